"""MCP resources and prompts: the notes as notesvc:// URIs, and prompts that embed them.

The JSON-RPC side (http/mcp.py) calls these with the request's principal in place: every
URI is checked through the same guards as the API (visible_note, visible_folders,
visible_attachment), so a resource outside the caller's reach is "not found" like a note.
"""

from __future__ import annotations

import base64
import collections
import datetime as dt
import hashlib
import hmac
import os
import re
import time
import urllib.parse
from typing import Any

from notesvc.errors import ApiError
from notesvc.grants import (
    granted_tree,
    request_principal,
    visible_attachment,
    visible_folders,
    visible_note,
)
from notesvc.helpers import iso
from notesvc.notes.paths import NOTES, note_title
from notesvc.plugins import LinkResolver, derived_per_note, link_graph, link_refs, tag_map
from notesvc.search.hybrid import find_notes
from notesvc.search.text import Query
from notesvc.service import Service
from notesvc.tools import seen_version

# -- errors: JSON-RPC's codes, MCP's "resource not found" --------------------------------------

PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, INVALID_PARAMS = -32700, -32600, -32601, -32602
RESOURCE_NOT_FOUND = -32002  # MCP: resources/read of a URI that names nothing (or not for you)
HEADER_MISMATCH, UNSUPPORTED_VERSION = -32020, -32022


class McpError(Exception):
    """A JSON-RPC error of an MCP method (http/mcp.py's RpcError answers it)."""

    def __init__(self, code: int, message: str, data: Any = None):
        super().__init__(message)
        self.code, self.message, self.data = code, message, data


# -- URIs: notesvc://<kind>/<path>, each path segment percent-encoded -------------------------

SCHEME = "notesvc://"
URI_KINDS = ("note", "folder", "version", "attachment")
MAX_URI_CHARS = 4096
_URI_RE = re.compile(r"notesvc://([^/?#]*)/([^?#]*)", re.S)


def resource_uri(kind: str, path: str, version: str = "") -> str:
    """Return the URI of a note, folder, attachment or version: each segment of its path
    percent-encoded (`/` between them kept; a version after the last `@`).

    >>> resource_uri("note", "notes/a b/c@d.md")
    'notesvc://note/notes/a%20b/c%40d.md'
    """
    quoted = "/".join(urllib.parse.quote(seg, safe="") for seg in path.split("/"))
    return f"{SCHEME}{kind}/{quoted}" + (f"@{version}" if version else "")


def parse_uri(uri: Any) -> tuple:
    """Return (kind, path, version id or "") of a notesvc:// URI; -32602 for anything else:
    another scheme or host, a query or fragment, `.` or `..` segments (`%2F` reads as `/`).

    >>> parse_uri("notesvc://version/notes/a%2Fb.md@v1")
    ('version', 'notes/a/b.md', 'v1')
    """
    if not isinstance(uri, str) or not uri:
        raise McpError(INVALID_PARAMS, "params.uri must be a resource URI (a string)")
    if len(uri) > MAX_URI_CHARS:
        raise McpError(INVALID_PARAMS, f"the URI is longer than {MAX_URI_CHARS} characters")
    m = _URI_RE.fullmatch(uri)
    if not m:
        raise McpError(
            INVALID_PARAMS,
            "unknown resource URI: this server serves notesvc://note/<path>, "
            "notesvc://folder/<path>, notesvc://version/<path>@<id>, "
            "notesvc://attachment/<path> and ui://notesvc/review",
            {"uri": uri[:200]},
        )
    kind, raw = m.groups()
    if kind not in URI_KINDS:
        raise McpError(
            INVALID_PARAMS,
            f"unknown resource kind {kind[:40]!r}: one of {', '.join(URI_KINDS)}",
            {"uri": uri[:200]},
        )
    version = ""
    if kind == "version":
        raw, at, version = raw.rpartition("@")
        if not at or not version:
            raise McpError(INVALID_PARAMS, "a version URI ends @<versionId>", {"uri": uri[:200]})
        version = urllib.parse.unquote(version)
    try:
        path = "/".join(urllib.parse.unquote(seg, errors="strict") for seg in raw.split("/")).strip(
            "/"
        )
    except UnicodeDecodeError:
        raise McpError(INVALID_PARAMS, "the URI's path is not UTF-8", {"uri": uri[:200]}) from None
    if not path or {".", ".."} & set(path.split("/")) or "" in path.split("/"):
        raise McpError(
            INVALID_PARAMS, "a resource path has no empty, . or .. segments", {"uri": uri[:200]}
        )
    return kind, path, version


