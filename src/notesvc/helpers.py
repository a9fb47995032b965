"""Clock, ids, atomic writes, host validation, JSON bodies, logging."""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import errno
import functools
import hashlib
import io
import ipaddress
import itertools
import json
import logging
import os
import platform
import re
import secrets
import socket
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any, Callable

from notesvc.boot import KEY_PREFIX, bottle, fcntl, log
from notesvc.errors import ApiError, DiskFull, bad_request
from notesvc.settings import Config


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def iso(ts: dt.datetime | float) -> str:
    """Return an ISO 8601 UTC timestamp ending in Z (milliseconds)."""
    if not isinstance(ts, dt.datetime):
        ts = dt.datetime.fromtimestamp(ts, dt.timezone.utc)
    return ts.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ts.microsecond // 1000:03d}Z"


def plural(n: int, noun: str, many: str = "") -> str:
    """Return a count with its noun, singular for one: plural(1, "note") is "1 note",
    plural(2, "note") "2 notes" (`many` for a noun that takes more than an s).

    >>> plural(1, "file"), plural(0, "file"), plural(3, "entry", "entries")
    ('1 file', '0 files', '3 entries')
    """
    return f"{n} {noun if n == 1 else many or noun + 's'}"


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def redact(secret: str, keep: int = 4) -> str:
    """Return a secret shown as its prefix (for keys) and last characters only."""
    if not secret:
        return ""
    prefix = KEY_PREFIX if secret.startswith(KEY_PREFIX) else ""
    return f"{prefix}…{secret[-keep:]}" if len(secret) > keep + len(prefix) + 4 else "…"


_BATCH = threading.local()  # a thread inside deferred_sync(): its flushes wait


def flush_each() -> bool:
    """Return whether this thread flushes each write as it goes (see deferred_sync)."""
    return not getattr(_BATCH, "deferred", False)


@contextlib.contextmanager
def deferred_sync():
    """Within: the files, folders and journal entries this thread writes are each still
    written atomically (temp file, rename) but not flushed one by one; the file system is
    synced when sync_batch() is called and at the end (an import of 10,000 notes pays a
    few syncs instead of 40,000 fsyncs)."""
    _BATCH.deferred = True
    try:
        yield
    finally:
        _BATCH.deferred = False
        sync_batch()


def sync_batch() -> None:
    """Make everything written so far durable (one sync of the file systems)."""
    if hasattr(os, "sync"):
        os.sync()


def fsync_dir(folder: Path) -> None:
    """Make a rename inside folder durable (no-op where folders cannot be opened)."""
    if not flush_each():
        return
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover - Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


UMASK = os.umask(0)
os.umask(UMASK)


DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)})


@contextlib.contextmanager
def disk_writes():
    """Run a block of writes; a full disk or quota (ENOSPC, EDQUOT) becomes DiskFull (507).

    The one place that translates it: atomic_write and the store's moves use it.
    """
    try:
        yield
    except DiskFull:
        raise
    except OSError as e:
        if e.errno in DISK_FULL_ERRNOS:
            raise DiskFull(e) from None
        raise


TEMP_PREFIX, TEMP_SUFFIX = ".tmp-", ".part"  # atomic_write's temp files


def atomic_write(
    path: Path,
    data: bytes | Callable,
    mode: int | None = None,
    before_replace: Callable | None = None,
) -> None:
    """Write data (bytes, or a function writing to a file) to path so that a crash leaves
    either the old or the new content.

    Temp file in the same folder, flush, fsync, os.replace, fsync the folder. Raises
    DiskFull (507) when the disk is full; the old content and no temp file remain.
    before_replace(): what must be durable before the new content is in place.
    """
    with disk_writes():
        replace_atomically(path, data, mode, before_replace)


def replace_atomically(
    path: Path, data: bytes | Callable, mode: int | None, before_replace: Callable | None
) -> None:
    folder = path.parent
    fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=TEMP_SUFFIX, dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            if flush_each():
                os.fsync(f.fileno())
        if mode is None:
            try:
                mode = os.stat(path).st_mode & 0o777
            except FileNotFoundError:
                mode = 0o666 & ~UMASK
        os.chmod(tmp, mode)
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(folder)


def sweep_temp_files(folder: Path, skip_hidden: bool) -> int:
    """Remove the temp files a crash left under folder (atomic_write's); return how many."""
    removed = 0
    for parent, dirs, files in os.walk(folder):
        if skip_hidden:
            dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            if name.startswith(TEMP_PREFIX) and name.endswith(TEMP_SUFFIX):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(parent, name))
                    removed += 1
    return removed


