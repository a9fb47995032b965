"""CalDAV under /dav/: the notes' task lines as task lists (RFC 4791, RFC 6578)."""

from __future__ import annotations

import contextlib
import datetime as dt
import hmac
import re
import urllib.parse
from typing import Any, Callable

from notesvc.boot import bottle, log
from notesvc.errors import ApiError, PreconditionFailed, not_found
from notesvc.grants import Principal, request_principal
from notesvc.helpers import (
    if_match_allows,
    local_time,
    request_body_reader,
    request_header,
    time_zone,
)
from notesvc.http.api import INBOX
from notesvc.http.dav import (
    DAV_CHALLENGE,
    DAV_PREFIX,
    DavError,
    dav_authenticate,
    dav_body,
    dav_callback,
    dav_children,
    dav_href,
    dav_item,
    dav_live,
    dav_name,
    dav_only_the_way,
    dav_props,
    dav_state,
    dav_xml,
    empty_prop,
    xesc,
)
from notesvc.notes.paths import NOTES, make_etag
from notesvc.notes.tasks import (
    ALARM_RE,
    DUE_DATE_RE,
    TAG_RE,
    TASK_LINE_RE,
    TASKS_NOTE,
    ICalError,
    TaskBook,
    UnusableDate,
    ical_calendar,
    ical_parse,
    ical_split,
    ical_unescape,
    ical_when,
    task_book,
    task_line_of,
    utc_of_timestamp,
    vtodo_lines,
    wall_timestamp,
)
from notesvc.service import Service

# -- CalDAV --------------------------------------------------------------------------------
#
# docs/api.md (CalDAV): /dav/principal/ and /dav/calendars/ beside the WebDAV of notes/ and
# attachments/ (a PROPFIND of /dav/ still lists only those two, so file sync never sees
# .ics files). /dav/calendars/all/ holds every task a key sees, /dav/calendars/f-<id>/ the
# tasks of one folder's own notes. A write from a client edits the task's one line of its
# note (a versioned write, reason "caldav"); a new task is a new line of <folder>/Tasks.md.

CAL_NS = "urn:ietf:params:xml:ns:caldav"
CS_NS = "http://calendarserver.org/ns/"
CAL_TOPS = ("principal", "calendars")
CAL_METHODS = ("REPORT", "MKCALENDAR")
CAL_TYPE = "text/calendar; charset=utf-8"
CAL_ITEM_TYPE = "text/calendar; charset=utf-8; component=VTODO"
CAL_XML_TYPE = "application/xml; charset=utf-8"
CAL_MAX_OBJECT = 256 * 1024  # one VTODO from a client
CAL_REFUSED = ("RRULE", "RDATE", "EXDATE", "ATTACH", "ATTENDEE", "ORGANIZER")
CAL_TEXT_MATCH = ("STATUS", "SUMMARY", "UID", "CATEGORIES")
ALL_LIST = "all"
_NS_DECL = f'xmlns:D="DAV:" xmlns:C="{CAL_NS}" xmlns:CS="{CS_NS}"'
_PREFIX = {"DAV:": "D", CAL_NS: "C", CS_NS: "CS"}
SYNC_PREFIX = "urn:notesvc:sync:"
SYNC_TOKEN_RE = re.compile(r"([0-9]{1,18})-([0-9a-f]{16})\Z")  # ASCII digits only
CAL_DAV_CLASSES = "1, 2, calendar-access"
CAL_MAX_HREFS = 1000  # hrefs one calendar-multiget may name
CAL_MAX_NAME = 255  # characters of an item's name (<name>.ics)
CAL_MAX_SUMMARY = 1000  # characters of a SUMMARY: a task is one line of a note
CAL_MAX_CATEGORIES = 32  # CATEGORIES of one task, each at most CAL_MAX_NAME characters


class CalError(DavError):
    """A CalDAV failure; `condition` is a prefixed element (`C:supported-filter`)."""

    def __init__(self, status: int, message: str, condition: str = "", inner: str = ""):
        super().__init__(status, message, condition)
        self.inner = inner


def cal_error(e: ApiError) -> bottle.HTTPResponse:
    condition = getattr(e, "condition", "")
    headers = {k: v for k, v in e.headers.items() if k.lower() != "content-type"}
    if e.status_code == 401:
        headers.setdefault("WWW-Authenticate", DAV_CHALLENGE)
    if condition:
        tag = condition if ":" in condition else f"D:{condition}"
        inner = getattr(e, "inner", "")
        body = (
            f'<?xml version="1.0" encoding="utf-8"?>\n<D:error {_NS_DECL}>'
            f"<{tag}>{inner}</{tag}><D:responsedescription>{xesc(e.message)}"
            "</D:responsedescription></D:error>"
        )
        headers["Content-Type"] = CAL_XML_TYPE
    else:
        body = e.message + "\n"
        headers["Content-Type"] = "text/plain; charset=utf-8"
    return bottle.HTTPResponse(body.encode("utf-8"), e.status_code, headers)


# -- the entry: /dav/ with CalDAV beside WebDAV -------------------------------------------


def caldav_callback(svc: Service) -> Callable:
    """The one entry of /dav/: principal/ and calendars/ (and a PROPFIND of /dav/ itself,
    which names the principal) here; everything else to WebDAV."""
    dav = dav_callback(svc)

    def callback(path: str = ""):
        env = bottle.request.environ
        method = env.get("REQUEST_METHOD", "GET").upper()
        parts = [p for p in path.split("/") if p]
        ours = (parts and parts[0] in CAL_TOPS) or (not parts and method == "PROPFIND")
        if not ours and method not in CAL_METHODS:
            answer = dav(path)
            if not parts and method == "OPTIONS":  # /dav/ itself: the root of both
                bottle.response.set_header("DAV", CAL_DAV_CLASSES)
            return answer
        try:
            return cal_answer(svc, env, method, parts)
        except DavError as e:
            return cal_error(e)
        except ApiError as e:
            return cal_error(e)
        except bottle.HTTPResponse:
            raise
        except Exception:
            rid = env.get("notesvc.request_id", "-")
            log.exception("request %s failed in CalDAV %s", rid, method)
            return cal_error(DavError(500, f"internal error; request id {rid}"))

    return callback


