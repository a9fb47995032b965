"""Channel providers, the channels' state and the channel pipeline."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import hmac
import json
import re
import secrets
import time
import urllib.parse
from collections.abc import Mapping
from typing import Any, Callable

from notesvc.boot import bottle, log
from notesvc.errors import ApiError, bad_request, not_found, to_json
from notesvc.grants import (
    MADE_BY_OWNER,
    Principal,
    acting_as,
    epoch_of,
    made_by,
    made_by_grant,
    request_principal,
)
from notesvc.helpers import is_blank, iso, key_hash, query_str, redact, scrub, utcnow
from notesvc.notes.paths import DAILY_FOLDER, NOTES, folder_path
from notesvc.providers.agent import ask_agent
from notesvc.providers.base import (
    REPLY_LIMIT,
    Outbound,
    UpstreamError,
    clip,
    post_json,
    registry_of,
)
from notesvc.providers.capture import capture_media, capture_note, local_now
from notesvc.search.text import Query
from notesvc.service import Service

# -- channel providers ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ConfigField:
    name: str
    kind: str  # "string", "list", "boolean", "choice" (one of `choices`) or "folder" (notes/...)
    required: bool = False
    secret: bool = False
    help: str = ""
    choices: tuple = ()
    default: Any = None  # of a field left out ("choice": its first choice unless given)

    def empty(self) -> Any:
        """Return the value a field left out takes."""
        if self.default is not None:
            return self.default
        first = self.choices[0] if self.choices else ""
        return {"list": [], "boolean": False}.get(self.kind, first)


MAX_CONFIG_CHARS = 512  # of one string in a channel's config

ParseFn = Callable[[dict], list]  # payload -> [(sender, text[, display name])]
SendFn = Callable[[Any, dict, str, str], None]  # (svc, config, sender, text)


@dataclasses.dataclass(frozen=True)
class ChannelProvider:
    name: str
    fields: tuple  # ConfigField
    # (payload) -> [(sender, text)] or [(sender, text, sender's display name)]; text None
    # for an update without text. Plugins' 2-tuples keep working.
    parse: ParseFn
    send: SendFn | None  # raises UpstreamError
    allow: str = ""  # the config field holding the sender allowlist
    description: str = ""
    secret_header: str = ""  # a header the provider itself sends the channel secret in
    # GET /channels/webhook/<name>: the provider's subscription check, (svc) -> text
    verify: Callable | None = None
    verify_params: tuple = ()  # its query parameters (OpenAPI)
    # Meta-style signed webhooks: the header carrying "sha256=<HMAC of the raw body>" and
    # the config field holding the key; a channel with the key set needs the signature.
    signature_header: str = ""
    signing_field: str = ""
    # (svc, config, offset, wait, outbound) -> [(next offset, update)]: the channel can
    # fetch its own updates (config.mode "polling", see ChannelPollers)
    poll: Callable | None = None
    # (svc, config, media, write, limit): stream one media item of an update to write()
    fetch: Callable | None = None
    # (svc, channel) -> what it did, or None: the provider's side of a create or PATCH
    # (Telegram's setWebhook); raises UpstreamError, shown as the channel's `status`
    configure: Callable | None = None


CHANNEL_PROVIDERS: dict[str, ChannelProvider] = {}


def channel_provider(
    name: str,
    fields: tuple,
    allow: str = "",
    description: str = "",
    secret_header: str = "",
    signature_header: str = "",
    signing_field: str = "",
) -> Callable[[ParseFn], ParseFn]:
    """Register a channel provider: the decorated function parses inbound updates.

    A parser returns [(sender, text)], [(sender, text, display name)] or, with files,
    [(sender, text or caption, display name, [media])]; a media item is a dict with
    `kind` (photo, voice, audio, document, video, video_note, image), `id`, and where
    known `mime`, `name` and `size`.
    """

    def register(parse: ParseFn) -> ParseFn:
        provider = ChannelProvider(
            name,
            fields,
            parse,
            None,
            allow,
            description,
            secret_header,
            signature_header=signature_header,
            signing_field=signing_field,
        )
        registry_of("channel", CHANNEL_PROVIDERS)[name] = provider
        return parse

    return register


def _registered_channel(name: str) -> tuple:
    registry = registry_of("channel", CHANNEL_PROVIDERS)
    if name not in registry:
        raise KeyError(f"register channel provider {name!r} before its sender or check")
    return registry, registry[name]


def channel_part(name: str, part: str, **extra: Any) -> Callable:
    """Register one part of channel provider `name` (registered first): the decorated
    function becomes its `part` (send, verify, poll, fetch or configure), with `extra`
    fields beside it."""

    def register(fn: Callable) -> Callable:
        registry, provider = _registered_channel(name)
        registry[name] = dataclasses.replace(provider, **{part: fn}, **extra)
        return fn

    return register


def channel_sender(name: str) -> Callable[[SendFn], SendFn]:
    """Register the function that sends replies through channel provider `name`."""
    return channel_part(name, "send")


def channel_verifier(name: str, params: tuple = ()) -> Callable:
    """Register the provider's answer to GET /channels/webhook/<name> (a subscription check)."""
    return channel_part(name, "verify", verify_params=params)


def channel_poller(name: str) -> Callable:
    """Register how provider `name` fetches its own updates (channels in polling mode)."""
    return channel_part(name, "poll")


def channel_fetcher(name: str) -> Callable:
    """Register how provider `name` downloads the photos, voice and files of an update."""
    return channel_part(name, "fetch")


def channel_configurer(name: str) -> Callable:
    """Register what provider `name` does when one of its channels is created or changed."""
    return channel_part(name, "configure")


def channel_mode(channel: dict) -> str:
    """Return a channel's mode: "polling" or "webhook" (a channel stored before modes
    existed, or of a provider without them, is a webhook channel)."""
    return channel.get("config", {}).get("mode") or "webhook"


