"""People on one server, part 3: the change feed, history, trash, who made a change, chats,
captures, reminders, daily notes and the audit (src/notesvc/notes/trash.py, http/api.py,
providers/channels.py, providers/capture.py, providers/reminders.py, plugins.py, audit.py)."""

from __future__ import annotations

import json
import re
import threading
import time
import types
import urllib.parse

import pytest
import webtest

from conftest import (
    API,
    KEY,
    PNG,
    assert_error,
    att_url,
    audit,
    data,
    feed,
    note_url,
    notesvc,
    put_note,
    running,
    update,
    versions_of,
    wait_for,
    with_key,
)
from standins import MINIMAL_CONFIG, telegram_update
from test_people import device_of

FAMILY = "notes%2FFamily"


def share(client, folder: str, *members: tuple) -> dict:
    """Make `members` ((person, scope), ...) a folder's own members, as the owner."""
    body = {"members": [{"person": p["id"], "scope": s} for p, s in members]}
    quoted = urllib.parse.quote(folder, safe="")
    return data(client.put_json(f"{API}/folders/{quoted}/members", body))


def kinds(answer: dict) -> list:
    return [(c["kind"], c["path"]) for c in answer["changes"]]


@pytest.fixture
def house(client, anon):
    """The owner's private note, a Family folder shared with Ann (read) and Bob (write),
    and each person's home with a note: (owner, ann, as_ann, bob, as_bob)."""
    put_note(client, "notes/owner/diary.md", "the owner's diary")
    put_note(client, "notes/Family/list.md", "bread")
    ann, as_ann = device_of(client, anon, "Ann")
    bob, as_bob = device_of(client, anon, "Bob")
    share(client, "notes/Family", (ann, "read"), (bob, "write"))
    put_note(as_ann, "notes/Ann/todo.md", "ann's todo")
    put_note(as_bob, "notes/Bob/todo.md", "bob's todo")
    return client, ann, as_ann, bob, as_bob