@contextlib.contextmanager
def file_lock(path: Path, blocking: bool = True):
    """Hold an exclusive advisory lock on path (created if missing) for the block."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        yield fd
    finally:
        os.close(fd)  # closing the descriptor releases the lock


_HOST_RE = re.compile(
    r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*)(?::(\d{1,5}))?$"
)


def valid_host(value: str) -> bool:
    """Return whether value is a plain host[:port] (no user info, path or junk)."""
    m = _HOST_RE.match(value or "")
    if not m or len(value) > 261:
        return False
    if value.startswith("["):
        try:
            ipaddress.IPv6Address(value[1 : value.index("]")])
        except ValueError:
            return False
    return m.group(1) is None or 0 < int(m.group(1)) <= 65535


def is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr.strip("[]")).is_loopback
    except ValueError:
        return False


def lan_address() -> str:
    """Return this machine's address on its network (the one its default route leaves
    from; no packet is sent), or "" when it has none."""
    for family, probe in ((socket.AF_INET, "192.0.2.1"), (socket.AF_INET6, "2001:db8::1")):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((probe, 9))
                addr = s.getsockname()[0]
        except OSError:
            continue
        if not is_loopback(addr):
            return addr if family == socket.AF_INET else f"[{addr}]"
    return ""


@functools.lru_cache(maxsize=4)
def mdns_name(timeout: float = 1.5) -> str:
    """Return <host>.local when this machine answers to it over mDNS (Avahi, Bonjour),
    else "" (asked once, at most `timeout` seconds)."""
    short = (socket.gethostname() or "").split(".")[0].lower()
    if not re.fullmatch(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?", short):
        return ""
    found: list = []

    def look() -> None:
        with contextlib.suppress(OSError, UnicodeError):
            found.extend(socket.getaddrinfo(f"{short}.local", None, type=socket.SOCK_STREAM))

    probe = threading.Thread(target=look, daemon=True)
    probe.start()
    probe.join(timeout)
    real = [info for info in found if not is_loopback(info[4][0])]
    return f"{short}.local" if real else ""


def phone_url(config: Config, port: int | None = None) -> str:
    """Return the address a phone on the same network opens: SERVICE_PUBLIC_URL, else
    http://<host>.local:<port> when mDNS answers for this machine, else its LAN address
    (loopback when it listens on loopback only)."""
    if config.public_url:
        return config.public_url
    port = port or config.port
    if config.host not in ("0.0.0.0", "::", ""):
        host = config.host
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"
    name = mdns_name() or lan_address() or "127.0.0.1"
    return f"http://{name}:{port}"


HOME_NETS = tuple(
    ipaddress.ip_network(n)
    for n in (
        "127.0.0.0/8",
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "169.254.0.0/16",
        "100.64.0.0/10",  # carrier-grade NAT: tailnets (Tailscale, Headscale)
        "::1/128",
        "fe80::/10",
        "fc00::/7",
    )
)


def is_home_network(addr: str) -> bool:
    """Return whether an address is loopback, private (RFC 1918, fc00::/7) or link-local:
    a client on this machine or on its own network."""
    ip = ip_of(addr) if addr else None
    if ip is None:
        return False
    ip = getattr(ip, "ipv4_mapped", None) or ip
    return any(ip.version == net.version and ip in net for net in HOME_NETS)


def names_this_machine(config: Config, host: str) -> bool:
    """Return whether a Host header names this machine, not a name anyone could point here.

    An IP literal, localhost, the host name (`name`, `name.local`) or SERVICE_PUBLIC_URL's
    host: a page on rebind.attacker.example that resolves to 127.0.0.1 is none of them.
    """
    if not valid_host(host):
        return False
    name = host[1 : host.index("]")] if host.startswith("[") else host.rsplit(":", 1)[0]
    name = name.lower().rstrip(".")
    if ip_of(name) is not None or name == "localhost":
        return True
    names = {(urllib.parse.urlsplit(config.public_url).hostname or "").lower()} - {""}
    for node in (socket.gethostname(), platform.node()):
        node = node.lower().rstrip(".")
        if node:
            short = node.split(".")[0]
            names |= {node, f"{node}.local", short, f"{short}.local"}
    return name in names


def minutes_text(seconds: int) -> str:
    if seconds % 60:
        return f"{seconds} seconds"
    return "1 minute" if seconds == 60 else f"{seconds // 60} minutes"


def redact_url(url: str) -> str:
    """Return url for display: userinfo dropped, query values (which may be keys) hidden."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    query = "&".join(
        f"{pair.partition('=')[0]}=…" if "=" in pair else "…"
        for pair in parts.query.split("&")
        if pair
    )
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc, query=query, fragment=""))


SCRUB_FRAGMENT = 12  # a run this long of a secret's own characters is a piece of it


def url_secrets(url: str) -> list:
    """Return what in an endpoint's URL may be a secret: its userinfo's password, its
    query string and each query value of 8 characters or more."""
    parts = urllib.parse.urlsplit(url)
    found = [parts.password or "", parts.query]
    found += [v for _, v in urllib.parse.parse_qsl(parts.query) if len(v) >= 8]
    return [s for s in found if s]


@functools.lru_cache(maxsize=64)
def _scrubber(secrets: tuple) -> tuple:
    """Return (a pattern of every spelling of the secrets, their lower-case forms)."""
    spellings: set = set()
    for secret in secrets:
        raw = secret.encode("utf-8")
        spellings |= {
            secret,
            urllib.parse.quote(secret, safe=""),
            urllib.parse.quote_plus(secret, safe=""),
        }
        for shift in range(3):  # base64 at each alignment: the groups the secret alone decides
            for encode in (base64.b64encode, base64.urlsafe_b64encode):
                text = encode(b"\0" * shift + raw).decode("ascii").rstrip("=")
                core = text[4 if shift else 0 : len(text) - len(text) % 4 or None]
                if len(core) >= SCRUB_FRAGMENT:
                    spellings.add(core)
    ordered = sorted(spellings, key=len, reverse=True)
    pattern = re.compile("|".join(map(re.escape, ordered)), re.I)
    return pattern, tuple(s.lower() for s in secrets)