def well_known_caldav(svc: Service):
    """/.well-known/caldav: 301 to /dav/ (RFC 6764)."""
    return bottle.HTTPResponse(b"", 301, {"Location": f"{DAV_PREFIX}/"})


def cal_answer(svc: Service, env: dict, method: str, parts: list):
    if method == "OPTIONS":
        return cal_options()
    principal = dav_authenticate(svc, env)
    env["notesvc.principal"] = principal
    if "#" in env.get("REQUEST_URI", ""):
        raise DavError(400, "the URL holds a fragment (#): send the path alone")
    if method == "MKCALENDAR":
        raise CalError(403, "task lists are the folders of notes: make a folder instead")
    if method == "REPORT" and parts[:1] != ["calendars"]:
        raise CalError(403, "REPORTs are served on task lists", "D:supported-report")
    write = method in ("PUT", "DELETE", "PROPPATCH")
    if write and not principal.allows("write"):
        raise DavError(403, f"this key is {principal.scope}-only")
    ctx = {"script": env.get("SCRIPT_NAME", ""), "principal": principal, "method": method}
    ctx["base"] = f"{ctx['script']}{DAV_PREFIX}"
    ctx["origin"] = svc.base_url(env).rstrip("/")
    book = task_book(svc)
    book.refresh()
    res = cal_resource(book, principal, parts)
    if method == "PROPFIND":
        return cal_propfind(svc, book, res, ctx)
    if method == "REPORT":
        return cal_report(svc, book, res, ctx)
    if method in ("GET", "HEAD"):
        return cal_get(svc, res, ctx)
    if method == "PUT":
        return cal_put(svc, book, res, ctx)
    if method == "DELETE":
        return cal_delete(svc, book, res, ctx)
    if method == "PROPPATCH":
        raise CalError(
            403,
            "the properties of task lists are the server's",
            "D:cannot-modify-protected-property",
        )
    raise DavError(405, f"{method} is not served on task lists", headers={"Allow": cal_allow()})


def cal_allow() -> str:
    return "OPTIONS, PROPFIND, REPORT, GET, HEAD, PUT, DELETE"


def cal_options():
    resp = bottle.response
    resp.set_header("DAV", CAL_DAV_CLASSES)
    resp.set_header("Allow", f"{cal_allow()}, PROPPATCH, MKCALENDAR")
    resp.set_header("Content-Length", "0")
    resp.content_type = "text/plain; charset=utf-8"
    return b""


# -- what a path names ----------------------------------------------------------------------


def _sees(principal: Principal, path: str) -> bool:
    return principal.sees(path)


def cal_lists(book: TaskBook, principal: Principal) -> list:
    """The task lists a key sees: (list id, folder or None, display name)."""
    out = [(ALL_LIST, None, "All tasks")]
    holding = {f for f in book.holding if _sees(principal, f + "/")}
    for folder in sorted(holding):
        fid = book.folders.get(folder)
        if fid:
            out.append((f"f-{fid}", folder, folder[len(NOTES) + 1 :] or "notes"))
    return out


def cal_list_tasks(book: TaskBook, principal: Principal, folder: str | None) -> list:
    return sorted(
        (
            t
            for t in book.tasks.values()
            if _sees(principal, t["path"]) and (folder is None or t["folder"] == folder)
        ),
        key=lambda t: (t["path"], t["line"]),
    )


def cal_resource(book: TaskBook, principal: Principal, parts: list) -> dict:
    """{kind: root|principal|home|list|item, ...} of a path; 404 for nothing there."""
    if not parts:
        return {"kind": "root", "path": ""}
    if parts == ["principal"]:
        return {"kind": "principal", "path": "principal"}
    if parts[0] == "principal" or len(parts) > 3:
        raise DavError(404, f"nothing at /dav/{'/'.join(parts)}")
    if len(parts) == 1:
        return {"kind": "home", "path": "calendars"}
    lid = parts[1]
    found = [entry for entry in cal_lists(book, principal) if entry[0] == lid]
    if not found:
        folder = book.folder_of_list(lid[2:]) if lid.startswith("f-") else None
        if folder is None or not _sees(principal, folder + "/x"):
            raise DavError(404, f"no task list {lid}")
        found = [(lid, folder, folder[len(NOTES) + 1 :] or "notes")]  # (no tasks now)
    lid, folder, name = found[0]
    lst = {"kind": "list", "path": f"calendars/{lid}", "id": lid, "folder": folder, "name": name}
    if len(parts) == 2:
        return lst
    href = parts[2]
    task = cal_task_named(book, principal, folder, href)
    return {
        "kind": "item",
        "path": f"calendars/{lid}/{href}",
        "list": lst,
        "href": href,
        "task": task,
    }


def cal_href(ctx: dict, path: str, folder: bool) -> str:
    href = f"{ctx['base']}/{urllib.parse.quote(path)}" if path else f"{ctx['base']}"
    return href + "/" if folder else href


# -- properties -------------------------------------------------------------------------------


def _prop(ns: str, local: str, inner: str = "") -> str:
    p = _PREFIX[ns]
    return f"<{p}:{local}>{inner}</{p}:{local}>" if inner else f"<{p}:{local}/>"


def cal_item_data(svc: Service, task: dict, ctx: dict) -> bytes:
    link = f"{ctx['origin']}/#task={task['uid']}"
    return ical_calendar(vtodo_lines(task, link))


def _sees_gone(principal: Principal, folder: str | None, old: str | None) -> bool:
    """Whether a tombstone (of a task that was in the folder `old`) is in a list a
    principal reads (a folder's, or None: all); one of no known folder was never served."""
    return bool(old) and (folder is None or old == folder) and _sees(principal, old + "/x")


def cal_sync_seq(book: TaskBook, principal: Principal, folder: str | None) -> int:
    """The newest change a principal sees in a list: its tasks' and its tombstones'
    sequence numbers, and the newest forgotten tombstone of its reach (changes elsewhere
    never move it)."""
    seqs = [t["seq"] for t in cal_list_tasks(book, principal, folder)]
    seqs += [g[0] for g in list(book.gone) if _sees_gone(principal, folder, g[3])]
    seqs.append(book.floor_within(lambda old: _sees_gone(principal, folder, old)))
    return max(seqs)