class TestPeopleFeed:
    """The change feed as a person sees it (docs/api.md: History, trash and the change feed)."""

    def test_a_person_sees_their_reach_only_and_their_cursor_is_theirs(self, house):
        owner, _ann, as_ann, _bob, as_bob = house
        mine = feed(as_ann)
        assert kinds(mine) == [
            ("created", "notes/Family/list.md"),
            ("created", "notes/Ann/todo.md"),
        ]
        everything = feed(owner)
        assert len(everything["changes"]) == 4
        assert mine["last"] == everything["changes"][-1]["seq"] - 1  # Bob's came after: unseen
        # the owner and Bob write where Ann can't see: her cursor does not move
        last = mine["last"]
        put_note(owner, "notes/owner/more.md", "x")
        update(as_bob, "notes/Bob/todo.md", "bob's todo, changed")
        assert feed(as_ann, last) == {"changes": [], "last": last, "more": False}
        assert data(as_ann.get(f"{API}/changes?since=latest"))["last"] == last
        assert data(owner.get(f"{API}/changes?since=latest"))["last"] == last + 3
        # a change she sees comes with its own number: the gap tells her nothing more
        update(as_bob, "notes/Family/list.md", "bread, milk")
        seen = feed(as_ann, last)
        assert kinds(seen) == [("updated", "notes/Family/list.md")]
        assert seen["changes"][0]["seq"] == seen["last"] == last + 4

    def test_more_and_limit_count_what_the_person_sees(self, house):
        owner, _ann, as_ann, _bob, _ = house
        last = feed(as_ann)["last"]
        for i in range(5):
            put_note(owner, f"notes/owner/n{i}.md", "unseen")
            put_note(owner, f"notes/Family/n{i}.md", "seen")
        page = feed(as_ann, last, limit=2)
        assert kinds(page) == [("created", "notes/Family/n0.md"), ("created", "notes/Family/n1.md")]
        assert page["more"] is True
        page = feed(as_ann, page["last"], limit=3)
        assert [p for _, p in kinds(page)] == [f"notes/Family/n{i}.md" for i in (2, 3, 4)]
        assert page["more"] is False  # the owner's last notes came after: not Ann's to count
        assert page["last"] == data(as_ann.get(f"{API}/changes?since=latest"))["last"]

    def test_moves_across_the_reach_are_creations_and_deletions(self, house):
        owner, _ann, as_ann, _bob, _ = house
        last = feed(as_ann)["last"]
        move = f"{note_url('notes/owner/diary.md')}/move"
        owner.patch_json(move, {"path": "notes/Family/diary.md"})
        owner.patch_json(f"{note_url('notes/Family/list.md')}/move", {"path": "notes/owner/l.md"})
        owner.patch_json(f"{note_url('notes/Ann/todo.md')}/move", {"path": "notes/Ann/t.md"})
        seen = feed(as_ann, last)["changes"]
        assert [(c["kind"], c["path"], c.get("from")) for c in seen] == [
            ("created", "notes/Family/diary.md", None),
            ("deleted", "notes/Family/list.md", None),
            ("moved", "notes/Ann/t.md", "notes/Ann/todo.md"),
        ]
        assert "etag" in seen[0]
        assert "etag" not in seen[1]  # where it went, and what it holds, are not hers
        assert "notes/owner" not in json.dumps(seen)

    def test_the_cursor_reveals_nothing_of_what_the_person_does_not_see(self, house):
        owner, _ann, as_ann, _bob, _ = house
        last = feed(as_ann)["last"]

        def answers() -> list:
            out = [feed(as_ann, last), data(as_ann.get(f"{API}/changes?since=latest"))]
            for probe in (last + 1, last + 50, 10**6):  # beyond what she saw: 410 alike
                resp = as_ann.get(f"{API}/changes?since={probe}", status=410)
                out.append(assert_error(resp, 410, "GONE")["message"])
            return out

        before = answers()
        for i in range(30):
            put_note(owner, f"notes/owner/x{i}.md", "busy elsewhere")
        assert answers() == before
        assert str(last) in before[2]  # "follow from since=<her last>", no other number
        assert re.findall(r"\d+", before[2]) == [str(last)]

    def test_a_persons_changes_name_the_person_and_the_device(self, house):
        owner, ann, as_ann, bob, as_bob = house
        last = feed(owner)["last"]
        update(as_bob, "notes/Family/list.md", "bread, eggs")
        put_note(owner, "notes/Family/owner.md", "the owner's")
        changes = feed(owner, last)["changes"]
        assert changes[0]["person"] == {"id": bob["id"], "name": "Bob"}
        assert changes[0]["savedBy"] == "Bob · Bob's phone"
        assert "person" not in changes[1]  # the owner's (and other programs') name no one
        assert "savedBy" not in changes[1]
        assert feed(as_ann, last)["changes"][0]["person"]["name"] == "Bob"  # Ann sees it too
        # renamed later: the entry keeps the name it was made under (as history's savedBy)
        owner.patch_json(f"{API}/people/{bob['id']}", {"name": "Robert"})
        assert feed(owner, last)["changes"][0]["person"]["name"] == "Bob"
        assert ann["id"] != bob["id"]

    def test_the_person_survives_a_restart_of_the_journal(self, house, make_app, root):
        owner, _ann, _, bob, as_bob = house
        last = feed(owner)["last"]
        update(as_bob, "notes/Bob/todo.md", "changed")
        owner.app.service.close()
        again = with_key(make_app(root), owner.extra_environ["HTTP_X_SERVICE_KEY"])
        (entry,) = feed(again, last)["changes"]
        assert entry["person"] == {"id": bob["id"], "name": "Bob"}
        assert entry["savedBy"] == "Bob · Bob's phone"

    def test_a_waiting_feed_is_cut_when_the_share_ends(self, house):
        owner, _ann, as_ann, bob, as_bob = house
        journal = owner.app.service.journal
        last = feed(as_ann)["last"]
        answer: dict = {}

        def wait(since: int) -> None:
            path = f"{API}/changes?since={since}&wait=20"
            answer["resp"] = as_ann.get(path, status="*")

        reader = threading.Thread(target=wait, args=(last,))
        reader.start()
        wait_for(lambda: journal.waiting() == 1)
        update(as_bob, "notes/Bob/todo.md", "not hers")  # woken, nothing of hers: waits on
        wait_for(lambda: journal.waiting() == 1)
        assert reader.is_alive()
        share(owner, "notes/Family", (bob, "write"))  # Ann is no longer a member
        reader.join(15)
        assert not reader.is_alive()  # at once: her list holds notes the feed cannot name
        err = assert_error(answer["resp"], 410, "GONE")
        assert answer["resp"].json["error"]["resetRequired"] is True
        latest = data(as_ann.get(f"{API}/changes?since=latest"))["last"]
        assert err["message"].endswith(f"since={latest}")
        # from there on: her reach as it is now, the folder's changes no longer hers
        reader = threading.Thread(target=wait, args=(latest,))
        reader.start()
        wait_for(lambda: journal.waiting() == 1)
        update(as_bob, "notes/Family/list.md", "after she left")
        wait_for(lambda: journal.waiting() == 1)
        assert reader.is_alive()
        put_note(owner, "notes/Ann/from-owner.md", "for Ann")  # the owner writes in her home
        reader.join(15)
        assert kinds(answer["resp"].json["data"]) == [("created", "notes/Ann/from-owner.md")]

    def test_a_waiting_feed_ends_at_once_when_its_person_is_removed(self, house):
        owner, ann, as_ann, _bob, _ = house
        journal = owner.app.service.journal
        last = feed(as_ann)["last"]
        answer: dict = {}

        def wait():
            answer["resp"] = as_ann.get(f"{API}/changes?since={last}&wait=25", status="*")

        reader = threading.Thread(target=wait)
        reader.start()
        wait_for(lambda: journal.waiting() == 1)
        started = time.monotonic()
        owner.delete(f"{API}/people/{ann['id']}")
        reader.join(15)
        assert not reader.is_alive()
        assert time.monotonic() - started < 10  # at once, not when its 25 s ran out
        assert_error(answer["resp"], 401, "UNAUTHORIZED")

    def test_a_quiet_feed_looks_at_its_own_changes_only(self, house):
        owner, _ann, as_ann, _bob, _ = house
        last = feed(as_ann)["last"]
        for i in range(40):
            put_note(owner, f"notes/owner/y{i}.md", "not hers")
        journal, looked = owner.app.service.journal, []

        class Counting(list):  # the journal's entries, counting the ones looked at
            def __getitem__(self, i):
                looked.append(i)
                return super().__getitem__(i)

        journal._entries = Counting(journal._entries)
        assert feed(as_ann, last)["changes"] == []
        assert data(as_ann.get(f"{API}/changes?since=latest"))["last"] == last
        assert looked == []  # the owner's 40 changes: none looked at
        put_note(owner, "notes/Family/more.md", "one more")
        put_note(owner, "notes/owner/z.md", "not hers")
        assert kinds(feed(as_ann, last)) == [("created", "notes/Family/more.md")]
        assert len(looked) == 1  # hers, and nothing else

    def test_a_move_between_two_of_her_folders_is_one_change(self, house):
        owner, _ann, as_ann, _bob, _ = house
        last = feed(as_ann)["last"]
        owner.patch_json(f"{note_url('notes/Ann/todo.md')}/move", {"path": "notes/Family/t.md"})
        put_note(owner, "notes/Family/after.md", "x")
        first = feed(as_ann, last, limit=1)
        assert first["more"] is True
        changes = first["changes"]
        assert [(c["kind"], c["path"], c.get("from")) for c in changes] == [
            ("moved", "notes/Family/t.md", "notes/Ann/todo.md")
        ]
        second = feed(as_ann, changes[0]["seq"])
        assert kinds(second) == [("created", "notes/Family/after.md")]
        assert second["more"] is False


