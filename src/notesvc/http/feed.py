"""The calendar feed: /ics/<secret>.ics, the tasks as a read-only iCalendar file."""

from __future__ import annotations

import datetime as dt
import hmac
import re
import secrets
import time

from notesvc.boot import bottle, log
from notesvc.errors import ApiError, bad_request, not_found
from notesvc.grants import OWNER, Principal, epoch_of, request_principal, visible_folders
from notesvc.helpers import field, iso, key_hash, read_json
from notesvc.http.access import opens_only_at_home, public_limit, share_url
from notesvc.http.caldav import CAL_TYPE, cal_list_tasks
from notesvc.notes.paths import NOTES
from notesvc.notes.tasks import (
    ical_calendar,
    ical_date,
    ical_escape,
    ical_stamp,
    ical_utc,
    task_book,
    vtodo_lines,
)
from notesvc.service import Service

# -- the calendar feed: /ics/<secret>.ics -------------------------------------------------
#
# A read-only iCalendar file for apps that subscribe to a URL (Google Calendar, Outlook):
# the tasks as VTODOs, a VEVENT at each ⏰ time and an all-day VEVENT for each open dated
# task (those apps ignore VTODO). Its secret opens /ics/ only, is shown once and kept
# hashed in state.json (`feeds`); unknown secrets count toward the per-address lockout of
# share links.

FEED_SECRET_RE = re.compile(r"^[A-Za-z0-9_-]{32}\Z")
MAX_FEEDS = 50
FEED_USE_SECONDS = 300  # lastUsedAt is written at most this often


def feed_record(feed: dict) -> dict:
    keys = ("id", "name", "folder", "createdAt", "lastUsedAt", "hint")
    rec = {**{k: feed.get(k) for k in keys}, "createdBy": feed.get("createdBy", "owner")}
    if feed.get("person"):  # whose it is (the owner lists everyone's)
        rec["person"] = feed["person"]
    return rec


def feed_url(svc: Service, environ: dict, secret: str) -> str:
    """<base>/ics/<secret>.ics, <base> as share links have it (the relay origin in relay
    mode)."""
    return share_url(svc, environ, "")[: -len("/s/")] + f"/ics/{secret}.ics"


def create_feed(svc: Service) -> dict:
    body = read_json(svc.config.max_body_bytes)
    name = " ".join(str(field(body, "name", max_len=100)).split())
    if not name:
        raise bad_request("'name' is empty")
    raw = field(body, "folder", required=False)
    who = request_principal()
    folder = None
    if raw:  # one folder of its reach (a folder above several of them: 404)
        asked, shown = visible_folders(svc, raw)
        if shown != (asked,):
            raise not_found(f"no folder at {asked}")
        folder = asked
    secret, now = secrets.token_urlsafe(24), time.time()
    feed = {
        "id": "fd_" + secrets.token_hex(6),
        "name": name,
        "folder": folder if folder != NOTES else None,
        "createdAt": iso(now),
        "lastUsedAt": None,
        "hint": secret[-4:],
        "secretHash": key_hash(secret),
        "createdBy": who.grant_id or "owner",
    }
    if who.person:  # a person's feed: listed to them, and it reads as much as they do
        feed["person"] = who.person

    def change(data: dict) -> None:
        feeds = data.get("feeds", [])
        if len(feeds) >= MAX_FEEDS:
            raise ApiError(409, "CONFLICT", f"{MAX_FEEDS} calendar feeds exist; delete some")
        data["feeds"] = [*feeds, feed]

    svc.state.update(change)
    log.info("calendar feed %s created", feed["id"])
    bottle.response.status = 201
    url = feed_url(svc, bottle.request.environ, secret)
    return {**feed_record(feed), "url": url, "homeOnly": opens_only_at_home(url)}


def _feeds_seen(svc: Service) -> list:
    """The feeds the request may list and delete: all for the owner, a person's own."""
    person = request_principal().person
    feeds = svc.state.read().get("feeds", [])
    return [f for f in feeds if not person or f.get("person") == person]


