"""The relay's TLS port: ClientHellos read for their name, spliced to servers that dial in.

With SERVICE_RELAY_TLS=passthrough the relay listens on SERVICE_RELAY_TLS_PORT (which may
be its HTTP port: a TLS connection starts with byte 22, an HTTP request with a letter).
For each connection it peeks at the ClientHello, never decrypting anything, and reads
the name the client asks for (SNI):

    <id>.D, server <id> registered with passthrough: true   spliced, byte for byte
    D (and <id>.D of another server, with a *.D cert)        TLS ends here: the relay's
                                                             own pages and routes (22)
    anything else: no SNI, another domain, an IP literal     closed

A splice: the relay gives the server a one-use token in its long-poll (`{kind: "dial",
token, client}`); the server opens a data connection to the relay (`POST
/relay/v1/dial/<id>/<token>`, `Upgrade: notesvc-splice`); the relay answers `101`, writes
a PROXY v2 header (the client's address) and the client's bytes so far, and from then on
copies bytes both ways and reads none of them. No dial within DIAL_SECONDS: closed.

Everything waiting is bounded: connections whose ClientHello is not in yet (per client
address and in all, the oldest closed first, each at most HELLO_SECONDS), dials per server
(the oldest client closed first), and splices per server; a splice with no byte either
way for SPLICE_IDLE_SECONDS is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import socket
import ssl
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

from notesvc.boot import log
from notesvc.helpers import is_trusted_proxy, log_safe
from notesvc.passthrough.wire import (
    MAX_HELLO_RAW,
    HelloError,
    certificate_names,
    client_hello_sni,
    parse_proxy_header,
    proxy_v2_header,
    socket_address,
)
from notesvc.settings import Config

HELLO_SECONDS = 10.0  # a whole ClientHello (and a trusted proxy's PROXY header) within this
DIAL_SECONDS = 10.0  # a server dials within this, or its client's connection is closed
PENDING_MAX = 4096  # connections whose ClientHello is not in yet, in all
DIALS_PER_SERVER = 64  # clients waiting for one server's dial (the oldest closed first)
SPLICES_PER_SERVER = 256  # open splices to one server
SPLICE_IDLE_SECONDS = 300.0  # a splice with no byte either way this long is closed
SPLICE_HIGH_WATER = 256 * 1024  # bytes buffered toward one side before the other pauses
SPLICE_UPGRADE = "notesvc-splice"


@dataclasses.dataclass
class Dial:
    """A client connection waiting for its server to dial in."""

    server_id: str
    sock: socket.socket
    hello: bytes  # the client's bytes so far (its ClientHello)
    client: tuple  # (address, port) of the client, as the PROXY header says it
    local: tuple  # (address, port) it connected to
    until: float
    done: asyncio.Future


class _Pipe(asyncio.Protocol):
    """One side of a splice: what it reads goes to the other side's transport."""

    def __init__(self, splice: _Splice):
        self.splice = splice
        self.transport: asyncio.Transport | None = None
        self.other: _Pipe | None = None
        self.early = b""  # read before the other side had its transport

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.set_write_buffer_limits(high=SPLICE_HIGH_WATER)

    def data_received(self, data: bytes) -> None:
        self.splice.last = time.monotonic()
        other = self.other.transport if self.other is not None else None
        if other is None:
            self.early += data
        elif not other.is_closing():
            other.write(data)

    def eof_received(self) -> bool:
        other = self.other.transport if self.other is not None else None
        if other is not None and not other.is_closing() and other.can_write_eof():
            other.write_eof()  # a half-close passes through (TLS's close_notify came first)
            return True
        return False

    def connection_lost(self, exc) -> None:
        self.splice.close()

    def pause_writing(self) -> None:  # our side's buffer is full: stop reading the other
        other = self.other.transport if self.other is not None else None
        if other is not None and not other.is_closing():
            other.pause_reading()

    def resume_writing(self) -> None:
        other = self.other.transport if self.other is not None else None
        if other is not None and not other.is_closing():
            other.resume_reading()


class _Splice:
    """A client's connection and its server's data connection, joined."""

    def __init__(self, front: TlsFront, server_id: str):
        self.front, self.server_id = front, server_id
        self.client, self.server = _Pipe(self), _Pipe(self)
        self.client.other, self.server.other = self.server, self.client
        self.last = time.monotonic()
        self.closed = False
        self.writer: Any = None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if log.isEnabledFor(10):
            log.debug("relay: a splice to %s closed", self.server_id)
        for pipe in (self.client, self.server):
            if pipe.transport is not None and not pipe.transport.is_closing():
                pipe.transport.close()  # (what is buffered still goes out first)
        self.front.splices.get(self.server_id, {}).pop(self, None)
        if not self.front.splices.get(self.server_id, True):
            self.front.splices.pop(self.server_id, None)