class TestPeopleHistory:
    """Versions, diffs, restores and the trash within a person's reach."""

    def test_a_version_saved_outside_the_reach_is_404(self, house):
        owner, _ann, as_ann, _bob, as_bob = house
        put_note(owner, "notes/owner/plan.md", "v1 private")
        update(owner, "notes/owner/plan.md", "v2 private")
        owner.patch_json(
            f"{note_url('notes/owner/plan.md')}/move", {"path": "notes/Family/plan.md"}
        )
        update(owner, "notes/Family/plan.md", "v3 shared")  # (v2 was kept by the move)
        update(as_bob, "notes/Family/plan.md", "v4 shared")
        update(as_bob, "notes/Family/plan.md", "v5 shared")
        everything = versions_of(owner, "notes/Family/plan.md")["versions"]
        theirs = versions_of(as_ann, "notes/Family/plan.md")["versions"]
        assert [v["reason"] for v in everything] == ["updated", "updated", "moved", "updated"]
        assert [v["reason"] for v in theirs] == ["updated", "updated"]  # saved in Family
        assert versions_of(as_ann, "notes/Family/plan.md")["created"] is None  # made elsewhere
        hidden = [v["id"] for v in everything if v["id"] not in {t["id"] for t in theirs}]
        url = f"{note_url('notes/Family/plan.md')}/versions"
        for vid in hidden:
            assert_error(as_ann.get(f"{url}/{vid}", status=404), 404, "NOT_FOUND")
            as_ann.get(f"{url}/{vid}/diff", status=404)
            as_ann.get(f"{url}/{theirs[0]['id']}/diff?against={vid}", status=404)
            as_bob.post(f"{url}/{vid}/restore", status=404)
            assert "private" in data(owner.get(f"{url}/{vid}"))["content"]
        shown = data(as_ann.get(f"{url}/{theirs[-1]['id']}"))
        assert shown["content"] == "v3 shared"
        diff = data(as_ann.get(f"{url}/{theirs[-1]['id']}/diff?against={theirs[0]['id']}"))
        assert "-v3 shared" in diff["diff"]
        assert "+v4 shared" in diff["diff"]
        assert "private" not in json.dumps(theirs)

    def test_where_it_was_saved_decides_not_when_the_person_joined(self, client, anon):
        """Members change over time; what a person sees of a folder's history follows where
        each version was saved, judged by the reach they have now (docs/api.md)."""
        put_note(client, "notes/Trips/rome.md", "day 1")
        update(client, "notes/Trips/rome.md", "day 1, day 2")
        ann, as_ann = device_of(client, anon, "Ann")
        as_ann.get(f"{note_url('notes/Trips/rome.md')}/versions", status=404)
        share(client, "notes/Trips", (ann, "read"))
        (version,) = versions_of(as_ann, "notes/Trips/rome.md")["versions"]
        url = f"{note_url('notes/Trips/rome.md')}/versions/{version['id']}"
        assert data(as_ann.get(url))["content"] == "day 1"  # saved before she joined: in Trips
        share(client, "notes/Trips")
        as_ann.get(url, status=404)  # left: none of it, at once
        as_ann.get(f"{note_url('notes/Trips/rome.md')}/versions", status=404)

    def test_restores_need_write_where_the_note_is(self, house):
        owner, _ann, as_ann, _bob, as_bob = house
        update(as_bob, "notes/Family/list.md", "bread, eggs")
        (old,) = versions_of(as_ann, "notes/Family/list.md")["versions"]
        url = f"{note_url('notes/Family/list.md')}/versions/{old['id']}/restore"
        resp = as_ann.post(url, status=403)  # a read share
        assert "read" in assert_error(resp, 403, "FORBIDDEN")["message"]
        restored = data(as_bob.post(url))
        assert data(owner.get(note_url(restored["path"])))["content"] == "bread"
        latest = versions_of(owner, "notes/Family/list.md")["versions"][0]
        assert latest["reason"] == "restored"
        assert latest["savedBy"] == "Bob · Bob's phone"

    def test_the_trash_holds_only_what_the_person_reaches(self, house):
        owner, _ann, as_ann, _bob, as_bob = house
        put_note(owner, "notes/Family/old.md", "old")
        for who, path in (
            (owner, "notes/owner/diary.md"),
            (as_bob, "notes/Bob/todo.md"),
            (as_ann, "notes/Ann/todo.md"),
            (as_bob, "notes/Family/old.md"),
        ):
            who.delete(note_url(path))
        listed = data(as_ann.get(f"{API}/trash"))
        assert sorted(i["path"] for i in listed["items"]) == [
            "notes/Ann/todo.md",
            "notes/Family/old.md",
        ]
        assert listed["total"] == 2
        every = {i["path"]: i["id"] for i in data(owner.get(f"{API}/trash"))["items"]}
        assert len(every) == 4
        for path in ("notes/owner/diary.md", "notes/Bob/todo.md"):
            item = every[path]
            assert_error(as_ann.get(f"{API}/trash/{item}", status=404), 404, "NOT_FOUND")
            as_ann.post(f"{API}/trash/{item}/restore", status=404)
        family = every["notes/Family/old.md"]
        assert data(as_ann.get(f"{API}/trash/{family}"))["content"] == "old"
        as_ann.post(f"{API}/trash/{family}/restore", status=403)  # read: no restore there
        for item in every.values():  # purging for good is the owner's alone, as for any key
            resp = as_ann.delete(f"{API}/trash/{item}", status=403)
            assert "owner" in assert_error(resp, 403, "FORBIDDEN")["message"]
        body = {"path": "notes/Ann/old.md"}  # ... but into her home, yes
        assert data(as_ann.post_json(f"{API}/trash/{family}/restore", body))["path"] == (
            "notes/Ann/old.md"
        )
        as_ann.post_json(
            f"{API}/trash/{every['notes/Ann/todo.md']}/restore",
            {"path": "notes/Bob/x.md"},
            status=404,
        )
        as_ann.post(f"{API}/trash/{every['notes/Ann/todo.md']}/restore")

    def test_a_conflict_copy_names_the_person_and_the_device(self, house, monkeypatch):
        owner, _ann, _as_ann, bob, as_bob = house
        base = data(as_bob.get(note_url("notes/Family/list.md")))["etag"]
        update(owner, "notes/Family/list.md", "rye bread")
        last = feed(owner)["last"]
        body = {"base": base, "content": "sourdough"}
        resp = as_bob.post_json(f"{note_url('notes/Family/list.md')}/merge", body, status=409)
        copy = assert_error(resp, 409, "CONFLICT")["conflictPath"]
        assert re.fullmatch(
            r"notes/Family/list \(conflict Bob · Bob's phone \d{4}-\d\d-\d\d \d\d-\d\d\)\.md", copy
        ), copy
        (created,) = feed(owner, last)["changes"]
        assert (created["kind"], created["path"], created["conflictOf"]) == (
            "created",
            copy,
            "notes/Family/list.md",
        )
        assert created["person"] == {"id": bob["id"], "name": "Bob"}
        # the client's own name for itself comes after the person's: never instead of it
        base = data(as_bob.get(note_url("notes/Family/list.md")))["etag"]
        update(owner, "notes/Family/list.md", "spelt bread")
        body = {"base": base, "content": "barley", "clientName": "Owner"}
        resp = as_bob.post_json(f"{note_url('notes/Family/list.md')}/merge", body, status=409)
        assert "(conflict Bob · Owner " in assert_error(resp, 409, "CONFLICT")["conflictPath"]
        # the owner's copies read as before
        base = data(owner.get(note_url("notes/Family/list.md")))["etag"]
        update(as_bob, "notes/Family/list.md", "oat bread")
        body = {"base": base, "content": "corn bread"}
        resp = owner.post_json(f"{note_url('notes/Family/list.md')}/merge", body, status=409)
        assert "(conflict owner " in assert_error(resp, 409, "CONFLICT")["conflictPath"]


