"""The relay (`notesvc relay`, on asyncio) and the server's RelayClient."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hmac
import json
import logging
import re
import secrets
import time
import urllib.parse
import uuid
from collections import deque
from typing import Any

from notesvc.auth import relay_code_of, relay_server_id
from notesvc.boot import API, __version__, bottle, log
from notesvc.errors import (
    JSON_TYPE,
    STATUS_CODES,
    ApiError,
    bad_request,
    error_body,
    jsonrpc_error_body,
    not_found,
    success_body,
)
from notesvc.helpers import (
    FORWARDING_HEADERS,
    base_url_of,
    client_address,
    field,
    ip_of,
    lan_address,
    log_safe,
)
from notesvc.notes.paths import ACTIVE_TYPES
from notesvc.passthrough.dns import (
    CHALLENGE_MAX_BYTES,
    CHALLENGE_MAX_VALUES,
    ChallengeRecords,
    DnsError,
    DnsServer,
    DnsUpdater,
    DnsZone,
    tsig_setting,
)
from notesvc.passthrough.front import SPLICE_UPGRADE, TlsFront
from notesvc.settings import Config
from notesvc.web import (
    RELAY_LANDING_HEADERS,
    WEB_ASSETS,
    consent_page_headers,
    negotiated_page,
    share_page_headers,
    web_asset_headers,
    web_client_headers,
)

# -- Relay ---------------------------------------------------------------------------------
#
# A relay lets a server behind NAT be reached without an open port. The server
# registers and keeps a long-poll open; the relay hands it each client request and
# passes the reply back. The relay keeps no notes and no keys at rest: the
# X-Service-Key header passes through untouched and the server checks it.
#
# `notesvc relay` runs on asyncio: an idle long-poll or a waiting client costs a
# socket, not a thread. Every path names the key it can be routed by (a server id
# or a relay code), so several relay processes scale out behind a load balancer
# that hashes on it (deploy/nginx-relay.conf).
#
#   server -> POST {relay}/relay/v1/register/<serverId>   {token, relayCode}
#   server -> GET  {relay}/relay/v1/poll/<serverId>       X-Relay-Token; 200 a request, 204 none
#   server -> POST {relay}/relay/v1/reply/<serverId>/<id> X-Relay-Token; {status, headers, body}
#   server -> POST {relay}/relay/v1/code/<relayCode>      {serverId, token}
#   client -> GET  {relay}/relay/v1/pair/<relayCode>      {serverId, relayApiBase}
#   client -> ANY  {relay}/r/<serverId>/api/v1/...        forwarded, answered or 504
#   client -> GET  {relay}/  and /health                  the web client (the relay's copy)

RELAY_POLL_WAIT = 25.0  # seconds a poll is held open
RELAY_EXPIRY = 90.0  # a server not polling for this long is offline
RELAY_CODE_TTL = 600.0  # a server sends its relay code again at least every third of this
RELAY_MAX_HEAD = 16384  # bytes of request line and headers
# Lingering close after an early error (413, 431, a bad Content-Length), by the server and
# the relay alike (docs/api.md): bounded in bytes and in time, so it costs no more than the
# connection it keeps.
LINGER_MAX_BYTES = 64 * 1024 * 1024
LINGER_SECONDS = 10.0
LINGER_IDLE_SECONDS = 2.0
RELAY_MAX_LINGERING = 128  # connections a relay lingers on at once (the rest close at once)
UPGRADED = object()  # _serve_one: the connection became a splice's data connection
RELAY_ID_RE = re.compile(r"^[a-z2-7]{20}\Z")
RELAY_CODE_RE = re.compile(r"^[A-Za-z0-9-]{1,64}\Z")
_TOKEN_CHARS_RE = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+\Z")
HOP_BY_HOP = frozenset(
    "connection keep-alive proxy-authenticate proxy-authorization te trailer trailers "
    "transfer-encoding upgrade host content-length expect".split()
)
RELAY_ANSWER_CSP = "default-src 'none'; sandbox"
RELAYED_WELL_KNOWN_RE = re.compile(
    r"^/\.well-known/(oauth-protected-resource|oauth-authorization-server|openid-configuration)"
    r"/r/([^/]+)(/.*)?$"
)
# A server's route that answers JSON-RPC (/mcp, path-based or on its own origin): the
# relay's own refusals of a request to it (server offline, body too large) are JSON-RPC
# errors too (docs/api.md).
RELAYED_JSONRPC_RE = re.compile(rf"^(?:/r/[^/]+)?{API}/mcp$")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: Any) -> bytes:
    if not isinstance(text, str):
        raise bad_request("body must be base64 text")
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:
        raise bad_request("body is not valid base64") from None


# -- HTTP/1.1 on asyncio streams ----------------------------------------------


@dataclasses.dataclass
class RelayRequest:
    method: str
    path: str  # percent-decoded, as WSGI servers pass PATH_INFO
    query: str
    headers: list  # [(name, value)] as received
    body: bytes
    peer: str
    keep_alive: bool
    server_id: str = ""  # the server whose own origin (Host) the request came to
    scheme: str = "http"  # https when TLS ended on the relay's own TLS port

    def header(self, name: str, default: str = "") -> str:
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), default)


class _Refuse(Exception):
    """A request the relay will not parse: answered with `status` and the connection closed."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def parse_request_head(head: bytes, peer: str) -> tuple:
    """Return (method, path, query, headers, keep_alive, content_length) of a request head.

    Strict: one request line, CRLF lines, token field names, no obs-fold, at most one
    Content-Length, and Transfer-Encoding only as exactly `chunked` in one header with no
    Content-Length beside it (docs/design.md: relay: anything else is 400, never guessed); a chunked
    body's content_length is -1 (read_chunked_body decodes it).
    """
    text = head.decode("latin-1")  # every byte decodes
    lines = text.split("\r\n")
    if lines[-2:] != ["", ""]:
        raise _Refuse(400, "the request head must end with an empty CRLF line")
    lines = lines[:-2]
    method, target, minor, authority = _parse_request_line(lines[0])
    headers = _parse_header_lines(lines[1:])
    if authority:
        headers = [(k, v) for k, v in headers if k.lower() != "host"] + [("Host", authority)]
    length = _request_body_length(headers, minor)
    connection = ",".join(v for k, v in headers if k.lower() == "connection").lower()
    keep_alive = "close" not in connection if minor == "1" else "keep-alive" in connection
    raw_path, _, query = target.partition("?")
    try:
        path = urllib.parse.unquote_to_bytes(raw_path).decode("utf-8")
    except UnicodeDecodeError:
        raise _Refuse(400, "the URL path is not UTF-8") from None
    return method, path, query, headers, keep_alive, length


def _parse_request_line(line: str) -> tuple:
    """Return (method, target, HTTP minor version, authority) of a request line; the target
    of an absolute-form one (RFC 9112 3.2.2) is its path and query, its authority the Host
    ('' for the usual origin-form)."""
    m = re.fullmatch(r"([A-Z]{1,16}) (/[!-~]*|[Hh][Tt][Tt][Pp][Ss]?://[!-~]+) HTTP/1\.([01])", line)
    if not m:
        raise _Refuse(400, "malformed request line")
    method, target, minor = m.groups()
    if target.startswith("/"):
        return method, target, minor, ""
    try:
        url = urllib.parse.urlsplit(target)
    except ValueError:  # (a broken IPv6 literal, say)
        raise _Refuse(400, "malformed request line") from None
    authority, target = url.netloc, (url.path or "/") + (f"?{url.query}" if url.query else "")
    if not authority or "@" in authority or not target.startswith("/"):
        raise _Refuse(400, "malformed request line")
    return method, target, minor, authority


