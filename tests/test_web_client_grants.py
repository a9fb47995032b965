"""The web client's grants: folders, consent and share pages (web/)."""

from __future__ import annotations

import re
import urllib.error
import urllib.parse
import urllib.request

import pytest

from browsers import BROWSER_TESTS, CHROMIUM, CHROMIUM_ARGS, expect, unexpected
from conftest import API, CALLBACK, owner_headers, pkce_pair, post_oauth_form, running, wait_for
from standins import Callback


class TestWebClientGrants:
    """The keys screen, the Share action, and a scoped key's page (issue 19, item 6)."""

    pytestmark = BROWSER_TESTS

    def test_keys_and_connections(self, web):
        s = web("desktop")
        page = s.page
        owner = owner_headers(web.setup)
        # A connected app, as an OAuth client would make one.
        _, _, reg = web.server.request(
            "POST", "/oauth/register", {"redirect_uris": [CALLBACK], "client_name": "Pocket AI"}
        )
        verifier, challenge = pkce_pair()
        approval = {
            "clientId": reg["client_id"],
            "redirectUri": CALLBACK,
            "codeChallenge": challenge,
            "scope": "notes:read",
            "resource": f"{web.server.url}{API}/mcp",
        }
        _, _, ok = web.server.request("POST", f"{API}/oauth/approve", approval, owner)
        code = urllib.parse.parse_qs(urllib.parse.urlsplit(ok["data"]["redirect"]).query)["code"]
        status, _ = post_oauth_form(
            f"{web.server.url}/oauth/token",
            {
                "grant_type": "authorization_code",
                "code": code[0],
                "client_id": reg["client_id"],
                "redirect_uri": CALLBACK,
                "code_verifier": verifier,
            },
        )
        assert status == 200
        page.click("#menu summary")
        page.click("#menu-keys")
        expect(page.locator("#dlg-title")).to_have_text("Keys and devices")
        expect(page.locator("#connections-list")).to_contain_text("Pocket AI")
        expect(page.locator("#keys-list")).to_contain_text("No scoped keys yet")
        page.fill("#key-name", "kitchen tablet")
        page.select_option("#key-scope", "write")
        page.fill("#key-folder", "kitchen")
        page.select_option("#key-days", "365")
        page.click("#key-create")
        expect(page.locator("#new-key")).to_have_value(re.compile(r"^nsg_[A-Za-z0-9_-]{43}$"))
        key = page.input_value("#new-key")
        row = page.locator("#keys-list li")
        expect(row).to_contain_text("kitchen tablet")
        expect(row).to_contain_text("read and write · only notes/kitchen")
        s.shot("keys")
        _, _, listed = web.server.request("GET", f"{API}/auth/keys", headers=owner)
        made = next(k for k in listed["data"]["keys"] if k["kind"] == "key")
        assert (made["scope"], made["folder"], made["expiresAt"] is not None) == (
            "write",
            "notes/kitchen",
            True,
        )
        assert web.server.request("GET", f"{API}/notes", headers={"X-Service-Key": key})[0] == 200
        # Revoked from the screen: refused at once.
        row.locator("button", has_text="Revoke").click()
        s.dialog_choose("revoke")
        expect(page.locator("#keys-list")).to_contain_text("No scoped keys yet")
        assert web.server.request("GET", f"{API}/notes", headers={"X-Service-Key": key})[0] == 401
        page.locator("#connections-list li button", has_text="Revoke").click()
        s.dialog_choose("revoke")
        expect(page.locator("#connections-list")).to_contain_text("No app is connected")
        assert unexpected(s.close()) == []

    def test_a_device_shows_what_it_made_and_one_tap_revokes_it_all(self, web):
        server, owner = web.server, owner_headers(web.setup)

        def post(path: str, body: dict, headers: dict | None = None) -> dict:
            status, _, answer = server.request("POST", f"{API}{path}", body, headers)
            assert status == 201, answer
            return answer["data"]

        def joined(made_by: dict, name: str, scope: str) -> dict:
            made = post("/auth/devices/pairings", {"scope": scope}, made_by)
            return post("/auth/devices/claim", {"secret": made["secret"], "deviceName": name})

        s = web("desktop")
        page = s.page
        own = post("/auth/keys", {"name": "own key", "scope": "read"}, owner)
        laptop = joined(owner, "Ada's laptop", "admin")
        as_laptop = {"X-Service-Key": laptop["key"]}
        garden = post("/auth/keys", {"name": "garden key", "scope": "write"}, as_laptop)
        kid = joined(as_laptop, "Kid's phone", "read")
        page.click("#menu summary")
        page.click("#menu-keys")
        expect(page.locator("#keys-list li", has_text="own key")).to_contain_text("made by you")
        expect(page.locator("#keys-list li", has_text="garden key")).to_contain_text(
            "made by “Ada's laptop”"
        )
        devices = page.locator("#devices-list")
        expect(devices.locator("li", has_text="Kid's phone")).to_contain_text(
            "made by “Ada's laptop”"
        )
        row = devices.locator("li", has_text="Ada's laptop · ")
        expect(row).to_contain_text("made 2")
        row.scroll_into_view_if_needed()
        s.shot("keys-made-by")
        row.locator("button", has_text="Revoke").click()
        expect(page.locator("#revoke-made")).to_contain_text("It made 2 keys, devices or apps")
        expect(page.locator("#revoke-made")).to_contain_text("“garden key”, “Kid's phone”")
        s.shot("revoke-made")
        s.dialog_choose("cascade")
        expect(page.locator("#dlg-title")).to_have_text("Keys and devices")
        expect(page.locator("#devices-list")).not_to_contain_text("Ada's laptop")
        expect(page.locator("#devices-list")).not_to_contain_text("Kid's phone")
        expect(page.locator("#keys-list")).not_to_contain_text("garden key")
        expect(page.locator("#keys-list")).to_contain_text("own key")
        for key, status in ((laptop, 401), (garden, 401), (kid, 401), (own, 200)):
            headers = {"X-Service-Key": key["key"]}
            assert server.request("GET", f"{API}/notes", headers=headers)[0] == status
        assert unexpected(s.close()) == []

    def test_share_a_note_and_open_the_link_in_a_fresh_browser(self, web, browser):
        s = web("phone")
        page = s.page
        s.tree_open("notes/kitchen/pancakes.md")
        page.click("#note-menu summary")
        page.click("#share")
        expect(page.locator("#share-links")).to_contain_text("Not shared yet")
        page.click("#share-create")
        expect(page.locator("#share-url")).to_have_value(re.compile(r"/s/[A-Za-z0-9_-]{22}$"))
        url = page.input_value("#share-url")
        expect(page.locator("#share-links")).to_contain_text("pancakes · expires")
        # made on 127.0.0.1: the dialog says where it opens, and how to get a public one
        note = page.locator("#share-home-only")
        expect(note).to_contain_text("It opens only at home (127.0.0.1:")
        expect(note).to_contain_text("Away from home: the relay")
        s.shot("share")
        stranger = browser.new_context()  # no key, nothing stored
        try:
            other = stranger.new_page()
            other.goto(url)
            expect(other.locator("article h1")).to_have_text("Pancakes")
            expect(other.locator("article td")).to_have_count(4)
            page.locator("#share-links li button", has_text="Revoke").click()
            expect(page.locator("#share-links")).to_contain_text("Not shared yet")
            other.reload()
            expect(other.locator("#msg")).to_contain_text("expired or been revoked")
        finally:
            stranger.close()
        assert unexpected(s.close()) == []

    def test_a_read_key_for_one_folder_sees_that_folder_and_no_edit(self, web):
        owner = owner_headers(web.setup)
        body = {"name": "fridge screen", "scope": "read", "folder": "notes/home"}
        key = web.server.request("POST", f"{API}/auth/keys", body, owner)[2]["data"]["key"]
        s = web("phone", login=False)
        page = s.page
        s.login(web.setup["links"]["connect"]["hosted"], key)
        expect(page.locator("#tree")).to_contain_text("home")
        assert page.locator("#tree").inner_text().count("kitchen") == 0
        assert page.locator('#tree button[data-path="notes/todo.md"]').count() == 0
        for hidden in ("#new", "#menu-new", "#menu-keys", ".capture"):
            assert page.locator(hidden).is_hidden(), hidden
        s.tree_open("notes/home/keys.md")
        expect(page.locator("#view h1")).to_have_text("Spare keys")
        for hidden in ("#edit", "#share", "#move", "#delete", "#attach"):
            assert page.locator(hidden).is_hidden(), hidden
        assert all(
            page.locator("#view input[type=checkbox]").evaluate_all("bs => bs.map(b => b.disabled)")
        )
        s.shot("read-key")
        # The page never asked for what the key may not do.
        assert s.api_calls("/auth/link") == []
        assert not [
            r
            for r in s.requests
            if r.method in ("PUT", "POST", "PATCH", "DELETE")
            and not r.url.endswith(("/auth/verify", "/agent/chat"))
        ]
        assert unexpected(s.close()) == []


