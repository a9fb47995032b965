"""NotesApp (the middleware) and create_app."""

from __future__ import annotations

import contextlib
import gzip
import io
import logging
import os
import random
import re
import time
from collections.abc import Iterable
from typing import Callable

from notesvc.boot import API, bottle, log
from notesvc.errors import JSON_TYPE, ApiError, error_body, jsonrpc_error_body, ok, render_error
from notesvc.grants import SCOPES
from notesvc.helpers import log_safe, quick_info
from notesvc.http.caldav import CAL_METHODS, caldav_callback, well_known_caldav
from notesvc.http.dav import DAV_METHODS, DAV_PREFIX
from notesvc.http.integrations import plugin_routes
from notesvc.http.mcp import authenticate_mcp, cors_allows
from notesvc.http.route import GZIP_MIN_BYTES, Route, compressible_type
from notesvc.http.routes import ROUTES, channel_routes
from notesvc.plugins import build_service
from notesvc.relay import RELAYED_WELL_KNOWN_RE
from notesvc.service import Service
from notesvc.settings import Config, ConfigError, load_config
from notesvc.web import accepts_gzip, page_bytes

# -- the application ------------------------------------------------------------------


def _callback(svc: Service, route: Route) -> Callable:
    """Wrap a handler: authenticate, call, put dicts in the envelope, hide crashes."""

    def callback(**kwargs):
        env = bottle.request.environ
        env["notesvc.gzip"] = route.gzip  # the middleware may compress its answer
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
            if principal.person and route.scope == "admin" and not route.people:
                raise ApiError(
                    403,
                    "FORBIDDEN",
                    "this is the owner's: a person manages their own devices, keys, "
                    "connectors and feeds only",
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


_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._-]{8,64}\Z")
# Request ids name a request in the log, they guard nothing: a seeded generator, not a
# system call for each (os.urandom hands the GIL to another thread every time).
_REQUEST_IDS = random.Random(os.urandom(16))  # noqa: S311 - not a secret
# share tokens and feed secrets never reach the log: /s/…<last 4>, /ics/…<last 4>
_SHARE_PATH_RE = re.compile(r"(/s/|/shared/|/ics/)[^/]*?([^/]{0,4}?)(?:\.ics)?(?=/|$)")
_RELAY_PREFIX_RE = re.compile(r"^/r/[^/]+(?=/)")
_RELAYED_RE = re.compile(r"^/r/([^/]+)(/.*)?$")
CORS_HEADERS = (
    "X-Service-Key, Content-Type, Authorization, If-Match, If-None-Match, Range, If-Range, "
    "X-API-Key, Idempotency-Key, MCP-Protocol-Version, Mcp-Method, Mcp-Name, Mcp-Session-Id, "
    "Last-Event-ID"  # from MCP-Protocol-Version on: /mcp's
)
CORS_EXPOSE = (
    "ETag, Location, X-Request-Id, Retry-After, Content-Range, Content-Disposition, Mcp-Session-Id"
)
CORS_METHODS = "GET, POST, PUT, PATCH, DELETE, OPTIONS"


