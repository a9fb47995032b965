"""People on one server: search by words and by meaning, related notes, the agent, MCP and
a person's OAuth connector see a person's reach and nothing else (issue 52)."""

from __future__ import annotations

import dataclasses
import json
import urllib.parse

import pytest
import webtest

from conftest import (
    API,
    CALLBACK,
    assert_error,
    call_tool,
    data,
    mcp_url,
    note_url,
    ok_tool,
    owner_headers,
    paths_in,
    pkce_pair,
    put_note,
    register_client,
    rpc,
    running,
    search,
    token_call,
    tool_refused,
    wait_for,
    with_key,
)
from standins import ToolModel, embed_env, last_tool_results
from test_people import device_of

# The household: the owner's own notes, Ann's home, Bob's home (his Trips shared with Ann
# for writing) and Family (the owner's, shared with Ann for reading and Bob for writing).
HOUSE = {
    "notes/owner/diary.md": "# Diary\n\nzucchini quokka: the owner's secret plans #veg\n",
    "notes/owner/garage.md": "# Fixing the automobile\n\nThe mechanic changed the brake pads.\n",
    "notes/top.md": "# Top\n\nzucchini at the top, quokka too\n",
    "notes/Familyx/next.md": "# Next door\n\nzucchini neighbour quokka\n",
    "notes/Bob/diary.md": "# Bob's diary\n\nzucchini bob private quokka #veg\n",
    "notes/Bob/Trips/rome.md": "# Rome\n\nzucchini flowers in rome\n",
    "notes/Ann/garden.md": "# Garden\n\nzucchini and tomatoes in the garden #veg\n",
    "notes/Ann/car.md": "# Company vehicle\n\nMend the dent before the inspection.\n",
    "notes/Family/shopping.md": "# Shopping\n\nzucchini, bread and milk #veg\n",
    "notes/Family/sub/plans.md": "# Plans\n\nholiday with zucchini soup\n",
}
ANN_FOLDERS = ("notes/Ann", "notes/Bob/Trips", "notes/Family")
ANN_SEES = tuple(f + "/" for f in ANN_FOLDERS)
UNREACHED_WORDS = ("quokka", "secret", "neighbour", "private", "mechanic", "brake", "Diary")
ANN_NOTES = sorted(p for p in HOUSE if p.startswith(ANN_SEES))


def ann_sees(path: str) -> bool:
    return path.startswith(ANN_SEES)


def assert_nothing_unreached(answer) -> None:
    """No path outside Ann's reach and no word only unreached notes hold, anywhere in an
    answer (keys, values, snippets, text contents)."""
    text = json.dumps(answer, ensure_ascii=False)
    outside = [p for p in paths_in(answer) if not ann_sees(p)]
    assert outside == [], outside
    for word in UNREACHED_WORDS:
        assert word not in text, (word, text[:2000])


class House:
    """The owner's client and Ann's and Bob's, on one app (make_app's env)."""

    def __init__(self, anon):
        self.anon = anon
        self.owner = with_key(anon)
        self.ann, self.as_ann = device_of(self.owner, anon, "Ann")
        self.bob, self.as_bob = device_of(self.owner, anon, "Bob")
        for path, text in HOUSE.items():
            put_note(self.owner, path, text)
        self.share("notes/Family", {self.ann["id"]: "read", self.bob["id"]: "write"})
        body = {"members": [{"person": self.ann["id"], "scope": "write"}]}
        self.as_bob.put_json(f"{API}/folders/notes%2FBob%2FTrips/members", body)

    def share(self, folder: str, members: dict) -> None:
        body = {"members": [{"person": p, "scope": s} for p, s in members.items()]}
        url = f"{API}/folders/{urllib.parse.quote(folder, safe='')}/members"
        self.owner.put_json(url, body)


@pytest.fixture
def house(make_app):
    return House(make_app(SERVICE_MCP_WRITE="true"))


def found(client, q: str, **params) -> list:
    return [r["path"] for r in search(client, q, limit=100, **params)["results"]]


# -- searching by words ---------------------------------------------------------------------


