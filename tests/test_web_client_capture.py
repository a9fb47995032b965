"""Capture in real browsers (CONTRACT 31's judges): the clipper extension unpacked in Debian's
Chromium (its popup and its context menu) on loopback fixture pages, the bookmarklet, and
Record from Chromium's fake microphone fed a WAV that espeak-ng speaks, transcribed by a
Whisper-compatible stand-in. `web-ext lint` judges the extension for Firefox."""

from __future__ import annotations

import contextlib
import http.server
import json
import shutil
import subprocess
import threading
import urllib.parse
from pathlib import Path

import pytest

from browsers import (
    BROWSER_TESTS,
    CHROMIUM,
    CHROMIUM_ARGS,
    DEVICES,
    PLAIN_HTTP_HOST,
    WebSession,
    expect,
    web_server,
)
from conftest import API, Server, must_be_marked, wait_for

pytestmark = BROWSER_TESTS

CLIPPER = Path(__file__).resolve().parent.parent / "clipper"


# -- the pages clipped: a loopback site with an article, and one behind a login -----------------


def picture(size: int = 64) -> bytes:
    import notesvc

    return notesvc.web_icon_png(size)


ARTICLE = """<!doctype html><html><head><title>Tide tables explained</title>
<style>body{font:16px serif}</style><script>window.tracker = 1;</script></head><body>
<header><a href="/">Fixture Site</a>
<nav><a href="/about">About</a> <a href="/ads">Ads</a></nav></header>
<main><article><h1>Tide tables explained</h1>
<p>The <strong>spring tide</strong> comes twice a month, when the sun and the moon line up.
Read the <a href="/guide/neap.html">guide to neap tides</a> next.</p>
<figure><img src="/img/chart.png" alt="A tide chart"><figcaption>A chart</figcaption></figure>
<ul><li>High water</li><li>Low water</li></ul>
<p>Sailors check the tables <em>before</em> they leave the harbour; the moon's pull decides.</p>
<p><img src="/img/boat.png" alt="A boat"></p>
<button onclick="alert(1)">Subscribe</button></article></main>
<aside>Buy our newsletter</aside><footer>Copyright Fixture Site</footer></body></html>"""

PRIVATE = """<!doctype html><html><head><title>Members' notes</title></head><body><article>
<h1>Members' notes</h1><p>The locker code for members is 4711, only seen when signed in to the
site; a server fetching this address would meet the sign-in page instead.</p>
<p><img src="/private/badge.png" alt="Member badge"></p></article></body></html>"""


class FixtureSite:
    """A loopback web site: the article, a page and an image behind a session cookie. It
    records every request's User-Agent: the notes server never comes here."""

    def __init__(self):
        self.agents: list = []
        site = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                site.agents.append((self.path, self.headers.get("User-Agent", "")))
                signed_in = "session=member" in (self.headers.get("Cookie") or "")
                path = self.path.split("?")[0]
                if path == "/article.html":
                    return self._send(200, "text/html", ARTICLE.encode())
                if path in ("/img/chart.png", "/img/boat.png"):
                    return self._send(200, "image/png", picture(48 if "boat" in path else 64))
                if path == "/private.html":
                    if not signed_in:
                        return self._send(403, "text/html", b"<h1>Please sign in</h1>")
                    return self._send(200, "text/html", PRIVATE.encode())
                if path == "/private/badge.png":
                    if not signed_in:
                        return self._send(403, "text/plain", b"no")
                    return self._send(200, "image/png", picture(32))
                return self._send(404, "text/plain", b"not here")

            def _send(self, status: int, ctype: str, body: bytes):
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def site():
    s = FixtureSite()
    yield s
    s.close()


def owner_key(root: Path) -> str:
    return json.loads((root / ".notesvc" / "state.json").read_text())["apiKey"]


def api(server: Server, root: Path, method: str, path: str, body=None) -> dict:
    status, _, answer = server.request(method, path, body, {"X-Service-Key": owner_key(root)})
    assert status < 400, answer
    return answer["data"]


def pairing_link(server: Server, root: Path, scope: str = "write") -> str:
    made = api(server, root, "POST", f"{API}/auth/devices/pairings", {"name": "x", "scope": scope})
    return f"{server.url}/#pair={made['secret']}"


def note_text(server: Server, root: Path, path: str) -> str:
    quoted = urllib.parse.quote(path, safe="")
    return api(server, root, "GET", f"{API}/notes/{quoted}")["content"]