def validate_channel_config(provider: ChannelProvider, config: Any) -> dict:
    """Return config checked against the provider's fields; 400 naming what is wrong."""
    if not isinstance(config, dict):
        raise bad_request("'config' must be an object")
    known = {f.name: f for f in provider.fields}
    unknown = sorted(set(config) - set(known))
    if unknown:
        raise bad_request(f"unknown config field(s) for {provider.name}: {', '.join(unknown)}")
    out = {}
    for f in provider.fields:
        value = config.get(f.name)
        if value is None or value == [] or (isinstance(value, str) and is_blank(value)):
            if f.required:
                raise bad_request(f"config.{f.name} is required for {provider.name}")
            out[f.name] = f.empty()
            continue
        if f.kind == "boolean":
            if not isinstance(value, bool):
                raise bad_request(f"config.{f.name} must be true or false")
            out[f.name] = value
        elif f.kind == "choice":
            if value not in f.choices:
                raise bad_request(f"config.{f.name} must be one of {', '.join(f.choices)}")
            out[f.name] = value
        elif f.kind == "folder":
            if not isinstance(value, str) or len(value) > MAX_CONFIG_CHARS:
                raise bad_request(f"config.{f.name} must be a folder under {NOTES}/")
            out[f.name] = folder_path(value)
        elif f.kind == "list":
            if not isinstance(value, list) or not all(
                isinstance(v, (str, int)) and not isinstance(v, bool) for v in value
            ):
                raise bad_request(f"config.{f.name} must be a list of ids")
            out[f.name] = [str(v).strip() for v in value][:1000]
        else:
            if (
                not isinstance(value, str)
                or len(value) > MAX_CONFIG_CHARS
                or not value.isprintable()
            ):
                raise bad_request(f"config.{f.name} must be a short single-line string")
            out[f.name] = value.strip()
    return out


# -- channels' state: what providers and the pipeline share ---------------------------


def channels_of(svc: Service) -> list:
    return svc.state.read().get("channels", [])


def printable(text: str, limit: int = 100) -> str:
    """Return text without control characters, at most limit characters (names, log lines)."""
    return "".join(ch for ch in str(text) if ch.isprintable())[:limit]


def change_channel(svc: Service, channel_id: str, change: Callable) -> dict:
    def apply(data: dict) -> dict:
        for i, channel in enumerate(data.get("channels", [])):
            if channel["id"] == channel_id:
                return change(data["channels"], i)
        raise not_found(f"no channel {channel_id}")

    return svc.state.update(apply)


def _match_secret(candidates: list, key: str, presented: str) -> dict | None:
    """Return the candidate whose `key` equals presented; every candidate is compared."""
    found = None
    for item in candidates:
        expected = str(item.get(key) or "")
        if expected and hmac.compare_digest(expected.encode(), presented.encode()):
            found = item
    return found


_SAVE_TO = ConfigField(
    "saveTo",
    "folder",
    help=f"a folder under {NOTES}/ for /save and captures, a note per day "
    f"(default: the daily note, {DAILY_FOLDER}/YYYY-MM-DD.md)",
)
_NOTIFY = ConfigField("notify", "boolean", help="send reminders (⏰ lines) to the allowed senders")
TELEGRAM_UPDATES = ["message", "edited_message", "channel_post"]
TELEGRAM_MEDIA = ("voice", "audio", "document", "video", "video_note")


class TelegramError(UpstreamError):
    """The Bot API answered ok: false; `code` is its error_code (409: a webhook is set)."""

    def __init__(self, message: str, code: int = 0, retry_after: float = 0.0):
        super().__init__(message)
        self.code, self.retry_after = code, retry_after


def telegram_call(
    svc: Service,
    config: dict,
    method: str,
    params: dict,
    timeout: float = 15.0,
    outbound: Outbound | None = None,
) -> Any:
    """Return the `result` of one Bot API call; TelegramError with Telegram's description."""
    url = f"{svc.config.telegram_api_base}/bot{config['botToken']}/{method}"
    out = outbound or Outbound()
    try:
        status, _, raw = out.request(
            "POST", url, to_json(params), {"Content-Type": "application/json"}, timeout
        )
    finally:
        if outbound is None:
            out.close()
    try:
        answer = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise UpstreamError(f"Telegram {method}: HTTP {status}, not JSON") from None
    if not isinstance(answer, dict) or answer.get("ok") is not True:
        answer = answer if isinstance(answer, dict) else {}
        wait = (answer.get("parameters") or {}).get("retry_after") or 0
        said = scrub(str(answer.get("description") or f"HTTP {status}"), [config["botToken"]])
        raise TelegramError(
            f"Telegram {method}: " + printable(said, 200),
            int(answer.get("error_code") or status),
            float(wait) if isinstance(wait, (int, float)) else 0.0,
        )
    return answer.get("result")


@channel_provider(
    "telegram",
    (
        ConfigField("botToken", "string", True, True, "the token BotFather gave you"),
        ConfigField("allowedChatIds", "list", help="chat ids that may talk to the bot"),
        ConfigField(
            "mode",
            "choice",
            help="polling: the server asks Telegram for updates (no public URL needed); "
            "webhook: Telegram calls webhookUrl (setWebhook is done for you)",
            choices=("polling", "webhook"),
        ),
        _SAVE_TO,
        _NOTIFY,
    ),
    allow="allowedChatIds",
    description="a Telegram bot (getUpdates long polling or a webhook; sendMessage)",
    secret_header="X-Telegram-Bot-Api-Secret-Token",  # noqa: S106 - a header name
)
def parse_telegram(update: dict) -> list:
    msg = update.get("message") or update.get("edited_message") or update.get("channel_post")
    if not isinstance(msg, dict) or not isinstance(msg.get("chat"), dict):
        return []
    text = msg.get("text")
    if not isinstance(text, str):
        text = msg.get("caption")
    person = msg.get("from") if isinstance(msg.get("from"), dict) else msg["chat"]
    name = person.get("first_name") or person.get("username") or msg["chat"].get("title") or ""
    return [
        (
            str(msg["chat"].get("id", "")),
            text if isinstance(text, str) else None,
            name if isinstance(name, str) else "",
            _telegram_media(msg),
        )
    ]


