"""Benchmark: note listing, folder tree, history and the change feed (not run by the tests).

    python bench/bench_notes.py --notes 10000 --folders 500
    python bench/bench_notes.py --only history      # just the history and feed figures

Reports the median of several runs for GET /notes (one page and the full 1000 page),
GET /folders/tree, and as the reference measured in the same run a bare os.walk + stat
over the same tree (the least any tree listing must do).

History and the change feed (issue 13), each against a reference from the same run:
- PUT p50 with history on vs off, at --notes notes, the two apps' PUTs interleaved so that
  noise hits both alike (goal: history adds at most 20 %);
- change-feed delivery: from sending a PUT to a real server until a long-poll waiting on
  it has its answer, p50 (goal: 20 ms), beside a GET /health round trip;
- disk used by history after 10,000 edits of 100 notes, beside the notes' own size.

Settings: notesvc's defaults (rescans on) but SERVICE_AUTH_MODE=none, as the references
have no authentication; in process, each app's first check of the files is waited out.
"""

from __future__ import annotations

import argparse
import http.client
import io
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import print_header, server_env, wait_first_check

import notesvc


def call(app, path: str, method: str = "GET", body: dict | None = None) -> tuple:
    raw = json.dumps(body).encode() if body is not None else b""
    env = {
        "REQUEST_METHOD": method,
        "PATH_INFO": path.split("?")[0],
        "QUERY_STRING": path.split("?")[1] if "?" in path else "",
        "SERVER_NAME": "bench",
        "SERVER_PORT": "3000",
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(raw),
        "wsgi.errors": sys.stderr,
        "REMOTE_ADDR": "127.0.0.1",
    }
    if raw:
        env.update(CONTENT_LENGTH=str(len(raw)), CONTENT_TYPE="application/json")
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


# The one setting every part changes: no authentication, as the references (a bare os.walk,
# GET /health) have none; a key check would be the bench's difference, not the route's work.
SETTINGS = {"SERVICE_AUTH_MODE": "none"}


def make_app(root: str, **env: str):
    """An in-process app on root at the default settings but SETTINGS and env, once its
    first check of the files (in the background: rescans on) is done."""
    cfg = notesvc.load_config(env={"SERVICE_NOTES_ROOT": root, **SETTINGS, **env})
    app = notesvc.create_app(cfg)
    wait_first_check(app.service)
    return app


def note_text(i: int, edit: int = 0) -> str:
    return f"# Note {i}\n\nedit {edit}: " + "some words of a note " * 50 + "\n"


def write_notes(root: Path, count: int) -> list:
    paths = []
    for i in range(count):
        folder = root / "notes" / f"f{i % 100:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"n{i:05d}.md").write_text(note_text(i))
        paths.append(f"notes/f{i % 100:02d}/n{i:05d}.md")
    return paths


def url_of(path: str) -> str:
    return "/api/v1/notes/" + path  # plain slashes: what a WSGI server decodes %2F to


def bench_history_put(notes: int, rounds: int) -> tuple:
    """Return (p50 ms with history off, p50 ms with it on): PUTs to two apps, interleaved."""
    with tempfile.TemporaryDirectory() as off_root, tempfile.TemporaryDirectory() as on_root:
        paths = write_notes(Path(off_root), notes)
        write_notes(Path(on_root), notes)
        apps = {
            "off": make_app(off_root, SERVICE_HISTORY_MAX_VERSIONS="0"),
            "on": make_app(on_root),
        }
        time.sleep(2)  # the start-up's background work (index cache, retention) is done
        times: dict = {"off": [], "on": []}
        rnd = random.Random(2)
        for k in range(rounds):
            path = rnd.choice(paths)
            for which in ("off", "on") if k % 2 else ("on", "off"):
                t = time.perf_counter()
                status, _ = call(apps[which], url_of(path), "PUT", {"content": note_text(k, k)})
                times[which].append(time.perf_counter() - t)
                assert status.startswith("200"), status
        for app in apps.values():
            app.service.close()
        return statistics.median(times["off"]) * 1000, statistics.median(times["on"]) * 1000


def start_server(root: str) -> tuple:
    """Start `python notesvc.py` on a free port; return (process, port)."""
    env = server_env(SETTINGS)  # the default settings but SETTINGS
    command = [sys.executable, str(Path(notesvc.__file__)), "--root", root]
    command += ["--host", "127.0.0.1", "--port", "0"]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    for line in proc.stderr:
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        if m:
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return proc, int(m.group(1))
    raise RuntimeError("the server did not start")


def request(conn: http.client.HTTPConnection, method: str, path: str, body=None) -> dict:
    payload = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"} if payload else {}
    conn.request(method, path, payload, headers)
    return json.loads(conn.getresponse().read() or b"null")


