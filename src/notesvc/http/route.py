"""The Route record; conditional GET and byte ranges (attachments and WebDAV share them).

A Route is one row of the route table (http/routes.py).
"""

from __future__ import annotations

import dataclasses
import re
import urllib.parse
from typing import Any, Callable

from notesvc.boot import API, bottle
from notesvc.errors import ApiError
from notesvc.helpers import BODY_CHUNK, request_header
from notesvc.notes.paths import ATTACHMENT_CSP, shown_inline

# -- the route record: one row of the route table (at the end of this section) -------


@dataclasses.dataclass(frozen=True)
class Route:
    method: str
    path: str  # a Bottle rule; under /api/v1 unless `api` is False
    handler: Callable
    public: bool = False
    summary: str = ""
    body: dict | None = None  # JSON schema of the request body (OpenAPI)
    params: dict | None = None  # query parameters: name -> JSON schema (OpenAPI)
    status: int = 200  # the documented success status (handlers set it themselves)
    api: bool = True
    tag: str = "system"
    media: str = "application/json"  # of the success answer
    enveloped: bool = True  # False: the answer is the document itself (OpenAPI, a challenge)
    body_media: str = "application/json"  # of the request body
    key_only: bool = False  # needs the API key itself: a JWT may not mint tokens or rotate
    scope: str = ""  # read, write or admin (docs/api.md: Let others in); a protected route
    # without one stops the app from starting
    jsonrpc: bool = False  # answers JSON-RPC 2.0, errors too; callers checked by
    # authenticate_mcp, which also takes OAuth access tokens (the MCP endpoint only)
    idempotent: bool = False  # an Idempotency-Key header makes a repeat answer as the first
    people: bool = False  # an admin route a person's admin device may call too, for what
    # is their own (their devices, keys, connectors, feeds): every other admin route is the
    # owner's (403 to a person)
    secret: bool = False  # its answer can carry a secret or a code (a key, a token, a
    # pairing's secret, a share or feed link, an authorisation code): never gzipped
    # (docs/api.md: Compression; a test derives it from the answers of every route)

    @property
    def rule(self) -> str:
        return (API if self.api else "") + self.path

    @property
    def gzip(self) -> bool:
        """Return whether this route's answers may be gzipped: a page, script or JSON that
        carries no secret (never a file's bytes, an export or WebDAV: those are no Route's)."""
        return not self.secret and compressible_type(self.media)


GZIP_MIN_BYTES = 1024  # smaller answers go as they are: gzip's header would eat the gain
_COMPRESSIBLE_RE = re.compile(
    r"^\s*(text/html|text/css|text/javascript|application/javascript|application/json"
    r"|application/[a-z0-9.-]+\+json)\s*(;|$)",
    re.I,
)


def compressible_type(content_type: str) -> bool:
    """Return whether answers of a media type are gzipped when asked: pages, scripts and JSON.

    >>> compressible_type("application/json"), compressible_type("text/html; charset=utf-8")
    (True, True)
    >>> compressible_type("image/png"), compressible_type("*/*"), compressible_type("")
    (False, False, False)
    """
    return bool(_COMPRESSIBLE_RE.match(content_type or ""))


# -- conditional GET and byte ranges: a file's download (attachments, WebDAV's GET) -------


_RANGE_RE = re.compile(r"\s*bytes\s*=\s*(\d{0,19})\s*-\s*(\d{0,19})\s*")


def byte_range(header: str, size: int) -> tuple | None:
    """Return (first, last) of a single `bytes=` range within size bytes; None to send the
    whole file (no range, several ranges, or one not understood); 416 when it is outside.

    >>> byte_range("bytes=0-99", 1000), byte_range("bytes=-10", 1000), byte_range("bytes=9-", 10)
    ((0, 99), (990, 999), (9, 9))
    """
    m = _RANGE_RE.fullmatch(header)
    if not m or not (m.group(1) or m.group(2)):
        return None
    first, last = m.groups()
    if not first:
        start, end = max(0, size - int(last)), size - 1
        if int(last) == 0:
            start = size
    else:
        start = int(first)
        end = min(int(last), size - 1) if last else size - 1
        if last and int(last) < start:
            return None
    if start >= size:
        raise ApiError(
            416,
            "VALIDATION_ERROR",
            f"the range is outside the file's {size} bytes",
            {"Content-Range": f"bytes */{size}"},
        )
    return start, end


def content_disposition(path: str, content_type: str) -> str:
    """Return the Content-Disposition of a download: inline only for types shown in place."""
    kind = "inline" if shown_inline(content_type) else "attachment"
    name = path.rsplit("/", 1)[-1]
    plain = re.sub(r"[^A-Za-z0-9._ -]+", "_", name)
    return f"{kind}; filename=\"{plain}\"; filename*=UTF-8''{urllib.parse.quote(name)}"


def file_chunks(f: Any, length: int):
    try:
        while length > 0:
            chunk = f.read(min(BODY_CHUNK, length))
            if not chunk:
                return
            length -= len(chunk)
            yield chunk
    finally:
        f.close()


def none_match(header: str | None, etag: str) -> bool:
    """Return whether an If-None-Match names `etag` (weakly or not) or is `*` (RFC 9110: a
    `*` inside a tag, `"a*b"` or `W/"*"`, is that tag, not a match)."""
    if not header:
        return False
    tags = {t.strip().removeprefix("W/") for t in header.split(",")}
    return "*" in tags or etag in tags


def conditional_download(
    etag: str,
    size: int,
    content_type: str,
    path: str,
    headers: tuple = (),
) -> tuple | None:
    """Set the status and headers of a file's download (`size` bytes, `etag`); return
    (first, length) of the bytes to send, or None for a 304 (no body).

    If-None-Match naming the ETag (or `*`) is 304 with the ETag alone. Else one `bytes=`
    Range, honoured when If-Range is absent or is this very ETag, is 206 with
    Content-Range; a range past the end 416 (`Content-Range: bytes */size`); any other
    Range, or a stale If-Range, the whole file (200). Either carries ETag, `headers`
    (name, value pairs), Accept-Ranges, Content-Length, Content-Disposition and the
    sandbox policy. If-Modified-Since is not looked at.
    """
    resp = bottle.response
    if none_match(request_header("If-None-Match"), etag):
        resp.status = 304
        resp.set_header("ETag", etag)
        return None
    first, last, status = 0, size - 1, 200
    wanted, if_range = request_header("Range"), request_header("If-Range")
    if wanted and size and (if_range is None or if_range.strip() == etag):
        found = byte_range(wanted, size)
        if found:
            (first, last), status = found, 206
            resp.set_header("Content-Range", f"bytes {first}-{last}/{size}")
    resp.status = status
    resp.content_type = content_type
    length = max(0, last - first + 1)
    for name, value in (
        ("ETag", etag),
        *headers,
        ("Accept-Ranges", "bytes"),
        ("Content-Length", str(length)),
        ("Content-Disposition", content_disposition(path, content_type)),
        ("Content-Security-Policy", ATTACHMENT_CSP),
    ):
        resp.set_header(name, value)
    return first, length
