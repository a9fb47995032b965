"""The index on disk: segment files, the manifest, crash safety."""

from __future__ import annotations

import array
import bisect
import collections
import dataclasses
import functools
import heapq
import itertools
import json
import mmap
import operator
import os
import re
import struct
import sys
import tempfile
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from notesvc.boot import log
from notesvc.helpers import atomic_write
from notesvc.search.segments import (
    FIRST_ITEM,
    NOT_MINUS_ONE,
    OVERFLOW_CHAR,
    PAIR_COMMON,
    PAIR_RE,
    PAIR_TERMS,
    SECOND_ITEM,
    SPARSE_EVERY,
    DeletedCounts,
    Vocab,
    sorted_position,
    term_char_of,
    term_number,
)
from notesvc.search.text import INDEX_FORMAT, K1, B, bm25_tf

# -- persistence --------------------------------------------------------------
#
# A segment file: an 8-byte magic, 8-aligned sections (arrays in native byte order,
# strings "\n"-terminated), a JSON footer naming them with the format, counts and a
# CRC-32 of everything before it, then the footer's length, its CRC and the magic again.
# The commit file (<root>/.notesvc/index.cache) has the same frame around the list of
# segment files and their deleted notes. Files are written with atomic_write (0600).


class IndexFileError(ValueError):
    """An index file that is missing, old, foreign, truncated or damaged."""


_SEGMENT_MAGIC = b"NSVCSEG\x00"
_COMMIT_MAGIC = b"NSVCIDX\x00"
_TRAILER = struct.Struct("<II8s")  # footer length, footer crc32, magic
# name: (array type, items per note or term, extra items): how long each section must be
_SECTIONS = {
    "ids": ("I", None, 0, 0),  # postings, term by term (body, then title): note ids...
    "imps": ("f", None, 0, 0),  # ...and their BM25 impacts (the same positions)
    "terms": ("I", "terms", 4, 0),  # per term: body start, count, title start, count
    "dict_off": ("I", "dict", 1, 1),
    "dict_tid": ("I", "dict", 1, 0),
    "tid_rank": ("I", "terms", 1, 0),
    "surf_off": ("I", "surfaces", 1, 1),
    "surf_tid": ("I", "surfaces", 1, 0),
    "size": ("Q", "docs", 1, 0),
    "mtime": ("q", "docs", 1, 0),
    "dl": ("I", "docs", 2, 0),
    "avg": ("f", "docs", 2, 0),
    "tok_off": ("Q", "docs", 2, 1),
    "path_off": ("I", "docs", 1, 1),
    "title_off": ("I", "docs", 1, 1),
    "by_path": ("I", "docs", 1, 0),
}
_TEXT_SECTIONS = ("dict", "dict_sparse", "surf", "surf_sparse", "paths", "titles", "tokens")


