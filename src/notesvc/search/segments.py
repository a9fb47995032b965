"""Index segments: postings in memory and on disk."""

from __future__ import annotations

import array
import bisect
import collections
import itertools
import math
import operator
import re
import threading
import unicodedata
from collections import deque
from collections.abc import Iterable

from notesvc.notes.paths import note_title
from notesvc.search.text import K1, WORD_RE, B, bm25_tf, fold, stem

# -- segments ---------------------------------------------------------------------
#
# The index is a list of segments, each a small inverted index of some notes: immutable
# files in <root>/.notesvc/index/ read in place through mmap (a sorted term dictionary of
# which only every SPARSE_EVERY-th term is held in memory, postings as packed arrays, the
# notes' paths, titles, lengths and term strings), and one segment in memory that takes the
# changes. A replaced or removed note stays in its segment marked deleted: at any time a path
# has at most one live entry over all segments. A background thread writes the memory
# segment to a file and merges files of similar size into one; <root>/.notesvc/index.cache,
# the commit point, names the files and their deletions and is replaced atomically.
#
# Each segment numbers its own terms; a note's terms are kept as a string of term chars
# (U+0100 upward, one per token, UTF-8 on disk), so a phrase check is a substring search
# (mmap.find) and a match's position is its token index. A segment file also lists the
# notes of each adjacent pair of its commoner terms (PAIR_COMMON, PAIR_TERMS): a phrase of
# common words starts from that list instead.
#
# Scores are exact BM25 over the live notes: N, df and the average field lengths are summed
# over the segments at query time, deleted notes subtracted. Postings hold impacts computed
# with the averages of their day (the top-k of one word is heapq over an array); the few
# notes that can reach the top are rescored with today's averages from their term
# frequencies, and impact(today) / impact(then) <= max(1, avg(today) / avg(then)) says when
# no other note can.

Doc = collections.namedtuple("Doc", "path size mtime title toks title_toks")
Doc.__doc__ = """A note analysed for indexing: toks / title_toks are strings of term chars."""
IndexedNote = collections.namedtuple("IndexedNote", "path title text")

SPARSE_EVERY = 64  # one dictionary entry in this many is held in memory
FLUSH_DOCS = 1000  # the memory segment is written to a file at this many notes...
FLUSH_TOKENS = 2_000_000  # ...or tokens
COMMIT_SECONDS = 30.0  # other changes reach the disk within this
BULK_CHUNK_NOTES = 2000  # notes analysed per segment file when many are (re)read...
BULK_CHUNK_CHARS = 8_000_000  # ...or this much text
MERGE_FACTOR = 3  # segments of one size class merged at once
MAX_DELETED = 0.3  # a segment with this share of deleted notes is rewritten
STEM_CACHE = 20_000  # words whose stems one bulk remembers (the common ones come first)
OVERFLOW_CHAR = "\xff"  # the term char of stems past the last code point (not indexed)
# Phrases of common words: a segment file keeps, for each adjacent pair of terms among its
# first PAIR_TERMS (numbered commonest first by a merge) of which one is among the first
# PAIR_COMMON, the notes holding that pair in a field: "the file" is a list read, not a
# substring search in 40 % of the notes. Their term chars are U+0100-02FF, and U+0100-017F:
# in UTF-8 a lead byte C4-CB, and C4-C5, then a continuation byte.
PAIR_COMMON, PAIR_TERMS = 128, 512
PAIR_RE = re.compile(
    rb"(?=((?:[\xc4\xc5][\x80-\xbf])(?:[\xc4-\xcb][\x80-\xbf])"
    rb"|(?:[\xc6-\xcb][\x80-\xbf])(?:[\xc4\xc5][\x80-\xbf])))"
)
_APPEND = array.array.append
FIRST_ITEM, SECOND_ITEM = operator.itemgetter(0), operator.itemgetter(1)
NOT_MINUS_ONE = (-1).__ne__
SCORE_EPS = 1e-6  # float32 impacts against float64 scores


def term_char_of(n: int) -> str:
    """Return the term char of term number n (U+0100 upward, surrogates skipped)."""
    cp = 0x100 + n
    if cp >= 0xD800:
        cp += 0x800
    return chr(cp) if cp <= 0x10FFFF else OVERFLOW_CHAR


