"""Handlers for channels, reminders, plugins, the security audit, import, export, the page."""

from __future__ import annotations

import dataclasses
import re
import secrets
import tempfile
from collections.abc import Iterable
from typing import Any

from notesvc.audit import key_age_days, run_audit
from notesvc.auth import JWT_LIFETIME
from notesvc.boot import API, KEY_HEADER, bottle, log
from notesvc.errors import ApiError, bad_request, not_found, ok
from notesvc.grants import NOWHERE, made_by, request_principal
from notesvc.helpers import (
    BODY_CHUNK,
    MultipartReader,
    disk_writes,
    field,
    is_blank,
    iso,
    plural,
    query_int,
    query_str,
    read_json,
    request_body_reader,
    request_header,
    too_large,
    utcnow,
    yes_or_no,
)
from notesvc.http.access import qr_svg
from notesvc.http.api import MULTIPART_SLACK, agent_facts, limit_facts, network_facts
from notesvc.http.route import Route
from notesvc.plugins import Plugin
from notesvc.providers.base import MAX_MESSAGE_CHARS, UpstreamError
from notesvc.providers.channels import (
    MAX_CONFIG_CHARS,
    TelegramError,
    change_channel,
    channel_chats,
    channel_secret,
    channels_of,
    configure_channel,
    handle_channel_update,
    live_links,
    new_binding,
    new_link,
    note_chat_makers,
    person_channel,
    printable,
    redact_channel,
    telegram_call,
    unlink_chats,
    validate_channel_config,
)
from notesvc.search.text import MAX_QUERY_CHARS
from notesvc.service import Service, current_request_id
from notesvc.transfer.export import ExportCut, export_files, export_zip
from notesvc.transfer.formats import run_import
from notesvc.transfer.plan import import_settled
from notesvc.web import negotiated_page, web_client_headers

# -- channels ----------------------------------------------------------------------------------


def list_channel_providers(svc: Service) -> dict:
    return {
        "providers": [
            {
                "name": p.name,
                "description": p.description,
                "fields": [dataclasses.asdict(f) for f in p.fields],
                "allowlistField": p.allow,
                "webhookPath": f"{API}/channels/webhook/{p.name}",
            }
            for p in svc.channel_providers.values()
        ]
    }


def list_channels(svc: Service) -> dict:
    """GET /channels: the owner's every channel (redacted); a person's, the channels a chat
    of theirs may join, with their own chats only."""
    person, provs = request_principal().person, svc.channel_providers
    if person:
        return {
            "channels": [
                person_channel(c, person)
                for c in channels_of(svc)
                if _linkable(svc, c) or any(x["person"] == person for x in c.get("linkedChats", []))
            ]
        }
    return {
        "channels": [
            {**redact_channel(c, svc.channel_providers), "chats": channel_chats(c, provs)}
            for c in channels_of(svc)
        ]
    }


def _linkable(svc: Service, channel: dict) -> bool:
    """Return whether a person's chat may join a channel: switched on, with an allowlist
    (or closed until a code connects a chat); never one that answers anyone."""
    prov = svc.channel_providers.get(channel["provider"])
    if prov is None or not prov.allow or not channel["enabled"]:
        return False
    return bool(channel["config"].get(prov.allow)) or "binding" in channel


def link_channel(svc: Service, channel_id: str) -> dict:
    """POST /channels/:id/link: a code a chat sends the bot, ten minutes, once; that chat
    acts as the key that asked from then on (a person's: their reach, their places)."""
    who = request_principal()
    code, link = new_link(who)
    made = link["createdBy"]

    def apply(channels: list, i: int) -> dict:
        channel = channels[i]
        if not _linkable(svc, channel):
            raise ApiError(
                409,
                "CONFLICT",
                "no chat can join this channel now: it is switched off, or answers anyone "
                "(the owner gives it an allowlist first)",
            )
        waiting = [  # one code waits per person (the owner's: per key)
            x
            for x in live_links(channel)
            if x["person"] != link["person"] or (not x["person"] and x["createdBy"] != made)
        ]
        channel["links"] = [*waiting, link]
        return channel

    if not any(c["id"] == channel_id for c in channels_of(svc)):
        raise not_found(f"no channel {channel_id}")
    channel = change_channel(svc, channel_id, apply)
    log.info("channel %s: a chat link for %s", channel_id, who.person or "the owner")
    answer = {"bindCode": code, "expiresAt": link["until"]}
    if channel.get("bot"):
        answer.update(bot=channel["bot"], link=f"https://t.me/{channel['bot']}?start={code}")
        svg = qr_svg(answer["link"])
        if svg:
            answer["qrSvg"] = svg
    bottle.response.status = 201
    return {**answer, "channel": person_channel(channel, link["person"])}


