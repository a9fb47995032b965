"""The built-in tools MCP clients and the agent may call."""

from __future__ import annotations

import datetime as dt
import urllib.parse

from notesvc.boot import API, bottle
from notesvc.errors import ApiError, bad_request, not_found, to_json
from notesvc.grants import granted_tree, request_principal, searched_folders, visible_note
from notesvc.helpers import iso
from notesvc.notes.history import VERSION_ID_RE
from notesvc.notes.merge import unified_diff
from notesvc.notes.paths import MAX_PATH_CHARS, NOTES, note_title
from notesvc.plugins import list_tags, move_and_relink
from notesvc.providers.base import SUGGESTING, tool
from notesvc.search.hybrid import find_notes, related_notes
from notesvc.search.text import MAX_QUERY_CHARS, Query
from notesvc.service import Service
from notesvc.suggestions import (
    accept_suggestion,
    make_suggestion,
    reject_suggestion,
    suggestion_diff,
)

# -- built-in tools (the TOOLS registry: see Providers) --------------------------------------

_PATH_ARG = {
    "type": "string",
    "minLength": 1,
    "maxLength": MAX_PATH_CHARS,
    "description": f"a note path, {NOTES}/<folders>/<name>.md, as search_notes and "
    "list_folder show it",
}
_FOLDER_ARG = {
    "type": "string",
    "maxLength": MAX_PATH_CHARS,
    "description": f"a folder: {NOTES} (the top) or {NOTES}/<folders>",
}
_ETAG_ARG = {
    "type": "string",
    "minLength": 1,
    "maxLength": 100,
    "description": "the etag read_note gave: the change is refused if the note changed since",
}
_QUERY_ARG = {
    "type": "string",
    "minLength": 1,
    "maxLength": MAX_QUERY_CHARS,
    "description": 'words (all must match), "exact phrase", prefix*, -word to leave out, '
    "a OR b; case, accents and English plurals do not matter",
}
READ_CHARS, MAX_READ_CHARS = 20000, 200000  # of a note read_note returns: default, most
REVIEW_URI = "ui://notesvc/review"  # the MCP App that shows a suggestion or a diff

# the structured results' JSON Schemas (MCP's outputSchema): their properties
_S, _I, _B = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}
_L = {"type": "array", "items": {"type": "object"}}
NOTE_SUMMARY = {"path": _S, "title": _S, "etag": _S, "size": _I, "modified": _S}
SUGGESTION_OUTPUT = {
    "suggestion": {
        "type": "object",
        "properties": {
            "id": _S,
            "url": _S,
            "kind": {"type": "string", "enum": ["create", "edit", "move", "delete"]},
            "path": _S,
            "newPath": _S,
            "diff": _S,
        },
        "required": ["id", "url", "kind", "path"],
    },
    "rejected": _L,
    "note": _S,
}


def suggesting() -> dict | None:
    """Return the connector the write tools make suggestions for (suggest mode), or None."""
    return SUGGESTING.get()


def _suggested(svc: Service, kind: str, path: str, **fields) -> dict:
    """Return a write tool's answer in suggest mode: the suggestion made (with its diff)."""
    answer = make_suggestion(svc, kind, path, connector=suggesting(), **fields)
    s = answer["suggestion"]
    s["diff"] = suggestion_diff(
        {
            "kind": kind,
            "path": path,
            "content": fields.get("content"),
            "baseText": fields.get("base_text") or "",
            "newPath": fields.get("new_path"),
        }
    )
    return answer


def _suggestion_text(data: dict) -> str:
    s = data["suggestion"]
    where = f"{s['path']} -> {s['newPath']}" if s.get("newPath") else s["path"]
    text = (
        f"Suggested ({s['kind']} {where}), not applied: the user reviews it and accepts or "
        f"rejects it ({s['url']}).\n\n{s.get('diff', '')}"
    )
    return text + (f"\n{data['note']}" if data.get("note") else "")


def write_text(data: dict) -> str:
    """Return a write tool's answer as text: a suggestion's, else the JSON."""
    if "suggestion" in data:
        return _suggestion_text(data)
    return to_json(data).decode("utf-8")


def note_url(svc: Service, path: str) -> str:
    """Return the API URL of a note as the current request reached this server (relay
    included); relative outside a request."""
    try:
        environ = bottle.request.environ
        base = svc.base_url(environ) + environ.get("SCRIPT_NAME", "")
    except (AttributeError, RuntimeError, KeyError):
        base = svc.config.public_url
    return f"{base}{API}/notes/{urllib.parse.quote(path, safe='')}"


