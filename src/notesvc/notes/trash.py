"""The trash and the change journal: what a deletion keeps, and the feed of every change."""

from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import datetime as dt
import errno
import hashlib
import json
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from notesvc.boot import API, log
from notesvc.errors import bad_request, gone, not_found, to_json
from notesvc.helpers import atomic_write, disk_writes, flush_each, fsync_dir, iso, utcnow
from notesvc.notes.history import DAY_SECONDS
from notesvc.notes.paths import (
    ATTACHMENTS,
    NOTES,
    attachment_path,
    missing_folders,
    nfc,
    note_path,
    remove_empty_folders,
)

if TYPE_CHECKING:  # annotations only: these modules come later
    from notesvc.notes.store import NoteStore

# -- the trash and the change journal --------------------------------------------------------
#
# The note itself when deleted (Trash), and a numbered entry in the change feed for every
# change (ChangeJournal); expire_loop applies the retention of history and trash.

TRASH_TOPS = (NOTES, ATTACHMENTS)  # what a trash folder holds: notes and attachments
TRASH_STAMP = "%Y%m%dT%H%M%S.%fZ"  # a trash folder's name: when its item was deleted (UTC)
TRASH_ID_RE = re.compile(r"^([0-9A-Za-z]{1,64})-([0-9a-f]{16})\Z")


def move_to_trash(src: Path, trash: Path, path: str, guard: Any = None) -> dict:
    """Move src into the trash as <trash>/<UTC stamp>/<path> (new folders private, the
    rename made durable) inside `guard`; return {trash, trashId}. A failure (507 on a
    full disk) leaves the trash as it was."""
    stamp = utcnow().strftime(TRASH_STAMP)
    dst = trash / stamp / path
    made = missing_folders(dst.parent, trash.parent)
    try:
        with guard or contextlib.nullcontext(), disk_writes():
            for folder in reversed(made):  # private, as all of the state folder
                folder.mkdir(mode=0o700, exist_ok=True)
            os.replace(src, dst)
    except BaseException:
        for folder in made:  # deepest first
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    fsync_dir(dst.parent)
    fsync_dir(src.parent)
    return {"trash": f".notesvc/trash/{stamp}/{path}", "trashId": trash_id(stamp, path)}


def trash_id(stamp: str, path: str) -> str:
    """Return a trash item's id: its folder's letters and digits, a hash of its path."""
    digest = hashlib.sha256(f"{stamp}/{path}".encode("utf-8", "surrogateescape")).hexdigest()
    return re.sub(r"[^0-9A-Za-z]", "", stamp)[:64] + "-" + digest[:16]


@dataclasses.dataclass(frozen=True)
class TrashItem:
    id: str
    path: str  # notes/... or attachments/..., as it was before the delete
    file: Path
    deleted: float  # seconds since the epoch
    size: int

    @property
    def kind(self) -> str:
        return "note" if self.path.startswith(NOTES + "/") else "attachment"

    def describe(self) -> dict:
        return {
            "id": self.id,
            "path": self.path,
            "kind": self.kind,
            "deletedAt": iso(self.deleted),
            "size": self.size,
        }


