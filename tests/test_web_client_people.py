"""The web client for a household: who is signed in, People, Share…, Shared with me, and
the consent page for a person's admin device (web/people.js, web/consent.js; issue 52)."""

from __future__ import annotations

import shutil
import subprocess
import urllib.parse

import pytest

from browsers import BROWSER_TESTS, WebSession, expect, unexpected
from conftest import API, pkce_pair, post_oauth_form
from standins import Callback

ZBARIMG = shutil.which("zbarimg")


def call(server, method: str, path: str, body=None, key: str = "", status: int = 0) -> dict:
    """Send one API request to a real server as `key`; return its data (checking the status:
    the one given, else any 2xx)."""
    got, _, answer = server.request(method, f"{API}{path}", body, {"X-Service-Key": key})
    assert (got == status) if status else (200 <= got < 300), (got, answer)
    return answer.get("data") if isinstance(answer, dict) else answer


def person_with_device(server, owner: str, name: str) -> tuple:
    """Add a person as the owner and claim their first device: (person, device key)."""
    made = call(server, "POST", "/people", {"name": name}, owner)
    claim = {"secret": made["pairing"]["secret"], "deviceName": f"{name}'s phone"}
    return made["person"], call(server, "POST", "/auth/devices/claim", claim)["key"]


def share(server, key: str, folder: str, *members: tuple) -> None:
    body = {"members": [{"person": p["id"], "scope": scope} for p, scope in members]}
    call(server, "PUT", f"/folders/{urllib.parse.quote(folder, safe='')}/members", body, key)


