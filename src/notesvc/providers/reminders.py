"""Reminders: ⏰ lines sent through the channels."""

from __future__ import annotations

import array
import datetime as dt
import hashlib
import json
import re
import threading
import time
from typing import Any, Callable

from notesvc.boot import log
from notesvc.helpers import atomic_write, iso, time_zone
from notesvc.notes.paths import MAX_SCAN_CHARS
from notesvc.notes.tasks import ALARM_RE, usable_wall, wall_timestamp
from notesvc.providers.base import UpstreamError
from notesvc.providers.capture import one_line
from notesvc.providers.channels import allowed_senders, channels_of
from notesvc.search.index import SearchIndex
from notesvc.search.segments import IndexedNote
from notesvc.service import Service

# -- reminders: ⏰ lines sent through the channels ------------------------------------

_REMIND_FIELD_RE = re.compile(
    r"^remind:[ \t]*[\"']?(\d{4})-(\d{2})-(\d{2})[ \tT]+([01]?\d|2[0-3]):([0-5]\d)", re.M
)
REMINDER_GRACE = 60.0  # seconds: a reminder first seen this soon after its time still fires
REMINDER_RETRY = 60.0  # seconds between tries while no channel took a reminder
REMINDER_ATTEMPTS = 5


def note_reminders(path: str, title: str, text: str, zone: dt.tzinfo | None) -> list:
    """Return the reminders of a note: lines with ⏰ YYYY-MM-DD HH:MM, and `remind:` in its
    front matter; each {id, path, title, line, wall, due} (due: a timestamp in `zone`).

    >>> [r["wall"] for r in note_reminders("notes/a.md", "A", "- ⏰ 2026-12-01 09:00", None)]
    ['2026-12-01 09:00']
    """
    text = text[:MAX_SCAN_CHARS]
    matches = list(ALARM_RE.finditer(text))
    if text.startswith("---"):
        end = text.find("\n---", 3)
        if end > 0:
            matches += _REMIND_FIELD_RE.finditer(text, 0, end)
    found = []
    for m in matches:
        start = text.rfind("\n", 0, m.start()) + 1
        stop = text.find("\n", m.end())
        line = one_line(text[start : stop if stop >= 0 else len(text)], 300)
        wall = usable_wall(*(int(g) for g in m.groups()))  # (None: 2026-02-30, 0001-01-01)
        due = wall_timestamp(wall, zone) if wall is not None else None
        if due is None:  # an unusable time: that line only is no reminder
            continue
        text_id = f"{path}\n{wall:%Y-%m-%d %H:%M}\n{line}".encode()
        found.append(
            {
                "id": hashlib.sha256(text_id).hexdigest()[:20],
                "path": path,
                "title": title,
                "line": line,
                "wall": f"{wall:%Y-%m-%d %H:%M}",
                "due": due,
            }
        )
    return found


def chats_of(channel: dict, allowed: list, person: str) -> list:
    """Return the chats of a channel's live ones (`allowed`) that are a person's ("": the
    owner's, those linked to nobody)."""
    linked = {c["chat"]: c["person"] for c in channel.get("linkedChats", [])}
    return [chat for chat in allowed if (linked.get(chat) or "") == person]


