"""Channels: Telegram, WhatsApp, the web channel, polling (src/notesvc/providers/channels.py)."""

from __future__ import annotations

import json
import os
import re
import stat
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
import webtest

from conftest import (
    API,
    Server,
    as_key,
    assert_error,
    audit,
    claim,
    data,
    hits,
    key_of,
    notesvc,
    pair,
    relay_servers,
    running,
    wait_for,
    web_update,
    with_key,
)
from standins import (
    MINIMAL_CONFIG,
    closed_port_url,
    seed_notes,
    telegram_update,
    today_note,
    whatsapp_update,
)


class TestTelegramConnect:
    """ "Connect Telegram": the token checked first, then a code that binds one chat."""

    @pytest.fixture
    def tg(self, make_app, upstream):
        return with_key(make_app(SERVICE_TELEGRAM_API_BASE=upstream.url)), upstream

    def connect(self, client, status=201, token="123456:ABC-good") -> dict:
        resp = client.post_json(
            f"{API}/channels/connect/telegram", {"botToken": token}, status=status
        )
        return resp.json["data"] if status == 201 else resp

    def test_a_refused_token_stores_nothing(self, tg):
        client, upstream = tg
        upstream.refused_token = "123456:ABC-bad"
        resp = self.connect(client, 400, token="123456:ABC-bad")
        assert "Unauthorized" in assert_error(resp, 400, "VALIDATION_ERROR")["message"]
        assert data(client.get(f"{API}/channels"))["channels"] == []
        assert "ABC-bad" not in resp.text

    def test_telegram_unreachable_is_502_and_stores_nothing(self, make_app):
        client = with_key(make_app(SERVICE_TELEGRAM_API_BASE=closed_port_url()))
        resp = self.connect(client, 502)
        assert_error(resp, 502, "UPSTREAM_ERROR")
        assert data(client.get(f"{API}/channels"))["channels"] == []

    @pytest.mark.slow
    def test_the_first_chat_to_send_the_code_is_the_only_one_allowed(self, tg):
        client, upstream = tg
        made = self.connect(client)
        code = made["bindCode"]
        assert re.fullmatch(r"[a-z2-7]{12}", code)
        assert made["link"] == f"https://t.me/notes_bot?start={code}"
        ch = made["channel"]
        assert ch["config"]["mode"] == "polling"
        assert ch["config"]["allowedChatIds"] == []
        assert ch["name"] == "@notes_bot"
        url = f"{API}/channels/{ch['id']}"
        shown = data(client.get(url))
        assert set(shown["binding"]) == {"until"}  # the code is never shown again
        assert code not in json.dumps(shown)
        # before the code: nobody, though the allowlist is empty
        upstream.push(telegram_update("/save sneaky", chat_id=7))
        wait_for(lambda: data(client.get(url))["refusedSenders"])
        upstream.push(telegram_update(f"/start {code}", chat_id=42))
        wait_for(lambda: "boundChat" in data(client.get(url)))
        bound = data(client.get(url))
        assert bound["boundChat"]["id"] == "42"
        assert bound["boundChat"]["name"] == "Ada"
        assert bound["config"]["allowedChatIds"] == ["42"]
        assert "binding" not in bound
        wait_for(lambda: any("Connected" in t for t in upstream.sent()))
        upstream.push(telegram_update(code, chat_id=9))  # a second chat with the same code
        wait_for(lambda: "9" in [r["sender"] for r in data(client.get(url))["refusedSenders"]])
        upstream.push(telegram_update("/save oat milk", chat_id=42))
        wait_for(lambda: today_note(client).exists())
        assert "oat milk" in today_note(client).read_text()
        assert "sneaky" not in today_note(client).read_text()

    def test_a_new_code_rebinds_and_an_expired_one_binds_nothing(self, tg):
        client, upstream = tg
        ch = self.connect(client)["channel"]
        url = f"{API}/channels/{ch['id']}"
        again = data(client.post(f"{url}/bind"))
        svc = client.app.service

        def expire(data_: dict) -> None:
            for c in data_["channels"]:
                c["binding"]["until"] = "2000-01-01T00:00:00Z"

        svc.state.update(expire)
        upstream.push(telegram_update(f"/start {again['bindCode']}", chat_id=42))
        wait_for(lambda: data(client.get(url))["refusedSenders"])
        assert "boundChat" not in data(client.get(url))
        fresh = data(client.post(f"{url}/bind"))
        upstream.push(telegram_update(fresh["bindCode"], chat_id=43))
        wait_for(lambda: "boundChat" in data(client.get(url)))
        assert data(client.get(url))["config"]["allowedChatIds"] == ["43"]

    @pytest.mark.slow
    def test_a_chat_a_device_allowed_ends_with_the_device(self, tg, root):
        """T5 for chats put on an allowlist by a config (not a code): the device's chat is
        refused once the device has expired, and unbound when it is revoked; the owner's
        chat stays, and the channel never opens to anyone."""
        client, upstream = tg
        made = claim(webtest.TestApp(client.app), pair(client, scope="admin")["secret"])
        phone = as_key(client, made["key"])
        body = {
            "provider": "telegram",
            "config": {**MINIMAL_CONFIG["telegram"], "allowedChatIds": [42]},
        }
        ch = data(phone.post_json(f"{API}/channels", body, status=201))
        url = f"{API}/channels/{ch['id']}"
        client.patch_json(url, {"config": {"allowedChatIds": [42, 7]}})  # the owner's chat 7
        assert data(client.get(url))["chatMakers"] == {"42": made["deviceId"]}
        upstream.push(telegram_update("/save from the phone's chat", chat_id=42))
        wait_for(lambda: today_note(client).exists())
        svc = client.app.service

        def expire(state: dict) -> None:
            for g in state["grants"]:
                g["expiresAt"] = "2000-01-01T00:00:00.000Z"

        svc.state.update(expire)
        upstream.push(telegram_update("/save after it expired", chat_id=42))
        wait_for(lambda: "42" in [r["sender"] for r in data(client.get(url))["refusedSenders"]])
        upstream.push(telegram_update("/save the owner's own", chat_id=7))
        wait_for(lambda: "the owner's own" in today_note(client).read_text())
        assert "after it expired" not in today_note(client).read_text()
        client.delete(f"{API}/auth/keys/{made['deviceId']}")
        shown = data(client.get(url))
        assert shown["config"]["allowedChatIds"] == ["7"]
        assert "chatMakers" not in shown
        client.patch_json(url, {"config": {"allowedChatIds": [7]}})
        revoked = claim(webtest.TestApp(client.app), pair(client, scope="admin")["secret"])
        tablet = as_key(client, revoked["key"])
        tablet.patch_json(url, {"config": {"allowedChatIds": [7, 9]}})
        client.patch_json(url, {"config": {"allowedChatIds": [9]}})  # the owner drops 7
        client.delete(f"{API}/auth/keys/{revoked['deviceId']}")
        shown = data(client.get(url))
        assert shown["config"]["allowedChatIds"] == []
        assert set(shown["binding"]) == {"until"}  # closed: nobody, not anyone
        assert not any(f["id"] == f"channel-open-{ch['id']}" for f in audit(client)["findings"])
        upstream.push(telegram_update("/save anyone?", chat_id=99))
        wait_for(lambda: "99" in [r["sender"] for r in data(client.get(url))["refusedSenders"]])
        assert "anyone?" not in today_note(client).read_text()

    def test_bind_refuses_other_channels(self, client):
        web = data(client.post_json(f"{API}/channels", {"provider": "web"}, status=201))
        resp = client.post(f"{API}/channels/{web['id']}/bind", status=400)
        assert_error(resp, 400, "VALIDATION_ERROR")
        assert_error(client.post(f"{API}/channels/ch_nope/bind", status=404), 404, "NOT_FOUND")


