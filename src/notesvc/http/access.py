"""Handlers for who else gets in: scoped keys, devices, share links, OAuth, relay pairing."""

from __future__ import annotations

import base64
import contextlib
import hmac
import io
import posixpath
import re
import urllib.parse
from typing import Any

from notesvc.auth import relay_origin_of
from notesvc.boot import API, bottle, log
from notesvc.errors import JSON_TYPE, ApiError, bad_request, not_found, to_json
from notesvc.grants import (
    CHALLENGE_RE,
    SCOPES,
    GrantStore,
    Principal,
    clean_name,
    made_by,
    request_principal,
    visible_attachment,
    visible_note,
)
from notesvc.helpers import (
    base_url_of,
    behind_trusted_proxy,
    field,
    ip_of,
    is_blank,
    is_home_network,
    is_loopback,
    log_safe,
    phone_url,
    query_str,
    read_json,
    request_header,
    request_host,
    valid_host,
    yes_or_no,
)
from notesvc.http.api import get_attachment
from notesvc.notes.paths import ATTACHMENTS, MAX_SCAN_CHARS, NOTES, attachment_path, folder_path
from notesvc.oauth import OAUTH_SCOPES, OAuthError, parse_oauth_scope
from notesvc.plugins import MDLINK_RE, md_target
from notesvc.service import Service
from notesvc.settings import Config
from notesvc.web import consent_page, consent_page_headers, share_page, share_page_headers

# -- grants: scoped keys and share links ------------------------------------------------


def _days(body: dict, name: str, hi: int, default: int | None) -> int | None:
    days = body.get(name)
    if days is None:
        return default
    if isinstance(days, float) and days.is_integer():  # JSON Schema's integer: 7.0 is one
        days = int(days)
    if not isinstance(days, int) or isinstance(days, bool) or not 1 <= days <= hi:
        raise bad_request(f"'{name}' must be a whole number from 1 to {hi}")
    return days


def _grant_folder(body: dict) -> str | None:
    """Return the folder of a grant's body (None: every note it may see); `notes` itself
    is None. A person's grant takes a folder of their reach only (404 for any other)."""
    raw = field(body, "folder", required=False)
    folder = folder_path(raw) if raw is not None else NOTES
    principal = request_principal()
    if folder != NOTES and not principal.whole and not principal.sees(folder):
        raise not_found(f"no folder at {folder}")
    return None if folder == NOTES else folder


def create_scoped_key(svc: Service) -> dict:
    body = read_json(svc.config.max_body_bytes)
    raw = field(body, "name", max_len=100)
    if is_blank(raw):
        raise bad_request("'name' must not be empty")
    name = clean_name(raw, "unnamed key")  # control characters never reach a listing
    scope = field(body, "scope")
    if scope not in ("read", "write"):
        raise bad_request("'scope' must be read or write (the API key itself holds admin)")
    folder = _grant_folder(body)
    record, key = svc.grants.create_key(
        name,
        scope,
        folder,
        _days(body, "expiresInDays", 3650, None),
        created_by=made_by(request_principal()),
        person=request_principal().person,
    )
    return {**record, "key": key}


def list_scoped_keys(svc: Service) -> dict:
    """GET /auth/keys: every grant for the owner; a person's own for a person."""
    person = request_principal().person
    return {"keys": svc.grants.grants(person or None)}


# -- devices: a phone joins by scanning a code (docs/api.md: Devices) ---------------------------


def qr_svg(text: str) -> str | None:
    """Return text as a QR code in SVG (segno, when installed; else None)."""
    try:
        import segno
    except ImportError:
        return None
    out = io.BytesIO()  # a whole SVG document (with its namespace): it also works as an <img>
    segno.make(text, error="m").save(
        out, kind="svg", xmldecl=False, nl=False, scale=5, border=2, dark="#111"
    )
    return out.getvalue().decode("utf-8")


