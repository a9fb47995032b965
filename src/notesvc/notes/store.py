"""NoteStore and AttachmentStore: notes on disk, their locks, the records read lately."""

from __future__ import annotations

import collections
import contextlib
import errno
import hashlib
import json
import os
import re
import stat
import tempfile
import threading
import time
import unicodedata
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Callable

from notesvc.boot import log
from notesvc.errors import (
    ApiError,
    PreconditionFailed,
    bad_request,
    not_found,
    success_body,
    to_json,
)
from notesvc.helpers import (
    BODY_CHUNK,
    TEMP_PREFIX,
    TEMP_SUFFIX,
    UMASK,
    atomic_write,
    disk_writes,
    flush_each,
    fsync_dir,
    if_match_allows,
    iso,
    log_safe,
    replace_atomically,
    sweep_temp_files,
)
from notesvc.notes.history import HeadStore, HeadStoreError, HistoryStore
from notesvc.notes.merge import change_summary, merge3, sort_key
from notesvc.notes.paths import (
    ATTACHMENT_TYPES,
    ATTACHMENTS,
    MAX_SEGMENT_BYTES,
    NOTES,
    attachment_path,
    content_type_of,
    is_note_name,
    make_etag,
    missing_folders,
    nfc,
    note_path,
    note_preview,
    note_tags,
    note_title,
    remove_empty_folders,
    walk_entries,
)
from notesvc.notes.trash import ChangeJournal, TrashItem, move_to_trash

# -- the store: notes on disk, their locks and the records read lately ---------------


def disk_path(base: Path, path: str) -> Path:
    """Return where an (NFC) path under base is on disk (see NoteStore.on_disk)."""
    target = base / path
    if path.isascii() or os.path.lexists(target):
        return target
    at = base
    segments = path.split("/")
    for i, seg in enumerate(segments):
        step = at / seg
        if not os.path.lexists(step):
            try:
                names = sorted(os.listdir(at)) if not seg.isascii() else []
            except OSError:
                names = []
            same = [n for n in names if unicodedata.normalize("NFC", n) == seg]
            if not same:
                return step.joinpath(*segments[i + 1 :])
            step = at / same[0]
        at = step
    return at


class ReadCache:
    """The records of notes read lately, each kept with its file's signature (device,
    inode, size, mtime, ctime) and given again only while a stat finds the same one.

    A file is kept only once its mtime and ctime are RACY_SECONDS old (git's "racy clean"
    rule): a change made in the same clock tick as the read that was kept would otherwise
    leave every field of the signature as it was. Our own writes rename a new file into
    place (a new inode); ctime changes with any write, chmod or rename and cannot be set
    back. At most MAX_BYTES of content, notes up to MAX_NOTE_BYTES, least recent out first.

    A note read again also keeps its GET's answer, encoded once (`answer`): encoding the
    envelope was a fifth of a GET's time. Its bytes count toward MAX_BYTES too.
    """

    MAX_BYTES = 4 << 20
    MAX_NOTE_BYTES = 64 << 10
    RACY_SECONDS = 2.0

    def __init__(self):
        self._lock = threading.Lock()
        # path -> (sig, rec, [the GET's envelope as bytes, once asked for; else None])
        self._items: collections.OrderedDict = collections.OrderedDict()
        self._bytes = 0

    @staticmethod
    def signature(st: os.stat_result) -> tuple:
        return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns

    def get(self, path: str, target: Path | str) -> dict | None:
        """Return a copy of the kept record of path while its file is unchanged, else None."""
        entry = self._fresh(path, target)
        return None if entry is None else dict(entry[1])

    def answer(self, path: str, target: Path | str) -> tuple | None:
        """Return (etag, the success envelope of the record as bytes) while the file of
        path is unchanged, else None; the envelope is encoded at the first ask and kept."""
        entry = self._fresh(path, target)
        if entry is None:
            return None
        _, rec, box = entry
        body = box[0]
        if body is None:
            body = success_body(rec)
            with self._lock:
                if self._items.get(path) is entry and box[0] is None:
                    box[0] = body
                    self._bytes += len(body)
                    self._trim()
        return rec["etag"], body

    def kept(self, path: str, st: os.stat_result) -> dict | None:
        """Return the kept record itself (not to be changed) of path while `st`, the stat
        of its file the caller made, is the one it was kept with; else None."""
        entry = self._same(path, st)
        return None if entry is None else entry[1]

    def _fresh(self, path: str, target: Path | str) -> tuple | None:
        if path not in self._items:
            return None
        try:
            st = os.stat(target)
        except (OSError, ValueError):
            return None
        return self._same(path, st)

    def _same(self, path: str, st: os.stat_result) -> tuple | None:
        entry = self._items.get(path)
        if entry is None or self.signature(st) != entry[0]:
            return None
        with contextlib.suppress(KeyError):  # one C call: no lock (put may have dropped it)
            self._items.move_to_end(path)
        return entry

    @staticmethod
    def _size(entry: tuple) -> int:
        return entry[0][2] + len(entry[2][0] or b"")

    def _trim(self) -> None:  # under the lock
        while self._bytes > self.MAX_BYTES:
            _, old = self._items.popitem(last=False)
            self._bytes -= self._size(old)

    def put(self, path: str, st: os.stat_result, rec: dict) -> None:
        size = st.st_size
        settled = time.time_ns() - int(self.RACY_SECONDS * 1e9)
        if size > self.MAX_NOTE_BYTES or max(st.st_mtime_ns, st.st_ctime_ns) > settled:
            return
        with self._lock:
            old = self._items.pop(path, None)
            if old is not None:
                self._bytes -= self._size(old)
            self._items[path] = (self.signature(st), rec, [None])
            self._bytes += size
            self._trim()


_PROC_FD = os.path.isdir("/proc/self/fd")  # Linux: where a descriptor leads


def _moved_from(old: str, new: str) -> str:
    """Return a move's summary, as the note's history shows it at its new path."""
    folder, name = old.rsplit("/", 1)
    if new.rsplit("/", 1)[0] == folder:
        return f"renamed from {name[:-3]}"
    return f"moved from {old}"


