"""Attachments: `AttachmentStore` and its routes (src/notesvc/notes/store.py)."""

from __future__ import annotations

import http.client
import http.server
import json
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from conftest import (
    API,
    PNG,
    assert_error,
    att_url,
    data,
    leftovers,
    make_state,
    multipart,
    note_url,
    notesvc,
    post_form,
    put_note,
    raw_http,
    running,
    upload,
    with_key,
)


class TestAttachments:
    def test_put_then_get_round_trips_with_every_header(self, client, root):
        resp = upload(client, "attachments/trip/beach.png")
        rec = data(resp)
        assert set(rec) == {"path", "size", "contentType", "modified", "etag"}
        assert rec["path"] == "attachments/trip/beach.png"
        assert rec["size"] == len(PNG)
        assert rec["contentType"] == "image/png"
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", rec["modified"])
        assert resp.headers["ETag"] == rec["etag"]
        assert resp.headers["Location"].endswith(att_url("attachments/trip/beach.png"))
        assert (root / "attachments" / "trip" / "beach.png").read_bytes() == PNG
        got = client.get(att_url("attachments/trip/beach.png"))
        assert got.body == PNG
        assert got.headers["Content-Type"] == "image/png"
        assert got.headers["Content-Length"] == str(len(PNG))
        assert got.headers["ETag"] == rec["etag"]
        assert got.headers["Accept-Ranges"] == "bytes"
        assert got.headers["X-Content-Type-Options"] == "nosniff"
        assert "sandbox" in got.headers["Content-Security-Policy"]
        assert got.headers["Content-Disposition"].startswith('inline; filename="beach.png"')
        assert got.headers["Cache-Control"] == "no-store"
        head = client.head(att_url("attachments/trip/beach.png"))
        assert head.body == b""
        assert head.headers["ETag"] == rec["etag"]
        # PUT again replaces it: 200, a new ETag.
        again = data(upload(client, "attachments/trip/beach.png", PNG[::-1], status=200))
        assert again["etag"] != rec["etag"]
        assert client.get(att_url("attachments/trip/beach.png")).body == PNG[::-1]
        assert leftovers(root) == []

    def test_preconditions_guard_a_replacement(self, client, root):
        rec = data(upload(client, "attachments/a.jpg"))
        resp = upload(client, "attachments/a.jpg", b"x", 412, **{"If-Match": '"nope"'})
        assert_error(resp, 412, "PRECONDITION_FAILED")
        resp = upload(client, "attachments/a.jpg", b"x", 412, **{"If-None-Match": "*"})
        assert_error(resp, 412, "PRECONDITION_FAILED")
        assert (root / "attachments" / "a.jpg").read_bytes() == PNG
        upload(client, "attachments/a.jpg", b"new", 200, **{"If-Match": rec["etag"]})
        upload(client, "attachments/b.jpg", b"x", 201, **{"If-None-Match": "*"})
        resp = upload(client, "attachments/c.jpg", b"x", 412, **{"If-Match": rec["etag"]})
        assert_error(resp, 412, "PRECONDITION_FAILED")  # nothing there to match
        assert not (root / "attachments" / "c.jpg").exists()

    def test_ranges_and_conditional_gets(self, client):
        etag = data(upload(client, "attachments/v.mp4"))["etag"]
        url, size = att_url("attachments/v.mp4"), len(PNG)
        part = client.get(url, headers={"Range": "bytes=0-9"}, status=206)
        assert part.body == PNG[:10]
        assert part.headers["Content-Range"] == f"bytes 0-9/{size}"
        assert part.headers["Content-Length"] == "10"
        tail = client.get(url, headers={"Range": "bytes=-5"}, status=206)
        assert tail.body == PNG[-5:]
        rest = client.get(url, headers={"Range": f"bytes={size - 3}-"}, status=206)
        assert rest.body == PNG[-3:]
        clipped = client.get(url, headers={"Range": f"bytes=10-{size * 2}"}, status=206)
        assert clipped.body == PNG[10:]
        for whole in ("bytes=0-1,5-6", "pages=1-2", "bytes=9-3", "bytes=-"):
            assert client.get(url, headers={"Range": whole}, status=200).body == PNG
        outside = client.get(url, headers={"Range": f"bytes={size}-"}, status=416)
        assert_error(outside, 416, "VALIDATION_ERROR")
        assert outside.headers["Content-Range"] == f"bytes */{size}"
        stale = client.get(url, headers={"Range": "bytes=0-9", "If-Range": '"old"'}, status=200)
        assert stale.body == PNG
        fresh = client.get(url, headers={"Range": "bytes=0-9", "If-Range": etag}, status=206)
        assert fresh.body == PNG[:10]
        assert client.get(url, headers={"If-None-Match": etag}, status=304).body == b""
        assert client.get(url, headers={"If-None-Match": '"other"'}, status=200).body == PNG

    @pytest.mark.parametrize(
        ("name", "ctype"),
        [("page.html", "text/html"), ("page.HTM", "text/html"), ("logo.svg", "image/svg+xml")],
    )
    def test_html_and_svg_are_downloads_under_a_sandbox(self, client, name, ctype):
        active = b"<svg xmlns='http://www.w3.org/2000/svg'><script>alert(1)</script></svg>"
        upload(client, f"attachments/{name}", active)
        got = client.get(att_url(f"attachments/{name}"))
        assert got.body == active
        assert got.headers["Content-Type"].split(";")[0] == ctype
        assert got.headers["Content-Disposition"].startswith("attachment;")
        assert got.headers["Content-Security-Policy"] == "default-src 'none'; sandbox"
        assert got.headers["X-Content-Type-Options"] == "nosniff"

    def test_documents_are_downloads_and_names_are_quoted(self, client):
        upload(client, "attachments/Überweisung (2026) März.pdf", b"%PDF-1.4")
        got = client.get(att_url("attachments/Überweisung (2026) März.pdf"))
        disposition = got.headers["Content-Disposition"]
        assert disposition.startswith('attachment; filename="_berweisung _2026_ M_rz.pdf"')
        assert "filename*=UTF-8''%C3%9Cberweisung%20%282026%29%20M%C3%A4rz.pdf" in disposition

    def test_multipart_upload_never_overwrites(self, client, root):
        body, ctype = multipart(
            ("path", "attachments/cam/photo.jpg"), ("file", PNG, "IMG_1.jpg", "image/jpeg")
        )
        first = data(post_form(client, body, ctype, 201))
        assert first["path"] == "attachments/cam/photo.jpg"
        assert first["size"] == len(PNG)
        assert (root / "attachments" / "cam" / "photo.jpg").read_bytes() == PNG
        # The file part first, an unknown field ignored; the taken name gets -2, then -3.
        body, ctype = multipart(
            ("file", b"second", "x.jpg"), ("note", "hi"), ("path", "attachments/cam/photo.jpg")
        )
        second = data(post_form(client, body, ctype, 201))
        assert second["path"] == "attachments/cam/photo-2.jpg"
        third = data(post_form(client, body, ctype, 201))
        assert third["path"] == "attachments/cam/photo-3.jpg"
        assert client.get(att_url(second["path"])).body == b"second"
        assert (root / "attachments" / "cam" / "photo.jpg").read_bytes() == PNG
        # An empty file, the form a browser sends for an empty pick, is a file too.
        empty = (
            '--e\r\nContent-Disposition: form-data; name="path"\r\n\r\nattachments/e.txt\r\n'
            '--e\r\nContent-Disposition: form-data; name="file"; filename="e.txt"\r\n\r\n--e--\r\n'
        )
        rec = data(
            post_form(
                client,
                empty.encode(),
                "multipart/form-data; boundary=e",
                201,
            )
        )
        assert rec["size"] == 0
        assert leftovers(root) == []

    @pytest.mark.parametrize(
        ("body", "ctype", "status"),
        [
            pytest.param(*multipart(("path", "attachments/a.jpg")), 400, id="no-file"),
            pytest.param(*multipart(("file", b"x", "a.jpg")), 400, id="no-path"),
            pytest.param(
                *multipart(("path", "notes/a.jpg"), ("file", b"x", "a.jpg")), 400, id="notes-path"
            ),
            pytest.param(
                *multipart(("path", "attachments/a.exe"), ("file", b"x", "a.exe")), 400, id="exe"
            ),
            pytest.param(
                *multipart(("path", "attachments/../x.jpg"), ("file", b"x", "a.jpg")),
                400,
                id="dotdot",
            ),
            pytest.param(
                *multipart(("path", "attachments/" + "a" * 3000 + ".jpg"), ("file", b"x", "a.jpg")),
                400,
                id="long-path",
            ),
            pytest.param(
                *multipart(("path", b"attachments/\xff.jpg"), ("file", b"x", "a.jpg")),
                400,
                id="not-utf8",
            ),
            pytest.param(
                *multipart(("path", "attachments/a.jpg"), ("file", b"x", "a"), ("file", b"y", "b")),
                400,
                id="two-files",
            ),
            pytest.param(*multipart(*[("f", "x")] * 20), 400, id="many-parts"),
            pytest.param(
                b'--b\r\nContent-Disposition: form-data; name="file"\r\n\r\nnever ends',
                "multipart/form-data; boundary=b",
                400,
                id="unterminated",
            ),
            pytest.param(
                b"--b\r\nX-Big: " + b"h" * 9000 + b"\r\n\r\nx\r\n--b--",
                "multipart/form-data; boundary=b",
                400,
                id="huge-headers",
            ),
            pytest.param(
                b"--b\r\nContent-Type: text/plain\r\n\r\nx\r\n--b--",
                "multipart/form-data; boundary=b",
                400,
                id="no-disposition",
            ),
            pytest.param(b"junk", "multipart/form-data", 400, id="no-boundary"),
            pytest.param(b"junk", 'multipart/form-data; boundary="a\x7fb"', 400, id="bad-boundary"),
            pytest.param(b'{"path": "attachments/a.jpg"}', "application/json", 415, id="json"),
            pytest.param(
                b"path=attachments/a.jpg", "application/x-www-form-urlencoded", 415, id="urlencoded"
            ),
        ],
    )
    @pytest.mark.slow
    def test_multipart_refusals(self, client, root, body, ctype, status):
        resp = post_form(client, body, ctype, status)
        assert_error(
            resp, status, "VALIDATION_ERROR" if status == 400 else "UNSUPPORTED_MEDIA_TYPE"
        )
        assert (
            not (root / "attachments").exists() or list((root / "attachments").rglob("*.*")) == []
        )
        assert leftovers(root) == []

    @pytest.mark.parametrize(
        "path",
        [
            "notes/a.jpg",
            "attachments/a.exe",
            "attachments/noext",
            "attachments/.hidden.jpg",
            "attachments/../notes/a.jpg",
            "attachments//a.jpg",
            "attachments/a\\b.jpg",
            "attachments/a\x01.jpg",
            "attachments/a\u202e.jpg",
            "attachments/" + "x" * 300 + ".jpg",
            "/attachments/a.jpg",
            "attachments",
            "attachments/.jpg",
        ],
    )
    def test_hostile_paths_are_400(self, client, root, path):
        for resp in (
            client.put(att_url(path), b"x", content_type="image/jpeg", status=400),
            client.delete(att_url(path), status=400),
        ):
            assert_error(resp, 400, "VALIDATION_ERROR")
        # reading notes/a.jpg names a file kept beside the notes (WebDAV): none is there
        got = client.get(att_url(path), status=404 if path == "notes/a.jpg" else 400)
        assert_error(
            got, got.status_int, "NOT_FOUND" if got.status_int == 404 else "VALIDATION_ERROR"
        )
        assert not (root / "notes" / "a.jpg").exists()

    def test_a_symbolic_link_out_of_attachments_is_refused(self, client, root, tmp_path):
        outside = tmp_path / "outside"
        outside.mkdir()
        (root / "attachments").mkdir(parents=True)
        (root / "attachments" / "link").symlink_to(outside)
        resp = client.put(
            att_url("attachments/link/x.jpg"), b"x", content_type="image/jpeg", status=400
        )
        assert (
            "outside the attachments folder"
            in assert_error(resp, 400, "VALIDATION_ERROR")["message"]
        )
        assert list(outside.iterdir()) == []
        (outside / "secret.jpg").write_bytes(b"secret")
        assert_error(
            client.get(att_url("attachments/link/secret.jpg"), status=400), 400, "VALIDATION_ERROR"
        )
        assert data(client.get(f"{API}/attachments"))["total"] == 0  # links are not followed

    def test_size_limit(self, make_app, root):
        client = with_key(make_app(SERVICE_MAX_ATTACHMENT_BYTES="2048"))
        upload(client, "attachments/fits.bin.zip", b"x" * 2048)
        resp = upload(client, "attachments/big.zip", b"x" * 2049, status=413)
        message = assert_error(resp, 413, "PAYLOAD_TOO_LARGE")["message"]
        assert "2048" in message
        assert "SERVICE_MAX_ATTACHMENT_BYTES" in message
        body, ctype = multipart(("path", "attachments/big2.zip"), ("file", b"x" * 2049, "b.zip"))
        resp = post_form(client, body, ctype, 413)
        assert_error(resp, 413, "PAYLOAD_TOO_LARGE")
        assert sorted(p.name for p in (root / "attachments").iterdir()) == ["fits.bin.zip"]
        assert leftovers(root) == []

    def test_list_pages_by_path_and_leaves_out_the_rest(self, client, root):
        for path in ("attachments/b/2.png", "attachments/a.pdf", "attachments/b/1.PNG"):
            upload(client, path)
        (root / "attachments" / "tool.exe").write_bytes(b"MZ")
        (root / "attachments" / ".hidden.png").write_bytes(b"x")
        (root / "attachments" / "b" / ".tmp-x.part").write_bytes(b"x")
        listing = data(client.get(f"{API}/attachments"))
        assert [a["path"] for a in listing["attachments"]] == [
            "attachments/a.pdf",
            "attachments/b/1.PNG",
            "attachments/b/2.png",
        ]
        assert listing["total"] == 3
        assert set(listing["attachments"][0]) == {"path", "size", "contentType", "modified", "etag"}
        page = data(
            client.get(f"{API}/attachments", {"folder": "attachments/b", "limit": 1, "offset": 1})
        )
        assert [a["path"] for a in page["attachments"]] == ["attachments/b/2.png"]
        assert (page["total"], page["limit"], page["offset"]) == (2, 1, 1)
        assert_error(
            client.get(f"{API}/attachments", {"folder": "attachments/none"}, status=404),
            404,
            "NOT_FOUND",
        )
        for bad in (
            {"folder": "notes"},
            {"folder": "attachments/../x"},
            {"limit": "0"},
            {"offset": "-1"},
            {"limit": "x"},
        ):
            assert_error(client.get(f"{API}/attachments", bad, status=400), 400, "VALIDATION_ERROR")
        info = data(client.get(f"{API}/system/info"))
        assert info["attachments"] == {"count": 3, "bytes": 3 * len(PNG)}

    def test_an_empty_root_lists_nothing(self, client, root):
        assert data(client.get(f"{API}/attachments")) == {
            "attachments": [],
            "total": 0,
            "limit": 100,
            "offset": 0,
        }
        assert not (root / "attachments").exists()  # created by the first upload only

    def test_delete_moves_it_into_the_notes_trash(self, client, root):
        rec = data(upload(client, "attachments/old/scan.pdf", b"%PDF"))
        resp = client.delete(
            att_url("attachments/old/scan.pdf"), headers={"If-Match": '"x"'}, status=412
        )
        assert_error(resp, 412, "PRECONDITION_FAILED")
        gone = data(
            client.delete(att_url("attachments/old/scan.pdf"), headers={"If-Match": rec["etag"]})
        )
        assert gone["path"] == "attachments/old/scan.pdf"
        assert gone["deleted"] is True
        m = re.fullmatch(
            r"\.notesvc/trash/(\d{8}T\d{6}\.\d{6}Z)/attachments/old/scan\.pdf", gone["trash"]
        )
        assert m, gone["trash"]
        assert (root / gone["trash"]).read_bytes() == b"%PDF"  # the same layout as notes
        assert not (root / "attachments" / "old").exists()  # its emptied folder is pruned
        assert_error(client.get(att_url("attachments/old/scan.pdf"), status=404), 404, "NOT_FOUND")
        assert_error(
            client.delete(att_url("attachments/old/scan.pdf"), status=404), 404, "NOT_FOUND"
        )

    def test_move_rewrites_the_links_to_it(self, client, root):
        upload(client, "attachments/trip/a.jpg")
        put_note(
            client,
            "notes/days/monday.md",
            '# Monday\n\n![beach](../../attachments/trip/a.jpg "Sea")\n',
        )
        put_note(
            client,
            "notes/index.md",
            "[photo](/attachments/trip/a.jpg) and ![[a.jpg]] and [[trip/a.jpg|pic]]\n",
        )
        put_note(client, "notes/other.md", "![other](../attachments/trip/b.jpg) [a](a.md)\n")
        url = att_url("attachments/trip/a.jpg")
        body = {"path": "attachments/2026/sea.jpg", "updateLinks": True}
        moved = data(client.patch_json(url + "/move", body))
        assert moved["path"] == "attachments/2026/sea.jpg"
        assert moved["from"] == "attachments/trip/a.jpg"
        assert moved["linksUpdated"] == ["notes/days/monday.md", "notes/index.md"]
        assert (
            root / "notes/days/monday.md"
        ).read_text() == '# Monday\n\n![beach](../../attachments/2026/sea.jpg "Sea")\n'
        assert (
            (root / "notes/index.md").read_text()
            == "[photo](/attachments/2026/sea.jpg) and ![[sea.jpg]] and [[2026/sea.jpg|pic]]\n"
        )
        assert (
            root / "notes/other.md"
        ).read_text() == "![other](../attachments/trip/b.jpg) [a](a.md)\n"
        assert client.get(att_url("attachments/2026/sea.jpg")).body == PNG
        assert not (root / "attachments" / "trip").exists()
        # Without updateLinks the notes stay as they are.
        plain = data(
            client.patch_json(
                att_url("attachments/2026/sea.jpg") + "/move", {"path": "attachments/x.jpg"}
            )
        )
        assert "linksUpdated" not in plain
        assert "2026/sea.jpg" in (root / "notes/index.md").read_text()

    def test_move_finds_the_links_as_the_notes_are_now(self, client, root, monkeypatch):
        # The notes' links are kept between moves: an edit in between is seen. (Every
        # note is just written: without the racy-clean wait they are kept at once.)
        monkeypatch.setattr(notesvc.ReadCache, "RACY_SECONDS", 0)
        upload(client, "attachments/a.jpg")
        put_note(client, "notes/one.md", "![a](../attachments/a.jpg)\n")
        put_note(client, "notes/two.md", "no link yet\n")
        put_note(client, "notes/three.md", "a [[note]] and [b](b.md)\n")
        url = att_url("attachments/a.jpg")
        moved = data(
            client.patch_json(url + "/move", {"path": "attachments/b.jpg", "updateLinks": True})
        )
        assert moved["linksUpdated"] == ["notes/one.md"]
        client.put_json(note_url("notes/two.md"), {"content": "now ![[b.jpg]]\n"})
        client.put_json(note_url("notes/one.md"), {"content": "the link is gone\n"})
        url = att_url("attachments/b.jpg")
        moved = data(
            client.patch_json(url + "/move", {"path": "attachments/c.jpg", "updateLinks": True})
        )
        assert moved["linksUpdated"] == ["notes/two.md"]
        assert (root / "notes/two.md").read_text() == "now ![[c.jpg]]\n"
        assert (root / "notes/three.md").read_text() == "a [[note]] and [b](b.md)\n"

    def test_move_refusals(self, client, root):
        rec = data(upload(client, "attachments/a.jpg"))
        upload(client, "attachments/b.jpg", b"other")
        url = att_url("attachments/a.jpg") + "/move"
        assert_error(
            client.patch_json(url, {"path": "attachments/b.jpg"}, status=409), 409, "CONFLICT"
        )
        assert_error(
            client.patch_json(
                url, {"path": "attachments/c.jpg"}, headers={"If-Match": '"x"'}, status=412
            ),
            412,
            "PRECONDITION_FAILED",
        )
        assert_error(
            client.patch_json(
                att_url("attachments/none.jpg") + "/move", {"path": "attachments/c.jpg"}, status=404
            ),
            404,
            "NOT_FOUND",
        )
        for body in (
            {"path": "attachments/c.exe"},
            {"path": "notes/c.md"},
            {"path": 5},
            {},
            {"path": "attachments/c.jpg", "updateLinks": "yes"},
        ):
            assert_error(client.patch_json(url, body, status=400), 400, "VALIDATION_ERROR")
        assert_error(
            client.patch(url, b'{"path": ', content_type="application/json", status=400),
            400,
            "VALIDATION_ERROR",
        )
        assert_error(
            client.patch(url, b"path=x", content_type="text/plain", status=415),
            415,
            "UNSUPPORTED_MEDIA_TYPE",
        )
        assert (root / "attachments/a.jpg").read_bytes() == PNG
        assert (root / "attachments/b.jpg").read_bytes() == b"other"
        same = data(
            client.patch_json(url, {"path": "attachments/a.jpg"}, headers={"If-Match": rec["etag"]})
        )
        assert same["path"] == same["from"] == "attachments/a.jpg"

    def test_a_moved_note_keeps_its_attachment_links_working(self, client, root):
        upload(client, "attachments/x.jpg")
        put_note(client, "notes/a.md", "![x](../attachments/x.jpg) ![[x.jpg]]\n")
        moved = data(
            client.patch_json(
                note_url("notes/a.md") + "/move",
                {"path": "notes/deep/er/a.md", "updateLinks": True},
            )
        )
        assert moved["linksUpdated"] == ["notes/deep/er/a.md"]
        assert (
            root / "notes/deep/er/a.md"
        ).read_text() == "![x](../../../attachments/x.jpg) ![[x.jpg]]\n"

    def test_raw_put_refuses_a_multipart_body(self, client):
        body, ctype = multipart(("path", "attachments/a.jpg"), ("file", b"x", "a.jpg"))
        resp = client.put(att_url("attachments/a.jpg"), body, content_type=ctype, status=415)
        assert (
            "POST /api/v1/attachments"
            in assert_error(resp, 415, "UNSUPPORTED_MEDIA_TYPE")["message"]
        )

    def test_a_crash_leftover_is_swept_at_start(self, make_app, root):
        folder = root / "attachments"
        folder.mkdir(parents=True)
        (folder / ".tmp-abc.part").write_bytes(b"half an upload")
        with_key(make_app())
        assert leftovers(root) == []

    def test_a_client_on_another_allowed_origin_may_ask_for_ranges(self, make_app):
        app = make_app(SERVICE_CORS_ORIGINS="https://app.example")
        pre = app.options(
            att_url("attachments/a.mp4"),
            headers={
                "Origin": "https://app.example",
                "Access-Control-Request-Method": "GET",
                "Access-Control-Request-Headers": "range, if-none-match",
            },
            status=204,
        )
        allowed = pre.headers["Access-Control-Allow-Headers"]
        assert "Range" in allowed
        assert "If-None-Match" in allowed
        client = with_key(app)
        upload(client, "attachments/a.mp4")
        got = client.get(
            att_url("attachments/a.mp4"),
            headers={"Origin": "https://app.example", "Range": "bytes=0-1"},
            status=206,
        )
        assert "Content-Range" in got.headers["Access-Control-Expose-Headers"]

    def test_every_route_needs_the_key(self, anon):
        for method, url in (
            ("GET", f"{API}/attachments"),
            ("POST", f"{API}/attachments"),
            ("GET", att_url("attachments/a.jpg")),
            ("PUT", att_url("attachments/a.jpg")),
            ("DELETE", att_url("attachments/a.jpg")),
            ("PATCH", att_url("attachments/a.jpg") + "/move"),
        ):
            assert_error(anon.request(url, method=method, status=401), 401, "UNAUTHORIZED")


