"""Path rules for notes, folders and attachments."""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import os
import re
import unicodedata
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Callable

from notesvc.errors import bad_request
from notesvc.helpers import BLANK_CLASS

NOTES = "notes"
MAX_PATH_CHARS = 512
MAX_SEGMENT_BYTES = 255
FORBIDDEN_CHARS = set('\\:*?"<>|')
# Invisible characters that make a path read as another one (docs/api.md: Notes).
BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
ZERO_WIDTH = frozenset("\u200b\u200c\u200d\u2060\ufeff")
_CONTROL_RE = re.compile("[\x00-\x1f\x7f-\x9f]")
# Scans of a note's text for links, tags and passages read at most this much of it (in
# characters), so one huge note cannot make every such scan slow; the scans are linear.
MAX_SCAN_CHARS = 256 * 1024


def check_segments(path: str, what: str, top: str = NOTES) -> list:
    """Return the segments of a relative path under `top`, or raise 400 naming the broken rule."""
    if not isinstance(path, str) or not path:
        raise bad_request(f"the {what} path is empty")
    if len(path) > MAX_PATH_CHARS:
        raise bad_request(f"the {what} path is longer than {MAX_PATH_CHARS} characters")
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(f"the {what} path is not valid Unicode") from None
    if _CONTROL_RE.search(path):
        raise bad_request(f"the {what} path holds a control character")
    if not BIDI_CONTROLS.isdisjoint(path):
        raise bad_request(
            f"the {what} path holds a bidi control character (U+202A-202E, U+2066-2069)"
        )
    if not ZERO_WIDTH.isdisjoint(path):
        raise bad_request(
            f"the {what} path holds a zero-width character (U+200B-200D, U+2060, U+FEFF)"
        )
    if "\\" in path:
        raise bad_request(f"the {what} path holds a backslash; separate folders with /")
    if path.startswith("/"):
        raise bad_request(f"the {what} path must be relative, starting with {top}/")
    segments = path.split("/")
    if segments[0] != top:
        raise bad_request(f"the {what} path must start with {top}/")
    for seg in segments[1:]:
        if not seg:
            raise bad_request(f"the {what} path has an empty segment (// or a trailing /)")
        if seg in (".", ".."):
            raise bad_request(f"the {what} path may not contain '.' or '..' segments")
        if seg.startswith("."):
            raise bad_request(f"the {what} path may not contain hidden segments (starting '.')")
        if len(seg.encode("utf-8")) > MAX_SEGMENT_BYTES:
            raise bad_request(f"a segment of the {what} path is over {MAX_SEGMENT_BYTES} bytes")
        bad = sorted(set(seg) & FORBIDDEN_CHARS)
        if bad:
            raise bad_request(f"the {what} path holds a forbidden character: {' '.join(bad)}")
    return segments


def note_path(raw: Any) -> str:
    """Return a note path checked against every rule, NFC-normalised; 400 otherwise.

    >>> note_path("notes/Ideas/cafe\u0301.md")
    'notes/Ideas/café.md'
    """
    if not isinstance(raw, str):
        raise bad_request("the note path must be a string")
    return _note_path(raw)


@functools.lru_cache(maxsize=512)  # a phone reads the same few notes again and again
def _note_path(raw: str) -> str:
    """note_path of a string: the last 512 paths that passed are kept (about 100 KB for
    paths of 60 characters), a refused one raises again each time (lru_cache keeps no
    exception)."""
    path = unicodedata.normalize("NFC", raw)
    segments = check_segments(path, "note")
    if len(segments) < 2 or not path.endswith(".md") or segments[-1] == ".md":
        raise bad_request(f"the note path must look like {NOTES}/<name>.md")
    return path


def folder_path(raw: Any) -> str:
    """Return a folder path (`notes` or `notes/...`), NFC-normalised; 400 otherwise."""
    if not isinstance(raw, str):
        raise bad_request("the folder path must be a string")
    path = unicodedata.normalize("NFC", raw).rstrip("/")
    check_segments(path, "folder")
    return path


