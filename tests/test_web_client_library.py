"""The web client in Chromium: moves, keys, history, attachments, relays (web/)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
import wave

from browsers import (
    BROWSER_TESTS,
    SEED_NOTES,
    WebSession,
    WireMeter,
    expect,
    needs,
    unexpected,
)
from conftest import (
    A11Y_AUDIT,
    API,
    CALLBACK,
    KEY,
    PNG,
    EvilRelay,
    Server,
    notesvc,
    pkce_pair,
    relay_servers,
    running,
    wait_for,
)


class TestWebClient:
    pytestmark = BROWSER_TESTS

    def test_move_with_update_links_and_delete_to_the_trash(self, web):
        s = web("desktop")
        page = s.page
        s.tree_open("notes/kitchen/pancakes.md")
        page.click("#note-menu summary")
        page.click("#move")
        page.fill("#move-path", "recipes/pancakes")
        assert page.is_checked("#move-links")
        s.dialog_choose("move")
        expect(page.locator("#path")).to_contain_text("notes/recipes/pancakes.md")
        assert (web.root / "notes/recipes/pancakes.md").exists()
        assert "(../recipes/pancakes.md)" in (web.root / "notes/home/keys.md").read_text()
        expect(
            page.locator('#tree button.note[data-path="notes/recipes/pancakes.md"]')
        ).to_be_visible()
        page.click("#note-menu summary")
        page.click("#delete")
        s.dialog_choose("delete")
        expect(page.locator("#empty")).to_be_visible()
        assert not (web.root / "notes/recipes/pancakes.md").exists()
        assert list((web.root / ".notesvc" / "trash").rglob("pancakes.md"))
        expect(
            page.locator('#tree button.note[data-path="notes/recipes/pancakes.md"]')
        ).to_have_count(0)
        # The deleted note's folder goes with it (emptied): a refresh of the tree or the
        # open note racing the change feed may ask for one of them once, and hear 404.
        gone = [url for status, _, url in s.failed if status == 404]
        assert all("recipes" in urllib.parse.unquote(url) for url in gone), s.failed
        assert unexpected(s.close(), *(["404"] if gone else [])) == []

    def test_quick_capture_appends_to_todays_note(self, web):
        s = web("phone")
        page = s.page
        page.fill("#capture", "call the plumber about the tap")
        page.keyboard.press("Enter")
        expect(page.locator("#toast")).to_contain_text("Added to")
        page.fill("#capture", "buy washers")
        page.click("#capture-add")
        expect(page.locator("#capture")).to_have_value("")
        (daily,) = (web.root / "notes" / "daily").glob("*.md")
        lines = daily.read_text().splitlines()
        assert re.fullmatch(r"- \d\d:\d\d call the plumber about the tap", lines[-2])
        assert re.fullmatch(r"- \d\d:\d\d buy washers", lines[-1])
        expect(page.locator('#tree button.dir[data-path="notes/daily"]')).to_be_visible()
        assert unexpected(s.close()) == []

    def test_the_key_stays_in_the_session_unless_remembered(self, web):
        s = web("phone", login=False)
        page = s.page
        page.goto(web.setup["links"]["connect"]["hosted"])
        assert page.is_hidden("#remember-warn")
        page.check("#remember")
        expect(page.locator("#remember-warn")).to_be_visible()
        page.uncheck("#remember")
        page.fill("#key", "nsk_" + "x" * 43)
        page.click("#connect")
        expect(page.locator("#login-msg")).to_contain_text("not accepted")
        assert page.evaluate("sessionStorage.getItem('notesvc.key')") is None
        page.fill("#key", web.setup["apiKey"])
        page.click("#connect")
        page.wait_for_selector("#app", state="visible")
        stored = "k => [sessionStorage.getItem(k), localStorage.getItem(k)]"
        assert page.evaluate(stored, "notesvc.key") == [web.setup["apiKey"], None]
        # A new tab of the same browser (a new session) asks again.
        other = s.context.new_page()
        other.goto(web.server.url + "/")
        expect(other.locator("#login")).to_be_visible()
        other.close()
        # Remembered: in localStorage, and a new tab goes straight in.
        page.click("#menu summary")
        page.click("#logout")
        page.wait_for_selector("#login", state="visible")
        assert page.evaluate("Object.keys(localStorage).concat(Object.keys(sessionStorage))") == []
        page.fill("#key", web.setup["apiKey"])
        page.check("#remember")
        page.click("#connect")
        page.wait_for_selector("#app", state="visible")
        assert page.evaluate(stored, "notesvc.key")[1] == web.setup["apiKey"]
        other = s.context.new_page()
        other.goto(web.server.url + "/")
        other.wait_for_selector("#app", state="visible")
        assert unexpected(s.close(), 401) == []

    def test_a_rotated_key_returns_to_the_key_screen_and_a_lockout_shows_its_wait(self, web):
        s = web("phone")
        page = s.page
        status, _, body = web.server.request(
            "POST", f"{API}/auth/rotate", headers={"X-Service-Key": web.setup["apiKey"]}
        )
        assert status == 200
        # The next request with the old key, a click or the change feed's next poll
        # (whichever comes first), brings the key screen back.
        note = page.locator('#tree button.note[data-path="notes/todo.md"]')
        if not page.locator("#login").is_visible():
            with contextlib.suppress(Exception):  # the feed's poll may hide the tree meanwhile
                note.click(timeout=2000)
        expect(page.locator("#login")).to_be_visible()
        expect(page.locator("#login-msg")).to_contain_text("rotated")
        assert page.evaluate("sessionStorage.getItem('notesvc.key')") is None
        s.shot("key-rotated")
        # Wrong keys until this address is locked out: the wait is shown.
        for i in range(10):  # different ones: the old key the page retries counts once
            web.server.request("POST", f"{API}/auth/verify", headers={KEY: f"nsk_wrong{i}"})
        page.fill("#key", body["data"]["apiKey"])
        page.click("#connect")
        expect(page.locator("#login-msg")).to_have_text(re.compile(r"try again in \d+ s"))
        # 404: the link's relay code changed with the key (the page fell back to the server)
        assert unexpected(s.close(), 401, 404, 429) == []

    def test_dark_mode_and_accessibility_in_both_themes(self, web):
        for scheme in ("light", "dark"):
            for device in ("phone", "desktop"):
                s = web(device, login=False, color_scheme=scheme)
                page = s.page
                page.goto(web.setup["links"]["connect"]["hosted"])
                problems = page.evaluate(A11Y_AUDIT)
                page.fill("#key", web.setup["apiKey"])
                page.click("#connect")
                page.wait_for_selector("#tree button")
                problems += page.evaluate(A11Y_AUDIT)
                s.tree_open("notes/home/keys.md")
                problems += page.evaluate(A11Y_AUDIT)
                page.click("#edit")
                page.fill("#editor", page.input_value("#editor") + "\nmore")
                problems += page.evaluate(A11Y_AUDIT)
                page.keyboard.press("Control+s")
                page.fill("#search", "kumquat")
                page.keyboard.press("Enter")
                page.wait_for_selector("#results mark")
                problems += page.evaluate(A11Y_AUDIT)
                s.tap(".tabs button[data-pane=ask]" if device == "phone" else "#toggle-ask")
                page.fill("#chat-input", "spare keys?")
                page.click("#chat-send")
                page.wait_for_selector("#chat-log ul.sources")
                problems += page.evaluate(A11Y_AUDIT)
                page.click("#menu summary")
                page.click("#menu-new")
                expect(page.locator("#editor")).to_be_focused()
                problems += page.evaluate(A11Y_AUDIT)
                if device == "phone":
                    s.tap("#back")
                else:
                    page.click("#results-close")
                s.tree_open("notes/home/keys.md")
                page.click("#note-menu summary")
                page.click("#history")
                page.locator("#versions button", has_text="Changes").first.click()
                page.wait_for_selector("#version-detail p.words")
                problems += page.evaluate(A11Y_AUDIT)
                s.dialog_choose("cancel")
                # Focus is visible: Tab lands on a control that draws an outline.
                page.keyboard.press("Tab")
                style = page.evaluate(
                    "() => { const s = getComputedStyle(document.activeElement); "
                    "return [s.outlineStyle, parseFloat(s.outlineWidth)]; }"
                )
                assert style[0] != "none", (scheme, device)
                assert style[1] >= 2, (scheme, device)
                bg = page.evaluate("getComputedStyle(document.body).backgroundColor")
                assert (bg == "rgb(15, 20, 25)") == (scheme == "dark")
                s.shot(f"theme-{scheme}")
                assert problems == [], (scheme, device)
                assert unexpected(s.close()) == []

    def test_keyboard_alone_reaches_a_note_and_saves_it(self, web):
        s = web("desktop")
        page = s.page
        seen = []
        for _ in range(40):  # Tab through the page until the tree's note is reached
            page.keyboard.press("Tab")
            seen.append(
                page.evaluate("document.activeElement.dataset.path || document.activeElement.id")
            )
            if seen[-1] == "notes/todo.md":
                break
        assert seen[-1] == "notes/todo.md", seen
        page.keyboard.press("Enter")
        expect(page.locator("#path")).to_contain_text("notes/todo.md")
        page.focus("#edit")
        page.keyboard.press("Enter")
        expect(page.locator("#editor")).to_be_focused()
        page.keyboard.press("End")
        page.keyboard.type(" - and bread")
        page.keyboard.press("Control+s")
        expect(page.locator("#status")).to_have_text("Saved")
        assert "and bread" in (web.root / "notes/todo.md").read_text()
        assert unexpected(s.close()) == []

    def test_two_thousand_notes_load_lazily_and_fast(self, browser, tmp_path):
        root = tmp_path / "root"
        for f in range(20):
            folder = root / "notes" / f"project-{f:02d}"
            folder.mkdir(parents=True)
            for n in range(50):
                (folder / f"note-{n:03d}.md").write_text(f"# Note {f}-{n}\n\nbody {n}\n")
        for n in range(1000):
            (root / "notes" / f"inbox-{n:04d}.md").write_text(f"# Inbox {n}\n\nbody {n}\n")
        with running(root) as server:
            setup = server.request("GET", f"{API}/system/setup")[2]["data"]
            s = WebSession(browser, tmp_path, "desktop")
            s.login(setup["links"]["connect"]["hosted"], setup["apiKey"])
            page = s.page
            timings = []
            shown = "performance.getEntriesByName('notesvc:tree-shown').map(e => e.startTime)"
            for _ in range(3):
                page.reload()
                expect(page.locator("#tree button")).to_have_count(1020)
                (at,) = page.evaluate(shown)  # the page marks when the tree is on screen
                timings.append(at)
            # One request for the first level: the folders come with counts, not their notes.
            trees = [r.url for r in s.requests if "/folders/tree" in r.url]
            assert {urllib.parse.urlsplit(u).query for u in trees} == {"depth=1"}
            assert page.locator("#tree .count").first.inner_text() == "50"
            page.click('#tree button.dir[data-path="notes/project-07"]')
            expect(
                page.locator('#tree button.dir[data-path="notes/project-07"] + ul button')
            ).to_have_count(50)
            s.shot("tree-2000")
            s.close()
        best = min(timings)
        (tmp_path / "tree-2000-ms.txt").write_text(f"{best:.0f}\n")
        print(f"2,000-note tree shown {best:.0f} ms after navigation (best of 3: {timings})")
        assert best < 3000  # the goal is 1 s (bench/bench_web.py measures it); this is a guard

    # -- with the history, trash and change feed of docs/api.md: History (issue 13) ----------------

    def test_history_lists_diffs_and_restores_a_version(self, web):
        needs(web.server, "/notes/{path}/versions", "history (issue 13)")
        key = {"X-Service-Key": web.setup["apiKey"]}
        url = f"{API}/notes/notes%2Ftodo.md"
        for text in ("# Todo\n\n- buy oat milk\n- bread\n", "# Todo\n\n- bread only\n"):
            assert web.server.request("PUT", url, {"content": text}, key)[0] == 200
        s = web("phone")
        page = s.page
        s.tree_open("notes/todo.md")
        page.click("#note-menu summary")
        page.click("#history")
        expect(page.locator("#dlg-title")).to_have_text("History of Todo")
        rows = page.locator("#versions li")
        expect(rows).to_have_count(2)
        # A timeline a person reads: the day and time, why, how large.
        expect(rows.nth(0)).to_contain_text(re.compile(r"Today, \d{1,2}:\d{2}"))
        expect(rows.nth(0)).to_contain_text("edited")
        # What changed since, word by word, fitting the phone's width.
        rows.nth(0).locator("button", has_text="Changes").click()
        expect(page.locator("#version-detail p.words ins")).to_contain_text(["only"])
        expect(page.locator("#version-detail p.words del")).to_contain_text(["oat milk"])
        fits = "el => el.scrollWidth <= el.clientWidth"
        assert page.locator("#dlg").evaluate(fits)
        assert page.locator("#version-detail p.words").evaluate(fits)
        s.shot("history")
        rows.nth(1).locator("button", has_text="View").click()
        expect(page.locator("#version-detail pre")).to_have_text(SEED_NOTES["todo.md"])
        assert page.evaluate(A11Y_AUDIT) == []
        rows.nth(1).locator("button", has_text="Restore").click()
        expect(page.locator("#dlg")).to_be_hidden()
        expect(page.locator("#view")).to_contain_text("buy oat milk")
        assert (web.root / "notes/todo.md").read_text() == SEED_NOTES["todo.md"]
        (restore,) = [r for r in s.requests if r.url.endswith("/restore")]
        assert restore.headers["if-match"].startswith('"')
        assert unexpected(s.close()) == []

    def test_history_rows_say_who_and_what_changed_and_fold_alike_neighbours(self, web):
        """Issue 42: rows told apart by who saved, a few words and the size change; saves
        alike (same reason, size, summary and saver) within a minute fold into one row."""
        needs(web.server, "/notes/{path}/versions", "history (issue 13)")
        owner = {"X-Service-Key": web.setup["apiKey"]}
        body = {"name": "Anna's Pixel", "scope": "write"}
        made = web.server.request("POST", f"{API}/auth/keys", body, owner)[2]["data"]
        pixel = {"X-Service-Key": made["key"]}
        url = f"{API}/notes/notes%2Ftodo.md"
        seed = SEED_NOTES["todo.md"]
        steps = [(owner, seed + "- bread\n")]  # +8 B, by the API key: no name
        steps += [(pixel, seed + "- bread\n- " + w + "\n") for w in ("jam", "ham", "yam", "pam")]
        for who, text in steps:
            assert web.server.request("PUT", url, {"content": text}, who)[0] == 200
        s = web("phone")
        page = s.page
        s.tree_open("notes/todo.md")
        page.click("#note-menu summary")
        page.click("#history")
        rows = page.locator("#versions li")
        expect(rows).to_have_count(3)  # five versions: three alike, folded
        expect(rows.nth(0)).to_contain_text("3 saves · edited · Anna's Pixel · 1 line changed")
        expect(rows.nth(0)).to_contain_text("±0 B")
        assert rows.nth(0).get_attribute("data-count") == "3"
        expect(rows.nth(1)).to_contain_text("edited · Anna's Pixel · +1 line · +6 B")
        expect(rows.nth(2)).to_contain_text("edited · +1 line · +8 B")
        expect(rows.nth(2)).not_to_contain_text("Pixel")
        assert page.locator("#dlg").evaluate("el => el.scrollWidth <= el.clientWidth")
        s.shot("history-rows")
        # The folded row acts on its newest version: as it was before the last save.
        rows.nth(0).locator("button", has_text="View").click()
        expect(page.locator("#version-detail pre")).to_have_text(seed + "- bread\n- yam\n")
        assert unexpected(s.close()) == []

    def test_history_ends_with_the_notes_creation_when_and_by_which_device(self, web):
        """The new user's point 7a: a note's history shows its creation (no version: it
        replaced nothing), when and by which device, under the versions its edits kept."""
        owner = {"X-Service-Key": web.setup["apiKey"]}
        made = web.server.request(
            "POST", f"{API}/auth/devices/pairings", {"name": "phone", "scope": "write"}, owner
        )[2]
        claim = {"secret": made["data"]["secret"], "deviceName": "Anna's Pixel"}
        pixel = web.server.request("POST", f"{API}/auth/devices/claim", claim)[2]["data"]
        body = {"path": "notes/trip.md", "content": "# Trip\n\n- passport\n"}
        assert web.server.request("POST", f"{API}/notes", body, {KEY: pixel["key"]})[0] == 201
        s = web("phone")
        page = s.page
        s.tree_open("notes/trip.md")
        page.click("#edit")
        page.locator("#editor").press("Control+End")
        page.keyboard.type("- socks")
        page.keyboard.press("Control+s")
        expect(page.locator("#status")).to_have_text("Saved")
        page.click("#note-menu summary")
        page.click("#history")
        rows = page.locator("#versions li")
        expect(rows).to_have_count(2)
        expect(rows.nth(0)).to_contain_text("edited")
        created = page.locator("#version-created")
        expect(created).to_contain_text("created · Anna's Pixel")
        expect(created).to_contain_text("Today, ")
        expect(created.locator("button")).to_have_count(0)  # nothing to view or restore
        s.shot("history-created")
        assert unexpected(s.close()) == []

    def test_restore_with_a_stale_draft_restores_and_makes_no_copy(self, web):
        """Issue 42: a Restore on a phone holding a stale draft of the note wrote a conflict
        copy instead; now the draft is dropped (after asking) and the version restored."""
        needs(web.server, "/notes/{path}/versions", "history (issue 13)")
        key = {"X-Service-Key": web.setup["apiKey"]}
        url = f"{API}/notes/notes%2Ftodo.md"
        seed = SEED_NOTES["todo.md"]
        old = web.server.request("GET", url, headers=key)[2]["data"]["etag"]
        assert (
            web.server.request("PUT", url, {"content": "# Todo\n\n- bread only\n"}, key)[0] == 200
        )
        s = web("phone")
        page = s.page
        # Left by an earlier visit, from the older text: the same line, changed otherwise.
        stale = json.dumps({"content": "# Todo\n\n- buy soy milk\n", "etag": old, "at": 1})
        (tree, *_) = s.api_calls("/folders/tree")  # the page's API base (the relay's /r/…)
        base = urllib.parse.urlsplit(tree.url).path[: -len("/folders/tree")]
        draft = f"notesvc.draft:{base}|notes/todo.md"
        page.evaluate("([k, v]) => localStorage.setItem(k, v)", [draft, stale])
        s.tree_open("notes/todo.md")
        expect(page.locator("#draft")).to_be_visible()
        page.click("#note-menu summary")
        page.click("#history")
        rows = page.locator("#versions li")
        expect(rows).to_have_count(1)
        rows.nth(0).locator("button", has_text="Restore").click()
        expect(page.locator("#dlg-title")).to_have_text("Restore this version?")
        s.shot("restore-drop-draft")
        s.dialog_choose("restore")
        expect(page.locator("#toast")).to_contain_text("Restored the version of")
        expect(page.locator("#view")).to_contain_text("buy oat milk")
        assert (web.root / "notes/todo.md").read_text() == seed
        assert list((web.root / "notes").glob("todo (conflict*")) == []
        assert not s.api_calls("/merge")  # the draft was never sent
        drafts = page.evaluate(
            "() => Object.keys(localStorage).filter(k => k.startsWith('notesvc.draft:'))"
        )
        assert drafts == []
        expect(page.locator("#draft")).to_be_hidden()
        s.shot("restore-with-stale-draft")
        assert unexpected(s.close()) == []

    def test_trash_restores_and_a_delete_can_be_undone(self, web):
        needs(web.server, "/trash", "the trash (issue 13)")
        s = web("phone", color_scheme="dark")
        page = s.page
        s.tree_open("notes/todo.md")
        page.clock.install()
        page.click("#note-menu summary")
        page.click("#delete")
        s.dialog_choose("delete")
        expect(page.locator("#toast")).to_contain_text("to the trash")
        undo = page.locator("#toast button", has_text="Undo")
        assert undo.bounding_box()["height"] >= 44
        assert undo.bounding_box()["width"] >= 44
        page.clock.fast_forward(9000)  # still there 9 s later (it waits 15 s)
        expect(undo).to_be_visible()
        undo.click()
        expect(page.locator("#path")).to_contain_text("notes/todo.md")
        assert (web.root / "notes/todo.md").read_text() == SEED_NOTES["todo.md"]
        # Deleted elsewhere, restored from the Trash dialog.
        key = {"X-Service-Key": web.setup["apiKey"]}
        url = f"{API}/notes/notes%2Fkitchen%2Fpancakes.md"
        assert web.server.request("DELETE", url, headers=key)[0] == 200
        page.click("#menu summary")
        page.click("#menu-trash")
        item = page.locator("#trash-items li", has_text="notes/kitchen/pancakes.md")
        expect(item).to_have_count(1)
        item.locator("button", has_text="View").click()
        expect(page.locator("#trash-detail pre")).to_contain_text("Whisk")
        s.shot("trash")
        assert page.evaluate(A11Y_AUDIT) == []
        item.locator("button", has_text="Restore").click()
        expect(page.locator("#path")).to_contain_text("notes/kitchen/pancakes.md")
        assert (web.root / "notes/kitchen/pancakes.md").exists()
        # A note already at its path: it comes back under another name. (The page sees the
        # open note deleted first, so that its change feed never acts on it mid-restore.)
        assert web.server.request("DELETE", url, headers=key)[0] == 200
        expect(page.locator("#toast")).to_contain_text("deleted elsewhere")
        body = {"path": "notes/kitchen/pancakes.md", "content": "# New pancakes\n"}
        assert web.server.request("POST", f"{API}/notes", body, key)[0] == 201
        page.click("#menu summary")
        page.click("#menu-trash")
        page.locator("#trash-items li", has_text="pancakes.md").locator(
            "button", has_text="Restore"
        ).click()
        expect(page.locator("#dlg-title")).to_have_text("Restore under another name")
        page.fill("#restore-path", "notes/kitchen/old-pancakes.md")
        s.dialog_choose("restore")
        expect(page.locator("#path")).to_contain_text("notes/kitchen/old-pancakes.md")
        assert "Whisk" in (web.root / "notes/kitchen/old-pancakes.md").read_text()
        assert (web.root / "notes/kitchen/pancakes.md").read_text() == "# New pancakes\n"
        errors = s.close()
        # A 404 only for what was deleted elsewhere, asked for before the change feed told
        # the page: the note (a backlink or a check), or its folder, emptied by the delete,
        # when the tree reloads it. The page takes either in its stride.
        gone = [f for f in s.failed if f[0] == 404]
        assert all("pancakes" in url or "/tree/notes%2Fkitchen?" in url for *_, url in gone), gone
        assert unexpected(errors, 409, *(["404"] if gone else [])) == []

    def test_the_change_feed_keeps_the_tree_and_the_open_note_current(self, web):
        needs(web.server, "/changes", "the change feed (issue 13)")
        key = {"X-Service-Key": web.setup["apiKey"]}
        s = web("desktop")
        page = s.page
        s.tree_open("notes/todo.md")
        page.wait_for_timeout(300)  # the page has its cursor and waits for changes
        todo = f"{API}/notes/notes%2Ftodo.md"
        status, _, put = web.server.request(
            "PUT", todo, {"content": "# Todo\n\n- from the phone\n"}, key
        )
        assert status == 200
        expect(page.locator("#view")).to_contain_text("from the phone")  # no reload, no focus
        expect(page.locator("#toast")).to_contain_text("changed elsewhere")
        body = {"path": "notes/from-elsewhere.md", "content": "# Elsewhere\n"}
        assert web.server.request("POST", f"{API}/notes", body, key)[0] == 201
        expect(page.locator('#tree button[data-path="notes/from-elsewhere.md"]')).to_be_visible()
        # Typed here while another device saved the same note (both through merge, from
        # the version they started from): whichever lands first, both edits are kept.
        page.click("#edit")
        page.fill("#editor", "# Todo\n\n- from the phone\n- typed here\n")
        there = {"base": put["data"]["etag"], "content": "# Todo, shared\n\n- from the phone\n"}
        assert web.server.request("POST", todo + "/merge", there, key)[0] == 200
        both = "# Todo, shared\n\n- from the phone\n- typed here\n"
        expect(page.locator("#editor")).to_have_value(both)
        expect(page.locator("#status")).to_have_text("Saved")
        wait_for(lambda: (web.root / "notes/todo.md").read_text() == both)
        # Our own save comes back through the feed without a conflict.
        page.wait_for_timeout(500)
        assert page.is_hidden("#conflict")
        # Moved elsewhere: the page follows; deleted elsewhere: it closes.
        move = {"path": "notes/archive/todo.md"}
        assert web.server.request("PATCH", todo + "/move", move, key)[0] == 200
        expect(page.locator("#path")).to_contain_text("notes/archive/todo.md")
        expect(page.locator('#tree button[data-path="notes/archive/todo.md"]')).to_be_visible()
        page.fill("#editor", "# Todo\n\n- typed after the move\n")  # still editing
        page.keyboard.press("Control+s")  # saved where it is now
        expect(page.locator("#status")).to_have_text("Saved")
        archived = web.root / "notes/archive/todo.md"
        assert archived.read_text() == "# Todo\n\n- typed after the move\n"
        assert not (web.root / "notes/todo.md").exists()
        gone = f"{API}/notes/notes%2Farchive%2Ftodo.md"
        assert web.server.request("DELETE", gone, headers=key)[0] == 200
        expect(page.locator("#empty")).to_be_visible()
        expect(page.locator("#toast")).to_contain_text("deleted elsewhere")
        # 404: the page's own reads (backlinks, a look at the note) may meet the deletion
        assert unexpected(s.close(), 404) == []

    def test_a_note_made_here_shows_another_devices_edit_within_two_seconds(self, web):
        """The device that made a note keeps it open; another device edits it: the edit shows
        here as fast as on a note opened from the list (it once waited out 30 s)."""
        needs(web.server, "/changes", "the change feed (issue 13)")
        a = web("phone")
        path = a.write_new("Packing\n- passport")  # made here, open and in the editor
        b = web("desktop")
        b.tree_open(path)
        b.tap("#edit")
        edited = "Packing\n- passport\n- socks, from the laptop"
        b.page.fill("#editor", edited)
        sent = time.monotonic()
        b.page.keyboard.press("Control+s")
        expect(a.page.locator("#editor")).to_have_value(edited, timeout=5_000)
        took = time.monotonic() - sent
        print(f"the edit showed on the device that made the note {took:.2f} s after Save")
        assert took < 2.5
        expect(b.page.locator("#status")).to_have_text("Saved")
        # and the next edit too, after the page's own save
        a.page.bring_to_front()
        a.page.keyboard.press("Control+End")
        a.page.keyboard.type("\n- charger")
        expect(a.page.locator("#status")).to_have_text("Saved")
        again = {"content": edited + "\n- charger\n- book, from the laptop"}
        key = {"X-Service-Key": web.setup["apiKey"]}
        url = f"{API}/notes/{urllib.parse.quote(path, safe='')}"
        assert web.server.request("PUT", url, again, key)[0] == 200
        expect(a.page.locator("#editor")).to_have_value(again["content"], timeout=5_000)
        a.shot("made-here-edited-there")
        assert unexpected(a.close()) == []
        assert unexpected(b.close()) == []

    # -- with the attachments of docs/api.md: Attachments (issue 17) -------------------------------

    def test_a_vaults_images_beside_its_notes_show_in_the_note(self, web):
        # as Obsidian keeps them, put there over WebDAV: beside the note, linked two ways
        png = notesvc.web_icon_png(192)
        (web.root / "notes/home/photo.png").write_bytes(png)
        (web.root / "notes/home/vault.md").write_text(
            "# Vault\n\n![a photo](photo.png)\n\n![[photo.png]]\n"
        )
        s = web("phone")
        page = s.page
        s.tree_open("notes/home/vault.md")
        for img in (page.locator("#view img[alt='a photo']"), page.locator("#view img").nth(1)):
            expect(img).to_have_attribute("src", re.compile("^blob:"))
            expect(img).to_have_js_property("naturalWidth", 192)
        assert "not found" not in page.inner_text("#view")
        assert unexpected(s.close()) == []

    def test_images_show_and_files_photos_and_pastes_are_attached(self, web):
        needs(web.server, "/attachments", "attachments (issue 17)")
        png = notesvc.web_icon_png(192)
        key = {"X-Service-Key": web.setup["apiKey"], "Content-Type": "image/png"}
        req = urllib.request.Request(
            web.server.url + f"{API}/attachments/attachments%2Fhome%2Flogo.png",
            png,
            key,
            method="PUT",
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 201
        body = {
            "path": "notes/home/pic.md",
            "content": "# Pic\n\n![our logo](../../attachments/home/logo.png)\n",
        }
        web.server.request("POST", f"{API}/notes", body, {"X-Service-Key": web.setup["apiKey"]})
        s = web("phone")
        page = s.page
        s.tree_open("notes/home/pic.md")
        img = page.locator("#view img[alt='our logo']")
        expect(img).to_have_attribute("src", re.compile("^blob:"))
        expect(img).to_have_js_property("naturalWidth", 192)
        s.shot("image")
        # A photo (the camera's input), a picked file, a pasted image.
        page.set_input_files(
            "#attach-photo",
            files=[{"name": "IMG 1.PNG", "mimeType": "image/png", "buffer": png}],
        )
        expect(page.locator("#editor")).to_have_value(
            re.compile(r"!\[IMG 1\.PNG\]\(\.\./\.\./attachments/home/\d{8}-\d{6}-IMG-1\.png\)")
        )
        page.set_input_files(
            "#attach-file",
            files=[
                {"name": "notes.pdf", "mimeType": "application/pdf", "buffer": b"%PDF-1.4 test"}
            ],
        )
        expect(page.locator("#editor")).to_have_value(
            re.compile(r"\n\[notes\.pdf\]\(\.\./\.\./attachments/home/\d{8}-\d{6}-notes\.pdf\)")
        )
        page.evaluate(
            """(bytes) => {
              const dt = new DataTransfer();
              dt.items.add(new File([new Uint8Array(bytes)], "image.png", {type: "image/png"}));
              const ed = document.getElementById("editor");
              const init = {clipboardData: dt, bubbles: true, cancelable: true};
              ed.dispatchEvent(new ClipboardEvent("paste", init));
            }""",
            list(png),
        )
        expect(page.locator("#editor")).to_have_value(re.compile(r"-image\.png\)"))
        page.keyboard.press("Control+s")
        expect(page.locator("#status")).to_have_text("Saved")
        page.click("#edit")
        expect(page.locator("#view img")).to_have_count(3)
        uploaded = sorted(p.name for p in (web.root / "attachments" / "home").iterdir())
        assert len(uploaded) == 4
        assert any(n.endswith("-IMG-1.png") for n in uploaded)
        puts = [r for r in s.requests if r.method == "PUT" and "/attachments/" in r.url]
        assert {r.headers["if-none-match"] for r in puts} == {"*"}
        assert unexpected(s.close()) == []

    def test_a_photo_is_saved_with_no_typing_and_refused_offline_with_a_message(self, web):
        """Issue 42: inserting a photo is an edit like typing: on the server within the
        autosave time with nothing else done. Offline, nothing is inserted and it says so."""
        needs(web.server, "/attachments", "attachments (issue 17)")
        s = web("phone")
        page = s.page
        s.tree_open("notes/todo.md")
        page.set_input_files(
            "#attach-photo", files=[{"name": "shelf.png", "mimeType": "image/png", "buffer": PNG}]
        )
        expect(page.locator("#editor")).to_have_value(re.compile(r"!\[shelf\.png\]"))
        inserted = time.monotonic()
        key = {"X-Service-Key": web.setup["apiKey"]}
        url = f"{API}/notes/notes%2Ftodo.md"
        content = lambda: web.server.request("GET", url, headers=key)[2]["data"]["content"]  # noqa: E731
        wait_for(lambda: "![shelf.png](" in content(), timeout=4)
        print(f"on the server {time.monotonic() - inserted:.2f} s after the insert")
        (link,) = re.findall(r"!\[shelf\.png\]\(\.\./(attachments/[^)]+)\)", content())
        assert (web.root / link).read_bytes() == PNG
        expect(page.locator("#status")).to_have_text("Saved")
        assert "Save to keep" not in page.inner_text("#toast")
        s.shot("photo-saved")
        # Offline: the upload needs the server; nothing is inserted, and the page says so.
        before = page.input_value("#editor")
        s.context.set_offline(True)
        page.set_input_files(
            "#attach-photo", files=[{"name": "later.png", "mimeType": "image/png", "buffer": PNG}]
        )
        expect(page.locator("#toast")).to_contain_text("No connection: “later.png” was not added")
        assert page.input_value("#editor") == before
        s.shot("photo-offline")
        s.context.set_offline(False)
        assert "later.png" not in content()
        offline_noise = ("ERR_INTERNET_DISCONNECTED", "ERR_FAILED", "status of 0")
        assert [e for e in unexpected(s.close()) if not any(n in e for n in offline_noise)] == []

    def test_embeds_play_and_download_attachments_without_opening_them(self, web):
        needs(web.server, "/attachments", "attachments (issue 17)")
        sound = io.BytesIO()
        with wave.open(sound, "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(8000)
            w.writeframes(b"\0\0" * 800)
        files = {
            "attachments/inbox/2026-01-02/090000-photo.png": (
                notesvc.web_icon_png(192),
                "image/png",
            ),
            "attachments/inbox/2026-01-02/090100-voice.wav": (sound.getvalue(), "audio/wav"),
            "attachments/docs/manual.pdf": (b"%PDF-1.4 manual", "application/pdf"),
            "attachments/docs/page.html": (b"<script>window.pwned=1</script>", "text/html"),
        }
        for path, (data, ctype) in files.items():
            headers = {"X-Service-Key": web.setup["apiKey"], "Content-Type": ctype}
            url = web.server.url + f"{API}/attachments/" + urllib.parse.quote(path, safe="")
            with urllib.request.urlopen(
                urllib.request.Request(url, data, headers, method="PUT"), timeout=10
            ) as resp:
                assert resp.status == 201
        text = (
            "# Media\n\n![[090000-photo.png|the photo]] ![[missing.png]]\n\n"
            "[voice](../attachments/inbox/2026-01-02/090100-voice.wav) [[manual.pdf]] "
            "[[docs/page.html]]\n"
        )
        body = {"path": "notes/media.md", "content": text}
        web.server.request("POST", f"{API}/notes", body, {"X-Service-Key": web.setup["apiKey"]})
        s = web("desktop")
        page = s.page
        s.tree_open("notes/media.md")
        view = page.locator("#view")
        photo = view.locator("img[alt='the photo']")
        expect(photo).to_have_js_property("naturalWidth", 192)
        assert (
            photo.get_attribute("data-attachment")
            == "attachments/inbox/2026-01-02/090000-photo.png"
        )
        expect(view).to_contain_text("[image not found: missing.png]")
        view.locator("a.file", has_text="voice").click()
        expect(view.locator("audio")).to_have_attribute("src", re.compile("^blob:"))
        with page.expect_download() as download:
            view.locator("a.file", has_text="manual.pdf").click()
        assert download.value.suggested_filename == "manual.pdf"
        with page.expect_download() as download:  # HTML is a file to keep, never a page here
            view.locator("a.file", has_text="page.html").click()
        assert download.value.suggested_filename == "page.html"
        assert page.evaluate("window.pwned") is None
        assert len(s.context.pages) == 1
        s.shot("media")
        # (a missing embed is looked for beside the note too: that answer is a 404)
        assert unexpected(s.close(), 404) == []

    def test_a_tap_while_the_page_still_starts_is_not_undone_by_its_restore(self, web):
        # (CI once tapped New note while the page still read the server's features: the
        # start then restored the pane it remembered, the list, and the editor was gone)
        s = web("phone", login=False)
        page = s.page
        held = []
        page.route("**/system/features", lambda route: held.append(route))  # the features wait
        s.login(web.server.url + "/", web.setup["apiKey"])
        wait_for(lambda: held or page.wait_for_timeout(50))
        s.tap("#new")
        expect(page.locator("#editor")).to_be_focused()
        held[0].continue_()
        page.unroute("**/system/features")
        wait_for(lambda: page.evaluate("!document.getElementById('history').hidden"))
        assert page.get_attribute("#app", "data-pane") == "note"
        expect(page.locator("#editor")).to_be_focused()
        page.keyboard.insert_text("Quick one\n")
        page.keyboard.type("typed at once")
        page.keyboard.press("Control+s")
        expect(page.locator("#status")).to_have_text("Saved")
        assert (web.root / "notes/inbox/Quick one.md").read_text().endswith("typed at once")
        assert unexpected(s.close()) == []

    def test_reloading_the_list_on_a_phone_stays_on_the_list(self, web):
        s = web("phone")
        page = s.page
        s.tree_open("notes/todo.md")
        page.reload()  # on the note: it comes back
        expect(page.locator("#path")).to_contain_text("notes/todo.md")
        assert page.get_attribute("#app", "data-pane") == "note"
        s.tap("#back")
        wait_for(lambda: page.get_attribute("#app", "data-pane") == "notes")
        s.requests.clear()
        page.reload()  # on the list: the list, not the note last open
        page.wait_for_selector("#tree button", state="attached")
        # (the note would be read right after the tree: a bounded wait for that read)
        with contextlib.suppress(Exception):
            page.wait_for_request(lambda r: "/notes/notes%2Ftodo.md" in r.url, timeout=3_000)
        assert s.api_calls("/notes/notes%2Ftodo.md") == []
        assert page.get_attribute("#app", "data-pane") == "notes"
        expect(page.locator("#pane-notes")).to_be_visible()
        assert page.text_content("#path") == ""
        s.shot("reloaded-list")
        s.tree_open("notes/home/keys.md")  # and a tap opens a note as before
        expect(page.locator("#view")).to_contain_text("blue kumquat jar")
        assert unexpected(s.close()) == []

    def test_a_note_opened_before_the_features_are_read_shows_its_embeds(self, web):
        # (a CI-like run under load opened a note before the server's features were read:
        # its embedded photo was rendered as if the server had no attachments)
        needs(web.server, "/attachments", "attachments (issue 17)")
        path = "attachments/inbox/2026-01-02/090000-photo.png"
        headers = {"X-Service-Key": web.setup["apiKey"], "Content-Type": "image/png"}
        url = web.server.url + f"{API}/attachments/" + urllib.parse.quote(path, safe="")
        request = urllib.request.Request(url, notesvc.web_icon_png(192), headers, method="PUT")
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert resp.status == 201
        body = {"path": "notes/photo.md", "content": "# Photo\n\n![[090000-photo.png|it]]\n"}
        web.server.request("POST", f"{API}/notes", body, {"X-Service-Key": web.setup["apiKey"]})
        s = web("desktop", login=False)
        page = s.page
        held = []
        page.route("**/system/features", lambda route: held.append(route))  # the answer waits
        s.login(web.server.url + "/", web.setup["apiKey"])
        wait_for(lambda: held or page.wait_for_timeout(50))
        with page.expect_response(lambda r: r.url.endswith("photo.md")):  # it is not held
            page.click('#tree button.note[data-path="notes/photo.md"]')
        held[0].continue_()
        page.unroute("**/system/features")
        expect(page.locator("#path")).to_contain_text("notes/photo.md")
        expect(page.locator("#view img[alt='it']")).to_have_js_property("naturalWidth", 192)
        assert unexpected(s.close()) == []

    def test_a_cold_signed_in_load_moves_at_most_80_kb(self, browser, tmp_path):
        """CONTRACT (the phone issue): a fresh server with 50 notes in 5 folders, a phone
        signed in as an admin device (set up from the page itself: the browser keeps its
        device key), opened again with an empty cache: <= 80 KB received on the wire,
        openapi.json never fetched, the list and the tree fetched once each."""
        root = tmp_path / "srv"
        for f in range(5):
            for n in range(10):
                note = root / "notes" / f"folder {f}" / f"note {n}.md"
                note.parent.mkdir(parents=True, exist_ok=True)
                note.write_text(f"# Note {f}.{n}\n\nA line of text about {n} things in {f}.\n" * 3)
        server = Server(root)
        try:
            first = WebSession(browser, tmp_path, "phone")
            first.page.goto(server.url + "/")
            first.page.fill("#setup-name", "Ada's phone")
            first.page.click("#setup")
            first.dialog_choose("done")
            expect(first.page.locator("#app")).to_be_visible()
            assert first.page.evaluate("localStorage.getItem('notesvc.key')").startswith("nsd_")
            kept = first.context.storage_state()
            assert unexpected(first.close()) == []
            for origin in kept["origins"]:  # as on a device that never read the features
                origin["localStorage"] = [
                    i for i in origin["localStorage"] if i["name"] != "notesvc.features"
                ]
            s = WebSession(browser, tmp_path, "phone", storage_state=kept)
            wire = WireMeter(s.page)
            s.page.goto(server.url + "/")
            expect(s.page.locator("#recent .recent-note")).to_have_count(30)
            expect(s.page.locator("#tree button.dir")).to_have_count(5)
            grant = json.loads(s.page.evaluate("localStorage.getItem('notesvc.grant')"))
            assert (grant["kind"], grant["scope"]) == ("device", "admin")
            rows = wire.settled()
            print(f"\ncold signed-in load (Chromium's count, CDP):\n{wire.table(rows)}")
            s.shot("cold-load")
            asked = [urllib.parse.urlsplit(r["url"]).path for r in rows]
            assert f"{API}/openapi.json" not in asked
            assert asked.count(f"{API}/notes") == asked.count(f"{API}/folders/tree") == 1, asked
            (features,) = [r for r in rows if r["url"].endswith("/system/features")]
            assert features["status"] == 200
            assert sum(r["received"] for r in rows) <= 80_000, wire.table(rows)
            # opened again: the features kept with their ETag cost a 304, the list and the
            # tree are asked once again
            again = WireMeter(s.page)
            s.page.reload()
            expect(s.page.locator("#recent .recent-note")).to_have_count(30)
            rows = again.settled()
            (features,) = [r for r in rows if r["url"].endswith("/system/features")]
            assert features["status"] == 304
            asked = [urllib.parse.urlsplit(r["url"]).path for r in rows]
            assert asked.count(f"{API}/notes") == asked.count(f"{API}/folders/tree") == 1, asked
            assert f"{API}/openapi.json" not in asked
            assert unexpected(s.close()) == []
        finally:
            server.stop()

    def test_foreign_relay_url_never_gets_a_request(self, web):
        evil = EvilRelay()
        try:
            code = web.setup["pairing"]["relayCode"]
            s = web("phone", login=False)
            s.login(f"{web.server.url}/?relayCode={code}&relayUrl={evil.url}", web.setup["apiKey"])
            page = s.page
            assert s.write_new("Origin\n\nwritten here") == "notes/inbox/Origin.md"
            s.tap("#back")
            page.fill("#capture", "kept on this origin")
            page.keyboard.press("Enter")
            expect(page.locator("#toast")).to_contain_text("Added to")
            requested = [r.url for r in s.requests]
            assert unexpected(s.close()) == []
        finally:
            evil.close()
        assert (web.root / "notes/inbox/Origin.md").exists()
        assert evil.requests == []
        origins = {re.match(r"^[a-z]+://[^/]+", u).group(0) for u in requested if "://" in u}
        assert origins == {web.server.url}
        paths = [urllib.parse.urlsplit(u).path for u in requested]
        assert f"/relay/v1/pair/{code}" in paths
        assert f"/r/{web.setup['serverId']}{API}/auth/verify" in paths

    def test_page_on_the_server_stays_there_when_the_relay_is_elsewhere(self, browser, tmp_path):
        relay = Server(tmp_path / "relay", "relay")
        server = Server(tmp_path / "srv", env={"SERVICE_RELAY_URL": relay.url})
        try:
            wait_for(lambda: relay_servers(relay) == 1)
            setup = server.request("GET", f"{API}/system/setup")[2]["data"]
            assert setup["links"]["relayApiBase"].startswith(relay.url)
            s = WebSession(browser, tmp_path, "desktop")
            s.login(f"{server.url}/?relayCode={setup['pairing']['relayCode']}", setup["apiKey"])
            expect(s.page.locator("#tree")).to_contain_text("No notes yet")
            requested = [r.url for r in s.requests]
            assert unexpected(s.close()) == []
        finally:
            server.stop()
            relay.stop()
        assert {u.startswith(server.url + "/") for u in requested} == {True}
        assert f"{server.url}/r/{setup['serverId']}{API}/folders/tree?depth=1" in requested

    def test_phone_away_from_home_uses_the_relay_copy(self, browser, tmp_path):
        """The connect link opens the relay's own page, which talks to /r/<id> on its origin."""
        relay = Server(tmp_path / "relay", "relay")
        server = Server(tmp_path / "srv", env={"SERVICE_RELAY_URL": relay.url})
        try:
            wait_for(lambda: relay_servers(relay) == 1)
            setup = server.request("GET", f"{API}/system/setup")[2]["data"]
            link = setup["links"]["connect"]["hosted"]
            assert link.startswith(relay.url + "/?relayCode=")
            s = WebSession(browser, tmp_path, "phone")
            page = s.page
            s.login(link, setup["apiKey"])
            # The manifest and icons come from the relay too.
            manifest = page.evaluate("fetch('manifest.webmanifest').then(r => r.ok && r.json())")
            assert manifest["name"] == "notesvc"
            for icon in manifest["icons"]:
                assert page.evaluate("(u) => fetch(u).then(r => r.status)", icon["src"]) == 200
            path = s.write_new("# Keys\n\nThe spare kumquat key is under the mat.")
            assert path == "notes/inbox/Keys.md"
            page.fill("#search", "kumquat")
            page.press("#search", "Enter")
            page.wait_for_selector("#results mark")
            assert "notes/inbox/Keys.md" in page.inner_text("#results")
            s.shot("relay-phone")
            requested = [r.url for r in s.requests]
            assert unexpected(s.close()) == []
        finally:
            server.stop()
            relay.stop()
        on_disk = tmp_path / "srv/notes/inbox/Keys.md"
        assert "kumquat" in on_disk.read_text()
        assert {u.startswith(relay.url + "/") for u in requested} == {True}
        assert f"{relay.url}/r/{setup['serverId']}{API}/folders/tree?depth=1" in requested

    def test_a_relays_shared_origin_keeps_no_key_for_any_page(self, browser, tmp_path):
        """On a relay without a domain every server's pages share the relay's origin: the
        web client keeps nothing there, so no other server's page can find a key."""
        relay = Server(tmp_path / "relay", "relay")
        mine = Server(tmp_path / "mine", env={"SERVICE_RELAY_URL": relay.url})
        other = Server(tmp_path / "other", env={"SERVICE_RELAY_URL": relay.url})
        try:
            wait_for(lambda: relay_servers(relay) == 2)
            setup = mine.request("GET", f"{API}/system/setup")[2]["data"]
            sids = {
                "mine": setup["serverId"],
                "other": other.request("GET", f"{API}/system/setup")[2]["data"]["serverId"],
            }

            def consent_url(sid: str) -> str:
                reg = relay.request(
                    "POST", f"/r/{sid}/oauth/register", {"redirect_uris": [CALLBACK]}
                )[2]
                _, challenge = pkce_pair()
                q = urllib.parse.urlencode(
                    {
                        "response_type": "code",
                        "client_id": reg["client_id"],
                        "redirect_uri": CALLBACK,
                        "code_challenge": challenge,
                        "code_challenge_method": "S256",
                        "resource": f"{relay.url}/r/{sid}{API}/mcp",
                    }
                )
                return f"{relay.url}/r/{sid}/oauth/authorize?{q}"

            s = WebSession(browser, tmp_path, "phone")
            page = s.page
            page.goto(setup["links"]["connect"]["hosted"])
            expect(page.locator("#shared-origin")).to_be_visible()  # says why, and the fix
            expect(page.locator("#remember")).to_be_hidden()
            page.fill("#key", setup["apiKey"])
            page.click("#connect")
            page.wait_for_selector("#app", state="visible")
            page.wait_for_selector("#tree button, #tree .empty")
            stored = "() => [localStorage.length, sessionStorage.length, document.cookie]"
            assert page.evaluate(stored) == [0, 0, ""]
            for sid in sids.values():
                page.goto(consent_url(sid))  # the same tab
                expect(page.locator("#ask")).to_be_visible()
                assert page.input_value("#key") == ""
            page.goto(setup["links"]["connect"]["hosted"])  # back: the key is asked again
            expect(page.locator("#login")).to_be_visible()
            assert page.evaluate(stored) == [0, 0, ""]
            s.close()
        finally:
            other.stop()
            mine.stop()
            relay.stop()
