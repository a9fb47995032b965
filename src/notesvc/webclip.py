"""Clips: a web page as a Markdown note (the standard library's parser), images attached.

The clipper (`clipper/`, a browser extension) and the `/clip` page (the bookmarklet's) send
the page as the browser rendered it; the server never fetches its URL. html_to_markdown()
keeps what reads (headings, paragraphs, lists, tables, code, quotes, emphasis, links made
absolute, images) and drops what runs or distracts (scripts, styles, frames, forms, event
handlers, `javascript:` and `data:` links, SVG, navigation). save_clip() writes the note
(front matter `source:` and `clipped:`), its images as attachments beside it, and finds the
note of the same URL again among those the clipping principal may write.
"""

from __future__ import annotations

import base64
import binascii
import functools
import html
import json
import posixpath
import re
import time
import unicodedata
import urllib.parse
from typing import Any

from notesvc.errors import ApiError, bad_request
from notesvc.grants import (
    Principal,
    attachments_twin,
    inside,
    person_reach,
    visible_attachment,
    writable_folder,
)
from notesvc.helpers import field, iso, local_time, time_zone
from notesvc.notes.merge import title_filename
from notesvc.notes.paths import NOTES, attachment_path
from notesvc.plugins import derived_per_note
from notesvc.service import Service

# -- HTML to Markdown ------------------------------------------------------------------------

MAX_CLIP_HTML_BYTES = 5 << 20  # the page's HTML (the contract's "Capture limits")
MAX_CLIP_MARKDOWN_BYTES = 2 * MAX_CLIP_HTML_BYTES  # what a page may become (deep quotes)
MAX_CLIP_IMAGE_BYTES = 10_000_000  # each image (and at most SERVICE_MAX_ATTACHMENT_BYTES)
MAX_CLIP_IMAGES = 200
MAX_NESTING = 16  # deeper lists and quotes are drawn at this depth (10,000 nested elements)
# Elements opened deeper than this are read as their text alone (a block there ends the
# paragraph): each open element costs its close a copy of what it holds, so 700,000 nested
# <div>s or <b>s in a 5 MB page would be quadratic.
MAX_DEPTH = 100

