"""Benchmark: what a note's history costs on disk, kept loose and then packed (not run by
the tests).

    python bench/bench_history.py --notes 1000 --edits 10 [--json /tmp/h.json]

The first --notes notes of the real-text corpus (../shared/bench/corpus.py, built into
~/corpus/10k when missing) on a real server over loopback. Every note is edited --edits
times by `PUT`, round after round, each edit what a person does: a paragraph added from
another note, a sentence changed, a paragraph removed. Then:

- loose: the versions as the saves keep them (one file each: a hard link of the replaced
  note), their bytes and what they take on disk (allocated blocks);
- packed: the server's retention sweep, run as it runs an hour later (the history's clock
  moved on), moves them into versions.db; its size and the CPU it took;
- the reference, in the same run: git, given the same rounds as commits (`git add -A;
  git commit` per round) and then `git gc` (git's packs, with deltas: the design the
  packs follow, written in C);
- reading a version over HTTP (`GET /notes/:path/versions/:id`, one keep-alive
  connection), p50 and p95 loose and packed.
Goal: the packed history <= 0.5x its loose bytes; reported against git's.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _common import print_header  # noqa: E402
from bench_merge import start  # noqa: E402
from bench_search import SHARED_BENCH, note_paths, real_corpus  # noqa: E402

import notesvc  # noqa: E402


def edit(text: str, rnd: random.Random, donor: str) -> str:
    """One person's edit of a note: add a paragraph, change a sentence, or drop one."""
    paragraphs = text.split("\n\n")
    kind = rnd.random()
    if kind < 0.5 or len(paragraphs) < 3:  # add a paragraph from another note
        extra = [p for p in donor.split("\n\n")[1:] if p.strip()] or ["A new thought."]
        paragraphs.insert(rnd.randrange(1, len(paragraphs) + 1), rnd.choice(extra))
    elif kind < 0.85:  # change a sentence
        i = rnd.randrange(1, len(paragraphs))
        words = paragraphs[i].split(" ")
        at = rnd.randrange(len(words))
        words[at : at + 3] = ["changed", "this", "today"]
        paragraphs[i] = " ".join(words)
    else:  # drop a paragraph
        del paragraphs[rnd.randrange(1, len(paragraphs))]
    return "\n\n".join(paragraphs)


def tree_size(folder: Path) -> tuple:
    """Return (files, bytes, bytes allocated on disk) under folder."""
    files = size = blocks = 0
    for dirpath, _, names in os.walk(folder):
        for name in names:
            st = os.lstat(os.path.join(dirpath, name))
            files, size, blocks = files + 1, size + st.st_size, blocks + st.st_blocks * 512
    return files, size, blocks


def wait_idle(pid: int, timeout: float = 60) -> None:
    """Wait until the process used under 2 % of a core for a second (its start is done)."""
    ticks = os.sysconf("SC_CLK_TCK")

    def cpu() -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / ticks

    deadline, last = time.monotonic() + timeout, cpu()
    while time.monotonic() < deadline:
        time.sleep(1)
        now = cpu()
        if now - last < 0.02:
            return
        last = now


