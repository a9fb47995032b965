"""History: versions, diffs, restores, on real servers too (src/notesvc/notes/history.py)."""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import http.server
import json
import os
import re
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from conftest import (
    API,
    Server,
    assert_error,
    claim,
    data,
    feed,
    make_state,
    new_grant,
    note_url,
    notesvc,
    pair,
    put_note,
    relay_servers,
    running,
    save_by_channel,
    search,
    tmp_path_factory_root,
    update,
    version_contents,
    versions_of,
    versions_of_raw,
    wait_for,
    web_channel,
    with_key,
)


class TestHistory:
    def test_each_write_keeps_the_content_it_replaced_newest_first(self, client, root):
        put_note(client, "notes/h.md", "one")
        update(client, "notes/h.md", "two")
        update(client, "notes/h.md", "three")
        listing = versions_of(client, "notes/h.md")
        assert listing["total"] == 2
        assert (listing["limit"], listing["offset"]) == (100, 0)
        first, second = listing["versions"]
        assert set(first) == {"id", "savedAt", "size", "etag", "reason", "savedBy", "summary"}
        assert re.fullmatch(r"[A-Za-z0-9_-]+", first["id"])
        assert "/" not in first["id"]
        assert "notes" not in first["id"]
        assert first["reason"] == second["reason"] == "updated"
        assert first["savedAt"] >= second["savedAt"]
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["savedAt"])
        one = data(client.get(f"{note_url('notes/h.md')}/versions/{second['id']}"))
        assert one["content"] == "one"
        assert one["path"] == "notes/h.md"
        assert one["id"] == second["id"]
        assert one["etag"] == second["etag"] == notesvc.make_etag(b"one")
        assert (first["size"], second["size"]) == (3, 3)
        assert version_contents(client, "notes/h.md") == ["two", "one"]
        history = root / ".notesvc" / "history"
        assert stat.S_IMODE(history.stat().st_mode) == 0o700
        for path in history.rglob("*"):
            assert stat.S_IMODE(path.stat().st_mode) == (0o700 if path.is_dir() else 0o600), path

    def test_versions_say_who_saved_them_and_what_changed(self, client, root):
        # issue 42: rows told apart by the device and a few words of what changed, kept
        # at write time; `reason`, `savedAt`, `savedBy` and `summary` are the change made
        # at savedAt (the one that replaced the version's content)
        got = claim(client, pair(client, name="phone")["secret"], name="Anna's Pixel")
        phone = with_key(client, got["key"])
        put_note(client, "notes/h.md", "one\ntwo\n")
        update(phone, "notes/h.md", "one\nTWO\nthree\nfour\n")
        update(client, "notes/h.md", "one\n")
        phone.patch_json(f"{note_url('notes/h.md')}/move", {"path": "notes/sub/k.md"})
        update(client, "notes/sub/k.md", "one\nx\n")
        phone.patch_json(f"{note_url('notes/sub/k.md')}/move", {"path": "notes/sub/m.md"})
        listing = versions_of(client, "notes/sub/m.md")["versions"]
        assert [(v["reason"], v["savedBy"], v["summary"]) for v in listing] == [
            ("moved", "Anna's Pixel", "renamed from k"),
            # (the update to one\nx\n replaced what the move had kept: stored once)
            ("moved", "Anna's Pixel", "moved from notes/h.md"),
            ("updated", None, "-3 lines"),  # the API key: no grant
            ("updated", "Anna's Pixel", "+2 lines, 1 changed"),
        ]
        one = data(client.get(f"{note_url('notes/sub/m.md')}/versions/{listing[-1]['id']}"))
        assert (one["savedBy"], one["summary"]) == ("Anna's Pixel", "+2 lines, 1 changed")
        # versions kept before this was recorded (no record of theirs) list null
        for meta in (root / ".notesvc" / "history").rglob("meta"):
            meta.unlink()
        listing = versions_of(client, "notes/sub/m.md")["versions"]
        assert {(v["savedBy"], v["summary"]) for v in listing} == {(None, None)}
        assert len(version_contents(client, "notes/sub/m.md")) == 4  # and all still read

    def test_the_versions_list_tells_when_and_by_whom_a_note_was_created(self, make_app):
        """A creation keeps no version (it replaced nothing): the list's `created` tells it
        from the change journal, followed through moves, to whoever sees where it was made,
        while the journal holds it; the feed itself names no one."""
        client = with_key(make_app())
        got = claim(client, pair(client, name="phone")["secret"], name="Anna's Pixel")
        phone = with_key(client, got["key"])
        before = notesvc.iso(time.time() - 1)
        put_note(phone, "notes/trip.md", "# Trip\n")
        update(client, "notes/trip.md", "# Trip\n\n- passport\n")
        client.patch_json(f"{note_url('notes/trip.md')}/move", {"path": "notes/family/trip.md"})
        listing = versions_of(client, "notes/family/trip.md")
        assert listing["total"] == 2  # the update and the move: still no version for it
        made = listing["created"]
        assert made["by"] == "Anna's Pixel"
        assert before <= made["at"] <= notesvc.iso(time.time() + 1)
        assert versions_of(client, "notes/family/trip.md", limit=1, offset=1)["created"] == made
        put_note(client, "notes/own.md", "by the API key")
        assert versions_of(client, "notes/own.md")["created"]["by"] is None
        assert "by" not in json.dumps(feed(client)["changes"])  # (the feed: as before)
        # a folder grant sees no creation made outside its folder (nor where that was)
        family = with_key(client, new_grant(client, "read", folder="notes/family")["key"])
        assert versions_of(family, "notes/family/trip.md")["created"] is None
        put_note(phone, "notes/family/list.md", "- bread\n")
        assert versions_of(family, "notes/family/list.md")["created"]["by"] == "Anna's Pixel"
        # deleted and made again: the new one's creation
        client.delete(note_url("notes/own.md"))
        put_note(phone, "notes/own.md", "again")
        assert versions_of(client, "notes/own.md")["created"]["by"] == "Anna's Pixel"
        # kept in the journal's file: the same after a restart
        again = with_key(make_app())
        assert versions_of(again, "notes/family/trip.md")["created"] == made
        # once the journal no longer holds it: null, never a guess
        again.app.service.journal.keep = 2
        for i in range(6):
            put_note(again, f"notes/c{i}.md", "x")
        assert versions_of(again, "notes/family/trip.md")["created"] is None

    def test_the_summary_of_a_change(self):
        assert [
            notesvc.change_summary(a.encode(), b.encode())
            for a, b in [
                ("a\nb\n", "a\nB\nc\nd\n"),
                ("a\nb\nc\n", "a\nc\n"),
                ("a\nb\n", "a\nB\n"),
                ("a\nb", "a\nb\n"),  # the last line's ending
                ("a\nb\nc\nd\n", "A\nb\nc\nD\n"),
                ("", "x\ny\n"),
                ("x\n" * 2000, "y\n" * 3000),  # long: counted, not compared
            ]
        ] == [
            "+2 lines, 1 changed",
            "-1 line",
            "1 line changed",
            "1 line changed",
            "2 lines changed",
            "+2 lines",
            "+1000 lines, 2000 changed",
        ]

    def test_versions_kept_by_the_sweep_keep_who_saved_them(self, client, root):
        put_note(client, "notes/p.md", "a\n")
        update(client, "notes/p.md", "a\nb\n")
        update(client, "notes/p.md", "a\nb\nc\n")
        history = client.app.service.history
        history.PACK_AFTER = -1  # pack everything now
        client.app.service.notes.sweep_history()
        # all packed: no folder and no file each (the records are packed with them)
        assert not history.dir_of("notes/p.md").exists()
        listing = versions_of(client, "notes/p.md")["versions"]
        assert [v["summary"] for v in listing] == ["+1 line", "+1 line"]
        one = data(client.get(f"{note_url('notes/p.md')}/versions/{listing[0]['id']}"))
        assert one["summary"] == "+1 line"
        history.max_versions, history.days = 1, 0
        client.app.service.notes.sweep_history()
        assert [v["summary"] for v in versions_of(client, "notes/p.md")["versions"]] == ["+1 line"]
        assert history.packs._run("SELECT count(*) FROM meta")[0][0] == 1  # collected

    def test_identical_consecutive_contents_are_stored_once(self, client):
        put_note(client, "notes/same.md", "a")
        for _ in range(3):
            update(client, "notes/same.md", "b")
        update(client, "notes/same.md", "a")
        update(client, "notes/same.md", "b")
        assert version_contents(client, "notes/same.md") == ["a", "b", "a"]

    def test_channels_link_rewrites_moves_and_deletes_keep_versions(self, client):
        channel = web_channel(client)
        save_by_channel(client, channel, "/save first thought")
        save_by_channel(client, channel, "/save second thought")
        inbox = data(client.get(f"{API}/notes?folder=notes/daily"))["notes"][0]["path"]
        (kept,) = version_contents(client, inbox)
        assert "first thought" in kept
        assert "second thought" not in kept
        put_note(client, "notes/target.md", "# Target")
        put_note(client, "notes/linker.md", "see [[target]]")
        client.patch_json(
            note_url("notes/target.md") + "/move", {"path": "notes/moved.md", "updateLinks": True}
        )
        linker = versions_of(client, "notes/linker.md")["versions"]
        assert [v["reason"] for v in linker] == ["linksRewritten"]
        assert version_contents(client, "notes/linker.md") == ["see [[target]]"]
        assert [v["reason"] for v in versions_of(client, "notes/moved.md")["versions"]] == ["moved"]
        update(client, "notes/moved.md", "# Target, edited")
        client.delete(note_url("notes/moved.md"))
        deleted = versions_of(client, "notes/moved.md")["versions"]
        assert [v["reason"] for v in deleted] == ["deleted", "moved"]
        assert version_contents(client, "notes/moved.md")[0] == "# Target, edited"

    def test_history_follows_a_note_across_moves(self, client):
        put_note(client, "notes/a.md", "v1")
        update(client, "notes/a.md", "v2")
        client.patch_json(note_url("notes/a.md") + "/move", {"path": "notes/deep/b.md"})
        update(client, "notes/deep/b.md", "v3")
        assert version_contents(client, "notes/deep/b.md") == ["v2", "v1"]
        assert_error(versions_of_raw(client, "notes/a.md", 404), 404, "NOT_FOUND")

    def test_a_move_onto_the_path_of_a_deleted_note_merges_their_histories(self, client):
        put_note(client, "notes/old.md", "old 1")
        update(client, "notes/old.md", "old 2")
        client.delete(note_url("notes/old.md"))
        put_note(client, "notes/new.md", "new 1")
        update(client, "notes/new.md", "new 2")
        client.patch_json(note_url("notes/new.md") + "/move", {"path": "notes/old.md"})
        assert sorted(version_contents(client, "notes/old.md")) == [
            "new 1",
            "new 2",
            "old 1",
            "old 2",
        ]

    def test_restore_is_a_write_guarded_by_if_match_that_keeps_what_it_replaced(self, client):
        put_note(client, "notes/r.md", "first")
        update(client, "notes/r.md", "second")
        (old,) = versions_of(client, "notes/r.md")["versions"]
        url = f"{note_url('notes/r.md')}/versions/{old['id']}/restore"
        resp = client.post(url, headers={"If-Match": '"stale"'}, status=412)
        assert_error(resp, 412, "PRECONDITION_FAILED")
        current = client.get(note_url("notes/r.md")).headers["ETag"]
        resp = client.post(url, headers={"If-Match": current})
        rec = data(resp)
        assert rec["content"] == "first"
        assert resp.headers["ETag"] == rec["etag"] == notesvc.make_etag(b"first")
        assert data(client.get(note_url("notes/r.md")))["content"] == "first"
        newest = versions_of(client, "notes/r.md")["versions"][0]
        assert newest["reason"] == "restored"
        assert version_contents(client, "notes/r.md") == ["second", "first"]
        assert feed(client)["changes"][-1]["kind"] == "restored"
        assert search(client, "first")["total"] == 1  # the index follows

    def test_restoring_a_version_of_a_deleted_note_recreates_it(self, client):
        put_note(client, "notes/gone/x.md", "keep me")
        update(client, "notes/gone/x.md", "keep me too")
        client.delete(note_url("notes/gone/x.md"))
        client.get(note_url("notes/gone/x.md"), status=404)
        listing = versions_of(client, "notes/gone/x.md")["versions"]
        assert [v["reason"] for v in listing] == ["deleted", "updated"]
        url = f"{note_url('notes/gone/x.md')}/versions/{listing[1]['id']}/restore"
        client.post(url, headers={"If-Match": "*"}, status=412)  # there is no note to match
        assert data(client.post(url))["content"] == "keep me"
        assert data(client.get(note_url("notes/gone/x.md")))["content"] == "keep me"

    def test_diff_against_the_current_note_or_another_version(self, client):
        put_note(client, "notes/d.md", "alpha\nbeta\ngamma\n")
        update(client, "notes/d.md", "alpha\nBETA\ngamma\n")
        update(client, "notes/d.md", "alpha\nBETA\ngamma\ndelta")
        newer, older = versions_of(client, "notes/d.md")["versions"]
        base = f"{note_url('notes/d.md')}/versions/{older['id']}/diff"
        d = data(client.get(base))
        assert d["against"] == "current"
        assert d["diff"] == (
            f"--- notes/d.md@{older['id']}\n"
            "+++ notes/d.md@current\n"
            "@@ -1,3 +1,4 @@\n"
            " alpha\n"
            "-beta\n"
            "+BETA\n"
            " gamma\n"
            "+delta\n"
            "\\ No newline at end of file\n"
        )
        d = data(client.get(f"{base}?against={newer['id']}"))
        assert "-beta\n+BETA\n" in d["diff"]
        assert "delta" not in d["diff"]
        same = data(
            client.get(
                f"{note_url('notes/d.md')}/versions/{newer['id']}/diff?against={newer['id']}"
            )
        )
        assert same["diff"] == ""
        other = "1795388114646622-updated-" + "0" * 32
        assert_error(client.get(f"{base}?against={other}", status=404), 404, "NOT_FOUND")
        assert_error(client.get(f"{base}?against=..%2F..", status=400), 400, "VALIDATION_ERROR")

    def test_a_large_diff_stays_linear_and_patches_correctly(self, client):
        import random

        rnd = random.Random(5)
        old = "".join(f"{rnd.randrange(150)}\n" for _ in range(12000))
        new = "".join(f"{rnd.randrange(150)}\n" for _ in range(12000))
        put_note(client, "notes/big.md", old)
        update(client, "notes/big.md", new)
        (v,) = versions_of(client, "notes/big.md")["versions"]
        started = time.monotonic()
        diff = data(client.get(f"{note_url('notes/big.md')}/versions/{v['id']}/diff"))["diff"]
        assert time.monotonic() - started < 5
        if shutil.which("patch"):
            with tempfile.TemporaryDirectory() as tmp:
                Path(tmp, "f").write_text(old)
                Path(tmp, "p").write_text(diff)
                subprocess.run(["patch", "-s", f"{tmp}/f", f"{tmp}/p"], check=True, timeout=30)
                assert Path(tmp, "f").read_text() == new

    def test_bad_ids_paths_and_pages(self, client):
        put_note(client, "notes/v.md", "a")
        for i in range(3):
            update(client, "notes/v.md", f"b{i}")
        page = versions_of(client, "notes/v.md", limit=1, offset=1)
        assert (page["total"], len(page["versions"]), page["limit"], page["offset"]) == (3, 1, 1, 1)
        assert (
            version_contents(client, "notes/v.md")[1]
            == data(client.get(f"{note_url('notes/v.md')}/versions/{page['versions'][0]['id']}"))[
                "content"
            ]
        )
        url = note_url("notes/v.md") + "/versions"
        for bad in ("limit=0", "limit=1001", "limit=x", "offset=-1", "offset=1.5"):
            assert_error(client.get(f"{url}?{bad}", status=400), 400, "VALIDATION_ERROR")
        for garbage in ("nope", "..%2F..%2Fstate.json", "1" * 300, "%00", "head"):
            for suffix in ("", "/diff"):
                resp = client.get(f"{url}/{garbage}{suffix}", status=400)
                assert_error(resp, 400, "VALIDATION_ERROR")
            resp = client.post(f"{url}/{garbage}/restore", status=[400, 405])
            assert resp.json["success"] is False  # a decoded %2F leaves no such route: 405
        unknown = "1795388114646622-updated-" + "f" * 32
        for method, suffix in (("get", ""), ("get", "/diff"), ("post", "/restore")):
            resp = getattr(client, method)(f"{url}/{unknown}{suffix}", status=404)
            assert_error(resp, 404, "NOT_FOUND")
        assert_error(versions_of_raw(client, "notes/never.md", 404), 404, "NOT_FOUND")
        for hostile in ("notes/../x.md", "../etc/passwd", "notes/.hidden/x.md", "notes/a\u202e.md"):
            assert_error(versions_of_raw(client, hostile, 400), 400, "VALIDATION_ERROR")

    def test_a_note_in_a_folder_named_like_the_versions_route_is_still_read(self, client):
        put_note(client, "notes/x.md/versions/y.md", "tricky")
        assert data(client.get(note_url("notes/x.md/versions/y.md")))["content"] == "tricky"

    def test_retention_keeps_the_newest_and_whatever_is_younger_than_its_days(self, make_app):
        client = with_key(make_app(SERVICE_HISTORY_MAX_VERSIONS="3", SERVICE_HISTORY_DAYS="1"))
        svc = client.app.service
        now = [time.time()]
        svc.history.clock = lambda: now[0]  # the injectable clock
        put_note(client, "notes/r.md", "v0")
        for i in range(1, 7):
            update(client, "notes/r.md", f"v{i}")
        assert versions_of(client, "notes/r.md")["total"] == 6  # all younger than a day
        now[0] += 2 * 86400
        assert svc.notes.sweep_history() == 3  # what the hourly retention runs
        assert version_contents(client, "notes/r.md") == ["v5", "v4", "v3"]
        update(client, "notes/r.md", "v7")  # each write applies the retention to its note
        assert version_contents(client, "notes/r.md") == ["v6", "v5", "v4"]
        client.delete(note_url("notes/r.md"))
        now[0] += 2 * 86400
        svc.notes.sweep_history()
        assert len(version_contents(client, "notes/r.md")) == 3  # a deleted note's too
        svc.history.max_versions = 1
        svc.notes.sweep_history()
        assert version_contents(client, "notes/r.md") == ["v7"]

    def test_retention_by_count_only_when_days_is_zero(self, make_app):
        client = with_key(make_app(SERVICE_HISTORY_MAX_VERSIONS="2", SERVICE_HISTORY_DAYS="0"))
        put_note(client, "notes/c.md", "v0")
        for i in range(1, 6):
            update(client, "notes/c.md", f"v{i}")
        assert version_contents(client, "notes/c.md") == ["v4", "v3"]

    def test_history_off_keeps_nothing_and_the_audit_says_so(self, make_app, root):
        client = with_key(make_app(SERVICE_HISTORY_MAX_VERSIONS="0"))
        put_note(client, "notes/off.md", "a")
        update(client, "notes/off.md", "b")
        assert versions_of(client, "notes/off.md")["total"] == 0
        assert not (root / ".notesvc" / "history").exists()
        found = {f["id"]: f for f in data(client.get(f"{API}/security/audit"))["findings"]}
        assert found["history-off"]["severity"] == "low"
        assert "SERVICE_HISTORY_MAX_VERSIONS" in found["history-off"]["recommendation"]
        assert feed(client)["changes"][-1]["kind"] == "updated"  # the feed runs without it
        on = with_key(make_app(tmp_path_factory_root(root)))
        assert "history-off" not in {
            f["id"] for f in data(on.get(f"{API}/security/audit"))["findings"]
        }

    def test_an_external_edit_keeps_what_it_replaced(self, client, root):
        put_note(client, "notes/e.md", "mine 1")
        update(client, "notes/e.md", "mine 2")
        (root / "notes" / "e.md").write_text("theirs")  # another program, in place
        client.app.service.sync_index()  # what the rescan runs
        listing = versions_of(client, "notes/e.md")["versions"]
        assert [v["reason"] for v in listing] == ["external", "updated"]
        assert version_contents(client, "notes/e.md") == ["mine 2", "mine 1"]
        (root / "notes" / "e.md").unlink()
        client.app.service.sync_index()
        assert version_contents(client, "notes/e.md")[0] == "theirs"
        changes = feed(client)["changes"]
        assert [(c["kind"], c["path"]) for c in changes[-2:]] == [
            ("updated", "notes/e.md"),
            ("deleted", "notes/e.md"),
        ]
        assert changes[-2]["etag"] == notesvc.make_etag(b"theirs")

    def test_a_note_that_was_there_before_gets_its_copy_at_start(self, make_app, root):
        (root / "notes").mkdir(parents=True)
        (root / "notes" / "pre.md").write_text("from before notesvc")
        client = with_key(make_app())
        (root / "notes" / "pre.md").write_text("edited by hand")
        client.app.service.sync_index()
        assert version_contents(client, "notes/pre.md") == ["from before notesvc"]
        changes = feed(client)["changes"]
        assert [(c["kind"], c["path"]) for c in changes] == [("updated", "notes/pre.md")]

    def test_system_info_reports_history_trash_and_the_feed(self, client):
        put_note(client, "notes/i.md", "12345")
        update(client, "notes/i.md", "123")
        put_note(client, "notes/j.md", "xy")
        client.delete(note_url("notes/j.md"))
        info = data(client.get(f"{API}/system/info"))
        assert info["history"]["notes"] == 2
        assert info["history"]["versions"] == 2  # 12345 and the deleted xy
        assert info["history"]["bytes"] >= 7
        assert info["history"]["maxVersions"] == 50
        assert info["trash"] == {"items": 1, "bytes": 2}
        assert info["changes"] == {"last": 4, "floor": 0, "waiting": 0}
        sync = data(client.get(f"{API}/system/config"))["sync"]
        assert (sync["historyMaxVersions"], sync["historyDays"], sync["trashDays"]) == (50, 90, 30)
        assert sync["maxWaiters"] == 4