# Elements whose whole content goes: what runs, what styles, what asks for input, what
# draws (an SVG can hold scripts), what another document fills.
DROPPED = frozenset(
    {
        "script",
        "style",
        "noscript",
        "template",
        "iframe",
        "frame",
        "frameset",
        "object",
        "embed",
        "applet",
        "form",
        "button",
        "select",
        "textarea",
        "input",
        "svg",
        "math",
        "canvas",
        "audio",
        "video",
        "map",
        "dialog",
        "head",
        "title",
        "nav",
        "aside",
    }
)
# Dropped outside the article (a site's banner and footer), kept inside it.
OUTSIDE_ARTICLE = frozenset({"header", "footer"})
VOID = frozenset(
    {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param"}
    | {"source", "track", "wbr"}
)
BLOCKS = frozenset(
    {"p", "div", "section", "article", "main", "header", "footer", "figure", "figcaption"}
    | {"address", "details", "summary", "center", "dl", "dt", "dd", "body", "html"}
    | {"h1", "h2", "h3", "h4", "h5", "h6", "ul", "ol", "li", "blockquote", "pre", "table"}
    | {"thead", "tbody", "tfoot", "tr", "caption", "hr"}
)
INLINE_MARKS = {"strong": "**", "b": "**", "em": "_", "i": "_", "del": "~~", "s": "~~"}
LINK_SCHEMES = ("http", "https", "mailto")
_ESCAPE_RE = re.compile(r"([\\`*_\[\]<>|])")
BREAK = "\x00"  # a <br> in a paragraph's text until it is written (NULs are read out first)
_LEAD_RE = re.compile(r"^(?:([#>+=-])|(\d+)([.)])(?=\s))", re.MULTILINE)


# Written as %XX in a kept URL: what Markdown reads as its end, and what str.splitlines()
# (the front matter's readers) takes for a line break.
_URL_ESCAPES = tuple(
    (ch, "%" + "%".join(f"{b:02X}" for b in ch.encode()))
    for ch in (" ", "(", ")", "\x85", "\u2028", "\u2029")
)


@functools.lru_cache(maxsize=4096)
def safe_url(raw: str, base: str, schemes: tuple = LINK_SCHEMES) -> str:
    """Return raw made absolute against base, or "" when it is not one of `schemes`
    (javascript:, data:, vbscript:, file:... never survive, however they are written)."""
    raw = "".join(ch for ch in (raw or "") if ch >= " " and ch != "\x7f").strip()
    if not raw or len(raw) > 4096:
        return ""
    try:
        url = urllib.parse.urljoin(base, raw) if base else raw
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return ""
    if parts.scheme.lower() not in schemes:
        return ""
    if parts.scheme.lower() != "mailto" and not parts.netloc:
        return ""
    for ch, code in _URL_ESCAPES:
        if ch in url:
            url = url.replace(ch, code)
    return url


def escape_text(text: str) -> str:
    """Return text with Markdown's own characters escaped (it reads as the page did)."""
    return _ESCAPE_RE.sub(r"\\\1", text) if _ESCAPE_RE.search(text) else text


class _Frame:
    """One open block the Markdown depends on: its finished child blocks and the inline
    text it is gathering."""

    __slots__ = ("blocks", "data", "inline", "tag")

    def __init__(self, tag: str, data: Any = None):
        self.tag = tag
        self.blocks: list = []  # finished Markdown blocks inside it ("li" items as tuples)
        self.inline: list = []  # text (and open inline marks) of the paragraph being read
        self.data = data  # an <ol>'s next number, a table's or a row's cells, a link's href


# The page read as tags and text by regular expressions (C loops): html.parser's own
# tokenizer took 180 ms for 1 MB of dense markup before any Markdown was written. The
# content of a raw-text element (a script, a style) is skipped to its end tag, as browsers do.
# A tag left open runs to the end of the page (as a browser's tokenizer drops it): a match
# that could fail would be tried again from every later "<", quadratic on "<a<a<a...".
_HTML_TAG_RE = re.compile(
    r"<(/?)([A-Za-z][A-Za-z0-9:-]*)((?:[^>\"']|\"[^\"]*(?:\"|\Z)|'[^']*(?:'|\Z))*)(?:>|\Z)"
    r"|<!--.*?(?:-->|\Z)|<!\[CDATA\[.*?(?:\]\]>|\Z)|<![^>]*(?:>|\Z)|<\?[^>]*(?:>|\Z)",
    re.DOTALL,
)
RAW_TEXT = frozenset(
    {"script", "style", "textarea", "title", "xmp", "noscript", "template", "iframe"}
    | {"noembed", "noframes", "plaintext"}
)
_HTML_ATTR_RE = re.compile(r"""([^\s=/>"']+)(?:\s*=\s*("[^"]*"|'[^']*'|[^\s>]+))?""")
_WANTED_ATTRS = frozenset({"a", "img", "ol"})


def _html_attrs(raw: str) -> list:
    """Return [(name, value)] of a tag's attributes, names lowercased, values unescaped."""
    out = []
    for m in _HTML_ATTR_RE.finditer(raw):
        value = m.group(2)
        if value is not None:
            if value[:1] in "\"'":
                value = value[1:-1]
            value = html.unescape(value)
        out.append((m.group(1).lower(), value))
    return out


class _Converter:
    """HTML events to Markdown blocks on an explicit stack: no recursion, and no walk of
    the stack per event, so 10,000 nested elements cost what 10,000 siblings do."""

    def __init__(self, base: str, images: dict):
        self.base = base
        self.images = images  # an image's src as the page had it -> its local link
        self.stack: list = [_Frame("#root")]
        self.open_tags: list = []  # every open element's tag, for end tags out of order
        self.open_count: dict = {}  # tag -> how many are open
        self.dropping = 0  # > 0: inside a dropped element (its depth in open_tags)
        self.nesting = 0  # open lists and quotes (their Markdown prefixes)
        self.pre = 0  # open <pre>
        self.code = 0  # open inline <code>
        self.rows: list = []  # open <tr> frames
        self.tables: list = []  # open <table> frames
        self.articles = 0  # open <article>/<main>
        self.article_blocks: list = []  # the outermost article's blocks
        self.remote_images = 0
        self.title = ""

    # -- reading the page ----------------------------------------------------------------

    def feed(self, page: str) -> None:
        """Read a page: tags and the text between them, in order (a raw-text element's
        content skipped whole, the title kept)."""
        page = page.replace("\x00", "")
        data, starttag, endtag = self.handle_data, self.handle_starttag, self.handle_endtag
        unescape = html.unescape
        at, end = 0, len(page)
        search = _HTML_TAG_RE.search
        while at < end:
            m = search(page, at)
            if m is None:
                break
            if m.start() > at and not self.dropping:
                text = page[at : m.start()]
                data(unescape(text) if "&" in text else text)
            at = m.end()
            slash, name, raw = m.groups()
            if name is None:
                continue  # a comment, a doctype, a processing instruction
            tag = name.lower()
            if slash:
                endtag(tag)
                continue
            if tag in RAW_TEXT:
                close = re.compile(r"</" + tag + r"\s*>", re.IGNORECASE).search(page, at)
                stop = close.start() if close else end
                if tag == "title" and not self.title:
                    self.title = unescape(page[at:stop])
                at = close.end() if close else end
                continue  # dropped whole (DROPPED holds them all)
            if raw:
                wanted = tag in _WANTED_ATTRS or "hidden" in raw
                starttag(tag, _html_attrs(raw) if wanted else ())
                if raw.endswith("/") and tag not in VOID:
                    endtag(tag)
            else:
                starttag(tag, ())
        if end > at:
            text = page[at:end]
            data(unescape(text) if "&" in text else text)

    # -- the parser's events -------------------------------------------------------------

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        if tag in VOID:
            if not self.dropping:
                self._void(tag, dict(attrs))
            return
        self.open_tags.append(tag)
        self.open_count[tag] = self.open_count.get(tag, 0) + 1
        if self.dropping:
            return
        attrs_d = dict(attrs) if attrs else {}
        hidden = attrs_d and (attrs_d.get("hidden", 0) != 0 or attrs_d.get("aria-hidden") == "true")
        if tag in DROPPED or (tag in OUTSIDE_ARTICLE and not self.articles) or hidden:
            self.dropping = len(self.open_tags)
            return
        if len(self.open_tags) > MAX_DEPTH:  # read as its text alone (MAX_DEPTH)
            if tag in BLOCKS or tag in ("td", "th"):
                self.stack[-1].inline.append(BREAK)
            return
        if tag in BLOCKS or tag in ("td", "th"):
            self._open_block(tag, attrs_d)
        elif tag == "a":
            self.stack[-1].inline.append(
                _Frame("a", safe_url(attrs_d.get("href") or "", self.base))
            )
        elif tag in INLINE_MARKS:
            self.stack[-1].inline.append(_Frame(tag))
        elif tag == "code" and not self.pre:
            self.code += 1
            self.stack[-1].inline.append(_Frame("code"))

    def handle_endtag(self, tag: str) -> None:
        if tag in VOID or not self.open_count.get(tag):
            return
        while self.open_tags:  # what was left open inside it closes with it
            top = self.open_tags.pop()
            self.open_count[top] -= 1
            if self.dropping:
                if len(self.open_tags) + 1 == self.dropping:
                    self.dropping = 0
            elif len(self.open_tags) < MAX_DEPTH:  # one opened deeper was never a frame
                self._close(top)
            if top == tag:
                break

    def handle_data(self, data: str) -> None:
        if self.dropping or not data:
            return
        if self.pre or self.code:
            self.stack[-1].inline.append(data.replace("\u00a0", " "))
        else:
            self.stack[-1].inline.append(escape_text(data))

    # -- blocks --------------------------------------------------------------------------

    def _open_block(self, tag: str, attrs: dict) -> None:
        self._end_paragraph()
        frame = _Frame(tag)
        if tag == "ol":
            start = attrs.get("start") or "1"
            ok = start.isascii() and start.isdigit() and len(start) < 9  # not "²" nor "٣"
            frame.data = int(start) if ok else 1
        elif tag == "table":
            frame.data = []  # its rows
            self.tables.append(frame)
        elif tag == "tr":
            frame.data = []  # its cells
            self.rows.append(frame)
        elif tag == "pre":
            self.pre += 1
        elif tag in ("ul", "ol", "blockquote"):
            self.nesting += 1
        elif tag in ("article", "main"):
            self.articles += 1
        self.stack.append(frame)

    def _close(self, tag: str) -> None:
        if tag in INLINE_MARKS or tag in ("a", "code"):
            if tag == "code" and self.code:
                self.code -= 1
            self._close_inline(tag)
        elif (tag in BLOCKS or tag in ("td", "th")) and self.stack[-1].tag == tag:
            self._finish(self.stack.pop())

    def _end_paragraph(self) -> None:
        text = self._inline_text(self.stack[-1])
        if text:
            self.stack[-1].blocks.append(text)

    def _finish(self, frame: _Frame) -> None:
        """Turn a closed block into Markdown and hand it to the block around it."""
        tag = frame.tag
        parent = self.stack[-1]
        if tag == "pre":
            self.pre -= 1
            text = "".join(x for x in frame.inline if isinstance(x, str)).strip("\n")
            # a fence longer than any run of backticks inside: no line of the code ends it
            runs = re.findall(r"`{3,}", text)
            fence = "`" * max([3] + [len(r) + 1 for r in runs])
            if text:
                parent.blocks.append(f"{fence}\n{text}\n{fence}")
            return
        text = self._inline_text(frame)
        if text:
            frame.blocks.append(text)
        if tag in ("ul", "ol", "blockquote"):
            self.nesting -= 1
        if tag in ("td", "th"):
            cell = " ".join(" ".join(_texts(frame.blocks)).split())
            if self.rows:
                self.rows[-1].data.append(cell)
            elif cell:
                parent.inline.append(" " + cell + " ")
        elif tag == "tr":
            self.rows.pop()
            if self.tables and frame.data:
                self.tables[-1].data.append(frame.data)
        elif tag == "table":
            self.tables.pop()
            self._table(parent, frame.data, _texts(frame.blocks))
        elif tag in ("h1", "h2", "h3", "h4", "h5", "h6"):
            line = " ".join(" ".join(_texts(frame.blocks)).split())
            if line:
                parent.blocks.append("#" * int(tag[1]) + " " + line)
        elif tag == "hr":
            parent.blocks.append("---")
        elif tag == "li" and self.nesting <= MAX_NESTING and frame.blocks:
            marker = "- "
            if parent.tag == "ol" and isinstance(parent.data, int):
                marker = f"{parent.data}. "
                parent.data += 1
            first, _, rest = "\n".join(_texts(frame.blocks)).partition("\n")
            rest = _prefix_lines(rest, " " * len(marker), "")
            parent.blocks.append(("li", marker + first + ("\n" + rest if rest else "")))
        elif tag in ("ul", "ol") and self.nesting < MAX_NESTING and frame.blocks:
            parent.blocks.append("\n".join(_texts(frame.blocks)))
        elif tag == "blockquote" and self.nesting < MAX_NESTING and frame.blocks:
            inner = "\n\n".join(_texts(frame.blocks))
            parent.blocks.append(_prefix_lines(inner, "> ", ">"))
        elif tag in ("article", "main") and self.articles == 1:
            self.articles = 0
            self.article_blocks.extend(_texts(frame.blocks))
            parent.blocks.extend(frame.blocks)
            return
        elif parent.blocks:  # a block that is only its content (a <div>): handed on whole
            parent.blocks.extend(frame.blocks)
        else:
            parent.blocks = frame.blocks
        if tag in ("article", "main"):
            self.articles -= 1

    def _table(self, parent: _Frame, rows: list, other: list) -> None:
        cells = [r for r in rows if any(r)]
        if not cells:
            parent.blocks.extend(other)
            return
        width = max(len(r) for r in cells)
        lines = []
        for i, row in enumerate(cells):
            row = row + [""] * (width - len(row))
            lines.append("| " + " | ".join(c or " " for c in row) + " |")
            if i == 0:
                lines.append("|" + " --- |" * width)
        parent.blocks.append("\n".join(lines))

    # -- inline --------------------------------------------------------------------------

    def _close_inline(self, tag: str) -> None:
        inline = self.stack[-1].inline
        for i in range(len(inline) - 1, max(-1, len(inline) - 2000), -1):
            item = inline[i]
            if isinstance(item, _Frame) and item.tag == tag:
                inner = "".join(x for x in inline[i + 1 :] if isinstance(x, str))
                del inline[i:]
                inline.append(self._wrap(item, inner))
                return

    @staticmethod
    def _wrap(frame: _Frame, inner: str) -> str:
        text = inner.strip()
        if not text:
            return inner
        lead = " " if inner[:1].isspace() else ""
        trail = " " if inner[-1:].isspace() else ""
        if frame.tag == "a":
            return f"{lead}[{text}]({frame.data}){trail}" if frame.data else inner
        if frame.tag == "code":
            tick = "`" * (max([0] + [len(r) for r in re.findall(r"`+", text)]) + 1)
            pad = " " if text[:1] == "`" or text[-1:] == "`" else ""
            return f"{lead}{tick}{pad}{text}{pad}{tick}{trail}"
        mark = INLINE_MARKS[frame.tag]
        return f"{lead}{mark}{text}{mark}{trail}"

    def _void(self, tag: str, attrs: dict) -> None:
        if tag == "br":
            self.stack[-1].inline.append("\n" if self.pre else BREAK)
        elif tag == "hr":
            self._end_paragraph()
            self.stack[-1].blocks.append("---")
        elif tag == "img":
            self._image(attrs)

    def _image(self, attrs: dict) -> None:
        src = (attrs.get("src") or "").strip()
        alt = escape_text(" ".join((attrs.get("alt") or "").split()))[:200]
        local = self.images.get(src)
        if local:
            self.stack[-1].inline.append(f"![{alt}]({local})")
            return
        url = safe_url(src, self.base, ("http", "https"))
        if url:  # never fetched by the server: a link to where it is, said to be remote
            self.remote_images += 1
            self.stack[-1].inline.append(f"![{alt or 'image'} (remote)]({url})")

    @staticmethod
    def _inline_text(frame: _Frame) -> str:
        text = "".join(x for x in frame.inline if isinstance(x, str))
        frame.inline = []
        lines = (" ".join(ln.split()) for ln in text.split(BREAK))
        text = "  \n".join(ln for ln in lines if ln).strip()
        # a line of the page's text must not read as a heading, a quote or a list item
        return _LEAD_RE.sub(_lead_escaped, text) if _LEAD_RE.search(text) else text

    def markdown(self) -> str:
        """Return the Markdown of everything read: the article's own when the page had an
        <article> or <main> with some text, else the whole page's."""
        while self.open_tags:  # what was never closed
            self.handle_endtag(self.open_tags[0])
        self._end_paragraph()
        article = "\n\n".join(self.article_blocks)
        if len(article) >= 200:
            return article
        return "\n\n".join(b[1] if isinstance(b, tuple) else b for b in self.stack[0].blocks)


def _prefix_lines(text: str, prefix: str, empty: str) -> str:
    """Return text with prefix before each line, an empty line given `empty` instead (by
    str.replace: a page's million lines in one quote cost no Python loop per line)."""
    if not text:
        return text
    out = prefix + text.replace("\n", "\n" + prefix)
    blank = "\n" + prefix + "\n"
    while blank in out:
        out = out.replace(blank, "\n" + empty + "\n")
    if out.startswith(prefix + "\n"):
        out = empty + out[len(prefix) :]
    if out.endswith("\n" + prefix):
        out = out[: -len(prefix)] + empty
    return out


def _texts(blocks: list) -> list:
    """Return blocks as text (a list item's tuple as its Markdown)."""
    return [b[1] if isinstance(b, tuple) else b for b in blocks]


def _lead_escaped(m: re.Match) -> str:
    return "\\" + m.group(1) if m.group(1) else m.group(2) + "\\" + m.group(3)


def html_to_markdown(page: str, base: str = "", images: dict | None = None) -> tuple:
    """Return (Markdown, title, remote images) of an HTML page or fragment.

    base: the page's URL (links made absolute against it, never against a <base> of the
    page's own); images: {src as in the page: the local link to put instead}.
    """
    conv = _Converter(base, images or {})
    conv.feed(page)
    md = re.sub(r"\n{3,}", "\n\n", conv.markdown()).strip()
    title = " ".join(conv.title.split())
    return md, title, conv.remote_images


# -- images -------------------------------------------------------------------------------

# The first bytes of the image types a clip may carry (never SVG: it can hold scripts).
IMAGE_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "png"),
    (b"\xff\xd8\xff", "jpg"),
    (b"GIF87a", "gif"),
    (b"GIF89a", "gif"),
)


