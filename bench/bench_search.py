"""Benchmark: notesvc's search index against SQLite FTS5, measured in one run.

    python bench/bench_search.py --notes 10000
    python bench/bench_search.py --notes 100000 --root /tmp/corpus-100k   # keep the corpus

Builds a deterministic corpus of English-looking notes (0.5-4 KB, a few hundred
folders, a Zipf-like vocabulary) in a temporary folder (or --root, reused when it holds
one), then runs each engine in its own child process and measures:

- first build from the files (notesvc: scan, read, index, write the segment files and the
  commit; the background merge that follows is timed apart), its progress lines and the
  building process's peak RssAnon; the faster of two builds, against the fastest of
  FTS5's three (the machine may be shared with other work);
- restart: a real `notesvc.py` server on the built root, from process start to its first
  answered search, minus a server's process start to /api/v1/health on an empty root
  (the interpreter's own start is not the index's cost); its RssAnon and RssFile 5 s after
  that first search (the goal), and after the query run;
- one-note update latency, query latency p50/p95/p99 per kind (common word, rare word,
  2-3 word AND, phrase, prefix), in a process that opened the built index: percentiles
  over the notes (queries) of each one's best of --repeat tries, for both engines.

Both engines answer the same queries with a top-10 and snippets; notesvc's answer also
carries the total hit count. FTS5 runs with tokenize='porter unicode61 remove_diacritics 2'
and bm25() ranking (title weighted 2, like notesvc). Three FTS5 columns: "FTS5" gives the
same top-10 with snippet() (the reference of the goals); "FTS5+cnt" adds SELECT count(*)
for the very same answer; "FTS5bare" is the top-10 ranking alone. The last table lists
every goal of issue 15 as met or missed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
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


def proc_status(pid: int | str = "self") -> dict:
    """Return the memory lines of /proc/<pid>/status in MB (RssAnon, RssFile, VmHWM...)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if value.strip().endswith("kB"):
                out[key] = int(value.split()[0]) / 1024
    return out


def rss_mb() -> float:
    return proc_status().get("VmRSS", float("nan"))


def percentiles(times: list) -> dict:
    ms = sorted(t * 1000 for t in times)

    def pick(p):
        return ms[min(len(ms) - 1, round(p / 100 * (len(ms) - 1)))]

    return {"p50": pick(50), "p95": pick(95), "p99": pick(99)}


def measure_queries(run, queries: dict, repeat: int) -> dict:
    """Per kind: percentiles over the queries of each query's best time of `repeat` passes
    (the machine may be shared: the best of a few passes is the engine's own cost)."""
    out = {}
    for kind, qs in queries.items():
        for q in qs:  # warm-up pass
            run(q)
        best = [float("inf")] * len(qs)
        for _ in range(repeat):
            for i, q in enumerate(qs):
                t = time.perf_counter()
                run(q)
                best[i] = min(best[i], time.perf_counter() - t)
        out[kind] = percentiles(best)
    return out


def open_index(root: Path, fresh: bool):
    import notesvc

    notesvc.log.setLevel("INFO")
    state = root / ".notesvc"
    if fresh and state.exists():
        shutil.rmtree(state)
    state.mkdir(exist_ok=True)
    store = notesvc.NoteStore(root / "notes", state / "trash")
    return notesvc, notesvc.SearchIndex.open(state, store)