def _not_found(uri: str) -> McpError:
    return McpError(RESOURCE_NOT_FOUND, "Resource not found", {"uri": uri[:200]})


def checked(uri: str, fn, *args):
    """Return fn(*args), an ApiError of the guards turned into JSON-RPC: 404 (and 403: what
    is not yours to see is not there) "not found", anything else invalid params."""
    try:
        return fn(*args)
    except ApiError as e:
        if e.status_code in (403, 404):
            raise _not_found(uri) from None
        raise McpError(INVALID_PARAMS, e.message, {"uri": uri[:200]}) from None


# -- resources/list: the notes in reach, newest first, 100 a page -----------------------------

RESOURCE_PAGE = 100
_CURSOR_KEY = os.urandom(16)  # a cursor is good until the server restarts


def _who() -> str:
    p = request_principal()
    return p.grant_id or p.kind


def make_cursor(offset: int) -> str:
    body = f"{offset}.{_who()}"
    mac = hmac.new(_CURSOR_KEY, body.encode(), hashlib.sha256).hexdigest()[:16]
    return base64.urlsafe_b64encode(f"{offset}.{mac}".encode()).decode().rstrip("=")


def read_cursor(cursor: Any) -> int:
    """Return the offset a cursor names; -32602 for one this server did not give this
    caller (forged, another caller's, from before a restart)."""
    if cursor is None:
        return 0
    try:
        if not isinstance(cursor, str) or len(cursor) > 100:
            raise ValueError
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        offset_text, mac = raw.split(".")
        offset = int(offset_text)
        body = f"{offset}.{_who()}"
        want = hmac.new(_CURSOR_KEY, body.encode(), hashlib.sha256).hexdigest()[:16]
        if offset < 0 or not hmac.compare_digest(mac, want):
            raise ValueError
    except (ValueError, UnicodeDecodeError):
        raise McpError(
            INVALID_PARAMS,
            "unknown cursor: list again without one (cursors last until the server restarts)",
        ) from None
    return offset


def list_resources(svc: Service, cursor: Any) -> dict:
    """resources/list: a page of the notes the caller reaches, most recently changed first."""
    offset = read_cursor(cursor)
    principal = request_principal()
    folders = principal.folders or (NOTES,)
    try:
        page = svc.notes.list_page(
            folders[0] if len(folders) == 1 else folders, RESOURCE_PAGE, offset, "modified"
        )
    except ApiError as e:  # a home not made yet: nothing to list
        if e.status_code != 404:
            raise
        page = {"notes": [], "total": 0}
    resources = [
        {
            "uri": resource_uri("note", rec["path"]),
            "name": rec["path"],
            "title": rec["title"],
            "mimeType": "text/markdown",
            "size": rec["size"],
            "annotations": {"lastModified": rec["modified"]},
        }
        for rec in page["notes"]
    ]
    answer: dict = {"resources": resources}
    if offset + RESOURCE_PAGE < page["total"]:
        answer["nextCursor"] = make_cursor(offset + RESOURCE_PAGE)
    return answer


RESOURCE_TEMPLATES = [
    {
        "uriTemplate": "notesvc://note/{path}",
        "name": "note",
        "title": "A note",
        "description": "A note's Markdown, by its path (notes/<folders>/<name>.md)",
        "mimeType": "text/markdown",
    },
    {
        "uriTemplate": "notesvc://folder/{path}",
        "name": "folder",
        "title": "A folder",
        "description": "A folder's subfolders and notes, as a Markdown list of links",
        "mimeType": "text/markdown",
    },
    {
        "uriTemplate": "notesvc://version/{path}@{versionId}",
        "name": "version",
        "title": "An earlier version of a note",
        "description": "A note as it was (note_history lists the version ids)",
        "mimeType": "text/markdown",
    },
    {
        "uriTemplate": "notesvc://attachment/{path}",
        "name": "attachment",
        "title": "An attachment",
        "description": "A file under attachments/: its bytes up to 1 MiB, else a link",
    },
]


# -- resources/read ----------------------------------------------------------------------------

MAX_BLOB_BYTES = 1 << 20  # an attachment read inline; larger ones are a link