def unlink_channel(svc: Service, channel_id: str) -> dict:
    """DELETE /channels/:id/link: the chats linked for the caller's person (the owner: the
    ones the owner's keys linked) leave the channel, and their codes that wait end."""
    person = request_principal().person or None

    def apply(channels: list, i: int) -> list:
        prov = svc.channel_providers.get(channels[i]["provider"])
        return unlink_chats(channels[i], prov, person) if prov and prov.allow else []

    gone = change_channel(svc, channel_id, apply)
    return {"id": channel_id, "unlinked": gone}


def create_channel(svc: Service) -> dict:
    body = read_json(svc.config.max_body_bytes)
    name = field(body, "provider")
    provider = svc.channel_providers.get(name)
    if provider is None:
        raise bad_request(f"'provider' must be one of {', '.join(svc.channel_providers)}")
    config = validate_channel_config(provider, body.get("config", {}))
    title = field(body, "name", required=False, max_len=100) or f"{name} channel"
    return add_channel(svc, name, config, title)


def add_channel(svc: Service, name: str, config: dict, title: str, **extra) -> dict:
    """Store a new channel (config already checked) and start what it needs; return it."""
    # Through a relay (or this server's own /r/<id> prefix) the hook must go that way too.
    base = svc.issuer(bottle.request.environ)
    channel = {
        "id": "ch_" + secrets.token_hex(6),
        "provider": name,
        "name": printable(title),
        "enabled": True,
        "createdAt": iso(utcnow()),
        "webhookUrl": f"{base}{API}/channels/webhook/{name}",
        "secret": secrets.token_urlsafe(24),
        "config": config,
        **extra,
    }
    maker = made_by(request_principal())  # the chats it allows are theirs (unbind_chats)
    note_chat_makers(channel, svc.channel_providers.get(name), [], maker)
    svc.state.update(lambda data: data.setdefault("channels", []).append(channel))
    log.info("channel %s (%s) created", channel["id"], name)
    channel = configure_channel(svc, channel)  # Telegram webhook mode: setWebhook
    svc.pollers.sync()
    return channel


TELEGRAM_TOKEN_RE = re.compile(r"^[0-9]{1,20}:[A-Za-z0-9_-]{1,200}\Z")  # BotFather's shape


def connect_telegram(svc: Service) -> dict:
    """POST /channels/connect/telegram {botToken, name?}: the web client's "Connect
    Telegram". The token is checked with getMe first (refused: 400, Telegram unreachable:
    502; nothing is stored either way); then a polling channel that no chat may use until
    one sends the bind code (10 minutes), which connects that chat alone."""
    body = read_json(svc.config.max_body_bytes)
    token = field(body, "botToken", max_len=MAX_CONFIG_CHARS).strip()
    if not TELEGRAM_TOKEN_RE.match(token):
        raise bad_request("'botToken' must be the token BotFather gave you (123456:ABC...)")
    try:
        bot = telegram_call(svc, {"botToken": token}, "getMe", {}, timeout=15)
    except TelegramError as e:
        raise bad_request(
            f"Telegram refused this token ({e}); copy it again from @BotFather"
        ) from None
    except UpstreamError as e:
        raise ApiError(502, "UPSTREAM_ERROR", f"Telegram cannot be reached: {e}") from None
    bot = bot if isinstance(bot, dict) else {}
    username = printable(str(bot.get("username") or ""), 64)
    title = field(body, "name", required=False, max_len=100) or f"@{username or 'telegram'}"
    config = validate_channel_config(
        svc.channel_providers["telegram"],
        {"botToken": token, "mode": "polling", "notify": True},
    )
    code, binding = new_binding(made_by(request_principal()))
    channel = add_channel(svc, "telegram", config, title, binding=binding, bot=username)
    return bind_answer(svc, channel, code, binding)