def linking_code(as_person, channel_id: str, status: int = 201):
    resp = as_person.post(f"{API}/channels/{channel_id}/link", status=status)
    return data(resp) if status == 201 else resp


class TestPeopleChats:
    """A person's chat: linked by a code, their reach, their places, their reminders."""

    @pytest.fixture
    def home(self, make_app, anon, upstream):
        """A server whose owner has a Telegram channel (webhook mode, chat 42 allowed),
        Ann and Bob, a Family folder both write, and notes for /search to find."""
        app = make_app(SERVICE_TELEGRAM_API_BASE=upstream.url, SERVICE_TIMEZONE="Europe/Paris")
        owner = with_key(app)
        config = {**MINIMAL_CONFIG["telegram"], "allowedChatIds": [42], "mode": "webhook"}
        body = {"provider": "telegram", "name": "notes bot", "config": {**config, "notify": True}}
        channel = data(owner.post_json(f"{API}/channels", body, status=201))
        anon = webtest.TestApp(app.app)
        ann, as_ann = device_of(owner, anon, "Ann")
        bob, as_bob = device_of(owner, anon, "Bob")
        put_note(owner, "notes/owner/keys.md", "# Keys\n\nThe spare keys are under the flowerpot.")
        put_note(owner, "notes/Family/keys.md", "# Car\n\nThe car keys hang by the door.")
        share(owner, "notes/Family", (ann, "write"), (bob, "write"))
        return types.SimpleNamespace(
            owner=owner, channel=channel, ann=ann, as_ann=as_ann, bob=bob, as_bob=as_bob
        )

    @staticmethod
    def send(h, text, chat_id: int, **extra) -> dict:
        """Deliver one Telegram update from a chat through the channel's webhook."""
        anon = webtest.TestApp(h.owner.app)
        update = telegram_update(text, chat_id, **extra)
        headers = {"X-Service-Channel-Secret": h.channel["secret"]}
        return data(anon.post_json(f"{API}/channels/webhook/telegram", update, headers=headers))

    def link(self, h, as_person, chat_id: int) -> str:
        code = linking_code(as_person, h.channel["id"])["bindCode"]
        assert self.send(h, f"/start {code}", chat_id) == {"handled": True, "delivered": True}
        return code

    def test_a_code_links_the_chat_that_sends_it_to_the_person(self, home, upstream):
        h = home
        made = linking_code(h.as_ann, h.channel["id"])
        assert set(made) == {"bindCode", "expiresAt", "channel"}
        assert re.fullmatch(r"[a-z2-7]{12}", made["bindCode"])
        until = notesvc.epoch_of(made["expiresAt"])
        assert 590 < until - time.time() <= 600
        assert made["channel"]["chats"] == []
        assert self.send(h, f"/start {made['bindCode']}", 77)["handled"] is True
        assert "Ann's notes" in upstream.sent()[-1]
        assert "notes/Ann" in upstream.sent()[-1]
        seen = data(h.owner.get(f"{API}/channels/{h.channel['id']}"))
        assert seen["chats"] == [
            {"chat": "42", "person": None},
            {"chat": "77", "person": h.ann["id"], "name": "Ada"},
        ]
        assert seen["config"]["allowedChatIds"] == ["42", "77"]  # beside the owner's
        assert made["bindCode"] not in json.dumps(seen)
        listed = data(h.owner.get(f"{API}/channels"))["channels"][0]
        assert listed["chats"] == seen["chats"]
        # used up: another chat sending the same code is a refused sender
        assert self.send(h, f"/start {made['bindCode']}", 88) == {
            "handled": False,
            "reason": "sender not allowed",
        }
        assert [
            r["sender"]
            for r in data(h.owner.get(f"{API}/channels/{h.channel['id']}"))["refusedSenders"]
        ] == ["88"]

    def test_a_persons_chat_saves_searches_and_answers_within_their_reach(self, home, upstream):
        h = home
        self.link(h, h.as_ann, 77)
        svc = h.owner.app.service
        day = notesvc.local_now(svc).date()
        self.send(h, "/save buy oat milk", 77)
        daily = f"notes/Ann/daily/{day:%Y-%m-%d}.md"
        assert upstream.sent()[-1] == f"Saved to {daily}."
        assert "buy oat milk" in data(h.as_ann.get(note_url(daily)))["content"]
        assert not (svc.config.root / "notes" / "daily").exists()
        (version,) = [c for c in feed(h.owner)["changes"] if c["path"] == daily]
        assert version["person"] == {"id": h.ann["id"], "name": "Ann"}
        assert version["savedBy"] == "Ann · notes bot"
        self.send(h, "/search keys", 77)
        said = upstream.sent()[-1]
        assert "notes/Family/keys.md" in said
        assert "notes/owner" not in said
        assert said.startswith("1 note match;")
        self.send(h, "/search keys", 42)  # the owner's chat: every note
        assert upstream.sent()[-1].startswith("2 notes match")
        self.send(h, "/today", 77)
        assert upstream.sent()[-1].startswith(daily)
        self.send(h, "where are the spare keys?", 77)  # the agent's sources: her reach
        assert "flowerpot" not in upstream.sent()[-1]
        self.send(h, "where are the spare keys?", 42)
        assert "flowerpot" in upstream.sent()[-1]

    @pytest.mark.slow
    def test_a_photo_from_a_persons_chat_lands_in_their_home(self, home, upstream):
        h = home
        self.link(h, h.as_ann, 77)
        upstream.add_file("ph", "photos/file_1.jpg", PNG)
        photo = [{"file_id": "ph", "file_unique_id": "u", "width": 8, "height": 8}]
        self.send(h, None, 77, photo=photo, caption="Whiteboard")
        day = notesvc.local_now(h.owner.app.service).date()
        text = data(h.as_ann.get(note_url(f"notes/Ann/daily/{day:%Y-%m-%d}.md")))["content"]
        m = re.search(
            r"!\[photo\]\(\.\./\.\./\.\./(attachments/Ann/inbox/\d{4}-\d\d-\d\d/\d{6}-photo\.jpg)\)"
            r" Whiteboard",
            text,
        )
        assert m, text
        assert h.as_ann.get(att_url(m.group(1))).body == PNG  # hers to see
        h.as_bob.get(att_url(m.group(1)), status=404)

    def test_a_person_sees_the_channels_and_their_own_chats_only(self, home):
        h = home
        self.link(h, h.as_ann, 77)
        self.link(h, h.as_bob, 78)
        (seen,) = data(h.as_ann.get(f"{API}/channels"))["channels"]
        assert seen["id"] == h.channel["id"]
        assert [c["chat"] for c in seen["chats"]] == ["77"]
        assert seen["linkUntil"] is None
        text = json.dumps(seen)
        for hidden in ('"78"', '"42"', "secret", "botToken", "webhookUrl", "allowedChatIds"):
            assert hidden not in text, hidden
        h.as_ann.get(f"{API}/channels/{h.channel['id']}", status=403)
        h.as_ann.patch_json(f"{API}/channels/{h.channel['id']}", {"name": "x"}, status=403)
        linking_code(h.as_ann, h.channel["id"])
        assert data(h.as_ann.get(f"{API}/channels"))["channels"][0]["linkUntil"]

    def test_bad_link_requests(self, home, make_app):
        h = home
        assert_error(linking_code(h.as_ann, "ch_nothinghere", 404), 404, "NOT_FOUND")
        reader = data(h.as_ann.post_json(f"{API}/auth/keys", {"name": "r", "scope": "read"}))
        as_reader = with_key(h.owner, reader["key"])
        assert_error(linking_code(as_reader, h.channel["id"], 403), 403, "FORBIDDEN")
        open_body = {"provider": "web", "config": {}}  # answers anyone: no person's chat joins
        web = data(h.owner.post_json(f"{API}/channels", open_body, status=201))
        assert_error(linking_code(h.as_ann, web["id"], 409), 409, "CONFLICT")
        h.owner.post(f"{API}/channels/{h.channel['id']}/toggle")
        assert_error(linking_code(h.as_ann, h.channel["id"], 409), 409, "CONFLICT")
        h.owner.post(f"{API}/channels/{h.channel['id']}/toggle")
        resp = h.as_ann.post_json(f"{API}/channels/{h.channel['id']}/link", {"x": 1}, status="*")
        assert resp.status_int in (201, 400)  # a body is not read
        h.as_ann.post(f"{API}/channels/{'x' * 5000}/link", status=404)

    def test_an_expired_or_replaced_code_links_nothing(self, home, root):
        h = home
        first = linking_code(h.as_ann, h.channel["id"])["bindCode"]
        second = linking_code(h.as_ann, h.channel["id"])["bindCode"]  # replaces hers
        assert self.send(h, first, 77)["handled"] is False
        state_file = root / ".notesvc" / "state.json"
        state = json.loads(state_file.read_text())
        state["channels"][0]["links"][0]["until"] = "2020-01-01T00:00:00.000Z"
        state_file.write_text(json.dumps(state))
        assert self.send(h, second, 77)["handled"] is False
        assert data(h.owner.get(f"{API}/channels/{h.channel['id']}"))["config"][
            "allowedChatIds"
        ] == ["42"]

    def test_removing_a_person_unbinds_their_chats_in_the_same_change(self, home, root):
        h = home
        self.link(h, h.as_ann, 77)
        linking_code(h.as_ann, h.channel["id"])  # a code that waits goes too
        h.owner.delete(f"{API}/people/{h.ann['id']}")
        stored = json.loads((root / ".notesvc" / "state.json").read_text())["channels"][0]
        assert stored["config"]["allowedChatIds"] == ["42"]
        assert "linkedChats" not in stored
        assert "links" not in stored
        assert self.send(h, "/save after", 77)["handled"] is False
        assert self.send(h, "/save still mine", 42)["handled"] is True

    def test_revoking_the_device_that_linked_a_chat_unbinds_it(self, home):
        h = home
        laptop = data(h.as_ann.post_json(f"{API}/auth/keys", {"name": "l", "scope": "write"}))
        as_laptop = with_key(h.owner, laptop["key"])
        self.link(h, as_laptop, 77)
        self.send(h, "/save from the chat", 77)
        h.as_ann.delete(f"{API}/auth/keys/{laptop['id']}")
        assert self.send(h, "/save after", 77)["handled"] is False
        chats = data(h.owner.get(f"{API}/channels/{h.channel['id']}"))["chats"]
        assert chats == [{"chat": "42", "person": None}]

    def test_a_person_unlinks_their_chat_and_the_owner_may_take_it_off(self, home):
        h = home
        self.link(h, h.as_ann, 77)
        self.link(h, h.as_bob, 78)
        gone = data(h.as_ann.delete(f"{API}/channels/{h.channel['id']}/link"))
        assert gone == {"id": h.channel["id"], "unlinked": ["77"]}
        assert self.send(h, "/save x", 77)["handled"] is False
        assert data(h.as_ann.delete(f"{API}/channels/{h.channel['id']}/link"))["unlinked"] == []
        assert data(h.owner.delete(f"{API}/channels/{h.channel['id']}/link"))["unlinked"] == []
        url = f"{API}/channels/{h.channel['id']}"
        h.owner.patch_json(url, {"config": {"allowedChatIds": [42]}})  # the owner's word
        assert data(h.owner.get(url))["chats"] == [{"chat": "42", "person": None}]
        h.owner.patch_json(url, {"config": {"allowedChatIds": [42, 78]}})  # back: the owner's
        assert data(h.owner.get(url))["chats"][1] == {"chat": "78", "person": None}

    def test_a_chat_acts_as_the_key_that_linked_it_the_owners_too(self, home, upstream):
        """The owner's own key adds a chat of the owner's beside the others (bind replaces
        them); a key narrowed to a folder links a chat that stays in that folder."""
        h = home
        self.link(h, h.owner, 43)
        assert upstream.sent()[-1].startswith("Connected:")
        chats = data(h.owner.get(f"{API}/channels/{h.channel['id']}"))["chats"]
        assert chats[1] == {"chat": "43", "person": None, "name": "Ada"}
        self.send(h, "/search keys", 43)
        assert upstream.sent()[-1].startswith("2 notes match")
        body = {"name": "family", "scope": "write", "folder": "notes/Family"}
        family = with_key(h.owner, data(h.owner.post_json(f"{API}/auth/keys", body))["key"])
        self.link(h, family, 44)
        self.send(h, "/search keys", 44)
        assert upstream.sent()[-1].startswith("1 note match;")
        self.send(h, "/save from the family chat", 44)
        day = notesvc.local_now(h.owner.app.service).date()
        assert upstream.sent()[-1] == f"Saved to notes/Family/daily/{day:%Y-%m-%d}.md."
        assert not (h.owner.app.service.config.root / "notes" / "daily").exists()
        assert data(h.owner.delete(f"{API}/channels/{h.channel['id']}/link"))["unlinked"] == [
            "43",
            "44",
        ]

    def test_the_owners_bind_code_keeps_the_peoples_chats(self, home):
        h = home
        self.link(h, h.as_ann, 77)
        code = data(h.owner.post(f"{API}/channels/{h.channel['id']}/bind"))["bindCode"]
        self.send(h, code, 99)
        chats = data(h.owner.get(f"{API}/channels/{h.channel['id']}"))["chats"]
        assert chats == [
            {"chat": "99", "person": None},
            {"chat": "77", "person": h.ann["id"], "name": "Ada"},
        ]

    def test_reminders_go_to_the_chat_of_the_home_that_holds_them(self, home, upstream):
        h = home
        self.link(h, h.as_ann, 77)
        self.link(h, h.as_bob, 78)
        svc = h.owner.app.service
        put_note(h.as_ann, "notes/Ann/dentist.md", "# Dentist\n\n- call ⏰ 2031-01-06 09:00\n")
        put_note(h.as_bob, "notes/Family/bins.md", "# Bins\n\n- out ⏰ 2031-01-06 09:00\n")
        put_note(h.owner, "notes/owner/tax.md", "# Tax\n\n- file ⏰ 2031-01-06 09:00\n")
        clock = types.SimpleNamespace(
            now=notesvc.timestamp_of(
                notesvc.dt.datetime(2031, 1, 6, 9, 0), notesvc.time_zone("Europe/Paris")
            )
            + 1
        )
        svc.reminders.close()
        svc.notes.after.remove(svc.reminders._note_changed)
        svc.reminders = notesvc.ReminderScheduler(svc, clock=lambda: clock.now)
        before = len(upstream.requests)
        svc.reminders.tick()
        sent = [
            (r["json"]["chat_id"], r["json"]["text"].split("\n")[-1])
            for r in upstream.requests[before:]
            if r["path"].endswith("/sendMessage")
        ]
        assert sorted(sent) == [
            ("42", "notes/Family/bins.md"),  # a shared folder's: the owner's
            ("42", "notes/owner/tax.md"),
            ("77", "notes/Ann/dentist.md"),
        ]
        listed = data(h.as_ann.get(f"{API}/reminders"))
        assert listed["total"] == 0  # sent already (and hers only: below)
        assert "notes/owner" not in json.dumps(listed)