def page_on_loopback(config: Config, environ: dict) -> bool:
    """Return whether the page asking was opened by a loopback name (127.0.0.1, ::1,
    localhost) on this machine itself: never a relayed request, nor a proxied one."""
    if environ.get("notesvc.relayed") or behind_trusted_proxy(config, environ):
        return False
    host = request_host(config, environ)
    if not valid_host(host) or not is_loopback(environ.get("REMOTE_ADDR", "")):
        return False
    name = host[1 : host.index("]")] if host.startswith("[") else host.rsplit(":", 1)[0]
    name = name.lower().rstrip(".")
    return name == "localhost" or name.endswith(".localhost") or is_loopback(name)


def pairing_origin(config: Config, state: dict, environ: dict | None) -> tuple:
    """Return (origin, via): the origin a pairing's link opens and which one it is.

    SERVICE_PUBLIC_URL's ("public"); on a page opened by a loopback name, the address the
    banner gives phones ("home": a phone can't open 127.0.0.1); else the server's own
    origin on its relay ("relay"); else the request's ("page"). Outside a request: the
    banner's address. "local" is a loopback address that only this machine opens (a
    server listening on loopback only, with no relay)."""
    url, via = _pairing_url(config, state, environ)
    parts = urllib.parse.urlsplit(url)
    if via in ("home", "page") and is_loopback(parts.hostname or ""):
        via = "local"
    return f"{parts.scheme}://{parts.netloc}", via


def _pairing_url(config: Config, state: dict, environ: dict | None) -> tuple:
    if config.public_url:
        return config.public_url, "public"
    if environ is None:
        return phone_url(config), "home"
    home = home_origin(config, environ)
    if home:
        return home, "home"
    relayed = relay_origin_of(config, state)
    return (relayed, "relay") if relayed else (base_url_of(config, environ), "page")


def home_origin(config: Config, environ: dict) -> str:
    """Return the address the banner gives phones for a page opened by a loopback name ("":
    another page, SERVICE_PUBLIC_URL, or that address is loopback too)."""
    if config.public_url or not page_on_loopback(config, environ):
        return ""
    home = phone_url(config, int(environ.get("SERVER_PORT") or 0) or config.port)
    return "" if is_loopback(urllib.parse.urlsplit(home).hostname or "") else home


def link_base(svc: Service, environ: dict) -> str:
    """Return the base of links the page shows (shares, feeds, MCP): svc.issuer's, but the
    phones' address on a page on loopback, as Add a device draws it."""
    home = home_origin(svc.config, environ)
    return home + environ.get("SCRIPT_NAME", "") if home else svc.issuer(environ)


def new_pairing(
    config: Config,
    grants: GrantStore,
    name: str,
    scope: str,
    folder: str | None,
    environ,
    created_by: str,
    person: str = "",
) -> dict:
    """Make a pairing (a person's, with `person`); return {id, name, scope, folder,
    createdAt, expiresAt, createdBy, secret, url, origin, via[, qrSvg]}: the secret travels
    only in the link's fragment."""
    if scope not in SCOPES:
        raise bad_request("'scope' must be read, write or admin")
    if scope == "admin" and folder:
        raise bad_request("an admin device sees every note: leave out 'folder', or choose write")
    record, secret = grants.create_pairing(
        name, scope, folder, config.pairing_ttl, created_by=created_by, person=person
    )
    return pairing_answer(config, grants.state.read(), environ, record, secret)


def pairing_answer(config: Config, state: dict, environ, record: dict, secret: str) -> dict:
    """Return a stored pairing's answer: its record, secret, link, origin, via[, qrSvg]."""
    origin, via = pairing_origin(config, state, environ)
    url = f"{origin}/#pair={secret}"
    answer = {**record, "secret": secret, "url": url, "origin": origin, "via": via}
    svg = qr_svg(url)
    if svg:
        answer["qrSvg"] = svg
    return answer


