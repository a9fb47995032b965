"""The attachment reader: the text inside PDFs and images (pdftotext, OCR), for search.

With `pdftotext` (Debian's poppler-utils) or `tesseract` (tesseract-ocr) on PATH, a thread
reads each PDF's text layer (and OCRs its pages without one: pdftoppm, then tesseract) and
each image's text, one file at a time: children at `nice 19`, `OMP_THREAD_LIMIT=1`,
`RLIMIT_AS` 1 GiB, at most 60 s a page and 200 pages a file, never through a shell, and
resting as long as they worked (the reader's CPU stays at half a core or less). What they
read is kept by the file's content hash in `<state>/filetext/` (a JSON-lines file per
file, one line a page: a crash loses at most the page being read, and a restart goes on
from the next) and searched in an index of its own; search.hybrid asks it for the notes
that link a file whose text matched (`FileTextReader.find`).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import os
import re
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from notesvc.boot import log
from notesvc.grants import file_joins_note
from notesvc.helpers import atomic_write, iso
from notesvc.notes.paths import ATTACHMENTS, walk_entries
from notesvc.search.index import SearchIndex, folder_prefixes
from notesvc.search.text import Query
from notesvc.service import Service

# -- limits -----------------------------------------------------------------------------------

PAGE_SECONDS = 60  # a page's tools, together (a hanging tool is killed here)
MAX_PAGES = 200  # a file's pages read (the rest said, not read)
MAX_TEXT_BYTES = 10_000_000  # a file's text kept (the rest said, not kept)
MAX_PIXELS = 40_000_000  # images larger than this (by their header) are skipped and said
MAX_FILE_BYTES = 1 << 30  # files larger are not read at all
CHILD_MEMORY = 1 << 30  # RLIMIT_AS of each child
SCAN_SECONDS = 8.0  # a look for new files (uploads through the API wake it at once)
PDF_DPI_LONG_SIDE = 3000  # pdftoppm's image of a page: its longer side, in pixels
TEXT_LAYER_CHARS = 20  # a page with fewer letters than this has no text layer: OCR it
READ_EXTENSIONS = {
    "pdf": "pdf",
    **dict.fromkeys(("png", "jpg", "jpeg", "gif", "bmp", "tif", "tiff", "webp"), "image"),
}
STORE_VERSION = 1


# -- what a file is, by its bytes -------------------------------------------------------------


def sniff(head: bytes) -> str | None:
    """Return "pdf", or an image's type ("png", "jpeg", "gif", "bmp", "tiff", "webp") by a
    file's first bytes; None for anything else (a PDF that isn't one is not read)."""
    if head.startswith(b"%PDF-"):
        return "pdf"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if head.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if head[:2] == b"BM":
        return "bmp"
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return "tiff"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    return None


def image_size(f: Any, kind: str) -> tuple | None:
    """Return (width, height) read from an image's header (the file object at 0), None when
    the header does not say. Never decodes the pixels."""
    head = f.read(64)
    try:
        if kind == "png":
            return struct.unpack(">II", head[16:24])
        if kind == "gif":
            return struct.unpack("<HH", head[6:10])
        if kind == "bmp":
            w, h = struct.unpack("<ii", head[18:26])
            return abs(w), abs(h)
        if kind == "webp":
            chunk = head[12:16]
            if chunk == b"VP8X":
                w = int.from_bytes(head[24:27], "little") + 1
                h = int.from_bytes(head[27:30], "little") + 1
                return w, h
            if chunk == b"VP8L":
                bits = int.from_bytes(head[21:25], "little")
                return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
            if chunk == b"VP8 ":
                w, h = struct.unpack("<HH", head[26:30])
                return w & 0x3FFF, h & 0x3FFF
            return None
        if kind == "jpeg":
            return _jpeg_size(f)
        if kind == "tiff":
            return _tiff_size(f, head)
    except (struct.error, OSError, ValueError):
        return None
    return None


def _jpeg_size(f: Any) -> tuple | None:
    f.seek(2)
    for _ in range(1000):  # markers up to the frame header
        byte = f.read(1)
        while byte and byte != b"\xff":
            byte = f.read(1)
        while byte == b"\xff":
            byte = f.read(1)
        if not byte:
            return None
        marker = byte[0]
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            continue
        length = struct.unpack(">H", f.read(2))[0]
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            h, w = struct.unpack(">xHH", f.read(5))
            return w, h
        f.seek(length - 2, 1)
    return None


def _tiff_size(f: Any, head: bytes) -> tuple | None:
    order = "<" if head[:2] == b"II" else ">"
    f.seek(struct.unpack(order + "I", head[4:8])[0])
    (count,) = struct.unpack(order + "H", f.read(2))
    found: dict = {}
    for _ in range(min(count, 512)):
        tag, kind, _n, value = struct.unpack(order + "HHI4s", f.read(12))
        if tag in (256, 257):
            fmt = order + ("H" if kind == 3 else "I")
            found[tag] = struct.unpack(fmt, value[: struct.calcsize(fmt)])[0]
    return (found[256], found[257]) if 256 in found and 257 in found else None


# -- the tools, bounded ---------------------------------------------------------------------


class Tools:
    """The programs the reader runs, found on PATH once (None: not installed)."""

    def __init__(self, which: Callable = shutil.which):
        self.pdftotext = which("pdftotext")
        self.pdftoppm = which("pdftoppm")
        self.pdfinfo = which("pdfinfo")
        self.tesseract = which("tesseract")

    @property
    def pdf(self) -> bool:
        return bool(self.pdftotext and self.pdfinfo)

    @property
    def ocr(self) -> bool:
        return bool(self.tesseract)

    @property
    def pdf_ocr(self) -> bool:
        return bool(self.pdf and self.pdftoppm and self.tesseract)


class ToolFailed(Exception):
    """A tool ran over its time, or ended with an error (its message says which)."""


def _child_limits() -> None:  # pragma: no cover - runs in the child, before exec
    os.nice(19)
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY, CHILD_MEMORY))
    except (ImportError, ValueError, OSError):
        pass


def child_env() -> dict:
    """Return the environment of a reader's child: one OpenMP thread, a C locale."""
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "TMPDIR", "LANG")}
    env.update({"OMP_THREAD_LIMIT": "1", "LC_ALL": "C.UTF-8"})
    return env