class TestWords:
    QUERIES = (
        "zucchini",
        "zucch*",
        "zucchini OR quokka",
        "quokka",
        "secret",
        '"zucchini quokka"',
        "zucchini -bread",
        "zucchini garden",
        "Diary",
    )

    @pytest.mark.parametrize("q", QUERIES)
    @pytest.mark.slow
    def test_every_query_finds_the_reach_only_in_hits_counts_and_snippets(self, house, q):
        mine = search(house.as_ann, q, limit=100)
        every = search(house.owner, q, limit=100)
        assert_nothing_unreached({k: mine[k] for k in ("results", "total")})
        want = sorted(r["path"] for r in every["results"] if ann_sees(r["path"]))
        assert sorted(r["path"] for r in mine["results"]) == want
        assert mine["total"] == len(want)

    def test_a_folder_narrows_within_the_reach(self, house):
        ann = house.as_ann
        assert sorted(found(ann, "zucchini")) == [
            "notes/Ann/garden.md",
            "notes/Bob/Trips/rome.md",
            "notes/Family/shopping.md",
            "notes/Family/sub/plans.md",
        ]
        assert sorted(found(ann, "zucchini", folder="notes/Family")) == [
            "notes/Family/shopping.md",
            "notes/Family/sub/plans.md",
        ]
        assert found(ann, "zucchini", folder="notes/Family/sub") == ["notes/Family/sub/plans.md"]
        # Above a reached folder: the way down only (Bob's home shows his shared Trips).
        assert found(ann, "zucchini", folder="notes/Bob") == ["notes/Bob/Trips/rome.md"]
        assert sorted(found(ann, "zucchini", folder="notes")) == sorted(found(ann, "zucchini"))

    @pytest.mark.parametrize(
        "folder",
        [
            "notes/owner",
            "notes/Familyx",
            "notes/Fam",
            "notes/Family/../owner",
            "notes/Family/..",
            "notes/Bob/../owner",
            "notes/./owner",
            "notes/Bob/Tripsx",
            "attachments",
            "../etc",
            "/etc",
            "notes/Family\x00",
            "notes/Ann\u202e",
            "n" * 5000,
        ],
    )
    @pytest.mark.slow
    def test_a_folder_outside_the_reach_is_not_there(self, house, folder):
        resp = search(house.as_ann, "zucchini", status="*", folder=folder)
        assert resp.status_int in (400, 404), (folder, resp.status)
        assert resp.json["error"]["code"] in ("NOT_FOUND", "VALIDATION_ERROR")
        assert_nothing_unreached(assert_error(resp, resp.status_int, resp.json["error"]["code"]))

    @pytest.mark.parametrize(
        ("params", "code"),
        [
            ({}, "VALIDATION_ERROR"),
            ({"q": ""}, "VALIDATION_ERROR"),
            ({"q": "x" * 513}, "VALIDATION_ERROR"),
            ({"q": "zucchini", "limit": "many"}, "VALIDATION_ERROR"),
            ({"q": "zucchini", "limit": "0"}, "VALIDATION_ERROR"),
            ({"q": "zucchini", "limit": "101"}, "VALIDATION_ERROR"),
            ({"q": "zucchini", "offset": "-1"}, "VALIDATION_ERROR"),
            ({"q": "zucchini", "mode": "psychic"}, "VALIDATION_ERROR"),
            ({"q": '"unclosed'}, "VALIDATION_ERROR"),
            ({"q": "-zucchini"}, "VALIDATION_ERROR"),
        ],
    )
    @pytest.mark.slow
    def test_bad_input_is_a_clear_4xx(self, house, params, code):
        query = urllib.parse.urlencode(params)
        resp = house.as_ann.get(f"{API}/search?{query}", status="*")
        assert_nothing_unreached(assert_error(resp, 400, code))

    def test_the_scores_are_the_reachs_own(self, house):
        """The owner's notes outside the reach move nothing of the person's answer, not
        even a score (BM25's statistics are the reach's: a count of unreached notes would
        show in them)."""
        queries = ("zucchini", "zucchini garden", "zucch*", '"zucchini flowers"', "rome OR soup")
        before = [search(house.as_ann, q) for q in queries]
        for i in range(40):
            put_note(house.owner, f"notes/owner/more/{i}.md", f"zucchini garden flowers {i}")
        after = [search(house.as_ann, q) for q in queries]
        for a, b in zip(before, after):
            assert (a["total"], a["results"]) == (b["total"], b["results"])
        assert search(house.owner, "zucchini")["total"] == 8 + 40

    def test_a_share_joins_and_leaves_the_search_at_once(self, house):
        house.share("notes/Family", {house.bob["id"]: "write"})  # Ann is no longer a member
        assert not any(p.startswith("notes/Family/") for p in found(house.as_ann, "zucchini"))
        search(house.as_ann, "zucchini", status=404, folder="notes/Family")
        house.share("notes/owner", {house.ann["id"]: "read"})  # the owner shares the diary
        assert "notes/owner/diary.md" in found(house.as_ann, "quokka")
        assert found(house.as_ann, "quokka", folder="notes/owner") == ["notes/owner/diary.md"]

    def test_a_person_who_reaches_nothing_else_finds_their_own_notes(self, make_app):
        anon = make_app()
        owner = with_key(anon)
        put_note(owner, "notes/owner/diary.md", "zucchini secret")
        _, as_eve = device_of(owner, anon, "Eve")
        assert search(as_eve, "zucchini")["total"] == 0
        put_note(as_eve, "notes/Eve/a.md", "zucchini mine")
        answer = search(as_eve, "zucchini")
        assert (answer["total"], [r["path"] for r in answer["results"]]) == (1, ["notes/Eve/a.md"])
        assert "secret" not in json.dumps(answer)

    def test_a_folder_grant_of_a_person_searches_within_that_folder_of_the_reach(self, house):
        key = data(
            house.as_ann.post_json(
                f"{API}/auth/keys", {"name": "fam", "scope": "read", "folder": "notes/Family"}
            )
        )["key"]
        fam = with_key(house.anon, key)
        assert sorted(found(fam, "zucchini")) == [
            "notes/Family/shopping.md",
            "notes/Family/sub/plans.md",
        ]
        search(fam, "zucchini", status=404, folder="notes/Ann")

    def test_tags_count_the_reach_only(self, house):
        tags = {t["tag"]: t["count"] for t in data(house.as_ann.get(f"{API}/plugins/tags"))["tags"]}
        assert tags["veg"] == 2  # Ann's garden and Family's shopping; not the diaries
        assert data(house.owner.get(f"{API}/plugins/tags/veg"))["notes"].__len__() == 4