def create_pairing(svc: Service) -> dict:
    body = read_json(svc.config.max_body_bytes, required=False)  # every field has a default
    name = clean_name(field(body, "name", required=False, max_len=100), "device")
    scope = field(body, "scope", required=False) or "write"
    folder = _grant_folder(body)
    env, who = bottle.request.environ, request_principal()
    return new_pairing(svc.config, svc.grants, name, scope, folder, env, made_by(who), who.person)


def get_addresses(svc: Service) -> dict:
    """GET /auth/devices/addresses (admin): where a phone and an AI assistant reach this
    server, as Add a device and Connect an AI assistant show them. The LAN address is
    offered only here and in a pairing, both admin: never to a folder key or a stranger."""
    env, cfg = bottle.request.environ, svc.config
    origin, via = pairing_origin(cfg, svc.state.read(), env)
    relayed = bool(cfg.relay_url) and cfg.pairing == "relay"
    mcp = (svc.relay_base(env) if relayed else link_base(svc, env)) + API + "/mcp"
    mcp_via = "relay" if relayed else via if via in ("public", "home") else "page"
    return {"phone": {"origin": origin, "via": via}, "mcpUrl": mcp, "mcpVia": mcp_via}


def claim_device(svc: Service) -> dict:
    """POST /auth/devices/claim (public): a pairing's secret for a device key, once.

    Failures count toward the lockout like wrong keys. The secret is refused in a URL,
    where logs and proxies keep it.
    """
    env = bottle.request.environ
    if "secret" in bottle.request.query or "pair" in bottle.request.query:
        raise bad_request("send the pairing secret in the JSON body, never in the URL")
    addr = svc.client_addr(env)
    svc.check_lockout(addr)
    body = read_json(svc.config.max_body_bytes)
    secret = field(body, "secret", max_len=64)
    name = clean_name(field(body, "deviceName", required=False, max_len=100), "")
    found = svc.grants.claim(secret, name) if len(secret) <= 64 else None
    if found is None:
        svc.lockout.fail(addr, secret)
        raise not_found("this pairing code is unknown, used or expired: make a new one")
    svc.lockout.succeed(addr)
    record, key = found
    return {
        "key": key,
        "deviceId": record["id"],
        "device": record,
        "apiBase": svc.issuer(env) + API,
    }


def revoke_scoped_key(svc: Service, grant_id: str) -> dict:
    """DELETE /auth/keys/<id>[?cascade=true]: the grant, its share links and the pairings it
    made that wait; with cascade also every grant it made (by `createdBy`, and theirs)."""
    cascade = yes_or_no(bottle.request.query.get("cascade"), "cascade")
    person = request_principal().person
    if person and not any(g["id"] == grant_id for g in svc.grants.grants(person)):
        raise not_found(f"no key or OAuth grant {grant_id}")  # (another's, to a person)
    gone = svc.grants.revoke(grant_id, cascade=cascade)
    if not gone:
        raise not_found(f"no key or OAuth grant {grant_id}")
    answer = {"id": grant_id, "revoked": True}
    return {**answer, "alsoRevoked": gone[1:]} if cascade else answer


def share_url(svc: Service, environ: dict, token: str) -> str:
    """Return a share link: in relay mode on the server's relay origin (or {relay}/r/<id>;
    with no relay, its own /r/<id>), else <base>/s/<token>; bases as link_base has them."""
    if svc.config.pairing != "relay":
        return f"{link_base(svc, environ)}/s/{token}"
    home = "" if svc.config.relay_url else home_origin(svc.config, environ)
    base = f"{home}/r/{svc.state.read()['serverId']}" if home else svc.relay_base(environ)
    return f"{base}/s/{token}"


def create_share(svc: Service) -> dict:
    body = read_json(svc.config.max_body_bytes)
    path = visible_note(svc.notes, field(body, "path"))
    days = _days(body, "expiresInDays", 365, 7)
    if not svc.notes.exists(path):
        raise not_found(f"no note at {path}")
    record, token = svc.grants.create_share(path, days, request_principal())
    log.info("share link %s created for a note", record["id"])
    url = share_url(svc, bottle.request.environ, token)
    return {**record, "url": url, "homeOnly": opens_only_at_home(url)}