def run_tool(argv: list, timeout: float, limit: int = MAX_TEXT_BYTES, fds: tuple = ()) -> str:
    """Return what a tool wrote (at most `limit` bytes, as UTF-8 text); ToolFailed when it
    ran over `timeout` (killed) or failed. An argument list, never a shell: a file named
    `; rm -rf ~` is a file name."""
    if timeout <= 0:
        raise ToolFailed(f"{Path(argv[0]).name}: no time left for this page")
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            proc = subprocess.Popen(  # noqa: S603 - the tools found on PATH, a file path
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=child_env(),
                preexec_fn=_child_limits if sys.platform != "win32" else None,
                close_fds=True,
                pass_fds=fds,  # the file being read, opened once (FileTextReader.pinned)
            )
        except OSError as e:
            raise ToolFailed(f"{Path(argv[0]).name} could not start: {e.strerror}") from None
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            stopped = f"{Path(argv[0]).name} ran over {timeout:.0f} s and was stopped"
            raise ToolFailed(stopped) from None
        out.seek(0)
        data = out.read(limit)
        if code != 0:
            err.seek(0)
            said = " ".join(err.read(300).decode("utf-8", "replace").split())
            raise ToolFailed(f"{Path(argv[0]).name} failed ({code}): {said}"[:300])
    return data.decode("utf-8", "replace")


def children_cpu() -> float:
    """Return the CPU seconds of this process's children that have ended."""
    try:
        import resource

        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime
    except ImportError:  # pragma: no cover - Windows
        return 0.0


# -- the texts, kept by content hash ------------------------------------------------------------


