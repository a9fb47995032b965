"""Benchmark: MCP's resources (issue 53) against the notes listing, in one run.

    python bench/bench_mcp.py                      # 10k notes of real text (~/corpus/10k)
    python bench/bench_mcp.py --notes 10000 --repeat 5 --updates 30 --json /tmp/mcp.json

A real `notesvc.py` on 127.0.0.1 at its default settings (API keys on), over keep-alive
HTTP, the owner's key. The notes are the real-text corpus of ../shared/bench/corpus.py
(built into ~/corpus/<n> when missing), copied in before the server starts.

Measured:

- a page of 100 from MCP's `resources/list` (POST /api/v1/mcp in a session, newest first,
  walking its signed cursors) against `GET /notes?limit=100` (the reference) and
  `GET /notes?limit=100&sort=modified` (the same order as resources/list), at the same
  page offsets, the three taking turns, best of --repeat per page; p50 and p95 over the
  pages;
- an update notification: a session subscribed to a note, its GET stream open; the note
  written with `PUT /notes/:path` (the API, another connection); the time from the PUT's
  start to `notifications/resources/updated` arriving on the stream, --updates times
  (p50, max).

Goals (issue 53): resources/list's page p50 <= 2x GET /notes?limit=100's; an update
notification within 1 s of the write.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_header
from bench_search import (
    SHARED_BENCH,
    Client,
    note_paths,
    real_corpus,
    server_key,
    start_server,
    stop,
)

API = "/api/v1"
VERSION = "2025-11-25"


def p(values: list, q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Mcp:
    """An MCP session over one keep-alive connection (JSON answers, not SSE)."""

    def __init__(self, port: int, key: dict):
        self.client = Client(
            port,
            {
                **key,
                "Accept": "application/json, text/event-stream",
                "MCP-Protocol-Version": VERSION,
            },
        )
        self.ids = 0
        init = {"protocolVersion": VERSION, "capabilities": {}, "clientInfo": {"name": "bench"}}
        conn = self.client.conn
        body = json.dumps({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": init})
        conn.request("POST", f"{API}/mcp", body=body, headers=self.headers_json())
        resp = conn.getresponse()
        resp.read()
        if resp.status != 200:
            raise RuntimeError(f"initialize: {resp.status}")
        self.sid = resp.getheader("Mcp-Session-Id")
        self.client.headers["Mcp-Session-Id"] = self.sid
        self.send({"jsonrpc": "2.0", "method": "notifications/initialized"}, 202)

    def headers_json(self) -> dict:
        return {**self.client.headers, "Content-Type": "application/json"}

    def send(self, message: dict, want: int = 200) -> bytes:
        status, out = self.client.request("POST", f"{API}/mcp", json.dumps(message).encode())
        if status != want:
            raise RuntimeError(f"{message.get('method')}: {status} {out[:300]!r}")
        return out

    def call(self, method: str, params: dict | None = None) -> dict:
        self.ids += 1
        msg = {"jsonrpc": "2.0", "id": self.ids, "method": method, "params": params or {}}
        answer = json.loads(self.send(msg))
        if "error" in answer:
            raise RuntimeError(f"{method}: {answer['error']}")
        return answer["result"]


def listing_pages(port: int, key: dict, n: int, repeat: int) -> dict:
    """Best-of-repeat times (s) per page offset for the three ways of reading a page of 100."""
    owner = Client(port, key)
    mcp = Mcp(port, key)
    cursors = [None]  # resources/list's cursor for each page, walked once
    while True:
        page = mcp.call("resources/list", {"cursor": cursors[-1]} if cursors[-1] else {})
        if "nextCursor" not in page:
            break
        cursors.append(page["nextCursor"])
    pages = len(cursors)
    if pages * 100 < n:
        raise SystemExit(f"resources/list gave {pages} pages for {n} notes")
    ways = {
        "notes": lambda i: owner.get(f"{API}/notes?limit=100&offset={i * 100}"),
        "notes_modified": lambda i: owner.get(
            f"{API}/notes?limit=100&offset={i * 100}&sort=modified"
        ),
        "resources_list": lambda i: mcp.call(
            "resources/list", {"cursor": cursors[i]} if cursors[i] else {}
        ),
    }
    best = {name: [float("inf")] * pages for name in ways}
    for r in range(repeat + 1):  # the first pass warms
        order = list(ways) if r % 2 == 0 else list(ways)[::-1]
        for i in range(pages):
            for name in order:
                t = time.perf_counter()
                ways[name](i)
                took = time.perf_counter() - t
                if r:
                    best[name][i] = min(best[name][i], took)
    owner.close()
    mcp.client.close()
    return best


class StreamReader(threading.Thread):
    """A session's GET stream; each `notifications/resources/updated` arrival is timed."""

    def __init__(self, port: int, key: dict, sid: str):
        super().__init__(daemon=True)
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
        headers = {**key, "Mcp-Session-Id": sid, "Accept": "text/event-stream"}
        headers["MCP-Protocol-Version"] = VERSION
        self.conn.request("GET", f"{API}/mcp", headers=headers)
        self.resp = self.conn.getresponse()
        if self.resp.status != 200:
            raise RuntimeError(f"GET /mcp: {self.resp.status}")
        self.arrived: list = []
        self.event = threading.Event()

    def run(self) -> None:
        try:
            while True:
                line = self.resp.readline()
                if not line:
                    return
                if line.startswith(b"data: "):
                    message = json.loads(line[6:])
                    if message.get("method") == "notifications/resources/updated":
                        self.arrived.append((time.perf_counter(), message["params"]["uri"]))
                        self.event.set()
        except (OSError, ValueError):
            return