HOME_NAME_RE = re.compile(r"(?:[^.]+|.+\.(?:local|lan|home\.arpa|internal|localhost))")


def opens_only_at_home(url: str) -> bool:
    """Return whether a link names a host only this machine or its network reaches: a
    loopback, private or link-local address, localhost, a single label, .local, .lan."""
    host = (urllib.parse.urlsplit(url).hostname or "").lower().rstrip(".")
    if ip_of(host) is not None:
        return is_home_network(host)
    return bool(HOME_NAME_RE.fullmatch(host))


def list_shares(svc: Service) -> dict:
    return {"shares": svc.grants.shares(request_principal())}


def revoke_share(svc: Service, share_id: str) -> dict:
    if not svc.grants.revoke_share(share_id, request_principal()):
        raise not_found(f"no share link {share_id}")
    return {"id": share_id, "revoked": True}


def public_limit(svc: Service) -> str:
    """Count one public grant request from its address; 429 over the limits."""
    addr = svc.client_addr(bottle.request.environ)
    wait = svc.grants.share_misses.retry_after(addr) or svc.grants.public_hits.hit(addr)
    if wait:
        raise ApiError(
            429,
            "RATE_LIMITED",
            f"too many requests from this address; retry in {wait} s",
            {"Retry-After": str(wait)},
        )
    return addr


def _shared_note(svc: Service, token: str) -> tuple:
    """Return (the shared note's record, whom the link reads as). A link made by a grant
    reads as that grant: only while the note is in its folder, only what it may see."""
    addr = public_limit(svc)
    bottle.response.set_header("X-Robots-Tag", "noindex, nofollow")
    bottle.response.set_header("Referrer-Policy", "no-referrer")
    found = svc.grants.shared(token)
    if found is None:
        svc.grants.share_misses.fail(addr, token)
        raise not_found("nothing is shared at this link (it may have expired or been revoked)")
    share, reader = found
    try:
        return svc.notes.get(visible_note(svc.notes, share["path"], reader)), reader
    except ApiError as e:
        if e.status_code == 404:
            raise not_found("the shared note no longer exists") from None
        raise


def _readable_attachments(svc: Service, rec: dict, reader: Principal) -> dict:
    """Return {href: attachment path} of the attachments a share link of rec may load: the
    ones it links, that the link's reader may see."""
    found = {}
    for href, path in shared_attachments(rec["path"], rec["content"]).items():
        with contextlib.suppress(ApiError):
            found[href] = visible_attachment(svc.attachments, path, reader)
    return found


def shared_attachments(path: str, text: str) -> dict:
    """Return {href as written: attachment path} of the attachments a note at `path` links
    by Markdown link or image: all a share link of it may load."""
    found = {}
    for m in MDLINK_RE.finditer(text[:MAX_SCAN_CHARS]):
        target = md_target(m.group(2))
        href = urllib.parse.unquote(target.strip("<>")) if target else ""
        if not href or "://" in href or href.startswith("mailto:"):
            continue
        if href.startswith("/"):
            candidate = href.lstrip("/")
        else:
            candidate = posixpath.normpath(posixpath.join(posixpath.dirname(path), href))
        if candidate.startswith(f"{ATTACHMENTS}/"):
            with contextlib.suppress(ApiError):
                found[m.group(2).strip("<>")] = attachment_path(candidate)  # as the page sees it
    return found


def get_shared(svc: Service, token: str) -> dict:
    rec, reader = _shared_note(svc, token)
    return {
        "title": rec["title"],
        "content": rec["content"],
        "modified": rec["modified"],
        "attachments": _readable_attachments(svc, rec, reader),
    }


def get_shared_attachment(svc: Service, token: str, path: str):
    """An attachment the shared note links (no other) and its link's reader may see, as
    GET /attachments/:path serves it."""
    rec, reader = _shared_note(svc, token)
    if path not in _readable_attachments(svc, rec, reader).values():
        raise not_found("the shared note links no such attachment")
    return get_attachment(svc, path)


