"""Imports: the plan, its bounds, and writing it through the stores."""

from __future__ import annotations

import contextlib
import io
import json
import os
import posixpath
import re
import shutil
import stat
import struct
import time
import unicodedata
import urllib.parse
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Callable

from notesvc.boot import log
from notesvc.errors import STATUS_CODES, ApiError
from notesvc.helpers import (
    BODY_CHUNK,
    deferred_sync,
    iso,
    log_safe,
    plural,
    release_memory,
    sync_batch,
)
from notesvc.notes.paths import (
    ATTACHMENTS,
    BIDI_CONTROLS,
    FORBIDDEN_CHARS,
    MAX_SEGMENT_BYTES,
    NOTES,
    ZERO_WIDTH,
    attachment_path,
    note_file_path,
    note_path,
)
from notesvc.notes.store import disk_path

# -- Import and export ---------------------------------------------------------------------
#
# Bring every note you have, take them all with you (docs/api.md: Import). An import reads a
# source (a folder, a zip, a tar, an .enex stream), refuses a hostile one before anything
# is written, turns each format's notes into Markdown drafts, names them (never over
# anything: a taken name gets " 2"), rewrites the links between them, and writes each
# note with one atomic create through the NoteStore, so the index, the history and the
# change feed see it. A dry run stops before the writes and reports the same plan.

IMPORT_KINDS = ("keep", "evernote", "notion", "obsidian", "joplin", "files", "notesvc")
EXPORT_MANIFEST = "notesvc-export.json"
BOMB_RATIO = 100  # an entry may expand to at most this many times its compressed size...
BOMB_MIN_BYTES = 1 << 20  # ...once it expands past a mebibyte (smaller ones cannot harm)
IMPORT_TEXT_TYPES = ("md", "markdown", "txt", "text")
IMPORT_SYNC_NOTES = 500  # writes between two syncs of an import (and at least each second)
# a zip's central directory may take this many bytes for each entry SERVICE_MAX_IMPORT_ENTRIES
# allows (16 MB at 50,000: names of 270 bytes on average); zipfile holds it all, twice
ZIP_DIRECTORY_BYTES = 320
DISK_BLOCK = 4096  # what a small file takes on the disk, at least (see import_need)
IMPORT_DISK_SLACK = 8 << 20  # the SQLite files' journals and the index's merges, meanwhile
# entries that become notes (their disk counts three times: see import_need)
IMPORT_NOTE_TYPES = frozenset((*IMPORT_TEXT_TYPES, "json", "csv", "html", "htm", "enex"))
_WINDOWS_NAMES = frozenset(
    ["con", "prn", "aux", "nul"] + [f"{p}{n}" for p in ("com", "lpt") for n in range(1, 10)]
)
NOTION_ID_RE = re.compile(r"\s+[0-9a-f]{32}$|\s+[0-9a-f]{8}(?:-[0-9a-f]{4}){3}-[0-9a-f]{12}$")
_LINK_TOKEN_RE = re.compile("\x00([^\x00\x01]*)\x01([^\x00]*)\x00")
_DRIVE_RE = re.compile(r"^[A-Za-z]:")


def import_refused(message: str, status: int = 400) -> ApiError:
    """An archive refused whole, before anything was written."""
    return ApiError(status, STATUS_CODES[status], f"nothing was imported: {message}")


def import_budget(packed: int, limit: int) -> int:
    """Return the most an upload of `packed` bytes may expand to, all its entries together:
    100 times its size (a mebibyte at least: smaller cannot harm), never over `limit`
    (SERVICE_MAX_IMPORT_EXPANDED_BYTES)."""
    return min(limit, max(BOMB_RATIO * packed, BOMB_MIN_BYTES))


def import_too_big(total: int, packed: int, limit: int) -> ApiError:
    """413 for a source whose entries declare `total` bytes, over import_budget()."""
    if total > limit:
        return import_refused(
            f"the archive expands to more than {limit} bytes (SERVICE_MAX_IMPORT_EXPANDED_BYTES)",
            413,
        )
    return import_refused(
        f"the archive expands to {total} bytes, more than {BOMB_RATIO} times its "
        f"{packed} bytes (a zip bomb?)",
        413,
    )


def import_too_many(most: int, what: str = "the archive holds", count: int = 0) -> ApiError:
    """413 for a source of more than `most` entries (SERVICE_MAX_IMPORT_ENTRIES): `count`
    when it declares how many (a zip's end record), else as soon as one more is seen."""
    many = f"{count:,}" if count else f"more than {most:,}"
    return import_refused(
        f"{what} {many} entries; an import takes at most {most:,} "
        "(SERVICE_MAX_IMPORT_ENTRIES): split it, or raise the setting",
        413,
    )


