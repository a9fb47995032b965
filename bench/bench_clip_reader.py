"""Benchmark: capture (issue 54). A clip's conversion, and search while the reader reads.

    python bench/bench_clip_reader.py [--runs 30] [--pdfs 200] [--notes 2000] [--window 60]

1. Clip: a 1 MB article page as a browser renders one (inline scripts and JSON, styles, a
   navigation and a footer of links, 400 paragraphs with links and emphasis, figures,
   tables) converted by notesvc.html_to_markdown, p50 of `--runs` (goal: <= 200 ms). The
   reference in the same run is the standard library's html.parser.HTMLParser reading the
   same page and doing nothing (what any converter built on it costs at least).
2. The reader: a real `python notesvc.py` over `--notes` notes and `--pdfs` PDFs linked from
   them (half with a text layer, half scans that need OCR). Search p50 (20 queries, each
   several times) with SERVICE_ATTACHMENT_TEXT=off is the reference; the same searches on
   the same files while the reader works is the ratio (goal: <= 1.2x). Then the server's
   CPU with its children (the tools), from /proc, over `--window` seconds of reading
   (goal: <= half a core).
"""

from __future__ import annotations

import argparse
import html.parser
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
import urllib.request
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
NOTESVC = str(HERE.parent / "notesvc.py")
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from _common import print_header, server_env  # noqa: E402

WORDS = (
    "tide harbour moon sailor chart neap spring current vessel anchor buoy channel pilot "
    "ebb flood estuary lighthouse keel rudder mast hull quay pier beacon compass fathom "
    "gale squall swell breaker reef shoal sandbank dune coast cliff cove bay inlet"
).split()


def article_page(size: int = 1_000_000, seed: int = 7) -> str:
    """Return an article page of about `size` bytes, shaped like a news site's."""
    rnd = random.Random(seed)

    def sentence(n: int) -> str:
        return " ".join(rnd.choice(WORDS) for _ in range(n)).capitalize() + "."

    def paragraph() -> str:
        parts = []
        for i in range(rnd.randint(5, 9)):
            s = sentence(rnd.randint(8, 16))
            if i == 1:
                s = f'See <a href="/wiki/{rnd.choice(WORDS)}?ref=art">{s}</a>'
            elif i == 3:
                s = f"<em>{s}</em> and <strong>{rnd.choice(WORDS)}</strong>"
            elif i == 5:
                s += f" Use <code>{rnd.choice(WORDS)}_{rnd.randint(1, 99)}()</code>."
            parts.append(s)
        return '<p class="body-text">' + " ".join(parts) + "</p>\n"

    head = [
        "<!doctype html><html lang=en><head><meta charset=utf-8><title>Tides explained</title>",
        "<style>"
        + "".join(f".c{i}{{margin:{i}px;color:#{i:06x}}}" for i in range(1500))
        + "</style>",
        '<script type="application/json" id="__DATA__">'
        + json.dumps({"items": [{"id": i, "w": sentence(6)} for i in range(1500)]})
        + "</script>",
        "<script>" + "var a=1;" * 8000 + "</script></head><body>",
        "<header><nav>"
        + "".join(f'<a href="/section/{i}">Section {i}</a> ' for i in range(300))
        + "</nav></header><main><article><h1>Tides explained</h1>",
    ]
    body, total = [], sum(map(len, head))
    n = 0
    while total < size * 1.01:
        n += 1
        block = paragraph()
        if n % 12 == 0:
            block += (
                f'<figure><img src="/img/{n}.jpg" alt="figure {n}" loading="lazy">'
                f"<figcaption>{sentence(6)}</figcaption></figure>\n"
            )
        if n % 40 == 0:
            rows = "".join(
                f"<tr><td>{rnd.choice(WORDS)}</td><td>{rnd.randint(1, 99)}</td></tr>"
                for _ in range(8)
            )
            block += f"<h2>{sentence(4)}</h2><table><tr><th>a</th><th>b</th></tr>{rows}</table>\n"
        body.append(block)
        total += len(block)
    foot = (
        "</article></main><aside>Advertisement</aside><footer>"
        + "".join(f'<a href="/more/{i}">More {i}</a> ' for i in range(400))
        + "</footer></body></html>"
    )
    page = "".join(head) + "".join(body) + foot
    return page


