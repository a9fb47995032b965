"""The route table (its OpenAPI document: http/openapi.py)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from notesvc.boot import bottle
from notesvc.grants import SCOPES
from notesvc.helpers import NOT_BLANK_PATTERN
from notesvc.http.access import (
    approve_oauth,
    authorization_server_metadata,
    claim_device,
    create_pairing,
    create_scoped_key,
    create_share,
    get_addresses,
    get_consent_page,
    get_share_page,
    get_shared,
    get_shared_attachment,
    list_scoped_keys,
    list_shares,
    oauth_consent,
    oauth_register,
    oauth_revoke,
    oauth_token,
    pair_relay_code,
    protected_resource_metadata,
    revoke_scoped_key,
    revoke_share,
)
from notesvc.http.api import (
    MAX_SEQ,
    MAX_WAIT_SECONDS,
    accept_suggestion_route,
    agent_chat,
    agent_status,
    create_note,
    delete_attachment,
    delete_note,
    diff_version,
    get_attachment,
    get_config,
    get_features,
    get_health,
    get_info,
    get_note,
    get_setup,
    get_subtree,
    get_trash_item,
    get_tree,
    get_version,
    issue_token,
    link_client,
    list_attachments,
    list_changes,
    list_notes,
    list_suggestions,
    list_trash,
    list_versions,
    merge_note,
    move_attachment,
    move_note,
    note_related,
    post_attachment,
    purge_trash_item,
    put_attachment,
    reject_suggestion_route,
    restore_trash_item,
    restore_version,
    rotate_api_key,
    search_notes,
    update_note,
    verify_key,
)
from notesvc.http.caldav import get_task
from notesvc.http.capture import get_capture, get_clip_page, post_clip, post_voice
from notesvc.http.feed import create_feed, delete_feed, get_feed, list_feeds
from notesvc.http.integrations import (
    TELEGRAM_TOKEN_RE,
    bind_channel,
    connect_telegram,
    create_channel,
    delete_channel,
    get_channel,
    get_export,
    get_plugin,
    get_web_client,
    link_channel,
    list_channel_providers,
    list_channels,
    list_plugins,
    list_reminders,
    patch_channel,
    post_import,
    receive_webhook,
    security_audit,
    security_config,
    security_recommendations,
    toggle_channel,
    toggle_plugin,
    unlink_channel,
    verify_webhook,
)
from notesvc.http.mcp import mcp_end_session, mcp_endpoint, mcp_stream
from notesvc.http.openapi import get_openapi
from notesvc.http.people import (
    add_person,
    create_person_pairing,
    get_members,
    list_people,
    list_shared_with_me,
    put_members,
    remove_person,
    rename_person,
)
from notesvc.http.route import Route
from notesvc.notes.history import VERSION_ID_RE, json_pattern
from notesvc.notes.paths import (
    ATTACHMENT_FOLDER_SCHEMA,
    ATTACHMENT_PATH_PARAM,
    ATTACHMENT_PATH_SCHEMA,
    FOLDER_NAME_SCHEMA,
    FOLDER_PATH_PARAM,
    FOLDER_PATH_SCHEMA,
    MAX_PATH_CHARS,
    NOTE_PATH_PARAM,
    NOTE_PATH_SCHEMA,
)
from notesvc.notes.trash import TRASH_ID_RE
from notesvc.providers.base import MAX_MESSAGE_CHARS
from notesvc.providers.channels import MAX_CONFIG_CHARS, ChannelProvider, ConfigField
from notesvc.search.text import MAX_QUERY_CHARS
from notesvc.service import Service
from notesvc.web import WEB_ASSETS, web_asset_headers
from notesvc.webclip import MAX_CLIP_HTML_BYTES, MAX_CLIP_IMAGES

# -- route table --------------------------------------------------------------------


def web_asset_route(path: str) -> Route:
    """Return the public route of one of the page's assets (manifest, icons)."""

    def get_asset(svc: Service) -> bytes:
        for name, value in web_asset_headers(path).items():
            bottle.response.set_header(name, value)
        return WEB_ASSETS[path][1]()

    get_asset.__name__ = "get_" + re.sub(r"\W+", "_", path.strip("/"))
    media = WEB_ASSETS[path][0]
    return Route("GET", path, get_asset, public=True, api=False, tag="pages", media=media)


def share_target_without_worker(svc: Service) -> bytes:
    """POST /share-target reaches the server only where no service worker took it (the
    option "Keep notes on this device" is off): the page is sent back to say so. The
    shared text is not kept: this request carries no key."""
    bottle.response.status = 303
    bottle.response.set_header("Location", "./?share=off")
    bottle.response.set_header("Cache-Control", "no-store")
    return b""


def _obj(required: Iterable[str] = (), **props: dict) -> dict:
    return {"type": "object", "required": list(required), "properties": props}