def term_number(ch: str) -> int:
    cp = ord(ch)
    return cp - (0x900 if cp >= 0xE000 else 0x100)


def exact_tf(imp: float, dl: int, avg_then: float, avg_now: float) -> float:
    """Return bm25_tf with today's average from an impact computed with avg_then."""
    room = K1 + 1.0 - imp
    if room <= 1e-5:  # saturated: a term this frequent scores the same with any average
        return imp
    tf = max(1.0, float(round(imp * K1 * (1.0 - B + B * dl / avg_then) / room)))
    return bm25_tf(tf, dl, avg_now)


def sorted_position(ids, d: int) -> int:
    """Return the position of d in the sorted sequence ids, or -1."""
    i = bisect.bisect_left(ids, d)
    return i if i < len(ids) and ids[i] == d else -1


_ASCII_SPACES = bytes(c if chr(c).isalnum() and c < 128 else 32 for c in range(256))


class Vocab:
    """The term numbers of one segment being built, and the folded words that map to them
    (the prefix* vocabulary). encode() turns text into a string of term chars."""

    def __init__(self, stem_cache: dict | None = None):
        self.ascii: dict = {}  # folded ASCII word (bytes) -> term char: the fast path
        self.surfaces: dict = {}  # folded word of a non-ASCII text -> term char
        self.chars: dict = {}  # stem -> term char
        self.stems: list = []  # by term number
        self._cache = stem_cache

    def copy(self) -> Vocab:
        new = Vocab()
        new.ascii, new.surfaces = dict(self.ascii), dict(self.surfaces)
        new.chars, new.stems = dict(self.chars), [*self.stems]
        return new

    def _char(self, word) -> str:
        """Return the term char of a folded word (str, or ASCII bytes), numbering its stem."""
        if isinstance(word, bytes):
            word = word.decode()
        cache = self._cache
        term = cache.get(word) if cache is not None else None
        if term is None:
            term = stem(word)
            if cache is not None and len(cache) < STEM_CACHE:
                cache[word] = term
        ch = self.chars.get(term)
        if ch is None:
            ch = term_char_of(len(self.stems))
            if ch == OVERFLOW_CHAR:
                return ch
            self.chars[term] = ch
            self.stems.append(term)
        return ch

    def encode(self, text: str) -> str:
        """Return the term chars of text's tokens, in order."""
        text = fold(text)
        if text.isascii():  # the same tokens as _ASCII_WORD_RE, split at C speed
            words, chars = text.encode().translate(_ASCII_SPACES).split(), self.ascii
        else:
            words, chars = WORD_RE.findall(text), self.surfaces
        try:
            return "".join(map(chars.__getitem__, words))
        except KeyError:  # new words: give them term chars, then encode again
            for w in set(words).difference(chars):
                chars[w] = self._char(w)
            return "".join(map(chars.__getitem__, words))

    def analyse(self, path: str, text: str, size: int, mtime: int) -> Doc:
        text = unicodedata.normalize("NFC", text)
        title = note_title(text, path)
        return Doc(path, size, mtime, title, self.encode(text), self.encode(title))

    def words_utf8(self) -> list:
        """Return [(folded word as UTF-8, term char)] sorted (overflowing stems left out)."""
        found = dict(self.ascii)
        found.update((w.encode(), ch) for w, ch in self.surfaces.items())
        return sorted(item for item in found.items() if item[1] != OVERFLOW_CHAR)

    def words(self) -> list:
        """Return [(folded word, term char)] sorted by word (overflowing stems left out)."""
        found = {w.decode(): ch for w, ch in self.ascii.items()}
        found.update(self.surfaces)
        return sorted(item for item in found.items() if item[1] != OVERFLOW_CHAR)


def _count_terms(counter: dict, keys: Iterable) -> None:
    for key in keys:
        counter[key] = counter.get(key, 0) + 1


