"""People over the protocols: WebDAV, CalDAV, feeds, share links, export and import, moves
and links (issue 52, part 2; src/notesvc/http/dav.py, caldav.py, feed.py, people.py)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import threading
import urllib.error
import urllib.parse
import urllib.request
import zipfile

import pytest
import webob

from conftest import (
    API,
    KEY,
    PNG,
    QUERY_TODOS,
    Dav,
    assert_error,
    basic,
    data,
    import_file,
    note_url,
    notesvc,
    put_note,
    running,
    upload,
    wait_for,
    with_key,
    zip_of,
)
from test_http_caldav import cal_items, list_ids, sync_body, vtodo
from test_http_dav import RCLONE, rclone, rclone_env
from test_people import add_person

# -- who is who -------------------------------------------------------------------------------


class Person:
    """A person of the household as the tests use them: their record, their device key, an
    API client and a WebDAV client with that key."""

    def __init__(self, client, anon, name: str, **body):
        made = add_person(client, name, **body)
        claim = {"secret": made["pairing"]["secret"], "deviceName": f"{name}'s laptop"}
        self.key = data(anon.post_json(f"{API}/auth/devices/claim", claim, status=201))["key"]
        self.person, self.id = made["person"], made["person"]["id"]
        self.home = self.person["home"]
        self.api = with_key(anon, self.key)
        self.dav = Dav(anon, self.key)


def share(client, folder: str, status: int = 200, **members: str):
    """PUT a folder's members ({person id: scope}) with `client` (the owner, or a person)."""
    body = {"members": [{"person": p, "scope": s} for p, s in members.items()]}
    url = f"{API}/folders/{urllib.parse.quote(folder, safe='')}/members"
    return client.put_json(url, body, status=status)


def hrefs(dav: Dav, path: str) -> list:
    """The paths (below /dav/) a Depth 1 PROPFIND of path lists, the folder itself first."""
    return [h[len("/dav/") :] for h in dav.hrefs(path)]


@pytest.fixture
def house(client, anon):
    """The owner's private folder, a family folder shared with Ann (read) and Bob (write),
    and a note in each home."""
    put_note(client, "notes/owner/diary.md", "# Diary\n\nthe owner's secret plans")
    put_note(client, "notes/Family/plan.md", "# Plan\n\nholiday in the hills")
    ann, bob = Person(client, anon, "Ann"), Person(client, anon, "Bob")
    put_note(ann.api, "notes/Ann/mine.md", "# Ann's\n\nher own words")
    put_note(bob.api, "notes/Bob/mine.md", "# Bob's\n\nhis own words")
    share(client, "notes/Family", **{ann.id: "read", bob.id: "write"})
    return ann, bob


# -- WebDAV as a person ------------------------------------------------------------------------


