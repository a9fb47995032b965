"""Handlers of the notes API: system, auth, notes, attachments, folders, history, search.

And the agent's two routes (/agent/chat, /agent/status).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import platform
import secrets
import threading
import time
import urllib.parse
from typing import Any, Callable

from notesvc.auth import JWT_LIFETIME, jwt_encode, rotate_key
from notesvc.boot import API, KEY_HEADER, KEY_PREFIX, __version__, bottle, log
from notesvc.errors import JSON_TYPE, ApiError, bad_request, gone, not_found, ok, to_json
from notesvc.grants import (
    Principal,
    clean_name,
    granted_tree,
    request_principal,
    searched_folders,
    visible_attachment,
    visible_folders,
    visible_note,
    visible_note_file,
    writable_folder,
)
from notesvc.helpers import (
    BODY_CHUNK,
    MultipartReader,
    field,
    is_blank,
    is_home_network,
    iso,
    lan_address,
    local_time,
    minutes_text,
    query_int,
    query_str,
    read_json,
    redact_url,
    request_body_reader,
    request_header,
    setup_client_ip,
    time_zone,
    too_large,
    utcnow,
)
from notesvc.http.route import conditional_download, file_chunks, none_match
from notesvc.notes.history import VERSION_ID_RE
from notesvc.notes.merge import title_filename, unified_diff
from notesvc.notes.paths import ATTACHMENTS, NOTES, note_path
from notesvc.notes.trash import attachment_or_note_path, change_record
from notesvc.plugins import attachment_linkers, move_and_relink, relinkable, update_links
from notesvc.providers.agent import ask_agent
from notesvc.providers.base import MAX_MESSAGE_CHARS, MCP_VERSIONS
from notesvc.relay_client import RELAY_WORKERS
from notesvc.search.hybrid import find_notes, related_notes
from notesvc.search.text import MAX_QUERY_CHARS, Query
from notesvc.service import Service
from notesvc.settings import Config
from notesvc.suggestions import (
    accept_suggestion,
    open_suggestions,
    public_suggestion,
    reject_suggestion,
)

# -- system ---------------------------------------------------------------------


def get_health(svc: Service) -> dict:
    return {"status": "ok", "version": __version__, "uptimeSeconds": svc.uptime()}


def server_features(svc: Service) -> dict:
    """Return what this server offers beyond the core API, decided from its route table as
    the web client decided it from openapi.json's paths (docs/api.md: Features)."""
    rules = [r.rule for r in svc.routes if r.api]

    def has(end: str) -> bool:
        return any(rule.endswith(end) for rule in rules)

    return {
        "version": __version__,
        "history": has("/trash") and has("/versions"),
        "attachments": has("/attachments"),
        "changes": has("/changes"),
        "related": svc.embedder is not None,  # search by meaning: /related has answers
    }


def get_features(svc: Service):
    """GET /system/features: the small document a client reads instead of openapi.json; an
    ETag of its bytes, and 304 to an If-None-Match that names it."""
    doc = server_features(svc)
    etag = '"' + hashlib.sha256(to_json(doc)).hexdigest()[:20] + '"'
    bottle.response.set_header("ETag", etag)
    bottle.response.set_header("Cache-Control", "no-cache")  # kept, asked again each time
    if none_match(bottle.request.get_header("If-None-Match"), etag):
        bottle.response.status = 304
        return b""
    return doc


SETUP_ELSEWHERE = "finish setup on this machine or its home network, or run `pair` on the server"


def setup_here_facts(svc: Service, env: dict) -> dict:
    """Return the setup payload's setupHere: {allowed, reason[, url]}; url is the address
    to open instead, for a client that came over global IPv6 to a server with a home
    IPv4 address."""
    allowed, reason = svc.setup_here(env)
    facts: dict = {"allowed": allowed, "reason": reason}
    ip = setup_client_ip(svc.config, env) if reason == "remote" else None
    if ip is not None and ip.version == 6:
        own = lan_address()
        if own and ":" not in own and is_home_network(own):
            facts["url"] = f"http://{own}:{_server_port(env, svc.config)}"
    return facts


