"""Capture's handlers: voice notes, GET /capture, the /clip page (src/notesvc/http/capture.py)."""

from __future__ import annotations

import re

import pytest

from conftest import API, NOWHERE, assert_error, data, note_url, running, with_key
from test_people import device_of

VOICE = f"{API}/capture/voice"
WEBM = b"\x1a\x45\xdf\xa3" + b"\x00" * 4000  # a WebM's first bytes (the stand-in hears it)
OGG = b"OggS" + b"\x00" * 2000


def voice(client, raw: bytes = WEBM, ctype: str = "audio/webm", status: int = 201, **kw):
    resp = client.post(VOICE, raw, {"Content-Type": ctype, **kw}, status=status)
    return data(resp) if status == 201 else resp


class TestVoice:
    def test_a_recording_is_kept_and_its_transcript_written_beside_it(
        self, make_app, upstream, root
    ):
        client = with_key(make_app(SERVICE_TRANSCRIBE_URL=upstream.url + "/v1"))
        made = voice(client)
        assert made["transcribed"] is True
        assert made["transcript"] == upstream.transcript
        assert re.fullmatch(r"notes/inbox/Voice note \d{4}-\d\d-\d\d \d\d \d\d\.md", made["path"])
        assert re.fullmatch(
            r"attachments/inbox/\d{4}-\d\d-\d\d/\d{6}-voice\.webm", made["attachment"]
        )
        assert (root / made["attachment"]).read_bytes() == WEBM
        text = data(client.get(note_url(made["path"])))["content"]
        assert f"](../../{made['attachment']})" in text
        assert upstream.transcript in text
        sent = upstream.requests[-1]
        assert sent["path"] == "/v1/audio/transcriptions"
        assert sent["form"]["file"]

    def test_without_a_transcription_service_the_note_holds_the_audio_and_says_so(self, client):
        made = voice(client, OGG, "audio/ogg")
        assert made["transcribed"] is False
        assert made["attachment"].endswith("-voice.ogg")
        text = data(client.get(note_url(made["path"])))["content"]
        assert "SERVICE_TRANSCRIBE_URL" in text

    def test_a_service_that_fails_leaves_the_audio_kept_and_says_why(self, make_app):
        client = with_key(make_app(SERVICE_TRANSCRIBE_URL=NOWHERE + "/v1"))
        made = voice(client)
        assert made["transcribed"] is False
        assert "Not transcribed" in data(client.get(note_url(made["path"])))["content"]

    def test_a_person_records_into_their_home(self, client, anon, root):
        _, as_ann = device_of(client, anon, "Ann")
        made = voice(as_ann)
        assert made["path"].startswith("notes/Ann/inbox/Voice note ")
        assert made["attachment"].startswith("attachments/Ann/inbox/")

    def test_an_outbox_replay_with_its_key_makes_one_note(self, client):
        first = voice(client, **{"Idempotency-Key": "rec-1"})
        again = voice(client, **{"Idempotency-Key": "rec-1"})
        assert again == first
        listed = data(client.get(f"{API}/notes?folder=notes/inbox"))["notes"]
        assert len(listed) == 1

    @pytest.mark.parametrize(
        ("raw", "ctype", "status", "code"),
        [
            (b"MZ\x90\x00 not audio", "audio/webm", 400, "VALIDATION_ERROR"),
            (b"<svg onload=alert(1)>", "audio/ogg", 400, "VALIDATION_ERROR"),
            (WEBM, "application/json", 415, "UNSUPPORTED_MEDIA_TYPE"),
            (WEBM, "text/html", 415, "UNSUPPORTED_MEDIA_TYPE"),
        ],
    )
    def test_what_is_not_a_recording_is_refused(self, client, raw, ctype, status, code):
        assert_error(voice(client, raw, ctype, status=status), status, code)

    def test_an_empty_or_too_large_recording_is_refused(self, make_app):
        client = with_key(make_app(SERVICE_MAX_ATTACHMENT_BYTES="2048"))
        assert_error(voice(client, b"", status=400), 400, "VALIDATION_ERROR")
        assert_error(voice(client, WEBM, status=413), 413, "PAYLOAD_TOO_LARGE")
        assert not data(client.get(f"{API}/notes"))["notes"]

    def test_a_folder_outside_the_reach_or_read_only_is_refused(self, client, anon):
        _, as_ann = device_of(client, anon, "Ann")
        resp = as_ann.post(
            f"{VOICE}?folder=notes/owner", WEBM, {"Content-Type": "audio/webm"}, status=404
        )
        assert_error(resp, 404, "NOT_FOUND")
        resp = client.post(f"{VOICE}?folder=../x", WEBM, {"Content-Type": "audio/webm"}, status=400)
        assert_error(resp, 400, "VALIDATION_ERROR")
        key = data(client.post_json(f"{API}/auth/keys", {"name": "r", "scope": "read"}))["key"]
        assert_error(voice(with_key(anon, key), status=403), 403, "FORBIDDEN")


