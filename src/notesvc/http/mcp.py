"""MCP over JSON-RPC 2.0: /mcp's tools, resources and prompts, in both protocol eras."""

from __future__ import annotations

import base64
import json
import re
from typing import Any

from notesvc.boot import API, __version__, bottle, log
from notesvc.errors import JSON_TYPE, ApiError, to_json
from notesvc.grants import Principal, request_principal, visible_note
from notesvc.helpers import no_constant
from notesvc.http.mcp_sessions import McpSession, mcp_sessions, terminated_relay
from notesvc.mcp_resources import (
    HEADER_MISMATCH,
    INVALID_PARAMS,
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    PARSE_ERROR,
    RESOURCE_NOT_FOUND,
    RESOURCE_TEMPLATES,
    UNSUPPORTED_VERSION,
    McpError,
    complete,
    get_prompt,
    list_prompts,
    list_resources,
    parse_uri,
    read_resource,
)
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
from notesvc.suggestions import connector_of
from notesvc.tools import REVIEW_URI, SUGGESTION_OUTPUT
from notesvc.web import REVIEW_CSP_META, REVIEW_HTML

# -- MCP over JSON-RPC 2.0 (Streamable HTTP) ---------------------------------------------------
#
# POST /api/v1/mcp takes one JSON-RPC message and answers it with one JSON object. Two eras
# share it, told apart the way the official SDKs route them: by the MCP-Protocol-Version
# header (none, or a handshake-era version: the handshake era).
#   2025-06-18, 2025-11-25: `initialize` (on a direct connection it opens a session:
#     Mcp-Session-Id, http/mcp_sessions.py; a POST without the header stands alone),
#     `notifications/initialized` (202), `ping`, tools, resources (subscriptions need the
#     session and its GET stream), prompts. DELETE with the session ends it.
#   2026-07-28 (stateless): no handshake; each request carries its version and capabilities
#     in `params._meta`, and the MCP-Protocol-Version, Mcp-Method and Mcp-Name headers must
#     repeat the body (-32020 when they do not); an unknown version is -32022 with the list.
#     `server/discover`, tools, resources (no subscriptions), prompts; results carry
#     `resultType: "complete"`.

_HANDSHAKE_ERA = ("2024-11-05", "2025-03-26", *MCP_HANDSHAKE_VERSIONS)
META_VERSION = "io.modelcontextprotocol/protocolVersion"
META_CAPABILITIES = "io.modelcontextprotocol/clientCapabilities"
META_SERVER_INFO = "io.modelcontextprotocol/serverInfo"
# The HTTP status of a stateless-era error (the SDKs' table); in the handshake era a body
# that cannot be taken is 400 and every other error 200.
_STATELESS_STATUS = {METHOD_NOT_FOUND: 404, RESOURCE_NOT_FOUND: 404}
_HANDSHAKE_400 = (PARSE_ERROR, INVALID_REQUEST, UNSUPPORTED_VERSION)
MCP_LIST_TTL_MS = 60000  # how long a stateless client may cache the tool list
MCP_INSTRUCTIONS = (
    "The user's Markdown notes, paths like notes/<folders>/<name>.md. Find notes with "
    "search_notes (or list_folder, recent_changes) and read them with read_note before "
    "answering from them; name the paths you used. To change a note, read it first and pass "
    "its etag to update_note or move_note. note_history and note_diff show what a note was. "
    "The notes are also resources (notesvc://note/<path>), and the prompts ingest, "
    "weekly-review, summarize-folder and tidy start the usual wiki work."
)
SUGGEST_INSTRUCTIONS = (
    " Changes are suggestions here: the write tools change nothing until the user accepts "
    "them; say so, and give the suggestion's link."
)
SESSION_HEADER = "Mcp-Session-Id"


def capabilities(subscribe: bool) -> dict:
    """Return the server's capabilities: resources subscribed to only where a session and
    its stream can carry the notifications."""
    return {
        "tools": {"listChanged": False},
        "resources": {"subscribe": subscribe, "listChanged": subscribe},
        "prompts": {"listChanged": False},
        "completions": {},
    }


def instructions(svc: Service) -> str:
    suggest = svc.config.mcp_write == "suggest"
    return MCP_INSTRUCTIONS + (SUGGEST_INSTRUCTIONS if suggest else "")


def server_info() -> dict:
    return {"name": "notesvc", "title": "notesvc notes", "version": __version__}


class RpcError(McpError):
    """A JSON-RPC error answer (its HTTP status follows from the code and the era)."""

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


