"""Benchmark: request latency through a relay against direct, on loopback (not run by tests).

    python bench/bench_relay.py --requests 300

Starts a real relay (`notesvc.py relay`) and a real server registered with it, then times
GET /api/v1/notes/:path and POST /api/v1/search-like reads both ways, one request at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

NOTESVC = str(Path(__file__).resolve().parent.parent / "notesvc.py")


def start(*args: str, env: dict) -> tuple:
    proc = subprocess.Popen(
        [sys.executable, NOTESVC, *args, "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "SERVICE_LOG_LEVEL": "warning", **env},
    )
    ready, port = threading.Event(), []

    def read():
        for line in proc.stderr:
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            if m:
                port.append(int(m.group(1)))
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    ready.wait(20)
    return proc, f"http://127.0.0.1:{port[0]}"


def get(url: str, key: str) -> dict:
    req = urllib.request.Request(url, headers={"X-Service-Key": key})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=300)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        relay, relay_url = start("relay", env={})
        server, direct = start(
            "--root", tmp, env={"SERVICE_RELAY_URL": relay_url, "SERVICE_RESCAN_SECONDS": "0"}
        )
        try:
            setup = get(f"{direct}/api/v1/system/setup", "")["data"]
            key, sid = setup["apiKey"], setup["serverId"]
            while get(f"{relay_url}/health", "")["data"]["servers"] < 1:
                time.sleep(0.1)
            body = json.dumps({"path": "notes/bench.md", "content": "# Bench\n\n" + "x " * 500})
            req = urllib.request.Request(
                f"{direct}/api/v1/notes",
                body.encode(),
                {"X-Service-Key": key, "Content-Type": "application/json"},
            )
            urllib.request.urlopen(req, timeout=10).read()
            rows = []
            for name, base in (
                ("direct", f"{direct}/api/v1"),
                ("through relay", f"{relay_url}/r/{sid}/api/v1"),
            ):
                times = []
                for i in range(args.requests + 20):
                    t = time.perf_counter()
                    get(f"{base}/notes/notes%2Fbench.md", key)
                    if i >= 20:
                        times.append((time.perf_counter() - t) * 1000)
                times.sort()
                rows.append((name, statistics.median(times), times[int(len(times) * 0.95)]))
            print(f"{args.requests} sequential GET /notes/:path on loopback")
            print(f"{'':<16} {'p50 ms':>8} {'p95 ms':>8} {'x direct':>9}")
            for name, p50, p95 in rows:
                print(f"{name:<16} {p50:>8.2f} {p95:>8.2f} {p50 / rows[0][1]:>9.2f}")
        finally:
            server.terminate()
            relay.terminate()
            server.wait(10)
            relay.wait(10)


if __name__ == "__main__":
    main()