def scrub(text: str, secrets: Any, limit: int = 0) -> str:
    """Return text (an answer, an error, a log line from an outbound call) without any of
    the secrets this server sends out (embeddings, agent and transcription keys, bot
    tokens, a URL's password or query), each replaced by "…": as sent, in any case,
    URL-encoded, in base64 (standard or URL-safe, at any alignment), and any run of
    SCRUB_FRAGMENT or more of a secret's own characters (an endpoint that echoes it cut
    short, or lower-cased); cut to `limit` bytes when given. The one scrub of notesvc.

    >>> scrub("bad token 123456%3aabc-defghijklmn, ABC-DEFGHIJKLM", ["123456:ABC-defghijklmn"])
    'bad token …, …'
    """
    found = tuple(sorted({s for s in secrets if isinstance(s, str) and len(s) >= 4}))
    if found and text:
        pattern, lowered = _scrubber(found)
        text = pattern.sub("…", text)

        def piece(m: Any) -> str:
            run = m.group().lower()
            return "…" if any(run in secret for secret in lowered) else m.group()

        text = re.sub(f"[A-Za-z0-9_-]{{{SCRUB_FRAGMENT},}}", piece, text)
    return text.encode("utf-8")[:limit].decode("utf-8", "ignore") if limit else text


def self_command() -> str:
    """Return how the owner runs this program: the `notesvc` entry point, `python3 -m
    notesvc` (the package) or the file."""
    argv0 = sys.argv[0] if sys.argv else ""
    if argv0.endswith(os.path.join("notesvc", "__main__.py")):
        return "python3 -m notesvc"
    return argv0 if os.path.basename(argv0) == "notesvc" else "python3 notesvc.py"


_UNPRINTABLE_RE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def log_safe(text: str, limit: int = 1024) -> str:
    """Return text for one log line: control characters escaped (no forged lines), clipped."""
    return _UNPRINTABLE_RE.sub(lambda m: ascii(m.group())[1:-1], text[:limit])


class BatchedLogHandler(logging.StreamHandler):
    """The log on stderr, its info lines written together at most LOG_BATCH_SECONDS late.

    A line per request written at once is a system call per request, and each one hands
    the GIL to another thread: 15 % of a busy server's requests per second. Warnings and
    errors flush what is waiting and are written at once; the rest goes out on the
    writer thread, which also formats it, at exit (logging.shutdown flushes every
    handler), or past MAX_WAITING lines.
    """

    LOG_BATCH_SECONDS = 0.2
    MAX_WAITING = 512  # lines
    installed: BatchedLogHandler | None = None  # main()'s handler, for quick_info

    def __init__(self, stream=None):
        super().__init__(stream)
        self._waiting: list = []  # records, formatted when written
        self._listed = threading.Lock()  # guards _waiting alone (self.lock: the writing)
        self._due = threading.Event()
        self._writer: threading.Thread | None = None
        self._second, self._stamp = -1, ""  # the asctime of quick lines, kept per second

    def handle(self, record: logging.LogRecord) -> bool:
        """Filter and emit without the handler's lock: that one is the writing's (flush),
        which would otherwise hold every request up while a batch is formatted."""
        passed = self.filter(record)
        if isinstance(passed, logging.LogRecord):  # Python 3.12: a filter may replace it
            record = passed
        if passed:
            self.emit(record)
        return bool(passed)

    def emit(self, record: logging.LogRecord) -> None:
        self._wait(record, record.levelno >= logging.WARNING)

    def quick(self, created: float, msg: str, args: tuple) -> None:
        """An info line of `log` (msg % args) without a LogRecord: what logging gathers for
        each one (the caller's frame, a dozen fields) costs a request more than all of its
        own logging, about 12 µs holding the GIL. Written in turn with the records, as
        logging's default format would (quick_info says when it is used)."""
        self._wait((created, msg, args), False)

    def _wait(self, item, urgent: bool) -> None:
        with self._listed:  # formatted when written: by the writer thread, off the request
            self._waiting.append(item)
            urgent = urgent or len(self._waiting) > self.MAX_WAITING
            if not urgent and len(self._waiting) == 1:
                if self._writer is None:
                    self._writer = threading.Thread(
                        target=self._run, name="notesvc-log", daemon=True
                    )
                    self._writer.start()
                self._due.set()
        if urgent:
            self.flush()

    def _run(self) -> None:
        while True:
            self._due.wait()
            time.sleep(self.LOG_BATCH_SECONDS)
            self._due.clear()
            self.flush()

    def _write(self) -> None:  # under self.lock: one batch at a time, in order
        with self._listed:
            records, self._waiting = self._waiting, []
        if not records:
            return
        lines = []
        for record in records:
            if isinstance(record, tuple):  # quick()'s
                created, msg, args = record
                lines.append(f"{self._asctime(created)} INFO {log.name}: {msg % args}\n")
                continue
            try:
                lines.append(self.format(record) + self.terminator)
            except Exception:
                self.handleError(record)
        try:
            self.stream.write("".join(lines))
            self.stream.flush()
        except (OSError, ValueError):  # stderr closed: the lines are dropped
            pass

    def _asctime(self, created: float) -> str:
        """logging's default asctime ("2026-11-27 12:00:00,123"), its second's text kept."""
        second = int(created)
        if second != self._second:
            self._second = second
            self._stamp = time.strftime(
                logging.Formatter.default_time_format, logging.Formatter.converter(second)
            )
        return logging.Formatter.default_msec_format % (self._stamp, (created - second) * 1000)

    def flush(self) -> None:
        with self.lock:
            self._write()


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def quick_info(msg: str, *args) -> None:
    """log.info(msg, *args) for a line per request: straight to the handler main() set up,
    when it is still the only one writing `log`'s lines (else, and in tests, as usual)."""
    if not log.isEnabledFor(logging.INFO):
        return
    handler = BatchedLogHandler.installed
    alone = handler is not None and logging.root.handlers == [handler] and not log.handlers
    plain = alone and log.propagate and handler.level <= logging.INFO
    if plain and not (log.filters or handler.filters or logging.root.filters):
        handler.quick(time.time(), msg, args)
    else:
        log.info(msg, *args)