class TestCaptureFacts:
    def test_record_names_the_https_address_when_there_is_one(self, make_app):
        plain = with_key(make_app())
        assert data(plain.get(f"{API}/capture"))["record"]["secureUrl"] is None
        public = with_key(make_app(SERVICE_PUBLIC_URL="https://notes.example.org"))
        facts = data(public.get(f"{API}/capture"))
        assert facts["record"]["secureUrl"] == "https://notes.example.org/"
        assert facts["record"]["transcribe"] is False
        assert set(facts["attachmentText"]) >= {"enabled", "files", "read", "waiting"}

    def test_anyone_without_a_key_is_refused(self, anon):
        assert_error(anon.get(f"{API}/capture", status=401), 401, "UNAUTHORIZED")
        assert_error(
            anon.post(VOICE, WEBM, {"Content-Type": "audio/webm"}, status=401), 401, "UNAUTHORIZED"
        )


class TestClipPage:
    def test_the_clip_page_is_locked_down_and_holds_no_key(self, anon):
        resp = anon.get("/clip")
        assert resp.content_type == "text/html"
        csp = resp.headers["Content-Security-Policy"]
        assert "default-src 'none'" in csp
        assert "frame-ancestors 'none'" in csp
        assert "unsafe-inline" not in csp
        assert "connect-src 'self'" in csp
        assert "event.source !== window.opener" in resp.text
        assert "nsk_" not in resp.text
        assert resp.headers["Referrer-Policy"] == "no-referrer"

    def test_the_page_and_record_js_go_together(self, anon):
        page = anon.get("/")
        sri = re.search(r'data-sri="(sha384-[^"]+)"', page.text).group(1)
        script = anon.get("/record.js")
        import base64
        import hashlib

        assert sri == "sha384-" + base64.b64encode(hashlib.sha384(script.body).digest()).decode()
        assert "'strict-dynamic'" in page.headers["Content-Security-Policy"]
        assert script.headers["Cache-Control"] == "no-cache"


@pytest.mark.real_server
@pytest.mark.slow
def test_the_real_server_takes_clips_and_recordings_up_to_the_attachment_limit(tmp_path):
    # waitress held /capture/clip and /capture/voice to SERVICE_MAX_BODY_BYTES (1 MiB)
    # while the handlers (and docs/api.md) take up to SERVICE_MAX_ATTACHMENT_BYTES: a
    # two-minute recording or a long article was 413 on a real server only.
    import json
    import urllib.request

    env = {"SERVICE_MAX_BODY_BYTES": "100000", "SERVICE_MAX_ATTACHMENT_BYTES": "3000000"}
    with running(tmp_path / "root", env=env) as server:
        key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]

        def post(path: str, body: bytes, ctype: str) -> tuple:
            req = urllib.request.Request(
                server.url + path, body, {"Content-Type": ctype, "X-Service-Key": key}
            )
            try:
                with urllib.request.urlopen(req, timeout=60) as resp:
                    return resp.status, json.loads(resp.read())
            except urllib.error.HTTPError as e:
                with e:
                    return e.code, json.loads(e.read())

        page = {"url": "https://e.x/long", "html": "<p>" + "word " * 200_000 + "</p>"}
        status, answer = post(f"{API}/capture/clip", json.dumps(page).encode(), "application/json")
        assert status == 201, answer
        recording = b"\x1a\x45\xdf\xa3" + b"\x00" * 1_500_000
        status, answer = post(VOICE, recording, "audio/webm")
        assert status == 201, answer
        status, answer = post(VOICE, recording * 2, "audio/webm")  # over the attachment limit
        assert status == 413, answer
        assert "SERVICE_MAX_ATTACHMENT_BYTES" in answer["error"]["message"]
        status, answer = post(f"{API}/notes", b"{" + b" " * 200_000 + b"}", "application/json")
        assert status == 413, answer  # every other body keeps SERVICE_MAX_BODY_BYTES