class TestPeopleWebDav:
    """A person's /dav/ keeps real paths: their root lists the first segment of each reached
    folder, a folder above one lists only the way down, nothing is renamed or flattened."""

    def test_a_persons_root_lists_the_first_segment_of_each_reached_folder(self, client, house):
        ann, _ = house
        put_note(client, "notes/house/kids/school.md", "# School\n\nreport")
        put_note(client, "notes/house/garage.md", "# Garage\n\nthe owner's")
        share(client, "notes/house/kids", **{ann.id: "read"})
        assert hrefs(ann.dav, "") == ["", "notes/", "attachments/"]
        assert hrefs(ann.dav, "notes") == ["notes/", "notes/Ann/", "notes/Family/", "notes/house/"]
        assert hrefs(ann.dav, "notes/house") == ["notes/house/", "notes/house/kids/"]
        assert hrefs(ann.dav, "notes/house/kids") == [
            "notes/house/kids/",
            "notes/house/kids/school.md",
        ]
        assert ann.dav("GET", "notes/house/kids/school.md", status=200).text == "# School\n\nreport"
        for hidden in ("notes/owner", "notes/owner/diary.md", "notes/house/garage.md", "notes/Bob"):
            ann.dav("PROPFIND", hidden, b"", status=404, Depth="0")
            ann.dav("GET", hidden, status=404)
        owner = Dav(client, client.extra_environ["HTTP_X_SERVICE_KEY"])
        assert "notes/Bob/" in hrefs(owner, "notes")  # the owner sees every home

    def test_writes_into_a_read_share_are_403_and_a_write_share_takes_them(self, house, root):
        ann, bob = house
        before = (root / "notes/Family/plan.md").read_bytes()
        ann.dav("PUT", "notes/Family/plan.md", b"# Plan\n\nmine now", status=403)
        ann.dav("PUT", "notes/Family/new.md", b"# New", status=403)
        ann.dav("DELETE", "notes/Family/plan.md", status=403)
        ann.dav("MKCOL", "notes/Family/sub", status=403)
        ann.dav("PROPPATCH", "notes/Family/plan.md", b"<x/>", status=403)
        ann.dav("LOCK", "notes/Family/plan.md", b"", status=403)
        assert (root / "notes/Family/plan.md").read_bytes() == before
        bob.dav("PUT", "notes/Family/list.md", b"# List\n\nbread", status=201)
        assert (root / "notes/Family/list.md").read_text() == "# List\n\nbread"
        ann.dav("PUT", "notes/Ann/fine.md", b"# Fine", status=201)
        ann.dav("PUT", "notes/owner/x.md", b"x", status=404)  # not there, as far as she knows
        bob.dav("PUT", "notes/Family/list.md", b"# List\n\nbread, eggs", status=204)
        versions = data(bob.api.get(note_url("notes/Family/list.md") + "/versions"))
        assert versions["versions"][0]["savedBy"] == "Bob · Bob's laptop"

    def test_a_note_moves_across_reach_boundaries_only_with_write_on_both_sides(
        self, client, house, root
    ):
        ann, bob = house

        def move(who, src: str, dst: str, status: int):
            return who.dav("MOVE", src, status=status, Destination=f"/dav/{dst}")

        move(ann, "notes/Ann/mine.md", "notes/Family/mine.md", 403)  # into a read share
        move(ann, "notes/Family/plan.md", "notes/Ann/plan.md", 403)  # out of one
        move(ann, "notes/Ann/mine.md", "notes/owner/mine.md", 403)  # outside her reach
        move(bob, "notes/Family/plan.md", "notes/Bob/plan.md", 201)  # write on both sides
        assert (root / "notes/Bob/plan.md").exists()
        assert not (root / "notes/Family/plan.md").exists()
        ann.dav("GET", "notes/Family/plan.md", status=404)
        move(bob, "notes/Bob/plan.md", "notes/Family/plan.md", 201)
        copied = ann.dav(
            "COPY", "notes/Family/plan.md", status=201, Destination="/dav/notes/Ann/p.md"
        )
        assert copied.status_int == 201  # reading the source is enough for a COPY
        assert (root / "notes/Ann/p.md").read_bytes() == (
            root / "notes/Family/plan.md"
        ).read_bytes()
        ann.dav("COPY", "notes/Ann/p.md", status=403, Destination="/dav/notes/Family/p.md")
        ann.dav("COPY", "notes/owner/diary.md", status=404, Destination="/dav/notes/Ann/d.md")
        assert data(client.get(note_url("notes/owner/diary.md")))["content"].endswith("plans")

    def test_a_copy_of_a_folder_on_the_way_down_copies_only_what_the_copier_reaches(
        self, house, root
    ):
        ann, bob = house
        put_note(bob.api, "notes/Bob/shared/s.md", "# S\n\nfor Ann")
        upload(bob.api, "attachments/Bob/secret.txt", b"his own file")
        upload(bob.api, "attachments/Bob/shared/s.txt", b"for Ann too")
        share(bob.api, "notes/Bob/shared", **{ann.id: "read"})
        ann.dav("MKCOL", "attachments/Ann", status=201)
        assert hrefs(ann.dav, "notes/Bob") == ["notes/Bob/", "notes/Bob/shared/"]
        for top in ("notes", "attachments"):  # notes/Bob is only her way to notes/Bob/shared
            ann.dav("COPY", f"{top}/Bob", status=201, Destination=f"/dav/{top}/Ann/loot")
        copied = sorted(
            str(p.relative_to(root)) for p in root.glob("*/Ann/loot/**/*") if p.is_file()
        )
        assert copied == ["attachments/Ann/loot/shared/s.txt", "notes/Ann/loot/shared/s.md"]
        assert not (root / "notes/Ann/loot/mine.md").exists()

    def test_a_folder_on_the_way_down_shows_no_dates_locks_or_properties_of_others(self, house):
        ann, bob = house
        put_note(bob.api, "notes/Bob/shared/s.md", "# S\n\nfor Ann")
        share(bob.api, "notes/Bob/shared", **{ann.id: "read"})
        patch = (
            b'<D:propertyupdate xmlns:D="DAV:" xmlns:Z="urn:x"><D:set><D:prop>'
            b"<Z:tag>surprise party</Z:tag></D:prop></D:set></D:propertyupdate>"
        )
        bob.dav("PROPPATCH", "notes/Bob", patch, status=207)
        lock = (
            b'<D:lockinfo xmlns:D="DAV:"><D:lockscope><D:exclusive/></D:lockscope>'
            b"<D:locktype><D:write/></D:locktype><D:owner>Bob's Mac</D:owner></D:lockinfo>"
        )
        bob.dav("LOCK", "notes/Bob", lock, status=200, Depth="0")
        for path in ("notes/Bob", "notes", ""):
            seen = ann.dav("PROPFIND", path, b"", status=207, Depth="1").text
            way = seen.split("<D:response>")[1 if path else 2]  # the way down itself
            assert "getlastmodified" not in way
            assert "creationdate" not in way
        seen = ann.dav("PROPFIND", "notes/Bob", b"", status=207, Depth="0").text
        assert "surprise" not in seen
        assert "Bob's Mac" not in seen
        assert "opaquelocktoken" not in seen
        mine = ann.dav("PROPFIND", "notes/Ann", b"", status=207, Depth="0").text
        assert "getlastmodified" in mine  # her own folders keep theirs
        theirs = bob.dav("PROPFIND", "notes/Bob", b"", status=207, Depth="0").text
        assert "surprise" in theirs
        assert "Bob's Mac" in theirs

    def test_a_persons_admin_device_ends_no_lock_but_its_own(self, client, house):
        ann, bob = house
        owner = Dav(client, client.extra_environ["HTTP_X_SERVICE_KEY"])
        lock = (
            b'<D:lockinfo xmlns:D="DAV:"><D:lockscope><D:exclusive/></D:lockscope>'
            b"<D:locktype><D:write/></D:locktype></D:lockinfo>"
        )
        token = owner("LOCK", "notes/Family/plan.md", lock, status=200).headers["Lock-Token"]
        for who in (ann, bob):  # Ann reads Family, Bob writes it: both hold admin devices
            who.dav("UNLOCK", "notes/Family/plan.md", status=403, Lock_Token=token)
        bob.dav("PUT", "notes/Family/plan.md", b"# Plan\n\nmine", status=423)
        bobs = bob.dav("LOCK", "notes/Bob/mine.md", lock, status=200).headers["Lock-Token"]
        bob.dav("UNLOCK", "notes/Bob/mine.md", status=204, Lock_Token=bobs)
        owner("UNLOCK", "notes/Family/plan.md", status=204, Lock_Token=token)

    def test_the_owner_moves_a_home_and_its_person_shares_and_links_follow(
        self, client, anon, house, root
    ):
        ann, bob = house
        put_note(ann.api, "notes/Ann/Trips/rome.md", "# Rome\n\ncolosseum")
        share(ann.api, "notes/Ann/Trips", **{bob.id: "read"})
        link = data(ann.api.post_json(f"{API}/shares", {"path": "notes/Ann/Trips/rome.md"}))
        token = link["url"].rsplit("/", 1)[1]
        owner = Dav(client, client.extra_environ["HTTP_X_SERVICE_KEY"])
        owner("MKCOL", "notes/people", status=201)
        owner("MOVE", "notes/Ann", status=201, Destination="/dav/notes/people/Ann")
        me = data(ann.api.post_json(f"{API}/auth/verify", {}))
        assert me["person"]["home"] == "notes/people/Ann"
        assert data(ann.api.get(note_url("notes/people/Ann/mine.md")))["content"] == (
            "# Ann's\n\nher own words"
        )
        assert hrefs(ann.dav, "notes") == ["notes/", "notes/Family/", "notes/people/"]
        shared = data(bob.api.get(f"{API}/shared"))["folders"]
        assert [f["path"] for f in shared] == ["notes/Family", "notes/people/Ann/Trips"]
        assert "colosseum" in bob.dav("GET", "notes/people/Ann/Trips/rome.md", status=200).text
        bob.dav("GET", "notes/people/Ann/mine.md", status=404)
        assert data(anon.get(f"{API}/shared/{token}"))["content"] == "# Rome\n\ncolosseum"
        made = data(ann.api.post_json(f"{API}/notes", {"content": "# Later\n"}, status=201))
        assert made["path"] == "notes/people/Ann/inbox/Later.md"
        assert not (root / "notes/Ann").exists()

    def test_a_person_moves_a_shared_folder_within_their_home_only(self, client, house):
        ann, bob = house
        put_note(ann.api, "notes/Ann/Trips/rome.md", "# Rome")
        put_note(ann.api, "notes/Ann/Trips/Day 1/walk.md", "# Walk")
        share(ann.api, "notes/Ann/Trips", **{bob.id: "write"})
        ann.dav("MKCOL", "notes/Ann/Old", status=201)
        ann.dav("MOVE", "notes/Ann/Trips", status=201, Destination="/dav/notes/Ann/Old/Trips")
        assert [f["path"] for f in data(bob.api.get(f"{API}/shared"))["folders"]] == [
            "notes/Ann/Old/Trips",
            "notes/Family",
        ]
        members = data(ann.api.get(f"{API}/folders/notes%2FAnn%2FOld%2FTrips/members"))
        assert [(m["name"], m["scope"]) for m in members["members"]] == [("Bob", "write")]
        # out of her home, her share would be no longer hers to manage: refused
        share(client, "notes/Family", **{ann.id: "write", bob.id: "write"})
        resp = ann.dav("MOVE", "notes/Ann/Old/Trips", status=403, Destination="/dav/notes/Family/T")
        assert "sharer's home" in resp.text
        # a member moves what is in a shared folder, never the folder itself
        bob.dav("MOVE", "notes/Ann/Old/Trips", status=403, Destination="/dav/notes/Bob/Trips")
        bob.dav("DELETE", "notes/Ann/Old/Trips", status=403)
        bob.dav("MOVE", "notes/Ann/Old/Trips/Day 1", status=201, Destination="/dav/notes/Bob/Day 1")
        assert data(bob.api.get(note_url("notes/Bob/Day 1/walk.md")))["content"] == "# Walk"
        # nor one's own home, nor a folder shared with one
        ann.dav("MOVE", "notes/Ann", status=403, Destination="/dav/notes/Family/Ann")
        ann.dav("DELETE", "notes/Ann", status=403)
        bob.dav("DELETE", "notes/Family", status=403)
        bob.dav("MOVE", "notes/Family", status=403, Destination="/dav/notes/Bob/Family")
        bob.dav("MKCOL", "attachments/Family", status=201)  # (its attachments' twin: the same)
        bob.dav("DELETE", "attachments/Family", status=403)
        bob.dav("MOVE", "attachments/Family", status=403, Destination="/dav/attachments/Bob")
        assert data(client.get(f"{API}/folders/notes%2FFamily/members"))["members"]

    def test_nobody_moves_a_home_into_another_home_nor_a_shared_folder_out_of_notes(
        self, client, house, root
    ):
        ann, _bob = house
        owner = Dav(client, client.extra_environ["HTTP_X_SERVICE_KEY"])
        resp = owner("MOVE", "notes/Ann", status=409, Destination="/dav/notes/Bob/Ann")
        assert "another person's home" in resp.text
        owner("MOVE", "notes/Family", status=409, Destination="/dav/attachments/Family")
        assert (root / "notes/Ann/mine.md").exists()
        assert (root / "notes/Family/plan.md").exists()
        put_note(client, "notes/shelf/kids/a.md", "a")
        add = client.post_json(f"{API}/people", {"name": "Cy", "home": "notes/shelf/kids/Cy"})
        assert add.status_int == 201  # (a home is never made in a shared folder: shared after)
        share(client, "notes/shelf", **{ann.id: "write"})
        ann.dav("MOVE", "notes/shelf/kids", status=403, Destination="/dav/notes/Ann/kids")
        ann.dav("DELETE", "notes/shelf/kids", status=403)  # it holds Cy's home

    def test_a_shared_folder_moved_by_the_owner_keeps_its_members(self, client, house):
        ann, bob = house
        owner = Dav(client, client.extra_environ["HTTP_X_SERVICE_KEY"])
        owner("MOVE", "notes/Family", status=201, Destination="/dav/notes/Household")
        assert data(ann.api.get(note_url("notes/Household/plan.md")))["title"] == "Plan"
        bob.dav("PUT", "notes/Household/new.md", b"# New", status=201)
        ann.dav("PUT", "notes/Household/new.md", b"# Mine", status=403)
        members = data(client.get(f"{API}/folders/notes%2FHousehold/members"))["members"]
        assert sorted((m["name"], m["scope"]) for m in members) == [
            ("Ann", "read"),
            ("Bob", "write"),
        ]
        client.get(f"{API}/folders/notes%2FFamily/members", status=404)


