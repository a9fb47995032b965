"""Search by meaning: notes cut into chunks, the vectors of the chunks, the semantic pass.

The model is elsewhere (an embeddings endpoint, `providers/embed.py`); this module keeps
what it answered. Each chunk's vector is stored as int8 with one scale, appended to
`<state>/vectors/vectors.<n>.bin` with a CRC; its sign bits (one bit a dimension) are held
in memory for the first pass, a Hamming scan of every chunk; the best few hundred are
rescored with their int8 vectors read from the file. A chunk is known by the hash of its
text, so an edit re-embeds only the chunks it changed and a move re-embeds nothing.
"""

from __future__ import annotations

import array
import collections
import contextlib
import hashlib
import heapq
import json
import math
import os
import re
import struct
import threading
import zlib
from operator import mul
from pathlib import Path
from typing import Any

from notesvc.boot import log
from notesvc.helpers import atomic_write, disk_writes, release_memory
from notesvc.notes.paths import FRONT_MATTER_RE

_NUMPY: list = []  # [numpy or None], looked for once embeddings are on (never at start)


def numpy_module() -> Any:
    """Return NumPy when it is installed (optional, like segno: the same passes,
    vectorised), else None. Imported only when a store opens: it costs ~15 MB."""
    if not _NUMPY:
        try:
            import numpy
        except ImportError:  # pragma: no cover - depends on the machine
            numpy = None
        _NUMPY.append(numpy)
    return _NUMPY[0]


# -- chunks ---------------------------------------------------------------------------------

