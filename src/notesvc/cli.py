"""The command line: parser, cmd_* functions, main()."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import functools
import io
import json
import logging
import os
import re
import socket
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Any, BinaryIO, Callable

from notesvc.audit import entropy_bits_per_char, run_audit
from notesvc.auth import StateError, StateStore, rotate_key
from notesvc.boot import API, __version__, bottle, fcntl, log
from notesvc.errors import JSON_TYPE, STATUS_CODES, ApiError, error_body, jsonrpc_error_body
from notesvc.grants import MADE_BY_CLI, OWNER, SCOPES, GrantStore, clean_name
from notesvc.helpers import (
    LOG_FORMAT,
    BatchedLogHandler,
    atomic_write,
    is_loopback,
    iso,
    log_safe,
    phone_url,
    plural,
    self_command,
    settle_after_start,
    utcnow,
)
from notesvc.http.access import new_pairing
from notesvc.http.api import MULTIPART_SLACK
from notesvc.http.app import create_app
from notesvc.http.dav import DAV_PREFIX
from notesvc.notes.paths import NOTES, folder_path
from notesvc.plugins import PLUGINS, build_service, provider_registries
from notesvc.relay import (
    LINGER_IDLE_SECONDS,
    LINGER_MAX_BYTES,
    LINGER_SECONDS,
    RelayServer,
)
from notesvc.relay_client import RelayClient
from notesvc.service import Service
from notesvc.settings import SETTINGS, Config, ConfigError, load_config, setting_commands
from notesvc.transfer.export import export_zip
from notesvc.transfer.formats import import_path
from notesvc.transfer.plan import ImportPlan, import_too_many, sniff_import


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one clear line, exit 2
        self.exit(2, f"notesvc: error: {message} (see --help)\n")


COMMAND_HELP = {
    "serve": "serve the API (the default)",
    "rotate-key": "print a new API key; the old one stops working (works while serving)",
    "pair": "add a device: print a one-time link and its QR code to scan (works while serving)",
    "audit": "print the security audit of this root's server; exit 1 on a critical finding",
    "relay": "run a relay only (serves /relay/v1/*, /r/<serverId>/api/v1/*, /health)",
    "import": "bring notes from Keep, Evernote, Notion, Obsidian, Joplin or a folder "
    "(works while serving)",
    "export": "write every note, attachment and file to a zip (works while serving)",
}


def build_parser() -> argparse.ArgumentParser:
    """Return the parser; each subcommand takes the flags of the settings it reads."""

    def env_only(command: str | None) -> str:
        rows = [
            f"  {s.env:<28} {s.help} (default: {s.default or '-'})"
            for s in SETTINGS
            if not s.flag and (command is None or command in setting_commands(s))
        ]
        return "Environment variables without a flag:\n" + "\n".join(rows) if rows else ""

    def add_flags(p: argparse.ArgumentParser, command: str | None, default: Any) -> None:
        for s in SETTINGS:
            if s.flag and (command is None or command in setting_commands(s)):
                p.add_argument(
                    s.flag,
                    dest=s.name,
                    metavar=s.name.upper(),
                    default=default,
                    help=f"{s.help} (env {s.env}, default {s.default or '-'})",
                )

    parser = _Parser(
        prog="notesvc",
        description="A self-hosted notes server with an HTTP JSON API.",
        epilog=env_only(None),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"notesvc {__version__}")
    add_flags(parser, None, None)  # `notesvc --port 8080` serves; checked against the command
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, text in COMMAND_HELP.items():
        p = sub.add_parser(
            name,
            help=text,
            description=text,
            epilog=env_only(name),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        add_flags(p, name, argparse.SUPPRESS)
        for flag, options in COMMAND_ARGS.get(name, {}).items():
            p.add_argument(flag, **options)
    return parser


# a subcommand's own flags (not settings): the handler gets them as its second argument
COMMAND_ARGS = {
    "pair": {
        "--scope": {
            "choices": SCOPES,
            "default": "write",
            "help": "what the device may do (default: write; admin: also keys and settings)",
        },
        "--folder": {"help": "only this folder, e.g. notes/family (not with --scope admin)"},
        "--name": {"default": "device", "help": "the device's name in the list of devices"},
    },
    "import": {
        "source": {
            "help": "a Keep Takeout (folder or zip), an Evernote .enex, a Notion export zip, "
            "an Obsidian vault, a Joplin .jex, a notesvc export, or any folder or zip of "
            ".md/.txt files"
        },
        "--into": {"help": "the folder to put them in (default: notes/imported/<source kind>)"},
        "--dry-run": {
            "action": "store_true",
            "help": "write nothing; say what would be created, renamed and skipped",
        },
    },
    "export": {"out": {"metavar": "OUT.zip", "help": "the zip to write (not overwritten)"}},
}


def take_process_lock(config: Config) -> int:
    """Return a descriptor holding the notes root's lock; ConfigError if another holds it."""
    config.state_dir.mkdir(parents=True, exist_ok=True)
    path = config.state_dir / "notesvc.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            other = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ConfigError(
                f"another notesvc (pid {other}) is already serving {config.root}"
            ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


