"""Handlers for what plugs in: MCP, channels, reminders, plugins, security, grants, devices,
OAuth, relay pairing, import and export, the page."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hmac
import io
import json
import posixpath
import re
import secrets
import tempfile
import urllib.parse
from collections.abc import Iterable
from typing import Any

from notesvc.audit import key_age_days, run_audit
from notesvc.auth import JWT_LIFETIME, relay_origin_of
from notesvc.boot import API, KEY_HEADER, __version__, bottle, log
from notesvc.errors import JSON_TYPE, ApiError, bad_request, not_found, ok, to_json
from notesvc.grants import (
    CHALLENGE_RE,
    OAUTH_SCOPES,
    SCOPES,
    GrantStore,
    OAuthError,
    Principal,
    _clean_name,
    made_by,
    parse_oauth_scope,
    request_principal,
    visible_attachment,
    visible_note,
)
from notesvc.helpers import (
    BODY_CHUNK,
    MultipartReader,
    _no_constant,
    base_url_of,
    behind_trusted_proxy,
    disk_writes,
    field,
    ip_of,
    is_blank,
    is_home_network,
    is_loopback,
    iso,
    log_safe,
    phone_url,
    plural,
    query_int,
    query_str,
    read_json,
    request_body_reader,
    request_header,
    request_host,
    too_large,
    utcnow,
    valid_host,
)
from notesvc.http.api import (
    MULTIPART_SLACK,
    _agent_facts,
    _limit_facts,
    _network_facts,
    get_attachment,
)
from notesvc.http.route import Route
from notesvc.notes.paths import ATTACHMENTS, MAX_SCAN_CHARS, NOTES, attachment_path, folder_path
from notesvc.plugins import _MDLINK_RE, Plugin, _md_target
from notesvc.providers.base import (
    MAX_MESSAGE_CHARS,
    MCP_HANDSHAKE_VERSIONS,
    MCP_STATELESS_VERSIONS,
    MCP_VERSIONS,
    TOOLS,
    Tool,
    UpstreamError,
    available_tools,
    call_tool,
)
from notesvc.providers.channels import (
    MAX_CONFIG_CHARS,
    TelegramError,
    _change_channel,
    _channels,
    _printable,
    channel_secret,
    configure_channel,
    handle_channel_update,
    new_binding,
    note_chat_makers,
    redact_channel,
    telegram_call,
    validate_channel_config,
)
from notesvc.search.text import MAX_QUERY_CHARS
from notesvc.service import Service, _rid
from notesvc.settings import Config
from notesvc.transfer.export import export_files, export_zip
from notesvc.transfer.formats import run_import
from notesvc.transfer.plan import import_settled
from notesvc.web import (
    consent_page,
    consent_page_headers,
    negotiated_page,
    share_page,
    share_page_headers,
    web_client_headers,
)

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
    X-Service-Key, `Authorization: Bearer` or X-API-Key (docs/api.md), or an OAuth access
    token issued for this URL (docs/api.md: Let others in). Returns who the request acts for."""
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
    maker = made_by(request_principal())  # the chats it allows are theirs (unbind_chats)
    note_chat_makers(channel, svc.channel_providers.get(name), [], maker)
    svc.state.update(lambda data: data.setdefault("channels", []).append(channel))
    log.info("channel %s (%s) created", channel["id"], name)
    channel = configure_channel(svc, channel)  # Telegram webhook mode: setWebhook
    svc.pollers.sync()
    return channel


TELEGRAM_TOKEN_RE = re.compile(r"^[0-9]{1,20}:[A-Za-z0-9_-]{1,200}\Z")  # BotFather's shape


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
    code, binding = new_binding(made_by(request_principal()))
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
    code, binding = new_binding(made_by(request_principal()))

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
    maker = made_by(request_principal())

    def merge(channels: list, i: int) -> dict:
        channel = channels[i]
        if changes is not None:
            provider = svc.channel_providers.get(channel["provider"])
            if provider is None:
                raise bad_request(f"channel provider {channel['provider']!r} is not loaded")
            stored = channel["config"]
            before = list(stored.get(provider.allow) or []) if provider.allow else []
            if "mode" not in stored and any(f.name == "mode" for f in provider.fields):
                stored = {**stored, "mode": "webhook"}  # stored before modes: a webhook
            channel["config"] = validate_channel_config(provider, {**stored, **changes})
            note_chat_makers(channel, provider, before, maker)
        if title is not None:  # only invisible characters: the name it had stays
            channel["name"] = _printable(title) or channel["name"]
        return channel

    channel = _change_channel(svc, channel_id, merge)
    log.info("channel %s changed", channel_id)
    svc.pollers.sync(join=15)  # a poller that goes is done before a webhook is set
    if changes is not None:
        channel = configure_channel(svc, channel)  # webhook mode: setWebhook again
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
                    secret=r.secret,
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
            "localOnly": svc.setup_loopback_only,
            "windowSeconds": cfg.setup_window,
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
        name,
        scope,
        folder,
        _days(body, "expiresInDays", 3650, None),
        created_by=made_by(request_principal()),
    )
    return {**record, "key": key}


