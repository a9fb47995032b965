"""MCP sessions: Mcp-Session-Id, the GET stream (SSE), subscriptions and their notifications.

`initialize` (2025-06-18, 2025-11-25) on a direct connection opens a session bound to the
principal that made it; sessions are optional (a POST without the header is served alone).
While the client holds the session's GET stream, a change of a note it subscribed to sends
`notifications/resources/updated`, and a create, move or delete in its reach sends
`notifications/resources/list_changed` (debounced 1 s). The stream follows the change
journal, as the change feed does, and holds one of the feed's waiting places (the shared
cap of long polls: over it, 429).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

from notesvc.boot import log
from notesvc.errors import ApiError
from notesvc.grants import OWNER, Principal
from notesvc.mcp_resources import resource_uri
from notesvc.service import Service

STREAM_POOL = "direct"  # the change feed's pool of direct waiters: both hold a worker thread


def terminated_relay(environ: dict) -> bool:
    """Return whether a request came through the relay's terminating modes (no sessions
    there: the relay passes Mcp-Session-Id neither way); a spliced passthrough connection
    (passthrough/server.py: TLS ends here) is served like a direct one."""
    return bool(environ.get("notesvc.relayed")) and not environ.get("notesvc.spliced")


def who_of(principal: Principal) -> tuple:
    """Return what a session is bound to: the owner, or one grant."""
    return (principal.kind, principal.grant_id)


_CREDENTIAL_HEADERS = ("HTTP_X_SERVICE_KEY", "HTTP_X_API_KEY", "HTTP_AUTHORIZATION")


@dataclasses.dataclass
class McpSession:
    id: str
    who: tuple  # who_of the principal that made it
    version: str  # the protocol version initialize settled
    used: float  # monotonic time of its last request
    subscriptions: set = dataclasses.field(default_factory=set)  # note URIs
    stream: int = 0  # the number of its latest GET stream (a second GET replaces the first)
    ended: bool = False  # DELETE, dropped (idle, over the cap): its stream ends


class McpSessions:
    """The sessions of this server, in memory: at most MAX_SESSIONS (the least recently used
    dropped first), each dropped after IDLE_SECONDS unused. A GET stream lasts
    SERVICE_MCP_STREAM_SECONDS (10 minutes); the client then opens another."""

    MAX_SESSIONS = 256
    IDLE_SECONDS = 3600
    COMMENT_SECONDS = 15.0  # a comment line this often keeps proxies from closing it
    CHECK_SECONDS = 1.0  # how often a stream asks whether its credential is still good
    DEBOUNCE_SECONDS = 1.0  # list_changed at most this often
    MAX_SUBSCRIPTIONS = 1000  # a session's subscriptions: beyond it, -32602 said so

    def __init__(self, svc: Service):
        self.svc = svc
        self._lock = threading.Lock()
        self._sessions: collections.OrderedDict = collections.OrderedDict()

    def _drop_idle(self, now: float) -> None:
        while self._sessions:
            first = next(iter(self._sessions.values()))
            if now - first.used < self.IDLE_SECONDS:
                return
            self._sessions.popitem(last=False)
            first.ended = True

    def create(self, principal: Principal, version: str) -> McpSession:
        """Open a session for `principal` (dropping the least recently used over the cap)."""
        now = time.monotonic()
        session = McpSession(secrets.token_urlsafe(16)[:22], who_of(principal), version, now)
        with self._lock:
            self._drop_idle(now)
            while len(self._sessions) >= self.MAX_SESSIONS:
                _, dropped = self._sessions.popitem(last=False)
                dropped.ended = True
            self._sessions[session.id] = session
        self.svc.journal.nudge()  # a stream of a dropped session ends now
        return session

    def find(self, sid: Any, principal: Principal) -> McpSession:
        """Return the live session `sid` of this principal (touched); 404 for an unknown or
        dropped one, or one another principal made."""
        now = time.monotonic()
        with self._lock:
            self._drop_idle(now)
            session = self._sessions.get(sid) if isinstance(sid, str) else None
            if session is None or session.who != who_of(principal):
                raise ApiError(
                    404,
                    "NOT_FOUND",
                    "no such MCP session (ended, dropped after an hour unused, or made with "
                    "another credential): initialize again",
                )
            session.used = now
            self._sessions.move_to_end(sid)
            return session

    def end(self, session: McpSession) -> None:
        with self._lock:
            self._sessions.pop(session.id, None)
            session.ended = True
        self.svc.journal.nudge()

    def count(self) -> int:
        with self._lock:
            return len(self._sessions)

    # -- subscriptions ---------------------------------------------------------------------

    def subscribe(self, session: McpSession, uri: str) -> None:
        with self._lock:
            if uri not in session.subscriptions and (
                len(session.subscriptions) >= self.MAX_SUBSCRIPTIONS
            ):
                raise ApiError(
                    400,
                    "VALIDATION_ERROR",
                    f"a session holds at most {self.MAX_SUBSCRIPTIONS} subscriptions: "
                    "unsubscribe from some, or follow resources/list_changed instead",
                )
            session.subscriptions.add(uri)

    def unsubscribe(self, session: McpSession, uri: str) -> None:
        with self._lock:
            session.subscriptions.discard(uri)

    # -- the GET stream ----------------------------------------------------------------------

    def credential_of(self, environ: dict) -> dict:
        """Return the credential headers of a request: what a stream checks again."""
        return {k: environ[k] for k in _CREDENTIAL_HEADERS if k in environ}

    def principal_now(self, credential: dict, first: Principal) -> Principal | None:
        """Return who the stream's credential stands for now (its reach as it is now), None
        when it stopped being valid (revoked, expired, a key rotated away). Counts toward
        no lockout: it was right when the stream opened."""
        svc = self.svc
        if svc.config.auth_mode == "none":
            return OWNER
        key = credential.get("HTTP_X_SERVICE_KEY", "")
        auth = credential.get("HTTP_AUTHORIZATION", "")
        bearer = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        key = key or credential.get("HTTP_X_API_KEY", "") or bearer
        if first.kind == "owner":
            if svc.key_matches(key):
                return OWNER
            if bearer and svc.config.auth_mode == "jwt" and svc.token_valid(credential):
                return OWNER
            return None
        for secret in filter(None, dict.fromkeys((key, bearer))):
            now = svc.grants.principal(secret)
            if now is not None and now.grant_id == first.grant_id:
                return now
        return None

    def open_stream(self, session: McpSession, principal: Principal, environ: dict) -> Iterator:
        """Return the body of a session's GET stream: `: ok` at once, then the notifications
        its principal may see, a comment every COMMENT_SECONDS; it ends after
        SERVICE_MCP_STREAM_SECONDS, when another GET replaces it, when the session ends, or when its
        credential stops being valid. 429 when the waiting places are all taken."""
        journal = self.svc.journal
        cap = self.svc.config.max_waiters
        if not journal.take_slot(STREAM_POOL, cap):
            raise ApiError(
                429,
                "RATE_LIMITED",
                f"{cap} streams and change-feed waits are open already: try again shortly",
                {"Retry-After": "5"},
            )
        with self._lock:
            session.stream += 1
            number = session.stream
        journal.nudge()  # the stream it replaces ends
        return self._stream(session, number, principal, self.credential_of(environ))

    def _stream(
        self, session: McpSession, number: int, principal: Principal, credential: dict
    ) -> Iterator:
        journal = self.svc.journal
        try:
            last = journal.latest()
            yield b": ok\n\n"
            clock = time.monotonic
            started = clock()
            lasts = self.svc.config.mcp_stream_seconds
            next_comment = started + self.COMMENT_SECONDS
            next_check = started + self.CHECK_SECONDS
            list_due: float | None = None  # when the next list_changed goes
            list_sent = -self.DEBOUNCE_SECONDS

            def replaced() -> bool:
                return session.stream != number or session.ended

            while True:
                now = clock()
                if now - started >= lasts or replaced() or journal.closed:
                    return
                if now >= next_check:
                    fresh = self.principal_now(credential, principal)
                    if fresh is None:
                        log.info(
                            "MCP session %s…: its credential ended; stream closed", session.id[:4]
                        )
                        return
                    principal, next_check = fresh, now + self.CHECK_SECONDS
                try:
                    page = journal.read(last, 500)
                except ApiError:  # compacted past it: start again from now
                    page = {"changes": [], "last": journal.latest(), "more": False}
                    list_due = list_due or now
                out, listed = self._events(session, principal, page["changes"])
                last = page["last"]
                if listed and list_due is None:  # at most one a DEBOUNCE_SECONDS
                    list_due = max(now, list_sent + self.DEBOUNCE_SECONDS)
                if list_due is not None and now >= list_due:
                    out = (out or b"") + _event("notifications/resources/list_changed")
                    list_due, list_sent = None, now
                if out:
                    yield out
                    next_comment = now + self.COMMENT_SECONDS
                elif now >= next_comment:
                    yield b": keep-alive\n\n"
                    next_comment = now + self.COMMENT_SECONDS
                if page["more"]:
                    continue
                due = min(next_comment, next_check, started + lasts)
                if list_due is not None:
                    due = min(due, list_due)
                journal.wait_past(last, max(due - clock(), 0.005), replaced)
        finally:
            journal.give_slot(STREAM_POOL)

    def _events(self, session: McpSession, principal: Principal, changes: list) -> tuple:
        """Return (the updated notifications of changes as SSE bytes or None, whether the
        list of resources the principal sees changed)."""
        out, listed = [], False
        subs = session.subscriptions
        for c in changes:
            kind, path, origin = c["kind"], c["path"], c.get("from")
            sees_path = principal.sees(path)
            sees_origin = bool(origin) and principal.sees(origin)
            if not (sees_path or sees_origin):
                continue
            if kind in ("created", "deleted", "moved"):
                listed = True
            touched = [path] if sees_path else []
            if kind == "moved" and sees_origin:
                touched.append(origin)
            for p in touched:
                uri = resource_uri("note", p)
                if uri in subs:
                    out.append(_event("notifications/resources/updated", {"uri": uri}))
        return (b"".join(out) or None), listed


def _event(method: str, params: dict | None = None) -> bytes:
    """Return one JSON-RPC notification as an SSE event."""
    message: dict = {"jsonrpc": "2.0", "method": method}
    if params is not None:
        message["params"] = params
    data = json.dumps(message, ensure_ascii=False, separators=(",", ":"))
    return f"event: message\ndata: {data}\n\n".encode()


_SESSIONS_START = threading.Lock()


def mcp_sessions(svc: Service) -> McpSessions:
    """Return the Service's McpSessions (`svc.mcp_sessions`), made on first use."""
    sessions = svc.mcp_sessions
    if sessions is None:
        with _SESSIONS_START:
            sessions = svc.mcp_sessions
            if sessions is None:
                sessions = McpSessions(svc)
                svc.mcp_sessions = sessions
    return sessions