def get_setup(svc: Service) -> dict:
    env, cfg, st = bottle.request.environ, svc.config, svc.state.read()
    url, relay = svc.base_url(env), svc.relay_url(env)
    server_id, code, complete = st["serverId"], st["relayCode"], bool(st.get("setupComplete"))
    here = setup_here_facts(svc, env)
    show_key = here["allowed"]
    key = st.get("apiKey", "") if show_key else KEY_PREFIX + "…" + st.get("keyHint", "")
    direct, relayed = f"{url}{API}", f"{svc.relay_base(env)}{API}"
    own_client = f"{svc.relay_base(env) if svc.relay_origin() else relay}/"
    own_client = own_client if cfg.pairing == "relay" else f"{url}/"
    client = cfg.client_url or own_client
    test_client = cfg.test_client_url or own_client
    payload = {
        "serverId": server_id,
        "apiKey": key,
        "setupComplete": complete,
        "browserSetup": show_key and not env.get("SCRIPT_NAME"),
        "setupHere": here,
        "version": __version__,
        "auth": {
            "method": cfg.auth_mode,
            "header": KEY_HEADER,
            "note": f"Send the key in the {KEY_HEADER} header on every protected endpoint."
            + ("" if cfg.auth_mode != "none" else " Auth is off (development only)."),
        },
        "pairing": {"mode": cfg.pairing, "relayCode": code, "relayUrl": relay},
        "server": {
            "url": url,
            "port": _server_port(env, cfg),
            "host": cfg.host,
            "cors": list(cfg.cors),
        },
        "links": {
            "setupApi": f"{direct}/system/setup",
            "health": f"{direct}/health",
            "apiBase": relayed if cfg.pairing == "relay" else direct,
            "directApiBase": direct,
            "relayApiBase": relayed,
            "connect": {
                "testHosted": _with_query(test_client, relayCode=code),
                "hosted": _with_query(client, relayCode=code),
                "localDevUi": _with_query(f"{url}/", relayCode=code, relayUrl=relay),
            },
        },
    }
    if not complete:
        payload["instructions"] = [
            "Copy apiKey: it is shown only to this machine"
            + ("" if svc.setup_loopback_only else " and its home network")
            + f", for {minutes_text(cfg.setup_window)} after a start, until setup completes.",
            "Open links.connect.hosted (or testHosted) on your device: it fills in this server.",
            f"If prefill is unavailable, paste links.apiBase and the key into your client "
            f"(header {KEY_HEADER}).",
            f"Finish with POST {direct}/auth/link and the key in {KEY_HEADER}; "
            "the key is redacted here from then on.",
        ]
    return payload


def _server_port(env: dict, cfg: Config) -> int:
    port = env.get("SERVER_PORT", "")
    return int(port) if str(port).isdigit() and cfg.port == 0 else cfg.port


def _with_query(url: str, **params: str) -> str:
    sep = "&" if "?" in url else "?"
    return url + sep + urllib.parse.urlencode(params)


def file_sees():
    """Return the request principal's sees() for what names files, None when it sees all."""
    principal = request_principal()
    return None if principal.whole else principal.sees


def get_info(svc: Service) -> dict:
    count, size = svc.note_stats()
    return {
        "version": __version__,
        "serverId": svc.state.read()["serverId"],
        "uptimeSeconds": svc.uptime(),
        "startedAt": iso(svc.started),
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "notes": {"count": count, "bytes": size},
        "attachments": dict(zip(("count", "bytes"), svc.attachments.stats())),
        "history": {**svc.history.usage(), "maxVersions": svc.history.max_versions},
        "trash": svc.trash.usage(),
        "changes": {
            "last": svc.journal.last,
            "floor": svc.journal.floor,
            "waiting": svc.journal.waiting(),
        },
        "index": {**svc.index.stats(), "lastSync": svc.last_sync},
        "embeddings": svc.embedder.info() if svc.embedder is not None else None,
        "attachmentText": svc.reader.info(file_sees()) if svc.reader is not None else None,
        "connection": svc.relay_client.status()
        if svc.relay_client
        else {
            "url": svc.config.relay_url or "(this server)",
            "state": "self" if not svc.config.relay_url else "off",
            "mode": "self" if not svc.config.relay_url else "off",
        },
    }


def network_facts(cfg: Config) -> dict:
    """The network settings /system/config and /security/config both report."""
    return {
        "port": cfg.port,
        "publicUrl": cfg.public_url,
        "trustProxy": list(cfg.trust_proxy),
        "cors": list(cfg.cors),
    }


def limit_facts(svc: Service) -> dict:
    cfg = svc.config
    return {
        "maxBodyBytes": cfg.max_body_bytes,
        "maxAttachmentBytes": cfg.max_attachment_bytes,
        "maxConnections": cfg.max_connections,
        "idleTimeoutSeconds": cfg.idle_timeout,
        "lockout": {
            "failures": svc.lockout.limit,
            "windowSeconds": svc.lockout.window,
            "lockSeconds": svc.lockout.window,
        },
    }


def agent_facts(cfg: Config) -> dict:
    return {
        "provider": cfg.agent_provider,
        "baseUrl": redact_url(cfg.agent_base_url),
        "apiKeySet": bool(cfg.agent_api_key),
    }