def _token_text(principal: Principal, list_id: str, seq: int) -> str:
    return f"{','.join(principal.folders)}\n{list_id}\n{seq}"


def cal_sync_token(book: TaskBook, principal: Principal, lst: dict, seq: int | None = None) -> str:
    """A list's sync token (and CTag) for a principal: the newest change it sees there,
    signed for its reach and that list (RFC 6578: opaque to clients). Another reach's
    token, or a number made up, is no token: it tells nothing of what others see."""
    if seq is None:
        seq = cal_sync_seq(book, principal, lst["folder"])
    mac = book.sync_mac(_token_text(principal, lst["id"], seq))
    return f"{SYNC_PREFIX}{seq}-{mac}"


def cal_token_seq(book: TaskBook, principal: Principal, lst: dict, raw: str) -> int:
    """The sequence number of a sync token this principal was given for this list; 403
    valid-sync-token for any other text, and for one too old to answer."""
    m = SYNC_TOKEN_RE.match(raw[len(SYNC_PREFIX) :]) if raw.startswith(SYNC_PREFIX) else None
    mac = book.sync_mac(_token_text(principal, lst["id"], int(m.group(1)))) if m else ""
    if m is None or not hmac.compare_digest(m.group(2), mac):
        raise CalError(403, "this sync-token is not one of this list's", "D:valid-sync-token")
    since = int(m.group(1))
    floor = book.floor_within(lambda old: _sees_gone(principal, lst["folder"], old))
    if since < floor or since > cal_sync_seq(book, principal, lst["folder"]):
        raise CalError(
            403, "this sync-token is too old: sync again from none", "D:valid-sync-token"
        )
    return since


def cal_props(svc: Service, book: TaskBook, res: dict, ctx: dict, names=None) -> dict:
    """{(ns, local): xml} of a resource's properties (of an item, its calendar data only
    when `names`, the local names asked for, holds it or its length; None: all)."""
    if res["kind"] == "item":
        return cal_item_props(svc, res["task"], ctx, names)
    principal = ctx["principal"]
    me = _prop("DAV:", "href", xesc(cal_href(ctx, "principal", True)))
    home = _prop("DAV:", "href", xesc(cal_href(ctx, "calendars", True)))
    privs = "<D:privilege><D:read/></D:privilege>"
    writes = principal.allows("write")
    if res["kind"] == "list" and res["folder"] and not principal.whole:
        writes = principal.may_write(f"{res['folder']}/{TASKS_NOTE}")  # (a read share: no)
    if writes:
        privs += "".join(
            f"<D:privilege><D:{p}/></D:privilege>"
            for p in ("write", "write-content", "bind", "unbind")
        )
    out = {
        ("DAV:", "current-user-principal"): _prop("DAV:", "current-user-principal", me),
        ("DAV:", "current-user-privilege-set"): _prop("DAV:", "current-user-privilege-set", privs),
    }
    kind = res["kind"]
    collection = "<D:collection/>"
    if kind == "root":
        out[("DAV:", "resourcetype")] = _prop("DAV:", "resourcetype", collection)
        out[("DAV:", "principal-URL")] = _prop("DAV:", "principal-URL", me)
        out[(CAL_NS, "calendar-home-set")] = _prop(CAL_NS, "calendar-home-set", home)
    elif kind == "principal":
        out[("DAV:", "resourcetype")] = _prop("DAV:", "resourcetype", collection + "<D:principal/>")
        out[("DAV:", "displayname")] = _prop("DAV:", "displayname", "notesvc")
        out[("DAV:", "principal-URL")] = _prop("DAV:", "principal-URL", me)
        out[(CAL_NS, "calendar-home-set")] = _prop(CAL_NS, "calendar-home-set", home)
    elif kind == "home":
        out[("DAV:", "resourcetype")] = _prop("DAV:", "resourcetype", collection)
        out[("DAV:", "displayname")] = _prop("DAV:", "displayname", "Task lists")
    elif kind == "list":
        token = cal_sync_token(book, principal, res)
        out[("DAV:", "resourcetype")] = _prop("DAV:", "resourcetype", collection + "<C:calendar/>")
        out[("DAV:", "displayname")] = _prop("DAV:", "displayname", xesc(res["name"]))
        out[(CAL_NS, "supported-calendar-component-set")] = _prop(
            CAL_NS, "supported-calendar-component-set", '<C:comp name="VTODO"/>'
        )
        out[(CAL_NS, "supported-calendar-data")] = _prop(
            CAL_NS,
            "supported-calendar-data",
            '<C:calendar-data content-type="text/calendar" version="2.0"/>',
        )
        out[(CAL_NS, "max-resource-size")] = _prop(CAL_NS, "max-resource-size", str(CAL_MAX_OBJECT))
        out[(CS_NS, "getctag")] = _prop(CS_NS, "getctag", token)
        out[("DAV:", "sync-token")] = _prop("DAV:", "sync-token", token)
        out[("DAV:", "supported-report-set")] = _prop(
            "DAV:",
            "supported-report-set",
            "".join(
                f"<D:supported-report><D:report>{r}</D:report></D:supported-report>"
                for r in ("<C:calendar-query/>", "<C:calendar-multiget/>", "<D:sync-collection/>")
            ),
        )
    return out


def cal_wanted(root) -> tuple:
    """(mode, [(ns, local, tag)]) of a PROPFIND or REPORT body's prop/allprop/propname."""
    if root is None:
        return "allprop", []
    for child in root:
        if child.tag == "{DAV:}propname":
            return "propname", []
        if child.tag == "{DAV:}prop":
            return "prop", [(*dav_name(c.tag), c.tag) for c in child]
    return "allprop", []