def zip_entries(file: Any, most: int) -> int:
    """Return how many entries a zip's central directory holds, counted before zipfile
    reads it (zipfile builds an object of some 500 bytes for each): more than `most` refuse
    it (413) from its end record's count alone, and, since zipfile reads the directory by
    its size and not by that count, from the directory itself, whose size may not pass
    ZIP_DIRECTORY_BYTES for each entry allowed and whose records are counted. A file with
    no end record (not a zip) is left to zipfile to say so."""
    end = _zip_end_record(file)
    if end is None:
        return 0
    declared, size, start = end
    if declared > most:
        raise import_too_many(most, count=declared)
    if start < 0:  # a directory said to begin before the file: zipfile refuses it (400)
        return declared
    if size > most * ZIP_DIRECTORY_BYTES:
        raise import_refused(
            f"the zip's directory takes {size:,} bytes, more than {ZIP_DIRECTORY_BYTES} for "
            f"each of the {most:,} entries an import may hold (SERVICE_MAX_IMPORT_ENTRIES)",
            413,
        )
    file.seek(start)
    directory = file.read(size)
    count = at = 0
    while at + 46 <= len(directory) and directory[at : at + 4] == b"PK\x01\x02":
        count += 1
        if count > most:
            raise import_too_many(most)
        name, extra, comment = struct.unpack_from("<HHH", directory, at + 28)
        at += 46 + name + extra + comment
    return count


def _zip_end_record(file: Any) -> tuple | None:
    """Return (entries, directory size, directory start) as zipfile finds them: the end
    of central directory record (the last 22 bytes, else the last one in the 64 KiB a
    comment may take), Zip64's when its locator stands before it; None when there is none."""
    size = file.seek(0, io.SEEK_END)
    if size < 22:
        return None
    file.seek(size - 22)
    tail = file.read(22)
    if tail[:4] == b"PK\x05\x06" and tail[-2:] == b"\x00\x00":
        at, record = size - 22, tail
    else:
        window = max(size - 22 - 0xFFFF, 0)
        file.seek(window)
        data = file.read()
        found = data.rfind(b"PK\x05\x06")
        record = data[found : found + 22] if found >= 0 else b""
        if len(record) != 22:
            return None
        at = window + found
    entries, dir_size = struct.unpack("<10xHL6x", record)
    extra = 0
    if at >= 20:
        file.seek(at - 20)
        locator = file.read(20)
        if locator[:4] == b"PK\x06\x07" and at >= 76:
            file.seek(at - 76)
            record64 = file.read(56)
            if record64[:4] == b"PK\x06\x06":
                entries, dir_size = struct.unpack("<32xQQ8x", record64)
                extra = 76
    return entries, dir_size, at - dir_size - extra


def import_need(entries: Iterable) -> int:
    """Return the disk an import of these entries may take (the 507 check): each file in
    whole blocks and a block more (its folder's entry, its journal line and index row);
    a note (a text entry) twice its size again, for the history's copy and the index's
    postings (neither compressed, to be safe); and IMPORT_DISK_SLACK for the journals of
    the SQLite files. Declared sizes, so a file the import will skip counts too."""
    need = IMPORT_DISK_SLACK
    for e in entries:
        need += _disk_blocks(e.size) + DISK_BLOCK
        if e.name.rpartition(".")[2].lower() in IMPORT_NOTE_TYPES:
            need += 2 * e.size
    return need


def note_need(size: int) -> int:
    """Return the disk one note of `size` bytes may take (see import_need)."""
    return _disk_blocks(size) + DISK_BLOCK + 2 * size


