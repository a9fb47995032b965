"""Task lines: the `- [ ]` lines of the notes as iCalendar VTODOs, and their identities."""

from __future__ import annotations

import datetime as dt
import difflib
import hashlib
import hmac
import json
import os
import re
import secrets
import stat
import threading
import time
from typing import Any, Callable

from notesvc.boot import log
from notesvc.errors import ApiError
from notesvc.helpers import (
    atomic_write,
    disk_writes,
    flush_each,
    log_safe,
    time_zone,
    timestamp_of,
)
from notesvc.notes.paths import note_title

# -- task lines ----------------------------------------------------------------------------
#
# docs/api.md (CalDAV): a task line is a list item (`-`, `*`, `+`, `1.`, `1)`, any
# indentation) whose text starts with `[ ]` or `[x]`, outside fenced code and front matter.
# Its dates (`📅 2026-12-02`, `due:2026-12-02`, `⏰ 2026-12-02 09:00`) and `#tags` are parsed
# out of its SUMMARY; the tags stay in the text. Nesting (a task indented under another) is
# RELATED-TO. Lines split on "\n" only, so a line edit never touches the others.

TASK_LINE_RE = re.compile(r"^([ \t]*)([-*+]|\d{1,9}[.)])([ \t]+)\[([ xX])\](?=[ \t]|$)(.*)$")
_TASK_FENCE_RE = re.compile(r"^[ \t]*(`{3,}|~{3,})")
DUE_DATE_RE = re.compile(r"(?:📅\ufe0f?[ \t]*|(?<!\S)due:[ \t]*)(\d{4})-(\d{2})-(\d{2})(?!\d)")
# ⏰ YYYY-MM-DD HH:MM: a task's alarm here, a reminder sent through the channels in
# providers/reminders.py (one syntax, one pattern)
ALARM_RE = re.compile(
    r"⏰\ufe0f?[ \t]*(\d{4})-(\d{2})-(\d{2})[ \tT]+([01]?\d|2[0-3]):([0-5]\d)(?!\d)"
)
TAG_RE = re.compile(r"(?<![^\s(\[])#([^\W\d_][\w/-]*|\d+[^\W\d][\w/-]*)")
_DONE_DATE_RE = re.compile(r"✅\ufe0f?[ \t]*\d{4}-\d{2}-\d{2}")
TASKS_NOTE = "Tasks.md"  # where a folder's new tasks from a client go


def _width(indent: str) -> int:
    return sum(4 if c == "\t" else 1 for c in indent)


def task_lines(text: str) -> list:
    """Return the task lines of a note, each a dict: line (its index), indent, done, text
    (the line as written), summary, due (date or UTC datetime or None), alarm (UTC datetime
    or None), categories, parent (the index in this list of the task it nests under).

    >>> [t["summary"] for t in task_lines("- [ ] a #x\\n```\\n- [ ] b\\n```\\n  1. [x] c")]
    ['a', 'c']
    """
    lines = text.split("\n")
    start = 0
    if lines and lines[0].rstrip() == "---":  # front matter: up to the next --- or ...
        for i in range(1, len(lines)):
            if lines[i].rstrip() in ("---", "..."):
                start = i + 1
                break
    found: list = []
    stack: list = []  # (indent width, index in found) of the open task lines
    fence = ""
    for i in range(start, len(lines)):
        line = lines[i]
        m = _TASK_FENCE_RE.match(line)
        if fence:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                fence = ""
            continue
        if m:
            fence = m.group(1)
            continue
        t = TASK_LINE_RE.match(line)
        if t is None:
            if line.strip() and not line[:1].isspace():
                stack = []  # a paragraph at the margin ends the list
            continue
        width = _width(t.group(1))
        while stack and stack[-1][0] >= width:
            stack.pop()
        task = parse_task(t.group(5))
        task.update(line=i, indent=width, done=t.group(4) != " ", text=line)
        task["parent"] = stack[-1][1] if stack else None
        stack.append((width, len(found)))
        found.append(task)
    return found


# A date a line may use: years FIRST_YEAR to LAST_YEAR, so that iCalendar's four digits,
# the day after (an all-day event's end), a zone's offset and a quarter of an hour (an
# event at a ⏰ time) all stay dates. Outside them, or where the platform cannot convert one
# (a 32-bit time_t), the date is ignored for its line only: the line stays a task without
# it, and no feed, list or reminder tick stops over it.
FIRST_YEAR, LAST_YEAR = 1000, 9998


def usable_day(year: int, month: int, day: int) -> dt.date | None:
    """Return the date, or None when it doesn't exist or lies outside the usable years."""
    if not FIRST_YEAR <= year <= LAST_YEAR:
        return None
    try:
        return dt.date(year, month, day)
    except ValueError:  # 2026-02-30
        return None


def usable_wall(year: int, month: int, day: int, hour: int = 0, minute: int = 0):
    """Return the naive wall time, or None as usable_day does."""
    return dt.datetime(year, month, day, hour, minute) if usable_day(year, month, day) else None