def tiny_png() -> bytes:
    """A real 1x1 PNG (a browser decodes it)."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
        return struct.pack(">I", len(body)) + kind + body + crc

    header = struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)
    pixels = zlib.compress(b"\x00\xc0\x30\x30")
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")
    )


class TestGrantPages:
    """The consent page and the share page in a real browser."""

    pytestmark = BROWSER_TESTS

    @pytest.fixture
    def browser(self):
        sync_api = pytest.importorskip("playwright.sync_api")
        if not CHROMIUM:
            pytest.skip("no Chromium on this machine")
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                yield browser, sync_api.expect
            finally:
                browser.close()

    def test_consent_on_a_phone(self, tmp_path, browser):
        browser, expect = browser
        cb = Callback()
        try:
            with running(tmp_path) as server:
                setup = server.request("GET", f"{API}/system/setup")[2]["data"]
                reg = server.request(
                    "POST",
                    "/oauth/register",
                    {"redirect_uris": [cb.url], "client_name": "Phone app"},
                )[2]
                endpoint = server.request("GET", "/.well-known/oauth-authorization-server")[2][
                    "authorization_endpoint"
                ]
                resource = f"{server.url}/api/v1/mcp"

                def authorize_url(client_id: str, state: str) -> tuple:
                    verifier, challenge = pkce_pair()
                    q = urllib.parse.urlencode(
                        {
                            "response_type": "code",
                            "client_id": client_id,
                            "redirect_uri": cb.url,
                            "state": state,
                            "code_challenge": challenge,
                            "code_challenge_method": "S256",
                            "scope": "notes:read",
                            "resource": resource,
                        }
                    )
                    return f"{endpoint}?{q}", verifier

                context = browser.new_context(
                    viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True
                )
                page = context.new_page()
                url, verifier = authorize_url(reg["client_id"], "phone-1")
                page.goto(url)
                expect(page.locator("#client")).to_have_text("Phone app")
                expect(page.locator("#host")).to_have_text(urllib.parse.urlsplit(cb.url).netloc)
                expect(page.locator("#write-row")).to_be_hidden()  # SERVICE_MCP_WRITE is off
                page.screenshot(path=str(tmp_path / "consent-390x844.png"), full_page=True)
                assert page.evaluate("document.documentElement.scrollWidth") <= 390
                page.fill("#key", "nsk_" + "w" * 43)
                page.fill("#folder", "family")
                page.click("#allow")
                expect(page.locator("#msg")).to_contain_text("wrong")
                assert cb.hits == []
                page.fill("#key", setup["apiKey"])
                page.click("#allow")
                page.wait_for_url(re.compile(r".*/callback\?"))
                query = cb.query()
                assert query["state"] == ["phone-1"]
                assert query["iss"] == [server.url]
                status, tokens = post_oauth_form(
                    f"{server.url}/oauth/token",
                    {
                        "grant_type": "authorization_code",
                        "code": query["code"][0],
                        "client_id": reg["client_id"],
                        "redirect_uri": cb.url,
                        "code_verifier": verifier,
                        "resource": resource,
                    },
                )
                assert status == 200
                assert tokens["scope"] == "notes:read"
                _, _, keys = server.request("GET", f"{API}/auth/keys", headers=owner_headers(setup))
                assert keys["data"]["keys"][0]["folder"] == "notes/family"
                # Deny goes back with access_denied.
                url, _ = authorize_url(reg["client_id"], "phone-2")
                page.goto(url)
                expect(page.locator("#client")).to_have_text("Phone app")
                page.click("#deny")
                page.wait_for_url(re.compile(r".*/callback\?.*error="))
                query = cb.query()
                assert query["error"] == ["access_denied"]
                assert query["state"] == ["phone-2"]
                # An unknown client is shown and nothing is redirected to.
                url, _ = authorize_url("mcp_nobody", "phone-3")
                page.goto(url)
                expect(page.locator("#msg")).to_contain_text("no client is registered")
                expect(page.locator("#ask")).to_be_hidden()
                assert len(cb.hits) == 2
                # Framed by another page, it never shows.
                page.goto(cb.url)
                page.evaluate(
                    "(src) => new Promise((done) => { const f = document.createElement('iframe');"
                    " f.onload = () => done(); f.src = src; document.body.appendChild(f); })",
                    authorize_url(reg["client_id"], "framed")[0],
                )
                framed = page.frames[1]
                assert framed.url.startswith("chrome-error://") or not framed.query_selector(
                    "#allow"
                )
                context.close()
        finally:
            cb.close()

    def test_a_share_link_in_a_fresh_browser(self, tmp_path, browser):
        browser, expect = browser
        with running(tmp_path) as server:
            setup = server.request("GET", f"{API}/system/setup")[2]["data"]
            owner = owner_headers(setup)
            text = (
                "# Grandma's pie\n\nMix **apples** and *butter*; "
                "see [the shop](https://shop.example).\n\n- [x] apples\n- [ ] sugar\n\n"
                "> keep it warm\n\n```\n<script>alert(1)</script>\n```\n\n"
                "| step | minutes |\n|---|---|\n| bake | 40 |\n\n<img src=x onerror=alert(2)>\n"
                "\n![the pie](../attachments/pie.png) ![elsewhere](https://img.example/x.png)\n"
            )
            put = urllib.request.Request(
                f"{server.url}{API}/attachments/attachments%2Fpie.png",
                tiny_png(),
                {**owner, "Content-Type": "application/octet-stream"},
                method="PUT",
            )
            urllib.request.urlopen(put, timeout=30).close()
            server.request("POST", f"{API}/notes", {"path": "notes/pie.md", "content": text}, owner)
            _, _, made = server.request("POST", f"{API}/shares", {"path": "notes/pie.md"}, owner)
            context = browser.new_context()  # no key, no storage
            page = context.new_page()
            dialogs, sent = [], []
            page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
            page.on("request", lambda r: sent.append((r.url, r.headers)))
            page.goto(made["data"]["url"])
            expect(page.locator("article h1")).to_have_text("Grandma's pie")
            assert page.title() == "Grandma's pie"
            expect(page.locator("article strong")).to_have_text("apples")
            expect(page.locator("article li")).to_have_count(2)
            assert page.locator("article input[type=checkbox]").first.is_checked()
            assert page.locator("article a").get_attribute("rel") == "noopener noreferrer nofollow"
            expect(page.locator("article pre")).to_have_text("<script>alert(1)</script>")
            expect(page.locator("article td")).to_have_count(2)
            assert "<img src=x onerror=alert(2)>" in page.inner_text("article")
            image = page.locator("article img")
            expect(image).to_have_count(1)  # the note's own attachment; never another host's
            assert image.get_attribute("alt") == "the pie"
            wait_for(lambda: page.evaluate("document.querySelector('article img').complete"))
            assert image.evaluate("(img) => img.naturalWidth") == 1
            assert "[image: elsewhere]" in page.inner_text("article")
            assert dialogs == []
            page.screenshot(path=str(tmp_path / "share.png"), full_page=True)
            assert all(
                "x-service-key" not in h and "authorization" not in h and not h.get("referer")
                for _, h in sent
            )
            origins = {urllib.parse.urlsplit(u).netloc for u, _ in sent}
            assert origins == {urllib.parse.urlsplit(server.url).netloc}
            # A revoked link says so.
            _, _, listed = server.request("GET", f"{API}/shares", headers=owner)
            share_id = listed["data"]["shares"][0]["id"]
            server.request("DELETE", f"{API}/shares/{share_id}", headers=owner)
            page.reload()
            expect(page.locator("#msg")).to_contain_text("expired or been revoked")
            expect(page.locator("article")).to_be_empty()
            context.close()