def get_config(svc: Service) -> dict:
    cfg, limits = svc.config, limit_facts(svc)
    return {
        "server": {
            "host": cfg.host,
            **network_facts(cfg),
            "threads": cfg.threads,
            **{k: v for k, v in limits.items() if k != "lockout"},
        },
        "auth": {
            "mode": cfg.auth_mode,
            "header": KEY_HEADER,
            "setupLocalOnly": svc.setup_loopback_only,
            "setupWindowSeconds": cfg.setup_window,
            "lockout": limits["lockout"],
        },
        "connection": {
            "pairingMode": cfg.pairing,
            "relayUrl": cfg.relay_url or "(this server)",
            "clientUrl": cfg.client_url or "(built-in client)",
            "testClientUrl": cfg.test_client_url or "(built-in client)",
        },
        "agent": {
            **agent_facts(cfg),
            "model": cfg.agent_model,
            "timeoutSeconds": cfg.agent_timeout,
            "maxSteps": cfg.agent_max_steps,
            "write": cfg.agent_write,
        },
        "mcp": {"path": f"{API}/mcp", "write": cfg.mcp_write, "protocolVersions": MCP_VERSIONS},
        "search": {
            "engine": "notesvc-bm25",
            "maxQueryLength": MAX_QUERY_CHARS,
            "embedUrl": redact_url(cfg.embed_url),
            "embedModel": cfg.embed_model,
            "embedKeySet": bool(cfg.embed_key),
        },
        "sync": {
            "rescanSeconds": cfg.rescan_seconds,
            "notesRoot": "notes/",
            "historyMaxVersions": cfg.history_max_versions,
            "historyDays": cfg.history_days,
            "trashDays": cfg.trash_days,
            "maxWaiters": cfg.max_waiters,
        },
        "plugins": {"dir": cfg.plugins_dir or ".notesvc/plugins"},
        "capture": {
            "transcribeUrl": redact_url(cfg.transcribe_url),
            "transcribeModel": cfg.transcribe_model,
            "transcribeApiKeySet": bool(cfg.transcribe_api_key),
            "timeZone": cfg.timezone or "system",
            "attachmentsRoot": f"{ATTACHMENTS}/",
        },
    }


# -- auth / linking ---------------------------------------------------------------


def verify_key(svc: Service) -> dict:
    st = svc.state.read()
    answer = {"valid": True, "serverId": st["serverId"], "setupComplete": bool(st["setupComplete"])}
    who = request_principal()
    if not answer["setupComplete"] and who.kind == "owner":  # may this client link (setup)?
        answer["linkHere"] = svc.setup_here(bottle.request.environ, check_host=False)[0]
    if who.kind != "owner":  # a scoped key learns how far it may go (the web client asks)
        answer["grant"] = {"kind": who.kind, "scope": who.scope, "folder": who.folder or None}
        if who.kind == "device":  # "Signed in as <device>"
            mine = [g for g in svc.grants.grants() if g["id"] == who.grant_id]
            answer["grant"]["name"] = mine[0]["name"] if mine else "this device"
    person = svc.people.get(who.person) if who.person else None
    if person is not None:  # who is signed in, and what they reach (the owner: everything)
        answer["person"] = {k: person[k] for k in ("id", "name", "home")}
        answer["reach"] = reach_rows(svc, who)
    return answer


def reach_rows(svc: Service, who: Principal) -> list:
    """Return what a principal reaches, as the menu shows it: [{path, scope, sharedBy}]
    (sharedBy null for a person's own home)."""
    shared = {r["path"]: r["sharedBy"] for r in svc.people.shared_with(who.person)}
    rows = []
    for folder, scope in who.reach.folders:
        own = folder == who.reach.home and who.person
        by = None if own else shared.get(folder, svc.people.sharer(None))
        rows.append({"path": folder, "scope": scope, "sharedBy": by})
    return rows


def link_client(svc: Service) -> dict:
    """POST /auth/link. Before setup, only from where the key may be offered
    (Service.setup_here, the Host aside): elsewhere 403, not counted toward the lockout."""
    env = bottle.request.environ
    allowed, reason = svc.setup_here(env, check_host=False)
    if not allowed and reason == "window":
        raise ApiError(
            403,
            "FORBIDDEN",
            "the setup window has passed: restart the server, or run `pair` (or "
            "`rotate-key`) on the server",
        )
    if not allowed and reason != "complete":
        raise ApiError(403, "FORBIDDEN", SETUP_ELSEWHERE)
    body = read_json(svc.config.max_body_bytes, required=False)
    name = field(body, "clientName", str, required=False, max_len=100) or "unnamed client"
    name = "".join(ch for ch in name if ch.isprintable()).strip() or "unnamed client"
    now = iso(utcnow())
    addr = svc.client_addr(bottle.request.environ)

    def change(data: dict) -> str:
        data["setupComplete"] = True
        data.pop("apiKey", None)
        clients = data.setdefault("linkedClients", [])
        clients.append({"name": name, "linkedAt": now, "address": addr})
        del clients[:-50]
        return data["serverId"]

    server_id = svc.state.update(change)
    log.info("client %r linked from %s; setup complete", name, addr)
    return {"linked": True, "setupComplete": True, "serverId": server_id, "linkedAt": now}


def issue_token(svc: Service) -> dict:
    if svc.config.auth_mode != "jwt":
        raise ApiError(403, "FORBIDDEN", "tokens are issued only with SERVICE_AUTH_MODE=jwt")
    st, now = svc.state.read(), int(time.time())
    claims = {
        "iss": f"notesvc:{st['serverId']}",
        "sub": "owner",
        "iat": now,
        "nbf": now,
        "exp": now + JWT_LIFETIME,
        "jti": secrets.token_hex(8),
        "kid": st["keyHash"][:16],  # rotating the key retires every token issued before
    }
    return {
        "token": jwt_encode(claims, svc.config.jwt_secret),
        "tokenType": "Bearer",
        "expiresIn": JWT_LIFETIME,
        "expiresAt": iso(claims["exp"]),
    }