def cal_item_props(svc: Service, task: dict, ctx: dict, names) -> dict:
    out = {
        ("DAV:", "resourcetype"): "<D:resourcetype/>",
        ("DAV:", "getetag"): _prop("DAV:", "getetag", xesc(task["etag"])),
        ("DAV:", "getcontenttype"): _prop("DAV:", "getcontenttype", CAL_ITEM_TYPE),
    }
    if names is None or {"calendar-data", "getcontentlength"} & names:
        data = cal_item_data(svc, task, ctx)
        out[("DAV:", "getcontentlength")] = _prop("DAV:", "getcontentlength", str(len(data)))
        out[(CAL_NS, "calendar-data")] = _prop(
            CAL_NS, "calendar-data", xesc(data.decode("utf-8")).replace("\r", "&#13;")
        )
    return out


def cal_propstat(props: dict, mode: str, wanted: list) -> str:
    if mode == "propname":
        found = [_prop(ns, local) for ns, local in props]
        missing: list = []
    elif mode == "allprop":
        found = [x for (ns, local), x in props.items() if local != "calendar-data"]
        missing = []
    else:
        found, missing = [], []
        for ns, local, tag in wanted:
            value = props.get((ns, local))
            if value is None:
                missing.append(empty_prop(tag))
            else:
                found.append(value)
    out = ""
    if found:
        out += (
            "<D:propstat><D:prop>" + "".join(found) + "</D:prop>"
            "<D:status>HTTP/1.1 200 OK</D:status></D:propstat>"
        )
    if missing:
        out += (
            "<D:propstat><D:prop>" + "".join(missing) + "</D:prop>"
            "<D:status>HTTP/1.1 404 Not Found</D:status></D:propstat>"
        )
    return out


def cal_multistatus(parts: list, tail: str = "") -> bytes:
    body = (
        f'<?xml version="1.0" encoding="utf-8"?>\n<D:multistatus {_NS_DECL}>'
        + "".join(parts)
        + tail
        + "</D:multistatus>"
    )
    bottle.response.status = 207
    bottle.response.content_type = CAL_XML_TYPE
    return body.encode("utf-8")


def _response(href: str, inner: str) -> str:
    return f"<D:response><D:href>{xesc(href)}</D:href>{inner}</D:response>"


def cal_body():
    """The XML body of a PROPFIND or REPORT, parsed the way WebDAV parses (no DTD)."""
    return dav_xml(dav_body())


def cal_propfind(svc: Service, book: TaskBook, res: dict, ctx: dict):
    depth = (request_header("Depth") or "infinity").strip().lower()
    if depth not in ("0", "1"):
        raise DavError(
            403, "PROPFIND with Depth: infinity is not served: ask Depth 1", "propfind-finite-depth"
        )
    root = cal_body()
    if root is not None and root.tag != "{DAV:}propfind":
        raise DavError(400, "a PROPFIND body is a DAV:propfind element")
    mode, wanted = cal_wanted(root)
    if res["kind"] == "item" and res["task"] is None:
        raise DavError(404, f"nothing at /dav/{res['path']}")
    principal = ctx["principal"]
    out = []
    if res["kind"] == "root":  # WebDAV's root, with the principal named
        out.append(cal_root_response(svc, book, res, ctx, mode, wanted))
        if depth == "1":
            dav = dav_state(svc)
            root_item = dav_item(svc, "")
            for child in dav_children(svc, root_item, principal):
                asked = [(t, ns, lo) for ns, lo, t in wanted]
                inner = dav_props(dav, child, mode, asked, dav_only_the_way(principal, child.path))
                out.append(_response(dav_href(ctx["script"], child.path, True), inner))
        return cal_multistatus(out)
    kind = res["kind"]
    is_dir = kind != "item"
    out.append(
        _response(
            cal_href(ctx, res["path"], is_dir),
            cal_propstat(cal_props(svc, book, res, ctx), mode, wanted),
        )
    )
    if depth == "1":
        for child in cal_children(book, res, principal):
            props = cal_props(svc, book, child, ctx)
            out.append(
                _response(
                    cal_href(ctx, child["path"], child["kind"] != "item"),
                    cal_propstat(props, mode, wanted),
                )
            )
    return cal_multistatus(out)


def cal_root_response(svc, book, res, ctx, mode, wanted) -> str:
    """/dav/ itself: WebDAV's properties of the root and the principal's names."""
    dav = dav_state(svc)
    item = dav_item(svc, "")
    props = cal_props(svc, book, res, ctx)
    for name in ("displayname", "resourcetype", "supportedlock", "lockdiscovery"):
        value = dav_live(dav, item, name)
        if value is not None and ("DAV:", name) not in props:
            props[("DAV:", name)] = value
    return _response(cal_href(ctx, "", True), cal_propstat(props, mode, wanted))


def cal_children(book: TaskBook, res: dict, principal: Principal) -> list:
    if res["kind"] == "home":
        return [
            {"kind": "list", "path": f"calendars/{lid}", "id": lid, "folder": folder, "name": name}
            for lid, folder, name in cal_lists(book, principal)
        ]
    if res["kind"] == "list":
        return [cal_item_of(res, t) for t in cal_list_tasks(book, principal, res["folder"])]
    return []


def cal_item_of(lst: dict, task: dict) -> dict:
    return {
        "kind": "item",
        "path": f"{lst['path']}/{task['href']}",
        "list": lst,
        "href": task["href"],
        "task": task,
    }


def cal_get(svc: Service, res: dict, ctx: dict):
    if res["kind"] != "item":
        raise DavError(
            405,
            "a collection has no content: list it with PROPFIND",
            headers={"Allow": "OPTIONS, PROPFIND, REPORT"},
        )
    task = res["task"]
    if task is None:
        raise DavError(404, f"nothing at /dav/{res['path']}")
    data = cal_item_data(svc, task, ctx)
    resp = bottle.response
    resp.set_header("ETag", task["etag"])
    resp.content_type = CAL_TYPE
    resp.set_header("Content-Length", str(len(data)))
    inm = request_header("If-None-Match")
    if inm and task["etag"] in [t.strip() for t in inm.split(",")]:
        resp.status = 304
        return b""
    return b"" if ctx["method"] == "HEAD" else data


# -- REPORT: calendar-query, calendar-multiget, sync-collection --------------------------------