class TextStore:
    """<state>/filetext/: a JSON-lines file per content hash. Its first line says what the
    file is ({"v", "kind", "pages"}), then one line a page read ({"p", "text"}), then one
    that ends it ({"done": true, "note"?}). A line cut short by a crash is left out when
    read, and reading goes on after the last whole page."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._cache: collections.OrderedDict = collections.OrderedDict()  # hash -> pages
        self._lock = threading.Lock()

    def file(self, digest: str) -> Path:
        return self.folder / f"{digest}.jsonl"

    def load(self, digest: str) -> dict | None:
        """Return {kind, pages (total), texts {page: text}, done, note} of a hash, None
        when nothing was kept for it."""
        try:
            raw = self.file(digest).read_bytes()
        except OSError:
            return None
        out: dict = {"kind": "", "pages": 0, "texts": {}, "done": False, "note": ""}
        for line in raw.split(b"\n"):
            try:
                item = json.loads(line)
            except ValueError:
                continue  # the last line, cut short
            if not isinstance(item, dict):
                continue
            if "kind" in item:
                out["kind"], out["pages"] = str(item["kind"]), int(item.get("pages") or 0)
            elif "p" in item and isinstance(item.get("text"), str):
                out["texts"][int(item["p"])] = item["text"]
            elif item.get("done"):
                out["done"], out["note"] = True, str(item.get("note") or "")
        return out

    def append(self, digest: str, item: dict) -> None:
        """Add a line (flushed and synced: a page once read is never read again)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        line = json.dumps(item, ensure_ascii=False).encode() + b"\n"
        with open(self.file(digest), "ab") as f:
            if f.tell():  # a line cut short by a crash: begin on a line of its own
                with open(self.file(digest), "rb") as r:
                    r.seek(-1, os.SEEK_END)
                    if r.read(1) != b"\n":
                        f.write(b"\n")
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        with self._lock:
            self._cache.pop(digest, None)

    def page(self, digest: str, page: int) -> str | None:
        """Return one page's text (the file's texts kept for the next few asks)."""
        with self._lock:
            texts = self._cache.get(digest)
            if texts is not None:
                self._cache.move_to_end(digest)
        if texts is None:
            kept = self.load(digest)
            texts = kept["texts"] if kept else {}
            with self._lock:
                self._cache[digest] = texts
                while len(self._cache) > 16:
                    self._cache.popitem(last=False)
        return texts.get(page)

    def digests(self) -> set:
        try:
            return {p.stem for p in self.folder.glob("*.jsonl")}
        except OSError:
            return set()

    def drop(self, digest: str) -> None:
        with contextlib.suppress(OSError):
            self.file(digest).unlink()
        with self._lock:
            self._cache.pop(digest, None)


class FileTextIndex(SearchIndex):
    """The search index of the files' texts: a document per page, `<attachment>#<page>`,
    in memory (built from the store at start), its texts read back from the store."""

    def __init__(self, texts: TextStore, digest_of: Callable):
        super().__init__()
        self.texts = texts
        self.digest_of = digest_of  # attachment path -> its content hash (or None)

    def _read(self, path: str, limit: int = -1) -> str | None:
        file, _, page = path.rpartition("#")
        digest = self.digest_of(file)
        if digest is None or not page.isdigit():
            return None
        return self.texts.page(digest, int(page))


def file_label(path: str, page: int, kind: str) -> str:
    """Return how a snippet names where it was found: `scan.pdf, p. 3`, `board.jpg`."""
    name = path.rsplit("/", 1)[-1]
    return f"{name}, p. {page}" if kind == "pdf" else name


# -- the reader -----------------------------------------------------------------------------


