"""Reminders sent through the channels (src/notesvc/providers/reminders.py)."""

from __future__ import annotations

import array
import datetime as dt
import json
import os
import stat
import types

import pytest

from conftest import API, data, note_url, notesvc, patch_global, put_note, wait_for, with_key
from standins import MINIMAL_CONFIG


def at(text: str, zone: str = "Europe/Paris") -> float:
    return notesvc.timestamp_of(
        notesvc.dt.datetime.strptime(text, "%Y-%m-%d %H:%M"), notesvc.time_zone(zone)
    )


class FakeClock:
    """An injectable clock for the reminder scheduler."""

    def __init__(self, when: float):
        self.now = when

    def __call__(self) -> float:
        return self.now


class TestReminders:
    @pytest.fixture
    def client(self, make_app, upstream):
        client = with_key(
            make_app(SERVICE_TELEGRAM_API_BASE=upstream.url, SERVICE_TIMEZONE="Europe/Paris")
        )
        body = {
            "provider": "telegram",
            "config": {
                **MINIMAL_CONFIG["telegram"],
                "allowedChatIds": [42],
                "mode": "webhook",
                "notify": True,
            },
        }
        client.post_json(f"{API}/channels", body, status=201)
        return client

    def scheduler(self, client, when: str):
        """Give the app a scheduler on a clock the test sets (ticked by the test itself)."""
        svc = client.app.service
        svc.reminders.close()
        svc.notes.after.remove(svc.reminders._note_changed)
        svc.reminders = notesvc.ReminderScheduler(svc, clock=FakeClock(at(when)))
        svc.notes.after.append(svc.reminders._note_changed)  # as start() does, without its thread
        return svc.reminders

    @staticmethod
    def reads(svc) -> list:
        """Spy on the index's reads of note files: the list of paths read from now on."""
        read, index_read = [], svc.index._read
        svc.index._read = lambda path, *a: read.append(path) or index_read(path, *a)
        return read

    def reminders_sent(self, upstream) -> list:
        return [t for t in upstream.sent() if t.startswith("⏰")]

    def test_a_reminder_fires_once_at_its_time(self, client, upstream):
        put_note(client, "notes/plans.md", "# Plans\n\n- dentist ⏰ 2031-01-06 09:00\n")
        listed = data(client.get(f"{API}/reminders"))
        assert listed["timeZone"] == "Europe/Paris"
        assert listed["total"] == 1
        (item,) = listed["reminders"]
        assert item["path"] == "notes/plans.md"
        assert item["title"] == "Plans"
        assert item["line"] == "- dentist ⏰ 2031-01-06 09:00"
        assert item["local"] == "2031-01-06 09:00"
        assert item["due"] == "2031-01-06T08:00:00.000Z"  # Paris is UTC+1 in January
        sched = self.scheduler(client, "2031-01-06 08:59")
        assert 59 < sched.tick() <= 60
        assert self.reminders_sent(upstream) == []
        sched.clock.now = at("2031-01-06 09:00") + 1
        sched.tick()
        assert self.reminders_sent(upstream) == [
            "⏰ Reminder (2031-01-06 09:00): Plans\n- dentist ⏰ 2031-01-06 09:00\nnotes/plans.md"
        ]
        assert upstream.requests[-1]["json"]["chat_id"] == "42"
        sched.tick()
        sched.clock.now += 3600
        sched.tick()
        assert len(self.reminders_sent(upstream)) == 1
        assert data(client.get(f"{API}/reminders"))["total"] == 0
        saved = client.app.service.config.state_dir / "reminders.json"
        assert stat.S_IMODE(os.stat(saved).st_mode) == 0o600

    def test_not_again_after_a_restart_and_a_missed_one_fires_late(
        self, client, upstream, make_app, root
    ):
        put_note(
            client,
            "notes/plans.md",
            "# Plans\n\n- dentist ⏰ 2031-01-06 09:00\n- call Ada ⏰ 2031-01-06 10:00\n",
        )
        sched = self.scheduler(client, "2031-01-06 09:00")
        sched.tick()
        assert len(self.reminders_sent(upstream)) == 1
        client.app.service.close()  # the server goes down before 10:00
        again = with_key(
            make_app(SERVICE_TELEGRAM_API_BASE=upstream.url, SERVICE_TIMEZONE="Europe/Paris")
        )
        later = self.scheduler(again, "2031-01-06 10:30")
        later.tick()
        sent = self.reminders_sent(upstream)
        assert len(sent) == 2  # the dentist not again; Ada late
        assert sent[-1].startswith("⏰ Late reminder (2031-01-06 10:00): Plans\n- call Ada")

    def test_one_written_after_its_time_is_not_sent(self, client, upstream):
        put_note(client, "notes/log.md", "# Log\n\n- done ⏰ 2031-01-06 07:00\n")
        sched = self.scheduler(client, "2031-01-06 09:00")
        sched.tick()
        assert self.reminders_sent(upstream) == []
        sched.clock.now += 3600
        sched.tick()
        assert self.reminders_sent(upstream) == []

    def test_editing_or_deleting_the_line_cancels_it(self, client, upstream):
        put_note(client, "notes/a.md", "- a ⏰ 2031-01-06 09:00\n")
        put_note(client, "notes/b.md", "- b ⏰ 2031-01-06 09:00\n")
        sched = self.scheduler(client, "2031-01-06 08:00")
        sched.tick()
        client.put_json(note_url("notes/a.md"), {"content": "- a ⏰ 2031-01-06 11:00\n"})
        client.delete(note_url("notes/b.md"))
        sched.clock.now = at("2031-01-06 09:01")
        sched.tick()
        assert self.reminders_sent(upstream) == []
        sched.clock.now = at("2031-01-06 11:00")
        sched.tick()
        assert len(self.reminders_sent(upstream)) == 1
        assert "- a ⏰ 2031-01-06 11:00" in self.reminders_sent(upstream)[0]

    def test_only_the_notes_that_changed_are_read_again(self, client, upstream, root, monkeypatch):
        """(Notes written just now are read at every look while RACY_SECONDS old: here every
        key is remembered at once; test_a_second_save_in_the_same_clock_tick... tests that.)"""
        monkeypatch.setattr(notesvc.ReadCache, "RACY_SECONDS", 0.0)
        svc = client.app.service
        for i in range(30):
            put_note(client, f"notes/n{i:02}.md", f"# N{i}\n\nplain note {i}\n")
        put_note(client, "notes/a.md", "- a ⏰ 2031-01-06 09:00\n")
        sched = self.scheduler(client, "2031-01-06 08:00")
        read = self.reads(svc)
        sched.tick()
        assert len(read) == 31  # the first look reads every note
        del read[:]
        sched.tick()
        assert read == []  # nothing changed: nothing read
        client.put_json(note_url("notes/n05.md"), {"content": "# N5\n\n- b ⏰ 2031-01-06 10:00\n"})
        client.patch_json(note_url("notes/a.md") + "/move", {"path": "notes/moved/a.md"})
        (root / "notes" / "n07.md").write_text("- c ⏰ 2031-01-06 11:00\n")
        svc.sync_index()  # an edit by another program, as the rescan finds it
        client.delete(note_url("notes/n09.md"))
        del read[:]  # (the index reads a moved note too)
        sched.tick()
        assert sorted(read) == ["notes/moved/a.md", "notes/n05.md", "notes/n07.md"]
        assert [(r["path"], r["wall"]) for r in sched.upcoming()] == [
            ("notes/moved/a.md", "2031-01-06 09:00"),
            ("notes/n05.md", "2031-01-06 10:00"),
            ("notes/n07.md", "2031-01-06 11:00"),
        ]
        client.put_json(note_url("notes/n05.md"), {"content": "# N5\n\nno reminder now\n"})
        client.delete(note_url("notes/moved/a.md"))
        sched.clock.now = at("2031-01-06 12:00")
        sched.tick()
        sent = self.reminders_sent(upstream)
        (only,) = sent
        assert "- c ⏰ 2031-01-06 11:00" in only

    def test_a_save_through_the_api_reads_that_note_only(self, client, upstream):
        """Not every note's key after each save: that much Python holding the GIL made each
        of a PUT's system calls wait (PUTs per second 6 times fewer at 10,000 notes)."""
        svc = client.app.service
        for i in range(20):
            put_note(client, f"notes/n{i:02}.md", f"plain note {i}\n")
        sched = self.scheduler(client, "2031-01-06 08:00")
        sched.tick()
        looks, note_keys = [], svc.index.note_keys
        svc.index.note_keys = lambda: looks.append(1) or note_keys()
        read = self.reads(svc)
        client.put_json(note_url("notes/n03.md"), {"content": "- n ⏰ 2031-01-06 09:00\n"})
        sched.tick()
        assert read == ["notes/n03.md"]
        assert looks == []
        assert [r["path"] for r in sched.upcoming()] == ["notes/n03.md"]

    def test_an_edit_that_kept_size_and_mtime_is_read_again(self, client, upstream, root):
        """A clock that ticks coarsely: the edit leaves the file's size and mtime as they
        were, and the scheduler looks at the notes between the index taking the edit and
        the write's hook (which runs once the note's lock is let go)."""
        svc = client.app.service
        put_note(client, "notes/a.md", "- a ⏰ 2031-01-06 09:00\n")
        sched = self.scheduler(client, "2031-01-06 08:00")
        sched.tick()
        note = root / "notes" / "a.md"
        st = note.stat()
        note.write_text("- a ⏰ 2031-01-06 10:00\n")  # the same size
        os.utime(note, ns=(st.st_atime_ns, st.st_mtime_ns))  # in the same clock tick
        svc.index.add("notes/a.md", note.read_text(), st.st_size, st.st_mtime_ns)
        sched.tick()  # the index changed, the note's key did not
        sched._note_changed("saved", "notes/a.md")  # the write's hook, afterwards
        sched.tick()
        assert [r["wall"] for r in sched.upcoming()] == ["2031-01-06 10:00"]

    def test_while_the_index_reads_many_notes_in_the_loop_waits_to_look(
        self, client, upstream, root
    ):
        svc = client.app.service
        put_note(client, "notes/a.md", "- a ⏰ 2031-01-06 09:00\n")
        sched = self.scheduler(client, "2031-01-06 08:00")
        sched.tick()
        for i in range(80):  # a restored backup: more than a rescan reads one by one
            (root / "notes" / f"r{i:02}.md").write_text(f"- r{i} ⏰ 2031-01-06 09:00\n")
        seen = []
        bulk_add = svc.index.bulk_add
        svc.index.bulk_add = lambda *a: seen.append(svc.index.reading) or bulk_add(*a)
        assert svc.index.reading is False
        svc.sync_index()
        assert seen
        assert all(seen)  # what the loop asks before it looks
        sched.clock.now = at("2031-01-06 09:00")
        sched.tick(refresh=False)  # from the notes as last looked at
        assert len(self.reminders_sent(upstream)) == 1
        sched.tick()
        assert len(self.reminders_sent(upstream)) == 81

    def test_while_the_index_reads_notes_in_a_deleted_note_is_cancelled_and_none_lost(
        self, client, upstream
    ):
        svc = client.app.service
        put_note(client, "notes/a.md", "- a ⏰ 2031-01-06 09:00\n")
        put_note(client, "notes/b.md", "- b ⏰ 2031-01-06 09:00\n")
        sched = self.scheduler(client, "2031-01-06 08:00")
        sched.tick()
        booked = json.loads(sched.path.read_text())["scheduled"]
        assert len(booked) == 2
        client.delete(note_url("notes/a.md"))
        # A scheduler that looks while the index is read in (a first build, a discarded
        # index) sees few notes or none: it cancels nothing it has not seen gone
        again = self.scheduler(client, "2031-01-06 08:00")
        svc.index._bulks += 1
        try:
            again.tick(refresh=not svc.index.reading)
        finally:
            svc.index._bulks -= 1
        assert json.loads(again.path.read_text())["scheduled"] == booked
        sched = self.scheduler(client, "2031-01-06 08:00")
        sched.tick()
        client.delete(note_url("notes/b.md"))
        sched.clock.now = at("2031-01-06 09:00")
        sched.tick(refresh=False)  # the deleted note is read again even so
        assert self.reminders_sent(upstream) == []

    @pytest.mark.parametrize("width", [64, 32])
    def test_note_keys_are_64_bits_where_str_hashes_have_32(self, monkeypatch, width):
        info = types.SimpleNamespace(width=width)
        patch_global(monkeypatch, "sys", types.SimpleNamespace(hash_info=info))
        key = notesvc._note_key
        keys = [key(f"notes/{i}.md", (10, 7)) for i in range(2000)]
        keys += [key("notes/0.md", (11, 7)), key("notes/0.md", (10, 8))]
        assert len(set(keys)) == len(keys)
        assert key("notes/0.md", (10, 7)) == keys[0]
        assert array.array("q", keys)  # each fits the 8 bytes it is kept in

    def test_front_matter_and_only_notifying_channels(self, client, upstream):
        body = {
            "provider": "whatsapp",
            "config": {**MINIMAL_CONFIG["whatsapp"], "allowedNumbers": ["15551234567"]},
        }
        client.post_json(f"{API}/channels", body, status=201)  # notify is off
        put_note(
            client, "notes/trip.md", "---\ntitle: Trip\nremind: 2031-01-06 12:30\n---\n# Trip\n"
        )
        put_note(client, "notes/bad.md", "- never ⏰ 2031-02-30 09:00 and ⏰ 2031-01-06 25:00\n")
        assert [r["local"] for r in data(client.get(f"{API}/reminders"))["reminders"]] == [
            "2031-01-06 12:30"
        ]
        sched = self.scheduler(client, "2031-01-06 12:30")
        sched.tick()
        (sent,) = self.reminders_sent(upstream)
        assert "Trip\nremind: 2031-01-06 12:30\nnotes/trip.md" in sent
        assert not any(r["path"].endswith("/messages") for r in upstream.requests)

    def test_a_reminder_no_channel_takes_is_tried_again(self, client, upstream):
        put_note(client, "notes/a.md", "- a ⏰ 2031-01-06 09:00\n")
        upstream.status = 500
        sched = self.scheduler(client, "2031-01-06 09:00")
        assert sched.tick() == notesvc.REMINDER_RETRY
        upstream.status = 200
        sched.clock.now += 61
        sched.tick()
        assert len(self.reminders_sent(upstream)) == 2  # the failed try, then the good one
        sched.clock.now += 61
        sched.tick()
        assert len(self.reminders_sent(upstream)) == 2

    def test_time_zone_setting_and_its_fallback(self, caplog, make_app):
        assert notesvc.load_config({"SERVICE_TIMEZONE": "Asia/Tokyo"}).timezone == "Asia/Tokyo"
        with pytest.raises(notesvc.ConfigError, match="SERVICE_TIMEZONE"):
            notesvc.load_config({"SERVICE_TIMEZONE": "Mars/Olympus_Mons"})
        # Where no time zone database knows a name, the system's local time is used, logged.
        assert notesvc.time_zone("Nowhere/Else") is None
        assert any("Nowhere/Else" in r.getMessage() for r in caplog.records)
        assert notesvc.time_zone("UTC") is notesvc.dt.timezone.utc
        client = with_key(
            make_app(SERVICE_TIMEZONE="Asia/Tokyo", SERVICE_TRANSCRIBE_API_KEY="tr-secret-9")
        )
        config = data(client.get(f"{API}/system/config"))
        assert config["capture"]["timeZone"] == "Asia/Tokyo"
        assert config["capture"]["transcribeApiKeySet"] is True
        assert "tr-secret-9" not in json.dumps(config)
        assert config["server"]["maxAttachmentBytes"] == 20971520

    def test_the_running_scheduler_sends_a_reminder_due_now(self, make_app, upstream):
        client = with_key(make_app(SERVICE_TELEGRAM_API_BASE=upstream.url))
        body = {
            "provider": "telegram",
            "config": {
                **MINIMAL_CONFIG["telegram"],
                "allowedChatIds": [42],
                "mode": "webhook",
                "notify": True,
            },
        }
        client.post_json(f"{API}/channels", body, status=201)
        # inside the minute the reminder names: not in its last two seconds
        now = wait_for(
            lambda: (n := notesvc.local_now(client.app.service)).second < 58 and n, timeout=5
        )
        put_note(client, "notes/now.md", f"# Now\n\n- stretch ⏰ {now:%Y-%m-%d %H:%M}\n")
        wait_for(lambda: self.reminders_sent(upstream), timeout=10)
        assert "stretch" in self.reminders_sent(upstream)[0]

    def test_a_reminder_at_an_unusable_time_is_ignored_for_its_line_only(self, make_app, upstream):
        client = with_key(make_app(SERVICE_TELEGRAM_API_BASE=upstream.url))  # the system's zone
        body = {
            "provider": "telegram",
            "config": {
                **MINIMAL_CONFIG["telegram"],
                "allowedChatIds": [42],
                "mode": "webhook",
                "notify": True,
            },
        }
        client.post_json(f"{API}/channels", body, status=201)
        put_note(
            client,
            "notes/odd.md",
            "- b ⏰ 0001-01-01 00:00\n- z ⏰ 9999-12-31 23:59\n- good ⏰ 2031-01-06 09:00\n",
        )
        listed = data(client.get(f"{API}/reminders"))["reminders"]
        assert [r["local"] for r in listed] == ["2031-01-06 09:00"]
        svc = client.app.service
        svc.reminders.close()
        svc.notes.after.remove(svc.reminders._note_changed)
        clock = FakeClock(dt.datetime(2031, 1, 6, 9, 0).timestamp())
        svc.reminders = sched = notesvc.ReminderScheduler(svc, clock=clock)
        sched.tick()
        (sent,) = self.reminders_sent(upstream)
        assert "- good ⏰ 2031-01-06 09:00" in sent
