"""Tasks over CalDAV and the calendar feed (src/notesvc/http/caldav.py)."""

from __future__ import annotations

import contextlib
import datetime as dt
import html
import http.client
import http.server
import json
import logging
import os
import random
import re
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import webtest

from conftest import (
    API,
    KEY,
    QUERY_TODOS,
    Dav,
    Server,
    as_key,
    basic,
    data,
    key_of,
    new_grant,
    note_url,
    notesvc,
    put_note,
    running,
    timed_health,
    update,
    upload,
    wait_for,
    with_key,
)
from standins import MINIMAL_CONFIG

VDIRSYNCER = shutil.which("vdirsyncer")


KHAL = shutil.which("khal")


# -- CalDAV: task lines as task lists (docs/api.md: CalDAV) -------------------------------------

TASKS_NOTE = (
    "# Home\n\n"
    "- [ ] call the plumber ⏰ 2026-12-02 09:00\n"
    "  - [x] find the number #phone\n"
    "* [ ] buy milk 📅 2026-12-03 #shop\n"
    "1. [ ] pay rent; twice, now due:2026-12-01\n"
    "+ [X] water the plants\n"
    "```\n- [ ] not a task: fenced code\n```\n"
    "text with [ ] a box but no list marker\n"
)


CAL = "urn:ietf:params:xml:ns:caldav"


def sync_body(token: str = "") -> bytes:
    return (
        '<d:sync-collection xmlns:d="DAV:" xmlns:c="urn:ietf:params:xml:ns:caldav">'
        f"<d:sync-token>{token}</d:sync-token><d:sync-level>1</d:sync-level>"
        "<d:prop><d:getetag/></d:prop></d:sync-collection>"
    ).encode()


def vtodo(uid: str, *props: str) -> bytes:
    lines = ["BEGIN:VCALENDAR", "VERSION:2.0", "PRODID:-//test//EN", "BEGIN:VTODO"]
    lines += [f"UID:{uid}", "DTSTAMP:20261128T100000Z", *props, "END:VTODO", "END:VCALENDAR"]
    return ("\r\n".join(lines) + "\r\n").encode()


def cal_items(resp) -> dict:
    """{href: calendar data} of a REPORT's answer."""
    found = re.findall(
        r"<D:href>([^<]*)</D:href>.*?(?:<C:calendar-data>([^<]*)</C:calendar-data>|</D:response>)",
        resp.text,
        re.S,
    )
    return {href: html.unescape(body) for href, body in found}


def list_ids(dav: Dav) -> dict:
    """{display name: list path} of the task lists a key sees."""
    listed = dav("PROPFIND", "calendars/", b"", status=207, Depth="1").text
    pairs = re.findall(
        r"<D:href>/dav/(calendars/[^<]+/)</D:href>.*?<D:displayname>([^<]*)</D:displayname>",
        listed,
        re.S,
    )
    return {html.unescape(name): path for path, name in pairs}