class DiskSegment:
    """A segment file, read in place through mmap; raises IndexFileError when damaged."""

    def __init__(self, path: Path):
        self.file = path
        self.name = path.name
        try:
            with open(path, "rb") as f:
                self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:  # ValueError: an empty file
            raise IndexFileError(f"{path.name}: cannot be opened ({e})") from None
        self.meta = meta = _read_footer(self.mm, _SEGMENT_MAGIC, path.name)
        try:
            self.n, self.nt = int(meta["docs"]), int(meta["terms"])
            self.nd, self.ns = int(meta["dict"]), int(meta["surfaces"])
            self.lens = [int(x) for x in meta["lens"]]
            self.avg_range = [[float(a), float(b)] for a, b in meta["avg_range"]]
            self.crc = int(meta["crc"])
            bounds = {k: (int(a), int(b)) for k, (a, b) in meta["sections"].items()}
        except (KeyError, TypeError, ValueError) as e:
            raise IndexFileError(f"{path.name}: unreadable header ({e})") from None
        self.body_end = len(self.mm) - _TRAILER.size - int(meta["footer"])
        view = memoryview(self.mm)
        self.text: dict = {}
        counts = {"docs": self.n, "terms": self.nt, "dict": self.nd, "surfaces": self.ns}
        for name in (*_SECTIONS, *_TEXT_SECTIONS):
            if name not in bounds:
                raise IndexFileError(f"{path.name}: section {name} is missing")
            start, length = bounds[name]
            if start < 16 or length < 0 or start + length > self.body_end or start % 8:
                raise IndexFileError(f"{path.name}: section {name} is out of bounds")
            if name in _TEXT_SECTIONS:
                self.text[name] = start
                continue
            spec = _SECTIONS[name]
            part = view[start : start + length]
            if length % struct.calcsize(spec[0]):
                raise IndexFileError(f"{path.name}: section {name} has a torn item")
            arr = part.cast(spec[0])
            if spec[1] is not None and len(arr) != counts[spec[1]] * spec[2] + spec[3]:
                raise IndexFileError(f"{path.name}: section {name} does not add up")
            setattr(self, "_" + name, arr)
        if len(self._ids) != len(self._imps):
            raise IndexFileError(f"{path.name}: postings do not add up")
        self._pairs = self._pair_lists(meta, bounds, view)
        self.sparse = {
            kind: self.mm[slice(*_span(bounds[kind + "_sparse"]))].decode().split("\n")[:-1]
            for kind in ("dict", "surf")
        }
        self.deleted: set = set()
        self.del_df: tuple = (DeletedCounts(self.nt), DeletedCounts(self.nt))
        self.del_lens = [0, 0]

    def _pair_lists(self, meta: dict, bounds: dict, view: memoryview) -> tuple | None:
        """Return (pair keys, list offsets, note ids), or None for a file without them (0.3
        and before) or with other PAIR_COMMON, PAIR_TERMS: its phrases are found the slower way."""
        if meta.get("pair_terms") != [PAIR_COMMON, PAIR_TERMS]:
            return None
        arrays = []
        for name in ("pair_keys", "pair_off", "pair_ids"):
            start, length = bounds.get(name, (-1, -1))
            if start < 16 or length < 0 or start + length > self.body_end or start % 8:
                raise IndexFileError(f"{self.name}: section {name} is out of bounds")
            if length % 4:
                raise IndexFileError(f"{self.name}: section {name} has a torn item")
            arrays.append(view[start : start + length].cast("I"))
        keys, off, ids = arrays
        if len(off) != len(keys) + 1 or off[-1] != len(ids):
            raise IndexFileError(f"{self.name}: section pair_off does not add up")
        return keys, off, ids

    def pair_ids(self, keys: list, f: int) -> list | None:
        """Return the note ids (deleted ones included) of each adjacent pair of keys that
        has a list in field f, or None when none has: notes holding the phrase are among
        each list's (exactly those, for a phrase of two words)."""
        if self._pairs is None:
            return None
        listed, off, ids = self._pairs
        out = []
        for a, b in zip(keys, keys[1:]):
            if max(a, b) < PAIR_TERMS and min(a, b) < PAIR_COMMON:
                i = sorted_position(listed, _pair_key(a, b, f))
                found = ids[off[i] : off[i + 1]] if i >= 0 else ids[0:0]
                if len(found) and found[-1] >= self.n:  # ascending: a damaged list
                    return None  # (the substring search instead)
                out.append(found)
        return out or None

    def verify(self) -> None:
        """Check the whole file against its checksum (reads it, does not map it)."""
        crc, left = 0, self.body_end
        with open(self.file, "rb") as f:
            while left > 0:
                chunk = f.read(min(left, 1 << 20))
                if not chunk:
                    break
                crc = zlib.crc32(chunk, crc)
                left -= len(chunk)
        if left or crc != self.crc:
            raise IndexFileError(f"{self.name}: checksum mismatch")

    def delete(self, d: int) -> None:
        if d in self.deleted or not 0 <= d < self.n:
            return
        self.deleted.add(d)
        for f in (0, 1):
            toks = self.tok_text(d, f)
            self.del_lens[f] += len(toks)
            self.del_df[f].add(map(term_number, set(toks).difference(OVERFLOW_CHAR)))

    # -- sorted string tables: the dictionary, the surfaces, the paths -----------------------

    def _strings(self, kind: str, lo: int, hi: int) -> list:
        off = self._dict_off if kind == "dict" else self._surf_off
        base = self.text[kind]
        return self.mm[base + off[lo] : base + off[hi]].decode().split("\n")[:-1]

    def _seek(self, kind: str, word: str) -> tuple:
        """Return (position of the first entry >= word, the block read, its first position)."""
        count = self.nd if kind == "dict" else self.ns
        i = bisect.bisect_right(self.sparse[kind], word) - 1
        if i < 0:
            return 0, [], 0
        lo = i * SPARSE_EVERY
        block = self._strings(kind, lo, min(lo + SPARSE_EVERY, count))
        return lo + bisect.bisect_left(block, word), block, lo

    def keys(self, stems: list) -> list:
        """Return the term number of each stem (None where absent); stems sorted or not."""
        out = []
        if len(stems) > 8:  # one read of the dictionary range the stems span
            first, last = min(stems), max(stems)
            lo = self._seek("dict", first)[0]
            hi = self._seek("dict", last + "\0")[0]
            if hi - lo <= 16 * len(stems):
                table = dict(zip(self._strings("dict", lo, hi), self._dict_tid[lo:hi]))
                return list(map(table.get, stems))
        for s in stems:
            pos, block, lo = self._seek("dict", s)
            j = pos - lo
            out.append(self._dict_tid[pos] if j < len(block) and block[j] == s else None)
        return out

    def counts(self, key: int) -> tuple:
        """Return how many notes (deleted ones included) hold a term in body and title."""
        return self._terms[4 * key + 1], self._terms[4 * key + 3]

    def postings(self, key: int, f: int):
        at = 4 * key + 2 * f
        start, n = self._terms[at], self._terms[at + 1]
        if not n:
            return None
        return self._ids[start : start + n], self._imps[start : start + n]

    def char(self, key: int) -> str:
        return term_char_of(key)

    def _tok_span(self, d: int, f: int) -> tuple:
        base, off = self.text["tokens"], self._tok_off
        return base + off[2 * d + f], base + off[2 * d + f + 1]

    def tok_bytes(self, d: int, f: int) -> bytes:
        a, b = self._tok_span(d, f)
        return self.mm[a:b]

    def tok_text(self, d: int, f: int) -> str:
        return self.tok_bytes(d, f).decode()

    toks = tok_text

    def path_bytes(self, d: int) -> bytes:
        base, off = self.text["paths"], self._path_off
        return self.mm[base + off[d] : base + off[d + 1]]

    def path(self, d: int) -> str:
        return self.path_bytes(d).decode()

    def title_bytes(self, d: int) -> bytes:
        base, off = self.text["titles"], self._title_off
        return self.mm[base + off[d] : base + off[d + 1]]

    def title(self, d: int) -> str:
        return self.title_bytes(d).decode()

    def sig(self, d: int) -> tuple:
        return self._size[d], self._mtime[d]

    def dl(self, d: int, f: int) -> int:
        return self._dl[2 * d + f]

    def avg_then(self, d: int, f: int) -> float:
        return self._avg[2 * d + f]

    def _path_pos(self, target: bytes) -> int:
        """Return the first position in path order whose path is >= target."""
        order, lo, hi = self._by_path, 0, self.n
        while lo < hi:
            mid = (lo + hi) // 2
            if self.path_bytes(order[mid]) < target:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def find(self, path: str):
        target = path.encode()
        pos = self._path_pos(target)
        if pos < self.n:
            d = self._by_path[pos]
            if d not in self.deleted and self.path_bytes(d) == target:
                return d
        return None

    def phrase(self, cands: Iterable, chars: list, f: int) -> list:
        """Return the candidates whose field holds the term chars in a row: one mmap.find
        per candidate (C's substring search skips on the needle's last byte; starting at a
        rare term instead and comparing what precedes it in Python measured slower, 24.5
        against 29.8 ms at p95 on 100k real notes)."""
        cands = list(cands)
        first, last = self._tok_spans[f]
        base, mm = self.text["tokens"], self.mm
        starts = map(base.__add__, map(first.__getitem__, cands))
        ends = map(base.__add__, map(last.__getitem__, cands))
        found = map(mm.find, itertools.repeat("".join(chars).encode()), starts, ends)
        return list(itertools.compress(cands, map(NOT_MINUS_ONE, found)))

    @functools.cached_property
    def _tok_spans(self) -> tuple:
        """Per field: (start offsets, end offsets) of the notes' term strings, by note id."""
        off = self._tok_off
        return (off[0:-1:2], off[1::2]), (off[1::2], off[2::2])

    def ids_under(self, prefix: str) -> memoryview:
        """Return the ids of the notes (deleted ones too) whose paths start with prefix."""
        target = prefix.encode()
        return self._by_path[self._path_pos(target) : self._path_pos(target + b"\xff")]

    def field_lengths(self, f: int) -> memoryview:
        """Return every note's length in a field (tokens), by id."""
        return self._dl[f::2]

    def in_folder(self, cands: set, prefix: str) -> set:
        target = prefix.encode()
        lo, hi = self._path_pos(target), self._path_pos(target + b"\xff")
        if hi - lo > 4 * len(cands):
            return {d for d in cands if self.path_bytes(d).startswith(target)}
        return cands.intersection(self._by_path[lo:hi])

    def prefix_words(self, prefix: str, cap: int) -> list:
        pos = self._seek("surf", prefix)[0]
        words = self._strings("surf", pos, min(pos + cap, self.ns))
        out = []
        for w, tid in zip(words, self._surf_tid[pos : pos + len(words)]):
            if not w.startswith(prefix):
                break
            out.append((w, tid))
        stems = self._stems([tid for _, tid in out])
        return [(w, s) for (w, _), s in zip(out, stems)]

    def _stems(self, tids: list) -> list:
        base, off, rank = self.text["dict"], self._dict_off, self._tid_rank
        mm = self.mm
        return [mm[base + off[rank[t]] : base + off[rank[t] + 1] - 1].decode() for t in tids]

    def live(self) -> list:
        deleted = self.deleted
        return [(self.path(d), d) for d in range(self.n) if d not in deleted]

    # -- what the segment writer reads -----------------------------------------------------

    def sorted_terms(self) -> Iterable:
        for lo in range(0, self.nd, 512):
            hi = min(lo + 512, self.nd)
            yield from zip(self._strings("dict", lo, hi), self._dict_tid[lo:hi])

    def sorted_surfaces(self) -> Iterable:
        for lo in range(0, self.ns, 512):
            hi = min(lo + 512, self.ns)
            yield from zip(self._strings("surf", lo, hi), self._surf_tid[lo:hi])

    def term_count(self) -> int:
        return self.nt

    @staticmethod
    def key_number(key: int) -> int:
        return key

    def by_path(self) -> memoryview:
        return self._by_path