def cal_report(svc: Service, book: TaskBook, res: dict, ctx: dict):
    root = cal_body()
    if root is None:
        raise DavError(400, "a REPORT needs a body")
    if res["kind"] not in ("list", "item"):
        raise CalError(403, "REPORTs are served on task lists", "D:supported-report")
    lst = res["list"] if res["kind"] == "item" else res
    principal = ctx["principal"]
    mode, wanted = cal_wanted(root)
    if root.tag == f"{{{CAL_NS}}}calendar-multiget":
        hrefs = root.findall("{DAV:}href")
        if len(hrefs) > CAL_MAX_HREFS:
            raise CalError(
                403,
                f"a calendar-multiget names at most {CAL_MAX_HREFS} items: ask in parts",
                "D:number-of-matches-within-limits",
            )
        out = []
        for h in hrefs:
            path = urllib.parse.urlsplit(urllib.parse.unquote((h.text or "").strip())).path
            found = cal_find_item(book, principal, lst, ctx, path)
            if found is None:
                out.append(_response(path, "<D:status>HTTP/1.1 404 Not Found</D:status>"))
            else:
                out.append(cal_item_response(svc, book, found, ctx, mode, wanted))
        return cal_multistatus(out)
    items = [cal_item_of(lst, t) for t in cal_list_tasks(book, principal, lst["folder"])]
    if root.tag == f"{{{CAL_NS}}}calendar-query":
        flt = root.find(f"{{{CAL_NS}}}filter")
        test = cal_filter(flt, svc) if flt is not None else (lambda t: True)
        return cal_multistatus(
            [cal_item_response(svc, book, i, ctx, mode, wanted) for i in items if test(i["task"])]
        )
    if root.tag == "{DAV:}sync-collection":
        return cal_sync(svc, book, lst, items, root, ctx, mode, wanted)
    raise CalError(403, "this REPORT is not served", "D:supported-report")


def cal_find_item(book: TaskBook, principal: Principal, lst: dict, ctx: dict, path: str):
    """The item a multiget's href names in this list (None: none the key sees)."""
    prefix = f"{ctx['base']}/{lst['path']}/"
    name = path[len(prefix) :] if path.startswith(prefix) else ""
    if not name or "/" in name:
        return None
    task = cal_task_named(book, principal, lst["folder"], name)
    return cal_item_of(lst, task) if task is not None else None


def cal_task_named(book: TaskBook, principal: Principal, folder: str | None, name: str):
    """The task of a list (a folder's, or None: all) whose item is named `name`."""

    for uid in book.by_href.get(name, ()):  # (two lists may hold an item of the same name)
        t = book.tasks.get(uid)
        if t and _sees(principal, t["path"]) and folder in (None, t["folder"]):
            return t
    return None


def cal_item_response(svc, book, item: dict, ctx: dict, mode: str, wanted: list) -> str:
    names = {local for _ns, local, _tag in wanted} if mode == "prop" else None
    props = cal_props(svc, book, item, ctx, names)
    return _response(cal_href(ctx, item["path"], False), cal_propstat(props, mode, wanted))


def cal_sync(svc, book, lst: dict, items: list, root, ctx: dict, mode: str, wanted: list):
    raw = (root.findtext("{DAV:}sync-token") or "").strip()
    since = cal_token_seq(book, ctx["principal"], lst, raw) if raw else 0
    level = (root.findtext("{DAV:}sync-level") or "1").strip()
    if level not in ("1", "infinite"):
        raise DavError(400, "sync-level is 1")
    out = [
        cal_item_response(svc, book, i, ctx, mode, wanted)
        for i in items
        if i["task"]["seq"] > since
    ]
    for href in cal_gone(book, lst, items, since, ctx["principal"]) if since else ():
        out.append(
            _response(
                cal_href(ctx, f"{lst['path']}/{href}", False),
                "<D:status>HTTP/1.1 404 Not Found</D:status>",
            )
        )
    seq = max(cal_sync_seq(book, ctx["principal"], lst["folder"]), since)
    token = cal_sync_token(book, ctx["principal"], lst, seq)
    return cal_multistatus(out, f"<D:sync-token>{token}</D:sync-token>")


def cal_gone(book: TaskBook, lst: dict, items: list, since: int, principal: Principal) -> list:
    """The names of the items a list lost since a sync token (removed, or moved away)."""
    here = {i["task"]["uid"] for i in items}
    folder = lst["folder"]
    gone: dict = {}
    for seq, uid, href, old, _path in list(book.gone):
        if seq > since and uid not in here and _sees_gone(principal, folder, old):
            gone[href] = True
    return list(gone)


# -- calendar-query filters (RFC 4791 9.7) ---------------------------------------------------


def _unsupported(what: str) -> CalError:
    return CalError(403, f"this filter is not supported: {what}", "C:supported-filter")


def cal_filter(flt, svc: Service) -> Callable:
    comps = list(flt)
    if len(comps) != 1 or comps[0].tag != f"{{{CAL_NS}}}comp-filter":
        raise _unsupported("a filter holds one comp-filter")
    cal = comps[0]
    if cal.get("name", "").upper() != "VCALENDAR":
        return lambda t: False
    tests = []
    for child in cal:
        if child.tag == f"{{{CAL_NS}}}is-not-defined":
            return lambda t: False
        if child.tag != f"{{{CAL_NS}}}comp-filter":
            raise _unsupported(dav_name(child.tag)[1])
        name = child.get("name", "").upper()
        if name != "VTODO":
            negated = child.find(f"{{{CAL_NS}}}is-not-defined") is not None
            tests.append(lambda t, n=negated: n)  # no VEVENT, VJOURNAL here
            continue
        tests.append(cal_todo_filter(child, svc))
    return lambda t: all(test(t) for test in tests)


def cal_todo_filter(comp, svc: Service) -> Callable:
    tests: list = []
    for child in comp:
        ns, local = dav_name(child.tag)
        if ns != CAL_NS:
            raise _unsupported(local)
        if local == "is-not-defined":
            return lambda t: False
        if local == "time-range":
            tests.append(cal_time_range(child, svc))
        elif local == "prop-filter":
            tests.append(cal_prop_filter(child))
        else:
            raise _unsupported(local)
    return lambda t: all(test(t) for test in tests)


