"""Benchmark: how fast notesvc.py starts and how much memory it holds idle, against another
revision of the same file (not run by the tests).

    python bench/bench_start.py                      # this checkout against HEAD~1's file
    python bench/bench_start.py --base c7645b5 --runs 15

Each file is copied alone into an empty folder (as a user drops it onto a Pi), run once to
write its bytecode cache, then the two are started in turn, A B A B …, each on a fresh
empty root with default settings: the wall time from the process's start to its "listening
on" line, and its RssAnon 3 s later (idle: setup not done, no notes). Reported as the
median of each and the median of the pairwise ratios new/base. Goal (the house issue): the
generated file within 5 % of the one-file original on both.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE / "bench"))
from _common import print_header, server_env  # noqa: E402


def rss_anon(pid: int) -> float:
    """Return the process's RssAnon in MB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return 0.0


def start_once(program: Path, root: Path) -> tuple:
    """Return (seconds to listening, RssAnon MB 3 s later) of one start of program."""
    cmd = [sys.executable, str(program), "--host", "127.0.0.1", "--port", "0", "--root", str(root)]
    began = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=server_env()
    )  # without PYTHONDONTWRITEBYTECODE, or no bytecode cache would be written
    try:
        for line in proc.stderr:
            if re.search(r"listening on http", line):
                ready = time.perf_counter() - began
                break
        else:
            raise SystemExit(f"{program} did not start")
        time.sleep(3)
        return ready, rss_anon(proc.pid)
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD~1", help="the revision to compare with")
    parser.add_argument("--runs", type=int, default=11, help="starts of each file")
    args = parser.parse_args()
    print_header()
    with tempfile.TemporaryDirectory(prefix="notesvc-start-") as tmp:
        files = {}
        for name in ("base", "new"):
            (Path(tmp) / name).mkdir()
            files[name] = Path(tmp) / name / "notesvc.py"
        base = subprocess.run(
            ["git", "show", f"{args.base}:notesvc.py"], cwd=HERE, capture_output=True, check=True
        )
        files["base"].write_bytes(base.stdout)
        shutil.copy(HERE / "notesvc.py", files["new"])
        got: dict = {"base": [], "new": []}
        for k in range(args.runs + 1):
            for name in ("base", "new"):
                root = Path(tmp) / f"root-{name}-{k}"
                result = start_once(files[name], root)
                if k:  # the first start of each writes its bytecode cache: not counted
                    got[name].append(result)
        print(f"{args.runs} starts each, default settings, empty root, Python {sys.version[:6]}")
        for i, what in ((0, "start to listening (s)"), (1, "idle RssAnon (MB)")):
            b = [r[i] for r in got["base"]]
            n = [r[i] for r in got["new"]]
            ratio = statistics.median(x / y for x, y in zip(n, b))
            print(
                f"{what:24} base {statistics.median(b):7.3f}  new {statistics.median(n):7.3f}"
                f"  new/base {ratio:.3f} (pairs {min(x / y for x, y in zip(n, b)):.3f}"
                f"-{max(x / y for x, y in zip(n, b)):.3f})"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
