"""ApiError, the envelope, and the one renderer of every failure."""

from __future__ import annotations

import json
from typing import Any

from notesvc.boot import API, bottle

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
    code in `data` (docs/api.md)."""
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
