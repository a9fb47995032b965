"""Notes on disk: the API, If-Match, storage safety, folders (src/notesvc/notes/store.py)."""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import os
import re
import shutil
import subprocess
import threading
import time

import pytest
import webtest

from conftest import (
    API,
    HOSTILE_PATHS,
    MiB,
    Server,
    assert_error,
    data,
    new_grant,
    note_url,
    notesvc,
    put_note,
    running,
    search,
    wait_for,
    with_key,
)


class TestNotes:
    def test_create_returns_201_record_location_and_etag(self, client, root):
        resp = put_note(client, "notes/ideas/new.md", "# Big idea\n\nbody")
        rec = data(resp)
        assert rec["path"] == "notes/ideas/new.md"
        assert rec["title"] == "Big idea"
        assert rec["content"] == "# Big idea\n\nbody"
        assert rec["size"] == len(b"# Big idea\n\nbody")
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", rec["modified"])
        assert resp.headers["ETag"] == rec["etag"]
        assert resp.headers["Location"] == note_url("notes/ideas/new.md")
        assert (root / "notes" / "ideas" / "new.md").read_text() == "# Big idea\n\nbody"

    def test_title_falls_back_to_file_name(self, client):
        assert data(put_note(client, "notes/plain.md", "no heading"))["title"] == "plain"

    def test_create_onto_existing_is_409_and_keeps_content(self, client, root):
        put_note(client, "notes/a.md", "first")
        resp = client.post_json(
            f"{API}/notes", {"path": "notes/a.md", "content": "second"}, status=409
        )
        assert_error(resp, 409, "CONFLICT")
        assert (root / "notes" / "a.md").read_text() == "first"

    @pytest.mark.parametrize(
        "body",
        [
            {"path": "notes/a.md"},
            {"path": 5, "content": "x"},
            {"path": "notes/a.md", "content": 5},
            {"path": "notes/a.md", "content": ["x"]},
            {"content": "x", "folder": 7},
            {"content": "x", "folder": "notes/../etc"},
            {"content": "x", "folder": "attachments/x"},
        ],
    )
    def test_create_with_missing_or_ill_typed_field_is_400(self, client, body):
        assert_error(client.post_json(f"{API}/notes", body, status=400), 400, "VALIDATION_ERROR")

    def test_lone_surrogate_content_is_400(self, client):
        raw = '{"path": "notes/s.md", "content": "\\ud800"}'
        resp = client.post(f"{API}/notes", raw, content_type="application/json", status=400)
        assert_error(resp, 400, "VALIDATION_ERROR")

    def test_unicode_paths_are_nfc_normalised(self, client):
        nfd = "notes/cafe\u0301.md"
        rec = data(put_note(client, nfd, "☕ Grüße"))
        assert rec["path"] == "notes/caf\u00e9.md"
        assert data(client.get(note_url("notes/caf\u00e9.md")))["content"] == "☕ Grüße"
        assert data(client.get(note_url(nfd)))["path"] == "notes/caf\u00e9.md"

    def test_get_accepts_encoded_and_plain_slashes(self, client):
        put_note(client, "notes/a/b/c.md", "deep")
        assert data(client.get(note_url("notes/a/b/c.md")))["content"] == "deep"
        assert data(client.get(f"{API}/notes/notes/a/b/c.md"))["content"] == "deep"

    def test_get_missing_is_404(self, client):
        assert_error(client.get(note_url("notes/none.md"), status=404), 404, "NOT_FOUND")

    def test_get_sets_etag(self, client):
        etag = data(put_note(client, "notes/e.md"))["etag"]
        assert client.get(note_url("notes/e.md")).headers["ETag"] == etag

    def test_list_sorted_paged_without_content(self, client):
        for name in ["c", "a", "b/z", "b/y", "d"]:
            put_note(client, f"notes/{name}.md", name)
        d = data(client.get(f"{API}/notes"))
        assert [n["path"] for n in d["notes"]] == [
            "notes/a.md",
            "notes/b/y.md",
            "notes/b/z.md",
            "notes/c.md",
            "notes/d.md",
        ]
        assert d["total"] == 5
        assert (d["limit"], d["offset"]) == (100, 0)
        assert all("content" not in n for n in d["notes"])
        assert set(d["notes"][0]) == {"path", "title", "size", "modified", "etag"}
        page = data(client.get(f"{API}/notes?limit=2&offset=1"))
        assert [n["path"] for n in page["notes"]] == ["notes/b/y.md", "notes/b/z.md"]
        assert page["total"] == 5
        sub = data(client.get(f"{API}/notes?folder=notes/b"))
        assert [n["path"] for n in sub["notes"]] == ["notes/b/y.md", "notes/b/z.md"]

    @pytest.mark.parametrize(
        "query",
        ["limit=0", "limit=1001", "limit=abc", "offset=-1", "folder=../x", "folder=other"],
    )
    def test_list_bad_parameters_are_400(self, client, query):
        resp = client.get(f"{API}/notes?{query}", status=400)
        assert_error(resp, 400, "VALIDATION_ERROR")

    def test_list_missing_folder_is_404(self, client):
        assert_error(client.get(f"{API}/notes?folder=notes/nope", status=404), 404, "NOT_FOUND")

    def test_update_replaces_content(self, client, root):
        put_note(client, "notes/u.md", "old")
        resp = client.put_json(note_url("notes/u.md"), {"content": "# New\nnew"})
        rec = data(resp)
        assert rec["content"] == "# New\nnew"
        assert rec["title"] == "New"
        assert resp.headers["ETag"] == rec["etag"]
        assert (root / "notes" / "u.md").read_text() == "# New\nnew"

    def test_update_missing_is_404_not_upsert(self, client, root):
        resp = client.put_json(note_url("notes/ghost.md"), {"content": "x"}, status=404)
        assert_error(resp, 404, "NOT_FOUND")
        assert not (root / "notes" / "ghost.md").exists()

    def test_update_with_other_path_points_at_move(self, client):
        put_note(client, "notes/p.md")
        resp = client.put_json(
            note_url("notes/p.md"), {"content": "x", "path": "notes/q.md"}, status=400
        )
        assert "/move" in assert_error(resp, 400, "VALIDATION_ERROR")["message"]
        client.put_json(note_url("notes/p.md"), {"content": "x", "path": "notes/p.md"})

    def test_update_without_content_is_400(self, client):
        put_note(client, "notes/p.md")
        resp = client.put_json(note_url("notes/p.md"), {"text": "x"}, status=400)
        assert_error(resp, 400, "VALIDATION_ERROR")

    def test_move_returns_record_with_from_and_prunes_folders(self, client, root):
        put_note(client, "notes/old/deep/m.md", "moving")
        rec = data(
            client.patch_json(
                note_url("notes/old/deep/m.md") + "/move", {"path": "notes/new/m2.md"}
            )
        )
        assert rec["path"] == "notes/new/m2.md"
        assert rec["from"] == "notes/old/deep/m.md"
        assert rec["content"] == "moving"
        assert (root / "notes" / "new" / "m2.md").read_text() == "moving"
        assert not (root / "notes" / "old").exists()
        assert (root / "notes").is_dir()

    def test_move_missing_is_404(self, client):
        resp = client.patch_json(
            note_url("notes/none.md") + "/move", {"path": "notes/x.md"}, status=404
        )
        assert_error(resp, 404, "NOT_FOUND")

    def test_move_never_overwrites(self, client, root):
        put_note(client, "notes/a.md", "A")
        put_note(client, "notes/b.md", "B")
        resp = client.patch_json(
            note_url("notes/a.md") + "/move", {"path": "notes/b.md"}, status=409
        )
        assert_error(resp, 409, "CONFLICT")
        assert (root / "notes" / "a.md").read_text() == "A"
        assert (root / "notes" / "b.md").read_text() == "B"

    @pytest.mark.parametrize("body", [{}, {"path": 3}, {"path": "notes/../x.md"}])
    def test_move_bad_body_is_400(self, client, body):
        put_note(client, "notes/a.md")
        resp = client.patch_json(note_url("notes/a.md") + "/move", body, status=400)
        assert_error(resp, 400, "VALIDATION_ERROR")

    def test_delete_moves_to_trash_and_prunes(self, client, root):
        put_note(client, "notes/gone/soon.md", "keep me somewhere")
        d = data(client.delete(note_url("notes/gone/soon.md")))
        assert d["path"] == "notes/gone/soon.md"
        assert d["deleted"] is True
        assert not (root / "notes" / "gone").exists()
        trashed = list((root / ".notesvc" / "trash").glob("*/notes/gone/soon.md"))
        assert len(trashed) == 1
        assert trashed[0].read_text() == "keep me somewhere"
        assert re.fullmatch(r"\d{8}T\d{6}\.\d{6}Z", trashed[0].parents[2].name)
        client.get(note_url("notes/gone/soon.md"), status=404)
        assert_error(client.delete(note_url("notes/gone/soon.md"), status=404), 404, "NOT_FOUND")

    def test_delete_twice_keeps_both_versions_in_trash(self, client, root):
        for text in ("one", "two"):
            put_note(client, "notes/t.md", text)
            client.delete(note_url("notes/t.md"))
        trashed = sorted(p.read_text() for p in (root / ".notesvc" / "trash").rglob("t.md"))
        assert trashed == ["one", "two"]

    def test_invalid_utf8_on_disk_is_a_clear_error(self, client, root):
        (root / "notes" / "bin.md").write_bytes(b"caf\xe9")
        resp = client.get(note_url("notes/bin.md"), status=409)
        assert "UTF-8" in assert_error(resp, 409, "CONFLICT")["message"]
        listed = data(client.get(f"{API}/notes"))["notes"]
        assert [n["path"] for n in listed] == ["notes/bin.md"]
        client.put_json(note_url("notes/bin.md"), {"content": "café"})  # fixing it works
        assert data(client.get(note_url("notes/bin.md")))["content"] == "café"

    def test_external_edits_are_seen_at_once(self, client, root):
        put_note(client, "notes/ext.md", "ours")
        (root / "notes" / "ext.md").write_text("# Theirs\nchanged by vim")
        (root / "notes" / "added").mkdir()
        (root / "notes" / "added" / "new.md").write_text("from syncthing")
        assert data(client.get(note_url("notes/ext.md")))["title"] == "Theirs"
        paths = [n["path"] for n in data(client.get(f"{API}/notes"))["notes"]]
        assert paths == ["notes/added/new.md", "notes/ext.md"]
        tree = data(client.get(f"{API}/folders/tree"))
        assert [c["name"] for c in tree["children"]] == ["added", "ext.md"]
        (root / "notes" / "ext.md").unlink()
        client.get(note_url("notes/ext.md"), status=404)
        assert data(client.get(f"{API}/notes"))["total"] == 1