# -- the extension ---------------------------------------------------------------------------


@contextlib.contextmanager
def chromium_with_clipper(tmp_path: Path, device: str = "desktop"):
    """Debian's Chromium (new headless) with the unpacked clipper, in a persistent context."""
    sync_api = pytest.importorskip("playwright.sync_api")
    if not CHROMIUM:
        pytest.skip("no Chromium on this machine")
    must_be_marked("browser")
    args = [
        *CHROMIUM_ARGS,
        f"--disable-extensions-except={CLIPPER}",
        f"--load-extension={CLIPPER}",
    ]
    with sync_api.sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"),
            executable_path=CHROMIUM,
            headless=True,
            args=args,
            **DEVICES[device],
        )
        try:
            context.set_default_timeout(15_000)
            workers = context.service_workers or [context.wait_for_event("serviceworker")]
            yield context, workers[0]
        finally:
            context.close()


def extension_id(worker) -> str:
    return urllib.parse.urlsplit(worker.url).netloc


class TestClipper:
    def test_the_popup_connects_and_clips_an_article_with_its_images(self, tmp_path, site):
        root = tmp_path / "srv"
        server = Server(root)
        try:
            with chromium_with_clipper(tmp_path) as (context, worker):
                article = context.new_page()
                article.goto(site.url + "/article.html")
                popup = context.new_page()
                popup.set_viewport_size({"width": 380, "height": 560})
                popup.goto(f"chrome-extension://{extension_id(worker)}/popup.html")
                popup.fill("#link", pairing_link(server, root))
                popup.click("#connect-go")
                expect(popup.locator("#clip-page")).to_be_visible()
                popup.screenshot(path=str(tmp_path / "clipper-popup-connected.png"))
                popup.click("#clip-page")
                expect(popup.locator("#msg")).to_contain_text(
                    "Saved as notes/inbox/", timeout=30_000
                )
                popup.screenshot(path=str(tmp_path / "clipper-popup-clipped.png"))
                path = popup.inner_text("#msg").split("Saved as ")[1].split(" (")[0]
            text = note_text(server, root, path)
            assert text.startswith(f"---\nsource: {site.url}/article.html\nclipped: ")
            assert "# Tide tables explained" in text
            assert "**spring tide**" in text
            assert f"[guide to neap tides]({site.url}/guide/neap.html)" in text
            assert "![A tide chart](../../attachments/inbox/" in text
            assert "![A boat](../../attachments/inbox/" in text
            for gone in ("Subscribe", "newsletter", "Copyright", "About", "tracker", "alert"):
                assert gone not in text
            stored = sorted(p.name for p in (root / "attachments" / "inbox").rglob("*.png"))
            assert stored == ["boat.png", "chart.png"]
            assert (root / "attachments" / "inbox").rglob("chart.png").__next__().read_bytes() == (
                picture(64)
            )
            assert all("Chrome" in agent for _, agent in site.agents)  # never the server
        finally:
            server.stop()

    def test_a_page_only_the_signed_in_browser_sees_is_clipped_as_it_saw_it(self, tmp_path, site):
        root = tmp_path / "srv"
        server = Server(root)
        try:
            with chromium_with_clipper(tmp_path) as (context, worker):
                context.add_cookies([{"name": "session", "value": "member", "url": site.url}])
                page = context.new_page()
                page.goto(site.url + "/private.html")
                expect(page.locator("h1")).to_have_text("Members' notes")
                link = pairing_link(server, root)
                made = worker.evaluate(
                    """async ([link]) => {
                        await clipper.connect(link, "Web clipper");
                        const [tab] = (await chrome.tabs.query({})).filter(
                            (t) => t.url.includes("private.html"));
                        return onMenu({menuItemId: "clip-page"}, tab);
                    }""",
                    [link],
                )
            assert made["path"] == "notes/inbox/Members' notes.md"
            text = note_text(server, root, made["path"])
            assert "locker code for members is 4711" in text
            assert "Please sign in" not in text
            assert "![Member badge](../../attachments/inbox/" in text
            assert all("Chrome" in agent for _, agent in site.agents)
        finally:
            server.stop()

    def test_the_context_menu_saves_a_link_an_image_and_a_selection(self, tmp_path, site):
        root = tmp_path / "srv"
        server = Server(root)
        try:
            with chromium_with_clipper(tmp_path) as (context, worker):
                page = context.new_page()
                page.goto(site.url + "/article.html")
                page.evaluate(
                    "() => { const r = document.createRange();"
                    " r.selectNodeContents(document.querySelectorAll('article p')[1]);"
                    " getSelection().removeAllRanges(); getSelection().addRange(r); }"
                )
                link = pairing_link(server, root)
                made = worker.evaluate(
                    """async ([link, site]) => {
                        await clipper.connect(link, "Web clipper");
                        const [tab] = (await chrome.tabs.query({})).filter(
                            (t) => t.url.includes("article.html"));
                        const out = [];
                        out.push(await onMenu({menuItemId: "save-link",
                            linkUrl: site + "/guide/neap.html", linkText: "guide"}, tab));
                        out.push(await onMenu({menuItemId: "save-image",
                            srcUrl: site + "/img/chart.png"}, tab));
                        out.push(await onMenu({menuItemId: "clip-selection"}, tab));
                        out.push((await chrome.storage.local.get("last")).last);
                        return out;
                    }""",
                    [link, site.url],
                )
            saved_link, saved_image, selection, last = made
            assert last["ok"] is True
            text = note_text(server, root, saved_link["path"])
            assert f"source: {site.url}/guide/neap.html" in text
            assert f"[guide]({site.url}/guide/neap.html)" in text
            assert "Found on [Tide tables explained]" in text
            image_note = note_text(server, root, saved_image["path"])
            assert "](../../attachments/inbox/" in image_note
            assert saved_image["images"] == 1
            chosen = note_text(server, root, selection["path"])
            assert "Sailors check the tables _before_" in chosen
            assert "spring tide" not in chosen
        finally:
            server.stop()

    def test_a_revoked_clipper_is_told_so(self, tmp_path, site):
        root = tmp_path / "srv"
        server = Server(root)
        try:
            with chromium_with_clipper(tmp_path) as (context, worker):
                page = context.new_page()
                page.goto(site.url + "/article.html")
                link = pairing_link(server, root)
                conn = worker.evaluate("async ([l]) => clipper.connect(l, 'Web clipper')", [link])
                devices = api(server, root, "GET", f"{API}/auth/keys")["keys"]
                mine = next(d for d in devices if d.get("kind") == "device")
                api(server, root, "DELETE", f"{API}/auth/keys/{mine['id']}")
                last = worker.evaluate(
                    """async () => {
                        const [tab] = (await chrome.tabs.query({})).filter(
                            (t) => t.url.includes("article.html"));
                        await onMenu({menuItemId: "clip-page"}, tab);
                        return (await chrome.storage.local.get("last")).last;
                    }"""
                )
            assert conn["key"].startswith("nsd_")
            assert last["ok"] is False
            assert last["message"].startswith("This clipper's key no longer works (revoked?)")
            assert api(server, root, "GET", f"{API}/notes")["total"] == 0
        finally:
            server.stop()