def long_poll(server: Server, since: int, wait: float, prefix: str = "", headers=None) -> tuple:
    """Return (status, headers, data, seconds) of one change-feed request."""
    started = time.monotonic()
    status, hdrs, body = server.request(
        "GET", f"{prefix}{API}/changes?since={since}&wait={wait}", headers=headers
    )
    return status, hdrs, (body or {}).get("data"), time.monotonic() - started


def feed_waiting(server: Server, prefix: str = "", headers=None) -> int:
    return server.request("GET", f"{prefix}{API}/system/info", headers=headers)[2]["data"][
        "changes"
    ]["waiting"]


class TestHistoryServer:
    """History and the change feed on real servers: crashes, long-polls, the relay."""

    pytestmark = [pytest.mark.real_server, pytest.mark.slow]

    def test_a_folder_grant_sees_no_version_saved_before_the_move_into_its_folder(self, tmp_path):
        with running(tmp_path) as server:
            owner = {"X-Service-Key": make_state(tmp_path)["apiKey"]}
            secret = "# Plan\n\nthe safe's code is 4711\n"
            body = {"path": "notes/private/plan.md", "content": secret}
            assert server.request("POST", f"{API}/notes", body, owner)[0] == 201
            url = note_url("notes/private/plan.md")
            assert (
                server.request("PUT", url, {"content": "# Plan\n\nnothing here\n"}, owner)[0] == 200
            )
            moved = {"path": "notes/family/plan.md"}
            assert server.request("PATCH", url + "/move", moved, owner)[0] == 200
            url = note_url("notes/family/plan.md")
            for text in ("# Plan\n\nfor all\n", "# Plan\n\nfor all, again\n"):
                assert server.request("PUT", url, {"content": text}, owner)[0] == 200
            grant = {"name": "family", "scope": "write", "folder": "notes/family"}
            status, _, made = server.request("POST", f"{API}/auth/keys", grant, owner)
            family = {"X-Service-Key": made["data"]["key"]}
            everything = server.request("GET", url + "/versions", None, owner)[2]["data"]
            seen = server.request("GET", url + "/versions", None, family)[2]["data"]
            before = {v["id"] for v in everything["versions"]} - {v["id"] for v in seen["versions"]}
            assert before
            assert seen["total"] == len(seen["versions"]) >= 1
            for v in everything["versions"]:  # the owner still sees the whole history
                text = server.request("GET", f"{url}/versions/{v['id']}", None, owner)[2]
                assert text["success"]
            leaked = [
                server.request("GET", f"{url}/versions/{v['id']}", None, family)[2]["data"][
                    "content"
                ]
                for v in seen["versions"]
            ]
            assert not any("4711" in text for text in leaked)
            after = seen["versions"][0]["id"]
            for vid in before:  # every way of reading an older version is 404 for the grant
                for method, path in (
                    ("GET", f"{url}/versions/{vid}"),
                    ("GET", f"{url}/versions/{vid}/diff"),
                    ("GET", f"{url}/versions/{after}/diff?against={vid}"),
                    ("POST", f"{url}/versions/{vid}/restore"),
                ):
                    status, _, answer = server.request(method, path, None, family)
                    assert (status, answer["error"]["code"]) == (404, "NOT_FOUND"), path
                    assert "4711" not in json.dumps(answer)
            assert server.request("GET", f"{url}/versions/{after}/diff", None, family)[0] == 200
            assert (
                "4711"
                in server.request("GET", f"{url}/versions/{min(before)}", None, owner)[2]["data"][
                    "content"
                ]
            )

    def test_sigkill_during_puts_leaves_old_or_new_and_the_history_whole(self, tmp_path):
        root = tmp_path / "srv"
        contents = [f"# v{i}\n\n" + f"line {i}\n" * 3000 for i in range(40)]
        url = note_url("notes/crash.md")
        for round_ in range(2):
            server = Server(root, "--auth-mode", "none")
            acked = []  # contents whose PUT answered 200, in order
            try:
                if round_ == 0:
                    status, _, _ = server.request(
                        "POST", f"{API}/notes", {"path": "notes/crash.md", "content": contents[0]}
                    )
                    assert status == 201
                current = server.request("GET", url)[2]["data"]["content"]
                acked.append(current)

                def writer(start: int, acked=acked, server=server):
                    i = start
                    while True:
                        content = contents[i % len(contents)]
                        try:
                            status, _, _ = server.request("PUT", url, {"content": content})
                        except (OSError, http.client.HTTPException):  # killed
                            return
                        if status == 200:
                            acked.append(content)
                        i += 1

                start = contents.index(current) + 1 if current in contents else 0
                t = threading.Thread(target=writer, args=(start,))
                t.start()
                enough = 8 + 8 * round_  # well under way
                wait_for(lambda acked=acked, enough=enough: len(acked) > enough, step=0.01)
                server.proc.kill()  # SIGKILL, in the middle of the next PUT: no clean-up
                server.proc.wait(10)
                t.join(30)
            finally:
                server.stop()
            assert len(acked) > 3
            on_disk = (root / "notes" / "crash.md").read_text()
            assert on_disk in (*contents, acked[0])  # old or new, never torn
            history = root / ".notesvc" / "history"
            kept = {}
            for f in history.rglob("*"):
                if f.is_file() and notesvc.VERSION_ID_RE.match(f.name):
                    raw = f.read_bytes()
                    assert f.name.endswith(notesvc.make_etag(raw)[1:-1]), "a torn version"
                    kept[f.name] = raw.decode()
            replaced = set(acked[:-1])  # every acknowledged PUT kept what it replaced
            if on_disk != acked[-1]:  # the PUT in flight replaced the note: that too
                replaced.add(acked[-1])
            assert replaced <= set(kept.values())
            with running(root, "--auth-mode", "none") as again:
                assert again.request("GET", url)[2]["data"]["content"] == on_disk
                listing = again.request("GET", url + "/versions?limit=1000")[2]["data"]
                assert set(kept) <= {v["id"] for v in listing["versions"]}
                for v in listing["versions"][:5]:
                    body = again.request("GET", f"{url}/versions/{v['id']}")[2]["data"]
                    assert body["content"] == kept[v["id"]]
                changes = again.request("GET", f"{API}/changes?limit=1000")[2]["data"]["changes"]
                seqs = [c["seq"] for c in changes]
                assert seqs == list(range(1, len(seqs) + 1))
                etags = {c.get("etag") for c in changes}
                assert {notesvc.make_etag(c.encode()) for c in acked[1:]} <= etags
                status, _, _ = again.request("PUT", url, {"content": "after the crash"})
                assert status == 200
            leftovers = [p for p in root.rglob("*") if p.name.startswith(".tmp-")]
            assert leftovers == []

    def test_a_waiting_feed_gets_the_next_change_at_once(self, tmp_path):
        with running(tmp_path, "--auth-mode", "none", env={"SERVICE_RESCAN_SECONDS": "1"}) as s:
            status, _, d, took = long_poll(s, 0, 1)
            assert (status, d, took >= 0.9) == (
                200,
                {"changes": [], "last": 0, "more": False},
                True,
            )
            got = []
            t = threading.Thread(target=lambda: got.append(long_poll(s, 0, 20)))
            t.start()
            wait_for(lambda: feed_waiting(s) == 1)
            sent = time.monotonic()
            s.request("POST", f"{API}/notes", {"path": "notes/n.md", "content": "hello"})
            t.join(25)
            status, _, d, _ = got[0]
            assert status == 200
            assert [(c["seq"], c["kind"], c["path"]) for c in d["changes"]] == [
                (1, "created", "notes/n.md")
            ]
            assert time.monotonic() - sent < 2
            # another program's edit reaches a waiting feed through the rescan
            t = threading.Thread(target=lambda: got.append(long_poll(s, 1, 20)))
            t.start()
            wait_for(lambda: feed_waiting(s) == 1)
            (tmp_path / "notes" / "n.md").write_text("edited elsewhere")
            t.join(25)
            change = got[1][2]["changes"][0]
            assert (change["kind"], change["path"]) == ("updated", "notes/n.md")
            assert change["etag"] == notesvc.make_etag(b"edited elsewhere")
            versions = s.request("GET", note_url("notes/n.md") + "/versions")[2]["data"]
            assert [v["reason"] for v in versions["versions"]] == ["external"]

    def test_over_the_waiter_cap_the_answer_is_at_once_and_others_still_answer(self, tmp_path):
        with running(tmp_path, "--auth-mode", "none", env={"SERVICE_THREADS": "4"}) as s:
            info = s.request("GET", f"{API}/system/config")[2]["data"]["sync"]
            assert info["maxWaiters"] == 2  # half of 4 threads
            held = []
            threads = [
                threading.Thread(target=lambda: held.append(long_poll(s, 0, 20))) for _ in range(2)
            ]
            for t in threads:
                t.start()
            wait_for(lambda: feed_waiting(s) == 2)
            status, headers, d, took = long_poll(s, 0, 20)
            assert status == 200
            assert took < 1
            assert d == {"changes": [], "last": 0, "more": False, "retryAfter": 1}
            assert headers["Retry-After"] == "1"
            for _ in range(5):  # the cap keeps threads for everything else
                started = time.monotonic()
                assert s.request("GET", f"{API}/notes")[0] == 200
                assert time.monotonic() - started < 1
            s.request("POST", f"{API}/notes", {"path": "notes/x.md", "content": "x"})
            for t in threads:
                t.join(25)
            assert [len(h[2]["changes"]) for h in held] == [1, 1]
            assert max(h[3] for h in held) < 15
            assert feed_waiting(s) == 0

    def test_twenty_followers_see_every_change_once_and_in_order(self, tmp_path):
        with running(tmp_path, "--auth-mode", "none", env={"SERVICE_THREADS": "8"}) as s:
            writes, followers = 30, 20
            done, errors = threading.Event(), []
            seen = [[] for _ in range(followers)]
            retried = [0] * followers

            def follow(k: int) -> None:
                since, deadline = 0, time.monotonic() + 90
                try:
                    while time.monotonic() < deadline:
                        status, headers, body = s.request(
                            "GET", f"{API}/changes?since={since}&wait=5&limit=7"
                        )
                        assert status == 200, body
                        d = body["data"]
                        if "retryAfter" in d:  # over the cap: retry as told
                            assert headers["Retry-After"] == str(d["retryAfter"])
                            retried[k] += 1
                            time.sleep(d["retryAfter"])
                            continue
                        seen[k].extend(d["changes"])
                        since = d["last"]
                        if done.is_set() and not d["more"] and since >= final[0]:
                            return
                    errors.append(f"follower {k} timed out at {since}")
                except Exception as e:
                    errors.append(f"follower {k}: {e!r}")

            def write(w: int) -> None:
                for i in range(writes):
                    path = f"notes/w{w}/n{i % 5}.md"
                    if i < 5:
                        s.request("POST", f"{API}/notes", {"path": path, "content": f"{w}/{i}"})
                    else:
                        s.request("PUT", note_url(path), {"content": f"{w}/{i}"})

            final = [10**9]
            readers = [threading.Thread(target=follow, args=(k,)) for k in range(followers)]
            writers = [threading.Thread(target=write, args=(w,)) for w in range(3)]
            for t in readers + writers:
                t.start()
            for t in writers:
                t.join(60)
            everything = s.request("GET", f"{API}/changes?limit=1000")[2]["data"]
            final[0] = everything["last"]
            done.set()
            for t in readers:
                t.join(100)
            assert errors == []
            assert final[0] == 3 * writes
            for k in range(followers):
                assert seen[k] == everything["changes"], f"follower {k}"
            assert sum(retried) > 0  # 20 followers, 4 may wait at once

    def test_the_feed_passes_through_the_relay(self, tmp_path):
        relay = Server(tmp_path / "relay", "relay")
        server = Server(tmp_path / "srv", env={"SERVICE_RELAY_URL": relay.url})
        try:
            wait_for(lambda: relay_servers(relay) == 1)
            setup = server.request("GET", f"{API}/system/setup")[2]["data"]
            key = {"X-Service-Key": setup["apiKey"]}
            prefix = f"/r/{setup['serverId']}"

            def relayed(since: int, wait: float) -> tuple:
                started = time.monotonic()
                status, hdrs, body = relay.request(
                    "GET", f"{prefix}{API}/changes?since={since}&wait={wait}", headers=key
                )
                return status, hdrs, body["data"], time.monotonic() - started

            got = []
            waiters = [
                threading.Thread(target=lambda: got.append(relayed(0, 15))) for _ in range(2)
            ]
            for t in waiters:
                t.start()
            wait_for(lambda: feed_waiting(server, headers=key) == 2)
            status, headers, d, took = relayed(0, 15)  # relayed waits: half the relay's workers
            assert (status, d["retryAfter"], headers["Retry-After"]) == (200, 1, "1")
            assert took < 3
            status, _, body = relay.request("GET", f"{prefix}{API}/notes", headers=key)
            assert status == 200  # still answered through the relay
            sent = time.monotonic()
            server.request(
                "POST", f"{API}/notes", {"path": "notes/r.md", "content": "via relay"}, key
            )
            for t in waiters:
                t.join(20)
            assert time.monotonic() - sent < 5
            assert [g[0] for g in got] == [200, 200]
            for g in got:
                assert [(c["kind"], c["path"]) for c in g[2]["changes"]] == [
                    ("created", "notes/r.md")
                ]
            status, _, body = relay.request("GET", f"{prefix}{API}/changes?since=5", headers=key)
            assert status == 410
            assert body["error"]["resetRequired"] is True
        finally:
            server.stop()
            relay.stop()

    def test_waiting_feeds_do_not_hold_up_a_stopping_server(self, tmp_path):
        server = Server(tmp_path, "--auth-mode", "none")
        try:

            def poll() -> None:
                with contextlib.suppress(OSError, http.client.HTTPException):
                    long_poll(server, 0, 25)  # cut off, or answered: either way at once

            t = threading.Thread(target=poll)
            t.start()
            wait_for(lambda: feed_waiting(server) == 1)
            started = time.monotonic()
            server.proc.terminate()
            assert server.proc.wait(10) == 0
            assert time.monotonic() - started < 3  # waitress waits 5 s for busy threads
            t.join(30)
            assert not t.is_alive()
        finally:
            server.stop()

    def test_a_full_disk_during_a_history_write_is_507_and_changes_nothing(self, tmp_path):
        if os.geteuid() != 0 or not shutil.which("mount"):
            pytest.skip("mounting a small tmpfs needs root")
        disk = tmp_path / "disk"
        disk.mkdir()
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(disk)],
            capture_output=True,
            timeout=10,
        )
        if mounted.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode()[:200]}")
        try:
            with running(disk, "--auth-mode", "none") as server:
                big = "x" * 60000
                url = note_url("notes/big.md")
                assert (
                    server.request(
                        "POST", f"{API}/notes", {"path": "notes/big.md", "content": big}
                    )[0]
                    == 201
                )
                assert server.request("PUT", url, {"content": big + "!"})[0] == 200
                vid = server.request("GET", url + "/versions")[2]["data"]["versions"][0]["id"]
                wait_for((disk / ".notesvc" / "index").is_dir)  # the index is open
                before = server.request("GET", f"{API}/changes")[2]["data"]["last"]
                filler = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
                try:
                    with contextlib.suppress(OSError):
                        while True:
                            os.write(filler, b"\0" * 4096)
                finally:
                    os.close(filler)
                attempts = [
                    ("PATCH", url + "/move", {"path": "notes/moved.md"}),  # copies the content
                    ("DELETE", url, None),
                    ("PUT", url, {"content": big + "?"}),
                    ("POST", f"{url}/versions/{vid}/restore", None),
                ]
                for method, target, body in attempts:
                    status, _, answer = server.request(method, target, body)
                    assert status == 507, (method, answer)
                    assert answer["error"]["code"] == "INSUFFICIENT_STORAGE"
                assert (disk / "notes" / "big.md").read_text() == big + "!"
                assert not (disk / "notes" / "moved.md").exists()
                listing = server.request("GET", url + "/versions")[2]["data"]
                assert [v["id"] for v in listing["versions"]] == [vid]
                assert server.request("GET", f"{API}/trash")[2]["data"]["items"] == []
                assert server.request("GET", f"{API}/changes")[2]["data"]["last"] == before
                assert [p for p in disk.rglob("*") if p.name.startswith(".tmp-")] == []
                os.unlink(disk / "filler")
                assert server.request("PUT", url, {"content": "small"})[0] == 200
                changes = server.request("GET", f"{API}/changes?since={before}")[2]["data"]
                assert [c["seq"] for c in changes["changes"]] == [before + 1]
            assert "Traceback" not in "".join(server.lines)
        finally:
            subprocess.run(["umount", str(disk)], capture_output=True, timeout=10)


