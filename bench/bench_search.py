"""Benchmark: notesvc's search index against SQLite FTS5, measured in one run.

    python bench/bench_search.py --notes 10000

Builds a deterministic corpus of English-looking notes (0.5-4 KB, a few hundred
folders, a Zipf-like vocabulary) in a temporary folder, then runs each engine in its
own child process (so RSS is comparable) and measures: first build from the files,
restart with a cache (notesvc), one-note update latency, query latency p50/p95/p99
per query kind (common word, rare word, 2-3 word AND, phrase, prefix), and RSS.

Both engines answer the same queries with a top-10 and snippets. FTS5 runs with
tokenize='porter unicode61 remove_diacritics 2' and bm25() ranking (title weighted 2,
like notesvc). Three FTS5 columns: "FTS5" gives the same top-10 with snippet(); notesvc's
answer also carries the total hit count, so "FTS5+cnt" adds FTS5's SELECT count(*) for the
very same answer; "FTS5bare" is the top-10 ranking alone (no snippets, no count), the
strictest reference.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

COMMON = """the of and to a in is that for it as was with be by on not he this are or his from
at which
but have an they you were her she there been one all we their has would when if so no more
out up into do any your what can time some them only other new could these two may first
then very after most also its made like over such our did even many must before through back
where much should well people just those how too being little state good under know last
three never make work year day way still great own see here house world thing life between
name now right long same life note idea plan garden kitchen project meeting email phone
paper book shelf drawer window morning evening week month family friend doctor school money
market travel train river mountain coffee recipe list photo music picture letter garage keys
spare blue flowerpot table chair light water bread""".split()

SYLLABLES = (
    "ba be bi bo bu ca co cu da de di do fa fe fi fo ga ge go ha he hi ho ka ke ki ko "
    "la le li lo lu ma me mi mo mu na ne ni no nu pa pe pi po ra re ri ro ru sa se si "
    "so su ta te ti to tu va ve vi vo wa we wi za ze zo ar er ir or ur an en in on un "
    "al el il ol st tr pl gr br cr dr fl sh ch th "
).split()


def make_vocabulary(size: int, rnd: random.Random) -> list:
    words = list(dict.fromkeys(COMMON))
    seen = set(words)
    while len(words) < size:
        w = "".join(rnd.choice(SYLLABLES) for _ in range(rnd.choice((2, 2, 3, 3, 3, 4))))
        w += rnd.choice(("", "", "", "s", "ing", "ed", "er", "ly", "tion"))
        if w not in seen:
            seen.add(w)
            words.append(w)
    return words


def zipf_cdf(n: int, s: float = 1.07) -> list:
    weights = [1.0 / (r**s) for r in range(1, n + 1)]
    total, acc, cdf = sum(weights), 0.0, []
    for w in weights:
        acc += w / total
        cdf.append(acc)
    return cdf


def make_corpus(root: Path, n_notes: int, seed: int = 7) -> dict:
    """Write the corpus under root/notes; return what the queries need."""
    rnd = random.Random(seed)
    vocab = make_vocabulary(max(20000, n_notes * 3), rnd)
    cdf = zipf_cdf(len(vocab))
    folders = [f"notes/area-{i:02d}" for i in range(20)]
    while len(folders) < 300:
        folders.append(f"{rnd.choice(folders)}/sub-{len(folders):03d}")
    bodies = []
    for i in range(n_notes):
        target = int(rnd.triangular(500, 4000, 700))
        words = rnd.choices(vocab, cum_weights=cdf, k=target // 5)
        title = " ".join(rnd.choices(vocab[30:3000], k=rnd.randint(2, 5))).capitalize()
        lines, line = [], []
        for w in words:
            line.append(w)
            if len(line) > rnd.randint(8, 18):
                lines.append(" ".join(line).capitalize() + ".")
                line = []
        body = f"# {title}\n\n" + "\n".join(lines) + "\n"
        path = root / rnd.choice(folders) / f"note-{i:05d}.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body[:4096], encoding="utf-8")
        if i < 2000:
            bodies.append(lines)
    return {"vocab": vocab, "sample_lines": bodies}


def make_queries(info: dict, per_kind: int, seed: int = 11) -> dict:
    rnd = random.Random(seed)
    vocab = info["vocab"]
    phrases = []
    while len(phrases) < per_kind:
        lines = rnd.choice(info["sample_lines"])
        if not lines:
            continue
        words = rnd.choice(lines).rstrip(".").lower().split()
        if len(words) > 3:
            j = rnd.randrange(len(words) - 2)
            phrases.append(f'"{words[j]} {words[j + 1]}"')
    return {
        "common word": [rnd.choice(vocab[10:120]) for _ in range(per_kind)],
        "rare word": [rnd.choice(vocab[4000:15000]) for _ in range(per_kind)],
        "2-3 word AND": [
            " ".join(rnd.sample(vocab[40:1500], rnd.choice((2, 3)))) for _ in range(per_kind)
        ],
        "phrase": phrases,
        "prefix": [rnd.choice(vocab[100:3000])[:3] + "*" for _ in range(per_kind)],
    }


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def percentiles(times: list) -> dict:
    ms = sorted(t * 1000 for t in times)

    def pick(p):
        return ms[min(len(ms) - 1, round(p / 100 * (len(ms) - 1)))]

    return {"p50": pick(50), "p95": pick(95), "p99": pick(99)}


def measure_queries(run, queries: dict, repeat: int) -> dict:
    out = {}
    for kind, qs in queries.items():
        for q in qs:  # warm-up pass
            run(q)
        times = []
        for _ in range(repeat):
            for q in qs:
                t = time.perf_counter()
                run(q)
                times.append(time.perf_counter() - t)
        out[kind] = percentiles(times)
    return out


def notesvc_config(root: Path):
    import notesvc

    notesvc.log.setLevel("WARNING")
    return notesvc, notesvc.load_config(
        env={"SERVICE_NOTES_ROOT": str(root), "SERVICE_RESCAN_SECONDS": "0"}
    )


def child_notesvc(root: Path, queries: dict, repeat: int) -> dict:
    notesvc, cfg = notesvc_config(root)
    cache = cfg.state_dir / "index.cache"
    if cache.exists():
        cache.unlink()
    t = time.perf_counter()
    svc = notesvc.Service(cfg)  # first build: scan, read and index every file
    build = time.perf_counter() - t
    svc._first_save.join()  # the cache is written in the background; time it on its own
    t = time.perf_counter()
    svc.save_index(force=True)
    save = time.perf_counter() - t
    index = svc.index
    paths = sorted(index.ids)[:200]
    updates = []
    for i, path in enumerate(paths):
        text = index.docs[index.ids[path]].text + f"\nedited {i} spare keys\n"
        t = time.perf_counter()
        index.add(path, text, len(text), i)
        updates.append(time.perf_counter() - t)

    def run(q):
        return index.search(notesvc.Query(q), "", 10, 0)

    lat = measure_queries(run, queries, repeat)
    return {
        "build": build,
        "save": save,
        "update": percentiles(updates),
        "queries": lat,
        "rss": rss_mb(),
        "cache_mb": cache.stat().st_size / 1e6,
    }


def child_restart(root: Path) -> dict:
    notesvc, cfg = notesvc_config(root)
    t = time.perf_counter()
    svc = notesvc.Service(cfg)  # restart: load the cache, check every file's size and mtime
    restart = time.perf_counter() - t
    assert svc.last_sync["read"] == 0, svc.last_sync
    t = time.perf_counter()
    svc.sync_index()  # what the periodic rescan costs on an unchanged tree
    rescan = time.perf_counter() - t
    return {"restart": restart, "rescan": rescan, "rss": rss_mb()}


def child_fts5(root: Path, queries: dict, repeat: int, mode: str) -> dict:
    db_path = Path(tempfile.mkdtemp()) / "fts.db"
    t = time.perf_counter()
    db = sqlite3.connect(db_path)
    db.execute(
        "CREATE VIRTUAL TABLE notes USING fts5(path UNINDEXED, title, body, "
        "tokenize='porter unicode61 remove_diacritics 2')"
    )
    with db:
        for folder, _dirs, files in os.walk(root / "notes"):
            for name in files:
                p = os.path.join(folder, name)
                with open(p, encoding="utf-8") as f:
                    body = f.read()
                title = body.split("\n", 1)[0].lstrip("# ")
                db.execute("INSERT INTO notes VALUES (?, ?, ?)", (p, title, body))
    build = time.perf_counter() - t
    rows = db.execute("SELECT rowid, body FROM notes LIMIT 200").fetchall()
    updates = []
    for i, (rowid, body) in enumerate(rows):
        t = time.perf_counter()
        with db:
            db.execute(
                "UPDATE notes SET body = ? WHERE rowid = ?",
                (body + f"\nedited {i} spare keys\n", rowid),
            )
        updates.append(time.perf_counter() - t)
    snippet = "" if mode == "fts5-bare" else "snippet(notes, 2, '', '', '…', 40), "
    top = (
        f"SELECT path, title, {snippet}bm25(notes, 0.0, 2.0, 1.0) "  # noqa: S608 (a constant)
        "FROM notes WHERE notes MATCH ? ORDER BY bm25(notes, 0.0, 2.0, 1.0) LIMIT 10"
    )
    count = "SELECT count(*) FROM notes WHERE notes MATCH ?"

    def run(q):
        rows = db.execute(top, (q,)).fetchall()
        if mode == "fts5+count":
            db.execute(count, (q,)).fetchone()
        return rows

    lat = measure_queries(run, queries, repeat)
    return {"build": build, "update": percentiles(updates), "queries": lat, "rss": rss_mb()}


def run_child(engine: str, root: Path, queries_file: Path, repeat: int) -> dict:
    os.sync()  # let the previous child's writes settle so they do not slow this one
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--child",
            engine,
            "--root",
            str(root),
            "--queries",
            str(queries_file),
            "--repeat",
            str(repeat),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--notes", type=int, default=10000)
    ap.add_argument("--per-kind", type=int, default=100, help="queries per kind")
    ap.add_argument("--repeat", type=int, default=3, help="timed passes over the queries")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--queries", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        queries = json.loads(Path(args.queries).read_text())
        root = Path(args.root)
        if args.child == "notesvc":
            result = child_notesvc(root, queries, args.repeat)
        elif args.child == "notesvc-restart":
            result = child_restart(root)
        else:
            result = child_fts5(root, queries, args.repeat, args.child)
        print(json.dumps(result))
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t = time.perf_counter()
        info = make_corpus(root, args.notes)
        size = sum(p.stat().st_size for p in (root / "notes").rglob("*.md")) / 1e6
        folders = sum(1 for p in (root / "notes").rglob("*") if p.is_dir())
        print(
            f"corpus: {args.notes} notes, {size:.1f} MB, {folders} folders, "
            f"made in {time.perf_counter() - t:.1f} s; python {sys.version.split()[0]}, "
            f"sqlite {sqlite3.sqlite_version}"
        )
        queries = make_queries(info, args.per_kind)
        qfile = root / "queries.json"
        qfile.write_text(json.dumps(queries))
        engines = ("notesvc", "notesvc-restart", "fts5", "fts5+count", "fts5-bare")
        res = {e: run_child(e, root, qfile, args.repeat) for e in engines}
    ns, rs, fts, ftsc, bare = (res[e] for e in engines)

    def row(name, a, b, c, d=None, unit="ms"):
        d = b if d is None else d
        print(
            f"{name:<26} {a:>9.2f} {b:>9.2f} {c:>10.2f} {d:>9.2f} "
            f"{a / b:>7.2f} {a / c:>8.2f} {a / d:>7.2f}  {unit}"
        )

    print(
        f"\n{'measure':<26} {'notesvc':>9} {'FTS5':>9} {'FTS5+cnt':>10} {'FTS5bare':>9} "
        f"{'xFTS5':>7} {'x+cnt':>8} {'xbare':>7}"
    )
    row("first build", ns["build"], fts["build"], ftsc["build"], bare["build"], "s")
    print(
        f"{'restart with cache':<26} {rs['restart']:>10.2f} {'-':>10} {'-':>12} "
        f"{'':>8} {'':>9}  s (cache {ns['cache_mb']:.0f} MB, written in the background in "
        f"{ns['save']:.2f} s; RSS after restart {rs['rss']:.0f} MB)"
    )
    print(
        f"{'rescan, nothing changed':<26} {rs['rescan'] * 1000:>10.2f} {'-':>10} {'-':>12} "
        f"{'':>8} {'':>9}  ms"
    )
    for p in ("p50", "p95"):
        row(
            f"one-note update {p}",
            ns["update"][p],
            fts["update"][p],
            ftsc["update"][p],
            bare["update"][p],
        )
    for kind in ns["queries"]:
        for p in ("p50", "p95", "p99"):
            row(
                f"{kind} {p}",
                ns["queries"][kind][p],
                fts["queries"][kind][p],
                ftsc["queries"][kind][p],
                bare["queries"][kind][p],
            )
    row("process RSS", ns["rss"], fts["rss"], ftsc["rss"], bare["rss"], "MB")


if __name__ == "__main__":
    main()