CHUNK_WORDS = 160  # a chunk closes at a block boundary past this many words (~210 tokens)
CHUNK_MAX_WORDS = 280  # and a block longer than this is cut between words (~370 tokens)
MAX_NOTE_CHUNKS = 1000  # of a huge note, the first 1,000 chunks (~200k words) are embedded
_CHUNK_HEADING_RE = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)[ \t#]*$")
_CHUNK_FENCE_RE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def _blocks(text: str) -> list:
    """Return the note's blocks in order: ("h", level, heading) or ("p", text), a
    paragraph or a whole fenced code block (never cut at a blank line inside it)."""
    out: list = []
    para: list = []
    fence = ""

    def close() -> None:
        if para:
            out.append(("p", "\n".join(para)))
            para.clear()

    for line in text.split("\n"):
        if fence:
            para.append(line)
            if line.lstrip().startswith(fence):
                fence = ""
                close()
            continue
        m = _CHUNK_FENCE_RE.match(line)
        if m:
            close()
            fence = m.group(1)[:3]
            para.append(line)
            continue
        h = _CHUNK_HEADING_RE.match(line)
        if h:
            close()
            out.append(("h", len(h.group(1)), h.group(2).strip()))
        elif line.strip():
            para.append(line)
        else:
            close()
    close()
    return out


def _pieces(words: list, size: int) -> list:
    return [" ".join(words[i : i + size]) for i in range(0, len(words), size)]


def chunk_note(title: str, text: str) -> list:
    """Return the texts to embed for a note: its body cut at headings and between
    paragraphs into chunks of about CHUNK_WORDS words (never mid-word), each starting with
    the note's title and its heading path. Front matter is left out; fenced code is kept
    as a paragraph of its own. A note with no body is its title alone."""
    text = FRONT_MATTER_RE.sub("", text.replace("\r\n", "\n"), count=1)
    chunks: list = []
    path: list = []  # [(level, heading)]
    body: list = []  # the paragraphs of the chunk being filled
    count = 0

    def emit() -> None:
        nonlocal count
        if body:
            trail = " › ".join(h for _, h in path if h and h != title)
            head = f"{title}\n{trail}" if trail else title
            chunks.append(f"{head}\n\n" + "\n\n".join(body))
            body.clear()
        count = 0

    for block in _blocks(text):
        if block[0] == "h":
            emit()
            level = block[1]
            path = [p for p in path if p[0] < level] + [(level, block[2])]
            continue
        words = block[1].split()
        if count and count + len(words) > CHUNK_MAX_WORDS:
            emit()
        if len(words) > CHUNK_MAX_WORDS:
            *full, rest = _pieces(words, CHUNK_WORDS)
            for piece in full:
                body.append(piece)
                emit()
            body.append(rest)
            count = len(rest.split())
        else:
            body.append(block[1])
            count += len(words)
        if count >= CHUNK_WORDS:
            emit()
        if len(chunks) >= MAX_NOTE_CHUNKS:
            break
    emit()
    if not chunks and title.strip():
        chunks.append(title)
    return chunks[:MAX_NOTE_CHUNKS]


def chunk_body(chunk: str) -> str:
    """Return a chunk's text without the title and heading lines it starts with."""
    return chunk.partition("\n\n")[2] or chunk


def chunk_hash(text: str) -> int:
    """Return a chunk's identity: 64 bits of BLAKE2b of its text."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


# -- vectors: checked, normalised, quantised -----------------------------------------------


class VectorError(ValueError):
    """An answer that is not a usable vector (NaN, infinite, empty, the wrong size)."""


def normalised(vec: Any, dim: int = 0) -> list:
    """Return vec as a list of floats of length 1; VectorError for anything else."""
    if not isinstance(vec, list) or not vec:
        raise VectorError("a vector is not a non-empty list of numbers")
    if dim and len(vec) != dim:
        raise VectorError(f"a vector has {len(vec)} dimensions, not {dim}")
    if not all(type(x) in (float, int) for x in vec):  # not bool, not "1"
        raise VectorError("a vector holds something that is not a number")
    values = [float(x) for x in vec]
    norm = math.sqrt(math.fsum(x * x for x in values))
    if not math.isfinite(norm):
        raise VectorError("a vector holds NaN or an infinite value")
    if norm == 0:
        raise VectorError("a vector is all zeros")
    return [x / norm for x in values]


def quantised(vec: list) -> tuple:
    """Return (scale, int8 bytes) of a normalised vector: vec[i] ≈ scale * q[i]."""
    top = max(map(abs, vec))
    scale = top / 127.0
    q = array.array("b", [round(x / scale) for x in vec])
    return scale, q.tobytes()


# bit i of a chunk's sign code is set when its dimension i is positive
_SIGN = bytes(49 if 0 < b < 128 else 48 for b in range(256))  # "1" or "0"


def sign_code(qbytes: bytes) -> int:
    """Return the sign bits of an int8 vector as an int (first dimension highest)."""
    return int(qbytes.translate(_SIGN), 2)


if hasattr(int, "bit_count"):  # Python 3.10+

    def _distances(q: int, codes: list, shift: int) -> list:
        return [(q ^ c).bit_count() >> shift for c in codes]

else:  # pragma: no cover - Python 3.9

    def _distances(q: int, codes: list, shift: int) -> list:
        return [bin(q ^ c).count("1") >> shift for c in codes]


def float_sign_code(vec: list) -> int:
    return int("".join("1" if x > 0 else "0" for x in vec), 2)


# -- the store on disk -------------------------------------------------------------------------

_MAGIC = b"NSVEC\x00\x01\x00"
_HEAD = struct.Struct("<8sHH")  # magic, dimensions, reserved
_REC = struct.Struct("<Qf")  # chunk hash, scale; then the int8 vector, then its CRC-32
DEAD = 0xFFFFFFFF  # a record no note holds (a tombstone until compaction)
RESCORE = 400  # chunks the sign-code pass hands to the int8 rescoring
MAX_SEMANTIC_NOTES = 100  # notes a semantic pass returns at most
REACH_ROWS = 16  # reaches whose records the semantic pass keeps (a person's search by meaning)


class _PathTable:
    """Note paths by number, off the heap of small objects: the paths' UTF-8 in one
    bytearray (each ended by NUL), an offset a number, and an open-addressing table of
    numbers by the path's hash. 50,000 paths cost ~3 MB here, ~10 MB as a dict of str."""

    FREE = 0xFFFFFFFF
    TOP = "notes/"  # every note's path starts so: kept once, not 50,000 times

    @classmethod
    def _raw(cls, path: str) -> bytes:
        if path.startswith(cls.TOP):
            return path[len(cls.TOP) :].encode("utf-8", "surrogatepass")
        return b"\x01" + path.encode("utf-8", "surrogatepass")

    @classmethod
    def _text(cls, raw: bytes) -> str:
        if raw[:1] == b"\x01":
            return raw[1:].decode("utf-8", "surrogatepass")
        return cls.TOP + raw.decode("utf-8", "surrogatepass")

    def __init__(self):
        self._blob = bytearray()
        self._off = array.array("I")  # number -> where its path starts (FREE: none)
        self._slots = array.array("i", [-1]) * 16  # -1 empty, -2 removed, else a number
        self._used = 0  # slots not empty
        self.count = 0  # numbers held

    def path(self, n: int) -> str | None:
        off = self._off[n]
        if off == self.FREE:
            return None
        return self._text(bytes(self._blob[off : self._blob.index(0, off)]))

    def _slot(self, raw: bytes) -> int:
        """Return the slot holding raw's number, else the first empty slot of its probe."""
        mask = len(self._slots) - 1
        i = hash(raw) & mask
        blob, end = self._blob, len(raw)
        while True:
            n = self._slots[i]
            if n == -1:
                return i
            if n >= 0:
                off = self._off[n]
                if blob[off : off + end] == raw and blob[off + end] == 0:
                    return i
            i = (i + 1) & mask

    def find(self, path: str) -> int | None:
        n = self._slots[self._slot(self._raw(path))]
        return None if n < 0 else n

    def add(self, path: str) -> int:
        """Return the number of a path, given one if it has none."""
        raw = self._raw(path)
        i = self._slot(raw)
        if self._slots[i] >= 0:
            return self._slots[i]
        n = len(self._off)
        self._off.append(len(self._blob))
        self._blob += raw + b"\0"
        self._slots[i] = n
        self._used += 1
        self.count += 1
        if 3 * self._used > 2 * len(self._slots):
            self._rehash()
        return n

    def remove(self, n: int) -> None:
        i = self._slot(self._raw(self.path(n)))
        self._slots[i] = -2
        self._off[n] = self.FREE
        self.count -= 1

    def rename(self, n: int, new: str) -> None:
        self.remove(n)
        raw = self._raw(new)
        self._off[n] = len(self._blob)
        self._blob += raw + b"\0"
        self._slots[self._slot(raw)] = n
        self._used += 1
        self.count += 1
        if 3 * self._used > 2 * len(self._slots):
            self._rehash()

    def _rehash(self) -> None:
        size = 16
        while size < 2 * self.count:  # at most half full after, two thirds before the next
            size *= 2
        self._slots = array.array("i", [-1]) * size
        self._used = 0
        for n, path in self.held():
            self._slots[self._slot(self._raw(path))] = n
            self._used += 1

    def held(self):
        """Yield (number, path) of every path held."""
        for n in range(len(self._off)):
            if self._off[n] != self.FREE:
                yield n, self.path(n)


class VectorStore:
    """The chunks' vectors of one (model, dimensions): `<state>/vectors/`.

    meta.json (written atomically) names the vector file, the fingerprint, and each note's
    file key (SearchIndex.note_keys) with its records in chunk order. The vector file is a
    header and fixed-size records appended in order; a record is checked by its CRC when
    the store opens, and a torn or damaged tail is cut off (its chunks are embedded again).
    Records past what meta.json names are kept as tombstones: their chunks are found by
    hash instead of asked for again. compact() rewrites the file without tombstones.
    """

    def __init__(
        self, folder: Path, dim: int, fingerprint: str, model: str, vectorised: bool = True
    ):
        self.np = numpy_module() if vectorised else None
        self.folder = folder
        self.dim = dim
        self.fingerprint = fingerprint
        self.model = model
        self.generation = 0  # n of vectors.<n>.bin
        self.size = _REC.size + dim + 4
        self.lock = threading.RLock()
        # The notes, in flat arrays by note number (no object per note but its path):
        self.owner = array.array("I")  # record -> note number (DEAD: a tombstone)
        self._names = _PathTable()  # note number <-> path
        self._keys = array.array("q")  # note number -> its file key (_NO_KEY: none)
        self._start = array.array("I")  # note number -> where its run in _recs starts
        self._len = array.array("H")  # note number -> its records (MAX_NOTE_CHUNKS at most)
        self._recs = array.array("I")  # each note's records in chunk order, a run a note
        self._folders: collections.Counter = collections.Counter()  # folder -> notes beneath
        self._codes: Any = [] if self.np is None else self.np.zeros((0, (dim + 7) // 8), "uint8")
        self._count = 0  # records in the file
        self._hashes: dict | None = None  # chunk hash -> record, built while embedding
        self._fd = -1
        self.dirty = False  # meta.json is behind
        self.changes = 0  # notes given records or dropped since the store opened
        self.extra: dict = {}  # what the embedder keeps with it (the probe, the floor)
        self._edits = 0  # any change of which note holds which records, or of a path
        # the records of the notes under a reach's folders, as the semantic pass scans them:
        # prefixes -> (the edits it was made at, the records), the few searched lately
        self._reach_rows: collections.OrderedDict = collections.OrderedDict()

    # -- opening -----------------------------------------------------------------------

    @property
    def file(self) -> Path:
        return self.folder / f"vectors.{self.generation}.bin"

    @classmethod
    def create(
        cls, folder: Path, dim: int, fingerprint: str, model: str, extra: dict, **kw: Any
    ) -> VectorStore:
        """Start an empty store (what was in folder is removed)."""
        remove_store(folder)
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        store = cls(folder, dim, fingerprint, model, **kw)
        store.extra = dict(extra)
        with disk_writes():
            atomic_write(store.file, _HEAD.pack(_MAGIC, dim, 0))
        store._open_file()
        store.save()
        return store

    @classmethod
    def open(cls, folder: Path, **kw: Any) -> VectorStore | None:
        """Return the store in folder, None when there is none or it cannot be read."""
        if not (folder / "meta.json").exists():
            return None
        try:
            meta = json.loads((folder / "meta.json").read_text("utf-8"))
            dim, model = int(meta["dim"]), str(meta["model"])
            store = cls(folder, dim, str(meta["fingerprint"]), model, **kw)
            store.generation = int(meta["generation"])
            store.extra = dict(meta.get("extra") or {})
            store._load(meta)
        except (OSError, ValueError, KeyError, TypeError, VectorError) as e:
            log.warning("vectors: the store cannot be read (%s): embedding again", e)
            return None
        for stale in folder.glob("vectors.*.bin"):  # a compaction's leftovers
            if stale != store.file:
                stale.unlink(missing_ok=True)
        return store

    def _load(self, meta: dict) -> None:
        with open(self.file, "rb") as f:
            head = f.read(_HEAD.size)
            if len(head) < _HEAD.size or _HEAD.unpack(head)[:2] != (_MAGIC, self.dim):
                raise VectorError("not a vector file of these dimensions")
            good = self._read_records(f)
        self._open_file()
        end = _HEAD.size + good * self.size
        if os.fstat(self._fd).st_size != end:
            log.warning("vectors: cut a torn or damaged tail after %d records", good)
            os.ftruncate(self._fd, end)
        # the note map is made anew once the parsed meta.json is freed: objects kept from
        # it would pin the heap's pages of everything it held (RssAnon +18 MB at 50k notes)
        paths, keys, counts, recs = _packed_notes(meta.pop("notes"), good)
        at = 0
        for path, key, count in zip(paths.split("\0") if paths else (), keys, counts):
            self._claim(path, None if key == _NO_KEY else key, recs[at : at + count])
            at += count

    def _read_records(self, f) -> int:
        """Read the records up to the first torn or damaged one; return how many are good.
        The sign codes are made as the file is read (no object a record meanwhile: those
        would pin the heap's pages the codes end up among)."""
        dim, size, np = self.dim, self.size, self.np
        codes: list = []
        vectors = bytearray()  # NumPy: every int8 vector in one buffer, packed at the end
        good = 0
        while True:
            block = f.read(size * 4096)
            for at in range(0, len(block) - size + 1, size):
                rec = block[at : at + size]
                if zlib.crc32(rec[:-4]) != int.from_bytes(rec[-4:], "little"):
                    break
                if np is None:
                    codes.append(sign_code(rec[_REC.size : _REC.size + dim]))
                else:
                    vectors += rec[_REC.size : _REC.size + dim]
                good += 1
            else:
                if len(block) == size * 4096:
                    continue
            break
        self.owner = array.array("I", [DEAD]) * good
        self._count = good
        if np is None:
            self._codes = codes
        else:
            self._set_codes([bytes(vectors)] if good else [], good)
        return good

    def _set_codes(self, vectors: list, count: int = -1) -> None:
        """Set the sign codes of int8 vectors: a list of them, or `count` in one bytes."""
        np = self.np
        if np is None:
            self._codes = [sign_code(v) for v in vectors]
            return
        count = len(vectors) if count < 0 else count
        nb = (self.dim + 7) // 8
        rows = np.zeros((max(16, count), nb), "uint8")  # appends grow it by half
        if count:
            q = np.frombuffer(b"".join(vectors), "int8").reshape(count, self.dim)
            rows[:count] = np.packbits(q > 0, axis=1)
        self._codes = rows

    def _open_file(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = os.open(self.file, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))

    def close(self) -> None:
        with self.lock:
            if self.dirty:
                self.save()
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    # -- notes and records ------------------------------------------------------------

    def _claim(self, path: str, key: Any, recs: Any) -> None:
        self._edits += 1
        number = self._names.find(path)
        if number is None:
            number = self._names.add(path)
            self._count_folders(path, 1)
            self._keys.append(_NO_KEY)
            self._start.append(0)
            self._len.append(0)
        for r in recs:
            self.owner[r] = number
        self._keys[number] = _NO_KEY if key is None else key
        self._len[number] = len(recs)
        if recs and recs[-1] - recs[0] == len(recs) - 1 and _consecutive(recs):
            self._start[number] = _RUN | recs[0]  # the usual case: records in a row, no copy
            return
        if len(self._recs) > 2 * self._count + 1024:  # mostly runs of old versions: repack
            self._repack()
        self._start[number] = len(self._recs)
        self._recs.extend(recs)

    def _repack(self) -> None:
        runs = [(n, self._run(n)) for n, _ in self._names.held() if not self._start[n] & _RUN]
        self._recs = array.array("I")
        for n, recs in runs:
            self._start[n] = len(self._recs)
            self._recs.extend(recs)

    def _run(self, n: int) -> array.array:
        start, count = self._start[n], self._len[n]
        if start & _RUN:
            return array.array("I", range(start & ~_RUN, (start & ~_RUN) + count))
        return self._recs[start : start + count]

    def records(self, path: str) -> array.array:
        """Return a note's records in chunk order (empty for a note not held)."""
        n = self._names.find(path)
        return array.array("I") if n is None else self._run(n)

    def paths(self) -> list:
        """Return the paths of the notes held."""
        with self.lock:
            return [p for _, p in self._names.held()]

    def drop(self, path: str) -> None:
        """Forget a note: its records become tombstones."""
        with self.lock:
            n = self._names.find(path)
            if n is None:
                return
            for r in self._run(n):
                self.owner[r] = DEAD
            self._names.remove(n)
            self._count_folders(path, -1)
            self._len[n] = 0
            self._edits += 1
            self.changes += 1
            self.dirty = True

    def move(self, old: str, new: str, key: Any = None) -> bool:
        """Give a moved note's chunks to its new path (nothing is embedded again)."""
        with self.lock:
            n = self._names.find(old)
            if n is None or self._names.find(new) is not None:
                return False
            self._names.rename(n, new)
            self._edits += 1
            self._count_folders(old, -1)
            self._count_folders(new, 1)
            self._keys[n] = _NO_KEY if key is None else key
            self.dirty = True
            return True

    def _key(self, n: int) -> Any:
        return None if self._keys[n] == _NO_KEY else self._keys[n]

    def key_of(self, path: str) -> Any:
        n = self._names.find(path)
        if n is None or self._keys[n] == _NO_KEY:
            return None
        return self._keys[n]

    def _count_folders(self, path: str, delta: int) -> None:
        folder = path
        while "/" in folder:
            folder = folder.rpartition("/")[0]
            self._folders[folder] += delta

    def count_under(self, folder: str | tuple = "") -> int:
        """Return how many notes are held beneath a folder, or the folders of a reach (""
        or (): all): kept as notes come and go, so a search's status costs a look-up, not
        a walk. (A reach's folders never hold one another.)"""
        folders = (folder,) if isinstance(folder, str) else tuple(folder)
        with self.lock:
            if not any(folders):
                return self._names.count
            return sum(self._folders.get(f.rstrip("/"), 0) for f in folders if f)

    def holds(self, path: str) -> bool:
        return self._names.find(path) is not None

    def find(self, h: int) -> int:
        """Return the record of a chunk hash (a note's or a tombstone), -1 when none."""
        with self.lock:
            if self._hashes is None:
                self._hashes = {}
                for r in range(self._count):
                    self._hashes.setdefault(self._hash_at(r), r)
            return self._hashes.get(h, -1)

    def forget_hashes(self) -> None:
        """Drop the hash lookup (rebuilt when next needed): the embedder is idle."""
        with self.lock:
            self._hashes = None

    def _hash_at(self, r: int) -> int:
        rec = os.pread(self._fd, 8, _HEAD.size + r * self.size)
        return int.from_bytes(rec, "little")

    def append(self, pairs: list) -> list:
        """Append [(chunk hash, normalised vector)]; return their records."""
        data = bytearray()
        vectors = []
        for h, vec in pairs:
            scale, q = quantised(vec)
            rec = _REC.pack(h, scale) + q
            data += rec + zlib.crc32(rec).to_bytes(4, "little")
            vectors.append(q)
        with self.lock:
            first = self._count
            with disk_writes():
                os.pwrite(self._fd, bytes(data), _HEAD.size + first * self.size)
            self._count += len(pairs)
            self.owner.extend([DEAD] * len(pairs))
            self._add_codes(vectors)
            recs = list(range(first, self._count))
            if self._hashes is not None:
                for (h, _), r in zip(pairs, recs):
                    self._hashes[h] = r
            return recs

    def _add_codes(self, vectors: list) -> None:
        np = self.np
        if np is None:
            self._codes.extend(sign_code(v) for v in vectors)
            return
        n = self._count
        if n > len(self._codes):
            grown = np.zeros((n * 3 // 2 + 16, self._codes.shape[1]), "uint8")
            grown[: n - len(vectors)] = self._codes[: n - len(vectors)]
            self._codes = grown
        q = np.frombuffer(b"".join(vectors), "int8").reshape(len(vectors), self.dim)
        self._codes[n - len(vectors) : n] = np.packbits(q > 0, axis=1)

    def assign(self, path: str, key: Any, recs: list) -> None:
        """Give a note its records, in chunk order; a record another note holds is copied."""
        with self.lock:
            number = self._names.find(path)
            copies = [r for r in recs if self.owner[r] != DEAD and self.owner[r] != number]
            if copies:
                moved = dict(zip(copies, self._copy(copies)))
                recs = [moved.get(r, r) for r in recs]
            for r in self.records(path):
                self.owner[r] = DEAD
            self._claim(path, key, recs)
            self.changes += 1
            self.dirty = True

    def _copy(self, recs: list) -> list:
        pairs = []
        for r in recs:
            raw = os.pread(self._fd, self.size, _HEAD.size + r * self.size)
            h, scale = _REC.unpack_from(raw)
            q = array.array("b", raw[_REC.size : -4])
            pairs.append((h, [scale * x for x in q]))
        return self.append(pairs)

    # -- persistence --------------------------------------------------------------------

    def save(self) -> None:
        """Write meta.json (atomically); the vector file is already on disk."""
        with self.lock:
            if self._fd >= 0:
                os.fsync(self._fd)
            meta = {
                "version": 1,
                "model": self.model,
                "dim": self.dim,
                "fingerprint": self.fingerprint,
                "generation": self.generation,
                "extra": self.extra,
                "notes": {p: [self._key(n), self._run(n).tolist()] for n, p in self._names.held()},
            }
            data = json.dumps(meta, separators=(",", ":")).encode()
            self.dirty = False
        with disk_writes():
            atomic_write(self.folder / "meta.json", data, 0o600)

    def dead(self) -> int:
        return self._count - sum(self._len)

    def compact(self) -> None:
        """Rewrite the vector file with the notes' records only; then meta.json names it."""
        with self.lock:
            order = [(p, self._key(n), self._run(n)) for n, p in self._names.held()]
            new_gen = self.generation + 1
            target = self.folder / f"vectors.{new_gen}.bin"
            mapping: dict = {}

            def write(f) -> None:
                f.write(_HEAD.pack(_MAGIC, self.dim, 0))
                for _, _, recs in order:
                    for r in recs:
                        if r not in mapping:
                            mapping[r] = len(mapping)
                            f.write(os.pread(self._fd, self.size, _HEAD.size + r * self.size))

            with disk_writes():
                atomic_write(target, write, 0o600)
            old_file = self.file
            keep = sorted(mapping, key=mapping.get)
            vectors = [
                os.pread(self._fd, self.dim, _HEAD.size + r * self.size + _REC.size) for r in keep
            ]
            self.generation = new_gen
            self._open_file()
            self._count = len(keep)
            self._hashes = None
            self._names = _PathTable()
            self._folders = collections.Counter()
            self._keys, self._start, self._len = (
                array.array("q"),
                array.array("I"),
                array.array("H"),
            )
            self._recs = array.array("I")
            self.owner = array.array("I", [DEAD]) * len(keep)
            for path, key, recs in order:
                self._claim(path, key, [mapping[r] for r in recs])
            self._set_codes(vectors)
            self.save()
            old_file.unlink(missing_ok=True)
        release_memory()

    def note_vector(self, path: str) -> list | None:
        """Return the normalised mean of a note's chunk vectors, None for a note without."""
        with self.lock:
            recs = self.records(path)
            if not recs:
                return None
            total = [0.0] * self.dim
            for r in recs[:64]:
                raw = os.pread(self._fd, self.size, _HEAD.size + r * self.size)
                scale = _REC.unpack_from(raw)[1]
                for i, x in enumerate(array.array("b", raw[_REC.size : _REC.size + self.dim])):
                    total[i] += scale * x
        try:
            return normalised(total)
        except VectorError:
            return None

    def stats(self) -> dict:
        with self.lock:
            return {"notes": self._names.count, "chunks": sum(self._len)}

    # -- what the floor is calibrated from ------------------------------------------------

    def sample(self, k: int) -> list:
        """Return the paths of up to k notes with chunks (every one when fewer): those whose
        paths hash lowest, so the same notes give the same sample whatever order they were
        embedded in, and a sample is spread over every folder."""
        with self.lock:
            held = [(p, n) for n, p in self._names.held() if self._len[n]]
        if len(held) <= k:
            return [p for p, _ in held]
        keyed = [(chunk_hash(p), p) for p, _ in held]
        return [p for _, p in heapq.nsmallest(k, keyed)]

    def best_cosines(self, vector: list, paths: list) -> list:
        """Return each note's best cosine to a normalised vector (of its first 64 chunks),
        as the semantic pass scores a note; notes no longer held are left out."""
        out = []
        for path in paths:
            with self.lock:
                scored = self._rescore(list(self.records(path)[:64]), vector)
            if scored:
                out.append(max(score for score, _ in scored))
        return out

    def nearest_other(self, path: str) -> float | None:
        """Return the cosine of a note's nearest other note, as /related scores it (None
        for a note not held or alone)."""
        vector = self.note_vector(path)
        if vector is None:
            return None
        for other, score, _ in self.nearest(vector, limit=2):
            if other != path:
                return score
        return None

    # -- the semantic pass ----------------------------------------------------------------

    def _rows_under(self, prefixes: tuple) -> Any:
        """Return the records of the notes under these folder prefixes (a NumPy array of
        them, or an array): kept for the few reaches searched lately until a note gets other
        records, is dropped or moves, so a person's search by meaning costs no walk of
        every path."""
        kept = self._reach_rows.get(prefixes)
        if kept is not None and kept[0] == self._edits:
            self._reach_rows.move_to_end(prefixes)
            return kept[1]
        held = [n for n, p in self._names.held() if p.startswith(prefixes)]
        rows: Any = array.array("I", [r for n in held for r in self._run(n)])
        if self.np is not None:
            rows = self.np.asarray(rows, "int64")
        self._reach_rows[prefixes] = (self._edits, rows)
        self._reach_rows.move_to_end(prefixes)
        while len(self._reach_rows) > REACH_ROWS:
            self._reach_rows.popitem(last=False)
        return rows

    def _candidates(self, qcode: Any, within: Any, k: int) -> list:
        """Return up to about k records nearest the query's sign code (Hamming)."""
        np = self.np
        if np is not None:
            codes = self._codes[: self._count]
            rows = np.asarray(within, "int64") if within is not None else None
            if rows is not None:
                codes = codes[rows]
            dist = _popcount(np, np.bitwise_xor(codes, qcode)).sum(axis=1, dtype="int32")
            best = np.argpartition(dist, k)[:k] if len(dist) > k else np.arange(len(dist))
            return (rows[best] if rows is not None else best).tolist()
        codes, shift = self._codes, max(0, self.dim.bit_length() - 8)  # a distance: a byte
        if within is not None:
            codes = [codes[r] for r in within]
        dist = bytes(_distances(qcode, codes, shift))
        if len(dist) <= k:
            picked: Any = range(len(dist))
        else:
            seen, cut = 0, 0
            for cut in range(256):
                seen += dist.count(cut)
                if seen >= k:
                    break
            nearer = re.compile(b"[\\x00-" + re.escape(bytes([cut])) + b"]")
            picked = [m.start() for m in nearer.finditer(dist)]
        return list(picked) if within is None else [within[i] for i in picked]

    def _rescore(self, recs: list, query: list) -> list:
        """Return [(cosine, record)] of live records, their int8 vectors read from the file."""
        size, fd, base, dim = self.size, self._fd, _HEAD.size, self.dim
        owner, np = self.owner, self.np
        live = [r for r in recs if owner[r] != DEAD]
        if np is not None and live:
            raw = b"".join(os.pread(fd, size, base + r * size) for r in live)
            rows = np.frombuffer(raw, "uint8").reshape(len(live), size)
            scales = rows[:, 8:12].copy().view("<f4")[:, 0]
            q = rows[:, _REC.size : _REC.size + dim].view("int8").astype("float32")
            scores = (q @ np.asarray(query, "float32")) * scales
            return list(zip(scores.tolist(), live))
        out = []
        for r in live:
            raw = os.pread(fd, size, base + r * size)
            scale = _REC.unpack_from(raw)[1]
            vec = array.array("b", raw[_REC.size : _REC.size + dim])
            out.append((scale * sum(map(mul, vec, query)), r))
        return out

    def nearest(
        self, query: list, folder: str | tuple = "", limit: int = MAX_SEMANTIC_NOTES
    ) -> list:
        """Return [(path, cosine, chunk number)] of the notes nearest a normalised query
        vector, best first: each note's best chunk; only notes under `folder` (a folder,
        or the folders of a reach) are scanned."""
        with self.lock:
            if not self._count:
                return []
            within = None
            folders = (folder,) if isinstance(folder, str) else tuple(folder)
            prefixes = tuple(f.rstrip("/") + "/" for f in folders if f)
            if prefixes:
                within = self._rows_under(prefixes)
                if not len(within):
                    return []
            np = self.np
            qcode = float_sign_code(query) if np is None else np.packbits(np.asarray(query) > 0)
            recs = self._candidates(qcode, within, RESCORE)
            scored = self._rescore(recs, query)
            best: dict = {}
            for score, r in sorted(scored, reverse=True):
                path = self._names.path(self.owner[r])
                if path is not None and path not in best:
                    best[path] = (score, r)
            ranked = sorted(best.items(), key=lambda x: (-x[1][0], x[0]))[:limit]
            return [(path, score, self.records(path).index(r)) for path, (score, r) in ranked]


# -- the floor: how near a note must be to count as found by meaning ----------------------------

FLOOR_Z = 3.25  # spreads above what an unrelated text scores against a typical note
FLOOR_SAMPLE = 2048  # notes whose cosine to the probe text is measured (all, when fewer)
FLOOR_NEIGHBOURS = 128  # of those, notes whose nearest other note is looked up
FLOOR_PRIOR = 8  # the weight, in notes, of a random direction's spread (1/sqrt(dimensions))
FLOOR_METHOD = (
    "the probe text's median cosine to the notes plus {z} robust spreads of those cosines"
    " (1.4826 x their median absolute deviation, weighted with a random direction's"
    " 1/sqrt(dimensions) while there are few notes)"
)


def _median(values: list) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def calibrate_floor(store: VectorStore, probe: list, neighbours: int = FLOOR_NEIGHBOURS) -> dict:
    """Return the floor of the semantic pass for this store's model and notes, and how it
    was found. The probe text is about none of the notes: its cosines to them are what a
    query about nothing scores against each, so the floor sits FLOOR_Z robust spreads
    above their median (a spread that leans on 1/sqrt(dimensions), a random direction's,
    while few notes are held: two notes still give a floor). The notes' best other-note
    cosines (what /related would show first) are measured beside it: how near the nearest
    notes come, and the share of notes that keep a related note over the floor. Costs at
    most FLOOR_SAMPLE rescorings and `neighbours` semantic passes at any size (measured at
    100k chunks of 50k notes: 1.2 s with NumPy, 2.6 s in pure Python on a quiet machine,
    4.6 and 16 s on a busy one; most of it the passes)."""
    probe = normalised(list(probe))
    paths = store.sample(FLOOR_SAMPLE)
    scores = store.best_cosines(probe, paths)
    step = max(1, -(-len(paths) // neighbours)) if neighbours else 0
    near = [x for x in map(store.nearest_other, paths[::step]) if x is not None] if step else []
    prior = 1 / math.sqrt(store.dim)
    n = len(scores)
    middle = _median(scores) if scores else 0.0
    mad = 1.4826 * _median([abs(x - middle) for x in scores]) if scores else prior
    spread = math.sqrt((n * mad * mad + FLOOR_PRIOR * prior * prior) / (n + FLOOR_PRIOR))
    cosine = round(middle + FLOOR_Z * spread, 4)
    return {
        "cosine": cosine,
        "notes": store.stats()["notes"],
        "probe": {"notes": n, "median": round(middle, 4), "spread": round(spread, 4)},
        "neighbours": {
            "notes": len(near),
            "median": round(_median(near), 4) if near else None,
            "withRelated": round(sum(x >= cosine for x in near) / len(near), 3) if near else 0,
        },
        "method": FLOOR_METHOD.format(z=FLOOR_Z),
    }


_RUN = 0x80000000  # a note's start that is its first record: its records are in a row


def _consecutive(recs: Any) -> bool:
    return all(b - a == 1 for a, b in zip(recs, recs[1:]))


_NO_KEY = -1  # a note kept without a key (hash() never gives -1)


def _packed_notes(notes: dict, good: int) -> tuple:
    """Return meta.json's notes as (paths joined by NUL, array of keys, array of counts,
    array of records), leaving out a note with a record past the `good` ones (lost in a
    torn tail: embedded again). A handful of flat objects, none of the parsed ones."""
    paths, keys, counts, recs = [], array.array("q"), array.array("I"), array.array("I")
    for path, (key, rs) in notes.items():
        if rs and max(rs) >= good:
            continue  # its chunks were in the lost tail: embedded again
        paths.append(path)
        keys.append(_NO_KEY if key is None else key)
        counts.append(len(rs))
        recs.extend(rs)
    return "\0".join(paths), keys, counts, recs


def _popcount(np: Any, a: Any) -> Any:
    """Per-byte bit counts of a uint8 array (NumPy's bitwise_count where it has one)."""
    count = getattr(np, "bitwise_count", None)
    if count is not None:
        return count(a)
    return np.array([bin(i).count("1") for i in range(256)], "uint8")[a]


def remove_store(folder: Path, keep_folder: bool = False) -> None:
    """Delete a vector store (embeddings switched off, or a new model)."""
    if not folder.is_dir():
        return
    for child in folder.iterdir():
        if child.is_file() or child.is_symlink():
            child.unlink(missing_ok=True)
    if not keep_folder:
        with contextlib.suppress(OSError):
            folder.rmdir()


# -- fusion ----------------------------------------------------------------------------------

RRF_K = 10  # measured: see bench/README.md, "Search quality with a real model"
MEANING_WEIGHT = 1.5  # the semantic ranking counts 1.5 times the keyword one


def fuse(words: list, meaning: list, k: int = RRF_K, weight: float = MEANING_WEIGHT) -> list:
    """Return [(path, score)] of two best-first lists of paths fused by weighted reciprocal
    rank: the keyword list adds 1 / (k + rank), the semantic one weight / (k + rank); ties
    by path."""
    scores: dict = {}
    for ranking, w in ((words, 1.0), (meaning, weight)):
        for rank, path in enumerate(ranking, 1):
            scores[path] = scores.get(path, 0.0) + w / (k + rank)
    return sorted(scores.items(), key=lambda x: (-x[1], x[0]))
