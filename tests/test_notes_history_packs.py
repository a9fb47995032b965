"""History's packs and heads: packing, races, origins, attacks (src/notesvc/notes/history.py)."""

from __future__ import annotations

import hashlib
import random
import sqlite3
import stat
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import zlib
from pathlib import Path

import pytest

from conftest import (
    API,
    Server,
    assert_error,
    data,
    note_url,
    notesvc,
    put_note,
    running,
    update,
    version_contents,
    versions_of,
    versions_of_raw,
    wait_for,
    with_key,
)


def history_folder_of(root: Path, path: str) -> Path:
    return root / ".notesvc/history" / hashlib.sha256(path.encode()).hexdigest()[:32]


def loose_versions(root: Path) -> list:
    """Return the versions kept as files anywhere in the history."""
    history = root / ".notesvc/history"
    return [f for f in history.rglob("*") if f.is_file() and notesvc.VERSION_ID_RE.match(f.name)]


class TestVersionPacks:
    """Versions a sweep found settled move from their files into one compressed,
    content-addressed SQLite file (git's loose objects and packs)."""

    @staticmethod
    def edited(make_app, edits: int = 30, **settings):
        """A note edited `edits` times, a line changed each time; the app's clock in hand."""
        client = with_key(make_app(**settings))
        svc = client.app.service
        now = [time.time()]
        svc.history.clock = lambda: now[0]
        lines = [
            f"Line {i}: the garden by the river needs water and some care.\n" for i in range(300)
        ]
        put_note(client, "notes/long.md", "# Long\n\n" + "".join(lines))
        for i in range(edits):
            lines[(i * 37) % 300] = f"Line changed in edit {i}.\n"
            update(client, "notes/long.md", "# Long\n\n" + "".join(lines))
        return client, svc, now

    @pytest.mark.slow
    def test_a_settled_history_is_packed_to_a_fraction_and_reads_the_same(self, make_app, root):
        client, svc, now = self.edited(make_app)
        before = versions_of(client, "notes/long.md")
        contents = version_contents(client, "notes/long.md")
        loose_bytes = sum(f.stat().st_size for f in loose_versions(root))
        assert before["total"] == len(loose_versions(root)) == 30
        svc.notes.sweep_history()  # younger than an hour: they stay files
        assert len(loose_versions(root)) == 30
        now[0] += 2 * 3600
        svc.notes.sweep_history()
        assert loose_versions(root) == []
        assert not history_folder_of(root, "notes/long.md").exists()  # no folder, no file each
        db = root / ".notesvc/history/versions.db"
        assert stat.S_IMODE(db.stat().st_mode) == 0o600
        svc.history.close()  # the log folded into the file, as at a stop
        assert db.stat().st_size <= loose_bytes / 10, (db.stat().st_size, loose_bytes)
        assert versions_of(client, "notes/long.md") == before  # ids, sizes, etags, reasons
        assert version_contents(client, "notes/long.md") == contents
        first, last = before["versions"][-1]["id"], before["versions"][0]["id"]
        diff = data(client.get(f"{note_url('notes/long.md')}/versions/{first}/diff?against={last}"))
        assert "+Line changed in edit 28." in diff["diff"]
        info = data(client.get(f"{API}/system/info"))["history"]
        assert (info["notes"], info["versions"]) == (1, 30)
        etag = client.get(note_url("notes/long.md")).headers["ETag"]
        client.post(
            f"{note_url('notes/long.md')}/versions/{first}/restore", headers={"If-Match": etag}
        )
        assert data(client.get(note_url("notes/long.md")))["content"] == contents[-1]
        assert versions_of(client, "notes/long.md")["total"] == 31  # a new loose one, beside

    def test_the_same_content_is_kept_once(self, make_app, root):
        client = with_key(make_app())
        svc = client.app.service
        now = [time.time()]
        svc.history.clock = lambda: now[0]
        for name in ("a", "b", "c"):
            put_note(client, f"notes/{name}.md", "# Template\n\nthe same first text\n")
            update(client, f"notes/{name}.md", f"# {name}\n\nits own text\n")
        now[0] += 2 * 3600
        svc.notes.sweep_history()
        packs = svc.history.packs
        assert packs._run("SELECT count(*) FROM version")[0][0] == 3
        assert packs._run("SELECT count(*) FROM object")[0][0] == 1
        for name in ("a", "b", "c"):
            assert version_contents(client, f"notes/{name}.md") == [
                "# Template\n\nthe same first text\n"
            ]

    @pytest.mark.slow
    def test_retention_drops_packed_versions_and_tidies_the_packs(self, make_app, root):
        client, svc, now = self.edited(make_app, SERVICE_HISTORY_DAYS="1")
        contents = version_contents(client, "notes/long.md")
        now[0] += 2 * 3600
        svc.notes.sweep_history()
        packs = svc.history.packs
        assert packs._run("SELECT count(*) FROM pack")[0][0] == 1
        (whole,) = packs._run("SELECT size FROM pack")[0]
        svc.history.close()  # the log folded into the file, as at a stop
        db = root / ".notesvc/history/versions.db"
        full = db.stat().st_size
        now[0] += 2 * 86400
        svc.history.max_versions = 5
        assert svc.notes.sweep_history() == 25
        svc.history.close()
        assert db.stat().st_size < full  # the freed pages went back
        assert version_contents(client, "notes/long.md") == contents[:5]
        assert packs._run("SELECT count(*) FROM object")[0][0] == 5  # the others collected
        (size,) = packs._run("SELECT size FROM pack")[0]  # rewritten: mostly dead
        assert size < whole / 2
        current = data(client.get(note_url("notes/long.md")))["content"]
        update(client, "notes/long.md", "# Long\n\nshort now\n")  # a save applies it too
        assert version_contents(client, "notes/long.md") == [current, *contents[:4]]
        client.delete(note_url("notes/long.md"))
        svc.history.max_versions = 1
        now[0] += 2 * 86400
        svc.notes.sweep_history()
        assert versions_of(client, "notes/long.md")["total"] == 1

    def test_a_packed_history_follows_its_note_across_moves_and_restores(self, make_app, root):
        client, svc, now = self.edited(make_app, edits=3)
        contents = version_contents(client, "notes/long.md")
        now[0] += 2 * 3600
        svc.notes.sweep_history()
        assert loose_versions(root) == []
        client.patch_json(f"{note_url('notes/long.md')}/move", {"path": "notes/moved.md"})
        assert version_contents(client, "notes/moved.md")[1:] == contents  # and "moved"
        versions_of_raw(client, "notes/long.md", 404)  # nothing left under the old path
        now[0] += 2 * 3600
        svc.notes.sweep_history()  # the "moved" version packed too: all in the packs
        client.delete(note_url("notes/moved.md"))
        put_note(client, "notes/moved.md", "someone else's note now")
        item = data(client.get(f"{API}/trash"))["items"][0]
        client.post_json(f"{API}/trash/{item['id']}/restore", {"path": "notes/back.md"})
        assert version_contents(client, "notes/back.md")[-3:] == contents  # copied along
        assert version_contents(client, "notes/moved.md")[-3:] == contents  # and still there

    def test_a_damaged_pack_shows_no_wrong_version(self, make_app, root, caplog):
        client, svc, now = self.edited(make_app, edits=3)
        now[0] += 2 * 3600
        svc.notes.sweep_history()
        packs = svc.history.packs
        (data_,) = packs._run("SELECT data FROM pack")[0]
        torn = zlib.compress(zlib.decompress(data_).replace(b"garden", b"GARDEN", 1), 9)
        packs._run("UPDATE pack SET data = ?", (torn,))
        found = versions_of(client, "notes/long.md")["versions"]
        oldest = found[-1]["id"]  # its text comes first in the pack: the one changed
        resp = client.get(f"{note_url('notes/long.md')}/versions/{oldest}", status=404)
        assert_error(resp, 404, "NOT_FOUND")
        assert "damaged" in caplog.text
        assert data(client.get(f"{note_url('notes/long.md')}/versions/{found[0]['id']}"))["content"]

    def test_versions_stay_files_when_the_packs_cannot_be_written(self, make_app, root, caplog):
        client, svc, now = self.edited(make_app, edits=3)
        contents = version_contents(client, "notes/long.md")
        (root / ".notesvc/history/versions.db").mkdir()  # not a file: SQLite cannot open it
        now[0] += 2 * 3600
        svc.notes.sweep_history()
        assert len(loose_versions(root)) == 3
        assert version_contents(client, "notes/long.md") == contents
        assert "not packed" in caplog.text
        client.patch_json(f"{note_url('notes/long.md')}/move", {"path": "notes/moved.md"})
        assert version_contents(client, "notes/moved.md")[1:] == contents  # files move on

    def test_a_crash_between_packing_and_removing_the_files_lists_each_version_once(
        self, make_app, root
    ):
        client, svc, now = self.edited(make_app, edits=3)
        before = versions_of(client, "notes/long.md")
        files = {f: f.read_bytes() for f in loose_versions(root)}
        now[0] += 2 * 3600
        svc.notes.sweep_history()
        for f, raw in files.items():  # as if the process had died before the unlinks
            f.parent.mkdir(mode=0o700, exist_ok=True)
            f.write_bytes(raw)
        svc.history._changed(next(iter(files)).parent)
        assert versions_of(client, "notes/long.md") == before
        svc.notes.sweep_history()
        assert loose_versions(root) == []
        assert versions_of(client, "notes/long.md") == before


