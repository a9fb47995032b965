"""Captures: /save, photos, voice and files into the day's note."""

from __future__ import annotations

import datetime as dt
import json
import posixpath
import re
import secrets
import time
import unicodedata
import urllib.parse
from typing import TYPE_CHECKING

from notesvc.boot import log
from notesvc.errors import ApiError
from notesvc.grants import Principal, request_principal, visible_note
from notesvc.helpers import BODY_CHUNK, local_time, scrub, time_zone, url_secrets
from notesvc.notes.paths import (
    ATTACHMENT_TYPES,
    ATTACHMENTS,
    DAILY_FOLDER,
    NOTES,
    attachment_path,
    content_type_of,
    day_note,
)
from notesvc.providers.agent import agent_endpoint
from notesvc.providers.base import Outbound, UpstreamError, clip
from notesvc.service import Service

if TYPE_CHECKING:  # annotations only: these modules come later
    from notesvc.providers.channels import ChannelProvider


# -- captures: /save, photos, voice and files into the day's note --------------------

TRANSCRIBE_TIMEOUT = 120.0
CAPTURE_LABELS = {
    "photo": "photo",
    "image": "photo",
    "voice": "voice message",
    "audio": "audio",
    "video": "video",
    "video_note": "video message",
    "document": "file",
}
# The extension a file is stored with when its name does not say: by type, then by kind.
EXTENSION_OF_TYPE: dict = {}
for _ext, _type in ATTACHMENT_TYPES.items():
    EXTENSION_OF_TYPE.setdefault(_type, _ext)
EXTENSION_OF_TYPE.update({"audio/opus": "ogg", "audio/x-m4a": "m4a", "image/jpg": "jpg"})
EXTENSION_OF_KIND = {"photo": "jpg", "image": "jpg", "voice": "ogg", "video_note": "mp4"}


def daily_folder(principal: Principal) -> str:
    """Return where whoever acts keeps daily notes: the owner's notes/daily; a person's
    <home>/daily (a key narrowed to a folder, a folder grant's chat: <folder>/daily)."""
    return DAILY_FOLDER if principal.whole else f"{principal.home}/daily"


def inbox_attachments(principal: Principal) -> str:
    """Return where captured files go: attachments/inbox; a person's attachments/<home
    without notes/>/inbox (a folder grant's: its folder's twin)."""
    if principal.whole:
        return f"{ATTACHMENTS}/inbox"
    return f"{ATTACHMENTS}{principal.home[len(NOTES) :]}/inbox"


def capture_note(svc: Service, channel: dict, now: dt.datetime) -> tuple:
    """Return (path, heading) of the note a channel's captures go to today: the daily
    note, or a note per day in the channel's saveTo folder; a person's chat (one that acts
    for a part of the notes), their own daily note (saveTo is the owner's)."""
    who = request_principal()
    if not who.whole:  # (a key narrowed to a folder shared for reading: 403)
        path, heading = day_note(now.date(), daily_folder(who))
        return visible_note(svc.notes, path, who, write=True), heading
    folder = channel.get("config", {}).get("saveTo") or DAILY_FOLDER
    return day_note(now.date(), folder)


def local_now(svc: Service) -> dt.datetime:
    """Return the wall-clock time now in SERVICE_TIMEZONE (naive)."""
    return local_time(time.time(), time_zone(svc.config.timezone))


def one_line(text: str, limit: int = 1000) -> str:
    return clip(" ".join(text.split()), limit)


def _media_extension(media: dict) -> str | None:
    """Return the allowed extension to store a media item with, None when none fits."""
    name = media.get("name") or ""
    ext = name.rpartition(".")[2].lower() if "." in name else ""
    if ext in ATTACHMENT_TYPES:
        return ext
    mime = (media.get("mime") or "").split(";")[0].strip().lower()
    if name and "." in name and not EXTENSION_OF_TYPE.get(mime):
        return None  # a named file of a type not on the list (an .exe, say)
    return EXTENSION_OF_TYPE.get(mime) or EXTENSION_OF_KIND.get(media.get("kind", ""))


def _safe_stem(media: dict) -> str:
    kind = {"image": "photo"}.get(media.get("kind", ""), media.get("kind"))
    stem = (media.get("name") or "").rpartition(".")[0] or kind or "file"
    stem = re.sub(r"[^\w-]+", "-", unicodedata.normalize("NFC", stem)).strip("-_")
    return stem[:60] or "file"