def child_build(root: Path) -> dict:
    """First build from the files, then the background merge, timed apart."""
    import logging

    stamps = []

    class Progress(logging.Handler):
        def emit(self, record):
            stamps.append(time.perf_counter())

    peak = {"anon": 0.0}
    done = threading.Event()

    def sample():  # /proc has no peak of RssAnon: sample it
        while not done.wait(0.05):
            peak["anon"] = max(peak["anon"], proc_status()["RssAnon"])

    threading.Thread(target=sample, daemon=True).start()
    t = time.perf_counter()
    notesvc, index = open_index(root, fresh=True)
    notesvc.log.addHandler(Progress())
    stamps.append(t)
    index.sync()  # scan, read, analyse, write segment files, commit
    build = time.perf_counter() - t
    stamps.append(time.perf_counter())
    segments = len(index._segs)
    t = time.perf_counter()
    index.maintain(force=True)  # what the background thread does next: merge
    merge = time.perf_counter() - t
    index.close()
    done.set()
    folder = root / ".notesvc" / "index"
    size = sum(p.stat().st_size for p in folder.iterdir())
    status = proc_status()
    return {
        "build": build,
        "merge": merge,
        "segments": segments,
        "segments_after": len([p for p in folder.iterdir() if p.suffix == ".seg"]),
        "index_mb": size / 1e6,
        "peak_rss": status["VmHWM"],
        "peak_anon": peak["anon"],
        "rss_anon": status["RssAnon"],
        "progress_gap": max(b - a for a, b in zip(stamps, stamps[1:])),
    }


def child_notesvc(root: Path, queries: dict, repeat: int) -> dict:
    """Open the built index (as a restarted server does), then update and query it."""
    notesvc, index = open_index(root, fresh=False)
    index.close()
    t = time.perf_counter()
    index = notesvc.SearchIndex.open(root / ".notesvc", index.notes)
    opened = time.perf_counter() - t
    index.sync()  # checksums and the check against the files (a restarted server's background)
    paths = sorted(index.paths())[:200]
    updates = [float("inf")] * len(paths)
    for edit in range(repeat):  # each note's best of `repeat` updates
        for i, path in enumerate(paths):
            text = (root / path).read_text(encoding="utf-8") + f"\nedited {edit} spare keys\n"
            t = time.perf_counter()
            index.add(path, text, len(text), i)
            updates[i] = min(updates[i], time.perf_counter() - t)

    def run(q):
        return index.search(notesvc.Query(q), "", 10, 0)

    lat = measure_queries(run, queries, repeat)
    status = proc_status()
    index.close()  # the next runs start from the same files: put the notes back as they were
    index = notesvc.SearchIndex.open(root / ".notesvc", index.notes)
    index.sync()
    index.close()
    return {
        "opened": opened,
        "update": percentiles(updates),
        "queries": lat,
        "rss": status["VmRSS"],
        "rss_anon": status["RssAnon"],
        "rss_file": status["RssFile"],
    }


def start_server(root: Path, env: dict):
    """Start `notesvc.py serve` on root; return (process, port, start time)."""
    cmd = [sys.executable, str(HERE.parent / "notesvc.py"), "--root", str(root)]
    cmd += ["--host", "127.0.0.1", "--port", "0", "--auth-mode", "none"]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SERVICE_")}
    full_env.update(env)
    started = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=full_env
    )
    for line in proc.stderr:
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        if m:
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep draining
            return proc, int(m.group(1)), started
    raise RuntimeError("the server did not start")


def first_answer(port: int, path: str, started: float) -> float:
    """Poll path until it answers 200; return seconds since started."""
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
                if r.status == 200:
                    json.loads(r.read())
                    return time.perf_counter() - started
        except (OSError, ValueError):
            time.sleep(0.002)