@pytest.mark.real_server
@pytest.mark.slow
def test_a_server_packs_an_older_historys_version_files_and_keeps_them_across_a_kill(tmp_path):
    """A history written before packs (one file per version, days old) is packed by the
    server's first sweep; a SIGKILL right after loses none of it."""
    root, path = tmp_path / "srv", "notes/old.md"
    (root / "notes").mkdir(parents=True)
    (root / path).write_text("# Old\n\nnow\n")
    folder = history_folder_of(root, path)
    folder.mkdir(parents=True)
    texts = [f"# Old\n\nversion {i}\n" + "the same long paragraph again. " * 50 for i in range(20)]
    start_us = int((time.time() - 3 * 86400) * 1_000_000)
    for i, text in enumerate(texts):
        raw = text.encode()
        (folder / f"{start_us + i:016d}-updated-{notesvc.make_etag(raw)[1:-1]}").write_bytes(raw)
    url = note_url(path) + "/versions"
    with running(root, "--auth-mode", "none") as server:
        wait_for(lambda: not loose_versions(root), timeout=20)
        server.proc.kill()
        server.proc.wait(10)
    with running(root, "--auth-mode", "none") as server:
        found = server.request("GET", url + "?limit=100")[2]["data"]["versions"]
        assert len(found) == 20
        got = [server.request("GET", f"{url}/{v['id']}")[2]["data"]["content"] for v in found]
        assert got == texts[::-1]