def _span(bounds: tuple) -> tuple:
    return bounds[0], bounds[0] + bounds[1]


def _read_footer(mm, magic: bytes, name: str) -> dict:
    """Return the JSON footer of an index file (checked: magic, length, crc, format)."""
    size = len(mm)
    if size < 16 + _TRAILER.size or mm[:8] != magic:
        raise IndexFileError(f"{name}: not an index file of this kind")
    length, crc, tail = _TRAILER.unpack(mm[size - _TRAILER.size :])
    if tail != magic or length > size - 16 - _TRAILER.size:
        raise IndexFileError(f"{name}: truncated")
    raw = mm[size - _TRAILER.size - length : size - _TRAILER.size]
    if zlib.crc32(raw) != crc:
        raise IndexFileError(f"{name}: damaged footer")
    try:
        meta = json.loads(raw)
    except ValueError:
        raise IndexFileError(f"{name}: damaged footer") from None
    if not isinstance(meta, dict) or meta.get("format") != list(INDEX_FORMAT):
        raise IndexFileError(f"{name}: an index of another format")
    if meta.get("byteorder") != sys.byteorder:
        raise IndexFileError(f"{name}: written on a machine of another byte order")
    meta["footer"] = length
    return meta


class _FileWriter:
    """Writes an index file: 8-aligned sections, a checksum, a JSON footer."""

    def __init__(self, f, magic: bytes):
        self.f, self.pos, self.crc = f, 0, 0
        self.sections: dict = {}
        self.magic = magic
        self.write(magic + bytes(8))

    def write(self, data) -> None:
        self.f.write(data)
        self.crc = zlib.crc32(data, self.crc)
        self.pos += len(data) if isinstance(data, bytes) else memoryview(data).nbytes

    def align(self) -> None:
        if self.pos % 8:
            self.write(bytes(8 - self.pos % 8))

    def section(self, name: str, *parts) -> None:
        self.align()
        start = self.pos
        for part in parts:
            self.write(part)
        self.sections[name] = (start, self.pos - start)

    def begin(self, name: str) -> None:
        self.align()
        self.sections[name] = (self.pos, None)

    def end(self, name: str) -> None:
        start = self.sections[name][0]
        self.sections[name] = (start, self.pos - start)

    def finish(self, meta: dict) -> None:
        self.align()
        footer = {
            **meta,
            "format": list(INDEX_FORMAT),
            "byteorder": sys.byteorder,
            "crc": self.crc,
            "sections": self.sections,
        }
        raw = json.dumps(footer, separators=(",", ":")).encode()
        self.f.write(raw + _TRAILER.pack(len(raw), zlib.crc32(raw), self.magic))


