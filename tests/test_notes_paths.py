"""Path rules for notes, folders and attachments (src/notesvc/notes/paths.py)."""

from __future__ import annotations

import json
import os
import time
import types
import urllib.error
import urllib.parse
import urllib.request

import pytest

from conftest import API, HOSTILE_PATHS, assert_error, data, note_url, notesvc, put_note, update


class TestHostilePaths:
    @pytest.mark.parametrize(("path", "rule"), HOSTILE_PATHS)
    @pytest.mark.slow
    def test_body_path_is_refused_naming_the_rule(self, client, root, path, rule):
        resp = client.post_json(f"{API}/notes", {"path": path, "content": "x"}, status=400)
        assert rule in assert_error(resp, 400, "VALIDATION_ERROR")["message"]
        assert not (root / "etc").exists()

    @pytest.mark.parametrize(("path", "rule"), [p for p in HOSTILE_PATHS if "\x00" not in p[0]])
    def test_url_path_is_refused(self, client, path, rule):
        resp = client.get(
            f"{API}/notes/" + urllib.parse.quote(path, safe=""), status="*", expect_errors=True
        )
        # An empty or bare path is no note route at all; everything else is a 400.
        assert resp.status_int in (400, 404) if path in ("", "notes/") else resp.status_int == 400
        assert resp.json["success"] is False

    @pytest.mark.parametrize(
        "raw",
        [
            "/api/v1/notes/notes%2F%2E%2E%2F%2E%2E%2Fsecret.md",
            "/api/v1/notes/notes%2F..%2Fsecret.md",
            "/api/v1/notes/notes/%2e%2e/secret.md",
            "/api/v1/notes/%2Fetc%2Fpasswd",
            "/api/v1/notes/notes%5C..%5Csecret.md",
            "/api/v1/notes/notes%2Fa%00.md",
        ],
    )
    def test_encoded_traversal_in_url_is_400(self, client, raw):
        assert_error(client.get(raw, status=400), 400, "VALIDATION_ERROR")

    def test_symlink_escape_is_refused(self, client, root, tmp_path):
        outside = tmp_path / "outside"
        outside.mkdir()
        (outside / "secret.md").write_text("top secret")
        os.symlink(outside, root / "notes" / "link")
        os.symlink(outside / "secret.md", root / "notes" / "file.md")
        for path in ("notes/link/secret.md", "notes/file.md"):
            resp = client.get(note_url(path), status=400)
            assert "outside" in assert_error(resp, 400, "VALIDATION_ERROR")["message"]
            assert "top secret" not in resp.text
        resp = client.post_json(
            f"{API}/notes", {"path": "notes/link/new.md", "content": "x"}, status=400
        )
        assert_error(resp, 400, "VALIDATION_ERROR")
        assert sorted(os.listdir(outside)) == ["secret.md"]
        resp = client.put_json(note_url("notes/file.md"), {"content": "pwned"}, status=400)
        assert (outside / "secret.md").read_text() == "top secret"
        listed = data(client.get(f"{API}/notes"))
        assert listed["total"] == 0  # links are not followed in listings
        assert "secret" not in client.get(f"{API}/folders/tree").text

    def test_a_link_inside_the_folder_is_read_and_one_planted_later_is_refused(
        self, client, root, tmp_path
    ):
        """The descriptor is opened, then the kernel says where it leads (/proc/self/fd on
        Linux): a link that stays inside is read, one leading out is 400, and a note read
        before (kept by the read cache) that becomes such a link is refused, not served."""
        put_note(client, "notes/real/a.md", "# A\n\ninside")
        os.symlink(root / "notes" / "real", root / "notes" / "alias")
        assert data(client.get(note_url("notes/alias/a.md")))["content"] == "# A\n\ninside"
        outside = tmp_path / "outside"
        outside.mkdir()
        (outside / "b.md").write_text("top secret")
        put_note(client, "notes/b.md", "mine")
        old = time.time() - 60
        os.utime(root / "notes" / "b.md", (old, old))
        store = client.app.service.notes
        store.cache.RACY_SECONDS = 0  # ctime cannot be set back: keep it even though new
        assert data(client.get(note_url("notes/b.md")))["content"] == "mine"
        assert "notes/b.md" in store.cache._items
        os.unlink(root / "notes" / "b.md")
        os.symlink(outside / "b.md", root / "notes" / "b.md")
        resp = client.get(note_url("notes/b.md"), status=400)
        assert "outside" in assert_error(resp, 400, "VALIDATION_ERROR")["message"]
        assert "top secret" not in resp.text
        os.symlink(outside / "gone", root / "notes" / "dangling.md")  # 400, not 404
        assert_error(client.get(note_url("notes/dangling.md"), status=400), 400, "VALIDATION_ERROR")

    def test_the_read_cache_gives_a_note_again_only_while_its_file_is_unchanged(self, client, root):
        store = client.app.service.notes
        put_note(client, "notes/c.md", "# C\n\none")
        path = root / "notes" / "c.md"
        assert data(client.get(note_url("notes/c.md")))["content"] == "# C\n\none"
        assert "notes/c.md" not in store.cache._items  # written just now: racy, not kept
        store.cache.RACY_SECONDS = 0
        client.get(note_url("notes/c.md"))
        assert "notes/c.md" in store.cache._items
        mtime = path.stat().st_mtime_ns
        with open(path, "r+b") as f:  # another editor, in place, same size, same mtime
            f.write(b"# C\n\ntwo")
        os.utime(path, ns=(mtime, mtime))
        got = data(client.get(note_url("notes/c.md")))
        assert got["content"] == "# C\n\ntwo"  # ctime changed: read again
        assert got["etag"] == notesvc.make_etag(b"# C\n\ntwo")
        update(client, "notes/c.md", "# C\n\nthree")  # our own write: a new inode
        assert data(client.get(note_url("notes/c.md")))["content"] == "# C\n\nthree"
        path.unlink()
        assert_error(client.get(note_url("notes/c.md"), status=404), 404, "NOT_FOUND")

    def test_the_read_cache_holds_at_most_its_budget(self):
        cache = notesvc.ReadCache()
        cache.RACY_SECONDS = 0
        cache.MAX_BYTES = 1000
        for i in range(30):
            fake = types.SimpleNamespace(
                st_dev=1, st_ino=i, st_size=100, st_mtime_ns=0, st_ctime_ns=0
            )
            cache.put(f"notes/{i}.md", fake, {"content": "x" * 100})
        assert len(cache._items) == 10
        assert cache._bytes == 1000
        assert next(iter(cache._items)) == "notes/20.md"  # the least recent went first
        big = types.SimpleNamespace(
            st_dev=1, st_ino=99, st_size=cache.MAX_NOTE_BYTES + 1, st_mtime_ns=0, st_ctime_ns=0
        )
        cache.put("notes/big.md", big, {})
        assert "notes/big.md" not in cache._items

    def test_the_read_cache_keeps_a_gets_answer_once_and_counts_it(self, tmp_path):
        cache = notesvc.ReadCache()
        cache.RACY_SECONDS = 0
        files = {}
        for name in ("a", "b"):
            files[name] = tmp_path / f"{name}.md"
            files[name].write_text(name * 100)
            os.utime(files[name], (time.time() - 60,) * 2)
        rec = {"path": "notes/a.md", "etag": '"ea"', "content": "a" * 100}
        assert cache.answer("notes/a.md", files["a"]) is None  # nothing kept yet
        cache.put("notes/a.md", files["a"].stat(), rec)
        etag, body = cache.answer("notes/a.md", files["a"])
        assert etag == '"ea"'
        assert json.loads(body) == {"success": True, "data": rec}
        assert cache._bytes == 100 + len(body)
        assert cache.answer("notes/a.md", files["a"])[1] is body  # encoded once
        cache.MAX_BYTES = 100 + len(body) + 99  # b's 100 bytes do not fit beside a's answer
        cache.put("notes/b.md", files["b"].stat(), {"etag": '"eb"'})
        assert list(cache._items) == ["notes/b.md"]
        assert cache._bytes == 100
        cache.put("notes/a.md", files["a"].stat(), rec)
        files["a"].write_text("c" * 100)  # changed on disk: no answer kept for it
        assert cache.answer("notes/a.md", files["a"]) is None

    def test_move_target_is_checked_too(self, client, root, tmp_path):
        put_note(client, "notes/a.md")
        outside = tmp_path / "outside"
        outside.mkdir()
        os.symlink(outside, root / "notes" / "link")
        for target in ("../a.md", "notes/../a.md", "notes/link/a.md"):
            resp = client.patch_json(note_url("notes/a.md") + "/move", {"path": target}, status=400)
            assert_error(resp, 400, "VALIDATION_ERROR")
        assert os.listdir(outside) == []

    def test_file_standing_where_a_folder_should_be_is_409(self, client):
        put_note(client, "notes/a.md")
        (client.app.service.notes.root / "plain").write_text("file")
        resp = client.post_json(
            f"{API}/notes", {"path": "notes/plain/x.md", "content": "x"}, status=409
        )
        assert_error(resp, 409, "CONFLICT")