class TestNotesForPeople:
    """Notes without paths, listings by date with titles and previews (docs/api.md: phone)."""

    @pytest.mark.parametrize(
        ("content", "name"),
        [
            ("# Apple pie\n\nflour\n", "Apple pie"),
            ("\n\nBuy milk: 2 l / 3 eggs?\nmore\n", "Buy milk 2 l 3 eggs"),
            ("some intro\n\n## Plan for May\n", "Plan for May"),
            ("---\ntitle: x\n---\nAfter the front matter\n", "After the front matter"),
            ("#!?*\n", "#!"),
            ("...\n", "untitled"),
            ("", "untitled"),
            ("\u202eevil\u202c name\u200b\n", "evil name"),
            ("# שלום עולם\n", "שלום עולם"),
            ("# 🍎 pie 🥧\n", "🍎 pie 🥧"),
            ("# Cafe\u0301\n", "Café"),
            ("   ..hidden.  \n", "hidden"),
        ],
    )
    @pytest.mark.slow
    def test_a_note_without_a_path_is_named_from_its_title(self, client, content, name):
        rec = data(client.post_json(f"{API}/notes", {"content": content}, status=201))
        assert rec["path"] == f"notes/inbox/{name}.md"
        assert rec["content"] == content

    def test_long_titles_are_cut_and_taken_names_numbered(self, client, root):
        long = "word " * 1000
        rec = data(client.post_json(f"{API}/notes", {"content": long}, status=201))
        name = rec["path"][len("notes/inbox/") : -3]
        assert len(name) <= 80
        assert len(name.encode()) <= 200
        put_note(client, "notes/ideas/Pie.md", "# Pie\n\nmine")
        paths = [
            data(client.post_json(f"{API}/notes", {"content": "# Pie\n", "folder": "notes/ideas"}))[
                "path"
            ]
            for _ in range(2)
        ]
        assert paths == ["notes/ideas/Pie 2.md", "notes/ideas/Pie 3.md"]
        assert (root / "notes" / "ideas" / "Pie.md").read_text() == "# Pie\n\nmine"  # untouched

    def test_a_folder_key_writes_into_its_own_folder(self, client, anon):
        key = with_key(anon, new_grant(client, "write", "notes/family")["key"])
        rec = data(key.post_json(f"{API}/notes", {"content": "# Gifts\n"}, status=201))
        assert rec["path"] == "notes/family/Gifts.md"
        rec = data(key.post_json(f"{API}/notes", {"content": "# Up\n", "folder": "notes"}))
        assert rec["path"] == "notes/family/Up.md"
        resp = key.post_json(
            f"{API}/notes", {"content": "# Out\n", "folder": "notes/work"}, status=404
        )
        assert_error(resp, 404, "NOT_FOUND")

    def test_the_listing_for_people_newest_first_with_previews_and_tags(self, client, root):
        for i, name in enumerate(("old", "mid", "new")):
            put_note(client, f"notes/{name}.md", f"# {name.title()}\n\n**Note** {i} #tag{i}\n")
            os.utime(root / "notes" / f"{name}.md", (1_700_000_000 + i, 1_700_000_000 + i))
        listing = data(client.get(f"{API}/notes?sort=modified&fields=title,preview,modified,tags"))
        assert [n["title"] for n in listing["notes"]] == ["New", "Mid", "Old"]
        assert listing["notes"][0]["preview"] == "Note 2 #tag2"
        assert listing["notes"][0]["tags"] == ["tag2"]
        assert "content" not in listing["notes"][0]
        plain = data(client.get(f"{API}/notes"))
        assert [n["path"] for n in plain["notes"]] == [
            "notes/mid.md",
            "notes/new.md",
            "notes/old.md",
        ]
        assert "preview" not in plain["notes"][0]
        for bad in ("sort=size", "fields=content", "fields=title,secret"):
            assert_error(client.get(f"{API}/notes?{bad}", status=400), 400, "VALIDATION_ERROR")