# -- CalDAV as a person ------------------------------------------------------------------------

TODO = "# To do\n\n- [ ] {}\n"


@pytest.fixture
def tasks(client, house):
    """A task in each home, in the family folder and in the owner's private folder."""
    ann, bob = house
    put_note(client, "notes/owner/todo.md", TODO.format("hide the presents"))
    put_note(client, "notes/Family/todo.md", TODO.format("book the cabin"))
    put_note(ann.api, "notes/Ann/todo.md", TODO.format("call the dentist"))
    put_note(bob.api, "notes/Bob/todo.md", TODO.format("fix the bike"))
    return ann, bob


def summaries(dav: Dav, list_path: str) -> list:
    resp = dav("REPORT", list_path, QUERY_TODOS.format("").encode(), status=207, Depth="1")
    return sorted(re.findall(r"SUMMARY:([^\r\n]*)", "".join(cal_items(resp).values())))


def ctag(dav: Dav, list_path: str) -> str:
    body = (
        b'<d:propfind xmlns:d="DAV:" xmlns:cs="http://calendarserver.org/ns/"><d:prop>'
        b"<cs:getctag/></d:prop></d:propfind>"
    )
    text = dav("PROPFIND", list_path, body, status=207, Depth="0").text
    return re.search(r"<CS:getctag>([^<]*)</CS:getctag>", text).group(1)