def rotate_api_key(svc: Service) -> dict:
    key = svc.state.update(rotate_key)
    if svc.relay_client is not None:  # the relay code changed: tell the relay now
        threading.Thread(target=svc.relay_client.register, daemon=True).start()
    st = svc.state.read()
    log.info("API key rotated through the API; the old key stops working now")
    return {"apiKey": key, "relayCode": st["relayCode"], "rotatedAt": st["keyCreatedAt"]}


# -- notes ---------------------------------------------------------------------------


def if_match_header() -> str | None:
    return request_header("If-Match")


def _note_response(rec: dict) -> dict:
    bottle.response.set_header("ETag", rec["etag"])
    return rec


INBOX = f"{NOTES}/inbox"  # where a note without a path goes (a folder grant: its folder)


def default_folder(principal: Principal) -> str:
    """Return where a note without a path goes: the owner's notes/inbox, a folder grant's
    folder, a person's <home>/inbox."""
    if principal.person and not principal.folder:
        return f"{principal.home}/inbox"
    return principal.home or INBOX


def create_note(svc: Service) -> dict:
    """POST /notes: {path, content}, or {content, folder?} named from its title."""
    body = read_json(svc.config.max_body_bytes)
    content = field(body, "content")
    if body.get("path") is None:
        principal = request_principal()
        raw = field(body, "folder", required=False) or default_folder(principal)
        if raw == NOTES and not principal.whole:
            raw = default_folder(principal)
        folder = writable_folder(svc, raw)
        rec = svc.notes.create_named(folder, title_filename(content), content)
    else:
        rec = svc.notes.create(visible_note(svc.notes, field(body, "path"), write=True), content)
    path = rec["path"]
    script = bottle.request.environ.get("SCRIPT_NAME", "")
    location = f"{script}{API}/notes/{urllib.parse.quote(path, safe='')}"
    bottle.response.set_header("Location", location)
    return _note_response(rec)


LIST_FIELDS = ("title", "preview", "modified", "tags")  # a listing's ?fields= (docs/api.md: phone)


def list_notes(svc: Service) -> dict:
    raw = query_str("folder") or NOTES
    asked, folder = visible_folders(svc, raw)  # what a grant reaches of it, or 404
    limit = query_int("limit", 100, 1, 1000)
    offset = query_int("offset", 0, 0, 10**9)
    sort = query_str("sort", "path") or "path"
    if sort not in ("path", "modified"):
        raise bad_request("'sort' must be path (the default) or modified (newest first)")
    fields = [f for f in query_str("fields").split(",") if f]
    unknown = sorted(set(fields) - set(LIST_FIELDS))
    if unknown:
        raise bad_request(
            f"unknown field(s) {', '.join(unknown)}: ask for {', '.join(LIST_FIELDS)}"
        )
    try:
        return svc.notes.list_page(folder, limit, offset, sort, fields)
    except ApiError as e:  # the folder a grant sees from one of its ancestors is not there yet
        if e.status_code != 404 or folder == (asked,):
            raise
        return {"notes": [], "total": 0, "limit": limit, "offset": offset}


def get_note(svc: Service, path: str) -> bytes:
    etag, body = svc.notes.answer(visible_note(svc.notes, path))
    bottle.response.set_header("ETag", etag)
    bottle.response.content_type = JSON_TYPE
    return body


def update_note(svc: Service, path: str) -> dict:
    path = visible_note(svc.notes, path, write=True)
    body = read_json(svc.config.max_body_bytes)
    content = field(body, "content")
    if body.get("path") is not None and note_path(field(body, "path")) != path:
        raise bad_request(
            f"PUT changes content only; to move or rename use PATCH {API}/notes/:path/move"
        )
    return _note_response(svc.notes.update(path, content, if_match_header()))


def move_note(svc: Service, path: str) -> dict:
    path = visible_note(svc.notes, path, write=True)
    body = read_json(svc.config.max_body_bytes)
    new = visible_note(
        svc.notes, field(body, "path"), write=True
    )  # a folder grant moves within its folder
    relink = bool(field(body, "updateLinks", bool, required=False))
    return _note_response(move_and_relink(svc, path, new, if_match_header(), relink))


def merge_note(svc: Service, path: str) -> dict:
    """POST /notes/:path/merge {base, content}: an edit that started from version `base`,
    merged with what changed since (docs/api.md: phone); 409 with `conflictPath` when it clashed."""
    path = visible_note(svc.notes, path, write=True)
    body = read_json(svc.config.max_body_bytes)
    base = field(body, "base", max_len=100)
    content = field(body, "content")
    base = base if base.startswith('"') else f'"{base}"'
    name = clean_name(field(body, "clientName", required=False, max_len=100), "")
    principal = request_principal()  # a folder grant merges from versions it may read
    who = name or principal_name(svc, principal)
    person = svc.people.get(principal.person)
    if person is not None:  # a person's copy names them, whatever the client calls itself
        who = f"{person['name']} · {who}"
    who = title_filename(who)
    when = local_time(time.time(), time_zone(svc.config.timezone)).strftime("%Y-%m-%d %H-%M")
    sees = None if principal.whole else principal.sees
    done = svc.notes.merge(path, base, content, f"conflict {who} {when}", sees)
    bottle.response.set_header("ETag", done["note"]["etag"])
    return done