class TestCalDAV:
    """/dav/calendars/: the task lines of the notes as task lists for Reminders, DAVx5 and
    Thunderbird; writes from them edit one line of a note."""

    def test_task_lines_are_list_items_with_a_box_outside_code_and_front_matter(self):
        text = "---\ntags: [a]\n- [ ] in front matter\n---\n" + TASKS_NOTE
        tasks = notesvc.task_lines(text)
        assert [t["summary"] for t in tasks] == [
            "call the plumber",
            "find the number",
            "buy milk",
            "pay rent; twice, now",
            "water the plants",
        ]
        assert [t["done"] for t in tasks] == [False, True, False, False, True]
        assert tasks[1]["parent"] == 0  # nesting
        assert tasks[2]["parent"] is None
        assert tasks[0]["wall"] == dt.datetime(2026, 12, 2, 9, 0)
        assert tasks[0]["due"] is None
        assert tasks[2]["due"] == dt.date(2026, 12, 3)
        assert tasks[2]["categories"] == ["shop"]
        assert tasks[3]["due"] == dt.date(2026, 12, 1)
        assert tasks[1]["categories"] == ["phone"]
        assert notesvc.task_lines("- [ ]x not a box\n-[ ] no space\n- [y] other\n") == []

    def test_a_task_line_with_a_control_character_is_answered_as_well_formed_xml(self, client):
        icalendar = pytest.importorskip("icalendar")
        import xml.etree.ElementTree as ET

        put_note(client, "notes/home/todo.md", "- [ ] pay\x01 the\x1b rent\n")  # kept as written
        dav = Dav(client, key_of(client))
        answer = dav("REPORT", list_ids(dav)["home"], QUERY_TODOS.format("").encode(), status=207)
        ET.fromstring(answer.body)  # noqa: S314 - our own answer; well-formed, or it raises
        (data_,) = cal_items(answer).values()
        (todo,) = icalendar.Calendar.from_ical(data_).walk("VTODO")
        assert str(todo["SUMMARY"]) == "pay\ufffd the\ufffd rent"

    def test_the_vtodo_is_rfc_5545_folded_escaped_utf8_and_in_utc(self, make_app, root):
        icalendar = pytest.importorskip("icalendar")
        app = make_app(SERVICE_TIMEZONE="Europe/Paris")
        long = "é" * 60 + ", a; b\\c"
        put_note(with_key(app), "notes/home/todo.md", f"- [ ] {long} ⏰ 2026-12-02 09:00 #x\n")
        dav = Dav(app, key_of(app))
        home = list_ids(dav)["home"]
        items = cal_items(dav("REPORT", home, QUERY_TODOS.format("").encode(), status=207))
        (data_,) = items.values()
        raw = data_.encode("utf-8")
        assert all(len(line) <= 75 for line in raw.split(b"\r\n")), raw
        raw.decode("utf-8")  # (no character cut in two by the folding)
        assert b"\\, a\\; b\\\\c" in raw.replace(b"\r\n ", b"")
        cal = icalendar.Calendar.from_ical(raw)
        (todo,) = cal.walk("VTODO")
        assert str(todo["SUMMARY"]) == long
        assert todo["DUE"].dt == dt.datetime(2026, 12, 2, 8, 0, tzinfo=dt.timezone.utc)
        (alarm,) = todo.walk("VALARM")
        assert alarm["TRIGGER"].dt == dt.datetime(2026, 12, 2, 8, 0, tzinfo=dt.timezone.utc)
        assert [str(c) for c in todo["CATEGORIES"].cats] == ["x"]
        assert str(todo["STATUS"]) == "NEEDS-ACTION"
        assert str(todo["DESCRIPTION"]).startswith("todo\nhttp://")
        assert "/#task=" in str(todo["DESCRIPTION"])

    def test_a_task_keeps_its_uid_across_edits_small_edits_and_a_move(self, client, dav, root):
        put_note(client, "notes/home/todo.md", TASKS_NOTE)
        home = list_ids(dav)["home"]

        def uids() -> dict:
            items = cal_items(dav("REPORT", "calendars/all/", QUERY_TODOS.format("").encode()))
            out = {}
            for body in items.values():
                uid = re.search(r"UID:(\S+)", body).group(1)
                summary = re.search(r"SUMMARY:([^\r\n]*)", body).group(1)
                out[summary] = uid
            return out

        before = uids()
        assert len(before) == 5
        assert all(re.fullmatch(r"[A-Za-z0-9-]+", u) for u in before.values())
        text = TASKS_NOTE.replace("# Home\n", "# Home\n\nA new first paragraph.\n")
        text = text.replace("buy milk", "buy oat milk")
        update(client, "notes/home/todo.md", text)
        after = uids()
        assert after["buy oat milk"] == before["buy milk"]
        assert after["call the plumber"] == before["call the plumber"]
        client.patch_json(f"{note_url('notes/home/todo.md')}/move", {"path": "notes/work/todo.md"})
        moved = uids()
        assert moved == after
        # the folder's list followed the note (the id of a folder that holds no tasks now)
        assert list_ids(dav)["work"] == home

    def test_wrong_passwords_on_task_lists_count_toward_the_lockout(self, anon):
        wrong = Dav(anon, "nsk_wrong")
        for i in range(10):
            resp = Dav(anon, f"nsk_wrong{i}")("REPORT", "calendars/all/", sync_body(), status=401)
            assert resp.headers["WWW-Authenticate"].startswith('Basic realm="notesvc"')
        wrong("PROPFIND", "calendars/", status=429, Depth="0")
        Dav(anon, key_of(anon))("PROPFIND", "calendars/", status=429, Depth="0")

    def test_identities_and_sync_tokens_survive_a_restart(self, make_app, root):
        app = make_app()
        client, dav = with_key(app), Dav(app, key_of(app))
        put_note(client, "notes/home/todo.md", TASKS_NOTE)

        def uids(dav: Dav) -> set:
            items = cal_items(dav("REPORT", "calendars/all/", QUERY_TODOS.format("").encode()))
            return {re.search(r"UID:(\S+)", b).group(1) for b in items.values()}

        before = uids(dav)
        update(client, "notes/home/todo.md", TASKS_NOTE.replace("buy milk", "buy oat milk"))
        after_edit = uids(dav)  # (written to the log, not the snapshot)
        assert after_edit == before
        first = dav("REPORT", "calendars/all/", sync_body(), status=207).text
        token = re.search(r"<D:sync-token>([^<]+)</D:sync-token>", first).group(1)
        app.app.service.close()
        assert (root / ".notesvc/caldav.log").stat().st_size > 0
        again = make_app()
        dav2 = Dav(again, key_of(app))
        assert uids(dav2) == before
        quiet = dav2("REPORT", "calendars/all/", sync_body(token), status=207).text
        assert "<D:response>" not in quiet  # the same token: nothing changed

    def test_the_log_of_identities_is_folded_into_the_snapshot(self, make_app, root, monkeypatch):
        monkeypatch.setattr(notesvc.TaskBook, "LOG_LINES", 2)
        app = make_app()
        client, dav = with_key(app), Dav(app, key_of(app))
        put_note(client, "notes/home/todo.md", TASKS_NOTE)
        seen = []
        for n in range(5):
            update(client, "notes/home/todo.md", TASKS_NOTE + f"- [ ] extra {n}\n")
            items = cal_items(dav("REPORT", "calendars/all/", QUERY_TODOS.format("").encode()))
            seen.append(sorted(re.findall(r"UID:(\S+)", "".join(items.values()))))
        log = (root / ".notesvc/caldav.log").read_bytes()
        assert log.count(b"\n") <= 2  # folded every 2 lines
        app.app.service.close()
        again = Dav(make_app(), key_of(app))
        items = cal_items(again("REPORT", "calendars/all/", QUERY_TODOS.format("").encode()))
        assert sorted(re.findall(r"UID:(\S+)", "".join(items.values()))) == seen[-1]

    def test_discovery_from_the_well_known_url(self, anon, dav):
        plain = webtest.TestApp(anon.app, lint=False)
        resp = plain.request("/.well-known/caldav", method="PROPFIND", status=301)
        assert resp.headers["Location"] == "/dav/"
        body = (
            b'<d:propfind xmlns:d="DAV:"><d:prop><d:current-user-principal/></d:prop></d:propfind>'
        )
        root_ = dav("PROPFIND", "", body, status=207, Depth="0").text
        assert "<D:current-user-principal><D:href>/dav/principal/</D:href>" in root_
        listed = dav.hrefs("")
        assert listed == ["/dav/", "/dav/notes/", "/dav/attachments/"]  # no .ics for rclone
        home = dav(
            "PROPFIND",
            "principal/",
            b'<d:propfind xmlns:d="DAV:" xmlns:c="urn:ietf:params:xml:ns:caldav"><d:prop>'
            b"<c:calendar-home-set/></d:prop></d:propfind>",
            status=207,
            Depth="0",
        ).text
        assert "<C:calendar-home-set><D:href>/dav/calendars/</D:href>" in home
        lists = dav("PROPFIND", "calendars/", b"", status=207, Depth="1").text
        assert "<D:displayname>All tasks</D:displayname>" in lists
        assert '<C:comp name="VTODO"/>' in lists
        assert (
            "calendar-access" in plain.request("/dav/calendars/", method="OPTIONS").headers["DAV"]
        )
        dav("MKCALENDAR", "calendars/new/", status=403)
        dav("MKCALENDAR", "notes/new/", status=403)
        assert "supported-report" in dav("REPORT", "notes/", sync_body(), status=403).text
        Dav(anon, "nsk_wrong")("REPORT", "notes/", sync_body(), status=401)
        dav("PROPFIND", "calendars/f-nothing/", status=404, Depth="0")

    def test_sync_collection_after_one_change_returns_that_item_and_a_delete_a_404(
        self, client, dav
    ):
        put_note(client, "notes/home/todo.md", TASKS_NOTE)
        home = list_ids(dav)["home"]
        first = dav("REPORT", home, sync_body(), status=207).text
        assert first.count("<D:response>") == 5
        token = re.search(r"<D:sync-token>([^<]+)</D:sync-token>", first).group(1)
        ctag = re.search(r"<CS:getctag>([^<]+)<", dav("PROPFIND", home, b"", Depth="0").text)
        ticked = TASKS_NOTE.replace("[ ] buy milk", "[x] buy milk")
        update(client, "notes/home/todo.md", ticked)
        again = dav("REPORT", home, sync_body(token), status=207).text
        assert again.count("<D:response>") == 1
        new_token = re.search(r"<D:sync-token>([^<]+)</D:sync-token>", again).group(1)
        assert new_token != token
        assert ctag.group(1) not in dav("PROPFIND", home, b"", Depth="0").text
        update(client, "notes/home/todo.md", ticked.replace("+ [X] water the plants\n", ""))
        gone = dav("REPORT", home, sync_body(new_token), status=207).text
        assert gone.count("<D:response>") == 1
        assert "404 Not Found" in gone
        bad = dav("REPORT", home, sync_body("urn:notesvc:sync:999999"), status=403)
        assert "valid-sync-token" in bad.text

    def test_calendar_query_filters_and_others_are_403_supported_filter(self, client, dav):
        put_note(client, "notes/home/todo.md", TASKS_NOTE)
        home = list_ids(dav)["home"]

        def count(inner: str) -> int:
            return len(cal_items(dav("REPORT", home, QUERY_TODOS.format(inner).encode())))

        open_ = '<c:prop-filter name="STATUS"><c:text-match negate-condition="yes">COMPLETED'
        assert count(open_ + "</c:text-match></c:prop-filter>") == 3
        assert count('<c:prop-filter name="COMPLETED"><c:is-not-defined/></c:prop-filter>') == 3
        milk = '<c:prop-filter name="SUMMARY"><c:text-match>MILK</c:text-match></c:prop-filter>'
        assert count(milk) == 1
        assert count('<c:time-range start="20261202T000000Z" end="20261202T120000Z"/>') == 1
        resp = dav(
            "REPORT",
            home,
            QUERY_TODOS.format(
                '<c:prop-filter name="DESCRIPTION"><c:text-match>x</c:text-match></c:prop-filter>'
            ).encode(),
            status=403,
        )
        assert "<C:supported-filter>" in resp.text

    def test_writes_edit_one_line_as_a_versioned_write(self, client, dav, root):
        put_note(client, "notes/home/todo.md", TASKS_NOTE)
        home = list_ids(dav)["home"]
        items = cal_items(dav("REPORT", home, QUERY_TODOS.format("").encode()))
        href, body = next((h, b) for h, b in items.items() if "buy milk" in b)
        uid = re.search(r"UID:(\S+)", body).group(1)
        item = urllib.parse.unquote(href)[len("/dav/") :]
        etag = dav("GET", item).headers["ETag"]
        done = vtodo(
            uid,
            "SUMMARY:buy milk",
            "STATUS:COMPLETED",
            "DUE;VALUE=DATE:20261203",
            "CATEGORIES:shop",
            "PERCENT-COMPLETE:100",
            "X-APPLE-SORT-ORDER:3",
        )
        resp = dav("PUT", item, done, status=204, If_Match=etag)
        assert resp.headers["ETag"] != etag
        text = (root / "notes/home/todo.md").read_text()
        assert text == TASKS_NOTE.replace("* [ ] buy milk", "* [x] buy milk")  # that line only
        versions = data(client.get(f"{note_url('notes/home/todo.md')}/versions"))["versions"]
        assert versions[0]["reason"] == "caldav"
        dav("PUT", item, done, status=412, If_Match=etag)  # stale
        reopened = done.replace(b"STATUS:COMPLETED", b"STATUS:NEEDS-ACTION")
        dav("PUT", item, reopened, status=204)  # unticked: that line only, as it was
        assert (root / "notes/home/todo.md").read_text() == TASKS_NOTE
        dav("PUT", item, done, status=204)
        moved = vtodo(uid, "SUMMARY:buy oat milk", "STATUS:COMPLETED", "DUE:20261204T090000Z")
        dav("PUT", item, moved, status=204)
        line = (root / "notes/home/todo.md").read_text().split("\n")[4]
        assert line == "* [x] buy oat milk 📅 2026-12-04"
        dav("DELETE", item, status=204)
        assert "oat milk" not in (root / "notes/home/todo.md").read_text()
        dav("GET", item, status=404)
        # a new task goes to the folder's Tasks.md, with the href and UID it was PUT with
        made = vtodo("client-made-1", "SUMMARY:new\\nlines joined", "DUE:20261210T080000Z")
        dav("PUT", f"{home}client-made-1.ics", made, status=201)
        assert "- [ ] new lines joined ⏰ 2026-12-10 " in (root / "notes/home/Tasks.md").read_text()
        got = dav("GET", f"{home}client-made-1.ics").text
        assert "UID:client-made-1" in got
        dav(
            "PUT",
            "calendars/all/inbox-1.ics",
            vtodo("inbox-1", "SUMMARY:for the inbox"),
            status=201,
        )
        assert "- [ ] for the inbox" in (root / "notes/inbox/Tasks.md").read_text()

    def test_a_new_subtask_goes_under_its_parent(self, client, dav, root):
        put_note(client, "notes/home/todo.md", TASKS_NOTE)
        home = list_ids(dav)["home"]
        items = cal_items(dav("REPORT", home, QUERY_TODOS.format("").encode()))
        parent = next(b for b in items.values() if "SUMMARY:call the plumber" in b)
        uid = re.search(r"UID:(\S+)", parent).group(1)
        child = vtodo("sub-1", "SUMMARY:ask about the boiler", f"RELATED-TO;RELTYPE=PARENT:{uid}")
        dav("PUT", f"{home}sub-1.ics", child, status=201)
        lines = (root / "notes/home/todo.md").read_text().split("\n")
        assert lines[2:5] == [
            "- [ ] call the plumber ⏰ 2026-12-02 09:00",
            "  - [x] find the number #phone",
            "  - [ ] ask about the boiler",
        ]
        got = dav("GET", f"{home}sub-1.ics").text
        assert f"RELATED-TO;RELTYPE=PARENT:{uid}" in got
        assert not (root / "notes/home/Tasks.md").exists()

    def test_bad_calendar_objects_are_refused_with_their_precondition(self, client, dav, root):
        put_note(client, "notes/home/todo.md", TASKS_NOTE)
        home = list_ids(dav)["home"]
        item = f"{home}x.ics"
        for body, condition in (
            (b"BEGIN:VCALENDAR\r\nthis is not\r\n", "valid-calendar-data"),
            (b"\xff\xfe", "valid-calendar-data"),
            (vtodo("x", "SUMMARY:weekly", "RRULE:FREQ=WEEKLY"), "valid-calendar-object-resource"),
            (vtodo("x", "SUMMARY:a", "ATTENDEE:mailto:a@b.c"), "valid-calendar-object-resource"),
            (vtodo("x", "STATUS:CANCELLED"), "valid-calendar-object-resource"),
            (
                b"BEGIN:VCALENDAR\r\nBEGIN:VEVENT\r\nUID:e\r\nEND:VEVENT\r\nEND:VCALENDAR\r\n",
                "supported-calendar-component",
            ),
        ):
            resp = dav("PUT", item, body, status=403)
            assert f"<C:{condition}>" in resp.text, (body, resp.text)
            assert "Traceback" not in resp.text
        huge = vtodo("x", "SUMMARY:" + "a" * (10 << 20))
        dav("PUT", item, huge, status=413)
        xxe = (
            b'<?xml version="1.0"?><!DOCTYPE r [<!ENTITY x SYSTEM "file:///etc/passwd">]>'
            b'<d:sync-collection xmlns:d="DAV:">&x;</d:sync-collection>'
        )
        dav("REPORT", home, xxe, status=400)
        dav("REPORT", home, b"<not-xml", status=400)
        # If-Match from another task
        items = cal_items(dav("REPORT", home, QUERY_TODOS.format("").encode()))
        (h1, b1), (h2, _b2) = list(items.items())[:2]
        other = dav("GET", urllib.parse.unquote(h2)[5:]).headers["ETag"]
        uid = re.search(r"UID:(\S+)", b1).group(1)
        dav(
            "PUT", urllib.parse.unquote(h1)[5:], vtodo(uid, "SUMMARY:x"), status=412, If_Match=other
        )
        assert (root / "notes/home/todo.md").read_text() == TASKS_NOTE

    def test_if_match_reads_alike_on_every_surface(self, client, dav):
        """One reading of If-Match (if_match_allows): an ETag without its quotes, in a list
        with an empty item, lets a write through on the notes API, attachments, WebDAV and
        CalDAV alike; a stale one is 412 on each (CalDAV read it its own way)."""

        def loose(etag: str) -> str:
            return f' , "stale", {etag.strip(chr(34))}'

        etag = data(put_note(client, "notes/m.md", "v1"))["etag"]
        url = note_url("notes/m.md")
        client.put_json(url, {"content": "v2"}, headers={"If-Match": '"stale"'}, status=412)
        client.put_json(url, {"content": "v2"}, headers={"If-Match": loose(etag)})
        rec = data(upload(client, "attachments/a.jpg"))
        upload(client, "attachments/a.jpg", b"x", 412, **{"If-Match": '"stale"'})
        upload(client, "attachments/a.jpg", b"new", 200, **{"If-Match": loose(rec["etag"])})
        etag = dav("GET", "notes/m.md").headers["ETag"]  # (Dav answers any status: asked)
        assert dav("PUT", "notes/m.md", b"v3", If_Match='"stale"').status_int == 412
        assert dav("PUT", "notes/m.md", b"v3", If_Match=loose(etag)).status_int == 204
        put_note(client, "notes/home/todo.md", "- [ ] pay the rent\n")
        home = list_ids(dav)["home"]
        ((href, body),) = cal_items(dav("REPORT", home, QUERY_TODOS.format("").encode())).items()
        item, uid = urllib.parse.unquote(href)[5:], re.search(r"UID:(\S+)", body).group(1)
        etag = dav("GET", item).headers["ETag"]
        stale = dav("PUT", item, vtodo(uid, "SUMMARY:x"), If_Match='"stale"')
        assert stale.status_int == 412
        put = dav("PUT", item, vtodo(uid, "SUMMARY:pay the bills"), If_Match=loose(etag))
        assert put.status_int == 204, put.text
        assert data(client.get(note_url("notes/home/todo.md")))["content"] == (
            "- [ ] pay the bills\n"
        )

    def test_folder_grants_see_their_folders_tasks_and_read_keys_write_nothing(
        self, client, dav, root
    ):
        put_note(client, "notes/home/todo.md", TASKS_NOTE)
        put_note(client, "notes/work/todo.md", "- [ ] ship it\n")
        work_key = new_grant(client, "write", folder="notes/work")["key"]
        work = Dav(client, work_key)
        assert set(list_ids(work)) == {"All tasks", "work"}
        home = list_ids(dav)["home"]
        work("PROPFIND", home, status=404, Depth="0")
        work("PUT", f"{home}new.ics", vtodo("n1", "SUMMARY:x"), status=404)
        every = cal_items(work("REPORT", "calendars/all/", QUERY_TODOS.format("").encode()))
        assert len(every) == 1
        # a UID of another folder's task: 403 no-uid-conflict, naming nothing there
        theirs = cal_items(dav("REPORT", home, QUERY_TODOS.format("").encode()))
        uid = re.search(r"UID:(\S+)", next(iter(theirs.values()))).group(1)
        resp = work("PUT", "calendars/all/mine.ics", vtodo(uid, "SUMMARY:x"), status=403)
        assert "<C:no-uid-conflict></C:no-uid-conflict>" in resp.text
        assert "<D:href>" not in resp.text
        work_client = as_key(client, work_key)
        work_client.get(f"{API}/tasks/{uid}", status=404)  # (another folder's task)
        found = data(client.get(f"{API}/tasks/{uid}"))
        assert found["path"] == "notes/home/todo.md"
        assert found["uid"] == uid
        client.get(f"{API}/tasks/nothing-here", status=404)
        work("PUT", "calendars/all/mine.ics", vtodo("mine-1", "SUMMARY:from work"), status=201)
        assert "- [ ] from work" in (root / "notes/work/Tasks.md").read_text()
        reader = Dav(client, new_grant(client, "read")["key"])
        reader("PUT", "calendars/all/r.ics", vtodo("r-1", "SUMMARY:x"), status=403)
        assert reader("REPORT", "calendars/all/", sync_body(), status=207)

    @pytest.mark.slow
    def test_a_feed_serves_the_tasks_as_icalendar_behind_its_own_secret(
        self, client, anon, root, caplog
    ):
        icalendar = pytest.importorskip("icalendar")
        put_note(client, "notes/home/todo.md", TASKS_NOTE)
        put_note(client, "notes/work/todo.md", "- [ ] ship it 📅 2026-12-07\n")
        made = data(client.post_json(f"{API}/auth/feeds", {"name": "Phone"}, status=201))
        secret = re.search(r"/ics/([^/]+)\.ics$", made["url"]).group(1)
        assert made["url"].startswith("http://")
        assert made["hint"] == secret[-4:]
        listed = data(client.get(f"{API}/auth/feeds"))["feeds"]
        assert [f["id"] for f in listed] == [made["id"]]
        assert secret not in json.dumps(listed)
        assert secret not in (root / ".notesvc/state.json").read_text()
        plain = webtest.TestApp(anon.app)
        with caplog.at_level(logging.INFO, logger="notesvc"):
            resp = plain.get(f"/ics/{secret}.ics")
        assert secret not in caplog.text
        assert f"/ics/…{secret[-4:]}" in caplog.text
        assert resp.headers["Content-Type"] == "text/calendar; charset=utf-8"
        assert resp.headers["Cache-Control"].startswith("private")
        assert resp.headers["X-Robots-Tag"].startswith("noindex")
        assert resp.headers["Referrer-Policy"] == "no-referrer"
        cal = icalendar.Calendar.from_ical(resp.body)
        assert len(cal.walk("VTODO")) == 6
        events = {str(e["UID"]): e for e in cal.walk("VEVENT")}
        at = [e for u, e in events.items() if u.endswith("-at")]
        assert [str(e["SUMMARY"]) for e in at] == ["call the plumber"]
        days = sorted(str(e["SUMMARY"]) for u, e in events.items() if u.endswith("-day"))
        assert days == ["buy milk", "pay rent; twice, now", "ship it"]  # open and dated
        assert data(client.get(f"{API}/auth/feeds"))["feeds"][0]["lastUsedAt"]
        # a folder's feed holds that folder's tasks; the secret opens nothing else
        work = data(client.post_json(f"{API}/auth/feeds", {"name": "W", "folder": "notes/work"}))
        work_secret = re.search(r"/ics/([^/]+)\.ics$", work["url"]).group(1)
        only = icalendar.Calendar.from_ical(plain.get(f"/ics/{work_secret}.ics").body)
        assert [str(t["SUMMARY"]) for t in only.walk("VTODO")] == ["ship it"]
        plain.get(f"{API}/notes", headers={KEY: secret}, status=401)
        Dav(anon, secret)("PROPFIND", "calendars/", status=401, Depth="0")
        # deleted: the link is gone; a read key may not make one
        client.delete(f"{API}/auth/feeds/{made['id']}")
        plain.get(f"/ics/{secret}.ics", status=404)
        reader = as_key(client, new_grant(client, "read")["key"])
        reader.post_json(f"{API}/auth/feeds", {"name": "x"}, status=403)

    def test_unknown_feed_secrets_are_404_under_the_per_address_limit(self, anon):
        plain = webtest.TestApp(anon.app)
        statuses = [
            plain.get(f"/ics/{'a' * 31}{i % 10}.ics", expect_errors=True).status_int
            for i in range(12)
        ]
        assert statuses[0] == 404
        assert statuses[-1] == 429

    def test_options_on_dav_the_principal_and_every_task_address_names_calendar_access(self, anon):
        plain = webtest.TestApp(anon.app, lint=False)
        for path in (
            "/dav/",
            "/dav/principal/",
            "/dav/calendars/",
            "/dav/calendars/all/",
            "/dav/calendars/all/x.ics",
            "/dav/calendars/f-nothing/",
        ):
            resp = plain.request(path, method="OPTIONS")
            assert resp.headers["DAV"] == "1, 2, calendar-access", path
        assert plain.request("/dav/notes/", method="OPTIONS").headers["DAV"] == "1, 2"

    def test_unusable_dates_are_ignored_for_their_line_only(self, client, dav):
        tasks = notesvc.task_lines(
            "- [ ] a 📅 9999-12-31\n- [ ] b ⏰ 0001-01-01 00:00\n- [ ] c due:2026-02-30\n"
            "- [ ] d 📅 2026-12-03 ⏰ 0999-12-31 23:00\n"
        )
        assert [t["summary"] for t in tasks] == ["a", "b", "c", "d"]  # each still a task
        assert [t["due"] for t in tasks] == [None, None, None, dt.date(2026, 12, 3)]
        assert [t["wall"] for t in tasks] == [None, None, None, None]
        put_note(client, "notes/home/odd.md", "- [ ] b ⏰ 0001-01-01 00:00\n- [ ] fine\n")
        items = cal_items(dav("REPORT", "calendars/all/", QUERY_TODOS.format("").encode()))
        assert sorted(re.search(r"SUMMARY:(\S+)", b).group(1) for b in items.values()) == [
            "b",
            "fine",
        ]
        assert not any("DUE" in b or "VALARM" in b for b in items.values())

    def test_a_put_with_an_unusable_due_or_an_unknown_zone_is_403_and_logged_clean(
        self, client, dav, root, caplog
    ):
        put_note(client, "notes/home/todo.md", TASKS_NOTE)
        home = list_ids(dav)["home"]
        evil = "\x1b[31mEvil" + "A" * 100_000
        with caplog.at_level(logging.INFO, logger="notesvc"):
            for due in ("DUE:00010101T000000", "DUE:00010101T000000Z", "DUE;VALUE=DATE:99991231"):
                resp = dav("PUT", f"{home}d.ics", vtodo("d-1", "SUMMARY:x", due), status=403)
                assert "<C:valid-calendar-object-resource>" in resp.text, due
            zoned = vtodo("z-1", "SUMMARY:x", f"DUE;TZID={evil}:20261201T090000")
            resp = dav("PUT", f"{home}z.ics", zoned, status=403)
            assert "<C:valid-calendar-data>" in resp.text
            assert "\x1b" not in resp.text
            assert len(resp.text) < 1000
        assert "Traceback" not in caplog.text
        assert "\x1b" not in caplog.text
        assert "A" * 200 not in caplog.text
        assert (root / "notes/home/todo.md").read_text() == TASKS_NOTE
        assert not (root / "notes/home/Tasks.md").exists()
        paris = vtodo("p-1", "SUMMARY:fine", "DUE;TZID=Europe/Paris:20261201T090000")
        dav("PUT", f"{home}p.ics", paris, status=201)  # a zone known by its name is read
        assert "- [ ] fine ⏰ 2026-12-01 08:00" in (root / "notes/home/Tasks.md").read_text()

    def test_a_short_task_dated_by_a_client_or_in_its_note_keeps_its_uid_and_href(
        self, client, dav, root
    ):
        put_note(client, "notes/home/todo.md", "- [ ] milk\n- [ ] eggs\n")
        home = list_ids(dav)["home"]
        first = dav("REPORT", home, sync_body(), status=207).text
        token = re.search(r"<D:sync-token>([^<]+)</D:sync-token>", first).group(1)
        items = cal_items(dav("REPORT", home, QUERY_TODOS.format("").encode()))
        named = {re.search(r"SUMMARY:(\S+)", b).group(1): h for h, b in items.items()}
        uids = {s: re.search(r"UID:(\S+)", items[h]).group(1) for s, h in named.items()}
        milk = urllib.parse.unquote(named["milk"])[len("/dav/") :]
        dated = vtodo(uids["milk"], "SUMMARY:milk", "DUE;VALUE=DATE:20261205")
        dav("PUT", milk, dated, status=204)  # the phone gives it a date
        text = (root / "notes/home/todo.md").read_text()
        assert text == "- [ ] milk 📅 2026-12-05\n- [ ] eggs\n"
        got = dav("GET", milk, status=200).text  # the same item: same href, same UID
        assert f"UID:{uids['milk']}" in got
        assert "DUE;VALUE=DATE:20261205" in got
        changes = dav("REPORT", home, sync_body(token), status=207).text
        assert changes.count("<D:response>") == 1  # changed, not deleted and made again
        assert "404 Not Found" not in changes
        # dated, timed and tagged in the note itself (the web client, an editor): the same
        update(client, "notes/home/todo.md", text.replace("eggs", "eggs ⏰ 2026-12-06 09:00 #shop"))
        eggs = urllib.parse.unquote(named["eggs"])[len("/dav/") :]
        assert f"UID:{uids['eggs']}" in dav("GET", eggs, status=200).text

    def test_a_client_renaming_a_task_to_other_words_keeps_it_one_line(self, client, dav, root):
        put_note(client, "notes/home/todo.md", "# Home\n\n- [ ] buy milk\n- [ ] walk the dog\n")
        home = list_ids(dav)["home"]
        items = cal_items(dav("REPORT", home, QUERY_TODOS.format("").encode()))
        href, body = next((h, b) for h, b in items.items() if "SUMMARY:buy milk" in b)
        uid = re.search(r"UID:(\S+)", body).group(1)
        item = urllib.parse.unquote(href)[len("/dav/") :]
        renamed = vtodo(uid, "SUMMARY:call the bank about the mortgage")
        dav("PUT", item, renamed, status=204)
        assert f"UID:{uid}" in dav("GET", item, status=200).text
        done = vtodo(uid, "SUMMARY:call the bank about the mortgage", "STATUS:COMPLETED")
        dav("PUT", item, done, status=204)  # the same item: its line, not a second one
        assert (root / "notes/home/todo.md").read_text() == (
            "# Home\n\n- [x] call the bank about the mortgage\n- [ ] walk the dog\n"
        )

    def test_a_folder_keys_ctag_and_sync_token_move_only_with_its_own_tasks(self, client, dav):
        put_note(client, "notes/home/todo.md", TASKS_NOTE)
        put_note(client, "notes/work/todo.md", "- [ ] ship it\n- [ ] plan it\n")
        work = Dav(client, new_grant(client, "read", folder="notes/work")["key"])

        def seen(who: Dav) -> dict:
            out = {}
            for path in list_ids(who).values():
                props = who("PROPFIND", path, b"", status=207, Depth="0").text
                out[path] = re.findall(r"<(?:CS:getctag|D:sync-token)>([^<]+)<", props)
            return out

        def token_of(who: Dav, path: str, since: str = "") -> str:
            answer = who("REPORT", path, sync_body(since), status=207).text
            return re.search(r"<D:sync-token>([^<]+)</D:sync-token>", answer).group(1)

        before = seen(work)
        token = token_of(work, "calendars/all/")
        # tasks ticked, removed, added and a note deleted elsewhere: nothing moves here
        update(client, "notes/home/todo.md", TASKS_NOTE.replace("[ ] buy milk", "[x] buy milk"))
        update(client, "notes/home/todo.md", "- [ ] only this\n")
        put_note(client, "notes/home/more.md", "- [ ] another\n")
        client.delete(note_url("notes/home/more.md"))
        assert seen(work) == before
        assert token_of(work, "calendars/all/", token) == token
        # its tokens tell nothing of the others: another key's, or a number, is no token
        theirs = token_of(dav, "calendars/all/")
        seq = int(re.search(r"sync:(\d+)-", token).group(1))
        for made_up in (theirs, f"urn:notesvc:sync:{seq + 1}", "urn:notesvc:sync:999999999"):
            resp = work("REPORT", "calendars/all/", sync_body(made_up), status=403)
            assert "valid-sync-token" in resp.text
        # its own folder's changes move them
        client.put_json(note_url("notes/work/todo.md"), {"content": "- [x] ship it\n"})
        assert seen(work)["calendars/all/"] != before["calendars/all/"]
        changed = work("REPORT", "calendars/all/", sync_body(token), status=207).text
        assert changed.count("<D:response>") == 2  # ticked, and removed
        assert changed.count("404 Not Found") == 1

    def test_a_sync_token_with_digits_other_than_ascii_is_refused(self, client, dav):
        put_note(client, "notes/home/todo.md", TASKS_NOTE)
        first = dav("REPORT", "calendars/all/", sync_body(), status=207).text
        token = re.search(r"<D:sync-token>([^<]+)</D:sync-token>", first).group(1)
        dav("REPORT", "calendars/all/", sync_body(token), status=207)
        arabic = str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩")
        for raw in ("urn:notesvc:sync:٣", "urn:notesvc:sync:３", token.translate(arabic)):
            resp = dav("REPORT", "calendars/all/", sync_body(raw), status=403)
            assert "valid-sync-token" in resp.text

    def test_a_feeds_event_at_a_time_carries_an_alarm_at_its_start(self, client, anon):
        icalendar = pytest.importorskip("icalendar")
        put_note(client, "notes/home/todo.md", TASKS_NOTE)
        made = data(client.post_json(f"{API}/auth/feeds", {"name": "Phone"}, status=201))
        secret = re.search(r"/ics/([^/]+)\.ics$", made["url"]).group(1)
        raw = webtest.TestApp(anon.app).get(f"/ics/{secret}.ics").body
        assert b"TRIGGER;RELATED=START:PT0S" in raw
        events = {str(e["UID"]): e for e in icalendar.Calendar.from_ical(raw).walk("VEVENT")}
        (at,) = [e for uid, e in events.items() if uid.endswith("-at")]
        (alarm,) = at.walk("VALARM")
        assert str(alarm["ACTION"]) == "DISPLAY"
        assert alarm["TRIGGER"].dt == dt.timedelta(0)
        assert str(alarm["DESCRIPTION"]) == "call the plumber"
        assert not any(e.walk("VALARM") for uid, e in events.items() if uid.endswith("-day"))


