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

Real text, over HTTP (item 6 of the issue on measuring again):

    python bench/bench_search.py --corpus real --notes 10000 --http --json /tmp/s10k.json

--corpus real takes the notes of ../shared/bench/corpus.py (built into ~/corpus/<n> when
missing, or --corpus-dir; never inside the repository) and queries drawn from its real
vocabulary (make_real_queries); the in-process mode above works on it too. --http runs every
server with the default settings (rescans on) unless --setting NAME=VALUE (repeatable) says
otherwise; the header and every figure name corpus, size, settings changed and commit. It
copies the notes into a work folder and measures: a real server's first start on them (no
.notesvc/) until every note of a seeded random sample of 100 (--sample, --sample-seed) is
found by a search for its three rarest words, raw wall time from process start and CPU
(user+sys of the server, its reaped children and its live ones, from /proc; nothing
subtracted), against FTS5's build of the same notes in a child process (wall from its start
to its exit, CPU from getrusage); once that server's background merges are done (its index
folder unchanged for 5 s; a server merging answers several times slower), the restarted
server's RssAnon 5 s after its first search and after
800 queries; query latency per kind over keep-alive HTTP (one client, best of --repeat, the
two servers' passes taking turns; then again with each query's tries taking turns, reported
as "in turn": measure_paired) against FTS5 behind the same route chain: a notesvc server of
its own on an empty scratch root whose plugin (bench/fts5_plugin.py) answers the search
from the FTS5 file, so waitress, its threads, the middleware, the key check and the envelope
are the same and only the index differs (p50 goal <= 1.0x, p95 <= 0.8x); tantivy in
process as an anchor when `import tantivy` works (skipped otherwise); /folders/tree?depth=1
against /health; req/s with 16 keep-alive connections (wrk -t1 when installed, else a Python
client in its own process) of GET and PUT of a note against fts5_server.py's bare JSON route
(Bottle under waitress, no key: what they cost by themselves).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
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
import urllib.parse
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


def measure_paired(runs: dict, queries: dict, repeat: int, by_query: bool = False) -> dict:
    """measure_queries for several engines at once, {name: per kind}: their passes over a
    kind's queries take turns (the order turned round at every pass), so a machine that
    slows down for a while slows each engine alike instead of the one whose turn it was.

    `by_query`: the turns are each query's tries instead, so every request meets a server
    whose caches the other one has just used: a search as a person makes it, now and then,
    rather than one of a run of searches (each engine slower; ours more: it runs more
    Python per request, and more of it falls out of the CPU's caches)."""
    names = list(runs)
    out: dict = {name: {} for name in names}
    for kind, qs in queries.items():
        for q in qs:  # warm-up pass
            for name in names:
                runs[name](q)
        best = {name: [float("inf")] * len(qs) for name in names}

        def timed(name: str, i: int, q: str, best: dict = best) -> None:
            t = time.perf_counter()
            runs[name](q)
            best[name][i] = min(best[name][i], time.perf_counter() - t)

        for r in range(repeat):
            if by_query:
                for i, q in enumerate(qs):
                    for name in names if (i + r) % 2 == 0 else names[::-1]:
                        timed(name, i, q)
            else:
                for name in names if r % 2 == 0 else names[::-1]:
                    for i, q in enumerate(qs):
                        timed(name, i, q)
        for name in names:
            out[name][kind] = percentiles(best[name])
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


def start_server(root: Path, env: dict, auth_mode: str = "none"):
    """Start `notesvc.py serve` on root; return (process, port, start time)."""
    cmd = [sys.executable, str(HERE.parent / "notesvc.py"), "--root", str(root)]
    cmd += ["--host", "127.0.0.1", "--port", "0", "--auth-mode", auth_mode]
    full_env = user_env()
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


def user_env() -> dict:
    """The environment a server gets: this one without SERVICE_* settings and without
    PYTHONDONTWRITEBYTECODE, which this machine sets and a user's shell does not (it would
    make every start compile notesvc.py twice instead of once: 0.3 s of CPU here)."""
    skip = ("PYTHONDONTWRITEBYTECODE",)
    return {k: v for k, v in os.environ.items() if not k.startswith("SERVICE_") and k not in skip}


def warm_bytecode() -> None:
    """Run notesvc.py once (--help) so its cached bytecode is written, as any run before
    the one measured leaves it on a user's machine."""
    cmd = [sys.executable, str(HERE.parent / "notesvc.py"), "--help"]
    subprocess.run(cmd, stdout=subprocess.DEVNULL, env=user_env(), check=True)


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
    """RssAnon <= 50 MB at 10k notes, 70 MB at 50k and at 100k (with default settings,
    after 800 queries; 100k's goal was 90 MB before the benches ran at default settings)."""
    return 50.0 if n <= 10_000 else 70.0


# --- real text (--corpus real), the real server over HTTP (--http), tantivy -------------