def _parse_header_lines(lines: list) -> list:
    """Return [(name, value)] of a request's header lines, refusing obs-fold, a name that is
    not a token and a bare CR or LF."""
    headers = []
    for line in lines:
        if line[:1] in (" ", "\t"):
            raise _Refuse(400, "folded header lines (obs-fold) are not accepted")
        name, sep, value = line.partition(":")
        if not sep or not _TOKEN_CHARS_RE.match(name):
            raise _Refuse(400, "malformed header line")
        if "\n" in line or "\r" in line:
            raise _Refuse(400, "bare CR or LF in a header line")
        headers.append((name, value.strip(" \t")))
    return headers


def _request_body_length(headers: list, minor: str) -> int:
    """Return a request's Content-Length (0 without one; -1 for a chunked body), refusing
    any framing that could be read two ways."""
    lengths = [v for k, v in headers if k.lower() == "content-length"]
    codings = [v for k, v in headers if k.lower() == "transfer-encoding"]
    if codings:
        # One way to find a body's end, or none: two headers, a list, another coding, or a
        # Content-Length beside it could be read two ways (request smuggling).
        if len(codings) > 1 or codings[0].lower() != "chunked":
            raise _Refuse(400, "Transfer-Encoding must be exactly one header saying chunked")
        if lengths:
            raise _Refuse(400, "a request may not carry both Transfer-Encoding and Content-Length")
        if minor == "0":
            raise _Refuse(400, "HTTP/1.0 has no chunked request bodies")
    if len(lengths) > 1:
        raise _Refuse(400, "more than one Content-Length")
    if not lengths:
        return -1 if codings else 0
    if not re.fullmatch(r"\d{1,18}", lengths[0]):
        raise _Refuse(400, "Content-Length is not a whole number")
    return int(lengths[0])


RELAY_MAX_CHUNK_META = 8192  # bytes of a chunk-size line (with extensions), and of trailers


async def _chunk_line(reader: asyncio.StreamReader, limit: int, status: int, what: str) -> bytes:
    """Return one line of a chunked body without its CRLF: at most `limit` bytes with its
    CRLF (else `status`), with no bare CR or LF in it (else 400)."""
    try:
        line = await reader.readuntil(b"\n")
    except asyncio.LimitOverrunError:
        raise _Refuse(status, f"{what} is over {limit} bytes") from None
    if len(line) > limit:
        raise _Refuse(status, f"{what} is over {limit} bytes")
    if not line.endswith(b"\r\n") or b"\r" in line[:-2]:
        raise _Refuse(400, "a chunked body's lines must end with CRLF (no bare CR or LF)")
    return line[:-2]


async def read_chunked_body(reader: asyncio.StreamReader, limit: int) -> bytes:
    """Return a chunked request body, decoded (docs/design.md: relay).

    Chunk sizes are 1-16 hex digits, every line ends with CRLF, extensions and trailers
    (RELAY_MAX_CHUNK_META bytes each line, the trailers in all) are read and dropped, and
    the decoded bytes count against `limit` as they come: _Refuse 413 before a chunk that
    would pass it is read, 400 for anything malformed, 431 for trailers too large.
    """
    body = bytearray()
    while True:
        line = await _chunk_line(reader, RELAY_MAX_CHUNK_META, 400, "a chunk-size line")
        size, sep, _extensions = line.partition(b";")
        if sep:
            size = size.rstrip(b" \t")  # BWS before an extension (RFC 9112 7.1.1)
        if not re.fullmatch(rb"[0-9A-Fa-f]{1,16}", size):
            raise _Refuse(400, "a chunk size must be 1-16 hexadecimal digits")
        n = int(size, 16)
        if n == 0:
            break
        if len(body) + n > limit:
            raise _Refuse(413, f"the body is over this relay's limit of {limit} bytes")
        body += await reader.readexactly(n)
        if await reader.readexactly(2) != b"\r\n":
            raise _Refuse(400, "a chunk's data must be followed by CRLF")
    left = RELAY_MAX_CHUNK_META
    while True:  # trailer fields, dropped, up to the empty line
        line = await _chunk_line(reader, left, 431, "the trailer section")
        if not line:
            return bytes(body)
        left -= len(line) + 2
        name, colon, _value = line.partition(b":")
        if not colon or not _TOKEN_CHARS_RE.match(name.decode("latin-1")):
            raise _Refuse(400, "malformed trailer line")


def _expects_continue(headers: list, head: bytes) -> bool:
    """Return whether an HTTP/1.1 client waits for `100 Continue` before its body (curl
    and the Windows WebDAV client do, for a second or until told)."""
    expect = ",".join(v for k, v in headers if k.lower() == "expect").lower()
    return "100-continue" in expect and head.split(b"\r\n", 1)[0].endswith(b" HTTP/1.1")


def http_response(status: int, headers: list, body: bytes, keep_alive: bool) -> bytes:
    """Return an HTTP/1.1 response (head and body) as bytes; a header that cannot go on
    the wire (outside Latin-1) is left out, never the whole answer."""
    reason = bottle.HTTP_CODES.get(status, "Status")
    lines = [f"HTTP/1.1 {status} {reason}"]
    for k, v in headers:
        line = f"{k}: {v}"
        if all(ord(c) < 256 for c in line):
            lines.append(line)
        else:
            log.warning("relay: a %s header outside Latin-1 was left out", log_safe(k, 40))
    lines.append(f"Content-Length: {len(body)}")
    lines.append("Connection: " + ("keep-alive" if keep_alive else "close"))
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


# -- the relay's memory ---------------------------------------------------------


@dataclasses.dataclass
class _RelayServer:
    queue: deque = dataclasses.field(default_factory=deque)  # requests no poll has taken
    pollers: deque = dataclasses.field(default_factory=deque)  # futures of waiting polls
    waiting: dict = dataclasses.field(default_factory=dict)  # request id -> future of reply
    last_seen: float = 0.0
    code: str = ""  # its relay code, once it gave one (held while it is registered)
    passthrough: bool = False  # registered with passthrough: true (its clients are spliced)


