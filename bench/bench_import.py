"""Benchmark: import (Keep Takeout, Evernote .enex) and export (not run by the tests).

    python bench/bench_import.py                 # 10,000 notes, 1,000 images, 200 MB .enex
    python bench/bench_import.py --quick         # 500 notes, 50 images, 10 MB .enex
    python bench/bench_import.py --only keep     # or enex, export, bounds (comma-separated)
    python bench/bench_import.py --only bounds   # the fourth attack's T4: memory, hostile imports

The issue's goals, one run each, everything in a temp dir under /tmp (removed after):

1. Keep: a synthetic Google Keep Takeout zip (Takeout/Keep/<title>.json in Keep's own
   shape: color, isTrashed, isPinned, isArchived, title, textContent or listContent,
   labels, userEditedTimestampUsec, createdTimestampUsec, attachments [{filePath,
   mimetype}]) of --notes notes whose text is the first --notes notes of
   /work/shared/bench/corpus.py's real-text corpus (--corpus, built there when missing),
   --images of them attaching one image each (Takeout/Keep/<hex>.jpg|png, 20-200 KB of
   random bytes behind a JPEG/PNG signature). Imported in <= 60 s with the search index
   caught up: POSTed raw (application/zip) to a real `notesvc.py` server
   (default settings, key from .notesvc/state.json, header X-Service-Key), timed
   from the request to its 201 (the upload included); then a search for a rare word of the
   last note written must find it (polled when it does not at once: that wait is reported).
   And the command line on its own, `notesvc.py import takeout.zip --root <fresh>`, timed
   as a whole process, its stderr lines time-stamped as they arrive: the largest gap
   between them is goal 4 (progress at least every 2 s; 0.5 s of slack).
2. Evernote: a ~--enex-mb MB .enex (a few thousand real-text notes, plus notes with one or
   two 1-3 MB resources of random bytes behind a PNG signature, base64 in 76-column lines,
   each referred to by an <en-media hash=md5> in its note; most of the bytes are
   resources), POSTed raw (application/xml) to a real server: its RssAnon (from
   /proc/<pid>/status, sampled every 50 ms in a thread) just before the upload and its
   peak during it; growth = peak - before <= 60 MB. Also the command line on its own: its
   RssAnon 0.5 s after start (the interpreter and notesvc loaded) and its peak.
3. Export: a root holding the corpus's notes (notes/...) and the Keep images
   (attachments/keep/), the page cache warmed; `notesvc.py export out.zip` (a process) and
   `GET /api/v1/export.zip` from a real server (streamed to a file; the server started
   first, and its indexing of the root waited out) each within 1.5x of Info-ZIP's
   `zip -qr ref.zip notes attachments` in the root (apt-get install zip), same run.
4. Bounds (the fourth attack's T4; not in the default run): a real server's RssAnon
   (sampled every 20 ms) over its idle just before each upload, at the peak and 3 s after
   the answer, each case on a fresh server at default settings, by a folder key as the
   attack sent them: the 19 MB zip of 200,000 empty entries (dry run: refused by
   SERVICE_MAX_IMPORT_ENTRIES), a zip of 49,000 (dry run, and imported; then the same
   root's idle after a restart, for what 49,000 more notes cost a server), one 63 MB
   .enex note (63 MB of text: dry run and imported) and one .enex note with a 47 MB
   picture (imported). Goal: peak <= 100 MB over idle, <= 50 MB over idle 3 s after.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import html
import http.client
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
NOTESVC = str(HERE.parent / "notesvc.py")
sys.path.insert(0, str(HERE))
from _common import print_header, server_env  # noqa: E402
from bench_offline import corpus_notes  # noqa: E402

ENV = server_env()  # notesvc's defaults, for the servers and the command line alike
LABELS = ["work", "home", "ideas", "reading", "travel", "recipes", "to do", "later"]
COLOURS = ["DEFAULT", "DEFAULT", "DEFAULT", "RED", "YELLOW", "BLUE", "GREEN", "GRAY"]
WORD_RE = re.compile(r"[A-Za-z]{6,}")


# -- measuring -----------------------------------------------------------------------------


def rss_anon_mb(pid: int) -> float:
    """RssAnon of a process, in MB (0 when it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    m = re.search(r"RssAnon:\s+(\d+) kB", status)
    return int(m.group(1)) / 1024 if m else 0.0


class RssSampler:
    """Samples a process's RssAnon every 50 ms in a thread; .peak is the highest seen."""

    def __init__(self, pid: int, every: float = 0.05):
        self.pid, self.every, self.peak, self.samples = pid, every, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon_mb(self.pid))
            self.samples += 1
            self._stop.wait(self.every)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon_mb(self.pid))


