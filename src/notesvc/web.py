"""The web client: one self-contained page, served by servers and relays alike."""

from __future__ import annotations

import base64
import functools
import gzip
import hashlib
import re
import zlib
from collections.abc import Iterable
from pathlib import Path

from notesvc.errors import to_json

# -- Web client ----------------------------------------------------------------------------
#
# One self-contained page: inline CSS and JS (allowed by their hashes in the CSP), no
# CDN, no build step. It uses only the public API. Data goes in as text nodes only.


def web_source(name: str) -> str:
    """Return the text of web/<name>. Only the package calls this: in notesvc.py the build
    has put each file's text in place of its call. Installed, the files are the package's
    assets (notesvc/assets/); in a checkout, web/ beside src/."""
    here = Path(__file__).resolve()
    for folder in (here.parent / "assets", here.parents[2] / "web"):
        if (folder / name).is_file():
            return (folder / name).read_text(encoding="utf-8")
    raise FileNotFoundError(f"web/{name} is not installed beside {here.parent}")


WEB_CSS = web_source("app.css")

WEB_JS_START = web_source("core.js")

PATHS_JS = web_source("paths.js")
KEYS_JS = web_source("keys.js")
MERGE_JS = web_source("merge.js")
OUTBOX_JS = web_source("outbox.js")
MARKDOWN_JS = web_source("markdown.js")
ORDER_JS = web_source("order.js")
AUTOSAVE_JS = web_source("autosave.js")
DRAFTS_JS = web_source("drafts.js")
LISTS_JS = web_source("lists.js")

WEB_JS_REST = web_source("app.js")

WEB_GRANTS_JS = web_source("grants.js")
WEB_OFFLINE_JS = web_source("offline.js")
SW_JS = web_source("sw.js")
WEB_DEVICES_JS = web_source("devices.js")
WEB_PEOPLE_JS = web_source("people.js")
WEB_TRANSFER_JS = web_source("transfer.js")
WEB_CAPTURE_JS = web_source("capture.js")
WEB_SUGGESTIONS_JS = web_source("suggestions.js")
WEB_MAIN_JS = web_source("main.js")
# Record's code: its own script, fetched when Record is first pressed (the page's budget)
RECORD_JS = web_source("record.js")


# a / after one of these (or a line's start) opens a regular expression, else it divides
_REGEX_AFTER = set("(,=:[!&|?{};+-*%<>~^")
_REGEX_WORD = re.compile(r"\b(return|typeof|case|of|in|do|else|void|yield|await)\s*\Z")


def scan_script(js: str) -> tuple:
    """Return (the numbers, from 0, of the lines of a script that begin inside a string or
    a template literal: text, kept as it is; the (start, end) of each comment). A small
    scanner of the script's strings, comments, templates (with `${}` inside) and regular
    expressions; prettier's layout keeps the regex-or-division guess simple. ValueError when
    it ends inside a template (it lost its place: nothing it found is used).

    >>> scan_script("a = `x\\n  y` + /`/.source; // why\\nb = '`'; /* c */")
    ({1}, [(26, 32), (42, 49)])
    """
    kept: set = set()
    comments: list = []
    stack = ["code"]  # modes: code (its `{` depth beside it in depths), tpl
    depths = [0]
    i, line, n, last = 0, 0, len(js), ""  # last: the code's last significant character
    while i < n:
        c, mode = js[i], stack[-1]
        if c == "\n":
            line += 1
            if mode == "tpl":
                kept.add(line)
        elif mode == "tpl":
            if c == "\\" and js[i + 1 : i + 2] == "\n":
                i += 1
                line += 1
                kept.add(line)
            elif c == "\\":
                i += 1
            elif c == "`":
                stack.pop()
                last = "`"
            elif js.startswith("${", i):
                stack.append("code")
                depths.append(0)
                i += 1
        elif js.startswith("//", i):
            end = js.find("\n", i)
            end = n if end < 0 else end
            comments.append((i, end))
            i = end - 1
        elif js.startswith("/*", i):
            end = js.find("*/", i + 2) + 2
            end = n if end < 2 else end
            comments.append((i, end))
            line += js.count("\n", i, end)
            i = end - 1
        elif c in "'\"":
            i += 1
            while i < n and js[i] != c:
                if js[i] == "\\":
                    i += 1
                    if js[i : i + 1] == "\n":
                        line += 1
                        kept.add(line)  # a string continued on the next line
                i += 1
            last = c
        elif c == "`":
            stack.append("tpl")
        elif c == "/" and (
            not last or last in _REGEX_AFTER or _REGEX_WORD.search(js[max(0, i - 12) : i])
        ):
            klass = False
            i += 1
            while i < n and (js[i] != "/" or klass) and js[i] != "\n":
                if js[i] == "\\":
                    i += 1
                elif js[i] in "[]":
                    klass = js[i] == "["
                i += 1
            last = "/"
        elif c == "{":
            depths[-1] += 1
            last = c
        elif c == "}" and depths[-1] == 0 and len(stack) > 1:
            stack.pop()  # the end of a ${...}: back in its template
            depths.pop()
        elif not c.isspace():
            depths[-1] -= c == "}"
            last = c
        i += 1
    if stack != ["code"]:  # the scanner lost its place: serve nothing it might have cut
        raise ValueError(f"a template literal of the script does not end (line {line + 1})")
    return kept, comments