class MergeCancelled(Exception):
    """A merge stopped because the index is closing."""


def _tagged(pairs: Iterable, i: int) -> Iterable:
    """Yield (word, i, key) for (word, key) of source i (a function: i bound per source)."""
    for word, key in pairs:
        yield word, i, key


def _path_order(src, remap) -> Iterable:
    """Yield (path bytes, new id) of a source's kept notes in path order."""
    for d in src.by_path():
        if remap[d] >= 0:
            yield src.path_bytes(d), remap[d]


def _merged_terms(sources: list) -> Iterable:
    """Yield (stem, [(source number, key)]) over the sources' dictionaries, in stem order."""
    streams = [_tagged(src.sorted_terms(), i) for i, src in enumerate(sources)]
    for stem_, parts in itertools.groupby(heapq.merge(*streams), key=FIRST_ITEM):
        yield stem_, [(i, k) for _, i, k in parts]


def _live_df(sources: list, dels: list, parts: list) -> tuple:
    """Return a term's (body, title) document frequencies over sources, deletions aside."""
    body = title = 0
    for i, k in parts:
        n_body, n_title = sources[i].counts(k)
        body += n_body - dels[i][0].get(k, 0) if n_body else 0
        title += n_title - dels[i][1].get(k, 0) if n_title else 0
    return body, title


def _norms(sources: list, remaps: list, avg: tuple) -> list:
    """Per field: (each merged note's BM25 length norm with the averages of its impacts,
    with today's averages), by new note id; None where every note already has today's."""
    out = []
    for f in (0, 1):
        then, now, stale = array.array("d"), array.array("d"), False
        for src, remap in zip(sources, remaps):
            for d in range(src.n):
                if remap[d] >= 0:
                    dl, a = src.dl(d, f), src.avg_then(d, f)
                    stale = stale or abs(a - avg[f]) > 1e-6 * avg[f]
                    then.append(K1 * (1 - B + B * dl / a))
                    now.append(K1 * (1 - B + B * dl / avg[f]))
        out.append((then, now) if stale else None)
    return out


def _rescore(ids, imps, then, now) -> array.array:
    """Return impacts computed again with new length norms: each term frequency recovered
    from its impact and its note's old norm, then scored with the new one (C-level maps)."""
    top = K1 + 1.0
    tfs = list(
        map(
            max,
            itertools.repeat(1),
            map(
                round,
                map(
                    operator.truediv,
                    map(operator.mul, imps, map(then.__getitem__, ids)),
                    map(
                        max, map(operator.sub, itertools.repeat(top), imps), itertools.repeat(1e-6)
                    ),
                ),
            ),
        )
    )
    return array.array(
        "f",
        map(
            operator.truediv,
            map(top.__mul__, tfs),
            map(operator.add, tfs, map(now.__getitem__, ids)),
        ),
    )


def _write_postings(out, spill, sources, skips, remaps, norms, parts: list, f: int) -> int:
    """Write one term's postings in one field (ids to out, impacts to spill), impacts
    computed again when norms are given; return how many."""
    ids_out, imps_out = array.array("I"), array.array("f")
    for i, k in parts:
        p = sources[i].postings(k, f)
        if not p:
            continue
        ids, imps = p
        if skips[i]:
            mapped = list(map(remaps[i].__getitem__, ids))
            keep = list(map(NOT_MINUS_ONE, mapped))
            ids_out.extend(itertools.compress(mapped, keep))
            imps_out.extend(itertools.compress(imps, keep))
            continue
        shift = remaps[i][ids[0]] - ids[0]
        ids_out.extend(map(shift.__add__, ids) if shift else ids)
        imps_out.extend(imps)
    if norms is not None and norms[f] is not None and ids_out:
        imps_out = _rescore(ids_out, imps_out, *norms[f])
    out.write(ids_out.tobytes())
    spill.write(imps_out.tobytes())
    return len(ids_out)


class _StringTable:
    """A sorted string table made as its words come (a merge's stems and surface words):
    its UTF-8 text, offsets and sparse directory, with no Python string kept per word.
    The lists of them were the largest part of a merge: 780,000 strings, 45 MB, at 100k
    notes."""

    __slots__ = ("offsets", "sparse", "text")

    def __init__(self):
        self.text, self.sparse = bytearray(), bytearray()
        self.offsets = array.array("I", [0])

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def append(self, word: str) -> None:
        raw = (word + "\n").encode()
        if not (len(self.offsets) - 1) % SPARSE_EVERY:
            self.sparse += raw
        self.text += raw
        self.offsets.append(len(self.text))