class Trash:
    """Deleted notes and attachments: <state>/trash/<UTC stamp>/<path>, where the deletes
    put them. Items older than `days` are purged by purge_expired() (0: kept until purged
    by hand); restoring a note is NoteStore's (history, journal, index), restoring an
    attachment moves its file back.
    """

    def __init__(self, folder: Path, days: int, clock: Callable = time.time):
        self.folder = folder
        self.days = days
        self.clock = clock  # injectable, as the history's

    def _stamps(self) -> list:
        try:
            return [
                e
                for e in os.scandir(self.folder)
                if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)
            ]
        except FileNotFoundError:
            return []

    @staticmethod
    def _deleted_at(entry: os.DirEntry) -> float:
        try:
            return (
                dt.datetime.strptime(entry.name, TRASH_STAMP)
                .replace(tzinfo=dt.timezone.utc)
                .timestamp()
            )
        except ValueError:  # a folder named otherwise: its own time
            return entry.stat(follow_symlinks=False).st_mtime

    def _items_in(self, entry: os.DirEntry) -> list:
        deleted, items = self._deleted_at(entry), []
        for top in TRASH_TOPS:
            stack = [(os.path.join(entry.path, top), top)]
            while stack:
                real, rel = stack.pop()
                try:
                    children = list(os.scandir(real))
                except (FileNotFoundError, NotADirectoryError, PermissionError):
                    continue
                for e in children:
                    if e.name.startswith(".") or e.is_symlink():
                        continue
                    name = f"{rel}/{nfc(e.name)}"
                    if e.is_dir():
                        stack.append((e.path, name))
                    else:
                        with contextlib.suppress(OSError):
                            size = e.stat().st_size
                            items.append(
                                TrashItem(
                                    trash_id(entry.name, name), name, Path(e.path), deleted, size
                                )
                            )
        return items

    def items(self) -> list:
        """Return every item in the trash, the most recently deleted first."""
        found = [item for entry in self._stamps() for item in self._items_in(entry)]
        return sorted(found, key=lambda i: (-i.deleted, i.path))

    def find(self, item_id: str) -> TrashItem:
        """Return the item of an id; 400 for a malformed id, 404 for an unknown one."""
        m = TRASH_ID_RE.match(item_id)
        if not m:
            raise bad_request(f"{item_id[:80]!r} is not a trash item id (see GET {API}/trash)")
        for entry in self._stamps():
            if re.sub(r"[^0-9A-Za-z]", "", entry.name)[:64] == m.group(1):
                for item in self._items_in(entry):
                    if item.id == item_id:
                        return item
        raise not_found(f"no item {item_id} in the trash")

    def purge(self, item: TrashItem) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(item.file)
        self.emptied(item)

    def purge_expired(self) -> int:
        """Remove the trash folders older than `days`; return how many items went."""
        if not self.days:
            return 0
        cutoff, purged = self.clock() - self.days * DAY_SECONDS, 0
        for entry in self._stamps():
            if self._deleted_at(entry) < cutoff:
                purged += len(self._items_in(entry))
                shutil.rmtree(entry.path, ignore_errors=True)  # never follows links
        return purged

    def emptied(self, item: TrashItem) -> None:
        """After an item left: remove the folders it leaves empty."""
        remove_empty_folders(item.file.parent, self.folder)

    def usage(self) -> dict:
        items = [item for entry in self._stamps() for item in self._items_in(entry)]
        return {"items": len(items), "bytes": sum(i.size for i in items)}


def attachment_or_note_path(raw: Any) -> str:
    """Return a checked path under notes/ or attachments/ (a trash item's destination)."""
    if isinstance(raw, str) and raw.startswith(f"{ATTACHMENTS}/"):
        return attachment_path(raw)
    return note_path(raw)


CHANGE_KINDS = ("created", "updated", "moved", "deleted", "restored")


def _allocate(fd: int, offset: int, length: int) -> None:
    """Allocate length bytes of a file from offset, so writing there later needs no space."""
    if hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, offset, length)
            return
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
    os.pwrite(fd, bytes(length), offset)


_fdatasync = getattr(os, "fdatasync", os.fsync)


def _change_of(line: bytes, after: int) -> tuple | None:
    """Return a journal line as an entry tuple, None when it is not one (a torn write)."""
    try:
        d = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    if (
        not isinstance(d, dict)
        or not isinstance(d.get("seq"), int)
        or d["seq"] <= after
        or d.get("kind") not in CHANGE_KINDS
        or not isinstance(d.get("path"), str)
    ):
        return None
    origin = d.get("from") if d["kind"] == "moved" else d.get("conflictOf")
    by = d.get("by") if isinstance(d.get("by"), str) else None
    person = d.get("person")
    if not (
        isinstance(person, dict)
        and isinstance(person.get("id"), str)
        and isinstance(person.get("name"), str)
    ):
        person = None
    else:
        person = {"id": person["id"], "name": person["name"]}
    return (d["seq"], d["kind"], d["path"], origin, d.get("etag"), d.get("at", ""), by, person)