def bench_feed_latency(rounds: int) -> tuple:
    """Return (p50 ms from sending a PUT to a waiting long-poll's answer, p50 ms of a GET
    /health round trip) on a real server."""
    with tempfile.TemporaryDirectory() as root:
        proc, port = start_server(root)
        try:
            writer = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            follower = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            request(writer, "POST", "/api/v1/notes", {"path": "notes/feed.md", "content": "0"})
            since = request(writer, "GET", "/api/v1/changes")["data"]["last"]
            health = []
            for _ in range(rounds):
                t = time.perf_counter()
                request(writer, "GET", "/api/v1/health")
                health.append(time.perf_counter() - t)
            latencies = []
            for k in range(rounds):
                got = {}

                def follow(since=since, got=got) -> None:
                    got["data"] = request(
                        follower, "GET", f"/api/v1/changes?since={since}&wait=10"
                    )["data"]
                    got["at"] = time.perf_counter()

                t = threading.Thread(target=follow)
                t.start()
                while (
                    request(writer, "GET", "/api/v1/system/info")["data"]["changes"]["waiting"] < 1
                ):
                    time.sleep(0.002)
                sent = time.perf_counter()
                request(writer, "PUT", url_of("notes/feed.md"), {"content": str(k)})
                t.join(15)
                assert got["data"]["changes"], got
                latencies.append(got["at"] - sent)
                since = got["data"]["last"]
        finally:
            proc.terminate()
            proc.wait(15)
        return statistics.median(latencies) * 1000, statistics.median(health) * 1000


def disk_use(folder: Path) -> tuple:
    """Return (bytes allocated on disk, bytes of content) of the files under folder."""
    used = size = 0
    for parent, _dirs, files in os.walk(folder):
        for name in files:
            st = os.stat(os.path.join(parent, name))
            used += st.st_blocks * 512
            size += st.st_size
    return used, size


def bench_history_disk(notes: int, edits: int) -> dict:
    """Return the disk used by the notes and by their history after `edits` PUTs."""
    with tempfile.TemporaryDirectory() as root:
        paths = write_notes(Path(root), notes)
        app = make_app(root)
        started = time.perf_counter()
        for k in range(edits):
            call(app, url_of(paths[k % notes]), "PUT", {"content": note_text(k % notes, k)})
        took = time.perf_counter() - started
        app.service.close()
        history = Path(root) / ".notesvc" / "history"
        return {
            "notes": disk_use(Path(root) / "notes"),
            "history": disk_use(history),
            "versions": sum(1 for _ in history.rglob("*-updated-*")),
            "seconds": took,
        }


def report_history(args) -> None:
    off, on = bench_history_put(args.notes, args.put_rounds)
    print(f"\nhistory: PUT p50 at {args.notes} notes ({args.put_rounds} PUTs each, interleaved)")
    print(f"{'what':<40} {'p50 ms':>8} {'x reference':>12}")
    print(f"{'reference: PUT, history off':<40} {off:>8.2f} {1:>12.2f}")
    goal = "met" if on / off <= 1.2 else "missed"
    print(f"{'PUT, history on':<40} {on:>8.2f} {on / off:>12.2f}   goal <= 1.20: {goal}")
    feed, health = bench_feed_latency(args.feed_rounds)
    print(f"\nchange feed: PUT -> waiting long-poll ({args.feed_rounds} rounds, real server)")
    print(f"{'reference: GET /health round trip':<40} {health:>8.2f} {1:>12.2f}")
    goal = "met" if feed <= 20 else "missed"
    print(
        f"{'PUT sent -> long-poll answered':<40} {feed:>8.2f} {feed / health:>12.2f}"
        f"   goal <= 20 ms: {goal}"
    )
    d = bench_history_disk(100, args.edits)
    (n_used, n_size), (h_used, h_size) = d["notes"], d["history"]
    print(
        f"\nhistory disk after {args.edits} edits of 100 notes ({d['versions']} versions, "
        f"{d['seconds']:.1f} s of PUTs)"
    )
    print(
        f"{'reference: the notes':<40} {n_used / 1e6:>6.2f} MB used ({n_size / 1e6:.2f} MB of text)"
    )
    print(
        f"{'history':<40} {h_used / 1e6:>6.2f} MB used ({h_size / 1e6:.2f} MB of text)"
        f"   x{h_used / n_used:.1f} the notes"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--notes", type=int, default=10000)
    ap.add_argument("--folders", type=int, default=500)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--put-rounds", type=int, default=1000, help="PUTs per app (history)")
    ap.add_argument("--feed-rounds", type=int, default=200, help="change-feed deliveries")
    ap.add_argument("--edits", type=int, default=10000, help="edits of 100 notes (disk)")
    ap.add_argument("--only", choices=("listing", "history"), help="run one part")
    args = ap.parse_args()
    print_header({**SETTINGS, "SERVICE_HISTORY_MAX_VERSIONS": "0 (the history-off app only)"})
    if args.only != "history":
        report_listing(args)
    if args.only != "listing":
        report_history(args)


def report_listing(args) -> None:
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
        app = make_app(tmp)

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
