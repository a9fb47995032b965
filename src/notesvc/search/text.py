"""Text analysis (Porter2), BM25, the query language and snippets."""

from __future__ import annotations

import functools
import math
import re
import sys
import unicodedata

from notesvc.errors import bad_request

# -- Search --------------------------------------------------------------------------------
#
# An inverted index of the notes that lives on disk and is read in place: memory grows
# with what is being used, not with the size of the archive. Chapters: text analysis,
# BM25, the query language, snippets, segments (the changes held in memory), persistence
# (segment files and the commit file), the index (SearchIndex: search, sync, merges).

K1, B = 1.2, 0.75  # BM25 saturation and length normalisation (Lucene's defaults)
TITLE_WEIGHT = 2.0  # a title hit counts twice a body hit
INDEX_FORMAT = ("notesvc-segments", 3, K1, B, TITLE_WEIGHT, "porter2-words-1")
MAX_QUERY_CHARS = 512
MAX_PREFIX_TERMS = 64  # expansions of one prefix* (most frequent first)
SNIPPET_CHARS = 240

# -- text analysis ------------------------------------------------------------

# Words: letters and digits; `_` separates (snake_case is two words, as for FTS5's unicode61)
WORD_RE = re.compile(r"[^\W_]+")
_ASCII_WORD_RE = re.compile(r"[^\W_]+", re.ASCII)  # the same tokens on ASCII text, faster
_MARKS_RE = re.compile("[\u0300-\u036f\u1ab0-\u1aff\u1dc0-\u1dff\u20d0-\u20ff\ufe20-\ufe2f]")


def fold(text: str) -> str:
    """Return text with case and accents folded.

    >>> fold("Crème BRÛLÉE Straße")
    'creme brulee strasse'
    """
    text = text.casefold()
    if not text.isascii():
        text = _MARKS_RE.sub("", unicodedata.normalize("NFKD", text))
    return text


# Porter2, the Snowball English stemmer (snowballstem.org/algorithms/english), as its
# reference english.sbl defines it today; checked against the project's word list (every
# 15th pair is in docs/porter2-sample.txt). The description's tables are the tables below,
# its steps the _p2_step* functions, run in order by _P2_STEPS. A "Y" is a y that acts as a
# consonant: a first letter, or one after a vowel; it is not a vowel.
_P2_VOWELS = frozenset("aeiouy")
_P2_NOT_SHORT_END = frozenset("aeiouywxY")  # a short syllable's last letter is none of these
_P2_VOWEL_RE = re.compile("[aeiouy]")
_P2_REGION_RE = re.compile("[^aeiouy]*[aeiouy]+[^aeiouy]")  # to just past a vowel-consonant
_P2_WORDS = {  # whole words with a stem of their own (or none)
    "skis": "ski",
    "skies": "sky",
    "idly": "idl",
    "gently": "gentl",
    "ugly": "ugli",
    "early": "earli",
    "only": "onli",
    "singly": "singl",
    **dict.fromkeys(["sky", "news", "howe", "atlas", "cosmos", "bias", "andes"]),
}
# R1 starts after these (generous/general, not gener-ous/gen-eral), not after the first
# vowel-consonant pair.
_P2_R1_PREFIXES = (
    "gener",
    "commun",
    "arsen",
    "past",
    "univers",
    "later",
    "emerg",
    "organ",
    "inter",
)
_P2_STEP0 = ("'s'", "'s", "'")  # longest first
_P2_1A = ("sses", "ied", "ies", "us", "ss", "s")  # longest first
_P2_1B = ("eedly", "ingly", "edly", "eed", "ing", "ed")  # longest first
_P2_EED_KEEP = frozenset(["proc", "exc", "succ"])  # proceed, exceed, succeed
_P2_ING_KEEP = frozenset(["inn", "out", "cann", "herr", "earr", "even"])  # inning, outing...
_P2_1B_ADD_E = ("at", "bl", "iz")  # luxuriated -> luxuriate
_P2_DOUBLES = ("bb", "dd", "ff", "gg", "mm", "nn", "pp", "rr", "tt")


