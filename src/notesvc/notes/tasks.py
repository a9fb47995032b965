"""Task lines: the `- [ ]` lines of the notes as iCalendar VTODOs, and their identities."""

from __future__ import annotations

import datetime as dt
import difflib
import hashlib
import json
import os
import re
import secrets
import stat
import threading
import time
from typing import Any

from notesvc.errors import ApiError
from notesvc.helpers import atomic_write, disk_writes, flush_each, time_zone, timestamp_of
from notesvc.notes.paths import note_title

# == task lines ===============================================================
#
# docs/api.md (CalDAV): a task line is a list item (`-`, `*`, `+`, `1.`, `1)`, any
# indentation) whose text starts with `[ ]` or `[x]`, outside fenced code and front matter.
# Its dates (`📅 2026-12-02`, `due:2026-12-02`, `⏰ 2026-12-02 09:00`) and `#tags` are parsed
# out of its SUMMARY; the tags stay in the text. Nesting (a task indented under another) is
# RELATED-TO. Lines split on "\n" only, so a line edit never touches the others.

TASK_LINE_RE = re.compile(r"^([ \t]*)([-*+]|\d{1,9}[.)])([ \t]+)\[([ xX])\](?=[ \t]|$)(.*)$")
_TASK_FENCE_RE = re.compile(r"^[ \t]*(`{3,}|~{3,})")
DUE_DATE_RE = re.compile(r"(?:📅\ufe0f?[ \t]*|(?<!\S)due:[ \t]*)(\d{4})-(\d{2})-(\d{2})(?!\d)")
# the reminder syntax of providers/reminders.py (REMINDER_RE), read here too
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


def parse_task(rest: str) -> dict:
    """Return summary, due, alarm (naive wall time) and categories of a task's text."""
    due: Any = None
    m = DUE_DATE_RE.search(rest)
    if m:
        try:
            due = dt.date(*(int(g) for g in m.groups()))
        except ValueError:
            due = None
    alarm = None
    a = ALARM_RE.search(rest)
    if a:
        try:
            alarm = dt.datetime(*(int(g) for g in a.groups()))
        except ValueError:
            alarm = None
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


def alarm_utc(wall: dt.datetime | None, zone_name: str) -> dt.datetime | None:
    if wall is None:
        return None
    ts = timestamp_of(wall, time_zone(zone_name))
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).replace(tzinfo=None)


# == iCalendar (RFC 5545) =====================================================


def ical_escape(value: str) -> str:
    return (
        value.replace("\\", "\\\\")
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


def ical_utc(when: dt.datetime) -> str:
    return when.strftime("%Y%m%dT%H%M%SZ")


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
        out.append(f"DUE;VALUE=DATE:{due:%Y%m%d}")
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


def ical_when(value: str, params: dict) -> Any:
    """Return a date, or a UTC datetime (naive), of a DATE / DATE-TIME value."""
    value = value.strip()
    try:
        if params.get("VALUE", "").upper() == "DATE" or re.fullmatch(r"\d{8}", value):
            return dt.datetime.strptime(value, "%Y%m%d").date()
        utc = value.endswith("Z")
        wall = dt.datetime.strptime(value.rstrip("Z"), "%Y%m%dT%H%M%S")
    except ValueError:
        raise ICalError(f"not a date or time: {value[:40]!r}") from None
    if utc:
        return wall
    zone = time_zone(params["TZID"]) if params.get("TZID") else None
    if params.get("TZID") and zone is None:
        raise ICalError(f"unknown time zone {params['TZID'][:60]}")
    ts = timestamp_of(wall, zone)
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).replace(tzinfo=None)


# == identities ===============================================================
#
# A task's UID and the state around it (when it was first seen ticked, its last change,
# the href a client gave it) live in <state>/caldav.json, never in the note. On each look
# the notes that changed are parsed again and their tasks matched to the UIDs they had:
# the same line text first, then the closest (a small edit of its own text, by difflib's
# ratio), then a task whose note is gone (a moved note), then a new UID. Each change takes
# the next sequence number: a list's sync-token is the highest, and tombstones of removed
# tasks answer sync-collection with 404s.