def principal_name(svc: Service, principal: Principal) -> str:
    """Return who a request acts for, as a person would name it: a device's or a key's
    name, an app's; "owner" for the API key."""
    if principal.kind == "owner":
        return "owner"
    for g in svc.grants.grants():
        if g["id"] == principal.grant_id:
            return (g.get("client") or {}).get("name") or g["name"]
    return principal.kind


def delete_note(svc: Service, path: str) -> dict:
    return svc.notes.delete(visible_note(svc.notes, path, write=True), if_match_header())


# -- attachments -------------------------------------------------------------------------

MULTIPART_SLACK = 65536  # bytes of a form beyond its file: the boundaries, headers and path


def _attachment_response(rec: dict, status: int) -> bytes:
    bottle.response.set_header("ETag", rec["etag"])
    script = bottle.request.environ.get("SCRIPT_NAME", "")
    location = f"{script}{API}/attachments/{urllib.parse.quote(rec['path'], safe='')}"
    bottle.response.set_header("Location", location)
    return ok(rec, status)


def put_attachment(svc: Service, path: str) -> bytes:
    """PUT the raw bytes: 201 when created, 200 when replaced (If-Match, If-None-Match: *)."""
    path = visible_attachment(svc.attachments, path, write=True)
    ctype = bottle.request.content_type.split(";")[0].strip().lower()
    if ctype.startswith("multipart/"):
        raise ApiError(
            415,
            "UNSUPPORTED_MEDIA_TYPE",
            f"PUT takes the file's own bytes; send a multipart form to POST {API}/attachments",
        )
    if_match, if_none_match = if_match_header(), request_header("If-None-Match")
    svc.attachments.check(path, if_match, if_none_match)  # before the body is read
    limit = svc.config.max_attachment_bytes
    read, _ = request_body_reader(limit, "SERVICE_MAX_ATTACHMENT_BYTES")

    def copy(f) -> None:
        while chunk := read(BODY_CHUNK):
            f.write(chunk)

    rec, created = svc.attachments.place(svc.attachments.spool(copy), path, if_match, if_none_match)
    return _attachment_response(rec, 201 if created else 200)


def post_attachment(svc: Service) -> bytes:
    """POST multipart/form-data with `path` and `file`: 201; never overwrites (a taken path
    becomes name-2.ext, name-3.ext...)."""
    import email.message

    header = request_header("Content-Type") or ""
    parsed = email.message.Message()
    parsed["Content-Type"] = header
    if parsed.get_content_type() != "multipart/form-data":
        raise ApiError(
            415,
            "UNSUPPORTED_MEDIA_TYPE",
            "send multipart/form-data with the fields path and file "
            f"(or PUT the raw bytes to {API}/attachments/:path)",
        )
    limit = svc.config.max_attachment_bytes
    read, _ = request_body_reader(limit + MULTIPART_SLACK, "SERVICE_MAX_ATTACHMENT_BYTES")
    reader = MultipartReader(read, str(parsed.get_param("boundary") or ""))
    form: dict = {"path": bytearray(), "file": False}

    def given_path() -> str:
        try:
            raw = bytes(form["path"]).decode("utf-8").strip()
        except UnicodeDecodeError:
            raise bad_request("'path' is not valid UTF-8") from None
        if not raw:
            raise bad_request("'path' is required (attachments/<name>.<extension>)")
        return visible_attachment(svc.attachments, raw, write=True)

    def receive(f) -> None:
        def part(name: str, filename: Any, headers: Any):
            if name == "path":
                too_long = lambda: bad_request("'path' is longer than 2048 bytes")  # noqa: E731
                return form["path"].extend, 2048, too_long
            if name != "file":
                return None
            if form["file"]:
                raise bad_request("send one part named 'file'")
            form["file"] = True
            if form["path"]:
                given_path()  # a bad path is refused before the file is read
            return f.write, limit, lambda: too_large(limit, "SERVICE_MAX_ATTACHMENT_BYTES")

        reader.parts(part)

    tmp = svc.attachments.spool(receive)
    try:
        if not form["file"]:
            raise bad_request("the form has no part named 'file'")
        path = given_path()
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    rec, _ = svc.attachments.place(tmp, path, unique=True)
    return _attachment_response(rec, 201)


