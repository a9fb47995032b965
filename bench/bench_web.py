"""Benchmark: the web client's page and tree (not run by the tests).

    python bench/bench_web.py            # needs Playwright and Chromium for the page figures

1. The page: its size, raw and gzipped (the budget is one response under 60 KB gzipped).
2. The tree in a real browser: the time from navigation to the tree on screen (the page
   marks it with performance.mark), with 2,000 notes (1,000 at the top, 20 folders of 50)
   and with 10,000 notes in 500 folders; the reference is the same page on an empty root,
   measured in the same run. The goal: 2,000 notes in under 1 s.
3. The folder tree of 10,000 notes on a real server: the whole tree against `?depth=1`,
   one client and 16 clients at once (time until all 16 have their answer); the reference
   is GET /api/v1/health the same way.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gzip
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "bench"))
from _common import print_header, server_env  # noqa: E402

import notesvc  # noqa: E402 (the checkout, not an installed copy)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class Server:
    def __init__(self, root: Path):
        env = server_env()  # notesvc's defaults
        cmd = [sys.executable, str(HERE / "notesvc.py"), "--root", str(root)]
        cmd += ["--host", "127.0.0.1", "--port", "0"]
        self.proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
        for line in self.proc.stderr:
            if "listening on http://127.0.0.1:" in line:
                port = line.split("listening on http://127.0.0.1:")[1].split()[0].strip("/")
                self.url = f"http://127.0.0.1:{int(port)}"
                break
        else:
            raise RuntimeError("the server did not start")
        # The access log goes on: keep reading it, or the server blocks on a full pipe.
        threading.Thread(target=lambda: [None for _ in self.proc.stderr], daemon=True).start()
        setup = self.get("/api/v1/system/setup")
        self.key, self.link = setup["apiKey"], setup["links"]["connect"]["hosted"]
        deadline = time.monotonic() + 300  # the first check of the files (in the background)
        while not self.get("/api/v1/system/info", self.key)["index"]["lastSync"]:
            if time.monotonic() > deadline:
                raise RuntimeError("the server's first check of the files did not end")
            time.sleep(0.1)

    def get(self, path: str, key: str | None = None) -> dict:
        req = urllib.request.Request(self.url + path, headers={"X-Service-Key": key or ""})
        with urllib.request.urlopen(req, timeout=120) as resp:
            return json.loads(resp.read())["data"]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def make_root(root: Path, layout: str) -> None:
    notes = root / "notes"
    notes.mkdir(parents=True)
    if layout == "2000":
        for f in range(20):
            (notes / f"project-{f:02d}").mkdir()
            for n in range(50):
                (notes / f"project-{f:02d}" / f"note-{n:03d}.md").write_text(f"# {f}-{n}\n\nx\n")
        for n in range(1000):
            (notes / f"inbox-{n:04d}.md").write_text(f"# Inbox {n}\n\nx\n")
    elif layout == "10000":
        for f in range(500):
            folder = notes / f"area-{f // 25:02d}" / f"folder-{f:03d}"
            folder.mkdir(parents=True, exist_ok=True)
            for n in range(20):
                (folder / f"note-{n:03d}.md").write_text(f"# {f}-{n}\n\n" + "text " * 100)


def page_figures() -> None:
    page = notesvc.web_client_page().encode("utf-8")
    print(f"page: {len(page):,} bytes, {len(gzip.compress(page, 9)):,} bytes gzipped")


def browser_figures(runs: int) -> None:
    from playwright.sync_api import sync_playwright

    rows = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        for layout in ("empty", "2000", "10000"):
            with tempfile.TemporaryDirectory() as tmp:
                make_root(Path(tmp), layout)
                server = Server(Path(tmp))
                try:
                    context = browser.new_context(viewport={"width": 1280, "height": 800})
                    page = context.new_page()
                    page.goto(server.link)
                    page.fill("#key", server.key)
                    page.click("#connect")
                    page.wait_for_selector("#tree button, #tree .empty")
                    times = []
                    for _ in range(runs):
                        page.reload()
                        page.wait_for_selector("#tree button, #tree .empty")
                        marks = "performance.getEntriesByName('notesvc:tree-shown')"
                        times.append(page.evaluate(f"{marks}[0].startTime"))
                    items = page.locator("#tree button, #tree .empty").count()
                    context.close()
                finally:
                    server.stop()
            rows.append((layout, items, statistics.median(times), min(times)))
    ref = rows[0][2]
    print(f"{'notes':<8} {'tree items':>10} {'median ms':>10} {'best ms':>8} {'x empty':>8}")
    for layout, items, median, best in rows:
        print(f"{layout:<8} {items:>10} {median:>10.0f} {best:>8.0f} {median / ref:>8.2f}")


def tree_figures(runs: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        make_root(Path(tmp), "10000")
        server = Server(Path(tmp))
        try:
            server.get("/api/v1/search?q=text", server.key)  # the index is built

            def one(path: str) -> float:
                t = time.perf_counter()
                server.get(path, server.key)
                return time.perf_counter() - t

            def sixteen(path: str) -> float:
                t = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(16) as pool:
                    list(pool.map(lambda _: server.get(path, server.key), range(16)))
                return time.perf_counter() - t

            rows = []
            for name, path in (
                ("reference: GET /health", "/api/v1/health"),
                ("GET /folders/tree", "/api/v1/folders/tree"),
                ("GET /folders/tree?depth=1", "/api/v1/folders/tree?depth=1"),
                (
                    "GET /folders/tree/<area>?depth=1",
                    "/api/v1/folders/tree/notes%2Farea-07?depth=1",
                ),
            ):
                single = statistics.median(one(path) for _ in range(runs)) * 1000
                many = statistics.median(sixteen(path) for _ in range(3)) * 1000
                rows.append((name, single, many))
        finally:
            server.stop()
    ref1, ref16 = rows[0][1], rows[0][2]
    print("10,000 notes in 500 folders (20 areas of 25), a real server:")
    print(f"{'what':<34} {'1 client ms':>11} {'x ref':>7} {'16 at once ms':>13} {'x ref':>7}")
    for name, single, many in rows:
        print(
            f"{name:<34} {single:>11.1f} {single / ref1:>7.1f} {many:>13.0f} {many / ref16:>7.1f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    print_header()
    page_figures()
    tree_figures(args.runs)
    if CHROMIUM:
        browser_figures(args.runs)
    else:
        print("no Chromium: the browser figures are skipped")


if __name__ == "__main__":
    main()