class TestCalDAVClients:
    """The task lists judged by a real CalDAV client against a real server."""

    pytestmark = [pytest.mark.real_server, pytest.mark.slow]

    def test_the_caldav_library_discovers_reads_completes_creates_edits_deletes_and_syncs(
        self, tmp_path
    ):
        caldav = pytest.importorskip("caldav")
        root = tmp_path / "root"
        with running(root) as server, contextlib.ExitStack() as stack:
            key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]
            name = new_grant_on(server, key, "phone")
            body = {"path": "notes/home/todo.md", "content": TASKS_NOTE}
            assert server.request("POST", f"{API}/notes", body, {KEY: key})[0] == 201
            client = caldav.DAVClient(
                url=f"{server.url}/.well-known/caldav", username="me", password=name["key"]
            )
            stack.enter_context(client)  # (its connections closed at the end)
            lists = {c.get_display_name(): c for c in client.principal().calendars()}
            assert set(lists) == {"All tasks", "home"}
            home = lists["home"]
            todos = home.todos(include_completed=True)
            assert sorted(str(t.icalendar_component["SUMMARY"]) for t in todos) == [
                "buy milk",
                "call the plumber",
                "find the number",
                "pay rent; twice, now",
                "water the plants",
            ]
            assert len(home.todos()) == 3
            token = home.objects_by_sync_token(load_objects=False).sync_token
            milk = next(t for t in home.todos() if "milk" in str(t.icalendar_component["SUMMARY"]))
            milk.complete()
            text = (root / "notes/home/todo.md").read_text()
            assert text == TASKS_NOTE.replace("* [ ] buy milk", "* [x] buy milk")
            path = urllib.parse.quote("notes/home/todo.md", safe="")
            versions = server.request("GET", f"{API}/notes/{path}/versions", None, {KEY: key})
            assert versions[2]["data"]["versions"][0]["savedBy"] == "phone"
            changed = list(home.objects_by_sync_token(sync_token=token, load_objects=True))
            assert len(changed) == 1
            made = home.save_todo(summary="water the fern", due=dt.date(2026, 12, 5))
            assert (
                "- [ ] water the fern 📅 2026-12-05" in (root / "notes/home/Tasks.md").read_text()
            )
            again = home.todo_by_uid(str(made.icalendar_component["UID"]))
            again.icalendar_component.pop("DUE")
            again.icalendar_component.add("DUE", dt.date(2026, 12, 9))
            again.save()
            assert "water the fern 📅 2026-12-09" in (root / "notes/home/Tasks.md").read_text()
            again.delete()
            assert "fern" not in (root / "notes/home/Tasks.md").read_text()
            assert not any("Traceback" in line for line in server.lines)

    def test_the_caldav_library_and_a_feed_through_a_relays_per_server_origin(
        self, origins, tmp_path
    ):
        caldav = pytest.importorskip("caldav")
        with contextlib.ExitStack() as stack:
            self.through_a_relay(caldav, stack, origins, tmp_path)

    @staticmethod
    def through_a_relay(caldav, stack, origins, tmp_path) -> None:
        relay, server, setup, origin = origins
        key = setup["apiKey"]
        body = {"path": "notes/home/todo.md", "content": TASKS_NOTE}
        assert server.request("POST", f"{API}/notes", body, {KEY: key})[0] == 201
        client = caldav.DAVClient(
            url=f"{origin}/.well-known/caldav", username="me", password=key, proxy=relay.url
        )
        stack.enter_context(client)  # (its connections closed at the end)
        lists = {c.get_display_name(): c for c in client.principal().calendars()}
        home = lists["home"]
        token = home.objects_by_sync_token(load_objects=False).sync_token
        assert len(home.todos()) == 3  # a REPORT through the relay
        milk = next(t for t in home.todos() if "milk" in str(t.icalendar_component["SUMMARY"]))
        milk.complete()
        assert "* [x] buy milk" in (tmp_path / "srv/notes/home/todo.md").read_text()
        assert len(list(home.objects_by_sync_token(sync_token=token, load_objects=True))) == 1
        feed = server.request("POST", f"{API}/auth/feeds", {"name": "G"}, {KEY: key})[2]["data"]
        assert feed["url"].startswith(origin + "/ics/")
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": relay.url}))
        with opener.open(feed["url"], timeout=20) as resp:
            assert resp.headers["Content-Type"] == "text/calendar; charset=utf-8"
            assert b"SUMMARY:buy milk" in resp.read()
        secret = feed["url"].rsplit("/", 1)[1][: -len(".ics")]
        # and on the relay's own host, under /r/<serverId>/
        path_based = f"{relay.url}/r/{setup['serverId']}/ics/{secret}.ics"
        with urllib.request.urlopen(path_based, timeout=20) as resp:
            assert resp.headers["Content-Type"] == "text/calendar; charset=utf-8"
            assert b"SUMMARY:buy milk" in resp.read()
        assert not any(secret in line for line in relay.lines + server.lines)

    def test_vdirsyncer_syncs_a_task_list_both_ways_and_a_second_sync_converges(self, tmp_path):
        if not VDIRSYNCER:
            pytest.skip("no vdirsyncer on this machine (Debian: apt install vdirsyncer)")
        root = tmp_path / "root"
        with running(root) as server:
            key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]
            content = "# Home\n\n- [ ] call the plumber 📅 2026-12-02\n- [ ] buy milk\n"
            body = {"path": "notes/home/todo.md", "content": content}
            assert server.request("POST", f"{API}/notes", body, {KEY: key})[0] == 201
            req = urllib.request.Request(
                f"{server.url}/dav/calendars/",
                method="PROPFIND",
                headers={"Authorization": basic(key), "Depth": "1"},
            )
            with urllib.request.urlopen(req, timeout=10) as resp:
                (list_id,) = re.findall(r"/dav/calendars/(f-[0-9a-f]+)/<", resp.read().decode())
            local = tmp_path / "cal"
            config = tmp_path / "vdirsyncer.conf"
            config.write_text(
                f'[general]\nstatus_path = "{tmp_path}/status/"\n\n'
                f'[pair tasks]\na = "mine"\nb = "server"\ncollections = ["{list_id}"]\n\n'
                f'[storage mine]\ntype = "filesystem"\npath = "{local}/"\nfileext = ".ics"\n\n'
                f'[storage server]\ntype = "caldav"\nurl = "{server.url}/"\n'
                f'username = "me"\npassword = "{key}"\nitem_types = ["VTODO"]\n'
            )

            def vdirsyncer(*args: str) -> str:
                done = subprocess.run(
                    [VDIRSYNCER, "-c", str(config), *args],
                    input="y\n" * 5,
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                assert done.returncode == 0, done.stdout + done.stderr
                return done.stdout + done.stderr

            vdirsyncer("discover")
            vdirsyncer("sync")
            files = {f.read_text(): f for f in (local / list_id).glob("*.ics")}
            assert len(files) == 2
            milk = next(f for text, f in files.items() if "SUMMARY:buy milk" in text)
            plumber = next(f for text, f in files.items() if "plumber" in text)
            # an edit on each side: ticked here, a new date on the server
            milk.write_text(milk.read_text().replace("NEEDS-ACTION", "COMPLETED"))
            path = urllib.parse.quote("notes/home/todo.md", safe="")
            edit = {"content": content.replace("2026-12-02", "2026-12-09")}
            assert server.request("PUT", f"{API}/notes/{path}", edit, {KEY: key})[0] == 200
            vdirsyncer("sync")
            text = (root / "notes/home/todo.md").read_text()
            assert text == "# Home\n\n- [ ] call the plumber 📅 2026-12-09\n- [x] buy milk\n"
            assert "DUE;VALUE=DATE:20261209" in plumber.read_text()
            quiet = vdirsyncer("sync")  # converged: nothing to copy either way
            assert not re.search(r"Copying|Updating|Deleting", quiet), quiet
            assert not any("Traceback" in line for line in server.lines)

    def test_khal_imports_the_feed(self, tmp_path):
        if not KHAL:
            pytest.skip("no khal on this machine (Debian: apt install khal)")
        with running(tmp_path / "root", env={"SERVICE_TIMEZONE": "UTC"}) as server:
            key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]
            body = {"path": "notes/home/todo.md", "content": TASKS_NOTE}
            assert server.request("POST", f"{API}/notes", body, {KEY: key})[0] == 201
            made = server.request("POST", f"{API}/auth/feeds", {"name": "Phone"}, {KEY: key})
            with urllib.request.urlopen(made[2]["data"]["url"], timeout=10) as resp:
                (tmp_path / "feed.ics").write_bytes(resp.read())
        (tmp_path / "cal").mkdir()
        (tmp_path / "khal.conf").write_text(
            f"[calendars]\n[[tasks]]\npath = {tmp_path}/cal/\n"
            "[locale]\ntimeformat = %H:%M\ndateformat = %Y-%m-%d\n"
            "longdateformat = %Y-%m-%d\ndatetimeformat = %Y-%m-%d %H:%M\n"
            "longdatetimeformat = %Y-%m-%d %H:%M\ndefault_timezone = UTC\nlocal_timezone = UTC\n"
            f"[sqlite]\npath = {tmp_path}/khal.db\n"
        )

        def khal(*args: str) -> str:
            cmd = [KHAL, "-c", str(tmp_path / "khal.conf"), *args]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stdout + done.stderr
            return done.stdout

        khal("import", "--batch", "-a", "tasks", str(tmp_path / "feed.ics"))
        listed = khal("list", "2026-12-01", "2026-12-10")
        assert "09:00-09:15 call the plumber" in listed  # the ⏰ time (SERVICE_TIMEZONE: UTC)
        assert "buy milk" in listed
        assert "pay rent; twice, now" in listed
        assert "water the plants" not in listed  # done: no all-day event

    def test_a_flood_of_reports_from_one_key_leaves_the_owner_answered_within_a_second(
        self, tmp_path
    ):
        with running(tmp_path / "root") as server:
            key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]
            for n in range(20):
                tasks = "".join(f"- [ ] task {n}.{i}\n" for i in range(10))
                body = {"path": f"notes/home/t{n}.md", "content": tasks}
                assert server.request("POST", f"{API}/notes", body, {KEY: key})[0] == 201
            phone = basic(new_grant_on(server, key, "phone")["key"])
            first = urllib.request.Request(
                f"{server.url}/dav/calendars/all/",
                sync_body(),
                {"Authorization": phone, "Content-Type": "application/xml"},
                method="REPORT",
            )
            with urllib.request.urlopen(first, timeout=10) as resp:
                token = re.search(r"<D:sync-token>([^<]+)<", resp.read().decode()).group(1)
            report = sync_body(token)  # (a token of its own: tokens are per key and list)
            until = time.monotonic() + 3
            answered: list = []

            def flood() -> None:
                conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
                headers = {"Authorization": phone, "Content-Type": "application/xml"}
                while time.monotonic() < until:
                    conn.request("REPORT", "/dav/calendars/all/", report, headers)
                    resp = conn.getresponse()
                    resp.read()
                    answered.append(resp.status)
                conn.close()

            threads = [threading.Thread(target=flood) for _ in range(8)]
            for t in threads:
                t.start()
            waits = []
            while time.monotonic() < until:
                started = time.monotonic()
                assert server.request("GET", f"{API}/notes", None, {KEY: key})[0] == 200
                waits.append(time.monotonic() - started)
                time.sleep(0.1)
            for t in threads:
                t.join()
            assert set(answered) == {207}
            assert len(answered) > 300  # (about 1,200 a second on a CI machine)
            assert max(waits) < 1.0, waits