UPDATES = {"telegram": telegram_update, "whatsapp": whatsapp_update, "web": web_update}


class TestChannels:
    @pytest.fixture
    def client(self, make_app, upstream):
        client = with_key(
            make_app(
                SERVICE_TELEGRAM_API_BASE=upstream.url,
                SERVICE_WHATSAPP_API_BASE=upstream.url + "/v21.0",
            )
        )
        seed_notes(client)
        return client

    def create(self, client, provider, **config):
        body = {"provider": provider, "config": {**MINIMAL_CONFIG[provider], **config}}
        return data(client.post_json(f"{API}/channels", body, status=201))

    def hook(self, client, provider, payload, secret, status=200, how="header"):
        url = f"{API}/channels/webhook/{provider}"
        headers = {}
        if how == "header":
            headers["X-Service-Channel-Secret"] = secret
        elif how == "telegram":
            headers["X-Telegram-Bot-Api-Secret-Token"] = secret
        else:
            url += "?" + urllib.parse.urlencode({"secret": secret})
        anon = webtest.TestApp(client.app)
        return anon.post_json(url, payload, headers=headers, status=status)

    def test_providers_list_their_config_fields(self, client):
        providers = data(client.get(f"{API}/channels/providers"))["providers"]
        assert [p["name"] for p in providers] == list(notesvc.CHANNEL_PROVIDERS)
        telegram = next(p for p in providers if p["name"] == "telegram")
        fields = {f["name"]: f for f in telegram["fields"]}
        assert fields["botToken"]["required"] is True
        assert fields["botToken"]["secret"] is True
        assert "allowedChatIds" in fields
        whatsapp = next(p for p in providers if p["name"] == "whatsapp")
        assert {"accessToken", "phoneNumberId", "verifyToken", "allowedNumbers"} <= {
            f["name"] for f in whatsapp["fields"]
        }

    def test_create_shows_secrets_once_and_lists_redact(self, client, root):
        ch = self.create(client, "telegram", allowedChatIds=[42])
        assert set(ch) == {
            "id",
            "provider",
            "name",
            "enabled",
            "createdAt",
            "webhookUrl",
            "secret",
            "config",
        }
        assert ch["config"]["botToken"] == "123456:ABC-telegram-token"
        assert ch["config"]["allowedChatIds"] == ["42"]
        assert ch["webhookUrl"].endswith("/api/v1/channels/webhook/telegram")
        assert len(ch["secret"]) >= 32
        listed = data(client.get(f"{API}/channels"))["channels"]
        text = json.dumps(listed)
        assert ch["secret"] not in text
        assert "ABC-telegram-token" not in text
        assert listed[0]["config"]["botToken"].startswith("…")
        state = root / ".notesvc" / "state.json"
        assert stat.S_IMODE(os.stat(state).st_mode) == 0o600

    def test_channels_survive_a_restart(self, client, make_app):
        ch = self.create(client, "web")
        again = with_key(make_app())
        assert [c["id"] for c in data(again.get(f"{API}/channels"))["channels"]] == [ch["id"]]

    @pytest.mark.parametrize(
        "body",
        [
            {"provider": "carrier-pigeon", "config": {}},
            {"config": {}},
            {"provider": "telegram", "config": {}},
            {"provider": "telegram", "config": {"botToken": 5}},
            {"provider": "telegram", "config": {"botToken": "t", "allowedChatIds": "42"}},
            {"provider": "telegram", "config": {"botToken": "t", "extra": 1}},
            {"provider": "telegram", "config": "token"},
            {"provider": "whatsapp", "config": {"accessToken": "a"}},
            {"provider": "web", "name": "x" * 101},
        ],
    )
    @pytest.mark.slow
    def test_create_validation(self, client, body):
        resp = client.post_json(f"{API}/channels", body, status=400)
        assert_error(resp, 400, "VALIDATION_ERROR")

    def test_toggle_and_delete(self, client):
        ch = self.create(client, "web")
        off = data(client.post(f"{API}/channels/{ch['id']}/toggle"))
        assert off["enabled"] is False
        assert ch["secret"] not in json.dumps(off)
        assert data(client.post(f"{API}/channels/{ch['id']}/toggle"))["enabled"] is True
        assert data(client.delete(f"{API}/channels/{ch['id']}")) == {
            "id": ch["id"],
            "deleted": True,
        }
        assert data(client.get(f"{API}/channels"))["channels"] == []
        for method, url in (
            ("POST", f"{API}/channels/{ch['id']}/toggle"),
            ("DELETE", f"{API}/channels/{ch['id']}"),
        ):
            resp = client.request(url, method=method, status=404)
            assert_error(resp, 404, "NOT_FOUND")

    def test_webhook_errors(self, client):
        ch = self.create(client, "web")
        assert_error(
            self.hook(client, "pigeon", web_update("hi"), ch["secret"], 404), 404, "NOT_FOUND"
        )
        assert_error(self.hook(client, "web", web_update("hi"), "wrong", 401), 401, "UNAUTHORIZED")
        assert_error(self.hook(client, "web", web_update("hi"), "", 401), 401, "UNAUTHORIZED")
        # A secret of another provider's channel is wrong here.
        tg = self.create(client, "telegram")
        self.hook(client, "web", web_update("hi"), tg["secret"], 401)
        client.post(f"{API}/channels/{ch['id']}/toggle")
        resp = self.hook(client, "web", web_update("hi"), ch["secret"], 403)
        assert_error(resp, 403, "CHANNEL_DISABLED")

    def test_webhook_failures_count_toward_lockout(self, client):
        self.create(client, "web")
        for i in range(10):
            self.hook(client, "web", web_update("hi"), f"wrong{i}", 401)
        resp = self.hook(client, "web", web_update("hi"), "wrong", 429)
        assert_error(resp, 429, "RATE_LIMITED")

    def test_telegram_save_writes_the_daily_note_and_replies(self, client, upstream, root):
        ch = self.create(client, "telegram", allowedChatIds=[42])
        resp = self.hook(
            client, "telegram", telegram_update("/save buy milk"), ch["secret"], how="telegram"
        )
        assert data(resp) == {"handled": True, "delivered": True}
        inbox = list((root / "notes" / "daily").glob("*.md"))  # into the daily note
        assert len(inbox) == 1
        text = inbox[0].read_text()
        assert re.search(r"^- \d\d:\d\d buy milk$", text, re.M)
        assert text.startswith("# " + notesvc.day_note(notesvc.dt.date.today())[1])
        sent = upstream.requests[-1]
        assert sent["path"] == "/bot123456:ABC-telegram-token/sendMessage"
        assert sent["json"]["chat_id"] == "42"
        assert "Saved to notes/daily/" in sent["json"]["text"]
        # A second /save appends to the same note; the index follows.
        self.hook(client, "telegram", telegram_update("/save@my_bot call mum"), ch["secret"])
        assert "call mum" in inbox[0].read_text()
        assert "buy milk" in inbox[0].read_text()
        assert hits(client, "milk") == [str(inbox[0].relative_to(root))]

    def test_telegram_question_reaches_the_agent_and_the_chat(self, client, upstream):
        ch = self.create(client, "telegram")
        self.hook(
            client, "telegram", telegram_update("where did I put the spare keys?"), ch["secret"]
        )
        reply = upstream.requests[-1]["json"]["text"]
        assert "Spare keys are under the blue flowerpot." in reply

    def test_search_command(self, client, upstream):
        ch = self.create(client, "telegram")
        self.hook(client, "telegram", telegram_update("/search tomatoes"), ch["secret"])
        reply = upstream.requests[-1]["json"]["text"]
        assert "Garden — notes/garden.md" in reply
        self.hook(client, "telegram", telegram_update('/search "open'), ch["secret"])
        assert "quote" in upstream.requests[-1]["json"]["text"]

    def test_update_without_text_is_not_handled(self, client, upstream):
        ch = self.create(client, "telegram")
        sticker = telegram_update(None, sticker={"file_id": "x", "emoji": "👍"})
        assert data(self.hook(client, "telegram", sticker, ch["secret"]))["handled"] is False
        assert (
            data(self.hook(client, "telegram", {"update_id": 5}, ch["secret"]))["handled"] is False
        )
        assert upstream.requests == []

    def test_sender_outside_allowlist_learns_nothing(self, client, upstream):
        ch = self.create(client, "telegram", allowedChatIds=["42"])
        resp = self.hook(
            client, "telegram", telegram_update("spare keys", chat_id=666), ch["secret"]
        )
        assert data(resp) == {"handled": False, "reason": "sender not allowed"}
        assert "flowerpot" not in resp.text
        assert upstream.requests == []

    def test_failed_delivery_is_200_delivered_false(self, client, upstream, caplog):
        ch = self.create(client, "telegram")
        upstream.status = 500
        resp = self.hook(client, "telegram", telegram_update("keys"), ch["secret"])
        assert data(resp) == {"handled": True, "delivered": False}
        assert any("delivering the reply failed" in r.getMessage() for r in caplog.records)

    def test_whatsapp_round_trip_and_verification(self, client, upstream):
        ch = self.create(client, "whatsapp", allowedNumbers=["15551234567"])
        resp = self.hook(
            client,
            "whatsapp",
            whatsapp_update("where are the spare keys"),
            ch["secret"],
            how="query",
        )
        assert data(resp) == {"handled": True, "delivered": True}
        sent = upstream.requests[-1]
        assert sent["path"] == "/v21.0/106540352242922/messages"
        assert sent["headers"]["Authorization"] == "Bearer EAAG-whatsapp-token"
        assert sent["json"]["to"] == "15551234567"
        assert sent["json"]["messaging_product"] == "whatsapp"
        assert "flowerpot" in sent["json"]["text"]["body"]
        assert client.app.service.query_secret_seen_at > 0
        anon = webtest.TestApp(client.app)
        ok = anon.get(
            f"{API}/channels/webhook/whatsapp",
            {
                "hub.mode": "subscribe",
                "hub.verify_token": "verify-me-please",
                "hub.challenge": "1158201444",
            },
        )
        assert ok.text == "1158201444"
        bad = anon.get(
            f"{API}/channels/webhook/whatsapp",
            {"hub.mode": "subscribe", "hub.verify_token": "nope", "hub.challenge": "1"},
            status=403,
        )
        assert_error(bad, 403, "FORBIDDEN")
        image = whatsapp_update(None)
        assert data(self.hook(client, "whatsapp", image, ch["secret"]))["handled"] is False

    def test_web_replies_inline(self, client, upstream):
        ch = self.create(client, "web")
        d = data(self.hook(client, "web", web_update("when do I plant tomatoes?"), ch["secret"]))
        assert d["handled"] is True
        assert "Plant tomatoes in May." in d["reply"]
        assert upstream.requests == []

    @pytest.mark.parametrize("name", list(notesvc.CHANNEL_PROVIDERS))
    @pytest.mark.slow
    def test_every_channel_provider_handles_a_text_update(self, client, upstream, name):
        assert name in UPDATES, f"add a sample update of channel provider {name} to UPDATES"
        assert name in MINIMAL_CONFIG, f"add channel provider {name} to MINIMAL_CONFIG"
        ch = self.create(client, name)
        resp = self.hook(client, name, UPDATES[name]("/search tomatoes"), ch["secret"])
        assert data(resp)["handled"] is True
        empty = self.hook(client, name, UPDATES[name](None), ch["secret"])
        assert data(empty)["handled"] is False

    def test_no_secret_in_any_log_line(self, client, upstream, caplog):
        caplog.set_level("DEBUG", logger="notesvc")
        tg = self.create(client, "telegram")
        wa = self.create(client, "whatsapp")
        self.hook(client, "telegram", telegram_update("keys"), tg["secret"])
        self.hook(client, "whatsapp", whatsapp_update("keys"), wa["secret"], how="query")
        upstream.status = 500
        self.hook(client, "telegram", telegram_update("keys"), tg["secret"])
        logged = "\n".join(r.getMessage() for r in caplog.records)
        for secret in (
            tg["secret"],
            wa["secret"],
            "ABC-telegram-token",
            "EAAG-whatsapp-token",
            "verify-me-please",
            key_of(client),
        ):
            assert secret not in logged

    def test_webhook_url_through_the_relay_prefix_carries_it(self, client):
        sid = client.app.service.state.read()["serverId"]
        direct = self.create(client, "web")["webhookUrl"]
        body = {"provider": "web", "config": {}}
        ch = data(client.post_json(f"/r/{sid}{API}/channels", body, status=201))
        assert ch["webhookUrl"] == direct.replace(API, f"/r/{sid}{API}")
        assert ch["webhookUrl"].endswith(f"/r/{sid}/api/v1/channels/webhook/web")
        hook = urllib.parse.urlsplit(ch["webhookUrl"]).path
        anon = webtest.TestApp(client.app)
        resp = anon.post_json(
            hook,
            web_update("when do I plant tomatoes?"),
            headers={"X-Service-Channel-Secret": ch["secret"]},
        )
        assert "Plant tomatoes in May." in data(resp)["reply"]

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_webhook_url_through_a_real_relay_carries_the_prefix(self, tmp_path):
        relay = Server(tmp_path / "relay", "relay", env={"SERVICE_RELAY_TIMEOUT": "5"})
        server = Server(tmp_path / "srv", env={"SERVICE_RELAY_URL": relay.url})
        try:
            wait_for(lambda: relay_servers(relay) == 1)
            setup = server.request("GET", f"{API}/system/setup")[2]["data"]
            prefix = f"/r/{setup['serverId']}{API}"
            key = {"X-Service-Key": setup["apiKey"]}
            body = {"provider": "web", "config": {}}
            status, _, answer = relay.request("POST", f"{prefix}/channels", body, key)
            assert status == 201
            ch = answer["data"]
            assert ch["webhookUrl"] == f"{relay.url}{prefix}/channels/webhook/web"
            hook = ch["webhookUrl"][len(relay.url) :]
            secret = {"X-Service-Channel-Secret": ch["secret"]}
            status, _, answer = relay.request("POST", hook, web_update("hello"), secret)
            assert status == 200
            assert answer["data"]["handled"] is True
        finally:
            server.stop()
            relay.stop()

    def test_patch_merges_config_and_keeps_the_secret(self, client, upstream, root):
        ch = self.create(client, "telegram", allowedChatIds=[42])
        url = f"{API}/channels/{ch['id']}"
        body = {"name": "Family bot", "config": {"allowedChatIds": [42, "7"]}}
        changed = data(client.patch_json(url, body))
        assert changed["name"] == "Family bot"
        assert changed["config"]["allowedChatIds"] == ["42", "7"]
        assert changed["config"]["botToken"].startswith("…")
        assert changed["secret"] == notesvc.redact(ch["secret"])
        assert ch["secret"] not in json.dumps(changed)
        assert "ABC-telegram-token" not in json.dumps(changed)
        assert set(changed) == set(ch)
        stored = json.loads((root / ".notesvc" / "state.json").read_text())["channels"][0]
        assert stored["secret"] == ch["secret"]
        assert stored["config"]["botToken"] == "123456:ABC-telegram-token"
        # The new sender gets through with the old secret; the name alone changes only it.
        resp = self.hook(client, "telegram", telegram_update("keys", chat_id=7), ch["secret"])
        assert data(resp) == {"handled": True, "delivered": True}
        assert upstream.requests[-1]["path"] == "/bot123456:ABC-telegram-token/sendMessage"
        again = data(client.patch_json(url, {"name": "Bot"}))
        assert again["name"] == "Bot"
        assert again["config"]["allowedChatIds"] == ["42", "7"]
        assert data(client.get(url))["name"] == "Bot"

    @pytest.mark.parametrize(
        ("body", "status"),
        [
            ({}, 400),
            ({"secret": "mine"}, 400),
            ({"enabled": False}, 400),
            ({"provider": "web"}, 400),
            ({"config": {"extra": 1}}, 400),
            ({"config": {"allowedChatIds": "42"}}, 400),
            ({"config": {"allowedChatIds": [True]}}, 400),
            ({"config": {"botToken": 5}}, 400),
            ({"config": {"botToken": ""}}, 400),
            ({"config": {"botToken": "line\nbreak"}}, 400),
            ({"config": "token"}, 400),
            ({"config": []}, 400),
            ({"name": 5}, 400),
            ({"name": ""}, 400),
            ({"name": "x" * 101}, 400),
            (b'{"name": "x"', 400),
            (b"[1, 2]", 400),
            (b"", 400),
            pytest.param(b'{"name": "' + b"x" * 1_100_000 + b'"}', 413, id="huge-body"),
        ],
    )
    @pytest.mark.slow
    def test_patch_validation(self, client, root, body, status):
        ch = self.create(client, "telegram", allowedChatIds=[42])
        url = f"{API}/channels/{ch['id']}"
        state = root / ".notesvc" / "state.json"
        before = json.loads(state.read_text())["channels"]
        if isinstance(body, bytes):
            resp = client.patch(url, body, content_type="application/json", status=status)
        else:
            resp = client.patch_json(url, body, status=status)
        assert_error(resp, status, "VALIDATION_ERROR" if status == 400 else "PAYLOAD_TOO_LARGE")
        assert json.loads(state.read_text())["channels"] == before
        assert ch["secret"] not in resp.text

    def test_patch_and_get_of_an_unknown_channel_are_404(self, client):
        for resp in (
            client.patch_json(f"{API}/channels/ch_nope", {"name": "x"}, status=404),
            client.get(f"{API}/channels/ch_nope", status=404),
        ):
            assert_error(resp, 404, "NOT_FOUND")
        anon = webtest.TestApp(client.app)
        ch = self.create(client, "web")
        url = f"{API}/channels/{ch['id']}"
        resp = client.patch(url, "x", content_type="text/plain", status=415)
        assert_error(resp, 415, "UNSUPPORTED_MEDIA_TYPE")
        for method in ("GET", "PATCH"):
            resp = anon.request(f"{API}/channels/{ch['id']}", method=method, status=401)
            assert_error(resp, 401, "UNAUTHORIZED")

    def test_get_shows_refused_senders_and_the_log_names_them(self, client, upstream, caplog):
        caplog.set_level("INFO", logger="notesvc")
        ch = self.create(client, "telegram", allowedChatIds=[42])
        url = f"{API}/channels/{ch['id']}"
        fresh = data(client.get(url))
        assert fresh["refusedSenders"] == []
        assert fresh["secret"] == notesvc.redact(ch["secret"])
        assert fresh["config"]["botToken"].startswith("…")
        assert ch["secret"] not in json.dumps(fresh)
        update = telegram_update("the secret diary text", chat_id=666)
        update["message"]["from"]["first_name"] = "Mallory"
        resp = self.hook(client, "telegram", update, ch["secret"])
        assert data(resp) == {"handled": False, "reason": "sender not allowed"}
        refused = data(client.get(url))["refusedSenders"]
        assert [(r["sender"], r["name"]) for r in refused] == [("666", "Mallory")]
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z", refused[0]["at"])
        logged = [r for r in caplog.records if "refused sender" in r.getMessage()]
        assert [r.levelname for r in logged] == ["INFO"]
        assert logged[0].getMessage() == (
            f"channel {ch['id']}: refused sender 666 (Mallory) — "
            "add it to config.allowedChatIds to allow"
        )
        everything = "\n".join(r.getMessage() for r in caplog.records)
        assert "secret diary" not in everything
        # Listings stay as they were; the refused senders survive a toggle and a PATCH.
        assert "refusedSenders" not in data(client.get(f"{API}/channels"))["channels"][0]
        client.post(f"{API}/channels/{ch['id']}/toggle")
        client.post(f"{API}/channels/{ch['id']}/toggle")
        client.patch_json(url, {"name": "renamed"})
        assert data(client.get(url))["refusedSenders"] == refused
        assert upstream.requests == []

    def test_refused_senders_keep_the_last_ten_distinct(self, client):
        ch = self.create(client, "telegram", allowedChatIds=[42])
        for chat_id in [*range(1000, 1012), 1003]:
            self.hook(client, "telegram", telegram_update("hi", chat_id=chat_id), ch["secret"])
        refused = data(client.get(f"{API}/channels/{ch['id']}"))["refusedSenders"]
        # 1000 and 1001 fell off; 1003 wrote again and moved to the end, once.
        assert [r["sender"] for r in refused] == [str(i) for i in (1002, *range(1004, 1012), 1003)]

    def test_whatsapp_refused_sender_has_the_contact_name(self, client, upstream):
        ch = self.create(client, "whatsapp", allowedNumbers=["15551234567"])
        self.hook(client, "whatsapp", whatsapp_update("hi", number="15550000000"), ch["secret"])
        refused = data(client.get(f"{API}/channels/{ch['id']}"))["refusedSenders"]
        assert [(r["sender"], r["name"]) for r in refused] == [("15550000000", "Ada")]
        assert upstream.requests == []

    def test_plugin_provider_parsing_pairs_still_works(self, make_app, root):
        plugins = root / ".notesvc" / "plugins"
        plugins.mkdir(parents=True)
        (plugins / "pigeon.py").write_text(
            "import notesvc\n"
            "@notesvc.channel_provider('pigeon', (notesvc.ConfigField('allowedBirds', 'list'),),\n"
            "                          allow='allowedBirds')\n"
            "def parse(payload):\n"
            "    return [(str(payload.get('bird', '')), payload.get('text'))]\n"
            "PLUGIN = notesvc.Plugin(name='pigeon', description='carrier pigeons')\n"
        )
        try:
            client = with_key(make_app())
            body = {"provider": "pigeon", "config": {"allowedBirds": ["rex"]}}
            ch = data(client.post_json(f"{API}/channels", body, status=201))
            anon = webtest.TestApp(client.app)
            hook = f"{API}/channels/webhook/pigeon"
            secret = {"X-Service-Channel-Secret": ch["secret"]}
            ok = data(anon.post_json(hook, {"bird": "rex", "text": "/save seed"}, headers=secret))
            assert ok["handled"] is True
            no = data(anon.post_json(hook, {"bird": "crow", "text": "hi"}, headers=secret))
            assert no == {"handled": False, "reason": "sender not allowed"}
            refused = data(client.get(f"{API}/channels/{ch['id']}"))["refusedSenders"]
            assert [(r["sender"], r["name"]) for r in refused] == [("crow", "")]
            changed = client.patch_json(
                f"{API}/channels/{ch['id']}", {"config": {"allowedBirds": ["crow"]}}
            )
            assert data(changed)["config"]["allowedBirds"] == ["crow"]
        finally:
            notesvc.CHANNEL_PROVIDERS.pop("pigeon", None)