def get_attachment(svc: Service, path: str):
    """The file's bytes, with ETag, Range, Content-Disposition and a sandbox policy. A path
    under notes/ is a file kept beside the notes (a vault's image, put there over WebDAV)."""
    store = svc.note_files if str(path).startswith(NOTES + "/") else svc.attachments
    if store is svc.note_files:
        path = visible_note_file(store, path)
    else:
        path = visible_attachment(store, path)
    f, st = store.open(path)
    try:
        rec = store.record(path, st)
        span = conditional_download(rec["etag"], st.st_size, rec["contentType"], path)
        if span is None:  # 304
            f.close()
            return b""
        first, length = span
        f.seek(first)
        return file_chunks(f, length)
    except BaseException:
        f.close()
        raise


def list_attachments(svc: Service) -> dict:
    raw = query_str("folder") or ATTACHMENTS
    asked, folder = visible_folders(svc, raw, top=ATTACHMENTS)  # what a grant reaches of it
    limit = query_int("limit", 100, 1, 1000)
    offset = query_int("offset", 0, 0, 10**9)
    try:
        return svc.attachments.list_page(folder, limit, offset)
    except ApiError as e:  # the folder a grant sees from one of its ancestors is not there yet
        if e.status_code != 404 or folder == (asked,):
            raise
        return {"attachments": [], "total": 0, "limit": limit, "offset": offset}


def move_attachment(svc: Service, path: str) -> dict:
    path = visible_attachment(svc.attachments, path, write=True)
    body = read_json(svc.config.max_body_bytes)
    new = visible_attachment(svc.attachments, field(body, "path"), write=True)
    relink = field(body, "updateLinks", bool, required=False)
    writes = relinkable(request_principal())  # (the notes it may write, as for a note's move)
    linking = set(filter(writes, attachment_linkers(svc, path))) if relink else set()
    rec = svc.attachments.move(path, new, if_match_header())
    if relink and new != path:
        rec["linksUpdated"] = update_links(svc, path, new, linking)
    bottle.response.set_header("ETag", rec["etag"])
    return rec


def delete_attachment(svc: Service, path: str) -> dict:
    return svc.attachments.delete(
        visible_attachment(svc.attachments, path, write=True), if_match_header()
    )


# -- folders ---------------------------------------------------------------------------


def indexed_counts(svc: Service) -> Callable:
    """Return count(folder path) -> notes beneath it, from the index's folder counts."""
    counts = svc.index.folder_counts()
    return lambda folder: counts.get(folder, 0)


def get_tree(svc: Service) -> dict:
    return granted_tree(svc, NOTES, query_int("depth", None, 1, 64), indexed_counts(svc))


def get_subtree(svc: Service, path: str) -> dict:
    return granted_tree(svc, path, query_int("depth", None, 1, 64), indexed_counts(svc))


# -- history, trash and the change feed ----------------------------------------------------

MAX_WAIT_SECONDS = 25  # a change-feed long-poll, below the relay's 30 s
RETRY_AFTER_SECONDS = 1  # what a feed over the waiter cap is told
MAX_SEQ = 10**10 - 1


def _page() -> tuple:
    return query_int("limit", 100, 1, 1000), query_int("offset", 0, 0, 10**9)


def _version_seen(svc: Service, path: str, version_id: str) -> str:
    """Return version_id when the request's grant sees the path it was saved at (a folder
    grant: inside its folder, whatever the note's path is now); 404 otherwise. Asked after
    the version was read: a version's origin is written before it lands in a folder, so a
    move landing in between cannot show a grant a version from elsewhere."""
    if VERSION_ID_RE.match(version_id) and not request_principal().sees(
        svc.history.saved_at(path, version_id)
    ):
        raise not_found(f"no version {version_id} of {path}")
    return version_id


def _read_version(svc: Service, path: str, version_id: str) -> bytes:
    """Return a version the request's grant sees (read, then checked: _version_seen)."""
    data = svc.history.read(path, version_id)
    _version_seen(svc, path, version_id)
    return data


def list_versions(svc: Service, path: str) -> dict:
    path = visible_note(svc.notes, path)
    limit, offset = _page()
    principal = request_principal()
    versions = svc.history.versions(path, None if principal.whole else principal.sees)
    if not versions and not svc.notes.exists(path):
        raise not_found(f"no note and no history at {path}")
    page = versions[offset : offset + limit]
    # the creation: no version (it replaced nothing), told by the change journal while it
    # holds it, to a grant that sees where the note was made
    made = svc.journal.creation(path)
    created = {"at": made[0], "by": made[1]} if made and principal.sees(made[2]) else None
    answer = {"versions": page, "total": len(versions), "limit": limit, "offset": offset}
    return {**answer, "created": created}


def get_version(svc: Service, path: str, version_id: str) -> dict:
    if not VERSION_ID_RE.match(version_id):  # WSGI decodes %2F: maybe a note in a folder
        with contextlib.suppress(ApiError):  # named like one (notes/x.md/versions/y.md)
            return get_note(svc, f"{path}/versions/{version_id}")
    path = visible_note(svc.notes, path)
    data = _read_version(svc, path, version_id)
    return {
        **svc.history.describe(version_id, len(data), svc.history.meta_of(path, version_id)),
        "path": path,
        "content": data.decode("utf-8", "replace"),
    }


