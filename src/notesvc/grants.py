"""Grants: who a request acts for (scoped keys, devices, OAuth) and how far it may go."""

from __future__ import annotations

import base64
import collections
import contextlib
import dataclasses
import datetime as dt
import functools
import hmac
import math
import os
import re
import secrets
import threading
import time
import unicodedata
import urllib.parse
from typing import TYPE_CHECKING, Any, Callable

from notesvc.auth import Lockout, RateLimit, StateError, StateStore
from notesvc.boot import bottle, log
from notesvc.errors import ApiError, not_found
from notesvc.helpers import iso, key_hash, log_safe
from notesvc.notes.paths import (
    ATTACHMENTS,
    MAX_PATH_CHARS,
    NOTES,
    attachment_folder,
    attachment_path,
    folder_path,
    note_file_path,
    note_path,
)
from notesvc.notes.store import NoteStore
from notesvc.oauth import (
    OAUTH_SCOPES,
    OAuthError,
    check_redirect_uri,
    fetch_client_metadata,
    parse_oauth_scope,
    pkce_matches,
    redirect_matches,
)

if TYPE_CHECKING:  # annotations only: these modules come later
    from notesvc.service import Service


# -- grants: who a request acts for, and how far it may go ---------------------------
#
# One mechanism lets others in exactly as far as the owner allows (docs/api.md: Let others
# in): a grant
# has a scope (read, write or admin) and optionally a folder, and is issued as a key
# (nsg_...), as an OAuth token pair for an MCP client (nsa_... / nsr_...), or, for one
# note, as a share link. Every secret is random and kept only as its SHA-256; the grants
# live in the state file, so a revocation holds at once in every thread (and process).

SCOPES = ("read", "write", "admin")  # each includes the ones before it
SCOPE_RANK = {scope: rank for rank, scope in enumerate(SCOPES)}
GRANT_KEY_PREFIX = "nsg_"
DEVICE_KEY_PREFIX = "nsd_"  # a device's key, from a pairing it claimed (docs/api.md: Devices)
MAX_PAIRINGS = 50  # pairings waiting to be claimed at once
PAIRING_SECRET_RE = re.compile(r"^[a-z2-7]{26}\Z")  # 128 bits, base32: typed in groups of 4
ACCESS_PREFIX, REFRESH_PREFIX, CODE_PREFIX = "nsa_", "nsr_", "nsc_"
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
SHARE_TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]{22}\Z")  # 16 random bytes: 128 bits
CHALLENGE_RE = re.compile(r"^[A-Za-z0-9_-]{43}\Z")  # BASE64URL(SHA-256(verifier))
CIMD_CACHE_SECONDS = 3600.0


def lower_scope(a: str, b: str) -> str:
    """Return the lower of two scopes (a grant's own, and what a share gives)."""
    return a if SCOPE_RANK[a] <= SCOPE_RANK[b] else b


def inside(path: str, folder: str) -> bool:
    """Return whether a path is `folder` itself or lies beneath it."""
    return path == folder or path.startswith(folder + "/")


def attachments_twin(folder: str) -> str:
    """Return the attachments folder that goes with a notes folder (notes/x -> attachments/x)."""
    return ATTACHMENTS + folder[len(NOTES) :]


@dataclasses.dataclass(frozen=True)
class Reach:
    """The folders a principal sees, each with the scope it holds there: everything (the
    owner's key, devices and connectors), or a list of folders under notes/ (a folder grant:
    one; a person: their home and the folders shared with them). Attachments follow notes:
    `attachments/x` is reached with `notes/x`. Built once per state by reach_of(), the one
    place that decides who sees what; every surface asks a principal's reach."""

    folders: tuple = ()  # ((folder, scope), ...) by folder; nothing when not everything
    everything: bool = False
    home: str = ""  # where what it makes goes by default: a folder grant's, a person's home

    @functools.cached_property
    def tops(self) -> tuple:
        """Return the reached folders none of the others holds: what a filter needs (once
        per reach: a change feed asks it on every read)."""
        names = {f for f, _ in self.folders}  # one is held when a folder above it is here
        return tuple(
            sorted(f for f in names if not any(f[:i] in names for i, c in enumerate(f) if c == "/"))
        )

    def folder_of(self, path: str) -> str:
        """Return the notes folder a note, attachment or folder path stands for (its
        attachments/ twin mapped back to notes/)."""
        if path == ATTACHMENTS or path.startswith(ATTACHMENTS + "/"):
            return NOTES + path[len(ATTACHMENTS) :]
        return path

    def scope_at(self, path: str) -> str | None:
        """Return the scope held at a path (the highest of the reached folders holding it;
        a deeper share may add to the one above, never take away); None: not reached."""
        if self.everything:
            return "admin"
        where = self.folder_of(path)
        held = [scope for folder, scope in self.folders if inside(where, folder)]
        return max(held, key=SCOPE_RANK.__getitem__) if held else None

    @functools.cached_property
    def _lookup(self) -> tuple:
        """(the prefixes of the reached folders and their attachments twins, those folders)"""
        folders = (*self.tops, *map(attachments_twin, self.tops))
        return tuple(f + "/" for f in folders), frozenset(folders)

    def sees(self, path: str) -> bool:
        """Return whether a note, attachment or folder path lies inside a reached folder
        (what scope_at() holds somewhere; asked for every entry a listing or a feed filters)."""
        if self.everything:
            return True
        prefixes, folders = self._lookup
        return path.startswith(prefixes) or path in folders

    def way_down(self, folder: str) -> tuple:
        """Return the reached folders beneath `folder` (an ancestor of them, not reached
        itself): what a listing of it shows."""
        return tuple(t for t in self.tops if t.startswith(folder + "/"))

    def narrowed(self, folder: str, scope: str) -> Reach:
        """Return this reach within one folder and at most one scope (a grant's own)."""
        if self.everything:
            return Reach(((folder, scope),), home=folder) if folder else self
        kept = []
        for f, s in self.folders:
            if not folder or inside(f, folder):
                kept.append((f, lower_scope(s, scope)))
            elif inside(folder, f):
                kept.append((folder, lower_scope(s, scope)))
        home = folder or self.home
        return Reach(tuple(sorted(set(kept))), home=home if kept else "")