def image_extension(data: bytes) -> str | None:
    """Return the extension an image's bytes say it is (png, jpg, gif, webp, avif, bmp),
    None for anything else (an image that isn't one)."""
    for magic, ext in IMAGE_MAGIC:
        if data.startswith(magic):
            return ext
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    if data[4:8] == b"ftyp" and data[8:12] in (b"avif", b"avis"):
        return "avif"
    if data[:2] == b"BM" and len(data) > 26:
        return "bmp"
    return None


def _image_stem(src: str) -> str:
    try:
        path = urllib.parse.urlsplit(src).path
    except ValueError:  # "http://[broken/a.png": no URL, its last segment all the same
        path = src.split("?", 1)[0].split("#", 1)[0]
    name = urllib.parse.unquote(path.rsplit("/", 1)[-1])
    stem = name.rpartition(".")[0] or name
    stem = re.sub(r"[^\w-]+", "-", unicodedata.normalize("NFC", stem)).strip("-_")
    return stem[:60] or "image"


# -- saving a clip -----------------------------------------------------------------------------

CLIP_FIELDS = ("url", "title", "html", "selection", "images", "folder", "new")


def clip_sources(svc: Service) -> dict:
    """Return {note path: its `source:` URL} of the notes that are clips (front matter with
    `source:` and `clipped:`), kept until the index changes (one note read after a save)."""

    def take(text: str) -> str | None:
        if not text.startswith("---") or "\nclipped:" not in text[:4096]:
            return None
        head = text[:4096].split("\n---", 1)[0]
        m = re.search(r"^source:[ \t]*(.+?)[ \t]*$", head, re.MULTILINE)
        if not m:
            return None
        value = m.group(1)
        if value.startswith('"'):
            try:
                value = json.loads(value)
            except ValueError:
                return None
        return value if isinstance(value, str) else None

    return derived_per_note(svc, "clip sources", take, lambda _paths, taken: taken)


