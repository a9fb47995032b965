"""WebDAV under /dav/: the notes folder in other apps."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import json
import os
import re
import stat
import threading
import time
import unicodedata
import urllib.parse
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Callable

from notesvc.boot import bottle, log
from notesvc.errors import STATUS_CODES, ApiError, to_json
from notesvc.grants import OWNER, Principal, attachments_twin
from notesvc.helpers import (
    BODY_CHUNK,
    TEMP_PREFIX,
    TEMP_SUFFIX,
    atomic_write,
    disk_writes,
    fsync_dir,
    iso,
    request_body_reader,
    request_header,
)
from notesvc.http.api import if_match_header
from notesvc.http.route import conditional_download, file_chunks
from notesvc.notes.paths import (
    ATTACHMENTS,
    MAX_PATH_CHARS,
    NOTES,
    attachment_path,
    check_segments,
    content_type_of,
    make_etag,
    nfc,
)
from notesvc.notes.store import ReadCache, attachment_etag, check_etag
from notesvc.service import Service

# -- WebDAV --------------------------------------------------------------------------------
#
# The notes folder in other apps (docs/api.md: WebDAV): Finder, Windows, rclone, Obsidian.
# /dav/notes/... and /dav/attachments/... for Obsidian (Remotely Save), Markor, Joplin,
# rclone, Finder, Windows and davfs2. Every write goes through the stores: a `.md` file
# under notes/ is a note (history with reason "dav", the index, the change feed, the trash);
# any other file a client puts there (an image beside a note, a .canvas, a dot-folder of
# settings) is kept byte for byte where it was put. Locks live in memory; dead properties in
# the state folder.

DAV_PREFIX = "/dav"
DAV_TOPS = (NOTES, ATTACHMENTS)
DAV_READ = frozenset({"OPTIONS", "PROPFIND", "GET", "HEAD"})
DAV_METHODS = (
    "OPTIONS",
    "PROPFIND",
    "PROPPATCH",
    "GET",
    "HEAD",
    "PUT",
    "DELETE",
    "MKCOL",
    "COPY",
    "MOVE",
    "LOCK",
    "UNLOCK",
)
DAV_MAX_XML = 1 << 20  # a PROPFIND, PROPPATCH or LOCK body
DAV_LOCK_SECONDS = 600  # a lock asked for without a timeout (or an infinite one)
DAV_LOCK_MAX_SECONDS = 3600  # clients refresh what they keep longer
DAV_LOCKS_MAX = 10000
DAV_LOCKS_PER_KEY = 100  # one key's locks at once (the owner's too)
DAV_LOCKS_PER_PATH = 16  # shared locks on one resource
DAV_PROPS_PER_PATH = 100  # dead properties: how many a resource keeps...
DAV_PROPS_BYTES_PER_PATH = 64 * 1024  # ...in how many characters...
DAV_PROPS_PATHS = 10000  # ...on how many resources...
DAV_PROPS_BYTES = 8 << 20  # ...and in how many characters in all
XML_TYPE = "application/xml; charset=utf-8"
DAV_CHALLENGE = 'Basic realm="notesvc", charset="UTF-8"'  # a 401's WWW-Authenticate
NOTE_TYPE = "text/markdown; charset=utf-8"
_DAV_LIVE = (
    "displayname",
    "resourcetype",
    "getcontentlength",
    "getcontenttype",
    "getetag",
    "getlastmodified",
    "creationdate",
    "supportedlock",
    "lockdiscovery",
)
_DOCTYPE_RE = re.compile(rb"<!(DOCTYPE|ENTITY)", re.I)


class DavError(ApiError):
    """A WebDAV failure: its status, and an RFC 4918 precondition element when it has one."""

    def __init__(self, status: int, message: str, condition: str = "", headers: dict | None = None):
        super().__init__(status, STATUS_CODES.get(status, "VALIDATION_ERROR"), message, headers)
        self.condition = condition


@dataclasses.dataclass
class DavLock:
    token: str
    path: str  # the locked resource ("" is the root)
    depth: str  # "0" or "infinity"
    owner: str  # the client's <owner> element, as XML
    seconds: int
    expires: float
    holder: str  # who took it (a grant id, "owner"): only they may refresh or unlock it
    scope: str = "exclusive"  # or "shared": shared locks live together, never with another

    def covers(self, path: str) -> bool:
        return path == self.path or (
            self.depth == "infinity" and (not self.path or path.startswith(self.path + "/"))
        )


class DavNotes(ReadCache):
    """The bytes and ETag of the notes GET lately, each kept with its file's signature
    (device, inode, size, mtime, ctime; ReadCache's rules) and given again only while the
    walk for links (dav_item) finds none and the same signature: a GET of a note read
    before costs the walk's lstat calls, where the open and the reads added seven more
    system calls, each handing the GIL to another of waitress's threads. Filled by a GET
    that found no link on the way only: never by the API, which follows links inside the
    root where WebDAV answers 403."""

    MAX_BYTES = 2 << 20


class DavState:
    """What WebDAV keeps beside the stores: locks (in memory), dead properties (a JSON file
    in the state folder), the store of other files under notes/, an ETag cache of notes
    (by their stat, so a listing reads each note once until it changes) and the bytes of
    the notes GET lately (DavNotes)."""

    def __init__(self, svc: Service):
        self.notes = DavNotes()
        self.files = svc.note_files  # the other files under notes/, with the notes' trash
        self.grants = svc.grants  # a revoked key's locks end with it
        self.props_file = svc.config.state_dir / "dav-properties.json"
        self.lock = threading.RLock()
        self.locks: dict = {}
        self.etags: dict = {}
        try:
            self.props = json.loads(self.props_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            self.props = {}

    # -- locks ------------------------------------------------------------------------

    def live_locks(self) -> list:
        """The locks held now: not expired, and their key not revoked."""
        if not self.locks:
            return []
        now = time.monotonic()
        keys = {g["id"] for g in self.grants.grants()}
        with self.lock:
            for token, lk in list(self.locks.items()):
                if lk.expires <= now or (lk.holder != "owner" and lk.holder not in keys):
                    del self.locks[token]
            return list(self.locks.values())

    def locks_on(self, path: str, below: bool = False) -> list:
        """The locks covering path (and with `below`, those on anything under it)."""
        return [
            lk
            for lk in self.live_locks()
            if lk.covers(path) or (below and (not path or lk.path.startswith(path + "/")))
        ]

    # -- dead properties ----------------------------------------------------------------

    def props_of(self, path: str) -> dict:
        with self.lock:
            return dict(self.props.get(path, {}))

    def _save_props(self) -> None:
        atomic_write(self.props_file, to_json(self.props))

    def set_props(self, path: str, changes: list) -> None:
        with self.lock:
            kept = dict(self.props.get(path, {}))
            for name, xml in changes:
                if xml is None:
                    kept.pop(name, None)
                else:
                    kept[name] = xml
            size = sum(len(k) + len(v) for k, v in kept.items())
            if len(kept) > DAV_PROPS_PER_PATH or size > DAV_PROPS_BYTES_PER_PATH:
                raise DavError(
                    507,
                    f"a resource keeps at most {DAV_PROPS_PER_PATH} properties of "
                    f"{DAV_PROPS_BYTES_PER_PATH // 1024} KiB in all",
                )
            if len(self.props) >= DAV_PROPS_PATHS and path not in self.props:
                raise DavError(507, f"properties are kept for {DAV_PROPS_PATHS} resources at most")
            before = sum(len(k) + len(x) for k, x in self.props.get(path, {}).items())
            if self.props_bytes - before + size > DAV_PROPS_BYTES:
                raise DavError(507, f"properties are kept up to {DAV_PROPS_BYTES >> 20} MiB in all")
            if kept:
                self.props[path] = kept
            else:
                self.props.pop(path, None)
            self._save_props()

    def props_room(self, src: str) -> None:
        """507 when a copy of src (and what is below it) would pass the properties' bounds."""
        with self.lock:
            carried = [v for p, v in self.props.items() if p == src or p.startswith(src + "/")]
            size = sum(len(k) + len(x) for v in carried for k, x in v.items())
            if carried and (
                len(self.props) + len(carried) > DAV_PROPS_PATHS
                or self.props_bytes + size > DAV_PROPS_BYTES
            ):
                raise DavError(507, "no room left for the properties this copy would carry")

    @property
    def props_bytes(self) -> int:
        return sum(len(k) + len(x) for v in self.props.values() for k, x in v.items())

    def carry_props(self, src: str, dst: str, keep_source: bool) -> None:
        """A move (or copy) of src to dst takes its properties and its children's along."""
        with self.lock:
            moved = {p: v for p, v in self.props.items() if p == src or p.startswith(src + "/")}
            if not moved:
                return
            for p, v in moved.items():
                if not keep_source:
                    del self.props[p]
                self.props[dst + p[len(src) :]] = dict(v)
            self._save_props()

    def drop_locks(self, path: str) -> None:
        """A resource deleted or moved away takes its locks (and those below it) along."""
        with self.lock:
            for token, lk in list(self.locks.items()):
                if lk.path == path or lk.path.startswith(path + "/"):
                    del self.locks[token]

    def drop_props(self, path: str) -> None:
        with self.lock:
            gone = [p for p in self.props if p == path or p.startswith(path + "/")]
            for p in gone:
                del self.props[p]
            if gone:
                self._save_props()

    def note_etag(self, file: Path, st: os.stat_result) -> str:
        key = (str(file), st.st_mtime_ns, st.st_size, st.st_ino)
        found = self.etags.get(key[0])
        if found and found[0] == key:
            return found[1]
        with open(file, "rb") as f:
            etag = make_etag(f.read())
        if len(self.etags) > 100000:
            self.etags.clear()
        self.etags[key[0]] = (key, etag)
        return etag


def dav_state(svc: Service) -> DavState:
    """Return the Service's DavState (`svc.dav`), made on first use."""
    state = svc.dav
    if state is None:
        with _DAV_START:
            state = svc.dav or DavState(svc)
            svc.dav = state
    return state


_DAV_START = threading.Lock()


# -- what a /dav/ path names ------------------------------------------------------------------


@dataclasses.dataclass
class DavItem:
    path: str  # "" (the root), "notes", "notes/a/b.md", "attachments/x.png"
    file: str | None  # on disk (None: the root)
    st: os.stat_result | None  # None: nothing there
    kept: dict | None = None  # a note's {"etag", "data"} while its file is as GET read it

    @property
    def top(self) -> str:
        return self.path.split("/", 1)[0]

    @property
    def is_dir(self) -> bool:
        if not self.path or self.path in DAV_TOPS:
            return True
        return self.st is not None and stat.S_ISDIR(self.st.st_mode)

    @property
    def exists(self) -> bool:
        return not self.path or self.path in DAV_TOPS or self.st is not None

    @property
    def is_note(self) -> bool:
        return dav_is_note(self.path)


def dav_is_note(path: str) -> bool:
    """A `.md` file under notes/ outside any dot-folder is a note; anything else is a file."""
    segments = path.split("/")
    return (
        segments[0] == NOTES
        and len(segments) > 1
        and path.endswith(".md")
        and segments[-1] != ".md"
        and not any(s.startswith(".") for s in segments)
    )


def dav_checked(raw: str) -> str:
    """Return a /dav/ path (decoded, NFC, no trailing slash), checked by the note path rules,
    except that dot-names are allowed (an Obsidian vault's .obsidian/); 403 otherwise."""
    path = unicodedata.normalize("NFC", raw).strip("/")
    if not path:
        return ""
    segments = path.split("/")
    if "." in segments or ".." in segments:  # a name the path rules refuse, wherever it is
        raise DavError(403, "a WebDAV path holds no . or .. segment")
    if segments[0] not in DAV_TOPS:
        raise DavError(
            404, f"nothing at /dav/{path[:MAX_PATH_CHARS]}: only notes/ and attachments/"
        )
    if len(segments) == 1:
        return path
    shown = "/".join(
        "_" + s[1:] if s.startswith(".") and s not in (".", "..") else s for s in segments
    )
    try:
        check_segments(shown, "WebDAV", segments[0])
    except ApiError as e:
        raise DavError(403, e.message) from None
    return path


def dav_item(svc: Service, path: str, kept: DavNotes | None = None) -> DavItem:
    """Return what is at a checked path; a symbolic link anywhere on the way is 403.
    With `kept` (a GET's), a note kept there and unchanged is not read again."""
    if not path:
        return DavItem("", None, None)
    base = str(svc.notes.base)
    file = str(svc.notes.on_disk(path)) if path.startswith(NOTES) else f"{base}/{path}"
    st = _dav_walk(path, file, f"{base}/{path.split('/', 1)[0]}")
    if st is not None and not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        raise DavError(403, f"/dav/{path} is neither a file nor a folder")
    found = kept.kept(path, st) if kept is not None and st is not None else None
    return DavItem(path, file, st, found)


def _dav_walk(path: str, file: str, top: str) -> os.stat_result | None:
    """Return the lstat of file below top (None: nothing there), 403 when a folder on the
    way or the file itself is a symbolic link: an lstat a segment (os.stat for a top)."""
    at = top
    below = file[len(top) + 1 :].split("/") if len(file) > len(top) else ()
    for part in below[:-1]:
        at = f"{at}/{part}"
        if os.path.islink(at):
            raise DavError(403, f"/dav/{path} leads through a symbolic link")
    try:  # (attachments/ before the first upload: None, a folder all the same)
        st = os.lstat(file) if below else os.stat(file)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if stat.S_ISLNK(st.st_mode):
        raise DavError(403, f"/dav/{path} leads through a symbolic link")
    return st


def dav_grant_sees(principal: Principal, path: str, write: bool = False) -> bool:
    """A grant sees the folders of its reach (notes/<f>, attachments/<f>) and what is
    inside; the folders above them only as the way there, and it writes nothing outside
    them, nor where it may only read."""
    if principal.whole:
        return True
    folders = principal.folders
    own = (*folders, *(attachments_twin(f) for f in folders))
    if write:  # (its folder itself too: a new folder key's first MKCOL makes it)
        return principal.sees(path) and principal.may_write(path)
    inside = any(path.startswith(f + "/") for f in own)
    return inside or path in own or any(not path or f.startswith(path + "/") for f in own)


@functools.lru_cache(maxsize=4096)
def _quoted_folder(path: str) -> str:
    return urllib.parse.quote(path)


def dav_href(script: str, path: str, folder: bool) -> str:
    """The URL path of a resource (a folder's ends in /); a folder's part is quoted once for
    all its entries."""
    parent, _, name = path.rpartition("/")
    quoted = (
        f"{_quoted_folder(parent)}/{urllib.parse.quote(name)}" if parent else _quoted_folder(path)
    )
    href = f"{script}{DAV_PREFIX}/{quoted}"
    return href + "/" if folder and path else href


# -- reading XML: no DTD, no entities, a bounded size ----------------------------------------


def dav_body(limit: int = DAV_MAX_XML) -> bytes:
    read, _ = request_body_reader(limit, "the WebDAV XML limit (1 MiB)")
    parts, size = [], 0
    while chunk := read(BODY_CHUNK):
        parts.append(chunk)
        size += len(chunk)
    return b"".join(parts)


DAV_XML_DEPTH = 32  # elements within elements: a property's value, an owner


def dav_xml(body: bytes):
    """Return the parsed XML body (None when empty); 400 for a DTD or an entity declaration
    (refused in any encoding, before anything is expanded or fetched), for XML nested
    deeper than DAV_XML_DEPTH and for XML that is not well formed."""
    if not body.strip():
        return None
    if _DOCTYPE_RE.search(body):  # (UTF-8 and ASCII: refused before the parser starts)
        raise DavError(400, "XML with a DTD or entity declarations is not accepted")
    import xml.etree.ElementTree as ET  # (only WebDAV reads XML: imported on first use)
    import xml.parsers.expat

    def refuse(*_args) -> None:
        raise DavError(400, "XML with a DTD or entity declarations is not accepted")

    # A first pass with expat's own handlers: a DTD stops it where it starts, in whatever
    # encoding the body is (UTF-16 hides "<!DOCTYPE" from the check above), so ElementTree
    # below only ever reads XML without one.
    scan = xml.parsers.expat.ParserCreate()
    scan.StartDoctypeDeclHandler = refuse
    scan.EntityDeclHandler = refuse
    scan.ExternalEntityRefHandler = refuse
    try:
        scan.Parse(body, True)
        root = ET.fromstring(body)  # noqa: S314 - no DTD (refused above)
    except (xml.parsers.expat.ExpatError, ET.ParseError) as e:
        raise DavError(400, f"the XML body is not well formed: {e}") from None
    level = [(root, 1)]
    while level:  # (iteratively: a deep body must not reach a recursive step)
        elem, depth = level.pop()
        if depth > DAV_XML_DEPTH:
            raise DavError(400, f"the XML body is nested deeper than {DAV_XML_DEPTH} elements")
        level.extend((child, depth + 1) for child in elem)
    return root


def dav_name(tag: str) -> tuple:
    """('DAV:', 'getetag') from '{DAV:}getetag'; ('', 'x') for an element in no namespace."""
    if tag.startswith("{"):
        ns, _, local = tag[1:].partition("}")
        return ns, local
    return "", tag


def _xml_of(elem) -> str:
    import xml.etree.ElementTree as ET

    elem.tail = None
    return ET.tostring(elem, encoding="unicode")


# characters XML 1.0 cannot carry at all, not even as references (its Char production)
XML_NON_CHAR_RE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def xesc(text: str) -> str:
    """Text as XML character data or an attribute value (what XML cannot hold as U+FFFD)."""
    return (
        XML_NON_CHAR_RE.sub("\ufffd", text)
        .replace("&", "&amp;")
        .replace("<", "&lt;")
        .replace(">", "&gt;")
        .replace('"', "&quot;")
    )


def empty_prop(tag: str) -> str:
    ns, local = dav_name(tag)
    if ns == "DAV:":
        return f"<D:{local}/>"
    if not ns:
        return f'<{local} xmlns=""/>'
    quoted = xesc(ns).replace("\n", "&#10;").replace("\r", "&#13;").replace("\t", "&#9;")
    return f'<X:{local} xmlns:X="{quoted}"/>'


# -- properties ---------------------------------------------------------------------------------


def _http_date(ts: float) -> str:
    """RFC 9110's date (its English names whatever the locale)."""
    t = time.gmtime(ts)
    day = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")[t.tm_wday]
    month = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
    clock = f"{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d}"
    return f"{day}, {t.tm_mday:02d} {month[t.tm_mon - 1]} {t.tm_year} {clock} GMT"


_SUPPORTED_LOCK = "<D:supportedlock>{}</D:supportedlock>".format(
    "".join(
        f"<D:lockentry><D:lockscope><D:{scope}/></D:lockscope>"
        "<D:locktype><D:write/></D:locktype></D:lockentry>"
        for scope in ("exclusive", "shared")
    )
)


def dav_live(dav: DavState, item: DavItem, name: str) -> str | None:
    """Return the XML of a live property of item (None when it has no such property)."""
    st = item.st
    folder = st is None or stat.S_ISDIR(st.st_mode) if item.path not in DAV_TOPS else True
    if name == "displayname":
        return f"<D:displayname>{xesc(item.path.rsplit('/', 1)[-1])}</D:displayname>"
    if name == "resourcetype":
        return "<D:resourcetype><D:collection/></D:resourcetype>" if folder else "<D:resourcetype/>"
    if name == "supportedlock":
        return _SUPPORTED_LOCK
    if name == "lockdiscovery":
        return dav_lockdiscovery(dav.locks_on(item.path))
    if st is None:
        return None
    if name == "getlastmodified":
        return f"<D:getlastmodified>{_http_date(st.st_mtime)}</D:getlastmodified>"
    if name == "creationdate":
        return f"<D:creationdate>{iso(min(st.st_ctime, st.st_mtime))}</D:creationdate>"
    if folder:
        return None
    if name == "getcontentlength":
        return f"<D:getcontentlength>{st.st_size}</D:getcontentlength>"
    if name == "getcontenttype":
        kind = NOTE_TYPE if item.path.endswith(".md") else content_type_of(item.path)
        return f"<D:getcontenttype>{kind}</D:getcontenttype>"
    if name == "getetag":
        try:
            return f"<D:getetag>{xesc(dav_etag(dav, item))}</D:getetag>"
        except OSError:  # deleted while the listing was made
            return None
    return None


def dav_etag(dav: DavState, item: DavItem) -> str:
    """The API's ETag: a note's is its content's, a file's its attachment ETag."""
    if item.is_note:
        return dav.note_etag(item.file, item.st)
    return attachment_etag(item.st)


def dav_propstat(found: list, missing: list) -> str:
    out = []
    if found:
        out.append(
            "<D:propstat><D:prop>" + "".join(found) + "</D:prop>"
            "<D:status>HTTP/1.1 200 OK</D:status></D:propstat>"
        )
    if missing:
        out.append(
            "<D:propstat><D:prop>" + "".join(missing) + "</D:prop>"
            "<D:status>HTTP/1.1 404 Not Found</D:status></D:propstat>"
        )
    return "".join(out)


def dav_response(href: str, inner: str) -> str:
    return f"<D:response><D:href>{xesc(href)}</D:href>{inner}</D:response>"


def dav_multistatus(parts: Iterable[str]) -> bytes:
    body = (
        '<?xml version="1.0" encoding="utf-8"?>\n<D:multistatus xmlns:D="DAV:">'
        + "".join(parts)
        + "</D:multistatus>"
    )
    bottle.response.status = 207
    bottle.response.content_type = XML_TYPE
    return body.encode("utf-8")


def dav_shown_name(name: str) -> bool:
    """Whether a name on disk can be listed: UTF-8 (a name that is not comes decoded with
    surrogates) and no control characters."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return not any(ord(c) < 32 or 0x7F <= ord(c) < 0xA0 for c in name)


def dav_children(svc: Service, item: DavItem, principal: Principal) -> list:
    """Return the items in a folder the grant may see (the root: notes/ and attachments/)."""
    out = []
    if not item.path:
        for top in DAV_TOPS:
            if dav_grant_sees(principal, top):
                out.append(dav_item(svc, top))
        return out
    try:
        with os.scandir(item.file) as found:
            entries = sorted(found, key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        entries = []
    for e in entries:
        name = e.name
        if name.startswith(TEMP_PREFIX) and name.endswith(TEMP_SUFFIX):
            continue  # a write under way
        if not dav_shown_name(name):
            continue  # a name no path may hold (control characters, bytes that are not UTF-8)
        path = f"{item.path}/{nfc(name)}"
        if not dav_grant_sees(principal, path):
            continue
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode):  # (no links, pipes)
            out.append(DavItem(path, e.path, st))
    return out


# -- locks and the If header ----------------------------------------------------------------

_IF_LIST_RE = re.compile(r"\s*(?:<([^>]*)>\s*)?\(([^)]*)\)")
_IF_COND_RE = re.compile(r"\s*(Not\s+)?(?:<([^>]*)>|\[([^\]]*)\])", re.I)


def dav_if(svc: Service, dav: DavState, item: DavItem, ctx: dict) -> set:
    """Evaluate the If header (RFC 4918 10.4) for the request; 412 when it is false. Return
    the lock tokens it names (a write on a locked resource needs its token among them)."""
    header = request_header("If")
    if not header:
        return set()
    tokens, lists, rest = set(), [], header.strip()
    while rest:
        m = _IF_LIST_RE.match(rest)
        if not m:
            raise DavError(400, "the If header is not understood")
        conds, inner = [], m.group(2)
        while inner.strip():
            c = _IF_COND_RE.match(inner)
            if not c:
                raise DavError(400, "the If header is not understood")
            negate, token, etag = bool(c.group(1)), c.group(2), c.group(3)
            if token is not None:
                tokens.add(token)
            conds.append((negate, token, etag))
            inner = inner[c.end() :]
        lists.append((m.group(1), conds))
        rest = rest[m.end() :].strip()

    def holds(target: DavItem, negate: bool, token: str | None, etag: str | None) -> bool:
        if token is not None:
            ok = any(lk.token == token for lk in dav.locks_on(target.path))
        else:
            ok = target.exists and not target.is_dir and etag == dav_etag(dav, target)
        return ok != negate

    def resource(tag: str | None) -> DavItem:
        if tag is None:
            return item
        path = urllib.parse.urlsplit(tag).path
        prefix = f"{ctx['script']}{DAV_PREFIX}"
        nothing = DavItem("\0", None, None)  # another server's, or one this key cannot see
        if not path.startswith(prefix):
            return nothing
        try:
            checked = dav_checked(urllib.parse.unquote(path[len(prefix) :]))
            return dav_item(svc, checked) if dav_grant_sees(ctx["principal"], checked) else nothing
        except ApiError:
            return nothing

    if not any(all(holds(resource(tag), *c) for c in conds) for tag, conds in lists):
        raise DavError(412, "the If header's conditions do not hold")
    return tokens


def dav_unlocked(dav: DavState, path: str, tokens: set, below: bool = False) -> None:
    """423 when a lock covers path (or with `below`, anything under it) and its token was
    not given (of shared locks on one resource, one of their tokens)."""
    locks = dav.locks_on(path, below)
    if any(lk.scope == "exclusive" and lk.token not in tokens for lk in locks):
        raise DavError(423, f"/dav/{path} is locked", "lock-token-submitted")
    shared = {}
    for lk in locks:
        if lk.scope == "shared":
            shared.setdefault(lk.path, set()).add(lk.token)
    if any(not (held & tokens) for held in shared.values()):
        raise DavError(423, f"/dav/{path} is locked", "lock-token-submitted")


def dav_lockdiscovery(locks: list) -> str:
    active = "".join(dav_activelock(lk) for lk in locks)
    return f"<D:lockdiscovery>{active}</D:lockdiscovery>"


def dav_activelock(lk: DavLock) -> str:
    root = f"{bottle.request.environ.get('SCRIPT_NAME', '')}{DAV_PREFIX}/" + urllib.parse.quote(
        lk.path
    )
    left = max(0, int(lk.expires - time.monotonic()))
    return (
        "<D:activelock><D:locktype><D:write/></D:locktype>"
        f"<D:lockscope><D:{lk.scope}/></D:lockscope>"
        f"<D:depth>{lk.depth}</D:depth>{lk.owner}"
        f"<D:timeout>Second-{left}</D:timeout>"
        f"<D:locktoken><D:href>{lk.token}</D:href></D:locktoken>"
        f"<D:lockroot><D:href>{xesc(root)}</D:href></D:lockroot>"
        "</D:activelock>"
    )


def _lock_seconds() -> int:
    for part in (request_header("Timeout") or "").split(","):
        part = part.strip()
        if part.lower().startswith("second-") and part[7:].isdigit():
            return max(1, min(int(part[7:]), DAV_LOCK_MAX_SECONDS))
    return DAV_LOCK_SECONDS


# -- writing through the stores ---------------------------------------------------------------


def dav_store(svc: Service, dav: DavState, path: str):
    """The store of a file that is not a note: attachments/ or the other files of notes/."""
    return svc.attachments if path.startswith(ATTACHMENTS + "/") else dav.files


def dav_parent_ready(svc: Service, path: str) -> None:
    """409 when the folder a new resource goes into is not there (RFC 4918 9.7.1)."""
    parent = path.rsplit("/", 1)[0]
    if parent in DAV_TOPS:
        return
    got = dav_item(svc, parent)
    if not got.exists or not got.is_dir:
        raise DavError(409, f"/dav/{parent}/ is not a folder: create it first (MKCOL)")


def dav_keep_folder(item: DavItem) -> None:
    """The stores remove a folder a delete or move left empty; a WebDAV client made it and
    expects it to stay."""
    folder = os.path.dirname(item.file)
    if "/" in item.path and not os.path.exists(folder):
        with disk_writes():
            os.makedirs(folder, exist_ok=True)


def dav_write_file(
    svc: Service, dav: DavState, path: str, read: Callable, if_match=None, if_none_match=None
) -> tuple:
    """Write a resource from read(n) -> bytes; return (etag, created)."""
    if dav_is_note(path):
        data, size = [], 0
        while chunk := read(BODY_CHUNK):
            data.append(chunk)
            size += len(chunk)
        try:
            text = b"".join(data).decode("utf-8")
        except UnicodeDecodeError:
            raise DavError(415, f"/dav/{path} is a note: its bytes must be UTF-8 text") from None
        if svc.notes.exists(path):
            if if_none_match is not None and if_none_match.strip() == "*":
                raise DavError(412, f"a note exists at /dav/{path} (If-None-Match: *)")
            rec = svc.notes.update(path, text, if_match, reason="dav")
            return rec["etag"], False
        if if_match is not None:
            raise DavError(412, f"no note at /dav/{path} to match If-Match")
        return svc.notes.create(path, text)["etag"], True
    store = dav_store(svc, dav, path)
    if path.startswith(ATTACHMENTS + "/") and not path.rsplit("/", 1)[-1].startswith("."):
        try:
            attachment_path(path)
        except ApiError as e:
            raise DavError(403, e.message) from None

    def copy(f) -> None:
        while chunk := read(BODY_CHUNK):
            f.write(chunk)

    rec, created = store.place(store.spool(copy), path, if_match, if_none_match)
    return rec["etag"], created


def dav_delete(svc: Service, dav: DavState, item: DavItem) -> None:
    """Delete a resource into the trash (a folder: everything in it, each restorable)."""
    if item.is_dir:
        for child in dav_children(svc, item, OWNER):
            dav_delete(svc, dav, child)
        with contextlib.suppress(OSError), disk_writes():
            os.rmdir(item.file)
    elif item.is_note:
        svc.notes.delete(item.path)
    else:
        dav_store(svc, dav, item.path).delete(item.path)
    dav.drop_props(item.path)


def dav_can_place(
    svc: Service, src: DavItem, dst: str, depth: str, principal: Principal = OWNER
) -> None:
    """Refuse a copy or move before it starts: each file it would write must be one its new
    place takes (a note: UTF-8, the body limit; under attachments/: an attachment's
    extension; any file: the attachment limit), so it never stops halfway. Only what
    `principal` sees is copied (a folder on the way down to its reach: that way only)."""
    if src.is_dir:
        for child in dav_children(svc, src, principal) if depth != "0" else ():
            name = child.path.rsplit("/", 1)[-1]
            dav_can_place(svc, child, dav_checked(f"{dst}/{name}"), depth, principal)
        return
    size, note = src.st.st_size, dav_is_note(dst)
    limit = svc.config.max_body_bytes if note else svc.config.max_attachment_bytes
    if size > limit:
        raise DavError(413, f"/dav/{src.path} is over {limit} bytes, the limit at /dav/{dst}")
    if note and not src.is_note:
        with open(src.file, "rb") as f:
            try:
                f.read().decode("utf-8")
            except UnicodeDecodeError:
                raise DavError(
                    415, f"/dav/{dst} would be a note: its bytes must be UTF-8"
                ) from None
    if dst.startswith(ATTACHMENTS + "/") and not dst.rsplit("/", 1)[-1].startswith("."):
        try:
            attachment_path(dst)
        except ApiError as e:
            raise DavError(403, e.message) from None


def dav_copy(
    svc: Service,
    dav: DavState,
    src: DavItem,
    dst: str,
    move: bool,
    depth: str,
    principal: Principal = OWNER,
):
    """Copy or move src to dst (not there: the caller made room): what `principal` sees of
    it (a folder above its reach holds only the way down; a move's source is all seen)."""
    if src.is_dir:
        with disk_writes():
            os.makedirs(svc.notes.on_disk(dst), exist_ok=True)
        if depth != "0" or move:
            for child in dav_children(svc, src, principal):
                name = child.path.rsplit("/", 1)[-1]
                dav_copy(svc, dav, child, f"{dst}/{name}", move, depth, principal)
        if move:
            with contextlib.suppress(OSError), disk_writes():
                os.rmdir(src.file)
    elif move and src.is_note and dav_is_note(dst):
        svc.notes.move(src.path, dst)
    elif move and not src.is_note and not dav_is_note(dst) and src.top == dst.split("/")[0]:
        dav_store(svc, dav, src.path).move(src.path, dst)
    else:
        with open(src.file, "rb") as f:
            dav_write_file(svc, dav, dst, f.read, if_none_match="*")
        if move:
            dav_delete(svc, dav, src)
            return
    dav.carry_props(src.path, dst, keep_source=not move)


# -- the methods ------------------------------------------------------------------------------


def dav_options(svc: Service, dav: DavState, item: DavItem, ctx: dict):
    resp = bottle.response
    resp.set_header("DAV", "1, 2")
    resp.set_header("MS-Author-Via", "DAV")
    resp.set_header("Allow", ", ".join(DAV_METHODS))
    resp.set_header("Content-Length", "0")
    resp.content_type = "text/plain; charset=utf-8"
    return b""


def dav_propfind(svc: Service, dav: DavState, item: DavItem, ctx: dict):
    depth = (request_header("Depth") or "infinity").strip().lower()
    if depth not in ("0", "1"):
        raise DavError(
            403, "PROPFIND with Depth: infinity is not served: ask Depth 1", "propfind-finite-depth"
        )
    root = dav_xml(dav_body())
    mode, wanted = "allprop", []
    if root is not None:
        if root.tag != "{DAV:}propfind":
            raise DavError(400, "a PROPFIND body is a DAV:propfind element")
        for child in root:
            if child.tag == "{DAV:}propname":
                mode = "propname"
            elif child.tag == "{DAV:}prop":
                mode, wanted = "prop", [(c.tag, *dav_name(c.tag)) for c in child]
    if not item.exists:
        raise DavError(404, f"nothing at /dav/{item.path}")
    items = [item]
    if depth == "1" and item.is_dir:
        items += dav_children(svc, item, ctx["principal"])
    script, principal = ctx["script"], ctx["principal"]
    return dav_multistatus(
        dav_response(
            dav_href(script, i.path, i.is_dir),
            dav_props(dav, i, mode, wanted, dav_only_the_way(principal, i.path)),
        )
        for i in items
    )


def dav_only_the_way(principal: Principal, path: str) -> bool:
    """Whether a grant sees a folder only as its way down to its reach (notes/, a folder
    above a shared one, another's home): its dates, locks and properties are others'."""
    if principal.whole or not path:
        return False
    own = (*principal.folders, *(attachments_twin(f) for f in principal.folders))
    return not any(path == f or path.startswith(f + "/") for f in own)


def dav_props(
    dav: DavState, item: DavItem, mode: str, wanted: list, only_the_way: bool = False
) -> str:
    """The properties of item; a folder on the way down shows its name and kind only (no
    dates, locks or dead properties: they tell of what others keep and do in it)."""
    dead = dav.props_of(item.path) if dav.props and not only_the_way else {}
    if only_the_way:
        bare = dataclasses.replace(item, st=None)

        def live(dav: DavState, _item: DavItem, name: str) -> str | None:
            if name == "lockdiscovery":
                return "<D:lockdiscovery/>"
            return dav_live(dav, bare, name)

        return _dav_props(dav, item, mode, wanted, dead, live)
    return _dav_props(dav, item, mode, wanted, dead, dav_live)


def _dav_props(
    dav: DavState, item: DavItem, mode: str, wanted: list, dead: dict, live: Callable
) -> str:
    if mode == "propname":
        names = [f"<D:{n}/>" for n in _DAV_LIVE if live(dav, item, n) is not None]
        return dav_propstat(names + [empty_prop(t) for t in dead], [])
    if mode == "allprop":
        found = [x for n in _DAV_LIVE if (x := live(dav, item, n)) is not None]
        return dav_propstat(found + list(dead.values()), [])
    found, missing = [], []
    for tag, ns, local in wanted:
        value = live(dav, item, local) if ns == "DAV:" else None
        if value is None:
            value = dead.get(tag)
        (found if value is not None else missing).append(value or empty_prop(tag))
    return dav_propstat(found, missing)


def dav_proppatch(svc: Service, dav: DavState, item: DavItem, ctx: dict):
    if not item.exists:
        raise DavError(404, f"nothing at /dav/{item.path}")
    dav_unlocked(dav, item.path, ctx["tokens"])
    root = dav_xml(dav_body())
    if root is None or root.tag != "{DAV:}propertyupdate":
        raise DavError(400, "a PROPPATCH body is a DAV:propertyupdate element")
    changes, refused = [], []
    for op in root:
        if op.tag not in ("{DAV:}set", "{DAV:}remove"):
            continue
        for prop in op.findall("{DAV:}prop"):
            for elem in prop:
                if dav_name(elem.tag)[0] == "DAV:":
                    refused.append(elem.tag)  # the live properties are the server's
                elif op.tag == "{DAV:}set":
                    changes.append((elem.tag, _xml_of(elem)))
                else:
                    changes.append((elem.tag, None))
    names = [t for t, _ in changes] + refused
    if refused:  # all or nothing (RFC 4918 9.2)
        inner = (
            "<D:propstat><D:prop>" + "".join(empty_prop(t) for t in refused) + "</D:prop>"
            "<D:status>HTTP/1.1 403 Forbidden</D:status>"
            "<D:error><D:cannot-modify-protected-property/></D:error></D:propstat>"
        )
        others = [t for t, _ in changes]
        if others:
            inner += (
                "<D:propstat><D:prop>" + "".join(empty_prop(t) for t in others) + "</D:prop>"
                "<D:status>HTTP/1.1 424 Failed Dependency</D:status></D:propstat>"
            )
    else:
        dav.set_props(item.path, changes)
        inner = dav_propstat([empty_prop(t) for t in dict.fromkeys(names)], [])
    return dav_multistatus([dav_response(dav_href(ctx["script"], item.path, item.is_dir), inner)])


def dav_get(svc: Service, dav: DavState, item: DavItem, ctx: dict):
    if not item.exists:
        raise DavError(404, f"nothing at /dav/{item.path}")
    if item.is_dir:
        raise DavError(
            405,
            "a folder has no content: list it with PROPFIND",
            headers={
                "Allow": "OPTIONS, PROPFIND, PROPPATCH, DELETE, MKCOL, COPY, MOVE, LOCK, UNLOCK"
            },
        )
    data = None
    if item.kept is not None:  # unchanged since a GET read it (DavNotes)
        data = item.kept["data"]
        etag, size = item.kept["etag"], len(data)
    elif item.is_note:  # read once: its ETag and its bytes are of the same version
        data, st = dav_read(item)
        etag, size = make_etag(data), len(data)
        dav.notes.put(item.path, st, {"etag": etag, "data": data})
    else:
        etag, size = attachment_etag(item.st), item.st.st_size
    kind = NOTE_TYPE if item.path.endswith(".md") else content_type_of(item.path)
    modified = (("Last-Modified", _http_date(item.st.st_mtime)),)
    span = conditional_download(etag, size, kind, item.path, modified)
    if span is None or ctx["method"] == "HEAD":
        return b""
    first, length = span
    if data is not None:
        return data[first : first + length]
    f = open(item.file, "rb")  # noqa: SIM115 - closed by _file_chunks
    f.seek(first)
    return file_chunks(f, length)


def dav_read(item: DavItem) -> tuple:
    """Return (bytes, stat) of a note by its descriptor (no buffered file's isatty and seek
    calls), the stat of what was read; 404 when it went, 403 when it is a link now (the
    walk found none) or no longer a plain file."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(item.file, flags)  # O_NONBLOCK: a named pipe is never waited on
    except (FileNotFoundError, NotADirectoryError):
        raise DavError(404, f"nothing at /dav/{item.path}") from None
    except OSError:  # ELOOP: it became a link
        raise DavError(403, f"/dav/{item.path} leads through a symbolic link") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DavError(403, f"/dav/{item.path} is neither a file nor a folder")
        data = os.read(fd, st.st_size + 1)
        if len(data) > st.st_size:  # it grew meanwhile
            parts = [data]
            while chunk := os.read(fd, BODY_CHUNK):
                parts.append(chunk)
            data = b"".join(parts)
        return data, st
    finally:
        os.close(fd)


def dav_put(svc: Service, dav: DavState, item: DavItem, ctx: dict):
    if not item.path or item.path in DAV_TOPS or item.is_dir:
        raise DavError(405, "a folder cannot be written: PUT a file into it")
    if request_header("Content-Range"):
        raise DavError(400, "PUT writes a whole file: Content-Range is not accepted")
    dav_parent_ready(svc, item.path)
    dav_unlocked(dav, item.path, ctx["tokens"])
    note = dav_is_note(item.path)
    limit = svc.config.max_body_bytes if note else svc.config.max_attachment_bytes
    setting = "SERVICE_MAX_BODY_BYTES" if note else "SERVICE_MAX_ATTACHMENT_BYTES"
    read, _ = request_body_reader(limit, setting)
    etag, created = dav_write_file(
        svc, dav, item.path, read, if_match_header(), request_header("If-None-Match")
    )
    bottle.response.status = 201 if created else 204
    bottle.response.set_header("ETag", etag)
    return b""


def dav_delete_method(svc: Service, dav: DavState, item: DavItem, ctx: dict):
    if not item.path or item.path in DAV_TOPS:
        raise DavError(403, "notes/ and attachments/ themselves cannot be deleted")
    if not item.exists:
        raise DavError(404, f"nothing at /dav/{item.path}")
    if item.is_dir and (request_header("Depth") or "infinity").lower() != "infinity":
        raise DavError(400, "a folder is deleted whole: Depth: infinity")
    if request_header("If-Match") and not item.is_dir:
        check_etag(if_match_header(), dav_etag(dav, item), "file")
    if item.is_dir:  # a person's home, a shared folder: not by its members (403)
        svc.people.check_folder_change(ctx["principal"], item.path, None)
    dav_unlocked(dav, item.path, ctx["tokens"], below=True)
    dav_delete(svc, dav, item)
    dav.drop_locks(item.path)  # (RFC 4918 9.6.1)
    if item.is_dir and os.path.lexists(item.file):
        raise DavError(409, f"/dav/{item.path}/ holds files whose names no path may hold")
    dav_keep_folder(item)
    if item.is_dir and item.top == NOTES:
        svc.people.folder_deleted(item.path)  # its shares end with it
    bottle.response.status = 204
    return b""


def dav_mkcol(svc: Service, dav: DavState, item: DavItem, ctx: dict):
    if dav_body(DAV_MAX_XML):
        raise DavError(415, "MKCOL takes no body")
    if item.exists:
        raise DavError(405, f"/dav/{item.path} already exists")
    dav_parent_ready(svc, item.path)
    dav_unlocked(dav, item.path.rsplit("/", 1)[0], ctx["tokens"])
    folder, root = Path(item.file).resolve(), svc.attachments.root
    with disk_writes():
        if folder == root or root in folder.parents:
            svc.attachments.make_root()  # attachments/ itself, at first: private
        if folder != root:
            os.makedirs(os.path.dirname(item.file), exist_ok=True)
            os.mkdir(item.file)
    fsync_dir(Path(os.path.dirname(item.file)))
    bottle.response.status = 201
    return b""


def dav_destination(svc: Service, ctx: dict) -> str:
    """Return the checked path a COPY or MOVE goes to: this server, under /dav/."""
    raw = request_header("Destination") or ""
    if not raw:
        raise DavError(400, "COPY and MOVE need a Destination header")
    url = urllib.parse.urlsplit(raw)
    host = bottle.request.environ.get("HTTP_HOST", "")
    if url.netloc and url.netloc.lower() != host.lower():
        raise DavError(502, "the Destination is on another server")
    prefix = f"{ctx['script']}{DAV_PREFIX}/"
    if not url.path.startswith(prefix) or re.search(r"%2f|%5c|%00", url.path, re.I):
        raise DavError(403, f"the Destination must be a path under {prefix}")
    try:
        path = urllib.parse.unquote(url.path[len(prefix) :], errors="strict")
    except UnicodeDecodeError:
        raise DavError(403, "the Destination is not UTF-8") from None
    return dav_checked(path)


def dav_copy_move(svc: Service, dav: DavState, item: DavItem, ctx: dict):
    move = ctx["method"] == "MOVE"
    if not item.path or item.path in DAV_TOPS:
        raise DavError(403, "notes/ and attachments/ themselves cannot be copied or moved")
    if not item.exists:
        raise DavError(404, f"nothing at /dav/{item.path}")
    dst = dav_destination(svc, ctx)
    principal = ctx["principal"]
    if not dav_grant_sees(principal, dst, write=True):
        raise DavError(403, "this key may not write there")
    if not dst or dst in DAV_TOPS or dst == item.path or dst.startswith(item.path + "/"):
        raise DavError(403, "a resource cannot be copied or moved onto itself or into itself")
    if item.path.startswith(dst + "/"):
        raise DavError(403, "a resource cannot replace the folder that holds it")
    depth = (request_header("Depth") or "infinity").lower()
    if depth not in ("0", "infinity") or (move and depth != "infinity"):
        raise DavError(400, "Depth is 0 or infinity (a MOVE: infinity)")
    overwrite = (request_header("Overwrite") or "T").strip().upper()
    if move:
        dav_unlocked(dav, item.path, ctx["tokens"], below=True)
    dav_unlocked(dav, dst, ctx["tokens"], below=True)
    dav_parent_ready(svc, dst)
    target = dav_item(svc, dst)
    if target.exists and overwrite == "F":
        raise DavError(412, f"/dav/{dst} exists and Overwrite is F")
    folder_move = move and item.is_dir
    if folder_move:  # a home or a shared folder: who may move it, and where (409/403)
        svc.people.check_folder_change(principal, item.path, dst)
    dav_can_place(svc, item, dst, depth, principal)  # before anything changes, the target too
    if target.exists and target.is_dir:
        svc.people.check_folder_change(principal, target.path, None)
    if not move:
        dav.props_room(item.path)
    if target.exists:
        dav_delete(svc, dav, target)
    if folder_move and item.top == NOTES and dst.startswith(NOTES + "/"):
        svc.people.folder_moved(item.path, dst)  # homes, members and links follow it
        try:
            dav_copy(svc, dav, item, dst, move, depth, principal)
        except BaseException:
            svc.people.folder_moved(dst, item.path)
            raise
    else:
        dav_copy(svc, dav, item, dst, move, depth, principal)
    if move:
        dav.drop_locks(item.path)  # (RFC 4918 9.9.4)
        dav_keep_folder(item)
    bottle.response.status = 204 if target.exists else 201
    return b""


def dav_lock(svc: Service, dav: DavState, item: DavItem, ctx: dict):
    root = dav_xml(dav_body())
    seconds = _lock_seconds()
    if root is None:  # a refresh: the If header names the lock
        return _dav_refresh_lock(dav, item, ctx, seconds)
    if root.tag != "{DAV:}lockinfo":
        raise DavError(400, "a LOCK body is a DAV:lockinfo element")
    scope = root.find("{DAV:}lockscope")
    shared = scope is not None and scope.find("{DAV:}shared") is not None
    owner = root.find("{DAV:}owner")
    depth = (request_header("Depth") or "infinity").lower()
    if depth not in ("0", "infinity"):
        raise DavError(400, "a lock's Depth is 0 or infinity")
    if not item.path or item.path in DAV_TOPS:
        raise DavError(403, "notes/ and attachments/ themselves cannot be locked")
    with dav.lock:
        _dav_lock_room(dav, item.path, depth, shared, ctx["holder"])
        created = False
        if not item.exists:  # an unmapped URL: locked as an empty file (RFC 4918 7.3)
            dav_parent_ready(svc, item.path)
            dav_write_file(svc, dav, item.path, lambda n: b"", if_none_match="*")
            created = True
        lk = DavLock(
            token=f"urn:uuid:{uuid.uuid4()}",
            path=item.path,
            depth=depth,
            owner=dav_owner(owner) if owner is not None else "",
            seconds=seconds,
            expires=time.monotonic() + seconds,
            holder=ctx["holder"],
            scope="shared" if shared else "exclusive",
        )
        dav.locks[lk.token] = lk
    bottle.response.set_header("Lock-Token", f"<{lk.token}>")
    return dav_lock_answer(lk, 201 if created else 200)


def _dav_refresh_lock(dav: DavState, item: DavItem, ctx: dict, seconds: int) -> bytes:
    """A LOCK without a body: the locks on item that the If header names last `seconds`
    more (RFC 4918 9.10.2); 412 when it names none."""
    found = [lk for lk in dav.locks_on(item.path) if lk.token in ctx["tokens"]]
    if not found:
        raise DavError(
            412, "a refresh names the lock in the If header", "lock-token-matches-request-uri"
        )
    for lk in found:
        lk.seconds, lk.expires = seconds, time.monotonic() + seconds
    return dav_lock_answer(found[0], 200)


def _dav_lock_room(dav: DavState, path: str, depth: str, shared: bool, holder: str) -> None:
    """Raise unless a new lock on path may be taken (called holding dav.lock): 423 for a
    conflicting lock or a path holding DAV_LOCKS_PER_PATH, 507 for a key holding
    DAV_LOCKS_PER_KEY, 503 when DAV_LOCKS_MAX are held."""
    held = dav.locks_on(path, below=depth == "infinity")
    if any(not shared or lk.scope == "exclusive" for lk in held):
        raise DavError(423, f"/dav/{path} is locked", "no-conflicting-lock")
    if len(held) >= DAV_LOCKS_PER_PATH:
        raise DavError(423, f"/dav/{path} holds {len(held)} locks: no more")
    every = dav.live_locks()
    if sum(lk.holder == holder for lk in every) >= DAV_LOCKS_PER_KEY:
        raise DavError(507, f"this key holds {DAV_LOCKS_PER_KEY} locks: unlock some first")
    if len(every) >= DAV_LOCKS_MAX:
        raise DavError(503, "too many locks are held: try again later")


def dav_owner(owner) -> str:
    """The <D:owner> a client gave, as XML (its inside kept as sent)."""
    import xml.etree.ElementTree as ET

    inner = xesc(owner.text or "") + "".join(ET.tostring(c, encoding="unicode") for c in owner)
    return f"<D:owner>{inner}</D:owner>"


def dav_lock_answer(lk: DavLock, status: int) -> bytes:
    bottle.response.status = status
    bottle.response.content_type = XML_TYPE
    return (
        '<?xml version="1.0" encoding="utf-8"?>\n<D:prop xmlns:D="DAV:">'
        + dav_lockdiscovery([lk])
        + "</D:prop>"
    ).encode("utf-8")


def dav_unlock(svc: Service, dav: DavState, item: DavItem, ctx: dict):
    token = (request_header("Lock-Token") or "").strip().strip("<>")
    with dav.lock:
        lk = dav.locks.get(token)
        if lk is None or not lk.covers(item.path):
            raise DavError(409, "no such lock on this resource", "lock-token-matches-request-uri")
        who = ctx["principal"]  # the owner may end any lock; a person's admin, their own only
        if lk.holder != ctx["holder"] and not (who.whole and who.allows("admin")):
            raise DavError(403, "the lock was taken by another key")
        del dav.locks[token]
    bottle.response.status = 204
    return b""


DAV_HANDLERS = {
    "OPTIONS": dav_options,
    "PROPFIND": dav_propfind,
    "PROPPATCH": dav_proppatch,
    "GET": dav_get,
    "HEAD": dav_get,
    "PUT": dav_put,
    "DELETE": dav_delete_method,
    "MKCOL": dav_mkcol,
    "COPY": dav_copy_move,
    "MOVE": dav_copy_move,
    "LOCK": dav_lock,
    "UNLOCK": dav_unlock,
}


def dav_authenticate(svc: Service, env: dict) -> Principal:
    """Basic (any user name, the password a key) or Bearer; failures count toward the
    lockout; a 401 asks for Basic."""
    auth = env.get("HTTP_AUTHORIZATION", "")
    key = ""
    if auth[:6].lower() == "basic ":
        try:
            key = (
                base64.b64decode(auth[6:].strip(), validate=True).decode("utf-8").partition(":")[2]
            )
        except (ValueError, UnicodeDecodeError):
            key = "\0"  # presented and wrong
    elif auth[:7].lower() == "bearer ":
        key = auth[7:].strip()
    checked = {
        **env,
        "HTTP_X_SERVICE_KEY": key or env.get("HTTP_X_SERVICE_KEY", ""),
        "HTTP_AUTHORIZATION": "",
    }
    try:
        return svc.authenticate(checked)
    except ApiError as e:
        if e.status_code == 401:
            raise DavError(
                401,
                "a key is needed: any user name, the key as the password",
                headers={"WWW-Authenticate": DAV_CHALLENGE},
            ) from None
        raise


def dav_callback(svc: Service) -> Callable:
    """The one entry of /dav/: the path checked, who asks, what they may do, the If header,
    then the method; every failure a short plain answer (an XML one for a precondition)."""

    def callback(path: str = ""):
        env = bottle.request.environ
        method = env.get("REQUEST_METHOD", "GET").upper()
        try:
            return dav_answer(svc, env, method, path)
        except DavError as e:
            return dav_error(e)
        except ApiError as e:
            if e.status_code == 400 and method != "PUT":
                e = DavError(400, e.message)
            return dav_error(e)
        except bottle.HTTPResponse:
            raise
        except Exception:
            rid = env.get("notesvc.request_id", "-")
            log.exception("request %s failed in WebDAV %s", rid, method)
            return dav_error(DavError(500, f"internal error; request id {rid}"))

    return callback


def dav_answer(svc: Service, env: dict, method: str, raw: str):
    if method == "OPTIONS":
        return dav_options(svc, None, None, {})
    principal = dav_authenticate(svc, env)
    env["notesvc.principal"] = principal
    if "#" in env.get("REQUEST_URI", ""):  # a fragment never names a resource of its own
        raise DavError(400, "the URL holds a fragment (#): send the path alone")
    write = method not in DAV_READ
    if write and not principal.allows("write"):
        raise DavError(403, f"this key is {principal.scope}-only")
    path = dav_checked(raw)
    # (UNLOCK changes nothing; COPY reads its source and writes its Destination, checked there)
    if not dav_grant_sees(principal, path, write=write and method not in ("UNLOCK", "COPY")):
        if write and dav_grant_sees(principal, path):
            raise DavError(403, "this key may not write here")
        raise DavError(404, f"nothing at /dav/{path}")
    dav = dav_state(svc)
    item = dav_item(svc, path, dav.notes if method in ("GET", "HEAD") else None)
    script = env.get("SCRIPT_NAME", "")
    ctx = {"method": method, "principal": principal, "script": script}
    ctx["holder"] = dav_holder(principal)
    tokens = dav_if(svc, dav, item, ctx) if write or request_header("If") else set()
    # a token counts for the key that took the lock only (lockdiscovery shows it to all)
    ctx["tokens"] = {
        t for t in tokens if (lk := dav.locks.get(t)) is None or lk.holder == ctx["holder"]
    }
    return DAV_HANDLERS[method](svc, dav, item, ctx)


def dav_holder(principal: Principal) -> str:
    """Who holds a lock: "owner" for the API key, else the key's grant id."""
    return principal.grant_id or "owner"


def dav_error(e: ApiError) -> bottle.HTTPResponse:
    condition = getattr(e, "condition", "")
    headers = {k: v for k, v in e.headers.items() if k.lower() not in ("content-type",)}
    if e.status_code == 401:  # (also a key revoked while its write was on its way)
        headers.setdefault("WWW-Authenticate", DAV_CHALLENGE)
    if condition:
        body = (
            f'<?xml version="1.0" encoding="utf-8"?>\n<D:error xmlns:D="DAV:">'
            f"<D:{condition}/><D:responsedescription>{xesc(e.message)}"
            "</D:responsedescription></D:error>"
        )
        headers["Content-Type"] = XML_TYPE
    else:
        body = e.message + "\n"
        headers["Content-Type"] = "text/plain; charset=utf-8"
    return bottle.HTTPResponse(body.encode("utf-8"), e.status_code, headers)