class TestPeopleCalDav:
    """CalDAV for a person: the lists of reached folders holding tasks (the same f-<id> for
    everyone), "All tasks" is their reach, new items go to <home>/Tasks.md, CTags and sync
    tokens per principal."""

    def test_lists_are_the_reached_folders_holding_tasks_with_the_same_ids(self, dav, tasks):
        ann, bob = tasks
        owners = list_ids(dav)
        assert set(owners) == {"All tasks", "owner", "Family", "Ann", "Bob"}
        anns = list_ids(ann.dav)
        assert anns == {k: owners[k] for k in ("All tasks", "Family", "Ann")}
        assert list_ids(bob.dav) == {k: owners[k] for k in ("All tasks", "Family", "Bob")}
        ann.dav("PROPFIND", owners["owner"], b"", status=404, Depth="0")
        ann.dav("REPORT", owners["Bob"], QUERY_TODOS.format("").encode(), status=404)
        assert summaries(ann.dav, anns["All tasks"]) == ["book the cabin", "call the dentist"]
        assert summaries(dav, owners["All tasks"]) == [
            "book the cabin",
            "call the dentist",
            "fix the bike",
            "hide the presents",
        ]

    def test_a_new_item_in_all_tasks_goes_to_the_home_and_a_read_share_takes_none(
        self, tasks, root
    ):
        ann, bob = tasks
        lists = list_ids(ann.dav)
        ann.dav(
            "PUT",
            lists["All tasks"] + "new.ics",
            vtodo("u-1", "SUMMARY:water the fern"),
            status=201,
        )
        assert "- [ ] water the fern" in (root / "notes/Ann/Tasks.md").read_text()
        family = lists["Family"]
        ann.dav("PUT", family + "n2.ics", vtodo("u-2", "SUMMARY:sneak in"), status=403)
        assert not (root / "notes/Family/Tasks.md").exists()
        bob.dav("PUT", family + "n3.ics", vtodo("u-3", "SUMMARY:pack"), status=201)
        assert "- [ ] pack" in (root / "notes/Family/Tasks.md").read_text()

    def test_a_task_in_a_read_share_is_neither_edited_nor_deleted(self, tasks, root):
        ann, bob = tasks
        family = list_ids(ann.dav)["Family"]
        href = next(
            h
            for h in cal_items(
                ann.dav("REPORT", family, QUERY_TODOS.format("").encode(), status=207)
            )
            if h.endswith(".ics")
        )
        item = href[len("/dav/") :]
        uid = re.search(r"UID:([^\r\n]*)", ann.dav("GET", item, status=200).text).group(1)
        done = vtodo(uid, "SUMMARY:book the cabin", "STATUS:COMPLETED")
        resp = ann.dav("PUT", item, done, status=403)
        assert "need-privileges" in resp.text
        ann.dav("DELETE", item, status=403)
        assert (root / "notes/Family/todo.md").read_text() == TODO.format("book the cabin")
        privileges = ann.dav("PROPFIND", family, b"", status=207, Depth="0").text
        assert "<D:write/>" not in privileges
        assert "<D:write/>" in bob.dav("PROPFIND", family, b"", status=207, Depth="0").text
        bob.dav("PUT", item, done, status=204)
        assert "- [x] book the cabin" in (root / "notes/Family/todo.md").read_text()

    def test_ctags_and_sync_tokens_move_only_for_changes_in_reach(self, client, tasks):
        ann, bob = tasks
        lists = list_ids(ann.dav)
        every, family = lists["All tasks"], lists["Family"]
        before = {who: ctag(who.dav, every) for who in (ann, bob)}
        token = re.search(
            r"<D:sync-token>([^<]*)</D:sync-token>",
            ann.dav("REPORT", every, sync_body(), status=207).text,
        ).group(1)
        client.put_json(note_url("notes/owner/todo.md"), {"content": TODO.format("wrap them")})
        put_note(bob.api, "notes/Bob/more.md", TODO.format("oil the chain"))
        assert ctag(ann.dav, every) == before[ann]  # nothing she sees changed
        again = ann.dav("REPORT", every, sync_body(token), status=207)
        assert cal_items(again) == {}
        assert ctag(bob.dav, every) != before[bob]
        bob.api.put_json(note_url("notes/Family/todo.md"), {"content": TODO.format("book it")})
        assert ctag(ann.dav, every) != before[ann]
        changed = ann.dav("REPORT", every, sync_body(token), status=207)
        found = re.findall(r"<D:href>/dav/([^<]+)</D:href><D:propstat>", changed.text)
        assert [ann.dav("GET", h, status=200).text.count("SUMMARY:book it") for h in found] == [1]
        seqs = {ctag(who.dav, family).rsplit(":", 1)[1].split("-")[0] for who in (ann, bob)}
        assert len(seqs) == 1  # one list's newest change, signed for each reach apart
        # her share removed: the list goes, and her token is no token any more
        share(client, "notes/Family", **{bob.id: "write"})
        ann.dav("PROPFIND", family, b"", status=404, Depth="0")
        resp = ann.dav("REPORT", every, sync_body(token), status=403)
        assert "valid-sync-token" in resp.text
        assert summaries(ann.dav, every) == ["call the dentist"]


# -- calendar feeds, share links ------------------------------------------------------------


class TestPeopleFeedsAndLinks:
    def test_a_persons_feed_reads_their_reach_and_is_theirs_to_list_and_delete(
        self, client, anon, tasks
    ):
        ann, bob = tasks
        made = data(ann.api.post_json(f"{API}/auth/feeds", {"name": "Ann's"}, status=201))
        secret_path = urllib.parse.urlsplit(made["url"]).path
        body = anon.get(secret_path).text
        assert "SUMMARY:call the dentist" in body
        assert "SUMMARY:book the cabin" in body
        assert "presents" not in body
        assert "bike" not in body
        ann.api.post_json(f"{API}/auth/feeds", {"name": "x", "folder": "notes/owner"}, status=404)
        assert [f["id"] for f in data(ann.api.get(f"{API}/auth/feeds"))["feeds"]] == [made["id"]]
        assert data(bob.api.get(f"{API}/auth/feeds"))["feeds"] == []
        bob.api.delete(f"{API}/auth/feeds/{made['id']}", status=404)
        listed = data(client.get(f"{API}/auth/feeds"))["feeds"]
        assert [(f["id"], f["person"]) for f in listed] == [(made["id"], ann.id)]
        share(client, "notes/Family", **{bob.id: "write"})  # her share ends: so does its part
        assert "cabin" not in anon.get(secret_path).text
        client.delete(f"{API}/people/{ann.id}")
        anon.get(secret_path, status=404)

    def test_a_link_is_made_only_for_a_note_they_read_and_dies_when_they_lose_it(
        self, client, anon, house
    ):
        ann, bob = house
        ann.api.post_json(f"{API}/shares", {"path": "notes/owner/diary.md"}, status=404)
        ann.api.post_json(f"{API}/shares", {"path": "notes/Bob/mine.md"}, status=404)
        link = data(ann.api.post_json(f"{API}/shares", {"path": "notes/Family/plan.md"}))
        token = link["url"].rsplit("/", 1)[1]
        assert "hills" in data(anon.get(f"{API}/shared/{token}"))["content"]
        assert [s["id"] for s in data(ann.api.get(f"{API}/shares"))["shares"]] == [link["id"]]
        assert data(bob.api.get(f"{API}/shares"))["shares"] == []
        share(client, "notes/Family", **{bob.id: "write"})  # the share that gave it her: gone
        anon.get(f"{API}/shared/{token}", status=404)
        assert data(ann.api.get(f"{API}/shares"))["shares"] == []
        assert data(client.get(f"{API}/shares"))["shares"] == []  # ended, not hidden
        share(client, "notes/Family", **{ann.id: "read", bob.id: "write"})
        anon.get(f"{API}/shared/{token}", status=404)  # and it stays dead

    def test_a_link_dies_when_its_note_moves_out_of_its_makers_reach(self, client, anon, house):
        ann, bob = house
        link = data(ann.api.post_json(f"{API}/shares", {"path": "notes/Family/plan.md"}))
        token = link["url"].rsplit("/", 1)[1]
        mine = data(bob.api.post_json(f"{API}/shares", {"path": "notes/Family/plan.md"}))
        bob.api.patch_json(note_url("notes/Family/plan.md") + "/move", {"path": "notes/Bob/p.md"})
        anon.get(f"{API}/shared/{token}", status=404)
        assert [s["id"] for s in data(client.get(f"{API}/shares"))["shares"]] == [mine["id"]]
        bob_token = mine["url"].rsplit("/", 1)[1]
        assert "hills" in data(anon.get(f"{API}/shared/{bob_token}"))["content"]