def _text_table(words) -> tuple:
    """Return (text, offsets, sparse directory) of a sorted string table (str or UTF-8)."""
    if isinstance(words, _StringTable):
        return words.text, words.offsets, words.sparse
    raw = [w + b"\n" if isinstance(w, bytes) else (w + "\n").encode() for w in words]
    offsets = array.array("I", itertools.accumulate(map(len, raw), initial=0))
    return b"".join(raw), offsets, b"".join(raw[::SPARSE_EVERY])


def _write_tables(out: _FileWriter, stems: list, tids: list, words: list, surf_tids) -> None:
    """Write the dictionary (stems sorted, with their term numbers) and the folded words."""
    text, offsets, sparse = _text_table(stems)
    out.section("dict", text)
    out.section("dict_sparse", sparse)
    out.section("dict_off", offsets.tobytes())
    out.section("dict_tid", array.array("I", tids).tobytes())
    text, offsets, sparse = _text_table(words)
    out.section("surf", text)
    out.section("surf_sparse", sparse)
    out.section("surf_off", offsets.tobytes())
    out.section("surf_tid", array.array("I", surf_tids).tobytes())


def _pair_key(a: int, b: int, fld: int) -> int:
    """Return the key of the list of term a followed by term b in field fld."""
    return (a * PAIR_TERMS + b) * 2 + fld


class _PairPostings:
    """The notes of each adjacent pair of a segment's commoner terms (_PAIR_RE), per field,
    gathered note by note from the token strings as they are written (ids ascending).

    Past SPILL_IDS held, the lists so far go to a temporary file in `folder` as one
    run, sorted by key, and write() merges the runs: a merge of 100k notes (7.4 million
    ids) holds a few MB of them, not 50.
    """

    _HEAD = struct.Struct("<II")  # a list in a run: its key and length, then its ids
    SPILL_IDS = 1 << 20  # pair list entries a segment writer holds before it spills them

    def __init__(self, folder: Path | None = None):
        self.found: tuple = ({}, {})  # per field: the pair's 4 UTF-8 bytes -> note ids
        self.held = 0
        self.folder = folder
        self.spill = None  # the runs' temporary file
        self.runs: list = []  # (start, end) of each run in it

    def add(self, d: int, fld: int, raw: bytes) -> None:
        if len(raw) < 4:
            return
        found = self.found[fld]
        pairs = set(PAIR_RE.findall(raw))
        for pair in pairs:
            ids = found.get(pair)
            if ids is None:
                found[pair] = ids = array.array("I")
            ids.append(d)
        self.held += len(pairs)
        if self.held > self.SPILL_IDS and self.folder is not None:
            self._spill()

    def _sorted(self) -> list:
        """Return [(pair_key, ids)] of the lists held, by key."""
        lists = []
        for fld in (0, 1):
            for pair, ids in self.found[fld].items():
                a = ((pair[0] & 0x1F) << 6 | (pair[1] & 0x3F)) - 0x100  # _term_number
                b = ((pair[2] & 0x1F) << 6 | (pair[3] & 0x3F)) - 0x100
                lists.append((_pair_key(a, b, fld), ids))
        lists.sort(key=FIRST_ITEM)
        return lists

    def _spill(self) -> None:
        if self.spill is None:
            self.spill = tempfile.TemporaryFile(dir=self.folder)  # noqa: SIM115 - close()
        start = self.spill.seek(0, os.SEEK_END)
        for key, ids in self._sorted():
            self.spill.write(self._HEAD.pack(key, len(ids)))
            self.spill.write(ids)
        self.runs.append((start, self.spill.tell()))
        self.found, self.held = ({}, {}), 0

    def _run(self, pos: int, end: int) -> Iterable:
        """Yield (key, ids as bytes) of the run at pos..end of the temporary file."""
        fd, buf, at = self.spill.fileno(), b"", 0

        def have(n: int) -> None:
            nonlocal buf, at, pos
            while len(buf) - at < n:
                chunk = os.pread(fd, min(max(n, 1 << 18), end - pos), pos)
                if not chunk:
                    raise OSError("a run of pair lists ended early")
                buf, at, pos = buf[at:] + chunk, 0, pos + len(chunk)

        while pos < end or at < len(buf):
            have(self._HEAD.size)
            key, n = self._HEAD.unpack_from(buf, at)
            at += self._HEAD.size
            have(4 * n)
            yield key, buf[at : at + 4 * n]
            at += 4 * n

    def write(self, out: _FileWriter) -> None:
        """Write the sections "pair_keys" (each list's pair_key, ascending), "pair_off"
        (where each list starts, and the end) and "pair_ids" (the lists)."""
        if not self.runs:
            lists = self._sorted()
            out.section("pair_keys", array.array("I", map(FIRST_ITEM, lists)))
            sizes = (len(ids) for _, ids in lists)
            out.section("pair_off", array.array("I", itertools.accumulate(sizes, initial=0)))
            out.section("pair_ids", *(ids for _, ids in lists))
            return
        self._spill()
        self.spill.flush()
        keys, off = array.array("I"), array.array("I", [0])
        runs = [self._run(*span) for span in self.runs]
        out.begin("pair_ids")  # a key's lists, run after run: its ids ascending
        for key, lists in itertools.groupby(heapq.merge(*runs, key=FIRST_ITEM), key=FIRST_ITEM):
            n = 0
            for _, ids in lists:
                out.write(ids)
                n += len(ids) // 4
            keys.append(key)
            off.append(off[-1] + n)
        out.end("pair_ids")
        out.section("pair_keys", keys)
        out.section("pair_off", off)

    def close(self) -> None:
        if self.spill is not None:
            self.spill.close()
            self.spill = None