class _EnvelopedError:
    """One of waitress's own refusals (body too large, bad Content-Length) as our envelope."""

    def __init__(
        self,
        error: Any,
        max_body: int,
        setting: str = "SERVICE_MAX_BODY_BYTES",
        jsonrpc: bool = False,
    ):
        self.code, self.body, self.max_body = error.code, str(error.body), max_body
        self.setting = setting
        self.jsonrpc = jsonrpc  # on /mcp: a JSON-RPC error instead

    def to_response(self, ident: str | None = None) -> tuple:  # waitress 2.x passes no ident
        status = 400 if self.code == 501 else self.code  # 501: an unknown Transfer-Encoding
        if status == 413:
            message = f"the body is over {self.max_body} bytes ({self.setting})"
        elif status == 431:
            message = "the request headers are too large"
        elif "Content-Length" in self.body:
            message = "Content-Length must be one whole number of bytes"
        elif status < 500:
            message = f"malformed HTTP request: {log_safe(self.body, 200)}"
        else:
            message = "internal error"
        code = STATUS_CODES.get(status, "VALIDATION_ERROR" if status < 500 else "INTERNAL_ERROR")
        body = (
            jsonrpc_error_body(status, code, message) if self.jsonrpc else error_body(code, message)
        )
        headers = [
            ("Content-Type", JSON_TYPE),
            ("X-Request-Id", uuid.uuid4().hex[:16]),
            ("X-Content-Type-Options", "nosniff"),
            ("Cache-Control", "no-store"),
        ]
        return f"{status} {bottle.HTTP_CODES.get(status, 'Error')}", headers, body


@functools.cache
def _hardened(listener_class: type) -> type:
    """Return a subclass of a waitress listener that keeps serving under a connection flood.

    waitress stops accepting at `connection_limit` until a connection closes, so 100 idle
    sockets kept everyone out for the 120 s channel time-out. This one, at the limit,
    closes the connection idle the longest (no request in flight, nothing left to send)
    and takes the new one; only when every connection is busy does it stop accepting.
    Its channels answer waitress's own refusals in the JSON envelope.
    """
    import waitress.channel
    import waitress.parser
    import waitress.task

    class JsonErrorTask(waitress.task.ErrorTask):
        def execute(self):
            adj = getattr(self.request, "adj", None) or self.channel.server.adj
            setting = getattr(adj, "setting", "SERVICE_MAX_BODY_BYTES")
            answers = getattr(self.channel.server.application, "answers_jsonrpc", None)
            path = getattr(self.request, "path", "") or ""
            jsonrpc = bool(answers and answers(path))
            limit = adj.max_request_body_size - 1
            self.request.error = _EnvelopedError(self.request.error, limit, setting, jsonrpc)
            # refused before its body was read: drain what the client still sends (Channel)
            declared = getattr(self.request, "content_length", 0) or 0
            self.channel.linger_budget = min(declared or LINGER_MAX_BYTES, LINGER_MAX_BYTES)
            super().execute()

    class Parser(waitress.parser.HTTPRequestParser):
        """Attachment uploads may be SERVICE_MAX_ATTACHMENT_BYTES, imports
        SERVICE_MAX_IMPORT_BYTES; every other body keeps SERVICE_MAX_BODY_BYTES, refused
        (413) from its declared length before it is read."""

        def parse_header(self, header_plus):
            super().parse_header(header_plus)
            limits = getattr(self.adj, "notesvc_limits", None)
            if limits:
                self.adj = limits[upload_kind(self.command, self.path)]

    class Channel(waitress.channel.HTTPChannel):
        """Closes after an early error like nginx's lingering_close: the answer sent and the
        sending side shut, it reads and discards what the client still sends (at most
        linger_budget bytes, LINGER_SECONDS, LINGER_IDLE_SECONDS between reads) before
        closing, so a client that writes its whole body before reading (urllib) gets the
        413 instead of a reset.

        The lingering readable, writable and handle_read are set on the one channel that
        lingers: every other channel runs waitress's own. The I/O loop calls readable and
        writable on every channel at every turn while holding the GIL, and one more Python
        frame each cost a third of the requests per second (the workers wait for the GIL).
        """

        error_task_class = JsonErrorTask
        parser_class = Parser
        linger_budget = 0  # bytes still drained once the early error's answer is out
        linger_until = 0.0  # while lingering: the monotonic time it ends at the latest

        def handle_close(self) -> None:
            answered = self.connected and not self.total_outbufs_len  # the whole answer is out
            if self.linger_budget > 0 and not self.linger_until and answered:
                try:
                    self.socket.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                else:
                    self.linger_until = time.monotonic() + LINGER_SECONDS
                    self.will_close = self.close_when_flushed = False
                    self.last_activity = time.time()
                    self.readable = self._linger_readable
                    self.writable = self._linger_writable
                    self.handle_read = self._linger_read
                    return
            super().handle_close()

        def _linger_readable(self) -> bool:
            idle = time.time() - self.last_activity > LINGER_IDLE_SECONDS
            if idle or time.monotonic() > self.linger_until:
                self.will_close = True  # closed by handle_write, on this loop's next turn
                return False
            return True

        def _linger_writable(self) -> bool:
            return self.will_close

        def _linger_read(self) -> None:
            try:
                data = self.recv(65536)  # b"" at the client's end: recv closed the channel
            except OSError:
                data = b""
            if data:
                self.last_activity = time.time()
                self.linger_budget -= len(data)
                if self.linger_budget <= 0:
                    self.will_close = True
            elif self.connected:
                super().handle_close()

    class Listener(listener_class):
        channel_class = Channel
        warned_at = 0.0

        def _oldest_idle(self) -> Any:
            idle = [
                c
                for c in list(self._map.values())
                if isinstance(c, Channel) and not c.requests and not c.total_outbufs_len
            ]
            return min(idle, key=lambda c: c.last_activity, default=None)

        def readable(self) -> bool:  # waitress's, less its stop at the limit (and its log)
            now = time.time()
            if now >= self.next_channel_cleanup:  # close connections idle too long
                self.next_channel_cleanup = now + self.adj.cleanup_interval
                self.maintenance(now)
            if not self.accepting:
                return False
            return len(self._map) < self.adj.connection_limit or self._oldest_idle() is not None

        def handle_accept(self) -> None:
            if len(self._map) >= self.adj.connection_limit:
                victim = self._oldest_idle()
                if victim is not None:
                    victim.handle_close()
                now = time.monotonic()
                if now - Listener.warned_at > 60:  # once a minute, not once a connection
                    Listener.warned_at = now
                    log.warning(
                        "%d connections open (SERVICE_MAX_CONNECTIONS): closing the longest "
                        "idle one for each new one",
                        len(self._map),
                    )
            super().handle_accept()

    return Listener