class TestClipperForFirefox:
    def test_web_ext_lint_finds_no_error(self):
        web_ext = shutil.which("web-ext")
        if not web_ext:
            pytest.skip("web-ext is not installed (npm install -g web-ext)")
        out = subprocess.run(
            [web_ext, "lint", "--source-dir", str(CLIPPER), "--output", "json", "--boring"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        report = json.loads(out.stdout[out.stdout.index("{") :])
        assert report["errors"] == [], report["errors"]
        assert report["summary"]["errors"] == 0


# -- the bookmarklet ---------------------------------------------------------------------------


@pytest.fixture(scope="class")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    if not CHROMIUM:
        pytest.skip("no Chromium on this machine")
    rules = f"--host-resolver-rules=MAP {PLAIN_HTTP_HOST} 127.0.0.1"
    with sync_api.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=[*CHROMIUM_ARGS, rules])
        try:
            yield chromium
        finally:
            chromium.close()


class TestBookmarklet:
    def test_the_bookmarklet_clips_a_page_through_the_clip_page(self, browser, tmp_path, site):
        root = tmp_path / "srv"
        server = Server(root)
        try:
            s = WebSession(browser, tmp_path, "phone")
            page = s.page
            page.goto(server.url + "/clip")
            secret = pairing_link(server, root).split("#pair=")[1]
            page.fill("#pair", secret)
            page.click("#pair-go")
            expect(page.locator("#bookmarklet")).to_be_visible()
            code = page.input_value("#bm-code")
            assert code.startswith("javascript:")
            assert "nsd_" not in code  # the bookmarklet carries no key
            # a message from anyone but the window that opened the page is not taken
            page.evaluate(
                "() => window.postMessage({type: 'notesvc-clip', url: 'https://evil.example/',"
                " title: 'x', html: '<p>x</p>'}, '*')"
            )
            expect(page.locator("#clip")).to_be_hidden()
            article = s.context.new_page()
            article.goto(site.url + "/article.html")
            with s.context.expect_page() as opened:
                article.evaluate(urllib.parse.unquote(code[len("javascript:") :]))
            clip_page = opened.value
            expect(clip_page.locator("#clip-page")).to_be_visible()
            expect(clip_page.locator("#page")).to_contain_text("Tide tables explained")
            clip_page.screenshot(path=str(tmp_path / "bookmarklet-phone.png"))
            with contextlib.suppress(Exception):  # it closes itself once saved
                clip_page.click("#clip-page")
                expect(clip_page.locator("#msg")).to_contain_text("Saved as")
            wait_for(lambda: (root / "notes" / "inbox" / "Tide tables explained.md").exists())
            text = (root / "notes" / "inbox" / "Tide tables explained.md").read_text()
            assert "**spring tide**" in text
            assert f"![A tide chart (remote)]({site.url}/img/chart.png)" in text
            assert not (root / "attachments").exists()  # no image bytes from a bookmarklet
            assert [p for p, _ in site.agents].count("/img/chart.png") <= 1  # the browser's own
            assert s.close() == []
        finally:
            server.stop()

    def test_a_page_that_opens_the_clip_page_speaks_only_for_its_own_address(
        self, browser, tmp_path, site
    ):
        # Any site can open /clip and post to it as its opener: claiming another address, it
        # would have the person's note of that URL (their bank's page, clipped before)
        # replaced by its own HTML at one click on "Clip page".
        root = tmp_path / "srv"
        server = Server(root)
        try:
            s = WebSession(browser, tmp_path, "phone")
            page = s.page
            page.goto(server.url + "/clip")
            page.fill("#pair", pairing_link(server, root).split("#pair=")[1])
            page.click("#pair-go")
            expect(page.locator("#bookmarklet")).to_be_visible()
            evil = s.context.new_page()
            evil.goto(site.url + "/article.html")
            script = """(target) => new Promise((done) => {
                const w = window.open(target, "notesvc-clip");
                addEventListener("message", (e) => {
                    if (e.source !== w) return;
                    for (const url of ["https://bank.example/statement", "not a url"])
                        w.postMessage({type: "notesvc-clip", url, title: "Statement",
                                       html: "<p>forged</p>"}, "*");
                    done();
                });
            })"""
            with s.context.expect_page() as opened:
                evil.evaluate(script, server.url + "/clip")
            clip_page = opened.value
            expect(clip_page.locator("#msg")).to_contain_text("Waiting for the page")
            expect(clip_page.locator("#clip")).to_be_hidden()
            # the same opener, for its own address, is heard
            evil.evaluate(
                """(origin) => window.open("", "notesvc-clip").postMessage({type: "notesvc-clip",
                    url: location.href, title: "Its own", html: "<p>own</p>"}, origin)""",
                server.url,
            )
            expect(clip_page.locator("#clip")).to_be_visible()
            expect(clip_page.locator("#page")).to_contain_text(site.url + "/article.html")
            assert s.close() == []
        finally:
            server.stop()


# -- Record -----------------------------------------------------------------------------------


@pytest.fixture
def spoken_wav(tmp_path) -> Path:
    espeak = shutil.which("espeak-ng")
    if not espeak:
        pytest.skip("espeak-ng is not installed")
    wav = tmp_path / "spoken.wav"
    subprocess.run(
        [espeak, "-w", str(wav), "Remember to buy oat milk and call the plumber."],
        check=True,
        timeout=60,
    )
    return wav


@contextlib.contextmanager
def chromium_with_microphone(wav: Path):
    sync_api = pytest.importorskip("playwright.sync_api")
    if not CHROMIUM:
        pytest.skip("no Chromium on this machine")
    args = [
        *CHROMIUM_ARGS,
        "--use-fake-ui-for-media-stream",
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={wav}",
        f"--host-resolver-rules=MAP {PLAIN_HTTP_HOST} 127.0.0.1",
    ]
    with sync_api.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=args)
        try:
            yield chromium
        finally:
            chromium.close()


