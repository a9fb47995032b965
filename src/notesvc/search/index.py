"""SearchIndex: building, updating and querying the inverted index."""

from __future__ import annotations

import array
import bisect
import collections
import contextlib
import functools
import hashlib
import heapq
import itertools
import math
import os
import stat
import sys
import threading
import time
import unicodedata
from collections import deque
from collections.abc import Container, Iterable, Mapping, Sequence, Sized
from pathlib import Path
from typing import Any, Callable

from notesvc.boot import log
from notesvc.helpers import (
    TEMP_PREFIX,
    atomic_write,
    deferred_sync,
    fsync_dir,
    release_memory,
)
from notesvc.notes.paths import MAX_SCAN_CHARS
from notesvc.notes.store import NOFOLLOW_NONBLOCK, NoteStore, ReadCache
from notesvc.search.helper import (
    MERGE_HELPER_NOTES,
    EarlyHelper,
    IndexHelper,
    analyse_batch,
    discard_temp,
    read_items,
)
from notesvc.search.masks import MaskCache, ReachMasks
from notesvc.search.persistence import (
    DiskSegment,
    IndexFileError,
    MergeCancelled,
    read_commit,
    write_batch,
    write_commit,
    write_segment,
)
from notesvc.search.segments import (
    BULK_CHUNK_CHARS,
    BULK_CHUNK_NOTES,
    COMMIT_SECONDS,
    FIRST_ITEM,
    FLUSH_DOCS,
    FLUSH_TOKENS,
    MAX_DELETED,
    MERGE_FACTOR,
    SCORE_EPS,
    SECOND_ITEM,
    IndexedNote,
    MemorySegment,
    TextCache,
    Vocab,
    exact_tf,
    phrase_docs,
    query_needles,
    sorted_position,
    word_docs,
)
from notesvc.search.text import MAX_PREFIX_TERMS, Query, bm25_idf, bm25_weight, body_snippet

# -- the index ----------------------------------------------------------------


def _memory_segment(vocab: Vocab, docs: list, avg: tuple) -> MemorySegment:
    seg = MemorySegment(vocab)
    for doc in docs:
        seg.add(doc, avg)
    return seg


class _Progress:
    """Counts the notes a bulk has indexed; a thread logs the count every 2 s."""

    def __init__(self, total: int):
        self.total, self.done, self.helped = total, 0, 0
        self.helper_failed = False
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="notesvc-progress", daemon=True)

    def __enter__(self) -> _Progress:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        log.info(
            "indexing: %d notes in %.1f s (%d batches by the helper process)",
            self.done,
            time.monotonic() - self.started,
            self.helped,
        )

    def add(self, count: int) -> None:
        self.done += count

    def _run(self) -> None:
        while not self._stop.wait(2):
            log.info("indexing: %d of %d notes indexed", self.done, self.total)


def folder_prefixes(folder: str | tuple) -> tuple:
    """Return the path prefixes ("notes/a/") of a folder or of several (() for every note)."""
    folders = (folder,) if isinstance(folder, str) else tuple(folder)
    return tuple(f.rstrip("/") + "/" for f in folders if f)


SORT_UP_TO = 512  # fewer items: sorted() in C beats heapq.nlargest's Python loop (3x at 20)


def _largest(n: int, items: Sized, key: Callable) -> list:
    """Return heapq.nlargest(n, items, key) (the same list: sorted() keeps ties in order)."""
    if len(items) <= SORT_UP_TO:
        return sorted(items, key=key, reverse=True)[:n]
    return heapq.nlargest(n, items, key=key)


def _best(scores: dict, m: int) -> tuple:
    """Return ([(score, id)] of the m best of {id: score}, in no order, the best score left
    out or 0.0). All of them, unsorted, when they are m or fewer."""
    if len(scores) <= m:
        return [(a, d) for d, a in scores.items()], 0.0
    items = _largest(m + 1, scores.items(), SECOND_ITEM)
    return [(a, d) for d, a in items[:m]], items[m][1]


class _Match:
    """One segment's candidates for a query, with approximate scores (stored impacts)."""

    def __init__(self, seg, comps: list, hi: float, scores: dict | None = None, mask=None):
        self.seg, self.comps, self.hi = seg, comps, hi
        self.scores = scores  # {id: approximate score}, or None: the one-word fast path
        self.total = len(scores) if scores is not None else 0
        self.mask = mask  # the one-word fast path within a reach: its SegmentMask

    def top(self, m: int) -> tuple:
        """Return ([(approx, id)] of the m best, in no order, bound on the approx of every
        other candidate). A rare word's few candidates are all taken, unsorted."""
        if self.scores is not None:
            return _best(self.scores, m)
        return self._top_single(m)

    def count_single(self) -> None:
        """Count the notes holding the word (body or title), deleted ones aside (and, within
        a reach, the ones outside it)."""
        mask = self.mask
        body = title = None
        for comp in self.comps:
            if comp[3] == 0:
                body = comp
            else:
                title = comp
        self.body, self.title = body, title
        self.title_scores: dict = {}
        self.deleted = self.seg.deleted if mask is None else ()  # a mask holds live notes
        if body is None:
            self.body_at: Sequence = ()
        elif mask is None:
            self.body_at = range(len(body[1]))
        else:
            self.body_at = mask.positions(body[1])
        total = len(self.body_at) - (body[5] if body and mask is None else 0)
        held = mask.mask if mask is not None else None
        deleted = self.deleted
        if title:
            w, ids, imps = title[:3]
            for d, imp in zip(ids, imps):
                if d in deleted or (held is not None and not held[d]):
                    continue
                self.title_scores[d] = w * imp
                if body is None or sorted_position(body[1], d) < 0:
                    total += 1
        self.total = total

    def _top_single(self, m: int) -> tuple:
        scores = dict(self.title_scores)
        bound = 0.0
        if self.body:
            w, ids, imps = self.body[:3]
            deleted = self.deleted
            want = m + len(scores) + len(deleted) + 1
            idx = self.body_at
            if want < len(idx):
                idx = _largest(want, idx, imps.__getitem__)
                bound = w * imps[idx[-1]]
            taken = set()
            for i in idx:
                d = ids[i]
                taken.add(d)
                if d not in deleted:
                    scores[d] = scores.get(d, 0.0) + w * imps[i]
            for d in self.title_scores:
                if d not in taken:
                    i = sorted_position(ids, d)
                    if i >= 0:
                        scores[d] += w * imps[i]
        top, beyond = _best(scores, m)
        return top, max(bound, beyond)

    def exact(self, d: int, avg: tuple) -> float:
        seg, score = self.seg, 0.0
        for w, ids, imps, f, *_ in self.comps:
            i = sorted_position(ids, d)
            if i >= 0:
                score += w * exact_tf(imps[i], seg.dl(d, f), seg.avg_then(d, f), avg[f])
        return score


