"""Captures: photos, voice and files into the day's note (src/notesvc/providers/capture.py)."""

from __future__ import annotations

import json
import re

import pytest
import webtest

from conftest import (
    API,
    NOWHERE,
    PNG,
    assert_error,
    att_url,
    audit,
    data,
    hits,
    leftovers,
    notesvc,
    put_note,
    with_key,
)
from standins import (
    KEYS_NOTE,
    MINIMAL_CONFIG,
    FakeUpstream,
    telegram_update,
    today_note,
    whatsapp_update,
)

OGG = b"OggS\x00\x02" + bytes(range(200))


def photo_update(*sizes: tuple, caption: str | None = None, chat_id: int = 42) -> dict:
    """A Telegram photo message: sizes are (file_id, width, height, file_size)."""
    photo = [
        {"file_id": f, "file_unique_id": f"u{f}", "width": w, "height": h, "file_size": n}
        for f, w, h, n in sizes
    ]
    extra = {"caption": caption} if caption else {}
    return telegram_update(None, chat_id, photo=photo, **extra)


def whatsapp_media(kind: str, media_id: str, number: str = "15551234567", **fields) -> dict:
    update = whatsapp_update("x", number)
    message = update["entry"][0]["changes"][0]["value"]["messages"][0]
    del message["text"]
    message.update(type=kind, **{kind: {"id": media_id, **fields}})
    return update


def whatsapp_signature(body: bytes, secret: str) -> str:
    import hashlib
    import hmac

    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


