"""notesvc: a self-hosted notes server with an HTTP JSON API, in one file.

Run it:   python notesvc.py            (serves ./data on http://0.0.0.0:3000)
Help:     python notesvc.py --help
Embed:    notesvc.create_app(load_config(...)) is a WSGI application.

Outline (``grep -n '^# ==' notesvc.py``), in the order the data flows:
  Settings        the option table, the loader, the frozen Config
  Errors          ApiError, the envelope, the one renderer of every failure
  Helpers         clock, ids, atomic writes, host validation, JSON bodies
  Notes           path rules, the note record, the store, locks; history, trash and
                  the change journal (what every change leaves behind)
  Search          tokenizer, BM25, the inverted index, its cache
  State and auth  state.json, keys, JWT, lockout
  Service         the object every handler gets as `svc`: state, notes, index, registries
  Providers       AGENT_PROVIDERS and CHANNEL_PROVIDERS (registries of small functions),
                  the channel pipeline
  Plugins         the Plugin record, loading, the built-ins (backlinks, tags, daily)
  Security audit  AUDIT_CHECKS and the score
  Web client      the one self-contained page, served by servers and relays alike
  Relay           `notesvc relay` on asyncio (RelayHub, RelayServer) and the server's
                  RelayClient
  HTTP            handlers per endpoint group, the route
                  table, OpenAPI, NotesApp (middleware) and create_app
  CLI             parser, cmd_* functions, main()
"""

from __future__ import annotations

__version__ = "0.3.0"

import argparse
import array
import asyncio
import base64
import bisect
import collections
import contextlib
import dataclasses
import datetime as dt
import difflib
import errno
import functools
import hashlib
import heapq
import hmac
import importlib.util
import io
import ipaddress
import itertools
import json
import logging
import math
import mmap
import operator
import os
import platform
import posixpath
import re
import secrets
import shutil
import socket
import stat
import struct
import sys
import tempfile
import threading
import time
import unicodedata
import urllib.parse
import uuid
import zlib
from collections import deque
from collections.abc import Container, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Callable

try:
    import bottle
except ImportError:  # `python3 notesvc.py` on a machine without bottle: one line, no traceback
    if __name__ != "__main__":
        raise
    print(
        "notesvc: error: the bottle package is missing; install it with "
        "`sudo apt install python3-bottle python3-waitress` (Debian, Raspberry Pi OS) "
        "or `pip install bottle waitress` in a virtual environment",
        file=sys.stderr,
    )
    sys.exit(2)

try:  # file locks: POSIX only; on other systems the single-process rule is advisory
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

# `python notesvc.py` runs this file as __main__, and CPython keeps a __main__ script's
# whole syntax tree in memory for as long as the script runs: about 30 MB for this file,
# a tenth of a Pi Zero's free memory. So the script hands over at once (exec: the same
# process id, the same open files, the same interpreter options) to an interpreter that
# imports this file as the module `notesvc`, from its cached bytecode when it can (a
# faster start too), and runs main() there.
_MAIN_CODE = (
    "import importlib.util as u, os, sys; f = sys.argv[1]; "
    "sys.path[:1] = [os.path.dirname(f)] if sys.path[:1] == [''] else sys.path[:1]; "
    "s = u.spec_from_file_location('notesvc', f); m = sys.modules['notesvc'] = "
    "u.module_from_spec(s); sys.argv = sys.argv[1:]; s.loader.exec_module(m); sys.exit(m.main())"
)


def _interpreter_options() -> list:
    """Return the command-line options this interpreter runs with (-I, -E, -s, -P, -B,
    -O, -u, -W and -X), for the interpreter that takes over from the script."""
    flags, out = sys.flags, []
    if flags.isolated:
        out.append("-I")
    else:
        out += ["-E"] * bool(flags.ignore_environment) + ["-s"] * bool(flags.no_user_site)
        out += ["-P"] * bool(getattr(flags, "safe_path", False))
    out += ["-B"] * bool(flags.dont_write_bytecode) + ["-O"] * flags.optimize
    out += ["-u"] * bool(getattr(sys.stdout, "write_through", False))
    out += [f"-W{w}" for w in sys.warnoptions]
    out += [f"-X{k}" if v is True else f"-X{k}={v}" for k, v in sys._xoptions.items()]
    return out


if __name__ == "__main__" and os.name == "posix" and sys.executable:
    sys.stdout.flush()
    here = os.path.abspath(__file__)
    options = _interpreter_options()
    os.execv(sys.executable, [sys.executable, *options, "-c", _MAIN_CODE, here, *sys.argv[1:]])  # noqa: S606 - this interpreter, this file

log = logging.getLogger("notesvc")

API = "/api/v1"
KEY_PREFIX = "nsk_"
KEY_HEADER = "X-Service-Key"


# == Settings =================================================================


class ConfigError(Exception):
    """A bad option or value; the CLI prints it as one line and exits 2."""


def _text(raw: str) -> str:
    return raw.strip()


def _port(raw: str) -> int:
    if not raw.strip().isdigit() or not 0 <= int(raw) <= 65535:
        raise ValueError(f"{raw!r} is not a port number (1-65535, or 0 for any free port)")
    return int(raw)


def _int_range(lo: int, hi: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        try:
            value = int(raw.strip())
        except ValueError:
            raise ValueError(f"{raw!r} is not a whole number") from None
        if not lo <= value <= hi:
            raise ValueError(f"{value} is outside {lo}..{hi}")
        return value

    return parse


def _waiters(raw: str) -> int:
    """Parse SERVICE_MAX_WAITERS: a count, or `auto` (-1: half of SERVICE_THREADS)."""
    if raw.strip().lower() in ("", "auto"):
        return -1
    return _int_range(0, 255)(raw)


def _seconds(raw: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        raise ValueError(f"{raw!r} is not a number of seconds") from None
    if not 0 < value <= 3600:
        raise ValueError(f"{value} is outside 0..3600 seconds")
    return value


def _bool(raw: str) -> bool:
    word = raw.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{raw!r} is not true or false")


def _choice(*values: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        word = raw.strip().lower()
        if word not in values:
            raise ValueError(f"{raw!r} is not one of {', '.join(values)}")
        return word

    return parse


def _url(raw: str) -> str:
    raw = raw.strip().rstrip("/")
    if not raw:
        return ""
    parts = urllib.parse.urlsplit(raw)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{raw!r} is not an http(s) URL")
    return raw


def _domain(raw: str) -> str:
    """Parse a DNS name (SERVICE_RELAY_DOMAIN): lower-case labels, at least two of them."""
    name = raw.strip().lower().rstrip(".")
    label = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
    if name and (len(name) > 200 or not re.fullmatch(rf"{label}(?:\.{label})+", name)):
        raise ValueError(f"{raw!r} is not a domain name such as relay.example.org")
    return name


def _origins(raw: str) -> tuple:
    origins = tuple(o.strip().rstrip("/") for o in raw.split(",") if o.strip())
    for origin in origins:
        if origin != "*":
            _url(origin)
    return origins


def _path(raw: str) -> Path:
    return Path(raw.strip() or ".").expanduser()


LOOPBACK_NETS = ("127.0.0.0/8", "::1/128")


def _proxies(raw: str) -> tuple:
    """Parse SERVICE_TRUST_PROXY: false, true (a proxy on loopback) or proxy addresses."""
    word = raw.strip().lower()
    if word in ("0", "false", "no", "off", ""):
        return ()
    if word in ("1", "true", "yes", "on"):
        return LOOPBACK_NETS
    nets = []
    for item in raw.split(","):
        item = item.strip()
        if item:
            try:  # an address or a network (10.0.0.0/8); kept as text for the records
                nets.append(str(ipaddress.ip_network(item.strip("[]"), strict=False)))
            except ValueError:
                raise ValueError(f"{item!r} is not true, false or a proxy's IP address") from None
    return tuple(nets)


def _timezone(raw: str) -> str:
    """Parse SERVICE_TIMEZONE: empty (the system's), or an IANA name such as Europe/Paris.

    A name this machine's time zone database does not know is refused; without any
    database (no tzdata) every name is taken and the system's local time is used, logged.
    """
    name = raw.strip()
    if not name or name.upper() == "UTC":
        return name
    try:
        import zoneinfo
    except ImportError:  # pragma: no cover - Python < 3.9
        return name
    try:
        zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        try:
            zoneinfo.ZoneInfo("Europe/London")
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            return name  # no time zone database here: the system's local time, logged
        raise ValueError(f"{name!r} is not a time zone name (e.g. Europe/Paris)") from None
    return name


def _log_level(raw: str) -> str:
    return _choice("debug", "info", "warning", "error")(raw).upper()


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str  # attribute of Config
    env: str  # environment variable
    flag: str  # command-line flag, "" when there is none
    default: str  # as text, parsed like any other value
    parse: Callable[[str], Any]
    help: str
    commands: tuple = ()  # subcommands that read it; () = see setting_commands()


SETTINGS = (
    Setting("host", "SERVICE_HOST", "--host", "0.0.0.0", _text, "bind host"),
    Setting("port", "SERVICE_PORT", "--port", "3000", _port, "listening port"),
    Setting("root", "SERVICE_NOTES_ROOT", "--root", "./data", _path, "notes root"),
    Setting(
        "auth_mode",
        "SERVICE_AUTH_MODE",
        "--auth-mode",
        "api-key",
        _choice("api-key", "none", "jwt"),
        "api-key, none (development only) or jwt",
    ),
    Setting("jwt_secret", "SERVICE_JWT_SECRET", "", "", str, "HS256 secret for jwt mode"),
    Setting("cors", "SERVICE_CORS_ORIGINS", "--cors", "", _origins, "allowed CORS origins"),
    Setting("public_url", "SERVICE_PUBLIC_URL", "--public-url", "", _url, "canonical URL"),
    Setting(
        "trust_proxy",
        "SERVICE_TRUST_PROXY",
        "",
        "false",
        _proxies,
        "honour X-Forwarded-* from these proxies: true (loopback) or addresses",
    ),
    Setting(
        "setup_local_only",
        "SERVICE_SETUP_LOCAL_ONLY",
        "",
        "false",
        _bool,
        "show the key in the setup payload only to loopback clients",
    ),
    Setting(
        "pairing",
        "SERVICE_PAIRING_MODE",
        "--pairing",
        "relay",
        _choice("relay", "open-port"),
        "relay or open-port",
    ),
    Setting("relay_url", "SERVICE_RELAY_URL", "--relay-url", "", _url, "relay address"),
    Setting("client_url", "SERVICE_CLIENT_URL", "", "", _url, "links.connect.hosted base"),
    Setting("test_client_url", "SERVICE_TEST_CLIENT_URL", "", "", _url, "links.connect.testHosted"),
    Setting("agent_provider", "SERVICE_AGENT_PROVIDER", "", "local", _text, "agent provider"),
    Setting("agent_base_url", "SERVICE_AGENT_BASE_URL", "", "", _url, "OpenAI-compatible URL"),
    Setting("agent_model", "SERVICE_AGENT_MODEL", "", "", _text, "model name"),
    Setting("agent_api_key", "SERVICE_AGENT_API_KEY", "", "", _text, "model API key"),
    Setting("agent_timeout", "SERVICE_AGENT_TIMEOUT", "", "60", _seconds, "model time-out (s)"),
    Setting(
        "agent_max_steps",
        "SERVICE_AGENT_MAX_STEPS",
        "",
        "6",
        _int_range(1, 20),
        "model calls per question in the agent's tool loop",
    ),
    Setting("agent_write", "SERVICE_AGENT_WRITE", "", "false", _bool, "the agent may change notes"),
    Setting("mcp_write", "SERVICE_MCP_WRITE", "", "false", _bool, "MCP clients may change notes"),
    Setting(
        "telegram_api_base",
        "SERVICE_TELEGRAM_API_BASE",
        "",
        "https://api.telegram.org",
        _url,
        "Telegram Bot API base",
    ),
    Setting(
        "whatsapp_api_base",
        "SERVICE_WHATSAPP_API_BASE",
        "",
        "https://graph.facebook.com/v21.0",
        _url,
        "WhatsApp Cloud API base",
    ),
    Setting(
        "max_body_bytes",
        "SERVICE_MAX_BODY_BYTES",
        "",
        "1048576",
        _int_range(1024, 1 << 30),
        "largest request body (bytes)",
    ),
    Setting(
        "rescan_seconds",
        "SERVICE_RESCAN_SECONDS",
        "",
        "5",
        _int_range(0, 86400),
        "external-edit rescan interval (0 = off)",
    ),
    Setting("plugins_dir", "SERVICE_PLUGINS_DIR", "", "", _text, "third-party plugins folder"),
    Setting("threads", "SERVICE_THREADS", "", "8", _int_range(1, 256), "waitress threads"),
    Setting(
        "history_max_versions",
        "SERVICE_HISTORY_MAX_VERSIONS",
        "",
        "50",
        _int_range(0, 100000),
        "versions kept per note, more when younger than SERVICE_HISTORY_DAYS (0 = history off)",
    ),
    Setting(
        "history_days",
        "SERVICE_HISTORY_DAYS",
        "",
        "90",
        _int_range(0, 36500),
        "days every version of a note is kept, whatever their number (0 = count only)",
    ),
    Setting(
        "trash_days",
        "SERVICE_TRASH_DAYS",
        "",
        "30",
        _int_range(0, 36500),
        "days deleted notes stay in the trash (0 = until purged)",
    ),
    Setting(
        "max_waiters",
        "SERVICE_MAX_WAITERS",
        "",
        "auto",
        _waiters,
        "change-feed long-polls held at once (auto: half of SERVICE_THREADS)",
    ),
    Setting(
        "max_connections",
        "SERVICE_MAX_CONNECTIONS",
        "",
        "500",
        _int_range(16, 100000),
        "open connections (at the cap the oldest idle one is closed)",
    ),
    Setting(
        "idle_timeout",
        "SERVICE_IDLE_TIMEOUT",
        "",
        "30",
        _int_range(1, 3600),
        "seconds an idle or incomplete connection is kept",
    ),
    Setting(
        "relay_max_servers",
        "SERVICE_RELAY_MAX_SERVERS",
        "",
        "1000",
        _int_range(1, 100000),
        "relay role: servers it holds",
    ),
    Setting(
        "relay_max_queue",
        "SERVICE_RELAY_MAX_QUEUE",
        "",
        "32",
        _int_range(1, 10000),
        "relay role: requests queued per server",
    ),
    Setting(
        "relay_timeout",
        "SERVICE_RELAY_TIMEOUT",
        "",
        "30",
        _seconds,
        "relay role: seconds a client waits for its server",
    ),
    Setting(
        "relay_registrations_per_minute",
        "SERVICE_RELAY_REGISTRATIONS_PER_MINUTE",
        "",
        "60",
        _int_range(1, 100000),
        "relay role: registrations accepted per client address and minute",
    ),
    Setting(
        "relay_domain",
        "SERVICE_RELAY_DOMAIN",
        "",
        "",
        _domain,
        "relay role: serve each server on its own origin <serverId>.<domain> (wildcard DNS)",
    ),
    Setting(
        "relay_max_idle_per_address",
        "SERVICE_RELAY_MAX_IDLE_PER_ADDRESS",
        "",
        "64",
        _int_range(1, 100000),
        "relay role: idle connections kept per client address (the oldest closed first)",
    ),
    Setting(
        "pairing_ttl",
        "SERVICE_PAIRING_TTL",
        "",
        "600",
        _int_range(10, 86400),
        "seconds a device pairing's one-time secret lives",
    ),
    Setting(
        "max_attachment_bytes",
        "SERVICE_MAX_ATTACHMENT_BYTES",
        "",
        "20971520",
        _int_range(1024, 1 << 34),
        "largest attachment (bytes)",
    ),
    Setting(
        "transcribe_url",
        "SERVICE_TRANSCRIBE_URL",
        "",
        "",
        _url,
        "OpenAI-compatible /audio/transcriptions endpoint for voice messages",
    ),
    Setting("transcribe_model", "SERVICE_TRANSCRIBE_MODEL", "", "whisper-1", _text, "model"),
    Setting("transcribe_api_key", "SERVICE_TRANSCRIBE_API_KEY", "", "", _text, "transcription key"),
    Setting(
        "timezone",
        "SERVICE_TIMEZONE",
        "",
        "",
        _timezone,
        "time zone of daily notes and reminders (default: the system's)",
    ),
    Setting("log_level", "SERVICE_LOG_LEVEL", "--log-level", "info", _log_level, "log level"),
)

# Which subcommands read a setting (each subcommand's --help lists only those). `audit`
# reads what `serve` reads: it audits a server's configuration. A setting whose row names
# no `commands` and is not listed here belongs to serve and audit, or, when its help
# starts with "relay role:", to the relay alone.
SERVER_COMMANDS = ("serve", "audit")
_NETWORK_COMMANDS = ("serve", "audit", "relay")
COMMANDS_OF_SETTING = {
    "root": ("serve", "audit", "rotate-key", "pair"),
    "log_level": ("serve", "audit", "rotate-key", "pair", "relay"),
    # `pair` names the address a phone opens, as the banner does
    **dict.fromkeys(("host", "port", "public_url"), (*_NETWORK_COMMANDS, "pair")),
    "pairing_ttl": ("serve", "audit", "pair"),
    "relay_url": ("serve", "audit", "pair"),
    **dict.fromkeys(
        (
            "trust_proxy",
            "threads",
            "max_body_bytes",
            "max_connections",
            "idle_timeout",
        ),
        _NETWORK_COMMANDS,
    ),
}


def setting_commands(setting: Setting) -> tuple:
    """Return the subcommands that read this setting."""
    if setting.commands:
        return setting.commands
    if setting.name in COMMANDS_OF_SETTING:
        return COMMANDS_OF_SETTING[setting.name]
    return ("relay",) if setting.help.startswith("relay role:") else SERVER_COMMANDS


@dataclasses.dataclass(frozen=True)
class Config:
    """The settings in force: built by load_config() from SETTINGS, whose defaults are the
    only ones (no second copy here)."""

    host: str
    port: int
    root: Path
    auth_mode: str
    jwt_secret: str
    cors: tuple
    public_url: str
    trust_proxy: tuple
    setup_local_only: bool
    pairing: str
    relay_url: str
    client_url: str
    test_client_url: str
    agent_provider: str
    agent_base_url: str
    agent_model: str
    agent_api_key: str
    agent_timeout: float
    agent_max_steps: int
    agent_write: bool
    mcp_write: bool
    telegram_api_base: str
    whatsapp_api_base: str
    max_body_bytes: int
    rescan_seconds: int
    plugins_dir: str
    threads: int
    history_max_versions: int
    history_days: int
    trash_days: int
    max_waiters: int
    max_connections: int
    idle_timeout: int
    relay_max_servers: int
    relay_max_queue: int
    relay_timeout: float
    relay_registrations_per_minute: int
    relay_domain: str
    relay_max_idle_per_address: int
    pairing_ttl: int
    max_attachment_bytes: int
    transcribe_url: str
    transcribe_model: str
    transcribe_api_key: str
    timezone: str
    log_level: str

    @property
    def state_dir(self) -> Path:
        return self.root / ".notesvc"

    @property
    def notes_dir(self) -> Path:
        return self.root / "notes"


def load_config(env: Mapping[str, str] | None = None, **flags: Any) -> Config:
    """Return the Config for these flags and environment (flag > variable > default).

    Raises ConfigError naming the option and the bad value.
    """
    env = os.environ if env is None else env
    values = {}
    for s in SETTINGS:
        if flags.get(s.name) is not None:
            raw, source = str(flags[s.name]), s.flag or s.name
        elif env.get(s.env) is not None:
            raw, source = env[s.env], s.env
        else:
            raw, source = s.default, s.env
        try:
            values[s.name] = s.parse(raw)
        except ValueError as e:
            raise ConfigError(f"{source}: {e}") from None
    if values["auth_mode"] == "jwt" and len(values["jwt_secret"].encode()) < 32:
        raise ConfigError("SERVICE_JWT_SECRET: jwt mode needs a secret of at least 32 bytes")
    if values["max_waiters"] < 0:
        values["max_waiters"] = values["threads"] // 2
    if values["max_waiters"] >= values["threads"]:
        raise ConfigError(
            f"SERVICE_MAX_WAITERS: {values['max_waiters']} would leave none of the "
            f"{values['threads']} SERVICE_THREADS to other requests; use at most "
            f"{values['threads'] - 1}"
        )
    values["root"] = values["root"].resolve()
    return Config(**values)


# == Errors and envelope ======================================================

ERROR_CODES = (  # every error.code the API answers with
    "VALIDATION_ERROR",
    "UNAUTHORIZED",
    "FORBIDDEN",
    "CHANNEL_DISABLED",
    "PLUGIN_DISABLED",
    "NOT_FOUND",
    "METHOD_NOT_ALLOWED",
    "CONFLICT",
    "PRECONDITION_FAILED",
    "PAYLOAD_TOO_LARGE",
    "UNSUPPORTED_MEDIA_TYPE",
    "RATE_LIMITED",
    "INTERNAL_ERROR",
    "UPSTREAM_ERROR",
    "UPSTREAM_TIMEOUT",
    "AGENT_DISABLED",
    "INSUFFICIENT_STORAGE",
    "GONE",
)
STATUS_CODES = {
    400: "VALIDATION_ERROR",
    401: "UNAUTHORIZED",
    403: "FORBIDDEN",
    404: "NOT_FOUND",
    405: "METHOD_NOT_ALLOWED",
    409: "CONFLICT",
    410: "GONE",
    412: "PRECONDITION_FAILED",
    413: "PAYLOAD_TOO_LARGE",
    415: "UNSUPPORTED_MEDIA_TYPE",
    429: "RATE_LIMITED",
    500: "INTERNAL_ERROR",
    502: "UPSTREAM_ERROR",
    503: "AGENT_DISABLED",
    504: "UPSTREAM_TIMEOUT",
    507: "INSUFFICIENT_STORAGE",
}

# Endpoints that SPEC.md replaced: asking for them names the replacement.
REPLACED = {
    ("POST", f"{API}/folders"): f"POST {API}/folders does not exist; "
    f"folders follow from note paths, read them with GET {API}/folders/tree/:path",
    ("GET", f"{API}/agent/tools"): f"GET {API}/agent/tools was replaced by GET {API}/agent/status",
}


class ApiError(bottle.HTTPError):
    """An HTTP error that renders as the JSON error envelope."""

    def __init__(self, status: int, code: str, message: str, headers: dict | None = None):
        super().__init__(status, message, **(headers or {}))
        self.code = code
        self.message = message


class DiskFull(ApiError, OSError):
    """507: a write found the disk (or the owner's quota) full; raised by disk_writes().

    Also an OSError, so code that treats a failed background write as a warning (the index
    cache) goes on doing so.
    """

    def __init__(self, err: OSError):
        super().__init__(507, "INSUFFICIENT_STORAGE", "the disk is full; nothing was changed")
        self.errno, self.strerror, self.filename = err.errno, err.strerror, None

    def __str__(self) -> str:
        return f"{self.message} ({self.strerror})"


class PreconditionFailed(ApiError):
    """412: If-Match named another version of the note than the one there."""

    def __init__(self, message: str):
        super().__init__(412, "PRECONDITION_FAILED", message)


def bad_request(message: str) -> ApiError:
    return ApiError(400, "VALIDATION_ERROR", message)


def not_found(message: str) -> ApiError:
    return ApiError(404, "NOT_FOUND", message)


def gone(message: str) -> ApiError:
    """410 GONE with `resetRequired`: the client must start over (re-list) from now."""
    err = ApiError(410, "GONE", message)
    err.extra = {"resetRequired": True}
    return err


JSON_TYPE = "application/json; charset=utf-8"


def to_json(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def success_body(data: Any) -> bytes:
    """Return the success envelope {"success": true, "data": ...} as bytes."""
    return to_json({"success": True, "data": data})


def error_body(code: str, message: str, **extra: Any) -> bytes:
    """Return the error envelope as bytes: every failure, wherever raised, is this."""
    return to_json({"success": False, "error": {"code": code, "message": message, **extra}})


def jsonrpc_error_body(status: int, code: str, message: str, **extra: Any) -> bytes:
    """Return a failure of a JSON-RPC route (/mcp) that its handler did not answer (auth,
    limits, method): a JSON-RPC 2.0 error (id null) with the HTTP status and the envelope's
    code in `data` (CONTRACT 3)."""
    number = -32600 if status in (400, 413, 415) else -32603 if status >= 500 else -32000
    data = {"status": status, "code": code, **extra}
    error = {"code": number, "message": message, "data": data}
    return to_json({"jsonrpc": "2.0", "id": None, "error": error})


def ok(data: Any, status: int = 200) -> bytes:
    """Return the success envelope as the current response (status and JSON type set)."""
    bottle.response.status = status
    bottle.response.content_type = JSON_TYPE
    return success_body(data)


def render_error(err: bottle.HTTPError) -> bytes:
    """Render every failure, Bottle's own 404/405/500 included, as the error envelope."""
    status = err.status_code
    env = bottle.request.environ
    if isinstance(err, ApiError):
        code, message = err.code, err.message
    else:
        code = STATUS_CODES.get(status, "INTERNAL_ERROR" if status >= 500 else "VALIDATION_ERROR")
        method, path = env.get("REQUEST_METHOD", "GET"), env.get("PATH_INFO", "")
        if status == 404:
            message = REPLACED.get((method, path)) or f"no route for {method} {path}"
        elif status == 405:
            allowed = err.headers.get("Allow", "")
            message = f"{method} is not allowed on {path}; allowed: {allowed}"
        elif status >= 500:
            message = f"internal error; request id {env.get('notesvc.request_id', '-')}"
        else:
            message = str(err.body or bottle.HTTP_CODES.get(status, "error"))
    bottle.response.content_type = JSON_TYPE
    if env.get("notesvc.jsonrpc"):  # set by the app for routes that answer JSON-RPC
        return jsonrpc_error_body(status, code, message, **getattr(err, "extra", {}))
    return error_body(code, message, **getattr(err, "extra", {}))


# == Helpers ==================================================================


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def iso(ts: dt.datetime | float) -> str:
    """Return an ISO 8601 UTC timestamp ending in Z (milliseconds)."""
    if not isinstance(ts, dt.datetime):
        ts = dt.datetime.fromtimestamp(ts, dt.timezone.utc)
    return ts.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ts.microsecond // 1000:03d}Z"


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


def fsync_dir(folder: Path) -> None:
    """Make a rename inside folder durable (no-op where folders cannot be opened)."""
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


_UMASK = os.umask(0)
os.umask(_UMASK)


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
        _atomic_write(path, data, mode, before_replace)


def _atomic_write(
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
            os.fsync(f.fileno())
        if mode is None:
            try:
                mode = os.stat(path).st_mode & 0o777
            except FileNotFoundError:
                mode = 0o666 & ~_UMASK
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


_UNPRINTABLE_RE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def log_safe(text: str, limit: int = 1024) -> str:
    """Return text for one log line: control characters escaped (no forged lines), clipped."""
    return _UNPRINTABLE_RE.sub(lambda m: ascii(m.group())[1:-1], text[:limit])


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


def client_address(config: Config, environ: dict) -> str:
    """Return the client's address: the peer's, or the one a trusted proxy or the relay reports.

    Behind trusted proxies it is the right-most X-Forwarded-For entry that is not itself
    a trusted proxy (entries further left are whatever the client claimed). Relayed
    clients are "relay:<addr>", so they never share a lockout bucket with loopback ones.
    """
    peer = environ.get("REMOTE_ADDR", "")
    if environ.get("notesvc.relayed"):
        return f"relay:{peer or '?'}"
    if not behind_trusted_proxy(config, environ):
        return peer
    found = peer
    for hop in reversed(environ.get("HTTP_X_FORWARDED_FOR", "").split(",")):
        if not hop.strip():
            continue
        ip = ip_of(hop)
        if ip is None:  # not written by a proxy we trust: stop at the last good hop
            break
        found = str(ip)
        if not is_trusted_proxy(config, found):
            break
    return found


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
        body = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise bad_request("the body is not valid UTF-8") from None
    except (ValueError, RecursionError) as e:
        raise bad_request(f"the body is not valid JSON: {str(e)[:120]}") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    return body


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not allowed in JSON")


# Blank text (CONTRACT 3): nothing left once every Unicode White_Space character and every
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


# == Notes ====================================================================

NOTES = "notes"
MAX_PATH_CHARS = 512
MAX_SEGMENT_BYTES = 255
_FORBIDDEN = set('\\:*?"<>|')
# Invisible characters that make a path read as another one (CONTRACT 6).
_BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
_ZERO_WIDTH = frozenset("\u200b\u200c\u200d\u2060\ufeff")
# Scans of a note's text for links, tags and passages read at most this much of it (in
# characters), so one huge note cannot make every such scan slow; the scans are linear.
MAX_SCAN_CHARS = 256 * 1024


def _check_segments(path: str, what: str, top: str = NOTES) -> list:
    """Return the segments of a relative path under `top`, or raise 400 naming the broken rule."""
    if not isinstance(path, str) or not path:
        raise bad_request(f"the {what} path is empty")
    if len(path) > MAX_PATH_CHARS:
        raise bad_request(f"the {what} path is longer than {MAX_PATH_CHARS} characters")
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(f"the {what} path is not valid Unicode") from None
    if any(ord(ch) < 32 or 0x7F <= ord(ch) < 0xA0 for ch in path):
        raise bad_request(f"the {what} path holds a control character")
    if not _BIDI_CONTROLS.isdisjoint(path):
        raise bad_request(
            f"the {what} path holds a bidi control character (U+202A-202E, U+2066-2069)"
        )
    if not _ZERO_WIDTH.isdisjoint(path):
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
        bad = sorted(set(seg) & _FORBIDDEN)
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
    path = unicodedata.normalize("NFC", raw)
    segments = _check_segments(path, "note")
    if len(segments) < 2 or not path.endswith(".md") or segments[-1] == ".md":
        raise bad_request(f"the note path must look like {NOTES}/<name>.md")
    return path


def folder_path(raw: Any) -> str:
    """Return a folder path (`notes` or `notes/...`), NFC-normalised; 400 otherwise."""
    if not isinstance(raw, str):
        raise bad_request("the folder path must be a string")
    path = unicodedata.normalize("NFC", raw).rstrip("/")
    _check_segments(path, "folder")
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


# -- attachments: files notes link to --------------------------------------------------

ATTACHMENTS = "attachments"
# The extensions accepted under attachments/ and the type each is served as: images,
# audio, video, PDF, text, office documents and archives (CONTRACT 20).
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
    segments = _check_segments(path, what, top)
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
    _check_segments(path, "attachment folder", ATTACHMENTS)
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
_FRONT_MATTER_RE = re.compile(r"\A---[ \t]*\n(.*?)\n---[ \t]*(?:\n|\Z)", re.S)


def note_tags(text: str) -> set:
    """Return a note's tags: #tags outside code, and front matter `tags:`, lower-cased (in
    its first MAX_SCAN_CHARS; every pattern here runs in linear time).

    >>> sorted(note_tags("---\\ntags: [Work, home]\\n---\\n# Title #todo\\n#idea `#code` x#no #42"))
    ['home', 'idea', 'todo', 'work']
    """
    tags = set()
    text = text[:MAX_SCAN_CHARS]
    fm = _FRONT_MATTER_RE.match(text)
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
    fm = _FRONT_MATTER_RE.match(text)
    if fm:
        text = text[fm.end() :]
    lines = text.split("\n")
    first = next((i for i, line in enumerate(lines) if line.strip()), len(lines))
    body = "\n".join(lines[first + 1 :])  # the title: a heading, else the first line
    for pattern, replacement in _PREVIEW_DROP:
        body = pattern.sub(replacement, body)
    return " ".join(body.split())[:PREVIEW_CHARS]


# -- three-way merges and names from titles (CONTRACT 24) ------------------------------


MERGE_MAX_EDITS = 500  # lines added or removed between two versions that a merge follows


class _LineDiff:
    """What two lists of lines share, as difflib's get_matching_blocks/get_opcodes say it,
    found by Myers' O(ND) algorithm after the common start and end are set aside (an edit
    is mostly one place in a long note). Beyond MERGE_MAX_EDITS changed lines the middle
    counts as replaced whole: a merge there becomes a conflict copy, never a long stall."""

    def __init__(self, a: list, b: list):
        n, m = len(a), len(b)
        pre = 0
        while pre < n and pre < m and a[pre] == b[pre]:
            pre += 1
        suf = 0
        while suf < n - pre and suf < m - pre and a[n - 1 - suf] == b[m - 1 - suf]:
            suf += 1
        middle = _myers(a[pre : n - suf], b[pre : m - suf], MERGE_MAX_EDITS) or []
        blocks = [(0, 0, pre)] + [(i + pre, j + pre, k) for i, j, k in middle]
        blocks.append((n - suf, m - suf, suf))
        joined: list = []
        for i, j, k in blocks:
            if (
                k
                and joined
                and joined[-1][0] + joined[-1][2] == i
                and joined[-1][1] + joined[-1][2] == j
            ):
                joined[-1] = (joined[-1][0], joined[-1][1], joined[-1][2] + k)
            elif k:
                joined.append((i, j, k))
        self.blocks = [*joined, (n, m, 0)]

    def get_matching_blocks(self) -> list:
        return self.blocks

    def get_opcodes(self) -> list:
        ops, i, j = [], 0, 0
        for ai, bj, size in self.blocks:
            if i < ai or j < bj:
                tag = "replace" if i < ai and j < bj else "delete" if i < ai else "insert"
                ops.append((tag, i, ai, j, bj))
            if size:
                ops.append(("equal", ai, ai + size, bj, bj + size))
            i, j = ai + size, bj + size
        return ops


def _myers(a: list, b: list, limit: int) -> list | None:
    """Return the matching blocks (i, j, size) of a shortest edit script from a to b, or
    None when it takes more than `limit` lines added and removed."""
    n, m = len(a), len(b)
    if not n or not m:
        return []
    v, trace = {1: 0}, []
    for d in range(min(n + m, limit) + 1):
        trace.append(v.copy())
        for k in range(-d, d + 1, 2):
            x = v[k + 1] if k == -d or (k != d and v[k - 1] < v[k + 1]) else v[k - 1] + 1
            y = x - k
            while x < n and y < m and a[x] == b[y]:
                x, y = x + 1, y + 1
            v[k] = x
            if x >= n and y >= m:
                return _snakes(trace, n, m)
    return None


def _snakes(trace: list, x: int, y: int) -> list:
    """Walk Myers' trace back from (x, y): the diagonal runs, first to last."""
    blocks = []
    for d in range(len(trace) - 1, 0, -1):
        v, k = trace[d], x - y
        prev = k + 1 if k == -d or (k != d and v[k - 1] < v[k + 1]) else k - 1
        px = v[prev]
        py = px - prev
        sx = px if prev == k + 1 else px + 1  # where this step's run begins
        if x > sx:
            blocks.append((sx, sx - k, x - sx))
        x, y = px, py
    if x > 0:
        blocks.append((0, 0, x))
    return blocks[::-1]


def _diff(base: list, other: list) -> _LineDiff:
    """Return the line matcher of base to other, lines compared without their endings (a
    note saved with CRLF changes nothing)."""
    return _LineDiff([x.rstrip("\r\n") for x in base], [x.rstrip("\r\n") for x in other])


def _overlap(a: tuple, b: tuple) -> bool:
    """Whether two changes touch the same base lines (two insertions at one place do)."""
    if a[0] == a[1] and b[0] == b[1]:
        return a[0] == b[0]
    if a[0] == a[1]:
        return b[0] < a[0] < b[1]
    if b[0] == b[1]:
        return a[0] < b[0] < a[1]
    return a[0] < b[1] and b[0] < a[1]


def _already_made(h: tuple, changes: list) -> bool:
    """Whether an insertion is part of a change the other side made right there (an edit
    sent again after it was merged): its lines end that change where it inserts after
    it, or begin it where it inserts before it."""
    if h[0] != h[1] or not h[2]:
        return False
    wanted, n = [x.rstrip("\r\n") for x in h[2]], len(h[2])
    for g in changes:
        if g[3] == h[3] or g[0] == g[1] or len(g[2]) < n:
            continue
        lines = [x.rstrip("\r\n") for x in g[2]]
        if (g[1] == h[0] and lines[-n:] == wanted) or (g[0] == h[0] and lines[:n] == wanted):
            return True
    return False


def _apply(base: list, lo: int, hi: int, hunks: list) -> list:
    """Return base[lo:hi] with hunks (start, end, lines; inside that range, in order)."""
    out, at = [], lo
    for i1, i2, lines, _ in hunks:
        out += base[at:i1] + lines
        at = i2
    return out + base[at:hi]


def merge3(base: str, current: str, edit: str) -> tuple:
    """Return (the merged text, whether any change of the edit overlapped one of current's)
    of a three-way line merge: changes on one side are kept, identical changes on both sides
    once, overlapping different ones are a conflict (the current text wins there). Lines
    neither side changed keep current's endings.

    >>> merge3("a\\nb\\nc\\n", "A\\nb\\nc\\n", "a\\nb\\nC\\n")
    ('A\\nb\\nC\\n', False)
    >>> merge3("a\\n", "b\\n", "c\\n")[1]
    True
    """
    b, c, e = (t.splitlines(keepends=True) for t in (base, current, edit))
    for side in (c, e):  # a last line without its newline, followed by more: add it
        if side and not side[-1].endswith(("\n", "\r")):
            side[-1] += "\n"
    to_current = _diff(b, c)
    kept = b[:]  # base lines as current has them, where it kept them
    for i, j, n in to_current.get_matching_blocks():
        kept[i : i + n] = c[j : j + n]
    changes = [
        (i1, i2, other[j1:j2], side)
        for side, other, matcher in ((0, c, to_current), (1, e, _diff(b, e)))
        for tag, i1, i2, j1, j2 in matcher.get_opcodes()
        if tag != "equal"
    ]
    changes = [h for h in changes if not _already_made(h, changes)]
    changes.sort(key=lambda h: (h[0], h[1], h[3]))
    groups: list = []
    for h in changes:
        if groups and any(_overlap(h, g) for g in groups[-1]):
            groups[-1].append(h)
        else:
            groups.append([h])
    out, at, conflict = [], 0, False
    for group in groups:
        lo, hi = min(g[0] for g in group), max(g[1] for g in group)
        out += kept[at:lo]
        ours = [g for g in group if g[3] == 0]
        edited = [g for g in group if g[3] == 1]
        if ours and edited:
            mine, theirs = _apply(b, lo, hi, ours), _apply(b, lo, hi, edited)
            conflict = conflict or [x.rstrip("\r\n") for x in mine] != [
                x.rstrip("\r\n") for x in theirs
            ]
            out += mine
        else:
            out += _apply(b, lo, hi, ours or edited)
        at = hi
    out += kept[at:]
    return "".join(out), conflict


_NAME_DROP_RE = re.compile(
    r'[\x00-\x1f\x7f-\x9f/\\:*?"<>|\u200b-\u200d\u2060\ufeff\u202a-\u202e\u2066-\u2069]'
)
_ANY_HEADING_RE = re.compile(r"^ {0,3}#{1,6}[ \t]+(\S[^\n]*?)[ \t#]*$", re.M)


def title_filename(text: str) -> str:
    """Return the file name (without .md) a note without a path gets from its text: its
    first heading, else its first line, made a safe name of at most 80 characters and 200
    bytes ("untitled" when nothing is left).

    >>> title_filename("\\n  Buy milk: 2 l / 3 eggs?  \\n"), title_filename("## ...\\n")
    ('Buy milk 2 l 3 eggs', 'untitled')
    """
    fm = _FRONT_MATTER_RE.match(text)
    body = text[fm.end() :] if fm else text
    heading = _ANY_HEADING_RE.search(body[: PREVIEW_CHARS * 64])
    first = next((line for line in body.splitlines() if line.strip()), "")
    name = unicodedata.normalize("NFC", heading.group(1) if heading else first)
    name = " ".join(_NAME_DROP_RE.sub(" ", name).split())
    name = name.lstrip(".").rstrip(". ")[:80]
    while len(name.encode("utf-8")) > 200:
        name = name[:-1]
    return name.rstrip(". ") or "untitled"


def _sort_key(name: str) -> tuple:
    return (name.casefold(), name)


def _missing_folders(folder: Path, top: Path) -> list:
    """Return folder and its parents below top that do not exist yet, deepest first."""
    missing = []
    while folder != top and top in folder.parents and not folder.exists():
        missing.append(folder)
        folder = folder.parent
    return missing


def _remove_empty_folders(folder: Path, top: Path) -> None:
    """Remove folder and its parents while they are empty, up to (not including) top."""
    folder = Path(os.path.abspath(folder))
    while folder != top and top in folder.parents:
        try:
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent


def _nfc(name: str) -> str:
    return name if name.isascii() else unicodedata.normalize("NFC", name)


def disk_path(base: Path, path: str) -> Path:
    """Return where an (NFC) path under base is on disk (see NoteStore.on_disk)."""
    target = base / path
    if path.isascii() or os.path.lexists(target):
        return target
    at = base
    segments = path.split("/")
    for i, seg in enumerate(segments):
        step = at / seg
        if not os.path.lexists(step):
            try:
                names = sorted(os.listdir(at)) if not seg.isascii() else []
            except OSError:
                names = []
            same = [n for n in names if unicodedata.normalize("NFC", n) == seg]
            if not same:
                return step.joinpath(*segments[i + 1 :])
            step = at / same[0]
        at = step
    return at


class NoteStore:
    """Markdown files under <root>/notes: the source of truth, read from disk every time.

    Writes are atomic (see atomic_write). A note's writes are serialised by a striped
    lock, so an If-Match check and the write it guards happen as one step; creating,
    moving and deleting also hold the tree lock, so folders are never pruned under a
    writer that is about to fill them.
    """

    STRIPES = 64

    def __init__(
        self,
        root: Path,
        trash: Path,
        history: HistoryStore | None = None,
        journal: ChangeJournal | None = None,
    ):
        self.root = root.resolve()  # <root>/notes
        self.base = self.root.parent
        self.trash = trash
        self.history = history  # what each change replaced (None: nothing kept)
        self.journal = journal  # the change feed (None: nothing recorded)
        self._recent: dict = {}  # folder -> (journal's last entry, paths newest first)
        self._observed = False  # the rescan has run once (observe())
        self._tree = threading.RLock()
        self._stripes = [threading.RLock() for _ in range(self.STRIPES)]
        # listener(event, path, detail), called under the note's lock after each change:
        # ("saved", path, (content, stat)), ("moved", old, (new, stat)), ("deleted", path, None)
        self.listeners: list = []
        # after(event, path, detail): the same events, once the note locks are released
        # (plugin hooks run there, free to write other notes).
        self.after: list = []
        self._local = threading.local()

    # -- paths and locks -------------------------------------------------------------

    def file_of(self, path: str) -> Path:
        """Return the file for a checked note/folder path; 400 when it leads outside."""
        target = self.on_disk(path)
        real = os.path.realpath(target)
        if real != str(self.root) and not real.startswith(str(self.root) + os.sep):
            raise bad_request("the path resolves outside the notes folder (symbolic link?)")
        return target

    def on_disk(self, path: str) -> Path:
        """Return where an (NFC) path is on disk: segment by segment, a name that is not
        there is matched to an entry that normalises to it (NFD names from macOS or
        Syncthing), so such a note is read and written in place under its own name.
        """
        return disk_path(self.base, path)

    @contextlib.contextmanager
    def locked(self, *paths: str, tree: bool = False):
        """Hold the locks of these note paths (and the tree lock); nests in one thread.

        When the outermost lock is released, the `after` listeners get the changes made.
        """
        stripes = sorted({hash(p) % self.STRIPES for p in paths})
        local = self._local
        local.depth = getattr(local, "depth", 0) + 1
        try:
            with contextlib.ExitStack() as stack:
                if tree:
                    stack.enter_context(self._tree)
                for i in stripes:
                    stack.enter_context(self._stripes[i])
                yield
        finally:
            local.depth -= 1
        if local.depth == 0 and getattr(local, "pending", None):
            pending, local.pending = local.pending, []
            for event in pending:
                self._call(self.after, *event)

    def _notify(self, event: str, path: str, detail: Any = None) -> None:
        self._call(self.listeners, event, path, detail)
        if self.after:
            self._local.__dict__.setdefault("pending", []).append((event, path, detail))

    @staticmethod
    def _call(listeners: list, event: str, path: str, detail: Any) -> None:
        for listener in list(listeners):
            try:
                listener(event, path, detail)
            except Exception:
                log.exception("listener %r failed on %s %s", listener, event, path)

    # -- reading ------------------------------------------------------------------

    def _read(self, path: str, trusted: bool = False) -> tuple:
        """Return (bytes, stat) of a note; 404 when there is none.

        `trusted` paths come from our own scan, which never follows links.
        """
        target = self.on_disk(path) if trusted else self.file_of(path)
        try:  # O_NONBLOCK: a named pipe called like a note is skipped, never waited on
            fd = os.open(target, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise not_found(f"no note at {path}") from None
        with open(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise not_found(f"no note at {path}")
            return f.read(), st

    @staticmethod
    def decode(path: str, data: bytes) -> str:
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise ApiError(
                409,
                "CONFLICT",
                f"{path} is not valid UTF-8 on disk; fix its encoding with another editor",
            ) from None

    @staticmethod
    def record(path: str, data: bytes, st: os.stat_result, content: bool = True) -> dict:
        text = data.decode("utf-8", "replace")
        rec = {
            "path": path,
            "title": note_title(text, path),
            "size": len(data),
            "modified": iso(st.st_mtime_ns / 1e9),
            "etag": make_etag(data),
        }
        if content:
            rec["content"] = text
        return rec

    def get(self, path: str) -> dict:
        data, st = self._read(path)
        self.decode(path, data)
        return self.record(path, data, st)

    def exists(self, path: str) -> bool:
        return os.path.isfile(self.file_of(path))

    def _entries(self, folder: str = NOTES):
        """Yield (note path, DirEntry) under a folder path (hidden entries and links skipped).

        Paths are NFC whatever the names on disk.
        """
        stack = [(str(self.on_disk(folder)), folder)]
        while stack:
            real, rel = stack.pop()
            try:
                entries = list(os.scandir(real))
            except (FileNotFoundError, NotADirectoryError, PermissionError):
                continue
            for e in entries:
                if e.name.startswith(".") or e.is_symlink():
                    continue
                name = _nfc(e.name)
                if e.is_dir():
                    stack.append((e.path, f"{rel}/{name}"))
                elif name.endswith(".md") and len(name) > 3:
                    yield f"{rel}/{name}", e

    def walk(self, folder: str = NOTES) -> list:
        """Return every note path under a folder path, sorted."""
        return sorted({path for path, _ in self._entries(folder)})

    def by_modified(self, folder: str = NOTES) -> list:
        """Return every note path under a folder, newest first. Kept until the next change
        the journal records (every write here, and every external edit the rescan finds),
        so a phone asking again and again for its list pays for the files' stat once."""
        seen = self.journal.last if self.journal is not None else None
        kept = self._recent.get(folder)
        if kept is not None and seen is not None and kept[0] == seen:
            return kept[1]
        found = []
        for path, e in self._entries(folder):
            with contextlib.suppress(OSError):  # removed meanwhile
                found.append((-e.stat().st_mtime_ns, path))
        paths = [path for _, path in sorted(found)]
        if seen is not None:
            if len(self._recent) >= 16:
                self._recent.pop(next(iter(self._recent)))
            self._recent[folder] = (seen, paths)
        return paths

    def scan(self) -> dict:
        """Return {note path: (size, mtime_ns)} for every note (the rescan's view)."""
        out = {}
        for path, e in self._entries():
            try:
                st = e.stat()
            except OSError:
                continue
            out[path] = (st.st_size, st.st_mtime_ns)
        return out

    def read_raw(self, path: str) -> tuple:
        """Return (bytes, stat) of a note found by scan() (404 when gone), for the indexer."""
        return self._read(path, trusted=True)

    def list_page(
        self, folder: str, limit: int, offset: int, sort: str = "path", fields: Iterable = ()
    ) -> dict:
        """Return a page of note records (no content): by path, or newest first (`sort`
        "modified"); `fields` may add each note's `preview` and `tags`."""
        if folder != NOTES and not os.path.isdir(self.file_of(folder)):
            raise not_found(f"no folder at {folder}")
        paths = self.by_modified(folder) if sort == "modified" else self.walk(folder)
        page = []
        for path in paths[offset : offset + limit]:
            try:
                data, st = self._read(path)
            except ApiError:  # removed between the walk and the read
                continue
            rec = self.record(path, data, st, content=False)
            if "preview" in fields or "tags" in fields:
                text = data.decode("utf-8", "replace")
                if "preview" in fields:
                    rec["preview"] = note_preview(text)
                if "tags" in fields:
                    rec["tags"] = sorted(note_tags(text))
            page.append(rec)
        return {"notes": page, "total": len(paths), "limit": limit, "offset": offset}

    def tree(
        self, folder: str = NOTES, depth: int | None = None, count: Callable | None = None
    ) -> dict:
        """Return the folder node: folders first, then notes, each by name. With a depth,
        folders below that many levels carry `count(path)` (notes beneath) for `children`."""
        target = self.file_of(folder)
        if not target.is_dir():
            raise not_found(f"no folder at {folder}")
        return self._node(str(target), folder, depth, count or (lambda rel: len(self.walk(rel))))

    def _node(self, real: str, rel: str, depth: int | None = None, count=None) -> dict:
        name = rel.rsplit("/", 1)[-1]
        if depth is not None and depth <= 0:
            return {"name": name, "path": rel, "type": "folder", "count": count(rel)}
        below = None if depth is None else depth - 1
        folders, notes = [], []
        try:
            entries = list(os.scandir(real))
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            entries = []
        for e in entries:
            if e.name.startswith(".") or e.is_symlink():
                continue
            if e.is_dir():
                folders.append(e)
            elif e.name.endswith(".md") and len(e.name) > 3:
                notes.append(e)
        children = [
            self._node(e.path, f"{rel}/{_nfc(e.name)}", below, count)
            for e in sorted(folders, key=lambda e: _sort_key(_nfc(e.name)))
        ]
        for e in sorted(notes, key=lambda e: _sort_key(_nfc(e.name))):
            try:
                st = e.stat()
            except OSError:
                continue
            children.append(
                {
                    "name": _nfc(e.name),
                    "path": f"{rel}/{_nfc(e.name)}",
                    "type": "note",
                    "size": st.st_size,
                    "modified": iso(st.st_mtime_ns / 1e9),
                }
            )
        return {"name": name, "path": rel, "type": "folder", "children": children}

    # -- writing ------------------------------------------------------------------

    @staticmethod
    def encode(content: str) -> bytes:
        try:
            return content.encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request("'content' holds text that is not valid Unicode") from None

    @staticmethod
    def check_match(if_match: str | None, data: bytes | None) -> None:
        """Raise 412 unless If-Match (absent, `*`, or a list of ETags) matches data."""
        if if_match is None:
            return
        tags = [t.strip() for t in if_match.split(",") if t.strip()]
        if data is not None and "*" in tags:
            return
        current = make_etag(data) if data is not None else None
        wanted = {t if t.startswith('"') else f'"{t}"' for t in tags}
        if current is None or current not in wanted:
            raise PreconditionFailed(
                "the note changed since you read it (If-Match does not match its ETag); "
                "read it again and retry"
            )

    def create(self, path: str, content: str) -> dict:
        data = self.encode(content)
        with self.locked(path, tree=True):
            target = self.file_of(path)
            if os.path.lexists(target):
                raise ApiError(409, "CONFLICT", f"a note already exists at {path}; use PUT")
            with self._changing(path), self._new_parents(target):
                atomic_write(target, data)
            st = os.stat(target)
            self._notify("saved", path, (content, st))
            self._record("created", path, data)
            return self.record(path, data, st)

    @contextlib.contextmanager
    def _new_parents(self, target: Path):
        """Create the missing folders of target for the block; remove them again when the
        block fails (a full disk changes nothing)."""
        parent = target.parent
        missing = _missing_folders(parent, self.root)
        try:
            with disk_writes():
                try:
                    parent.mkdir(parents=True, exist_ok=True)
                except (FileExistsError, NotADirectoryError):
                    raise ApiError(
                        409, "CONFLICT", "a file stands where a folder of this path should be"
                    ) from None
            self.file_of(str(target.relative_to(self.base)))  # re-check containment
            yield
        except BaseException:
            for folder in missing:  # deepest first
                with contextlib.suppress(OSError):
                    folder.rmdir()
            raise

    def update(
        self, path: str, content: str, if_match: str | None = None, reason: str = "updated"
    ) -> dict:
        data = self.encode(content)
        with self.locked(path):
            old, seen = self._read(path)
            self.check_match(if_match, old)
            target = self.file_of(path)
            with self._changing(path, old, reason, (target, seen)) as first:
                atomic_write(target, data, before_replace=first)
            st = os.stat(target)
            self._notify("saved", path, (content, st))
            self._record("updated", path, data)
            return self.record(path, data, st)

    def version_with(self, path: str, etag: str) -> bytes | None:
        """Return the content of the note's kept version whose ETag is etag (None: no such
        version: another note's, or one the retention dropped). The history's copy of the
        note counts: another program may have replaced it before the rescan kept it."""
        if self.history is None or not re.fullmatch(r'"[0-9a-f]{32}"', etag or ""):
            return None
        head = self.history.read_head(path) if self.history.enabled else None
        if head is not None and make_etag(head) == etag:
            return head
        folder = self.history.dir_of(path)
        for vid in reversed(self.history.ids(folder)):
            if vid.endswith(etag[1:-1]):
                with contextlib.suppress(ApiError):
                    return self.history.read(path, vid)
        return None

    def merge(self, path: str, base: str, content: str, conflict_name: str) -> dict:
        """Write an edit that started from the version `base` (an ETag): as it is when the
        note is still that version; else merged line-wise three ways with what changed
        since (one atomic write, `merged` in history). When the changes overlap, or `base`
        is unknown, the note stays as it is and the edit is kept beside it as a conflict
        copy: 409 with its path. Returns {note, merged}."""
        self.encode(content)  # too large, not text: refused before anything
        for _ in range(5):  # another write may land in between: merge with that one
            raw, st = self._read(path)
            if make_etag(raw) == base:
                with contextlib.suppress(PreconditionFailed):
                    return {"note": self.update(path, content, base), "merged": False}
                continue
            current = self.decode(path, raw)
            old = self.version_with(path, base)
            if old is None and current == content:  # nothing to keep apart: already so
                return {"note": self.record(path, raw, st), "merged": False}
            merged, clash = (
                merge3(old.decode("utf-8", "replace"), current, content) if old else ("", True)
            )
            if clash:
                break
            with contextlib.suppress(PreconditionFailed):
                rec = self.update(path, merged, make_etag(raw), reason="merged")
                return {"note": rec, "merged": True}
        copy = self.create_beside(path, conflict_name, content)
        err = ApiError(
            409,
            "CONFLICT",
            f"{path} changed where this edit did too: it stays as it was, and the edit is "
            f"kept, whole, as {copy['path']}",
        )
        err.extra = {"path": path, "conflictPath": copy["path"]}
        raise err

    def create_beside(self, path: str, note: str, content: str) -> dict:
        """Create `<name> (<note>).md` beside path (` 2`, ` 3`... when taken); a long name
        is shortened to leave room, so the copy always fits the 255-byte rule."""
        folder, name = path.rsplit("/", 1)
        tail = f" ({note})"
        room = MAX_SEGMENT_BYTES - len(".md 999") - len(tail.encode())
        short = name[:-3].encode()[: max(room, 1)].decode("utf-8", "ignore").rstrip() or "note"
        return self.create_named(folder, short + tail, content)

    def create_named(self, folder: str, name: str, content: str) -> dict:
        """Create the note `<folder>/<name>.md`, or `<name> 2.md`, `<name> 3.md`... when
        taken (never overwriting: each try is an exclusive create)."""
        for n in range(1, 1000):
            candidate = name if n == 1 else f"{name} {n}"
            try:
                return self.create(note_path(f"{folder}/{candidate}.md"), content)
            except ApiError as e:
                if e.status_code != 409:
                    raise
        raise ApiError(409, "CONFLICT", f"too many notes named {name} in {folder}")

    def append(self, path: str, line: str, heading: str) -> dict:
        """Append a line to a note, creating it with a heading when missing (one atomic write)."""
        with self.locked(path, tree=True):
            target = self.file_of(path)
            parents: Any = contextlib.nullcontext()
            try:
                raw, seen = self._read(path)
                old = self.decode(path, raw)
            except ApiError as e:
                if e.status_code != 404:
                    raise
                raw, old = None, f"# {heading}\n\n"
                parents = self._new_parents(target)
            content = old + ("" if old.endswith("\n") else "\n") + line + "\n"
            data = self.encode(content)
            inode = (target, seen) if raw is not None else None
            with self._changing(path, raw, "updated", inode) as first, parents:
                atomic_write(target, data, before_replace=first)
            st = os.stat(target)
            self._notify("saved", path, (content, st))
            self._record("created" if raw is None else "updated", path, data)
            return self.record(path, data, st)

    def rewrite(self, path: str, change: Callable) -> bool:
        """Apply change(text) -> text to a note under its lock; return whether it changed."""
        with self.locked(path):
            data, seen = self._read(path)
            text = self.decode(path, data)
            new = change(text)
            if new == text:
                return False
            raw = self.encode(new)
            target = self.file_of(path)
            with self._changing(path, data, "linksRewritten", (target, seen)) as first:
                atomic_write(target, raw, before_replace=first)
            self._notify("saved", path, (new, os.stat(target)))
            self._record("updated", path, raw)
            return True

    def move(self, path: str, new: str, if_match: str | None = None) -> dict:
        with self.locked(path, new, tree=True):
            data, _ = self._read(path)
            self.check_match(if_match, data)
            self.decode(path, data)
            if new == path:
                return {**self.record(path, data, os.stat(self.file_of(path))), "from": path}
            src, dst = self.file_of(path), self.file_of(new)
            if os.path.lexists(dst):
                raise ApiError(409, "CONFLICT", f"a note already exists at {new}")
            with self._changing(path, data, "moved"), self._new_parents(dst), disk_writes():
                os.replace(src, dst)
            fsync_dir(dst.parent)
            fsync_dir(src.parent)
            self._prune(src.parent)
            self._relocate_history(path, new)
            st = os.stat(dst)
            self._notify("moved", path, (new, st))
            self._record("moved", new, data, origin=path)
            return {**self.record(new, data, st), "from": path}

    def delete(self, path: str, if_match: str | None = None) -> dict:
        with self.locked(path, tree=True):
            data, _ = self._read(path)
            self.check_match(if_match, data)
            src = self.file_of(path)
            trashed = move_to_trash(src, self.trash, path, self._changing(path, data, "deleted"))
            self._prune(src.parent)
            self._notify("deleted", path)
            self._record("deleted", path, None)
        return {"path": path, "deleted": True, **trashed}

    # -- what a change leaves behind: history, the journal, the trash -------------------

    @contextlib.contextmanager
    def _changing(
        self,
        path: str,
        old: bytes | None = None,
        reason: str = "updated",
        inode: tuple | None = None,
    ):
        """Around one change of a note: room for its journal entry, then the content it
        replaces kept as a version (a full disk stops the change here, 507, with nothing
        changed); both are undone when the change itself fails. `inode` (see
        HistoryStore.keep) when the change replaces the note's file by a rename: then it
        gives what atomic_write must run before that rename."""
        journal, history = self.journal, self.history
        if journal is not None:
            journal.reserve()
        try:
            keep = history is not None and old is not None
            vid = history.keep(path, old, reason, inode) if keep else None
        except BaseException:
            if journal is not None:
                journal.release()
            raise
        try:
            yield (lambda: history.durable(path)) if vid and inode else None
        except BaseException:
            if vid:
                history.discard(path, vid)
            if journal is not None:
                journal.release()
            raise
        if vid:
            history.settle(path, vid)

    def _record(self, kind: str, path: str, data: bytes | None, origin: str | None = None):
        """After a change, under the note's lock: its journal entry, then the history's copy
        of the note (in this order: a crash in between leaves the rescan a change to report
        twice, never one to miss)."""
        etag = None if data is None else make_etag(data)
        if self.journal is not None:
            self.journal.append(kind, path, etag, origin)
        if self.history is not None:
            if data is None:
                self.history.drop_head(path)
            else:
                self.history.write_head(path, data, etag)
            if origin is not None:
                self.history.drop_head(origin)

    def _relocate_history(self, old: str, new: str, until_us: int | None = None, copy=False):
        if self.history is None:
            return
        try:
            self.history.relocate(old, new, until_us, copy)
        except OSError as e:  # the note has moved: its history stays findable under `old`
            log.warning("history of %s stays under that path (%s)", log_safe(old), e)

    def _keep_external(self, path: str, head: bytes | None) -> None:
        """Keep what another program replaced (the history's copy of it), as the rescan can."""
        if head is None:
            return
        try:
            vid = self.history.keep(path, head, "external")
            if vid:
                self.history.settle(path, vid)
        except OSError as e:
            log.warning("history: could not keep %s as it was (%s)", log_safe(path), e)

    def observe(
        self, changed: list, removed: list, known: Mapping, present: Iterable[str] = ()
    ) -> None:
        """Record what other programs did to the notes, as the rescan found it: a journal
        entry for each change and, when the history holds a copy of the note, the content
        the change replaced (reason "external"). On the first call the notes `present`
        that have no copy yet get one: the starting point."""
        history, journal = self.history, self.journal
        if history is None or journal is None:
            return
        first, self._observed = not self._observed, True
        quiet, journal.fresh = journal.fresh, False  # a new journal starts from the notes
        if changed and not known and not quiet and not history.enabled:
            journal.reset()  # the index was rebuilt and no copy tells what changed meanwhile
            quiet = True
        for path in changed:
            with self.locked(path):
                try:
                    data, _ = self._read(path, trusted=True)
                except ApiError:
                    continue
                head = history.read_head(path) if history.enabled else None
                if head == data:  # written by us, or only touched
                    continue
                self._keep_external(path, head)
                history.write_head(path, data)
                if not quiet:
                    kind = "updated" if head is not None or path in known else "created"
                    journal.append(kind, path, make_etag(data), reserved=False)
        for path in removed:
            with self.locked(path):
                if os.path.lexists(self.on_disk(path)):
                    continue
                self._keep_external(path, history.read_head(path) if history.enabled else None)
                history.drop_head(path)
                if not quiet:
                    journal.append("deleted", path, reserved=False)
        if first and history.enabled:
            seen = set(changed)
            for path in present:
                if path in seen or (history.dir_of(path) / history.HEAD).exists():
                    continue
                with self.locked(path):
                    try:
                        data, _ = self._read(path, trusted=True)
                    except ApiError:
                        continue
                    if history.read_head(path) is None:
                        history.write_head(path, data)

    def restore_version(self, path: str, vid: str, if_match: str | None = None) -> dict:
        """Make a version the note's content again (recreating a deleted note); the content
        it replaces becomes a version itself. 412 when If-Match does not match the note."""
        if self.history is None:
            raise not_found(f"no version {vid} of {path}")
        with self.locked(path, tree=True):
            data = self.history.read(path, vid)
            target = self.file_of(path)
            try:
                old, seen = self._read(path)
            except ApiError as e:
                if e.status_code != 404:
                    raise
                old = seen = None
            self.check_match(if_match, old)
            parents = self._new_parents(target) if old is None else contextlib.nullcontext()
            inode = (target, seen) if old is not None else None
            with self._changing(path, old, "restored", inode) as first, parents:
                atomic_write(target, data, before_replace=first)
            st = os.stat(target)
            self._notify("restored", path, (data.decode("utf-8", "replace"), st))
            self._record("restored", path, data)
            return self.record(path, data, st)

    def restore_trashed(self, item: TrashItem, target: str) -> dict:
        """Move a trashed note back, to its own path or another; 409 when a note is there.
        Its history comes with it."""
        with self.locked(target, item.path, tree=True):
            dst = self.file_of(target)
            if os.path.lexists(dst):
                raise ApiError(
                    409,
                    "CONFLICT",
                    f'a note already exists at {target}; restore elsewhere with {{"path": ...}}',
                )
            try:
                with open(item.file, "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                raise not_found(f"no item {item.id} in the trash") from None
            with self._changing(target), self._new_parents(dst), disk_writes():
                os.replace(item.file, dst)
            fsync_dir(dst.parent)
            fsync_dir(item.file.parent)
            _remove_empty_folders(item.file.parent, self.trash)  # as Trash.emptied()
            if target != item.path:  # the versions it had when deleted (a second's slack)
                live = os.path.isfile(self.on_disk(item.path))
                until = int((item.deleted + 1) * 1_000_000)
                self._relocate_history(item.path, target, until, copy=live)
            st = os.stat(dst)
            self._notify("restored", target, (data.decode("utf-8", "replace"), st))
            self._record("restored", target, data)
            return self.record(target, data, st)

    def sweep_history(self, fix_modes: bool = False) -> int:
        """Apply the history's retention to every note and drop the copies of notes that
        are gone; return how many versions were removed."""
        history, removed = self.history, 0
        if history is None:
            return 0
        for folder in history.folders():
            path = history.head_path(folder)
            try:
                path = note_path(path) if path is not None else None
            except ApiError:
                path = None
            if path is not None and history.dir_of(path) == folder:
                with self.locked(path):
                    if not os.path.isfile(self.on_disk(path)):
                        history.drop_head(path)
            removed += history.sweep(folder, fix_modes)
        return removed

    def _prune(self, folder: Path) -> None:
        """Remove folder and its parents while they are empty (never notes/ itself)."""
        _remove_empty_folders(folder, self.root)

    def sweep_temp_files(self) -> int:
        """Remove the temp files a crash left in the notes and in the state folder (its
        trash and every subfolder); return how many."""
        state = self.trash.parent
        return sweep_temp_files(self.root, skip_hidden=True) + (
            sweep_temp_files(state, skip_hidden=False) if state.is_dir() else 0
        )


def attachment_etag(st: os.stat_result) -> str:
    """Return a strong validator of an attachment: every write is a new file (atomic
    rename: a new inode), and an edit in place changes its size or modification time."""
    seed = f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}".encode()
    return '"' + hashlib.sha256(seed).hexdigest()[:32] + '"'


def _check_etag(if_match: str | None, current: str | None, what: str) -> None:
    """Raise 412 unless If-Match (absent, `*`, or a list of ETags) matches current."""
    if if_match is None:
        return
    tags = [t.strip() for t in if_match.split(",") if t.strip()]
    if current is not None and "*" in tags:
        return
    wanted = {t if t.startswith('"') else f'"{t}"' for t in tags}
    if current is None or current not in wanted:
        raise ApiError(
            412,
            "PRECONDITION_FAILED",
            f"the {what} changed since you read it (If-Match does not match its ETag)",
        )


class AttachmentStore:
    """Files under <root>/attachments: uploads, and photos, voice and files from channels.

    Paths follow the note rules (prefix attachments/) with an allowlist of extensions.
    A body is first written to a temp file in the attachments folder (flushed, fsynced),
    then renamed into place and the folder fsynced: a crash leaves the old file or the
    new one, and at most a temp file that the next start sweeps. Deleting moves the file
    into the notes' trash, <state>/trash/<UTC stamp>/attachments/...
    """

    MAX_SIBLINGS = 1000  # numbered names tried for an upload that must not overwrite

    def __init__(self, root: Path, trash: Path, nfd_names: bool = False):
        self.root = root.resolve()  # <root>/attachments (created on the first upload)
        self.base = self.root.parent
        self.trash = trash
        self.nfd_names = nfd_names  # names on disk matched as the notes' are (see on_disk)
        self._lock = threading.RLock()  # one change of the tree at a time

    # -- reading -------------------------------------------------------------------

    def file_of(self, path: str) -> Path:
        """Return the file of a checked path; 400 when it resolves outside attachments/."""
        target = disk_path(self.base, path) if self.nfd_names else self.base / path
        real = os.path.realpath(target)
        if real != str(self.root) and not real.startswith(str(self.root) + os.sep):
            raise bad_request("the path resolves outside the attachments folder (symbolic link?)")
        return target

    @staticmethod
    def record(path: str, st: os.stat_result) -> dict:
        return {
            "path": path,
            "size": st.st_size,
            "contentType": content_type_of(path),
            "modified": iso(st.st_mtime_ns / 1e9),
            "etag": attachment_etag(st),
        }

    def open(self, path: str) -> tuple:
        """Return (open binary file, stat) of an attachment; 404 when there is none."""
        try:  # O_NONBLOCK: a named pipe is refused below, never waited on
            fd = os.open(self.file_of(path), os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise not_found(f"no attachment at {path}") from None
        f = open(fd, "rb")  # noqa: SIM115 - handed to the caller
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            f.close()
            raise not_found(f"no attachment at {path}")
        return f, st

    def get(self, path: str) -> dict:
        try:
            st = os.stat(self.file_of(path))
        except (FileNotFoundError, NotADirectoryError):
            raise not_found(f"no attachment at {path}") from None
        if not stat.S_ISREG(st.st_mode):
            raise not_found(f"no attachment at {path}")
        return self.record(path, st)

    def _entries(self, folder: str = ATTACHMENTS):
        """Yield (path, DirEntry) of the attachments under a folder (hidden entries, links and
        other extensions left out)."""
        stack = [(str(self.base / folder), folder)]
        while stack:
            real, rel = stack.pop()
            try:
                entries = list(os.scandir(real))
            except (FileNotFoundError, NotADirectoryError, PermissionError):
                continue
            for e in entries:
                if e.name.startswith(".") or e.is_symlink():
                    continue
                name = _nfc(e.name)
                if e.is_dir():
                    stack.append((e.path, f"{rel}/{name}"))
                elif name.rpartition(".")[2].lower() in ATTACHMENT_TYPES and "." in name[1:]:
                    yield f"{rel}/{name}", e

    def paths(self) -> list:
        """Return every attachment path, sorted."""
        return sorted(path for path, _ in self._entries())

    def stats(self) -> tuple:
        """Return (count, total bytes) of the attachments."""
        count = size = 0
        for _, e in self._entries():
            with contextlib.suppress(OSError):
                size += e.stat().st_size
                count += 1
        return count, size

    def list_page(self, folder: str, limit: int, offset: int) -> dict:
        if folder != ATTACHMENTS and not os.path.isdir(self.file_of(folder)):
            raise not_found(f"no folder at {folder}")
        found = sorted(self._entries(folder), key=lambda item: item[0])
        page = []
        for path, e in found[offset : offset + limit]:
            try:
                page.append(self.record(path, e.stat()))
            except OSError:  # removed meanwhile
                continue
        return {"attachments": page, "total": len(found), "limit": limit, "offset": offset}

    # -- writing ------------------------------------------------------------------

    def check(self, path: str, if_match: str | None, if_none_match: str | None) -> bool:
        """Check a write's preconditions (If-Match, If-None-Match: *); return whether an
        attachment exists at path. 412 when they fail, 409 when a folder stands there."""
        target = self.file_of(path)
        exists = os.path.lexists(target)
        if exists and not os.path.isfile(target):
            raise ApiError(409, "CONFLICT", f"a folder stands at {path}")
        if if_none_match is not None and if_none_match.strip() == "*" and exists:
            raise ApiError(
                412, "PRECONDITION_FAILED", f"an attachment exists at {path} (If-None-Match: *)"
            )
        _check_etag(if_match, attachment_etag(os.stat(target)) if exists else None, "attachment")
        return exists

    def spool(self, write: Callable) -> Path:
        """Return a temp file in the attachments folder holding what write(file) wrote,
        flushed and fsynced; 507 on a full disk (and no temp file left)."""
        with disk_writes():
            self.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=TEMP_SUFFIX, dir=self.root)
            try:
                with os.fdopen(fd, "wb") as f:
                    write(f)
                    f.flush()
                    os.fsync(f.fileno())
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        return Path(tmp)

    def place(
        self,
        tmp: Path,
        path: str,
        if_match: str | None = None,
        if_none_match: str | None = None,
        unique: bool = False,
    ) -> tuple:
        """Rename a spooled temp file to path; return (record, created).

        unique: never overwrite, take the first free `name-2.ext`, `name-3.ext`... instead.
        If-Match / If-None-Match: * guard a replacement (412). The temp file is gone after.
        """
        try:
            with self._lock:
                target = self.file_of(path)
                if unique:
                    path, target = self._free(path, target)
                exists = self.check(path, if_match, if_none_match)
                with self._new_parents(target, path):
                    os.chmod(tmp, 0o666 & ~_UMASK)
                    self._rename(tmp, target)
                fsync_dir(target.parent)
                if target.parent != self.root:
                    fsync_dir(self.root)
                return self.record(path, os.stat(target)), not exists
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def put(self, path: str, data: bytes, unique: bool = False) -> tuple:
        """Write bytes to an attachment; return (record, created)."""
        return self.place(self.spool(lambda f: f.write(data)), path, unique=unique)

    @staticmethod
    def _rename(src: Path, dst: Path) -> None:
        with disk_writes():
            try:
                os.replace(src, dst)
            except OSError as e:
                if e.errno != errno.EXDEV:  # a folder on another file system: copy it over
                    raise

                def copy(f) -> None:
                    with open(src, "rb") as source:
                        while chunk := source.read(BODY_CHUNK):
                            f.write(chunk)

                _atomic_write(dst, copy, None)

    @contextlib.contextmanager
    def _new_parents(self, target: Path, path: str):
        """Create target's missing folders for the block; remove them if the block fails."""
        missing = _missing_folders(target.parent, self.root)
        try:
            with disk_writes():
                try:
                    target.parent.mkdir(parents=True, exist_ok=True)
                except (FileExistsError, NotADirectoryError):
                    raise ApiError(
                        409, "CONFLICT", "a file stands where a folder of this path should be"
                    ) from None
            self.file_of(path)  # re-check containment now that the folders exist
            yield
        except BaseException:
            for folder in missing:  # deepest first
                with contextlib.suppress(OSError):
                    folder.rmdir()
            raise

    def _free(self, path: str, target: Path) -> tuple:
        """Return (path, file) of the first name not taken: path, name-2.ext, name-3.ext..."""
        if not os.path.lexists(target):
            return path, target
        base, _, ext = path.rpartition(".")
        for n in range(2, self.MAX_SIBLINGS):
            candidate = attachment_path(f"{base}-{n}.{ext}")
            target = self.file_of(candidate)
            if not os.path.lexists(target):
                return candidate, target
        raise ApiError(409, "CONFLICT", f"too many attachments named like {path}")

    def move(self, path: str, new: str, if_match: str | None = None) -> dict:
        with self._lock:
            src = self.file_of(path)
            rec = self.get(path)
            _check_etag(if_match, rec["etag"], "attachment")
            if new == path:
                return {**rec, "from": path}
            dst = self.file_of(new)
            if os.path.lexists(dst):
                raise ApiError(409, "CONFLICT", f"an attachment already exists at {new}")
            with self._new_parents(dst, new), disk_writes():
                os.replace(src, dst)
            fsync_dir(dst.parent)
            fsync_dir(src.parent)
            self._prune(src.parent)
            return {**self.record(new, os.stat(dst)), "from": path}

    def delete(self, path: str, if_match: str | None = None) -> dict:
        """Move an attachment into the trash: <state>/trash/<UTC stamp>/attachments/..."""
        with self._lock:
            src = self.file_of(path)
            _check_etag(if_match, self.get(path)["etag"], "attachment")
            trashed = move_to_trash(src, self.trash, path)
            self._prune(src.parent)
        return {"path": path, "deleted": True, **trashed}

    def restore(self, src: Path, path: str) -> dict:
        """Move a file back from the trash to path; 409 when an attachment is there."""
        with self._lock:
            dst = self.file_of(path)
            if os.path.lexists(dst):
                raise ApiError(409, "CONFLICT", f"an attachment already exists at {path}")
            with self._new_parents(dst, path), disk_writes():
                os.replace(src, dst)
            fsync_dir(dst.parent)
            return self.record(path, os.stat(dst))

    def _prune(self, folder: Path) -> None:
        """Remove folder and its parents while they are empty (never attachments/ itself)."""
        folder = Path(os.path.abspath(folder))
        while folder != self.root and self.root in folder.parents:
            try:
                folder.rmdir()
            except OSError:
                return
            folder = folder.parent

    def sweep_temp_files(self) -> int:
        """Remove the temp files an interrupted upload left; return how many."""
        return sweep_temp_files(self.root, skip_hidden=True) if self.root.is_dir() else 0


# -- history, trash and the change journal ------------------------------------------------
#
# What NoteStore keeps of every change: the content it replaced (HistoryStore), the note
# itself when deleted (Trash), and a numbered entry in the change feed (ChangeJournal).

DAY_SECONDS = 86400
VERSION_REASONS = (
    "updated",
    "moved",
    "deleted",
    "external",
    "restored",
    "linksRewritten",
    "merged",
    "dav",
)
VERSION_ID_RE = re.compile(r"^(\d{16})-(" + "|".join(VERSION_REASONS) + r")-([0-9a-f]{32})$")


def _etag_hex(data: bytes) -> str:
    return make_etag(data)[1:-1]


class HistoryStore:
    """Past contents of the notes: <state>/history/<key of the note's path>/<version id>.

    A version id is `<microseconds since the epoch, 16 digits>-<reason>-<etag>`: ids sort by
    age and say what a version is, so listing a history reads no file. Beside the versions,
    `head` is a copy of the note as notesvc last wrote or saw it (first line: its etag and
    path), so that a change made by another program, found by the rescan, still keeps the
    content it replaced; it is a cache, checked against its etag and not fsynced. A content
    about to be replaced by a rename is linked, not copied (no data written). Retention: a
    note's newest `max_versions`, and every version younger than `days`. Callers hold the
    note's lock (NoteStore's); the retention sweep only removes.
    """

    HEAD = "head"
    # Where the versions a move brought in were saved (lines "<version id> <path>"): a folder
    # grant sees only those saved inside its folder. A version not named was saved at the
    # path the history folder belongs to.
    ORIGINS = "origins"

    def __init__(self, folder: Path, max_versions: int, days: int, clock: Callable = time.time):
        self.folder = folder
        self.max_versions = max_versions
        self.days = days
        self.clock = clock  # injectable: retention by age is tested with another clock
        self._last_us = 0
        self._lock = threading.Lock()
        self._ids: dict = {}  # folder name -> its version ids, oldest first (kept by keep())

    @property
    def enabled(self) -> bool:
        return self.max_versions > 0

    def dir_of(self, path: str) -> Path:
        return self.folder / hashlib.sha256(path.encode("utf-8")).hexdigest()[:32]

    def folders(self) -> list:
        try:
            return [
                Path(e.path)
                for e in os.scandir(self.folder)
                if len(e.name) == 32 and e.is_dir(follow_symlinks=False)
            ]
        except FileNotFoundError:
            return []

    def ids(self, folder: Path) -> list:
        """Return the version ids in a history folder, oldest first."""
        with self._lock:
            cached = self._ids.get(folder.name)
            if cached is not None:
                return list(cached)
        return self._list(folder)

    @staticmethod
    def _list(folder: Path) -> list:
        try:
            return sorted(n for n in os.listdir(folder) if VERSION_ID_RE.match(n))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def _cached_ids(self, folder: Path) -> list:
        """ids() remembered: only under the note's lock, where its history changes."""
        found = self.ids(folder)
        with self._lock:
            if folder.name not in self._ids:
                if len(self._ids) >= 4096:
                    self._ids.pop(next(iter(self._ids)))
                self._ids[folder.name] = list(found)
        return found

    def _changed(self, folder: Path, added: str | None = None, dropped: Iterable = ()) -> None:
        """Keep the remembered ids of a folder in step (None added, nothing dropped: forget)."""
        with self._lock:
            cached = self._ids.get(folder.name)
            if cached is None:
                return
            if added is None and not dropped:
                del self._ids[folder.name]
                return
            if added is not None:
                cached.append(added)  # ids only grow: the newest goes last
            for vid in dropped:
                with contextlib.suppress(ValueError):
                    cached.remove(vid)

    def _folder(self, path: str) -> Path:
        """Return the note's history folder, created (0700) when missing."""
        folder = self.dir_of(path)
        if not folder.is_dir():
            with disk_writes():
                self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
                folder.mkdir(mode=0o700, exist_ok=True)
            fsync_dir(self.folder)
        return folder

    def _new_id(self, reason: str, etag: str) -> str:
        with self._lock:  # strictly increasing: ids never collide and sort by age
            us = max(int(self.clock() * 1_000_000), self._last_us + 1)
            self._last_us = us
        return f"{us:016d}-{reason}-{etag}"

    # -- keeping a version (under the note's lock) -------------------------------------

    def keep(self, path: str, data: bytes, reason: str, inode: tuple | None = None) -> str | None:
        """Keep data, a note's content about to be replaced, as its newest version; return
        the version's id (None when history is off or the newest version holds data).

        inode: (file, stat as read) of the note when the change replaces the file by a
        rename: its content is then linked, not copied, and durable only once durable()
        was called (before the rename; the note's own fsync has flushed the journal by
        then on most file systems, so that costs little). Raises DiskFull (507) with
        nothing kept.
        """
        if not self.enabled:
            return None
        etag = _etag_hex(data)
        for attempt in (1, 2):  # the sweep may remove an emptied folder in between
            folder = self._folder(path)
            ids = self._cached_ids(folder)
            if ids and ids[-1].endswith(etag):
                return None
            vid = self._new_id(reason, etag)
            try:
                if inode is None or not self._link(inode, folder / vid):
                    atomic_write(folder / vid, data, mode=0o600)
                self._changed(folder, added=vid)
                return vid
            except FileNotFoundError:
                self._changed(folder)
                if attempt == 2:
                    raise
        return None  # pragma: no cover

    @staticmethod
    def _link(inode: tuple, target: Path) -> bool:
        """Link a note's file as a version (the file is about to be replaced, not
        rewritten); False when the file system cannot or another program changed the
        file since it was read: then it is copied."""
        source, seen = inode
        try:
            with disk_writes():
                os.link(source, target)
        except DiskFull:
            raise
        except OSError:  # no hard links here (FAT, some network file systems)
            return False
        st = os.stat(target)
        if (st.st_ino, st.st_size, st.st_mtime_ns) != (seen.st_ino, seen.st_size, seen.st_mtime_ns):
            os.unlink(target)
            return False
        return True  # durable once its folder is fsynced: see durable()

    def durable(self, path: str) -> None:
        """Make the versions kept for a note durable (fsync its history folder)."""
        fsync_dir(self.dir_of(path))

    def settle(self, path: str, vid: str) -> None:
        """After the change a version was kept for: make it private, apply the retention."""
        folder = self.dir_of(path)
        with contextlib.suppress(OSError):  # a linked version had the note's mode
            os.chmod(folder / vid, 0o600)
        self.prune(folder)

    def discard(self, path: str, vid: str) -> None:
        """Drop a version kept for a change that then failed."""
        with contextlib.suppress(OSError):
            os.unlink(self.dir_of(path) / vid)
        self._changed(self.dir_of(path), dropped=[vid])

    def prune(self, folder: Path) -> int:
        """Remove the versions past the newest max_versions that are older than `days`."""
        if not self.enabled:
            return 0
        ids = self.ids(folder)
        cutoff = (self.clock() - self.days * DAY_SECONDS) * 1_000_000
        removed = []
        for vid in ids[: max(0, len(ids) - self.max_versions)]:  # oldest first
            if self.days and int(vid[:16]) >= cutoff:
                break
            with contextlib.suppress(FileNotFoundError):
                os.unlink(folder / vid)
            removed.append(vid)
        if removed:
            self._changed(folder, dropped=removed)
        return len(removed)

    def relocate(self, old: str, new: str, until_us: int | None = None, copy: bool = False):
        """Give the note at `new` the history of `old` (a move, a restore elsewhere): the
        versions saved up to until_us (all when None), moved, or linked when `copy`."""
        src, dst = self.dir_of(old), self.dir_of(new)
        self._changed(src)
        self._changed(dst)
        ids = [v for v in self.ids(src) if until_us is None or int(v[:16]) <= until_us]
        origins = self._origins(src)
        came = {vid: origins.get(vid, old) for vid in ids}
        if not copy and until_us is None and src.is_dir() and not dst.exists():
            os.replace(src, dst)  # the whole folder, head and origins included
            fsync_dir(self.folder)
            self._write_origins(dst, {**origins, **came})
            return
        if not ids:
            return
        dst = self._folder(new)
        self._write_origins(dst, {**self._origins(dst), **came})  # before the versions land
        for vid in ids:
            if (dst / vid).exists():  # the same id: the same content
                if not copy:
                    os.unlink(src / vid)
            elif not copy:
                os.replace(src / vid, dst / vid)
            else:
                try:
                    os.link(src / vid, dst / vid)
                except OSError:  # no hard links here
                    atomic_write(dst / vid, (src / vid).read_bytes(), mode=0o600)
        fsync_dir(dst)
        if not copy:
            self.drop_head(old)
            with contextlib.suppress(OSError):
                src.rmdir()

    def _origins(self, folder: Path) -> dict:
        """Return {version id: the path it was saved at} for versions moved into folder."""
        try:
            text = (folder / self.ORIGINS).read_text("utf-8")
        except (OSError, UnicodeDecodeError):
            return {}
        pairs = (line.partition(" ") for line in text.splitlines())
        return {vid: path for vid, _, path in pairs if VERSION_ID_RE.match(vid) and path}

    def _write_origins(self, folder: Path, origins: dict) -> None:
        """Keep the origins of the versions still in folder (atomic, private)."""
        here = set(self._list(folder))
        lines = "".join(f"{v} {p}\n" for v, p in sorted(origins.items()) if v in here)
        if lines:
            atomic_write(folder / self.ORIGINS, lines.encode("utf-8"), mode=0o600)

    def saved_at(self, path: str, vid: str) -> str:
        """Return the path the note had when version vid of the note at path was saved."""
        return self._origins(self.dir_of(path)).get(vid, path)

    # -- the copy of the current content ----------------------------------------------

    def write_head(self, path: str, data: bytes, etag: str | None = None) -> None:
        """Remember data (whose etag may be given) as the note's content as last written
        or seen (best effort)."""
        if not self.enabled:
            return
        try:  # rewritten in place: a torn copy fails its etag check, as a missing one.
            # Not truncated to 0 first: ext4 flushes a file truncated and rewritten.
            fd = os.open(self._folder(path) / self.HEAD, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                blob = f"{(etag or make_etag(data))[1:-1]} {path}\n".encode() + data
                os.pwrite(fd, blob, 0)
                os.ftruncate(fd, len(blob))
            finally:
                os.close(fd)
        except OSError as e:  # a stale copy would pass for the current content: drop it
            log.warning("history: could not keep a copy of %s (%s)", log_safe(path), e)
            self.drop_head(path)

    def read_head(self, path: str) -> bytes | None:
        """Return the note's content as last written or seen, None when unknown."""
        try:
            raw = (self.dir_of(path) / self.HEAD).read_bytes()
        except OSError:
            return None
        line, _, data = raw.partition(b"\n")
        return data if line[:32] == _etag_hex(data).encode() else None

    def head_path(self, folder: Path) -> str | None:
        """Return the note path a history folder's copy belongs to (None without one)."""
        try:
            with open(folder / self.HEAD, "rb") as f:
                line = f.readline(MAX_PATH_CHARS * 4 + 64)
        except OSError:
            return None
        return line[33:].rstrip(b"\n").decode("utf-8", "replace") or None

    def drop_head(self, path: str) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.dir_of(path) / self.HEAD)

    # -- reading ------------------------------------------------------------------

    @staticmethod
    def describe(vid: str, size: int) -> dict:
        m = VERSION_ID_RE.match(vid)
        return {
            "id": vid,
            "savedAt": iso(int(m.group(1)) / 1_000_000),
            "size": size,
            "etag": f'"{m.group(3)}"',
            "reason": m.group(2),
        }

    def versions(self, path: str, sees: Callable | None = None) -> list:
        """Return the note's versions, newest first (no content); with `sees`, only those
        saved at a path sees(path) accepts (a folder grant's)."""
        folder, found = self.dir_of(path), []
        origins = self._origins(folder) if sees else {}
        for vid in reversed(self.ids(folder)):
            if sees and not sees(origins.get(vid, path)):
                continue
            with contextlib.suppress(OSError):  # pruned meanwhile
                found.append(self.describe(vid, os.stat(folder / vid).st_size))
        return found

    def read(self, path: str, vid: str) -> bytes:
        """Return a version's content; 400 for a malformed id, 404 for an unknown one."""
        if not VERSION_ID_RE.match(vid):
            raise bad_request(f"{vid[:80]!r} is not a version id (see GET .../versions)")
        try:
            return (self.dir_of(path) / vid).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            raise not_found(f"no version {vid} of {path}") from None

    def sweep(self, folder: Path, fix_modes: bool = False) -> int:
        """Apply the retention to one folder (and make its versions private: a crash in
        settle() may have left one with its note's mode), remove it when empty; return how
        many versions were removed."""
        removed = self.prune(folder)
        self._changed(folder)  # what the disk says from now on
        if not self.ids(folder):
            with contextlib.suppress(OSError):
                os.unlink(folder / self.ORIGINS)
        for vid in self.ids(folder) if fix_modes else ():
            with contextlib.suppress(OSError):
                if stat.S_IMODE(os.stat(folder / vid).st_mode) != 0o600:
                    os.chmod(folder / vid, 0o600)
        with contextlib.suppress(OSError):
            folder.rmdir()  # only when nothing is left in it
        return removed

    def usage(self) -> dict:
        """Return {notes, versions, bytes} of the history (the copies' bytes included)."""
        notes = versions = size = 0
        for folder in self.folders():
            notes += 1
            with contextlib.suppress(OSError):
                for e in os.scandir(folder):
                    with contextlib.suppress(OSError):
                        size += e.stat(follow_symlinks=False).st_size
                    versions += bool(VERSION_ID_RE.match(e.name))
        return {"notes": notes, "versions": versions, "bytes": size}


TRASH_TOPS = (NOTES, ATTACHMENTS)  # what a trash folder holds: notes and attachments
TRASH_STAMP = "%Y%m%dT%H%M%S.%fZ"  # a trash folder's name: when its item was deleted (UTC)
TRASH_ID_RE = re.compile(r"^([0-9A-Za-z]{1,64})-([0-9a-f]{16})$")


def move_to_trash(src: Path, trash: Path, path: str, guard: Any = None) -> dict:
    """Move src into the trash as <trash>/<UTC stamp>/<path> (new folders private, the
    rename made durable) inside `guard`; return {trash, trashId}. A failure (507 on a
    full disk) leaves the trash as it was."""
    stamp = utcnow().strftime(TRASH_STAMP)
    dst = trash / stamp / path
    made = _missing_folders(dst.parent, trash.parent)
    try:
        with guard or contextlib.nullcontext(), disk_writes():
            for folder in reversed(made):  # private, as all of the state folder
                folder.mkdir(mode=0o700, exist_ok=True)
            os.replace(src, dst)
    except BaseException:
        for folder in made:  # deepest first
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    fsync_dir(dst.parent)
    fsync_dir(src.parent)
    return {"trash": f".notesvc/trash/{stamp}/{path}", "trashId": trash_id(stamp, path)}


def trash_id(stamp: str, path: str) -> str:
    """Return a trash item's id: its folder's letters and digits, a hash of its path."""
    digest = hashlib.sha256(f"{stamp}/{path}".encode("utf-8", "surrogateescape")).hexdigest()
    return re.sub(r"[^0-9A-Za-z]", "", stamp)[:64] + "-" + digest[:16]


@dataclasses.dataclass(frozen=True)
class TrashItem:
    id: str
    path: str  # notes/... or attachments/..., as it was before the delete
    file: Path
    deleted: float  # seconds since the epoch
    size: int

    @property
    def kind(self) -> str:
        return "note" if self.path.startswith(NOTES + "/") else "attachment"

    def describe(self) -> dict:
        return {
            "id": self.id,
            "path": self.path,
            "kind": self.kind,
            "deletedAt": iso(self.deleted),
            "size": self.size,
        }


class Trash:
    """Deleted notes and attachments: <state>/trash/<UTC stamp>/<path>, where the deletes
    put them. Items older than `days` are purged by purge_expired() (0: kept until purged
    by hand); restoring a note is NoteStore's (history, journal, index), restoring an
    attachment moves its file back.
    """

    def __init__(self, folder: Path, days: int, clock: Callable = time.time):
        self.folder = folder
        self.days = days
        self.clock = clock  # injectable, as the history's

    def _stamps(self) -> list:
        try:
            return [
                e
                for e in os.scandir(self.folder)
                if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)
            ]
        except FileNotFoundError:
            return []

    @staticmethod
    def _deleted_at(entry: os.DirEntry) -> float:
        try:
            return (
                dt.datetime.strptime(entry.name, TRASH_STAMP)
                .replace(tzinfo=dt.timezone.utc)
                .timestamp()
            )
        except ValueError:  # a folder named otherwise: its own time
            return entry.stat(follow_symlinks=False).st_mtime

    def _items_in(self, entry: os.DirEntry) -> list:
        deleted, items = self._deleted_at(entry), []
        for top in TRASH_TOPS:
            stack = [(os.path.join(entry.path, top), top)]
            while stack:
                real, rel = stack.pop()
                try:
                    children = list(os.scandir(real))
                except (FileNotFoundError, NotADirectoryError, PermissionError):
                    continue
                for e in children:
                    if e.name.startswith(".") or e.is_symlink():
                        continue
                    name = f"{rel}/{_nfc(e.name)}"
                    if e.is_dir():
                        stack.append((e.path, name))
                    else:
                        with contextlib.suppress(OSError):
                            size = e.stat().st_size
                            items.append(
                                TrashItem(
                                    trash_id(entry.name, name), name, Path(e.path), deleted, size
                                )
                            )
        return items

    def items(self) -> list:
        """Return every item in the trash, the most recently deleted first."""
        found = [item for entry in self._stamps() for item in self._items_in(entry)]
        return sorted(found, key=lambda i: (-i.deleted, i.path))

    def find(self, item_id: str) -> TrashItem:
        """Return the item of an id; 400 for a malformed id, 404 for an unknown one."""
        m = TRASH_ID_RE.match(item_id)
        if not m:
            raise bad_request(f"{item_id[:80]!r} is not a trash item id (see GET {API}/trash)")
        for entry in self._stamps():
            if re.sub(r"[^0-9A-Za-z]", "", entry.name)[:64] == m.group(1):
                for item in self._items_in(entry):
                    if item.id == item_id:
                        return item
        raise not_found(f"no item {item_id} in the trash")

    def purge(self, item: TrashItem) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(item.file)
        self.emptied(item)

    def purge_expired(self) -> int:
        """Remove the trash folders older than `days`; return how many items went."""
        if not self.days:
            return 0
        cutoff, purged = self.clock() - self.days * DAY_SECONDS, 0
        for entry in self._stamps():
            if self._deleted_at(entry) < cutoff:
                purged += len(self._items_in(entry))
                shutil.rmtree(entry.path, ignore_errors=True)  # never follows links
        return purged

    def emptied(self, item: TrashItem) -> None:
        """After an item left: remove the folders it leaves empty."""
        _remove_empty_folders(item.file.parent, self.folder)

    def usage(self) -> dict:
        items = [item for entry in self._stamps() for item in self._items_in(entry)]
        return {"items": len(items), "bytes": sum(i.size for i in items)}


def attachment_or_note_path(raw: Any) -> str:
    """Return a checked path under notes/ or attachments/ (a trash item's destination)."""
    if isinstance(raw, str) and raw.startswith(f"{ATTACHMENTS}/"):
        return attachment_path(raw)
    return note_path(raw)


CHANGE_KINDS = ("created", "updated", "moved", "deleted", "restored")


def _allocate(fd: int, offset: int, length: int) -> None:
    """Allocate length bytes of a file from offset, so writing there later needs no space."""
    if hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, offset, length)
            return
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
    os.pwrite(fd, bytes(length), offset)


_fdatasync = getattr(os, "fdatasync", os.fsync)


def _change_of(line: bytes, after: int) -> tuple | None:
    """Return a journal line as an entry tuple, None when it is not one (a torn write)."""
    try:
        d = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    if (
        not isinstance(d, dict)
        or not isinstance(d.get("seq"), int)
        or d["seq"] <= after
        or d.get("kind") not in CHANGE_KINDS
        or not isinstance(d.get("path"), str)
    ):
        return None
    return (d["seq"], d["kind"], d["path"], d.get("from"), d.get("etag"), d.get("at", ""))


def change_record(entry: tuple) -> dict:
    seq, kind, path, origin, etag, at = entry
    rec = {"seq": seq, "kind": kind, "path": path}
    if origin is not None:
        rec["from"] = origin
    if etag is not None:
        rec["etag"] = etag
    rec["at"] = at
    return rec


class ChangeJournal:
    """Every change to the notes, numbered in order: <state>/changes.log.

    A header line {"floor": F}, then one JSON object a line. A cursor below F (compacted
    away) or above the last number cannot be answered for (410). An entry is written and
    fdatasync'ed before anyone learns of it, under one lock, so numbers are given, stored
    and seen in one order. Room for entries is allocated in the file ahead of time:
    reserve() (507 on a full disk) comes before a change, so recording a change once made
    never fails for want of space. The newest entries stay in memory; the file is
    compacted to the newest `keep` when it holds twice as many.
    """

    RESERVE = 16384  # bytes allocated ahead
    ENTRY_MAX = 8192  # an entry's line is at most ~4.3 KB (two 512-character paths)

    def __init__(self, path: Path, keep: int = 10000, clock: Callable = time.time):
        self.path = path
        self.keep = keep  # injectable, as the clock: compaction is tested with a small one
        self.clock = clock
        self.floor = 0
        self.last = 0
        self.fresh = False  # this run created it: the first rescan is its starting point
        self._cond = threading.Condition()
        self._seqs: list = []
        self._entries: list = []  # (seq, kind, path, from, etag, at), oldest first
        self._open = False  # open() found or made the file: entries are stored
        self._end = 0  # where the next line goes
        self._allocated = 0  # the file's bytes (zeros past _end)
        self._promised = 0  # entries reserve() made room for, not yet appended
        self._compact_at = 0  # after a failed compaction: when to try again
        self._waiting: collections.Counter = collections.Counter()
        self._closed = False

    def open(self) -> ChangeJournal:
        """Read the journal, creating it when missing; a torn last line is dropped."""
        with self._cond:
            try:
                raw = self.path.read_bytes()
            except FileNotFoundError:
                self.fresh = True
                self._rewrite([], 0)
                return self
            lines = raw.split(b"\0", 1)[0].split(b"\n")
            try:
                header = json.loads(lines[0])
                floor = header["floor"] if isinstance(header, dict) else None
            except (ValueError, UnicodeDecodeError):
                floor = None
            entries, end, after = [], len(lines[0]) + 1, floor if isinstance(floor, int) else -1
            for line in lines[1:-1]:  # the last piece is what follows the last newline
                entry = _change_of(line, after)
                if entry is None:
                    break
                entries.append(entry)
                end, after = end + len(line) + 1, entry[0]
            if not isinstance(floor, int) or floor < 0:
                log.warning(
                    "changes.log: unreadable header; the feed starts over (410 for clients)"
                )
                self._rewrite([], max(0, after))
                return self
            self.floor, self.last = floor, after if entries else floor
            self._entries, self._seqs = entries, [e[0] for e in entries]
            with self._file() as fd:
                os.ftruncate(fd, end)  # a torn line and the old allowance go
            self._open, self._end, self._allocated = True, end, end
            if len(entries) > self.keep:
                self._compact()
        return self

    def _rewrite(self, entries: list, floor: int) -> None:
        """Write the journal anew (atomically) with these entries above floor."""
        lines = [to_json({"notesvc": "changes", "floor": floor}) + b"\n"]
        lines += [to_json(change_record(e)) + b"\n" for e in entries]
        content = b"".join(lines)
        room = self.RESERVE + self._promised * self.ENTRY_MAX

        def write(f) -> None:
            f.write(content)
            f.flush()
            _allocate(f.fileno(), len(content), room)

        atomic_write(self.path, write, mode=0o600)
        self._open, self._end, self._allocated = True, len(content), len(content) + room
        self.floor, self.last = floor, max(floor, entries[-1][0] if entries else floor)
        self._entries, self._seqs = list(entries), [e[0] for e in entries]

    @contextlib.contextmanager
    def _file(self):
        """Open the journal for one operation (no descriptor is held between them)."""
        fd = os.open(self.path, os.O_RDWR)
        try:
            yield fd
        finally:
            os.close(fd)

    def _compact(self) -> None:
        kept = self._entries[-self.keep :]
        try:
            self._rewrite(kept, kept[0][0] - 1 if kept else self.last)
        except OSError as e:  # the old file stays good; try again after a while
            log.warning("changes.log: could not compact it (%s)", e)
            self._compact_at = len(self._entries) + max(1, self.keep // 10)

    def reserve(self) -> None:
        """Make room for one more entry before a change; DiskFull (507) when there is none.
        The change then calls append() or, when it failed, release()."""
        with self._cond:
            if not self._open:
                return
            need = (self._promised + 1) * self.ENTRY_MAX
            if self._allocated - self._end < need:
                with disk_writes(), self._file() as fd:
                    _allocate(fd, self._end, need + self.RESERVE)
                self._allocated = self._end + need + self.RESERVE
            self._promised += 1

    def release(self) -> None:
        with self._cond:
            self._promised = max(0, self._promised - 1)

    def append(
        self,
        kind: str,
        path: str,
        etag: str | None = None,
        origin: str | None = None,
        reserved: bool = True,
    ) -> int:
        """Record a change that was made, wake the waiting feeds; return its number."""
        with self._cond:
            if reserved:
                self._promised = max(0, self._promised - 1)
            seq = self.last + 1
            entry = (seq, kind, path, origin, etag, iso(self.clock()))
            if self._open:
                line = to_json(change_record(entry)) + b"\n"
                try:
                    with self._file() as fd:
                        if self._end + len(line) > self._allocated:  # not reserved: the rescan
                            _allocate(fd, self._end, len(line) + self.RESERVE)
                            self._allocated = self._end + len(line) + self.RESERVE
                        os.pwrite(fd, line, self._end)
                        _fdatasync(fd)
                    self._end += len(line)
                except OSError as e:
                    log.error("changes.log: could not store change %d (%s)", seq, e)
            self.last = seq
            self._seqs.append(seq)
            self._entries.append(entry)
            if len(self._entries) > max(2 * self.keep, self._compact_at):
                self._compact()
            self._cond.notify_all()
            return seq

    def reset(self) -> None:
        """Forget the entries: every cursor from before answers 410 (re-list)."""
        with self._cond:
            try:
                self._rewrite([], self.last)
            except OSError as e:
                log.warning("changes.log: could not reset it (%s)", e)
                self.floor, self._entries, self._seqs = self.last, [], []
            self._cond.notify_all()

    def read(self, since: int, limit: int) -> dict:
        """Return {changes, last, more}: the changes after `since` (at most limit); 410
        when the journal no longer holds them (or never did: a cursor from the future)."""
        with self._cond:
            if since < self.floor:
                raise gone(
                    f"changes up to {self.floor} were compacted away; list the notes again "
                    f"and follow from since={self.last}"
                )
            if since > self.last:
                raise gone(
                    f"this server's changes end at {self.last}; list the notes again and "
                    f"follow from since={self.last}"
                )
            i = bisect.bisect_right(self._seqs, since)
            chunk = self._entries[i : i + limit]
            more = i + limit < len(self._entries)
        return {
            "changes": [change_record(e) for e in chunk],
            "last": chunk[-1][0] if chunk else since,
            "more": more,
        }

    def wait_after(self, since: int, timeout: float, pool: str, cap: int) -> bool | None:
        """Wait up to timeout s for a change after `since`; return whether one came, or
        None at once when `pool` already has `cap` waiters (each holds a worker thread)."""
        with self._cond:
            if self._waiting[pool] >= cap:
                return None
            self._waiting[pool] += 1
            try:
                return self._cond.wait_for(lambda: self.last > since or self._closed, timeout)
            finally:
                self._waiting[pool] -= 1

    def waiting(self) -> int:
        with self._cond:
            return sum(self._waiting.values())

    def close(self) -> None:
        """Wake every waiter: the server stops."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


MAX_DIFF_LINES = 5000  # difflib is quadratic on some inputs: past this, one plain hunk


def _diff_range(start: int, length: int) -> str:
    """Return a unified diff's range (as difflib writes it) of `length` lines from `start`."""
    if length == 1:
        return str(start + 1)
    return f"{start + 1 if length else start},{length}"


def unified_diff(a: str, b: str, from_name: str, to_name: str) -> str:
    """Return the unified diff from text a to text b, in time linear in their size past
    MAX_DIFF_LINES changed lines (the changed middle is then one hunk, not minimal)."""
    x, y = a.splitlines(keepends=True), b.splitlines(keepends=True)
    head = 0
    while head < min(len(x), len(y)) and x[head] == y[head]:
        head += 1
    tail = 0
    while tail < min(len(x), len(y)) - head and x[-1 - tail] == y[-1 - tail]:
        tail += 1
    if max(len(x), len(y)) - head - tail > MAX_DIFF_LINES:
        old, new = x[head : len(x) - tail], y[head : len(y) - tail]
        lines = [
            f"--- {from_name}\n",
            f"+++ {to_name}\n",
            f"@@ -{_diff_range(head, len(old))} +{_diff_range(head, len(new))} @@\n",
            *("-" + line for line in old),
            *("+" + line for line in new),
        ]
    else:  # only the changed middle, with its context, goes through difflib
        lo = max(0, head - 3)
        x_end, y_end = len(x) - max(0, tail - 3), len(y) - max(0, tail - 3)
        lines = []
        for line in difflib.unified_diff(x[lo:x_end], y[lo:y_end], from_name, to_name):
            if line.startswith("@@"):
                line = re.sub(
                    r"([-+])(\d+)", lambda m: f"{m.group(1)}{int(m.group(2)) + lo}", line, count=2
                )
            lines.append(line)
    return "".join(
        line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines
    )


def expire_loop(notes: NoteStore, trash: Trash, stop: threading.Event, every: float = 3600) -> None:
    """Apply the retention of history and trash now, then every `every` s until stop."""
    first = True
    while True:
        try:
            removed, purged = notes.sweep_history(fix_modes=first), trash.purge_expired()
            first = False
            if removed or purged:
                log.info("retention: %d versions and %d trash items removed", removed, purged)
        except Exception:
            log.exception("retention sweep failed; trying again in %.0f s", every)
        if stop.wait(every):
            return


# == Search ===================================================================
#
# An inverted index of the notes that lives on disk and is read in place: memory grows
# with what is being used, not with the size of the archive. Chapters: text analysis,
# BM25, the query language, snippets, segments (the changes held in memory), persistence
# (segment files and the commit file), the index (SearchIndex: search, sync, merges).

K1, B = 1.2, 0.75  # BM25 saturation and length normalisation (Lucene's defaults)
TITLE_WEIGHT = 2.0  # a title hit counts twice a body hit
INDEX_FORMAT = ("notesvc-segments", 3, K1, B, TITLE_WEIGHT, "porter2-1")
MAX_QUERY_CHARS = 512
MAX_PREFIX_TERMS = 64  # expansions of one prefix* (most frequent first)
SNIPPET_CHARS = 240

# -- text analysis ------------------------------------------------------------

_WORD_RE = re.compile(r"\w+")
_ASCII_WORD_RE = re.compile(r"\w+", re.ASCII)  # the same tokens on ASCII text, faster
_MARKS_RE = re.compile("[\u0300-\u036f\u1ab0-\u1aff\u1dc0-\u1dff\u20d0-\u20ff\ufe20-\ufe2f]")


def fold(text: str) -> str:
    """Return text with case and accents folded.

    >>> fold("Crème BRÛLÉE Straße")
    'creme brulee strasse'
    """
    text = text.casefold()
    if not text.isascii():
        text = _MARKS_RE.sub("", unicodedata.normalize("NFKD", text))
    return text


# Porter2, the Snowball English stemmer (snowballstem.org/algorithms/english), as its
# reference english.sbl defines it today; checked against the project's word list (every
# 15th pair is in docs/porter2-sample.txt). A "Y" is a y that acts as a consonant: a first
# letter, or one after a vowel; it is not a vowel.
_P2_VOWELS = frozenset("aeiouy")
_P2_NOT_SHORT_END = frozenset("aeiouywxY")  # a short syllable's last letter is none of these
_P2_VOWEL_RE = re.compile("[aeiouy]")
_P2_REGION_RE = re.compile("[^aeiouy]*[aeiouy]+[^aeiouy]")  # to just past a vowel-consonant
_P2_WORDS = {  # whole words with a stem of their own (or none)
    "skis": "ski",
    "skies": "sky",
    "idly": "idl",
    "gently": "gentl",
    "ugly": "ugli",
    "early": "earli",
    "only": "onli",
    "singly": "singl",
    **dict.fromkeys(["sky", "news", "howe", "atlas", "cosmos", "bias", "andes"]),
}
# R1 starts after these (generous/general, not gener-ous/gen-eral), not after the first
# vowel-consonant pair.
_P2_R1_PREFIXES = (
    "gener",
    "commun",
    "arsen",
    "past",
    "univers",
    "later",
    "emerg",
    "organ",
    "inter",
)
_P2_1B = ("eedly", "ingly", "edly", "eed", "ing", "ed")  # longest first
_P2_ING_KEEP = frozenset(["inn", "out", "cann", "herr", "earr", "even"])  # inning, outing...
_P2_DOUBLES = ("bb", "dd", "ff", "gg", "mm", "nn", "pp", "rr", "tt")
_P2_STEP2 = {
    "tional": "tion",
    "enci": "ence",
    "anci": "ance",
    "abli": "able",
    "entli": "ent",
    "izer": "ize",
    "ization": "ize",
    "ational": "ate",
    "ation": "ate",
    "ator": "ate",
    "alism": "al",
    "aliti": "al",
    "alli": "al",
    "fulness": "ful",
    "ousli": "ous",
    "ousness": "ous",
    "iveness": "ive",
    "iviti": "ive",
    "biliti": "ble",
    "bli": "ble",
    "ogist": "og",
    "ogi": "og",  # after an l only
    "fulli": "ful",
    "lessli": "less",
    "li": "",  # after one of c d e g h k m n r t only
}
_P2_STEP3 = {
    "tional": "tion",
    "ational": "ate",
    "alize": "al",
    "icate": "ic",
    "iciti": "ic",
    "ical": "ic",
    "ful": "",
    "ness": "",
    "ative": "",  # in R2 only
}
_P2_STEP4 = "al ance ence er ic able ible ant ement ment ent ism ate iti ous ive ize ion".split()
_P2_STEP2_ENDS, _P2_STEP3_ENDS, _P2_STEP4_ENDS = (  # longest first: the first match wins
    tuple(sorted(table, key=len, reverse=True)) for table in (_P2_STEP2, _P2_STEP3, _P2_STEP4)
)


def _p2_suffix(word: str, suffixes: tuple) -> str | None:
    """Return the first of suffixes (longest first) that word ends with, or None."""
    if word.endswith(suffixes):  # one test in C for the many words that end in none
        for suffix in suffixes:
            if word.endswith(suffix):
                return suffix
    return None


def _p2_short(word: str) -> bool:
    """Whether word ends in a short syllable: consonant-vowel-consonant (the last not w, x
    or Y), or vowel-consonant as the whole word; "past" counts too (pasted, pasting)."""
    n = len(word)
    if (
        n >= 3
        and word[-1] not in _P2_NOT_SHORT_END
        and word[-2] in _P2_VOWELS
        and word[-3] not in _P2_VOWELS
    ):
        return True
    if n == 2 and word[0] in _P2_VOWELS and word[1] not in _P2_VOWELS:
        return True
    return word.endswith("past")


def _porter2(word: str) -> str:
    """Return the Porter2 stem of a word of lower-case ASCII letters (and apostrophes)."""
    if word in _P2_WORDS:
        return _P2_WORDS[word] or word
    if len(word) < 3:
        return word
    if word[0] == "'":
        word = word[1:]
    if "y" in word:  # a consonant y becomes Y: the first letter, or after a vowel
        chars = list(word)
        if chars[0] == "y":
            chars[0] = "Y"
        for i in range(1, len(chars)):
            if chars[i] == "y" and chars[i - 1] in _P2_VOWELS:
                chars[i] = "Y"
        word = "".join(chars)
    # R1: after the first consonant that follows a vowel (or a special prefix); R2: the same
    # again, in R1. Both are kept as offsets: the steps only shorten the word's end.
    n = len(word)
    if word.startswith(_P2_R1_PREFIXES):
        p1 = next(len(p) for p in _P2_R1_PREFIXES if word.startswith(p))
    else:
        m = _P2_REGION_RE.match(word)
        p1 = m.end() if m else n
    m = _P2_REGION_RE.match(word, p1)
    p2 = m.end() if m else n
    # Step 0: a possessive 's, or an apostrophe at the end
    if "'" in word:
        for tail in ("'s'", "'s", "'"):
            if word.endswith(tail):
                word = word[: -len(tail)]
                break
    # Step 1a: plurals
    if word.endswith("sses"):
        word = word[:-2]
    elif word.endswith(("ied", "ies")):
        word = word[:-2] if len(word) > 4 else word[:-1]  # cries -> cri, ties -> tie
    elif (
        word.endswith("s")
        and not word.endswith(("us", "ss"))
        and _P2_VOWEL_RE.search(word, 0, len(word) - 2)
    ):
        word = word[:-1]  # gaps -> gap, but gas
    # Step 1b: -eed, -ed, -ing (and -edly, -ingly)
    suffix = _p2_suffix(word, _P2_1B)
    if suffix:
        s = len(word) - len(suffix)
        base = word[:s]
        if suffix in ("eed", "eedly"):
            if s >= p1 and base not in ("proc", "exc", "succ"):
                word = base + "ee"
        elif suffix == "ing" and s == 2 and base[1] == "y" and base[0] not in _P2_VOWELS:
            word = base[0] + "ie"  # dying -> die, lying -> lie
        elif suffix == "ing" and base in _P2_ING_KEEP:
            pass  # inning, outing, canning, herring, earring, evening
        elif _P2_VOWEL_RE.search(base):
            word = base
            if base.endswith(("at", "bl", "iz")):
                word = base + "e"  # luxuriated -> luxuriate
            elif base.endswith(_P2_DOUBLES):
                if not (len(base) == 3 and base[0] in "aeo"):  # hopping -> hop; but add, egg
                    word = base[:-1]
            elif s == p1 and _p2_short(base):
                word = base + "e"  # hoped -> hope
    # Step 1c: a final y after a consonant (not the first letter) becomes i
    if len(word) > 2 and word[-1] in "yY" and word[-2] not in _P2_VOWELS:
        word = word[:-1] + "i"
    # Step 2: derivational suffixes in R1
    suffix = _p2_suffix(word, _P2_STEP2_ENDS)
    if suffix is not None:
        s = len(word) - len(suffix)
        if s >= p1:
            if suffix == "ogi":
                if word[s - 1 : s] == "l":
                    word = word[:s] + "og"
            elif suffix == "li":
                if s > 0 and word[s - 1] in "cdeghkmnrt":
                    word = word[:s]
            else:
                word = word[:s] + _P2_STEP2[suffix]
    # Step 3
    suffix = _p2_suffix(word, _P2_STEP3_ENDS)
    if suffix is not None:
        s = len(word) - len(suffix)
        if s >= p1 and (suffix != "ative" or s >= p2):
            word = word[:s] + _P2_STEP3[suffix]
    # Step 4: suffixes in R2
    suffix = _p2_suffix(word, _P2_STEP4_ENDS)
    if suffix is not None:
        s = len(word) - len(suffix)
        if s >= p2 and (suffix != "ion" or word[s - 1 : s] in ("s", "t")):
            word = word[:s]
    # Step 5: a final e, or the second l of a final ll
    if word.endswith("e"):
        s = len(word) - 1
        if s >= p2 or (s >= p1 and not _p2_short(word[:s])):
            word = word[:s]
    elif word.endswith("ll") and len(word) - 1 >= p2:
        word = word[:-1]
    return word.replace("Y", "y")


@functools.lru_cache(maxsize=65536)
def stem(word: str) -> str:
    """Return the Porter2 (Snowball English) stem of a folded word; a word that is not all
    ASCII lower-case letters, or has 2 letters or fewer, comes back unchanged.

    >>> [stem(w) for w in ["running", "runs", "keys", "cities", "generously", "news", "café"]]
    ['run', 'run', 'key', 'citi', 'generous', 'news', 'café']
    >>> [stem(w) for w in ["informing", "informed", "information", "dying", "x86", "is"]]
    ['inform', 'inform', 'inform', 'die', 'x86', 'is']
    """
    if len(word) <= 2 or not word.isascii() or not word.isalpha() or not word.islower():
        return word
    return _porter2(word)


def tokenize(text: str) -> list:
    """Return the stems of text, in order.

    >>> tokenize("Running shoes & the spare KEYS, café")
    ['run', 'shoe', 'the', 'spare', 'key', 'cafe']
    """
    return [stem(w) for w in _WORD_RE.findall(fold(text))]


# -- BM25 ---------------------------------------------------------------------
#
# A note's score for a query is the sum, over the query's terms and the two fields
# (body, title), of  bm25_weight(N, df, field) * bm25_tf(tf, dl, avgdl):
#   N      notes in the index          df     notes whose field holds the term
#   tf     the term's count in the field   dl     the field's length in tokens
#   avgdl  the field's average length over all notes
# The index stores bm25_tf per posting (its "impact"); the weight is computed per query.

FIELD_WEIGHTS = {"body": 1.0, "title": TITLE_WEIGHT}


def bm25_idf(n_docs: int, df: int) -> float:
    """Lucene's always-positive inverse document frequency."""
    return math.log(1.0 + (n_docs - df + 0.5) / (df + 0.5))


def bm25_tf(tf: float, dl: float, avgdl: float) -> float:
    """BM25's saturated, length-normalised term frequency (the per-posting impact).

    tf: occurrences of the term in the field; dl: the field's length in tokens;
    avgdl: the average length of that field over all documents.
    """
    return tf * (K1 + 1.0) / (tf + K1 * (1.0 - B + B * dl / max(avgdl, 1.0)))


def bm25_weight(n_docs: int, df: int, field: str = "body") -> float:
    """Return a term's weight in one field: the field's weight times the term's IDF."""
    return FIELD_WEIGHTS[field] * bm25_idf(n_docs, df)


# -- the query language -------------------------------------------------------


class Query:
    """A parsed query: clauses that must all match, each a list of alternatives (OR).

    An alternative is ("word", stem), ("phrase", [stems]) or ("prefix", folded text).
    """

    def __init__(self, text: str):
        self.text = text
        self.clauses: list = []
        self.excludes: list = []
        self._parse(text)

    def _parse(self, text: str) -> None:
        if not text.strip():
            raise bad_request("'q' is required: give one or more words to search for")
        if len(text) > MAX_QUERY_CHARS:
            raise bad_request(f"the query is longer than {MAX_QUERY_CHARS} characters")
        if text.count('"') % 2:
            raise bad_request('the query has an unbalanced quote: close the " or remove it')
        items = re.findall(r'(-?)"([^"]*)"|(\S+)', text)
        pending_or = False
        for neg, phrase, word in items:
            if word == "OR":
                if not self.clauses or pending_or:
                    raise bad_request("OR needs a word on each side, as in: cats OR dogs")
                pending_or = True
                continue
            negative = bool(neg) or (word.startswith("-") and len(word) > 1)
            raw = phrase if not word else word.lstrip("-") if negative else word
            alt = self._alternative(raw, quoted=not word)
            if alt is None:
                continue
            if negative:
                if pending_or:
                    raise bad_request("an -exclusion cannot be part of an OR")
                self.excludes.append(alt)
            elif pending_or:
                self.clauses[-1].append(alt)
                pending_or = False
            else:
                self.clauses.append([alt])
        if pending_or:
            raise bad_request("OR needs a word on each side, as in: cats OR dogs")
        if not self.clauses:
            if self.excludes:
                raise bad_request("the query only excludes: add a word to search for")
            raise bad_request("the query has no searchable words (letters or digits)")

    @staticmethod
    def _alternative(raw: str, quoted: bool):
        if not quoted and raw.endswith("*"):
            prefix = fold(raw.rstrip("*"))
            if len(prefix) < 2 or not _WORD_RE.fullmatch(prefix):
                raise bad_request("a prefix* needs at least 2 letters or digits before the *")
            return ("prefix", prefix)
        stems = tokenize(raw)
        if not stems:
            return None
        return ("word", stems[0]) if len(stems) == 1 else ("phrase", stems)


# -- snippets -----------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _skip_tokens(n: int, ascii_only: bool) -> re.Pattern:
    return re.compile(r"\W*(?:\w+\W+){" + str(n) + "}", re.ASCII if ascii_only else 0)


def _token_offset(text: str, k: int) -> int | None:
    """Return where token k (0-based) of text starts, skipping tokens in C-level steps."""
    pos, ascii_only = 0, text.isascii()
    while k > 0:
        n = min(k, 100)
        m = _skip_tokens(n, ascii_only).match(text, pos)
        if m is None:
            return None
        pos, k = m.end(), k - n
    m = _WORD_RE.search(text, pos)
    return m.start() if m else None


def _snippet(text: str, toks: str, needles: list) -> str:
    """Return up to SNIPPET_CHARS of the body around the first match of the best needle."""
    index = -1
    for needle in needles:
        index = toks.find(needle)
        if index >= 0:
            break
    start = 0
    at = _token_offset(text, index) if index > 0 else None
    if at is not None:
        start = max(0, at - 60)
        while start > 0 and not text[start - 1].isspace() and at - start < 90:
            start -= 1
    end = start + SNIPPET_CHARS + 40
    window = " ".join(text[start:end].split())
    lead = "…" if start > 0 else ""
    room = SNIPPET_CHARS - len(lead)
    if len(window) > room or end < len(text):
        cut = window[: room - 1]
        cut = cut.rsplit(" ", 1)[0] if " " in cut[20:] else cut
        return lead + cut + "…"
    return lead + window


# -- segments ---------------------------------------------------------------------
#
# The index is a list of segments, each a small inverted index of some notes: immutable
# files in <root>/.notesvc/index/ read in place through mmap (a sorted term dictionary of
# which only every SPARSE_EVERY-th term is held in memory, postings as packed arrays, the
# notes' paths, titles, lengths and term strings), and one segment in memory that takes the
# changes. A replaced or removed note stays in its segment marked deleted: at any time a path
# has at most one live entry over all segments. A background thread writes the memory
# segment to a file and merges files of similar size into one; <root>/.notesvc/index.cache,
# the commit point, names the files and their deletions and is replaced atomically.
#
# Each segment numbers its own terms; a note's terms are kept as a string of term chars
# (U+0100 upward, one per token, UTF-8 on disk), so a phrase check is a substring search
# (mmap.find) and a match's position is its token index.
#
# Scores are exact BM25 over the live notes: N, df and the average field lengths are summed
# over the segments at query time, deleted notes subtracted. Postings hold impacts computed
# with the averages of their day (the top-k of one word is heapq over an array); the few
# notes that can reach the top are rescored with today's averages from their term
# frequencies, and impact(today) / impact(then) <= max(1, avg(today) / avg(then)) says when
# no other note can.

Doc = collections.namedtuple("Doc", "path size mtime title toks title_toks")
Doc.__doc__ = """A note analysed for indexing: toks / title_toks are strings of term chars."""
IndexedNote = collections.namedtuple("IndexedNote", "path title text")

SPARSE_EVERY = 64  # one dictionary entry in this many is held in memory
FLUSH_DOCS = 1000  # the memory segment is written to a file at this many notes...
FLUSH_TOKENS = 2_000_000  # ...or tokens
COMMIT_SECONDS = 30.0  # other changes reach the disk within this
BULK_CHUNK_NOTES = 2000  # notes analysed per segment file when many are (re)read...
BULK_CHUNK_CHARS = 8_000_000  # ...or this much text
MERGE_FACTOR = 3  # segments of one size class merged at once
MAX_DELETED = 0.3  # a segment with this share of deleted notes is rewritten
STEM_CACHE = 100_000  # words whose stems one bulk remembers (the common ones come first)
_OVERFLOW = "\xff"  # the term char of stems past the last code point (not indexed)
_APPEND = array.array.append
_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)
_NOT_MINUS_ONE = (-1).__ne__
_EPS = 1e-6  # float32 impacts against float64 scores


def _term_char_of(n: int) -> str:
    """Return the term char of term number n (U+0100 upward, surrogates skipped)."""
    cp = 0x100 + n
    if cp >= 0xD800:
        cp += 0x800
    return chr(cp) if cp <= 0x10FFFF else _OVERFLOW


def _term_number(ch: str) -> int:
    cp = ord(ch)
    return cp - (0x900 if cp >= 0xE000 else 0x100)


def _exact_tf(imp: float, dl: int, avg_then: float, avg_now: float) -> float:
    """Return bm25_tf with today's average from an impact computed with avg_then."""
    room = K1 + 1.0 - imp
    if room <= 1e-5:  # saturated: a term this frequent scores the same with any average
        return imp
    tf = max(1.0, float(round(imp * K1 * (1.0 - B + B * dl / avg_then) / room)))
    return bm25_tf(tf, dl, avg_now)


def _has(ids, d: int) -> int:
    """Return the position of d in the sorted sequence ids, or -1."""
    i = bisect.bisect_left(ids, d)
    return i if i < len(ids) and ids[i] == d else -1


_ASCII_SPACES = bytes(c if (chr(c).isalnum() and c < 128) or c == 95 else 32 for c in range(256))


class _Vocab:
    """The term numbers of one segment being built, and the folded words that map to them
    (the prefix* vocabulary). encode() turns text into a string of term chars."""

    def __init__(self, stem_cache: dict | None = None):
        self.ascii: dict = {}  # folded ASCII word (bytes) -> term char: the fast path
        self.surfaces: dict = {}  # folded word of a non-ASCII text -> term char
        self.chars: dict = {}  # stem -> term char
        self.stems: list = []  # by term number
        self._cache = stem_cache

    def copy(self) -> _Vocab:
        new = _Vocab()
        new.ascii, new.surfaces = dict(self.ascii), dict(self.surfaces)
        new.chars, new.stems = dict(self.chars), [*self.stems]
        return new

    def _char(self, word) -> str:
        """Return the term char of a folded word (str, or ASCII bytes), numbering its stem."""
        if isinstance(word, bytes):
            word = word.decode()
        cache = self._cache
        term = cache.get(word) if cache is not None else None
        if term is None:
            term = stem(word)
            if cache is not None and len(cache) < STEM_CACHE:
                cache[word] = term
        ch = self.chars.get(term)
        if ch is None:
            ch = _term_char_of(len(self.stems))
            if ch == _OVERFLOW:
                return ch
            self.chars[term] = ch
            self.stems.append(term)
        return ch

    def encode(self, text: str) -> str:
        """Return the term chars of text's tokens, in order."""
        text = fold(text)
        if text.isascii():  # the same tokens as _ASCII_WORD_RE, split at C speed
            words, chars = text.encode().translate(_ASCII_SPACES).split(), self.ascii
        else:
            words, chars = _WORD_RE.findall(text), self.surfaces
        try:
            return "".join(map(chars.__getitem__, words))
        except KeyError:  # new words: give them term chars, then encode again
            for w in set(words).difference(chars):
                chars[w] = self._char(w)
            return "".join(map(chars.__getitem__, words))

    def analyse(self, path: str, text: str, size: int, mtime: int) -> Doc:
        text = unicodedata.normalize("NFC", text)
        title = note_title(text, path)
        return Doc(path, size, mtime, title, self.encode(text), self.encode(title))

    def words_utf8(self) -> list:
        """Return [(folded word as UTF-8, term char)] sorted (overflowing stems left out)."""
        found = dict(self.ascii)
        found.update((w.encode(), ch) for w, ch in self.surfaces.items())
        return sorted(item for item in found.items() if item[1] != _OVERFLOW)

    def words(self) -> list:
        """Return [(folded word, term char)] sorted by word (overflowing stems left out)."""
        found = {w.decode(): ch for w, ch in self.ascii.items()}
        found.update(self.surfaces)
        return sorted(item for item in found.items() if item[1] != _OVERFLOW)


def _count_terms(counter: dict, keys: Iterable) -> None:
    for key in keys:
        counter[key] = counter.get(key, 0) + 1


class MemorySegment:
    """A segment in memory: the notes changed since the last flush (or a bulk's notes that
    could not be written to disk). Append-only: a replaced note is marked deleted."""

    name = "memory"

    def __init__(self, vocab: _Vocab | None = None):
        self.vocab = vocab or _Vocab()
        self.docs: list = []  # Doc by id
        self.avgs: list = []  # the (body, title) averages each note's impacts were computed with
        self.ids: dict = {}  # path -> id of its live entry
        self.post: tuple = ([], [])  # per field, by code point of the term char: None or
        # (array of ids, array of impacts)
        self.lens = [0, 0]
        self.tokens = 0
        self.deleted: set = set()
        self.del_df: tuple = ({}, {})  # per field: term -> deleted notes holding it
        self.del_lens = [0, 0]
        self.avg_range = [[math.inf, 0.0], [math.inf, 0.0]]
        self._sorted: list = []  # the vocabulary's words, sorted when it grew
        self._sorted_size = 0

    @property
    def n(self) -> int:
        return len(self.docs)

    def add(self, doc: Doc, avg: tuple) -> int:
        d = len(self.docs)
        self.docs.append(doc)
        self.avgs.append(avg)
        self.ids[doc.path] = d
        self.tokens += len(doc.toks)
        for f, toks in enumerate((doc.toks, doc.title_toks)):
            dl, a = len(toks), avg[f]
            self.lens[f] += dl
            span = self.avg_range[f]
            span[0], span[1] = min(span[0], a), max(span[1], a)
            counts = collections.Counter(toks)
            counts.pop(_OVERFLOW, None)
            if not counts:
                continue
            table = self.post[f]
            cps, tfs = list(map(ord, counts)), list(counts.values())
            if max(cps) >= len(table):
                table.extend([None] * (max(cps) + 1024 - len(table)))
            by_tf = {tf: bm25_tf(tf, dl, a) for tf in set(tfs)}
            entries = list(map(table.__getitem__, cps))
            if None in entries:
                for i, entry in enumerate(entries):
                    if entry is None:
                        entries[i] = table[cps[i]] = (array.array("I"), array.array("f"))
            deque(map(_APPEND, map(_FIRST, entries), itertools.repeat(d)), 0)
            deque(map(_APPEND, map(_SECOND, entries), map(by_tf.__getitem__, tfs)), 0)
        return d

    def delete(self, d: int) -> None:
        if d in self.deleted:
            return
        self.deleted.add(d)
        doc = self.docs[d]
        if self.ids.get(doc.path) == d:
            del self.ids[doc.path]
        for f, toks in enumerate((doc.toks, doc.title_toks)):
            self.del_lens[f] += len(toks)
            _count_terms(self.del_df[f], set(toks).difference(_OVERFLOW))

    # -- what searching asks of every segment -------------------------------------------

    def keys(self, stems: list) -> list:
        return list(map(self.vocab.chars.get, stems))

    def postings(self, key, f: int):
        table, cp = self.post[f], ord(key)
        return table[cp] if cp < len(table) else None

    def counts(self, key) -> tuple:
        """Return how many notes (deleted ones included) hold a term in body and title."""
        return tuple(len(p[0]) if p else 0 for p in (self.postings(key, 0), self.postings(key, 1)))

    def char(self, key) -> str:
        return key

    def toks(self, d: int, f: int) -> str:
        return self.docs[d][4 + f]

    def path(self, d: int) -> str:
        return self.docs[d].path

    def title(self, d: int) -> str:
        return self.docs[d].title

    def sig(self, d: int) -> tuple:
        doc = self.docs[d]
        return doc.size, doc.mtime

    def dl(self, d: int, f: int) -> int:
        return len(self.docs[d][4 + f])

    def avg_then(self, d: int, f: int) -> float:
        return self.avgs[d][f]

    def find(self, path: str):
        return self.ids.get(path)

    def phrase(self, cands: Iterable, chars: list, rare: int, f: int) -> list:
        """Return the candidates whose field holds the term chars in a row."""
        docs, needle = self.docs, "".join(chars)
        return [d for d in cands if needle in docs[d][4 + f]]

    def in_folder(self, cands: set, prefix: str) -> set:
        docs = self.docs
        return {d for d in cands if docs[d].path.startswith(prefix)}

    def prefix_words(self, prefix: str, cap: int) -> list:
        """Return [(folded word, stem)] of up to cap words starting with prefix, sorted."""
        vocab = self.vocab
        size = len(vocab.ascii) + len(vocab.surfaces)
        if self._sorted_size != size:
            self._sorted, self._sorted_size = vocab.words(), size
        words = self._sorted
        i = bisect.bisect_left(words, (prefix,))
        out = []
        while i < len(words) and words[i][0].startswith(prefix) and len(out) < cap:
            out.append((words[i][0], vocab.stems[_term_number(words[i][1])]))
            i += 1
        return out

    def live(self) -> list:
        """Return [(path, id)] of the live notes (a snapshot, taken under the index lock)."""
        return list(self.ids.items())

    # -- what the segment writer reads -----------------------------------------------------

    def sorted_terms(self) -> Iterable:
        return iter(sorted(self.vocab.chars.items()))

    def sorted_surfaces(self) -> Iterable:
        return iter(self.vocab.words())

    def term_count(self) -> int:
        return len(self.vocab.stems)

    def key_number(self, key) -> int:
        return _term_number(key)

    def tok_text(self, d: int, f: int) -> str:
        return self.docs[d][4 + f]

    def title_bytes(self, d: int) -> bytes:
        return self.docs[d].title.encode()

    def path_bytes(self, d: int) -> bytes:
        return self.docs[d].path.encode()

    def by_path(self) -> list:
        docs = self.docs
        return sorted(range(len(docs)), key=lambda d: docs[d].path)


# -- persistence --------------------------------------------------------------
#
# A segment file: an 8-byte magic, 8-aligned sections (arrays in native byte order,
# strings "\n"-terminated), a JSON footer naming them with the format, counts and a
# CRC-32 of everything before it, then the footer's length, its CRC and the magic again.
# The commit file (<root>/.notesvc/index.cache) has the same frame around the list of
# segment files and their deleted notes. Files are written with atomic_write (0600).


class IndexFileError(ValueError):
    """An index file that is missing, old, foreign, truncated or damaged."""


_SEGMENT_MAGIC = b"NSVCSEG\x00"
_COMMIT_MAGIC = b"NSVCIDX\x00"
_TRAILER = struct.Struct("<II8s")  # footer length, footer crc32, magic
# name: (array type, items per note or term, extra items): how long each section must be
_SECTIONS = {
    "ids": ("I", None, 0, 0),  # postings, term by term (body, then title): note ids...
    "imps": ("f", None, 0, 0),  # ...and their BM25 impacts (the same positions)
    "terms": ("I", "terms", 4, 0),  # per term: body start, count, title start, count
    "dict_off": ("I", "dict", 1, 1),
    "dict_tid": ("I", "dict", 1, 0),
    "tid_rank": ("I", "terms", 1, 0),
    "surf_off": ("I", "surfaces", 1, 1),
    "surf_tid": ("I", "surfaces", 1, 0),
    "size": ("Q", "docs", 1, 0),
    "mtime": ("q", "docs", 1, 0),
    "dl": ("I", "docs", 2, 0),
    "avg": ("f", "docs", 2, 0),
    "tok_off": ("Q", "docs", 2, 1),
    "path_off": ("I", "docs", 1, 1),
    "title_off": ("I", "docs", 1, 1),
    "by_path": ("I", "docs", 1, 0),
}
_TEXT_SECTIONS = ("dict", "dict_sparse", "surf", "surf_sparse", "paths", "titles", "tokens")


class DiskSegment:
    """A segment file, read in place through mmap; raises IndexFileError when damaged."""

    def __init__(self, path: Path):
        self.file = path
        self.name = path.name
        try:
            with open(path, "rb") as f:
                self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:  # ValueError: an empty file
            raise IndexFileError(f"{path.name}: cannot be opened ({e})") from None
        self.meta = meta = _read_footer(self.mm, _SEGMENT_MAGIC, path.name)
        try:
            self.n, self.nt = int(meta["docs"]), int(meta["terms"])
            self.nd, self.ns = int(meta["dict"]), int(meta["surfaces"])
            self.lens = [int(x) for x in meta["lens"]]
            self.avg_range = [[float(a), float(b)] for a, b in meta["avg_range"]]
            self.crc = int(meta["crc"])
            bounds = {k: (int(a), int(b)) for k, (a, b) in meta["sections"].items()}
        except (KeyError, TypeError, ValueError) as e:
            raise IndexFileError(f"{path.name}: unreadable header ({e})") from None
        self.body_end = len(self.mm) - _TRAILER.size - int(meta["footer"])
        view = memoryview(self.mm)
        self.text: dict = {}
        counts = {"docs": self.n, "terms": self.nt, "dict": self.nd, "surfaces": self.ns}
        for name in (*_SECTIONS, *_TEXT_SECTIONS):
            if name not in bounds:
                raise IndexFileError(f"{path.name}: section {name} is missing")
            start, length = bounds[name]
            if start < 16 or length < 0 or start + length > self.body_end or start % 8:
                raise IndexFileError(f"{path.name}: section {name} is out of bounds")
            if name in _TEXT_SECTIONS:
                self.text[name] = start
                continue
            spec = _SECTIONS[name]
            part = view[start : start + length]
            if length % struct.calcsize(spec[0]):
                raise IndexFileError(f"{path.name}: section {name} has a torn item")
            arr = part.cast(spec[0])
            if spec[1] is not None and len(arr) != counts[spec[1]] * spec[2] + spec[3]:
                raise IndexFileError(f"{path.name}: section {name} does not add up")
            setattr(self, "_" + name, arr)
        if len(self._ids) != len(self._imps):
            raise IndexFileError(f"{path.name}: postings do not add up")
        self.sparse = {
            kind: self.mm[slice(*_span(bounds[kind + "_sparse"]))].decode().split("\n")[:-1]
            for kind in ("dict", "surf")
        }
        self.deleted: set = set()
        self.del_df: tuple = ({}, {})
        self.del_lens = [0, 0]

    def verify(self) -> None:
        """Check the whole file against its checksum (reads it, does not map it)."""
        crc, left = 0, self.body_end
        with open(self.file, "rb") as f:
            while left > 0:
                chunk = f.read(min(left, 1 << 20))
                if not chunk:
                    break
                crc = zlib.crc32(chunk, crc)
                left -= len(chunk)
        if left or crc != self.crc:
            raise IndexFileError(f"{self.name}: checksum mismatch")

    def delete(self, d: int) -> None:
        if d in self.deleted or not 0 <= d < self.n:
            return
        self.deleted.add(d)
        for f in (0, 1):
            toks = self.tok_text(d, f)
            self.del_lens[f] += len(toks)
            numbers = map(_term_number, set(toks).difference(_OVERFLOW))
            _count_terms(self.del_df[f], numbers)

    # -- sorted string tables: the dictionary, the surfaces, the paths -----------------------

    def _strings(self, kind: str, lo: int, hi: int) -> list:
        off = self._dict_off if kind == "dict" else self._surf_off
        base = self.text[kind]
        return self.mm[base + off[lo] : base + off[hi]].decode().split("\n")[:-1]

    def _seek(self, kind: str, word: str) -> tuple:
        """Return (position of the first entry >= word, the block read, its first position)."""
        count = self.nd if kind == "dict" else self.ns
        i = bisect.bisect_right(self.sparse[kind], word) - 1
        if i < 0:
            return 0, [], 0
        lo = i * SPARSE_EVERY
        block = self._strings(kind, lo, min(lo + SPARSE_EVERY, count))
        return lo + bisect.bisect_left(block, word), block, lo

    def keys(self, stems: list) -> list:
        """Return the term number of each stem (None where absent); stems sorted or not."""
        out = []
        if len(stems) > 8:  # one read of the dictionary range the stems span
            first, last = min(stems), max(stems)
            lo = self._seek("dict", first)[0]
            hi = self._seek("dict", last + "\0")[0]
            if hi - lo <= 16 * len(stems):
                table = dict(zip(self._strings("dict", lo, hi), self._dict_tid[lo:hi]))
                return list(map(table.get, stems))
        for s in stems:
            pos, block, lo = self._seek("dict", s)
            j = pos - lo
            out.append(self._dict_tid[pos] if j < len(block) and block[j] == s else None)
        return out

    def counts(self, key: int) -> tuple:
        """Return how many notes (deleted ones included) hold a term in body and title."""
        return self._terms[4 * key + 1], self._terms[4 * key + 3]

    def postings(self, key: int, f: int):
        at = 4 * key + 2 * f
        start, n = self._terms[at], self._terms[at + 1]
        if not n:
            return None
        return self._ids[start : start + n], self._imps[start : start + n]

    def char(self, key: int) -> str:
        return _term_char_of(key)

    def _tok_span(self, d: int, f: int) -> tuple:
        base, off = self.text["tokens"], self._tok_off
        return base + off[2 * d + f], base + off[2 * d + f + 1]

    def tok_bytes(self, d: int, f: int) -> bytes:
        a, b = self._tok_span(d, f)
        return self.mm[a:b]

    def tok_text(self, d: int, f: int) -> str:
        return self.tok_bytes(d, f).decode()

    toks = tok_text

    def path_bytes(self, d: int) -> bytes:
        base, off = self.text["paths"], self._path_off
        return self.mm[base + off[d] : base + off[d + 1]]

    def path(self, d: int) -> str:
        return self.path_bytes(d).decode()

    def title_bytes(self, d: int) -> bytes:
        base, off = self.text["titles"], self._title_off
        return self.mm[base + off[d] : base + off[d + 1]]

    def title(self, d: int) -> str:
        return self.title_bytes(d).decode()

    def sig(self, d: int) -> tuple:
        return self._size[d], self._mtime[d]

    def dl(self, d: int, f: int) -> int:
        return self._dl[2 * d + f]

    def avg_then(self, d: int, f: int) -> float:
        return self._avg[2 * d + f]

    def _path_pos(self, target: bytes) -> int:
        """Return the first position in path order whose path is >= target."""
        order, lo, hi = self._by_path, 0, self.n
        while lo < hi:
            mid = (lo + hi) // 2
            if self.path_bytes(order[mid]) < target:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def find(self, path: str):
        target = path.encode()
        pos = self._path_pos(target)
        if pos < self.n:
            d = self._by_path[pos]
            if d not in self.deleted and self.path_bytes(d) == target:
                return d
        return None

    def phrase(self, cands: Iterable, chars: list, rare: int, f: int) -> list:
        """Return the candidates whose field holds the term chars in a row.

        rare: the position of a term much rarer than the others, or -1. Then the search
        starts at that term (a regular expression, whose first byte is found at C speed)
        and the terms before it are compared where it matched; a phrase of common words
        is one mmap.find per candidate.
        """
        cands = list(cands)
        first, last = self._tok_spans[f]
        base, mm = self.text["tokens"], self.mm
        if rare < 0:
            starts = map(base.__add__, map(first.__getitem__, cands))
            ends = map(base.__add__, map(last.__getitem__, cands))
            found = map(mm.find, itertools.repeat("".join(chars).encode()), starts, ends)
            return list(itertools.compress(cands, map(_NOT_MINUS_ONE, found)))
        head = "".join(chars[:rare]).encode()
        search = re.compile(re.escape("".join(chars[rare:]).encode())).search
        starts = map((base + len(head)).__add__, map(first.__getitem__, cands))
        ends = map(base.__add__, map(last.__getitem__, cands))
        out = []
        for d, m in zip(cands, map(search, itertools.repeat(mm), starts, ends)):
            while m is not None:  # only where the rare part matched: compare what precedes
                at = m.start()
                if mm[at - len(head) : at] == head:
                    out.append(d)
                    break
                m = search(mm, at + 1, base + last[d])
        return out

    @functools.cached_property
    def _tok_spans(self) -> tuple:
        """Per field: (start offsets, end offsets) of the notes' term strings, by note id."""
        off = self._tok_off
        return (off[0:-1:2], off[1::2]), (off[1::2], off[2::2])

    def in_folder(self, cands: set, prefix: str) -> set:
        target = prefix.encode()
        lo, hi = self._path_pos(target), self._path_pos(target + b"\xff")
        if hi - lo > 4 * len(cands):
            return {d for d in cands if self.path_bytes(d).startswith(target)}
        return cands.intersection(self._by_path[lo:hi])

    def prefix_words(self, prefix: str, cap: int) -> list:
        pos = self._seek("surf", prefix)[0]
        words = self._strings("surf", pos, min(pos + cap, self.ns))
        out = []
        for w, tid in zip(words, self._surf_tid[pos : pos + len(words)]):
            if not w.startswith(prefix):
                break
            out.append((w, tid))
        stems = self._stems([tid for _, tid in out])
        return [(w, s) for (w, _), s in zip(out, stems)]

    def _stems(self, tids: list) -> list:
        base, off, rank = self.text["dict"], self._dict_off, self._tid_rank
        mm = self.mm
        return [mm[base + off[rank[t]] : base + off[rank[t] + 1] - 1].decode() for t in tids]

    def live(self) -> list:
        deleted = self.deleted
        return [(self.path(d), d) for d in range(self.n) if d not in deleted]

    # -- what the segment writer reads -----------------------------------------------------

    def sorted_terms(self) -> Iterable:
        for lo in range(0, self.nd, 512):
            hi = min(lo + 512, self.nd)
            yield from zip(self._strings("dict", lo, hi), self._dict_tid[lo:hi])

    def sorted_surfaces(self) -> Iterable:
        for lo in range(0, self.ns, 512):
            hi = min(lo + 512, self.ns)
            yield from zip(self._strings("surf", lo, hi), self._surf_tid[lo:hi])

    def term_count(self) -> int:
        return self.nt

    @staticmethod
    def key_number(key: int) -> int:
        return key

    def by_path(self) -> memoryview:
        return self._by_path


def _span(bounds: tuple) -> tuple:
    return bounds[0], bounds[0] + bounds[1]


def _read_footer(mm, magic: bytes, name: str) -> dict:
    """Return the JSON footer of an index file (checked: magic, length, crc, format)."""
    size = len(mm)
    if size < 16 + _TRAILER.size or mm[:8] != magic:
        raise IndexFileError(f"{name}: not an index file of this kind")
    length, crc, tail = _TRAILER.unpack(mm[size - _TRAILER.size :])
    if tail != magic or length > size - 16 - _TRAILER.size:
        raise IndexFileError(f"{name}: truncated")
    raw = mm[size - _TRAILER.size - length : size - _TRAILER.size]
    if zlib.crc32(raw) != crc:
        raise IndexFileError(f"{name}: damaged footer")
    try:
        meta = json.loads(raw)
    except ValueError:
        raise IndexFileError(f"{name}: damaged footer") from None
    if not isinstance(meta, dict) or meta.get("format") != list(INDEX_FORMAT):
        raise IndexFileError(f"{name}: an index of another format")
    if meta.get("byteorder") != sys.byteorder:
        raise IndexFileError(f"{name}: written on a machine of another byte order")
    meta["footer"] = length
    return meta


class _FileWriter:
    """Writes an index file: 8-aligned sections, a checksum, a JSON footer."""

    def __init__(self, f, magic: bytes):
        self.f, self.pos, self.crc = f, 0, 0
        self.sections: dict = {}
        self.magic = magic
        self.write(magic + bytes(8))

    def write(self, data) -> None:
        self.f.write(data)
        self.crc = zlib.crc32(data, self.crc)
        self.pos += len(data) if isinstance(data, bytes) else memoryview(data).nbytes

    def align(self) -> None:
        if self.pos % 8:
            self.write(bytes(8 - self.pos % 8))

    def section(self, name: str, *parts) -> None:
        self.align()
        start = self.pos
        for part in parts:
            self.write(part)
        self.sections[name] = (start, self.pos - start)

    def begin(self, name: str) -> None:
        self.align()
        self.sections[name] = (self.pos, None)

    def end(self, name: str) -> None:
        start = self.sections[name][0]
        self.sections[name] = (start, self.pos - start)

    def finish(self, meta: dict) -> None:
        self.align()
        footer = {
            **meta,
            "format": list(INDEX_FORMAT),
            "byteorder": sys.byteorder,
            "crc": self.crc,
            "sections": self.sections,
        }
        raw = json.dumps(footer, separators=(",", ":")).encode()
        self.f.write(raw + _TRAILER.pack(len(raw), zlib.crc32(raw), self.magic))


class _Cancelled(Exception):
    """A merge stopped because the index is closing."""


def _tagged(pairs: Iterable, i: int) -> Iterable:
    """Yield (word, i, key) for (word, key) of source i (a function: i bound per source)."""
    for word, key in pairs:
        yield word, i, key


def _path_order(src, remap) -> Iterable:
    """Yield (path bytes, new id) of a source's kept notes in path order."""
    for d in src.by_path():
        if remap[d] >= 0:
            yield src.path_bytes(d), remap[d]


def _merged_terms(sources: list) -> Iterable:
    """Yield (stem, [(source number, key)]) over the sources' dictionaries, in stem order."""
    streams = [_tagged(src.sorted_terms(), i) for i, src in enumerate(sources)]
    for stem_, parts in itertools.groupby(heapq.merge(*streams), key=_FIRST):
        yield stem_, [(i, k) for _, i, k in parts]


def _live_df(sources: list, dels: list, parts: list) -> tuple:
    """Return a term's (body, title) document frequencies over sources, deletions aside."""
    body = title = 0
    for i, k in parts:
        n_body, n_title = sources[i].counts(k)
        body += n_body - dels[i][0].get(k, 0) if n_body else 0
        title += n_title - dels[i][1].get(k, 0) if n_title else 0
    return body, title


def _norms(sources: list, remaps: list, avg: tuple) -> list:
    """Per field: (each merged note's BM25 length norm with the averages of its impacts,
    with today's averages), by new note id; None where every note already has today's."""
    out = []
    for f in (0, 1):
        then, now, stale = array.array("d"), array.array("d"), False
        for src, remap in zip(sources, remaps):
            for d in range(src.n):
                if remap[d] >= 0:
                    dl, a = src.dl(d, f), src.avg_then(d, f)
                    stale = stale or abs(a - avg[f]) > 1e-6 * avg[f]
                    then.append(K1 * (1 - B + B * dl / a))
                    now.append(K1 * (1 - B + B * dl / avg[f]))
        out.append((then, now) if stale else None)
    return out


def _rescore(ids, imps, then, now) -> array.array:
    """Return impacts computed again with new length norms: each term frequency recovered
    from its impact and its note's old norm, then scored with the new one (C-level maps)."""
    top = K1 + 1.0
    tfs = list(
        map(
            max,
            itertools.repeat(1),
            map(
                round,
                map(
                    operator.truediv,
                    map(operator.mul, imps, map(then.__getitem__, ids)),
                    map(
                        max, map(operator.sub, itertools.repeat(top), imps), itertools.repeat(1e-6)
                    ),
                ),
            ),
        )
    )
    return array.array(
        "f",
        map(
            operator.truediv,
            map(top.__mul__, tfs),
            map(operator.add, tfs, map(now.__getitem__, ids)),
        ),
    )


def _write_postings(out, spill, sources, skips, remaps, norms, parts: list, f: int) -> int:
    """Write one term's postings in one field (ids to out, impacts to spill), impacts
    computed again when norms are given; return how many."""
    ids_out, imps_out = array.array("I"), array.array("f")
    for i, k in parts:
        p = sources[i].postings(k, f)
        if not p:
            continue
        ids, imps = p
        if skips[i]:
            mapped = list(map(remaps[i].__getitem__, ids))
            keep = list(map(_NOT_MINUS_ONE, mapped))
            ids_out.extend(itertools.compress(mapped, keep))
            imps_out.extend(itertools.compress(imps, keep))
            continue
        shift = remaps[i][ids[0]] - ids[0]
        ids_out.extend(map(shift.__add__, ids) if shift else ids)
        imps_out.extend(imps)
    if norms is not None and norms[f] is not None and ids_out:
        imps_out = _rescore(ids_out, imps_out, *norms[f])
    out.write(ids_out.tobytes())
    spill.write(imps_out.tobytes())
    return len(ids_out)


def _text_table(words: list) -> tuple:
    """Return (text, offsets, sparse directory) of a sorted string table (str or UTF-8)."""
    raw = [w + b"\n" if isinstance(w, bytes) else (w + "\n").encode() for w in words]
    offsets = array.array("I", itertools.accumulate(map(len, raw), initial=0))
    return b"".join(raw), offsets, b"".join(raw[::SPARSE_EVERY])


def _write_tables(out: _FileWriter, stems: list, tids: list, words: list, surf_tids) -> None:
    """Write the dictionary (stems sorted, with their term numbers) and the folded words."""
    text, offsets, sparse = _text_table(stems)
    out.section("dict", text)
    out.section("dict_sparse", sparse)
    out.section("dict_off", offsets.tobytes())
    out.section("dict_tid", array.array("I", tids).tobytes())
    text, offsets, sparse = _text_table(words)
    out.section("surf", text)
    out.section("surf_sparse", sparse)
    out.section("surf_off", offsets.tobytes())
    out.section("surf_tid", array.array("I", surf_tids).tobytes())


def write_batch(f, docs: list, vocab: _Vocab, avg: tuple) -> None:
    """Write analysed notes (Doc, in this order) as one segment file to f: the bulk build's
    fast path, with no Python work per posting beyond C-level maps and one sort per field.

    avg: the (body, title) average lengths the impacts are computed with.
    """
    out = _FileWriter(f, _SEGMENT_MAGIC)
    n, nt = len(docs), len(vocab.stems)
    terms = array.array("I", bytes(16 * nt))
    start = 0
    for fld in (0, 1):  # postings in note order, then sorted by term (stable: ids sorted)
        cps, owners, imps = array.array("I"), array.array("I"), array.array("f")
        for d, doc in enumerate(docs):
            toks = doc[4 + fld]
            counts = collections.Counter(toks)
            counts.pop(_OVERFLOW, None)
            if counts:
                tfs = list(counts.values())
                by_tf = {tf: bm25_tf(tf, len(toks), avg[fld]) for tf in set(tfs)}
                cps.extend(map(ord, counts))
                owners.extend(itertools.repeat(d, len(tfs)))
                imps.extend(map(by_tf.__getitem__, tfs))
        order = sorted(range(len(cps)), key=cps.__getitem__)
        if fld == 0:
            out.begin("ids")
            spill = [array.array("f", map(imps.__getitem__, order))]
        else:
            spill.append(array.array("f", map(imps.__getitem__, order)))
        out.write(array.array("I", map(owners.__getitem__, order)).tobytes())
        for cp, count in sorted(collections.Counter(cps).items()):
            at = 4 * (cp - (0x900 if cp >= 0xE000 else 0x100)) + 2 * fld  # _term_number
            terms[at], terms[at + 1] = start, count
            start += count
        del cps, owners, imps, order
    out.end("ids")
    out.section("imps", *(part.tobytes() for part in spill))
    out.section("terms", terms.tobytes())
    stems = vocab.stems
    by_stem = sorted(range(nt), key=stems.__getitem__)
    tid_rank = array.array("I", bytes(4 * nt))
    for pos, tid in enumerate(by_stem):
        tid_rank[tid] = pos
    out.section("tid_rank", tid_rank.tobytes())
    words = vocab.words_utf8()
    _write_tables(
        out,
        [stems[t] for t in by_stem],
        by_stem,
        [w for w, _ in words],
        [_term_number(ch) for _, ch in words],
    )
    toks = [t.encode() for doc in docs for t in (doc.toks, doc.title_toks)]
    out.section("tokens", *toks)
    out.section("tok_off", array.array("Q", itertools.accumulate(map(len, toks), initial=0)))
    del toks
    paths = [doc.path.encode() for doc in docs]
    titles = [doc.title.encode() for doc in docs]
    for name, strings in (("paths", paths), ("titles", titles)):
        out.section(name, *strings)
        offsets = array.array("I", itertools.accumulate(map(len, strings), initial=0))
        out.section(name[:-1] + "_off", offsets.tobytes())
    out.section("by_path", array.array("I", sorted(range(n), key=paths.__getitem__)).tobytes())
    out.section("size", array.array("Q", [doc.size for doc in docs]).tobytes())
    out.section("mtime", array.array("q", [doc.mtime for doc in docs]).tobytes())
    dls = array.array("I", [len(t) for doc in docs for t in (doc.toks, doc.title_toks)])
    out.section("dl", dls.tobytes())
    out.section("avg", array.array("f", avg * n).tobytes())
    out.finish(
        {
            "docs": n,
            "terms": nt,
            "dict": nt,
            "surfaces": len(words),
            "lens": [sum(dls[0::2]), sum(dls[1::2])],
            "avg_range": [[avg[0], avg[0]], [avg[1], avg[1]]],
        }
    )


def write_segment(
    f, sources: list, skips: list, dels: list, cancel=None, folder=None, avg=None
) -> list:
    """Write the live notes of sources as one segment to file f; return, per source, the
    map of its note ids to the new ones (-1: dropped).

    skips: each source's deleted ids; dels: each source's deleted-term counts (snapshots).
    avg: when given, every impact is computed again with these average lengths (a merge:
    the merged file then has one average, today's). Postings and term strings stream to
    the file (impacts through a temporary file in folder), so merging big segments needs
    memory for their dictionaries and per-note arrays, not for their postings.

    The steps follow the file: postings (ids, then impacts), the term table, the
    dictionary of stems and surface words, each note's tokens, its path and title, then
    the per-note columns and the footer.
    """
    out = _FileWriter(f, _SEGMENT_MAGIC)
    remaps, n = _renumber_notes(sources, skips)
    norms = _norms(sources, remaps, avg) if avg else None
    plan = _TermPlan.of(sources, dels)
    terms, tid_rank, stems, tids = _write_postings_of_terms(
        out, plan, sources, skips, dels, remaps, norms, cancel, folder
    )
    out.section("terms", terms.tobytes())
    out.section("tid_rank", tid_rank.tobytes())
    surfaces = _write_dictionary(out, plan, sources, terms, stems, tids)
    dictionary = len(tids)
    del stems, tids
    columns = _write_tokens(out, plan, sources, remaps, avg, cancel)
    _write_paths_and_titles(out, sources, remaps)
    by_path = array.array("I", map(_SECOND, heapq.merge(*map(_path_order, sources, remaps))))
    dls, avgs = columns["dl"], columns["avg"]
    for name, arr in (("by_path", by_path), *columns.items()):
        out.section(name, arr.tobytes())
    spans = []
    for fld in (0, 1):
        values = avgs[fld::2]
        spans.append([min(values), max(values)] if len(values) else [1.0, 1.0])
    out.finish(
        {
            "docs": n,
            "terms": plan.nt,
            "dict": dictionary,
            "surfaces": surfaces,
            "lens": [sum(dls[0::2]), sum(dls[1::2])],
            "avg_range": spans,
        }
    )
    return remaps


def _renumber_notes(sources: list, skips: list) -> tuple:
    """Return (per source, its note ids -> the segment's (-1: dropped); the live count).
    Notes keep their order, so every map increases."""
    remaps, n = [], 0
    for src, skip in zip(sources, skips):
        remap = array.array("i", [-1]) * src.n
        for d in range(src.n):
            if d not in skip:
                remap[d] = n
                n += 1
        remaps.append(remap)
    return remaps, n


@dataclasses.dataclass
class _TermPlan:
    """How a segment numbers its terms: one source keeps its numbers; several get theirs
    anew, the commonest first (short term characters for common words), through `rank`
    (merged term -> new number, -1: dropped) and `trans` (per source, a str.translate
    table from its term characters to the new ones, filled as the terms are written)."""

    single: bool
    nt: int  # terms the segment keeps
    rank: Any = None
    trans: list = dataclasses.field(default_factory=lambda: [None])

    @classmethod
    def of(cls, sources: list, dels: list) -> _TermPlan:
        if len(sources) == 1:
            return cls(True, sources[0].term_count())
        df_b, df_t = array.array("I"), array.array("I")
        for _, parts in _merged_terms(sources):
            body, title = _live_df(sources, dels, parts)
            df_b.append(body)
            df_t.append(title)
        kept = [g for g in range(len(df_b)) if df_b[g] or df_t[g]]
        kept.sort(key=df_b.__getitem__, reverse=True)
        rank = array.array("i", [-1]) * len(df_b)
        for r, g in enumerate(kept):
            rank[g] = r
        trans = [array.array("I", bytes(4 * (src.term_count() + 0x900))) for src in sources]
        for table in trans:
            table[ord(_OVERFLOW)] = ord(_OVERFLOW)
        return cls(False, len(kept), rank, trans)


def _write_postings_of_terms(out, plan, sources, skips, dels, remaps, norms, cancel, folder):
    """Write the sections "ids" and "imps" (the impacts pass through a temporary file in
    folder until the ids are out); return (terms: each term's start and count per field,
    tid_rank, the stems in merged order, their term numbers)."""
    nt = plan.nt
    terms = array.array("I", bytes(16 * nt))
    tid_rank = array.array("I", bytes(4 * nt))
    stems, tids = [], array.array("I")
    with tempfile.TemporaryFile(dir=folder) as spill:
        out.begin("ids")
        start = 0
        for g, (stem_, parts) in enumerate(_merged_terms(sources)):
            if cancel is not None and not g % 1024 and cancel.is_set():
                raise _Cancelled
            if plan.single:
                if not any(_live_df(sources, dels, parts)):
                    continue
                tid = sources[0].key_number(parts[0][1])
            else:
                tid = plan.rank[g]
                if tid < 0:
                    continue
                cp = ord(_term_char_of(tid))
                for i, k in parts:
                    plan.trans[i][ord(sources[i].char(k))] = cp
            tid_rank[tid] = len(stems)
            stems.append(stem_)
            tids.append(tid)
            for fld in (0, 1):
                count = _write_postings(out, spill, sources, skips, remaps, norms, parts, fld)
                if count:
                    terms[4 * tid + 2 * fld] = start
                    terms[4 * tid + 2 * fld + 1] = count
                    start += count
        out.end("ids")
        spill.seek(0)
        out.begin("imps")
        for chunk in iter(functools.partial(spill.read, 1 << 20), b""):
            out.write(chunk)
        out.end("imps")
    return terms, tid_rank, stems, tids


def _write_dictionary(out, plan, sources, terms, stems, tids) -> int:
    """Write the stems and the surface words (the forms that occur, for prefix* and the
    snippets) of the live terms; return how many surface words."""
    words, surf_tids = [], []
    last = None
    streams = [_tagged(src.sorted_surfaces(), i) for i, src in enumerate(sources)]
    for w, i, k in heapq.merge(*streams):
        if w == last:
            continue
        if plan.single:
            tid = sources[0].key_number(k)
            alive = tid < plan.nt and (terms[4 * tid + 1] or terms[4 * tid + 3])
        else:
            cp = plan.trans[i][ord(sources[i].char(k))]
            alive, tid = cp != 0, _term_number(chr(cp)) if cp else 0
        if alive:
            last = w
            words.append(w)
            surf_tids.append(tid)
    _write_tables(out, stems, tids, words, surf_tids)
    return len(surf_tids)


def _write_tokens(out, plan, sources, remaps, avg, cancel) -> dict:
    """Write the section "tokens" (each live note's token string, body then title, in the
    segment's term characters); return the per-note columns gathered on the way: size,
    mtime, dl, avg and tok_off, in the order they are written."""
    sizes, mtimes = array.array("Q"), array.array("q")
    dls, avgs, tok_off = array.array("I"), array.array("f"), array.array("Q", [0])
    out.begin("tokens")
    for src, remap, table in zip(sources, remaps, plan.trans):
        if cancel is not None and cancel.is_set():
            raise _Cancelled
        raw_tokens = table is None and isinstance(src, DiskSegment)
        for d in range(src.n):
            if remap[d] < 0:
                continue
            for fld in (0, 1):
                if raw_tokens:
                    raw = src.tok_bytes(d, fld)
                else:
                    text = src.tok_text(d, fld)
                    raw = (text if table is None else text.translate(table)).encode()
                out.write(raw)
                tok_off.append(tok_off[-1] + len(raw))
                dls.append(src.dl(d, fld))
                avgs.append(avg[fld] if avg else src.avg_then(d, fld))
            size, mtime = src.sig(d)
            sizes.append(size)
            mtimes.append(mtime)
    out.end("tokens")
    return {"size": sizes, "mtime": mtimes, "dl": dls, "avg": avgs, "tok_off": tok_off}


def _write_paths_and_titles(out, sources, remaps) -> None:
    """Write the sections "paths" and "titles", each with its offsets ("path_off",
    "title_off")."""
    for name, getter in (("paths", "path_bytes"), ("titles", "title_bytes")):
        off = array.array("I", [0])
        out.begin(name)
        for src, remap in zip(sources, remaps):
            get = getattr(src, getter)
            for d in range(src.n):
                if remap[d] >= 0:
                    raw = get(d)
                    out.write(raw)
                    off.append(off[-1] + len(raw))
        out.end(name)
        out.section(name[:-1] + "_off", off.tobytes())


def _blob(raw: bytes, end: int, bounds, typecode: str) -> array.array:
    start, length = (int(x) for x in bounds)
    if start < 16 or length < 0 or start + length > end or length % 4:
        raise IndexFileError("a list in the commit file is out of bounds")
    out = array.array(typecode)
    out.frombytes(raw[start : start + length])
    return out


def read_commit(path: Path, folder: Path) -> tuple:
    """Return (the segments the commit file names, their deletions applied; the last file
    number; False when a segment had to be dropped). Raises IndexFileError."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise IndexFileError("no index yet") from None
    except OSError as e:
        raise IndexFileError(f"{path.name}: unreadable ({e.strerror})") from None
    meta = _read_footer(raw, _COMMIT_MAGIC, path.name)
    end = len(raw) - _TRAILER.size - meta["footer"]
    if zlib.crc32(raw[:end]) != meta.get("crc"):
        raise IndexFileError(f"{path.name}: checksum mismatch")
    segs = []
    try:
        seq, intact = int(meta["seq"]), True
        for entry in meta["segments"]:
            name = str(entry["name"])
            if not re.fullmatch(r"\d{8}\.seg", name):
                raise IndexFileError(f"{path.name}: names a file that is not a segment")
            deleted = _blob(raw, end, entry["deleted"], "I")
            del_df = [_blob(raw, end, entry[key], "I") for key in ("del_body", "del_title")]
            del_lens = [int(x) for x in entry["del_lens"]]
            try:
                seg = DiskSegment(folder / name)
                if len(seg.mm) != int(entry["size"]) or seg.crc != int(entry["crc"]):
                    raise IndexFileError(f"{name}: not the file the index names")
            except IndexFileError as e:
                log.warning("index segment %s dropped: %s; its notes are read again", name, e)
                intact = False
                continue
            seg.deleted = {d for d in deleted if d < seg.n}
            for f, pairs in enumerate(del_df):
                seg.del_df[f].update(zip(pairs[0::2], pairs[1::2]))
            seg.del_lens = del_lens
            segs.append(seg)
    except (KeyError, TypeError, ValueError) as e:
        raise IndexFileError(f"{path.name}: unreadable ({e})") from None
    return segs, seq, intact


def write_commit(path: Path, entries: list, seq: int) -> None:
    """Write the commit file atomically (mode 0600): segment names, sizes, checksums and
    deletions."""

    def write(f) -> None:
        out = _FileWriter(f, _COMMIT_MAGIC)
        listed = []
        for name, size, crc, deleted, del_body, del_title, del_lens in entries:
            item = {"name": name, "size": size, "crc": crc, "del_lens": del_lens}
            for key, arr in (
                ("deleted", deleted),
                ("del_body", del_body),
                ("del_title", del_title),
            ):
                out.section(f"{name}/{key}", arr.tobytes())
                item[key] = out.sections[f"{name}/{key}"]
            listed.append(item)
        out.finish({"seq": seq, "segments": listed})

    atomic_write(path, write, mode=0o600)


# -- the index ----------------------------------------------------------------


def _analyse_batch(items: list, stems: dict) -> tuple:
    """Return (vocabulary, [Doc], average lengths) of (path, text, size, mtime) items."""
    vocab = _Vocab(stems)
    docs = [vocab.analyse(*item) for item in items]
    avg = tuple(max(sum(len(d[4 + f]) for d in docs) / max(len(docs), 1), 1.0) for f in (0, 1))
    return vocab, docs, avg


def _memory_segment(vocab: _Vocab, docs: list, avg: tuple) -> MemorySegment:
    seg = MemorySegment(vocab)
    for doc in docs:
        seg.add(doc, avg)
    return seg


# Opening a note to read it: never through a symbolic link, never waiting on a FIFO (a
# named pipe called x.md is seen as a file and then skipped).
_NOFOLLOW_NONBLOCK = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


def _read_items(notes: NoteStore, paths: list) -> list:
    """Return (path, text, size, mtime_ns) of the notes still there (paths from a scan)."""
    items, base = [], str(notes.base)
    flags = os.O_RDONLY | _NOFOLLOW_NONBLOCK
    for path in paths:
        try:  # the common case without pathlib: the name on disk is the path
            fd = os.open(os.path.join(base, path), flags)
        except FileNotFoundError:
            if path.isascii():
                continue
            try:  # an NFD name on disk
                data, st = notes.read_raw(path)
            except ApiError:
                continue
        except OSError:
            continue
        else:
            with open(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    continue
                data = f.read()
        items.append((path, data.decode("utf-8", "replace"), st.st_size, st.st_mtime_ns))
    return items


class _Progress:
    """Counts the notes a bulk has indexed; a thread logs the count every 2 s."""

    def __init__(self, total: int):
        self.total, self.done, self.helped = total, 0, 0
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="notesvc-progress", daemon=True)

    def __enter__(self) -> _Progress:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        log.info(
            "indexing: %d notes in %.1f s (%d batches by the helper process)",
            self.done,
            time.monotonic() - self.started,
            self.helped,
        )

    def add(self, count: int) -> None:
        self.done += count

    def _run(self) -> None:
        while not self._stop.wait(2):
            log.info("indexing: %d of %d notes indexed", self.done, self.total)


_HELPER_CODE = (  # loads this file as a module (its cached bytecode) and runs index_helper
    "import importlib.util as u, sys; s = u.spec_from_file_location('notesvc_index_helper', "
    "sys.argv[1]); m = sys.modules[s.name] = u.module_from_spec(s); s.loader.exec_module(m); "
    "m.index_helper(*sys.argv[2:])"
)


def index_helper(notes_root: str, folder: str) -> None:
    """Run as the helper process of a bulk build: for each line {"paths": [...]} on stdin,
    read those notes, write them as a segment to a temp file in folder and answer
    {"file": its path} (or {"error": ...}) on stdout; stop at the end of stdin.

    The server renames each file into place, so a helper that outlives a crashed server
    leaves nothing but a temp file, which the next start sweeps away.
    """
    notes = NoteStore(Path(notes_root), Path(folder) / "trash")
    stems: dict = {}
    for line in sys.stdin:
        name = None
        try:
            vocab, docs, avg = _analyse_batch(_read_items(notes, json.loads(line)["paths"]), stems)
            if docs:
                fd, name = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=TEMP_SUFFIX, dir=folder)
                with os.fdopen(fd, "wb") as f:
                    write_batch(f, docs, vocab, avg)
                    f.flush()
                    os.fsync(f.fileno())
            reply = {"file": name}
        except Exception as e:  # the server indexes the batch itself
            if name:
                with contextlib.suppress(OSError):
                    os.unlink(name)
            reply = {"error": f"{type(e).__name__}: {e}"[:300]}
        print(json.dumps(reply), flush=True)


def _stop_helper(helper) -> None:
    with contextlib.suppress(OSError):
        helper.stdin.close()
    try:
        helper.wait(30)
    except Exception:
        helper.kill()
        helper.wait()
    with contextlib.suppress(OSError):
        helper.stdout.close()


class _Match:
    """One segment's candidates for a query, with approximate scores (stored impacts)."""

    def __init__(self, seg, comps: list, hi: float, scores: dict | None = None):
        self.seg, self.comps, self.hi = seg, comps, hi
        self.scores = scores  # {id: approximate score}, or None: the one-word fast path
        self.total = len(scores) if scores is not None else 0
        self._single: dict = {}

    def top(self, m: int) -> tuple:
        """Return ([(approx, id)] best first, bound on the approx of every other candidate)."""
        if self.scores is not None:
            items = heapq.nlargest(m + 1, self.scores.items(), key=_SECOND)
            return [(a, d) for d, a in items[:m]], (items[m][1] if len(items) > m else 0.0)
        return self._top_single(m)

    def count_single(self) -> None:
        """Count the notes holding the word (body or title), deleted ones aside."""
        deleted = self.seg.deleted
        body = title = None
        for comp in self.comps:
            if comp[3] == 0:
                body = comp
            else:
                title = comp
        self.body, self.title = body, title
        self.title_scores: dict = {}
        total = len(body[1]) - body[5] if body else 0
        if title:
            w, ids, imps = title[:3]
            for d, imp in zip(ids, imps):
                if d in deleted:
                    continue
                self.title_scores[d] = w * imp
                if body is None or _has(body[1], d) < 0:
                    total += 1
        self.total = total

    def _top_single(self, m: int) -> tuple:
        scores = dict(self.title_scores)
        bound = 0.0
        if self.body:
            w, ids, imps = self.body[:3]
            deleted = self.seg.deleted
            want = m + len(scores) + len(deleted) + 1
            idx = heapq.nlargest(want, range(len(ids)), key=imps.__getitem__)
            if len(idx) < len(ids):
                bound = w * imps[idx[-1]]
            taken = set()
            for i in idx:
                d = ids[i]
                taken.add(d)
                if d not in deleted:
                    scores[d] = scores.get(d, 0.0) + w * imps[i]
            for d in self.title_scores:
                if d not in taken:
                    i = _has(ids, d)
                    if i >= 0:
                        scores[d] += w * imps[i]
        items = heapq.nlargest(m + 1, scores.items(), key=_SECOND)
        if len(items) > m:
            bound = max(bound, items[m][1])
        return [(a, d) for d, a in items[:m]], bound

    def exact(self, d: int, avg: tuple) -> float:
        seg, score = self.seg, 0.0
        for w, ids, imps, f, *_ in self.comps:
            i = _has(ids, d)
            if i >= 0:
                score += w * _exact_tf(imps[i], seg.dl(d, f), seg.avg_then(d, f), avg[f])
        return score


class _NoteTexts(Sequence):
    """The indexed notes as (path, title, text), each text read from its file when asked
    (its first MAX_SCAN_CHARS characters)."""

    def __init__(self, index: SearchIndex, entries: list):
        self._index = index
        self._entries = entries  # (path, segment, id)
        self.paths = [e[0] for e in entries]

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, i: int) -> IndexedNote:
        path, seg, d = self._entries[i]
        text = self._index._read(path, 4 * MAX_SCAN_CHARS) or ""
        return IndexedNote(path, seg.title(d), text[:MAX_SCAN_CHARS])


class SearchIndex:
    """The search index: segment files read in place plus one segment in memory.

    Thread-safe. SearchIndex() lives in memory only; SearchIndex.open(state_dir, notes) keeps
    its segments in <state_dir>/index/ and reads note texts (for snippets and moves) through
    the note store. Plugins and providers use the read methods, never the internals.
    """

    def __init__(self, folder: Path | None = None, notes: NoteStore | None = None):
        self._lock = threading.RLock()
        self.folder = folder  # <state>/index, or None: in memory only
        self.commit_file = folder.parent / "index.cache" if folder else None
        self.notes = notes
        self._base = str(notes.base) if notes is not None else ""
        self._segs: list = []  # DiskSegment, or MemorySegment not yet written; oldest first
        self._live = MemorySegment()
        self.generation = 0  # bumps on every change
        self._touched: dict = {}  # path -> generation of its last change (for bulk_add)
        self._bulks = 0
        self._names = itertools.count(1)
        self._commit_lock = threading.RLock()
        self._sync_lock = threading.Lock()
        self._dirty = False  # the commit file is behind
        self._flushed = time.monotonic()
        self._unverified: list = []
        self._stems: dict | None = None  # word -> stem, shared by the batches of one sync
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None

    # -- changing ------------------------------------------------------------------------

    def _all(self) -> list:
        return [*self._segs, self._live]

    def _averages(self, segs: list | None = None) -> tuple:
        segs = segs or self._all()
        n = sum(s.n - len(s.deleted) for s in segs)
        if not n:
            return 1.0, 1.0
        return tuple(max(sum(s.lens[f] - s.del_lens[f] for s in segs) / n, 1.0) for f in (0, 1))

    def _changed(self, path: str) -> None:
        self.generation += 1
        if len(self._touched) > 10_000 and not self._bulks:
            self._touched.clear()
        self._touched[path] = self.generation

    def _locate(self, path: str):
        for seg in reversed(self._all()):
            d = seg.find(path)
            if d is not None:
                return seg, d
        return None

    def _drop(self, path: str) -> bool:
        found = self._locate(path)
        if found:
            found[0].delete(found[1])
            if isinstance(found[0], DiskSegment):
                self._dirty = True  # the commit file's deletions are behind
        return found is not None

    def add(self, path: str, text: str, size: int, mtime: int) -> None:
        """Index (or re-index) one note."""
        with self._lock:
            doc = self._live.vocab.analyse(path, text, size, mtime)
            self._drop(path)
            self._live.add(doc, self._averages())
            self._changed(path)
            full = self._live.n >= FLUSH_DOCS or self._live.tokens >= FLUSH_TOKENS
        if full:
            self._wake.set()

    def remove(self, path: str) -> bool:
        with self._lock:
            if not self._drop(path):
                return False
            self._changed(path)
            return True

    def move(self, old: str, new: str, size: int, mtime: int) -> None:
        """Index a moved note under its new path (its text is read from there)."""
        text = self._read(new)
        with self._lock:
            if self._locate(old) is None:
                return
            self.remove(old)
            if text is not None:
                self.add(new, text, size, mtime)

    def bulk_add(self, items: list, since: int, replace: Container | None = None) -> int:
        """Index many (path, text, size, mtime) at once; skip paths changed after generation
        `since` (read before the texts were). replace: the paths that may be indexed already
        (None: any); the others are not looked for. Return how many were indexed.

        A large batch becomes a segment file of its own (analysed without the lock).
        """
        with self._lock:
            self._bulks += 1
        try:
            if len(items) < 64 or (self.folder is None and len(items) < FLUSH_DOCS):
                count = 0
                for item in items:
                    with self._lock:
                        if self._touched.get(item[0], -1) <= since:
                            self.add(*item)
                            count += 1
                return count
            batch = _analyse_batch(items, self._stems if self._stems is not None else {})
            new = None
            if self.folder is not None:
                new = self._write(
                    functools.partial(write_batch, docs=batch[1], vocab=batch[0], avg=batch[2])
                )
            if new is None:  # in memory only, or a full disk: keep it in memory
                new = _memory_segment(*batch)
            return self._add_segment(new, since, replace)
        finally:
            with self._lock:
                self._bulks -= 1
            self._wake.set()

    def _add_segment(self, new, since: int, replace: Container | None) -> int:
        """Add a segment of (re)read notes: drop their older entries, and any of its own
        that a change after generation `since` made stale; commit. Return its live notes."""
        with self._lock:
            count = 0
            for d in range(new.n):
                path = new.path(d)
                if self._touched.get(path, -1) > since:
                    new.delete(d)
                    continue
                if replace is None or path in replace:
                    self._drop(path)
                count += 1
            self._segs.append(new)
            self.generation += 1
            self._dirty = True
        self._commit()
        return count

    # -- reading: what plugins and providers may ask (they never touch the lock) ---------

    def title_of(self, path: str) -> str | None:
        """Return the indexed title of a note, None when it is not indexed."""
        with self._lock:
            found = self._locate(path)
            return found[0].title(found[1]) if found else None

    def titles(self, paths: Iterable[str]) -> dict:
        """Return {path: indexed title} for those of paths that are indexed."""
        with self._lock:
            out = {}
            for path in paths:
                found = self._locate(path)
                if found:
                    out[path] = found[0].title(found[1])
            return out

    def _snapshot(self) -> list:
        """Return [(segment, its live (path, id) or None, its deleted ids)] (under the lock)."""
        return [
            (s, s.live() if isinstance(s, MemorySegment) else None, set(s.deleted))
            for s in self._all()
        ]

    @staticmethod
    def _entries(snapshot: list) -> Iterable:
        """Yield (path, segment, id) of every live note of a snapshot (no lock needed)."""
        for seg, items, deleted in snapshot:
            if items is not None:
                for path, d in items:
                    yield path, seg, d
            else:
                for d in range(seg.n):
                    if d not in deleted:
                        yield seg.path(d), seg, d

    def paths(self) -> list:
        """Return the indexed note paths."""
        with self._lock:
            snapshot = self._snapshot()
        return [path for path, _, _ in self._entries(snapshot)]

    def documents(self) -> tuple:
        """Return (generation, [(path, title, text)]): a snapshot to compute from unlocked.

        The texts are read from the files as the list is walked (the first MAX_SCAN_CHARS
        characters of each), so the snapshot costs memory for the paths only.
        """
        with self._lock:
            generation, snapshot = self.generation, self._snapshot()
        return generation, _NoteTexts(self, list(self._entries(snapshot)))

    def stem_weights(self, stems: Iterable[str]) -> dict:
        """Return {stem: its IDF in note bodies} for the stems that are in the index."""
        stems = list(dict.fromkeys(stems))
        with self._lock:
            segs = self._all()
            n = max(self._count(segs), 1)
            _, _, dfs = self._terms(segs, n, stems)
            return {s: bm25_idf(n, dfs[s][0]) for s in stems if dfs[s][0] or dfs[s][1]}

    # -- state -------------------------------------------------------------------------

    def signature(self) -> dict:
        """Return {path: (size, mtime_ns)} of what is indexed."""
        with self._lock:
            snapshot = self._snapshot()
        return {path: seg.sig(d) for path, seg, d in self._entries(snapshot)}

    @staticmethod
    def _count(segs: list) -> int:
        return sum(s.n - len(s.deleted) for s in segs)

    def stats(self) -> dict:
        with self._lock:
            segs = self._all()
            terms = sum(s.nd if isinstance(s, DiskSegment) else len(s.vocab.stems) for s in segs)
            return {"documents": self._count(segs), "terms": terms, "segments": len(segs)}

    def check(self, files: dict) -> tuple:
        """Compare {path: (size, mtime_ns)} of the notes on disk (the dict is consumed) with
        the index; return (paths to read, indexed paths that are gone)."""
        changed, removed, _, _ = self._check(files)
        return changed, removed

    def _check(self, files: dict) -> tuple:
        """Return (paths to read, paths gone, the paths to read that are indexed, the sizes
        of the paths to read)."""
        with self._lock:
            snapshot = self._snapshot()
        known, removed, sizes = [], [], {}
        for path, seg, d in self._entries(snapshot):
            sig = files.pop(path, None)
            if sig is None:
                removed.append(path)
            elif sig != seg.sig(d):
                known.append(path)
                sizes[path] = sig[0]
        sizes.update((path, sig[0]) for path, sig in files.items())
        return known + list(files), removed, set(known), sizes

    def sync(self, notes: NoteStore | None = None, observe: Callable | None = None) -> dict:
        """Bring the index in line with the files: re-read what changed, drop what is gone.

        The first sync also checks each segment file against its checksum; a damaged one
        is dropped, and its notes are read again. observe(changed, removed, known, present)
        hears what changed before the index takes it (history and the change feed).
        """
        notes = notes or self.notes
        with self._sync_lock:
            started = time.perf_counter()
            self.verify()
            files = notes.scan()
            present, had_notes = list(files), bool(self.stats().get("documents"))
            changed, removed, known, sizes = self._check(files)
            if observe is not None:
                # `known` empty means "the index was rebuilt" to observe(); a None entry
                # keeps it truthy when the index held notes but none of these changed ones
                observe(changed, removed, known | ({None} if had_notes else set()), present)
            for path in removed:
                with notes.locked(path):
                    if not notes.exists(path):
                        self.remove(path)
            if len(changed) > 50:
                self._bulk_read(notes, changed, known, sizes)
            else:
                for path in changed:
                    with notes.locked(path):  # no API write can slip in between
                        for item in _read_items(notes, [path]):
                            self.add(*item)
            took = time.perf_counter() - started
            if changed or removed:
                log.info(
                    "index: %d notes read, %d removed in %.2f s", len(changed), len(removed), took
                )
            return {"read": len(changed), "removed": len(removed), "seconds": round(took, 3)}

    def _bulk_read(self, notes: NoteStore, paths: list, known: set, sizes: dict) -> None:
        """Read and index many notes, a segment file per batch (BULK_CHUNK_NOTES notes or
        BULK_CHUNK_CHARS bytes); with two cores or more, a helper process analyses every
        other batch (index_helper), so a first build takes two cores."""
        batches: deque = deque([[]])
        chars = 0
        for path in paths:
            if len(batches[-1]) >= BULK_CHUNK_NOTES or chars >= BULK_CHUNK_CHARS:
                batches.append([])
                chars = 0
            batches[-1].append(path)
            chars += sizes.get(path, 0)
        with self._lock:
            self._bulks += 1
        self._stems = {}
        helper = self._start_helper(notes) if len(batches) > 1 else None
        try:
            with _Progress(len(paths)) as progress:
                pump = None
                if helper is not None:
                    pump = threading.Thread(
                        target=self._pump, args=(helper, batches, known, progress), daemon=True
                    )
                    pump.start()
                for pumping in (True, False):
                    while not self._stop.is_set():  # closing: the next sync goes on
                        try:
                            batch = batches.popleft()
                        except IndexError:  # the helper took the last one
                            break
                        since = self.generation
                        progress.add(self.bulk_add(_read_items(notes, batch), since, known))
                    if pumping and pump is not None:
                        pump.join()  # batches it gave back are done on the second pass
        finally:
            self._stems = None
            if helper is not None:
                _stop_helper(helper)
            with self._lock:
                self._bulks -= 1
            self._wake.set()

    def _start_helper(self, notes: NoteStore):
        """Start an index_helper process; None where it cannot help (one core, no file)."""
        module = globals().get("__file__")
        if self.folder is None or (os.cpu_count() or 1) < 2 or not module or not sys.executable:
            return None
        import subprocess

        cmd = [sys.executable, "-c", _HELPER_CODE, module, str(notes.root), str(self.folder)]
        try:
            helper = subprocess.Popen(  # noqa: S603 (this interpreter and this file)
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, close_fds=True
            )
            log.info("index: a helper process (pid %d) analyses every other batch", helper.pid)
            return helper
        except OSError as e:
            log.warning("index: no helper process (%s); indexing on one core", e)
            return None

    def _pump(self, helper, batches: deque, known: set, progress: _Progress) -> None:
        """Hand batches to the helper process and add the segment files it writes; on any
        trouble give the batch back (the caller indexes it) and stop."""
        while not self._stop.is_set():
            try:
                batch = batches.popleft()
            except IndexError:
                return
            since = self.generation
            try:
                helper.stdin.write(json.dumps({"paths": batch}) + "\n")
                helper.stdin.flush()
                reply = json.loads(helper.stdout.readline() or '{"error": "it stopped"}')
                seg = self._install(reply["file"]) if reply.get("file") else None
                if reply.get("error") or (reply.get("file") and seg is None):
                    raise ValueError(reply.get("error") or "its file is unusable")
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning("index helper process: %s; indexing on one core", e)
                batches.appendleft(batch)
                return
            if seg is not None:
                progress.add(self._add_segment(seg, since, known))
                progress.helped += 1

    def _install(self, name: str):
        """Rename a segment file the helper wrote into place; return it opened, or None."""
        tmp = Path(name)
        if tmp.parent != self.folder or not tmp.name.startswith(TEMP_PREFIX):
            return None
        final = self.folder / f"{next(self._names):08d}.seg"
        try:
            os.replace(tmp, final)
            fsync_dir(self.folder)
            return DiskSegment(final)
        except (OSError, IndexFileError) as e:
            log.warning("index: a helper's segment file is unusable (%s)", e)
            with contextlib.suppress(OSError):
                final.unlink()
            return None

    # -- searching -----------------------------------------------------------------------

    def _terms(self, segs: list, n: int, stems: list) -> tuple:
        """Return ({stem: [key per segment]}, {stem: (body weight, title weight)},
        {stem: [live body df, live title df]})."""
        per_seg = [seg.keys(stems) for seg in segs]
        keys, weights, dfs = {}, {}, {}
        for j, s in enumerate(stems):
            ks = [found[j] for found in per_seg]
            df = [0, 0]
            for seg, k in zip(segs, ks):
                if k is not None:
                    for f in (0, 1):
                        p = seg.postings(k, f)
                        if p:
                            df[f] += len(p[0]) - seg.del_df[f].get(k, 0)
            keys[s], dfs[s] = ks, df
            weights[s] = (bm25_weight(n, df[0], "body"), bm25_weight(n, df[1], "title"))
        return keys, weights, dfs

    def _expand(self, segs: list, n: int, prefix: str) -> list:
        """Return up to MAX_PREFIX_TERMS stems of words starting with prefix, commonest first
        (of the first 16 * MAX_PREFIX_TERMS such words, in order)."""
        cap = 16 * MAX_PREFIX_TERMS
        words: dict = {}
        for seg in segs:
            for w, s in seg.prefix_words(prefix, cap):
                words.setdefault(w, s)
        stems = sorted({words[w] for w in sorted(words)[:cap]})
        _, _, dfs = self._terms(segs, n, stems)
        alive = [s for s in stems if dfs[s][0] or dfs[s][1]]
        alive.sort(key=lambda s: (-dfs[s][0], s))
        return alive[:MAX_PREFIX_TERMS]

    def _resolve(self, segs: list, n: int, alt: tuple) -> tuple:
        kind = alt[0]
        if kind == "prefix":
            return kind, self._expand(segs, n, alt[1])
        return kind, [alt[1]] if kind == "word" else list(alt[1])

    @staticmethod
    def _comps(seg, si: int, stems: list, keys: dict, weights: dict) -> list:
        """Return the scoring components of stems in a segment:
        (weight, ids, impacts, field, key, deleted holding it)."""
        out = []
        for s in stems:
            k = keys[s][si]
            if k is None:
                continue
            for f in (0, 1):
                p = seg.postings(k, f)
                if p:
                    out.append((weights[s][f], p[0], p[1], f, k, seg.del_df[f].get(k, 0)))
        return out

    def _alt_docs(self, seg, si: int, alt: tuple, keys: dict, within: set | None) -> set:
        """Return the notes of a segment matching one alternative (among `within`)."""
        kind, stems = alt
        found: set = set()
        if kind == "phrase":
            ks = [keys[s][si] for s in stems]
            if None in ks:
                return found
            chars = list(map(seg.char, ks))
            for f in (0, 1):
                lists = [seg.postings(k, f) for k in ks]
                if all(lists):
                    rare = min(range(len(ks)), key=lambda i: len(lists[i][0]))
                    lists = sorted((p[0] for p in lists), key=len)
                    if len(ks) < 2 or 4 * len(lists[0]) > len(lists[1]):
                        rare = -1  # no term stands out: search the whole phrase
                    cands = lists[0]
                    if within is not None and len(within) < len(cands):
                        cands = within
                    elif len(lists[1]) <= 16 * len(cands):  # the notes holding both terms
                        cands = set(cands).intersection(lists[1])
                    found.update(seg.phrase(cands, chars, rare, f))
            return found
        for s in stems:
            k = keys[s][si]
            if k is None:
                continue
            for f in (0, 1):
                p = seg.postings(k, f)
                if not p:
                    continue
                ids = p[0]
                if within is None:
                    found.update(ids)
                elif len(ids) > 4 * len(within):
                    found.update(d for d in within if _has(ids, d) >= 0)
                else:
                    found.update(within.intersection(ids))
        return found

    @staticmethod
    def _estimate(seg, si: int, clause: list, keys: dict) -> int:
        total = 0
        for kind, stems in clause:
            sizes = []
            for s in stems:
                k = keys[s][si]
                size = 0
                if k is not None:
                    for f in (0, 1):
                        p = seg.postings(k, f)
                        size += len(p[0]) if p else 0
                sizes.append(size)
            total += (min(sizes) if kind == "phrase" else sum(sizes)) if sizes else 0
        return total

    def _match(self, seg, si, clauses, excludes, keys, weights, folder, hi) -> _Match | None:
        order = sorted(clauses, key=lambda c: self._estimate(seg, si, c, keys))
        cands = None
        for clause in order:
            docs: set = set()
            for alt in clause:
                docs |= self._alt_docs(seg, si, alt, keys, cands)
            cands = docs
            if not cands:
                return None
        for alt in excludes:
            cands -= self._alt_docs(seg, si, alt, keys, cands)
        cands = cands - seg.deleted
        if folder and cands:
            cands = seg.in_folder(cands, folder)
        if not cands:
            return None
        comps = [
            c
            for clause in clauses
            for alt in clause
            for c in self._comps(seg, si, alt[1], keys, weights)
        ]
        scores = dict.fromkeys(cands, 0.0)
        for w, ids, imps, *_ in comps:
            if len(ids) > 4 * len(cands):
                for d in cands:
                    i = _has(ids, d)
                    if i >= 0:
                        scores[d] += w * imps[i]
            else:
                for d, imp in zip(ids, imps):
                    if d in scores:
                        scores[d] += w * imp
        return _Match(seg, comps, hi, scores)

    @staticmethod
    def _hi(seg, avg: tuple) -> float:
        """Return the most a segment's stored impacts can rise with today's averages."""
        return max(1.0, *(avg[f] / max(seg.avg_range[f][0], 1.0) for f in (0, 1))) * (1 + _EPS)

    def _matches(self, segs, n, avg, clauses, excludes, folder) -> list:
        stems = sorted({s for clause in [*clauses, excludes] for _, ss in clause for s in ss})
        keys, weights, _ = self._terms(segs, n, stems)
        single = (
            (len(clauses) == 1 and len(clauses[0]) == 1 and clauses[0][0][0] == "word")
            and not excludes
            and not folder
        )
        matches = []
        for si, seg in enumerate(segs):
            hi = self._hi(seg, avg)
            if single:
                comps = self._comps(seg, si, clauses[0][0][1], keys, weights)
                if comps:
                    mt = _Match(seg, comps, hi)
                    mt.count_single()
                    if mt.total:
                        matches.append(mt)
            else:
                mt = self._match(seg, si, clauses, excludes, keys, weights, folder, hi)
                if mt:
                    matches.append(mt)
        return matches, keys

    @staticmethod
    def _rank(matches: list, k: int, avg: tuple) -> list:
        """Return the k best [(exact score, path, segment, id)], best first (then by path).

        Candidates are rescored in the order of their approximate scores until no other one
        can reach the k-th exact score (exact <= approx * hi).
        """
        if k <= 0 or not matches:
            return []
        hi = max(mt.hi for mt in matches)
        m, cache = k + 4, {}
        while True:
            pool, outside = [], 0.0
            for mt in matches:
                top, bound = mt.top(m)
                pool += [(a, mt, d) for a, d in top]
                outside = max(outside, bound * mt.hi)
            pool.sort(key=_FIRST, reverse=True)
            found, heap = [], []
            for a, mt, d in pool:
                if len(heap) >= k and a * hi < heap[0]:
                    break
                score = cache.get((id(mt), d))
                if score is None:
                    score = cache[(id(mt), d)] = mt.exact(d, avg)
                found.append((score, mt, d))
                if len(heap) < k:
                    heapq.heappush(heap, score)
                else:
                    heapq.heappushpop(heap, score)
            if outside and (len(heap) < k or outside >= heap[0]):
                m *= 4
                continue
            if not found:
                return []
            found.sort(key=_FIRST, reverse=True)
            last = found[min(k, len(found)) - 1][0]  # equal scores are ordered by path
            best = [x for x in found if x[0] >= last]
            ranked = [(score, mt.seg.path(d), mt.seg, d) for score, mt, d in best]
            ranked.sort(key=lambda x: (-x[0], x[1]))
            return ranked[:k]

    def search(self, query: Query, folder: str = "", limit: int = 20, offset: int = 0) -> tuple:
        """Return (total, [(path, title, score, snippet)]) best first."""
        prefix = folder.rstrip("/") + "/" if folder else ""
        with self._lock:
            segs = self._all()
            n, avg = self._count(segs), self._averages(segs)
            clauses = [[self._resolve(segs, n, alt) for alt in c] for c in query.clauses]
            excludes = [self._resolve(segs, n, alt) for alt in query.excludes]
            matches, keys = self._matches(segs, n, avg, clauses, excludes, prefix)
            total = sum(mt.total for mt in matches)
            ranked = self._rank(matches, offset + limit, avg)[offset:]
            needles: dict = {}
            hits = []
            for score, path, seg, d in ranked:
                if seg not in needles:
                    needles[seg] = self._needles(seg, segs.index(seg), clauses, keys)
                hits.append((path, seg.title(d), round(score, 4), seg.toks(d, 0), needles[seg]))
        return total, [(p, t, s, self._snippet(p, toks, nd)) for p, t, s, toks, nd in hits]

    @staticmethod
    def _needles(seg, si: int, clauses: list, keys: dict) -> list:
        """Return the query's term strings in a segment, phrases and rarest words first."""
        found = []
        for kind, stems in (alt for clause in clauses for alt in clause):
            groups = [[s] for s in stems[:8]] if kind == "prefix" else [stems]
            for group in groups:
                ks = [keys[s][si] for s in group]
                if None not in ks:
                    p = seg.postings(ks[0], 0)
                    found.append(("".join(map(seg.char, ks)), len(p[0]) if p else 0))
        found.sort(key=lambda x: (-len(x[0]), x[1]))
        return list(dict.fromkeys(needle for needle, _ in found))

    def _snippet(self, path: str, toks: str, needles: list) -> str:
        text = self._read(path)
        if text is None:
            return ""
        return _snippet(unicodedata.normalize("NFC", text), toks, needles)

    def _read(self, path: str, limit: int = -1) -> str | None:
        """Return a note's text from its file (up to limit bytes), None when unreadable."""
        if self.notes is None:
            return None
        flags = os.O_RDONLY | _NOFOLLOW_NONBLOCK
        try:
            try:  # the common case without pathlib: the name on disk is the path
                fd = os.open(os.path.join(self._base, path), flags)
            except FileNotFoundError:
                if path.isascii():
                    return None
                fd = os.open(self.notes.on_disk(path), flags)  # an NFD name on disk
            try:  # os.read: no file object for the one or two reads of a note
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    return None
                size = st.st_size
                size = size if limit < 0 else min(size, limit)
                data = os.read(fd, size)
                while len(data) < size:  # a growing file, or a read cut short
                    more = os.read(fd, size - len(data))
                    if not more:
                        break
                    data += more
            finally:
                os.close(fd)
        except (OSError, ValueError):
            return None
        return data.decode("utf-8", "replace")

    def search_any(self, stems: list, limit: int) -> list:
        """Return the top (path, title, text, score) of notes holding any of the stems.

        A term in more than half the notes carries no weight, like a stopword. The texts
        of the hits are read from their files.
        """
        with self._lock:
            segs = self._all()
            n, avg = self._count(segs), self._averages(segs)
            stems = list(dict.fromkeys(stems))
            keys, weights, dfs = self._terms(segs, n, stems)
            matches = []
            for si, seg in enumerate(segs):
                common = [s for s in stems if n >= 20 and max(dfs[s]) > n // 2]
                comps = [
                    c
                    for s in stems
                    for c in self._comps(seg, si, [s], keys, weights)
                    if not (s in common and dfs[s][c[3]] > n // 2)
                ]
                if not comps:
                    continue
                scores: dict = {}
                for w, ids, imps, *_ in comps:
                    for d, imp in zip(ids, imps):
                        scores[d] = scores.get(d, 0.0) + w * imp
                for d in seg.deleted.intersection(scores):
                    del scores[d]
                if scores:
                    matches.append(_Match(seg, comps, self._hi(seg, avg), scores))
            ranked = self._rank(matches, limit, avg)
            hits = [(path, seg.title(d), score) for score, path, seg, d in ranked]
        return [(path, title, self._read(path) or "", score) for path, title, score in hits]

    # -- on disk: open, write, commit, merge -----------------------------------------------

    @classmethod
    def open(cls, state_dir: Path, notes: NoteStore | None = None) -> SearchIndex:
        """Return the index kept under state_dir, its segment files opened in place.

        A damaged, foreign or old index is discarded with a log line (the first sync
        rebuilds it); a single damaged segment is dropped and its notes read again.
        """
        folder = state_dir / "index"
        folder.mkdir(mode=0o700, exist_ok=True)
        os.chmod(folder, 0o700)
        index = cls(folder, notes)
        try:
            segs, seq, intact = read_commit(index.commit_file, folder)
        except IndexFileError as e:
            if index.commit_file.exists():
                log.warning("%s: discarded, rebuilding the index", e)
            with contextlib.suppress(OSError):
                index.commit_file.unlink()
            segs, seq, intact = [], 0, True
        keep = {s.name for s in segs}
        for path in folder.iterdir():
            if path.name.endswith(".seg") and path.name not in keep:
                with contextlib.suppress(OSError):
                    path.unlink()
        index._segs = segs
        index._names = itertools.count(seq + 1)
        index._unverified = list(segs)
        index._dirty = not intact
        if segs:
            log.info("index opened: %d notes in %d segments", index._count(segs), len(segs))
        return index

    def _write(self, write: Callable):
        """Write a new segment file with write(file); return it opened, or None when the
        disk is full or failing (the caller keeps what it has) or a merge was cancelled."""
        path = self.folder / f"{next(self._names):08d}.seg"
        try:
            atomic_write(path, write, mode=0o600)
            return DiskSegment(path)
        except _Cancelled:
            return None
        except (OSError, IndexFileError) as e:
            log.warning("index: could not write segment %s (%s); serving from memory", path.name, e)
            with contextlib.suppress(OSError):
                path.unlink()
            return None

    def flush(self) -> bool:
        """Write the notes held in memory to segment files, then commit; return False when
        some could not be written (they stay in memory and are tried again later)."""
        if self.folder is None:
            return False
        with self._commit_lock:
            with self._lock:
                live = self._live
                if live.n:
                    vocab = live.vocab.copy() if len(live.vocab.stems) < 50_000 else None
                    self._live = MemorySegment(vocab)
                    self._segs.append(live)
                jobs = [
                    (s, set(s.deleted), (dict(s.del_df[0]), dict(s.del_df[1])))
                    for s in self._segs
                    if isinstance(s, MemorySegment)
                ]
            written = True
            for seg, skip, dels in jobs:
                disk = remaps = None
                if seg.n > len(skip):
                    remaps = []
                    disk = self._write(
                        lambda f, seg=seg, skip=skip, dels=dels, out=remaps: out.extend(
                            write_segment(f, [seg], [skip], [dels], folder=self.folder)
                        )
                    )
                    if disk is None:
                        written = False
                        break
                with self._lock:
                    i = self._segs.index(seg)
                    if disk is None:
                        del self._segs[i]
                    else:
                        self._segs[i] = disk
                        for d in seg.deleted - skip:
                            disk.delete(remaps[0][d])
                    self._dirty = True
            self._flushed = time.monotonic()
            self._commit()
            return written

    def _commit(self) -> None:
        """Write the commit file: the segment files and their deletions (atomically)."""
        if self.folder is None:
            return
        with self._commit_lock:
            with self._lock:
                if not self._dirty:
                    return
                entries = [
                    (
                        s.name,
                        len(s.mm),
                        s.crc,
                        array.array("I", sorted(s.deleted)),
                        array.array(
                            "I", itertools.chain.from_iterable(sorted(s.del_df[0].items()))
                        ),
                        array.array(
                            "I", itertools.chain.from_iterable(sorted(s.del_df[1].items()))
                        ),
                        list(s.del_lens),
                    )
                    for s in self._segs
                    if isinstance(s, DiskSegment)
                ]
                self._dirty = False
                seq = next(self._names)
            try:
                write_commit(self.commit_file, entries, seq)
            except OSError as e:
                log.warning("index: could not write %s (%s)", self.commit_file.name, e)
                with self._lock:
                    self._dirty = True

    def _pick_merge(self) -> list:
        """Return segments to merge: one mostly deleted, or those of the smallest size class
        (live notes, in powers of MERGE_FACTOR) that has MERGE_FACTOR of them."""
        with self._lock:
            segs = [s for s in self._segs if isinstance(s, DiskSegment)]
        tiers = collections.defaultdict(list)
        for s in segs:
            if len(s.deleted) >= MAX_DELETED * s.n:
                return [s]
            live = max(s.n - len(s.deleted), 1024)
            tiers[int(math.log(live / 1024, MERGE_FACTOR) + 1e-9)].append(s)
        for tier in sorted(tiers):
            if len(tiers[tier]) >= MERGE_FACTOR:
                return tiers[tier]
        return []

    def merge(self, sources: list) -> bool:
        """Merge segment files into one (without the lock), then swap it in and commit."""
        with self._lock:
            skips = [set(s.deleted) for s in sources]
            dels = [(dict(s.del_df[0]), dict(s.del_df[1])) for s in sources]
        new = remaps = None
        if any(s.n > len(skip) for s, skip in zip(sources, skips)):
            with self._lock:
                avg = self._averages()
            remaps = []
            new = self._write(
                lambda f: remaps.extend(
                    write_segment(f, sources, skips, dels, self._stop, self.folder, avg)
                )
            )
            if new is None:
                return False
        with self._commit_lock:
            with self._lock:
                if any(s not in self._segs for s in sources):  # dropped meanwhile: not this one
                    if new is not None:
                        with contextlib.suppress(OSError):
                            new.file.unlink()
                    return False
                at = self._segs.index(sources[0])
                kept = [s for s in self._segs[at:] if s not in sources]
                self._segs[at:] = ([new] if new is not None else []) + kept
                if new is not None:
                    for src, skip, remap in zip(sources, skips, remaps):
                        for d in src.deleted - skip:
                            new.delete(remap[d])
                self._dirty = True
            self._commit()
        for s in sources:
            with contextlib.suppress(OSError):
                s.file.unlink()
        return True

    def verify(self) -> None:
        """Check the segment files opened at start against their checksums; a damaged one
        is dropped (the sync that follows reads its notes again)."""
        while True:
            with self._lock:
                if not self._unverified:
                    return
                seg = self._unverified.pop()
            try:
                seg.verify()
            except (IndexFileError, OSError) as e:
                log.warning("index segment %s dropped: %s; its notes are read again", seg.name, e)
                with self._lock:
                    if seg in self._segs:
                        self._segs.remove(seg)
                        self.generation += 1
                        self._dirty = True

    def maintain(self, force: bool = False) -> None:
        """Flush, commit and merge as due (the background thread's work; force: now)."""
        live = self._live
        due = force or time.monotonic() - self._flushed >= COMMIT_SECONDS
        pending = any(isinstance(s, MemorySegment) for s in self._segs)
        if live.n >= FLUSH_DOCS or live.tokens >= FLUSH_TOKENS or (due and (live.n or pending)):
            self.flush()
        elif self._dirty and due:
            self._commit()
        merged = False
        while not self._stop.is_set() and not self._bulks:
            sources = self._pick_merge()
            if not sources or not self.merge(sources):
                break
            merged = True
        if merged:
            release_memory()

    def start(self) -> None:
        """Start the background thread that flushes, commits and merges."""
        if self.folder is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="notesvc-index", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(COMMIT_SECONDS / 2)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.maintain()
            except Exception:
                log.exception("index maintenance failed; trying again later")

    def close(self) -> None:
        """Stop the background thread (a merge under way is abandoned) and write what is in
        memory."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(120)
        if self.folder is not None:
            self.flush()
            self._commit()


# == State and auth ===========================================================


def relay_server_id(token: str) -> str:
    """Return the server id a relay token certifies (CONTRACT 13).

    >>> relay_server_id("x" * 43)
    'w6p7juq57zv3akfa7qaw'
    """
    digest = hashlib.sha256(b"notesvc-relay-id:" + token.encode("utf-8")).digest()
    return base64.b32encode(digest).decode("ascii").lower()[:20]


def relay_code_of(token: str) -> str:
    """Return the relay code a relay token certifies (CONTRACT 22): like the server id,
    nobody without the token can claim it, on any relay.

    >>> relay_code_of("x" * 43) == relay_code_of("x" * 43) != relay_server_id("x" * 43)[:16]
    True
    """
    digest = hashlib.sha256(b"notesvc-relay-code:" + token.encode("utf-8")).digest()
    return base64.b32encode(digest).decode("ascii").lower()[:16]


class StateError(Exception):
    """The state file exists but cannot be used (start-up stops with its message)."""


class StateStore:
    """state.json: server id, key (hash), setup state, clients, relay code, channels.

    Every change goes through update(): it takes a file lock, re-reads the file,
    applies the change and writes it back atomically, so a `rotate-key` run by
    another process is never overwritten with an older copy. Reads notice a file
    changed by another process through its (mtime, size, inode) signature.
    """

    def __init__(
        self,
        folder: Path,
        owner: tuple | None = None,
        create: bool = True,
        readonly: bool = False,
    ):
        self.folder = folder
        self.path = folder / "state.json"
        self.owner = owner  # (uid, gid) the files are written as (root acting for the owner)
        self.readonly = readonly
        self.permission_hint = ""  # what to run instead when writing is not allowed
        self._lock = threading.RLock()
        self._data: dict = {}
        self._sig: tuple | None = None
        if not create:  # open what exists; create, chmod and write nothing
            if not self.path.is_file():
                raise StateError(f"no notesvc state at {folder}")
            self._load()
            return
        folder.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            os.chmod(folder, 0o700)
        self.update(self._initialise)

    @classmethod
    def open_existing(cls, folder: Path, readonly: bool = False, owner: tuple | None = None):
        """Return the store of an existing state, creating and writing nothing on open.

        Raises StateError when the folder holds no state.json (or it cannot be read);
        a `readonly` store refuses update().
        """
        return cls(folder, owner=owner, create=False, readonly=readonly)

    @staticmethod
    def _initialise(data: dict) -> None:
        if not data.get("relayToken"):  # a new root, or a state file from 0.1
            data["relayToken"] = secrets.token_urlsafe(32)
            if data.get("serverId"):
                log.warning("the server id changes once (it now derives from a relay token)")
        data["serverId"] = relay_server_id(data["relayToken"])
        code = relay_code_of(data["relayToken"])
        if data.get("relayCode", code) != code:  # a random code of 0.1: connect links change
            log.warning("the relay code changes once (it now derives from the relay token)")
        data["relayCode"] = code
        if data.get("keyHash"):
            return
        key, now = new_key(), iso(utcnow())
        data.update(
            version=1,
            createdAt=now,
            apiKey=key,
            keyHash=key_hash(key),
            keyHint=key[-4:],
            keyCreatedAt=now,
            setupComplete=False,
            linkedClients=[],
        )

    def _signature(self) -> tuple | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _load(self) -> None:
        sig = self._signature()
        if sig == self._sig and self._data:
            return
        if sig is None:
            self._data, self._sig = {}, None
            return
        try:
            data = json.loads(self.path.read_text("utf-8"))
        except (OSError, ValueError) as e:
            raise StateError(f"{self.path} cannot be read ({e}); restore it or move it away") from e
        if not isinstance(data, dict):
            raise StateError(f"{self.path} does not hold a JSON object; restore it or move it away")
        self._data, self._sig = data, sig

    def read(self) -> dict:
        """Return the current state (do not mutate it; use update)."""
        with self._lock:
            self._load()
            return self._data

    def update(self, change: Callable[[dict], Any]) -> Any:
        """Apply change(data) to the freshest state, write it atomically, return its result."""
        if self.readonly:
            raise StateError(f"{self.path} was opened read-only")
        lock_path = self.folder / "state.lock"
        if self.owner:  # the lock file must stay usable by the service's own user
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.fchown(fd, *self.owner)
            finally:
                os.close(fd)
        with self._lock, file_lock(lock_path):
            self._sig = None
            self._load()
            data = json.loads(json.dumps(self._data))  # a copy: a failed change leaves no trace
            result = change(data)
            payload = json.dumps(data, indent=2).encode("utf-8")

            def write(f) -> None:
                if self.owner:  # chown before the rename: the service never sees it root-owned
                    os.fchown(f.fileno(), *self.owner)
                f.write(payload)

            atomic_write(self.path, write, mode=0o600)
            self._data, self._sig = data, self._signature()
            return result


def relay_origin_of(config: Config, state: dict) -> str:
    """Return a server's own origin on its relay (learnt when it registered), or "" when
    its relay has no per-server origins or it has none configured."""
    if not config.relay_url:
        return ""
    known = state.get("relayOrigin") or {}
    return known.get("origin", "") if known.get("relay") == config.relay_url else ""


def rotate_key(data: dict) -> str:
    """Give the state a new key; return the key (shown once). The relay code stays: it
    derives from the relay token, and only finds the server (it opens nothing)."""
    key = new_key()
    data.update(keyHash=key_hash(key), keyHint=key[-4:], keyCreatedAt=iso(utcnow()))
    if data.get("setupComplete"):
        data.pop("apiKey", None)
    else:
        data["apiKey"] = key
    return key


JWT_LEEWAY = 30  # seconds of clock skew allowed on exp / nbf
JWT_LIFETIME = 3600


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64url_decode(text: str) -> bytes:
    if not re.fullmatch(r"[A-Za-z0-9_-]*", text):
        raise ValueError("not base64url")
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def jwt_encode(claims: dict, secret: str) -> str:
    """Return an HS256 JSON Web Token for claims."""
    header = _b64url(json.dumps({"alg": "HS256", "typ": "JWT"}, separators=(",", ":")).encode())
    payload = _b64url(json.dumps(claims, separators=(",", ":")).encode())
    signing_input = f"{header}.{payload}".encode()
    signature = hmac.new(secret.encode(), signing_input, hashlib.sha256).digest()
    return f"{header}.{payload}.{_b64url(signature)}"


def jwt_decode(token: str, secret: str, now: float | None = None) -> dict:
    """Return a token's claims; ValueError saying why when it is not a valid HS256 JWT.

    Only HS256 is accepted (`none`, HS512, RS256 ... are refused before any check), the
    signature is compared in constant time, and exp / nbf allow JWT_LEEWAY seconds.
    """
    parts = token.split(".")
    if len(parts) != 3:
        raise ValueError("not a JWT")
    try:
        header = json.loads(_b64url_decode(parts[0]))
        signature = _b64url_decode(parts[2])
    except (ValueError, UnicodeDecodeError):
        raise ValueError("malformed JWT") from None
    if not isinstance(header, dict) or header.get("alg") != "HS256":
        raise ValueError("only HS256 tokens are accepted")
    expected = hmac.new(secret.encode(), f"{parts[0]}.{parts[1]}".encode(), hashlib.sha256)
    if not hmac.compare_digest(expected.digest(), signature):
        raise ValueError("bad signature")
    try:
        claims = json.loads(_b64url_decode(parts[1]))
    except (ValueError, UnicodeDecodeError):
        raise ValueError("malformed claims") from None
    if not isinstance(claims, dict):
        raise ValueError("malformed claims")
    now = time.time() if now is None else now
    for name in ("exp", "nbf"):
        if name in claims and not isinstance(claims[name], (int, float)):
            raise ValueError(f"{name} is not a number")
    if "exp" not in claims or claims["exp"] + JWT_LEEWAY < now:
        raise ValueError("expired")
    if claims.get("nbf", 0) - JWT_LEEWAY > now:
        raise ValueError("not valid yet")
    return claims


class Lockout:
    """Failed credentials per client address: `limit` in `window` s lock it out for `window` s."""

    def __init__(
        self, limit: int = 10, window: float = 60.0, clock=time.monotonic, tracked: int = 10000
    ):
        self.limit, self.window, self.clock = limit, window, clock
        self.tracked = tracked  # addresses remembered at most (memory under a spray)
        self._fails: dict[str, deque] = {}
        self._until: dict[str, float] = {}
        self._lock = threading.Lock()

    def retry_after(self, addr: str) -> int:
        """Return the seconds addr must still wait, 0 when it is not locked out."""
        with self._lock:
            until = self._until.get(addr, 0.0)
            left = until - self.clock()
            if left <= 0:
                self._until.pop(addr, None)
                return 0
            return max(1, int(left + 0.999))

    def fail(self, addr: str) -> None:
        now = self.clock()
        with self._lock:
            if len(self._fails) >= self.tracked:  # bound memory under a spray of addresses
                self._prune(now)
            q = self._fails.setdefault(addr, deque())
            q.append(now)
            while q and q[0] <= now - self.window:
                q.popleft()
            if len(q) >= self.limit:
                self._until[addr] = now + self.window
                q.clear()

    def succeed(self, addr: str) -> None:
        """Forget addr's failures: a right credential from it (a lockout still runs out)."""
        with self._lock:
            self._fails.pop(addr, None)

    def _prune(self, now: float) -> None:
        """Forget stale addresses; when a spray keeps them all fresh, forget the quietest half.

        Pruning makes room for `tracked // 2` new addresses, so its cost is spread thin.
        """
        for addr in [a for a, q in self._fails.items() if not q or q[-1] <= now - self.window]:
            del self._fails[addr]
        for addr in [a for a, until in self._until.items() if until <= now]:
            del self._until[addr]
        excess = len(self._fails) - self.tracked // 2
        if excess > 0:
            last = {a: q[-1] for a, q in self._fails.items()}
            for addr in heapq.nsmallest(excess, last, key=last.__getitem__):
                del self._fails[addr]


class RateLimit:
    """At most `limit` events per `window` seconds per client address (memory bounded)."""

    def __init__(
        self, limit: int, window: float = 60.0, clock=time.monotonic, tracked: int = 10000
    ):
        self.limit, self.window, self.clock, self.tracked = limit, window, clock, tracked
        self._events: dict[str, deque] = {}
        self._lock = threading.Lock()

    def hit(self, addr: str) -> int:
        """Count one event from addr; return 0 when it is allowed, else the seconds to wait."""
        now = self.clock()
        with self._lock:
            if len(self._events) >= self.tracked:  # forget the quiet, then the oldest half
                for a in [a for a, q in self._events.items() if q[-1] <= now - self.window]:
                    del self._events[a]
                for a in list(self._events)[: max(0, len(self._events) - self.tracked // 2)]:
                    del self._events[a]
            q = self._events.setdefault(addr, deque())
            while q and q[0] <= now - self.window:
                q.popleft()
            if len(q) >= self.limit:
                return max(1, int(q[0] + self.window - now + 0.999))
            q.append(now)
            return 0


# -- grants: who a request acts for, and how far it may go ---------------------------
#
# One mechanism lets others in exactly as far as the owner allows (CONTRACT 21): a grant
# has a scope (read, write or admin) and optionally a folder, and is issued as a key
# (nsg_...), as an OAuth token pair for an MCP client (nsa_... / nsr_...), or, for one
# note, as a share link. Every secret is random and kept only as its SHA-256; the grants
# live in the state file, so a revocation holds at once in every thread (and process).

SCOPES = ("read", "write", "admin")  # each includes the ones before it
SCOPE_RANK = {scope: rank for rank, scope in enumerate(SCOPES)}
GRANT_KEY_PREFIX = "nsg_"
DEVICE_KEY_PREFIX = "nsd_"  # a device's key, from a pairing it claimed (CONTRACT 23)
MAX_PAIRINGS = 50  # pairings waiting to be claimed at once
PAIRING_SECRET_RE = re.compile(r"^[a-z2-7]{26}$")  # 128 bits, base32: typed in groups of 4
ACCESS_PREFIX, REFRESH_PREFIX, CODE_PREFIX = "nsa_", "nsr_", "nsc_"
OAUTH_SCOPES = ("notes:read", "notes:write")
OAUTH_SCOPE_OF = {"read": "notes:read", "write": "notes:read notes:write"}
ACCESS_LIFETIME = 3600  # seconds an OAuth access token lives
CODE_LIFETIME = 60  # seconds an authorisation code may be redeemed in (once)
OAUTH_IDLE_DAYS = 90  # an OAuth grant whose refresh token goes unused this long expires
MAX_OAUTH_CLIENTS = 100  # registered (DCR) clients kept at most
OAUTH_CLIENT_UNUSED_DAYS = 30  # a registered client unused this long is dropped
OAUTH_FRESH_CLIENT_SECONDS = 3600  # at the cap, never-used clients older than this give way
REGISTRATIONS_PER_MINUTE = 10  # per client address
MAX_GRANTS = 500  # keys and OAuth grants
MAX_SHARES = 1000
MAX_CODES = 1000  # authorisation codes outstanding
LAST_USED_FLUSH = 300.0  # seconds between writes of the grants' lastUsedAt
SHARE_TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]{22}$")  # 16 random bytes: 128 bits
PKCE_RE = re.compile(r"^[A-Za-z0-9._~-]{43,128}$")  # a verifier (RFC 7636 4.1)
CHALLENGE_RE = re.compile(r"^[A-Za-z0-9_-]{43}$")  # BASE64URL(SHA-256(verifier))
CIMD_TIMEOUT, CIMD_MAX_BYTES, CIMD_CACHE_SECONDS = 5.0, 65536, 3600.0


@dataclasses.dataclass(frozen=True)
class Principal:
    """Who a request acts for: the owner (API key, JWT, auth off) or one grant."""

    kind: str  # "owner", "key" (a scoped key), "device" (a paired device) or "oauth"
    scope: str  # read, write or admin
    folder: str = ""  # "notes/family": the grant sees that folder only; "" everything
    grant_id: str = ""
    resource: str = ""  # an OAuth token's audience: the MCP URL it was issued for

    def allows(self, scope: str) -> bool:
        return SCOPE_RANK[self.scope] >= SCOPE_RANK[scope]

    @property
    def attachments_folder(self) -> str:
        """Return the attachments folder a folder grant sees (notes/x -> attachments/x)."""
        return ATTACHMENTS + self.folder[len(NOTES) :] if self.folder else ""

    def sees(self, path: str) -> bool:
        """Return whether a note or attachment path lies inside the grant's folder."""
        return not self.folder or path.startswith(
            (self.folder + "/", self.attachments_folder + "/")
        )


OWNER = Principal("owner", "admin")


def request_principal() -> Principal:
    """Return who the current request acts for (the owner outside a protected request)."""
    try:
        return bottle.request.environ.get("notesvc.principal", OWNER)
    except (AttributeError, RuntimeError, KeyError):
        return OWNER


def _escapes(raw: Any, top: str) -> bool:
    """Return whether a raw path is not lexically inside folder `top` (or holds . or ..)."""
    if not isinstance(raw, str):
        return True
    text = unicodedata.normalize("NFC", raw)
    segments = text.split("/")
    return not text.startswith(top + "/") or "." in segments or ".." in segments


def _no_link_below(on_disk: Callable, top: str, path: str, what: str) -> None:
    """Raise 404 when a symbolic link lies between folder `top` and `path` (on disk)."""
    at = on_disk(top)
    try:
        parts = on_disk(path).relative_to(at).parts
    except ValueError:
        raise not_found(f"no {what} at {path}") from None
    for part in parts:
        at = at / part
        if os.path.islink(at):
            raise not_found(f"no {what} at {path}")


def visible_note(store: NoteStore, raw: Any, principal: Principal | None = None) -> str:
    """Return a checked note path the request's grant may see: outside its folder 404.

    The folder test comes first, so `..`, another folder's note by any encoding, or a
    symbolic link that leads out of the folder all answer as if nothing were there.
    """
    principal = principal or request_principal()
    if not principal.folder:
        return note_path(raw)
    if _escapes(raw, principal.folder):
        raise not_found(f"no note at {str(raw)[:MAX_PATH_CHARS]}")
    path = note_path(raw)
    _no_link_below(store.on_disk, principal.folder, path, "note")
    return path


def visible_attachment(store: Any, raw: Any, principal: Principal | None = None) -> str:
    """Return a checked attachment path the request's grant may see (its folder's match
    under attachments/); 404 outside it, as for notes."""
    principal = principal or request_principal()
    if not principal.folder:
        return attachment_path(raw)
    top = principal.attachments_folder
    if _escapes(raw, top):
        raise not_found(f"no attachment at {str(raw)[:MAX_PATH_CHARS]}")
    path = attachment_path(raw)
    _no_link_below(lambda p: store.base / p, top, path, "attachment")
    return path


def visible_note_file(store: Any, raw: Any, principal: Principal | None = None) -> str:
    """Return a checked path of a file beside the notes that the grant may see; 404 outside
    its folder, as for notes."""
    principal = principal or request_principal()
    if not principal.folder:
        return note_file_path(raw)
    if _escapes(raw, principal.folder):
        raise not_found(f"no attachment at {str(raw)[:MAX_PATH_CHARS]}")
    path = note_file_path(raw)
    _no_link_below(lambda p: store.base / p, principal.folder, path, "attachment")
    return path


def visible_folder(
    svc: Service, raw: Any, principal: Principal | None = None, top: str = NOTES
) -> str:
    """Return the folder a listing of `raw` shows a grant: raw itself inside its folder (no
    symbolic link on the way), the grant's folder for an ancestor of it; 404 for any other
    folder. `top` (notes or attachments) by default."""
    principal = principal or request_principal()
    own = principal.folder if top == NOTES else principal.attachments_folder
    if own and isinstance(raw, str) and {".", ".."} & set(raw.split("/")):
        raise not_found(f"no folder at {raw[:MAX_PATH_CHARS]}")
    folder = (folder_path if top == NOTES else attachment_folder)(raw or top)
    if not own or folder == own:
        return folder
    if folder.startswith(own + "/"):
        base = svc.attachments.base
        on_disk = svc.notes.on_disk if top == NOTES else (lambda p: base / p)
        _no_link_below(on_disk, own, folder, "folder")
        return folder
    if folder == top or own.startswith(folder + "/"):
        return own
    raise not_found(f"no folder at {folder}")


def granted_tree(
    svc: Service, raw: Any, depth: int | None = None, count: Callable | None = None
) -> dict:
    """Return the tree of a folder as the request's grant sees it (`depth` and `count` as
    NoteStore.tree takes them): a folder above the grant's own holds only the way down."""
    folder = visible_folder(svc, raw)  # a folder grant's own, or 404
    asked = folder_path(raw)
    if folder == asked:
        return svc.notes.tree(folder, depth, count)
    way = folder.split("/")[asked.count("/") + 1 :]  # the folders from below asked to its own
    left = None if depth is None else depth - len(way)
    if left is not None and left < 0:  # the cut falls on the way down
        path = "/".join([asked, *way[:depth]])
        notes = count(folder) if count else len(svc.notes.walk(folder))
        node = {"name": way[depth - 1], "path": path, "type": "folder", "count": notes}
    else:
        try:
            node = svc.notes.tree(folder, left, count)
        except ApiError as e:
            if e.status_code != 404:
                raise
            node = {"name": way[-1], "path": folder, "type": "folder"}
            node.update({"count": 0} if left == 0 else {"children": []})
    while node["path"] != asked:
        parent = node["path"].rsplit("/", 1)[0]
        node = {
            "name": parent.rsplit("/", 1)[-1],
            "path": parent,
            "type": "folder",
            "children": [node],
        }
    return node


def _epoch(text: Any) -> float:
    """Return the time an ISO 8601 UTC stamp names; infinity for none (never expires)."""
    if not text:
        return math.inf
    try:
        when = dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ")
    except (TypeError, ValueError):
        return 0.0  # unreadable: treated as long expired
    return when.replace(tzinfo=dt.timezone.utc).timestamp()


def _clean_name(text: Any, fallback: str, limit: int = 100) -> str:
    """Return a display name: printable characters only, trimmed, at most limit long."""
    name = "".join(ch for ch in str(text or "") if ch.isprintable()).strip()[:limit]
    return name or fallback


class OAuthError(Exception):
    """An OAuth failure, answered in OAuth's own JSON (RFC 6749 5.2, RFC 7591 3.2.2)."""

    def __init__(self, error: str, description: str, status: int = 400, headers=None):
        super().__init__(description)
        self.error, self.description, self.status = error, description, status
        self.headers = headers or {}


def check_redirect_uri(uri: Any) -> str:
    """Return a redirect URI a client may register: https, or http on a loopback host."""
    if not isinstance(uri, str) or not uri or len(uri) > 2000:
        raise OAuthError("invalid_redirect_uri", "a redirect URI is a URL of 1-2000 characters")
    if any(ch.isspace() or not ch.isprintable() for ch in uri):
        raise OAuthError("invalid_redirect_uri", "a redirect URI holds no spaces or controls")
    parts = urllib.parse.urlsplit(uri)
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise OAuthError("invalid_redirect_uri", "the redirect URI has a bad port") from None
    host = parts.hostname or ""
    if "#" in uri or parts.username is not None or parts.password is not None or not host:
        raise OAuthError(
            "invalid_redirect_uri", "a redirect URI has a host and no #fragment or user info"
        )
    if parts.scheme == "https" or (
        parts.scheme == "http" and (host == "localhost" or is_loopback(host))
    ):
        return uri
    raise OAuthError(
        "invalid_redirect_uri", "a redirect URI must be https, or http on a loopback host"
    )


def redirect_matches(registered: Iterable[str], uri: str) -> bool:
    """Return whether uri is registered: exactly, or on loopback with any port (RFC 8252)."""
    if uri in registered:
        return True
    p = urllib.parse.urlsplit(uri)
    host = p.hostname or ""
    if p.scheme != "http" or not (host == "localhost" or is_loopback(host)):
        return False
    return any(
        (q.scheme, q.hostname, q.path, q.query) == ("http", host, p.path, p.query)
        for q in map(urllib.parse.urlsplit, registered)
    )


def parse_oauth_scope(text: Any) -> str:
    """Return the grant scope ("read" or "write") an OAuth scope string asks for; unknown
    scopes are ignored (RFC 6749 3.3 lets the server grant less)."""
    words = set(str(text or "").split())
    return "write" if "notes:write" in words else "read"


def pkce_matches(verifier: str, challenge: str) -> bool:
    """Return whether BASE64URL(SHA-256(verifier)) is the challenge (S256, RFC 7636)."""
    if not PKCE_RE.match(verifier or ""):
        return False
    digest = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).rstrip(b"=")
    return hmac.compare_digest(digest, challenge.encode())


def mcp_challenge(mcp_url: str, error: str = "") -> str:
    """Return the WWW-Authenticate value of a 401 on the MCP endpoint (RFC 9728 5.1): the
    metadata URL is the MCP URL's origin, the well-known name, then the MCP URL's path."""
    parts = urllib.parse.urlsplit(mcp_url)
    meta = f"{parts.scheme}://{parts.netloc}/.well-known/oauth-protected-resource{parts.path}"
    extra = f', error="{error}"' if error else ""
    return f'Bearer resource_metadata="{meta}", scope="{OAUTH_SCOPES[0]}"{extra}'


def public_address(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Return whether an address is on the public internet (not loopback, private,
    link-local, multicast, reserved or unspecified), IPv4-mapped IPv6 unwrapped."""
    if ip.version == 6 and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return ip.is_global and not (
        ip.is_loopback
        or ip.is_private
        or ip.is_link_local
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
    )


def fetch_client_metadata(
    url: str,
    resolve: Callable = socket.getaddrinfo,
    allow: Callable = public_address,
    context: Any = None,
    timeout: float = CIMD_TIMEOUT,
    limit: int = CIMD_MAX_BYTES,
) -> dict:
    """Return the JSON object a Client ID Metadata Document URL serves, fetched safely.

    https only; the host's every address must pass `allow` after DNS resolution, and the
    connection goes to the address checked (no second lookup a rebinding host could
    answer differently); redirects are not followed; `timeout` seconds in all and `limit`
    bytes at most. Raises ValueError saying why not.
    """
    import http.client  # outbound calls only: kept off the start-up path
    import ssl

    parts = urllib.parse.urlsplit(url)
    if (
        parts.scheme != "https"
        or not parts.hostname
        or parts.username is not None
        or parts.fragment
        or parts.path in ("", "/")
    ):
        raise ValueError("a client_id URL must be https, with a path and no user or #fragment")
    try:
        port = parts.port or 443
        infos = resolve(parts.hostname, port, type=socket.SOCK_STREAM)
        addrs = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
    except (OSError, UnicodeError, ValueError):
        raise ValueError(f"{parts.hostname} does not resolve") from None
    refused = [ip for ip in addrs if not allow(ip)]
    if not addrs or refused:
        shown = refused[0] if refused else "nothing"
        raise ValueError(f"{parts.hostname} resolves to {shown}, which is not a public address")
    deadline, opened = time.monotonic() + timeout, []

    class Pinned(http.client.HTTPSConnection):
        def connect(self) -> None:  # to the address checked; TLS still names the host
            sock = socket.create_connection((str(addrs[0]), self.port), timeout)
            self.sock = self._context.wrap_socket(
                sock, server_hostname=self.host, do_handshake_on_connect=False
            )
            opened.append(self.sock)  # the response keeps it after the connection lets go
            self.sock.do_handshake()

    conn = Pinned(
        parts.hostname, port, timeout=timeout, context=context or ssl.create_default_context()
    )
    expired = threading.Event()

    def cut() -> None:  # the socket's time-out bounds each read; this, the whole fetch
        expired.set()
        for sock in opened:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    watchdog = threading.Timer(timeout, cut)
    watchdog.daemon = True
    watchdog.start()
    try:
        target = urllib.parse.urlunsplit(("", "", parts.path, parts.query, ""))
        conn.request("GET", target, headers={"Accept": "application/json"})
        resp = conn.getresponse()
        if 300 <= resp.status < 400:
            raise ValueError(f"it answered a redirect (HTTP {resp.status}); none is followed")
        if resp.status != 200:
            raise ValueError(f"it answered HTTP {resp.status}")
        raw = b""
        while len(raw) <= limit:
            if time.monotonic() > deadline:
                raise ValueError(f"it took over {timeout:g} s")
            chunk = resp.read(min(16384, limit + 1 - len(raw)))
            if not chunk:
                break
            raw += chunk
        if len(raw) > limit:
            raise ValueError(f"it is over {limit} bytes")
    except (OSError, http.client.HTTPException, ssl.SSLError) as e:
        if expired.is_set():
            raise ValueError(f"it took over {timeout:g} s") from None
        reason = "timed out" if isinstance(e, (socket.timeout, TimeoutError)) else type(e).__name__
        raise ValueError(f"it could not be fetched ({reason})") from None
    finally:
        watchdog.cancel()
        conn.close()
    if expired.is_set():  # cut short: what arrived is not the document
        raise ValueError(f"it took over {timeout:g} s")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ValueError("it is not JSON") from None
    if not isinstance(doc, dict):
        raise ValueError("it is not a JSON object")
    return doc


class GrantStore:
    """Grants (scoped keys, OAuth grants), OAuth clients and share links.

    Kept in the state file under "grants", "oauthClients" and "shares", so a change is
    seen at once by every thread. Authorisation codes (60 s, single use), fetched client
    metadata documents and rate counters live in memory. Lookups go through an index of
    secret hashes rebuilt whenever the state changes.
    """

    def __init__(self, state: StateStore, clock: Callable = time.time):
        self.state, self.clock = state, clock
        self._lock = threading.Lock()
        self._cache: tuple = (
            None,
            {},
        )  # (state it was built from, hash -> (kind, principal, expires))
        self._used: dict = {}  # grant id -> when it was last used, not yet written
        self._flushed = clock()
        self.codes: dict = {}  # code hash -> what the owner approved (memory only)
        self.metadata: dict = {}  # client_id URL -> (fetched at, document)
        self.registrations = RateLimit(REGISTRATIONS_PER_MINUTE)
        self.public_hits = RateLimit(60)  # shared notes and consent facts, per address
        self.share_misses = Lockout()  # unknown share tokens, per address

    # -- authenticating -------------------------------------------------------------

    def _index(self) -> dict:
        data = self.state.read()
        built_from, index = self._cache
        if built_from is data:
            return index
        index = {}
        for g in data.get("grants", []):
            p = Principal(
                g["kind"], g["scope"], g.get("folder") or "", g["id"], g.get("resource", "")
            )
            expires = _epoch(g.get("expiresAt"))
            if g.get("keyHash"):
                index[g["keyHash"]] = ("key", p, expires)
            if g.get("accessHash"):
                until = min(expires, _epoch(g.get("accessExpiresAt")))
                index[g["accessHash"]] = ("access", p, until)
        self._cache = (data, index)
        return index

    def principal(self, secret: str) -> Principal | None:
        """Return the grant a scoped key, a device key or an access token stands for (None:
        no such live one)."""
        keys = (GRANT_KEY_PREFIX, DEVICE_KEY_PREFIX)
        if not secret.startswith((*keys, ACCESS_PREFIX)) or len(secret) > 128:
            return None
        entry = self._index().get(key_hash(secret))
        if entry is None or self.clock() >= entry[2]:
            return None
        kind, principal, _ = entry
        if (kind == "key") != secret.startswith(keys):
            return None
        self._used[principal.grant_id] = self.clock()
        if self.clock() - self._flushed > LAST_USED_FLUSH:
            self.flush()
        return principal

    def flush(self, force: bool = False) -> None:
        """Write the grants' lastUsedAt (every LAST_USED_FLUSH seconds at most, or now)."""
        with self._lock:
            if not force and self.clock() - self._flushed <= LAST_USED_FLUSH:
                return
            used, self._used, self._flushed = self._used, {}, self.clock()
        if not used or self.state.readonly:
            return

        def change(data: dict) -> None:
            for g in data.get("grants", []):
                if g["id"] in used:
                    g["lastUsedAt"] = iso(used[g["id"]])

        try:
            self.state.update(change)
        except (OSError, StateError, ApiError) as e:
            log.warning("could not record when grants were last used: %s", e)

    # -- keys and grants --------------------------------------------------------------

    def _public(self, g: dict) -> dict:
        last = self._used.get(g["id"])
        rec = {
            "id": g["id"],
            "kind": g["kind"],
            "name": g["name"],
            "scope": g["scope"],
            "folder": g.get("folder"),
            "createdAt": g["createdAt"],
            "expiresAt": g.get("expiresAt"),
            "lastUsedAt": iso(last) if last else g.get("lastUsedAt"),
        }
        if g["kind"] == "oauth":
            rec["client"] = dict(g["client"])
        return rec

    def grants(self) -> list:
        """Return every grant without its secrets (keys and OAuth grants)."""
        return [self._public(g) for g in self.state.read().get("grants", [])]

    def _add_grant(self, grant: dict) -> None:
        now = self.clock()

        def change(data: dict) -> None:
            live = [g for g in data.get("grants", []) if _epoch(g.get("expiresAt")) > now]
            if len(live) >= MAX_GRANTS:
                raise ApiError(
                    409, "CONFLICT", f"{MAX_GRANTS} grants exist already; revoke some first"
                )
            data["grants"] = [*live, grant]

        self.state.update(change)

    def create_key(self, name: str, scope: str, folder: str | None, days: int | None) -> tuple:
        """Return (the key's record, the key itself) of a new scoped key."""
        key, now = GRANT_KEY_PREFIX + secrets.token_urlsafe(32), self.clock()
        grant = {
            "id": "gr_" + secrets.token_hex(6),
            "kind": "key",
            "name": name,
            "scope": scope,
            "folder": folder,
            "createdAt": iso(now),
            "expiresAt": iso(now + days * 86400) if days else None,
            "lastUsedAt": None,
            "keyHash": key_hash(key),
        }
        self._add_grant(grant)
        log.info("scoped key %s (%s%s) created", grant["id"], scope, f" {folder}" if folder else "")
        return self._public(grant), key

    # -- devices: a pairing's one-time secret, claimed for a device key ------------------

    def create_pairing(self, name: str, scope: str, folder: str | None, ttl: int) -> tuple:
        """Return (the pairing's record, its one-time secret): 128 random bits, kept only
        as their SHA-256, good once within ttl seconds."""
        secret = base64.b32encode(secrets.token_bytes(16)).decode("ascii").lower().rstrip("=")
        now = self.clock()
        pairing = {
            "id": "pa_" + secrets.token_hex(6),
            "secretHash": key_hash(secret),
            "name": name,
            "scope": scope,
            "folder": folder,
            "createdAt": iso(now),
            "expiresAt": iso(now + ttl),
        }

        def change(data: dict) -> None:
            live = [p for p in data.get("pairings", []) if _epoch(p["expiresAt"]) > now]
            if len(live) >= MAX_PAIRINGS:
                raise ApiError(
                    409, "CONFLICT", f"{MAX_PAIRINGS} pairings wait already; let them expire"
                )
            data["pairings"] = [*live, pairing]

        self.state.update(change)
        log.info("pairing %s (%s%s) made", pairing["id"], scope, f" {folder}" if folder else "")
        return {k: v for k, v in pairing.items() if k != "secretHash"}, secret

    def claim(self, secret: str, device_name: str) -> tuple | None:
        """Return (the new device's record, its key) for a live pairing's secret, which is
        used up; None for a secret that is unknown, used or expired."""
        wanted = key_hash(re.sub(r"[\s-]", "", secret).lower())
        now = self.clock()
        key = DEVICE_KEY_PREFIX + secrets.token_urlsafe(32)

        def change(data: dict) -> dict | None:
            pairings = [p for p in data.get("pairings", []) if _epoch(p["expiresAt"]) > now]
            found = next(
                (p for p in pairings if hmac.compare_digest(p["secretHash"], wanted)), None
            )
            data["pairings"] = [p for p in pairings if p is not found]
            if found is None:
                return None
            grants = [g for g in data.get("grants", []) if _epoch(g.get("expiresAt")) > now]
            if len(grants) >= MAX_GRANTS:
                raise ApiError(
                    409, "CONFLICT", f"{MAX_GRANTS} grants exist already; revoke some first"
                )
            device = {
                "id": "dv_" + secrets.token_hex(6),
                "kind": "device",
                "name": device_name or found["name"],
                "scope": found["scope"],
                "folder": found["folder"],
                "createdAt": iso(now),
                "expiresAt": None,
                "lastUsedAt": iso(now),
                "keyHash": key_hash(key),
                "pairing": found["id"],
            }
            data["grants"] = [*grants, device]
            return device

        if not any(  # a wrong secret writes nothing
            hmac.compare_digest(p["secretHash"], wanted)
            for p in self.state.read().get("pairings", [])
        ):
            return None
        device = self.state.update(change)
        if device is None:
            return None
        log.info("device %s claimed pairing %s", device["id"], device["pairing"])
        return self._public(device), key

    def revoke(self, grant_id: str) -> bool:
        """Revoke a key or an OAuth grant (and the share links it made); False if unknown."""

        def change(data: dict) -> bool:
            grants = data.get("grants", [])
            kept = [g for g in grants if g["id"] != grant_id]
            if len(kept) == len(grants):
                return False
            data["grants"] = kept
            data["shares"] = [s for s in data.get("shares", []) if s.get("grantId") != grant_id]
            return True

        if not any(g["id"] == grant_id for g in self.state.read().get("grants", [])):
            return False
        found = self.state.update(change)
        self._used.pop(grant_id, None)
        if found:
            log.info("grant %s revoked", grant_id)
        return found

    def counts(self) -> dict:
        """Return how many grants there are of each kind, and registered OAuth clients."""
        data, now = self.state.read(), self.clock()
        live = [g for g in data.get("grants", []) if _epoch(g.get("expiresAt")) > now]
        kinds = collections.Counter(g["kind"] for g in live)
        return {
            "key": kinds["key"],
            "oauth": kinds["oauth"],
            "share": sum(_epoch(s["expiresAt"]) > now for s in data.get("shares", [])),
            "oauthClients": len(data.get("oauthClients", {})),
        }

    # -- OAuth clients ----------------------------------------------------------------

    def register_client(self, meta: dict, addr: str) -> dict:
        """Register a public client (RFC 7591); return its client information."""
        wait = self.registrations.hit(addr)
        if wait:
            raise OAuthError(
                "temporarily_unavailable",
                f"too many registrations from this address; retry in {wait} s",
                429,
                {"Retry-After": str(wait)},
            )
        uris = meta.get("redirect_uris")
        if not isinstance(uris, list) or not 1 <= len(uris) <= 10:
            raise OAuthError("invalid_redirect_uri", "redirect_uris must list 1-10 URIs")
        uris = [check_redirect_uri(u) for u in uris]
        grant_types = meta.get("grant_types", ["authorization_code", "refresh_token"])
        if not isinstance(grant_types, list) or not set(grant_types) <= {
            "authorization_code",
            "refresh_token",
        }:
            raise OAuthError(
                "invalid_client_metadata", "grant_types may be authorization_code, refresh_token"
            )
        if meta.get("response_types", ["code"]) != ["code"]:
            raise OAuthError("invalid_client_metadata", 'response_types may only be ["code"]')
        for name in ("client_name", "client_uri", "scope", "token_endpoint_auth_method"):
            if name in meta and not isinstance(meta[name], (str, type(None))):
                raise OAuthError("invalid_client_metadata", f"{name} must be a string")
        uri = meta.get("client_uri") or ""
        if uri and (len(uri) > 2000 or urllib.parse.urlsplit(uri).scheme not in ("https", "http")):
            raise OAuthError("invalid_client_metadata", "client_uri must be an http(s) URL")
        now = self.clock()
        client_id = "mcp_" + secrets.token_urlsafe(16)
        record = {
            "name": _clean_name(meta.get("client_name"), "unnamed client"),
            "redirectUris": uris,
            "uri": uri,
            "createdAt": iso(now),
            "lastUsedAt": None,
        }

        def change(data: dict) -> None:
            clients = data.setdefault("oauthClients", {})
            stale = now - OAUTH_CLIENT_UNUSED_DAYS * 86400
            holding = {g["client"]["id"] for g in data.get("grants", []) if g["kind"] == "oauth"}
            for cid in [
                c
                for c, r in clients.items()
                if _epoch(r.get("lastUsedAt") or r["createdAt"]) < stale and c not in holding
            ]:
                del clients[cid]
            unused = sorted(
                (r["createdAt"], c)
                for c, r in clients.items()
                if not r.get("lastUsedAt")
                and _epoch(r["createdAt"]) < now - OAUTH_FRESH_CLIENT_SECONDS
            )
            while len(clients) >= MAX_OAUTH_CLIENTS and unused:
                del clients[unused.pop(0)[1]]
            if len(clients) >= MAX_OAUTH_CLIENTS:
                raise OAuthError(
                    "temporarily_unavailable",
                    f"this server holds its maximum of {MAX_OAUTH_CLIENTS} registered clients",
                    503,
                )
            clients[client_id] = record

        self.state.update(change)
        log.info("OAuth client %s registered (%s)", client_id, log_safe(record["name"], 100))
        answer = {
            "client_id": client_id,
            "client_id_issued_at": int(now),
            "client_name": record["name"],
            "redirect_uris": uris,
            "grant_types": grant_types,
            "response_types": ["code"],
            "token_endpoint_auth_method": "none",
        }
        if meta.get("scope"):
            answer["scope"] = " ".join(s for s in meta["scope"].split() if s in OAUTH_SCOPES)
        if uri:
            answer["client_uri"] = uri
        return answer

    def client(self, client_id: Any, fetch: Callable = fetch_client_metadata) -> dict:
        """Return {id, name, redirectUris, uri} of a registered client or of a Client ID
        Metadata Document (an https client_id, fetched and cached an hour); OAuthError if none."""
        if not isinstance(client_id, str) or not client_id or len(client_id) > 2000:
            raise OAuthError("invalid_client", "client_id is missing or too long", 401)
        if not client_id.startswith("https://"):
            record = self.state.read().get("oauthClients", {}).get(client_id)
            if record is None:
                raise OAuthError(
                    "invalid_client", "no client is registered with that client_id", 401
                )
            return {"id": client_id, **record}
        cached = self.metadata.get(client_id)
        if cached and self.clock() - cached[0] < CIMD_CACHE_SECONDS:
            return cached[1]
        try:
            doc = fetch(client_id)
        except ValueError as e:
            raise OAuthError(
                "invalid_client", f"the client's metadata document: {e}", 401
            ) from None
        if doc.get("client_id") != client_id:
            raise OAuthError(
                "invalid_client", "the client's metadata document names another client_id", 401
            )
        uris = doc.get("redirect_uris")
        if not isinstance(uris, list) or not 1 <= len(uris) <= 10:
            raise OAuthError("invalid_client", "the client's metadata lists no redirect_uris", 401)
        try:
            uris = [check_redirect_uri(u) for u in uris]
        except OAuthError as e:
            raise OAuthError(
                "invalid_client", f"the client's metadata: {e.description}", 401
            ) from None
        host = urllib.parse.urlsplit(client_id).hostname
        client = {
            "id": client_id,
            "name": _clean_name(doc.get("client_name"), host),
            "redirectUris": uris,
            "uri": doc.get("client_uri") if isinstance(doc.get("client_uri"), str) else "",
        }
        if len(self.metadata) >= 64:
            self.metadata.clear()
        self.metadata[client_id] = (self.clock(), client)
        return client

    def check_request(self, client_id: Any, redirect_uri: Any) -> dict:
        """Return the client of an authorisation request whose redirect URI it registered."""
        client = self.client(client_id)
        if not isinstance(redirect_uri, str) or not redirect_uri:
            raise OAuthError("invalid_request", "redirect_uri is required")
        if not redirect_matches(client["redirectUris"], redirect_uri):
            raise OAuthError(
                "invalid_request", "that redirect_uri is not registered for the client"
            )
        check_redirect_uri(redirect_uri)
        return client

    # -- authorisation codes and tokens -----------------------------------------------

    def approve(self, client: dict, redirect_uri: str, grant: dict, state: str, issuer: str) -> str:
        """Return the redirect (with code, state and iss) for an approved request.

        grant: {challenge, scope, folder, resource}, what the code will be redeemed for.
        """
        code, now = CODE_PREFIX + secrets.token_urlsafe(32), self.clock()
        with self._lock:
            for h in [h for h, c in self.codes.items() if c["expires"] + CODE_LIFETIME < now]:
                del self.codes[h]
            if len(self.codes) >= MAX_CODES:
                raise ApiError(429, "RATE_LIMITED", "too many approvals waiting; retry in a minute")
            self.codes[key_hash(code)] = {
                **grant,
                "client": {"id": client["id"], "name": client["name"]},
                "redirectUri": redirect_uri,
                "expires": now + CODE_LIFETIME,
                "used": False,
                "grantId": None,
            }
        params = {"code": code, **({"state": state} if state else {}), "iss": issuer}
        sep = "&" if urllib.parse.urlsplit(redirect_uri).query else "?"
        return redirect_uri + sep + urllib.parse.urlencode(params)

    def redeem(self, code: str, client_id: str, redirect_uri: str, verifier: str, resource) -> dict:
        """Return the token answer for an authorisation code (single use, 60 s, bound to the
        client, the redirect URI, the PKCE challenge and the resource); OAuthError if not."""
        now = self.clock()
        with self._lock:
            entry = self.codes.get(key_hash(code or ""))
            reused = entry is not None and entry["used"]
            if entry is not None:
                entry["used"] = True
        if entry is None:
            raise OAuthError("invalid_grant", "the code is unknown or expired")
        if reused:  # a replayed code: what it was exchanged for is revoked (RFC 6749 4.1.2)
            if entry["grantId"]:
                self.revoke(entry["grantId"])
            raise OAuthError("invalid_grant", "the code was used already")
        if entry["expires"] < now:
            raise OAuthError("invalid_grant", "the code is unknown or expired")
        if client_id != entry["client"]["id"]:
            raise OAuthError("invalid_grant", "the code was issued to another client")
        if redirect_uri != entry["redirectUri"]:
            raise OAuthError("invalid_grant", "redirect_uri differs from the authorisation's")
        if not pkce_matches(verifier, entry["challenge"]):
            raise OAuthError("invalid_grant", "the code_verifier does not match the challenge")
        if resource and resource != entry["resource"]:
            raise OAuthError("invalid_target", "resource differs from the authorisation's")
        answer, grant_id = self._issue(entry)
        entry["grantId"] = grant_id
        return answer

    def _tokens(self, grant: dict, now: float) -> dict:
        access, refresh = (
            ACCESS_PREFIX + secrets.token_urlsafe(32),
            REFRESH_PREFIX + secrets.token_urlsafe(32),
        )
        grant.update(
            accessHash=key_hash(access),
            accessExpiresAt=iso(now + ACCESS_LIFETIME),
            refreshHash=key_hash(refresh),
            expiresAt=iso(now + OAUTH_IDLE_DAYS * 86400),
        )
        return {
            "access_token": access,
            "token_type": "Bearer",
            "expires_in": ACCESS_LIFETIME,
            "refresh_token": refresh,
            "scope": OAUTH_SCOPE_OF[grant["scope"]],
        }

    def _issue(self, entry: dict) -> tuple:
        now = self.clock()
        grant = {
            "id": "gr_" + secrets.token_hex(6),
            "kind": "oauth",
            "name": entry["client"]["name"],
            "scope": entry["scope"],
            "folder": entry["folder"],
            "createdAt": iso(now),
            "lastUsedAt": None,
            "client": entry["client"],
            "resource": entry["resource"],
            "usedRefresh": [],
        }
        answer = self._tokens(grant, now)
        self._add_grant(grant)

        def used(data: dict) -> None:
            record = data.get("oauthClients", {}).get(entry["client"]["id"])
            if record is not None:
                record["lastUsedAt"] = iso(now)

        self.state.update(used)
        log.info("OAuth grant %s issued to %s", grant["id"], log_safe(grant["name"], 100))
        return answer, grant["id"]

    def refresh(self, token: str, client_id: str, resource, scope) -> dict:
        """Return new tokens for a refresh token, which is rotated; a refresh token used twice
        revokes its whole grant (both tokens fail from then on)."""
        h, now = key_hash(token or ""), self.clock()
        known = any(
            g.get("refreshHash") == h or h in g.get("usedRefresh", ())
            for g in self.state.read().get("grants", [])
        )
        if not token or not known:
            raise OAuthError("invalid_grant", "the refresh token is unknown, expired or revoked")

        def change(data: dict) -> tuple:
            grants = data.get("grants", [])
            for i, g in enumerate(grants):
                if h in g.get("usedRefresh", ()):
                    del grants[i]
                    return "reused", g
                if g.get("refreshHash") != h:
                    continue
                if g["client"]["id"] != client_id:
                    return "client", g
                if _epoch(g.get("expiresAt")) <= now:
                    return "expired", g
                if resource and resource != g.get("resource"):
                    return "resource", g
                if scope and parse_oauth_scope(scope) == "write" and g["scope"] != "write":
                    return "scope", g
                g["usedRefresh"] = [*g.get("usedRefresh", []), h][-20:]
                client = data.get("oauthClients", {}).get(client_id)
                if client is not None:  # in use: never dropped as unused
                    client["lastUsedAt"] = iso(now)
                return "ok", self._tokens(g, now)
            return "gone", None

        outcome, detail = self.state.update(change)
        if outcome == "ok":
            return detail
        if outcome == "reused":
            log.warning("OAuth grant %s revoked: a refresh token was used twice", detail["id"])
        errors = {
            "reused": ("invalid_grant", "the refresh token was used already: the grant is revoked"),
            "client": ("invalid_grant", "the refresh token was issued to another client"),
            "expired": ("invalid_grant", "the grant expired; authorise again"),
            "resource": ("invalid_target", "resource differs from the grant's"),
            "scope": ("invalid_scope", "the grant does not hold notes:write"),
            "gone": ("invalid_grant", "the refresh token is unknown, expired or revoked"),
        }
        raise OAuthError(*errors[outcome])

    def revoke_token(self, token: str, client_id: str) -> None:
        """Revoke the grant an access or refresh token belongs to (RFC 7009; unknown: nothing)."""
        h = key_hash(token or "")
        for g in self.state.read().get("grants", []):
            if g.get("kind") == "oauth" and h in (g.get("accessHash"), g.get("refreshHash")):
                if client_id and g["client"]["id"] != client_id:
                    return
                self.revoke(g["id"])
                return

    # -- share links ---------------------------------------------------------------

    def create_share(self, path: str, days: int, principal: Principal) -> tuple:
        """Return (the share's record, its token) of a new read-only link to one note."""
        token, now = secrets.token_urlsafe(16), self.clock()
        share = {
            "id": "sh_" + secrets.token_hex(6),
            "path": path,
            "tokenHash": key_hash(token),
            "createdAt": iso(now),
            "expiresAt": iso(now + days * 86400),
            "grantId": principal.grant_id or None,
        }

        def change(data: dict) -> None:
            live = [s for s in data.get("shares", []) if _epoch(s["expiresAt"]) > now]
            if len(live) >= MAX_SHARES:
                raise ApiError(409, "CONFLICT", f"{MAX_SHARES} share links exist; revoke some")
            data["shares"] = [*live, share]

        self.state.update(change)
        return self.share_record(share), token

    @staticmethod
    def share_record(share: dict) -> dict:
        keys = ("id", "path", "createdAt", "expiresAt")
        return {**{k: share[k] for k in keys}, "createdBy": share.get("grantId") or "owner"}

    def shares(self, principal: Principal) -> list:
        """Return the share links a principal sees: a grant its own (while their notes are
        in its folder), the owner (and an admin device) all."""
        now = self.clock()
        return [
            self.share_record(s)
            for s in self.state.read().get("shares", [])
            if _epoch(s["expiresAt"]) > now
            and (
                principal.allows("admin")
                or (s.get("grantId") == principal.grant_id and principal.sees(s["path"]))
            )
        ]

    def revoke_share(self, share_id: str, principal: Principal) -> bool:
        def mine(s: dict) -> bool:
            return s["id"] == share_id and (
                principal.allows("admin") or s.get("grantId") == principal.grant_id
            )

        if not any(map(mine, self.state.read().get("shares", []))):
            return False

        def change(data: dict) -> None:
            data["shares"] = [s for s in data.get("shares", []) if not mine(s)]

        self.state.update(change)
        return True

    def shared(self, token: str) -> tuple | None:
        """Return (the live share a token opens, whom it reads as: the owner, or the grant
        that made it); None when unknown, expired or revoked, or when that grant is."""
        if not SHARE_TOKEN_RE.match(token or ""):
            return None
        h, now = key_hash(token), self.clock()
        data = self.state.read()
        for s in data.get("shares", []):
            if hmac.compare_digest(s["tokenHash"], h) and _epoch(s["expiresAt"]) > now:
                if not s.get("grantId"):
                    return s, OWNER
                for g in data.get("grants", []):
                    if g["id"] == s["grantId"] and _epoch(g.get("expiresAt")) > now:
                        return s, Principal(g["kind"], g["scope"], g.get("folder") or "", g["id"])
                return None
        return None

    def on_note_event(self, event: str, path: str, detail: Any) -> None:
        """Keep share links on their note: a move takes them along, a delete ends them."""
        if event not in ("moved", "deleted") or self.state.readonly:
            return
        if not any(s["path"] == path for s in self.state.read().get("shares", [])):
            return

        def change(data: dict) -> None:
            shares = data.get("shares", [])
            if event == "deleted":
                data["shares"] = [s for s in shares if s["path"] != path]
            else:
                for s in shares:
                    if s["path"] == path:
                        s["path"] = detail[0]

        self.state.update(change)


# == Service ==================================================================
#
# The one object every handler, provider, plugin and audit check gets as `svc`: the
# configuration, the state, the notes, the index, the lockout and the app's own
# registries (built-ins plus what its plugins brought). Built by create_app() (or, read
# only, by the audit); its threads start in start().


def plugins_dir(config: Config) -> Path:
    """Return the folder third-party plugins are loaded from."""
    return (
        Path(config.plugins_dir).expanduser()
        if config.plugins_dir
        else config.state_dir / "plugins"
    )


def check_agent_config(config: Config, providers: Mapping[str, Any]) -> None:
    """Raise ConfigError when the agent provider is unknown or lacks a setting it requires."""
    provider = providers.get(config.agent_provider)
    if provider is None:
        names = ", ".join(sorted(providers))
        raise ConfigError(
            f"SERVICE_AGENT_PROVIDER: {config.agent_provider!r} is not one of {names}"
        )
    env_of = {s.name: s.env for s in SETTINGS}
    for name in provider.requires:
        if not getattr(config, name):
            raise ConfigError(f"{env_of[name]}: required by the {provider.name} agent provider")


def _rid() -> str:
    """Return the current request's id (for log lines written below a handler)."""
    try:
        return bottle.request.environ.get("notesvc.request_id", "-")
    except (AttributeError, RuntimeError, KeyError):
        return "-"


class Idempotency:
    """The answers to recent writes sent with an Idempotency-Key header: a client replaying
    its outbox after a lost answer gets the first answer again, and nothing is done twice
    (no second note, no second conflict copy). Memory only; a day at most, and at most
    IDEMPOTENCY_BYTES of answers (the oldest go first)."""

    def __init__(self, clock: Callable = time.monotonic):
        self.clock = clock
        self._kept: collections.OrderedDict = collections.OrderedDict()
        self._running: dict = {}  # key -> [its lock, requests holding or waiting]
        self._bytes = 0
        self._lock = threading.Lock()

    @staticmethod
    def key(route: Any, environ: dict) -> tuple | None:
        raw = environ.get("HTTP_IDEMPOTENCY_KEY", "")
        if not raw:
            return None
        if not re.fullmatch(r"[!-~]{1,100}", raw):
            raise bad_request("Idempotency-Key must be 1-100 printable ASCII characters")
        who = environ.get("notesvc.principal", OWNER)
        where = environ.get("SCRIPT_NAME", "") + environ.get("PATH_INFO", "")
        return (who.grant_id or who.kind, route.method, where, raw)

    @contextlib.contextmanager
    def running(self, key: tuple | None):
        """Hold the key while its request runs: the same key sent again at once (two tabs
        sending one outbox) waits for the first answer instead of doing it twice."""
        if key is None:
            yield
            return
        with self._lock:
            held = self._running.setdefault(key, [threading.Lock(), 0])
            held[1] += 1
        got = held[0].acquire(timeout=60)
        try:
            yield
        finally:
            if got:
                held[0].release()
            with self._lock:
                held[1] -= 1
                if not held[1]:
                    del self._running[key]

    def get(self, key: tuple) -> tuple | None:
        with self._lock:
            self._expire()
            found = self._kept.get(key)
            return found[1] if found else None

    def put(self, key: tuple, status: int, headers: list, body: bytes) -> None:
        if len(body) > IDEMPOTENCY_BYTES // 8:
            return
        with self._lock:
            self._kept[key] = (self.clock(), (status, headers, body))
            self._bytes += len(body)
            self._expire()

    def _expire(self) -> None:
        now = self.clock()
        while self._kept:
            at, answer = next(iter(self._kept.values()))
            if now - at < DAY_SECONDS and self._bytes <= IDEMPOTENCY_BYTES:
                break
            self._kept.popitem(last=False)
            self._bytes -= len(answer[2])


IDEMPOTENCY_BYTES = 8 << 20


class Service:
    """Everything one running app shares across its threads.

    plugins: every plugin of this app, built-in and third-party (load_plugins);
    agent_providers / channel_providers / tools: the registries this app sees (built-ins
    plus its plugins' own). `readonly` (the audit): the state is opened without writing,
    nothing is created, swept, indexed or started.
    """

    def __init__(
        self,
        config: Config,
        plugins: Mapping[str, Any],
        agent_providers: Mapping[str, Any],
        channel_providers: Mapping[str, Any],
        tools: Mapping[str, Any] | None = None,
        readonly: bool = False,
    ):
        self.config = config
        self.readonly = readonly
        self.started = time.time()
        self.plugins = dict(plugins)
        self.agent_providers = dict(agent_providers)
        self.channel_providers = dict(channel_providers)
        self.tools = dict(tools or {})  # what MCP clients and the agent may call (TOOLS)
        self.plugin_errors: dict = {}  # name -> the last error a hook raised
        self.plugin_cache: dict = {}  # what built-in plugins derive from the index
        self.plugin_build_lock = threading.RLock()  # derived(): one build at a time
        self.routes: tuple = ()  # the app's Route table (NotesApp sets it)
        self.relay_client: Any = None  # a RelayClient while `serve` is connected to a relay
        self.idempotency = Idempotency()
        self.query_secret_seen_at = 0.0  # last webhook call that carried ?secret=
        self.service_uid = os.geteuid() if hasattr(os, "geteuid") else -1  # the audit's
        self.recorded_secrets: dict | None = None  # the audit: a running server's figures
        self.lockout = Lockout()
        self.last_sync: dict = {}
        self.index = SearchIndex()  # in memory until start() opens <state>/index
        self._stop = threading.Event()
        self._threads: list = []
        check_agent_config(config, self.agent_providers)
        if readonly:
            self.state = StateStore.open_existing(config.state_dir, readonly=True)
        else:
            config.notes_dir.mkdir(parents=True, exist_ok=True)
            self.state = StateStore(config.state_dir)
        state = config.state_dir  # history, trash and the change feed live with the notes:
        self.history = HistoryStore(
            state / "history", config.history_max_versions, config.history_days
        )
        self.trash = Trash(state / "trash", config.trash_days)
        self.journal = ChangeJournal(state / "changes.log")
        self.notes = NoteStore(config.notes_dir, state / "trash", self.history, self.journal)
        self.attachments = AttachmentStore(config.root / ATTACHMENTS, config.state_dir / "trash")
        # the other files beside the notes (an image in a vault, put there over WebDAV)
        self.note_files = AttachmentStore(
            config.notes_dir, config.state_dir / "trash", nfd_names=True
        )
        self.grants = GrantStore(self.state)  # scoped keys, OAuth grants, share links
        # Background components of later sections, composed by build_service():
        self.pollers: Any = None  # ChannelPollers: a thread per channel in polling mode
        self.reminders: Any = None  # ReminderScheduler: ⏰ lines sent through the channels

    def start(self) -> Service:
        """Sweep crash leftovers, bring the index up to date, start the background work."""
        if self.readonly or self._threads:
            return self
        swept = self.notes.sweep_temp_files() + self.attachments.sweep_temp_files()
        if swept:
            log.info("removed %d temp files left by an interrupted write", swept)
        self.index = SearchIndex.open(self.config.state_dir, self.notes)
        self.notes.listeners.append(self._on_note_event)
        self.notes.after.append(self._run_hooks)
        self.journal.open()
        self.notes.after.append(self.grants.on_note_event)  # share links follow their note
        if not self.config.rescan_seconds:  # nothing else would check the files: now
            self.last_sync = self.sync_index()
        self.index.start()  # flushes, commits and merges in the background
        self._spawn(lambda: expire_loop(self.notes, self.trash, self._stop), "notesvc-expire")
        if self.config.rescan_seconds:  # its first check runs at once: searches need not wait
            self._spawn(self._rescan_loop, "notesvc-rescan")
        for component in (self.pollers, self.reminders):
            if component is not None:
                component.start()
        return self

    def _spawn(self, target: Callable, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    # -- the search index ---------------------------------------------------------

    def _on_note_event(self, event: str, path: str, detail: Any) -> None:
        try:
            self._index_event(event, path, detail)
        except Exception:  # the write happened; the rescan sees the file differ and re-reads
            log.exception("request %s: indexing %s failed; the next rescan retries", _rid(), path)

    def _index_event(self, event: str, path: str, detail: Any) -> None:
        if event in ("saved", "restored"):
            content, st = detail
            self.index.add(path, content, st.st_size, st.st_mtime_ns)
        elif event == "moved":
            new, st = detail
            self.index.move(path, new, st.st_size, st.st_mtime_ns)
        elif event == "deleted":
            self.index.remove(path)

    # -- plugins ----------------------------------------------------------------

    def plugin_enabled(self, name: str) -> bool:
        plugin = self.plugins.get(name)
        switches = self.state.read().get("plugins", {})
        return plugin is not None and plugin.error is None and switches.get(name, True)

    def _run_hooks(self, event: str, path: str, detail: Any) -> None:
        hook = {
            "saved": "note_saved",
            "moved": "note_moved",
            "deleted": "note_deleted",
            "restored": "note_restored",
        }[event]
        args = {"deleted": lambda: (path,)}
        for plugin in self.plugins.values():
            fn = plugin.hooks.get(hook)
            if fn is None or not self.plugin_enabled(plugin.name):
                continue
            try:
                fn(self, *args.get(event, lambda: (path, detail[0]))())
            except Exception as e:  # a plugin's failure is its own: log it, list it, go on
                log.exception("plugin %s failed in %s for %s", plugin.name, hook, path)
                self.plugin_errors[plugin.name] = f"{hook}: {type(e).__name__}: {e}"[:300]

    def sync_index(self) -> dict:
        """Bring the index in line with the files; what other programs changed goes into the
        history and the change feed on the way."""
        return self.index.sync(self.notes, observe=self.notes.observe)

    def _rescan_loop(self) -> None:
        # The first check starts a second after start: the first searches of a restarted
        # server need not share the interpreter with it.
        if self._stop.wait(min(1.0, self.config.rescan_seconds)):
            return
        first = True
        while True:
            try:
                self.last_sync = self.sync_index()
                if first or self.last_sync.get("read") or self.last_sync.get("removed"):
                    release_memory()  # what reading the notes left behind
                first = False
            except Exception:
                log.exception("rescan failed; trying again in %s s", self.config.rescan_seconds)
            if self._stop.wait(self.config.rescan_seconds):
                return

    def close(self) -> None:
        """Stop background work and persist the index (once; a read-only service has none)."""
        self._stop.set()
        for component in (self.pollers, self.reminders):
            if component is not None:
                component.close()
        self.journal.close()  # long-polls answer now
        for thread in self._threads:
            thread.join(30)
        if self._threads:
            self._threads = []
            self.index.close()  # the last flush and commit
            self.grants.flush(force=True)

    # -- request context ------------------------------------------------------

    def client_addr(self, environ: dict) -> str:
        """Return the client's address (see client_address: proxies and the relay)."""
        return client_address(self.config, environ)

    def base_url(self, environ: dict) -> str:
        return base_url_of(self.config, environ)

    def relay_url(self, environ: dict) -> str:
        return self.config.relay_url or self.base_url(environ)

    def relay_origin(self) -> str:
        """Return this server's own origin on its relay, https://<serverId>.<domain>, when
        the relay it is paired with has per-server origins (else "")."""
        return relay_origin_of(self.config, self.state.read())

    def relay_base(self, environ: dict) -> str:
        """Return where browsers and links reach this server through its relay: its own
        origin there, else {relay}/r/<serverId> (path-based)."""
        origin = self.relay_origin()
        return origin or f"{self.relay_url(environ)}/r/{self.state.read()['serverId']}"

    def issuer(self, environ: dict) -> str:
        """Return the OAuth issuer (and share-link base) a request sees: the base URL, the
        server's own origin on its relay for a request that came that way, or
        {relay}/r/<serverId> for one that came through a relay's or this server's /r/<id>."""
        script = environ.get("SCRIPT_NAME", "")
        if environ.get("notesvc.relayed") and self.config.relay_url:
            if environ.get("notesvc.relay_origin"):
                return environ["notesvc.relay_origin"]
            return self.config.relay_url + script
        return self.base_url(environ) + script

    # -- authentication -------------------------------------------------------

    def key_matches(self, key: str | None) -> bool:
        """Return whether key is the current API key (constant-time on the hashes)."""
        stored = self.state.read().get("keyHash", "")
        return bool(key) and hmac.compare_digest(key_hash(key), stored)

    def authenticate(self, environ: dict, key_only: bool = False, mcp: bool = False) -> Principal:
        """Return who a protected request acts for, or raise 401 / 403 / 429.

        Only a credential that was presented and is wrong counts toward the lockout,
        and a right one clears its address's failures; while an address is locked out,
        every credential from it is 429, right or wrong (no oracle for a guesser).
        key_only: the route needs the API key itself, a JWT gets 403.
        mcp: /mcp, where the key may also come as `Authorization: Bearer` or `X-API-Key`,
        OAuth access tokens issued for its URL are good, and a 401 carries the challenge
        that leads a client to them.
        """
        if self.config.auth_mode == "none":
            return OWNER
        key = environ.get("HTTP_X_SERVICE_KEY", "")
        auth = environ.get("HTTP_AUTHORIZATION", "")
        bearer = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        if mcp and not key:  # AI connectors send only authorization, x-api-key, x-auth-token
            key = environ.get("HTTP_X_API_KEY", "") or bearer
        mcp_url = self.issuer(environ) + API + "/mcp" if mcp else ""
        if key or bearer:
            addr = self.client_addr(environ)
            self.check_lockout(addr)
            if self.key_matches(key):
                self.lockout.succeed(addr)
                return OWNER
            if bearer and self.config.auth_mode == "jwt" and self.token_valid(environ):
                self.lockout.succeed(addr)
                if key_only:
                    raise ApiError(
                        403,
                        "FORBIDDEN",
                        f"this needs the API key itself ({KEY_HEADER}), not a token",
                    )
                return OWNER
            for secret in filter(None, dict.fromkeys((key, bearer))):  # a scoped key, a token
                grant = self.grants.principal(secret)
                if grant is not None and grant.kind == "oauth" and not mcp:
                    raise ApiError(401, "UNAUTHORIZED", f"OAuth tokens are good for {API}/mcp only")
                if grant is not None and (grant.kind != "oauth" or grant.resource == mcp_url):
                    self.lockout.succeed(addr)
                    if key_only and grant.allows("admin"):  # an admin device: not these
                        raise ApiError(
                            403, "FORBIDDEN", f"this needs the API key itself ({KEY_HEADER})"
                        )
                    return grant
            self.lockout.fail(addr)
        headers = f"{KEY_HEADER}, Authorization: Bearer or X-API-Key" if mcp else KEY_HEADER
        challenge = {"WWW-Authenticate": mcp_challenge(mcp_url, "invalid_token" if bearer else "")}
        raise ApiError(
            401,
            "UNAUTHORIZED",
            f"missing or wrong {headers} header; see GET {API}/system/setup",
            challenge if mcp else None,
        )

    def token_valid(self, environ: dict) -> bool:
        """Return whether the request carries a valid bearer JWT for the current key."""
        auth = environ.get("HTTP_AUTHORIZATION", "")
        if not auth.lower().startswith("bearer "):
            return False
        try:
            claims = jwt_decode(auth[7:].strip(), self.config.jwt_secret)
        except ValueError:
            return False
        kid = self.state.read().get("keyHash", "")[:16]
        return hmac.compare_digest(str(claims.get("kid", "")).encode(), kid.encode())

    def check_lockout(self, addr: str) -> None:
        wait = self.lockout.retry_after(addr)
        if wait:
            raise ApiError(
                429,
                "RATE_LIMITED",
                f"too many failed credentials from this address; retry in {wait} s",
                {"Retry-After": str(wait)},
            )

    # -- facts shared by several endpoints ------------------------------------

    def uptime(self) -> float:
        return round(time.time() - self.started, 3)

    def note_stats(self) -> tuple:
        """Return (note count, total bytes) of the notes folder."""
        sizes = self.notes.scan()
        return len(sizes), sum(size for size, _ in sizes.values())


# == Providers ================================================================
#
# Agents answer questions from the notes; channels carry messages in and replies
# out. Both are registries of small records filled by decorators, so a plugin adds
# one exactly the way the built-ins are added.

STOPWORDS = frozenset(
    """a about am an and any are as at be been but by can could did do does doing for from
    get got had has have having he her here hers him his how i if in into is it its just
    me my mine no nor not now of off on once only or our ours out over own please put
    said same she should so some such than that the their theirs them then there these
    they this those to too under until up very was we were what when where which while
    who whom why will with would you your yours""".split()
)
CONTEXT_BUDGET = 12000  # characters of notes an upstream model is given
REPLY_LIMIT = 4000  # characters of a reply sent through a messaging channel
MAX_MESSAGE_CHARS = 8000  # of a question to the agent

# The built-in registries are filled by the decorators below. While a plugin file loads,
# the same decorators fill that plugin's own registries instead (see load_plugins), so
# each app sees the built-ins plus its own plugins' providers, never another app's.
_COLLECTING = threading.local()


def _registry(kind: str, builtin: dict) -> dict:
    target = getattr(_COLLECTING, "registries", None)
    return builtin if target is None else target.setdefault(kind, {})


@contextlib.contextmanager
def collecting_registrations():
    """Within the block, provider decorators fill the yielded dict, not the built-ins."""
    registries: dict = {}
    _COLLECTING.registries = registries
    try:
        yield registries
    finally:
        _COLLECTING.registries = None


class UpstreamError(Exception):
    """An outbound call failed; `timeout` tells a time-out from any other failure."""

    def __init__(self, message: str, timeout: bool = False, status: int = 0):
        super().__init__(message)
        self.timeout = timeout
        self.status = status  # the HTTP status the other side answered, 0 when none

    def api_error(self, what: str) -> ApiError:
        if self.timeout:
            return ApiError(504, "UPSTREAM_TIMEOUT", f"{what} did not answer in time: {self}")
        return ApiError(502, "UPSTREAM_ERROR", f"{what} failed: {self}")


def post_json(url: str, body: dict, headers: dict | None = None, timeout: float = 30) -> dict:
    """POST body as JSON and return the JSON answer; UpstreamError on any failure.

    Messages never include the URL (it may carry a bot token) or the headers.
    """
    import http.client  # outbound calls only: kept off the start-up path
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode()
    req = urllib.request.Request(
        url, data, {"Content-Type": "application/json", **(headers or {})}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read(4 << 20)
    except urllib.error.HTTPError as e:
        e.close()  # it holds the response (and its socket) open
        raise UpstreamError(f"HTTP {e.code}", status=e.code) from None
    except urllib.error.URLError as e:
        timed_out = isinstance(e.reason, (socket.timeout, TimeoutError))
        raise UpstreamError(
            str(getattr(e.reason, "strerror", None) or e.reason), timed_out
        ) from None
    except (socket.timeout, TimeoutError):
        raise UpstreamError("timed out", timeout=True) from None
    except (OSError, http.client.HTTPException) as e:
        raise UpstreamError(type(e).__name__) from None
    try:
        answer = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise UpstreamError("the answer was not JSON") from None
    if not isinstance(answer, dict):
        raise UpstreamError("the answer was not a JSON object")
    return answer


class Outbound:
    """Outbound HTTP(S) calls over one kept-alive connection, with bounded answers.

    abort() from another thread ends a call in flight at once (a poller's long poll when
    its channel is switched off). Messages never include the URL (a bot token is in it).
    A 2xx answer's body goes to `sink` chunk by chunk when one is given (a download
    straight to disk), else it is returned; any answer over `limit` is an UpstreamError.
    """

    def __init__(self):
        self._conn: Any = None
        self._origin: tuple = ()
        self._aborted = False
        self._lock = threading.Lock()

    def __enter__(self) -> Outbound:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            conn = self._conn
        sock = getattr(conn, "sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _drop(self, conn: Any) -> None:
        with self._lock:
            if self._conn is conn:
                self._conn = None
        conn.close()

    def _connection(self, scheme: str, host: str, timeout: float) -> tuple:
        import http.client

        with self._lock:
            if self._aborted:
                raise UpstreamError("stopped")
            fresh = self._conn is None or self._origin != (scheme, host)
            if fresh:
                if self._conn is not None:
                    self._conn.close()
                https = scheme == "https"
                kind = http.client.HTTPSConnection if https else http.client.HTTPConnection
                self._conn, self._origin = kind(host, timeout=timeout), (scheme, host)
            conn = self._conn
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn, fresh

    def request(
        self,
        method: str,
        url: str,
        body: Any = None,
        headers: dict | None = None,
        timeout: float = 30.0,
        limit: int = 4 << 20,
        sink: Callable | None = None,
    ) -> tuple:
        """Return (status, {lower-case header: value}, body bytes) of one call."""
        import http.client

        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise UpstreamError("not an http(s) URL")
        host = parts.netloc.rpartition("@")[2]
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        for attempt in (1, 2):
            conn, fresh = self._connection(parts.scheme, host, timeout)
            try:
                conn.request(method, target, body=body, headers=headers or {})
                resp = conn.getresponse()
                break
            except (OSError, http.client.HTTPException) as e:
                self._drop(conn)
                resend = body is None or isinstance(body, bytes)
                if attempt == 2 or fresh or self._aborted or not resend or _timed_out(e):
                    raise _upstream_error(e) from None
        try:
            status = resp.status
            answer = {k.lower(): v for k, v in resp.getheaders()}
            good = 200 <= status < 300
            cap = limit if good else 65536
            declared = answer.get("content-length", "")
            if declared.isdigit() and int(declared) > cap:
                raise UpstreamError(f"the answer is over {cap} bytes")
            data, seen = bytearray(), 0
            while True:
                chunk = resp.read(BODY_CHUNK)
                if not chunk:
                    break
                seen += len(chunk)
                if seen > cap:
                    raise UpstreamError(f"the answer is over {cap} bytes")
                if good and sink is not None:
                    sink(chunk)
                else:
                    data += chunk
        except DiskFull:
            self._drop(conn)
            raise
        except UpstreamError:
            self._drop(conn)
            raise
        except (OSError, http.client.HTTPException) as e:
            self._drop(conn)
            raise _upstream_error(e) from None
        if resp.will_close:
            self._drop(conn)
        return status, answer, bytes(data)


def _timed_out(e: BaseException) -> bool:
    return isinstance(e, (socket.timeout, TimeoutError))


def _upstream_error(e: BaseException) -> UpstreamError:
    if _timed_out(e):
        return UpstreamError("timed out", timeout=True)
    return UpstreamError(str(getattr(e, "strerror", None) or type(e).__name__))


# -- retrieval ---------------------------------------------------------------------


def question_stems(question: str) -> list:
    """Return the stems of a natural-language question, stopwords dropped."""
    words = [w for w in _WORD_RE.findall(fold(question)) if w not in STOPWORDS]
    return [stem(w) for w in dict.fromkeys(words)]


_SENTENCE_RE = re.compile(r"(?<=[.!?])\s+|\n+")
# Markdown a quoted sentence leaves out; every pattern runs in linear time.
_MD_LEAD_RE = re.compile(
    r"^(?:#{1,6}[ \t]+|>[ \t]*|(?:[-*+]|\d{1,9}[.)])[ \t]+(?:\[[ xX]\][ \t]+)?)+"
)
_MD_LINK_RE = re.compile(r"!?\[([^\[\]\n]*)\]\([^()\s]*(?:[ \t]+\"[^\"\n]*\")?\)")
_MD_WIKILINK_RE = re.compile(r"\[\[([^\[\]|\n]*)(?:\|([^\[\]\n]*))?\]\]")
_MD_MARKS_RE = re.compile(
    r"\*\*|__|~~|`|(?<![\w*])\*(?=\S)|(?<=\S)\*(?![\w*])|(?<!\w)_(?=\S)|(?<=\S)_(?!\w)"
)
_MD_INLINE_RE = re.compile(r"[*_~`\[]")  # a sentence without these has no inline marks
_HEADING_MARK_RE = re.compile(r"^[ \t]*#{1,6}[ \t]+", re.M)
_LINE_MARKS_RE = re.compile(
    r"^[ \t]*(?:>[ \t]*|(?:[-*+]|\d{1,9}[.)])[ \t]+(?:\[[ xX]\][ \t]+)?)+", re.M
)


def plain_text(line: str) -> str:
    """Return a line of Markdown as plain text: no heading, quote or list marks, no emphasis
    or code marks, links as their text.

    >>> plain_text("- [ ] **Buy** [milk](shop.md) and [[eggs|the eggs]] for *Anna*, `now`")
    'Buy milk and the eggs for Anna, now'
    """
    line = _MD_LEAD_RE.sub("", line.strip())
    line = _MD_WIKILINK_RE.sub(lambda m: m.group(2) or m.group(1), line)
    line = _MD_LINK_RE.sub(r"\1", line)
    return " ".join(_MD_MARKS_RE.sub("", line).split())


def best_passages(weights: dict, text: str, keep: int = 2) -> list:
    """Return up to `keep` sentences of text that hold the most (and rarest) query terms.

    weights: {stem: idf}. Needs no index (so no lock); reads the first MAX_SCAN_CHARS.
    """
    scored = []
    stems: dict = {}  # word -> stem, each computed once
    # Line marks go first (so "1. " ends no sentence); a heading is marked with \x01.
    text = _LINE_MARKS_RE.sub("", _HEADING_MARK_RE.sub("\x01", text[:MAX_SCAN_CHARS]))
    for i, sentence in enumerate(_SENTENCE_RE.split(text)):
        heading = sentence.startswith("\x01")  # quoted only when no other sentence matches
        sentence = sentence.strip("\x01 \t\r")
        if not sentence:
            continue
        if _MD_INLINE_RE.search(sentence):
            sentence = plain_text(sentence)
        words = set(_WORD_RE.findall(fold(sentence)))
        for w in words.difference(stems):
            stems[w] = stem(w)
        present = set(map(stems.__getitem__, words)) & weights.keys()
        if present:
            scored.append((heading, -sum(weights[t] for t in present), i, sentence))
    scored.sort()
    if scored and not scored[0][0]:
        scored = [item for item in scored if not item[0]]
    return [_clip(item[3], 400) for item in scored[:keep]]


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1].rsplit(" ", 1)[0] + "…"


def _hits_in_folder(svc: Service, question: str, folder: str, limit: int) -> list:
    """Return the top (path, title, text, score) inside a folder (a folder grant's sources):
    the question's words as one OR query of the index, restricted to the folder."""
    words = list(dict.fromkeys(w for w in _WORD_RE.findall(fold(question)) if w not in STOPWORDS))
    text = ""
    for word in words:
        if len(text) + len(word) + 4 > MAX_QUERY_CHARS:
            break
        text = f"{text} OR {word}" if text else word
    try:
        _, ranked = svc.index.search(Query(text), folder, limit)
    except ApiError:  # no searchable word in the question
        return []
    hits = []
    for path, title, score, _ in ranked:
        with contextlib.suppress(ApiError):
            hits.append((path, title, svc.notes.get(path)["content"], score))
    return hits


def retrieve(
    svc: Service, question: str, note: str | None, limit: int = 3, folder: str = ""
) -> list:
    """Return [(path, title, [passages])]: the best hits, best first (inside `folder` only,
    when a folder grant asks).

    The note asked about (`notePath`) comes first when its passages match the question;
    otherwise it comes last with its opening, context for a model that no one quotes.
    """
    index = svc.index
    weights = index.stem_weights(question_stems(question))
    if folder:
        hits = _hits_in_folder(svc, question, folder, limit)
    else:
        hits = index.search_any(list(weights), limit)  # the passages are cut without the lock
    found = [(p, title, best_passages(weights, text)) for p, title, text, _ in hits if p != note]
    if note:
        rec = svc.notes.get(note)
        passages = best_passages(weights, rec["content"])
        if passages:
            found.insert(0, (note, rec["title"], passages))
        else:
            opening = _clip(" ".join(rec["content"][:MAX_SCAN_CHARS].split()), 600)
            found.append((note, rec["title"], [opening]))
    return found


def matching(stems: set, passages: list) -> list:
    """Return the best of the passages (best first) that hold one of the stems, and the
    next ones while they hold as many of them."""
    counts = [len(stems.intersection(tokenize(p))) for p in passages]
    return [p for p, n in zip(passages, counts) if n and n == counts[0]]


# -- tools: what MCP clients and the agent may call -------------------------------------
#
# A tool is a small function of the service with a JSON Schema for its arguments, a
# description a model can act on, and MCP's annotations. MCP clients call tools through
# /api/v1/mcp and the `openai` agent through its tool loop; both run the same functions,
# which go through the store (its locks, hooks and history) and the index like every HTTP
# handler: there is no second write path. Write tools are offered only where the owner
# allows writes (SERVICE_MCP_WRITE, SERVICE_AGENT_WRITE). The built-ins register at the
# end of Plugins, like the built-in plugins (two of them use the links and tags plugins).

TOOL_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # what MCP and OpenAI both accept


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str
    run: Callable  # (svc, **arguments) -> dict, the structured result; raises ApiError
    description: str
    schema: dict  # JSON Schema of the arguments: an object, no other properties
    title: str = ""
    read_only: bool = True
    destructive: bool = False  # may overwrite or remove what is there (not only add)
    idempotent: bool = False  # calling it again with the same arguments changes nothing more
    plugin: str = ""  # offered only while this plugin is on ("": always)
    text: Callable | None = None  # structured result -> the text a model reads (default JSON)
    alias_of: str = ""  # the same service under a name some client expects (MCP only)

    def annotations(self) -> dict:
        """Return MCP's annotations of the tool (hints for clients, never enforced by them)."""
        return {
            "title": self.title or self.name.replace("_", " "),
            "readOnlyHint": self.read_only,
            "destructiveHint": self.destructive,
            "idempotentHint": self.idempotent,
            "openWorldHint": False,  # the notes are a closed world
        }


TOOLS: dict[str, Tool] = {}


def tool(
    name: str,
    description: str,
    properties: dict | None = None,
    required: tuple = (),
    *,
    title: str = "",
    read_only: bool = True,
    destructive: bool = False,
    idempotent: bool = False,
    plugin: str = "",
    text: Callable | None = None,
    alias_of: str = "",
) -> Callable:
    """Register a tool function under name; `properties` are its arguments' JSON Schemas."""
    if not TOOL_NAME_RE.match(name):
        raise ValueError(f"tool name {name!r} is not 1-64 of A-Z a-z 0-9 _ -")
    schema = {
        "type": "object",
        "properties": dict(properties or {}),
        "required": list(required),
        "additionalProperties": False,
    }

    def register(fn: Callable) -> Callable:
        _registry("tool", TOOLS)[name] = Tool(
            name,
            fn,
            description,
            schema,
            title,
            read_only,
            destructive,
            idempotent,
            plugin,
            text,
            alias_of,
        )
        return fn

    return register


def available_tools(svc: Service, writes: bool) -> list:
    """Return the tools this app offers: read-only ones, write ones when `writes` and the
    request's grant may write, each only while its plugin is on. A folder grant gets the
    built-in tools only: they keep it in its folder, a plugin's tool may not."""
    who = request_principal()
    writes = writes and who.allows("write")
    return [
        t
        for t in svc.tools.values()
        if (writes or t.read_only)
        and (not t.plugin or svc.plugin_enabled(t.plugin))
        and (not who.folder or TOOLS.get(t.name) is t)
    ]


_JSON_TYPES = {"string": str, "integer": int, "boolean": bool, "object": dict, "array": list}


def checked_arguments(schema: dict, arguments: Any) -> dict:
    """Return a tool's arguments checked against its schema (the part of JSON Schema tools
    use: type, required, additionalProperties, min/maxLength, minimum/maximum, enum); null
    counts as absent, 3.0 as 3. Raises 400 saying what is wrong."""
    if not isinstance(arguments, dict):
        raise bad_request("the arguments must be a JSON object")
    props = schema.get("properties", {})
    given = {k: v for k, v in arguments.items() if v is not None}
    missing = [name for name in schema.get("required", ()) if name not in given]
    if missing:
        raise bad_request(f"missing required argument(s): {', '.join(missing)}")
    unknown = sorted(set(given) - set(props))
    if unknown and schema.get("additionalProperties") is False:
        takes = ", ".join(props) or "no arguments"
        raise bad_request(f"unknown argument(s): {', '.join(unknown)}; this tool takes {takes}")
    out = {}
    for name, value in given.items():
        rule = props.get(name, {})
        kind = rule.get("type")
        if kind == "integer" and isinstance(value, float) and value.is_integer():
            value = int(value)
        expected = _JSON_TYPES.get(kind)
        if expected and (
            not isinstance(value, expected) or (expected is int and isinstance(value, bool))
        ):
            raise bad_request(f"'{name}' must be a{'n' if kind[0] in 'aeio' else ''} {kind}")
        if isinstance(value, str):
            if len(value) < rule.get("minLength", 0):
                raise bad_request(f"'{name}' must not be empty")
            if len(value) > rule.get("maxLength", len(value)):
                raise bad_request(f"'{name}' is longer than {rule['maxLength']} characters")
        if isinstance(value, int) and not (
            rule.get("minimum", value) <= value <= rule.get("maximum", value)
        ):
            raise bad_request(f"'{name}' must be from {rule['minimum']} to {rule['maximum']}")
        if "enum" in rule and value not in rule["enum"]:
            raise bad_request(f"'{name}' must be one of {', '.join(map(str, rule['enum']))}")
        out[name] = value
    return out


def tool_error(code: str, message: str) -> dict:
    """Return a tool result saying what went wrong, for the model to act on (MCP's isError)."""
    return {
        "content": [{"type": "text", "text": f"Error ({code}): {message}"}],
        "structuredContent": {"error": {"code": code, "message": message}},
        "isError": True,
    }


def call_tool(svc: Service, tool: Tool, arguments: Any) -> dict:
    """Return the result of one tool call as MCP's CallToolResult {content, structuredContent,
    isError}.

    Whatever a model can recover from (bad arguments, a missing note, a stale etag) is an
    isError result whose text says what to do; a bug is logged and answered with its request
    id only. Nothing raises.
    """
    try:
        data = tool.run(svc, **checked_arguments(tool.schema, arguments))
    except ApiError as e:
        return tool_error(e.code, e.message)
    except Exception:
        rid = _rid()
        log.exception("request %s: tool %s failed", rid, tool.name)
        return tool_error("INTERNAL_ERROR", f"internal error; request id {rid}")
    text = tool.text(data) if tool.text else to_json(data).decode("utf-8")
    return {
        "content": [{"type": "text", "text": text}],
        "structuredContent": data,
        "isError": False,
    }


# -- agent providers ------------------------------------------------------------------


# (svc, question, found) -> (reply, model) or (reply, model, [paths of the sources]); with
# two items the sources are every note in `found`.
AnswerFn = Callable[[Any, str, list], tuple]


@dataclasses.dataclass(frozen=True)
class AgentProvider:
    name: str
    answer: AnswerFn  # raises UpstreamError when the model fails
    model: Callable[[Config], str]  # the model name reported by /agent/status
    enabled: bool = True
    description: str = ""
    requires: tuple = ()  # Config fields that must be set to use it (checked at start)


AGENT_PROVIDERS: dict[str, AgentProvider] = {}


def agent_provider(
    name: str,
    model: Callable[[Config], str],
    enabled: bool = True,
    description: str = "",
    requires: tuple = (),
) -> Callable[[AnswerFn], AnswerFn]:
    """Register an agent provider function under name."""

    def register(fn: AnswerFn) -> AnswerFn:
        provider = AgentProvider(name, fn, model, enabled, description, requires)
        _registry("agent", AGENT_PROVIDERS)[name] = provider
        return fn

    return register


@agent_provider(
    "local",
    model=lambda cfg: "notesvc-local",
    description="offline: quotes the best-matching passages of your notes",
)
def answer_locally(svc: Service, question: str, found: list) -> tuple:
    """Quote the best-matching plain sentence of each note that matches, best note first."""
    quoted, stems = [], set(question_stems(question))
    for path, _, passages in found:
        best = matching(stems, passages)  # best_passages put the best one first
        if best:
            quoted.append((path, " ".join(best)))
    if not quoted:
        return f"Nothing in your notes matches “{_clip(question, 80)}”.", "notesvc-local", []
    lines = ["From your notes:", *(f"• {passage} — {path}" for path, passage in quoted[:4])]
    return "\n".join(lines), "notesvc-local", [path for path, _ in quoted[:4]]


SYSTEM_PROMPT = (
    "You answer questions about the user's personal notes. Use only the notes below; "
    "name the note path you took an answer from; if the notes do not say, say so."
)
TOOLS_PROMPT = (
    "When the notes below do not answer the question, call the tools: search_notes to "
    "search again, read_note to read a whole note."
)
WRITE_PROMPT = (
    "Change notes only when the user asks you to; read a note first and pass the etag you "
    "read to update_note or move_note."
)
MAX_TOOL_CALLS_PER_STEP = 8  # run of one model answer; the others are answered "skipped"
MAX_TOOL_TEXT = 16000  # characters of one tool result a model is given


def model_context(found: list, budget: int = CONTEXT_BUDGET) -> str:
    """Return the notes for an upstream model, trimmed to the character budget."""
    parts, used = [], 0
    for path, title, passages in found:
        block = f"## {path} ({title})\n" + "\n".join(f"- {p}" for p in passages)
        if used + len(block) > budget:
            block = block[: max(0, budget - used)]
        if block:
            parts.append(block)
            used += len(block)
    return "\n\n".join(parts) or "(no note matched the question)"


def agent_endpoint(base_url: str, path: str, api_key: str = "") -> tuple:
    """Return (url, headers) for a call to path under an OpenAI-compatible base URL.

    urllib cannot send a `user:pass@` from the URL, so userinfo becomes a Basic
    credential (an API key, when set, wins as Bearer); a query string stays after the path.
    """
    parts = urllib.parse.urlsplit(base_url)
    userinfo, _, hostport = parts.netloc.rpartition("@")
    headers = {}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    elif userinfo:
        user, _, password = userinfo.partition(":")
        plain = f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password)}"
        headers["Authorization"] = "Basic " + base64.b64encode(plain.encode()).decode()
    full = parts._replace(netloc=hostport, path=parts.path.rstrip("/") + path, fragment="")
    return urllib.parse.urlunsplit(full), headers


@agent_provider(
    "openai",
    model=lambda cfg: cfg.agent_model,
    description="any OpenAI-compatible /chat/completions (Ollama, llama.cpp, vLLM, OpenAI)",
    requires=("agent_base_url", "agent_model"),
)
def answer_with_model(svc: Service, question: str, found: list) -> tuple:
    """Answer through an OpenAI-compatible model, in a bounded tool loop.

    The first call carries the best passages as context together with the tools, so a
    model that answers at once answers from the notes. Each answer with `tool_calls` gets
    the tools' results (`role: tool`) and another call, at most SERVICE_AGENT_MAX_STEPS
    calls in all (the last one with `tool_choice: "none"`). A model or server that refuses
    `tools` (HTTP 400 or 422) gets today's single call without them.
    """
    cfg = svc.config
    url, headers = agent_endpoint(cfg.agent_base_url, "/chat/completions", cfg.agent_api_key)
    tools = [t for t in available_tools(svc, cfg.agent_write) if not t.alias_of]
    specs = [openai_tool(t) for t in tools]
    prompt = SYSTEM_PROMPT + (f" {TOOLS_PROMPT}" if specs else "")
    prompt += f" {WRITE_PROMPT}" if any(not t.read_only for t in tools) else ""
    messages = [
        {"role": "system", "content": f"{prompt}\n\n{model_context(found)}"},
        {"role": "user", "content": question},
    ]
    body = {"model": cfg.agent_model, "messages": messages, "temperature": 0.2, "stream": False}
    touched: list = []  # notes the tools read or changed, in order
    context = [path for path, _, _ in found]
    model = cfg.agent_model
    for step in range(cfg.agent_max_steps):
        last = step == cfg.agent_max_steps - 1
        if specs:
            body["tools"] = specs
            if last:  # the model must answer now (some servers refuse an explicit "auto")
                body["tool_choice"] = "none"
        try:
            answer = post_json(url, body, headers, cfg.agent_timeout)
        except UpstreamError as e:
            if not (step == 0 and specs and e.status in (400, 422)):
                raise
            log.info("request %s: the model refused tools (%s); asking without them", _rid(), e)
            specs = []
            body.pop("tools")
            body.pop("tool_choice", None)
            answer = post_json(url, body, headers, cfg.agent_timeout)
        message = _assistant_message(answer)
        model = str(answer.get("model") or cfg.agent_model)
        calls = message.get("tool_calls") if specs else None
        if not calls or not isinstance(calls, list):
            return _reply_text(message), model, touched + context
        if last:
            break
        content = message.get("content") or ""
        messages.append({"role": "assistant", "content": content, "tool_calls": calls})
        for i, call in enumerate(calls):
            if i < MAX_TOOL_CALLS_PER_STEP:
                messages.append(run_tool_call(svc, tools, call, touched))
            else:  # every call needs its answer, or the next request is refused
                messages.append(
                    _tool_message(call, f"skipped: at most {MAX_TOOL_CALLS_PER_STEP} calls at once")
                )
        log.debug("request %s: agent step %d ran %d tool calls", _rid(), step + 1, len(calls))
    reply = (
        f"I stopped after {cfg.agent_max_steps} model calls (SERVICE_AGENT_MAX_STEPS) without "
        "an answer; the notes I looked at are listed as sources."
    )
    return reply, model, touched + context


def _assistant_message(answer: dict) -> dict:
    try:
        message = answer["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        raise UpstreamError("the answer had no choices[0].message.content") from None
    if not isinstance(message, dict):
        raise UpstreamError("the answer had no choices[0].message.content")
    return message


def _reply_text(message: dict) -> str:
    reply = message.get("content")
    if not isinstance(reply, str):
        raise UpstreamError("the answer's content was not text")
    return reply.strip()


def openai_tool(tool: Tool) -> dict:
    """Return a tool as OpenAI's function-calling declaration."""
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": tool.schema},
    }


def run_tool_call(svc: Service, tools: list, call: Any, touched: list) -> dict:
    """Return the `role: tool` message answering one of a model's tool calls.

    A tool not offered (a write tool while SERVICE_AGENT_WRITE is off, a name the model
    made up) or arguments that are not JSON are refused in that message, for the model to
    read. A note a tool read or changed is added to `touched`.
    """
    call = call if isinstance(call, dict) else {}
    function = call.get("function") if isinstance(call.get("function"), dict) else {}
    name, raw = function.get("name"), function.get("arguments") or "{}"
    offered = {t.name: t for t in tools}
    if name in offered:
        try:
            arguments = json.loads(raw) if isinstance(raw, str) else raw
        except ValueError:
            result = tool_error("VALIDATION_ERROR", "the arguments are not valid JSON")
        else:
            result = call_tool(svc, offered[name], arguments)
            path = result["structuredContent"].get("path")
            if not result["isError"] and isinstance(path, str) and path not in touched:
                touched.append(path)
    elif name in svc.tools and not svc.tools[name].read_only:
        result = tool_error(
            "FORBIDDEN",
            f"{name} changes notes, and the owner has not allowed the agent to change notes "
            "(SERVICE_AGENT_WRITE is off); tell the user instead",
        )
    else:
        result = tool_error(
            "NOT_FOUND", f"there is no tool {str(name)[:64]!r}; use one of {', '.join(offered)}"
        )
    return _tool_message(call, result["content"][0]["text"])


def _tool_message(call: Any, text: str) -> dict:
    call_id = str(call.get("id", "")) if isinstance(call, dict) else ""
    return {"role": "tool", "tool_call_id": call_id, "content": _clip(text, MAX_TOOL_TEXT)}


@agent_provider("none", model=lambda cfg: "", enabled=False, description="agent switched off")
def answer_nothing(svc: Service, question: str, found: list) -> tuple:
    raise ApiError(503, "AGENT_DISABLED", "the agent is off (SERVICE_AGENT_PROVIDER=none)")


def ask_agent(svc: Service, question: str, note: str | None = None, folder: str = "") -> dict:
    """Return the agent's {reply, provider, model, sources} for a question (its sources
    inside `folder` only, when a folder grant asks)."""
    provider = svc.agent_providers[svc.config.agent_provider]
    if not provider.enabled:
        raise ApiError(503, "AGENT_DISABLED", "the agent is off (SERVICE_AGENT_PROVIDER=none)")
    found = retrieve(svc, question, note, folder=folder)
    try:
        answer = provider.answer(svc, question, found)
    except UpstreamError as e:
        raise e.api_error("the model endpoint") from None
    reply, model = answer[0], answer[1]
    titles = {path: title for path, title, _ in found}
    if len(answer) > 2:  # the provider names its sources (notes that may be gone since)
        paths = [p for p in dict.fromkeys(answer[2]) if p in titles or svc.notes.exists(p)]
    else:
        paths = list(titles)
    sources = [{"path": p, "title": titles.get(p) or svc.index.title_of(p) or p} for p in paths]
    return {"reply": reply, "provider": provider.name, "model": model, "sources": sources}


# -- channel providers ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ConfigField:
    name: str
    kind: str  # "string", "list", "boolean", "choice" (one of `choices`) or "folder" (notes/...)
    required: bool = False
    secret: bool = False
    help: str = ""
    choices: tuple = ()
    default: Any = None  # of a field left out ("choice": its first choice unless given)

    def empty(self) -> Any:
        """Return the value a field left out takes."""
        if self.default is not None:
            return self.default
        first = self.choices[0] if self.choices else ""
        return {"list": [], "boolean": False}.get(self.kind, first)


MAX_CONFIG_CHARS = 512  # of one string in a channel's config

ParseFn = Callable[[dict], list]  # payload -> [(sender, text[, display name])]
SendFn = Callable[[Any, dict, str, str], None]  # (svc, config, sender, text)


@dataclasses.dataclass(frozen=True)
class ChannelProvider:
    name: str
    fields: tuple  # ConfigField
    # (payload) -> [(sender, text)] or [(sender, text, sender's display name)]; text None
    # for an update without text. Plugins' 2-tuples keep working.
    parse: ParseFn
    send: SendFn | None  # raises UpstreamError
    allow: str = ""  # the config field holding the sender allowlist
    description: str = ""
    secret_header: str = ""  # a header the provider itself sends the channel secret in
    # GET /channels/webhook/<name>: the provider's subscription check, (svc) -> text
    verify: Callable | None = None
    verify_params: tuple = ()  # its query parameters (OpenAPI)
    # Meta-style signed webhooks: the header carrying "sha256=<HMAC of the raw body>" and
    # the config field holding the key; a channel with the key set needs the signature.
    signature_header: str = ""
    signing_field: str = ""
    # (svc, config, offset, wait, outbound) -> [(next offset, update)]: the channel can
    # fetch its own updates (config.mode "polling", see ChannelPollers)
    poll: Callable | None = None
    # (svc, config, media, write, limit): stream one media item of an update to write()
    fetch: Callable | None = None
    # (svc, channel) -> what it did, or None: the provider's side of a create or PATCH
    # (Telegram's setWebhook); raises UpstreamError, shown as the channel's `status`
    configure: Callable | None = None


CHANNEL_PROVIDERS: dict[str, ChannelProvider] = {}


def channel_provider(
    name: str,
    fields: tuple,
    allow: str = "",
    description: str = "",
    secret_header: str = "",
    signature_header: str = "",
    signing_field: str = "",
) -> Callable[[ParseFn], ParseFn]:
    """Register a channel provider: the decorated function parses inbound updates.

    A parser returns [(sender, text)], [(sender, text, display name)] or, with files,
    [(sender, text or caption, display name, [media])]; a media item is a dict with
    `kind` (photo, voice, audio, document, video, video_note, image), `id`, and where
    known `mime`, `name` and `size`.
    """

    def register(parse: ParseFn) -> ParseFn:
        provider = ChannelProvider(
            name,
            fields,
            parse,
            None,
            allow,
            description,
            secret_header,
            signature_header=signature_header,
            signing_field=signing_field,
        )
        _registry("channel", CHANNEL_PROVIDERS)[name] = provider
        return parse

    return register


def _registered_channel(name: str) -> tuple:
    registry = _registry("channel", CHANNEL_PROVIDERS)
    if name not in registry:
        raise KeyError(f"register channel provider {name!r} before its sender or check")
    return registry, registry[name]


def channel_sender(name: str) -> Callable[[SendFn], SendFn]:
    """Register the function that sends replies through channel provider `name`."""

    def register(send: SendFn) -> SendFn:
        registry, provider = _registered_channel(name)
        registry[name] = dataclasses.replace(provider, send=send)
        return send

    return register


def channel_verifier(name: str, params: tuple = ()) -> Callable:
    """Register the provider's answer to GET /channels/webhook/<name> (a subscription check)."""

    def register(verify: Callable) -> Callable:
        registry, provider = _registered_channel(name)
        registry[name] = dataclasses.replace(provider, verify=verify, verify_params=params)
        return verify

    return register


def channel_poller(name: str) -> Callable:
    """Register how provider `name` fetches its own updates (channels in polling mode)."""

    def register(poll: Callable) -> Callable:
        registry, provider = _registered_channel(name)
        registry[name] = dataclasses.replace(provider, poll=poll)
        return poll

    return register


def channel_fetcher(name: str) -> Callable:
    """Register how provider `name` downloads the photos, voice and files of an update."""

    def register(fetch: Callable) -> Callable:
        registry, provider = _registered_channel(name)
        registry[name] = dataclasses.replace(provider, fetch=fetch)
        return fetch

    return register


def channel_configurer(name: str) -> Callable:
    """Register what provider `name` does when one of its channels is created or changed."""

    def register(configure: Callable) -> Callable:
        registry, provider = _registered_channel(name)
        registry[name] = dataclasses.replace(provider, configure=configure)
        return configure

    return register


def channel_mode(channel: dict) -> str:
    """Return a channel's mode: "polling" or "webhook" (a channel stored before modes
    existed, or of a provider without them, is a webhook channel)."""
    return channel.get("config", {}).get("mode") or "webhook"


def validate_channel_config(provider: ChannelProvider, config: Any) -> dict:
    """Return config checked against the provider's fields; 400 naming what is wrong."""
    if not isinstance(config, dict):
        raise bad_request("'config' must be an object")
    known = {f.name: f for f in provider.fields}
    unknown = sorted(set(config) - set(known))
    if unknown:
        raise bad_request(f"unknown config field(s) for {provider.name}: {', '.join(unknown)}")
    out = {}
    for f in provider.fields:
        value = config.get(f.name)
        if value is None or value == [] or (isinstance(value, str) and is_blank(value)):
            if f.required:
                raise bad_request(f"config.{f.name} is required for {provider.name}")
            out[f.name] = f.empty()
            continue
        if f.kind == "boolean":
            if not isinstance(value, bool):
                raise bad_request(f"config.{f.name} must be true or false")
            out[f.name] = value
        elif f.kind == "choice":
            if value not in f.choices:
                raise bad_request(f"config.{f.name} must be one of {', '.join(f.choices)}")
            out[f.name] = value
        elif f.kind == "folder":
            if not isinstance(value, str) or len(value) > MAX_CONFIG_CHARS:
                raise bad_request(f"config.{f.name} must be a folder under {NOTES}/")
            out[f.name] = folder_path(value)
        elif f.kind == "list":
            if not isinstance(value, list) or not all(
                isinstance(v, (str, int)) and not isinstance(v, bool) for v in value
            ):
                raise bad_request(f"config.{f.name} must be a list of ids")
            out[f.name] = [str(v).strip() for v in value][:1000]
        else:
            if (
                not isinstance(value, str)
                or len(value) > MAX_CONFIG_CHARS
                or not value.isprintable()
            ):
                raise bad_request(f"config.{f.name} must be a short single-line string")
            out[f.name] = value.strip()
    return out


# -- channels' state: what providers and the pipeline share ---------------------------


def _channels(svc: Service) -> list:
    return svc.state.read().get("channels", [])


def _printable(text: str, limit: int = 100) -> str:
    """Return text without control characters, at most limit characters (names, log lines)."""
    return "".join(ch for ch in str(text) if ch.isprintable())[:limit]


def _change_channel(svc: Service, channel_id: str, change: Callable) -> dict:
    def apply(data: dict) -> dict:
        for i, channel in enumerate(data.get("channels", [])):
            if channel["id"] == channel_id:
                return change(data["channels"], i)
        raise not_found(f"no channel {channel_id}")

    return svc.state.update(apply)


def _match_secret(candidates: list, key: str, presented: str) -> dict | None:
    """Return the candidate whose `key` equals presented; every candidate is compared."""
    found = None
    for item in candidates:
        expected = str(item.get(key) or "")
        if expected and hmac.compare_digest(expected.encode(), presented.encode()):
            found = item
    return found


_SAVE_TO = ConfigField(
    "saveTo",
    "folder",
    help=f"a folder under {NOTES}/ for /save and captures, a note per day "
    f"(default: the daily note, {DAILY_FOLDER}/YYYY-MM-DD.md)",
)
_NOTIFY = ConfigField("notify", "boolean", help="send reminders (⏰ lines) to the allowed senders")
TELEGRAM_UPDATES = ["message", "edited_message", "channel_post"]
TELEGRAM_MEDIA = ("voice", "audio", "document", "video", "video_note")


class TelegramError(UpstreamError):
    """The Bot API answered ok: false; `code` is its error_code (409: a webhook is set)."""

    def __init__(self, message: str, code: int = 0, retry_after: float = 0.0):
        super().__init__(message)
        self.code, self.retry_after = code, retry_after


def telegram_call(
    svc: Service,
    config: dict,
    method: str,
    params: dict,
    timeout: float = 15.0,
    outbound: Outbound | None = None,
) -> Any:
    """Return the `result` of one Bot API call; TelegramError with Telegram's description."""
    url = f"{svc.config.telegram_api_base}/bot{config['botToken']}/{method}"
    out = outbound or Outbound()
    try:
        status, _, raw = out.request(
            "POST", url, to_json(params), {"Content-Type": "application/json"}, timeout
        )
    finally:
        if outbound is None:
            out.close()
    try:
        answer = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise UpstreamError(f"Telegram {method}: HTTP {status}, not JSON") from None
    if not isinstance(answer, dict) or answer.get("ok") is not True:
        answer = answer if isinstance(answer, dict) else {}
        wait = (answer.get("parameters") or {}).get("retry_after") or 0
        raise TelegramError(
            f"Telegram {method}: " + _printable(answer.get("description") or f"HTTP {status}", 200),
            int(answer.get("error_code") or status),
            float(wait) if isinstance(wait, (int, float)) else 0.0,
        )
    return answer.get("result")


@channel_provider(
    "telegram",
    (
        ConfigField("botToken", "string", True, True, "the token BotFather gave you"),
        ConfigField("allowedChatIds", "list", help="chat ids that may talk to the bot"),
        ConfigField(
            "mode",
            "choice",
            help="polling: the server asks Telegram for updates (no public URL needed); "
            "webhook: Telegram calls webhookUrl (setWebhook is done for you)",
            choices=("polling", "webhook"),
        ),
        _SAVE_TO,
        _NOTIFY,
    ),
    allow="allowedChatIds",
    description="a Telegram bot (getUpdates long polling or a webhook; sendMessage)",
    secret_header="X-Telegram-Bot-Api-Secret-Token",  # noqa: S106 - a header name
)
def parse_telegram(update: dict) -> list:
    msg = update.get("message") or update.get("edited_message") or update.get("channel_post")
    if not isinstance(msg, dict) or not isinstance(msg.get("chat"), dict):
        return []
    text = msg.get("text")
    if not isinstance(text, str):
        text = msg.get("caption")
    person = msg.get("from") if isinstance(msg.get("from"), dict) else msg["chat"]
    name = person.get("first_name") or person.get("username") or msg["chat"].get("title") or ""
    return [
        (
            str(msg["chat"].get("id", "")),
            text if isinstance(text, str) else None,
            name if isinstance(name, str) else "",
            _telegram_media(msg),
        )
    ]


def _telegram_media(msg: dict) -> list:
    """Return the files of a Telegram message: the largest photo size, voice, audio..."""
    found = []
    sizes = [p for p in _dicts(msg.get("photo")) if isinstance(p.get("file_id"), str)]
    if sizes:

        def area(p: dict) -> int:
            w, h = p.get("width"), p.get("height")
            return w * h if isinstance(w, int) and isinstance(h, int) else 0

        best = max(sizes, key=area)
        found.append({"kind": "photo", "id": best["file_id"], "mime": "image/jpeg", "name": ""})
        found[-1]["size"] = best.get("file_size")
    for kind in TELEGRAM_MEDIA:
        item = msg.get(kind)
        if isinstance(item, dict) and isinstance(item.get("file_id"), str):
            found.append(
                {
                    "kind": kind,
                    "id": item["file_id"],
                    "mime": str(item.get("mime_type") or ""),
                    "name": str(item.get("file_name") or ""),
                    "size": item.get("file_size"),
                }
            )
    return found


@channel_sender("telegram")
def send_telegram(svc: Service, config: dict, chat_id: str, text: str) -> None:
    base = svc.config.telegram_api_base
    url = f"{base}/bot{config['botToken']}/sendMessage"
    answer = post_json(url, {"chat_id": chat_id, "text": text[:REPLY_LIMIT]}, timeout=15)
    if answer.get("ok") is not True:
        raise UpstreamError(f"Telegram refused: {str(answer.get('description'))[:100]}")


@channel_poller("telegram")
def poll_telegram(svc: Service, config: dict, offset: int, wait: float, outbound) -> list:
    """getUpdates with a long-poll time-out; a webhook still set is deleted first (409)."""
    params: dict = {"timeout": int(wait), "allowed_updates": TELEGRAM_UPDATES}
    if offset:
        params["offset"] = offset
    try:
        updates = telegram_call(svc, config, "getUpdates", params, wait + 15, outbound)
    except TelegramError as e:
        if e.code != 409 or "webhook" not in str(e).lower():
            raise  # 409 "terminated by other getUpdates request": another poller, backoff
        log.info("telegram: a webhook was set for this bot; deleting it to poll instead")
        telegram_call(svc, config, "deleteWebhook", {"drop_pending_updates": False}, 15, outbound)
        return []
    batch = [u for u in updates or [] if isinstance(u, dict) and type(u.get("update_id")) is int]
    return [(u["update_id"] + 1, u) for u in sorted(batch, key=lambda u: u["update_id"])]


@channel_fetcher("telegram")
def fetch_telegram(svc: Service, config: dict, media: dict, write: Callable, limit: int) -> None:
    """getFile, then the file's bytes from {base}/file/bot<token>/<file_path>."""
    info = telegram_call(svc, config, "getFile", {"file_id": media["id"]})
    path = info.get("file_path") if isinstance(info, dict) else None
    if not isinstance(path, str) or not path or ".." in path.split("/"):
        raise UpstreamError("Telegram gave no file to download (files over 20 MB are not served)")
    size = info.get("file_size")
    if isinstance(size, int) and size > limit:
        raise UpstreamError(f"the file is over {limit} bytes (SERVICE_MAX_ATTACHMENT_BYTES)")
    url = f"{svc.config.telegram_api_base}/file/bot{config['botToken']}/{urllib.parse.quote(path)}"
    with Outbound() as out:
        status, _, _ = out.request("GET", url, timeout=120, limit=limit, sink=write)
    if status != 200:
        raise UpstreamError(f"the download answered HTTP {status}")


@channel_configurer("telegram")
def configure_telegram(svc: Service, channel: dict) -> str | None:
    """Webhook mode: setWebhook to the channel's URL with its secret as secret_token.

    Polling mode needs nothing here: the poller deletes a webhook it finds in its way.
    """
    if channel_mode(channel) != "webhook":
        return None
    params = {
        "url": channel["webhookUrl"],
        "secret_token": channel["secret"],
        "allowed_updates": TELEGRAM_UPDATES,
        "drop_pending_updates": False,
    }
    telegram_call(svc, channel["config"], "setWebhook", params)
    return "webhook set"


@channel_provider(
    "whatsapp",
    (
        ConfigField("accessToken", "string", True, True, "Cloud API access token"),
        ConfigField("phoneNumberId", "string", True, help="the sending phone number id"),
        ConfigField("verifyToken", "string", True, True, "what Meta sends to verify the hook"),
        ConfigField(
            "appSecret",
            "string",
            secret=True,
            help="the Meta app's secret: every call must carry its X-Hub-Signature-256",
        ),
        ConfigField("allowedNumbers", "list", help="phone numbers (wa_id) that may write"),
        _SAVE_TO,
        _NOTIFY,
    ),
    allow="allowedNumbers",
    description="WhatsApp Cloud API (webhook + /messages)",
    signature_header="X-Hub-Signature-256",
    signing_field="appSecret",
)
def parse_whatsapp(payload: dict) -> list:
    out = []
    for entry in _dicts(payload.get("entry")):
        for change in _dicts(entry.get("changes")):
            value = change.get("value")
            if not isinstance(value, dict):
                continue
            names = {
                str(c.get("wa_id", "")): c["profile"].get("name")
                for c in _dicts(value.get("contacts"))
                if isinstance(c.get("profile"), dict)
            }
            for msg in _dicts(value.get("messages")):
                kind = msg.get("type")
                body = (
                    msg.get("text", {}).get("body") if isinstance(msg.get("text"), dict) else None
                )
                text = body if kind == "text" and isinstance(body, str) else None
                media = []
                item = msg.get(kind) if kind in ("image", "audio", "document", "video") else None
                if isinstance(item, dict) and isinstance(item.get("id"), str):
                    caption = item.get("caption")
                    text = caption if isinstance(caption, str) else None
                    voice = kind == "audio" and item.get("voice") is True
                    media.append(
                        {
                            "kind": "voice" if voice else kind,
                            "id": item["id"],
                            "mime": str(item.get("mime_type") or "").split(";")[0].strip(),
                            "name": str(item.get("filename") or ""),
                        }
                    )
                sender = str(msg.get("from", ""))
                name = names.get(sender)
                out.append((sender, text, name if isinstance(name, str) else "", media))
    return out


def _dicts(value: Any) -> list:
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


@channel_sender("whatsapp")
def send_whatsapp(svc: Service, config: dict, number: str, text: str) -> None:
    url = f"{svc.config.whatsapp_api_base}/{config['phoneNumberId']}/messages"
    body = {
        "messaging_product": "whatsapp",
        "recipient_type": "individual",
        "to": number,
        "type": "text",
        "text": {"body": text[:REPLY_LIMIT]},
    }
    answer = post_json(url, body, {"Authorization": f"Bearer {config['accessToken']}"}, 15)
    if not answer.get("messages"):
        raise UpstreamError("WhatsApp did not accept the message")


@channel_fetcher("whatsapp")
def fetch_whatsapp(svc: Service, config: dict, media: dict, write: Callable, limit: int) -> None:
    """The media id's URL from the Graph API, then its bytes, both with the bearer token.

    The token goes only to an https URL or to the configured API's own origin.
    """
    base = svc.config.whatsapp_api_base
    auth = {"Authorization": f"Bearer {config['accessToken']}"}
    with Outbound() as out:
        url = f"{base}/{urllib.parse.quote(media['id'], safe='')}"
        status, _, raw = out.request("GET", url, headers=auth, timeout=15)
        try:
            info = json.loads(raw.decode("utf-8")) if status == 200 else None
        except (UnicodeDecodeError, ValueError):
            info = None
        link = info.get("url") if isinstance(info, dict) else None
        if not isinstance(link, str):
            raise UpstreamError(f"WhatsApp gave no media URL (HTTP {status})")
        size = info.get("file_size")
        if isinstance(size, int) and size > limit:
            raise UpstreamError(f"the file is over {limit} bytes (SERVICE_MAX_ATTACHMENT_BYTES)")
        own = urllib.parse.urlsplit(base)
        there = urllib.parse.urlsplit(link)
        if there.scheme != "https" and (there.scheme, there.netloc) != (own.scheme, own.netloc):
            raise UpstreamError("WhatsApp's media URL is not https")
        if isinstance(info.get("mime_type"), str) and not media.get("mime"):
            media["mime"] = info["mime_type"]
        status, _, _ = out.request("GET", link, headers=auth, timeout=120, limit=limit, sink=write)
    if status != 200:
        raise UpstreamError(f"the download answered HTTP {status}")


@channel_verifier("whatsapp", params=("hub.mode", "hub.verify_token", "hub.challenge"))
def verify_whatsapp(svc: Service) -> str:
    """Answer Meta's subscription check with hub.challenge when hub.verify_token matches."""
    addr = svc.client_addr(bottle.request.environ)
    mode, token = query_str("hub.mode"), query_str("hub.verify_token")
    if token:
        svc.check_lockout(addr)
    challenge = query_str("hub.challenge")
    mine = [c["config"] for c in _channels(svc) if c["provider"] == "whatsapp" and c["enabled"]]
    if mode != "subscribe" or not token or not _match_secret(mine, "verifyToken", token):
        if token:
            svc.lockout.fail(addr)
        raise ApiError(403, "FORBIDDEN", "hub.verify_token does not match a WhatsApp channel")
    bottle.response.content_type = "text/plain; charset=utf-8"
    return challenge[:200]


@channel_provider(
    "web",
    (
        ConfigField("allowedSenders", "list", help="sender names that may write (empty: any)"),
        _SAVE_TO,
    ),
    allow="allowedSenders",
    description="a web page or script: POST {text, sender}; the reply comes back inline",
)
def parse_web(payload: dict) -> list:
    text = payload.get("text")
    sender = payload.get("sender", "web")
    return [(str(sender)[:100], text if isinstance(text, str) else None)]


def redact_channel(channel: dict, providers: Mapping[str, ChannelProvider]) -> dict:
    """Return a channel record with its secret and secret config fields redacted."""
    provider = providers.get(channel["provider"])
    secret_fields = {f.name for f in provider.fields if f.secret} if provider else set()
    config = {
        k: (redact(v) if k in secret_fields and v else v) for k, v in channel["config"].items()
    }
    shown = {k: v for k, v in channel.items() if k != "refusedSenders"}  # GET /channels/:id
    if "binding" in shown:  # its code is never shown again: only until when it lives
        shown["binding"] = {"until": shown["binding"].get("until")}
    return {**shown, "secret": redact(channel["secret"]), "config": config}


# -- the channel pipeline: secret, lockout, parse, allowlist, command or agent, delivery --


def channel_secret(svc: Service, provider: ChannelProvider, environ: dict) -> str:
    """Return the channel secret a webhook call presents (header, the provider's, ?secret=)."""
    presented = environ.get("HTTP_X_SERVICE_CHANNEL_SECRET", "")
    if not presented and provider.secret_header:
        presented = environ.get("HTTP_" + provider.secret_header.upper().replace("-", "_"), "")
    if not presented and query_str("secret"):
        presented = query_str("secret")
        svc.query_secret_seen_at = time.time()  # the audit reports secrets in URLs
    return presented


def handle_channel_update(
    svc: Service,
    prov: ChannelProvider,
    presented: str,
    addr: str,
    payload: Callable,
    signature: str = "",
    raw: Callable | None = None,
) -> dict:
    """Run one inbound webhook update through the pipeline; return what the webhook answers.

    payload() reads the update's JSON only once the secret has been checked; raw() gives
    the body's bytes for a provider that signs its calls (signature: its header's value).
    """
    channel = _authenticate_channel(svc, prov, presented, addr, signature, raw)
    return process_update(svc, channel, prov, payload())


def _authenticate_channel(
    svc: Service,
    prov: ChannelProvider,
    presented: str,
    addr: str,
    signature: str = "",
    raw: Callable | None = None,
) -> dict:
    """Return the enabled channel whose secret (or signature) was presented; 401, 403 or
    429 otherwise.

    A channel with a signing key (WhatsApp's appSecret) needs a valid signature of the
    raw body as well as, or instead of, its secret: Meta signs every call but cannot send
    the secret in a header.
    """
    signed = bool(signature and prov.signing_field and raw is not None)
    if presented or signed:  # only a presented credential counts toward (or meets) the lockout
        svc.check_lockout(addr)
    mine = [c for c in _channels(svc) if c["provider"] == prov.name]
    channel = _match_secret(mine, "secret", presented) if presented else None
    key = prov.signing_field
    if channel is not None and key and channel["config"].get(key):
        if not signed or _signed_by(signature, raw(), [channel], key) is None:
            channel = None  # its secret alone is not enough
    elif channel is None and signed and not presented:
        channel = _signed_by(signature, raw(), mine, key)
    if channel is None:
        if presented or signed:
            svc.lockout.fail(addr)
        raise ApiError(401, "UNAUTHORIZED", "missing or wrong channel secret or signature")
    svc.lockout.succeed(addr)
    if not channel["enabled"]:
        raise ApiError(403, "CHANNEL_DISABLED", f"channel {channel['id']} is switched off")
    return channel


def _signed_by(signature: str, body: bytes, channels: list, key: str) -> dict | None:
    """Return the channel whose key signed body ("sha256=<hex HMAC>"); every one is compared."""
    found = None
    presented = signature.strip().encode("latin-1", "replace")
    for channel in channels:
        secret = str(channel["config"].get(key) or "")
        if not secret:
            continue
        digest = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
        if hmac.compare_digest(f"sha256={digest}".encode(), presented):
            found = channel
    return found


def _deliver(svc: Service, channel: dict, prov: ChannelProvider, sender: str, reply: str):
    if prov.send is None:  # the reply goes back in the webhook's answer
        return {"handled": True, "reply": reply, "delivered": True}
    try:
        prov.send(svc, channel["config"], sender, reply)
        delivered = True
    except UpstreamError as e:
        log.warning("channel %s: delivering the reply failed: %s", channel["id"], e)
        delivered = False
    return {"handled": True, "delivered": delivered}


REFUSED_KEPT = 10  # refused senders remembered per channel (GET /channels/:id)
BIND_SECONDS = 600  # a bind code connects the first chat that sends it within this
BOUND_TEXT = (
    "Connected: what you send here goes to your notes. /save <text> keeps it in today's "
    "note; /help lists the rest."
)


def new_binding() -> tuple:
    """Return (a bind code to send to the bot, the record kept of it: its hash, its time)."""
    code = base64.b32encode(secrets.token_bytes(10)).decode("ascii").lower()[:12]
    return code, {"codeHash": key_hash(code), "until": iso(time.time() + BIND_SECONDS)}


def binds(binding: dict, text: str) -> bool:
    """Return whether a message is the binding's live code (alone, or after /start as a
    t.me/<bot>?start=<code> link sends it)."""
    m = re.fullmatch(r"\s*(?:/start(?:@\w+)?\s+)?([a-z2-7]{12})\s*", text or "", re.I)
    return (
        m is not None
        and _epoch(binding.get("until")) > time.time()
        and hmac.compare_digest(key_hash(m.group(1).lower()), binding.get("codeHash", ""))
    )


def bind_chat(svc: Service, channel: dict, prov: ChannelProvider, sender: str, name: str):
    """Make the chat that sent the bind code the channel's only allowed one (the code is
    used up: a second chat sending it is a refused sender)."""
    bound = {"id": _printable(sender), "name": _printable(name or ""), "at": iso(utcnow())}

    def apply(channels: list, i: int) -> None:
        channels[i].pop("binding", None)
        channels[i]["config"][prov.allow] = [bound["id"]]
        channels[i]["boundChat"] = bound

    _change_channel(svc, channel["id"], apply)
    log.info("channel %s: bound to chat %s", channel["id"], bound["id"])


def refuse_sender(svc: Service, channel: dict, prov: ChannelProvider, sender, name) -> None:
    """Log and remember a sender the allowlist refused (never the message text)."""
    sender, name = _printable(sender), _printable(name or "")
    log.info(
        "channel %s: refused sender %s%s — add it to config.%s to allow",
        channel["id"],
        sender,
        f" ({name})" if name else "",
        prov.allow,
    )
    entry = {"sender": sender, "name": name, "at": iso(utcnow())}

    def remember(channels: list, i: int) -> None:
        kept = [r for r in channels[i].get("refusedSenders", []) if r.get("sender") != sender]
        channels[i]["refusedSenders"] = [*kept, entry][-REFUSED_KEPT:]

    with contextlib.suppress(ApiError):  # the channel was deleted meanwhile
        _change_channel(svc, channel["id"], remember)


_COMMAND_RE = re.compile(r"^/([A-Za-z]\w{0,31})(?:@\w+)?(?:\s+(.*))?$", re.S)
HELP_TEXT = (
    "/save <text> — keep it in today's note\n"
    "/search <words> — find notes\n"
    "/ask <question> — ask the agent (any other text does the same)\n"
    "/today — today's note\n"
    "Send a photo, a voice message or a file to keep it in today's note; "
    "a line with ⏰ YYYY-MM-DD HH:MM in any note reminds you then."
)


def run_command(svc: Service, text: str, channel: dict | None = None) -> str:
    """Return the reply to a channel message: /save, /search, /ask, /today, /help, or a
    question for the agent."""
    m = _COMMAND_RE.match(text)
    command, arg = (m.group(1).lower(), (m.group(2) or "").strip()) if m else (None, text)
    channel = channel or {}
    if command == "save":
        if not arg:
            return "Usage: /save <text to keep>"
        now = local_now(svc)
        path, heading = capture_note(svc, channel, now)
        svc.notes.append(path, f"- {now:%H:%M} {arg}", heading)
        return f"Saved to {path}."
    if command == "search":
        if not arg:
            return "Usage: /search <words>"
        try:
            total, hits = svc.index.search(Query(arg), "", 5, 0)
        except ApiError as e:
            return f"Search: {e.message}"
        if not total:
            return f"No note matches “{_clip(arg, 80)}”."
        lines = [f"{total} note{'s' if total != 1 else ''} match; the best:"]
        lines += [f"• {title} — {path}" for path, title, _, _ in hits]
        return "\n".join(lines)
    if command == "today":
        path, _ = capture_note(svc, channel, local_now(svc))
        try:
            content = svc.notes.get(path)["content"]
        except ApiError:
            return f"Nothing in {path} yet."
        return _clip(f"{path}\n\n{content.strip()}", REPLY_LIMIT)
    if command in ("help", "start"):
        return HELP_TEXT
    if command == "ask":
        if not arg:
            return "Usage: /ask <question>"
    elif command is not None:
        return f"Unknown command /{command}.\n{HELP_TEXT}"
    try:
        return ask_agent(svc, arg)["reply"]
    except ApiError as e:
        if e.code == "AGENT_DISABLED":
            return "The agent is off on this server; try /search <words>."
        return f"The agent could not answer ({e.message}); try /search <words>."


def process_update(svc: Service, channel: dict, prov: ChannelProvider, update: dict) -> dict:
    """Handle one authenticated update (from a webhook or a poller): parse, allowlist, then
    a capture (photos, voice, files), a command or the agent, and deliver the reply."""
    messages = []
    for m in prov.parse(update):
        text = m[1] if isinstance(m[1], str) else ""
        media = list(m[3]) if len(m) > 3 and m[3] else []
        if text or media:
            messages.append((m[0], text, m[2] if len(m) > 2 else "", media))
    if not messages:
        return {"handled": False, "reason": "the update holds no text message"}
    allowed = channel["config"].get(prov.allow) if prov.allow else None
    binding = channel.get("binding")  # a code waits for the chat it connects
    results = []
    for sender, text, name, media in messages[:5]:
        if binding and binds(binding, text):
            bind_chat(svc, channel, prov, sender, name)
            results.append(_deliver(svc, channel, prov, sender, BOUND_TEXT))
            binding = allowed = None
            continue
        if (binding and not allowed) or (allowed and sender not in allowed):
            refuse_sender(svc, channel, prov, sender, name)
            results.append({"handled": False, "reason": "sender not allowed"})
            continue
        if media:
            reply = capture_media(svc, channel, prov, media, text)
        else:
            reply = run_command(svc, text.strip(), channel)
        results.append(_deliver(svc, channel, prov, sender, reply))
    if len(results) == 1:
        return results[0]
    return {"handled": any(r["handled"] for r in results), "results": results}


def set_channel_status(svc: Service, channel_id: str, ok: bool, error: str = "") -> dict | None:
    """Record the outcome of the last call to the channel's provider as its `status`."""
    status: dict = {"ok": ok, "at": iso(utcnow())}
    if error:
        status["error"] = _printable(error, 300)

    def record(channels: list, i: int) -> dict:
        channels[i]["status"] = status
        return channels[i]

    try:
        return _change_channel(svc, channel_id, record)
    except ApiError:  # deleted meanwhile
        return None


def configure_channel(svc: Service, channel: dict) -> dict:
    """Run the provider's side of a create or PATCH (Telegram's setWebhook); return the
    channel as stored. A failure never fails the request: it is logged and shown as the
    channel's `status: {ok: false, error, at}`."""
    prov = svc.channel_providers.get(channel["provider"])
    if prov is None or prov.configure is None:
        return channel
    try:
        done = prov.configure(svc, channel)
    except UpstreamError as e:
        log.warning("channel %s: %s", channel["id"], e)
        return set_channel_status(svc, channel["id"], False, str(e)) or channel
    if done is None:
        return channel
    log.info("channel %s: %s", channel["id"], done)
    return set_channel_status(svc, channel["id"], True) or channel


# -- captures: /save, photos, voice and files into the day's note --------------------

TRANSCRIBE_TIMEOUT = 120.0
CAPTURE_LABELS = {
    "photo": "photo",
    "image": "photo",
    "voice": "voice message",
    "audio": "audio",
    "video": "video",
    "video_note": "video message",
    "document": "file",
}
# The extension a file is stored with when its name does not say: by type, then by kind.
EXTENSION_OF_TYPE: dict = {}
for _ext, _type in ATTACHMENT_TYPES.items():
    EXTENSION_OF_TYPE.setdefault(_type, _ext)
EXTENSION_OF_TYPE.update({"audio/opus": "ogg", "audio/x-m4a": "m4a", "image/jpg": "jpg"})
EXTENSION_OF_KIND = {"photo": "jpg", "image": "jpg", "voice": "ogg", "video_note": "mp4"}


def capture_note(svc: Service, channel: dict, now: dt.datetime) -> tuple:
    """Return (path, heading) of the note a channel's captures go to today: the daily
    note, or a note per day in the channel's saveTo folder."""
    folder = channel.get("config", {}).get("saveTo") or DAILY_FOLDER
    return day_note(now.date(), folder)


def local_now(svc: Service) -> dt.datetime:
    """Return the wall-clock time now in SERVICE_TIMEZONE (naive)."""
    return local_time(time.time(), time_zone(svc.config.timezone))


def _one_line(text: str, limit: int = 1000) -> str:
    return _clip(" ".join(text.split()), limit)


def _media_extension(media: dict) -> str | None:
    """Return the allowed extension to store a media item with, None when none fits."""
    name = media.get("name") or ""
    ext = name.rpartition(".")[2].lower() if "." in name else ""
    if ext in ATTACHMENT_TYPES:
        return ext
    mime = (media.get("mime") or "").split(";")[0].strip().lower()
    if name and "." in name and not EXTENSION_OF_TYPE.get(mime):
        return None  # a named file of a type not on the list (an .exe, say)
    return EXTENSION_OF_TYPE.get(mime) or EXTENSION_OF_KIND.get(media.get("kind", ""))


def _safe_stem(media: dict) -> str:
    kind = {"image": "photo"}.get(media.get("kind", ""), media.get("kind"))
    stem = (media.get("name") or "").rpartition(".")[0] or kind or "file"
    stem = re.sub(r"[^\w-]+", "-", unicodedata.normalize("NFC", stem)).strip("-_")
    return stem[:60] or "file"


def capture_media(svc: Service, channel: dict, prov: ChannelProvider, media: list, caption: str):
    """Store each file of a message as an attachment under attachments/inbox/<date>/, link
    it from the day's note with the caption (and a voice message's transcript); return the
    reply for the sender."""
    if prov.fetch is None:
        return "This channel cannot fetch files."
    now = local_now(svc)
    note, heading = capture_note(svc, channel, now)
    lines, saved, problems = [], [], []
    for i, item in enumerate(media[:10]):
        label = CAPTURE_LABELS.get(item.get("kind", ""), "file")
        try:
            entry, transcript = _capture_one(svc, channel, prov, item, note, now)
        except (UpstreamError, ApiError) as e:
            reason = e.message if isinstance(e, ApiError) else str(e)
            log.warning("channel %s: a %s was not saved: %s", channel["id"], label, reason)
            problems.append(f"The {label} was not saved: {reason}.")
            continue
        text = _one_line(caption) if caption and i == 0 else ""
        lines.append(f"- {now:%H:%M} {entry}" + (f" {text}" if text else ""))
        if transcript is not None:
            lines.append(f"  > {transcript}" if transcript else "  > (nothing was heard)")
        saved.append((label, transcript))
    if lines:
        svc.notes.append(note, "\n".join(lines), heading)
    replies = []
    for label, transcript in saved:
        said = f": “{_clip(transcript, 300)}”" if transcript else ""
        replies.append(f"Saved the {label} to {note}{said}.")
    unheard = [label for label, t in saved if t is None and label in ("voice message", "audio")]
    if unheard and not svc.config.transcribe_url:
        replies.append("(Not transcribed: SERVICE_TRANSCRIBE_URL is not set.)")
    return " ".join(replies + problems) or "Nothing was saved."


def _capture_one(svc: Service, channel: dict, prov: ChannelProvider, item, note, now) -> tuple:
    """Fetch one media item into an attachment; return (Markdown link, transcript or None)."""
    ext = _media_extension(item)
    if ext is None:
        raise UpstreamError("files of its type are not accepted as attachments")
    limit = svc.config.max_attachment_bytes
    size = item.get("size")
    if isinstance(size, int) and size > limit:
        raise UpstreamError(f"the file is over {limit} bytes (SERVICE_MAX_ATTACHMENT_BYTES)")
    stem = _safe_stem(item)
    path = attachment_path(f"{ATTACHMENTS}/inbox/{now:%Y-%m-%d}/{now:%H%M%S}-{stem}.{ext}")

    def download(f) -> None:
        prov.fetch(svc, channel["config"], item, f.write, limit)

    rec, _ = svc.attachments.place(svc.attachments.spool(download), path, unique=True)
    href = urllib.parse.quote(posixpath.relpath(rec["path"], posixpath.dirname(note)), safe="/")
    label = CAPTURE_LABELS.get(item.get("kind", ""), "file")
    if rec["contentType"].startswith("image/"):
        entry = f"![{label}]({href})"
    else:
        text = _one_line(item.get("name") or label, 100).replace("[", "(").replace("]", ")")
        entry = f"[{text}]({href})"
    transcript = None
    if item.get("kind") in ("voice", "audio") and svc.config.transcribe_url:
        try:
            transcript = _one_line(transcribe(svc, rec["path"]), 4000)
        except UpstreamError as e:
            log.warning("channel %s: transcription failed: %s", channel["id"], e)
            entry += f" (transcription failed: {e})"
    elif item.get("kind") in ("voice", "audio"):
        entry += " (not transcribed)"
    return entry, transcript


def transcribe(svc: Service, path: str) -> str:
    """Return the text of an audio attachment from SERVICE_TRANSCRIBE_URL, an OpenAI-
    compatible /audio/transcriptions endpoint (multipart built with the standard library)."""
    cfg = svc.config
    url = cfg.transcribe_url
    tail = (
        ""
        if urllib.parse.urlsplit(url).path.endswith("/audio/transcriptions")
        else ("/audio/transcriptions")
    )
    url, headers = agent_endpoint(url, tail, cfg.transcribe_api_key)
    name = path.rsplit("/", 1)[-1]
    stem, _, ext = name.rpartition(".")
    ext = {"oga": "ogg", "opus": "ogg"}.get(ext.lower(), ext.lower())  # names the API knows
    boundary = "notesvc-" + secrets.token_hex(12)
    fields = {"model": cfg.transcribe_model, "response_format": "json"}
    head = b"".join(
        f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
        for k, v in fields.items()
    )
    head += (
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
        f'filename="{stem[:60] or "audio"}.{ext}"\r\nContent-Type: {content_type_of(path)}\r\n\r\n'
    ).encode()
    tail_bytes = f"\r\n--{boundary}--\r\n".encode()
    f, st = svc.attachments.open(path)
    with f:

        def body():
            yield head
            while chunk := f.read(BODY_CHUNK):
                yield chunk
            yield tail_bytes

        headers.update(
            {
                "Content-Type": f"multipart/form-data; boundary={boundary}",
                "Content-Length": str(len(head) + st.st_size + len(tail_bytes)),
            }
        )
        with Outbound() as out:
            status, _, raw = out.request("POST", url, body(), headers, TRANSCRIBE_TIMEOUT)
    if status != 200:
        raise UpstreamError(f"the transcription service answered HTTP {status}")
    try:
        answer = json.loads(raw.decode("utf-8"))
        text = answer["text"]
    except (UnicodeDecodeError, ValueError, KeyError, TypeError):
        raise UpstreamError("the transcription answer had no text") from None
    if not isinstance(text, str):
        raise UpstreamError("the transcription answer had no text")
    return text.strip()


# -- polling: channels that fetch their own updates ------------------------------------

POLL_WAIT = 25.0  # seconds the provider holds a long poll open (Telegram allows up to 50)
POLL_BACKOFF = 60.0  # longest pause after failures in a row
POLL_REFUSED_PAUSE = 300.0  # after the provider refused the credentials


def _channel(svc: Service, channel_id: str) -> dict | None:
    return next((c for c in _channels(svc) if c["id"] == channel_id), None)


class ChannelPollers:
    """A thread per enabled channel in polling mode (a provider with a poller and
    config.mode "polling"): for Telegram, getUpdates with a long-poll time-out, so a server
    behind NAT needs nothing exposed.

    Each channel's offset is recorded in <state>/channel-offsets.json after every update
    it handled: no update is handled twice or lost across restarts (only a crash in the
    instant between handling one and recording it hands that one over again). sync(),
    called after every change of the channels, starts and stops the threads; close()
    stops them all at once (a long poll in flight is aborted).
    """

    def __init__(self, svc: Service, wait: float = POLL_WAIT):
        self.svc, self.wait = svc, wait
        self.path = svc.config.state_dir / "channel-offsets.json"
        self._pollers: dict = {}  # channel id -> ChannelPoller
        self._offsets: dict | None = None
        self._lock = threading.Lock()
        self._offsets_lock = threading.Lock()
        self._closed = False

    def start(self) -> None:
        self.sync()

    def sync(self) -> None:
        """Run a poller for each enabled polling channel and for none other."""
        svc = self.svc
        if svc.readonly:
            return
        wanted = {}
        for c in _channels(svc):
            prov = svc.channel_providers.get(c["provider"])
            if prov and prov.poll and c["enabled"] and channel_mode(c) == "polling":
                secret = {f.name for f in prov.fields if f.secret}
                key = {k: v for k, v in c["config"].items() if k in secret or k == "mode"}
                wanted[c["id"]] = (prov, json.dumps(key, sort_keys=True))
        with self._lock:
            if self._closed:
                return
            for cid, poller in list(self._pollers.items()):
                if cid not in wanted or wanted[cid][1] != poller.signature:
                    poller.stop()
                    del self._pollers[cid]
                    if cid in wanted:  # its credentials changed: the new one waits for it
                        prov, sig = wanted[cid]
                        self._pollers[cid] = ChannelPoller(self, cid, prov, sig, poller).start()
            for cid, (prov, sig) in wanted.items():
                if cid not in self._pollers:
                    self._pollers[cid] = ChannelPoller(self, cid, prov, sig).start()
        known = {c["id"] for c in _channels(svc)}
        with self._offsets_lock:  # a deleted channel's offset goes with it
            offsets = self._read_offsets()
            if any(cid not in known for cid in offsets):
                self._offsets = {k: v for k, v in offsets.items() if k in known}
                self._write_offsets()

    def running(self) -> list:
        """Return the ids of the channels being polled."""
        with self._lock:
            return sorted(cid for cid, p in self._pollers.items() if p.thread.is_alive())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pollers, self._pollers = list(self._pollers.values()), {}
        for poller in pollers:
            poller.stop()
        for poller in pollers:
            poller.thread.join(15)

    # -- offsets -------------------------------------------------------------------

    def _read_offsets(self) -> dict:
        if self._offsets is None:
            try:
                loaded = json.loads(self.path.read_text("utf-8"))
            except (OSError, ValueError):
                loaded = {}
            self._offsets = {
                k: v
                for k, v in (loaded if isinstance(loaded, dict) else {}).items()
                if type(v) is int
            }
        return self._offsets

    def offset(self, channel_id: str) -> int:
        with self._offsets_lock:
            return self._read_offsets().get(channel_id, 0)

    def set_offset(self, channel_id: str, value: int) -> None:
        with self._offsets_lock:
            self._read_offsets()[channel_id] = value
            self._write_offsets()

    def _write_offsets(self) -> None:
        try:
            atomic_write(self.path, json.dumps(self._offsets).encode("utf-8"), mode=0o600)
        except OSError as e:  # the update was handled; a full disk must not stop polling
            log.warning("could not record the channels' offsets: %s", e)


class ChannelPoller:
    """One channel's polling thread (see ChannelPollers)."""

    def __init__(self, owner: ChannelPollers, channel_id: str, prov, signature: str, after=None):
        self.owner, self.channel_id, self.prov = owner, channel_id, prov
        self.signature, self.after = signature, after
        self.stopping = threading.Event()
        self.outbound = Outbound()
        self.failing = False
        self.thread = threading.Thread(
            target=self._run, name=f"notesvc-poll-{channel_id}", daemon=True
        )

    def start(self) -> ChannelPoller:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.outbound.abort()

    def _run(self) -> None:
        if self.after is not None:  # the same channel's previous poller finishes first
            self.after.thread.join()
        svc, backoff = self.owner.svc, 0.0
        try:
            while not self.stopping.is_set():
                channel = _channel(svc, self.channel_id)
                if channel is None or not channel["enabled"]:
                    return
                try:
                    batch = self.prov.poll(
                        svc,
                        channel["config"],
                        self.owner.offset(self.channel_id),
                        self.owner.wait,
                        self.outbound,
                    )
                except Exception as e:  # a poller keeps polling, whatever failed
                    if self.stopping.is_set():
                        return
                    backoff = self._failed(e, backoff)
                    self.stopping.wait(backoff)
                    continue
                backoff = 0.0
                if self.failing:
                    self.failing = False
                    log.info("channel %s: polling works again", self.channel_id)
                    set_channel_status(svc, self.channel_id, True)
                self._handle(batch)
        finally:
            self.outbound.close()

    def _handle(self, batch: list) -> None:
        svc = self.owner.svc
        for next_offset, update in batch:
            if self.stopping.is_set():
                return  # not recorded: handed over again at the next start
            channel = _channel(svc, self.channel_id)
            if channel is None or not channel["enabled"]:
                return
            try:
                process_update(svc, channel, self.prov, update)
            except Exception:  # one bad update must not stop the channel
                log.exception("channel %s: an update could not be handled", self.channel_id)
            self.owner.set_offset(self.channel_id, next_offset)

    def _failed(self, e: Exception, backoff: float) -> float:
        """Log and record a failure; return the pause before the next try."""
        if isinstance(e, UpstreamError):
            reason = str(e)
        else:
            reason = type(e).__name__
            log.exception("channel %s: polling failed", self.channel_id)
        refused = isinstance(e, TelegramError) and e.code in (401, 403, 404)
        pause = min(POLL_BACKOFF, max(1.0, backoff * 2))
        if refused:
            pause = POLL_REFUSED_PAUSE
        elif isinstance(e, TelegramError) and e.retry_after:
            pause = min(POLL_REFUSED_PAUSE, e.retry_after)
        if not self.failing:
            self.failing = True
            log.warning("channel %s: polling failed: %s; retrying", self.channel_id, reason)
            set_channel_status(self.owner.svc, self.channel_id, False, reason)
        return pause


# -- reminders: ⏰ lines sent through the channels ------------------------------------

REMINDER_RE = re.compile(
    r"⏰\ufe0f?[ \t]*(\d{4})-(\d{2})-(\d{2})[ \tT]+([01]?\d|2[0-3]):([0-5]\d)(?!\d)"
)
_REMIND_FIELD_RE = re.compile(
    r"^remind:[ \t]*[\"']?(\d{4})-(\d{2})-(\d{2})[ \tT]+([01]?\d|2[0-3]):([0-5]\d)", re.M
)
REMINDER_GRACE = 60.0  # seconds: a reminder first seen this soon after its time still fires
REMINDER_RETRY = 60.0  # seconds between tries while no channel took a reminder
REMINDER_ATTEMPTS = 5


def note_reminders(path: str, title: str, text: str, zone: dt.tzinfo | None) -> list:
    """Return the reminders of a note: lines with ⏰ YYYY-MM-DD HH:MM, and `remind:` in its
    front matter; each {id, path, title, line, wall, due} (due: a timestamp in `zone`).

    >>> [r["wall"] for r in note_reminders("notes/a.md", "A", "- ⏰ 2026-12-01 09:00", None)]
    ['2026-12-01 09:00']
    """
    text = text[:MAX_SCAN_CHARS]
    matches = list(REMINDER_RE.finditer(text))
    if text.startswith("---"):
        end = text.find("\n---", 3)
        if end > 0:
            matches += _REMIND_FIELD_RE.finditer(text, 0, end)
    found = []
    for m in matches:
        start = text.rfind("\n", 0, m.start()) + 1
        stop = text.find("\n", m.end())
        line = _one_line(text[start : stop if stop >= 0 else len(text)], 300)
        try:
            wall = dt.datetime(*(int(g) for g in m.groups()))
        except ValueError:  # 2026-02-30
            continue
        text_id = f"{path}\n{wall:%Y-%m-%d %H:%M}\n{line}".encode()
        found.append(
            {
                "id": hashlib.sha256(text_id).hexdigest()[:20],
                "path": path,
                "title": title,
                "line": line,
                "wall": f"{wall:%Y-%m-%d %H:%M}",
                "due": timestamp_of(wall, zone),
            }
        )
    return found


class ReminderScheduler:
    """Reminders written in the notes, sent once through every enabled channel with
    config.notify true (to the senders on its allowlist).

    The notes are read through the index (re-read when a note changes: an edit or a
    delete cancels); what was sent and what was scheduled is kept in
    <state>/reminders.json, so each is sent once across restarts and one that was due
    while the server was down is sent at start, marked late. One first seen after its
    time (written in the past) is not sent. `clock` (a function returning the time, like
    time.time) may be given to test the schedule.
    """

    def __init__(self, svc: Service, clock: Callable[[], float] = time.time):
        self.svc, self.clock = svc, clock
        self.path = svc.config.state_dir / "reminders.json"
        self._tick_lock = threading.Lock()  # one tick at a time (no reminder sent twice)
        self._data_lock = threading.RLock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._generation: Any = None
        self._found: dict = {}  # id -> reminder, from the notes as they are
        self._fired: dict = {}  # id -> when it was sent (persisted)
        self._scheduled: dict = {}  # id -> due, known before it was due (persisted)
        self._tries: dict = {}  # id -> (tries, next try) while no channel took it
        self._loaded = False

    def start(self) -> None:
        self._load()
        self.svc.notes.after.append(self._note_changed)
        self._thread = threading.Thread(target=self._run, name="notesvc-reminders", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(20)

    def _note_changed(self, *event) -> None:
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                wait = self.tick()
            except Exception:
                log.exception("reminders: a check failed; trying again in a minute")
                wait = 60.0
            self._wake.wait(max(0.05, min(wait, 30.0)))  # a rescan's edits: within 30 s

    # -- persistence ------------------------------------------------------------------

    def _load(self) -> None:
        try:
            saved = json.loads(self.path.read_text("utf-8"))
        except (OSError, ValueError):
            saved = {}
        saved = saved if isinstance(saved, dict) else {}
        with self._data_lock:
            self._loaded = True
            self._fired = dict(saved.get("fired") or {})
            self._scheduled = {
                k: v
                for k, v in (saved.get("scheduled") or {}).items()
                if isinstance(v, (int, float))
            }

    def _save(self) -> None:
        data = {"fired": self._fired, "scheduled": self._scheduled}
        try:
            atomic_write(self.path, json.dumps(data).encode("utf-8"), mode=0o600)
        except OSError as e:
            log.warning("could not record the reminders: %s", e)

    # -- the schedule -----------------------------------------------------------------

    def _refresh(self) -> None:
        """Re-read the reminders of the notes when the index changed."""
        if not self._loaded:
            self._load()
        index = self.svc.index
        if index.generation == self._generation:
            return
        generation, notes = index.documents()
        zone = time_zone(self.svc.config.timezone)
        found = {}
        for path, title, text in notes:
            if "⏰" in text or "remind:" in text:
                for r in note_reminders(path, title, text, zone):
                    found[r["id"]] = r
        self._found, self._generation = found, generation

    def tick(self) -> float:
        """Send the reminders that are due; return the seconds until the next one."""
        with self._tick_lock:
            now = self.clock()
            due, wait, changed = [], 3600.0, False
            with self._data_lock:
                self._refresh()
                for rid, r in self._found.items():
                    if rid in self._fired:
                        continue
                    if r["due"] > now:
                        if self._scheduled.get(rid) != r["due"]:
                            self._scheduled[rid], changed = r["due"], True
                        wait = min(wait, r["due"] - now)
                    elif (
                        rid in self._scheduled
                        or rid in self._tries
                        or r["due"] >= now - REMINDER_GRACE
                    ):
                        tries, retry_at = self._tries.get(rid, (0, 0.0))
                        if retry_at > now:
                            wait = min(wait, retry_at - now)
                        else:
                            due.append((r, tries))
                for book in (self._scheduled, self._fired):  # edited or deleted: cancelled
                    for rid in [rid for rid in book if rid not in self._found]:
                        del book[rid]
                        changed = True
            for r, tries in sorted(due, key=lambda item: item[0]["due"]):
                late = now - r["due"] > REMINDER_GRACE
                sent, tried = self._send(r, late)
                with self._data_lock:
                    if sent or not tried or tries + 1 >= REMINDER_ATTEMPTS:
                        self._fired[r["id"]] = iso(now)
                        self._scheduled.pop(r["id"], None)
                        self._tries.pop(r["id"], None)
                        changed = True
                    else:
                        self._tries[r["id"]] = (tries + 1, now + REMINDER_RETRY)
                        wait = min(wait, REMINDER_RETRY)
            if changed:
                with self._data_lock:
                    self._save()
            return wait

    def _send(self, r: dict, late: bool) -> tuple:
        """Send a reminder through the notifying channels; return (sent, tried)."""
        svc = self.svc
        text = (
            f"⏰ {'Late reminder' if late else 'Reminder'} ({r['wall']}): {r['title']}\n"
            f"{r['line']}\n{r['path']}"
        )
        sent = tried = 0
        for channel in _channels(svc):
            prov = svc.channel_providers.get(channel["provider"])
            if not (prov and prov.send and channel["enabled"] and channel["config"].get("notify")):
                continue
            for to in channel["config"].get(prov.allow, []) if prov.allow else []:
                tried += 1
                try:
                    prov.send(svc, channel["config"], to, text)
                    sent += 1
                except UpstreamError as e:
                    log.warning("channel %s: a reminder was not delivered: %s", channel["id"], e)
        if not tried:
            log.warning(
                "reminder in %s is due, but no enabled channel has notify: true and an allowlist",
                r["path"],
            )
        else:
            log.info("reminder in %s sent (%d of %d)%s", r["path"], sent, tried, " late" * late)
        return sent > 0, tried > 0

    def upcoming(self) -> list:
        """Return the reminders not sent yet, soonest first."""
        with self._data_lock:
            self._refresh()
            now = self.clock()
            pending = [
                r
                for rid, r in self._found.items()
                if rid not in self._fired
                and (r["due"] > now - REMINDER_GRACE or rid in self._scheduled)
            ]
        return sorted(pending, key=lambda r: (r["due"], r["path"]))


# == Plugins ==================================================================
#
# A plugin is a small record: hooks called after notes change, routes under
# /api/v1/plugins/<name>/..., and (through the registries above) agent or channel
# providers. The built-ins register exactly like a third-party file does.

HOOKS = ("note_saved", "note_moved", "note_deleted", "note_restored")
# note_saved(svc, path, content)    after a note is created, updated or appended to
# note_moved(svc, old_path, new_path)
# note_deleted(svc, path)
# note_restored(svc, path, content) after a note is restored from the trash or a version
#                                   (note_saved is not called for it)
PLUGIN_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,31}$")


@dataclasses.dataclass(frozen=True)
class PluginRoute:
    method: str
    path: str  # a Bottle rule below /api/v1/plugins/<name>; "" is the plugin's own page
    handler: Callable  # (svc, **url_args) -> dict
    summary: str = ""
    status: int = 200  # documented success status (200 is always documented too)
    params: dict | None = None  # JSON schemas of path/query parameters (OpenAPI), by name
    scope: str = "admin"  # what a grant needs to call it; a read or write route must keep
    # a folder grant inside its folder (request_principal())


@dataclasses.dataclass(frozen=True)
class Plugin:
    name: str
    version: str = "1.0.0"
    description: str = ""
    hooks: dict = dataclasses.field(default_factory=dict)  # hook name -> function
    routes: tuple = ()  # PluginRoute
    builtin: bool = False
    error: str | None = None  # why it could not be loaded
    # what the plugin's file registered with @agent_provider / @channel_provider / @tool
    # (per app; its tools are offered while it is on)
    agent_providers: dict = dataclasses.field(default_factory=dict)
    channel_providers: dict = dataclasses.field(default_factory=dict)
    tools: dict = dataclasses.field(default_factory=dict)


PLUGINS: dict[str, Plugin] = {}  # the built-ins, registered like any plugin file's PLUGIN


def accept_plugin(plugin: Any, taken: Mapping[str, Plugin]) -> Plugin:
    """Return a plugin record checked like every plugin (built-in or file); ValueError if not."""
    if not isinstance(plugin, Plugin):
        raise TypeError("the file defines no PLUGIN = notesvc.Plugin(...)")
    if not PLUGIN_NAME_RE.match(plugin.name):
        raise ValueError(f"plugin name {plugin.name!r} is not lower-case-with-dashes")
    if plugin.name in taken:
        raise ValueError(f"a plugin named {plugin.name!r} exists already")
    unknown = set(plugin.hooks) - set(HOOKS)
    if unknown:
        raise ValueError(f"unknown hook(s): {', '.join(sorted(unknown))}")
    return dataclasses.replace(plugin, error=None)


def builtin_plugin(plugin: Plugin) -> Plugin:
    """Register a built-in plugin (datasette's DEFAULT_PLUGINS pattern)."""
    PLUGINS[plugin.name] = accept_plugin(dataclasses.replace(plugin, builtin=True), PLUGINS)
    return plugin


def load_plugins(folder: Path) -> dict[str, Plugin]:
    """Return the built-in plugins and the third-party ones of folder (*.py, each defining
    PLUGIN), by name. A file that fails to load is listed with its error.

    Providers a file registers with the decorators belong to its plugin alone.
    """
    found: dict = dict(PLUGINS)
    for path in sorted(folder.glob("*.py")) if folder.is_dir() else ():
        name = path.stem.lower().replace("_", "-")
        try:
            spec = importlib.util.spec_from_file_location(f"notesvc_plugin_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            with collecting_registrations() as registered:
                spec.loader.exec_module(module)
            plugin = accept_plugin(getattr(module, "PLUGIN", None), found)
            found[plugin.name] = dataclasses.replace(
                plugin,
                builtin=False,
                agent_providers=registered.get("agent", {}),
                channel_providers=registered.get("channel", {}),
                tools={
                    name: dataclasses.replace(t, plugin=plugin.name)
                    for name, t in registered.get("tool", {}).items()
                },
            )
            log.info("plugin %s %s loaded from %s", plugin.name, plugin.version, path.name)
        except Exception as e:
            log.exception("plugin file %s failed to load", path.name)
            found[name] = Plugin(name=name, builtin=False, error=f"{type(e).__name__}: {e}")
    return found


def build_service(config: Config, readonly: bool = False) -> Service:
    """Return the Service of config with its plugins and their providers (not started).

    readonly (the audit): the built-in plugins only, no plugin file is ever imported.
    """
    plugins = PLUGINS if readonly else load_plugins(plugins_dir(config))
    svc = Service(config, plugins, *provider_registries(plugins), readonly=readonly)
    svc.pollers = ChannelPollers(svc)
    svc.reminders = ReminderScheduler(svc)
    return svc


def provider_registries(plugins: Mapping[str, Plugin]) -> tuple:
    """Return (agent providers, channel providers, tools) of one app: built-ins, then its
    plugins'."""
    agents, channels, tools = dict(AGENT_PROVIDERS), dict(CHANNEL_PROVIDERS), dict(TOOLS)
    for plugin in plugins.values():
        agents.update(plugin.agent_providers)
        channels.update(plugin.channel_providers)
        tools.update(plugin.tools)
    return agents, channels, tools


# -- links ---------------------------------------------------------------------------------

# Both patterns run in linear time: link text, targets and fragments stop at any bracket,
# so the attempts started at different brackets never scan the same text (a run of `[`
# fails at once at each one), and no repeat nests in another. Whether a Markdown link
# points at a .md note (or an attachment) is decided afterwards (_md_target), not by
# backtracking.
_WIKILINK_RE = re.compile(r"\[\[([^\[\]|#\n]+)((?:#[^\[\]|\n]*)?(?:\|[^\[\]\n]*)?)\]\]")
_MDLINK_RE = re.compile(
    r"(\[[^\[\]\n]*\]\()(<[^<>\n]*>[^)\s<>\[\]]*|[^)\s<>\[\]]+)((?:\s+\"[^\"\n]*\")?\))"
)


def _md_target(href: str) -> str | None:
    """Return the file part of a Markdown link's href (`<...>` kept), or None when it does not
    point at a .md file or an attachment's type; what follows it is a #fragment."""
    if href.startswith("<"):
        end = href.index(">") + 1
        target, inner, rest = href[:end], href[1 : end - 1], href[end:]
    else:
        target, _, rest = href.partition("#")
        inner, rest = target, href[len(target) :]
    if rest and not rest.startswith("#"):
        return None
    if len(inner) > 3 and inner.endswith(".md"):
        return target
    name = inner.rsplit("/", 1)[-1]
    return (
        target if "." in name[1:] and name.rpartition(".")[2].lower() in ATTACHMENT_TYPES else None
    )


def _attachment_name(target: str) -> bool:
    """Return whether a wikilink target names an attachment (`photo.jpg`, `trip/a.pdf`)."""
    name = target.rsplit("/", 1)[-1]
    ext = name.rpartition(".")[2].lower()
    return "." in name[1:] and ext != "md" and ext in ATTACHMENT_TYPES


class LinkResolver:
    """Resolves [[wikilinks]] (by name or path) and Markdown links to note paths, and to
    the attachment paths it is given (`![](../attachments/a.jpg)`, `![[a.jpg]]`)."""

    def __init__(self, paths: Iterable[str], attachments: Iterable[str] = ()):
        self.paths = {p.casefold(): p for p in paths}
        self.names: dict = {}
        for p in sorted(self.paths.values()):
            self.names.setdefault(p.rsplit("/", 1)[-1][:-3].casefold(), p)
        self.files: dict = {}  # an attachment's file name -> its path
        for p in sorted(attachments):
            self.paths[p.casefold()] = p
            self.files.setdefault(p.rsplit("/", 1)[-1].casefold(), p)

    def wikilink(self, target: str) -> str | None:
        t = target.strip()
        if _attachment_name(t):
            if "/" not in t:
                return self.files.get(t.casefold())
            t = t if t.startswith(f"{ATTACHMENTS}/") else f"{ATTACHMENTS}/{t.lstrip('/')}"
            return self.paths.get(t.casefold())
        if t.casefold().endswith(".md"):
            t = t[:-3]
        if "/" in t:
            t = t if t.startswith(f"{NOTES}/") else f"{NOTES}/{t.lstrip('/')}"
            return self.paths.get(f"{t}.md".casefold())
        return self.names.get(t.casefold())

    def mdlink(self, href: str, source: str) -> str | None:
        href = urllib.parse.unquote(href.strip("<>"))
        if "://" in href or href.startswith("mailto:"):
            return None
        if href.startswith("/"):
            href = href.lstrip("/")
            own = href.startswith((f"{NOTES}/", f"{ATTACHMENTS}/"))
            candidate = href if own else f"{NOTES}/{href}"
        else:
            candidate = posixpath.normpath(posixpath.join(posixpath.dirname(source), href))
        return self.paths.get(candidate.casefold())

    def links(self, text: str, source: str) -> set:
        """Return the paths a note's text links to (in its first MAX_SCAN_CHARS)."""
        text = text[:MAX_SCAN_CHARS]
        out = {self.wikilink(m.group(1)) for m in _WIKILINK_RE.finditer(text)}
        targets = map(_md_target, (m.group(2) for m in _MDLINK_RE.finditer(text)))
        out |= {self.mdlink(t, source) for t in targets if t}
        out.discard(None)
        out.discard(source)
        return out


def derived(svc: Service, name: str, build: Callable) -> Any:
    """Return build([(path, title, text)] of every indexed note), kept until the index changes.

    Only taking the snapshot holds the index lock (inside index.documents()); the build runs
    without it, so searches and writes never wait for a plugin's computation. Builds take
    turns, so concurrent callers wait for one build instead of repeating it.
    """
    cached = svc.plugin_cache.get(name)
    if cached and cached[0] == svc.index.generation:
        return cached[1]
    with svc.plugin_build_lock:
        cached = svc.plugin_cache.get(name)
        if cached and cached[0] == svc.index.generation:
            return cached[1]
        generation, notes = svc.index.documents()
        value = build(notes)
        svc.plugin_cache[name] = (generation, value)
        return value


def link_graph(svc: Service) -> dict:
    """Return {note path: set of notes linking to it}, cached until the index changes."""

    def build(notes: list) -> dict:
        resolver = LinkResolver(getattr(notes, "paths", None) or [p for p, _, _ in notes])
        graph: dict = collections.defaultdict(set)
        for path, _, text in notes:
            text = text[:MAX_SCAN_CHARS]
            if "[[" in text or ".md" in text:
                for target in resolver.links(text, path):
                    graph[target].add(path)
        return graph

    return derived(svc, "links", build)


def rewrite_links(
    text: str,
    source: str,
    old: str,
    new: str,
    resolver: LinkResolver,
    moved_from: str | None = None,
) -> str:
    """Return text with its links to `old` pointing at `new` (in the style they were written).

    `moved_from`: the note itself moved from there, so its relative links are rebased.
    """

    def wiki(m: re.Match) -> str:
        target = m.group(1)
        if resolver.wikilink(target) != old:
            return m.group(0)
        t = target.strip()
        if _attachment_name(t):  # ![[photo.jpg]]: by file name, or by path
            if "/" not in t:
                replacement = new.rsplit("/", 1)[-1]
            else:
                own = t.startswith(f"{ATTACHMENTS}/")
                replacement = new if own else new[len(ATTACHMENTS) + 1 :]
        elif "/" not in t:
            replacement = new.rsplit("/", 1)[-1][:-3]
        else:
            replacement = new if t.startswith(f"{NOTES}/") else new[len(NOTES) + 1 :]
            if not t.casefold().endswith(".md"):
                replacement = replacement[:-3]
        return f"[[{replacement}{m.group(2)}]]"

    def markdown(m: re.Match) -> str:
        href = _md_target(m.group(2))
        if href is None:
            return m.group(0)
        fragment = m.group(2)[len(href) :]
        base = moved_from or source
        target = resolver.mdlink(href, base)
        if target is None or (target != old and not moved_from):
            return m.group(0)
        target = new if target == old else target
        bare = href.strip("<>")
        if bare.startswith("/") and target.startswith(f"{ATTACHMENTS}/"):
            replacement = "/" + target
        elif bare.startswith("/"):
            replacement = "/" + (
                target if bare.lstrip("/").startswith(f"{NOTES}/") else target[len(NOTES) + 1 :]
            )
        else:
            replacement = posixpath.relpath(target, posixpath.dirname(source))
        if "%" in bare or " " not in replacement:
            replacement = urllib.parse.quote(replacement, safe="/")
        if href.startswith("<"):
            replacement = f"<{urllib.parse.unquote(replacement)}>"
        return f"{m.group(1)}{replacement}{fragment}{m.group(3)}"

    return _MDLINK_RE.sub(markdown, _WIKILINK_RE.sub(wiki, text))


def update_links(svc: Service, old: str, new: str, linking: set) -> list:
    """Rewrite the links to `old` (a note or an attachment) in each linking note (one atomic
    write each); a moved note's own relative links are rebased too."""
    note, sees = old.startswith(f"{NOTES}/"), request_principal().sees
    resolver = LinkResolver(  # a folder grant's: what the rewritten text shows is its own
        [p for p in [*svc.index.paths(), *([old] if note else [])] if sees(p)],
        [p for p in [*svc.attachments.paths(), *([] if note else [old])] if sees(p)],
    )
    changed = []
    for source in sorted(linking | ({new} if note else set())):
        moved_from = old if source == new else None

        def change(text: str, source=source, moved_from=moved_from) -> str:
            return rewrite_links(text, source, old, new, resolver, moved_from)

        try:
            if svc.notes.rewrite(source, change):
                changed.append(source)
        except ApiError as e:  # a linking note vanished or is not UTF-8: leave it be
            log.warning("links in %s not updated: %s", source, e.message)
    return changed


def move_and_relink(
    svc: Service, path: str, new: str, if_match: str | None = None, relink: bool = False
) -> dict:
    """Move a note (If-Match honoured; never overwrites) and, with `relink`, point the links
    to it at its new path; return its record there with `from` (and `linksUpdated`).
    A folder grant's move rewrites links inside its folder only."""
    sees = request_principal().sees
    linking = set(filter(sees, link_graph(svc).get(path, ()))) if relink else set()
    rec = svc.notes.move(path, new, if_match)
    if relink and new != path:
        rec["linksUpdated"] = update_links(svc, path, new, linking - {path})
        if new in rec["linksUpdated"]:  # the note's own relative links were rebased
            rec = {**svc.notes.get(new), "from": path, "linksUpdated": rec["linksUpdated"]}
    return rec


def attachment_linkers(svc: Service, path: str) -> set:
    """Return the notes that link to an attachment (Markdown links, images, ![[embeds]])."""
    name = path.rsplit("/", 1)[-1]
    quoted = urllib.parse.quote(name)
    resolver = LinkResolver(svc.index.paths(), [*svc.attachments.paths(), path])
    _, notes = svc.index.documents()
    return {
        source
        for source, _, text in notes
        if (name in text or quoted in text) and path in resolver.links(text, source)
    }


# -- built-in plugins -----------------------------------------------------------------------


def titled(svc: Service, paths: Iterable[str]) -> list:
    """Return [{path, title}] of the paths that are (still) indexed."""
    out = [{"path": p, "title": svc.index.title_of(p)} for p in paths]
    return [item for item in out if item["title"] is not None]


def get_backlinks(svc: Service, path: str) -> dict:
    path = visible_note(svc.notes, path)
    if not svc.notes.exists(path):
        raise not_found(f"no note at {path}")
    sees = request_principal().sees
    return {
        "path": path,
        "backlinks": titled(svc, sorted(filter(sees, link_graph(svc).get(path, ())))),
    }


builtin_plugin(
    Plugin(
        "backlinks",
        description="notes that link to a note, by [[wikilink]] or Markdown link",
        routes=(
            PluginRoute(
                "GET",
                "/<path:path>",
                get_backlinks,
                "Notes linking to a note",
                params={"path": NOTE_PATH_PARAM},
                scope="read",
            ),
        ),
    )
)


def tag_map(svc: Service) -> dict:
    """Return {tag: sorted note paths}, cached until the index changes."""

    def build(notes: list) -> dict:
        tags: dict = collections.defaultdict(list)
        for path, _, text in sorted(notes):
            if "#" in text or text.startswith("---"):
                for tag in note_tags(text):
                    tags[tag].append(path)
        return tags

    return derived(svc, "tags", build)


def _visible_tags(svc: Service) -> dict:
    """Return {tag: note paths} the request's grant sees (a folder grant: its folder's)."""
    who = request_principal()
    tags = tag_map(svc)
    if not who.folder:
        return tags
    seen = {t: [p for p in paths if who.sees(p)] for t, paths in tags.items()}
    return {t: paths for t, paths in seen.items() if paths}


def list_tags(svc: Service) -> dict:
    tags = _visible_tags(svc)
    return {"tags": [{"tag": t, "count": len(tags[t])} for t in sorted(tags)]}


def get_tag(svc: Service, tag: str) -> dict:
    tag = tag.lstrip("#").lower()
    paths = _visible_tags(svc).get(tag)
    if not paths:
        raise not_found(f"no note is tagged #{tag}")
    return {"tag": tag, "notes": titled(svc, paths)}


builtin_plugin(
    Plugin(
        "tags",
        description="#tags outside code and front-matter tags:",
        routes=(
            PluginRoute("GET", "", list_tags, "All tags with their counts", scope="read"),
            PluginRoute("GET", "/<tag:path>", get_tag, "Notes with a tag", scope="read"),
        ),
    )
)


def daily_today(svc: Service) -> bytes:
    path, heading = day_note(local_now(svc).date())
    path = visible_note(svc.notes, path)
    try:
        rec, status = svc.notes.create(path, f"# {heading}\n\n"), 201
    except ApiError as e:
        if e.code != "CONFLICT":
            raise
        rec, status = svc.notes.get(path), 200  # it was there already: not created now
    bottle.response.set_header("ETag", rec["etag"])
    return ok(rec, status)


builtin_plugin(
    Plugin(
        "daily",
        description="a note per day: notes/daily/YYYY-MM-DD.md",
        routes=(
            PluginRoute(
                "POST",
                "/today",
                daily_today,
                "Today's note, created if missing",
                201,
                scope="write",
            ),
        ),
    )
)


# -- built-in tools (the TOOLS registry: see Providers) --------------------------------------

_PATH_ARG = {
    "type": "string",
    "minLength": 1,
    "maxLength": MAX_PATH_CHARS,
    "description": f"a note path, {NOTES}/<folders>/<name>.md, as search_notes and "
    "list_folder show it",
}
_FOLDER_ARG = {
    "type": "string",
    "maxLength": MAX_PATH_CHARS,
    "description": f"a folder: {NOTES} (the top) or {NOTES}/<folders>",
}
_ETAG_ARG = {
    "type": "string",
    "minLength": 1,
    "maxLength": 100,
    "description": "the etag read_note gave: the change is refused if the note changed since",
}
_QUERY_ARG = {
    "type": "string",
    "minLength": 1,
    "maxLength": MAX_QUERY_CHARS,
    "description": 'words (all must match), "exact phrase", prefix*, -word to leave out, '
    "a OR b; case, accents and English plurals do not matter",
}
READ_CHARS, MAX_READ_CHARS = 20000, 200000  # of a note read_note returns: default, most


def note_url(svc: Service, path: str) -> str:
    """Return the API URL of a note as the current request reached this server (relay
    included); relative outside a request."""
    try:
        environ = bottle.request.environ
        base = svc.base_url(environ) + environ.get("SCRIPT_NAME", "")
    except (AttributeError, RuntimeError, KeyError):
        base = svc.config.public_url
    return f"{base}{API}/notes/{urllib.parse.quote(path, safe='')}"


def _summary(rec: dict) -> dict:
    """Return what a write tool answers: the note's record without its content."""
    return {k: rec[k] for k in ("path", "title", "etag", "size", "modified")}


def _hit_lines(data: dict) -> str:
    lines = [f"{r['path']} — {r['title']}: {r['snippet']}" for r in data["results"]]
    return "\n".join(lines) or "No note matches."


@tool(
    "search_notes",
    "Search the user's notes (full text, best match first). Returns each hit's path, title "
    "and a snippet; open a note with read_note.",
    {
        "query": _QUERY_ARG,
        "limit": {"type": "integer", "minimum": 1, "maximum": 50, "default": 10},
        "folder": {**_FOLDER_ARG, "description": "search only this folder (and below)"},
    },
    ("query",),
    title="Search notes",
    text=_hit_lines,
)
def tool_search_notes(svc: Service, query: str, limit: int = 10, folder: str = "") -> dict:
    parsed = Query(query)
    folder = visible_folder(svc, folder or NOTES)  # a folder grant's by default
    total, hits = svc.index.search(parsed, "" if folder == NOTES else folder, limit, 0)
    results = [{"path": p, "title": t, "snippet": sn, "score": sc} for p, t, sc, sn in hits]
    return {"results": results, "total": total}


def _note_text(data: dict) -> str:
    head = f"{data['path']} — {data['title']}\netag: {data['etag']}"
    end = data["offset"] + len(data["content"])
    if data["offset"] or data["truncated"]:
        head += f"\ncharacters {data['offset']}-{end} of {data['totalChars']}"
        if data["truncated"]:
            head += f"; read on with offset={end}"
    return f"{head}\n\n{data['content']}"


@tool(
    "read_note",
    "Read a note: its Markdown content, title and etag (pass the etag to update_note or "
    "move_note). A long note comes in parts: read on from `offset`.",
    {
        "path": _PATH_ARG,
        "offset": {"type": "integer", "minimum": 0, "maximum": 10**9, "default": 0},
        "maxChars": {"type": "integer", "minimum": 1, "maximum": MAX_READ_CHARS},
    },
    ("path",),
    title="Read a note",
    text=_note_text,
)
def tool_read_note(svc: Service, path: str, offset: int = 0, maxChars: int = READ_CHARS) -> dict:
    rec = svc.notes.get(visible_note(svc.notes, path))
    content = rec["content"]
    part = content[offset : offset + maxChars]
    return {
        **_summary(rec),
        "content": part,
        "offset": offset,
        "truncated": offset + len(part) < len(content),
        "totalChars": len(content),
    }


def _cut(node: dict, depth: int) -> dict:
    """Return a folder node listed `depth` levels deep; deeper folders get `count`."""
    children = []
    for child in node["children"]:
        if child["type"] != "folder":
            children.append(child)
        elif depth > 1:
            children.append(_cut(child, depth - 1))
        else:
            folder = {k: child[k] for k in ("name", "path", "type")}
            children.append({**folder, "count": _count_notes(child)})
    return {**node, "children": children}


def _count_notes(node: dict) -> int:
    return sum(_count_notes(c) if c["type"] == "folder" else 1 for c in node["children"])


def _tree_lines(node: dict, indent: str = "") -> list:
    lines = [f"{indent}{node['name'] if indent else node['path']}/"]
    for child in node.get("children", ()):
        if child["type"] == "folder" and "children" in child:
            lines += _tree_lines(child, indent + "  ")
        elif child["type"] == "folder":
            lines.append(f"{indent}  {child['name']}/ ({child['count']} notes)")
        else:
            lines.append(f"{indent}  {child['name']}")
    return lines


@tool(
    "list_folder",
    f"List a folder of notes: its subfolders and notes ({NOTES} is the top). `depth` levels "
    "are listed; deeper folders show how many notes they hold.",
    {"path": _FOLDER_ARG, "depth": {"type": "integer", "minimum": 1, "maximum": 10, "default": 1}},
    title="List a folder",
    text=lambda node: "\n".join(_tree_lines(node)),
)
def tool_list_folder(svc: Service, path: str = NOTES, depth: int = 1) -> dict:
    return _cut(granted_tree(svc, path), depth)


def _since_ns(since: str) -> int:
    try:
        when = dt.datetime.fromisoformat(since.strip().replace("Z", "+00:00"))
    except ValueError:
        raise bad_request("'since' must be a time such as 2025-05-01T12:00:00Z") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return int(when.timestamp() * 1e9)


@tool(
    "recent_changes",
    "The notes changed most recently, newest first (by modification time; deleted notes "
    "are not listed).",
    {
        "since": {
            "type": "string",
            "maxLength": 40,
            "description": "only notes changed after this time (ISO 8601, e.g. "
            "2025-05-01T12:00:00Z)",
        },
        "limit": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20},
    },
    title="Recent changes",
    text=lambda d: (
        "\n".join(f"{c['modified']} {c['path']} — {c['title']}" for c in d["changes"])
        or "No note changed."
    ),
)
def tool_recent_changes(svc: Service, since: str = "", limit: int = 20) -> dict:
    after, sees = _since_ns(since) if since else -1, request_principal().sees
    notes = [(m, p, size) for p, (size, m) in svc.notes.scan().items() if m > after and sees(p)]
    notes.sort(reverse=True)
    changes = [
        {
            "path": p,
            "title": svc.index.title_of(p) or note_title("", p),
            "modified": iso(m / 1e9),
            "size": size,
        }
        for m, p, size in notes[:limit]
    ]
    return {"changes": changes, "total": len(notes)}


@tool(
    "list_tags",
    "All #tags of the notes (and front-matter tags), each with how many notes carry it.",
    title="List tags",
    plugin="tags",
    text=lambda d: "\n".join(f"#{t['tag']} ({t['count']})" for t in d["tags"]) or "No tags.",
)
def tool_list_tags(svc: Service) -> dict:
    return list_tags(svc)


@tool(
    "create_note",
    "Create a note (refused if one exists at that path; missing folders are created).",
    {"path": _PATH_ARG, "content": {"type": "string", "description": "the Markdown text"}},
    ("path", "content"),
    title="Create a note",
    read_only=False,
)
def tool_create_note(svc: Service, path: str, content: str) -> dict:
    return _summary(svc.notes.create(visible_note(svc.notes, path), content))


@tool(
    "append_to_note",
    "Add text at the end of an existing note, on a new line (a list item: start it with '- ').",
    {"path": _PATH_ARG, "text": {"type": "string", "minLength": 1}},
    ("path", "text"),
    title="Append to a note",
    read_only=False,
)
def tool_append_to_note(svc: Service, path: str, text: str) -> dict:
    path = visible_note(svc.notes, path)

    def add(old: str) -> str:
        return old + ("\n" if old and not old.endswith("\n") else "") + text.rstrip("\n") + "\n"

    svc.notes.rewrite(path, add)
    return _summary(svc.notes.get(path))


@tool(
    "replace_in_note",
    "Replace one exact piece of a note's text with new text. `old` must occur exactly "
    "once: copy it from read_note, with enough of its surroundings to be unique.",
    {
        "path": _PATH_ARG,
        "old": {"type": "string", "minLength": 1, "description": "the exact text to replace"},
        "new": {"type": "string", "description": "the text to put in its place"},
    },
    ("path", "old", "new"),
    title="Replace text in a note",
    read_only=False,
    destructive=True,
)
def tool_replace_in_note(svc: Service, path: str, old: str, new: str) -> dict:
    path = visible_note(svc.notes, path)

    def swap(text: str) -> str:
        count = text.count(old)
        if count == 1:
            return text.replace(old, new, 1)
        if count == 0:
            raise ApiError(
                409,
                "CONFLICT",
                f"the text to replace is not in {path}; read the note again (read_note) "
                "and copy the text exactly",
            )
        raise ApiError(
            409,
            "CONFLICT",
            f"the text to replace occurs {count} times in {path}; include more of the text "
            "around it so that it occurs once",
        )

    svc.notes.rewrite(path, swap)
    return {**_summary(svc.notes.get(path)), "replaced": 1}


@tool(
    "update_note",
    "Replace a note's whole content. Needs the etag read_note gave: a note that changed "
    "since is not overwritten (read it again and redo the change).",
    {"path": _PATH_ARG, "content": {"type": "string"}, "etag": _ETAG_ARG},
    ("path", "content", "etag"),
    title="Update a note",
    read_only=False,
    destructive=True,
    idempotent=True,
)
def tool_update_note(svc: Service, path: str, content: str, etag: str) -> dict:
    return _summary(svc.notes.update(visible_note(svc.notes, path), content, etag))


@tool(
    "move_note",
    "Move or rename a note (never onto an existing note). Needs the etag read_note gave; "
    "updateLinks rewrites the links of other notes to it.",
    {
        "path": _PATH_ARG,
        "newPath": {**_PATH_ARG, "description": "where the note goes"},
        "etag": _ETAG_ARG,
        "updateLinks": {"type": "boolean", "default": False},
    },
    ("path", "newPath", "etag"),
    title="Move a note",
    read_only=False,
    destructive=True,
    idempotent=True,
)
def tool_move_note(
    svc: Service, path: str, newPath: str, etag: str, updateLinks: bool = False
) -> dict:
    path, new = visible_note(svc.notes, path), visible_note(svc.notes, newPath)
    rec = move_and_relink(svc, path, new, etag, updateLinks)
    return {**_summary(rec), **{k: rec[k] for k in ("from", "linksUpdated") if k in rec}}


@tool(
    "delete_note",
    "Delete a note (it goes to the trash, from where the owner can restore it). With an "
    "etag, a note that changed since is not deleted.",
    {"path": _PATH_ARG, "etag": _ETAG_ARG},
    ("path",),
    title="Delete a note",
    read_only=False,
    destructive=True,
    idempotent=True,
)
def tool_delete_note(svc: Service, path: str, etag: str | None = None) -> dict:
    done = svc.notes.delete(visible_note(svc.notes, path), etag)
    return {"path": done["path"], "deleted": True}


@tool(
    "search",
    "Search the user's notes; each result's id is a note path to pass to fetch.",
    {"query": _QUERY_ARG},
    ("query",),
    title="Search",
    alias_of="search_notes",
)
def tool_search(svc: Service, query: str) -> dict:
    folder = request_principal().folder  # a folder grant searches its folder
    _, hits = svc.index.search(Query(query), folder, 10, 0)
    return {"results": [{"id": p, "title": t, "url": note_url(svc, p)} for p, t, _, _ in hits]}


@tool(
    "fetch",
    "Read a whole note by the id search gave (its path).",
    {"id": {**_PATH_ARG, "description": "a note path, as search gives it"}},
    ("id",),
    title="Fetch",
    alias_of="read_note",
)
def tool_fetch(svc: Service, id: str) -> dict:
    rec = svc.notes.get(visible_note(svc.notes, id))
    return {
        "id": rec["path"],
        "title": rec["title"],
        "text": rec["content"][:MAX_READ_CHARS],
        "url": note_url(svc, rec["path"]),
        "metadata": {k: rec[k] for k in ("etag", "modified", "size")},
    }


# == Security audit ===========================================================
#
# Each check is a small function of the service returning findings; the score is
# 100 - 40 per critical - 20 per high - 10 per medium - 3 per low, never below 0.

SEVERITIES = ("critical", "high", "medium", "low", "info")
SEVERITY_COST = {"critical": 40, "high": 20, "medium": 10, "low": 3, "info": 0}
KEY_MAX_AGE_DAYS = 180
QUERY_SECRET_WINDOW = 7 * 86400  # "seen recently"

AUDIT_CHECKS: dict = {}


def audit_check(fn: Callable) -> Callable:
    """Register a check: fn(svc) -> list of findings."""
    AUDIT_CHECKS[fn.__name__.removeprefix("check_")] = fn
    return fn


def finding(id: str, severity: str, title: str, detail: str, recommendation: str) -> dict:
    return {
        "id": id,
        "severity": severity,
        "title": title,
        "detail": detail,
        "recommendation": recommendation,
    }


def key_age_days(state: dict) -> int | None:
    """Return how many days old the API key is (None when the state does not say)."""
    try:
        born = dt.datetime.strptime(state.get("keyCreatedAt", ""), "%Y-%m-%dT%H:%M:%S.%fZ")
    except ValueError:
        return None
    return (utcnow() - born.replace(tzinfo=dt.timezone.utc)).days


def _reachable_beyond_loopback(cfg: Config) -> bool:
    return not is_loopback(cfg.host) and cfg.host != "localhost"


def _off_loopback_http(url: str) -> bool:
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    return parts.scheme == "http" and host != "localhost" and not is_loopback(host)


def _mode_of(path: Path) -> int | None:
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return None


@audit_check
def check_auth_off(svc: Service) -> list:
    if svc.config.auth_mode != "none":
        return []
    return [
        finding(
            "auth-off",
            "critical",
            "Authentication is off",
            "SERVICE_AUTH_MODE=none: anyone who reaches the port reads and changes every note.",
            "Set SERVICE_AUTH_MODE=api-key (the default).",
        )
    ]


@audit_check
def check_tool_writes(svc: Service) -> list:
    """Write tools switched on (SERVICE_MCP_WRITE, SERVICE_AGENT_WRITE): medium without auth."""
    cfg, out = svc.config, []
    flags = (("SERVICE_MCP_WRITE", cfg.mcp_write), ("SERVICE_AGENT_WRITE", cfg.agent_write))
    on = [env for env, flag in flags if flag]
    if on and cfg.auth_mode == "none":
        out.append(
            finding(
                "tool-writes-without-auth",
                "medium",
                "AI tools may change notes and no key is asked",
                f"{' and '.join(on)} on with SERVICE_AUTH_MODE=none: any MCP client or "
                "chat that reaches the port can have notes changed, moved and deleted.",
                "Set SERVICE_AUTH_MODE=api-key, or turn the write tools off.",
            )
        )
    channels = [c for c in svc.state.read().get("channels", []) if c["enabled"]]
    if cfg.agent_write and channels:
        out.append(
            finding(
                "agent-writes-from-channels",
                "info",
                "The agent may change notes when asked through a channel",
                f"SERVICE_AGENT_WRITE is on: every sender {len(channels)} enabled channel(s) "
                "accept can have the agent create, change, move and delete notes.",
                "Keep the channels' allowlists short, or turn SERVICE_AGENT_WRITE off.",
            )
        )
    return out


@audit_check
def check_setup_exposed(svc: Service) -> list:
    cfg, st = svc.config, svc.state.read()
    if st.get("setupComplete") or cfg.auth_mode == "none":
        return []
    if not _reachable_beyond_loopback(cfg):
        return [
            finding(
                "setup-incomplete",
                "low",
                "Setup is not complete",
                "The key is shown by GET /system/setup until a client links; the "
                "service listens on loopback only.",
                "Link a client: POST /api/v1/auth/link with the key.",
            )
        ]
    if cfg.setup_local_only:
        return [
            finding(
                "setup-incomplete",
                "medium",
                "Setup is not complete",
                f"Reachable on {cfg.host}; the key is shown only to loopback clients "
                "(SERVICE_SETUP_LOCAL_ONLY), but a proxy on this machine would count "
                "as loopback.",
                "Link a client now: POST /api/v1/auth/link with the key.",
            )
        ]
    return [
        finding(
            "setup-exposed",
            "critical",
            "The API key is publicly readable",
            f"Setup is incomplete and the service listens on {cfg.host}: anyone who "
            "reaches it can read the key from GET /api/v1/system/setup.",
            "Link a client now (POST /api/v1/auth/link), or set "
            "SERVICE_SETUP_LOCAL_ONLY=true, or bind to 127.0.0.1 until linked.",
        )
    ]


@audit_check
def check_cors_wildcard(svc: Service) -> list:
    if "*" not in svc.config.cors:
        return []
    return [
        finding(
            "cors-wildcard",
            "high",
            "CORS allows every origin",
            "SERVICE_CORS_ORIGINS contains *: any web page a user opens may call the "
            "API from their browser.",
            "List the exact origins of your clients in SERVICE_CORS_ORIGINS.",
        )
    ]


def _entropy_bits_per_char(text: str) -> float:
    counts = collections.Counter(text)
    return -sum(c / len(text) * math.log2(c / len(text)) for c in counts.values()) if text else 0


def _secret_strength(svc: Service, name: str) -> tuple:
    """Return (bytes, bits of entropy per character) of a secret setting.

    The `audit` command auditing a running server reads them from the server's recorded
    settings, which keep these figures and never the secret.
    """
    recorded = getattr(svc, "recorded_secrets", None)
    if recorded is not None:
        facts = recorded.get(name) or {}
        return int(facts.get("bytes", 0)), float(facts.get("bitsPerChar", 0.0))
    secret = getattr(svc.config, name)
    return len(secret.encode()), _entropy_bits_per_char(secret)


@audit_check
def check_jwt_secret(svc: Service) -> list:
    cfg = svc.config
    if cfg.auth_mode != "jwt":
        return []
    size, bits = _secret_strength(svc, "jwt_secret")
    if size < 32 or bits < 3.5:
        return [
            finding(
                "jwt-secret-weak",
                "high",
                "The JWT secret is weak",
                f"SERVICE_JWT_SECRET is {size} bytes with "
                f"{bits:.1f} bits of entropy per character; a "
                "guessable secret lets anyone mint tokens.",
                "Use 32+ random bytes: python -c 'import secrets; "
                "print(secrets.token_urlsafe(48))'.",
            )
        ]
    return [
        finding(
            "jwt-mode",
            "info",
            "JWT mode is on",
            "Bearer tokens (HS256, one hour) and the API key are both accepted.",
            "Keep SERVICE_JWT_SECRET out of shell history and logs.",
        )
    ]


@audit_check
def check_state_private(svc: Service) -> list:
    out = []
    folder = svc.config.state_dir
    for path, what in ((folder, "state folder"), (folder / "state.json", "state file")):
        mode = _mode_of(path)
        if mode is not None and mode & 0o077:
            out.append(
                finding(
                    f"state-readable-{'dir' if path == folder else 'file'}",
                    "high",
                    f"The {what} is open to other users",
                    f"{path.name} has mode {mode:o}; it holds the key hash and channel tokens.",
                    f"chmod {'700' if path == folder else '600'} {path}",
                )
            )
    return out


@audit_check
def check_notes_folder(svc: Service) -> list:
    """The notes folder, and the attachments folder beside it, are private to the owner."""
    out = []
    for folder, what in (
        (svc.config.notes_dir, NOTES),
        (svc.config.root / ATTACHMENTS, ATTACHMENTS),
    ):
        mode = _mode_of(folder)
        if mode is None:
            continue
        if mode & 0o002:
            out.append(
                finding(
                    f"{what}-writable",
                    "high",
                    f"Other users can write the {what} folder",
                    f"{what}/ has mode {mode:o}: any local user can change or plant {what}.",
                    f"chmod o-w {folder}",
                )
            )
        elif mode & 0o004:
            out.append(
                finding(
                    f"{what}-readable",
                    "low",
                    f"Other users can read the {what} folder",
                    f"{what}/ has mode {mode:o}.",
                    f"chmod o-rx {folder} (or run with UMask=0077)",
                )
            )
    return out


def _service_uid(svc: Service) -> int:
    """Return the uid the audited service runs as (the CLI's audit says which it means)."""
    uid = getattr(svc, "service_uid", None)
    return uid if uid is not None else os.geteuid()


def _plugin_path_findings(folder: Path, uid: int) -> list:
    """Findings for the plugins folder's ancestors and owners (who could plant code).

    A parent writable by others matters unless it has the sticky bit (like /tmp: others
    cannot rename or remove what is ours); group write by group 0 (root) is fine. A folder
    owned by another user than root or the service's own can be replaced by that user.
    """
    out, writable, owners = [], [], []
    target = folder.resolve()
    for path in (target, *target.parents):
        try:
            st = os.stat(path)
        except OSError:
            continue  # not created yet: its parents decide who may create it
        mode = stat.S_IMODE(st.st_mode)
        open_write = mode & 0o002 or (mode & 0o020 and st.st_gid != 0)
        if path != target and open_write and not mode & stat.S_ISVTX:
            writable.append(f"{path} ({mode:o})")
        if st.st_uid not in (0, uid):
            owners.append(f"{path} (uid {st.st_uid})")
    if writable:
        out.append(
            finding(
                "plugins-parent-writable",
                "high",
                "Others can write a folder above the plugins folder",
                f"{', '.join(writable)}: whoever can write there can replace the plugins "
                "folder with their own, and its files run as this service at the next start.",
                "chmod go-w (or chmod +t) each folder named",
            )
        )
    if owners:
        out.append(
            finding(
                "plugins-owner",
                "high",
                "The plugins folder or a folder above it belongs to another user",
                f"{', '.join(owners)}: that user can plant code that runs as this service.",
                "chown them to root or to the service's user",
            )
        )
    return out


@audit_check
def check_plugins(svc: Service) -> list:
    """Plugin files and the folders holding them, read from the disk: never imported here."""
    out = []
    folder = plugins_dir(svc.config)
    uid = _service_uid(svc)
    mode = _mode_of(folder)
    if mode is not None and mode & 0o022:
        out.append(
            finding(
                "plugins-writable",
                "high",
                "Others can write the plugins folder",
                f"{folder.name}/ has mode {mode:o}: a file dropped there runs as "
                "this service at the next start.",
                f"chmod go-w {folder}",
            )
        )
    out += _plugin_path_findings(folder, uid)
    loaded = {p.name: p for p in svc.plugins.values() if not p.builtin}
    files = sorted(folder.glob("*.py")) if folder.is_dir() else []
    for path in files:
        name = path.stem.lower().replace("_", "-")
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISLNK(st.st_mode):
            out.append(
                finding(
                    f"plugin-symlink-{name}",
                    "high",
                    f"Plugin file {path.name} is a symbolic link",
                    "The code that runs is wherever the link points, outside the checks "
                    "on the plugins folder.",
                    f"Replace the link with a copy of the file you have read: {path}",
                )
            )
            with contextlib.suppress(OSError):
                st = os.stat(path)
        if st.st_mode & 0o022:
            out.append(
                finding(
                    f"plugin-writable-{name}",
                    "high",
                    f"Others can write plugin file {path.name}",
                    f"It has mode {stat.S_IMODE(st.st_mode):o}: anyone who can write it "
                    "runs code as this service at the next start.",
                    f"chmod go-w {path}",
                )
            )
        if st.st_uid not in (0, uid):
            out.append(
                finding(
                    f"plugin-owner-{name}",
                    "high",
                    f"Plugin file {path.name} belongs to another user",
                    f"It belongs to uid {st.st_uid}, who can change the code this service runs.",
                    f"chown it to root or to the service's user: {path}",
                )
            )
        plugin = loaded.pop(name, None)
        state = (
            "present (failed to load)"
            if plugin and plugin.error
            else "loaded"
            if plugin
            else "present (listed by file name; the audit never runs plugin code)"
        )
        out.append(
            finding(
                f"plugin-{name}",
                "low" if plugin and plugin.error else "medium",
                f"Third-party plugin {path.name} is {state}",
                "Plugins run at start with the service's full rights over every note.",
                "Keep only plugins you have read; switch off the others "
                f"(POST /api/v1/plugins/{name}/toggle) or remove the file.",
            )
        )
    for plugin in loaded.values():  # loaded under another name than its file's
        out.append(
            finding(
                f"plugin-{plugin.name}",
                "medium" if not plugin.error else "low",
                f"Third-party plugin {plugin.name} is "
                + ("loaded" if not plugin.error else "present (failed to load)"),
                "Plugins run at start with the service's full rights over every note.",
                "Keep only plugins you have read; switch off the others "
                f"(POST /api/v1/plugins/{plugin.name}/toggle).",
            )
        )
    return out


@audit_check
def check_channel_allowlists(svc: Service) -> list:
    """Telegram/WhatsApp channels without an allowlist; every web channel (its secret is all).

    A web channel's senders name themselves, so `allowedSenders` filters but never
    authenticates: the channel secret is its only lock, whatever the allowlist says.
    """
    out = []
    for channel in svc.state.read().get("channels", []):
        provider = svc.channel_providers.get(channel["provider"])
        if not provider or not channel["enabled"]:
            continue
        if channel["provider"] == "web":
            out.append(
                finding(
                    f"channel-web-{channel['id']}",
                    "info",
                    f"Web channel {channel['name']} is guarded by its secret alone",
                    "Anyone holding the channel secret can ask the agent about your notes "
                    "and /save into them; allowedSenders only filters the sender names "
                    "callers give themselves, so it is not authentication.",
                    "Keep the channel secret as private as the API key; to change it, "
                    "delete the channel and create it again.",
                )
            )
        elif provider.allow and not channel["config"].get(provider.allow):
            out.append(
                finding(
                    f"channel-open-{channel['id']}",
                    "high",
                    f"Channel {channel['name']} has no allowlist",
                    f"Anyone who can message this {channel['provider']} channel "
                    "can ask the agent about your notes and /save into them.",
                    f"Set config.{provider.allow}: PATCH /api/v1/channels/{channel['id']}.",
                )
            )
    return out


@audit_check
def check_channel_signatures(svc: Service) -> list:
    """Channels whose provider signs its calls (WhatsApp) but that have no key to check them."""
    out = []
    for channel in svc.state.read().get("channels", []):
        provider = svc.channel_providers.get(channel["provider"])
        if not provider or not provider.signing_field or not channel["enabled"]:
            continue
        if channel["config"].get(provider.signing_field):
            continue
        out.append(
            finding(
                f"channel-unsigned-{channel['id']}",
                "high",
                f"Channel {channel['name']} does not check the provider's signature",
                f"Without config.{provider.signing_field}, calls to this {channel['provider']} "
                f"webhook are authenticated by the secret in the URL alone (?secret=), which "
                f"lands in access logs; {provider.signature_header} is not checked.",
                f"Set config.{provider.signing_field} (the app secret of your Meta app): "
                f"PATCH /api/v1/channels/{channel['id']}.",
            )
        )
    return out


@audit_check
def check_query_secrets(svc: Service) -> list:
    seen = svc.query_secret_seen_at
    if not seen or time.time() - seen > QUERY_SECRET_WINDOW:
        return []
    return [
        finding(
            "secret-in-query",
            "medium",
            "A webhook secret came in a query string",
            f"Last at {iso(seen)}. URLs end up in proxy and access logs, and whoever reads "
            "them can post to the channel.",
            "Send X-Service-Channel-Secret (Telegram: the polling mode needs no webhook, "
            "or secret_token); for WhatsApp set config.appSecret and drop ?secret= from "
            "the callback URL: Meta's signature then authenticates each call.",
        )
    ]


@audit_check
def check_plain_http_upstreams(svc: Service) -> list:
    cfg, out = svc.config, []
    if cfg.relay_url and _off_loopback_http(cfg.relay_url):
        out.append(
            finding(
                "relay-plain-http",
                "medium",
                "The relay is plain HTTP",
                "Requests, notes and the key cross the network unencrypted.",
                "Serve the relay over HTTPS and set SERVICE_RELAY_URL=https://...",
            )
        )
    if cfg.agent_provider == "openai" and _off_loopback_http(cfg.agent_base_url):
        severity = "high" if cfg.agent_api_key else "medium"
        out.append(
            finding(
                "model-plain-http",
                severity,
                "The model endpoint is plain HTTP",
                "Questions and note passages (and the model key) travel unencrypted.",
                "Use an https:// SERVICE_AGENT_BASE_URL or a model on this machine.",
            )
        )
    return out


@audit_check
def check_relay_in_transit(svc: Service) -> list:
    cfg = svc.config
    host = urllib.parse.urlsplit(cfg.relay_url).hostname or ""
    if cfg.pairing != "relay" or not cfg.relay_url or is_loopback(host) or host == "localhost":
        return []
    return [
        finding(
            "relay-sees-transit",
            "info",
            "Requests pass through a relay on another machine",
            f"The relay at {host} stores nothing at rest, but TLS ends there: whoever runs it "
            "could read the key and the notes in transit, and it learns addresses, server "
            "ids, timing and sizes. Losing it costs availability only.",
            "Run your own relay (python3 notesvc.py relay) or use one run by someone you trust.",
        )
    ]


@audit_check
def check_key_age(svc: Service) -> list:
    days = key_age_days(svc.state.read())
    if days is None or days <= KEY_MAX_AGE_DAYS:
        return []
    return [
        finding(
            "key-old",
            "medium",
            "The API key is old",
            f"The key is {days} days old (more than {KEY_MAX_AGE_DAYS}).",
            "Rotate it: POST /api/v1/auth/rotate or python notesvc.py rotate-key.",
        )
    ]


@audit_check
def check_history_off(svc: Service) -> list:
    if svc.config.history_max_versions:
        return []
    return [
        finding(
            "history-off",
            "low",
            "Note history is off",
            "SERVICE_HISTORY_MAX_VERSIONS=0: an overwritten or mangled note (by hand, an "
            "agent or a channel) cannot be brought back; only deleted notes go to the trash.",
            "Set SERVICE_HISTORY_MAX_VERSIONS to a number of versions to keep (default 50).",
        )
    ]


@audit_check
def check_plain_http_bind(svc: Service) -> list:
    cfg = svc.config
    if cfg.host not in ("0.0.0.0", "::", "") or cfg.trust_proxy:
        return []
    if cfg.public_url.startswith("https://"):
        return []
    return [
        finding(
            "plain-http-all-interfaces",
            "medium",
            "Listening on every interface without TLS",
            f"Bound to {cfg.host or '*'}:{cfg.port} in plain HTTP with no trusted proxy: "
            "the key and notes cross the network in clear.",
            "Put a TLS proxy in front (SERVICE_TRUST_PROXY=true, SERVICE_PUBLIC_URL="
            "https://...) or bind to 127.0.0.1 and use the relay.",
        )
    ]


SHARE_OLD_DAYS = 90
MANY_OAUTH_CLIENTS = 20


@audit_check
def check_grants(svc: Service) -> list:
    """Scoped keys and OAuth grants that may write and never expire."""
    forever = [
        g
        for g in svc.state.read().get("grants", [])
        if g.get("scope") == "write" and not g.get("expiresAt")
    ]
    if not forever:
        return []
    names = ", ".join(sorted(_clean_name(g.get("name"), g["id"], 40) for g in forever)[:5])
    return [
        finding(
            "grant-write-forever",
            "low",
            "A key that may write never expires",
            f"{len(forever)} grant(s) with the write scope and no expiry: {names}.",
            "Give write keys an expiry (expiresInDays), or revoke the ones no longer used "
            "(DELETE /api/v1/auth/keys/:id).",
        )
    ]


@audit_check
def check_share_links(svc: Service) -> list:
    """Share links created over 90 days ago and still open."""
    now = time.time()
    old = [
        s
        for s in svc.state.read().get("shares", [])
        if _epoch(s.get("expiresAt")) > now
        and _epoch(s.get("createdAt")) < now - SHARE_OLD_DAYS * 86400
    ]
    if not old:
        return []
    return [
        finding(
            "share-links-old",
            "low",
            "Old share links are still open",
            f"{len(old)} share link(s) were created over {SHARE_OLD_DAYS} days ago and "
            "still open their note to anyone who has the link.",
            "Revoke the links no longer needed: DELETE /api/v1/shares/:id.",
        )
    ]


@audit_check
def check_oauth_clients(svc: Service) -> list:
    """Many registered OAuth clients (registration is open, as the MCP spec expects)."""
    count = len(svc.state.read().get("oauthClients", {}))
    if count <= MANY_OAUTH_CLIENTS:
        return []
    return [
        finding(
            "oauth-clients-many",
            "info",
            "Many OAuth clients are registered",
            f"{count} clients registered themselves (at most {MAX_OAUTH_CLIENTS} are kept; "
            f"unused ones go after {OAUTH_CLIENT_UNUSED_DAYS} days). Registering grants "
            "nothing: each still needs your approval with the API key.",
            "Nothing to do unless you did not expect it; GET /api/v1/auth/keys lists the "
            "clients you approved.",
        )
    ]


def run_audit(svc: Service) -> dict:
    """Return {score, findings (most severe first), summary, checkedAt}."""
    findings = []
    for name, check in AUDIT_CHECKS.items():
        try:
            findings += check(svc)
        except Exception as e:  # a broken check must not hide the others
            log.exception("audit check %s failed", name)
            findings.append(
                finding(  # not info: a check that cannot run must not raise the score
                    f"check-{name}",
                    "medium",
                    f"Check {name} failed",
                    f"{type(e).__name__}",
                    "Report this as a bug.",
                )
            )
    findings.sort(key=lambda f: SEVERITIES.index(f["severity"]))
    summary = {s: sum(f["severity"] == s for f in findings) for s in SEVERITIES}
    score = max(0, 100 - sum(SEVERITY_COST[f["severity"]] for f in findings))
    return {"score": score, "findings": findings, "summary": summary, "checkedAt": iso(utcnow())}


# == Web client =================================================================
#
# One self-contained page: inline CSS and JS (allowed by their hashes in the CSP), no
# CDN, no build step. It uses only the public API. Data goes in as text nodes only.

# --- begin web/app.css ---
WEB_CSS = r"""

:root {
  color-scheme: light dark;
  --bg: #ffffff;
  --fg: #1b1f24;
  --muted: #57606a;
  --line: #d0d7de;
  --surface: #f6f8fa;
  --hover: #eaeef2;
  --accent: #0a58ca;
  --accent-fg: #ffffff;
  --mark: #fff0a0;
  --mark-fg: #1b1f24;
  --err: #b42318;
  --warn-bg: #fff4e5;
  --code: #eff1f3;
  --focus: #0a58ca;
  --me: #ddeaff;
  --add-bg: #dafbe1;
  --del-bg: #ffebe9;
}
@media (prefers-color-scheme: dark) {
  :root {
    --bg: #0f1419;
    --fg: #e6edf3;
    --muted: #9ba7b4;
    --line: #30363d;
    --surface: #161b22;
    --hover: #21262d;
    --accent: #58a6ff;
    --accent-fg: #0b1220;
    --mark: #6b5800;
    --mark-fg: #fff8d6;
    --err: #ff8a80;
    --warn-bg: #3a2a10;
    --code: #1f252d;
    --focus: #79b8ff;
    --me: #15304f;
    --add-bg: #12361f;
    --del-bg: #4a1d1d;
  }
}
* {
  box-sizing: border-box;
}
[hidden] {
  display: none !important;
}
html,
body {
  height: 100%;
}
body {
  margin: 0;
  background: var(--bg);
  color: var(--fg);
  font:
    16px/1.5 system-ui,
    -apple-system,
    "Segoe UI",
    Roboto,
    sans-serif;
  -webkit-text-size-adjust: 100%;
}
::placeholder {
  color: var(--muted);
  opacity: 1;
}
button,
input,
textarea,
select {
  font: inherit;
  color: inherit;
}
input,
textarea {
  background: var(--bg);
  border: 1px solid var(--line);
  border-radius: 8px;
  padding: 0.45rem 0.6rem;
  min-width: 0;
}
button {
  background: var(--surface);
  border: 1px solid var(--line);
  border-radius: 8px;
  padding: 0.4rem 0.75rem;
  cursor: pointer;
  min-height: 36px;
}
button:hover {
  background: var(--hover);
}
button:disabled {
  cursor: default;
  opacity: 0.6;
}
button.primary {
  background: var(--accent);
  border-color: var(--accent);
  color: var(--accent-fg);
}
button.primary:hover {
  filter: brightness(1.08);
}
button.plain {
  background: none;
  border-color: transparent;
}
button.danger {
  color: var(--err);
}
:focus-visible {
  outline: 3px solid var(--focus);
  outline-offset: 1px;
}
input:focus-visible,
textarea:focus-visible {
  outline-offset: -1px;
}
.sr {
  position: absolute;
  width: 1px;
  height: 1px;
  overflow: hidden;
  clip: rect(0 0 0 0);
  white-space: nowrap;
}
.muted {
  color: var(--muted);
}
.err {
  color: var(--err);
}
mark {
  background: var(--mark);
  color: var(--mark-fg);
  border-radius: 2px;
}
.icon {
  width: 22px;
  height: 22px;
  fill: none;
  stroke: currentColor;
  stroke-width: 2;
  stroke-linecap: round;
  stroke-linejoin: round;
  flex: none;
}

/* -- the key screen -- */
#login {
  max-width: 28rem;
  margin: 0 auto;
  padding: 12vh 1.25rem 2rem;
}
#login h1 {
  display: flex;
  align-items: center;
  gap: 0.5rem;
  margin: 0 0 0.5rem;
}
#login h1 svg {
  width: 40px;
  height: 40px;
}
#login label {
  display: block;
  margin-top: 1rem;
  font-weight: 600;
}
#login input[type="password"],
#login input[type="text"] {
  width: 100%;
  margin-top: 0.3rem;
  min-height: 44px;
}
#login .check {
  display: flex;
  gap: 0.5rem;
  align-items: center;
  font-weight: 400;
}
#login .check input {
  width: 20px;
  height: 20px;
}
#connect {
  width: 100%;
  margin-top: 1rem;
  min-height: 44px;
}
#remember-warn {
  background: var(--warn-bg);
  padding: 0.5rem 0.75rem;
  border-radius: 8px;
  margin: 0.5rem 0 0;
}
#login details {
  margin-top: 1rem;
}
#login summary {
  cursor: pointer;
  color: var(--muted);
}

/* -- the application: a bar, the panes, and (on a phone) the tabs -- */
#app {
  display: grid;
  grid-template-rows: auto minmax(0, 1fr) auto;
  height: 100vh;
  height: var(--app-h, 100dvh);
}
.bar {
  display: flex;
  align-items: center;
  gap: 0.5rem;
  padding: 0.5rem 0.75rem;
  background: var(--surface);
  border-bottom: 1px solid var(--line);
}
.brand {
  display: flex;
  align-items: center;
  gap: 0.4rem;
  font-weight: 700;
}
.brand svg {
  width: 28px;
  height: 28px;
}
#search {
  flex: 1 1 0;
  width: 0; /* its own width never widens the bar: it takes what is left */
  min-width: 0;
  max-width: 36rem;
  min-height: 40px;
  margin-right: auto;
}
.bar .spacer {
  flex: 1;
}
.menu {
  position: relative;
}
.menu > summary {
  list-style: none;
  cursor: pointer;
  display: flex;
  align-items: center;
  justify-content: center;
  min-width: 40px;
  min-height: 40px;
  border-radius: 8px;
}
.menu > summary::-webkit-details-marker {
  display: none;
}
.menu > summary:hover {
  background: var(--hover);
}
.menu-list {
  position: absolute;
  right: 0;
  top: calc(100% + 4px);
  z-index: 20;
  display: flex;
  flex-direction: column;
  min-width: 12rem;
  background: var(--bg);
  border: 1px solid var(--line);
  border-radius: 10px;
  box-shadow: 0 8px 24px rgba(0, 0, 0, 0.18);
  padding: 0.3rem;
}
.menu-list button {
  text-align: left;
  border: 0;
  background: none;
  min-height: 40px;
}
.menu-list button:hover {
  background: var(--hover);
}

main {
  display: grid;
  grid-template-columns: minmax(15rem, 20rem) minmax(0, 1fr) minmax(18rem, 24rem);
  min-height: 0;
}
main.side-closed {
  grid-template-columns: minmax(15rem, 20rem) minmax(0, 1fr);
}
main.side-closed #pane-ask {
  display: none;
}
.pane {
  min-height: 0;
  min-width: 0;
  overflow: auto;
  grid-row: 1;
}
#pane-notes,
#pane-search {
  grid-column: 1;
  border-right: 1px solid var(--line);
  padding: 0.5rem;
}
#pane-note {
  grid-column: 2;
  display: flex;
  flex-direction: column;
  overflow: hidden;
}
#pane-ask {
  grid-column: 3;
  border-left: 1px solid var(--line);
  display: flex;
  flex-direction: column;
  padding: 0.5rem;
  overflow: hidden;
}
#app:not(.searching) #pane-search {
  display: none;
}
#app.searching #pane-notes {
  display: none;
}
.tabs {
  display: none;
}

/* -- the notes pane: capture, tree -- */
.capture {
  display: flex;
  gap: 0.4rem;
  margin-bottom: 0.5rem;
}
.capture input {
  flex: 1;
}
.pane-tools {
  display: flex;
  gap: 0.4rem;
  margin-bottom: 0.5rem;
}
.pane-tools button {
  flex: 1;
}
/* the recent list: title, a line of the text, when */
.list-head {
  margin: 0.75rem 0 0.25rem;
  font-size: 0.8rem;
  font-weight: 700;
  letter-spacing: 0.04em;
  text-transform: uppercase;
  color: var(--muted);
}
details > summary.list-head {
  cursor: pointer;
  min-height: 32px;
  display: flex;
  align-items: center;
}
#recent {
  list-style: none;
  margin: 0;
  padding: 0;
}
#recent li.muted {
  padding: 0.5rem 0.4rem;
  color: var(--muted);
}
.recent-note {
  display: grid;
  grid-template-columns: minmax(0, 1fr) auto;
  column-gap: 0.5rem;
  width: 100%;
  min-height: 44px;
  text-align: left;
  background: none;
  border: 0;
  border-bottom: 1px solid var(--line);
  border-radius: 0;
  padding: 0.5rem 0.4rem;
  color: var(--fg);
}
.recent-note:hover {
  background: var(--hover);
}
.recent-note[aria-current="true"] {
  background: var(--hover);
  box-shadow: inset 3px 0 0 var(--accent);
}
.recent-note strong {
  overflow: hidden;
  text-overflow: ellipsis;
  white-space: nowrap;
}
.recent-note small {
  grid-column: 2;
  grid-row: 1;
  font-size: 0.8rem;
  white-space: nowrap;
}
.recent-note .preview {
  grid-column: 1 / -1;
  color: var(--muted);
  font-size: 0.9rem;
  overflow: hidden;
  display: -webkit-box;
  -webkit-line-clamp: 2;
  -webkit-box-orient: vertical;
}
#offline-state {
  align-self: center;
  flex: none;
  font-size: 0.8rem;
  padding: 0.2rem 0.6rem;
  border-radius: 999px;
  background: var(--warn-bg);
  white-space: nowrap;
}
#offline-state.ready {
  background: var(--add-bg);
}
#tree ul {
  list-style: none;
  margin: 0;
  padding: 0 0 0 0.9rem;
}
#tree > ul {
  padding-left: 0;
}
#tree button {
  display: flex;
  align-items: center;
  gap: 0.35rem;
  width: 100%;
  text-align: left;
  background: none;
  border: 0;
  border-radius: 6px;
  padding: 0.25rem 0.4rem;
  min-height: 32px;
  overflow-wrap: anywhere;
}
#tree button:hover {
  background: var(--hover);
}
#tree button[aria-current="true"] {
  background: var(--accent);
  color: var(--accent-fg);
}
#tree .dir {
  font-weight: 600;
}
#tree .caret {
  display: inline-block;
  width: 0.9em;
  flex: none;
  color: var(--muted);
}
#tree .caret::before {
  content: "▸";
}
#tree .dir[aria-expanded="true"] .caret::before {
  content: "▾";
}
#tree .count {
  margin-left: auto;
  font-weight: 400;
  font-size: 0.8rem;
  color: var(--muted);
}
#tree .empty {
  color: var(--muted);
  padding: 0.25rem 0.4rem;
}

/* -- search results -- */
#results-head {
  display: flex;
  justify-content: space-between;
  align-items: center;
  gap: 0.5rem;
  margin-bottom: 0.3rem;
}
#results-info {
  color: var(--muted);
  font-size: 0.9rem;
}
#results {
  list-style: none;
  margin: 0;
  padding: 0;
}
#results button {
  display: block;
  width: 100%;
  text-align: left;
  background: none;
  border: 0;
  border-bottom: 1px solid var(--line);
  border-radius: 0;
  padding: 0.5rem 0.4rem;
}
#results button:hover,
#results button:focus-visible {
  background: var(--hover);
}
#results .t {
  display: block;
  font-weight: 600;
}
#results .p {
  display: block;
  font-size: 0.8rem;
  color: var(--muted);
  overflow-wrap: anywhere;
}
#results .s {
  display: block;
  font-size: 0.9rem;
  overflow-wrap: anywhere;
}

/* -- the note -- */
.note-bar {
  display: flex;
  align-items: center;
  gap: 0.4rem;
  padding: 0.4rem 0.6rem;
  border-bottom: 1px solid var(--line);
  background: var(--bg);
}
.note-title {
  flex: 1;
  min-width: 0;
}
.note-title strong {
  display: block;
  overflow: hidden;
  text-overflow: ellipsis;
  white-space: nowrap;
}
.note-title small {
  display: block;
  color: var(--muted);
  overflow: hidden;
  text-overflow: ellipsis;
  white-space: nowrap;
}
#back {
  display: none;
}
#status {
  font-size: 0.85rem;
  color: var(--muted);
  white-space: nowrap;
}
/* typed, not saved yet: autosave sends it in a second (quiet); a save that failed: loud */
#status.dirty {
  color: var(--muted);
}
#status.bad {
  color: var(--err);
  font-weight: 600;
}
.banner {
  margin: 0.5rem 0.6rem 0;
  padding: 0.5rem 0.75rem;
  border-radius: 8px;
  background: var(--warn-bg);
}
.banner button {
  margin: 0.25rem 0.25rem 0 0;
}
#view {
  flex: 1;
  overflow: auto;
  padding: 0.5rem 1.25rem 2rem;
  overflow-wrap: break-word;
}
#editor {
  flex: 1;
  width: 100%;
  resize: none;
  border: 0;
  border-radius: 0;
  padding: 0.75rem 1rem;
  font:
    15px/1.55 ui-monospace,
    "SF Mono",
    Menlo,
    Consolas,
    monospace;
  background: var(--bg);
}
#empty {
  flex: 1;
  display: flex;
  flex-direction: column;
  align-items: center;
  justify-content: center;
  gap: 0.75rem;
  padding: 2rem;
  text-align: center;
  color: var(--muted);
}
#backlinks {
  padding: 0.5rem 1.25rem 1rem;
  border-top: 1px solid var(--line);
  font-size: 0.9rem;
}
#backlinks ul {
  margin: 0.25rem 0 0;
  padding-left: 1.2rem;
}

/* -- Markdown -- */
.md {
  max-width: 46rem;
}
.md h1,
.md h2,
.md h3,
.md h4,
.md h5,
.md h6 {
  line-height: 1.25;
  margin: 1.2em 0 0.5em;
}
.md h1 {
  font-size: 1.7rem;
}
.md h2 {
  font-size: 1.4rem;
}
.md h3 {
  font-size: 1.2rem;
}
.md h4,
.md h5,
.md h6 {
  font-size: 1rem;
}
.md > :first-child {
  margin-top: 0.6rem;
}
.md p {
  margin: 0.6em 0;
}
.md a,
.link {
  color: var(--accent);
  text-decoration: underline;
  cursor: pointer;
  background: none;
  border: 0;
  padding: 0;
  font: inherit;
  min-height: 0;
}
.md code {
  background: var(--code);
  padding: 0.1em 0.3em;
  border-radius: 4px;
  font:
    0.9em ui-monospace,
    Menlo,
    Consolas,
    monospace;
}
.md pre {
  background: var(--code);
  padding: 0.75rem;
  border-radius: 8px;
  overflow: auto;
}
.md pre code {
  background: none;
  padding: 0;
}
.md blockquote {
  margin: 0.6em 0;
  padding: 0.1em 1em;
  border-left: 4px solid var(--line);
  color: var(--muted);
}
.md ul,
.md ol {
  padding-left: 1.6em;
}
.md li.task {
  list-style: none;
  margin-left: -1.4em;
}
/* A task is a 44 px row: the whole row (its label) ticks the box. */
.md li.task > label {
  display: flex;
  align-items: flex-start;
  gap: 0.6em;
  min-height: 44px;
  padding: 10px 0;
  box-sizing: border-box;
  cursor: pointer;
}
.md li.task input {
  flex: none;
  width: 24px;
  height: 24px;
  margin: -1px 0 0;
  accent-color: var(--accent);
  cursor: pointer;
}
.md li.task:has(input:checked) > label {
  color: var(--muted);
}
.md hr {
  border: 0;
  border-top: 1px solid var(--line);
  margin: 1.2em 0;
}
.md .table {
  overflow-x: auto;
}
.md table {
  border-collapse: collapse;
  margin: 0.6em 0;
}
.md th,
.md td {
  border: 1px solid var(--line);
  padding: 0.3em 0.6em;
}
.md th {
  background: var(--surface);
}
.md .al-c {
  text-align: center;
}
.md .al-r {
  text-align: right;
}
.md img {
  max-width: 100%;
  height: auto;
  border-radius: 6px;
}
.md .front {
  font-size: 0.85rem;
  color: var(--muted);
}

/* -- ask -- */
#chat-log {
  flex: 1;
  overflow: auto;
  display: flex;
  flex-direction: column;
  gap: 0.6rem;
  padding: 0.25rem 0;
}
.msg {
  padding: 0.5rem 0.75rem;
  border-radius: 10px;
  background: var(--surface);
  overflow-wrap: anywhere;
}
.msg.me {
  background: var(--me);
  align-self: flex-end;
  max-width: 90%;
  white-space: pre-wrap;
}
.msg .md {
  font-size: 0.95rem;
}
.msg .sources {
  font-size: 0.85rem;
  margin: 0.4rem 0 0;
  padding-left: 1.1rem;
}
.ask-form {
  display: flex;
  flex-direction: column;
  gap: 0.4rem;
  border-top: 1px solid var(--line);
  padding-top: 0.5rem;
}
.ask-form .row {
  display: flex;
  gap: 0.4rem;
}
.ask-form .row input {
  flex: 1;
}
.ask-form .check {
  display: flex;
  gap: 0.4rem;
  align-items: center;
  font-size: 0.9rem;
}
.ask-form .check input {
  width: 18px;
  height: 18px;
}
.pane h2 {
  font-size: 1rem;
  margin: 0.2rem 0 0.5rem;
}

/* -- dialogs and the toast -- */
dialog {
  border: 1px solid var(--line);
  border-radius: 12px;
  background: var(--bg);
  color: var(--fg);
  padding: 1rem 1.25rem;
  width: min(92vw, 30rem);
}
dialog::backdrop {
  background: rgba(0, 0, 0, 0.45);
}
dialog h2 {
  margin: 0 0 0.5rem;
  font-size: 1.15rem;
}
dialog label {
  display: block;
  font-weight: 600;
  margin-top: 0.5rem;
}
dialog input[type="text"] {
  width: 100%;
  margin-top: 0.3rem;
  min-height: 44px;
}
dialog .check {
  display: flex;
  align-items: center;
  gap: 0.5rem;
  font-weight: 400;
}
dialog .check input {
  width: 20px;
  height: 20px;
}
dialog .buttons {
  display: flex;
  flex-wrap: wrap;
  justify-content: flex-end;
  gap: 0.5rem;
  margin-top: 1rem;
}
dialog .buttons button {
  min-height: 44px;
}
dialog .list {
  list-style: none;
  padding: 0;
  margin: 0.5rem 0;
  max-height: 50vh;
  overflow: auto;
}
dialog .list li {
  display: flex;
  flex-wrap: wrap;
  gap: 0.5rem;
  align-items: center;
  justify-content: space-between;
  padding: 0.35rem 0;
  border-bottom: 1px solid var(--line);
}
dialog pre {
  white-space: pre-wrap;
  max-height: 50vh;
  overflow: auto;
  background: var(--code);
  padding: 0.5rem;
  border-radius: 8px;
  font-size: 0.85rem;
}
#toast {
  position: fixed;
  left: 50%;
  transform: translateX(-50%);
  bottom: 1rem;
  z-index: 30;
  max-width: min(92vw, 32rem);
  padding: 0.6rem 1rem;
  border-radius: 10px;
  background: var(--fg);
  color: var(--bg);
  box-shadow: 0 6px 20px rgba(0, 0, 0, 0.25);
}
#toast.bad {
  background: var(--err);
  color: var(--bg);
}

/* -- a phone: one pane at a time, tabs at the bottom, large targets -- */
@media (max-width: 799px) {
  main,
  main.side-closed {
    grid-template-columns: minmax(0, 1fr);
  }
  .pane {
    grid-column: 1 !important;
    display: none !important;
    border: 0 !important;
  }
  #app[data-pane="notes"] #pane-notes,
  #app[data-pane="search"] #pane-search,
  #app[data-pane="ask"] #pane-ask {
    display: flex !important;
    flex-direction: column;
  }
  #app[data-pane="note"] #pane-note {
    display: flex !important;
  }
  #pane-notes,
  #pane-search {
    display: block;
  }
  #toggle-ask,
  .brand span {
    display: none;
  }
  #back {
    display: flex;
  }
  #status .word {
    position: absolute;
    width: 1px;
    height: 1px;
    overflow: hidden;
    clip: rect(0 0 0 0);
  }
  .tabs {
    display: grid;
    grid-template-columns: repeat(4, 1fr);
    border-top: 1px solid var(--line);
    background: var(--surface);
    padding-bottom: env(safe-area-inset-bottom);
  }
  .tabs button {
    display: flex;
    flex-direction: column;
    align-items: center;
    gap: 2px;
    background: none;
    border: 0;
    border-radius: 0;
    min-height: 56px;
    font-size: 0.75rem;
    padding: 0.3rem 0;
  }
  .tabs button[aria-current="page"] {
    color: var(--accent);
    font-weight: 700;
  }
  #app.typing .tabs {
    display: none;
  }
  button,
  .menu > summary {
    min-height: 44px;
    min-width: 44px;
  }
  #tree button {
    min-height: 44px;
  }
  input:not([type="checkbox"]) {
    min-height: 44px;
  }
  #view {
    padding: 0.25rem 1rem 2rem;
  }
  .note-bar {
    padding: 0.3rem 0.4rem;
  }
  #toast {
    bottom: calc(64px + env(safe-area-inset-bottom));
  }
}

#save.clean {
  background: var(--surface);
  border-color: var(--line);
  color: var(--fg);
}
.hint {
  color: var(--muted);
  font-size: 0.9rem;
}

/* history: a timeline, and what changed word by word */
ol.timeline {
  list-style: none;
  margin: 0.5rem 0;
  padding: 0 0 0 0.9rem;
  border-left: 2px solid var(--line);
  max-height: 45vh;
  overflow: auto;
}
ol.timeline li {
  position: relative;
  display: flex;
  flex-wrap: wrap;
  align-items: center;
  gap: 0.3rem 0.5rem;
  padding: 0.4rem 0;
}
ol.timeline li::before {
  content: "";
  position: absolute;
  left: calc(-0.9rem - 6px);
  top: 0.95rem;
  width: 10px;
  height: 10px;
  border-radius: 50%;
  background: var(--accent);
}
ol.timeline .when {
  display: flex;
  flex-direction: column;
  flex: 1 1 10rem;
  min-width: 0;
}
ol.timeline .actions {
  display: flex;
  gap: 0.3rem;
}
p.words {
  white-space: pre-wrap;
  overflow-wrap: anywhere;
  max-height: 40vh;
  overflow: auto;
  background: var(--code);
  padding: 0.5rem;
  border-radius: 8px;
  font-size: 0.9rem;
}
p.words ins {
  background: var(--add-bg);
  text-decoration: underline;
}
p.words del {
  background: var(--del-bg);
  text-decoration: line-through;
}
p.words .gap {
  color: var(--muted);
}
dialog .list .actions {
  display: flex;
  gap: 0.3rem;
  margin-left: auto;
}
dialog h3 {
  font-size: 1rem;
  margin: 0.75rem 0 0.25rem;
}
#toast {
  display: flex;
  align-items: center;
  gap: 0.5rem;
}
#toast[hidden] {
  display: none;
}
#toast button {
  color: inherit;
  background: none;
  border: 1px solid currentColor;
  font-weight: 700;
  min-height: 44px;
  min-width: 64px;
  padding: 0 0.9rem;
  margin-left: auto;
}
.md audio,
.md video {
  display: block;
  max-width: 100%;
  margin: 0.4rem 0;
}
.md a.file::before {
  content: "↓ ";
}
.md a.file.media::before {
  content: "▶ ";
}
/* -- keys, connections and share links -- */
dialog select {
  display: block;
  width: 100%;
  min-height: 44px;
  margin-top: 0.3rem;
}
dialog .once {
  display: flex;
  flex-wrap: wrap;
  gap: 0.4rem;
  align-items: end;
}
dialog .once label {
  flex-basis: 100%;
}
dialog .once input {
  flex: 1;
  min-width: 0;
  font-family: ui-monospace, monospace;
}
dialog .new-key button,
#share-create {
  margin-top: 0.75rem;
}
.warn {
  background: var(--warn-bg);
  padding: 0.4rem 0.6rem;
  border-radius: 8px;
}
/* devices: the QR code to scan, the copy fallback's field, a joined device */
img.qr {
  display: block;
  width: min(70vw, 260px);
  height: auto;
  margin: 0.5rem auto;
  padding: 8px;
  background: #ffffff;
  border-radius: 8px;
  image-rendering: pixelated;
}
.offscreen {
  position: fixed;
  top: 0;
  left: -10000px;
  width: 1px;
  height: 1px;
  opacity: 0;
}
.ok {
  color: var(--fg);
  background: var(--add-bg);
  padding: 0.4rem 0.6rem;
  border-radius: 8px;
  font-weight: 600;
}
#setup-box,
#pair-box {
  margin: 1rem 0 1.5rem;
  padding: 0.8rem 1rem 1rem;
  border: 1px solid var(--line);
  border-radius: 12px;
  background: var(--surface);
}
#setup-box .primary,
#pair-box .primary {
  margin-top: 0.75rem;
  width: 100%;
}
dialog .row {
  display: flex;
  gap: 0.5rem;
  flex-wrap: wrap;
  margin: 0.5rem 0;
}
dialog ol {
  padding-left: 1.3rem;
}
#code-box button {
  margin-top: 0.5rem;
  min-height: 44px;
}
"""[1:]
# --- end web/app.css ---

# --- begin web/core.js ---
WEB_JS_START = r"""
"use strict";
// notesvc's web client: one page, no build step, only the public API.
// Requests, the key included, go only to the origin this page was loaded from: a relayUrl
// in the query string is ignored, and an API base on another origin is never used.
// Text from notes and answers reaches the page as text nodes only (never as HTML).

const $ = (id) => document.getElementById(id);
const enc = encodeURIComponent;
const NARROW = window.matchMedia("(max-width: 799px)");

// -- storage: the key for the session (or this device, if asked); drafts on this device --
// On a relay's shared origin (a relay without per-server origins, which marks the page)
// every server's page shares one storage: nothing is kept there at all.

const SHARED_ORIGIN = document.documentElement.dataset.origin === "shared";

function storage(kind) {
  if (SHARED_ORIGIN) return null;
  try {
    return kind === "local" ? window.localStorage : window.sessionStorage;
  } catch (e) {
    return null;
  } // storage can be switched off; the page still works
}
function getItem(kind, name) {
  const s = storage(kind);
  try {
    return s ? s.getItem(name) : null;
  } catch (e) {
    return null;
  }
}
function setItem(kind, name, value) {
  const s = storage(kind);
  try {
    if (s) s.setItem(name, value);
  } catch (e) {
    /* full or refused: not fatal */
  }
}
function removeItem(kind, name) {
  const s = storage(kind);
  try {
    if (s) s.removeItem(name);
  } catch (e) {
    /* ignore */
  }
}

const state = {
  base: "", // the API base on this origin: /api/v1, or /r/<serverId>/api/v1
  key: "",
  keyBase: "", // the API base the key was given for: it is sent nowhere else
  path: null, // the open note
  etag: null, // the ETag the editor's text was loaded from (sent as If-Match)
  saved: "", // the note's text as last loaded or saved
  title: "",
  editing: false,
  expanded: new Set(JSON.parse(getItem("session", "notesvc.expanded") || "[]")),
};

// What this server offers beyond the core API (read from its OpenAPI document at start).
const features = {history: false, attachments: false, changes: false};

// -- small DOM helpers -------------------------------------------------------------------

function ago(iso) {
  const t = Date.parse(iso);
  if (!t) return "";
  const s = (Date.now() - t) / 1000;
  if (s < 60) return "just now";
  if (s < 3600) return Math.floor(s / 60) + " min ago";
  if (s < 86400) return Math.floor(s / 3600) + " h ago";
  if (s < 2 * 86400) return "yesterday";
  return new Date(t).toLocaleDateString();
}

let toastTimer = 0;
function toast(text, bad, action) {
  const t = $("toast");
  // A modal dialog sits above everything else: a message then shows inside it, not under.
  const host = $("dlg").open ? $("dlg") : document.body;
  if (t.parentNode !== host) host.append(t);
  t.textContent = text;
  if (action) {
    const [label, fn] = action;
    const run = act(fn);
    const done = () => {
      t.hidden = true;
      run();
    };
    t.append(" ", el("button", {type: "button", class: "plain", onclick: done}, label));
  }
  t.className = bad ? "bad" : "";
  t.setAttribute("role", bad ? "alert" : "status");
  t.hidden = false;
  clearTimeout(toastTimer);
  // An action (Undo) waits 15 s, and longer while a finger or the focus is on it.
  const hide = () => {
    if (t.matches(":hover, :focus-within")) toastTimer = setTimeout(hide, 2000);
    else t.hidden = true;
  };
  toastTimer = setTimeout(hide, action ? 15000 : bad ? 8000 : 3000);
}

// -- the API -------------------------------------------------------------------------------

class Problem extends Error {
  constructor(status, code, message, retryAfter) {
    super(message);
    this.status = status;
    this.code = code;
    this.retryAfter = retryAfter;
  }
}

function ownOrigin(url) {
  return sameOrigin(url, location.href);
}

function lockoutMessage(retryAfter) {
  const s = parseInt(retryAfter || "60", 10);
  return "Too many wrong keys from this address: try again in " + s + " s.";
}

async function api(method, path, body, headers, opts) {
  opts = opts || {};
  const url = state.base + path;
  if (!state.base || !ownOrigin(url)) {
    throw new Problem(0, "REFUSED", "Refused: the API is not on this page's origin.");
  }
  if (state.key && state.keyBase !== state.base) {
    throw new Problem(0, "REFUSED", "Refused: this key was given for another server.");
  }
  const h = Object.assign({"X-Service-Key": state.key}, headers || {});
  const raw = body instanceof Blob; // an upload goes as it is, with its own type
  if (body !== undefined && !raw) h["Content-Type"] = "application/json";
  let r;
  try {
    r = await fetch(url, {
      method,
      headers: h,
      mode: "same-origin",
      credentials: "omit",
      cache: "no-store",
      body: body === undefined || raw ? body : JSON.stringify(body),
    });
  } catch (e) {
    throw new Problem(0, "NETWORK", "Cannot reach the server. Check the connection and try again.");
  }
  if (opts.blob && r.ok) return {blob: await r.blob(), status: r.status};
  if (opts.raw && r.ok) return {json: await r.json(), status: r.status};
  let j = null;
  try {
    j = await r.json();
  } catch (e) {
    /* not JSON */
  }
  if (r.ok && j && j.success) {
    // the server answers again: what waits on this device goes now
    if (offline.items.length && !offline.sending) sendOutbox().catch(() => {});
    return {data: j.data, etag: r.headers.get("ETag"), status: r.status};
  }
  const err = (j && j.error) || {
    code: "HTTP_" + r.status,
    message: "The server answered " + r.status + ".",
  };
  const retry = r.headers.get("Retry-After");
  const message = r.status === 429 ? lockoutMessage(retry) : err.message;
  const problem = new Problem(r.status, err.code, message, retry);
  problem.error = err; // the envelope's error, with any extra fields (410's resetRequired)
  if (!opts.login && (r.status === 401 || r.status === 429)) {
    toKeyScreen(
      r.status === 401
        ? "The key was not accepted: it may have been rotated. Paste the current key."
        : message,
      r.status,
    );
  }
  throw problem;
}

// Run an event handler; show what went wrong instead of failing silently.
function act(fn) {
  return async (...args) => {
    try {
      return await fn(...args);
    } catch (e) {
      if (e instanceof Problem && (e.status === 401 || e.status === 429)) return undefined;
      toast(e && e.message ? e.message : String(e), true);
      return undefined;
    }
  };
}

// -- connecting: the relay code, the key ---------------------------------------------------

async function resolveBase(code) {
  let r;
  try {
    r = await fetch(new URL("relay/v1/pair/" + enc(code), location.href).pathname, {
      mode: "same-origin",
      credentials: "omit",
      cache: "no-store",
    });
  } catch (e) {
    throw new Error("Cannot reach this address.");
  }
  const j = await r.json().catch(() => ({}));
  if (!r.ok || !j.data) {
    throw new Error(
      j.error && r.status === 404
        ? "The relay code is not known here: open the current connect link from your server."
        : "Pairing failed" + (j.error ? ": " + j.error.message : "."),
    );
  }
  const target = pairTarget(j.data, location.href);
  if (target && target.open) {
    location.assign(target.open); // that server's own page on its relay: its key goes there
    throw new Error("Opening that server's own page…");
  }
  if (!target) throw new Error("Pairing failed.");
  return target.base;
}

function relayCodeGiven() {
  return (
    new URLSearchParams(location.search).get("relayCode") ||
    $("relay-code").value ||
    ""
  ).trim();
}

// The key kept on this device (session or local storage) and the API base it was given for.
function keptKey() {
  const pairs = ["session", "local"].map((kind) => [
    getItem(kind, "notesvc.key"),
    getItem(kind, "notesvc.keyFor"),
  ]);
  return keptEntry(pairs, location.href);
}

// Connect with the key typed, else the one kept for the same API base (never another's).
async function connect(typed) {
  const msg = $("login-msg");
  msg.textContent = "";
  $("connect").disabled = true;
  try {
    const code = relayCodeGiven();
    if (code) {
      try {
        state.base = await resolveBase(code);
      } catch (e) {
        if (!state.base) throw e; // an old code: a server this device knows is still there
      }
    }
    if (!state.base) state.base = new URL("api/v1", location.href).pathname;
    state.key = keyFor(state.base, typed ? $("key").value.trim() : "", keptKey());
    state.keyBase = state.key ? state.base : "";
    if (!state.key) {
      msg.textContent = "Paste the API key first.";
      return;
    }
    let v;
    try {
      v = await api("POST", "/auth/verify", undefined, undefined, {login: true});
      setItem("local", "notesvc.grant", JSON.stringify(v.data.grant || null));
    } catch (e) {
      if (unreachable(e) && offlineOn() && state.keyBase === state.base) {
        // out of reach, and this device keeps the notes: open them from the copy
        const grant = JSON.parse(getItem("local", "notesvc.grant") || "null");
        v = {data: {grant, setupComplete: true}};
      } else if (e.status === 404) {
        state.base = "";
        removeItem("local", "notesvc.base");
        $("relay-box").open = true;
        throw new Error(
          "No notes server answers here. Open your server's connect link, " +
            "or enter its relay code.",
        );
      } else if (e.status === 401) {
        if (!typed) await forgetOffline(); // the key this device kept: no copy stays
        throw new Error(
          "That key was not accepted. Check it and try again " +
            "(a rotated key stops working at once).",
        );
      } else {
        throw e;
      }
    }
    applyGrant(v.data.grant); // a scoped key: only what it may do
    if (!v.data.setupComplete && !v.data.grant) {
      await api("POST", "/auth/link", {clientName: "web client"});
    }
    setItem("local", "notesvc.base", state.base);
    if (new URLSearchParams(location.search).has("relayCode")) {
      history.replaceState(history.state, "", location.pathname); // the code has done its job
    }
    const remember = $("remember").checked || getItem("local", "notesvc.key") !== null;
    setItem(remember ? "local" : "session", "notesvc.key", state.key);
    // Beside the key, the API it opens: the consent page offers the key only to that API
    // (on a relay's origin, other servers' consent pages share this storage).
    setItem(remember ? "local" : "session", "notesvc.keyFor", state.base);
    $("key").value = "";
    $("login").hidden = true;
    $("app").hidden = false;
    fitViewport();
    await act(start)(); // from here on, a failure is shown in the app, not on the key screen
  } catch (e) {
    msg.textContent = e.message || String(e);
  } finally {
    $("connect").disabled = false;
  }
}

function toKeyScreen(message, status) {
  keepDraft();
  feedRun++;
  // the key stopped working: no copy stays (too many tries is not that: the copy stays)
  if (status === 401) forgetOffline().catch(() => {});
  state.key = "";
  state.keyBase = "";
  for (const kind of ["session", "local"]) {
    removeItem(kind, "notesvc.key");
    removeItem(kind, "notesvc.keyFor");
  }
  $("app").hidden = true;
  $("login").hidden = false;
  $("login-msg").textContent = message || "";
  $("key").focus();
}

async function logout() {
  if (!(await confirmLeave("Log out"))) return;
  await sendOutbox().catch(() => {}); // what waits goes first, if it can
  if (!(await letWaitingGo("Log out"))) return;
  if (offlineOn()) {
    // the next key on this device starts from nothing of this one's
    removeItem("local", "notesvc.offline");
    await wipeOffline().catch(() => {});
  }
  for (const kind of ["local", "session"]) {
    const s = storage(kind);
    if (!s) continue;
    for (const name of Object.keys(s)) if (name.startsWith("notesvc.")) removeItem(kind, name);
  }
  state.path = null;
  location.reload();
}

// -- the page's layout: panes on a phone, a side panel on a desktop ------------------------

function showPane(name, fromHistory) {
  const app = $("app");
  if (app.dataset.pane === name) return;
  app.dataset.pane = name;
  for (const b of document.querySelectorAll(".tabs button")) {
    if (b.dataset.pane === name) b.setAttribute("aria-current", "page");
    else b.removeAttribute("aria-current");
  }
  if (NARROW.matches && !fromHistory) history.pushState({pane: name}, "");
}

function fitViewport() {
  // The keyboard on a phone shrinks the visual viewport: keep the bar (and Save) in view.
  const vv = window.visualViewport;
  if (vv) document.documentElement.style.setProperty("--app-h", Math.round(vv.height) + "px");
}

function setSide(open) {
  $("main").classList.toggle("side-closed", !open);
  $("toggle-ask").setAttribute("aria-expanded", String(open));
  setItem("local", "notesvc.ui.side", open ? "open" : "closed");
}

// -- the tree: folders load lazily, one level at a time -------------------------------------

function treeUrl(folder) {
  return (folder === "notes" ? "/folders/tree" : "/folders/tree/" + enc(folder)) + "?depth=1";
}

async function fillFolder(folder, ul) {
  let data;
  try {
    data = (await api("GET", treeUrl(folder))).data;
  } catch (e) {
    if (!unreachable(e) || !offlineOn()) throw e;
    data = await mirrorTree(folder); // out of reach: the copy on this device
  }
  const items = (data.children || []).map(treeItem);
  ul.replaceChildren(...items.map((i) => i.li));
  if (!items.length) {
    ul.appendChild(
      el(
        "li",
        {class: "empty"},
        folder === "notes" ? "No notes yet: start one with New note." : "Empty folder",
      ),
    );
  }
  await Promise.all(items.filter((i) => i.expand).map((i) => i.expand()));
}

function treeItem(node) {
  const li = el("li");
  if (node.type !== "folder") {
    const b = el(
      "button",
      {
        type: "button",
        class: "note",
        "data-path": node.path,
        "aria-current": node.path === state.path ? "true" : null,
      },
      nameOf(node.path),
    );
    b.addEventListener(
      "click",
      act(() => openNote(node.path)),
    );
    li.appendChild(b);
    return {li};
  }
  const b = el(
    "button",
    {type: "button", class: "dir", "aria-expanded": "false", "data-path": node.path},
    el("span", {class: "caret", "aria-hidden": "true"}),
    el("span", {}, node.name),
    node.count === undefined ? null : el("span", {class: "count"}, String(node.count)),
  );
  if (node.count !== undefined)
    b.setAttribute("aria-label", node.name + ", folder, " + node.count + " notes");
  const sub = el("ul");
  sub.hidden = true;
  li.append(b, sub);
  const expand = async () => {
    b.setAttribute("aria-expanded", "true");
    sub.hidden = false;
    state.expanded.add(node.path);
    if (node.children) {
      // a server without ?depth sends the whole subtree
      const items = node.children.map(treeItem);
      sub.replaceChildren(...items.map((i) => i.li));
      await Promise.all(items.filter((i) => i.expand).map((i) => i.expand()));
    } else {
      sub.replaceChildren(el("li", {class: "empty"}, "Loading…"));
      await fillFolder(node.path, sub);
    }
  };
  b.addEventListener(
    "click",
    act(async () => {
      if (b.getAttribute("aria-expanded") === "true") {
        b.setAttribute("aria-expanded", "false");
        sub.hidden = true;
        state.expanded.delete(node.path);
      } else {
        await expand();
      }
      setItem("session", "notesvc.expanded", JSON.stringify([...state.expanded]));
    }),
  );
  return {li, expand: state.expanded.has(node.path) ? expand : null};
}

async function loadTree() {
  loadRecent().catch(() => {});
  const ul = el("ul");
  await fillFolder("notes", ul);
  const focused = $("tree").contains(document.activeElement) && document.activeElement.dataset.path;
  $("tree").replaceChildren(ul);
  markCurrent();
  if (focused) {
    // Refreshed under the keyboard's feet: focus stays on the same entry.
    const again = ul.querySelector('button[data-path="' + CSS.escape(focused) + '"]');
    if (again) again.focus();
  }
  performance.mark("notesvc:tree-shown");
}

// The notes by date, newest first: title, a line of the text, when (the way people find
// what they just wrote; the folders are below it).
async function loadRecent() {
  let notes;
  try {
    const {data} = await api("GET", "/notes?sort=modified&fields=title,preview,modified&limit=30");
    notes = data.notes;
  } catch (e) {
    if (!unreachable(e) || !offlineOn()) throw e;
    notes = await mirrorRecent(30);
  }
  const items = notes.map((n) =>
    el(
      "li",
      {},
      el(
        "button",
        {
          type: "button",
          class: "recent-note",
          "data-path": n.path,
          onclick: act(() => openNote(n.path)),
        },
        el("strong", {}, n.title || nameOf(n.path)),
        el("span", {class: "preview"}, n.preview || ""),
        el("small", {class: "muted"}, ago(n.modified)),
      ),
    ),
  );
  if (!items.length)
    items.push(el("li", {class: "muted"}, "No notes yet: start one with New note."));
  $("recent").replaceChildren(...items);
  markCurrent();
}

function markCurrent() {
  for (const b of $("recent").querySelectorAll("button.recent-note")) {
    if (b.dataset.path === state.path) b.setAttribute("aria-current", "true");
    else b.removeAttribute("aria-current");
  }
  for (const b of $("tree").querySelectorAll("button.note")) {
    if (b.dataset.path === state.path) b.setAttribute("aria-current", "true");
    else b.removeAttribute("aria-current");
  }
}

async function reveal(path) {
  // Open the folders above a note, so the tree shows where it is.
  const parts = path.split("/");
  let changed = false;
  for (let i = 2; i < parts.length; i++) {
    const folder = parts.slice(0, i).join("/");
    if (!state.expanded.has(folder)) {
      state.expanded.add(folder);
      changed = true;
    }
  }
  setItem("session", "notesvc.expanded", JSON.stringify([...state.expanded]));
  if (changed || !$("tree").querySelector('button.note[data-path="' + CSS.escape(path) + '"]'))
    await loadTree();
  else markCurrent();
}
"""[1:]
# --- end web/core.js ---

# --- begin web/paths.js ---
PATHS_JS = r"""
// -- paths and names (pure: no page; node --test web/) -------------------------------------

// A note's name: its file name without .md.
function nameOf(path) {
  return path.split("/").pop().replace(/\.md$/, "");
}

function fileName(path) {
  return path.split("/").pop();
}

// Whether a name is a file other than a note (it has an extension, and it is not .md).
function isAttachmentName(name) {
  const ext = /\.([a-z0-9]{1,5})$/i.exec(fileName(name));
  return !!ext && ext[1].toLowerCase() !== "md";
}

// The note path a person's "folder/name" means: under notes/, ending in .md.
function toNotePath(name) {
  let path = name.trim().replace(/^\/+/, "");
  if (!path.startsWith("notes/")) path = "notes/" + path;
  if (!/\.md$/i.test(path)) path += ".md";
  return path;
}

// The link a note at `from` writes to `path`, so other Markdown editors find it too.
function relativeTo(from, path) {
  const a = from.split("/").slice(0, -1);
  const b = path.split("/");
  let i = 0;
  while (i < a.length && i < b.length - 1 && a[i] === b[i]) i++;
  return "../".repeat(a.length - i) + b.slice(i).map(encodeURIComponent).join("/");
}

// Lower case without accents, the same length (in UTF-16 units) as s.
function fold(s) {
  return s
    .split("")
    .map((c) => c.normalize("NFD")[0].toLowerCase()[0])
    .join("");
}

// The words of a search query to highlight in its snippets (as the server matches them).
function queryWords(q) {
  return fold(q)
    .replace(/(^|\s)-\S+/g, " ")
    .replace(/["*()]/g, " ")
    .split(/\s+/)
    .filter((w) => w && w !== "or" && w.length > 1)
    .map((w) => (w.length > 4 ? w.replace(/(es|s)$/, "") : w));
}

// A snippet's Markdown as plain text.
function plainSnippet(text) {
  return text
    .replace(/\]\([^)\s]*\)/g, "]")
    .replace(/\[[ xX]\]/g, "")
    .replace(/\[\[|\]\]|[[\]]|\*\*|__|`+|~~|==/g, "")
    .replace(/(^|\s)(#{1,6}|>|[-*+]|\|[-:| ]*\|?)(?=\s)/g, "$1")
    .replace(/\s+/g, " ")
    .trim();
}

function sizeText(n) {
  return n < 1024
    ? n + " B"
    : n < 1048576
      ? (n / 1024).toFixed(1) + " KB"
      : (n / 1048576).toFixed(1) + " MB";
}

if (typeof module !== "undefined") {
  module.exports = {
    nameOf,
    fileName,
    isAttachmentName,
    toNotePath,
    relativeTo,
    fold,
    queryWords,
    plainSnippet,
    sizeText,
  };
}
"""[1:]
# --- end web/paths.js ---
# --- begin web/keys.js ---
KEYS_JS = r"""
// -- keys: which key goes where (pure: no page, no storage; node --test web/) ---------------
// A key is kept on a device together with the API base it was given for, and is sent to
// that base only. A pairing code may name any server: what it resolves to decides where
// the page talks, never which key it sends.

// Whether url (absolute or relative to `here`) has the origin of `here`.
function sameOrigin(url, here) {
  try {
    return new URL(url, here).origin === new URL(here).origin;
  } catch (e) {
    return false;
  }
}

// The first kept [key, base] pair that is whole and names an API on this origin (as a
// path: a kept absolute URL is never trusted); null when there is none.
function keptEntry(pairs, here) {
  for (const [key, base] of pairs) {
    if (key && base && sameOrigin(base, here) && !/^[a-z][a-z0-9+.-]*:/i.test(base)) {
      return {key, base};
    }
  }
  return null;
}

// The key to send to `base`: the one typed, else the kept one if it was kept for `base`.
function keyFor(base, typed, kept) {
  if (typed) return typed;
  return kept && kept.base === base ? kept.key : "";
}

// Where a pairing answer ({serverId, relayApiBase, origin?}) leads: {open: <another
// server's own page>} to go to, {base: <API path on this origin>}, or null.
function pairTarget(data, here) {
  const origin = String((data && data.origin) || "");
  if (origin && !sameOrigin(origin, here) && /^https?:\/\/[a-z2-7]{20}\.[^/?#]+$/.test(origin)) {
    return {open: origin + "/"};
  }
  const given = String((data && data.relayApiBase) || "").replace(/\/$/, "");
  if (given && sameOrigin(given, here)) {
    return {base: new URL(given, here).pathname.replace(/\/$/, "")};
  }
  const id = String((data && data.serverId) || ""); // the server's relay prefix, here
  return /^[A-Za-z0-9_-]{1,64}$/.test(id) ? {base: "/r/" + id + "/api/v1"} : null;
}

// A pairing secret as a person types it: groups of four, lower case.
function groupCode(secret) {
  return (
    String(secret)
      .toLowerCase()
      .replace(/[^a-z2-7]/g, "")
      .match(/.{1,4}/g) || []
  ).join("-");
}

if (typeof module !== "undefined") {
  module.exports = {sameOrigin, keptEntry, keyFor, pairTarget, groupCode};
}
"""[1:]
# --- end web/keys.js ---
# --- begin web/merge.js ---
MERGE_JS = r"""
// -- diffs and merges (pure: no page; node --test web/) -----------------------------------
// The same three-way line merge as the server's (merge3 in notesvc.py): the page uses it
// when the person typed on while a save was on its way and the server merged in someone
// else's change meanwhile. The word diff draws a version against another on a phone.

// How long a and b (arrays or strings) are the same from the start, and then from the end
// (never overlapping the start).
function commonEnds(a, b) {
  let pre = 0;
  while (pre < a.length && pre < b.length && a[pre] === b[pre]) pre++;
  let suf = 0;
  while (
    suf < a.length - pre &&
    suf < b.length - pre &&
    a[a.length - 1 - suf] === b[b.length - 1 - suf]
  )
    suf++;
  return [pre, suf];
}

// Past this many differences a diff gives up on the middle: it is one change there (a
// merge then keeps both sides apart, a word diff marks it all), in bounded time and memory.
const MAX_EDITS = 2000;

// Myers' diff of two arrays (by ===): the matching runs, as [aStart, bStart, length]. The
// common start and end are matched first; the middle is searched at most MAX_EDITS deep.
function matches(a, b) {
  const [pre, suf] = commonEnds(a, b);
  const mid = myers(a.slice(pre, a.length - suf), b.slice(pre, b.length - suf)) || [];
  const runs = [[0, 0, pre], ...mid.map(([x, y, len]) => [x + pre, y + pre, len])];
  runs.push([a.length - suf, b.length - suf, suf]);
  return runs.filter((r) => r[2] > 0);
}

// The runs of a against b, or null past MAX_EDITS. Each depth keeps only its own diagonals
// (2d + 3 of them), so the memory is the square of the differences, not of the lengths.
function myers(a, b) {
  const n = a.length;
  const m = b.length;
  const max = n + m;
  const v = new Int32Array(2 * max + 3);
  const trace = [];
  let done = max === 0;
  for (let d = 0; d <= max && !done; d++) {
    if (d > MAX_EDITS) return null;
    trace.push(v.slice(max - d, max + d + 3)); // diagonals -d-1 .. d+1
    for (let k = -d; k <= d; k += 2) {
      const i = k + max + 1;
      let x = k === -d || (k !== d && v[i - 1] < v[i + 1]) ? v[i + 1] : v[i - 1] + 1;
      let y = x - k;
      while (x < n && y < m && a[x] === b[y]) {
        x++;
        y++;
      }
      v[i] = x;
      if (x >= n && y >= m) {
        done = true;
        break;
      }
    }
  }
  // walk back through the trace: the snakes are the matching runs
  const runs = [];
  let x = n;
  let y = m;
  for (let d = trace.length - 1; d >= 0 && (x > 0 || y > 0); d--) {
    const vd = trace[d];
    const at = (k) => vd[k + d + 1];
    const k = x - y;
    const prevK = k === -d || (k !== d && at(k - 1) < at(k + 1)) ? k + 1 : k - 1;
    const prevX = d === 0 ? 0 : at(prevK);
    const prevY = prevX - prevK;
    const startX = d === 0 ? 0 : prevK === k + 1 ? prevX : prevX + 1;
    const startY = startX - k;
    if (x > startX) runs.push([startX, startY, x - startX]);
    x = d === 0 ? 0 : prevX;
    y = d === 0 ? 0 : prevY;
  }
  return runs.reverse().filter((r) => r[2] > 0);
}

// The changes from a to b: [aStart, aEnd, bStart, bEnd] of every region that differs.
function changes(a, b) {
  const out = [];
  let i = 0;
  let j = 0;
  for (const [x, y, len] of [...matches(a, b), [a.length, b.length, 0]]) {
    if (x > i || y > j) out.push([i, x, j, y]);
    i = x + len;
    j = y + len;
  }
  return out;
}

function splitLines(text) {
  const lines = text.match(/[^\n]*\n|[^\n]+$/g) || [];
  return lines;
}

const bare = (line) => line.replace(/\r?\n$/, "");

function overlap(a, b) {
  if (a[0] === a[1] && b[0] === b[1]) return a[0] === b[0];
  if (a[0] === a[1]) return b[0] < a[0] && a[0] < b[1];
  if (b[0] === b[1]) return a[0] < b[0] && b[0] < a[1];
  return a[0] < b[1] && b[0] < a[1];
}

function alreadyMade(h, all) {
  if (h[0] !== h[1] || !h[2].length) return false;
  const wanted = h[2].map(bare).join("\n");
  const n = h[2].length;
  return all.some((g) => {
    if (g[3] === h[3] || g[0] === g[1] || g[2].length < n) return false;
    const lines = g[2].map(bare);
    return (
      (g[1] === h[0] && lines.slice(-n).join("\n") === wanted) ||
      (g[0] === h[0] && lines.slice(0, n).join("\n") === wanted)
    );
  });
}

function apply(base, lo, hi, hunks) {
  const out = [];
  let at = lo;
  for (const [i1, i2, lines] of hunks) {
    out.push(...base.slice(at, i1), ...lines);
    at = i2;
  }
  return out.concat(base.slice(at, hi));
}

// {text, conflict}: a three-way line merge of base, current and edit. Changes on one side
// are kept, identical changes on both sides once, overlapping different ones are a
// conflict (current's side is kept there). Line endings do not count as changes.
function merge3(base, current, edit) {
  const b = splitLines(base);
  const c = splitLines(current);
  const e = splitLines(edit);
  for (const side of [c, e]) {
    if (side.length && !side[side.length - 1].endsWith("\n")) side[side.length - 1] += "\n";
  }
  const kb = b.map(bare);
  const kept = b.slice();
  for (const [x, y, len] of matches(kb, c.map(bare))) {
    for (let k = 0; k < len; k++) kept[x + k] = c[y + k];
  }
  let all = [];
  for (const [side, other] of [
    [0, c],
    [1, e],
  ]) {
    for (const [i1, i2, j1, j2] of changes(kb, other.map(bare))) {
      all.push([i1, i2, other.slice(j1, j2), side]);
    }
  }
  all = all.filter((h) => !alreadyMade(h, all));
  all.sort((p, q) => p[0] - q[0] || p[1] - q[1] || p[3] - q[3]);
  const groups = [];
  for (const h of all) {
    const last = groups[groups.length - 1];
    if (last && last.some((g) => overlap(h, g))) last.push(h);
    else groups.push([h]);
  }
  const out = [];
  let at = 0;
  let conflict = false;
  for (const group of groups) {
    const lo = Math.min(...group.map((g) => g[0]));
    const hi = Math.max(...group.map((g) => g[1]));
    out.push(...kept.slice(at, lo));
    const ours = group.filter((g) => g[3] === 0);
    const theirs = group.filter((g) => g[3] === 1);
    if (ours.length && theirs.length) {
      const mine = apply(b, lo, hi, ours);
      const edited = apply(b, lo, hi, theirs);
      if (mine.map(bare).join("\n") !== edited.map(bare).join("\n")) conflict = true;
      out.push(...mine);
    } else {
      out.push(...apply(b, lo, hi, ours.length ? ours : theirs));
    }
    at = hi;
  }
  out.push(...kept.slice(at));
  return {text: out.join(""), conflict};
}

// The difference between two texts word by word: [{op: "same"|"add"|"del", text}], the
// runs joined, so a version reads as one text with what changed marked in it.
function wordDiff(before, after) {
  const split = (t) => t.match(/\s+|[^\s]+/g) || [];
  const a = split(before);
  const b = split(after);
  const raw = [];
  let i = 0;
  let j = 0;
  for (const [x, y, len] of [...matches(a, b), [a.length, b.length, 0]]) {
    if (i < x) raw.push({op: "del", text: a.slice(i, x).join("")});
    if (j < y) raw.push({op: "add", text: b.slice(j, y).join("")});
    for (let k = x; k < x + len; k++) raw.push({op: "same", text: a[k]});
    i = x + len;
    j = y + len;
  }
  // One change reads as one: a space between two changes joins them (the words struck
  // out together, then the words put in), as a person would mark up a text.
  const out = [];
  const push = (op, text) => {
    const last = out[out.length - 1];
    if (!text) return;
    if (last && last.op === op) last.text += text;
    else out.push({op, text});
  };
  let del = "";
  let add = "";
  const flush = () => {
    push("del", del);
    push("add", add);
    del = add = "";
  };
  raw.forEach((part, k) => {
    const next = raw[k + 1];
    if (part.op === "del") del += part.text;
    else if (part.op === "add") add += part.text;
    else if ((del || add) && /^\s+$/.test(part.text) && next && next.op !== "same") {
      del += part.text;
      add += part.text;
    } else {
      flush();
      push("same", part.text);
    }
  });
  flush();
  return out;
}

if (typeof module !== "undefined")
  module.exports = {commonEnds, matches, changes, merge3, wordDiff};
"""[1:]
# --- end web/merge.js ---
# --- begin web/outbox.js ---
OUTBOX_JS = r"""
// -- the outbox (pure: no page; node --test web/) ----------------------------------------
// What was written while the server could not be reached, in order, sent when it can be.
// An item is {id, kind, key, ...}: `key` is its Idempotency-Key, so an item sent twice
// (its answer lost) is done once. Kinds: "save" {path, base, content} (through merge, from
// the version it started from), "create" {local, folder, content} (a new note, named by
// the server; `local` stands for its path until then), "capture" {text, files, at} (today's
// note: the capture box, the share sheet).

// Queue a save; an unsent save of the same note takes the new text (it keeps the version
// the edits started from), and so does the unsent create of a note not sent yet.
function queueSave(items, path, base, content, newId) {
  const out = items.slice();
  const create = out.findIndex((i) => i.kind === "create" && i.local === path && !i.sent);
  if (create >= 0) {
    out[create] = {...out[create], content, key: newId()};
    return out;
  }
  const at = out.findIndex((i) => i.kind === "save" && i.path === path && !i.sent);
  if (at >= 0) out[at] = {...out[at], content, key: newId()};
  else out.push({id: newId(), kind: "save", key: newId(), path, base, content});
  return out;
}

function queueCreate(items, local, folder, content, newId) {
  return [...items, {id: newId(), kind: "create", key: newId(), local, folder, content}];
}

// `at`: when it was captured (its time in today's note), not when it is sent.
function queueCapture(items, text, files, newId, at) {
  const item = {id: newId(), kind: "capture", key: newId(), text, files: files || [], at};
  return [...items, item];
}

// The item sent: gone from the queue. A create's answer gives the note its path: later
// saves of it go there, from the version the server made; a later save of a note just
// saved starts from the version that save made (its text already holds the earlier edit).
function settle(items, item, answer) {
  const made = answer && answer.etag;
  return items
    .filter((i) => i.id !== item.id)
    .map((i) => {
      if (i.kind !== "save") return i;
      if (item.kind === "create" && i.path === item.local) {
        return {...i, path: answer.path, base: answer.etag};
      }
      if (item.kind === "save" && made && i.path === item.path && answer.path === item.path) {
        return {...i, base: answer.etag};
      }
      return i;
    });
}

// Before an item goes out it is marked sent: a later edit of the same note queues anew
// instead of changing text that may already be on the server.
function markSent(items, item) {
  return items.map((i) => (i.id === item.id ? {...i, sent: true} : i));
}

// The first item that may go now: the share sheet's items wait until the person says yes.
function nextItem(items) {
  return items.find((i) => !i.ask) || null;
}

// What the page says about the queue.
function waiting(items) {
  const n = items.length;
  if (!n) return "";
  return n === 1 ? "1 change waits to be sent" : n + " changes wait to be sent";
}

if (typeof module !== "undefined") {
  module.exports = {queueSave, queueCreate, queueCapture, settle, markSent, nextItem, waiting};
}
"""[1:]
# --- end web/outbox.js ---
# --- begin web/markdown.js ---
MARKDOWN_JS = r"""
// -- Markdown: a small renderer that builds DOM nodes, so no HTML in a note can run ----------
// (MARKDOWN_JS, shared with the share page: each page brings its own link(), wikiLink()
// and image(), which decide what a link or an image may reach.)

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === false || v === null || v === undefined) continue;
    if (k === "class") e.className = v;
    else if (k === "onclick") e.addEventListener("click", v);
    else e.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children) {
    if (c === null || c === undefined || c === false) continue;
    e.appendChild(typeof c === "string" ? document.createTextNode(c) : c);
  }
  return e;
}

function folderOf(path) {
  return path.split("/").slice(0, -1).join("/");
}

const LIST_RE = /^(\s*)([-*+]|\d{1,9}[.)])(?:\s+(.*)|$)/;
const FENCE_RE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)/;
const HEADING_RE = /^ {0,3}(#{1,6})(?:\s+(.*?))?(?:\s+#+)?\s*$/;
const HR_RE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
const QUOTE_RE = /^ {0,3}> ?/;
const TABLE_SEP_RE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

// Inline syntax, one alternative per construct; the group numbers are used below.
const INLINE_SOURCE = [
  /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/.source, // 1, 2: code
  /!\[([^\]\n]*)\]\(\s*<?([^)\s>]+)>?(?:\s+"[^"\n]*")?\s*\)/.source, // 3, 4: image
  /\[\[([^\[\]|\n]+)(?:\|([^\[\]\n]+))?\]\]/.source, // 5, 6: wikilink
  /\[([^\[\]\n]+)\]\(\s*<?([^)\s>]+)>?(?:\s+"[^"\n]*")?\s*\)/.source, // 7, 8: link
  /<((?:https?|mailto):[^>\s]+)>/.source, // 9: autolink
  /(https?:\/\/[^\s<]*[^\s<.,:;"')\]!?*_~])/.source, // 10: a bare URL
  /(\*\*|__)(?=\S)([\s\S]*?\S)\11/.source, // 11, 12: strong
  /(\*|_)(?=[^\s*_])([\s\S]*?[^\s\\])\13/.source, // 13, 14: emphasis
  /~~(?=\S)([\s\S]*?\S)~~/.source, // 15: strike-through
  /==(?=\S)([\s\S]*?\S)==/.source, // 16: highlight
  /\\([\\`*_{}\[\]()#+\-.!|~<>=])/.source, // 17: an escape
  /(\n)/.source, // 18: a line break
].join("|");

function renderMarkdown(text, ctx) {
  ctx = ctx || {};
  const lines = text
    .replace(/\r\n?/g, "\n")
    .split("\n")
    .map((t, n) => ({t, n}));
  const root = el("div", {class: "md"});
  let start = 0;
  if (lines.length > 2 && lines[0].t === "---") {
    // front matter: shown small, as it is
    const end = lines.findIndex((l, i) => i > 0 && (l.t === "---" || l.t === "..."));
    if (end > 0) {
      root.appendChild(
        el(
          "pre",
          {class: "front"},
          lines
            .slice(1, end)
            .map((l) => l.t)
            .join("\n"),
        ),
      );
      start = end + 1;
    }
  }
  blocks(lines.slice(start), root, ctx);
  return root;
}

function startsBlock(t) {
  return (
    FENCE_RE.test(t) || HEADING_RE.test(t) || HR_RE.test(t) || QUOTE_RE.test(t) || LIST_RE.test(t)
  );
}

function blocks(lines, out, ctx) {
  let i = 0;
  while (i < lines.length) {
    const t = lines[i].t;
    let m;
    if (!t.trim()) {
      i++;
      continue;
    }
    if ((m = FENCE_RE.exec(t))) {
      const close = new RegExp("^ {0,3}" + m[1][0] + "{" + m[1].length + ",}\\s*$");
      const body = [];
      for (i++; i < lines.length && !close.test(lines[i].t); i++) body.push(lines[i].t);
      i++;
      out.appendChild(
        el(
          "pre",
          {},
          el("code", {class: m[2] ? "lang-" + m[2].replace(/[^\w-]/g, "") : null}, body.join("\n")),
        ),
      );
    } else if ((m = HEADING_RE.exec(t))) {
      const h = el("h" + m[1].length);
      inline(m[2] || "", h, ctx);
      out.appendChild(h);
      i++;
    } else if (HR_RE.test(t)) {
      out.appendChild(el("hr"));
      i++;
    } else if (QUOTE_RE.test(t)) {
      const inner = [];
      for (; i < lines.length && QUOTE_RE.test(lines[i].t); i++) {
        inner.push({t: lines[i].t.replace(QUOTE_RE, ""), n: lines[i].n});
      }
      const q = el("blockquote");
      blocks(inner, q, ctx);
      out.appendChild(q);
    } else if (
      i + 1 < lines.length &&
      t.includes("|") &&
      lines[i + 1].t.includes("-") &&
      TABLE_SEP_RE.test(lines[i + 1].t)
    ) {
      i = table(lines, i, out, ctx);
    } else if (LIST_RE.test(t)) {
      i = list(lines, i, out, ctx);
    } else {
      const para = [t.trim()];
      for (i++; i < lines.length && lines[i].t.trim() && !startsBlock(lines[i].t); i++)
        para.push(lines[i].t.trim());
      const p = el("p");
      inline(para.join("\n"), p, ctx);
      out.appendChild(p);
    }
  }
}

function indentOf(s) {
  return s.replace(/\t/g, "    ").length;
}

function list(lines, i, out, ctx) {
  const first = LIST_RE.exec(lines[i].t);
  const indent = indentOf(first[1]);
  const ordered = /\d/.test(first[2]);
  const listEl = el(ordered ? "ol" : "ul");
  if (ordered && parseInt(first[2], 10) !== 1)
    listEl.setAttribute("start", String(parseInt(first[2], 10)));
  out.appendChild(listEl);
  let li = null;
  let body = null; // where the item's text goes: a task's text is inside its label
  while (i < lines.length) {
    const t = lines[i].t;
    if (!t.trim()) {
      // a blank line: the list goes on if an item follows
      let j = i;
      while (j < lines.length && !lines[j].t.trim()) j++;
      const next = j < lines.length ? LIST_RE.exec(lines[j].t) : null;
      if (!next || indentOf(next[1]) < indent) return j;
      i = j;
      continue;
    }
    const m = LIST_RE.exec(t);
    if (m && !HR_RE.test(t)) {
      const ind = indentOf(m[1]);
      if (ind < indent) return i;
      if (ind > indent && li) {
        i = list(lines, i, li, ctx);
        body = li; // text after a nested list goes after it
        continue;
      }
      if (/\d/.test(m[2]) !== ordered) return i;
      li = el("li");
      body = li;
      let content = m[3] || "";
      const task = /^\[([ xX])\](?:\s+|$)/.exec(content);
      if (task) {
        li.className = "task";
        const n = lines[i].n;
        const box = el("input", {
          type: "checkbox",
          "data-line": String(n),
          "aria-label": content.slice(task[0].length).slice(0, 80) || "task",
        });
        box.checked = task[1] !== " ";
        box.disabled = !ctx.onTask;
        if (ctx.onTask) box.addEventListener("change", () => ctx.onTask(n, box));
        body = el("span");
        li.appendChild(el("label", {}, box, body));
        content = content.slice(task[0].length);
      }
      inline(content, body, ctx);
      listEl.appendChild(li);
      i++;
    } else if (li && (/^\s/.test(t) || !startsBlock(t))) {
      // the item's text goes on
      body.appendChild(el("br"));
      inline(t.trim(), body, ctx);
      i++;
    } else {
      return i;
    }
  }
  return i;
}

function splitRow(row) {
  let s = row.trim();
  if (s.startsWith("|")) s = s.slice(1);
  if (s.endsWith("|") && !s.endsWith("\\|")) s = s.slice(0, -1);
  return s
    .replace(/\\\|/g, "\u0000")
    .split("|")
    .map((c) => c.replace(/\u0000/g, "|").trim());
}

function table(lines, i, out, ctx) {
  const head = splitRow(lines[i].t);
  const align = splitRow(lines[i + 1].t).map((c) =>
    c.endsWith(":") ? (c.startsWith(":") ? "al-c" : "al-r") : null,
  );
  const tr = el("tr");
  head.forEach((c, k) => {
    const th = el("th", {class: align[k]});
    inline(c, th, ctx);
    tr.appendChild(th);
  });
  const tbody = el("tbody");
  for (i += 2; i < lines.length && lines[i].t.includes("|") && lines[i].t.trim(); i++) {
    const row = el("tr");
    const cells = splitRow(lines[i].t);
    head.forEach((_, k) => {
      const td = el("td", {class: align[k]});
      inline(cells[k] || "", td, ctx);
      row.appendChild(td);
    });
    tbody.appendChild(row);
  }
  out.appendChild(el("div", {class: "table"}, el("table", {}, el("thead", {}, tr), tbody)));
  return i;
}

function inline(text, parent, ctx) {
  if (text.length > 20000) {
    parent.appendChild(document.createTextNode(text));
    return;
  }
  const re = new RegExp(INLINE_SOURCE, "g");
  let last = 0;
  let m;
  const add = (s) => {
    if (s) parent.appendChild(document.createTextNode(s));
  };
  while ((m = re.exec(text))) {
    if (
      m[13] === "_" &&
      (/\w/.test(text[m.index - 1] || "") || /\w/.test(text[re.lastIndex] || ""))
    ) {
      re.lastIndex = m.index + 1; // snake_case is not emphasis
      continue;
    }
    // ![[name]] embeds what [[name]] links to (an image shows, a file is offered).
    const embed = m[5] !== undefined && m.index > last && text[m.index - 1] === "!";
    add(text.slice(last, embed ? m.index - 1 : m.index));
    last = re.lastIndex;
    if (m[1] !== undefined) parent.appendChild(el("code", {}, m[2].replace(/^ (.*) $/, "$1")));
    else if (m[3] !== undefined) parent.appendChild(image(m[3], m[4], ctx));
    else if (m[5] !== undefined) parent.appendChild(wikiLink(m[5], m[6], ctx, embed));
    else if (m[7] !== undefined) parent.appendChild(link(m[8], m[7], ctx, true));
    else if (m[9] !== undefined) parent.appendChild(link(m[9], m[9].replace(/^mailto:/, ""), ctx));
    else if (m[10] !== undefined) parent.appendChild(link(m[10], m[10], ctx));
    else if (m[11] !== undefined) {
      const e = el("strong");
      inline(m[12], e, ctx);
      parent.appendChild(e);
    } else if (m[13] !== undefined) {
      const e = el("em");
      inline(m[14], e, ctx);
      parent.appendChild(e);
    } else if (m[15] !== undefined) {
      const e = el("del");
      inline(m[15], e, ctx);
      parent.appendChild(e);
    } else if (m[16] !== undefined) {
      const e = el("mark");
      inline(m[16], e, ctx);
      parent.appendChild(e);
    } else if (m[17] !== undefined) add(m[17]);
    else if (m[18] !== undefined) parent.appendChild(el("br"));
  }
  add(text.slice(last));
}

function safeDecode(s) {
  try {
    return decodeURIComponent(s);
  } catch (e) {
    return s;
  }
}

// Return the note path (or attachment path) a relative link points at, or null.
function resolveRelative(href, from) {
  const target = safeDecode(href.split("#")[0].split("?")[0]);
  if (!target) return null;
  const parts = target.startsWith("/")
    ? target.startsWith("/notes/") || target.startsWith("/attachments/")
      ? []
      : ["notes"]
    : folderOf(from || "notes/x.md").split("/");
  for (const seg of target.split("/")) {
    if (seg === "" || seg === ".") continue;
    if (seg === "..") {
      if (!parts.length) return null;
      parts.pop();
    } else parts.push(seg);
  }
  const path = parts.join("/");
  return /^(notes|attachments)\//.test(path) ? path : null;
}

if (typeof module !== "undefined") {
  module.exports = {el, folderOf, renderMarkdown, resolveRelative, safeDecode};
}
"""[1:]
# --- end web/markdown.js ---

# --- begin web/app.js ---
WEB_JS_REST = r"""
function link(href, label, ctx, markdown) {
  href = href.trim();
  let a;
  if (/^(https?:|mailto:)/i.test(href)) {
    a = el("a", {href, target: "_blank", rel: "noopener noreferrer"});
  } else {
    const path = /^[a-z][a-z0-9+.-]*:|^\/\/|^#/i.test(href)
      ? null
      : resolveRelative(href, ctx.from);
    if (path && path.startsWith("attachments/") && features.attachments) {
      a = attachmentLink(path, path);
    } else if (!path || !path.startsWith("notes/") || !path.endsWith(".md")) {
      a = el("span"); // another scheme, or nothing this page can open: the text alone
    } else {
      a = el("a", {
        href: "#",
        "data-note": path,
        onclick: (e) => {
          e.preventDefault();
          act(() => openNote(path))();
        },
      });
    }
  }
  if (markdown) inline(label, a, ctx);
  else a.textContent = label;
  return a;
}

function wikiLink(target, label, ctx, embed) {
  const name = target.split("#")[0].trim();
  if (isAttachmentName(name) && features.attachments) {
    const found = findAttachment(name, ctx.from);
    const shown = label && !/^\d+(x\d+)?$/.test(label.trim()) ? label.trim() : fileName(name);
    if (embed && IMAGE_EXT.test(name)) return attachmentImage(found, shown);
    const a = attachmentLink(found, name);
    a.textContent = shown;
    return a;
  }
  return el(
    "a",
    {
      href: "#",
      "data-wiki": name,
      onclick: (e) => {
        e.preventDefault();
        act(() => openWiki(name, ctx.from))();
      },
    },
    (label || target).trim(),
  );
}

function image(alt, src, ctx) {
  // Images load only from this server (the CSP allows no other); others show as a link.
  if (/^(https?:)/i.test(src)) return link(src, alt ? "image: " + alt : src, ctx);
  const path = /^[a-z][a-z0-9+.-]*:|^\/\//i.test(src) ? null : resolveRelative(src, ctx.from);
  // an attachment, or a file beside the note (a vault's image, put there over WebDAV)
  const beside = path && path.startsWith("notes/") && !/\.md$/i.test(path);
  if (!path || !(path.startsWith("attachments/") || beside) || !features.attachments) {
    return document.createTextNode(alt ? "[image: " + alt + "]" : "[image]");
  }
  if (!IMAGE_EXT.test(path)) {
    const a = attachmentLink(path, path);
    a.textContent = alt || fileName(path);
    return a;
  }
  return attachmentImage(Promise.resolve(path), alt || fileName(path));
}

const IMAGE_EXT = /\.(png|jpe?g|gif|webp|avif|bmp|ico|svg)$/i;
const MEDIA_EXT = /\.(mp3|m4a|aac|ogg|oga|opus|wav|flac|weba|mp4|m4v|mov|webm)$/i;
const VIDEO_EXT = /\.(mp4|m4v|mov|webm)$/i;

function attachmentImage(found, alt) {
  const img = el("img", {alt, loading: "lazy"});
  Promise.resolve(found)
    .then((path) => {
      if (!path) throw new Error("not found");
      img.dataset.attachment = path;
      return attachmentUrl(path);
    })
    .then(
      (url) => {
        img.src = url;
      },
      () => img.replaceWith(document.createTextNode("[image not found: " + alt + "]")),
    );
  return img;
}

// A link to an attachment: audio and video play in the page, other files are downloaded
// (never opened as a page of this origin).
function attachmentLink(found, name) {
  const a = el("a", {href: "#", class: MEDIA_EXT.test(name) ? "file media" : "file"});
  if (typeof found === "string") a.dataset.attachment = found;
  a.addEventListener("click", (e) => {
    e.preventDefault();
    act(() => openAttachment(found, a))();
  });
  return a;
}

async function openAttachment(found, a) {
  const path = await found;
  if (!path) throw new Error("There is no attachment of that name.");
  if (MEDIA_EXT.test(path)) {
    const url = await attachmentUrl(path);
    const player = el(VIDEO_EXT.test(path) ? "video" : "audio", {controls: true, class: "media"});
    player.src = url;
    player.setAttribute("aria-label", fileName(path));
    a.replaceWith(player);
    player.play().catch(() => {});
    return;
  }
  const {blob} = await api("GET", "/attachments/" + enc(path), undefined, undefined, {blob: true});
  const url = URL.createObjectURL(new Blob([blob], {type: "application/octet-stream"}));
  const save = el("a", {href: url, download: fileName(path), hidden: true});
  document.body.append(save);
  save.click();
  save.remove();
  setTimeout(() => URL.revokeObjectURL(url), 60000);
}

// ![[photo.jpg]] names a file: a path, else the first attachment of that name (as the
// server resolves it), from one listing of the attachments kept for a minute.
let attachmentNames = null;
let attachmentNamesAt = 0;
async function findAttachment(name, from) {
  if (name.includes("/")) {
    const path = name.replace(/^\/+/, "");
    return path.startsWith("attachments/") || path.startsWith("notes/")
      ? path
      : "attachments/" + path;
  }
  if (!attachmentNames || Date.now() - attachmentNamesAt > 60000) {
    attachmentNamesAt = Date.now();
    attachmentNames = (async () => {
      const names = new Map();
      const paths = [];
      for (let offset = 0; offset < 20000; offset += 1000) {
        const {data} = await api("GET", "/attachments?limit=1000&offset=" + offset);
        paths.push(...data.attachments.map((x) => x.path));
        if (offset + 1000 >= data.total) break;
      }
      for (const p of paths.sort()) {
        const key = fileName(p).toLowerCase();
        if (!names.has(key)) names.set(key, p);
      }
      return names;
    })();
  }
  const names = await attachmentNames.catch(() => new Map());
  // not among the attachments: the file beside the note (how a vault keeps its images)
  return names.get(name.toLowerCase()) || (from ? folderOf(from) + "/" + name : null);
}

// An attachment needs the key, which an <img src> cannot send: fetch it, show it as a blob.
// A blob: URL is a document of this origin when opened alone, so only a picture, a sound or
// a video keeps its type; an SVG (which may hold script) is shown from a data: URL instead,
// whose document, opened alone, has no origin of its own to read.
const attachmentUrls = new Map();
function attachmentUrl(path) {
  if (!attachmentUrls.has(path)) {
    const url = api("GET", "/attachments/" + enc(path), undefined, undefined, {blob: true}).then(
      (r) => inertUrl(r.blob, path),
    );
    url.catch(() => attachmentUrls.delete(path));
    attachmentUrls.set(path, url);
  }
  return attachmentUrls.get(path);
}

function inertUrl(blob, path) {
  const type = (blob.type || "").toLowerCase().split(";")[0].trim();
  if (type === "image/svg+xml" || /\.svg$/i.test(path)) {
    return new Promise((resolve, reject) => {
      const reader = new FileReader(); // a relay sends an SVG as octet-stream: say what it is
      reader.onload = () => resolve(reader.result);
      reader.onerror = () => reject(reader.error);
      reader.readAsDataURL(new Blob([blob], {type: "image/svg+xml"}));
    });
  }
  const passive = /^(image|audio|video)\/[a-z0-9.+-]+$/.test(type) && !/(xml|html)/.test(type);
  const safe = passive ? blob : new Blob([blob], {type: "application/octet-stream"});
  return URL.createObjectURL(safe);
}

// [[Name]] resolves as the server does: a path, else the first note of that file name.
async function openWiki(name, from) {
  let target = name.replace(/\.md$/i, "");
  if (target.includes("/")) {
    target = target.replace(/^\/+/, "");
    return openNote((target.startsWith("notes/") ? target : "notes/" + target) + ".md");
  }
  const {data} = await api("GET", "/search?limit=100&q=" + enc(target.replace(/["*()-]/g, " ")));
  const want = target.toLowerCase();
  const found = data.results
    .map((h) => h.path)
    .filter((p) => nameOf(p).toLowerCase() === want)
    .sort();
  if (found.length) return openNote(found[0]);
  const guess = (from ? folderOf(from) : "notes") + "/" + target + ".md";
  for (const path of new Set([guess, "notes/" + target + ".md"])) {
    try {
      await api("GET", "/notes/" + enc(path));
      return openNote(path);
    } catch (e) {
      if (e.status !== 404) throw e;
    }
  }
  const choice = await choose("No note named “" + target + "”", "Create " + guess + "?", [
    ["create", "Create it", "primary"],
    ["cancel", "Cancel"],
  ]);
  if (choice === "create") await createNote(guess);
  return undefined;
}

// -- dialogs ---------------------------------------------------------------------------------

let dialogDone = null;
function dialog(title, body, buttons, initial) {
  const d = $("dlg");
  if (dialogDone) dialogDone("cancel"); // one dialog at a time: the one open gives way
  $("dlg-title").textContent = title;
  $("dlg-body").replaceChildren(
    ...(Array.isArray(body) ? body : [body]).map((b) =>
      typeof b === "string" ? el("p", {}, b) : b,
    ),
  );
  return new Promise((resolve) => {
    dialogDone = (value) => {
      dialogDone = null;
      if (d.open) d.close();
      resolve(value);
    };
    $("dlg-buttons").replaceChildren(
      ...buttons.map(([value, label, cls]) =>
        el(
          "button",
          {
            type: "button",
            class: cls || null,
            "data-value": value,
            onclick: () => dialogDone(value),
          },
          label,
        ),
      ),
    );
    d.showModal();
    const focus =
      initial ||
      d.querySelector("#dlg-body input") ||
      d.querySelector("button.primary") ||
      d.querySelector("button");
    if (focus) focus.focus();
  });
}
function choose(title, text, buttons) {
  return dialog(title, text, buttons);
}

// -- the open note -----------------------------------------------------------------------------

const editor = () => $("editor");
function dirty() {
  return (state.path !== null || state.blank) && editor().value !== state.saved;
}

function updateDirty() {
  const s = $("status");
  if (dirty()) {
    s.replaceChildren(
      el("span", {"aria-hidden": "true"}, "● "),
      el("span", {class: "word"}, "Unsaved"),
    );
    s.className = "dirty";
  } else if (s.className === "dirty") {
    s.textContent = "";
    s.className = "";
  }
  $("save").disabled = !state.path && !state.blank;
  $("save").classList.toggle("clean", !dirty());
}

// A note not created yet keeps its draft under this name (one at a time).
const NEW_NOTE = "(new note)";
function draftKey(path) {
  return "notesvc.draft:" + state.base + "|" + path;
}
const draftName = () => (state.blank ? NEW_NOTE : state.path);
function readDraft(path) {
  try {
    return JSON.parse(getItem("local", draftKey(path)) || "null");
  } catch (e) {
    return null;
  }
}
function keepDraft() {
  const name = draftName();
  if (!name) return;
  if (dirty()) {
    setItem(
      "local",
      draftKey(name),
      JSON.stringify({content: editor().value, etag: state.etag, at: Date.now()}),
    );
  } else if (!state.blank && state.key) {
    // saved: no draft (a new note's goes when it is created; with no key, what the copy
    // on this device left as drafts stays)
    removeItem("local", draftKey(name));
  }
}
let draftTimer = 0;
function scheduleDraft() {
  clearTimeout(draftTimer);
  draftTimer = setTimeout(keepDraft, 300);
}
function dropDraft() {
  const name = draftName();
  if (name) removeItem("local", draftKey(name));
  $("draft").hidden = true;
}

// Before the page leaves a note: what was typed is saved now (autosave may not have run
// yet). Only when that fails does it ask; resolve to true when it is fine to go on.
async function confirmLeave() {
  if (!dirty()) return true;
  clearTimeout(saveTimer);
  let why = "";
  try {
    if (await save(false)) return true;
  } catch (e) {
    why = " " + ((e.error && e.error.message) || "The server could not be reached.");
  }
  if (!dirty()) return false; // kept as a conflict copy: the page says where
  const choice = await choose("Not saved", "“" + state.title + "” could not be saved." + why, [
    ["retry", "Try again", "primary"],
    ["discard", "Discard changes"],
    ["cancel", "Stay"],
  ]);
  if (choice === "retry") return confirmLeave();
  if (choice === "discard") {
    dropDraft();
    editor().value = state.saved;
    updateDirty();
    return true;
  }
  return false;
}

// Put new text in the editor where the cursor stays on the words it was at (a change
// elsewhere in the note moves it only by what was put in or taken out before it).
function replaceText(text) {
  const ed = editor();
  const old = ed.value;
  if (old === text) return;
  const [a, b] = [ed.selectionStart, ed.selectionEnd];
  const [p, q] = commonEnds(old, text);
  const at = (i) =>
    i <= p ? i : i >= old.length - q ? i + text.length - old.length : text.length - q;
  ed.value = text;
  if (document.activeElement === ed) ed.setSelectionRange(at(a), at(b));
}

// A textarea holds lines ending in \n only: a note written with \r\n is shown with \n and
// saved back with \r\n, so opening it changes nothing.
const toEditor = (text) => text.replace(/\r\n?/g, "\n");
function fromEditor(text) {
  return state.crlf ? text.replace(/\n/g, "\r\n") : text;
}

function showNote(rec) {
  const again = rec.path === state.path; // the same note, newer: the cursor stays
  state.path = rec.path;
  state.etag = rec.etag;
  state.crlf = rec.content.includes("\r\n");
  state.saved = toEditor(rec.content);
  state.title = rec.title || nameOf(rec.path);
  if (again) replaceText(state.saved);
  else editor().value = state.saved;
  $("title").textContent = state.title;
  $("path").textContent = rec.path + " · " + ago(rec.modified);
  $("path").title = rec.path;
  $("empty").hidden = true;
  $("note-bar").hidden = false;
  $("conflict").hidden = true;
  $("draft").hidden = true;
  $("status").textContent = "";
  $("status").className = "";
  $("about").disabled = false;
  $("about-label").textContent = "About this note: " + state.title;
  setItem("session", "notesvc.open", rec.path);
}

async function openNote(path, opts) {
  opts = opts || {};
  if (path !== state.path && !(await confirmLeave())) return false;
  let data;
  try {
    data = (await api("GET", "/notes/" + enc(path))).data;
    if (offlineOn()) mirrorPut(data).catch(() => {}); // the copy takes what the server has
  } catch (e) {
    data = unreachable(e) && offlineOn() ? await mirrorGet(path) : null;
    if (!data) throw e;
  }
  showNote(data);
  const draft = readDraft(data.path);
  if (draft && draft.content !== state.saved) {
    editor().value = draft.content;
    state.etag = draft.etag || data.etag; // a save meets the conflict if the note moved on
    $("draft-text").textContent =
      "Your unsaved draft from " +
      new Date(draft.at).toLocaleString() +
      " is back." +
      (draft.etag && draft.etag !== data.etag ? " The note has changed since then." : "");
    $("draft").hidden = false;
    setEditing(true);
  } else {
    if (draft) dropDraft();
    setEditing(!!opts.edit);
  }
  updateDirty();
  showPane("note");
  loadBacklinks(data.path);
  reveal(data.path).catch(() => {});
  return true;
}

function closeNote() {
  state.path = null;
  state.blank = false;
  state.etag = null;
  state.saved = "";
  state.crlf = false;
  editor().value = "";
  $("note-bar").hidden = true;
  $("title").textContent = "";
  $("path").textContent = "";
  $("view").replaceChildren();
  $("view").hidden = true;
  editor().hidden = true;
  $("backlinks").hidden = true;
  $("conflict").hidden = true;
  $("draft").hidden = true;
  $("status").textContent = "";
  $("status").className = "";
  $("empty").hidden = false;
  $("about").checked = false;
  $("about").disabled = true;
  $("about-label").textContent = "About this note";
  removeItem("session", "notesvc.open");
  markCurrent();
}

function setEditing(on) {
  state.editing = on;
  editor().hidden = !on;
  $("view").hidden = on;
  $("edit").textContent = on ? "View" : "Edit";
  $("edit").setAttribute("aria-pressed", String(on));
  if (!on) renderView();
}

function renderView() {
  const onTask = writable() ? toggleTask : null; // a read key ticks nothing
  const view = renderMarkdown(editor().value, {from: state.path, onTask});
  $("view").replaceChildren(...view.childNodes);
}

// A checkbox ticked in the formatted view changes its line; saved at once (with If-Match)
// unless there are other unsaved changes, which it then joins.
async function toggleTask(n, box) {
  const lines = editor().value.split("\n");
  const line = lines[n] || "";
  const flipped = line.replace(
    /^(\s*(?:[-*+]|\d{1,9}[.)])\s+)\[([ xX])\]/,
    (_, lead, mark) => lead + (mark === " " ? "[x]" : "[ ]"),
  );
  if (flipped === line) {
    box.checked = !box.checked;
    return;
  }
  lines[n] = flipped;
  editor().value = lines.join("\n");
  if (!(await act(() => save(false))())) {
    const now = editor().value.split("\n"); // not saved: that tick is undone, nothing else
    if (now[n] === flipped) now[n] = line;
    editor().value = now.join("\n");
    updateDirty();
    renderView();
  }
}

// The banner over a note: "gone" (deleted or moved elsewhere while edited here: reload or
// keep mine) or "copy" (both changed the same lines: where this edit was kept).
function showConflict(gone, copy) {
  $("conflict-text").textContent = gone
    ? "This note was deleted or moved elsewhere."
    : "Someone changed the same lines meanwhile. This is their version; yours is kept, " +
      "whole, as “" +
      nameOf(copy) +
      "”.";
  $("conflict").dataset.copy = copy || "";
  for (const id of ["reload", "overwrite"]) $(id).hidden = !gone;
  for (const id of ["open-copy", "conflict-ok"]) $(id).hidden = !!gone;
  $("conflict").hidden = false;
  if (!gone) return;
  $("status").textContent = "Not saved";
  $("status").className = "bad";
}

// A write of this page's own is under way: the feed's news of the open note waits for it
// (the news may be that very write), then the note is looked at once.
async function writing(fn) {
  state.writes = (state.writes || 0) + 1;
  try {
    return await fn();
  } finally {
    state.writes--;
    if (!state.writes && state.recheck) {
      state.recheck = false;
      checkOpenNote().catch(() => {});
    }
  }
}

// One save at a time, in order: each starts from the version the one before it made.
let saveChain = Promise.resolve();
async function save(force) {
  if (!state.path && !state.blank) return false;
  const run = saveChain.then(() => writing(() => saveNow(force)));
  saveChain = run.catch(() => {});
  return run;
}

function newId() {
  return crypto.randomUUID ? crypto.randomUUID() : String(Date.now()) + Math.random();
}

// Save the editor's text: through merge, from the version it was loaded as (what changed
// elsewhere meanwhile is merged in; overlapping changes keep this edit as a conflict copy).
// A new note's first save creates it, named from its first line. `force`: keep mine.
async function saveNow(force) {
  const content = editor().value;
  if (state.blank) return createFromText(content);
  if (state.path.startsWith("new:")) return keepOffline(state.path, content); // not sent yet
  if (content === state.saved && !force) return true;
  const path = state.path;
  let r;
  try {
    if (force) {
      r = await api("PUT", "/notes/" + enc(path), {content: fromEditor(content)});
      r = {data: {note: r.data, merged: false}};
    } else {
      r = await api("POST", "/notes/" + enc(path) + "/merge", {
        base: state.etag,
        content: fromEditor(content),
        clientName: deviceName(),
      });
    }
  } catch (e) {
    if (unreachable(e) && offlineOn()) return keepOffline(path, content);
    if (e.status === 409 && e.error && e.error.conflictPath) return clashed(e.error, path, content);
    if (e.status === 404 && force) {
      r = await api("POST", "/notes", {path, content: fromEditor(content)}); // gone: keep mine
      r = {data: {note: r.data, merged: false}};
      loadTree().catch(() => {});
    } else if (e.status === 404) {
      showConflict(true);
      return false;
    } else {
      throw e;
    }
  }
  if (path === state.path) saved(r.data.note, content);
  return true;
}

// The server has `note`; the editor sent `sent`. What was merged in shows in the editor,
// without losing what was typed since (merged here too, three ways).
function saved(note, sent) {
  const theirs = toEditor(note.content);
  let kept = false;
  if (theirs !== sent) {
    const now = editor().value;
    const m = now === sent ? {text: theirs} : merge3(sent, theirs, now);
    kept = !!m.conflict; // typed here over what was merged in: the editor keeps it, unsaved
    if (!kept) replaceText(m.text);
    if (!state.editing) renderView();
  }
  // kept: the next save starts from the version this one started from, so the server
  // merges the other change in again (or keeps a copy), never writes over it
  if (!kept) state.etag = note.etag;
  state.saved = theirs;
  state.title = note.title || state.title;
  $("title").textContent = state.title;
  $("path").textContent = note.path + " · " + ago(note.modified);
  mirrorPut(note);
  if (editor().value === state.saved) dropDraft();
  $("conflict").hidden = true;
  $("status").textContent = "Saved";
  $("status").className = "";
  updateDirty();
  if (kept) scheduleSave(); // the next save merges it on the server (a copy if it overlaps)
  if (!state.editing) renderView();
}

// Both changed the same lines: the note keeps the other change; this edit is kept whole
// beside it. Show the note as it is, and say where this edit went.
async function clashed(err, path, sent) {
  const now = editor().value;
  if (path === state.path) {
    dropDraft();
    state.saved = now;
    if (now !== sent) {
      // typed on while the save was on its way: the copy holds all of it (or, when the copy
      // cannot be written, this browser keeps it as the note's draft, shown on opening)
      try {
        await api("PUT", "/notes/" + enc(err.conflictPath), {content: fromEditor(now)});
      } catch (e) {
        setItem("local", draftKey(err.path), JSON.stringify({content: now, at: Date.now()}));
      }
    }
    await openNote(err.path);
    showConflict(false, err.conflictPath);
  } else {
    toast(
      "“" + nameOf(path) + "” changed meanwhile: your edit is kept as " + nameOf(err.conflictPath),
    );
  }
  loadTree().catch(() => {});
  loadRecent().catch(() => {});
  return false;
}

async function createFromText(content) {
  if (!content.trim()) return true;
  const own = state.grant && state.grant.folder;
  const body = {content};
  if (own) body.folder = own;
  let r;
  try {
    r = await api("POST", "/notes", body, {"Idempotency-Key": state.newKey});
  } catch (e) {
    if (unreachable(e) && offlineOn()) return keepOffline(null, content);
    throw e;
  }
  removeItem("local", draftKey(NEW_NOTE));
  state.blank = false;
  mine(r.data.path);
  state.path = r.data.path;
  setItem("session", "notesvc.open", state.path);
  // the answer may be an earlier try's (the same key, its answer lost): the editor keeps
  // what was typed since, and saves it through merge from the version that was made
  state.crlf = false;
  saved(r.data, toEditor(r.data.content));
  if (dirty()) scheduleSave();
  loadTree().catch(() => {});
  return true;
}

// Autosave: a second after the last keystroke, or every 3 s while typing goes on, never
// more than one request a second; and when the page is hidden (a small note then goes out
// even as the page closes; a large one waits in this browser for the next visit). A new
// note waits for its first line to be finished (or five quiet seconds): that line names it.
let saveTimer = 0;
let lastSave = 0;
let dirtySince = 0;
function scheduleSave() {
  clearTimeout(saveTimer);
  const now = Date.now();
  if (!dirtySince) dirtySince = now;
  const naming = state.blank && !/\S[^\n]*\n/.test(editor().value);
  let wait = naming ? 5000 : Math.min(1000, dirtySince + 3000 - now);
  wait = Math.max(wait, lastSave + 1000 - now, 0);
  saveTimer = setTimeout(autosave, wait);
}
let saveFailures = 0;
async function autosave() {
  dirtySince = 0;
  if (!dirty()) return;
  if (state.writes) return scheduleSave(); // one at a time: the next one after this
  lastSave = Date.now();
  $("status").textContent = "Saving…";
  try {
    await save(false);
    saveFailures = 0;
  } catch (e) {
    // Kept in this browser meanwhile; tried again, less and less often; said once.
    keepDraft();
    saveFailures++;
    $("status").textContent = unreachable(e) ? "Not saved: no connection" : "Not saved";
    $("status").className = "bad";
    if (saveFailures === 1 && !unreachable(e) && e.status !== 401) toast(e.message, true);
    clearTimeout(saveTimer);
    saveTimer = setTimeout(autosave, Math.min(60000, 5000 * saveFailures));
    return;
  }
  if (dirty()) scheduleSave(); // typed on meanwhile
}
function saveAsThePageHides() {
  // (a save on its way would make this one's base stale: the draft waits for the next visit)
  if (!dirty() || !state.path || state.blank || state.writes) return keepDraft();
  const content = editor().value;
  if (new Blob([content]).size > 64 * 1024 || !state.key || state.keyBase !== state.base) {
    return keepDraft();
  }
  keepDraft(); // until the next visit sees it saved
  fetch(state.base + "/notes/" + enc(state.path) + "/merge", {
    method: "POST",
    keepalive: true,
    mode: "same-origin",
    credentials: "omit",
    headers: {
      "Content-Type": "application/json",
      "X-Service-Key": state.key,
      "Idempotency-Key": newId(),
    },
    body: JSON.stringify({
      base: state.etag,
      content: fromEditor(content),
      clientName: deviceName(),
    }),
  }).catch(() => {});
}

function deviceName() {
  try {
    return JSON.parse(getItem("local", "notesvc.device") || "{}").name || "web client";
  } catch (e) {
    return "web client";
  }
}

async function reloadTheirs() {
  dropDraft();
  const path = state.path;
  state.saved = editor().value; // nothing to ask about: the person chose theirs
  try {
    await openNote(path);
  } catch (e) {
    if (e.status !== 404) throw e;
    closeNote();
    showPane("notes");
    await loadTree();
    toast(path + " is no longer there");
  }
}

// The open note may have changed elsewhere: take the new text when nothing is unsaved,
// otherwise say so and let the person choose.
async function checkOpenNote() {
  const path = state.path;
  if (!path || !state.key) return;
  let r;
  try {
    r = await api("GET", "/notes/" + enc(path));
  } catch (e) {
    if (e.status === 404 && path === state.path) showConflict(true);
    return;
  }
  if (path !== state.path || r.data.etag === state.etag) return;
  if (dirty()) return save(false); // merged with what is typed here
  const editing = state.editing;
  showNote(r.data);
  setEditing(editing);
  updateDirty();
  toast("“" + state.title + "” changed elsewhere: this is the new text");
}

let lastLook = 0;
async function lookAgain() {
  // Back to the page after a while: the tree and the open note may have moved on.
  if (Date.now() - lastLook < 10000 || !state.key || $("app").hidden) return;
  lastLook = Date.now();
  await Promise.all([loadTree(), checkOpenNote()]);
}

// A [[link]] to a note that is not there yet: create it where the link says.
async function createNote(path) {
  const {data} = await api("POST", "/notes", {path, content: "# " + nameOf(path) + "\n\n"});
  mine(data.path);
  await loadTree();
  await openNote(data.path, {edit: true});
}

// A new note is written first: no path to choose; its first line names it when it is
// first saved (in notes/inbox, or a folder key's own folder).
async function newNote() {
  if (!(await confirmLeave())) return;
  closeNote();
  state.blank = true;
  state.newKey = newId(); // its create, sent again after a lost answer, is made once
  $("empty").hidden = true;
  $("note-bar").hidden = false;
  $("title").textContent = "New note";
  $("path").textContent = "The first line is its title";
  const draft = readDraft(NEW_NOTE);
  if (draft && draft.content.trim()) {
    editor().value = draft.content; // written here before and never saved: it is back
    $("draft-text").textContent =
      "Your new note from " + new Date(draft.at).toLocaleString() + " is back.";
    $("draft").hidden = false;
  }
  setEditing(true);
  updateDirty();
  showPane("note");
  editor().focus();
}

async function moveNote() {
  if (!state.path) return;
  if (dirty() && !(await save(false))) return;
  const input = el("input", {
    type: "text",
    id: "move-path",
    autocomplete: "off",
    spellcheck: "false",
  });
  input.value = state.path.replace(/^notes\//, "").replace(/\.md$/, "");
  const links = el("input", {type: "checkbox", id: "move-links"});
  links.checked = true;
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && dialogDone) dialogDone("move");
  });
  const v = await dialog(
    "Move or rename",
    [
      el("label", {for: "move-path"}, "New name (folders with /)"),
      input,
      el("label", {class: "check"}, links, " Update links to it in other notes"),
    ],
    [
      ["cancel", "Cancel"],
      ["move", "Move", "primary"],
    ],
    input,
  );
  if (v !== "move") return;
  const to = toNotePath(input.value);
  if (to === state.path) return;
  mine(state.path);
  const {data} = await api(
    "PATCH",
    "/notes/" + enc(state.path) + "/move",
    {path: to, updateLinks: links.checked},
    {"If-Match": state.etag},
  );
  state.saved = editor().value;
  await openNote(data.path);
  await loadTree();
  toast("Moved to " + data.path);
}

async function deleteNote() {
  if (!state.path) return;
  const v = await choose(
    "Move to trash?",
    "“" + state.title + "” goes to the trash, where it can be restored.",
    [
      ["cancel", "Cancel"],
      ["delete", "Move to trash", "primary"],
    ],
  );
  if (v !== "delete") return;
  const path = state.path;
  mine(path);
  try {
    await api("DELETE", "/notes/" + enc(path), undefined, {"If-Match": state.etag});
  } catch (e) {
    if (e.status === 412) throw new Error("It changed elsewhere: reload it before deleting.");
    throw e;
  }
  dropDraft();
  closeNote();
  showPane("notes");
  await loadTree();
  toast(
    "Moved " + nameOf(path) + " to the trash",
    false,
    features.history ? ["Undo", () => undoDelete(path)] : null,
  );
}

async function loadBacklinks(path) {
  const box = $("backlinks");
  box.hidden = true;
  let r;
  try {
    r = await api("GET", "/plugins/backlinks/" + enc(path));
  } catch (e) {
    return;
  } // the plugin may be off
  if (path !== state.path) return;
  const list = r.data.backlinks || r.data.notes || [];
  if (!list.length) return;
  const items = list.map((n) =>
    el(
      "li",
      {},
      el(
        "button",
        {type: "button", class: "link", onclick: act(() => openNote(n.path))},
        n.title || n.path,
      ),
    ),
  );
  box.replaceChildren(el("strong", {}, "Linked from"), el("ul", {}, ...items));
  box.hidden = false;
}

// -- history and the trash (where the server keeps them) ----------------------------------

function when(iso) {
  const t = Date.parse(iso);
  return t ? new Date(t).toLocaleString() : iso;
}

// Why a version was kept, in words.
const REASONS = {
  updated: "edited",
  merged: "merged with an edit from another device",
  external: "changed outside notesvc",
  moved: "before a move",
  deleted: "before it was deleted",
  restored: "before a restore",
  linksRewritten: "links updated",
  dav: "saved by another app",
};

function dayAndTime(iso) {
  const t = new Date(iso);
  const days = Math.round(
    (new Date().setHours(0, 0, 0, 0) - new Date(t).setHours(0, 0, 0, 0)) / 864e5,
  );
  const time = t.toLocaleTimeString([], {hour: "2-digit", minute: "2-digit"});
  if (days === 0) return "Today, " + time;
  if (days === 1) return "Yesterday, " + time;
  return t.toLocaleDateString([], {weekday: "short", day: "numeric", month: "short"}) + ", " + time;
}

// What changed, word by word; long unchanged stretches shrink to their ends.
function wordDiffView(before, after) {
  const out = el("p", {class: "words"});
  const parts = wordDiff(before, after);
  parts.forEach((part, i) => {
    if (part.op !== "same") {
      out.append(el(part.op === "add" ? "ins" : "del", {}, part.text));
      return;
    }
    const t = part.text;
    const head = i > 0 ? 80 : 0; // after a change: its context
    const tail = i < parts.length - 1 ? 80 : 0; // before one
    if (t.length <= head + tail + 40) out.append(t);
    else out.append(t.slice(0, head), el("span", {class: "gap"}, " … "), t.slice(t.length - tail));
  });
  return out;
}

// The history as a timeline: when, why, and what changed since, word by word; restore in
// one tap.
async function showHistory() {
  if (!state.path) return;
  const path = state.path;
  const {data} = await api("GET", "/notes/" + enc(path) + "/versions?limit=50");
  const base = "/notes/" + enc(path) + "/versions/";
  const list = el("ol", {class: "timeline", id: "versions"});
  const detail = el("div", {id: "version-detail"});
  for (const v of data.versions) {
    const changes = act(async () => {
      const r = await api("GET", base + enc(v.id));
      const now = editor().value;
      detail.replaceChildren(
        el("h3", {}, "From " + dayAndTime(v.savedAt) + " to now"),
        r.data.content === now
          ? el("p", {}, "The same as now.")
          : wordDiffView(r.data.content, now),
        el("p", {class: "muted"}, "Struck out: only then. Underlined: only now."),
      );
      detail.scrollIntoView({block: "nearest"});
    });
    const view = act(async () => {
      const r = await api("GET", base + enc(v.id));
      detail.replaceChildren(
        el("h3", {}, "As it was " + dayAndTime(v.savedAt)),
        el("pre", {}, r.data.content),
      );
    });
    const restore = act(async () => {
      dialogDone("cancel");
      if (!(await confirmLeave())) return;
      await writing(async () => {
        const r = await api("POST", base + enc(v.id) + "/restore", undefined, {
          "If-Match": state.etag,
        });
        dropDraft();
        showNote(r.data);
        setEditing(false);
        updateDirty();
      });
      toast("Restored the version of " + dayAndTime(v.savedAt));
    });
    list.append(
      el(
        "li",
        {"data-version": v.id},
        el(
          "span",
          {class: "when"},
          el("strong", {}, dayAndTime(v.savedAt)),
          el("small", {class: "muted"}, (REASONS[v.reason] || v.reason) + " · " + sizeText(v.size)),
        ),
        el(
          "span",
          {class: "actions"},
          el("button", {type: "button", onclick: changes}, "Changes"),
          el("button", {type: "button", onclick: view}, "View"),
          writable() ? el("button", {type: "button", onclick: restore}, "Restore") : null,
        ),
      ),
    );
  }
  if (!data.versions.length) list.append(el("li", {class: "muted"}, "No earlier versions yet."));
  await dialog("History of " + state.title, [list, detail], [["cancel", "Close"]]);
}

async function restoreFromTrash(item, to) {
  try {
    const r = await api("POST", "/trash/" + enc(item.id) + "/restore", to ? {path: to} : undefined);
    return r.data;
  } catch (e) {
    if (e.status !== 409) throw e;
    const input = el("input", {
      type: "text",
      id: "restore-path",
      autocomplete: "off",
      spellcheck: "false",
    });
    input.value = item.path.replace(/(\.\w+)$/, " (restored)$1");
    const v = await dialog(
      "Restore under another name",
      [e.message, el("label", {for: "restore-path"}, "Restore as"), input],
      [
        ["cancel", "Cancel"],
        ["restore", "Restore", "primary"],
      ],
      input,
    );
    return v === "restore" ? restoreFromTrash(item, input.value.trim()) : null;
  }
}

async function showTrash() {
  const {data} = await api("GET", "/trash?limit=100");
  const list = el("ul", {class: "list", id: "trash-items"});
  const detail = el("div", {id: "trash-detail"});
  for (const item of data.items) {
    const view = act(async () => {
      const r = await api("GET", "/trash/" + enc(item.id));
      detail.replaceChildren(el("h3", {}, item.path), el("pre", {}, r.data.content || ""));
    });
    const restore = act(async () => {
      dialogDone("cancel");
      const rec = await restoreFromTrash(item);
      if (!rec) return;
      await loadTree();
      toast("Restored " + rec.path);
      if (rec.path.startsWith("notes/")) await openNote(rec.path);
    });
    const purge = act(async () => {
      await api("DELETE", "/trash/" + enc(item.id));
      row.remove();
    });
    const row = el(
      "li",
      {"data-trash": item.id},
      el(
        "span",
        {},
        item.path,
        el("small", {class: "muted"}, " · deleted " + when(item.deletedAt)),
      ),
      el(
        "span",
        {class: "actions"},
        item.path.endsWith(".md") ? el("button", {type: "button", onclick: view}, "View") : null,
        writable() ? el("button", {type: "button", onclick: restore}, "Restore") : null,
        state.grant
          ? null
          : el(
              // purging for good is the owner's alone
              "button",
              {
                type: "button",
                class: "danger",
                onclick: purge,
                "aria-label": "Delete forever: " + item.path,
              },
              "Delete",
            ),
      ),
    );
    list.append(row);
  }
  if (!data.items.length) list.append(el("li", {class: "muted"}, "The trash is empty."));
  await dialog("Trash", [list, detail], [["cancel", "Close"]]);
}

// Undo a delete: the newest trash item with that path comes back.
async function undoDelete(path) {
  const {data} = await api("GET", "/trash?limit=50");
  const item = data.items.find((i) => i.path === path);
  if (!item) throw new Error("It is no longer in the trash.");
  const rec = await restoreFromTrash(item);
  if (!rec) return;
  await loadTree();
  await openNote(rec.path);
}

// -- attachments: a photo, a file, a pasted image ------------------------------------------

function attachmentPath(file) {
  const now = new Date();
  const stamp = now.toISOString().replace(/[-:]/g, "").replace("T", "-").slice(0, 15);
  const dot = file.name.lastIndexOf(".");
  const ext = (dot > 0 ? file.name.slice(dot + 1) : file.type.split("/")[1] || "bin").toLowerCase();
  const stem =
    (dot > 0 ? file.name.slice(0, dot) : file.name || "file")
      .normalize("NFKD")
      .replace(/[^\w-]+/g, "-")
      .replace(/^-+|-+$/g, "")
      .slice(0, 60) || "file";
  const folder = state.path ? folderOf(state.path).replace(/^notes\/?/, "") : "";
  return (
    "attachments/" +
    (folder ? folder + "/" : "") +
    stamp +
    "-" +
    stem +
    "." +
    ext.replace(/[^\w]/g, "")
  );
}

// PUT the file's bytes; never over another file (If-None-Match: *): a taken name gets -2, -3…
// `once`: an Idempotency-Key (the outbox's): sent again after a lost answer, the upload is
// made once.
async function upload(file, once) {
  const path = attachmentPath(file);
  for (let n = 1; ; n++) {
    const tried = n === 1 ? path : path.replace(/(\.\w+)$/, "-" + n + "$1");
    const headers = {"Content-Type": file.type || "application/octet-stream", "If-None-Match": "*"};
    if (once) headers["Idempotency-Key"] = once + ":" + n;
    try {
      const r = await api("PUT", "/attachments/" + enc(tried), file, headers);
      return r.data;
    } catch (e) {
      if (e.status !== 412 || n >= 5) throw e;
    }
  }
}

async function attach(files) {
  if (!state.path || !files.length) return;
  if (!state.editing) setEditing(true);
  const ed = editor();
  for (const file of files) {
    toast("Uploading " + (file.name || "the image") + "…");
    const data = await upload(file);
    const label = (file.name || "image").replace(/[[\]]/g, "");
    const md =
      (/^image\//.test(data.contentType) ? "!" : "") +
      "[" +
      label +
      "](" +
      relativeTo(state.path, data.path) +
      ")";
    const at = ed.selectionStart === undefined ? ed.value.length : ed.selectionEnd;
    const before = ed.value.slice(0, at);
    const insert = (before && !before.endsWith("\n") ? "\n" : "") + md + "\n";
    ed.value = before + insert + ed.value.slice(at);
    ed.setSelectionRange(at + insert.length, at + insert.length);
    toast("Attached " + data.path + ": Save to keep the link");
  }
  updateDirty();
  scheduleDraft();
}

// -- the change feed: the tree and the open note follow edits made elsewhere ----------------

let feedRun = 0; // one follower at a time: a new connection starts a new one
// Notes this page is moving or deleting itself: the feed's report of it is no news.
const own = new Set();
function mine(path) {
  own.add(path);
  setTimeout(() => own.delete(path), 30000);
}
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
let treeTimer = 0;
function treeSoon() {
  clearTimeout(treeTimer);
  treeTimer = setTimeout(() => loadTree().catch(() => {}), 300);
}
let recentTimer = 0;
function recentSoon() {
  clearTimeout(recentTimer);
  recentTimer = setTimeout(() => loadRecent().catch(() => {}), 1500);
}

function cursorAfterGone(e) {
  // A 410 says where the server's changes end: from there on, after listing again.
  const last = e.error && (e.error.last !== undefined ? e.error.last : null);
  if (Number.isInteger(last)) return last;
  const m = /since=(\d+)/.exec(e.message || "");
  return m ? parseInt(m[1], 10) : null;
}

async function changeCursor() {
  let since = 0;
  for (let page = 0; page < 20; page++) {
    let r;
    try {
      r = await api("GET", "/changes?wait=0&limit=1000&since=" + since);
    } catch (e) {
      if (e.status === 410) return cursorAfterGone(e);
      throw e;
    }
    since = r.data.last;
    if (!r.data.more) return since;
  }
  return since;
}

function applyChange(c) {
  if (offlineOn()) mirrorChange(c).catch(() => {});
  if (c.kind === "updated" || c.kind === "modified")
    recentSoon(); // the recent list's order; the tree is the same
  else treeSoon(); // the tree's names (and the recent list)
  if (!state.path || own.has(c.from || c.path)) return;
  if (c.kind === "moved" && c.from === state.path) {
    // Follow it at once (a later change in the same batch may name the new path); unsaved
    // text stays and will be saved there.
    removeItem("local", draftKey(state.path));
    state.path = c.path;
    $("path").textContent = c.path;
    $("path").title = c.path;
    setItem("session", "notesvc.open", c.path);
    keepDraft();
    loadBacklinks(c.path);
    reveal(c.path).catch(() => {});
    if (!dirty()) checkOpenNote().catch(() => {}); // a move may rewrite its links
    toast("“" + state.title + "” moved to " + c.path);
  } else if (c.path === state.path) {
    if (c.kind === "deleted" && !dirty()) {
      closeNote();
      toast(
        c.path + " was deleted elsewhere",
        false,
        features.history ? ["Undo", () => undoDelete(c.path)] : null,
      );
    } else if (c.kind === "deleted") {
      showConflict(true);
    } else if (c.etag !== state.etag) {
      // Perhaps our own write: look when it is done.
      if (state.writes) state.recheck = true;
      else checkOpenNote().catch(() => {});
    }
  }
}

async function followChanges() {
  const run = ++feedRun;
  const alive = () => run === feedRun && state.key && !$("app").hidden;
  let since = null;
  let pause = 1000;
  while (alive()) {
    try {
      if (since === null) since = await changeCursor();
      if (since === null) return; // this server gives no cursor: coming back to the page refreshes
      const r = await api("GET", "/changes?wait=20&limit=1000&since=" + since);
      if (!alive()) return;
      for (const c of r.data.changes) applyChange(c);
      since = r.data.last;
      pause = 1000;
      if (r.data.retryAfter) await sleep(r.data.retryAfter * 1000); // too many feeds waiting
    } catch (e) {
      if (e.status === 401 || e.status === 429) return;
      if (e.status === 410) {
        since = cursorAfterGone(e);
        treeSoon();
        checkOpenNote().catch(() => {});
        continue;
      }
      await sleep(pause); // offline, or the server restarts: try again, less and less often
      pause = Math.min(pause * 2, 30000);
    }
  }
}

// What this server offers, from its OpenAPI document (an older one has the core only).
async function readFeatures() {
  try {
    const {json} = await api("GET", "/openapi.json", undefined, undefined, {raw: true});
    const paths = Object.keys((json && json.paths) || {});
    const has = (end) => paths.some((p) => p.endsWith(end));
    features.history = has("/trash") && has("/versions");
    features.attachments = has("/attachments");
    features.changes = has("/changes");
  } catch (e) {
    /* the core only */
  }
  $("menu-trash").hidden = !features.history;
  $("history").hidden = !features.history;
  $("attach").hidden = !features.attachments || !writable();
  $("photo").hidden =
    !features.attachments || !writable() || !matchMedia("(pointer: coarse)").matches; // a camera
}

// -- search ----------------------------------------------------------------------------------

function highlight(text, words) {
  const frag = document.createDocumentFragment();
  const folded = fold(text);
  const marks = [];
  for (const w of words) {
    let at = 0;
    for (;;) {
      const i = folded.indexOf(w, at);
      if (i < 0) break;
      if (i === 0 || !/[\p{L}\p{N}]/u.test(folded[i - 1])) marks.push([i, i + w.length]);
      at = i + 1;
    }
  }
  marks.sort((a, b) => a[0] - b[0]);
  let last = 0;
  for (const [s, e] of marks) {
    if (s < last) continue;
    let end = e; // run on to the end of the word: "key" marks "keys"
    while (end < text.length && /[\p{L}\p{N}]/u.test(text[end])) end++;
    frag.append(text.slice(last, s), el("mark", {}, text.slice(s, end)));
    last = end;
  }
  frag.append(text.slice(last));
  return frag;
}

// A snippet is raw Markdown: leave out the marks that only make it harder to read.
let searchSeq = 0;
let searchTimer = 0;
async function runSearch() {
  clearTimeout(searchTimer);
  const q = $("search").value.trim();
  if (!q) {
    endSearch(false);
    return;
  }
  const seq = ++searchSeq;
  $("app").classList.add("searching");
  showPane("search");
  const {data} = await api("GET", "/search?limit=50&q=" + enc(q));
  if (seq !== searchSeq) return;
  const words = queryWords(q);
  $("search-hint").hidden = true;
  $("results-info").textContent =
    (data.total === 1 ? "1 note" : data.total + " notes") +
    " · " +
    (data.tookMs < 10 ? data.tookMs.toFixed(1) : Math.round(data.tookMs)) +
    " ms";
  $("results").replaceChildren(
    ...data.results.map((hit, i) =>
      el(
        "li",
        {},
        el(
          "button",
          {
            type: "button",
            id: "hit-" + i,
            "data-path": hit.path,
            onclick: act(() => openNote(hit.path)),
          },
          el("span", {class: "t"}, highlight(hit.title, words)),
          el("span", {class: "p"}, hit.path),
          el("span", {class: "s"}, highlight(plainSnippet(hit.snippet), words)),
        ),
      ),
    ),
  );
  if (!data.results.length)
    $("results").appendChild(
      el("li", {class: "muted"}, "Nothing found. Try fewer words, or pre* for a prefix."),
    );
}

function endSearch(focusTree) {
  searchSeq++;
  $("search").value = "";
  $("app").classList.remove("searching");
  $("results").replaceChildren();
  $("results-info").textContent = "";
  $("search-hint").hidden = false;
  if (NARROW.matches) showPane("notes");
  if (focusTree) {
    const target =
      $("tree").querySelector("button[aria-current=true]") || $("tree").querySelector("button");
    if (target) target.focus();
  }
}

function moveInResults(step) {
  const buttons = Array.from($("results").querySelectorAll("button"));
  if (!buttons.length) return;
  const at = buttons.indexOf(document.activeElement);
  const next = at < 0 ? (step > 0 ? 0 : buttons.length - 1) : at + step;
  if (next < 0) {
    $("search").focus();
    return;
  }
  buttons[Math.min(next, buttons.length - 1)].focus();
}

// -- quick capture: a line in today's note --------------------------------------------------

async function capture() {
  const input = $("capture");
  const text = input.value.trim();
  if (!text) return;
  let path;
  try {
    path = await appendToToday(text);
  } catch (e) {
    if (!unreachable(e) || !offlineOn()) throw e;
    const at = Date.now();
    await updateOutbox((items) => queueCapture(items, text, [], newId, at)); // sent when it can be
    input.value = "";
    toast("Kept on this device: it goes to today's note when the server can be reached");
    return;
  }
  input.value = "";
  toast("Added to " + nameOf(path));
  await loadTree();
}

// Append a timed line to today's note (the daily plugin's); return its path.
// `text`: the line, or a function of today's path giving it. `once`: an Idempotency-Key
// (the outbox's): a capture sent again after a lost answer is added once (each attempt has
// its own key, so an answer kept for one is found again). `at`: when it was captured.
async function appendToToday(text, once, at) {
  const now = at ? new Date(at) : new Date();
  const stamp =
    String(now.getHours()).padStart(2, "0") + ":" + String(now.getMinutes()).padStart(2, "0");
  for (let attempt = 0; attempt < 3; attempt++) {
    const today = await api("POST", "/plugins/daily/today");
    const note = today.data;
    const line = typeof text === "function" ? text(note.path) : text;
    const content =
      note.content + (note.content.endsWith("\n") ? "" : "\n") + "- " + stamp + " " + line + "\n";
    const headers = {"If-Match": note.etag};
    if (once) headers["Idempotency-Key"] = once + ":" + attempt;
    const done = await writing(async () => {
      try {
        await api("PUT", "/notes/" + enc(note.path), {content}, headers);
      } catch (e) {
        if (e.status === 412) return false; // written meanwhile: read it again
        throw e;
      }
      if (state.path === note.path && !dirty()) await openNote(note.path);
      return true;
    });
    if (done) return note.path;
  }
  throw new Error("Today's note keeps changing; try again.");
}

// -- ask -----------------------------------------------------------------------------------

async function ask() {
  const input = $("chat-input");
  const message = input.value.trim();
  if (!message) return;
  const log = $("chat-log");
  const about = $("about").checked && state.path;
  log.appendChild(
    el(
      "div",
      {class: "msg me"},
      message,
      about ? el("small", {class: "muted"}, "\nabout " + state.title) : null,
    ),
  );
  const pending = el("div", {class: "msg"}, el("span", {class: "muted"}, "Thinking…"));
  log.appendChild(pending);
  log.scrollTop = log.scrollHeight;
  input.value = "";
  const body = {message, channel: "web"};
  if (about) body.notePath = state.path;
  try {
    const {data} = await api("POST", "/agent/chat", body);
    const parts = [renderMarkdown(data.reply || "", {from: state.path})];
    if (data.sources && data.sources.length) {
      parts.push(el("div", {class: "hint", "aria-hidden": "true"}, "Sources"));
      parts.push(
        el(
          "ul",
          {class: "sources", "aria-label": "Sources"},
          ...data.sources.map((s) =>
            el(
              "li",
              {},
              el(
                "button",
                {
                  type: "button",
                  class: "link",
                  "data-path": s.path,
                  onclick: act(() => openNote(s.path)),
                },
                s.title || s.path,
              ),
            ),
          ),
        ),
      );
    }
    pending.replaceChildren(...parts);
  } catch (e) {
    pending.replaceChildren(el("span", {class: "err"}, e.message));
  }
  log.scrollTop = log.scrollHeight;
}

// -- start: wire the controls, connect with what this tab (or device) remembers ------------

async function start() {
  setSide(getItem("local", "notesvc.ui.side") !== "closed");
  offlineMenu();
  if (offlineOn()) await loadOutboxOrSay();
  await Promise.all([
    loadTree(),
    readFeatures().catch((e) => (offlineOn() ? null : Promise.reject(e))),
  ]);
  if (features.changes) followChanges();
  if (offlineOn()) {
    sendOutbox().catch(() => {}); // what waits goes now
    if (new URLSearchParams(location.search).has("shared")) {
      history.replaceState(history.state, "", location.pathname);
    }
    act(askShared)(); // the share sheet's items, once the person says yes
  }
  const last = getItem("session", "notesvc.open");
  if (last) {
    try {
      await openNote(last);
    } catch (e) {
      closeNote();
    }
  } else if (readDraft(NEW_NOTE) && writable()) {
    await newNote(); // a new note that was never saved: its text is back
  }
  if (NARROW.matches) {
    const pane = getItem("session", "notesvc.pane");
    showPane(pane && (pane !== "note" || state.path) ? pane : state.path ? "note" : "notes", true);
    history.replaceState({pane: $("app").dataset.pane}, "");
  }
}

function wire() {
  $("connect").addEventListener("click", () => connect(true));
  $("key").addEventListener("keydown", (e) => {
    if (e.key === "Enter") connect(true);
  });
  $("relay-code").addEventListener("keydown", (e) => {
    if (e.key === "Enter") connect(true);
  });
  $("remember").addEventListener("change", () => {
    $("remember-warn").hidden = !$("remember").checked;
  });
  $("logout").addEventListener("click", act(logout));
  for (const id of ["new", "empty-new", "menu-new"]) $(id).addEventListener("click", act(newNote));
  $("menu-refresh").addEventListener(
    "click",
    act(async () => {
      await loadTree();
      if (state.path && !dirty()) await openNote(state.path);
    }),
  );
  $("save").addEventListener(
    "click",
    act(() => save(false)),
  );
  $("overwrite").addEventListener(
    "click",
    act(() => save(true)),
  );
  $("reload").addEventListener("click", act(reloadTheirs));
  $("open-copy").addEventListener(
    "click",
    act(() => openNote($("conflict").dataset.copy)),
  );
  $("conflict-ok").addEventListener("click", () => ($("conflict").hidden = true));
  $("draft-discard").addEventListener(
    "click",
    act(() => {
      if (!state.blank) return reloadTheirs();
      dropDraft(); // a new note's draft: the page starts blank again
      editor().value = "";
      updateDirty();
      return undefined;
    }),
  );
  $("edit").addEventListener("click", () => {
    setEditing(!state.editing);
    if (state.editing) editor().focus();
  });
  $("back").addEventListener("click", () => showPane("notes"));
  $("move").addEventListener("click", act(moveNote));
  $("history").addEventListener("click", act(showHistory));
  $("menu-trash").addEventListener("click", act(showTrash));
  $("attach").addEventListener("click", () => $("attach-file").click());
  $("photo").addEventListener("click", () => $("attach-photo").click());
  for (const id of ["attach-file", "attach-photo"]) {
    $(id).addEventListener(
      "change",
      act(async () => {
        const files = Array.from($(id).files);
        $(id).value = "";
        await attach(files);
      }),
    );
  }
  editor().addEventListener("paste", (e) => {
    const files = Array.from((e.clipboardData && e.clipboardData.files) || []);
    if (!files.length || !features.attachments) return;
    e.preventDefault();
    act(() => attach(files))();
  });
  editor().addEventListener("drop", (e) => {
    const files = Array.from((e.dataTransfer && e.dataTransfer.files) || []);
    if (!files.length || !features.attachments) return;
    e.preventDefault();
    act(() => attach(files))();
  });
  $("delete").addEventListener("click", act(deleteNote));
  editor().addEventListener("input", () => {
    updateDirty();
    scheduleDraft();
    if (writable()) scheduleSave();
  });
  editor().addEventListener("focus", () => $("app").classList.add("typing"));
  editor().addEventListener("blur", () => $("app").classList.remove("typing"));
  $("search").addEventListener("input", () => {
    clearTimeout(searchTimer);
    searchTimer = setTimeout(act(runSearch), 250);
  });
  $("search").addEventListener("keydown", (e) => {
    if (e.key === "Enter") {
      e.preventDefault();
      act(runSearch)();
    } else if (e.key === "ArrowDown") {
      e.preventDefault();
      moveInResults(1);
    } else if (e.key === "Escape") {
      e.preventDefault();
      endSearch(true);
    }
  });
  $("search").addEventListener("focus", () => {
    if (NARROW.matches && $("search").value) showPane("search");
  });
  $("results").addEventListener("keydown", (e) => {
    if (e.key === "ArrowDown") {
      e.preventDefault();
      moveInResults(1);
    } else if (e.key === "ArrowUp") {
      e.preventDefault();
      moveInResults(-1);
    } else if (e.key === "Escape") {
      e.preventDefault();
      endSearch(true);
    }
  });
  $("results-close").addEventListener("click", () => endSearch(true));
  $("capture-add").addEventListener("click", act(capture));
  $("capture").addEventListener("keydown", (e) => {
    if (e.key === "Enter") act(capture)();
  });
  $("chat-send").addEventListener("click", act(ask));
  $("chat-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter") act(ask)();
  });
  $("toggle-ask").addEventListener("click", () =>
    setSide($("main").classList.contains("side-closed")),
  );
  for (const b of document.querySelectorAll(".tabs button")) {
    b.addEventListener("click", () => {
      showPane(b.dataset.pane);
      if (b.dataset.pane === "search") $("search").focus();
      if (b.dataset.pane === "ask") $("chat-input").focus();
    });
  }
  $("dlg").addEventListener("cancel", (e) => {
    e.preventDefault();
    if (dialogDone) dialogDone("cancel");
  });
  // Menus close when something is chosen or the click lands elsewhere.
  document.addEventListener("click", (e) => {
    for (const m of document.querySelectorAll("details.menu[open]")) {
      if (!m.contains(e.target) || e.target.closest(".menu-list button")) m.open = false;
    }
  });
  document.addEventListener("keydown", (e) => {
    const typing = /^(INPUT|TEXTAREA|SELECT)$/.test(document.activeElement.tagName);
    if ((e.ctrlKey || e.metaKey) && e.key.toLowerCase() === "s") {
      e.preventDefault();
      if (state.path) act(() => save(false))();
    } else if (e.key === "/" && !typing && !$("app").hidden && !$("dlg").open) {
      e.preventDefault();
      $("search").focus();
      $("search").select();
    } else if (e.key === "Escape") {
      for (const m of document.querySelectorAll("details.menu[open]")) {
        m.open = false;
        m.querySelector("summary").focus();
      }
    }
  });
  window.addEventListener("beforeunload", (e) => {
    keepDraft();
    if (dirty()) {
      e.preventDefault();
      e.returnValue = "";
    }
  });
  document.addEventListener("visibilitychange", () => {
    if (document.hidden) saveAsThePageHides();
    else act(lookAgain)();
  });
  window.addEventListener("popstate", (e) => {
    if (e.state && e.state.pane) showPane(e.state.pane, true);
  });
  if (window.visualViewport) window.visualViewport.addEventListener("resize", fitViewport);
  NARROW.addEventListener("change", () => {
    if (!NARROW.matches) $("app").classList.toggle("searching", !!$("search").value.trim());
  });
  new MutationObserver(() => setItem("session", "notesvc.pane", $("app").dataset.pane)).observe(
    $("app"),
    {attributes: true, attributeFilter: ["data-pane"]},
  );
}

wire();
(function boot() {
  const code = new URLSearchParams(location.search).get("relayCode");
  if (new URLSearchParams(location.search).get("share") === "off") {
    // the share sheet reached the server itself: no worker here to keep what was shared
    history.replaceState(history.state, "", location.pathname);
    toast(
      "Sharing to notesvc needs “Keep notes on this device” (in the menu): turn it on, " +
        "then share again.",
      true,
    );
  }
  if (code) $("relay-code").value = code;
  const pairing = pairingInUrl();
  if (pairing) {
    // the secret leaves the address bar and the history at once: it is good once
    history.replaceState(history.state, "", location.pathname + location.search);
    $("pair-box").dataset.secret = pairing;
    $("pair-name").placeholder = "the name it was given, or " + deviceGuess();
    $("pair-box").hidden = false;
    if (SHARED_ORIGIN) {
      $("pair-msg").textContent =
        "This relay gives all its servers one address, where nothing can be kept: open " +
        "the link on the server's own address instead.";
      $("pair-join").disabled = true;
    }
  }
  if (SHARED_ORIGIN) {
    $("shared-origin").hidden = false;
    $("remember").closest("label").hidden = true;
  }
  const kept = keptKey();
  state.base = kept ? kept.base : getItem("local", "notesvc.base") || "";
  if (!ownOrigin(state.base) || /^[a-z]+:/i.test(state.base)) state.base = "";
  if (getItem("local", "notesvc.wipe")) forgetOffline().catch(() => {}); // one cut short
  // A pairing code may name any server: the page waits for a person to connect, and then
  // sends the kept key only if the code resolves to the API base it was kept for.
  if (kept && !code && !pairing) connect(false);
  else if (!pairing && !kept && !SHARED_ORIGIN) offerSetup();
  else if (!pairing) $("key").focus();
})();
"""[1:]
# --- end web/app.js ---

# --- begin web/grants.js ---
WEB_GRANTS_JS = r"""
// -- keys, connections and share links (what a grant may do shapes the page) --------------
// The API key holds every scope, and so does an admin device; a scoped key (or a folder
// key or device) sees only what it may use: a read key gets no editing, a folder key only
// its folder (the server filters the rest).

function writable() {
  return !state.grant || state.grant.scope !== "read";
}

function ownerLike() {
  return !state.grant || (state.grant.scope === "admin" && !state.grant.folder);
}

function applyGrant(grant) {
  state.grant = grant || null;
  const owner = ownerLike();
  const write = writable();
  for (const id of ["edit", "save", "new", "empty-new", "menu-new", "move", "delete"]) {
    $(id).hidden = !write;
  }
  const daily = owner || !state.grant.folder || state.grant.folder === "notes/daily";
  $("app").querySelector(".capture").hidden = !write || !daily; // today's note is notes/daily
  $("menu-keys").hidden = !owner;
  $("menu-telegram").hidden = !owner;
  $("share").hidden = !write;
  if (!write) {
    $("attach").hidden = true;
    $("photo").hidden = true;
  }
  $("app").dataset.scope = state.grant ? state.grant.scope : "admin";
  if (state.grant && state.grant.folder) $("app").dataset.folder = state.grant.folder;
}

// Copy: the Clipboard API where the page is a secure context, else (plain HTTP on a home
// network) the selection and the browser's copy command.
async function copyText(text, what, field) {
  try {
    await navigator.clipboard.writeText(text);
    toast(what + " copied");
    return;
  } catch (e) {
    /* no Clipboard API here: the selection instead */
  }
  const box = field || el("textarea", {class: "offscreen", readonly: true, "aria-hidden": "true"});
  if (!field) {
    box.value = text;
    ($("dlg").open ? $("dlg") : document.body).append(box);
  }
  box.focus();
  box.select();
  let done = false;
  try {
    done = document.execCommand("copy");
  } catch (e) {
    done = false;
  }
  if (!field) box.remove();
  if (done) toast(what + " copied");
  else toast("Select it and copy it yourself: this browser did not allow copying", true);
}

function shownOnce(label, value, id) {
  const input = el("input", {type: "text", id, readonly: true, spellcheck: "false"});
  input.value = value;
  input.addEventListener("focus", () => input.select());
  return el(
    "div",
    {class: "once"},
    el("label", {for: id}, label),
    input,
    el("button", {type: "button", onclick: () => copyText(value, label, input)}, "Copy"),
  );
}

const SCOPE_TEXT = {admin: "everything", write: "read and write", read: "read only"};

function grantRow(g, list) {
  const what = [
    SCOPE_TEXT[g.scope] || g.scope,
    g.folder ? "only " + g.folder : "all notes",
    g.expiresAt ? "expires " + when(g.expiresAt) : "never expires",
    g.lastUsedAt ? "used " + ago(g.lastUsedAt) : "never used",
  ];
  const revoke = act(async () => {
    const sure = await choose(
      "Revoke “" + g.name + "”?",
      g.kind === "oauth"
        ? "This app is disconnected at once; it must ask you again to come back."
        : g.kind === "device"
          ? "This device is signed out at once, and the share links it made end."
          : "This key stops working at once, and the share links it made end.",
      [
        ["cancel", "Cancel"],
        ["revoke", "Revoke", "danger"],
      ],
    );
    if (sure === "revoke") await api("DELETE", "/auth/keys/" + enc(g.id));
    await showKeys();
  });
  list.append(
    el(
      "li",
      {"data-grant": g.id},
      el(
        "span",
        {},
        el("strong", {}, g.name),
        el("small", {class: "muted"}, " · " + what.join(" · ")),
      ),
      el(
        "span",
        {class: "actions"},
        el("button", {type: "button", class: "danger", onclick: revoke}, "Revoke"),
      ),
    ),
  );
}

async function showKeys(made) {
  const [{data}, shares] = await Promise.all([api("GET", "/auth/keys"), api("GET", "/shares")]);
  const keys = el("ul", {class: "list", id: "keys-list"});
  const apps = el("ul", {class: "list", id: "connections-list"});
  const devices = el("ul", {class: "list", id: "devices-list"});
  for (const g of data.keys) {
    grantRow(g, g.kind === "oauth" ? apps : g.kind === "device" ? devices : keys);
  }
  if (!keys.children.length) keys.append(el("li", {class: "muted"}, "No scoped keys yet."));
  if (!devices.children.length) devices.append(el("li", {class: "muted"}, "No device yet."));
  if (!apps.children.length) {
    apps.append(el("li", {class: "muted"}, "No app is connected (Claude, ChatGPT…)."));
  }
  const links = el("ul", {class: "list", id: "shares-list"});
  for (const s of shares.data.shares) links.append(shareRow(s, showKeys));
  if (!links.children.length) links.append(el("li", {class: "muted"}, "No share links."));
  const name = el("input", {type: "text", id: "key-name", placeholder: "family tablet"});
  const scope = el(
    "select",
    {id: "key-scope"},
    el("option", {value: "read"}, "read only"),
    el("option", {value: "write"}, "read and write"),
  );
  const folder = el("input", {type: "text", id: "key-folder", placeholder: "notes/family"});
  const days = el(
    "select",
    {id: "key-days"},
    el("option", {value: "30"}, "in 30 days"),
    el("option", {value: "365"}, "in a year"),
    el("option", {value: ""}, "never"),
  );
  const create = act(async () => {
    const body = {name: name.value.trim() || "key", scope: scope.value};
    let f = folder.value.trim().replace(/\/+$/, "");
    if (f) body.folder = f.startsWith("notes") ? f : "notes/" + f.replace(/^\/+/, "");
    if (days.value) body.expiresInDays = Number(days.value);
    const r = await api("POST", "/auth/keys", body);
    await showKeys(r.data);
  });
  const form = el(
    "div",
    {class: "new-key"},
    el("h3", {}, "New key"),
    el("label", {for: "key-name"}, "Name"),
    name,
    el("label", {for: "key-scope"}, "It may"),
    scope,
    el("label", {for: "key-folder"}, "Only this folder (optional)"),
    folder,
    el("label", {for: "key-days"}, "Expires"),
    days,
    el("button", {type: "button", id: "key-create", class: "primary", onclick: create}, "Create"),
  );
  const body = [];
  if (made) {
    body.push(
      el("p", {class: "warn"}, "Copy the new key now: it is shown this once."),
      shownOnce("Key “" + made.name + "”", made.key, "new-key"),
    );
  }
  body.push(
    el("h3", {}, "Devices"),
    devices,
    el(
      "div",
      {class: "row"},
      el(
        "button",
        {type: "button", id: "add-device", class: "primary", onclick: act(() => addDevice(false))},
        "Add a device",
      ),
      el(
        "button",
        {type: "button", id: "add-folder", onclick: act(() => addDevice(true))},
        "Give someone a folder",
      ),
    ),
    el("h3", {}, "Keys"),
    keys,
    el("h3", {}, "Connected apps"),
    apps,
    el("h3", {}, "Share links"),
    links,
    form,
  );
  await dialog("Keys and devices", body, [["cancel", "Close"]]);
}

function shareRow(s, after) {
  const revoke = act(async () => {
    await api("DELETE", "/shares/" + enc(s.id));
    toast("The link no longer opens " + nameOf(s.path));
    await after();
  });
  return el(
    "li",
    {"data-share": s.id},
    el(
      "span",
      {},
      nameOf(s.path),
      el("small", {class: "muted"}, " · expires " + when(s.expiresAt)),
    ),
    el(
      "span",
      {class: "actions"},
      el("button", {type: "button", class: "danger", onclick: revoke}, "Revoke"),
    ),
  );
}

async function shareNote(made) {
  if (!state.path) return;
  const path = state.path;
  const {data} = await api("GET", "/shares");
  const list = el("ul", {class: "list", id: "share-links"});
  for (const s of data.shares) if (s.path === path) list.append(shareRow(s, () => shareNote()));
  if (!list.children.length) list.append(el("li", {class: "muted"}, "Not shared yet."));
  const days = el(
    "select",
    {id: "share-days"},
    el("option", {value: "1"}, "in a day"),
    el("option", {value: "7", selected: true}, "in a week"),
    el("option", {value: "30"}, "in 30 days"),
    el("option", {value: "365"}, "in a year"),
  );
  const create = act(async () => {
    const r = await api("POST", "/shares", {path, expiresInDays: Number(days.value)});
    await shareNote(r.data);
  });
  const body = [
    el(
      "p",
      {},
      "Anyone with a link reads this note, formatted, without a key, until it expires " +
        "or you revoke it. Other notes stay private.",
    ),
  ];
  if (made) body.push(shownOnce("Link", made.url, "share-url"));
  body.push(
    el("label", {for: "share-days"}, "A new link expires"),
    days,
    el("button", {type: "button", id: "share-create", class: "primary", onclick: create}, "Create"),
    el("h3", {}, "Links to this note"),
    list,
  );
  await dialog("Share " + (state.title || nameOf(path)), body, [["cancel", "Close"]]);
}

function wireGrants() {
  $("menu-keys").addEventListener(
    "click",
    act(() => showKeys()),
  );
  $("menu-telegram").addEventListener(
    "click",
    act(() => showTelegram()),
  );
  $("share").addEventListener(
    "click",
    act(() => shareNote()),
  );
}
wireGrants();
"""[1:]
# --- end web/grants.js ---
# --- begin web/offline.js ---
WEB_OFFLINE_JS = r"""
// -- offline: the notes kept on this device (opt-in, per device) ---------------------------
// "Keep notes on this device" mirrors the notes this key sees into IndexedDB, keeps the app
// in a service worker, and queues what is written while the server cannot be reached (the
// outbox, sent through merge when it can be). It needs a secure context (HTTPS, a relay's
// per-server origin, or localhost): elsewhere the option says so and stays off. Turning
// it off deletes the copy. A key that stops working wipes it.

const offline = {db: null, items: [], sending: false};

function offlineOn() {
  return !!state.base && getItem("local", "notesvc.offline") === state.base;
}

// The server cannot be reached: no answer at all, or the relay's word that the server
// behind it is not there (502, 503, 504).
function unreachable(e) {
  return e.status === 0 || e.status === 502 || e.status === 503 || e.status === 504;
}

function offlinePossible() {
  return (
    window.isSecureContext &&
    "serviceWorker" in navigator &&
    "indexedDB" in window &&
    !SHARED_ORIGIN
  );
}

function idb() {
  if (offline.db) return Promise.resolve(offline.db);
  return new Promise((resolve, reject) => {
    const open = indexedDB.open("notesvc", 1);
    open.onupgradeneeded = () => {
      open.result.createObjectStore("notes", {keyPath: "path"});
      open.result.createObjectStore("meta");
    };
    open.onsuccess = () => resolve((offline.db = open.result));
    open.onerror = () => reject(open.error);
  });
}

// One request on one store, as a promise.
async function stored(name, mode, fn) {
  const db = await idb();
  return new Promise((resolve, reject) => {
    const tx = db.transaction(name, mode);
    const req = fn(tx.objectStore(name));
    tx.oncomplete = () => resolve(req && req.result);
    tx.onerror = () => reject(tx.error);
  });
}

async function mirrorPut(note) {
  if (!offlineOn() || !note || !note.path) return;
  const kept = {path: note.path, title: note.title, etag: note.etag, modified: note.modified};
  kept.content =
    note.content !== undefined ? note.content : ((await mirrorGet(note.path)) || {}).content;
  await stored("notes", "readwrite", (s) => s.put(kept));
}
async function mirrorGet(path) {
  return stored("notes", "readonly", (s) => s.get(path));
}
async function mirrorAll() {
  return (await stored("notes", "readonly", (s) => s.getAll())) || [];
}
async function mirrorDrop(path) {
  if (!offlineOn()) return;
  await stored("notes", "readwrite", (s) => s.delete(path));
}
async function mirrorRecent(limit) {
  const all = await mirrorAll();
  all.sort((a, b) => (a.modified < b.modified ? 1 : a.modified > b.modified ? -1 : 0));
  return all.slice(0, limit).map((n) => ({
    ...n,
    preview: plainSnippet((n.content || "").split("\n").slice(1).join(" ")).slice(0, 160),
  }));
}

// The tree of a folder, from the copy (as GET /folders/tree?depth=1 has it).
async function mirrorTree(folder) {
  const folders = new Map();
  const notes = [];
  for (const n of await mirrorAll()) {
    if (!n.path.startsWith(folder + "/")) continue;
    const rest = n.path.slice(folder.length + 1).split("/");
    if (rest.length === 1) notes.push({type: "note", name: rest[0], path: n.path});
    else folders.set(rest[0], (folders.get(rest[0]) || 0) + 1);
  }
  const byName = (a, b) => a.name.localeCompare(b.name);
  const dirs = [...folders].map(([name, count]) => ({
    type: "folder",
    name,
    path: folder + "/" + name,
    count,
  }));
  return {children: [...dirs.sort(byName), ...notes.sort(byName)]};
}

async function loadOutbox() {
  offline.items = offlineOn()
    ? (await stored("meta", "readonly", (s) => s.get("outbox"))) || []
    : [];
  showWaiting();
}
// At start: a browser that refuses IndexedDB (private mode, storage full) still opens the
// notes from the server; the page says the copy cannot be read.
async function loadOutboxOrSay() {
  try {
    await loadOutbox();
  } catch (e) {
    toast("The notes kept on this device cannot be read here: " + (e.message || e), true);
  }
}
// Change the outbox as one step: read, change, write in one IndexedDB transaction, so a
// change made meanwhile (this tab's sender, another tab, the share sheet's worker) is never
// written over with an older list. Resolves to the list as written.
async function updateOutbox(change) {
  if (!offlineOn()) return offline.items; // the copy was let go meanwhile: nothing is kept
  const db = await idb();
  offline.items = await new Promise((resolve, reject) => {
    const tx = db.transaction("meta", "readwrite");
    const store = tx.objectStore("meta");
    const read = store.get("outbox");
    let items = [];
    read.onsuccess = () => {
      items = change(read.result || []);
      store.put(items, "outbox");
    };
    tx.oncomplete = () => resolve(items);
    tx.onerror = () => reject(tx.error);
  });
  showWaiting();
  if (offline.tabs) offline.tabs.postMessage("outbox"); // the other tabs show it too
  return offline.items;
}

// The badge in the bar, on every pane: "Offline", "2 to send" (its title says it whole).
function showWaiting() {
  const box = $("offline-state");
  const on = offlineOn();
  const n = on ? offline.items.length : 0;
  const off = on && !navigator.onLine;
  box.textContent = [off ? "Offline" : "", n ? n + " to send" : ""].filter(Boolean).join(" · ");
  box.title = [off ? "No connection: your notes open from this device" : "", waiting(offline.items)]
    .filter(Boolean)
    .join(". ");
  box.className = "";
  box.hidden = !box.textContent;
}

// The server cannot be reached: keep the text on this device, to send when it can be.
async function keepOffline(path, content) {
  const raw = fromEditor(content); // (a CRLF note keeps its line endings)
  if (path === null) {
    const local = "new:" + newId();
    const folder = (state.grant && state.grant.folder) || "";
    await updateOutbox((items) => queueCreate(items, local, folder, raw, newId));
    state.blank = false;
    state.path = local;
    state.etag = null;
  } else {
    const base = state.etag;
    await updateOutbox((items) => queueSave(items, path, base, raw, newId));
  }
  state.saved = content;
  const title = (content.split("\n").find((l) => l.trim()) || "untitled").replace(/^#+\s*/, "");
  await mirrorPut({
    path: state.path,
    title,
    content: raw,
    etag: state.etag,
    modified: new Date().toISOString(),
  });
  loadRecent().catch(() => {}); // the list shows it too (from this device's copy)
  $("status").textContent = "Kept on this device";
  $("status").className = "";
  updateDirty();
  return true;
}

// Send what waits, in order, once each (the idempotency keys make a resend harmless); one
// tab at a time (the others find the outbox done).
async function sendOutbox() {
  if (!offlineOn() || offline.sending || !navigator.onLine) return;
  if (!navigator.locks) return sendWaiting();
  return navigator.locks.request("notesvc-outbox", {ifAvailable: true}, (lock) =>
    lock ? sendWaiting() : null,
  );
}
async function sendWaiting() {
  offline.sending = true;
  try {
    await loadOutbox();
    for (let item = nextItem(offline.items); item && offlineOn();) {
      await updateOutbox((items) => markSent(items, item)); // a later edit queues anew
      let answer;
      try {
        answer = await sendItem(item);
      } catch (e) {
        const refused = e.status >= 400 && e.status < 500 && ![401, 408, 429].includes(e.status);
        if (!refused) break; // out of reach, the server unwell, the key refused: later, as it is
        // refused for good (too large, no longer allowed): out of the queue, and said; an
        // edit of a note stays in this browser as its draft
        if (item.kind === "save") {
          const draft = {content: item.content, etag: item.base, at: Date.now()};
          setItem("local", draftKey(item.path), JSON.stringify(draft));
        }
        toast("Could not send a change kept on this device: " + e.message, true);
        answer = null;
      }
      if (item.kind === "create" && answer && state.path === item.local) {
        state.path = answer.path;
        state.etag = answer.etag;
        $("path").textContent = answer.path;
      }
      if (item.kind === "create" && answer) await mirrorDrop(item.local);
      if (!offlineOn()) break; // the key stopped working meanwhile: what waits became drafts
      item = nextItem(await updateOutbox((items) => settle(items, item, answer || {})));
    }
  } finally {
    offline.sending = false;
    showWaiting();
  }
  if (!offline.items.length) loadTree().catch(() => {});
}

async function sendItem(item) {
  const once = {"Idempotency-Key": item.key};
  if (item.kind === "create") {
    const body = {content: item.content};
    if (item.folder) body.folder = item.folder;
    const {data} = await api("POST", "/notes", body, once);
    await mirrorPut(data);
    return data;
  }
  if (item.kind === "capture") {
    const files = [];
    let text = item.text;
    for (const [i, file] of (item.files || []).entries()) {
      const name = (file.name || "image").replace(/[[\]]/g, "");
      try {
        files.push([name, (await upload(file, item.key + ":file" + i)).path]);
      } catch (e) {
        if (e.status !== 413 && e.status !== 400) throw e;
        // too large (or not allowed): the text still goes; the page says why the file did not
        const limit = /over (\d+) bytes/.exec(e.message || "");
        const why = limit ? "this server takes files up to " + sizeText(+limit[1]) : e.message;
        toast(
          "“" +
            name +
            "” (" +
            sizeText(file.size) +
            ") was not added: " +
            why +
            ". " +
            (text ? "The text is in today's note." : ""),
          true,
        );
      }
    }
    if (!text && !files.length) return {};
    // the images' links are relative to today's note, wherever the daily plugin keeps it
    const line = (notePath) =>
      [text, ...files.map(([name, path]) => "![" + name + "](" + relativeTo(notePath, path) + ")")]
        .filter(Boolean)
        .join(" ");
    await appendToToday(line, item.key, item.at);
    return {};
  }
  try {
    const {data} = await api(
      "POST",
      "/notes/" + enc(item.path) + "/merge",
      {base: item.base, content: item.content, clientName: deviceName()},
      once,
    );
    await mirrorPut(data.note);
    const typed = toEditor(item.content);
    if (state.path === item.path && editor().value === typed) saved(data.note, typed);
    return data.note;
  } catch (e) {
    if (e.status === 409 && e.error && e.error.conflictPath) {
      toast(
        "“" +
          nameOf(item.path) +
          "” changed meanwhile: your edit is kept as " +
          nameOf(e.error.conflictPath),
      );
      return {};
    }
    if (e.status !== 404) throw e;
    const {data} = await api("POST", "/notes", {content: item.content}, once); // deleted: kept anew
    toast("“" + nameOf(item.path) + "” was deleted meanwhile: your text is kept as " + data.path);
    return data;
  }
}

// The change feed keeps the copy current.
async function mirrorChange(c) {
  if (c.kind === "deleted" || c.kind === "moved") await mirrorDrop(c.from || c.path);
  if (c.kind === "deleted") return;
  try {
    const {data} = await api("GET", "/notes/" + enc(c.path));
    await mirrorPut(data);
  } catch (e) {
    if (e.status === 404) await mirrorDrop(c.path);
  }
}

// The first copy: every note the key sees, a few at a time.
async function copyAll() {
  const paths = [];
  for (let offset = 0; ; offset += 1000) {
    const {data} = await api("GET", "/notes?limit=1000&offset=" + offset);
    paths.push(...data.notes.map((n) => n.path));
    if (offset + 1000 >= data.total) break;
  }
  let done = 0;
  const total = paths.length;
  const box = $("offline-state");
  box.hidden = false;
  box.title = "Copying your notes to this device";
  // kept 50 at a time, one transaction each (a transaction per note costs the page more
  // than the requests do)
  let batch = [];
  const flush = async () => {
    const notes = batch;
    batch = [];
    const kept = notes.map((n) => ({
      path: n.path,
      title: n.title,
      etag: n.etag,
      modified: n.modified,
      content: n.content,
    }));
    await stored("notes", "readwrite", (s) => kept.forEach((n) => s.put(n)));
  };
  const worker = async () => {
    while (paths.length) {
      const path = paths.pop();
      const {data} = await api("GET", "/notes/" + enc(path));
      batch.push(data);
      if (batch.length >= 50) await flush();
      done++;
      if (done % 25 === 0) box.textContent = "Copying " + done + "/" + total;
    }
  };
  await Promise.all(Array.from({length: 6}, worker));
  await flush();
  box.textContent = done + " notes kept";
  box.title = done + " notes kept on this device";
  box.className = "ready";
  performance.mark("notesvc:offline-copied");
  setTimeout(showWaiting, 5000);
}

async function enableOffline() {
  if (!offlinePossible()) {
    await dialog(
      "Keep notes on this device",
      [
        el(
          "p",
          {},
          SHARED_ORIGIN
            ? "This relay gives all its servers one address, where nothing can be kept."
            : "This needs a secure connection: open the notes by HTTPS (a relay's own " +
                "address for this server, or a proxy with a certificate), or on this " +
                "computer as http://localhost.",
        ),
      ],
      [["cancel", "Close"]],
    );
    return;
  }
  await idb(); // a browser that refuses IndexedDB says so here, before anything is kept
  await wipeOffline(); // whatever another key left on this device is not this key's
  await navigator.serviceWorker.register("sw.js");
  if (navigator.storage && navigator.storage.persist) navigator.storage.persist().catch(() => {});
  setItem("local", "notesvc.offline", state.base);
  if (getItem("local", "notesvc.key") === null) {
    // the app opens without the server (and from the share sheet): this device keeps the
    // key, as "Remember" would, until the option is turned off
    setItem("local", "notesvc.key", state.key);
    setItem("local", "notesvc.keyFor", state.base);
    setItem("local", "notesvc.offlineKey", "1");
  }
  offlineMenu();
  await copyAll();
  toast("Your notes are kept on this device: they open without a connection");
}

async function disableOffline() {
  await sendOutbox().catch(() => {}); // what waits goes first, if it can
  if (!(await letWaitingGo("Stop keeping notes on this device"))) return;
  removeItem("local", "notesvc.offline");
  if (getItem("local", "notesvc.offlineKey") === "1") {
    for (const name of ["notesvc.key", "notesvc.keyFor", "notesvc.offlineKey"]) {
      removeItem("local", name); // kept for this option only: this tab keeps it
    }
  }
  await wipeOffline();
  offlineMenu();
  toast("The copy on this device is deleted");
}

// Changes not sent yet, before the copy is deleted: resolve to true when the person lets
// them go (or there are none).
async function letWaitingGo(title) {
  if (!offlineOn()) return true;
  await loadOutbox().catch(() => {});
  if (!offline.items.length) return true;
  const choice = await choose(
    title,
    waiting(offline.items) +
      ": the server could not be reached. They are lost if the copy on this device is deleted now.",
    [
      ["cancel", "Keep them", "primary"],
      ["delete", "Delete them"],
    ],
  );
  return choice === "delete";
}

// The key this device kept was refused (revoked, rotated): the copy goes with it; what was
// written here and not sent yet stays in this browser as drafts (a note's edit reopens
// with it; new notes and shared text as one new note's draft), for the next key to send.
async function forgetOffline() {
  if (!offlineOn() && getItem("local", "notesvc.wipe") !== state.base) return;
  setItem("local", "notesvc.wipe", state.base); // finished at the next start if cut short
  removeItem("local", "notesvc.offline");
  removeItem("local", "notesvc.offlineKey");
  const items = await stored("meta", "readonly", (s) => s.get("outbox")); // (unread: kept)
  const loose = [];
  for (const item of items || []) {
    if (item.kind === "save") {
      const draft = {content: item.content, etag: item.base, at: Date.now()};
      setItem("local", draftKey(item.path), JSON.stringify(draft));
    } else if (item.kind === "create") {
      loose.push(item.content);
    } else if (item.text && !item.ask) {
      loose.push(item.text);
    }
  }
  if (loose.length) {
    const old = readDraft(NEW_NOTE);
    if (old) loose.unshift(old.content);
    const draft = {content: loose.join("\n\n"), at: Date.now()};
    setItem("local", draftKey(NEW_NOTE), JSON.stringify(draft));
  }
  await wipeOffline();
  removeItem("local", "notesvc.wipe");
}

// Everything this option kept: the copy, the outbox, the worker and the app's cache.
async function wipeOffline() {
  offline.items = [];
  if (offline.db) offline.db.close();
  offline.db = null;
  if ("indexedDB" in window) indexedDB.deleteDatabase("notesvc");
  if ("serviceWorker" in navigator) {
    for (const r of await navigator.serviceWorker.getRegistrations()) await r.unregister();
  }
  if ("caches" in window) for (const name of await caches.keys()) await caches.delete(name);
  showWaiting();
}

// What the share sheet brought waits for a yes here: any web page can post to the share
// address, so nothing reaches today's note until the person has seen it.
async function askShared() {
  await loadOutbox();
  for (const item of offline.items.filter((i) => i.ask)) {
    const files = (item.files || []).map((f) => f.name || "image");
    const body = [el("p", {}, "Add this to today's note?")];
    if (item.text) body.push(el("blockquote", {class: "shared-text"}, item.text.slice(0, 500)));
    if (files.length) body.push(el("p", {}, "With " + files.join(", ")));
    if (item.dropped) {
      body.push(el("p", {class: "muted"}, item.dropped + " more file(s) were too large to keep."));
    }
    const yes =
      (await dialog("Shared to notesvc", body, [
        ["add", "Add to today's note", "primary"],
        ["drop", "Discard"],
      ])) === "add";
    await updateOutbox((items) =>
      yes
        ? items.map((i) => (i.id === item.id ? {...i, ask: false} : i))
        : items.filter((i) => i.id !== item.id),
    );
  }
  sendOutbox().catch(() => {});
}

function offlineMenu() {
  $("menu-offline").hidden = false;
  $("menu-offline").textContent = offlineOn()
    ? "Stop keeping notes on this device"
    : "Keep notes on this device";
}

function wireOffline() {
  $("menu-offline").addEventListener(
    "click",
    act(() => (offlineOn() ? disableOffline() : enableOffline())),
  );
  window.addEventListener("online", () => act(sendOutbox)());
  window.addEventListener("offline", showWaiting);
  if ("BroadcastChannel" in window) {
    offline.tabs = new BroadcastChannel("notesvc-outbox");
    offline.tabs.onmessage = () => loadOutbox().catch(() => {});
  }
}
wireOffline();
"""[1:]
# --- end web/offline.js ---
# --- begin web/sw.js ---
SW_JS = r"""
"use strict";
// notesvc's service worker (served at ./sw.js beside the page; only where the person turned
// "Keep notes on this device" on, in a secure context). It keeps the app itself for offline
// starts, and takes what the share sheet sends: the notes and the outbox live in IndexedDB,
// where the page reads and writes them; this worker only adds shared items to the outbox.

const APP = "notesvc-app";
const SHELL = ["./", "manifest.webmanifest", "icon.svg", "icon-192.png", "icon-512.png"];

self.addEventListener("install", (event) => {
  event.waitUntil(caches.open(APP).then((cache) => cache.addAll(SHELL)));
  self.skipWaiting();
});

self.addEventListener("activate", (event) => event.waitUntil(self.clients.claim()));

self.addEventListener("fetch", (event) => {
  const url = new URL(event.request.url);
  if (url.origin !== self.location.origin) return;
  const here = new URL("./", self.registration.scope).pathname;
  if (event.request.method === "POST" && url.pathname === here + "share-target") {
    event.respondWith(shared(event.request));
    return;
  }
  const shell = SHELL.map((p) => new URL(p, self.registration.scope).pathname);
  if (event.request.method !== "GET" || !shell.includes(url.pathname)) return; // the API
  // the app: the network's when it answers (kept for next time), else the kept copy (also
  // when a relay answers for a server it cannot reach: 502, 503, 504)
  const kept = (answer) =>
    caches.match(event.request, {ignoreSearch: true}).then((k) => k || answer || Response.error());
  event.respondWith(
    fetch(event.request)
      .then((answer) => {
        if (answer.ok) {
          const copy = answer.clone();
          caches.open(APP).then((cache) => cache.put(event.request, copy));
          return answer;
        }
        return answer.status >= 502 && answer.status <= 504 ? kept(answer) : answer;
      })
      .catch(() => kept(null)),
  );
});

// What one share may keep on this device: the server's own limit refuses larger files later.
const MAX_FILES = 10;
const MAX_BYTES = 100 * 1024 * 1024;

// The share sheet's POST: text, a link and images, kept in the outbox for the page to send
// to today's note once the person has said yes there (any web page can post a form to this
// address: nothing it sends goes anywhere unseen).
async function shared(request) {
  const form = await request.formData();
  const text = ["title", "text", "url"]
    .map((name) => String(form.get(name) || "").trim())
    .filter((value, i, all) => value && all.indexOf(value) === i)
    .join(" ");
  let room = MAX_BYTES;
  const given = form.getAll("image").filter((f) => f && f.size);
  const files = given
    .filter((f) => f.size <= room && (room -= f.size) >= 0) // (one too large: the rest may go)
    .slice(0, MAX_FILES);
  const dropped = given.length - files.length;
  const db = await openBox();
  await new Promise((resolve, reject) => {
    const tx = db.transaction("meta", "readwrite");
    const store = tx.objectStore("meta");
    const read = store.get("outbox");
    read.onsuccess = () => {
      const items = read.result || [];
      const id = () => (self.crypto.randomUUID ? self.crypto.randomUUID() : String(Math.random()));
      items.push({
        id: id(),
        kind: "capture",
        key: id(),
        text,
        files,
        dropped,
        at: Date.now(),
        ask: true,
      });
      store.put(items, "outbox");
    };
    tx.oncomplete = resolve;
    tx.onerror = () => reject(tx.error);
  });
  db.close();
  return Response.redirect(new URL("./?shared=1", self.registration.scope).href, 303);
}

function openBox() {
  return new Promise((resolve, reject) => {
    const open = indexedDB.open("notesvc", 1);
    open.onupgradeneeded = () => {
      open.result.createObjectStore("notes", {keyPath: "path"});
      open.result.createObjectStore("meta");
    };
    open.onsuccess = () => resolve(open.result);
    open.onerror = () => reject(open.error);
  });
}
"""[1:]
# --- end web/sw.js ---
# --- begin web/devices.js ---
WEB_DEVICES_JS = r"""
// -- devices: a phone joins by scanning a code; a new server is set up from its page ------
// A pairing is a one-time secret in a link's fragment (#pair=…), never in a URL a server
// or a log keeps. Claiming it gives this browser a device key of its own, kept (with the
// API base it was given for) on this device only.

function pairingInUrl() {
  const m = /^#pair=([A-Za-z2-7-]{26,40})$/.exec(location.hash);
  return m ? m[1] : "";
}

function deviceGuess() {
  const ua = navigator.userAgent || "";
  if (/iPhone/.test(ua)) return "iPhone";
  if (/iPad/.test(ua)) return "iPad";
  if (/Android/.test(ua)) return /Mobile/.test(ua) ? "Android phone" : "Android tablet";
  if (/Macintosh/.test(ua)) return "Mac";
  if (/Windows/.test(ua)) return "Windows computer";
  return "Computer";
}

// Keep a device key for base: on this device, in the origin's own storage (never on a
// relay's shared origin, where storage is off).
function keepDevice(base, claimed) {
  for (const kind of ["session", "local"]) {
    removeItem(kind, "notesvc.key");
    removeItem(kind, "notesvc.keyFor");
  }
  setItem("local", "notesvc.key", claimed.key);
  setItem("local", "notesvc.keyFor", base);
  const d = claimed.device || {};
  setItem("local", "notesvc.device", JSON.stringify({id: d.id, name: d.name, scope: d.scope}));
}

async function claim(secret, name) {
  const base = new URL("api/v1", location.href).pathname;
  let r;
  try {
    r = await fetch(base + "/auth/devices/claim", {
      method: "POST",
      mode: "same-origin",
      credentials: "omit",
      cache: "no-store",
      headers: {"Content-Type": "application/json"},
      body: JSON.stringify({secret, deviceName: name}),
    });
  } catch (e) {
    throw new Error("Cannot reach the server. Check the connection and try again.");
  }
  const j = await r.json().catch(() => ({}));
  if (r.status === 404) {
    throw new Error(
      "This code was used already or has expired: ask for a new one (another device " +
        "shows it under Keys and devices → Add a device).",
    );
  }
  if (!r.ok || !j.data) {
    throw new Error(j.error ? j.error.message : "The server answered " + r.status + ".");
  }
  return {base, claimed: j.data};
}

async function joinWithPairing() {
  const msg = $("pair-msg");
  msg.textContent = "";
  $("pair-join").disabled = true;
  try {
    const secret = $("pair-box").dataset.secret;
    const {base, claimed} = await claim(secret, $("pair-name").value.trim()); // "": its given name
    keepDevice(base, claimed);
    $("pair-box").hidden = true;
    state.base = base;
    await connect(false);
  } catch (e) {
    msg.textContent = e.message || String(e);
  } finally {
    $("pair-join").disabled = false;
  }
}

// First run: the setup payload shows the key to this browser (on this machine or its own
// network): make an admin pairing with it, claim it as this browser's device, link.
async function setUpServer() {
  const msg = $("setup-msg");
  msg.textContent = "";
  $("setup").disabled = true;
  try {
    const base = new URL("api/v1", location.href).pathname;
    const setup = await (await fetch(base + "/system/setup", {cache: "no-store"})).json();
    const key = setup.data && setup.data.apiKey;
    if (!setup.data || !setup.data.browserSetup || !/^nsk_[A-Za-z0-9_-]{43}$/.test(key || "")) {
      throw new Error("This server is set up already: connect with its key, or scan a code.");
    }
    const name = $("setup-name").value.trim() || deviceGuess();
    state.base = base;
    state.key = key; // the API key, for these two calls only
    state.keyBase = base;
    const pairing = await api("POST", "/auth/devices/pairings", {name, scope: "admin"});
    const {claimed} = await claim(pairing.data.secret, name);
    keepDevice(base, claimed);
    state.key = claimed.key;
    await api("POST", "/auth/link", {clientName: "web client on " + name});
    $("setup-box").hidden = true;
    await connect(false);
    await dialog(
      "Keep this key safe",
      [
        el(
          "p",
          {},
          "Your server is ready, and this browser is signed in as “" +
            name +
            "”. " +
            "Other devices join by scanning a code: Keys and devices → Add a device.",
        ),
        el(
          "p",
          {class: "warn"},
          "This is the server's API key. It is shown this once: keep it in a password " +
            "manager. Lost it? On the server, run: python3 notesvc.py rotate-key",
        ),
        shownOnce("API key", key, "setup-key"),
      ],
      [["done", "I have kept it", "primary"]],
    );
  } catch (e) {
    state.key = "";
    state.keyBase = "";
    msg.textContent = e.message || String(e);
  } finally {
    $("setup").disabled = false;
  }
}

async function offerSetup() {
  try {
    const base = new URL("api/v1", location.href).pathname;
    const r = await fetch(base + "/system/setup", {cache: "no-store", mode: "same-origin"});
    const j = await r.json();
    if (j.data && j.data.browserSetup) {
      $("setup-name").value = deviceGuess();
      $("setup-box").hidden = false;
      $("setup").focus();
    }
  } catch (e) {
    /* not a notes server's own page (a relay's): the key screen as it is */
  }
}

// The picture of a pairing or a bot link: the server's QR code, else the link and a code to
// type (when the server has no QR encoder).
function pairingView(made, what) {
  const parts = [];
  if (made.qrSvg) {
    const img = el("img", {
      class: "qr",
      id: "pair-qr",
      alt: "QR code of the link to " + what,
      src: "data:image/svg+xml;charset=utf-8," + encodeURIComponent(made.qrSvg),
    });
    parts.push(img);
  }
  parts.push(shownOnce("Link", made.url, "pair-url"));
  if (made.secret) {
    parts.push(
      el(
        "p",
        {class: "muted"},
        "Or open this server's page on the device and type the code: ",
        el("code", {id: "pair-code"}, groupCode(made.secret)),
      ),
    );
  }
  return parts;
}

// "Add a device" (any scope; admin is everything) and "Give someone a folder".
async function addDevice(folderOnly) {
  const name = el("input", {
    type: "text",
    id: "device-name",
    placeholder: folderOnly ? "Anna's phone" : "my tablet",
  });
  const scope = el(
    "select",
    {id: "device-scope"},
    ...(folderOnly ? [] : [el("option", {value: "admin"}, "everything, like this device")]),
    el("option", {value: "write"}, "read and write"),
    el("option", {value: "read"}, "read only"),
  );
  const folder = el("input", {type: "text", id: "device-folder", placeholder: "notes/family"});
  const fields = [
    el("label", {for: "device-name"}, "Name"),
    name,
    el("label", {for: "device-scope"}, "It may"),
    scope,
  ];
  if (folderOnly) fields.push(el("label", {for: "device-folder"}, "Only this folder"), folder);
  for (;;) {
    const go = await dialog(folderOnly ? "Give someone a folder" : "Add a device", fields, [
      ["cancel", "Cancel"],
      ["make", "Show the code", "primary"],
    ]);
    if (go !== "make") return showKeys();
    const body = {
      name: name.value.trim() || (folderOnly ? "folder" : "device"),
      scope: scope.value,
    };
    try {
      if (folderOnly) {
        const f = folder.value.trim().replace(/\/+$/, "").replace(/^\/+/, "");
        if (!f) throw new Error("Name the folder to give, e.g. notes/family.");
        body.folder = f.startsWith("notes") ? f : "notes/" + f;
      }
      const {data} = await api("POST", "/auth/devices/pairings", body);
      return showPairing(data);
    } catch (e) {
      if (e instanceof Problem && (e.status === 401 || e.status === 429)) throw e;
      dialogProblem(fields, e); // in the dialog, which opens again with what was typed
    }
  }
}

async function showPairing(made) {
  const until = new Date(made.expiresAt);
  const status = el(
    "p",
    {id: "pair-status", role: "status"},
    "Scan it with the other device's camera. It works once, until " +
      until.toLocaleTimeString([], {hour: "2-digit", minute: "2-digit"}) +
      ".",
  );
  const shown = dialog(
    "Scan to join",
    [...pairingView(made, "join this server"), status],
    [["cancel", "Done"]],
  );
  let watching = true;
  shown.then(() => (watching = false));
  while (watching && Date.now() < until.getTime()) {
    await sleep(2000);
    if (!watching) break;
    const {data} = await api("GET", "/auth/keys");
    const joined = data.keys.find((g) => g.kind === "device" && g.createdAt >= made.createdAt);
    if (joined) {
      status.textContent = "“" + joined.name + "” joined.";
      status.className = "ok";
      break;
    }
  }
  await shown;
  return showKeys();
}

// -- Telegram: paste the bot's token, send it a code, connected ---------------------------

async function telegramChannels() {
  const {data} = await api("GET", "/channels");
  return data.channels.filter((c) => c.provider === "telegram");
}

async function showTelegram() {
  const [channel] = await telegramChannels();
  if (!channel) return connectTelegram();
  const bound = channel.boundChat;
  const lines = [
    el(
      "p",
      {},
      el("strong", {}, channel.name),
      channel.enabled ? "" : " (switched off)",
      bound ? " saves what “" + (bound.name || bound.id) + "” sends it." : " waits for a chat.",
    ),
  ];
  if (channel.status && channel.status.ok === false) {
    lines.push(el("p", {class: "err"}, "Telegram: " + channel.status.error));
  }
  const choice = await dialog("Telegram", lines, [
    ["close", "Close"],
    ["bind", "Connect another chat"],
    ["toggle", channel.enabled ? "Switch off" : "Switch on"],
    ["remove", "Remove", "danger"],
  ]);
  if (choice === "bind") {
    const {data} = await api("POST", "/channels/" + enc(channel.id) + "/bind");
    return waitForChat(channel.id, data);
  }
  if (choice === "toggle") {
    await api("POST", "/channels/" + enc(channel.id) + "/toggle");
    return showTelegram();
  }
  if (choice === "remove") {
    const sure = await choose(
      "Remove " + channel.name + "?",
      "The bot stops saving to your notes.",
      [
        ["cancel", "Cancel"],
        ["remove", "Remove", "danger"],
      ],
    );
    if (sure === "remove") {
      await api("DELETE", "/channels/" + enc(channel.id));
      toast("Telegram removed");
    }
  }
  return undefined;
}

async function connectTelegram() {
  const token = el("input", {
    type: "text",
    id: "tg-token",
    autocomplete: "off",
    spellcheck: "false",
    placeholder: "123456789:AA…",
  });
  const body = [
    el(
      "ol",
      {},
      el("li", {}, "In Telegram, open @BotFather and send /newbot; give it a name."),
      el("li", {}, "BotFather answers with a token: paste it here."),
    ),
    el("label", {for: "tg-token"}, "Bot token"),
    token,
  ];
  for (;;) {
    const go = await dialog("Connect Telegram", body, [
      ["cancel", "Cancel"],
      ["connect", "Connect", "primary"],
    ]);
    if (go !== "connect") return undefined;
    let made;
    try {
      made = await api("POST", "/channels/connect/telegram", {botToken: token.value.trim()});
    } catch (e) {
      if (e instanceof Problem && (e.status === 401 || e.status === 429)) throw e;
      dialogProblem(body, e); // shown in the dialog, which opens again with the token kept
      continue;
    }
    return waitForChat(made.data.channel.id, made.data);
  }
}

// An error of a dialog's own action, shown inside that dialog the next time it opens.
function dialogProblem(body, e) {
  let p = body.find((b) => b.id === "dlg-error");
  if (!p) {
    p = el("p", {id: "dlg-error", class: "err", role: "alert"});
    body.push(p);
  }
  p.textContent = e && e.message ? e.message : String(e);
}

async function waitForChat(id, made) {
  const until = new Date(made.bindUntil);
  const status = el(
    "p",
    {id: "tg-status", role: "status"},
    "Waiting for the first message… (the code works until " +
      until.toLocaleTimeString([], {hour: "2-digit", minute: "2-digit"}) +
      ")",
  );
  const bot = made.link
    ? el("a", {href: made.link, target: "_blank", rel: "noopener"}, "@" + made.bot)
    : "your bot";
  const parts = [el("p", {}, "Open ", bot, " in Telegram and press Start.")];
  if (made.qrSvg) {
    parts.push(
      el("img", {
        class: "qr",
        id: "tg-qr",
        alt: "QR code of the link to the bot",
        src: "data:image/svg+xml;charset=utf-8," + encodeURIComponent(made.qrSvg),
      }),
      el("p", {class: "muted"}, "On a computer? Scan this with your phone's camera."),
    );
  }
  const code = el("code", {id: "tg-code"}, made.bindCode);
  parts.push(el("p", {}, "Or send the bot this code: ", code));
  parts.push(status);
  const shown = dialog("Connect Telegram", parts, [["cancel", "Done"]]);
  let watching = true;
  shown.then(() => (watching = false));
  while (watching && Date.now() < until.getTime()) {
    await sleep(1500);
    if (!watching) break;
    const {data} = await api("GET", "/channels/" + enc(id));
    if (data.boundChat) {
      status.textContent = "Connected to " + (data.boundChat.name || data.boundChat.id) + ".";
      status.className = "ok";
      break;
    }
  }
  return shown;
}

// A code typed from another device's screen (where no camera can scan it).
async function joinWithCode() {
  const msg = $("join-msg");
  msg.textContent = "";
  const code = $("join-code")
    .value.replace(/[^A-Za-z2-7]/g, "")
    .toLowerCase();
  if (code.length !== 26) {
    msg.textContent = "A code is 26 letters and digits (groups of four): check it and try again.";
    return;
  }
  $("join").disabled = true;
  try {
    const {base, claimed} = await claim(code, "");
    keepDevice(base, claimed);
    state.base = base;
    await connect(false);
  } catch (e) {
    msg.textContent = e.message || String(e);
  } finally {
    $("join").disabled = false;
  }
}

function wireDevices() {
  $("setup").addEventListener("click", setUpServer);
  $("pair-join").addEventListener("click", joinWithPairing);
  $("join").addEventListener("click", joinWithCode);
  $("join-code").addEventListener("keydown", (e) => {
    if (e.key === "Enter") joinWithCode();
  });
}
wireDevices();
"""[1:]
# --- end web/devices.js ---

# One script, in this order: core.js ("use strict", the page's state, storage and API),
# the pure modules (paths.js, keys.js, merge.js, outbox.js, markdown.js; node --test web/),
# app.js, grants.js, devices.js, offline.js.
WEB_JS = "".join(
    (
        WEB_JS_START,
        PATHS_JS,
        KEYS_JS,
        MERGE_JS,
        OUTBOX_JS,
        MARKDOWN_JS,
        WEB_JS_REST,
        WEB_GRANTS_JS,
        WEB_DEVICES_JS,
        WEB_OFFLINE_JS,
    )
)

# --- begin web/app.html ---
WEB_PAGE = r"""

<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1, viewport-fit=cover,
  interactive-widget=resizes-content">
<meta name="theme-color" content="#f6f8fa" media="(prefers-color-scheme: light)">
<meta name="theme-color" content="#161b22" media="(prefers-color-scheme: dark)">
<meta name="color-scheme" content="light dark">
<meta name="apple-mobile-web-app-capable" content="yes">
<meta name="apple-mobile-web-app-title" content="notesvc">
<meta name="referrer" content="no-referrer">
<title>notesvc</title>
<link rel="manifest" href="manifest.webmanifest">
<link rel="icon" href="icon.svg" type="image/svg+xml">
<link rel="apple-touch-icon" href="apple-touch-icon.png">
<style>{css}</style>
</head>
<body>
<svg hidden aria-hidden="true">
  <symbol id="i-logo" viewBox="0 0 48 48">
    <rect width="48" height="48" rx="11" fill="#0a58ca"/>
    <path d="M14 9h15l7 7v23H14z" fill="#fff"/><path d="M29 9v7h7" fill="#c9dcf7"/>
    <path d="M18 22h14M18 28h14M18 34h9" stroke="#0a58ca" stroke-width="3" stroke-linecap="round"/>
  </symbol>
  <symbol id="i-notes" viewBox="0 0 24 24"><path d="M3 6h18M3 12h18M3 18h12"/></symbol>
  <symbol id="i-note" viewBox="0 0 24 24"><path d="M6 3h9l4 4v14H6zM9 12h7M9 16h7"/></symbol>
  <symbol id="i-search" viewBox="0 0 24 24">
    <circle cx="11" cy="11" r="6"/><path d="M20 20l-4.5-4.5"/></symbol>
  <symbol id="i-ask" viewBox="0 0 24 24"><path d="M4 5h16v11H9l-5 4z"/></symbol>
  <symbol id="i-more" viewBox="0 0 24 24">
    <circle cx="5" cy="12" r="1"/><circle cx="12" cy="12" r="1"/><circle cx="19" cy="12" r="1"/>
  </symbol>
  <symbol id="i-back" viewBox="0 0 24 24"><path d="M15 5l-7 7 7 7"/></symbol>
</svg>

<div id="login">
  <h1><svg aria-hidden="true"><use href="#i-logo"/></svg>notesvc</h1>
  <div id="setup-box" hidden>
    <p>This notes server is new. Set it up from this browser: it becomes this browser's
      own, and you get its key to keep safe.</p>
    <label for="setup-name">This device's name</label>
    <input id="setup-name" type="text" autocomplete="off" maxlength="100">
    <button id="setup" class="primary" type="button">Set up this server</button>
    <p id="setup-msg" class="err" role="alert"></p>
    <p class="hint">Or connect with the key below.</p>
  </div>
  <div id="pair-box" hidden>
    <p>You were invited to a notes server. Join it from this device: no key to type.</p>
    <label for="pair-name">This device's name (optional)</label>
    <input id="pair-name" type="text" autocomplete="off" maxlength="100">
    <button id="pair-join" class="primary" type="button">Join</button>
    <p id="pair-msg" class="err" role="alert"></p>
  </div>
  <p id="key-intro">Your notes, on your own server. Scan the code another of your devices
    shows (<em>Keys and devices → Add a device</em>), or paste the API key.</p>
  <label for="key">API key</label>
  <input id="key" type="password" autocomplete="off" spellcheck="false" placeholder="nsk_…">
  <label class="check"><input id="remember" type="checkbox"> Remember on this device</label>
  <p id="remember-warn" hidden>Anyone who can use this browser will be able to read and change
    your notes. Leave it off on a shared device.</p>
  <button id="connect" class="primary" type="button">Connect</button>
  <p id="login-msg" class="err" role="alert"></p>
  <p id="shared-origin" class="hint" hidden>This relay gives all its servers one address, so
    this page keeps nothing on this device: the key is asked for each time, and offline use
    and pairing are off. The relay's operator can give each server its own address
    (SERVICE_RELAY_DOMAIN).</p>
  <details id="code-box">
    <summary>Have a code from another device?</summary>
    <label for="join-code">Code (from Keys and devices → Add a device)</label>
    <input id="join-code" type="text" autocomplete="off" spellcheck="false"
      autocapitalize="none" placeholder="abcd-efgh-…">
    <button id="join" type="button">Join</button>
    <p id="join-msg" class="err" role="alert"></p>
  </details>
  <details id="relay-box">
    <summary>Connecting through a relay?</summary>
    <label for="relay-code">Relay code (from the server's connect link)</label>
    <input id="relay-code" type="text" autocomplete="off" spellcheck="false">
  </details>
</div>

<div id="app" hidden data-pane="notes">
  <header class="bar">
    <span class="brand"><svg aria-hidden="true"><use href="#i-logo"/></svg><span>notesvc</span>
    </span>
    <label class="sr" for="search">Search notes</label>
    <input id="search" type="search" placeholder="Search  ( / )" autocomplete="off"
      enterkeyhint="search" aria-controls="results">
    <span id="offline-state" role="status" hidden></span>
    <button id="toggle-ask" type="button" class="plain" aria-expanded="true"
      aria-controls="pane-ask">Ask</button>
    <details class="menu" id="menu">
      <summary aria-label="Menu"><svg class="icon" aria-hidden="true"><use href="#i-more"/></svg>
      </summary>
      <div class="menu-list">
        <button id="menu-new" type="button">New note</button>
        <button id="menu-refresh" type="button">Refresh</button>
        <button id="menu-trash" type="button" hidden>Trash</button>
        <button id="menu-offline" type="button" hidden>Keep notes on this device</button>
        <button id="menu-keys" type="button" hidden>Keys and devices</button>
        <button id="menu-telegram" type="button" hidden>Telegram</button>
        <button id="logout" type="button">Log out</button>
      </div>
    </details>
  </header>

  <main id="main">
    <nav id="pane-notes" class="pane" aria-label="Notes">
      <div class="capture">
        <label class="sr" for="capture">Quick capture to today's note</label>
        <input id="capture" type="text" placeholder="Capture to today's note…" enterkeyhint="send">
        <button id="capture-add" type="button">Add</button>
      </div>
      <div class="pane-tools"><button id="new" type="button">New note</button></div>
      <h2 class="list-head">Recent</h2>
      <ul id="recent" class="recent"></ul>
      <details id="folders" open>
        <summary class="list-head">Folders</summary>
        <div id="tree"></div>
      </details>
    </nav>

    <section id="pane-search" class="pane" aria-label="Search results">
      <div id="results-head"><span id="results-info" role="status"></span>
        <button id="results-close" type="button" class="plain">Back to notes</button></div>
      <p id="search-hint" class="hint">Type in the search box above: words, "a phrase", pre*,
        -without, this OR that. Press / to search from anywhere, Esc to go back.</p>
      <ul id="results"></ul>
    </section>

    <section id="pane-note" class="pane" aria-label="Note">
      <div id="empty">
        <p>No note is open. Pick one from your notes, or start a new one.</p>
        <button id="empty-new" type="button" class="primary">New note</button>
      </div>
      <div id="note-bar" class="note-bar" hidden>
        <button id="back" type="button" class="plain" aria-label="Back to notes">
          <svg class="icon" aria-hidden="true"><use href="#i-back"/></svg></button>
        <div class="note-title"><strong id="title"></strong><small id="path"></small></div>
        <span id="status" role="status"></span>
        <button id="edit" type="button">Edit</button>
        <button id="save" type="button" class="primary">Save</button>
        <details class="menu" id="note-menu">
          <summary aria-label="Note actions">
            <svg class="icon" aria-hidden="true"><use href="#i-more"/></svg></summary>
          <div class="menu-list">
            <button id="attach" type="button" hidden>Attach a file…</button>
            <button id="photo" type="button" hidden>Take a photo…</button>
            <button id="share" type="button" hidden>Share…</button>
            <button id="move" type="button">Move or rename…</button>
            <button id="history" type="button" hidden>History…</button>
            <button id="delete" type="button" class="danger">Move to trash</button>
          </div>
        </details>
      </div>
      <div id="conflict" class="banner" role="alert" hidden>
        <span id="conflict-text">This note changed elsewhere.</span>
        <button id="reload" type="button">Reload theirs</button>
        <button id="overwrite" type="button">Keep mine</button>
        <button id="open-copy" type="button" hidden>Open yours</button>
        <button id="conflict-ok" type="button" hidden>OK</button></div>
      <div id="draft" class="banner" role="status" hidden><span id="draft-text"></span>
        <button id="draft-discard" type="button">Discard draft</button></div>
      <article id="view" class="md" hidden></article>
      <label class="sr" for="editor">Note text (Markdown)</label>
      <textarea id="editor" spellcheck="true" hidden></textarea>
      <div id="backlinks" hidden></div>
      <input id="attach-file" type="file" multiple hidden aria-label="Attach a file">
      <input id="attach-photo" type="file" accept="image/*" capture="environment" hidden
        aria-label="Take a photo">
    </section>

    <aside id="pane-ask" class="pane" aria-label="Ask your notes">
      <h2>Ask your notes</h2>
      <div id="chat-log" aria-live="polite">
        <p class="hint">Ask a question: the answer comes from all your notes, with its sources.
          Tick “About this note” to ask about the open note only.</p></div>
      <div class="ask-form">
        <label class="check"><input id="about" type="checkbox" disabled>
          <span id="about-label">About this note</span></label>
        <div class="row">
          <label class="sr" for="chat-input">Question</label>
          <input id="chat-input" type="text" placeholder="Where are the spare keys?"
            enterkeyhint="send">
          <button id="chat-send" type="button" class="primary">Ask</button>
        </div>
      </div>
    </aside>
  </main>

  <nav class="tabs" aria-label="Sections">
    <button type="button" data-pane="notes">
      <svg class="icon" aria-hidden="true"><use href="#i-notes"/></svg>Notes</button>
    <button type="button" data-pane="note">
      <svg class="icon" aria-hidden="true"><use href="#i-note"/></svg>Note</button>
    <button type="button" data-pane="search">
      <svg class="icon" aria-hidden="true"><use href="#i-search"/></svg>Search</button>
    <button type="button" data-pane="ask">
      <svg class="icon" aria-hidden="true"><use href="#i-ask"/></svg>Ask</button>
  </nav>
</div>

<dialog id="dlg" aria-labelledby="dlg-title">
  <h2 id="dlg-title"></h2>
  <div id="dlg-body"></div>
  <div class="buttons" id="dlg-buttons"></div>
</dialog>

<div id="toast" role="status" aria-live="polite" hidden></div>
<script>{js}</script>
</body>
</html>
"""[1:]
# --- end web/app.html ---


def _csp_hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


WEB_CSP = (
    "default-src 'none'; "
    f"script-src {_csp_hash(WEB_JS)}; style-src {_csp_hash(WEB_CSS)}; "
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
            # takes the POST and keeps it for today's note (CONTRACT 24)
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
}


def web_asset_headers(path: str) -> dict:
    """Return the headers of a public asset: cacheable, typed, and inert if opened alone
    (the service worker: checked for a new version at every start, allowed to fetch)."""
    worker = path == "/sw.js"
    return {
        "Content-Type": WEB_ASSETS[path][0],
        "Cache-Control": "no-cache" if worker else "public, max-age=86400",
        "Content-Security-Policy": "default-src 'none'; connect-src 'self'"
        if worker
        else "default-src 'none'",
        "X-Content-Type-Options": "nosniff",
    }


def web_client_page() -> str:
    """Return the page: the same bytes on a server and on a relay."""
    return WEB_PAGE.replace("{css}", WEB_CSS).replace("{js}", WEB_JS)


def web_client_headers() -> dict:
    """Return the headers that lock the page down (its CSP allows only its own hashes)."""
    return {
        "Content-Security-Policy": WEB_CSP,
        "Referrer-Policy": "no-referrer",
        "X-Frame-Options": "DENY",
    }


# -- the consent and share pages (CONTRACT 21) ----------------------------------------------
#
# Small pages of their own, each with its CSP hashes. Both are static: a relay serves the
# same bytes (never HTML forwarded from a server), and their scripts find the API beside
# them on their own origin (/api/v1, or /r/<serverId>/api/v1 on a relay).

# --- begin web/page.css ---
PAGE_CSS = r"""

*{box-sizing:border-box}
body{margin:0;font:16px/1.5 system-ui,sans-serif;color:#1d232a;background:#f6f7f9}
main{max-width:42em;margin:0 auto;padding:1.2em}
h1{font-size:1.4em;line-height:1.25}label{display:block;margin:.8em 0 .2em}
input,button{font:inherit;padding:.6em .7em;border:1px solid #8a94a0;border-radius:6px}
input[type=password],input[type=text]{width:100%}button{min-height:2.9em;min-width:7em;cursor:pointer}
button.go{background:#1d4f91;color:#fff;border-color:#1d4f91}button:disabled{opacity:.6}
fieldset{border:1px solid #c8ced6;border-radius:6px;margin:1em 0}fieldset label{margin:.4em 0}
.row{display:flex;gap:.7em;flex-wrap:wrap;margin-top:1.2em}.hidden{display:none!important}
.err{color:#a40000}.who{font-weight:600;overflow-wrap:anywhere}.muted{color:#56606b}
article{background:#fff;border:1px solid #dde2e8;border-radius:8px;padding:.2em 1.2em 1em;
overflow-wrap:anywhere}article img{max-width:100%}pre{overflow:auto;background:#f0f2f5;padding:.7em}
code{font-family:ui-monospace,monospace;font-size:.92em}blockquote{margin:0;padding-left:1em;
border-left:3px solid #c8ced6;color:#444}table{border-collapse:collapse}td,th{border:1px solid
#c8ced6;padding:.3em .5em}
.md .table{overflow-x:auto}.md li.task{list-style:none}.md li.task input{margin-left:-1.3em}
.md pre.front{font-size:.85em;color:#56606b}.md .al-c{text-align:center}.md .al-r{text-align:right}
mark{background:#fff0a0}
@media (prefers-color-scheme:dark){body{background:#111418;color:#e4e8ec}
article{background:#1a1f25;border-color:#2c333b}pre{background:#232a31}.muted{color:#a6b0ba}
input{background:#1a1f25;color:#e4e8ec}.err{color:#ff8a80}}
"""[1:]
# --- end web/page.css ---

# --- begin web/share.js ---
SHARE_JS = r"""
// The link is {base}/s/<token>; the note comes from {base}/api/v1/shared/<token>. The
// web client's renderer (MARKDOWN_JS) draws it; what a link or an image may reach is
// decided here: pages on the web, and the attachments this note links, nothing else.
const found = location.pathname.match(/^(.*)\/s\/([A-Za-z0-9_-]{1,64})\/?$/);
const shared = found ? found[1] + "/api/v1/shared/" + found[2] : "";
let linked = {}; // the note's href as written -> the attachment it names (the server's)

function attachmentOf(src) {
  const path = Object.prototype.hasOwnProperty.call(linked, src) ? linked[src] : "";
  if (typeof path !== "string" || !/^attachments\//.test(path)) return "";
  return shared + "/attachments/" + path.split("/").map(encodeURIComponent).join("/");
}

function link(href, label, ctx, markdown) {
  href = href.trim();
  const a = /^(https?:|mailto:)/i.test(href)
    ? el("a", {href, target: "_blank", rel: "noopener noreferrer nofollow"})
    : el("span"); // another note of the owner's: not shared, so the text alone
  if (markdown) inline(label, a, ctx);
  else a.textContent = label;
  return a;
}

function wikiLink(target, label, ctx, embed) {
  return el("span", {}, (label || target).trim());
}

function image(alt, src, ctx) {
  const url = attachmentOf(src.trim());
  if (!url) return document.createTextNode(alt ? "[image: " + alt + "]" : "[image]");
  return el("img", {src: url, alt: alt || "", loading: "lazy", referrerpolicy: "no-referrer"});
}

async function showShared() {
  const say = (text) => {
    document.getElementById("msg").textContent = text;
  };
  if (!shared) return say("This link is not valid.");
  let r;
  let j = null;
  try {
    r = await fetch(shared, {mode: "same-origin", credentials: "omit"});
    j = await r.json();
  } catch (e) {
    return say("The notes server cannot be reached right now.");
  }
  if (r.status === 429) return say("Too many requests: try again in a minute.");
  if (!r.ok || !j || !j.success) {
    return say("Nothing is shared at this link: it may have expired or been revoked.");
  }
  document.title = j.data.title;
  linked = j.data.attachments || {};
  document.getElementById("note").replaceChildren(renderMarkdown(j.data.content, {}));
  document.getElementById("meta").textContent =
    "Shared read-only · last changed " + new Date(j.data.modified).toLocaleString();
  return undefined;
}
showShared();
"""[1:]
# --- end web/share.js ---

# --- begin web/share.html ---
SHARE_PAGE = r"""
<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="robots" content="noindex, nofollow"><meta name="referrer" content="no-referrer">
<title>Shared note</title><link rel="icon" href="data:,"><style>{css}</style></head><body>
<main><p id="msg" class="err" role="alert"></p><article id="note"></article>
<p id="meta" class="muted"></p></main><script>{js}</script></body></html>
"""[1:]
# --- end web/share.html ---

# --- begin web/consent.js ---
CONSENT_JS = r"""
"use strict";
const $ = (id) => document.getElementById(id);
const ask = new URLSearchParams(location.search);
// This page is {base}/oauth/authorize; the API is {base}/api/v1 on this same origin.
const api = location.pathname.replace(/\/oauth\/authorize\/?$/, "") + "/api/v1";
let facts = null,
  back = "",
  signedIn = "";

function say(text) {
  $("msg").textContent = text;
}

async function load() {
  const params = new URLSearchParams();
  [
    "client_id",
    "redirect_uri",
    "response_type",
    "state",
    "code_challenge",
    "code_challenge_method",
    "scope",
    "resource",
  ].forEach((name) => {
    if (ask.has(name)) params.set(name, ask.get(name));
  });
  let r,
    j = null;
  try {
    r = await fetch(api + "/oauth/consent?" + params, {mode: "same-origin"});
    j = await r.json();
  } catch (e) {
    say("The notes server cannot be reached right now.");
    return;
  }
  if (!r.ok || !j || !j.success) {
    say(j && j.error ? j.error.message : "This request cannot be answered.");
    if (j && j.error && j.error.redirect) {
      back = j.error.redirect;
      $("back").classList.remove("hidden");
    }
    return;
  }
  facts = j.data;
  $("client").textContent = facts.client.name;
  $("client-id").textContent = facts.client.id;
  $("host").textContent = facts.redirectHost;
  if (!facts.writeAllowed) $("write-row").classList.add("hidden");
  else if (facts.scope === "write") $("scope-write").checked = true;
  // The web client's key on this origin (session or device), offered only when it was kept
  // for this very server's API: on a relay, every server's consent page has this origin.
  let kept = "",
    device = null;
  try {
    const shared = document.documentElement.dataset.origin === "shared"; // a relay's: keep off
    for (const store of shared ? [] : [sessionStorage, localStorage]) {
      if (!kept && store.getItem("notesvc.keyFor") === api) {
        kept = store.getItem("notesvc.key") || "";
        if (kept.startsWith("nsd_")) device = JSON.parse(store.getItem("notesvc.device") || "null");
      }
    }
  } catch (e) {
    /* storage is off in this browser */
  }
  $("ask").classList.remove("hidden");
  if (kept && device && device.scope === "admin") {
    // This browser is an admin device of this very server: it approves as itself.
    signedIn = kept;
    $("device").textContent = device.name || "this device";
    $("signed-in").classList.remove("hidden");
    $("key-row").classList.add("hidden");
    $("allow").focus();
    return;
  }
  if (kept && !kept.startsWith("nsd_")) $("key").value = kept;
  $("key").focus();
}

async function allow() {
  say("");
  const body = {
    clientId: facts.client.id,
    redirectUri: facts.redirectUri,
    codeChallenge: ask.get("code_challenge") || "",
    resource: facts.resource,
    scope: $("scope-write").checked ? "notes:read notes:write" : "notes:read",
  };
  if (ask.get("state")) body.state = ask.get("state");
  let folder = $("folder").value.trim().replace(/\/+$/, "");
  if (folder) body.folder = folder.startsWith("notes/") ? folder : "notes/" + folder;
  $("allow").disabled = true;
  try {
    const r = await fetch(api + "/oauth/approve", {
      method: "POST",
      mode: "same-origin",
      headers: {
        "Content-Type": "application/json",
        "X-Service-Key": signedIn || $("key").value.trim(),
      },
      body: JSON.stringify(body),
    });
    const j = await r.json().catch(() => null);
    if (r.ok && j && j.success) {
      location.assign(j.data.redirect);
      return;
    }
    say(j && j.error ? j.error.message : "Not allowed.");
  } catch (e) {
    say("The notes server cannot be reached right now.");
  }
  $("allow").disabled = false;
}

$("allow").onclick = allow;
$("key").onkeydown = (e) => {
  if (e.key === "Enter") allow();
};
$("deny").onclick = () => {
  if (facts) location.assign(facts.deny);
};
$("return").onclick = () => {
  if (back) location.assign(back);
};
load();
"""[1:]
# --- end web/consent.js ---

# --- begin web/consent.html ---
CONSENT_PAGE = r"""
<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="robots" content="noindex, nofollow"><meta name="referrer" content="no-referrer">
<title>Allow access? · notesvc</title><link rel="icon" href="data:,"><style>{css}</style>
</head><body><main>
<h1>Allow access to your notes?</h1>
<p id="msg" class="err" role="alert"></p>
<div id="ask" class="hidden">
<p><span id="client" class="who"></span> asks to use your notes
(<span id="client-id" class="muted"></span>).</p>
<p>Whatever you decide, you go back to <span id="host" class="who"></span>.</p>
<fieldset><legend>It may</legend>
<label><input type="radio" name="scope" id="scope-read" value="read" checked>
read and search your notes</label>
<label id="write-row"><input type="radio" name="scope" id="scope-write" value="write">
read, create and change your notes</label></fieldset>
<label for="folder">Only this folder (leave empty for all notes)</label>
<input id="folder" type="text" autocomplete="off" placeholder="notes/family">
<p id="signed-in" class="hidden">Signed in as <span id="device" class="who"></span>.</p>
<div id="key-row"><label for="key">Your API key (it stays on this page and your server)</label>
<input id="key" type="password" autocomplete="off" placeholder="nsk_..."></div>
<div class="row"><button id="allow" class="go">Allow</button>
<button id="deny">Deny</button></div></div>
<div id="back" class="hidden row"><button id="return">Return to the app</button></div>
</main><script>{js}</script></body></html>
"""[1:]
# --- end web/consent.html ---

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


def shared_origin_page(page: str) -> str:
    """Return a page marked for a relay's shared origin (a relay without a domain): its
    script then keeps nothing in browser storage, since every server's page shares it."""
    return page.replace('<html lang="en"', '<html lang="en" data-origin="shared"', 1)


# -- the relay's own page (a relay with per-server origins opens no server on its host) --

# --- begin web/landing.html ---
RELAY_LANDING_HTML = r"""
<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="robots" content="noindex">
<title>notesvc relay</title>
<style>body{font:16px/1.5 system-ui,sans-serif;max-width:34em;margin:3em auto;padding:0 1em}</style>
</head>
<body>
<h1>notesvc relay</h1>
<p>This relay passes requests between people and their own notes servers. It keeps no
notes and no keys, and this page opens nothing of any server.</p>
<p>To open your notes, use the link your server gives you (its web client, or
<code>links.connect.hosted</code> in its setup payload): each server has its own address
here, <code>https://&lt;server id&gt;.&lt;this relay&gt;</code>.</p>
</body></html>
"""[1:]
# --- end web/landing.html ---
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


# == Relay ====================================================================
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
# the relay alike (CONTRACT 3): bounded in bytes and in time, so it costs no more than the
# connection it keeps.
LINGER_MAX_BYTES = 64 * 1024 * 1024
LINGER_SECONDS = 10.0
LINGER_IDLE_SECONDS = 2.0
RELAY_MAX_LINGERING = 128  # connections a relay lingers on at once (the rest close at once)
RELAY_ID_RE = re.compile(r"^[a-z2-7]{20}$")
RELAY_CODE_RE = re.compile(r"^[A-Za-z0-9-]{1,64}$")
_TOKEN_CHARS_RE = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
HOP_BY_HOP = frozenset(
    "connection keep-alive proxy-authenticate proxy-authorization te trailers "
    "transfer-encoding upgrade host content-length".split()
)
RELAY_ANSWER_CSP = "default-src 'none'; sandbox"
RELAYED_WELL_KNOWN_RE = re.compile(
    r"^/\.well-known/(oauth-protected-resource|oauth-authorization-server|openid-configuration)"
    r"/r/([^/]+)(/.*)?$"
)
# A server's route that answers JSON-RPC (/mcp): the relay's own refusals of a request to it
# (server offline, body too large) are JSON-RPC errors too (CONTRACT 3).
RELAYED_JSONRPC_RE = re.compile(rf"^/r/[^/]+{API}/mcp$")


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
    Content-Length and no Transfer-Encoding (chunked bodies are refused, never guessed).
    """
    text = head.decode("latin-1")  # every byte decodes
    lines = text.split("\r\n")
    if lines[-2:] != ["", ""]:
        raise _Refuse(400, "the request head must end with an empty CRLF line")
    lines = lines[:-2]
    m = re.fullmatch(
        r"([A-Z]{1,16}) (/[!-~]*|[Hh][Tt][Tt][Pp][Ss]?://[!-~]+) HTTP/1\.([01])", lines[0]
    )
    if not m:
        raise _Refuse(400, "malformed request line")
    method, target, minor = m.groups()
    authority = ""
    if not target.startswith("/"):  # absolute-form (RFC 9112 3.2.2): its authority is the Host
        try:
            url = urllib.parse.urlsplit(target)
        except ValueError:  # (a broken IPv6 literal, say)
            raise _Refuse(400, "malformed request line") from None
        authority, target = url.netloc, (url.path or "/") + (f"?{url.query}" if url.query else "")
        if not authority or "@" in authority or not target.startswith("/"):
            raise _Refuse(400, "malformed request line")
    headers = []
    for line in lines[1:]:
        if line[:1] in (" ", "\t"):
            raise _Refuse(400, "folded header lines (obs-fold) are not accepted")
        name, sep, value = line.partition(":")
        if not sep or not _TOKEN_CHARS_RE.match(name):
            raise _Refuse(400, "malformed header line")
        if "\n" in line or "\r" in line:
            raise _Refuse(400, "bare CR or LF in a header line")
        headers.append((name, value.strip(" \t")))
    if authority:
        headers = [(k, v) for k, v in headers if k.lower() != "host"] + [("Host", authority)]

    def all_of(wanted: str) -> list:
        return [v for k, v in headers if k.lower() == wanted]

    lengths = all_of("content-length")
    if all_of("transfer-encoding"):
        raise _Refuse(
            411, "chunked or encoded request bodies are not accepted; send Content-Length"
        )
    if len(lengths) > 1:
        raise _Refuse(400, "more than one Content-Length")
    length = 0
    if lengths:
        if not re.fullmatch(r"\d{1,18}", lengths[0]):
            raise _Refuse(400, "Content-Length is not a whole number")
        length = int(lengths[0])
    connection = ",".join(all_of("connection")).lower()
    keep_alive = "close" not in connection if minor == "1" else "keep-alive" in connection
    raw_path, _, query = target.partition("?")
    try:
        path = urllib.parse.unquote_to_bytes(raw_path).decode("utf-8")
    except UnicodeDecodeError:
        raise _Refuse(400, "the URL path is not UTF-8") from None
    return method, path, query, headers, keep_alive, length


def http_response(status: int, headers: list, body: bytes, keep_alive: bool) -> bytes:
    """Return an HTTP/1.1 response (head and body) as bytes."""
    reason = bottle.HTTP_CODES.get(status, "Status")
    lines = [f"HTTP/1.1 {status} {reason}"]
    lines += [f"{k}: {v}" for k, v in headers]
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

    def register(self, server_id: str, token: str, relay_code: str, addr: str) -> None:
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
            if request["id"] in slot.waiting:  # its client may have given up meanwhile
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

    __slots__ = ("busy", "opened", "peer", "writer")

    def __init__(self, writer: asyncio.StreamWriter, peer: str):
        self.writer, self.peer, self.busy, self.opened = writer, peer, False, time.monotonic()

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
        assets = re.compile("^(" + "|".join(map(re.escape, WEB_ASSETS)) + ")$")
        prefixed = r"^/r/([^/]+)"
        # The relay's own host: its API for servers, the path-based JSON routes of every
        # server (/r/<id>/api/v1, MCP, OAuth's token endpoints and metadata), and pages:
        # with a domain, a landing page and redirects to each server's own origin; without
        # one, the pages themselves, which then keep nothing in the browser (CONTRACT 22).
        self.routes = (
            ("GET", re.compile(r"^/health$"), self.health),
            ("GET", re.compile(r"^/relay/v1/info$"), self.info),
            ("POST", re.compile(r"^/relay/v1/register/([^/]+)$"), self.register),
            ("GET", re.compile(r"^/relay/v1/poll/([^/]+)$"), self.poll),
            ("POST", re.compile(r"^/relay/v1/reply/([^/]+)/([^/]+)$"), self.reply),
            ("POST", re.compile(r"^/relay/v1/code/([^/]+)$"), self.set_code),
            ("GET", re.compile(r"^/relay/v1/pair/([^/]+)$"), self.pair),
            ("*", re.compile(prefixed + r"(/api/v1(?:/.*)?)$", re.S), self.forward),
            ("GET", RELAYED_WELL_KNOWN_RE, self.forward_well_known),
            ("POST", re.compile(prefixed + r"(/oauth/(?:token|register|revoke))$"), self.forward),
            ("GET", assets, self.web_asset),
            ("GET", re.compile(r"^/$"), self.landing if self.domain else self.web_client),
            ("GET", re.compile(prefixed + r"(/oauth/authorize)$"), self.consent_page),
            ("GET", re.compile(prefixed + r"(/s/[A-Za-z0-9_-]{1,64})$"), self.share_page),
            ("GET", re.compile(prefixed + r"(/)$"), self.to_origin),
        )
        # A server's own origin, <serverId>.<domain>: its pages (the relay's copies), and its
        # API, WebDAV, OAuth and metadata forwarded as that server's own paths.
        self.origin_routes = (
            ("*", re.compile(r"^(/api/v1(?:/.*)?)$", re.S), self.forward_origin),
            ("*", re.compile(r"^(/dav(?:/.*)?)$", re.S), self.forward_origin),
            ("POST", re.compile(r"^(/oauth/(?:token|register|revoke))$"), self.forward_origin),
            ("GET", re.compile(r"^(/\.well-known/[a-z-]+(?:/.*)?)$"), self.forward_origin),
            ("GET", re.compile(r"^/relay/v1/pair/([^/]+)$"), self.pair),
            ("GET", assets, self.web_asset),
            ("GET", re.compile(r"^/$"), self.web_client),
            ("GET", re.compile(r"^/oauth/authorize$"), self.consent_page),
            ("GET", re.compile(r"^/s/[A-Za-z0-9_-]{1,64}$"), self.share_page),
        )

    # -- connections ---------------------------------------------------------------

    async def start(self) -> int:
        """Listen; return the port."""
        self.server = await asyncio.start_server(
            self._serve_connection,
            self.config.host,
            self.config.port,
            limit=RELAY_MAX_HEAD,
            backlog=1024,
        )
        return self.server.sockets[0].getsockname()[1]

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

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        peer = (writer.get_extra_info("peername") or ("?", 0))[0]
        conn = _Conn(writer, peer)
        self._admit(conn)
        try:
            while not self.hub.closed:
                keep_alive = await self._serve_one(conn, reader, writer)
                if not keep_alive:
                    break
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        except Exception:
            log.exception("relay: connection from %s failed", peer)
        finally:
            self._forget(conn)
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
            limit = self._body_limit(path)
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
            try:
                body = (
                    await asyncio.wait_for(reader.readexactly(length), timeout) if length else b""
                )
            except asyncio.TimeoutError:
                return False
            request = RelayRequest(method, path, query, headers, body, conn.peer, keep_alive)
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

    def _body_limit(self, path: str) -> int:
        """Return the largest body accepted on a path: replies carry base64 answers."""
        if path.startswith("/relay/v1/reply/"):
            return self.config.max_body_bytes * 2 + 65536
        if path.startswith("/r/"):
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
        if not self.domain:
            return ""
        host = req.header("Host").lower().rstrip(".")
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
        forwarded = req.header("X-Forwarded-For")
        if forwarded:
            environ["HTTP_X_FORWARDED_FOR"] = forwarded
        return client_address(self.config, environ)

    def base_url(self, req: RelayRequest) -> str:
        environ = {
            "wsgi.url_scheme": "http",
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
        }

    def info(self, req: RelayRequest) -> dict:
        """What a server needs to name its pages: per-server origins, and where."""
        return {
            "domain": self.domain or None,
            "perServerOrigins": bool(self.domain),
            "publicUrl": self.config.public_url or self.base_url(req),
        }

    def server_origin(self, req: RelayRequest, server_id: str) -> str:
        """Return https://<serverId>.<domain>[:port]: the scheme and port of the relay's
        SERVICE_PUBLIC_URL, else of the address the request came to."""
        parts = urllib.parse.urlsplit(self.config.public_url or self.base_url(req))
        port = f":{parts.port}" if parts.port else ""
        return f"{parts.scheme}://{server_id}.{self.domain}{port}"

    def _html(self, page: str, headers: dict, shared: bool) -> tuple:
        if shared:  # the shared origin of a relay without a domain: keep nothing (22)
            page = shared_origin_page(page)
        ctype = ("Content-Type", "text/html; charset=utf-8")
        return 200, [ctype, *headers.items()], page.encode("utf-8")

    def web_client(self, req: RelayRequest) -> tuple:
        return self._html(web_client_page(), web_client_headers(), not req.server_id)

    def landing(self, req: RelayRequest) -> tuple:
        """The relay's own page: an old connect link (?relayCode=) goes on to its server's
        origin; otherwise a page that opens nothing of any server."""
        code = urllib.parse.parse_qs(req.query).get("relayCode", [""])[0]
        if code:
            if not RELAY_CODE_RE.match(code):
                raise bad_request("a relay code is 1-64 letters, digits and dashes")
            return self._redirect(self.server_origin(req, self.hub.pair(code)) + "/")
        return 200, list(RELAY_LANDING_HEADERS.items()), RELAY_LANDING_PAGE

    def to_origin(self, req: RelayRequest, server_id: str, rest: str) -> tuple:
        """An old browser link under /r/<serverId>/ (the client, the consent page, a share
        link): the same path and query on the server's own origin; without a domain the
        consent and share pages are served here, keeping nothing."""
        if not RELAY_ID_RE.match(server_id):
            raise not_found("no such server on this relay")
        if not self.domain:
            page = consent_page if rest == "/oauth/authorize" else share_page
            if rest == "/":
                raise not_found("open the relay's own page with your server's connect link")
            head = consent_page_headers if rest == "/oauth/authorize" else share_page_headers
            return self._html(page(), head(), True)
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
        return self._html(consent_page(), consent_page_headers(), False)

    def share_page(self, req: RelayRequest, server_id: str = "", rest: str = "") -> tuple:
        if not req.server_id:
            return self.to_origin(req, server_id, rest)
        return self._html(share_page(), share_page_headers(), False)

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
        self.hub.register(server_id, token, code, self.client_addr(req))
        return {"registered": True, "serverId": server_id}

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

    def pair(self, req: RelayRequest, code: str) -> dict:
        server_id = self.hub.pair(code)
        if self.domain:
            origin = self.server_origin(req, server_id)
            return {"serverId": server_id, "relayApiBase": f"{origin}{API}", "origin": origin}
        return {"serverId": server_id, "relayApiBase": f"{self.base_url(req)}/r/{server_id}{API}"}

    async def forward(self, req: RelayRequest, server_id: str, rest: str, prefix=None) -> tuple:
        """Hand a request to server_id as its path `rest`; `prefix` is what the server sees
        in front of it: /r/<serverId> on the relay's host, nothing on its own origin."""
        headers = [[k, v] for k, v in req.headers if k.lower() not in HOP_BY_HOP]
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
        return answer["status"], headers, answer["body"]


RELAY_PASSED_HEADERS = frozenset(
    "cache-control vary etag last-modified location retry-after www-authenticate content-range "
    "accept-ranges allow dav lock-token x-request-id content-disposition".split()
)


def relay_answer_headers(path: str, headers: list, download: bool = False) -> list:
    """Return a forwarded answer's headers: a type the route may answer, an allowlist of the
    rest, nosniff and a sandbox (CONTRACT 22).

    A registered server cannot publish a page, script or cookies on the relay's origins:
    its Content-Type is kept only when its media type is exactly one the route answers
    (JSON; XML under /dav/; a zip for export.zip; for file bytes (`download`) an image,
    audio, video, PDF or plain text, else application/octet-stream, always as an
    attachment), and only the headers a client of the API needs pass.
    """
    given = next((v for k, v in headers if k.lower() == "content-type"), "")
    keep = [
        (name, value)
        for name, value in headers
        if name.lower() in RELAY_PASSED_HEADERS
        and _TOKEN_CHARS_RE.match(name)
        and not re.search(r"[\x00-\x1f\x7f]", value)
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


def _relayed_type(path: str, given: str, download: bool) -> str:
    """Return the Content-Type a forwarded answer goes out with (see relay_answer_headers)."""
    media = given.split(";")[0].strip().lower()
    if download:
        return _download_type(media)
    if media in ("application/xml", "text/xml") and re.match(r"^/dav(/|$)", path):
        return f"{media}; charset=utf-8"
    if media == "application/zip" and path == f"{API}/export.zip":
        return media
    return JSON_TYPE


def _download_type(media: str) -> str:
    """Return the type file bytes go out as through a relay: an image, audio, video, PDF or
    plain text keeps its own (never one a browser runs as a page), else octet-stream."""
    passive = media.split("/")[0] in ("image", "audio", "video") or media in (
        "application/pdf",
        "text/plain",
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
    return re.sub(r"/r/[^/]+(/s/)?.*", lambda m: f"/r/…{m.group(1) or '/'}…", path)


RELAY_WORKERS = 4  # relayed requests a server answers at once (change-feed waits: half)


class RelayClient:
    """The server side: register at SERVICE_RELAY_URL, long-poll, answer in-process.

    Polls run on one thread over a kept-alive connection; each request is answered by a
    small worker pool, so a slow request never holds up the next poll.
    """

    def __init__(self, app: NotesApp):
        import concurrent.futures

        self.app, self.svc = app, app.service
        self.url = self.svc.config.relay_url
        self.state, self.error, self.since = "connecting", None, iso(utcnow())
        self._stop = threading.Event()
        self._registered_code = None
        self._code_sent_at = 0.0
        self._local = threading.local()
        self._workers = concurrent.futures.ThreadPoolExecutor(RELAY_WORKERS, "notesvc-relay-worker")
        self._thread = threading.Thread(target=self._run, name="notesvc-relay", daemon=True)

    def start(self) -> RelayClient:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._workers.shutdown(wait=False)

    def status(self) -> dict:
        return {"url": self.url, "state": self.state, "since": self.since, "lastError": self.error}

    def _set(self, state: str, error: str | None = None) -> None:
        if state != self.state:
            self.state, self.since = state, iso(utcnow())
        self.error = error

    # -- HTTP to the relay ----------------------------------------------------------

    def _call(self, method: str, path: str, body: dict | None = None, timeout: float = 15):
        """Return (status, parsed JSON or None) of one call to the relay (kept-alive per thread).

        Raises UpstreamError when the relay cannot be reached.
        """
        import http.client

        parts = urllib.parse.urlsplit(self.url)
        conn = getattr(self._local, "conn", None)
        if conn is None or conn.timeout != timeout:
            kind = (
                http.client.HTTPSConnection
                if parts.scheme == "https"
                else http.client.HTTPConnection
            )
            conn = self._local.conn = kind(parts.netloc, timeout=timeout)
        st = self.svc.state.read()
        headers = {"X-Relay-Token": st["relayToken"]}
        payload = None
        if body is not None:
            payload = to_json(body)
            headers["Content-Type"] = "application/json"
        for attempt in (1, 2):  # a kept-alive connection the relay closed: once more, fresh
            try:
                conn.request(method, parts.path.rstrip("/") + path, payload, headers)
                resp = conn.getresponse()
                raw = resp.read()
                break
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                if attempt == 2 or self._stop.is_set():
                    reason = "timed out" if isinstance(e, (socket.timeout, TimeoutError)) else e
                    raise UpstreamError(f"{method} {path.split('/')[3]}: {reason}") from None
        try:
            return resp.status, json.loads(raw) if raw else None
        except ValueError:
            return resp.status, None

    def register(self) -> None:
        """Register this server (and its relay code); UpstreamError, or RelayRefused."""
        st = self.svc.state.read()
        sid, code = st["serverId"], st["relayCode"]
        status, answer = self._call(
            "POST", f"/relay/v1/register/{sid}", {"token": st["relayToken"], "relayCode": code}
        )
        if status != 200:
            raise RelayRefused(status, _relay_message(answer, status))
        status, answer = self._call(
            "POST", f"/relay/v1/code/{code}", {"serverId": sid, "token": st["relayToken"]}
        )
        if status != 200:
            raise RelayRefused(status, _relay_message(answer, status))
        self._registered_code, self._code_sent_at = code, time.monotonic()
        self._learn_origin(sid)

    def _learn_origin(self, sid: str) -> None:
        """Ask the relay whether it gives servers their own origins, and remember this
        server's (links, share URLs and the OAuth issuer name it; CONTRACT 22)."""
        status, answer = self._call("GET", "/relay/v1/info")
        info = answer.get("data") if status == 200 and isinstance(answer, dict) else None
        origin = ""
        if isinstance(info, dict) and info.get("perServerOrigins") and info.get("domain"):
            parts = urllib.parse.urlsplit(str(info.get("publicUrl") or self.url))
            domain = str(info["domain"]).lower()
            if parts.scheme in ("http", "https") and valid_host(f"{sid}.{domain}"):
                port = f":{parts.port}" if parts.port else ""
                origin = f"{parts.scheme}://{sid}.{domain}{port}"
        known = {"relay": self.url, "origin": origin}
        if self.svc.state.read().get("relayOrigin") != known:
            self.svc.state.update(lambda data: data.update(relayOrigin=known))
            if origin:
                log.info("relay: this server's own origin there is %s", origin)

    def _run(self) -> None:
        backoff = 1.0
        while not self._stop.is_set():
            try:
                self.register()
                self._set("connected")
                backoff = 1.0
                log.info("relay: connected to %s", self.url)
                while not self._stop.is_set():
                    stale = time.monotonic() - self._code_sent_at > RELAY_CODE_TTL / 3
                    if stale or self.svc.state.read()["relayCode"] != self._registered_code:
                        self.register()  # the key (and with it the relay code) was rotated
                    request = self._poll()
                    if request is not None:
                        self._workers.submit(self._serve, request)
            except RelayRefused as e:
                self._set("refused", e.message)
                log.warning("relay %s refused this server: %s", self.url, e.message)
                self._stop.wait(max(backoff, 30.0 if e.status == 429 else 60.0))
                backoff = min(backoff * 2, 300.0)
            except UpstreamError as e:  # relay down or restarted: try again, more slowly
                self._set("error" if self.state != "connecting" else "connecting", str(e))
                log.warning("relay %s: %s; retrying in %.0f s", self.url, e, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)
            except Exception as e:
                self._set("error", type(e).__name__)
                log.exception("relay %s: unexpected failure; retrying in %.0f s", self.url, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)

    def _poll(self) -> dict | None:
        sid = self.svc.state.read()["serverId"]
        status, answer = self._call("GET", f"/relay/v1/poll/{sid}", timeout=RELAY_POLL_WAIT + 15)
        if status == 204:
            return None
        if status == 200 and isinstance(answer, dict) and isinstance(answer.get("data"), dict):
            return answer["data"]
        if status in (401, 403):  # the relay forgot us (restart, expiry): register again
            raise UpstreamError(f"poll answered HTTP {status}; registering again")
        raise UpstreamError(f"poll answered HTTP {status}")

    def _serve(self, request: dict) -> None:
        try:
            status, headers, body = self._dispatch(request)
            sid = self.svc.state.read()["serverId"]
            self._call(
                "POST",
                f"/relay/v1/reply/{sid}/{request['id']}",
                {"status": status, "headers": headers, "body": _b64(body)},
                timeout=30,
            )
        except Exception:  # the client gets a 504 from the relay; we log why
            log.exception("relay: answering request %s failed", request.get("id"))

    def _dispatch(self, request: dict) -> tuple:
        """Run one relayed request through the app in-process; return (status, headers, body)."""
        body = base64.b64decode(request.get("body", ""))
        sid = self.svc.state.read()["serverId"]
        # "" when the request came to this server's own origin on the relay, else /r/<id>
        on_origin = request.get("prefix") == "" and bool(self.svc.relay_origin())
        environ = {
            "REQUEST_METHOD": request["method"],
            "SCRIPT_NAME": "" if on_origin else f"/r/{sid}",
            "PATH_INFO": request["path"].encode("utf-8").decode("latin-1"),
            "QUERY_STRING": request.get("query", ""),
            "SERVER_NAME": "relay",
            "SERVER_PORT": "443" if request.get("scheme") == "https" else "80",
            "SERVER_PROTOCOL": "HTTP/1.1",
            "REMOTE_ADDR": request.get("client", ""),  # the lockout counts per real client
            "wsgi.version": (1, 0),
            "wsgi.url_scheme": request.get("scheme", "http"),
            "wsgi.input": io.BytesIO(body),
            "wsgi.errors": sys.stderr,
            "wsgi.multithread": True,
            "wsgi.multiprocess": False,
            "wsgi.run_once": False,
            "CONTENT_LENGTH": str(len(body)),
            "notesvc.relayed": True,
            "notesvc.relay_origin": self.svc.relay_origin() if on_origin else "",
        }
        for name, value in request.get("headers", []):
            key = name.upper().replace("-", "_")
            if key == "CONTENT_TYPE":
                environ["CONTENT_TYPE"] = value
            elif key not in (
                "CONTENT_LENGTH",
                "X_FORWARDED_FOR",
                "X_FORWARDED_PROTO",
                "X_FORWARDED_HOST",
            ):
                environ[f"HTTP_{key}"] = value
        if request.get("host"):
            environ["HTTP_HOST"] = request["host"]
        seen: dict = {}

        def start_response(status, headers, exc_info=None):
            seen["status"], seen["headers"] = int(status.split()[0]), headers

        chunks = self.app(environ, start_response)
        try:
            data = b"".join(chunks)
        finally:
            if hasattr(chunks, "close"):
                chunks.close()
        return seen["status"], [list(h) for h in seen["headers"]], data


class RelayRefused(Exception):
    """The relay answered a registration with a refusal (status and its message)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def _relay_message(answer: Any, status: int) -> str:
    try:
        return f"HTTP {status}: {answer['error']['message']}"[:300]
    except (TypeError, KeyError):
        return f"HTTP {status}"


# == HTTP =====================================================================


# -- system ---------------------------------------------------------------------


def get_health(svc: Service) -> dict:
    return {"status": "ok", "version": __version__, "uptimeSeconds": svc.uptime()}


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


def browser_setup_allowed(svc: Service, env: dict) -> bool:
    """Return whether the web client may set this server up from this request: setup not
    done, the key shown to it, the client on this machine or its own network, and never
    through a relay (CONTRACT 23)."""
    cfg, st = svc.config, svc.state.read()
    addr = svc.client_addr(env)
    return (
        not st.get("setupComplete")
        and not env.get("notesvc.relayed")
        and not env.get("SCRIPT_NAME")
        and names_this_machine(cfg, request_host(cfg, env))
        and is_home_network(addr)
        and (not cfg.setup_local_only or is_loopback(addr))
    )


def get_setup(svc: Service) -> dict:
    env, cfg, st = bottle.request.environ, svc.config, svc.state.read()
    url, relay = svc.base_url(env), svc.relay_url(env)
    server_id, code, complete = st["serverId"], st["relayCode"], bool(st.get("setupComplete"))
    show_key = (
        not complete
        and names_this_machine(cfg, request_host(cfg, env))  # defeats DNS rebinding
        and (not cfg.setup_local_only or is_loopback(svc.client_addr(env)))
    )
    key = st.get("apiKey", "") if show_key else KEY_PREFIX + "…" + st.get("keyHint", "")
    direct, relayed = f"{url}{API}", f"{svc.relay_base(env)}{API}"
    own_client = f"{svc.relay_base(env) if svc.relay_origin() else relay}/"
    own_client = own_client if cfg.pairing == "relay" else f"{url}/"
    client = cfg.client_url or own_client
    test_client = cfg.test_client_url or own_client
    payload = {
        "serverId": server_id,
        "apiKey": key,
        "setupComplete": complete,
        "browserSetup": show_key and browser_setup_allowed(svc, env),
        "version": __version__,
        "auth": {
            "method": cfg.auth_mode,
            "header": KEY_HEADER,
            "note": f"Send the key in the {KEY_HEADER} header on every protected endpoint."
            + ("" if cfg.auth_mode != "none" else " Auth is off (development only)."),
        },
        "pairing": {"mode": cfg.pairing, "relayCode": code, "relayUrl": relay},
        "server": {
            "url": url,
            "port": _server_port(env, cfg),
            "host": cfg.host,
            "cors": list(cfg.cors),
        },
        "links": {
            "setupApi": f"{direct}/system/setup",
            "health": f"{direct}/health",
            "apiBase": relayed if cfg.pairing == "relay" else direct,
            "directApiBase": direct,
            "relayApiBase": relayed,
            "connect": {
                "testHosted": _with_query(test_client, relayCode=code),
                "hosted": _with_query(client, relayCode=code),
                "localDevUi": _with_query(f"{url}/", relayCode=code, relayUrl=relay),
            },
        },
    }
    if not complete:
        payload["instructions"] = [
            "Copy apiKey: it is shown here only until setup completes"
            + (" (and only to this machine)." if cfg.setup_local_only else "."),
            "Open links.connect.hosted (or testHosted) on your device: it fills in this server.",
            f"If prefill is unavailable, paste links.apiBase and the key into your client "
            f"(header {KEY_HEADER}).",
            f"Finish with POST {direct}/auth/link and the key in {KEY_HEADER}; "
            "the key is redacted here from then on.",
        ]
    return payload


def _server_port(env: dict, cfg: Config) -> int:
    port = env.get("SERVER_PORT", "")
    return int(port) if str(port).isdigit() and cfg.port == 0 else cfg.port


def _with_query(url: str, **params: str) -> str:
    sep = "&" if "?" in url else "?"
    return url + sep + urllib.parse.urlencode(params)


def get_info(svc: Service) -> dict:
    count, size = svc.note_stats()
    return {
        "version": __version__,
        "serverId": svc.state.read()["serverId"],
        "uptimeSeconds": svc.uptime(),
        "startedAt": iso(svc.started),
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "notes": {"count": count, "bytes": size},
        "attachments": dict(zip(("count", "bytes"), svc.attachments.stats())),
        "history": {**svc.history.usage(), "maxVersions": svc.history.max_versions},
        "trash": svc.trash.usage(),
        "changes": {
            "last": svc.journal.last,
            "floor": svc.journal.floor,
            "waiting": svc.journal.waiting(),
        },
        "index": {**svc.index.stats(), "lastSync": svc.last_sync},
        "connection": svc.relay_client.status()
        if svc.relay_client
        else {
            "url": svc.config.relay_url or "(this server)",
            "state": "self" if not svc.config.relay_url else "off",
        },
    }


def _redact_url(url: str) -> str:
    """Return url for display: userinfo dropped, query values (which may be keys) hidden."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    query = "&".join(
        f"{pair.partition('=')[0]}=…" if "=" in pair else "…"
        for pair in parts.query.split("&")
        if pair
    )
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc, query=query, fragment=""))


def _network_facts(cfg: Config) -> dict:
    """The network settings /system/config and /security/config both report."""
    return {
        "port": cfg.port,
        "publicUrl": cfg.public_url,
        "trustProxy": list(cfg.trust_proxy),
        "cors": list(cfg.cors),
    }


def _limit_facts(svc: Service) -> dict:
    cfg = svc.config
    return {
        "maxBodyBytes": cfg.max_body_bytes,
        "maxAttachmentBytes": cfg.max_attachment_bytes,
        "maxConnections": cfg.max_connections,
        "idleTimeoutSeconds": cfg.idle_timeout,
        "lockout": {
            "failures": svc.lockout.limit,
            "windowSeconds": svc.lockout.window,
            "lockSeconds": svc.lockout.window,
        },
    }


def _agent_facts(cfg: Config) -> dict:
    return {
        "provider": cfg.agent_provider,
        "baseUrl": _redact_url(cfg.agent_base_url),
        "apiKeySet": bool(cfg.agent_api_key),
    }


def get_config(svc: Service) -> dict:
    cfg, limits = svc.config, _limit_facts(svc)
    return {
        "server": {
            "host": cfg.host,
            **_network_facts(cfg),
            "threads": cfg.threads,
            **{k: v for k, v in limits.items() if k != "lockout"},
        },
        "auth": {
            "mode": cfg.auth_mode,
            "header": KEY_HEADER,
            "setupLocalOnly": cfg.setup_local_only,
            "lockout": limits["lockout"],
        },
        "connection": {
            "pairingMode": cfg.pairing,
            "relayUrl": cfg.relay_url or "(this server)",
            "clientUrl": cfg.client_url or "(built-in client)",
            "testClientUrl": cfg.test_client_url or "(built-in client)",
        },
        "agent": {
            **_agent_facts(cfg),
            "model": cfg.agent_model,
            "timeoutSeconds": cfg.agent_timeout,
            "maxSteps": cfg.agent_max_steps,
            "write": cfg.agent_write,
        },
        "mcp": {"path": f"{API}/mcp", "write": cfg.mcp_write, "protocolVersions": MCP_VERSIONS},
        "search": {"engine": "notesvc-bm25", "maxQueryLength": MAX_QUERY_CHARS},
        "sync": {
            "rescanSeconds": cfg.rescan_seconds,
            "notesRoot": "notes/",
            "historyMaxVersions": cfg.history_max_versions,
            "historyDays": cfg.history_days,
            "trashDays": cfg.trash_days,
            "maxWaiters": cfg.max_waiters,
        },
        "plugins": {"dir": cfg.plugins_dir or ".notesvc/plugins"},
        "capture": {
            "transcribeUrl": _redact_url(cfg.transcribe_url),
            "transcribeModel": cfg.transcribe_model,
            "transcribeApiKeySet": bool(cfg.transcribe_api_key),
            "timeZone": cfg.timezone or "system",
            "attachmentsRoot": f"{ATTACHMENTS}/",
        },
    }


# -- auth / linking ---------------------------------------------------------------


def verify_key(svc: Service) -> dict:
    st = svc.state.read()
    answer = {"valid": True, "serverId": st["serverId"], "setupComplete": bool(st["setupComplete"])}
    who = request_principal()
    if who.kind != "owner":  # a scoped key learns how far it may go (the web client asks)
        answer["grant"] = {"kind": who.kind, "scope": who.scope, "folder": who.folder or None}
        if who.kind == "device":  # "Signed in as <device>"
            mine = [g for g in svc.grants.grants() if g["id"] == who.grant_id]
            answer["grant"]["name"] = mine[0]["name"] if mine else "this device"
    return answer


def link_client(svc: Service) -> dict:
    body = read_json(svc.config.max_body_bytes, required=False)
    name = field(body, "clientName", str, required=False, max_len=100) or "unnamed client"
    name = "".join(ch for ch in name if ch.isprintable()).strip() or "unnamed client"
    now = iso(utcnow())
    addr = svc.client_addr(bottle.request.environ)

    def change(data: dict) -> str:
        data["setupComplete"] = True
        data.pop("apiKey", None)
        clients = data.setdefault("linkedClients", [])
        clients.append({"name": name, "linkedAt": now, "address": addr})
        del clients[:-50]
        return data["serverId"]

    server_id = svc.state.update(change)
    log.info("client %r linked from %s; setup complete", name, addr)
    return {"linked": True, "setupComplete": True, "serverId": server_id, "linkedAt": now}


def issue_token(svc: Service) -> dict:
    if svc.config.auth_mode != "jwt":
        raise ApiError(403, "FORBIDDEN", "tokens are issued only with SERVICE_AUTH_MODE=jwt")
    st, now = svc.state.read(), int(time.time())
    claims = {
        "iss": f"notesvc:{st['serverId']}",
        "sub": "owner",
        "iat": now,
        "nbf": now,
        "exp": now + JWT_LIFETIME,
        "jti": secrets.token_hex(8),
        "kid": st["keyHash"][:16],  # rotating the key retires every token issued before
    }
    return {
        "token": jwt_encode(claims, svc.config.jwt_secret),
        "tokenType": "Bearer",
        "expiresIn": JWT_LIFETIME,
        "expiresAt": iso(claims["exp"]),
    }


def rotate_api_key(svc: Service) -> dict:
    key = svc.state.update(rotate_key)
    if svc.relay_client is not None:  # the relay code changed: tell the relay now
        threading.Thread(target=svc.relay_client.register, daemon=True).start()
    st = svc.state.read()
    log.info("API key rotated through the API; the old key stops working now")
    return {"apiKey": key, "relayCode": st["relayCode"], "rotatedAt": st["keyCreatedAt"]}


# -- notes ---------------------------------------------------------------------------


def _if_match() -> str | None:
    return request_header("If-Match")


def _note_response(rec: dict) -> dict:
    bottle.response.set_header("ETag", rec["etag"])
    return rec


INBOX = f"{NOTES}/inbox"  # where a note without a path goes (a folder grant: its folder)


def create_note(svc: Service) -> dict:
    """POST /notes: {path, content}, or {content, folder?} named from its title."""
    body = read_json(svc.config.max_body_bytes)
    content = field(body, "content")
    if body.get("path") is None:
        principal = request_principal()
        raw = field(body, "folder", required=False) or principal.folder or INBOX
        if principal.folder and raw == NOTES:
            raw = principal.folder
        folder = visible_folder(svc, raw)
        rec = svc.notes.create_named(folder, title_filename(content), content)
    else:
        rec = svc.notes.create(visible_note(svc.notes, field(body, "path")), content)
    path = rec["path"]
    script = bottle.request.environ.get("SCRIPT_NAME", "")
    location = f"{script}{API}/notes/{urllib.parse.quote(path, safe='')}"
    bottle.response.set_header("Location", location)
    return _note_response(rec)


LIST_FIELDS = ("title", "preview", "modified", "tags")  # a listing's ?fields= (CONTRACT 24)


def list_notes(svc: Service) -> dict:
    raw = query_str("folder") or NOTES
    folder = visible_folder(svc, raw)  # a folder grant's own, or 404
    asked = folder_path(raw)
    limit = query_int("limit", 100, 1, 1000)
    offset = query_int("offset", 0, 0, 10**9)
    sort = query_str("sort", "path") or "path"
    if sort not in ("path", "modified"):
        raise bad_request("'sort' must be path (the default) or modified (newest first)")
    fields = [f for f in query_str("fields").split(",") if f]
    unknown = sorted(set(fields) - set(LIST_FIELDS))
    if unknown:
        raise bad_request(
            f"unknown field(s) {', '.join(unknown)}: ask for {', '.join(LIST_FIELDS)}"
        )
    try:
        return svc.notes.list_page(folder, limit, offset, sort, fields)
    except ApiError as e:  # the folder a grant sees from one of its ancestors is not there yet
        if e.status_code != 404 or folder == asked:
            raise
        return {"notes": [], "total": 0, "limit": limit, "offset": offset}


def get_note(svc: Service, path: str) -> dict:
    return _note_response(svc.notes.get(visible_note(svc.notes, path)))


def update_note(svc: Service, path: str) -> dict:
    path = visible_note(svc.notes, path)
    body = read_json(svc.config.max_body_bytes)
    content = field(body, "content")
    if body.get("path") is not None and note_path(field(body, "path")) != path:
        raise bad_request(
            f"PUT changes content only; to move or rename use PATCH {API}/notes/:path/move"
        )
    return _note_response(svc.notes.update(path, content, _if_match()))


def move_note(svc: Service, path: str) -> dict:
    path = visible_note(svc.notes, path)
    body = read_json(svc.config.max_body_bytes)
    new = visible_note(svc.notes, field(body, "path"))  # a folder grant moves within its folder
    relink = bool(field(body, "updateLinks", bool, required=False))
    return _note_response(move_and_relink(svc, path, new, _if_match(), relink))


def merge_note(svc: Service, path: str) -> dict:
    """POST /notes/:path/merge {base, content}: an edit that started from version `base`,
    merged with what changed since (CONTRACT 24); 409 with `conflictPath` when it clashed."""
    path = visible_note(svc.notes, path)
    body = read_json(svc.config.max_body_bytes)
    base = field(body, "base", max_len=100)
    content = field(body, "content")
    base = base if base.startswith('"') else f'"{base}"'
    name = _clean_name(field(body, "clientName", required=False, max_len=100), "")
    who = title_filename(name or principal_name(svc, request_principal()))
    when = utcnow().strftime("%Y-%m-%d %H-%M UTC")
    done = svc.notes.merge(path, base, content, f"conflict {who} {when}")
    bottle.response.set_header("ETag", done["note"]["etag"])
    return done


def principal_name(svc: Service, principal: Principal) -> str:
    """Return who a request acts for, as a person would name it: a device's or a key's
    name, an app's; "owner" for the API key."""
    if principal.kind == "owner":
        return "owner"
    for g in svc.grants.grants():
        if g["id"] == principal.grant_id:
            return (g.get("client") or {}).get("name") or g["name"]
    return principal.kind


def delete_note(svc: Service, path: str) -> dict:
    return svc.notes.delete(visible_note(svc.notes, path), _if_match())


# -- attachments -------------------------------------------------------------------------

MULTIPART_SLACK = 65536  # bytes of a form beyond its file: the boundaries, headers and path


def _attachment_response(rec: dict, status: int) -> bytes:
    bottle.response.set_header("ETag", rec["etag"])
    script = bottle.request.environ.get("SCRIPT_NAME", "")
    location = f"{script}{API}/attachments/{urllib.parse.quote(rec['path'], safe='')}"
    bottle.response.set_header("Location", location)
    return ok(rec, status)


def put_attachment(svc: Service, path: str) -> bytes:
    """PUT the raw bytes: 201 when created, 200 when replaced (If-Match, If-None-Match: *)."""
    path = visible_attachment(svc.attachments, path)
    ctype = bottle.request.content_type.split(";")[0].strip().lower()
    if ctype.startswith("multipart/"):
        raise ApiError(
            415,
            "UNSUPPORTED_MEDIA_TYPE",
            f"PUT takes the file's own bytes; send a multipart form to POST {API}/attachments",
        )
    if_match, if_none_match = _if_match(), request_header("If-None-Match")
    svc.attachments.check(path, if_match, if_none_match)  # before the body is read
    limit = svc.config.max_attachment_bytes
    read, _ = request_body_reader(limit, "SERVICE_MAX_ATTACHMENT_BYTES")

    def copy(f) -> None:
        while chunk := read(BODY_CHUNK):
            f.write(chunk)

    rec, created = svc.attachments.place(svc.attachments.spool(copy), path, if_match, if_none_match)
    return _attachment_response(rec, 201 if created else 200)


def post_attachment(svc: Service) -> bytes:
    """POST multipart/form-data with `path` and `file`: 201; never overwrites (a taken path
    becomes name-2.ext, name-3.ext...)."""
    import email.message

    header = request_header("Content-Type") or ""
    parsed = email.message.Message()
    parsed["Content-Type"] = header
    if parsed.get_content_type() != "multipart/form-data":
        raise ApiError(
            415,
            "UNSUPPORTED_MEDIA_TYPE",
            "send multipart/form-data with the fields path and file "
            f"(or PUT the raw bytes to {API}/attachments/:path)",
        )
    limit = svc.config.max_attachment_bytes
    read, _ = request_body_reader(limit + MULTIPART_SLACK, "SERVICE_MAX_ATTACHMENT_BYTES")
    reader = MultipartReader(read, str(parsed.get_param("boundary") or ""))
    form: dict = {"path": bytearray(), "file": False}

    def given_path() -> str:
        try:
            raw = bytes(form["path"]).decode("utf-8").strip()
        except UnicodeDecodeError:
            raise bad_request("'path' is not valid UTF-8") from None
        if not raw:
            raise bad_request("'path' is required (attachments/<name>.<extension>)")
        return visible_attachment(svc.attachments, raw)

    def receive(f) -> None:
        def part(name: str, filename: Any, headers: Any):
            if name == "path":
                too_long = lambda: bad_request("'path' is longer than 2048 bytes")  # noqa: E731
                return form["path"].extend, 2048, too_long
            if name != "file":
                return None
            if form["file"]:
                raise bad_request("send one part named 'file'")
            form["file"] = True
            if form["path"]:
                given_path()  # a bad path is refused before the file is read
            return f.write, limit, lambda: too_large(limit, "SERVICE_MAX_ATTACHMENT_BYTES")

        reader.parts(part)

    tmp = svc.attachments.spool(receive)
    try:
        if not form["file"]:
            raise bad_request("the form has no part named 'file'")
        path = given_path()
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    rec, _ = svc.attachments.place(tmp, path, unique=True)
    return _attachment_response(rec, 201)


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


def _file_chunks(f: Any, length: int):
    try:
        while length > 0:
            chunk = f.read(min(BODY_CHUNK, length))
            if not chunk:
                return
            length -= len(chunk)
            yield chunk
    finally:
        f.close()


def get_attachment(svc: Service, path: str):
    """The file's bytes, with ETag, Range, Content-Disposition and a sandbox policy. A path
    under notes/ is a file kept beside the notes (a vault's image, put there over WebDAV)."""
    store = svc.note_files if str(path).startswith(NOTES + "/") else svc.attachments
    if store is svc.note_files:
        path = visible_note_file(store, path)
    else:
        path = visible_attachment(store, path)
    f, st = store.open(path)
    try:
        rec = store.record(path, st)
        etag, size, resp = rec["etag"], st.st_size, bottle.response
        none_match = request_header("If-None-Match")
        if none_match:
            tags = {t.strip().removeprefix("W/") for t in none_match.split(",")}
            if "*" in tags or etag in tags:
                f.close()
                resp.status = 304
                resp.set_header("ETag", etag)
                return b""
        first, last, status = 0, size - 1, 200
        if_range = request_header("If-Range")
        wanted = request_header("Range")
        if wanted and size and (if_range is None or if_range.strip() == etag):
            found = byte_range(wanted, size)
            if found:
                (first, last), status = found, 206
                resp.set_header("Content-Range", f"bytes {first}-{last}/{size}")
        resp.status = status
        resp.content_type = rec["contentType"]
        for name, value in (
            ("ETag", etag),
            ("Accept-Ranges", "bytes"),
            ("Content-Length", str(max(0, last - first + 1))),
            ("Content-Disposition", content_disposition(path, rec["contentType"])),
            ("Content-Security-Policy", ATTACHMENT_CSP),
        ):
            resp.set_header(name, value)
        f.seek(first)
        return _file_chunks(f, last - first + 1)
    except BaseException:
        f.close()
        raise


def list_attachments(svc: Service) -> dict:
    raw = query_str("folder") or ATTACHMENTS
    folder = visible_folder(svc, raw, top=ATTACHMENTS)  # a folder grant's own, or 404
    asked = attachment_folder(raw)
    limit = query_int("limit", 100, 1, 1000)
    offset = query_int("offset", 0, 0, 10**9)
    try:
        return svc.attachments.list_page(folder, limit, offset)
    except ApiError as e:  # the folder a grant sees from one of its ancestors is not there yet
        if e.status_code != 404 or folder == asked:
            raise
        return {"attachments": [], "total": 0, "limit": limit, "offset": offset}


def move_attachment(svc: Service, path: str) -> dict:
    path = visible_attachment(svc.attachments, path)
    body = read_json(svc.config.max_body_bytes)
    new = visible_attachment(svc.attachments, field(body, "path"))
    relink = field(body, "updateLinks", bool, required=False)
    linking = (
        set(filter(request_principal().sees, attachment_linkers(svc, path))) if relink else set()
    )
    rec = svc.attachments.move(path, new, _if_match())
    if relink and new != path:
        rec["linksUpdated"] = update_links(svc, path, new, linking)
    bottle.response.set_header("ETag", rec["etag"])
    return rec


def delete_attachment(svc: Service, path: str) -> dict:
    return svc.attachments.delete(visible_attachment(svc.attachments, path), _if_match())


# -- folders ---------------------------------------------------------------------------


def indexed_counts(svc: Service) -> Callable:
    """Return count(folder path) -> notes beneath it, from the index (read on first call)."""
    by_folder: dict = {}

    def count(folder: str) -> int:
        if not by_folder:
            by_folder.update(collections.Counter(p.rpartition("/")[0] for p in svc.index.paths()))
            by_folder.setdefault("", 0)  # read once, even when there are no notes
        inside = folder + "/"
        return sum(n for f, n in by_folder.items() if f == folder or f.startswith(inside))

    return count


def get_tree(svc: Service) -> dict:
    return granted_tree(svc, NOTES, query_int("depth", None, 1, 64), indexed_counts(svc))


def get_subtree(svc: Service, path: str) -> dict:
    return granted_tree(svc, path, query_int("depth", None, 1, 64), indexed_counts(svc))


# -- history, trash and the change feed ----------------------------------------------------

MAX_WAIT_SECONDS = 25  # a change-feed long-poll, below the relay's 30 s
RETRY_AFTER_SECONDS = 1  # what a feed over the waiter cap is told
MAX_SEQ = 10**10 - 1


def _page() -> tuple:
    return query_int("limit", 100, 1, 1000), query_int("offset", 0, 0, 10**9)


def _version_seen(svc: Service, path: str, version_id: str) -> str:
    """Return version_id when the request's grant sees the path it was saved at (a folder
    grant: inside its folder, whatever the note's path is now); 404 otherwise."""
    if VERSION_ID_RE.match(version_id) and not request_principal().sees(
        svc.history.saved_at(path, version_id)
    ):
        raise not_found(f"no version {version_id} of {path}")
    return version_id


def list_versions(svc: Service, path: str) -> dict:
    path = visible_note(svc.notes, path)
    limit, offset = _page()
    principal = request_principal()
    versions = svc.history.versions(path, principal.sees if principal.folder else None)
    if not versions and not svc.notes.exists(path):
        raise not_found(f"no note and no history at {path}")
    page = versions[offset : offset + limit]
    return {"versions": page, "total": len(versions), "limit": limit, "offset": offset}


def get_version(svc: Service, path: str, version_id: str) -> dict:
    if not VERSION_ID_RE.match(version_id):  # WSGI decodes %2F: maybe a note in a folder
        with contextlib.suppress(ApiError):  # named like one (notes/x.md/versions/y.md)
            return get_note(svc, f"{path}/versions/{version_id}")
    path = visible_note(svc.notes, path)
    data = svc.history.read(path, _version_seen(svc, path, version_id))
    return {
        **svc.history.describe(version_id, len(data)),
        "path": path,
        "content": data.decode("utf-8", "replace"),
    }


def diff_version(svc: Service, path: str, version_id: str) -> dict:
    path = visible_note(svc.notes, path)
    against = query_str("against", "current") or "current"
    old = svc.history.read(path, _version_seen(svc, path, version_id)).decode("utf-8", "replace")
    if against == "current":
        new = svc.notes.get(path)["content"]
    else:
        new = svc.history.read(path, _version_seen(svc, path, against))
        new = new.decode("utf-8", "replace")
    diff = unified_diff(old, new, f"{path}@{version_id}", f"{path}@{against}")
    return {"path": path, "id": version_id, "against": against, "diff": diff}


def restore_version(svc: Service, path: str, version_id: str) -> dict:
    path = visible_note(svc.notes, path)
    version_id = _version_seen(svc, path, version_id)
    return _note_response(svc.notes.restore_version(path, version_id, _if_match()))


def _trashed(svc: Service, item_id: str) -> Any:
    """Return a trash item the request's grant sees (a folder grant: its folder's); 404."""
    item = svc.trash.find(item_id)
    if not request_principal().sees(item.path):
        raise not_found(f"no item {item_id} in the trash")
    return item


def list_trash(svc: Service) -> dict:
    limit, offset = _page()
    sees = request_principal().sees
    items = [item for item in svc.trash.items() if sees(item.path)]
    page = [item.describe() for item in items[offset : offset + limit]]
    return {"items": page, "total": len(items), "limit": limit, "offset": offset}


def get_trash_item(svc: Service, item_id: str) -> dict:
    item = _trashed(svc, item_id)
    content = None
    if item.kind == "note":
        try:
            content = item.file.read_bytes().decode("utf-8", "replace")
        except FileNotFoundError:  # purged meanwhile
            raise not_found(f"no item {item_id} in the trash") from None
    return {**item.describe(), "content": content}


def restore_trash_item(svc: Service, item_id: str) -> dict:
    body = read_json(svc.config.max_body_bytes, required=False)
    item = _trashed(svc, item_id)
    target = field(body, "path", required=False)
    target = attachment_or_note_path(item.path if target is None else target)
    if not request_principal().sees(target):  # a folder grant restores into its folder
        raise not_found(f"no folder for {target}")
    top = target.split("/", 1)[0]
    if top != item.path.split("/", 1)[0]:
        raise bad_request(f"a trashed {item.kind} is restored under {item.path.split('/')[0]}/")
    if item.kind == "note":
        return _note_response(svc.notes.restore_trashed(item, target))
    rec = svc.attachments.restore(item.file, target)  # no history: the file goes back
    svc.trash.emptied(item)
    return rec


def purge_trash_item(svc: Service, item_id: str) -> dict:
    item = _trashed(svc, item_id)
    svc.trash.purge(item)
    return {"id": item.id, "purged": True}


def _granted_changes(page: dict) -> dict:
    """Return a page of the change feed as the request's grant sees it: a folder grant gets
    its folder's changes, a move into it as a creation and a move out of it as a deletion."""
    who = request_principal()
    if not who.folder:
        return page
    seen = []
    for c in page["changes"]:
        inside, was = who.sees(c["path"]), c["kind"] == "moved" and who.sees(c.get("from", ""))
        if c["kind"] == "moved" and inside and not was:
            c = {**{k: v for k, v in c.items() if k != "from"}, "kind": "created"}
        elif c["kind"] == "moved" and was and not inside:
            c = {"seq": c["seq"], "kind": "deleted", "path": c["from"], "at": c["at"]}
        elif not inside:
            continue
        seen.append(c)
    return {**page, "changes": seen}


def list_changes(svc: Service) -> dict:
    since = query_int("since", 0, 0, MAX_SEQ)
    wait = query_int("wait", 0, 0, MAX_WAIT_SECONDS)
    limit = query_int("limit", 100, 1, 1000)
    page = _granted_changes(svc.journal.read(since, limit))
    if page["changes"] or not wait:
        return page
    # A waiting feed holds a worker thread: at most max_waiters at once, so the others
    # keep serving (relayed requests have their own small pool: half of it).
    if bottle.request.environ.get("notesvc.relayed"):
        pool, cap = "relay", min(svc.config.max_waiters, RELAY_WORKERS // 2)
    else:
        pool, cap = "direct", svc.config.max_waiters
    deadline = time.monotonic() + wait
    while not page["changes"]:  # a folder grant waits on for a change it may see
        came = svc.journal.wait_after(page["last"], deadline - time.monotonic(), pool, cap)
        if came is None:
            bottle.response.set_header("Retry-After", str(RETRY_AFTER_SECONDS))
            return {**page, "retryAfter": RETRY_AFTER_SECONDS}
        after = _granted_changes(svc.journal.read(page["last"], limit))
        if not came or after["last"] == page["last"] or time.monotonic() >= deadline:
            return after
        page = after
    return page


# -- search --------------------------------------------------------------------------------


def search_notes(svc: Service) -> dict:
    started = time.perf_counter()
    query = Query(query_str("q"))
    folder = visible_folder(svc, query_str("folder") or NOTES)  # a folder grant's by default
    folder = "" if folder == NOTES else folder
    limit = query_int("limit", 20, 1, 100)
    offset = query_int("offset", 0, 0, 10000)
    total, hits = svc.index.search(query, folder, limit, offset)
    results = [{"path": p, "title": t, "score": sc, "snippet": sn} for p, t, sc, sn in hits]
    return {
        "query": query.text,
        "total": total,
        "limit": limit,
        "offset": offset,
        "results": results,
        "tookMs": round((time.perf_counter() - started) * 1000, 3),
    }


# -- agent ---------------------------------------------------------------------------------


def agent_chat(svc: Service) -> dict:
    body = read_json(svc.config.max_body_bytes)
    message = field(body, "message", max_len=MAX_MESSAGE_CHARS)
    if is_blank(message):
        raise bad_request("'message' must not be empty")
    note = body.get("notePath")
    if note is not None:
        note = visible_note(svc.notes, field(body, "notePath"))
        if not svc.notes.exists(note):
            raise not_found(f"no note at {note}")
    channel = field(body, "channel", required=False)
    if channel is not None and channel not in svc.channel_providers:
        raise bad_request(f"'channel' must be one of {', '.join(svc.channel_providers)}")
    return ask_agent(svc, message, note, request_principal().folder)


def agent_status(svc: Service) -> dict:
    provider = svc.agent_providers[svc.config.agent_provider]
    return {
        "enabled": provider.enabled,
        "provider": provider.name,
        "model": provider.model(svc.config),
    }


# -- MCP: the tools over JSON-RPC 2.0 (Streamable HTTP, answered as JSON) -------------------
#
# POST /api/v1/mcp takes one JSON-RPC message and answers it with one JSON object (no SSE,
# no sessions). Two eras share it, told apart the way the official SDKs route them: by the
# MCP-Protocol-Version header (none, or a handshake-era version: the handshake era).
#   2025-06-18, 2025-11-25: `initialize` (nothing is kept: every request stands alone),
#     `notifications/initialized` (202), `ping`, `tools/list`, `tools/call`.
#   2026-07-28 (stateless): no handshake; each request carries its version and capabilities
#     in `params._meta`, and the MCP-Protocol-Version, Mcp-Method and Mcp-Name headers must
#     repeat the body (-32020 when they do not); an unknown version is -32022 with the list.
#     `server/discover`, `tools/list`, `tools/call`; results carry `resultType: "complete"`.

MCP_HANDSHAKE_VERSIONS = ("2025-06-18", "2025-11-25")
MCP_STATELESS_VERSIONS = ("2026-07-28",)
MCP_VERSIONS = (*MCP_HANDSHAKE_VERSIONS, *MCP_STATELESS_VERSIONS)
_HANDSHAKE_ERA = ("2024-11-05", "2025-03-26", *MCP_HANDSHAKE_VERSIONS)
META_VERSION = "io.modelcontextprotocol/protocolVersion"
META_CAPABILITIES = "io.modelcontextprotocol/clientCapabilities"
META_SERVER_INFO = "io.modelcontextprotocol/serverInfo"
PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, INVALID_PARAMS = -32700, -32600, -32601, -32602
HEADER_MISMATCH, UNSUPPORTED_VERSION = -32020, -32022
# The HTTP status of a stateless-era error (the SDKs' table); in the handshake era a body
# that cannot be taken is 400 and every other error 200.
_STATELESS_STATUS = {METHOD_NOT_FOUND: 404}
_HANDSHAKE_400 = (PARSE_ERROR, INVALID_REQUEST, UNSUPPORTED_VERSION)
MCP_LIST_TTL_MS = 60000  # how long a stateless client may cache the tool list
MCP_INSTRUCTIONS = (
    "The user's Markdown notes, paths like notes/<folders>/<name>.md. Find notes with "
    "search_notes (or list_folder, recent_changes) and read them with read_note before "
    "answering from them; name the paths you used. To change a note, read it first and pass "
    "its etag to update_note or move_note."
)


def server_info() -> dict:
    return {"name": "notesvc", "title": "notesvc notes", "version": __version__}


class RpcError(Exception):
    """A JSON-RPC error answer (its HTTP status follows from the code and the era)."""

    def __init__(self, code: int, message: str, data: Any = None):
        super().__init__(message)
        self.code, self.message, self.data = code, message, data

    def answer(self, request_id: Any) -> dict:
        error = {"code": self.code, "message": self.message}
        if self.data is not None:
            error["data"] = self.data
        return {"jsonrpc": "2.0", "id": request_id, "error": error}

    def http_status(self, stateless: bool) -> int:
        if stateless:
            return _STATELESS_STATUS.get(self.code, 400)
        return 400 if self.code in _HANDSHAKE_400 else 200


def cors_allows(config: Config, origin: str) -> bool:
    """Return whether SERVICE_CORS_ORIGINS lets pages of this origin call the API."""
    return "*" in config.cors or origin.rstrip("/") in config.cors


def authenticate_mcp(svc: Service, environ: dict) -> Principal:
    """Let a request to /mcp through or raise 403, 401 or 429: the one place /mcp's callers
    are checked. A page's Origin must be one SERVICE_CORS_ORIGINS allows (so a site that
    rebinds its name to this machine gets nowhere), then the key, which may come as
    X-Service-Key, `Authorization: Bearer` or X-API-Key (CONTRACT 4), or an OAuth access
    token issued for this URL (CONTRACT 21). Returns who the request acts for."""
    origin = environ.get("HTTP_ORIGIN", "")
    if origin and not cors_allows(svc.config, origin):
        raise ApiError(
            403,
            "FORBIDDEN",
            "requests from web pages are refused unless their origin is listed in "
            "SERVICE_CORS_ORIGINS",
        )
    return svc.authenticate(environ, mcp=True)


def mcp_endpoint(svc: Service) -> bytes:
    """POST /mcp: one JSON-RPC message in; its answer out, or 202 for a notification."""
    env = bottle.request.environ
    stateless = _stateless_era(env, None)
    request_id = None
    try:
        message = _rpc_message(svc.config.max_body_bytes)
        stateless = _stateless_era(env, message)
        request_id = message.get("id")  # answered with errors too, when it is a usable id
        if not isinstance(request_id, (str, int)) or isinstance(request_id, bool):
            request_id = None
        method, params = _rpc_request(message, request_id)
        if method is None:  # a notification or a response: nothing to answer
            if stateless:
                _check_version(env.get("HTTP_MCP_PROTOCOL_VERSION"), MCP_STATELESS_VERSIONS)
            bottle.response.status = 202
            bottle.response.content_type = JSON_TYPE
            return b""
        if stateless:
            result = _stateless_request(svc, env, method, params)
        else:
            result = _handshake_request(svc, env, method, params)
        answer, status = {"jsonrpc": "2.0", "id": request_id, "result": result}, 200
    except RpcError as e:
        answer, status = e.answer(request_id), e.http_status(stateless)
    bottle.response.status = status
    bottle.response.content_type = JSON_TYPE
    return to_json(answer)


def _stateless_era(env: dict, message: Any) -> bool:
    """Return whether a request speaks the 2026-07-28 era: a header naming another version
    than the handshake era's, or (its header missing) a body carrying its version."""
    header = env.get("HTTP_MCP_PROTOCOL_VERSION")
    if header is not None:
        return header not in _HANDSHAKE_ERA
    params = message.get("params") if isinstance(message, dict) else None
    meta = params.get("_meta") if isinstance(params, dict) else None
    return isinstance(meta, dict) and META_VERSION in meta


def _rpc_message(max_bytes: int) -> Any:
    """Return the request's JSON-RPC message; 413 / 415 as ApiErrors, -32700 / -32600."""
    req = bottle.request
    if req.content_type.split(";")[0].strip().lower() != "application/json":
        raise ApiError(
            415, "UNSUPPORTED_MEDIA_TYPE", "send JSON-RPC with Content-Type: application/json"
        )
    if req.content_length > max_bytes:
        raise ApiError(413, "PAYLOAD_TOO_LARGE", f"the body is over {max_bytes} bytes")
    raw = req.body.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise ApiError(413, "PAYLOAD_TOO_LARGE", f"the body is over {max_bytes} bytes")
    try:
        message = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise RpcError(PARSE_ERROR, "the body is not valid JSON (UTF-8)") from None
    if isinstance(message, list):
        raise RpcError(INVALID_REQUEST, "batches are not supported: one message per request")
    if not isinstance(message, dict):
        raise RpcError(INVALID_REQUEST, "the body must be one JSON-RPC message (an object)")
    return message


def _rpc_request(message: dict, request_id: Any) -> tuple:
    """Return (method, params) of a request; method None for a notification or a response
    (both are only acknowledged); -32600 / -32602 for a malformed message."""
    if message.get("jsonrpc") != "2.0":
        raise RpcError(INVALID_REQUEST, 'a JSON-RPC 2.0 message needs "jsonrpc": "2.0"')
    method = message.get("method")
    if method is None and "id" in message and ("result" in message or "error" in message):
        return None, {}  # a response: this server never asks, so it is dropped
    if not isinstance(method, str) or not method:
        raise RpcError(INVALID_REQUEST, "'method' must be a non-empty string")
    if "id" in message and request_id is None:
        raise RpcError(INVALID_REQUEST, "'id' must be a string or a whole number")
    params = message.get("params")
    if params is not None and not isinstance(params, dict):
        raise RpcError(INVALID_PARAMS, "'params' must be an object")
    return method if "id" in message else None, params or {}


def _check_version(version: Any, served: tuple) -> None:
    if version not in served:
        requested = version[:64] if isinstance(version, str) else None
        raise RpcError(
            UNSUPPORTED_VERSION,
            f"protocol version {str(version)[:40]!r} is not supported",
            {"supported": list(MCP_VERSIONS), "requested": requested},
        )


def _handshake_request(svc: Service, env: dict, method: str, params: dict) -> dict:
    if method == "initialize":  # the client's version when served, else the newest
        asked = params.get("protocolVersion")
        version = asked if asked in MCP_HANDSHAKE_VERSIONS else MCP_HANDSHAKE_VERSIONS[-1]
        return {
            "protocolVersion": version,
            "capabilities": {"tools": {"listChanged": False}},
            "serverInfo": server_info(),
            "instructions": MCP_INSTRUCTIONS,
        }
    header = env.get("HTTP_MCP_PROTOCOL_VERSION")
    if header is not None:
        _check_version(header, MCP_HANDSHAKE_VERSIONS)
    if method == "ping":
        return {}
    return _tools_method(svc, method, params)


def _header_text(value: str | None) -> str | None:
    """Return a header's text; a value the client wrapped as =?base64?...?= is unwrapped."""
    m = re.fullmatch(r"=\?base64\?([A-Za-z0-9+/=]*)\?=", value or "")
    if not m:
        return value
    try:
        return base64.b64decode(m.group(1), validate=True).decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        return None


def _stateless_request(svc: Service, env: dict, method: str, params: dict) -> dict:
    meta = params.get("_meta")
    if not isinstance(meta, dict) or META_VERSION not in meta or META_CAPABILITIES not in meta:
        raise RpcError(
            INVALID_PARAMS,
            f"params._meta must carry {META_VERSION!r} and {META_CAPABILITIES!r} "
            "(protocol 2026-07-28)",
        )
    version = meta[META_VERSION]
    if env.get("HTTP_MCP_PROTOCOL_VERSION") != version:
        raise RpcError(
            HEADER_MISMATCH, "the MCP-Protocol-Version header does not match params._meta"
        )
    if env.get("HTTP_MCP_METHOD") != method:
        raise RpcError(HEADER_MISMATCH, "the Mcp-Method header does not match the method")
    name = params.get("name")
    if (
        method == "tools/call"
        and name is not None
        and _header_text(env.get("HTTP_MCP_NAME")) != name
    ):
        raise RpcError(HEADER_MISMATCH, "the Mcp-Name header does not match params.name")
    _check_version(version, MCP_STATELESS_VERSIONS)
    if method == "server/discover":
        result = {
            "supportedVersions": list(MCP_VERSIONS),
            "capabilities": {"tools": {"listChanged": False}},
            "instructions": MCP_INSTRUCTIONS,
            "cacheScope": "private",
            "ttlMs": MCP_LIST_TTL_MS,
        }
    else:
        result = _tools_method(svc, method, params)
    if method == "tools/list":
        result.update(cacheScope="private", ttlMs=MCP_LIST_TTL_MS)
    return {**result, "resultType": "complete", "_meta": {META_SERVER_INFO: server_info()}}


def _tools_method(svc: Service, method: str, params: dict) -> dict:
    if method == "tools/list":
        if params.get("cursor") is not None:
            raise RpcError(INVALID_PARAMS, "unknown cursor: the tool list has a single page")
        tools = available_tools(svc, svc.config.mcp_write)
        return {"tools": [mcp_tool(t) for t in tools]}
    if method == "tools/call":
        return _tools_call(svc, params.get("name"), params.get("arguments"))
    raise RpcError(METHOD_NOT_FOUND, f"method {method[:64]!r} is not served here")


def mcp_tool(tool: Tool) -> dict:
    """Return a tool as MCP's tools/list describes it."""
    return {
        "name": tool.name,
        "title": tool.annotations()["title"],
        "description": tool.description,
        "inputSchema": tool.schema,
        "annotations": tool.annotations(),
    }


def _tools_call(svc: Service, name: Any, arguments: Any) -> dict:
    if not isinstance(name, str):
        raise RpcError(INVALID_PARAMS, "params.name must name a tool (see tools/list)")
    if arguments is not None and not isinstance(arguments, dict):
        raise RpcError(INVALID_PARAMS, "params.arguments must be an object")
    offered = {t.name: t for t in available_tools(svc, svc.config.mcp_write)}
    if name not in offered:
        known = svc.tools.get(name)
        if known is not None and request_principal().folder and TOOLS.get(name) is not known:
            why = f"{name} is a plugin's tool: a connection to one folder gets the built-in tools"
        elif known is not None and not known.read_only and not svc.config.mcp_write:
            why = f"{name} changes notes: the owner has not allowed that (SERVICE_MCP_WRITE)"
        elif known is not None and not known.read_only:
            why = f"{name} changes notes: this connection was granted reading only"
        elif known is not None:
            why = f"{name} needs the {known.plugin} plugin, which is switched off"
        else:
            why = f"unknown tool {name[:64]!r} (see tools/list)"
        raise RpcError(INVALID_PARAMS, why)
    log.debug("request %s: MCP tool %s", _rid(), name)
    return call_tool(svc, offered[name], arguments or {})


# -- channels ----------------------------------------------------------------------------------


def list_channel_providers(svc: Service) -> dict:
    return {
        "providers": [
            {
                "name": p.name,
                "description": p.description,
                "fields": [dataclasses.asdict(f) for f in p.fields],
                "allowlistField": p.allow,
                "webhookPath": f"{API}/channels/webhook/{p.name}",
            }
            for p in svc.channel_providers.values()
        ]
    }


def list_channels(svc: Service) -> dict:
    return {"channels": [redact_channel(c, svc.channel_providers) for c in _channels(svc)]}


def create_channel(svc: Service) -> dict:
    body = read_json(svc.config.max_body_bytes)
    name = field(body, "provider")
    provider = svc.channel_providers.get(name)
    if provider is None:
        raise bad_request(f"'provider' must be one of {', '.join(svc.channel_providers)}")
    config = validate_channel_config(provider, body.get("config", {}))
    title = field(body, "name", required=False, max_len=100) or f"{name} channel"
    return add_channel(svc, name, config, title)


def add_channel(svc: Service, name: str, config: dict, title: str, **extra) -> dict:
    """Store a new channel (config already checked) and start what it needs; return it."""
    # Through a relay (or this server's own /r/<id> prefix) the hook must go that way too.
    base = svc.issuer(bottle.request.environ)
    channel = {
        "id": "ch_" + secrets.token_hex(6),
        "provider": name,
        "name": _printable(title),
        "enabled": True,
        "createdAt": iso(utcnow()),
        "webhookUrl": f"{base}{API}/channels/webhook/{name}",
        "secret": secrets.token_urlsafe(24),
        "config": config,
        **extra,
    }
    svc.state.update(lambda data: data.setdefault("channels", []).append(channel))
    log.info("channel %s (%s) created", channel["id"], name)
    channel = configure_channel(svc, channel)  # Telegram webhook mode: setWebhook
    svc.pollers.sync()
    return channel


TELEGRAM_TOKEN_RE = re.compile(r"^[0-9]{1,20}:[A-Za-z0-9_-]{1,200}$")  # BotFather's shape


def connect_telegram(svc: Service) -> dict:
    """POST /channels/connect/telegram {botToken, name?}: the web client's "Connect
    Telegram". The token is checked with getMe first (refused: 400, Telegram unreachable:
    502; nothing is stored either way); then a polling channel that no chat may use until
    one sends the bind code (10 minutes), which connects that chat alone."""
    body = read_json(svc.config.max_body_bytes)
    token = field(body, "botToken", max_len=MAX_CONFIG_CHARS).strip()
    if not TELEGRAM_TOKEN_RE.match(token):
        raise bad_request("'botToken' must be the token BotFather gave you (123456:ABC...)")
    try:
        bot = telegram_call(svc, {"botToken": token}, "getMe", {}, timeout=15)
    except TelegramError as e:
        raise bad_request(
            f"Telegram refused this token ({e}); copy it again from @BotFather"
        ) from None
    except UpstreamError as e:
        raise ApiError(502, "UPSTREAM_ERROR", f"Telegram cannot be reached: {e}") from None
    bot = bot if isinstance(bot, dict) else {}
    username = _printable(str(bot.get("username") or ""), 64)
    title = field(body, "name", required=False, max_len=100) or f"@{username or 'telegram'}"
    config = validate_channel_config(
        svc.channel_providers["telegram"],
        {"botToken": token, "mode": "polling", "notify": True},
    )
    code, binding = new_binding()
    channel = add_channel(svc, "telegram", config, title, binding=binding, bot=username)
    return bind_answer(svc, channel, code, binding)


def bind_answer(svc: Service, channel: dict, code: str, binding: dict) -> dict:
    """Return what the web client shows to connect a chat: the code, the bot's t.me link
    that sends it (and its QR code), until when it works."""
    username = channel.get("bot") or ""
    link = f"https://t.me/{username}?start={code}" if username else ""
    answer = {
        "channel": redact_channel(channel, svc.channel_providers),
        "bindCode": code,
        "bindUntil": binding["until"],
        "bot": username,
        "link": link,
    }
    svg = qr_svg(link) if link else None
    if svg:
        answer["qrSvg"] = svg
    return answer


def bind_channel(svc: Service, channel_id: str) -> dict:
    """POST /channels/:id/bind: a new bind code; the next chat to send it replaces the
    allowed chats (the ones allowed now keep working until then)."""
    code, binding = new_binding()

    def apply(channels: list, i: int) -> dict:
        if channels[i]["provider"] != "telegram":
            raise bad_request("only a Telegram channel is connected by a code")
        channels[i]["binding"] = binding
        return channels[i]

    channel = _change_channel(svc, channel_id, apply)
    return bind_answer(svc, channel, code, binding)


def get_channel(svc: Service, channel_id: str) -> dict:
    """Return one channel, redacted, with the last senders its allowlist refused."""
    for channel in _channels(svc):
        if channel["id"] == channel_id:
            refused = channel.get("refusedSenders", [])
            return {**redact_channel(channel, svc.channel_providers), "refusedSenders": refused}
    raise not_found(f"no channel {channel_id}")


def patch_channel(svc: Service, channel_id: str) -> dict:
    """Merge {name?, config?} into a channel (validated as on create; the secret stays)."""
    if not any(c["id"] == channel_id for c in _channels(svc)):  # 404 before the body's 400
        raise not_found(f"no channel {channel_id}")
    body = read_json(svc.config.max_body_bytes)
    unknown = sorted(set(body) - {"name", "config"})
    if unknown:
        raise bad_request(f"unknown field(s): {', '.join(unknown)}; send name and/or config")
    if not body:
        raise bad_request("nothing to change: send name and/or config")
    title = field(body, "name", required=False, max_len=100)
    if title is not None and is_blank(title):
        raise bad_request("'name' must not be empty")
    changes = field(body, "config", dict, required=False)

    def merge(channels: list, i: int) -> dict:
        channel = channels[i]
        if changes is not None:
            provider = svc.channel_providers.get(channel["provider"])
            if provider is None:
                raise bad_request(f"channel provider {channel['provider']!r} is not loaded")
            stored = channel["config"]
            if "mode" not in stored and any(f.name == "mode" for f in provider.fields):
                stored = {**stored, "mode": "webhook"}  # stored before modes: a webhook
            channel["config"] = validate_channel_config(provider, {**stored, **changes})
        if title is not None:  # only invisible characters: the name it had stays
            channel["name"] = _printable(title) or channel["name"]
        return channel

    channel = _change_channel(svc, channel_id, merge)
    log.info("channel %s changed", channel_id)
    if changes is not None:
        channel = configure_channel(svc, channel)  # webhook mode: setWebhook again
    svc.pollers.sync()
    return redact_channel(channel, svc.channel_providers)


def toggle_channel(svc: Service, channel_id: str) -> dict:
    def flip(channels: list, i: int) -> dict:
        channels[i]["enabled"] = not channels[i]["enabled"]
        return channels[i]

    channel = _change_channel(svc, channel_id, flip)
    svc.pollers.sync()
    return redact_channel(channel, svc.channel_providers)


def delete_channel(svc: Service, channel_id: str) -> dict:
    _change_channel(svc, channel_id, lambda channels, i: channels.pop(i))
    svc.pollers.sync()
    return {"id": channel_id, "deleted": True}


def receive_webhook(svc: Service, provider: str) -> dict:
    prov = svc.channel_providers.get(provider)
    if prov is None:
        raise not_found(f"no channel provider {provider!r}")
    env = bottle.request.environ
    limit = svc.config.max_body_bytes
    signature = ""
    if prov.signature_header:
        signature = env.get("HTTP_" + prov.signature_header.upper().replace("-", "_"), "")

    def raw() -> bytes:  # the body as signed: read (and checked) as JSON, then as bytes
        read_json(limit)
        return bottle.request.body.read(limit + 1)

    return handle_channel_update(
        svc,
        prov,
        channel_secret(svc, prov, env),
        svc.client_addr(env),
        lambda: read_json(limit),
        signature,
        raw,
    )


def verify_webhook(svc: Service, provider: str):
    """GET /channels/webhook/<provider>: the provider's own subscription check."""
    prov = svc.channel_providers.get(provider)
    if prov is None or prov.verify is None:
        raise not_found(f"channel provider {provider!r} has no subscription check")
    return prov.verify(svc)


# -- reminders -----------------------------------------------------------------------------


def list_reminders(svc: Service) -> dict:
    """The reminders not sent yet (⏰ lines and `remind:`), soonest first."""
    limit = query_int("limit", 100, 1, 1000)
    offset = query_int("offset", 0, 0, 10**9)
    sees = request_principal().sees  # a folder grant: its folder's reminders
    pending = [r for r in svc.reminders.upcoming() if sees(r["path"])]
    return {
        "reminders": [
            {
                "id": r["id"],
                "path": r["path"],
                "title": r["title"],
                "line": r["line"],
                "due": iso(r["due"]),
                "local": r["wall"],
            }
            for r in pending[offset : offset + limit]
        ],
        "total": len(pending),
        "limit": limit,
        "offset": offset,
        "timeZone": svc.config.timezone or "system",
    }


# -- plugins -------------------------------------------------------------------------------


def plugin_info(svc: Service, plugin: Plugin) -> dict:
    return {
        "name": plugin.name,
        "version": plugin.version,
        "description": plugin.description,
        "enabled": svc.plugin_enabled(plugin.name),
        "builtin": plugin.builtin,
        "error": plugin.error or svc.plugin_errors.get(plugin.name),
        "hooks": sorted(plugin.hooks),
        "routes": [f"{r.method} {API}/plugins/{plugin.name}{r.path}" for r in plugin.routes],
    }


def _plugin(svc: Service, name: str) -> Plugin:
    plugin = svc.plugins.get(name)
    if plugin is None:
        raise not_found(f"no plugin {name!r}")
    return plugin


def list_plugins(svc: Service) -> dict:
    return {"plugins": [plugin_info(svc, p) for p in svc.plugins.values()]}


def get_plugin(svc: Service, name: str) -> dict:
    """The plugin's record; a plugin's own page (route "") adds its data when it is on."""
    plugin = _plugin(svc, name)
    info = plugin_info(svc, plugin)
    page = next((r for r in plugin.routes if r.method == "GET" and r.path == ""), None)
    who = request_principal()  # a grant sees a page its scope allows, a folder grant a built-in's
    allowed = page and who.allows(page.scope) and (plugin.builtin or not who.folder)
    if allowed and info["enabled"]:
        info.update(page.handler(svc))
    return info


def toggle_plugin(svc: Service, name: str) -> dict:
    plugin = _plugin(svc, name)
    if plugin.error and plugin.name not in svc.plugin_errors:
        raise ApiError(409, "CONFLICT", f"plugin {name} did not load: {plugin.error}")
    enabled = not svc.plugin_enabled(name)
    svc.state.update(lambda data: data.setdefault("plugins", {}).__setitem__(name, enabled))
    svc.plugin_errors.pop(name, None)
    return plugin_info(svc, plugin)


def plugin_routes(plugins: Iterable[Plugin]) -> tuple:
    """Return the Routes of the plugins' own endpoints, each refusing while it is off."""
    routes = []
    for plugin in plugins:
        for r in plugin.routes:
            if r.method == "GET" and r.path == "":
                continue  # served by get_plugin

            def guarded(svc: Service, _name=plugin.name, _handler=r.handler, **kwargs):
                if not svc.plugin_enabled(_name):
                    raise ApiError(403, "PLUGIN_DISABLED", f"plugin {_name} is switched off")
                return _handler(svc, **kwargs)

            guarded.__name__ = re.sub(r"\W+", "_", f"{plugin.name}_{r.handler.__name__}")
            routes.append(
                Route(
                    r.method,
                    f"/plugins/{plugin.name}{r.path}",
                    guarded,
                    summary=r.summary,
                    status=r.status,
                    params=r.params,
                    tag="plugins",
                    scope=r.scope,
                )
            )
    return tuple(routes)


# -- security ------------------------------------------------------------------------------


def security_audit(svc: Service) -> dict:
    return run_audit(svc)


def security_config(svc: Service) -> dict:
    cfg, st = svc.config, svc.state.read()
    channels = st.get("channels", [])
    return {
        "auth": {
            "mode": cfg.auth_mode,
            "header": KEY_HEADER,
            "jwt": {"enabled": cfg.auth_mode == "jwt", "tokenLifetimeSeconds": JWT_LIFETIME},
            "keyCreatedAt": st.get("keyCreatedAt", ""),
            "keyAgeDays": key_age_days(st),
            "keyComparison": "constant-time (SHA-256 digests, hmac.compare_digest)",
        },
        "setup": {
            "complete": bool(st.get("setupComplete")),
            "localOnly": cfg.setup_local_only,
            "linkedClients": len(st.get("linkedClients", [])),
        },
        "network": {"bindHost": cfg.host, **_network_facts(cfg), "pairingMode": cfg.pairing},
        "limits": {
            **_limit_facts(svc),
            "maxQueryChars": MAX_QUERY_CHARS,
            "maxMessageChars": MAX_MESSAGE_CHARS,
        },
        "channels": {
            "count": len(channels),
            "enabled": sum(bool(c["enabled"]) for c in channels),
            "withoutAllowlist": sum(
                1
                for c in channels
                if c["provider"] in svc.channel_providers
                and not c["config"].get(svc.channel_providers[c["provider"]].allow)
            ),
        },
        "plugins": {
            "count": len(svc.plugins),
            "thirdParty": sum(not p.builtin for p in svc.plugins.values()),
            "enabled": sum(svc.plugin_enabled(n) for n in svc.plugins),
        },
        "agent": _agent_facts(cfg),
        "grants": svc.grants.counts(),
    }


def security_recommendations(svc: Service) -> dict:
    return {
        "recommendations": [
            {
                "id": f["id"],
                "severity": f["severity"],
                "title": f["title"],
                "action": f["recommendation"],
            }
            for f in run_audit(svc)["findings"]
            if f["severity"] != "info"
        ]
    }


# -- grants: scoped keys and share links ------------------------------------------------


def _days(body: dict, name: str, hi: int, default: int | None) -> int | None:
    days = body.get(name)
    if days is None:
        return default
    if isinstance(days, float) and days.is_integer():  # JSON Schema's integer: 7.0 is one
        days = int(days)
    if not isinstance(days, int) or isinstance(days, bool) or not 1 <= days <= hi:
        raise bad_request(f"'{name}' must be a whole number from 1 to {hi}")
    return days


def _grant_folder(body: dict) -> str | None:
    """Return the folder of a grant's body (None: every note); `notes` itself is None."""
    raw = field(body, "folder", required=False)
    folder = folder_path(raw) if raw is not None else NOTES
    return None if folder == NOTES else folder


def create_scoped_key(svc: Service) -> dict:
    body = read_json(svc.config.max_body_bytes)
    raw = field(body, "name", max_len=100)
    if is_blank(raw):
        raise bad_request("'name' must not be empty")
    name = _clean_name(raw, "unnamed key")  # control characters never reach a listing
    scope = field(body, "scope")
    if scope not in ("read", "write"):
        raise bad_request("'scope' must be read or write (the API key itself holds admin)")
    folder = _grant_folder(body)
    record, key = svc.grants.create_key(
        name, scope, folder, _days(body, "expiresInDays", 3650, None)
    )
    return {**record, "key": key}


def list_scoped_keys(svc: Service) -> dict:
    return {"keys": svc.grants.grants()}


# -- devices: a phone joins by scanning a code (CONTRACT 23) ---------------------------


def qr_svg(text: str) -> str | None:
    """Return text as a QR code in SVG (segno, when installed; else None)."""
    try:
        import segno
    except ImportError:
        return None
    out = io.BytesIO()  # a whole SVG document (with its namespace): it also works as an <img>
    segno.make(text, error="m").save(
        out, kind="svg", xmldecl=False, nl=False, scale=5, border=2, dark="#111"
    )
    return out.getvalue().decode("utf-8")


def pairing_origin(config: Config, state: dict, environ: dict | None) -> str:
    """Return the origin a pairing's link opens: SERVICE_PUBLIC_URL's, else the server's
    own origin on its relay, else the request's (outside a request: the address the
    banner gives phones)."""
    url = config.public_url or relay_origin_of(config, state)
    if not url:
        url = base_url_of(config, environ) if environ is not None else phone_url(config)
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def new_pairing(
    config: Config, grants: GrantStore, name: str, scope: str, folder: str | None, environ
) -> dict:
    """Make a pairing; return {id, name, scope, folder, createdAt, expiresAt, secret,
    url[, qrSvg]}: the secret travels only in the link's fragment."""
    if scope not in SCOPES:
        raise bad_request("'scope' must be read, write or admin")
    if scope == "admin" and folder:
        raise bad_request("an admin device sees every note: leave out 'folder', or choose write")
    record, secret = grants.create_pairing(name, scope, folder, config.pairing_ttl)
    url = f"{pairing_origin(config, grants.state.read(), environ)}/#pair={secret}"
    answer = {**record, "secret": secret, "url": url}
    svg = qr_svg(url)
    if svg:
        answer["qrSvg"] = svg
    return answer


def create_pairing(svc: Service) -> dict:
    body = read_json(svc.config.max_body_bytes)
    name = _clean_name(field(body, "name", required=False, max_len=100), "device")
    scope = field(body, "scope", required=False) or "write"
    folder = _grant_folder(body)
    return new_pairing(svc.config, svc.grants, name, scope, folder, bottle.request.environ)


def claim_device(svc: Service) -> dict:
    """POST /auth/devices/claim (public): a pairing's secret for a device key, once.

    Failures count toward the lockout like wrong keys. The secret is refused in a URL,
    where logs and proxies keep it.
    """
    env = bottle.request.environ
    if "secret" in bottle.request.query or "pair" in bottle.request.query:
        raise bad_request("send the pairing secret in the JSON body, never in the URL")
    addr = svc.client_addr(env)
    svc.check_lockout(addr)
    body = read_json(svc.config.max_body_bytes)
    secret = field(body, "secret", max_len=64)
    name = _clean_name(field(body, "deviceName", required=False, max_len=100), "")
    found = svc.grants.claim(secret, name) if len(secret) <= 64 else None
    if found is None:
        svc.lockout.fail(addr)
        raise not_found("this pairing code is unknown, used or expired: make a new one")
    svc.lockout.succeed(addr)
    record, key = found
    return {
        "key": key,
        "deviceId": record["id"],
        "device": record,
        "apiBase": svc.issuer(env) + API,
    }


def revoke_scoped_key(svc: Service, grant_id: str) -> dict:
    if not svc.grants.revoke(grant_id):
        raise not_found(f"no key or OAuth grant {grant_id}")
    return {"id": grant_id, "revoked": True}


def share_url(svc: Service, environ: dict, token: str) -> str:
    """Return a share link: in relay mode on the server's relay origin (or {relay}/r/<id>),
    else <base>/s/<token>."""
    if svc.config.pairing == "relay":
        return f"{svc.relay_base(environ)}/s/{token}"
    return f"{svc.issuer(environ)}/s/{token}"


def create_share(svc: Service) -> dict:
    body = read_json(svc.config.max_body_bytes)
    path = visible_note(svc.notes, field(body, "path"))
    days = _days(body, "expiresInDays", 365, 7)
    if not svc.notes.exists(path):
        raise not_found(f"no note at {path}")
    record, token = svc.grants.create_share(path, days, request_principal())
    log.info("share link %s created for a note", record["id"])
    return {**record, "url": share_url(svc, bottle.request.environ, token)}


def list_shares(svc: Service) -> dict:
    return {"shares": svc.grants.shares(request_principal())}


def revoke_share(svc: Service, share_id: str) -> dict:
    if not svc.grants.revoke_share(share_id, request_principal()):
        raise not_found(f"no share link {share_id}")
    return {"id": share_id, "revoked": True}


def _public_limit(svc: Service) -> str:
    """Count one public grant request from its address; 429 over the limits."""
    addr = svc.client_addr(bottle.request.environ)
    wait = svc.grants.share_misses.retry_after(addr) or svc.grants.public_hits.hit(addr)
    if wait:
        raise ApiError(
            429,
            "RATE_LIMITED",
            f"too many requests from this address; retry in {wait} s",
            {"Retry-After": str(wait)},
        )
    return addr


def _shared_note(svc: Service, token: str) -> tuple:
    """Return (the shared note's record, whom the link reads as). A link made by a grant
    reads as that grant: only while the note is in its folder, only what it may see."""
    addr = _public_limit(svc)
    bottle.response.set_header("X-Robots-Tag", "noindex, nofollow")
    bottle.response.set_header("Referrer-Policy", "no-referrer")
    found = svc.grants.shared(token)
    if found is None:
        svc.grants.share_misses.fail(addr)
        raise not_found("nothing is shared at this link (it may have expired or been revoked)")
    share, reader = found
    try:
        return svc.notes.get(visible_note(svc.notes, share["path"], reader)), reader
    except ApiError as e:
        if e.status_code == 404:
            raise not_found("the shared note no longer exists") from None
        raise


def _readable_attachments(svc: Service, rec: dict, reader: Principal) -> dict:
    """Return {href: attachment path} of the attachments a share link of rec may load: the
    ones it links, that the link's reader may see."""
    found = {}
    for href, path in shared_attachments(rec["path"], rec["content"]).items():
        with contextlib.suppress(ApiError):
            found[href] = visible_attachment(svc.attachments, path, reader)
    return found


def shared_attachments(path: str, text: str) -> dict:
    """Return {href as written: attachment path} of the attachments a note at `path` links
    by Markdown link or image: all a share link of it may load."""
    found = {}
    for m in _MDLINK_RE.finditer(text[:MAX_SCAN_CHARS]):
        target = _md_target(m.group(2))
        href = urllib.parse.unquote(target.strip("<>")) if target else ""
        if not href or "://" in href or href.startswith("mailto:"):
            continue
        if href.startswith("/"):
            candidate = href.lstrip("/")
        else:
            candidate = posixpath.normpath(posixpath.join(posixpath.dirname(path), href))
        if candidate.startswith(f"{ATTACHMENTS}/"):
            with contextlib.suppress(ApiError):
                found[m.group(2).strip("<>")] = attachment_path(candidate)  # as the page sees it
    return found


def get_shared(svc: Service, token: str) -> dict:
    rec, reader = _shared_note(svc, token)
    return {
        "title": rec["title"],
        "content": rec["content"],
        "modified": rec["modified"],
        "attachments": _readable_attachments(svc, rec, reader),
    }


def get_shared_attachment(svc: Service, token: str, path: str):
    """An attachment the shared note links (no other) and its link's reader may see, as
    GET /attachments/:path serves it."""
    rec, reader = _shared_note(svc, token)
    if path not in _readable_attachments(svc, rec, reader).values():
        raise not_found("the shared note links no such attachment")
    return get_attachment(svc, path)


def get_share_page(svc: Service, token: str):
    bottle.response.content_type = "text/html; charset=utf-8"
    for name, value in share_page_headers().items():
        bottle.response.set_header(name, value)
    return share_page()


# -- OAuth for MCP clients ---------------------------------------------------------------
#
# notesvc is its own authorisation server (RFC 8414, 9728, 7591, 7636, 8707, 7009); its
# tokens are good for the MCP endpoint only. These endpoints answer in OAuth's own JSON.


def _oauth_answer(body: dict, status: int = 200, headers: dict | None = None) -> bytes:
    bottle.response.status = status
    bottle.response.content_type = JSON_TYPE
    for name, value in {
        "Cache-Control": "no-store",
        "Pragma": "no-cache",
        **(headers or {}),
    }.items():
        bottle.response.set_header(name, value)
    return to_json(body)


def _oauth_failure(e: OAuthError) -> bytes:
    return _oauth_answer(
        {"error": e.error, "error_description": e.description}, e.status, e.headers
    )


def mcp_resource(svc: Service, environ: dict) -> str:
    return svc.issuer(environ) + API + "/mcp"


def oauth_issuers(svc: Service, environ: dict) -> dict:
    """Return {MCP resource: issuer} a request may grant for: its own, and on the server's
    own relay origin also the relay's path-based one, whose authorisation page now
    redirects there (connectors set up before per-server origins keep their URLs)."""
    issuer = svc.issuer(environ)
    found = {issuer + API + "/mcp": issuer}
    if environ.get("notesvc.relay_origin"):
        old = f"{svc.config.relay_url}/r/{svc.state.read()['serverId']}"
        found[old + API + "/mcp"] = old
    return found


def protected_resource_metadata(svc: Service) -> bytes:
    """RFC 9728 metadata of the MCP endpoint."""
    env = bottle.request.environ
    issuer = svc.issuer(env)
    return _oauth_answer(
        {
            "resource": mcp_resource(svc, env),
            "authorization_servers": [issuer],
            "scopes_supported": list(OAUTH_SCOPES),
            "bearer_methods_supported": ["header"],
            "resource_name": "notesvc",
        }
    )


def authorization_server_metadata(svc: Service) -> bytes:
    """RFC 8414 metadata of this authorisation server (also served as OpenID's name)."""
    issuer = svc.issuer(bottle.request.environ)
    return _oauth_answer(
        {
            "issuer": issuer,
            "authorization_endpoint": f"{issuer}/oauth/authorize",
            "token_endpoint": f"{issuer}/oauth/token",
            "registration_endpoint": f"{issuer}/oauth/register",
            "revocation_endpoint": f"{issuer}/oauth/revoke",
            "response_types_supported": ["code"],
            "grant_types_supported": ["authorization_code", "refresh_token"],
            "code_challenge_methods_supported": ["S256"],
            "token_endpoint_auth_methods_supported": ["none"],
            "revocation_endpoint_auth_methods_supported": ["none"],
            "scopes_supported": list(OAUTH_SCOPES),
            "client_id_metadata_document_supported": True,
            "authorization_response_iss_parameter_supported": True,
        }
    )


def _form(max_bytes: int = 65536) -> dict:
    """Return a form-encoded body's parameters; OAuthError for anything else or a repeat."""
    req = bottle.request
    if req.content_type.split(";")[0].strip().lower() != "application/x-www-form-urlencoded":
        raise OAuthError("invalid_request", "send the parameters form-encoded")
    if req.content_length > max_bytes:
        raise OAuthError("invalid_request", f"the body is over {max_bytes} bytes", 413)
    raw = req.body.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise OAuthError("invalid_request", f"the body is over {max_bytes} bytes", 413)
    try:
        pairs = urllib.parse.parse_qsl(
            raw.decode("utf-8"), keep_blank_values=True, max_num_fields=40
        )
    except (UnicodeDecodeError, ValueError):
        raise OAuthError("invalid_request", "the body is not a UTF-8 form") from None
    params: dict = {}
    for name, value in pairs:
        if name in params:
            raise OAuthError("invalid_request", f"'{name[:40]}' is given twice")
        params[name] = value
    basic = request_header("Authorization", "")
    if basic[:6].lower() == "basic " and "client_id" not in params:  # a client id sent that way
        with contextlib.suppress(ValueError, UnicodeDecodeError):
            decoded = base64.b64decode(basic[6:].strip(), validate=True).decode("utf-8")
            params["client_id"] = urllib.parse.unquote(decoded.partition(":")[0])
    return params


def oauth_token(svc: Service) -> bytes:
    """POST /oauth/token: authorization_code (PKCE S256) and refresh_token grants."""
    try:
        p = _form()
        grant_type = p.get("grant_type", "")
        if grant_type == "authorization_code":
            answer = svc.grants.redeem(
                p.get("code", ""),
                p.get("client_id", ""),
                p.get("redirect_uri", ""),
                p.get("code_verifier", ""),
                p.get("resource"),
            )
        elif grant_type == "refresh_token":
            if not p.get("client_id"):
                raise OAuthError("invalid_request", "client_id is required")
            answer = svc.grants.refresh(
                p.get("refresh_token", ""), p["client_id"], p.get("resource"), p.get("scope")
            )
        elif not grant_type:
            raise OAuthError("invalid_request", "grant_type is required")
        else:
            raise OAuthError(
                "unsupported_grant_type", "grant_type: authorization_code or refresh_token"
            )
    except OAuthError as e:
        return _oauth_failure(e)
    return _oauth_answer(answer)


def oauth_register(svc: Service) -> bytes:
    """POST /oauth/register: Dynamic Client Registration of a public client (RFC 7591)."""
    try:
        try:
            meta = read_json(65536)
        except ApiError as e:
            raise OAuthError("invalid_client_metadata", e.message, e.status_code) from None
        answer = svc.grants.register_client(meta, svc.client_addr(bottle.request.environ))
    except OAuthError as e:
        return _oauth_failure(e)
    return _oauth_answer(answer, 201)


def oauth_revoke(svc: Service) -> bytes:
    """POST /oauth/revoke (RFC 7009): the token's whole grant ends; unknown tokens are fine."""
    try:
        p = _form()
        if not p.get("token"):
            raise OAuthError("invalid_request", "token is required")
    except OAuthError as e:
        return _oauth_failure(e)
    svc.grants.revoke_token(p["token"], p.get("client_id", ""))
    return _oauth_answer({})


def get_consent_page(svc: Service):
    bottle.response.content_type = "text/html; charset=utf-8"
    for name, value in consent_page_headers().items():
        bottle.response.set_header(name, value)
    return consent_page()


def _check_client(svc: Service, client_id: Any, redirect_uri: Any) -> dict:
    """Return the client of an authorisation request; 404 / 400 saying what is wrong.

    These are shown on the consent page and never redirected to.
    """
    try:
        return svc.grants.check_request(client_id, redirect_uri)
    except OAuthError as e:
        if e.error == "invalid_client" and "registered" in e.description:
            raise not_found(e.description) from None
        raise bad_request(e.description) from None


def _error_redirect(
    redirect_uri: str, error: str, description: str, state: str, issuer: str
) -> str:
    params = {"error": error, "error_description": description, "iss": issuer}
    if state:
        params["state"] = state
    sep = "&" if urllib.parse.urlsplit(redirect_uri).query else "?"
    return redirect_uri + sep + urllib.parse.urlencode(params)


def oauth_consent(svc: Service) -> dict:
    """GET /api/v1/oauth/consent: what the consent page shows for an authorisation request."""
    _public_limit(svc)
    env = bottle.request.environ
    q = {
        name: query_str(name)
        for name in (
            "client_id",
            "redirect_uri",
            "response_type",
            "state",
            "code_challenge",
            "code_challenge_method",
            "scope",
            "resource",
        )
    }
    client = _check_client(svc, q["client_id"], q["redirect_uri"])
    issuers = oauth_issuers(svc, env)
    resource = q["resource"] if q["resource"] in issuers else mcp_resource(svc, env)
    issuer = issuers[resource]
    problem = ""
    if q["response_type"] != "code":
        problem = "response_type must be code"
    elif q["code_challenge_method"] != "S256":
        problem = "PKCE is required: code_challenge_method=S256"
    elif not CHALLENGE_RE.match(q["code_challenge"]):
        problem = "code_challenge must be 43 base64url characters (S256)"
    elif q["resource"] and q["resource"] != resource:
        problem = f"this server's MCP resource is {resource}"
    elif len(q["state"]) > 1024:
        problem = "state is longer than 1024 characters"
    if problem:  # the client is known and its redirect URI registered: tell it there
        err = bad_request(problem)
        err.extra = {
            "redirect": _error_redirect(
                q["redirect_uri"], "invalid_request", problem, q["state"][:1024], issuer
            )
        }
        raise err
    write = svc.config.mcp_write
    return {
        "client": {"id": client["id"], "name": client["name"], "uri": client.get("uri") or ""},
        "redirectUri": q["redirect_uri"],
        "redirectHost": urllib.parse.urlsplit(q["redirect_uri"]).netloc,
        "scope": "write" if write and parse_oauth_scope(q["scope"]) == "write" else "read",
        "writeAllowed": write,
        "resource": resource,
        "deny": _error_redirect(
            q["redirect_uri"], "access_denied", "the owner denied the request", q["state"], issuer
        ),
    }


def approve_oauth(svc: Service) -> dict:
    """POST /api/v1/oauth/approve (the owner): an authorisation code for the client."""
    body = read_json(svc.config.max_body_bytes)
    env = bottle.request.environ
    client_id = field(body, "clientId", max_len=2000)
    redirect_uri = field(body, "redirectUri", max_len=2000)
    state = field(body, "state", required=False, max_len=1024) or ""
    challenge = field(body, "codeChallenge", max_len=128)
    scope = field(body, "scope", max_len=200)
    resource = field(body, "resource", required=False, max_len=2000) or mcp_resource(svc, env)
    folder = _grant_folder(body)
    client = _check_client(svc, client_id, redirect_uri)
    if not CHALLENGE_RE.match(challenge):
        raise bad_request("'codeChallenge' must be 43 base64url characters (PKCE S256)")
    words = set(scope.split())
    if not words or not words <= set(OAUTH_SCOPES):
        raise bad_request("'scope' must be notes:read or notes:read notes:write")
    wanted = parse_oauth_scope(scope)
    if wanted == "write" and not svc.config.mcp_write:
        raise ApiError(403, "FORBIDDEN", "notes:write needs SERVICE_MCP_WRITE=true on the server")
    issuers = oauth_issuers(svc, env)
    if resource not in issuers:
        raise bad_request(f"'resource' must be this server's MCP URL, {mcp_resource(svc, env)}")
    grant = {"challenge": challenge, "scope": wanted, "folder": folder, "resource": resource}
    redirect = svc.grants.approve(client, redirect_uri, grant, state, issuers[resource])
    log.info("OAuth request of %s approved (%s)", log_safe(client["name"], 100), wanted)
    return {"redirect": redirect}


# -- relay pairing (this server as its own relay) -------------------------------------


def pair_relay_code(svc: Service, code: str) -> dict:
    st = svc.state.read()
    if not hmac.compare_digest(code.lower().encode(), st["relayCode"].encode()):
        raise not_found("no server is paired under this relay code")
    relay = svc.relay_base(bottle.request.environ)
    return {"serverId": st["serverId"], "relayApiBase": f"{relay}{API}"}


# -- WebDAV: the notes folder in other apps (CONTRACT 25) -------------------------------------
# /dav/notes/... and /dav/attachments/... for Obsidian (Remotely Save), Markor, Joplin,
# rclone, Finder, Windows and davfs2. Every write goes through the stores: a `.md` file
# under notes/ is a note (history with reason "dav", the index, the change feed, the trash);
# any other file a client puts there (an image beside a note, a .canvas, a dot-folder of
# settings) is kept byte for byte where it was put. Locks live in memory; dead properties in
# the state folder.

DAV_PREFIX = "/dav"
DAV_TOPS = (NOTES, ATTACHMENTS)
DAV_READ = frozenset({"OPTIONS", "PROPFIND", "GET", "HEAD"})
DAV_METHODS = (
    "OPTIONS",
    "PROPFIND",
    "PROPPATCH",
    "GET",
    "HEAD",
    "PUT",
    "DELETE",
    "MKCOL",
    "COPY",
    "MOVE",
    "LOCK",
    "UNLOCK",
)
DAV_MAX_XML = 1 << 20  # a PROPFIND, PROPPATCH or LOCK body
DAV_LOCK_SECONDS = 600  # a lock asked for without a timeout (or an infinite one)
DAV_LOCK_MAX_SECONDS = 3600  # clients refresh what they keep longer
DAV_LOCKS_MAX = 10000
DAV_LOCKS_PER_KEY = 100  # one key's locks at once (the owner's too)
DAV_LOCKS_PER_PATH = 16  # shared locks on one resource
DAV_PROPS_PER_PATH = 100  # dead properties: how many a resource keeps...
DAV_PROPS_BYTES_PER_PATH = 64 * 1024  # ...in how many characters...
DAV_PROPS_PATHS = 10000  # ...on how many resources...
DAV_PROPS_BYTES = 8 << 20  # ...and in how many characters in all
XML_TYPE = "application/xml; charset=utf-8"
NOTE_TYPE = "text/markdown; charset=utf-8"
_DAV_LIVE = (
    "displayname",
    "resourcetype",
    "getcontentlength",
    "getcontenttype",
    "getetag",
    "getlastmodified",
    "creationdate",
    "supportedlock",
    "lockdiscovery",
)
_DOCTYPE_RE = re.compile(rb"<!(DOCTYPE|ENTITY)", re.I)


class DavError(ApiError):
    """A WebDAV failure: its status, and an RFC 4918 precondition element when it has one."""

    def __init__(self, status: int, message: str, condition: str = "", headers: dict | None = None):
        super().__init__(status, STATUS_CODES.get(status, "VALIDATION_ERROR"), message, headers)
        self.condition = condition


@dataclasses.dataclass
class DavLock:
    token: str
    path: str  # the locked resource ("" is the root)
    depth: str  # "0" or "infinity"
    owner: str  # the client's <owner> element, as XML
    seconds: int
    expires: float
    holder: str  # who took it (a grant id, "owner"): only they may refresh or unlock it
    scope: str = "exclusive"  # or "shared": shared locks live together, never with another

    def covers(self, path: str) -> bool:
        return path == self.path or (
            self.depth == "infinity" and (not self.path or path.startswith(self.path + "/"))
        )


class DavState:
    """What WebDAV keeps beside the stores: locks (in memory), dead properties (a JSON file
    in the state folder), the store of other files under notes/, and an ETag cache of notes
    (by their stat, so a listing reads each note once until it changes)."""

    def __init__(self, svc: Service):
        self.files = svc.note_files  # the other files under notes/, with the notes' trash
        self.grants = svc.grants  # a revoked key's locks end with it
        self.props_file = svc.config.state_dir / "dav-properties.json"
        self.lock = threading.RLock()
        self.locks: dict = {}
        self.etags: dict = {}
        try:
            self.props = json.loads(self.props_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            self.props = {}

    # -- locks ------------------------------------------------------------------------

    def live_locks(self) -> list:
        """The locks held now: not expired, and their key not revoked."""
        if not self.locks:
            return []
        now = time.monotonic()
        keys = {g["id"] for g in self.grants.grants()}
        with self.lock:
            for token, lk in list(self.locks.items()):
                if lk.expires <= now or (lk.holder != "owner" and lk.holder not in keys):
                    del self.locks[token]
            return list(self.locks.values())

    def locks_on(self, path: str, below: bool = False) -> list:
        """The locks covering path (and with `below`, those on anything under it)."""
        return [
            lk
            for lk in self.live_locks()
            if lk.covers(path) or (below and (not path or lk.path.startswith(path + "/")))
        ]

    # -- dead properties ----------------------------------------------------------------

    def props_of(self, path: str) -> dict:
        with self.lock:
            return dict(self.props.get(path, {}))

    def _save_props(self) -> None:
        atomic_write(self.props_file, to_json(self.props))

    def set_props(self, path: str, changes: list) -> None:
        with self.lock:
            kept = dict(self.props.get(path, {}))
            for name, xml in changes:
                if xml is None:
                    kept.pop(name, None)
                else:
                    kept[name] = xml
            size = sum(len(k) + len(v) for k, v in kept.items())
            if len(kept) > DAV_PROPS_PER_PATH or size > DAV_PROPS_BYTES_PER_PATH:
                raise DavError(
                    507,
                    f"a resource keeps at most {DAV_PROPS_PER_PATH} properties of "
                    f"{DAV_PROPS_BYTES_PER_PATH // 1024} KiB in all",
                )
            if len(self.props) >= DAV_PROPS_PATHS and path not in self.props:
                raise DavError(507, f"properties are kept for {DAV_PROPS_PATHS} resources at most")
            before = sum(len(k) + len(x) for k, x in self.props.get(path, {}).items())
            if self.props_bytes - before + size > DAV_PROPS_BYTES:
                raise DavError(507, f"properties are kept up to {DAV_PROPS_BYTES >> 20} MiB in all")
            if kept:
                self.props[path] = kept
            else:
                self.props.pop(path, None)
            self._save_props()

    def props_room(self, src: str) -> None:
        """507 when a copy of src (and what is below it) would pass the properties' bounds."""
        with self.lock:
            carried = [v for p, v in self.props.items() if p == src or p.startswith(src + "/")]
            size = sum(len(k) + len(x) for v in carried for k, x in v.items())
            if carried and (
                len(self.props) + len(carried) > DAV_PROPS_PATHS
                or self.props_bytes + size > DAV_PROPS_BYTES
            ):
                raise DavError(507, "no room left for the properties this copy would carry")

    @property
    def props_bytes(self) -> int:
        return sum(len(k) + len(x) for v in self.props.values() for k, x in v.items())

    def carry_props(self, src: str, dst: str, keep_source: bool) -> None:
        """A move (or copy) of src to dst takes its properties and its children's along."""
        with self.lock:
            moved = {p: v for p, v in self.props.items() if p == src or p.startswith(src + "/")}
            if not moved:
                return
            for p, v in moved.items():
                if not keep_source:
                    del self.props[p]
                self.props[dst + p[len(src) :]] = dict(v)
            self._save_props()

    def drop_locks(self, path: str) -> None:
        """A resource deleted or moved away takes its locks (and those below it) along."""
        with self.lock:
            for token, lk in list(self.locks.items()):
                if lk.path == path or lk.path.startswith(path + "/"):
                    del self.locks[token]

    def drop_props(self, path: str) -> None:
        with self.lock:
            gone = [p for p in self.props if p == path or p.startswith(path + "/")]
            for p in gone:
                del self.props[p]
            if gone:
                self._save_props()

    def note_etag(self, file: Path, st: os.stat_result) -> str:
        key = (str(file), st.st_mtime_ns, st.st_size, st.st_ino)
        found = self.etags.get(key[0])
        if found and found[0] == key:
            return found[1]
        with open(file, "rb") as f:
            etag = make_etag(f.read())
        if len(self.etags) > 100000:
            self.etags.clear()
        self.etags[key[0]] = (key, etag)
        return etag


def dav_state(svc: Service) -> DavState:
    state = getattr(svc, "_dav", None)
    if state is None:
        with _DAV_START:
            state = getattr(svc, "_dav", None) or DavState(svc)
            svc._dav = state
    return state


_DAV_START = threading.Lock()


# -- what a /dav/ path names ------------------------------------------------------------------


@dataclasses.dataclass
class DavItem:
    path: str  # "" (the root), "notes", "notes/a/b.md", "attachments/x.png"
    file: str | None  # on disk (None: the root)
    st: os.stat_result | None  # None: nothing there

    @property
    def top(self) -> str:
        return self.path.split("/", 1)[0]

    @property
    def is_dir(self) -> bool:
        if not self.path or self.path in DAV_TOPS:
            return True
        return self.st is not None and stat.S_ISDIR(self.st.st_mode)

    @property
    def exists(self) -> bool:
        return not self.path or self.path in DAV_TOPS or self.st is not None

    @property
    def is_note(self) -> bool:
        return dav_is_note(self.path)


def dav_is_note(path: str) -> bool:
    """A `.md` file under notes/ outside any dot-folder is a note; anything else is a file."""
    segments = path.split("/")
    return (
        segments[0] == NOTES
        and len(segments) > 1
        and path.endswith(".md")
        and segments[-1] != ".md"
        and not any(s.startswith(".") for s in segments)
    )


def dav_checked(raw: str) -> str:
    """Return a /dav/ path (decoded, NFC, no trailing slash), checked by the note path rules,
    except that dot-names are allowed (an Obsidian vault's .obsidian/); 403 otherwise."""
    path = unicodedata.normalize("NFC", raw).strip("/")
    if not path:
        return ""
    segments = path.split("/")
    if segments[0] not in DAV_TOPS:
        raise DavError(
            404, f"nothing at /dav/{path[:MAX_PATH_CHARS]}: only notes/ and attachments/"
        )
    if len(segments) == 1:
        return path
    shown = "/".join(
        "_" + s[1:] if s.startswith(".") and s not in (".", "..") else s for s in segments
    )
    try:
        _check_segments(shown, "WebDAV", segments[0])
    except ApiError as e:
        raise DavError(403, e.message) from None
    return path


def dav_item(svc: Service, path: str) -> DavItem:
    """Return what is at a checked path; a symbolic link anywhere on the way is 403."""
    if not path:
        return DavItem("", None, None)
    base = str(svc.notes.base)
    file = str(svc.notes.on_disk(path)) if path.startswith(NOTES) else f"{base}/{path}"
    top = f"{base}/{path.split('/', 1)[0]}"
    at = top
    for part in file[len(top) + 1 :].split("/") if len(file) > len(top) else ():
        at = f"{at}/{part}"
        if os.path.islink(at):
            raise DavError(403, f"/dav/{path} leads through a symbolic link")
    try:
        st = os.stat(file)  # (attachments/ before the first upload: None, a folder all the same)
    except (FileNotFoundError, NotADirectoryError):
        st = None
    if st is not None and not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        raise DavError(403, f"/dav/{path} is neither a file nor a folder")
    return DavItem(path, file, st)


def dav_grant_sees(principal: Principal, path: str, write: bool = False) -> bool:
    """A folder grant sees its folders (notes/<f>, attachments/<f>) and what is inside; the
    folders above them only as the way there, and it writes nothing outside."""
    if not principal.folder:
        return True
    own = (principal.folder, principal.attachments_folder)
    inside = any(path.startswith(f + "/") for f in own)
    if write:  # (its folder itself too: a new folder key's first MKCOL makes it)
        return inside or path in own
    return inside or path in own or any(not path or f.startswith(path + "/") for f in own)


@functools.lru_cache(maxsize=4096)
def _quoted_folder(path: str) -> str:
    return urllib.parse.quote(path)


def dav_href(script: str, path: str, folder: bool) -> str:
    """The URL path of a resource (a folder's ends in /); a folder's part is quoted once for
    all its entries."""
    parent, _, name = path.rpartition("/")
    quoted = (
        f"{_quoted_folder(parent)}/{urllib.parse.quote(name)}" if parent else _quoted_folder(path)
    )
    href = f"{script}{DAV_PREFIX}/{quoted}"
    return href + "/" if folder and path else href


# -- reading XML: no DTD, no entities, a bounded size ----------------------------------------


def dav_body(limit: int = DAV_MAX_XML) -> bytes:
    read, _ = request_body_reader(limit, "the WebDAV XML limit (1 MiB)")
    parts, size = [], 0
    while chunk := read(BODY_CHUNK):
        parts.append(chunk)
        size += len(chunk)
    return b"".join(parts)


DAV_XML_DEPTH = 32  # elements within elements: a property's value, an owner


def dav_xml(body: bytes):
    """Return the parsed XML body (None when empty); 400 for a DTD or an entity declaration
    (refused in any encoding, before anything is expanded or fetched), for XML nested
    deeper than DAV_XML_DEPTH and for XML that is not well formed."""
    if not body.strip():
        return None
    if _DOCTYPE_RE.search(body):  # (UTF-8 and ASCII: refused before the parser starts)
        raise DavError(400, "XML with a DTD or entity declarations is not accepted")
    import xml.etree.ElementTree as ET  # (only WebDAV reads XML: imported on first use)
    import xml.parsers.expat

    def refuse(*_args) -> None:
        raise DavError(400, "XML with a DTD or entity declarations is not accepted")

    # A first pass with expat's own handlers: a DTD stops it where it starts, in whatever
    # encoding the body is (UTF-16 hides "<!DOCTYPE" from the check above), so ElementTree
    # below only ever reads XML without one.
    scan = xml.parsers.expat.ParserCreate()
    scan.StartDoctypeDeclHandler = refuse
    scan.EntityDeclHandler = refuse
    scan.ExternalEntityRefHandler = refuse
    try:
        scan.Parse(body, True)
        root = ET.fromstring(body)  # noqa: S314 - no DTD (refused above)
    except (xml.parsers.expat.ExpatError, ET.ParseError) as e:
        raise DavError(400, f"the XML body is not well formed: {e}") from None
    level = [(root, 1)]
    while level:  # (iteratively: a deep body must not reach a recursive step)
        elem, depth = level.pop()
        if depth > DAV_XML_DEPTH:
            raise DavError(400, f"the XML body is nested deeper than {DAV_XML_DEPTH} elements")
        level.extend((child, depth + 1) for child in elem)
    return root


def _dav_name(tag: str) -> tuple:
    """('DAV:', 'getetag') from '{DAV:}getetag'; ('', 'x') for an element in no namespace."""
    if tag.startswith("{"):
        ns, _, local = tag[1:].partition("}")
        return ns, local
    return "", tag


def _xml_of(elem) -> str:
    import xml.etree.ElementTree as ET

    elem.tail = None
    return ET.tostring(elem, encoding="unicode")


def _xesc(text: str) -> str:
    """Text as XML character data or an attribute value."""
    return (
        text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")
    )


def _empty_prop(tag: str) -> str:
    ns, local = _dav_name(tag)
    if ns == "DAV:":
        return f"<D:{local}/>"
    if not ns:
        return f'<{local} xmlns=""/>'
    quoted = _xesc(ns).replace("\n", "&#10;").replace("\r", "&#13;").replace("\t", "&#9;")
    return f'<X:{local} xmlns:X="{quoted}"/>'


# -- properties ---------------------------------------------------------------------------------


def _http_date(ts: float) -> str:
    """RFC 9110's date (its English names whatever the locale)."""
    t = time.gmtime(ts)
    day = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")[t.tm_wday]
    month = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
    clock = f"{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d}"
    return f"{day}, {t.tm_mday:02d} {month[t.tm_mon - 1]} {t.tm_year} {clock} GMT"


_SUPPORTED_LOCK = "<D:supportedlock>{}</D:supportedlock>".format(
    "".join(
        f"<D:lockentry><D:lockscope><D:{scope}/></D:lockscope>"
        "<D:locktype><D:write/></D:locktype></D:lockentry>"
        for scope in ("exclusive", "shared")
    )
)


def dav_live(dav: DavState, item: DavItem, name: str) -> str | None:
    """Return the XML of a live property of item (None when it has no such property)."""
    st = item.st
    folder = st is None or stat.S_ISDIR(st.st_mode) if item.path not in DAV_TOPS else True
    if name == "displayname":
        return f"<D:displayname>{_xesc(item.path.rsplit('/', 1)[-1])}</D:displayname>"
    if name == "resourcetype":
        return "<D:resourcetype><D:collection/></D:resourcetype>" if folder else "<D:resourcetype/>"
    if name == "supportedlock":
        return _SUPPORTED_LOCK
    if name == "lockdiscovery":
        return dav_lockdiscovery(dav.locks_on(item.path))
    if st is None:
        return None
    if name == "getlastmodified":
        return f"<D:getlastmodified>{_http_date(st.st_mtime)}</D:getlastmodified>"
    if name == "creationdate":
        return f"<D:creationdate>{iso(min(st.st_ctime, st.st_mtime))}</D:creationdate>"
    if folder:
        return None
    if name == "getcontentlength":
        return f"<D:getcontentlength>{st.st_size}</D:getcontentlength>"
    if name == "getcontenttype":
        kind = NOTE_TYPE if item.path.endswith(".md") else content_type_of(item.path)
        return f"<D:getcontenttype>{kind}</D:getcontenttype>"
    if name == "getetag":
        try:
            return f"<D:getetag>{_xesc(dav_etag(dav, item))}</D:getetag>"
        except OSError:  # deleted while the listing was made
            return None
    return None


def dav_etag(dav: DavState, item: DavItem) -> str:
    """The API's ETag: a note's is its content's, a file's its attachment ETag."""
    if item.is_note:
        return dav.note_etag(item.file, item.st)
    return attachment_etag(item.st)


def dav_propstat(found: list, missing: list) -> str:
    out = []
    if found:
        out.append(
            "<D:propstat><D:prop>" + "".join(found) + "</D:prop>"
            "<D:status>HTTP/1.1 200 OK</D:status></D:propstat>"
        )
    if missing:
        out.append(
            "<D:propstat><D:prop>" + "".join(missing) + "</D:prop>"
            "<D:status>HTTP/1.1 404 Not Found</D:status></D:propstat>"
        )
    return "".join(out)


def dav_response(href: str, inner: str) -> str:
    return f"<D:response><D:href>{_xesc(href)}</D:href>{inner}</D:response>"


def dav_multistatus(parts: Iterable[str]) -> bytes:
    body = (
        '<?xml version="1.0" encoding="utf-8"?>\n<D:multistatus xmlns:D="DAV:">'
        + "".join(parts)
        + "</D:multistatus>"
    )
    bottle.response.status = 207
    bottle.response.content_type = XML_TYPE
    return body.encode("utf-8")


def dav_shown_name(name: str) -> bool:
    """Whether a name on disk can be listed: UTF-8 (a name that is not comes decoded with
    surrogates) and no control characters."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return not any(ord(c) < 32 or 0x7F <= ord(c) < 0xA0 for c in name)


def dav_children(svc: Service, item: DavItem, principal: Principal) -> list:
    """Return the items in a folder the grant may see (the root: notes/ and attachments/)."""
    out = []
    if not item.path:
        for top in DAV_TOPS:
            if dav_grant_sees(principal, top):
                out.append(dav_item(svc, top))
        return out
    try:
        with os.scandir(item.file) as found:
            entries = sorted(found, key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        entries = []
    for e in entries:
        name = e.name
        if name.startswith(TEMP_PREFIX) and name.endswith(TEMP_SUFFIX):
            continue  # a write under way
        if not dav_shown_name(name):
            continue  # a name no path may hold (control characters, bytes that are not UTF-8)
        path = f"{item.path}/{_nfc(name)}"
        if not dav_grant_sees(principal, path):
            continue
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode):  # (no links, pipes)
            out.append(DavItem(path, e.path, st))
    return out


# -- locks and the If header ----------------------------------------------------------------

_IF_LIST_RE = re.compile(r"\s*(?:<([^>]*)>\s*)?\(([^)]*)\)")
_IF_COND_RE = re.compile(r"\s*(Not\s+)?(?:<([^>]*)>|\[([^\]]*)\])", re.I)


def dav_if(svc: Service, dav: DavState, item: DavItem, ctx: dict) -> set:
    """Evaluate the If header (RFC 4918 10.4) for the request; 412 when it is false. Return
    the lock tokens it names (a write on a locked resource needs its token among them)."""
    header = request_header("If")
    if not header:
        return set()
    tokens, lists, rest = set(), [], header.strip()
    while rest:
        m = _IF_LIST_RE.match(rest)
        if not m:
            raise DavError(400, "the If header is not understood")
        conds, inner = [], m.group(2)
        while inner.strip():
            c = _IF_COND_RE.match(inner)
            if not c:
                raise DavError(400, "the If header is not understood")
            negate, token, etag = bool(c.group(1)), c.group(2), c.group(3)
            if token is not None:
                tokens.add(token)
            conds.append((negate, token, etag))
            inner = inner[c.end() :]
        lists.append((m.group(1), conds))
        rest = rest[m.end() :].strip()

    def holds(target: DavItem, negate: bool, token: str | None, etag: str | None) -> bool:
        if token is not None:
            ok = any(lk.token == token for lk in dav.locks_on(target.path))
        else:
            ok = target.exists and not target.is_dir and etag == dav_etag(dav, target)
        return ok != negate

    def resource(tag: str | None) -> DavItem:
        if tag is None:
            return item
        path = urllib.parse.urlsplit(tag).path
        prefix = f"{ctx['script']}{DAV_PREFIX}"
        nothing = DavItem("\0", None, None)  # another server's, or one this key cannot see
        if not path.startswith(prefix):
            return nothing
        try:
            checked = dav_checked(urllib.parse.unquote(path[len(prefix) :]))
            return dav_item(svc, checked) if dav_grant_sees(ctx["principal"], checked) else nothing
        except ApiError:
            return nothing

    if not any(all(holds(resource(tag), *c) for c in conds) for tag, conds in lists):
        raise DavError(412, "the If header's conditions do not hold")
    return tokens


def dav_unlocked(dav: DavState, path: str, tokens: set, below: bool = False) -> None:
    """423 when a lock covers path (or with `below`, anything under it) and its token was
    not given (of shared locks on one resource, one of their tokens)."""
    locks = dav.locks_on(path, below)
    if any(lk.scope == "exclusive" and lk.token not in tokens for lk in locks):
        raise DavError(423, f"/dav/{path} is locked", "lock-token-submitted")
    shared = {}
    for lk in locks:
        if lk.scope == "shared":
            shared.setdefault(lk.path, set()).add(lk.token)
    if any(not (held & tokens) for held in shared.values()):
        raise DavError(423, f"/dav/{path} is locked", "lock-token-submitted")


def dav_lockdiscovery(locks: list) -> str:
    active = "".join(dav_activelock(lk) for lk in locks)
    return f"<D:lockdiscovery>{active}</D:lockdiscovery>"


def dav_activelock(lk: DavLock) -> str:
    root = f"{bottle.request.environ.get('SCRIPT_NAME', '')}{DAV_PREFIX}/" + urllib.parse.quote(
        lk.path
    )
    left = max(0, int(lk.expires - time.monotonic()))
    return (
        "<D:activelock><D:locktype><D:write/></D:locktype>"
        f"<D:lockscope><D:{lk.scope}/></D:lockscope>"
        f"<D:depth>{lk.depth}</D:depth>{lk.owner}"
        f"<D:timeout>Second-{left}</D:timeout>"
        f"<D:locktoken><D:href>{lk.token}</D:href></D:locktoken>"
        f"<D:lockroot><D:href>{_xesc(root)}</D:href></D:lockroot>"
        "</D:activelock>"
    )


def _lock_seconds() -> int:
    for part in (request_header("Timeout") or "").split(","):
        part = part.strip()
        if part.lower().startswith("second-") and part[7:].isdigit():
            return max(1, min(int(part[7:]), DAV_LOCK_MAX_SECONDS))
    return DAV_LOCK_SECONDS


# -- writing through the stores ---------------------------------------------------------------


def dav_store(svc: Service, dav: DavState, path: str):
    """The store of a file that is not a note: attachments/ or the other files of notes/."""
    return svc.attachments if path.startswith(ATTACHMENTS + "/") else dav.files


def dav_parent_ready(svc: Service, path: str) -> None:
    """409 when the folder a new resource goes into is not there (RFC 4918 9.7.1)."""
    parent = path.rsplit("/", 1)[0]
    if parent in DAV_TOPS:
        return
    got = dav_item(svc, parent)
    if not got.exists or not got.is_dir:
        raise DavError(409, f"/dav/{parent}/ is not a folder: create it first (MKCOL)")


def dav_keep_folder(item: DavItem) -> None:
    """The stores remove a folder a delete or move left empty; a WebDAV client made it and
    expects it to stay."""
    folder = os.path.dirname(item.file)
    if "/" in item.path and not os.path.exists(folder):
        with disk_writes():
            os.makedirs(folder, exist_ok=True)


def dav_write_file(
    svc: Service, dav: DavState, path: str, read: Callable, if_match=None, if_none_match=None
) -> tuple:
    """Write a resource from read(n) -> bytes; return (etag, created)."""
    if dav_is_note(path):
        data, size = [], 0
        while chunk := read(BODY_CHUNK):
            data.append(chunk)
            size += len(chunk)
        try:
            text = b"".join(data).decode("utf-8")
        except UnicodeDecodeError:
            raise DavError(415, f"/dav/{path} is a note: its bytes must be UTF-8 text") from None
        if svc.notes.exists(path):
            if if_none_match is not None and if_none_match.strip() == "*":
                raise DavError(412, f"a note exists at /dav/{path} (If-None-Match: *)")
            rec = svc.notes.update(path, text, if_match, reason="dav")
            return rec["etag"], False
        if if_match is not None:
            raise DavError(412, f"no note at /dav/{path} to match If-Match")
        return svc.notes.create(path, text)["etag"], True
    store = dav_store(svc, dav, path)
    if path.startswith(ATTACHMENTS + "/") and not path.rsplit("/", 1)[-1].startswith("."):
        try:
            attachment_path(path)
        except ApiError as e:
            raise DavError(403, e.message) from None

    def copy(f) -> None:
        while chunk := read(BODY_CHUNK):
            f.write(chunk)

    rec, created = store.place(store.spool(copy), path, if_match, if_none_match)
    return rec["etag"], created


def dav_delete(svc: Service, dav: DavState, item: DavItem) -> None:
    """Delete a resource into the trash (a folder: everything in it, each restorable)."""
    if item.is_dir:
        for child in dav_children(svc, item, OWNER):
            dav_delete(svc, dav, child)
        with contextlib.suppress(OSError), disk_writes():
            os.rmdir(item.file)
    elif item.is_note:
        svc.notes.delete(item.path)
    else:
        dav_store(svc, dav, item.path).delete(item.path)
    dav.drop_props(item.path)


def dav_can_place(svc: Service, src: DavItem, dst: str, depth: str) -> None:
    """Refuse a copy or move before it starts: each file it would write must be one its new
    place takes (a note: UTF-8, the body limit; under attachments/: an attachment's
    extension; any file: the attachment limit), so it never stops halfway."""
    if src.is_dir:
        for child in dav_children(svc, src, OWNER) if depth != "0" else ():
            name = child.path.rsplit("/", 1)[-1]
            dav_can_place(svc, child, dav_checked(f"{dst}/{name}"), depth)
        return
    size, note = src.st.st_size, dav_is_note(dst)
    limit = svc.config.max_body_bytes if note else svc.config.max_attachment_bytes
    if size > limit:
        raise DavError(413, f"/dav/{src.path} is over {limit} bytes, the limit at /dav/{dst}")
    if note and not src.is_note:
        with open(src.file, "rb") as f:
            try:
                f.read().decode("utf-8")
            except UnicodeDecodeError:
                raise DavError(
                    415, f"/dav/{dst} would be a note: its bytes must be UTF-8"
                ) from None
    if dst.startswith(ATTACHMENTS + "/") and not dst.rsplit("/", 1)[-1].startswith("."):
        try:
            attachment_path(dst)
        except ApiError as e:
            raise DavError(403, e.message) from None


def dav_copy(svc: Service, dav: DavState, src: DavItem, dst: str, move: bool, depth: str):
    """Copy or move src to dst (not there: the caller made room)."""
    if src.is_dir:
        with disk_writes():
            os.makedirs(svc.notes.on_disk(dst), exist_ok=True)
        if depth != "0" or move:
            for child in dav_children(svc, src, OWNER):
                name = child.path.rsplit("/", 1)[-1]
                dav_copy(svc, dav, child, f"{dst}/{name}", move, depth)
        if move:
            with contextlib.suppress(OSError), disk_writes():
                os.rmdir(src.file)
    elif move and src.is_note and dav_is_note(dst):
        svc.notes.move(src.path, dst)
    elif move and not src.is_note and not dav_is_note(dst) and src.top == dst.split("/")[0]:
        dav_store(svc, dav, src.path).move(src.path, dst)
    else:
        with open(src.file, "rb") as f:
            dav_write_file(svc, dav, dst, f.read, if_none_match="*")
        if move:
            dav_delete(svc, dav, src)
            return
    dav.carry_props(src.path, dst, keep_source=not move)


# -- the methods ------------------------------------------------------------------------------


def dav_options(svc: Service, dav: DavState, item: DavItem, ctx: dict):
    resp = bottle.response
    resp.set_header("DAV", "1, 2")
    resp.set_header("MS-Author-Via", "DAV")
    resp.set_header("Allow", ", ".join(DAV_METHODS))
    resp.set_header("Content-Length", "0")
    resp.content_type = "text/plain; charset=utf-8"
    return b""


def dav_propfind(svc: Service, dav: DavState, item: DavItem, ctx: dict):
    depth = (request_header("Depth") or "infinity").strip().lower()
    if depth not in ("0", "1"):
        raise DavError(
            403, "PROPFIND with Depth: infinity is not served: ask Depth 1", "propfind-finite-depth"
        )
    root = dav_xml(dav_body())
    mode, wanted = "allprop", []
    if root is not None:
        if root.tag != "{DAV:}propfind":
            raise DavError(400, "a PROPFIND body is a DAV:propfind element")
        for child in root:
            if child.tag == "{DAV:}propname":
                mode = "propname"
            elif child.tag == "{DAV:}prop":
                mode, wanted = "prop", [(c.tag, *_dav_name(c.tag)) for c in child]
    if not item.exists:
        raise DavError(404, f"nothing at /dav/{item.path}")
    items = [item]
    if depth == "1" and item.is_dir:
        items += dav_children(svc, item, ctx["principal"])
    script = ctx["script"]
    return dav_multistatus(
        dav_response(dav_href(script, i.path, i.is_dir), dav_props(dav, i, mode, wanted))
        for i in items
    )


def dav_props(dav: DavState, item: DavItem, mode: str, wanted: list) -> str:
    dead = dav.props_of(item.path) if dav.props else {}
    if mode == "propname":
        names = [f"<D:{n}/>" for n in _DAV_LIVE if dav_live(dav, item, n) is not None]
        return dav_propstat(names + [_empty_prop(t) for t in dead], [])
    if mode == "allprop":
        found = [x for n in _DAV_LIVE if (x := dav_live(dav, item, n)) is not None]
        return dav_propstat(found + list(dead.values()), [])
    found, missing = [], []
    for tag, ns, local in wanted:
        value = dav_live(dav, item, local) if ns == "DAV:" else None
        if value is None:
            value = dead.get(tag)
        (found if value is not None else missing).append(value or _empty_prop(tag))
    return dav_propstat(found, missing)


def dav_proppatch(svc: Service, dav: DavState, item: DavItem, ctx: dict):
    if not item.exists:
        raise DavError(404, f"nothing at /dav/{item.path}")
    dav_unlocked(dav, item.path, ctx["tokens"])
    root = dav_xml(dav_body())
    if root is None or root.tag != "{DAV:}propertyupdate":
        raise DavError(400, "a PROPPATCH body is a DAV:propertyupdate element")
    changes, refused = [], []
    for op in root:
        if op.tag not in ("{DAV:}set", "{DAV:}remove"):
            continue
        for prop in op.findall("{DAV:}prop"):
            for elem in prop:
                if _dav_name(elem.tag)[0] == "DAV:":
                    refused.append(elem.tag)  # the live properties are the server's
                elif op.tag == "{DAV:}set":
                    changes.append((elem.tag, _xml_of(elem)))
                else:
                    changes.append((elem.tag, None))
    names = [t for t, _ in changes] + refused
    if refused:  # all or nothing (RFC 4918 9.2)
        inner = (
            "<D:propstat><D:prop>" + "".join(_empty_prop(t) for t in refused) + "</D:prop>"
            "<D:status>HTTP/1.1 403 Forbidden</D:status>"
            "<D:error><D:cannot-modify-protected-property/></D:error></D:propstat>"
        )
        others = [t for t, _ in changes]
        if others:
            inner += (
                "<D:propstat><D:prop>" + "".join(_empty_prop(t) for t in others) + "</D:prop>"
                "<D:status>HTTP/1.1 424 Failed Dependency</D:status></D:propstat>"
            )
    else:
        dav.set_props(item.path, changes)
        inner = dav_propstat([_empty_prop(t) for t in dict.fromkeys(names)], [])
    return dav_multistatus([dav_response(dav_href(ctx["script"], item.path, item.is_dir), inner)])


def dav_get(svc: Service, dav: DavState, item: DavItem, ctx: dict):
    if not item.exists:
        raise DavError(404, f"nothing at /dav/{item.path}")
    if item.is_dir:
        raise DavError(
            405,
            "a folder has no content: list it with PROPFIND",
            headers={
                "Allow": "OPTIONS, PROPFIND, PROPPATCH, DELETE, MKCOL, COPY, MOVE, LOCK, UNLOCK"
            },
        )
    resp, data = bottle.response, None
    if item.is_note:  # read once: its ETag and its bytes are of the same version
        with open(item.file, "rb") as f:
            data = f.read()
        etag, size = make_etag(data), len(data)
    else:
        etag, size = attachment_etag(item.st), item.st.st_size
    kind = NOTE_TYPE if item.path.endswith(".md") else content_type_of(item.path)
    none_match = request_header("If-None-Match")
    if none_match and (
        "*" in none_match or etag in {t.strip().removeprefix("W/") for t in none_match.split(",")}
    ):
        resp.status = 304
        resp.set_header("ETag", etag)
        return b""
    first, last, status = 0, size - 1, 200
    wanted, if_range = request_header("Range"), request_header("If-Range")
    if wanted and size and (if_range is None or if_range.strip() == etag):
        found = byte_range(wanted, size)
        if found:
            (first, last), status = found, 206
            resp.set_header("Content-Range", f"bytes {first}-{last}/{size}")
    resp.status = status
    resp.content_type = kind
    for name, value in (
        ("ETag", etag),
        ("Last-Modified", _http_date(item.st.st_mtime)),
        ("Accept-Ranges", "bytes"),
        ("Content-Length", str(max(0, last - first + 1))),
        ("Content-Disposition", content_disposition(item.path, kind)),
        ("Content-Security-Policy", ATTACHMENT_CSP),
    ):
        resp.set_header(name, value)
    if ctx["method"] == "HEAD":
        return b""
    if data is not None:
        return data[first : last + 1]
    f = open(item.file, "rb")  # noqa: SIM115 - closed by _file_chunks
    f.seek(first)
    return _file_chunks(f, last - first + 1)


def dav_put(svc: Service, dav: DavState, item: DavItem, ctx: dict):
    if not item.path or item.path in DAV_TOPS or item.is_dir:
        raise DavError(405, "a folder cannot be written: PUT a file into it")
    if request_header("Content-Range"):
        raise DavError(400, "PUT writes a whole file: Content-Range is not accepted")
    dav_parent_ready(svc, item.path)
    dav_unlocked(dav, item.path, ctx["tokens"])
    note = dav_is_note(item.path)
    limit = svc.config.max_body_bytes if note else svc.config.max_attachment_bytes
    setting = "SERVICE_MAX_BODY_BYTES" if note else "SERVICE_MAX_ATTACHMENT_BYTES"
    read, _ = request_body_reader(limit, setting)
    etag, created = dav_write_file(
        svc, dav, item.path, read, _if_match(), request_header("If-None-Match")
    )
    bottle.response.status = 201 if created else 204
    bottle.response.set_header("ETag", etag)
    return b""


def dav_delete_method(svc: Service, dav: DavState, item: DavItem, ctx: dict):
    if not item.path or item.path in DAV_TOPS:
        raise DavError(403, "notes/ and attachments/ themselves cannot be deleted")
    if not item.exists:
        raise DavError(404, f"nothing at /dav/{item.path}")
    if item.is_dir and (request_header("Depth") or "infinity").lower() != "infinity":
        raise DavError(400, "a folder is deleted whole: Depth: infinity")
    if request_header("If-Match") and not item.is_dir:
        _check_etag(_if_match(), dav_etag(dav, item), "file")
    dav_unlocked(dav, item.path, ctx["tokens"], below=True)
    dav_delete(svc, dav, item)
    dav.drop_locks(item.path)  # (RFC 4918 9.6.1)
    if item.is_dir and os.path.lexists(item.file):
        raise DavError(409, f"/dav/{item.path}/ holds files whose names no path may hold")
    dav_keep_folder(item)
    bottle.response.status = 204
    return b""


def dav_mkcol(svc: Service, dav: DavState, item: DavItem, ctx: dict):
    if dav_body(DAV_MAX_XML):
        raise DavError(415, "MKCOL takes no body")
    if item.exists:
        raise DavError(405, f"/dav/{item.path} already exists")
    dav_parent_ready(svc, item.path)
    dav_unlocked(dav, item.path.rsplit("/", 1)[0], ctx["tokens"])
    with disk_writes():
        os.makedirs(os.path.dirname(item.file), exist_ok=True)  # attachments/ itself, at first
        os.mkdir(item.file)
    fsync_dir(Path(os.path.dirname(item.file)))
    bottle.response.status = 201
    return b""


def dav_destination(svc: Service, ctx: dict) -> str:
    """Return the checked path a COPY or MOVE goes to: this server, under /dav/."""
    raw = request_header("Destination") or ""
    if not raw:
        raise DavError(400, "COPY and MOVE need a Destination header")
    url = urllib.parse.urlsplit(raw)
    host = bottle.request.environ.get("HTTP_HOST", "")
    if url.netloc and url.netloc.lower() != host.lower():
        raise DavError(502, "the Destination is on another server")
    prefix = f"{ctx['script']}{DAV_PREFIX}/"
    if not url.path.startswith(prefix) or re.search(r"%2f|%5c|%00", url.path, re.I):
        raise DavError(403, f"the Destination must be a path under {prefix}")
    try:
        path = urllib.parse.unquote(url.path[len(prefix) :], errors="strict")
    except UnicodeDecodeError:
        raise DavError(403, "the Destination is not UTF-8") from None
    return dav_checked(path)


def dav_copy_move(svc: Service, dav: DavState, item: DavItem, ctx: dict):
    move = ctx["method"] == "MOVE"
    if not item.path or item.path in DAV_TOPS:
        raise DavError(403, "notes/ and attachments/ themselves cannot be copied or moved")
    if not item.exists:
        raise DavError(404, f"nothing at /dav/{item.path}")
    dst = dav_destination(svc, ctx)
    principal = ctx["principal"]
    if not dav_grant_sees(principal, dst, write=True):
        raise DavError(403, "this key may not write there")
    if not dst or dst in DAV_TOPS or dst == item.path or dst.startswith(item.path + "/"):
        raise DavError(403, "a resource cannot be copied or moved onto itself or into itself")
    if item.path.startswith(dst + "/"):
        raise DavError(403, "a resource cannot replace the folder that holds it")
    depth = (request_header("Depth") or "infinity").lower()
    if depth not in ("0", "infinity") or (move and depth != "infinity"):
        raise DavError(400, "Depth is 0 or infinity (a MOVE: infinity)")
    overwrite = (request_header("Overwrite") or "T").strip().upper()
    if move:
        dav_unlocked(dav, item.path, ctx["tokens"], below=True)
    dav_unlocked(dav, dst, ctx["tokens"], below=True)
    dav_parent_ready(svc, dst)
    target = dav_item(svc, dst)
    if target.exists and overwrite == "F":
        raise DavError(412, f"/dav/{dst} exists and Overwrite is F")
    dav_can_place(svc, item, dst, depth)  # before anything changes, the target included
    if not move:
        dav.props_room(item.path)
    if target.exists:
        dav_delete(svc, dav, target)
    dav_copy(svc, dav, item, dst, move, depth)
    if move:
        dav.drop_locks(item.path)  # (RFC 4918 9.9.4)
        dav_keep_folder(item)
    bottle.response.status = 204 if target.exists else 201
    return b""


def dav_lock(svc: Service, dav: DavState, item: DavItem, ctx: dict):
    root = dav_xml(dav_body())
    seconds = _lock_seconds()
    if root is None:  # a refresh: the If header names the lock
        found = [lk for lk in dav.locks_on(item.path) if lk.token in ctx["tokens"]]
        if not found:
            raise DavError(
                412, "a refresh names the lock in the If header", "lock-token-matches-request-uri"
            )
        for lk in found:
            lk.seconds, lk.expires = seconds, time.monotonic() + seconds
        return dav_lock_answer(found[0], 200)
    if root.tag != "{DAV:}lockinfo":
        raise DavError(400, "a LOCK body is a DAV:lockinfo element")
    scope = root.find("{DAV:}lockscope")
    shared = scope is not None and scope.find("{DAV:}shared") is not None
    owner = root.find("{DAV:}owner")
    depth = (request_header("Depth") or "infinity").lower()
    if depth not in ("0", "infinity"):
        raise DavError(400, "a lock's Depth is 0 or infinity")
    if not item.path or item.path in DAV_TOPS:
        raise DavError(403, "notes/ and attachments/ themselves cannot be locked")
    with dav.lock:
        held = dav.locks_on(item.path, below=depth == "infinity")
        if any(not shared or lk.scope == "exclusive" for lk in held):
            raise DavError(423, f"/dav/{item.path} is locked", "no-conflicting-lock")
        if len(held) >= DAV_LOCKS_PER_PATH:
            raise DavError(423, f"/dav/{item.path} holds {len(held)} locks: no more")
        every = dav.live_locks()
        if sum(lk.holder == ctx["holder"] for lk in every) >= DAV_LOCKS_PER_KEY:
            raise DavError(507, f"this key holds {DAV_LOCKS_PER_KEY} locks: unlock some first")
        if len(every) >= DAV_LOCKS_MAX:
            raise DavError(503, "too many locks are held: try again later")
        created = False
        if not item.exists:  # an unmapped URL: locked as an empty file (RFC 4918 7.3)
            dav_parent_ready(svc, item.path)
            dav_write_file(svc, dav, item.path, lambda n: b"", if_none_match="*")
            created = True
        lk = DavLock(
            token=f"urn:uuid:{uuid.uuid4()}",
            path=item.path,
            depth=depth,
            owner=dav_owner(owner) if owner is not None else "",
            seconds=seconds,
            expires=time.monotonic() + seconds,
            holder=ctx["holder"],
            scope="shared" if shared else "exclusive",
        )
        dav.locks[lk.token] = lk
    bottle.response.set_header("Lock-Token", f"<{lk.token}>")
    return dav_lock_answer(lk, 201 if created else 200)


def dav_owner(owner) -> str:
    """The <D:owner> a client gave, as XML (its inside kept as sent)."""
    import xml.etree.ElementTree as ET

    inner = _xesc(owner.text or "") + "".join(ET.tostring(c, encoding="unicode") for c in owner)
    return f"<D:owner>{inner}</D:owner>"


def dav_lock_answer(lk: DavLock, status: int) -> bytes:
    bottle.response.status = status
    bottle.response.content_type = XML_TYPE
    return (
        '<?xml version="1.0" encoding="utf-8"?>\n<D:prop xmlns:D="DAV:">'
        + dav_lockdiscovery([lk])
        + "</D:prop>"
    ).encode("utf-8")


def dav_unlock(svc: Service, dav: DavState, item: DavItem, ctx: dict):
    token = (request_header("Lock-Token") or "").strip().strip("<>")
    with dav.lock:
        lk = dav.locks.get(token)
        if lk is None or not lk.covers(item.path):
            raise DavError(409, "no such lock on this resource", "lock-token-matches-request-uri")
        if lk.holder != ctx["holder"] and not ctx["principal"].allows("admin"):
            raise DavError(403, "the lock was taken by another key")  # (the owner may end it)
        del dav.locks[token]
    bottle.response.status = 204
    return b""


DAV_HANDLERS = {
    "OPTIONS": dav_options,
    "PROPFIND": dav_propfind,
    "PROPPATCH": dav_proppatch,
    "GET": dav_get,
    "HEAD": dav_get,
    "PUT": dav_put,
    "DELETE": dav_delete_method,
    "MKCOL": dav_mkcol,
    "COPY": dav_copy_move,
    "MOVE": dav_copy_move,
    "LOCK": dav_lock,
    "UNLOCK": dav_unlock,
}


def dav_authenticate(svc: Service, env: dict) -> Principal:
    """Basic (any user name, the password a key) or Bearer; failures count toward the
    lockout; a 401 asks for Basic."""
    auth = env.get("HTTP_AUTHORIZATION", "")
    key = ""
    if auth[:6].lower() == "basic ":
        try:
            key = (
                base64.b64decode(auth[6:].strip(), validate=True).decode("utf-8").partition(":")[2]
            )
        except (ValueError, UnicodeDecodeError):
            key = "\0"  # presented and wrong
    elif auth[:7].lower() == "bearer ":
        key = auth[7:].strip()
    checked = {
        **env,
        "HTTP_X_SERVICE_KEY": key or env.get("HTTP_X_SERVICE_KEY", ""),
        "HTTP_AUTHORIZATION": "",
    }
    try:
        return svc.authenticate(checked)
    except ApiError as e:
        if e.status_code == 401:
            raise DavError(
                401,
                "a key is needed: any user name, the key as the password",
                headers={"WWW-Authenticate": 'Basic realm="notesvc", charset="UTF-8"'},
            ) from None
        raise


def dav_callback(svc: Service) -> Callable:
    """The one entry of /dav/: the path checked, who asks, what they may do, the If header,
    then the method; every failure a short plain answer (an XML one for a precondition)."""

    def callback(path: str = ""):
        env = bottle.request.environ
        method = env.get("REQUEST_METHOD", "GET").upper()
        try:
            return dav_answer(svc, env, method, path)
        except DavError as e:
            return dav_error(e)
        except ApiError as e:
            if e.status_code == 400 and method != "PUT":
                e = DavError(400, e.message)
            return dav_error(e)
        except bottle.HTTPResponse:
            raise
        except Exception:
            rid = env.get("notesvc.request_id", "-")
            log.exception("request %s failed in WebDAV %s", rid, method)
            return dav_error(DavError(500, f"internal error; request id {rid}"))

    return callback


def dav_answer(svc: Service, env: dict, method: str, raw: str):
    if method == "OPTIONS":
        return dav_options(svc, None, None, {})
    principal = dav_authenticate(svc, env)
    env["notesvc.principal"] = principal
    if "#" in env.get("REQUEST_URI", ""):  # a fragment never names a resource of its own
        raise DavError(400, "the URL holds a fragment (#): send the path alone")
    write = method not in DAV_READ
    if write and not principal.allows("write"):
        raise DavError(403, f"this key is {principal.scope}-only")
    path = dav_checked(raw)
    if not dav_grant_sees(principal, path, write=write and method != "UNLOCK"):
        if write and dav_grant_sees(principal, path):
            raise DavError(403, "this key may not write here")
        raise DavError(404, f"nothing at /dav/{path}")
    dav = dav_state(svc)
    item = dav_item(svc, path)
    script = env.get("SCRIPT_NAME", "")
    ctx = {"method": method, "principal": principal, "script": script}
    ctx["holder"] = dav_holder(principal)
    tokens = dav_if(svc, dav, item, ctx) if write or request_header("If") else set()
    # a token counts for the key that took the lock only (lockdiscovery shows it to all)
    ctx["tokens"] = {
        t for t in tokens if (lk := dav.locks.get(t)) is None or lk.holder == ctx["holder"]
    }
    return DAV_HANDLERS[method](svc, dav, item, ctx)


def dav_holder(principal: Principal) -> str:
    """Who holds a lock: "owner" for the API key, else the key's grant id."""
    return principal.grant_id or "owner"


def dav_error(e: ApiError) -> bottle.HTTPResponse:
    condition = getattr(e, "condition", "")
    headers = {k: v for k, v in e.headers.items() if k.lower() not in ("content-type",)}
    if condition:
        body = (
            f'<?xml version="1.0" encoding="utf-8"?>\n<D:error xmlns:D="DAV:">'
            f"<D:{condition}/><D:responsedescription>{_xesc(e.message)}"
            "</D:responsedescription></D:error>"
        )
        headers["Content-Type"] = XML_TYPE
    else:
        body = e.message + "\n"
        headers["Content-Type"] = "text/plain; charset=utf-8"
    return bottle.HTTPResponse(body.encode("utf-8"), e.status_code, headers)


# -- the built-in web client (GET /) ----------------------------------------------------


def get_web_client(svc: Service):
    bottle.response.content_type = "text/html; charset=utf-8"
    for name, value in web_client_headers().items():
        bottle.response.set_header(name, value)
    return web_client_page()


# -- route table --------------------------------------------------------------------


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
    scope: str = ""  # read, write or admin (CONTRACT 21); a protected route without one
    # stops the app from starting
    jsonrpc: bool = False  # answers JSON-RPC 2.0, errors too; callers checked by
    # authenticate_mcp, which also takes OAuth access tokens (the MCP endpoint only)
    idempotent: bool = False  # an Idempotency-Key header makes a repeat answer as the first

    @property
    def rule(self) -> str:
        return (API if self.api else "") + self.path


def web_asset_route(path: str) -> Route:
    """Return the public route of one of the page's assets (manifest, icons)."""

    def get_asset(svc: Service) -> bytes:
        for name, value in web_asset_headers(path).items():
            bottle.response.set_header(name, value)
        return WEB_ASSETS[path][1]()

    get_asset.__name__ = "get_" + re.sub(r"\W+", "_", path.strip("/"))
    media = WEB_ASSETS[path][0]
    return Route("GET", path, get_asset, public=True, api=False, tag="pages", media=media)


def share_target_without_worker(svc: Service) -> bytes:
    """POST /share-target reaches the server only where no service worker took it (the
    option "Keep notes on this device" is off): the page is sent back to say so. The
    shared text is not kept: this request carries no key."""
    bottle.response.status = 303
    bottle.response.set_header("Location", "./?share=off")
    bottle.response.set_header("Cache-Control", "no-store")
    return b""


def get_openapi(svc: Service):
    bottle.response.content_type = JSON_TYPE
    return to_json(openapi_document(svc, svc.base_url(bottle.request.environ)))


def _obj(required: Iterable[str] = (), **props: dict) -> dict:
    return {"type": "object", "required": list(required), "properties": props}


_STR = {"type": "string"}
_NOTE_PATH, _FOLDER_PATH = NOTE_PATH_SCHEMA, FOLDER_PATH_SCHEMA
_VERSION_ID = {
    "type": "string",
    "pattern": VERSION_ID_RE.pattern,
    "description": "from .../versions",
}
_TRASH_ID = {"type": "string", "pattern": TRASH_ID_RE.pattern, "description": "from /trash"}


def _int(lo: int, hi: int, default: int) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi, "default": default}


_DEPTH = {"type": "integer", "minimum": 1, "maximum": 64}


def _channel_body(svc: Service) -> dict:
    """Return the schema of a channel's create body: one shape per registered provider."""

    def prop(f: ConfigField) -> dict:
        if f.kind == "list":
            return {"type": "array", "items": {"type": ["string", "integer"]}, "maxItems": 1000}
        if f.kind == "boolean":
            return {"type": "boolean"}
        if f.kind == "choice":
            return {"enum": list(f.choices)}
        if f.kind == "folder":
            return {**FOLDER_PATH_SCHEMA, "maxLength": MAX_CONFIG_CHARS}
        # printable and single-line on the server; said here as printable ASCII, and a
        # required one not blank
        return {
            "type": "string",
            "minLength": int(f.required),
            "maxLength": MAX_CONFIG_CHARS,
            "pattern": "^[ -~]*[!-~][ -~]*$" if f.required else "^[ -~]*$",
        }

    def config(provider: ChannelProvider) -> dict:
        props = {f.name: prop(f) for f in provider.fields}
        required = [f.name for f in provider.fields if f.required]
        return {**_obj(required, **props), "additionalProperties": False}

    return {
        "oneOf": [
            _obj(
                ["provider", "config"] if any(f.required for f in p.fields) else ["provider"],
                provider={"const": name},
                name={"type": "string", "maxLength": 100},
                config=config(p),
            )
            for name, p in sorted(svc.channel_providers.items())
        ]
    }


ROUTES = (
    Route("GET", "/health", get_health, public=True, summary="Liveness and version"),
    Route("GET", "/system/setup", get_setup, public=True, summary="Setup and pairing payload"),
    Route("GET", "/system/info", get_info, summary="Version, uptime, note counts", scope="admin"),
    Route(
        "GET",
        "/system/config",
        get_config,
        summary="Non-secret runtime configuration",
        scope="admin",
    ),
    Route(
        "GET",
        "/openapi.json",
        get_openapi,
        public=True,
        summary="This document",
        enveloped=False,
    ),
    Route("POST", "/auth/verify", verify_key, summary="Check a key", tag="auth", scope="read"),
    Route(
        "POST",
        "/auth/link",
        link_client,
        summary="Link a client; completes setup",
        body=_obj(clientName={"type": "string", "maxLength": 100}),
        tag="auth",
        scope="admin",
    ),
    Route(
        "POST",
        "/auth/rotate",
        rotate_api_key,
        summary="New key, shown once",
        tag="auth",
        key_only=True,
        scope="admin",
    ),
    Route(
        "POST",
        "/auth/token",
        issue_token,
        summary="A one-hour JWT (jwt mode)",
        tag="auth",
        key_only=True,
        scope="admin",
    ),
    Route(
        "POST",
        "/notes",
        create_note,
        summary="Create a note (409 if it exists); without a path, named from its title in "
        "`folder` (notes/inbox by default)",
        body=_obj(["content"], path=_NOTE_PATH, content=_STR, folder=_FOLDER_PATH),
        idempotent=True,
        status=201,
        tag="notes",
        scope="write",
    ),
    Route(
        "GET",
        "/notes",
        list_notes,
        summary="List notes by path, or newest first; with titles, previews and tags",
        params={
            "folder": _FOLDER_PATH,
            "limit": _int(1, 1000, 100),
            "offset": _int(0, 10**9, 0),
            "sort": {"enum": ["path", "modified"], "default": "path"},
            "fields": {
                "type": "string",
                "pattern": "^((title|preview|modified|tags)(,(title|preview|modified|tags))*)?$",
            },
        },
        tag="notes",
        scope="read",
    ),
    # before GET /notes/<path:path>, which would take ".../versions" as part of a path
    Route(
        "GET",
        "/notes/<path:path>/versions",
        list_versions,
        summary="A note's versions, newest first (also of a deleted note)",
        params={"path": NOTE_PATH_PARAM, "limit": _int(1, 1000, 100), "offset": _int(0, 10**9, 0)},
        tag="history",
        scope="read",
    ),
    Route(
        "GET",
        "/notes/<path:path>/versions/<version_id>",
        get_version,
        summary="One version with its content",
        params={"path": NOTE_PATH_PARAM, "version_id": _VERSION_ID},
        tag="history",
        scope="read",
    ),
    Route(
        "GET",
        "/notes/<path:path>/versions/<version_id>/diff",
        diff_version,
        summary="Unified diff from a version to another one or to the current note",
        params={
            "path": NOTE_PATH_PARAM,
            "version_id": _VERSION_ID,
            "against": {
                "type": "string",
                "pattern": f"^(current|{VERSION_ID_RE.pattern[1:-1]})$",
                "default": "current",
            },
        },
        tag="history",
        scope="read",
    ),
    Route(
        "POST",
        "/notes/<path:path>/versions/<version_id>/restore",
        restore_version,
        summary="Make a version the note's content again (If-Match honoured; recreates a "
        "deleted note); the replaced content becomes a version",
        params={"path": NOTE_PATH_PARAM, "version_id": _VERSION_ID},
        tag="history",
        scope="write",
    ),
    Route(
        "GET",
        "/notes/<path:path>",
        get_note,
        summary="Read a note",
        params={"path": NOTE_PATH_PARAM},
        tag="notes",
        scope="read",
    ),
    Route(
        "PUT",
        "/notes/<path:path>",
        update_note,
        summary="Replace a note's content (If-Match honoured)",
        body=_obj(
            ["content"],
            content=_STR,
            path={
                **_NOTE_PATH,
                "description": "optional, and then the note's own path: PUT never moves "
                "a note (PATCH .../move does)",
            },
        ),
        params={"path": NOTE_PATH_PARAM},
        tag="notes",
        scope="write",
        idempotent=True,
    ),
    Route(
        "POST",
        "/notes/<path:path>/merge",
        merge_note,
        summary="Save an edit made from version `base`: merged three ways with what changed "
        "since; 409 keeps it as a conflict copy",
        body=_obj(
            ["base", "content"],
            base={**_STR, "minLength": 1, "maxLength": 100},
            content=_STR,
            clientName={**_STR, "maxLength": 100},
        ),
        params={"path": NOTE_PATH_PARAM},
        tag="notes",
        scope="write",
        idempotent=True,
    ),
    Route(
        "PATCH",
        "/notes/<path:path>/move",
        move_note,
        summary="Move or rename a note; never overwrites",
        body=_obj(["path"], path=_NOTE_PATH, updateLinks={"type": "boolean"}),
        params={"path": NOTE_PATH_PARAM},
        tag="notes",
        scope="write",
    ),
    Route(
        "DELETE",
        "/notes/<path:path>",
        delete_note,
        summary="Move to trash",
        params={"path": NOTE_PATH_PARAM},
        tag="notes",
        scope="write",
    ),
    Route(
        "GET",
        "/search",
        search_notes,
        summary='Full-text search (BM25): words, "phrases", prefix*, -exclude, OR',
        params={
            "q": {
                "type": "string",
                "minLength": 1,
                "maxLength": MAX_QUERY_CHARS,
                "description": 'words (all must match), "exact phrase", prefix*, -word, '
                "a OR b; at least one word of letters or digits to search for",
            },
            "limit": _int(1, 100, 20),
            "offset": _int(0, 10000, 0),
            "folder": _FOLDER_PATH,
        },
        tag="search",
        scope="read",
    ),
    Route(
        "POST",
        "/agent/chat",
        agent_chat,
        summary="Ask the agent about your notes",
        body=lambda svc: _obj(
            ["message"],
            message={
                "type": "string",
                "minLength": 1,
                "maxLength": MAX_MESSAGE_CHARS,
                "pattern": NOT_BLANK_PATTERN,
            },
            notePath=_NOTE_PATH,
            channel={"enum": sorted(svc.channel_providers)},  # this app's providers
        ),
        tag="agent",
        scope="read",
    ),
    Route(
        "GET",
        "/agent/status",
        agent_status,
        summary="Agent provider and model",
        tag="agent",
        scope="read",
    ),
    Route(
        "POST",
        "/mcp",
        mcp_endpoint,
        summary="MCP (Model Context Protocol) server: the tools over JSON-RPC 2.0; the key "
        "also as Authorization: Bearer or X-API-Key",
        body={
            "type": "object",
            "required": ["jsonrpc", "method"],
            "properties": {
                "jsonrpc": {"const": "2.0"},
                "id": {"type": ["string", "integer"]},
                "method": {"type": "string", "minLength": 1},
                "params": {"type": "object"},
            },
        },
        tag="mcp",
        enveloped=False,
        jsonrpc=True,
        scope="read",  # each write tool needs a grant that may write
    ),
    Route(
        "GET",
        "/attachments",
        list_attachments,
        summary="List attachments by path",
        params={
            "folder": ATTACHMENT_FOLDER_SCHEMA,
            "limit": _int(1, 1000, 100),
            "offset": _int(0, 10**9, 0),
        },
        tag="attachments",
        scope="read",
    ),
    Route(
        "POST",
        "/attachments",
        post_attachment,
        summary="Upload a file (multipart: path, file); never overwrites: a taken name gets -2",
        body=_obj(
            ["path", "file"],
            path=ATTACHMENT_PATH_SCHEMA,
            file={"type": "string", "format": "binary"},
        ),
        body_media="multipart/form-data",
        status=201,
        tag="attachments",
        scope="write",
    ),
    Route(
        "GET",
        "/attachments/<path:path>",
        get_attachment,
        summary="The file's bytes (ETag, Range; HTML and SVG only as downloads)",
        params={"path": ATTACHMENT_PATH_PARAM},
        media="*/*",  # the type of its extension (ATTACHMENT_TYPES)
        enveloped=False,
        tag="attachments",
        scope="read",
    ),
    Route(
        "PUT",
        "/attachments/<path:path>",
        put_attachment,
        summary="Upload the raw bytes: 201 created, 200 replaced (If-Match, If-None-Match: *)",
        body={"type": "string", "format": "binary"},
        body_media="application/octet-stream",
        params={"path": ATTACHMENT_PATH_PARAM},
        status=201,
        tag="attachments",
        scope="write",
        idempotent=True,
    ),
    Route(
        "PATCH",
        "/attachments/<path:path>/move",
        move_attachment,
        summary="Move or rename an attachment (never overwrites); updateLinks rewrites links",
        body=_obj(["path"], path=ATTACHMENT_PATH_SCHEMA, updateLinks={"type": "boolean"}),
        params={"path": ATTACHMENT_PATH_PARAM},
        tag="attachments",
        scope="write",
    ),
    Route(
        "DELETE",
        "/attachments/<path:path>",
        delete_attachment,
        summary="Move an attachment to the trash",
        params={"path": ATTACHMENT_PATH_PARAM},
        tag="attachments",
        scope="write",
    ),
    Route(
        "GET",
        "/reminders",
        list_reminders,
        summary="Reminders not sent yet (⏰ YYYY-MM-DD HH:MM lines, remind: in front matter)",
        params={"limit": _int(1, 1000, 100), "offset": _int(0, 10**9, 0)},
        tag="reminders",
        scope="read",
    ),
    Route(
        "GET",
        "/channels/providers",
        list_channel_providers,
        summary="Channel providers and their config fields",
        tag="channels",
        scope="admin",
    ),
    Route(
        "GET",
        "/channels",
        list_channels,
        summary="Channels (secrets redacted)",
        tag="channels",
        scope="admin",
    ),
    Route(
        "POST",
        "/channels",
        create_channel,
        summary="Create a channel (the only answer showing its secret)",
        body=_channel_body,
        status=201,
        tag="channels",
        scope="admin",
    ),
    Route(
        "POST",
        "/channels/webhook/<provider>",
        receive_webhook,
        public=True,
        summary="Inbound messages (shared secret in X-Service-Channel-Secret or ?secret=)",
        body={"type": "object"},
        tag="channels",
    ),
    Route(
        "POST",
        "/channels/<channel_id>/toggle",
        toggle_channel,
        summary="Switch on/off",
        tag="channels",
        scope="admin",
    ),
    Route(
        "POST",
        "/channels/connect/telegram",
        connect_telegram,
        summary="Connect a Telegram bot: its token checked (getMe), then a one-time code "
        "that connects the first chat to send it",
        body=_obj(
            ["botToken"],
            botToken={**_STR, "pattern": TELEGRAM_TOKEN_RE.pattern},
            name={**_STR, "maxLength": 100},
        ),
        status=201,
        tag="channels",
        scope="admin",
    ),
    Route(
        "POST",
        "/channels/<channel_id>/bind",
        bind_channel,
        summary="A new one-time code: the next Telegram chat to send it becomes the allowed one",
        tag="channels",
        scope="admin",
    ),
    Route(
        "DELETE",
        "/channels/<channel_id>",
        delete_channel,
        summary="Remove",
        tag="channels",
        scope="admin",
    ),
    Route(
        "GET",
        "/channels/<channel_id>",
        get_channel,
        summary="One channel (redacted) with the senders its allowlist refused lately",
        tag="channels",
        scope="admin",
    ),
    Route(
        "PATCH",
        "/channels/<channel_id>",
        patch_channel,
        summary="Change a channel's name or config keys (validated as on create)",
        body={
            "type": "object",
            "minProperties": 1,
            "additionalProperties": False,
            "properties": {
                "name": {**_STR, "minLength": 1, "maxLength": 100, "pattern": NOT_BLANK_PATTERN},
                "config": {"type": "object"},
            },
        },
        tag="channels",
        scope="admin",
    ),
    Route("GET", "/plugins", list_plugins, summary="Plugins", tag="plugins", scope="read"),
    Route(
        "GET",
        "/plugins/<name>",
        get_plugin,
        summary="One plugin (and its page)",
        tag="plugins",
        scope="read",
    ),
    Route(
        "POST",
        "/plugins/<name>/toggle",
        toggle_plugin,
        summary="Switch on/off",
        tag="plugins",
        scope="admin",
    ),
    Route(
        "GET",
        "/security/audit",
        security_audit,
        summary="Scored audit",
        tag="security",
        scope="admin",
    ),
    Route(
        "GET",
        "/security/config",
        security_config,
        summary="Settings in force",
        tag="security",
        scope="admin",
    ),
    Route(
        "GET",
        "/security/recommendations",
        security_recommendations,
        summary="What to fix, most severe first",
        tag="security",
        scope="admin",
    ),
    Route(
        "GET",
        "/folders/tree",
        get_tree,
        summary="Folder tree from the root (`depth`: levels listed; deeper folders get `count`)",
        params={"depth": _DEPTH},
        tag="folders",
        scope="read",
    ),
    Route(
        "GET",
        "/trash",
        list_trash,
        summary="Deleted notes and attachments, the most recent first",
        params={"limit": _int(1, 1000, 100), "offset": _int(0, 10**9, 0)},
        tag="trash",
        scope="read",
    ),
    Route(
        "GET",
        "/trash/<item_id>",
        get_trash_item,
        summary="One trashed item (a note's content included)",
        params={"item_id": _TRASH_ID},
        tag="trash",
        scope="read",
    ),
    Route(
        "POST",
        "/trash/<item_id>/restore",
        restore_trash_item,
        summary="Put an item back, at its path or `path` (409 if taken); history comes along",
        body=_obj(
            path={
                "type": "string",
                "maxLength": MAX_PATH_CHARS,
                "description": "where to restore it: a note path, or attachments/... for an "
                "attachment (default: where it was)",
            }
        ),
        params={"item_id": _TRASH_ID},
        tag="trash",
        scope="write",
    ),
    Route(
        "DELETE",
        "/trash/<item_id>",
        purge_trash_item,
        summary="Delete an item for good",
        params={"item_id": _TRASH_ID},
        tag="trash",
        scope="admin",  # purging for good: the owner's alone
    ),
    Route(
        "GET",
        "/changes",
        list_changes,
        summary="The change feed: changes after `since`, or a wait of up to `wait` s for the "
        "next (410 GONE with resetRequired when the journal no longer has `since`)",
        params={
            "since": _int(0, MAX_SEQ, 0),
            "wait": _int(0, MAX_WAIT_SECONDS, 0),
            "limit": _int(1, 1000, 100),
        },
        tag="changes",
        scope="read",
    ),
    Route(
        "GET",
        "/folders/tree/<path:path>",
        get_subtree,
        summary="Subtree",
        params={"path": FOLDER_PATH_PARAM, "depth": _DEPTH},
        tag="folders",
        scope="read",
    ),
    Route(
        "POST",
        "/auth/devices/pairings",
        create_pairing,
        summary="Pair a device: a one-time secret (its link and QR code) for a device key",
        body=_obj(
            [],
            name={**_STR, "maxLength": 100},
            scope={"enum": list(SCOPES)},
            folder=_FOLDER_PATH,
        ),
        status=201,
        tag="auth",
        scope="admin",
    ),
    Route(
        "POST",
        "/auth/devices/claim",
        claim_device,
        public=True,
        summary="Claim a pairing's secret (from the link's fragment) for a device key, once",
        body=_obj(
            ["secret"],
            secret={**_STR, "minLength": 1, "maxLength": 64},
            deviceName={**_STR, "maxLength": 100},
        ),
        status=201,
        tag="auth",
    ),
    Route(
        "POST",
        "/auth/keys",
        create_scoped_key,
        summary="Create a scoped key (read or write, optionally one folder); shown once",
        body=_obj(
            ["name", "scope"],
            name={
                **_STR,
                "minLength": 1,
                "maxLength": 100,
                "pattern": NOT_BLANK_PATTERN,
                "description": "printable text",
            },
            scope={"enum": ["read", "write"]},
            folder=_FOLDER_PATH,
            expiresInDays={"type": "integer", "minimum": 1, "maximum": 3650},
        ),
        status=201,
        tag="grants",
        scope="admin",
    ),
    Route(
        "GET",
        "/auth/keys",
        list_scoped_keys,
        summary="Scoped keys and OAuth grants (no secrets)",
        tag="grants",
        scope="admin",
    ),
    Route(
        "DELETE",
        "/auth/keys/<grant_id>",
        revoke_scoped_key,
        summary="Revoke a scoped key or an OAuth grant, at once",
        tag="grants",
        scope="admin",
    ),
    Route(
        "POST",
        "/shares",
        create_share,
        summary="Share one note read-only by a link that expires",
        body=_obj(
            ["path"],
            path=_NOTE_PATH,
            expiresInDays={"type": "integer", "minimum": 1, "maximum": 365, "default": 7},
        ),
        status=201,
        tag="grants",
        scope="write",
    ),
    Route(
        "GET",
        "/shares",
        list_shares,
        summary="Live share links (a grant sees its own, the API key all)",
        tag="grants",
        scope="read",
    ),
    Route(
        "DELETE",
        "/shares/<share_id>",
        revoke_share,
        summary="Revoke a share link",
        tag="grants",
        scope="write",
    ),
    Route(
        "GET",
        "/shared/<token>",
        get_shared,
        public=True,
        summary="A shared note (rate-limited per address) and the attachments it links",
        tag="grants",
    ),
    Route(
        "GET",
        "/shared/<token>/attachments/<path:path>",
        get_shared_attachment,
        public=True,
        summary="An attachment the shared note links (only those)",
        params={"path": ATTACHMENT_PATH_PARAM},
        tag="grants",
        media="application/octet-stream",
        enveloped=False,
    ),
    Route(
        "GET",
        "/oauth/consent",
        oauth_consent,
        public=True,
        summary="What the consent page shows for an OAuth authorisation request",
        params={
            "client_id": {**_STR, "minLength": 1, "maxLength": 2000},
            "redirect_uri": {**_STR, "minLength": 1, "maxLength": 2000},
            "response_type": {"enum": ["code"]},
            "state": {**_STR, "maxLength": 1024},
            "code_challenge": {**_STR, "pattern": "^[A-Za-z0-9_-]{43}$"},
            "code_challenge_method": {"enum": ["S256"]},
            "scope": _STR,
            "resource": _STR,
        },
        tag="grants",
    ),
    Route(
        "POST",
        "/oauth/approve",
        approve_oauth,
        summary="The owner approves an OAuth request: the redirect with its code",
        body=_obj(
            ["clientId", "redirectUri", "codeChallenge", "scope"],
            clientId={**_STR, "minLength": 1, "maxLength": 2000},
            redirectUri={**_STR, "minLength": 1, "maxLength": 2000},
            state={**_STR, "maxLength": 1024},
            codeChallenge={**_STR, "pattern": "^[A-Za-z0-9_-]{43}$"},
            scope={"enum": ["notes:read", "notes:read notes:write"]},
            resource=_STR,
            folder=_FOLDER_PATH,
        ),
        tag="grants",
        scope="admin",
    ),
    Route("GET", "/relay/v1/pair/<code>", pair_relay_code, public=True, api=False, tag="relay"),
    Route("GET", "/", get_web_client, public=True, api=False, tag="pages", media="text/html"),
    Route(
        "GET", "/s/<token>", get_share_page, public=True, api=False, tag="pages", media="text/html"
    ),
    Route(
        "GET",
        "/oauth/authorize",
        get_consent_page,
        public=True,
        api=False,
        tag="pages",
        media="text/html",
    ),
    Route(
        "GET",
        "/.well-known/oauth-protected-resource",
        protected_resource_metadata,
        public=True,
        api=False,
        tag="oauth",
        enveloped=False,
    ),
    Route(
        "GET",
        "/.well-known/oauth-protected-resource/api/v1/mcp",
        protected_resource_metadata,
        public=True,
        api=False,
        tag="oauth",
        enveloped=False,
    ),
    Route(
        "GET",
        "/.well-known/oauth-authorization-server",
        authorization_server_metadata,
        public=True,
        api=False,
        tag="oauth",
        enveloped=False,
    ),
    Route(
        "GET",
        "/.well-known/openid-configuration",
        authorization_server_metadata,
        public=True,
        api=False,
        tag="oauth",
        enveloped=False,
    ),
    Route(
        "POST", "/oauth/token", oauth_token, public=True, api=False, tag="oauth", enveloped=False
    ),
    Route(
        "POST",
        "/oauth/register",
        oauth_register,
        public=True,
        api=False,
        tag="oauth",
        enveloped=False,
    ),
    Route(
        "POST", "/oauth/revoke", oauth_revoke, public=True, api=False, tag="oauth", enveloped=False
    ),
    *(web_asset_route(path) for path in WEB_ASSETS),
    Route(
        "POST",
        "/share-target",
        share_target_without_worker,
        summary="The share sheet without the offline worker: 303 to the page, which says so",
        status=303,
        media="text/plain",
        public=True,
        api=False,
        tag="pages",
        enveloped=False,
    ),
)


def channel_routes(providers: Mapping[str, ChannelProvider]) -> tuple:
    """Return GET /channels/webhook/<name> for each provider that declares a check."""
    routes = []
    for name, provider in providers.items():
        if provider.verify is None:
            continue

        def verify(svc: Service, _name: str = name):
            return verify_webhook(svc, _name)

        verify.__name__ = re.sub(r"\W+", "_", f"verify_{name}_webhook")
        routes.append(
            Route(
                "GET",
                f"/channels/webhook/{name}",
                verify,
                public=True,
                summary=f"{name}'s subscription check",
                params=dict.fromkeys(provider.verify_params, _STR),
                tag="channels",
                media="text/plain",
                enveloped=False,
            )
        )
    return tuple(routes)


def openapi_path(rule: str) -> str:
    """Return a Bottle rule as an OpenAPI path: <name> and <name:path> become {name}."""
    return re.sub(r"<(\w+)(?::[^>]*)?>", r"{\1}", rule)


_SEGMENT = {"type": "string", "minLength": 1}  # a path parameter without its own schema


def openapi_document(svc: Service, server_url: str) -> dict:
    """Return the OpenAPI 3.1 document of every /api/v1 route in the table."""
    envelope_ok = _obj(["success", "data"], success={"const": True}, data={"type": "object"})
    envelope_err = _obj(
        ["success", "error"],
        success={"const": False},
        error=_obj(["code", "message"], code={"enum": list(ERROR_CODES)}, message=_STR),
    )
    paths: dict = {}
    for r in svc.routes:
        if not r.api:
            continue
        success = (
            _json_content("Success")
            if r.enveloped
            else {r.media: {"schema": {"type": "object" if "json" in r.media else "string"}}}
        )
        op: dict = {
            "operationId": r.handler.__name__,
            "summary": r.summary or r.handler.__name__.replace("_", " "),
            "tags": [r.tag],
            "responses": {
                **{
                    str(code): {"description": "success", "content": success}
                    for code in sorted({200, r.status})
                },
                "default": {
                    "description": "the error envelope: 400, 401, 403, 404, 405, 409, 410, "
                    "412, 413, 415, 429, 500, 502, 503, 504 or 507",
                    "content": _json_content("Error"),
                },
            },
        }
        if r.jsonrpc:
            answer = {"application/json": {"schema": {"type": "object"}}}
            op["responses"] = {
                "200": {"description": "the JSON-RPC answer", "content": answer},
                "202": {"description": "a notification (or response), accepted"},
                "default": {"description": "a JSON-RPC error object", "content": answer},
            }
            op["security"] = [{"apiKey": []}, {"bearerKey": []}, {"xApiKey": []}, {"bearerJwt": []}]
            op["security"].append({"mcpOAuth": [OAUTH_SCOPES[0]]})  # CONTRACT 21
        if r.public:
            op["security"] = []
        elif r.key_only:
            op["security"] = [{"apiKey": []}]
        if not r.public:
            op["x-scope"] = r.scope
        schemas = r.params or {}  # a name of the rule's is a path parameter, others query
        in_path = re.findall(r"<(\w+)(?::[^>]*)?>", r.path)
        params = [
            {"name": p, "in": "path", "required": True, "schema": schemas.get(p, _SEGMENT)}
            for p in in_path
        ]
        params += [
            {"name": n, "in": "query", "required": n == "q", "schema": schema}
            for n, schema in schemas.items()
            if n not in in_path
        ]
        if params:
            op["parameters"] = params
        body = r.body(svc) if callable(r.body) else r.body  # built per app and document
        if body is not None:
            op["requestBody"] = {
                "required": bool(
                    body.get("required") or body.get("oneOf") or body.get("minProperties")
                ),
                "content": {r.body_media: {"schema": body}},
            }
        paths.setdefault(openapi_path(r.rule), {})[r.method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "notesvc",
            "version": __version__,
            "description": "A self-hosted notes server. Every answer is the envelope "
            '{"success": true, "data": {...}} or {"success": false, "error": {code, message}}; '
            "note paths in URLs are percent-encoded with / as %2F.",
        },
        "servers": [{"url": server_url}],
        "paths": paths,
        "components": {
            "schemas": {"Success": envelope_ok, "Error": envelope_err},
            "securitySchemes": {
                "apiKey": {
                    "type": "apiKey",
                    "in": "header",
                    "name": KEY_HEADER,
                    "description": "the API key (admin), or a scoped key (nsg_...) holding "
                    "the scope an operation's x-scope names (also as Authorization: Bearer)",
                },
                "mcpOAuth": {
                    "type": "oauth2",
                    "description": "OAuth 2.1 for MCP clients (PKCE S256, RFC 8707 resource); "
                    "tokens are good for /api/v1/mcp only",
                    "flows": {
                        "authorizationCode": {
                            "authorizationUrl": f"{server_url}/oauth/authorize",
                            "tokenUrl": f"{server_url}/oauth/token",
                            "refreshUrl": f"{server_url}/oauth/token",
                            "scopes": {
                                "notes:read": "read and search notes",
                                "notes:write": "create and change notes (SERVICE_MCP_WRITE)",
                            },
                        }
                    },
                },
                "bearerJwt": {"type": "http", "scheme": "bearer", "bearerFormat": "JWT"},
                "bearerKey": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "the API key as a bearer token (/mcp only)",
                },
                "xApiKey": {
                    "type": "apiKey",
                    "in": "header",
                    "name": "X-API-Key",
                    "description": "the API key (/mcp only)",
                },
            },
        },
        "security": [{"apiKey": []}, {"bearerJwt": []}],
    }


def _json_content(schema: str) -> dict:
    return {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}


# -- the application ------------------------------------------------------------------


def _callback(svc: Service, route: Route) -> Callable:
    """Wrap a handler: authenticate, call, put dicts in the envelope, hide crashes."""

    def callback(**kwargs):
        env = bottle.request.environ
        if route.jsonrpc:  # /mcp: Origin, then the key in any header AI clients use, or a token
            principal = authenticate_mcp(svc, env)
        elif not route.public:
            principal = svc.authenticate(env, key_only=route.key_only)
        if not route.public:
            if not principal.allows(route.scope):
                raise ApiError(
                    403,
                    "FORBIDDEN",
                    f"this needs the {route.scope} scope; this key holds {principal.scope}",
                )
            env["notesvc.principal"] = principal
        once = svc.idempotency.key(route, env) if route.idempotent else None
        with svc.idempotency.running(once):
            return _answer_once(svc, route, kwargs, once)

    callback.__name__ = route.handler.__name__
    return callback


def _answer_once(svc: Service, route: Route, kwargs: dict, once: tuple | None):
    """Run the route's handler: its answer as the envelope (kept for its Idempotency-Key,
    when it has one, and given again for that key)."""
    if once is not None:
        done = svc.idempotency.get(once)
        if done is not None:  # an outbox sent it again: the first answer, nothing redone
            status, headers, body = done
            bottle.response.status = status
            for name, value in headers:
                bottle.response.set_header(name, value)
            return body
    try:
        result = route.handler(svc, **kwargs)
    except ApiError as e:  # (an HTTPResponse too: before that clause)
        if once is not None and e.status_code == 409:  # a conflict copy: kept once
            headers = [("Content-Type", JSON_TYPE)]
            svc.idempotency.put(once, e.status_code, headers, render_error(e))
        raise
    except bottle.HTTPResponse:
        raise
    except Exception:
        rid = bottle.request.environ.get("notesvc.request_id", "-")
        log.exception("request %s failed in %s", rid, route.handler.__name__)
        raise ApiError(500, "INTERNAL_ERROR", f"internal error; request id {rid}") from None
    if isinstance(result, dict):
        result = ok(result, route.status)
        if once is not None:
            kept = [
                (k, v)
                for k, v in bottle.response.headerlist
                if k in ("Content-Type", "ETag", "Location")
            ]
            svc.idempotency.put(once, bottle.response.status_code, kept, result)
    return result


_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._-]{8,64}$")
_SHARE_PATH_RE = re.compile(r"(/s/|/shared/)[^/]+")  # share tokens never reach the log
CORS_HEADERS = (
    "X-Service-Key, Content-Type, Authorization, If-Match, If-None-Match, Range, If-Range, "
    "X-API-Key, Idempotency-Key, MCP-Protocol-Version, Mcp-Method, Mcp-Name"  # last 4: /mcp
)
CORS_EXPOSE = "ETag, Location, X-Request-Id, Retry-After, Content-Range, Content-Disposition"
CORS_METHODS = "GET, POST, PUT, PATCH, DELETE, OPTIONS"


class NotesApp:
    """The WSGI application: request ids, CORS, the self-relay prefix, then Bottle."""

    def __init__(self, service: Service, routes: Iterable[Route]):
        self.service = service
        self.bottle = bottle.Bottle(catchall=True)
        self.bottle.default_error_handler = render_error
        # Bottle's `path` filter stops at a newline; let the path rules name that instead.
        self.bottle.router.add_filter("path", lambda conf: (r"[\s\S]+?", None, None))
        service.routes = tuple(routes)
        unscoped = [
            f"{r.method} {r.rule}" for r in service.routes if not r.public and r.scope not in SCOPES
        ]
        if unscoped:  # deny by default: what a grant may call is declared, never assumed
            raise ConfigError(
                f"routes without a scope (read, write or admin): {', '.join(unscoped)}"
            )
        for r in service.routes:
            self.bottle.route(r.rule, r.method, _callback(service, r))
        dav = dav_callback(service)  # WebDAV: its own methods, answers and errors
        for method in DAV_METHODS:
            for rule in (DAV_PREFIX, DAV_PREFIX + "/", DAV_PREFIX + "/<path:path>"):
                self.bottle.route(rule, method, dav)
        self._jsonrpc_rules = frozenset(r.rule for r in service.routes if r.jsonrpc)

    def answers_jsonrpc(self, path: str) -> bool:
        """Return whether a request path (under /r/<id> or not) is a route answering JSON-RPC,
        whose every failure is then a JSON-RPC error (render_error, waitress's refusals)."""
        return re.sub(r"^/r/[^/]+(?=/)", "", path) in self._jsonrpc_rules

    def _cors_origin(self, origin: str) -> str:
        allowed = self.service.config.cors
        if not origin or not allowed:
            return ""
        if "*" in allowed:
            return "*"
        return origin if cors_allows(self.service.config, origin) else ""

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        started = time.perf_counter()
        rid = environ.get("HTTP_X_REQUEST_ID", "")
        rid = rid if _REQUEST_ID_RE.match(rid) else uuid.uuid4().hex[:16]
        environ["notesvc.request_id"] = rid
        method = environ.get("REQUEST_METHOD", "GET")
        cors = self._cors_origin(environ.get("HTTP_ORIGIN", ""))
        path = environ.get("PATH_INFO", "")
        environ["notesvc.jsonrpc"] = self.answers_jsonrpc(path)
        status_seen = []

        def respond(status: str, headers: list, exc_info=None):
            status_seen.append(status)
            headers.append(("X-Request-Id", rid))
            headers.append(("X-Content-Type-Options", "nosniff"))
            if path.startswith(API) or path.startswith("/r/"):
                headers.append(("Cache-Control", "no-store"))
            if cors:
                headers.append(("Access-Control-Allow-Origin", cors))
                headers.append(("Access-Control-Expose-Headers", CORS_EXPOSE))
                headers.append(("Vary", "Origin"))
            return start_response(status, headers, exc_info)

        try:
            length = environ.get("CONTENT_LENGTH", "")
            if length and not re.fullmatch(r"[0-9]+", length):  # servers that pass it through
                body = _plain_error(
                    respond,
                    400,
                    "VALIDATION_ERROR",
                    "Content-Length is not a number of bytes",
                    environ["notesvc.jsonrpc"],
                )
            else:
                body = self._dispatch(environ, respond, method, cors)
        finally:
            if log.isEnabledFor(logging.INFO):
                try:  # WSGI hands the path over as latin-1; log the UTF-8 it was
                    shown = path.encode("latin-1").decode("utf-8")
                except UnicodeError:
                    shown = path
                log.info(
                    "%s %s %s %.1fms %s",
                    log_safe(method, 32),
                    log_safe(_SHARE_PATH_RE.sub(r"\1…", shown)),
                    (status_seen or ["-"])[0].split(" ")[0],
                    (time.perf_counter() - started) * 1000,
                    rid,
                )
        return body

    def _dispatch(self, environ: dict, respond: Callable, method: str, cors: str):
        if method == "OPTIONS" and cors and environ.get("HTTP_ACCESS_CONTROL_REQUEST_METHOD"):
            respond(
                "204 No Content",
                [
                    ("Access-Control-Allow-Methods", CORS_METHODS),
                    ("Access-Control-Allow-Headers", CORS_HEADERS),
                    ("Access-Control-Max-Age", "600"),
                ],
            )
            return [b""]
        try:
            path = environ.get("PATH_INFO", "").encode("latin-1").decode("utf-8")
        except UnicodeError:
            return _plain_error(respond, 400, "VALIDATION_ERROR", "the URL path is not UTF-8")
        known = RELAYED_WELL_KNOWN_RE.match(path)
        if known:  # RFC 8414 / 9728: the issuer's path follows the well-known name
            path = f"/r/{known.group(2)}/.well-known/{known.group(1)}{known.group(3) or ''}"
        m = re.match(r"^/r/([^/]+)(/.*)?$", path)
        if m:
            if m.group(1) != self.service.state.read()["serverId"]:
                message = "no such server on this relay"
                return _plain_error(respond, 404, "NOT_FOUND", message, environ["notesvc.jsonrpc"])
            inner = m.group(2) or "/"
            environ["SCRIPT_NAME"] = environ.get("SCRIPT_NAME", "") + f"/r/{m.group(1)}"
            environ["PATH_INFO"] = inner.encode("utf-8").decode("latin-1")
        return self.bottle(environ, respond)


def _plain_error(
    respond: Callable, status: int, code: str, message: str, jsonrpc: bool = False
) -> list:
    body = jsonrpc_error_body(status, code, message) if jsonrpc else error_body(code, message)
    respond(
        f"{status} {bottle.HTTP_CODES.get(status, 'Error')}",
        [("Content-Type", JSON_TYPE), ("Content-Length", str(len(body)))],
    )
    return [body]


def create_app(config: Config | None = None) -> NotesApp:
    """Return the WSGI application for config (the environment's when None)."""
    config = config or load_config()
    service = build_service(config).start()
    routes = ROUTES + channel_routes(service.channel_providers)
    return NotesApp(service, routes + plugin_routes(service.plugins.values()))


def __getattr__(name: str):
    # `notesvc.app`: built on first use, so importing the module touches no files.
    if name == "app":
        globals()["app"] = create_app()
        return globals()["app"]
    raise AttributeError(name)


# == CLI ======================================================================


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one clear line, exit 2
        self.exit(2, f"notesvc: error: {message} (see --help)\n")


COMMAND_HELP = {
    "serve": "serve the API (the default)",
    "rotate-key": "print a new API key; the old one stops working (works while serving)",
    "pair": "add a device: print a one-time link and its QR code to scan (works while serving)",
    "audit": "print the security audit of this root's server; exit 1 on a critical finding",
    "relay": "run a relay only (serves /relay/v1/*, /r/<serverId>/api/v1/*, /health)",
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
    }
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
        """Attachment uploads may be SERVICE_MAX_ATTACHMENT_BYTES; every other body keeps
        SERVICE_MAX_BODY_BYTES, refused (413) from its declared length before it is read."""

        def parse_header(self, header_plus):
            super().parse_header(header_plus)
            smaller = getattr(self.adj, "notesvc_body_size", None)
            if smaller and not attachment_upload(self.command, self.path):
                self.adj = _BodyLimit(self.adj, smaller, "SERVICE_MAX_BODY_BYTES")
            elif smaller:
                self.adj = _BodyLimit(
                    self.adj, self.adj.max_request_body_size, "SERVICE_MAX_ATTACHMENT_BYTES"
                )

    class Channel(waitress.channel.HTTPChannel):
        """Closes after an early error like nginx's lingering_close: the answer sent and the
        sending side shut, it reads and discards what the client still sends (at most
        linger_budget bytes, LINGER_SECONDS, LINGER_IDLE_SECONDS between reads) before
        closing, so a client that writes its whole body before reading (urllib) gets the
        413 instead of a reset."""

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
                    return
            super().handle_close()

        def readable(self) -> bool:
            if not self.linger_until:
                return super().readable()
            idle = time.time() - self.last_activity > LINGER_IDLE_SECONDS
            if idle or time.monotonic() > self.linger_until:
                self.will_close = True  # closed by handle_write, on this loop's next turn
                return False
            return True

        def writable(self) -> bool:
            return self.will_close if self.linger_until else super().writable()

        def handle_read(self) -> None:
            if not self.linger_until:
                return super().handle_read()
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
            return None

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


class _BodyLimit:
    """waitress's settings with another largest body (per request; see _hardened)."""

    def __init__(self, adj: Any, size: int, setting: str):
        self._adj, self.max_request_body_size, self.setting = adj, size, setting

    def __getattr__(self, name: str) -> Any:
        return getattr(self._adj, name)


_UPLOAD_RE = re.compile(rf"^(?:/r/[^/]+)?{API}/attachments(?:/.*)?$", re.S)


_DAV_PUT_RE = re.compile(rf"^(?:/r/[^/]+)?{DAV_PREFIX}/.*(?<!\.md)$", re.S)


def attachment_upload(method: str, path: str) -> bool:
    """Return whether a request uploads an attachment (its body may be the larger kind): to
    the API's attachments, or a file that is not a note over WebDAV."""
    if method == "PUT" and _DAV_PUT_RE.match((path or "").split("?", 1)[0]):
        return True
    return method in ("PUT", "POST") and bool(_UPLOAD_RE.match(path or ""))


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
                "bitsPerChar": max(0.0, _entropy_bits_per_char(text)),
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
    max_body = max(config.max_body_bytes, config.max_attachment_bytes + MULTIPART_SLACK)
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
        ):
            getattr(cls, name)
        for listener in sockets.values():
            if isinstance(listener, waitress.server.BaseWSGIServer):
                listener.__class__ = _hardened(type(listener))
                # the limit of every body but an attachment's (Parser, in _hardened)
                listener.adj.notesvc_body_size = config.max_body_bytes + 1
    except (AttributeError, ImportError, TypeError) as e:
        log.warning("this waitress differs (%s): no guard against connection floods", e)
        for listener in sockets.values():  # one limit then: SERVICE_MAX_BODY_BYTES
            with contextlib.suppress(AttributeError):
                listener.adj.max_request_body_size = config.max_body_bytes + 1
    return server


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
        lines.append(f"  add a device: {_self_command()} pair")
        lines.append(f"  lost the key? run: {_self_command()} rotate-key")
    elif terminal:
        lines.append("  first:  open that address in a browser: it sets this server up")
        lines.append(f"  key:    {state.get('apiKey', '')}  (shown until setup completes)")
    else:  # a journal or a log file keeps what it is given: no key there
        lines.append("  first:  open that address in a browser: it sets this server up")
        lines.append(
            "  key:    not logged; open the setup URL on this machine, "
            f"or run: {_self_command()} rotate-key"
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


def _self_command() -> str:
    """Return how the owner runs this program: the `notesvc` entry point or the file."""
    argv0 = sys.argv[0] if sys.argv else ""
    return argv0 if os.path.basename(argv0) == "notesvc" else "python3 notesvc.py"


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
            app.service.relay_client = RelayClient(app).start()
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
            raise ConfigError(f"cannot listen on {config.host}:{config.port}: {e.strerror}") from e
        settle_after_start()  # what compiling this module left free
        host = config.host if config.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        print(
            f"notesvc {__version__} relay\n  listening on http://{host}:{port}"
            f" (bind {config.host}:{port})\n"
            f"  servers register with SERVICE_RELAY_URL=http://<this host>:{port}\n"
            f"  phones open http://<this host>:{port}/?relayCode=<the server's relay code>",
            file=sys.stderr,
            flush=True,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("relay stopping")
        relay.hub.close()  # long-polls and waiting clients answer now
        relay.server.close()
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
        f"sudo -u {name} {_self_command()} {command} --root {config.root}"
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
    try:
        key = store.update(rotate_key)
    except PermissionError:
        raise ConfigError(store.permission_hint) from None
    print(key)
    print(
        "The old key stopped working; a running notesvc picks this one up at once.",
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
    name = _clean_name(args.name, "device")
    raw = (args.folder or "").strip().strip("/")
    try:
        folder = folder_path(raw if raw.startswith(NOTES) else f"{NOTES}/{raw}") if raw else None
        made = new_pairing(config, GrantStore(store), name, args.scope, folder, None)
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


COMMANDS = {
    "serve": cmd_serve,
    "rotate-key": cmd_rotate_key,
    "pair": cmd_pair,
    "audit": cmd_audit,
    "relay": cmd_relay,
}
CREATING_COMMANDS = ("serve", "relay")  # the others refuse a root without state


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
        logging.basicConfig(
            level=config.log_level,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
            stream=sys.stderr,
        )
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