def lean_script(js: str) -> str:
    """Return the script as the page serves it: without comments and without indentation
    (the comments are for whoever reads web/; the page is a third smaller gzipped). Lines
    stay where they were (a comment's lines are left empty), so an error's line in the page
    is a line of the sources' order; a line that begins or ends inside a string or a
    template literal keeps its spaces. node --check and the no-undef lint run on the
    result."""
    kept, comments = scan_script(js)
    parts, at = [], 0
    for start, end in comments:  # a block comment on one line becomes a space
        block = js.startswith("/*", start)
        parts += [js[at:start], "\n" * js.count("\n", start, end) or " " * block]
        at = end
    lines = "".join([*parts, js[at:]]).split("\n")
    return "\n".join(
        line if i in kept else line.lstrip() if i + 1 in kept else line.strip()
        for i, line in enumerate(lines)
    )


def lean_css(css: str) -> str:
    """Return a style sheet as the page serves it: without comments and indentation, each
    line where it was (a comment's lines are left empty)."""
    css = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group().count("\n"), css, flags=re.S)
    return "\n".join(line.strip() for line in css.split("\n"))


# One script, in this order: core.js ("use strict", the page's state, storage and API),
# the pure modules (paths.js, keys.js, merge.js, outbox.js, markdown.js, order.js,
# autosave.js, drafts.js, lists.js; node --test web/), app.js, grants.js, devices.js,
# people.js, transfer.js, offline.js, capture.js, suggestions.js, and last main.js, where
# the page starts (the files before it only define).
WEB_JS = "".join(
    (
        WEB_JS_START,
        PATHS_JS,
        KEYS_JS,
        MERGE_JS,
        OUTBOX_JS,
        MARKDOWN_JS,
        ORDER_JS,
        AUTOSAVE_JS,
        DRAFTS_JS,
        LISTS_JS,
        WEB_JS_REST,
        WEB_GRANTS_JS,
        WEB_DEVICES_JS,
        WEB_PEOPLE_JS,
        WEB_TRANSFER_JS,
        WEB_OFFLINE_JS,
        WEB_CAPTURE_JS,
        WEB_SUGGESTIONS_JS,
        WEB_MAIN_JS,
    )
)
WEB_JS = lean_script(WEB_JS)  # as served: without the comment lines and indentation
WEB_CSS = lean_css(WEB_CSS)  # as served: without comments and indentation

WEB_PAGE = web_source("app.html")


def _csp_hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


RECORD_JS = lean_script(RECORD_JS)
RECORD_SRI = "sha384-" + base64.b64encode(hashlib.sha384(RECORD_JS.encode()).digest()).decode()

# 'strict-dynamic': the page's own script (its hash) may add record.js (checked by its
# integrity); nothing in the markup runs, and no other script is named.
WEB_CSP = (
    "default-src 'none'; "
    f"script-src {_csp_hash(WEB_JS)} 'strict-dynamic'; style-src {_csp_hash(WEB_CSS)}; "
    "connect-src 'self'; img-src 'self' data: blob:; media-src blob:; manifest-src 'self'; "
    "worker-src 'self'; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'"
)

# -- the app's manifest and icons: "Add to Home Screen" gives an app with its own icon ------