def readers_of(svc: Service, path: str) -> frozenset:
    """Return who besides the owner reads a note or folder at path: each person whose reach
    holds it, each folder grant over it."""
    data = svc.state.read()
    people = {
        ("person", p["id"])
        for p in data.get("people", [])
        if person_reach(data, p["id"]).sees(path)
    }
    grants = {
        ("grant", g["id"])
        for g in data.get("grants", [])
        if g.get("folder") and inside(path, g["folder"])
    }
    return frozenset(people | grants)


def clip_note_of(svc: Service, url: str, principal: Principal, folder: str) -> str | None:
    """Return the note already clipped from url that the principal may write and that no
    one reads who would not read a new clip in `folder` (a note planted with the URL in a
    shared place never receives the page), those in `folder` first, then by name; None
    when there is none."""
    found = [p for p, src in clip_sources(svc).items() if src == url]
    found.sort(key=lambda p: (not inside(p, folder), p))  # in the folder asked for first
    readers = None
    for path in found:
        if (principal.whole or principal.may_write(path)) and svc.notes.exists(path):
            if readers is None:
                readers = readers_of(svc, folder)
            if readers_of(svc, path) <= readers:
                return path
    return None


def clip_folder(svc: Service, principal: Principal, raw: Any) -> str:
    """Return the folder a new clip goes to: the one asked for (writable), else the inbox
    (a person's <home>/inbox, a folder grant's folder, the owner's notes/inbox)."""
    if raw is None:
        if principal.person and not principal.folder:
            raw = f"{principal.home}/inbox"
        else:
            raw = principal.home or f"{NOTES}/inbox"
    return writable_folder(svc, raw, principal)