def _p2_rules(*rows: tuple) -> dict:
    """Return a step's rows (suffix, replacement, region, letters) as suffix -> (replacement,
    region, letters), longest suffix first.

    The longest suffix a word ends with is the one the step looks at: it is replaced when it
    starts in the region (1: R1, 2: R2) and, where letters are given, follows one of them;
    otherwise the step leaves the word as it is.
    """
    return {
        suffix: (replacement, region, frozenset(letters) if letters else None)
        for suffix, replacement, region, letters in sorted(rows, key=lambda r: -len(r[0]))
    }


_P2_STEP2 = _p2_rules(  # derivational suffixes in R1
    ("tional", "tion", 1, ""),
    ("enci", "ence", 1, ""),
    ("anci", "ance", 1, ""),
    ("abli", "able", 1, ""),
    ("entli", "ent", 1, ""),
    ("izer", "ize", 1, ""),
    ("ization", "ize", 1, ""),
    ("ational", "ate", 1, ""),
    ("ation", "ate", 1, ""),
    ("ator", "ate", 1, ""),
    ("alism", "al", 1, ""),
    ("aliti", "al", 1, ""),
    ("alli", "al", 1, ""),
    ("fulness", "ful", 1, ""),
    ("ousli", "ous", 1, ""),
    ("ousness", "ous", 1, ""),
    ("iveness", "ive", 1, ""),
    ("iviti", "ive", 1, ""),
    ("biliti", "ble", 1, ""),
    ("bli", "ble", 1, ""),
    ("ogist", "og", 1, ""),
    ("ogi", "og", 1, "l"),
    ("fulli", "ful", 1, ""),
    ("lessli", "less", 1, ""),
    ("li", "", 1, "cdeghkmnrt"),
)
_P2_STEP3 = _p2_rules(
    ("tional", "tion", 1, ""),
    ("ational", "ate", 1, ""),
    ("alize", "al", 1, ""),
    ("icate", "ic", 1, ""),
    ("iciti", "ic", 1, ""),
    ("ical", "ic", 1, ""),
    ("ful", "", 1, ""),
    ("ness", "", 1, ""),
    ("ative", "", 2, ""),
)
_P2_STEP4 = _p2_rules(  # suffixes in R2
    *((suffix, "", 2, "") for suffix in "al ance ence er ic able ible ant ement ment ent".split()),
    *((suffix, "", 2, "") for suffix in "ism ate iti ous ive ize".split()),
    ("ion", "", 2, "st"),
)


def _p2_suffix(word: str, suffixes: tuple) -> str | None:
    """Return the first of suffixes (longest first) that word ends with, or None."""
    if word.endswith(suffixes):  # one test in C for the many words that end in none
        for suffix in suffixes:
            if word.endswith(suffix):
                return suffix
    return None


def _p2_short(word: str) -> bool:
    """Whether word ends in a short syllable: consonant-vowel-consonant (the last not w, x
    or Y), or vowel-consonant as the whole word; "past" counts too (pasted, pasting)."""
    n = len(word)
    if (
        n >= 3
        and word[-1] not in _P2_NOT_SHORT_END
        and word[-2] in _P2_VOWELS
        and word[-3] not in _P2_VOWELS
    ):
        return True
    if n == 2 and word[0] in _P2_VOWELS and word[1] not in _P2_VOWELS:
        return True
    return word.endswith("past")


def _p2_mark_y(word: str) -> str:
    """Return word with each consonant y as Y: the first letter, or one after a vowel."""
    chars = list(word)
    if chars[0] == "y":
        chars[0] = "Y"
    for i in range(1, len(chars)):
        if chars[i] == "y" and chars[i - 1] in _P2_VOWELS:
            chars[i] = "Y"
    return "".join(chars)


def _p2_regions(word: str) -> tuple:
    """Return (p1, p2), where R1 and R2 start: R1 after the first consonant that follows a
    vowel (or after a special prefix), R2 the same again in R1; len(word) for an empty one.
    Offsets stay right as the steps go: they only shorten the word's end."""
    n = len(word)
    if word.startswith(_P2_R1_PREFIXES):
        p1 = next(len(p) for p in _P2_R1_PREFIXES if word.startswith(p))
    else:
        m = _P2_REGION_RE.match(word)
        p1 = m.end() if m else n
    m = _P2_REGION_RE.match(word, p1)
    return p1, (m.end() if m else n)