_STR = {"type": "string"}
_NOTE_PATH, _FOLDER_PATH = NOTE_PATH_SCHEMA, FOLDER_PATH_SCHEMA
_HOME = {  # a folder below notes/, never notes/ itself
    **_FOLDER_PATH,
    "minLength": 7,
    "pattern": _FOLDER_PATH["pattern"].replace(")*/?$", ")+/?$"),
    "examples": ["notes/Ann"],
}
_SUBFOLDER_PARAM = {
    **FOLDER_PATH_PARAM,
    "pattern": FOLDER_PATH_PARAM["pattern"].replace(")*/?$", ")+/?$"),
}
_VERSION_ID = {
    "type": "string",
    "pattern": json_pattern(VERSION_ID_RE),
    "description": "from .../versions",
}
_TRASH_ID = {"type": "string", "pattern": json_pattern(TRASH_ID_RE), "description": "from /trash"}
_SUGGESTION_ID = {
    "type": "string",
    "minLength": 1,
    "maxLength": 64,
    "description": "from /suggestions",
}


def _int(lo: int, hi: int, default: int) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi, "default": default}


_DEPTH = {"type": "integer", "minimum": 1, "maximum": 64}


def _channel_body(svc: Service) -> dict:
    """Return the schema of a channel's create body: one shape per registered provider."""

    def prop(f: ConfigField) -> dict:
        if f.kind == "list":
            return {"type": "array", "items": {"type": ["string", "integer"]}, "maxItems": 1000}
        if f.kind == "boolean":
            return {"type": "boolean"}
        if f.kind == "choice":
            return {"enum": list(f.choices)}
        if f.kind == "folder":
            return {**FOLDER_PATH_SCHEMA, "maxLength": MAX_CONFIG_CHARS}
        # printable and single-line on the server; said here as printable ASCII, and a
        # required one not blank
        return {
            "type": "string",
            "minLength": int(f.required),
            "maxLength": MAX_CONFIG_CHARS,
            "pattern": "^[ -~]*[!-~][ -~]*$" if f.required else "^[ -~]*$",
        }

    def config(provider: ChannelProvider) -> dict:
        props = {f.name: prop(f) for f in provider.fields}
        required = [f.name for f in provider.fields if f.required]
        return {**_obj(required, **props), "additionalProperties": False}

    return {
        "oneOf": [
            _obj(
                ["provider", "config"] if any(f.required for f in p.fields) else ["provider"],
                provider={"const": name},
                name={"type": "string", "maxLength": 100},
                config=config(p),
            )
            for name, p in sorted(svc.channel_providers.items())
        ]
    }


