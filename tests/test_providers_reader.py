"""The attachment reader: text inside PDFs and images, searched with the notes that link
them (src/notesvc/providers/reader.py). The judges are Debian's poppler-utils and
tesseract-ocr on a PDF and an image made here; without them these tests skip."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import struct
import subprocess
import time
import zlib
from pathlib import Path

import pytest

from conftest import (
    API,
    Server,
    att_url,
    data,
    put_note,
    search,
    upload,
    wait_for,
    with_key,
)

POPPLER = bool(shutil.which("pdftotext") and shutil.which("pdftoppm") and shutil.which("pdfinfo"))
TESSERACT = bool(shutil.which("tesseract"))
needs_poppler = pytest.mark.skipif(not POPPLER, reason="poppler-utils is not installed")
needs_tesseract = pytest.mark.skipif(not TESSERACT, reason="tesseract-ocr is not installed")
needs_both = pytest.mark.skipif(
    not (POPPLER and TESSERACT), reason="poppler-utils and tesseract-ocr are not installed"
)


# -- files made here: PDFs written by hand, images drawn by pdftoppm --------------------------


def _pdf(objects: list) -> bytes:
    """Return a PDF of the given object bodies (1-based numbers), with its xref."""
    out = bytearray(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n")
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


def text_pdf(pages: list) -> bytes:
    """Return a PDF with a text layer: each page's lines in 28 pt Helvetica."""
    n = len(pages)
    kids = " ".join(f"{3 + 2 * i} 0 R" for i in range(n))
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        f"<< /Type /Pages /Kids [{kids}] /Count {n} >>".encode(),
    ]
    font = 3 + 2 * n
    for i, text in enumerate(pages):
        lines = "".join(
            f"BT /F1 28 Tf 60 {720 - 40 * j} Td ({line}) Tj ET\n"
            for j, line in enumerate(text.split("\n"))
        ).encode()
        objects.append(
            f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents {4 + 2 * i} 0 R "
            f"/Resources << /Font << /F1 {font} 0 R >> >> >>".encode()
        )
        objects.append(f"<< /Length {len(lines)} >>\nstream\n".encode() + lines + b"endstream")
    objects.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
    return _pdf(objects)


def encrypted_pdf() -> bytes:
    """Return a PDF locked with a user password (its keys random: no password opens it)."""
    raw = _pdf(
        [
            b"<< /Type /Catalog /Pages 2 0 R >>",
            b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R >>",
            b"<< /Length 3 >>\nstream\nabc\nendstream",
            b"<< /Filter /Standard /V 1 /R 2 /O <"
            + b"1f" * 32
            + b"> /U <"
            + b"2e" * 32
            + b"> /P -4 >>",
        ]
    )
    ids = b"<" + b"3d" * 16 + b">"
    return raw.replace(
        b"/Root 1 0 R >>", b"/Root 1 0 R /Encrypt 5 0 R /ID [" + ids + b" " + ids + b"] >>"
    )


def bomb_pdf(megabytes: int = 400) -> bytes:
    """Return a PDF of under 1 MB whose one page's drawing inflates to `megabytes` MB: one
    block deflated once and repeated (each block stands alone after a full flush)."""
    block = b"0 0 m " * (1 << 18)
    deflate = zlib.compressobj(9)
    first = deflate.compress(block) + deflate.flush(zlib.Z_FULL_FLUSH)
    again = deflate.compress(block) + deflate.flush(zlib.Z_FULL_FLUSH)
    count = megabytes * (1 << 20) // len(block)
    adler = 1
    for _ in range(count):
        adler = zlib.adler32(block, adler)
    stream = first + again * (count - 1) + deflate.flush()[:-4] + adler.to_bytes(4, "big")
    return _pdf(
        [
            b"<< /Type /Catalog /Pages 2 0 R >>",
            b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R >>",
            f"<< /Length {len(stream)} /Filter /FlateDecode >>\nstream\n".encode()
            + stream
            + b"\nendstream",
        ]
    )