def diff_version(svc: Service, path: str, version_id: str) -> dict:
    path = visible_note(svc.notes, path)
    against = query_str("against", "current") or "current"
    old = _read_version(svc, path, version_id).decode("utf-8", "replace")
    if against == "current":
        new = svc.notes.get(path)["content"]
    else:
        new = _read_version(svc, path, against).decode("utf-8", "replace")
    diff = unified_diff(old, new, f"{path}@{version_id}", f"{path}@{against}")
    return {"path": path, "id": version_id, "against": against, "diff": diff}


def restore_version(svc: Service, path: str, version_id: str) -> dict:
    path = visible_note(svc.notes, path, write=True)
    seen = functools.partial(_version_seen, svc, path, version_id)
    return _note_response(svc.notes.restore_version(path, version_id, if_match_header(), seen))


def _trashed(svc: Service, item_id: str) -> Any:
    """Return a trash item the request's grant sees (a folder grant: its folder's); 404."""
    item = svc.trash.find(item_id)
    if not request_principal().sees(item.path):
        raise not_found(f"no item {item_id} in the trash")
    return item


def list_trash(svc: Service) -> dict:
    limit, offset = _page()
    sees = request_principal().sees
    items = [item for item in svc.trash.items() if sees(item.path)]
    page = [item.describe() for item in items[offset : offset + limit]]
    return {"items": page, "total": len(items), "limit": limit, "offset": offset}


def get_trash_item(svc: Service, item_id: str) -> dict:
    item = _trashed(svc, item_id)
    content = None
    if item.kind == "note":
        try:
            content = item.file.read_bytes().decode("utf-8", "replace")
        except FileNotFoundError:  # purged meanwhile
            raise not_found(f"no item {item_id} in the trash") from None
    return {**item.describe(), "content": content}


def restore_trash_item(svc: Service, item_id: str) -> dict:
    body = read_json(svc.config.max_body_bytes, required=False)
    item = _trashed(svc, item_id)
    target = field(body, "path", required=False)
    target = attachment_or_note_path(item.path if target is None else target)
    who = request_principal()
    if not who.sees(target):  # a folder grant restores into its folder
        raise not_found(f"no folder for {target}")
    if not who.whole and not who.may_write(target):
        raise ApiError(403, "FORBIDDEN", f"restoring into {target} needs the write scope there")
    top = target.split("/", 1)[0]
    if top != item.path.split("/", 1)[0]:
        raise bad_request(f"a trashed {item.kind} is restored under {item.path.split('/')[0]}/")
    if item.kind == "note":
        return _note_response(svc.notes.restore_trashed(item, target))
    rec = svc.attachments.restore(item.file, target)  # no history: the file goes back
    svc.trash.emptied(item)
    return rec


def purge_trash_item(svc: Service, item_id: str) -> dict:
    item = _trashed(svc, item_id)
    who = request_principal()
    if not who.whole and not who.may_write(item.path):
        raise ApiError(403, "FORBIDDEN", f"purging {item.path} needs the write scope there")
    svc.trash.purge(item)
    return {"id": item.id, "purged": True}


def seen_change(entry: tuple, inside: bool, was: bool) -> dict:
    """Return a journal entry's record to one who sees part of the notes (`inside`: its
    path is theirs; `was`: a move's origin is): a move into their part is a creation, a
    move out of it a deletion (where the note went is not theirs to know)."""
    c = change_record(entry)
    if entry[1] != "moved" or (inside and was):
        return c
    del c["from"]
    if inside:  # moved in: to them, the note appears
        c["kind"] = "created"
        return c
    c.pop("etag", None)
    c.update(kind="deleted", path=entry[3])
    return c


def _changes_page(svc: Service, who: Principal, since: int, limit: int) -> dict:
    """Return a page of the change feed as `who` sees it: all of it, or (a part of the
    notes: a folder grant, a person) the changes it sees, numbered with gaps."""
    if who.whole:
        return svc.journal.read(since, limit)
    return svc.journal.read_seen(since, limit, who.folders, seen_change)


def _still(svc: Service, who: Principal) -> Principal:
    """Return who a waiting feed acts as now (its reach as shared now); 401 once revoked,
    410 once a folder it followed is no longer shared with it (its list lost notes the
    feed cannot name: it lists again)."""
    now = svc.grants.current(who.grant_id) if who.grant_id else who
    if now is None:
        raise ApiError(401, "UNAUTHORIZED", "the key this request came with was revoked")
    if any(not now.sees(folder) for folder, _ in who.reach.folders):
        latest = svc.journal.seen_latest(now.folders)
        raise gone(
            f"a folder this key followed is no longer shared with it; list the notes again "
            f"and follow from since={latest}"
        )
    return now


