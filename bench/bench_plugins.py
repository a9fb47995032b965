"""Benchmark: what the tags and backlinks plugins cost on a big folder, measured in one run.

    python bench/bench_plugins.py --notes 100000
    python bench/bench_plugins.py --notes 100000 --baseline /tmp/notesvc-before.py

Takes the real-text corpus of bench_search.py (../shared/bench/corpus.py, built into
~/corpus/<n> when missing), links its notes into a work folder, and in a child process per
notesvc.py (this one, and --baseline when given: an older notesvc.py measured the same way,
one after the other) starts the app in-process (WSGI, no network), lets it index the notes
and go idle, then times, with the process's CPU seconds and its RssAnon (before, and the
peak sampled every 20 ms):

- GET /plugins/tags, the first look (every note read);
- a note saved, then GET /plugins/tags again (the reference: the first look);
- GET /plugins/backlinks/<that note>, the first look, then after another save of it.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
NOTE = "notes/bench-plugins.md"


def rss_anon() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon"):
                return int(line.split()[1]) / 1024
    return 0.0


def child(notesvc_file: str, root: str) -> None:
    """Measure one notesvc.py in this process; print one JSON line of results."""
    import importlib.util

    from _common import wait_first_check

    spec = importlib.util.spec_from_file_location("ns", notesvc_file)
    ns = importlib.util.module_from_spec(spec)
    sys.modules["ns"] = ns
    spec.loader.exec_module(ns)
    app = ns.create_app(ns.load_config({}, root=root))  # the default settings
    if hasattr(app.service, "last_sync"):
        wait_first_check(app.service)  # the first check runs in the background (rescans on)
    else:  # an older notesvc.py
        app.service.index.sync(app.service.notes)
    key = app.service.state.read()["apiKey"]
    while True:  # idle: the background work of a first start (history, reminders) is done
        before = sum(os.times()[:2])
        time.sleep(2)
        if sum(os.times()[:2]) - before < 0.1:
            break

    def call(method: str, path: str, body: dict | None = None) -> None:
        raw = json.dumps(body).encode() if body is not None else b""
        environ = {
            "REQUEST_METHOD": method,
            "PATH_INFO": path,
            "QUERY_STRING": "",
            "SERVER_NAME": "127.0.0.1",
            "SERVER_PORT": "8080",
            "SERVER_PROTOCOL": "HTTP/1.1",
            "HTTP_HOST": "127.0.0.1:8080",
            "REMOTE_ADDR": "127.0.0.1",
            "HTTP_X_SERVICE_KEY": key,
            "CONTENT_TYPE": "application/json",
            "CONTENT_LENGTH": str(len(raw)),
            "wsgi.input": io.BytesIO(raw),
            "wsgi.url_scheme": "http",
            "wsgi.errors": sys.stderr,
        }
        status = []
        body_out = b"".join(app(environ, lambda s, h, e=None: status.append(s)))
        if not status[0].startswith("2"):
            raise RuntimeError(f"{method} {path}: {status[0]} {body_out[:200]!r}")

    results = {}

    def measure(label: str, method: str, path: str) -> None:
        peak, start = [rss_anon()], rss_anon()
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.02):
                peak[0] = max(peak[0], rss_anon())

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        cpu, wall = time.process_time(), time.perf_counter()
        try:
            call(method, path)
        finally:
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            done.set()
            sampler.join()
        results[label] = {"wall": wall, "cpu": cpu, "rss_before": start, "rss_peak": peak[0]}

    links = f"/api/v1/plugins/backlinks/{NOTE}"
    measure("tags, first look", "GET", "/api/v1/plugins/tags")
    call("POST", "/api/v1/notes", {"path": NOTE, "content": "# Bench #benchtag [[x]]"})
    measure("tags after a save", "GET", "/api/v1/plugins/tags")
    measure("backlinks, first look", "GET", links)
    call("PUT", f"/api/v1/notes/{NOTE}", {"content": "# Bench #benchtag2 [[x]]"})
    measure("backlinks after a save", "GET", links)
    results["rss_after"] = rss_anon()
    print(json.dumps(results), flush=True)


def link_tree(source: Path, target: Path) -> None:
    """Hard-link every note of source/notes into target/notes (a fresh .notesvc/ each)."""
    if target.exists():
        shutil.rmtree(target)
    for folder, _, files in os.walk(source / "notes"):
        out = target / Path(folder).relative_to(source)
        out.mkdir(parents=True, exist_ok=True)
        for name in files:
            os.link(Path(folder) / name, out / name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--notes", type=int, default=10000)
    ap.add_argument("--corpus-dir", help="the corpus folder (default ~/corpus/<n>)")
    ap.add_argument("--workdir", help="where the notes are linked (default: a temporary one)")
    ap.add_argument("--baseline", help="an older notesvc.py to measure the same way")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    if args.child:
        child(*args.child)
        return
    from _common import print_header, server_env

    print_header()
    from bench_search import SHARED_BENCH, real_corpus

    corpus = real_corpus(args.notes, args.corpus_dir, SHARED_BENCH / "corpus.py")
    runs = {"this notesvc.py": str(HERE.parent / "notesvc.py")}
    if args.baseline:
        runs["baseline"] = args.baseline
    rows = {}
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-plugins-"))
    for name, file in runs.items():
        root = work / ("baseline" if name == "baseline" else "this")
        link_tree(corpus, root)
        out = subprocess.run(
            [sys.executable, __file__, "--child", file, str(root)],
            capture_output=True,
            text=True,
            check=True,
            env=server_env(),
        )
        rows[name] = json.loads(out.stdout.strip().splitlines()[-1])
        shutil.rmtree(root)
    print(f"{args.notes} notes of real text ({corpus})")
    head = f"{'measure':<24} {'wall s':>7} {'CPU s':>7} {'RssAnon MB: before':>19} {'peak':>7}"
    print(f"{'':<24} {head}")
    for name, res in rows.items():
        for label, r in res.items():
            if label != "rss_after":
                print(
                    f"{name:<24} {label:<24} {r['wall']:>7.2f} {r['cpu']:>7.2f} "
                    f"{r['rss_before']:>19.1f} {r['rss_peak']:>7.1f}"
                )
        first = res["tags, first look"]["cpu"]
        print(
            f"{name:<24} tags after a save × the first look: "
            f"{res['tags after a save']['cpu'] / first:.3f} (CPU); RssAnon at the end "
            f"{res['rss_after']:.1f} MB"
        )


if __name__ == "__main__":
    main()