EVERYTHING = Reach(everything=True)
# The filter of a reach of nothing: a folder no note path lies in (paths hold no control
# character), so that every `() means everything` test sees a folder, and nothing in it.
NOWHERE = NOTES + "/\x01"


@dataclasses.dataclass(frozen=True)
class Principal:
    """Who a request acts for: the owner (API key, JWT, auth off) or one grant (of the owner
    or of a person), with the reach it sees (Reach)."""

    kind: str  # "owner", "key" (a scoped key), "device" (a paired device) or "oauth"
    scope: str  # read, write or admin
    folder: str = ""  # the grant's own folder ("notes/family"): it sees within it only
    grant_id: str = ""
    resource: str = ""  # an OAuth token's audience: the MCP URL it was issued for
    person: str = ""  # the person whose grant this is ("": the owner's)
    reach: Reach = EVERYTHING  # what it sees (reach_of); a folder alone: that folder

    def __post_init__(self) -> None:
        if self.folder and self.reach.everything:  # Principal(kind, scope, folder): as before
            reach = Reach(((self.folder, self.scope),), home=self.folder)
            object.__setattr__(self, "reach", reach)

    def allows(self, scope: str) -> bool:
        return SCOPE_RANK[self.scope] >= SCOPE_RANK[scope]

    @property
    def whole(self) -> bool:
        """Return whether it sees every note (the owner's key and the owner's whole grants)."""
        return self.reach.everything

    @property
    def folders(self) -> tuple:
        """Return the folders it sees as a filter: () for everything; for a reach of nothing
        (a key narrowed to a folder no longer shared with its person) (NOWHERE,), never ()."""
        if self.reach.everything:
            return ()
        return self.reach.tops or (NOWHERE,)

    @property
    def home(self) -> str:
        """Return where what it makes goes by default: its own folder, a person's home, else
        "" (the owner's defaults, each in its place)."""
        return self.reach.home

    def sees(self, path: str) -> bool:
        """Return whether a note, attachment or folder path lies inside its reach."""
        return self.reach.sees(path)

    def may_write(self, path: str) -> bool:
        """Return whether it may write at a path: its scope and the reach's both say so."""
        held = self.reach.scope_at(path)
        return held is not None and self.allows("write") and SCOPE_RANK[held] >= 1


OWNER = Principal("owner", "admin")


def person_reach(data: dict, person_id: str) -> Reach:
    """Return what a person reaches in the state `data`: their home (write) and each folder
    shared with them at the share's scope; nothing for a person who is gone."""
    person = next((p for p in data.get("people", []) if p["id"] == person_id), None)
    if person is None:
        return Reach()
    folders = {(person["home"], "write")}
    for folder, members in data.get("members", {}).items():
        folders |= {(folder, m["scope"]) for m in members if m["person"] == person_id}
    return Reach(tuple(sorted(folders)), home=person["home"])


def reach_of(data: dict, grant: dict | None) -> Reach:
    """Return the reach of a grant (None: the owner's own key) in the state `data`: the one
    place that decides who sees what. The owner's grants see everything, or their folder;
    a person's see the person's reach, within the grant's folder and at its scope at most."""
    if grant is None:
        return EVERYTHING
    base = person_reach(data, grant["person"]) if grant.get("person") else EVERYTHING
    return base.narrowed(grant.get("folder") or "", grant["scope"])