WEB_ACCENT = "#0a58ca"
WEB_ICON_SVG = f"""<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 48 48">
<rect width="48" height="48" rx="11" fill="{WEB_ACCENT}"/>
<path d="M14 9h15l7 7v23H14z" fill="#fff"/><path d="M29 9v7h7" fill="#c9dcf7"/>
<path d="M18 22h14M18 28h14M18 34h9" stroke="{WEB_ACCENT}" stroke-width="3"
 stroke-linecap="round"/></svg>
"""


def _png(size: int, rows: Iterable[bytes]) -> bytes:
    """Return an RGB PNG of size x size from its rows of pixels."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data).to_bytes(4, "big")
        return len(data).to_bytes(4, "big") + kind + data + crc

    head = size.to_bytes(4, "big") * 2 + bytes([8, 2, 0, 0, 0])  # 8-bit RGB
    pixels = zlib.compress(b"".join(b"\x00" + row for row in rows), 9)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", head) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")
    )


@functools.cache
def web_icon_png(size: int) -> bytes:
    """Return the icon of WEB_ICON_SVG as a size x size PNG, full-bleed (the sheet stays in
    the middle 80%, a maskable icon's safe zone), painted in spans of colour, not pixels."""
    blue, white, fold = bytes.fromhex(WEB_ACCENT[1:]), b"\xff\xff\xff", bytes.fromhex("c9dcf7")

    def px(u: float) -> int:  # icon units (0-48) to pixels
        return max(0, min(size, round(u / 48 * size)))

    rows = []
    for y in range(size):
        v = (y + 0.5) / size * 48
        spans = []  # (from, to, colour) in icon units, later ones painted over earlier ones
        if 9 <= v < 39:
            spans.append((14, 36 if v >= 16 else 29 + (v - 9), white))
            if v < 16:
                spans.append((29, 29 + (v - 9), fold))
        for line_y, x0, x1 in ((22, 18, 32), (28, 18, 32), (34, 18, 27)):
            if abs(v - line_y) < 1.5:
                spans.append((x0 - 1.5, x1 + 1.5, blue))
        row = bytearray(blue * size)
        for u0, u1, colour in spans:
            a, b = px(u0), px(u1)
            row[a * 3 : b * 3] = colour * (b - a)
        rows.append(bytes(row))
    return _png(size, rows)


def web_manifest() -> bytes:
    """Return the web app manifest (paths relative to it, so it works under any prefix)."""
    return to_json(
        {
            "name": "notesvc",
            "short_name": "notesvc",
            "description": "Your notes, on your own server",
            "start_url": ".",
            "scope": ".",
            "display": "standalone",
            # the share sheet (an installed app, in a secure context): its service worker
            # takes the POST and keeps it for today's note (docs/api.md: phone)
            "share_target": {
                "action": "share-target",
                "method": "POST",
                "enctype": "multipart/form-data",
                "params": {
                    "title": "title",
                    "text": "text",
                    "url": "url",
                    "files": [{"name": "image", "accept": ["image/*"]}],
                },
            },
            "background_color": "#ffffff",
            "theme_color": WEB_ACCENT,
            "icons": [
                {"src": "icon.svg", "sizes": "any", "type": "image/svg+xml"},
                {"src": "icon-192.png", "sizes": "192x192", "type": "image/png"},
                {"src": "icon-512.png", "sizes": "512x512", "type": "image/png"},
                {
                    "src": "icon-512.png",
                    "sizes": "512x512",
                    "type": "image/png",
                    "purpose": "maskable",
                },
            ],
        }
    )


# path -> (content type, a function giving the bytes): served by the app and by the relay
WEB_ASSETS: dict = {
    "/manifest.webmanifest": ("application/manifest+json", web_manifest),
    "/icon.svg": ("image/svg+xml", lambda: WEB_ICON_SVG.encode("utf-8")),
    "/icon-192.png": ("image/png", lambda: web_icon_png(192)),
    "/icon-512.png": ("image/png", lambda: web_icon_png(512)),
    "/apple-touch-icon.png": ("image/png", lambda: web_icon_png(180)),
    # the service worker: a worker cannot be inline; its policy lets it fetch this origin
    "/sw.js": ("text/javascript; charset=utf-8", lambda: SW_JS.encode("utf-8")),
    # Record's code, loaded by the page on first use (WEB_CSP, RECORD_SRI)
    "/record.js": ("text/javascript; charset=utf-8", lambda: RECORD_JS.encode("utf-8")),
}


def web_asset_headers(path: str) -> dict:
    """Return the headers of a public asset: cacheable, typed, and inert if opened alone
    (the service worker: checked for a new version at every start, allowed to fetch)."""
    worker = path == "/sw.js"
    fresh = worker or path == "/record.js"  # checked again at each use: a new version's own
    return {
        "Content-Type": WEB_ASSETS[path][0],
        "Cache-Control": "no-cache" if fresh else "public, max-age=86400",
        "Content-Security-Policy": "default-src 'none'; connect-src 'self'"
        if worker
        else "default-src 'none'",
        "X-Content-Type-Options": "nosniff",
    }


def web_client_page() -> str:
    """Return the page: the same bytes on a server and on a relay."""
    page = WEB_PAGE.replace("{record_sri}", RECORD_SRI)
    return page.replace("{css}", WEB_CSS).replace("{js}", WEB_JS)


def web_client_headers() -> dict:
    """Return the headers that lock the page down (its CSP allows only its own hashes)."""
    return {
        "Content-Security-Policy": WEB_CSP,
        "Referrer-Policy": "no-referrer",
        "X-Frame-Options": "DENY",
    }


# -- the consent and share pages (docs/api.md: Let others in) --------------------------------------
#
# Small pages of their own, each with its CSP hashes. Both are static: a relay serves the
# same bytes (never HTML forwarded from a server), and their scripts find the API beside
# them on their own origin (/api/v1, or /r/<serverId>/api/v1 on a relay).

PAGE_CSS = web_source("page.css")

SHARE_JS = web_source("share.js")

SHARE_PAGE = web_source("share.html")

CONSENT_JS = web_source("consent.js")

CONSENT_PAGE = web_source("consent.html")

_SHARE_SCRIPT = '"use strict";\n' + MARKDOWN_JS + SHARE_JS


def _page_csp(script: str) -> str:
    return (
        "default-src 'none'; "
        f"script-src {_csp_hash(script)}; style-src {_csp_hash(PAGE_CSS)}; "
        "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
        "form-action 'none'; frame-ancestors 'none'"
    )


def consent_page() -> str:
    """Return the OAuth consent page: the same bytes on a server and on a relay."""
    return CONSENT_PAGE.replace("{css}", PAGE_CSS).replace("{js}", CONSENT_JS)


def consent_page_headers() -> dict:
    """Return the consent page's headers: it can never be framed, and sends no referrer."""
    return {
        "Content-Security-Policy": _page_csp(CONSENT_JS),
        "Referrer-Policy": "no-referrer",
        "X-Frame-Options": "DENY",
        "X-Robots-Tag": "noindex, nofollow",
        "Cache-Control": "no-store",
    }


def share_page() -> str:
    """Return the read-only share page (the note itself is fetched by its script)."""
    return SHARE_PAGE.replace("{css}", PAGE_CSS).replace("{js}", _SHARE_SCRIPT)


def share_page_headers() -> dict:
    return {
        "Content-Security-Policy": _page_csp(_SHARE_SCRIPT),
        "Referrer-Policy": "no-referrer",
        "X-Frame-Options": "DENY",
        "X-Robots-Tag": "noindex, nofollow",
        "Cache-Control": "no-store",
    }


CLIP_JS = web_source("clip.js")

CLIP_PAGE = web_source("clip.html")


def clip_page() -> str:
    """Return the bookmarklet's page (/clip): it keeps its own key, takes the page the
    bookmarklet hands it by postMessage, and sends the clip."""
    return CLIP_PAGE.replace("{css}", PAGE_CSS).replace("{js}", CLIP_JS)


def clip_page_headers() -> dict:
    return {
        "Content-Security-Policy": _page_csp(CLIP_JS),
        "Referrer-Policy": "no-referrer",
        "X-Robots-Tag": "noindex, nofollow",
        "Cache-Control": "no-store",
    }


def shared_origin_page(page: str) -> str:
    """Return a page marked for a relay's shared origin (a relay without a domain): its
    script then keeps nothing in browser storage, since every server's page shares it."""
    return page.replace('<html lang="en"', '<html lang="en" data-origin="shared"', 1)


# -- the relay's own page (a relay with per-server origins opens no server on its host) --

RELAY_LANDING_HTML = web_source("landing.html")
RELAY_LANDING_CSS = RELAY_LANDING_HTML.split("<style>")[1].split("</style>")[0]
RELAY_LANDING_PAGE = RELAY_LANDING_HTML.encode()
RELAY_LANDING_HEADERS = {
    "Content-Type": "text/html; charset=utf-8",
    "Content-Security-Policy": f"default-src 'none'; style-src {_csp_hash(RELAY_LANDING_CSS)}; "
    "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "public, max-age=3600",
}


# -- MCP's review card (ui://notesvc/review): a page for an assistant's host --------------
#
# Self-contained: its style and script inline, allowed by their hashes in its own CSP (a
# meta tag: the host serves it, not us), no other source, no connection, no frame.

REVIEW_SOURCE = web_source("review.html")
_REVIEW_CSS = REVIEW_SOURCE.split("<style>")[1].split("</style>")[0]
_REVIEW_JS = REVIEW_SOURCE.split("<script>")[1].split("</script>")[0]
REVIEW_CSP_META = (
    f"default-src 'none'; script-src {_csp_hash(_REVIEW_JS)}; "
    f"style-src {_csp_hash(_REVIEW_CSS)}; img-src 'none'; connect-src 'none'; "
    "form-action 'none'; base-uri 'none'"
)
REVIEW_HTML = REVIEW_SOURCE.replace(
    "<!--CSP-->", f'<meta http-equiv="Content-Security-Policy" content="{REVIEW_CSP_META}">', 1
)


# -- compression: each page gzipped once, at start (docs/api.md: Compression) --------------

_PAGES = {
    "client": web_client_page,
    "consent": consent_page,
    "share": share_page,
    "clip": clip_page,
    "landing": lambda: RELAY_LANDING_HTML,
}


def accepts_gzip(accept_encoding: str) -> bool:
    """Return whether an Accept-Encoding takes gzip: `gzip` (or `x-gzip`) with a q-value
    above 0, or `*` above 0 when gzip is not named (`gzip;q=0` refuses it).

    >>> accepts_gzip("gzip, deflate, br"), accepts_gzip("br;q=1.0, gzip;q=0.5, *;q=0.1")
    (True, True)
    >>> accepts_gzip(""), accepts_gzip("gzip;q=0"), accepts_gzip("*;q=1, gzip;q=0.000")
    (False, False, False)
    >>> accepts_gzip("identity"), accepts_gzip("*"), accepts_gzip("gzip;q=x")
    (False, True, False)
    """
    named, star = None, None
    for item in (accept_encoding or "").lower().split(","):
        coding, _, params = item.partition(";")
        coding = coding.strip()
        if coding not in ("gzip", "x-gzip", "*"):
            continue
        q = 1.0
        for param in params.split(";"):
            name, _, value = param.partition("=")
            if name.strip() == "q":
                try:
                    q = float(value.strip())
                except ValueError:
                    q = 0.0  # a q-value not understood takes nothing
        if coding == "*":
            star = q
        else:
            named = q if named is None else max(named, q)
    chosen = named if named is not None else star
    return chosen is not None and chosen > 0


@functools.cache
def page_bytes(name: str, shared: bool = False) -> tuple:
    """Return (the bytes, their gzip at level 9) of a page ("client", "consent", "share",
    "landing"), made on first use and kept: a server makes the client's at start, a relay
    each on its first request. `shared`: marked for a relay's shared origin."""
    page = _PAGES[name]()
    raw = (shared_origin_page(page) if shared else page).encode("utf-8")
    return raw, gzip.compress(raw, 9, mtime=0)


def negotiated_page(name: str, accept_encoding: str, shared: bool = False) -> tuple:
    """Return (body, headers) of a page for a request's Accept-Encoding: its gzip when
    taken, else its bytes; Vary either way."""
    raw, packed = page_bytes(name, shared)
    headers = {"Vary": "Accept-Encoding"}
    if accepts_gzip(accept_encoding):
        headers["Content-Encoding"] = "gzip"
        return packed, headers
    return raw, headers