def measure_restart(root: Path, word: str) -> dict:
    """Restart time and memory of a real server that opens the built index."""
    with tempfile.TemporaryDirectory() as empty:
        proc, port, started = start_server(Path(empty), {})
        health = first_answer(port, "/api/v1/health", started)
        proc.terminate()
        proc.wait(30)
    proc, port, started = start_server(root, {})  # defaults: the check runs in the background
    try:
        answered = first_answer(port, f"/api/v1/search?q={word}", started)
        time.sleep(5)
        after = proc_status(proc.pid)
        return {
            "health": health,
            "first_search": answered,
            "restart": answered - health,
            "rss_anon": after["RssAnon"],
            "rss_file": after["RssFile"],
        }
    finally:
        proc.terminate()
        proc.wait(60)


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
    updates = [float("inf")] * len(rows)
    for edit in range(repeat):  # each note's best of `repeat` updates, as for notesvc
        for i, (rowid, body) in enumerate(rows):
            t = time.perf_counter()
            with db:
                db.execute(
                    "UPDATE notes SET body = ? WHERE rowid = ?",
                    (body + f"\nedited {edit} spare keys\n", rowid),
                )
            updates[i] = min(updates[i], time.perf_counter() - t)
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
    db.close()
    t = time.perf_counter()
    db = sqlite3.connect(db_path)
    db.execute(top, (queries["rare word"][0],)).fetchall()
    reopen = time.perf_counter() - t
    status = proc_status()
    return {
        "build": build,
        "update": percentiles(updates),
        "queries": lat,
        "rss": status["VmRSS"],
        "rss_anon": status["RssAnon"],
        "reopen": reopen,
    }


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