class DeletedCounts:
    """A segment file's per-term counts of its deleted notes (live document frequencies
    are its own less these): 4 bytes a term, in an array made at the first deletion. A
    dict of them cost about 100 bytes a term, 112 MB when every note of a 100k-note
    index was read again (a restored backup), and each commit sorted it all again.
    Reads like the dict a memory segment keeps: get(term, 0), items(), copy()."""

    __slots__ = ("counts", "size")

    def __init__(self, size: int):
        self.size = size  # the segment's terms
        self.counts: array.array | None = None

    def get(self, term, default: int = 0) -> int:
        counts = self.counts
        if counts is None or term is None or not 0 <= term < len(counts):
            return default
        return counts[term]

    def _array(self) -> array.array:
        if self.counts is None:
            self.counts = array.array("I", bytes(4 * self.size))
        return self.counts

    def add(self, terms: Iterable) -> None:
        """Count one more deleted note holding each of these (distinct) terms."""
        terms, size = list(terms), self.size
        if terms and max(terms) >= size:  # past the segment's terms: a damaged file
            terms = [t for t in terms if t < size]
        if terms:
            counts = self._array()
            for t in terms:
                counts[t] += 1

    def load(self, pairs: array.array) -> None:
        """Set the counts from term, count, term, count... (pairs(), from the commit file);
        a term past the segment's terms is left out."""
        if pairs:
            counts, size = self._array(), self.size
            for t, n in zip(pairs[0::2], pairs[1::2]):
                if t < size:
                    counts[t] = n

    def pairs(self) -> array.array:
        """Return term, count, term, count... of the counts that are not 0, by term."""
        counts = self.counts
        if counts is None:
            return array.array("I")
        out = array.array("I", bytes(8 * (len(counts) - counts.count(0))))
        out[0::2] = array.array("I", itertools.compress(range(len(counts)), counts))
        out[1::2] = array.array("I", filter(None, counts))
        return out

    def copy(self) -> DeletedCounts:
        new = DeletedCounts(self.size)
        new.counts = None if self.counts is None else array.array("I", self.counts)
        return new