def read_resource(svc: Service, uri: Any, api_base: str = "") -> dict:
    """resources/read of a notesvc:// URI: {contents: [...]}; -32002 for what is not there
    or not in the caller's reach, -32602 for a URI that is not one of ours."""
    kind, path, version = parse_uri(uri)
    if kind == "note":
        path = checked(uri, visible_note, svc.notes, path)
        rec = checked(uri, svc.notes.get, path)
        return {"contents": [note_content(uri, rec)]}
    if kind == "version":
        path = checked(uri, visible_note, svc.notes, path)
        data = checked(uri, seen_version, svc, path, version)
        text = data.decode("utf-8", "replace")
        meta = {"etag": '"' + hashlib.sha256(data).hexdigest()[:32] + '"', "path": path}
        return {
            "contents": [{"uri": uri, "mimeType": "text/markdown", "text": text, "_meta": meta}]
        }
    if kind == "folder":
        tree = checked(uri, granted_tree, svc, path, 1)
        text = folder_markdown(svc, tree)
        return {"contents": [{"uri": uri, "mimeType": "text/markdown", "text": text}]}
    path = checked(uri, visible_attachment, svc.attachments, path)
    rec = checked(uri, svc.attachments.get, path)
    meta = {"etag": rec["etag"], "modified": rec["modified"], "size": rec["size"]}
    if rec["size"] > MAX_BLOB_BYTES:  # too large to carry: where to fetch it
        link = f"{api_base}/attachments/{urllib.parse.quote(path, safe='/')}"
        meta["tooLarge"] = True
        return {
            "contents": [{"uri": uri, "mimeType": "text/uri-list", "text": link, "_meta": meta}]
        }
    f, _ = checked(uri, svc.attachments.open, path)
    with f:
        data = f.read(MAX_BLOB_BYTES + 1)
    blob = base64.b64encode(data).decode("ascii")
    return {"contents": [{"uri": uri, "mimeType": rec["contentType"], "blob": blob, "_meta": meta}]}


def note_content(uri: str, rec: dict) -> dict:
    return {
        "uri": uri,
        "mimeType": "text/markdown",
        "text": rec["content"],
        "_meta": {"etag": rec["etag"], "modified": rec["modified"]},
    }


def folder_markdown(svc: Service, tree: dict) -> str:
    """Return a folder's listing as Markdown: its subfolders and notes as resource links."""
    lines = [f"# {tree['path']}", ""]
    for child in tree.get("children", ()):
        if child["type"] == "folder":
            count = child.get("count")
            more = f" ({count} notes)" if isinstance(count, int) else ""
            lines.append(f"- [{child['name']}/]({resource_uri('folder', child['path'])}){more}")
        else:
            title = svc.index.title_of(child["path"]) or note_title("", child["path"])
            lines.append(f"- [{title}]({resource_uri('note', child['path'])})")
    if len(lines) == 2:
        lines.append("(empty)")
    return "\n".join(lines) + "\n"


# -- prompts: ingest, weekly-review, summarize-folder, tidy ------------------------------------

PROMPT_BYTES = 50_000  # of everything one prompt embeds (its notes cut to fit)
PROMPTS = {
    "ingest": {
        "title": "Ingest into the wiki",
        "description": "Turn a text (or a note) into wiki notes: search first, link to what "
        "is there, update rather than duplicate.",
        "arguments": [
            {
                "name": "source",
                "description": "the text to take in, or the path of a note holding it",
                "required": True,
            },
            {
                "name": "folder",
                "description": "where new notes go (default: notes/wiki)",
                "required": False,
            },
        ],
    },
    "weekly-review": {
        "title": "Weekly review",
        "description": "What changed in the notes since a date (default: 7 days ago), and "
        "the open tasks in them.",
        "arguments": [
            {
                "name": "since",
                "description": "a date or time, ISO 8601 (2025-05-01)",
                "required": False,
            }
        ],
    },
    "summarize-folder": {
        "title": "Summarize a folder",
        "description": "A summary of the notes of one folder, with its notes embedded.",
        "arguments": [
            {"name": "path", "description": "the folder (notes/<folders>)", "required": True}
        ],
    },
    "tidy": {
        "title": "Tidy the notes",
        "description": "Find broken links, orphan notes, near duplicates and untagged notes, "
        "and suggest fixes.",
        "arguments": [
            {
                "name": "folder",
                "description": "only this folder (default: all you reach)",
                "required": False,
            }
        ],
    },
}