def ip_of(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """Return the IP address in "1.2.3.4", "1.2.3.4:80", "::1" or "[::1]:80", else None."""
    text = text.strip()
    if text.startswith("[") and "]" in text:
        text = text[1 : text.index("]")]
    elif text.count(":") == 1:
        text = text.split(":")[0]
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    return (ip.ipv4_mapped or ip) if ip.version == 6 else ip


@functools.lru_cache(maxsize=16)
def _networks(nets: tuple) -> tuple:
    return tuple(ipaddress.ip_network(n) for n in nets)


def is_trusted_proxy(config: Config, addr: str) -> bool:
    ip = ip_of(addr)
    return ip is not None and any(ip in net for net in _networks(config.trust_proxy))


def behind_trusted_proxy(config: Config, environ: dict) -> bool:
    """Return whether X-Forwarded-* count: the direct peer is a proxy the operator trusts.

    Decided here rather than by the WSGI server, so it holds under any of them; a
    request that came through the relay never counts (its headers are the client's).
    """
    return (
        bool(config.trust_proxy)
        and not environ.get("notesvc.relayed")
        and is_trusted_proxy(config, environ.get("REMOTE_ADDR", ""))
    )


# Headers by which a proxy or a tunnel says whom it forwards for: from a peer that is not a
# trusted proxy, any of them means the peer is not the client (docs/design.md: Security).
FORWARDING_HEADERS = (
    "HTTP_X_FORWARDED_FOR",
    "HTTP_FORWARDED",
    "HTTP_X_REAL_IP",
    "HTTP_X_FORWARDED_HOST",
    "HTTP_X_FORWARDED_PROTO",
    "HTTP_VIA",
    "HTTP_CF_CONNECTING_IP",
    "HTTP_TRUE_CLIENT_IP",
)
_FORWARDED_FOR_RE = re.compile(r'(?:^|;)\s*for\s*=\s*("[^"]*"|[^;,\s]*)', re.IGNORECASE)


def _forwarded_hops(environ: dict) -> list:
    """Return, for each forwarding header present (X-Forwarded-For, Forwarded,
    X-Real-IP), the client addresses it reports, nearest last."""
    found = []
    xff = environ.get("HTTP_X_FORWARDED_FOR", "")
    if xff.strip():
        found.append([hop.strip() for hop in xff.split(",")])
    forwarded = environ.get("HTTP_FORWARDED", "")
    if forwarded.strip():
        hops = []
        for element in forwarded.split(","):
            m = _FORWARDED_FOR_RE.search(element.strip())
            hops.append(m.group(1).strip('"') if m else "")
        found.append(hops)
    real = environ.get("HTTP_X_REAL_IP", "")
    if real.strip():
        found.append([real.strip()])
    return found


def _client_of_hops(config: Config, hops: list) -> Any:
    """Return the right-most hop that is not a trusted proxy (or the first hop when all
    are), or None when a hop on the way is not an address."""
    ip = None
    for hop in reversed(hops):
        ip = ip_of(hop)
        if ip is None:  # "unknown", an obfuscated name, junk: no client we can judge
            return None
        if not is_trusted_proxy(config, str(ip)):
            break
    return ip  # else every hop a trusted proxy: the first one's client is theirs to say


def client_of(config: Config, environ: dict) -> tuple:
    """Return (the client's address as setup judges it, or None when it cannot be known;
    the name its lockout and rate limits count under, which the logs show): the one place
    that decides who the client is (docs/design.md: Security).

    The TCP peer decides; a forwarded address counts only from a proxy SERVICE_TRUST_PROXY
    names (the right-most hop that is not itself such a proxy). For setup, None: a relayed
    request, a trusted proxy that names no parseable client, or any forwarding header from
    a peer that is not a trusted proxy (a tunnel or proxy we were not told about).

    A proxy that writes only X-Real-IP or Forwarded passes the client's own
    X-Forwarded-For on (and one that writes only X-Forwarded-For passes a forged
    X-Real-IP), so every one of the three headers present is judged. Setup takes the
    farthest from home (outside the home ranges, then not loopback). The lockout's name is
    the client they all agree on; when they disagree, or one names nothing parseable, which
    one the proxy wrote cannot be told, so every such request through that proxy counts
    under one name, "via:<proxy>": a client rotating a forged header dodges no limit, and
    naming someone else's address locks nobody else out. Relayed clients count as
    "relay:<addr>", never in a bucket of loopback clients.
    """
    peer_text = environ.get("REMOTE_ADDR") or ""
    if environ.get("notesvc.relayed"):
        return None, f"relay:{peer_text or '?'}"
    peer = ip_of(peer_text)
    if peer is None or not is_trusted_proxy(config, str(peer)):
        forwarded = any(environ.get(h) for h in FORWARDING_HEADERS)
        return (None if forwarded else peer), peer_text
    clients = [_client_of_hops(config, hops) for hops in _forwarded_hops(environ)]
    if not clients:  # the proxy's own request, or one that adds no header: the peer
        return None, peer_text
    if None in clients:
        return None, f"via:{peer}"
    judged = max(clients, key=lambda ip: (not is_home_network(str(ip)), not ip.is_loopback))
    # a header whose every hop is a trusted proxy names no client while another one does
    named = {ip for ip in clients if not is_trusted_proxy(config, str(ip))} or set(clients)
    return judged, str(next(iter(named))) if len(named) == 1 else f"via:{peer}"


def setup_client_ip(config: Config, environ: dict) -> Any:
    """Return the client's address as setup judges it, or None when it cannot be known
    (client_of)."""
    return client_of(config, environ)[0]


def client_address(config: Config, environ: dict) -> str:
    """Return the name a client's failed credentials and rate limits count under, and the
    logs show: its address, "relay:<addr>" or "via:<proxy>" (client_of)."""
    return client_of(config, environ)[1]


# What names a cloud in the firmware's own words (sys_vendor, product_name,
# chassis_asset_tag): Amazon EC2, Google Compute Engine, Microsoft's Virtual Machine (Azure,
# with the vendor), DigitalOcean's Droplet, Hetzner's vServer, OpenStack Nova (OVH, and
# many more), Alibaba, Oracle, Linode/Akamai, Vultr, Scaleway, Exoscale, UpCloud, Tencent.
_CLOUD_RE = re.compile(
    r"amazon|\bec2\b|google|digitalocean|droplet|hetzner|openstack|alibaba|aliyun|oracle ?cloud"
    r"|linode|akamai|vultr|scaleway|exoscale|upcloud|tencent|huawei cloud|outscale",
    re.I,
)
CLOUD_RANGES = ("10.0.0.0/8", "172.16.0.0/12")  # what VPCs and clusters hand out


class Machine:
    """Where this process runs, as SERVICE_SETUP_LOCAL_ONLY=auto judges it (docs/design.md:
    Security). The files it reads are class attributes, so a test points them at a folder
    of its own."""

    DMI = "/sys/class/dmi/id"  # sys_vendor, product_name, chassis_asset_tag: world-readable
    HYPERVISOR_UUID = "/sys/hypervisor/uuid"  # Xen-based EC2: starts "ec2"
    CONTAINER_MARKS = ("/.dockerenv", "/run/.containerenv")

    @classmethod
    def in_container(cls) -> bool:
        return any(os.path.exists(mark) for mark in cls.CONTAINER_MARKS)

    @classmethod
    def cloud(cls, environ: Any = None) -> str | None:
        """Return what says this machine is a cloud VM or a Kubernetes pod ("" when nothing
        does), or None when it cannot tell: its firmware's names cannot be read (no DMI,
        as on a Raspberry Pi, or no /sys at all)."""
        environ = os.environ if environ is None else environ
        if environ.get("KUBERNETES_SERVICE_HOST"):
            return "a Kubernetes pod (KUBERNETES_SERVICE_HOST is set)"
        with contextlib.suppress(OSError, UnicodeError), open(cls.HYPERVISOR_UUID, "rb") as f:
            if f.read(64).strip().lower().startswith(b"ec2"):
                return f"an Amazon EC2 instance ({cls.HYPERVISOR_UUID})"
        names: dict = {}
        for name in ("sys_vendor", "product_name", "chassis_asset_tag"):
            path = os.path.join(cls.DMI, name)
            with contextlib.suppress(OSError, UnicodeError), open(path, encoding="utf-8") as f:
                names[name] = " ".join(f.read(200).split())
        if not names:
            return None
        said = " ".join(names.values())
        microsoft = "microsoft" in names.get("sys_vendor", "").lower()
        if _CLOUD_RE.search(said) or (microsoft and "virtual machine" in said.lower()):
            shown = ", ".join(f"{k} {log_safe(v, 60)!r}" for k, v in names.items() if v)
            return f"a cloud VM ({shown})"
        return ""


def in_container() -> bool:
    """Return whether this process runs in a Docker or Podman container."""
    return Machine.in_container()


def setup_loopback_reason(
    mode: str, own_address: str, container: bool, cloud: str | None = ""
) -> str:
    """Return why only loopback clients may set up (SERVICE_SETUP_LOCAL_ONLY), "" when
    clients on a home network may too.

    auto: loopback only when this machine runs in a container (every client then arrives
    from the container network's private gateway), looks like a cloud VM or a pod (`cloud`,
    from Machine.cloud(): its "home network" is a VPC or a cluster), or its own
    default-route address is outside the home ranges (a VPS: its "neighbours" are
    strangers); and when it cannot tell whether it is a cloud VM (cloud None) while its
    address is in a range clouds and clusters hand out (10/8, 172.16/12).
    """
    if mode in ("true", "false"):
        return "SERVICE_SETUP_LOCAL_ONLY=true" if mode == "true" else ""
    if cloud:
        return f"this machine looks like {cloud}"
    if container:
        return "this server runs in a container"
    if not is_home_network(own_address):
        return f"this machine's own address ({own_address or 'none'}) is outside the home ranges"
    ip = ip_of(own_address)
    if cloud is None and ip is not None and any(ip in n for n in _networks(CLOUD_RANGES)):
        return (
            f"this machine's address {ip} is in a range clouds and clusters use "
            f"({', '.join(CLOUD_RANGES)}) and its firmware names no maker to tell a home "
            "from a cloud"
        )
    return ""


def setup_loopback_only(
    mode: str, own_address: str, container: bool, cloud: str | None = ""
) -> bool:
    """Return whether only loopback clients may set up (setup_loopback_reason)."""
    return bool(setup_loopback_reason(mode, own_address, container, cloud))


def request_host(config: Config, environ: dict) -> str:
    """Return the Host the client asked for (X-Forwarded-Host only from a trusted proxy)."""
    if behind_trusted_proxy(config, environ):
        forwarded = environ.get("HTTP_X_FORWARDED_HOST", "").split(",")[-1].strip()
        if valid_host(forwarded):
            return forwarded
    return environ.get("HTTP_HOST", "")


def base_url_of(config: Config, environ: dict) -> str:
    """Return the canonical base URL: the configured one, else from the request.

    Forwarded headers count only from a trusted proxy; a Host that is not a plain
    host[:port] is ignored, so no client can plant a foreign link.
    """
    if config.public_url:
        return config.public_url
    scheme = environ.get("wsgi.url_scheme", "http")
    host = request_host(config, environ)
    if behind_trusted_proxy(config, environ):
        # the right-most value is the one our own proxy wrote
        proto = environ.get("HTTP_X_FORWARDED_PROTO", "").split(",")[-1].strip().lower()
        if proto in ("http", "https"):
            scheme = proto
    if not valid_host(host):
        bind = config.host
        bind = "127.0.0.1" if bind in ("0.0.0.0", "::", "") else bind
        bind = f"[{bind}]" if ":" in bind else bind
        host = f"{bind}:{environ.get('SERVER_PORT') or config.port}"
    return f"{scheme}://{host}"


def read_json(max_bytes: int, required: bool = True) -> dict:
    """Return the request's JSON object body.

    Raises 415 for another media type, 413 over max_bytes, 400 for anything
    that is not one UTF-8 JSON object. An absent body is {} when not required.
    """
    req = bottle.request
    length = req.content_length  # -1 when unknown (chunked)
    chunked = "chunked" in req.environ.get("HTTP_TRANSFER_ENCODING", "").lower()
    if length <= 0 and not chunked:
        if required:
            raise bad_request("a JSON object body is required")
        return {}
    ctype = req.content_type.split(";")[0].strip().lower()
    if ctype != "application/json":
        raise ApiError(
            415,
            "UNSUPPORTED_MEDIA_TYPE",
            "send the body as JSON with Content-Type: application/json",
        )
    if length > max_bytes:
        raise ApiError(413, "PAYLOAD_TOO_LARGE", f"the body is over {max_bytes} bytes")
    raw = req.body.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise ApiError(413, "PAYLOAD_TOO_LARGE", f"the body is over {max_bytes} bytes")
    if not raw.strip():
        if required:
            raise bad_request("a JSON object body is required")
        return {}
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=no_constant)
    except UnicodeDecodeError:
        raise bad_request("the body is not valid UTF-8") from None
    except (ValueError, RecursionError) as e:
        raise bad_request(f"the body is not valid JSON: {str(e)[:120]}") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    return body