class FileTextReader:
    """The background reader and the index of what it read (svc.reader)."""

    FILE_TEXT_WEIGHT = 0.8  # a note's own words rank above the same words in a file it links
    PAGE_SECONDS = PAGE_SECONDS
    MAX_PAGES = MAX_PAGES
    MAX_PIXELS = MAX_PIXELS
    SCAN_SECONDS = SCAN_SECONDS

    def __init__(self, svc: Service, tools: Tools | None = None):
        self.svc = svc
        cfg = svc.config
        self.tools = tools or Tools()
        self.langs = cfg.ocr_langs
        self.mode = cfg.attachment_text
        self.folder = cfg.state_dir / "filetext"
        self.store = TextStore(self.folder)
        self.files_file = self.folder / "files.json"
        self.files: dict = {}  # attachment path -> [size, mtime_ns, digest]
        self.kinds: dict = {}  # digest -> "pdf" / "image"
        self.index = FileTextIndex(self.store, self._digest_of)
        self.indexed: dict = {}  # attachment path -> (digest, pages indexed)
        self.queue: collections.deque = collections.deque()
        self.linkers: Callable | None = None  # files -> {file: linking notes} (build_service)
        self.current = ""
        self.pinned: tuple | None = None  # (path on disk, fd) of the file being read
        self.counts = {"read": 0, "skipped": 0, "failed": 0, "pages": 0}
        self.notes: dict = {}  # digest -> what was said of it (skipped, cut short, failed)
        # the latest (path, what was said of it), for info
        self.said: collections.deque = collections.deque(maxlen=20)
        self.last_read = ""  # when the last file was done
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._scanned = 0.0
        self._dirty = False
        self._open: set = set()  # hashes begun and not done: read on at the next page
        self.generation = 0  # bumps whenever the texts searched change
        self.files_generation = 0  # bumps whenever the files known (their paths) change

    # -- on, off, and why ---------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self.mode != "off" and (self.tools.pdf or self.tools.ocr)

    def off_reason(self) -> str:
        if self.mode == "off":
            return "SERVICE_ATTACHMENT_TEXT is off"
        if not (self.tools.pdf or self.tools.ocr):
            return (
                "neither pdftotext nor tesseract is installed (Debian: sudo apt install "
                "poppler-utils tesseract-ocr)"
            )
        return ""

    def info(self, sees: Callable | None = None) -> dict:
        """What /system/info says: on or off (and why), the tools, how far it got. With
        `sees` (a principal that does not see every file: a person, a folder key) only the
        files it sees count, the file being read and what was said show only for files it
        sees, and what is server-wide (skipped, failed, pages, when) is left out."""
        if sees is not None:
            return self._info_within(sees)
        with self._lock:
            known = len(self.files)
            waiting = len(self.queue) + (1 if self.current else 0)
            answer = {
                "enabled": self.enabled,
                "reason": self.off_reason() or None,
                "tools": {
                    "pdftotext": bool(self.tools.pdf),
                    "ocr": bool(self.tools.ocr),
                    "pdfOcr": bool(self.tools.pdf_ocr),
                },
                "languages": self.langs,
                "files": known,
                "read": sum(1 for v in self.files.values() if self._done(v[2])),
                "waiting": waiting,
                "reading": self.current or None,
                "skipped": self.counts["skipped"],
                "failed": self.counts["failed"],
                "pages": self.counts["pages"],
                "lastRead": self.last_read or None,
                "said": [said for _, said in self.said],
            }
        return answer

    def _info_within(self, sees: Callable) -> dict:
        with self._lock:
            seen = {p: v for p, v in self.files.items() if sees(p)}
            current = self.current if self.current and sees(self.current) else ""
            waiting = sum(1 for p, _ in self.queue if sees(p)) + (1 if current else 0)
            return {
                "enabled": self.enabled,
                "reason": self.off_reason() or None,
                "tools": {
                    "pdftotext": bool(self.tools.pdf),
                    "ocr": bool(self.tools.ocr),
                    "pdfOcr": bool(self.tools.pdf_ocr),
                },
                "languages": self.langs,
                "files": len(seen),
                "read": sum(1 for v in seen.values() if self._done(v[2])),
                "waiting": waiting,
                "reading": current or None,
                "skipped": None,
                "failed": None,
                "pages": None,
                "lastRead": None,
                "said": [said for path, said in self.said if sees(path)],
            }

    def _done(self, digest: str) -> bool:
        return digest in self.kinds and digest not in self._open

    # -- start, stop ---------------------------------------------------------------------

    def start(self) -> None:
        if not self.enabled or self._thread is not None or self.svc.readonly:
            if self.mode != "off" and not self.enabled:
                log.info("text inside files is off: %s", self.off_reason())
            return
        self._load()
        self.svc.attachments.listeners.append(self.uploaded)
        self._thread = threading.Thread(target=self._run, name="notesvc-reader", daemon=True)
        self._thread.start()
        have = {"pdftotext": self.tools.pdf, "tesseract": self.tools.ocr}
        log.info(
            "text inside files: on (%s); not installed: %s",
            ", ".join(n for n, ok in have.items() if ok),
            ", ".join(n for n, ok in have.items() if not ok) or "nothing",
        )

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(self.PAGE_SECONDS + 5)
            self._thread = None
        self._save_files()

    def uploaded(self, path: str) -> None:
        """A file was placed under attachments/ (the store's listener): look at once."""
        if path.rpartition(".")[2].lower() in READ_EXTENSIONS:
            self._scanned = 0.0
            self._wake.set()

    # -- the files and their hashes ---------------------------------------------------------

    def _digest_of(self, path: str) -> str | None:
        entry = self.files.get(path)
        return entry[2] if entry else None

    def _load(self) -> None:
        """Take what the last run kept: the files' hashes, and each hash's texts."""
        try:
            kept = json.loads(self.files_file.read_text())
            self.files = {p: list(v) for p, v in kept.get("files", {}).items() if len(v) == 3}
            self.files_generation += 1
        except (OSError, ValueError, AttributeError):
            self.files = {}
        for digest in self.store.digests():
            state = self.store.load(digest)
            if state is None or not state["kind"]:
                continue
            self.kinds[digest] = state["kind"]
            if not state["done"]:
                self._open.add(digest)
            elif state["note"]:
                self.notes[digest] = state["note"]
        for path, (_, _, digest) in list(self.files.items()):
            self._index_file(path, digest)

    def _save_files(self) -> None:
        if not self._dirty:
            return
        self._dirty = False
        with self._lock:
            data = json.dumps({"v": STORE_VERSION, "files": self.files}).encode()
        with contextlib.suppress(OSError):
            self.folder.mkdir(parents=True, exist_ok=True)
            atomic_write(self.files_file, data)

    def scan(self) -> None:
        """Look at the attachments: new or changed files are hashed and queued (unless
        their text is kept already); gone ones leave the index."""
        root = self.svc.attachments.base / ATTACHMENTS
        present: dict = {}
        if root.is_dir():
            for path, entry in walk_entries(str(root), ATTACHMENTS, _readable_name):
                with contextlib.suppress(OSError):
                    st = entry.stat()
                    present[path] = (st.st_size, st.st_mtime_ns)
        fresh = []
        with self._lock:
            for path in [p for p in self.files if p not in present]:
                del self.files[path]
                self.files_generation += 1
                self._unindex(path)
                self._dirty = True
        for path, (size, mtime) in sorted(present.items(), key=lambda kv: kv[1][1]):
            if self._stop.is_set():
                return
            known = self.files.get(path)
            if known and known[0] == size and known[1] == mtime:
                digest = known[2]
                if digest in self._open and digest not in self.queue and digest != self.current:
                    fresh.append((path, digest))
                continue
            if size > MAX_FILE_BYTES or size == 0:
                continue
            digest = self._hash(path)
            if digest is None:
                continue
            with self._lock:
                if path not in self.files:
                    self.files_generation += 1
                self.files[path] = [size, mtime, digest]
                self._dirty = True
            if digest in self.kinds and digest not in self._open:
                self._index_file(path, digest)
            else:
                fresh.append((path, digest))
        with self._lock:
            queued = {d for _, d in self.queue}
            for path, digest in fresh:
                if digest not in queued:
                    self.queue.append((path, digest))
                    queued.add(digest)
        self._save_files()
        self._collect()

    def _hash(self, path: str) -> str | None:
        h = hashlib.sha256()
        try:
            with open(self.svc.attachments.base / path, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
        except OSError:
            return None
        return h.hexdigest()

    def _collect(self) -> None:
        """Drop kept texts no file has any longer (a re-upload would read it again)."""
        with self._lock:
            used = {v[2] for v in self.files.values()} | {d for _, d in self.queue}
            if self.current:
                used.add(self.files.get(self.current, [0, 0, ""])[2])
        for digest in self.store.digests() - used:
            self.store.drop(digest)
            self.kinds.pop(digest, None)
            self._open.discard(digest)

    # -- the index of the texts ---------------------------------------------------------------

    def _index_file(self, path: str, digest: str) -> None:
        state = self.store.load(digest)
        if state is None:
            return
        with self._lock:
            self._unindex(path)
            for page, text in state["texts"].items():
                if text.strip():
                    self.index.add(f"{path}#{page}", text, len(text), 0)
            self.indexed[path] = (digest, sorted(state["texts"]))
            self.generation += 1

    def _unindex(self, path: str) -> None:
        with self._lock:
            was = self.indexed.pop(path, None)
            if was:
                for page in was[1]:
                    self.index.remove(f"{path}#{page}")
                self.generation += 1

    def _add_page(self, path: str, digest: str, page: int, text: str) -> None:
        with self._lock:
            for other, (d, pages) in list(self.indexed.items()):
                if d == digest and self.files.get(other, [0, 0, ""])[2] == digest:
                    if text.strip():
                        self.index.add(f"{other}#{page}", text, len(text), 0)
                    pages.append(page)
            if path not in self.indexed:
                self.indexed[path] = (digest, [page])
                if text.strip():
                    self.index.add(f"{path}#{page}", text, len(text), 0)
            self.generation += 1

    # -- reading -------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if time.monotonic() - self._scanned >= self.SCAN_SECONDS:
                    self.scan()
                    self._scanned = time.monotonic()
                with self._lock:
                    item = self.queue.popleft() if self.queue else None
                if item is None:
                    self._wake.wait(self.SCAN_SECONDS)
                    self._wake.clear()
                    continue
                self._read_file(*item)
            except Exception:  # one file's trouble never stops the reader
                log.exception("text inside files: reading failed")
                self._stop.wait(5)

    def _rest(self, cpu_before: float, wall_before: float) -> None:
        """Rest as long as the children worked: the reader takes half a core at most."""
        worked = children_cpu() - cpu_before
        elapsed = time.monotonic() - wall_before
        self._stop.wait(max(0.0, worked * 2 - elapsed) + 0.01)

    def _pin(self, full: Path, known: list) -> int | None:
        """Open the file to read once, as scanned: not a link, a plain file inside
        attachments/, its size and time those hashed. Every tool then reads that open
        file (/dev/fd/N), so one swapped in meanwhile (a link out of attachments/, another
        file renamed over it) is never read, nor kept under the hash of the one scanned."""
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        try:
            fd = os.open(full, flags)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            real = os.path.realpath(f"/proc/self/fd/{fd}" if sys.platform == "linux" else full)
            top = os.path.realpath(self.svc.attachments.base / ATTACHMENTS) + os.sep
            if (
                stat.S_ISREG(st.st_mode)
                and [st.st_size, st.st_mtime_ns] == list(known[:2])
                and real.startswith(top)
            ):
                return fd
        except OSError:
            pass
        os.close(fd)
        return None

    def _arg(self, full: Path) -> str:
        """Return how a tool names `full`: the pinned file's /dev/fd/N when it is that."""
        if self.pinned is not None and self.pinned[0] == full and os.path.isdir("/dev/fd"):
            return f"/dev/fd/{self.pinned[1]}"
        return str(full)

    def _fds(self, full: Path) -> tuple:
        return (self.pinned[1],) if self._arg(full).startswith("/dev/fd/") else ()

    def _read_file(self, path: str, digest: str) -> None:
        full = self.svc.attachments.base / path
        with self._lock:
            known = self.files.get(path, [0, 0, ""])
            if known[2] != digest:
                return  # changed or gone meanwhile: the next scan has it
        fd = self._pin(full, known)
        if fd is None:
            return  # changed, gone or a link now: the next scan has it
        with self._lock:
            self.current = path
        self.pinned = (full, fd)
        try:
            kept = self.store.load(digest)
            if kept is None or not kept["kind"]:
                kind = self._start(full, digest)
                if kind is None:
                    return
                kept = self.store.load(digest) or {"kind": kind, "texts": {}, "pages": 1}
            if kept.get("done"):
                self._index_file(path, digest)
                return
            self._open.add(digest)
            self.kinds[digest] = kept["kind"]
            if kept["kind"] == "pdf":
                self._read_pdf(path, full, digest, kept)
            else:
                self._read_image(path, full, digest)
        finally:
            self.pinned = None
            os.close(fd)
            with self._lock:
                self.current = ""
                self.last_read = iso(time.time())

    def _finish(self, digest: str, note: str = "") -> None:
        self.store.append(digest, {"done": True, "note": note} if note else {"done": True})
        self._open.discard(digest)
        if note:
            self.notes[digest] = note
            self.said.append((self.current, note))  # (the file's path, what was said)
            log.info("text inside files: %s", note)

    def _start(self, full: Path, digest: str) -> str | None:
        """Check a new file's bytes and write its first line; None when it is not read
        (its reason kept, so it is not tried again)."""
        try:
            with open(self._arg(full), "rb") as f:
                kind = sniff(f.read(16))
                f.seek(0)
                size = image_size(f, kind) if kind and kind != "pdf" else None
        except OSError:
            return None
        name = full.name
        ext = READ_EXTENSIONS.get(name.rpartition(".")[2].lower())
        self.kinds[digest] = "pdf" if kind == "pdf" else "image"
        if kind is None or (ext == "pdf") != (kind == "pdf"):
            self.store.append(digest, {"v": STORE_VERSION, "kind": ext or "image", "pages": 0})
            self._skip(digest, f"{name} is not a {'PDF' if ext == 'pdf' else 'image'} by its bytes")
            return None
        if kind == "pdf":
            if not self.tools.pdf:
                self.store.append(digest, {"v": STORE_VERSION, "kind": "pdf", "pages": 0})
                self._skip(digest, f"{name}: pdftotext is not installed")
                return None
            try:
                pages = self._pdf_pages(full)
            except ToolFailed as e:
                self.store.append(digest, {"v": STORE_VERSION, "kind": "pdf", "pages": 0})
                self._fail(digest, f"{name} could not be read: {e}")
                return None
            self.store.append(digest, {"v": STORE_VERSION, "kind": "pdf", "pages": pages})
            return "pdf"
        self.store.append(digest, {"v": STORE_VERSION, "kind": "image", "pages": 1})
        if not self.tools.ocr:
            self._skip(digest, f"{name}: tesseract is not installed")
            return None
        if size is None:
            self._skip(digest, f"{name}: its header does not say its size")
            return None
        if size[0] * size[1] > self.MAX_PIXELS:
            self._skip(
                digest,
                f"{name} was skipped: {size[0]} × {size[1]} pixels is over "
                f"{self.MAX_PIXELS // 1_000_000} megapixels",
            )
            return None
        return "image"

    def _skip(self, digest: str, why: str) -> None:
        self.counts["skipped"] += 1
        self._finish(digest, why)

    def _fail(self, digest: str, why: str) -> None:
        self.counts["failed"] += 1
        self._finish(digest, why)

    def _pdf_pages(self, full: Path) -> int:
        try:  # (a PDF that only forbids copying opens; one that needs a password does not)
            argv = [self.tools.pdfinfo, self._arg(full)]
            out = run_tool(argv, self.PAGE_SECONDS, 65536, self._fds(full))
        except ToolFailed as e:
            if "password" in str(e).lower():
                raise ToolFailed("it is encrypted and needs a password") from None
            raise
        m = re.search(r"^Pages:\s+(\d+)", out, re.MULTILINE)
        if not m:
            raise ToolFailed("pdfinfo found no pages")
        return int(m.group(1))

    def _read_pdf(self, path: str, full: Path, digest: str, kept: dict) -> None:
        total = kept["pages"]
        texts = kept["texts"]
        size = sum(len(t.encode()) for t in texts.values())
        last = min(total, self.MAX_PAGES)
        start = max(texts) + 1 if texts else 1
        for page in range(start, last + 1):
            if self._stop.is_set():
                return  # closing: the next start goes on from here
            with self._lock:
                if self.files.get(path, [0, 0, ""])[2] != digest:
                    return
            cpu, wall = children_cpu(), time.monotonic()
            deadline = wall + self.PAGE_SECONDS
            try:
                text = self._pdf_page(full, page, deadline)
            except ToolFailed as e:
                if texts or page > 1:
                    self._fail(digest, f"{full.name}, p. {page}: {e}; the pages before it are kept")
                else:
                    self._fail(digest, f"{full.name} could not be read: {e}")
                self._rest(cpu, wall)
                return
            text = text[: max(0, MAX_TEXT_BYTES - size)]
            size += len(text.encode())
            self.store.append(digest, {"p": page, "text": text})
            texts[page] = text
            self.counts["pages"] += 1
            self._add_page(path, digest, page, text)
            self._rest(cpu, wall)
            if size >= MAX_TEXT_BYTES:
                self._finish(
                    digest, f"{full.name}: text kept up to p. {page} ({MAX_TEXT_BYTES} bytes)"
                )
                self.counts["read"] += 1
                return
        note = ""
        if total > self.MAX_PAGES:
            note = f"{full.name}: the first {self.MAX_PAGES} of {total} pages were read"
        self._finish(digest, note)
        self.counts["read"] += 1

    def _pdf_page(self, full: Path, page: int, deadline: float) -> str:
        n = str(page)
        text = run_tool(
            [self.tools.pdftotext, "-f", n, "-l", n, "-enc", "UTF-8", "-q", self._arg(full), "-"],
            deadline - time.monotonic(),
            fds=self._fds(full),
        )
        if sum(ch.isalnum() for ch in text[:2000]) >= TEXT_LAYER_CHARS or not self.tools.pdf_ocr:
            return text
        with tempfile.TemporaryDirectory(prefix="notesvc-ocr-") as tmp:
            prefix = os.path.join(tmp, "page")
            argv = [self.tools.pdftoppm, "-f", n, "-l", n, "-gray", "-png", "-r", "300"]
            argv += ["-scale-to", str(PDF_DPI_LONG_SIDE), self._arg(full), prefix]
            run_tool(argv, deadline - time.monotonic(), 1024, self._fds(full))
            images = sorted(Path(tmp).glob("page*.png"))
            if not images:
                return text
            return self._ocr(images[0], deadline)

    def _ocr(self, image: Path, deadline: float) -> str:
        argv = [self.tools.tesseract, self._arg(image), "-", "-l", self.langs, "--psm", "3"]
        return run_tool(argv, deadline - time.monotonic(), fds=self._fds(image))

    def _read_image(self, path: str, full: Path, digest: str) -> None:
        cpu, wall = children_cpu(), time.monotonic()
        try:
            text = self._ocr(full, wall + self.PAGE_SECONDS)
        except ToolFailed as e:
            self._fail(digest, f"{full.name} could not be read: {e}")
            self._rest(cpu, wall)
            return
        text = text[:MAX_TEXT_BYTES]
        self.store.append(digest, {"p": 1, "text": text})
        self.counts["pages"] += 1
        self._add_page(path, digest, 1, text)
        self._finish(digest)
        self.counts["read"] += 1
        self._rest(cpu, wall)

    # -- search ---------------------------------------------------------------------------------

    def has_text(self) -> bool:
        return bool(self.indexed)

    def find(self, query: Query, folder: str | tuple, limit: int = 200, snippets: int = 20) -> list:
        """Return [(note, score, snippet)] best first: the notes (within `folder`) that link
        a file whose text holds the query, each once with its best page, when every
        principal reaching the note reaches the file too (grants.file_joins_note). Only the
        first `snippets` get their snippet (`scan.pdf, p. 3: ...`; the others the file's
        name and page): no note after them can reach a page of results (each one before
        it scores more), and a snippet reads the page's text back from the store."""
        if not self.indexed or self.linkers is None or not query.clauses:
            return []
        _, hits = self.index.search(query, "", limit, 0, snippets=False)
        if not hits:
            return []
        files = collections.OrderedDict()  # file -> (score, page), best first
        for doc, _title, score, _ in hits:
            file, _, page = doc.rpartition("#")
            if file not in files:
                files[file] = (score, int(page))
        linked = self.linkers(set(files))
        data = self.svc.state.read()
        prefixes = folder_prefixes(folder)
        best: dict = {}
        for file, (score, page) in files.items():
            for note in linked.get(file, ()):
                if prefixes and not note.startswith(prefixes):
                    continue
                if not file_joins_note(data, note, file):
                    continue
                weighted = round(score * self.FILE_TEXT_WEIGHT, 4)
                if note not in best or best[note][0] < weighted:
                    best[note] = (weighted, file, page)
        ranked = sorted(best.items(), key=lambda kv: (-kv[1][0], kv[0]))
        shown = {f"{file}#{page}" for _, (_, file, page) in ranked[:snippets]}
        texts = self.index.snippets(query, sorted(shown)) if shown else {}
        out = []
        for note, (score, file, page) in ranked:
            kind = self.kinds.get(self._digest_of(file) or "", "pdf")
            label = file_label(file, page, kind)
            snippet = texts.get(f"{file}#{page}")
            out.append((note, score, f"{label}: {snippet}" if snippet else label))
        return out


def _readable_name(name: str) -> bool:
    return name.rpartition(".")[2].lower() in READ_EXTENSIONS and "." in name[1:]