# -- searching by meaning ---------------------------------------------------------------------


@pytest.fixture
def meaning_house(make_app, embed_endpoint):
    house = House(make_app(**embed_env(embed_endpoint), SERVICE_MCP_WRITE="true"))
    put_note(house.owner, "notes/owner/copy.md", HOUSE["notes/Ann/garden.md"])  # its twin

    def ready():
        info = data(house.owner.get(f"{API}/system/info"))["embeddings"]
        floor = (info.get("floor") or {}).get("notes")
        return info["total"] and info["embedded"] == info["total"] == floor and info

    wait_for(ready, timeout=30)
    return house


class TestMeaning:
    @pytest.mark.parametrize("mode", ["semantic", "hybrid"])
    @pytest.mark.slow
    def test_meaning_finds_the_reach_only(self, meaning_house, mode):
        ann = meaning_house.as_ann
        for q in ("car repair", "automobile mechanic", "zucchini", "quokka", "garden tomatoes"):
            answer = search(ann, q, limit=100, mode=mode)
            assert answer["mode"] == mode, answer
            assert_nothing_unreached({k: answer[k] for k in ("results", "total")})
            assert answer["total"] == len(answer["results"])
        hits = [r["path"] for r in search(ann, "car repair", mode="semantic")["results"]]
        assert hits[0] == "notes/Ann/car.md"  # the owner's garage note is nearer, and unseen
        owner = [
            r["path"] for r in search(meaning_house.owner, "car repair", mode="semantic")["results"]
        ]
        assert "notes/owner/garage.md" in owner

    def test_a_folder_narrows_meaning_too(self, meaning_house):
        ann = meaning_house.as_ann
        for mode in ("semantic", "hybrid"):
            hits = found(ann, "zucchini holiday", mode=mode, folder="notes/Family")
            assert hits
            assert all(p.startswith("notes/Family/") for p in hits)
            search(ann, "zucchini", status=404, mode=mode, folder="notes/owner")

    def test_the_embedding_counts_are_the_reachs(self, meaning_house):
        meaning_house.as_ann.get(f"{API}/system/info", status=403)  # the server's counts
        mine = search(meaning_house.as_ann, "zucchini")["embeddings"]
        every = search(meaning_house.owner, "zucchini")["embeddings"]
        assert (mine["embedded"], mine["total"]) == (len(ANN_NOTES), len(ANN_NOTES))
        assert every["total"] == len(HOUSE) + 1
        for_bob = search(meaning_house.as_bob, "zucchini")["embeddings"]
        bob_notes = [p for p in HOUSE if p.startswith(("notes/Bob/", "notes/Family/"))]
        assert for_bob["total"] == len(bob_notes)

    def test_related_notes_never_name_an_unreached_note(self, meaning_house):
        ann = meaning_house.as_ann
        url = f"{note_url('notes/Ann/garden.md')}/related"
        near = data(ann.get(url))["results"]
        assert "notes/owner/copy.md" not in [r["path"] for r in near]
        assert_nothing_unreached(near)
        mine = data(meaning_house.owner.get(url))["results"]
        assert mine[0]["path"] == "notes/owner/copy.md"  # the twin is the nearest of all
        ann.get(f"{note_url('notes/owner/copy.md')}/related", status=404)
        ann.get(f"{note_url('notes/Bob/diary.md')}/related", status=404)
        shared = data(ann.get(f"{note_url('notes/Family/shopping.md')}/related"))["results"]
        assert_nothing_unreached(shared)
        resp = ann.get(f"{note_url('notes/Ann/garden.md')}/related?limit=x", status=400)
        assert_error(resp, 400, "VALIDATION_ERROR")

    def test_a_note_moved_into_or_out_of_the_reach_follows_at_once(self, meaning_house):
        """The semantic pass keeps the records of a reach's notes between searches: a move
        (nothing is embedded again) changes what it scans at once."""
        owner, ann = meaning_house.owner, meaning_house.as_ann
        url = f"{note_url('notes/Ann/garden.md')}/related"
        assert "notes/owner/copy.md" not in [r["path"] for r in data(ann.get(url))["results"]]
        body = {"path": "notes/Family/copy.md"}
        owner.patch_json(f"{note_url('notes/owner/copy.md')}/move", body)
        assert data(ann.get(url))["results"][0]["path"] == "notes/Family/copy.md"
        assert "notes/Family/copy.md" in found(ann, "zucchini tomatoes", mode="semantic")
        owner.patch_json(f"{note_url('notes/Family/copy.md')}/move", {"path": "notes/x/copy.md"})
        near = data(ann.get(url))["results"]
        assert "notes/x/copy.md" not in [r["path"] for r in near]
        assert_nothing_unreached(near)
        assert "notes/x/copy.md" not in found(ann, "zucchini tomatoes", mode="semantic")

    def test_mcp_search_and_related_by_meaning_stay_in_the_reach(self, meaning_house):
        ann = meaning_house.as_ann
        for mode in ("semantic", "hybrid", "keyword"):
            got = ok_tool(ann, "search_notes", query="car repair zucchini", mode=mode)
            assert_nothing_unreached(got)
        near = ok_tool(ann, "related_notes", path="notes/Ann/garden.md")
        assert_nothing_unreached(near)
        tool_refused(ann, "related_notes", "NOT_FOUND", path="notes/owner/copy.md")


