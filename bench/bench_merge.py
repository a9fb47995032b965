"""Benchmark: writing from a phone (not run by the tests).

    python bench/bench_merge.py --notes 10000

A real server on loopback, one keep-alive connection. In one run:

- merge: `POST /notes/:path/merge` of a 10 KB note with 50 versions, the edit made from a
  version 10 saves back (a real three-way merge), against a plain `PUT` of the same note;
- the listing for people, `GET /notes?sort=modified&fields=title,preview,modified,tags&
  limit=100`, against the plain listing (`GET /notes?limit=100`), at --notes notes in 500
  folders.
Goals: merge p50 <= 5 ms; the listing for people <= 2x the plain one.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import print_header, server_env  # noqa: E402

NOTESVC = str(HERE.parent / "notesvc.py")
WORDS = "apple river stone quiet market garden letter window silver morning paper".split()


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
    if not ready.wait(120):
        raise SystemExit("the server did not start")
    return proc, port[0]


def paragraph(rnd: random.Random, n: int) -> str:
    return " ".join(rnd.choice(WORDS) for _ in range(n))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--notes", type=int, default=10000)
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    print_header()
    rnd = random.Random(7)
    with tempfile.TemporaryDirectory() as root:
        for i in range(args.notes):
            folder = Path(root) / "notes" / f"f{i % 500:03d}"
            folder.mkdir(parents=True, exist_ok=True)
            text = f"# Note {i}\n\n{paragraph(rnd, 40)} #t{i % 7}\n\n{paragraph(rnd, 60)}\n"
            (folder / f"n{i:05d}.md").write_text(text)
        proc, port = start(root)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

        def call(method: str, path: str, key: str, body=None) -> tuple:
            headers = {"X-Service-Key": key}
            payload = None
            if body is not None:
                payload = json.dumps(body).encode()
                headers["Content-Type"] = "application/json"
            started = time.perf_counter()
            conn.request(method, "/api/v1" + path, payload, headers)
            resp = conn.getresponse()
            raw = resp.read()
            return resp.status, json.loads(raw), (time.perf_counter() - started) * 1000

        try:
            key = call("GET", "/system/setup", "")[1]["data"]["apiKey"]
            for _ in range(600):  # until the start-up check has indexed every note
                if call("GET", "/search?q=note&limit=1", key)[1]["data"]["total"] >= args.notes:
                    break
                time.sleep(0.5)
            time.sleep(2)  # and its merges have settled
            url = "/notes/" + urllib.parse.quote("notes/big.md", safe="")
            lines = [f"{k:03d} {paragraph(rnd, 12)}\n" for k in range(130)]  # ~10 KB
            call("POST", "/notes", key, {"path": "notes/big.md", "content": "".join(lines)})
            etags = []
            for v in range(50):  # 50 versions
                lines[v % 130] = f"{v % 130:03d} edited {v} {paragraph(rnd, 10)}\n"
                etags.append(call("PUT", url, key, {"content": "".join(lines)})[1]["data"]["etag"])
            times: dict = {"put": [], "merge": []}
            for r in range(args.rounds):
                base = etags[-10]  # the edit started 10 saves ago, far from the last changes
                # not timed: the text of `base` (a version), edited on a line of its own
                found = call("GET", f"{url}/versions", key)[1]["data"]["versions"]
                vid = next(v["id"] for v in found if v["etag"] == base)
                old = call("GET", f"{url}/versions/{vid}", key)[1]["data"]["content"]
                ours = old.splitlines(keepends=True)
                line = 60 + r % 70
                ours[line] = f"{line:03d} from the phone {r}\n"
                status, answer, took = call(
                    "POST", f"{url}/merge", key, {"base": base, "content": "".join(ours)}
                )
                assert status == 200, answer
                assert answer["data"]["merged"], answer
                times["merge"].append(took)
                lines = answer["data"]["note"]["content"].splitlines(keepends=True)
                etags.append(answer["data"]["note"]["etag"])
                lines[5] = f"005 plain {r} {paragraph(rnd, 8)}\n"
                status, answer, took = call("PUT", url, key, {"content": "".join(lines)})
                times["put"].append(took)
                etags.append(answer["data"]["etag"])
            listing: dict = {"plain": [], "people": []}
            for _ in range(30):
                listing["plain"].append(call("GET", "/notes?limit=100", key)[2])
                listing["people"].append(
                    call(
                        "GET",
                        "/notes?sort=modified&fields=title,preview,modified,tags&limit=100",
                        key,
                    )[2]
                )
        finally:
            conn.close()
            proc.terminate()
            proc.wait(10)

    def p(values: list, q: int) -> float:
        return statistics.quantiles(values, n=100)[q - 1]

    print(f"\n{args.notes} notes in 500 folders; a real server, one keep-alive connection")
    print(f"{'':58}{'p50':>8}{'p95':>8}  ms")
    for label, values in (
        ("PUT of a 10 KB note (50 versions)", times["put"]),
        ("merge of an edit from 10 saves ago into it", times["merge"]),
        ("GET /notes?limit=100 (by path)", listing["plain"]),
        ("GET /notes?sort=modified&fields=...&limit=100", listing["people"]),
    ):
        print(f"{label:58}{p(values, 50):8.2f}{p(values, 95):8.2f}")
    merge, put = p(times["merge"], 50), p(times["put"], 50)
    people, plain = p(listing["people"], 50), p(listing["plain"], 50)
    print(f"merge p50 {merge:.2f} ms (goal <= 5), {merge / put:.2f}x a PUT")
    print(f"listing for people p50 {people / plain:.2f}x the plain listing (goal <= 2)")


if __name__ == "__main__":
    main()