def _summary(rec: dict) -> dict:
    """Return what a write tool answers: the note's record without its content."""
    return {k: rec[k] for k in ("path", "title", "etag", "size", "modified")}


def _hit_lines(data: dict) -> str:
    lines = [f"{r['path']} — {r['title']}: {r['snippet']}" for r in data["results"]]
    return "\n".join(lines) or "No note matches."


@tool(
    "search_notes",
    "Search the user's notes, best match first: by words and, when embeddings are on, by "
    "meaning (mode hybrid, the default then; semantic; keyword). Returns each hit's path, "
    "title and a snippet; open a note with read_note.",
    {
        "query": _QUERY_ARG,
        "limit": {"type": "integer", "minimum": 1, "maximum": 50, "default": 10},
        "folder": {**_FOLDER_ARG, "description": "search only this folder (and below)"},
        "mode": {
            "type": "string",
            "enum": ["hybrid", "semantic", "keyword"],
            "description": "hybrid (default when embeddings are on), semantic or keyword",
        },
    },
    ("query",),
    title="Search notes",
    text=_hit_lines,
    output={"results": _L, "total": _I, "mode": _S},
)
def tool_search_notes(
    svc: Service, query: str, limit: int = 10, folder: str = "", mode: str = ""
) -> dict:
    parsed = Query(query)
    within = searched_folders(svc, folder)  # a person's or a folder grant's reach by default
    found = find_notes(svc, parsed, within, limit, 0, mode, request_principal().folders)
    results = [
        {"path": p, "title": t, "snippet": sn, "score": sc} for p, t, sc, sn in found["results"]
    ]
    return {"results": results, "total": found["total"], "mode": found["mode"]}


def _related_lines(data: dict) -> str:
    lines = [f"{r['path']} — {r['title']}" for r in data["results"]]
    return "\n".join(lines) or (
        "No related note: none is near enough in meaning (or embeddings are off or not ready)."
    )


@tool(
    "related_notes",
    "Notes near one note in meaning (needs embeddings on the server; else empty).",
    {
        "path": _PATH_ARG,
        "limit": {"type": "integer", "minimum": 1, "maximum": 50, "default": 10},
    },
    ("path",),
    title="Related notes",
    text=_related_lines,
    output={"path": _S, "results": _L},
)
def tool_related_notes(svc: Service, path: str, limit: int = 10) -> dict:
    path = visible_note(svc.notes, path)
    if not svc.notes.exists(path):
        raise not_found(f"no note at {path}")
    near = related_notes(svc, path, request_principal().folders, limit)
    return {"path": path, "results": [{"path": p, "title": t, "score": s} for p, t, s in near]}


def _note_text(data: dict) -> str:
    head = f"{data['path']} — {data['title']}\netag: {data['etag']}"
    end = data["offset"] + len(data["content"])
    if data["offset"] or data["truncated"]:
        head += f"\ncharacters {data['offset']}-{end} of {data['totalChars']}"
        if data["truncated"]:
            head += f"; read on with offset={end}"
    return f"{head}\n\n{data['content']}"


@tool(
    "read_note",
    "Read a note: its Markdown content, title and etag (pass the etag to update_note or "
    "move_note). A long note comes in parts: read on from `offset`.",
    {
        "path": _PATH_ARG,
        "offset": {"type": "integer", "minimum": 0, "maximum": 10**9, "default": 0},
        "maxChars": {"type": "integer", "minimum": 1, "maximum": MAX_READ_CHARS},
    },
    ("path",),
    title="Read a note",
    text=_note_text,
    output={
        **NOTE_SUMMARY,
        "content": _S,
        "offset": _I,
        "truncated": _B,
        "totalChars": _I,
    },
)
def tool_read_note(svc: Service, path: str, offset: int = 0, maxChars: int = READ_CHARS) -> dict:
    rec = svc.notes.get(visible_note(svc.notes, path))
    content = rec["content"]
    part = content[offset : offset + maxChars]
    return {
        **_summary(rec),
        "content": part,
        "offset": offset,
        "truncated": offset + len(part) < len(content),
        "totalChars": len(content),
    }