# -- the agent ---------------------------------------------------------------------------------


class TestAgent:
    def test_the_local_agent_quotes_the_reach_only(self, house):
        for question in ("zucchini?", "what about quokka", "the owner's secret plans"):
            answer = data(house.as_ann.post_json(f"{API}/agent/chat", {"message": question}))
            answer["reply"] = answer["reply"].replace(question, "")  # (it may say it back)
            assert_nothing_unreached(answer)
            assert all(ann_sees(s["path"]) for s in answer["sources"])
        answer = data(house.as_ann.post_json(f"{API}/agent/chat", {"message": "zucchini"}))
        assert answer["sources"]
        body = {"message": "zucchini", "notePath": "notes/owner/diary.md"}
        house.as_ann.post_json(f"{API}/agent/chat", body, status=404)
        body = {"message": "zucchini", "notePath": "notes/Family/shopping.md"}
        assert data(house.as_ann.post_json(f"{API}/agent/chat", body))["sources"][0]["path"] == (
            "notes/Family/shopping.md"
        )

    def test_a_provider_naming_an_unreached_note_lists_no_such_source(self, house):
        """Whatever a provider (a plugin's, say) names as its sources, a note outside the
        asker's reach is never listed, not even by its path."""
        svc = house.anon.app.service
        local = svc.agent_providers["local"]
        named = ["notes/owner/diary.md", "notes/Family/shopping.md", "notes/Bob/diary.md"]
        svc.agent_providers["local"] = dataclasses.replace(
            local, answer=lambda svc, question, found: ("Here.", "m", named)
        )
        answer = data(house.as_ann.post_json(f"{API}/agent/chat", {"message": "zucchini"}))
        assert answer["sources"] == [{"path": "notes/Family/shopping.md", "title": "Shopping"}]
        every = data(house.owner.post_json(f"{API}/agent/chat", {"message": "zucchini"}))
        assert [s["path"] for s in every["sources"]] == named

    def test_the_model_sees_and_names_nothing_outside_the_reach(self, make_app):
        """A model in a tool loop that searches, reads an unreached note by its path and
        names it as a source: the tools answer as if it were not there, and the sources
        list none of it."""

        def snoop(messages):
            return [
                ("search_notes", {"query": "quokka"}),
                ("read_note", {"path": "notes/owner/diary.md"}),
                ("list_folder", {"path": "notes", "depth": 3}),
                ("search_notes", {"query": "zucchini", "folder": "notes/owner"}),
            ]

        model = ToolModel(snoop, lambda messages: "Done: see notes/owner/diary.md")
        try:
            env = {
                "SERVICE_AGENT_PROVIDER": "openai",
                "SERVICE_AGENT_BASE_URL": model.url + "/v1",
                "SERVICE_AGENT_MODEL": "tool-llama",
            }
            house = House(make_app(**env))
            answer = data(house.as_ann.post_json(f"{API}/agent/chat", {"message": "zucchini"}))
            asked = [r["json"] for r in model.requests if r["path"].endswith("/chat/completions")]
            results = last_tool_results(asked[-1]["messages"])
            assert results[0] == "No note matches."
            assert "NOT_FOUND" in results[1]
            assert "NOT_FOUND" in results[3]
            assert_nothing_unreached([results[0], results[2]])
            assert not any(w in results[1] + results[3] for w in UNREACHED_WORDS)  # (the path
            # asked for is said back, nothing of what is there)
            context = asked[0]["messages"][0]["content"]
            assert_nothing_unreached(context)
            assert all(ann_sees(s["path"]) for s in answer["sources"])
        finally:
            model.close()