def get_share_page(svc: Service, token: str):
    bottle.response.content_type = "text/html; charset=utf-8"
    for name, value in share_page_headers().items():
        bottle.response.set_header(name, value)
    return share_page()


# -- OAuth for MCP clients ---------------------------------------------------------------
#
# notesvc is its own authorisation server (RFC 8414, 9728, 7591, 7636, 8707, 7009); its
# tokens are good for the MCP endpoint only. These endpoints answer in OAuth's own JSON.


def _oauth_answer(body: dict, status: int = 200, headers: dict | None = None) -> bytes:
    bottle.response.status = status
    bottle.response.content_type = JSON_TYPE
    for name, value in {
        "Cache-Control": "no-store",
        "Pragma": "no-cache",
        **(headers or {}),
    }.items():
        bottle.response.set_header(name, value)
    return to_json(body)


def _oauth_failure(e: OAuthError) -> bytes:
    return _oauth_answer(
        {"error": e.error, "error_description": e.description}, e.status, e.headers
    )


def mcp_resource(svc: Service, environ: dict) -> str:
    return svc.issuer(environ) + API + "/mcp"


def oauth_issuers(svc: Service, environ: dict) -> dict:
    """Return {MCP resource: issuer} a request may grant for: its own, and on the server's
    own relay origin also the relay's path-based one, whose authorisation page now
    redirects there (connectors set up before per-server origins keep their URLs)."""
    issuer = svc.issuer(environ)
    found = {issuer + API + "/mcp": issuer}
    if environ.get("notesvc.relay_origin"):
        old = f"{svc.config.relay_url}/r/{svc.state.read()['serverId']}"
        found[old + API + "/mcp"] = old
    return found


def protected_resource_metadata(svc: Service) -> bytes:
    """RFC 9728 metadata of the MCP endpoint."""
    env = bottle.request.environ
    issuer = svc.issuer(env)
    return _oauth_answer(
        {
            "resource": mcp_resource(svc, env),
            "authorization_servers": [issuer],
            "scopes_supported": list(OAUTH_SCOPES),
            "bearer_methods_supported": ["header"],
            "resource_name": "notesvc",
        }
    )


def authorization_server_metadata(svc: Service) -> bytes:
    """RFC 8414 metadata of this authorisation server (also served as OpenID's name)."""
    issuer = svc.issuer(bottle.request.environ)
    return _oauth_answer(
        {
            "issuer": issuer,
            "authorization_endpoint": f"{issuer}/oauth/authorize",
            "token_endpoint": f"{issuer}/oauth/token",
            "registration_endpoint": f"{issuer}/oauth/register",
            "revocation_endpoint": f"{issuer}/oauth/revoke",
            "response_types_supported": ["code"],
            "grant_types_supported": ["authorization_code", "refresh_token"],
            "code_challenge_methods_supported": ["S256"],
            "token_endpoint_auth_methods_supported": ["none"],
            "revocation_endpoint_auth_methods_supported": ["none"],
            "scopes_supported": list(OAUTH_SCOPES),
            "client_id_metadata_document_supported": True,
            "authorization_response_iss_parameter_supported": True,
        }
    )


def _form(max_bytes: int = 65536) -> dict:
    """Return a form-encoded body's parameters; OAuthError for anything else or a repeat."""
    req = bottle.request
    if req.content_type.split(";")[0].strip().lower() != "application/x-www-form-urlencoded":
        raise OAuthError("invalid_request", "send the parameters form-encoded")
    if req.content_length > max_bytes:
        raise OAuthError("invalid_request", f"the body is over {max_bytes} bytes", 413)
    raw = req.body.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise OAuthError("invalid_request", f"the body is over {max_bytes} bytes", 413)
    try:
        pairs = urllib.parse.parse_qsl(
            raw.decode("utf-8"), keep_blank_values=True, max_num_fields=40
        )
    except (UnicodeDecodeError, ValueError):
        raise OAuthError("invalid_request", "the body is not a UTF-8 form") from None
    params: dict = {}
    for name, value in pairs:
        if name in params:
            raise OAuthError("invalid_request", f"'{name[:40]}' is given twice")
        params[name] = value
    basic = request_header("Authorization", "")
    if basic[:6].lower() == "basic " and "client_id" not in params:  # a client id sent that way
        with contextlib.suppress(ValueError, UnicodeDecodeError):
            decoded = base64.b64decode(basic[6:].strip(), validate=True).decode("utf-8")
            params["client_id"] = urllib.parse.unquote(decoded.partition(":")[0])
    return params