def list_prompts() -> dict:
    return {"prompts": [{"name": name, **spec} for name, spec in PROMPTS.items()]}


class _Budget:
    """The bytes a prompt may still embed (PROMPT_BYTES in all)."""

    def __init__(self, total: int = PROMPT_BYTES):
        self.left = total

    def text(self, text: str) -> str:
        data = text.encode("utf-8")
        if len(data) <= self.left:
            self.left -= len(data)
            return text
        mark = "\n\n[… cut: the prompt's 50 KB are used up]"
        cut = data[: max(self.left - len(mark.encode()), 0)].decode("utf-8", "ignore")
        self.left = 0
        return cut + mark


def _say(text: str, budget: _Budget) -> dict:
    return {"role": "user", "content": {"type": "text", "text": budget.text(text)}}


def _embed(svc: Service, paths: list, budget: _Budget, most: int = 20) -> list:
    """Return messages embedding the notes at paths (type resource), while the budget lasts."""
    out = []
    for path in paths[:most]:
        if budget.left < 200:
            break
        try:
            rec = svc.notes.get(path)
        except ApiError:
            continue
        content = note_content(resource_uri("note", path), rec)
        content["text"] = budget.text(content["text"])
        out.append({"role": "user", "content": {"type": "resource", "resource": content}})
    return out


def _argument(arguments: dict, name: str, required: bool = False) -> str:
    value = arguments.get(name)
    if value is None or value == "":
        if required:
            raise McpError(INVALID_PARAMS, f"missing required argument {name!r}")
        return ""
    if not isinstance(value, str):
        raise McpError(INVALID_PARAMS, f"argument {name!r} must be a string")
    if len(value) > 100_000:
        raise McpError(INVALID_PARAMS, f"argument {name!r} is over 100,000 characters")
    return value


def _one_folder(svc: Service, raw: str) -> str:
    """Return the folder a prompt's `folder` argument names as the caller sees it: the folder
    itself inside its reach, or the one reached folder beneath it (404 outside the reach)."""
    folder, shown = visible_folders(svc, raw)
    return shown[0] if len(shown) == 1 else folder


def _guarded(fn, *args):
    try:
        return fn(*args)
    except ApiError as e:
        raise McpError(INVALID_PARAMS, e.message) from None


def get_prompt(svc: Service, name: Any, arguments: Any) -> dict:
    """prompts/get: {description, messages}; -32602 for an unknown prompt or bad arguments."""
    if not isinstance(name, str) or name not in PROMPTS:
        raise McpError(INVALID_PARAMS, f"unknown prompt {str(name)[:64]!r} (see prompts/list)")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise McpError(INVALID_PARAMS, "params.arguments must be an object")
    budget = _Budget()
    make = {
        "ingest": _ingest,
        "weekly-review": _weekly_review,
        "summarize-folder": _summarize_folder,
        "tidy": _tidy,
    }[name]
    return {"description": PROMPTS[name]["description"], "messages": make(svc, arguments, budget)}


def _search_words(text: str, most: int = 12) -> str:
    """Return a query of a text's most frequent longer words (OR-ed), for finding notes on it."""
    words = collections.Counter(w.casefold() for w in re.findall(r"[^\W\d_]{5,}", text[:20000]))
    return " OR ".join(w for w, _ in words.most_common(most))


def _ingest(svc: Service, args: dict, budget: _Budget) -> list:
    source = _argument(args, "source", required=True)
    folder = _argument(args, "folder") or ""
    principal = request_principal()
    home = principal.home or NOTES
    folder = _guarded(_one_folder, svc, folder) if folder else f"{home}/wiki"
    messages = []
    text, from_note = source, ""
    if re.fullmatch(r"notes/[^\n]+\.md", source.strip()):
        try:
            path = visible_note(svc.notes, source.strip())
            text, from_note = svc.notes.get(path)["content"], path
        except ApiError:
            pass
    intro = (
        "Take the source below into my notes as a small wiki.\n\n"
        "1. Search first (search_notes) for notes on the same subjects; read them (read_note).\n"
        "2. Where a note on a subject exists, add to it (update_note with its etag, or "
        "append_to_note); do not make a second note on the same subject.\n"
        f"3. New subjects get a note each in {folder}/, named for the subject, starting with "
        "a `# Title` line and a line of #tags.\n"
        "4. Link related notes with [[Note name]] wikilinks, both ways where it helps.\n"
        "5. Keep the source's facts; say where they came from"
        + (f" ([[{from_note.rsplit('/', 1)[-1][:-3]}]])" if from_note else "")
        + ".\n6. At the end, list the notes you made or changed.\n\n"
        "Notes that may be on the same subjects are embedded after the source."
    )
    messages.append(_say(intro, budget))
    if from_note:
        messages += _embed(svc, [from_note], budget, 1)
    else:
        messages.append(_say(f"The source:\n\n{text}", budget))
    query = _search_words(text)
    related = []
    if query:
        found = find_notes(svc, Query(query), principal.folders, 8, 0, "keyword")
        related = [p for p, *_ in found["results"] if p != from_note]
    return messages + _embed(svc, related, budget, 8)