def write_batch(f, docs: list, vocab: Vocab, avg: tuple) -> None:
    """Write analysed notes (Doc, in this order) as one segment file to f: the bulk build's
    fast path, with no Python work per posting beyond C-level maps and one sort per field.

    avg: the (body, title) average lengths the impacts are computed with.
    """
    out = _FileWriter(f, _SEGMENT_MAGIC)
    n, nt = len(docs), len(vocab.stems)
    terms = array.array("I", bytes(16 * nt))
    start = 0
    for fld in (0, 1):  # postings in note order, then sorted by term (stable: ids sorted)
        cps, owners, imps = array.array("I"), array.array("I"), array.array("f")
        for d, doc in enumerate(docs):
            toks = doc[4 + fld]
            counts = collections.Counter(toks)
            counts.pop(OVERFLOW_CHAR, None)
            if counts:
                tfs = list(counts.values())
                by_tf = {tf: bm25_tf(tf, len(toks), avg[fld]) for tf in set(tfs)}
                cps.extend(map(ord, counts))
                owners.extend(itertools.repeat(d, len(tfs)))
                imps.extend(map(by_tf.__getitem__, tfs))
        # by term, a counting sort: a sort of the postings' indexes made two Python ints
        # a posting (a 2,000-note batch: 250,000 of them, +20 MB at its peak)
        ids, by_term, at_term = array.array("I", owners), array.array("f", imps), {}
        base = start
        for cp, count in sorted(collections.Counter(cps).items()):
            at = 4 * (cp - (0x900 if cp >= 0xE000 else 0x100)) + 2 * fld  # _term_number
            terms[at], terms[at + 1] = start, count
            at_term[cp] = start - base
            start += count
        for cp, owner, imp in zip(cps, owners, imps):
            at = at_term[cp]
            at_term[cp] = at + 1
            ids[at], by_term[at] = owner, imp
        if fld == 0:
            out.begin("ids")
            spill = [by_term]
        else:
            spill.append(by_term)
        out.write(ids.tobytes())
        del cps, owners, imps, ids, at_term
    out.end("ids")
    out.section("imps", *(part.tobytes() for part in spill))
    out.section("terms", terms.tobytes())
    stems = vocab.stems
    by_stem = sorted(range(nt), key=stems.__getitem__)
    tid_rank = array.array("I", bytes(4 * nt))
    for pos, tid in enumerate(by_stem):
        tid_rank[tid] = pos
    out.section("tid_rank", tid_rank.tobytes())
    words = vocab.words_utf8()
    _write_tables(
        out,
        [stems[t] for t in by_stem],
        by_stem,
        [w for w, _ in words],
        [term_number(ch) for _, ch in words],
    )
    toks = [t.encode() for doc in docs for t in (doc.toks, doc.title_toks)]
    out.section("tokens", *toks)
    out.section("tok_off", array.array("Q", itertools.accumulate(map(len, toks), initial=0)))
    del toks  # no pair lists: a first build's files are small, and merged soon
    paths = [doc.path.encode() for doc in docs]
    titles = [doc.title.encode() for doc in docs]
    for name, strings in (("paths", paths), ("titles", titles)):
        out.section(name, *strings)
        offsets = array.array("I", itertools.accumulate(map(len, strings), initial=0))
        out.section(name[:-1] + "_off", offsets.tobytes())
    out.section("by_path", array.array("I", sorted(range(n), key=paths.__getitem__)).tobytes())
    out.section("size", array.array("Q", [doc.size for doc in docs]).tobytes())
    out.section("mtime", array.array("q", [doc.mtime for doc in docs]).tobytes())
    dls = array.array("I", [len(t) for doc in docs for t in (doc.toks, doc.title_toks)])
    out.section("dl", dls.tobytes())
    out.section("avg", array.array("f", avg * n).tobytes())
    out.finish(
        {
            "docs": n,
            "terms": nt,
            "dict": nt,
            "surfaces": len(words),
            "lens": [sum(dls[0::2]), sum(dls[1::2])],
            "avg_range": [[avg[0], avg[0]], [avg[1], avg[1]]],
        }
    )


