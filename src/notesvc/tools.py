"""The built-in tools MCP clients and the agent may call."""

from __future__ import annotations

import datetime as dt
import urllib.parse

from notesvc.boot import API, bottle
from notesvc.errors import ApiError, bad_request, not_found
from notesvc.grants import granted_tree, request_principal, searched_folders, visible_note
from notesvc.helpers import iso
from notesvc.notes.paths import MAX_PATH_CHARS, NOTES, note_title
from notesvc.plugins import list_tags, move_and_relink
from notesvc.providers.base import tool
from notesvc.search.hybrid import find_notes, related_notes
from notesvc.search.text import MAX_QUERY_CHARS, Query
from notesvc.service import Service

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
)
def tool_list_tags(svc: Service) -> dict:
    return list_tags(svc)


@tool(
    "create_note",
    "Create a note (refused if one exists at that path; missing folders are created).",
    {"path": _PATH_ARG, "content": {"type": "string", "description": "the Markdown text"}},
    ("path", "content"),
    title="Create a note",
    read_only=False,
)
def tool_create_note(svc: Service, path: str, content: str) -> dict:
    return _summary(svc.notes.create(visible_note(svc.notes, path, write=True), content))


@tool(
    "append_to_note",
    "Add text at the end of an existing note, on a new line (a list item: start it with '- ').",
    {"path": _PATH_ARG, "text": {"type": "string", "minLength": 1}},
    ("path", "text"),
    title="Append to a note",
    read_only=False,
)
def tool_append_to_note(svc: Service, path: str, text: str) -> dict:
    path = visible_note(svc.notes, path, write=True)

    def add(old: str) -> str:
        return old + ("\n" if old and not old.endswith("\n") else "") + text.rstrip("\n") + "\n"

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

    svc.notes.rewrite(path, swap)
    return {**_summary(svc.notes.get(path)), "replaced": 1}


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
)
def tool_update_note(svc: Service, path: str, content: str, etag: str) -> dict:
    return _summary(svc.notes.update(visible_note(svc.notes, path, write=True), content, etag))


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
)
def tool_move_note(
    svc: Service, path: str, newPath: str, etag: str, updateLinks: bool = False
) -> dict:
    path = visible_note(svc.notes, path, write=True)  # write on both sides (a read share: 403)
    new = visible_note(svc.notes, newPath, write=True)
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
)
def tool_delete_note(svc: Service, path: str, etag: str | None = None) -> dict:
    done = svc.notes.delete(visible_note(svc.notes, path, write=True), etag)
    return {"path": done["path"], "deleted": True}


@tool(
    "search",
    "Search the user's notes; each result's id is a note path to pass to fetch.",
    {"query": _QUERY_ARG},
    ("query",),
    title="Search",
    alias_of="search_notes",
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
