"""The home server's side of passthrough: dials, TLS in process, spliced waitress channels.

When its relay offers passthrough (`/relay/v1/info`), a server with SERVICE_RELAY_PASSTHROUGH
=auto gets a certificate for `<serverId>.<domain>` (CertKeeper) and registers with
`passthrough: true`. For each client that asks the relay for that name, the relay puts a
dial in the server's long-poll; the server opens a data connection to its relay (the
scheme, host and port of SERVICE_RELAY_URL, never a name learned from the relay), reads
the PROXY v2 header the relay writes, and does the TLS handshake itself, on a thread of
its own. The plaintext goes to waitress as a channel of its own: one end of a
`socket.socketpair()`, the other end pumped to and from the TLS connection by that
thread. The channel's address is the client's (from the PROXY header), and its requests
are relayed ones (`notesvc.relayed`: never setup, their own lockout bucket) that come by
HTTPS on the server's own origin there; answers stream as on a direct connection.

At most SPLICED_MAX spliced connections at once; they count toward waitress's connection
limit and its idle time-out like any other. When all are taken, the oldest one still in
its handshake makes room (a flood of unfinished handshakes cannot keep the owner out).
"""

from __future__ import annotations

import contextlib
import functools
import selectors
import socket
import ssl
import threading
import time
import urllib.parse
from typing import Any, Callable, ClassVar

from notesvc.boot import __version__, log
from notesvc.helpers import iso, log_safe, utcnow
from notesvc.passthrough.acme import (
    LETS_ENCRYPT,
    AcmeError,
    CertKeeper,
    TlsFolder,
    has_cryptography,
)
from notesvc.passthrough.front import SPLICE_UPGRADE
from notesvc.passthrough.wire import parse_proxy_header

SPLICED_MAX = 64  # spliced connections at once
HANDSHAKE_SECONDS = 10.0  # a client's TLS handshake, from the dial on
PUMP_HIGH_WATER = 256 * 1024  # bytes held toward one side before the other is not read


@functools.lru_cache(maxsize=4)
def spliced_channel_class(base: type) -> type:
    """Return a subclass of waitress's channel class whose requests carry the spliced
    connection's environ (`notesvc_environ`, set on the channel)."""

    class SplicedTask(base.task_class):
        def get_environment(self):
            environ = super().get_environment()
            environ.update(self.channel.notesvc_environ)
            return environ

    class SplicedChannel(base):
        task_class = SplicedTask
        notesvc_environ: ClassVar[dict] = {}  # (each channel gets its own at once)

    return SplicedChannel


class SplicedConnection:
    """One client's connection through the relay: dial, handshake, pump (its own thread)."""

    def __init__(self, owner: SpliceServer, token: str):
        self.owner, self.token = owner, token
        self.started = time.monotonic()
        self.handshaken = False
        self.link: socket.socket | None = None
        self.client = ("", 0)
        self._aborted = False

    def abort(self) -> None:
        """Close it from another thread (to make room)."""
        self._aborted = True
        link = self.link
        if link is not None:
            with contextlib.suppress(OSError):
                link.shutdown(socket.SHUT_RDWR)

    def run(self) -> None:
        try:
            self._run()
        except (OSError, ssl.SSLError, ValueError) as e:
            if not self._aborted:
                log.info("passthrough: a spliced connection ended: %s", log_safe(str(e), 200))
        except Exception:
            log.exception("passthrough: a spliced connection failed")
        finally:
            if self.link is not None:
                with contextlib.suppress(OSError):
                    self.link.close()
            self.owner.forget(self)

    def _run(self) -> None:
        deadline = self.started + HANDSHAKE_SECONDS
        link, rest = self.owner.open_dial(self.token, deadline)
        self.link = link
        if self._aborted:
            return
        while True:  # the PROXY v2 header the relay writes before the client's bytes
            found = parse_proxy_header(rest)
            if found is not None:
                break
            rest += _recv_by(link, deadline)
        size, client = found
        self.client = client or ("0.0.0.0", 0)
        context = self.owner.context()
        if context is None:
            raise ValueError("no certificate in hand")
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = context.wrap_bio(incoming, outgoing, server_side=True)
        incoming.write(rest[size:])
        while True:
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                pending = outgoing.read()
                if pending:
                    link.settimeout(max(0.01, deadline - time.monotonic()))
                    link.sendall(pending)
                incoming.write(_recv_by(link, deadline))
        self.handshaken = True
        ours, theirs = socket.socketpair()
        try:
            self.owner.hand_to_waitress(theirs, self.client)
        except Exception:
            ours.close()
            theirs.close()
            raise
        try:
            _pump(link, ours, tls, incoming, outgoing, lambda: self._aborted)
        finally:
            ours.close()
            log.debug("passthrough: a spliced connection from %s closed", self.client[0])