class TestPeopleDaily:
    def test_todays_note_is_each_persons_own(self, house):
        owner, _ann, as_ann, _bob, as_bob = house
        made = data(as_ann.post(f"{API}/plugins/daily/today", status=201))
        assert re.fullmatch(r"notes/Ann/daily/\d{4}-\d\d-\d\d\.md", made["path"])
        again = as_ann.post(f"{API}/plugins/daily/today", status=200)
        assert data(again)["path"] == made["path"]
        assert data(as_bob.post(f"{API}/plugins/daily/today", status=201))["path"].startswith(
            "notes/Bob/daily/"
        )
        assert data(owner.post(f"{API}/plugins/daily/today", status=201))["path"].startswith(
            "notes/daily/"
        )
        as_ann.get(note_url(made["path"].replace("Ann", "Bob")), status=404)


class TestPeopleAudit:
    """The audit's two checks of a household (docs/design.md: the audit's table)."""

    @staticmethod
    def age_devices(root, *names: str) -> None:
        state_file = root / ".notesvc" / "state.json"
        state = json.loads(state_file.read_text())
        for g in state["grants"]:
            if g["name"] in names:
                g["createdAt"] = g["lastUsedAt"] = "2020-01-01T00:00:00.000Z"
        state_file.write_text(json.dumps(state))

    def test_a_persons_admin_device_unused_for_90_days_is_low(self, make_app, root):
        owner = with_key(make_app(SERVICE_DEVICE_IDLE_DAYS="0"))
        anon = webtest.TestApp(owner.app)
        device_of(owner, anon, "Ann")
        device_of(owner, anon, "Bob")
        got = data(owner.post_json(f"{API}/auth/devices/pairings", {"scope": "admin"}))
        claim = {"secret": got["secret"], "deviceName": "owner's old tablet"}
        anon.post_json(f"{API}/auth/devices/claim", claim, status=201)
        assert "people-admin-devices-unused" not in {f["id"] for f in audit(owner)["findings"]}
        self.age_devices(root, "Ann's phone", "owner's old tablet")
        (found,) = [f for f in audit(owner)["findings"] if f["id"] == "people-admin-devices-unused"]
        assert found["severity"] == "low"
        assert "Ann's Ann's phone" in found["detail"]  # hers; not the owner's, not Bob's in use
        assert "1 admin device" in found["detail"]
        assert "Bob" not in found["detail"]

    def test_an_expired_device_is_not_reported(self, make_app, root):
        owner = with_key(make_app())  # SERVICE_DEVICE_IDLE_DAYS=90: unused, it has expired
        device_of(owner, webtest.TestApp(owner.app), "Ann")
        self.age_devices(root, "Ann's phone")
        assert "people-admin-devices-unused" not in {f["id"] for f in audit(owner)["findings"]}

    def test_a_folder_every_person_writes_is_info_and_only_then(self, house):
        owner, ann, _, bob, as_bob = house  # Family: Ann reads, Bob writes
        before = audit(owner)
        assert "shared-write-everyone" not in {f["id"] for f in before["findings"]}
        put_note(as_bob, "notes/Bob/Garden/beds.md", "tomatoes")
        share(owner, "notes/Bob/Garden", (ann, "write"))  # Bob's home, Ann writes: everyone
        share(owner, "notes/Family", (ann, "write"), (bob, "write"))
        (found,) = [f for f in audit(owner)["findings"] if f["id"] == "shared-write-everyone"]
        assert found["severity"] == "info"
        assert "2 shared folder(s)" in found["detail"]
        assert "notes/Bob/Garden" in found["detail"]
        assert audit(owner)["score"] == before["score"]  # info costs nothing