def list_feeds(svc: Service) -> dict:
    return {"feeds": [feed_record(f) for f in _feeds_seen(svc)]}


def delete_feed(svc: Service, feed_id: str) -> dict:
    if not any(f["id"] == feed_id for f in _feeds_seen(svc)):
        raise not_found(f"no calendar feed {feed_id}")

    def change(data: dict) -> None:
        data["feeds"] = [f for f in data.get("feeds", []) if f["id"] != feed_id]

    svc.state.update(change)
    return {"id": feed_id, "deleted": True}


def _feed_of(svc: Service, secret: str) -> dict | None:
    if not FEED_SECRET_RE.match(secret):
        return None
    h = key_hash(secret)
    for f in svc.state.read().get("feeds", []):
        if hmac.compare_digest(f["secretHash"], h):
            return f
    return None


def get_feed(svc: Service, name: str):
    """GET /ics/<secret>.ics: the feed's calendar."""
    addr = public_limit(svc)
    resp = bottle.response
    for header, value in (
        ("Cache-Control", "private, max-age=300"),
        ("X-Robots-Tag", "noindex, nofollow"),
        ("Referrer-Policy", "no-referrer"),
    ):
        resp.set_header(header, value)
    feed = _feed_of(svc, name[:-4] if name.endswith(".ics") else "")
    if feed is not None and not svc.grants.live_maker(feed.get("createdBy")):
        feed = None  # its device was revoked (the feed went with it) or has expired
    if feed is None:
        svc.grants.share_misses.fail(addr, name)
        raise not_found("no calendar feed at this link (it may have been deleted)")
    now = time.time()
    used = feed.get("lastUsedAt")
    if used is None or now - epoch_of(used) > FEED_USE_SECONDS:

        def change(data: dict) -> None:
            for f in data.get("feeds", []):
                if f["id"] == feed["id"]:
                    f["lastUsedAt"] = iso(now)

        svc.state.update(change)
    book = task_book(svc)
    book.refresh()
    maker = svc.grants.principal_by_id(feed.get("createdBy"))  # (live: checked above)
    reach = (maker or OWNER).reach.narrowed(feed.get("folder") or "", "read")
    reader = Principal("key", "read", reach=reach)
    origin = svc.base_url(bottle.request.environ).rstrip("/")
    parts: list = []
    for task in cal_list_tasks(book, reader, None):
        parts += vtodo_lines(task, f"{origin}/#task={task['uid']}")
        parts += feed_events(task)
    resp.content_type = CAL_TYPE
    return ical_calendar(parts, feed["name"])


def feed_events(task: dict) -> list:
    """The VEVENTs of a task in the feed: at its ⏰ time, and all day on its open date."""
    out: list = []
    stamp = f"DTSTAMP:{ical_stamp(task['stamp'])}"
    summary = f"SUMMARY:{ical_escape(task['summary'] or 'Task')}"
    if task["alarm"] is not None:  # it rings: an alarm at its start (README: ⏰ also rings)
        end = task["alarm"] + dt.timedelta(minutes=15)
        out += ["BEGIN:VEVENT", f"UID:{task['uid']}-at", stamp, summary]
        out += [f"DTSTART:{ical_utc(task['alarm'])}", f"DTEND:{ical_utc(end)}"]
        out += ["BEGIN:VALARM", "ACTION:DISPLAY", summary.replace("SUMMARY:", "DESCRIPTION:", 1)]
        out += ["TRIGGER;RELATED=START:PT0S", "END:VALARM", "END:VEVENT"]
    if isinstance(task["due"], dt.date) and not task["done"]:
        after = task["due"] + dt.timedelta(days=1)
        out += ["BEGIN:VEVENT", f"UID:{task['uid']}-day", stamp, summary]
        out += [
            f"DTSTART;VALUE=DATE:{ical_date(task['due'])}",
            f"DTEND;VALUE=DATE:{ical_date(after)}",
        ]
        out += ["TRANSP:TRANSPARENT", "END:VEVENT"]
    return out