def list_scoped_keys(svc: Service) -> dict:
    return {"keys": svc.grants.grants()}


# -- devices: a phone joins by scanning a code (docs/api.md: Devices) ---------------------------


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


def page_on_loopback(config: Config, environ: dict) -> bool:
    """Return whether the page asking was opened by a loopback name (127.0.0.1, ::1,
    localhost) on this machine itself: never a relayed request, nor a proxied one."""
    if environ.get("notesvc.relayed") or behind_trusted_proxy(config, environ):
        return False
    host = request_host(config, environ)
    if not valid_host(host) or not is_loopback(environ.get("REMOTE_ADDR", "")):
        return False
    name = host[1 : host.index("]")] if host.startswith("[") else host.rsplit(":", 1)[0]
    name = name.lower().rstrip(".")
    return name == "localhost" or name.endswith(".localhost") or is_loopback(name)


def pairing_origin(config: Config, state: dict, environ: dict | None) -> tuple:
    """Return (origin, via): the origin a pairing's link opens and which one it is.

    SERVICE_PUBLIC_URL's ("public"); on a page opened by a loopback name, the address the
    banner gives phones ("home": a phone can't open 127.0.0.1); else the server's own
    origin on its relay ("relay"); else the request's ("page"). Outside a request: the
    banner's address. "local" is a loopback address that only this machine opens (a
    server listening on loopback only, with no relay)."""
    url, via = _pairing_url(config, state, environ)
    parts = urllib.parse.urlsplit(url)
    if via in ("home", "page") and is_loopback(parts.hostname or ""):
        via = "local"
    return f"{parts.scheme}://{parts.netloc}", via


def _pairing_url(config: Config, state: dict, environ: dict | None) -> tuple:
    if config.public_url:
        return config.public_url, "public"
    if environ is None:
        return phone_url(config), "home"
    home = home_origin(config, environ)
    if home:
        return home, "home"
    relayed = relay_origin_of(config, state)
    return (relayed, "relay") if relayed else (base_url_of(config, environ), "page")


def home_origin(config: Config, environ: dict) -> str:
    """Return the address the banner gives phones for a page opened by a loopback name ("":
    another page, SERVICE_PUBLIC_URL, or that address is loopback too)."""
    if config.public_url or not page_on_loopback(config, environ):
        return ""
    home = phone_url(config, int(environ.get("SERVER_PORT") or 0) or config.port)
    return "" if is_loopback(urllib.parse.urlsplit(home).hostname or "") else home


def link_base(svc: Service, environ: dict) -> str:
    """Return the base of links the page shows (shares, feeds, MCP): svc.issuer's, but the
    phones' address on a page on loopback, as Add a device draws it."""
    home = home_origin(svc.config, environ)
    return home + environ.get("SCRIPT_NAME", "") if home else svc.issuer(environ)


def new_pairing(
    config: Config,
    grants: GrantStore,
    name: str,
    scope: str,
    folder: str | None,
    environ,
    created_by: str,
) -> dict:
    """Make a pairing; return {id, name, scope, folder, createdAt, expiresAt, createdBy,
    secret, url, origin, via[, qrSvg]}: the secret travels only in the link's fragment."""
    if scope not in SCOPES:
        raise bad_request("'scope' must be read, write or admin")
    if scope == "admin" and folder:
        raise bad_request("an admin device sees every note: leave out 'folder', or choose write")
    record, secret = grants.create_pairing(
        name, scope, folder, config.pairing_ttl, created_by=created_by
    )
    origin, via = pairing_origin(config, grants.state.read(), environ)
    url = f"{origin}/#pair={secret}"
    answer = {**record, "secret": secret, "url": url, "origin": origin, "via": via}
    svg = qr_svg(url)
    if svg:
        answer["qrSvg"] = svg
    return answer


def create_pairing(svc: Service) -> dict:
    body = read_json(svc.config.max_body_bytes, required=False)  # every field has a default
    name = _clean_name(field(body, "name", required=False, max_len=100), "device")
    scope = field(body, "scope", required=False) or "write"
    folder = _grant_folder(body)
    env = bottle.request.environ
    made = made_by(request_principal())
    return new_pairing(svc.config, svc.grants, name, scope, folder, env, made)