def capture_media(svc: Service, channel: dict, prov: ChannelProvider, media: list, caption: str):
    """Store each file of a message as an attachment under attachments/inbox/<date>/ (a
    person's: attachments/<home>/inbox/<date>/), link it from the day's note with the
    caption (and a voice message's transcript); return the reply for the sender."""
    if prov.fetch is None:
        return "This channel cannot fetch files."
    now = local_now(svc)
    note, heading = capture_note(svc, channel, now)
    lines, saved, problems = [], [], []
    for i, item in enumerate(media[:10]):
        label = CAPTURE_LABELS.get(item.get("kind", ""), "file")
        try:
            entry, transcript = _capture_one(svc, channel, prov, item, note, now)
        except (UpstreamError, ApiError) as e:
            reason = e.message if isinstance(e, ApiError) else str(e)
            log.warning("channel %s: a %s was not saved: %s", channel["id"], label, reason)
            problems.append(f"The {label} was not saved: {reason}.")
            continue
        text = one_line(caption) if caption and i == 0 else ""
        lines.append(f"- {now:%H:%M} {entry}" + (f" {text}" if text else ""))
        if transcript is not None:
            lines.append(f"  > {transcript}" if transcript else "  > (nothing was heard)")
        saved.append((label, transcript))
    if lines:
        svc.notes.append(note, "\n".join(lines), heading)
    replies = []
    for label, transcript in saved:
        said = f": “{clip(transcript, 300)}”" if transcript else ""
        replies.append(f"Saved the {label} to {note}{said}.")
    unheard = [label for label, t in saved if t is None and label in ("voice message", "audio")]
    if unheard and not svc.config.transcribe_url:
        replies.append("(Not transcribed: SERVICE_TRANSCRIBE_URL is not set.)")
    return " ".join(replies + problems) or "Nothing was saved."


def _capture_one(svc: Service, channel: dict, prov: ChannelProvider, item, note, now) -> tuple:
    """Fetch one media item into an attachment; return (Markdown link, transcript or None)."""
    ext = _media_extension(item)
    if ext is None:
        raise UpstreamError("files of its type are not accepted as attachments")
    limit = svc.config.max_attachment_bytes
    size = item.get("size")
    if isinstance(size, int) and size > limit:
        raise UpstreamError(f"the file is over {limit} bytes (SERVICE_MAX_ATTACHMENT_BYTES)")
    stem = _safe_stem(item)
    inbox = inbox_attachments(request_principal())
    path = attachment_path(f"{inbox}/{now:%Y-%m-%d}/{now:%H%M%S}-{stem}.{ext}")

    def download(f) -> None:
        prov.fetch(svc, channel["config"], item, f.write, limit)

    rec, _ = svc.attachments.place(svc.attachments.spool(download), path, unique=True)
    href = urllib.parse.quote(posixpath.relpath(rec["path"], posixpath.dirname(note)), safe="/")
    label = CAPTURE_LABELS.get(item.get("kind", ""), "file")
    if rec["contentType"].startswith("image/"):
        entry = f"![{label}]({href})"
    else:
        text = one_line(item.get("name") or label, 100).replace("[", "(").replace("]", ")")
        entry = f"[{text}]({href})"
    transcript = None
    if item.get("kind") in ("voice", "audio") and svc.config.transcribe_url:
        try:
            transcript = one_line(transcribe(svc, rec["path"]), 4000)
        except UpstreamError as e:
            log.warning("channel %s: transcription failed: %s", channel["id"], e)
            entry += f" (transcription failed: {e})"
    elif item.get("kind") in ("voice", "audio"):
        entry += " (not transcribed)"
    return entry, transcript


def transcribe(svc: Service, path: str) -> str:
    """Return the text of an audio attachment from SERVICE_TRANSCRIBE_URL, an OpenAI-
    compatible /audio/transcriptions endpoint (multipart built with the standard library)."""
    cfg = svc.config
    url = cfg.transcribe_url
    tail = (
        ""
        if urllib.parse.urlsplit(url).path.endswith("/audio/transcriptions")
        else ("/audio/transcriptions")
    )
    url, headers = agent_endpoint(url, tail, cfg.transcribe_api_key)
    name = path.rsplit("/", 1)[-1]
    stem, _, ext = name.rpartition(".")
    ext = {"oga": "ogg", "opus": "ogg"}.get(ext.lower(), ext.lower())  # names the API knows
    boundary = "notesvc-" + secrets.token_hex(12)
    fields = {"model": cfg.transcribe_model, "response_format": "json"}
    head = b"".join(
        f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
        for k, v in fields.items()
    )
    head += (
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
        f'filename="{stem[:60] or "audio"}.{ext}"\r\nContent-Type: {content_type_of(path)}\r\n\r\n'
    ).encode()
    tail_bytes = f"\r\n--{boundary}--\r\n".encode()
    f, st = svc.attachments.open(path)
    with f:

        def body():
            yield head
            while chunk := f.read(BODY_CHUNK):
                yield chunk
            yield tail_bytes

        headers.update(
            {
                "Content-Type": f"multipart/form-data; boundary={boundary}",
                "Content-Length": str(len(head) + st.st_size + len(tail_bytes)),
            }
        )
        with Outbound() as out:
            status, _, raw = out.request("POST", url, body(), headers, TRANSCRIBE_TIMEOUT)
    if status != 200:
        raise UpstreamError(f"the transcription service answered HTTP {status}")
    try:
        answer = json.loads(raw.decode("utf-8"))
        text = answer["text"]
    except (UnicodeDecodeError, ValueError, KeyError, TypeError):
        raise UpstreamError("the transcription answer had no text") from None
    if not isinstance(text, str):
        raise UpstreamError("the transcription answer had no text")
    return scrub(text, [cfg.transcribe_api_key, *url_secrets(cfg.transcribe_url)]).strip()