def request_session(svc: Service, env: dict) -> McpSession | None:
    """Return the session a request names (Mcp-Session-Id), None when it names none (or
    came through a terminating relay, where there are none); 404 for one unknown, dropped,
    or made by another principal (credentials were checked before)."""
    sid = env.get("HTTP_MCP_SESSION_ID")
    if sid is None or terminated_relay(env):
        return None
    return mcp_sessions(svc).find(sid.strip(), request_principal())


def mcp_endpoint(svc: Service) -> bytes:
    """POST /mcp: one JSON-RPC message in; its answer out, or 202 for a notification."""
    env = bottle.request.environ
    stateless = _stateless_era(env, None)
    request_id = None
    session = request_session(svc, env)
    env["notesvc.mcp_session"] = session
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
    except McpError as e:
        rpc = e if isinstance(e, RpcError) else RpcError(e.code, e.message, e.data)
        answer, status = rpc.answer(request_id), rpc.http_status(stateless)
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
        direct = not terminated_relay(env)
        if direct:  # a session (optional for the client): what subscriptions need
            session = mcp_sessions(svc).create(request_principal(), version)
            bottle.response.set_header(SESSION_HEADER, session.id)
        return {
            "protocolVersion": version,
            "capabilities": capabilities(direct),
            "serverInfo": server_info(),
            "instructions": instructions(svc),
        }
    header = env.get("HTTP_MCP_PROTOCOL_VERSION")
    if header is not None:
        _check_version(header, MCP_HANDSHAKE_VERSIONS)
    if method == "ping":
        return {}
    return _method(svc, method, params, env.get("notesvc.mcp_session"))


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
            "capabilities": capabilities(False),
            "instructions": instructions(svc),
            "cacheScope": "private",
            "ttlMs": MCP_LIST_TTL_MS,
        }
    else:
        result = _method(svc, method, params, None)
    if method == "tools/list":
        result.update(cacheScope="private", ttlMs=MCP_LIST_TTL_MS)
    return {**result, "resultType": "complete", "_meta": {META_SERVER_INFO: server_info()}}


def _method(svc: Service, method: str, params: dict, session: McpSession | None) -> dict:
    """Answer a request of either era: tools, resources, prompts."""
    if method == "tools/list":
        _single_page(params)
        tools = available_tools(svc, svc.config.mcp_write)
        suggest = svc.config.mcp_write == "suggest"
        return {"tools": [mcp_tool(t, suggest) for t in tools]}
    if method == "tools/call":
        return _tools_call(svc, params.get("name"), params.get("arguments"))
    if method == "resources/list":
        return list_resources(svc, params.get("cursor"))
    if method == "resources/templates/list":
        _single_page(params)
        return {"resourceTemplates": RESOURCE_TEMPLATES}
    if method == "resources/read":
        uri = params.get("uri")
        if uri == REVIEW_URI:
            return {"contents": [review_card()]}
        return read_resource(svc, uri, _api_base(svc))
    if method in ("resources/subscribe", "resources/unsubscribe"):
        return _subscription(svc, method, params.get("uri"), session)
    if method == "prompts/list":
        _single_page(params)
        return list_prompts()
    if method == "prompts/get":
        return get_prompt(svc, params.get("name"), params.get("arguments"))
    if method == "completion/complete":
        return complete(svc, params.get("ref"), params.get("argument"))
    raise RpcError(METHOD_NOT_FOUND, f"method {method[:64]!r} is not served here")


def _single_page(params: dict) -> None:
    if params.get("cursor") is not None:
        raise RpcError(INVALID_PARAMS, "unknown cursor: this list has a single page")


def _api_base(svc: Service) -> str:
    env = bottle.request.environ
    return svc.base_url(env) + env.get("SCRIPT_NAME", "") + API