def decode_qr(png) -> str:
    """The text of the QR code in a picture (Debian's zbarimg: a real decoder)."""
    done = subprocess.run(
        [ZBARIMG, "--quiet", "--raw", str(png)], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def open_menu(s: WebSession) -> None:
    s.page.click("#menu summary")
    expect(s.page.locator("#who")).to_be_visible()


def share_button(s: WebSession, folder: str):
    """The Share… button of a folder's row in the tree (hovered first, as a mouse does)."""
    if s.device == "phone" and s.page.get_attribute("#app", "data-pane") != "notes":
        s.tap(".tabs button[data-pane=notes]")
    folder_button = s.page.locator(f"#tree button.dir[data-path='{folder}']")
    if s.device == "desktop" and folder_button.count():
        folder_button.hover()
    return s.page.locator(f"#tree li:has(> button.dir[data-path='{folder}']) > button.share")


def top_level(s: WebSession) -> list:
    """The tree's first level as shown: each folder's name and the line under it."""
    if s.device == "phone" and s.page.get_attribute("#app", "data-pane") != "notes":
        s.tap(".tabs button[data-pane=notes]")
    rows = s.page.locator("#tree > ul > li")
    return [" ".join(t.split()) for t in rows.all_inner_texts()]


class TestWebClientPeople:
    """People for the owner, and what a person's page shows (issue 52, item 5)."""

    pytestmark = BROWSER_TESTS

    @pytest.mark.parametrize("device", ["desktop", "phone"])
    def test_the_owner_adds_a_person_whose_phone_joins_by_scanning_and_sees_their_home(
        self, web, browser, tmp_path, device
    ):
        owner = web(device)
        page = owner.page
        open_menu(owner)
        expect(page.locator("#who")).to_have_text("Signed in as Owner · the server key")
        page.click("#menu-people")
        expect(page.locator("#dlg-title")).to_have_text("People")
        expect(page.locator("#people-list")).to_contain_text("No one yet")
        owner.shot("people-empty")
        page.fill("#person-name", "Ann")
        page.click("#person-add")
        expect(page.locator("#dlg-title")).to_have_text("Ann's first device")
        qr = page.locator("#pair-qr")
        expect(qr).to_be_visible()
        url = page.input_value("#pair-url")
        assert url.startswith(web.server.url + "/#pair=")
        if ZBARIMG:
            picture = tmp_path / f"person-qr-{device}.png"
            qr.screenshot(path=str(picture))
            assert decode_qr(picture) == url
        owner.shot("people-first-device")
        # Ann's phone opens the link (as her camera would) and joins: no key typed
        ann = WebSession(browser, tmp_path, "phone")
        ann.page.goto(url)
        expect(ann.page.locator("#pair-box")).to_be_visible()
        ann.page.click("#pair-join")
        expect(ann.page.locator("#app")).to_be_visible()
        expect(page.locator("#pair-status")).to_contain_text("joined", timeout=10_000)
        # her page: her home and nothing of the owner's; the menu says who she is
        expect(ann.page.locator("#tree button.dir").first).to_contain_text("My notes")
        assert top_level(ann) == ["My notes No notes yet: start one with New note."]
        open_menu(ann)
        expect(ann.page.locator("#who")).to_have_text("Signed in as Ann · Ann's first device")
        for hidden in ("#menu-people", "#menu-telegram"):
            expect(ann.page.locator(hidden)).to_be_hidden()
        expect(ann.page.locator("#menu-keys")).to_be_visible()
        ann.shot("person-menu")
        ann.page.keyboard.press("Escape")
        assert ann.write_new("Call the plumber\n") == "notes/Ann/inbox/Call the plumber.md"
        # the owner's People: Ann, her home, her device
        owner.dialog_choose("cancel")
        expect(page.locator("#dlg-title")).to_have_text("People")
        row = page.locator("#people-list > li", has_text="Ann")
        expect(row).to_contain_text("notes/Ann · 1 device")
        expect(row.locator(".held")).to_contain_text("Ann's first device · device")
        owner.shot("people-one")
        assert unexpected(owner.close()) == []
        assert unexpected(ann.close()) == []

    @pytest.mark.parametrize("device", ["desktop", "phone"])
    def test_the_owner_shares_a_folder_and_each_person_sees_it_shared_with_who_shared_it(
        self, web, browser, tmp_path, device
    ):
        server, key = web.server, web.setup["apiKey"]
        _, ann_key = person_with_device(server, key, "Ann")
        _, bob_key = person_with_device(server, key, "Bob")
        owner = web(device)
        page = owner.page
        # the owner's tree names the people's homes, and each folder has Share…
        assert top_level(owner)[:2] == ["Ann Ann's home 0", "Bob Bob's home 0"]
        share_button(owner, "notes/kitchen").click()
        expect(page.locator("#dlg-title")).to_have_text("Share “kitchen”")
        expect(page.locator("#share-members")).to_have_text("Not shared yet: only you see it.")
        assert page.locator("#share-person option").all_inner_texts() == ["Ann", "Bob"]
        page.select_option("#share-person", label="Ann")  # can edit: the default
        page.click("#share-add")
        expect(page.locator("#share-members li[data-person]")).to_have_count(1)
        page.select_option("#share-person", label="Bob")
        page.select_option("#share-scope", "read")
        page.click("#share-add")
        chips = page.locator("#share-members li[data-person]")
        expect(chips).to_have_count(2)
        expect(chips.nth(0)).to_contain_text("Ann")
        assert chips.nth(0).locator("select").input_value() == "write"
        assert chips.nth(1).locator("select").input_value() == "read"
        expect(page.locator("#dlg-body")).to_contain_text("Everyone here has it now.")
        expect(page.locator("#dlg-body h3")).to_have_count(0)  # no "Share with": no one left
        owner.shot("share-dialog")
        members = call(server, "GET", "/folders/notes%2Fkitchen/members", key=key)["members"]
        assert [(m["name"], m["scope"]) for m in members] == [("Ann", "write"), ("Bob", "read")]
        owner.dialog_choose("cancel")
        # the owner's list says what is shared, and with whom; its Share… stays in view
        kitchen = page.locator("#tree button.dir[data-path='notes/kitchen']")
        expect(kitchen).to_contain_text("Shared with Ann, Bob")
        expect(share_button(owner, "notes/kitchen")).to_have_class("share on")
        owner.shot("shared-by-owner")
        # each person's list: their home, then Shared with me with who shared it
        as_ann = web(device, login=False)
        as_ann.login(web.setup["links"]["connect"]["hosted"], ann_key)
        assert top_level(as_ann) == [
            "My notes No notes yet: start one with New note.",
            "SHARED WITH ME",  # (as shown: a heading)
            "kitchen Shared by Owner · can edit",
        ]
        recent = as_ann.page.locator("#recent [data-path='notes/kitchen/pancakes.md'] .avatar")
        expect(recent).to_have_attribute("aria-label", "Shared by Owner")  # and its initial
        as_ann.shot("shared-with-me")
        as_bob = web(device, login=False)
        as_bob.login(web.setup["links"]["connect"]["hosted"], bob_key)
        as_bob.tree_open("notes/kitchen/pancakes.md")
        expect(as_bob.page.locator("#note-shared")).to_have_text("Shared by Owner · view only")
        expect(as_bob.page.locator("#edit")).to_be_hidden()  # a read share: nothing to edit
        expect(as_bob.page.locator("#share-folder")).to_be_hidden()  # nor to share on
        as_bob.shot("shared-note-read")
        as_ann.tree_open("notes/kitchen/pancakes.md")
        expect(as_ann.page.locator("#note-shared")).to_have_text("Shared by Owner")
        expect(as_ann.page.locator("#edit")).to_be_visible()
        # the owner takes Bob off: his list loses the folder at its next look
        share_button(owner, "notes/kitchen").click()
        page.locator(
            "#share-members li[data-person] button[aria-label='Stop sharing with Bob']"
        ).click()
        expect(page.locator("#share-members li[data-person]")).to_have_count(1)
        call(server, "GET", "/notes/notes%2Fkitchen%2Fpancakes.md", key=bob_key, status=404)
        open_menu(as_bob)
        as_bob.page.click("#menu-refresh")
        expect(as_bob.page.locator("#shared-head")).to_have_count(0)
        assert top_level(as_bob) == ["My notes No notes yet: start one with New note."]
        for s in (owner, as_ann):
            assert unexpected(s.close()) == []
        # (the open note, taken away; his waiting feed cut when the share ended: it lists again)
        assert unexpected(as_bob.close(), "404", "410") == []

    @pytest.mark.parametrize("device", ["desktop", "phone"])
    def test_a_person_shares_a_folder_of_their_home_and_a_deeper_share_shows_inherited_members(
        self, web, tmp_path, device
    ):
        server, key = web.server, web.setup["apiKey"]
        ann, ann_key = person_with_device(server, key, "Ann")
        bob, bob_key = person_with_device(server, key, "Bob")
        for path, as_key in (
            ("notes/Ann/Trips/rome.md", ann_key),
            ("notes/kitchen/baking/b.md", key),
        ):
            call(server, "POST", "/notes", {"path": path, "content": "# A note\n"}, as_key)
        share(server, key, "notes/kitchen", (ann, "read"))
        as_ann = web(device, login=False)
        as_ann.login(web.setup["links"]["connect"]["hosted"], ann_key)
        page = as_ann.page
        # her home's folders have Share…; her home itself and what is shared with her don't
        expect(page.locator("#tree button.dir[data-path='notes/Ann/Trips']")).to_be_visible()
        assert share_button(as_ann, "notes/Ann").count() == 0
        assert share_button(as_ann, "notes/kitchen").count() == 0
        share_button(as_ann, "notes/Ann/Trips").click()
        expect(page.locator("#dlg-title")).to_have_text("Share “Trips”")
        # whom she may share with: the others (not herself); the owner sees all anyway
        assert page.locator("#share-person option").all_inner_texts() == ["Bob"]
        expect(page.locator("#dlg-body")).to_contain_text("The server's owner can read every")
        page.select_option("#share-scope", "read")
        page.click("#share-add")
        expect(page.locator(f"#share-members li[data-person='{bob['id']}']")).to_be_visible()
        as_ann.shot("person-shares")
        as_ann.dialog_choose("cancel")
        trips = page.locator("#tree button.dir[data-path='notes/Ann/Trips']")
        expect(trips).to_contain_text("Shared with Bob")
        as_ann.tree_open("notes/Ann/Trips/rome.md")
        expect(page.locator("#note-shared")).to_have_text("Shared with Bob")
        # the note's menu offers its folder's Share… too, apart from a link to the note
        page.click("#note-menu summary")
        expect(page.locator("#share")).to_have_text("Share a link…")
        as_ann.shot("note-menu")
        page.click("#share-folder:has-text('Share “Trips” with people…')")
        expect(page.locator("#dlg-title")).to_have_text("Share “Trips”")
        as_ann.dialog_choose("cancel")
        as_bob = web(device, login=False)
        as_bob.login(web.setup["links"]["connect"]["hosted"], bob_key)
        assert top_level(as_bob)[1:] == ["SHARED WITH ME", "Trips Shared by Ann · view only"]
        # a folder inside a shared one: its own members, and those it inherits (marked)
        owner = web(device)
        owner.page.click("#tree button.dir[data-path='notes/kitchen']")
        share_button(owner, "notes/kitchen/baking").click()
        inherited = owner.page.locator(f"#share-members li[data-person='{ann['id']}']")
        expect(inherited).to_contain_text("view only · from kitchen")
        assert inherited.locator("select, button").count() == 0  # changed where it is shared
        owner.page.select_option("#share-person", label="Bob")
        owner.page.click("#share-add")
        expect(owner.page.locator("#share-members li[data-person]")).to_have_count(2)
        assert owner.page.locator("#share-person option").all_inner_texts() == ["Ann"]
        owner.shot("share-inherited")
        members = call(server, "GET", "/folders/notes%2Fkitchen%2Fbaking/members", key=key)
        assert [(m["name"], m.get("inherited", False)) for m in members["members"]] == [
            ("Bob", False),
            ("Ann", True),
        ]
        for s in (as_ann, as_bob, owner):
            assert unexpected(s.close()) == []

    @pytest.mark.parametrize("device", ["desktop", "phone"])
    def test_the_owner_renames_and_removes_a_person_and_their_page_is_signed_out(self, web, device):
        server, key = web.server, web.setup["apiKey"]
        ann, ann_key = person_with_device(server, key, "Ann")
        call(server, "POST", "/auth/keys", {"name": "Ann's laptop key", "scope": "read"}, ann_key)
        as_ann = web("phone", login=False)
        as_ann.login(web.setup["links"]["connect"]["hosted"], ann_key)
        owner = web(device)
        page = owner.page
        open_menu(owner)
        page.click("#menu-people")
        row = page.locator(f"#people-list > li[data-person='{ann['id']}']")
        expect(row).to_contain_text("notes/Ann · 1 device")
        expect(row.locator(".held li")).to_have_count(2)  # her phone, her key
        # Rename: the person's name, not their folder's
        row.locator("button", has_text="Rename").click()
        expect(page.locator("#dlg-title")).to_have_text("Rename Ann")
        page.fill("#person-rename", "Bob/../x")
        owner.dialog_choose("save")
        expect(page.locator("#dlg-error")).to_contain_text("'name'")  # refused, said, kept
        assert page.input_value("#person-rename") == "Bob/../x"
        page.fill("#person-rename", "Annie")
        owner.dialog_choose("save")
        expect(page.locator("#dlg-title")).to_have_text("People")
        expect(row).to_contain_text("Annie")
        expect(row).to_contain_text("notes/Ann ·")
        # Remove: the confirmation says what ends and what stays
        row.locator("button", has_text="Remove").click()
        expect(page.locator("#dlg-title")).to_have_text("Remove Annie?")
        body = page.locator("#dlg-body")
        expect(body).to_contain_text("Annie's 1 device and 1 key or app stop working at once")
        expect(body).to_contain_text("share links, calendar feeds and chats")
        expect(page.locator("#remove-stays")).to_have_text(
            "Annie's notes stay in notes/Ann, where you still see them."
        )
        owner.shot("people-remove")
        owner.dialog_choose("remove")
        expect(page.locator("#toast")).to_contain_text("Annie removed: 2 devices, keys and apps")
        expect(page.locator("#people-list")).to_contain_text("No one yet")
        call(server, "GET", "/notes", key=ann_key, status=401)
        # her open page: its waiting change feed is ended at once (401), and a 401 takes a
        # page to the key screen
        expect(as_ann.page.locator("#login")).to_be_visible()
        kept = "[localStorage, sessionStorage].map((s) => s.getItem('notesvc.key'))"
        assert as_ann.page.evaluate(kept) == [None, None]  # her key is kept nowhere
        assert unexpected(owner.close(), "400") == []  # (the name refused, on purpose)
        assert unexpected(as_ann.close(), "401") == []

    def test_a_persons_page_offers_none_of_the_owners_settings(self, web):
        server, key = web.server, web.setup["apiKey"]
        _, ann_key = person_with_device(server, key, "Ann")
        person_with_device(server, key, "Bob")
        s = web("desktop", login=False)
        s.login(web.setup["links"]["connect"]["hosted"], ann_key)
        page = s.page
        open_menu(s)
        expect(page.locator("#who")).to_have_text("Signed in as Ann · Ann's phone")
        for owner_only in ("#menu-people", "#menu-telegram"):
            expect(page.locator(owner_only)).to_be_hidden()
        page.click("#menu-keys")  # her own devices, keys and apps
        expect(page.locator("#devices-list li")).to_have_count(1)
        expect(page.locator("#devices-list")).to_contain_text("Ann's phone")
        expect(page.locator("#add-device")).to_be_visible()
        expect(page.locator("#add-folder")).to_have_count(0)  # others join as people
        s.dialog_choose("cancel")
        for route in ("/people", "/channels", "/security/audit", "/system/config"):
            assert s.api_calls(route) == [], route  # never asked: not hers to see
        assert s.failed == []  # and nothing she asked was refused
        assert unexpected(s.close()) == []

    def test_the_consent_page_signs_a_person_in_and_offers_only_their_folders(
        self, web, browser, tmp_path
    ):
        server, key = web.server, web.setup["apiKey"]
        call(server, "POST", "/notes", {"path": "notes/secret/diary.md", "content": "x"}, key)
        made = call(server, "POST", "/people", {"name": "Ann"}, key)
        ann = made["person"]
        share(server, key, "notes/kitchen", (ann, "read"))
        s = WebSession(browser, tmp_path, "phone")  # her phone joins from the owner's code
        s.page.goto(made["pairing"]["url"])
        s.page.click("#pair-join")
        expect(s.page.locator("#app")).to_be_visible()
        callback = Callback()
        try:
            status, _, reg = server.request(
                "POST", "/oauth/register", {"redirect_uris": [callback.url], "client_name": "Pal"}
            )
            assert status == 201
            verifier, challenge = pkce_pair()
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
            expect(page.locator("#signed-in")).to_have_text(
                "Signed in as Ann · Ann's first device."
            )
            expect(page.locator("#key")).to_be_hidden()
            expect(page.locator("#folder")).to_be_hidden()
            offered = page.locator("#folder-pick option")
            assert [o.get_attribute("value") for o in offered.all()] == [
                "",
                "notes/Ann",
                "notes/kitchen",
            ]
            expect(offered.nth(2)).to_have_text("notes/kitchen (shared by Owner, read only)")
            s.shot("consent-person")
            page.select_option("#folder-pick", "notes/kitchen")
            page.click("#allow")
            back = callback.query()
            assert back["state"] == ["s1"]
            status, tokens = post_oauth_form(
                f"{server.url}/oauth/token",
                {
                    "grant_type": "authorization_code",
                    "code": back["code"][0],
                    "client_id": reg["client_id"],
                    "redirect_uri": callback.url,
                    "code_verifier": verifier,
                },
            )
            assert status == 200, tokens
            held = call(server, "GET", "/auth/keys", key=key)["keys"]
            connector = [g for g in held if g["kind"] == "oauth"]
            assert [(g["person"], g["folder"]) for g in connector] == [(ann["id"], "notes/kitchen")]
            assert unexpected(s.close()) == []
        finally:
            callback.close()