def oauth_token(svc: Service) -> bytes:
    """POST /oauth/token: authorization_code (PKCE S256) and refresh_token grants."""
    try:
        p = _form()
        grant_type = p.get("grant_type", "")
        if grant_type == "authorization_code":
            answer = svc.grants.redeem(
                p.get("code", ""),
                p.get("client_id", ""),
                p.get("redirect_uri", ""),
                p.get("code_verifier", ""),
                p.get("resource"),
            )
        elif grant_type == "refresh_token":
            if not p.get("client_id"):
                raise OAuthError("invalid_request", "client_id is required")
            answer = svc.grants.refresh(
                p.get("refresh_token", ""), p["client_id"], p.get("resource"), p.get("scope")
            )
        elif not grant_type:
            raise OAuthError("invalid_request", "grant_type is required")
        else:
            raise OAuthError(
                "unsupported_grant_type", "grant_type: authorization_code or refresh_token"
            )
    except OAuthError as e:
        return _oauth_failure(e)
    return _oauth_answer(answer)


def oauth_register(svc: Service) -> bytes:
    """POST /oauth/register: Dynamic Client Registration of a public client (RFC 7591)."""
    try:
        try:
            meta = read_json(65536)
        except ApiError as e:
            raise OAuthError("invalid_client_metadata", e.message, e.status_code) from None
        answer = svc.grants.register_client(meta, svc.client_addr(bottle.request.environ))
    except OAuthError as e:
        return _oauth_failure(e)
    return _oauth_answer(answer, 201)


def oauth_revoke(svc: Service) -> bytes:
    """POST /oauth/revoke (RFC 7009): the token's whole grant ends; unknown tokens are fine."""
    try:
        p = _form()
        if not p.get("token"):
            raise OAuthError("invalid_request", "token is required")
    except OAuthError as e:
        return _oauth_failure(e)
    svc.grants.revoke_token(p["token"], p.get("client_id", ""))
    return _oauth_answer({})


def get_consent_page(svc: Service):
    bottle.response.content_type = "text/html; charset=utf-8"
    for name, value in consent_page_headers().items():
        bottle.response.set_header(name, value)
    return consent_page()


def _check_client(svc: Service, client_id: Any, redirect_uri: Any) -> dict:
    """Return the client of an authorisation request; 404 / 400 saying what is wrong.

    These are shown on the consent page and never redirected to.
    """
    try:
        return svc.grants.check_request(client_id, redirect_uri)
    except OAuthError as e:
        if e.error == "invalid_client" and "registered" in e.description:
            raise not_found(e.description) from None
        raise bad_request(e.description) from None


def _error_redirect(
    redirect_uri: str, error: str, description: str, state: str, issuer: str
) -> str:
    params = {"error": error, "error_description": description, "iss": issuer}
    if state:
        params["state"] = state
    sep = "&" if urllib.parse.urlsplit(redirect_uri).query else "?"
    return redirect_uri + sep + urllib.parse.urlencode(params)


