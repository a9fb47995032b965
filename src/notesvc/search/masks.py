"""Reach masks: which notes of each index segment a reach holds, their counts and lengths.

A principal that does not see every note (a person, a folder grant) searches its reach only,
and is scored as if its reach were the whole collection: N, each term's document frequency
and the average field lengths of BM25 are counted over the notes it reaches, so nothing
outside it moves a score, a rank or a prefix's expansion. A reach's mask of a segment is one
byte a note (1: live and inside a reached folder), made from the segment's notes in path
order (a folder is one run of them), kept while the segment lasts (a memory segment's new
notes and every segment's deletions are folded in when seen) and dropped least recently used
first. Filtering a posting list is then a C-level map over it, and a document frequency is
counted once per term and segment.
"""

from __future__ import annotations

import collections
import itertools
import weakref
from collections import deque

MAX_REACHES = 64  # reaches whose masks are kept (a person's grants share one)
MAX_MASK_BYTES = 8 << 20  # and about this many bytes of masks and frequencies in all
MAX_FREQUENCIES = 4096  # document frequencies kept per segment mask
FREQUENCY_BYTES = 160  # what one kept frequency costs (its dict slot, key tuple and ints)


class SegmentMask:
    """One reach's view of one segment: a byte per note (1: live and reached), how many
    notes that is, their summed field lengths, and the document frequencies asked lately."""

    __slots__ = ("dfs", "lens", "live", "mask", "n_at", "zeroed")

    def __init__(self, seg, prefixes: tuple):
        self.mask = bytearray(seg.n)
        for prefix in prefixes:
            deque(map(self.mask.__setitem__, seg.ids_under(prefix), itertools.repeat(1)), 0)
        self.n_at = seg.n
        self.zeroed: set = set()
        self.live = self.mask.count(1)
        self.lens = [sum(itertools.compress(seg.field_lengths(f), self.mask)) for f in (0, 1)]
        self.dfs: dict = {}
        self.refresh(seg, prefixes)

    def refresh(self, seg, prefixes: tuple) -> None:
        """Fold in the notes a memory segment took since, and the deletions of any segment."""
        mask = self.mask
        if seg.n > self.n_at:
            for d in range(self.n_at, seg.n):
                held = seg.path(d).startswith(prefixes)
                mask.append(held)
                if held:
                    self.live += 1
                    self.lens[0] += seg.dl(d, 0)
                    self.lens[1] += seg.dl(d, 1)
            self.n_at = seg.n
            self.dfs.clear()
        if len(seg.deleted) != len(self.zeroed):
            for d in seg.deleted.difference(self.zeroed):
                if d < len(mask) and mask[d]:
                    mask[d] = 0
                    self.live -= 1
                    self.lens[0] -= seg.dl(d, 0)
                    self.lens[1] -= seg.dl(d, 1)
            self.zeroed = set(seg.deleted)
            self.dfs.clear()

    def df(self, seg, key, f: int) -> int:
        """Return how many reached live notes of the segment hold a term in a field."""
        found = self.dfs.get((key, f))
        if found is None:
            p = seg.postings(key, f)
            found = bytes(map(self.mask.__getitem__, p[0])).count(1) if p else 0
            if len(self.dfs) >= MAX_FREQUENCIES:
                self.dfs.clear()
            self.dfs[(key, f)] = found
        return found

    def positions(self, ids) -> list:
        """Return the positions in a posting list of the ids this mask holds."""
        return list(itertools.compress(range(len(ids)), map(self.mask.__getitem__, ids)))


class ReachMasks:
    """The masks of one reach over a list of segments (as SearchIndex.search holds them)."""

    __slots__ = ("masks", "segs")

    def __init__(self, segs: list, masks: list):
        self.segs, self.masks = segs, masks

    def count(self) -> int:
        return sum(m.live for m in self.masks)

    def averages(self) -> tuple:
        """Return the reached notes' average (body, title) lengths (1.0 with none)."""
        n = self.count()
        if not n:
            return 1.0, 1.0
        return tuple(max(sum(m.lens[f] for m in self.masks) / n, 1.0) for f in (0, 1))

    def df(self, si: int, key, f: int) -> int:
        return self.masks[si].df(self.segs[si], key, f) if key is not None else 0


class MaskCache:
    """The masks of the reaches searched lately, least recently used dropped first (at most
    MAX_REACHES reaches and MAX_MASK_BYTES). Callers hold the index's lock."""

    LIMITS = (MAX_REACHES, MAX_MASK_BYTES)

    def __init__(self):
        # prefixes -> {segment: its mask}, weakly: a segment merged away goes with its masks
        self._reaches: collections.OrderedDict = collections.OrderedDict()
        self._asked = 0  # searches since the sizes were last added up

    def of(self, segs: list, prefixes: tuple) -> ReachMasks:
        """Return a reach's masks over `segs` (made or brought up to date)."""
        kept = self._reaches.pop(prefixes, None)
        if kept is None:
            kept = weakref.WeakKeyDictionary()
        self._reaches[prefixes] = kept
        masks, made = [], False
        for seg in segs:
            mask = kept.get(seg)
            if mask is None:
                mask = kept[seg] = SegmentMask(seg, prefixes)
                made = True
            else:
                mask.refresh(seg, prefixes)
            masks.append(mask)
        self._asked += 1
        if made or self._asked >= 32:  # (the frequencies grow a little a search)
            self._asked = 0
            self._trim()
        return ReachMasks(segs, masks)

    def reaches(self) -> list:
        """Return the reaches whose masks are kept, least recently used first."""
        return list(self._reaches)

    def _trim(self) -> None:
        most, most_bytes = self.LIMITS

        def cost(kept) -> int:
            return sum(len(m.mask) + FREQUENCY_BYTES * len(m.dfs) for m in list(kept.values()))

        size = sum(map(cost, self._reaches.values()))
        while len(self._reaches) > 1 and (len(self._reaches) > most or size > most_bytes):
            _, gone = self._reaches.popitem(last=False)
            size -= cost(gone)

    def clear(self) -> None:
        self._reaches.clear()