def get_addresses(svc: Service) -> dict:
    """GET /auth/devices/addresses (admin): where a phone and an AI assistant reach this
    server, as Add a device and Connect an AI assistant show them. The LAN address is
    offered only here and in a pairing, both admin: never to a folder key or a stranger."""
    env, cfg = bottle.request.environ, svc.config
    origin, via = pairing_origin(cfg, svc.state.read(), env)
    relayed = bool(cfg.relay_url) and cfg.pairing == "relay"
    mcp = (svc.relay_base(env) if relayed else link_base(svc, env)) + API + "/mcp"
    mcp_via = "relay" if relayed else via if via in ("public", "home") else "page"
    return {"phone": {"origin": origin, "via": via}, "mcpUrl": mcp, "mcpVia": mcp_via}


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
        svc.lockout.fail(addr, secret)
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
    """DELETE /auth/keys/<id>[?cascade=true]: the grant, its share links and the pairings it
    made that wait; with cascade also every grant it made (by `createdBy`, and theirs)."""
    cascade = _yes(bottle.request.query.get("cascade"), "cascade")
    gone = svc.grants.revoke(grant_id, cascade=cascade)
    if not gone:
        raise not_found(f"no key or OAuth grant {grant_id}")
    answer = {"id": grant_id, "revoked": True}
    return {**answer, "alsoRevoked": gone[1:]} if cascade else answer


def share_url(svc: Service, environ: dict, token: str) -> str:
    """Return a share link: in relay mode on the server's relay origin (or {relay}/r/<id>;
    with no relay, its own /r/<id>), else <base>/s/<token>; bases as link_base has them."""
    if svc.config.pairing != "relay":
        return f"{link_base(svc, environ)}/s/{token}"
    home = "" if svc.config.relay_url else home_origin(svc.config, environ)
    base = f"{home}/r/{svc.state.read()['serverId']}" if home else svc.relay_base(environ)
    return f"{base}/s/{token}"


def create_share(svc: Service) -> dict:
    body = read_json(svc.config.max_body_bytes)
    path = visible_note(svc.notes, field(body, "path"))
    days = _days(body, "expiresInDays", 365, 7)
    if not svc.notes.exists(path):
        raise not_found(f"no note at {path}")
    record, token = svc.grants.create_share(path, days, request_principal())
    log.info("share link %s created for a note", record["id"])
    url = share_url(svc, bottle.request.environ, token)
    return {**record, "url": url, "homeOnly": opens_only_at_home(url)}


HOME_NAME_RE = re.compile(r"(?:[^.]+|.+\.(?:local|lan|home\.arpa|internal|localhost))")


def opens_only_at_home(url: str) -> bool:
    """Return whether a link names a host only this machine or its network reaches: a
    loopback, private or link-local address, localhost, a single label, .local, .lan."""
    host = (urllib.parse.urlsplit(url).hostname or "").lower().rstrip(".")
    if ip_of(host) is not None:
        return is_home_network(host)
    return bool(HOME_NAME_RE.fullmatch(host))


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
        svc.grants.share_misses.fail(addr, token)
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
    grant = {
        "challenge": challenge,
        "scope": wanted,
        "folder": folder,
        "resource": resource,
        "createdBy": made_by(request_principal()),  # the owner, or the admin device
    }
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


# -- import and export (docs/api.md: Import) -------------------------------------------------------

IMPORT_BODY_TYPES = {  # a raw body's type -> the file name it stands for
    "application/zip": "import.zip",
    "application/x-zip-compressed": "import.zip",
    "application/xml": "import.enex",
    "text/xml": "import.enex",
    "application/enex+xml": "import.enex",
    "application/x-tar": "import.jex",
    "application/json": "import.json",
    "text/markdown": "import.md",
    "text/plain": "import.txt",
    "application/octet-stream": "",
}


def _yes(raw: Any, name: str) -> bool:
    value = str(raw or "").strip().lower()
    if value in ("", "0", "false", "no"):
        return False
    if value in ("1", "true", "yes"):
        return True
    raise bad_request(f"'{name}' must be true or false")