class ConflictCopies:
    """The notes that are conflict copies (a merge's edit kept beside its note, 24), as
    {copy's path: the note's path}, kept in <state>/conflicts.json. A copy is known by this
    record, not by its name: a note named like one is not one, and a copy whose name was
    shortened to fit still is. It stops being one when it is moved, renamed or deleted
    (keeping it under a name of one's own makes it a note like any other); when its note
    moves, the record follows. Small (a few entries); read once, written on each change."""

    NAME = "conflicts.json"

    def __init__(self, file: Path):
        self.file = file
        self._lock = threading.Lock()
        self._copies: dict | None = None

    def _load(self) -> dict:
        if self._copies is None:
            try:
                raw = json.loads(self.file.read_text("utf-8"))
            except FileNotFoundError:
                raw = {}
            except (OSError, ValueError) as e:
                log.warning(
                    "%s cannot be read (%s): no note counts as a conflict copy", self.file, e
                )
                raw = {}
            pairs = raw.items() if isinstance(raw, dict) else ()
            self._copies = {k: v for k, v in pairs if isinstance(k, str) and isinstance(v, str)}
        return self._copies

    def of(self, path: str) -> str | None:
        """Return the path of the note the note at path is a conflict copy of (None: not one)."""
        with self._lock:
            return self._load().get(path)

    def _store(self, copies: dict) -> None:
        try:
            with disk_writes():
                atomic_write(self.file, to_json(copies), mode=0o600)
        except OSError as e:  # kept in memory: the ranking is a nicety, never worth a failure
            log.warning("%s not written (%s)", self.file, e)
        self._copies = copies

    def mark(self, path: str, original: str | None) -> None:
        """Record that the note at path is a copy of `original` (None: it is not one)."""
        with self._lock:
            copies = self._load()
            if copies.get(path) == original:
                return
            copies = dict(copies)
            if original is None:
                del copies[path]
            else:
                copies[path] = original
            self._store(copies)

    def moved(self, old: str, new: str) -> None:
        """A note moved: as a copy it is one no more; as a note with copies they follow."""
        with self._lock:
            copies = self._load()
            if old not in copies and old not in copies.values():
                return
            self._store({c: (new if o == old else o) for c, o in copies.items() if c != old})


class FileTree:
    """What NoteStore and AttachmentStore share: files in a folder tree under root (below
    base) whose missing folders a write makes, and whose emptied folders go again."""

    root: Path
    base: Path

    def make_root(self) -> None:
        """Create root when a first write needs it (notes/ is there from the start)."""

    def file_of(self, path: str) -> Path:
        raise NotImplementedError

    @contextlib.contextmanager
    def _new_parents(self, target: Path, path: str | None = None):
        """Create the missing folders of target (the file of path) for the block; remove
        them again when the block fails (a full disk changes nothing)."""
        missing = missing_folders(target.parent, self.root)
        try:
            with disk_writes():
                try:
                    self.make_root()
                    target.parent.mkdir(parents=True, exist_ok=True)
                except (FileExistsError, NotADirectoryError):
                    raise ApiError(
                        409, "CONFLICT", "a file stands where a folder of this path should be"
                    ) from None
            # re-check containment now that the folders exist
            self.file_of(path if path is not None else str(target.relative_to(self.base)))
            yield
        except BaseException:
            for folder in missing:  # deepest first
                with contextlib.suppress(OSError):
                    folder.rmdir()
            raise

    def _prune(self, folder: Path) -> None:
        """Remove folder and its parents while they are empty (never root itself)."""
        remove_empty_folders(folder, self.root)