def bind_answer(svc: Service, channel: dict, code: str, binding: dict) -> dict:
    """Return what the web client shows to connect a chat: the code, the bot's t.me link
    that sends it (and its QR code), until when it works."""
    username = channel.get("bot") or ""
    link = f"https://t.me/{username}?start={code}" if username else ""
    answer = {
        "channel": redact_channel(channel, svc.channel_providers),
        "bindCode": code,
        "bindUntil": binding["until"],
        "bot": username,
        "link": link,
    }
    svg = qr_svg(link) if link else None
    if svg:
        answer["qrSvg"] = svg
    return answer


def bind_channel(svc: Service, channel_id: str) -> dict:
    """POST /channels/:id/bind: a new bind code; the next chat to send it replaces the
    allowed chats (the ones allowed now keep working until then)."""
    code, binding = new_binding(made_by(request_principal()))

    def apply(channels: list, i: int) -> dict:
        if channels[i]["provider"] != "telegram":
            raise bad_request("only a Telegram channel is connected by a code")
        channels[i]["binding"] = binding
        return channels[i]

    channel = change_channel(svc, channel_id, apply)
    return bind_answer(svc, channel, code, binding)


def get_channel(svc: Service, channel_id: str) -> dict:
    """Return one channel, redacted, with the last senders its allowlist refused."""
    for channel in channels_of(svc):
        if channel["id"] == channel_id:
            refused = channel.get("refusedSenders", [])
            chats = channel_chats(channel, svc.channel_providers)  # whose each chat is
            shown = redact_channel(channel, svc.channel_providers)
            return {**shown, "chats": chats, "refusedSenders": refused}
    raise not_found(f"no channel {channel_id}")


def patch_channel(svc: Service, channel_id: str) -> dict:
    """Merge {name?, config?} into a channel (validated as on create; the secret stays)."""
    if not any(c["id"] == channel_id for c in channels_of(svc)):  # 404 before the body's 400
        raise not_found(f"no channel {channel_id}")
    body = read_json(svc.config.max_body_bytes)
    unknown = sorted(set(body) - {"name", "config"})
    if unknown:
        raise bad_request(f"unknown field(s): {', '.join(unknown)}; send name and/or config")
    if not body:
        raise bad_request("nothing to change: send name and/or config")
    title = field(body, "name", required=False, max_len=100)
    if title is not None and is_blank(title):
        raise bad_request("'name' must not be empty")
    changes = field(body, "config", dict, required=False)
    maker = made_by(request_principal())

    def merge(channels: list, i: int) -> dict:
        channel = channels[i]
        if changes is not None:
            provider = svc.channel_providers.get(channel["provider"])
            if provider is None:
                raise bad_request(f"channel provider {channel['provider']!r} is not loaded")
            stored = channel["config"]
            before = list(stored.get(provider.allow) or []) if provider.allow else []
            if "mode" not in stored and any(f.name == "mode" for f in provider.fields):
                stored = {**stored, "mode": "webhook"}  # stored before modes: a webhook
            channel["config"] = validate_channel_config(provider, {**stored, **changes})
            note_chat_makers(channel, provider, before, maker)
        if title is not None:  # only invisible characters: the name it had stays
            channel["name"] = printable(title) or channel["name"]
        return channel

    channel = change_channel(svc, channel_id, merge)
    log.info("channel %s changed", channel_id)
    svc.pollers.sync(join=15)  # a poller that goes is done before a webhook is set
    if changes is not None:
        channel = configure_channel(svc, channel)  # webhook mode: setWebhook again
    return redact_channel(channel, svc.channel_providers)


def toggle_channel(svc: Service, channel_id: str) -> dict:
    def flip(channels: list, i: int) -> dict:
        channels[i]["enabled"] = not channels[i]["enabled"]
        return channels[i]

    channel = change_channel(svc, channel_id, flip)
    svc.pollers.sync()
    return redact_channel(channel, svc.channel_providers)


def delete_channel(svc: Service, channel_id: str) -> dict:
    change_channel(svc, channel_id, lambda channels, i: channels.pop(i))
    svc.pollers.sync()
    return {"id": channel_id, "deleted": True}


