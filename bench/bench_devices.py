"""Benchmark: what a device claim costs, against a key check (not run by the tests).

    python bench/bench_devices.py --rounds 300

A real server on loopback (keep-alive connection). In one run: p50/p95 of `POST
/auth/verify` (a credential check), of `POST /auth/link` (a credential check and one
state write, the reference a claim should match), and of `POST /auth/devices/claim` (each
of a fresh pairing, made before the timing). The goal: a claim costs no more than a
credential check plus one state write.
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import print_header, server_env  # noqa: E402

NOTESVC = str(HERE.parent / "notesvc.py")


def start(root: str) -> tuple:
    proc = subprocess.Popen(
        [sys.executable, NOTESVC, "--root", root, "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=server_env(),  # notesvc's defaults
    )
    ready, port = threading.Event(), []

    def read():
        for line in proc.stderr:
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            if m:
                port.append(int(m.group(1)))
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(30):
        raise SystemExit("the server did not start")
    return proc, port[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=300)
    args = ap.parse_args()
    print_header()
    with tempfile.TemporaryDirectory() as root:
        proc, port = start(root)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

        def call(method: str, path: str, key: str = "", body=None) -> tuple:
            headers = {"Content-Type": "application/json"} if body is not None else {}
            if key:
                headers["X-Service-Key"] = key
            payload = json.dumps(body).encode() if body is not None else None
            started = time.perf_counter()
            conn.request(method, "/api/v1" + path, payload, headers)
            resp = conn.getresponse()
            raw = resp.read()
            took = (time.perf_counter() - started) * 1000
            return resp.status, json.loads(raw), took

        try:
            key = call("GET", "/system/setup")[1]["data"]["apiKey"]
            call("POST", "/auth/link", key, {"clientName": "bench"})
            times: dict = {"verify": [], "link": [], "claim": []}
            for _ in range(args.rounds):  # interleaved: each measure sees the same machine
                times["verify"].append(call("POST", "/auth/verify", key)[2])
                times["link"].append(call("POST", "/auth/link", key, {"clientName": "b"})[2])
                secret = call("POST", "/auth/devices/pairings", key, {"scope": "read"})[1]
                secret = secret["data"]["secret"]
                status, _, took = call("POST", "/auth/devices/claim", "", {"secret": secret})
                assert status == 201
                times["claim"].append(took)
        finally:
            conn.close()
            proc.terminate()
            proc.wait(10)

    def p(values: list, q: float) -> float:
        return statistics.quantiles(values, n=100)[int(q) - 1]

    print(f"\n{args.rounds} rounds, one keep-alive connection, a real server on loopback")
    print(f"{'':36}{'p50':>8}{'p95':>8}  ms")
    for name, label in (
        ("verify", "POST /auth/verify (a key check)"),
        ("link", "POST /auth/link (check + state write)"),
        ("claim", "POST /auth/devices/claim"),
    ):
        print(f"{label:36}{p(times[name], 50):8.2f}{p(times[name], 95):8.2f}")
    claim, verify, link = (p(times[n], 50) for n in ("claim", "verify", "link"))
    print(
        f"claim p50 = {claim / verify:.1f}x a key check; {claim / link:.2f}x a key check plus a "
        f"state write (goal <= 1)"
    )


if __name__ == "__main__":
    main()