def cal_call(server: Server, key: str, method: str, path: str, body: bytes = b"", **headers):
    """Return (status, text) of one CalDAV request to a real server (the key as Basic's
    password; header names with `_` for `-`)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        sent = {"Authorization": basic(key), **{k.replace("_", "-"): v for k, v in headers.items()}}
        conn.request(method, path, body, sent)
        resp = conn.getresponse()
        return resp.status, resp.read().decode("utf-8", "replace")
    finally:
        conn.close()


def server_cpu(server: Server) -> float:
    """Seconds of CPU a server process has used (user and system, from /proc)."""
    fields = Path(f"/proc/{server.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


TASK_WORDS = "apple bread call dentist email fix garden house invoice jam kettle laundry".split()


def random_tasks(seed: int, count: int) -> str:
    """`count` task lines of six words from TASK_WORDS and a number (about 45 bytes each)."""
    rnd = random.Random(seed)
    return "".join(
        f"- [ ] {' '.join(rnd.choice(TASK_WORDS) for _ in range(6))} {i}\n" for i in range(count)
    )


class TestCalDAVLimits:
    """What one task line, one client or one key can make the tasks, the feed and the
    reminders cost, against a real server (issue 50's T1, T2, T3, T12)."""

    pytestmark = [pytest.mark.real_server, pytest.mark.slow]

    def test_unusable_dates_are_ignored_for_their_line_and_stop_no_feed_list_or_reminder(
        self, tmp_path, upstream
    ):
        env = {"SERVICE_TELEGRAM_API_BASE": upstream.url}  # (the system's time zone)
        with running(tmp_path / "root", env=env) as server:
            key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]
            owner = {KEY: key}
            channel = {
                "provider": "telegram",
                "config": {
                    **MINIMAL_CONFIG["telegram"],
                    "allowedChatIds": [42],
                    "mode": "webhook",
                    "notify": True,
                },
            }
            assert server.request("POST", f"{API}/channels", channel, owner)[0] == 201
            feed = server.request("POST", f"{API}/auth/feeds", {"name": "G"}, owner)[2]["data"]
            odd = (
                "# Odd\n\n- [ ] a 📅 9999-12-31\n- [ ] b ⏰ 0001-01-01 00:00\n"
                "- [ ] c ⏰ 9999-12-31 23:59\n- [ ] d 📅 2026-12-03\n"
            )
            body = {"path": "notes/home/odd.md", "content": odd}
            assert server.request("POST", f"{API}/notes", body, owner)[0] == 201

            def listed() -> str:
                status, text = cal_call(server, key, "PROPFIND", "/dav/calendars/all/", Depth="1")
                assert status == 207, text
                return text

            assert listed().count("<D:response>") == 5  # the list and its 4 tasks
            with urllib.request.urlopen(feed["url"], timeout=10) as resp:
                ics = resp.read().decode()
            assert ics.count("BEGIN:VTODO") == 4
            assert ics.count("DUE") == 1  # d's; the others are tasks without their date
            assert "DTSTART;VALUE=DATE:20261203" in ics
            assert server.request("GET", f"{API}/reminders", None, owner)[0] == 200
            # what comes later is still seen: the book kept nothing it didn't finish
            body = {"path": "notes/home/later.md", "content": "- [ ] later task\n"}
            assert server.request("POST", f"{API}/notes", body, owner)[0] == 201
            assert listed().count("<D:response>") == 6
            # and the reminders still go out
            now = wait_for(lambda: (n := dt.datetime.now()).second < 55 and n, timeout=10)
            body = {"path": "notes/home/now.md", "content": f"- stretch ⏰ {now:%Y-%m-%d %H:%M}\n"}
            assert server.request("POST", f"{API}/notes", body, owner)[0] == 201
            wait_for(lambda: any("stretch" in t for t in upstream.sent()), timeout=15)
            assert not any("Traceback" in line for line in server.lines)

    def test_replacing_600_task_lines_leaves_health_and_caldav_answered_fast(self, tmp_path):
        with running(tmp_path / "root") as server:
            key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]
            body = {"path": "notes/home/todo.md", "content": random_tasks(1, 600)}
            assert server.request("POST", f"{API}/notes", body, {KEY: key})[0] == 201
            assert cal_call(server, key, "PROPFIND", "/dav/calendars/all/", Depth="1")[0] == 207
            before = server_cpu(server)
            replaced = {"content": random_tasks(2, 600)}  # every line another (28 KB)
            path = note_url("notes/home/todo.md")
            assert server.request("PUT", path, replaced, {KEY: key})[0] == 200
            answered: list = []

            def phone() -> None:
                status, text = cal_call(server, key, "PROPFIND", "/dav/calendars/all/", Depth="1")
                answered.append((status, text.count("<D:response>")))

            phones = [threading.Thread(target=phone) for _ in range(9)]
            for t in phones:
                t.start()
            health = [timed_health(server.port)]
            while any(t.is_alive() for t in phones):
                health.append(timed_health(server.port))
            for t in phones:
                t.join()
            used = server_cpu(server) - before
            assert answered == [(207, 601)] * 9
            assert {status for status, _ in health} == {200}
            assert max(seconds for _, seconds in health) < 1.0, health
            assert used < 5.0  # (each line compared with each: 14 s here, 40 s in the report)

    def test_caldav_writes_stop_at_a_notes_size_limit_and_keep_history_bounded(self, tmp_path):
        limit = 32768
        env = {"SERVICE_MAX_BODY_BYTES": str(limit)}
        root = tmp_path / "root"
        with running(root, env=env) as server:
            key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]
            body = {"path": "notes/home/todo.md", "content": "- [ ] first\n"}
            assert server.request("POST", f"{API}/notes", body, {KEY: key})[0] == 201
            _, lists = cal_call(server, key, "PROPFIND", "/dav/calendars/", Depth="1")
            (home,) = re.findall(r"<D:href>(/dav/calendars/f-[0-9a-f]+/)</D:href>", lists)
            ical = {"Content-Type": "text/calendar"}
            long = vtodo("long-1", "SUMMARY:" + "a" * 5000)  # one property past its bound
            status, text = cal_call(server, key, "PUT", f"{home}long-1.ics", long, **ical)
            assert status == 403
            assert "<C:valid-calendar-object-resource>" in text
            made = 0
            for n in range(100):
                item = vtodo(f"t-{n}", f"SUMMARY:task {n} " + "x" * 990)
                status, text = cal_call(server, key, "PUT", f"{home}t-{n}.ics", item, **ical)
                if status != 201:
                    break
                made += 1
            assert status == 507, text
            assert "<D:quota-not-exceeded>" in text
            assert "SERVICE_MAX_BODY_BYTES" in text
            assert 25 <= made <= 32
            note = root / "notes/home/Tasks.md"
            size = note.stat().st_size
            assert size <= limit
            # a write that doesn't grow the note is still taken
            done = vtodo("t-0", "SUMMARY:task 0 " + "x" * 990, "STATUS:COMPLETED")
            status, _ = cal_call(server, key, "PUT", f"{home}t-0.ics", done, **ical)
            assert status == 204
            assert note.stat().st_size == size
            # each write kept the note it replaced, as any write does: no version over the limit
            path = note_url("notes/home/Tasks.md")
            versions = server.request("GET", f"{path}/versions?limit=200", None, {KEY: key})
            kept = versions[2]["data"]["versions"]
            assert len(kept) == made  # (the first write made the note)
            assert {v["reason"] for v in kept} == {"caldav"}
            assert max(v["size"] for v in kept) <= limit
            assert sum(v["size"] for v in kept) <= made * limit // 2 + limit
            assert not any("Traceback" in line for line in server.lines)

    def test_a_calendar_multiget_is_bounded_and_finds_each_item_without_a_scan(self, tmp_path):
        with running(tmp_path / "root") as server:
            key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]
            body = {"path": "notes/home/todo.md", "content": random_tasks(3, 3000)}
            assert server.request("POST", f"{API}/notes", body, {KEY: key})[0] == 201
            status, listed = cal_call(server, key, "PROPFIND", "/dav/calendars/all/", Depth="1")
            assert status == 207
            known = re.findall(r"<D:href>(/dav/calendars/all/[^<]+\.ics)</D:href>", listed)
            assert len(known) == 3000

            def multiget(hrefs: list) -> tuple:
                names = "".join(f"<d:href>{h}</d:href>" for h in hrefs)
                report = (
                    f'<c:calendar-multiget xmlns:d="DAV:" xmlns:c="{CAL}">'
                    f"<d:prop><d:getetag/></d:prop>{names}</c:calendar-multiget>"
                ).encode()
                return cal_call(server, key, "REPORT", "/dav/calendars/all/", report)

            unknown = [f"/dav/calendars/all/nothing-{i}.ics" for i in range(990)]
            before = server_cpu(server)
            status, text = multiget(unknown + known[:10])
            used = server_cpu(server) - before
            assert status == 207
            assert text.count("404 Not Found") == 990
            assert text.count("<D:getetag>") == 10
            assert used < 0.1  # (a scan of every task for each unknown name: 0.18 s; now 0.01)
            status, text = multiget(unknown * 8)
            assert status == 403
            assert "number-of-matches-within-limits" in text


def new_grant_on(server: Server, key: str, name: str) -> dict:
    body = {"name": name, "scope": "write"}
    status, _, answer = server.request("POST", f"{API}/auth/keys", body, {KEY: key})
    assert status == 201
    return answer["data"]
