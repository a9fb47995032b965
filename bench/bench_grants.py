"""Benchmark: what a scope check costs (issue 19), measured in one run.

    python bench/bench_grants.py --notes 10000

Builds bench_search.py's corpus (English-looking notes in 300 folders), starts the app
in-process (WSGI, no network, so the check itself is what differs) and reports:

- request p50 of GET /api/v1/notes/<path> with a scoped read key, and with a folder key,
  against the same request with the API key (the reference);
- search p50 at N notes (bench_search.py's query mix) with a folder key, against the same
  queries with the API key (the reference).
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_header, wait_first_check
from bench_search import make_corpus, make_queries

import notesvc


def call(app, method: str, path: str, key: str, body: dict | None = None) -> tuple:
    raw = json.dumps(body).encode() if body is not None else b""
    env = {
        "REQUEST_METHOD": method,
        "PATH_INFO": urllib.parse.unquote(path.split("?")[0]),
        "QUERY_STRING": path.split("?")[1] if "?" in path else "",
        "SERVER_NAME": "bench",
        "SERVER_PORT": "3000",
        "HTTP_HOST": "127.0.0.1:3000",
        "HTTP_X_SERVICE_KEY": key,
        "CONTENT_TYPE": "application/json",
        "CONTENT_LENGTH": str(len(raw)),
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(raw),
        "wsgi.errors": sys.stderr,
        "REMOTE_ADDR": "127.0.0.1",
    }
    status = []
    out = b"".join(app(env, lambda s, h, e=None: status.append(s)))
    return int(status[0].split()[0]), out


def p50_ms(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--notes", type=int, default=10000)
    ap.add_argument("--runs", type=int, default=2000, help="requests per key")
    ap.add_argument("--queries", type=int, default=100, help="queries per kind")
    args = ap.parse_args()
    print_header()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        started = time.perf_counter()
        info = make_corpus(root, args.notes)
        cfg = notesvc.load_config(env={"SERVICE_NOTES_ROOT": tmp})  # the default settings
        app = notesvc.create_app(cfg)
        wait_first_check(app.service)  # every note indexed (rescans on: in the background)
        print(f"{args.notes} notes built and indexed in {time.perf_counter() - started:.1f} s")
        key = app.service.state.read()["apiKey"]
        folder = "notes/area-03"
        grants = {}
        for name, body in (
            ("read key", {"name": "bench", "scope": "read"}),
            ("folder key", {"name": "bench", "scope": "read", "folder": folder}),
        ):
            status, out = call(app, "POST", "/api/v1/auth/keys", key, body)
            assert status == 201, out
            grants[name] = json.loads(out)["data"]["key"]
        paths = app.service.index.paths()
        inside = sorted(p for p in paths if p.startswith(folder + "/"))
        note = f"/api/v1/notes/{urllib.parse.quote(inside[0], safe='')}"
        for k in (key, *grants.values()):
            assert call(app, "GET", note, k)[0] == 200
        print(f"folder key on {folder}: {len(inside)} of {len(paths)} notes")

        rows = []
        for _ in range(2):  # warm, then measure (interleaved so drift hits all alike)
            ref = p50_ms(lambda: call(app, "GET", note, key), args.runs)
            rows = [("API key (reference)", ref)]
            for name, k in grants.items():
                rows.append((name, p50_ms(lambda k=k: call(app, "GET", note, k), args.runs)))
        print(f"\nGET one note, p50 over {args.runs} requests")
        print(f"{'credential':<22} {'p50 ms':>8} {'x reference':>12}")
        for name, ms in rows:
            print(f"{name:<22} {ms:>8.3f} {ms / ref:>12.2f}")

        queries = [q for qs in make_queries(info, args.queries).values() for q in qs]
        urls = [f"/api/v1/search?q={urllib.parse.quote(q)}&limit=10" for q in queries]
        folder_key = grants["folder key"]
        for url in urls[:20]:  # warm the caches both ways
            call(app, "GET", url, key)
            call(app, "GET", url, folder_key)
        own, scoped = [], []
        for url in urls:
            for k, into in ((key, own), (folder_key, scoped)):
                t = time.perf_counter()
                status, _ = call(app, "GET", url, k)
                into.append(time.perf_counter() - t)
                assert status == 200, url
        ref = statistics.median(own) * 1000
        mine = statistics.median(scoped) * 1000
        print(f"\nsearch at {args.notes} notes, p50 over {len(urls)} queries")
        print(f"{'credential':<22} {'p50 ms':>8} {'x reference':>12}")
        print(f"{'API key (reference)':<22} {ref:>8.3f} {1:>12.2f}")
        print(f"{'folder key':<22} {mine:>8.3f} {mine / ref:>12.2f}")
        app.service.close()


if __name__ == "__main__":
    main()
