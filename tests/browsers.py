"""Chromium through Playwright: the browser fixture, `WebSession`, a real server with
seed notes for the web client's tests."""

from __future__ import annotations

import contextlib
import re
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from conftest import API, Server, must_be_marked, wait_for

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


PHONE = {"viewport": {"width": 390, "height": 844}, "has_touch": True, "is_mobile": True}


DESKTOP = {"viewport": {"width": 1280, "height": 800}}


DEVICES = {"phone": PHONE, "desktop": DESKTOP}


SEED_NOTES = {
    "home/keys.md": "# Spare keys\n\nThe spare keys are in the blue kumquat jar on the shelf.\n\n"
    "- [ ] copy the garage key\n- [x] give one to Anna\n\n"
    "See [[pancakes]] and [the recipe](../kitchen/pancakes.md).\n",
    "kitchen/pancakes.md": "# Pancakes\n\n1. Flour, eggs and milk.\n2. Whisk **well**.\n\n"
    "| step | minutes |\n|---|--:|\n| rest | 10 |\n| fry | 2 |\n",
    "todo.md": "# Todo\n\n- buy oat milk\n",
}


# A name for loopback that is not "localhost" or 127.0.0.1: plain HTTP there is not a
# secure context, as a LAN address is not.
PLAIN_HTTP_HOST = "notes.lan.test"


# A browser test's marks. Its group keeps every browser test on one xdist worker, one after
# another: two Chromiums at once on two cores starve each other's timers (a pause in typing
# long enough to name a new note from its first letter was seen), while the other worker
# runs everything else.
BROWSER_TESTS = [
    pytest.mark.browser,
    pytest.mark.real_server,
    pytest.mark.slow,
    pytest.mark.xdist_group("browser"),
]


@pytest.fixture(scope="class")
def browser():
    """One Chromium for the class (each test gets its own context)."""
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


def expect(locator):
    from playwright.sync_api import expect as playwright_expect

    return playwright_expect(locator)


class WebSession:
    """A browser context on the page of a real server, with the errors it logs."""

    def __init__(self, browser, tmp_path: Path, device: str = "phone", **context):
        must_be_marked("browser")
        self.context = browser.new_context(**DEVICES[device], **context)
        self.context.set_default_timeout(10_000)
        self.page = self.context.new_page()
        self.device, self.tmp_path = device, tmp_path
        self.errors: list = []
        self.requests: list = []
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("request", lambda r: self.requests.append(r))
        self.failed: list = []  # (status, method, URL) of every answer >= 400
        self.page.on(
            "response",
            lambda r: r.status >= 400 and self.failed.append((r.status, r.request.method, r.url)),
        )

    def login(self, url: str, key: str) -> None:
        self.page.goto(url)
        self.page.fill("#key", key)
        self.page.click("#connect")
        # The first page of a class's Chromium, started cold beside another worker's
        # WebDAV judges, once took 10.6 s to sign in: the sign-in gets 30 s, and when it
        # fails it says what the key screen showed (and leaves its picture).
        try:
            self.page.wait_for_selector("#app", state="visible", timeout=30_000)
        except Exception:
            self.shot("login-failed")
            said = self.page.inner_text("#login-msg", timeout=1_000)
            raise AssertionError(f"not signed in: {said!r}; logged {self.errors}") from None
        self.page.wait_for_selector("#tree button, #tree .empty")

    def shot(self, name: str) -> Path:
        path = self.tmp_path / f"{name}-{self.device}.png"
        self.page.screenshot(path=str(path))
        return path

    def tap(self, selector: str) -> None:
        """Click (desktop) or tap (phone) the element."""
        if self.device == "phone":
            self.page.tap(selector)
        else:
            self.page.click(selector)

    def tree_open(self, path: str) -> None:
        """Open a note from the tree, opening its folders first (Notes pane on a phone)."""
        if self.device == "phone" and self.page.get_attribute("#app", "data-pane") != "notes":
            self.tap(".tabs button[data-pane=notes]")
        parts = path.split("/")
        for i in range(2, len(parts)):
            folder = self.page.locator(f'#tree button.dir[data-path="{"/".join(parts[:i])}"]')
            if folder.get_attribute("aria-expanded") != "true":
                folder.click()
        self.page.click(f'#tree button.note[data-path="{path}"]')
        expect(self.page.locator("#path")).to_contain_text(path)

    def write_new(self, text: str) -> str:
        """Write a new note as a person does (New note, type, Ctrl+S); return its path."""
        # The phone in the person's hand: with two contexts open, the other page may hold
        # the browser's focus, and an element of a page without it is never focused.
        self.page.bring_to_front()
        self.tap("#new")
        expect(self.page.locator("#editor")).to_be_focused()
        # (the first line at once: a loaded machine can stall typing past the five quiet
        # seconds after which a new note takes its name from the words typed so far)
        first, _, rest = text.partition("\n")
        self.page.keyboard.insert_text(first + ("\n" if _ else ""))
        self.page.keyboard.type(rest)
        self.page.keyboard.press("Control+s")
        expect(self.page.locator("#status")).to_have_text("Saved")
        return self.page.text_content("#path").split(" · ")[0]  # (in the note's menu)

    def dialog_choose(self, value: str) -> None:
        """Answer the open dialog, then wait until it is answered: closed, or (a question
        asked from another dialog, such as the keys screen) back to what it showed before."""
        button = self.page.locator(f'#dlg[open] #dlg-buttons button[data-value="{value}"]')
        button.evaluate("b => { b.dataset.chosen = '1'; }")
        button.click()
        # (polled from here: a predicate polled in the page is an eval, which its policy refuses)
        wait_for(lambda: self.page.evaluate("!document.querySelector('#dlg[open] [data-chosen]')"))

    def api_calls(self, suffix: str) -> list:
        return [r for r in self.requests if urllib.parse.urlsplit(r.url).path.endswith(suffix)]

    def close(self) -> list:
        self.context.close()
        # The browser logs every non-2xx fetch; those the test caused on purpose are named.
        return self.errors