# The path rules as JSON Schema (OpenAPI). The patterns state every character rule; the
# 255-byte segment rule, which JSON Schema cannot count, is stated safely in characters: up
# to 255 ASCII characters, or up to 63 of any kind (4 bytes at most each). Characters whose
# NFC form is longer are left out, so a path that matches is still within the limits once
# normalised. What the patterns cannot say (symbolic links, paths that differ only in
# normalisation) the server checks and the description says.
_NFC_GROWS = (  # the characters whose NFC form is longer than they are (Unicode 13-15)
    "\\u0344\\u0958-\\u095f\\u09dc\\u09dd\\u09df\\u0a33\\u0a36\\u0a59-\\u0a5b\\u0a5e\\u0b5c\\u0b5d"
    "\\u0f43\\u0f4d\\u0f52\\u0f57\\u0f5c\\u0f69\\u0f73\\u0f75\\u0f76\\u0f78\\u0f81\\u0f93\\u0f9d"
    "\\u0fa2\\u0fa7\\u0fac\\u0fb9\\u2adc\\ufa6c\\ufacf-\\ufad1\\ufad5-\\ufad7\\ufb1d\\ufb1f"
    "\\ufb2a-\\ufb36\\ufb38-\\ufb3c\\ufb3e\\ufb40\\ufb41\\ufb43\\ufb44\\ufb46-\\ufb4e"
    "\U0001d15e-\U0001d164\U0001d1bb-\U0001d1c0"
)
_SEG_NOT = (  # what no segment holds: controls, / and \ : * ? " < > |, bidi, zero-width
    '\\x00-\\x1f\\x7f-\\x9f/\\\\:*?"<>|\\u202a-\\u202e\\u2066-\\u2069\\u200b-\\u200d\\u2060\\ufeff'
    + _NFC_GROWS
)
_ASCII_CH, _ASCII_FIRST = r"[ !#-)+-.0-9;=@-\[\]-{}~]", r"[ !#-)+,\-0-9;=@-\[\]-{}~]"
_ANY_CH, _ANY_FIRST = f"[^{_SEG_NOT}]", f"[^.{_SEG_NOT}]"


def _segment(tail: int, in_url: bool = False) -> str:
    """Return the pattern of one segment that leaves `tail` of its 255 bytes to a suffix.

    `in_url`: the segment travels as a URL path parameter, where a client that does not
    escape "%" as %25 would send another path; such patterns leave "%" out.
    """
    ascii_ch, ascii_first, any_ch, any_first = _ASCII_CH, _ASCII_FIRST, _ANY_CH, _ANY_FIRST
    if in_url:
        ascii_ch, ascii_first = (c.replace("#-)", "#$&-)") for c in (ascii_ch, ascii_first))
        any_ch, any_first = (c.replace("[^", "[^%", 1) for c in (any_ch, any_first))
    return (
        f"(?:{ascii_first}{ascii_ch}{{0,{254 - tail}}}"
        f"|{any_first}{any_ch}{{0,{62 - (tail + 3) // 4}}})"
    )


# One folder name (a person's name is their home's): not blank, not hidden, at most 64
# characters and 255 UTF-8 bytes, none of what no segment holds.
FOLDER_NAME_SCHEMA = {
    "type": "string",
    "minLength": 1,
    "maxLength": 64,
    "pattern": f"^(?:{_ASCII_FIRST.replace('[ ', '[', 1)}{_ASCII_CH}{{0,63}}"
    f"|[^.{BLANK_CLASS}{_SEG_NOT}]{_ANY_CH}{{0,62}})$",
}


NOTE_PATH_SCHEMA = {
    "type": "string",
    "minLength": 9,
    "maxLength": MAX_PATH_CHARS,
    "pattern": f"^{NOTES}(?:/{_segment(0)})*/{_segment(3)}\\.md$",
    "description": f"{NOTES}/<folders>/<name>.md: segments of at most {MAX_SEGMENT_BYTES} "
    "UTF-8 bytes, not starting with '.', without control, bidi or zero-width characters "
    'and without \\ : * ? " < > |; NFC-normalised; inside the notes folder',
    "examples": ["notes/ideas/garden.md"],
}
FOLDER_PATH_SCHEMA = {
    **NOTE_PATH_SCHEMA,
    "minLength": 5,
    "pattern": f"^{NOTES}(?:/{_segment(0)})*/?$",
    "description": f"{NOTES} or {NOTES}/<folders>, segments as in note paths",
    "examples": ["notes/ideas"],
}
# As URL path parameters (percent-encoded, "/" as %2F; a "%" of the name itself as %25).
NOTE_PATH_PARAM = {
    **NOTE_PATH_SCHEMA,
    "pattern": f"^{NOTES}(?:/{_segment(0, True)})*/{_segment(3, True)}\\.md$",
}
FOLDER_PATH_PARAM = {**FOLDER_PATH_SCHEMA, "pattern": f"^{NOTES}(?:/{_segment(0, True)})*/?$"}


