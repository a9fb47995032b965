"""Benchmark: what notesvc's stemmer finds, against SQLite FTS5's porter tokenizer.

    python3 ../shared/bench/corpus.py --n 10000 --out ~/corpus/10k     # once, outside the repo
    python bench/bench_recall.py --corpus ~/corpus/10k
    python bench/bench_recall.py --notesvc /tmp/old/notesvc.py   # another version of notesvc

Indexes the corpus's notes (a real-text corpus from the shared corpus.py) twice, in this
process: in notesvc's SearchIndex (a temporary state folder; the corpus is only read) and in
an in-memory FTS5 table (title and body, tokenize='porter unicode61 remove_diacritics 2').
Then it asks both engines the same single-word queries and compares, per query, the number
of notes found (notesvc's total, FTS5's count(*)) and the overlap of the two top-10s
(notesvc's ranking against bm25(notes, 0, 2, 1): title weighted 2, like notesvc).

The queries are picked from the corpus itself, deterministically (--seed): words of 5 or
more ASCII letters found in 3 to 500 notes, each followed by one inflected form of it that
the corpus holds (-s, -es, -ed, -ing, -ion, -ly, -er, with a final e dropped where English
drops it), until there are --queries of them.

It prints the share of queries whose notesvc hit count is within +-10 % of FTS5's (both
zero counts as within), the queries that find nothing in each engine, the median top-10
overlap (shared notes / the shorter list, over queries where both find something), the
indexing time (notesvc's first sync: scan, read, analyse, write; FTS5's inserts), and the
queries that differ most. FTS5's porter is Martin Porter's original algorithm, not Porter2
(Snowball English): some differences are expected whichever stemmer notesvc runs.

Standard library and notesvc only. --json writes the figures to a file.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
INFLECTIONS = ("s", "es", "ed", "ing", "ion", "ly", "er")


def load_notesvc(path: Path):
    """Import notesvc from a file (the repo's, or another version's) under its own name."""
    spec = importlib.util.spec_from_file_location("notesvc", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["notesvc"] = module  # dataclasses look the module up while it loads
    spec.loader.exec_module(module)
    return module


def read_notes(notes_dir: Path) -> list:
    """Return [(path relative to notes_dir, text)] sorted by path."""
    out = []
    for folder, _dirs, files in os.walk(notes_dir):
        for name in files:
            if name.endswith(".md"):
                p = Path(folder, name)
                out.append((p.relative_to(notes_dir).as_posix(), p.read_text(encoding="utf-8")))
    return sorted(out)


def pick_queries(notesvc, notes: list, count: int, seed: int) -> list:
    """Return count query words: seeded base words, each with one inflected form."""
    df: dict = {}
    for _, text in notes:
        for w in set(notesvc.WORD_RE.findall(notesvc.fold(text))):
            df[w] = df.get(w, 0) + 1
    base = sorted(
        w for w, n in df.items() if len(w) >= 5 and w.isascii() and w.isalpha() and 3 <= n <= 500
    )
    random.Random(seed).shuffle(base)
    queries: list = []
    seen: set = set()
    for w in base:
        if len(queries) >= count:
            break
        if w in seen:
            continue
        queries.append(w)
        seen.add(w)
        root = w[:-1] if w.endswith("e") else w
        forms = [w + s for s in INFLECTIONS] + [root + s for s in ("ed", "ing", "ion", "er")]
        for form in forms:
            if form in df and form not in seen and len(queries) < count:
                queries.append(form)
                seen.add(form)
                break
    return queries


def build_notesvc(notesvc, corpus: Path, state: Path):
    store = notesvc.NoteStore(corpus / "notes", state / "trash")
    index = notesvc.SearchIndex.open(state, store)
    t = time.perf_counter()
    index.sync()  # scan, read, analyse, write the segment files and the commit
    return index, time.perf_counter() - t


def build_fts5(notes: list, tokenchars: str = ""):
    db = sqlite3.connect(":memory:")
    extra = f" tokenchars ''{tokenchars}''" if tokenchars else ""
    db.execute(
        "CREATE VIRTUAL TABLE notes USING fts5(path UNINDEXED, title, body, "
        f"tokenize='porter unicode61 remove_diacritics 2{extra}')"
    )
    t = time.perf_counter()
    with db:
        for path, text in notes:
            title = text.split("\n", 1)[0].lstrip("# ")
            db.execute("INSERT INTO notes VALUES (?, ?, ?)", (path, title, text))
    return db, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", type=Path, default=Path.home() / "corpus" / "10k")
    ap.add_argument("--notesvc", type=Path, default=HERE.parent / "notesvc.py")
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--seed", type=int, default=15)
    ap.add_argument("--show", type=int, default=15, help="list this many largest differences")
    ap.add_argument("--json", type=Path, help="write the figures here as JSON")
    args = ap.parse_args()
    corpus = args.corpus.expanduser()
    if not (corpus / "notes").is_dir():
        sys.exit(f"{corpus}/notes not found: build it with ../shared/bench/corpus.py")
    notesvc = load_notesvc(args.notesvc)
    notes = read_notes(corpus / "notes")
    queries = pick_queries(notesvc, notes, args.queries, args.seed)

    state = Path(tempfile.mkdtemp(prefix="bench-recall-"))
    try:
        index, n_build = build_notesvc(notesvc, corpus, state)
        mine = {}
        for q in queries:
            total, hits = index.search(notesvc.Query(q), "", 10, 0)  # total: all the hits
            mine[q] = (total, [key(h[0]) for h in hits])
        index.close()
    finally:
        shutil.rmtree(state, ignore_errors=True)
    print(f"notesvc: {args.notesvc}  format {notesvc.INDEX_FORMAT[-1]}")
    print(f"corpus: {corpus} ({len(notes)} notes), {len(queries)} queries (seed {args.seed})")
    print(f"index time: notesvc {n_build:.2f} s (first sync)")
    result = {
        "notesvc": str(args.notesvc),
        "index_format": list(notesvc.INDEX_FORMAT),
        "notes": len(notes),
        "queries": queries,
        "index_seconds_notesvc": round(n_build, 2),
        "zero_hits_notesvc": [q for q in queries if mine[q][0] == 0],
    }
    # FTS5 as bench_search.py runs it (the reference), then with "_" as a letter:
    # notesvc's tokens are \w+ (nl_langinfo is one word), unicode61 splits at "_"; the second
    # comparison leaves the stemmers as the only difference.
    for name, tokenchars in (("fts5", ""), ("fts5_underscore", "_")):
        db, f_build = build_fts5(notes, tokenchars)
        rows = []
        for q in queries:
            fq = '"' + q.replace('"', '""') + '"'
            (count,) = db.execute(
                "SELECT count(*) FROM notes WHERE notes MATCH ?", (fq,)
            ).fetchone()
            top = db.execute(
                "SELECT path FROM notes WHERE notes MATCH ? "
                "ORDER BY bm25(notes, 0.0, 2.0, 1.0) LIMIT 10",
                (fq,),
            )
            theirs = [key(r[0]) for r in top]
            total, ours = mine[q]
            shorter = min(len(ours), len(theirs))
            overlap = len(set(ours) & set(theirs)) / shorter if shorter else None
            rows.append((q, total, count, overlap))
        db.close()
        overlaps = [o for *_, o in rows if o is not None]
        figures = {
            "index_seconds": round(f_build, 2),
            "within_10pct": sum(within(t, c) for _, t, c, _ in rows) / len(rows),
            "zero_hits": [q for q, _, c, _ in rows if c == 0],
            "median_top10_overlap": statistics.median(overlaps) if overlaps else None,
            "rows": rows,
        }
        result[name] = figures
        print(
            f"\n-- against {name} (tokenize: porter unicode61{' tokenchars _' * bool(tokenchars)})"
        )
        print(f"   FTS5 index time {f_build:.2f} s")
        print(f"   hit count within +-10 % of FTS5: {figures['within_10pct']:.1%}")
        print(f"   zero hits: notesvc {result['zero_hits_notesvc']}, FTS5 {figures['zero_hits']}")
        print(f"   median top-10 overlap: {figures['median_top10_overlap']}")
        worst = sorted(rows, key=lambda r: -abs(r[1] - r[2]) / max(r[2], 1))[: args.show]
        print("   largest differences (query: notesvc hits / FTS5 hits, notesvc's stem):")
        for q, t, c, _ in worst:
            print(f"     {q:<18} {t:>5} / {c:<5} {notesvc.stem(q)}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


def key(path: str) -> str:
    """A note's path as both engines can compare it (notesvc's start with notes/)."""
    return path[6:] if path.startswith("notes/") else path


def within(total: int, count: int) -> bool:
    """Whether notesvc's hit count is within +-10 % of FTS5's (both zero counts too)."""
    return abs(total - count) <= 0.10 * count if count else total == 0


if __name__ == "__main__":
    main()
