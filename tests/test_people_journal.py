"""People on one server, part 3: the change feed, history, trash, who made a change, chats,
captures, reminders, daily notes and the audit (src/notesvc/notes/trash.py, http/api.py,
providers/channels.py, providers/capture.py, providers/reminders.py, plugins.py, audit.py)."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.parse

import pytest

from conftest import (
    API,
    assert_error,
    data,
    feed,
    note_url,
    put_note,
    update,
    versions_of,
    wait_for,
    with_key,
)
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
        again = with_key(make_app(root))
        (entry,) = feed(again, last)["changes"]
        assert entry["person"] == {"id": bob["id"], "name": "Bob"}
        assert entry["savedBy"] == "Bob · Bob's phone"

    def test_a_waiting_feed_is_cut_when_the_share_ends(self, house):
        owner, ann, as_ann, _bob, as_bob = house
        journal = owner.app.service.journal
        last = feed(as_ann)["last"]
        answer: dict = {}

        def wait():
            answer["seen"] = data(as_ann.get(f"{API}/changes?since={last}&wait=20"))

        reader = threading.Thread(target=wait)
        reader.start()
        wait_for(lambda: journal.waiting() == 1)
        share(owner, "notes/Family", (_bob, "write"))  # Ann is no longer a member ...
        update(as_bob, "notes/Family/list.md", "after she left")  # ... so not hers
        wait_for(lambda: journal.waiting() == 1)  # woken twice, still waiting
        assert reader.is_alive()
        put_note(owner, "notes/Ann/from-owner.md", "for Ann")  # the owner writes in her home
        reader.join(15)
        assert kinds(answer["seen"]) == [("created", "notes/Ann/from-owner.md")]
        assert ann["id"]

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

    def test_a_quiet_feed_reads_only_what_came_since_it_last_asked(self, house):
        owner, _ann, as_ann, _bob, _ = house
        last = feed(as_ann)["last"]
        for i in range(40):
            put_note(owner, f"notes/owner/y{i}.md", "not hers")
        journal, looked = owner.app.service.journal, []
        real = journal._newest_seen

        def counting(view, key):
            return real(lambda e: looked.append(e[0]) or view(e), key)

        journal._newest_seen = counting
        feed(as_ann, last)
        first = len(looked)
        assert first >= 40  # the owner's 40 notes, looked at once
        looked.clear()
        feed(as_ann, last)
        assert looked == []  # nothing new: nothing looked at again
        put_note(owner, "notes/owner/z.md", "one more")
        feed(as_ann, last)
        assert len(looked) == 1


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