def post_import(svc: Service) -> bytes:
    """POST /import: a zip, .enex, .jex or Keep .json, as the multipart field `file` (with
    `into`, `dryRun`) or as the raw body (?into=&dryRun=); 201, a dry run 200."""
    import email.message

    parsed = email.message.Message()
    parsed["Content-Type"] = request_header("Content-Type") or ""
    ctype = parsed.get_content_type()
    limit = svc.config.max_import_bytes
    fields = {"into": query_str("into"), "dryRun": query_str("dryRun")}
    if ctype != "multipart/form-data" and ctype not in IMPORT_BODY_TYPES:
        raise ApiError(
            415,
            "UNSUPPORTED_MEDIA_TYPE",
            "send the file as multipart/form-data (field file), or as a raw body of type "
            "application/zip, application/xml (.enex) or application/x-tar (.jex)",
        )
    with disk_writes():
        spool = tempfile.TemporaryFile(dir=svc.config.state_dir)  # noqa: SIM115 (closed below)
    try:
        with disk_writes():
            if ctype == "multipart/form-data":
                filename = _receive_import_form(svc, parsed, spool, fields)
            else:
                filename = IMPORT_BODY_TYPES[ctype]
                read, _ = request_body_reader(limit, "SERVICE_MAX_IMPORT_BYTES")
                while chunk := read(BODY_CHUNK):
                    spool.write(chunk)
            spool.flush()
        spool.seek(0)
        dry = _yes(fields["dryRun"], "dryRun")
        into = fields["into"] or None
        report = run_import(svc, spool, filename, into, dry, request_principal())
    finally:
        spool.close()
        import_settled()
    log.info(
        "request %s: import%s of %s and %s into %s (%d skipped)",
        _rid(),
        " (dry run)" if dry else "",
        plural(report["created"], "note"),
        plural(report["attachments"], "file"),
        report["into"],
        len(report["skipped"]),
    )
    return ok(report, 200 if dry else 201)


def _receive_import_form(svc: Service, parsed: Any, spool: Any, fields: dict) -> str:
    """Read a multipart import: its `file` into spool, `into` and `dryRun` into fields;
    return the file's name."""
    limit = svc.config.max_import_bytes
    read, _ = request_body_reader(limit + MULTIPART_SLACK, "SERVICE_MAX_IMPORT_BYTES")
    reader = MultipartReader(read, str(parsed.get_param("boundary") or ""))
    form: dict = {"into": bytearray(), "dryRun": bytearray(), "file": None}

    def part(name: str, filename: Any, headers: Any):
        if name in ("into", "dryRun"):
            return form[name].extend, 2048, lambda: bad_request(f"'{name}' is too long")
        if name != "file":
            return None
        if form["file"] is not None:
            raise bad_request("send one part named 'file'")
        form["file"] = str(filename or "")
        return spool.write, limit, lambda: too_large(limit, "SERVICE_MAX_IMPORT_BYTES")

    reader.parts(part)
    if form["file"] is None:
        raise bad_request("the form has no part named 'file'")
    for name in ("into", "dryRun"):
        if form[name]:
            try:
                fields[name] = bytes(form[name]).decode("utf-8").strip()
            except UnicodeDecodeError:
                raise bad_request(f"'{name}' is not valid UTF-8") from None
    return form["file"]


def get_export(svc: Service):
    """GET /export.zip: the notes, attachments and other files the key sees, streamed."""
    principal = request_principal()
    if bottle.request.environ.get("notesvc.relayed"):  # the relay carries bounded answers
        total = sum(st.st_size for _, _, st in export_files(svc.config.root, principal))
        if total > svc.config.max_body_bytes:
            raise too_large_for_relay(total, svc.config.max_body_bytes)
    stamp = utcnow().strftime("%Y-%m-%d")
    resp = bottle.response
    resp.content_type = "application/zip"
    resp.set_header("Content-Disposition", f'attachment; filename="notesvc-export-{stamp}.zip"')
    resp.set_header("Cache-Control", "no-store")
    log.info("request %s: export of %s", _rid(), principal.folder or "every note")
    return export_zip(svc.config.root, principal)


def too_large_for_relay(size: int, limit: int) -> ApiError:
    return ApiError(
        413,
        "PAYLOAD_TOO_LARGE",
        f"the export holds {size} bytes, more than the relay carries ({limit}, "
        "SERVICE_MAX_BODY_BYTES): export on the server's own address, or run "
        "python3 notesvc.py export OUT.zip there",
    )


# -- the built-in web client (GET /) ----------------------------------------------------


def get_web_client(svc: Service):
    """GET /: the page, gzipped once at start and sent so when asked (a HEAD as not)."""
    env = bottle.request.environ
    asked = env.get("HTTP_ACCEPT_ENCODING", "") if env["REQUEST_METHOD"] != "HEAD" else ""
    body, headers = negotiated_page("client", asked)
    bottle.response.content_type = "text/html; charset=utf-8"
    for name, value in {**web_client_headers(), **headers}.items():
        bottle.response.set_header(name, value)
    return body