class TestCapture:
    @pytest.fixture
    def client(self, make_app, upstream):
        return with_key(
            make_app(
                SERVICE_TELEGRAM_API_BASE=upstream.url,
                SERVICE_WHATSAPP_API_BASE=upstream.url + "/v21.0",
                SERVICE_TRANSCRIBE_URL=upstream.url + "/v1",
                SERVICE_TRANSCRIBE_API_KEY="tr-key-123",
            )
        )

    def create(self, client, provider="telegram", status=201, **config):
        base = {**MINIMAL_CONFIG[provider]}
        if provider == "telegram":
            base.update(allowedChatIds=[42], mode="webhook")
        elif provider == "whatsapp":
            base.update(allowedNumbers=["15551234567"])
        body = {"provider": provider, "config": {**base, **config}}
        return data(client.post_json(f"{API}/channels", body, status=status))

    def hook(self, client, provider, payload, secret, status=200, headers=None):
        anon = webtest.TestApp(client.app)
        headers = {"X-Service-Channel-Secret": secret, **(headers or {})} if secret else headers
        return anon.post_json(
            f"{API}/channels/webhook/{provider}", payload, headers=headers or {}, status=status
        )

    def test_a_photo_becomes_an_attachment_linked_from_the_daily_note(self, client, upstream):
        ch = self.create(client)
        upstream.add_file("ph-s", "photos/file_6.jpg", b"small")
        upstream.add_file("ph-b", "photos/file_7.jpg", PNG)
        update = photo_update(("ph-s", 90, 67, 5), ("ph-b", 1280, 960, len(PNG)), caption="Beach")
        assert data(self.hook(client, "telegram", update, ch["secret"])) == {
            "handled": True,
            "delivered": True,
        }
        text = today_note(client).read_text()
        m = re.search(
            r"^- \d\d:\d\d !\[photo\]\(\.\./\.\./(attachments/inbox/\d{4}-\d\d-\d\d/"
            r"\d{6}-photo\.jpg)\) Beach$",
            text,
            re.M,
        )
        assert m, text
        assert text.startswith("# " + notesvc.day_note(notesvc.local_now(client.app.service))[1])
        assert client.get(att_url(m.group(1))).body == PNG  # the largest size was fetched
        files = [c["json"]["file_id"] for c in upstream.bot_calls if "/getFile" in c["path"]]
        assert files == ["ph-b"]
        assert (
            upstream.downloads[-1]["path"] == "/file/bot123456:ABC-telegram-token/photos/file_7.jpg"
        )
        note = str(today_note(client).relative_to(client.app.service.config.root))
        assert upstream.sent()[-1] == f"Saved the photo to {note}."
        # The same photo again gets its own file, never overwriting the first.
        self.hook(client, "telegram", update, ch["secret"])
        assert len(re.findall(r"-photo(?:-2)?\.jpg", today_note(client).read_text())) == 2

    def test_a_voice_message_is_transcribed_under_its_link(self, client, upstream):
        ch = self.create(client)
        upstream.add_file("vc1", "voice/file_3.oga", OGG)
        voice = {"file_id": "vc1", "file_unique_id": "v", "duration": 4, "mime_type": "audio/ogg"}
        self.hook(client, "telegram", telegram_update(None, voice=voice), ch["secret"])
        text = today_note(client).read_text()
        m = re.search(
            r"^- \d\d:\d\d \[voice message\]\(\.\./\.\./(attachments/inbox/[^)]+-voice\.ogg)\)\n"
            r"  > Remember to buy oat milk and call the plumber\.$",
            text,
            re.M,
        )
        assert m, text
        assert client.get(att_url(m.group(1))).body == OGG
        asked = next(r for r in upstream.requests if r["path"] == "/v1/audio/transcriptions")
        assert asked["headers"]["Authorization"] == "Bearer tr-key-123"
        assert asked["form"]["model"] == (None, b"whisper-1")
        assert asked["form"]["file"][0].endswith("voice.ogg")
        assert asked["form"]["file"][1] == OGG
        assert "call the plumber" in upstream.sent()[-1]
        assert hits(client, "plumber") == [
            str(today_note(client).relative_to(client.app.service.config.root))
        ]

    def test_a_transcription_that_echoes_its_key_keeps_it_out_of_the_note(self, client, upstream):
        """T14 for the transcription key: the transcript is text a service wrote."""
        ch = self.create(client)
        upstream.add_file("vc1", "voice/file_3.oga", OGG)
        upstream.transcript = "Authorization: Bearer TR-KEY-123, and call the plumber."
        voice = {"file_id": "vc1", "file_unique_id": "v", "duration": 4, "mime_type": "audio/ogg"}
        self.hook(client, "telegram", telegram_update(None, voice=voice), ch["secret"])
        text = today_note(client).read_text()
        assert "> Authorization: Bearer …, and call the plumber." in text
        assert "tr-key-123" not in text.lower()
        assert "tr-key-123" not in upstream.sent()[-1].lower()

    def test_without_a_transcription_service_the_audio_is_kept_and_said_so(
        self, make_app, upstream
    ):
        client = with_key(make_app(SERVICE_TELEGRAM_API_BASE=upstream.url))
        ch = self.create(client)
        upstream.add_file("au1", "music/file_1.mp3", b"ID3" + bytes(50))
        audio = {"file_id": "au1", "mime_type": "audio/mpeg", "file_name": "Idea 1.mp3"}
        self.hook(client, "telegram", telegram_update(None, audio=audio), ch["secret"])
        text = today_note(client).read_text()
        assert re.search(
            r"\[Idea 1\.mp3\]\(\.\./\.\./attachments/inbox/[^)]+-Idea-1\.mp3\) \(not transcribed\)",
            text,
        ), text
        assert "SERVICE_TRANSCRIBE_URL is not set" in upstream.sent()[-1]
        assert not [r for r in upstream.requests if "transcriptions" in r["path"]]

    def test_a_failed_transcription_keeps_the_audio(self, make_app, upstream, caplog):
        client = with_key(
            make_app(
                SERVICE_TELEGRAM_API_BASE=upstream.url,
                SERVICE_TRANSCRIBE_URL=NOWHERE + "/v1/audio/transcriptions",
            )
        )
        ch = self.create(client)
        upstream.add_file("vc2", "voice/file_4.oga", OGG)
        voice = {"file_id": "vc2", "mime_type": "audio/ogg"}
        self.hook(client, "telegram", telegram_update(None, voice=voice), ch["secret"])
        text = today_note(client).read_text()
        assert "(transcription failed: " in text
        assert len(data(client.get(f"{API}/attachments"))["attachments"]) == 1
        assert any("transcription failed" in r.getMessage() for r in caplog.records)

    def test_files_of_other_types_or_over_the_limit_are_not_saved(self, make_app, upstream, root):
        client = with_key(
            make_app(SERVICE_TELEGRAM_API_BASE=upstream.url, SERVICE_MAX_ATTACHMENT_BYTES="4096")
        )
        ch = self.create(client)
        exe = {"file_id": "d1", "file_name": "setup.exe", "mime_type": "application/x-msdownload"}
        self.hook(client, "telegram", telegram_update(None, document=exe), ch["secret"])
        assert "not accepted" in upstream.sent()[-1]
        big = {
            "file_id": "d2",
            "file_name": "scan.pdf",
            "mime_type": "application/pdf",
            "file_size": 5000,
        }
        self.hook(client, "telegram", telegram_update(None, document=big), ch["secret"])
        assert "over 4096 bytes" in upstream.sent()[-1]
        assert not [c for c in upstream.bot_calls if "/getFile" in c["path"]]  # nothing fetched
        # A size Telegram did not announce is enforced while downloading.
        upstream.add_file("d3", "documents/file_9.pdf", b"%PDF" + b"x" * 5000)
        quiet = {"file_id": "d3", "file_name": "quiet.pdf", "mime_type": "application/pdf"}
        self.hook(client, "telegram", telegram_update(None, document=quiet), ch["secret"])
        assert "over 4096 bytes" in upstream.sent()[-1]
        assert not (root / "attachments").exists() or not list(
            (root / "attachments").rglob("*.pdf")
        )
        assert leftovers(root) == []
        assert not today_note(client).exists()  # nothing saved, nothing written
        # A named document of an accepted type is kept under its own name.
        upstream.add_file("d4", "documents/file_10.pdf", b"%PDF-1.7")
        named = {
            "file_id": "d4",
            "file_name": "Tax return 2026.pdf",
            "mime_type": "application/pdf",
        }
        self.hook(client, "telegram", telegram_update(None, document=named), ch["secret"])
        assert "[Tax return 2026.pdf](../../attachments/inbox/" in today_note(client).read_text()

    def test_whatsapp_image_and_voice_are_fetched_with_the_bearer_token(self, client, upstream):
        ch = self.create(client, "whatsapp")
        upstream.media["img-1"] = ("image/jpeg", PNG)
        upstream.media["aud-1"] = ("audio/ogg; codecs=opus", OGG)
        image = whatsapp_media("image", "img-1", mime_type="image/jpeg", caption="Receipt")
        assert data(self.hook(client, "whatsapp", image, ch["secret"]))["handled"] is True
        voice = whatsapp_media("audio", "aud-1", mime_type="audio/ogg; codecs=opus", voice=True)
        self.hook(client, "whatsapp", voice, ch["secret"])
        text = today_note(client).read_text()
        assert re.search(
            r"!\[photo\]\(\.\./\.\./attachments/inbox/[^)]+-photo\.jpg\) Receipt", text
        )
        assert re.search(
            r"\[voice message\]\([^)]+-voice\.ogg\)\n  > Remember to buy oat milk", text
        )
        fetched = [
            d for d in upstream.downloads if "whatsapp-media" in d["path"] or "/v21.0/" in d["path"]
        ]
        assert len(fetched) == 4
        assert all(d["headers"]["Authorization"] == "Bearer EAAG-whatsapp-token" for d in fetched)
        assert upstream.requests[-1]["json"]["to"] == "15551234567"
        assert "Saved the photo" in upstream.sent()[-2]

    def test_hostile_file_names_and_media_urls_go_nowhere(self, client, upstream, root):
        ch = self.create(client)
        upstream.add_file("h1", "documents/../../etc/passwd", b"root:x:0:0")
        doc = {"file_id": "h1", "file_name": "../../notes/evil.pdf", "mime_type": "application/pdf"}
        self.hook(client, "telegram", telegram_update(None, document=doc), ch["secret"])
        assert "not saved" in upstream.sent()[-1]  # Telegram's path with .. is not followed
        upstream.add_file("h2", "documents/file_2.pdf", b"%PDF")
        doc = {"file_id": "h2", "file_name": "../../notes/evil.pdf", "mime_type": "application/pdf"}
        self.hook(client, "telegram", telegram_update(None, document=doc), ch["secret"])
        saved = data(client.get(f"{API}/attachments"))["attachments"]
        assert [a["path"].rsplit("/", 1)[-1][7:] for a in saved] == ["notes-evil.pdf"]
        assert saved[0]["path"].startswith("attachments/inbox/")
        assert not (root / "notes" / "evil.pdf").exists()
        # A media URL on another plain-HTTP origin never gets the WhatsApp token.
        wa = self.create(client, "whatsapp")
        other = FakeUpstream()
        try:
            upstream.media["m1"] = ("image/jpeg", PNG)
            original = upstream.url
            upstream.url = other.url  # the Graph API answers with a URL elsewhere
            image = whatsapp_media("image", "m1", mime_type="image/jpeg")
            self.hook(client, "whatsapp", image, wa["secret"])
            upstream.url = original
            assert other.downloads == []
            assert "not https" in upstream.sent()[-1]
        finally:
            other.close()

    def test_commands_and_save_to(self, client, upstream, root):
        ch = self.create(client)

        def say(text):
            self.hook(client, "telegram", telegram_update(text), ch["secret"])
            return upstream.sent()[-1]

        assert "/save <text>" in say("/help")
        assert "/save <text>" in say("/start")
        assert "Unknown command /frobnicate" in say("/frobnicate now")
        assert say("/save") == "Usage: /save <text to keep>"
        assert say("/ask") == "Usage: /ask <question>"
        assert say("/search") == "Usage: /search <words>"
        assert say("/today").startswith("Nothing in notes/daily/")
        say("/save first thought")
        today = say("/today")
        assert today.startswith("notes/daily/")
        assert "first thought" in today
        put_note(client, "notes/home/keys.md", KEYS_NOTE)
        assert "flowerpot" in say("/ask where are the spare keys?")
        # saveTo: /save and captures go to a note per day in that folder.
        client.patch_json(f"{API}/channels/{ch['id']}", {"config": {"saveTo": "notes/journal"}})
        assert say("/save second thought").startswith("Saved to notes/journal/")
        assert "second thought" in today_note(client, "notes/journal").read_text()
        assert "second thought" not in today_note(client).read_text()
        assert "second thought" in say("/today")
        upstream.add_file("ph", "photos/p.jpg", PNG)
        self.hook(client, "telegram", photo_update(("ph", 10, 10, len(PNG))), ch["secret"])
        assert "](../../attachments/inbox/" in today_note(client, "notes/journal").read_text()

    @pytest.mark.parametrize(
        "config",
        [
            {"mode": "carrier-pigeon"},
            {"mode": 1},
            {"notify": "yes"},
            {"saveTo": "../etc"},
            {"saveTo": "journal"},
            {"saveTo": "notes/.hidden"},
            {"saveTo": 5},
            {"appSecret": "x"},  # a WhatsApp field
        ],
    )
    def test_new_config_fields_are_validated(self, client, config):
        resp = client.post_json(
            f"{API}/channels",
            {"provider": "telegram", "config": {**MINIMAL_CONFIG["telegram"], **config}},
            status=400,
        )
        assert_error(resp, 400, "VALIDATION_ERROR")

    def test_webhook_mode_sets_the_webhook_with_the_secret(self, client, upstream):
        ch = self.create(client)
        assert upstream.webhook == {
            "url": ch["webhookUrl"],
            "secret_token": ch["secret"],
            "allowed_updates": ["message", "edited_message", "channel_post"],
            "drop_pending_updates": False,
        }
        assert ch["status"]["ok"] is True
        upstream.webhook = None
        changed = data(
            client.patch_json(f"{API}/channels/{ch['id']}", {"config": {"allowedChatIds": [42, 7]}})
        )
        assert upstream.webhook["secret_token"] == ch["secret"]  # PATCH sets it again
        assert changed["status"]["ok"] is True

    def test_a_refused_set_webhook_is_shown_not_failed(self, client, upstream, caplog):
        upstream.webhook_error = (
            "Bad Request: bad webhook: An HTTPS URL must be provided for webhook"
        )
        ch = self.create(client)  # still 201
        assert ch["status"]["ok"] is False
        assert "HTTPS URL must be provided" in ch["status"]["error"]
        shown = data(client.get(f"{API}/channels/{ch['id']}"))
        assert shown["status"] == ch["status"]
        logged = "\n".join(r.getMessage() for r in caplog.records)
        assert "HTTPS URL must be provided" in logged
        for secret in (ch["secret"], "ABC-telegram-token"):
            assert secret not in logged
            assert secret not in json.dumps(shown)

    def test_an_unreachable_telegram_is_shown_not_failed(self, make_app):
        client = with_key(make_app())  # the Bot API base is a closed port
        body = {"provider": "telegram", "config": {**MINIMAL_CONFIG["telegram"], "mode": "webhook"}}
        ch = data(client.post_json(f"{API}/channels", body, status=201))
        assert ch["status"]["ok"] is False
        assert ch["status"]["error"]
        assert "ABC-telegram-token" not in ch["status"]["error"]

    def test_a_channel_stored_before_modes_stays_a_webhook(self, client, upstream, root):
        ch = self.create(client)
        state_file = root / ".notesvc" / "state.json"
        state = json.loads(state_file.read_text())
        for field in ("mode", "saveTo", "notify"):
            del state["channels"][0]["config"][field]
        state_file.write_text(json.dumps(state))
        changed = data(client.patch_json(f"{API}/channels/{ch['id']}", {"name": "old bot"}))
        assert "mode" not in changed["config"]  # a name change leaves the config alone
        changed = data(
            client.patch_json(f"{API}/channels/{ch['id']}", {"config": {"notify": True}})
        )
        assert changed["config"]["mode"] == "webhook"
        assert client.app.service.pollers.running() == []

    def test_whatsapp_with_an_app_secret_needs_meta_s_signature(self, client, upstream):
        ch = self.create(client, "whatsapp", appSecret="meta-app-secret")
        assert ch["config"]["appSecret"] == "meta-app-secret"
        listed = data(client.get(f"{API}/channels/{ch['id']}"))
        assert "meta-app-secret" not in json.dumps(listed)
        body = json.dumps(whatsapp_update("/search tomatoes")).encode()
        anon = webtest.TestApp(client.app)
        url = f"{API}/channels/webhook/whatsapp"

        def post(headers, status, query=""):
            return anon.post(
                url + query,
                body,
                headers={"Content-Type": "application/json", **headers},
                status=status,
            )

        good = whatsapp_signature(body, "meta-app-secret")
        # The signature alone authenticates: no secret in the URL needed.
        assert data(post({"X-Hub-Signature-256": good}, 200))["handled"] is True
        # With the secret, the signature is still required, and must be right.
        assert_error(post({}, 401, f"?secret={ch['secret']}"), 401, "UNAUTHORIZED")
        wrong = whatsapp_signature(body, "another-secret")
        assert_error(
            post({"X-Hub-Signature-256": wrong}, 401, f"?secret={ch['secret']}"),
            401,
            "UNAUTHORIZED",
        )
        assert (
            data(post({"X-Hub-Signature-256": good}, 200, f"?secret={ch['secret']}"))["handled"]
            is True
        )
        tampered = whatsapp_signature(body + b" ", "meta-app-secret")
        assert_error(post({"X-Hub-Signature-256": tampered}, 401), 401, "UNAUTHORIZED")
        assert_error(post({"X-Hub-Signature-256": "sha256=" + "0" * 64}, 401), 401, "UNAUTHORIZED")
        # A channel without an app secret is not reached by a signature.
        plain = self.create(client, "whatsapp", phoneNumberId="2")
        assert plain["config"]["appSecret"] == ""
        other = whatsapp_signature(body, "")
        assert_error(post({"X-Hub-Signature-256": other}, 401), 401, "UNAUTHORIZED")
        # Bad signatures count toward the lockout.
        for i in range(10):  # ten different wrong ones (the same one again counts once)
            post({"X-Hub-Signature-256": "sha256=" + f"{i:x}" * 64}, [401, 429])
        assert_error(post({"X-Hub-Signature-256": good}, 429), 429, "RATE_LIMITED")

    def test_the_audit_flags_unsigned_whatsapp_and_query_secrets(self, client, upstream):
        signed = self.create(client, "whatsapp", appSecret="meta-app-secret")
        unsigned = self.create(client, "whatsapp", phoneNumberId="2")
        found = {f["id"]: f["severity"] for f in audit(client)["findings"]}
        assert found[f"channel-unsigned-{unsigned['id']}"] == "high"
        assert f"channel-unsigned-{signed['id']}" not in found
        anon = webtest.TestApp(client.app)
        anon.post_json(
            f"{API}/channels/webhook/whatsapp?secret={unsigned['secret']}", whatsapp_update("hi")
        )
        found = {f["id"]: f["severity"] for f in audit(client)["findings"]}
        assert found["secret-in-query"] == "medium"
