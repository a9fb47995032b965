"""The web client offline, and devices joining in Chromium (web/)."""

from __future__ import annotations

import base64
import http.client
import http.server
import ipaddress
import json
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from browsers import (
    BROWSER_TESTS,
    PLAIN_HTTP_HOST,
    WebSession,
    WireMeter,
    expect,
    needs,
    unexpected,
)
from conftest import API, KEY, PNG, QUERY_TODOS, Server, notesvc, pkce_pair, wait_for
from standins import Callback, ForwardingProxy, telegram_update

ZBARIMG = shutil.which("zbarimg")


def machine_address() -> str:
    """This machine's address on its network (where its default route leaves), or "" when
    it has none but loopback: what a test of the address given to phones expects."""
    for family, probe in ((socket.AF_INET, "192.0.2.1"), (socket.AF_INET6, "2001:db8::1")):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as sock:
                sock.connect((probe, 9))
                found = sock.getsockname()[0]
        except OSError:
            continue
        if not ipaddress.ip_address(found).is_loopback:
            return found
    return ""


def decode_qr(png: Path) -> str:
    """Return the text of the QR code in a picture (Debian's zbarimg: a real decoder)."""
    done = subprocess.run(
        [ZBARIMG, "--quiet", "--raw", str(png)], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def todays_note(root: Path) -> Path | None:
    """The note the share sheet wrote to (the only one mentioning what it shares)."""
    found = [p for p in (root / "notes").rglob("*.md") if "Worth reading" in p.read_text()]
    return found[0] if found else None


def share_to(s: WebSession, url: str, *files: tuple):
    """Share a page's title, text and link and the files (name, bytes) to the app at url,
    as the share sheet does: a top-level multipart POST to its share-target, from outside
    it. Returns the tab the app opens in (its errors join the session's)."""
    tab = s.context.new_page()
    tab.on("pageerror", lambda e: s.errors.append(str(e)))
    tab.on("console", lambda m: m.type == "error" and s.errors.append(m.text))
    tab.set_content(
        f'<form method="POST" action="{url}/share-target" enctype="multipart/form-data">'
        '<input name="title" value="A page"><input name="text" value="Worth reading">'
        '<input name="url" value="https://example.com/read">'
        '<input type="file" name="image" multiple></form>'
    )
    if files:
        for name, content in files:
            (s.tmp_path / name).write_bytes(content)
        tab.set_input_files("input[type=file]", [s.tmp_path / name for name, _ in files])
    tab.evaluate("document.forms[0].submit()")
    return tab


def accept_shared(tab, answer: str = "add") -> None:
    """Say yes (or no) in the app to what was shared: any page can post to the share
    address, so nothing goes to today's note before the person has seen it."""
    expect(tab.locator("#dlg-title")).to_have_text("Shared to notesvc", timeout=20_000)
    expect(tab.locator("#dlg-body")).to_contain_text("Worth reading")
    tab.click(f'#dlg button[data-value="{answer}"]')


class TestOfflineInChromium:
    """Keep notes on this device (a secure context: http://127.0.0.1 is one): the app and
    the notes open without the server; what is written meanwhile lands once, when it is
    back; the share sheet's POST is kept for today's note."""

    pytestmark = BROWSER_TESTS

    def keep_offline(self, s: WebSession) -> None:
        page = s.page
        page.click("#menu summary")
        page.click("#menu-offline")
        expect(page.locator("#toast")).to_contain_text("kept on this device", timeout=20_000)
        wait_for(lambda: page.evaluate("navigator.serviceWorker.controller !== null"))

    def test_edit_two_and_create_one_offline_reload_then_all_land_once(self, web):
        s = web("phone")
        page = s.page
        self.keep_offline(s)
        expect(page.locator("#offline-state")).to_have_text("3 notes kept")
        s.context.set_offline(True)
        s.tree_open("notes/todo.md")
        page.click("#edit")
        page.fill("#editor", "# Todo\n\n- buy oat milk\n- written offline\n")
        page.keyboard.press("Control+s")
        expect(page.locator("#status")).to_have_text("Kept on this device")
        s.tap("#back")
        s.tree_open("notes/kitchen/pancakes.md")
        page.click("#edit")
        page.fill("#editor", "# Pancakes\n\nOffline batter.\n")
        page.keyboard.press("Control+s")
        expect(page.locator("#status")).to_have_text("Kept on this device")
        s.tap("#back")
        s.tap("#new")
        page.keyboard.insert_text("Made offline\n")  # (its name, at once: see write_new)
        page.keyboard.type("\non the train")
        page.keyboard.press("Control+s")
        expect(page.locator("#status")).to_have_text("Kept on this device")
        expect(page.locator("#offline-state")).to_have_text("Offline · 3 to send")
        title = page.get_attribute("#offline-state", "title")
        assert title.endswith("3 changes wait to be sent")
        s.tap("#back")
        assert page.evaluate("document.documentElement.scrollWidth") <= 390  # the badge fits
        s.shot("offline")
        # Reloaded without a connection: the app and the notes still open.
        page.reload()
        page.wait_for_selector("#app", state="visible")
        expect(page.locator("#recent")).to_contain_text("Made offline")
        s.tree_open("notes/todo.md")
        expect(page.locator("#view")).to_contain_text("written offline")
        # counted once the reloaded page has read its outbox back (slow on a busy machine)
        expect(page.locator("#offline-state")).to_contain_text("3 to send", timeout=15_000)
        assert "written offline" not in (web.root / "notes/todo.md").read_text()
        # Back online: everything lands, once.
        s.context.set_offline(False)
        page.evaluate("window.dispatchEvent(new Event('online'))")
        expect(page.locator("#offline-state")).to_be_hidden(timeout=15_000)
        todo = web.root / "notes/todo.md"
        assert todo.read_text() == "# Todo\n\n- buy oat milk\n- written offline\n"
        pancakes = (web.root / "notes/kitchen/pancakes.md").read_text()
        assert pancakes == "# Pancakes\n\nOffline batter.\n"
        (made,) = (web.root / "notes/inbox").iterdir()
        assert made.name == "Made offline.md"
        assert made.read_text() == "Made offline\n\non the train"
        page.reload()  # and again: nothing waits, nothing is sent twice
        page.wait_for_selector("#app", state="visible")
        assert "to send" not in page.inner_text("#offline-state")
        assert [p.name for p in (web.root / "notes/inbox").iterdir()] == ["Made offline.md"]
        offline_noise = ("ERR_INTERNET_DISCONNECTED", "ERR_FAILED", "status of 0")
        errors = [e for e in s.close() if not any(n in e for n in offline_noise)]
        assert errors == []

    def test_a_note_written_offline_is_sent_once_and_new_note_stays_blank(self, web):
        """Issue 42: once a note written offline is sent, its draft is gone: the next *New
        note* is blank and makes one note (no "<title> 2"), before and after a reload."""
        s = web("phone")
        page = s.page
        self.keep_offline(s)
        s.context.set_offline(True)
        s.tap("#new")
        page.keyboard.insert_text("Train idea\n")  # (its name, at once: see write_new)
        page.keyboard.type("\nwritten offline")
        expect(page.locator("#status")).to_have_text("Kept on this device", timeout=10_000)
        expect(page.locator("#offline-state")).to_have_text("Offline · 1 to send")
        s.context.set_offline(False)
        page.evaluate("window.dispatchEvent(new Event('online'))")
        expect(page.locator("#offline-state")).to_be_hidden(timeout=15_000)
        inbox = web.root / "notes" / "inbox"
        assert (inbox / "Train idea.md").read_text() == "Train idea\n\nwritten offline"
        for title in ("Second", "Third"):
            s.tap("#back")
            s.tap("#new")
            expect(page.locator("#editor")).to_have_value("")  # blank
            expect(page.locator("#draft")).to_be_hidden()
            page.keyboard.insert_text(title + "\n")
            page.keyboard.type("\nfresh")
            expect(page.locator("#status")).to_have_text("Saved", timeout=10_000)  # autosave
            expect(page.locator("#path")).to_contain_text(f"notes/inbox/{title}.md")
            assert (inbox / f"{title}.md").read_text() == f"{title}\n\nfresh"
            s.shot(f"offline-then-new-{title.lower()}")
            page.reload()  # and again after a reload: still nothing duplicated
            page.wait_for_selector("#app", state="visible")
            expect(page.locator("#recent")).to_contain_text(title)
        page.wait_for_timeout(1000)
        assert sorted(p.name for p in inbox.iterdir()) == [
            "Second.md",
            "Third.md",
            "Train idea.md",
        ]
        drafts = page.evaluate(
            "() => Object.keys(localStorage).filter(k => k.startsWith('notesvc.draft:'))"
        )
        assert drafts == []
        offline_noise = ("ERR_INTERNET_DISCONNECTED", "ERR_FAILED", "status of 0")
        assert [e for e in s.close() if not any(n in e for n in offline_noise)] == []

    def test_a_photo_put_in_offline_is_kept_linked_at_once_and_sent_before_the_note(self, web):
        """Issue 42: a photo is an edit like typing offline too: kept on the device, its link
        in the note at once, uploaded before the edit that links it, once; a name taken
        meanwhile gets -2 and the note links that."""
        needs(web.server, "/attachments", "attachments (issue 17)")
        s = web("phone")
        page = s.page
        self.keep_offline(s)
        s.tree_open("notes/todo.md")
        s.context.set_offline(True)
        icon = notesvc.web_icon_png(192)
        page.set_input_files(
            "#attach-photo", files=[{"name": "shelf.png", "mimeType": "image/png", "buffer": icon}]
        )
        expect(page.locator("#toast")).to_contain_text("“shelf.png” is kept on this device")
        page.set_input_files(
            "#attach-photo", files=[{"name": "taken.png", "mimeType": "image/png", "buffer": PNG}]
        )
        expect(page.locator("#editor")).to_have_value(re.compile(r"!\[taken\.png\]"))
        expect(page.locator("#status")).to_have_text("Kept on this device", timeout=10_000)
        expect(page.locator("#offline-state")).to_have_text("Offline · 3 to send")
        typed = page.input_value("#editor")
        shelf, taken = re.findall(r"!\[\w+\.png\]\(\.\./(attachments/[^)]+)\)", typed)
        assert re.fullmatch(r"attachments/\d{8}-\d{6}-shelf\.png", shelf)
        page.click("#edit")  # the picture shows from the file kept on this device
        expect(page.locator("#view img[alt='shelf.png']")).to_have_js_property("naturalWidth", 192)
        s.shot("photo-kept-offline")
        page.click("#edit")
        # meanwhile another device took the second one's name
        key = {"X-Service-Key": web.setup["apiKey"], "Content-Type": "image/png"}
        req = urllib.request.Request(
            web.server.url + f"{API}/attachments/" + urllib.parse.quote(taken, safe=""),
            b"\x89PNG other",
            key,
            method="PUT",
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 201
        assert not (web.root / shelf).exists()
        s.context.set_offline(False)
        page.evaluate("window.dispatchEvent(new Event('online'))")
        expect(page.locator("#offline-state")).to_be_hidden(timeout=15_000)
        url = f"{API}/notes/notes%2Ftodo.md"
        note = web.server.request("GET", url, headers=key)[2]["data"]["content"]
        renamed = taken.replace(".png", "-2.png")
        assert f"![shelf.png](../{shelf})" in note
        assert f"![taken.png](../{renamed})" in note
        assert (web.root / shelf).read_bytes() == icon
        assert (web.root / renamed).read_bytes() == PNG
        assert (web.root / taken).read_bytes() == b"\x89PNG other"  # never over it
        expect(page.locator("#editor")).to_have_value(re.compile(re.escape(renamed)))
        expect(page.locator("#status")).to_have_text("Saved")
        page.wait_for_timeout(1000)
        sent = [r for r in s.requests if r.method == "PUT" and "/attachments/" in r.url]
        answered = [r for r in sent if r.response() and r.response().status == 201]
        assert len(answered) == 2  # each once
        merges = [r for r in s.requests if r.url.endswith("/merge") and r.response()]
        assert merges
        assert all(r.response().status == 200 for r in merges)
        assert sorted(p.name for p in (web.root / "attachments").iterdir()) == sorted(
            [shelf.split("/")[-1], taken.split("/")[-1], renamed.split("/")[-1]]
        )
        page.click("#edit")
        expect(page.locator("#view img[alt='shelf.png']")).to_have_js_property("naturalWidth", 192)
        s.shot("photo-sent")
        offline_noise = ("ERR_INTERNET_DISCONNECTED", "ERR_FAILED", "status of 0", "412")
        assert [e for e in s.close() if not any(n in e for n in offline_noise)] == []

    def test_a_start_with_nothing_to_send_asks_for_the_list_and_the_tree_once(self, web):
        # (the phone issue: with the copy kept, a start sent the empty outbox and then asked
        # for the tree, and the list with it, a second time)
        s = web("phone")
        self.keep_offline(s)
        s.requests.clear()
        wire = WireMeter(s.page)
        s.page.reload()
        expect(s.page.locator("#recent .recent-note")).to_have_count(3)
        asked = [urllib.parse.urlsplit(r["url"]) for r in wire.settled()]  # (the relay's /r/…)
        lists = [u for u in asked if u.path.endswith(f"{API}/notes") and "sort=" in u.query]
        trees = [u for u in asked if u.path.endswith(f"{API}/folders/tree")]
        assert (len(lists), len(trees)) == (1, 1), asked
        assert unexpected(s.close()) == []

    def test_the_share_sheet_puts_text_and_an_image_in_todays_note(self, web):
        s = web("phone")
        self.keep_offline(s)
        tab = share_to(s, web.server.url, ("photo.png", PNG))
        expect(tab.locator("#dlg-body")).to_contain_text("photo.png", timeout=20_000)
        accept_shared(tab)
        assert "shared" not in tab.url
        today = wait_for(lambda: todays_note(web.root))
        text = wait_for(lambda: "photo.png" in today.read_text() and today.read_text())
        assert "A page Worth reading https://example.com/read" in text
        (image,) = re.findall(r"!\[photo.png\]\(\.\./\.\./(attachments/[^)]+)\)", text)
        assert (web.root / image).read_bytes() == PNG
        tab.screenshot(path=str(s.tmp_path / "shared-phone.png"))
        # (sent, and out of the outbox, before the tab goes: closed sooner, the item stays
        # marked sent, and goes again, once, with the next one)
        expect(tab.locator("#offline-state")).not_to_contain_text("to send")
        tab.close()
        # Offline, the share waits with the other changes and goes when the server is back.
        s.context.set_offline(True)
        tab = share_to(s, web.server.url, ("later.png", PNG))
        tab.wait_for_selector("#app", state="visible")
        accept_shared(tab)
        expect(tab.locator("#offline-state")).to_contain_text("1 to send")
        s.context.set_offline(False)
        tab.evaluate("window.dispatchEvent(new Event('online'))")
        wait_for(lambda: "later.png" in today.read_text())
        expect(tab.locator("#offline-state")).to_be_hidden()
        assert today.read_text().count("Worth reading") == 2
        offline_noise = ("ERR_INTERNET_DISCONNECTED", "ERR_FAILED", "status of 0")
        assert [e for e in s.close() if not any(n in e for n in offline_noise)] == []

    def test_an_image_over_the_limit_is_refused_with_a_clear_message(self, web):
        s = web("phone")
        self.keep_offline(s)
        big = b"\x89PNG\r\n\x1a\n" + bytes(30 * 1024 * 1024)
        tab = share_to(s, web.server.url, ("huge.png", big))
        accept_shared(tab)
        expect(tab.locator("#toast")).to_contain_text(
            re.compile(r"“huge.png” \(30.0 MB\) was not added: this server takes files up to 20"),
            timeout=20_000,
        )
        today = wait_for(lambda: todays_note(web.root))
        text = today.read_text()
        assert "huge.png" not in text
        assert not list(web.root.glob("attachments/**/huge*"))
        assert unexpected(s.close(), 413) == []

    def test_what_another_site_posts_to_the_share_address_goes_nowhere_unseen(self, web):
        s = web("phone")
        self.keep_offline(s)
        tab = share_to(s, web.server.url)  # as a hostile page's hidden form would
        accept_shared(tab, "drop")
        expect(tab.locator("#dlg")).to_be_hidden()
        tab.wait_for_timeout(1000)  # (the outbox was empty; nothing may have gone out)
        assert todays_note(web.root) is None
        assert tab.evaluate("indexedDB.databases().then(d => d.length)") == 1
        assert "to send" not in tab.inner_text("#offline-state")
        assert unexpected(s.close()) == []

    def test_without_the_worker_the_share_sheet_is_told_what_to_turn_on(self, web):
        s = web("phone")
        tab = share_to(s, web.server.url)
        expect(tab.locator("#toast")).to_contain_text("needs “Keep notes on this device”")
        assert "share=" not in tab.url
        assert unexpected(s.close()) == []

    def test_a_revoked_key_wipes_the_copy_on_this_device(self, web):
        key = {"X-Service-Key": web.setup["apiKey"]}
        body = {"name": "phone", "scope": "write"}
        grant = web.server.request("POST", f"{API}/auth/keys", body, key)[2]["data"]
        s = web("phone", login=False)
        s.login(web.setup["links"]["connect"]["hosted"], grant["key"])
        page = s.page
        self.keep_offline(s)
        assert "notesvc" in page.evaluate("indexedDB.databases().then(d => d.map(x => x.name))")
        s.context.set_offline(True)  # an edit waits on this device...
        s.tree_open("notes/todo.md")
        page.click("#edit")
        page.fill("#editor", "# Todo\n\n- written on the train\n")
        page.keyboard.press("Control+s")
        expect(page.locator("#status")).to_have_text("Kept on this device")
        gone = web.server.request("DELETE", f"{API}/auth/keys/{grant['id']}", headers=key)
        assert gone[0] == 200
        s.context.set_offline(False)
        page.evaluate("window.dispatchEvent(new Event('online'))")
        expect(page.locator("#login")).to_be_visible()  # the next contact: the key is refused
        page.reload()
        expect(page.locator("#login")).to_be_visible()
        wait_for(
            lambda: (
                "notesvc"
                not in page.evaluate("indexedDB.databases().then(d => d.map(x => x.name))")
            )
        )
        assert page.evaluate("navigator.serviceWorker.getRegistrations().then(r => r.length)") == 0
        assert page.evaluate("localStorage.getItem('notesvc.offline')") is None
        # ...and what waited stays in this browser as the note's draft, for the next key
        drafts = page.evaluate(
            "() => Object.keys(localStorage).filter(k => k.startsWith('notesvc.draft:'))"
            ".map(k => [k.split('|')[1], JSON.parse(localStorage.getItem(k)).content])"
        )
        assert drafts == [["notes/todo.md", "# Todo\n\n- written on the train\n"]]
        assert "train" not in (web.root / "notes/todo.md").read_text()
        offline_noise = "ERR_INTERNET_DISCONNECTED"
        assert [e for e in unexpected(s.close(), 401) if offline_noise not in e] == []

    def test_on_plain_http_an_open_page_keeps_what_is_typed_offline_and_sends_it(self, web):
        """A LAN address on plain HTTP is no secure context: no service worker, but the copy
        (IndexedDB) and the outbox work in an open page; the option says that only opening
        the app with no connection needs HTTPS."""
        s = web("phone", login=False)
        page = s.page
        # the same server by another name than 127.0.0.1 or localhost: not a secure context
        url = web.setup["links"]["connect"]["hosted"].replace("127.0.0.1", PLAIN_HTTP_HOST)
        s.login(url, web.setup["apiKey"])
        assert page.evaluate("window.isSecureContext") is False
        assert page.evaluate("'serviceWorker' in navigator") is False
        page.click("#menu summary")
        option = page.locator("#menu-offline")
        expect(option).to_contain_text("Keep notes on this device")
        said = "Works in an open page; only opening the app with no connection needs HTTPS"
        expect(option.locator("small")).to_have_text(said)
        s.shot("offline-option-plain-http")
        option.click()
        expect(page.locator("#toast")).to_contain_text(
            "only opening the app with no connection needs HTTPS", timeout=20_000
        )
        expect(page.locator("#offline-state")).to_have_text("3 notes kept")
        # (the app cannot open without the server here: the key is not kept for it)
        assert page.evaluate("localStorage.getItem('notesvc.key')") is None
        # The connection drops; a new note is typed (and autosaved) meanwhile.
        s.context.set_offline(True)
        s.tap("#new")
        expect(page.locator("#editor")).to_be_focused()
        page.keyboard.insert_text("Typed on the train\n")  # (its name, at once: see write_new)
        page.keyboard.type("\nwhile the wifi was down")
        expect(page.locator("#status")).to_have_text("Kept on this device", timeout=15_000)
        expect(page.locator("#offline-state")).to_have_text("Offline · 1 to send")
        s.shot("offline-plain-http")
        assert not (web.root / "notes/inbox").exists()
        # Back: it is sent within a few seconds, once, with nothing else done in the page.
        s.context.set_offline(False)
        expect(page.locator("#offline-state")).to_be_hidden(timeout=8_000)
        (made,) = (web.root / "notes/inbox").iterdir()
        assert made.name == "Typed on the train.md"
        assert made.read_text() == "Typed on the train\n\nwhile the wifi was down"
        page.click("#menu summary")
        expect(option).to_contain_text("Stop keeping notes on this device")
        expect(option.locator("small")).to_have_text(said)
        offline_noise = ("ERR_INTERNET_DISCONNECTED", "ERR_FAILED", "status of 0")
        assert [e for e in s.close() if not any(n in e for n in offline_noise)] == []


class TestDevicesInChromium:
    """A phone joins by scanning: real servers, Chromium at 390x844, the QR code decoded by
    zbarimg from a screenshot."""

    pytestmark = BROWSER_TESTS

    def set_up_from_the_page(self, browser, tmp_path, server) -> WebSession:
        s = WebSession(browser, tmp_path, "phone")
        s.page.goto(server.url + "/")
        s.page.fill("#setup-name", "Ada's phone")
        s.page.click("#setup")
        expect(s.page.locator("#dlg-title")).to_have_text("Keep this key safe")
        s.dialog_choose("done")
        expect(s.page.locator("#app")).to_be_visible()
        return s

    def test_a_page_opened_from_elsewhere_says_why_and_what_to_do(self, browser, tmp_path):
        """A new server reached from beyond its home network (through a proxy it trusts):
        no *Set up this server*, the reason and the commands; the key, pasted, still works."""
        server = Server(tmp_path / "srv", env={"SERVICE_TRUST_PROXY": "127.0.0.1"})
        try:
            with ForwardingProxy(server.url) as proxy:  # reports 203.0.113.1: a stranger
                s = WebSession(browser, tmp_path, "phone")
                page = s.page
                page.goto(proxy.url + "/")
                why = page.locator("#setup-why")
                expect(why).to_contain_text("set up only from the server itself or its home")
                expect(why).to_contain_text("python3 notesvc.py pair")
                expect(why).to_contain_text("python3 notesvc.py rotate-key")
                expect(page.locator("#setup-box")).to_be_hidden()
                s.shot("setup-elsewhere")
                state = json.loads((tmp_path / "srv/.notesvc/state.json").read_text())
                s.login(proxy.url + "/", state["apiKey"])  # the owner's key, from the server
                assert not server.request(
                    "GET", f"{API}/system/setup", headers={"X-Forwarded-For": "127.0.0.1"}
                )[2]["data"]["setupComplete"]  # the link was refused: setup waits
                assert unexpected(s.close(), 403) == []
            late = Server(tmp_path / "late", env={"SERVICE_SETUP_WINDOW": "0"})
            try:
                s = WebSession(browser, tmp_path, "phone")
                s.page.goto(late.url + "/")
                why = s.page.locator("#setup-why")
                expect(why).to_contain_text("setup window has passed")
                expect(why).to_contain_text("Restart the server")
                expect(s.page.locator("#setup-box")).to_be_hidden()
                assert unexpected(s.close()) == []
            finally:
                late.stop()
        finally:
            server.stop()

    def test_the_consent_page_signs_in_with_this_browsers_admin_device(self, browser, tmp_path):
        server = Server(tmp_path / "srv")
        callback = Callback()
        try:
            s = self.set_up_from_the_page(browser, tmp_path, server)
            status, _, reg = server.request(
                "POST", "/oauth/register", {"redirect_uris": [callback.url], "client_name": "Far"}
            )
            assert status == 201
            _, challenge = pkce_pair()
            query = urllib.parse.urlencode(
                {
                    "response_type": "code",
                    "client_id": reg["client_id"],
                    "redirect_uri": callback.url,
                    "state": "s1",
                    "code_challenge": challenge,
                    "code_challenge_method": "S256",
                }
            )
            page = s.page
            page.goto(f"{server.url}/oauth/authorize?{query}")
            expect(page.locator("#signed-in")).to_contain_text("Signed in as Ada's phone")
            expect(page.locator("#key")).to_be_hidden()  # no key to paste
            assert page.evaluate("localStorage.getItem('notesvc.key')").startswith("nsd_")
            page.click("#allow")
            back = callback.query()  # approved with the device's key: a code for the app
            assert back["state"] == ["s1"]
            assert back["code"][0].startswith("nsc_")
            assert unexpected(s.close()) == []
        finally:
            callback.close()
            server.stop()

    def test_a_new_server_is_set_up_from_the_phone_and_a_second_phone_joins(
        self, browser, tmp_path
    ):
        server = Server(tmp_path / "srv")
        try:
            first = WebSession(browser, tmp_path, "phone")
            page = first.page
            page.goto(server.url + "/")
            expect(page.locator("#setup-box")).to_be_visible()
            first.shot("first-run")
            page.fill("#setup-name", "Ada's phone")
            page.click("#setup")
            expect(page.locator("#dlg-title")).to_have_text("Keep this key safe")
            api_key = page.input_value("#setup-key")
            assert re.fullmatch(r"nsk_[A-Za-z0-9_-]{43}", api_key)
            first.dialog_choose("done")
            expect(page.locator("#app")).to_be_visible()
            kept = page.evaluate("localStorage.getItem('notesvc.key')")
            assert kept.startswith("nsd_")  # the browser keeps a device key, not the API key
            assert api_key not in json.dumps(page.evaluate("Object.assign({}, localStorage)"))
            setup = server.request("GET", f"{API}/system/setup")[2]["data"]
            assert setup["setupComplete"]
            assert setup["apiKey"] != api_key  # redacted from now on
            assert not setup["browserSetup"]
            # Add a device: the QR code on the screen is the link, decoded by a real decoder.
            page.click("#menu summary")
            page.click("#menu-keys")
            page.click("#add-device")
            page.fill("#device-name", "Second phone")
            first.dialog_choose("make")
            qr = page.locator("#pair-qr")
            expect(qr).to_be_visible()
            url = page.input_value("#pair-url")
            assert url.startswith(server.url + "/#pair=")
            if ZBARIMG:
                shot = tmp_path / "pair-qr.png"
                qr.screenshot(path=str(shot))
                assert decode_qr(shot) == url
            first.shot("pairing")
            started = time.monotonic()
            second = WebSession(browser, tmp_path, "phone")
            other = second.page
            other.goto(url)
            expect(other.locator("#pair-box")).to_be_visible()
            assert "#pair=" not in other.url  # out of the address bar and the history
            other.click("#pair-join")
            expect(other.locator("#app")).to_be_visible()
            assert (
                second.write_new("From the second phone\n")
                == "notes/inbox/From the second phone.md"
            )
            took = time.monotonic() - started
            print(f"pairing to first note on the second device: {took:.1f} s of page time")
            assert (tmp_path / "srv/notes/inbox/From the second phone.md").exists()
            expect(page.locator("#pair-status")).to_contain_text("joined", timeout=10_000)
            devices = [
                k
                for k in server.request(
                    "GET", f"{API}/auth/keys", headers={"X-Service-Key": api_key}
                )[2]["data"]["keys"]
                if k["kind"] == "device"
            ]
            assert sorted(d["name"] for d in devices) == ["Ada's phone", "Second phone"]
            # the link is good once
            third = WebSession(browser, tmp_path, "phone")
            third.page.goto(url)
            third.page.click("#pair-join")
            expect(third.page.locator("#pair-msg")).to_contain_text("used already")
            assert unexpected(first.close(), "404") == []
            assert unexpected(second.close()) == []
            assert unexpected(third.close(), "404") == []
        finally:
            server.stop()

    def test_add_a_device_on_the_servers_own_browser_draws_an_address_a_phone_opens(
        self, browser, tmp_path
    ):
        """Opened on http://127.0.0.1:<port> (the server's own browser), Add a device draws
        the address the banner gives phones, and says so; Keys and devices shows the MCP URL.
        A machine with no address but loopback gets the documented fallback: 127.0.0.1,
        with the page saying that only this computer opens it."""
        server = Server(tmp_path / "srv", host="0.0.0.0")
        try:
            key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]
            s = WebSession(browser, tmp_path, "phone")
            s.login(server.url + "/", key)
            page = s.page
            page.click("#menu summary")
            page.click("#menu-keys")
            # the MCP URL follows the rule of Add a device (the findings issue): the address
            # phones open, as the CalDAV address (checked below, with the pairing's)
            mcp = urllib.parse.urlsplit(page.input_value("#mcp-url"))
            assert mcp.path == "/api/v1/mcp"
            if machine_address():
                assert mcp.hostname not in ("127.0.0.1", "localhost", "::1")
            expect(page.locator("#mcp-steps")).to_contain_text("Add custom connector")
            expect(page.locator("#mcp-steps")).to_contain_text("ChatGPT")
            expect(page.locator("#mcp-reach")).to_contain_text("Away from home: the relay")
            page.locator("#mcp-url").scroll_into_view_if_needed()
            s.shot("connect-assistant")
            page.click("#add-device")
            page.fill("#device-name", "Second phone")
            s.dialog_choose("make")
            qr = page.locator("#pair-qr")
            expect(qr).to_be_visible()
            shot = tmp_path / "pair-qr-lan.png"
            qr.screenshot(path=str(shot))
            url = decode_qr(shot) if ZBARIMG else page.input_value("#pair-url")
            assert url == page.input_value("#pair-url")
            drawn = urllib.parse.urlsplit(url)
            assert drawn.port == server.port
            assert drawn.fragment.startswith("pair=")
            reach = page.locator("#pair-reach")
            assert f"{drawn.scheme}://{drawn.netloc}" == f"{mcp.scheme}://{mcp.netloc}"
            if machine_address():
                assert drawn.hostname not in ("127.0.0.1", "localhost", "::1")
                assert not ipaddress.ip_address(socket.gethostbyname(drawn.hostname)).is_loopback
                origin = f"{drawn.scheme}://{drawn.netloc}"
                expect(reach).to_have_text(f"It opens this server on your home network: {origin}")
            else:  # the documented fallback (docs/api.md: Devices)
                assert drawn.hostname == "127.0.0.1"
                expect(reach).to_contain_text("Only this computer opens http://127.0.0.1:")
            s.shot("pairing-lan")
            assert unexpected(s.close()) == []
        finally:
            server.stop()

    def test_the_servers_own_browser_draws_the_phones_address_in_every_link(
        self, browser, tmp_path
    ):
        """Opened on http://127.0.0.1:<port>: the calendar feed's link, a share link, the MCP
        URL and the CalDAV address all name the address phones open, as Add a device does
        (the findings issue); each says when it opens only at home."""
        if not machine_address():
            pytest.skip("this machine has no address but loopback: nothing else to draw")
        server = Server(tmp_path / "srv", host="0.0.0.0")
        try:
            key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]
            note = {"path": "notes/todo.md", "content": "# Todo\n\n- [ ] milk\n"}
            assert server.request("POST", f"{API}/notes", note, {KEY: key})[0] == 201
            s = WebSession(browser, tmp_path, "desktop")
            s.login(server.url + "/", key)
            page = s.page
            origin = lambda url: "://".join(urllib.parse.urlsplit(url)[:2])  # noqa: E731
            page.click("#menu summary")
            page.click("#menu-tasks")
            home = origin(page.input_value("#caldav-url"))
            assert urllib.parse.urlsplit(home).hostname not in ("127.0.0.1", "localhost")
            assert urllib.parse.urlsplit(home).port == server.port
            page.fill("#feed-name", "Calendar")
            page.click("#feed-create")
            assert origin(page.input_value("#feed-url")) == home
            # (said for a home network's address: this machine's may be another kind)
            name = urllib.parse.urlsplit(home).hostname
            at_home = name.endswith(".local") or any(
                ipaddress.ip_address(name) in ipaddress.ip_network(net)
                for net in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")
            )
            said = expect(page.locator("#feed-home-only"))
            said.to_contain_text("opens only at home") if at_home else said.to_have_count(0)
            s.shot("feed-from-the-servers-browser")
            page.keyboard.press("Escape")
            page.click("#menu summary")
            page.click("#menu-keys")
            assert origin(page.input_value("#mcp-url")) == home
            expect(page.locator("#mcp-reach")).to_contain_text("public URL")
            page.keyboard.press("Escape")
            s.tree_open("notes/todo.md")
            page.click("#note-menu summary")
            page.click("#share")
            page.click("#share-create")
            assert origin(page.input_value("#share-url")) == home
            said = expect(page.locator("#share-home-only"))
            said.to_be_visible() if at_home else said.to_have_count(0)
            with urllib.request.urlopen(page.input_value("#share-url"), timeout=10) as resp:
                assert resp.status == 200  # it opens there
            assert unexpected(s.close()) == []
        finally:
            server.stop()

    def test_keys_and_devices_shows_the_caldav_address_and_makes_a_feed(self, browser, tmp_path):
        """Tasks on your phone (README), one tap from the top of Keys and devices and in the
        menu: the CalDAV address with the apps' steps, and a calendar feed made there whose
        link (shown once) stays in view, focused and selected, until dismissed."""
        server = Server(tmp_path / "srv")
        try:
            key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]
            note = {"path": "notes/home/todo.md", "content": "- [ ] call the plumber\n"}
            assert server.request("POST", f"{API}/notes", note, {KEY: key})[0] == 201
            for name in ("Anna's Pixel", "Ben's iPhone", "Kitchen tablet"):  # a family's list
                made = server.request("POST", f"{API}/auth/devices/pairings", {}, {KEY: key})[2]
                claim = {"secret": made["data"]["secret"], "deviceName": name}
                assert server.request("POST", f"{API}/auth/devices/claim", claim)[0] == 201
            s = WebSession(browser, tmp_path, "phone")
            s.login(server.url + "/", key)
            page = s.page
            page.click("#menu summary")
            page.click("#menu-keys")
            # opened at its top, the tasks first: not 1.5 screens down, nor scrolled to the MCP URL
            expect(page.locator("#keys-tasks")).to_be_focused()
            expect(page.locator("#keys-tasks")).to_be_in_viewport()
            page.click("#keys-tasks")
            expect(page.locator("#dlg-title")).to_have_text("Tasks on your phone")
            expect(page.locator("#caldav-url")).to_have_value(re.compile(r"^http://.*/dav/$"))
            apps = page.locator("#tasks-app option").all_text_contents()
            assert apps == ["Reminders on iPhone", "Tasks on Android", "Thunderbird", "Tasks app"]
            expect(page.locator("#tasks-connect")).to_be_focused()
            s.shot("tasks-on-your-phone")
            page.fill("#feed-name", "Google")
            page.click("#feed-create")
            link = page.locator("#feed-url")
            expect(link).to_have_value(re.compile(r"/ics/[\w-]{32}\.ics$"))
            # the once-shown link keeps the focus, selected, in view: nothing jumps away
            expect(link).to_be_focused()
            expect(link).to_be_in_viewport()
            assert link.evaluate("i => i.selectionStart === 0 && i.selectionEnd === i.value.length")
            expect(page.locator("#feeds-list")).to_contain_text("Google")
            s.shot("feed-made")
            path = urllib.parse.urlsplit(page.input_value("#feed-url")).path
            with urllib.request.urlopen(server.url + path, timeout=10) as resp:
                feed = resp.read().decode()
            assert "SUMMARY:call the plumber" in feed
            page.click("#feed-done")  # dismissed: gone for good, the feed listed
            expect(page.locator("#feed-url")).to_have_count(0)
            expect(page.locator("#feeds-list")).to_contain_text("Google")
            page.keyboard.press("Escape")
            # the menu has it too
            page.click("#menu summary")
            page.click("#menu-tasks")
            expect(page.locator("#caldav-url")).to_be_visible()
            s.dialog_choose("cancel")
            # the link in a task's DESCRIPTION opens its note
            link = re.search(r"(http://\S+/#task=[\w-]+)", feed.replace("\r\n ", "")).group(1)
            page.goto(link.replace(urllib.parse.urlsplit(link).netloc, f"127.0.0.1:{server.port}"))
            expect(page.locator("#path")).to_contain_text("notes/home/todo.md")
            assert unexpected(s.close()) == []
        finally:
            server.stop()

    def test_connect_a_tasks_app_gives_an_address_a_user_name_and_a_password_that_work(
        self, browser, tmp_path
    ):
        """What the help names is what the page gives: the address, a user name and a
        password (a device key made for the app, shown once), which a CalDAV client signs in
        with; the app is then a device, listed and revocable, and no audit finding."""
        server = Server(tmp_path / "srv")
        try:
            key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]
            note = {"path": "notes/home/todo.md", "content": "- [ ] call the plumber\n"}
            assert server.request("POST", f"{API}/notes", note, {KEY: key})[0] == 201
            s = WebSession(browser, tmp_path, "phone")
            s.login(server.url + "/", key)
            page = s.page
            page.click("#menu summary")
            page.click("#menu-tasks")
            page.select_option("#tasks-app", "iphone")
            page.click("#tasks-connect")
            password = page.locator("#tasks-password")
            expect(password).to_have_value(re.compile(r"^nsd_[\w-]{43}$"))
            expect(password).to_be_focused()
            expect(page.locator("#tasks-steps")).to_contain_text("Add CalDAV Account")
            expect(page.locator("#dlg-body")).to_contain_text("shown this once")
            s.shot("tasks-app-connected")
            address = urllib.parse.urlsplit(page.input_value("#caldav-url"))
            user, secret = page.input_value("#tasks-user"), page.input_value("#tasks-password")
            assert user
            auth = "Basic " + base64.b64encode(f"{user}:{secret}".encode()).decode()
            conn = http.client.HTTPConnection(address.hostname, address.port, timeout=10)
            try:
                conn.request("PROPFIND", address.path, b"", {"Authorization": auth, "Depth": "0"})
                found = conn.getresponse()
                assert found.status == 207, found.read()
                assert "/dav/principal/" in found.read().decode()
                query = QUERY_TODOS.format("").encode()
                headers = {"Authorization": auth, "Depth": "1", "Content-Type": "application/xml"}
                conn.request("REPORT", "/dav/calendars/all/", query, headers)
                listed = conn.getresponse()
                assert listed.status == 207
                assert "SUMMARY:call the plumber" in listed.read().decode()
            finally:
                conn.close()
            page.click("#tasks-done")  # the password is gone from the page
            expect(page.locator("#tasks-password")).to_have_count(0)
            keys = server.request("GET", f"{API}/auth/keys", headers={KEY: key})[2]["data"]
            made = [g for g in keys["keys"] if g["name"] == "Reminders on iPhone"]
            assert [(g["kind"], g["scope"], g["folder"]) for g in made] == [
                ("device", "write", None)
            ]
            audit = server.request("GET", f"{API}/security/audit", headers={KEY: key})[2]
            assert "grant-write-forever" not in json.dumps(audit)
            assert unexpected(s.close()) == []
        finally:
            server.stop()

    def test_a_folder_pairing_lands_in_its_folder(self, browser, tmp_path):
        root = tmp_path / "srv"
        (root / "notes" / "family").mkdir(parents=True)
        (root / "notes" / "family" / "list.md").write_text("# Shopping\n\n- bread\n")
        (root / "notes" / "private.md").write_text("# Private\n")
        server = Server(root)
        try:
            key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]
            owner = WebSession(browser, tmp_path, "desktop")
            owner.login(server.url + "/", key)
            page = owner.page
            page.click("#menu summary")
            page.click("#menu-keys")
            page.click("#add-folder")
            page.fill("#device-name", "Anna")
            page.fill("#device-folder", "family")
            page.select_option("#device-scope", "write")
            owner.dialog_choose("make")
            code = page.locator("#pair-code")
            expect(code).to_have_text(re.compile(r"^([a-z2-7]{4}-){6}[a-z2-7]{2}$"))
            anna = WebSession(browser, tmp_path, "phone")  # no camera: the code is typed
            anna.page.goto(server.url + "/")
            anna.page.click("#code-box summary")
            anna.page.fill("#join-code", code.text_content().upper().replace("-", " "))
            anna.page.click("#join")
            expect(anna.page.locator("#app")).to_be_visible()
            expect(anna.page.locator("#tree")).to_contain_text("family")
            expect(anna.page.locator("#tree")).not_to_contain_text("private")
            assert anna.page.get_attribute("#app", "data-folder") == "notes/family"
            expect(anna.page.locator("#menu-keys")).to_be_hidden()
            assert unexpected(owner.close()) == []
            assert unexpected(anna.close()) == []
        finally:
            server.stop()

    def test_telegram_connects_from_the_page(self, browser, tmp_path, upstream):
        server = Server(tmp_path / "srv", env={"SERVICE_TELEGRAM_API_BASE": upstream.url})
        try:
            key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]
            s = WebSession(browser, tmp_path, "phone")
            s.login(server.url + "/", key)
            page = s.page
            page.click("#menu summary")
            page.click("#menu-telegram")
            upstream.refused_token = "111:bad"
            page.fill("#tg-token", "111:bad")
            s.dialog_choose("connect")
            expect(page.locator("#dlg-error")).to_contain_text("refused this token")
            expect(page.locator("#tg-token")).to_have_value("111:bad")  # kept, to correct
            page.fill("#tg-token", "222:good-token")
            s.dialog_choose("connect")
            code = page.locator("#tg-code")
            expect(code).to_have_text(re.compile(r"^[a-z2-7]{12}$"))
            expect(page.locator("#dlg-body a")).to_have_attribute(
                "href", f"https://t.me/notes_bot?start={code.text_content()}"
            )
            s.shot("telegram")
            upstream.push(telegram_update(f"/start {code.text_content()}", chat_id=42))
            expect(page.locator("#tg-status")).to_contain_text("Connected to Ada", timeout=15_000)
            s.dialog_choose("cancel")
            page.click("#menu summary")
            page.click("#menu-telegram")
            expect(page.locator("#dlg-body")).to_contain_text("saves what “Ada” sends it")
            assert unexpected(s.close(), "400") == []
        finally:
            server.stop()
