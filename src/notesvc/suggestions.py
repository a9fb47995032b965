"""Suggestions: an assistant's edits kept for the person to accept or reject.

With SERVICE_MCP_WRITE=suggest (or SERVICE_AGENT_WRITE=suggest) the write tools change
nothing: each makes a suggestion here (tools.py), listed by /api/v1/suggestions, shown as a
diff in the web client and in MCP's review card, and applied only when a person accepts it:
an edit through the three-way merge against the version it was made from (a clash becomes
a conflict copy, as for any stale edit), a move or a delete only while the note is still
that version. Accepted changes are saved by the connector that suggested them.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from pathlib import Path
from typing import Any

from notesvc.boot import bottle, log
from notesvc.errors import ApiError, PreconditionFailed, not_found
from notesvc.grants import Principal, request_principal
from notesvc.helpers import atomic_write, iso, local_time, time_zone
from notesvc.notes.merge import title_filename, unified_diff
from notesvc.notes.paths import make_etag
from notesvc.plugins import move_and_relink
from notesvc.service import Service

# -- the store: open suggestions in <state>/suggestions.json ---------------------------------

MAX_OPEN_SUGGESTIONS = 200  # beyond it the oldest is rejected, and the answer says so
SUGGESTION_KINDS = ("create", "edit", "move", "delete")


class SuggestionStore:
    """The open suggestions, oldest first, kept in one JSON file (written whole, atomically,
    at each change: at most 200 of them). A suggestion closed (accepted or rejected) is
    gone: its id is then unknown (404)."""

    NAME = "suggestions.json"

    def __init__(self, folder: Path):
        self.path = folder / self.NAME
        self.lock = threading.RLock()  # one change at a time; an accept holds it throughout
        self._open: list = []
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
            self._open = [s for s in raw.get("suggestions", []) if isinstance(s, dict)]
        except FileNotFoundError:
            pass
        except (OSError, ValueError, AttributeError) as e:
            log.warning("suggestions: %s could not be read (%s); starting with none", self.path, e)

    def _save(self) -> None:
        data = json.dumps({"suggestions": self._open}, ensure_ascii=False).encode("utf-8")
        atomic_write(self.path, data, mode=0o600)

    def add(self, record: dict) -> list:
        """Keep a new suggestion; return the ones rejected to make room (the oldest)."""
        with self.lock:
            self._open.append(record)
            dropped = []
            while len(self._open) > MAX_OPEN_SUGGESTIONS:
                dropped.append(self._open.pop(0))
            self._save()
            return dropped

    def all(self) -> list:
        with self.lock:
            return list(self._open)

    def get(self, sid: str) -> dict | None:
        with self.lock:
            return next((s for s in self._open if s["id"] == sid), None)

    def close(self, sid: str) -> dict | None:
        """Remove an open suggestion (accepted or rejected); return it, None if not open."""
        with self.lock:
            for i, s in enumerate(self._open):
                if s["id"] == sid:
                    del self._open[i]
                    self._save()
                    return s
            return None


_STORE_START = threading.Lock()


def suggestion_store(svc: Service) -> SuggestionStore:
    """Return the Service's SuggestionStore (`svc.suggestions`), made on first use."""
    store = svc.suggestions
    if store is None:
        with _STORE_START:
            store = svc.suggestions
            if store is None:
                store = SuggestionStore(svc.config.state_dir)
                svc.suggestions = store
    return store


# -- making one (the write tools in suggest mode) -------------------------------------------


def connector_of(svc: Service, principal: Principal) -> dict:
    """Return {id, name} of who suggests: the grant's id and its app's or device's name
    (a person's as `<person> · <name>`), the owner's key as {owner, "API key"}."""
    if not principal.grant_id:
        return {"id": "owner", "name": "API key"}
    return {"id": principal.grant_id, "name": svc.saved_by() or principal.kind}


def suggestion_url(svc: Service, sid: str) -> str:
    """Return where the web client shows a suggestion: `<base>/#suggestion=<id>`."""
    try:
        environ = bottle.request.environ
        base = svc.issuer(environ)
    except (AttributeError, RuntimeError, KeyError):
        base = svc.config.public_url
    return f"{base}/#suggestion={sid}"


def make_suggestion(
    svc: Service,
    kind: str,
    path: str,
    *,
    content: str | None = None,
    new_path: str | None = None,
    base: str | None = None,
    base_text: str | None = None,
    update_links: bool = False,
    connector: dict | None = None,
) -> dict:
    """Keep a suggestion; return what the assistant is told: {suggestion: {id, url, kind,
    path}, rejected: [...] (the oldest, when the 200 open were full)}."""
    if kind not in SUGGESTION_KINDS:
        raise ValueError(f"unknown suggestion kind {kind!r}")
    principal = request_principal()
    who = connector or connector_of(svc, principal)
    record = {
        "id": secrets.token_urlsafe(12),
        "kind": kind,
        "path": path,
        "base": base,
        "connector": who,
        "savedBy": who["name"] if who["id"] != "owner" else None,
        "createdAt": iso(time.time()),
    }
    if content is not None:
        record["content"] = content
    if base_text is not None:
        record["baseText"] = base_text
    if new_path is not None:
        record["newPath"] = new_path
        record["updateLinks"] = bool(update_links)
    dropped = suggestion_store(svc).add(record)
    answer: dict = {
        "suggestion": {
            "id": record["id"],
            "url": suggestion_url(svc, record["id"]),
            "kind": kind,
            "path": path,
            **({"newPath": new_path} if new_path is not None else {}),
        }
    }
    if dropped:
        answer["rejected"] = [{"id": s["id"], "path": s["path"]} for s in dropped]
        answer["note"] = (
            f"at most {MAX_OPEN_SUGGESTIONS} suggestions wait at once: the oldest "
            f"{len(dropped)} {'was' if len(dropped) == 1 else 'were'} rejected to make room"
        )
    return answer


