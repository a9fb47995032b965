"""WebDAV under /dav/, with litmus and rclone (src/notesvc/http/dav.py)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import unicodedata
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import webtest

from conftest import (
    API,
    PNG,
    PROPFIND_BODY,
    Dav,
    MiB,
    Server,
    as_key,
    basic,
    data,
    feed,
    key_of,
    new_grant,
    note_url,
    notesvc,
    patch_global,
    put_note,
    running,
    search,
    trash_items,
    wait_for,
)


class TestDav:
    """/dav/: notes and the other files of a vault, through the stores, for other apps."""

    def test_options_need_no_key_and_the_rest_asks_for_basic(self, anon, dav):
        anon = webtest.TestApp(anon.app, lint=False)
        resp = anon.request("/dav/", method="OPTIONS")
        assert resp.headers["DAV"] == "1, 2, calendar-access"  # (/dav/ is CalDAV's root too)
        assert "PROPFIND" in resp.headers["Allow"]
        assert anon.request("/dav/notes/", method="OPTIONS").headers["DAV"] == "1, 2"
        resp = anon.request("/dav/notes/", method="PROPFIND", headers={"Depth": "1"}, status=401)
        assert resp.headers["WWW-Authenticate"].startswith('Basic realm="notesvc"')
        assert "Traceback" not in resp.text
        bearer = {"Authorization": f"Bearer {key_of(anon)}", "Depth": "0"}
        assert anon.request("/dav/notes/", method="PROPFIND", headers=bearer).status_int == 207

    def test_wrong_passwords_count_toward_the_lockout(self, anon):
        wrong = Dav(anon, "nsk_wrong")
        for i in range(10):  # ten different wrong passwords (the same one again counts once)
            Dav(anon, f"nsk_wrong{i}")("PROPFIND", "notes", status=401, Depth="0")
        wrong("PROPFIND", "notes", status=429, Depth="0")
        Dav(anon, key_of(anon))("PROPFIND", "notes", status=429, Depth="0")  # locked out

    def test_a_note_written_over_dav_is_a_note(self, client, dav, root):
        dav("PUT", "notes/trip/plan.md", b"# Plan\n", status=409)  # no folder yet
        dav("MKCOL", "notes/trip", status=201)
        resp = dav("PUT", "notes/trip/plan.md", b"# Plan\n\nPack the tent\n", status=201)
        api = data(client.get(note_url("notes/trip/plan.md")))
        assert resp.headers["ETag"] == api["etag"]
        resp = dav("PUT", "notes/trip/plan.md", b"# Plan\n\nPack the stove\n", status=204)
        assert dav("GET", "notes/trip/plan.md").body == b"# Plan\n\nPack the stove\n"
        versions = data(client.get(f"{note_url('notes/trip/plan.md')}/versions"))["versions"]
        assert versions[0]["reason"] == "dav"
        assert search(client, "stove")["results"][0]["path"] == "notes/trip/plan.md"
        assert [c["kind"] for c in feed(client)["changes"]] == ["created", "updated"]
        listed = dav("PROPFIND", "notes/trip", PROPFIND_BODY, status=207, Depth="1").text
        etag = data(client.get(note_url("notes/trip/plan.md")))["etag"]
        assert f"<D:getetag>{etag.replace(chr(34), '&quot;')}</D:getetag>" in listed
        assert dav("GET", "notes/trip/plan.md").headers["ETag"] == etag

    @pytest.mark.slow
    def test_a_note_kept_by_get_is_served_as_its_file_is_now(self, dav, root, monkeypatch):
        """GET keeps a note's bytes while its file is unchanged (DavNotes, for speed): an
        edit of the same size with its mtime set back is seen at once, and a link put on
        the way later is 403 as it was, though the file behind it is the one kept."""
        folder = root / "notes" / "kept"
        folder.mkdir(parents=True)
        (folder / "a.md").write_bytes(b"# A\n\nfirst\n")
        (folder / "b.md").write_bytes(b"# B\n")
        monkeypatch.setattr(notesvc.DavNotes, "RACY_SECONDS", 0.3)  # (2 s: the same rules)

        def kept_by_get(name: str, body: bytes) -> bool:  # (once its ctime is settled)
            assert dav("GET", f"notes/kept/{name}", status=200).body == body
            kept = dav.app.app.service.dav.notes
            return kept.get(f"notes/kept/{name}", folder / name) is not None

        wait_for(lambda: kept_by_get("a.md", b"# A\n\nfirst\n"), step=0.2)
        wait_for(lambda: kept_by_get("b.md", b"# B\n"), step=0.2)
        kept = dav.app.app.service.dav.notes
        assert kept.get("notes/kept/a.md", folder / "a.md")["data"] == b"# A\n\nfirst\n"
        st = (folder / "a.md").stat()
        with open(folder / "a.md", "r+b") as f:
            f.write(b"# Z")  # same size, same mtime: only ctime tells
        os.utime(folder / "a.md", ns=(st.st_atime_ns, st.st_mtime_ns))
        assert dav("GET", "notes/kept/a.md", status=200).body == b"# Z\n\nfirst\n"
        assert dav("HEAD", "notes/kept/a.md", status=200).headers["Content-Length"] == "11"
        folder.rename(root / "notes" / "real")  # b.md's own stat does not change
        (root / "notes" / "kept").symlink_to(root / "notes" / "real", target_is_directory=True)
        resp = dav("GET", "notes/kept/b.md", status=403)
        assert "symbolic link" in resp.text
        (root / "notes" / "real" / "c.md").symlink_to(root / "notes" / "real" / "b.md")
        dav("GET", "notes/real/c.md", status=403)

    def test_a_revoked_or_rotated_key_is_refused_at_once(self, client, dav):
        dav("PUT", "notes/x.md", b"# X\n", status=201)
        grant = new_grant(client, "read")
        scoped = Dav(client, grant["key"])
        assert scoped("GET", "notes/x.md", status=200).body == b"# X\n"
        client.delete(f"{API}/auth/keys/{grant['id']}")
        scoped("GET", "notes/x.md", status=401)
        assert dav("GET", "notes/x.md", status=200).body == b"# X\n"
        new = data(client.post(f"{API}/auth/rotate"))["apiKey"]
        dav("GET", "notes/x.md", status=401)
        assert Dav(client, new)("GET", "notes/x.md", status=200).body == b"# X\n"

    def test_a_vaults_other_files_are_kept_byte_for_byte_out_of_the_apis_sight(
        self, client, dav, root
    ):
        dav("MKCOL", "notes/vault", status=201)
        dav("MKCOL", "notes/vault/.obsidian", status=201)
        png = PNG + bytes(range(256))
        for path, body in (
            ("notes/vault/photo.png", png),
            ("notes/vault/board.canvas", b'{"nodes":[]}'),
            ("notes/vault/.obsidian/app.json", b'{"theme":"dark"}'),
            ("notes/vault/.obsidian/notes.md", b"settings, not a note"),
            ("notes/vault/Welcome.md", b"# Welcome\n\n![[photo.png]]\n"),
        ):
            dav("PUT", path, body, status=201)
            assert dav("GET", path).body == body
            assert (root / path).read_bytes() == body
        assert [
            n["path"] for n in data(client.get(f"{API}/notes?folder=notes/vault"))["notes"]
        ] == ["notes/vault/Welcome.md"]
        tree = client.get(f"{API}/folders/tree?folder=notes/vault").text
        assert ".obsidian" not in tree
        assert "canvas" not in tree
        assert search(client, "settings")["total"] == 0
        assert sorted(dav.hrefs("notes/vault"))[1:] == [
            "/dav/notes/vault/.obsidian/",
            "/dav/notes/vault/Welcome.md",
            "/dav/notes/vault/board.canvas",
            "/dav/notes/vault/photo.png",
        ]
        # the API serves the image beside the note (the web client shows it in the note)
        got = client.get(
            f"{API}/attachments/" + urllib.parse.quote("notes/vault/photo.png", safe="")
        )
        assert got.body == png
        assert got.headers["Content-Security-Policy"] == notesvc.ATTACHMENT_CSP
        for hidden in ("notes/vault/.obsidian/app.json", "notes/vault/Welcome.md"):
            client.get(f"{API}/attachments/" + urllib.parse.quote(hidden, safe=""), status=400)
        elsewhere = as_key(client, new_grant(client, "read", folder="notes/other")["key"])
        elsewhere.get(f"{API}/attachments/notes%2Fvault%2Fphoto.png", status=404)
        # a range of a file, as a player asks for it
        part = dav("GET", "notes/vault/photo.png", Range="bytes=2-5", status=206)
        assert part.body == png[2:6]
        assert part.headers["Content-Security-Policy"] == notesvc.ATTACHMENT_CSP

    def test_propfind_depth_infinity_is_refused_by_name(self, dav):
        resp = dav("PROPFIND", "notes", PROPFIND_BODY, status=403, Depth="infinity")
        assert "<D:propfind-finite-depth/>" in resp.text
        dav("PROPFIND", "notes", PROPFIND_BODY, status=403)  # no Depth means infinity

    @pytest.mark.parametrize(
        "body",
        [
            b'<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol2 "&lol;&lol;'
            b'&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">]><d:propfind xmlns:d="DAV:">'
            b"<d:prop>&lol2;</d:prop></d:propfind>",
            b'<?xml version="1.0"?><!DOCTYPE d [<!ENTITY x SYSTEM "file:///etc/passwd">]>'
            b'<d:propfind xmlns:d="DAV:"><d:prop><d:x>&x;</d:x></d:prop></d:propfind>',
            b"<d:propfind xmlns:d='DAV:'><d:prop>",  # not well formed
        ],
        ids=["billion-laughs", "external-entity", "broken"],
    )
    def test_hostile_xml_is_400_at_once(self, dav, body):
        started = time.monotonic()
        for method in ("PROPFIND", "PROPPATCH", "LOCK"):
            resp = dav(method, "notes", body, status=400, Depth="0")
            assert "root:" not in resp.text
            assert "Traceback" not in resp.text
        assert time.monotonic() - started < 1

    def test_a_50_mb_xml_body_is_413(self, dav):
        dav("PROPFIND", "notes", b" " * (50 * 1024 * 1024), status=413, Depth="0")

    @pytest.mark.parametrize(
        ("destination", "status"),
        [
            ("http://elsewhere.example/dav/notes/b.md", 502),
            ("/api/v1/notes/b.md", 403),
            ("/dav/notes/../notes/b.md", 403),
            ("/dav/notes/x%2F..%2F..%2Fb.md", 403),
            ("/dav/../etc/b.md", 403),
            ("/dav/", 403),
            ("", 400),
        ],
    )
    @pytest.mark.slow
    def test_a_destination_elsewhere_is_refused(self, dav, root, destination, status):
        dav("PUT", "notes/a.md", b"a", status=201)
        for method in ("COPY", "MOVE"):
            dav(method, "notes/a.md", status=status, Destination=destination)
        assert (root / "notes/a.md").read_bytes() == b"a"

    def test_move_onto_a_note_with_overwrite_f_is_412_and_t_keeps_the_old_in_the_trash(
        self, client, dav, root
    ):
        dav("PUT", "notes/a.md", b"# A\n", status=201)
        dav("PUT", "notes/b.md", b"# B\n", status=201)
        dav("MOVE", "notes/a.md", status=412, Destination="/dav/notes/b.md", Overwrite="F")
        assert (root / "notes/b.md").read_bytes() == b"# B\n"
        dav("MOVE", "notes/a.md", status=204, Destination="http://localhost:80/dav/notes/b.md")
        assert (root / "notes/b.md").read_bytes() == b"# A\n"
        assert not (root / "notes/a.md").exists()
        assert [i["path"] for i in trash_items(client)] == ["notes/b.md"]
        dav("COPY", "notes/b.md", status=201, Destination="/dav/notes/c.md")
        assert search(client, "A")["total"] == 2

    @pytest.mark.parametrize(
        "path",
        ["attachments/tool.exe", "notes/bad\x01name.md", "notes/\u202eevil.md", "notes/a/../b.md"],
    )
    def test_a_name_the_api_refuses_is_403(self, dav, root, path):
        dav("PUT", path, b"x", status=403)
        assert not list(root.glob("attachments/*"))
        assert not list(root.glob("notes/*"))

    def test_a_lock_keeps_others_out_until_its_token_is_given(self, client, dav, root):
        dav("PUT", "notes/a.md", b"mine", status=201)
        body = (
            b'<?xml version="1.0"?><d:lockinfo xmlns:d="DAV:"><d:lockscope><d:exclusive/>'
            b"</d:lockscope><d:locktype><d:write/></d:locktype><d:owner>ada</d:owner></d:lockinfo>"
        )
        resp = dav("LOCK", "notes/a.md", body, status=200, Timeout="Second-60")
        token = resp.headers["Lock-Token"]
        other = Dav(client, new_grant(client, "write")["key"])
        other("PUT", "notes/a.md", b"theirs", status=423)
        other("DELETE", "notes/a.md", status=423)
        other("MOVE", "notes/a.md", status=423, Destination="/dav/notes/b.md")
        other("LOCK", "notes/a.md", body, status=423)
        other("PUT", "notes/a.md", b"theirs", status=412, If="(<urn:uuid:not-the-token>)")
        other("UNLOCK", "notes/a.md", status=403, Lock_Token=token)
        assert (root / "notes/a.md").read_bytes() == b"mine"
        dav("PUT", "notes/a.md", b"mine, edited", status=204, If=f"({token})")
        dav("UNLOCK", "notes/a.md", status=204, Lock_Token=token)
        other("PUT", "notes/a.md", b"theirs", status=204)

    def test_deleting_a_folder_puts_each_thing_in_the_trash_to_restore(self, client, dav, root):
        dav("MKCOL", "notes/old", status=201)
        dav("MKCOL", "notes/old/deep", status=201)
        dav("PUT", "notes/old/one.md", b"# One\n", status=201)
        dav("PUT", "notes/old/deep/two.md", b"# Two\n", status=201)
        dav("PUT", "notes/old/deep/pic.png", PNG, status=201)
        dav("DELETE", "notes/old", status=204, Depth="infinity")
        assert not (root / "notes/old").exists()
        items = {i["path"]: i for i in trash_items(client)}
        assert set(items) == {"notes/old/one.md", "notes/old/deep/two.md", "notes/old/deep/pic.png"}
        client.post(f"{API}/trash/{items['notes/old/deep/two.md']['id']}/restore")
        assert data(client.get(note_url("notes/old/deep/two.md")))["content"] == "# Two\n"

    def test_a_folder_key_sees_and_writes_its_folder_only(self, client, dav, root):
        put_note(client, "notes/family/list.md", "milk")
        put_note(client, "notes/private/diary.md", "secret")
        mine = Dav(client, new_grant(client, "write", folder="notes/family")["key"])
        assert mine.hrefs("") == ["/dav/", "/dav/notes/", "/dav/attachments/"]
        assert mine.hrefs("notes") == ["/dav/notes/", "/dav/notes/family/"]
        assert "secret" not in mine("PROPFIND", "notes", status=207, Depth="1").text
        mine("GET", "notes/private/diary.md", status=404)
        mine("PROPFIND", "notes/private", status=404, Depth="0")
        mine("PUT", "notes/private/x.md", b"x", status=404)  # (a write elsewhere: 404, as 21)
        mine("PUT", "notes/x.md", b"x", status=404)
        mine("MOVE", "notes/family/list.md", status=403, Destination="/dav/notes/private/l.md")
        mine("COPY", "notes/family/list.md", status=403, Destination="/dav/notes/l.md")
        mine("PUT", "notes/family/new.md", b"bread", status=201)
        assert sorted(p.name for p in (root / "notes/private").iterdir()) == ["diary.md"]
        # a new folder key's folder is not there yet: its first MKCOL makes it
        fresh = Dav(client, new_grant(client, "write", folder="notes/trip")["key"])
        fresh("PUT", "notes/trip/plan.md", b"x", status=409)
        fresh("MKCOL", "notes/trip", status=201)
        fresh("PUT", "notes/trip/plan.md", b"x", status=201)
        fresh("MKCOL", "notes/elsewhere", status=404)

    def test_two_writers_with_one_old_etag_the_second_is_412(self, client, dav, root):
        etag = dav("PUT", "notes/a.md", b"v1", status=201).headers["ETag"]
        dav("PUT", "notes/a.md", b"v2 from the laptop", status=204, If_Match=etag)
        dav("PUT", "notes/a.md", b"v2 from the phone", status=412, If_Match=etag)
        assert (root / "notes/a.md").read_bytes() == b"v2 from the laptop"
        dav("PUT", "notes/a.md", b"again", status=412, If_None_Match="*")

    def test_a_read_key_reads_and_writes_nothing(self, client, dav, root):
        dav("PUT", "notes/a.md", b"a", status=201)
        reader = Dav(client, new_grant(client, "read")["key"])
        assert reader("GET", "notes/a.md", status=200).body == b"a"
        for method in ("PUT", "DELETE", "MKCOL", "PROPPATCH", "LOCK"):
            reader(method, "notes/a.md", status=403)
        reader("MOVE", "notes/a.md", status=403, Destination="/dav/notes/b.md")

    def test_dead_properties_are_kept_moved_and_dropped(self, dav):
        dav("PUT", "notes/a.md", b"a", status=201)
        patch = (
            b'<?xml version="1.0"?><d:propertyupdate xmlns:d="DAV:" xmlns:z="urn:x">'
            b"<d:set><d:prop><z:colour>blue</z:colour></d:prop></d:set></d:propertyupdate>"
        )
        dav("PROPPATCH", "notes/a.md", patch, status=207)
        ask = (
            b'<d:propfind xmlns:d="DAV:" xmlns:z="urn:x"><d:prop><z:colour/></d:prop></d:propfind>'
        )
        dav("MOVE", "notes/a.md", status=201, Destination="/dav/notes/b.md")
        assert ">blue</" in dav("PROPFIND", "notes/b.md", ask, status=207, Depth="0").text
        protected = patch.replace(b"<z:colour>blue</z:colour>", b"<d:getetag>x</d:getetag>")
        assert "403 Forbidden" in dav("PROPPATCH", "notes/b.md", protected, status=207).text
        dav("DELETE", "notes/b.md", status=204)
        dav("PUT", "notes/b.md", b"b", status=201)
        assert "404 Not Found" in dav("PROPFIND", "notes/b.md", ask, status=207, Depth="0").text


LITMUS = shutil.which("litmus")


RCLONE = shutil.which("rclone")


CADAVER = shutil.which("cadaver")


def rclone_env(url: str, key: str, proxy: str = "") -> dict:
    """rclone's WebDAV remote `:webdav:` from the environment (no config file)."""
    obscured = subprocess.run(
        [RCLONE, "obscure", key], capture_output=True, text=True, check=True
    ).stdout.strip()
    env = {
        **os.environ,
        "RCLONE_CONFIG": "/dev/null",
        "RCLONE_WEBDAV_URL": url,
        "RCLONE_WEBDAV_VENDOR": "other",
        "RCLONE_WEBDAV_USER": "rclone",
        "RCLONE_WEBDAV_PASS": obscured,
    }
    for name in ("HTTP_PROXY", "http_proxy", "NO_PROXY", "no_proxy"):
        env.pop(name, None)
    if proxy:  # the relay's per-server origin by its name, through the relay itself
        env["HTTP_PROXY"] = proxy
    return env