# -- export and import -------------------------------------------------------------------------


def zip_names(resp) -> list:
    return sorted(zipfile.ZipFile(io.BytesIO(resp.body)).namelist())


class TestPeopleExportImport:
    def test_a_persons_export_holds_their_reach_and_nothing_else(self, client, house):
        ann, _ = house
        upload(ann.api, "attachments/Ann/p.png")
        upload(client, "attachments/owner/o.png")
        names = zip_names(ann.api.get(f"{API}/export.zip"))
        assert names == [
            "attachments/Ann/p.png",
            "notes/Ann/mine.md",
            "notes/Family/plan.md",
            "notesvc-export.json",
        ]
        manifest = json.loads(
            zipfile.ZipFile(io.BytesIO(ann.api.get(f"{API}/export.zip").body)).read(
                "notesvc-export.json"
            )
        )
        assert manifest["folders"] == ["notes/Ann", "notes/Family"]
        assert "notes/owner/diary.md" in zip_names(client.get(f"{API}/export.zip"))

    @pytest.mark.slow
    def test_an_import_lands_in_the_home_or_a_folder_they_write(self, client, house, root):
        ann, bob = house
        files = zip_of({"vault/a.md": "# A\n\nalpha", "vault/b.md": "# B\n\nbeta"})
        report = import_file(ann.api, files, "vault.zip")
        assert report["into"] == "notes/Ann/imported/files"
        assert (root / "notes/Ann/imported/files/vault/a.md").read_text() == "# A\n\nalpha"
        report = import_file(bob.api, files, "vault.zip", into="notes/Family/from Bob")
        assert (root / "notes/Family/from Bob/vault/b.md").exists()
        resp = import_file(ann.api, files, "vault.zip", status=403, into="notes/Family/x")
        assert resp["error"]["code"] == "FORBIDDEN"
        resp = import_file(ann.api, files, "vault.zip", status=404, into="notes/owner")
        assert "diary" not in json.dumps(resp)
        assert not (root / "notes/Family/x").exists()

    def test_a_notesvc_export_imported_by_a_person_skips_what_they_may_not_write(
        self, client, house, root
    ):
        ann, _ = house
        export = client.get(f"{API}/export.zip").body
        (root / "notes/Ann/mine.md").unlink()
        client.delete(note_url("notes/owner/diary.md"))
        report = import_file(ann.api, export, "export.zip")
        assert report["created"] == 1
        assert (root / "notes/Ann/mine.md").read_text() == "# Ann's\n\nher own words"
        skipped = {s["source"]: s["reason"] for s in report["skipped"]}
        for name in ("notes/owner/diary.md", "notes/Bob/mine.md", "notes/Family/plan.md"):
            assert "outside the folders this key may write" in skipped[name]
        assert not (root / "notes/owner/diary.md").exists()  # (deleted above: not brought back)


# -- link rewriting and backlinks across reach -----------------------------------------------


class TestPeopleLinks:
    def test_a_move_rewrites_links_only_in_notes_the_mover_may_write(self, client, house, root):
        ann, bob = house
        put_note(client, "notes/owner/refs.md", "see [[Family/plan]], [p](../Family/plan.md)")
        put_note(client, "notes/kids/refs.md", "see [[Family/plan]]")
        share(client, "notes/kids", **{bob.id: "read"})  # hers to read, not to rewrite
        put_note(bob.api, "notes/Bob/refs.md", "see [[Family/plan]]")
        put_note(bob.api, "notes/Family/refs.md", "see [p](plan.md)")
        put_note(ann.api, "notes/Ann/refs.md", "see [[Family/plan]]")
        kept = {
            p: (root / p).read_text()
            for p in ("notes/owner/refs.md", "notes/kids/refs.md", "notes/Ann/refs.md")
        }
        body = {"path": "notes/Family/trip/plan.md", "updateLinks": True}
        moved = data(bob.api.patch_json(note_url("notes/Family/plan.md") + "/move", body))
        assert sorted(moved["linksUpdated"]) == ["notes/Bob/refs.md", "notes/Family/refs.md"]
        assert (root / "notes/Bob/refs.md").read_text() == "see [[Family/trip/plan]]"
        assert (root / "notes/Family/refs.md").read_text() == "see [p](trip/plan.md)"
        for path, text in kept.items():
            assert (root / path).read_text() == text, path

    def test_backlinks_never_reveal_an_unreached_note(self, client, house):
        ann, bob = house
        put_note(client, "notes/owner/refs.md", "the owner's [[plan]]")
        put_note(bob.api, "notes/Bob/refs.md", "Bob's [[plan]]")
        put_note(ann.api, "notes/Ann/refs.md", "Ann's [[plan]] and [[diary]]")
        url = f"{API}/plugins/backlinks/" + urllib.parse.quote("notes/Family/plan.md", safe="")
        assert [b["path"] for b in data(ann.api.get(url))["backlinks"]] == ["notes/Ann/refs.md"]
        assert [b["path"] for b in data(bob.api.get(url))["backlinks"]] == ["notes/Bob/refs.md"]
        assert len(data(client.get(url))["backlinks"]) == 3
        diary = f"{API}/plugins/backlinks/" + urllib.parse.quote("notes/owner/diary.md", safe="")
        resp = ann.api.get(diary, status=404)
        assert "Ann" not in resp.text

    def test_a_link_into_an_unreached_note_is_never_rewritten(self, client, house, root):
        ann, _ = house
        text = "[d](../owner/diary.md) [[diary]] [m](../Ann/mine.md)"
        put_note(ann.api, "notes/Ann/refs.md", text)
        body = {"path": "notes/Ann/deep/refs.md", "updateLinks": True}
        data(ann.api.patch_json(note_url("notes/Ann/refs.md") + "/move", body))
        moved = (root / "notes/Ann/deep/refs.md").read_text()
        assert "[d](../owner/diary.md)" in moved  # not rebased: it leads nowhere she sees
        assert "[[diary]]" in moved
        assert "[m](../mine.md)" in moved  # her own note's link is rebased