def no_constant(name: str) -> None:
    raise ValueError(f"{name} is not allowed in JSON")


# Blank text (docs/api.md): nothing left once every Unicode White_Space character and every
# C0/C1 control character is removed. The OpenAPI document states the same rule as a pattern
# (one character outside this class), so a schema-valid value is never refused as empty.
BLANK_CLASS = r"\u0000-\u0020\u007f-\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
NOT_BLANK_PATTERN = f"[^{BLANK_CLASS}]"
_NOT_BLANK_RE = re.compile(NOT_BLANK_PATTERN)


def is_blank(text: str) -> bool:
    """Return whether text holds nothing but white space and control characters.

    >>> is_blank(" \u001e\u3000"), is_blank("\u200bx")
    (True, False)
    """
    return _NOT_BLANK_RE.search(text) is None


def field(body: dict, name: str, kind: type = str, required: bool = True, max_len: int = 0):
    """Return body[name] checked for type (and length for strings); 400 otherwise."""
    if name not in body or body[name] is None:
        if required:
            raise bad_request(f"'{name}' is required")
        return None
    value = body[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise bad_request(f"'{name}' must be a {_TYPE_NAMES.get(kind, kind.__name__)}")
    if max_len and isinstance(value, str) and len(value) > max_len:
        raise bad_request(f"'{name}' is longer than {max_len} characters")
    return value


_TYPE_NAMES = {str: "string", int: "whole number", bool: "boolean", dict: "object", list: "list"}


def if_match_allows(if_match: str | None, current: str | None) -> bool:
    """Return whether a write may go on under an If-Match header (the one reading of it):
    absent (None), `*` while something is there, or a list of ETags, quoted or not, that
    names current, the ETag of what is there (None: nothing is)."""
    if if_match is None:
        return True
    tags = [t.strip() for t in if_match.split(",") if t.strip()]
    if current is not None and "*" in tags:
        return True
    return current is not None and current in {t if t[0] == '"' else f'"{t}"' for t in tags}


def request_header(name: str, default: Any = None) -> Any:
    """Return a request header's text: its UTF-8 reading, else the bytes as Latin-1 text.

    Never raises (bottle's get_header does on bytes that are not UTF-8): such a value
    matches no ETag and parses as no range, so Range, If-Range and If-None-Match act as if
    absent, and an If-Match made of them fails as any other mismatch.
    """
    environ = bottle.request.environ
    key = name.upper().replace("-", "_")
    raw = environ.get(key if key in ("CONTENT_TYPE", "CONTENT_LENGTH") else "HTTP_" + key)
    if raw is None:
        return default
    try:
        return raw.encode("latin-1").decode("utf-8")
    except UnicodeError:
        return raw


def query_str(name: str, default: str = "") -> str:
    """Return a query parameter decoded as UTF-8; 400 when it is not UTF-8."""
    raw = bottle.request.query.get(name)
    if raw is None:
        return default
    try:
        return raw.encode("latin-1").decode("utf-8")
    except UnicodeError:
        raise bad_request(f"'{name}' is not valid UTF-8") from None


def query_int(name: str, default: int, lo: int, hi: int) -> int:
    """Return an integer query parameter within lo..hi; 400 otherwise."""
    raw = bottle.request.query.get(name)
    if raw is None or raw == "":
        return default
    if not re.fullmatch(r"-?\d{1,10}", raw) or not lo <= int(raw) <= hi:
        raise bad_request(f"'{name}' must be a whole number from {lo} to {hi}")
    return int(raw)


def yes_or_no(raw: Any, name: str) -> bool:
    """Return a flag of a query or a form (true/false, yes/no, 1/0; empty: false); 400
    otherwise."""
    value = str(raw or "").strip().lower()
    if value in ("", "0", "false", "no"):
        return False
    if value in ("1", "true", "yes"):
        return True
    raise bad_request(f"'{name}' must be true or false")


_MALLOC_TRIM: list = []  # glibc's malloc_trim, looked up once ([None] where there is none)


def settle_after_start() -> None:
    """Once started: freeze what start-up made (this module's functions, tables and pages:
    the collector's full passes would walk them on every run, a pause of tens of
    milliseconds on a busy server or relay), then give the free memory back."""
    import gc

    gc.collect()
    gc.freeze()
    release_memory()


def release_memory() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim). Compiling this
    module at start (about 35 MB, freed at once), a start-up check or a merge leave memory
    free but resident; on a small machine that is memory others could use. Elsewhere: nothing.
    """
    if not _MALLOC_TRIM:
        try:
            import ctypes  # only here: nothing else needs it

            _MALLOC_TRIM.append(getattr(ctypes.CDLL(None), "malloc_trim", None))
        except (ImportError, OSError):
            _MALLOC_TRIM.append(None)
    trim = _MALLOC_TRIM[0]
    if trim is not None:
        trim(0)


# -- time zones: daily notes and reminders ------------------------------------------


@functools.lru_cache(maxsize=8)
def time_zone(name: str) -> dt.tzinfo | None:
    """Return SERVICE_TIMEZONE's zone; None means the system's local time (the default,
    and the fallback, logged once, where no time zone database is installed)."""
    if not name:
        return None
    if name.upper() == "UTC":
        return dt.timezone.utc
    try:
        import zoneinfo

        return zoneinfo.ZoneInfo(name)
    except (ImportError, ValueError, OSError, KeyError):  # ZoneInfoNotFoundError: a KeyError
        log.warning("time zone %s is unknown here (no tzdata?): using the system's time", name)
    return None


def local_time(ts: float, zone: dt.tzinfo | None) -> dt.datetime:
    """Return the wall-clock time of a timestamp in a zone (None: the system's), naive."""
    when = dt.datetime.fromtimestamp(ts, zone) if zone else dt.datetime.fromtimestamp(ts)
    return when.replace(tzinfo=None)


def timestamp_of(wall: dt.datetime, zone: dt.tzinfo | None) -> float:
    """Return the timestamp of a naive wall-clock time in a zone (None: the system's)."""
    return wall.replace(tzinfo=zone).timestamp() if zone else wall.timestamp()


# -- raw and multipart request bodies (attachments) ---------------------------------

BODY_CHUNK = 1 << 16


def too_large(limit: int, setting: str) -> ApiError:
    return ApiError(413, "PAYLOAD_TOO_LARGE", f"the body is over {limit} bytes ({setting})")


def request_body_reader(limit: int, setting: str) -> tuple:
    """Return (read(n) -> bytes, declared length or -1) over the request body, bounded.

    Reads the WSGI input directly (no second copy of a large body); a declared length over
    `limit` is 413 before anything is read, and so is a chunked body once it passes it.
    A body that ends before its Content-Length is 400.
    """
    env = bottle.request.environ
    raw_length = env.get("CONTENT_LENGTH") or ""
    chunked = "chunked" in env.get("HTTP_TRANSFER_ENCODING", "").lower()
    if raw_length.isdigit():
        length = int(raw_length)
        stream = env["wsgi.input"]
    elif chunked:  # a server that leaves chunked bodies to the app: Bottle decodes them
        length, stream = -1, bottle.request.body
    else:
        length, stream = 0, io.BytesIO()
    if length > limit:
        raise too_large(limit, setting)
    left = [length]
    seen = [0]

    def read(n: int = BODY_CHUNK) -> bytes:
        if left[0] == 0:
            return b""
        want = n if left[0] < 0 else min(n, left[0])
        chunk = stream.read(want)
        if not chunk:
            if left[0] > 0:
                raise bad_request("the body ended before Content-Length bytes arrived")
            left[0] = 0
            return b""
        seen[0] += len(chunk)
        if seen[0] > limit:
            raise too_large(limit, setting)
        if left[0] > 0:
            left[0] -= len(chunk)
        return chunk

    return read, length


class MultipartReader:
    """A bounded, streaming reader of multipart/form-data (RFC 7578), standard library only.

    Field values are handed to sinks chunk by chunk, so a file part goes to disk without
    being held in memory. Limits: `max_parts` parts, 8 KiB of headers per part, and each
    sink's own limit; a malformed body is 400.
    """

    MAX_HEADERS = 8192
    MAX_PREAMBLE = 65536

    def __init__(self, read: Callable[[int], bytes], boundary: str, max_parts: int = 16):
        if not re.fullmatch(r"[0-9A-Za-z'()+_,./:=? -]{1,70}", boundary) or boundary.endswith(" "):
            raise bad_request("the multipart boundary is missing or malformed")
        self.read, self.max_parts = read, max_parts
        self.delimiter = b"--" + boundary.encode("ascii")
        self.buf = bytearray()
        self.ended = False

    def _fill(self) -> bool:
        if self.ended:
            return False
        chunk = self.read(BODY_CHUNK)
        if not chunk:
            self.ended = True
            return False
        self.buf += chunk
        return True

    def _take(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not self._fill():
                raise bad_request("the multipart body ended before its closing delimiter")
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def _until(self, marker: bytes, sink: Callable | None, limit: int, over: Callable) -> None:
        """Pass the bytes before marker to sink (None: drop them), then consume the marker."""
        seen, keep = 0, len(marker) - 1
        while True:
            i = self.buf.find(marker)
            end = i if i >= 0 else max(0, len(self.buf) - keep)
            if end:
                seen += end
                if seen > limit:
                    raise over()
                if sink is not None:
                    sink(bytes(self.buf[:end]))
                del self.buf[:end]
            if i >= 0:
                del self.buf[: len(marker)]
                return
            if not self._fill():
                raise bad_request("the multipart body ended before its closing delimiter")

    def parts(self, on_part: Callable) -> None:
        """Read every part: on_part(name, filename, headers) returns (sink, limit, over) for
        its body, or None to skip it (at most 64 KiB)."""
        import email.parser
        import email.policy
        import email.utils

        def malformed(what: str) -> Callable:
            return lambda: bad_request(f"multipart {what} is too large")

        self._until(self.delimiter, None, self.MAX_PREAMBLE, malformed("preamble"))
        for count in itertools.count(1):
            tail = self._take(2)
            if tail == b"--":
                return  # the close delimiter; an epilogue is ignored
            while tail != b"\r\n":  # transport padding (spaces) before the line end
                if tail[:1] not in (b" ", b"\t"):
                    raise bad_request("malformed multipart delimiter line")
                tail = tail[1:] + self._take(1)
            if count > self.max_parts:
                raise bad_request(f"more than {self.max_parts} multipart parts")
            head = bytearray()
            while len(self.buf) < 2 and self._fill():
                pass
            if self.buf[:2] == b"\r\n":
                del self.buf[:2]  # a part without headers
            else:
                self._until(b"\r\n\r\n", head.extend, self.MAX_HEADERS, malformed("headers"))
            text = bytes(head).decode("utf-8", "replace")
            msg = email.parser.HeaderParser(policy=email.policy.compat32).parsestr(text)
            disposition = msg.get("Content-Disposition", "")
            if not disposition.lower().startswith("form-data"):
                raise bad_request("each multipart part needs Content-Disposition: form-data")
            name = msg.get_param("name", header="content-disposition")
            filename = msg.get_filename()
            if isinstance(name, tuple):  # RFC 2231
                name = email.utils.collapse_rfc2231_value(name)
            handler = on_part(str(name or ""), filename, msg)
            sink, limit, over = handler or (None, 65536, malformed("part"))
            while len(self.buf) < len(self.delimiter) and self._fill():
                pass
            if self.buf.startswith(self.delimiter):  # an empty part whose header block's
                del self.buf[: len(self.delimiter)]  # last line end was the delimiter's
                continue
            self._until(b"\r\n" + self.delimiter, sink, limit, over)