class TlsFront:
    """The relay's TLS port (see this module's docstring).

    `hub` is the relay's RelayHub: `splices_to(server_id)` says whether a server is in
    passthrough mode and `dial(server_id, message)` puts a dial in its long-poll.
    `serve_http(reader, writer, peer, scheme)` serves a connection as the relay's HTTP.
    """

    def __init__(self, config: Config, hub: Any, serve_http: Callable):
        self.config, self.hub, self.serve_http = config, hub, serve_http
        self.domain = config.relay_domain
        self.listener: socket.socket | None = None
        self.shared = False  # one port with the HTTP server
        self.port = 0
        self.pending: OrderedDict = OrderedDict()  # socket -> (client address, task)
        self.pending_by_addr: dict = {}  # address -> {socket: None}
        self.dials: dict = {}  # token -> Dial
        self.splices: dict = {}  # server id -> {_Splice: None}
        self.counts = {"spliced": 0, "terminated": 0, "closed": 0, "dialsMissed": 0}
        self._tasks: set = set()
        self._context: ssl.SSLContext | None = None
        self._wildcard = False
        self._cert_seen: tuple = ()  # (mtime of cert, of key) the context was made from
        self._cert_checked = 0.0
        self._rcvlowat = hasattr(socket, "SO_RCVLOWAT")

    # -- listening -----------------------------------------------------------------------

    async def start(self, shared: bool) -> int:
        """Listen on SERVICE_RELAY_TLS_PORT; `shared`: it is the HTTP port too (this
        listener then serves the HTTP connections as well). Return the port."""
        self.shared = shared
        self.context()  # said at start when the certificate cannot be read
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        port = self.config.port if shared else self.config.relay_tls_port
        try:
            sock.bind((self.config.host, port))
            sock.listen(1024)
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        self.listener, self.port = sock, sock.getsockname()[1]
        self._keep(asyncio.get_running_loop().create_task(self._accept()))
        self._keep(asyncio.get_running_loop().create_task(self._sweep()))
        return self.port

    def close(self) -> None:
        if self.listener is not None:
            with contextlib.suppress(OSError):
                self.listener.close()
        for task in list(self._tasks):
            task.cancel()
        for splices in list(self.splices.values()):
            for splice in list(splices):
                splice.close()

    def _keep(self, task: asyncio.Task) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _addr = await loop.sock_accept(self.listener)
            except OSError as e:  # out of descriptors: a moment, then on
                if self.listener is None or self.listener.fileno() < 0:
                    return
                log.warning("relay: accepting on the TLS port failed: %s", e)
                await asyncio.sleep(0.1)
                continue
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = loop.create_task(self._handle(sock))
            self._admit(sock, task)

    def _admit(self, sock: socket.socket, task: asyncio.Task) -> None:
        """Count a connection whose ClientHello is not in yet; close the oldest of its
        address beyond the cap per address, and the oldest of all beyond PENDING_MAX."""
        addr = socket_address(sock, True)[0]
        mine = self.pending_by_addr.setdefault(addr, {})
        mine[sock] = None
        self.pending[sock] = (addr, task)
        if len(mine) > self.config.relay_max_idle_per_address:
            self._drop_pending(next(iter(mine)))
        if len(self.pending) > PENDING_MAX:
            self._drop_pending(next(iter(self.pending)))

    def _drop_pending(self, sock: socket.socket) -> None:
        entry = self._settled(sock)
        if entry is not None:
            entry[1].cancel()
            self.counts["closed"] += 1

    def _settled(self, sock: socket.socket):
        """Stop counting a connection as waiting for its ClientHello."""
        entry = self.pending.pop(sock, None)
        if entry is not None:
            mine = self.pending_by_addr.get(entry[0], {})
            mine.pop(sock, None)
            if not mine:
                self.pending_by_addr.pop(entry[0], None)
        return entry

    async def _sweep(self) -> None:
        """Close splices idle for SPLICE_IDLE_SECONDS and dials past their time."""
        while True:
            await asyncio.sleep(min(10.0, SPLICE_IDLE_SECONDS / 4))
            now = time.monotonic()
            for splices in list(self.splices.values()):
                for splice in [s for s in splices if now - s.last > SPLICE_IDLE_SECONDS]:
                    splice.close()
            for token in [t for t, d in self.dials.items() if d.until < now]:
                self._miss(self.dials.pop(token))

    # -- a connection ------------------------------------------------------------------------

    async def _handle(self, sock: socket.socket) -> None:
        kept = False
        try:
            kept = await self._route(sock)
        except (OSError, asyncio.TimeoutError, HelloError, ValueError) as e:
            if log.isEnabledFor(10):
                log.debug("relay: a TLS connection closed: %s", log_safe(str(e), 200))
        except asyncio.CancelledError:
            pass
        except Exception:
            log.exception("relay: a TLS connection failed")
        finally:
            self._settled(sock)
            if not kept:
                self.counts["closed"] += 1
                with contextlib.suppress(OSError):
                    sock.close()

    async def _route(self, sock: socket.socket) -> bool:
        """Read what a connection starts with and send it its way; return whether it was
        kept (handed on) rather than closed."""
        deadline = time.monotonic() + HELLO_SECONDS
        client, local = socket_address(sock, True), socket_address(sock, False)
        data = await self._peek(sock, b"", deadline)
        if data[:1] in (b"P", b"\r") and is_trusted_proxy(self.config, client[0]):
            while True:  # a trusted proxy's PROXY header (nginx stream: proxy_protocol on)
                try:
                    found = parse_proxy_header(data)
                except ValueError:
                    break  # none: an HTTP request from the proxy (PUT, POST...)
                if found is not None:
                    size, said = found
                    _recv_exactly(sock, size)
                    client = said or client
                    data = await self._peek(sock, b"", deadline)
                    break
                data = await self._peek(sock, data, deadline)
        if data[:1] != b"\x16":
            if self.shared and data[:1].isalpha():  # an HTTP request on the shared port
                self._settled(sock)
                await self._http(sock, client, None)
                return True
            raise HelloError("not TLS")
        while True:
            found = client_hello_sni(data)
            if found is not None:
                break
            data = await self._peek(sock, data, deadline)
        size, name = found
        server_id = self._server_of(name)
        if server_id and self.hub.splices_to(server_id):
            self._settled(sock)
            return await self._splice(sock, server_id, _recv_exactly(sock, size), client, local)
        ctx = self.context()
        if ctx is not None and (name == self.domain or (server_id and self._wildcard)):
            self._settled(sock)
            await self._http(sock, client, ctx)
            return True
        raise HelloError(f"no server here for the name {name}")

    def _server_of(self, name: str) -> str:
        sid, dot, rest = name.partition(".")
        if dot and rest == self.domain and len(sid) == 20 and sid.isalnum():
            return sid
        return ""

    async def _peek(self, sock: socket.socket, seen: bytes, deadline: float) -> bytes:
        """Return the bytes waiting on a socket, without taking them, once there are more
        than `seen`; raise OSError at its end, TimeoutError past the deadline."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                data = sock.recv(MAX_HELLO_RAW, socket.MSG_PEEK)
            except BlockingIOError:
                data = None
            if data == b"":
                raise OSError("closed before its ClientHello")
            if data is not None and len(data) > len(seen):
                return data
            if data is not None and len(data) >= MAX_HELLO_RAW:
                raise HelloError("the ClientHello is spread over too many bytes")
            left = deadline - time.monotonic()
            if left <= 0:
                raise asyncio.TimeoutError()
            waiting = len(data or b"")
            # wake only for more bytes than are waiting now (SO_RCVLOWAT), not for those
            lowat = self._rcvlowat and waiting > 0
            if lowat:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, waiting + 1)
                except OSError:
                    self._rcvlowat = lowat = False
            ready = loop.create_future()
            fd = sock.fileno()
            loop.add_reader(fd, lambda f=ready: f.done() or f.set_result(None))
            try:
                if waiting and not lowat:  # (no SO_RCVLOWAT here: look again in a moment)
                    await asyncio.sleep(0.02)
                else:
                    await asyncio.wait_for(ready, left)
            finally:
                loop.remove_reader(fd)
                if lowat:
                    with contextlib.suppress(OSError):
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)

    async def _http(self, sock: socket.socket, client: tuple, ctx: ssl.SSLContext | None):
        """Serve a connection as the relay's HTTP (TLS ended here when `ctx`)."""
        loop = asyncio.get_running_loop()
        scheme = "https" if ctx is not None else "http"

        def factory() -> asyncio.StreamReaderProtocol:
            reader = asyncio.StreamReader(limit=16384)
            return asyncio.StreamReaderProtocol(
                reader, lambda r, w: self.serve_http(r, w, client[0], scheme)
            )

        if ctx is not None:
            self.counts["terminated"] += 1
            await loop.connect_accepted_socket(
                factory, sock, ssl=ctx, ssl_handshake_timeout=HELLO_SECONDS
            )
        else:
            await loop.connect_accepted_socket(factory, sock)

    # -- splices -----------------------------------------------------------------------------

    async def _splice(
        self, sock: socket.socket, server_id: str, hello: bytes, client: tuple, local: tuple
    ) -> bool:
        """Ask a server to dial in for this connection, and wait for it."""
        waiting = [d for d in self.dials.values() if d.server_id == server_id]
        if len(waiting) >= DIALS_PER_SERVER:
            oldest = min(waiting, key=lambda d: d.until)
            self._miss(oldest)
        if len(self.splices.get(server_id, ())) >= SPLICES_PER_SERVER:
            raise HelloError("that server has its most splices open")
        token = secrets.token_urlsafe(24)
        loop = asyncio.get_running_loop()
        until = time.monotonic() + DIAL_SECONDS
        dial = Dial(server_id, sock, hello, client, local, until, loop.create_future())
        self.dials[token] = dial
        queued = self.hub.dial(server_id, {"kind": "dial", "token": token, "client": client[0]})
        if not queued:
            self.dials.pop(token, None)
            raise HelloError("that server is not connected, or its queue is full")
        if isinstance(queued, str) and queued in self.dials:  # it took an older one's place
            self._miss(self.dials[queued])
        try:
            return await asyncio.wait_for(dial.done, DIAL_SECONDS)
        except asyncio.TimeoutError:
            self.counts["dialsMissed"] += 1
            return False
        finally:
            self.dials.pop(token, None)

    def _miss(self, dial: Dial) -> None:
        for token, d in list(self.dials.items()):
            if d is dial:
                del self.dials[token]
        if not dial.done.done():
            dial.done.set_result(False)  # its task closes the client's connection

    def take_dial(self, server_id: str, token: str) -> Dial | None:
        """Return the dial a token stands for (once: it is used up), or None for a wrong,
        used or expired one."""
        dial = self.dials.get(token)
        if dial is None or dial.server_id != server_id or dial.until < time.monotonic():
            return None
        del self.dials[token]
        if dial.done.done():
            return None
        return dial

    async def join(self, dial: Dial, writer: asyncio.StreamWriter, early: bytes) -> None:
        """Splice a dial's client to the data connection its server opened (`writer`'s,
        just answered 101; `early`: bytes the server sent after its request)."""
        splice = _Splice(self, dial.server_id)
        splice.writer = writer  # (kept: a StreamWriter closes its transport when collected)
        transport = writer.transport
        self.splices.setdefault(dial.server_id, {})[splice] = None
        transport.set_protocol(splice.server)
        splice.server.connection_made(transport)
        transport.write(proxy_v2_header(dial.client, dial.local) + dial.hello)
        dial.done.set_result(True)  # the client's socket is the splice's from here
        loop = asyncio.get_running_loop()
        try:
            await loop.connect_accepted_socket(lambda: splice.client, dial.sock)
        except OSError:
            splice.close()
            return
        self.counts["spliced"] += 1
        early += splice.server.early  # what the server sent before the client's side was up
        if early:
            splice.client.transport.write(early)

    # -- the relay's own certificate ---------------------------------------------------------

    def context(self) -> ssl.SSLContext | None:
        """Return the SSLContext of the relay's own certificate for D (SERVICE_RELAY_TLS_CERT
        and _KEY), made again when the files change (a renewal); None without one."""
        cert, key = self.config.relay_tls_cert, self.config.relay_tls_key
        if not cert:
            return None
        now = time.monotonic()
        if self._context is not None and now - self._cert_checked < 60:
            return self._context
        self._cert_checked = now
        try:
            seen = (Path(cert).stat().st_mtime, Path(key or cert).stat().st_mtime)
            if seen == self._cert_seen and self._context is not None:
                return self._context
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            ctx.load_cert_chain(cert, key or None)
            ctx.set_alpn_protocols(["http/1.1"])
            names = certificate_names(Path(cert).read_text("ascii", "replace"))
        except (OSError, ssl.SSLError) as e:
            log.warning("relay: its certificate %s cannot be used: %s", cert, e)
            return self._context
        self._context, self._cert_seen = ctx, seen
        self._wildcard = f"*.{self.domain}" in names
        if self.domain not in names and not self._wildcard:
            domain = self.domain
            log.warning("relay: its certificate %s names neither %s nor *.%s", cert, domain, domain)
        return ctx

    def stats(self) -> dict:
        return {
            "waitingForHello": len(self.pending),
            "waitingForDial": len(self.dials),
            "splices": sum(len(s) for s in self.splices.values()),
            **self.counts,
        }


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    """Take `size` bytes already waiting on a socket (they were peeked at)."""
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise OSError("closed")
        data += chunk
    return data