def _p2_step0(word: str, p1: int, p2: int) -> str:
    """Step 0: return word without a possessive 's, or an apostrophe at the end."""
    return word[: -len(_p2_suffix(word, _P2_STEP0))]


def _p2_step1a(word: str, p1: int, p2: int) -> str:
    """Step 1a, plurals: sses -> ss; ied, ies -> i (ie after one letter: ties -> tie); s goes
    after a vowel that is not just before it (gaps -> gap, but gas); us and ss stay."""
    suffix = _p2_suffix(word, _P2_1A)
    if suffix == "sses":
        return word[:-2]
    if suffix in ("ied", "ies"):
        return word[:-2] if len(word) > 4 else word[:-1]  # cries -> cri, ties -> tie
    if suffix == "s" and _P2_VOWEL_RE.search(word, 0, len(word) - 2):
        return word[:-1]
    return word


def _p2_step1b(word: str, p1: int, p2: int) -> str:
    """Step 1b: eed, eedly -> ee in R1 (not proceed, exceed, succeed); ed, edly, ing, ingly
    go after a vowel, then _p2_step1b_end tidies what is left (dying -> die, inning stays)."""
    suffix = _p2_suffix(word, _P2_1B)
    s = len(word) - len(suffix)
    base = word[:s]
    if suffix in ("eed", "eedly"):
        return base + "ee" if s >= p1 and base not in _P2_EED_KEEP else word
    if suffix == "ing":
        if s == 2 and base[1] == "y" and base[0] not in _P2_VOWELS:
            return base[0] + "ie"  # dying -> die, lying -> lie
        if base in _P2_ING_KEEP:
            return word  # inning, outing, canning, herring, earring, evening
    if not _P2_VOWEL_RE.search(base):
        return word
    return _p2_step1b_end(base, p1)


def _p2_step1b_end(base: str, p1: int) -> str:
    """Return what step 1b left: at, bl, iz gain an e; a double letter loses one (hopping ->
    hop; but add, egg, off); a short word gains an e (hoped -> hope)."""
    if base.endswith(_P2_1B_ADD_E):
        return base + "e"
    if base.endswith(_P2_DOUBLES):
        return base if len(base) == 3 and base[0] in "aeo" else base[:-1]
    if len(base) == p1 and _p2_short(base):
        return base + "e"
    return base


def _p2_step1c(word: str, p1: int, p2: int) -> str:
    """Step 1c: a final y after a consonant (not the first letter) becomes i."""
    if len(word) > 2 and word[-2] not in _P2_VOWELS:
        return word[:-1] + "i"
    return word


def _p2_replace(word: str, rules: dict, p1: int, p2: int) -> str:
    """Return word with the longest of rules' suffixes it ends with replaced, where that
    row's region and letters allow (see _p2_rules)."""
    for suffix in rules:
        if word.endswith(suffix):
            replacement, region, letters = rules[suffix]
            s = len(word) - len(suffix)
            if s >= (p1 if region == 1 else p2) and (letters is None or word[s - 1 : s] in letters):
                return word[:s] + replacement
            return word
    return word


def _p2_step2(word: str, p1: int, p2: int) -> str:
    """Step 2: derivational suffixes in R1 (_P2_STEP2)."""
    return _p2_replace(word, _P2_STEP2, p1, p2)


def _p2_step3(word: str, p1: int, p2: int) -> str:
    """Step 3: more derivational suffixes in R1, ative in R2 (_P2_STEP3)."""
    return _p2_replace(word, _P2_STEP3, p1, p2)


def _p2_step4(word: str, p1: int, p2: int) -> str:
    """Step 4: suffixes in R2, ion after s or t (_P2_STEP4)."""
    return _p2_replace(word, _P2_STEP4, p1, p2)