class TestServerAttachments:
    pytestmark = [pytest.mark.real_server, pytest.mark.slow]

    def test_header_bytes_that_are_not_utf8_act_as_absent(self, tmp_path):
        with running(tmp_path) as server:
            owner = {"X-Service-Key": make_state(tmp_path)["apiKey"]}
            req = urllib.request.Request(
                server.url + att_url("attachments/a.png"),
                PNG,
                {**owner, "Content-Type": "image/png"},
                method="PUT",
            )
            with urllib.request.urlopen(req, timeout=10) as resp:
                assert resp.status == 201
            body = {"path": "notes/a.md", "content": "![a](../attachments/a.png)\n"}
            assert server.request("POST", f"{API}/notes", body, owner)[0] == 201
            share = server.request("POST", f"{API}/shares", {"path": "notes/a.md"}, owner)[2]
            token = share["data"]["url"].rsplit("/", 1)[1]
            key = owner["X-Service-Key"].encode()
            for path, credential in (
                (att_url("attachments/a.png"), b"X-Service-Key: " + key + b"\r\n"),
                (f"{API}/shared/{token}/attachments/attachments/a.png", b""),
            ):
                for header in (
                    b"Range: bytes=\xff\xfe-\x80",
                    b"If-Range: \xc3\x28",
                    b"If-None-Match: \xff",
                    b"Range: bytes=0-3\r\nIf-Range: \xe2\x82",
                ):
                    request = (
                        f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n".encode()
                        + credential
                        + header
                        + b"\r\n\r\n"
                    )
                    status, _, data = raw_http(server.port, request)
                    assert (status, data) == (200, PNG), (path, header)
            # If-Match of such bytes matches nothing: 412, never a write and never a 500.
            request = (
                f"PUT {note_url('notes/a.md')} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                "Content-Type: application/json\r\nContent-Length: 15\r\n".encode()
                + b"X-Service-Key: "
                + key
                + b"\r\nIf-Match: \xff\xfe\r\n\r\n"
                + b'{"content":"x"}'
            )
            status, _, data = raw_http(server.port, request)
            assert status == 412, data
            assert (tmp_path / "notes" / "a.md").read_text() == body["content"]

    def test_uploads_get_their_own_body_limit_and_others_keep_theirs(self, tmp_path):
        env = {"SERVICE_MAX_BODY_BYTES": "4096", "SERVICE_MAX_ATTACHMENT_BYTES": "65536"}
        with running(tmp_path, "--auth-mode", "none", env=env) as server:
            big = b"x" * 60000
            req = urllib.request.Request(
                server.url + att_url("attachments/a.zip"),
                big,
                {"Content-Type": "application/zip"},
                method="PUT",
            )
            with urllib.request.urlopen(req, timeout=10) as resp:
                assert resp.status == 201
            assert (tmp_path / "attachments" / "a.zip").read_bytes() == big
            # Declared lengths over the limits are refused before any body is read.
            for method, path, length, setting in (
                ("POST", f"{API}/notes", 5000, "SERVICE_MAX_BODY_BYTES"),
                ("PUT", note_url("notes/a.md"), 5000, "SERVICE_MAX_BODY_BYTES"),
                (
                    "PUT",
                    att_url("attachments/b.zip"),
                    70000 + 65536,
                    "SERVICE_MAX_ATTACHMENT_BYTES",
                ),
                ("POST", f"{API}/attachments", 70000 + 65536, "SERVICE_MAX_ATTACHMENT_BYTES"),
            ):
                head = (
                    f"{method} {path} HTTP/1.1\r\nHost: x\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
                )
                started = time.monotonic()
                status, _, text = raw_http(server.port, head.encode())
                assert status == 413, text
                assert time.monotonic() - started < 2
                assert setting in text.decode()
            # The app still holds a JSON body to SERVICE_MAX_BODY_BYTES on an upload's path.
            status, _, _ = server.request(
                "PATCH",
                att_url("attachments/a.zip") + "/move",
                {"path": "attachments/c.zip", "pad": "x" * 5000},
            )
            assert status == 413
            # A chunked upload is counted too.
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
            conn.putrequest("PUT", att_url("attachments/chunked.zip"))
            conn.putheader("Transfer-Encoding", "chunked")
            conn.putheader("Content-Type", "application/zip")
            conn.endheaders()
            for _ in range(3):
                conn.send(b"2710\r\n" + b"y" * 10000 + b"\r\n")
            conn.send(b"0\r\n\r\n")
            resp = conn.getresponse()
            assert resp.status == 201, resp.read()
            conn.close()
            assert (tmp_path / "attachments" / "chunked.zip").read_bytes() == b"y" * 30000

    def test_full_disk_is_507_and_leaves_nothing(self, tmp_path):
        if os.geteuid() != 0 or not shutil.which("mount"):
            pytest.skip("mounting a small tmpfs needs root")
        disk = tmp_path / "disk"
        disk.mkdir()
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)],
            capture_output=True,
            timeout=10,
        )
        if mounted.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode()[:200]}")
        try:
            with running(disk, "--auth-mode", "none") as server:
                req = urllib.request.Request(
                    server.url + att_url("attachments/deep/er/big.zip"),
                    b"z" * 400_000,
                    {"Content-Type": "application/zip"},
                    method="PUT",
                )
                with pytest.raises(urllib.error.HTTPError) as caught:
                    urllib.request.urlopen(req, timeout=10)
                assert caught.value.code == 507
                assert json.loads(caught.value.read())["error"]["code"] == "INSUFFICIENT_STORAGE"
                assert not (disk / "attachments" / "deep").exists()
                assert leftovers(disk) == []
            assert "Traceback" not in "".join(server.lines)
        finally:
            subprocess.run(["umount", str(disk)], capture_output=True, timeout=10)