def _recv_by(sock: socket.socket, deadline: float) -> bytes:
    left = deadline - time.monotonic()
    if left <= 0:
        raise OSError("the handshake took too long")
    sock.settimeout(left)
    data = sock.recv(65536)
    if not data:
        raise OSError("the relay closed the data connection")
    return data


def _pump(link, pair, tls, incoming, outgoing, aborted: Callable) -> None:
    """Move bytes until waitress closes its end: link (TLS records) <-> pair (plaintext).

    The client's end (TLS close_notify, or the connection's) is passed on as the end of
    the pair's stream, so waitress closes the channel; waitress's close is passed on as
    close_notify, then the link is closed."""
    link.setblocking(False)
    pair.setblocking(False)
    to_pair, to_link = bytearray(), bytearray(outgoing.read())
    link_open, shut = True, False
    sel = selectors.DefaultSelector()
    interest: dict = {}
    read, write = selectors.EVENT_READ, selectors.EVENT_WRITE

    def want(sock, events: int) -> None:
        had = interest.get(sock, 0)
        if events == had:
            return
        if not events:
            sel.unregister(sock)
        elif had:
            sel.modify(sock, events)
        else:
            sel.register(sock, events)
        interest[sock] = events

    def decrypt() -> None:
        nonlocal link_open
        while True:
            try:
                to_pair.extend(tls.read(65536))
            except ssl.SSLWantReadError:
                break
            except ssl.SSLZeroReturnError:  # the client's close_notify
                link_open = False
                break
        to_link.extend(outgoing.read())  # (TLS 1.3 tickets, key updates)

    def from_link() -> None:
        nonlocal link_open
        while link_open:
            try:
                data = link.recv(65536)
            except (BlockingIOError, ssl.SSLWantReadError):
                return
            if not data:
                link_open = False
                return
            incoming.write(data)
            decrypt()
            if not getattr(link, "pending", lambda: 0)():  # (an https link's own buffer)
                return

    decrypt()  # what came with the client's last handshake message (its first request)
    try:
        while not aborted():
            if not link_open and not to_pair and not shut:
                pair.shutdown(socket.SHUT_WR)  # waitress reads the end and closes
                shut = True
            want(link, (read if link_open and len(to_pair) < PUMP_HIGH_WATER else 0)
                 | (write if to_link else 0))  # fmt: skip
            want(pair, (read if len(to_link) < PUMP_HIGH_WATER else 0)
                 | (write if to_pair and not shut else 0))  # fmt: skip
            for key, events in sel.select(1.0):
                if key.fileobj is link:
                    if events & read:
                        from_link()
                    if events & write and to_link:
                        with contextlib.suppress(BlockingIOError, ssl.SSLWantWriteError):
                            del to_link[: link.send(to_link)]
                    continue
                if events & write and to_pair:
                    with contextlib.suppress(BlockingIOError):
                        del to_pair[: pair.send(to_pair)]
                if events & read:
                    try:
                        data = pair.recv(65536)
                    except BlockingIOError:
                        continue
                    if not data:  # waitress closed the channel: close_notify, then done
                        with contextlib.suppress(ssl.SSLError):
                            tls.unwrap()
                        to_link.extend(outgoing.read())
                        _flush(link, to_link)
                        return
                    tls.write(data)
                    to_link.extend(outgoing.read())
    finally:
        sel.close()


def _flush(link, data: bytearray) -> None:
    """Send what is left toward the client, for a second at most."""
    if not data:
        return
    link.settimeout(1.0)
    with contextlib.suppress(OSError):
        link.sendall(bytes(data))