SHARED_BENCH = HERE.parent.parent / "shared" / "bench"  # /work/shared/bench: corpus.py
PROBE_RE = re.compile(r"[a-z0-9]*[a-z][a-z0-9]*")  # a run of letters and digits (lowered)
WORD_RE = re.compile(r"\w+")  # a word as notesvc and FTS5 both see it whole (is_word)
STOP_WORDS = frozenset(
    """a about above after again against all am an and any are as at be because been before
    being below between both but by can could did do does doing down during each few for from
    further had has have having he her here hers herself him himself his how i if in into is
    it its itself just me more most my myself no nor not now of off on once only or other our
    ours ourselves out over own same she should so some such than that the their theirs them
    themselves then there these they this those through to too under until up very was we
    were what when where which while who whom why will with would you your yours yourself
    yourselves also may must shall might one two use used using see set get gets new""".split()
)
KINDS = ("common word", "rare word", "2-3 word AND", "phrase", "prefix")


def size_label(n: int) -> str:
    return f"{n // 1000}k" if n % 1000 == 0 else str(n)


def real_corpus(n: int, folder: str | None, script: Path) -> Path:
    """The folder of an N-note corpus of real text (shared/bench/corpus.py), built when
    missing; never inside this repository."""
    out = Path(folder).expanduser() if folder else Path.home() / "corpus" / size_label(n)
    if HERE.parent == out.resolve() or HERE.parent in out.resolve().parents:
        raise SystemExit(f"{out}: keep a corpus outside the repository")
    if not (out / "manifest.json").exists():
        print(f"building the real-text corpus: {script} --n {n} --out {out}", flush=True)
        subprocess.run([sys.executable, str(script), "--n", str(n), "--out", str(out)], check=True)
    manifest = json.loads((out / "manifest.json").read_text())
    if manifest["n"] != n:
        raise SystemExit(f"{out} holds {manifest['n']} notes, not {n}")
    return out


def note_paths(root: Path) -> list:
    """Every note's path ("notes/..."), sorted as strings."""
    return sorted(p.relative_to(root).as_posix() for p in (root / "notes").rglob("*.md"))


def read_vocabulary(corpus: Path) -> dict:
    """term -> number of notes holding it, counted over the notes with \\w+ as a word. The
    corpus's vocab.tsv splits at "_" (as FTS5's unicode61 does; notesvc before 208fdec did
    not): an alphabetic \\w+ word (is_word) is one whole word for every engine."""
    df: dict = {}
    for path in note_paths(corpus):
        for t in set(WORD_RE.findall((corpus / path).read_text(encoding="utf-8").lower())):
            df[t] = df.get(t, 0) + 1
    return df


def is_word(t: str) -> bool:
    return t.isascii() and t.isalpha() and len(t) >= 3 and t not in STOP_WORDS


def make_real_queries(
    corpus: Path, n: int, per_kind: int, seed: int = 11, df: dict | None = None
) -> dict:
    """Queries drawn from the corpus's real vocabulary and notes, deterministic (seeded):
    rare = a word in 2-20 notes; common = a word in > 10 % of the notes (no stop word);
    AND = 2-3 mid-frequency words (0.2-5 % of the notes) of one real note; phrase = two
    adjacent words of a real note (not both stop words); prefix = the first 3-5 letters of
    a word in >= 0.1 % of the notes, then *."""
    rnd = random.Random(seed)
    df = df if df is not None else read_vocabulary(corpus)
    common = sorted(t for t, d in df.items() if d > 0.10 * n and is_word(t))
    rare = sorted(t for t, d in df.items() if 2 <= d <= 20 and is_word(t) and len(t) >= 4)
    prefixes = sorted(t for t, d in df.items() if d >= 0.001 * n and is_word(t) and len(t) >= 6)
    paths = note_paths(corpus)
    ands, phrases = [], []
    for path in rnd.sample(paths, min(len(paths), 20 * per_kind)):
        if len(ands) >= per_kind and len(phrases) >= per_kind:
            break
        tokens = WORD_RE.findall((corpus / path).read_text(encoding="utf-8").lower())
        mid = sorted({t for t in tokens if is_word(t) and 0.002 * n <= df.get(t, 0) <= 0.05 * n})
        if len(ands) < per_kind and len(mid) >= 3:
            ands.append(" ".join(rnd.sample(mid, rnd.choice((2, 3)))))
        pairs = [
            (a, b)
            for a, b in zip(tokens, tokens[1:])
            if a.isascii() and a.isalpha() and b.isascii() and b.isalpha()
            if not (a in STOP_WORDS and b in STOP_WORDS)
        ]
        if len(phrases) < per_kind and pairs:
            a, b = rnd.choice(pairs)
            phrases.append(f'"{a} {b}"')
    queries = {
        "common word": [rnd.choice(common) for _ in range(per_kind)],
        "rare word": [rnd.choice(rare) for _ in range(per_kind)],
        "2-3 word AND": ands,
        "phrase": phrases,
        "prefix": [],
    }
    for _ in range(per_kind):
        word = rnd.choice(prefixes)
        queries["prefix"].append(word[: rnd.randint(3, min(5, len(word) - 1))] + "*")
    return queries


def rarest_word(df: dict, corpus: Path, path: str) -> str:
    """The word of that note in the fewest notes (a search for it finds the note)."""
    tokens = WORD_RE.findall((corpus / path).read_text(encoding="utf-8").lower())
    words = [t for t in tokens if is_word(t)] or [t for t in tokens if t.isalpha()]
    return min(words, key=lambda t: (df.get(t, 0), t))