def read_versions(port: int, picks: list, key: str) -> dict:
    """Time `GET .../versions/:id` of each (path, id): p50/p95 in ms."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    times = []
    for path, vid in picks + picks:  # the first pass warms up (and waits out a start)
        url = f"/api/v1/notes/{urllib.parse.quote(path, safe='')}/versions/{vid}"
        t = time.perf_counter()
        conn.request("GET", url, headers={"X-Service-Key": key})
        resp = conn.getresponse()
        resp.read()
        times.append((time.perf_counter() - t) * 1000)
        assert resp.status == 200, (resp.status, url)
    conn.close()
    times = sorted(times[len(picks) :])
    return {"p50": statistics.median(times), "p95": times[int(0.95 * (len(times) - 1))]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--notes", type=int, default=1000)
    ap.add_argument("--edits", type=int, default=10)
    ap.add_argument("--corpus-dir", help="a corpus of 10,000 notes (default ~/corpus/10k)")
    ap.add_argument("--reads", type=int, default=300)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--keep", help="work in this (empty) folder and keep it")
    args = ap.parse_args()
    print_header()
    corpus = real_corpus(10000, args.corpus_dir, SHARED_BENCH / "corpus.py")
    paths = note_paths(corpus)[: args.notes]
    rnd = random.Random(5)
    res: dict = {"notes": len(paths), "edits": args.edits}
    with tempfile.TemporaryDirectory() as temp:
        work = args.keep or temp
        root, repo = Path(work) / "root", Path(work) / "git"
        for path in paths:
            for top in (root, repo):
                (top / path).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(corpus / path, top / path)
        res["notesBytes"] = tree_size(root / "notes")[1]
        git = ["git", "-C", str(repo), "-c", "user.name=b", "-c", "user.email=b@b"]
        subprocess.run([*git, "init", "-q"], check=True)
        subprocess.run([*git, "add", "-A"], check=True)
        subprocess.run([*git, "commit", "-qm", "start"], check=True)

        proc, port = start(str(root))
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("GET", "/api/v1/system/setup")
        key = json.loads(conn.getresponse().read())["data"]["apiKey"]
        texts = {p: (root / p).read_text(encoding="utf-8") for p in paths}
        t0 = time.perf_counter()
        for r in range(args.edits):
            for path in paths:
                texts[path] = edit(texts[path], rnd, texts[rnd.choice(paths)])
                body = json.dumps({"content": texts[path]}).encode()
                url = f"/api/v1/notes/{urllib.parse.quote(path, safe='')}"
                conn.request(
                    "PUT", url, body, {"Content-Type": "application/json", "X-Service-Key": key}
                )
                resp = conn.getresponse()
                resp.read()
                assert resp.status == 200, resp.status
                (repo / path).write_text(texts[path], encoding="utf-8")
            subprocess.run([*git, "add", "-A"], check=True)
            subprocess.run([*git, "commit", "-qm", f"round {r}"], check=True)
        res["editSeconds"] = time.perf_counter() - t0
        picks = []
        for path in rnd.sample(paths, min(args.reads, len(paths))):
            url = f"/api/v1/notes/{urllib.parse.quote(path, safe='')}/versions?limit=100"
            conn.request("GET", url, headers={"X-Service-Key": key})
            found = json.loads(conn.getresponse().read())["data"]["versions"]
            picks.append((path, rnd.choice(found)["id"]))
        conn.close()
        wait_idle(proc.pid)
        res["readLoose"] = read_versions(port, picks, key)
        proc.terminate()
        proc.wait(30)

        history = root / ".notesvc" / "history"
        stats = [os.lstat(f) for f in history.rglob("*") if notesvc.VERSION_ID_RE.match(f.name)]
        res["loose"] = {
            "files": len(stats),
            "bytes": sum(st.st_size for st in stats),
            "onDisk": sum(st.st_blocks * 512 for st in stats),
            "historyBytes": tree_size(history)[1],
        }

        store = notesvc.HistoryStore(history, 50, 90, clock=lambda: time.time() + 7200)
        cpu = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        for folder in store.folders():
            store.sweep(folder)
        store.collect()
        store.heads.prune()  # as the server's sweep does: first copies no note needs
        store.close()
        after = resource.getrusage(resource.RUSAGE_SELF)
        res["packSeconds"] = time.perf_counter() - t0
        res["packCpuSeconds"] = after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime
        db = os.lstat(history / "versions.db")
        res["packed"] = {
            "files": sum(bool(notesvc.VERSION_ID_RE.match(f.name)) for f in history.rglob("*")),
            "bytes": db.st_size,
            "onDisk": db.st_blocks * 512,
            "historyBytes": tree_size(history)[1],
        }

        subprocess.run([*git, "gc", "-q"], check=True)
        res["git"] = {"objectsBytes": tree_size(repo / ".git" / "objects")[1]}

        proc, port = start(str(root))
        try:
            wait_idle(proc.pid)
            res["readPacked"] = read_versions(port, picks, key)
        finally:
            proc.terminate()
            proc.wait(30)

    loose, packed = res["loose"], res["packed"]
    print(f"{res['notes']} notes ({res['notesBytes'] / 1e6:.2f} MB), {args.edits} edits each")
    print(
        f"loose:  {loose['files']} version files, {loose['bytes'] / 1e6:.2f} MB "
        f"({loose['onDisk'] / 1e6:.2f} MB on disk); "
        f"history folder {loose['historyBytes'] / 1e6:.2f} MB"
    )
    print(
        f"packed: versions.db {packed['bytes'] / 1e6:.2f} MB, {packed['files']} files left, "
        f"in {res['packSeconds']:.1f} s (CPU {res['packCpuSeconds']:.1f} s); "
        f"history folder {packed['historyBytes'] / 1e6:.2f} MB"
    )
    print(f"git gc of the same rounds: {res['git']['objectsBytes'] / 1e6:.2f} MB of objects")
    print(
        f"packed x loose: {packed['bytes'] / loose['bytes']:.3f} of the bytes, "
        f"{packed['onDisk'] / loose['onDisk']:.3f} on disk; history folder x git's objects: "
        f"{packed['historyBytes'] / res['git']['objectsBytes']:.2f}"
    )
    for kind in ("readLoose", "readPacked"):
        print(f"{kind}: p50 {res[kind]['p50']:.2f} ms, p95 {res[kind]['p95']:.2f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
