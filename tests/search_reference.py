"""A reference BM25 and the random notes and queries the index is checked against."""

from __future__ import annotations

import math
import random
import re
import unicodedata
from pathlib import Path

import pytest

from conftest import notesvc

REF_WORDS = (
    "apple apples banana bananas cherry garden gardens gardening kitchen keys key spare blue "
    "flowerpot drawer window windows running runs run walked walking walk river mountain coffee "
    "recipe recipes the a of and to in note notes meeting meetings plan plans zebra yak "
    "xylophone quokka narwhal pelican otter heron café crème brûlée"
).split()


def make_ref_notes(rnd: random.Random, n: int, start: int = 0) -> dict:
    """Return {path: text} of n generated notes over REF_WORDS (some without a heading)."""
    notes = {}
    for i in range(start, start + n):
        folder = rnd.choice(["notes", "notes/work", "notes/home", "notes/work/deep"])
        vocab = REF_WORDS[: rnd.choice((20, 40, len(REF_WORDS)))]
        body = " ".join(rnd.choice(vocab) for _ in range(rnd.randint(3, 80)))
        if rnd.random() < 0.8:
            title = " ".join(rnd.choice(REF_WORDS) for _ in range(rnd.randint(1, 3)))
            body = f"# {title}\n\n{body}\n"
        notes[f"{folder}/n{i:05d}.md"] = body
    return notes


def write_notes(root: Path, notes: dict) -> None:
    for path, text in notes.items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")


class ReferenceBM25:
    """A brute-force BM25 over notesvc's tokens: every fast path must give its answers.

    Score: for each clause, alternative and term (a phrase's terms one by one, a prefix's
    expansions), in body (weight 1) and title (weight 2): idf * tf (k1 + 1) / (tf + k1 (1 - b
    + b dl / avgdl)), with Lucene's idf, k1 1.2, b 0.75; ties ordered by path.
    """

    def __init__(self, notes: dict):
        self.docs = {}
        words: set = set()
        for path, text in notes.items():
            text = unicodedata.normalize("NFC", text)
            title = notesvc.note_title(text, path)
            self.docs[path] = (notesvc.tokenize(text), notesvc.tokenize(title))
            for part in (text, title):
                words.update(re.findall(r"\w+", notesvc.fold(part)))
        self.words = sorted(words)
        self.n = len(self.docs)
        self.df: list = [{}, {}]
        for toks in self.docs.values():
            for f in (0, 1):
                for t in set(toks[f]):
                    self.df[f][t] = self.df[f].get(t, 0) + 1
        self.avg = [max(sum(len(t[f]) for t in self.docs.values()) / self.n, 1.0) for f in (0, 1)]

    def _resolve(self, alt: tuple) -> tuple:
        kind, arg = alt
        if kind == "prefix":  # the first 1024 words, their stems, commonest 64 in bodies
            first = [w for w in self.words if w.startswith(arg)][:1024]
            stems = sorted({notesvc.stem(w) for w in first})
            return kind, sorted(stems, key=lambda s: (-self.df[0].get(s, 0), s))[:64]
        return kind, [arg] if kind == "word" else list(arg)

    @staticmethod
    def _matches(toks: tuple, alt: tuple) -> bool:
        kind, stems = alt
        if kind != "phrase":
            return any(s in toks[0] or s in toks[1] for s in stems)
        k = len(stems)
        return any(field[i : i + k] == stems for field in toks for i in range(len(field) - k + 1))

    def _score(self, toks: tuple, clauses: list) -> float:
        score = 0.0
        for clause in clauses:
            for _, stems in clause:
                for s in stems:
                    for f, weight in ((0, 1.0), (1, 2.0)):
                        tf = toks[f].count(s)
                        if tf:
                            df = self.df[f][s]
                            idf = math.log(1 + (self.n - df + 0.5) / (df + 0.5))
                            norm = 1.2 * (1 - 0.75 + 0.75 * len(toks[f]) / self.avg[f])
                            score += weight * idf * tf * 2.2 / (tf + norm)
        return score

    def search(self, q: str, folder: str = "") -> tuple:
        query = notesvc.Query(q)
        clauses = [[self._resolve(a) for a in clause] for clause in query.clauses]
        excludes = [self._resolve(a) for a in query.excludes]
        prefix = folder.rstrip("/") + "/" if folder else ""
        found = []
        for path, toks in self.docs.items():
            if not path.startswith(prefix):
                continue
            wanted = all(any(self._matches(toks, a) for a in c) for c in clauses)
            if wanted and not any(self._matches(toks, a) for a in excludes):
                found.append((self._score(toks, clauses), path))
        found.sort(key=lambda h: (-h[0], h[1]))
        return len(found), found


def assert_answers_like(index: notesvc.SearchIndex, ref: ReferenceBM25, q: str, folder=""):
    total, results = index.search(notesvc.Query(q), folder, 10, 0)
    want_total, want = ref.search(q, folder)
    assert total == want_total, q
    assert len(results) == min(10, want_total), q
    for i, (path, _, score, _) in enumerate(results):
        best = want[i][0]
        assert abs(score - best) <= max(1e-4 * best, 6e-5), (q, i, path, score, want[i])
        if path != want[i][1]:  # only equal scores may come in another order
            tied = {p for s, p in want if abs(s - best) <= 1e-9 * max(best, 1.0)}
            assert path in tied, (q, i, path, want[:10])


def ref_queries(rnd: random.Random, notes: dict) -> list:
    """Single words (common, rare, folded forms), AND, OR, exclusions, prefixes, phrases."""
    qs = ["apple", "keys", "key", "garden", "the", "zebra", "café", "CREME", "runs", "walking"]
    qs += ["ap*", "gard*", "ke*", "wa*", "run*", "me*", "cr*", "zz*"]
    for _ in range(12):
        qs.append(" ".join(rnd.sample(REF_WORDS[:30], rnd.choice((2, 3)))))
        qs.append(f"{rnd.choice(REF_WORDS)} OR {rnd.choice(REF_WORDS)}")
        qs.append(f"{rnd.choice(REF_WORDS[:20])} -{rnd.choice(REF_WORDS[:20])}")
        prefix = rnd.choice([w for w in REF_WORDS[10:40] if len(w) > 3])[:3]
        qs.append(f"{rnd.choice(REF_WORDS[:10])} {prefix}*")
    bodies = sorted(notes.values())
    for _ in range(12):
        words = re.findall(r"\w+", rnd.choice(bodies))
        if len(words) > 3:
            j = rnd.randrange(len(words) - 2)
            qs.append(f'"{words[j]} {words[j + 1]}"')
            qs.append(f'{words[j]} -"{words[j + 1]} {words[j + 2]}"')
    return qs


@pytest.fixture
def disk_index(tmp_path):
    """A SearchIndex kept under tmp_path/.notesvc, reading notes from tmp_path/notes."""
    state = tmp_path / ".notesvc"
    state.mkdir()
    (tmp_path / "notes").mkdir()
    index = notesvc.SearchIndex.open(state, notesvc.NoteStore(tmp_path / "notes", state / "trash"))
    yield index
    index.close()


def remove_notes(rnd: random.Random, index, notes: dict, root: Path, count: int) -> None:
    for path in rnd.sample(sorted(notes), count):
        del notes[path]
        (root / path).unlink()
        index.remove(path)