class TestPeopleFeedBadInput:
    @pytest.mark.parametrize(
        "query",
        [
            "since=-1",
            "since=abc",
            "since=1e3",
            "since=99999999999",
            "limit=0",
            "wait=26",
            "limit=x",
        ],
    )
    @pytest.mark.slow
    def test_a_bad_cursor_is_400_for_a_person_too(self, house, query):
        _owner, _ann, as_ann, _bob, _ = house
        assert_error(as_ann.get(f"{API}/changes?{query}", status=400), 400, "VALIDATION_ERROR")

    def test_a_compacted_cursor_is_410_naming_only_their_last(self, house):
        owner, _ann, as_ann, _bob, _ = house
        journal = owner.app.service.journal
        journal.keep = 3
        for i in range(8):
            put_note(owner, f"notes/owner/c{i}.md", "x")
        put_note(owner, "notes/Ann/late.md", "hers")
        assert journal.floor > 0
        resp = as_ann.get(f"{API}/changes?since=0", status=410)
        last = data(as_ann.get(f"{API}/changes?since=latest"))["last"]
        assert re.findall(r"\d+", assert_error(resp, 410, "GONE")["message"]) == [str(last)]
        assert kinds(feed(as_ann, journal.floor)) == [("created", "notes/Ann/late.md")]