# -- bad input ---------------------------------------------------------------------------------


class TestPeopleBadInput:
    @pytest.mark.parametrize(
        "raw",
        [
            "notes/Ann/../owner",
            "notes/Ann/%2e%2e/owner",
            "notes%252FAnn",
            "notes/Ann/./x",
            "..",
            "notes/Ann/%E2%80%AEevil",
            "notes/Ann/" + "x" * 600,
        ],
    )
    @pytest.mark.slow
    def test_hostile_folder_paths_in_members_are_4xx_never_500(self, client, house, raw):
        ann, bob = house
        body = {"members": [{"person": bob.id, "scope": "read"}]}
        for who in (client, ann.api):
            resp = who.put_json(f"{API}/folders/{raw}/members", body, status="*")
            assert 400 <= resp.status_int < 500, (raw, resp.status_int)
            assert resp.json["success"] is False
        assert data(bob.api.get(f"{API}/shared"))["folders"][0]["path"] == "notes/Family"
        assert len(data(bob.api.get(f"{API}/shared"))["folders"]) == 1

    def test_an_nfd_folder_name_shares_the_nfc_folder(self, client, anon):
        rene = Person(client, anon, "Ren\u00e9")
        bob = Person(client, anon, "Bob")
        put_note(rene.api, "notes/Ren\u00e9/Caf\u00e9/menu.md", "# Menu\n\ncroissants")
        nfd = urllib.parse.quote("notes/Rene\u0301/Cafe\u0301", safe="")
        body = {"members": [{"person": bob.id, "scope": "read"}]}
        got = data(rene.api.put_json(f"{API}/folders/{nfd}/members", body))
        assert got["path"] == "notes/Ren\u00e9/Caf\u00e9"
        assert data(bob.api.get(f"{API}/shared"))["folders"][0]["path"] == got["path"]
        assert (
            "croissants"
            in data(bob.api.get(note_url("notes/Ren\u00e9/Caf\u00e9/menu.md")))["content"]
        )

    def test_sharing_outside_ones_home_is_403_and_unreached_is_404(self, client, house):
        ann, bob = house
        share(client, "notes/Family", **{ann.id: "write", bob.id: "write"})
        resp = share(ann.api, "notes/Family", status=403, **{bob.id: "read"})
        assert "own home" in assert_error(resp, 403, "FORBIDDEN")["message"]
        resp = share(ann.api, "notes/owner", status=404, **{bob.id: "read"})
        assert "owner" not in json.dumps(resp.json).replace("notes/owner", "")
        assert_error(
            share(ann.api, "notes/Ann", status=400, **{ann.id: "read"}), 400, "VALIDATION_ERROR"
        )

    @pytest.mark.parametrize(
        ("body", "status"),
        [
            (b"{not json", 400),
            (b'{"members": "Bob"}', 400),
            (b'{"members": [{"person": 7, "scope": "read"}]}', 400),
            (b'{"members": [{"person": "p_nobodyhere", "scope": "read"}]}', 400),
            (b'{"members": [["read"]]}', 400),
            (b'{"other": 1}', 400),
            (b'{"members": [' + b'{"person": "p_x", "scope": "read"},' * 60 + b"{}]}", 400),
        ],
    )
    @pytest.mark.slow
    def test_broken_member_bodies_are_400(self, house, body, status):
        ann, _ = house
        resp = ann.api.put(
            f"{API}/folders/notes%2FAnn/members",
            body,
            headers={"Content-Type": "application/json"},
            status=status,
        )
        assert_error(resp, status, "VALIDATION_ERROR")

    def test_a_huge_members_body_is_413(self, house):
        ann, bob = house
        body = json.dumps(
            {"members": [{"person": bob.id, "scope": "read"}], "pad": "x" * 2_000_000}
        )
        resp = ann.api.put(
            f"{API}/folders/notes%2FAnn/members",
            body.encode(),
            headers={"Content-Type": "application/json"},
            status=413,
        )
        assert_error(resp, 413, "PAYLOAD_TOO_LARGE")


# -- a person removed (or cut from a share) while their write is under way ------------------