class TestHeadStore:
    """The history's copies of the notes as last seen: one compressed SQLite file."""

    def test_an_older_historys_copies_move_into_one_file(self, make_app, root):
        path, old = "notes/a/plan.md", b"# Plan\n\nthe text before\n"
        (root / "notes/a").mkdir(parents=True)
        (root / path).write_bytes(old)
        history = root / ".notesvc/history"
        folder = history / hashlib.sha256(path.encode()).hexdigest()[:32]
        folder.mkdir(parents=True)
        etag = notesvc.make_etag(old)[1:-1]
        (folder / "head").write_bytes(f"{etag} {path}\n".encode() + old)
        (root / path).write_bytes(b"# Plan\n\nchanged by another program\n")
        client = with_key(make_app())  # its first check finds the outside edit
        svc = client.app.service
        assert not (folder / "head").exists()
        assert (history / "heads.db").is_file()
        assert stat.S_IMODE((history / "heads.db").stat().st_mode) == 0o600
        assert version_contents(client, path) == [old.decode()]  # what the edit replaced
        assert svc.history.read_head(path) == (root / path).read_bytes()

    def test_a_first_start_keeps_a_small_starting_copy(self, make_app, root):
        words = "garden kitchen river mountain coffee recipe letter market".split()
        total = 0
        for i in range(300):
            text = f"# Note {i}\n\n" + " ".join(words[(i + k) % 8] for k in range(300)) + "\n"
            (root / f"notes/f{i % 10}").mkdir(parents=True, exist_ok=True)
            (root / f"notes/f{i % 10}/n{i}.md").write_text(text)
            total += len(text)
        client = with_key(make_app())
        svc = client.app.service
        svc.sync_index()
        history = root / ".notesvc/history"
        assert len(list(history.iterdir())) <= 3  # heads.db (and its log): no folder per note
        svc.history.heads.close()  # the log folded into the file, as at a stop
        used = sum(p.stat().st_size for p in history.rglob("*") if p.is_file())
        assert used <= 0.5 * total, (used, total)
        assert svc.history.read_head("notes/f3/n3.md") == (root / "notes/f3/n3.md").read_bytes()
        assert svc.history.heads._run("SELECT count(*) FROM pack")[0][0] == 3  # 100 a pack
        svc.history.heads._run("UPDATE pack SET data = ?", (b"x\x9c torn",))
        assert svc.history.read_head("notes/f3/n3.md") is None  # a damaged copy: unknown