class TestIfMatch:
    def test_put_with_matching_etag_succeeds_and_stale_is_412(self, client):
        etag = data(put_note(client, "notes/m.md", "v1"))["etag"]
        new = client.put_json(note_url("notes/m.md"), {"content": "v2"}, headers={"If-Match": etag})
        resp = client.put_json(
            note_url("notes/m.md"), {"content": "v3"}, headers={"If-Match": etag}, status=412
        )
        assert_error(resp, 412, "PRECONDITION_FAILED")
        assert data(client.get(note_url("notes/m.md")))["content"] == "v2"
        client.put_json(
            note_url("notes/m.md"), {"content": "v3"}, headers={"If-Match": new.headers["ETag"]}
        )

    def test_star_and_lists_and_unquoted(self, client):
        etag = data(put_note(client, "notes/m.md", "v1"))["etag"]
        client.put_json(note_url("notes/m.md"), {"content": "v2"}, headers={"If-Match": "*"})
        etag = client.get(note_url("notes/m.md")).headers["ETag"]
        client.put_json(
            note_url("notes/m.md"), {"content": "v3"}, headers={"If-Match": f'"nope", {etag}'}
        )
        etag = client.get(note_url("notes/m.md")).headers["ETag"]
        client.put_json(
            note_url("notes/m.md"), {"content": "v4"}, headers={"If-Match": etag.strip('"')}
        )

    def test_move_and_delete_honour_if_match(self, client, root):
        put_note(client, "notes/m.md", "v1")
        stale = '"0000"'
        resp = client.patch_json(
            note_url("notes/m.md") + "/move",
            {"path": "notes/n.md"},
            headers={"If-Match": stale},
            status=412,
        )
        assert_error(resp, 412, "PRECONDITION_FAILED")
        assert_error(
            client.delete(note_url("notes/m.md"), headers={"If-Match": stale}, status=412),
            412,
            "PRECONDITION_FAILED",
        )
        assert (root / "notes" / "m.md").exists()
        etag = client.get(note_url("notes/m.md")).headers["ETag"]
        client.patch_json(
            note_url("notes/m.md") + "/move", {"path": "notes/n.md"}, headers={"If-Match": etag}
        )
        client.delete(note_url("notes/n.md"), headers={"If-Match": etag})

    def test_two_writers_with_same_etag_exactly_one_wins(self, client):
        etag = data(put_note(client, "notes/race.md", "start"))["etag"]
        barrier = threading.Barrier(2)
        results = []

        def writer(text):
            app = webtest.TestApp(client.app, extra_environ=client.extra_environ)
            barrier.wait()
            resp = app.put_json(
                note_url("notes/race.md"),
                {"content": text},
                headers={"If-Match": etag},
                expect_errors=True,
            )
            results.append((resp.status_int, text))

        threads = [threading.Thread(target=writer, args=(t,)) for t in ("left", "right")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(s for s, _ in results) == [200, 412]
        winner = next(text for s, text in results if s == 200)
        assert data(client.get(note_url("notes/race.md")))["content"] == winner


SLOW_PLUGIN = """
import pathlib
import time
import notesvc

def build(notes):
    pathlib.Path(__file__).with_name("slow.started").touch()  # for the test to see
    time.sleep(1.5)  # a plugin's slow computation over the notes
    return len(notes)

def count(svc):
    return {"notes": notesvc.derived(svc, "slow-count", build)}

PLUGIN = notesvc.Plugin(name="slow", routes=(notesvc.PluginRoute("GET", "/count", count),))
"""


BRACKET_NOTES = {  # 1 MiB notes that made the link scan quadratic
    "notes/open.md": "[" * MiB,
    "notes/wiki.md": "[[" * (MiB // 2),
    "notes/mixed.md": ("[](" * (MiB // 3) + "[[a|" + "](x.md" * 1000)[:MiB],
}


def timed(fn, *args):
    started = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - started


def tree_paths(node: dict) -> list:
    return [node["path"]] + [p for child in node.get("children", []) for p in tree_paths(child)]


class TestStorageSafety:
    """Huge notes, full disks, NFD names and crash leftovers (issue 10, items 4, 9, 10)."""

    @pytest.mark.parametrize(
        "unit", ["[", "[[", "[](", "](x.md", "[[a#b|c", "[](<a", '[](x "', "`", "```\n", "#1"]
    )
    @pytest.mark.slow
    def test_link_and_tag_scans_grow_linearly(self, unit):
        resolver = notesvc.LinkResolver(["notes/x.md", "notes/a.md"])

        def scan(size: int) -> float:
            """This thread's CPU seconds for the scans: what the other tests running beside
            it (another worker, their servers) do to the machine does not count."""
            text = (unit * (size // len(unit) + 1))[:size]
            started = time.thread_time()
            resolver.links(text, "notes/s.md")
            notesvc.rewrite_links(text, "notes/s.md", "notes/x.md", "notes/y.md", resolver)
            notesvc.note_tags(text)
            notesvc.note_title(text, "notes/s.md")
            return time.thread_time() - started

        small, big = scan(100 * 1024), scan(MiB)  # rewrite_links reads the whole MiB
        assert big < 1.0, f"{unit!r}: {big:.2f} s for 1 MiB"
        assert big < 30 * small + 0.05, f"{unit!r}: {small:.3f} s -> {big:.3f} s is not linear"

    def test_heading_scan_is_linear(self):
        text = "# a" + " " * MiB + "b"
        title, took = timed(notesvc.note_title, text, "notes/x.md")
        assert title.startswith("a")
        assert took < 0.5

    def test_scans_read_at_most_the_cap(self):
        far = "x" * notesvc.MAX_SCAN_CHARS
        resolver = notesvc.LinkResolver(["notes/a.md"])
        assert resolver.links("[[a]] " + far, "notes/s.md") == {"notes/a.md"}
        assert resolver.links(far + " [[a]]", "notes/s.md") == set()
        assert notesvc.note_tags(far + " #late") == set()

    @pytest.mark.slow
    def test_huge_bracket_notes_link_move_and_search_fast(self, make_app):
        client = with_key(make_app(SERVICE_MAX_BODY_BYTES=str(4 * MiB)))
        put_note(client, "notes/target.md", "# Target\n\nzebra")
        for path, text in BRACKET_NOTES.items():
            _, took = timed(put_note, client, path, "[[target]] zebra\n" + text)
            assert took < 2.0, f"creating {path} took {took:.2f} s"
        resp, took = timed(client.get, f"{API}/plugins/backlinks/notes%2Ftarget.md")
        assert sorted(b["path"] for b in data(resp)["backlinks"]) == sorted(BRACKET_NOTES)
        assert took < 2.0, f"backlinks took {took:.2f} s"
        resp, took = timed(
            client.patch_json,
            note_url("notes/target.md") + "/move",
            {"path": "notes/moved.md", "updateLinks": True},
        )
        assert sorted(data(resp)["linksUpdated"]) == sorted(BRACKET_NOTES)
        assert took < 2.0, f"the move took {took:.2f} s"
        assert data(client.get(note_url("notes/open.md")))["content"].startswith("[[moved]] zebra")
        resp, took = timed(client.get, f"{API}/search?q=zebra")
        assert data(resp)["total"] == 4
        assert took < 2.0, f"search took {took:.2f} s"
        _, took = timed(client.get, f"{API}/plugins/tags")
        assert took < 2.0, f"tags took {took:.2f} s"

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_search_is_answered_while_links_and_plugins_build(self, tmp_path):
        plugins = tmp_path / ".notesvc" / "plugins"
        plugins.mkdir(parents=True)
        (plugins / "slow.py").write_text(SLOW_PLUGIN)
        env = {"SERVICE_MAX_BODY_BYTES": str(4 * MiB)}
        with running(tmp_path, "--auth-mode", "none", env=env) as server:
            server.request("POST", f"{API}/notes", {"path": "notes/a.md", "content": "# A"})
            for path, text in BRACKET_NOTES.items():
                status, _, _ = server.request(
                    "POST", f"{API}/notes", {"path": path, "content": "[[a]] zebra " + text}
                )
                assert status == 201
            waits = []
            results = {}

            def ask(name: str, path: str) -> None:
                results[name] = timed(server.request, "GET", path)

            builders = [
                threading.Thread(target=ask, args=("slow", f"{API}/plugins/slow/count")),
                threading.Thread(
                    target=ask, args=("links", f"{API}/plugins/backlinks/notes%2Fa.md")
                ),
            ]
            for t in builders:
                t.start()
            wait_for((plugins / "slow.started").exists)  # the slow build is under way
            for _ in range(3):
                (status, _, body), took = timed(server.request, "GET", f"{API}/search?q=zebra")
                assert status == 200
                assert body["data"]["total"] == 3
                waits.append(took)
            for t in builders:
                t.join(30)
            assert results["slow"][0][2]["data"] == {"notes": 4}
            assert results["slow"][1] >= 1.5  # the build did run while we searched
            status, _, body = results["links"][0]
            assert status == 200
            assert sorted(b["path"] for b in body["data"]["backlinks"]) == sorted(BRACKET_NOTES)
            assert max(waits) < 0.5, f"searches waited {waits} during the builds"

    def test_disk_full_guard_turns_enospc_and_edquot_into_507(self):
        import errno

        for code in (errno.ENOSPC, errno.EDQUOT):
            with pytest.raises(notesvc.ApiError) as caught, notesvc.disk_writes():
                raise OSError(code, os.strerror(code))
            assert caught.value.status_code == 507
            assert caught.value.code == "INSUFFICIENT_STORAGE"
            assert caught.value.message == "the disk is full; nothing was changed"
            assert isinstance(caught.value, OSError)  # background savers still just log it
        with pytest.raises(PermissionError), notesvc.disk_writes():
            raise PermissionError(errno.EACCES, "denied")

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_full_disk_is_507_and_changes_nothing_real_server(self, tmp_path):
        if os.geteuid() != 0 or not shutil.which("mount"):
            pytest.skip("mounting a small tmpfs needs root")
        disk = tmp_path / "disk"
        disk.mkdir()
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)],
            capture_output=True,
            timeout=10,
        )
        if mounted.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode()[:200]}")
        try:
            with running(disk, "--auth-mode", "none") as server:
                url = note_url("notes/keep.md")
                status, _, _ = server.request(
                    "POST", f"{API}/notes", {"path": "notes/keep.md", "content": "old content"}
                )
                assert status == 201
                wait_for((disk / ".notesvc" / "index").is_dir)  # the index is open
                filler = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
                try:  # fill the disk to the last block
                    with contextlib.suppress(OSError):
                        while True:
                            os.write(filler, b"\0" * 4096)
                finally:
                    os.close(filler)
                big = "new content " * 2000
                status, _, body = server.request("PUT", url, {"content": big})
                assert status == 507, body
                assert body["error"] == {
                    "code": "INSUFFICIENT_STORAGE",
                    "message": "the disk is full; nothing was changed",
                }
                status, _, body = server.request(
                    "POST", f"{API}/notes", {"path": "notes/new/deep/x.md", "content": big}
                )
                assert status == 507
                assert (disk / "notes" / "keep.md").read_text() == "old content"
                assert not (disk / "notes" / "new").exists()
                leftovers = [p for p in disk.rglob("*") if p.name.startswith(".tmp-")]
                assert leftovers == []
                status, _, body = server.request("GET", url)
                assert status == 200
                assert body["data"]["content"] == "old content"
                status, _, body = server.request("GET", f"{API}/search?q=old")
                assert status == 200
                assert body["data"]["total"] == 1
            assert "Traceback" not in "".join(server.lines)
        finally:
            subprocess.run(["umount", str(disk)], capture_output=True, timeout=10)

    def test_nfd_named_note_is_reached_through_its_nfc_path(self, client, root):
        import unicodedata

        nfc_folder, nfc_name = "Café", "crème brûlée.md"
        nfd_folder = unicodedata.normalize("NFD", nfc_folder)
        nfd_name = unicodedata.normalize("NFD", nfc_name)
        assert nfd_name != nfc_name
        folder = root / "notes" / nfd_folder
        folder.mkdir(parents=True)
        (folder / nfd_name).write_text("# Dessert\n\ncaramelised sugar")
        client.app.service.sync_index()
        path = f"notes/{nfc_folder}/{nfc_name}"

        rec = data(client.get(note_url(path)))
        assert rec["path"] == path
        assert "caramelised" in rec["content"]
        assert [n["path"] for n in data(client.get(f"{API}/notes"))["notes"]] == [path]
        assert path in tree_paths(data(client.get(f"{API}/folders/tree")))
        assert [r["path"] for r in search(client, "caramelised")["results"]] == [path]

        client.put_json(note_url(path), {"content": "# Dessert\n\nburnt sugar"})
        assert os.listdir(root / "notes") == [nfd_folder]  # no NFC twin of the folder
        assert os.listdir(folder) == [nfd_name]  # updated in place, no duplicate
        assert (folder / nfd_name).read_text() == "# Dessert\n\nburnt sugar"
        assert [r["path"] for r in search(client, "burnt")["results"]] == [path]
        assert (
            client.post_json(f"{API}/notes", {"path": path, "content": "x"}, status=409).json[
                "error"
            ]["code"]
            == "CONFLICT"
        )

        moved = f"notes/{nfc_folder}/tarte.md"
        rec = data(client.patch_json(note_url(path) + "/move", {"path": moved}))
        assert rec["from"] == path
        assert sorted(os.listdir(folder)) == ["tarte.md"]  # into the NFD folder itself
        data(client.delete(note_url(moved)))
        assert not folder.exists()
        assert data(client.get(f"{API}/notes"))["total"] == 0

    def test_nfd_note_is_deleted_through_its_nfc_path(self, client, root):
        import unicodedata

        nfd = unicodedata.normalize("NFD", "é.md")
        (root / "notes").mkdir(parents=True, exist_ok=True)
        (root / "notes" / nfd).write_text("x")
        data(client.delete(note_url("notes/é.md")))
        assert os.listdir(root / "notes") == []

    def test_openapi_states_the_real_bounds_and_507(self, client):
        doc = client.get(f"{API}/openapi.json").json
        error = doc["components"]["schemas"]["Error"]["properties"]["error"]
        assert "INSUFFICIENT_STORAGE" in error["properties"]["code"]["enum"]
        listing = doc["paths"]["/api/v1/notes"]["get"]
        assert "507" in listing["responses"]["default"]["description"]
        params = {p["name"]: p["schema"] for p in listing["parameters"]}
        assert (params["limit"]["minimum"], params["limit"]["maximum"]) == (1, 1000)
        assert (params["offset"]["minimum"], params["offset"]["maximum"]) == (0, 10**9)
        search_params = doc["paths"]["/api/v1/search"]["get"]["parameters"]
        found = {p["name"]: p["schema"] for p in search_params}
        assert (found["q"]["minLength"], found["q"]["maxLength"]) == (1, 512)
        assert (found["limit"]["minimum"], found["limit"]["maximum"]) == (1, 100)
        note = doc["paths"]["/api/v1/notes/{path}"]["get"]["parameters"][0]["schema"]
        assert note["pattern"] == notesvc.NOTE_PATH_PARAM["pattern"]
        # The bounds are the server's own: at the bound accepted, past it refused.
        client.get(f"{API}/notes?limit=1000&offset={10**9}")
        client.get(f"{API}/notes?limit=1001", status=400)
        client.get(f"{API}/search?q=x&limit=101", status=400)

    @pytest.mark.slow
    def test_path_patterns_admit_only_paths_the_server_accepts(self):
        import unicodedata

        schema = notesvc.NOTE_PATH_SCHEMA
        pattern = re.compile(schema["pattern"])

        def admitted(path: str) -> bool:
            return len(path) <= schema["maxLength"] and bool(pattern.search(path))

        for path, _ in HOSTILE_PATHS:
            assert not admitted(path), path
        fine = [
            "notes/a.md",
            "notes/" + "x" * 252 + ".md",
            "notes/" + "é" * 62 + ".md",
            "notes/" + "\U0001f600" * 62 + ".md",
            "notes/" + "/".join(["\u6f22" * 63] * 3) + "/x.md",
            "notes/ a (1) [draft] #2 & co.md",
        ]
        for path in fine:
            assert admitted(path), path
            assert notesvc.note_path(path) == path
        assert not admitted("notes/" + "x" * 253 + ".md")
        assert not admitted("notes/" + "\U0001f600" * 63 + ".md")
        # The characters left out because NFC makes them longer are all there are.
        grows = "".join(
            chr(cp)
            for cp in range(0x80, 0x110000)
            if not 0xD800 <= cp <= 0xDFFF
            and unicodedata.decomposition(chr(cp))[:1] not in ("", "<")
            and len(unicodedata.normalize("NFC", chr(cp)).encode()) > len(chr(cp).encode())
        )
        assert re.fullmatch(f"[{notesvc._NFC_GROWS}]*", grows)
        assert not any(admitted(f"notes/a{ch}.md") for ch in grows)

    def test_crash_leftovers_in_the_state_folder_are_swept_at_start(self, make_app, root):
        make_app()  # creates the root and its state folder
        state = root / ".notesvc"
        stamp = time.strftime("%Y%m%dT%H%M%S.000000Z", time.gmtime())  # not yet expired
        stale = [
            state / ".tmp-abc123.part",
            state / "trash" / stamp / "notes" / ".tmp-x.part",
            state / "plugins" / ".tmp-y.part",
            state / "sub" / "deeper" / ".tmp-z.part",
            root / "notes" / "folder" / ".tmp-n.part",
        ]
        kept = [
            state / "trash" / stamp / "notes" / "tmp-x.part.md",
            root / "notes" / "tmp-1.part.md",
            state / "plugins" / "tmp-y.py",
        ]
        for path in stale + kept:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("left over")
        client = with_key(make_app())
        for path in stale:
            assert not path.exists(), path
        for path in kept:
            assert path.read_text() == "left over"
        assert data(client.get(note_url("notes/tmp-1.part.md")))["content"] == "left over"


class TestFolders:
    def test_tree_nests_folders_first_then_notes_by_name(self, client, root):
        for path in ["notes/b.md", "notes/A.md", "notes/zeta/x.md", "notes/alpha/y/z.md"]:
            put_note(client, path, "t")
        (root / "notes" / ".hidden").mkdir()
        (root / "notes" / ".hidden" / "h.md").write_text("h")
        (root / "notes" / ".dot.md").write_text("h")
        (root / "notes" / "image.png").write_bytes(b"\x89PNG")
        (root / "notes" / "empty").mkdir()
        tree = data(client.get(f"{API}/folders/tree"))
        assert (tree["name"], tree["path"], tree["type"]) == ("notes", "notes", "folder")
        assert [(c["name"], c["type"]) for c in tree["children"]] == [
            ("alpha", "folder"),
            ("empty", "folder"),
            ("zeta", "folder"),
            ("A.md", "note"),
            ("b.md", "note"),
        ]
        alpha = tree["children"][0]
        assert alpha["path"] == "notes/alpha"
        assert alpha["children"][0]["children"][0] == {
            "name": "z.md",
            "path": "notes/alpha/y/z.md",
            "type": "note",
            "size": 1,
            "modified": alpha["children"][0]["children"][0]["modified"],
        }

    def test_subtree(self, client):
        put_note(client, "notes/p/q/r.md")
        for url in (f"{API}/folders/tree/notes%2Fp", f"{API}/folders/tree/notes/p"):
            node = data(client.get(url))
            assert node["path"] == "notes/p"
            assert node["children"][0]["path"] == "notes/p/q"
        assert data(client.get(f"{API}/folders/tree/notes"))["path"] == "notes"

    def test_missing_folder_is_404_and_note_is_not_a_folder(self, client):
        put_note(client, "notes/n.md")
        assert_error(client.get(f"{API}/folders/tree/notes%2Fnope", status=404), 404, "NOT_FOUND")
        client.get(f"{API}/folders/tree/notes%2Fn.md", status=404)

    @pytest.mark.parametrize(
        "path", ["..%2Fetc", "notes%2F..%2F..", "%2Fetc", "other", "notes%2F.git"]
    )
    def test_bad_folder_path_is_400(self, client, path):
        resp = client.get(f"{API}/folders/tree/{path}", status=400)
        assert_error(resp, 400, "VALIDATION_ERROR")

    def test_post_folders_does_not_exist(self, client):
        resp = client.post_json(f"{API}/folders", {"path": "notes/x"}, status=404)
        assert "/folders/tree" in assert_error(resp, 404, "NOT_FOUND")["message"]

    def test_large_tree_is_fast_enough(self, client, root):
        # A smoke check of scale, not a benchmark (bench/bench_notes.py measures).
        for f in range(50):
            folder = root / "notes" / f"f{f:03d}"
            folder.mkdir()
            for n in range(20):
                (folder / f"n{n:03d}.md").write_text("x")
        tree = data(client.get(f"{API}/folders/tree"))
        assert sum(len(c["children"]) for c in tree["children"]) == 1000
        assert data(client.get(f"{API}/notes?limit=1000"))["total"] == 1000


class TestFolderDepth:
    """`?depth=N` lists N levels; folders below the cut carry `count` instead of `children`."""

    @pytest.fixture
    def tree_client(self, client, root):
        for path in [
            "notes/top.md",
            "notes/a/one.md",
            "notes/a/b/two.md",
            "notes/a/b/c/three.md",
            "notes/a/b/c/four.md",
            "notes/z/five.md",
        ]:
            put_note(client, path, "t")
        (root / "notes" / "empty").mkdir()
        (root / "notes" / "a" / ".hidden").mkdir()
        (root / "notes" / "a" / ".hidden" / "h.md").write_text("h")
        return client

    def test_depth_one_lists_children_with_counts_for_folders(self, tree_client):
        tree = data(tree_client.get(f"{API}/folders/tree?depth=1"))
        assert tree["path"] == "notes"
        assert "count" not in tree
        assert tree["children"] == [
            {"name": "a", "path": "notes/a", "type": "folder", "count": 4},
            {"name": "empty", "path": "notes/empty", "type": "folder", "count": 0},
            {"name": "z", "path": "notes/z", "type": "folder", "count": 1},
            tree["children"][3],
        ]
        assert tree["children"][3]["path"] == "notes/top.md"
        assert set(tree["children"][3]) == {"name", "path", "type", "size", "modified"}

    def test_depth_two_lists_one_more_level(self, tree_client):
        tree = data(tree_client.get(f"{API}/folders/tree?depth=2"))
        a = tree["children"][0]
        assert "count" not in a
        assert [(c["name"], c.get("count")) for c in a["children"]] == [("b", 3), ("one.md", None)]
        assert "children" not in a["children"][0]

    def test_subtree_with_depth(self, tree_client):
        for url in (
            f"{API}/folders/tree/notes%2Fa%2Fb?depth=1",
            f"{API}/folders/tree/notes/a/b?depth=1",
        ):
            node = data(tree_client.get(url))
            assert node["path"] == "notes/a/b"
            assert node["children"][0] == {
                "name": "c",
                "path": "notes/a/b/c",
                "type": "folder",
                "count": 2,
            }
            assert node["children"][1]["path"] == "notes/a/b/two.md"

    def test_deep_enough_equals_the_whole_tree(self, tree_client):
        whole = data(tree_client.get(f"{API}/folders/tree"))
        for depth in (4, 64):
            assert data(tree_client.get(f"{API}/folders/tree?depth={depth}")) == whole
        assert "count" not in json.dumps(whole)

    def test_a_large_folder_cut_at_depth_one_still_counts_every_note(self, client, root):
        for f in range(20):
            for n in range(10):
                (root / "notes" / f"f{f:02d}" / f"d{n}").mkdir(parents=True)
                (root / "notes" / f"f{f:02d}" / f"d{n}" / "x.md").write_text("x")
        client.app.service.sync_index()
        tree = data(client.get(f"{API}/folders/tree?depth=1"))
        assert [c["count"] for c in tree["children"]] == [10] * 20
        assert "children" not in json.dumps(tree["children"])

    @pytest.mark.parametrize("depth", ["0", "65", "-1", "x", "1.5", "99999999999", "%00", "1 "])
    def test_bad_depth_is_400(self, client, depth):
        for url in (f"{API}/folders/tree?depth={depth}", f"{API}/folders/tree/notes?depth={depth}"):
            resp = client.get(url, status=400)
            assert "depth" in assert_error(resp, 400, "VALIDATION_ERROR")["message"]

    def test_depth_on_a_missing_or_hostile_folder(self, client):
        assert_error(
            client.get(f"{API}/folders/tree/notes%2Fnope?depth=1", status=404), 404, "NOT_FOUND"
        )
        resp = client.get(f"{API}/folders/tree/..%2Fetc?depth=1", status=400)
        assert_error(resp, 400, "VALIDATION_ERROR")

    def test_depth_is_in_the_openapi_document(self, client):
        paths = client.get(f"{API}/openapi.json").json["paths"]
        for path in ("/api/v1/folders/tree", "/api/v1/folders/tree/{path}"):
            params = {p["name"]: p for p in paths[path]["get"]["parameters"]}
            assert params["depth"]["in"] == "query"
            assert params["depth"]["schema"]["maximum"] == 64


class TestServerNotes:
    pytestmark = [pytest.mark.real_server, pytest.mark.slow]

    def test_concurrent_if_match_increments_lose_nothing(self, tmp_path):
        with running(tmp_path, "--auth-mode", "none") as server:
            status, _, _ = server.request(
                "POST", f"{API}/notes", {"path": "notes/counter.md", "content": "0"}
            )
            assert status == 201
            url = note_url("notes/counter.md")
            conflicts = []
            errors = []

            def client():
                done = 0
                while done < 20:
                    status, headers, body = server.request("GET", url)
                    if status != 200:
                        errors.append(status)
                        return
                    value = int(body["data"]["content"])
                    status, _, _ = server.request(
                        "PUT", url, {"content": str(value + 1)}, {"If-Match": headers["ETag"]}
                    )
                    if status == 200:
                        done += 1
                    elif status == 412:
                        conflicts.append(1)
                    else:
                        errors.append(status)
                        return

            threads = [threading.Thread(target=client) for _ in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert errors == []
            _, _, body = server.request("GET", url)
            assert body["data"]["content"] == "120"

    def test_sigkill_mid_write_leaves_every_note_whole(self, tmp_path):
        server = Server(tmp_path, "--auth-mode", "none")
        sent: dict = {}
        try:
            for i in range(20):
                content = f"note {i} version 0\n" + "." * 1000 + f"\nend {i} 0\n"
                sent[f"notes/n{i:02d}.md"] = {content}
                server.request(
                    "POST", f"{API}/notes", {"path": f"notes/n{i:02d}.md", "content": content}
                )
            stop = threading.Event()
            done = []  # writes the server finished

            def writer(w):
                v = 0
                while not stop.is_set():
                    v += 1
                    i = (v * 7 + w) % 20
                    path = f"notes/n{i:02d}.md"
                    # Large, varied sizes make torn writes visible if they could happen.
                    content = (
                        f"note {i} version {w}-{v}\n"
                        + "x" * (20000 + (v % 7) * 9000)
                        + f"\nend {i} {w}-{v}\n"
                    )
                    sent[path].add(content)
                    try:
                        done.append(server.request("PUT", note_url(path), {"content": content}))
                    except (OSError, http.client.HTTPException, ValueError):
                        return  # the server was killed under this request

            threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
            for t in threads:
                t.start()
            # Killed in full flow: every writer busy, hundreds of writes behind them.
            wait_for(lambda: len(done) >= 200, timeout=60)
            server.proc.kill()
            server.proc.wait()
            stop.set()
            for t in threads:
                t.join(30)
        finally:
            server.stop()
        notes = tmp_path / "notes"
        for path, versions in sent.items():
            content = (tmp_path / path).read_text()
            assert content in versions, f"{path} holds a torn or foreign version"
        # A restart sweeps temp files a crash left behind and lists exactly the 20 notes.
        with running(tmp_path, "--auth-mode", "none") as again:
            _, _, body = again.request("GET", f"{API}/notes")
            assert body["data"]["total"] == 20
        assert [p for p in notes.iterdir() if p.name.startswith(".tmp-")] == []