def front_matter_value(text: str) -> str:
    """Return a value as YAML reads it back: plain when it is safe so, else quoted."""
    if re.fullmatch(r"[A-Za-z0-9][!-~]*", text) and ": " not in text and " #" not in text:
        return text
    return json.dumps(text, ensure_ascii=False)


def valid_unicode(name: str, text: Any) -> Any:
    """Return text when it is valid Unicode (JSON may carry a lone surrogate, "\\ud800", that
    no file name or note can hold); 400 otherwise."""
    if isinstance(text, str):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request(f"'{name}' is not valid Unicode (a lone surrogate)") from None
    return text


def decode_image(item: Any, i: int, limit: int) -> tuple:
    """Return (src, bytes, extension) of a clip's image {src, data (base64), type}; 400
    for one that isn't an image, 413 for one over the limit."""
    if not isinstance(item, dict):
        raise bad_request(f"'images[{i}]' must be an object {{src, data, type}}")
    src = valid_unicode(f"images[{i}].src", field(item, "src", max_len=8192))
    data = field(item, "data")
    if len(data) > (limit * 4) // 3 + 8:
        raise ApiError(
            413, "PAYLOAD_TOO_LARGE", f"'images[{i}]' is over {limit} bytes (each image)"
        )
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"'images[{i}].data' is not base64") from None
    if len(raw) > limit:
        raise ApiError(
            413, "PAYLOAD_TOO_LARGE", f"'images[{i}]' is over {limit} bytes (each image)"
        )
    ext = image_extension(raw)
    if ext is None:
        raise bad_request(
            f"'images[{i}]' is not an image (PNG, JPEG, GIF, WebP, AVIF or BMP by its bytes)"
        )
    return src, raw, ext