def _note_key(path: str, sig: tuple, stable: bool = False) -> int:
    """Hash a note's path and (size, mtime) into 64 bits (blake2b where str hashes have 32:
    100,000 notes would hold a pair of paths whose hashes collide; and when the key is
    kept on disk: str hashes differ from one process to the next)."""
    if sys.hash_info.width >= 64 and not stable:
        return hash((path, *sig))
    text = f"{path}\0{sig[0]}\0{sig[1]}".encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little", signed=True)


class _NoteTexts(Sequence):
    """The indexed notes as (path, title, text), each text read from its file when asked
    (its first MAX_SCAN_CHARS characters)."""

    def __init__(self, index: SearchIndex, entries: list):
        self._index = index
        self._entries = entries  # (path, segment, id)
        self.paths = [e[0] for e in entries]

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, i: int) -> IndexedNote:
        return self._index._document(*self._entries[i])


class SearchIndex:
    """The search index: segment files read in place plus one segment in memory.

    Thread-safe. SearchIndex() lives in memory only; SearchIndex.open(state_dir, notes) keeps
    its segments in <state_dir>/index/ and reads note texts (for snippets and moves) through
    the note store. Plugins and providers use the read methods, never the internals.
    """

    PAIR_REWRITE_NOTES = 10_000  # a file this big without pair lists is written again with them
    PAIR_REWRITE_RETRY = 3600.0  # seconds before a file whose rewrite failed is tried again
    # a conflict copy's score is scaled by this: it ranks below the note it came from (whose
    # text it shares), yet is found by what only it holds
    CONFLICT_COPY_WEIGHT = 0.5

    def __init__(self, folder: Path | None = None, notes: NoteStore | None = None):
        self._lock = threading.RLock()
        self.folder = folder  # <state>/index, or None: in memory only
        self.commit_file = folder.parent / "index.cache" if folder else None
        self.notes = notes
        self._base = os.path.join(str(notes.base), "") if notes is not None else ""  # ends in /
        self._segs: list = []  # DiskSegment, or MemorySegment not yet written; oldest first
        self._merger = None  # the helper process writing merges, while they run
        self._merger_lock = threading.RLock()  # one merge at a time (and through it)
        self._pair_rewrites: dict = {}  # file name -> when it was last picked to get pair lists
        self._live = MemorySegment()
        self._texts = TextCache()  # the texts snippets were cut from lately
        self._masks = MaskCache()  # which notes of each segment the reaches searched hold
        self.generation = 0  # bumps on every change
        # (generation it holds for, {folder: notes beneath it}): rebuilt after bulk changes,
        # kept up to date by single adds and removals (folder_counts)
        self._folder_counts: tuple = (-1, None)
        self._touched: dict = {}  # path -> generation of its last change (for bulk_add)
        self._bulks = 0
        self._names = itertools.count(1)
        self._commit_lock = threading.RLock()
        self._sync_lock = threading.Lock()
        self._dirty = False  # the commit file is behind
        self._flushed = time.monotonic()
        self._unverified: list = []
        self._stems: dict | None = None  # word -> stem, shared by the batches of one sync
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None

    # -- changing ------------------------------------------------------------------------

    def _all(self) -> list:
        return [*self._segs, self._live]

    def _averages(self, segs: list | None = None) -> tuple:
        segs = segs or self._all()
        n = sum(s.n - len(s.deleted) for s in segs)
        if not n:
            return 1.0, 1.0
        return tuple(max(sum(s.lens[f] - s.del_lens[f] for s in segs) / n, 1.0) for f in (0, 1))

    def _changed(self, path: str) -> None:
        self._texts.drop(path)
        self.generation += 1
        if len(self._touched) > 10_000 and not self._bulks:
            self._touched.clear()
        self._touched[path] = self.generation

    def _locate(self, path: str):
        for seg in reversed(self._all()):
            d = seg.find(path)
            if d is not None:
                return seg, d
        return None

    def _drop(self, path: str) -> bool:
        found = self._locate(path)
        if found:
            found[0].delete(found[1])
            if isinstance(found[0], DiskSegment):
                self._dirty = True  # the commit file's deletions are behind
        return found is not None

    def add(self, path: str, text: str, size: int, mtime: int) -> None:
        """Index (or re-index) one note."""
        with self._lock:
            doc = self._live.vocab.analyse(path, text, size, mtime)
            was = self.generation
            existed = self._drop(path)
            self._live.add(doc, self._averages())
            self._changed(path)
            self._recount(path, 0 if existed else 1, was)
            full = self._live.n >= FLUSH_DOCS or self._live.tokens >= FLUSH_TOKENS
        if full:
            self._wake.set()

    def remove(self, path: str) -> bool:
        with self._lock:
            was = self.generation
            if not self._drop(path):
                return False
            self._changed(path)
            self._recount(path, -1, was)
            return True

    def _recount(self, path: str, delta: int, was: int) -> None:
        """Keep the folder counts current through one change made at generation `was`
        (under the lock; counts of another generation are left to be rebuilt)."""
        at, counts = self._folder_counts
        if counts is None or at != was:
            return
        folder = path
        while "/" in folder:
            folder = folder.rpartition("/")[0]
            counts[folder] += delta
        self._folder_counts = (self.generation, counts)

    def folder_counts(self) -> Mapping:
        """Return {folder path: notes beneath it, at any depth}: kept up to date by single
        changes, counted again from the index only after bulk ones."""
        with self._lock:
            at, counts = self._folder_counts
            if counts is not None and at == self.generation:
                return counts
            generation, snapshot = self.generation, self._snapshot()
        counts = collections.Counter()
        for path, _, _ in self._entries(snapshot):
            folder = path
            while "/" in folder:
                folder = folder.rpartition("/")[0]
                counts[folder] += 1
        with self._lock:
            if self.generation == generation:
                self._folder_counts = (generation, counts)
        return counts

    def move(self, old: str, new: str, size: int, mtime: int) -> None:
        """Index a moved note under its new path (its text is read from there)."""
        text = self._read(new)
        with self._lock:
            if self._locate(old) is None:
                return
            self.remove(old)
            if text is not None:
                self.add(new, text, size, mtime)

    def bulk_add(self, items: list, since: int, replace: Container | None = None) -> int:
        """Index many (path, text, size, mtime) at once; skip paths changed after generation
        `since` (read before the texts were). replace: the paths that may be indexed already
        (None: any); the others are not looked for. Return how many were indexed.

        A large batch becomes a segment file of its own (analysed without the lock).
        """
        with self._lock:
            self._bulks += 1
        try:
            if len(items) < 64 or (self.folder is None and len(items) < FLUSH_DOCS):
                count = 0
                for item in items:
                    with self._lock:
                        if self._touched.get(item[0], -1) <= since:
                            self.add(*item)
                            count += 1
                return count
            batch = analyse_batch(items, self._stems if self._stems is not None else {})
            new = None
            if self.folder is not None:
                new = self._write(
                    functools.partial(write_batch, docs=batch[1], vocab=batch[0], avg=batch[2])
                )
            if new is None:  # in memory only, or a full disk: keep it in memory
                new = _memory_segment(*batch)
            return self._add_segment(new, since, replace)
        finally:
            with self._lock:
                self._bulks -= 1
            self._wake.set()

    def _add_segment(self, new, since: int, replace: Container | None) -> int:
        """Add a segment of (re)read notes: drop their older entries, and any of its own
        that a change after generation `since` made stale; commit. Return its live notes."""
        with self._lock:
            count = 0
            for d in range(new.n):
                path = new.path(d)
                if self._touched.get(path, -1) > since:
                    new.delete(d)
                    continue
                if replace is None or path in replace:
                    self._drop(path)
                count += 1
            self._segs.append(new)
            self.generation += 1
            self._dirty = True
        self._commit()
        return count

    # -- reading: what plugins and providers may ask (they never touch the lock) ---------

    def title_of(self, path: str) -> str | None:
        """Return the indexed title of a note, None when it is not indexed."""
        with self._lock:
            found = self._locate(path)
            return found[0].title(found[1]) if found else None

    def titles(self, paths: Iterable[str]) -> dict:
        """Return {path: indexed title} for those of paths that are indexed."""
        with self._lock:
            out = {}
            for path in paths:
                found = self._locate(path)
                if found:
                    out[path] = found[0].title(found[1])
            return out

    def _snapshot(self) -> list:
        """Return [(segment, its live (path, id) or None, its deleted ids)] (under the lock)."""
        return [
            (s, s.live() if isinstance(s, MemorySegment) else None, set(s.deleted))
            for s in self._all()
        ]

    @staticmethod
    def _entries(snapshot: list) -> Iterable:
        """Yield (path, segment, id) of every live note of a snapshot (no lock needed)."""
        for seg, items, deleted in snapshot:
            if items is not None:
                for path, d in items:
                    yield path, seg, d
            else:
                for d in range(seg.n):
                    if d not in deleted:
                        yield seg.path(d), seg, d

    def paths(self) -> list:
        """Return the indexed note paths."""
        with self._lock:
            snapshot = self._snapshot()
        return [path for path, _, _ in self._entries(snapshot)]

    def documents(self) -> tuple:
        """Return (generation, [(path, title, text)]): a snapshot to compute from unlocked.

        The texts are read from the files as the list is walked (the first MAX_SCAN_CHARS
        characters of each), so the snapshot costs memory for the paths only.
        """
        with self._lock:
            generation, snapshot = self.generation, self._snapshot()
        return generation, _NoteTexts(self, list(self._entries(snapshot)))

    @property
    def reading(self) -> bool:
        """Whether many notes are being read in at once (a first build, a restart's check)."""
        return self._bulks > 0

    def note_keys(self, stable: bool = False) -> tuple:
        """Return (generation, an iterator of (key, path, read) over every indexed note): the
        key an int that changes with the note's file (its path, size and mtime hashed; the
        same in every process when `stable`, for a key kept on disk), read()
        its (path, title, text) as documents() gives it, or None when the file cannot be read
        now. For callers that keep what they made of each note and read again only what
        changed: they keep nothing under a key of None (a note changed in the last
        ReadCache.RACY_SECONDS: a second save in the same clock tick, of the same size, would
        leave its key as it was) and nothing of a note read() could not read."""
        with self._lock:
            generation, snapshot = self.generation, self._snapshot()
        settled = time.time_ns() - int(ReadCache.RACY_SECONDS * 1e9)

        def keyed(path: str, seg, d: int) -> tuple:
            sig = seg.sig(d)
            key = _note_key(path, sig, stable) if sig[1] < settled else None
            return key, path, functools.partial(self._document, path, seg, d, None)

        return generation, (keyed(*entry) for entry in self._entries(snapshot))

    def document(self, path: str) -> IndexedNote | None:
        """Return (path, title, text) of an indexed note (as documents() gives it), or None."""
        with self._lock:
            found = self._locate(path)
        return None if found is None else self._document(path, *found)

    def _document(self, path: str, seg, d: int, unread: Any = "") -> IndexedNote | None:
        """Return (path, title, text) of an indexed note; its text `unread` ("") when the
        file cannot be read, or None itself for an `unread` of None."""
        text = self._read(path, 4 * MAX_SCAN_CHARS)
        if text is None:
            return None if unread is None else IndexedNote(path, seg.title(d), unread)
        return IndexedNote(path, seg.title(d), text[:MAX_SCAN_CHARS])

    def stem_weights(self, stems: Iterable[str]) -> dict:
        """Return {stem: its IDF in note bodies} for the stems that are in the index."""
        stems = list(dict.fromkeys(stems))
        with self._lock:
            segs = self._all()
            n = max(self._count(segs), 1)
            _, _, dfs = self._terms(segs, n, stems)
            return {s: bm25_idf(n, dfs[s][0]) for s in stems if dfs[s][0] or dfs[s][1]}

    # -- state -------------------------------------------------------------------------

    def signature(self) -> dict:
        """Return {path: (size, mtime_ns)} of what is indexed."""
        with self._lock:
            snapshot = self._snapshot()
        return {path: seg.sig(d) for path, seg, d in self._entries(snapshot)}

    @staticmethod
    def _count(segs: list) -> int:
        return sum(s.n - len(s.deleted) for s in segs)

    def stats(self) -> dict:
        with self._lock:
            segs = self._all()
            terms = sum(s.nd if isinstance(s, DiskSegment) else len(s.vocab.stems) for s in segs)
            return {"documents": self._count(segs), "terms": terms, "segments": len(segs)}

    def _check(self, files: dict) -> tuple:
        """Compare {path: (size, mtime_ns)} of the notes on disk with the index: return
        (paths to read, paths gone, the paths to read that are indexed); `files`
        keeps only the paths to read. The paths are the scan's own strings: at 100,000
        notes read again, a copy of each from the index held 10 MB more through the read."""
        with self._lock:
            snapshot = self._snapshot()
        removed, indexed = [], 0
        for path, seg, d in self._entries(snapshot):
            sig = files.get(path)
            if sig is None:
                removed.append(path)
            elif sig == seg.sig(d):
                del files[path]
            else:
                files[path] = (*sig, True)  # (a new value: the dict keeps the scan's key)
                indexed += 1
        known = {path for path, sig in files.items() if len(sig) > 2} if indexed else set()
        return list(files), removed, known

    def sync(self, notes: NoteStore | None = None, observe: Callable | None = None) -> dict:
        """Bring the index in line with the files: re-read what changed, drop what is gone.

        The first sync also checks each segment file against its checksum; a damaged one
        is dropped, and its notes are read again. observe(changed, removed, known, present)
        hears what changed before the index takes it (history and the change feed).
        """
        notes = notes or self.notes
        with self._sync_lock, EarlyHelper(lambda: self._start_helper(notes)) as early:
            started = time.perf_counter()
            self.verify()
            had_notes = bool(self.stats().get("documents"))
            # a first build's helper process starts while the scan goes on, once it has
            # found more than a batch of notes (it takes a fifth of a second to start)
            files = notes.scan(None if had_notes else early.start, BULK_CHUNK_NOTES + 1)
            present = list(files)
            changed, removed, known = self._check(files)
            # `known` empty means "the index was rebuilt" to observe(); a None entry keeps it
            # truthy when the index held notes but none of these changed ones. Many changes:
            # the history's copies are synced once, not each on its own. On a first start
            # (no index, no history) the index is built before they are made, so searches
            # answer sooner: they are only the starting point for later outside edits
            seen = known
            if had_notes:
                seen.add(None)
            many = len(changed) > 50 or (bool(present) and not had_notes)
            late = not had_notes and notes.history_is_empty()  # a first start
            if observe is not None and not late:
                with deferred_sync() if many else contextlib.nullcontext():
                    observe(changed, removed, seen, present)
            gone = 0  # a note created again while the scan ran is kept, not counted
            for path in removed:
                with notes.locked(path):
                    if not notes.exists(path):
                        gone += self.remove(path)
            if len(changed) > 50:
                self._bulk_read(notes, changed, known, files, had_notes, early.take())
            else:
                for path in changed:
                    with notes.locked(path):  # no API write can slip in between
                        for item in read_items(notes, [path]):
                            self.add(*item)
            took = time.perf_counter() - started
            if observe is not None and late:
                with deferred_sync() if many else contextlib.nullcontext():
                    observe(changed, removed, seen, present)
            if changed or gone:
                log.info("index: %d notes read, %d removed in %.2f s", len(changed), gone, took)
            return {"read": len(changed), "removed": gone, "seconds": round(took, 3)}

    def _bulk_read(
        self,
        notes: NoteStore,
        paths: list,
        known: set,
        sigs: dict,
        aside: bool = False,
        helper: Any = None,
    ) -> None:
        """Read and index many notes, a segment file per batch (BULK_CHUNK_NOTES notes or
        BULK_CHUNK_CHARS bytes, by their (size, ...) in sigs); with two cores or more, a
        helper process analyses every other batch (index_helper), so a first build takes
        two cores. `aside`: the index answers meanwhile (a restart's check found many notes
        changed: a restored backup, a `touch` of everything), so the helper analyses every
        batch and this process only installs its files: analysing a batch here took 25 MB
        more at its peak, and searches shared the GIL with it (100,000 notes: 34 -> 46 s).
        `helper`: one started already (EarlyHelper), used instead of a new one."""
        batches: deque = deque([[]])
        chars = 0
        for path in paths:
            if len(batches[-1]) >= BULK_CHUNK_NOTES or chars >= BULK_CHUNK_CHARS:
                batches.append([])
                chars = 0
            batches[-1].append(path)
            chars += sigs[path][0]
        with self._lock:
            self._bulks += 1
        self._stems = {}
        if helper is not None and len(batches) < 2:
            helper.stop()
            helper = None
        elif helper is None and len(batches) > 1:
            helper = self._start_helper(notes)
        progress = _Progress(len(paths))
        try:
            with progress:
                pump = None
                if helper is not None:
                    pump = threading.Thread(
                        target=self._pump, args=(helper, batches, known, progress), daemon=True
                    )
                    pump.start()
                for pumping in (True, False):
                    if pumping and pump is not None and aside:
                        pump.join()  # the batches it gave back are done on the second pass
                        continue
                    while not self._stop.is_set():  # closing: the next sync goes on
                        try:
                            batch = batches.popleft()
                        except IndexError:  # the helper took the last one
                            break
                        since = self.generation
                        progress.add(self.bulk_add(read_items(notes, batch), since, known))
                    if pumping and pump is not None:
                        pump.join()  # batches it gave back are done on the second pass
        finally:
            self._stems = None
            if helper is not None:
                self._keep_for_merges(helper, usable=not progress.helper_failed)
            with self._lock:
                self._bulks -= 1
            self._wake.set()

    def _keep_for_merges(self, helper: IndexHelper, usable: bool) -> None:
        """Hand a bulk's helper process on to the merges that follow it (the next maintain
        stops it when none is due), or stop it: a process start less (a tenth of a 10k
        first start's CPU)."""
        if usable and helper.alive() and self._merger_lock.acquire(blocking=False):
            try:
                if self._merger is None and not self._stop.is_set():
                    self._merger = helper
                    return
            finally:
                self._merger_lock.release()
        helper.stop()

    def _start_helper(self, notes: NoteStore, merging: bool = False) -> IndexHelper | None:
        """Start a helper process (search/helper.py); None where it cannot help."""
        if self.folder is None:
            return None
        return IndexHelper.start(notes.root, self.folder, merging)

    def _pump(self, helper: IndexHelper, batches: deque, known: set, progress: _Progress) -> None:
        """Hand batches to the helper process and add the segment files it writes; on any
        trouble give the batch back (the caller indexes it) and stop."""
        while not self._stop.is_set():
            try:
                batch = batches.popleft()
            except IndexError:
                return
            since = self.generation
            try:
                name = helper.analyse(batch)
                seg = self._install(name) if name else None
                if name and seg is None:
                    raise ValueError("its file is unusable")
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning("index helper process: %s; indexing on one core", e)
                batches.appendleft(batch)
                progress.helper_failed = True
                return
            if seg is not None:
                progress.add(self._add_segment(seg, since, known))
                progress.helped += 1

    def _install(self, name: str):
        """Rename a segment file the helper wrote into place; return it opened, or None."""
        tmp = Path(name)
        if tmp.parent != self.folder or not tmp.name.startswith(TEMP_PREFIX):
            return None
        final = self.folder / f"{next(self._names):08d}.seg"
        try:
            os.replace(tmp, final)
            fsync_dir(self.folder)
            return DiskSegment(final)
        except (OSError, IndexFileError) as e:
            log.warning("index: a helper's segment file is unusable (%s)", e)
            with contextlib.suppress(OSError):
                final.unlink()
            return None

    # -- searching -----------------------------------------------------------------------

    def _terms(self, segs: list, n: int, stems: list, masks: ReachMasks | None = None) -> tuple:
        """Return ({stem: [key per segment]}, {stem: (body weight, title weight)},
        {stem: [live body df, live title df]}); within a reach (`masks`), its notes' df."""
        per_seg = [seg.keys(stems) for seg in segs]
        keys, weights, dfs = {}, {}, {}
        for j, s in enumerate(stems):
            ks = [found[j] for found in per_seg]
            df = [0, 0]
            if masks is not None:
                df = [sum(masks.df(si, k, f) for si, k in enumerate(ks)) for f in (0, 1)]
                ks = [
                    k if k is not None and (masks.df(si, k, 0) or masks.df(si, k, 1)) else None
                    for si, k in enumerate(ks)
                ]
            for seg, k in zip(segs, ks):
                if k is not None and masks is None:
                    for f in (0, 1):
                        p = seg.postings(k, f)
                        if p:
                            df[f] += len(p[0]) - seg.del_df[f].get(k, 0)
            keys[s], dfs[s] = ks, df
            weights[s] = (bm25_weight(n, df[0], "body"), bm25_weight(n, df[1], "title"))
        return keys, weights, dfs

    def _expand(self, segs: list, n: int, prefix: str, masks: ReachMasks | None = None) -> list:
        """Return up to MAX_PREFIX_TERMS stems of words starting with prefix, commonest first
        (of the first 16 * MAX_PREFIX_TERMS such words, in order; within a reach, its)."""
        cap = 16 * MAX_PREFIX_TERMS
        words: dict = {}
        for seg in segs:
            for w, s in seg.prefix_words(prefix, cap):
                words.setdefault(w, s)
        stems = sorted({words[w] for w in sorted(words)[:cap]})
        _, _, dfs = self._terms(segs, n, stems, masks)
        alive = [s for s in stems if dfs[s][0] or dfs[s][1]]
        alive.sort(key=lambda s: (-dfs[s][0], s))
        return alive[:MAX_PREFIX_TERMS]

    def _resolve(self, segs: list, n: int, alt: tuple, masks: ReachMasks | None = None) -> tuple:
        kind = alt[0]
        if kind == "prefix":
            return kind, self._expand(segs, n, alt[1], masks)
        return kind, [alt[1]] if kind == "word" else list(alt[1])

    @staticmethod
    def _comps(seg, si: int, stems: list, keys: dict, weights: dict) -> list:
        """Return the scoring components of stems in a segment:
        (weight, ids, impacts, field, key, deleted holding it)."""
        out = []
        for s in stems:
            k = keys[s][si]
            if k is None:
                continue
            for f in (0, 1):
                p = seg.postings(k, f)
                if p:
                    out.append((weights[s][f], p[0], p[1], f, k, seg.del_df[f].get(k, 0)))
        return out

    def _alt_docs(self, seg, si: int, alt: tuple, keys: dict, within: set | None) -> set:
        """Return the notes of a segment matching one alternative (among `within`)."""
        kind, stems = alt
        ks = [keys[s][si] for s in stems]
        if kind == "phrase":
            return set() if None in ks else phrase_docs(seg, ks, within)
        return word_docs(seg, ks, within)

    @staticmethod
    def _estimate(seg, si: int, clause: list, keys: dict) -> int:
        total = 0
        for kind, stems in clause:
            sizes = []
            for s in stems:
                k = keys[s][si]
                size = 0
                if k is not None:
                    for f in (0, 1):
                        p = seg.postings(k, f)
                        size += len(p[0]) if p else 0
                sizes.append(size)
            total += (min(sizes) if kind == "phrase" else sum(sizes)) if sizes else 0
        return total

    def _match(self, seg, si, clauses, excludes, keys, weights, folder, hi, mask) -> _Match | None:
        order = sorted(clauses, key=lambda c: self._estimate(seg, si, c, keys))
        cands = None
        for clause in order:
            docs: set = set()
            for alt in clause:
                docs |= self._alt_docs(seg, si, alt, keys, cands)
            cands = docs
            if not cands:
                return None
        for alt in excludes:
            cands -= self._alt_docs(seg, si, alt, keys, cands)
        cands = cands - seg.deleted
        if mask is not None and cands:  # the reach's notes only
            held = mask.mask
            cands = {d for d in cands if held[d]}
        if folder and cands:  # the folders asked for (their prefixes): any of them
            cands = set().union(*(seg.in_folder(cands, prefix) for prefix in folder))
        if not cands:
            return None
        comps = [
            c
            for clause in clauses
            for alt in clause
            for c in self._comps(seg, si, alt[1], keys, weights)
        ]
        scores = dict.fromkeys(cands, 0.0)
        ordered = None
        for w, ids, imps, *_ in comps:
            if len(ids) > 4 * len(cands):  # look each candidate up, left to right
                ordered = ordered or sorted(cands)
                at, end = 0, len(ids)
                for d in ordered:
                    at = bisect.bisect_left(ids, d, at)
                    if at == end:
                        break
                    if ids[at] == d:
                        scores[d] += w * imps[at]
            else:
                for d, imp in zip(ids, imps):
                    if d in scores:
                        scores[d] += w * imp
        return _Match(seg, comps, hi, scores)

    @staticmethod
    def _hi(seg, avg: tuple) -> float:
        """Return the most a segment's stored impacts can rise with today's averages."""
        return max(1.0, *(avg[f] / max(seg.avg_range[f][0], 1.0) for f in (0, 1))) * (1 + SCORE_EPS)

    def _matches(self, segs, n, avg, clauses, excludes, folder, masks=None) -> list:
        """Return ([_Match] of the segments holding candidates, the query's keys): among the
        notes of `folder` (prefixes; () every note) and, with `masks`, of a reach."""
        stems = sorted({s for clause in [*clauses, excludes] for _, ss in clause for s in ss})
        keys, weights, _ = self._terms(segs, n, stems, masks)
        single = (
            (len(clauses) == 1 and len(clauses[0]) == 1 and clauses[0][0][0] == "word")
            and not excludes
            and not folder
        )
        matches = []
        for si, seg in enumerate(segs):
            hi = self._hi(seg, avg)
            mask = masks.masks[si] if masks is not None else None
            if single:
                comps = self._comps(seg, si, clauses[0][0][1], keys, weights)
                if comps:
                    mt = _Match(seg, comps, hi, mask=mask)
                    mt.count_single()
                    if mt.total:
                        matches.append(mt)
            else:
                mt = self._match(seg, si, clauses, excludes, keys, weights, folder, hi, mask)
                if mt:
                    matches.append(mt)
        return matches, keys

    def _weight(self, path: str) -> float:
        """Return what a note's score is scaled by: CONFLICT_COPY_WEIGHT for a conflict
        copy (the store's record says which notes are), else 1."""
        notes = self.notes
        if notes is not None and notes.copies.of(path) is not None:
            return self.CONFLICT_COPY_WEIGHT
        return 1.0

    @staticmethod
    def _rank(matches: list, k: int, avg: tuple, weigh: Callable | None = None) -> list:
        """Return the k best [(exact score, path, segment, id)], best first (then by path);
        weigh(path), at most 1, scales a note's exact score.

        Candidates are rescored in the order of their approximate scores until no other one
        can reach the k-th exact score (exact <= approx * hi).
        """
        if k <= 0 or not matches:
            return []
        hi = max(mt.hi for mt in matches)
        m, cache = k + 4, {}
        while True:
            pool, outside = [], 0.0
            for mt in matches:
                top, bound = mt.top(m)
                pool += [(a, mt, d) for a, d in top]
                outside = max(outside, bound * mt.hi)
            pool.sort(key=FIRST_ITEM, reverse=True)
            found, heap = [], []
            for a, mt, d in pool:
                if len(heap) >= k and a * hi < heap[0]:
                    break
                score = cache.get((id(mt), d))
                if score is None:
                    score = mt.exact(d, avg) * (weigh(mt.seg.path(d)) if weigh else 1.0)
                    cache[(id(mt), d)] = score
                found.append((score, mt, d))
                if len(heap) < k:
                    heapq.heappush(heap, score)
                else:
                    heapq.heappushpop(heap, score)
            if outside and (len(heap) < k or outside >= heap[0]):
                m *= 4
                continue
            if not found:
                return []
            found.sort(key=FIRST_ITEM, reverse=True)
            last = found[min(k, len(found)) - 1][0]  # equal scores are ordered by path
            best = [x for x in found if x[0] >= last]
            ranked = [(score, mt.seg.path(d), mt.seg, d) for score, mt, d in best]
            ranked.sort(key=lambda x: (-x[0], x[1]))
            return ranked[:k]

    def search(
        self,
        query: Query,
        folder: str | tuple = "",
        limit: int = 20,
        offset: int = 0,
        snippets=True,
        reach: tuple = (),
    ) -> tuple:
        """Return (total, [(path, title, score, snippet)]) best first (snippets "" when
        not asked for), among the notes of `folder` (a folder, or several: () or "" every
        note). `reach`: the folders a principal that sees part of the notes reaches (()
        everything): only their notes are searched, and they alone give BM25 its statistics
        (N, df, average lengths), so nothing outside them moves a score or a count."""
        within = folder_prefixes(reach)
        prefix = folder_prefixes(folder)
        if within and set(prefix) == set(within):
            prefix = ()  # the reach itself: its masks filter
        with self._lock:
            segs = self._all()
            masks = self._masks.of(segs, within) if within else None
            if masks is None:
                n, avg = self._count(segs), self._averages(segs)
            else:
                n, avg = masks.count(), masks.averages()
            clauses = [[self._resolve(segs, n, alt, masks) for alt in c] for c in query.clauses]
            excludes = [self._resolve(segs, n, alt, masks) for alt in query.excludes]
            matches, keys = self._matches(segs, n, avg, clauses, excludes, prefix, masks)
            total = sum(mt.total for mt in matches)
            ranked = self._rank(matches, offset + limit, avg, self._weight)[offset:]
            if not snippets:
                return total, [
                    (path, seg.title(d), round(sc, 4), "") for sc, path, seg, d in ranked
                ]
            hits = self._snippet_parts(
                segs, [(sc, p, seg, d) for sc, p, seg, d in ranked], clauses, keys, query
            )
        return total, [(p, t, s, self._snippet(p, toks, nd)) for p, t, s, toks, nd in hits]

    def _snippet_parts(self, segs: list, ranked: list, clauses: list, keys: dict, query) -> list:
        needles: dict = {}
        hits = []
        for score, path, seg, d in ranked:
            if seg not in needles:
                needles[seg] = query_needles(seg, segs.index(seg), clauses, keys, query.typed)
            toks = (seg.toks(d, 0), seg.sig(d))
            hits.append((path, seg.title(d), round(score, 4), toks, needles[seg]))
        return hits

    def snippets(self, query: Query, paths: list) -> dict:
        """Return {path: snippet} of the query's words in notes (hybrid search's hits that
        came from the words)."""
        with self._lock:
            segs = self._all()
            n = self._count(segs)
            clauses = [[self._resolve(segs, n, alt) for alt in c] for c in query.clauses]
            stems = sorted({s for clause in clauses for _, ss in clause for s in ss})
            keys, _, _ = self._terms(segs, n, stems)
            found = [(0.0, p, *self._locate(p)) for p in paths if self._locate(p) is not None]
            hits = self._snippet_parts(segs, found, clauses, keys, query)
        return {p: self._snippet(p, toks, nd) for p, _, _, toks, nd in hits}

    def excluded(self, excludes: list, paths: list) -> set:
        """Return the paths among `paths` holding any of a query's -exclusions."""
        out: set = set()
        with self._lock:
            segs = self._all()
            n = self._count(segs)
            alts = [self._resolve(segs, n, alt) for alt in excludes]
            keys, _, _ = self._terms(segs, n, sorted({s for _, ss in alts for s in ss}))
            for path in paths:
                found = self._locate(path)
                if found is not None:
                    seg, d = found
                    si = segs.index(seg)
                    if any(self._alt_docs(seg, si, alt, keys, {d}) for alt in alts):
                        out.add(path)
        return out

    def note_key(self, path: str) -> int | None:
        """Return a note's stable key as note_keys(stable=True) gives it (None: unknown or
        changed just now)."""
        with self._lock:
            found = self._locate(path)
        if found is None:
            return None
        sig = found[0].sig(found[1])
        settled = time.time_ns() - int(ReadCache.RACY_SECONDS * 1e9)
        return _note_key(path, sig, stable=True) if sig[1] < settled else None

    def _snippet(self, path: str, toks: tuple, needles: dict) -> str:
        """Cut a note's snippet; toks: (its term chars, its (size, mtime)) as indexed."""
        toks, sig = toks
        text = self._texts.get(path, sig)
        if text is None:
            text = self._read(path)
            if text is None:
                return ""
            text = unicodedata.normalize("NFC", text)
            self._texts.put(path, sig, text)
        return body_snippet(text, toks, needles)

    def _read(self, path: str, limit: int = -1) -> str | None:
        """Return a note's text from its file (up to limit bytes), None when unreadable."""
        if self.notes is None:
            return None
        flags = os.O_RDONLY | NOFOLLOW_NONBLOCK
        try:
            try:  # the common case without pathlib: the name on disk is the path
                fd = os.open(self._base + path, flags)
            except FileNotFoundError:
                if path.isascii():
                    return None
                fd = os.open(self.notes.on_disk(path), flags)  # an NFD name on disk
            try:  # os.read: no file object for the one or two reads of a note
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    return None
                size = st.st_size
                size = size if limit < 0 else min(size, limit)
                data = os.read(fd, size)
                while len(data) < size:  # a growing file, or a read cut short
                    more = os.read(fd, size - len(data))
                    if not more:
                        break
                    data += more
            finally:
                os.close(fd)
        except (OSError, ValueError):
            return None
        return data.decode("utf-8", "replace")

    def search_any(self, stems: list, limit: int) -> list:
        """Return the top (path, title, text, score) of notes holding any of the stems.

        A term in more than half the notes carries no weight, like a stopword. The texts
        of the hits are read from their files.
        """
        with self._lock:
            segs = self._all()
            n, avg = self._count(segs), self._averages(segs)
            stems = list(dict.fromkeys(stems))
            keys, weights, dfs = self._terms(segs, n, stems)
            matches = []
            for si, seg in enumerate(segs):
                common = [s for s in stems if n >= 20 and max(dfs[s]) > n // 2]
                comps = [
                    c
                    for s in stems
                    for c in self._comps(seg, si, [s], keys, weights)
                    if not (s in common and dfs[s][c[3]] > n // 2)
                ]
                if not comps:
                    continue
                scores: dict = {}
                for w, ids, imps, *_ in comps:
                    for d, imp in zip(ids, imps):
                        scores[d] = scores.get(d, 0.0) + w * imp
                for d in seg.deleted.intersection(scores):
                    del scores[d]
                if scores:
                    matches.append(_Match(seg, comps, self._hi(seg, avg), scores))
            ranked = self._rank(matches, limit, avg, self._weight)
            hits = [(path, seg.title(d), score) for score, path, seg, d in ranked]
        return [(path, title, self._read(path) or "", score) for path, title, score in hits]

    # -- on disk: open, write, commit, merge -----------------------------------------------

    @classmethod
    def open(cls, state_dir: Path, notes: NoteStore | None = None) -> SearchIndex:
        """Return the index kept under state_dir, its segment files opened in place.

        A damaged, foreign or old index is discarded with a log line (the first sync
        rebuilds it); a single damaged segment is dropped and its notes read again.
        """
        folder = state_dir / "index"
        folder.mkdir(mode=0o700, exist_ok=True)
        os.chmod(folder, 0o700)
        index = cls(folder, notes)
        try:
            segs, seq, intact = read_commit(index.commit_file, folder)
        except IndexFileError as e:
            if index.commit_file.exists():
                log.warning("%s: discarded, rebuilding the index", e)
            with contextlib.suppress(OSError):
                index.commit_file.unlink()
            segs, seq, intact = [], 0, True
        keep = {s.name for s in segs}
        for path in folder.iterdir():
            if path.name.endswith(".seg") and path.name not in keep:
                with contextlib.suppress(OSError):
                    path.unlink()
        index._segs = segs
        index._names = itertools.count(seq + 1)
        index._unverified = list(segs)
        index._dirty = not intact
        if segs:
            log.info("index opened: %d notes in %d segments", index._count(segs), len(segs))
        return index

    def _write(self, write: Callable):
        """Write a new segment file with write(file); return it opened, or None when the
        disk is full or failing (the caller keeps what it has) or a merge was cancelled."""
        path = self.folder / f"{next(self._names):08d}.seg"
        try:
            atomic_write(path, write, mode=0o600)
            return DiskSegment(path)
        except MergeCancelled:
            return None
        except (OSError, IndexFileError) as e:
            log.warning("index: could not write segment %s (%s); serving from memory", path.name, e)
            with contextlib.suppress(OSError):
                path.unlink()
            return None

    def flush(self) -> bool:
        """Write the notes held in memory to segment files, then commit; return False when
        some could not be written (they stay in memory and are tried again later)."""
        if self.folder is None:
            return False
        with self._commit_lock:
            with self._lock:
                live = self._live
                if live.n:
                    vocab = live.vocab.copy() if len(live.vocab.stems) < 50_000 else None
                    self._live = MemorySegment(vocab)
                    self._segs.append(live)
                jobs = [
                    (s, set(s.deleted), (s.del_df[0].copy(), s.del_df[1].copy()))
                    for s in self._segs
                    if isinstance(s, MemorySegment)
                ]
            written = True
            for seg, skip, dels in jobs:
                disk = remaps = None
                if seg.n > len(skip):
                    remaps = []
                    disk = self._write(
                        lambda f, seg=seg, skip=skip, dels=dels, out=remaps: out.extend(
                            write_segment(f, [seg], [skip], [dels], folder=self.folder)
                        )
                    )
                    if disk is None:
                        written = False
                        break
                with self._lock:
                    i = self._segs.index(seg)
                    if disk is None:
                        del self._segs[i]
                    else:
                        self._segs[i] = disk
                        for d in seg.deleted - skip:
                            disk.delete(remaps[0][d])
                    self._dirty = True
            self._flushed = time.monotonic()
            self._commit()
            return written

    def _commit(self) -> None:
        """Write the commit file: the segment files and their deletions (atomically)."""
        if self.folder is None:
            return
        with self._commit_lock:
            with self._lock:
                if not self._dirty:
                    return
                entries = [
                    (
                        s.name,
                        len(s.mm),
                        s.crc,
                        array.array("I", sorted(s.deleted)),
                        s.del_df[0].pairs(),
                        s.del_df[1].pairs(),
                        list(s.del_lens),
                    )
                    for s in self._segs
                    if isinstance(s, DiskSegment)
                ]
                self._dirty = False
                seq = next(self._names)
            try:
                write_commit(self.commit_file, entries, seq)
            except OSError as e:
                log.warning("index: could not write %s (%s)", self.commit_file.name, e)
                with self._lock:
                    self._dirty = True

    def _pick_merge(self) -> list:
        """Return segments to merge: one mostly deleted, or those of the smallest size class
        (live notes, in powers of MERGE_FACTOR) that has MERGE_FACTOR of them, or else the
        smallest file of PAIR_REWRITE_NOTES live notes or more written without pair lists
        (0.3's, which no merge may take for long): written again once, with them (a failed
        rewrite waits PAIR_REWRITE_RETRY)."""
        with self._lock:
            segs = [s for s in self._segs if isinstance(s, DiskSegment)]
        tiers = collections.defaultdict(list)
        for s in segs:
            if len(s.deleted) >= MAX_DELETED * s.n:
                return [s]
            live = max(s.n - len(s.deleted), 1024)
            tiers[int(math.log(live / 1024, MERGE_FACTOR) + 1e-9)].append(s)
        for tier in sorted(tiers):
            if len(tiers[tier]) >= MERGE_FACTOR:
                return tiers[tier]
        now, retry = time.monotonic(), self.PAIR_REWRITE_RETRY
        bare = [
            s
            for s in segs
            if "pair_terms" not in s.meta  # (a file of other PAIR_ settings: left to merges)
            and s.n - len(s.deleted) >= self.PAIR_REWRITE_NOTES
            and now - self._pair_rewrites.get(s.name, -retry) >= retry
        ]
        if not bare:
            return []
        pick = min(bare, key=lambda s: s.n)
        self._pair_rewrites[pick.name] = now  # a rewrite that fails waits before the next
        return [pick]

    def merge(self, sources: list) -> bool:
        """Merge segment files into one (without the lock), then swap it in and commit.
        The helper process writes the merged file when it can (merge_elsewhere). One merge
        at a time: two threads could pick the same files."""
        with self._merger_lock:
            return self._merge(sources)

    def _merge(self, sources: list) -> bool:
        with self._lock:
            if any(s not in self._segs for s in sources):  # merged or dropped meanwhile
                return False
            skips = [set(s.deleted) for s in sources]
            dels = [(s.del_df[0].copy(), s.del_df[1].copy()) for s in sources]
        new = remaps = None
        if any(s.n > len(skip) for s, skip in zip(sources, skips)):
            with self._lock:
                avg = self._averages()
            new, remaps = self.merge_elsewhere(sources, skips, dels, avg)
            if new is None and not self._stop.is_set():
                remaps = []
                new = self._write(
                    lambda f: remaps.extend(
                        write_segment(f, sources, skips, dels, self._stop, self.folder, avg)
                    )
                )
            if new is None:
                return False
        with self._commit_lock:
            with self._lock:
                if any(s not in self._segs for s in sources):  # dropped meanwhile: not this one
                    if new is not None:
                        with contextlib.suppress(OSError):
                            new.file.unlink()
                    return False
                at = self._segs.index(sources[0])
                kept = [s for s in self._segs[at:] if s not in sources]
                self._segs[at:] = ([new] if new is not None else []) + kept
                if new is not None:
                    for src, skip, remap in zip(sources, skips, remaps):
                        for d in src.deleted - skip:
                            new.delete(remap[d])
                self._dirty = True
            self._commit()
        for s in sources:
            with contextlib.suppress(OSError):
                s.file.unlink()
        return True

    def merge_elsewhere(self, sources: list, skips: list, dels: list, avg: tuple) -> tuple:
        """Have the helper process write a merge: return (the merged segment, installed,
        and each source's note id map), or (None, None) where it cannot (then the caller
        merges here). A merge is Python from end to end: in this process it would hold the
        GIL for most of every switch interval, and a 100k index's searches measured up to
        17 times slower while one ran; its memory would stay in this process's heap."""
        if not all(isinstance(s, DiskSegment) for s in sources) or self.notes is None:
            return None, None
        if sum(s.n for s in sources) < MERGE_HELPER_NOTES:  # quicker here than a process
            return None, None
        helper = self._merger
        if helper is None or not helper.alive():
            helper = self._merger = self._start_helper(self.notes, merging=True)
            if helper is None:
                return None, None
        name = None
        try:
            name, remaps = helper.merge(sources, skips, dels, avg, self._stop)
            new = self._install(name)
            if new is None:
                raise ValueError("its file is unusable")
            return new, remaps
        except (OSError, ValueError, KeyError, TypeError) as e:
            if not self._stop.is_set():
                log.warning("index helper process: %s; merging in this process", e)
            self._stop_merger()
            if name:
                discard_temp(self.folder, name)
            return None, None

    def _stop_merger(self) -> None:
        """Stop the merging helper (at once when closing); the next merge starts another."""
        with self._merger_lock if not self._stop.is_set() else contextlib.nullcontext():
            helper, self._merger = self._merger, None
        if helper is not None:
            helper.stop(kill=self._stop.is_set())

    def verify(self) -> None:
        """Check the segment files opened at start against their checksums; a damaged one
        is dropped (the sync that follows reads its notes again)."""
        while True:
            with self._lock:
                if not self._unverified:
                    return
                seg = self._unverified.pop()
            try:
                seg.verify()
            except (IndexFileError, OSError) as e:
                log.warning("index segment %s dropped: %s; its notes are read again", seg.name, e)
                with self._lock:
                    if seg in self._segs:
                        self._segs.remove(seg)
                        self.generation += 1
                        self._dirty = True

    def maintain(self, force: bool = False) -> None:
        """Flush, commit and merge as due (the background thread's work; force: now)."""
        live = self._live
        due = force or time.monotonic() - self._flushed >= COMMIT_SECONDS
        pending = any(isinstance(s, MemorySegment) for s in self._segs)
        if live.n >= FLUSH_DOCS or live.tokens >= FLUSH_TOKENS or (due and (live.n or pending)):
            self.flush()
        elif self._dirty and due:
            self._commit()
        merged = False
        try:
            while not self._stop.is_set() and not self._bulks:
                sources = self._pick_merge()
                if not sources or not self.merge(sources):
                    break
                merged = True
        finally:
            self._stop_merger()  # started for these merges: not kept between them
        if merged:
            release_memory()

    def start(self) -> None:
        """Start the background thread that flushes, commits and merges."""
        if self.folder is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="notesvc-index", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(COMMIT_SECONDS / 2)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.maintain()
            except Exception:
                log.exception("index maintenance failed; trying again later")

    def close(self) -> None:
        """Stop the background thread (a merge under way is abandoned) and write what is in
        memory."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(120)
        self._stop_merger()
        if self.folder is not None:
            self.flush()
            self._commit()