def _p2_step5(word: str, p1: int, p2: int) -> str:
    """Step 5: a final e goes in R2, or in R1 after no short syllable; so does the second l
    of a final ll in R2."""
    s = len(word) - 1
    if word.endswith("e"):
        return word[:s] if s >= p2 or (s >= p1 and not _p2_short(word[:s])) else word
    return word[:s] if s >= p2 else word


# The steps in order, each with the endings it acts on: a word ending in none skips it.
_P2_STEPS = (
    (_P2_STEP0, _p2_step0),
    (_P2_1A, _p2_step1a),
    (_P2_1B, _p2_step1b),
    (("y", "Y"), _p2_step1c),
    (tuple(_P2_STEP2), _p2_step2),
    (tuple(_P2_STEP3), _p2_step3),
    (tuple(_P2_STEP4), _p2_step4),
    (("e", "ll"), _p2_step5),
)


def _porter2(word: str) -> str:
    """Return the Porter2 stem of a word of lower-case ASCII letters (and apostrophes)."""
    if word in _P2_WORDS:
        return _P2_WORDS[word] or word
    if len(word) < 3:
        return word
    if word[0] == "'":
        word = word[1:]
    if "y" in word:
        word = _p2_mark_y(word)
    p1, p2 = _p2_regions(word)
    for endings, step in _P2_STEPS:
        if word.endswith(endings):
            word = step(word, p1, p2)
    return word.replace("Y", "y")


@functools.lru_cache(maxsize=16384)  # the common words of queries and edits: ~2.5 MB
def stem(word: str) -> str:
    """Return the Porter2 (Snowball English) stem of a folded word; a word that is not all
    ASCII lower-case letters, or has 2 letters or fewer, comes back unchanged.

    >>> [stem(w) for w in ["running", "runs", "keys", "cities", "generously", "news", "café"]]
    ['run', 'run', 'key', 'citi', 'generous', 'news', 'café']
    >>> [stem(w) for w in ["informing", "informed", "information", "dying", "x86", "is"]]
    ['inform', 'inform', 'inform', 'die', 'x86', 'is']
    """
    if len(word) <= 2 or not word.isascii() or not word.isalpha() or not word.islower():
        return word
    return _porter2(word)


def tokenize(text: str) -> list:
    """Return the stems of text, in order.

    >>> tokenize("Running shoes & the spare KEYS, café")
    ['run', 'shoe', 'the', 'spare', 'key', 'cafe']
    """
    return [stem(w) for w in WORD_RE.findall(fold(text))]


# -- BM25 ---------------------------------------------------------------------
#
# A note's score for a query is the sum, over the query's terms and the two fields
# (body, title), of  bm25_weight(N, df, field) * bm25_tf(tf, dl, avgdl):
#   N      notes in the index          df     notes whose field holds the term
#   tf     the term's count in the field   dl     the field's length in tokens
#   avgdl  the field's average length over all notes
# The index stores bm25_tf per posting (its "impact"); the weight is computed per query.

FIELD_WEIGHTS = {"body": 1.0, "title": TITLE_WEIGHT}


def bm25_idf(n_docs: int, df: int) -> float:
    """Lucene's always-positive inverse document frequency."""
    return math.log(1.0 + (n_docs - df + 0.5) / (df + 0.5))


def bm25_tf(tf: float, dl: float, avgdl: float) -> float:
    """BM25's saturated, length-normalised term frequency (the per-posting impact).

    tf: occurrences of the term in the field; dl: the field's length in tokens;
    avgdl: the average length of that field over all documents.
    """
    return tf * (K1 + 1.0) / (tf + K1 * (1.0 - B + B * dl / max(avgdl, 1.0)))


def bm25_weight(n_docs: int, df: int, field: str = "body") -> float:
    """Return a term's weight in one field: the field's weight times the term's IDF."""
    return FIELD_WEIGHTS[field] * bm25_idf(n_docs, df)


# -- the query language -------------------------------------------------------


