"""The walk: every surface, as the owner and as two people, sees exactly its reach (issue 52,
"Tests"; docs/contributing.md: who sees what, one place).

One real server holds a household: the owner's private folder (`notes/vault`), Ann's home
and Bob's home, and `notes/Family`, shared with Ann for reading and with Bob for writing.
Each folder holds a note (its own word, the shared word `marmalade`, its own #tag and the
shared #jam, a task, a link to the family note), a version, a note in the trash and a
picture. Each principal then walks each surface of SURFACES, a table: a surface is a
function giving back the folders ("regions") whose paths, words or tags showed anywhere in
what it answered (a path, a snippet, a title, a tag, a task, a file name), and the walk
asserts that this is exactly the principal's reach (or, for answers a score may cut, within
it). A new surface adds a row.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import urllib.error
import urllib.parse
import urllib.request
import zipfile

import pytest

from conftest import API, KEY, running, wait_for
from standins import EmbedStandIn, embed_env
from test_http_dav import RCLONE, rclone_env
from test_http_mcp import sdk_session

pytestmark = [pytest.mark.real_server, pytest.mark.slow, pytest.mark.xdist_group("people-walk")]

# region -> its folder, its own word
FOLDERS = {"owner": "vault", "Ann": "Ann", "Bob": "Bob", "Family": "Family"}
WORDS = {"owner": "zanzibar", "Ann": "quokka", "Bob": "ocelot", "Family": "marmot"}
NOTES = {r: f"notes/{f}/{f[0].lower()}1.md" for r, f in FOLDERS.items()}  # (no word in a name)
REACH = {
    "owner": {"owner", "Ann", "Bob", "Family"},
    "Ann": {"Ann", "Family"},
    "Bob": {"Bob", "Family"},
}


def regions_in(text: str) -> set:
    """The regions whose folder (under notes/ or attachments/, plain or URL-encoded) or own
    word shows anywhere in text."""
    low = text.lower()
    found = set()
    for region, folder in FOLDERS.items():
        marks = (f"notes/{folder}/", f"attachments/{folder}/", f"notes%2f{folder}%2f".lower())
        if WORDS[region] in low or any(m.lower() in low for m in marks):
            found.add(region)
    return found


def note_text(region: str) -> str:
    word = WORDS[region]
    link = "" if region == "Family" else "\n\nSee [[f1]] for the family's."
    peek = "\n\nAnd [[v1]]." if region == "Ann" else ""  # a link she cannot follow
    return (
        f"# Note {word}\n\nmarmalade {word} jam for the garden party. #{word} #jam\n\n"
        f"- [ ] task {word} 📅 2026-12-05{link}{peek}\n"
    )


class Walk:
    """The household on a real server: keys by principal, and requests as each."""

    def __init__(self, server, keys: dict, tokens: dict, feeds: dict, tmp):
        self.server, self.keys, self.tokens, self.feeds, self.tmp = (
            server,
            keys,
            tokens,
            feeds,
            tmp,
        )

    def get(self, who: str, path: str) -> tuple:
        """(status, bytes) of a GET as `who`."""
        req = urllib.request.Request(self.server.url + path, headers={KEY: self.keys[who]})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def json(self, who: str, path: str) -> dict:
        status, body = self.get(who, path)
        assert status == 200, (who, path, status, body[:300])
        return json.loads(body)["data"]

    def call(self, who: str, method: str, path: str, body=None) -> tuple:
        return self.server.request(method, path, body, {KEY: self.keys[who]})


@pytest.fixture(scope="module")
def walk(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("walk")
    meaning = EmbedStandIn()
    with contextlib.ExitStack() as stack:
        stack.callback(meaning.close)
        server = stack.enter_context(running(tmp / "root", env=embed_env(meaning)))
        keys = {"owner": server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]}
        owner = {KEY: keys["owner"]}
        people = {}
        for name in ("Ann", "Bob"):
            made = server.request("POST", f"{API}/people", {"name": name}, owner)[2]["data"]
            claim = {"secret": made["pairing"]["secret"], "deviceName": f"{name}'s laptop"}
            got = server.request("POST", f"{API}/auth/devices/claim", claim)[2]["data"]
            keys[name], people[name] = got["key"], made["person"]["id"]
        members = [
            {"person": people["Ann"], "scope": "read"},
            {"person": people["Bob"], "scope": "write"},
        ]
        for region, folder in FOLDERS.items():
            for path, text in (
                (NOTES[region], note_text(region)),
                (f"notes/{folder}/gone.md", f"# Gone\n\n{WORDS[region]} thrown away\n"),
            ):
                assert (
                    server.request("POST", f"{API}/notes", {"path": path, "content": text}, owner)[
                        0
                    ]
                    == 201
                )
            gone = urllib.parse.quote(f"notes/{folder}/gone.md", safe="")
            assert server.request("DELETE", f"{API}/notes/{gone}", None, owner)[0] == 200
            again = {"content": note_text(region) + "\nEdited once.\n"}
            quoted = urllib.parse.quote(NOTES[region], safe="")
            assert server.request("PUT", f"{API}/notes/{quoted}", again, owner)[0] == 200
            pic = urllib.request.Request(
                f"{server.url}{API}/attachments/"
                + urllib.parse.quote(f"attachments/{folder}/{WORDS[region]}.png", safe=""),
                b"\x89PNG\r\n\x1a\n" + WORDS[region].encode(),
                {**owner, "Content-Type": "application/octet-stream"},
                method="PUT",
            )
            with urllib.request.urlopen(pic, timeout=30) as resp:
                assert resp.status == 201
        url = f"{API}/folders/notes%2FFamily/members"
        assert server.request("PUT", url, {"members": members}, owner)[0] == 200
        tokens, feeds = {}, {}
        for who in REACH:  # a share link of each note it reads, and a calendar feed
            tokens[who] = []
            for region in REACH[who]:
                status, _, made = server.request(
                    "POST", f"{API}/shares", {"path": NOTES[region]}, {KEY: keys[who]}
                )
                assert status == 201, made
                tokens[who].append(made["data"]["url"].rsplit("/", 1)[1])
            status, _, made = server.request(
                "POST", f"{API}/auth/feeds", {"name": f"{who}'s"}, {KEY: keys[who]}
            )
            assert status == 201, made
            feeds[who] = urllib.parse.urlsplit(made["data"]["url"]).path

        def embedded() -> bool:
            e = server.request("GET", f"{API}/system/info", None, owner)[2]["data"]["embeddings"]
            floor = "floor" not in e or (e["floor"] or {}).get("notes") == e["total"]
            return e["total"] == 4 and e["embedded"] == 4 and floor

        wait_for(embedded, timeout=60)
        yield Walk(server, keys, tokens, feeds, tmp)
        assert not any("Traceback" in line for line in server.lines)


# -- the surfaces: each gives back the regions that showed in what it answered ----------------


def listings(w: Walk, who: str) -> set:
    notes = w.json(who, f"{API}/notes?limit=1000")
    files = w.json(who, f"{API}/attachments?limit=1000")
    assert notes["total"] == len(REACH[who])
    assert files["total"] == len(REACH[who])
    return regions_in(json.dumps(notes)) | regions_in(json.dumps(files))


def tree(w: Walk, who: str) -> set:
    return regions_in(json.dumps(w.json(who, f"{API}/folders/tree")))


def reads(w: Walk, who: str) -> set:
    seen = set()
    for region, path in NOTES.items():
        status, body = w.get(who, f"{API}/notes/" + urllib.parse.quote(path, safe=""))
        assert status in (200, 404), (path, status)
        pic = f"attachments/{FOLDERS[region]}/{WORDS[region]}.png"
        got, raw = w.get(who, f"{API}/attachments/" + urllib.parse.quote(pic, safe=""))
        assert got == status, (pic, got)
        if status == 200:
            seen |= regions_in(body.decode()) | (
                {region} if WORDS[region].encode() in raw else set()
            )
        else:
            assert WORDS[region] not in body.decode()
    return seen


def search_mode(mode: str, exact: bool):
    def surface(w: Walk, who: str) -> set:
        found = w.json(who, f"{API}/search?q=marmalade+jam&mode={mode}&limit=50")
        assert found["mode"] == mode, found
        assert found["results"], found
        if exact:
            assert found["total"] == len(REACH[who]), found
        counted = found["embeddings"]  # the vectors counted are the reach's too
        assert (counted["embedded"], counted["total"]) == (len(REACH[who]),) * 2, counted
        return regions_in(json.dumps(found))

    surface.__name__ = f"search_{mode}"
    return surface


def related(w: Walk, who: str) -> set:
    seen = set()
    for path in NOTES.values():
        status, body = w.get(who, f"{API}/notes/{urllib.parse.quote(path, safe='')}/related")
        assert status in (200, 404), (path, status)
        if status == 200:
            seen |= regions_in(body.decode())
    return seen


def changes(w: Walk, who: str) -> set:
    page = w.json(who, f"{API}/changes?since=0&limit=1000")
    assert page["changes"]
    return regions_in(json.dumps(page))


def history(w: Walk, who: str) -> set:
    seen = set()
    for path in NOTES.values():
        quoted = urllib.parse.quote(path, safe="")
        status, body = w.get(who, f"{API}/notes/{quoted}/versions")
        assert status in (200, 404), (path, status)
        if status == 200:
            versions = json.loads(body)["data"]["versions"]
            assert versions
            got, old = w.get(who, f"{API}/notes/{quoted}/versions/{versions[0]['id']}")
            assert got == 200
            seen |= regions_in(body.decode()) | regions_in(old.decode())
    return seen


def trash(w: Walk, who: str) -> set:
    items = w.json(who, f"{API}/trash")
    assert items["total"] == len(REACH[who])
    return regions_in(json.dumps(items))


def export(w: Walk, who: str) -> set:
    status, body = w.get(who, f"{API}/export.zip")
    assert status == 200
    names = zipfile.ZipFile(io.BytesIO(body)).namelist()
    return regions_in("\n".join(names))


def backlinks(w: Walk, who: str) -> set:
    seen = set()
    for path in NOTES.values():
        status, body = w.get(who, f"{API}/plugins/backlinks/{urllib.parse.quote(path, safe='')}")
        assert status in (200, 404), (path, status)
        if status == 200:
            seen |= regions_in(body.decode())
    return seen


def tags(w: Walk, who: str) -> set:
    listed = w.json(who, f"{API}/plugins/tags")
    jam = next(t for t in listed["tags"] if t["tag"] == "jam")
    assert jam["count"] == len(REACH[who])  # a count is a fact about unreached notes too
    notes = w.json(who, f"{API}/plugins/tags/jam")
    for word in WORDS.values():
        status, _ = w.get(who, f"{API}/plugins/tags/{word}")
        assert status in (200, 404)
    return regions_in(json.dumps(listed)) | regions_in(json.dumps(notes))


def share_links(w: Walk, who: str) -> set:
    listed = w.json(who, f"{API}/shares")
    seen = regions_in(json.dumps(listed))
    for region, path in NOTES.items():  # one for a note it cannot read: as if none were there
        if region not in REACH[who]:
            status, _, answer = w.call(who, "POST", f"{API}/shares", {"path": path})
            assert status == 404, answer
    for token in w.tokens[who]:  # what its links open (anyone may)
        with urllib.request.urlopen(f"{w.server.url}{API}/shared/{token}", timeout=30) as resp:
            seen |= regions_in(resp.read().decode())
    return seen


def feeds(w: Walk, who: str) -> set:
    listed = w.json(who, f"{API}/auth/feeds")["feeds"]
    assert len(listed) == (3 if who == "owner" else 1)  # the owner lists everyone's
    with urllib.request.urlopen(w.server.url + w.feeds[who], timeout=30) as resp:
        return regions_in(resp.read().decode())


def webdav_rclone(w: Walk, who: str) -> set:
    if not RCLONE:
        pytest.skip("no rclone on this machine (Debian: apt install rclone)")
    env = rclone_env(f"{w.server.url}/dav/", w.keys[who])
    listed = subprocess.run(
        [RCLONE, "lsf", "-R", ":webdav:"], capture_output=True, text=True, env=env, timeout=120
    )
    assert listed.returncode == 0, listed.stderr[-2000:]
    local = w.tmp / f"dav-{who}"
    copied = subprocess.run(
        [RCLONE, "copy", ":webdav:notes", str(local)], capture_output=True, env=env, timeout=120
    )
    assert copied.returncode == 0, copied.stderr[-2000:]
    texts = "\n".join(p.read_text() for p in local.rglob("*.md"))
    return regions_in("\n".join(f"{line}/" for line in listed.stdout.split())) | regions_in(texts)


def caldav_library(w: Walk, who: str) -> set:
    caldav = pytest.importorskip("caldav")
    with caldav.DAVClient(
        url=f"{w.server.url}/.well-known/caldav", username=who, password=w.keys[who]
    ) as client:
        lists = {c.get_display_name(): c for c in client.principal().calendars()}
        every = lists.pop("All tasks")
        summaries = [str(t.icalendar_component["SUMMARY"]) for t in every.todos()]
        assert len(summaries) == len(REACH[who])
        return regions_in("\n".join(summaries)) | {r for r, f in FOLDERS.items() if f in lists}


def mcp_sdk(w: Walk, who: str) -> set:
    async def steps(session) -> list:
        texts = []
        calls = [
            ("search_notes", {"query": "marmalade"}),
            ("search", {"query": "marmalade"}),
            ("list_folder", {"path": "notes", "depth": 3}),
            ("list_tags", {}),
            ("recent_changes", {"limit": 100}),
        ]
        calls += [("read_note", {"path": p}) for p in NOTES.values()]
        calls += [("fetch", {"id": p}) for p in NOTES.values()]
        calls += [("related_notes", {"path": p}) for p in NOTES.values()]
        for name, arguments in calls:
            got = await session.call_tool(name, arguments)
            if not got.is_error:
                texts.append(json.dumps(got.structured_content) + got.content[0].text)
        return texts

    headers = {"Authorization": f"Bearer {w.keys[who]}"}
    texts = sdk_session(w.server.url + f"{API}/mcp", headers, "auto", steps)
    return regions_in("\n".join(texts))


# (name, surface, "exact": it shows every reached folder | "within": a score may cut some)
SURFACES = [
    ("listings", listings, "exact"),
    ("tree", tree, "exact"),
    ("reads", reads, "exact"),
    ("search", search_mode("keyword", True), "exact"),
    ("search-semantic", search_mode("semantic", False), "within"),
    ("search-hybrid", search_mode("hybrid", True), "exact"),
    ("related", related, "exact"),
    ("changes", changes, "exact"),
    ("history", history, "exact"),
    ("trash", trash, "exact"),
    ("export", export, "exact"),
    ("backlinks", backlinks, "exact"),
    ("tags", tags, "exact"),
    ("share-links", share_links, "exact"),
    ("feeds", feeds, "exact"),
    ("webdav-rclone", webdav_rclone, "exact"),
    ("caldav-library", caldav_library, "exact"),
    ("mcp-sdk", mcp_sdk, "exact"),
]


@pytest.mark.parametrize(
    ("surface", "how"), [s[1:] for s in SURFACES], ids=[s[0] for s in SURFACES]
)
def test_every_surface_shows_each_principal_exactly_their_reach(walk, surface, how):
    wrong = {}
    for who, reach in REACH.items():
        seen = surface(walk, who)
        if seen - reach or (how == "exact" and seen != reach):
            wrong[who] = {"saw": sorted(seen), "reaches": sorted(reach)}
    assert not wrong, wrong


def test_the_table_walks_every_surface_the_issue_names():
    named = {
        "listings", "tree", "reads", "search", "search-semantic", "search-hybrid", "related",
        "changes", "history", "trash", "export", "backlinks", "tags", "share-links", "feeds",
        "webdav-rclone", "caldav-library", "mcp-sdk",
    }  # fmt: skip
    assert {s[0] for s in SURFACES} >= named
