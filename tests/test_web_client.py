"""The web client in Chromium: writing, search, tasks (web/)."""

from __future__ import annotations

import json
import os
import re
import time

import pytest

from browsers import (
    BROWSER_TESTS,
    SEED_NOTES,
    expect,
    needs,
    unexpected,
    web_server,
)
from conftest import (
    API,
    wait_for,
)
from standins import MEANING_NOTES, embed_env


class TestWebClient:
    pytestmark = BROWSER_TESTS

    @pytest.mark.parametrize("device", ["phone", "desktop"])
    def test_connect_open_formatted_edit_and_save(self, web, device):
        s = web(device)
        page = s.page
        assert "relayCode=" in web.setup["links"]["connect"]["hosted"]
        expect(page.locator("#tree")).to_contain_text("home")
        s.shot("tree")
        s.tree_open("notes/home/keys.md")
        # Formatted: a heading, a task list, links; the editor is not shown.
        expect(page.locator("#view h1")).to_have_text("Spare keys")
        assert page.is_hidden("#editor")
        assert page.locator("#view input[type=checkbox]").count() == 2
        assert page.locator("#view a[data-note='notes/kitchen/pancakes.md']").count() == 1
        s.shot("note")
        page.click("#edit")
        expect(page.locator("#editor")).to_be_visible()
        page.fill("#editor", "# Spare keys\n\nThe spare keys moved to the *red* box.\n")
        expect(page.locator("#status")).to_have_text(re.compile("Unsaved"))
        s.shot("editing")
        page.keyboard.press("Control+s")  # (no button: autosave, or the shortcut)
        expect(page.locator("#status")).to_have_text("Saved")
        on_disk = web.root / "notes/home/keys.md"
        assert on_disk.read_text() == "# Spare keys\n\nThe spare keys moved to the *red* box.\n"
        # A save goes through merge, from the version the edit started from.
        (save,) = s.api_calls("/notes/notes%2Fhome%2Fkeys.md/merge")
        assert json.loads(save.post_data)["base"].startswith('"')
        page.click("#edit")  # back to the formatted view, with the saved text
        expect(page.locator("#view em")).to_have_text("red")
        # The page linked this browser: setup is complete now.
        assert web.server.request("GET", f"{API}/system/setup")[2]["data"]["setupComplete"]
        assert unexpected(s.close()) == []

    def test_on_a_desktop_the_empty_ask_pane_takes_no_room_until_used(self, web):
        s = web("desktop")  # 1280x800
        page = s.page
        s.tree_open("notes/kitchen/pancakes.md")

        def width(sel: str) -> float:
            return page.locator(sel).evaluate("e => e.getBoundingClientRect().width")

        assert page.is_hidden("#pane-ask")
        assert page.get_attribute("#toggle-ask", "aria-expanded") == "false"
        assert width("#pane-note") >= 1280 - 320 - 2  # all but the tree's column
        s.shot("ask-closed")
        page.click("#toggle-ask")  # Ask in the bar: the pane opens, ready to type
        expect(page.locator("#chat-input")).to_be_focused()
        assert 280 <= width("#pane-ask") <= 384
        page.fill("#chat-input", "where are the spare keys?")
        page.keyboard.press("Enter")
        expect(page.locator("#chat-log .msg:not(.me) ul.sources")).to_be_visible()
        s.shot("ask-open")
        page.reload()  # answers live in the page: it comes back empty, and closed
        page.wait_for_selector("#tree button")
        assert page.is_hidden("#pane-ask")
        assert unexpected(s.close()) == []

    def test_phone_shows_one_pane_at_a_time_and_keeps_the_tools_above_the_keyboard(self, web):
        s = web("phone")
        page = s.page
        panes = ["#pane-notes", "#pane-search", "#pane-note", "#pane-ask"]
        visible = lambda: [p for p in panes if page.is_visible(p)]  # noqa: E731
        assert visible() == ["#pane-notes"]
        assert page.evaluate("document.documentElement.scrollWidth") <= 390
        for pane in ("ask", "search", "note", "notes"):
            s.tap(f".tabs button[data-pane={pane}]")
            assert visible() == [f"#pane-{pane}"]
        # Touch targets: the bar, the tabs and the tree are at least 44 px high.
        for sel in (".tabs button", "#tree button", "#new", "#capture-add", ".bar summary"):
            for box in page.locator(sel).evaluate_all(
                "els => els.map(e => e.getBoundingClientRect().height)"
            ):
                assert box >= 44, sel
        s.tree_open("notes/todo.md")
        assert visible() == ["#pane-note"]
        page.click("#edit")
        page.focus("#editor")
        # The keyboard takes the lower half: the page fits what is left, Done and the
        # editor's toolbar stay in view.
        page.set_viewport_size({"width": 390, "height": 420})
        page.evaluate("window.dispatchEvent(new Event('resize'))")
        # the page lays itself out again on the resize: wait for that, not a fixed time
        expect(page.locator("#checklist")).to_be_in_viewport(ratio=1)
        for sel in ("#edit", "#checklist"):
            box = page.locator(sel).bounding_box()
            assert box["y"] >= 0, sel
            assert box["y"] + box["height"] <= 420, sel
        assert page.is_hidden(".tabs")  # the tabs step aside while typing
        editor = page.locator("#editor").bounding_box()
        assert editor["height"] > 200
        assert editor["y"] + editor["height"] <= 421
        page.set_viewport_size({"width": 390, "height": 844})
        # The back button returns to the notes; so does the browser's Back.
        page.click("#back")
        assert visible() == ["#pane-notes"]
        page.go_back()
        expect(page.locator("#pane-note")).to_be_visible()
        assert unexpected(s.close()) == []

    def test_no_note_open_offers_new_instead_of_an_editor(self, web):
        s = web("desktop")
        page = s.page
        assert page.is_hidden("#editor")
        assert page.is_hidden("#note-bar")
        expect(page.locator("#empty")).to_contain_text("No note is open")
        page.click("#empty-new")
        # Write first: no path is asked for; the first line is the title.
        expect(page.locator("#editor")).to_be_focused()
        page.keyboard.type("Garden\n\nTomatoes by the wall.")
        page.keyboard.press("Control+s")
        expect(page.locator("#status")).to_have_text("Saved")
        expect(page.locator("#path")).to_contain_text("notes/inbox/Garden.md")
        text = (web.root / "notes/inbox/Garden.md").read_text()
        assert text == "Garden\n\nTomatoes by the wall."
        expect(page.locator("#recent")).to_contain_text("Garden")
        assert unexpected(s.close()) == []

    def test_typing_is_saved_with_no_button_and_two_pages_keep_both_edits(self, web):
        one, two = web("phone"), web("phone")
        for s in (one, two):
            s.tree_open("notes/todo.md")
            s.page.click("#edit")
        on_disk = web.root / "notes/todo.md"
        # Page one types at the end and leaves it: on the server within 3 s, no button.
        one.page.focus("#editor")
        one.page.keyboard.press("Control+End")
        # (Enter twice: the list ends, with a blank line after it)
        one.page.keyboard.type("- from page one\n\n")
        typed = time.monotonic()
        wait_for(lambda: "from page one" in on_disk.read_text(), timeout=3)
        print(f"on the server {time.monotonic() - typed:.2f} s after the last keystroke")
        # Page two, still on the version it opened, changes the title meanwhile.
        two.page.focus("#editor")
        two.page.keyboard.press("Control+Home")
        two.page.keyboard.press("End")
        two.page.keyboard.type(" list")
        both = "# Todo list\n\n- buy oat milk\n- from page one\n\n"
        wait_for(lambda: on_disk.read_text() == both, timeout=5)
        expect(two.page.locator("#editor")).to_have_value(both)  # merged in as it saved
        expect(one.page.locator("#editor")).to_have_value(both)  # the change feed
        assert not list(on_disk.parent.glob("todo (conflict*"))
        for s in (one, two):
            assert [r for r in s.requests if r.method == "PUT"] == []  # all through merge
            assert unexpected(s.close()) == []

    def test_leaving_a_note_saves_it_and_a_draft_survives_a_failed_save(self, web):
        s = web("desktop")
        page = s.page
        s.tree_open("notes/todo.md")
        page.click("#edit")
        page.fill("#editor", "# Todo\n\n- buy oat milk\n- call the plumber\n")
        # Opening another note saves this one first: nothing is asked.
        s.tree_open("notes/kitchen/pancakes.md")
        expect(page.locator("#path")).to_contain_text("notes/kitchen/pancakes.md")
        assert "plumber" in (web.root / "notes/todo.md").read_text()
        # The server gone: the text is kept in this browser, and leaving asks.
        page.click("#edit")
        page.route("**/notes/**", lambda route: route.abort())
        page.fill("#editor", "# Pancakes\n\nscratch\n")
        page.wait_for_timeout(400)  # the draft is written 300 ms after the last keystroke
        page.click("#menu summary")
        page.click("#logout")
        expect(page.locator("#dlg-title")).to_have_text("Not saved")
        s.shot("not-saved-prompt")
        s.dialog_choose("cancel")
        page.unroute("**/notes/**")
        # Reloaded: what was typed goes out as the page hides.
        page.on("dialog", lambda d: d.accept())  # "leave the page?" while unsaved
        page.reload()
        page.wait_for_selector("#note-bar", state="visible")
        assert "scratch" in (web.root / "notes/kitchen/pancakes.md").read_text()
        assert page.is_hidden("#draft")
        # Too large to send as the page closes, and the server gone: the text waits in
        # this browser as a draft, offered on the next visit.
        page.route("**/merge", lambda route: route.abort())
        page.click("#edit")
        big = "# Pancakes\n\n" + "lots of batter " * 5000
        page.fill("#editor", big)
        page.wait_for_timeout(400)  # the draft is written 300 ms after the last keystroke
        page.reload()
        page.wait_for_selector("#note-bar", state="visible")
        expect(page.locator("#draft")).to_be_visible()
        expect(page.locator("#draft-text")).to_contain_text("unsaved draft")
        assert page.input_value("#editor") == big
        s.shot("draft-restored")
        page.unroute("**/merge")
        # Discarding the draft brings back the saved text.
        page.click("#draft-discard")
        expect(page.locator("#editor")).to_have_value(re.compile("scratch"))
        expect(page.locator("#draft")).to_be_hidden()
        assert "batter" not in (web.root / "notes/kitchen/pancakes.md").read_text()
        assert page.evaluate("Object.keys(localStorage).filter(k => k.includes('draft'))") == []
        failed = [e for e in unexpected(s.close()) if "ERR_FAILED" not in e]
        assert failed == []

    def test_a_new_note_typed_as_the_tab_closed_is_sent_at_the_next_open(self, web):
        """Issue 42: a new note typed just before the tab was closed (its create on its way,
        never answered) arrives at the next open at once, listed, and *New note* is blank."""
        s = web("phone")
        page = s.page
        held = []  # the create, caught on its way: the tab closes before it reaches the server
        page.route(
            "**/api/v1/notes",
            lambda route: (
                held.append(route) if route.request.method == "POST" else route.continue_()
            ),
        )
        s.tap("#new")
        page.keyboard.insert_text("Closed tab\n")
        page.keyboard.type("\nlast words before the tab went")
        for _ in range(200):  # autosave fired... (the page's events run while it waits)
            if held:
                break
            page.wait_for_timeout(50)
        assert held
        page.close()  # ...and the tab is closed as it goes
        # (the page may also send it as it hides, with keepalive, past the held route: then
        # it is there already, and the next open must not make it twice)
        inbox = web.root / "notes" / "inbox"
        again = s.context.new_page()  # opened again (a new tab: the key is asked again)
        again.on("pageerror", lambda e: s.errors.append(str(e)))
        again.on("console", lambda m: m.type == "error" and s.errors.append(m.text))
        s.page = again
        s.login(web.setup["links"]["connect"]["hosted"], web.setup["apiKey"])
        expect(again.locator("#recent")).to_contain_text("Closed tab", timeout=5_000)
        made = inbox / "Closed tab.md"
        assert made.read_text() == "Closed tab\n\nlast words before the tab went"
        s.shot("closed-tab-sent")
        drafts = again.evaluate(
            "() => Object.keys(localStorage).filter(k => k.startsWith('notesvc.draft:'))"
        )
        assert drafts == []
        s.tap("#new")  # blank, and nothing else is made
        expect(again.locator("#editor")).to_have_value("")
        again.wait_for_timeout(1500)
        assert [p.name for p in inbox.iterdir()] == ["Closed tab.md"]
        assert unexpected(s.close()) == []

    @pytest.mark.parametrize("device", ["phone", "desktop"])
    def test_search_is_seen_and_used_with_the_keyboard(self, web, device):
        s = web(device)
        page = s.page
        page.keyboard.press("/")
        expect(page.locator("#search")).to_be_focused()
        page.keyboard.type("kumquat")
        page.keyboard.press("Enter")
        expect(page.locator("#results mark").first).to_have_text(re.compile("kumquat", re.I))
        expect(page.locator("#results-info")).to_have_text(re.compile(r"^1 note · [\d.]+ ms$"))
        assert page.is_visible("#pane-search")
        assert page.is_hidden("#pane-notes")
        hit = page.locator("#results button").first
        assert "notes/home/keys.md" in hit.inner_text()
        assert "Spare keys" in hit.inner_text()
        s.shot("search")
        page.keyboard.press("ArrowDown")
        expect(hit).to_be_focused()
        page.keyboard.press("Enter")
        expect(page.locator("#path")).to_contain_text("notes/home/keys.md")
        expect(page.locator("#view h1")).to_have_text("Spare keys")
        # Esc returns to the tree.
        page.keyboard.press("/")  # focuses the search box with its text selected
        page.keyboard.type("pancake")
        page.keyboard.press("Enter")
        expect(page.locator("#results button")).to_have_count(2)
        page.keyboard.press("ArrowDown")
        page.keyboard.press("ArrowDown")
        expect(page.locator("#results button").nth(1)).to_be_focused()
        page.keyboard.press("ArrowUp")
        expect(page.locator("#results button").nth(0)).to_be_focused()
        page.keyboard.press("Escape")
        expect(page.locator("#pane-notes")).to_be_visible()
        assert page.is_hidden("#pane-search")
        assert page.input_value("#search") == ""
        assert unexpected(s.close()) == []

    @pytest.mark.parametrize("device", ["phone", "desktop"])
    def test_search_by_meaning_says_so_and_related_notes_open(
        self, browser, tmp_path, embed_endpoint, device
    ):
        notes = {**SEED_NOTES, **{p[len("notes/") :]: t for p, t in MEANING_NOTES.items()}}
        with web_server(browser, tmp_path, notes, embed_env(embed_endpoint)) as web:
            key = {"X-Service-Key": web.setup["apiKey"]}

            def status() -> dict:
                return web.server.request("GET", f"{API}/system/info", None, key)[2]["data"]

            wait_for(lambda: (lambda e: e["embedded"] == e["total"] > 0)(status()["embeddings"]))
            s = web(device)
            page = s.page
            page.fill("#search", "car repair")  # no note holds both words
            page.keyboard.press("Enter")
            expect(page.locator("#results button").first).to_be_visible()
            found = [b.get_attribute("data-path") for b in page.locator("#results button").all()]
            assert "notes/garage.md" in found[:2]
            expect(page.locator("#search-mode")).to_have_text("Searching by words and meaning")
            s.shot("meaning-search")
            page.click('#results button[data-path="notes/garage.md"]')
            expect(page.locator("#view h1")).to_have_text("Fixing the automobile")
            related = page.locator("#view aside.related")
            expect(related.locator("h2")).to_have_text("Related")
            near = related.locator('button[data-path="notes/work/car.md"]')
            expect(near).to_have_text("Company vehicle")
            assert related.locator("button").count() <= 5
            assert "notes/garage.md" not in related.inner_text()
            s.shot("related")
            near.click()  # opens that note, and its own Related list
            expect(page.locator("#view h1")).to_have_text("Company vehicle")
            expect(related.locator('button[data-path="notes/garage.md"]')).to_be_visible()
            assert related.locator('button[data-path="notes/work/car.md"]').count() == 0
            page.click("#edit")  # writing: the list is not in the way
            expect(related).to_be_hidden()
            page.click("#edit")
            expect(related).to_be_visible()  # and back with the text
            # A search about nothing in the notes says so, and a note near no other note
            # shows no Related list (the server answers none over the floor).
            page.fill("#search", "quantum physics lecture")
            page.keyboard.press("Enter")
            expect(page.locator("#results li.muted")).to_have_text(
                "Nothing found by words or by meaning."
            )
            expect(page.locator("#results-info")).to_have_text(re.compile(r"^0 notes · "))
            page.fill("#search", "puppy")
            page.keyboard.press("Enter")
            with page.expect_response(lambda r: "/related" in r.url) as asked:
                page.click('#results button[data-path="notes/pets.md"]')
            assert asked.value.json()["data"]["results"] == []
            expect(page.locator("#view h1")).to_have_text("Walking the puppy")
            expect(page.locator("#view aside.related")).to_have_count(0)
            # The model stops answering: the words still find, and the line says so.
            embed_endpoint.how = "500"
            page.fill("#search", "brake pads")
            page.keyboard.press("Enter")
            expect(page.locator("#search-mode")).to_have_text(
                "By words only: the model is not answering"
            )
            expect(page.locator("#results button").first).to_contain_text("Fixing the automobile")
            assert unexpected(s.close()) == []

    def test_with_embeddings_off_search_and_a_note_look_as_before(self, web):
        s = web("phone")
        page = s.page
        page.fill("#search", "kumquat")
        page.keyboard.press("Enter")
        expect(page.locator("#results button")).to_have_count(1)
        assert page.is_hidden("#search-mode")
        asked = []
        page.on("request", lambda r: asked.append(r.url))
        page.click("#results button")
        expect(page.locator("#view h1")).to_have_text("Spare keys")
        page.wait_for_timeout(200)  # (time for a request it must not make)
        assert page.locator("#view .related").count() == 0
        assert not [u for u in asked if "/related" in u]  # the features say: nothing to ask
        assert unexpected(s.close()) == []

    def test_chat_asks_all_notes_unless_about_this_note_is_on(self, web):
        s = web("desktop")
        page = s.page
        s.tree_open("notes/kitchen/pancakes.md")
        assert not page.is_checked("#about")
        assert page.is_hidden("#pane-ask")  # empty, it takes no room: Ask in the bar opens it
        page.click("#toggle-ask")
        expect(page.locator("#chat-input")).to_be_focused()
        page.fill("#chat-input", "where are the spare keys?")
        page.keyboard.press("Enter")
        answer = page.locator("#chat-log .msg:not(.me)").first
        expect(answer.locator("ul.sources button").first).to_be_visible()
        (first,) = s.api_calls("/agent/chat")
        assert first.post_data_json == {"message": "where are the spare keys?", "channel": "web"}
        assert "Spare keys" in answer.locator("ul.sources").inner_text()
        assert answer.locator(".md").count() == 1  # the answer is rendered Markdown
        page.check("#about")
        expect(page.locator("#about-label")).to_contain_text("Pancakes")
        page.fill("#chat-input", "how long do they rest?")
        page.click("#chat-send")
        expect(page.locator("#chat-log .msg:not(.me)")).to_have_count(2)
        expect(page.locator("#chat-log .msg:not(.me)").last).not_to_contain_text("Thinking")
        second = s.api_calls("/agent/chat")[1]
        assert second.post_data_json["notePath"] == "notes/kitchen/pancakes.md"
        s.shot("chat")
        # A source opens its note.
        answer.locator("ul.sources button", has_text="Spare keys").click()
        expect(page.locator("#path")).to_contain_text("notes/home/keys.md")
        assert unexpected(s.close()) == []

    def test_an_external_edit_is_merged_and_an_overlap_keeps_both_versions(self, web):
        s = web("phone")
        page = s.page
        on_disk = web.root / "notes/todo.md"
        key = {"X-Service-Key": web.setup["apiKey"]}
        start = {"content": "# Todo\n\n- buy oat milk\n\nand then\n\n- call the plumber\n"}
        assert web.server.request("PUT", f"{API}/notes/notes%2Ftodo.md", start, key)[0] == 200
        s.tree_open("notes/todo.md")
        page.click("#edit")
        # Edited in vim meanwhile, on other lines: both edits are kept, no question asked.
        on_disk.write_text("# Todo\n\n- buy oat milk\n\nand then\n\n- call the electrician\n")
        page.fill("#editor", "# Todo\n\n- buy rice milk\n\nand then\n\n- call the plumber\n")
        page.keyboard.press("Control+s")
        expect(page.locator("#status")).to_have_text("Saved")
        both = "# Todo\n\n- buy rice milk\n\nand then\n\n- call the electrician\n"
        assert on_disk.read_text() == both
        expect(page.locator("#editor")).to_have_value(both)  # what was merged in shows
        assert page.is_hidden("#conflict")
        # The same line changed on both sides: the note keeps theirs, mine is kept whole
        # beside it, and the page says where.
        on_disk.write_text(both.replace("rice", "soy"))
        page.fill("#editor", both.replace("rice", "oat"))
        page.keyboard.press("Control+s")
        expect(page.locator("#conflict")).to_be_visible()
        expect(page.locator("#conflict")).to_contain_text("yours is kept, whole, as")
        s.shot("conflict")
        assert on_disk.read_text() == both.replace("rice", "soy")
        assert page.input_value("#editor") == both.replace("rice", "soy")
        (copy,) = [p for p in on_disk.parent.glob("todo (conflict*).md")]
        assert copy.read_text() == both.replace("rice", "oat")
        page.click("#open-copy")
        expect(page.locator("#path")).to_contain_text(copy.name)
        assert "oat milk" in page.input_value("#editor")
        assert unexpected(s.close(), 409) == []

    def test_the_device_whose_edit_won_hears_of_the_conflict_copy(self, web):
        """Issue 42: the phone whose edit lost gets the banner; the one whose edit won gets a
        quiet notice from the change feed, with *Open the copy*."""
        needs(web.server, "/changes", "the change feed (issue 13)")
        a, b = web("phone"), web("phone")
        for s in (a, b):
            s.tree_open("notes/todo.md")
            s.page.click("#edit")
        b.page.fill("#editor", "# Todo\n\n- buy soy milk\n")  # typed, not sent yet
        a.page.bring_to_front()
        a.page.fill("#editor", "# Todo\n\n- buy rice milk\n")
        a.page.keyboard.press("Control+s")
        expect(a.page.locator("#status")).to_have_text("Saved")
        b.page.bring_to_front()
        b.page.keyboard.press("Control+s")
        # (or the feed's news of a's save merged it first: the same clash)
        expect(b.page.locator("#conflict")).to_be_visible()
        on_disk = web.root / "notes/todo.md"
        assert on_disk.read_text() == "# Todo\n\n- buy rice milk\n"
        (copy,) = on_disk.parent.glob("todo (conflict*).md")
        notice = a.page.locator("#toast")
        expect(notice).to_contain_text("A conflicting edit was kept as a copy")
        assert notice.get_attribute("role") == "status"  # quiet: not an alert
        a.page.bring_to_front()
        a.shot("conflict-winner-notice")
        b.shot("conflict-loser-banner")
        expect(b.page.locator("#toast")).not_to_contain_text("A conflicting edit")
        notice.locator("button", has_text="Open the copy").click()
        expect(a.page.locator("#path")).to_contain_text(copy.name)
        assert "soy milk" in a.page.input_value("#editor")
        assert unexpected(a.close()) == []
        assert unexpected(b.close(), 409) == []

    def test_coming_back_to_the_page_picks_up_changes_and_a_deletion(self, web):
        s = web("desktop")
        page = s.page
        on_disk = web.root / "notes/todo.md"
        s.tree_open("notes/todo.md")
        on_disk.write_text("# Todo\n\n- changed in vim\n")
        (web.root / "notes/new-from-vim.md").write_text("# New\n")
        page.evaluate("document.dispatchEvent(new Event('visibilitychange'))")
        expect(page.locator("#view")).to_contain_text("changed in vim")  # nothing unsaved here
        expect(page.locator("#toast")).to_contain_text("changed elsewhere")
        expect(page.locator('#tree button[data-path="notes/new-from-vim.md"]')).to_be_visible()
        # Deleted elsewhere while edited here: saving says so; "Keep mine" writes it again.
        page.click("#edit")
        page.fill("#editor", "# Todo\n\n- mine\n")
        on_disk.unlink()
        page.keyboard.press("Control+s")
        expect(page.locator("#conflict")).to_contain_text("deleted or moved elsewhere")
        page.click("#overwrite")
        expect(page.locator("#status")).to_have_text("Saved")
        assert on_disk.read_text() == "# Todo\n\n- mine\n"
        # Deleted again, and this time theirs wins: the note closes.
        on_disk.unlink()
        page.fill("#editor", "# Todo\n\n- mine again\n")
        page.keyboard.press("Control+s")
        page.click("#reload")
        expect(page.locator("#empty")).to_be_visible()
        assert not on_disk.exists()
        assert unexpected(s.close(), 404) == []

    def test_a_task_row_tapped_anywhere_is_ticked_and_saved_through_merge(self, web):
        s = web("phone")
        page = s.page
        s.tree_open("notes/home/keys.md")
        rows = page.locator("#view li.task")
        # A 44 px row with a 24 px box: the words tick it too.
        for box in rows.evaluate_all("els => els.map(e => e.getBoundingClientRect().height)"):
            assert box >= 44
        assert page.locator("#view li.task input").first.bounding_box()["width"] >= 24
        s.tap("#view li.task >> text=copy the garage key")
        expect(page.locator("#status")).to_have_text("Saved")
        path = web.root / "notes/home/keys.md"
        assert "- [x] copy the garage key" in path.read_text()
        (save,) = s.api_calls("/notes/notes%2Fhome%2Fkeys.md/merge")
        assert json.loads(save.post_data)["base"]
        # Changed elsewhere in between, on another line: the tick and the change both stay.
        # Written whole, as an editor saves: a page that reads the note during a truncating
        # write_text would show it empty, with no second task to tap.
        changed = path.with_name("keys.md.tmp")
        changed.write_text(path.read_text().replace("blue kumquat jar", "red tin"))
        os.replace(changed, path)
        page.locator("#view li.task input").nth(1).click()
        expect(page.locator("#view")).to_contain_text("red tin")
        # the view shows the change as it merges; the tick lands when the save does
        wait_for(lambda: "- [ ] give one to Anna" in path.read_text())
        text = path.read_text()
        assert "red tin" in text
        assert "- [x] copy the garage key" in text
        assert unexpected(s.close()) == []

    def test_enter_continues_a_checklist_and_ends_it_on_an_empty_item(self, web):
        s = web("phone")
        page = s.page
        s.tree_open("notes/todo.md")
        s.tap("#edit")
        page.focus("#editor")
        page.keyboard.press("Control+End")
        page.keyboard.type("- [ ] passport")
        page.keyboard.press("Enter")
        base = "# Todo\n\n- buy oat milk\n"
        expect(page.locator("#editor")).to_have_value(base + "- [ ] passport\n- [ ] ")
        s.shot("checklist-enter")
        page.keyboard.type("socks")
        page.keyboard.press("Enter")
        two = base + "- [ ] passport\n- [ ] socks\n"
        expect(page.locator("#editor")).to_have_value(two + "- [ ] ")
        # what Enter made is undone (and redone) like typing
        page.keyboard.press("Control+z")
        expect(page.locator("#editor")).to_have_value(two[:-1])
        page.keyboard.press("Control+y")
        expect(page.locator("#editor")).to_have_value(two + "- [ ] ")
        # on the empty item: the list ends, a blank line stays between it and what follows
        page.keyboard.press("Enter")
        expect(page.locator("#editor")).to_have_value(two + "\n")
        page.keyboard.type("Done.")
        want = two + "\nDone."
        expect(page.locator("#editor")).to_have_value(want)
        # a bullet and a number go on too, and autosave sends what Enter made
        page.keyboard.press("Enter")
        page.keyboard.type("1. one\ntwo\n\n* a\nb")  # (Enter twice: the numbers end)
        want += "\n1. one\n2. two\n\n* a\n* b"
        expect(page.locator("#editor")).to_have_value(want)
        wait_for(lambda: (web.root / "notes/todo.md").read_text() == want)
        # read: the words after the checklist are a paragraph of their own, and a tick greys
        # the task only
        s.tap("#edit")
        done = page.locator("#view > p", has_text="Done.")
        expect(done).to_be_visible()
        expect(page.locator("#view li.task", has_text="Done.")).to_have_count(0)
        before = done.evaluate("p => getComputedStyle(p).color")
        page.locator("#view li.task label", has_text="socks").click()
        wait_for(lambda: "- [x] socks" in (web.root / "notes/todo.md").read_text())
        ticked = page.locator("#view li.task label", has_text="socks")
        assert ticked.evaluate("l => getComputedStyle(l).color") != before  # greyed
        assert done.evaluate("p => getComputedStyle(p).color") == before
        s.shot("checklist-ended")
        assert unexpected(s.close()) == []

    def test_the_checklist_button_toggles_the_line_or_the_selected_lines(self, web):
        s = web("phone")
        page = s.page
        s.tree_open("notes/todo.md")
        expect(page.locator("#checklist")).to_be_hidden()  # reading: no toolbar
        s.tap("#edit")
        editor = page.locator("#editor")
        editor.evaluate("e => { e.focus(); e.setSelectionRange(12, 12); }")  # in "buy oat milk"
        # The keyboard takes the lower half: the toolbar stays over it.
        page.set_viewport_size({"width": 390, "height": 420})
        # (the visual viewport's resize event comes when the browser gets to it: wait for it)
        toolbar = page.locator("#checklist")
        box = wait_for(lambda: (b := toolbar.bounding_box()) and b["y"] + b["height"] <= 420 and b)
        assert box["y"] >= 0
        assert box["height"] >= 40
        s.shot("checklist-toolbar-keyboard")
        s.tap("#checklist")
        expect(editor).to_have_value("# Todo\n\n- [ ] buy oat milk\n")
        expect(editor).to_be_focused()  # the keyboard stays up
        assert editor.evaluate("e => [e.selectionStart, e.selectionEnd]") == [16, 16]
        page.keyboard.type("X")
        expect(editor).to_have_value("# Todo\n\n- [ ] buXy oat milk\n")
        s.tap("#checklist")  # a task loses its box
        expect(editor).to_have_value("# Todo\n\nbuXy oat milk\n")
        page.set_viewport_size({"width": 390, "height": 844})
        editor.fill("Trip\npassport\nsocks\n")
        editor.evaluate("e => { e.focus(); e.setSelectionRange(5, 19); }")  # the two lines
        s.tap("#checklist")
        expect(editor).to_have_value("Trip\n- [ ] passport\n- [ ] socks\n")
        s.shot("checklist-button")
        wait_for(lambda: (web.root / "notes/todo.md").read_text() == editor.input_value())
        assert unexpected(s.close()) == []

    def test_no_save_button_and_the_path_only_in_the_notes_menu(self, web):
        s = web("phone")
        page = s.page
        s.tree_open("notes/home/keys.md")
        save = page.get_by_role("button", name=re.compile(r"^\s*Save\s*$"))
        assert page.locator("#save").count() == 0
        expect(save).to_have_count(0)
        expect(page.locator("#path")).to_be_hidden()  # not under the title
        expect(page.locator(".note-title")).not_to_contain_text("notes/home/keys.md")
        s.shot("note-view")
        s.tap("#edit")
        expect(save).to_have_count(0)
        expect(page.locator("#edit")).to_have_text("Done")
        page.focus("#editor")
        page.keyboard.press("Control+End")
        page.keyboard.type("more")
        expect(page.locator("#status")).to_have_text("Saved")  # by itself
        s.shot("editing-saved")
        s.tap("#note-menu summary")
        expect(page.locator("#note-menu .path-item")).to_be_visible()
        expect(page.locator("#note-menu .path-item")).to_contain_text("Path")
        expect(page.locator("#path")).to_contain_text("notes/home/keys.md")
        s.shot("note-menu-path")
        assert unexpected(s.close()) == []

    def test_a_tap_on_the_text_edits_there_and_a_tap_on_a_box_ticks_it(self, web):
        text = (
            "# Trip\n\nFirst paragraph about the beach.\n\n"
            "Second paragraph: the **mountains** and\nthe lakes after.\n\n- [ ] passport\n"
        )
        key = {"X-Service-Key": web.setup["apiKey"]}
        web.server.request("POST", f"{API}/notes", {"path": "notes/trip.md", "content": text}, key)
        s = web("phone")
        page = s.page
        s.tree_open("notes/trip.md")
        # A tap on the box ticks it: saved, and the note stays as it is shown.
        page.locator("#view li.task input").tap()
        expect(page.locator("#status")).to_have_text("Saved")
        assert "- [x] passport" in (web.root / "notes/trip.md").read_text()
        assert page.is_hidden("#editor")
        expect(page.locator("#view")).to_be_visible()
        # A tap on the second paragraph's word "lakes": the editor, the caret at that word.
        spot = (
            page.locator("#view p")
            .nth(1)
            .evaluate(
                """p => {
              const t = [...p.childNodes].find(n => n.nodeType === 3 && n.data.includes("lakes"));
              const r = document.createRange();
              const i = t.data.indexOf("lakes") + 2;
              r.setStart(t, i); r.setEnd(t, i + 1);
              const b = r.getBoundingClientRect();
              return {x: b.left, y: b.top + b.height / 2};
            }"""
            )
        )
        page.touchscreen.tap(spot["x"], spot["y"])
        editor = page.locator("#editor")
        expect(editor).to_be_visible()
        expect(editor).to_be_focused()
        caret = editor.evaluate("e => e.selectionStart")
        lakes = text.index("lakes")
        assert lakes <= caret <= lakes + 5, (caret, lakes)
        s.shot("tap-to-edit")
        page.keyboard.type("big ")
        assert text.replace("- [ ]", "- [x]")[:lakes] in editor.input_value()
        assert unexpected(s.close()) == []

    def test_links_open_notes_and_html_in_a_note_stays_text(self, web):
        hostile = (
            "# <img src=x onerror=alert(1)>\n\n<script>window.pwned = 1</script>\n\n"
            "[click](javascript:window.pwned=2) [data](data:text/html,x) "
            "![pic](https://tracker.example/p.png) [ok](https://example.com/a_b)\n\n"
            "snake_case_name and *em* **strong** ~~gone~~ `<b>code</b>` [[Pancakes]] "
            "[up](../todo.md) [[nowhere here]]\n\n> quoted <iframe>\n\n"
            "```\n<script>x</script>\n```\n"
        )
        web.server.request(
            "POST",
            f"{API}/notes",
            {"path": "notes/web/hostile.md", "content": hostile},
            {"X-Service-Key": web.setup["apiKey"]},
        )
        s = web("desktop")
        page = s.page
        s.tree_open("notes/web/hostile.md")
        view = page.locator("#view")
        expect(view.locator("h1")).to_have_text("<img src=x onerror=alert(1)>")
        assert view.locator("img, script, iframe").count() == 0
        assert page.evaluate("window.pwned") is None
        hrefs = view.locator("a").evaluate_all("els => els.map(e => e.getAttribute('href'))")
        # An image from elsewhere is a link to follow, never loaded on its own.
        allowed = ("#", "https://example.com/a_b", "https://tracker.example/p.png")
        assert [h for h in hrefs if h not in allowed] == []
        assert "snake_case_name" in view.inner_text()
        assert view.locator("em").all_inner_texts() == ["em"]
        assert view.locator("strong").all_inner_texts() == ["strong"]
        assert view.locator("del").all_inner_texts() == ["gone"]
        assert view.locator("code").first.inner_text() == "<b>code</b>"
        assert view.locator("pre code").inner_text() == "<script>x</script>"
        assert view.locator("a[rel='noopener noreferrer']").count() == 2
        # A relative link and a [[wikilink]] open their notes.
        view.locator("a", has_text="up").click()
        expect(page.locator("#path")).to_contain_text("notes/todo.md")
        s.tree_open("notes/web/hostile.md")
        view.locator("a", has_text="Pancakes").click()
        expect(page.locator("#path")).to_contain_text("notes/kitchen/pancakes.md")
        expect(page.locator("#view table td.al-r").first).to_have_text("10")
        # A [[link]] to no note offers to create it.
        s.tree_open("notes/web/hostile.md")
        view.locator("a", has_text="nowhere here").click()
        expect(page.locator("#dlg-title")).to_contain_text("No note named")
        s.dialog_choose("cancel")
        assert unexpected(s.close(), 404) == []

    def test_markdown_renderer(self, web):
        s = web("desktop", login=False)
        page = s.page
        page.goto(web.server.url + "/")
        render = lambda md: page.evaluate("(t) => markdown.renderMarkdown(t, {}).innerHTML", md)  # noqa: E731
        assert render("# T\n\npara *a* _b_\nline two") == (
            "<h1>T</h1><p>para <em>a</em> <em>b</em><br>line two</p>"
        )
        assert render("- a\n  - b\n- c") == "<ul><li>a<ul><li>b</li></ul></li><li>c</li></ul>"
        assert render("3. x\n4. y") == '<ol start="3"><li>x</li><li>y</li></ol>'
        assert render("a | b\n--|:-:\n1 | 2") == (
            '<div class="table"><table><thead><tr><th>a</th><th class="al-c">b</th></tr></thead>'
            '<tbody><tr><td>1</td><td class="al-c">2</td></tr></tbody></table></div>'
        )
        assert render("---\ntags: [a]\n---\n# After") == (
            '<pre class="front">tags: [a]</pre><h1>After</h1>'
        )
        assert (
            render("> q\n> > deeper")
            == "<blockquote><p>q</p><blockquote><p>deeper</p></blockquote></blockquote>"
        )
        assert (
            render("***\n\n~~~py\nx = 1\n~~~")
            == '<hr><pre><code class="lang-py">x = 1</code></pre>'
        )
        assert render("a\\*b\\* ==hi==") == "<p>a*b* <mark>hi</mark></p>"
        assert render("<b>x</b> &amp;") == "<p>&lt;b&gt;x&lt;/b&gt; &amp;amp;</p>"
        # Pathological input renders in linear-ish time.
        took = page.evaluate(
            "() => { const t = performance.now(); "
            "markdown.renderMarkdown('*_'.repeat(4000) + '['.repeat(3000), {}); "
            "return performance.now() - t; }"
        )
        assert took < 2000
        assert unexpected(s.close()) == []