@contextlib.contextmanager
def _compiled_once(router):
    """Let Bottle's router compile each method's combined pattern once, after the last
    route is added: it compiles it again at every route added (bottle 0.12 and 0.13), a
    tenth of a start's CPU time with this app's routes."""
    compile_method = getattr(router, "_compile", None)
    if compile_method is None:  # another Bottle: its own way
        yield
        return
    methods: set = set()
    router._compile = methods.add
    try:
        yield
    finally:
        del router._compile
        for method in sorted(methods):
            compile_method(method)


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
        with _compiled_once(self.bottle.router):
            for r in service.routes:
                self.bottle.route(r.rule, r.method, _callback(service, r))
            dav = caldav_callback(service)  # WebDAV and CalDAV: their own methods and answers
            for method in DAV_METHODS + CAL_METHODS:
                for rule in (DAV_PREFIX, DAV_PREFIX + "/", DAV_PREFIX + "/<path:path>"):
                    self.bottle.route(rule, method, dav)
            self.bottle.route("/.well-known/caldav", "ANY", lambda: well_known_caldav(service))
        self._jsonrpc_rules = frozenset(r.rule for r in service.routes if r.jsonrpc)

    def answers_jsonrpc(self, path: str) -> bool:
        """Return whether a request path (under /r/<id> or not) is a route answering JSON-RPC,
        whose every failure is then a JSON-RPC error (render_error, waitress's refusals)."""
        if path.startswith("/r/"):
            path = _RELAY_PREFIX_RE.sub("", path)
        return path in self._jsonrpc_rules

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
        rid = rid if _REQUEST_ID_RE.match(rid) else f"{_REQUEST_IDS.getrandbits(64):016x}"
        environ["notesvc.request_id"] = rid
        method = environ.get("REQUEST_METHOD", "GET")
        cors = self._cors_origin(environ.get("HTTP_ORIGIN", ""))
        path = environ.get("PATH_INFO", "")
        environ["notesvc.jsonrpc"] = self.answers_jsonrpc(path)
        status_seen = []
        held: list = []  # the answer's start, sent once its body is known (gzip_answer)

        def respond(status: str, headers: list, exc_info=None):
            status_seen.append(status)
            headers.append(("X-Request-Id", rid))
            headers.append(("X-Content-Type-Options", "nosniff"))
            api = path.startswith(API) or path.startswith("/r/")
            if api and not any(k.lower() == "cache-control" for k, _ in headers):
                headers.append(("Cache-Control", "no-store"))
            if cors:
                headers.append(("Access-Control-Allow-Origin", cors))
                headers.append(("Access-Control-Expose-Headers", CORS_EXPOSE))
                headers.append(("Vary", "Origin"))
            held[:] = [status, headers, exc_info]
            return _no_write

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
            status, headers, exc_info = held
            body = gzip_answer(environ, status, headers, body)
            start_response(status, headers, exc_info)
        finally:
            spooled = environ.get("bottle.request.body")  # Bottle's temp file of a body
            if spooled is not None and not isinstance(spooled, io.BytesIO):  # over 100 KB
                with contextlib.suppress(Exception):
                    spooled.close()
            if log.isEnabledFor(logging.INFO):
                try:  # WSGI hands the path over as latin-1; log the UTF-8 it was
                    shown = path.encode("latin-1").decode("utf-8")
                except UnicodeError:
                    shown = path
                quick_info(
                    "%s %s %s %.1fms %s",
                    log_safe(method, 32),
                    log_safe(_SHARE_PATH_RE.sub(r"\1…\2", shown)),
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
        known = path.startswith("/.well-known/") and RELAYED_WELL_KNOWN_RE.match(path)
        if known:  # RFC 8414 / 9728: the issuer's path follows the well-known name
            path = f"/r/{known.group(2)}/.well-known/{known.group(1)}{known.group(3) or ''}"
        m = path.startswith("/r/") and _RELAYED_RE.match(path)
        if m:
            if m.group(1) != self.service.state.read()["serverId"]:
                message = "no such server on this relay"
                return _plain_error(respond, 404, "NOT_FOUND", message, environ["notesvc.jsonrpc"])
            inner = m.group(2) or "/"
            environ["SCRIPT_NAME"] = environ.get("SCRIPT_NAME", "") + f"/r/{m.group(1)}"
            environ["PATH_INFO"] = inner.encode("utf-8").decode("latin-1")
        return self.bottle(environ, respond)


def _no_write(data: bytes) -> None:
    raise RuntimeError("notesvc answers by returning its body, never by write()")


def gzip_answer(environ: dict, status: str, headers: list, body: Iterable[bytes]):
    """Return an answer's body, gzipped when its route allows it (a page, script or JSON
    without a secret: `notesvc.gzip`), the client takes gzip, and it is a whole 200 of at
    least GZIP_MIN_BYTES; `headers` (changed in place) then say so, with the new length.
    Every answer such a route gives says `Vary: Accept-Encoding`. Left alone: a HEAD, a
    stream (a file's chunks), a range, WebDAV and files (no such route); the ETag stays the
    one of the bytes before compression (docs/api.md: Compression)."""
    if not environ.get("notesvc.gzip"):
        return body
    named = {k.lower(): v for k, v in headers}
    vary = ",".join(v for k, v in headers if k.lower() == "vary").lower()
    if "accept-encoding" not in vary:
        headers.append(("Vary", "Accept-Encoding"))
    asked = environ.get("REQUEST_METHOD") != "HEAD" and accepts_gzip(
        environ.get("HTTP_ACCEPT_ENCODING", "")
    )
    if not asked or not _whole_plain_answer(status, named, body):
        return body
    packed = gzip.compress(b"".join(body), 6)
    headers[:] = [(k, v) for k, v in headers if k.lower() != "content-length"]
    headers += [("Content-Encoding", "gzip"), ("Content-Length", str(len(packed)))]
    return [packed]


def _whole_plain_answer(status: str, named: dict, body: Iterable[bytes]) -> bool:
    """Return whether an answer is a whole 200 of a compressible type, not yet encoded,
    held in memory and of at least GZIP_MIN_BYTES (a stream, a range: no)."""
    if not status.startswith("200 ") or "content-encoding" in named or "content-range" in named:
        return False
    if not compressible_type(named.get("content-type", "")) or not isinstance(body, list):
        return False
    return all(isinstance(c, bytes) for c in body) and sum(map(len, body)) >= GZIP_MIN_BYTES


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
    page_bytes("client")  # the page and its gzip, made once now (docs/api.md: Compression)
    service = build_service(config).start()
    routes = ROUTES + channel_routes(service.channel_providers)
    return NotesApp(service, routes + plugin_routes(service.plugins.values()))


def __getattr__(name: str):
    # `notesvc.app`: built on first use, so importing the module touches no files.
    if name == "app":
        globals()["app"] = create_app()
        return globals()["app"]
    raise AttributeError(name)