class MemorySegment:
    """A segment in memory: the notes changed since the last flush (or a bulk's notes that
    could not be written to disk). Append-only: a replaced note is marked deleted."""

    name = "memory"

    def __init__(self, vocab: Vocab | None = None):
        self.vocab = vocab or Vocab()
        self.docs: list = []  # Doc by id
        self.avgs: list = []  # the (body, title) averages each note's impacts were computed with
        self.ids: dict = {}  # path -> id of its live entry
        self.post: tuple = ([], [])  # per field, by code point of the term char: None or
        # (array of ids, array of impacts)
        self.lens = [0, 0]
        self.tokens = 0
        self.deleted: set = set()
        self.del_df: tuple = ({}, {})  # per field: term -> deleted notes holding it
        self.del_lens = [0, 0]
        self.avg_range = [[math.inf, 0.0], [math.inf, 0.0]]
        self._sorted: list = []  # the vocabulary's words, sorted when it grew
        self._sorted_size = 0

    @property
    def n(self) -> int:
        return len(self.docs)

    def add(self, doc: Doc, avg: tuple) -> int:
        d = len(self.docs)
        self.docs.append(doc)
        self.avgs.append(avg)
        self.ids[doc.path] = d
        self.tokens += len(doc.toks)
        for f, toks in enumerate((doc.toks, doc.title_toks)):
            dl, a = len(toks), avg[f]
            self.lens[f] += dl
            span = self.avg_range[f]
            span[0], span[1] = min(span[0], a), max(span[1], a)
            counts = collections.Counter(toks)
            counts.pop(OVERFLOW_CHAR, None)
            if not counts:
                continue
            table = self.post[f]
            cps, tfs = list(map(ord, counts)), list(counts.values())
            if max(cps) >= len(table):
                table.extend([None] * (max(cps) + 1024 - len(table)))
            by_tf = {tf: bm25_tf(tf, dl, a) for tf in set(tfs)}
            entries = list(map(table.__getitem__, cps))
            if None in entries:
                for i, entry in enumerate(entries):
                    if entry is None:
                        entries[i] = table[cps[i]] = (array.array("I"), array.array("f"))
            deque(map(_APPEND, map(FIRST_ITEM, entries), itertools.repeat(d)), 0)
            deque(map(_APPEND, map(SECOND_ITEM, entries), map(by_tf.__getitem__, tfs)), 0)
        return d

    def delete(self, d: int) -> None:
        if d in self.deleted:
            return
        self.deleted.add(d)
        doc = self.docs[d]
        if self.ids.get(doc.path) == d:
            del self.ids[doc.path]
        for f, toks in enumerate((doc.toks, doc.title_toks)):
            self.del_lens[f] += len(toks)
            _count_terms(self.del_df[f], set(toks).difference(OVERFLOW_CHAR))

    # -- what searching asks of every segment -------------------------------------------

    def keys(self, stems: list) -> list:
        return list(map(self.vocab.chars.get, stems))

    def postings(self, key, f: int):
        table, cp = self.post[f], ord(key)
        return table[cp] if cp < len(table) else None

    def counts(self, key) -> tuple:
        """Return how many notes (deleted ones included) hold a term in body and title."""
        return tuple(len(p[0]) if p else 0 for p in (self.postings(key, 0), self.postings(key, 1)))

    def char(self, key) -> str:
        return key

    def toks(self, d: int, f: int) -> str:
        return self.docs[d][4 + f]

    def path(self, d: int) -> str:
        return self.docs[d].path

    def title(self, d: int) -> str:
        return self.docs[d].title

    def sig(self, d: int) -> tuple:
        doc = self.docs[d]
        return doc.size, doc.mtime

    def dl(self, d: int, f: int) -> int:
        return len(self.docs[d][4 + f])

    def avg_then(self, d: int, f: int) -> float:
        return self.avgs[d][f]

    def find(self, path: str):
        return self.ids.get(path)

    def pair_ids(self, keys: list, f: int) -> None:
        return None  # few notes: the substring search is quick

    def phrase(self, cands: Iterable, chars: list, f: int) -> list:
        """Return the candidates whose field holds the term chars in a row."""
        docs, needle = self.docs, "".join(chars)
        return [d for d in cands if needle in docs[d][4 + f]]

    def ids_under(self, prefix: str) -> list:
        """Return the ids of the notes (deleted ones too) whose paths start with prefix."""
        return [d for d, doc in enumerate(self.docs) if doc.path.startswith(prefix)]

    def field_lengths(self, f: int) -> list:
        """Return every note's length in a field (tokens), by id."""
        return [len(doc[4 + f]) for doc in self.docs]

    def in_folder(self, cands: set, prefix: str) -> set:
        docs = self.docs
        return {d for d in cands if docs[d].path.startswith(prefix)}

    def prefix_words(self, prefix: str, cap: int) -> list:
        """Return [(folded word, stem)] of up to cap words starting with prefix, sorted."""
        vocab = self.vocab
        size = len(vocab.ascii) + len(vocab.surfaces)
        if self._sorted_size != size:
            self._sorted, self._sorted_size = vocab.words(), size
        words = self._sorted
        i = bisect.bisect_left(words, (prefix,))
        out = []
        while i < len(words) and words[i][0].startswith(prefix) and len(out) < cap:
            out.append((words[i][0], vocab.stems[term_number(words[i][1])]))
            i += 1
        return out

    def live(self) -> list:
        """Return [(path, id)] of the live notes (a snapshot, taken under the index lock)."""
        return list(self.ids.items())

    # -- what the segment writer reads -----------------------------------------------------

    def sorted_terms(self) -> Iterable:
        return iter(sorted(self.vocab.chars.items()))

    def sorted_surfaces(self) -> Iterable:
        return iter(self.vocab.words())

    def term_count(self) -> int:
        return len(self.vocab.stems)

    def key_number(self, key) -> int:
        return term_number(key)

    def tok_text(self, d: int, f: int) -> str:
        return self.docs[d][4 + f]

    def title_bytes(self, d: int) -> bytes:
        return self.docs[d].title.encode()

    def path_bytes(self, d: int) -> bytes:
        return self.docs[d].path.encode()

    def by_path(self) -> list:
        docs = self.docs
        return sorted(range(len(docs)), key=lambda d: docs[d].path)