class NoteStore(FileTree):
    """Markdown files under <root>/notes: the source of truth, looked at on disk every time.

    A read of a note that has not changed on disk (the same inode, size, mtime and ctime,
    git's test of a clean file) answers from the ReadCache: one stat instead of five calls.
    Writes are atomic (see atomic_write). A note's writes are serialised by a striped
    lock, so an If-Match check and the write it guards happen as one step; creating,
    moving and deleting also hold the tree lock, so folders are never pruned under a
    writer that is about to fill them.
    """

    STRIPES = 64

    def __init__(
        self,
        root: Path,
        trash: Path,
        history: HistoryStore | None = None,
        journal: ChangeJournal | None = None,
    ):
        self.root = root.resolve()  # <root>/notes
        self.base = self.root.parent
        self._base_text = str(self.base)
        self._root_prefix = str(self.root) + os.sep
        self.cache = ReadCache()
        self.trash = trash
        self.history = history  # what each change replaced (None: nothing kept)
        self.journal = journal  # the change feed (None: nothing recorded)
        self.copies = ConflictCopies(trash.parent / ConflictCopies.NAME)  # conflict copies
        # who makes the change in progress, as its versions name it (savedBy): the Service
        # sets it to the request's grant's name; None: the owner, the server itself
        self.actor: Callable[[], str | None] = lambda: None
        self.person: Callable[[], dict | None] = lambda: None  # {id, name}: a person's change
        # guard(path): a context around one change of path, entered under the note's lock
        # before anything changes: it raises when the request under way may no longer
        # change path (its key revoked, its person's share removed since its key was
        # checked), and a revocation waits for the changes inside it (the Service sets it:
        # Service.writing; nothing by default)
        self.guard: Callable[[str], Any] = lambda path: contextlib.nullcontext()
        self._recent: dict = {}  # folder -> (journal's last entry, paths newest first)
        self._observed = False  # the rescan has run once (observe())
        self._tree = threading.RLock()
        self._stripes = [threading.RLock() for _ in range(self.STRIPES)]
        # listener(event, path, detail), called under the note's lock after each change:
        # ("saved", path, (content, stat)), ("moved", old, (new, stat)), ("deleted", path, None)
        self.listeners: list = []
        # after(event, path, detail): the same events, once the note locks are released
        # (plugin hooks run there, free to write other notes).
        self.after: list = []
        self._local = threading.local()

    # -- paths and locks -------------------------------------------------------------

    def file_of(self, path: str) -> Path:
        """Return the file for a checked note/folder path; 400 when it leads outside.

        Only what lies below the (resolved) root can be a link: each existing segment is
        looked at (lstat), and only when one is a link is the whole path resolved.
        """
        target = self.on_disk(path)
        at = self._base_text.rstrip(os.sep)
        for part in str(target)[len(at) + 1 :].split(os.sep):
            at = f"{at}{os.sep}{part}"
            try:
                mode = os.lstat(at).st_mode
            except (FileNotFoundError, NotADirectoryError):
                return target  # nothing there, so no link further down either
            if stat.S_ISLNK(mode):
                real = os.path.realpath(target)
                root = str(self.root)
                if real != root and not real.startswith(root + os.sep):
                    raise bad_request("the path resolves outside the notes folder (symbolic link?)")
                return target
        return target

    def on_disk(self, path: str) -> Path:
        """Return where an (NFC) path is on disk: segment by segment, a name that is not
        there is matched to an entry that normalises to it (NFD names from macOS or
        Syncthing), so such a note is read and written in place under its own name.
        """
        return disk_path(self.base, path)

    @contextlib.contextmanager
    def locked(self, *paths: str, tree: bool = False):
        """Hold the locks of these note paths (and the tree lock); nests in one thread.

        When the outermost lock is released, the `after` listeners get the changes made.
        """
        stripes = sorted({hash(p) % self.STRIPES for p in paths})
        local = self._local
        local.depth = getattr(local, "depth", 0) + 1
        try:
            with contextlib.ExitStack() as stack:
                if tree:
                    stack.enter_context(self._tree)
                for i in stripes:
                    stack.enter_context(self._stripes[i])
                yield
        finally:
            local.depth -= 1
        if local.depth == 0 and getattr(local, "pending", None):
            pending, local.pending = local.pending, []
            for event in pending:
                self._call(self.after, *event)

    def _notify(self, event: str, path: str, detail: Any = None) -> None:
        self._call(self.listeners, event, path, detail)
        if self.after:
            self._local.__dict__.setdefault("pending", []).append((event, path, detail))

    @staticmethod
    def _call(listeners: list, event: str, path: str, detail: Any) -> None:
        for listener in list(listeners):
            try:
                listener(event, path, detail)
            except Exception:
                log.exception("listener %r failed on %s %s", listener, event, path)

    # -- reading ------------------------------------------------------------------

    def _read(self, path: str, trusted: bool = False) -> tuple:
        """Return (bytes, stat) of a note; 404 when there is none.

        `trusted` paths come from our own scan, which never follows links.
        """
        fd = self._open(path, trusted)
        try:  # os.read on the descriptor: no buffered file's isatty and seek calls
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise not_found(f"no note at {path}")
            data = os.read(fd, st.st_size + 1)
            if len(data) > st.st_size or len(data) < st.st_size:  # it changed meanwhile
                parts = [data]
                while chunk := os.read(fd, 1 << 20):
                    parts.append(chunk)
                data = b"".join(parts)
            return data, st
        finally:
            os.close(fd)

    def _open(self, path: str, trusted: bool) -> int:
        """Open a note for reading; 404 when there is none, 400 when it leads outside.

        On Linux the descriptor is opened first and the kernel says where it leads
        (/proc/self/fd): one system call instead of a lstat per segment (file_of). Each
        one hands the GIL to another thread, which a server under load pays for dearly.
        """
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)  # a named pipe is never waited on
        direct = trusted or _PROC_FD
        target = self.on_disk(path) if direct else self.file_of(path)
        try:
            fd = os.open(target, flags)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            if not trusted:
                self.file_of(path)  # a link leading outside is 400 even with nothing there
            raise not_found(f"no note at {path}") from None
        if trusted or not _PROC_FD:
            return fd
        try:
            real = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            real = ""
        if not real.startswith(self._root_prefix):
            os.close(fd)
            self.file_of(path)  # raises when it leads outside
            return self._open(path, True)  # /proc said nothing usable: checked the long way
        return fd

    @staticmethod
    def decode(path: str, data: bytes) -> str:
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise ApiError(
                409,
                "CONFLICT",
                f"{path} is not valid UTF-8 on disk; fix its encoding with another editor",
            ) from None

    @staticmethod
    def record(path: str, data: bytes, st: os.stat_result, content: bool = True) -> dict:
        text = data.decode("utf-8", "replace")
        rec = {
            "path": path,
            "title": note_title(text, path),
            "size": len(data),
            "modified": iso(st.st_mtime_ns / 1e9),
            "etag": make_etag(data),
        }
        if content:
            rec["content"] = text
        return rec

    def _where(self, path: str) -> Path | str:
        return f"{self._base_text}{os.sep}{path}" if path.isascii() else self.on_disk(path)

    def answer(self, path: str) -> tuple:
        """Return (etag, GET's success envelope as bytes) of a note: kept while unchanged."""
        kept = self.cache.answer(path, self._where(path))
        if kept is not None:
            return kept
        rec = self.get(path)
        return rec["etag"], success_body(rec)

    def get(self, path: str) -> dict:
        rec = self.cache.get(path, self._where(path))
        if rec is not None:
            return rec
        data, st = self._read(path)
        self.decode(path, data)
        rec = self.record(path, data, st)
        self.cache.put(path, st, rec)
        return dict(rec)

    def exists(self, path: str) -> bool:
        return os.path.isfile(self.file_of(path))

    def _entries(self, folder: str = NOTES) -> Iterable:
        """Yield (note path, DirEntry) under a folder path (hidden entries and links skipped).

        Paths are NFC whatever the names on disk.
        """
        return walk_entries(str(self.on_disk(folder)), folder, is_note_name)

    def walk(self, folder: str = NOTES) -> list:
        """Return every note path under a folder path, sorted."""
        return sorted({path for path, _ in self._entries(folder)})

    def by_modified(self, folder: str = NOTES) -> list:
        """Return every note path under a folder, newest first. Kept until the next change
        the journal records (every write here, and every external edit the rescan finds),
        so a phone asking again and again for its list pays for the files' stat once."""
        seen = self.journal.last if self.journal is not None else None
        kept = self._recent.get(folder)
        if kept is not None and seen is not None and kept[0] == seen:
            return kept[1]
        found = []
        for path, e in self._entries(folder):
            with contextlib.suppress(OSError):  # removed meanwhile
                found.append((-e.stat().st_mtime_ns, path))
        paths = [path for _, path in sorted(found)]
        if seen is not None:
            if len(self._recent) >= 16:
                self._recent.pop(next(iter(self._recent)))
            self._recent[folder] = (seen, paths)
        return paths

    def scan(self, on_many: Callable | None = None, many: int = 0) -> dict:
        """Return {note path: (size, mtime_ns)} for every note (the rescan's view); call
        on_many() once it has found `many` notes (the index starts its helper then)."""
        out = {}
        for path, e in self._entries():
            try:
                st = e.stat()
            except OSError:
                continue
            out[path] = (st.st_size, st.st_mtime_ns)
            if on_many is not None and len(out) == many:
                on_many()
        return out

    def read_raw(self, path: str) -> tuple:
        """Return (bytes, stat) of a note found by scan() (404 when gone), for the indexer."""
        return self._read(path, trusted=True)

    def list_page(
        self, folder: str, limit: int, offset: int, sort: str = "path", fields: Iterable = ()
    ) -> dict:
        """Return a page of note records (no content) of a folder, or of several (the
        folders a grant reaches beneath the one asked: those not there yet hold nothing):
        by path, or newest first (`sort` "modified"); `fields` may add each note's `preview`
        and `tags`."""
        folders = (folder,) if isinstance(folder, str) else tuple(folder)
        if len(folders) == 1:
            folder = folders[0]
            if folder != NOTES and not os.path.isdir(self.file_of(folder)):
                raise not_found(f"no folder at {folder}")
            paths = self.by_modified(folder) if sort == "modified" else self.walk(folder)
        else:
            found = []
            for f in folders:
                if not os.path.isdir(self.file_of(f)):
                    continue  # a folder a grant reaches that is not there yet
                for path, e in self._entries(f):
                    with contextlib.suppress(OSError):  # removed meanwhile
                        found.append((-e.stat().st_mtime_ns if sort == "modified" else 0, path))
            paths = [path for _, path in sorted(found)]
        page = []
        for path in paths[offset : offset + limit]:
            try:
                data, st = self._read(path)
            except ApiError:  # removed between the walk and the read
                continue
            rec = self.record(path, data, st, content=False)
            if "preview" in fields or "tags" in fields:
                text = data.decode("utf-8", "replace")
                if "preview" in fields:
                    rec["preview"] = note_preview(text)
                if "tags" in fields:
                    rec["tags"] = sorted(note_tags(text))
            page.append(rec)
        return {"notes": page, "total": len(paths), "limit": limit, "offset": offset}

    def tree(
        self, folder: str = NOTES, depth: int | None = None, count: Callable | None = None
    ) -> dict:
        """Return the folder node: folders first, then notes, each by name. With a depth,
        folders below that many levels carry `count(path)` (notes beneath) for `children`."""
        target = self.file_of(folder)
        if not target.is_dir():
            raise not_found(f"no folder at {folder}")
        return self._node(str(target), folder, depth, count or (lambda rel: len(self.walk(rel))))

    def _node(self, real: str, rel: str, depth: int | None = None, count=None) -> dict:
        name = rel.rsplit("/", 1)[-1]
        if depth is not None and depth <= 0:
            return {"name": name, "path": rel, "type": "folder", "count": count(rel)}
        below = None if depth is None else depth - 1
        folders, notes = [], []
        try:
            entries = list(os.scandir(real))
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            entries = []
        for e in entries:
            if e.name.startswith(".") or e.is_symlink():
                continue
            if e.is_dir():
                folders.append(e)
            elif e.name.endswith(".md") and len(e.name) > 3:
                notes.append(e)
        children = [
            self._node(e.path, f"{rel}/{nfc(e.name)}", below, count)
            for e in sorted(folders, key=lambda e: sort_key(nfc(e.name)))
        ]
        for e in sorted(notes, key=lambda e: sort_key(nfc(e.name))):
            try:
                st = e.stat()
            except OSError:
                continue
            children.append(
                {
                    "name": nfc(e.name),
                    "path": f"{rel}/{nfc(e.name)}",
                    "type": "note",
                    "size": st.st_size,
                    "modified": iso(st.st_mtime_ns / 1e9),
                }
            )
        return {"name": name, "path": rel, "type": "folder", "children": children}

    # -- writing ------------------------------------------------------------------

    @staticmethod
    def encode(content: str) -> bytes:
        try:
            return content.encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request("'content' holds text that is not valid Unicode") from None

    @staticmethod
    def check_match(if_match: str | None, data: bytes | None) -> None:
        """Raise 412 unless If-Match (absent, `*`, or a list of ETags) matches data."""
        check_etag(if_match, make_etag(data) if data is not None else None, "note")

    def create(self, path: str, content: str, conflict_of: str | None = None) -> dict:
        """Create a note (409 when one is there); `conflict_of`: it is a conflict copy of
        that note (ConflictCopies; the change feed's entry says so)."""
        data = self.encode(content)
        with self.locked(path, tree=True):
            target = self.file_of(path)
            if os.path.lexists(target):
                raise ApiError(409, "CONFLICT", f"a note already exists at {path}; use PUT")
            with self._changing(path), self._new_parents(target):
                atomic_write(target, data)
            self.copies.mark(path, conflict_of)  # before the index and the feed learn of it
            st = os.stat(target)
            self._notify("saved", path, (content, st))
            self._record("created", path, data, conflict_of=conflict_of)
            return self.record(path, data, st)

    def update(
        self, path: str, content: str, if_match: str | None = None, reason: str = "updated"
    ) -> dict:
        data = self.encode(content)
        with self.locked(path):
            old, seen = self._read(path)
            self.check_match(if_match, old)
            target = self.file_of(path)
            with self._changing(path, old, reason, (target, seen), data) as first:
                atomic_write(target, data, before_replace=first)
            st = os.stat(target)
            self._notify("saved", path, (content, st))
            self._record("updated", path, data)
            return self.record(path, data, st)

    def version_with(self, path: str, etag: str, sees: Callable | None = None) -> bytes | None:
        """Return the content of the note's kept version whose ETag is etag (None: no such
        version: another note's, or one the retention dropped; with `sees`, one saved at a
        path sees() refuses: a folder grant's). The history's copy of the note counts:
        another program may have replaced it before the rescan kept it."""
        if self.history is None or not re.fullmatch(r'"[0-9a-f]{32}"', etag or ""):
            return None
        head = self.history.read_head(path) if self.history.enabled else None
        if head is not None and make_etag(head) == etag:
            return head
        folder = self.history.dir_of(path)
        for vid in reversed(self.history.ids(folder)):
            if vid.endswith(etag[1:-1]):
                with contextlib.suppress(ApiError):
                    data = self.history.read(path, vid)  # then checked (see _version_seen)
                    if sees is None or sees(self.history.saved_at(path, vid)):
                        return data
        return None

    def merge(
        self,
        path: str,
        base: str,
        content: str,
        conflict_name: str,
        sees: Callable | None = None,
        reason: str = "",
        base_text: str | None = None,
    ) -> dict:
        """Write an edit that started from the version `base` (an ETag): as it is when the
        note is still that version; else merged line-wise three ways with what changed
        since (one atomic write, `merged` in history). When the changes overlap, or `base`
        is unknown (or, with `sees`, a version saved where a folder grant cannot read), the
        note stays as it is and the edit is kept beside it as a conflict copy: 409 with its
        path. `reason`: history's reason for either write (a suggestion's); `base_text`:
        the content `base` names, when the caller kept it. Returns {note, merged}."""
        self.encode(content)  # too large, not text: refused before anything
        for _ in range(5):  # another write may land in between: merge with that one
            raw, st = self._read(path)
            if make_etag(raw) == base:
                with contextlib.suppress(PreconditionFailed):
                    note = self.update(path, content, base, reason=reason or "updated")
                    return {"note": note, "merged": False}
                continue
            current = self.decode(path, raw)
            if base_text is not None and make_etag(base_text.encode("utf-8")) == base:
                old = base_text.encode("utf-8")
            else:
                old = self.version_with(path, base, sees)
            if old is None and current == content:  # nothing to keep apart: already so
                return {"note": self.record(path, raw, st), "merged": False}
            merged, clash = (
                merge3(old.decode("utf-8", "replace"), current, content) if old else ("", True)
            )
            if clash:
                break
            with contextlib.suppress(PreconditionFailed):
                rec = self.update(path, merged, make_etag(raw), reason=reason or "merged")
                return {"note": rec, "merged": True}
        copy = self.create_beside(path, conflict_name, content, conflict=True)
        err = ApiError(
            409,
            "CONFLICT",
            f"{path} changed where this edit did too: it stays as it was, and the edit is "
            f"kept, whole, as {copy['path']}",
        )
        err.extra = {"path": path, "conflictPath": copy["path"]}
        raise err

    def create_beside(self, path: str, note: str, content: str, conflict: bool = False) -> dict:
        """Create `<name> (<note>).md` beside path (` 2`, ` 3`... when taken); a long name
        is shortened to leave room, so the copy always fits the 255-byte rule. `conflict`:
        it is a conflict copy of path (see create)."""
        folder, name = path.rsplit("/", 1)
        tail = f" ({note})"
        room = MAX_SEGMENT_BYTES - len(".md 999") - len(tail.encode())
        short = name[:-3].encode()[: max(room, 1)].decode("utf-8", "ignore").rstrip() or "note"
        return self.create_named(folder, short + tail, content, path if conflict else None)

    def create_named(
        self, folder: str, name: str, content: str, conflict_of: str | None = None
    ) -> dict:
        """Create the note `<folder>/<name>.md`, or `<name> 2.md`, `<name> 3.md`... when
        taken (never overwriting: each try is an exclusive create)."""
        for n in range(1, 1000):
            candidate = name if n == 1 else f"{name} {n}"
            try:
                return self.create(note_path(f"{folder}/{candidate}.md"), content, conflict_of)
            except ApiError as e:
                if e.status_code != 409:
                    raise
        raise ApiError(409, "CONFLICT", f"too many notes named {name} in {folder}")

    def append(self, path: str, line: str, heading: str) -> dict:
        """Append a line to a note, creating it with a heading when missing (one atomic write)."""
        with self.locked(path, tree=True):
            target = self.file_of(path)
            parents: Any = contextlib.nullcontext()
            try:
                raw, seen = self._read(path)
                old = self.decode(path, raw)
            except ApiError as e:
                if e.status_code != 404:
                    raise
                raw, old = None, f"# {heading}\n\n"
                parents = self._new_parents(target)
            content = old + ("" if old.endswith("\n") else "\n") + line + "\n"
            data = self.encode(content)
            inode = (target, seen) if raw is not None else None
            with self._changing(path, raw, "updated", inode, data) as first, parents:
                atomic_write(target, data, before_replace=first)
            st = os.stat(target)
            self._notify("saved", path, (content, st))
            self._record("created" if raw is None else "updated", path, data)
            return self.record(path, data, st)

    def rewrite(self, path: str, change: Callable) -> bool:
        """Apply change(text) -> text to a note under its lock; return whether it changed."""
        with self.locked(path):
            data, seen = self._read(path)
            text = self.decode(path, data)
            new = change(text)
            if new == text:
                return False
            raw = self.encode(new)
            target = self.file_of(path)
            with self._changing(path, data, "linksRewritten", (target, seen), raw) as first:
                atomic_write(target, raw, before_replace=first)
            self._notify("saved", path, (new, os.stat(target)))
            self._record("updated", path, raw)
            return True

    def move(self, path: str, new: str, if_match: str | None = None) -> dict:
        with self.locked(path, new, tree=True):
            data, _ = self._read(path)
            self.check_match(if_match, data)
            self.decode(path, data)
            if new == path:
                return {**self.record(path, data, os.stat(self.file_of(path))), "from": path}
            src, dst = self.file_of(path), self.file_of(new)
            if os.path.lexists(dst):
                raise ApiError(409, "CONFLICT", f"a note already exists at {new}")
            was = _moved_from(path, new)
            with (
                self.guard(new),  # (and the path it leaves, in _changing)
                self._changing(path, data, "moved", new=was),
                self._new_parents(dst),
                disk_writes(),
            ):
                os.replace(src, dst)
            fsync_dir(dst.parent)
            fsync_dir(src.parent)
            self._prune(src.parent)
            self._relocate_history(path, new)
            self.copies.moved(path, new)
            st = os.stat(dst)
            self._notify("moved", path, (new, st))
            self._record("moved", new, data, origin=path)
            return {**self.record(new, data, st), "from": path}

    def delete(self, path: str, if_match: str | None = None) -> dict:
        with self.locked(path, tree=True):
            data, _ = self._read(path)
            self.check_match(if_match, data)
            src = self.file_of(path)
            changing = self._changing(path, data, "deleted", new="deleted")
            trashed = move_to_trash(src, self.trash, path, changing)
            self.copies.mark(path, None)
            self._prune(src.parent)
            self._notify("deleted", path)
            self._record("deleted", path, None)
        return {"path": path, "deleted": True, **trashed}

    def discard_created(self, path: str, etag: str) -> bool:
        """Remove a note just created, as an import that cannot finish takes its notes back:
        no trash and no version (nothing was there before it), a `deleted` change in the
        feed. Return False, leaving it, when it is not `etag` any more (edited since)."""
        with self.locked(path, tree=True):
            try:
                data, _ = self._read(path)
            except ApiError as e:
                if e.status_code == 404:  # gone already
                    return True
                raise
            if make_etag(data) != etag:
                return False
            src = self.file_of(path)
            with disk_writes():
                os.unlink(src)  # first: on a full disk, what it frees is the journal's room
            self.copies.mark(path, None)
            self._prune(src.parent)
            self._notify("deleted", path)
            try:
                if self.journal is not None:
                    self.journal.reserve()
            except ApiError:  # still no room: the feed has it all the same (the log says so)
                self.journal.append("deleted", path, reserved=False)
                if self.history is not None:
                    self.history.drop_head(path)
                return True
            self._record("deleted", path, None)
        return True

    # -- what a change leaves behind: history, the journal, the trash -------------------

    @contextlib.contextmanager
    def _changing(
        self,
        path: str,
        old: bytes | None = None,
        reason: str = "updated",
        inode: tuple | None = None,
        new: bytes | str | None = None,
    ):
        """Around one change of a note: room for its journal entry, then the content it
        replaces kept as a version (a full disk stops the change here, 507, with nothing
        changed); both are undone when the change itself fails. `inode` (see
        HistoryStore.keep) when the change replaces the note's file by a rename: then it
        gives what atomic_write must run before that rename. `new`: the content written
        (the version's summary counts the lines it changed), or a summary in words."""
        with self.guard(path):
            journal, history = self.journal, self.history
            if journal is not None:
                journal.reserve()
            try:
                keep = history is not None and old is not None
                vid = history.keep(path, old, reason, inode) if keep else None
            except BaseException:
                if journal is not None:
                    journal.release()
                raise
            try:
                yield (lambda: history.durable(path)) if vid and inode else None
            except BaseException:
                if vid:
                    history.discard(path, vid)
                if journal is not None:
                    journal.release()
                raise
            if vid:
                history.settle(path, vid, self._version_meta(old, new))

    def _version_meta(self, old: bytes | None, new: bytes | str | None) -> dict:
        """Return {savedBy, summary} of the change a version is kept for."""
        if isinstance(new, bytes) and old is not None:
            summary = change_summary(old, new)
        else:
            summary = new if isinstance(new, str) else None
        return {"savedBy": self._who(), "summary": summary}

    def _who(self) -> str | None:
        """Return who makes the change under way (history's savedBy), None when unknown."""
        try:
            return self.actor()
        except Exception as e:  # a name is never worth a failed write
            log.warning("history: who saved this is unknown (%s)", e)
            return None

    def _record(
        self,
        kind: str,
        path: str,
        data: bytes | None,
        origin: str | None = None,
        conflict_of: str | None = None,
    ):
        """After a change, under the note's lock: its journal entry (`from` a move's
        origin; a conflict copy's `conflictOf`), then the history's copy of the note (in
        this order: a crash in between leaves the rescan a change to report twice, never
        one to miss)."""
        etag = None if data is None else make_etag(data)
        if self.journal is not None:
            person = self.person()  # the feed names a person (and the device), no one else
            by = self._who() if kind == "created" or person else None
            self.journal.append(kind, path, etag, origin or conflict_of, by=by, person=person)
        if self.history is not None:
            if data is None:
                self.history.drop_head(path)
            else:
                self.history.write_head(path, data, etag)
            if origin is not None:
                self.history.drop_head(origin)

    def _relocate_history(self, old: str, new: str, until_us: int | None = None, copy=False):
        if self.history is None:
            return
        try:
            self.history.relocate(old, new, until_us, copy)
        except OSError as e:  # the note has moved: its history stays findable under `old`
            log.warning("history of %s stays under that path (%s)", log_safe(old), e)

    def _keep_external(self, path: str, head: bytes | None) -> None:
        """Keep what another program replaced (the history's copy of it), as the rescan can."""
        if head is None:
            return
        try:
            vid = self.history.keep(path, head, "external")
            if vid:
                self.history.settle(path, vid, {"savedBy": None, "summary": "changed outside"})
        except OSError as e:
            log.warning("history: could not keep %s as it was (%s)", log_safe(path), e)

    def history_is_empty(self) -> bool:
        """Return whether the history holds nothing yet (a first start on these notes)."""
        if self.history is None or not self.history.enabled:
            return True
        try:
            with os.scandir(self.history.folder) as found:
                return next(found, None) is None
        except FileNotFoundError:
            return True

    def observe(
        self, changed: list, removed: list, known: Mapping, present: Iterable[str] = ()
    ) -> None:
        """Record what other programs did to the notes, as the rescan found it: a journal
        entry for each change and, when the history holds a copy of the note, the content
        the change replaced (reason "external"). On the first call the notes `present`
        that have no copy yet get one: the starting point."""
        history, journal = self.history, self.journal
        if history is None or journal is None:
            return
        first, self._observed = not self._observed, True
        quiet, journal.fresh = journal.fresh, False  # a new journal starts from the notes
        if changed and not known and not quiet and not history.enabled:
            journal.reset()  # the index was rebuilt and no copy tells what changed meanwhile
            quiet = True
        new: list = []  # first copies, kept in packs (HeadStore): a first start makes 10,000

        def keep_new(path: str, data: bytes) -> None:
            new.append((path, data))
            if len(new) >= HeadStore.PACK_NOTES:
                history.write_heads(new)
                new.clear()

        for path in changed:
            with self.locked(path):
                try:
                    data, _ = self._read(path, trusted=True)
                except ApiError:
                    continue
                head = history.read_head(path) if history.enabled else None
                if head == data:  # written by us, or only touched
                    continue
                self._keep_external(path, head)
                if head is None and history.enabled:
                    keep_new(path, data)
                else:
                    history.write_head(path, data)
                if not quiet:
                    kind = "updated" if head is not None or path in known else "created"
                    journal.append(kind, path, make_etag(data), reserved=False)
        for path in removed:
            with self.locked(path):
                if os.path.lexists(self.on_disk(path)):
                    continue
                self._keep_external(path, history.read_head(path) if history.enabled else None)
                history.drop_head(path)
                self.copies.mark(path, None)
                if not quiet:
                    journal.append("deleted", path, reserved=False)
        if first and history.enabled:
            seen = set(changed)
            for path in present:
                if path in seen or history.has_head(path):
                    continue
                with self.locked(path):
                    try:
                        data, _ = self._read(path, trusted=True)
                    except ApiError:
                        continue
                    if history.read_head(path) is None:
                        keep_new(path, data)
        history.write_heads(new)

    def restore_version(
        self, path: str, vid: str, if_match: str | None = None, check: Callable | None = None
    ) -> dict:
        """Make a version the note's content again (recreating a deleted note); the content
        it replaces becomes a version itself. 412 when If-Match does not match the note.
        `check`: called once the version was read (a grant's: it raises when not seen)."""
        if self.history is None:
            raise not_found(f"no version {vid} of {path}")
        with self.locked(path, tree=True):
            data = self.history.read(path, vid)
            if check is not None:
                check()
            target = self.file_of(path)
            try:
                old, seen = self._read(path)
            except ApiError as e:
                if e.status_code != 404:
                    raise
                old = seen = None
            self.check_match(if_match, old)
            parents = self._new_parents(target) if old is None else contextlib.nullcontext()
            inode = (target, seen) if old is not None else None
            with self._changing(path, old, "restored", inode, data) as first, parents:
                atomic_write(target, data, before_replace=first)
            st = os.stat(target)
            self._notify("restored", path, (data.decode("utf-8", "replace"), st))
            self._record("restored", path, data)
            return self.record(path, data, st)

    def restore_trashed(self, item: TrashItem, target: str) -> dict:
        """Move a trashed note back, to its own path or another; 409 when a note is there.
        Its history comes with it."""
        with self.locked(target, item.path, tree=True):
            dst = self.file_of(target)
            if os.path.lexists(dst):
                raise ApiError(
                    409,
                    "CONFLICT",
                    f'a note already exists at {target}; restore elsewhere with {{"path": ...}}',
                )
            try:
                with open(item.file, "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                raise not_found(f"no item {item.id} in the trash") from None
            with self._changing(target), self._new_parents(dst), disk_writes():
                os.replace(item.file, dst)
            self.copies.mark(target, None)
            fsync_dir(dst.parent)
            fsync_dir(item.file.parent)
            remove_empty_folders(item.file.parent, self.trash)  # as Trash.emptied()
            if target != item.path:  # the versions it had when deleted (a second's slack)
                live = os.path.isfile(self.on_disk(item.path))
                until = int((item.deleted + 1) * 1_000_000)
                self._relocate_history(item.path, target, until, copy=live)
            st = os.stat(dst)
            self._notify("restored", target, (data.decode("utf-8", "replace"), st))
            self._record("restored", target, data)
            return self.record(target, data, st)

    def sweep_history(self, fix_modes: bool = False) -> int:
        """Apply the history's retention to every note and drop the copies of notes that
        are gone; return how many versions were removed."""
        history, removed = self.history, 0
        if history is None:
            return 0
        folders = history.folders()
        owners = history.head_paths(folders)
        with contextlib.suppress(OSError, HeadStoreError):
            history.heads.prune()
        for folder in folders:
            path = owners.get(folder)
            try:
                path = note_path(path) if path is not None else None
            except ApiError:
                path = None
            if path is not None and history.dir_of(path) == folder:
                with self.locked(path):
                    if not os.path.isfile(self.on_disk(path)):
                        history.drop_head(path)
            removed += history.sweep(folder, fix_modes)
        history.collect()
        return removed

    def sweep_temp_files(self) -> int:
        """Remove the temp files a crash left in the notes and in the state folder (its
        trash and every subfolder); return how many."""
        state = self.trash.parent
        return sweep_temp_files(self.root, skip_hidden=True) + (
            sweep_temp_files(state, skip_hidden=False) if state.is_dir() else 0
        )


def attachment_etag(st: os.stat_result) -> str:
    """Return a strong validator of an attachment: every write is a new file (atomic
    rename: a new inode), and an edit in place changes its size or modification time."""
    seed = f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}".encode()
    return '"' + hashlib.sha256(seed).hexdigest()[:32] + '"'