def file_joins_note(data: dict, note: str, file: str) -> bool:
    """Return whether a file's text may join a note's search entry: when every principal
    that reaches the note (the owner, each person, each grant of the state `data`) reaches
    the file too. Otherwise the link stays, but the file is not read for that note."""
    reaches = [person_reach(data, p["id"]) for p in data.get("people", [])]
    for grant in data.get("grants", []):
        if isinstance(grant, dict) and grant.get("scope") in SCOPE_RANK:
            reaches.append(reach_of(data, grant))
    return all(r.sees(file) for r in reaches if r.sees(note))


def principal_of(data: dict, grant: dict) -> Principal:
    """Return who a grant (a key, a device, an OAuth grant) acts as in the state `data`."""
    return Principal(
        grant["kind"],
        grant["scope"],
        grant.get("folder") or "",
        grant["id"],
        grant.get("resource", ""),
        grant.get("person") or "",
        reach_of(data, grant),
    )


# Who made a grant, a pairing or a share link (its `createdBy`): the owner's own key,
# the command line on the server, or else the id of the grant (an admin device) that did.
MADE_BY_OWNER, MADE_BY_CLI = "owner", "cli"


def made_by(principal: Principal) -> str:
    """Return the `createdBy` of what a principal makes: "owner" or its grant's id."""
    return principal.grant_id or MADE_BY_OWNER


def made_by_grant(created_by: Any) -> bool:
    """Return whether a `createdBy` names a grant (not the owner, the CLI, or unknown)."""
    return isinstance(created_by, str) and created_by not in (MADE_BY_OWNER, MADE_BY_CLI)


_ACTING = threading.local()  # (principal, via) while a chat bound to someone is served


@contextlib.contextmanager
def acting_as(principal: Principal, via: str = ""):
    """Let what runs inside act for `principal` in this thread (a chat bound to a person
    acts as the grant that linked it): request_principal() answers it, `via` names it."""
    before = getattr(_ACTING, "who", None)
    _ACTING.who = (principal, via)
    try:
        yield principal
    finally:
        _ACTING.who = before


def acting_via() -> str:
    """Return the name of what this thread acts through (a chat's channel), "" if nothing."""
    who = getattr(_ACTING, "who", None)
    return who[1] if who else ""


def request_principal() -> Principal:
    """Return who the current request acts for (the owner outside a protected request;
    inside acting_as, whom that names)."""
    who = getattr(_ACTING, "who", None)
    if who is not None:
        return who[0]
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


def no_link_below(on_disk: Callable, top: str, path: str, what: str) -> None:
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


def reached_folders(principal: Principal, top: str = NOTES) -> tuple:
    """Return the folders a principal sees under `top` (notes/ or attachments/, whose twins
    they are): () for everything."""
    folders = principal.folders
    return folders if top == NOTES else tuple(attachments_twin(f) for f in folders)


def _visible(raw: Any, check_path: Callable, folders: tuple, on_disk: Callable, what: str) -> str:
    """Return `check_path(raw)` for a principal that sees `folders` (() everything); 404
    ("no <what> at ...") outside them.

    The folder test comes first, so `..`, another folder's file by any encoding, or a
    symbolic link that leads out of the folder all answer as if nothing were there; then
    the path's own rules (400), then no symbolic link below the folder on disk.
    """
    if not folders:
        return check_path(raw)
    holder = next((f for f in folders if not _escapes(raw, f)), None)
    if holder is None:
        raise not_found(f"no {what} at {str(raw)[:MAX_PATH_CHARS]}")
    path = check_path(raw)
    no_link_below(on_disk, holder, path, what)
    return path


def _writable(principal: Principal, path: str, what: str) -> str:
    """Return path when the principal may write there; 403 naming the scope it holds."""
    if principal.whole or principal.may_write(path):
        return path
    held = principal.reach.scope_at(path) or principal.scope
    raise ApiError(
        403,
        "FORBIDDEN",
        f"this needs the write scope at {path}: this key holds {held} there "
        f"(a {what} in a folder shared for reading)",
    )


def visible_note(
    store: NoteStore, raw: Any, principal: Principal | None = None, write: bool = False
) -> str:
    """Return a checked note path the request's principal may see (with write, may change):
    outside its reach 404, in a part of it it may only read 403."""
    principal = principal or request_principal()
    path = _visible(raw, note_path, reached_folders(principal), store.on_disk, "note")
    return _writable(principal, path, "note") if write else path


def visible_attachment(
    store: Any, raw: Any, principal: Principal | None = None, write: bool = False
) -> str:
    """Return a checked attachment path the principal may see (its folders' twins under
    attachments/); 404 outside them, as for notes (with write, 403 where it may only read)."""
    principal = principal or request_principal()
    folders = reached_folders(principal, ATTACHMENTS)
    path = _visible(raw, attachment_path, folders, lambda p: store.base / p, "attachment")
    return _writable(principal, path, "file") if write else path