def wall_timestamp(wall: dt.datetime, zone: dt.tzinfo | None) -> float | None:
    """Return the timestamp of a wall time in a zone (None: the system's), or None when
    the wall time is unusable there (outside the usable years, or beyond the platform)."""
    if not FIRST_YEAR <= wall.year <= LAST_YEAR:
        return None
    try:
        ts = timestamp_of(wall, zone)
        utc_of_timestamp(ts)
    except (ValueError, OverflowError, OSError):
        return None
    return ts


def utc_of_timestamp(ts: float) -> dt.datetime:
    """A timestamp as a naive UTC datetime, by arithmetic (no platform time_t)."""
    return dt.datetime(1970, 1, 1) + dt.timedelta(seconds=ts)


def parse_task(rest: str) -> dict:
    """Return summary, due, wall (the ⏰ time, naive) and categories of a task's text; an
    unusable date is None (usable_day)."""
    m = DUE_DATE_RE.search(rest)
    due: Any = usable_day(*(int(g) for g in m.groups())) if m else None
    a = ALARM_RE.search(rest)
    alarm = usable_wall(*(int(g) for g in a.groups())) if a else None
    tags = list(dict.fromkeys(TAG_RE.findall(rest)))
    summary = _DONE_DATE_RE.sub("", ALARM_RE.sub("", DUE_DATE_RE.sub("", rest)))
    summary = TAG_RE.sub("", summary)
    summary = " ".join(summary.split())
    return {"summary": summary, "due": due, "wall": alarm, "categories": tags}


def task_key(text: str) -> str:
    """What identifies a task's line across edits: the line without indentation, marker
    or box state."""
    m = TASK_LINE_RE.match(text)
    return " ".join(m.group(5).split()) if m else text.strip()


def task_core(key: str) -> str:
    """What a task says (its key without dates, tags and box), case-folded: a task dated,
    tagged or re-dated keeps it."""
    return parse_task(key)["summary"].casefold()


def alarm_utc(wall: dt.datetime | None, zone_name: str) -> dt.datetime | None:
    """Return a ⏰ wall time in UTC (naive), or None when it has none or an unusable one."""
    if wall is None:
        return None
    ts = wall_timestamp(wall, time_zone(zone_name))
    return None if ts is None else utc_of_timestamp(ts)


# -- iCalendar (RFC 5545) ------------------------------------------------------------------


# RFC 5545 3.1 allows no control character in a value but HTAB (and XML 1.0 none but tab and
# line ends): a task line holding one (any writer may put one there) is sent as U+FFFD.
ICAL_CONTROL_RE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def ical_escape(value: str) -> str:
    return (
        ICAL_CONTROL_RE.sub("\ufffd", value)
        .replace("\\", "\\\\")
        .replace(";", "\\;")
        .replace(",", "\\,")
        .replace("\r\n", "\\n")
        .replace("\n", "\\n")
        .replace("\r", "\\n")
    )


def ical_fold(line: str) -> str:
    """Fold a content line at 75 octets (never inside a UTF-8 character), CRLF-ended."""
    data = line.encode("utf-8")
    if len(data) <= 75:
        return line + "\r\n"
    parts, start, room = [], 0, 75
    while start < len(data):
        end = min(start + room, len(data))
        while end < len(data) and (data[end] & 0xC0) == 0x80:
            end -= 1
        parts.append(data[start:end].decode("utf-8"))
        start, room = end, 74
    return "\r\n ".join(parts) + "\r\n"


def ical_date(day: dt.date) -> str:
    return f"{day.year:04d}{day.month:02d}{day.day:02d}"  # (strftime's %Y may drop zeros)


def ical_utc(when: dt.datetime) -> str:
    return f"{ical_date(when)}T{when.hour:02d}{when.minute:02d}{when.second:02d}Z"


def ical_stamp(ts: float) -> str:
    return ical_utc(dt.datetime.fromtimestamp(ts, dt.timezone.utc))


def vtodo_lines(task: dict, link: str = "") -> list:
    """The content lines of one task's VTODO (without the calendar around it)."""
    out = ["BEGIN:VTODO", f"UID:{task['uid']}", f"DTSTAMP:{ical_stamp(task['stamp'])}"]
    out.append(f"SUMMARY:{ical_escape(task['summary'])}")
    if task["done"]:
        out.append("STATUS:COMPLETED")
        if task.get("completed"):
            out.append(f"COMPLETED:{ical_stamp(task['completed'])}")
    else:
        out.append("STATUS:NEEDS-ACTION")
    due, alarm = task["due"], task.get("alarm")
    if isinstance(due, dt.date):
        out.append(f"DUE;VALUE=DATE:{ical_date(due)}")
    elif alarm is not None:
        out.append(f"DUE:{ical_utc(alarm)}")
    if task["categories"]:
        out.append("CATEGORIES:" + ",".join(ical_escape(c) for c in task["categories"]))
    if task.get("parent_uid"):
        out.append(f"RELATED-TO;RELTYPE=PARENT:{task['parent_uid']}")
    description = task["title"] + (f"\n{link}" if link else "")
    out.append(f"DESCRIPTION:{ical_escape(description)}")
    if alarm is not None:
        out += [
            "BEGIN:VALARM",
            "ACTION:DISPLAY",
            f"DESCRIPTION:{ical_escape(task['summary'] or 'Task')}",
            f"TRIGGER;VALUE=DATE-TIME:{ical_utc(alarm)}",
            "END:VALARM",
        ]
    out.append("END:VTODO")
    return out