def _telegram_media(msg: dict) -> list:
    """Return the files of a Telegram message: the largest photo size, voice, audio..."""
    found = []
    sizes = [p for p in _dicts(msg.get("photo")) if isinstance(p.get("file_id"), str)]
    if sizes:

        def area(p: dict) -> int:
            w, h = p.get("width"), p.get("height")
            return w * h if isinstance(w, int) and isinstance(h, int) else 0

        best = max(sizes, key=area)
        found.append({"kind": "photo", "id": best["file_id"], "mime": "image/jpeg", "name": ""})
        found[-1]["size"] = best.get("file_size")
    for kind in TELEGRAM_MEDIA:
        item = msg.get(kind)
        if isinstance(item, dict) and isinstance(item.get("file_id"), str):
            found.append(
                {
                    "kind": kind,
                    "id": item["file_id"],
                    "mime": str(item.get("mime_type") or ""),
                    "name": str(item.get("file_name") or ""),
                    "size": item.get("file_size"),
                }
            )
    return found


@channel_sender("telegram")
def send_telegram(svc: Service, config: dict, chat_id: str, text: str) -> None:
    base = svc.config.telegram_api_base
    url = f"{base}/bot{config['botToken']}/sendMessage"
    answer = post_json(url, {"chat_id": chat_id, "text": text[:REPLY_LIMIT]}, timeout=15)
    if answer.get("ok") is not True:
        said = scrub(str(answer.get("description")), [config["botToken"]])
        raise UpstreamError(f"Telegram refused: {printable(said)}")


@channel_poller("telegram")
def poll_telegram(svc: Service, config: dict, offset: int, wait: float, outbound) -> list:
    """getUpdates with a long-poll time-out; a webhook still set is deleted first (409)."""
    params: dict = {"timeout": int(wait), "allowed_updates": TELEGRAM_UPDATES}
    if offset:
        params["offset"] = offset
    try:
        updates = telegram_call(svc, config, "getUpdates", params, wait + 15, outbound)
    except TelegramError as e:
        if e.code != 409 or "webhook" not in str(e).lower():
            raise  # 409 "terminated by other getUpdates request": another poller, backoff
        log.info("telegram: a webhook was set for this bot; deleting it to poll instead")
        telegram_call(svc, config, "deleteWebhook", {"drop_pending_updates": False}, 15, outbound)
        return []
    batch = [u for u in updates or [] if isinstance(u, dict) and type(u.get("update_id")) is int]
    return [(u["update_id"] + 1, u) for u in sorted(batch, key=lambda u: u["update_id"])]


@channel_fetcher("telegram")
def fetch_telegram(svc: Service, config: dict, media: dict, write: Callable, limit: int) -> None:
    """getFile, then the file's bytes from {base}/file/bot<token>/<file_path>."""
    info = telegram_call(svc, config, "getFile", {"file_id": media["id"]})
    path = info.get("file_path") if isinstance(info, dict) else None
    if not isinstance(path, str) or not path or ".." in path.split("/"):
        raise UpstreamError("Telegram gave no file to download (files over 20 MB are not served)")
    size = info.get("file_size")
    if isinstance(size, int) and size > limit:
        raise UpstreamError(f"the file is over {limit} bytes (SERVICE_MAX_ATTACHMENT_BYTES)")
    url = f"{svc.config.telegram_api_base}/file/bot{config['botToken']}/{urllib.parse.quote(path)}"
    with Outbound() as out:
        status, _, _ = out.request("GET", url, timeout=120, limit=limit, sink=write)
    if status != 200:
        raise UpstreamError(f"the download answered HTTP {status}")


@channel_configurer("telegram")
def configure_telegram(svc: Service, channel: dict) -> str | None:
    """Webhook mode: setWebhook to the channel's URL with its secret as secret_token.

    Polling mode needs nothing here: the poller deletes a webhook it finds in its way.
    """
    if channel_mode(channel) != "webhook":
        return None
    params = {
        "url": channel["webhookUrl"],
        "secret_token": channel["secret"],
        "allowed_updates": TELEGRAM_UPDATES,
        "drop_pending_updates": False,
    }
    telegram_call(svc, channel["config"], "setWebhook", params)
    return "webhook set"


@channel_provider(
    "whatsapp",
    (
        ConfigField("accessToken", "string", True, True, "Cloud API access token"),
        ConfigField("phoneNumberId", "string", True, help="the sending phone number id"),
        ConfigField("verifyToken", "string", True, True, "what Meta sends to verify the hook"),
        ConfigField(
            "appSecret",
            "string",
            secret=True,
            help="the Meta app's secret: every call must carry its X-Hub-Signature-256",
        ),
        ConfigField("allowedNumbers", "list", help="phone numbers (wa_id) that may write"),
        _SAVE_TO,
        _NOTIFY,
    ),
    allow="allowedNumbers",
    description="WhatsApp Cloud API (webhook + /messages)",
    signature_header="X-Hub-Signature-256",
    signing_field="appSecret",
)
def parse_whatsapp(payload: dict) -> list:
    out = []
    for entry in _dicts(payload.get("entry")):
        for change in _dicts(entry.get("changes")):
            value = change.get("value")
            if not isinstance(value, dict):
                continue
            names = {
                str(c.get("wa_id", "")): c["profile"].get("name")
                for c in _dicts(value.get("contacts"))
                if isinstance(c.get("profile"), dict)
            }
            for msg in _dicts(value.get("messages")):
                kind = msg.get("type")
                body = (
                    msg.get("text", {}).get("body") if isinstance(msg.get("text"), dict) else None
                )
                text = body if kind == "text" and isinstance(body, str) else None
                media = []
                item = msg.get(kind) if kind in ("image", "audio", "document", "video") else None
                if isinstance(item, dict) and isinstance(item.get("id"), str):
                    caption = item.get("caption")
                    text = caption if isinstance(caption, str) else None
                    voice = kind == "audio" and item.get("voice") is True
                    media.append(
                        {
                            "kind": "voice" if voice else kind,
                            "id": item["id"],
                            "mime": str(item.get("mime_type") or "").split(";")[0].strip(),
                            "name": str(item.get("filename") or ""),
                        }
                    )
                sender = str(msg.get("from", ""))
                name = names.get(sender)
                out.append((sender, text, name if isinstance(name, str) else "", media))
    return out