class TestVersionPacksRaces:
    """What a folder grant may see, and what a sweep racing a save, a move or a read
    does, when versions are packed (found by a review of the packs)."""

    @staticmethod
    def app(make_app):
        client = with_key(make_app())
        svc = client.app.service
        now = [time.time()]
        svc.history.clock = lambda: now[0]
        return client, svc, now

    @staticmethod
    def family_sees(client, path: str) -> list:
        grant = {"name": "family", "scope": "read", "folder": "notes/family"}
        family = with_key(
            client, data(client.post_json(f"{API}/auth/keys", grant, status=201))["key"]
        )
        seen = versions_of(family, path)["versions"]
        return [data(family.get(f"{note_url(path)}/versions/{v['id']}"))["content"] for v in seen]

    def private_note(self, make_app, packed: bool = False):
        client, svc, now = self.app(make_app)
        put_note(client, "notes/private/plan.md", "# Plan\n\nthe safe's code is 4711\n")
        update(client, "notes/private/plan.md", "# Plan\n\nnothing here\n")
        if packed:  # an hour on, swept: its versions packed
            now[0] += 2 * 3600
            svc.notes.sweep_history()
        return client, svc, now

    @staticmethod
    def move(client, new: str = "notes/family/plan.md"):
        client.patch_json(f"{note_url('notes/private/plan.md')}/move", {"path": new})

    @staticmethod
    def family_key(client):
        grant = {"name": "family", "scope": "write", "folder": "notes/family"}
        return with_key(
            client, data(client.post_json(f"{API}/auth/keys", grant, status=201))["key"]
        )

    def secret_moved_in(self, make_app, packed: bool = True):
        client, svc, now = self.private_note(make_app, packed)
        self.move(client)
        (secret,) = [
            v["id"]
            for v in versions_of(client, "notes/family/plan.md")["versions"]
            if "4711"
            in data(client.get(f"{note_url('notes/family/plan.md')}/versions/{v['id']}"))["content"]
        ]
        return client, svc, now, secret

    def test_a_packed_history_moved_into_a_grants_folder_shows_it_nothing_from_before(
        self, make_app, root
    ):
        client, svc, now = self.private_note(make_app)
        now[0] += 2 * 3600
        svc.notes.sweep_history()
        assert not history_folder_of(root, "notes/private/plan.md").exists()  # only packed
        self.move(client)
        assert len(version_contents(client, "notes/family/plan.md")) == 2  # the owner: all
        assert not any("4711" in t for t in self.family_sees(client, "notes/family/plan.md"))

    @pytest.mark.parametrize("packed", [False, True])
    def test_a_restore_from_the_trash_into_a_grants_folder_shows_it_nothing_from_before(
        self, make_app, root, packed
    ):
        client, _svc, _now = self.private_note(make_app, packed)
        client.delete(note_url("notes/private/plan.md"))
        item = data(client.get(f"{API}/trash"))["items"][0]
        client.post_json(f"{API}/trash/{item['id']}/restore", {"path": "notes/family/plan.md"})
        assert any("4711" in t for t in version_contents(client, "notes/family/plan.md"))
        assert not any("4711" in t for t in self.family_sees(client, "notes/family/plan.md"))

    def test_a_sweep_that_cannot_read_the_packs_keeps_the_origins(
        self, make_app, root, monkeypatch
    ):
        client, svc, now = self.private_note(make_app)
        self.move(client)
        now[0] += 2 * 3600
        svc.notes.sweep_history()  # all packed: the folder stays for its origins
        folder = history_folder_of(root, "notes/family/plan.md")
        assert (folder / "origins").exists()

        def broken(*args, **kwargs):
            raise notesvc.HeadStoreError("disk I/O error")

        with monkeypatch.context() as m:  # versions.db unreadable for one sweep
            m.setattr(svc.history.packs, "_run", broken)
            svc.notes.sweep_history()
        assert (folder / "origins").exists()
        assert not any("4711" in t for t in self.family_sees(client, "notes/family/plan.md"))

    def test_a_move_that_fails_halfway_shows_a_grant_nothing_from_before(
        self, make_app, root, monkeypatch
    ):
        client, svc, now = self.private_note(make_app)
        now[0] += 2 * 3600
        svc.notes.sweep_history()
        move = svc.history.packs.move

        def move_then_fail(*args, **kwargs):  # a kill or a failed rename after the commit
            move(*args, **kwargs)
            raise OSError("the process stops here")

        monkeypatch.setattr(svc.history.packs, "move", move_then_fail)
        self.move(client)
        assert not any("4711" in t for t in self.family_sees(client, "notes/family/plan.md"))

    def test_a_version_read_while_a_sweep_rewrites_its_pack_is_still_read(
        self, make_app, root, monkeypatch
    ):
        client, svc, now = self.app(make_app)
        put_note(client, "notes/a.md", "# A\n\none\n")
        update(client, "notes/a.md", "# A\n\ntwo\n")
        now[0] += 2 * 3600
        svc.notes.sweep_history()
        update(client, "notes/a.md", "# A\n\nthree\n")
        etag = notesvc.make_etag(b"# A\n\none\n")
        (vid,) = [
            v["id"] for v in versions_of(client, "notes/a.md")["versions"] if v["etag"] == etag
        ]
        now[0] += 2 * 3600
        unpack, inside = notesvc.VersionPacks._unpack, []

        def sweep_first(blob, objects):  # the read has its row: the sweep rewrites the pack
            if not inside:
                inside.append(True)
                svc.notes.sweep_history()
            return unpack(blob, objects)

        monkeypatch.setattr(notesvc.VersionPacks, "_unpack", staticmethod(sweep_first))
        got = data(client.get(f"{note_url('notes/a.md')}/versions/{vid}"))
        assert got["content"] == "# A\n\none\n"
        assert inside

    def test_a_version_the_retention_drops_while_it_is_packed_stays_dropped(
        self, make_app, root, monkeypatch
    ):
        client, svc, now = self.app(make_app)
        svc.history.max_versions, svc.history.days = 2, 0
        put_note(client, "notes/a.md", "v0")
        for i in (1, 2):
            update(client, "notes/a.md", f"v{i}")
        now[0] += 2 * 3600
        add = svc.history.packs.add

        def save_meanwhile(folder, versions):  # a save under the note's lock: v0 dropped
            update(client, "notes/a.md", "v3")
            return add(folder, versions)

        monkeypatch.setattr(svc.history.packs, "add", save_meanwhile)
        svc.history.pack(history_folder_of(root, "notes/a.md"))
        svc.history._changed(history_folder_of(root, "notes/a.md"))
        assert version_contents(client, "notes/a.md") == ["v2", "v1"]

    def test_a_damaged_copy_in_the_packs_is_replaced_not_trusted(self, make_app, root, monkeypatch):
        client, svc, now = self.app(make_app)
        put_note(client, "notes/a.md", "shared text")
        update(client, "notes/a.md", "a2")
        now[0] += 2 * 3600
        svc.notes.sweep_history()
        packs = svc.history.packs
        (raw,) = packs._run("SELECT data FROM pack")[0]
        torn = zlib.compress(zlib.decompress(raw).replace(b"shared", b"SHARED"), 9)
        packs._run("UPDATE pack SET data = ?", (torn,))
        put_note(client, "notes/b.md", "shared text")
        update(client, "notes/b.md", "b2")
        monkeypatch.setattr(notesvc.VersionPacks, "PACK_BYTES", 4)  # a history past 1 MiB
        now[0] += 2 * 3600
        svc.notes.sweep_history()
        assert loose_versions(root) == []
        assert version_contents(client, "notes/b.md") == ["shared text"]
        assert version_contents(client, "notes/a.md") == ["shared text"]  # mended too