def _cut(node: dict, depth: int) -> dict:
    """Return a folder node listed `depth` levels deep; deeper folders get `count`."""
    children = []
    for child in node["children"]:
        if child["type"] != "folder":
            children.append(child)
        elif depth > 1:
            children.append(_cut(child, depth - 1))
        else:
            folder = {k: child[k] for k in ("name", "path", "type")}
            children.append({**folder, "count": _count_notes(child)})
    return {**node, "children": children}


def _count_notes(node: dict) -> int:
    return sum(_count_notes(c) if c["type"] == "folder" else 1 for c in node["children"])


def _tree_lines(node: dict, indent: str = "") -> list:
    lines = [f"{indent}{node['name'] if indent else node['path']}/"]
    for child in node.get("children", ()):
        if child["type"] == "folder" and "children" in child:
            lines += _tree_lines(child, indent + "  ")
        elif child["type"] == "folder":
            lines.append(f"{indent}  {child['name']}/ ({child['count']} notes)")
        else:
            lines.append(f"{indent}  {child['name']}")
    return lines


@tool(
    "list_folder",
    f"List a folder of notes: its subfolders and notes ({NOTES} is the top). `depth` levels "
    "are listed; deeper folders show how many notes they hold.",
    {"path": _FOLDER_ARG, "depth": {"type": "integer", "minimum": 1, "maximum": 10, "default": 1}},
    title="List a folder",
    text=lambda node: "\n".join(_tree_lines(node)),
    output={"name": _S, "path": _S, "type": _S, "children": _L},
)
def tool_list_folder(svc: Service, path: str = NOTES, depth: int = 1) -> dict:
    return _cut(granted_tree(svc, path), depth)


def _since_ns(since: str) -> int:
    try:
        when = dt.datetime.fromisoformat(since.strip().replace("Z", "+00:00"))
    except ValueError:
        raise bad_request("'since' must be a time such as 2025-05-01T12:00:00Z") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return int(when.timestamp() * 1e9)


@tool(
    "recent_changes",
    "The notes changed most recently, newest first (by modification time; deleted notes "
    "are not listed).",
    {
        "since": {
            "type": "string",
            "maxLength": 40,
            "description": "only notes changed after this time (ISO 8601, e.g. "
            "2025-05-01T12:00:00Z)",
        },
        "limit": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20},
    },
    title="Recent changes",
    text=lambda d: (
        "\n".join(f"{c['modified']} {c['path']} — {c['title']}" for c in d["changes"])
        or "No note changed."
    ),
    output={"changes": _L, "total": _I},
)
def tool_recent_changes(svc: Service, since: str = "", limit: int = 20) -> dict:
    after, sees = _since_ns(since) if since else -1, request_principal().sees
    notes = [(m, p, size) for p, (size, m) in svc.notes.scan().items() if m > after and sees(p)]
    notes.sort(reverse=True)
    changes = [
        {
            "path": p,
            "title": svc.index.title_of(p) or note_title("", p),
            "modified": iso(m / 1e9),
            "size": size,
        }
        for m, p, size in notes[:limit]
    ]
    return {"changes": changes, "total": len(notes)}


@tool(
    "list_tags",
    "All #tags of the notes (and front-matter tags), each with how many notes carry it.",
    title="List tags",
    plugin="tags",
    text=lambda d: "\n".join(f"#{t['tag']} ({t['count']})" for t in d["tags"]) or "No tags.",
    output={"tags": _L},
)
def tool_list_tags(svc: Service) -> dict:
    return list_tags(svc)


WRITE_OUTPUT = {**NOTE_SUMMARY, **SUGGESTION_OUTPUT}  # what a write tool answers, either way


@tool(
    "create_note",
    "Create a note (refused if one exists at that path; missing folders are created).",
    {"path": _PATH_ARG, "content": {"type": "string", "description": "the Markdown text"}},
    ("path", "content"),
    title="Create a note",
    read_only=False,
    text=write_text,
    output=WRITE_OUTPUT,
    review=True,
)
def tool_create_note(svc: Service, path: str, content: str) -> dict:
    path = visible_note(svc.notes, path, write=True)
    if suggesting():
        svc.notes.encode(content)
        if svc.notes.exists(path):
            raise ApiError(409, "CONFLICT", f"a note already exists at {path}")
        return _suggested(svc, "create", path, content=content)
    return _summary(svc.notes.create(path, content))