def cpu_seconds(pid: int) -> float:
    """CPU seconds of a process and its live children (the index helper)."""
    total = 0.0
    pids = [pid]
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            kids = Path(f"/proc/{pid}/task/{task}/children").read_text().split()
            pids += [int(k) for k in kids]
    except OSError:
        pass
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def wait_quiet(pid: int, quiet: float = 1.5, limit: float = 180.0) -> float:
    """Wait until a server (and its helper) spends no CPU for `quiet` s; return the wait."""
    started = time.monotonic()
    last, since = cpu_seconds(pid), time.monotonic()
    while time.monotonic() - started < limit:
        time.sleep(0.25)
        now = cpu_seconds(pid)
        if now - last > 0.02:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            break
    return time.monotonic() - started - quiet


# -- the server ----------------------------------------------------------------------------


class Server:
    """A real `notesvc.py --root <root>` on a free loopback port."""

    def __init__(self, root: Path):
        self.root = root
        self.proc = subprocess.Popen(
            [sys.executable, NOTESVC, "--root", str(root), "--host", "127.0.0.1", "--port", "0"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
        )
        ready, port = threading.Event(), []

        def read() -> None:
            for line in self.proc.stderr:
                m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
                if m and not port:
                    port.append(int(m.group(1)))
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(60):
            self.stop()
            raise SystemExit(f"the server on {root} did not start")
        self.port = port[0]
        state = json.loads((root / ".notesvc" / "state.json").read_text())
        self.key = state["apiKey"]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=3600, blocksize=1 << 20)

    def get_json(self, path: str) -> tuple:
        c = self.conn()
        try:
            c.request("GET", path, headers={"X-Service-Key": self.key})
            resp = c.getresponse()
            return resp.status, json.loads(resp.read() or b"{}")
        finally:
            c.close()

    def folder_key(self, folder: str) -> str:
        """Return a new write key for one folder (as the attack's imports were sent)."""
        c = self.conn()
        try:
            grant = {"name": "bench", "scope": "write", "folder": folder}
            headers = {"X-Service-Key": self.key, "Content-Type": "application/json"}
            c.request("POST", "/api/v1/auth/keys", body=json.dumps(grant), headers=headers)
            return json.loads(c.getresponse().read())["data"]["key"]
        finally:
            c.close()

    def post_file(self, path: str, file: Path, ctype: str, key: str = "") -> tuple:
        c = self.conn()
        try:
            with open(file, "rb") as f:
                headers = {
                    "X-Service-Key": key or self.key,
                    "Content-Type": ctype,
                    "Content-Length": str(file.stat().st_size),
                }
                c.request("POST", path, body=f, headers=headers)
            resp = c.getresponse()
            return resp.status, json.loads(resp.read() or b"{}")
        finally:
            c.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run_cli(args: list, sample_rss: bool = False) -> dict:
    """Run `notesvc.py <args>`; return its wall time, exit code, stderr lines with their
    arrival times, and (sample_rss) its RssAnon 0.5 s after start and its peak."""
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, NOTESVC, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    lines: list = []
    out: list = []

    def read_err() -> None:
        for line in proc.stderr:
            lines.append((time.monotonic() - started, line.rstrip("\n")))

    def read_out() -> None:
        out.append(proc.stdout.read())

    threads = [threading.Thread(target=f, daemon=True) for f in (read_err, read_out)]
    for t in threads:
        t.start()
    early = 0.0
    sampler = RssSampler(proc.pid)
    if sample_rss:
        sampler.__enter__()
        time.sleep(0.5)
        early = rss_anon_mb(proc.pid)
    rc = proc.wait()
    wall = time.monotonic() - started
    if sample_rss:
        sampler.__exit__()
    for t in threads:
        t.join()
    if rc:
        print("".join(out), "\n".join(line for _, line in lines), file=sys.stderr)
        raise SystemExit(f"notesvc.py {' '.join(args[:2])} failed ({rc})")
    return {
        "wall": wall,
        "lines": lines,
        "stdout": "".join(out),
        "early": early,
        "peak": sampler.peak,
    }


