"""Benchmark: a server's memory through a restart's check (not run by the tests).

    python bench/bench_restart.py --notes 100000 --workdir /tmp/nsr100k

The real server (python notesvc.py) on loopback, on a copy of the real-text corpus
(bench_search.py --corpus real builds it into ~/corpus/<n>). In one run:

- settle: a start that indexes the notes, left until its merges end (the index folder
  unchanged for 5 s): what a restarted server finds;
- quiet: a restart with nothing changed (its check compares the notes and reads none);
- touched: a restart after every note's modification time moved (a restored backup, a
  `touch` of everything): the check reads all of them again.
RssAnon of the server (and, apart, of its helper processes) every 0.25 s, split into the
phases the server's log tells: starting (Python compiling notesvc.py: 60 MB for about a
second, given back once it listens), the check until the index reads notes (all of a
quiet restart), the reading, the merges that follow, settled. Goal (issue 28): the server's
RssAnon <= 50 / 70 / 90 MB at 10k / 50k / 100k notes through every phase.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_search  # noqa: E402 (the corpus)
from _common import print_header, server_env  # noqa: E402

LOG_PHASES = (  # a log line that ends a phase -> the phase that follows it
    (re.compile(r"listening on http"), "checking"),  # start-up: compiling this module
    (re.compile(r"index: a helper process \(pid \d+\) analyses"), "reading"),
    (re.compile(r"index: \d+ notes read"), "merging"),
)


def rss_anon(pid: int) -> float:
    """RssAnon of a process in MB (0 once it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    found = re.search(r"RssAnon:\s+(\d+)", status)
    return int(found.group(1)) / 1024 if found else 0.0


def children(pid: int) -> list:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def index_stamp(root: Path) -> tuple:
    folder = root / ".notesvc" / "index"
    return tuple(sorted((p.name, p.stat().st_size) for p in folder.glob("*")))


def run(notesvc: str, root: Path, seconds: float, settle: bool = False) -> dict:
    """Start a server on root; sample until `seconds` passed (settle: until the index
    folder stayed unchanged for 5 s after its check); return the peaks per phase."""
    cmd = [sys.executable, notesvc, "--root", str(root), "--host", "127.0.0.1", "--port", "0"]
    env = server_env()  # the defaults: its log (level info) names the phases
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    )
    phase, started, marks = ["starting"], time.monotonic(), {}

    def read_log() -> None:
        for line in proc.stderr:
            for pattern, after in LOG_PHASES:
                if pattern.search(line) and after not in marks:
                    marks[after] = round(time.monotonic() - started, 1)
                    phase[0] = after

    threading.Thread(target=read_log, daemon=True).start()
    peaks: dict = {}
    helper_peak, stamp, still = 0.0, None, time.monotonic()
    while time.monotonic() - started < seconds and proc.poll() is None:
        anon = rss_anon(proc.pid)
        helper_peak = max([helper_peak, *map(rss_anon, children(proc.pid))])
        now = phase[0]
        if now == "merging" and time.monotonic() - still >= 5 and "settled" not in marks:
            marks["settled"] = round(time.monotonic() - started, 1)
        if "settled" in marks:
            now = phase[0] = "settled"
            if settle:
                break
        if settle and "reading" not in marks and time.monotonic() - started >= 20:
            break  # an index that reads nothing: settled already
        peaks[now] = round(max(peaks.get(now, 0.0), anon), 1)
        new = index_stamp(root)
        if new != stamp:
            stamp, still = new, time.monotonic()
        time.sleep(0.25)
    settled_at = rss_anon(proc.pid)
    proc.terminate()
    proc.wait(30)
    return {
        "peaks": peaks,
        "end": round(settled_at, 1),
        "helper_peak": round(helper_peak, 1),
        "marks": marks,
    }


def touch_all(root: Path) -> int:
    later, n = time.time_ns() + 10**9, 0
    for path in (root / "notes").rglob("*.md"):
        os.utime(path, ns=(later, later))
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--notes", type=int, default=10000)
    ap.add_argument("--corpus-dir", help="the real-text corpus (default ~/corpus/<n>)")
    ap.add_argument("--workdir", required=True, help="where the copy lives (kept)")
    ap.add_argument("--notesvc", default=str(HERE.parent / "notesvc.py"))
    ap.add_argument("--seconds", type=float, default=0, help="per restart (0: by size)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    print_header()
    seconds = args.seconds or 60 + args.notes / 500
    corpus = bench_search.real_corpus(
        args.notes, args.corpus_dir, bench_search.SHARED_BENCH / "corpus.py"
    )
    root = Path(args.workdir) / "root"
    if not (root / "notes").is_dir():
        root.mkdir(parents=True)
        shutil.copytree(corpus / "notes", root / "notes")
    print(f"{args.notesvc} on {root} ({args.notes} notes)", flush=True)
    out = {"notes": args.notes, "notesvc": args.notesvc}
    out["settle"] = run(args.notesvc, root, 3 * seconds, settle=True)
    out["quiet"] = run(args.notesvc, root, seconds)
    out["touched_notes"] = touch_all(root)
    out["touched"] = run(args.notesvc, root, seconds)
    for name in ("quiet", "touched"):
        r = out[name]
        print(
            f"{name:8} peaks MB {r['peaks']}  at the end {r['end']}  helper {r['helper_peak']}"
            f"  marks (s) {r['marks']}",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