class Query:
    """A parsed query: clauses that must all match, each a list of alternatives (OR).

    An alternative is ("word", stem), ("phrase", [stems]) or ("prefix", folded text).
    """

    def __init__(self, text: str):
        self.text = text
        self.clauses: list = []
        self.excludes: list = []
        self.typed: dict = {}  # a word's stem: the word as typed, lowercased (for snippets)
        self._parse(text)

    def _parse(self, text: str) -> None:
        if not text.strip():
            raise bad_request("'q' is required: give one or more words to search for")
        if len(text) > MAX_QUERY_CHARS:
            raise bad_request(f"the query is longer than {MAX_QUERY_CHARS} characters")
        if text.count('"') % 2:
            raise bad_request('the query has an unbalanced quote: close the " or remove it')
        items = re.findall(r'(-?)"([^"]*)"|(\S+)', text)
        pending_or = False
        for neg, phrase, word in items:
            if word == "OR":
                if not self.clauses or pending_or:
                    raise bad_request("OR needs a word on each side, as in: cats OR dogs")
                pending_or = True
                continue
            negative = bool(neg) or (word.startswith("-") and len(word) > 1)
            raw = phrase if not word else word.lstrip("-") if negative else word
            alt = self._alternative(raw, quoted=not word)
            if alt is None:
                continue
            words = WORD_RE.findall(raw) if alt[0] == "word" else ()
            if len(words) == 1 and tokenize(words[0]) == [alt[1]]:  # the word is its term
                self.typed.setdefault(alt[1], words[0].lower())
            if negative:
                if pending_or:
                    raise bad_request("an -exclusion cannot be part of an OR")
                self.excludes.append(alt)
            elif pending_or:
                self.clauses[-1].append(alt)
                pending_or = False
            else:
                self.clauses.append([alt])
        if pending_or:
            raise bad_request("OR needs a word on each side, as in: cats OR dogs")
        if not self.clauses:
            if self.excludes:
                raise bad_request("the query only excludes: add a word to search for")
            raise bad_request("the query has no searchable words (letters or digits)")

    @staticmethod
    def _alternative(raw: str, quoted: bool):
        if not quoted and raw.endswith("*"):
            prefix = fold(raw.rstrip("*"))
            if len(prefix) < 2 or not WORD_RE.fullmatch(prefix):
                raise bad_request("a prefix* needs at least 2 letters or digits before the *")
            return ("prefix", prefix)
        stems = tokenize(raw)
        if not stems:
            return None
        return ("word", stems[0]) if len(stems) == 1 else ("phrase", stems)


# -- snippets -----------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _skip_tokens(n: int, ascii_only: bool) -> re.Pattern:
    """Match n tokens: possessive where Python has it (3.11; nothing to backtrack into, a
    fifth faster), else each token with the separators after it (no word split in two)."""
    if sys.version_info >= (3, 11):
        pattern = r"(?:[\W_]*+[^\W_]++){" + str(n) + "}"
    else:
        pattern = r"[\W_]*(?:[^\W_]+[\W_]+){" + str(n) + "}"
    return re.compile(pattern, re.ASCII if ascii_only else 0)


# ASCII letters and digits as they are, every other byte a space: an ASCII text's tokens
# ([A-Za-z0-9]+) as words that bytes.split finds. The UTF-8 table keeps the bytes of every
# other character too; which of those are separators is decided per text (_utf8_words).
_ASCII_TOKEN_BYTES = bytes(c if chr(c).isascii() and chr(c).isalnum() else 32 for c in range(256))
_UTF8_TOKEN_BYTES = bytes(c if c >= 0x80 or chr(c).isalnum() else 32 for c in range(256))
_ASCII_BYTES = bytes(range(0x80))


class Split:
    """How far _token_offset splits a text in C-level steps before a regex takes over."""

    TOKENS_UP_TO = 2000  # deeper: the regex, without a bytes object per token skipped
    CHARS = 1 << 16  # the split looks this far into a note at most...
    WORK = 1 << 20  # ...and replaces at most this many bytes (kinds of separators by size)