def oauth_consent(svc: Service) -> dict:
    """GET /api/v1/oauth/consent: what the consent page shows for an authorisation request."""
    public_limit(svc)
    env = bottle.request.environ
    q = {
        name: query_str(name)
        for name in (
            "client_id",
            "redirect_uri",
            "response_type",
            "state",
            "code_challenge",
            "code_challenge_method",
            "scope",
            "resource",
        )
    }
    client = _check_client(svc, q["client_id"], q["redirect_uri"])
    issuers = oauth_issuers(svc, env)
    resource = q["resource"] if q["resource"] in issuers else mcp_resource(svc, env)
    issuer = issuers[resource]
    problem = ""
    if q["response_type"] != "code":
        problem = "response_type must be code"
    elif q["code_challenge_method"] != "S256":
        problem = "PKCE is required: code_challenge_method=S256"
    elif not CHALLENGE_RE.match(q["code_challenge"]):
        problem = "code_challenge must be 43 base64url characters (S256)"
    elif q["resource"] and q["resource"] != resource:
        problem = f"this server's MCP resource is {resource}"
    elif len(q["state"]) > 1024:
        problem = "state is longer than 1024 characters"
    if problem:  # the client is known and its redirect URI registered: tell it there
        err = bad_request(problem)
        err.extra = {
            "redirect": _error_redirect(
                q["redirect_uri"], "invalid_request", problem, q["state"][:1024], issuer
            )
        }
        raise err
    write = svc.config.mcp_write
    return {
        "client": {"id": client["id"], "name": client["name"], "uri": client.get("uri") or ""},
        "redirectUri": q["redirect_uri"],
        "redirectHost": urllib.parse.urlsplit(q["redirect_uri"]).netloc,
        "scope": "write" if write and parse_oauth_scope(q["scope"]) == "write" else "read",
        "writeAllowed": write,
        "resource": resource,
        "deny": _error_redirect(
            q["redirect_uri"], "access_denied", "the owner denied the request", q["state"], issuer
        ),
    }


def approve_oauth(svc: Service) -> dict:
    """POST /api/v1/oauth/approve (the owner, or a person: their connector, within their
    reach): an authorisation code for the client."""
    body = read_json(svc.config.max_body_bytes)
    env = bottle.request.environ
    client_id = field(body, "clientId", max_len=2000)
    redirect_uri = field(body, "redirectUri", max_len=2000)
    state = field(body, "state", required=False, max_len=1024) or ""
    challenge = field(body, "codeChallenge", max_len=128)
    scope = field(body, "scope", max_len=200)
    resource = field(body, "resource", required=False, max_len=2000) or mcp_resource(svc, env)
    folder = _grant_folder(body)
    client = _check_client(svc, client_id, redirect_uri)
    if not CHALLENGE_RE.match(challenge):
        raise bad_request("'codeChallenge' must be 43 base64url characters (PKCE S256)")
    words = set(scope.split())
    if not words or not words <= set(OAUTH_SCOPES):
        raise bad_request("'scope' must be notes:read or notes:read notes:write")
    wanted = parse_oauth_scope(scope)
    if wanted == "write" and not svc.config.mcp_write:
        raise ApiError(403, "FORBIDDEN", "notes:write needs SERVICE_MCP_WRITE=true on the server")
    issuers = oauth_issuers(svc, env)
    if resource not in issuers:
        raise bad_request(f"'resource' must be this server's MCP URL, {mcp_resource(svc, env)}")
    grant = {
        "challenge": challenge,
        "scope": wanted,
        "folder": folder,
        "resource": resource,
        "createdBy": made_by(request_principal()),  # the owner, or the admin device
        "person": request_principal().person,  # a person's admin device: their connector
    }
    redirect = svc.grants.approve(client, redirect_uri, grant, state, issuers[resource])
    log.info("OAuth request of %s approved (%s)", log_safe(client["name"], 100), wanted)
    return {"redirect": redirect}


# -- relay pairing (this server as its own relay) -------------------------------------


def pair_relay_code(svc: Service, code: str) -> dict:
    st = svc.state.read()
    if not hmac.compare_digest(code.lower().encode(), st["relayCode"].encode()):
        raise not_found("no server is paired under this relay code")
    relay = svc.relay_base(bottle.request.environ)
    return {"serverId": st["serverId"], "relayApiBase": f"{relay}{API}"}