# -- what a person sees of one ------------------------------------------------------------


def suggestion_diff(s: dict) -> str:
    """Return a suggestion as a unified diff (a move: git's `rename from/to` lines)."""
    path = s["path"]
    if s["kind"] == "create":
        return unified_diff("", s.get("content", ""), "/dev/null", f"b/{path}")
    if s["kind"] == "edit":
        return unified_diff(s.get("baseText", ""), s.get("content", ""), f"a/{path}", f"b/{path}")
    if s["kind"] == "delete":
        return unified_diff(s.get("baseText", ""), "", f"a/{path}", "/dev/null")
    return f"rename from {path}\nrename to {s.get('newPath', '')}\n"


def public_suggestion(svc: Service, s: dict) -> dict:
    """Return a suggestion as the API lists it (no internal fields)."""
    shown = {k: s[k] for k in ("id", "kind", "path", "base") if k in s}
    if "newPath" in s:
        shown["newPath"] = s["newPath"]
    if "content" in s:
        shown["content"] = s["content"]
    shown.update(
        diff=suggestion_diff(s),
        connector=s["connector"],
        createdAt=s["createdAt"],
        url=suggestion_url(svc, s["id"]),
    )
    return shown


def sees_suggestion(principal: Principal, s: dict) -> bool:
    return principal.sees(s["path"]) and (not s.get("newPath") or principal.sees(s["newPath"]))


def open_suggestions(svc: Service, principal: Principal | None = None) -> list:
    """Return the open suggestions a principal reaches, newest first."""
    principal = principal or request_principal()
    shown = [s for s in suggestion_store(svc).all() if sees_suggestion(principal, s)]
    return list(reversed(shown))


def visible_suggestion(svc: Service, sid: Any, write: bool = False) -> dict:
    """Return the open suggestion `sid` the request's principal reaches (with write: may
    apply); 404 when closed, unknown or out of reach, 403 where it may only read."""
    principal = request_principal()
    s = suggestion_store(svc).get(sid) if isinstance(sid, str) else None
    if s is None or not sees_suggestion(principal, s):
        raise not_found(f"no open suggestion {str(sid)[:40]!r} (accepted, rejected or unknown)")
    if write and not (
        principal.may_write(s["path"])
        and (not s.get("newPath") or principal.may_write(s["newPath"]))
    ):
        raise ApiError(403, "FORBIDDEN", f"applying it needs write access to {s['path']}")
    return s


# -- accepting and rejecting ----------------------------------------------------------------


def reject_suggestion(svc: Service, sid: Any) -> dict:
    """Close a suggestion unapplied; 404 when it is not open (or not in reach)."""
    store = suggestion_store(svc)
    with store.lock:
        s = visible_suggestion(svc, sid, write=True)
        store.close(s["id"])
    return {"id": s["id"], "status": "rejected"}


def accept_suggestion(svc: Service, sid: Any) -> dict:
    """Apply a suggestion, saved by its connector (history's savedBy, reason `suggestion`):
    {suggestion: {id, status}, note, merged}. An edit goes through the three-way merge
    against its base; when that clashes the edit is kept as a conflict copy (409 with
    `path` and `conflictPath`) and the suggestion is closed. A create onto a taken path
    gets ` 2`; a move or a delete applies only while the note is still its base (else
    409, and the suggestion stays open). It applies even if its connector was revoked
    since: the person decides."""
    store = suggestion_store(svc)
    with store.lock:
        s = visible_suggestion(svc, sid, write=True)
        try:
            with svc.acting_as(s.get("savedBy")):
                note, merged = _apply_suggestion(svc, s)
        except ApiError as e:
            if e.status_code == 409 and getattr(e, "extra", None):  # a conflict copy: done
                store.close(s["id"])
            raise
        store.close(s["id"])
    return {"suggestion": {"id": s["id"], "status": "accepted"}, "note": note, "merged": merged}


def _stale(s: dict, what: str) -> ApiError:
    return ApiError(
        409,
        "CONFLICT",
        f"{s['path']} changed since this {what} was suggested: it is not applied and stays "
        "open (reject it, or ask for it again)",
    )


def _apply_suggestion(svc: Service, s: dict) -> tuple:
    kind, path = s["kind"], s["path"]
    if kind == "create":
        folder, name = path.rsplit("/", 1)
        return svc.notes.create_named(folder, name[:-3], s.get("content", "")), False
    if kind == "move":
        try:
            rec = move_and_relink(svc, path, s["newPath"], s["base"], s.get("updateLinks", False))
        except PreconditionFailed:
            raise _stale(s, "move") from None
        except ApiError as e:
            if e.status_code == 404:
                raise _stale(s, "move") from None
            raise
        return rec, False
    if kind == "delete":
        try:
            return svc.notes.delete(path, s["base"]), False
        except PreconditionFailed:
            raise _stale(s, "deletion") from None
    # an edit: merged with whatever changed since its base (a note deleted since: made again)
    if not svc.notes.exists(path):
        return svc.notes.create(path, s.get("content", "")), False
    who = title_filename(s["connector"].get("name") or "assistant")
    when = local_time(time.time(), time_zone(svc.config.timezone)).strftime("%Y-%m-%d %H-%M")
    base = s.get("base") or make_etag(s.get("baseText", "").encode("utf-8"))
    done = svc.notes.merge(
        path,
        base,
        s.get("content", ""),
        f"conflict {who} {when}",
        reason="suggestion",
        base_text=s.get("baseText"),
    )
    return done["note"], done["merged"]