def build_fts5(root: Path, db_path: Path) -> float:
    """FTS5's first build of the notes under root: read the files, insert, commit (s)."""
    if db_path.exists():
        db_path.unlink()
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
                rel = os.path.relpath(p, root).replace(os.sep, "/")
                db.execute("INSERT INTO notes VALUES (?, ?, ?)", (rel, title, body))
    db.close()
    return time.perf_counter() - t


class Client:
    """One keep-alive HTTP/1.1 connection (http.client), reconnecting when it is closed."""

    def __init__(self, port: int, headers: dict | None = None):
        self.port, self.headers = port, dict(headers or {})
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple:
        headers = dict(self.headers)
        if body is not None:
            headers["Content-Type"] = "application/json"
        for attempt in (0, 1):
            try:
                self.conn.request(method, path, body=body, headers=headers)
                r = self.conn.getresponse()
                return r.status, r.read()
            except (http.client.HTTPException, ConnectionError):
                self.conn.close()
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def get(self, path: str) -> bytes:
        status, body = self.request("GET", path)
        if status != 200:
            raise RuntimeError(f"GET {path}: {status} {body[:300]!r}")
        return body

    def close(self) -> None:
        self.conn.close()


def search_path(prefix: str, q: str, limit: int = 10) -> str:
    return f"{prefix}?q={urllib.parse.quote(q, safe='')}&limit={limit}"


def tree_rss(pid: int) -> dict:
    """RssAnon of the process and the sum over it and its children (a helper process)."""
    own = proc_status(pid)
    total = own["RssAnon"]
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            for child in (task / "children").read_text().split():
                with contextlib.suppress(OSError, KeyError):
                    total += proc_status(child)["RssAnon"]
    return {"rss_anon": own["RssAnon"], "rss_file": own["RssFile"], "rss_anon_tree": total}


def cpu_seconds(pid: int | str) -> float:
    """CPU time (user + system) of a process, its waited-for children and its live ones:
    on a shared machine this is less at the mercy of the load than the wall clock."""
    tick = os.sysconf("SC_CLK_TCK")

    def own(p) -> float:
        fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        return sum(int(x) for x in fields[11:15]) / tick  # utime stime cutime cstime

    total = own(pid)
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            for child in (task / "children").read_text().split():
                with contextlib.suppress(OSError):
                    total += own(child)
    return total


def server_key(root: Path) -> dict:
    state = json.loads((root / ".notesvc" / "state.json").read_text())
    return {"X-Service-Key": state["apiKey"]}


def stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def start_fts5_chain(db_path: Path, work: Path) -> tuple:
    """Start the reference a search is measured against: a notesvc server of its own (an
    empty scratch root, default settings, its key) whose plugin bench/fts5_plugin.py
    answers `GET /api/v1/plugins/fts5ref/search` from the FTS5 file, so that a query to it
    passes through the same route chain as one to notesvc (waitress's threads, middleware,
    key check, envelope); return (process, port, its key's headers)."""
    scratch = work / "fts5ref"
    if scratch.exists():
        shutil.rmtree(scratch)
    plugins = scratch / ".notesvc" / "plugins"
    plugins.mkdir(parents=True)
    shutil.copy(HERE / "fts5_plugin.py", plugins / "fts5ref.py")
    (scratch / "notes").mkdir()
    proc, port, _ = start_server(scratch, {"FTS5REF_DB": str(db_path)}, "api-key")
    return proc, port, server_key(scratch)


FTS5_SEARCH = "/api/v1/plugins/fts5ref/search"