def pct(xs: list, p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def bench_clip(runs: int) -> None:
    import notesvc

    page = article_page()
    ours, ref = [], []
    for _ in range(runs):
        t = time.perf_counter()
        md, _title, _remote = notesvc.html_to_markdown(page, "https://news.example/tides", {})
        ours.append((time.perf_counter() - t) * 1000)
        t = time.perf_counter()
        parser = html.parser.HTMLParser(convert_charrefs=True)
        parser.feed(page)
        parser.close()
        ref.append((time.perf_counter() - t) * 1000)
    size = len(page.encode()) / 1e6
    print(f"\n1. clip: a {size:.2f} MB article page -> {len(md) / 1e3:.0f} KB of Markdown")
    print(f"{'':<44} {'p50 ms':>8} {'p95 ms':>8} {'min ms':>8}")
    print(
        f"{'notesvc.html_to_markdown':<44} {pct(ours, 50):>8.1f} {pct(ours, 95):>8.1f} "
        f"{min(ours):>8.1f}"
    )
    name = "reference: html.parser.HTMLParser, no-op"
    print(f"{name:<44} {pct(ref, 50):>8.1f} {pct(ref, 95):>8.1f} {min(ref):>8.1f}")
    print(f"ratio ours / reference (p50): {pct(ours, 50) / pct(ref, 50):.2f}")
    goal = "met" if pct(ours, 50) <= 200 else "MISSED"
    print(f"goal p50 <= 200 ms: {goal}")


# -- the reader --------------------------------------------------------------------------------


def _pdf(objects: list) -> bytes:
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for i, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += f"{i} 0 obj\n".encode() + body + b"\nendobj\n"
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    out += b"".join(f"{o:010d} 00000 n \n".encode() for o in offsets)
    out += (
        f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    )
    return bytes(out)


def text_pdf(lines: list) -> bytes:
    stream = "".join(
        f"BT /F1 20 Tf 50 {740 - 28 * j} Td ({line}) Tj ET\n" for j, line in enumerate(lines)
    ).encode()
    return _pdf(
        [
            b"<< /Type /Catalog /Pages 2 0 R >>",
            b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
            b"/Resources << /Font << /F1 5 0 R >> >> >>",
            f"<< /Length {len(stream)} >>\nstream\n".encode() + stream + b"endstream",
            b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
        ]
    )


def scanned_pdf(text: bytes, tmp: Path) -> bytes:
    """A scan: the text PDF drawn by pdftoppm (grey, 100 dpi), put back as an image only."""
    src = tmp / "page.pdf"
    src.write_bytes(text)
    subprocess.run(["pdftoppm", "-r", "100", "-gray", str(src), str(tmp / "pg")], check=True)
    pgm = next(tmp.glob("pg*")).read_bytes()
    for f in tmp.glob("pg*"):
        f.unlink()
    _magic, dims, _maxval, pixels = pgm.split(b"\n", 3)
    w, h = map(int, dims.split())
    packed = zlib.compress(pixels[: w * h])
    draw = f"q {w * 72 // 100} 0 0 {h * 72 // 100} 0 0 cm /Im0 Do Q".encode()
    return _pdf(
        [
            b"<< /Type /Catalog /Pages 2 0 R >>",
            b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
            f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 {w * 72 // 100} {h * 72 // 100}] "
            f"/Contents 4 0 R /Resources << /XObject << /Im0 5 0 R >> >> >>".encode(),
            f"<< /Length {len(draw)} >>\nstream\n".encode() + draw + b"\nendstream",
            f"<< /Type /XObject /Subtype /Image /Width {w} /Height {h} /ColorSpace /DeviceGray "
            f"/BitsPerComponent 8 /Filter /FlateDecode /Length {len(packed)} >>\nstream\n".encode()
            + packed
            + b"\nendstream",
        ]
    )


def make_root(root: Path, notes: int, pdfs: int) -> None:
    rnd = random.Random(3)
    tmp = Path(tempfile.mkdtemp())
    (root / "attachments" / "docs").mkdir(parents=True)
    for i in range(pdfs):
        lines = [" ".join(rnd.choice(WORDS) for _ in range(6)) for _ in range(12)]
        raw = text_pdf(lines)
        if i % 2:
            raw = scanned_pdf(raw, tmp)
        (root / "attachments" / "docs" / f"doc{i}.pdf").write_bytes(raw)
    for i in range(notes):
        folder = root / "notes" / f"f{i % 20}"
        folder.mkdir(parents=True, exist_ok=True)
        text = "\n".join(" ".join(rnd.choice(WORDS) for _ in range(12)) for _ in range(8))
        link = f"\n\n[doc](../../attachments/docs/doc{i % pdfs}.pdf)\n" if i < pdfs else ""
        (folder / f"note {i}.md").write_text(f"# Note {i}\n\n{text}{link}")
    shutil.rmtree(tmp)


class Running:
    def __init__(self, root: Path, settings: dict):
        command = [
            sys.executable,
            NOTESVC,
            "--root",
            str(root),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
        ]
        self.proc = subprocess.Popen(
            command, stderr=subprocess.PIPE, text=True, env=server_env(settings)
        )
        for line in self.proc.stderr:
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            if m:
                self.base = f"http://127.0.0.1:{m.group(1)}"
                break
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()
        state = json.loads((root / ".notesvc" / "state.json").read_text())
        self.headers = {"X-Service-Key": state["apiKey"]}

    def get(self, path: str) -> dict:
        req = urllib.request.Request(self.base + path, headers=self.headers)
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.loads(resp.read())["data"]

    def post(self, path: str, body: dict) -> float:
        data = json.dumps(body).encode()
        req = urllib.request.Request(
            self.base + path, data, {**self.headers, "Content-Type": "application/json"}
        )
        t = time.perf_counter()
        with urllib.request.urlopen(req, timeout=60) as resp:
            resp.read()
        return (time.perf_counter() - t) * 1000

    def cpu(self) -> float:
        """CPU seconds of the server, its threads and its ended children."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        return sum(int(fields[i]) for i in (11, 12, 13, 14)) / ticks

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def searches(server: Running, queries: list, rounds: int) -> list:
    out = []
    for _ in range(rounds):
        for q in queries:
            t = time.perf_counter()
            server.get(f"/api/v1/search?q={urllib.parse.quote(q)}")
            out.append((time.perf_counter() - t) * 1000)
    return out


def wait_indexed(server: Running, notes: int) -> None:
    deadline = time.monotonic() + 600
    while server.get("/api/v1/system/info")["notes"]["count"] < notes:
        if time.monotonic() > deadline:
            raise SystemExit("the notes were not indexed")
        time.sleep(0.5)
    while server.get("/api/v1/search?q=tide")["total"] == 0:
        time.sleep(0.2)


def bench_reader(notes: int, pdfs: int, window: float) -> None:
    if not (shutil.which("pdftotext") and shutil.which("tesseract")):
        print("\n2. the reader: skipped (poppler-utils and tesseract-ocr are not installed)")
        return
    rnd = random.Random(11)
    queries = [" ".join(rnd.sample(WORDS, 2)) for _ in range(20)]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "root"
        make_root(root, notes, pdfs)
        off = Running(root, {"SERVICE_ATTACHMENT_TEXT": "off"})
        try:
            wait_indexed(off, notes)
            searches(off, queries, 2)  # warm
            ref = searches(off, queries, 10)
        finally:
            off.stop()
        on = Running(root, {"SERVICE_ATTACHMENT_TEXT": "auto"})
        try:
            wait_indexed(on, notes)
            deadline = time.monotonic() + 30
            while on.get("/api/v1/capture")["attachmentText"]["pages"] < 3:
                if time.monotonic() > deadline:
                    raise SystemExit("the reader did not start")
                time.sleep(0.2)
            during = searches(on, queries, 10)
            info = on.get("/api/v1/capture")["attachmentText"]
            cpu0, t0, pages0 = on.cpu(), time.monotonic(), info["pages"]
            time.sleep(window)
            cpu1, t1 = on.cpu(), time.monotonic()
            info = on.get("/api/v1/capture")["attachmentText"]
        finally:
            on.stop()
    share = (cpu1 - cpu0) / (t1 - t0)
    print(f"\n2. the reader: {notes} notes, {pdfs} PDFs (half of them scans, read by OCR)")
    print(f"{'':<44} {'p50 ms':>8} {'p95 ms':>8}")
    name = "search, reference: SERVICE_ATTACHMENT_TEXT=off"
    print(f"{name:<44} {pct(ref, 50):>8.2f} {pct(ref, 95):>8.2f}")
    print(f"{'search while the reader reads':<44} {pct(during, 50):>8.2f} {pct(during, 95):>8.2f}")
    ratio = pct(during, 50) / pct(ref, 50)
    print(f"ratio (p50): {ratio:.2f}; goal <= 1.2: {'met' if ratio <= 1.2 else 'MISSED'}")
    print(
        f"server and its tools over {t1 - t0:.0f} s of reading: {share * 100:.1f}% of one core "
        f"({info['pages'] - pages0} pages read); goal <= 50%: {'met' if share <= 0.5 else 'MISSED'}"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--pdfs", type=int, default=200)
    ap.add_argument("--notes", type=int, default=2000)
    ap.add_argument("--window", type=float, default=60.0)
    ap.add_argument("--only", choices=("clip", "reader"), default=None)
    args = ap.parse_args()
    print_header()
    if args.only != "reader":
        bench_clip(args.runs)
    if args.only != "clip":
        bench_reader(args.notes, args.pdfs, args.window)


if __name__ == "__main__":
    main()