class SlowBody(io.RawIOBase):
    """A request body whose second half waits for `go`: an upload still arriving when the
    owner acts on another thread."""

    def __init__(self, body: bytes):
        self.parts = [body[: len(body) // 2], body[len(body) // 2 :]]
        self.go, self.waiting = threading.Event(), threading.Event()

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        if not self.parts:
            return b""
        if len(self.parts) == 1:
            self.waiting.set()
            assert self.go.wait(10)
        return self.parts.pop(0)


def slow_request(app, method: str, url: str, body: bytes, headers: dict) -> tuple:
    """Start a request whose body stalls half way; return (its SlowBody, a thread that
    answers into `answer`, answer)."""

    req = webob.Request.blank(url, method=method, headers=headers)
    slow = SlowBody(body)
    req.environ.update({"wsgi.input": slow, "CONTENT_LENGTH": str(len(body))})
    req.environ["REMOTE_ADDR"] = "127.0.0.1"
    answer: list = []
    thread = threading.Thread(target=lambda: answer.append(req.get_response(app)))
    thread.start()
    assert slow.waiting.wait(10)  # the key was checked; the body is still on its way
    return slow, thread, answer


class TestPeopleInFlight:
    @pytest.mark.parametrize("surface", ["dav", "api", "attachment"])
    def test_a_removed_persons_write_in_flight_is_401_and_writes_nothing(
        self, client, anon, root, surface
    ):
        ann = Person(client, anon, "Ann")
        text = b"# Late\n\n" + b"words " * 2000
        if surface == "dav":
            url, method, headers = (
                "/dav/notes/Ann/late.md",
                "PUT",
                {"Authorization": basic(ann.key)},
            )
        elif surface == "api":
            url, method = f"{API}/notes", "POST"
            headers = {KEY: ann.key, "Content-Type": "application/json"}
            text = json.dumps({"path": "notes/Ann/late.md", "content": text.decode()}).encode()
        else:
            ann.dav("MKCOL", "attachments/Ann", status=201)
            url, method = "/dav/attachments/Ann/late.png", "PUT"
            headers, text = {"Authorization": basic(ann.key)}, PNG * 8
        slow, thread, answer = slow_request(client.app, method, url, text, headers)
        client.delete(f"{API}/people/{ann.id}")
        slow.go.set()
        thread.join(10)
        assert answer[0].status_int == 401, answer[0].text
        if surface != "api":
            assert answer[0].headers["WWW-Authenticate"].startswith("Basic ")
        assert not (root / "notes/Ann/late.md").exists()
        assert not (root / "attachments/Ann/late.png").exists()
        assert "Traceback" not in answer[0].text

    def test_a_write_in_flight_into_a_share_just_removed_writes_nothing(self, client, house, root):
        _, bob = house
        headers = {"Authorization": basic(bob.key)}
        slow, thread, answer = slow_request(
            client.app, "PUT", "/dav/notes/Family/late.md", b"# Late\n\n" * 500, headers
        )
        share(client, "notes/Family")  # no members any more
        slow.go.set()
        thread.join(10)
        assert answer[0].status_int == 404, answer[0].text
        assert not (root / "notes/Family/late.md").exists()
        bob.dav("PUT", "notes/Bob/fine.md", b"# Fine", status=201)  # his key still works

    def test_a_removal_waits_for_a_write_it_let_in_and_nothing_is_written_after(
        self, client, anon, root, monkeypatch
    ):
        ann = Person(client, anon, "Ann")
        ann.dav("MKCOL", "attachments/Ann", status=201)
        rename, order = notesvc.AttachmentStore._rename, []
        renaming, draining, release = threading.Event(), threading.Event(), threading.Event()

        def slow_rename(src, dst):
            renaming.set()
            assert release.wait(10)
            rename(src, dst)
            order.append("written")

        drain = notesvc.Service.drain

        def watched_drain(self, *args, **kwargs):
            draining.set()
            return drain(self, *args, **kwargs)

        monkeypatch.setattr(notesvc.AttachmentStore, "_rename", staticmethod(slow_rename))
        monkeypatch.setattr(notesvc.Service, "drain", watched_drain)
        answers: list = []
        put = threading.Thread(
            target=lambda: answers.append(ann.dav("PUT", "attachments/Ann/a.png", PNG, status="*"))
        )
        put.start()
        assert renaming.wait(10)  # let in: its key was live when it reached the store
        remove = threading.Thread(
            target=lambda: (client.delete(f"{API}/people/{ann.id}"), order.append("removed"))
        )
        remove.start()
        assert draining.wait(10)
        release.set()
        put.join(10)
        remove.join(10)
        assert order == ["written", "removed"]  # the DELETE answered after the write
        assert answers[0].status_int == 201
        assert (root / "attachments/Ann/a.png").read_bytes() == PNG
        ann.dav("PUT", "attachments/Ann/b.png", PNG, status=401)


# -- the judges: rclone and the caldav library as a person, on a real server ------------------


def owner_key_of(server) -> str:
    return server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]


def real_person(server, owner: str, name: str) -> tuple:
    """Add a person on a real server and claim their first device: (person, their key)."""
    status, _, made = server.request("POST", f"{API}/people", {"name": name}, {KEY: owner})
    assert status == 201, made
    claim = {"secret": made["data"]["pairing"]["secret"], "deviceName": f"{name}'s laptop"}
    status, _, got = server.request("POST", f"{API}/auth/devices/claim", claim)
    assert status == 201, got
    return made["data"]["person"], got["data"]["key"]


def real_share(server, key: str, folder: str, **members: str) -> None:
    body = {"members": [{"person": p, "scope": s} for p, s in members.items()]}
    url = f"{API}/folders/{urllib.parse.quote(folder, safe='')}/members"
    status, _, answer = server.request("PUT", url, body, {KEY: key})
    assert status == 200, answer


def real_note(server, key: str, path: str, content: str) -> None:
    status, _, answer = server.request(
        "POST", f"{API}/notes", {"path": path, "content": content}, {KEY: key}
    )
    assert status == 201, answer


class TestPeopleJudges:
    """A person's WebDAV judged by rclone, their CalDAV by the caldav library, and writes in
    flight on a real server's threads."""

    pytestmark = [pytest.mark.real_server, pytest.mark.slow]

    def test_rclone_as_a_person_syncs_their_home_both_ways_and_sees_only_their_reach(
        self, tmp_path
    ):
        if not RCLONE:
            pytest.skip("no rclone on this machine (Debian: apt install rclone)")
        root = tmp_path / "root"
        with running(root) as server:
            owner = owner_key_of(server)
            real_note(server, owner, "notes/owner/diary.md", "# Diary\n\nsecret")
            real_note(server, owner, "notes/Family/plan.md", "# Plan\n\nhills")
            ann, key = real_person(server, owner, "Ann")
            real_share(server, owner, "notes/Family", **{ann["id"]: "read"})
            env = rclone_env(f"{server.url}/dav/", key)
            listed = subprocess.run(
                [RCLONE, "lsf", "-R", ":webdav:notes"], capture_output=True, text=True, env=env
            )
            assert listed.returncode == 0, listed.stderr[-2000:]
            assert sorted(listed.stdout.split()) == ["Ann/", "Family/", "Family/plan.md"]
            local = tmp_path / "vault"
            files = {
                f"area {i % 3}/note {i}.md": f"# Note {i}\n\nabout the garden {i}\n".encode()
                for i in range(30)
            }
            files["area 0/photo.png"] = PNG
            for rel, body in files.items():
                (local / rel).parent.mkdir(parents=True, exist_ok=True)
                (local / rel).write_bytes(body)
            rclone(env, "sync", str(local), ":webdav:notes/Ann/vault")
            for rel, body in files.items():
                assert (root / "notes/Ann/vault" / rel).read_bytes() == body, rel
            path = urllib.parse.quote("notes/Ann/vault/area 1/note 1.md", safe="")
            edit = {"content": "# Note 1\n\nedited on the phone\n"}
            assert server.request("PUT", f"{API}/notes/{path}", edit, {KEY: key})[0] == 200
            rclone(env, "sync", ":webdav:notes/Ann/vault", str(local))
            assert "edited on the phone" in (local / "area 1/note 1.md").read_text()
            out = rclone(env, "check", "--download", str(local), ":webdav:notes/Ann/vault")
            assert "0 differences found" in out
            # a read share takes nothing, and nothing outside her reach shows
            (tmp_path / "mine.md").write_text("# Mine\n")
            done = subprocess.run(
                [RCLONE, "copyto", str(tmp_path / "mine.md"), ":webdav:notes/Family/mine.md"],
                capture_output=True,
                text=True,
                env=env,
            )
            assert done.returncode != 0
            assert not (root / "notes/Family/mine.md").exists()
            done = subprocess.run(
                [RCLONE, "cat", ":webdav:notes/owner/diary.md"], capture_output=True, env=env
            )
            assert done.returncode != 0
            assert b"secret" not in done.stdout
            assert not any("Traceback" in line for line in server.lines)

    def test_the_caldav_library_as_a_person(self, tmp_path):
        caldav = pytest.importorskip("caldav")
        root = tmp_path / "root"
        with running(root) as server, contextlib.ExitStack() as stack:
            owner = owner_key_of(server)
            real_note(server, owner, "notes/owner/todo.md", TODO.format("hide the presents"))
            real_note(server, owner, "notes/Family/todo.md", TODO.format("book the cabin"))
            ann, key = real_person(server, owner, "Ann")
            real_share(server, owner, "notes/Family", **{ann["id"]: "read"})
            real_note(server, key, "notes/Ann/todo.md", TODO.format("call the dentist"))
            client = caldav.DAVClient(
                url=f"{server.url}/.well-known/caldav", username="ann", password=key
            )
            stack.enter_context(client)
            lists = {c.get_display_name(): c for c in client.principal().calendars()}
            assert set(lists) == {"All tasks", "Family", "Ann"}
            every = lists["All tasks"]
            assert sorted(str(t.icalendar_component["SUMMARY"]) for t in every.todos()) == [
                "book the cabin",
                "call the dentist",
            ]
            token = every.objects_by_sync_token(load_objects=False).sync_token
            status = server.request(
                "PUT",
                f"{API}/notes/notes%2Fowner%2Ftodo.md",
                {"content": TODO.format("wrap the presents")},
                {KEY: owner},
            )[0]
            assert status == 200
            assert list(every.objects_by_sync_token(sync_token=token, load_objects=True)) == []
            dentist = lists["Ann"].todos()[0]
            dentist.complete()
            assert "- [x] call the dentist" in (root / "notes/Ann/todo.md").read_text()
            every.save_todo(summary="water the fern")
            assert "- [ ] water the fern" in (root / "notes/Ann/Tasks.md").read_text()
            cabin = lists["Family"].todos()[0]
            with pytest.raises(caldav.lib.error.DAVError):
                cabin.complete()
            assert (root / "notes/Family/todo.md").read_text() == TODO.format("book the cabin")
            with pytest.raises(caldav.lib.error.DAVError):
                lists["Family"].save_todo(summary="sneak in")
            assert not (root / "notes/Family/Tasks.md").exists()
            assert not any("Traceback" in line for line in server.lines)

    def test_nothing_is_written_once_a_persons_removal_has_answered(self, tmp_path):
        """Writers on waitress's threads with Ann's key, WebDAV and the API, while the owner
        removes her: every write answered 2xx is on disk, and none lands after the DELETE
        answered."""
        root = tmp_path / "root"
        with running(root, env={"SERVICE_THREADS": "8"}) as server:
            owner = owner_key_of(server)
            ann, key = real_person(server, owner, "Ann")
            stop, answers = threading.Event(), []

            def write(n: int) -> None:
                i = 0
                while not stop.is_set() and i < 400:
                    i += 1
                    path = f"notes/Ann/w{n}-{i}.md"
                    if n % 2:
                        status = server.request(
                            "POST", f"{API}/notes", {"path": path, "content": "x"}, {KEY: key}
                        )[0]
                    else:
                        req = urllib.request.Request(
                            f"{server.url}/dav/{urllib.parse.quote(path)}",
                            b"# x\n",
                            {"Authorization": basic(key)},
                            method="PUT",
                        )
                        try:
                            with urllib.request.urlopen(req, timeout=30) as resp:
                                status = resp.status
                        except urllib.error.HTTPError as e:
                            status = e.code
                    answers.append((path, status))
                    if status == 401:
                        return

            writers = [threading.Thread(target=write, args=(n,)) for n in range(4)]
            for w in writers:
                w.start()
            wait_for(lambda: len(answers) >= 20)
            status, _, gone = server.request(
                "DELETE", f"{API}/people/{ann['id']}", None, {KEY: owner}
            )
            assert status == 200, gone
            at_removal = {p.name for p in (root / "notes/Ann").glob("*.md")}
            for w in writers:
                w.join(60)
            stop.set()
            after = {p.name for p in (root / "notes/Ann").glob("*.md")}
            assert after == at_removal  # nothing landed once the DELETE had answered
            assert {s for _, s in answers} <= {200, 201, 401}
            written = {p.rsplit("/", 1)[1] for p, s in answers if s == 201}
            assert written == after
            assert sum(s == 401 for _, s in answers) == 4  # each writer was cut
            assert not any("Traceback" in line for line in server.lines)


class TestPeopleExportInFlight:
    """An export streaming while its person is removed, or their share is, stops showing
    what they lost: the files of a share removed are left out, and a revoked key's stream
    ends without the zip's directory (no zip at all)."""

    def stream(self, client, who):
        for folder in ("Ann", "Family"):
            for i in range(6):
                upload(client, f"attachments/{folder}/{i}.png", PNG + os.urandom(200_000))
        req = webob.Request.blank(f"{API}/export.zip", headers={KEY: who.key})
        req.environ["REMOTE_ADDR"] = "127.0.0.1"
        status, _headers, body = req.call_application(client.app)
        assert status.startswith("200")
        return iter(body)

    def test_a_share_removed_mid_export_leaves_its_files_out(self, client, house):
        ann, bob = house
        chunks = self.stream(client, ann)
        got = next(chunks)
        assert b"attachments/Ann/0.png" in got
        share(client, "notes/Family", **{bob.id: "write"})
        got += b"".join(chunks)
        names = zipfile.ZipFile(io.BytesIO(got)).namelist()
        assert "attachments/Ann/5.png" in names
        assert not [n for n in names if n.startswith("attachments/Family/")]
        assert "notes/Family/plan.md" in names  # (sent before: a stream cannot take it back)

    def test_a_removed_persons_export_ends_without_a_zip(self, client, house):
        ann, _ = house
        chunks = self.stream(client, ann)
        got = next(chunks)
        client.delete(f"{API}/people/{ann.id}")
        got += b"".join(chunks)
        with pytest.raises(zipfile.BadZipFile):
            zipfile.ZipFile(io.BytesIO(got))
        assert b"attachments/Family/" not in got