def _body_limited(adj: Any, size: int, setting: str) -> Any:
    """Return a copy of waitress's settings with another largest body, made once: a
    request's parser takes the one its kind of body has (see _hardened). (A wrapper that
    looked each setting up in the listener's cost every request a Python call each time
    waitress read one.)"""
    limited = copy.copy(adj)
    limited.max_request_body_size, limited.setting = size, setting
    return limited


_UPLOAD_RE = re.compile(rf"^(?:/r/[^/]+)?{API}/attachments(?:/.*)?$", re.S)
# a clip (its images inside) and a recording: up to SERVICE_MAX_ATTACHMENT_BYTES, as their
# handlers read them (docs/api.md: Capture)
_CAPTURE_RE = re.compile(rf"^(?:/r/[^/]+)?{API}/capture/(?:clip|voice)(?:\?.*)?$", re.S)


_DAV_PUT_RE = re.compile(rf"^(?:/r/[^/]+)?{DAV_PREFIX}/.*(?<!\.md)$", re.S)


_IMPORT_RE = re.compile(rf"^(?:/r/[^/]+)?{API}/import(?:\?.*)?$", re.S)


def upload_kind(method: str, path: str) -> str:
    """Return which limit a request's body has: "import" (POST /import), "attachment" (the
    API's attachments, a clip or a recording, or a file that is not a note over WebDAV) or
    "" (the others)."""
    if method == "POST" and _IMPORT_RE.match(path or ""):
        return "import"
    if method == "PUT" and _DAV_PUT_RE.match((path or "").split("?", 1)[0]):
        return "attachment"
    if method == "POST" and _CAPTURE_RE.match(path or ""):
        return "attachment"
    return "attachment" if method in ("PUT", "POST") and _UPLOAD_RE.match(path or "") else ""


def _raise_open_files_limit(wanted: int) -> None:
    """Raise the soft limit on open files toward `wanted` (a Pi's default is 1024)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < wanted:
            new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    except (ImportError, ValueError, OSError):  # not Unix, or not allowed: keep the limit
        pass


# -- the running server's effective settings ---------------------------------------------
#
# `serve` records its settings in <state>/effective.json (0600, atomic) once it listens,
# so that `audit` run from cron or a shell audits what the server really uses, not what
# that shell's environment says. Secrets are never written: only whether each is set and
# the figures the audit judges it by (length, entropy per character).

EFFECTIVE_FILE = "effective.json"
_SECRET_NAME_RE = re.compile(r"(secret|api_key|token|password)$")


def _plain(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (tuple, list, set, frozenset)):
        return [_plain(v) for v in value]
    return str(value)


def _as_text(value: Any) -> str:
    """Return a recorded value as the text its Setting parses back."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(_as_text(v) for v in value)
    return "" if value is None else str(value)


def effective_record(config: Config, port: int) -> dict:
    """Return the record of a serving process's settings (no secret in it)."""
    settings, hidden = {}, {}
    for s in SETTINGS:
        value = getattr(config, s.name)
        if _SECRET_NAME_RE.search(s.name):
            text = str(value or "")
            hidden[s.name] = {
                "set": bool(text),
                "bytes": len(text.encode()),
                "bitsPerChar": max(0.0, entropy_bits_per_char(text)),
            }
        else:
            settings[s.name] = _plain(value)
    settings["port"] = int(port)
    return {
        "pid": os.getpid(),
        "uid": os.geteuid() if hasattr(os, "geteuid") else None,
        "startedAt": iso(utcnow()),
        "version": __version__,
        "settings": settings,
        "secrets": hidden,
    }