def receive_webhook(svc: Service, provider: str) -> dict:
    prov = svc.channel_providers.get(provider)
    if prov is None:
        raise not_found(f"no channel provider {provider!r}")
    env = bottle.request.environ
    limit = svc.config.max_body_bytes
    signature = ""
    if prov.signature_header:
        signature = env.get("HTTP_" + prov.signature_header.upper().replace("-", "_"), "")

    def raw() -> bytes:  # the body as signed: read (and checked) as JSON, then as bytes
        read_json(limit)
        return bottle.request.body.read(limit + 1)

    return handle_channel_update(
        svc,
        prov,
        channel_secret(svc, prov, env),
        svc.client_addr(env),
        lambda: read_json(limit),
        signature,
        raw,
    )


def verify_webhook(svc: Service, provider: str):
    """GET /channels/webhook/<provider>: the provider's own subscription check."""
    prov = svc.channel_providers.get(provider)
    if prov is None or prov.verify is None:
        raise not_found(f"channel provider {provider!r} has no subscription check")
    return prov.verify(svc)


# -- reminders -----------------------------------------------------------------------------


def list_reminders(svc: Service) -> dict:
    """The reminders not sent yet (⏰ lines and `remind:`), soonest first."""
    limit = query_int("limit", 100, 1, 1000)
    offset = query_int("offset", 0, 0, 10**9)
    sees = request_principal().sees  # a folder grant: its folder's reminders
    pending = [r for r in svc.reminders.upcoming() if sees(r["path"])]
    return {
        "reminders": [
            {
                "id": r["id"],
                "path": r["path"],
                "title": r["title"],
                "line": r["line"],
                "due": iso(r["due"]),
                "local": r["wall"],
            }
            for r in pending[offset : offset + limit]
        ],
        "total": len(pending),
        "limit": limit,
        "offset": offset,
        "timeZone": svc.config.timezone or "system",
    }


# -- plugins -------------------------------------------------------------------------------


def plugin_info(svc: Service, plugin: Plugin) -> dict:
    return {
        "name": plugin.name,
        "version": plugin.version,
        "description": plugin.description,
        "enabled": svc.plugin_enabled(plugin.name),
        "builtin": plugin.builtin,
        "error": plugin.error or svc.plugin_errors.get(plugin.name),
        "hooks": sorted(plugin.hooks),
        "routes": [f"{r.method} {API}/plugins/{plugin.name}{r.path}" for r in plugin.routes],
    }


def _plugin(svc: Service, name: str) -> Plugin:
    plugin = svc.plugins.get(name)
    if plugin is None:
        raise not_found(f"no plugin {name!r}")
    return plugin


def list_plugins(svc: Service) -> dict:
    return {"plugins": [plugin_info(svc, p) for p in svc.plugins.values()]}


def get_plugin(svc: Service, name: str) -> dict:
    """The plugin's record; a plugin's own page (route "") adds its data when it is on."""
    plugin = _plugin(svc, name)
    info = plugin_info(svc, plugin)
    page = next((r for r in plugin.routes if r.method == "GET" and r.path == ""), None)
    who = request_principal()  # a grant sees a page its scope allows, a folder grant a built-in's
    allowed = page and who.allows(page.scope) and (plugin.builtin or who.whole)
    if allowed and info["enabled"]:
        info.update(page.handler(svc))
    return info


def toggle_plugin(svc: Service, name: str) -> dict:
    plugin = _plugin(svc, name)
    if plugin.error and plugin.name not in svc.plugin_errors:
        raise ApiError(409, "CONFLICT", f"plugin {name} did not load: {plugin.error}")
    enabled = not svc.plugin_enabled(name)
    svc.state.update(lambda data: data.setdefault("plugins", {}).__setitem__(name, enabled))
    svc.plugin_errors.pop(name, None)
    return plugin_info(svc, plugin)


def plugin_routes(plugins: Iterable[Plugin]) -> tuple:
    """Return the Routes of the plugins' own endpoints, each refusing while it is off."""
    routes = []
    for plugin in plugins:
        for r in plugin.routes:
            if r.method == "GET" and r.path == "":
                continue  # served by get_plugin

            def guarded(svc: Service, _name=plugin.name, _handler=r.handler, **kwargs):
                if not svc.plugin_enabled(_name):
                    raise ApiError(403, "PLUGIN_DISABLED", f"plugin {_name} is switched off")
                return _handler(svc, **kwargs)

            guarded.__name__ = re.sub(r"\W+", "_", f"{plugin.name}_{r.handler.__name__}")
            routes.append(
                Route(
                    r.method,
                    f"/plugins/{plugin.name}{r.path}",
                    guarded,
                    summary=r.summary,
                    status=r.status,
                    params=r.params,
                    tag="plugins",
                    scope=r.scope,
                    secret=r.secret,
                )
            )
    return tuple(routes)


