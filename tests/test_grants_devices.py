"""Devices: pairing, claiming, revoking (src/notesvc/grants.py)."""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import logging
import re
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from conftest import (
    API,
    CALLBACK,
    LOCAL,
    assert_error,
    claim,
    data,
    ids,
    mcp_url,
    new_grant,
    note_url,
    notesvc,
    oauth_error,
    pair,
    pkce_pair,
    put_note,
    register_client,
    tmp_path_factory_root,
    token_call,
    tokens_for,
    with_key,
)


class TestDevices:
    """Pairings and device keys: a one-time secret in a link's fragment, a key per device."""

    def test_a_pairing_is_a_one_time_link_and_its_qr_code(self, client, anon):
        made = pair(client, name="Anna's phone", scope="read", folder="notes/family")
        assert re.fullmatch(r"[a-z2-7]{26}", made["secret"])  # 128 bits
        assert made["url"] == f"http://localhost:80/#pair={made['secret']}"
        assert made["scope"] == "read"
        assert made["folder"] == "notes/family"
        expires = dt.datetime.fromisoformat(made["expiresAt"].replace("Z", "+00:00"))
        assert 590 <= (expires - dt.datetime.now(dt.timezone.utc)).total_seconds() <= 600
        if importlib.util.find_spec("segno"):
            assert made["qrSvg"].startswith("<svg")
        state = json.dumps(client.app.service.state.read())
        assert made["secret"] not in state  # only its SHA-256 is kept

    @pytest.mark.parametrize("days", [2, 0])
    def test_a_paired_device_expires_when_unused_for_device_idle_days(self, make_app, days):
        client = with_key(make_app(SERVICE_DEVICE_IDLE_DAYS=str(days)))
        grants, day = client.app.service.grants, 86400
        key = claim(client, pair(client, name="phone")["secret"])["key"]
        phone = with_key(client, key)

        def listed() -> dict:
            found = [k for k in data(client.get(f"{API}/auth/keys"))["keys"]]
            return next(k for k in found if k["kind"] == "device")

        def expires_in() -> float:
            at = dt.datetime.fromisoformat(listed()["expiresAt"].replace("Z", "+00:00"))
            return at.timestamp() - grants.clock()

        if not days:  # 0: never
            assert listed()["expiresAt"] is None
            grants.clock = lambda: time.time() + 3650 * day
            data(phone.post(f"{API}/auth/verify"))
            return
        assert 2 * day - 60 < expires_in() <= 2 * day  # its last use (the claim) + 2 days
        grants.clock = lambda: time.time() + 1.5 * day
        data(phone.post(f"{API}/auth/verify"))  # a use 1.5 days on: 2 more days from now
        assert 2 * day - 60 < expires_in() <= 2 * day
        grants.clock = lambda: time.time() + 3.4 * day
        data(phone.post(f"{API}/auth/verify"))
        grants.clock = lambda: time.time() + 5.5 * day  # unused for 2.1 days: expired
        assert_error(phone.post(f"{API}/auth/verify", status=401), 401, "UNAUTHORIZED")
        assert expires_in() < 0  # listed, with the time it stopped working (revocable)
        assert "grant-write-forever" not in ids(data(client.get(f"{API}/security/audit")))

    def test_claiming_gives_a_device_key_with_the_pairings_scope_and_folder(self, client, anon):
        put_note(client, "notes/family/list.md", "# List")
        put_note(client, "notes/work/plan.md", "# Plan")
        made = pair(client, name="Anna's phone", scope="write", folder="notes/family")
        got = claim(anon, made["secret"].upper(), name="Anna's\x07 Pixel")
        assert re.fullmatch(r"nsd_[A-Za-z0-9_-]{43}", got["key"])
        assert got["apiBase"] == f"http://localhost:80{API}"
        device = with_key(anon, got["key"])
        grant = data(device.post(f"{API}/auth/verify"))["grant"]
        assert grant == {
            "kind": "device",
            "scope": "write",
            "folder": "notes/family",
            "name": "Anna's Pixel",
        }
        assert data(device.get(note_url("notes/family/list.md")))["title"] == "List"
        assert_error(device.get(note_url("notes/work/plan.md"), status=404), 404, "NOT_FOUND")
        put_note(device, "notes/family/new.md", "mine")
        assert_error(device.get(f"{API}/auth/keys", status=403), 403, "FORBIDDEN")
        listed = [k for k in data(client.get(f"{API}/auth/keys"))["keys"] if k["kind"] == "device"]
        assert [(k["id"], k["name"], k["scope"]) for k in listed] == [
            (got["deviceId"], "Anna's Pixel", "write")
        ]
        assert listed[0]["lastUsedAt"]
        # used once: never again, for anyone
        assert_error(
            anon.post_json(f"{API}/auth/devices/claim", {"secret": made["secret"]}, status=404),
            404,
            "NOT_FOUND",
        )

    def test_a_secret_is_good_only_on_the_server_that_made_it(self, client, make_app, root):
        other = make_app(tmp_path_factory_root(root))
        made = pair(client)
        assert_error(claim(other, made["secret"], status=404), 404, "NOT_FOUND")
        claim(client, made["secret"])  # still good where it was made

    def test_a_revoked_device_is_out_on_its_next_request(self, client, anon):
        got = claim(anon, pair(client)["secret"])
        device = with_key(anon, got["key"])
        device.post(f"{API}/auth/verify")
        assert data(client.delete(f"{API}/auth/keys/{got['deviceId']}"))["revoked"]
        assert_error(device.post(f"{API}/auth/verify", status=401), 401, "UNAUTHORIZED")

    @pytest.mark.slow
    def test_an_admin_device_is_the_owner_but_for_the_key_itself(self, client, anon):
        got = claim(anon, pair(client, scope="admin")["secret"])
        device = with_key(anon, got["key"])
        assert data(device.post(f"{API}/auth/verify"))["grant"]["scope"] == "admin"
        data(device.get(f"{API}/auth/keys"))
        data(device.get(f"{API}/security/audit"))
        put_note(client, "notes/s.md")
        shared = data(client.post_json(f"{API}/shares", {"path": "notes/s.md"}))
        assert [s["id"] for s in data(device.get(f"{API}/shares"))["shares"]] == [shared["id"]]
        for url in (f"{API}/auth/rotate", f"{API}/auth/token"):
            assert_error(device.post(url, status=403), 403, "FORBIDDEN")

    # -- who made what (createdBy), and what a revoked device leaves (issue 40, S7) ----

    def admin_device(self, client, anon, name: str = "Admin phone") -> tuple:
        """Return (the device's id, a client with its key) of an admin device."""
        got = claim(anon, pair(client, scope="admin")["secret"], name=name)
        return got["deviceId"], with_key(anon, got["key"])

    def test_each_grant_records_who_made_it(self, client, anon):
        by_owner = new_grant(client, "write")
        assert by_owner["createdBy"] == "owner"
        made = pair(client, scope="admin")
        assert made["createdBy"] == "owner"
        got = claim(anon, made["secret"], name="Admin phone")
        dev_id, device = got["deviceId"], with_key(anon, got["key"])
        assert got["device"]["createdBy"] == "owner"  # the owner's pairing: the owner's device
        by_device = new_grant(device, "read")
        assert by_device["createdBy"] == dev_id
        its_pairing = pair(device, scope="read", name="Tablet")
        assert its_pairing["createdBy"] == dev_id
        tablet = claim(anon, its_pairing["secret"], name="Tablet")["deviceId"]
        _, owners_app = tokens_for(client, anon)
        _, devices_app = tokens_for(device, anon)
        put_note(client, "notes/s.md")
        shared = data(device.post_json(f"{API}/shares", {"path": "notes/s.md"}, status=201))
        assert shared["createdBy"] == dev_id
        keys = {k["id"]: k for k in data(client.get(f"{API}/auth/keys"))["keys"]}
        assert keys[by_owner["id"]]["createdBy"] == "owner"
        assert keys[dev_id]["createdBy"] == "owner"
        assert keys[by_device["id"]]["createdBy"] == dev_id
        assert keys[tablet]["createdBy"] == dev_id
        oauth = {k["createdBy"] for k in keys.values() if k["kind"] == "oauth"}
        assert oauth == {"owner", dev_id}
        # never a secret in the listing
        text = json.dumps(data(client.get(f"{API}/auth/keys")))
        for secret in (by_owner["key"], by_device["key"], got["key"], its_pairing["secret"]):
            assert secret not in text
        for answer in (owners_app, devices_app):
            assert answer["access_token"] not in text
            assert answer["refresh_token"] not in text
        assert "Hash" not in text

    def test_old_records_without_a_maker_read_as_unknown(self, client, anon):
        key = new_grant(client, "read")
        made = pair(client, scope="write")

        def forget(st: dict) -> None:
            for item in [*st["grants"], *st["pairings"]]:
                item.pop("createdBy", None)

        client.app.service.state.update(forget)
        got = claim(anon, made["secret"])  # an old pairing is still good
        keys = {k["id"]: k for k in data(client.get(f"{API}/auth/keys"))["keys"]}
        assert keys[key["id"]]["createdBy"] is None
        assert keys[got["deviceId"]]["createdBy"] is None
        revoked = data(client.delete(f"{API}/auth/keys/{key['id']}?cascade=true"))
        assert revoked == {"id": key["id"], "revoked": True, "alsoRevoked": []}

    def test_a_pairing_made_by_a_revoked_device_can_no_longer_be_claimed(self, client, anon):
        dev_id, device = self.admin_device(client, anon)
        waiting = pair(device, scope="admin", name="Thief's laptop")
        owners = pair(client, scope="read")
        revoked = data(client.delete(f"{API}/auth/keys/{dev_id}"))
        assert revoked == {"id": dev_id, "revoked": True}
        assert_error(claim(anon, waiting["secret"], status=404), 404, "NOT_FOUND")
        assert not any(
            p.get("createdBy") == dev_id
            for p in client.app.service.state.read().get("pairings", [])
        )
        claim(anon, owners["secret"])  # the owner's pairings wait on

    def test_a_pairing_whose_maker_is_gone_is_refused_at_claim(self, client, anon):
        # whatever way the maker went (revoked, expired), its pairing is used up
        dev_id, _ = self.admin_device(client, anon)
        grants = client.app.service.grants
        _, secret = grants.create_pairing("x", "admin", None, 600, created_by=dev_id)

        def expire(st: dict) -> None:  # the device's key expired (SERVICE_DEVICE_IDLE_DAYS)
            for g in st["grants"]:
                if g["id"] == dev_id:
                    g["expiresAt"] = "2000-01-01T00:00:00.000Z"

        client.app.service.state.update(expire)
        assert_error(claim(anon, secret, status=404), 404, "NOT_FOUND")
        assert client.app.service.state.read()["pairings"] == []

    def test_what_a_revoked_grant_makes_meanwhile_is_refused(self, client, anon):
        """A request of a device that passed its key check just before the device was
        revoked (cascade or not) writes its key, share link or OAuth grant after it: the
        maker must still be live then, or nothing is made."""
        svc = client.app.service
        dev_id, _ = self.admin_device(client, anon)
        put_note(client, "notes/s.md")
        data(client.delete(f"{API}/auth/keys/{dev_id}?cascade=true"))
        before = svc.state.read()
        with pytest.raises(notesvc.ApiError) as err:
            svc.grants.create_key("late", "admin", None, None, created_by=dev_id)
        assert err.value.status_code == 401
        with pytest.raises(notesvc.ApiError) as err:
            svc.grants.create_pairing("late", "admin", None, 600, created_by=dev_id)
        assert err.value.status_code == 401
        late = notesvc.Principal("device", "admin", grant_id=dev_id)
        with pytest.raises(notesvc.ApiError) as err:
            svc.grants.create_share("notes/s.md", 7, late)
        assert err.value.status_code == 401
        cid = register_client(anon)["client_id"]
        verifier, challenge = pkce_pair()
        client_rec = {"id": cid, "name": "Pocket assistant"}
        grant = {"challenge": challenge, "scope": "read", "folder": None}
        grant.update(resource=mcp_url(anon), createdBy=dev_id)
        redirect = svc.grants.approve(client_rec, CALLBACK, grant, "", "http://localhost:80")
        code = urllib.parse.parse_qs(urllib.parse.urlsplit(redirect).query)["code"][0]
        resp = token_call(
            anon,
            400,
            grant_type="authorization_code",
            code=code,
            client_id=cid,
            redirect_uri=CALLBACK,
            code_verifier=verifier,
            resource=mcp_url(anon),
        )
        oauth_error(resp, 400, "invalid_grant")
        after = svc.state.read()
        for what in ("grants", "pairings", "shares"):
            assert after.get(what, []) == before.get(what, []), what
        new_grant(client, "read")  # the owner makes on

    def test_cascade_revokes_what_the_device_made_and_only_that(self, client, anon):
        mine = new_grant(client, "write")
        dev_id, device = self.admin_device(client, anon)
        other_id, other = self.admin_device(client, anon, "Other phone")
        its_key = new_grant(device, "write")
        its_phone = claim(anon, pair(device, scope="write")["secret"], name="Kid's phone")
        sub = claim(anon, pair(device, scope="admin")["secret"], name="Second admin")
        subs_key = new_grant(with_key(anon, sub["key"]), "read")  # made by what it made
        _, app_tokens = tokens_for(device, anon)
        others_key = new_grant(other, "read")
        waiting = pair(device, scope="read")
        put_note(client, "notes/s.md")
        link = data(device.post_json(f"{API}/shares", {"path": "notes/s.md"}, status=201))
        # plain revoke of the other device: what it made stays, shown as made by it
        assert data(client.delete(f"{API}/auth/keys/{other_id}")) == {
            "id": other_id,
            "revoked": True,
        }
        with_key(anon, others_key["key"]).get(f"{API}/notes")
        keys = {k["id"]: k for k in data(client.get(f"{API}/auth/keys"))["keys"]}
        assert keys[others_key["id"]]["createdBy"] == other_id
        # cascade: the device and everything it made, and what that made in turn
        revoked = data(client.delete(f"{API}/auth/keys/{dev_id}?cascade=true"))
        oauth = [k["id"] for k in keys.values() if k["kind"] == "oauth"]
        made = {its_key["id"], its_phone["deviceId"], sub["deviceId"], subs_key["id"], *oauth}
        assert revoked["id"] == dev_id
        assert set(revoked["alsoRevoked"]) == made
        left = {k["id"] for k in data(client.get(f"{API}/auth/keys"))["keys"]}
        assert left == {mine["id"], others_key["id"]}
        for key in (its_key["key"], its_phone["key"], sub["key"], subs_key["key"]):
            assert_error(with_key(anon, key).get(f"{API}/notes", status=401), 401, "UNAUTHORIZED")
        bearer = {"Authorization": f"Bearer {app_tokens['access_token']}"}
        anon.post(f"{API}/mcp", "{}", headers=bearer, status=401)
        assert_error(claim(anon, waiting["secret"], status=404), 404, "NOT_FOUND")
        anon.get(f"{API}/shared/{link['url'].rsplit('/', 1)[1]}", status=404)
        for key in (mine["key"], others_key["key"]):  # what others made works on
            with_key(anon, key).get(f"{API}/notes")
        assert_error(
            client.delete(f"{API}/auth/keys/{mine['id']}?cascade=maybe", status=400),
            400,
            "VALIDATION_ERROR",
        )

    @pytest.mark.parametrize(
        ("body", "status"),
        [
            ({"scope": "admin", "folder": "notes/family"}, 400),  # admin sees every note
            ({"scope": "owner"}, 400),
            ({"scope": "write", "folder": "notes/../etc"}, 400),
            ({"scope": "write", "name": 7}, 400),
        ],
    )
    def test_bad_pairings_are_refused(self, client, body, status):
        resp = client.post_json(f"{API}/auth/devices/pairings", body, status=status)
        assert_error(resp, status, "VALIDATION_ERROR")

    def test_the_document_says_what_a_pairing_accepts(self, client):
        """The OpenAPI body and the server agree on every scope and folder combination, so
        a conformance tool's draws are judged by the API, not by its version's luck."""
        jsonschema = pytest.importorskip("jsonschema")
        doc = client.get(f"{API}/openapi.json").json
        schema = doc["paths"][f"{API}/auth/devices/pairings"]["post"]["requestBody"]
        schema = schema["content"]["application/json"]["schema"]
        validator = jsonschema.Draft202012Validator(schema)
        assert not client.post(f"{API}/auth/devices/pairings").json["data"]["folder"]  # no body
        for scope in (None, "read", "write", "admin"):
            for folder in (None, "notes/family"):
                body = {k: v for k, v in (("scope", scope), ("folder", folder)) if v}
                resp = client.post_json(f"{API}/auth/devices/pairings", body, expect_errors=True)
                assert validator.is_valid(body) == (resp.status_int == 201), (body, resp.text)

    def test_only_the_admin_makes_pairings(self, client, anon):
        anon.post_json(f"{API}/auth/devices/pairings", {"scope": "read"}, status=401)
        for scope in ("read", "write"):
            key = with_key(anon, new_grant(client, scope)["key"])
            resp = key.post_json(f"{API}/auth/devices/pairings", {"scope": "read"}, status=403)
            assert "admin" in assert_error(resp, 403, "FORBIDDEN")["message"]
        writer = with_key(anon, claim(anon, pair(client, scope="write")["secret"])["key"])
        writer.post_json(f"{API}/auth/devices/pairings", {"scope": "read"}, status=403)

    # -- which address Add a device draws (the phone issue, 42 item 6) --------------------

    ON_THIS_MACHINE = {
        "REMOTE_ADDR": "127.0.0.1",
        "HTTP_HOST": "127.0.0.1:3000",
        "SERVER_PORT": "3000",
    }

    def where(self, app, environ: dict) -> tuple:
        """(a pairing's link origin, via, the addresses answer) as environ's request sees them."""
        key = with_key(app)
        made = key.post_json(f"{API}/auth/devices/pairings", {}, extra_environ=environ)
        got = data(key.get(f"{API}/auth/devices/addresses", extra_environ=environ))
        assert made.json["data"]["url"].startswith(made.json["data"]["origin"] + "/#pair=")
        assert got["phone"] == {k: made.json["data"][k] for k in ("origin", "via")}
        return made.json["data"]["origin"], made.json["data"]["via"], got

    @pytest.mark.parametrize("host", ["127.0.0.1:3000", "localhost:3000", "[::1]:3000"])
    @pytest.mark.slow
    def test_a_page_on_loopback_draws_the_address_the_banner_gives_phones(self, make_app, host):
        app = make_app(SERVICE_HOST="192.168.1.20", SERVICE_PORT="3000")
        env = {**self.ON_THIS_MACHINE, "HTTP_HOST": host}
        origin, via, _ = self.where(app, env)
        assert (origin, via) == ("http://192.168.1.20:3000", "home")
        # the same server opened by its LAN address: that address, as before
        lan = {"REMOTE_ADDR": "192.168.1.30", "HTTP_HOST": "192.168.1.20:3000"}
        assert self.where(app, lan)[:2] == ("http://192.168.1.20:3000", "page")

    def test_listening_on_loopback_only_the_page_says_so(self, make_app):
        app = make_app(SERVICE_HOST="127.0.0.1", SERVICE_PORT="3000")
        origin, via, _ = self.where(app, self.ON_THIS_MACHINE)
        assert (origin, via) == ("http://127.0.0.1:3000", "local")

    def test_with_a_relay_a_loopback_page_draws_the_lan_else_the_relay(self, make_app):
        relay, mine = "https://relay.example.org", "https://k3xq7.relay.example.org"
        app = make_app(SERVICE_HOST="192.168.1.20", SERVICE_RELAY_URL=relay)
        known = {"relay": relay, "origin": mine}
        app.app.service.state.update(lambda d: d.update(relayOrigin=known))
        assert self.where(app, self.ON_THIS_MACHINE)[:2] == ("http://192.168.1.20:3000", "home")
        origin, via, got = self.where(app, {"REMOTE_ADDR": "192.168.1.30"})
        assert (origin, via) == (mine, "relay")
        assert got["mcpUrl"] == mine + "/api/v1/mcp"
        only_here = make_app(SERVICE_HOST="127.0.0.1", SERVICE_RELAY_URL=relay)
        only_here.app.service.state.update(lambda d: d.update(relayOrigin=known))
        assert self.where(only_here, self.ON_THIS_MACHINE)[:2] == (mine, "relay")

    def test_the_lan_address_goes_to_no_stranger(self, make_app, anon):
        """A loopback Host from elsewhere (a forged header) or through the relay is no page
        on this machine; a key that is not admin reads no address at all."""
        app = make_app(SERVICE_HOST="192.168.1.20")
        forged = {"REMOTE_ADDR": "203.0.113.5", "HTTP_HOST": "127.0.0.1:3000"}
        assert self.where(app, forged)[:2] == ("http://127.0.0.1:3000", "local")
        relayed = {**self.ON_THIS_MACHINE, "notesvc.relayed": True}
        assert "192.168.1.20" not in json.dumps(self.where(app, relayed))
        for scope in ("read", "write"):
            other = with_key(app, new_grant(with_key(app), scope)["key"])
            got = other.get(
                f"{API}/auth/devices/addresses", extra_environ=self.ON_THIS_MACHINE, status=403
            )
            assert "192.168.1.20" not in got.text
        anon_got = app.get(f"{API}/auth/devices/addresses", status=401)
        assert "192.168.1.20" not in anon_got.text

    def test_the_mcp_url_is_this_origins_without_a_relay(self, client):
        got = data(client.get(f"{API}/auth/devices/addresses"))
        assert got["mcpUrl"] == "http://localhost:80/api/v1/mcp"
        assert got["mcpVia"] == "page"

    def test_a_page_on_loopback_shows_the_phones_address_in_every_link(self, make_app):
        """The rule of Add a device (the findings issue): the server's own browser, on
        127.0.0.1, gets the MCP URL, share links and calendar feeds at the address phones
        open, as the CalDAV address; opened by its LAN address or from elsewhere, as before."""
        app = make_app(SERVICE_HOST="192.168.1.20", SERVICE_PORT="3000")
        key = with_key(app)
        put_note(key, "notes/a.md", "- [ ] milk\n")

        def origin(url: str) -> str:
            parts = urllib.parse.urlsplit(url)
            return f"{parts.scheme}://{parts.netloc}"

        def links(environ: dict) -> dict:
            got = data(key.get(f"{API}/auth/devices/addresses", extra_environ=environ))
            share = key.post_json(f"{API}/shares", {"path": "notes/a.md"}, extra_environ=environ)
            feed = key.post_json(f"{API}/auth/feeds", {"name": "Phone"}, extra_environ=environ)
            return {
                "phone": got["phone"]["origin"],
                "mcp": (got["mcpUrl"], got["mcpVia"]),
                "share": (origin(data(share)["url"]), data(share)["homeOnly"]),
                "feed": origin(data(feed)["url"]),
            }

        lan = "http://192.168.1.20:3000"
        assert links(self.ON_THIS_MACHINE) == {
            "phone": lan,
            "mcp": (lan + "/api/v1/mcp", "home"),
            "share": (lan, True),  # the page says it opens only at home
            "feed": lan,
        }
        home_only = key.post_json(
            f"{API}/auth/feeds", {"name": "y"}, extra_environ=self.ON_THIS_MACHINE
        )
        assert data(home_only)["homeOnly"] is True  # a feed says so too
        on_lan = {"REMOTE_ADDR": "192.168.1.30", "HTTP_HOST": "192.168.1.20:3000"}
        assert links(on_lan)["mcp"] == (lan + "/api/v1/mcp", "page")
        forged = {"REMOTE_ADDR": "203.0.113.5", "HTTP_HOST": "127.0.0.1:3000"}
        assert "192.168.1.20" not in json.dumps(links(forged))
        relayed = {**self.ON_THIS_MACHINE, "notesvc.relayed": True}
        assert "192.168.1.20" not in json.dumps(links(relayed))
        # a feed link drawn so opens (the secret works at any address of this server)
        feed = data(
            key.post_json(f"{API}/auth/feeds", {"name": "x"}, extra_environ=self.ON_THIS_MACHINE)
        )
        assert "SUMMARY:milk" in app.get(urllib.parse.urlsplit(feed["url"]).path).text
        # on loopback only, nothing better to draw: this machine's own address
        alone = with_key(make_app(SERVICE_HOST="127.0.0.1", SERVICE_PORT="3000"))
        got = data(alone.get(f"{API}/auth/devices/addresses", extra_environ=self.ON_THIS_MACHINE))
        assert (got["mcpUrl"], got["mcpVia"]) == ("http://127.0.0.1:3000/api/v1/mcp", "page")

    def test_an_expired_secret_is_404(self, client, anon):
        made = pair(client)
        grants = client.app.service.grants
        grants.clock = lambda: time.time() + client.app.service.config.pairing_ttl + 1
        assert_error(claim(anon, made["secret"], status=404), 404, "NOT_FOUND")
        grants.clock = time.time  # gone for good: expired pairings are dropped
        assert_error(claim(anon, made["secret"], status=404), 404, "NOT_FOUND")

    def test_a_secret_in_a_url_is_refused_and_never_logged(self, client, anon, caplog):
        made = pair(client)
        caplog.set_level(logging.DEBUG)
        resp = anon.post_json(
            f"{API}/auth/devices/claim?secret={made['secret']}",
            {"secret": made["secret"]},
            status=400,
        )
        assert "body" in assert_error(resp, 400, "VALIDATION_ERROR")["message"]
        claim(anon, made["secret"])  # still good: the refused call used nothing up
        logged = "\n".join(r.getMessage() for r in caplog.records)
        assert made["secret"] not in logged
        assert made["secret"][:13] not in logged

    def test_guessing_secrets_locks_the_address_out(self, client, anon):
        made = pair(client)
        guesser = {"REMOTE_ADDR": "203.0.113.9"}
        for i in range(10):  # ten different guesses (the same one again counts once)
            claim(anon, "a" * 25 + "abcdefghij"[i], status=404, **guesser)
        resp = anon.post_json(
            f"{API}/auth/devices/claim",
            {"secret": made["secret"]},
            status=429,
            extra_environ=guesser,
        )
        assert_error(resp, 429, "RATE_LIMITED")
        assert int(resp.headers["Retry-After"]) >= 1
        claim(anon, made["secret"], **{"REMOTE_ADDR": "203.0.113.10"})  # others are not

    @pytest.mark.parametrize(
        ("env", "remote", "offered"),
        [
            ({}, "127.0.0.1", True),
            ({}, "192.168.1.20", True),
            ({}, "fd12::5", True),
            ({}, "203.0.113.5", False),  # beyond the home network
            ({"SERVICE_SETUP_LOCAL_ONLY": "true"}, "192.168.1.20", False),
            ({"SERVICE_SETUP_LOCAL_ONLY": "true"}, "127.0.0.1", True),
        ],
    )
    def test_the_browser_may_set_up_only_a_new_server_at_home(self, make_app, env, remote, offered):
        app = make_app(**env)
        setup = data(app.get(f"{API}/system/setup", extra_environ={"REMOTE_ADDR": remote}))
        assert setup["browserSetup"] is offered
        sid = setup["serverId"]  # through the /r/<id> prefix (a relay's path): never
        assert not data(
            app.get(f"/r/{sid}{API}/system/setup", extra_environ={"REMOTE_ADDR": remote})
        )["browserSetup"]
        with_key(app).post(f"{API}/auth/link", extra_environ=LOCAL)
        assert not data(app.get(f"{API}/system/setup"))["browserSetup"]
