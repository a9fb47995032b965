"""The option table, the loader and the frozen Config."""

from __future__ import annotations

import base64
import dataclasses
import ipaddress
import os
import re
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable


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


def _write_mode(raw: str) -> bool | str:
    """Parse SERVICE_MCP_WRITE / SERVICE_AGENT_WRITE: true, false (as _bool takes them), or
    `suggest` (the write tools make suggestions the person accepts or rejects)."""
    if raw.strip().lower() == "suggest":
        return "suggest"
    try:
        return _bool(raw)
    except ValueError:
        raise ValueError(f"{raw!r} is not true, false or suggest") from None


def _setup_local_only(raw: str) -> str:
    """Parse SERVICE_SETUP_LOCAL_ONLY: auto, or true / false (as _bool takes them)."""
    word = raw.strip().lower()
    return "auto" if word == "auto" else ("true" if _bool(raw) else "false")


def _attachment_text(raw: str) -> str:
    """Parse SERVICE_ATTACHMENT_TEXT: auto (read files when the tools are there) or off."""
    word = raw.strip().lower()
    if word in ("auto", "off"):
        return word
    raise ValueError(f"{raw!r} is not auto or off")


def _ocr_langs(raw: str) -> str:
    """Parse SERVICE_OCR_LANGS: tesseract's language codes joined by + (eng, deu+eng)."""
    text = raw.strip()
    if not re.fullmatch(r"[A-Za-z_]{2,32}(\+[A-Za-z_]{2,32}){0,7}", text):
        raise ValueError(f"{raw!r} is not tesseract languages such as eng or deu+eng")
    return text


def _duration(lo: int, hi: int) -> Callable[[str], int]:
    """Parse seconds: a whole number, or one with s, m or h after it (30m, 2h)."""
    units = {"s": 1, "m": 60, "h": 3600}

    def parse(raw: str) -> int:
        text = raw.strip().lower()
        unit = units.get(text[-1:], 0)
        try:
            value = int(text[:-1] if unit else text) * (unit or 1)
        except ValueError:
            raise ValueError(f"{raw!r} is not a number of seconds (or 30m, 2h)") from None
        if not lo <= value <= hi:
            raise ValueError(f"{value} seconds is outside {lo}..{hi}")
        return value

    return parse


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


def _embed_url(raw: str) -> str:
    """Parse SERVICE_EMBED_URL: Ollama's .../api/embed or an OpenAI-compatible
    .../embeddings, told apart by the path (the message never repeats a query string: it
    may hold a key)."""
    raw = raw.strip().rstrip("/")
    if not raw:
        return ""
    parts = urllib.parse.urlsplit(raw)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError("it is not an http(s) URL")
    if not (parts.path.endswith("/api/embed") or parts.path.endswith("/embeddings")):
        raise ValueError(
            f"the path {parts.path or '/'!r} is neither Ollama's /api/embed nor an "
            "OpenAI-compatible /v1/embeddings"
        )
    return raw


def _domain(raw: str) -> str:
    """Parse a DNS name (SERVICE_RELAY_DOMAIN): lower-case labels, at least two of them."""
    name = raw.strip().lower().rstrip(".")
    label = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
    if name and (len(name) > 200 or not re.fullmatch(rf"{label}(?:\.{label})+", name)):
        raise ValueError(f"{raw!r} is not a domain name such as relay.example.org")
    return name


def _host_port(raw: str) -> str:
    """Parse host:port ([v6]:port) of a DNS server (SERVICE_RELAY_DNS_UPDATE); "" is none."""
    raw = raw.strip()
    if not raw:
        return ""
    host, sep, port = raw.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{raw!r} is not host:port (e.g. 127.0.0.1:53)")
    return raw


def _addresses(raw: str) -> tuple:
    """Parse a comma-separated list of IP addresses (SERVICE_RELAY_DNS_ADDRESSES)."""
    found = []
    for item in raw.split(","):
        item = item.strip().strip("[]")
        if item:
            try:
                found.append(str(ipaddress.ip_address(item)))
            except ValueError:
                raise ValueError(f"{item!r} is not an IP address") from None
    return tuple(found)