def rendered(pdf: bytes, tmp: Path, page: int = 1, fmt: str = "png") -> bytes:
    """Return a page of a PDF drawn by pdftoppm (150 dpi, grey): a picture of its text."""
    src = tmp / "src.pdf"
    src.write_bytes(pdf)
    flag = "-png" if fmt == "png" else "-gray"
    argv = ["pdftoppm", "-f", str(page), "-l", str(page), "-r", "150", flag, str(src)]
    subprocess.run([*argv, str(tmp / "out")], check=True, timeout=60)
    made = sorted(tmp.glob("out*"))
    raw = made[0].read_bytes()
    for f in made:
        f.unlink()
    return raw


def scanned_pdf(pgms: list) -> bytes:
    """Return an image-only PDF (a scan): each page a grey picture, no text layer."""
    n = len(pgms)
    kids = " ".join(f"{3 + 3 * i} 0 R" for i in range(n))
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        f"<< /Type /Pages /Kids [{kids}] /Count {n} >>".encode(),
    ]
    for i, pgm in enumerate(pgms):
        magic, dims, _maxval, pixels = pgm.split(b"\n", 3)
        assert magic == b"P5"
        w, h = map(int, dims.split())
        packed = zlib.compress(pixels[: w * h])
        draw = f"q {w * 72 // 150} 0 0 {h * 72 // 150} 0 0 cm /Im0 Do Q".encode()
        box = f"[0 0 {w * 72 // 150} {h * 72 // 150}]"
        resources = f"<< /XObject << /Im0 {5 + 3 * i} 0 R >> >>"
        page = f"<< /Type /Page /Parent 2 0 R /MediaBox {box} /Contents {4 + 3 * i} 0 R "
        objects.append(f"{page}/Resources {resources} >>".encode())
        objects.append(f"<< /Length {len(draw)} >>\nstream\n".encode() + draw + b"\nendstream")
        objects.append(
            f"<< /Type /XObject /Subtype /Image /Width {w} /Height {h} /ColorSpace /DeviceGray "
            f"/BitsPerComponent 8 /Filter /FlateDecode /Length {len(packed)} >>\nstream\n".encode()
            + packed
            + b"\nendstream"
        )
    return _pdf(objects)


