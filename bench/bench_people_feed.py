"""Benchmark: the change feed as a person reads it, against the owner's same read (issue 52).

    python bench/bench_people_feed.py --notes 10000 --reads 300

A real server at its default settings (the API key on: people need keys), 5 people with
homes, 3 shared folders (Family: all write; Trips: three read; Ann's Recipes: two read),
and --notes notes written through the API round the folders (each home 16 %, Family 8 %,
Trips 6 %, the owner's own 6 %), so the journal holds --notes changes of which Ann sees
about a third. Each figure is a p50 over HTTP with keep-alive, each with a paired device's
key (the owner's a whole one), the owner's and the person's requests interleaved so that
noise hits both alike:

- same window: `since` 100 changes back, each reads what it sees of them (the owner 100,
  Ann about 33);
- a page of 100: each reads the 100 changes it sees before its newest (Ann's span is about
  three times the owner's);
- following: one change in Family (both see it), then each reads from its cursor;
- a quiet person (Fay, a sixth person who sees only her 10 notes, older than the
  journal's other 10,000): her first read right after a share changed (an empty folder
  shared with her: the server's state is new) against the owner's first read after the
  same kind of change, then each one's read again.

Goal (issue 52): a person's read of the feed costs at most 1.1x the owner's.
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
import urllib.parse
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import print_header, server_env

NOTESVC = Path(__file__).resolve().parent.parent / "notesvc.py"
API = "/api/v1"
PEOPLE = ("Ann", "Bob", "Cara", "Dan", "Eve")
QUIET = "Fay"  # a sixth person, who sees only her first 10 notes


def start_server(root: str) -> tuple:
    """Start `python notesvc.py` at its defaults on a free port; return (process, port)."""
    command = [sys.executable, str(NOTESVC), "--root", root, "--host", "127.0.0.1"]
    command += ["--port", "0"]
    proc = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=server_env()
    )
    for line in proc.stderr:
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        if m:
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return proc, int(m.group(1))
    raise RuntimeError("the server did not start")


class Client:
    """One keep-alive connection with one key."""

    def __init__(self, port: int, key: str = ""):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.key = key

    def __call__(self, method: str, path: str, body=None, status: int = 200) -> dict:
        payload = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if payload else {}
        if self.key:
            headers["X-Service-Key"] = self.key
        try:
            self.conn.request(method, API + path, payload, headers)
            resp = self.conn.getresponse()
        except (http.client.RemoteDisconnected, ConnectionError):  # idle too long: again
            self.conn.close()
            self.conn.request(method, API + path, payload, headers)
            resp = self.conn.getresponse()
        answer = json.loads(resp.read() or b"null")
        if resp.status != status:
            raise RuntimeError(f"{method} {path}: {resp.status} {answer}")
        return answer["data"]


def household(port: int, notes: int) -> tuple:
    """Set the server up; return (owner, {name: person's client}, members(folder, people))."""
    key = Client(port)("GET", "/system/setup")["apiKey"]
    owner = Client(port, key)
    pairing = owner("POST", "/auth/devices/pairings", {"scope": "admin"}, status=201)
    claim = {"secret": pairing["secret"], "deviceName": "the owner's phone"}
    # the owner reads with a device of theirs, as each person does: keys checked alike
    owner = Client(port, Client(port)("POST", "/auth/devices/claim", claim, status=201)["key"])
    clients, ids = {}, {}
    for name in (*PEOPLE, QUIET):
        made = owner("POST", "/people", {"name": name}, status=201)
        claim = {"secret": made["pairing"]["secret"], "deviceName": f"{name}'s phone"}
        got = Client(port)("POST", "/auth/devices/claim", claim, status=201)
        clients[name], ids[name] = Client(port, got["key"]), made["person"]["id"]

    def members(folder: str, people: list) -> None:
        body = {"members": [{"person": ids[n], "scope": s} for n, s in people]}
        owner("PUT", f"/folders/{urllib.parse.quote(folder, safe='')}/members", body)

    for i in range(10):  # the quiet one's notes, before everything else
        body = {"path": f"notes/{QUIET}/n{i}.md", "content": "x"}
        clients[QUIET]("POST", "/notes", body, status=201)
    for folder in ("notes/Family", "notes/Trips", "notes/Ann/Recipes"):
        owner("POST", "/notes", {"path": f"{folder}/start.md", "content": "start"}, status=201)
    members("notes/Family", [(n, "write") for n in PEOPLE])
    members("notes/Trips", [("Ann", "read"), ("Bob", "read"), ("Cara", "read")])
    members("notes/Ann/Recipes", [("Bob", "read"), ("Cara", "read")])
    plan = [f"notes/{n}" for n in PEOPLE for _ in range(16)]
    plan += ["notes/Family"] * 8 + ["notes/Trips"] * 6 + ["notes/owner"] * 6  # 100 a round
    t = time.perf_counter()
    for i in range(notes):
        folder = plan[i % len(plan)]
        body = {"path": f"{folder}/n{i:05}.md", "content": f"# Note {i}\n\nwords {i}"}
        owner("POST", "/notes", body, status=201)
        if i % 2000 == 1999:
            print(f"  {i + 1} notes written ({time.perf_counter() - t:.0f} s)", flush=True)
    return owner, clients, members


def p50(times: list) -> float:
    return statistics.median(times) * 1000


def interleaved(a, b, reads: int) -> tuple:
    """Return (p50 ms of a(), p50 ms of b()), called in turn `reads` times each."""
    ta, tb = [], []
    for _ in range(reads):
        for fn, times in ((a, ta), (b, tb)):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return p50(ta), p50(tb)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--notes", type=int, default=10000)
    parser.add_argument("--reads", type=int, default=300)
    args = parser.parse_args()
    print_header()
    with tempfile.TemporaryDirectory() as root:
        proc, port = start_server(root)
        try:
            owner, people, members = household(port, args.notes)
            ann, quiet = people["Ann"], people[QUIET]
            last = owner("GET", "/changes?since=latest")["last"]
            seen = ann("GET", "/changes?since=latest")["last"]
            every = []  # Ann's visible numbers, oldest first
            since = owner("GET", "/system/info")["changes"]["floor"]
            while True:
                page = ann("GET", f"/changes?since={since}&limit=1000")
                every += [c["seq"] for c in page["changes"]]
                since = page["last"]
                if not page["more"]:
                    break
            print(
                f"journal: {last} changes, Ann sees {len(every)} "
                f"({100 * len(every) / max(1, last):.0f} %), her newest {seen}",
                flush=True,
            )
            rows = []
            window = last - 100
            o, p = interleaved(
                lambda: owner("GET", f"/changes?since={window}&limit=100"),
                lambda: ann("GET", f"/changes?since={min(window, seen)}&limit=100"),
                args.reads,
            )
            rows.append(("same window (100 changes back)", o, p))
            hers = every[-101]
            o, p = interleaved(
                lambda: owner("GET", f"/changes?since={last - 100}&limit=100"),
                lambda: ann("GET", f"/changes?since={hers}&limit=100"),
                args.reads,
            )
            rows.append(("a page of 100 of theirs", o, p))
            follow = []
            owner_since, ann_since = last, seen
            for k in range(args.reads):
                body = {"content": f"bread {k}"}
                owner("PUT", "/notes/" + urllib.parse.quote("notes/Family/start.md", ""), body)
                t = time.perf_counter()
                got = owner("GET", f"/changes?since={owner_since}")
                t1 = time.perf_counter()
                mine = ann("GET", f"/changes?since={ann_since}")
                t2 = time.perf_counter()
                assert got["changes"], got
                assert mine["changes"], mine
                owner_since, ann_since = got["last"], mine["last"]
                follow.append((t1 - t, t2 - t1))
            rows.append(
                (
                    "following: one new change",
                    p50([f[0] for f in follow]),
                    p50([f[1] for f in follow]),
                )
            )
            quiet_last = quiet("GET", "/changes?since=latest")["last"]
            owner_since = owner("GET", "/changes?since=latest")["last"]
            cold, warm = [], []  # (the owner's, hers)
            for k in range(max(10, args.reads // 10)):
                pair_cold, pair_warm = [], []
                for who, since, name in ((owner, owner_since, "o"), (quiet, quiet_last, "p")):
                    # a share of an empty folder (on disk: no change in the journal) is a
                    # new state all the same: each read right after one, then again
                    empty = Path(root) / "notes" / "owner" / f"q{k}{name}"
                    empty.mkdir(parents=True)
                    members(f"notes/owner/q{k}{name}", [(QUIET, "read")])
                    t = time.perf_counter()
                    got = who("GET", f"/changes?since={since}")
                    pair_cold.append(time.perf_counter() - t)
                    assert got["changes"] == [], got
                    t = time.perf_counter()
                    who("GET", f"/changes?since={since}")
                    pair_warm.append(time.perf_counter() - t)
                cold.append(pair_cold)
                warm.append(pair_warm)
            rows.append(
                (
                    "a quiet person, first read after a share changed",
                    p50([c[0] for c in cold]),
                    p50([c[1] for c in cold]),
                )
            )
            rows.append(
                (
                    "a quiet person, asking again",
                    p50([w[0] for w in warm]),
                    p50([w[1] for w in warm]),
                )
            )
            print("\n| read | owner p50 | person p50 | person / owner |")
            print("|---|---|---|---|")
            for name, o, p in rows:
                print(f"| {name} | {o:.2f} ms | {p:.2f} ms | {p / o:.2f}x |")
        finally:
            proc.terminate()
            proc.wait(15)


if __name__ == "__main__":
    main()