ROUTES = (
    Route("GET", "/health", get_health, public=True, summary="Liveness and version"),
    Route(
        "GET",
        "/system/setup",
        get_setup,
        public=True,
        summary="Setup and pairing payload (the full key only where setupHere.allowed: this "
        "machine or its home network, during the setup window)",
        secret=True,
    ),
    Route(
        "GET",
        "/system/features",
        get_features,
        public=True,
        summary="What this server offers (history, attachments, changes) and its version; "
        "ETag, 304 to If-None-Match: read at start instead of this document",
    ),
    Route("GET", "/system/info", get_info, summary="Version, uptime, note counts", scope="admin"),
    Route(
        "GET",
        "/system/config",
        get_config,
        summary="Non-secret runtime configuration",
        scope="admin",
    ),
    Route(
        "GET",
        "/openapi.json",
        get_openapi,
        public=True,
        summary="This document",
        enveloped=False,
    ),
    Route("POST", "/auth/verify", verify_key, summary="Check a key", tag="auth", scope="read"),
    Route(
        "POST",
        "/auth/link",
        link_client,
        summary="Link a client; completes setup (before setup: 403 unless from this machine "
        "or its home network)",
        body=_obj(clientName={"type": "string", "maxLength": 100}),
        tag="auth",
        scope="admin",
    ),
    Route(
        "POST",
        "/auth/rotate",
        rotate_api_key,
        summary="New key, shown once",
        tag="auth",
        key_only=True,
        scope="admin",
        secret=True,
    ),
    Route(
        "POST",
        "/auth/token",
        issue_token,
        summary="A one-hour JWT (jwt mode)",
        tag="auth",
        key_only=True,
        scope="admin",
        secret=True,
    ),
    Route(
        "POST",
        "/notes",
        create_note,
        summary="Create a note (409 if it exists); without a path, named from its title in "
        "`folder` (notes/inbox by default)",
        body=_obj(["content"], path=_NOTE_PATH, content=_STR, folder=_FOLDER_PATH),
        idempotent=True,
        status=201,
        tag="notes",
        scope="write",
    ),
    Route(
        "GET",
        "/notes",
        list_notes,
        summary="List notes by path, or newest first; with titles, previews and tags",
        params={
            "folder": _FOLDER_PATH,
            "limit": _int(1, 1000, 100),
            "offset": _int(0, 10**9, 0),
            "sort": {"enum": ["path", "modified"], "default": "path"},
            "fields": {
                "type": "string",
                "pattern": "^((title|preview|modified|tags)(,(title|preview|modified|tags))*)?$",
            },
        },
        tag="notes",
        scope="read",
    ),
    # before GET /notes/<path:path>, which would take ".../versions" as part of a path
    Route(
        "GET",
        "/notes/<path:path>/related",
        note_related,
        summary="Notes near this one in meaning (empty while embeddings are off)",
        params={"path": NOTE_PATH_PARAM, "limit": _int(1, 50, 10)},
        tag="search",
        scope="read",
    ),
    Route(
        "GET",
        "/notes/<path:path>/versions",
        list_versions,
        summary="A note's versions, newest first (also of a deleted note), and `created`: "
        "when and by whom it was made, {at, by}, while the change journal holds that (else null)",
        params={"path": NOTE_PATH_PARAM, "limit": _int(1, 1000, 100), "offset": _int(0, 10**9, 0)},
        tag="history",
        scope="read",
    ),
    Route(
        "GET",
        "/notes/<path:path>/versions/<version_id>",
        get_version,
        summary="One version with its content",
        params={"path": NOTE_PATH_PARAM, "version_id": _VERSION_ID},
        tag="history",
        scope="read",
    ),
    Route(
        "GET",
        "/notes/<path:path>/versions/<version_id>/diff",
        diff_version,
        summary="Unified diff from a version to another one or to the current note",
        params={
            "path": NOTE_PATH_PARAM,
            "version_id": _VERSION_ID,
            "against": {
                "type": "string",
                "pattern": f"^(current|{json_pattern(VERSION_ID_RE)[1:-1]})$",
                "default": "current",
            },
        },
        tag="history",
        scope="read",
    ),
    Route(
        "POST",
        "/notes/<path:path>/versions/<version_id>/restore",
        restore_version,
        summary="Make a version the note's content again (If-Match honoured; recreates a "
        "deleted note); the replaced content becomes a version",
        params={"path": NOTE_PATH_PARAM, "version_id": _VERSION_ID},
        tag="history",
        scope="write",
    ),
    Route(
        "GET",
        "/notes/<path:path>",
        get_note,
        summary="Read a note",
        params={"path": NOTE_PATH_PARAM},
        tag="notes",
        scope="read",
    ),
    Route(
        "PUT",
        "/notes/<path:path>",
        update_note,
        summary="Replace a note's content (If-Match honoured)",
        body=_obj(
            ["content"],
            content=_STR,
            path={
                **_NOTE_PATH,
                "description": "optional, and then the note's own path: PUT never moves "
                "a note (PATCH .../move does)",
            },
        ),
        params={"path": NOTE_PATH_PARAM},
        tag="notes",
        scope="write",
        idempotent=True,
    ),
    Route(
        "POST",
        "/notes/<path:path>/merge",
        merge_note,
        summary="Save an edit made from version `base`: merged three ways with what changed "
        "since; 409 keeps it as a conflict copy",
        body=_obj(
            ["base", "content"],
            base={**_STR, "minLength": 1, "maxLength": 100},
            content=_STR,
            clientName={**_STR, "maxLength": 100},
        ),
        params={"path": NOTE_PATH_PARAM},
        tag="notes",
        scope="write",
        idempotent=True,
    ),
    Route(
        "PATCH",
        "/notes/<path:path>/move",
        move_note,
        summary="Move or rename a note; never overwrites",
        body=_obj(["path"], path=_NOTE_PATH, updateLinks={"type": "boolean"}),
        params={"path": NOTE_PATH_PARAM},
        tag="notes",
        scope="write",
    ),
    Route(
        "DELETE",
        "/notes/<path:path>",
        delete_note,
        summary="Move to trash",
        params={"path": NOTE_PATH_PARAM},
        tag="notes",
        scope="write",
    ),
    Route(
        "GET",
        "/search",
        search_notes,
        summary='Full-text search (BM25): words, "phrases", prefix*, -exclude, OR',
        params={
            "q": {
                "type": "string",
                "minLength": 1,
                "maxLength": MAX_QUERY_CHARS,
                "description": 'words (all must match), "exact phrase", prefix*, -word, '
                "a OR b; at least one word of letters or digits to search for",
            },
            "limit": _int(1, 100, 20),
            "offset": _int(0, 10000, 0),
            "folder": _FOLDER_PATH,
            "mode": {
                "type": "string",
                "enum": ["hybrid", "semantic", "keyword"],
                "description": "hybrid (the default when embeddings are on), semantic, or "
                "keyword (the default otherwise); phrases and prefix* stay keyword",
            },
        },
        tag="search",
        scope="read",
    ),
    Route(
        "POST",
        "/agent/chat",
        agent_chat,
        summary="Ask the agent about your notes",
        body=lambda svc: _obj(
            ["message"],
            message={
                "type": "string",
                "minLength": 1,
                "maxLength": MAX_MESSAGE_CHARS,
                "pattern": NOT_BLANK_PATTERN,
            },
            notePath=_NOTE_PATH,
            channel={"enum": sorted(svc.channel_providers)},  # this app's providers
        ),
        tag="agent",
        scope="read",
    ),
    Route(
        "GET",
        "/agent/status",
        agent_status,
        summary="Agent provider and model",
        tag="agent",
        scope="read",
    ),
    Route(
        "POST",
        "/mcp",
        mcp_endpoint,
        summary="MCP (Model Context Protocol) server: the tools over JSON-RPC 2.0; the key "
        "also as Authorization: Bearer or X-API-Key",
        body={
            "type": "object",
            "required": ["jsonrpc", "method"],
            "properties": {
                "jsonrpc": {"const": "2.0"},
                "id": {"type": ["string", "integer"]},
                "method": {"type": "string", "minLength": 1},
                "params": {"type": "object"},
            },
        },
        tag="mcp",
        enveloped=False,
        jsonrpc=True,
        scope="read",  # each write tool needs a grant that may write
    ),
    Route(
        "GET",
        "/mcp",
        mcp_stream,
        summary="MCP: a session's stream of notifications (Server-Sent Events; needs "
        "Mcp-Session-Id from initialize and Accept: text/event-stream; 405 without a "
        "session or through the relay's link, 429 over the cap of open streams)",
        tag="mcp",
        media="text/event-stream",
        enveloped=False,
        jsonrpc=True,
        scope="read",
    ),
    Route(
        "DELETE",
        "/mcp",
        mcp_end_session,
        summary="MCP: end a session (Mcp-Session-Id); 405 without one",
        status=204,
        tag="mcp",
        enveloped=False,
        jsonrpc=True,
        scope="read",
    ),
    Route(
        "GET",
        "/attachments",
        list_attachments,
        summary="List attachments by path",
        params={
            "folder": ATTACHMENT_FOLDER_SCHEMA,
            "limit": _int(1, 1000, 100),
            "offset": _int(0, 10**9, 0),
        },
        tag="attachments",
        scope="read",
    ),
    Route(
        "POST",
        "/attachments",
        post_attachment,
        summary="Upload a file (multipart: path, file); never overwrites: a taken name gets -2",
        body=_obj(
            ["path", "file"],
            path=ATTACHMENT_PATH_SCHEMA,
            file={"type": "string", "format": "binary"},
        ),
        body_media="multipart/form-data",
        status=201,
        tag="attachments",
        scope="write",
    ),
    Route(
        "GET",
        "/attachments/<path:path>",
        get_attachment,
        summary="The file's bytes (ETag, Range; HTML and SVG only as downloads)",
        params={"path": ATTACHMENT_PATH_PARAM},
        media="*/*",  # the type of its extension (ATTACHMENT_TYPES)
        enveloped=False,
        tag="attachments",
        scope="read",
    ),
    Route(
        "PUT",
        "/attachments/<path:path>",
        put_attachment,
        summary="Upload the raw bytes: 201 created, 200 replaced (If-Match, If-None-Match: *)",
        body={"type": "string", "format": "binary"},
        body_media="application/octet-stream",
        params={"path": ATTACHMENT_PATH_PARAM},
        status=201,
        tag="attachments",
        scope="write",
        idempotent=True,
    ),
    Route(
        "POST",
        "/import",
        post_import,
        summary="Import notes from Keep, Evernote, Notion, Obsidian, Joplin or a zip of Markdown "
        "(multipart: file, into, dryRun; or the raw zip/.enex/.jex); never overwrites",
        body=_obj(
            ["file"],
            file={"type": "string", "format": "binary"},
            into={**_STR, "maxLength": 2048},
            dryRun={"type": "boolean"},
        ),
        body_media="multipart/form-data",
        params={"into": {**_STR, "maxLength": 2048}, "dryRun": {"type": "boolean"}},
        status=201,
        tag="notes",
        scope="write",
    ),
    Route(
        "GET",
        "/export.zip",
        get_export,
        summary="A zip of every note, attachment and file the key sees, with a manifest",
        media="application/zip",
        enveloped=False,
        tag="notes",
        scope="read",
    ),
    Route(
        "PATCH",
        "/attachments/<path:path>/move",
        move_attachment,
        summary="Move or rename an attachment (never overwrites); updateLinks rewrites links",
        body=_obj(["path"], path=ATTACHMENT_PATH_SCHEMA, updateLinks={"type": "boolean"}),
        params={"path": ATTACHMENT_PATH_PARAM},
        tag="attachments",
        scope="write",
    ),
    Route(
        "DELETE",
        "/attachments/<path:path>",
        delete_attachment,
        summary="Move an attachment to the trash",
        params={"path": ATTACHMENT_PATH_PARAM},
        tag="attachments",
        scope="write",
    ),
    Route(
        "GET",
        "/reminders",
        list_reminders,
        summary="Reminders not sent yet (⏰ YYYY-MM-DD HH:MM lines, remind: in front matter)",
        params={"limit": _int(1, 1000, 100), "offset": _int(0, 10**9, 0)},
        tag="reminders",
        scope="read",
    ),
    Route(
        "GET",
        "/channels/providers",
        list_channel_providers,
        summary="Channel providers and their config fields",
        tag="channels",
        scope="admin",
    ),
    Route(
        "GET",
        "/channels",
        list_channels,
        summary="Channels (secrets redacted); a person's: those a chat of theirs may join, "
        "with their own chats only",
        tag="channels",
        scope="admin",
        people=True,
    ),
    Route(
        "POST",
        "/channels",
        create_channel,
        summary="Create a channel (the only answer showing its secret)",
        body=_channel_body,
        status=201,
        tag="channels",
        scope="admin",
        secret=True,
    ),
    Route(
        "POST",
        "/channels/webhook/<provider>",
        receive_webhook,
        public=True,
        summary="Inbound messages (shared secret in X-Service-Channel-Secret or ?secret=)",
        body={"type": "object"},
        tag="channels",
    ),
    Route(
        "POST",
        "/channels/<channel_id>/toggle",
        toggle_channel,
        summary="Switch on/off",
        tag="channels",
        scope="admin",
    ),
    Route(
        "POST",
        "/channels/connect/telegram",
        connect_telegram,
        summary="Connect a Telegram bot: its token checked (getMe), then a one-time code "
        "that connects the first chat to send it",
        body=_obj(
            ["botToken"],
            botToken={**_STR, "pattern": json_pattern(TELEGRAM_TOKEN_RE)},
            name={**_STR, "maxLength": 100},
        ),
        status=201,
        tag="channels",
        scope="admin",
        secret=True,
    ),
    Route(
        "POST",
        "/channels/<channel_id>/bind",
        bind_channel,
        summary="A new one-time code: the next Telegram chat to send it becomes the allowed one",
        tag="channels",
        scope="admin",
        secret=True,
    ),
    Route(
        "POST",
        "/channels/<channel_id>/link",
        link_channel,
        summary="A person's one-time code (10 minutes): the chat that sends it to the bot "
        "becomes theirs (their reach, their places)",
        status=201,
        tag="channels",
        scope="write",
        secret=True,
    ),
    Route(
        "DELETE",
        "/channels/<channel_id>/link",
        unlink_channel,
        summary="A person's chats leave the channel (and their code that waits ends)",
        tag="channels",
        scope="write",
    ),
    Route(
        "DELETE",
        "/channels/<channel_id>",
        delete_channel,
        summary="Remove",
        tag="channels",
        scope="admin",
    ),
    Route(
        "GET",
        "/channels/<channel_id>",
        get_channel,
        summary="One channel (redacted) with the senders its allowlist refused lately",
        tag="channels",
        scope="admin",
    ),
    Route(
        "PATCH",
        "/channels/<channel_id>",
        patch_channel,
        summary="Change a channel's name or config keys (validated as on create)",
        body={
            "type": "object",
            "minProperties": 1,
            "additionalProperties": False,
            "properties": {
                "name": {**_STR, "minLength": 1, "maxLength": 100, "pattern": NOT_BLANK_PATTERN},
                "config": {"type": "object"},
            },
        },
        tag="channels",
        scope="admin",
    ),
    Route("GET", "/plugins", list_plugins, summary="Plugins", tag="plugins", scope="read"),
    Route(
        "GET",
        "/plugins/<name>",
        get_plugin,
        summary="One plugin (and its page)",
        tag="plugins",
        scope="read",
    ),
    Route(
        "POST",
        "/plugins/<name>/toggle",
        toggle_plugin,
        summary="Switch on/off",
        tag="plugins",
        scope="admin",
    ),
    Route(
        "GET",
        "/security/audit",
        security_audit,
        summary="Scored audit",
        tag="security",
        scope="admin",
    ),
    Route(
        "GET",
        "/security/config",
        security_config,
        summary="Settings in force",
        tag="security",
        scope="admin",
    ),
    Route(
        "GET",
        "/security/recommendations",
        security_recommendations,
        summary="What to fix, most severe first",
        tag="security",
        scope="admin",
    ),
    Route(
        "GET",
        "/folders/tree",
        get_tree,
        summary="Folder tree from the root (`depth`: levels listed; deeper folders get `count`)",
        params={"depth": _DEPTH},
        tag="folders",
        scope="read",
    ),
    Route(
        "GET",
        "/trash",
        list_trash,
        summary="Deleted notes and attachments, the most recent first",
        params={"limit": _int(1, 1000, 100), "offset": _int(0, 10**9, 0)},
        tag="trash",
        scope="read",
    ),
    Route(
        "GET",
        "/trash/<item_id>",
        get_trash_item,
        summary="One trashed item (a note's content included)",
        params={"item_id": _TRASH_ID},
        tag="trash",
        scope="read",
    ),
    Route(
        "POST",
        "/trash/<item_id>/restore",
        restore_trash_item,
        summary="Put an item back, at its path or `path` (409 if taken); history comes along",
        body=_obj(
            path={
                "type": "string",
                "maxLength": MAX_PATH_CHARS,
                "description": "where to restore it: a note path, or attachments/... for an "
                "attachment (default: where it was)",
            }
        ),
        params={"item_id": _TRASH_ID},
        tag="trash",
        scope="write",
    ),
    Route(
        "DELETE",
        "/trash/<item_id>",
        purge_trash_item,
        summary="Delete an item for good",
        params={"item_id": _TRASH_ID},
        tag="trash",
        scope="admin",  # purging for good: the owner's alone
    ),
    Route(
        "GET",
        "/suggestions",
        list_suggestions,
        summary="An assistant's suggested edits waiting for approval (SERVICE_MCP_WRITE or "
        "SERVICE_AGENT_WRITE=suggest), newest first, in the caller's reach",
        params={"limit": _int(1, 200, 50), "offset": _int(0, 10**6, 0)},
        tag="suggestions",
        scope="read",
    ),
    Route(
        "POST",
        "/suggestions/<suggestion_id>/accept",
        accept_suggestion_route,
        summary="Apply a suggestion: an edit merged three ways with what changed since (409 "
        "CONFLICT with conflictPath: kept as a conflict copy, closed); a move or delete only "
        "while the note is its base (else 409, still open); 404 when not open",
        params={"suggestion_id": _SUGGESTION_ID},
        tag="suggestions",
        scope="write",
    ),
    Route(
        "POST",
        "/suggestions/<suggestion_id>/reject",
        reject_suggestion_route,
        summary="Close a suggestion without applying it; 404 when not open",
        params={"suggestion_id": _SUGGESTION_ID},
        tag="suggestions",
        scope="write",
    ),
    Route(
        "GET",
        "/changes",
        list_changes,
        summary="The change feed: changes after `since`, or a wait of up to `wait` s for the "
        "next (410 GONE with resetRequired when the journal no longer has `since`)",
        params={
            # `latest`: no changes, only the cursor to follow from (a client's first read)
            "since": {"anyOf": [_int(0, MAX_SEQ, 0), {"type": "string", "enum": ["latest"]}]},
            "wait": _int(0, MAX_WAIT_SECONDS, 0),
            "limit": _int(1, 1000, 100),
        },
        tag="changes",
        scope="read",
    ),
    Route(
        "GET",
        "/folders/tree/<path:path>",
        get_subtree,
        summary="Subtree",
        params={"path": FOLDER_PATH_PARAM, "depth": _DEPTH},
        tag="folders",
        scope="read",
    ),
    Route(
        "POST",
        "/auth/devices/pairings",
        create_pairing,
        summary="Pair a device: a one-time secret (its link and QR code) for a device key",
        body={
            **_obj(
                [],
                name={**_STR, "maxLength": 100},
                scope={"enum": list(SCOPES)},
                folder=_FOLDER_PATH,
            ),
            # an admin device sees every note: it takes no folder (400 otherwise)
            "if": {"required": ["scope"], "properties": {"scope": {"const": "admin"}}},
            "then": {"not": {"required": ["folder"]}},
        },
        status=201,
        tag="auth",
        scope="admin",
        people=True,
        secret=True,
    ),
    Route(
        "GET",
        "/auth/devices/addresses",
        get_addresses,
        summary="Where a phone (the link Add a device draws) and an AI assistant (the MCP "
        "URL; mcpVia relay, public, home or page) reach this server",
        tag="auth",
        scope="admin",
        people=True,
    ),
    Route(
        "POST",
        "/auth/devices/claim",
        claim_device,
        public=True,
        summary="Claim a pairing's secret (from the link's fragment) for a device key, once",
        body=_obj(
            ["secret"],
            secret={**_STR, "minLength": 1, "maxLength": 64},
            deviceName={**_STR, "maxLength": 100},
        ),
        status=201,
        tag="auth",
        secret=True,
    ),
    Route(
        "POST",
        "/auth/keys",
        create_scoped_key,
        summary="Create a scoped key (read or write, optionally one folder); shown once",
        body=_obj(
            ["name", "scope"],
            name={
                **_STR,
                "minLength": 1,
                "maxLength": 100,
                "pattern": NOT_BLANK_PATTERN,
                "description": "printable text",
            },
            scope={"enum": ["read", "write"]},
            folder=_FOLDER_PATH,
            expiresInDays={"type": "integer", "minimum": 1, "maximum": 3650},
        ),
        status=201,
        tag="grants",
        scope="admin",
        people=True,
        secret=True,
    ),
    Route(
        "GET",
        "/auth/keys",
        list_scoped_keys,
        summary="Scoped keys and OAuth grants (no secrets)",
        tag="grants",
        scope="admin",
        people=True,
    ),
    Route(
        "DELETE",
        "/auth/keys/<grant_id>",
        revoke_scoped_key,
        summary="Revoke a scoped key, a device or an OAuth grant, at once (with the pairings "
        "it made; cascade=true: also the grants it made)",
        params={"cascade": {"type": "boolean"}},
        tag="grants",
        scope="admin",
        people=True,
    ),
    Route(
        "POST",
        "/shares",
        create_share,
        summary="Share one note read-only by a link that expires",
        body=_obj(
            ["path"],
            path=_NOTE_PATH,
            expiresInDays={"type": "integer", "minimum": 1, "maximum": 365, "default": 7},
        ),
        status=201,
        tag="grants",
        scope="write",
        secret=True,
    ),
    Route(
        "GET",
        "/shares",
        list_shares,
        summary="Live share links (a grant sees its own, the API key all)",
        tag="grants",
        scope="read",
    ),
    Route(
        "DELETE",
        "/shares/<share_id>",
        revoke_share,
        summary="Revoke a share link",
        tag="grants",
        scope="write",
    ),
    Route(
        "GET",
        "/shared/<token>",
        get_shared,
        public=True,
        summary="A shared note (rate-limited per address) and the attachments it links",
        tag="grants",
    ),
    Route(
        "GET",
        "/shared/<token>/attachments/<path:path>",
        get_shared_attachment,
        public=True,
        summary="An attachment the shared note links (only those)",
        params={"path": ATTACHMENT_PATH_PARAM},
        tag="grants",
        media="application/octet-stream",
        enveloped=False,
    ),
    Route(
        "GET",
        "/tasks/<uid>",
        get_task,
        summary="Where a task line is: {uid, path, line, summary, done} (the CalDAV UID)",
        tag="notes",
        scope="read",
    ),
    Route(
        "POST",
        "/auth/feeds",
        create_feed,
        summary="A read-only calendar feed of the tasks: its URL (with its secret) once, and "
        "homeOnly (the URL names a host only this machine or its network reaches)",
        body=_obj(["name"], name={**_STR, "minLength": 1, "maxLength": 100}, folder=_FOLDER_PATH),
        status=201,
        tag="grants",
        scope="admin",
        people=True,
        secret=True,
    ),
    Route(
        "GET",
        "/auth/feeds",
        list_feeds,
        summary="Calendar feeds",
        tag="grants",
        scope="admin",
        people=True,
    ),
    Route(
        "DELETE",
        "/auth/feeds/<feed_id>",
        delete_feed,
        summary="Delete a calendar feed: its URL stops working",
        tag="grants",
        scope="admin",
        people=True,
    ),
    Route(
        "GET",
        "/ics/<name>",
        get_feed,
        public=True,
        api=False,
        summary="A calendar feed: the tasks as iCalendar (rate-limited per address)",
        tag="grants",
        media="text/calendar",
        enveloped=False,
    ),
    Route(
        "GET",
        "/oauth/consent",
        oauth_consent,
        public=True,
        summary="What the consent page shows for an OAuth authorisation request",
        params={
            "client_id": {**_STR, "minLength": 1, "maxLength": 2000},
            "redirect_uri": {**_STR, "minLength": 1, "maxLength": 2000},
            "response_type": {"enum": ["code"]},
            "state": {**_STR, "maxLength": 1024},
            "code_challenge": {**_STR, "pattern": "^[A-Za-z0-9_-]{43}$"},
            "code_challenge_method": {"enum": ["S256"]},
            "scope": _STR,
            "resource": _STR,
        },
        tag="grants",
    ),
    Route(
        "POST",
        "/oauth/approve",
        approve_oauth,
        summary="The owner or a person approves an OAuth request: the redirect with its code",
        body=_obj(
            ["clientId", "redirectUri", "codeChallenge", "scope"],
            clientId={**_STR, "minLength": 1, "maxLength": 2000},
            redirectUri={**_STR, "minLength": 1, "maxLength": 2000},
            state={**_STR, "maxLength": 1024},
            codeChallenge={**_STR, "pattern": "^[A-Za-z0-9_-]{43}$"},
            scope={"enum": ["notes:read", "notes:read notes:write"]},
            resource=_STR,
            folder=_FOLDER_PATH,
        ),
        tag="grants",
        scope="admin",
        people=True,
        secret=True,  # the authorisation code, beside the client's own `state`
    ),
    Route(
        "POST",
        "/people",
        add_person,
        summary="Add a person (the owner): their home folder, and a pairing for their first "
        "device, shown once",
        body=_obj(
            ["name"],
            name=FOLDER_NAME_SCHEMA,
            home=_HOME,
        ),
        status=201,
        tag="people",
        scope="admin",
        secret=True,
    ),
    Route(
        "GET",
        "/people",
        list_people,
        summary="The people of this server, with their devices",
        tag="people",
        scope="admin",
    ),
    Route(
        "PATCH",
        "/people/<person_id>",
        rename_person,
        summary="Rename a person (their home keeps its name)",
        body=_obj(["name"], name=FOLDER_NAME_SCHEMA),
        tag="people",
        scope="admin",
    ),
    Route(
        "DELETE",
        "/people/<person_id>",
        remove_person,
        summary="Remove a person: every device, key, connector, feed, share link, pairing "
        "and chat link they hold ends at once; their notes stay",
        tag="people",
        scope="admin",
    ),
    Route(
        "POST",
        "/people/<person_id>/pairings",
        create_person_pairing,
        summary="A pairing for one more device of a person, in their reach; shown once",
        body=_obj(
            [],
            name={**_STR, "maxLength": 100},
            scope={"enum": list(SCOPES)},
            folder=_FOLDER_PATH,
        ),
        status=201,
        tag="people",
        scope="admin",
        secret=True,
    ),
    Route(
        "GET",
        "/folders/<path:path>/members",
        get_members,
        summary="Who a folder is shared with: its own members, then those of the folders "
        "above it (inherited)",
        params={"path": _SUBFOLDER_PARAM},
        tag="people",
        scope="read",
    ),
    Route(
        "PUT",
        "/folders/<path:path>/members",
        put_members,
        summary="Share a folder: replace its members (the owner any folder, a person one of "
        "their home)",
        params={"path": _SUBFOLDER_PARAM},
        body=_obj(
            ["members"],
            members={
                "type": "array",
                "maxItems": 50,
                "items": _obj(["person"], person=_STR, scope={"enum": ["read", "write"]}),
            },
        ),
        tag="people",
        scope="write",
    ),
    Route(
        "GET",
        "/shared",
        list_shared_with_me,
        summary="The folders shared with the person asking, with who shared them",
        tag="people",
        scope="read",
    ),
    Route(
        "POST",
        "/capture/clip",
        post_clip,
        summary="Clip a web page as the browser rendered it: Markdown, its images attached; "
        "the same URL again updates its note (`updated`) unless `new`",
        body={
            **_obj(
                ["url"],
                url={
                    **_STR,
                    "minLength": 1,
                    "maxLength": 4096,
                    "pattern": "^[Hh][Tt][Tt][Pp][Ss]?://[^/?#]",
                },
                title={**_STR, "maxLength": 1000},
                html={**_STR, "maxLength": MAX_CLIP_HTML_BYTES},
                selection={**_STR, "maxLength": MAX_CLIP_HTML_BYTES},
                images={
                    "type": "array",
                    "maxItems": MAX_CLIP_IMAGES,
                    "items": _obj(
                        ["src"],
                        src={**_STR, "maxLength": 8192},
                        data={**_STR, "description": "the image's bytes, base64"},
                        type=_STR,
                        path={**ATTACHMENT_PATH_SCHEMA, "description": "an image uploaded first"},
                    ),
                },
                folder=_FOLDER_PATH,
                new={"type": "boolean"},
            ),
            "additionalProperties": False,
            "anyOf": [{"required": ["html"]}, {"required": ["selection"]}],
        },
        status=201,
        tag="capture",
        scope="write",
        idempotent=True,
    ),
    Route(
        "POST",
        "/capture/voice",
        post_voice,
        summary="A voice note: the recording's bytes kept as an attachment, a note with it and "
        "its transcript (SERVICE_TRANSCRIBE_URL)",
        body={"type": "string", "format": "binary"},
        body_media="audio/webm",
        params={"folder": FOLDER_PATH_SCHEMA},
        status=201,
        tag="capture",
        scope="write",
        idempotent=True,
    ),
    Route(
        "GET",
        "/capture",
        get_capture,
        summary="What Record needs (transcription on, an HTTPS address) and how far the reader "
        "of PDFs and images got",
        tag="capture",
        scope="read",
    ),
    Route("GET", "/clip", get_clip_page, public=True, api=False, tag="pages", media="text/html"),
    Route("GET", "/relay/v1/pair/<code>", pair_relay_code, public=True, api=False, tag="relay"),
    Route("GET", "/", get_web_client, public=True, api=False, tag="pages", media="text/html"),
    Route(
        "GET", "/s/<token>", get_share_page, public=True, api=False, tag="pages", media="text/html"
    ),
    Route(
        "GET",
        "/oauth/authorize",
        get_consent_page,
        public=True,
        api=False,
        tag="pages",
        media="text/html",
    ),
    Route(
        "GET",
        "/.well-known/oauth-protected-resource",
        protected_resource_metadata,
        public=True,
        api=False,
        tag="oauth",
        enveloped=False,
    ),
    Route(
        "GET",
        "/.well-known/oauth-protected-resource/api/v1/mcp",
        protected_resource_metadata,
        public=True,
        api=False,
        tag="oauth",
        enveloped=False,
    ),
    Route(
        "GET",
        "/.well-known/oauth-authorization-server",
        authorization_server_metadata,
        public=True,
        api=False,
        tag="oauth",
        enveloped=False,
    ),
    Route(
        "GET",
        "/.well-known/openid-configuration",
        authorization_server_metadata,
        public=True,
        api=False,
        tag="oauth",
        enveloped=False,
    ),
    Route(
        "POST",
        "/oauth/token",
        oauth_token,
        public=True,
        api=False,
        tag="oauth",
        enveloped=False,
        secret=True,
    ),
    Route(
        "POST",
        "/oauth/register",
        oauth_register,
        public=True,
        api=False,
        tag="oauth",
        enveloped=False,
    ),
    Route(
        "POST", "/oauth/revoke", oauth_revoke, public=True, api=False, tag="oauth", enveloped=False
    ),
    *(web_asset_route(path) for path in WEB_ASSETS),
    Route(
        "POST",
        "/share-target",
        share_target_without_worker,
        summary="The share sheet without the offline worker: 303 to the page, which says so",
        status=303,
        media="text/plain",
        public=True,
        api=False,
        tag="pages",
        enveloped=False,
    ),
)


def channel_routes(providers: Mapping[str, ChannelProvider]) -> tuple:
    """Return GET /channels/webhook/<name> for each provider that declares a check."""
    routes = []
    for name, provider in providers.items():
        if provider.verify is None:
            continue

        def verify(svc: Service, _name: str = name):
            return verify_webhook(svc, _name)

        verify.__name__ = re.sub(r"\W+", "_", f"verify_{name}_webhook")
        routes.append(
            Route(
                "GET",
                f"/channels/webhook/{name}",
                verify,
                public=True,
                summary=f"{name}'s subscription check",
                params=dict.fromkeys(provider.verify_params, _STR),
                tag="channels",
                media="text/plain",
                enveloped=False,
            )
        )
    return tuple(routes)
