"""The trash and the change feed (src/notesvc/notes/trash.py)."""

from __future__ import annotations

import re
import stat
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from conftest import (
    API,
    PNG,
    assert_error,
    att_url,
    data,
    feed,
    note_url,
    notesvc,
    put_note,
    save_by_channel,
    search,
    tmp_path_factory_root,
    trash_items,
    update,
    upload,
    version_contents,
    wait_for,
    web_channel,
    with_key,
)


def plant_in_trash(root: Path, path: str, content: bytes, when: float | None = None) -> Path:
    """Put a file into the trash the way a delete does (attachments' deletes included)."""
    stamp = time.strftime("%Y%m%dT%H%M%S.000000Z", time.gmtime(when or time.time()))
    target = root / ".notesvc" / "trash" / stamp / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(content)
    return target


class TestTrash:
    def test_list_read_restore_and_purge(self, client, root):
        put_note(client, "notes/t/one.md", "# One")
        put_note(client, "notes/t/two.md", "# Two")
        gone = data(client.delete(note_url("notes/t/one.md")))
        client.delete(note_url("notes/t/two.md"))
        listing = data(client.get(f"{API}/trash"))
        assert (listing["total"], listing["limit"], listing["offset"]) == (2, 100, 0)
        two, one = listing["items"]  # the most recent first
        assert (one["path"], two["path"]) == ("notes/t/one.md", "notes/t/two.md")
        assert one["id"] == gone["trashId"]
        assert set(one) == {"id", "path", "kind", "deletedAt", "size"}
        assert (one["kind"], one["size"]) == ("note", 5)
        assert re.fullmatch(r"[A-Za-z0-9_-]+", one["id"])
        assert "notes" not in one["id"]
        item = data(client.get(f"{API}/trash/{one['id']}"))
        assert item["content"] == "# One"
        assert item["path"] == "notes/t/one.md"
        rec = data(client.post(f"{API}/trash/{one['id']}/restore"))
        assert rec["path"] == "notes/t/one.md"
        assert rec["content"] == "# One"
        assert data(client.get(note_url("notes/t/one.md")))["content"] == "# One"
        assert search(client, "one")["total"] == 1
        assert feed(client)["changes"][-1]["kind"] == "restored"
        assert data(client.delete(f"{API}/trash/{two['id']}")) == {"id": two["id"], "purged": True}
        assert trash_items(client) == []
        assert_error(client.get(f"{API}/trash/{two['id']}", status=404), 404, "NOT_FOUND")
        assert_error(client.delete(f"{API}/trash/{two['id']}", status=404), 404, "NOT_FOUND")
        assert list((root / ".notesvc" / "trash").iterdir()) == []  # emptied folders go

    def test_restore_refuses_a_taken_path_and_restores_elsewhere_with_its_history(self, client):
        put_note(client, "notes/x.md", "old 1")
        update(client, "notes/x.md", "old 2")
        client.delete(note_url("notes/x.md"))
        put_note(client, "notes/x.md", "a new note there")
        (item,) = trash_items(client)
        url = f"{API}/trash/{item['id']}/restore"
        err = assert_error(client.post(url, status=409), 409, "CONFLICT")
        assert '"path"' in err["message"]
        taken = client.post_json(url, {"path": "notes/x.md"}, status=409)
        assert_error(taken, 409, "CONFLICT")
        rec = data(client.post_json(url, {"path": "notes/elsewhere/x.md"}))
        assert rec["content"] == "old 2"
        assert version_contents(client, "notes/elsewhere/x.md") == ["old 2", "old 1"]
        assert version_contents(client, "notes/x.md") == ["old 2", "old 1"]  # still its own
        assert data(client.get(note_url("notes/x.md")))["content"] == "a new note there"

    def test_restoring_to_its_own_free_path_brings_its_history_back(self, client):
        put_note(client, "notes/y.md", "y1")
        update(client, "notes/y.md", "y2")
        client.delete(note_url("notes/y.md"))
        (item,) = trash_items(client)
        client.post(f"{API}/trash/{item['id']}/restore")
        update(client, "notes/y.md", "y3")
        assert version_contents(client, "notes/y.md") == ["y2", "y1"]

    def test_bad_ids_bodies_and_paths(self, client):
        put_note(client, "notes/z.md", "z")
        client.delete(note_url("notes/z.md"))
        (item,) = trash_items(client)
        url = f"{API}/trash/{item['id']}/restore"
        for garbage in ("nope", "x" * 300 + "-0123456789abcdef", "%00", "..", "a-b"):
            assert_error(client.get(f"{API}/trash/{garbage}", status=400), 400, "VALIDATION_ERROR")
            resp = client.post(f"{API}/trash/{garbage}/restore", status=400)
            assert_error(resp, 400, "VALIDATION_ERROR")
            resp = client.delete(f"{API}/trash/{garbage}", status=400)
            assert_error(resp, 400, "VALIDATION_ERROR")
        for method in ("get", "delete"):  # a decoded %2F leaves no such route
            resp = getattr(client, method)(f"{API}/trash/..%2F..%2Fstate.json", status=404)
            assert_error(resp, 404, "NOT_FOUND")
        for bad in ("limit=0", "limit=1001", "offset=-1", "limit=ten"):
            resp = client.get(f"{API}/trash?{bad}", status=400)
            assert_error(resp, 400, "VALIDATION_ERROR")
        unknown = "20240101T000000000000Z-0123456789abcdef"
        assert_error(client.post(f"{API}/trash/{unknown}/restore", status=404), 404, "NOT_FOUND")
        resp = client.post(url, b"{not json", content_type="application/json", status=400)
        assert_error(resp, 400, "VALIDATION_ERROR")
        for body in ([1], {"path": 5}, {"path": ["notes/a.md"]}, {"path": ""}):
            assert_error(client.post_json(url, body, status=400), 400, "VALIDATION_ERROR")
        for hostile in (
            "notes/../../state.json",
            "/etc/passwd",
            "notes/.notesvc/x.md",
            "attachments/cat.png",  # a note goes back under notes/
            "notes/a\u200b.md",
        ):
            resp = client.post_json(url, {"path": hostile}, status=400)
            assert_error(resp, 400, "VALIDATION_ERROR")
        resp = client.post(url, "x", content_type="text/plain", status=415)
        assert_error(resp, 415, "UNSUPPORTED_MEDIA_TYPE")
        big = {"path": "notes/a.md", "pad": "x" * 1_100_000}
        assert_error(client.post_json(url, big, status=413), 413, "PAYLOAD_TOO_LARGE")
        assert len(trash_items(client)) == 1  # nothing happened

    def test_an_item_whose_path_breaks_the_rules_is_restored_only_elsewhere(self, client, root):
        plant_in_trash(root, "notes/a:b.md", b"planted by hand")
        (item,) = trash_items(client)
        url = f"{API}/trash/{item['id']}/restore"
        assert_error(client.post(url, status=400), 400, "VALIDATION_ERROR")
        assert not (root / "notes" / "a:b.md").exists()
        rec = data(client.post_json(url, {"path": "notes/ab.md"}))
        assert rec["content"] == "planted by hand"

    def test_items_older_than_trash_days_are_purged(self, make_app, root):
        client = with_key(make_app(SERVICE_TRASH_DAYS="1"))
        put_note(client, "notes/old.md", "old")
        client.delete(note_url("notes/old.md"))
        trash = client.app.service.trash
        assert trash.purge_expired() == 0
        trash.clock = lambda: time.time() + 2 * 86400  # the injectable clock
        assert trash.purge_expired() == 1
        assert trash_items(client) == []
        keeper = with_key(make_app(tmp_path_factory_root(root), SERVICE_TRASH_DAYS="0"))
        put_note(keeper, "notes/k.md", "k")
        keeper.delete(note_url("notes/k.md"))
        keeper.app.service.trash.clock = lambda: time.time() + 3650 * 86400
        assert keeper.app.service.trash.purge_expired() == 0

    def test_an_expired_item_goes_when_the_server_starts(self, make_app, root):
        make_app()
        planted = plant_in_trash(root, "notes/ancient.md", b"x", when=time.time() - 40 * 86400)
        fresh = plant_in_trash(root, "notes/recent.md", b"y")
        client = with_key(make_app())
        wait_for(lambda: not planted.exists(), timeout=10)
        assert fresh.exists()
        assert [i["path"] for i in trash_items(client)] == ["notes/recent.md"]

    def test_a_trashed_attachment_is_listed_and_restored_as_a_file(self, client, root):
        png = b"\x89PNG\r\n\x1a\n" + bytes(range(256))
        plant_in_trash(root, "attachments/photos/cat.png", png)
        (item,) = trash_items(client)
        assert (item["kind"], item["path"], item["size"]) == (
            "attachment",
            "attachments/photos/cat.png",
            len(png),
        )
        assert data(client.get(f"{API}/trash/{item['id']}"))["content"] is None
        url = f"{API}/trash/{item['id']}/restore"
        for wrong in (
            "notes/cat.md",
            "attachments/../x.png",
            "attachments/.h/x.png",
            "attachments/cat.exe",  # not an allowed kind of attachment
        ):
            resp = client.post_json(url, {"path": wrong}, status=400)
            assert_error(resp, 400, "VALIDATION_ERROR")
        (root / "attachments" / "photos").mkdir(parents=True)
        (root / "attachments" / "photos" / "cat.png").write_bytes(b"another cat")
        assert_error(client.post(url, status=409), 409, "CONFLICT")
        rec = data(client.post_json(url, {"path": "attachments/photos/cat-2.png"}))
        assert rec["path"] == "attachments/photos/cat-2.png"
        assert rec["size"] == len(png)
        assert rec["contentType"] == "image/png"
        served = client.get(f"{API}/attachments/" + urllib.parse.quote(rec["path"], safe=""))
        assert served.body == png
        assert served.headers["ETag"] == rec["etag"]
        assert (root / "attachments" / "photos" / "cat-2.png").read_bytes() == png
        assert (root / "attachments" / "photos" / "cat.png").read_bytes() == b"another cat"
        assert trash_items(client) == []
        assert data(client.get(f"{API}/system/info"))["history"]["notes"] == 0  # none kept

    def test_a_deleted_attachment_comes_back_from_the_trash(self, client, root):
        upload(client, "attachments/trip/photo.png")
        gone = data(client.delete(att_url("attachments/trip/photo.png")))
        (item,) = trash_items(client)
        assert (item["id"], item["kind"], item["path"]) == (
            gone["trashId"],
            "attachment",
            "attachments/trip/photo.png",
        )
        assert stat.S_IMODE((root / ".notesvc" / "trash").stat().st_mode) == 0o700
        rec = data(client.post(f"{API}/trash/{item['id']}/restore"))
        assert rec["path"] == "attachments/trip/photo.png"
        assert client.get(att_url("attachments/trip/photo.png")).body == PNG
        assert trash_items(client) == []
        assert feed(client)["changes"] == []  # the feed is about notes

    def test_a_restore_cannot_escape_through_a_symbolic_link(self, client, root, tmp_path):
        outside = tmp_path / "outside"
        outside.mkdir()
        plant_in_trash(root, "attachments/evil/x.png", b"x")
        (root / "attachments").mkdir()
        (root / "attachments" / "evil").symlink_to(outside)
        (item,) = trash_items(client)
        resp = client.post(f"{API}/trash/{item['id']}/restore", status=400)
        assert_error(resp, 400, "VALIDATION_ERROR")
        assert list(outside.iterdir()) == []
        plant_in_trash(root, "notes/evil/n.md", b"n")
        (root / "notes" / "evil").symlink_to(outside)
        note = next(i for i in trash_items(client) if i["kind"] == "note")
        resp = client.post(f"{API}/trash/{note['id']}/restore", status=400)
        assert_error(resp, 400, "VALIDATION_ERROR")
        assert list(outside.iterdir()) == []