def rclone(env: dict, *args: str) -> str:
    done = subprocess.run(
        [RCLONE, "--transfers", "4", "--checkers", "4", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def a_vault(folder: Path, notes: int = 500) -> dict:
    """A vault of real-looking notes in 10 folders, images beside some, its settings folder."""
    files = {}
    for i in range(notes):
        files[f"area {i % 10}/note {i:03}.md"] = (
            f"# Note {i}\n\nMet with team {i % 7} about the plan. [[note {(i + 1) % notes:03}]]\n"
        ).encode()
    for i in range(0, notes, 25):
        files[f"area {i % 10}/photo {i}.png"] = PNG + i.to_bytes(4, "big")
    files[".obsidian/app.json"] = b'{"livePreview": true}'
    for rel, body in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(body)
    return files


class TestDavJudges:
    """/dav/ judged by real clients against a real server: litmus, rclone (also through a
    relay's per-server origin), cadaver."""

    pytestmark = [pytest.mark.real_server, pytest.mark.slow]

    def test_litmus_basic_copymove_props_and_locks_pass(self, tmp_path):
        if not LITMUS:
            pytest.skip("no litmus on this machine (Debian: apt install litmus)")
        with running(tmp_path / "root") as server:
            key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]
            done = subprocess.run(
                [LITMUS, f"{server.url}/dav/notes/", "litmus", key],
                capture_output=True,
                text=True,
                timeout=300,
                cwd=tmp_path,
                env={**os.environ, "TESTS": "basic copymove props locks"},
            )
            assert not any("Traceback" in line for line in server.lines)
        summaries = re.findall(
            r"<- summary for `(\w+)': of (\d+) tests run: (\d+) passed", done.stdout
        )
        assert [s[0] for s in summaries] == ["basic", "copymove", "props", "locks"], done.stdout
        for suite, ran, passed in summaries:
            assert ran == passed, (suite, done.stdout)
        assert done.returncode == 0

    def sync_both_ways(self, tmp_path: Path, root: Path, server: Server, env: dict) -> None:
        """rclone sync of a vault up, edits through the API, sync down, check clean."""
        local = tmp_path / "vault"
        files = a_vault(local)
        owner = {"X-Service-Key": server.key}
        rclone(env, "sync", str(local), ":webdav:notes/vault")
        for rel, body in files.items():
            assert (root / "notes/vault" / rel).read_bytes() == body, rel
        notes = server.request("GET", f"{API}/notes?folder=notes/vault&limit=1000", None, owner)
        assert notes[2]["data"]["total"] == 500  # the notes, not the images or the settings
        # edits elsewhere: through the API
        for i in (3, 4):
            path = urllib.parse.quote(f"notes/vault/area {i}/note {i:03}.md", safe="")
            body = {"content": f"# Note {i}\n\nEdited on the phone, with more words.\n"}
            assert server.request("PUT", f"{API}/notes/{path}", body, owner)[0] == 200
        made = {"path": "notes/vault/area 0/from the phone.md", "content": "# New\n"}
        assert server.request("POST", f"{API}/notes", made, owner)[0] == 201
        gone = urllib.parse.quote("notes/vault/area 1/note 001.md", safe="")
        assert server.request("DELETE", f"{API}/notes/{gone}", None, owner)[0] == 200
        rclone(env, "sync", ":webdav:notes/vault", str(local))
        assert "Edited on the phone" in (local / "area 3/note 003.md").read_text()
        assert (local / "area 0/from the phone.md").read_text() == "# New\n"
        assert not (local / "area 1/note 001.md").exists()
        out = rclone(env, "check", "--download", str(local), ":webdav:notes/vault")
        assert "0 differences found" in out

    def test_rclone_syncs_a_vault_both_ways_and_checks_clean(self, tmp_path):
        if not RCLONE:
            pytest.skip("no rclone on this machine (Debian: apt install rclone)")
        with running(tmp_path / "root") as server:
            server.key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]
            dav = rclone_env(f"{server.url}/dav/", server.key)
            self.sync_both_ways(tmp_path, tmp_path / "root", server, dav)
            assert not any("Traceback" in line for line in server.lines)

    def test_rclone_through_a_relays_per_server_origin(self, tmp_path, origins):
        if not RCLONE:
            pytest.skip("no rclone on this machine (Debian: apt install rclone)")
        relay, server, setup, origin = origins
        server.key = setup["apiKey"]
        # the origin's name resolves nowhere here: rclone asks the relay for it by name, as
        # a proxy (absolute-form requests), and the relay serves that origin
        dav = rclone_env(f"{origin}/dav/", server.key, proxy=relay.url)
        self.sync_both_ways(tmp_path, tmp_path / "srv", server, dav)

    def test_rclone_streams_a_file_chunked_through_a_relays_per_server_origin(
        self, tmp_path, origins
    ):
        """S8: a stream of unknown size (`rclone rcat`) goes up as a chunked PUT, as Finder's
        and Windows' uploads do; through the relay it is stored whole."""
        if not RCLONE:
            pytest.skip("no rclone on this machine (Debian: apt install rclone)")
        relay, _, setup, origin = origins
        dav = rclone_env(f"{origin}/dav/", setup["apiKey"], proxy=relay.url)
        dav["RCLONE_WEBDAV_VENDOR"] = "owncloud"  # rclone streams (chunked) only to these
        data = PNG + os.urandom(600_000)
        done = subprocess.run(
            [RCLONE, "rcat", "--streaming-upload-cutoff", "0", ":webdav:attachments/s.png"],
            input=data,
            capture_output=True,
            env=dav,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert (tmp_path / "srv/attachments/s.png").read_bytes() == data

    def test_a_file_over_the_json_limit_is_put_whole_and_a_note_is_not(self, tmp_path):
        # waitress refuses large bodies before the app sees them: a file over WebDAV has
        # the attachment limit, a note the body limit
        with running(tmp_path / "root") as server:
            key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]

            def put(path: str, body: bytes) -> int:
                req = urllib.request.Request(
                    f"{server.url}/dav/{path}", body, {"Authorization": basic(key)}, method="PUT"
                )
                try:
                    with urllib.request.urlopen(req, timeout=30) as resp:
                        return resp.status
                except urllib.error.HTTPError as e:
                    return e.code

            big = PNG + bytes(2 * MiB)
            assert put("attachments/big.png", big) == 201
            assert (tmp_path / "root/attachments/big.png").read_bytes() == big
            assert put("notes/big.md", b"x" * (2 * MiB)) == 413

    def test_a_cadaver_session(self, tmp_path):
        if not CADAVER:
            pytest.skip("no cadaver on this machine (Debian: apt install cadaver)")
        local = tmp_path / "shopping.md"
        local.write_text("# Shopping\n\n- oat milk\n")
        script = "\n".join(
            [
                "mkcol lists",
                "cd lists",
                f"put {local} shopping.md",
                "ls",
                "propset shopping.md colour green",
                "propget shopping.md colour",
                "lock shopping.md",
                "unlock shopping.md",
                "move shopping.md groceries.md",
                f"get groceries.md {tmp_path / 'back.md'}",
                "delete groceries.md",
                "ls",
                "quit",
            ]
        )
        with running(tmp_path / "root") as server:
            key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]
            (tmp_path / ".netrc").write_text(f"machine 127.0.0.1 login me password {key}\n")
            (tmp_path / ".netrc").chmod(0o600)
            done = subprocess.run(
                [CADAVER, f"{server.url}/dav/notes/"],
                input=script + "\n",
                capture_output=True,
                text=True,
                timeout=60,
                env={**os.environ, "HOME": str(tmp_path)},
            )
            owner = {"X-Service-Key": key}
            trash = server.request("GET", f"{API}/trash", None, owner)[2]["data"]["items"]
        out = done.stdout
        assert "shopping.md" in out, out
        assert "succeeded" in out, out
        assert "green" in out, out
        assert "failed" not in out.lower(), out
        assert (tmp_path / "back.md").read_text() == "# Shopping\n\n- oat milk\n"
        assert [i["path"] for i in trash] == ["notes/lists/groceries.md"]