class SpliceServer:
    """Dials in for the relay's clients and serves them through waitress (see the module
    docstring). `listener`: waitress's listening server (its map, adjustments, trigger)."""

    def __init__(self, relay_url: str, listener: Any, token: Callable, server_id: Callable):
        self.relay_url, self.listener = relay_url, listener
        self.relay_token, self.server_id = token, server_id
        self.origin = ""
        self._context: ssl.SSLContext | None = None
        self._lock = threading.Lock()
        self.live: list = []  # SplicedConnection, oldest first
        self.refused = 0
        self.dialed = 0  # dials answered (a data connection opened)
        self.served = 0  # of them, handshakes done (a channel handed to waitress)
        self._refused_said = 0.0

    def context(self) -> ssl.SSLContext | None:
        return self._context

    def use(self, context: ssl.SSLContext | None, origin: str) -> None:
        """Serve with this certificate (None: none in hand) on this origin from now on."""
        self._context, self.origin = context, origin

    def dial(self, message: dict) -> None:
        """Dial in for a client the relay holds (a poll's `{kind: dial, token, client}`)."""
        token = message.get("token")
        if not isinstance(token, str) or not 16 <= len(token) <= 128 or self._context is None:
            return
        conn = self._room()
        if conn is None:
            self.refused += 1
            now = time.monotonic()
            if now - self._refused_said > 60:
                self._refused_said = now
                log.warning(
                    "passthrough: %d spliced connections are open, all past their handshake: "
                    "a client was not served (the relay closes it)",
                    SPLICED_MAX,
                )
            return
        conn.token = token
        self.dialed += 1
        threading.Thread(target=conn.run, name="notesvc-spliced", daemon=True).start()

    def _room(self) -> SplicedConnection | None:
        """Return a new connection counted in `live`, making room by closing the oldest
        one still in its handshake when SPLICED_MAX are open (None: all are past it)."""
        with self._lock:
            if len(self.live) >= SPLICED_MAX:
                waiting = [c for c in self.live if not c.handshaken]
                if not waiting:
                    return None
                self.live.remove(waiting[0])
                waiting[0].abort()
            conn = SplicedConnection(self, "")
            self.live.append(conn)
            return conn

    def forget(self, conn: SplicedConnection) -> None:
        with self._lock:
            if conn in self.live:
                self.live.remove(conn)

    def stop(self) -> None:
        with self._lock:
            live = list(self.live)
        for conn in live:
            conn.abort()

    def open_dial(self, token: str, deadline: float) -> tuple:
        """Open the data connection and ask the relay for the splice; return (socket,
        bytes already read after the 101)."""
        parts = urllib.parse.urlsplit(self.relay_url)
        https = parts.scheme == "https"
        port = parts.port or (443 if https else 80)
        sock = socket.create_connection(
            (parts.hostname, port), timeout=max(0.5, deadline - time.monotonic())
        )
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if https:
            try:
                sock = ssl.create_default_context().wrap_socket(
                    sock, server_hostname=parts.hostname
                )
            except (OSError, ssl.SSLError):
                sock.close()
                raise
        path = f"{parts.path.rstrip('/')}/relay/v1/dial/{self.server_id()}/{token}"
        request = (
            f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            f"User-Agent: notesvc/{__version__}\r\nX-Relay-Token: {self.relay_token()}\r\n"
            f"Connection: Upgrade\r\nUpgrade: {SPLICE_UPGRADE}\r\nContent-Length: 0\r\n\r\n"
        )
        try:
            sock.sendall(request.encode("latin-1"))
            head = b""
            while b"\r\n\r\n" not in head:
                if len(head) > 16384:
                    raise ValueError("the relay's answer to a dial has no end")
                head += _recv_by(sock, deadline)
        except BaseException:
            sock.close()
            raise
        head, _, rest = head.partition(b"\r\n\r\n")
        status = head.split(b"\r\n", 1)[0]
        if not status.startswith(b"HTTP/1.1 101"):
            sock.close()
            raise ValueError(f"the relay refused the dial: {status.decode('latin-1')[:80]}")
        return sock, rest

    def hand_to_waitress(self, sock: socket.socket, client: tuple) -> None:
        """Give waitress one end of the socket pair as a channel of its own (made on its
        own thread: the trigger runs it in the loop that owns the map)."""
        listener = self.listener
        cls = spliced_channel_class(listener.channel_class)
        environ = {
            "wsgi.url_scheme": "https",
            "HTTPS": "on",
            "notesvc.relayed": True,
            "notesvc.spliced": True,
            "notesvc.relay_origin": self.origin,
        }

        def make() -> None:
            try:
                channel = cls(listener, sock, (client[0], client[1]), listener.adj, listener._map)
            except OSError:
                sock.close()
                return
            channel.notesvc_environ = environ

        listener.trigger.pull_trigger(make)
        self.served += 1

    def status(self) -> dict:
        with self._lock:
            live = list(self.live)
        return {
            "open": len(live),
            "handshaking": sum(1 for c in live if not c.handshaken),
            "max": SPLICED_MAX,
            "dialed": self.dialed,
            "served": self.served,
            "refused": self.refused,
        }


# -- the mode: certificate, registration, status ----------------------------------------------


class TerminatedCount:
    """Requests that came through a terminating path of the relay (its long-poll: the
    path-based /r/<id> and per-server origins), per UTC day, the last 7 days kept."""

    def __init__(self):
        self.days: dict = {}
        self._lock = threading.Lock()

    def add(self) -> None:
        day = utcnow().strftime("%Y-%m-%d")
        with self._lock:
            self.days[day] = self.days.get(day, 0) + 1
            if len(self.days) > 7:
                for old in sorted(self.days)[:-7]:
                    del self.days[old]

    def last_week(self) -> int:
        with self._lock:
            return sum(self.days.values())