class RelayHub:
    """Registered servers, their queued requests and waiting clients (one event loop).

    A relay code maps only to the server whose token it derives from: nobody can take
    another's code. A code is held while its server is registered here, or for
    RELAY_CODE_TTL after a code call (a relay process behind a load balancer that hashes
    on the code holds codes of servers registered with its peers); code calls count
    toward the registration rate limit, and at most relay_max_servers codes are held
    beyond those of the servers registered here.
    """

    def __init__(self, config: Config):
        self.config = config
        self.servers: dict = {}
        self.codes: dict = {}  # relay code -> (server id, held until: monotonic seconds)
        self.registrations: dict = {}  # client address -> deque of times
        self.closed = False
        self._expired_at = -1.0
        self.dial_waits: Any = lambda token: False  # is a dial's client still waiting?

    def close(self) -> None:
        """Wake every long-poll and waiting client (the relay is stopping)."""
        self.closed = True
        for slot in self.servers.values():
            for fut in [*slot.pollers, *slot.waiting.values()]:
                if not fut.done():
                    fut.set_result(None)

    def _expire(self, now: float) -> None:
        """Drop servers not seen for RELAY_EXPIRY and codes past their time (at most once a
        second: it walks them all)."""
        if now - self._expired_at < 1.0:
            return
        self._expired_at = now
        for sid in [s for s, v in self.servers.items() if now - v.last_seen > RELAY_EXPIRY]:
            if not self.servers[sid].pollers:
                self._drop(sid)
        for code in [c for c, (sid, until) in self.codes.items() if until < now]:
            slot = self.servers.get(self.codes[code][0])
            if slot is None or slot.code != code:
                del self.codes[code]

    def _drop(self, sid: str) -> None:
        slot = self.servers.pop(sid)
        if self.codes.get(slot.code, ("",))[0] == sid:
            del self.codes[slot.code]
        for fut in slot.waiting.values():  # their clients get a 504 now, not after a time-out
            if not fut.done():
                fut.set_result(None)

    @staticmethod
    def check_token(server_id: str, token: str) -> None:
        if not token or not hmac.compare_digest(relay_server_id(token), server_id):
            raise ApiError(403, "FORBIDDEN", "this relay token does not certify that server id")

    def register(
        self, server_id: str, token: str, relay_code: str, addr: str, passthrough: bool = False
    ) -> None:
        now = time.monotonic()
        self._rate_limit(addr, now)
        self.check_token(server_id, token)
        self._check_code(relay_code, token)
        self._expire(now)
        slot = self.servers.get(server_id)
        if slot is None:
            if len(self.servers) >= self.config.relay_max_servers:
                raise ApiError(
                    429,
                    "RATE_LIMITED",
                    "the relay holds its maximum of servers",
                    {"Retry-After": "60"},
                )
            slot = self.servers[server_id] = _RelayServer()
        slot.last_seen = now
        slot.passthrough = passthrough
        if relay_code:
            if slot.code and slot.code != relay_code.lower():
                self.codes.pop(slot.code, None)
            slot.code = relay_code.lower()
            self.codes[slot.code] = (server_id, now + RELAY_CODE_TTL)

    def _rate_limit(self, addr: str, now: float) -> None:
        if len(self.registrations) > 10000:
            for a in [a for a, q in self.registrations.items() if not q or q[-1] < now - 60]:
                del self.registrations[a]
        q = self.registrations.setdefault(addr, deque())
        while q and q[0] <= now - 60:
            q.popleft()
        if len(q) >= self.config.relay_registrations_per_minute:
            raise ApiError(
                429,
                "RATE_LIMITED",
                "too many registrations from this address",
                {"Retry-After": "60"},
            )
        q.append(now)

    @staticmethod
    def _check_code(relay_code: str, token: str) -> None:
        if relay_code and not hmac.compare_digest(relay_code.lower(), relay_code_of(token)):
            raise ApiError(403, "FORBIDDEN", "this relay token does not certify that relay code")

    def set_code(self, relay_code: str, server_id: str, token: str, addr: str) -> None:
        """Hold a code for RELAY_CODE_TTL (a code call is a registration of the code)."""
        now = time.monotonic()
        self._rate_limit(addr, now)
        self.check_token(server_id, token)
        self._check_code(relay_code, token)
        self._expire(now)
        code = relay_code.lower()
        held = sum(1 for c, (sid, _) in self.codes.items() if c != self._code_of(sid))
        if code not in self.codes and held >= self.config.relay_max_servers:
            raise ApiError(
                429, "RATE_LIMITED", "the relay holds its maximum of codes", {"Retry-After": "60"}
            )
        self.codes[code] = (server_id, now + RELAY_CODE_TTL)

    def _code_of(self, server_id: str) -> str:
        slot = self.servers.get(server_id)
        return slot.code if slot is not None else ""

    def pair(self, relay_code: str) -> str:
        self._expire(time.monotonic())
        entry = self.codes.get(relay_code.lower())
        if entry is None:
            raise not_found("no server is paired under this relay code")
        return entry[0]

    def _slot(self, server_id: str, token: str) -> _RelayServer:
        self.check_token(server_id, token)
        slot = self.servers.get(server_id)
        if slot is None:
            raise ApiError(401, "UNAUTHORIZED", "not registered here: register first")
        return slot

    async def poll(self, server_id: str, token: str, wait: float = RELAY_POLL_WAIT):
        """Return the next request for a server, waiting up to `wait` seconds (None: none)."""
        slot = self._slot(server_id, token)
        slot.last_seen = time.monotonic()
        while slot.queue:
            request = slot.queue.popleft()
            if request.get("id") in slot.waiting:  # its client may have given up meanwhile
                return request
            if request.get("kind") == "dial" and self.dial_waits(request["token"]):
                return request
        if self.closed:
            return None
        fut = asyncio.get_running_loop().create_future()
        slot.pollers.append(fut)
        try:
            return await asyncio.wait_for(fut, wait)
        except asyncio.TimeoutError:
            return None
        finally:
            slot.last_seen = time.monotonic()
            with contextlib.suppress(ValueError):
                slot.pollers.remove(fut)

    def splices_to(self, server_id: str) -> bool:
        """Return whether a server registered here in passthrough mode (and is polling)."""
        slot = self.servers.get(server_id)
        return (
            slot is not None
            and slot.passthrough
            and time.monotonic() - slot.last_seen <= RELAY_EXPIRY
        )

    def dial(self, server_id: str, message: dict):
        """Put a dial in a server's long-poll; return True, or False when it cannot be (not
        connected, its queue full of requests), or the token of the oldest dial it took the
        place of (a queue full of dials: the newest client comes first, so a flood of
        unfinished handshakes cannot keep the owner out)."""
        slot = self.servers.get(server_id)
        if slot is None:
            return False
        while slot.pollers:
            poller = slot.pollers.popleft()
            if not poller.done():
                poller.set_result(message)
                return True
        if len(slot.queue) >= self.config.relay_max_queue:
            oldest = next((m for m in slot.queue if m.get("kind") == "dial"), None)
            if oldest is None:
                return False
            slot.queue.remove(oldest)
            slot.queue.append(message)
            return oldest["token"]
        slot.queue.append(message)
        return True

    def reply(self, server_id: str, token: str, request_id: str, answer: dict) -> None:
        slot = self._slot(server_id, token)
        fut = slot.waiting.get(request_id)
        if fut is None or fut.done():
            raise not_found("no client is waiting for that request (timed out?)")
        fut.set_result(answer)

    async def forward(self, server_id: str, request: dict) -> dict:
        """Hand a client's request to its server and return the server's answer."""
        self._expire(time.monotonic())
        slot = self.servers.get(server_id)
        if slot is None:
            raise ApiError(504, "UPSTREAM_TIMEOUT", "that server is not connected to this relay")
        request_id = secrets.token_hex(8)
        request = {**request, "id": request_id}
        loop = asyncio.get_running_loop()
        slot.waiting[request_id] = answer = loop.create_future()
        try:
            while slot.pollers:  # a waiting poll takes it at once
                poller = slot.pollers.popleft()
                if not poller.done():
                    poller.set_result(request)
                    break
            else:
                if len(slot.queue) >= self.config.relay_max_queue:
                    raise ApiError(
                        429,
                        "RATE_LIMITED",
                        "too many requests queued for that server",
                        {"Retry-After": "5"},
                    )
                slot.queue.append(request)
            try:
                result = await asyncio.wait_for(answer, self.config.relay_timeout)
            except asyncio.TimeoutError:
                result = None
        finally:
            slot.waiting.pop(request_id, None)
            if request in slot.queue:  # an unanswered request leaves the queue with its client
                slot.queue.remove(request)
        if result is None:
            raise ApiError(504, "UPSTREAM_TIMEOUT", "the server did not answer through the relay")
        return result