def missing_folders(folder: Path, top: Path) -> list:
    """Return folder and its parents below top that do not exist yet, deepest first."""
    missing = []
    while folder != top and top in folder.parents and not folder.exists():
        missing.append(folder)
        folder = folder.parent
    return missing


def remove_empty_folders(folder: Path, top: Path) -> None:
    """Remove folder and its parents while they are empty, up to (not including) top."""
    folder = Path(os.path.abspath(folder))
    while folder != top and top in folder.parents:
        try:
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent


def nfc(name: str) -> str:
    return name if name.isascii() else unicodedata.normalize("NFC", name)


def walk_entries(real: str, rel: str, keep: Callable[[str], bool]) -> Iterable:
    """Yield (path, DirEntry) of the files below the folder `real` (known as `rel`) whose
    NFC names `keep` takes; hidden entries and links are skipped, and a folder that
    vanishes or can't be read is passed over."""
    stack = [(real, rel)]
    while stack:
        real, rel = stack.pop()
        try:
            entries = list(os.scandir(real))
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue
        for e in entries:
            if e.name.startswith(".") or e.is_symlink():
                continue
            name = nfc(e.name)
            if e.is_dir():
                stack.append((e.path, f"{rel}/{name}"))
            elif keep(name):
                yield f"{rel}/{name}", e


def is_note_name(name: str) -> bool:
    return name.endswith(".md") and len(name) > 3


# -- attachments: files notes link to --------------------------------------------------

ATTACHMENTS = "attachments"
# The extensions accepted under attachments/ and the type each is served as: images,
# audio, video, PDF, text, office documents and archives (docs/api.md: Attachments).
ATTACHMENT_TYPES = {
    **dict.fromkeys(("jpg", "jpeg"), "image/jpeg"),
    "png": "image/png",
    "gif": "image/gif",
    "webp": "image/webp",
    "avif": "image/avif",
    "heic": "image/heic",
    "heif": "image/heif",
    "bmp": "image/bmp",
    **dict.fromkeys(("tif", "tiff"), "image/tiff"),
    "ico": "image/x-icon",
    "svg": "image/svg+xml",
    "mp3": "audio/mpeg",
    "m4a": "audio/mp4",
    "aac": "audio/aac",
    **dict.fromkeys(("ogg", "oga", "opus"), "audio/ogg"),
    "wav": "audio/wav",
    "flac": "audio/flac",
    "weba": "audio/webm",
    "amr": "audio/amr",
    **dict.fromkeys(("mp4", "m4v"), "video/mp4"),
    "mov": "video/quicktime",
    "webm": "video/webm",
    "mkv": "video/x-matroska",
    "3gp": "video/3gpp",
    "avi": "video/x-msvideo",
    "pdf": "application/pdf",
    "txt": "text/plain",
    "csv": "text/csv",
    "json": "application/json",
    "vcf": "text/vcard",
    "ics": "text/calendar",
    **dict.fromkeys(("html", "htm"), "text/html"),
    "rtf": "application/rtf",
    "doc": "application/msword",
    "docx": "application/vnd.openxmlformats-officedocument.wordprocessingml.document",
    "xls": "application/vnd.ms-excel",
    "xlsx": "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet",
    "ppt": "application/vnd.ms-powerpoint",
    "pptx": "application/vnd.openxmlformats-officedocument.presentationml.presentation",
    "odt": "application/vnd.oasis.opendocument.text",
    "ods": "application/vnd.oasis.opendocument.spreadsheet",
    "odp": "application/vnd.oasis.opendocument.presentation",
    "epub": "application/epub+zip",
    "zip": "application/zip",
    **dict.fromkeys(("gz", "tgz"), "application/gzip"),
    "tar": "application/x-tar",
    "bz2": "application/x-bzip2",
    "xz": "application/x-xz",
    "7z": "application/x-7z-compressed",
}
# Types a browser would run as a page (script, styles, links): never shown inline, and
# the relay passes them on only as application/octet-stream.
ACTIVE_TYPES = frozenset({"text/html", "image/svg+xml"})
# The policy of every attachment download: no script, no plugins, a unique origin.
ATTACHMENT_CSP = "default-src 'none'; sandbox"


def content_type_of(path: str) -> str:
    """Return the type an attachment is served as, from its extension."""
    return ATTACHMENT_TYPES.get(path.rsplit(".", 1)[-1].lower(), "application/octet-stream")