class TestVersionPacksOrigins:
    """Where each version was saved, through crashes, races and odd ids (a second review)."""

    app = staticmethod(TestVersionPacksRaces.app)
    family_sees = staticmethod(TestVersionPacksRaces.family_sees)
    family_key = staticmethod(TestVersionPacksRaces.family_key)
    private_note = TestVersionPacksRaces.private_note
    secret_moved_in = TestVersionPacksRaces.secret_moved_in
    move = staticmethod(TestVersionPacksRaces.move)

    def test_a_version_id_with_a_trailing_newline_reads_a_packed_version_past_origins(
        self, make_app, root
    ):
        client, _svc, _now, secret = self.secret_moved_in(make_app)
        family = self.family_key(client)
        family.get(f"{note_url('notes/family/plan.md')}/versions/{secret}", status=404)
        resp = family.get(
            f"{note_url('notes/family/plan.md')}/versions/{secret}%0A", expect_errors=True
        )
        assert "code is 4711" not in resp.text, resp.text[:300]

    def test_a_whole_folder_move_that_fails_after_the_rename_keeps_the_origins(
        self, make_app, root, monkeypatch
    ):
        client, svc, _now = self.private_note(make_app)  # loose versions: a whole-folder rename
        write = svc.history._write_origins

        def fail_once(*args, **kwargs):  # a kill (or ENOSPC) right after os.replace
            monkeypatch.setattr(svc.history, "_write_origins", write)
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(svc.history, "_write_origins", fail_once)
        self.move(client)
        assert not any("4711" in t for t in self.family_sees(client, "notes/family/plan.md"))

    @pytest.mark.slow
    def test_a_sweep_racing_a_move_in_keeps_the_origins(self, make_app, root, monkeypatch):
        client, svc, now = self.app(make_app)
        put_note(client, "notes/family/a.md", "# A\n")
        update(client, "notes/family/a.md", "# A\n\nv2\n")
        client.patch_json(f"{note_url('notes/family/a.md')}/move", {"path": "notes/family/plan.md"})
        now[0] += 2 * 3600
        svc.notes.sweep_history()  # packed: the folder stays for its origins
        client.patch_json(f"{note_url('notes/family/plan.md')}/move", {"path": "notes/family/x.md"})
        assert [f.name for f in history_folder_of(root, "notes/family/plan.md").iterdir()] == [
            "origins"
        ]  # left behind by the move: the next sweep removes it
        put_note(client, "notes/private/plan.md", "# Plan\n\nthe safe's code is 4711\n")
        update(client, "notes/private/plan.md", "# Plan\n\nnothing here\n")
        target = history_folder_of(root, "notes/family/plan.md")
        packed, done = svc.history._packed, []

        def move_in_meanwhile(folder, strict=False):  # the sweep found the folder empty
            found = packed(folder, strict)
            if strict and folder == target and not done:  # a move, from another request
                done.append(threading.Thread(target=self.move, args=(client,)))
                done[0].start()
                done[0].join(1.0)  # it lands now, unless it waits for the sweep's check
            return found

        monkeypatch.setattr(svc.history, "_packed", move_in_meanwhile)
        svc.notes.sweep_history()
        done[0].join(10)
        assert not any("4711" in t for t in self.family_sees(client, "notes/family/plan.md"))

    def test_a_move_while_the_packs_cannot_be_read_leaves_no_version_behind(
        self, make_app, root, monkeypatch
    ):
        client, svc, now = self.private_note(make_app)
        self.move(client)  # into the family folder: origins say where they were saved
        now[0] += 2 * 3600
        svc.notes.sweep_history()
        update(client, "notes/family/plan.md", "# Plan\n\nfamily text\n")
        update(client, "notes/family/plan.md", "# Plan\n\nfamily text, again\n")  # a loose one
        before = version_contents(client, "notes/family/plan.md")
        assert len(before) == 3
        ids, failed = svc.history.packs.ids, []

        def fail_once(folder):
            if not failed:
                failed.append(True)
                raise notesvc.HeadStoreError("database is locked")
            return ids(folder)

        monkeypatch.setattr(svc.history.packs, "ids", fail_once)
        client.patch_json(
            f"{note_url('notes/family/plan.md')}/move", {"path": "notes/family/other.md"}
        )
        assert failed  # the packs failed once, and were read again
        assert version_contents(client, "notes/family/other.md")[1:] == before  # none behind
        put_note(client, "notes/family/plan.md", "# a new note, where the old one was\n")
        assert not any("4711" in t for t in self.family_sees(client, "notes/family/plan.md"))

    def test_origins_that_cannot_be_read_show_a_grant_nothing(self, make_app, root, monkeypatch):
        client, _svc, _now = self.private_note(make_app)
        self.move(client)
        origins = history_folder_of(root, "notes/family/plan.md") / "origins"
        assert origins.exists()
        read_text = Path.read_text

        def emfile(self, *args, **kwargs):  # too many open files, an I/O error
            if self == origins:
                raise OSError(24, "Too many open files")
            return read_text(self, *args, **kwargs)

        monkeypatch.setattr(Path, "read_text", emfile)
        assert not any("4711" in t for t in self.family_sees(client, "notes/family/plan.md"))

    def test_a_version_loose_and_packed_stays_dropped_by_the_retention(self, make_app, root):
        client, svc, now = self.app(make_app)
        svc.history.max_versions, svc.history.days = 2, 0
        put_note(client, "notes/a.md", "v0")
        for i in (1, 2):
            update(client, "notes/a.md", f"v{i}")
        files = {f: f.read_bytes() for f in loose_versions(root)}
        now[0] += 2 * 3600
        svc.notes.sweep_history()
        for f, raw in files.items():  # a kill between the pack's commit and the unlinks
            f.parent.mkdir(mode=0o700, exist_ok=True)
            f.write_bytes(raw)
        svc.history._changed(next(iter(files)).parent)
        update(client, "notes/a.md", "v3")  # its retention drops v0
        svc.history._changed(next(iter(files)).parent)
        assert version_contents(client, "notes/a.md") == ["v2", "v1"]

    def test_an_origin_path_with_a_line_separator_is_read_whole(self, make_app, root):
        client, svc, _now = self.app(make_app)
        odd = "notes/family\u2028x/plan.md"  # U+2028: a path may hold it, splitlines() splits
        put_note(client, odd, "# Plan\n\nthe safe's code is 4711\n")
        update(client, odd, "# Plan\n\nnothing here\n")
        client.patch_json(f"{note_url(odd)}/move", {"path": "notes/family/plan.md"})
        assert (
            svc.history.saved_at(
                "notes/family/plan.md",
                versions_of(client, "notes/family/plan.md")["versions"][-1]["id"],
            )
            == odd
        )

    def test_a_large_old_history_is_packed_a_bounded_batch_at_a_time(
        self, make_app, root, monkeypatch
    ):
        _client, svc, now = self.app(make_app)
        svc.history.max_versions = 1000
        monkeypatch.setattr(notesvc.VersionPacks, "PACK_BYTES", 64 * 1024)
        folder = history_folder_of(root, "notes/old.md")
        folder.mkdir(parents=True)
        start = int((now[0] - 86400) * 1_000_000)
        for i in range(400):  # 400 x 8 KiB, one file each (a history from before packs)
            raw = (f"version {i}\n" + "x" * 8192).encode()
            (folder / f"{start + i:016d}-updated-{notesvc._etag_hex(raw)}").write_bytes(raw)
        add, held = svc.history.packs.add, []

        def measured(name, versions):  # what one transaction (the store's lock) takes in
            held.append(sum(len(d) for _, d in versions))
            return add(name, versions)

        monkeypatch.setattr(svc.history.packs, "add", measured)
        svc.notes.sweep_history()
        assert loose_versions(root) == []
        assert max(held) <= 4 * notesvc.VersionPacks.PACK_BYTES, held  # not all 3.2 MB at once