def update_latency(port: int, key: dict, path: str, updates: int) -> list:
    """Seconds from each PUT's start to its notification on the stream."""
    mcp = Mcp(port, key)
    uri = "notesvc://note/" + path
    mcp.call("resources/subscribe", {"uri": uri})
    reader = StreamReader(port, key, mcp.sid)
    reader.start()
    writer = Client(port, key)
    quoted = urllib.parse.quote(path, safe="")
    times = []
    for i in range(updates):
        reader.event.clear()
        before = len(reader.arrived)
        body = json.dumps({"content": f"# Bench\n\nupdate {i} at {time.time()}\n"}).encode()
        start = time.perf_counter()
        status, out = writer.request("PUT", f"{API}/notes/{quoted}", body)
        if status >= 300:
            raise RuntimeError(f"PUT: {status} {out[:200]!r}")
        deadline = start + 30
        while len(reader.arrived) == before:
            if not reader.event.wait(max(0.0, deadline - time.perf_counter())):
                raise SystemExit(f"no update notification within 30 s (update {i})")
        at, got = reader.arrived[before]
        if got != uri:
            raise SystemExit(f"a notification for {got}, not {uri}")
        times.append(at - start)
        time.sleep(0.2)  # writes spaced as a person's are (the stream is not a queue test)
    reader.conn.close()
    writer.close()
    mcp.client.close()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--notes", type=int, default=10000)
    ap.add_argument("--corpus-dir", default=None, help="the corpus (default ~/corpus/<n>)")
    ap.add_argument("--repeat", type=int, default=5, help="tries per page (best counts)")
    ap.add_argument("--updates", type=int, default=30, help="writes timed to their notice")
    ap.add_argument("--json", default=None, help="write the figures here too")
    args = ap.parse_args()
    print_header()
    print("load average at the start:", " ".join(f"{x:.2f}" for x in os.getloadavg()), flush=True)
    corpus = real_corpus(args.notes, args.corpus_dir, SHARED_BENCH / "corpus.py")
    work = Path(tempfile.mkdtemp(prefix="bench_mcp_"))
    proc = None
    try:
        root = work / "root"
        shutil.copytree(corpus / "notes", root / "notes")
        proc, port, _ = start_server(root, {}, "api-key")
        key = server_key(root)
        owner = Client(port, key)
        deadline = time.monotonic() + 900
        while json.loads(owner.get(f"{API}/notes?limit=1"))["data"]["total"] < args.notes:
            if time.monotonic() > deadline:
                raise SystemExit("the notes were not all listed after 900 s")
            time.sleep(0.5)
        owner.close()
        best = listing_pages(port, key, args.notes, args.repeat)
        stats = {
            name: {
                "p50_ms": round(statistics.median(t) * 1000, 3),
                "p95_ms": round(p(t, 0.95) * 1000, 3),
            }
            for name, t in best.items()
        }
        ref = stats["notes"]["p50_ms"]
        for name, s in stats.items():
            s["ratio_p50"] = round(s["p50_ms"] / ref, 2)
            print(
                f"page of 100 ({len(best[name])} pages) {name:15s} "
                f"p50 {s['p50_ms']:8.3f} ms  p95 {s['p95_ms']:8.3f} ms  "
                f"x{s['ratio_p50']:.2f} of GET /notes?limit=100",
                flush=True,
            )
        path = note_paths(root)[len(note_paths(root)) // 2]
        latency = update_latency(port, key, path, args.updates)
        notice = {
            "p50_ms": round(statistics.median(latency) * 1000, 1),
            "max_ms": round(max(latency) * 1000, 1),
            "updates": len(latency),
        }
        print(
            f"update notification after a PUT: p50 {notice['p50_ms']} ms, "
            f"max {notice['max_ms']} ms over {notice['updates']} writes (goal: <= 1000 ms)",
            flush=True,
        )
        ratio = stats["resources_list"]["ratio_p50"]
        print(
            f"goals: resources/list page <= 2x GET /notes?limit=100: x{ratio} "
            f"{'met' if ratio <= 2 else 'MISSED'}; notification <= 1 s: max "
            f"{notice['max_ms']} ms {'met' if notice['max_ms'] <= 1000 else 'MISSED'}",
            flush=True,
        )
        if args.json:
            Path(args.json).write_text(json.dumps({"pages": stats, "notification": notice}))
    finally:
        if proc is not None:
            stop(proc)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