def _token_offset(text: str, k: int) -> int | None:
    """Return where token k (0-based) of text starts, skipping tokens in C-level steps.

    Up to Split.TOKENS_UP_TO tokens in, within Split.CHARS, the text's bytes with every
    separator made spaces are split k times: token k starts where the rest does (half the
    regex's time on ASCII notes, a third less on the others). Deeper, or in a note of many kinds
    of separators (a table of symbols), a regular expression skips 100 tokens a step.
    """
    ascii_only = text.isascii()
    if k <= Split.TOKENS_UP_TO:
        at = _split_offset(text, k, ascii_only)
        if at != -1:
            return at
    pos = 0
    while k > 0:
        n = min(k, 100)
        m = _skip_tokens(n, ascii_only).match(text, pos)
        if m is None:
            return None
        pos, k = m.end(), k - n
    m = WORD_RE.search(text, pos)
    return m.start() if m else None


def _split_offset(text: str, k: int, ascii_only: bool) -> int | None:
    """_token_offset by splitting the text's first Split.CHARS; -1 when it cannot tell
    (token k lies further, or splitting would cost more than Split.WORK)."""
    head = text[: Split.CHARS]
    if ascii_only:
        raw = None
        words = head.encode("ascii").translate(_ASCII_TOKEN_BYTES)
    else:
        raw = head.encode("utf-8", "surrogatepass")
        words = _utf8_words(raw)
        if words is None:
            return -1
    rest = words.split(None, k)
    if len(rest) <= k:
        return None if len(head) == len(text) else -1
    at = len(words) - len(rest[k])
    return at if raw is None else len(raw[:at].decode("utf-8", "surrogatepass"))


def _utf8_words(raw: bytes) -> bytes | None:
    """Return UTF-8 bytes with each separator (any character that is not a letter or a
    digit, as [^\\W_] means) made as many spaces as it has bytes: tokens stay where they
    were, and split() finds them. The text's few distinct non-ASCII characters are looked
    at once each; UTF-8 never matches a character inside another one. None when their
    replacing would pass over more than Split.WORK bytes."""
    words = raw.translate(_UTF8_TOKEN_BYTES)
    others = set(raw.translate(None, _ASCII_BYTES).decode("utf-8", "surrogatepass"))
    separators = [char for char in others if not char.isalnum()]
    if len(separators) * len(raw) > Split.WORK:
        return None
    for char in separators:
        sep = char.encode("utf-8", "surrogatepass")
        words = words.replace(sep, b" " * len(sep))
    return words


_LAST_SPACE_RE = re.compile(r".*\s", re.DOTALL)  # matched within bounds: up to the last space


def _typed_offset(text: str, word: str) -> int | None:
    """Return where the word first stands whole in text's first Split.CHARS, case aside
    (None: nowhere, or lowercasing changes the text's length and so its offsets)."""
    head = text[: Split.CHARS]
    low = head.lower()
    if len(low) != len(head):
        return None
    at, n = low.find(word), len(word)
    while at >= 0:
        if not (at and low[at - 1].isalnum()) and not low[at + n : at + n + 1].isalnum():
            return at
        at = low.find(word, at + n)
    return None


def body_snippet(text: str, toks: str, needles: dict) -> str:
    """Return up to SNIPPET_CHARS of the body around the first match of the best needle:
    where the word stands as it was typed (one find in C), else its first token of any
    form (the tokens counted)."""
    index, needle = -1, ""
    for needle in needles:
        index = toks.find(needle)
        if index >= 0:
            break
    start = 0
    at = None
    if index > 0:
        typed = needles[needle]
        at = _typed_offset(text, typed) if typed else None
        at = _token_offset(text, index) if at is None else at
    if at is not None:  # 60 characters before the match, back to a space (90 at most)
        lo, start = max(0, at - 90), max(0, at - 60)
        space = _LAST_SPACE_RE.match(text, lo, start)
        start = space.end() if space else lo
    end = start + SNIPPET_CHARS + 40
    window = " ".join(text[start:end].split())
    lead = "…" if start > 0 else ""
    room = SNIPPET_CHARS - len(lead)
    if len(window) > room or end < len(text):
        cut = window[: room - 1]
        cut = cut.rsplit(" ", 1)[0] if " " in cut[20:] else cut
        return lead + cut + "…"
    return lead + window