def shown_inline(content_type: str) -> bool:
    """Return whether a browser may show this type in place (images, audio, video, text)."""
    if content_type in ACTIVE_TYPES:
        return False
    return content_type.split("/")[0] in ("image", "audio", "video") or content_type == "text/plain"


def _file_path(raw: Any, what: str, top: str) -> tuple:
    """Return (path, extension) of a file path under top, NFC-normalised and checked by the
    path rules; 400 naming the broken rule, or a last segment that is not name.extension."""
    if not isinstance(raw, str):
        raise bad_request(f"the {what} path must be a string")
    path = unicodedata.normalize("NFC", raw)
    segments = check_segments(path, what, top)
    base, dot, ext = segments[-1].rpartition(".")
    if len(segments) < 2 or not dot or not base:
        raise bad_request(f"the {what} path must look like {top}/<name>.<extension>")
    return path, ext


def attachment_path(raw: Any) -> str:
    """Return an attachment path (attachments/<segments>.<ext>, an allowed extension),
    NFC-normalised; 400 naming the broken rule otherwise.

    >>> attachment_path("attachments/trip/IMG_0001.JPG")
    'attachments/trip/IMG_0001.JPG'
    """
    path, ext = _file_path(raw, "attachment", ATTACHMENTS)
    if ext.lower() not in ATTACHMENT_TYPES:
        raise bad_request(
            f"files ending .{ext[:16]} are not accepted as attachments; allowed: "
            + ", ".join(sorted(ATTACHMENT_TYPES))
        )
    return path


def note_file_path(raw: Any) -> str:
    """Return the path of a file kept beside the notes (`notes/<...>.<ext>` with an
    attachment's extension: the image a vault keeps next to its notes, put there over
    WebDAV), NFC-normalised; 400 otherwise.

    >>> note_file_path("notes/trip/photo.JPG")
    'notes/trip/photo.JPG'
    """
    path, ext = _file_path(raw, "file", NOTES)
    if ext.lower() not in ATTACHMENT_TYPES:
        raise bad_request(f"no file of an attachment's kind at {path[:MAX_PATH_CHARS]}")
    return path


def attachment_folder(raw: Any) -> str:
    """Return an attachment folder path (`attachments` or `attachments/...`); 400 otherwise."""
    if not isinstance(raw, str):
        raise bad_request("the folder path must be a string")
    path = unicodedata.normalize("NFC", raw).rstrip("/")
    check_segments(path, "attachment folder", ATTACHMENTS)
    return path


def _any_case(word: str) -> str:
    return "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else c for c in word)


_EXTENSIONS = "|".join(_any_case(e) for e in sorted(ATTACHMENT_TYPES, key=lambda e: (-len(e), e)))
ATTACHMENT_PATH_SCHEMA = {
    "type": "string",
    "minLength": 15,
    "maxLength": MAX_PATH_CHARS,
    "pattern": f"^{ATTACHMENTS}(?:/{_segment(0)})*/{_segment(5)}\\.(?:{_EXTENSIONS})$",
    "description": f"{ATTACHMENTS}/<folders>/<name>.<extension>: segments as in note paths; "
    "the extension one of " + ", ".join(sorted(ATTACHMENT_TYPES)) + " (any case)",
    "examples": ["attachments/trip/beach.jpg"],
}
ATTACHMENT_FOLDER_SCHEMA = {
    **FOLDER_PATH_SCHEMA,
    "minLength": len(ATTACHMENTS),
    "pattern": f"^{ATTACHMENTS}(?:/{_segment(0)})*/?$",
    "description": f"{ATTACHMENTS} or {ATTACHMENTS}/<folders>",
    "examples": ["attachments/trip"],
}
ATTACHMENT_PATH_PARAM = {
    **ATTACHMENT_PATH_SCHEMA,
    "pattern": f"^{ATTACHMENTS}(?:/{_segment(0, True)})*/{_segment(5, True)}\\.(?:{_EXTENSIONS})$",
}

# The daily note: the `daily` plugin's, and where channel captures go by default.
DAILY_FOLDER = f"{NOTES}/daily"


def day_note(day: dt.date, folder: str = DAILY_FOLDER) -> tuple:
    """Return (path, heading) of a day's note in a folder (the daily note by default).

    >>> day_note(dt.date(2026, 12, 1))
    ('notes/daily/2026-12-01.md', 'Tuesday, 01 December 2026')
    """
    return f"{folder}/{day:%Y-%m-%d}.md", f"{day:%A, %d %B %Y}"