# -- MCP ---------------------------------------------------------------------------------------


class TestMcp:
    def test_the_read_tools_see_the_reach_only(self, house):
        ann = house.as_ann
        hits = ok_tool(ann, "search_notes", query="zucchini", limit=50)
        assert sorted(r["path"] for r in hits["results"]) == sorted(
            p for p in ANN_NOTES if "zucchini" in HOUSE[p]
        )
        assert hits["total"] == 4
        assert_nothing_unreached(call_tool(ann, "search_notes", query="zucchini OR quokka"))
        narrowed = ok_tool(ann, "search_notes", query="zucchini", folder="notes/Family/sub")
        assert [r["path"] for r in narrowed["results"]] == ["notes/Family/sub/plans.md"]
        for folder in ("notes/owner", "notes/Familyx", "notes/Family/../owner"):
            tool_refused(ann, "search_notes", "NOT_FOUND", query="zucchini", folder=folder)
        assert ok_tool(ann, "read_note", path="notes/Family/shopping.md")["title"] == "Shopping"
        for path in ("notes/owner/diary.md", "notes/Bob/diary.md", "notes/top.md"):
            message = tool_refused(ann, "read_note", "NOT_FOUND", path=path)
            assert "quokka" not in message
            tool_refused(ann, "fetch", "NOT_FOUND", id=path)
        tree = ok_tool(ann, "list_folder", path="notes", depth=3)
        assert_nothing_unreached(tree)
        assert {c["name"] for c in tree["children"]} == {"Ann", "Bob", "Family"}
        bob = next(c for c in tree["children"] if c["name"] == "Bob")
        assert [c["name"] for c in bob["children"]] == ["Trips"]  # the way down only
        tool_refused(ann, "list_folder", "NOT_FOUND", path="notes/owner")
        changes = ok_tool(ann, "recent_changes", limit=100)
        assert sorted(c["path"] for c in changes["changes"]) == ANN_NOTES
        assert changes["total"] == len(ANN_NOTES)
        tags = ok_tool(ann, "list_tags")
        assert {t["tag"]: t["count"] for t in tags["tags"]} == {"veg": 2}
        found_ids = ok_tool(ann, "search", query="zucchini quokka")
        assert found_ids["results"] == []
        found_ids = ok_tool(ann, "search", query="zucchini")
        assert sorted(r["id"] for r in found_ids["results"]) == sorted(
            p for p in ANN_NOTES if "zucchini" in HOUSE[p]
        )
        assert ok_tool(ann, "fetch", id="notes/Bob/Trips/rome.md")["title"] == "Rome"
        assert ok_tool(ann, "related_notes", path="notes/Ann/garden.md")["results"] == []

    def test_writes_go_where_the_reach_allows_writing(self, house):
        ann = house.as_ann
        tools = {t["name"] for t in rpc(ann, "tools/list")["result"]["tools"]}
        assert {"create_note", "update_note", "move_note", "delete_note"} <= tools
        ok_tool(ann, "create_note", path="notes/Ann/new.md", content="mine")
        ok_tool(ann, "create_note", path="notes/Bob/Trips/paris.md", content="shared for writing")
        read_share = "notes/Family/shopping.md"
        etag = ok_tool(ann, "read_note", path=read_share)["etag"]
        refusals = [
            ("create_note", {"path": "notes/Family/mine.md", "content": "x"}),
            ("append_to_note", {"path": read_share, "text": "eggs"}),
            ("replace_in_note", {"path": read_share, "old": "bread", "new": "cake"}),
            ("update_note", {"path": read_share, "content": "gone", "etag": etag}),
            ("delete_note", {"path": read_share}),
            ("move_note", {"path": read_share, "newPath": "notes/Ann/s.md", "etag": etag}),
        ]
        for name, arguments in refusals:
            message = tool_refused(ann, name, "FORBIDDEN", **arguments)
            assert "read" in message
        mine = ok_tool(ann, "read_note", path="notes/Ann/new.md")
        message = tool_refused(
            ann,
            "move_note",
            "FORBIDDEN",
            path="notes/Ann/new.md",
            newPath="notes/Family/new.md",
            etag=mine["etag"],
        )
        assert "notes/Family/new.md" in message
        for name, arguments in (
            ("create_note", {"path": "notes/owner/x.md", "content": "x"}),
            ("append_to_note", {"path": "notes/owner/diary.md", "text": "x"}),
            ("delete_note", {"path": "notes/Bob/diary.md"}),
            (
                "move_note",
                {"path": "notes/Ann/new.md", "newPath": "notes/owner/x.md", "etag": mine["etag"]},
            ),
        ):
            tool_refused(ann, name, "NOT_FOUND", **arguments)
        assert data(house.owner.get(note_url(read_share)))["content"] == HOUSE[read_share]
        house.owner.get(note_url("notes/Family/new.md"), status=404)
        house.owner.get(note_url("notes/owner/x.md"), status=404)
        trip = ok_tool(ann, "read_note", path="notes/Bob/Trips/paris.md")
        moved = ok_tool(
            ann,
            "move_note",
            path="notes/Bob/Trips/paris.md",
            newPath="notes/Ann/paris.md",
            etag=trip["etag"],
        )
        assert moved["path"] == "notes/Ann/paris.md"
        ok_tool(ann, "append_to_note", path="notes/Ann/paris.md", text="- louvre")

    def test_bob_writes_in_family_where_ann_only_reads(self, house):
        ok_tool(house.as_bob, "append_to_note", path="notes/Family/shopping.md", text="- eggs")
        tool_refused(
            house.as_ann,
            "append_to_note",
            "FORBIDDEN",
            path="notes/Family/shopping.md",
            text="- jam",
        )

    @pytest.mark.slow
    def test_a_person_without_mcp_writes_or_with_a_read_key_gets_no_write_tool(
        self, make_app, tmp_path
    ):
        house = House(make_app(tmp_path / "off"))
        tools = {t["name"] for t in rpc(house.as_ann, "tools/list")["result"]["tools"]}
        assert "create_note" not in tools
        answer = rpc(
            house.as_ann,
            "tools/call",
            {"name": "create_note", "arguments": {"path": "notes/Ann/x.md", "content": "x"}},
        )
        assert "SERVICE_MCP_WRITE" in answer["error"]["message"]
        writes = House(make_app(tmp_path / "on", SERVICE_MCP_WRITE="true"))
        reader = data(writes.as_ann.post_json(f"{API}/auth/keys", {"name": "r", "scope": "read"}))
        as_reader = with_key(writes.anon, reader["key"])
        tools = {t["name"] for t in rpc(as_reader, "tools/list")["result"]["tools"]}
        assert "search_notes" in tools
        assert not tools & {"create_note", "append_to_note", "delete_note"}


