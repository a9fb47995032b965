"""Conditional GET and byte ranges (src/notesvc/http/route.py)."""

from __future__ import annotations

import pytest
import webtest

from conftest import KEY, PNG, att_url, data, key_of, notesvc, put_note, upload


class TestConditionalDownloads:
    """If-None-Match, Range and If-Range answered alike by the API's attachments and by
    WebDAV's GET (one implementation: conditional_download)."""

    @pytest.fixture(params=["api", "dav"])
    def get(self, request, client, dav):
        etag = data(upload(client, "attachments/v.png"))["etag"]
        if request.param == "api":
            raw = webtest.TestApp(client.app, lint=False)

            def fetch(status, method="GET", **headers):
                headers = {KEY: key_of(client), **headers}
                url = att_url("attachments/v.png")
                return raw.request(url, method=method, headers=headers, status=status)

        else:

            def fetch(status, method="GET", **headers):
                headers = {k.replace("-", "_"): v for k, v in headers.items()}
                return dav(method, "attachments/v.png", status=status, **headers)

        return fetch, etag, request.param

    def test_if_none_match_is_304_with_the_etag_alone(self, get):
        fetch, etag, _ = get
        for tags in (etag, "W/" + etag, f'"x", {etag}', "*"):
            resp = fetch(304, **{"If-None-Match": tags})
            assert resp.body == b""
            assert resp.headers["ETag"] == etag
            assert "Content-Range" not in resp.headers
        resp = fetch(304, **{"If-None-Match": etag, "Range": "bytes=0-9"})  # before Range
        assert "Content-Range" not in resp.headers
        for tags in ('"other"', etag.strip('"')):  # no quotes: another tag
            assert fetch(200, **{"If-None-Match": tags}).body == PNG

    def test_a_stale_if_range_gives_the_whole_file(self, get):
        fetch, etag, _ = get
        for stale in ('"old"', "W/" + etag, "Wed, 21 Oct 2015 07:28:00 GMT"):
            resp = fetch(200, Range="bytes=0-9", **{"If-Range": stale})
            assert resp.body == PNG
            assert "Content-Range" not in resp.headers
        resp = fetch(200, Range=f"bytes={len(PNG)}-", **{"If-Range": '"old"'})  # not 416
        assert resp.body == PNG
        resp = fetch(206, Range="bytes=0-9", **{"If-Range": f" {etag} "})
        assert resp.body == PNG[:10]
        assert resp.headers["Content-Range"] == f"bytes 0-9/{len(PNG)}"

    def test_a_range_outside_the_file_is_416_with_its_size(self, get):
        fetch, _, _ = get
        for outside in (f"bytes={len(PNG)}-", "bytes=-0", "bytes=99999-"):
            resp = fetch(416, Range=outside)
            assert resp.headers["Content-Range"] == f"bytes */{len(PNG)}"

    def test_a_range_not_understood_gives_the_whole_file(self, get):
        fetch, etag, _ = get
        for whole in ("bytes=0-1,5-6", "pages=1-2", "bytes=9-3", "bytes=-"):
            resp = fetch(200, Range=whole)
            assert resp.body == PNG
            assert resp.headers["Content-Length"] == str(len(PNG))
            assert resp.headers["ETag"] == etag
            assert resp.headers["Accept-Ranges"] == "bytes"

    def test_head_sends_the_headers_of_the_get_and_no_body(self, get):
        fetch, etag, _ = get
        resp = fetch(206, "HEAD", Range="bytes=-5")
        assert resp.body == b""
        assert resp.headers["Content-Range"] == f"bytes {len(PNG) - 5}-{len(PNG) - 1}/{len(PNG)}"
        assert resp.headers["Content-Length"] == "5"
        assert resp.headers["Content-Security-Policy"] == notesvc.ATTACHMENT_CSP
        assert fetch(304, "HEAD", **{"If-None-Match": etag}).body == b""

    def test_where_the_two_differ(self, get):
        # WebDAV names Last-Modified; both match a `*` in If-None-Match only when it stands
        # alone (RFC 9110; WebDAV's GET once took `"a*b"` and `W/"*"` for a match).
        fetch, _, side = get
        resp = fetch(200)
        assert ("Last-Modified" in resp.headers) == (side == "dav")
        for odd in ('"a*b"', 'W/"*"'):
            fetch(200, **{"If-None-Match": odd})
        fetch(304, **{"If-None-Match": '"other", *'})

    def test_a_note_over_dav_in_parts(self, client, dav):
        text = b"# N\n\nhello there\n"
        put_note(client, "notes/n.md", text.decode())
        etag = dav("GET", "notes/n.md").headers["ETag"]
        part = dav("GET", "notes/n.md", Range="bytes=4-8", status=206)
        assert part.body == text[4:9]
        assert part.headers["Content-Range"] == f"bytes 4-8/{len(text)}"
        assert dav("GET", "notes/n.md", If_None_Match=etag, status=304).body == b""
        stale = dav("GET", "notes/n.md", Range="bytes=4-8", If_Range='"old"', status=200)
        assert stale.body == text
        assert dav("HEAD", "notes/n.md", Range="bytes=4-8", status=206).body == b""

    def test_an_empty_file_is_whole_whatever_the_range(self, client, dav):
        upload(client, "attachments/e.png", b"")
        for resp in (
            client.get(att_url("attachments/e.png"), headers={"Range": "bytes=0-9"}),
            dav("GET", "attachments/e.png", Range="bytes=0-9"),
        ):
            assert resp.status_int == 200
            assert resp.body == b""
            assert resp.headers["Content-Length"] == "0"
            assert "Content-Range" not in resp.headers