class TestVersionPacksAttacks:
    """What a third review of the packs found (an attacker's ids, races, a power cut)."""

    app = staticmethod(TestVersionPacksRaces.app)
    family_key = staticmethod(TestVersionPacksRaces.family_key)
    private_note = TestVersionPacksRaces.private_note
    secret_moved_in = TestVersionPacksRaces.secret_moved_in
    move = staticmethod(TestVersionPacksRaces.move)

    @pytest.mark.parametrize("how", ["get", "diff", "against", "restore"])
    def test_a_version_id_in_other_digits_reads_a_packed_version_past_origins(
        self, make_app, root, how
    ):
        client, _svc, _now, secret = self.secret_moved_in(make_app)
        family = self.family_key(client)
        url = f"{note_url('notes/family/plan.md')}/versions"
        family.get(f"{url}/{secret}", status=404)
        odd = "".join(chr(0xFF10 + int(c)) for c in secret[:16]) + secret[16:]  # fullwidth
        assert not notesvc.VERSION_ID_RE.match(odd)  # an id's digits are ASCII
        assert odd != secret
        q = urllib.parse.quote
        if how == "get":
            text = family.get(f"{url}/{q(odd)}", expect_errors=True).text
        elif how == "diff":
            text = family.get(f"{url}/{q(odd)}/diff", expect_errors=True).text
        elif how == "against":
            update(family, "notes/family/plan.md", "# Plan\n\nthe family's text\n")
            update(family, "notes/family/plan.md", "# Plan\n\nthe family's, again\n")
            (mine,) = [v["id"] for v in versions_of(family, "notes/family/plan.md")["versions"]]
            text = family.get(f"{url}/{mine}/diff?against={q(odd)}", expect_errors=True).text
        else:
            etag = family.get(note_url("notes/family/plan.md")).headers["ETag"]
            family.post(f"{url}/{q(odd)}/restore", headers={"If-Match": etag}, expect_errors=True)
            text = family.get(note_url("notes/family/plan.md")).text
        assert "code is 4711" not in text, text[:300]

    @pytest.mark.parametrize("packed", [False, True])
    def test_a_listing_racing_a_move_in_shows_no_version_from_outside(
        self, make_app, root, monkeypatch, packed
    ):
        client, svc, _now = self.private_note(make_app, packed)
        family = self.family_key(client)
        put_note(client, "notes/family/other.md", "# Other\n")  # the grant sees something
        target = history_folder_of(root, "notes/family/plan.md")
        origins, moved = svc.history._origins, []

        def move_meanwhile(folder):  # the owner moves the note in right after this read
            found = origins(folder)
            if folder == target and not moved:
                moved.append(threading.Thread(target=self.move, args=(client,)))
                moved[0].start()
                moved[0].join(10)
            return found

        monkeypatch.setattr(svc.history, "_origins", move_meanwhile)
        resp = family.get(f"{note_url('notes/family/plan.md')}/versions", expect_errors=True)
        assert moved
        assert not moved[0].is_alive()
        secret = notesvc._etag_hex(b"# Plan\n\nthe safe's code is 4711\n")
        assert secret not in resp.text, resp.text[:400]  # its etag: 4 digits to guess

    @pytest.mark.parametrize("packed", [False, True])
    def test_a_read_racing_a_move_in_shows_no_version_from_outside(
        self, make_app, root, monkeypatch, packed
    ):
        client, svc, _now = self.private_note(make_app, packed)
        (secret,) = [  # its id, as a listing that raced a move in showed it (see above)
            v["id"]
            for v in versions_of(client, "notes/private/plan.md")["versions"]
            if "4711"
            in data(client.get(f"{note_url('notes/private/plan.md')}/versions/{v['id']}"))[
                "content"
            ]
        ]
        family = self.family_key(client)
        read, moved = svc.history.read, []

        def move_meanwhile(path, vid):  # the owner moves the note in just before this read
            if not moved:
                moved.append(threading.Thread(target=self.move, args=(client,)))
                moved[0].start()
                moved[0].join(10)
            return read(path, vid)

        monkeypatch.setattr(svc.history, "read", move_meanwhile)
        url = f"{note_url('notes/family/plan.md')}/versions/{secret}"
        resp = family.get(url, expect_errors=True)
        assert moved
        assert not moved[0].is_alive()
        assert "code is 4711" not in resp.text, resp.text[:300]

    def test_a_merge_based_on_a_version_from_outside_tells_a_grant_nothing(self, make_app, root):
        client, _svc, _now = self.private_note(make_app)
        self.move(client)  # loose or packed alike: merge reads versions past their origins
        family = self.family_key(client)
        secret = notesvc.make_etag(b"# Plan\n\nthe safe's code is 4711\n")  # its etag, as a
        url = f"{note_url('notes/family/plan.md')}/merge"  # listing that raced a move showed
        answers = []
        for guess in ("1234", "4711"):  # right: "merged"; wrong: 409 (an oracle on the text)
            body = {"base": secret, "content": f"# Plan\n\nthe safe's code is {guess}\n\nmore\n"}
            answers.append(family.post_json(url, body, expect_errors=True).status_int)
        assert answers[0] == answers[1], answers

    @pytest.mark.slow
    def test_a_move_with_a_damaged_packed_row_takes_every_version_along(self, make_app, root):
        client, svc, now = self.app(make_app)
        put_note(client, "notes/a.md", "v0")
        for i in (1, 2, 3):
            now[0] += 1
            update(client, "notes/a.md", f"v{i}")
        now[0] += 2 * 3600
        svc.notes.sweep_history()
        assert loose_versions(root) == []
        before = version_contents(client, "notes/a.md")
        assert before == ["v2", "v1", "v0"]
        name = bytes.fromhex(history_folder_of(root, "notes/a.md").name)
        (at0, oid0), (at1, _) = svc.history.packs._run(
            "SELECT at, object FROM version ORDER BY at LIMIT 2"
        )
        with svc.history.packs._transaction() as db:  # a row _vids leaves out (damaged)
            db.execute(
                "INSERT INTO version VALUES (?, ?, 'renamed', ?)", (name, (at0 + at1) // 2, oid0)
            )
        assert version_contents(client, "notes/a.md") == before  # left out, as it should be
        client.patch_json(f"{note_url('notes/a.md')}/move", {"path": "notes/b.md"})
        assert version_contents(client, "notes/b.md")[1:] == before
        versions_of_raw(client, "notes/a.md", 404)  # nothing readable left behind

    def test_a_versions_db_of_another_format_answers_no_500(self, make_app, root):
        client, svc, now = self.app(make_app)
        put_note(client, "notes/a.md", "# A\n\none\n")
        update(client, "notes/a.md", "# A\n\ntwo\n")
        db = root / ".notesvc/history/versions.db"
        other = sqlite3.connect(db)  # the same tables, other types (ids as hex text)
        other.execute("CREATE TABLE version (folder, at, reason, object)")
        other.execute("CREATE TABLE object (id, pack, start, size)")
        other.execute("CREATE TABLE pack (id INTEGER PRIMARY KEY, size, data)")
        folder = bytes.fromhex(history_folder_of(root, "notes/a.md").name)
        other.execute(
            "INSERT INTO version VALUES (?, 1700000000000000, 'updated', ?)", (folder, "ab" * 16)
        )
        other.execute("INSERT INTO object VALUES (?, 1, NULL, NULL)", ("ab" * 16,))
        other.execute("INSERT INTO pack VALUES (1, 5, 'hello')")
        other.commit()
        other.close()
        url = f"{note_url('notes/a.md')}/versions"
        assert client.get(url, expect_errors=True).status_int < 500
        odd = "1700000000000000-updated-" + "ab" * 16
        assert client.get(f"{url}/{odd}", expect_errors=True).status_int < 500
        moved = f"{note_url('notes/a.md')}/move"
        assert client.patch_json(moved, {"path": "notes/b.md"}, expect_errors=True).status_int < 500
        now[0] += 2 * 3600
        svc.notes.sweep_history()  # raised: every sweep (and the trash's purge) stops here


@pytest.mark.real_server
@pytest.mark.slow
def test_a_server_killed_while_it_packs_an_old_history_loses_no_version(tmp_path):
    """SIGKILL a server in the middle of its first sweep's packing (some versions packed,
    some still files): after a restart every version reads back whole."""
    root, path = tmp_path / "srv", "notes/big.md"
    (root / "notes").mkdir(parents=True)
    (root / path).write_text("# Big\n\nnow\n")
    folder = history_folder_of(root, path)
    folder.mkdir(parents=True)
    rnd = random.Random(3)
    start_us = int((time.time() - 3 * 86400) * 1_000_000)
    texts = {}
    for i in range(600):  # 12 MB that zlib cannot shrink much: a dozen batches to pack
        raw = f"# Big {i}\n\n".encode() + rnd.randbytes(20_000).hex().encode()[:20_000]
        vid = f"{start_us + i:016d}-updated-{notesvc._etag_hex(raw)}"
        (folder / vid).write_bytes(raw)
        texts[vid] = raw.decode()
    server = Server(root, "--auth-mode", "none", env={"SERVICE_HISTORY_MAX_VERSIONS": "1000"})
    try:
        wait_for(lambda: len(loose_versions(root)) < 600, timeout=20, step=0.002)
        server.proc.kill()  # mid-sweep: no clean-up
        server.proc.wait(10)
    finally:
        server.stop()
    left = len(loose_versions(root))
    url = note_url(path) + "/versions"
    with running(root, "--auth-mode", "none", env={"SERVICE_HISTORY_MAX_VERSIONS": "1000"}) as s:
        found = s.request("GET", url + "?limit=1000")[2]["data"]["versions"]
        assert {v["id"] for v in found} == set(texts), left
        for v in found[::37]:
            assert s.request("GET", f"{url}/{v['id']}")[2]["data"]["content"] == texts[v["id"]]
    assert 0 < left < 600  # it was killed in the middle