# -- OAuth: a person's connector ----------------------------------------------------------------


def approve_as(client, cid: str, scope: str = "notes:read", status: int = 200, **extra):
    """POST /oauth/approve as `client` (as the consent page does); (code, verifier) or the
    refusal."""
    verifier, challenge = pkce_pair()
    body = {
        "clientId": cid,
        "redirectUri": CALLBACK,
        "state": "st8",
        "codeChallenge": challenge,
        "scope": scope,
        "resource": mcp_url(client),
        **extra,
    }
    resp = client.post_json(f"{API}/oauth/approve", body, status=status)
    if status != 200:
        return resp
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(data(resp)["redirect"]).query)
    return query["code"][0], verifier


def redeem(anon, cid: str, code: str, verifier: str) -> dict:
    return token_call(
        anon,
        200,
        grant_type="authorization_code",
        code=code,
        client_id=cid,
        redirect_uri=CALLBACK,
        code_verifier=verifier,
        resource=mcp_url(anon),
    ).json


def bearer(anon, token: str) -> webtest.TestApp:
    return webtest.TestApp(anon.app, extra_environ={"HTTP_AUTHORIZATION": f"Bearer {token}"})


class TestConnector:
    def test_a_persons_admin_device_approves_a_connector_that_sees_their_reach(self, house):
        anon = house.anon
        cid = register_client(anon)["client_id"]
        code, verifier = approve_as(house.as_ann, cid)
        tokens = redeem(anon, cid, code, verifier)
        mine = data(house.as_ann.get(f"{API}/auth/keys"))["keys"]
        grant = next(g for g in mine if g["kind"] == "oauth")
        assert grant["person"] == house.ann["id"]
        assert grant["name"] == "Pocket assistant"
        everyone = data(house.owner.get(f"{API}/auth/keys"))["keys"]
        assert next(g for g in everyone if g["id"] == grant["id"])["person"] == house.ann["id"]
        assert grant["id"] not in {
            g["id"] for g in data(house.as_bob.get(f"{API}/auth/keys"))["keys"]
        }
        connector = bearer(anon, tokens["access_token"])
        hits = ok_tool(connector, "search_notes", query="zucchini OR quokka", limit=50)
        assert_nothing_unreached(hits)
        assert sorted(r["path"] for r in hits["results"]) == sorted(
            p for p in ANN_NOTES if "zucchini" in HOUSE[p]
        )
        tool_refused(connector, "read_note", "NOT_FOUND", path="notes/owner/diary.md")
        tool_refused(connector, "search_notes", "NOT_FOUND", query="x", folder="notes/owner")
        # the connector is Ann's: removing her ends it at once
        house.owner.delete(f"{API}/people/{house.ann['id']}")
        resp = rpc(connector, "tools/list", status=401)
        assert resp is None or "error" in json.dumps(resp)

    def test_a_connector_narrowed_to_a_folder_of_the_reach(self, house):
        anon = house.anon
        cid = register_client(anon)["client_id"]
        code, verifier = approve_as(house.as_ann, cid, folder="notes/Family")
        connector = bearer(anon, redeem(anon, cid, code, verifier)["access_token"])
        hits = ok_tool(connector, "search_notes", query="zucchini")
        assert sorted(r["path"] for r in hits["results"]) == [
            "notes/Family/shopping.md",
            "notes/Family/sub/plans.md",
        ]
        tool_refused(connector, "read_note", "NOT_FOUND", path="notes/Ann/garden.md")

    @pytest.mark.parametrize(
        "folder", ["notes/owner", "notes/Bob", "notes/Familyx", "notes/Family/../owner", "notes"]
    )
    @pytest.mark.slow
    def test_a_connector_is_never_given_a_folder_outside_the_reach(self, house, folder):
        cid = register_client(house.anon)["client_id"]
        resp = approve_as(house.as_ann, cid, folder=folder, status="*")
        if folder == "notes":  # the top: every note of the reach, as with no folder
            assert resp.status_int == 200
            return
        assert resp.status_int in (400, 404), resp.text
        assert_error(resp, resp.status_int, resp.json["error"]["code"])

    def test_writing_needs_a_write_share_even_for_a_write_connector(self, house):
        anon = house.anon
        cid = register_client(anon)["client_id"]
        code, verifier = approve_as(house.as_ann, cid, scope="notes:read notes:write")
        connector = bearer(anon, redeem(anon, cid, code, verifier)["access_token"])
        ok_tool(connector, "create_note", path="notes/Ann/from-ai.md", content="hello")
        tool_refused(connector, "create_note", "FORBIDDEN", path="notes/Family/ai.md", content="x")
        tool_refused(connector, "create_note", "NOT_FOUND", path="notes/owner/ai.md", content="x")

    def test_a_code_approved_by_a_person_removed_since_is_worth_nothing(self, house):
        anon = house.anon
        cid = register_client(anon)["client_id"]
        code, verifier = approve_as(house.as_ann, cid)
        house.owner.delete(f"{API}/people/{house.ann['id']}")
        resp = token_call(
            anon,
            "*",
            grant_type="authorization_code",
            code=code,
            client_id=cid,
            redirect_uri=CALLBACK,
            code_verifier=verifier,
            resource=mcp_url(anon),
        )
        assert resp.status_int in (400, 401)
        assert resp.json["error"] == "invalid_grant"
        assert not [
            g for g in data(house.owner.get(f"{API}/auth/keys"))["keys"] if g["kind"] == "oauth"
        ]

    def test_only_a_persons_admin_device_approves(self, house):
        cid = register_client(house.anon)["client_id"]
        writer = data(house.as_ann.post_json(f"{API}/auth/keys", {"name": "w", "scope": "write"}))
        resp = approve_as(with_key(house.anon, writer["key"]), cid, status=403)
        assert_error(resp, 403, "FORBIDDEN")
        resp = approve_as(webtest.TestApp(house.anon.app), cid, status=401)
        assert_error(resp, 401, "UNAUTHORIZED")

    @pytest.mark.parametrize(
        ("body", "status"),
        [
            (b"{", 400),
            (b"[1]", 400),
            (b'{"clientId": 7}', 400),
            (b'{"folder": ["notes/Ann"]}', 400),
            (b'{"x": "' + b"y" * 2_000_000 + b'"}', 413),
        ],
    )
    @pytest.mark.slow
    def test_a_bad_approval_is_a_clear_4xx(self, house, body, status):
        resp = house.as_ann.post(
            f"{API}/oauth/approve", body, {"Content-Type": "application/json"}, status="*"
        )
        assert resp.status_int == status
        assert_error(resp, status, resp.json["error"]["code"])

    def test_broken_json_rpc_from_a_person_is_a_json_rpc_error(self, house):
        headers = {"Content-Type": "application/json", "MCP-Protocol-Version": "2025-11-25"}
        resp = house.as_ann.post(f"{API}/mcp", b"{", headers, status="*")
        assert resp.json["error"]["code"] == -32700
        call = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "tools/call",
            "params": {"name": "read_note", "arguments": {"path": ["notes/owner"]}},
        }
        resp = house.as_ann.post(f"{API}/mcp", json.dumps(call), headers)
        result = resp.json["result"]
        assert result["isError"] is True
        assert "Traceback" not in resp.text