# -- security ------------------------------------------------------------------------------


def security_audit(svc: Service) -> dict:
    return run_audit(svc)


def security_config(svc: Service) -> dict:
    cfg, st = svc.config, svc.state.read()
    channels = st.get("channels", [])
    return {
        "auth": {
            "mode": cfg.auth_mode,
            "header": KEY_HEADER,
            "jwt": {"enabled": cfg.auth_mode == "jwt", "tokenLifetimeSeconds": JWT_LIFETIME},
            "keyCreatedAt": st.get("keyCreatedAt", ""),
            "keyAgeDays": key_age_days(st),
            "keyComparison": "constant-time (SHA-256 digests, hmac.compare_digest)",
        },
        "setup": {
            "complete": bool(st.get("setupComplete")),
            "localOnly": svc.setup_loopback_only,
            "windowSeconds": cfg.setup_window,
            "linkedClients": len(st.get("linkedClients", [])),
        },
        "network": {"bindHost": cfg.host, **network_facts(cfg), "pairingMode": cfg.pairing},
        "limits": {
            **limit_facts(svc),
            "maxQueryChars": MAX_QUERY_CHARS,
            "maxMessageChars": MAX_MESSAGE_CHARS,
        },
        "channels": {
            "count": len(channels),
            "enabled": sum(bool(c["enabled"]) for c in channels),
            "withoutAllowlist": sum(
                1
                for c in channels
                if c["provider"] in svc.channel_providers
                and not c["config"].get(svc.channel_providers[c["provider"]].allow)
            ),
        },
        "plugins": {
            "count": len(svc.plugins),
            "thirdParty": sum(not p.builtin for p in svc.plugins.values()),
            "enabled": sum(svc.plugin_enabled(n) for n in svc.plugins),
        },
        "agent": agent_facts(cfg),
        "grants": svc.grants.counts(),
    }


def security_recommendations(svc: Service) -> dict:
    return {
        "recommendations": [
            {
                "id": f["id"],
                "severity": f["severity"],
                "title": f["title"],
                "action": f["recommendation"],
            }
            for f in run_audit(svc)["findings"]
            if f["severity"] != "info"
        ]
    }


# -- import and export (docs/api.md: Import) -------------------------------------------------------

IMPORT_BODY_TYPES = {  # a raw body's type -> the file name it stands for
    "application/zip": "import.zip",
    "application/x-zip-compressed": "import.zip",
    "application/xml": "import.enex",
    "text/xml": "import.enex",
    "application/enex+xml": "import.enex",
    "application/x-tar": "import.jex",
    "application/json": "import.json",
    "text/markdown": "import.md",
    "text/plain": "import.txt",
    "application/octet-stream": "",
}


def post_import(svc: Service) -> bytes:
    """POST /import: a zip, .enex, .jex or Keep .json, as the multipart field `file` (with
    `into`, `dryRun`) or as the raw body (?into=&dryRun=); 201, a dry run 200."""
    import email.message

    parsed = email.message.Message()
    parsed["Content-Type"] = request_header("Content-Type") or ""
    ctype = parsed.get_content_type()
    limit = svc.config.max_import_bytes
    fields = {"into": query_str("into"), "dryRun": query_str("dryRun")}
    if ctype != "multipart/form-data" and ctype not in IMPORT_BODY_TYPES:
        raise ApiError(
            415,
            "UNSUPPORTED_MEDIA_TYPE",
            "send the file as multipart/form-data (field file), or as a raw body of type "
            "application/zip, application/xml (.enex) or application/x-tar (.jex)",
        )
    with disk_writes():
        spool = tempfile.TemporaryFile(dir=svc.config.state_dir)  # noqa: SIM115 (closed below)
    try:
        with disk_writes():
            if ctype == "multipart/form-data":
                filename = _receive_import_form(svc, parsed, spool, fields)
            else:
                filename = IMPORT_BODY_TYPES[ctype]
                read, _ = request_body_reader(limit, "SERVICE_MAX_IMPORT_BYTES")
                while chunk := read(BODY_CHUNK):
                    spool.write(chunk)
            spool.flush()
        spool.seek(0)
        dry = yes_or_no(fields["dryRun"], "dryRun")
        into = fields["into"] or None
        report = run_import(svc, spool, filename, into, dry, request_principal())
    finally:
        spool.close()
        import_settled()
    log.info(
        "request %s: import%s of %s and %s into %s (%d skipped)",
        current_request_id(),
        " (dry run)" if dry else "",
        plural(report["created"], "note"),
        plural(report["attachments"], "file"),
        report["into"],
        len(report["skipped"]),
    )
    return ok(report, 200 if dry else 201)