def _disk_blocks(size: int) -> int:
    return -(-size // DISK_BLOCK) * DISK_BLOCK


def import_settled() -> None:
    """After an import, answered or refused: collect what it left in cycles and give the
    freed heap back to the system (glibc's malloc_trim), so that a server is back near its
    idle memory once the answer is out, not at the import's peak."""
    import gc

    gc.collect()
    release_memory()


def unreadable_archive_errors() -> tuple:
    """What zipfile, tarfile and their decompressors raise on a damaged or hostile archive
    (a name that differs from its local header, a bad CRC, truncated or undecodable data,
    an unsupported method, an encrypted entry): each is 400 "not a readable ...", never 500."""
    import tarfile
    import zipfile

    errors = [zipfile.BadZipFile, zipfile.LargeZipFile, tarfile.TarError, zlib.error]
    errors += [EOFError, NotImplementedError, RuntimeError, struct.error, OSError, ValueError]
    with contextlib.suppress(ImportError):
        import lzma

        errors.append(lzma.LZMAError)
    return tuple(errors)


def import_room(svc: Any, need: int) -> None:
    """Refuse (507) an import that would leave the notes' disk with less free than
    min(5 % of it, SERVICE_IMPORT_MIN_FREE_BYTES) once its `need` bytes are written
    (import_need: the notes, their history's copies and index, the files)."""
    try:
        disk = shutil.disk_usage(svc.config.root)
    except OSError:
        return
    margin = min(disk.total * 5 // 100, svc.config.import_min_free_bytes)
    if disk.free - need < margin:
        raise import_refused(
            f"it may take up to {need} bytes of the notes' disk (the notes, their history's "
            f"copies and search index, the files) and leave less than {margin} bytes free "
            f"({disk.free} free now; the margin is 5 % of the disk or "
            "SERVICE_IMPORT_MIN_FREE_BYTES, whichever is less): free some space first",
            507,
        )


def import_segment(name: str, fallback: str = "untitled") -> str:
    """Return one path segment made safe from any name: no control, bidi, zero-width or
    forbidden characters, no leading dot, no trailing dot or space, not a name Windows
    reserves, at most 200 bytes.

    >>> import_segment("CON"), import_segment("a/b: c?\\x07"), import_segment("...")
    ('CON_', 'a b c', 'untitled')
    """
    name = unicodedata.normalize("NFC", name)
    name = "".join(
        " " if ord(ch) < 32 or 0x7F <= ord(ch) < 0xA0 or ch in FORBIDDEN_CHARS or ch == "/" else ch
        for ch in name
        if ch not in BIDI_CONTROLS and ch not in ZERO_WIDTH
    )
    name = " ".join(name.split()).lstrip(".").rstrip(". ")
    while len(name.encode("utf-8")) > 200:
        name = name[:-1].rstrip(". ")
    if name.split(".")[0].casefold() in _WINDOWS_NAMES:
        stem, dot, ext = name.partition(".")
        name = f"{stem}_{dot}{ext}"
    return name or fallback


def link_token(target: str, fallback: str) -> str:
    """Return a link's place-holder in a draft: replaced by the path `target` (a source
    name) gets, relative to the note, or by `fallback` when the import holds no such file."""
    return f"\x00{target}\x01{fallback}\x00"


class ImportEntry:
    """One file of an import's source: its name, its declared size, and how to open it
    (`opener(ref)`, one function shared by a source's entries, `ref` the entry's own zip or
    tar header, or its file's path). Slotted: 50,000 entries cost little more than their
    names."""

    __slots__ = ("name", "opener", "ref", "size")

    def __init__(self, name: str, size: int, opener: Callable, ref: Any = None):
        self.name = name  # its path inside the source, `/`-separated, NFC
        self.size = size  # as its header declares it: never more is read (see _CountedRead)
        self.opener, self.ref = opener, ref

    def open(self) -> _CountedRead:
        """Return its bytes as a file object giving no more than its declared size."""
        return _CountedRead(self, self.opener(self.ref))


class _CountedRead:
    """An entry's bytes as they are read: one byte past its declared size refuses the
    import (a header that lies about the size), so no entry gives more than it declared and
    the whole source no more than the sum checked when it was opened."""

    def __init__(self, entry: ImportEntry, f: Any):
        self.entry, self.f, self.seen = entry, f, 0

    def read(self, n: int = -1) -> bytes:
        allowed = self.entry.size + 1 - self.seen
        data = self.f.read(allowed if n is None or n < 0 else min(n, allowed))
        self.seen += len(data)
        if self.seen > self.entry.size:
            raise import_refused(
                f"{log_safe(self.entry.name, 120)} holds more than the "
                f"{plural(self.entry.size, 'byte')} its header declares (a zip bomb?)",
                413,
            )
        return data

    def close(self) -> None:
        self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _UnpackedTar:
    """A compressed tar (gzip, bzip2, xz) as it unpacks, bounded like its members: the
    headers tarfile reads whole into memory (a pax header, a GNU long name) count too, so
    a few hundred packed bytes cannot become gigabytes. Past the import's budget (and a
    mebibyte for the headers and padding), 413."""

    def __init__(self, f: Any, bound: int, packed: int, limit: int):
        self.f, self.bound, self.packed, self.limit = f, bound, packed, limit

    @classmethod
    def of(cls, file: Any, packed: int, budget: int, limit: int) -> Any:
        """Return file itself when it is a plain tar, else its unpacking, bounded."""
        head = file.read(6)
        file.seek(0)
        if head.startswith(b"\x1f\x8b"):
            import gzip

            unpacked = gzip.GzipFile(fileobj=file)
        elif head.startswith(b"BZh"):
            import bz2

            unpacked = bz2.BZ2File(file)
        elif head.startswith(b"\xfd7zXZ\x00"):
            import lzma

            unpacked = lzma.LZMAFile(file)  # noqa: SIM115 (closed by ImportSource.close)
        else:
            return file
        return cls(unpacked, budget + BOMB_MIN_BYTES, packed, limit)

    def _check(self) -> None:
        at = self.f.tell()
        if at > self.bound:
            raise import_too_big(at, self.packed, self.limit)

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = self.bound + 1 - self.f.tell()
        data = self.f.read(min(n, max(0, self.bound + 1 - self.f.tell())))
        self._check()
        return data

    def seek(self, pos: int, whence: int = 0) -> int:
        if whence == 0 and pos > self.bound:
            raise import_too_big(pos, self.packed, self.limit)
        at = self.f.seek(pos, whence)
        self._check()
        return at

    def tell(self) -> int:
        return self.f.tell()

    def close(self) -> None:
        self.f.close()


class ImportSource:
    """The files of a source (a folder, a zip or a tar), checked whole when opened: zip
    slip, absolute names, drive letters, links, zip bombs and more than
    SERVICE_MAX_IMPORT_ENTRIES entries refuse it (400 / 413) before anything is read
    further, let alone written."""

    def __init__(
        self,
        entries: list,
        kind_hint: str = "",
        closer: Callable | None = None,
        check: Callable | None = None,
    ):
        self.entries = entries
        self.by_name = {e.name: e for e in entries}
        self.kind_hint = kind_hint
        self._closer = closer
        self._check = check  # entry -> its bytes and more, if it holds more (a zip's)

    def declared(self) -> int:
        """Return the bytes its entries declare, together."""
        return sum(e.size for e in self.entries)

    def need(self) -> int:
        """Return the disk its import may take (see import_need)."""
        return import_need(self.entries)

    def verify(self, what: str, progress: Callable | None = None) -> None:
        """Read every entry once, to its end, before anything is written: an entry that is
        not readable (S4: a name that differs from its local header, a bad CRC, truncated
        data, an unsupported method, a password) refuses the source with 400, one that gives
        more than its header declares with 413, in a dry run as in the import. `progress`
        is called as an ImportPlan's is, with the entries read so far."""
        import types

        done = types.SimpleNamespace(read=0, created=0, attachments=0)
        for e in self.entries:
            try:
                raw = self._check(e) if self._check else e.opener(e.ref)
                with _CountedRead(e, raw) as f:
                    while f.read(BODY_CHUNK):
                        if progress:
                            progress(done)
            except unreadable_archive_errors() as err:
                raise import_refused(
                    f"the file is not a readable {what} ({log_safe(e.name, 120)}: "
                    f"{log_safe(str(err), 200) or type(err).__name__})"
                ) from None
            done.read += 1

    def close(self) -> None:
        if self._closer:
            self._closer()

    def read(self, entry: ImportEntry, limit: int | None = None) -> bytes:
        with entry.open() as f:
            data = f.read(-1 if limit is None else limit + 1)
        if limit is not None and len(data) > limit:
            raise ValueError(f"over {limit} bytes")
        return data

    @staticmethod
    def clean_name(raw: str) -> str | None:
        """Return an entry's name, None for a folder entry; raise when it leaves the source.
        A name that needs no change is returned as it is (one string, not two)."""
        name = unicodedata.normalize("NFC", raw.replace("\\", "/"))
        if name.endswith("/"):
            return None
        if name.startswith("/") or _DRIVE_RE.match(name) or "\x00" in name:
            raise import_refused(f"the archive names a file outside itself: {log_safe(raw, 120)}")
        parts = [p for p in name.split("/") if p not in ("", ".")]
        if ".." in parts:
            raise import_refused(f"the archive names a file outside itself: {log_safe(raw, 120)}")
        clean = "/".join(parts)
        return (name if clean == name else clean) or None

    @classmethod
    def from_zip(
        cls, file: Any, expanded_limit: int, packed: int, most: int = 1 << 62
    ) -> ImportSource:
        """Open a zip of `packed` bytes: refused whole when its end record or its directory
        counts more than `most` entries (before zipfile reads the directory), when an entry
        leaves it or is a link, when two entries share bytes (one local file named by many
        central-directory entries: a zip bomb), when an entry expands more than 100 times,
        or when all of them together declare more than import_budget()."""
        import copy
        import zipfile

        zip_entries(file, most)
        try:
            zf = zipfile.ZipFile(file)
            infos = zf.infolist()
        except unreadable_archive_errors() as e:
            raise import_refused(f"the file is not a readable zip ({e})") from None
        if len(infos) > most:  # zip_entries counted these: never, but the cap is the cap
            zf.close()
            raise import_too_many(most, count=len(infos))
        entries, total, opener = [], 0, zf.open  # one bound method for all
        try:
            for info in infos:
                name = cls.clean_name(info.filename)
                mode = info.external_attr >> 16
                if stat.S_ISLNK(mode):
                    raise import_refused(
                        f"the archive holds a symbolic link: {log_safe(info.filename, 120)}"
                    )
                total += info.file_size
                if total > expanded_limit:
                    raise import_too_big(total, packed, expanded_limit)
                if info.file_size > BOMB_MIN_BYTES and info.file_size > BOMB_RATIO * max(
                    1, info.compress_size
                ):
                    raise import_refused(
                        f"{log_safe(info.filename, 120)} expands more than {BOMB_RATIO} times "
                        "(a zip bomb?)",
                        413,
                    )
                if name is None or info.is_dir():
                    continue
                entries.append(ImportEntry(name, info.file_size, opener, info))
            if total > import_budget(packed, expanded_limit):
                raise import_too_big(total, packed, expanded_limit)
            cls._no_shared_bytes(file, infos)
        except ApiError:
            zf.close()
            raise

        def wider(entry: ImportEntry) -> Any:
            # verify() reads through a copy declaring a mebibyte more, so that zipfile (which
            # stops at the declared size, then checks the CRC) gives the byte past it: a
            # size that lies is then seen as what it is
            info = copy.copy(entry.ref)
            info.file_size += BOMB_MIN_BYTES
            return zf.open(info)

        return cls(entries, closer=zf.close, check=wider)

    @staticmethod
    def _no_shared_bytes(file: Any, infos: list) -> None:
        """Refuse a zip whose entries share bytes: each entry's local header and data,
        [header_offset, end of its compressed data), read from the local header itself,
        must overlap no other's."""
        import array

        starts, ends = array.array("q"), array.array("q")  # 16 bytes an entry, not a tuple
        for info in infos:
            head = b""
            if info.header_offset >= 0:  # < 0: a directory placed past where it is
                file.seek(info.header_offset)
                head = file.read(30)
            if len(head) < 30 or head[:4] != b"PK\x03\x04":
                raise import_refused(
                    f"the file is not a readable zip ({log_safe(info.filename, 120)} has no "
                    "local header where its directory entry points)"
                )
            name_len, extra_len = struct.unpack("<HH", head[26:30])
            starts.append(info.header_offset)
            ends.append(info.header_offset + 30 + name_len + extra_len + info.compress_size)
        order = sorted(range(len(starts)), key=starts.__getitem__)
        for first, second in zip(order, order[1:]):
            if starts[second] < ends[first]:
                raise import_refused(
                    f"entries {log_safe(infos[first].filename, 80)} and "
                    f"{log_safe(infos[second].filename, 80)} share their bytes in the archive "
                    "(a zip bomb?)",
                    413,
                )

    @classmethod
    def from_tar(
        cls, file: Any, expanded_limit: int, packed: int, most: int = 1 << 62
    ) -> ImportSource:
        """Open a tar (a .jex; compressed ones too) of `packed` bytes, one header at a
        time: its members' declared sizes (a sparse member's full size) together may not
        pass import_budget(), nor their number `most`, checked before the next header is
        looked for."""
        import tarfile

        budget = import_budget(packed, expanded_limit)
        try:
            unpacked = _UnpackedTar.of(file, packed, budget, expanded_limit)
            tf = tarfile.open(fileobj=unpacked, mode="r:")  # noqa: SIM115 (closed by close())
        except unreadable_archive_errors() as e:
            raise import_refused(f"the file is not a readable tar ({e})") from None
        entries, total, count, opener = [], 0, 0, tf.extractfile
        try:
            for m in tf:
                count += 1
                if count > most:
                    raise import_too_many(most)
                name = cls.clean_name(m.name)
                if m.issym() or m.islnk():
                    raise import_refused(f"the archive holds a link: {log_safe(m.name, 120)}")
                total += m.size
                if total > budget:
                    raise import_too_big(total, packed, expanded_limit)
                if name is None or m.isdir():
                    continue
                if not m.isfile():
                    raise import_refused(
                        f"the archive holds a device or a pipe: {log_safe(m.name, 120)}"
                    )
                entries.append(ImportEntry(name, m.size, opener, m))
        except unreadable_archive_errors() as e:
            tf.close()
            raise import_refused(f"the file is not a readable tar ({e})") from None
        except ApiError:
            tf.close()
            raise

        def close() -> None:
            tf.close()
            if unpacked is not file:  # a compressed tar: its unpacking too
                unpacked.close()

        return cls(entries, kind_hint="joplin", closer=close)

    @classmethod
    def from_folder(cls, folder: Path, skipped: list, most: int = 1 << 62) -> ImportSource:
        """Return the files of a folder (hidden ones and links left out, the links named in
        `skipped`); more than `most` of them refuse it (413) as soon as the walk finds one
        more."""
        entries, count = [], 0
        for top, dirs, files in os.walk(folder):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for d in list(dirs):
                if os.path.islink(os.path.join(top, d)):
                    dirs.remove(d)
                    skipped.append(_skip(_rel(folder, top, d), "a symbolic link (not followed)"))
            for f in sorted(files):
                if f.startswith("."):
                    continue
                count += 1
                if count > most:
                    raise import_too_many(most, "the folder holds")
                full = os.path.join(top, f)
                rel = _rel(folder, top, f)
                if os.path.islink(full):
                    skipped.append(_skip(rel, "a symbolic link (not followed)"))
                    continue
                st = os.stat(full)
                if stat.S_ISREG(st.st_mode):
                    entries.append(ImportEntry(rel, st.st_size, _open_file, full))
        return cls(entries, "obsidian" if (folder / ".obsidian").is_dir() else "")


def _open_file(path: str) -> Any:
    return open(path, "rb")


def _rel(folder: Path, top: str, name: str) -> str:
    return unicodedata.normalize("NFC", os.path.relpath(os.path.join(top, name), folder)).replace(
        os.sep, "/"
    )


def _skip(source: str, reason: str) -> dict:
    return {"source": source, "reason": reason}


def sniff_import(head: bytes, filename: str = "") -> str:
    """Return what a single uploaded file holds: zip, tar, enex or keep (one .json)."""
    lower = filename.lower()
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return "zip"
    if head[257:262] == b"ustar" or lower.endswith((".jex", ".tar")):
        return "tar"
    text = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    if text.startswith(b"<") or lower.endswith(".enex"):
        return "enex"
    if text.startswith(b"{") or lower.endswith(".json"):
        return "keep"
    if lower.endswith((".md", ".txt", ".markdown")):
        return "text"
    raise import_refused("send a zip, an Evernote .enex, a Joplin .jex or a Keep .json", 415)


def import_kind(source: ImportSource) -> str:
    """Return which program made a source, from the names and shapes of its files."""
    names = source.by_name
    if EXPORT_MANIFEST in names:
        return "notesvc"
    if source.kind_hint:
        return source.kind_hint
    if any(n.endswith(".enex") for n in names):
        return "evernote"
    if any(n == ".obsidian" or n.startswith(".obsidian/") or "/.obsidian/" in n for n in names):
        return "obsidian"
    jsons = [n for n in names if n.endswith(".json")]
    if any("/Keep/" in f"/{n}" for n in jsons):
        return "keep"
    notion = sum(
        1 for n in names if NOTION_ID_RE.search(posixpath.splitext(n.rsplit("/", 1)[-1])[0])
    )
    if notion and notion * 2 >= sum(1 for n in names if n.endswith((".md", ".csv"))):
        return "notion"
    for n in jsons[:3]:
        with contextlib.suppress(Exception):
            head = source.read(names[n], 1 << 20)
            if b'"textContent"' in head or b'"listContent"' in head:
                return "keep"
    return "files"


class Draft:
    """A note or a file on its way in. Slotted, and its path the very string it wanted
    when that one is free: a plan of 50,000 drafts keeps about their paths and no more."""

    __slots__ = ("open", "path", "size", "source", "text", "want")

    def __init__(
        self,
        source: str,
        want: str,
        text: Any = "",
        open: Callable | None = None,
        size: int = 0,
    ):
        self.source = source  # its name in the source (the report's `source`)
        self.want = want  # the path it would like (its final one, but for " 2")
        # a note's Markdown, links as link_token()s; or what reads it when it is written: a
        # function, or an ImportEntry that the plan's `load` reads
        self.text = text
        self.open = open  # a file's bytes (None: a note)
        self.size = size
        self.path = ""  # the path it gets


class ImportPlan:
    """Names the drafts (never over a note or file, nor over another draft), resolves the
    links between them, and writes them (or, in a dry run, only counts). When a write fails
    midway (a full disk: 507), what this import wrote is removed again, so that its answer,
    "nothing was changed", is true (see writing())."""

    def __init__(self, svc: Any, into: str, dry_run: bool, progress: Callable | None = None):
        self.svc, self.into, self.dry_run = svc, into, dry_run
        self.files_into = ATTACHMENTS + into[len(NOTES) :]
        self.taken: set = set()  # casefolded paths given out in this import
        self.by_source: dict = {}  # source name -> path it got
        self.created = self.renamed = self.attachments = 0
        self.missing = 0  # files notes name that the source lacks (each in `skipped` too)
        self.skipped: list = []
        self.progress = progress or (lambda plan: None)
        self.max_note = svc.config.max_body_bytes
        self.max_file = svc.config.max_attachment_bytes
        self.most = svc.config.max_import_entries
        self.entries = 0  # entries of a stream (an .enex's notes and resources) read so far
        self.read = 0  # source files looked at so far (for progress lines)
        self.load: Callable = lambda entry: ""  # reads a note whose draft holds its entry
        self.written: list = []  # (store, path, etag) of each note and file written
        self._synced, self._unsynced = time.monotonic(), 0

    @contextlib.contextmanager
    def writing(self):
        """The context the writes happen in: flushed per batch, not per note (see
        deferred_sync); a dry run writes nothing. A failure within (a full disk, or any
        other but an .enex that breaks off, 400: the notes before stay, as documented)
        removes what the import wrote so far and says so."""
        if self.dry_run:
            yield
            return
        try:
            with self.svc.importing(), deferred_sync():
                yield
        except Exception as e:
            if not self.written or (isinstance(e, ApiError) and e.status_code == 400):
                raise
            raise self.undo(e) from None

    def undo(self, failure: Exception) -> ApiError:
        """Remove the notes and files this import wrote (newest first; one changed since is
        left as it is), and return the error that says so."""
        notes = files = 0
        kept = []
        for store, path, etag in reversed(self.written):
            try:
                gone = store.discard_created(path, etag)
            except Exception as e:  # one that cannot be removed is named; the rest go
                log.warning("import: could not remove %s again (%s)", log_safe(path), e)
                gone = False
            if not gone:
                kept.append(path)
            elif store is self.svc.notes:
                notes += 1
            else:
                files += 1
        self.written = []
        sync_batch()
        what = f"{plural(notes, 'note')} and {plural(files, 'file')}"
        if kept:
            left = ", ".join(log_safe(p, 120) for p in kept[:5])
            undone = (
                f"the import removed the {what} it had written; it left {len(kept)} that "
                f"changed since (or could not be removed: see the log): "
                f"{left}{' ...' if len(kept) > 5 else ''}"
            )
        else:
            undone = f"the import removed the {what} it had written, so nothing was changed"
        if isinstance(failure, ApiError) and failure.status_code == 507:
            return ApiError(
                507,
                "INSUFFICIENT_STORAGE",
                f"the notes' disk filled up during the import: {undone}; free some space and "
                "import again",
            )
        if isinstance(failure, ApiError):
            reason = failure.message.removeprefix("nothing was imported: ")
            err = ApiError(failure.status_code, failure.code, f"{reason} ({undone})")
            if hasattr(failure, "extra"):
                err.extra = failure.extra
            return err
        log.error("import: failed midway (%s: %s); %s", type(failure).__name__, failure, undone)
        return ApiError(500, "INTERNAL_ERROR", f"the import failed midway: {undone}")

    def _wrote(self, store: Any, rec: dict) -> None:
        """Count one write (undo() can take it back); sync the batch every
        IMPORT_SYNC_NOTES writes or second."""
        self.written.append((store, rec["path"], rec["etag"]))
        self._unsynced += 1
        now = time.monotonic()
        if self._unsynced >= IMPORT_SYNC_NOTES or now - self._synced >= 1.0:
            sync_batch()
            self._synced, self._unsynced = time.monotonic(), 0

    def looked(self) -> None:
        """Count one source file read while planning (progress before the first write)."""
        self.read += 1
        self.progress(self)

    # -- naming ---------------------------------------------------------------------------

    def _exists(self, path: str) -> bool:
        return os.path.lexists(disk_path(self.svc.config.root, path))

    @staticmethod
    def _unfit(draft: Draft) -> str | None:
        """Return why a named draft's path breaks a path rule (too long, say), or None."""
        try:
            if draft.path.startswith(ATTACHMENTS + "/"):
                attachment_path(draft.path)
            elif draft.open is not None:
                note_file_path(draft.path)
            else:
                note_path(draft.path)
        except ApiError as e:
            return e.message
        return None

    def name(self, draft: Draft) -> str:
        """Give the draft its path: the one it wants, else `<name> 2`, `<name> 3`..."""
        folder, _, leaf = draft.want.rpartition("/")
        stem, dot, ext = leaf.rpartition(".") if "." in leaf[1:] else (leaf, "", "")
        for n in range(1, 10000):
            tail = f" {n}" if n > 1 else ""
            short = stem
            while len(f"{short}{tail}{dot}{ext}".encode()) > MAX_SEGMENT_BYTES:
                short = short[:-1]
            path = f"{folder}/{short}{tail}{dot}{ext}"
            key = path.casefold()
            if key not in self.taken and not self._exists(path):
                break
        else:
            raise ApiError(409, "CONFLICT", f"too many files named {leaf} in {folder}")
        if path == draft.want:
            path = draft.want  # one string for the draft, the set and the map, not three
        self.taken.add(path if key == path else key)
        draft.path = path
        self.by_source[draft.source] = path
        if path != draft.want:
            self.renamed += 1
        return path

    # -- links ----------------------------------------------------------------------------

    def render(self, draft: Draft) -> str:
        """Return a note's text with its link tokens made relative paths."""
        here = posixpath.dirname(draft.path)

        def link(m: re.Match) -> str:
            target = self.by_source.get(m.group(1))
            if target is None:
                return m.group(2)
            return urllib.parse.quote(posixpath.relpath(target, here), safe="/#")

        return _LINK_TOKEN_RE.sub(link, draft.text)

    # -- writing --------------------------------------------------------------------------

    def add_file(self, draft: Draft) -> None:
        """Write a named file draft (see name())."""
        path = draft.path
        unfit = self._unfit(draft)
        if unfit:
            self.skip(draft.source, unfit)
            return
        self.attachments += 1
        if not self.dry_run:
            store = self.svc.attachments if path.startswith(ATTACHMENTS) else self.svc.note_files

            def copy(f) -> None:
                with draft.open() as src:
                    shutil.copyfileobj(src, f, BODY_CHUNK)

            rec, _ = store.place(store.spool(copy), path, unique=True)
            if rec["path"] != path:
                self.by_source[draft.source] = rec["path"]
            self._wrote(store, rec)
        self.progress(self)

    def add_note(self, draft: Draft) -> None:
        """Write a named note draft, its links resolved."""
        if isinstance(draft.text, ImportEntry):  # read only now: the plan holds names
            draft.text = self.load(draft.text)
        elif callable(draft.text):
            draft.text = draft.text()
        text = self.render(draft)
        draft.text = ""
        unfit = self._unfit(draft)
        if len(text.encode("utf-8", "surrogatepass")) > self.max_note:
            unfit = "over SERVICE_MAX_BODY_BYTES"
        if unfit:
            self.skip(draft.source, unfit)
            return
        self.created += 1
        if not self.dry_run:
            try:
                rec = self.svc.notes.create(draft.path, text)
            except ApiError as e:  # taken since it was named: the next free name
                if e.status_code != 409:
                    raise
                folder, leaf = draft.path.rsplit("/", 1)
                rec = self.svc.notes.create_named(folder, leaf[:-3], text)
            self._wrote(self.svc.notes, rec)
        self.progress(self)

    def named(self) -> None:
        """Every draft has its path: forget the casefolded ones (only naming asks them)."""
        self.taken = set()

    def add_all(self, drafts: list) -> None:
        """Write named drafts in one batch: the files first, then the notes."""
        self.named()
        with self.writing():
            for d in drafts:
                if d.open is not None:
                    self.add_file(d)
            for d in drafts:
                if d.open is None:
                    self.add_note(d)

    def skip(self, source: str, reason: str) -> None:
        self.skipped.append(_skip(source, reason))

    def report(self, kind: str) -> dict:
        return {
            "created": self.created,
            "renamed": self.renamed,
            "attachments": self.attachments,
            "skipped": self.skipped,
            "missing": self.missing,
            "into": self.into,
            "kind": kind,
            "dryRun": self.dry_run,
        }


def decode_text(data: bytes) -> str:
    """Return a text file's text: UTF-8 (a BOM kept, as the bytes say), else Windows-1252."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("cp1252", "replace")


def front_matter(fields: dict) -> str:
    """Return YAML front matter for what Markdown can't say ('' when there is nothing)."""
    lines = []
    for key, value in fields.items():
        if value in (None, "", [], False):
            continue
        if isinstance(value, list):
            items = ", ".join(json.dumps(v, ensure_ascii=False) for v in value)
            lines.append(f"{key}: [{items}]")
        elif value is True:
            lines.append(f"{key}: true")
        else:
            lines.append(f"{key}: {json.dumps(str(value), ensure_ascii=False)}")
    return "---\n" + "\n".join(lines) + "\n---\n" if lines else ""


def iso_or_none(seconds: Any) -> str | None:
    try:
        return iso(float(seconds)) if seconds else None
    except (TypeError, ValueError, OverflowError, OSError):
        return None