def ical_calendar(components: list, name: str = "") -> bytes:
    """A VCALENDAR around content lines, folded, CRLF, UTF-8."""
    lines = ["BEGIN:VCALENDAR", "VERSION:2.0", "PRODID:-//notesvc//tasks//EN", "CALSCALE:GREGORIAN"]
    if name:
        lines.append(f"X-WR-CALNAME:{ical_escape(name)}")
    lines += [*components, "END:VCALENDAR"]
    return "".join(ical_fold(line) for line in lines).encode("utf-8")


class ICalError(ValueError):
    """iCalendar that cannot be read."""


class UnusableDate(ICalError):
    """A date or time outside the usable years (usable_day)."""


def ical_parse(data: bytes) -> list:
    """Parse iCalendar into components: each {"name", "props": [(NAME, params, value)],
    "subs": [...]}. Raises ICalError for anything that is not well formed."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ICalError("the calendar object is not UTF-8") from None
    text = re.sub(r"\r?\n[ \t]", "", text.replace("\r\n", "\n"))  # unfold
    root: dict = {"name": "", "props": [], "subs": []}
    stack = [root]
    for raw in text.split("\n"):
        if not raw.strip():
            continue
        name, params, value = _content_line(raw)
        if name == "BEGIN":
            comp = {"name": value.upper(), "props": [], "subs": []}
            stack[-1]["subs"].append(comp)
            stack.append(comp)
            if len(stack) > 8:
                raise ICalError("components nested too deep")
        elif name == "END":
            if len(stack) == 1 or stack[-1]["name"] != value.upper():
                raise ICalError(f"END:{value[:40]} does not close what is open")
            stack.pop()
        else:
            if len(stack) == 1:
                raise ICalError("a property outside any component")
            stack[-1]["props"].append((name, params, value))
    if len(stack) != 1 or not root["subs"]:
        raise ICalError("the calendar object is not closed (BEGIN without END)")
    return root["subs"]


_NAME_RE = re.compile(r"[A-Za-z0-9-]+")


def _content_line(raw: str) -> tuple:
    m = _NAME_RE.match(raw)
    if not m:
        raise ICalError(f"not a content line: {raw[:40]!r}")
    name, rest, params = m.group(0).upper(), raw[m.end() :], {}
    while rest.startswith(";"):
        pm = re.match(r';([A-Za-z0-9-]+)=("[^"]*"|[^;:,"]*(?:,[^;:,"]*)*)', rest)
        if not pm:
            raise ICalError(f"a parameter of {name} is not well formed")
        params[pm.group(1).upper()] = pm.group(2).strip('"')
        rest = rest[pm.end() :]
    if not rest.startswith(":"):
        raise ICalError(f"{name} has no value")
    return name, params, rest[1:]


def ical_unescape(value: str) -> str:
    return re.sub(r"\\([\\;,nN])", lambda m: "\n" if m.group(1) in "nN" else m.group(1), value)


def ical_split(value: str) -> list:
    """A list value (CATEGORIES) split on unescaped commas, unescaped."""
    return [ical_unescape(p) for p in re.split(r"(?<!\\),", value) if p]


_ZONE_NAME_RE = re.compile(r"[A-Za-z0-9_+-]+(?:/[A-Za-z0-9_+-]+)*")


def client_zone(name: str) -> dt.tzinfo | None:
    """A client's TZID as a zone, or None when none is known by that name (never logged:
    a client's text is not the server's configuration)."""
    if len(name) > 64 or not _ZONE_NAME_RE.fullmatch(name):
        return None
    if name.upper() == "UTC":
        return dt.timezone.utc
    try:
        import zoneinfo

        return zoneinfo.ZoneInfo(name)
    except (ImportError, ValueError, OSError, KeyError):  # ZoneInfoNotFoundError: a KeyError
        return None


def ical_when(value: str, params: dict, zone: dt.tzinfo | None = None) -> Any:
    """Return a date, or a UTC datetime (naive), of a DATE / DATE-TIME value; a floating
    time is read in `zone` (None: the system's). Raises ICalError for what is not one, and
    for a date outside the usable years (usable_day)."""
    value = value.strip()
    day = params.get("VALUE", "").upper() == "DATE" or re.fullmatch(r"\d{8}", value)
    try:
        wall = dt.datetime.strptime(value.rstrip("Z"), "%Y%m%d" if day else "%Y%m%dT%H%M%S")
    except ValueError:
        raise ICalError(f"not a date or time: '{log_safe(value, 40)}'") from None
    unusable = UnusableDate(f"{value[:20]} is outside the years {FIRST_YEAR}-{LAST_YEAR}")
    if day:
        if usable_day(wall.year, wall.month, wall.day) is None:
            raise unusable
        return wall.date()
    if params.get("TZID") and not value.endswith("Z"):
        zone = client_zone(params["TZID"])
        if zone is None:
            raise ICalError(f"unknown time zone '{log_safe(params['TZID'], 60)}'")
    ts = wall_timestamp(wall, dt.timezone.utc if value.endswith("Z") else zone)
    if ts is None or usable_wall(*utc_of_timestamp(ts).timetuple()[:3]) is None:
        raise unusable
    return utc_of_timestamp(ts)


# -- identities ----------------------------------------------------------------------------
#
# A task's UID and the state around it (when it was first seen ticked, its last change,
# the href a client gave it) live in <state>/caldav.json, never in the note. On each look
# the notes that changed are parsed again and their tasks matched to the UIDs they had
# (match_tasks): the line a client's write named, the same text, the same words without
# dates and tags, then the nearest (a small edit of its own text, by difflib's ratio, among
# a few candidates and within a budget); then a task whose note is gone (a moved note),
# then a new UID. One thread looks at a time, reading and matching outside the book's lock
# (held only to take what a look starts from and to keep what it found). Each change takes
# the next sequence number: a list's sync-token names the highest its reader sees, and
# tombstones of removed tasks answer sync-collection with 404s.

MATCH_RATIO = 0.6  # how alike a task's text must stay to keep its UID through an edit
MATCH_SURE = 0.8  # as alike as this: that one (the others are not compared)
MATCH_CHARS = 200  # of a long task's words, the first 200 characters are compared
MATCH_CANDIDATES = 8  # old tasks sharing its words a changed line is compared with, at most
MATCH_COMMON = 32  # a word more old tasks hold than this picks no candidates
# difflib comparisons one look makes at most: past them a changed line gets a new UID. A
# note of 600 task lines all replaced took 40 s of CPU when each was compared with each.
MATCH_COMPARISONS = 2000
CLAIM_SECONDS = 600  # how long the line a client's write named is held for it
TOMBSTONES = 5000  # removed tasks remembered for sync-collection
_MATCH_WORD_RE = re.compile(r"\w+")


def new_uid() -> str:
    return secrets.token_hex(8) + "-" + secrets.token_hex(4)


def match_tasks(olds: list, found: list, claims: dict, known: Callable, budget: list) -> tuple:
    """Pair a note's task lines with the UIDs its tasks had; return ([a UID or None per
    line], [the keys of the claims used]).

    olds: [(uid, key, line)] of the note's tasks as last seen; claims: {key: uid} of the
    lines clients wrote; known(uid): whether a task has that UID; budget: [comparisons
    left], shared by the notes of a look."""
    keys = [task_key(t["text"]) for t in found]
    uids: list = [None] * len(found)
    free = {uid: (key, line) for uid, key, line in olds}
    used: list = []
    for i, key in enumerate(keys):  # the line a client's write named
        uid = claims.get(key)
        if uid is None or key in used or uid in uids:
            continue
        if uid in free or not known(uid):
            uids[i] = uid
            free.pop(uid, None)
            used.append(key)
    by_key: dict = {}
    for uid, (key, _line) in free.items():
        by_key.setdefault(key, []).append(uid)
    for i, key in enumerate(keys):  # the same text
        if uids[i] is None and by_key.get(key):
            uids[i] = _nearest_place(by_key[key], free, i)
            del free[uids[i]]
    olds_core = {uid: task_core(key)[:MATCH_CHARS] for uid, (key, _line) in free.items()}
    cores = [task_core(key)[:MATCH_CHARS] if uids[i] is None else "" for i, key in enumerate(keys)]
    by_core: dict = {}
    for uid, core in olds_core.items():
        if core:
            by_core.setdefault(core, []).append(uid)
    for i, core in enumerate(cores):  # the same words, dated, tagged or re-dated
        if core and uids[i] is None and by_core.get(core):
            uids[i] = _nearest_place(by_core[core], free, i)
            del free[uids[i]]
    if free and None in uids:
        _match_nearest(uids, cores, free, olds_core, budget)
    return uids, used


def _nearest_place(same: list, free: dict, i: int) -> str:
    """Take from `same` (UIDs of tasks alike) the one that was nearest the i-th line (of
    a few; of many, the first)."""
    if len(same) == 1 or len(same) > 16:
        return same.pop(0)
    lines = [free[uid][1] for uid in same]
    at = min(range(len(same)), key=lambda k: abs(i - lines[k]) if lines[k] is not None else 1 << 30)
    return same.pop(at)


def _match_nearest(uids: list, cores: list, free: dict, olds_core: dict, budget: list) -> None:
    """Give the lines still without a UID the free one nearest in words (MATCH_RATIO or
    more), compared only with the tasks at about the same place and those sharing the most
    words with it (not a common one), while the budget lasts."""
    by_word: dict = {}
    for uid in free:
        for word in set(_MATCH_WORD_RE.findall(olds_core[uid])):
            by_word.setdefault(word, []).append(uid)
    by_line = {line: uid for uid, (_key, line) in free.items() if line is not None}
    for i, core in enumerate(cores):
        if uids[i] is not None or not core or not free:
            continue
        shared: dict = {}
        for word in set(_MATCH_WORD_RE.findall(core)):
            near = by_word.get(word, ())
            if len(near) <= MATCH_COMMON:
                for uid in near:
                    shared[uid] = shared.get(uid, 0) + 1
        ranked = sorted(shared, key=shared.__getitem__, reverse=True)[:MATCH_CANDIDATES]
        around = [by_line.get(i + d) for d in (0, -1, 1, -2, 2)]
        best, score = None, MATCH_RATIO
        matcher = difflib.SequenceMatcher(None)
        matcher.set_seq2(core)
        for uid in dict.fromkeys([u for u in around[:1] + ranked + around[1:] if u is not None]):
            if score >= MATCH_SURE:
                break
            other = olds_core.get(uid, "") if uid in free else ""
            if not other or 2 * min(len(other), len(core)) < score * (len(other) + len(core)):
                continue  # (difflib's ratio is at most this)
            if budget[0] <= 0:
                return
            budget[0] -= 1
            matcher.set_seq1(other)
            if matcher.quick_ratio() >= score:
                r = matcher.ratio()
                if r >= score:
                    best, score = uid, r
        if best is not None:
            uids[i] = best
            del free[best]


class TaskBook:
    """The tasks of every note and their identities (one per Service: `task_book`)."""

    def __init__(self, notes: Any, state_dir: Any, zone_name: str = ""):
        self.notes = notes
        self.file = state_dir / "caldav.json"
        self.zone = zone_name
        self.lock = threading.RLock()
        self._looked = threading.Condition(self.lock)  # a look ended
        self._looking = False  # a thread is looking (one at a time, outside the lock)
        self.parsed: dict = {}  # note path -> (title, [task dicts])
        self.seen_journal: Any = None
        self.loaded = False  # every note looked at once
        self.log_file = state_dir / "caldav.log"
        try:
            kept = json.loads(self.file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            kept = {}
        self.gen = int(kept.get("gen", 0))  # the snapshot's generation: its log's lines
        self.logged = 0  # lines in the log since the snapshot
        self.tombstones = 0  # tombstones made by this run (what a log line carries)
        self.seq = int(kept.get("seq", 0))
        self.floor = int(kept.get("floor", 0))
        # folder -> the newest of its tombstones forgotten ("*": of any folder, as kept by
        # a version that did not keep them per folder)
        self.floors: dict = dict(kept.get("floors") or ({"*": self.floor} if self.floor else {}))
        self.folders: dict = dict(kept.get("folders", {}))  # folder path -> list id
        self.ids: dict = dict(kept.get("tasks", {}))  # uid -> record
        self.gone: list = list(kept.get("gone", []))  # [seq, uid, href, folder, path]
        self.sigs: dict = dict(kept.get("sigs", {}))  # note path -> [size, mtime_ns]
        self._replay()
        self.claims: dict = {}  # (path, key) -> (uid, href, when): the line a client wrote
        self.tasks: dict = {}  # uid -> the task as served (after refresh)
        self.by_href: dict = {}  # an item's name -> the uids of the items so named
        self.holding: set = set()  # the folders that hold tasks
        secret = kept.get("secret")  # signs the sync tokens (sync_mac)
        self.secret = bytes.fromhex(secret) if isinstance(secret, str) else b""
        if len(self.secret) < 16:
            self.secret = secrets.token_bytes(32)
            try:
                self.save()
            except OSError as e:  # (tokens then last until a restart)
                log.warning("tasks: could not keep their state: %s", e)

    # -- on disk: a snapshot (caldav.json) and the changes since (caldav.log) --------------
    #
    # A change appends one line naming what it changed (fsync'ed: a few hundred bytes, not
    # the whole snapshot); every LOG_LINES lines the snapshot is written again (atomically,
    # with the next generation) and the log starts over. Lines of another generation (a
    # crash between the two) and a torn last line are ignored when read back.

    LOG_LINES = 500

    def _replay(self) -> None:
        try:
            with open(self.log_file, "rb") as f:
                lines = f.read().split(b"\n")
        except OSError:
            return
        for raw in lines:
            try:
                change = json.loads(raw)
            except ValueError:
                break  # a torn last line
            if not isinstance(change, dict) or change.get("gen") != self.gen:
                continue
            self.seq, self.floor = change["seq"], change["floor"]
            self.floors = change.get("floors", self.floors)
            self.folders = change["folders"]
            for uid, rec in change["tasks"].items():
                if rec is None:
                    self.ids.pop(uid, None)
                else:
                    self.ids[uid] = rec
            for path, sig in change["sigs"].items():
                if sig is None:
                    self.sigs.pop(path, None)
                else:
                    self.sigs[path] = sig
            self.gone = (self.gone + change["gone"])[-TOMBSTONES:]
            self.logged += 1

    def save(self, uids: Any = None, paths: Any = (), buried: int = 0) -> None:
        """Keep what changed: the records of `uids`, the signatures of `paths`, the last
        `buried` tombstones (uids None: everything, as a new snapshot)."""
        if uids is None or self.logged >= self.LOG_LINES:
            self.gen += 1
            whole = {"gen": self.gen, "seq": self.seq, "floor": self.floor, "floors": self.floors}
            whole.update(folders=self.folders, tasks=self.ids, gone=self.gone, sigs=self.sigs)
            whole["secret"] = self.secret.hex()
            atomic_write(self.file, json.dumps(whole, ensure_ascii=False).encode("utf-8"))
            atomic_write(self.log_file, b"")
            self.logged = 0
            return
        change = {"gen": self.gen, "seq": self.seq, "floor": self.floor, "floors": self.floors}
        change["folders"] = self.folders
        change["tasks"] = {u: self.ids.get(u) for u in uids}
        change["sigs"] = {p: self.sigs.get(p) for p in paths}
        change["gone"] = self.gone[len(self.gone) - buried :] if buried else []
        line = json.dumps(change, ensure_ascii=False).encode("utf-8") + b"\n"
        with disk_writes(), open(self.log_file, "ab") as f:
            f.write(line)
            f.flush()
            if flush_each():
                os.fsync(f.fileno())
        self.logged += 1

    # -- reading the notes ------------------------------------------------------------

    def refresh(self, force: bool = False) -> dict:
        """Bring the tasks up to date with the notes; return {uid: task}. After the first
        look (every note), only the notes the change journal names since the last look
        are looked at again (all of them again when it no longer holds those changes).
        One thread looks at a time; the others wait for its look, then look again if the
        notes changed since it began."""
        while True:
            with self.lock:
                journal = getattr(self.notes, "journal", None)
                last = journal.last if journal is not None else None
                if not force and last is not None and last == self.seen_journal and self.loaded:
                    return self.tasks
                if self._looking:
                    self._looked.wait(30)
                    continue
                self._looking = True
                since, full = self.seen_journal, force or not self.loaded
            try:
                self._look(journal, since, last, full)
                return self.tasks
            finally:
                with self.lock:
                    self._looking = False
                    self._looked.notify_all()

    def _look(self, journal: Any, since: Any, last: Any, full: bool) -> None:
        """One look at the notes (only the looking thread runs it, and only it changes
        parsed, ids and sigs): read and match outside the lock, keep what was found under
        it. A note's signature is kept only with the work done for it."""
        paths = None if full else self._journal_paths(journal, since, last)
        if paths is None:
            scan = self.notes.scan()
            removed = [p for p in list(self.sigs) if p not in scan]
        else:
            scan = {}
            for p in paths:
                sig = self._stat(p)
                if sig is not None:
                    scan[p] = sig
            removed = [p for p in paths if p not in scan and p in self.sigs]
        read = {}
        for p, sig in scan.items():
            if p not in self.parsed or self.sigs.get(p) != list(sig):
                got = self._parse(p)
                if got is not None:  # (unreadable now: looked at again when it changes)
                    read[p] = got
        changed = [p for p, got in read.items() if self.sigs.get(p) != list(got[2])]
        with self.lock:
            claims = dict(self.claims)
        wanted = set(changed) | set(removed)
        by_path: dict = {}
        for uid, rec in self.ids.items():
            if rec["path"] in wanted:
                by_path.setdefault(rec["path"], []).append(uid)
        assigned, used, hrefs = {}, [], {}
        budget = [MATCH_COMPARISONS]
        for p in changed:
            mine = {key: c[0] for (cp, key), c in claims.items() if cp == p}
            olds = [(u, self.ids[u]["key"], self.ids[u].get("line")) for u in by_path.get(p, [])]
            assigned[p], took = match_tasks(olds, read[p][1], mine, self.ids.__contains__, budget)
            used += [(p, key) for key in took]
            hrefs.update({claims[(p, key)][0]: claims[(p, key)][1] for key in took})
        with self.lock:
            for claimed in used:
                self.claims.pop(claimed, None)
            self._keep(read, changed, removed, by_path, assigned, hrefs)
            self.loaded = True
            self.seen_journal = last

    def _journal_paths(self, journal: Any, since: Any, last: Any) -> set | None:
        """The notes changed since the last look, as the journal has them (None: unknown)."""
        if journal is None or not isinstance(since, int) or not isinstance(last, int):
            return None
        paths: set = set()
        try:
            while since < last:
                got = journal.read(since, 1000)
                for c in got["changes"]:
                    paths.add(c["path"])
                    if c.get("from"):
                        paths.add(c["from"])
                if got["last"] == since:
                    break
                since = got["last"]
        except ApiError:  # compacted away, or reset: look at every note
            return None
        return paths

    def _stat(self, path: str) -> tuple | None:
        try:
            st = os.stat(self.notes.on_disk(path))
        except (OSError, ApiError):
            return None
        return (st.st_size, st.st_mtime_ns) if stat.S_ISREG(st.st_mode) else None

    def _parse(self, path: str) -> tuple | None:
        """(title, task lines, signature) of a note as read now; None when it can't be."""
        try:
            data, st = self.notes.read_raw(path)
            text = data.decode("utf-8", "replace")
        except Exception:  # gone or unreadable meanwhile
            return None
        return note_title(text, path), task_lines(text), (st.st_size, st.st_mtime_ns)

    def _keep(
        self, read: dict, changed: list, removed: list, by_path: dict, assigned: dict, hrefs: dict
    ) -> None:
        """Take a look's findings (under the lock); the notes' signatures last."""
        for p, (title, found, _sig) in read.items():
            self.parsed[p] = (title, found)
        for p in removed:
            self.parsed.pop(p, None)
        orphans = dict.fromkeys(u for p in removed for u in by_path.get(p, []))
        for p in changed:  # a changed note's tasks that no line kept
            kept = set(assigned[p])
            orphans.update(dict.fromkeys(u for u in by_path.get(p, []) if u not in kept))
        self._place(assigned, orphans, hrefs)
        before = self.tombstones
        dirty = self._bury(list(orphans))
        self._keep_places(assigned)
        dirty = self._settle(set(changed) | set(removed)) or dirty or bool(changed or removed)
        for p in changed:
            self.sigs[p] = list(read[p][2])
        for p in removed:
            self.sigs.pop(p, None)
        if dirty:
            uids = {u for found in assigned.values() for u in found} | set(orphans)
            self.save(uids if self.loaded else None, [*changed, *removed], self.tombstones - before)

    def _keep_places(self, assigned: dict) -> None:
        """Record where each task of the changed notes is now."""
        for p, uids in assigned.items():
            for i, uid in enumerate(uids):
                key = task_key(self.parsed[p][1][i]["text"])
                self.ids[uid].update(path=p, key=key, line=i)

    def _place(self, assigned: dict, orphans: dict, hrefs: dict) -> None:
        """Give each task still without a UID one: a task of a vanished note with the same
        text (the note moved), else a new one; make the records of clients' new tasks."""
        left: dict = {}
        for u in orphans:
            left.setdefault(self.ids[u]["key"], []).append(u)
        for p, uids in assigned.items():
            for i, uid in enumerate(uids):
                key = task_key(self.parsed[p][1][i]["text"])
                if uid is not None:
                    if uid not in self.ids:  # a client's new task, with the href it was PUT at
                        self.ids[uid] = {"path": p, "key": key, "href": hrefs[uid]}
                    continue
                if left.get(key):
                    uid = left[key].pop(0)
                    del orphans[uid]
                else:
                    uid = new_uid()
                    self.ids[uid] = {"path": p, "key": key, "href": f"{uid}.ics"}
                uids[i] = uid

    def _bury(self, gone: list) -> bool:
        """Forget removed tasks, keeping a tombstone of each for sync-collection (and, of
        those past TOMBSTONES, the newest per folder: a token under it can't be answered)."""
        for u in gone:
            rec = self.ids.pop(u)
            self.seq += 1
            self.gone.append([self.seq, u, rec.get("href", f"{u}.ics"), rec.get("folder"), None])
            self.tombstones += 1
        if len(self.gone) > TOMBSTONES:
            for seq, _uid, _href, folder, _path in self.gone[:-TOMBSTONES]:
                if folder:
                    self.floors[folder] = max(self.floors.get(folder, 0), seq)
            self.floor = self.gone[-TOMBSTONES - 1][0]
            self.gone = self.gone[-TOMBSTONES:]
        return bool(gone)

    def _settle(self, touched: set) -> bool:
        """Rebuild the served tasks of the notes touched (all at the first look); each task
        whose properties changed takes the next seq."""
        now = time.time()
        dirty = False
        every = not self.tasks
        tasks = {u: t for u, t in self.tasks.items() if t["path"] not in touched and u in self.ids}
        places: dict = {}  # (path, index) -> uid
        for uid, rec in self.ids.items():
            if not every and rec["path"] not in touched:
                continue
            _title, found = self.parsed.get(rec["path"], ("", []))
            i = rec.get("line", 0)
            if i < len(found):
                places[(rec["path"], i)] = uid
        for (path, i), uid in places.items():
            tasks[uid] = task = self._served(uid, path, i, places)
            dirty = self._stamp(self.ids[uid], task, now) or dirty
        dirty = self._name_folders({t["folder"] for t in tasks.values()}, tasks) or dirty
        self.tasks = tasks
        by_href: dict = {}
        for u, t in tasks.items():
            by_href.setdefault(t["href"], []).append(u)
        self.by_href = by_href
        self.holding = {t["folder"] for t in tasks.values()}
        return dirty

    def _served(self, uid: str, path: str, i: int, places: dict) -> dict:
        """The task as served, from its line (the i-th task line of its note)."""
        title, found = self.parsed[path]
        t = found[i]
        parent = places.get((path, t["parent"])) if t["parent"] is not None else None
        return {
            "uid": uid,
            "path": path,
            "folder": path.rsplit("/", 1)[0],
            "href": self.ids[uid].get("href", f"{uid}.ics"),
            "title": title,
            "summary": t["summary"],
            "done": t["done"],
            "due": t["due"],
            "alarm": alarm_utc(t["wall"], self.zone),
            "categories": t["categories"],
            "parent_uid": parent,
            "text": t["text"],
            "line": t["line"],
        }

    def _stamp(self, rec: dict, task: dict, now: float) -> bool:
        """Give a task whose properties (or list) changed the next seq and a new stamp,
        its COMPLETED time the first time it is seen ticked; then its seq, stamp and ETag.
        Return whether its record changed."""
        shape = json.dumps(
            [task[k] for k in ("title", "summary", "done", "categories", "parent_uid")]
            + [str(task["due"]), str(task["alarm"])],
            ensure_ascii=False,
        )
        digest = hashlib.sha256(shape.encode()).hexdigest()[:24]
        folder, dirty = task["folder"], False
        if rec.get("shape") != digest or rec.get("folder") != folder:
            if rec.get("folder") and rec["folder"] != folder:
                self.seq += 1  # it left its old folder's list
                self.gone.append([self.seq, task["uid"], task["href"], rec["folder"], task["path"]])
                self.tombstones += 1
            self.seq += 1
            rec.update(shape=digest, folder=folder, seq=self.seq, stamp=now)
            dirty = True
        if task["done"] != bool(rec.get("completed")):
            rec["completed"] = rec["stamp"] if task["done"] else None
            dirty = True
        task.update(seq=rec["seq"], stamp=rec["stamp"], completed=rec.get("completed"))
        task["etag"] = (
            '"' + hashlib.sha256(f"{digest}{rec['stamp']}".encode()).hexdigest()[:32] + '"'
        )
        return dirty

    def _name_folders(self, holding: set, tasks: dict) -> bool:
        """Give each folder holding tasks a list id; a moved folder keeps its own (the id
        whose folder holds no tasks now and whose tasks are now here)."""
        dirty = False
        vacant = {f: i for f, i in self.folders.items() if f not in holding}
        new = holding - set(self.folders)
        left: dict = {}  # uid -> the folder it left lately (the newest such tombstone)
        for _seq, u, _href, old, _p in self.gone[-200:] if new else ():
            left[u] = old
        for folder in sorted(new):
            came: dict = {}
            for uid, t in tasks.items():
                if t["folder"] == folder and left.get(uid) in vacant:
                    came[left[uid]] = came.get(left[uid], 0) + 1
            if came:
                old = max(came, key=came.get)
                self.folders[folder] = self.folders.pop(old)
                vacant.pop(old)
            else:
                self.folders[folder] = secrets.token_hex(6)
            dirty = True
        return dirty

    # -- asking ---------------------------------------------------------------------------

    def folder_of_list(self, list_id: str) -> str | None:
        for folder, i in list(self.folders.items()):  # (a refresh may add one meanwhile)
            if i == list_id:
                return folder
        return None

    def claim(self, path: str, text: str, uid: str, href: str) -> None:
        """A client's write is putting the line `text` into path (a new task, or one of its
        own rewritten): that line is the task `uid`, however much its text changed."""
        now = time.monotonic()
        with self.lock:
            for old in [k for k, c in self.claims.items() if now - c[2] > CLAIM_SECONDS]:
                del self.claims[old]
            self.claims[(path, task_key(text))] = (uid, href, now)

    def sync_mac(self, text: str) -> str:
        """The signature of a sync token's text: only tokens this server gave are taken."""
        return hmac.new(self.secret, text.encode("utf-8"), hashlib.sha256).hexdigest()[:16]

    def floor_within(self, within: Callable) -> int:
        """The newest tombstone forgotten in the folders `within` accepts (a sync token
        older than it can't be answered: it would miss that removal)."""
        floors = list(self.floors.items())
        return max((seq for f, seq in floors if f == "*" or within(f)), default=0)

    def seq_of(self, uid: str) -> int:
        rec = self.ids.get(uid)
        return rec.get("seq", 0) if rec else 0


def task_book(svc: Any) -> TaskBook:
    """Return the Service's TaskBook (`svc.task_book`), made on first use."""
    book = svc.task_book
    if book is None:
        with _BOOK_START:
            book = svc.task_book
            if book is None:
                book = TaskBook(svc.notes, svc.config.state_dir, svc.config.timezone)
                svc.task_book = book
    return book


_BOOK_START = threading.Lock()


def task_line_of(done: bool, summary: str, due: Any, categories: list, indent: str = "") -> str:
    """A new task line as a person would write it."""
    text = " ".join(summary.split()) or "Task"
    tags = [c for c in categories if f"#{c}" not in text.split()]
    line = f"{indent}- [{'x' if done else ' '}] {text}"
    if isinstance(due, dt.datetime):
        line += f" ⏰ {due:%Y-%m-%d %H:%M}"
    elif isinstance(due, dt.date):
        line += f" 📅 {due:%Y-%m-%d}"
    for tag in tags:
        clean = re.sub(r"[^\w/-]", "", tag.replace(" ", "-"))
        if clean:
            line += f" #{clean}"
    return line