def _dicts(value: Any) -> list:
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


@channel_sender("whatsapp")
def send_whatsapp(svc: Service, config: dict, number: str, text: str) -> None:
    url = f"{svc.config.whatsapp_api_base}/{config['phoneNumberId']}/messages"
    body = {
        "messaging_product": "whatsapp",
        "recipient_type": "individual",
        "to": number,
        "type": "text",
        "text": {"body": text[:REPLY_LIMIT]},
    }
    answer = post_json(url, body, {"Authorization": f"Bearer {config['accessToken']}"}, 15)
    if not answer.get("messages"):
        raise UpstreamError("WhatsApp did not accept the message")


@channel_fetcher("whatsapp")
def fetch_whatsapp(svc: Service, config: dict, media: dict, write: Callable, limit: int) -> None:
    """The media id's URL from the Graph API, then its bytes, both with the bearer token.

    The token goes only to an https URL or to the configured API's own origin.
    """
    base = svc.config.whatsapp_api_base
    auth = {"Authorization": f"Bearer {config['accessToken']}"}
    with Outbound() as out:
        url = f"{base}/{urllib.parse.quote(media['id'], safe='')}"
        status, _, raw = out.request("GET", url, headers=auth, timeout=15)
        try:
            info = json.loads(raw.decode("utf-8")) if status == 200 else None
        except (UnicodeDecodeError, ValueError):
            info = None
        link = info.get("url") if isinstance(info, dict) else None
        if not isinstance(link, str):
            raise UpstreamError(f"WhatsApp gave no media URL (HTTP {status})")
        size = info.get("file_size")
        if isinstance(size, int) and size > limit:
            raise UpstreamError(f"the file is over {limit} bytes (SERVICE_MAX_ATTACHMENT_BYTES)")
        own = urllib.parse.urlsplit(base)
        there = urllib.parse.urlsplit(link)
        if there.scheme != "https" and (there.scheme, there.netloc) != (own.scheme, own.netloc):
            raise UpstreamError("WhatsApp's media URL is not https")
        if isinstance(info.get("mime_type"), str) and not media.get("mime"):
            media["mime"] = info["mime_type"]
        status, _, _ = out.request("GET", link, headers=auth, timeout=120, limit=limit, sink=write)
    if status != 200:
        raise UpstreamError(f"the download answered HTTP {status}")


@channel_verifier("whatsapp", params=("hub.mode", "hub.verify_token", "hub.challenge"))
def verify_whatsapp(svc: Service) -> str:
    """Answer Meta's subscription check with hub.challenge when hub.verify_token matches."""
    addr = svc.client_addr(bottle.request.environ)
    mode, token = query_str("hub.mode"), query_str("hub.verify_token")
    if token:
        svc.check_lockout(addr)
    challenge = query_str("hub.challenge")
    mine = [c["config"] for c in channels_of(svc) if c["provider"] == "whatsapp" and c["enabled"]]
    if mode != "subscribe" or not token or not _match_secret(mine, "verifyToken", token):
        if token:
            svc.lockout.fail(addr, token)
        raise ApiError(403, "FORBIDDEN", "hub.verify_token does not match a WhatsApp channel")
    bottle.response.content_type = "text/plain; charset=utf-8"
    return challenge[:200]


@channel_provider(
    "web",
    (
        ConfigField("allowedSenders", "list", help="sender names that may write (empty: any)"),
        _SAVE_TO,
    ),
    allow="allowedSenders",
    description="a web page or script: POST {text, sender}; the reply comes back inline",
)
def parse_web(payload: dict) -> list:
    text = payload.get("text")
    sender = payload.get("sender", "web")
    return [(str(sender)[:100], text if isinstance(text, str) else None)]


def redact_channel(channel: dict, providers: Mapping[str, ChannelProvider]) -> dict:
    """Return a channel record with its secret and secret config fields redacted."""
    provider = providers.get(channel["provider"])
    secret_fields = {f.name for f in provider.fields if f.secret} if provider else set()
    config = {
        k: (redact(v) if k in secret_fields and v else v) for k, v in channel["config"].items()
    }
    shown = {k: v for k, v in channel.items() if k not in ("refusedSenders", "linkedChats")}
    if "binding" in shown:  # its code is never shown again: only until when it lives
        shown["binding"] = {"until": shown["binding"].get("until")}
    if "links" in shown:  # people's codes that wait: whose, until when
        shown["links"] = [{"person": x["person"], "until": x["until"]} for x in shown["links"]]
    return {**shown, "secret": redact(channel["secret"]), "config": config}


def channel_chats(channel: dict, providers: Mapping[str, ChannelProvider]) -> list:
    """Return whose each allowed chat of a channel is: [{chat, person}] (person null: the
    owner's; a person's chat also has the name it was linked with)."""
    provider = providers.get(channel["provider"])
    if provider is None or not provider.allow:
        return []
    people = {c["chat"]: c for c in channel.get("linkedChats", [])}
    return [
        {"chat": chat, "person": people[chat]["person"], "name": people[chat]["name"]}
        if chat in people
        else {"chat": chat, "person": None}
        for chat in channel["config"].get(provider.allow) or []
    ]