def _suggested_edit(svc: Service, path: str, change) -> dict:
    """Return the suggestion of an edit: change(text) -> text applied to the note as it is
    now (its version the base), or what change raises."""
    rec = svc.notes.get(path)
    content = change(rec["content"])
    svc.notes.encode(content)
    return _suggested(
        svc, "edit", path, content=content, base=rec["etag"], base_text=rec["content"]
    )


@tool(
    "append_to_note",
    "Add text at the end of an existing note, on a new line (a list item: start it with '- ').",
    {"path": _PATH_ARG, "text": {"type": "string", "minLength": 1}},
    ("path", "text"),
    title="Append to a note",
    read_only=False,
    text=write_text,
    output=WRITE_OUTPUT,
    review=True,
)
def tool_append_to_note(svc: Service, path: str, text: str) -> dict:
    path = visible_note(svc.notes, path, write=True)

    def add(old: str) -> str:
        return old + ("\n" if old and not old.endswith("\n") else "") + text.rstrip("\n") + "\n"

    if suggesting():
        return _suggested_edit(svc, path, add)
    svc.notes.rewrite(path, add)
    return _summary(svc.notes.get(path))


@tool(
    "replace_in_note",
    "Replace one exact piece of a note's text with new text. `old` must occur exactly "
    "once: copy it from read_note, with enough of its surroundings to be unique.",
    {
        "path": _PATH_ARG,
        "old": {"type": "string", "minLength": 1, "description": "the exact text to replace"},
        "new": {"type": "string", "description": "the text to put in its place"},
    },
    ("path", "old", "new"),
    title="Replace text in a note",
    read_only=False,
    destructive=True,
    text=write_text,
    output={**WRITE_OUTPUT, "replaced": _I},
    review=True,
)
def tool_replace_in_note(svc: Service, path: str, old: str, new: str) -> dict:
    path = visible_note(svc.notes, path, write=True)

    def swap(text: str) -> str:
        count = text.count(old)
        if count == 1:
            return text.replace(old, new, 1)
        if count == 0:
            raise ApiError(
                409,
                "CONFLICT",
                f"the text to replace is not in {path}; read the note again (read_note) "
                "and copy the text exactly",
            )
        raise ApiError(
            409,
            "CONFLICT",
            f"the text to replace occurs {count} times in {path}; include more of the text "
            "around it so that it occurs once",
        )

    if suggesting():
        return _suggested_edit(svc, path, swap)
    svc.notes.rewrite(path, swap)
    return {**_summary(svc.notes.get(path)), "replaced": 1}


def _current(svc: Service, path: str, etag: str | None) -> dict:
    """Return the note as it is now; 412 when an etag is given and it is not this version."""
    rec = svc.notes.get(path)
    if etag is not None:
        svc.notes.check_match(etag, rec["content"].encode("utf-8"))
    return rec


@tool(
    "update_note",
    "Replace a note's whole content. Needs the etag read_note gave: a note that changed "
    "since is not overwritten (read it again and redo the change).",
    {"path": _PATH_ARG, "content": {"type": "string"}, "etag": _ETAG_ARG},
    ("path", "content", "etag"),
    title="Update a note",
    read_only=False,
    destructive=True,
    idempotent=True,
    text=write_text,
    output=WRITE_OUTPUT,
    review=True,
)
def tool_update_note(svc: Service, path: str, content: str, etag: str) -> dict:
    path = visible_note(svc.notes, path, write=True)
    if suggesting():
        rec = _current(svc, path, etag)
        svc.notes.encode(content)
        return _suggested(
            svc, "edit", path, content=content, base=rec["etag"], base_text=rec["content"]
        )
    return _summary(svc.notes.update(path, content, etag))


@tool(
    "move_note",
    "Move or rename a note (never onto an existing note). Needs the etag read_note gave; "
    "updateLinks rewrites the links of other notes to it.",
    {
        "path": _PATH_ARG,
        "newPath": {**_PATH_ARG, "description": "where the note goes"},
        "etag": _ETAG_ARG,
        "updateLinks": {"type": "boolean", "default": False},
    },
    ("path", "newPath", "etag"),
    title="Move a note",
    read_only=False,
    destructive=True,
    idempotent=True,
    text=write_text,
    output={**WRITE_OUTPUT, "from": _S, "linksUpdated": {"type": "array"}},
    review=True,
)
def tool_move_note(
    svc: Service, path: str, newPath: str, etag: str, updateLinks: bool = False
) -> dict:
    path = visible_note(svc.notes, path, write=True)
    new = visible_note(svc.notes, newPath, write=True)
    if suggesting():
        rec = _current(svc, path, etag)
        if new != path and svc.notes.exists(new):
            raise ApiError(409, "CONFLICT", f"a note already exists at {new}")
        return _suggested(
            svc, "move", path, new_path=new, base=rec["etag"], update_links=updateLinks
        )
    rec = move_and_relink(svc, path, new, etag, updateLinks)
    return {**_summary(rec), **{k: rec[k] for k in ("from", "linksUpdated") if k in rec}}