class TestRecord:
    def test_a_recording_is_kept_and_transcribed_on_a_phone(self, tmp_path, spoken_wav, upstream):
        env = {"SERVICE_TRANSCRIBE_URL": upstream.url + "/v1"}
        with (
            chromium_with_microphone(spoken_wav) as chromium,
            web_server(chromium, tmp_path, env=env) as web,
        ):
            s = web("phone")
            s.context.grant_permissions(["microphone"])
            s.tap("#record")
            expect(s.page.locator("#record-msg")).to_have_text("Recording…")
            expect(s.page.locator("#record-time")).to_have_text("0:02", timeout=15_000)
            s.shot("record-recording")
            s.tap("#record-stop")
            expect(s.page.locator("#record-msg")).to_contain_text("Saved to", timeout=30_000)
            s.shot("record-saved")
            assert upstream.transcript in s.page.inner_text("#record-msg")
            sent = [r for r in upstream.requests if r["path"].endswith("/audio/transcriptions")]
            _name, audio = sent[-1]["form"]["file"]
            assert audio[:4] == b"\x1a\x45\xdf\xa3"  # WebM, as MediaRecorder made it
            assert len(audio) > 4000  # two seconds and more of the spoken WAV
            notes = sorted((web.root / "notes" / "inbox").glob("Voice note *.md"))
            assert len(notes) == 1
            assert upstream.transcript in notes[0].read_text()
            kept = list((web.root / "attachments" / "inbox").rglob("*-voice.webm"))
            assert len(kept) == 1
            assert kept[0].read_bytes() == audio
            assert s.close() == []

    def test_on_a_desktop_record_keeps_a_note_and_search_says_how_far_files_were_read(
        self, tmp_path, spoken_wav, upstream
    ):
        env = {"SERVICE_TRANSCRIBE_URL": upstream.url + "/v1"}
        with (
            chromium_with_microphone(spoken_wav) as chromium,
            web_server(chromium, tmp_path, env=env) as web,
        ):
            s = web("desktop")
            s.context.grant_permissions(["microphone"])
            s.tap("#record")
            expect(s.page.locator("#record-time")).to_have_text("0:01", timeout=15_000)
            s.tap("#record-stop")
            expect(s.page.locator("#record-msg")).to_contain_text(upstream.transcript)
            s.shot("record-saved")
            assert len(list((web.root / "notes" / "inbox").glob("Voice note *.md"))) == 1
            s.page.focus("#search")
            tools = bool(shutil.which("pdftotext") or shutil.which("tesseract"))
            said = "Text inside files: 0 of 0 read" if tools else "Text inside files: off, "
            expect(s.page.locator("#file-text")).to_contain_text(said)
            assert s.close() == []

    def test_with_no_connection_the_recording_waits_and_goes_when_it_is_back(
        self, tmp_path, spoken_wav
    ):
        with (
            chromium_with_microphone(spoken_wav) as chromium,
            web_server(chromium, tmp_path) as web,
        ):
            s = web("phone")
            s.context.grant_permissions(["microphone"])
            s.tap("#record")  # (record.js is fetched now, while the connection is there)
            expect(s.page.locator("#record-msg")).to_have_text("Recording…")
            s.context.set_offline(True)
            expect(s.page.locator("#record-time")).to_have_text("0:01", timeout=15_000)
            s.tap("#record-stop")
            expect(s.page.locator("#record-msg")).to_contain_text("No connection")
            notes = web.root / "notes" / "inbox"
            assert not list(notes.glob("Voice note *.md")) if notes.exists() else True
            s.context.set_offline(False)
            wait_for(lambda: notes.exists() and len(list(notes.glob("Voice note *.md"))) == 1)
            expect(s.page.locator("#record-msg")).to_contain_text("not transcribed")  # (the
            # note is on disk a moment before the page has the answer)
            s.close()

    def test_on_plain_http_record_says_it_needs_https_and_where(self, tmp_path, spoken_wav):
        env = {"SERVICE_PUBLIC_URL": "https://notes.example.org"}
        with (
            chromium_with_microphone(spoken_wav) as chromium,
            web_server(chromium, tmp_path, env=env) as web,
        ):
            s = web("phone", login=False)
            url = f"http://{PLAIN_HTTP_HOST}:{web.server.port}/"
            s.login(url, web.setup["apiKey"])
            s.tap("#record")
            expect(s.page.locator("#toast")).to_contain_text("Recording needs HTTPS")
            expect(s.page.locator("#toast")).to_contain_text("https://notes.example.org/")
            s.shot("record-needs-https")
            assert s.page.locator("#record-box").count() == 0
            s.close()
