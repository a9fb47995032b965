"""History: the content every change replaced (loose versions, packs, heads)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
import threading
import time
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Callable

from notesvc.boot import log
from notesvc.errors import DiskFull, bad_request, not_found
from notesvc.helpers import atomic_write, disk_writes, fsync_dir, iso, log_safe
from notesvc.notes.paths import make_etag

# -- history, trash and the change journal ------------------------------------------------
#
# What NoteStore keeps of every change: the content it replaced (HistoryStore, here), the
# note itself when deleted (Trash), and a numbered entry in the change feed (ChangeJournal):
# those two in notes/trash.py.

DAY_SECONDS = 86400
VERSION_REASONS = (
    "updated",
    "moved",
    "deleted",
    "external",
    "restored",
    "linksRewritten",
    "merged",
    "dav",
    "caldav",
    "suggestion",
)
VERSION_ID_RE = re.compile(r"^([0-9]{16})-(" + "|".join(VERSION_REASONS) + r")-([0-9a-f]{32})\Z")


def json_pattern(rx: re.Pattern) -> str:
    """Return an id's pattern as JSON Schema writes it: `$` for Python's `\\Z` (an id's
    patterns end in `\\Z`: `$` would also match before a final newline)."""
    return rx.pattern[:-2] + "$" if rx.pattern.endswith("\\Z") else rx.pattern


def _etag_hex(data: bytes) -> str:
    return make_etag(data)[1:-1]


class HeadStoreError(Exception):
    """A store's SQLite file could not be used (the heads: only a cache, the caller goes
    on; the packed versions: their loose files stay until a pack is written)."""


class _SqliteStore:
    """One SQLite file in the history folder, opened at its first use: WAL, private (its
    log too), SCHEMA made when missing. SYNCHRONOUS says what a commit costs: NORMAL for a
    cache, FULL for what must survive a power cut."""

    SCHEMA: tuple = ()
    FORMAT = 0  # a file's PRAGMA user_version; another one is refused (HeadStoreError)
    SYNCHRONOUS = "NORMAL"

    def __init__(self, file: Path, history: Path):
        self.file, self.history = file, history
        self._db: Any = None
        self._lock = threading.Lock()

    def _conn(self) -> Any:
        if self._db is not None:
            return self._db
        import sqlite3

        try:
            self.history.mkdir(parents=True, exist_ok=True, mode=0o700)
            fresh = not self.file.exists()
            os.close(os.open(self.file, os.O_RDWR | os.O_CREAT, 0o600))  # its WAL: the same
            db = sqlite3.connect(str(self.file), check_same_thread=False, isolation_level=None)
            if fresh:  # pages freed by deletions can go back to the file system (shrink())
                db.execute("PRAGMA auto_vacuum=INCREMENTAL")
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(f"PRAGMA synchronous={self.SYNCHRONOUS}")
            db.execute("PRAGMA cache_size=-256")
            db.execute("PRAGMA wal_autocheckpoint=256")  # the log stays near a mebibyte
            db.execute("PRAGMA journal_size_limit=1048576")
            found = db.execute("PRAGMA user_version").fetchone()[0]
            if fresh:
                db.execute(f"PRAGMA user_version={self.FORMAT}")
            elif found != self.FORMAT:
                db.close()
                raise HeadStoreError(f"{self.file}: format {found}, not {self.FORMAT}")
            for sql in self.SCHEMA:
                db.execute(sql)
        except (sqlite3.Error, OSError) as e:
            raise HeadStoreError(f"{self.file}: {e}") from None
        self._db = db
        if fresh:
            self._migrate()
        return db

    def _migrate(self) -> None:
        """Bring in what an older version kept otherwise (under the lock, once)."""

    def _run(self, sql: str, args: tuple = (), create: bool = False) -> list:
        """Run one statement; without `create`, a store not made yet holds nothing."""
        import sqlite3

        with self._lock:
            if self._db is None and not create and not self.file.exists():
                return []
            try:
                return self._conn().execute(sql, args).fetchall()
            except sqlite3.Error as e:
                raise HeadStoreError(str(e)) from None

    @contextlib.contextmanager
    def _transaction(self):
        """One transaction on the store, made when missing: all of it or nothing."""
        import sqlite3

        with self._lock:
            try:
                db = self._conn()
                db.execute("BEGIN IMMEDIATE")
                try:
                    yield db
                    db.execute("COMMIT")
                except BaseException:
                    db.execute("ROLLBACK")
                    raise
            except sqlite3.Error as e:
                raise HeadStoreError(str(e)) from None

    def _shrink(self) -> None:
        """Give the pages deletions freed back to the file system (a file made before
        auto_vacuum was set keeps them for its next rows). executescript runs the pragma to
        its end: execute() would free one page."""
        import sqlite3

        with self._lock:
            if self._db is None and not self.file.exists():
                return
            try:
                self._conn().executescript("PRAGMA incremental_vacuum")
            except sqlite3.Error as e:
                raise HeadStoreError(str(e)) from None

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                with contextlib.suppress(Exception):
                    self._db.close()
                self._db = None


class HeadStore(_SqliteStore):
    """The notes' contents as last written or seen (HistoryStore's "heads"): the starting
    point from which an edit made by another program is kept as a version.

    One SQLite file in the history folder, keyed by note path: a copy written by a save is
    its own zlib-compressed bytes; the first copies of many notes (a first start) are
    slices of packs of PACK_NOTES notes compressed together (git's packs are the model).
    zlib's checksum tells a damaged copy, which counts as unknown. 10,000 notes are one
    file of under half their size, not 10,000 folders and files. Synchronous NORMAL (a
    cache: never fsynced on its own). A history kept by an older version (a `head` file
    in each note's folder) is moved in when the file is first opened.
    """

    NAME = "heads.db"
    LEGACY = "head"  # the per-folder copy of versions up to 0.3
    PACK_NOTES = 100  # first copies compressed together (a third of their size, not 0.42)
    # a copy is its own compressed bytes, or a slice of a pack's (first copies)
    SCHEMA = (
        "CREATE TABLE IF NOT EXISTS copy (path TEXT PRIMARY KEY, data BLOB, "
        "pack INTEGER, start INTEGER, size INTEGER)",
        "CREATE TABLE IF NOT EXISTS pack (id INTEGER PRIMARY KEY, data BLOB)",
    )

    def open(self) -> None:
        """Open the file at start when it exists, or when an older history's copies are
        there to move in (else it is made by the first copy kept)."""
        with self._lock:
            if self.file.exists() or self._legacy_present():
                self._conn()

    def _legacy_present(self) -> bool:
        try:
            with os.scandir(self.history) as entries:
                return any(
                    len(e.name) == 32 and os.path.exists(os.path.join(e.path, self.LEGACY))
                    for e in entries
                )
        except OSError:
            return False

    def put(self, path: str, data: bytes) -> None:
        packed = zlib.compress(data, 9)  # its Adler-32 tells a damaged copy (get: None)
        sql = "INSERT OR REPLACE INTO copy (path, data) VALUES (?, ?)"
        self._run(sql, (path, packed), create=True)

    def put_new(self, items: list) -> None:
        """Keep the first copies of notes [(path, bytes)] as one compressed pack; a note
        that has a copy already (a save meanwhile) keeps it."""
        if not items:
            return
        packed = zlib.compress(b"".join(data for _, data in items), 9)
        rows, at = [], 0
        for path, data in items:
            rows.append((path, at, len(data)))
            at += len(data)
        with self._transaction() as db:
            pack = db.execute("INSERT INTO pack (data) VALUES (?)", (packed,)).lastrowid
            db.executemany(
                "INSERT OR IGNORE INTO copy (path, pack, start, size) VALUES (?, ?, ?, ?)",
                [(path, pack, start, size) for path, start, size in rows],
            )

    def get(self, path: str) -> bytes | None:
        found = self._run("SELECT data, pack, start, size FROM copy WHERE path = ?", (path,))
        if not found:
            return None
        data, pack, start, size = found[0]
        try:
            if data is not None:
                return zlib.decompress(data)
            blob = self._run("SELECT data FROM pack WHERE id = ?", (pack,))
            whole = zlib.decompress(blob[0][0]) if blob else b""
        except (zlib.error, TypeError):
            return None
        return whole[start : start + size] if start + size <= len(whole) else None

    def has(self, path: str) -> bool:
        return bool(self._run("SELECT 1 FROM copy WHERE path = ?", (path,)))

    def paths(self) -> list:
        return [row[0] for row in self._run("SELECT path FROM copy")]

    def drop(self, path: str) -> None:
        self._run("DELETE FROM copy WHERE path = ?", (path,))

    def prune(self) -> None:
        """Drop the packs no copy needs any more (a sweep's work)."""
        self._run("DELETE FROM pack WHERE id NOT IN (SELECT pack FROM copy WHERE pack > 0)")
        self._shrink()

    def _migrate(self) -> None:
        """Move the per-folder copies of an older history in (under the lock, once)."""
        moved = 0
        try:
            entries = [e for e in os.scandir(self.history) if len(e.name) == 32 and e.is_dir()]
        except OSError:
            return
        db = self._db
        db.execute("BEGIN")
        for e in entries:
            legacy = os.path.join(e.path, self.LEGACY)
            try:
                with open(legacy, "rb") as f:
                    raw = f.read()
            except OSError:
                continue
            line, _, data = raw.partition(b"\n")
            path = line[33:].decode("utf-8", "replace")
            if path and line[:32] == _etag_hex(data).encode():
                db.execute(
                    "INSERT OR REPLACE INTO copy (path, data) VALUES (?, ?)",
                    (path, zlib.compress(data, 9)),
                )
                moved += 1
        db.execute("COMMIT")
        for e in entries:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(e.path, self.LEGACY))
            with contextlib.suppress(OSError):
                os.rmdir(e.path)  # a folder that held only the copy
        if moved:
            log.info("history: %d copies of notes moved into %s", moved, self.file.name)


class VersionPacks(_SqliteStore):
    """The versions that have settled, out of their loose files (git's loose objects and
    packs are the model): a save keeps its version as a loose file (a hard link of the
    replaced note: nothing copied), and the retention sweep moves the versions older than
    HistoryStore.PACK_AFTER in here, so that a long history costs a fraction of its
    versions' size and no file each.

    A version's content is an `object` named by its ETag (the version id ends with it: the
    start of its SHA-256), kept once however many versions in any history hold it. The
    objects of one note's history are compressed together, oldest first (a `pack` of up to
    PACK_BYTES; each sweep that brings new versions of the note rewrites its pack with
    them): consecutive versions share most of their text, so each costs about what it
    changed. An object is a slice of its pack, checked against its name when read: a
    damaged one is never shown as a version. Synchronous FULL: a loose file is removed
    only once its version is durable here. What the retention drops is collected by
    collect(), which also rewrites the packs that are mostly dead.
    """

    NAME = "versions.db"
    FORMAT = 1
    SYNCHRONOUS = "FULL"
    PACK_BYTES = 1 << 20  # a pack's objects, uncompressed (reading one decompresses its pack)
    # A version id <microseconds>-<reason>-<ETag> is kept as its parts: `at`, `reason`
    # and `object` (the ETag's 16 bytes); a history folder as its name's 16 bytes.
    SCHEMA = (
        "CREATE TABLE IF NOT EXISTS version (folder BLOB, at INTEGER, reason TEXT, "
        "object BLOB, PRIMARY KEY (folder, at, object)) WITHOUT ROWID",
        "CREATE TABLE IF NOT EXISTS object (id BLOB PRIMARY KEY, pack INTEGER, "
        "start INTEGER, size INTEGER) WITHOUT ROWID",
        "CREATE TABLE IF NOT EXISTS pack (id INTEGER PRIMARY KEY, size INTEGER, data BLOB)",
        # who saved a packed version and what the change did (HistoryStore.META's lines,
        # moved in with it); by `at` and `object`, so that it follows moves and copies
        # untouched (a table older files gain when opened: their format stays)
        "CREATE TABLE IF NOT EXISTS meta (at INTEGER, object BLOB, data TEXT, "
        "PRIMARY KEY (at, object)) WITHOUT ROWID",
    )
    _OBJECTS = (
        "SELECT v.at, v.reason, o.id, o.pack, o.start, o.size FROM version v "
        "JOIN object o ON o.id = v.object WHERE v.folder = ?"
    )

    @staticmethod
    def _parts(vid: str) -> tuple:
        """Return (at, reason, object) of a version id."""
        at, reason, etag = vid.split("-")
        return int(at), reason, bytes.fromhex(etag)

    @staticmethod
    def _vids(rows: Iterable) -> list:
        """Return rows (at, reason, object, ...) as (version id, object, ...), the rows
        that hold a version id's parts (a damaged row is left out)."""
        return [
            (f"{at:016d}-{reason}-{oid.hex()}", oid, *rest)
            for at, reason, oid, *rest in rows
            if type(at) is int
            and 0 <= at < 10**16
            and reason in VERSION_REASONS
            and type(oid) is bytes
            and len(oid) == 16
        ]

    def ids(self, folder: str) -> dict:
        """Return {version id: size} of the versions packed for a history folder (name)."""
        rows = self._run(self._OBJECTS, (bytes.fromhex(folder),))
        return {row[0]: row[4] for row in self._vids(rows)}

    def folders(self) -> list:
        return [row[0].hex() for row in self._run("SELECT DISTINCT folder FROM version")]

    def read(self, folder: str, vid: str) -> bytes | None:
        """Return a packed version's content (None: not packed here, or damaged)."""
        at, reason, oid = self._parts(vid)
        sql = (  # one statement: the object's row and its pack from one snapshot
            "SELECT o.id, o.pack, o.start, o.size, p.data FROM version v "
            "JOIN object o ON o.id = v.object JOIN pack p ON p.id = o.pack "
            "WHERE v.folder = ? AND v.at = ? AND v.reason = ? AND v.object = ?"
        )
        found = self._run(sql, (bytes.fromhex(folder), at, reason, oid))
        if not found:
            return None
        data = self._unpack(found[0][4], [found[0][:4]]).get(oid)
        if data is None:
            log.error("history: version %s in %s is damaged", vid, self.file)
        return data

    def _slices(self, db: Any, pack: int, objects: list) -> dict:
        """Return {object: content} of objects [(object, pack, start, size)] in one pack,
        read within the caller's transaction (see _unpack)."""
        blob = db.execute("SELECT data FROM pack WHERE id = ?", (pack,)).fetchone()
        return self._unpack(blob[0] if blob else None, objects)

    @staticmethod
    def _unpack(blob: bytes | None, objects: list) -> dict:
        """Return {object: content} of objects [(object, pack, start, size)] in the pack
        `blob`, each checked against its name (a damaged one is left out)."""
        try:  # only as much of the pack as these objects need
            end = max(start + size for _, _, start, size in objects)
            whole = zlib.decompressobj().decompress(blob, end) if blob else b""
        except (zlib.error, TypeError, ValueError):  # damaged
            return {}
        found = {}
        for oid, _, start, size in objects:
            data = whole[start : start + size]
            if len(data) == size and hashlib.sha256(data).digest()[:16] == oid:
                found[oid] = data
        return found

    def metas(self, folder: str) -> dict:
        """Return {version id: {savedBy, summary}} of the packed versions of a folder."""
        sql = (
            "SELECT v.at, v.reason, v.object, m.data FROM version v "
            "JOIN meta m ON m.at = v.at AND m.object = v.object WHERE v.folder = ?"
        )
        found = {}
        for vid, _, data in self._vids(self._run(sql, (bytes.fromhex(folder),))):
            with contextlib.suppress(ValueError, TypeError):
                meta = json.loads(data)
                if isinstance(meta, dict):
                    found[vid] = meta
        return found

    def add_metas(self, metas: dict) -> None:
        """Keep {version id: {savedBy, summary}} of versions packed (or being packed)."""
        if not metas:
            return
        with self._transaction() as db:
            db.executemany(
                "INSERT OR REPLACE INTO meta (at, object, data) VALUES (?, ?, ?)",
                [
                    (at, oid, json.dumps(m, ensure_ascii=False))
                    for vid, m in metas.items()
                    for at, _, oid in [self._parts(vid)]
                ],
            )

    def add(self, folder: str, versions: list) -> None:
        """Keep versions [(version id, content)] of one history folder in one transaction:
        its pack is rewritten with the new contents (or they make new packs, past
        PACK_BYTES)."""
        name = bytes.fromhex(folder)
        with self._transaction() as db:
            old = self._vids(db.execute(self._OBJECTS, (name,)).fetchall())
            objects = {bytes.fromhex(vid[-32:]): (vid, data) for vid, data in versions}
            if sum(n for *_, n in old) + sum(len(d) for _, d in versions) <= self.PACK_BYTES:
                by_pack: dict = {}
                for _, *obj in old:
                    by_pack.setdefault(obj[1], []).append(obj)
                first = {oid: vid for vid, oid, *_ in sorted(old, reverse=True)}
                for pack, objs in by_pack.items():
                    for oid, data in self._slices(db, pack, objs).items():
                        objects.setdefault(oid, (first[oid], data))
            else:  # only what is not kept whole yet (a damaged copy is replaced)
                for oid in list(objects):
                    sql = "SELECT id, pack, start, size FROM object WHERE id = ?"
                    row = db.execute(sql, (oid,)).fetchone()
                    if row and self._slices(db, row[1], [row]):
                        del objects[oid]
            ordered = sorted(objects.items(), key=lambda item: item[1][0])  # oldest first
            packs: list = [[]]
            for oid, (_, data) in ordered:
                if packs[-1] and sum(len(d) for _, d in packs[-1]) + len(data) > self.PACK_BYTES:
                    packs.append([])
                packs[-1].append((oid, data))
            for pack in packs:
                if pack:
                    self._write_pack(db, pack)
            db.executemany(
                "INSERT OR IGNORE INTO version (folder, at, reason, object) VALUES (?, ?, ?, ?)",
                [(name, *self._parts(vid)) for vid, _ in versions],
            )

    @staticmethod
    def _write_pack(db: Any, objects: list) -> None:
        """Write objects [(object, content)] as one pack (within the caller's transaction)."""
        raw = b"".join(data for _, data in objects)
        pack = db.execute(
            "INSERT INTO pack (size, data) VALUES (?, ?)", (len(raw), zlib.compress(raw, 9))
        ).lastrowid
        rows, at = [], 0
        for oid, data in objects:
            rows.append((oid, pack, at, len(data)))
            at += len(data)
        db.executemany(
            "INSERT OR REPLACE INTO object (id, pack, start, size) VALUES (?, ?, ?, ?)", rows
        )

    def drop(self, folder: str, vids: Iterable[str]) -> None:
        name, vids = bytes.fromhex(folder), list(vids)
        if vids and self.file.exists():
            with self._transaction() as db:
                db.executemany(
                    "DELETE FROM version WHERE folder = ? AND at = ? AND object = ?",
                    [(name, at, oid) for at, _, oid in map(self._parts, vids)],
                )

    def move(self, src: str, dst: str, vids: list | None, copy: bool) -> None:
        """Give history folder dst the versions `vids` of src (all when None), moved or, with
        `copy`, shared (a version already in dst has the same content: its id says so)."""
        if not self.file.exists() or vids == []:
            return
        old, new = bytes.fromhex(src), bytes.fromhex(dst)
        with self._transaction() as db:
            sql = "SELECT at, reason, object FROM version WHERE folder = ?"
            rows = db.execute(sql, (old,)).fetchall()
            if vids is not None:  # each row with its own id (a damaged row has none)
                wanted = set(vids)
                named = [(row, self._vids([row])) for row in rows]
                rows = [row for row, got in named if got and got[0][0] in wanted]
            db.executemany(
                "INSERT OR IGNORE INTO version (folder, at, reason, object) VALUES (?, ?, ?, ?)",
                [(new, *row) for row in rows],
            )
            if not copy:
                db.executemany(
                    "DELETE FROM version WHERE folder = ? AND at = ? AND object = ?",
                    [(old, at, oid) for at, _, oid in rows],
                )

    def collect(self) -> None:
        """Drop the objects no version names and the packs no object is in; rewrite a pack
        whose live objects are under half of it (a sweep's work)."""
        if not self.file.exists():
            return
        with self._transaction() as db:
            db.execute("DELETE FROM object WHERE id NOT IN (SELECT object FROM version)")
            db.execute("DELETE FROM meta WHERE at NOT IN (SELECT at FROM version)")
            db.execute("DELETE FROM pack WHERE id NOT IN (SELECT pack FROM object)")
            thin = {
                pack
                for (pack,) in db.execute(
                    "SELECT p.id FROM pack p JOIN object o ON o.pack = p.id "
                    "GROUP BY p.id HAVING 2 * SUM(o.size) < MAX(p.size) LIMIT 100"
                )
            }  # (at most 100 a sweep: the store's lock is held meanwhile)
            live: dict = {}
            for row in db.execute("SELECT id, pack, start, size FROM object") if thin else ():
                if row[1] in thin:
                    live.setdefault(row[1], []).append(row)
            for pack, objects in live.items():
                found = self._slices(db, pack, objects)
                if len(found) < len(objects):
                    continue  # damaged: never rewritten as if whole
                objects.sort(key=lambda row: row[2])
                self._write_pack(db, [(oid, found[oid]) for oid, *_ in objects])
                db.execute("DELETE FROM pack WHERE id = ?", (pack,))
        self._shrink()

    def usage(self) -> tuple:
        """Return (versions, bytes on disk) of the packed history."""
        if not self.file.exists():
            return 0, 0
        versions = self._run("SELECT count(*) FROM version")[0][0]
        size = 0
        for suffix in ("", "-wal"):
            with contextlib.suppress(OSError):
                size += os.stat(f"{self.file}{suffix}").st_size
        return versions, size


class HistoryStore:
    """Past contents of the notes: <state>/history/<key of the note's path>/<version id>,
    until the retention sweep packs them (VersionPacks, after PACK_AFTER seconds).

    A version id is `<microseconds since the epoch, 16 digits>-<reason>-<etag>`: ids sort by
    age and say what a version is, so listing a history reads no content. The heads
    (HeadStore) hold a copy of each note as notesvc last wrote or saw it, so that a change
    made by another program, found by the rescan, still keeps the content it replaced; a
    cache, checked and not fsynced. A content about to be replaced by a rename is linked,
    not copied (no data written). Retention: a note's newest `max_versions`, and every
    version younger than `days`. Callers hold the note's lock (NoteStore's); the sweep only
    removes and packs (what a move does meanwhile waits for it: _pack_lock).
    """

    # Where the versions a move brought in were saved (lines "<version id> <path>"): a folder
    # grant sees only those saved inside its folder. A version not named was saved at the
    # path the history folder belongs to.
    ORIGINS = "origins"
    # Who made the change each version was kept for and what it did (lines "<version id>
    # <JSON {savedBy, summary}>", appended as changes are made, tidied by the sweep): best
    # effort, not fsynced (a version without its line lists them as null, as versions kept
    # before they were recorded do).
    META = "meta"
    PACK_AFTER = 3600  # seconds a version stays a loose file before a sweep packs it

    def __init__(self, folder: Path, max_versions: int, days: int, clock: Callable = time.time):
        self.folder = folder
        self.heads = HeadStore(folder / HeadStore.NAME, folder)
        self.packs = VersionPacks(folder / VersionPacks.NAME, folder)
        self._pack_lock = threading.Lock()  # packing a folder's versions, or moving them
        self.max_versions = max_versions
        self.days = days
        self.clock = clock  # injectable: retention by age is tested with another clock
        self._last_us = 0
        self._lock = threading.Lock()
        self._ids: dict = {}  # folder name -> its version ids, oldest first (kept by keep())

    @property
    def enabled(self) -> bool:
        return self.max_versions > 0

    def dir_of(self, path: str) -> Path:
        return self.folder / hashlib.sha256(path.encode("utf-8")).hexdigest()[:32]

    def folders(self) -> list:
        """Return the notes' history folders: those on disk and those only packed."""
        try:
            with os.scandir(self.folder) as entries:
                names = {
                    e.name for e in entries if len(e.name) == 32 and e.is_dir(follow_symlinks=False)
                }
        except FileNotFoundError:
            return []
        with contextlib.suppress(HeadStoreError):
            names.update(self.packs.folders())
        return [self.folder / name for name in sorted(names)]

    def close(self) -> None:
        self.heads.close()
        self.packs.close()

    def ids(self, folder: Path) -> list:
        """Return the version ids in a history folder, oldest first."""
        with self._lock:
            cached = self._ids.get(folder.name)
            if cached is not None:
                return list(cached)
        return sorted({*self._loose(folder), *self._packed(folder)})

    @staticmethod
    def _loose(folder: Path) -> list:
        """Return the ids of the versions kept as files in folder."""
        try:
            return [n for n in os.listdir(folder) if VERSION_ID_RE.match(n)]
        except (FileNotFoundError, NotADirectoryError):
            return []

    def _packed(self, folder: Path, strict: bool = False) -> dict:
        """Return {id: size} of the versions of folder that were packed (none when the
        packs cannot be read, logged; `strict`: HeadStoreError then)."""
        try:
            return self.packs.ids(folder.name)
        except HeadStoreError as e:
            if strict:
                raise
            log.error("history: the packed versions cannot be read (%s)", e)
            return {}

    def _packed_again(self, folder: Path) -> dict:
        """_packed(strict), asked twice: a busy or locked file is often free again."""
        try:
            return self._packed(folder, strict=True)
        except HeadStoreError:
            time.sleep(0.05)
            return self._packed(folder, strict=True)

    def _cached_ids(self, folder: Path) -> list:
        """ids() remembered: only under the note's lock, where its history changes (not
        while the packs cannot be read: the files alone are not all of it)."""
        with self._lock:
            cached = self._ids.get(folder.name)
            if cached is not None:
                return list(cached)
        try:
            found = sorted({*self._loose(folder), *self._packed(folder, strict=True)})
        except HeadStoreError:
            return self.ids(folder)
        with self._lock:
            if folder.name not in self._ids:
                if len(self._ids) >= 4096:
                    self._ids.pop(next(iter(self._ids)))
                self._ids[folder.name] = list(found)
        return found

    def _changed(self, folder: Path, added: str | None = None, dropped: Iterable = ()) -> None:
        """Keep the remembered ids of a folder in step (None added, nothing dropped: forget)."""
        with self._lock:
            cached = self._ids.get(folder.name)
            if cached is None:
                return
            if added is None and not dropped:
                del self._ids[folder.name]
                return
            if added is not None:
                cached.append(added)  # ids only grow: the newest goes last
            for vid in dropped:
                with contextlib.suppress(ValueError):
                    cached.remove(vid)

    def _folder(self, path: str) -> Path:
        """Return the note's history folder, created (0700) when missing."""
        folder = self.dir_of(path)
        if not folder.is_dir():
            with disk_writes():
                self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
                folder.mkdir(mode=0o700, exist_ok=True)
            fsync_dir(self.folder)
        return folder

    def _new_id(self, reason: str, etag: str) -> str:
        with self._lock:  # strictly increasing: ids never collide and sort by age
            us = max(int(self.clock() * 1_000_000), self._last_us + 1)
            self._last_us = us
        return f"{us:016d}-{reason}-{etag}"

    # -- keeping a version (under the note's lock) -------------------------------------

    def keep(self, path: str, data: bytes, reason: str, inode: tuple | None = None) -> str | None:
        """Keep data, a note's content about to be replaced, as its newest version; return
        the version's id (None when history is off or the newest version holds data).

        inode: (file, stat as read) of the note when the change replaces the file by a
        rename: its content is then linked, not copied, and durable only once durable()
        was called (before the rename; the note's own fsync has flushed the journal by
        then on most file systems, so that costs little). Raises DiskFull (507) with
        nothing kept.
        """
        if not self.enabled:
            return None
        etag = _etag_hex(data)
        for attempt in (1, 2):  # the sweep may remove an emptied folder in between
            folder = self._folder(path)
            ids = self._cached_ids(folder)
            if ids and ids[-1].endswith(etag):
                return None
            vid = self._new_id(reason, etag)
            try:
                if inode is None or not self._link(inode, folder / vid):
                    atomic_write(folder / vid, data, mode=0o600)
                self._changed(folder, added=vid)
                return vid
            except FileNotFoundError:
                self._changed(folder)
                if attempt == 2:
                    raise
        return None  # pragma: no cover

    @staticmethod
    def _link(inode: tuple, target: Path) -> bool:
        """Link a note's file as a version (the file is about to be replaced, not
        rewritten); False when the file system cannot or another program changed the
        file since it was read: then it is copied."""
        source, seen = inode
        try:
            with disk_writes():
                os.link(source, target)
        except DiskFull:
            raise
        except OSError:  # no hard links here (FAT, some network file systems)
            return False
        st = os.stat(target)
        if (st.st_ino, st.st_size, st.st_mtime_ns) != (seen.st_ino, seen.st_size, seen.st_mtime_ns):
            os.unlink(target)
            return False
        return True  # durable once its folder is fsynced: see durable()

    def durable(self, path: str) -> None:
        """Make the versions kept for a note durable (fsync its history folder)."""
        fsync_dir(self.dir_of(path))

    def settle(self, path: str, vid: str, meta: dict | None = None) -> None:
        """After the change a version was kept for: make it private, record who made the
        change and what it did (`meta`: {savedBy, summary}), apply the retention."""
        folder = self.dir_of(path)
        with contextlib.suppress(OSError):  # a linked version had the note's mode
            os.chmod(folder / vid, 0o600)
        if meta:
            self._add_meta(folder, {vid: meta})
        self.prune(folder)

    def _add_meta(self, folder: Path, metas: dict) -> None:
        """Append {version id: {savedBy, summary}} to a history folder's META (best effort)."""
        if not metas:
            return
        lines = "".join(f"{vid} {json.dumps(m, ensure_ascii=False)}\n" for vid, m in metas.items())
        try:
            fd = os.open(folder / self.META, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, lines.encode("utf-8"))
            finally:
                os.close(fd)
        except OSError as e:
            log.warning("history: who saved a version of %s is not kept (%s)", folder.name, e)

    def _copy_meta(self, src: Path, dst: Path, vids: Iterable[str]) -> None:
        """Give the versions vids, landing in dst, their META lines from src."""
        meta = self._meta(src)
        self._add_meta(dst, {vid: meta[vid] for vid in vids if vid in meta})

    def _meta(self, folder: Path) -> dict:
        """Return {version id: {savedBy, summary}} of a history folder (what can be read)."""
        try:
            text = (folder / self.META).read_text("utf-8", "replace")
        except OSError:
            return {}
        found = {}
        for line in text.split("\n"):
            vid, _, raw = line.partition(" ")
            if VERSION_ID_RE.match(vid):
                with contextlib.suppress(ValueError):
                    m = json.loads(raw)
                    if isinstance(m, dict):
                        found[vid] = m
        return found

    def meta_of(self, path: str, vid: str) -> dict | None:
        """Return {savedBy, summary} of one version of the note at path (None: unknown)."""
        folder = self.dir_of(path)
        return self._meta(folder).get(vid) or self._packed_metas(folder).get(vid)

    def _packed_metas(self, folder: Path) -> dict:
        try:
            return self.packs.metas(folder.name)
        except HeadStoreError as e:
            log.error("history: the packed versions cannot be read (%s)", e)
            return {}

    def _tidy_meta(self, folder: Path, present: Iterable[str]) -> None:
        """Drop the META lines of versions no longer kept (the sweep's)."""
        meta = self._meta(folder)
        kept = {vid: m for vid, m in meta.items() if vid in set(present)}
        if len(kept) == len(meta) and (folder / self.META).exists() == bool(meta or kept):
            return
        with contextlib.suppress(OSError):
            if not kept:
                os.unlink(folder / self.META)
                return
            lines = "".join(f"{v} {json.dumps(m, ensure_ascii=False)}\n" for v, m in kept.items())
            atomic_write(folder / self.META, lines.encode("utf-8"), mode=0o600)

    def discard(self, path: str, vid: str) -> None:
        """Drop a version kept for a change that then failed."""
        with contextlib.suppress(OSError):
            os.unlink(self.dir_of(path) / vid)
        self._changed(self.dir_of(path), dropped=[vid])

    def prune(self, folder: Path) -> int:
        """Remove the versions past the newest max_versions that are older than `days`."""
        if not self.enabled:
            return 0
        ids = self.ids(folder)
        cutoff = (self.clock() - self.days * DAY_SECONDS) * 1_000_000
        removed = []
        for vid in ids[: max(0, len(ids) - self.max_versions)]:  # oldest first
            if self.days and int(vid[:16]) >= cutoff:
                break
            with contextlib.suppress(FileNotFoundError):
                os.unlink(folder / vid)
            removed.append(vid)
        packed = self._packed(folder) if removed else {}  # (a crash may leave one in both)
        if packed:
            with contextlib.suppress(HeadStoreError):  # kept, to be dropped by the next sweep
                self.packs.drop(folder.name, [vid for vid in removed if vid in packed])
        if removed:
            self._changed(folder, dropped=removed)
        return len(removed)

    def relocate(self, old: str, new: str, until_us: int | None = None, copy: bool = False):
        """Give the note at `new` the history of `old` (a move, a restore elsewhere): the
        versions saved up to until_us (all when None), moved, or linked when `copy`."""
        with self._pack_lock:  # a sweep packs no version of these folders meanwhile
            try:
                self._relocate(old, new, until_us, copy)
            except HeadStoreError as e:  # the packed ones stay under `old` (the caller logs)
                raise OSError(f"the packed versions: {e}") from None

    def _relocate(self, old: str, new: str, until_us: int | None, copy: bool):
        src, dst = self.dir_of(old), self.dir_of(new)
        self._changed(src)
        self._changed(dst)
        try:
            packed, known = self._packed_again(src), True
        except HeadStoreError as e:  # the files move; what the packs hold stays in src
            log.error("history: packed versions of %s stay under that path (%s)", log_safe(old), e)
            packed, known = {}, False
        ids = sorted({*self._loose(src), *packed})
        ids = [v for v in ids if until_us is None or int(v[:16]) <= until_us]
        origins = self._origins(src)
        came = {vid: origins.get(vid, old) for vid in ids}
        whole = not copy and until_us is None and known and not packed
        if whole and src.is_dir() and not dst.exists():
            self._write_origins(src, {**origins, **came})  # what `old` means, before the move
            os.replace(src, dst)  # the whole folder, origins included
            fsync_dir(self.folder)
            return
        if not ids:
            return
        dst = self._folder(new)
        # the origins before the versions land (a crash in between: the versions stay in
        # src with theirs); the packed ones first, the files after (src's origins stay)
        self._write_origins(dst, {**self._origins(dst), **came}, landing=ids)
        self._copy_meta(src, dst, ids)
        self.packs.move(src.name, dst.name, [v for v in ids if v in packed], copy)
        for vid in ids:
            if vid in packed and not (src / vid).exists():
                continue
            if (dst / vid).exists():  # the same id: the same content
                if not copy:
                    os.unlink(src / vid)
            elif not copy:
                os.replace(src / vid, dst / vid)
            else:
                try:
                    os.link(src / vid, dst / vid)
                except OSError:  # no hard links here
                    atomic_write(dst / vid, (src / vid).read_bytes(), mode=0o600)
        fsync_dir(dst)
        if not copy:
            self.drop_head(old)
            with contextlib.suppress(OSError):
                src.rmdir()

    def _origins(self, folder: Path) -> dict:
        """Return {version id: the path it was saved at} for versions moved into folder;
        OSError when the file is there but cannot be read (never taken for "none")."""
        try:
            text = (folder / self.ORIGINS).read_text("utf-8")
        except (FileNotFoundError, NotADirectoryError):
            return {}
        except UnicodeDecodeError as e:
            raise OSError(f"{folder / self.ORIGINS}: {e}") from None
        pairs = (line.partition(" ") for line in text.split("\n"))  # a path may hold U+2028
        return {vid: path for vid, _, path in pairs if VERSION_ID_RE.match(vid) and path}

    def _write_origins(self, folder: Path, origins: dict, landing: Iterable = ()) -> None:
        """Keep the origins of the versions in folder and of those `landing` there next
        (atomic, private). While the packs cannot be read, all are kept: an origin too many
        is never read, one too few would show a version to a folder grant."""
        try:
            here = {*self._loose(folder), *self._packed(folder, strict=True), *landing}
        except HeadStoreError:
            here = set(origins)
        lines = "".join(f"{v} {p}\n" for v, p in sorted(origins.items()) if v in here)
        if lines:
            atomic_write(folder / self.ORIGINS, lines.encode("utf-8"), mode=0o600)

    def saved_at(self, path: str, vid: str) -> str:
        """Return the path the note had when version vid of the note at path was saved
        ("" when that cannot be read: no folder grant sees it)."""
        try:
            return self._origins(self.dir_of(path)).get(vid, path)
        except OSError as e:
            log.error(
                "history: where the versions of %s were saved is unknown (%s)", log_safe(path), e
            )
            return ""

    # -- the copy of the current content ----------------------------------------------

    def write_head(self, path: str, data: bytes, etag: str | None = None) -> None:
        """Remember data (whose etag may be given) as the note's content as last written
        or seen (best effort: a copy that cannot be kept is dropped, never left stale)."""
        if not self.enabled:
            return
        try:
            self.heads.put(path, data)
        except (OSError, HeadStoreError) as e:
            log.warning("history: could not keep a copy of %s (%s)", log_safe(path), e)
            with contextlib.suppress(OSError, HeadStoreError):
                self.heads.drop(path)

    def write_heads(self, items: list) -> None:
        """Remember the first copies of many notes [(path, bytes)] at once (packed)."""
        if not self.enabled or not items:
            return
        try:
            self.heads.put_new(items)
        except (OSError, HeadStoreError) as e:
            log.warning("history: could not keep the copies of %d notes (%s)", len(items), e)

    def read_head(self, path: str) -> bytes | None:
        """Return the note's content as last written or seen, None when unknown."""
        try:
            return self.heads.get(path)
        except (OSError, HeadStoreError):
            return None

    def has_head(self, path: str) -> bool:
        try:
            return self.heads.has(path)
        except (OSError, HeadStoreError):
            return False

    def head_paths(self, folders: Iterable[Path]) -> dict:
        """Return {history folder: the note path it belongs to} for the folders a copy
        tells (the folder name is a hash of the path)."""
        wanted = {f.name: f for f in folders}
        try:
            paths = self.heads.paths()
        except (OSError, HeadStoreError):
            return {}
        found = {}
        for path in paths:
            folder = wanted.get(self.dir_of(path).name)
            if folder is not None:
                found[folder] = path
        return found

    def drop_head(self, path: str) -> None:
        with contextlib.suppress(OSError, HeadStoreError):
            self.heads.drop(path)

    # -- reading ------------------------------------------------------------------

    @staticmethod
    def describe(vid: str, size: int, meta: dict | None = None) -> dict:
        """Return a version as listed: savedAt, reason, savedBy and summary say when, why,
        by whom and how the note changed from this content (meta: what META holds)."""
        m, meta = VERSION_ID_RE.match(vid), meta or {}
        by, summary = meta.get("savedBy"), meta.get("summary")
        return {
            "id": vid,
            "savedAt": iso(int(m.group(1)) / 1_000_000),
            "size": size,
            "etag": f'"{m.group(3)}"',
            "reason": m.group(2),
            "savedBy": by if isinstance(by, str) else None,
            "summary": summary if isinstance(summary, str) else None,
        }

    def versions(self, path: str, sees: Callable | None = None) -> list:
        """Return the note's versions, newest first (no content); with `sees`, only those
        saved at a path sees(path) accepts (a folder grant's)."""
        folder, found = self.dir_of(path), []
        ids = self.ids(folder)  # before the origins: those of a version are there before it
        packed = self._packed(folder)
        try:
            origins = self._origins(folder) if sees else {}
        except OSError as e:  # a grant sees none of them rather than too many
            log.error(
                "history: where the versions of %s were saved is unknown (%s)", log_safe(path), e
            )
            return []
        meta = {**(self._packed_metas(folder) if packed else {}), **self._meta(folder)}
        for vid in reversed(ids):
            if sees and not sees(origins.get(vid, path)):
                continue
            try:
                size = packed[vid] if vid in packed else os.stat(folder / vid).st_size
            except OSError:  # packed meanwhile, or pruned
                packed = self._packed(folder)
                if vid not in packed:
                    continue
                size = packed[vid]
            found.append(self.describe(vid, size, meta.get(vid)))
        return found

    def read(self, path: str, vid: str) -> bytes:
        """Return a version's content; 400 for a malformed id, 404 for an unknown one."""
        if not VERSION_ID_RE.match(vid):
            raise bad_request(f"{vid[:80]!r} is not a version id (see GET .../versions)")
        folder = self.dir_of(path)
        try:
            return (folder / vid).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            pass
        try:
            data = self.packs.read(folder.name, vid)
        except HeadStoreError as e:
            log.error("history: the packed versions cannot be read (%s)", e)
            data = None
        if data is None:
            raise not_found(f"no version {vid} of {path}")
        return data

    def sweep(self, folder: Path, fix_modes: bool = False) -> int:
        """Apply the retention to one folder (and make its versions private: a crash in
        settle() may have left one with its note's mode), remove it when empty; return how
        many versions were removed."""
        removed = self.prune(folder)
        self._changed(folder)  # what the disk says from now on
        self.pack(folder)
        with self._pack_lock, contextlib.suppress(HeadStoreError):  # no move lands meanwhile
            self._tidy_meta(folder, self._loose(folder))  # (a crash may have left lines)
            if not self._loose(folder) and not self._packed(folder, strict=True):
                with contextlib.suppress(OSError):
                    os.unlink(folder / self.ORIGINS)
        for vid in self.ids(folder) if fix_modes else ():
            with contextlib.suppress(OSError):
                if stat.S_IMODE(os.stat(folder / vid).st_mode) != 0o600:
                    os.chmod(folder / vid, 0o600)
        with contextlib.suppress(OSError):
            folder.rmdir()  # only when nothing is left in it
        return removed

    def pack(self, folder: Path) -> int:
        """Move the versions of a history folder older than PACK_AFTER from their files into
        the packs (durably, then the files are removed), about PACK_BYTES at a time (a move
        or a read waits for one batch at most); return how many."""
        cutoff = (self.clock() - self.PACK_AFTER) * 1_000_000
        loose = sorted(v for v in self._loose(folder) if int(v[:16]) < cutoff)
        done, at = 0, 0
        while at < len(loose):
            with self._pack_lock:
                versions, size = [], 0
                while at < len(loose) and size < VersionPacks.PACK_BYTES:
                    vid, at = loose[at], at + 1
                    with contextlib.suppress(OSError):  # pruned or moved meanwhile
                        data = (folder / vid).read_bytes()
                        if _etag_hex(data) == vid[-32:]:  # else damaged: left as it is
                            versions.append((vid, data))
                            size += len(data)
                if not versions:
                    continue
                meta = self._meta(folder)
                metas = {vid: meta[vid] for vid, _ in versions if vid in meta}
                try:
                    self.packs.add_metas(metas)  # first: a crash leaves the files, again
                    self.packs.add(folder.name, versions)
                except HeadStoreError as e:  # a full disk: they stay files, nothing lost
                    log.warning("history: versions not packed (%s)", e)
                    return done
                gone = []  # removed meanwhile by a save's retention (which holds no pack lock)
                for vid, _ in versions:
                    try:
                        os.unlink(folder / vid)
                    except FileNotFoundError:
                        gone.append(vid)
                    except OSError:
                        pass
                with contextlib.suppress(HeadStoreError):
                    self.packs.drop(folder.name, gone)
                self._tidy_meta(folder, self._loose(folder))  # the packed ones' are packed
                done += len(versions) - len(gone)
        return done

    def collect(self) -> None:
        """Drop what the packs hold for no version any more (a sweep's work)."""
        try:
            self.packs.collect()
        except HeadStoreError as e:
            log.warning("history: the packs were not tidied (%s)", e)

    def usage(self) -> dict:
        """Return {notes, versions, bytes} of the history (the copies' and packs' bytes
        included)."""
        notes = versions = size = 0
        for folder in self.folders():
            notes += 1
            with contextlib.suppress(OSError):
                for e in os.scandir(folder):
                    with contextlib.suppress(OSError):
                        size += e.stat(follow_symlinks=False).st_size
                    versions += bool(VERSION_ID_RE.match(e.name))
        with contextlib.suppress(HeadStoreError):
            packed, packed_bytes = self.packs.usage()
            versions, size = versions + packed, size + packed_bytes
        return {"notes": notes, "versions": versions, "bytes": size}