def check_etag(if_match: str | None, current: str | None, what: str) -> None:
    """Raise 412 unless If-Match (absent, `*`, or a list of ETags) matches current, the ETag
    of the {what} there (None: nothing is)."""
    if not if_match_allows(if_match, current):
        raise PreconditionFailed(
            f"the {what} changed since you read it (If-Match does not match its ETag); "
            "read it again and retry"
        )


def _is_attachment_name(name: str) -> bool:
    return name.rpartition(".")[2].lower() in ATTACHMENT_TYPES and "." in name[1:]


class AttachmentStore(FileTree):
    """Files under <root>/attachments: uploads, and photos, voice and files from channels.

    Paths follow the note rules (prefix attachments/) with an allowlist of extensions.
    A body is first written to a temp file in the attachments folder (flushed, fsynced),
    then renamed into place and the folder fsynced: a crash leaves the old file or the
    new one, and at most a temp file that the next start sweeps. Deleting moves the file
    into the notes' trash, <state>/trash/<UTC stamp>/attachments/...
    """

    MAX_SIBLINGS = 1000  # numbered names tried for an upload that must not overwrite

    def __init__(self, root: Path, trash: Path, nfd_names: bool = False):
        self.root = root.resolve()  # <root>/attachments (created on the first upload)
        self.base = self.root.parent
        self.trash = trash
        self.nfd_names = nfd_names  # names on disk matched as the notes' are (see on_disk)
        self._lock = threading.RLock()  # one change of the tree at a time
        self.listeners: list = []  # fn(path) after a file is placed (the attachment reader)
        self.guard: Callable[[str], Any] = lambda path: contextlib.nullcontext()  # NoteStore's

    def make_root(self) -> None:
        """Create the attachments folder when it is missing: private (0700, as the notes
        folder), so the audit finds nothing notesvc itself did (an existing folder keeps
        the mode its owner gave it)."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)

    # -- reading -------------------------------------------------------------------

    def file_of(self, path: str) -> Path:
        """Return the file of a checked path; 400 when it resolves outside attachments/."""
        target = disk_path(self.base, path) if self.nfd_names else self.base / path
        real = os.path.realpath(target)
        if real != str(self.root) and not real.startswith(str(self.root) + os.sep):
            raise bad_request("the path resolves outside the attachments folder (symbolic link?)")
        return target

    @staticmethod
    def record(path: str, st: os.stat_result) -> dict:
        return {
            "path": path,
            "size": st.st_size,
            "contentType": content_type_of(path),
            "modified": iso(st.st_mtime_ns / 1e9),
            "etag": attachment_etag(st),
        }

    def open(self, path: str) -> tuple:
        """Return (open binary file, stat) of an attachment; 404 when there is none."""
        try:  # O_NONBLOCK: a named pipe is refused below, never waited on
            fd = os.open(self.file_of(path), os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise not_found(f"no attachment at {path}") from None
        f = open(fd, "rb")  # noqa: SIM115 - handed to the caller
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            f.close()
            raise not_found(f"no attachment at {path}")
        return f, st

    def get(self, path: str) -> dict:
        try:
            st = os.stat(self.file_of(path))
        except (FileNotFoundError, NotADirectoryError):
            raise not_found(f"no attachment at {path}") from None
        if not stat.S_ISREG(st.st_mode):
            raise not_found(f"no attachment at {path}")
        return self.record(path, st)

    def _entries(self, folder: str = ATTACHMENTS) -> Iterable:
        """Yield (path, DirEntry) of the attachments under a folder (hidden entries, links and
        other extensions left out)."""
        return walk_entries(str(self.base / folder), folder, _is_attachment_name)

    def paths(self) -> list:
        """Return every attachment path, sorted."""
        return sorted(path for path, _ in self._entries())

    def stats(self) -> tuple:
        """Return (count, total bytes) of the attachments."""
        count = size = 0
        for _, e in self._entries():
            with contextlib.suppress(OSError):
                size += e.stat().st_size
                count += 1
        return count, size

    def list_page(self, folder: str | tuple, limit: int, offset: int) -> dict:
        """Return a page of the files of a folder, or of several (those not there yet hold
        nothing), by path."""
        folders = (folder,) if isinstance(folder, str) else tuple(folder)
        lone = folders[0] if len(folders) == 1 else ATTACHMENTS
        if lone != ATTACHMENTS and not os.path.isdir(self.file_of(lone)):
            raise not_found(f"no folder at {lone}")
        found = sorted(
            (item for f in folders if os.path.isdir(self.file_of(f)) for item in self._entries(f)),
            key=lambda item: item[0],
        )
        page = []
        for path, e in found[offset : offset + limit]:
            try:
                page.append(self.record(path, e.stat()))
            except OSError:  # removed meanwhile
                continue
        return {"attachments": page, "total": len(found), "limit": limit, "offset": offset}

    # -- writing ------------------------------------------------------------------

    def check(self, path: str, if_match: str | None, if_none_match: str | None) -> bool:
        """Check a write's preconditions (If-Match, If-None-Match: *); return whether an
        attachment exists at path. 412 when they fail, 409 when a folder stands there."""
        target = self.file_of(path)
        exists = os.path.lexists(target)
        if exists and not os.path.isfile(target):
            raise ApiError(409, "CONFLICT", f"a folder stands at {path}")
        if if_none_match is not None and if_none_match.strip() == "*" and exists:
            raise ApiError(
                412, "PRECONDITION_FAILED", f"an attachment exists at {path} (If-None-Match: *)"
            )
        check_etag(if_match, attachment_etag(os.stat(target)) if exists else None, "attachment")
        return exists

    def spool(self, write: Callable) -> Path:
        """Return a temp file in the attachments folder holding what write(file) wrote,
        flushed and fsynced; 507 on a full disk (and no temp file left)."""
        with disk_writes():
            self.make_root()
            fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=TEMP_SUFFIX, dir=self.root)
            try:
                with os.fdopen(fd, "wb") as f:
                    write(f)
                    f.flush()
                    if flush_each():
                        os.fsync(f.fileno())
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        return Path(tmp)

    def place(
        self,
        tmp: Path,
        path: str,
        if_match: str | None = None,
        if_none_match: str | None = None,
        unique: bool = False,
    ) -> tuple:
        """Rename a spooled temp file to path; return (record, created).

        unique: never overwrite, take the first free `name-2.ext`, `name-3.ext`... instead.
        If-Match / If-None-Match: * guard a replacement (412). The temp file is gone after.
        """
        try:
            with self._lock:
                target = self.file_of(path)
                if unique:
                    path, target = self._free(path, target)
                exists = self.check(path, if_match, if_none_match)
                with self.guard(path), self._new_parents(target, path):
                    os.chmod(tmp, 0o666 & ~UMASK)
                    self._rename(tmp, target)
                fsync_dir(target.parent)
                if target.parent != self.root:
                    fsync_dir(self.root)
                rec = self.record(path, os.stat(target))
            for listener in self.listeners:
                listener(path)
            return rec, not exists
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def put(self, path: str, data: bytes, unique: bool = False) -> tuple:
        """Write bytes to an attachment; return (record, created)."""
        return self.place(self.spool(lambda f: f.write(data)), path, unique=unique)

    @staticmethod
    def _rename(src: Path, dst: Path) -> None:
        with disk_writes():
            try:
                os.replace(src, dst)
            except OSError as e:
                if e.errno != errno.EXDEV:  # a folder on another file system: copy it over
                    raise

                def copy(f) -> None:
                    with open(src, "rb") as source:
                        while chunk := source.read(BODY_CHUNK):
                            f.write(chunk)

                replace_atomically(dst, copy, None)

    def _free(self, path: str, target: Path) -> tuple:
        """Return (path, file) of the first name not taken: path, name-2.ext, name-3.ext..."""
        if not os.path.lexists(target):
            return path, target
        base, _, ext = path.rpartition(".")
        for n in range(2, self.MAX_SIBLINGS):
            candidate = attachment_path(f"{base}-{n}.{ext}")
            target = self.file_of(candidate)
            if not os.path.lexists(target):
                return candidate, target
        raise ApiError(409, "CONFLICT", f"too many attachments named like {path}")

    def move(self, path: str, new: str, if_match: str | None = None) -> dict:
        with self._lock:
            src = self.file_of(path)
            rec = self.get(path)
            check_etag(if_match, rec["etag"], "attachment")
            if new == path:
                return {**rec, "from": path}
            dst = self.file_of(new)
            if os.path.lexists(dst):
                raise ApiError(409, "CONFLICT", f"an attachment already exists at {new}")
            with self.guard(path), self.guard(new), self._new_parents(dst, new), disk_writes():
                os.replace(src, dst)
            fsync_dir(dst.parent)
            fsync_dir(src.parent)
            self._prune(src.parent)
            return {**self.record(new, os.stat(dst)), "from": path}

    def delete(self, path: str, if_match: str | None = None) -> dict:
        """Move an attachment into the trash: <state>/trash/<UTC stamp>/attachments/..."""
        with self._lock:
            src = self.file_of(path)
            check_etag(if_match, self.get(path)["etag"], "attachment")
            trashed = move_to_trash(src, self.trash, path, self.guard(path))
            self._prune(src.parent)
        return {"path": path, "deleted": True, **trashed}

    def discard_created(self, path: str, etag: str) -> bool:
        """Remove a file just written, as an import that cannot finish takes its files back
        (no trash: nothing was there before it). Return False, leaving it, when it is not
        `etag` any more (replaced since)."""
        with self._lock:
            src = self.file_of(path)
            try:
                st = os.stat(src)
            except (FileNotFoundError, NotADirectoryError):  # gone already
                return True
            if attachment_etag(st) != etag:
                return False
            with disk_writes():
                os.unlink(src)
            self._prune(src.parent)
        return True

    def restore(self, src: Path, path: str) -> dict:
        """Move a file back from the trash to path; 409 when an attachment is there."""
        with self._lock:
            dst = self.file_of(path)
            if os.path.lexists(dst):
                raise ApiError(409, "CONFLICT", f"an attachment already exists at {path}")
            with self.guard(path), self._new_parents(dst, path), disk_writes():
                os.replace(src, dst)
            fsync_dir(dst.parent)
            return self.record(path, os.stat(dst))

    def sweep_temp_files(self) -> int:
        """Remove the temp files an interrupted upload left; return how many."""
        return sweep_temp_files(self.root, skip_hidden=True) if self.root.is_dir() else 0


# Opening a note to read it: never through a symbolic link, never waiting on a FIFO (a
# named pipe called x.md is seen as a file and then skipped).
NOFOLLOW_NONBLOCK = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