@pytest.fixture
def web(browser, tmp_path):
    """A real server with a few notes, and a function opening a logged-in browser session."""
    with web_server(browser, tmp_path) as open_session:
        yield open_session


@contextlib.contextmanager
def web_server(browser, tmp_path, notes: dict = SEED_NOTES, env: dict | None = None):
    """The `web` fixture's server, with these notes (paths under notes/) and settings."""
    root = tmp_path / "root"
    for rel, text in notes.items():
        (root / "notes" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "notes" / rel).write_text(text)
    server = Server(root, env=env)
    setup = server.request("GET", f"{API}/system/setup")[2]["data"]
    sessions = []

    def open_session(device: str = "phone", login: bool = True, **context) -> WebSession:
        session = WebSession(browser, tmp_path, device, **context)
        sessions.append(session)
        if login:
            session.login(setup["links"]["connect"]["hosted"], setup["apiKey"])
        return session

    open_session.server, open_session.setup, open_session.root = server, setup, root
    try:
        yield open_session
    finally:
        for s in sessions:
            with contextlib.suppress(Exception):
                s.context.close()
        server.stop()


def needs(server: Server, path: str, what: str) -> None:
    """Skip unless the server's OpenAPI document has the path (a feature of another issue)."""
    doc = server.request("GET", f"{API}/openapi.json")[2]
    if f"{API}{path}" not in doc["paths"]:
        pytest.skip(f"not on this server yet: {what}")


def unexpected(errors: list, *allowed: str) -> list:
    return [e for e in errors if not any(f"status of {a}" in e for a in allowed)]


class WireMeter:
    """What a page's requests move on the wire, from Chrome's own count (CDP Network): for
    each request `received`, loadingFinished's encodedDataLength (the answer's status line,
    headers and body as sent, gzipped or not), `headers` (of it, the answer's status line and
    headers) and `sent` (the request's headers as Chrome sent them, about)."""

    def __init__(self, page):
        self.page = page
        self.rows: dict = {}
        cdp = page.context.new_cdp_session(page)
        cdp.on("Network.requestWillBeSent", self._asked)
        cdp.on("Network.requestWillBeSentExtraInfo", self._asked_with)
        cdp.on("Network.responseReceived", self._answered)
        cdp.on("Network.responseReceivedExtraInfo", self._answered_with)
        cdp.on("Network.loadingFinished", self._finished)
        cdp.on("Network.loadingFailed", self._finished)
        cdp.send("Network.enable")

    def _row(self, e: dict) -> dict:
        empty = {"url": "", "method": "", "status": 0, "encoding": "", "done": False}
        return self.rows.setdefault(e["requestId"], {**empty, "sent": 0, "headers": 0})

    def _asked(self, e: dict) -> None:
        self._row(e).update(url=e["request"]["url"], method=e["request"]["method"])

    def _asked_with(self, e: dict) -> None:
        self._row(e)["sent"] = sum(len(k) + len(v) + 4 for k, v in e["headers"].items())

    def _answered(self, e: dict) -> None:
        headers = {k.lower(): v for k, v in e["response"]["headers"].items()}
        self._row(e).update(
            status=e["response"]["status"], encoding=headers.get("content-encoding", "")
        )

    def _answered_with(self, e: dict) -> None:
        self._row(e)["headers"] = len(e.get("headersText", ""))

    def _finished(self, e: dict) -> None:
        self._row(e).update(received=int(e.get("encodedDataLength", 0)), done=True)

    def settled(self, quiet: float = 1.0) -> list:
        """The requests made, once for `quiet` seconds none but the change feed's long poll
        (`wait=` above 0, which answers only when a change comes) has been in flight."""
        polls = lambda r: re.search(r"[?&]wait=[1-9]", r["url"])  # noqa: E731
        seen, since = None, time.monotonic()
        while time.monotonic() - since < quiet:
            self.page.wait_for_timeout(100)
            busy = [r for r in self.rows.values() if not r["done"] and not polls(r)]
            if busy or len(self.rows) != seen:
                seen, since = len(self.rows), time.monotonic()
        return [r for r in self.rows.values() if r["done"]]

    @staticmethod
    def table(rows: list) -> str:
        """One line a request: bytes received (of them headers), sent, status, encoding."""
        lines = [
            f"{r['received']:>7} {r['headers']:>5} {r['sent']:>5} {r['status']} "
            f"{r['encoding'] or '-':<5} {r['method']} {urllib.parse.urlsplit(r['url']).path}"
            f"{'?' + urllib.parse.urlsplit(r['url']).query if '?' in r['url'] else ''}"
            for r in rows
        ]
        total = [sum(r[k] for r in rows) for k in ("received", "headers", "sent")]
        lines.append("{:>7} {:>5} {:>5} in all: received, of it headers; sent".format(*total))
        return "\n".join(["received hdrs  sent", *lines])