def png_header(width: int, height: int) -> bytes:
    """Return a PNG that says it is width x height (its pixels never decoded here)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body).to_bytes(4, "big")
        return len(body).to_bytes(4, "big") + kind + body + crc

    head = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", head) + chunk(b"IDAT", zlib.compress(b"\0" * 64))


def reader_info(client) -> dict:
    return data(client.get(f"{API}/capture"))["attachmentText"]


def settled(client, files: int) -> dict:
    """Wait until the reader knows `files` files and has none waiting."""
    found = {}

    def done() -> bool:
        found.update(reader_info(client))
        return found["files"] >= files and not found["waiting"]

    wait_for(done, timeout=120)
    return found


def put_file(client, path: str, raw: bytes) -> None:
    upload(client, path, raw)


# -- the pieces ------------------------------------------------------------------------------


class TestSniff:
    @pytest.mark.parametrize(
        ("head", "kind"),
        [
            (b"%PDF-1.7\n", "pdf"),
            (b"\x89PNG\r\n\x1a\n\0\0", "png"),
            (b"\xff\xd8\xff\xe0", "jpeg"),
            (b"GIF89a", "gif"),
            (b"II*\x00", "tiff"),
            (b"RIFF\0\0\0\0WEBPVP8 ", "webp"),
            (b"PK\x03\x04", None),
            (b"<svg>", None),
            (b"", None),
        ],
    )
    def test_a_file_is_what_its_first_bytes_say(self, head, kind):
        import notesvc

        assert notesvc.sniff(head) == kind

    def test_an_images_size_is_read_from_its_header(self, tmp_path):
        import io

        import notesvc

        assert notesvc.image_size(io.BytesIO(png_header(30_000, 30_000)), "png") == (
            30_000,
            30_000,
        )
        gif = b"GIF89a" + struct.pack("<HH", 640, 480) + b"\0" * 20
        assert notesvc.image_size(io.BytesIO(gif), "gif") == (640, 480)
        jpeg = b"\xff\xd8\xff\xe0\x00\x04ab\xff\xc0\x00\x11\x08" + struct.pack(">HH", 300, 200)
        assert notesvc.image_size(io.BytesIO(jpeg + b"\0" * 20), "jpeg") == (200, 300)

    @pytest.mark.slow
    def test_a_tool_runs_without_a_shell_and_is_stopped_at_its_limit(self, tmp_path):
        import notesvc

        odd = tmp_path / "a; touch pwned $(id) `x`.txt"
        odd.write_text("fine")
        assert notesvc.run_tool(["cat", str(odd)], 10) == "fine"
        assert not list(tmp_path.glob("pwned*"))
        started = time.monotonic()
        with pytest.raises(notesvc.ToolFailed, match="ran over 1 s"):
            notesvc.run_tool(["sleep", "30"], 1)
        assert time.monotonic() - started < 10

    def test_a_tools_children_run_at_nice_19_with_one_thread_and_1_gib(self):
        import notesvc

        said = notesvc.run_tool(
            ["sh", "-c", "cut -d' ' -f19 /proc/self/stat; echo $OMP_THREAD_LIMIT; ulimit -v"], 10
        )
        nice, threads, memory = said.split()
        assert (int(nice), threads, int(memory)) == (19, "1", 1 << 20)


# -- the reader in a running app --------------------------------------------------------------


@needs_poppler
class TestPdfText:
    def test_a_pdfs_text_is_searched_with_the_note_that_links_it(self, make_app, tmp_path):
        client = with_key(make_app())
        put_file(
            client,
            "attachments/docs/report.pdf",
            text_pdf(
                ["Quarterly figures of the port authority", "zebra crossings near the harbour"]
            ),
        )
        put_note(
            client,
            "notes/work/meeting.md",
            "# Meeting\n\nSee [the report](../../attachments/docs/report.pdf).\n",
        )
        settled(client, 1)
        found = search(client, "harbour")
        assert [r["path"] for r in found["results"]] == ["notes/work/meeting.md"]
        assert found["results"][0]["snippet"].startswith("report.pdf, p. 2: ")
        assert "harbour" in found["results"][0]["snippet"]
        assert search(client, "harbour", folder="notes/other")["total"] == 0
        info = reader_info(client)
        assert (info["enabled"], info["read"], info["pages"]) == (True, 1, 2)

    def test_a_note_found_by_its_own_words_and_a_files_keeps_its_snippet(self, make_app):
        client = with_key(make_app())
        put_file(client, "attachments/a.pdf", text_pdf(["walrus facts and other walrus matters"]))
        put_note(client, "notes/w.md", "# Walrus\n\nA walrus note. ![[a.pdf]]\n")
        settled(client, 1)
        found = search(client, "walrus")
        assert found["total"] == 1
        assert not found["results"][0]["snippet"].startswith("a.pdf")

    def test_a_file_no_note_links_finds_nothing(self, make_app):
        client = with_key(make_app())
        put_file(
            client,
            "attachments/lonely.pdf",
            text_pdf(["quokka sightings on the island of Rottnest"]),
        )
        settled(client, 1)
        assert search(client, "quokka")["total"] == 0

    def test_text_is_kept_by_content_hash_and_a_copy_is_not_read_again(self, make_app, root):
        client = with_key(make_app())
        raw = text_pdf(["narwhal tusks grow in a left-handed helix"])
        put_file(client, "attachments/one.pdf", raw)
        settled(client, 1)
        put_file(client, "attachments/two.pdf", raw)
        put_note(client, "notes/n.md", "[x](../attachments/two.pdf)")
        settled(client, 2)
        assert reader_info(client)["pages"] == 1  # the second copy was not read again
        assert len(list((root / ".notesvc" / "filetext").glob("*.jsonl"))) == 1
        assert search(client, "narwhal")["total"] == 1

    @pytest.mark.parametrize(
        ("name", "raw", "said"),
        [
            ("fake.pdf", b"MZ\x90\x00 an executable named .pdf", "not a PDF by its bytes"),
            ("broken.pdf", b"%PDF-1.4\n1 0 obj << /Type /Catalog", "could not be read"),
            ("empty.pdf", b"%PDF-1.4\n%%EOF\n", "could not be read"),
        ],
    )
    def test_a_file_that_is_not_what_it_says_is_skipped_and_said(self, make_app, name, raw, said):
        client = with_key(make_app())
        put_file(client, f"attachments/{name}", raw)
        info = settled(client, 1)
        assert info["skipped"] + info["failed"] == 1
        assert any(said in line for line in info["said"])

    @pytest.mark.slow
    def test_a_pdf_of_5000_pages_is_read_up_to_its_limit(self, make_app, monkeypatch):
        import notesvc

        monkeypatch.setattr(notesvc.FileTextReader, "MAX_PAGES", 5)  # (200: a long wait)
        client = with_key(make_app())
        put_file(
            client,
            "attachments/long.pdf",
            text_pdf([f"page {i} of the long report about the tides" for i in range(1, 5001)]),
        )
        put_note(client, "notes/n.md", "[long](../attachments/long.pdf)")
        info = settled(client, 1)
        assert info["pages"] == 5
        assert any("the first 5 of 5000 pages" in line for line in info["said"])
        assert search(client, '"page 5 of"')["total"] == 1
        assert search(client, '"page 6 of"')["total"] == 0

    def test_an_encrypted_pdf_is_said_not_read(self, make_app):
        client = with_key(make_app())
        put_file(client, "attachments/locked.pdf", encrypted_pdf())
        info = settled(client, 1)
        assert info["failed"] == 1
        said = "locked.pdf could not be read: it is encrypted and needs a password"
        assert said in info["said"]

    @pytest.mark.slow
    def test_a_pdf_bomb_is_stopped_at_its_limit_and_the_next_file_is_read(
        self, make_app, monkeypatch
    ):
        import notesvc

        monkeypatch.setattr(notesvc.FileTextReader, "PAGE_SECONDS", 3)
        client = with_key(make_app())
        bomb = bomb_pdf()
        assert len(bomb) < 1_000_000
        put_file(client, "attachments/bomb.pdf", bomb)
        put_file(client, "attachments/after.pdf", text_pdf(["pelicans nest on the breakwater"]))
        put_note(client, "notes/n.md", "[a](../attachments/after.pdf) [b](../attachments/bomb.pdf)")
        info = settled(client, 2)
        assert info["failed"] == 1
        assert any(
            line.startswith("bomb.pdf could not be read: pdftotext ran over")
            for line in info["said"]
        ), info["said"]
        assert search(client, "pelicans")["total"] == 1

    def test_file_names_with_shell_characters_are_only_names(self, make_app, root):
        client = with_key(make_app())
        name = "attachments/x; touch PWNED $(touch PWNED2) `touch PWNED3` &.pdf"
        put_file(client, name, text_pdf(["marmot burrows in the alpine meadows"]))
        put_note(client, "notes/m.md", "![[x; touch PWNED $(touch PWNED2) `touch PWNED3` &.pdf]]")
        settled(client, 1)
        assert search(client, "marmot")["total"] == 1
        assert not [p for p in Path.cwd().glob("PWNED*")] + list(root.rglob("PWNED*"))

    @pytest.mark.parametrize("swap", ["symlink", "renamed over"])
    def test_a_file_swapped_between_scan_and_read_never_has_the_new_bytes_read(
        self, make_app, root, tmp_path, monkeypatch, swap
    ):
        # Someone with the disk (a sync tool) puts a link to a file outside attachments/,
        # or another file, in the place of one the reader has hashed and queued: the tools
        # opened the path again and read what was there then, kept under the old hash.
        import notesvc

        outside = tmp_path / "outside.pdf"
        outside.write_bytes(text_pdf(["beluga whales sing secret songs"]))
        original = notesvc.FileTextReader._pdf_pages
        swapped = []

        def swap_first(reader, full):
            if not swapped:
                swapped.append(full)
                moved = full.with_name(".swap")
                if swap == "symlink":
                    moved.symlink_to(outside)
                else:
                    moved.write_bytes(outside.read_bytes())
                os.replace(moved, full)
            return original(reader, full)

        monkeypatch.setattr(notesvc.FileTextReader, "_pdf_pages", swap_first)
        client = with_key(make_app())
        put_note(client, "notes/n.md", "[x](../attachments/a.pdf)")
        raw = text_pdf(["walrus facts for everyone"])
        put_file(client, "attachments/a.pdf", raw)
        kept = root / ".notesvc" / "filetext" / f"{hashlib.sha256(raw).hexdigest()}.jsonl"
        wait_for(lambda: kept.exists() and '"done"' in kept.read_text(), timeout=60)
        assert "walrus" in kept.read_text()  # the file hashed is the file read
        assert "beluga" not in kept.read_text()
        if swap == "symlink":  # a link is never read at all
            settled(client, 0)
            assert search(client, "beluga")["total"] == 0
            texts = (root / ".notesvc" / "filetext").glob("*.jsonl")
            assert not [p for p in texts if "beluga" in p.read_text()]

    def test_what_the_reader_says_names_only_files_the_asker_reaches(self, make_app):
        # GET /capture (scope read) carried the path being read and what was said of each
        # file ("merger-plan.pdf could not be read") to every key: a person, a folder key.
        from test_people import device_of

        anon = make_app()
        client = with_key(anon)
        put_file(client, "attachments/board/merger-plan.pdf", b"MZ an executable, the board's")
        put_file(client, "attachments/app/fake.pdf", b"MZ not a pdf")
        said = lambda who: " ".join(reader_info(who)["said"])  # noqa: E731
        wait_for(lambda: "merger-plan.pdf" in said(client) and "fake.pdf" in said(client))
        made = data(
            client.post_json(
                f"{API}/auth/keys", {"name": "app", "scope": "read", "folder": "notes/app"}
            )
        )
        _ann, as_ann = device_of(client, anon, "Ann")
        for other in (with_key(anon, made["key"]), as_ann):
            seen = data(other.get(f"{API}/capture"))["attachmentText"]
            assert "merger-plan" not in str(seen), seen
        app_seen = data(with_key(anon, made["key"]).get(f"{API}/capture"))["attachmentText"]
        assert any("fake.pdf" in line for line in app_seen["said"])  # its own file, said

    def test_off_says_so(self, make_app):
        client = with_key(make_app(SERVICE_ATTACHMENT_TEXT="off"))
        info = reader_info(client)
        assert info["enabled"] is False
        assert "SERVICE_ATTACHMENT_TEXT" in info["reason"]
        assert data(client.get(f"{API}/system/info"))["attachmentText"]["enabled"] is False


class TestWithoutTools:
    def test_without_the_tools_it_is_off_and_names_the_packages(
        self, make_app, monkeypatch, tmp_path
    ):
        monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it
        client = with_key(make_app())
        info = reader_info(client)
        assert info["enabled"] is False
        assert "poppler-utils" in info["reason"]
        assert "tesseract-ocr" in info["reason"]


@pytest.mark.slow
@needs_both
class TestOcr:
    def test_a_photo_of_text_is_read_by_tesseract(self, make_app, tmp_path):
        client = with_key(make_app())
        picture = rendered(text_pdf(["WHITEBOARD PLAN\nship the clipper"]), tmp_path)
        put_file(client, "attachments/board.png", picture)
        put_note(client, "notes/board.md", "# Board\n\n![](../attachments/board.png)\n")
        settled(client, 1)
        found = search(client, "clipper")
        assert [r["path"] for r in found["results"]] == ["notes/board.md"]
        assert found["results"][0]["snippet"].startswith("board.png: ")

    def test_a_scanned_pdf_is_read_page_by_page(self, make_app, tmp_path):
        client = with_key(make_app())
        pages = [rendered(text_pdf([w]), tmp_path, fmt="pgm") for w in ("APPLES", "PENGUINS")]
        put_file(client, "attachments/scan.pdf", scanned_pdf(pages))
        put_note(client, "notes/s.md", "[scan](../attachments/scan.pdf)")
        settled(client, 1)
        found = search(client, "penguins")
        assert found["total"] == 1
        assert found["results"][0]["snippet"].lower().startswith("scan.pdf, p. 2: penguins")

    def test_an_image_over_40_megapixels_is_skipped_and_said(self, make_app):
        client = with_key(make_app())
        put_file(client, "attachments/huge.png", png_header(30_000, 30_000))
        info = settled(client, 1)
        assert info["skipped"] == 1
        assert any("30000 × 30000 pixels" in line for line in info["said"])

    def test_a_tool_that_hangs_is_stopped_at_its_limit(self, make_app, monkeypatch, tmp_path):
        import notesvc

        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        hang = bin_dir / "tesseract"
        hang.write_text("#!/bin/sh\nsleep 600\n")
        hang.chmod(0o755)
        monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
        monkeypatch.setattr(notesvc.FileTextReader, "PAGE_SECONDS", 2)
        client = with_key(make_app())
        put_file(client, "attachments/stuck.png", rendered(text_pdf(["x"]), tmp_path))
        info = settled(client, 1)
        assert info["failed"] == 1
        assert any("ran over 2 s and was stopped" in line for line in info["said"])


# -- the real server: picked up within 10 s, resumed after a crash -----------------------------


class Api:
    """The owner's calls to a real server (its key from state.json)."""

    def __init__(self, server: Server, root: Path):
        import json

        self.server = server
        state = json.loads((root / ".notesvc" / "state.json").read_text())
        self.headers = {"X-Service-Key": state["apiKey"]}

    def put_note(self, path: str, content: str) -> None:
        body = {"path": path, "content": content}
        status, _, _ = self.server.request("POST", f"{API}/notes", body, self.headers)
        assert status in (200, 201)

    def put_file(self, path: str, raw: bytes) -> None:
        import urllib.request

        req = urllib.request.Request(
            self.server.url + att_url(path),
            raw,
            {**self.headers, "Content-Type": "application/pdf"},
            method="PUT",
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 201

    def capture(self) -> dict:
        return self.server.request("GET", f"{API}/capture", None, self.headers)[2]["data"]

    def search(self, q: str) -> dict:
        import urllib.parse

        path = f"{API}/search?q={urllib.parse.quote(q)}"
        return self.server.request("GET", path, None, self.headers)[2]["data"]


@pytest.mark.real_server
@pytest.mark.slow
@needs_both
class TestReaderServer:
    def test_an_upload_is_read_within_10_s_and_a_crash_loses_at_most_a_page(self, tmp_path):
        root = tmp_path / "srv"
        pages = [rendered(text_pdf([f"WORD{i}"]), tmp_path, fmt="pgm") for i in range(1, 7)]
        scan = scanned_pdf(pages)
        server = Server(root)
        try:
            client = Api(server, root)
            client.put_note("notes/s.md", "[scan](../attachments/scan.pdf)")
            started = time.monotonic()
            client.put_file("attachments/scan.pdf", scan)
            reading = "attachments/scan.pdf"
            wait_for(lambda: client.capture()["attachmentText"]["reading"] == reading, timeout=30)
            assert time.monotonic() - started < 10  # picked up (its OCR may take longer)
            wait_for(lambda: client.capture()["attachmentText"]["pages"] >= 1, timeout=60)
            os.kill(server.proc.pid, signal.SIGKILL)  # mid-file: a page or more is kept
            server.proc.wait(10)
        finally:
            server.stop()
        kept = list((root / ".notesvc" / "filetext").glob("*.jsonl"))
        before = kept[0].read_text().count('"p":')
        assert 1 <= before < 6
        server = Server(root)
        try:
            client = Api(server, root)
            wait_for(lambda: client.capture()["attachmentText"]["read"] == 1, timeout=120)
            after = kept[0].read_text()
            assert after.count('"p":') == 6  # each page once: read on from where it stopped
            assert client.search("word6")["total"] == 1
            assert client.search("word1")["total"] == 1
        finally:
            server.stop()