def _task_values(task: dict, name: str) -> list:
    """The values a task's VTODO has for a property ([] when it has none)."""
    if name == "UID":
        return [task["uid"]]
    if name == "SUMMARY":
        return [task["summary"]]
    if name == "STATUS":
        return ["COMPLETED" if task["done"] else "NEEDS-ACTION"]
    if name == "CATEGORIES":
        return list(task["categories"])
    if name in ("DTSTAMP", "DESCRIPTION"):
        return ["x"]
    if name == "DUE":
        return ["x"] if task["due"] or task["alarm"] else []
    if name == "COMPLETED":
        return ["x"] if task["done"] and task.get("completed") else []
    if name == "RELATED-TO":
        return [task["parent_uid"]] if task.get("parent_uid") else []
    return []


def cal_prop_filter(pf) -> Callable:
    name = pf.get("name", "").upper()
    children = list(pf)
    if not children:
        return lambda t: bool(_task_values(t, name))
    if len(children) != 1:
        raise _unsupported(f"prop-filter {name} with several tests")
    child = children[0]
    ns, local = dav_name(child.tag)
    if ns == CAL_NS and local == "is-not-defined":
        return lambda t: not _task_values(t, name)
    if ns == CAL_NS and local == "text-match" and name in CAL_TEXT_MATCH:
        needle = child.text or ""
        collation = child.get("collation", "i;ascii-casemap")
        if collation not in ("i;ascii-casemap", "i;octet", "i;unicode-casemap"):
            raise CalError(
                403, f"collation {collation[:40]} is not supported", "C:supported-collation"
            )
        negate = child.get("negate-condition", "no") == "yes"
        fold = collation != "i;octet"
        if fold:
            needle = needle.casefold()

        def match(t: dict) -> bool:
            values = _task_values(t, name)
            if not values:
                return False
            hit = any(needle in (v.casefold() if fold else v) for v in values)
            return hit != negate

        return match
    raise _unsupported(f"prop-filter {name} {local}")


def _utc_of(raw: str | None) -> dt.datetime | None:
    if not raw:
        return None
    try:
        return dt.datetime.strptime(raw.strip(), "%Y%m%dT%H%M%SZ")
    except ValueError:
        raise CalError(
            400, f"a time-range time is YYYYMMDDTHHMMSSZ, not {raw[:30]!r}", "C:valid-filter"
        ) from None


def cal_time_range(tr, svc: Service) -> Callable:
    start = _utc_of(tr.get("start")) or dt.datetime(1, 1, 1)
    end = _utc_of(tr.get("end")) or dt.datetime(9999, 12, 31)
    zone = time_zone(svc.config.timezone)

    def due_of(t: dict) -> dt.datetime | None:
        if isinstance(t["due"], dt.date):
            ts = wall_timestamp(dt.datetime.combine(t["due"], dt.time()), zone)
            return None if ts is None else utc_of_timestamp(ts)
        return t["alarm"]

    def test(t: dict) -> bool:  # RFC 4791 9.9, a VTODO without DTSTART or DURATION
        due = due_of(t)
        if due is not None:
            return start < due <= end
        if t["done"] and t.get("completed"):
            done = dt.datetime.fromtimestamp(t["completed"], dt.timezone.utc).replace(tzinfo=None)
            return start <= done <= end
        return True

    return test


# -- writes: a line of a note ---------------------------------------------------------------


def cal_read_object(svc: Service) -> dict:
    """The VTODO of a PUT body: {uid, summary, done, due, categories}; 403 for what a line
    cannot hold, 415/403 for what is not one VTODO."""
    kind = (request_header("Content-Type") or "text/calendar").split(";")[0].strip().lower()
    if kind not in ("text/calendar", "application/octet-stream", ""):
        raise CalError(415, "a task is PUT as text/calendar", "C:supported-calendar-data")
    read, _ = request_body_reader(
        CAL_MAX_OBJECT, f"the calendar object limit ({CAL_MAX_OBJECT // 1024} KiB)"
    )
    props = cal_todo_props(b"".join(iter(lambda: read(65536), b"")))
    uid = _first(props, "UID").strip()
    if not uid or len(uid) > 255 or any(ord(c) < 32 for c in uid):
        raise _unfit("a VTODO needs a UID")
    status = _first(props, "STATUS", "NEEDS-ACTION").strip().upper()
    if status not in ("NEEDS-ACTION", "COMPLETED"):
        raise _unfit(f"a task line is open or done, not {status[:20]}")
    due: Any = None
    if props.get("DUE"):
        params, value = props["DUE"][0]
        try:
            due = ical_when(value, params, time_zone(svc.config.timezone))
        except UnusableDate as e:
            raise _unfit(f"DUE {e}") from None
        except ICalError as e:
            raise CalError(403, str(e), "C:valid-calendar-data") from None
    categories: list = []
    for _params, value in props.get("CATEGORIES", []):
        categories += [c.strip() for c in ical_split(value) if c.strip()]
    categories = list(dict.fromkeys(categories))
    if len(categories) > CAL_MAX_CATEGORIES or any(len(c) > CAL_MAX_NAME for c in categories):
        raise _unfit(
            f"a task has at most {CAL_MAX_CATEGORIES} CATEGORIES of {CAL_MAX_NAME} characters"
        )
    parents = [
        v.strip()
        for params, v in props.get("RELATED-TO", [])
        if params.get("RELTYPE", "PARENT").upper() == "PARENT"
    ]
    summary = " ".join(ical_unescape(_first(props, "SUMMARY")).split())
    if len(summary) > CAL_MAX_SUMMARY:
        raise _unfit(f"a SUMMARY is at most {CAL_MAX_SUMMARY} characters: a task is one line")
    return {
        "parent": parents[0][:CAL_MAX_NAME] if parents else None,
        "uid": uid,
        "summary": summary,
        "done": status == "COMPLETED",
        "due": due,
        "categories": categories,
    }