def _receive_import_form(svc: Service, parsed: Any, spool: Any, fields: dict) -> str:
    """Read a multipart import: its `file` into spool, `into` and `dryRun` into fields;
    return the file's name."""
    limit = svc.config.max_import_bytes
    read, _ = request_body_reader(limit + MULTIPART_SLACK, "SERVICE_MAX_IMPORT_BYTES")
    reader = MultipartReader(read, str(parsed.get_param("boundary") or ""))
    form: dict = {"into": bytearray(), "dryRun": bytearray(), "file": None}

    def part(name: str, filename: Any, headers: Any):
        if name in ("into", "dryRun"):
            return form[name].extend, 2048, lambda: bad_request(f"'{name}' is too long")
        if name != "file":
            return None
        if form["file"] is not None:
            raise bad_request("send one part named 'file'")
        form["file"] = str(filename or "")
        return spool.write, limit, lambda: too_large(limit, "SERVICE_MAX_IMPORT_BYTES")

    reader.parts(part)
    if form["file"] is None:
        raise bad_request("the form has no part named 'file'")
    for name in ("into", "dryRun"):
        if form[name]:
            try:
                fields[name] = bytes(form[name]).decode("utf-8").strip()
            except UnicodeDecodeError:
                raise bad_request(f"'{name}' is not valid UTF-8") from None
    return form["file"]


def get_export(svc: Service):
    """GET /export.zip: the notes, attachments and other files the key sees, streamed."""
    principal = request_principal()
    env = bottle.request.environ
    if env.get("notesvc.relayed") and not env.get("notesvc.spliced"):  # bounded by the relay
        total = sum(st.st_size for _, _, st in export_files(svc.config.root, principal))
        if total > svc.config.max_body_bytes:
            raise too_large_for_relay(total, svc.config.max_body_bytes)
    stamp = utcnow().strftime("%Y-%m-%d")
    resp = bottle.response
    resp.content_type = "application/zip"
    resp.set_header("Content-Disposition", f'attachment; filename="notesvc-export-{stamp}.zip"')
    resp.set_header("Cache-Control", "no-store")
    shown = [f for f in principal.folders if f != NOWHERE]  # (a reach of nothing: none)
    what = "every note" if principal.whole else ", ".join(shown) or "nothing"
    log.info("request %s: export of %s", current_request_id(), what)

    def still(name: str) -> bool:  # a person removed, a share removed, while it streams
        now = svc.grants.current(principal.grant_id) if principal.grant_id else principal
        if now is None:
            log.info("export ended: its key was revoked while it streamed")
            raise ExportCut
        return now.sees(name)

    return export_zip(svc.config.root, principal, still=still)


def too_large_for_relay(size: int, limit: int) -> ApiError:
    return ApiError(
        413,
        "PAYLOAD_TOO_LARGE",
        f"the export holds {size} bytes, more than the relay carries ({limit}, "
        "SERVICE_MAX_BODY_BYTES): export on the server's own address, or run "
        "python3 notesvc.py export OUT.zip there",
    )


# -- the built-in web client (GET /) ----------------------------------------------------


def get_web_client(svc: Service):
    """GET /: the page, gzipped once at start and sent so when asked (a HEAD as not)."""
    env = bottle.request.environ
    asked = env.get("HTTP_ACCEPT_ENCODING", "") if env["REQUEST_METHOD"] != "HEAD" else ""
    body, headers = negotiated_page("client", asked)
    bottle.response.content_type = "text/html; charset=utf-8"
    for name, value in {**web_client_headers(), **headers}.items():
        bottle.response.set_header(name, value)
    return body