# -- the channel pipeline: secret, lockout, parse, allowlist, command or agent, delivery --


def channel_secret(svc: Service, provider: ChannelProvider, environ: dict) -> str:
    """Return the channel secret a webhook call presents (header, the provider's, ?secret=)."""
    presented = environ.get("HTTP_X_SERVICE_CHANNEL_SECRET", "")
    if not presented and provider.secret_header:
        presented = environ.get("HTTP_" + provider.secret_header.upper().replace("-", "_"), "")
    if not presented and query_str("secret"):
        presented = query_str("secret")
        svc.query_secret_seen_at = time.time()  # the audit reports secrets in URLs
    return presented


def handle_channel_update(
    svc: Service,
    prov: ChannelProvider,
    presented: str,
    addr: str,
    payload: Callable,
    signature: str = "",
    raw: Callable | None = None,
) -> dict:
    """Run one inbound webhook update through the pipeline; return what the webhook answers.

    payload() reads the update's JSON only once the secret has been checked; raw() gives
    the body's bytes for a provider that signs its calls (signature: its header's value).
    """
    channel = _authenticate_channel(svc, prov, presented, addr, signature, raw)
    return process_update(svc, channel, prov, payload())


def _authenticate_channel(
    svc: Service,
    prov: ChannelProvider,
    presented: str,
    addr: str,
    signature: str = "",
    raw: Callable | None = None,
) -> dict:
    """Return the enabled channel whose secret (or signature) was presented; 401, 403 or
    429 otherwise.

    A channel with a signing key (WhatsApp's appSecret) needs a valid signature of the
    raw body as well as, or instead of, its secret: Meta signs every call but cannot send
    the secret in a header.
    """
    signed = bool(signature and prov.signing_field and raw is not None)
    if presented or signed:  # only a presented credential counts toward (or meets) the lockout
        svc.check_lockout(addr)
    mine = [c for c in channels_of(svc) if c["provider"] == prov.name]
    channel = _match_secret(mine, "secret", presented) if presented else None
    key = prov.signing_field
    if channel is not None and key and channel["config"].get(key):
        if not signed or _signed_by(signature, raw(), [channel], key) is None:
            channel = None  # its secret alone is not enough
    elif channel is None and signed and not presented:
        channel = _signed_by(signature, raw(), mine, key)
    if channel is None:
        if presented or signed:
            svc.lockout.fail(addr, f"{presented}\n{signature}")
        raise ApiError(401, "UNAUTHORIZED", "missing or wrong channel secret or signature")
    svc.lockout.succeed(addr)
    if not channel["enabled"]:
        raise ApiError(403, "CHANNEL_DISABLED", f"channel {channel['id']} is switched off")
    return channel


def _signed_by(signature: str, body: bytes, channels: list, key: str) -> dict | None:
    """Return the channel whose key signed body ("sha256=<hex HMAC>"); every one is compared."""
    found = None
    presented = signature.strip().encode("latin-1", "replace")
    for channel in channels:
        secret = str(channel["config"].get(key) or "")
        if not secret:
            continue
        digest = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
        if hmac.compare_digest(f"sha256={digest}".encode(), presented):
            found = channel
    return found


def _deliver(svc: Service, channel: dict, prov: ChannelProvider, sender: str, reply: str):
    if prov.send is None:  # the reply goes back in the webhook's answer
        return {"handled": True, "reply": reply, "delivered": True}
    try:
        prov.send(svc, channel["config"], sender, reply)
        delivered = True
    except UpstreamError as e:
        log.warning("channel %s: delivering the reply failed: %s", channel["id"], e)
        delivered = False
    return {"handled": True, "delivered": delivered}


REFUSED_KEPT = 10  # refused senders remembered per channel (GET /channels/:id)
BIND_SECONDS = 600  # a bind code connects the first chat that sends it within this
BOUND_TEXT = (
    "Connected: what you send here goes to your notes. /save <text> keeps it in today's "
    "note; /help lists the rest."
)


def new_binding(created_by: str = MADE_BY_OWNER) -> tuple:
    """Return (a bind code to send to the bot, the record kept of it: its hash, its time,
    who asked for it: the chat it connects is theirs, and ends with their grant)."""
    code = base64.b32encode(secrets.token_bytes(10)).decode("ascii").lower()[:12]
    binding = {"codeHash": key_hash(code), "until": iso(time.time() + BIND_SECONDS)}
    return code, {**binding, "createdBy": created_by}


# -- who connected which chat: a chat a grant connected ends with that grant ------------
#
# A channel's `chatMakers` maps each chat (sender) on its allowlist that a grant put there
# (by a bind code it asked for, or in a config it sent) to that grant's id; chats the owner
# put there have no entry. Revoking the grant unbinds them (GrantStore.on_revoke:
# unbind_chats), and while its grant is expired or gone a chat is refused (allowed_senders).


def note_chat_makers(channel: dict, prov: ChannelProvider | None, before: list, maker: str):
    """Record `maker` (a `createdBy`) for the chats a change put on the channel's
    allowlist, and forget the chats it took off."""
    if prov is None or not prov.allow:
        return
    now = channel["config"].get(prov.allow) or []
    makers = {c: m for c, m in (channel.get("chatMakers") or {}).items() if c in now}
    if made_by_grant(maker):
        makers.update(dict.fromkeys((c for c in now if c not in before), maker))
    if makers:
        channel["chatMakers"] = makers
    else:
        channel.pop("chatMakers", None)
    linked = [c for c in channel.get("linkedChats", []) if c["chat"] in now]
    if linked:  # a person's chat taken off the allowlist is no longer theirs
        channel["linkedChats"] = linked
    else:
        channel.pop("linkedChats", None)