def _first(props: dict, name: str, default: str = "") -> str:
    return (props.get(name) or [({}, default)])[0][1]


def _unfit(message: str) -> CalError:
    return CalError(403, message, "C:valid-calendar-object-resource")


def cal_todo_props(data: bytes) -> dict:
    """{NAME: [(params, value)]} of the one VTODO of a calendar object; 403 for anything
    else, and for what a task line cannot hold."""
    try:
        comps = ical_parse(data)
    except ICalError as e:
        raise CalError(403, f"not iCalendar: {e}", "C:valid-calendar-data") from None
    if len(comps) != 1 or comps[0]["name"] != "VCALENDAR":
        raise CalError(403, "a calendar object is one VCALENDAR", "C:valid-calendar-data")
    todos = [c for c in comps[0]["subs"] if c["name"] == "VTODO"]
    others = [c for c in comps[0]["subs"] if c["name"] not in ("VTODO", "VTIMEZONE")]
    if others or len(todos) != 1:
        raise CalError(403, "task lists hold one VTODO per item", "C:supported-calendar-component")
    props: dict = {}
    for name, params, value in todos[0]["props"]:
        if name in CAL_REFUSED:
            raise _unfit(f"a task line cannot hold {name}")
        props.setdefault(name, []).append((params, value))
    for sub in todos[0]["subs"]:
        if sub["name"] != "VALARM":
            raise _unfit(f"a task line cannot hold a {sub['name'][:20]}")
    return props


def cal_wall(svc: Service, due: Any) -> Any:
    """A client's DUE as the note writes it: a date, or a wall time in SERVICE_TIMEZONE."""
    if isinstance(due, dt.datetime):
        ts = due.replace(tzinfo=dt.timezone.utc).timestamp()
        return local_time(ts, time_zone(svc.config.timezone))
    return due


def cal_rewrite(svc: Service, task: dict, new: dict) -> str:
    """The task's line with what the client changed, the rest byte for byte."""
    line = task["text"]
    m = TASK_LINE_RE.match(line)
    head, rest = line[: m.start(4)], line[m.end(4) + 1 :]
    box = "x" if new["done"] else " "
    if new["done"] == task["done"]:
        box = m.group(4)
    if new["summary"] and new["summary"] != task["summary"]:
        markers = [
            x.group(0)
            for x in re.finditer(f"{DUE_DATE_RE.pattern}|{ALARM_RE.pattern}|{TAG_RE.pattern}", rest)
        ]
        rest = " " + " ".join([new["summary"], *markers])
    current = task["due"] if task["due"] is not None else task["alarm"]
    if new["due"] != current:
        rest = cal_set_due(svc, rest, cal_wall(svc, new["due"]))
    if sorted(new["categories"]) != sorted(task["categories"]):
        for tag in task["categories"]:
            if tag not in new["categories"]:
                rest = re.sub(rf"(?<![^\s(\[])#{re.escape(tag)}(?![\w/-])", "", rest)
        for tag in new["categories"]:
            if tag not in task["categories"]:
                clean = re.sub(r"[^\w/-]", "", tag.replace(" ", "-"))
                if clean:
                    rest = rest.rstrip() + f" #{clean}"
        rest = re.sub(r"[ \t]{2,}", " ", rest).rstrip()
    return f"{head}{box}]{rest}"


def cal_set_due(svc: Service, rest: str, due: Any) -> str:
    dated = DUE_DATE_RE.search(rest)
    alarm = ALARM_RE.search(rest)
    if due is None:
        rest = ALARM_RE.sub("", DUE_DATE_RE.sub("", rest))
        return re.sub(r"[ \t]{2,}", " ", rest).rstrip()
    day = due.date() if isinstance(due, dt.datetime) else due
    if dated:
        marker = dated.group(0)
        new = marker[: marker.rfind(dated.group(1))] + f"{day:%Y-%m-%d}"
        return rest[: dated.start()] + new + rest[dated.end() :]
    if alarm and isinstance(due, dt.datetime):
        return rest[: alarm.start()] + f"⏰ {due:%Y-%m-%d %H:%M}" + rest[alarm.end() :]
    if alarm:
        return rest[: alarm.start()] + f"📅 {day:%Y-%m-%d}" + rest[alarm.end() :]
    if isinstance(due, dt.datetime):
        return rest.rstrip() + f" ⏰ {due:%Y-%m-%d %H:%M}"
    return rest.rstrip() + f" 📅 {day:%Y-%m-%d}"


def _check_if_match(task: dict | None) -> None:
    if not if_match_allows(request_header("If-Match"), task["etag"] if task else None):
        raise DavError(412, "the task changed since it was read (If-Match): read it again")
    inm = request_header("If-None-Match")
    if inm is not None and inm.strip() == "*" and task is not None:
        raise DavError(412, "a task is already there (If-None-Match: *)")


def cal_edit_line(svc: Service, task: dict, change: Callable) -> None:
    """Edit the note around the task's line: change(lines, at) alters the list of lines
    (the note split on "\n"; `at` the task's line), written as a versioned write on the
    note as it is now; 412 when the line is not there exactly once."""
    path = task["path"]
    for _ in range(5):
        try:
            raw, _st = svc.notes._read(path)
        except ApiError:
            raise DavError(412, "the task's note is gone: sync again") from None
        lines = raw.decode("utf-8").split("\n")
        at = task["line"]
        if not (at < len(lines) and lines[at] == task["text"]):
            spots = [i for i, x in enumerate(lines) if x == task["text"]]
            if len(spots) != 1:
                raise DavError(412, "the task's line changed in the note: sync again")
            at = spots[0]
        before = list(lines)
        change(lines, at)
        if lines == before:
            return
        content = "\n".join(lines)
        cal_fits(svc, path, len(raw), content)
        with contextlib.suppress(PreconditionFailed):
            svc.notes.update(path, content, make_etag(raw), reason="caldav")
            return
    raise DavError(412, "the note kept changing: try again")


