"""Export: a zip of everything a key sees."""

from __future__ import annotations

import io
import json
import os
import stat
import time
import unicodedata
from collections.abc import Iterable
from pathlib import Path
from typing import Callable

from notesvc.boot import __version__
from notesvc.grants import NOWHERE, OWNER, Principal, attachments_twin
from notesvc.helpers import BODY_CHUNK, iso, utcnow
from notesvc.notes.paths import ATTACHMENTS, NOTES
from notesvc.transfer.plan import EXPORT_MANIFEST

# -- export: a zip of everything a key sees -----------------------------------------------------

STORED_TYPES = frozenset(  # already compressed: stored as they are
    [
        *("jpg", "jpeg", "png", "gif", "webp", "avif", "heic", "heif", "mp3", "m4a", "aac"),
        *("ogg", "oga", "opus", "mp4", "m4v", "mov", "webm", "zip", "gz", "pdf", "docx", "xlsx"),
    ]
)


def export_files(root: Path, principal: Principal = OWNER) -> Iterable:
    """Yield (name in the zip, file, stat) of every note, attachment and other file the
    grant sees (hidden files, temp files and symbolic links left out), in path order."""
    folders = principal.folders  # a grant's reach, in path order: notes, then attachments
    tops = [*folders, *(attachments_twin(f) for f in folders)] if folders else [NOTES, ATTACHMENTS]
    for top in tops:
        base = root / top
        for folder, dirs, files in os.walk(base):
            dirs[:] = sorted(
                d
                for d in dirs
                if not d.startswith(".") and not os.path.islink(os.path.join(folder, d))
            )
            rel = os.path.relpath(folder, root).replace(os.sep, "/")
            for name in sorted(files):
                if name.startswith("."):
                    continue
                full = os.path.join(folder, name)
                try:
                    st = os.lstat(full)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    yield unicodedata.normalize("NFC", f"{rel}/{name}"), full, st


class _ZipOut(io.RawIOBase):
    """Where a streamed zip is written: taken away in chunks (not seekable, so zipfile
    writes data descriptors and never goes back)."""

    def __init__(self):
        self.parts: list = []
        self.pos = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.parts.append(bytes(b))
        self.pos += len(b)
        return len(b)

    def tell(self) -> int:
        return self.pos

    def seek(self, *args) -> int:
        raise OSError("not seekable")

    def take(self) -> bytes:
        data, self.parts = b"".join(self.parts), []
        return data


class ExportCut(Exception):
    """The key an export streams for was revoked (or its person removed) meanwhile."""


def export_zip(
    root: Path,
    principal: Principal = OWNER,
    progress: Callable | None = None,
    still: Callable | None = None,
):
    """Yield a zip of what export_files() lists, with each file's modification time and a
    notesvc-export.json manifest, in chunks (nothing is held whole).

    `still(name)`, asked before each file: whether the principal still sees it (a share
    removed meanwhile: the file is left out); ExportCut from it (the key revoked) ends the
    stream where it is, without the zip's directory, so the client holds no zip at all."""
    import zipfile

    out = _ZipOut()
    try:
        yield from _zip_chunks(zipfile, out, root, principal, progress, still)
    except ExportCut:
        return


def _zip_chunks(zipfile, out, root, principal, progress, still):
    counts = {"notes": 0, "files": 0, "bytes": 0}
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as zf:
        for name, full, st in export_files(root, principal):
            if still is not None and not still(name):
                continue
            when = time.localtime(max(st.st_mtime, 315532800.0))[:6]  # zip's dates start 1980
            info = zipfile.ZipInfo(name, date_time=when)
            ext = name.rpartition(".")[2].lower()
            info.compress_type = zipfile.ZIP_STORED if ext in STORED_TYPES else zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            info.file_size = st.st_size
            try:
                src = open(full, "rb")  # noqa: SIM115 (closed below)
            except OSError:  # gone since it was listed
                continue
            with src, zf.open(info, "w", force_zip64=st.st_size >= 1 << 31) as dst:
                while chunk := src.read(BODY_CHUNK * 4):
                    dst.write(chunk)
                    if out.pos >= BODY_CHUNK * 4:
                        yield out.take()
            counts["notes" if name.endswith(".md") and name.startswith(NOTES) else "files"] += 1
            counts["bytes"] += st.st_size
            if progress:
                progress(counts)
            if out.pos >= BODY_CHUNK:
                yield out.take()
        manifest = {
            "format": "notesvc-export",
            "version": 1,
            "notesvc": __version__,
            "exportedAt": iso(utcnow()),
            "folder": principal.folder or None,
            "folders": None  # (everything)
            if principal.whole
            else [f for f in principal.folders if f != NOWHERE],
            **counts,
        }
        zf.writestr(EXPORT_MANIFEST, json.dumps(manifest, indent=2) + "\n")
    yield out.take()