def write_segment(
    f, sources: list, skips: list, dels: list, cancel=None, folder=None, avg=None
) -> list:
    """Write the live notes of sources as one segment to file f; return, per source, the
    map of its note ids to the new ones (-1: dropped).

    skips: each source's deleted ids; dels: each source's deleted-term counts (snapshots).
    avg: when given, every impact is computed again with these average lengths (a merge:
    the merged file then has one average, today's). Postings and term strings stream to
    the file (impacts through a temporary file in folder), so merging big segments needs
    memory for their dictionaries and per-note arrays, not for their postings.

    The steps follow the file: postings (ids, then impacts), the term table, the
    dictionary of stems and surface words, each note's tokens, its path and title, then
    the per-note columns and the footer.
    """
    out = _FileWriter(f, _SEGMENT_MAGIC)
    remaps, n = _renumber_notes(sources, skips)
    norms = _norms(sources, remaps, avg) if avg else None
    plan = _TermPlan.of(sources, dels)
    terms, tid_rank, stems, tids = _write_postings_of_terms(
        out, plan, sources, skips, dels, remaps, norms, cancel, folder
    )
    out.section("terms", terms.tobytes())
    out.section("tid_rank", tid_rank.tobytes())
    surfaces = _write_dictionary(out, plan, sources, terms, stems, tids)
    dictionary = len(tids)
    del stems, tids
    pairs = _PairPostings(folder)
    try:
        columns = _write_tokens(out, plan, sources, remaps, avg, cancel, pairs)
        pairs.write(out)
    finally:
        pairs.close()
    del pairs
    _write_paths_and_titles(out, sources, remaps)
    by_path = array.array("I", map(SECOND_ITEM, heapq.merge(*map(_path_order, sources, remaps))))
    dls, avgs = columns["dl"], columns["avg"]
    for name, arr in (("by_path", by_path), *columns.items()):
        out.section(name, arr.tobytes())
    spans = []
    for fld in (0, 1):
        values = avgs[fld::2]
        spans.append([min(values), max(values)] if len(values) else [1.0, 1.0])
    out.finish(
        {
            "docs": n,
            "terms": plan.nt,
            "dict": dictionary,
            "surfaces": surfaces,
            "lens": [sum(dls[0::2]), sum(dls[1::2])],
            "avg_range": spans,
            "pair_terms": [PAIR_COMMON, PAIR_TERMS],
        }
    )
    return remaps


def _renumber_notes(sources: list, skips: list) -> tuple:
    """Return (per source, its note ids -> the segment's (-1: dropped); the live count).
    Notes keep their order, so every map increases."""
    remaps, n = [], 0
    for src, skip in zip(sources, skips):
        remap = array.array("i", [-1]) * src.n
        for d in range(src.n):
            if d not in skip:
                remap[d] = n
                n += 1
        remaps.append(remap)
    return remaps, n


@dataclasses.dataclass
class _TermPlan:
    """How a segment numbers its terms: one source keeps its numbers; several get theirs
    anew, the commonest first (short term characters for common words), through `rank`
    (merged term -> new number, -1: dropped) and `trans` (per source, a str.translate
    table from its term characters to the new ones, filled as the terms are written)."""

    single: bool
    nt: int  # terms the segment keeps
    rank: Any = None
    trans: list = dataclasses.field(default_factory=lambda: [None])

    @classmethod
    def of(cls, sources: list, dels: list) -> _TermPlan:
        if len(sources) == 1:
            return cls(True, sources[0].term_count())
        df_b, df_t = array.array("I"), array.array("I")
        for _, parts in _merged_terms(sources):
            body, title = _live_df(sources, dels, parts)
            df_b.append(body)
            df_t.append(title)
        kept = [g for g in range(len(df_b)) if df_b[g] or df_t[g]]
        kept.sort(key=df_b.__getitem__, reverse=True)
        rank = array.array("i", [-1]) * len(df_b)
        for r, g in enumerate(kept):
            rank[g] = r
        trans = [array.array("I", bytes(4 * (src.term_count() + 0x900))) for src in sources]
        for table in trans:
            table[ord(OVERFLOW_CHAR)] = ord(OVERFLOW_CHAR)
        return cls(False, len(kept), rank, trans)


def _write_postings_of_terms(out, plan, sources, skips, dels, remaps, norms, cancel, folder):
    """Write the sections "ids" and "imps" (the impacts pass through a temporary file in
    folder until the ids are out); return (terms: each term's start and count per field,
    tid_rank, the stems in merged order, their term numbers)."""
    nt = plan.nt
    terms = array.array("I", bytes(16 * nt))
    tid_rank = array.array("I", bytes(4 * nt))
    stems, tids = _StringTable(), array.array("I")
    with tempfile.TemporaryFile(dir=folder) as spill:
        out.begin("ids")
        start = 0
        for g, (stem_, parts) in enumerate(_merged_terms(sources)):
            if cancel is not None and not g % 1024 and cancel.is_set():
                raise MergeCancelled
            if plan.single:
                if not any(_live_df(sources, dels, parts)):
                    continue
                tid = sources[0].key_number(parts[0][1])
            else:
                tid = plan.rank[g]
                if tid < 0:
                    continue
                cp = ord(term_char_of(tid))
                for i, k in parts:
                    plan.trans[i][ord(sources[i].char(k))] = cp
            tid_rank[tid] = len(stems)
            stems.append(stem_)
            tids.append(tid)
            for fld in (0, 1):
                count = _write_postings(out, spill, sources, skips, remaps, norms, parts, fld)
                if count:
                    terms[4 * tid + 2 * fld] = start
                    terms[4 * tid + 2 * fld + 1] = count
                    start += count
        out.end("ids")
        spill.seek(0)
        out.begin("imps")
        for chunk in iter(functools.partial(spill.read, 1 << 20), b""):
            out.write(chunk)
        out.end("imps")
    return terms, tid_rank, stems, tids


def _write_dictionary(out, plan, sources, terms, stems, tids) -> int:
    """Write the stems and the surface words (the forms that occur, for prefix* and the
    snippets) of the live terms; return how many surface words."""
    words, surf_tids = _StringTable(), array.array("I")
    last = None
    streams = [_tagged(src.sorted_surfaces(), i) for i, src in enumerate(sources)]
    for w, i, k in heapq.merge(*streams):
        if w == last:
            continue
        if plan.single:
            tid = sources[0].key_number(k)
            alive = tid < plan.nt and (terms[4 * tid + 1] or terms[4 * tid + 3])
        else:
            cp = plan.trans[i][ord(sources[i].char(k))]
            alive, tid = cp != 0, term_number(chr(cp)) if cp else 0
        if alive:
            last = w
            words.append(w)
            surf_tids.append(tid)
    _write_tables(out, stems, tids, words, surf_tids)
    return len(surf_tids)


