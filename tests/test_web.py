"""The page as served: its CSP, size and assets (src/notesvc/web.py)."""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import re
import shutil
import subprocess
import zlib

import pytest

from conftest import Server, notesvc, relay_raw_get


def png_size(data: bytes) -> tuple:
    """Return (width, height) of a PNG, checking its signature, chunk CRCs and pixel data."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        length = int.from_bytes(data[pos : pos + 4], "big")
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        crc = int.from_bytes(data[pos + 8 + length : pos + 12 + length], "big")
        assert zlib.crc32(kind + body) == crc
        chunks[kind] = body
        pos += 12 + length
    width, height = (
        int.from_bytes(chunks[b"IHDR"][:4], "big"),
        int.from_bytes(chunks[b"IHDR"][4:8], "big"),
    )
    assert len(zlib.decompress(chunks[b"IDAT"])) == height * (1 + width * 3)
    assert b"IEND" in chunks
    return width, height


class TestWebClientPage:
    """The page as served: one locked-down response, its manifest and icons."""

    def test_page_is_small_self_contained_and_locked_down(self, anon):
        resp = anon.get("/")
        assert resp.content_type == "text/html"
        # the budget: one response <= 60 KB gzipped (contract, 15), so a signed-in cold load
        # (the page, the features, the list and the tree) stays under 80 KB on the wire
        # (docs/design.md)
        assert len(gzip.compress(resp.body)) <= 60_000
        csp = resp.headers["Content-Security-Policy"]
        assert "default-src 'none'" in csp
        assert "unsafe-inline" not in csp
        assert "unsafe-eval" not in csp
        assert "script-src 'sha256-" in csp
        assert "<script src" not in resp.text
        assert resp.text.count("<script>") == 1
        assert resp.text.count("<style>") == 1
        markup = re.sub(r"<(script|style)>.*?</\1>", "", resp.text, flags=re.S)
        assert "http" not in markup.lower()  # nothing from elsewhere: no CDN, no fonts
        assert resp.headers["X-Frame-Options"] == "DENY"
        assert resp.headers["Referrer-Policy"] == "no-referrer"

    def test_csp_hashes_match_the_inline_script_and_style(self, anon):
        resp = anon.get("/")
        csp = resp.headers["Content-Security-Policy"]
        directives = dict(d.strip().split(" ", 1) for d in csp.split(";") if d.strip())
        script = re.search(r"<script>(.*)</script>", resp.text, re.S).group(1)
        style = re.search(r"<style>(.*)</style>", resp.text, re.S).group(1)
        digest = lambda t: base64.b64encode(hashlib.sha256(t.encode()).digest()).decode()  # noqa: E731
        # 'strict-dynamic': the page's script may add record.js (its integrity checked)
        assert directives["script-src"] == f"'sha256-{digest(script)}' 'strict-dynamic'"
        assert directives["style-src"] == f"'sha256-{digest(style)}'"
        assert directives["connect-src"] == "'self'"
        assert directives["manifest-src"] == "'self'"
        assert directives["frame-ancestors"] == "'none'"

    def test_script_reads_no_relay_url_and_never_builds_an_absolute_api_url(self):
        js = notesvc.WEB_JS
        assert "relayUrl" not in js.replace("a relayUrl", "")  # only the comment names it
        assert "ownOrigin(url)" in js  # every request is checked against the page's origin
        assert 'mode: "same-origin"' in js

    def test_script_is_valid_javascript(self, tmp_path):
        node = shutil.which("node") or shutil.which("nodejs")
        if not node:
            pytest.skip("no node on this machine (.ci/run installs Debian's nodejs)")
        script = tmp_path / "web-client.js"
        script.write_text(notesvc.WEB_JS)
        done = subprocess.run([node, "--check", str(script)], capture_output=True, timeout=60)
        assert done.returncode == 0, done.stderr.decode()

    def test_script_is_served_without_comment_lines_line_for_line(self):
        # the sources' comments stay in web/; the page keeps every line where it was
        parts = [notesvc.WEB_JS_START, notesvc.LISTS_JS, notesvc.WEB_JS_REST]
        assert all(re.search(r"^\s*//", p, re.M) for p in parts)
        assert not re.search(r"^\s*//", notesvc.WEB_JS, re.M)
        assert notesvc.lean_script("a\n  // why\nb; // gone\nc/* x */d;") == "a\n\nb;\nc d;"
        lines = notesvc.WEB_JS.split("\n")
        start = lines.index(notesvc.LISTS_JS.split("\n")[5])  # const lists = (() => {
        assert lines[start - 5 : start] == ["", "", "", "", ""]
        assert lines[start + 2] == notesvc.LISTS_JS.split("\n")[7].strip()

    def test_script_and_style_are_served_without_indentation_but_text_keeps_it(self):
        # a line that begins inside a template literal or a continued string is text: kept
        js = "a = `x\n  y` + /`/.source;\n  b = '`//';\nc = `${`d\n  `}`; /* e\n */ "
        js += "f = 'g\\\n  h';\n"
        kept, comments = notesvc.scan_script(js)
        assert kept == {1, 4, 6}
        assert [js[a:b] for a, b in comments] == ["/* e\n */"]
        assert notesvc.lean_script(js).split("\n") == [
            "a = `x",
            "  y` + /`/.source;",
            "b = '`//';",
            "c = `${`d",
            "  `}`; ",  # (a line that begins inside a template is kept as it is)
            "f = 'g\\",
            "  h';",
            "",
        ]
        assert notesvc.scan_script("x = a / b / c; // d\ny = /[/`]/g; // z\n")[0] == set()
        with pytest.raises(ValueError, match="does not end"):
            notesvc.scan_script("x = `open\n")
        served = notesvc.WEB_JS.split("\n")
        assert not [line for line in served if line[:1].isspace()]  # (none in web/ today)
        css = notesvc.lean_css("a {\n  b: c; /* why\n  and */\n}\n")
        assert css == "a {\nb: c;\n\n}\n"
        assert "/*" not in notesvc.WEB_CSS

    def test_manifest_is_public_cacheable_and_points_at_served_icons(self, anon):
        resp = anon.get("/manifest.webmanifest")
        assert resp.headers["Content-Type"].startswith("application/manifest+json")
        assert resp.headers["Cache-Control"] == "public, max-age=86400"
        manifest = json.loads(resp.body)
        assert manifest["display"] == "standalone"
        assert manifest["start_url"] == "."
        assert manifest["theme_color"].startswith("#")
        purposes = {i.get("purpose", "any") for i in manifest["icons"]}
        assert purposes == {"any", "maskable"}
        for icon in manifest["icons"]:
            got = anon.get("/" + icon["src"])
            assert got.headers["Content-Type"] == icon["type"]
            if icon["type"] == "image/png":
                assert png_size(got.body) == tuple(map(int, icon["sizes"].split("x")))

    @pytest.mark.parametrize(
        ("path", "size"),
        [("/icon-192.png", 192), ("/icon-512.png", 512), ("/apple-touch-icon.png", 180)],
    )
    def test_png_icons_are_valid_pngs(self, anon, path, size):
        resp = anon.get(path)
        assert resp.headers["Cache-Control"] == "public, max-age=86400"
        assert resp.headers["X-Content-Type-Options"] == "nosniff"
        assert png_size(resp.body) == (size, size)
        assert len(resp.body) < 10_000

    def test_svg_icon_is_inert(self, anon):
        resp = anon.get("/icon.svg")
        assert resp.headers["Content-Type"] == "image/svg+xml"
        assert resp.headers["Content-Security-Policy"] == "default-src 'none'"
        assert "<script" not in resp.text
        assert not re.search(r"\son\w+=|href=", resp.text)

    def test_assets_need_no_key_and_refuse_other_methods(self, anon):
        for path in notesvc.WEB_ASSETS:
            anon.get(path, status=200)
            anon.post(path, status=405)
        anon.get("/icon.png", status=404)
        anon.get("/manifest.webmanifest/..%2f..%2fetc%2fpasswd", status=404)

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_the_relay_serves_the_same_page_manifest_and_icons(self, anon, tmp_path):
        relay = Server(tmp_path / "relay", "relay")
        try:
            head, body = relay_raw_get(relay, "/")
            # a relay without a domain: the same page, marked to keep nothing in storage
            assert body == notesvc.shared_origin_page(anon.get("/").text).encode()
            assert f"Content-Security-Policy: {notesvc.WEB_CSP}" in head
            for path in notesvc.WEB_ASSETS:
                head, body = relay_raw_get(relay, path)
                assert head.startswith("HTTP/1.1 200"), path
                assert body == anon.get(path).body
                # the same headers as the server's (the worker: revalidated, may fetch)
                for name, value in notesvc.web_asset_headers(path).items():
                    assert f"{name}: {value}" in head, (path, name)
            head, _ = relay_raw_get(relay, "/icon.png")
            assert head.startswith("HTTP/1.1 404")
        finally:
            relay.stop()