class Passthrough:
    """Passthrough for one server's relay link: its certificate, its splices, its state.

    `call(method, path, body)` is the relay link's (RelayClient._call); `register()`
    registers again (a certificate came or went).
    """

    def __init__(self, svc: Any, listener: Any, call: Callable, register: Callable):
        self.svc, self.call, self.register = svc, call, register
        cfg = svc.config
        self.offered = False
        self.active = False  # registered with passthrough: true, and the relay said so
        self.origin = ""
        self.reason = ""  # why it is off, when it is
        self.keeper: CertKeeper | None = None
        self.splicer: SpliceServer | None = None
        self.terminated = TerminatedCount()
        if not has_cryptography():
            self.reason = (
                "passthrough needs the cryptography package (sudo apt install "
                "python3-cryptography, or pip install cryptography)"
            )
        elif listener is None:
            self.reason = "passthrough needs waitress (sudo apt install python3-waitress)"
        else:
            self.splicer = SpliceServer(
                cfg.relay_url,
                listener,
                lambda: svc.state.read()["relayToken"],
                lambda: svc.state.read()["serverId"],
            )
            self.keeper = CertKeeper(
                TlsFolder(cfg.state_dir),
                cfg.acme_directory or LETS_ENCRYPT,
                cfg.acme_ca_file,
                cfg.acme_email,
                self._publish,
                self._withdraw,
                self._changed,
            )

    def wanted(self) -> bool:
        """Return whether to register with `passthrough: true`: a certificate in hand."""
        return self.keeper is not None and self.keeper.context() is not None

    def learn(self, info: dict, server_id: str) -> str:
        """Take what the relay said of itself (`/relay/v1/info`); return this server's
        passthrough origin when it is in use, else ""."""
        offered = bool(info.get("passthrough")) and bool(info.get("domain"))
        if offered and not self.offered:
            log.info("relay: it offers passthrough (TLS ends on this server)")
            if self.reason:
                log.warning("relay: %s; staying off", self.reason)
        self.offered = offered
        if not offered or self.keeper is None:
            self.active = False
            return ""
        domain = str(info["domain"]).lower()
        port = info.get("tlsPort")
        port = port if isinstance(port, int) and 0 < port < 65536 else 443
        self.origin = f"https://{server_id}.{domain}" + ("" if port == 443 else f":{port}")
        self.keeper.start(f"{server_id}.{domain}")
        if self.splicer is not None:
            self.splicer.use(self.keeper.context(), self.origin)
        return self.origin if self.active else ""

    def registered(self, asked: bool, answer: dict) -> None:
        """Note the relay's answer to a registration that asked for passthrough or not."""
        self.active = asked and bool(answer.get("passthrough"))

    def dial(self, message: dict) -> None:
        if self.splicer is not None:
            self.splicer.dial(message)

    def stop(self) -> None:
        if self.keeper is not None:
            self.keeper.stop()
        if self.splicer is not None:
            self.splicer.stop()

    def _publish(self, values: list) -> None:
        sid = self.svc.state.read()["serverId"]
        status, answer = self.call("PUT", f"/relay/v1/acme/{sid}", {"values": values})
        if status != 200:
            said = answer.get("error", {}).get("message", "") if isinstance(answer, dict) else ""
            raise AcmeError(f"the relay did not publish the challenge: HTTP {status} {said}")

    def _withdraw(self) -> None:
        sid = self.svc.state.read()["serverId"]
        self.call("DELETE", f"/relay/v1/acme/{sid}")

    def _changed(self) -> None:
        """A certificate came (or the one in hand expired): serve with it, register again."""
        if self.splicer is not None and self.keeper is not None:
            self.splicer.use(self.keeper.context(), self.origin)
        threading.Thread(target=self._register_again, daemon=True).start()

    def _register_again(self) -> None:
        try:
            self.register()
        except Exception as e:  # the link's own loop registers again soon anyway
            log.warning("relay: registering again after a certificate change failed: %s", e)

    def status(self) -> dict:
        """What /system/info and the audit say of passthrough."""
        if not self.offered:
            state = "not offered"
        elif self.reason:
            state = "unavailable"
        elif self.active:
            state = "active"
        else:
            state = "starting" if self.keeper.state != "error" else "error"
        return {
            "state": state,
            "reason": self.reason or None,
            "origin": self.origin or None,
            "certificate": self.keeper.status()
            if self.keeper is not None and self.offered
            else None,
            "spliced": self.splicer.status() if self.splicer is not None else None,
            "terminatedLast7Days": self.terminated.last_week(),
            "checkedAt": iso(utcnow()),
        }