# -- the relay's connections and routes --------------------------------------------


class _Conn:
    """One client connection; `busy` while a request is in flight or a poll is held."""

    __slots__ = ("busy", "opened", "peer", "scheme", "writer")

    def __init__(self, writer: asyncio.StreamWriter, peer: str):
        self.writer, self.peer, self.busy, self.opened = writer, peer, False, time.monotonic()
        self.scheme = "http"

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class RelayServer:
    """`notesvc relay`: the asyncio HTTP server, its routes and the hub."""

    def __init__(self, config: Config):
        self.config, self.started = config, time.time()
        self.hub = RelayHub(config)
        self.by_addr: dict = {}  # peer address -> {conn: None} (insertion order: oldest first)
        self.lingering = 0  # connections draining a refused body (_linger)
        self.server: asyncio.AbstractServer | None = None
        self.domain = config.relay_domain  # "": no per-server origins (pages path-based)
        # passthrough (SERVICE_RELAY_TLS): the TLS port, the challenge records and who
        # holds them (its own DNS, or another DNS server by RFC 2136 updates)
        self.front: TlsFront | None = None
        self.dns: DnsServer | None = None
        self.updater: DnsUpdater | None = None
        self.challenges = ChallengeRecords(config.relay_max_servers)
        if config.relay_tls == "passthrough":
            self.front = TlsFront(config, self.hub, self._serve_connection)
            self.hub.dial_waits = lambda token: token in self.front.dials
            if config.relay_dns_update:
                name, secret = tsig_setting(config.relay_dns_tsig_secret)
                self.updater = DnsUpdater(config.relay_dns_update, name, secret, self.domain)
        assets = re.compile("^(" + "|".join(map(re.escape, WEB_ASSETS)) + ")$")
        prefixed = r"^/r/([^/]+)"
        # The relay's own host: its API for servers, the path-based JSON routes of every
        # server (/r/<id>/api/v1, MCP, OAuth's token endpoints and metadata), and pages:
        # with a domain, a landing page and redirects to each server's own origin; without
        # one, the pages themselves, which then keep nothing in the browser (docs/design.md: relay).
        self.routes = (
            ("GET", re.compile(r"^/health$"), self.health),
            ("GET", re.compile(r"^/relay/v1/info$"), self.info),
            ("POST", re.compile(r"^/relay/v1/register/([^/]+)$"), self.register),
            ("GET", re.compile(r"^/relay/v1/poll/([^/]+)$"), self.poll),
            ("POST", re.compile(r"^/relay/v1/reply/([^/]+)/([^/]+)$"), self.reply),
            ("POST", re.compile(r"^/relay/v1/code/([^/]+)$"), self.set_code),
            ("GET", re.compile(r"^/relay/v1/pair/([^/]+)$"), self.pair),
            ("PUT", re.compile(r"^/relay/v1/acme/([^/]+)$"), self.acme),
            ("DELETE", re.compile(r"^/relay/v1/acme/([^/]+)$"), self.acme),
            ("*", re.compile(prefixed + r"(/api/v1(?:/.*)?)$", re.S), self.forward),
            ("GET", RELAYED_WELL_KNOWN_RE, self.forward_well_known),
            ("POST", re.compile(prefixed + r"(/oauth/(?:token|register|revoke))$"), self.forward),
            ("GET", assets, self.web_asset),
            ("GET", re.compile(r"^/$"), self.landing if self.domain else self.web_client),
            ("GET", re.compile(prefixed + r"(/oauth/authorize)$"), self.consent_page),
            ("GET", re.compile(prefixed + r"(/s/[A-Za-z0-9_-]{1,64})$"), self.share_page),
            ("GET", re.compile(prefixed + r"(/ics/[A-Za-z0-9_-]{1,64}\.ics)$"), self.forward),
            ("GET", re.compile(prefixed + r"(/)$"), self.to_origin),
        )
        # A server's own origin, <serverId>.<domain>: its pages (the relay's copies), and its
        # API, WebDAV, OAuth and metadata forwarded as that server's own paths.
        self.origin_routes = (
            ("*", re.compile(r"^(/api/v1(?:/.*)?)$", re.S), self.forward_origin),
            ("*", re.compile(r"^(/dav(?:/.*)?)$", re.S), self.forward_origin),
            ("POST", re.compile(r"^(/oauth/(?:token|register|revoke))$"), self.forward_origin),
            ("*", re.compile(r"^(/\.well-known/caldav)$"), self.forward_origin),  # (PROPFIND too)
            ("GET", re.compile(r"^(/\.well-known/[a-z-]+(?:/.*)?)$"), self.forward_origin),
            ("GET", re.compile(r"^(/ics/[A-Za-z0-9_-]{1,64}\.ics)$"), self.forward_origin),
            ("GET", re.compile(r"^/relay/v1/pair/([^/]+)$"), self.pair),
            ("GET", assets, self.web_asset),
            ("GET", re.compile(r"^/$"), self.web_client),
            ("GET", re.compile(r"^/oauth/authorize$"), self.consent_page),
            ("GET", re.compile(r"^/s/[A-Za-z0-9_-]{1,64}$"), self.share_page),
        )

    # -- connections ---------------------------------------------------------------

    async def start(self) -> int:
        """Listen (HTTP; with passthrough, TLS and DNS too); return the HTTP port."""
        shared = self.front is not None and self.config.relay_tls_port == self.config.port
        if shared and self.config.port:  # one port: the TLS front takes HTTP too
            port = await self.front.start(shared=True)
        else:
            self.server = await asyncio.start_server(
                self._serve_connection,
                self.config.host,
                self.config.port,
                limit=RELAY_MAX_HEAD,
                backlog=1024,
            )
            port = self.server.sockets[0].getsockname()[1]
            if self.front is not None:
                await self.front.start(shared=False)
        if self.front is not None and self.updater is None:
            zone = DnsZone(self.domain, self.dns_addresses(), self.challenges)
            self.dns = DnsServer(zone, self.config.host, self.config.relay_dns_port)
            await self.dns.start()
        return port

    def dns_addresses(self) -> tuple:
        """Return the A/AAAA answers for D and *.D: SERVICE_RELAY_DNS_ADDRESSES, else
        SERVICE_HOST when it names one address, else the default-route address."""
        if self.config.relay_dns_addresses:
            return self.config.relay_dns_addresses
        host = self.config.host.strip("[]")
        if host not in ("", "0.0.0.0", "::") and ip_of(host) is not None:
            return (host,)
        found = lan_address().strip("[]")
        if not found:
            log.warning("relay: no address for DNS answers: set SERVICE_RELAY_DNS_ADDRESSES")
        return (found,) if found else ()

    def close(self) -> None:
        """Stop listening (HTTP, TLS, DNS)."""
        if self.server is not None:
            self.server.close()
        if self.front is not None:
            self.front.close()
        if self.dns is not None:
            self.dns.close()

    def _admit(self, conn: _Conn) -> None:
        """Track a connection; close the address's oldest idle one beyond the cap."""
        conns = self.by_addr.setdefault(conn.peer, {})
        idle = [c for c in conns if not c.busy]
        for old in idle[: max(0, len(idle) + 1 - self.config.relay_max_idle_per_address)]:
            old.close()
            conns.pop(old, None)
        conns[conn] = None

    def _forget(self, conn: _Conn) -> None:
        conns = self.by_addr.get(conn.peer)
        if conns is not None:
            conns.pop(conn, None)
            if not conns:
                del self.by_addr[conn.peer]

    async def _serve_connection(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        peer: str = "",
        scheme: str = "http",
    ):
        """Serve one connection's requests; `peer` and `scheme` as the TLS port found them
        (a trusted proxy's PROXY header; TLS ended here)."""
        peer = peer or (writer.get_extra_info("peername") or ("?", 0))[0]
        conn = _Conn(writer, peer)
        conn.scheme = scheme
        self._admit(conn)
        keep_alive = None
        try:
            while not self.hub.closed:
                keep_alive = await self._serve_one(conn, reader, writer)
                if not keep_alive or keep_alive is UPGRADED:
                    break
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        except Exception:
            log.exception("relay: connection from %s failed", peer)
        finally:
            self._forget(conn)
            if keep_alive is not UPGRADED:  # (a data connection now: the splice has it)
                conn.close()

    async def _serve_one(self, conn: _Conn, reader, writer) -> bool:
        timeout = self.config.idle_timeout
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
        except asyncio.TimeoutError:
            return False
        except asyncio.IncompleteReadError:
            return False
        except asyncio.LimitOverrunError:
            await self._send(writer, *self._error(431, "the request head is too large"), False)
            await self._linger(reader, writer, LINGER_MAX_BYTES)
            return False
        conn.busy = True
        try:
            try:
                method, path, query, headers, keep_alive, length = parse_request_head(
                    head, conn.peer
                )
            except _Refuse as e:
                await self._send(writer, *self._error(e.status, e.message), False)
                conn.busy = False
                await self._linger(reader, writer, LINGER_MAX_BYTES)
                return False
            if method == "POST" and path.startswith("/relay/v1/dial/"):
                return await self._dial(conn, reader, writer, path, headers, length)
            host = next((v for k, v in headers if k.lower() == "host"), "")
            limit = self._body_limit(path, host)
            if length > limit:
                self._answer_too_large(path, headers)
                await self._send(
                    writer,
                    *self._error(
                        413, f"the body is over this relay's limit of {limit} bytes", path=path
                    ),
                    False,
                )
                conn.busy = False
                await self._linger(reader, writer, min(length, LINGER_MAX_BYTES))
                return False
            if length and _expects_continue(headers, head):
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            try:
                if length < 0:  # chunked: decoded here, under the same limit and time
                    body = await asyncio.wait_for(read_chunked_body(reader, limit), timeout)
                else:
                    body = (
                        await asyncio.wait_for(reader.readexactly(length), timeout)
                        if length
                        else b""
                    )
            except asyncio.TimeoutError:
                return False
            except _Refuse as e:
                if e.status == 413:
                    self._answer_too_large(path, headers)
                await self._send(writer, *self._error(e.status, e.message, path=path), False)
                conn.busy = False
                await self._linger(reader, writer, LINGER_MAX_BYTES)
                return False
            request = RelayRequest(method, path, query, headers, body, conn.peer, keep_alive)
            request.scheme = conn.scheme
            started = time.perf_counter()
            status, out_headers, out_body = await self._route(request)
            await self._send(writer, status, out_headers, out_body, keep_alive)
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "relay %s %s %d %.1fms",
                    method,
                    log_safe(_private_path(path)),
                    status,
                    (time.perf_counter() - started) * 1000,
                )
            return keep_alive
        finally:
            conn.busy = False

    async def _dial(self, conn: _Conn, reader, writer, path: str, headers: list, length: int):
        """`POST /relay/v1/dial/<serverId>/<token>` (Upgrade: notesvc-splice): a server's
        data connection for a client waiting on the TLS port. 101 and the splice, or 403
        (a wrong, used or expired token) and close."""
        m = re.match(r"^/relay/v1/dial/([^/]+)/([^/]+)$", path)
        upgrade = next((v for k, v in headers if k.lower() == "upgrade"), "")
        token = next((v for k, v in headers if k.lower() == "x-relay-token"), "")
        if self.front is None:
            answer = self._error(404, "this relay does not offer passthrough")
        elif not m or length != 0 or upgrade.strip().lower() != SPLICE_UPGRADE:
            answer = self._error(400, f"a dial is a POST with Upgrade: {SPLICE_UPGRADE}, no body")
        else:
            try:
                self.hub.check_token(m.group(1), token)
                dial = self.front.take_dial(m.group(1), m.group(2))
                if dial is None:
                    raise ApiError(403, "FORBIDDEN", "no client waits under that dial token")
            except ApiError as e:
                answer = self._error(e.status_code, e.message, e.code)
            else:
                writer.write(
                    b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\n"
                    + f"Upgrade: {SPLICE_UPGRADE}\r\n\r\n".encode()
                )
                early = bytes(reader._buffer) if getattr(reader, "_buffer", None) else b""
                await self.front.join(dial, writer, early)
                return UPGRADED
        await self._send(writer, *answer, False)
        return False

    async def _linger(self, reader, writer, budget: int) -> None:
        """After an early error: shut the sending side (the answer is out), then read and
        discard what the client still sends, up to `budget` bytes, LINGER_SECONDS in all
        and LINGER_IDLE_SECONDS between reads, so that a client writing its whole body
        before reading gets the answer instead of a reset (nginx's lingering_close). At
        most RELAY_MAX_LINGERING connections linger at once: a flood of them costs no
        more memory than that."""
        if self.lingering >= RELAY_MAX_LINGERING:
            return
        try:
            if writer.can_write_eof():
                writer.write_eof()
        except (OSError, RuntimeError):
            return
        self.lingering += 1
        try:
            await self._drain(reader, budget)
        finally:
            self.lingering -= 1

    @staticmethod
    async def _drain(reader, budget: int) -> None:
        deadline = time.monotonic() + LINGER_SECONDS
        while budget > 0:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                chunk = await asyncio.wait_for(reader.read(65536), min(left, LINGER_IDLE_SECONDS))
            except (asyncio.TimeoutError, OSError, asyncio.LimitOverrunError, ValueError):
                return
            if not chunk:
                return
            budget -= len(chunk)

    async def _send(self, writer, status: int, headers: list, body: bytes, keep_alive: bool):
        writer.write(http_response(status, headers, body, keep_alive))
        await asyncio.wait_for(writer.drain(), self.config.idle_timeout)

    def _body_limit(self, path: str, host: str = "") -> int:
        """Return the largest body accepted on a path: replies carry base64 answers; a
        server's routes, path-based (/r/<id>/...) or on its own origin (any path of
        <serverId>.<domain>), take SERVICE_MAX_BODY_BYTES alike; the relay's own JSON 64 KiB."""
        if path.startswith("/relay/v1/reply/") and not self._server_of_host(host):
            return self.config.max_body_bytes * 2 + 65536
        if path.startswith("/r/") or self._server_of_host(host):
            return self.config.max_body_bytes
        return 65536

    def _answer_too_large(self, path: str, headers: list) -> None:
        """A server's reply over the limit: its client gets 413 now, not a 504 later."""
        m = re.match(r"^/relay/v1/reply/([^/]+)/([^/]+)$", path)
        if not m:
            return
        token = next((v for k, v in headers if k.lower() == "x-relay-token"), "")
        message = (
            f"the answer is over this relay's limit of {self.config.max_body_bytes} bytes; "
            "ask for it in parts (Range)"
        )
        answer = {
            "status": 413,
            "headers": [["Content-Type", JSON_TYPE]],
            "body": error_body("PAYLOAD_TOO_LARGE", message),
        }
        with contextlib.suppress(ApiError):  # a wrong token, or the client left
            self.hub.reply(m.group(1), token, m.group(2), answer)

    @staticmethod
    def _error(
        status: int, message: str, code: str = "", headers: dict | None = None, path: str = ""
    ) -> tuple:
        code = code or STATUS_CODES.get(status, "VALIDATION_ERROR")
        if RELAYED_JSONRPC_RE.match(path):  # a server's /mcp: its callers read JSON-RPC
            body = jsonrpc_error_body(status, code, message)
        else:
            body = error_body(code, message)
        return status, [("Content-Type", JSON_TYPE), *(headers or {}).items()], body

    def origin_server(self, req: RelayRequest) -> str:
        """Return the server id a request's Host names as <serverId>.<domain> ("": the
        relay's own host, or a relay without a domain)."""
        return self._server_of_host(req.header("Host"))

    def _server_of_host(self, host: str) -> str:
        """Return the server id of a Host that is <serverId>.<domain>[:port] ("" if none)."""
        if not self.domain:
            return ""
        host = host.lower().rstrip(".")
        name = host[: host.rindex(":")] if re.search(r":\d+$", host) else host
        sid, dot, rest = name.partition(".")
        return sid if dot and rest == self.domain and RELAY_ID_RE.match(sid) else ""

    async def _route(self, req: RelayRequest) -> tuple:
        allowed = []
        req.server_id = self.origin_server(req)
        for method, pattern, handler in self.origin_routes if req.server_id else self.routes:
            m = pattern.match(req.path)
            if not m:
                continue
            if method not in ("*", req.method) and not (method == "GET" and req.method == "HEAD"):
                allowed.append(method)
                continue
            try:
                result = handler(req, *m.groups())
                if asyncio.iscoroutine(result):
                    result = await result
            except ApiError as e:
                return self._error(e.status_code, e.message, e.code, dict(e.headers), req.path)
            except Exception:
                rid = uuid.uuid4().hex[:16]
                log.exception("relay: request %s failed", rid)
                return self._error(500, f"internal error; request id {rid}", path=req.path)
            if isinstance(result, dict):
                return 200, [("Content-Type", JSON_TYPE)], success_body(result)
            return result
        if allowed:
            return self._error(
                405,
                f"{req.method} is not allowed on {req.path}",
                headers={"Allow": ", ".join(allowed)},
            )
        return self._error(404, f"no route for {req.method} {log_safe(req.path)}")

    def _json(self, req: RelayRequest, limit: int = 65536) -> dict:
        ctype = req.header("Content-Type").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise ApiError(
                415, "UNSUPPORTED_MEDIA_TYPE", "send JSON with Content-Type: application/json"
            )
        try:
            body = json.loads(req.body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise bad_request("the body is not valid JSON") from None
        if not isinstance(body, dict):
            raise bad_request("the body must be a JSON object")
        return body

    def client_addr(self, req: RelayRequest) -> str:
        """Return the client's address: the peer's, or the one a trusted proxy reports."""
        environ = {"REMOTE_ADDR": req.peer}
        for name in FORWARDING_HEADERS:  # every one is judged (client_of)
            value = req.header(name[5:].replace("_", "-"))
            if value:
                environ[name] = value
        return client_address(self.config, environ)

    def base_url(self, req: RelayRequest) -> str:
        environ = {
            "wsgi.url_scheme": req.scheme,
            "HTTP_HOST": req.header("Host"),
            "REMOTE_ADDR": req.peer,
            "SERVER_PORT": str(self.config.port),
        }
        for name in ("X-Forwarded-Proto", "X-Forwarded-Host"):
            if req.header(name):
                environ["HTTP_" + name.upper().replace("-", "_")] = req.header(name)
        return base_url_of(self.config, environ)

    # -- routes ----------------------------------------------------------------------

    def health(self, req: RelayRequest) -> dict:
        return {
            "status": "ok",
            "role": "relay",
            "version": __version__,
            "uptimeSeconds": round(time.time() - self.started, 3),
            "servers": len(self.hub.servers),
            "queued": sum(len(slot.queue) for slot in self.hub.servers.values()),
            **({"passthrough": self.passthrough_stats()} if self.front is not None else {}),
        }

    def passthrough_stats(self) -> dict:
        return {
            "servers": sum(1 for s in self.hub.servers.values() if s.passthrough),
            **self.front.stats(),
            "challenges": len(self.challenges.values),
            "dns": f"updates to {self.config.relay_dns_update}" if self.updater else "own",
        }

    def info(self, req: RelayRequest) -> dict:
        """What a server needs to name its pages: per-server origins, and where."""
        return {
            "domain": self.domain or None,
            "perServerOrigins": bool(self.domain),
            "publicUrl": self.config.public_url or self.base_url(req),
            "passthrough": self.front is not None,
            **({"tlsPort": self.tls_port()} if self.front is not None else {}),
        }

    def tls_port(self) -> int:
        """Return the port clients reach <id>.D on: SERVICE_PUBLIC_URL's when it is https
        (a proxy in front), else the TLS port this relay listens on."""
        parts = urllib.parse.urlsplit(self.config.public_url)
        if parts.scheme == "https":
            return parts.port or 443
        return self.front.port if self.front is not None else 0

    def server_origin(self, req: RelayRequest, server_id: str) -> str:
        """Return https://<serverId>.<domain>[:port]: the scheme and port of the relay's
        SERVICE_PUBLIC_URL, else of the address the request came to."""
        parts = urllib.parse.urlsplit(self.config.public_url or self.base_url(req))
        port = f":{parts.port}" if parts.port else ""
        return f"{parts.scheme}://{server_id}.{self.domain}{port}"

    @staticmethod
    def _html(req: RelayRequest, page: str, headers: dict, shared: bool) -> tuple:
        """A page of the relay's own: gzipped once, sent so to a client that takes it (a
        HEAD as not); `shared`: the shared origin of a relay without a domain, where the
        page keeps nothing (22)."""
        asked = req.header("Accept-Encoding") if req.method != "HEAD" else ""
        body, coding = negotiated_page(page, asked, shared)
        ctype = {"Content-Type": "text/html; charset=utf-8"}
        return 200, list({**ctype, **headers, **coding}.items()), body

    def web_client(self, req: RelayRequest) -> tuple:
        return self._html(req, "client", web_client_headers(), not req.server_id)

    def landing(self, req: RelayRequest) -> tuple:
        """The relay's own page: an old connect link (?relayCode=) goes on to its server's
        origin; otherwise a page that opens nothing of any server."""
        code = urllib.parse.parse_qs(req.query).get("relayCode", [""])[0]
        if code:
            if not RELAY_CODE_RE.match(code):
                raise bad_request("a relay code is 1-64 letters, digits and dashes")
            return self._redirect(self.server_origin(req, self.hub.pair(code)) + "/")
        return self._html(req, "landing", RELAY_LANDING_HEADERS, False)

    def to_origin(self, req: RelayRequest, server_id: str, rest: str) -> tuple:
        """An old browser link under /r/<serverId>/ (the client, the consent page, a share
        link): the same path and query on the server's own origin; without a domain the
        consent and share pages are served here, keeping nothing."""
        if not RELAY_ID_RE.match(server_id):
            raise not_found("no such server on this relay")
        if not self.domain:
            page = "consent" if rest == "/oauth/authorize" else "share"
            if rest == "/":
                raise not_found("open the relay's own page with your server's connect link")
            head = consent_page_headers if rest == "/oauth/authorize" else share_page_headers
            return self._html(req, page, head(), True)
        target = self.server_origin(req, server_id) + rest
        return self._redirect(target + (f"?{req.query}" if req.query else ""))

    @staticmethod
    def _redirect(location: str) -> tuple:
        headers = [
            ("Location", location),
            ("Cache-Control", "no-store"),
            ("Content-Type", JSON_TYPE),
        ]
        return 302, headers, success_body({"location": location})

    def consent_page(self, req: RelayRequest, server_id: str = "", rest: str = "") -> tuple:
        if not req.server_id:
            return self.to_origin(req, server_id, rest)
        return self._html(req, "consent", consent_page_headers(), False)

    def share_page(self, req: RelayRequest, server_id: str = "", rest: str = "") -> tuple:
        if not req.server_id:
            return self.to_origin(req, server_id, rest)
        return self._html(req, "share", share_page_headers(), False)

    async def forward_well_known(self, req: RelayRequest, name: str, server_id: str, rest):
        """/.well-known/<name>/r/<id>[/...] is server <id>'s own /.well-known/<name>[/...]."""
        return await self.forward(req, server_id, f"/.well-known/{name}{rest or ''}")

    async def forward_origin(self, req: RelayRequest, path: str) -> tuple:
        """A request to a server's own origin: forwarded as its own path, no prefix."""
        return await self.forward(req, req.server_id, path, prefix="")

    def web_asset(self, req: RelayRequest, path: str) -> tuple:
        return 200, list(web_asset_headers(path).items()), WEB_ASSETS[path][1]()

    def register(self, req: RelayRequest, server_id: str) -> dict:
        body = self._json(req)
        token = field(body, "token", max_len=256)
        code = field(body, "relayCode", required=False, max_len=64) or ""
        if not RELAY_ID_RE.match(server_id):
            raise bad_request("the server id must be 20 characters of a-z and 2-7")
        if code and not RELAY_CODE_RE.match(code):
            raise bad_request("a relay code is 1-64 letters, digits and dashes")
        passthrough = body.get("passthrough", False)
        if not isinstance(passthrough, bool):
            raise bad_request("passthrough must be true or false")
        offered = self.front is not None
        self.hub.register(server_id, token, code, self.client_addr(req), passthrough and offered)
        return {"registered": True, "serverId": server_id, "passthrough": offered}

    async def poll(self, req: RelayRequest, server_id: str):
        request = await self.hub.poll(server_id, req.header("X-Relay-Token"))
        if request is None:
            return 204, [], b""
        return request

    def reply(self, req: RelayRequest, server_id: str, request_id: str) -> dict:
        body = self._json(req)
        status = field(body, "status", int)
        headers = field(body, "headers", list)
        if not 100 <= status <= 599 or not all(
            isinstance(h, list) and len(h) == 2 and all(isinstance(x, str) for x in h)
            for h in headers
        ):
            raise bad_request("status must be an HTTP status and headers [name, value] pairs")
        answer = {"status": status, "headers": headers, "body": _unb64(body.get("body", ""))}
        self.hub.reply(server_id, req.header("X-Relay-Token"), request_id, answer)
        return {"delivered": True}

    def set_code(self, req: RelayRequest, code: str) -> dict:
        body = self._json(req)
        if not RELAY_CODE_RE.match(code):
            raise bad_request("a relay code is 1-64 letters, digits and dashes")
        server_id = field(body, "serverId", max_len=64)
        token = field(body, "token", max_len=256)
        self.hub.set_code(code, server_id, token, self.client_addr(req))
        return {"relayCode": code.lower(), "serverId": server_id}

    async def acme(self, req: RelayRequest, server_id: str) -> dict:
        """PUT /relay/v1/acme/<serverId> {values}: the `TXT _acme-challenge.<id>.D` of
        that server, set only with its token (X-Relay-Token) while it is registered here;
        DELETE clears it. Gone after 10 minutes."""
        if self.front is None:
            raise not_found("this relay does not offer passthrough")
        self.hub._slot(server_id, req.header("X-Relay-Token"))
        values = []
        if req.method == "PUT":
            values = self._json(req).get("values")
            if (
                not isinstance(values, list)
                or not 1 <= len(values) <= CHALLENGE_MAX_VALUES
                or not all(
                    isinstance(v, str)
                    and 1 <= len(v) <= CHALLENGE_MAX_BYTES
                    and re.fullmatch(r"[!-~]+", v)
                    for v in values
                )
            ):
                raise bad_request(
                    f"values: 1-{CHALLENGE_MAX_VALUES} strings of 1-{CHALLENGE_MAX_BYTES} "
                    "printable ASCII characters"
                )
        try:
            if self.updater is not None and values:
                await self.updater.set(server_id, values)
            elif self.updater is not None:
                await self.updater.clear(server_id)
            elif values:
                self.challenges.set(server_id, values)
            else:
                self.challenges.clear(server_id)
        except DnsError as e:
            code = "RATE_LIMITED" if e.rcode == 5 and self.updater is None else "UPSTREAM_ERROR"
            raise ApiError(429 if code == "RATE_LIMITED" else 502, code, str(e)) from None
        except OSError as e:
            raise ApiError(502, "UPSTREAM_ERROR", f"the DNS server: {e}") from None
        return {"name": f"_acme-challenge.{server_id}.{self.domain}", "values": values}

    def pair(self, req: RelayRequest, code: str) -> dict:
        server_id = self.hub.pair(code)
        if self.domain:
            origin = self.server_origin(req, server_id)
            return {"serverId": server_id, "relayApiBase": f"{origin}{API}", "origin": origin}
        return {"serverId": server_id, "relayApiBase": f"{self.base_url(req)}/r/{server_id}{API}"}

    async def forward(self, req: RelayRequest, server_id: str, rest: str, prefix=None) -> tuple:
        """Hand a request to server_id as its path `rest`; `prefix` is what the server sees
        in front of it: /r/<serverId> on the relay's host, nothing on its own origin."""
        # no MCP sessions through the relay (their stream cannot pass): the id goes neither way
        headers = [
            [k, v]
            for k, v in req.headers
            if k.lower() not in HOP_BY_HOP and k.lower() != "mcp-session-id"
        ]
        answer = await self.hub.forward(
            server_id,
            {
                "method": req.method,
                "path": rest,
                "query": req.query,
                "headers": headers,
                "body": _b64(req.body),
                "client": self.client_addr(req),
                "scheme": urllib.parse.urlsplit(self.base_url(req)).scheme,
                "host": req.header("Host"),
                "prefix": f"/r/{server_id}" if prefix is None else prefix,
            },
        )
        download = relayed_download(req.method, rest, answer["status"])
        headers = relay_answer_headers(rest, answer["headers"], download)
        origins = self.own_origins(req, server_id)
        headers = [
            (k, v) for k, v in headers if k.lower() != "location" or relay_location_ok(v, origins)
        ]
        return answer["status"], headers, answer["body"]

    def own_origins(self, req: RelayRequest, server_id: str) -> set:
        """Return the origins a forwarded answer's Location may name: the one the request
        came to (as the client named it, and as the relay's SERVICE_PUBLIC_URL or trusted
        proxy names it), and, with a domain, that server's own origin."""
        scheme = urllib.parse.urlsplit(self.base_url(req)).scheme
        found = {url_origin(self.base_url(req)), url_origin(f"{scheme}://{req.header('Host')}")}
        if self.domain:
            found.add(url_origin(self.server_origin(req, server_id)))
        return found - {None}


RELAY_PASSED_HEADERS = frozenset(
    "cache-control vary etag last-modified location retry-after www-authenticate content-range "
    "accept-ranges allow dav lock-token x-request-id content-disposition".split()
)


def url_origin(url: str):
    """Return (scheme, host, port) of an absolute http(s) URL with no userinfo, else None."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname or "@" in parts.netloc:
        return None
    return parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80)


def relay_location_ok(location: str, origins: set) -> bool:
    """Return whether a server's Location may pass the relay (S5: no open redirect).

    It passes when relative (no scheme, no authority: a path, `?query` or `#fragment`)
    or absolute on one of `origins`. Anything a browser could read as another host does
    not: `//host`, a backslash (`/\\host`), whitespace or control bytes, userinfo, a
    scheme other than http(s).
    """
    loc = location.strip(" \t")
    if not loc or "\\" in loc or re.search(r"[\x00-\x20\x7f]", loc):
        return False
    try:
        parts = urllib.parse.urlsplit(loc)
    except ValueError:
        return False
    if not parts.scheme and not parts.netloc and not loc.startswith("//"):
        return True
    return url_origin(loc) in origins


def relay_answer_headers(path: str, headers: list, download: bool = False) -> list:
    """Return a forwarded answer's headers: a type the route may answer, an allowlist of the
    rest, nosniff and a sandbox (docs/design.md: relay).

    A registered server cannot publish a page, script or cookies on the relay's origins:
    its Content-Type is kept only when its media type is exactly one the route answers
    (JSON; XML under /dav/; a zip for export.zip; for file bytes (`download`) an image,
    audio, video, PDF or plain text, else application/octet-stream, always as an
    attachment), and only the headers a client of the API needs pass: Content-Encoding
    only as `gzip` on an API answer (the server's, for the client's Accept-Encoding, which
    the relay forwards; docs/api.md: Compression), never on file bytes.
    """
    given = next((v for k, v in headers if k.lower() == "content-type"), "")
    keep = [
        (name, value)
        for name, value in headers
        if (
            name.lower() in RELAY_PASSED_HEADERS
            or (name.lower() == "content-encoding" and value == "gzip" and not download)
        )
        and _TOKEN_CHARS_RE.match(name)
        and _header_value_ok(value)
    ]
    ctype = _relayed_type(path, given, download)
    if download:
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", path.rsplit("/", 1)[-1])[:100] or "download"
        keep = [(k, v) for k, v in keep if k.lower() != "content-disposition"]
        keep.append(("Content-Disposition", f'attachment; filename="{name}"'))
    return [
        ("Content-Type", ctype),
        ("X-Content-Type-Options", "nosniff"),
        ("Content-Security-Policy", RELAY_ANSWER_CSP),
        *keep,
    ]


def _header_value_ok(value: str) -> bool:
    """Return whether a header value may go out on the wire as it is: no control bytes,
    nothing outside Latin-1 (HTTP/1.1's octets; a registered server's `é` or emoji would
    not encode, and its answer would be lost with the connection)."""
    return not re.search(r"[\x00-\x1f\x7f]", value) and all(ord(c) < 256 for c in value)


def _relayed_type(path: str, given: str, download: bool) -> str:
    """Return the Content-Type a forwarded answer goes out with (see relay_answer_headers)."""
    media = given.split(";")[0].strip().lower()
    if download:
        return _download_type(media)
    if media in ("application/xml", "text/xml") and re.match(r"^/dav(/|$)", path):
        return f"{media}; charset=utf-8"
    if media == "application/zip" and path == f"{API}/export.zip":
        return media
    if media == "text/calendar" and re.match(r"^/ics/[^/]+\.ics$", path):
        return "text/calendar; charset=utf-8"  # a calendar feed
    return JSON_TYPE


def _download_type(media: str) -> str:
    """Return the type file bytes go out as through a relay: an image, audio, video, PDF or
    plain text keeps its own (never one a browser runs as a page), else octet-stream."""
    passive = media.split("/")[0] in ("image", "audio", "video") or media in (
        "application/pdf",
        "text/plain",
        "text/calendar",  # a task over CalDAV
    )
    safe = (
        passive and media not in ACTIVE_TYPES and re.fullmatch(r"[a-z0-9.+-]+/[a-z0-9.+-]+", media)
    )
    return media if safe else "application/octet-stream"


def relayed_download(method: str, path: str, status: int) -> bool:
    """Return whether a forwarded answer is file bytes (not an API answer): an attachment,
    a shared note's attachment, or a file under /dav/ (not a collection's XML)."""
    return (
        method in ("GET", "HEAD")
        and 200 <= status < 300
        and (
            path.startswith(f"{API}/attachments/")
            or re.match(rf"^{API}/shared/[^/]+/attachments/", path) is not None
            or (re.match(r"^/dav/.*[^/]$", path) is not None)
        )
    )


def _private_path(path: str) -> str:
    """Return a path for the relay's log: the server id and what follows /api/v1 left out."""
    m = re.match(r"^/r/[^/]+/api/v1(/[^/]*)?", path)
    if m:
        return f"/r/…/api/v1{m.group(1) or ''}…"
    if path.startswith(("/ics/", "/s/")):  # a server's own origin: the secret's last 4
        return _SECRET_PATH_RE.sub(r"\1…\2", path)
    return re.sub(r"/r/[^/]+(/s/)?.*", lambda m: f"/r/…{m.group(1) or '/'}…", path)


_SECRET_PATH_RE = re.compile(r"^(/ics/|/s/)[^/]*?([^/]{0,4}?)(?:\.ics)?$")