def _write_tokens(out, plan, sources, remaps, avg, cancel, pairs: _PairPostings) -> dict:
    """Write the section "tokens" (each live note's token string, body then title, in the
    segment's term characters), handing each to pairs; return the per-note columns gathered
    on the way: size, mtime, dl, avg and tok_off, in the order they are written."""
    sizes, mtimes = array.array("Q"), array.array("q")
    dls, avgs, tok_off = array.array("I"), array.array("f"), array.array("Q", [0])
    out.begin("tokens")
    for src, remap, table in zip(sources, remaps, plan.trans):
        if cancel is not None and cancel.is_set():
            raise MergeCancelled
        raw_tokens = table is None and isinstance(src, DiskSegment)
        for d in range(src.n):
            if remap[d] < 0:
                continue
            for fld in (0, 1):
                if raw_tokens:
                    raw = src.tok_bytes(d, fld)
                else:
                    text = src.tok_text(d, fld)
                    raw = (text if table is None else text.translate(table)).encode()
                out.write(raw)
                pairs.add(remap[d], fld, raw)
                tok_off.append(tok_off[-1] + len(raw))
                dls.append(src.dl(d, fld))
                avgs.append(avg[fld] if avg else src.avg_then(d, fld))
            size, mtime = src.sig(d)
            sizes.append(size)
            mtimes.append(mtime)
    out.end("tokens")
    return {"size": sizes, "mtime": mtimes, "dl": dls, "avg": avgs, "tok_off": tok_off}


def _write_paths_and_titles(out, sources, remaps) -> None:
    """Write the sections "paths" and "titles", each with its offsets ("path_off",
    "title_off")."""
    for name, getter in (("paths", "path_bytes"), ("titles", "title_bytes")):
        off = array.array("I", [0])
        out.begin(name)
        for src, remap in zip(sources, remaps):
            get = getattr(src, getter)
            for d in range(src.n):
                if remap[d] >= 0:
                    raw = get(d)
                    out.write(raw)
                    off.append(off[-1] + len(raw))
        out.end(name)
        out.section(name[:-1] + "_off", off.tobytes())


def _blob(raw: bytes, end: int, bounds, typecode: str) -> array.array:
    start, length = (int(x) for x in bounds)
    if start < 16 or length < 0 or start + length > end or length % 4:
        raise IndexFileError("a list in the commit file is out of bounds")
    out = array.array(typecode)
    out.frombytes(raw[start : start + length])
    return out


def read_commit(path: Path, folder: Path) -> tuple:
    """Return (the segments the commit file names, their deletions applied; the last file
    number; False when a segment had to be dropped). Raises IndexFileError."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise IndexFileError("no index yet") from None
    except OSError as e:
        raise IndexFileError(f"{path.name}: unreadable ({e.strerror})") from None
    meta = _read_footer(raw, _COMMIT_MAGIC, path.name)
    end = len(raw) - _TRAILER.size - meta["footer"]
    if zlib.crc32(raw[:end]) != meta.get("crc"):
        raise IndexFileError(f"{path.name}: checksum mismatch")
    segs = []
    try:
        seq, intact = int(meta["seq"]), True
        for entry in meta["segments"]:
            name = str(entry["name"])
            if not re.fullmatch(r"\d{8}\.seg", name):
                raise IndexFileError(f"{path.name}: names a file that is not a segment")
            deleted = _blob(raw, end, entry["deleted"], "I")
            del_df = [_blob(raw, end, entry[key], "I") for key in ("del_body", "del_title")]
            del_lens = [int(x) for x in entry["del_lens"]]
            try:
                seg = DiskSegment(folder / name)
                if len(seg.mm) != int(entry["size"]) or seg.crc != int(entry["crc"]):
                    raise IndexFileError(f"{name}: not the file the index names")
            except IndexFileError as e:
                log.warning("index segment %s dropped: %s; its notes are read again", name, e)
                intact = False
                continue
            seg.deleted = {d for d in deleted if d < seg.n}
            for f, pairs in enumerate(del_df):
                seg.del_df[f].load(pairs)
            seg.del_lens = del_lens
            segs.append(seg)
    except (KeyError, TypeError, ValueError) as e:
        raise IndexFileError(f"{path.name}: unreadable ({e})") from None
    return segs, seq, intact


def write_commit(path: Path, entries: list, seq: int) -> None:
    """Write the commit file atomically (mode 0600): segment names, sizes, checksums and
    deletions."""

    def write(f) -> None:
        out = _FileWriter(f, _COMMIT_MAGIC)
        listed = []
        for name, size, crc, deleted, del_body, del_title, del_lens in entries:
            item = {"name": name, "size": size, "crc": crc, "del_lens": del_lens}
            for key, arr in (
                ("deleted", deleted),
                ("del_body", del_body),
                ("del_title", del_title),
            ):
                out.section(f"{name}/{key}", arr.tobytes())
                item[key] = out.sections[f"{name}/{key}"]
            listed.append(item)
        out.finish({"seq": seq, "segments": listed})

    atomic_write(path, write, mode=0o600)