def list_changes(svc: Service) -> dict:
    who = request_principal()
    if query_str("since") == "latest":  # where to follow from, without reading the journal
        last = svc.journal.latest() if who.whole else svc.journal.seen_latest(who.folders)
        return {"changes": [], "last": last, "more": False}
    since = query_int("since", 0, 0, MAX_SEQ)
    wait = query_int("wait", 0, 0, MAX_WAIT_SECONDS)
    limit = query_int("limit", 100, 1, 1000)
    nudges, mark = svc.journal.nudges(), svc.journal.latest()
    page = _changes_page(svc, who, since, limit)
    if page["changes"] or not wait:
        return page
    # A waiting feed holds a worker thread: at most max_waiters at once, so the others
    # keep serving (relayed requests have their own small pool: half of it; spliced ones,
    # served by waitress as direct ones are, share the direct pool).
    env = bottle.request.environ
    if env.get("notesvc.relayed") and not env.get("notesvc.spliced"):
        pool, cap = "relay", min(svc.config.max_waiters, RELAY_WORKERS // 2)
    else:
        pool, cap = "direct", svc.config.max_waiters
    deadline = time.monotonic() + wait
    while True:  # a part of the notes waits on for a change it may see
        left = deadline - time.monotonic()
        came = svc.journal.wait_after(mark, left, pool, cap, nudges) if left > 0 else False
        if came is None:
            bottle.response.set_header("Retry-After", str(RETRY_AFTER_SECONDS))
            return {**page, "retryAfter": RETRY_AFTER_SECONDS}
        if svc.journal.closed:  # the server stops: answer now (waiting again would spin)
            return page
        # woken: by a change, or a share or a key that ended; it sees what it reaches now
        nudges, mark = svc.journal.nudges(), svc.journal.latest()
        who = _still(svc, who)
        page = _changes_page(svc, who, since, limit)
        if page["changes"] or not came:
            return page


# -- search --------------------------------------------------------------------------------


def search_notes(svc: Service) -> dict:
    started = time.perf_counter()
    query = Query(query_str("q"))
    folder = searched_folders(svc, query_str("folder"))  # the reach's by default
    limit = query_int("limit", 20, 1, 100)
    offset = query_int("offset", 0, 0, 10000)
    reach = request_principal().folders  # scored within it: nothing else moves a score
    found = find_notes(svc, query, folder, limit, offset, query_str("mode"), reach)
    results = [
        {"path": p, "title": t, "score": sc, "snippet": sn} for p, t, sc, sn in found["results"]
    ]
    answer = {
        "query": query.text,
        "total": found["total"],
        "limit": limit,
        "offset": offset,
        "results": results,
        "mode": found["mode"],
        "fallback": found["fallback"],
    }
    if svc.embedder is not None:  # counted within the caller's reach (a grant: its folder)
        answer["embeddings"] = svc.embedder.status(request_principal().folders)
    answer["tookMs"] = round((time.perf_counter() - started) * 1000, 3)
    return answer


def note_related(svc: Service, path: str) -> dict:
    path = visible_note(svc.notes, path)
    if not svc.notes.exists(path):
        raise not_found(f"no note at {path}")
    limit = query_int("limit", 10, 1, 50)
    near = related_notes(svc, path, request_principal().folders, limit)
    return {"path": path, "results": [{"path": p, "title": t, "score": s} for p, t, s in near]}


# -- agent ---------------------------------------------------------------------------------


def agent_chat(svc: Service) -> dict:
    body = read_json(svc.config.max_body_bytes)
    message = field(body, "message", max_len=MAX_MESSAGE_CHARS)
    if is_blank(message):
        raise bad_request("'message' must not be empty")
    note = body.get("notePath")
    if note is not None:
        note = visible_note(svc.notes, field(body, "notePath"))
        if not svc.notes.exists(note):
            raise not_found(f"no note at {note}")
    channel = field(body, "channel", required=False)
    if channel is not None and channel not in svc.channel_providers:
        raise bad_request(f"'channel' must be one of {', '.join(svc.channel_providers)}")
    return ask_agent(svc, message, note, request_principal().folders)


def agent_status(svc: Service) -> dict:
    provider = svc.agent_providers[svc.config.agent_provider]
    return {
        "enabled": provider.enabled,
        "provider": provider.name,
        "model": provider.model(svc.config),
    }


# -- suggestions: an assistant's edits waiting for approval (docs/api.md: Suggestions) -----


def list_suggestions(svc: Service) -> dict:
    """GET /suggestions: the open suggestions in the caller's reach, newest first."""
    limit = query_int("limit", 50, 1, 200)
    offset = query_int("offset", 0, 0, 10**6)
    shown = open_suggestions(svc)
    page = [public_suggestion(svc, s) for s in shown[offset : offset + limit]]
    return {"suggestions": page, "total": len(shown), "limit": limit, "offset": offset}


def accept_suggestion_route(svc: Service, suggestion_id: str) -> dict:
    """POST /suggestions/:id/accept: apply it (an edit merged three ways; 409 with its
    conflict copy when it clashed)."""
    done = accept_suggestion(svc, suggestion_id)
    if "etag" in done["note"]:
        bottle.response.set_header("ETag", done["note"]["etag"])
    return done


def reject_suggestion_route(svc: Service, suggestion_id: str) -> dict:
    """POST /suggestions/:id/reject: close it unapplied."""
    return reject_suggestion(svc, suggestion_id)