def change_record(entry: tuple, stored: bool = False) -> dict:
    """Return a journal entry (seq, kind, path, origin, etag, at, by, person) as the feed
    gives it: the origin is a move's `from`, a created conflict copy's `conflictOf` (the
    note it keeps an edit of); a person's change names them (`person: {id, name}`) and the
    device (`savedBy`, as history's). `stored`: as the journal's file keeps it, with `by`
    (who created a note, as history's savedBy: the note's history shows it, the feed
    shows it for a person's changes only)."""
    seq, kind, path, origin, etag, at, by, person = entry
    rec = {"seq": seq, "kind": kind, "path": path}
    if origin is not None:
        rec["from" if kind == "moved" else "conflictOf"] = origin
    if etag is not None:
        rec["etag"] = etag
    rec["at"] = at
    if stored:
        if by is not None:
            rec["by"] = by
        if person is not None:
            rec["person"] = person
    elif person is not None:
        rec["person"] = dict(person)
        rec["savedBy"] = by
    return rec


class ChangeJournal:
    """Every change to the notes, numbered in order: <state>/changes.log.

    A header line {"floor": F}, then one JSON object a line. A cursor below F (compacted
    away) or above the last number cannot be answered for (410). An entry is written and
    fdatasync'ed before anyone learns of it, under one lock, so numbers are given, stored
    and seen in one order. Room for entries is allocated in the file ahead of time:
    reserve() (507 on a full disk) comes before a change, so recording a change once made
    never fails for want of space. The newest entries stay in memory; the file is
    compacted to the newest `keep` when it holds twice as many.
    """

    RESERVE = 16384  # bytes allocated ahead
    ENTRY_MAX = 8192  # an entry's line is at most ~4.3 KB (two 512-character paths)

    def __init__(self, path: Path, keep: int = 10000, clock: Callable = time.time):
        self.path = path
        self.keep = keep  # injectable, as the clock: compaction is tested with a small one
        self.clock = clock
        self.floor = 0
        self.last = 0
        self.fresh = False  # this run created it: the first rescan is its starting point
        self._cond = threading.Condition()
        self._seqs: list = []
        self._entries: list = []  # (seq, kind, path, origin, etag, at, by), oldest first
        self._open = False  # open() found or made the file: entries are stored
        self._end = 0  # where the next line goes
        self._allocated = 0  # the file's bytes (zeros past _end)
        self._promised = 0  # entries reserve() made room for, not yet appended
        self._compact_at = 0  # after a failed compaction: when to try again
        self._waiting: collections.Counter = collections.Counter()
        self._closed = False
        self._nudges = 0  # bumped when who sees what changed: waiting feeds look again
        # a folder -> the numbers of the changes below it (a move's at both ends), oldest
        # first: a feed that sees part of the notes finds its own without looking at others'
        self._under: dict = {}

    def open(self) -> ChangeJournal:
        """Read the journal, creating it when missing; a torn last line is dropped."""
        with self._cond:
            try:
                raw = self.path.read_bytes()
            except FileNotFoundError:
                self.fresh = True
                self._rewrite([], 0)
                return self
            lines = raw.split(b"\0", 1)[0].split(b"\n")
            try:
                header = json.loads(lines[0])
                floor = header["floor"] if isinstance(header, dict) else None
            except (ValueError, UnicodeDecodeError):
                floor = None
            entries, end, after = [], len(lines[0]) + 1, floor if isinstance(floor, int) else -1
            for line in lines[1:-1]:  # the last piece is what follows the last newline
                entry = _change_of(line, after)
                if entry is None:
                    break
                entries.append(entry)
                end, after = end + len(line) + 1, entry[0]
            if not isinstance(floor, int) or floor < 0:
                log.warning(
                    "changes.log: unreadable header; the feed starts over (410 for clients)"
                )
                self._rewrite([], max(0, after))
                return self
            self.floor, self.last = floor, after if entries else floor
            self._entries, self._seqs = entries, [e[0] for e in entries]
            self._reindex()
            with self._file() as fd:
                os.ftruncate(fd, end)  # a torn line and the old allowance go
            self._open, self._end, self._allocated = True, end, end
            if len(entries) > self.keep:
                self._compact()
        return self

    def _rewrite(self, entries: list, floor: int) -> None:
        """Write the journal anew (atomically) with these entries above floor."""
        lines = [to_json({"notesvc": "changes", "floor": floor}) + b"\n"]
        lines += [to_json(change_record(e, stored=True)) + b"\n" for e in entries]
        content = b"".join(lines)
        room = self.RESERVE + self._promised * self.ENTRY_MAX

        def write(f) -> None:
            f.write(content)
            f.flush()
            _allocate(f.fileno(), len(content), room)

        atomic_write(self.path, write, mode=0o600)
        self._open, self._end, self._allocated = True, len(content), len(content) + room
        self.floor, self.last = floor, max(floor, entries[-1][0] if entries else floor)
        self._entries, self._seqs = list(entries), [e[0] for e in entries]
        self._reindex()

    def _reindex(self) -> None:
        """Index the entries held by the folders they are under (open, compaction)."""
        self._under = {}
        for e in self._entries:
            self._file_under(e)

    def _file_under(self, entry: tuple) -> None:
        """Add an entry's number to the folders above its path (and a move's origin)."""
        seq, under = entry[0], self._under
        for path in (entry[2], entry[3]) if entry[1] == "moved" else (entry[2],):
            at = path.find("/") if path else -1
            while at > 0:
                seqs = under.get(path[:at])
                if seqs is None:
                    under[path[:at]] = [seq]
                elif seqs[-1] != seq:  # (a move within one folder: once)
                    seqs.append(seq)
                at = path.find("/", at + 1)

    @contextlib.contextmanager
    def _file(self):
        """Open the journal for one operation (no descriptor is held between them)."""
        fd = os.open(self.path, os.O_RDWR)
        try:
            yield fd
        finally:
            os.close(fd)

    def _compact(self) -> None:
        kept = self._entries[-self.keep :]
        try:
            self._rewrite(kept, kept[0][0] - 1 if kept else self.last)
        except OSError as e:  # the old file stays good; try again after a while
            log.warning("changes.log: could not compact it (%s)", e)
            self._compact_at = len(self._entries) + max(1, self.keep // 10)

    def reserve(self) -> None:
        """Make room for one more entry before a change; DiskFull (507) when there is none.
        The change then calls append() or, when it failed, release()."""
        with self._cond:
            if not self._open:
                return
            need = (self._promised + 1) * self.ENTRY_MAX
            if self._allocated - self._end < need:
                with disk_writes(), self._file() as fd:
                    _allocate(fd, self._end, need + self.RESERVE)
                self._allocated = self._end + need + self.RESERVE
            self._promised += 1

    def release(self) -> None:
        with self._cond:
            self._promised = max(0, self._promised - 1)

    def append(
        self,
        kind: str,
        path: str,
        etag: str | None = None,
        origin: str | None = None,
        reserved: bool = True,
        by: str | None = None,
        person: dict | None = None,
    ) -> int:
        """Record a change that was made, wake the waiting feeds; return its number. `by`:
        who made it, as history's savedBy (kept for a `created` entry, and for a person's
        changes); `person`: {id, name} of the person who made it."""
        with self._cond:
            if reserved:
                self._promised = max(0, self._promised - 1)
            seq = self.last + 1
            entry = (seq, kind, path, origin, etag, iso(self.clock()), by, person)
            if self._open:
                line = to_json(change_record(entry, stored=True)) + b"\n"
                try:
                    with self._file() as fd:
                        if self._end + len(line) > self._allocated:  # not reserved: the rescan
                            _allocate(fd, self._end, len(line) + self.RESERVE)
                            self._allocated = self._end + len(line) + self.RESERVE
                        os.pwrite(fd, line, self._end)
                        if flush_each():
                            _fdatasync(fd)
                    self._end += len(line)
                except OSError as e:
                    log.error("changes.log: could not store change %d (%s)", seq, e)
            self.last = seq
            self._seqs.append(seq)
            self._entries.append(entry)
            self._file_under(entry)
            if len(self._entries) > max(2 * self.keep, self._compact_at):
                self._compact()
            self._cond.notify_all()
            return seq

    def reset(self) -> None:
        """Forget the entries: every cursor from before answers 410 (re-list)."""
        with self._cond:
            try:
                self._rewrite([], self.last)
            except OSError as e:
                log.warning("changes.log: could not reset it (%s)", e)
                self.floor, self._entries, self._seqs = self.last, [], []
                self._under = {}
            self._cond.notify_all()

    def read(self, since: int, limit: int) -> dict:
        """Return {changes, last, more}: the changes after `since` (at most limit); 410
        when the journal no longer holds them (or never did: a cursor from the future)."""
        with self._cond:
            if since < self.floor:
                raise gone(
                    f"changes up to {self.floor} were compacted away; list the notes again "
                    f"and follow from since={self.last}"
                )
            if since > self.last:
                raise gone(
                    f"this server's changes end at {self.last}; list the notes again and "
                    f"follow from since={self.last}"
                )
            i = bisect.bisect_right(self._seqs, since)
            chunk = self._entries[i : i + limit]
            more = i + limit < len(self._entries)
        return {
            "changes": [change_record(e) for e in chunk],
            "last": chunk[-1][0] if chunk else since,
            "more": more,
        }

    def _newest_under(self, folders: tuple) -> int | None:
        """Return the newest number of a change under one of `folders`, None if the
        journal holds none (called holding the lock)."""
        found = [seqs[-1] for seqs in map(self._under.get, folders) if seqs]
        return max(found) if found else None

    def read_seen(self, since: int, limit: int, folders: tuple, record: Callable) -> dict:
        """Return {changes, last, more} as one who sees the notes under `folders` sees the
        feed: record(entry, inside, was) is an entry's record to it (inside: the entry's
        path is under them; was: a move's origin is). The numbers have gaps, and `last` is
        the newest change it sees: its cursor never moves for a change it may not see, nor
        tells how many there were. 410 for a cursor below the journal's floor or beyond
        the newest change it sees. Its changes are found through the folders' index: what
        it reads costs what it sees, not what everyone else changed."""
        below, exact = tuple(f + "/" for f in folders), frozenset(folders)
        with self._cond:
            floor, newest = self.floor, self._newest_under(folders)
            seen_last = max(floor, newest if newest is not None else floor)
            if since < floor or since > seen_last:
                raise gone(
                    "this cursor is no longer answered for here; list the notes again and "
                    f"follow from since={seen_last}"
                )
            runs = []
            for under in map(self._under.get, folders):
                if under:
                    i = bisect.bisect_right(under, since)
                    runs.append(under[i : i + limit + 1])
            # (a move under two of its folders is one change)
            numbers = runs[0] if len(runs) == 1 else sorted(set().union(*runs))[: limit + 1]
            seqs, entries = self._seqs, self._entries
            if seqs and seqs[-1] - seqs[0] == len(seqs) - 1:  # no gaps: where n is, at once
                first = seqs[0]
                picked = [entries[n - first] for n in numbers]
            else:
                picked = [entries[bisect.bisect_left(seqs, n)] for n in numbers]
        out = []
        for e in picked[:limit]:
            seen_here = e[2].startswith(below) or e[2] in exact
            was = e[1] == "moved" and (e[3].startswith(below) or e[3] in exact)
            out.append(record(e, seen_here, was))
        more = len(picked) > limit
        return {"changes": out, "last": out[-1]["seq"] if out else since, "more": more}

    def seen_latest(self, folders: tuple) -> int:
        """Return the newest change under `folders`, or the floor: where one who sees
        them follows from."""
        with self._cond:
            newest = self._newest_under(folders)
            return max(self.floor, newest if newest is not None else self.floor)

    def creation(self, path: str) -> tuple | None:
        """Return (at, by, the path it was made at) of the note now at path, its `created`
        entry followed back through its moves, while the journal holds it; None otherwise
        (compacted away, made unseen, or a deletion in between)."""
        with self._cond:
            for _, kind, at_path, origin, _, at, by, _ in reversed(self._entries):
                if at_path != path:
                    continue
                if kind == "created":
                    return at, by, path
                if kind == "deleted":
                    return None  # the note now there came after it, unseen
                if kind == "moved":
                    path = origin
        return None

    def latest(self) -> int:
        """Return the number of the newest change: the cursor a new follower starts from."""
        with self._cond:
            return self.last

    def wait_after(
        self, since: int, timeout: float, pool: str, cap: int, nudges: int | None = None
    ) -> bool | None:
        """Wait up to timeout s for a change after `since` (or, given `nudges`, a nudge()
        after that count); return whether one came, or None at once when `pool` already
        has `cap` waiters (each holds a worker thread)."""
        with self._cond:
            if self._waiting[pool] >= cap:
                return None
            self._waiting[pool] += 1

            def woken() -> bool:
                nudged = nudges is not None and self._nudges != nudges
                return self.last > since or self._closed or nudged

            try:
                return self._cond.wait_for(woken, timeout)
            finally:
                self._waiting[pool] -= 1

    def take_slot(self, pool: str, cap: int) -> bool:
        """Hold one of `pool`'s `cap` waiting places for a follower that stays (an MCP
        session's stream): False when they are all taken. give_slot() gives it back."""
        with self._cond:
            if self._waiting[pool] >= cap:
                return False
            self._waiting[pool] += 1
            return True

    def give_slot(self, pool: str) -> None:
        with self._cond:
            self._waiting[pool] -= 1

    def wait_past(self, since: int, timeout: float, stop: Callable = lambda: False) -> bool:
        """Wait up to timeout s for a change after `since` (or stop(), or the server
        stopping), a place already held (take_slot); return whether a change came."""
        with self._cond:
            self._cond.wait_for(lambda: self.last > since or self._closed or stop(), timeout)
            return self.last > since

    @property
    def closed(self) -> bool:
        return self._closed

    def nudges(self) -> int:
        """Return how many times who sees what changed (wait_after's `nudges`)."""
        with self._cond:
            return self._nudges

    def nudge(self) -> None:
        """Wake the waiting feeds and MCP streams to look at their principal again (a share
        ended, a key was revoked: what a feed shows is cut at once, a waiting one too) and a
        stream at its stop() (replaced, its session ended)."""
        with self._cond:
            self._nudges += 1
            self._cond.notify_all()

    def waiting(self) -> int:
        with self._cond:
            return sum(self._waiting.values())

    def close(self) -> None:
        """Wake every waiter: the server stops."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def expire_loop(notes: NoteStore, trash: Trash, stop: threading.Event, every: float = 3600) -> None:
    """Apply the retention of history and trash now, then every `every` s until stop."""
    first = True
    while True:
        removed = purged = 0
        try:
            removed = notes.sweep_history(fix_modes=first)
            first = False
        except Exception:
            log.exception("history's retention sweep failed; trying again in %.0f s", every)
        try:  # on its own: a history that cannot be swept still lets the trash be purged
            purged = trash.purge_expired()
        except Exception:
            log.exception("trash purge failed; trying again in %.0f s", every)
        if removed or purged:
            log.info("retention: %d versions and %d trash items removed", removed, purged)
        if stop.wait(every):
            return
