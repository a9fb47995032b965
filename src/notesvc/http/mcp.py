"""MCP over JSON-RPC 2.0: /mcp's tools for assistants, in both protocol eras."""

from __future__ import annotations

import base64
import json
import re
from typing import Any

from notesvc.boot import __version__, bottle, log
from notesvc.errors import JSON_TYPE, ApiError, to_json
from notesvc.grants import Principal, request_principal
from notesvc.helpers import no_constant
from notesvc.providers.base import (
    MCP_HANDSHAKE_VERSIONS,
    MCP_STATELESS_VERSIONS,
    MCP_VERSIONS,
    TOOLS,
    Tool,
    available_tools,
    call_tool,
)
from notesvc.service import Service, current_request_id
from notesvc.settings import Config

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
        message = json.loads(raw.decode("utf-8"), parse_constant=no_constant)
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
        if known is not None and not request_principal().whole and TOOLS.get(name) is not known:
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
    log.debug("request %s: MCP tool %s", current_request_id(), name)
    return call_tool(svc, offered[name], arguments or {})