class ReminderScheduler:
    """Reminders written in the notes, sent once through every enabled channel with
    config.notify true (to the senders on its allowlist): a note in a person's home to
    that person's chats, any other note (a shared folder's too) to the owner's.

    The notes are read through the index (re-read when a note changes: an edit or a
    delete cancels); what was sent and what was scheduled is kept in
    <state>/reminders.json, so each is sent once across restarts and one that was due
    while the server was down is sent at start, marked late. One first seen after its
    time (written in the past) is not sent. `clock` (a function returning the time, like
    time.time) may be given to test the schedule.
    """

    def __init__(self, svc: Service, clock: Callable[[], float] = time.time):
        self.svc, self.clock = svc, clock
        self.path = svc.config.state_dir / "reminders.json"
        self._tick_lock = threading.Lock()  # one tick at a time (no reminder sent twice)
        self._data_lock = threading.RLock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._found: dict = {}  # id -> reminder, from the notes as they are
        self._by_path: dict = {}  # note path -> its reminders (notes that have some)
        self._keys: array.array = array.array("q")  # each note's key when last read
        self._written: set = set()  # notes written through the API since the last look
        self._written_lock = threading.Lock()
        self._stale = True  # every note's key is to be looked at: at start, after a rescan
        self._fired: dict = {}  # id -> when it was sent (persisted)
        self._scheduled: dict = {}  # id -> due, known before it was due (persisted)
        self._tries: dict = {}  # id -> (tries, next try) while no channel took it
        self._loaded = False

    def start(self) -> None:
        self._load()
        self.svc.notes.after.append(self._note_changed)
        self._thread = threading.Thread(target=self._run, name="notesvc-reminders", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(20)

    def look_again(self) -> None:
        """Have the next look compare every note's key: the rescan found notes changed by
        other programs (the API's writes name their notes: only those are read again)."""
        self._stale = True
        self._wake.set()

    def _note_changed(self, event: str, path: str, detail: Any = None) -> None:
        with self._written_lock:  # read again even if its size and mtime came out the same
            self._written.add(path)
            if event == "moved":
                self._written.add(detail[0])
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            # While the index reads many notes in (a first start, a restart's check), each
            # batch would make a look of its own at every note: the look waits for the end
            reading = self.svc.index.reading
            try:
                wait = self.tick(refresh=not reading)
            except Exception:
                log.exception("reminders: a check failed; trying again in a minute")
                wait = 60.0
            wait = min(wait, 1.0 if reading else 30.0)  # a rescan's edits: within 30 s
            self._wake.wait(max(0.05, wait))

    # -- persistence ------------------------------------------------------------------

    def _load(self) -> None:
        try:
            saved = json.loads(self.path.read_text("utf-8"))
        except (OSError, ValueError):
            saved = {}
        saved = saved if isinstance(saved, dict) else {}
        with self._data_lock:
            self._loaded = True
            self._fired = dict(saved.get("fired") or {})
            self._scheduled = {
                k: v
                for k, v in (saved.get("scheduled") or {}).items()
                if isinstance(v, (int, float))
            }

    def _save(self) -> None:
        data = {"fired": self._fired, "scheduled": self._scheduled}
        try:
            atomic_write(self.path, json.dumps(data).encode("utf-8"), mode=0o600)
        except OSError as e:
            log.warning("could not record the reminders: %s", e)

    # -- the schedule -----------------------------------------------------------------

    def _refresh(self, full: bool = True) -> None:
        """Bring the reminders in line with the notes: the notes written through the API
        since the last look; at start and after a rescan found changes, every note whose
        key changed (`full` false: not while the index reads many notes in). At 100,000
        notes, reading every note after each save took a second of CPU; comparing every
        key after each save, 0.15 s of Python holding the GIL, cut PUTs per second 6 times
        at 10,000 notes (each of a PUT's system calls waited for it)."""
        if not self._loaded:
            self._load()
        index = self.svc.index
        with self._written_lock:
            written, self._written = self._written, set()
        try:
            if full and self._stale:
                self._stale = False
                self._read_changed(index, written)
            elif written:
                for path in written:
                    self._take_note(path, index.document(path))
                self._found = {r["id"]: r for found in self._by_path.values() for r in found}
        except BaseException:
            with self._written_lock:
                self._written |= written  # looked at again next time
            self._stale = self._stale or full
            raise

    def _take_note(self, path: str, note: IndexedNote | None) -> bool:
        """Take the reminders of a note read (None: gone); return whether it has some."""
        found = []
        if note is not None and ("⏰" in note.text or "remind:" in note.text):
            found = note_reminders(path, note.title, note.text, time_zone(self.svc.config.timezone))
        if found:
            self._by_path[path] = found
        else:
            self._by_path.pop(path, None)
        return bool(found)

    def _read_changed(self, index: SearchIndex, written: set) -> None:
        _, keys = index.note_keys()
        known, fresh, kept = set(self._keys), array.array("q"), set()
        for key, path, read in keys:
            if key is not None and key in known and path not in written:
                fresh.append(key)
                if path in self._by_path:
                    kept.add(path)
                continue
            note = read()
            if note is None:  # unreadable now: its reminders stay, and it is read next time
                if path in self._by_path:
                    kept.add(path)
                continue
            if key is not None:  # a key of None: changed too lately to be remembered
                fresh.append(key)
            if self._take_note(path, note):
                kept.add(path)
        self._by_path = {path: found for path, found in self._by_path.items() if path in kept}
        self._found = {r["id"]: r for found in self._by_path.values() for r in found}
        self._keys = fresh

    def tick(self, refresh: bool = True) -> float:
        """Send the reminders that are due; return the seconds until the next one. Without
        `refresh`, from the notes as last looked at."""
        with self._tick_lock:
            now = self.clock()
            due, wait, changed = [], 3600.0, False
            with self._data_lock:
                self._refresh(full=refresh)
                for rid, r in self._found.items():
                    if rid in self._fired:
                        continue
                    if r["due"] > now:
                        if self._scheduled.get(rid) != r["due"]:
                            self._scheduled[rid], changed = r["due"], True
                        wait = min(wait, r["due"] - now)
                    elif (
                        rid in self._scheduled
                        or rid in self._tries
                        or r["due"] >= now - REMINDER_GRACE
                    ):
                        tries, retry_at = self._tries.get(rid, (0, 0.0))
                        if retry_at > now:
                            wait = min(wait, retry_at - now)
                        else:
                            due.append((r, tries))
                # edited or deleted: cancelled, once all the notes were looked at (not from
                # an index still being read in: a first build, a discarded index)
                for book in (
                    (self._scheduled, self._fired) if refresh and self.svc.last_sync else ()
                ):
                    for rid in [rid for rid in book if rid not in self._found]:
                        del book[rid]
                        changed = True
            for r, tries in sorted(due, key=lambda item: item[0]["due"]):
                late = now - r["due"] > REMINDER_GRACE
                sent, tried = self._send(r, late)
                with self._data_lock:
                    if sent or not tried or tries + 1 >= REMINDER_ATTEMPTS:
                        self._fired[r["id"]] = iso(now)
                        self._scheduled.pop(r["id"], None)
                        self._tries.pop(r["id"], None)
                        changed = True
                    else:
                        self._tries[r["id"]] = (tries + 1, now + REMINDER_RETRY)
                        wait = min(wait, REMINDER_RETRY)
            if changed:
                with self._data_lock:
                    self._save()
            return wait

    def _send(self, r: dict, late: bool) -> tuple:
        """Send a reminder through the notifying channels; return (sent, tried)."""
        svc = self.svc
        text = (
            f"⏰ {'Late reminder' if late else 'Reminder'} ({r['wall']}): {r['title']}\n"
            f"{r['line']}\n{r['path']}"
        )
        sent = tried = 0
        person = svc.people.holder(r["path"])  # a note in a person's home: their chats only
        for channel in channels_of(svc):
            prov = svc.channel_providers.get(channel["provider"])
            if not (prov and prov.send and channel["enabled"] and channel["config"].get("notify")):
                continue
            for to in chats_of(channel, allowed_senders(svc, channel, prov) or [], person):
                tried += 1
                try:
                    prov.send(svc, channel["config"], to, text)
                    sent += 1
                except UpstreamError as e:
                    log.warning("channel %s: a reminder was not delivered: %s", channel["id"], e)
        if not tried:
            log.warning(
                "reminder in %s is due, but no enabled channel has notify: true and an "
                "allowlist with a chat of %s",
                r["path"],
                "its person" if person else "the owner",
            )
        else:
            log.info("reminder in %s sent (%d of %d)%s", r["path"], sent, tried, " late" * late)
        return sent > 0, tried > 0

    def upcoming(self) -> list:
        """Return the reminders not sent yet, soonest first."""
        with self._data_lock:
            self._refresh()
            now = self.clock()
            pending = [
                r
                for rid, r in self._found.items()
                if rid not in self._fired
                and (r["due"] > now - REMINDER_GRACE or rid in self._scheduled)
            ]
        return sorted(pending, key=lambda r: (r["due"], r["path"]))
