"""The security audit: AUDIT_CHECKS and the score."""

from __future__ import annotations

import collections
import contextlib
import datetime as dt
import math
import os
import stat
import time
import urllib.parse
from pathlib import Path
from typing import Callable

from notesvc.boot import log
from notesvc.grants import (
    MAX_OAUTH_CLIENTS,
    OAUTH_CLIENT_UNUSED_DAYS,
    clean_name,
    epoch_of,
    person_reach,
)
from notesvc.helpers import (
    is_loopback,
    is_trusted_proxy,
    iso,
    minutes_text,
    redact_url,
    self_command,
    utcnow,
)
from notesvc.notes.paths import ATTACHMENTS, NOTES
from notesvc.passthrough.acme import TlsFolder
from notesvc.service import Service, plugins_dir
from notesvc.settings import Config

# -- Security audit ------------------------------------------------------------------------
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
    """An incomplete setup is critical once anything beyond loopback can reach the server:
    bound to a non-loopback address, or registered with a relay."""
    cfg, st = svc.config, svc.state.read()
    if st.get("setupComplete") or cfg.auth_mode == "none":
        return []
    relayed = bool(cfg.relay_url) and cfg.pairing == "relay"
    finish = (
        f"Set it up now from a browser on this machine or its home network, or run "
        f"`{self_command()} pair` (or rotate-key) on the server: either completes setup."
    )
    window = minutes_text(cfg.setup_window)
    home = "loopback" if svc.setup_loopback_only else "loopback or its home network"
    if not _reachable_beyond_loopback(cfg) and not relayed and cfg.trust_proxy:
        # Behind the proxy the forwarded address decides (client_of): what the key is
        # offered to is what the proxy reports, and a loopback peer may be the proxy itself.
        itself = any(is_trusted_proxy(cfg, a) for a in ("127.0.0.1", "::1"))
        return [
            finding(
                "setup-incomplete",
                "low",
                "Setup is not complete",
                "The service listens on loopback only, behind the proxy SERVICE_TRUST_PROXY "
                "names: GET /system/setup offers the key only to a client that proxy reports "
                f"(X-Forwarded-For, Forwarded, X-Real-IP) as on {home}, for {window} after a "
                "start, until setup completes"
                + (
                    "; a request straight to the port from this machine comes from a "
                    "trusted proxy's address and names no client, so it is not offered "
                    "the key"
                    if itself
                    else ""
                )
                + ".",
                "Set it up through the proxy from a browser "
                + ("on this machine" if svc.setup_loopback_only else "at home")
                + f", or run `{self_command()} pair` (or rotate-key) on the server: either "
                "completes setup.",
            )
        ]
    if not _reachable_beyond_loopback(cfg) and not relayed:
        return [
            finding(
                "setup-incomplete",
                "low",
                "Setup is not complete",
                f"The key is offered by GET /system/setup to this machine, for {window} "
                "after a start, until setup completes; the service listens on loopback only.",
                finish,
            )
        ]
    where = " and ".join(
        part
        for part in (
            f"listens on {cfg.host or '*'}" if _reachable_beyond_loopback(cfg) else "",
            f"is registered with the relay {redact_url(cfg.relay_url)}" if relayed else "",
        )
        if part
    )
    who = "loopback" if svc.setup_loopback_only else "loopback and home-network"
    if cfg.trust_proxy:
        who += " clients (behind the proxy SERVICE_TRUST_PROXY names: as it reports them)"
    else:
        who += " clients"
    return [
        finding(
            "setup-exposed",
            "critical",
            "Setup is not complete on a reachable server",
            f"Setup is incomplete and the service {where}: whoever sets it up first owns "
            f"it. The key is offered only to {who}, for "
            f"{minutes_text(cfg.setup_window)} after a start, and never through a relay; a "
            "proxy or tunnel in front that adds no forwarding header makes every client "
            "look local.",
            finish,
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


def entropy_bits_per_char(text: str) -> float:
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
    return len(secret.encode()), entropy_bits_per_char(secret)


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
        elif (  # (a channel waiting for a bind code, or closed by one revoked, takes nobody)
            provider.allow
            and not channel["config"].get(provider.allow)
            and not channel.get("binding")
        ):
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
    if _off_loopback_http(cfg.embed_url):
        out.append(
            finding(
                "embed-plain-http",
                "high" if cfg.embed_key else "medium",
                "The embeddings endpoint is plain HTTP",
                "Every note's text, every search (and the embeddings key) travel unencrypted.",
                "Use an https:// SERVICE_EMBED_URL or run the model on this machine.",
            )
        )
    return out


def passthrough_status(svc: Service) -> dict | None:
    """Return what the relay link says of passthrough (None: no link, or it is off)."""
    client = svc.relay_client
    return client.status().get("passthrough") if client is not None else None


@audit_check
def check_relay_in_transit(svc: Service) -> list:
    cfg = svc.config
    host = urllib.parse.urlsplit(cfg.relay_url).hostname or ""
    if cfg.pairing != "relay" or not cfg.relay_url or is_loopback(host) or host == "localhost":
        return []
    passthrough = passthrough_status(svc) or {}
    readable = passthrough.get("terminatedLast7Days", 0)
    if passthrough.get("state") == "active":
        cert = (passthrough.get("certificate") or {}).get("certificate") or {}
        origin = passthrough.get("origin")
        return [
            finding(
                "relay-passthrough",
                "info",
                "TLS ends on this server: the relay forwards encrypted bytes (passthrough)",
                f"Clients reach this server at {origin} through the relay at {host}, which "
                "cannot read the key or the notes there; it learns addresses, server ids, "
                f"timing and sizes. The certificate is valid until {cert.get('notAfter')} and "
                f"is renewed from {cert.get('renewAt')}. {readable} request(s) in the last 7 "
                "days came by the relay's other paths (path-based links, connectors set up "
                "before, its per-server origin), where TLS ends at the relay.",
                f"Open the server at {origin}, and connect devices and connectors again "
                "there: then nothing crosses the relay in the clear.",
            )
        ]
    offered = passthrough.get("state") not in (None, "not offered")
    return [
        finding(
            "relay-sees-transit",
            "info",
            "Requests pass through a relay on another machine",
            f"The relay at {host} stores nothing at rest, but TLS ends there: whoever runs it "
            "could read the key and the notes in transit, and it learns addresses, server "
            "ids, timing and sizes. Losing it costs availability only."
            + (
                f" It offers passthrough, which is {passthrough.get('state')} here"
                f"{': ' + passthrough['reason'] if passthrough.get('reason') else ''}."
                if offered
                else ""
            ),
            "Run your own relay (python3 notesvc.py relay) or use one run by someone you "
            "trust, or one that offers passthrough (SERVICE_RELAY_TLS=passthrough), where "
            "TLS ends on this server.",
        )
    ]


@audit_check
def check_passthrough_certificate(svc: Service) -> list:
    """A passthrough certificate that cannot be renewed, or is near its end."""
    passthrough = passthrough_status(svc)
    if passthrough is not None:
        keeper = passthrough.get("certificate") or {}
        cert = keeper.get("certificate") or {}
        if keeper.get("state") != "error":
            return []
        severity = "medium" if cert else "high"
        return [
            finding(
                "passthrough-certificate",
                severity,
                "The certificate for passthrough cannot be obtained or renewed",
                f"The ACME CA ({keeper.get('acmeDirectory')}) said: {keeper.get('lastError')}. "
                f"Next try at {keeper.get('nextAttemptAt')}. "
                + (
                    f"The certificate in hand keeps serving until {cert.get('notAfter')}."
                    if cert
                    else "Until one is in hand, clients reach this server only by the "
                    "relay's terminating paths."
                ),
                "Check that the relay answers DNS for its domain (the domain delegated to "
                "it) and that SERVICE_ACME_DIRECTORY is reachable from here.",
            )
        ]
    facts = TlsFolder(svc.config.state_dir).facts()  # `audit` beside a server: the file
    if not facts or facts["notAfter"] - time.time() > 14 * 86400:
        return []
    ended = facts["notAfter"] <= time.time()
    return [
        finding(
            "passthrough-certificate",
            "medium" if ended else "low",
            "The certificate for passthrough " + ("has expired" if ended else "expires soon"),
            f"{svc.config.state_dir / 'tls'} holds one for {', '.join(facts['names'])} until "
            f"{iso(facts['notAfter'])}; a running server renews it from two thirds of its "
            "lifetime on, and says why it could not in /system/info.",
            "Look at the server's /system/info (connection.passthrough) and its log.",
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
    """Scoped keys and OAuth grants that may write and never expire (a paired device
    expires when unused for SERVICE_DEVICE_IDLE_DAYS: not forever)."""
    forever = [
        g
        for g in svc.state.read().get("grants", [])
        if g.get("scope") == "write" and svc.grants.expires(g) == math.inf
    ]
    if not forever:
        return []
    names = ", ".join(sorted(clean_name(g.get("name"), g["id"], 40) for g in forever)[:5])
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
        if epoch_of(s.get("expiresAt")) > now
        and epoch_of(s.get("createdAt")) < now - SHARE_OLD_DAYS * 86400
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


PERSON_ADMIN_IDLE_DAYS = 90


@audit_check
def check_people_admin_devices(svc: Service) -> list:
    """People whose admin devices went unused over 90 days (each can add devices and keys
    of theirs, and share their home): a lost phone, most likely."""
    now, idle = time.time(), []
    data = svc.state.read()
    names = {p["id"]: p["name"] for p in data.get("people", [])}
    for g in svc.grants.grants():
        if g.get("person") not in names or g["kind"] != "device" or g["scope"] != "admin":
            continue
        stored = next((x for x in data.get("grants", []) if x["id"] == g["id"]), None)
        if stored is None or svc.grants.expires(stored) <= now:
            continue  # expired already: it opens nothing
        last = epoch_of(g.get("lastUsedAt") or g["createdAt"])
        if last < now - PERSON_ADMIN_IDLE_DAYS * 86400:
            idle.append((names[g["person"]], clean_name(g["name"], g["id"], 40)))
    if not idle:
        return []
    shown = ", ".join(f"{who}'s {name}" for who, name in sorted(idle)[:5])
    return [
        finding(
            "people-admin-devices-unused",
            "low",
            "People's admin devices are unused",
            f"{len(idle)} admin device(s) of people here went unused for over "
            f"{PERSON_ADMIN_IDLE_DAYS} days: {shown}. Each can add keys and devices for its "
            "person and share their home.",
            "Ask them whether the device is still theirs; remove the ones that are not "
            "(DELETE /api/v1/auth/keys/:id from their device, or remove the person).",
        )
    ]


@audit_check
def check_shared_to_everyone(svc: Service) -> list:
    """A shared folder every person here may write: fine for a family folder, worth a look
    when it holds what only some should change."""
    data = svc.state.read()
    people = [p["id"] for p in data.get("people", [])]
    if not people:
        return []
    reaches = [person_reach(data, p) for p in people]
    open_to_all = sorted(
        folder
        for folder in data.get("members", {})
        if all(r.scope_at(folder) == "write" for r in reaches)
    )
    if not open_to_all:
        return []
    return [
        finding(
            "shared-write-everyone",
            "info",
            "A folder every person may change",
            f"{len(open_to_all)} shared folder(s) give write to every person here: "
            f"{', '.join(open_to_all[:5])}. Anyone of them can change or delete what is "
            "inside (history keeps every version).",
            "Nothing to do for a family folder; share read where some should only look "
            "(PUT /api/v1/folders/:path/members).",
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