def visible_note_file(
    store: Any, raw: Any, principal: Principal | None = None, write: bool = False
) -> str:
    """Return a checked path of a file beside the notes that the principal may see; 404
    outside its reach, as for notes (with write, 403 where it may only read)."""
    principal = principal or request_principal()
    folders = reached_folders(principal)
    path = _visible(raw, note_file_path, folders, lambda p: store.base / p, "attachment")
    return _writable(principal, path, "file") if write else path


def visible_folders(
    svc: Service, raw: Any, principal: Principal | None = None, top: str = NOTES
) -> tuple:
    """Return (the folder asked, the folders a listing of it shows the principal): the
    folder itself inside its reach (no symbolic link on the way), the reached folders
    beneath an ancestor of them; 404 for any other folder. `top`: notes (or attachments)."""
    principal = principal or request_principal()
    own = reached_folders(principal, top)
    if own and isinstance(raw, str) and {".", ".."} & set(raw.split("/")):
        raise not_found(f"no folder at {raw[:MAX_PATH_CHARS]}")
    folder = (folder_path if top == NOTES else attachment_folder)(raw or top)
    if not own:
        return folder, (folder,)
    holder = next((f for f in own if inside(folder, f)), None)
    if holder is not None:
        base = svc.attachments.base
        on_disk = svc.notes.on_disk if top == NOTES else (lambda p: base / p)
        no_link_below(on_disk, holder, folder, "folder")
        return folder, (folder,)
    below = tuple(f for f in own if f.startswith(folder + "/"))
    if below:
        return folder, below
    raise not_found(f"no folder at {folder}")


def searched_folders(svc: Service, raw: Any, principal: Principal | None = None) -> tuple:
    """Return the folders a search of folder `raw` (None or "": the top) looks in, for the
    request's principal: () every note (the owner at the top), else the folder itself inside
    its reach or the reached folders beneath it; 404 for any other folder. Pass the
    principal's `folders` beside it as the search's reach (SearchIndex.search)."""
    _, shown = visible_folders(svc, raw or NOTES, principal)
    return () if shown == (NOTES,) else shown


def writable_folder(svc: Service, raw: Any, principal: Principal | None = None) -> str:
    """Return a folder the principal may make notes in (inside its reach, at write); 404
    outside it, 403 where it may only read."""
    principal = principal or request_principal()
    folder, shown = visible_folders(svc, raw, principal)
    if shown != (folder,):
        raise not_found(f"no folder at {folder}")
    return _writable(principal, folder, "note")


def granted_tree(
    svc: Service, raw: Any, depth: int | None = None, count: Callable | None = None
) -> dict:
    """Return the tree of a folder as the request's principal sees it (`depth` and `count`
    as NoteStore.tree takes them): a folder above the ones it reaches holds only the ways
    down to them."""
    asked, shown = visible_folders(svc, raw)  # what it reaches of the folder, or 404
    if shown == (asked,):
        return svc.notes.tree(asked, depth, count)
    root = {"name": asked.rsplit("/", 1)[-1], "path": asked, "type": "folder", "children": []}
    for folder in shown:
        if folder == NOWHERE:  # a reach of nothing: not even a way down
            continue
        way = folder.split("/")[asked.count("/") + 1 :]  # the folders from below asked to it
        left = None if depth is None else depth - len(way)
        if left is not None and left < 0:  # the cut falls on the way down
            notes = count(folder) if count else len(svc.notes.walk(folder))
            at = _way_node(root, way[: depth - 1])
            cut = next((c for c in at["children"] if c["name"] == way[depth - 1]), None)
            if cut is None:
                cut = {"name": way[depth - 1], "path": f"{at['path']}/{way[depth - 1]}"}
                cut.update({"type": "folder", "count": 0})
                at["children"].append(cut)
            cut["count"] += notes
            at["children"].sort(key=lambda c: c["name"])
            continue
        try:
            node = svc.notes.tree(folder, left, count)
        except ApiError as e:
            if e.status_code != 404:
                raise
            node = {"name": way[-1], "path": folder, "type": "folder"}
            node.update({"count": 0} if left == 0 else {"children": []})
        at = _way_node(root, way[:-1])
        at["children"].append(node)
        at["children"].sort(key=lambda c: c["name"])
    return root


def _way_node(root: dict, way: list) -> dict:
    """Return the folder node at root/way, adding the folders on the way (in name order)."""
    node = root
    for name in way:
        child = next((c for c in node["children"] if c["name"] == name), None)
        if child is None:
            path = f"{node['path']}/{name}"
            child = {"name": name, "path": path, "type": "folder", "children": []}
            node["children"].append(child)
            node["children"].sort(key=lambda c: c["name"])
        node = child
    return node


def epoch_of(text: Any) -> float:
    """Return the time an ISO 8601 UTC stamp names; infinity for none (never expires)."""
    if not text:
        return math.inf
    try:
        when = dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ")
    except (TypeError, ValueError):
        return 0.0  # unreadable: treated as long expired
    return when.replace(tzinfo=dt.timezone.utc).timestamp()