MATCH_RATIO = 0.6  # how alike a task's text must stay to keep its UID through an edit
TOMBSTONES = 5000  # removed tasks remembered for sync-collection


def new_uid() -> str:
    return secrets.token_hex(8) + "-" + secrets.token_hex(4)


class TaskBook:
    """The tasks of every note and their identities (one per Service: `task_book`)."""

    def __init__(self, notes: Any, state_dir: Any, zone_name: str = ""):
        self.notes = notes
        self.file = state_dir / "caldav.json"
        self.zone = zone_name
        self.lock = threading.RLock()
        self.parsed: dict = {}  # note path -> (signature, title, [task dicts])
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
        self.folders: dict = dict(kept.get("folders", {}))  # folder path -> list id
        self.ids: dict = dict(kept.get("tasks", {}))  # uid -> record
        self.gone: list = list(kept.get("gone", []))  # [seq, uid, href, folder, path]
        self.sigs: dict = dict(kept.get("sigs", {}))  # note path -> [size, mtime_ns]
        self._replay()
        self.claims: dict = {}  # (path, key) -> (uid, href): a client's new task
        self.tasks: dict = {}  # uid -> the task as served (after refresh)
        self.by_href: dict = {}  # an item's name -> its uid
        self.holding: set = set()  # the folders that hold tasks

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
            whole = {"gen": self.gen, "seq": self.seq, "floor": self.floor}
            whole.update(folders=self.folders, tasks=self.ids, gone=self.gone, sigs=self.sigs)
            atomic_write(self.file, json.dumps(whole, ensure_ascii=False).encode("utf-8"))
            atomic_write(self.log_file, b"")
            self.logged = 0
            return
        change = {"gen": self.gen, "seq": self.seq, "floor": self.floor, "folders": self.folders}
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
        are looked at again (all of them again when it no longer holds those changes)."""
        with self.lock:
            journal = getattr(self.notes, "journal", None)
            last = journal.last if journal is not None else None
            if not force and last is not None and last == self.seen_journal and self.loaded:
                return self.tasks
            scan, removed = self._look(journal, last, force)
            changed = [p for p, sig in scan.items() if self.sigs.get(p) != list(sig)]
            if changed or removed or not self.loaded:
                self._reconcile(scan, changed, removed)
            self.loaded = True
            self.seen_journal = last
            return self.tasks

    def _look(self, journal: Any, last: Any, force: bool) -> tuple:
        """({note: signature}, [notes gone]) of every note, or of those the journal names."""
        paths = self._journal_paths(journal, last) if self.loaded and not force else None
        if paths is None:
            scan = self.notes.scan()
            return scan, [p for p in self.sigs if p not in scan]
        scan = {}
        for p in paths:
            sig = self._stat(p)
            if sig is not None:
                scan[p] = sig
        return scan, [p for p in paths if p not in scan and p in self.sigs]

    def _journal_paths(self, journal: Any, last: Any) -> set | None:
        """The notes changed since the last look, as the journal has them (None: unknown)."""
        since = self.seen_journal
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

    def _parse(self, path: str) -> tuple:
        try:
            data, _st = self.notes.read_raw(path)
            text = data.decode("utf-8", "replace")
        except Exception:  # gone or unreadable meanwhile: no tasks
            return "", []
        return note_title(text, path), task_lines(text)

    def _reconcile(self, scan: dict, changed: list, removed: list) -> None:
        for p in scan:
            if p not in self.parsed or p in changed:
                self.parsed[p] = self._parse(p)
        for p in removed:
            self.parsed.pop(p, None)
        by_path: dict = {}
        for uid, rec in self.ids.items():
            by_path.setdefault(rec["path"], []).append(uid)
        orphans = [u for p in removed for u in by_path.get(p, [])]  # a moved note's, maybe
        assigned: dict = {}  # path -> [uid per task]
        for p in changed:
            olds = by_path.get(p, [])
            assigned[p] = self._match(olds, self.parsed[p][1])
            orphans += [u for u in olds if u not in assigned[p]]
        self._place(assigned, orphans)
        before = self.tombstones
        dirty = self._bury(orphans)
        self._keep_places(assigned, scan, removed)
        dirty = self._settle(set(changed) | set(removed)) or dirty or bool(changed or removed)
        if dirty:
            uids = {u for found in assigned.values() for u in found} | set(orphans)
            self.save(uids if self.loaded else None, [*changed, *removed], self.tombstones - before)

    def _keep_places(self, assigned: dict, scan: dict, removed: list) -> None:
        """Record where each task of the changed notes is now, and the notes' signatures."""
        for p, uids in assigned.items():
            for i, uid in enumerate(uids):
                key = task_key(self.parsed[p][1][i]["text"])
                self.ids[uid].update(path=p, key=key, line=i)
            self.sigs[p] = list(scan[p])
        for p in removed:
            self.sigs.pop(p, None)

    def _place(self, assigned: dict, orphans: list) -> None:
        """Give each task still without a UID one: a client's claim on its line, else a
        task of a vanished note with the same text (the note moved), else a new one."""
        left: dict = {}
        for u in orphans:
            left.setdefault(self.ids[u]["key"], []).append(u)
        for p, uids in assigned.items():
            for i, uid in enumerate(uids):
                if uid is not None:
                    continue
                key = task_key(self.parsed[p][1][i]["text"])
                claim = self.claims.pop((p, key), None)
                if claim is not None:
                    uid, href = claim
                    self.ids[uid] = {"path": p, "key": key, "href": href}
                elif left.get(key):
                    uid = left[key].pop(0)
                    orphans.remove(uid)
                else:
                    uid = new_uid()
                    self.ids[uid] = {"path": p, "key": key, "href": f"{uid}.ics"}
                uids[i] = uid

    def _bury(self, gone: list) -> bool:
        """Forget removed tasks, keeping a tombstone of each for sync-collection."""
        for u in gone:
            rec = self.ids.pop(u)
            self.seq += 1
            self.gone.append([self.seq, u, rec.get("href", f"{u}.ics"), rec.get("folder"), None])
            self.tombstones += 1
        if len(self.gone) > TOMBSTONES:
            self.floor = self.gone[-TOMBSTONES - 1][0]
            self.gone = self.gone[-TOMBSTONES:]
        return bool(gone)

    def _match(self, olds: list, found: list) -> list:
        """Pair a note's tasks with the UIDs its tasks had: the same text, then the nearest."""
        uids: list = [None] * len(found)
        free = list(olds)
        keys = [task_key(t["text"]) for t in found]
        for i, key in enumerate(keys):
            for u in free:
                if self.ids[u]["key"] == key:
                    uids[i] = u
                    free.remove(u)
                    break
        for i, key in enumerate(keys):
            if uids[i] is not None or not free:
                continue
            best, score = None, MATCH_RATIO
            for u in free:
                r = difflib.SequenceMatcher(None, self.ids[u]["key"], key).ratio()
                if r >= score:
                    best, score = u, r
            if best is not None:
                uids[i] = best
                free.remove(best)
        return uids

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
        self.by_href = {t["href"]: u for u, t in tasks.items()}
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
        for folder in sorted(holding - set(self.folders)):
            came = {}
            for uid, t in tasks.items():
                if t["folder"] == folder:
                    for _seq, u, _href, old, _p in reversed(self.gone[-200:]):
                        if u == uid and old in vacant:
                            came[old] = came.get(old, 0) + 1
                            break
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
        """A client's new task is being written as `text` into path: it gets that UID."""
        with self.lock:
            self.claims[(path, task_key(text))] = (uid, href)

    def seq_of(self, uid: str) -> int:
        rec = self.ids.get(uid)
        return rec.get("seq", 0) if rec else 0


def task_book(svc: Any) -> TaskBook:
    book = getattr(svc, "_task_book", None)
    if book is None:
        with _BOOK_START:
            book = getattr(svc, "_task_book", None)
            if book is None:
                book = TaskBook(svc.notes, svc.config.state_dir, svc.config.timezone)
                svc._task_book = book
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