def save_clip(svc: Service, principal: Principal, body: dict) -> tuple:
    """Write a clip; return ({path, url, updated, images, remoteImages}, created)."""
    unknown = sorted(set(body) - set(CLIP_FIELDS))
    if unknown:
        raise bad_request(f"unknown field(s) {', '.join(unknown)}: send {', '.join(CLIP_FIELDS)}")
    for name in ("url", "title", "html", "selection"):
        valid_unicode(name, body.get(name))
    url = safe_url(field(body, "url", max_len=4096), "", ("http", "https"))
    if not url:
        raise bad_request("'url' must be the page's http(s) address")
    page = field(body, "html", required=False) or ""
    selection = field(body, "selection", required=False)
    if not page and not selection:
        raise bad_request("'html' (the page) or 'selection' is required")
    for name, text in (("html", page), ("selection", selection or "")):
        if len(text) > MAX_CLIP_HTML_BYTES or len(text.encode("utf-8", "surrogatepass")) > (
            MAX_CLIP_HTML_BYTES
        ):
            raise ApiError(
                413, "PAYLOAD_TOO_LARGE", f"'{name}' is over {MAX_CLIP_HTML_BYTES} bytes"
            )
    title = field(body, "title", required=False, max_len=1000)
    images = body.get("images") or []
    if not isinstance(images, list):
        raise bad_request("'images' must be an array of {src, data, type} or {src, path}")
    if len(images) > MAX_CLIP_IMAGES:
        raise bad_request(f"'images' holds more than {MAX_CLIP_IMAGES} images")
    new = bool(field(body, "new", bool, required=False))
    limit = min(MAX_CLIP_IMAGE_BYTES, svc.config.max_attachment_bytes)
    decoded, uploaded = [], {}
    for i, item in enumerate(images):
        if isinstance(item, dict) and item.get("path") is not None and "data" not in item:
            src = valid_unicode(f"images[{i}].src", field(item, "src", max_len=8192))
            path = visible_attachment(svc.attachments, field(item, "path"), principal)
            svc.attachments.get(path)  # 404 when it is not there
            uploaded[src] = path
            continue
        decoded.append(decode_image(item, i, limit))
    folder = clip_folder(svc, principal, field(body, "folder", required=False))
    existing = None if new else clip_note_of(svc, url, principal, folder)
    if existing is not None:
        folder = existing.rsplit("/", 1)[0]
    now = time.time()
    local = local_time(now, time_zone(svc.config.timezone))
    image_dir = f"{attachments_twin(folder)}/{local:%Y-%m-%d}"
    note_dir = folder
    links, stored, placed = {}, 0, []
    source = selection if selection else page
    for src, raw, ext in decoded:
        if src in links or src not in source:
            continue  # sent twice, or not in what is clipped: not kept
        path = attachment_path(f"{image_dir}/{_image_stem(src)}.{ext}")
        if not (principal.whole or principal.may_write(path)):
            raise ApiError(403, "FORBIDDEN", f"this key may not write files at {path}")

        def write(f, data=raw) -> None:
            f.write(data)

        rec, _ = svc.attachments.place(svc.attachments.spool(write), path, unique=True)
        placed.append(rec)
        links[src] = urllib.parse.quote(posixpath.relpath(rec["path"], note_dir), safe="/")
        stored += 1
    for src, path in uploaded.items():
        links[src] = urllib.parse.quote(posixpath.relpath(path, note_dir), safe="/")
    md, page_title, remote = html_to_markdown(source, url, links)
    if len(md) > MAX_CLIP_MARKDOWN_BYTES:
        for rec in placed:  # the clip is refused: its images go with it
            svc.attachments.discard_created(rec["path"], rec["etag"])
        raise ApiError(
            413,
            "PAYLOAD_TOO_LARGE",
            f"the page's Markdown is over {MAX_CLIP_MARKDOWN_BYTES} bytes (its quotes and "
            "lists nest too deep to draw)",
        )
    title = " ".join((title or page_title or url).split())[:300]
    head = (
        f"---\nsource: {front_matter_value(url)}\nclipped: {iso(now)}\n---\n\n"
        f"# {escape_text(title)}\n\n"
    )
    content = head + (md or f"[{escape_text(title)}]({url})") + "\n"
    if existing is not None:
        rec = svc.notes.update(existing, content, None)
        created = False
    else:
        rec = svc.notes.create_named(folder, title_filename(f"# {title}"), content)
        created = True
    answer = {
        "path": rec["path"],
        "url": url,
        "etag": rec["etag"],
        "updated": not created,
        "images": stored + len(uploaded),
        "remoteImages": remote,
    }
    return answer, created