def _tsig(raw: str) -> str:
    """Parse SERVICE_RELAY_DNS_TSIG: <key name>:<base64 HMAC-SHA256 secret>."""
    raw = raw.strip()
    if raw:
        name, sep, secret = raw.partition(":")
        try:
            key = base64.b64decode(secret.strip(), validate=True)
        except ValueError:
            key = b""
        if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]{1,250}", name) or len(key) < 16:
            raise ValueError("give it as <key name>:<base64 secret of at least 16 bytes>")
    return raw


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
        "auto",
        _setup_local_only,
        "who may set up: true (loopback only), false (loopback and home networks) or auto "
        "(loopback only on a VPS or in a container)",
    ),
    Setting(
        "setup_window",
        "SERVICE_SETUP_WINDOW",
        "",
        "30m",
        _duration(0, 30 * 86400),
        "how long after a start with setup incomplete the key is offered over HTTP "
        "(seconds, or 30m, 2h; 0: never)",
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
    Setting(
        "relay_passthrough",
        "SERVICE_RELAY_PASSTHROUGH",
        "",
        "auto",
        _choice("auto", "off"),
        "auto: when the relay offers it, TLS ends on this server (a certificate for "
        "<serverId>.<domain> by ACME); off: never",
    ),
    Setting(
        "acme_directory",
        "SERVICE_ACME_DIRECTORY",
        "",
        "https://acme-v02.api.letsencrypt.org/directory",
        _url,
        "the ACME CA's directory for that certificate",
    ),
    Setting("acme_email", "SERVICE_ACME_EMAIL", "", "", _text, "contact for the ACME account"),
    Setting(
        "acme_ca_file",
        "SERVICE_ACME_CA_FILE",
        "",
        "",
        _text,
        "a CA file to trust for the ACME directory's own HTTPS (a test CA)",
    ),
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
    Setting("embed_url", "SERVICE_EMBED_URL", "--embed-url", "", _embed_url, "embeddings URL"),
    Setting("embed_model", "SERVICE_EMBED_MODEL", "--embed-model", "", _text, "embeddings model"),
    Setting("embed_key", "SERVICE_EMBED_KEY", "", "", _text, "embeddings API key (a secret)"),
    Setting(
        "agent_write",
        "SERVICE_AGENT_WRITE",
        "",
        "false",
        _write_mode,
        "the agent may change notes (true), or suggest changes (suggest)",
    ),
    Setting(
        "mcp_write",
        "SERVICE_MCP_WRITE",
        "",
        "false",
        _write_mode,
        "MCP clients may change notes (true), or suggest changes (suggest)",
    ),
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
        "change-feed long-polls and MCP streams held at once (auto: half of SERVICE_THREADS)",
    ),
    Setting(
        "mcp_stream_seconds",
        "SERVICE_MCP_STREAM_SECONDS",
        "",
        "10m",
        _duration(1, 3600),
        "how long one MCP notification stream (GET /mcp) lasts before the client opens another",
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
        "relay_tls",
        "SERVICE_RELAY_TLS",
        "",
        "off",
        _choice("off", "passthrough"),
        "relay role: passthrough: splice <serverId>.<domain> to its server by SNI, TLS ending "
        "there (needs SERVICE_RELAY_DOMAIN)",
    ),
    Setting(
        "relay_tls_port",
        "SERVICE_RELAY_TLS_PORT",
        "",
        "443",
        _port,
        "relay role: the TLS port of passthrough (may be the HTTP port: told apart by the "
        "first byte)",
    ),
    Setting(
        "relay_tls_cert",
        "SERVICE_RELAY_TLS_CERT",
        "",
        "",
        _text,
        "relay role: the relay's own certificate (PEM chain) for <domain>, and *.<domain> to "
        "terminate servers not in passthrough",
    ),
    Setting("relay_tls_key", "SERVICE_RELAY_TLS_KEY", "", "", _text, "relay role: its private key"),
    Setting(
        "relay_dns_port",
        "SERVICE_RELAY_DNS_PORT",
        "",
        "53",
        _port,
        "relay role: the port of its DNS for <domain> (UDP and TCP), with passthrough",
    ),
    Setting(
        "relay_dns_addresses",
        "SERVICE_RELAY_DNS_ADDRESSES",
        "",
        "",
        _addresses,
        "relay role: the A/AAAA answers for <domain> and *.<domain> (default: SERVICE_HOST "
        "when it is one address, else this machine's default-route address)",
    ),
    Setting(
        "relay_dns_update",
        "SERVICE_RELAY_DNS_UPDATE",
        "",
        "",
        _host_port,
        "relay role: host:port of a DNS server to set challenge records in by RFC 2136 "
        "updates, instead of answering DNS itself",
    ),
    Setting(
        "relay_dns_tsig_secret",
        "SERVICE_RELAY_DNS_TSIG",
        "",
        "",
        _tsig,
        "relay role: the TSIG key of those updates, <key name>:<base64 HMAC-SHA256 secret>",
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
        "device_idle_days",
        "SERVICE_DEVICE_IDLE_DAYS",
        "",
        "90",
        _int_range(0, 36500),
        "days a device key made by pairing keeps working unused (0 = never expires)",
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
        "attachment_text",
        "SERVICE_ATTACHMENT_TEXT",
        "",
        "auto",
        _attachment_text,
        "read the text inside PDFs and images for search (auto: when pdftotext or tesseract is"
        " installed; off)",
    ),
    Setting(
        "ocr_langs", "SERVICE_OCR_LANGS", "", "eng", _ocr_langs, "tesseract languages (deu+eng)"
    ),
    Setting(
        "timezone",
        "SERVICE_TIMEZONE",
        "",
        "",
        _timezone,
        "time zone of daily notes and reminders (default: the system's)",
    ),
    Setting(
        "max_import_bytes",
        "SERVICE_MAX_IMPORT_BYTES",
        "",
        "268435456",
        _int_range(1024, 1 << 40),
        "largest import upload (bytes)",
    ),
    Setting(
        "max_import_expanded_bytes",
        "SERVICE_MAX_IMPORT_EXPANDED_BYTES",
        "",
        "2147483648",
        _int_range(1024, 1 << 44),
        "the most an imported archive may expand to (bytes)",
    ),
    Setting(
        "max_import_entries",
        "SERVICE_MAX_IMPORT_ENTRIES",
        "",
        "50000",
        _int_range(1, 10_000_000),
        "the most entries an import may hold: files of an archive or folder, notes and "
        "resources of an .enex",
    ),
    Setting(
        "import_min_free_bytes",
        "SERVICE_IMPORT_MIN_FREE_BYTES",
        "",
        "209715200",
        _int_range(0, 1 << 62),
        "free space an import leaves on the notes' disk, at least (or 5 % of it, if less)",
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
    "root": ("serve", "audit", "rotate-key", "pair", "import", "export"),
    "log_level": ("serve", "audit", "rotate-key", "pair", "relay", "import", "export"),
    **dict.fromkeys(
        (
            "max_import_bytes",
            "max_import_expanded_bytes",
            "max_import_entries",
            "import_min_free_bytes",
        ),
        (*SERVER_COMMANDS, "import"),
    ),
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
    setup_local_only: str  # auto, true or false: see setup_loopback_only()
    setup_window: int
    pairing: str
    relay_url: str
    relay_passthrough: str
    acme_directory: str
    acme_email: str
    acme_ca_file: str
    client_url: str
    test_client_url: str
    agent_provider: str
    agent_base_url: str
    agent_model: str
    agent_api_key: str
    embed_url: str
    embed_model: str
    embed_key: str
    agent_timeout: float
    agent_max_steps: int
    agent_write: bool | str  # True, False or "suggest"
    mcp_write: bool | str
    mcp_stream_seconds: int
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
    relay_tls: str
    relay_tls_port: int
    relay_tls_cert: str
    relay_tls_key: str
    relay_dns_port: int
    relay_dns_addresses: tuple
    relay_dns_update: str
    relay_dns_tsig_secret: str
    pairing_ttl: int
    device_idle_days: int
    max_attachment_bytes: int
    transcribe_url: str
    transcribe_model: str
    transcribe_api_key: str
    attachment_text: str
    ocr_langs: str
    timezone: str
    max_import_bytes: int
    max_import_expanded_bytes: int
    max_import_entries: int
    import_min_free_bytes: int
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
    if values["embed_url"] and not values["embed_model"]:
        raise ConfigError("SERVICE_EMBED_MODEL: SERVICE_EMBED_URL is set: name its model too")
    if values["max_waiters"] < 0:
        values["max_waiters"] = values["threads"] // 2
    if values["max_waiters"] >= values["threads"]:
        raise ConfigError(
            f"SERVICE_MAX_WAITERS: {values['max_waiters']} would leave none of the "
            f"{values['threads']} SERVICE_THREADS to other requests; use at most "
            f"{values['threads'] - 1}"
        )
    if values["relay_tls"] == "passthrough" and not values["relay_domain"]:
        raise ConfigError("SERVICE_RELAY_TLS: passthrough needs SERVICE_RELAY_DOMAIN")
    if values["relay_dns_update"] and not values["relay_dns_tsig_secret"]:
        raise ConfigError("SERVICE_RELAY_DNS_TSIG: SERVICE_RELAY_DNS_UPDATE is set: give its key")
    values["root"] = values["root"].resolve()
    return Config(**values)