def clean_name(text: Any, fallback: str, limit: int = 100) -> str:
    """Return a display name: printable characters only, trimmed, at most limit long."""
    name = "".join(ch for ch in str(text or "") if ch.isprintable()).strip()[:limit]
    return name or fallback


class GrantStore:
    """Grants (scoped keys, OAuth grants), OAuth clients and share links.

    Kept in the state file under "grants", "oauthClients" and "shares", so a change is
    seen at once by every thread. Authorisation codes (60 s, single use), fetched client
    metadata documents and rate counters live in memory. Lookups go through an index of
    secret hashes rebuilt whenever the state changes.
    """

    def __init__(self, state: StateStore, clock: Callable = time.time, idle_days: int = 0):
        self.state, self.clock = state, clock
        self.idle = idle_days * 86400  # a paired device's key ends this long after its last use
        self._lock = threading.Lock()
        # (state it was built from, hash -> (kind, principal, expires, idle since),
        # grant id -> (principal, expires, idle since))
        self._cache: tuple = (None, {}, {})
        self._used: dict = {}  # grant id -> when it was last used, not yet written
        self._flushed = clock()
        self.codes: dict = {}  # code hash -> what the owner approved (memory only)
        self.metadata: dict = {}  # client_id URL -> (fetched at, document)
        # (ids) -> None, run once a revocation's state change is written: the Service waits
        # there for the writes the grants had begun (Service.drain)
        self.on_ended: list = []
        # (data, the ids revoked) -> None, run inside a revocation's state update: what a
        # grant made beyond this store ends with it in the same write (the chats it bound)
        self.on_revoke: list = []
        self.after_revoke: list = []  # () -> None after it: waiting change feeds look again
        self.registrations = RateLimit(REGISTRATIONS_PER_MINUTE)
        self.public_hits = RateLimit(60)  # shared notes and consent facts, per address
        self.share_misses = Lockout(what="unknown links")  # share and feed tokens, per address

    # -- authenticating -------------------------------------------------------------

    def _index(self) -> dict:
        return self._indexes()[0]

    def _indexes(self) -> tuple:
        """Return (by secret hash, by grant id) of the grants in the state now."""
        data = self.state.read()
        built_from, index, by_id = self._cache
        if built_from is data:
            return index, by_id
        index, by_id = {}, {}
        for g in data.get("grants", []):
            p = principal_of(data, g)
            expires = epoch_of(g.get("expiresAt"))
            by_id[g["id"]] = (p, expires, self._idle_since(g))
            if g.get("keyHash"):
                index[g["keyHash"]] = ("key", p, expires, self._idle_since(g))
            if g.get("accessHash"):
                until = min(expires, epoch_of(g.get("accessExpiresAt")))
                index[g["accessHash"]] = ("access", p, until, None)
        self._cache = (data, index, by_id)
        return index, by_id

    def current(self, grant_id: str) -> Principal | None:
        """Return who a grant acts as in the state now (its reach as it is now), None when
        it is gone: revoked, expired, or its person removed."""
        found = self._indexes()[1].get(grant_id)
        if found is None:
            return None
        principal, expires, since = found
        if since is not None:  # a paired device: its last use, as expires() counts it
            expires = max(since, self._used.get(grant_id, 0.0)) + self.idle
        return principal if expires > self.clock() else None

    def still_writes(self, principal: Principal, path: str) -> None:
        """Raise unless a request's principal may still write at `path` now: its grant may
        have ended (401), or a person's reach shrunk (404; 403 where they may only read)
        on another thread since its key was checked."""
        if not principal.grant_id:
            return  # the owner's own key (or no request): nothing to end
        now = self.current(principal.grant_id)
        if now is None:
            raise ApiError(401, "UNAUTHORIZED", "the key this request came with was revoked")
        if not now.person or now.may_write(path):
            return  # (a folder grant's reach is its folder: it never changes)
        if now.sees(path):
            raise ApiError(403, "FORBIDDEN", f"this needs the write scope at {path}")
        raise not_found(f"nothing at {path[:MAX_PATH_CHARS]} in this key's reach")

    def _idle_since(self, g: dict) -> float | None:
        """Return when a paired device without an expiry of its own was last used, as
        stored (None: its key does not expire for want of use: another kind of grant, or
        SERVICE_DEVICE_IDLE_DAYS=0)."""
        if not self.idle or g.get("kind") != "device" or g.get("expiresAt"):
            return None
        return epoch_of(g.get("lastUsedAt") or g.get("createdAt"))

    def expires(self, g: dict) -> float:
        """Return when a grant stops working: its expiresAt, or for a paired device its
        last use plus SERVICE_DEVICE_IDLE_DAYS (infinity: never)."""
        since = self._idle_since(g)
        if since is None:
            return epoch_of(g.get("expiresAt"))
        return max(since, self._used.get(g["id"], 0.0)) + self.idle

    def principal(self, secret: str) -> Principal | None:
        """Return the grant a scoped key, a device key or an access token stands for (None:
        no such live one)."""
        keys = (GRANT_KEY_PREFIX, DEVICE_KEY_PREFIX)
        if not secret.startswith((*keys, ACCESS_PREFIX)) or len(secret) > 128:
            return None
        entry = self._index().get(key_hash(secret))
        if entry is None or self.clock() >= entry[2]:
            return None
        kind, principal, _, since = entry
        if since is not None:  # a paired device: unused for too long, it has expired
            last = max(since, self._used.get(principal.grant_id, 0.0))
            if self.clock() >= last + self.idle:
                return None
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
            "expiresAt": g.get("expiresAt")
            if self._idle_since(g) is None
            else iso(self.expires(g)),
            "lastUsedAt": iso(last) if last else g.get("lastUsedAt"),
            "createdBy": g.get("createdBy"),  # null: made before it was recorded
        }
        if g.get("person"):
            rec["person"] = g["person"]
        if g["kind"] == "oauth":
            rec["client"] = dict(g["client"])
        return rec

    def grants(self, person: str | None = None) -> list:
        """Return every grant without its secrets (keys and OAuth grants); with `person`,
        that person's only ("" the owner's)."""
        return [
            self._public(g)
            for g in self.state.read().get("grants", [])
            if person is None or (g.get("person") or "") == person
        ]

    def _check_maker(self, data: dict, maker: Any, now: float) -> None:
        """Refuse (401) to record what a grant made once that grant is gone: a request that
        passed its key check just before its key was revoked writes after the revoke."""
        if made_by_grant(maker) and not any(
            g["id"] == maker and self.expires(g) > now for g in data.get("grants", [])
        ):
            raise ApiError(401, "UNAUTHORIZED", "the key this request came with was revoked")

    def _add_grant(self, grant: dict) -> None:
        now = self.clock()

        def change(data: dict) -> None:
            self._check_maker(data, grant.get("createdBy"), now)
            live = [g for g in data.get("grants", []) if self.expires(g) > now]
            if len(live) >= MAX_GRANTS:
                raise ApiError(
                    409, "CONFLICT", f"{MAX_GRANTS} grants exist already; revoke some first"
                )
            data["grants"] = [*live, grant]

        self.state.update(change)

    def create_key(
        self,
        name: str,
        scope: str,
        folder: str | None,
        days: int | None,
        *,
        created_by: str,
        person: str = "",
    ) -> tuple:
        """Return (the key's record, the key itself) of a new scoped key; created_by is
        "owner", "cli" or the id of the grant that made it; person: whose key it is."""
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
            "createdBy": created_by,
        }
        if person:
            grant["person"] = person
        self._add_grant(grant)
        log.info("scoped key %s (%s%s) created", grant["id"], scope, f" {folder}" if folder else "")
        return self._public(grant), key

    # -- devices: a pairing's one-time secret, claimed for a device key ------------------

    def create_pairing(
        self,
        name: str,
        scope: str,
        folder: str | None,
        ttl: int,
        *,
        created_by: str,
        person: str = "",
    ) -> tuple:
        """Return (the pairing's record, its one-time secret): 128 random bits, kept only
        as their SHA-256, good once within ttl seconds, and only while the grant that made
        it (created_by, when not "owner" or "cli") is live."""
        pairing, secret = self.pairing_record(
            name, scope, folder, ttl, created_by=created_by, person=person
        )
        record = self.state.update(lambda data: self.add_pairing(data, pairing))
        self.log_pairing(record)
        return record, secret

    def pairing_record(
        self,
        name: str,
        scope: str,
        folder: str | None,
        ttl: int,
        *,
        created_by: str,
        person: str = "",
    ) -> tuple:
        """Return (a new pairing, its one-time secret), not yet stored: add_pairing stores
        it, in the state change that makes it or in a larger one (a person and theirs)."""
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
            "createdBy": created_by,
        }
        if person:
            pairing["person"] = person
        return pairing, secret

    def add_pairing(self, data: dict, pairing: dict) -> dict:
        """Store a pairing (of pairing_record) in the state `data`, inside a state change;
        return its record without the secret's hash. 401 once its maker is revoked, 404
        for a person removed meanwhile, 409 at MAX_PAIRINGS waiting."""
        now, person = self.clock(), pairing.get("person", "")
        self._check_maker(data, pairing["createdBy"], now)
        live = [p for p in data.get("pairings", []) if epoch_of(p["expiresAt"]) > now]
        if person and not any(p["id"] == person for p in data.get("people", [])):
            raise not_found(f"no person {person}")  # removed meanwhile
        # the owner's and the people's wait apart: adding people never blocks the owner
        mine = [p for p in live if bool(p.get("person")) == bool(person)]
        if len(mine) >= MAX_PAIRINGS:
            raise ApiError(
                409, "CONFLICT", f"{MAX_PAIRINGS} pairings wait already; let them expire"
            )
        data["pairings"] = [*live, pairing]
        return {k: v for k, v in pairing.items() if k != "secretHash"}

    @staticmethod
    def log_pairing(record: dict) -> None:
        """Log a pairing made (once its state change is written)."""
        folder = record["folder"]
        log.info(
            "pairing %s (%s%s) made", record["id"], record["scope"], f" {folder}" if folder else ""
        )

    def claim(self, secret: str, device_name: str) -> tuple | None:
        """Return (the new device's record, its key) for a live pairing's secret, which is
        used up; None for a secret that is unknown, used or expired."""
        wanted = key_hash(re.sub(r"[\s-]", "", secret).lower())
        now = self.clock()
        key = DEVICE_KEY_PREFIX + secrets.token_urlsafe(32)

        def change(data: dict) -> dict | None:
            pairings = [p for p in data.get("pairings", []) if epoch_of(p["expiresAt"]) > now]
            found = next(
                (p for p in pairings if hmac.compare_digest(p["secretHash"], wanted)), None
            )
            data["pairings"] = [p for p in pairings if p is not found]
            if found is None:
                return None
            grants = [g for g in data.get("grants", []) if self.expires(g) > now]
            maker = found.get("createdBy")  # absent: a pairing made before it was recorded
            if made_by_grant(maker) and not any(g["id"] == maker for g in grants):
                return None  # the device that made it is revoked (or expired): used up
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
                "createdBy": maker,  # whoever made the pairing made the device
            }
            if found.get("person"):
                if not any(p["id"] == found["person"] for p in data.get("people", [])):
                    return None  # the person was removed: the pairing went with them
                device["person"] = found["person"]
            data["grants"] = [*grants, device]
            if found["scope"] == "admin" and found.get("createdBy") == MADE_BY_CLI:
                data["setupComplete"] = True  # `pair` on the server: its owner set it up
                data.pop("apiKey", None)
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

    @staticmethod
    def _made_by(grants: list, grant_id: str) -> list:
        """Return the ids of the grants grant_id made, and those they made, and so on."""
        made, found = [], {grant_id}
        while True:
            more = [g["id"] for g in grants if g.get("createdBy") in found and g["id"] not in found]
            if not more:
                return made
            made += more
            found.update(more)

    def revoke(self, grant_id: str, cascade: bool = False) -> list:
        """Revoke a key or an OAuth grant and the secrets it made: its share links, its
        calendar feeds, the pairings it made that wait to be claimed, and (on_revoke) the
        chats it connected to a channel; with cascade also the grants it made (devices,
        keys, OAuth grants, and theirs in turn), and theirs. Return the ids revoked,
        grant_id first ([]: unknown)."""

        def change(data: dict) -> list:
            grants = data.get("grants", [])
            if not any(g["id"] == grant_id for g in grants):
                return []
            gone = [grant_id, *(self._made_by(grants, grant_id) if cascade else [])]
            self.end_grants(data, gone)
            return gone

        if not any(g["id"] == grant_id for g in self.state.read().get("grants", [])):
            return []
        gone = self.state.update(change)
        self.ended(gone)
        return gone

    def end_grants(self, data: dict, gone: list) -> None:
        """End the grants `gone` and the secrets they made, inside one state change."""
        data["grants"] = [g for g in data.get("grants", []) if g["id"] not in gone]
        data["shares"] = [s for s in data.get("shares", []) if s.get("grantId") not in gone]
        for name, what in (("pairings", "pairing"), ("feeds", "calendar feed")):
            kept = [x for x in data.get(name, []) if x.get("createdBy") not in gone]
            if len(kept) < len(data.get(name, [])):
                ended = len(data[name]) - len(kept)
                log.info("%d %s(s) made by %s ended", ended, what, ", ".join(gone[:3]))
                data[name] = kept
        for hook in self.on_revoke:
            hook(data, gone)

    def ended(self, gone: list) -> None:
        """Forget what lives in memory for grants just ended (after their state change),
        once the writes they had begun are done (nothing is written after this returns)."""
        for hook in self.on_ended:
            hook(gone)
        with self._lock:  # codes they approved are redeemed for nothing
            for h in [h for h, c in self.codes.items() if c.get("createdBy") in gone]:
                del self.codes[h]
        for g in gone:
            self._used.pop(g, None)
            log.info("grant %s revoked", g)
        for hook in self.after_revoke:
            hook()

    def grants_of_person(self, data: dict, person_id: str) -> list:
        """Return the ids of a person's grants and of all those they made, in `data`."""
        grants = data.get("grants", [])
        theirs = [g["id"] for g in grants if g.get("person") == person_id]
        out = list(theirs)
        for grant_id in theirs:
            out += [g for g in self._made_by(grants, grant_id) if g not in out]
        return out

    def principal_by_id(self, grant_id: Any) -> Principal | None:
        """Return who a grant acts as now: None when `grant_id` names no grant (the owner or
        the CLI made the thing asked about); a principal reaching nothing for a grant gone."""
        if not made_by_grant(grant_id):
            return None
        data = self.state.read()
        g = next((g for g in data.get("grants", []) if g["id"] == grant_id), None)
        return principal_of(data, g) if g else Principal("key", "read", reach=Reach())

    def person_sees(self, person_id: str, path: str) -> bool:
        """Return whether a person reaches a path (their home, a folder shared with them)."""
        return person_reach(self.state.read(), person_id).sees(path)

    def live_maker(self, created_by: Any) -> bool:
        """Return whether what `created_by` made may still be used: made by the owner or
        the CLI (or before it was recorded), or by a grant that is live (not revoked, not
        expired)."""
        if not made_by_grant(created_by):
            return True
        now = self.clock()
        return any(
            g["id"] == created_by and self.expires(g) > now
            for g in self.state.read().get("grants", [])
        )

    def counts(self) -> dict:
        """Return how many grants there are of each kind, and registered OAuth clients."""
        data, now = self.state.read(), self.clock()
        live = [g for g in data.get("grants", []) if self.expires(g) > now]
        kinds = collections.Counter(g["kind"] for g in live)
        return {
            "key": kinds["key"],
            "oauth": kinds["oauth"],
            "share": sum(epoch_of(s["expiresAt"]) > now for s in data.get("shares", [])),
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
            "name": clean_name(meta.get("client_name"), "unnamed client"),
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
                if epoch_of(r.get("lastUsedAt") or r["createdAt"]) < stale and c not in holding
            ]:
                del clients[cid]
            unused = sorted(
                (r["createdAt"], c)
                for c, r in clients.items()
                if not r.get("lastUsedAt")
                and epoch_of(r["createdAt"]) < now - OAUTH_FRESH_CLIENT_SECONDS
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
            "name": clean_name(doc.get("client_name"), host),
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
            "createdBy": entry.get("createdBy"),
            "usedRefresh": [],
        }
        if entry.get("person"):  # a person's connector: their reach, never more
            grant["person"] = entry["person"]
        answer = self._tokens(grant, now)
        try:
            self._add_grant(grant)
        except ApiError as e:
            if e.status_code != 401:
                raise
            raise OAuthError("invalid_grant", "the key that approved this was revoked") from None

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
                if epoch_of(g.get("expiresAt")) <= now:
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
            self._check_maker(data, share["grantId"], now)
            live = [s for s in data.get("shares", []) if epoch_of(s["expiresAt"]) > now]
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
        now, data = self.clock(), self.state.read()
        return [
            self.share_record(s)
            for s in data.get("shares", [])
            if epoch_of(s["expiresAt"]) > now
            and (
                (principal.allows("admin") and self._owns_share(principal, s, data))
                or s.get("grantId") == principal.grant_id
            )
            and principal.sees(s["path"])  # (the owner's: everything)
        ]

    @staticmethod
    def _owns_share(principal: Principal, share: dict, data: dict) -> bool:
        """Return whether an admin principal manages a share link: the owner's every one, a
        person's admin device those made by the person's grants."""
        if not principal.person:
            return True
        maker = next((g for g in data.get("grants", []) if g["id"] == share.get("grantId")), None)
        return maker is not None and maker.get("person") == principal.person

    def revoke_share(self, share_id: str, principal: Principal) -> bool:
        data = self.state.read()

        def mine(s: dict) -> bool:
            return s["id"] == share_id and (
                (principal.allows("admin") and self._owns_share(principal, s, data))
                or s.get("grantId") == principal.grant_id
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
            if hmac.compare_digest(s["tokenHash"], h) and epoch_of(s["expiresAt"]) > now:
                if not s.get("grantId"):
                    return s, OWNER
                for g in data.get("grants", []):
                    if g["id"] == s["grantId"] and self.expires(g) > now:
                        return s, principal_of(data, g)
                return None
        return None

    @staticmethod
    def drop_unreached_shares(data: dict) -> None:
        """Inside a state change: end the share links a person's grant made for a note the
        person no longer reads (the folder's share removed, the note moved out of their
        reach): a link dies when its maker loses the note."""
        shares = data.get("shares", [])
        if not shares or not any(g.get("person") for g in data.get("grants", [])):
            return
        grants = {g["id"]: g for g in data.get("grants", [])}
        kept = []
        for s in shares:
            maker = grants.get(s.get("grantId"))
            if maker and maker.get("person") and not reach_of(data, maker).sees(s["path"]):
                log.info("share link %s ended: its maker no longer reads its note", s["id"])
                continue
            kept.append(s)
        if len(kept) < len(shares):
            data["shares"] = kept

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
                self.drop_unreached_shares(data)  # (moved out of its maker's reach)

        self.state.update(change)
