"""Benchmark: note listing and folder tree on a generated tree (not run by the tests).

    python bench/bench_notes.py --notes 10000 --folders 500

Reports the median of several runs for GET /notes (one page and the full 1000 page),
GET /folders/tree, and as the reference measured in the same run a bare os.walk + stat
over the same tree (the least any tree listing must do).
"""

from __future__ import annotations

import argparse
import io
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import notesvc


def call(app, path: str) -> tuple:
    env = {
        "REQUEST_METHOD": "GET",
        "PATH_INFO": path.split("?")[0],
        "QUERY_STRING": path.split("?")[1] if "?" in path else "",
        "SERVER_NAME": "bench",
        "SERVER_PORT": "3000",
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(),
        "wsgi.errors": sys.stderr,
        "REMOTE_ADDR": "127.0.0.1",
    }
    status = []
    body = b"".join(app(env, lambda s, h, e=None: status.append(s)))
    return status[0], len(body)


def timed(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--notes", type=int, default=10000)
    ap.add_argument("--folders", type=int, default=500)
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    rnd = random.Random(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        notes = root / "notes"
        folders = [notes]
        for i in range(args.folders):
            parent = rnd.choice(folders[: max(1, len(folders) // 3)])
            folders.append(parent / f"folder-{i:04d}")
            folders[-1].mkdir(parents=True, exist_ok=True)
        for i in range(args.notes):
            folder = rnd.choice(folders)
            (folder / f"note-{i:05d}.md").write_text(f"# Note {i}\n\n" + "text " * 100)
        cfg = notesvc.load_config(
            env={
                "SERVICE_NOTES_ROOT": tmp,
                "SERVICE_AUTH_MODE": "none",
                "SERVICE_LOG_LEVEL": "warning",
            }
        )
        app = notesvc.create_app(cfg)
        notesvc.log.setLevel("WARNING")

        def walk():
            n = 0
            for folder, _dirs, files in os.walk(notes):
                for name in files:
                    os.stat(os.path.join(folder, name))
                    n += 1
            return n

        ref = timed(walk, args.runs)
        rows = [
            ("reference: os.walk + stat", ref),
            ("GET /folders/tree", timed(lambda: call(app, "/api/v1/folders/tree"), args.runs)),
            ("GET /notes (limit 100)", timed(lambda: call(app, "/api/v1/notes"), args.runs)),
            (
                "GET /notes (limit 1000)",
                timed(lambda: call(app, "/api/v1/notes?limit=1000"), args.runs),
            ),
        ]
        status, size = call(app, "/api/v1/folders/tree")
        print(
            f"{args.notes} notes in {args.folders} folders; tree response {size} bytes ({status})"
        )
        print(f"{'what':<28} {'median ms':>10} {'x reference':>12}")
        for name, ms in rows:
            print(f"{name:<28} {ms:>10.1f} {ms / ref:>12.2f}")


if __name__ == "__main__":
    main()