def make_etag(data: bytes) -> str:
    return '"' + hashlib.sha256(data).hexdigest()[:32] + '"'


_HEADING_RE = re.compile(r"^#[ \t]+([^ \t\n][^\n]*)", re.M)  # linear: no nested repeats


def note_title(text: str, path: str) -> str:
    """Return the first `# ` heading of a note (closing #s dropped), else its file name
    without .md.

    >>> note_title("#  Plans for May ##", "notes/x.md"), note_title("", "notes/a/b.md")
    ('Plans for May', 'b')
    """
    m = _HEADING_RE.search(text)
    if m:
        heading = m.group(1)
        return (heading[0] + heading[1:].rstrip(" \t#")).strip()[:200]
    return path.rsplit("/", 1)[-1][:-3]


_FENCE_RE = re.compile(r"^(```|~~~)[^\n]*\n.*?^\1[^\n]*$", re.M | re.S)
_CODE_SPAN_RE = re.compile(r"`[^`\n]*`")
_TAG_RE = re.compile(r"(?<![\w#&/\[])#((?:\d*[^\W\d_])[\w/-]*)")
FRONT_MATTER_RE = re.compile(r"\A---[ \t]*\n(.*?)\n---[ \t]*(?:\n|\Z)", re.S)


def note_tags(text: str) -> set:
    """Return a note's tags: #tags outside code, and front matter `tags:`, lower-cased (in
    its first MAX_SCAN_CHARS; every pattern here runs in linear time).

    >>> sorted(note_tags("---\\ntags: [Work, home]\\n---\\n# Title #todo\\n#idea `#code` x#no #42"))
    ['home', 'idea', 'todo', 'work']
    """
    tags = set()
    text = text[:MAX_SCAN_CHARS]
    fm = FRONT_MATTER_RE.match(text)
    if fm:
        text = text[fm.end() :]
        lines = fm.group(1).splitlines()
        for i, line in enumerate(lines):
            m = re.match(r"^tags:\s*(.*)$", line)
            if not m:
                continue
            value = m.group(1).strip()
            if value:
                tags |= {t.strip(" '\"#") for t in value.strip("[]").split(",")}
            for item in lines[i + 1 :]:
                m = re.match(r"^\s*-\s*(.+)$", item)
                if not m:
                    break
                tags.add(m.group(1).strip(" '\"#"))
    body = _CODE_SPAN_RE.sub(" ", _FENCE_RE.sub(" ", text))
    tags |= {m.group(1).rstrip("/-") for m in _TAG_RE.finditer(body)}
    return {t.lower() for t in tags if t}


PREVIEW_CHARS = 160
_PREVIEW_DROP = (
    (re.compile(r"!\[[^\]\n]*\]\([^)\n]*\)"), ""),  # images
    (re.compile(r"!?\[\[([^\]|\n]*\|)?([^\]\n]*)\]\]"), r"\2"),  # [[wiki|links]], ![[embeds]]
    (re.compile(r"\[([^\]\n]*)\]\([^)\n]*\)"), r"\1"),  # [links](to)
    (re.compile(r"^\s{0,3}(?:#{1,6}\s+|>\s?|[-*+]\s+(?:\[[ xX]\]\s+)?|\d{1,9}[.)]\s+)", re.M), ""),
    (re.compile(r"^\s*(?:```|~~~).*$|^\s*\|?[-:| ]{3,}\|?\s*$", re.M), ""),  # fences, rules
    (re.compile(r"(\*\*|__|~~|==|`+|\*|_)(?=\S)(.+?)(?<=\S)\1"), r"\2"),  # emphasis, code
    (re.compile(r"\|"), " "),  # table cells
)


def note_preview(text: str) -> str:
    """Return a note's first PREVIEW_CHARS characters after its title, as plain text.

    >>> note_preview("---\\ntags: [a]\\n---\\n# Pie\\n\\n- [ ] **2** eggs, see [the shop](s.md)")
    '2 eggs, see the shop'
    """
    text = text[: PREVIEW_CHARS * 8]
    fm = FRONT_MATTER_RE.match(text)
    if fm:
        text = text[fm.end() :]
    lines = text.split("\n")
    first = next((i for i, line in enumerate(lines) if line.strip()), len(lines))
    body = "\n".join(lines[first + 1 :])  # the title: a heading, else the first line
    for pattern, replacement in _PREVIEW_DROP:
        body = pattern.sub(replacement, body)
    return " ".join(body.split())[:PREVIEW_CHARS]