LOCKINFO = (
    b'<?xml version="1.0"?><d:lockinfo xmlns:d="DAV:"><d:lockscope><d:exclusive/>'
    b"</d:lockscope><d:locktype><d:write/></d:locktype><d:owner>ada</d:owner></d:lockinfo>"
)


class TestDavMisuse:
    """What an attack run against /dav/ found, each tried again."""

    def test_a_dtd_in_utf_16_is_refused_too(self, dav, root):
        dav("PUT", "notes/a.md", b"a", status=201)
        body = (
            '<?xml version="1.0" encoding="UTF-16"?><!DOCTYPE d [<!ENTITY e "'
            + "x" * 1000
            + '">]><d:propertyupdate xmlns:d="DAV:" xmlns:z="urn:z"><d:set><d:prop>'
            "<z:big>&e;&e;&e;</z:big></d:prop></d:set></d:propertyupdate>"
        ).encode("utf-16")
        dav("PROPPATCH", "notes/a.md", body, status=400)
        assert not (root / ".notesvc/dav-properties.json").exists()

    def test_deep_xml_is_400_and_a_lock_leaves_nothing_behind(self, dav, root):
        deep = b"<x>" * 5000 + b"</x>" * 5000
        patch = b'<d:propertyupdate xmlns:d="DAV:"><d:set><d:prop>' + deep
        patch += b"</d:prop></d:set></d:propertyupdate>"
        dav("PUT", "notes/a.md", b"a", status=201)
        dav("PROPPATCH", "notes/a.md", patch, status=400)
        lock = LOCKINFO.replace(b"ada", deep)
        dav("LOCK", "notes/new.md", lock, status=400)
        assert not (root / "notes/new.md").exists()

    def test_dead_properties_are_bounded(self, dav):
        dav("PUT", "notes/a.md", b"a", status=201)
        big = b"x" * (70 * 1024)
        patch = (
            b'<d:propertyupdate xmlns:d="DAV:" xmlns:z="urn:z"><d:set><d:prop><z:big>'
            + big
            + b"</z:big></d:prop></d:set></d:propertyupdate>"
        )
        dav("PROPPATCH", "notes/a.md", patch, status=507)

    def test_a_lock_token_counts_for_the_key_that_took_the_lock(self, client, dav, root):
        dav("PUT", "notes/a.md", b"mine", status=201)
        token = dav("LOCK", "notes/a.md", LOCKINFO, status=200).headers["Lock-Token"]
        other = Dav(client, new_grant(client, "write")["key"])
        assert token.strip("<>") in other("PROPFIND", "notes/a.md", status=207, Depth="0").text
        other("PUT", "notes/a.md", b"hijack", status=423, If=f"({token})")
        other("DELETE", "notes/a.md", status=423, If=f"({token})")
        other("LOCK", "notes/a.md", b"", status=412, If=f"({token})")  # no refresh either
        assert (root / "notes/a.md").read_bytes() == b"mine"

    @pytest.mark.slow
    def test_one_key_cannot_hold_every_lock_and_the_owner_ends_any(self, client, dav):
        grant = new_grant(client, "write")
        other = Dav(client, grant["key"])
        for i in range(notesvc.DAV_LOCKS_PER_KEY):
            other("PUT", f"notes/f{i}.md", b"x", status=201)
            other("LOCK", f"notes/f{i}.md", LOCKINFO, status=200)
        other("PUT", "notes/one-more.md", b"x", status=201)
        other("LOCK", "notes/one-more.md", LOCKINFO, status=507)
        dav("LOCK", "notes/one-more.md", LOCKINFO, status=200)  # others still lock
        held = other("PROPFIND", "notes/f0.md", status=207, Depth="0").text
        token = re.search(r"urn:uuid:[0-9a-f-]+", held).group(0)
        dav("UNLOCK", "notes/f0.md", status=204, Lock_Token=f"<{token}>")  # the owner may
        dav("PUT", "notes/f0.md", b"owner's", status=204)
        client.delete(f"{API}/auth/keys/{grant['id']}")  # a revoked key's locks end with it
        dav("PUT", "notes/f1.md", b"owner's", status=204)

    def test_shared_locks_stop_at_the_limit_of_a_path_and_of_the_server(
        self, client, dav, monkeypatch
    ):
        shared = LOCKINFO.replace(b"<d:exclusive/>", b"<d:shared/>")
        dav("PUT", "notes/s.md", b"x", status=201)
        for _ in range(notesvc.DAV_LOCKS_PER_PATH):
            dav("LOCK", "notes/s.md", shared, status=200)
        answer = dav("LOCK", "notes/s.md", shared, status=423)
        assert f"holds {notesvc.DAV_LOCKS_PER_PATH} locks" in answer.text
        dav("LOCK", "notes/s.md", LOCKINFO, status=423)  # nor an exclusive one
        dav("PUT", "notes/e.md", b"x", status=201)
        token = dav("LOCK", "notes/e.md", LOCKINFO, status=200).headers["Lock-Token"]
        dav("LOCK", "notes/e.md", shared, status=423)  # not beside an exclusive lock
        dav("LOCK", "notes/e.md", b"", status=200, If=f"({token})")  # a refresh is no new lock
        patch_global(monkeypatch, "DAV_LOCKS_MAX", notesvc.DAV_LOCKS_PER_PATH + 1)
        dav("PUT", "notes/t.md", b"x", status=201)
        dav("LOCK", "notes/t.md", LOCKINFO, status=503)  # every lock of every key counts
        dav("PUT", "notes/t.md", b"y", status=204)  # and none was taken

    def test_copy_or_move_onto_the_folder_holding_it_is_refused(self, client, dav, root):
        dav("MKCOL", "notes/t", status=201)
        dav("MKCOL", "notes/t/sub", status=201)
        dav("PUT", "notes/t/other.md", b"other", status=201)
        dav("PUT", "notes/t/sub/s.md", b"s", status=201)
        dav("COPY", "notes/t/other.md", status=403, Destination="/dav/notes/t")
        dav("MOVE", "notes/t/sub", status=403, Destination="/dav/notes/t")
        assert (root / "notes/t/other.md").read_bytes() == b"other"
        assert (root / "notes/t/sub/s.md").read_bytes() == b"s"
        assert trash_items(client) == []

    def test_a_refused_copy_leaves_the_destination_as_it_was(self, client, dav, root):
        dav("PUT", "notes/keep.md", b"important", status=201)
        dav("PUT", "notes/blob.bin", b"\xff\xfe not text", status=201)
        dav("COPY", "notes/blob.bin", status=415, Destination="/dav/notes/keep.md")
        dav("PUT", "attachments/z.png", PNG, status=201)
        dav("COPY", "notes/blob.bin", status=403, Destination="/dav/attachments/z.exe")
        dav("MOVE", "attachments/z.png", status=403, Destination="/dav/attachments/z.exe")
        assert (root / "notes/keep.md").read_bytes() == b"important"
        assert (root / "attachments/z.png").read_bytes() == PNG
        assert trash_items(client) == []

    def test_odd_names_on_disk_stay_out_of_listings(self, dav, root):
        (root / "notes/weird").mkdir(parents=True)
        (root / "notes/weird/fine.md").write_text("fine")
        os.close(
            os.open(
                os.path.join(str(root / "notes/weird").encode(), b"bad\xff.md"),
                os.O_CREAT | os.O_WRONLY,
            )
        )
        (root / "notes/weird/ctl\x01x.md").write_text("x")
        resp = dav("PROPFIND", "notes/weird", status=207, Depth="1")
        import xml.etree.ElementTree as ET

        ET.fromstring(resp.body)  # noqa: S314 - our own answer: well formed
        assert dav.hrefs("notes/weird") == ["/dav/notes/weird/", "/dav/notes/weird/fine.md"]

    def test_the_if_header_says_nothing_of_notes_a_key_cannot_see(self, client, dav):
        put_note(client, "notes/work/secret.md", "the plan")
        put_note(client, "notes/family/a.md", "a")
        etag = data(client.get(note_url("notes/work/secret.md")))["etag"]
        mine = Dav(client, new_grant(client, "write", folder="notes/family")["key"])
        guess = f'<http://localhost/dav/notes/work/secret.md> (["{etag.strip(chr(34))}"])'
        wrong = '<http://localhost/dav/notes/work/secret.md> (["0"])'
        for header in (guess, wrong):  # the same answer, right guess or wrong
            mine("PROPFIND", "notes/family", status=412, Depth="0", If=header)

    def test_a_deleted_or_moved_resource_takes_its_locks_along(self, client, dav):
        other = Dav(client, new_grant(client, "write")["key"])
        for verb, extra in (("DELETE", {}), ("MOVE", {"Destination": "/dav/notes/b.md"})):
            dav("PUT", "notes/a.md", b"a", status=201)
            token = dav("LOCK", "notes/a.md", LOCKINFO, status=200).headers["Lock-Token"]
            dav(verb, "notes/a.md", status=201 if verb == "MOVE" else 204, If=f"({token})", **extra)
            other("PUT", "notes/a.md", b"free again", status=201)  # no lock is left behind
            other("DELETE", "notes/a.md", status=204)

    def test_files_in_a_folder_named_in_nfd_are_written_in_place(self, client, dav, root):
        nfd = unicodedata.normalize("NFD", "Café")
        (root / "notes" / nfd).mkdir(parents=True)
        (root / "notes" / nfd / "photo.png").write_bytes(PNG)
        dav("PUT", "notes/Café/photo.png", PNG + b"new", status=204)
        assert os.listdir(root / "notes") == [nfd]  # no second, NFC folder beside it
        assert (root / "notes" / nfd / "photo.png").read_bytes() == PNG + b"new"
        got = client.get(
            f"{API}/attachments/" + urllib.parse.quote("notes/Café/photo.png", safe="")
        )
        assert got.body == PNG + b"new"
        dav("DELETE", "notes/Café/photo.png", status=204)

    def test_a_broken_absolute_form_request_line_is_400(self):
        for line in (
            b"GET http://[::1/x HTTP/1.1",
            b"GET http:///x HTTP/1.1",
            b"GET http://u@h/x HTTP/1.1",
        ):
            with pytest.raises(notesvc._Refuse):
                notesvc.parse_request_head(line + b"\r\nHost: a\r\n\r\n", "127.0.0.1")
        method, path, *_ = notesvc.parse_request_head(
            b"PROPFIND http://abc.relay.test:8/dav/notes/ HTTP/1.1\r\nHost: x\r\n\r\n", "127.0.0.1"
        )
        assert (method, path) == ("PROPFIND", "/dav/notes/")