def unbind_chats(providers: Mapping[str, ChannelProvider]) -> Callable:
    """Return the GrantStore.on_revoke hook that unbinds the chats the revoked grants
    connected: off the allowlist, `boundChat` gone, their bind codes that wait ended. A
    channel left with no allowed chat is closed (a binding without a code: nobody, until
    a new code connects one), never opened to anyone."""

    def unbind(data: dict, gone: list) -> None:
        for channel in data.get("channels", []):
            prov = providers.get(channel["provider"])
            binding = channel.get("binding")
            waiting = binding is not None and binding.get("createdBy") in gone
            if prov is None or not prov.allow:
                continue
            links = [x for x in channel.get("links", []) if x.get("createdBy") not in gone]
            if len(links) < len(channel.get("links", [])):  # people's codes they asked for
                channel["links"] = links
                if not links:
                    del channel["links"]
            makers = channel.get("chatMakers") or {}
            dropped = [c for c, m in makers.items() if m in gone]
            if not dropped and not waiting:
                continue
            allowed = channel["config"].get(prov.allow) or []
            kept = [c for c in allowed if c not in dropped]
            channel["config"][prov.allow] = kept
            note_chat_makers(channel, prov, kept, MADE_BY_OWNER)
            if (channel.get("boundChat") or {}).get("id") in dropped:
                channel.pop("boundChat")
            linked = [c for c in channel.get("linkedChats", []) if c["chat"] not in dropped]
            if len(linked) < len(channel.get("linkedChats", [])):
                channel["linkedChats"] = linked
                if not linked:
                    del channel["linkedChats"]
            if waiting:
                channel.pop("binding")
            if (allowed or waiting) and not kept:  # nobody now, never anybody
                channel["binding"] = {"until": iso(time.time())}
            for chat in dropped:
                log.info(
                    "channel %s: chat %s unbound (%s was revoked)",
                    channel["id"],
                    chat,
                    makers[chat],
                )

    return unbind


def allowed_senders(svc: Service, channel: dict, prov: ChannelProvider) -> list | None:
    """Return the senders a channel answers: its allowlist without the chats a grant
    connected that is no longer live (revoked, expired); None when it has no allowlist
    (anyone: the audit says so)."""
    allowed = channel["config"].get(prov.allow) if prov.allow else None
    if not allowed:
        return None
    makers = channel.get("chatMakers") or {}
    return [c for c in allowed if c not in makers or svc.grants.live_maker(makers[c])]


def binds(binding: dict, text: str) -> bool:
    """Return whether a message is the binding's live code (alone, or after /start as a
    t.me/<bot>?start=<code> link sends it)."""
    m = re.fullmatch(r"\s*(?:/start(?:@\w+)?\s+)?([a-z2-7]{12})\s*", text or "", re.I)
    return (
        m is not None
        and epoch_of(binding.get("until")) > time.time()
        and hmac.compare_digest(key_hash(m.group(1).lower()), binding.get("codeHash", ""))
    )


def bind_chat(svc: Service, channel: dict, prov: ChannelProvider, sender: str, name: str):
    """Make the chat that sent the bind code the channel's only allowed one (the code is
    used up: a second chat sending it is a refused sender); it is the chat of whoever asked
    for the code."""
    bound = {"id": printable(sender), "name": printable(name or ""), "at": iso(utcnow())}

    def apply(channels: list, i: int) -> None:
        ch = channels[i]
        maker = (ch.pop("binding", None) or {}).get("createdBy", MADE_BY_OWNER)
        # the owner's chats are replaced; the people's stay theirs (this one becomes the owner's)
        linked = [c for c in ch.get("linkedChats", []) if c["chat"] != bound["id"]]
        kept = [c for c in ch["config"].get(prov.allow) or [] if c in {x["chat"] for x in linked}]
        makers = {c: m for c, m in (ch.get("chatMakers") or {}).items() if c in kept}
        ch["config"][prov.allow] = [bound["id"], *kept]
        ch["chatMakers"] = makers
        note_chat_makers(ch, prov, kept, maker)
        linked = [c for c in linked if c["chat"] in kept]
        if linked:
            ch["linkedChats"] = linked
        else:
            ch.pop("linkedChats", None)
        ch["boundChat"] = bound

    change_channel(svc, channel["id"], apply)
    log.info("channel %s: bound to chat %s", channel["id"], bound["id"])


# -- a person's chats: linked by a code the person asked for, acting as that person -------
#
# A channel's `links` are the codes keys asked for (POST /channels/:id/link: one each
# waiting, ten minutes, once); the chat that sends one joins the allowlist as the chat of
# that key's person (`linkedChats: [{chat, person, name, at}]`; person null: the owner's),
# and in `chatMakers` the grant that asked, so the chat ends with that grant. What such a
# chat sends acts as that grant: a person's reach and places; every other allowed chat is
# the owner's.

LINKED_TEXT = (
    "Connected to {name}'s notes: what you send here goes to {home}. /save <text> keeps it "
    "in today's note; /help lists the rest."
)


def new_link(principal: Principal) -> tuple:
    """Return (a code a chat sends the bot, the record kept of it: its hash, until when,
    whose (a person's id, or None: the owner's), which grant asked)."""
    code, binding = new_binding(made_by(principal))
    return code, {**binding, "person": principal.person or None}


def live_links(channel: dict) -> list:
    return [x for x in channel.get("links", []) if epoch_of(x.get("until")) > time.time()]


def link_of(channel: dict, text: str) -> dict | None:
    """Return the person's link whose live code a message is (as binds() reads it)."""
    return next((x for x in live_links(channel) if binds(x, text)), None)