class TestPeopleOnARealServer:
    """The waiting feed and a person's chat on a real `python notesvc.py`."""

    @staticmethod
    def household(server) -> tuple:
        """(the owner's headers, Ann's id, Ann's device headers) on a fresh server."""
        key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]
        owner = {KEY: key}
        status, _, made = server.request("POST", f"{API}/people", {"name": "Ann"}, owner)
        assert status == 201
        claim = {"secret": made["data"]["pairing"]["secret"], "deviceName": "Ann's phone"}
        status, _, got = server.request("POST", f"{API}/auth/devices/claim", claim)
        assert status == 201
        return owner, made["data"]["person"]["id"], {KEY: got["data"]["key"]}

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_a_waiting_feed_is_cut_by_a_share_ending_and_ended_by_a_removal(self, tmp_path):
        with running(tmp_path / "root") as server:
            owner, ann, as_ann = self.household(server)
            body = {"path": "notes/Family/list.md", "content": "bread"}
            assert server.request("POST", f"{API}/notes", body, owner)[0] == 201
            members = {"members": [{"person": ann, "scope": "read"}]}
            url = f"{API}/folders/{FAMILY}/members"
            assert server.request("PUT", url, members, owner)[0] == 200
            last = server.request("GET", f"{API}/changes?since=latest", None, as_ann)[2]
            since = last["data"]["last"]
            answers: list = []

            def wait():
                path = f"{API}/changes?since={since}&wait=25"
                answers.append(server.request("GET", path, None, as_ann))

            def waiting() -> int:
                info = server.request("GET", f"{API}/system/info", None, owner)[2]["data"]
                return info["changes"]["waiting"]

            reader = threading.Thread(target=wait)
            reader.start()
            wait_for(lambda: waiting() == 1)
            assert server.request("PUT", url, {"members": []}, owner)[0] == 200
            reader.join(20)  # cut at once: 410, list again
            assert answers[0][0] == 410
            assert answers[0][2]["error"]["resetRequired"] is True
            since = server.request("GET", f"{API}/changes?since=latest", None, as_ann)[2]
            since = since["data"]["last"]
            reader = threading.Thread(target=wait)
            reader.start()
            wait_for(lambda: waiting() == 1)
            update = {"content": "bread, after she left"}
            path = note_url("notes/Family/list.md")
            assert server.request("PUT", path, update, owner)[0] == 200
            wait_for(lambda: waiting() == 1)  # looked again, nothing of hers: waits on
            started = time.monotonic()
            assert server.request("DELETE", f"{API}/people/{ann}", None, owner)[0] == 200
            reader.join(20)
            assert time.monotonic() - started < 10  # at once, not at the end of its 25 s
            (status, _, answer) = answers[1]
            assert status == 401
            assert answer["error"]["code"] == "UNAUTHORIZED"

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_a_persons_chat_on_a_polling_channel_links_saves_and_ends_with_them(
        self, tmp_path, upstream
    ):
        root = tmp_path / "root"
        env = {"SERVICE_TELEGRAM_API_BASE": upstream.url}
        with running(root, env=env) as server:
            owner, ann, as_ann = self.household(server)
            config = {**MINIMAL_CONFIG["telegram"], "allowedChatIds": [42]}  # polling
            body = {"provider": "telegram", "name": "notes bot", "config": config}
            status, _, made = server.request("POST", f"{API}/channels", body, owner)
            assert status == 201
            channel = made["data"]["id"]
            status, _, link = server.request("POST", f"{API}/channels/{channel}/link", None, as_ann)
            assert status == 201
            upstream.push(telegram_update(f"/start {link['data']['bindCode']}", 77))
            wait_for(lambda: any("Ann's notes" in t for t in upstream.sent()))
            upstream.push(telegram_update("/save oat milk", 77))
            wait_for(
                lambda: any(t.startswith("Saved to notes/Ann/daily/") for t in upstream.sent())
            )
            (daily,) = (root / "notes" / "Ann" / "daily").glob("*.md")
            assert "oat milk" in daily.read_text()
            changes = server.request("GET", f"{API}/changes", None, owner)[2]["data"]["changes"]
            (saved,) = [c for c in changes if c["path"].startswith("notes/Ann/daily/")]
            assert saved["savedBy"] == "Ann · notes bot"
            upstream.push(telegram_update("/save for the owner", 42))
            wait_for(lambda: (root / "notes" / "daily").is_dir())
            assert server.request("DELETE", f"{API}/people/{ann}", None, owner)[0] == 200
            upstream.push(telegram_update("/save after she left", 77))

            def refused() -> list:
                got = server.request("GET", f"{API}/channels/{channel}", None, owner)[2]["data"]
                return [r["sender"] for r in got["refusedSenders"]]

            wait_for(lambda: "77" in refused())
            assert "after she left" not in daily.read_text()
            got = server.request("GET", f"{API}/channels/{channel}", None, owner)[2]["data"]
            assert got["chats"] == [{"chat": "42", "person": None}]