def cal_fits(svc: Service, path: str, before: int, content: str) -> None:
    """507 (DAV:quota-not-exceeded, RFC 4331) when a write would grow a note past the
    size the API takes for a note's content (SERVICE_MAX_BODY_BYTES); a note already
    larger (written by another program) may still be edited in place, never grown."""
    limit = svc.config.max_body_bytes
    size = len(content.encode("utf-8"))
    if size > limit and size > before:
        raise CalError(
            507,
            f"{path[len(NOTES) + 1 :]} would be {size} bytes, over the {limit} a note may hold "
            "(SERVICE_MAX_BODY_BYTES): make room in it or start another list",
            "D:quota-not-exceeded",
        )


def cal_put(svc: Service, book: TaskBook, res: dict, ctx: dict):
    if res["kind"] != "item":
        raise DavError(405, "PUT a task into a task list: /dav/calendars/<list>/<name>.ics")
    if not res["href"].endswith(".ics") or "/" in res["href"]:
        raise DavError(403, "an item's name ends in .ics")
    if len(res["href"]) > CAL_MAX_NAME:
        raise DavError(403, f"an item's name is at most {CAL_MAX_NAME} characters")
    principal = ctx["principal"]
    task = res["task"]
    _check_if_match(task)
    new = cal_read_object(svc)
    uid = new["uid"]
    if task is not None and task["uid"] != uid:
        raise CalError(403, "an item keeps its UID", "C:no-uid-conflict")
    other = book.tasks.get(uid)
    if task is None and other is not None:
        if not _sees(principal, other["path"]):
            raise CalError(403, "this UID belongs to another task", "C:no-uid-conflict")
        href = cal_href(ctx, f"calendars/{ALL_LIST}/{other['href']}", False)
        raise CalError(
            403,
            "this UID belongs to another task",
            "C:no-uid-conflict",
            f"<D:href>{xesc(href)}</D:href>",
        )
    if task is not None:
        cal_may_write(principal, task["path"])

        def edit(lines: list, at: int) -> None:
            lines[at] = cal_rewrite(svc, {**task, "text": lines[at]}, new)
            # the line stays this item whatever its text became (a new DUE on `milk`, a
            # rename): the next look gives it this UID, not the nearest text's
            book.claim(task["path"], lines[at], task["uid"], task["href"])

        cal_edit_line(svc, task, edit)
        status = 204
    else:
        cal_put_new(svc, book, res, principal, new)
        status = 201
    book.refresh()
    done = book.tasks.get(uid)
    bottle.response.status = status
    if done is not None:
        bottle.response.set_header("ETag", done["etag"])
    return b""


def cal_put_new(svc: Service, book: TaskBook, res: dict, principal: Principal, new: dict):
    """A client's new task: a line under its parent task (RELATED-TO) when that is in
    this list, else a line at the end of the list's <folder>/Tasks.md."""
    parent = book.tasks.get(new["parent"] or "")
    folder = res["list"]["folder"]
    if parent and _sees(principal, parent["path"]) and folder in (None, parent["folder"]):
        cal_may_write(principal, parent["path"])
        m = TASK_LINE_RE.match(parent["text"])
        indent = m.group(1) + " " * len(m.group(2) + m.group(3))
        line = task_line_of(
            new["done"], new["summary"], cal_wall(svc, new["due"]), new["categories"], indent
        )
        book.claim(parent["path"], line, new["uid"], res["href"])

        def insert(lines: list, at: int) -> None:
            width = len(m.group(1).expandtabs(4))
            end = at + 1
            while end < len(lines) and lines[end].strip():
                shown = lines[end].expandtabs(4)
                if len(shown) - len(shown.lstrip()) <= width:
                    break
                end += 1
            lines.insert(end, line)

        cal_edit_line(svc, parent, insert)
        return
    path = f"{folder or principal.home or INBOX}/{TASKS_NOTE}"
    if not _sees(principal, path):
        raise DavError(404, f"no task list {res['list']['id']}")
    cal_may_write(principal, path)
    line = task_line_of(new["done"], new["summary"], cal_wall(svc, new["due"]), new["categories"])
    book.claim(path, line, new["uid"], res["href"])
    cal_append(svc, path, line)


def cal_may_write(principal: Principal, path: str) -> None:
    """403 (DAV:need-privileges) where a principal may only read: a folder shared with a
    person for reading."""
    if not principal.whole and not principal.may_write(path):
        raise CalError(403, f"this key may only read {path.rsplit('/', 1)[0]}", "D:need-privileges")


def cal_append(svc: Service, path: str, line: str) -> None:
    for _ in range(5):
        try:
            raw, _st = svc.notes._read(path)
        except ApiError as e:
            if e.status_code != 404:
                raise
            content = f"# Tasks\n\n{line}\n"
            cal_fits(svc, path, 0, content)
            with contextlib.suppress(ApiError):
                svc.notes.create(path, content)
                return
            continue
        text = raw.decode("utf-8")
        content = text + ("" if text.endswith("\n") or not text else "\n") + line + "\n"
        cal_fits(svc, path, len(raw), content)
        with contextlib.suppress(PreconditionFailed):
            svc.notes.update(path, content, make_etag(raw), reason="caldav")
            return
    raise DavError(409, "the task note kept changing: try again")


def cal_delete(svc: Service, book: TaskBook, res: dict, ctx: dict):
    if res["kind"] != "item":
        raise DavError(403, "task lists are folders of notes: they are not deleted here")
    task = res["task"]
    if task is None:
        raise DavError(404, f"nothing at /dav/{res['path']}")
    _check_if_match(task)
    cal_may_write(ctx["principal"], task["path"])

    def drop(lines: list, at: int) -> None:
        del lines[at]

    cal_edit_line(svc, task, drop)
    book.refresh()
    bottle.response.status = 204
    return b""


def get_task(svc: Service, uid: str) -> dict:
    """GET /tasks/<uid>: where a task's line is (the web client opens `#task=<uid>`, the
    link in each task's DESCRIPTION)."""
    book = task_book(svc)
    book.refresh()
    task = book.tasks.get(uid)
    if task is None or not _sees(request_principal(), task["path"]):
        raise not_found("no such task (it may have been deleted, or its line changed a lot)")
    keys = ("uid", "path", "line", "summary", "done")
    return {k: task[k] for k in keys}