class TestChanges:
    def test_every_kind_of_change_in_order(self, client):
        assert feed(client) == {"changes": [], "last": 0, "more": False}
        put_note(client, "notes/f.md", "a")
        update(client, "notes/f.md", "b")
        client.patch_json(note_url("notes/f.md") + "/move", {"path": "notes/g.md"})
        client.delete(note_url("notes/g.md"))
        (item,) = trash_items(client)
        client.post(f"{API}/trash/{item['id']}/restore")
        d = feed(client)
        assert d["last"] == 5
        assert d["more"] is False
        assert [(c["seq"], c["kind"], c["path"]) for c in d["changes"]] == [
            (1, "created", "notes/f.md"),
            (2, "updated", "notes/f.md"),
            (3, "moved", "notes/g.md"),
            (4, "deleted", "notes/g.md"),
            (5, "restored", "notes/g.md"),
        ]
        moved, deleted = d["changes"][2], d["changes"][3]
        assert moved["from"] == "notes/f.md"
        assert moved["etag"] == notesvc.make_etag(b"b")
        assert "etag" not in deleted
        assert "from" not in deleted
        for c in d["changes"]:
            assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", c["at"])
        page = feed(client, since=1, limit=2)
        assert [c["seq"] for c in page["changes"]] == [2, 3]
        assert (page["last"], page["more"]) == (3, True)
        assert feed(client, since=5) == {"changes": [], "last": 5, "more": False}

    def test_channels_plugins_and_link_rewrites_are_in_the_feed(self, client):
        channel = web_channel(client)
        save_by_channel(client, channel, "/save an idea")  # creates today's daily note
        client.post(f"{API}/plugins/daily/today", status=200)  # which is there already
        save_by_channel(client, channel, "/save another")
        put_note(client, "notes/t.md", "# T")
        put_note(client, "notes/l.md", "[[t]]")
        client.patch_json(
            note_url("notes/t.md") + "/move", {"path": "notes/u.md", "updateLinks": True}
        )
        kinds = [(c["kind"], c["path"].split("/")[1]) for c in feed(client)["changes"]]
        assert kinds == [
            ("created", "daily"),
            ("updated", "daily"),
            ("created", "t.md"),
            ("created", "l.md"),
            ("moved", "u.md"),
            ("updated", "l.md"),
        ]

    def test_bad_cursors_and_parameters(self, client):
        put_note(client, "notes/a.md", "a")
        for bad in (
            "since=-1",
            "since=x",
            "since=1.5",
            "since=99999999999",
            "wait=26",
            "wait=-1",
            "limit=0",
            "limit=1001",
            "since=%00",
        ):
            resp = client.get(f"{API}/changes?{bad}", status=400)
            assert_error(resp, 400, "VALIDATION_ERROR")
        err = assert_error(client.get(f"{API}/changes?since=2", status=410), 410, "GONE")
        assert err["resetRequired"] is True
        assert "since=1" in err["message"]

    def test_since_latest_gives_the_cursor_alone(self, client):
        for name in ("a", "b", "c"):
            put_note(client, f"notes/{name}.md", name)
        latest = data(client.get(f"{API}/changes?since=latest"))
        assert latest == {"changes": [], "last": 3, "more": False}
        assert data(client.get(f"{API}/changes?since=3"))["changes"] == []
        put_note(client, "notes/d.md", "d")  # followed from there: the next change only
        assert [c["path"] for c in feed(client, 3)["changes"]] == ["notes/d.md"]
        for bad in ("since=Latest", "since=latest1", "since=-1"):
            assert_error(client.get(f"{API}/changes?{bad}", status=400), 400, "VALIDATION_ERROR")

    def test_410_after_compaction_and_the_journal_survives_a_restart(self, make_app, root):
        client = with_key(make_app())
        client.app.service.journal.keep = 3  # injectable, as the clocks
        for i in range(8):
            put_note(client, f"notes/c{i}.md", "x")
        journal = client.app.service.journal
        assert journal.floor > 0
        err = assert_error(client.get(f"{API}/changes?since=0", status=410), 410, "GONE")
        assert err["resetRequired"] is True
        d = feed(client, since=journal.floor)
        assert d["changes"][-1]["seq"] == 8
        again = with_key(make_app())
        assert again.app.service.journal.floor == journal.floor
        put_note(again, "notes/after.md", "y")
        assert feed(again, since=8)["changes"][0]["seq"] == 9
        client.get(f"{API}/changes?since=0", status=410)
        log_file = root / ".notesvc" / "changes.log"
        assert stat.S_IMODE(log_file.stat().st_mode) == 0o600

    def test_a_torn_last_line_is_dropped_and_numbering_goes_on(self, make_app, root):
        client = with_key(make_app())
        put_note(client, "notes/a.md", "a")
        put_note(client, "notes/b.md", "b")
        log_file = root / ".notesvc" / "changes.log"
        raw = log_file.read_bytes()
        end = raw.index(b"\0") if b"\0" in raw else len(raw)
        with open(log_file, "r+b") as f:  # a crash in the middle of the next line
            f.seek(end)
            f.write(b'{"seq":3,"kind":"upd')
        again = with_key(make_app())
        assert feed(again)["last"] == 2
        put_note(again, "notes/c.md", "c")
        put_note(again, "notes/d.md", "d")
        third = with_key(make_app())
        assert [c["path"] for c in feed(third)["changes"]] == [
            "notes/a.md",
            "notes/b.md",
            "notes/c.md",
            "notes/d.md",
        ]

    def test_an_unreadable_journal_starts_over_with_410_for_old_cursors(self, make_app, root):
        client = with_key(make_app())
        put_note(client, "notes/a.md", "a")
        put_note(client, "notes/b.md", "b")
        log_file = root / ".notesvc" / "changes.log"
        log_file.write_bytes(b"garbage\n" + log_file.read_bytes().split(b"\n", 1)[1])
        again = with_key(make_app())
        assert_error(again.get(f"{API}/changes?since=1", status=410), 410, "GONE")
        put_note(again, "notes/c.md", "c")
        assert feed(again, since=2)["changes"][0]["seq"] == 3

    @pytest.mark.slow
    def test_with_history_off_a_rebuilt_index_resets_the_feed(self, make_app, root):
        client = with_key(make_app(SERVICE_HISTORY_MAX_VERSIONS="0"))
        put_note(client, "notes/a.md", "a")
        (root / ".notesvc" / "index.cache").unlink(missing_ok=True)
        again = with_key(make_app(SERVICE_HISTORY_MAX_VERSIONS="0"))
        assert_error(again.get(f"{API}/changes?since=0", status=410), 410, "GONE")
        assert feed(again, since=1)["changes"] == []

    def test_max_waiters_setting(self):
        cfg = notesvc.load_config(env={"SERVICE_THREADS": "8"})
        assert cfg.max_waiters == 4
        assert notesvc.load_config(env={"SERVICE_THREADS": "1"}).max_waiters == 0
        assert notesvc.load_config(env={"SERVICE_MAX_WAITERS": "7"}).max_waiters == 7
        for bad in ("8", "x", "-1", "256"):
            with pytest.raises(notesvc.ConfigError, match="SERVICE_MAX_WAITERS"):
                notesvc.load_config(env={"SERVICE_MAX_WAITERS": bad})
        for name in ("HISTORY_MAX_VERSIONS", "HISTORY_DAYS", "TRASH_DAYS"):
            with pytest.raises(notesvc.ConfigError, match=name):
                notesvc.load_config(env={f"SERVICE_{name}": "-1"})