@tool(
    "delete_note",
    "Delete a note (it goes to the trash, from where the owner can restore it). With an "
    "etag, a note that changed since is not deleted.",
    {"path": _PATH_ARG, "etag": _ETAG_ARG},
    ("path",),
    title="Delete a note",
    read_only=False,
    destructive=True,
    idempotent=True,
    text=write_text,
    output={**WRITE_OUTPUT, "deleted": _B},
    review=True,
)
def tool_delete_note(svc: Service, path: str, etag: str | None = None) -> dict:
    path = visible_note(svc.notes, path, write=True)
    if suggesting():
        rec = _current(svc, path, etag)
        return _suggested(svc, "delete", path, base=rec["etag"], base_text=rec["content"])
    done = svc.notes.delete(path, etag)
    return {"path": done["path"], "deleted": True}


# -- history: what a note was, and going back to it ------------------------------------------

_VERSION_ARG = {
    "type": "string",
    "minLength": 1,
    "maxLength": 100,
    "description": "a version id, as note_history lists it",
}
VERSION_FIELDS = {
    "id": _S,
    "savedAt": _S,
    "size": _I,
    "etag": _S,
    "reason": _S,
    "savedBy": {"type": ["string", "null"]},
    "summary": {"type": ["string", "null"]},
}


def seen_version(svc: Service, path: str, vid: str) -> bytes:
    """Return a version's content when the request's principal sees the path it was saved
    at (read, then checked, as the history API does); 400 for a malformed id, else 404."""
    if not isinstance(vid, str) or not VERSION_ID_RE.match(vid):
        raise bad_request(f"{str(vid)[:80]!r} is not a version id (see note_history)")
    data = svc.history.read(path, vid)
    if not request_principal().sees(svc.history.saved_at(path, vid)):
        raise not_found(f"no version {vid} of {path}")
    return data


def _history_lines(data: dict) -> str:
    lines = [
        f"{v['id']}  {v['savedAt']}  {v['reason']}"
        + (f" by {v['savedBy']}" if v.get("savedBy") else "")
        + (f": {v['summary']}" if v.get("summary") else "")
        for v in data["versions"]
    ]
    return "\n".join(lines) or f"{data['path']} has no earlier versions."


@tool(
    "note_history",
    "A note's earlier versions, newest first: when each was replaced, why (updated, moved, "
    "merged, suggestion...), by whom, and a summary of the change. Compare them with "
    "note_diff; go back with restore_version.",
    {"path": _PATH_ARG, "limit": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20}},
    ("path",),
    title="Note history",
    text=_history_lines,
    output={
        "path": _S,
        "versions": {"type": "array", "items": {"type": "object", "properties": VERSION_FIELDS}},
        "total": _I,
    },
)
def tool_note_history(svc: Service, path: str, limit: int = 20) -> dict:
    path = visible_note(svc.notes, path)
    principal = request_principal()
    versions = svc.history.versions(path, None if principal.whole else principal.sees)
    if not versions and not svc.notes.exists(path):
        raise not_found(f"no note and no history at {path}")
    return {"path": path, "versions": versions[:limit], "total": len(versions)}


def _text_at(svc: Service, path: str, which: str) -> str:
    if which == "current":
        return svc.notes.get(path)["content"]
    return seen_version(svc, path, which).decode("utf-8", "replace")