def link_chat(svc: Service, channel: dict, prov: ChannelProvider, sender, name, link) -> dict:
    """Make the chat that sent a person's code theirs: on the allowlist beside the others,
    linked to the person and ended with the grant that asked (the code is used up)."""
    chat = {"chat": printable(sender), "person": link["person"], "name": printable(name or "")}
    chat["at"] = iso(utcnow())

    def apply(channels: list, i: int) -> dict:
        ch = channels[i]
        ch["links"] = [x for x in live_links(ch) if x["codeHash"] != link["codeHash"]]
        if not ch["links"]:
            del ch["links"]
        allowed = list(ch["config"].get(prov.allow) or [])
        ch["config"][prov.allow] = allowed + [chat["chat"]] * (chat["chat"] not in allowed)
        makers = {**(ch.get("chatMakers") or {}), chat["chat"]: link["createdBy"]}
        ch["chatMakers"] = {c: m for c, m in makers.items() if made_by_grant(m)}
        others = [c for c in ch.get("linkedChats", []) if c["chat"] != chat["chat"]]
        ch["linkedChats"] = [*others, chat]
        return ch

    changed = change_channel(svc, channel["id"], apply)
    log.info("channel %s: chat %s linked to %s", channel["id"], chat["chat"], link["person"])
    return changed


def unlink_chats(channel: dict, prov: ChannelProvider, person: str | None) -> list:
    """Take a person's chats off a channel (None: those the owner's keys linked), and their
    codes that wait; return the chats. A channel left with no allowed chat is closed,
    never opened to anyone."""
    mine = [c["chat"] for c in channel.get("linkedChats", []) if c["person"] == person]
    waiting = any(x["person"] == person for x in channel.get("links", []))
    if waiting:
        channel["links"] = [x for x in channel["links"] if x["person"] != person]
        if not channel["links"]:
            del channel["links"]
    if not mine:
        return []
    allowed = channel["config"].get(prov.allow) or []
    kept = [c for c in allowed if c not in mine]
    channel["config"][prov.allow] = kept
    makers = {c: m for c, m in (channel.get("chatMakers") or {}).items() if c not in mine}
    channel["chatMakers"] = makers
    if not makers:
        del channel["chatMakers"]
    channel["linkedChats"] = [c for c in channel["linkedChats"] if c["person"] != person]
    if not channel["linkedChats"]:
        del channel["linkedChats"]
    if allowed and not kept:  # nobody now, never anybody
        channel["binding"] = {"until": iso(time.time())}
    return mine


def unlink_person(providers: Mapping[str, ChannelProvider]) -> Callable:
    """Return the PeopleStore.on_remove hook: a person removed, their chats go with them
    (in the removal's own state change)."""

    def unlink(data: dict, person: str) -> None:
        for channel in data.get("channels", []):
            prov = providers.get(channel["provider"])
            if prov is not None and prov.allow:
                for chat in unlink_chats(channel, prov, person):
                    log.info("channel %s: chat %s unlinked (its person left)", channel["id"], chat)

    return unlink


def chat_principal(svc: Service, channel: dict, sender: str) -> tuple:
    """Return (whether a chat acts for a key, the principal it acts for): the grant that
    linked it, as it is now (a person's reach as shared now); (False, None) for the
    owner's chats (linked by the owner's own key too); (True, None) for a chat whose grant
    ended just now (it acts for nobody)."""
    linked = any(c["chat"] == sender for c in channel.get("linkedChats", []))
    maker = (channel.get("chatMakers") or {}).get(sender)
    if not linked or maker is None:
        return False, None
    found = svc.grants.principal_by_id(maker)
    who = found if found is None or not found.grant_id else svc.grants.current(found.grant_id)
    if who is None or not (who.whole or who.reach.folders):
        return True, None
    return True, who


def person_channel(channel: dict, person: str | None) -> dict:
    """Return a channel as a person sees it: what it is, whether a chat of theirs can join
    it, and their own chats only (never its config, secret, or anyone else's chat)."""
    mine = [
        {k: c[k] for k in ("chat", "name", "at")}
        for c in channel.get("linkedChats", [])
        if c["person"] == person
    ]
    waiting = [x["until"] for x in live_links(channel) if x["person"] == person]
    shown = {k: channel[k] for k in ("id", "provider", "name", "enabled") if k in channel}
    if channel.get("bot"):
        shown["bot"] = channel["bot"]
    return {**shown, "chats": mine, "linkUntil": waiting[0] if waiting else None}


def refuse_sender(svc: Service, channel: dict, prov: ChannelProvider, sender, name) -> None:
    """Log and remember a sender the allowlist refused (never the message text)."""
    sender, name = printable(sender), printable(name or "")
    log.info(
        "channel %s: refused sender %s%s — add it to config.%s to allow",
        channel["id"],
        sender,
        f" ({name})" if name else "",
        prov.allow,
    )
    entry = {"sender": sender, "name": name, "at": iso(utcnow())}

    def remember(channels: list, i: int) -> None:
        kept = [r for r in channels[i].get("refusedSenders", []) if r.get("sender") != sender]
        channels[i]["refusedSenders"] = [*kept, entry][-REFUSED_KEPT:]

    with contextlib.suppress(ApiError):  # the channel was deleted meanwhile
        change_channel(svc, channel["id"], remember)


_COMMAND_RE = re.compile(r"^/([A-Za-z]\w{0,31})(?:@\w+)?(?:\s+(.*))?$", re.S)
HELP_TEXT = (
    "/save <text> — keep it in today's note\n"
    "/search <words> — find notes\n"
    "/ask <question> — ask the agent (any other text does the same)\n"
    "/today — today's note\n"
    "Send a photo, a voice message or a file to keep it in today's note; "
    "a line with ⏰ YYYY-MM-DD HH:MM in any note reminds you then."
)