def _since_time(raw: str) -> float:
    if not raw:
        return time.time() - 7 * 86400
    try:
        when = dt.datetime.fromisoformat(raw.strip().replace("Z", "+00:00"))
    except ValueError:
        raise McpError(
            INVALID_PARAMS, "'since' must be a date or time, such as 2025-05-01"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return when.timestamp()


_OPEN_TASK_RE = re.compile(r"^[ \t]*[-*+][ \t]+\[ \][ \t]+(.+)$", re.M)


def _weekly_review(svc: Service, args: dict, budget: _Budget) -> list:
    since = _since_time(_argument(args, "since"))
    sees = request_principal().sees
    changed = sorted(
        ((m, p) for p, (_, m) in svc.notes.scan().items() if m / 1e9 > since and sees(p)),
        reverse=True,
    )
    paths = [p for _, p in changed]
    tasks = []
    for path in paths[:200]:
        try:
            text = svc.notes.get(path)["content"]
        except ApiError:
            continue
        tasks += [f"- [ ] {t.strip()} ({path})" for t in _OPEN_TASK_RE.findall(text)[:20]]
    listed = "\n".join(f"- {p}" for p in paths[:100]) or "(none)"
    more = f"\n… and {len(paths) - 100} more" if len(paths) > 100 else ""
    intro = (
        f"Review my notes since {iso(since)[:10]}: what changed ({len(paths)} notes), what "
        "it adds up to, and what needs doing next. Group the changes by subject; list the "
        "open tasks below by urgency; point out anything that looks forgotten.\n\n"
        f"Changed notes, newest first:\n{listed}{more}\n\n"
        f"Open tasks in them:\n" + ("\n".join(tasks[:100]) or "(none)")
    )
    return [_say(intro, budget), *_embed(svc, paths, budget, 20)]


def _summarize_folder(svc: Service, args: dict, budget: _Budget) -> list:
    raw = _argument(args, "path", required=True)
    tree = _guarded(granted_tree, svc, raw.rstrip("/"), 1)
    listing = folder_markdown(svc, tree)
    paths = [c["path"] for c in tree["children"] if c["type"] != "folder"]
    intro = (
        f"Summarize the folder {tree['path']}: what it is about, its main points, how its "
        "notes relate, and what is missing or out of date. Cite notes by name.\n\n" + listing
    )
    return [_say(intro, budget), *_embed(svc, paths, budget, 40)]


def _broken_links(svc: Service) -> dict:
    """Return {note path: [link targets that lead nowhere]}, kept until the index changes."""

    def take(text: str) -> tuple | None:
        refs = link_refs(text) if "[[" in text or ".md" in text else ((), ())
        return refs if any(refs) else None

    def combine(paths: list, refs: dict) -> dict:
        resolver = LinkResolver(paths)
        broken = {}
        for path, (wikis, targets) in refs.items():
            bad = [w for w in wikis if resolver.wikilink(w) is None and "." not in w[-5:]]
            bad += [
                t
                for t in targets
                if t.casefold().endswith(".md") and resolver.mdlink(t, path) is None
            ]
            if bad:
                broken[path] = bad
        return broken

    return derived_per_note(svc, "broken links", take, combine)


def _tidy(svc: Service, args: dict, budget: _Budget) -> list:
    principal = request_principal()
    folder = _argument(args, "folder")
    if folder:
        folder = _guarded(_one_folder, svc, folder.rstrip("/"))

    def inside(p: str) -> bool:
        return principal.sees(p) and (not folder or p.startswith(folder + "/"))

    paths = [p for p in svc.notes.scan() if inside(p)]
    graph, broken = link_graph(svc), _broken_links(svc)
    tagged = {p for ps in tag_map(svc).values() for p in ps}
    linking = {src for targets in graph.values() for src in targets}
    orphans = [p for p in sorted(paths) if not graph.get(p) and p not in linking]
    untagged = [p for p in sorted(paths) if p not in tagged]
    titles = collections.defaultdict(list)
    for p in sorted(paths):
        key = re.sub(r"[\W\d_]+", "", (svc.index.title_of(p) or p.rsplit("/", 1)[-1]).casefold())
        if key:
            titles[key].append(p)
    dupes = [group for group in titles.values() if len(group) > 1]
    bad = [(p, broken[p]) for p in sorted(broken) if inside(p)]

    def listed(items: list, show) -> str:
        lines = [show(i) for i in items[:50]]
        more = f"\n… and {len(items) - 50} more" if len(items) > 50 else ""
        return ("\n".join(lines) or "(none)") + more

    intro = (
        f"Tidy my notes{' in ' + folder if folder else ''} ({len(paths)} notes). For each "
        "finding below, propose a fix (a link to correct, a note to link from, notes to merge, "
        "tags to add) and make it with the write tools only after saying what you will do.\n\n"
        "Broken links:\n"
        + listed(bad, lambda b: f"- {b[0]}: " + ", ".join(f"[[{t}]]" for t in b[1][:5]))
        + "\n\nOrphans (no links in or out):\n"
        + listed(orphans, lambda p: f"- {p}")
        + "\n\nNear duplicates (the same title):\n"
        + listed(dupes, lambda g: "- " + " · ".join(g[:5]))
        + "\n\nUntagged:\n"
        + listed(untagged, lambda p: f"- {p}")
    )
    first = [b[0] for b in bad[:5]] + [p for g in dupes[:3] for p in g[:2]] + orphans[:5]
    return [_say(intro, budget), *_embed(svc, list(dict.fromkeys(first)), budget, 15)]


# -- completion/complete: the paths an argument may take ------------------------------------

MAX_COMPLETIONS = 100  # MCP's most values in one answer
_FOLDER_ARGUMENTS = {("summarize-folder", "path"), ("tidy", "folder"), ("ingest", "folder")}
_NOTE_ARGUMENTS = {("ingest", "source")}


def complete(svc: Service, ref: Any, argument: Any) -> dict:
    """completion/complete: note or folder paths in the caller's reach that begin with what
    was typed (or hold it), for a prompt's path arguments and the resource templates'
    `path`; nothing for other arguments (their values are free text)."""
    if not isinstance(ref, dict) or not isinstance(argument, dict):
        raise McpError(INVALID_PARAMS, "params.ref and params.argument must be objects")
    name, value = argument.get("name"), argument.get("value", "")
    if not isinstance(name, str) or not isinstance(value, str):
        raise McpError(INVALID_PARAMS, "argument.name and argument.value must be strings")
    kind = ref.get("type")
    if kind == "ref/prompt":
        key = (ref.get("name"), name)
        wants = "folder" if key in _FOLDER_ARGUMENTS else "note" if key in _NOTE_ARGUMENTS else ""
    elif kind == "ref/resource":
        template = str(ref.get("uri", ""))
        wants = ""
        if name == "path":
            wants = "folder" if template.startswith(f"{SCHEME}folder/") else "note"
    else:
        raise McpError(INVALID_PARAMS, "params.ref.type must be ref/prompt or ref/resource")
    values = _paths_like(svc, value[:500], wants) if wants else []
    shown = values[:MAX_COMPLETIONS]
    return {
        "completion": {"values": shown, "total": len(values), "hasMore": len(values) > len(shown)}
    }


def _paths_like(svc: Service, typed: str, wants: str) -> list:
    """Return the note (or folder) paths the caller sees that start with `typed`, then those
    that hold it, each group sorted."""
    sees = request_principal().sees
    notes = [p for p in svc.notes.scan() if sees(p)]
    if wants == "folder":
        found = {p.rsplit("/", 1)[0] for p in notes}
        found |= {"/".join(f.split("/")[:i]) for f in found for i in range(1, f.count("/") + 1)}
        paths = sorted(f for f in found if sees(f))
    else:
        paths = sorted(notes)
    low = typed.casefold()
    first = [p for p in paths if p.casefold().startswith(low)]
    return first + [p for p in paths if low in p.casefold() and p not in set(first)]