def _subscription(svc: Service, method: str, uri: Any, session: McpSession | None) -> dict:
    """resources/subscribe and unsubscribe: a note URI of the caller's reach, for the
    session's stream; -32600 without a session, -32602 for a URI that is not a note's or
    over the session's cap, -32002 for a note it cannot see."""
    if session is None:
        raise RpcError(
            INVALID_REQUEST,
            f"subscriptions need a session: send the {SESSION_HEADER} header initialize "
            "gave (not available through the relay's link), and hold the session's GET "
            "stream for the notifications",
        )
    kind, path, _ = parse_uri(uri)
    if kind != "note":
        raise RpcError(INVALID_PARAMS, "subscriptions are to notes (notesvc://note/<path>)")
    if method == "resources/unsubscribe":
        mcp_sessions(svc).unsubscribe(session, uri)
        return {}
    try:
        visible_note(svc.notes, path)
    except ApiError as e:
        code = RESOURCE_NOT_FOUND if e.status_code in (403, 404) else INVALID_PARAMS
        raise RpcError(
            code, "Resource not found" if code < -32600 else e.message, {"uri": uri}
        ) from None
    try:
        mcp_sessions(svc).subscribe(session, uri)
    except ApiError as e:
        raise RpcError(INVALID_PARAMS, e.message, {"uri": uri}) from None
    return {}


def review_card() -> dict:
    """Return the MCP App resource ui://notesvc/review: one self-contained page (no remote
    loads; the host's CSP asks no domains, the page's own allows only its inline code)."""
    return {
        "uri": REVIEW_URI,
        "mimeType": "text/html;profile=mcp-app",
        "text": REVIEW_HTML,
        "_meta": {
            "ui": {
                "csp": {"connectDomains": [], "resourceDomains": [], "frameDomains": []},
                "prefersBorder": True,
            },
            "contentSecurityPolicy": REVIEW_CSP_META,
        },
    }


def mcp_tool(tool: Tool, suggest: bool = False) -> dict:
    """Return a tool as MCP's tools/list describes it (in suggest mode a write tool answers
    the suggestion it made, which the review card shows)."""
    described = {
        "name": tool.name,
        "title": tool.annotations()["title"],
        "description": tool.description,
        "inputSchema": tool.schema,
        "annotations": tool.annotations(),
    }
    output = tool.output
    writes_here = suggest and not tool.read_only and not tool.app_only
    if writes_here:
        output = {"type": "object", "properties": SUGGESTION_OUTPUT, "required": ["suggestion"]}
        described["description"] += (
            " Here it makes a suggestion the user accepts or rejects; nothing changes until then."
        )
    if output is not None:
        described["outputSchema"] = output
    ui: dict = {}
    if tool.review and (writes_here or tool.read_only):
        ui["resourceUri"] = REVIEW_URI
    if tool.app_only:
        ui["visibility"] = ["app"]
    if ui:
        described["_meta"] = {
            "ui": ui,
            **({"ui/resourceUri": REVIEW_URI} if "resourceUri" in ui else {}),
        }
    return described


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
    suggest = svc.config.mcp_write == "suggest" and not offered[name].app_only
    connector = connector_of(svc, request_principal()) if suggest else None
    return call_tool(svc, offered[name], arguments or {}, connector)


# -- the GET stream and DELETE ------------------------------------------------------------------


def _no_session_here(method: str) -> ApiError:
    return ApiError(
        405,
        "METHOD_NOT_ALLOWED",
        f"{method} {API}/mcp needs a session ({SESSION_HEADER} from initialize, on a "
        "direct connection: not through the relay's link); send JSON-RPC with POST",
        {"Allow": "POST, GET, DELETE"},
    )


def mcp_stream(svc: Service):
    """GET /mcp with a session: its stream of notifications (text/event-stream)."""
    env = bottle.request.environ
    if env.get("REQUEST_METHOD") == "HEAD":  # (Bottle's GET routes take HEAD): no stream
        raise _no_session_here("HEAD")
    if env.get("HTTP_MCP_SESSION_ID") is None or terminated_relay(env):
        raise _no_session_here("GET")
    session = request_session(svc, env)
    accept = env.get("HTTP_ACCEPT", "")
    if "text/event-stream" not in accept and "*/*" not in accept:
        raise ApiError(
            406, "NOT_ACCEPTABLE", "the stream is text/event-stream: ask for it in Accept"
        )
    body = mcp_sessions(svc).open_stream(session, request_principal(), env)
    bottle.response.content_type = "text/event-stream"
    bottle.response.set_header("Cache-Control", "no-store")
    bottle.response.set_header("X-Accel-Buffering", "no")  # nginx: pass each event at once
    bottle.response.set_header(SESSION_HEADER, session.id)
    return body


def mcp_end_session(svc: Service):
    """DELETE /mcp with a session: end it (204); without one 405."""
    env = bottle.request.environ
    if env.get("HTTP_MCP_SESSION_ID") is None or terminated_relay(env):
        raise _no_session_here("DELETE")
    mcp_sessions(svc).end(request_session(svc, env))
    bottle.response.status = 204
    return b""