def memory_goal(n: int) -> float:
    """Issue 15: RssAnon <= 50 MB at 10k notes, 70 MB at 50k, 90 MB at 100k."""
    return 50.0 if n <= 10_000 else 70.0 if n <= 50_000 else 90.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--notes", type=int, default=10000)
    ap.add_argument("--per-kind", type=int, default=100, help="queries per kind")
    ap.add_argument("--repeat", type=int, default=3, help="timed passes over the queries")
    ap.add_argument("--root", help="keep the corpus in this folder (reused when it is there)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--queries", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        queries = json.loads(Path(args.queries).read_text()) if args.queries else {}
        root = Path(args.root)
        if args.child == "build":
            result = child_build(root)
        elif args.child == "notesvc":
            result = child_notesvc(root, queries, args.repeat)
        else:
            result = child_fts5(root, queries, args.repeat, args.child)
        print(json.dumps(result))
        return
    with contextlib.ExitStack() as stack:
        if args.root:
            root = Path(args.root)
            root.mkdir(parents=True, exist_ok=True)
        else:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        qfile = root / "queries.json"
        t = time.perf_counter()
        if not qfile.exists() or not (root / "notes").exists():
            info = make_corpus(root, args.notes)
            qfile.write_text(json.dumps(make_queries(info, args.per_kind)))
        queries = json.loads(qfile.read_text())
        files = list((root / "notes").rglob("*.md"))
        size = sum(p.stat().st_size for p in files) / 1e6
        print(
            f"corpus: {len(files)} notes, {size:.1f} MB, made or found in "
            f"{time.perf_counter() - t:.1f} s; python {sys.version.split()[0]}, "
            f"sqlite {sqlite3.sqlite_version}, {os.cpu_count()} cores",
            flush=True,
        )
        builds = [run_child("build", root, qfile, args.repeat) for _ in range(2)]
        res = {"build": min(builds, key=lambda b: b["build"])}  # the faster of two builds
        print(f"built: {[round(b['build'], 2) for b in builds]}; {res['build']}", flush=True)
        res["restart"] = measure_restart(root, queries["rare word"][0])
        print(f"restarted: {res['restart']}", flush=True)
        for engine in ("notesvc", "fts5", "fts5+count", "fts5-bare"):
            res[engine] = run_child(engine, root, qfile, args.repeat)
            print(f"{engine}: done", flush=True)
    report(args.notes, res)


def report(n: int, res: dict) -> None:
    b, r, ns = res["build"], res["restart"], res["notesvc"]
    fts, ftsc, bare = res["fts5"], res["fts5+count"], res["fts5-bare"]

    def row(name, a, x, y, z, unit="ms"):
        print(
            f"{name:<24} {a:>9.2f} {x:>9.2f} {y:>10.2f} {z:>9.2f} "
            f"{a / x:>7.2f} {a / y:>8.2f} {a / z:>7.2f}  {unit}"
        )

    print(
        f"\n{'measure':<24} {'notesvc':>9} {'FTS5':>9} {'FTS5+cnt':>10} {'FTS5bare':>9} "
        f"{'xFTS5':>7} {'x+cnt':>8} {'xbare':>7}"
    )
    row("first build", b["build"], fts["build"], ftsc["build"], bare["build"], "s")
    for p in ("p50", "p95"):
        row(f"one-note update {p}", *(e["update"][p] for e in (ns, fts, ftsc, bare)))
    for kind in ns["queries"]:
        for p in ("p50", "p95", "p99"):
            row(f"{kind} {p}", *(e["queries"][kind][p] for e in (ns, fts, ftsc, bare)))
    print(
        f"\nnotesvc: build wrote {b['segments']} segment files, merged in the background in "
        f"{b['merge']:.1f} s into {b['segments_after']} ({b['index_mb']:.0f} MB on disk); "
        f"building process peak RssAnon {b['peak_anon']:.0f} MB (peak RSS with the mapped "
        f"files {b['peak_rss']:.0f} MB; RssAnon at its end {b['rss_anon']:.0f} MB)."
        f"\nrestart: first answered search {r['first_search']:.3f} s "
        f"after process start, /health on an empty root {r['health']:.3f} s; the index opens "
        f"in {ns['opened'] * 1000:.1f} ms in process (FTS5 reopens in {fts['reopen'] * 1000:.1f}"
        f" ms).\nmemory: the restarted server 5 s after its first search: RssAnon "
        f"{r['rss_anon']:.1f} MB, RssFile {r['rss_file']:.1f} MB; the query process after "
        f"every query: RssAnon {ns['rss_anon']:.1f} MB, RssFile {ns['rss_file']:.1f} MB; FTS5's "
        f"process RssAnon {fts['rss_anon']:.1f} MB (VmRSS {fts['rss']:.1f} MB)."
    )
    goals = [
        (
            "RssAnon, opened server",
            r["rss_anon"],
            None,
            f"<= {memory_goal(n):.0f} MB",
            r["rss_anon"] <= memory_goal(n),
            "MB",
        ),
        ("restart to first search", r["restart"], None, "<= 0.3 s", r["restart"] <= 0.3, "s"),
        (
            "one-note update p50",
            ns["update"]["p50"],
            None,
            "<= 1.0 ms",
            ns["update"]["p50"] <= 1.0,
            "ms",
        ),
        (
            "one-note update p95",
            ns["update"]["p95"],
            None,
            "<= 3.0 ms",
            ns["update"]["p95"] <= 3.0,
            "ms",
        ),
    ]
    for kind in ns["queries"]:
        for p in ("p50", "p95"):
            ours, ref = ns["queries"][kind][p], fts["queries"][kind][p]
            goals.append((f"{kind} {p}", ours, ref, "<= 1.0x FTS5", ours <= ref, "ms"))
    fts_build = min(fts["build"], ftsc["build"], bare["build"])  # the fastest of its 3 builds
    goals.append(
        ("first build", b["build"], fts_build, "<= 1.5x FTS5", b["build"] <= 1.5 * fts_build, "s")
    )
    goals.append(
        (
            "progress lines, max gap",
            b["progress_gap"],
            None,
            "<= 5 s",
            b["progress_gap"] <= 5.0,
            "s",
        )
    )
    print(f"\ngoals of issue 15 at {n} notes:")
    print(f"{'goal':<26} {'notesvc':>10} {'FTS5':>9} {'ratio':>7}  {'wanted':<14} result")
    for name, ours, ref, wanted, met, unit in goals:
        ref_s = f"{ref:>9.2f}" if ref is not None else f"{'':>9}"
        ratio = f"{ours / ref:>7.2f}" if ref else f"{'':>7}"
        print(
            f"{name:<26} {ours:>7.2f} {unit:<2} {ref_s} {ratio}  {wanted:<14} "
            f"{'met' if met else 'MISSED'}"
        )


if __name__ == "__main__":
    main()