def start_fts5_server(db_path: Path, threads: int):
    cmd = [sys.executable, str(HERE / "fts5_server.py"), "--db", str(db_path)]
    cmd += ["--threads", str(threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        if m:
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return proc, int(m.group(1))
    raise RuntimeError("the FTS5 server did not start")


def probe_query(df: dict, root: Path, path: str) -> str:
    """A query that must find that note: its three rarest words, all of them (AND). One
    rare word is not enough: stemming can widen a word in 1 note to hundreds of hits
    ("anli"), and the note falls out of a top-100."""
    text = (root / path).read_text(encoding="utf-8").lower()
    words = sorted(set(t for t in WORD_RE.findall(text) if is_word(t)))
    if not words or df.get(min(words, key=lambda t: df.get(t, 0)), 0) > 20:
        # no rare word (a note of symbol names): its letter-and-digit runs, which both
        # engines take as words (an underscore parts them)
        words = sorted(set(t for t in PROBE_RE.findall(text) if len(t) >= 3) - STOP_WORDS)
    words.sort(key=lambda t: (df.get(t, 0), t))
    return " ".join(words[:3])


def measure_first_start(root: Path, probes: dict, settings: dict, limit: float = 3600.0) -> dict:
    """A server's first start on a folder of notes without .notesvc/ (the given settings,
    none by default): from process start until every note of `probes` (path -> a query that
    must find it; a seeded random sample) is found by its query, polling in order and
    stopping a round at the first note not found yet (a note once found stays found). The
    wall time is raw (process start included, nothing subtracted); the CPU time is
    cpu_seconds() of the server at that moment: its own user+sys, its waited-for children's
    (cutime+cstime: an index helper process it has stopped) and its live children's (read
    from /proc/<pid>/task/*/children: a helper still at work)."""
    proc, port, started = start_server(root, settings, "api-key")  # searches meanwhile
    try:
        listening = time.perf_counter() - started
        client, polls, requests = Client(port, server_key(root)), 0, 0
        missing, first_found = list(probes), None
        while True:
            if time.perf_counter() - started > limit:
                raise RuntimeError(
                    f"{len(missing)} of {len(probes)} sample notes not found within {limit:.0f}"
                    " s: " + ", ".join(f"{p} ({probes[p]!r})" for p in missing[:5])
                )
            polls += 1
            while missing:
                path, requests = missing[0], requests + 1
                status, body = client.request(
                    "GET", search_path("/api/v1/search", probes[path], 100)
                )
                results = json.loads(body)["data"]["results"] if status == 200 else []
                if not any(r["path"] == path for r in results):
                    break
                missing.pop(0)
                first_found = first_found or time.perf_counter() - started
            if not missing:
                done = time.perf_counter() - started
                cpu = cpu_seconds(proc.pid)
                break
            if polls % 600 == 0:  # about every 30 s: a probe that never finds its note shows
                print(f"first start: {len(missing)} sample notes not found yet", flush=True)
            time.sleep(0.05)
        time.sleep(5)
        mem = tree_rss(proc.pid)
        client.close()
        settled = wait_for_merges(root / ".notesvc" / "index")
        return {
            "listening": listening,
            "complete": done,
            "cpu": cpu,
            "sample": len(probes),
            "polls": polls,
            "requests": requests,
            "first_found": first_found,
            "merges_done_after": settled,
            **mem,
        }
    finally:
        stop(proc)


def measure_fts5_build(root: Path, db_path: Path) -> dict:
    """FTS5's first build of the same notes in a child process (build_fts5 via --child
    fts5-build), measured as the server's first start is: wall from process start to its
    exit, CPU = its user+sys (getrusage(RUSAGE_CHILDREN) around the reaped child)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    cmd = [sys.executable, __file__, "--child", "fts5-build", "--root", str(root)]
    t = time.perf_counter()
    out = subprocess.run([*cmd, "--queries", str(db_path)], capture_output=True, text=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode:
        raise RuntimeError(f"the FTS5 build failed: {out.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall": wall, "cpu": cpu, "inner": json.loads(out.stdout.strip().splitlines()[-1])}


def wait_for_merges(folder: Path, quiet: float = 5.0, limit: float = 300.0) -> float:
    """Wait until the index folder's files (names and sizes) stay the same for `quiet`
    seconds: the first start's background merges are done, and the restarted server opens
    a settled index, as a server restarted later does. Return the seconds waited."""
    t0 = time.perf_counter()
    last, since = None, t0
    while time.perf_counter() - t0 < limit:
        try:
            now = sorted((p.name, p.stat().st_size) for p in folder.iterdir())
        except OSError:  # a file renamed or removed while listed: a merge is under way
            now = None
        if now is None or now != last:
            last, since = now, time.perf_counter()
        elif time.perf_counter() - since >= quiet:
            break
        time.sleep(0.25)
    return time.perf_counter() - t0


def busy_core() -> subprocess.Popen:
    """A process that keeps one core busy (a Python busy loop at normal priority): the
    other work a Pi or a shared machine runs while notesvc starts."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def first_starts(args, root: Path, probes: dict, settings: dict, work: Path) -> list:
    """--first-start-only: the first start against FTS5's build, --first-start-runs times,
    each on a fresh .notesvc/, with the second core idle (as far as the machine allows) and
    then kept busy by busy_core(), in turns; each run's load average is recorded."""
    warm_bytecode()
    runs = []
    for i in range(args.first_start_runs):
        for busy in (False, True):
            shutil.rmtree(root / ".notesvc", ignore_errors=True)
            (work / "fts.db").unlink(missing_ok=True)
            os.sync()
            loop = busy_core() if busy else None
            try:
                time.sleep(1.0 if busy else 0)  # the loop running before the server starts
                load = os.getloadavg()[0]
                fst = measure_first_start(root, probes, settings)
                build = measure_fts5_build(root, work / "fts.db")
            finally:
                if loop is not None:
                    loop.kill()
                    loop.wait()
            run = {
                "run": i + 1,
                "second_core": "busy" if busy else "idle",
                "load": load,
                "wall": fst["complete"],
                "cpu": fst["cpu"],
                "fts5_wall": build["wall"],
                "fts5_cpu": build["cpu"],
            }
            runs.append(run)
            print(
                f"first start, run {run['run']}, the other core {run['second_core']} (load "
                f"{load:.1f}): {fst['complete']:.2f} s wall, {fst['cpu']:.2f} s CPU; FTS5 build "
                f"{build['wall']:.2f} s wall, {build['cpu']:.2f} s CPU: "
                f"{fst['complete'] / build['wall']:.2f}x wall, "
                f"{fst['cpu'] / build['cpu']:.2f}x CPU",
                flush=True,
            )
    return runs


def timed_requests(client: Client, paths: list) -> list:
    out = []
    for p in paths:
        t = time.perf_counter()
        client.get(p)
        out.append(time.perf_counter() - t)
    return out


def load(url: str, seconds: int, conns: int, headers: dict, put_body: str | None) -> dict:
    """Requests per second with `conns` concurrent keep-alive connections for `seconds`:
    wrk (one client thread, its own process) when installed, else a Python client of
    `conns` threads in a child process. PUT bodies differ by a counter (a real change)."""
    if shutil.which("wrk"):
        with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
            for k, v in headers.items():
                f.write(f'wrk.headers["{k}"] = "{v}"\n')
            if put_body is not None:
                escaped = json.dumps(put_body)[1:-1]
                f.write(
                    'wrk.headers["Content-Type"] = "application/json"\n'
                    f"local base = [==[{escaped}]==]\nlocal n = 0\n"
                    "request = function()\n  n = n + 1\n"
                    '  return wrk.format("PUT", nil, nil, \'{"content": "\' .. base .. '
                    "'\\\\nedit ' .. n .. '\"}')\nend\n"
                )
        try:
            cmd = ["wrk", "-t1", f"-c{conns}", f"-d{seconds}s", "-s", f.name, url]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        finally:
            os.unlink(f.name)
        rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
        bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
        errors = re.search(r"Socket errors: (.*)", out)
        return {
            "client": "wrk -t1",
            "rps": rps,
            "non_2xx": int(bad.group(1)) if bad else 0,
            "socket_errors": errors.group(1) if errors else "",
        }
    spec = json.dumps(
        {"url": url, "seconds": seconds, "conns": conns, "headers": headers, "put_body": put_body}
    )
    out = subprocess.run(
        [sys.executable, __file__, "--child", "load", "--queries", spec],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def child_load(spec: dict) -> dict:
    """The Python load generator: `conns` threads, one keep-alive connection each."""
    parsed = urllib.parse.urlsplit(spec["url"])
    path = parsed.path + (f"?{parsed.query}" if parsed.query else "")
    stop_at = time.perf_counter() + spec["seconds"]
    counts, errors = [0] * spec["conns"], [0] * spec["conns"]

    def worker(i):
        client, n = Client(parsed.port, spec["headers"]), 0
        while time.perf_counter() < stop_at:
            n += 1
            body = None
            if spec["put_body"] is not None:
                body = json.dumps({"content": spec["put_body"] + f"\nedit {i} {n}"}).encode()
            status, _ = client.request("PUT" if body else "GET", path, body)
            counts[i] += 1
            errors[i] += status >= 300
        client.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(spec["conns"])]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return {
        "client": f"python, {spec['conns']} threads",
        "rps": sum(counts) / (time.perf_counter() - t),
        "non_2xx": sum(errors),
        "socket_errors": "",
    }


def tantivy_query(tantivy, index, schema, q: str):
    if q.endswith("*"):  # the query parser has no prefix*: a regex on the (stemmed) terms
        pattern = re.escape(q[:-1]) + ".*"
        return tantivy.Query.boolean_query(
            [
                (tantivy.Occur.Should, tantivy.Query.regex_query(schema, field, pattern))
                for field in ("title", "body")
            ]
        )
    return index.parse_query(q, ["title", "body"], {"title": 2.0}, conjunction_by_default=True)


def child_tantivy(root: Path, queries: dict, repeat: int) -> dict:
    """tantivy (the Python binding) in process: an in-RAM index of the same notes (en_stem
    tokenizer), top-10 with a snippet of the body, as FTS5's reference does."""
    import tantivy

    builder = tantivy.SchemaBuilder()
    builder.add_text_field("path", stored=True, tokenizer_name="raw")
    builder.add_text_field("title", stored=True, tokenizer_name="en_stem")
    builder.add_text_field("body", stored=True, tokenizer_name="en_stem")
    schema = builder.build()
    index = tantivy.Index(schema)
    t = time.perf_counter()
    writer = index.writer(heap_size=100_000_000, num_threads=1)
    for path in note_paths(root):
        body = (root / path).read_text(encoding="utf-8")
        title = body.split("\n", 1)[0].lstrip("# ")
        writer.add_document(tantivy.Document(path=path, title=title, body=body))
    writer.commit()
    writer.wait_merging_threads()
    build = time.perf_counter() - t
    index.reload()
    searcher = index.searcher()

    def run(q):
        query = tantivy_query(tantivy, index, schema, q)
        gen = tantivy.SnippetGenerator.create(searcher, query, schema, "body")
        out = []
        for _score, address in searcher.search(query, 10, count=False).hits:
            doc = searcher.doc(address)
            out.append((doc["path"][0], gen.snippet_from_doc(doc).fragment()))
        return out

    return {
        "version": getattr(tantivy, "__version__", "?"),
        "build": build,
        "queries": measure_queries(run, queries, repeat),
    }


def parse_settings(items: list) -> dict:
    """--setting NAME=VALUE (repeatable) -> {NAME: VALUE}: the only settings a run changes."""
    out = {}
    for item in items or ():
        name, sep, value = item.partition("=")
        if not sep or not name.startswith("SERVICE_"):
            raise SystemExit(f"--setting {item!r}: expected SERVICE_NAME=VALUE")
        out[name] = value
    return out


def settings_text(settings: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in settings.items()) or "none (defaults)"


def run_label(res: dict) -> str:
    """What every figure of a run is of: corpus, size, settings, commit."""
    return (
        f"corpus {res['corpus']}, {size_label(res['n'])} notes, settings "
        f"{settings_text(res.get('settings', {}))}, commit {res.get('notesvc_commit', '?')}"
    )


def run_http(args, corpus: Path | None, work: Path) -> dict:
    """The real server over HTTP against FTS5 behind Bottle (and tantivy in process)."""
    settings = parse_settings(args.setting)
    res: dict = {"n": args.notes, "corpus": args.corpus, "settings": settings}
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        git = ["git", "-C", str(HERE.parent)]
        res["notesvc_commit"] = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip() + (
            "+dirty"
            if subprocess.run(
                [*git, "diff", "--quiet", "HEAD", "--", "notesvc.py"], check=False
            ).returncode
            else ""
        )
    root = work / "root"
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    if corpus is not None:
        shutil.copytree(corpus / "notes", root / "notes")
        df = read_vocabulary(root)
        queries = make_real_queries(root, args.notes, args.per_kind, df=df)
    else:
        info = make_corpus(root, args.notes)
        queries = make_queries(info, args.per_kind)
        df = read_vocabulary(root)
    qfile = work / "queries.json"
    qfile.write_text(json.dumps(queries))
    paths = note_paths(root)
    word = rarest_word(df, root, paths[-1])  # the restarted server's first search
    sample = random.Random(args.sample_seed).sample(paths, min(args.sample, len(paths)))
    probes = {p: probe_query(df, root, p) for p in sample}
    res["queries_per_kind"] = {k: len(v) for k, v in queries.items()}
    res["load_before"] = os.getloadavg()
    res["label"] = run_label(res)
    print(
        f"{len(paths)} notes in {root}; queries {res['queries_per_kind']}\n"
        f"settings changed: {settings_text(settings)}; commit "
        f"{res.get('notesvc_commit', '?')}; servers run without PYTHONDONTWRITEBYTECODE "
        f"(notesvc.py's bytecode cached, as after any earlier run)\n{res['label']}",
        flush=True,
    )

    if args.first_start_only:
        res["first_starts"] = first_starts(args, root, probes, settings, work)
        return res

    # first start on a folder without .notesvc/, against FTS5's build of the same notes
    warm_bytecode()
    os.sync()
    res["first_start"] = measure_first_start(root, probes, settings)
    res["first_start"]["sample_seed"] = args.sample_seed
    res["first_start"]["probes"] = probes
    os.sync()
    db_path = work / "fts.db"
    build = measure_fts5_build(root, db_path)
    res["fts5_build"], res["fts5_build_cpu"] = build["wall"], build["cpu"]
    res["fts5_build_inner"] = build["inner"]
    fst = res["first_start"]
    print(
        f"first start to all {fst['sample']} sample notes found: {fst['complete']:.2f} s wall, "
        f"{fst['cpu']:.2f} s CPU; FTS5 build {res['fts5_build']:.2f} s wall, "
        f"{res['fts5_build_cpu']:.2f} s CPU [{res['label']}]",
        flush=True,
    )

    # the restarted server: memory, search latency, tree, health, req/s
    proc, port, started = start_server(root, settings, "api-key")
    fproc, fport = start_fts5_server(db_path, args.threads)  # the bare route
    cproc, cport, cheaders = start_fts5_chain(db_path, work)  # FTS5 behind our route chain
    try:
        headers = server_key(root)
        ns = Client(port, headers)
        while True:
            status, _ = ns.request("GET", search_path("/api/v1/search", word))
            if status == 200:
                break
            time.sleep(0.05)
        res["restart_first_search"] = time.perf_counter() - started
        time.sleep(5)
        res["mem_after_first"] = tree_rss(proc.pid)
        count = {"n": 0}
        res["mem_every_400"] = []  # RssAnon over the queries: bounded, or growing?

        def run_ns(q):
            ns.get(search_path("/api/v1/search", q))
            count["n"] += 1
            if count["n"] == 800:
                res["mem_after_800"] = tree_rss(proc.pid)
            if count["n"] % 400 == 0:
                res["mem_every_400"].append(round(tree_rss(proc.pid)["rss_anon"], 1))

        ref, chain = Client(fport), Client(cport, cheaders)
        engines = {"notesvc": run_ns, "fts5": lambda q: chain.get(search_path(FTS5_SEARCH, q))}
        paired = measure_paired(engines, queries, args.repeat)
        res["notesvc"], res["fts5"] = paired["notesvc"], paired["fts5"]
        res["mem_after_all"] = tree_rss(proc.pid)
        res["queries_sent"] = count["n"]
        res.setdefault("mem_after_800", res["mem_after_all"])  # fewer queries than 800
        res["fts5_server_rss_anon"] = proc_status(cproc.pid)["RssAnon"]
        print("notesvc and FTS5 over HTTP, pass by pass in turn: done", flush=True)
        res["by_query"] = measure_paired(engines, queries, args.repeat, by_query=True)
        print("the same, query by query in turn: done", flush=True)
        res["bare"] = percentiles(timed_requests(ref, ["/bare"] * 300))
        tree, health = [], []
        for _ in range(300):  # interleaved, one keep-alive client
            tree += timed_requests(ns, ["/api/v1/folders/tree?depth=1"])
            health += timed_requests(ns, ["/api/v1/health"])
        res["tree"], res["health"] = percentiles(tree), percentiles(health)
        note = paths[len(paths) // 2]
        note_url = "/api/v1/notes/" + urllib.parse.quote(note, safe="/")
        ns.get(note_url)
        content = (root / note).read_text(encoding="utf-8")
        ns.close()
        ref.close()
        chain.close()
        base = "http://127.0.0.1"
        res["load_note"] = note
        res["rps_get"] = load(f"{base}:{port}{note_url}", args.seconds, 16, headers, None)
        res["rps_bare"] = load(f"{base}:{fport}/bare", args.seconds, 16, {}, None)
        res["rps_put"] = load(f"{base}:{port}{note_url}", args.seconds, 16, headers, content)
        res["mem_after_load"] = tree_rss(proc.pid)
        print("load: done", flush=True)
    finally:
        stop(proc)
        stop(fproc)
        stop(cproc)
    try:
        import tantivy  # noqa: F401
    except ImportError:
        res["tantivy"] = None
        print("tantivy is not importable (pip install tantivy): skipped", flush=True)
    else:
        res["tantivy"] = run_child("tantivy", root, qfile, args.repeat)
        print("tantivy: done", flush=True)
    res["load_after"] = os.getloadavg()
    return res


def report_http(res: dict) -> list:
    """Print the table of goals; return its rows."""
    n = res["n"]
    ns, fts, tv = res["notesvc"], res["fts5"], res["tantivy"]
    rows = []

    def row(measure, ours, ref, unit, goal="", met=None):
        rows.append(
            {
                "measure": measure,
                "notesvc": ours,
                "reference": ref,
                "unit": unit,
                "ratio": ours / ref if ref else None,
                "goal": goal,
                "met": met,
            }
        )

    for kind in KINDS:
        for p in ("p50", "p95"):
            ours, ref = ns[kind][p], fts[kind][p]
            goal = 1.0 if p == "p50" else 0.8
            row(f"{kind} {p} × FTS5/HTTP", ours, ref, "ms", f"<= {goal}x", ours <= goal * ref)
    alone = res.get("by_query")  # each request after one to the other server
    for kind in KINDS if alone else ():
        ours, ref = alone["notesvc"][kind]["p50"], alone["fts5"][kind]["p50"]
        row(f"{kind} p50, in turn × FTS5", ours, ref, "ms", "reported")
    if tv:
        for kind in KINDS:
            row(
                f"{kind} p50 × tantivy",
                ns[kind]["p50"],
                tv["queries"][kind]["p50"],
                "ms",
                "reported",
            )
    goal = memory_goal(n)
    for key, label in (
        ("mem_after_first", "5 s after 1st search"),
        ("mem_after_800", "after 800 queries"),
    ):
        ours = res[key]["rss_anon"]
        row(f"RssAnon, {label}", ours, None, "MB", f"<= {goal:.0f} MB", ours <= goal)
    fs, fsc = res["first_start"]["complete"], res["first_start"]["cpu"]
    row(
        "first start × FTS5 build",
        fs,
        res["fts5_build"],
        "s",
        "<= 2.5x",
        fs <= 2.5 * res["fts5_build"],
    )
    row(
        "  the same in CPU seconds",
        fsc,
        res["fts5_build_cpu"],
        "s",
        "<= 2.5x",
        fsc <= 2.5 * res["fts5_build_cpu"],
    )
    t50, h50 = res["tree"]["p50"], res["health"]["p50"]
    row("tree?depth=1 p50 × health", t50, h50, "ms", "<= 4x", t50 <= 4 * h50)
    g, b, pt = res["rps_get"]["rps"], res["rps_bare"]["rps"], res["rps_put"]["rps"]
    row("GET note req/s × bare", g, b, "req/s", ">= 0.6x", g >= 0.6 * b)
    row("PUT note req/s × bare", pt, b, "req/s", "reported")

    label = res.get("label") or run_label(res)
    for r in rows:
        r["run"] = label
    print(
        f"\n{label}; load average "
        f"{' '.join(f'{x:.2f}' for x in res['load_before'])} before, "
        f"{' '.join(f'{x:.2f}' for x in res['load_after'])} after"
    )
    print(f"{'measure':<32} {'notesvc':>10} {'reference':>10} {'ratio':>7}  {'goal':<11} met?")
    for r in rows:
        ref = f"{r['reference']:>10.2f}" if r["reference"] is not None else f"{'':>10}"
        ratio = f"{r['ratio']:>7.2f}" if r["ratio"] is not None else f"{'':>7}"
        met = "" if r["met"] is None else "met" if r["met"] else "MISSED"
        print(
            f"{r['measure']:<32} {r['notesvc']:>10.2f} {ref} {ratio}  {r['goal']:<11} {met}"
            f"  ({r['unit']})"
        )
    fst = res["first_start"]
    print(
        f"\nfirst start [{label}]: listening after {fst['listening']:.2f} s; the first of "
        f"{fst['sample']} sample notes (seed {fst['sample_seed']}) found after "
        f"{fst['first_found']:.2f} s, all of them after {fst['complete']:.2f} s wall from process "
        f"start ({fst['cpu']:.2f} s CPU: the server's user+sys, its reaped children's and its "
        f"live children's; {fst['polls']} polls, {fst['requests']} searches; nothing "
        f"subtracted); FTS5 build of the same notes {res['fts5_build']:.2f} s wall, "
        f"{res['fts5_build_cpu']:.2f} s CPU (a child process, start to exit); that server's "
        "RssAnon 5 s later "
        f"{fst['rss_anon']:.1f} MB (with children {fst['rss_anon_tree']:.1f}); its merges"
        f" done {fst.get('merges_done_after', 0):.0f} s after that.\n"
        f"restarted server [{label}]: first search {res['restart_first_search']:.2f} s after "
        f"process start; RssAnon {res['mem_after_first']['rss_anon']:.1f} / "
        f"{res['mem_after_800']['rss_anon']:.1f} / {res['mem_after_all']['rss_anon']:.1f} / "
        f"{res['mem_after_load']['rss_anon']:.1f} MB (5 s after the first search / after 800 "
        f"queries / after all {res['queries_sent']} / after the req/s runs; RssFile "
        f"{res['mem_after_all']['rss_file']:.1f} MB; every 400 queries: "
        f"{', '.join(map(str, res.get('mem_every_400', [])))}); the FTS5 reference "
        f"server's RssAnon {res['fts5_server_rss_anon']:.1f} MB.\n"
        f"bare route p50 {res['bare']['p50']:.2f} ms, /health p50 {res['health']['p50']:.2f} ms,"
        f" tree p95 {res['tree']['p95']:.2f} ms. req/s with 16 connections "
        f"({res['rps_get']['client']}, {res['rps_get']}; bare {res['rps_bare']}; "
        f"PUT {res['rps_put']})."
    )
    if tv:
        print(
            f"tantivy {tv['version']}: in-RAM build {tv['build']:.2f} s (FTS5 "
            f"{res['fts5_build']:.2f} s); p50 / p95 per kind, ms: "
            + ", ".join(f"{k} {v['p50']:.3f} / {v['p95']:.3f}" for k, v in tv["queries"].items())
        )
    else:
        print("tantivy: skipped (not importable)")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--notes", type=int, default=10000)
    ap.add_argument("--per-kind", type=int, default=100, help="queries per kind")
    ap.add_argument("--repeat", type=int, default=3, help="timed passes over the queries")
    ap.add_argument("--root", help="keep the corpus in this folder (reused when it is there)")
    ap.add_argument(
        "--corpus",
        choices=("synthetic", "real"),
        default="synthetic",
        help="synthetic (made here) or real English text (shared/bench/corpus.py)",
    )
    ap.add_argument("--corpus-dir", help="real-text corpus folder (default ~/corpus/<n>)")
    ap.add_argument("--corpus-script", default=str(SHARED_BENCH / "corpus.py"))
    ap.add_argument(
        "--http",
        action="store_true",
        help="the real server over HTTP against FTS5 behind Bottle (bench/fts5_server.py), "
        "tantivy in process when importable, memory, first start, tree, req/s",
    )
    ap.add_argument("--workdir", help="--http: the work folder (default: a temporary one)")
    ap.add_argument("--threads", type=int, default=8, help="--http: the FTS5 server's threads")
    ap.add_argument("--seconds", type=int, default=10, help="--http: seconds per req/s run")
    ap.add_argument(
        "--setting",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="--http: a setting the servers get (repeatable; default none: as users run it)",
    )
    ap.add_argument(
        "--sample", type=int, default=100, help="--http: notes that first start must find"
    )
    ap.add_argument("--sample-seed", type=int, default=45, help="--http: the sample's seed")
    ap.add_argument(
        "--first-start-only",
        action="store_true",
        help="--http: only the first start against FTS5's build, with the other core idle "
        "and then busy (a busy loop), --first-start-runs times",
    )
    ap.add_argument("--first-start-runs", type=int, default=2, help="--first-start-only")
    ap.add_argument("--json", help="write the results (and the table) as JSON to this file")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--queries", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child == "load":
        print(json.dumps(child_load(json.loads(args.queries))))
        return
    if args.child:
        fts5_build = args.child == "fts5-build"
        queries = (
            json.loads(Path(args.queries).read_text()) if args.queries and not fts5_build else {}
        )
        root = Path(args.root)
        if args.child == "build":
            result = child_build(root)
        elif args.child == "notesvc":
            result = child_notesvc(root, queries, args.repeat)
        elif args.child == "tantivy":
            result = child_tantivy(root, queries, args.repeat)
        elif args.child == "fts5-build":  # --queries: the database file
            result = {"build": build_fts5(root, Path(args.queries))}
        else:
            result = child_fts5(root, queries, args.repeat, args.child)
        print(json.dumps(result))
        return
    corpus = None
    if args.corpus == "real":
        corpus = real_corpus(args.notes, args.corpus_dir, Path(args.corpus_script))
    if args.http:
        with contextlib.ExitStack() as stack:
            if args.workdir:
                work = Path(args.workdir)
                work.mkdir(parents=True, exist_ok=True)
            else:
                work = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            res = run_http(args, corpus, work)
        if args.json:  # before the report, which could fail
            Path(args.json).write_text(json.dumps({"results": res}, indent=1))
        if args.first_start_only:
            return
        rows = report_http(res)
        if args.json:
            Path(args.json).write_text(json.dumps({"results": res, "table": rows}, indent=1))
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
            if corpus is not None:  # a copy: the servers write .notesvc/ next to notes/
                shutil.copytree(corpus / "notes", root / "notes", dirs_exist_ok=True)
                queries = make_real_queries(corpus, args.notes, args.per_kind)
            else:
                queries = make_queries(make_corpus(root, args.notes), args.per_kind)
            qfile.write_text(json.dumps(queries))
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
    res["corpus"] = args.corpus
    report(args.notes, res)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": res}, indent=1))


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