def config_from_record(record: dict, root: Path) -> Config:
    """Return the Config a record describes, parsed and checked like any other settings."""
    settings, hidden = record.get("settings") or {}, record.get("secrets") or {}
    env = {}
    for s in SETTINGS:
        if s.name in hidden:  # a stand-in: the audit reads the recorded figures instead
            facts = hidden[s.name] if isinstance(hidden[s.name], dict) else {}
            env[s.env] = "*" * max(32, int(facts.get("bytes", 0))) if facts.get("set") else ""
        elif s.name in settings:
            env[s.env] = _as_text(settings[s.name])
    env["SERVICE_NOTES_ROOT"] = str(root)
    return load_config(env)


def running_server(config: Config) -> tuple | None:
    """Return (pid, effective record or None) while a server holds the root's lock.

    Opens the lock file read-only and takes no lock it keeps: nothing is written.
    """
    if fcntl is None:
        return None
    try:
        fd = os.open(config.state_dir / "notesvc.lock", os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
    finally:
        os.close(fd)
    try:
        record = json.loads((config.state_dir / EFFECTIVE_FILE).read_text("utf-8"))
    except (OSError, ValueError):
        record = None
    if not isinstance(record, dict) or str(record.get("pid")) != pid:
        record = None  # left by an earlier server, or this one has not written it yet
    return pid, record


def make_server(app: Callable, config: Config):
    """Return a server bound to host:port: waitress, else wsgiref with a warning.

    waitress takes bodies up to SERVICE_MAX_BODY_BYTES (attachment uploads: up to
    SERVICE_MAX_ATTACHMENT_BYTES) and refuses a larger declared Content-Length before
    reading any body, in the JSON envelope. It passes X-Forwarded-* through: the app
    decides whom to trust (client_address), under any WSGI server.
    """
    try:
        import waitress.server
    except ImportError:
        from socketserver import ThreadingMixIn
        from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

        class ThreadingServer(ThreadingMixIn, WSGIServer):
            daemon_threads = True

        class QuietHandler(WSGIRequestHandler):
            def log_message(self, *args):  # our middleware logs requests
                pass

        log.warning("waitress is not installed; using wsgiref (slower): pip install waitress")
        server = make_server(
            config.host, config.port, app, ThreadingServer, handler_class=QuietHandler
        )
        server.effective_port = server.server_port
        server.run = server.serve_forever
        server.close = server.shutdown
        return server
    max_body = max(
        config.max_body_bytes,
        config.max_attachment_bytes + MULTIPART_SLACK,
        config.max_import_bytes + MULTIPART_SLACK,
    )
    _raise_open_files_limit(config.max_connections + 256)
    sockets: dict = {}
    server = waitress.server.create_server(
        app,
        map=sockets,
        host=config.host,
        port=config.port,
        threads=config.threads,
        max_request_body_size=max_body + 1,  # waitress refuses a body of this size or more
        connection_limit=config.max_connections,
        channel_timeout=config.idle_timeout,
        cleanup_interval=max(1, min(5, config.idle_timeout // 2)),
        asyncore_use_poll=True,  # select() cannot watch descriptors past FD_SETSIZE (1024)
        clear_untrusted_proxy_headers=False,  # waitress 3 strips X-Forwarded-* otherwise
        ident="notesvc",
    )
    try:  # waitress internals, the same in 2.1 and 3.0; another version serves as it is
        import waitress.channel
        import waitress.task

        channel, task = waitress.channel.HTTPChannel, waitress.task.ErrorTask
        for cls, name in (
            (waitress.server.BaseWSGIServer, "maintenance"),
            (waitress.server.BaseWSGIServer, "next_channel_cleanup"),
            (channel, "last_activity"),
            (channel, "total_outbufs_len"),
            (channel, "error_task_class"),
            (channel, "parser_class"),
            (task, "execute"),
            (waitress.task.ThreadedTaskDispatcher, "queue_logger"),
        ):
            getattr(cls, name)
        server.task_dispatcher.queue_logger = QueueNotice(config.threads)
        for listener in sockets.values():
            if isinstance(listener, waitress.server.BaseWSGIServer):
                listener.__class__ = _hardened(type(listener))
                server.notesvc_listener = listener  # spliced connections join it (passthrough)
                # the limit of every body but an attachment's (Parser, in _hardened)
                adj = listener.adj
                listener.adj.notesvc_limits = {
                    "": _body_limited(adj, config.max_body_bytes + 1, "SERVICE_MAX_BODY_BYTES"),
                    "attachment": _body_limited(
                        adj,
                        config.max_attachment_bytes + MULTIPART_SLACK + 1,
                        "SERVICE_MAX_ATTACHMENT_BYTES",
                    ),
                    "import": _body_limited(
                        adj,
                        config.max_import_bytes + MULTIPART_SLACK + 1,
                        "SERVICE_MAX_IMPORT_BYTES",
                    ),
                }
    except (AttributeError, ImportError, TypeError) as e:
        log.warning("this waitress differs (%s): no guard against connection floods", e)
        for listener in sockets.values():  # one limit then: SERVICE_MAX_BODY_BYTES
            with contextlib.suppress(AttributeError):
                listener.adj.max_request_body_size = config.max_body_bytes + 1
    return server


class QueueNotice:
    """waitress's "Task queue depth is N", said at most once a minute, with how often.

    waitress warns each time a request finds every thread busy, on its I/O thread and
    written at once: a burst makes a line per request (8,000 in 14 s under 16 connections,
    9 % of the GIL's samples in py-spy), filling the log of a Pi with one sentence.
    """

    EVERY_SECONDS = 60.0

    def __init__(self, threads: int):
        self.threads = threads
        self.waited = self.deepest = 0  # since the last notice
        self.quiet_until = 0.0

    def warning(self, msg: str, *args) -> None:  # waitress: warning("...%d", depth)
        depth = args[0] if args and isinstance(args[0], int) else 1
        self.waited += 1
        self.deepest = max(self.deepest, depth)
        now = time.monotonic()
        if now < self.quiet_until:
            return
        self.quiet_until = now + self.EVERY_SECONDS
        waited, deepest, self.waited, self.deepest = self.waited, self.deepest, 0, 0
        log.warning(
            "%d request(s) waited for a free thread (SERVICE_THREADS=%d, at most %d "
            "waiting) since the last such line; if answers are slow, raise it",
            waited,
            self.threads,
            deepest,
        )


def print_banner(config: Config, state: dict, port: int) -> None:
    host = config.host if config.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    host = f"[{host}]" if ":" in host else host
    url = config.public_url or f"http://{host}:{port}"
    terminal = _is_terminal(sys.stderr)
    phone = phone_url(config, port)
    lines = [
        f"notesvc {__version__} serving {config.notes_dir}",
        f"  listening on http://{host}:{port} (bind {config.host or '*'}:{port})",
        (
            f"  on your phone: {phone}" + ("  (or scan the code below)" if terminal else "")
            if not is_loopback(config.host)
            else f"  in a browser on this machine: {phone}  (phones need --host 0.0.0.0)"
        ),
        f"  API:    {url}{API}",
        f"  setup:  {url}{API}/system/setup",
    ]
    if state.get("setupComplete"):
        lines.append(f"  add a device: {self_command()} pair")
        lines.append(f"  lost the key? run: {self_command()} rotate-key")
    elif terminal:
        lines.append("  first:  open that address in a browser: it sets this server up")
        lines.append(f"  key:    {state.get('apiKey', '')}  (shown until setup completes)")
    else:  # a journal or a log file keeps what it is given: no key there
        lines.append("  first:  open that address in a browser: it sets this server up")
        lines.append(
            "  key:    not logged; open the setup URL on this machine, "
            f"or run: {self_command()} rotate-key"
        )
    print("\n".join(lines), file=sys.stderr, flush=True)
    if terminal:  # a journal keeps text, not pictures
        print_qr(phone, sys.stderr)


def print_qr(text: str, out: Any) -> bool:
    """Print text as a QR code of Unicode blocks (segno, when installed); False without."""
    try:
        import segno
    except ImportError:
        return False
    segno.make(text, error="m").terminal(out=out, compact=True)
    out.flush()
    return True


def _is_terminal(stream: Any) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no stream, or a closed one
        return False


def cmd_serve(config: Config) -> int:
    lock_fd = take_process_lock(config)
    try:
        app = create_app(config)
        try:
            server = make_server(app, config)
        except OSError as e:
            raise ConfigError(f"cannot listen on {config.host}:{config.port}: {e.strerror}") from e
        import signal

        def stop(*_):
            # Waiting change feeds let go of their threads first: waitress's own
            # shutdown waits up to 5 s for busy threads.
            app.service.journal.close()
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, stop)  # systemd's stop: shut down cleanly, exit 0
        signal.signal(signal.SIGINT, stop)  # Ctrl-C, likewise
        if config.relay_url and config.pairing == "relay":
            listener = getattr(server, "notesvc_listener", None)
            app.service.relay_client = RelayClient(app, listener).start()
        effective = config.state_dir / EFFECTIVE_FILE
        try:
            record = effective_record(config, server.effective_port)
            atomic_write(effective, json.dumps(record, indent=2).encode("utf-8"), mode=0o600)
            print_banner(config, app.service.state.read(), server.effective_port)
            settle_after_start()  # what compiling this module and starting up left free
            server.run()
        except KeyboardInterrupt:
            log.info("stopping")
        finally:
            with contextlib.suppress(OSError):
                effective.unlink()
            with contextlib.suppress(Exception):
                server.close()
            if app.service.relay_client:
                app.service.relay_client.stop()
            app.service.close()
    finally:
        os.close(lock_fd)
    return 0


def cmd_relay(config: Config) -> int:
    """Run a relay only: no notes, no keys, just forwarding (asyncio, one thread)."""
    import signal

    _raise_open_files_limit(1 << 20)  # a relay holds a socket per server and client
    relay = RelayServer(config)

    async def run() -> None:
        try:
            port = await relay.start()
        except OSError as e:
            what = "a port it needs (HTTP, TLS or DNS)" if relay.front else f"{config.port}"
            raise ConfigError(f"cannot listen on {config.host}, {what}: {e.strerror}") from e
        settle_after_start()  # what compiling this module left free
        host = config.host if config.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        lines = [
            f"notesvc {__version__} relay",
            f"  listening on http://{host}:{port} (bind {config.host}:{port})",
            f"  servers register with SERVICE_RELAY_URL=http://<this host>:{port}",
            f"  phones open http://<this host>:{port}/?relayCode=<the server's relay code>",
        ]
        domain = config.relay_domain
        if relay.front is not None:  # passthrough: the TLS port and the DNS
            lines.append(f"  passthrough: TLS on {host}:{relay.front.port} for <serverId>.{domain}")
            if relay.dns is not None:
                lines.append(f"  dns on {host}:{relay.dns.port} (udp, tcp) for {domain}")
            else:
                lines.append(f"  dns: challenge records to {config.relay_dns_update} (RFC 2136)")
        print("\n".join(lines), file=sys.stderr, flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("relay stopping")
        relay.hub.close()  # long-polls and waiting clients answer now
        relay.close()
        await asyncio.sleep(0.2)  # let those answers go out

    asyncio.run(run())
    return 0


def _user_name(uid: int) -> str:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return f"#{uid}"  # sudo -u takes a numeric id this way


def _owned_state(config: Config, command: str) -> StateStore:
    """Return the root's state, written as the state folder's owner.

    Root writes it as that owner (chown before the atomic rename); another user stops
    with the sudo line to use, so the service never finds its state owned by someone else.
    """
    folder = os.stat(config.state_dir)
    euid = os.geteuid() if hasattr(os, "geteuid") else folder.st_uid
    name = _user_name(folder.st_uid)
    hint = (
        f"the state at {config.state_dir} belongs to {name}; run: "
        f"sudo -u {name} {self_command()} {command} --root {config.root}"
    )
    owner = None
    if euid != folder.st_uid:
        if euid != 0:
            raise ConfigError(hint)
        owner = (folder.st_uid, folder.st_gid)
    store = StateStore.open_existing(config.state_dir, owner=owner)
    store.permission_hint = hint
    return store


def cmd_rotate_key(config: Config) -> int:
    """Print a new key (written as the state folder's owner, see _owned_state)."""
    store = _owned_state(config, "rotate-key")
    was_complete = bool(store.read().get("setupComplete"))

    def change(data: dict) -> str:
        data["setupComplete"] = True  # run on the server: setup is done (key kept hashed)
        return rotate_key(data)

    try:
        key = store.update(change)
    except PermissionError:
        raise ConfigError(store.permission_hint) from None
    print(key)
    print(
        "The old key stopped working; a running notesvc picks this one up at once."
        + ("" if was_complete else " Setup is complete: the key is offered to no one now."),
        file=sys.stderr,
    )
    return 0


def cmd_pair(config: Config, args: argparse.Namespace) -> int:
    """Print a one-time pairing link and its QR code (a running server honours it at once:
    it reads the state file again when it changes)."""
    store = _owned_state(config, "pair")
    running = running_server(config)
    if running and running[1]:  # the address the running server's banner gives phones
        config = config_from_record(running[1], config.root)
    name = clean_name(args.name, "device")
    raw = (args.folder or "").strip().strip("/")
    try:
        folder = folder_path(raw if raw.startswith(NOTES) else f"{NOTES}/{raw}") if raw else None
        made = new_pairing(config, GrantStore(store), name, args.scope, folder, None, MADE_BY_CLI)
    except PermissionError:
        raise ConfigError(store.permission_hint) from None
    except ApiError as e:
        raise ConfigError(e.message) from None
    minutes = max(1, round(config.pairing_ttl / 60))
    where = f", folder {folder}" if folder else ""
    print(f"Scan this with the phone's camera, or open the link (good once, {minutes} min):")
    if not print_qr(made["url"], sys.stdout):
        code = "-".join(made["secret"][i : i + 4] for i in range(0, len(made["secret"]), 4))
        print(f"  (install python3-segno for a QR code; or type the code {code})")
    print(made["url"])
    print(f"The device may {args.scope}{where}; it is listed, and revoked, as {name!r}.")
    return 0


def cmd_audit(config: Config) -> int:
    """Print the security audit; exit 1 when a critical finding exists (for cron / CI).

    Audits the running server's recorded settings while one holds the root's lock, else
    this command's own; writes nothing and never imports plugin code.
    """
    StateStore.open_existing(config.state_dir, readonly=True)  # no state: one line, exit 2
    service_uid, secrets_seen = os.stat(config.state_dir).st_uid, None
    running = running_server(config)
    if running and running[1]:
        pid, record = running
        try:
            config = config_from_record(record, config.root)
        except ConfigError as e:
            subject = (
                f"the running server (pid {pid}) recorded settings this version cannot "
                f"read ({e}); auditing this command's own settings instead"
            )
        else:
            subject = (
                f"auditing the running server (pid {pid}, started {record.get('startedAt')})"
                " with its effective settings"
            )
            secrets_seen = record.get("secrets") or {}
            if isinstance(record.get("uid"), int):
                service_uid = record["uid"]
    elif running:
        subject = (
            f"a server (pid {running[0]}) holds this root but has recorded no settings yet; "
            "auditing this command's own settings (flags and SERVICE_* variables)"
        )
    else:
        subject = (
            "no server is running on this root; auditing this command's own settings "
            "(flags and SERVICE_* variables)"
        )
    svc = build_service(config, readonly=True)  # imports no plugin, starts nothing
    svc.service_uid, svc.recorded_secrets = service_uid, secrets_seen
    report = run_audit(svc)
    marks = {"critical": "!!", "high": "! ", "medium": "- ", "low": ". ", "info": "  "}
    print(f"notesvc {__version__} security audit of {config.root}")
    print(subject)
    print(
        f"score {report['score']}/100  "
        + "  ".join(f"{k} {v}" for k, v in report["summary"].items())
    )
    for f in report["findings"]:
        print(f"\n{marks[f['severity']]} [{f['severity']}] {f['title']} ({f['id']})")
        print(f"     {f['detail']}")
        print(f"     fix: {f['recommendation']}")
    return 1 if report["summary"]["critical"] else 0


class Progress:
    """Prints a progress line at most every `every` seconds (and never on a quick run)."""

    def __init__(self, every: float = 2.0, out: Any = None):
        self.every, self.out = every, out or sys.stderr
        self.next = time.monotonic() + every

    def __call__(self, line: Callable[[], str]) -> None:
        now = time.monotonic()
        if now >= self.next:
            self.next = now + self.every
            print(line(), file=self.out, flush=True)


def print_import_report(report: dict) -> None:
    dry = report["dryRun"]
    verb = "would create" if dry else "created"
    missing = report.get("missing", 0)
    print(
        f"{'Dry run: ' if dry else ''}{verb} {plural(report['created'], 'note')} and "
        f"{plural(report['attachments'], 'file')} in {report['into']} (from {report['kind']}); "
        f"{report['renamed']} renamed to a free name, {len(report['skipped'])} skipped"
        + (f" ({plural(missing, 'file')} named but not in the source)" if missing else "")
    )
    for s in report["skipped"][:50]:
        print(f"  skipped {s['source']}: {s['reason']}")
    if len(report["skipped"]) > 50:
        print(f"  ... and {len(report['skipped']) - 50} more")
    if dry:
        print("Nothing was written. Run again without --dry-run to import.")


def cmd_import(config: Config, args: argparse.Namespace) -> int:
    """Import a folder or a file; a running server does it itself (its index, history and
    change feed see every note), else this process does, holding the root's lock."""
    source = Path(args.source).expanduser()
    if not source.exists():
        raise ConfigError(f"no file or folder at {source}")
    into = args.into
    what = "checking" if args.dry_run else "importing"
    print(
        f"notesvc: {what} {source} (a line every 2 s while it works)", file=sys.stderr, flush=True
    )
    running = running_server(config)
    if running:
        report = _import_through_server(config, running, source, into, args.dry_run)
    else:
        lock = take_process_lock(config)
        svc = Service(config, PLUGINS, *provider_registries(PLUGINS))
        try:
            svc.start()
            tick = Progress()

            def progress(plan: ImportPlan) -> None:
                tick(
                    lambda: (
                        f"  read {plural(plan.read, 'file')}; wrote "
                        f"{plural(plan.created, 'note')} and "
                        f"{plural(plan.attachments, 'file')} so far..."
                    )
                )

            try:
                report = import_path(svc, source, into, args.dry_run, progress)
            except ApiError as e:
                raise ConfigError(e.message) from None
        finally:
            svc.close()
            os.close(lock)
    print_import_report(report)
    return 0


def _import_through_server(
    config: Config, running: tuple, source: Path, into: Any, dry_run: bool
) -> dict:
    """Send the import to the server holding the root: as a zip (a folder is zipped first)
    with a write key made for it and revoked after."""
    import http.client

    pid, record = running
    if not record:
        raise ConfigError(f"a server (pid {pid}) is starting on this root; try again in a moment")
    served = config_from_record(record, config.root)
    host = served.host if served.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    port = int(record.get("port") or served.port)
    grants = GrantStore(_owned_state(config, "import"))
    try:
        made, key = grants.create_key(
            "import (command line)", "write", None, 1 / 24, created_by=MADE_BY_CLI
        )
    except PermissionError:
        raise ConfigError(grants.state.permission_hint) from None
    tick = Progress()
    try:
        with contextlib.ExitStack() as stack:
            if source.is_dir():
                body = stack.enter_context(tempfile.TemporaryFile())
                _zip_folder(source, body, tick, served.max_import_entries)
                ctype = "application/zip"
            else:
                body = stack.enter_context(open(source, "rb"))
                head = body.read(512)
                form = sniff_import(head, source.name) if head else "zip"
                ctype = {
                    "zip": "application/zip",
                    "tar": "application/x-tar",
                    "enex": "application/xml",
                    "keep": "application/json",
                    "text": "text/markdown",
                }[form]
            size = body.seek(0, io.SEEK_END)
            body.seek(0)
            query = urllib.parse.urlencode(
                {"into": into or "", "dryRun": "true" if dry_run else "false"}
            )
            print(f"A server (pid {pid}) holds this root: it does the import.", file=sys.stderr)
            conn = http.client.HTTPConnection(host, port, timeout=3600)
            conn.putrequest("POST", f"{API}/import?{query}")
            conn.putheader("Authorization", f"Bearer {key}")
            conn.putheader("Content-Type", ctype)
            conn.putheader("Content-Length", str(size))
            conn.endheaders()
            sent = 0
            while chunk := body.read(1 << 20):
                conn.send(chunk)
                sent += len(chunk)
                tick(functools.partial("  sent {} of {} MB...".format, sent >> 20, size >> 20))
            started = time.monotonic()
            done = threading.Event()

            def waiting() -> None:
                while not done.wait(2.0):
                    print(
                        f"  the server is importing ({time.monotonic() - started:.0f} s)...",
                        file=sys.stderr,
                        flush=True,
                    )

            threading.Thread(target=waiting, daemon=True).start()
            try:
                resp = conn.getresponse()
                answer = json.loads(resp.read() or b"{}")
            finally:
                done.set()
                conn.close()
    except (OSError, http.client.HTTPException, ValueError) as e:
        raise ConfigError(f"the server on {host}:{port} could not be reached ({e})") from None
    finally:
        grants.revoke(made["id"])
    if resp.status >= 400:
        message = (answer.get("error") or {}).get("message") or f"HTTP {resp.status}"
        raise ConfigError(f"the server refused the import: {message}")
    return answer.get("data", answer)


def _zip_folder(source: Path, out: BinaryIO, tick: Progress, most: int = 1 << 62) -> None:
    """Write the files under source to out as a zip (stored, not compressed), their paths
    relative to it; symlinks and hidden files and folders are left out, .obsidian kept.
    More than `most` files (the server's SERVICE_MAX_IMPORT_ENTRIES) stop it at the one
    past: the server would refuse the zip, so it is not made."""
    import zipfile

    count = 0
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for path in sorted(source.rglob("*")):
            rel = path.relative_to(source).as_posix()
            if path.is_symlink() or not path.is_file():
                continue
            if any(p.startswith(".") and p != ".obsidian" for p in rel.split("/")):
                continue
            count += 1
            if count > most:
                raise ConfigError(import_too_many(most, "the folder holds").message)
            zf.write(path, rel)
            tick(functools.partial("  packing {}...".format, rel[:60]))


def cmd_export(config: Config, args: argparse.Namespace) -> int:
    """Write a zip of every note, attachment and file (what GET /export.zip sends)."""
    out = Path(args.out).expanduser()
    if out.exists():
        raise ConfigError(f"{out} exists already; name another file (nothing is overwritten)")
    if out.suffix.lower() != ".zip":
        raise ConfigError(f"{out}: the export is a zip; name a file ending .zip")
    tick = Progress()
    part = out.with_name(out.name + ".part")
    counts: dict = {}

    def progress(c: dict) -> None:
        counts.update(c)
        tick(lambda: f"  {plural(c['notes'], 'note')} and {plural(c['files'], 'file')} so far...")

    try:
        with open(part, "xb") as f:
            for chunk in export_zip(config.root, OWNER, progress):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, out)
    except BaseException:
        with contextlib.suppress(OSError):
            part.unlink()
        raise
    print(
        f"Exported {plural(counts.get('notes', 0), 'note')} and "
        f"{plural(counts.get('files', 0), 'file')} to {out} ({out.stat().st_size} bytes)."
    )
    return 0


COMMANDS = {
    "serve": cmd_serve,
    "rotate-key": cmd_rotate_key,
    "pair": cmd_pair,
    "audit": cmd_audit,
    "relay": cmd_relay,
    "import": cmd_import,
    "export": cmd_export,
}
CREATING_COMMANDS = ("serve", "relay", "import")  # the others refuse a root without state


def main(argv: list | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = args.command or "serve"
    reads = [s for s in SETTINGS if command in setting_commands(s)]
    for s in SETTINGS:
        if s not in reads and getattr(args, s.name, None) is not None:
            parser.error(f"{s.flag} does not apply to {command}")
    flags = {s.name: getattr(args, s.name, None) for s in reads}
    env = {s.env: os.environ[s.env] for s in reads if s.env in os.environ}
    try:
        config = load_config(env, **flags)
        # no log line shows a thread, process id or process name: not gathered per line
        logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
        BatchedLogHandler.installed = BatchedLogHandler(sys.stderr)
        handlers = [BatchedLogHandler.installed]
        logging.basicConfig(level=config.log_level, format=LOG_FORMAT, handlers=handlers)
        if command not in CREATING_COMMANDS and not (config.state_dir / "state.json").is_file():
            raise ConfigError(
                f"no notesvc state at {config.state_dir} "
                "(start the server there first, or check --root)"
            )
        if command in COMMAND_ARGS:
            return COMMANDS[command](config, args)
        return COMMANDS[command](config)
    except (ConfigError, StateError) as e:
        print(f"notesvc: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"notesvc: error: {e.strerror or e}: {getattr(e, 'filename', '')}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.modules.setdefault("notesvc", sys.modules[__name__])  # plugins `import notesvc`
    sys.exit(main())