# -- what a query finds in a segment ----------------------------------------------


def phrase_docs(seg, ks: list, within: set | None) -> set:
    """Return the notes of a segment holding the words of keys ks in a row, in the body
    or the title (among `within`)."""
    found: set = set()
    chars = list(map(seg.char, ks))
    for f in (0, 1):
        lists = [seg.postings(k, f) for k in ks]
        if not all(lists):
            continue
        lists = sorted((p[0] for p in lists), key=len)
        pairs = seg.pair_ids(ks, f)
        if pairs is not None and (len(ks) == 2 or len(min(pairs, key=len)) < len(lists[0])):
            lists = [min(pairs, key=len)]  # common words: the notes holding a pair
        cands = lists[0]
        if within is not None:  # (the notes of the clauses before)
            if len(cands) > 4 * len(within):
                cands = [d for d in within if sorted_position(cands, d) >= 0]
            else:
                cands = within.intersection(cands)
        elif len(lists) > 1 and len(lists[1]) <= 16 * len(cands):  # holding both terms
            cands = set(cands).intersection(lists[1])
        exact = len(ks) == 2 and pairs is not None  # a pair's list is the phrase's
        found.update(cands if exact else seg.phrase(cands, chars, f))
    return found


def word_docs(seg, ks: list, within: set | None) -> set:
    """Return the notes of a segment holding any of the keys ks (None: a word it lacks),
    in the body or the title (among `within`)."""
    found: set = set()
    for k in ks:
        if k is None:
            continue
        for f in (0, 1):
            p = seg.postings(k, f)
            if not p:
                continue
            ids = p[0]
            if within is None:
                found.update(ids)
            elif len(ids) > 4 * len(within):
                found.update(d for d in within if sorted_position(ids, d) >= 0)
            else:
                found.update(within.intersection(ids))
    return found


def query_needles(seg, si: int, clauses: list, keys: dict, typed: dict) -> dict:
    """Return the query's term strings in a segment, phrases and rarest words first,
    each with the word as typed ("" for a phrase or a prefix)."""
    found = []
    for kind, stems in (alt for clause in clauses for alt in clause):
        groups = [[s] for s in stems[:8]] if kind == "prefix" else [stems]
        for group in groups:
            ks = [keys[s][si] for s in group]
            if None not in ks:
                p = seg.postings(ks[0], 0)
                word = typed.get(group[0], "") if kind == "word" else ""
                found.append(("".join(map(seg.char, ks)), len(p[0]) if p else 0, word))
    found.sort(key=lambda x: (-len(x[0]), x[1]))
    needles: dict = {}
    for needle, _, word in found:
        needles.setdefault(needle, word)
    return needles


class TextCache:
    """The texts of the notes snippets were cut from lately, each kept with the signature
    (size, mtime) the index holds for it, so it is given again only for that version;
    at most MAX_CHARS characters, notes up to MAX_NOTE_CHARS, least recent out first.
    A search typed letter by letter, or asked again, cuts its snippets from the same notes:
    reading each one's file again cost a rare word's search a fifth of its time."""

    MAX_CHARS = 1 << 20
    MAX_NOTE_CHARS = 32 << 10

    def __init__(self):
        self._lock = threading.Lock()
        self._items: collections.OrderedDict = collections.OrderedDict()  # path -> (sig, text)
        self._chars = 0

    def get(self, path: str, sig: tuple) -> str | None:
        with self._lock:
            entry = self._items.get(path)
            if entry is None or entry[0] != sig:
                return None
            self._items.move_to_end(path)
            return entry[1]

    def put(self, path: str, sig: tuple, text: str) -> None:
        if len(text) > self.MAX_NOTE_CHARS:
            return
        with self._lock:
            old = self._items.pop(path, None)
            if old is not None:
                self._chars -= len(old[1])
            self._items[path] = (sig, text)
            self._chars += len(text)
            while self._chars > self.MAX_CHARS:
                self._chars -= len(self._items.popitem(last=False)[1][1])

    def drop(self, path: str) -> None:
        with self._lock:
            old = self._items.pop(path, None)
            if old is not None:
                self._chars -= len(old[1])