@pytest.mark.real_server
@pytest.mark.slow
class TestSdkConnector:
    """The official MCP SDK over a person's OAuth connector, against a real server: it
    registers, Ann's admin device approves on the consent page's API, and every tool it
    calls sees Ann's reach; a share taken away is gone from it at once."""

    def test_the_sdk_connects_as_a_person_and_sees_their_reach(self, tmp_path):
        from test_grants_oauth import sdk_oauth_session

        with running(tmp_path / "srv", env={"SERVICE_MCP_WRITE": "true"}) as server:
            setup = server.request("GET", f"{API}/system/setup")[2]["data"]
            owner = owner_headers(setup)

            def call(method, path, body=None, headers=owner):
                status, _, answer = server.request(method, path, body, headers)
                assert status < 300, (method, path, status, answer)
                return answer["data"]

            made = call("POST", f"{API}/people", {"name": "Ann"})
            claim = {"secret": made["pairing"]["secret"], "deviceName": "Ann's phone"}
            ann_key = call("POST", f"{API}/auth/devices/claim", claim, {})["key"]
            bob = call("POST", f"{API}/people", {"name": "Bob"})["person"]
            for path, text in HOUSE.items():
                call("POST", f"{API}/notes", {"path": path, "content": text})
            members = {
                "members": [
                    {"person": made["person"]["id"], "scope": "read"},
                    {"person": bob["id"], "scope": "write"},
                ]
            }
            call("PUT", f"{API}/folders/notes%2FFamily/members", members)

            async def steps(session, provider):
                tools = {t.name for t in (await session.list_tools()).tools}
                hits = await session.call_tool("search_notes", {"query": "zucchini OR quokka"})
                secret = await session.call_tool("read_note", {"path": "notes/owner/diary.md"})
                tree = await session.call_tool("list_folder", {"path": "notes", "depth": 3})
                write = await session.call_tool(
                    "create_note", {"path": "notes/Family/ai.md", "content": "x"}
                )
                mine = await session.call_tool(
                    "create_note", {"path": "notes/Ann/ai.md", "content": "from the SDK"}
                )
                call(
                    "PUT",
                    f"{API}/folders/notes%2FFamily/members",
                    {"members": [{"person": bob["id"], "scope": "write"}]},
                )
                after = await session.call_tool("search_notes", {"query": "zucchini"})
                return tools, hits, secret, tree, write, mine, after

            result, transcript, _ = sdk_oauth_session(
                f"{server.url}{API}/mcp", ann_key, steps, scope="notes:read notes:write"
            )
            tools, hits, secret, tree, write, mine, after = result
            (tmp_path / "sdk-person-transcript.txt").write_text("\n".join(transcript) + "\n")
            assert "create_note" in tools
            assert hits.is_error is False
            assert_nothing_unreached(hits.structured_content)
            assert sorted(r["path"] for r in hits.structured_content["results"]) == [
                "notes/Ann/garden.md",
                "notes/Family/shopping.md",
                "notes/Family/sub/plans.md",
            ]
            assert secret.is_error is True
            assert "NOT_FOUND" in secret.content[0].text
            assert_nothing_unreached(tree.structured_content)
            assert write.is_error is True
            assert "FORBIDDEN" in write.content[0].text
            assert mine.is_error is False
            assert [r["path"] for r in after.structured_content["results"]] == [
                "notes/Ann/garden.md"
            ]
            grants = call("GET", f"{API}/auth/keys", headers={"X-Service-Key": ann_key})["keys"]
            oauth = [g for g in grants if g["kind"] == "oauth"]
            assert len(oauth) == 1
            assert oauth[0]["person"] == made["person"]["id"]
            assert oauth[0]["scope"] == "write"
            saved = call("GET", f"{API}/notes/notes%2FAnn%2Fai.md")
            assert saved["content"] == "from the SDK"