def run_command(svc: Service, text: str, channel: dict | None = None) -> str:
    """Return the reply to a channel message: /save, /search, /ask, /today, /help, or a
    question for the agent."""
    m = _COMMAND_RE.match(text)
    command, arg = (m.group(1).lower(), (m.group(2) or "").strip()) if m else (None, text)
    channel = channel or {}
    if command == "save":
        if not arg:
            return "Usage: /save <text to keep>"
        now = local_now(svc)
        path, heading = capture_note(svc, channel, now)
        svc.notes.append(path, f"- {now:%H:%M} {arg}", heading)
        return f"Saved to {path}."
    if command == "search":
        if not arg:
            return "Usage: /search <words>"
        try:  # a person's chat: their reach (the owner's: every note)
            total, hits = svc.index.search(Query(arg), request_principal().folders, 5, 0)
        except ApiError as e:
            return f"Search: {e.message}"
        if not total:
            return f"No note matches “{clip(arg, 80)}”."
        lines = [f"{total} note{'s' if total != 1 else ''} match; the best:"]
        lines += [f"• {title} — {path}" for path, title, _, _ in hits]
        return "\n".join(lines)
    if command == "today":
        path, _ = capture_note(svc, channel, local_now(svc))
        try:
            content = svc.notes.get(path)["content"]
        except ApiError:
            return f"Nothing in {path} yet."
        return clip(f"{path}\n\n{content.strip()}", REPLY_LIMIT)
    if command in ("help", "start"):
        return HELP_TEXT
    if command == "ask":
        if not arg:
            return "Usage: /ask <question>"
    elif command is not None:
        return f"Unknown command /{command}.\n{HELP_TEXT}"
    try:
        return ask_agent(svc, arg, folder=request_principal().folders)["reply"]
    except ApiError as e:
        if e.code == "AGENT_DISABLED":
            return "The agent is off on this server; try /search <words>."
        return f"The agent could not answer ({e.message}); try /search <words>."


def process_update(svc: Service, channel: dict, prov: ChannelProvider, update: dict) -> dict:
    """Handle one authenticated update (from a webhook or a poller): parse, allowlist, then
    a capture (photos, voice, files), a command or the agent, and deliver the reply."""
    messages = []
    for m in prov.parse(update):
        text = m[1] if isinstance(m[1], str) else ""
        media = list(m[3]) if len(m) > 3 and m[3] else []
        if text or media:
            messages.append((m[0], text, m[2] if len(m) > 2 else "", media))
    if not messages:
        return {"handled": False, "reason": "the update holds no text message"}
    allowed = allowed_senders(svc, channel, prov)  # None: no allowlist
    binding = channel.get("binding")  # a code waits for the chat it connects (or none may)
    results = []
    for sender, text, name, media in messages[:5]:
        if binding and binds(binding, text):
            bind_chat(svc, channel, prov, sender, name)
            results.append(_deliver(svc, channel, prov, sender, BOUND_TEXT))
            binding = allowed = None
            continue
        link = link_of(channel, text) if prov.allow else None
        if link is not None:  # a key's code: this chat is its person's from now on
            channel = link_chat(svc, channel, prov, sender, name, link)
            person = svc.people.get(link["person"])
            reply = (
                LINKED_TEXT.format(name=person["name"], home=person["home"])
                if person
                else BOUND_TEXT
            )
            results.append(_deliver(svc, channel, prov, sender, reply))
            allowed, binding = allowed_senders(svc, channel, prov), channel.get("binding")
            continue
        mine, who = chat_principal(svc, channel, sender)
        if (
            (binding and not allowed)
            or (allowed is not None and sender not in allowed)
            or (mine and who is None)
        ):
            refuse_sender(svc, channel, prov, sender, name)
            results.append({"handled": False, "reason": "sender not allowed"})
            continue
        with acting_as(who, channel.get("name") or prov.name) if who else contextlib.nullcontext():
            try:
                if media:
                    reply = capture_media(svc, channel, prov, media, text)
                else:
                    reply = run_command(svc, text.strip(), channel)
            except ApiError as e:  # a full disk, a place this chat may not write
                reply = f"That did not work: {e.message}"
        results.append(_deliver(svc, channel, prov, sender, reply))
    if len(results) == 1:
        return results[0]
    return {"handled": any(r["handled"] for r in results), "results": results}


def channel_secrets(svc: Service, channel_id: str) -> list:
    """Return what a channel sends out that is secret: its config's secret fields (a bot
    token, an access token), for scrub()."""
    for channel in channels_of(svc):
        prov = svc.channel_providers.get(channel["provider"])
        if channel["id"] == channel_id and prov is not None:
            return [str(channel["config"].get(f.name) or "") for f in prov.fields if f.secret]
    return []


def set_channel_status(svc: Service, channel_id: str, ok: bool, error: str = "") -> dict | None:
    """Record the outcome of the last call to the channel's provider as its `status` (no
    secret of the channel in it, whatever its provider said)."""
    status: dict = {"ok": ok, "at": iso(utcnow())}
    if error:
        status["error"] = printable(scrub(error, channel_secrets(svc, channel_id)), 300)

    def record(channels: list, i: int) -> dict:
        channels[i]["status"] = status
        return channels[i]

    try:
        return change_channel(svc, channel_id, record)
    except ApiError:  # deleted meanwhile
        return None


def configure_channel(svc: Service, channel: dict) -> dict:
    """Run the provider's side of a create or PATCH (Telegram's setWebhook); return the
    channel as stored. A failure never fails the request: it is logged and shown as the
    channel's `status: {ok: false, error, at}`."""
    prov = svc.channel_providers.get(channel["provider"])
    if prov is None or prov.configure is None:
        return channel
    try:
        done = prov.configure(svc, channel)
    except UpstreamError as e:
        said = scrub(str(e), channel_secrets(svc, channel["id"]))
        log.warning("channel %s: %s", channel["id"], said)
        return set_channel_status(svc, channel["id"], False, said) or channel
    if done is None:
        return channel
    log.info("channel %s: %s", channel["id"], done)
    return set_channel_status(svc, channel["id"], True) or channel