@tool(
    "note_diff",
    "What changed in a note between two versions, as a unified diff: `from` a version id "
    "(note_history), `to` another or, by default, the note as it is now.",
    {
        "path": _PATH_ARG,
        "from": _VERSION_ARG,
        "to": {**_VERSION_ARG, "description": "a version id, or current (the default)"},
    },
    ("path", "from"),
    title="Compare versions",
    text=lambda d: d["diff"] or "No difference.",
    output={"path": _S, "from": _S, "to": _S, "diff": _S},
    review=True,
)
def tool_note_diff(svc: Service, path: str, to: str = "current", **given) -> dict:
    path = visible_note(svc.notes, path)
    start = given["from"]
    old, new = _text_at(svc, path, start), _text_at(svc, path, to)
    diff = unified_diff(old, new, f"{path}@{start}", f"{path}@{to}")
    return {"path": path, "from": start, "to": to, "diff": diff}


@tool(
    "restore_version",
    "Make an earlier version (note_history) the note's content again; what it replaces "
    "becomes a version itself. Needs the note's etag (read_note): refused if it changed since.",
    {"path": _PATH_ARG, "versionId": _VERSION_ARG, "etag": _ETAG_ARG},
    ("path", "versionId", "etag"),
    title="Restore a version",
    read_only=False,
    destructive=True,
    idempotent=True,
    text=write_text,
    output=WRITE_OUTPUT,
    review=True,
)
def tool_restore_version(svc: Service, path: str, versionId: str, etag: str) -> dict:
    path = visible_note(svc.notes, path, write=True)
    if suggesting():
        rec = _current(svc, path, etag)
        content = seen_version(svc, path, versionId).decode("utf-8", "replace")
        return _suggested(
            svc, "edit", path, content=content, base=rec["etag"], base_text=rec["content"]
        )
    seen_version(svc, path, versionId)
    return _summary(svc.notes.restore_version(path, versionId, etag))


# -- the review card's own tools (suggest mode; hidden from the model) ------------------------

_SUGGESTION_ID_ARG = {
    "type": "string",
    "minLength": 1,
    "maxLength": 64,
    "description": "a suggestion's id",
}


@tool(
    "accept_suggestion",
    "Apply a suggestion (the review card's Accept): an edit is merged with what changed "
    "since it was made; a clash keeps it as a conflict copy.",
    {"id": _SUGGESTION_ID_ARG},
    ("id",),
    title="Accept a suggestion",
    read_only=False,
    destructive=True,
    app_only=True,
    text=lambda d: f"Accepted: {d['note']['path']}" + (" (merged)" if d["merged"] else ""),
    output={
        "suggestion": {"type": "object"},
        "note": {"type": "object", "properties": NOTE_SUMMARY},
        "merged": _B,
    },
)
def tool_accept_suggestion(svc: Service, id: str) -> dict:
    done = accept_suggestion(svc, id)
    return {**done, "note": _summary(done["note"]) if "etag" in done["note"] else done["note"]}


@tool(
    "reject_suggestion",
    "Close a suggestion without applying it (the review card's Reject).",
    {"id": _SUGGESTION_ID_ARG},
    ("id",),
    title="Reject a suggestion",
    read_only=False,
    idempotent=True,
    app_only=True,
    text=lambda d: f"Rejected suggestion {d['id']}.",
    output={"id": _S, "status": _S},
)
def tool_reject_suggestion(svc: Service, id: str) -> dict:
    return reject_suggestion(svc, id)


@tool(
    "search",
    "Search the user's notes; each result's id is a note path to pass to fetch.",
    {"query": _QUERY_ARG},
    ("query",),
    title="Search",
    alias_of="search_notes",
    output={"results": _L},
)
def tool_search(svc: Service, query: str) -> dict:
    folders = request_principal().folders  # a grant searches its reach
    hits = find_notes(svc, Query(query), folders, 10, 0, reach=folders)["results"]
    return {"results": [{"id": p, "title": t, "url": note_url(svc, p)} for p, t, _, _ in hits]}


@tool(
    "fetch",
    "Read a whole note by the id search gave (its path).",
    {"id": {**_PATH_ARG, "description": "a note path, as search gives it"}},
    ("id",),
    title="Fetch",
    alias_of="read_note",
    output={"id": _S, "title": _S, "text": _S, "url": _S, "metadata": {"type": "object"}},
)
def tool_fetch(svc: Service, id: str) -> dict:
    rec = svc.notes.get(visible_note(svc.notes, id))
    return {
        "id": rec["path"],
        "title": rec["title"],
        "text": rec["content"][:MAX_READ_CHARS],
        "url": note_url(svc, rec["path"]),
        "metadata": {k: rec[k] for k in ("etag", "modified", "size")},
    }