class TestPolling:
    @pytest.fixture
    def client(self, make_app, upstream):
        return with_key(make_app(SERVICE_TELEGRAM_API_BASE=upstream.url))

    def create(self, client, **config):
        body = {
            "provider": "telegram",
            "config": {**MINIMAL_CONFIG["telegram"], "allowedChatIds": [42], **config},
        }
        return data(client.post_json(f"{API}/channels", body, status=201))

    def test_a_new_telegram_channel_polls_and_handles_updates(self, client, upstream, root):
        ch = self.create(client)
        assert ch["config"]["mode"] == "polling"  # the default for a new channel
        assert upstream.webhook is None  # no setWebhook in polling mode
        wait_for(lambda: client.app.service.pollers.running() == [ch["id"]])
        first = upstream.push(telegram_update("/save from the bus"))
        wait_for(
            lambda: today_note(client).exists() and "from the bus" in today_note(client).read_text()
        )
        wait_for(lambda: upstream.sent())
        assert upstream.sent()[-1].startswith("Saved to notes/daily/")
        offsets = root / ".notesvc" / "channel-offsets.json"
        wait_for(
            lambda: offsets.exists() and json.loads(offsets.read_text()) == {ch["id"]: first + 1}
        )
        assert stat.S_IMODE(os.stat(offsets).st_mode) == 0o600
        polls = [c["json"] for c in upstream.bot_calls if c["path"].endswith("/getUpdates")]
        assert polls[0]["timeout"] == 25
        assert polls[0]["allowed_updates"] == ["message", "edited_message", "channel_post"]
        wait_for(
            lambda: any(
                c["json"].get("offset") == first + 1
                for c in upstream.bot_calls
                if c["path"].endswith("/getUpdates")
            )
        )
        # A stranger's update is refused like a webhook's.
        upstream.push(telegram_update("let me in", chat_id=666))
        wait_for(lambda: data(client.get(f"{API}/channels/{ch['id']}"))["refusedSenders"])

    def test_a_webhook_in_the_way_is_deleted(self, client, upstream):
        upstream.webhook = {"url": "https://old.example/hook"}
        upstream.push(telegram_update("/save after the webhook"))
        self.create(client)
        wait_for(lambda: today_note(client).exists())
        assert upstream.webhook is None
        assert any(c["path"].endswith("/deleteWebhook") for c in upstream.bot_calls)
        assert [c["json"] for c in upstream.bot_calls if c["path"].endswith("/deleteWebhook")] == [
            {"drop_pending_updates": False}
        ]

    def test_switching_off_or_deleting_stops_the_poller_at_once(self, client, upstream):
        upstream.max_hold = 30  # a long poll is in flight when the channel stops
        ch = self.create(client)
        pollers = client.app.service.pollers
        wait_for(lambda: pollers.running() == [ch["id"]] and upstream.polls)
        started = time.monotonic()
        client.post(f"{API}/channels/{ch['id']}/toggle")
        wait_for(lambda: pollers.running() == [], timeout=10)
        assert time.monotonic() - started < 10  # not the poll's 30 s hold (a loaded CI: slack)
        upstream.push(telegram_update("/save while off"))
        assert [u["message"]["text"] for u in upstream.updates] == ["/save while off"]  # untaken
        assert not today_note(client).exists()
        client.post(f"{API}/channels/{ch['id']}/toggle")  # on again: what waited arrives
        wait_for(lambda: today_note(client).exists())
        client.delete(f"{API}/channels/{ch['id']}")
        wait_for(lambda: pollers.running() == [], timeout=10)
        offsets = client.app.service.config.state_dir / "channel-offsets.json"
        # (no file: no offset was kept yet, for any channel)
        assert ch["id"] not in json.loads(offsets.read_text() if offsets.exists() else "{}")
        # Switching to webhook mode stops polling too, and sets the webhook.
        ch = self.create(client)
        wait_for(lambda: pollers.running() == [ch["id"]])
        client.patch_json(f"{API}/channels/{ch['id']}", {"config": {"mode": "webhook"}})
        wait_for(lambda: pollers.running() == [], timeout=10)
        assert upstream.webhook["secret_token"] == ch["secret"]

    @pytest.mark.slow
    def test_switching_to_webhook_mode_keeps_the_webhook_from_the_stopping_poller(
        self, client, upstream
    ):
        """A poller between two getUpdates when the webhook is set would meet it (409) and
        delete it: the PATCH stops the poller, and waits for it, before setWebhook."""
        upstream.max_hold = 0.0  # every getUpdates answers at once: the poller never rests
        for i in range(6):
            ch = self.create(client)
            if i % 2:  # else at once: its first getUpdates may still be on its way
                before = upstream.polls
                wait_for(lambda before=before: upstream.polls >= before + 3)
            url = f"{API}/channels/{ch['id']}"
            client.patch_json(url, {"config": {"mode": "webhook"}})
            assert client.app.service.pollers.running() == []
            # a getUpdates sent before the poller stopped is answered (or dropped) by now;
            # its bytes may reach the stand-in after setWebhook (the poller is gone by then)
            wait_for(lambda: upstream.connections == 0)
            calls = [c["path"].rsplit("/", 1)[-1] for c in upstream.bot_calls]
            after = calls[len(calls) - calls[::-1].index("setWebhook") :]
            assert set(after) <= {"getUpdates"}  # nothing deleted the webhook after it was set
            assert upstream.webhook["secret_token"] == ch["secret"]
            assert data(client.get(url))["status"]["ok"] is True
            client.delete(url)
            upstream.webhook = None

    def test_a_refused_token_is_shown_as_the_channel_status(self, client, upstream, caplog):
        upstream.poll_status = 401
        ch = self.create(client)
        url = f"{API}/channels/{ch['id']}"
        wait_for(lambda: "status" in data(client.get(url)))
        status = data(client.get(url))["status"]
        assert status["ok"] is False
        assert "Unauthorized" in status["error"]
        logged = "\n".join(r.getMessage() for r in caplog.records)
        assert "ABC-telegram-token" not in logged + json.dumps(status)

    def test_a_token_telegram_says_back_is_not_shown_or_logged(self, client, upstream, caplog):
        """T14 for bot tokens: a Bot API that puts the token, lower-cased, in its description."""
        upstream.poll_status = 401
        upstream.poll_error = "Unauthorized: bot 123456:abc-telegram-token is not known"
        ch = self.create(client)
        url = f"{API}/channels/{ch['id']}"
        wait_for(lambda: "status" in data(client.get(url)))
        status = data(client.get(url))["status"]
        assert "Unauthorized: bot … is not known" in status["error"]
        logged = "\n".join(r.getMessage() for r in caplog.records)
        assert "abc-telegram-token" not in (logged + json.dumps(status)).lower()

    @pytest.mark.slow
    def test_another_poller_of_the_same_bot_is_not_fought(self, client, upstream):
        upstream.poll_status = 409
        upstream.poll_error = (
            "Conflict: terminated by other getUpdates request; "
            "make sure that only one bot instance is running"
        )
        ch = self.create(client)
        url = f"{API}/channels/{ch['id']}"
        wait_for(lambda: "status" in data(client.get(url)))
        failed = time.monotonic()
        assert "only one bot instance" in data(client.get(url))["status"]["error"]

        def polls() -> int:
            return len([c for c in upstream.bot_calls if c["path"].endswith("/getUpdates")])

        wait_for(lambda: polls() >= 2, timeout=10)  # it tries again ...
        assert time.monotonic() - failed >= 0.5  # ... after backing off, not at once
        assert not any(c["path"].endswith("/deleteWebhook") for c in upstream.bot_calls)

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_polling_delivers_each_update_once_across_a_restart(self, tmp_path, upstream):
        env = {"SERVICE_TELEGRAM_API_BASE": upstream.url}
        root = tmp_path / "root"
        with running(root, "--auth-mode", "none", env=env) as server:
            body = {
                "provider": "telegram",
                "config": {"botToken": "123456:ABC-telegram-token", "allowedChatIds": [42]},
            }
            status, _, _ = server.request("POST", f"{API}/channels", body)
            assert status == 201
            upstream.push(telegram_update("/save alpha"))
            wait_for(lambda: len(upstream.sent()) == 1)
        # While the server is down two more arrive; they wait at Telegram.
        upstream.push(telegram_update("/save beta"))
        upstream.push(telegram_update("/save gamma"))
        with running(root, "--auth-mode", "none", env=env):
            wait_for(lambda: len(upstream.sent()) == 3)
            polls = upstream.polls
            wait_for(lambda: upstream.polls >= polls + 2)  # two polls more: nothing again
        daily = next((root / "notes" / "daily").glob("*.md")).read_text()
        for word in ("alpha", "beta", "gamma"):
            assert len(re.findall(rf"^- \d\d:\d\d {word}$", daily, re.M)) == 1, daily
        assert len(upstream.sent()) == 3
