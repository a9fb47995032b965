"""Handlers for capture: clips (/capture/clip, the /clip page), voice notes, file text.

A clip arrives as the browser rendered it (clip.save_clip); a voice note is the audio's
own bytes, kept as an attachment beside a note that holds it and its transcript; GET
/capture says what the page's Record and its line about the text inside files need.
"""

from __future__ import annotations

import posixpath
import time
import urllib.parse

from notesvc.boot import API, bottle
from notesvc.errors import ApiError, bad_request
from notesvc.grants import attachments_twin, request_principal
from notesvc.helpers import (
    BODY_CHUNK,
    local_time,
    query_str,
    read_json,
    request_body_reader,
    time_zone,
)
from notesvc.notes.merge import title_filename
from notesvc.notes.paths import attachment_path
from notesvc.providers.base import UpstreamError, clip
from notesvc.providers.capture import transcribe
from notesvc.service import Service
from notesvc.web import clip_page, clip_page_headers
from notesvc.webclip import clip_folder, save_clip

# -- clips ------------------------------------------------------------------------------------


def post_clip(svc: Service) -> dict:
    """POST /capture/clip {url, title, html, selection?, images?, folder?, new?}: 201 with
    the note (`updated`: it was the same URL's note, one the caller may write)."""
    body = read_json(svc.config.max_attachment_bytes)
    answer, _created = save_clip(svc, request_principal(), body)
    script = bottle.request.environ.get("SCRIPT_NAME", "")
    location = f"{script}{API}/notes/{urllib.parse.quote(answer['path'], safe='')}"
    bottle.response.set_header("Location", location)
    bottle.response.set_header("ETag", answer["etag"])
    return answer


def get_clip_page(svc: Service) -> str:
    """GET /clip: the bookmarklet's page (it keeps its own device key, takes the page the
    bookmarklet hands it by postMessage, and sends the clip)."""
    bottle.response.content_type = "text/html; charset=utf-8"
    for name, value in clip_page_headers().items():
        bottle.response.set_header(name, value)
    return clip_page()


# -- voice notes -------------------------------------------------------------------------------

# What a recording may be, by its first bytes: (type prefix, extension).
AUDIO_MAGIC = (
    (b"\x1a\x45\xdf\xa3", "webm"),  # WebM (Chromium, Firefox: Opus)
    (b"OggS", "ogg"),
)
AUDIO_TYPES = {
    "audio/webm": "webm",
    "video/webm": "webm",
    "audio/ogg": "ogg",
    "audio/mp4": "m4a",
    "video/mp4": "m4a",
    "audio/x-m4a": "m4a",
    "audio/aac": "aac",
    "audio/mpeg": "mp3",
    "audio/wav": "wav",
    "audio/x-wav": "wav",
}


def audio_extension(head: bytes) -> str | None:
    """Return the extension an audio file's first bytes say (webm, ogg, m4a, mp3, wav,
    aac), None when they are not audio a recorder makes."""
    for magic, ext in AUDIO_MAGIC:
        if head.startswith(magic):
            return ext
    if head[4:8] == b"ftyp":
        return "m4a"
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return "wav"
    if head[:3] == b"ID3" or (len(head) > 1 and head[0] == 0xFF and head[1] & 0xF6 == 0xF2):
        return "mp3"
    if len(head) > 1 and head[0] == 0xFF and head[1] & 0xF6 == 0xF0:
        return "aac"
    return None


def post_voice(svc: Service) -> dict:
    """POST /capture/voice (the audio's bytes; ?folder=): the recording kept as an
    attachment, a note with it and its transcript (SERVICE_TRANSCRIBE_URL) -> 201."""
    principal = request_principal()
    ctype = bottle.request.content_type.split(";")[0].strip().lower()
    if ctype not in AUDIO_TYPES:
        raise ApiError(
            415,
            "UNSUPPORTED_MEDIA_TYPE",
            f"send the recording's bytes as one of {', '.join(sorted(set(AUDIO_TYPES)))}",
        )
    raw_folder = query_str("folder") or None
    folder = clip_folder(svc, principal, raw_folder)
    now = local_time(time.time(), time_zone(svc.config.timezone))
    limit = svc.config.max_attachment_bytes
    read, _ = request_body_reader(limit, "SERVICE_MAX_ATTACHMENT_BYTES")
    head = bytearray()

    def copy(f) -> None:
        while chunk := read(BODY_CHUNK):
            if len(head) < 16:
                head.extend(chunk[:16])
            f.write(chunk)

    tmp = svc.attachments.spool(copy)
    ext = audio_extension(bytes(head))
    if ext is None:
        tmp.unlink(missing_ok=True)
        if not head:
            raise bad_request("the recording is empty")
        raise bad_request("the body is not a recording (WebM, Ogg, MP4, MP3, WAV or AAC)")
    path = attachment_path(f"{attachments_twin(folder)}/{now:%Y-%m-%d}/{now:%H%M%S}-voice.{ext}")
    if not (principal.whole or principal.may_write(path)):
        tmp.unlink(missing_ok=True)
        raise ApiError(403, "FORBIDDEN", f"this key may not write files at {path}")
    rec, _ = svc.attachments.place(tmp, path, unique=True)
    transcript, said = None, ""
    if svc.config.transcribe_url:
        try:
            transcript = " ".join(transcribe(svc, rec["path"]).split())
        except UpstreamError as e:
            said = f"(Not transcribed: {clip(str(e), 200)}.)"
    else:
        said = "(Not transcribed: this server has no SERVICE_TRANSCRIBE_URL.)"
    title = f"Voice note {now:%Y-%m-%d %H:%M}"
    href = urllib.parse.quote(posixpath.relpath(rec["path"], folder), safe="/")
    body = f"# {title}\n\n[Voice note]({href})\n\n"
    if transcript:
        body += transcript + "\n"
    elif transcript is not None:
        body += "(Nothing was heard.)\n"
    else:
        body += said + "\n"
    note = svc.notes.create_named(folder, title_filename(title), body)
    bottle.response.status = 201
    return {
        "path": note["path"],
        "etag": note["etag"],
        "attachment": rec["path"],
        "transcript": transcript,
        "transcribed": transcript is not None,
    }


# -- what the page needs ----------------------------------------------------------------------


def secure_address(svc: Service, env: dict) -> str | None:
    """Return an https address of this server the person can open (SERVICE_PUBLIC_URL, its
    own origin on the relay, the relay's path), None when it has none."""
    cfg = svc.config
    if cfg.public_url.startswith("https://"):
        return cfg.public_url.rstrip("/") + "/"
    origin = svc.relay_origin()
    if origin:
        return origin + "/"
    if cfg.relay_url.startswith("https://"):
        return svc.relay_base(env) + "/"
    return None


def get_capture(svc: Service) -> dict:
    """GET /capture: what Record and the line about the text inside files need."""
    env = bottle.request.environ
    principal = request_principal()
    sees = None if principal.whole else principal.sees  # names only the files it reaches
    reader = svc.reader.info(sees) if svc.reader is not None else {"enabled": False}
    return {
        "record": {
            "transcribe": bool(svc.config.transcribe_url),
            "secureUrl": secure_address(svc, env),
            "maxBytes": svc.config.max_attachment_bytes,
        },
        "attachmentText": reader,
    }