# -- the inputs ----------------------------------------------------------------------------


def fake_image(rng: random.Random, size: int, png: bool) -> bytes:
    head = b"\x89PNG\r\n\x1a\n" if png else b"\xff\xd8\xff\xe0\x00\x10JFIF\x00"
    return head + rng.randbytes(size - len(head))


def split_note(text: str) -> tuple:
    """(title, body) of a corpus note ('# Title' first)."""
    first, _, rest = text.partition("\n")
    return first.lstrip("# ").strip(), rest.strip("\n")


def make_images(folder: Path, n: int, rng: random.Random) -> list:
    """Write n images (20-200 KB, JPEG or PNG) into folder; return their names."""
    folder.mkdir(parents=True)
    names = []
    for i in range(n):
        png = i % 3 == 0
        name = f"{rng.getrandbits(64):016x}.{'png' if png else 'jpg'}"
        (folder / name).write_bytes(fake_image(rng, rng.randint(20_000, 200_000), png))
        names.append(name)
    return names


def make_takeout(out: Path, notes: list, images: Path, names: list, rng: random.Random) -> dict:
    """Write a Keep Takeout zip; return the last note's title and a rare word of it."""
    every = max(1, len(notes) // max(1, len(names))) if names else 0
    used: set = set()
    last = {}
    base = 1_600_000_000_000_000
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        attached = 0
        for i, (_, text) in enumerate(notes):
            title, body = split_note(text)
            when = base + i * 3_600_000_000
            data = {
                "color": rng.choice(COLOURS),
                "isTrashed": False,
                "isPinned": i % 50 == 0,
                "isArchived": i % 40 == 0,
                "title": title,
                "userEditedTimestampUsec": when + 86_400_000_000,
                "createdTimestampUsec": when,
                "labels": [{"name": n} for n in rng.sample(LABELS, rng.randint(0, 2))],
            }
            if i % 10 == 7:  # a checklist: the body's non-empty lines
                items = [ln.strip() for ln in body.splitlines() if ln.strip()][:40]
                data["listContent"] = [{"text": t, "isChecked": rng.random() < 0.3} for t in items]
            else:
                data["textContent"] = body
            if every and i % every == 0 and attached < len(names):
                name = names[attached]
                mime = "image/png" if name.endswith(".png") else "image/jpeg"
                data["attachments"] = [{"filePath": name, "mimetype": mime}]
                attached += 1
            stem = re.sub(r'[\\/:*?"<>|]', "_", title)[:100] or "Untitled"
            leaf, k = stem, 1
            while leaf.casefold() in used:
                leaf, k = f"{stem}({k})", k + 1
            used.add(leaf.casefold())
            zf.writestr(f"Takeout/Keep/{leaf}.json", json.dumps(data, ensure_ascii=False))
            last = {"title": title, "text": body}
        for name in names:
            zf.write(images / name, f"Takeout/Keep/{name}", zipfile.ZIP_STORED)
    words = sorted(set(WORD_RE.findall(last["text"])), key=lambda w: (-len(w), w))
    last["word"] = words[0].lower() if words else last["title"].split()[0].lower()
    return last


def enml_of(body: str) -> str:
    paras = [p.strip() for p in body.split("\n\n") if p.strip()]
    divs = "".join(f"<div>{html.escape(p)}</div>" for p in paras)
    return f"<en-note>{divs}</en-note>".replace("]]>", "]] >")


def make_enex(out: Path, notes: list, target: int, rng: random.Random) -> dict:
    """Write an .enex of about `target` bytes; return its counts."""
    head = (
        '<?xml version="1.0" encoding="UTF-8"?>\n<!DOCTYPE en-export SYSTEM '
        '"http://xml.evernote.com/pub/evernote-export4.dtd">\n'
        '<en-export export-date="20240101T000000Z" application="Evernote" version="10">\n'
    )
    counts = {"text": 0, "with_resources": 0, "resources": 0, "resource_bytes": 0}
    texts = list(notes)
    est_resource_notes = max(1, int(target * 0.9 / (2_000_000 * 1.5 * 4 / 3)))
    per = max(1, len(texts) // est_resource_notes)

    def note_xml(title: str, content: str, resources: str, i: int) -> str:
        created = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(1_577_934_245 + i * 3600))
        return (
            f"<note><title>{html.escape(title)}</title><created>{created}</created>"
            f"<updated>{created}</updated><tag>bench</tag>"
            f"<content><![CDATA[{content}]]></content>{resources}</note>\n"
        )

    with open(out, "w", encoding="utf-8") as f:
        f.write(head)
        i = 0
        while True:
            for _, text in texts[:per]:
                title, body = split_note(text)
                f.write(note_xml(title, enml_of(body), "", i))
                counts["text"] += 1
                i += 1
            texts = texts[per:]
            if f.tell() >= target - 1_000_000:
                break
            res, media = [], []
            for _ in range(1 if rng.random() < 0.7 else 2):
                data = fake_image(rng, rng.randint(1_000_000, 3_000_000), True)
                md5 = hashlib.md5(data, usedforsecurity=False).hexdigest()
                b64 = base64.encodebytes(data).decode("ascii")
                name = f"scan-{counts['resources']}.png"
                res.append(
                    f'<resource><data encoding="base64">\n{b64}</data><mime>image/png</mime>'
                    f"<resource-attributes><file-name>{name}</file-name>"
                    "</resource-attributes></resource>"
                )
                media.append(f'<div><en-media hash="{md5}" type="image/png"/></div>')
                counts["resources"] += 1
                counts["resource_bytes"] += len(data)
            _, caption = split_note(rng.choice(notes)[1])
            content = enml_of(caption[:400]).replace("</en-note>", "".join(media) + "</en-note>")
            f.write(note_xml(f"Scan {counts['with_resources']}", content, "".join(res), i))
            counts["with_resources"] += 1
            i += 1
        for _, text in texts:
            title, body = split_note(text)
            f.write(note_xml(title, enml_of(body), "", i))
            counts["text"] += 1
            i += 1
        f.write("</en-export>\n")
    counts["bytes"] = out.stat().st_size
    return counts


# -- the measures --------------------------------------------------------------------------


def find_note(server: Server, word: str, title: str) -> bool:
    q = urllib.parse.urlencode({"q": word, "limit": 100})
    status, body = server.get_json(f"/api/v1/search?{q}")
    if status != 200:
        return False
    data = body.get("data", body)
    return any(r.get("title") == title for r in data.get("results", []))


def bench_keep(tmp: Path, notes: list, n_images: int, rows: list, rng: random.Random) -> None:
    images = tmp / "images"
    names = make_images(images, n_images, rng)
    takeout = tmp / "takeout.zip"
    started = time.monotonic()
    last = make_takeout(takeout, notes, images, names, rng)
    size = takeout.stat().st_size
    print(
        f"  takeout: {len(notes)} notes, {len(names)} images, {size / 1e6:.1f} MB "
        f"(built in {time.monotonic() - started:.1f} s); last note {last['title']!r}, "
        f"word {last['word']!r}",
        flush=True,
    )
    # through a real server
    root = tmp / "keep-server"
    root.mkdir()
    server = Server(root)
    try:
        started = time.monotonic()
        status, body = server.post_file("/api/v1/import", takeout, "application/zip")
        took = time.monotonic() - started
        if status != 201:
            raise SystemExit(f"the import answered {status}: {body}")
        report = body.get("data", body)
        found_at = None
        while time.monotonic() - started < took + 120:
            if find_note(server, last["word"], last["title"]):
                found_at = time.monotonic() - started
                break
            time.sleep(0.1)
        print(
            f"  server: 201 in {took:.1f} s: {report['created']} notes, "
            f"{report['attachments']} files, {len(report['skipped'])} skipped; last note "
            f"found by search {'at ' + format(found_at, '.1f') + ' s' if found_at else 'NEVER'}",
            flush=True,
        )
        whole = found_at if found_at is not None else float("inf")
        rows.append(
            (
                "Keep import via server, POST to 201",
                f"{took:.1f} s",
                "",
                "",
                "<= 60 s",
                took <= 60,
            )
        )
        rows.append(
            (
                "  ... to last note found by search",
                f"{whole:.1f} s" if found_at else "not found",
                "",
                "",
                "<= 60 s",
                whole <= 60,
            )
        )
        rows.append(
            (
                "  server RssAnon after",
                f"{rss_anon_mb(server.pid):.1f} MB",
                "",
                "",
                "reported",
                None,
            )
        )
    finally:
        server.stop()
    # the command line on its own
    root = tmp / "keep-cli"
    root.mkdir()
    run = run_cli(["import", str(takeout), "--root", str(root)], sample_rss=True)
    times = [0.0] + [t for t, _ in run["lines"]] + [run["wall"]]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    inner = gaps[1:-1] or [0.0]
    where = max(range(len(gaps)), key=gaps.__getitem__)
    print(
        f"  CLI: {run['wall']:.1f} s, {len(run['lines'])} stderr lines, peak RssAnon "
        f"{run['peak']:.1f} MB; {run['stdout'].strip()[:200]}",
        flush=True,
    )
    for t, line in run["lines"]:
        print(f"    {t:6.2f} s  {line[:110]}")
    rows.append(
        ("Keep import, CLI alone", f"{run['wall']:.1f} s", "", "", "<= 60 s", run["wall"] <= 60)
    )
    rows.append(
        (
            "  CLI largest gap between stderr lines",
            f"{max(inner):.2f} s",
            "",
            "",
            "<= 2 s (+0.5)",
            max(inner) <= 2.5,
        )
    )
    rows.append(
        (
            "  ... counting start and exit",
            f"{max(gaps):.2f} s (#{where})",
            "",
            "",
            "<= 2 s (+0.5)",
            max(gaps) <= 2.5,
        )
    )
    rows.append(("  CLI peak RssAnon", f"{run['peak']:.1f} MB", "", "", "reported", None))
    return names


def bench_enex(tmp: Path, notes: list, mb: int, rows: list, rng: random.Random) -> None:
    enex = tmp / "export.enex"
    started = time.monotonic()
    counts = make_enex(enex, notes, mb * 1_000_000, rng)
    print(
        f"  enex: {counts['bytes'] / 1e6:.1f} MB, {counts['text']} text notes, "
        f"{counts['with_resources']} notes with {counts['resources']} resources "
        f"({counts['resource_bytes'] / 1e6:.1f} MB decoded) in {time.monotonic() - started:.1f} s",
        flush=True,
    )
    root = tmp / "enex-server"
    root.mkdir()
    server = Server(root)
    try:
        time.sleep(1.0)
        before = rss_anon_mb(server.pid)
        with RssSampler(server.pid) as sampler:
            started = time.monotonic()
            status, body = server.post_file("/api/v1/import", enex, "application/xml")
            took = time.monotonic() - started
        if status != 201:
            raise SystemExit(f"the import answered {status}: {body}")
        report = body.get("data", body)
        growth = sampler.peak - before
        print(
            f"  server: 201 in {took:.1f} s: {report['created']} notes, {report['attachments']} "
            f"files, {len(report['skipped'])} skipped; RssAnon {before:.1f} -> peak "
            f"{sampler.peak:.1f} MB ({sampler.samples} samples)",
            flush=True,
        )
        rows.append(
            (
                f"ENEX {counts['bytes'] / 1e6:.0f} MB via server: RssAnon growth",
                f"{growth:.1f} MB",
                f"{before:.1f} MB before",
                f"peak {sampler.peak:.1f}",
                "<= 60 MB",
                growth <= 60,
            )
        )
        rows.append(("  ... POST to 201", f"{took:.1f} s", "", "", "reported", None))
    finally:
        server.stop()
    root = tmp / "enex-cli"
    root.mkdir()
    run = run_cli(["import", str(enex), "--root", str(root)], sample_rss=True)
    print(
        f"  CLI: {run['wall']:.1f} s, RssAnon {run['early']:.1f} MB at 0.5 s, peak "
        f"{run['peak']:.1f} MB; {run['stdout'].strip()[:200]}",
        flush=True,
    )
    rows.append(
        (
            "ENEX via CLI alone: RssAnon growth",
            f"{run['peak'] - run['early']:.1f} MB",
            f"{run['early']:.1f} MB at 0.5 s",
            f"peak {run['peak']:.1f}",
            "<= 60 MB",
            run["peak"] - run["early"] <= 60,
        )
    )
    rows.append(("  ... CLI wall time", f"{run['wall']:.1f} s", "", "", "reported", None))


def bench_export(tmp: Path, corpus: Path, notes: list, images: Path, rows: list) -> None:
    root = tmp / "export-root"
    for rel, text in notes:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    shutil.copytree(images, root / "attachments" / "keep")
    files = [p for p in root.rglob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    for p in files:  # warm the page cache
        p.read_bytes()
    print(f"  root: {len(files)} files, {total / 1e6:.1f} MB", flush=True)
    if not shutil.which("zip"):
        raise SystemExit("no zip here: apt-get install -y zip")
    server = Server(root)  # first: it makes the root's state, and indexes the notes
    try:
        waited = wait_quiet(server.pid)
        ref_zip = tmp / "ref.zip"
        started = time.monotonic()
        subprocess.run(["zip", "-qr", str(ref_zip), "notes", "attachments"], cwd=root, check=True)
        ref = time.monotonic() - started
        cli_zip = tmp / "cli.zip"
        run = run_cli(["export", str(cli_zip), "--root", str(root)])  # "works while serving"
        http_zip = tmp / "http.zip"
        c = server.conn()
        started = time.monotonic()
        c.request("GET", "/api/v1/export.zip", headers={"X-Service-Key": server.key})
        resp = c.getresponse()
        with open(http_zip, "wb") as f:
            while chunk := resp.read(1 << 20):
                f.write(chunk)
        over_http = time.monotonic() - started
        c.close()
        if resp.status != 200:
            raise SystemExit(f"the export answered {resp.status}")
    finally:
        server.stop()
    started = time.monotonic()
    subprocess.run(
        ["zip", "-qr", str(tmp / "ref2.zip"), "notes", "attachments"], cwd=root, check=True
    )
    ref2 = time.monotonic() - started
    sizes = {p: p.stat().st_size / 1e6 for p in (ref_zip, cli_zip, http_zip)}
    entries = {p: len(zipfile.ZipFile(p).namelist()) for p in (ref_zip, cli_zip, http_zip)}
    print(
        f"  zip -qr {ref:.2f} s (again after: {ref2:.2f} s), {sizes[ref_zip]:.1f} MB, "
        f"{entries[ref_zip]} entries (folders too); CLI {run['wall']:.2f} s, "
        f"{sizes[cli_zip]:.1f} MB, {entries[cli_zip]}; HTTP {over_http:.2f} s, "
        f"{sizes[http_zip]:.1f} MB, {entries[http_zip]} (server quiet after {waited:.1f} s)",
        flush=True,
    )
    rows.append(
        (
            "ref.: zip -qr notes attachments",
            f"{ref:.2f} s",
            f"{sizes[ref_zip]:.1f} MB",
            "1.00",
            "",
            None,
        )
    )
    for label, secs, p in (
        ("export, CLI (whole process)", run["wall"], cli_zip),
        ("export, GET /api/v1/export.zip", over_http, http_zip),
    ):
        rows.append(
            (
                label,
                f"{secs:.2f} s",
                f"{sizes[p]:.1f} MB",
                f"{secs / ref:.2f}x",
                "<= 1.5x zip",
                secs / ref <= 1.5,
            )
        )


def empty_entries_zip(out: Path, count: int) -> None:
    """Write a zip of `count` empty notes byte by byte, as the attack's (19 MB for 200,000),
    with a Zip64 end record past 65,535 entries, as zipfile writes one."""
    import struct

    local, central, at = [], [], 0
    for i in range(count):
        name = b"n%06d.md" % i
        head = (0, 0, 0, 0x21, 0, 0, 0)
        local.append(struct.pack("<4sHHHHHLLLHH", b"PK\x03\x04", 20, *head, len(name), 0) + name)
        central.append(
            struct.pack(
                "<4sHHHHHHLLLHHHHHLL", b"PK\x01\x02", 20, 20, *head, len(name), 0, 0, 0, 0, 0, at
            )
            + name
        )
        at += 30 + len(name)
    directory = b"".join(central)
    tail = b""
    if count > 0xFFFF:
        end64 = at + len(directory)
        tail = struct.pack(
            "<4sQHHLLQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, len(directory), at
        ) + struct.pack("<4sLQL", b"PK\x06\x07", 0, end64, 1)
    short = min(count, 0xFFFF)
    end = struct.pack("<4sHHHHLLH", b"PK\x05\x06", 0, 0, short, short, len(directory), at, 0)
    out.write_bytes(b"".join(local) + directory + tail + end)


def big_enex_note(out: Path, text_mb: int = 0, picture_mb: int = 0) -> None:
    """Write an .enex of one note: `text_mb` MB of ENML text, or a picture of `picture_mb` MB
    of random bytes (base64 in 76 columns, shown by its hash)."""
    head = '<?xml version="1.0" encoding="UTF-8"?>\n<en-export><note><title>Big</title>'
    with open(out, "wb") as f:
        f.write(head.encode())
        f.write(b"<content><![CDATA[<en-note>")
        if text_mb:
            para = b"<div>" + b"lorem ipsum dolor sit amet " * 30 + b"</div>\n"
            f.write(para * (text_mb * 1_000_000 // len(para)))
        if picture_mb:
            data = os.urandom(picture_mb * 1_000_000)
            digest = hashlib.md5(data, usedforsecurity=False).hexdigest()
            f.write(f'<en-media hash="{digest}" type="image/png"/>'.encode())
        f.write(b"</en-note>]]></content>")
        if picture_mb:
            f.write(b'<resource><data encoding="base64">')
            f.write(base64.encodebytes(data))
            f.write(b"</data><mime>image/png</mime></resource>")
        f.write(b"</note></en-export>\n")


def bounds_case(tmp: Path, name: str, upload: Path, ctype: str, dry: bool, restart=False) -> dict:
    """Import `upload` by a folder key into a fresh server; return its RssAnon figures."""
    root = tmp / f"bounds-{name}"
    server = Server(root)
    try:
        key = server.folder_key("notes/family")
        wait_quiet(server.pid, 1.0, 60)
        idle = rss_anon_mb(server.pid)
        with RssSampler(server.pid, every=0.02) as sampler:
            started = time.monotonic()
            status, body = server.post_file(
                f"/api/v1/import?dryRun={str(dry).lower()}", upload, ctype, key
            )
            took = time.monotonic() - started
        time.sleep(3.0)
        after = rss_anon_mb(server.pid)
    finally:
        server.stop()
    figures = {"idle": idle, "peak": sampler.peak, "after": after, "took": took}
    figures.update(status=status, answer=body.get("data") or body.get("error"))
    if restart:  # what the same notes cost a server that starts with them
        server = Server(root)
        try:
            time.sleep(2.0)
            wait_quiet(server.pid, 1.5, 300)
            figures["restarted"] = rss_anon_mb(server.pid)
        finally:
            server.stop()
    shutil.rmtree(root, ignore_errors=True)
    return figures


def bench_bounds(tmp: Path, rows: list) -> None:
    many, under = tmp / "200k.zip", tmp / "49k.zip"
    text, picture = tmp / "text-63mb.enex", tmp / "picture-47mb.enex"
    empty_entries_zip(many, 200_000)
    empty_entries_zip(under, 49_000)
    big_enex_note(text, text_mb=63)
    big_enex_note(picture, picture_mb=47)
    for f in (many, under, text, picture):
        print(f"  {f.name}: {f.stat().st_size / 1e6:.1f} MB", flush=True)
    cases = [
        ("200,000 empty entries, dry run", many, "application/zip", True, False),
        ("49,000 empty entries, dry run", under, "application/zip", True, False),
        ("49,000 empty entries, imported", under, "application/zip", False, True),
        ("one 63 MB .enex note (text), dry run", text, "application/xml", True, False),
        ("one 63 MB .enex note (text), imported", text, "application/xml", False, False),
        (
            "one .enex note, 47 MB picture (64 MB), imported",
            picture,
            "application/xml",
            False,
            False,
        ),
    ]
    for label, upload, ctype, dry, restart in cases:
        name = re.sub(r"\W+", "-", label)
        f = bounds_case(tmp, name, upload, ctype, dry, restart)
        answer = f["answer"]
        said = (
            answer.get("message", "")[:90]
            if f["status"] >= 400
            else (
                f"{answer['created']} notes, {answer['attachments']} files, "
                f"{len(answer['skipped'])} skipped"
            )
        )
        print(
            f"  {label}: {f['status']} in {f['took']:.1f} s ({said}); RssAnon idle "
            f"{f['idle']:.1f}, peak {f['peak']:.1f}, 3 s after {f['after']:.1f} MB"
            + (f"; the same root restarted: {f['restarted']:.1f} MB" if restart else ""),
            flush=True,
        )
        growth, left = f["peak"] - f["idle"], f["after"] - f["idle"]
        rows.append(
            (
                label,
                f"+{growth:.1f} MB peak",
                f"{f['idle']:.1f} MB idle",
                "",
                "<= 100 MB",
                growth <= 100,
            )
        )
        rows.append(
            ("  ... 3 s after the answer", f"+{left:.1f} MB", "", "", "<= 50 MB", left <= 50)
        )
        if restart:
            rows.append(
                (
                    "  ... the same root, restarted, idle",
                    f"{f['restarted']:.1f} MB",
                    "",
                    "",
                    "reported",
                    None,
                )
            )


def print_table(rows: list) -> None:
    head = ("measure", "value", "reference", "ratio", "goal", "met?")
    table = [head] + [(*r[:5], "" if r[5] is None else ("yes" if r[5] else "NO")) for r in rows]
    widths = [max(len(str(r[i])) for r in table) for i in range(len(head))]
    for i, r in enumerate(table):
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--notes", type=int, default=10000)
    ap.add_argument("--images", type=int, default=1000)
    ap.add_argument("--enex-mb", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="500 notes, 50 images, 10 MB .enex")
    ap.add_argument("--corpus", type=Path, default=Path("~/corpus/10k").expanduser())
    ap.add_argument("--only", default="keep,enex,export", help="keep, enex, export, bounds")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keep-tmp", action="store_true", help="leave the temp dir behind")
    args = ap.parse_args()
    print_header()
    if args.quick:
        args.notes, args.images, args.enex_mb = 500, 50, 10
    only = set(args.only.split(","))
    notes = corpus_notes(args.corpus, args.notes) if only - {"bounds"} else []
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="bench_import_", dir="/tmp"))
    rows: list = []
    print(f"temp dir {tmp}; {os.cpu_count()} cores; Python {sys.version.split()[0]}", flush=True)
    try:
        images = tmp / "images"
        if "keep" in only:
            print("Keep Takeout import", flush=True)
            bench_keep(tmp, notes, args.images, rows, rng)
        elif "export" in only:
            make_images(images, args.images, rng)
        if "enex" in only:
            print("Evernote .enex import", flush=True)
            bench_enex(tmp, notes[:3000], args.enex_mb, rows, rng)
        if "export" in only:
            print("Export", flush=True)
            bench_export(tmp, args.corpus, notes, images, rows)
        if "bounds" in only:
            print("Bounds: RssAnon under the attack's imports (T4)", flush=True)
            bench_bounds(tmp, rows)
        print()
        print_table(rows)
    finally:
        if args.keep_tmp:
            print(f"left {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
