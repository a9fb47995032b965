"""Setup, keys, JWT and the lockout (src/notesvc/auth.py)."""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import statistics
import string
import time

import pytest
import webtest

from conftest import (
    API,
    HERE,
    JWT_SECRET,
    KEY,
    LOCAL,
    assert_error,
    claim,
    data,
    ids,
    key_of,
    make_env,
    notesvc,
    put_note,
    route_id,
    run_cli,
    running,
    sample_url,
    wait_for,
    with_key,
)

SETUP_FIELDS = [
    "serverId",
    "apiKey",
    "setupComplete",
    "version",
    "auth.method",
    "auth.header",
    "auth.note",
    "pairing.mode",
    "pairing.relayCode",
    "pairing.relayUrl",
    "server.url",
    "server.port",
    "server.host",
    "server.cors",
    "links.setupApi",
    "links.health",
    "links.apiBase",
    "links.directApiBase",
    "links.relayApiBase",
    "links.connect.testHosted",
    "links.connect.hosted",
    "links.connect.localDevUi",
    "instructions",
]


def dig(obj: dict, dotted: str):
    for part in dotted.split("."):
        obj = obj[part]
    return obj


class TestSetup:
    def test_payload_has_every_spec_field(self, anon):
        payload = data(anon.get(f"{API}/system/setup"))
        for name in SETUP_FIELDS:
            dig(payload, name)  # KeyError names a missing field
        assert payload["auth"]["method"] == "api-key"
        assert payload["auth"]["header"] == "X-Service-Key"
        assert payload["server"]["port"] == 3000
        assert re.fullmatch(r"\d+\.\d+\.\d+", payload["version"])
        assert payload["version"] == notesvc.__version__

    def test_key_has_prefix_and_43_urlsafe_chars(self, anon):
        key = data(anon.get(f"{API}/system/setup", extra_environ=LOCAL))["apiKey"]
        assert re.fullmatch(r"nsk_[A-Za-z0-9_-]{43}", key)

    def test_relay_mode_links(self, anon):
        p = data(anon.get(f"{API}/system/setup", headers={"Host": "notes.example:3000"}))
        sid, code = p["serverId"], p["pairing"]["relayCode"]
        links = p["links"]
        assert p["server"]["url"] == "http://notes.example:3000"
        assert links["directApiBase"] == "http://notes.example:3000/api/v1"
        assert links["relayApiBase"] == f"http://notes.example:3000/r/{sid}/api/v1"
        assert links["apiBase"] == links["relayApiBase"]
        assert links["setupApi"] == "http://notes.example:3000/api/v1/system/setup"
        assert links["health"] == "http://notes.example:3000/api/v1/health"
        assert links["connect"]["hosted"].endswith(f"?relayCode={code}")
        assert links["connect"]["testHosted"].endswith(f"?relayCode={code}")
        assert "relayUrl=http%3A%2F%2Fnotes.example%3A3000" in links["connect"]["localDevUi"]

    def test_open_port_mode_uses_direct_api_base(self, make_app):
        p = data(make_app(SERVICE_PAIRING_MODE="open-port").get(f"{API}/system/setup"))
        assert p["pairing"]["mode"] == "open-port"
        assert p["links"]["apiBase"] == p["links"]["directApiBase"]

    def test_configured_relay_and_client_urls(self, make_app):
        app = make_app(
            SERVICE_RELAY_URL="https://relay.example",
            SERVICE_CLIENT_URL="https://app.example/connect",
            SERVICE_TEST_CLIENT_URL="https://test.example/?v=2",
        )
        p = data(app.get(f"{API}/system/setup"))
        code = p["pairing"]["relayCode"]
        assert p["pairing"]["relayUrl"] == "https://relay.example"
        assert p["links"]["relayApiBase"].startswith("https://relay.example/r/")
        assert p["links"]["connect"]["hosted"] == f"https://app.example/connect?relayCode={code}"
        assert p["links"]["connect"]["testHosted"] == f"https://test.example/?v=2&relayCode={code}"

    @pytest.mark.parametrize(
        "host", ["evil.example/phish", "a b", "user@evil.example", "x:99999", "<script>", ""]
    )
    def test_invalid_host_header_is_ignored(self, anon, host):
        p = data(anon.get(f"{API}/system/setup", headers={"Host": host}))
        assert p["server"]["url"] == "http://127.0.0.1:80"  # WebTest's SERVER_PORT
        assert "evil" not in json.dumps(p)

    def test_forwarded_headers_ignored_unless_proxy_trusted(self, make_app):
        headers = {"X-Forwarded-Proto": "https", "X-Forwarded-Host": "notes.example"}
        untrusted = data(make_app().get(f"{API}/system/setup", headers=headers))
        assert "notes.example" not in untrusted["server"]["url"]
        trusted_app = make_app(SERVICE_TRUST_PROXY="true")
        proxy = {"REMOTE_ADDR": "127.0.0.1"}  # the peer is the (loopback) proxy
        trusted = data(trusted_app.get(f"{API}/system/setup", headers=headers, extra_environ=proxy))
        assert trusted["server"]["url"] == "https://notes.example"
        elsewhere = {"REMOTE_ADDR": "192.0.2.7"}  # trusted proxies only, not any peer
        other = trusted_app.get(f"{API}/system/setup", headers=headers, extra_environ=elsewhere)
        assert "notes.example" not in data(other)["server"]["url"]

    def test_public_url_wins(self, make_app):
        app = make_app(SERVICE_PUBLIC_URL="https://pi.example/")
        p = data(app.get(f"{API}/system/setup", headers={"Host": "other:1"}))
        assert p["server"]["url"] == "https://pi.example"

    def test_link_completes_setup_and_redacts_key(self, anon, client):
        key = key_of(anon)
        before = data(anon.get(f"{API}/system/setup", extra_environ=LOCAL))
        assert before["setupComplete"] is False
        assert before["apiKey"] == key
        assert before["instructions"]
        link = client.post_json(f"{API}/auth/link", {"clientName": "phone"}, extra_environ=LOCAL)
        linked = data(link)
        assert linked["linked"] is True
        assert linked["setupComplete"] is True
        after = data(anon.get(f"{API}/system/setup"))
        assert after["setupComplete"] is True
        assert after["apiKey"] == "nsk_…" + key[-4:]
        assert key not in json.dumps(after)
        assert "instructions" not in after
        # The key keeps working after it is redacted.
        assert data(client.post(f"{API}/auth/verify"))["setupComplete"] is True

    def test_setup_local_only_hides_key_from_remote_clients(self, make_app):
        app = make_app(SERVICE_SETUP_LOCAL_ONLY="true")
        key = key_of(app)
        home = {"REMOTE_ADDR": "192.168.1.7"}  # its own network: not loopback
        remote = data(app.get(f"{API}/system/setup", extra_environ=home))
        assert remote["apiKey"] != key
        assert remote["apiKey"].startswith("nsk_…")
        local = data(app.get(f"{API}/system/setup", extra_environ={"REMOTE_ADDR": "127.0.0.1"}))
        assert local["apiKey"] == key

    @pytest.mark.parametrize(
        ("host", "shown"),
        [
            ("127.0.0.1:3000", True),
            ("[::1]:3000", True),
            ("192.168.1.20", True),
            ("LocalHost:3000", True),
            (socket.gethostname().upper(), True),
            (f"{socket.gethostname()}.local:3000", True),
            ("notes.example", True),  # SERVICE_PUBLIC_URL's host
            ("rebind.attacker.example", False),
            ("localhost.attacker.example", False),
            (f"{socket.gethostname()}.attacker.example", False),
            ("", False),
        ],
    )
    def test_full_key_only_for_hosts_naming_this_machine(self, make_app, host, shown):
        app = make_app(SERVICE_PUBLIC_URL="https://notes.example")
        key = key_of(app)
        p = data(app.get(f"{API}/system/setup", headers={"Host": host}, extra_environ=LOCAL))
        assert (p["apiKey"] == key) is shown
        if not shown:
            assert p["apiKey"] == "nsk_…" + key[-4:]

    def test_forwarded_host_counts_for_the_key_only_from_a_trusted_proxy(self, make_app):
        app = make_app(SERVICE_TRUST_PROXY="true")
        key = key_of(app)
        home = {"Host": "127.0.0.1", "X-Forwarded-For": "192.168.1.5"}
        rebind = {**home, "X-Forwarded-Host": "rebind.attacker.example"}
        via_proxy = {"REMOTE_ADDR": "127.0.0.1"}
        assert (
            data(app.get(f"{API}/system/setup", headers=home, extra_environ=via_proxy))["apiKey"]
            == key
        )
        p = data(app.get(f"{API}/system/setup", headers=rebind, extra_environ=via_proxy))
        assert p["apiKey"] != key  # the proxy was asked for the attacker's name
        assert p["setupHere"] == {"allowed": False, "reason": "host"}

    # -- who may set up: the TCP peer decides, never a header ---------------------------

    STRANGER = {"REMOTE_ADDR": "203.0.113.5"}  # beyond any home network

    @pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.1:3000", "localhost", "[::1]:3000"])
    def test_a_stranger_naming_this_machine_gets_no_key_and_cannot_link(self, make_app, host):
        """S1: the Host header is the client's to write; it never earns the key."""
        app = make_app()
        key = key_of(app)
        p = data(
            app.get(f"{API}/system/setup", headers={"Host": host}, extra_environ=self.STRANGER)
        )
        assert p["apiKey"] == "nsk_…" + key[-4:]
        assert p["browserSetup"] is False
        assert p["setupHere"] == {"allowed": False, "reason": "remote"}
        for _ in range(12):  # more than the lockout's 10: a refusal here is not a failure
            resp = with_key(app).post(
                f"{API}/auth/link", headers={"Host": host}, extra_environ=self.STRANGER, status=403
            )
            err = assert_error(resp, 403, "FORBIDDEN")
            assert err["message"] == (
                "finish setup on this machine or its home network, or run `pair` on the server"
            )
        assert not app.app.service.state.read()["setupComplete"]
        assert data(with_key(app).get(f"{API}/notes", extra_environ=self.STRANGER)) is not None
        # from home the same key links at once
        with_key(app).post(f"{API}/auth/link", extra_environ={"REMOTE_ADDR": "192.168.1.5"})
        assert app.app.service.state.read()["setupComplete"]

    @pytest.mark.parametrize(
        ("peer", "home"),
        [
            ("127.0.0.1", True),
            ("127.8.9.10", True),
            ("::1", True),
            ("10.1.2.3", True),
            ("172.16.5.4", True),
            ("172.31.255.254", True),
            ("172.32.0.1", False),
            ("192.168.1.5", True),
            ("100.64.1.2", True),  # a tailnet
            ("100.127.255.254", True),
            ("100.128.0.1", False),
            ("169.254.3.4", True),
            ("fd00::1", True),
            ("fe80::1", True),
            ("::ffff:192.168.1.5", True),  # IPv4-mapped, unwrapped
            ("::ffff:203.0.113.5", False),
            ("2a01:4f8::1", False),  # a global IPv6 address is not home
            ("203.0.113.5", False),
            ("8.8.8.8", False),
            ("", False),  # no peer at all: not local
        ],
    )
    def test_home_ranges_decide_by_the_peer(self, make_app, peer, home):
        app = make_app()
        key = key_of(app)
        env = {"REMOTE_ADDR": peer} if peer else {}
        p = data(app.get(f"{API}/system/setup", headers={"Host": "127.0.0.1"}, extra_environ=env))
        assert (p["apiKey"] == key) is home
        assert p["setupHere"]["allowed"] is home
        assert p["browserSetup"] is home
        if not home:
            assert p["setupHere"]["reason"] == "remote"

    @pytest.mark.parametrize(
        "header",
        [
            ("X-Forwarded-For", "127.0.0.1"),
            ("Forwarded", "for=127.0.0.1"),
            ("X-Real-IP", "127.0.0.1"),
            ("X-Forwarded-Host", "127.0.0.1"),
            ("X-Forwarded-Proto", "http"),
            ("Via", "1.1 tunnel"),
            ("CF-Connecting-IP", "127.0.0.1"),
            ("True-Client-IP", "127.0.0.1"),
        ],
    )
    def test_a_forwarding_header_from_an_untrusted_peer_is_not_local(self, make_app, header):
        """A proxy or tunnel nobody named in SERVICE_TRUST_PROXY: whoever it carries, the
        loopback peer is not the client."""
        app = make_app()
        key = key_of(app)
        p = data(app.get(f"{API}/system/setup", headers=dict([header]), extra_environ=LOCAL))
        assert p["apiKey"] != key
        assert p["setupHere"] == {"allowed": False, "reason": "proxy"}
        resp = with_key(app).post(
            f"{API}/auth/link", headers=dict([header]), extra_environ=LOCAL, status=403
        )
        assert_error(resp, 403, "FORBIDDEN")

    @pytest.mark.parametrize(
        ("headers", "shown"),
        [
            ({"X-Forwarded-For": "203.0.113.5"}, False),
            ({"X-Forwarded-For": "192.168.1.5"}, True),
            ({"X-Forwarded-For": "192.168.1.5, 203.0.113.5"}, False),  # the left is the client's
            ({"X-Forwarded-For": "203.0.113.5, 127.0.0.1"}, False),  # a second trusted hop
            ({"X-Forwarded-For": "10.0.0.7, 127.0.0.1"}, True),
            ({"X-Forwarded-For": "unknown"}, False),
            ({"X-Forwarded-For": "127.0.0.1"}, True),  # a trusted proxy's client on loopback
            ({"X-Forwarded-For": "203.0.113.5, 127.0.0.1, 127.0.0.1"}, False),
            ({"Forwarded": 'for="[fd00::5]:4711";proto=https'}, True),
            ({"Forwarded": "for=203.0.113.5"}, False),
            ({"Forwarded": "for=_hidden"}, False),
            ({"X-Real-IP": "10.0.0.2"}, True),
            ({"X-Real-IP": "203.0.113.5"}, False),
            ({}, False),  # a trusted proxy that names no client
            ({"X-Forwarded-Proto": "https"}, False),
            # A proxy that sets only X-Real-IP or Forwarded passes the client's own
            # X-Forwarded-For on: every header a proxy may have written must name home.
            ({"X-Forwarded-For": "127.0.0.1", "X-Real-IP": "203.0.113.5"}, False),
            ({"X-Forwarded-For": "192.168.1.5", "Forwarded": "for=203.0.113.5"}, False),
            ({"Forwarded": "for=10.0.0.2", "X-Real-IP": "203.0.113.5"}, False),
            ({"X-Forwarded-For": "127.0.0.1", "X-Real-IP": "unknown"}, False),
            ({"X-Forwarded-For": "192.168.1.5", "X-Real-IP": "192.168.1.5"}, True),
        ],
    )
    @pytest.mark.slow
    def test_a_trusted_proxy_names_the_client(self, make_app, headers, shown):
        app = make_app(SERVICE_TRUST_PROXY="127.0.0.1")
        key = key_of(app)
        hdrs = {"Host": "127.0.0.1", **headers}
        p = data(app.get(f"{API}/system/setup", headers=hdrs, extra_environ=LOCAL))
        assert (p["apiKey"] == key) is shown
        if not shown:
            assert p["setupHere"] == {"allowed": False, "reason": "remote"}

    def test_a_relayed_request_is_never_local(self, make_app):
        app = make_app()
        relayed = {**LOCAL, "notesvc.relayed": True}
        p = data(app.get(f"{API}/system/setup", extra_environ=relayed))
        assert p["apiKey"] != key_of(app)
        assert p["setupHere"] == {"allowed": False, "reason": "relayed"}
        assert_error(
            with_key(app).post(f"{API}/auth/link", extra_environ=relayed, status=403),
            403,
            "FORBIDDEN",
        )

    def test_local_only_narrows_to_loopback(self, make_app):
        app = make_app(SERVICE_SETUP_LOCAL_ONLY="true")
        home = {"REMOTE_ADDR": "192.168.1.7"}
        p = data(app.get(f"{API}/system/setup", extra_environ=home))
        assert p["setupHere"] == {"allowed": False, "reason": "loopback-only"}
        assert_error(
            with_key(app).post(f"{API}/auth/link", extra_environ=home, status=403), 403, "FORBIDDEN"
        )
        assert data(app.get(f"{API}/system/setup", extra_environ=LOCAL))["setupHere"]["allowed"]

    def test_the_key_is_offered_only_during_the_setup_window(self, make_app):
        app = make_app(SERVICE_SETUP_WINDOW="60")
        key = key_of(app)
        assert data(app.get(f"{API}/system/setup", extra_environ=LOCAL))["apiKey"] == key
        app.app.service.setup_opened -= 61  # a minute later (no wait: a busy machine is slow)
        p = data(app.get(f"{API}/system/setup", extra_environ=LOCAL))
        assert p["setupHere"]["reason"] == "window"
        assert p["apiKey"] == "nsk_…" + key[-4:]
        assert p["browserSetup"] is False
        err = assert_error(
            with_key(app).post(f"{API}/auth/link", extra_environ=LOCAL, status=403),
            403,
            "FORBIDDEN",
        )
        assert "restart" in err["message"]
        assert "pair" in err["message"]
        # A start opens it again (the window runs from the start).
        assert data(make_app().get(f"{API}/system/setup", extra_environ=LOCAL))["apiKey"] == key
        never = make_app(SERVICE_SETUP_WINDOW="0")
        assert data(never.get(f"{API}/system/setup", extra_environ=LOCAL))["apiKey"] != key

    @pytest.mark.parametrize(
        ("raw", "seconds"), [("1800", 1800), ("90s", 90), ("30m", 1800), ("2h", 7200), ("0", 0)]
    )
    def test_setup_window_values(self, root, raw, seconds):
        cfg = notesvc.load_config(env=make_env(root, SERVICE_SETUP_WINDOW=raw))
        assert cfg.setup_window == seconds
        assert notesvc.load_config(env=make_env(root)).setup_window == 1800

    @pytest.mark.parametrize("raw", ["soon", "-5", "30d", "m"])
    def test_setup_window_refuses_what_is_not_a_duration(self, root, raw):
        with pytest.raises(notesvc.ConfigError, match="SERVICE_SETUP_WINDOW"):
            notesvc.load_config(env=make_env(root, SERVICE_SETUP_WINDOW=raw))

    @pytest.mark.parametrize(
        ("mode", "own", "container", "loopback_only"),
        [
            ("auto", "203.0.113.7", False, True),  # a VPS: its neighbours are strangers
            ("auto", "192.168.1.20", False, False),  # a Pi at home
            ("auto", "10.0.0.4", False, False),
            ("auto", "100.101.102.103", False, False),  # on a tailnet
            ("auto", "[fd00::4]", False, False),
            ("auto", "[2a01:4f8::1]", False, True),
            ("auto", "", False, True),  # no network at all
            ("auto", "192.168.1.20", True, True),  # a container: all arrive via its gateway
            ("true", "192.168.1.20", False, True),
            ("false", "203.0.113.7", True, False),
        ],
    )
    def test_auto_mode_decides_from_this_machine(self, mode, own, container, loopback_only):
        assert notesvc.setup_loopback_only(mode, own, container) is loopback_only

    @pytest.mark.parametrize(
        ("own", "cloud", "loopback_only"),
        [
            ("10.0.0.4", "a cloud VM (sys_vendor 'Amazon EC2')", True),  # a VPC's neighbours
            ("192.168.1.20", "a Kubernetes pod", True),
            ("10.0.0.4", None, True),  # no firmware names to tell: a cloud's or a cluster's range
            ("172.20.0.5", None, True),
            ("192.168.1.20", None, False),  # a Pi at home (no DMI on ARM): its router's range
            ("100.101.102.103", None, False),
            ("10.0.0.4", "", False),  # the firmware names a maker, and no cloud
        ],
    )
    def test_auto_mode_is_loopback_only_on_clouds_and_in_pods(self, own, cloud, loopback_only):
        """T13: a cloud VM's VPC address or a pod's cluster address is no home network."""
        assert notesvc.setup_loopback_only("auto", own, False, cloud) is loopback_only
        why = notesvc.setup_loopback_reason("auto", own, False, cloud)
        assert bool(why) is loopback_only
        if cloud is None and loopback_only:
            assert "10.0.0.0/8, 172.16.0.0/12" in why
        assert not notesvc.setup_loopback_only("false", own, False, cloud)

    @pytest.mark.parametrize(
        ("files", "seen"),
        [
            ({"sys_vendor": "Amazon EC2", "product_name": "m6g.large"}, "Amazon EC2"),
            ({"sys_vendor": "Google", "product_name": "Google Compute Engine"}, "Google"),
            ({"sys_vendor": "Microsoft Corporation", "product_name": "Virtual Machine"}, "Virtual"),
            ({"sys_vendor": "DigitalOcean", "product_name": "Droplet"}, "DigitalOcean"),
            ({"sys_vendor": "Hetzner", "product_name": "vServer"}, "Hetzner"),
            ({"sys_vendor": "OpenStack Foundation", "product_name": "OpenStack Nova"}, "Nova"),
            ({"sys_vendor": "Xen", "hypervisor": "ec2e1916-9099-7caf-fd21-012345abcdef"}, "EC2"),
            ({"sys_vendor": "QEMU", "product_name": "Standard PC (Q35 + ICH9, 2009)"}, ""),
            ({"sys_vendor": "Dell Inc.", "product_name": "OptiPlex 7050"}, ""),
            ({"sys_vendor": "Microsoft Corporation", "product_name": "Surface Laptop 5"}, ""),
            ({}, None),  # nothing to read: cannot tell
        ],
    )
    def test_the_machine_names_its_cloud(self, tmp_path, monkeypatch, files, seen):
        dmi = tmp_path / "dmi"
        dmi.mkdir()
        hypervisor = tmp_path / "uuid"
        for name, value in files.items():
            (hypervisor if name == "hypervisor" else dmi / name).write_text(value + "\n")
        if not any(dmi.iterdir()):
            dmi.rmdir()
        monkeypatch.setattr(notesvc.Machine, "DMI", str(dmi))
        monkeypatch.setattr(notesvc.Machine, "HYPERVISOR_UUID", str(hypervisor))
        found = notesvc.Machine.cloud({})
        if seen is None or seen == "":
            assert found == seen
        else:
            assert seen in found
        pod = notesvc.Machine.cloud({"KUBERNETES_SERVICE_HOST": "10.96.0.1"})
        assert "Kubernetes" in pod

    def test_auto_mode_on_a_cloud_vm_shows_the_key_to_loopback_only(
        self, make_app, tmp_path, monkeypatch, caplog
    ):
        dmi = tmp_path / "dmi"
        dmi.mkdir()
        (dmi / "sys_vendor").write_text("DigitalOcean\n")
        (dmi / "product_name").write_text("Droplet\n")
        monkeypatch.setattr(notesvc.Machine, "DMI", str(dmi))
        monkeypatch.setattr(notesvc.Machine, "CONTAINER_MARKS", (str(tmp_path / "none"),))
        app = make_app(SERVICE_SETUP_LOCAL_ONLY="auto")
        key = key_of(app)
        vpc = {"REMOTE_ADDR": "10.114.0.3"}  # a neighbour in the droplet's VPC
        p = data(app.get(f"{API}/system/setup", extra_environ=vpc))
        assert p["setupHere"] == {"allowed": False, "reason": "loopback-only"}
        assert key not in json.dumps(p)
        assert data(app.get(f"{API}/system/setup", extra_environ=LOCAL))["apiKey"] == key
        said = [
            r.getMessage() for r in caplog.records if "SERVICE_SETUP_LOCAL_ONLY" in r.getMessage()
        ]
        assert said
        assert "DigitalOcean" in said[0]
        assert "SERVICE_SETUP_LOCAL_ONLY=false" in said[0]

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_a_real_server_in_a_pod_lets_only_loopback_set_up(self, tmp_path):
        """T13 on a real server: with KUBERNETES_SERVICE_HOST set, `auto` is loopback only,
        and the log says why and how to widen it."""
        env = {"SERVICE_SETUP_LOCAL_ONLY": "auto", "KUBERNETES_SERVICE_HOST": "10.96.0.1"}
        with running(tmp_path / "root", env=env) as server:
            key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]
            assert re.fullmatch(r"nsk_[A-Za-z0-9_-]{43}", key)  # this machine itself: yes
            status, _, body = server.request("GET", f"{API}/security/config", headers={KEY: key})
            assert status == 200
            assert body["data"]["setup"]["localOnly"] is True
            said = wait_for(lambda: [line for line in server.lines if "Kubernetes pod" in line])
            assert "SERVICE_SETUP_LOCAL_ONLY=false" in said[0]

    @pytest.mark.parametrize(
        ("raw", "mode"), [("", "false"), ("auto", "auto"), ("AUTO", "auto"), ("yes", "true")]
    )
    def test_setup_local_only_values(self, root, raw, mode):
        env = make_env(root, SERVICE_SETUP_LOCAL_ONLY=raw)
        assert notesvc.load_config(env=env).setup_local_only == mode
        env.pop("SERVICE_SETUP_LOCAL_ONLY")
        assert notesvc.load_config(env=env).setup_local_only == "auto"  # the default

    def test_no_route_but_the_setup_payload_shows_the_key_and_only_at_home(self, make_app):
        """Every GET route, as a stranger and at home, with and without the key: the full
        setup key is in no answer but GET /system/setup's to the client at home."""
        app = make_app()
        key = key_of(app)
        put_note(with_key(app), "notes/a.md", "a")
        routes = [r for r in app.app.service.routes if r.method == "GET"]
        assert len(routes) > 30
        setup_rule = f"{API}/system/setup"
        for who, env in (("stranger", self.STRANGER), ("home", LOCAL)):
            for creds in ({}, {"X-Service-Key": key}):
                for r in routes:
                    url = sample_url(r)
                    resp = app.get(url, headers=creds, extra_environ=env, status="*")
                    seen = resp.body + str(resp.headers).encode()
                    if r.rule == setup_rule and who == "home":
                        assert key.encode() in seen
                    else:
                        assert key.encode() not in seen, f"{who} {r.method} {r.rule}"

    def test_the_page_says_why_it_cannot_set_up_here(self):
        """The web client shows setupHere's reason and what to do (pair, rotate-key)."""
        devices = (HERE / "web" / "devices.js").read_text()
        assert "setupHere" in devices
        for reason in ("remote", "loopback-only", "relayed", "proxy", "window", "host"):
            assert re.search(rf'(?:"{reason}"|\b{reason}):', devices), reason
        assert "python3 notesvc.py pair" in devices
        assert "python3 notesvc.py rotate-key" in devices
        assert 'id="setup-elsewhere"' in (HERE / "web" / "app.html").read_text()

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_a_real_server_judges_the_client_a_trusted_proxy_names(self, tmp_path):
        """S1 on a real server behind a (loopback) proxy it trusts: the forwarded address
        decides, whatever Host says."""
        setup, link = f"{API}/system/setup", f"{API}/auth/link"
        env = {"SERVICE_TRUST_PROXY": "127.0.0.1"}
        with running(tmp_path / "root", env=env) as server:
            stranger = {"X-Forwarded-For": "203.0.113.5", "Host": "127.0.0.1"}
            home = {"X-Forwarded-For": "192.168.1.5", "Host": "127.0.0.1"}
            key = server.request("GET", setup, headers=home)[2]["data"]["apiKey"]
            assert re.fullmatch(r"nsk_[A-Za-z0-9_-]{43}", key)
            for headers in (stranger, {"Host": "localhost"}):  # the latter names no client
                status, _, body = server.request("GET", setup, headers=headers)
                assert status == 200
                assert body["data"]["apiKey"] == "nsk_…" + key[-4:]
                assert body["data"]["setupHere"] == {"allowed": False, "reason": "remote"}
                assert key not in json.dumps(body)
            status, _, body = server.request("POST", link, headers={**stranger, KEY: key})
            assert status == 403
            assert body["error"]["code"] == "FORBIDDEN"
            assert "run `pair` on the server" in body["error"]["message"]
            assert not server.request("GET", setup, headers=home)[2]["data"]["setupComplete"]
            status, _, body = server.request("GET", f"{API}/notes", headers={**stranger, KEY: key})
            assert status == 200  # the key itself works from anywhere; setup waits
            status, _, body = server.request("POST", link, headers={**home, KEY: key})
            assert status == 200
            assert server.request("GET", setup, headers=home)[2]["data"]["setupComplete"]

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_a_client_forged_forwarded_for_loses_to_the_proxys_own_header(self, tmp_path):
        """A trusted proxy that writes only X-Real-IP (a common nginx setup) or only
        Forwarded (HAProxy's `option forwarded`) passes on whatever X-Forwarded-For the
        client sent: a stranger's `X-Forwarded-For: 127.0.0.1` must not make it local."""
        setup, link = f"{API}/system/setup", f"{API}/auth/link"
        with running(tmp_path / "root", env={"SERVICE_TRUST_PROXY": "127.0.0.1"}) as server:
            home = {"X-Forwarded-For": "192.168.1.5", "Host": "127.0.0.1"}
            key = server.request("GET", setup, headers=home)[2]["data"]["apiKey"]
            assert re.fullmatch(r"nsk_[A-Za-z0-9_-]{43}", key)
            for proxys in ({"X-Real-IP": "203.0.113.5"}, {"Forwarded": "for=203.0.113.5"}):
                forged = {"X-Forwarded-For": "127.0.0.1", "Host": "127.0.0.1", **proxys}
                status, _, body = server.request("GET", setup, headers=forged)
                assert status == 200
                assert key not in json.dumps(body)
                assert body["data"]["setupHere"] == {"allowed": False, "reason": "remote"}
                status, _, body = server.request("POST", link, headers={**forged, KEY: key})
                assert status == 403
                assert body["error"]["code"] == "FORBIDDEN"
            assert not server.request("GET", setup, headers=home)[2]["data"]["setupComplete"]

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_a_real_server_trusts_no_forwarding_header_by_default(self, tmp_path):
        with running(tmp_path / "root") as server:
            setup = f"{API}/system/setup"
            key = server.request("GET", setup)[2]["data"]["apiKey"]
            assert re.fullmatch(r"nsk_[A-Za-z0-9_-]{43}", key)  # loopback, no header: local
            for forwarded in ({"X-Forwarded-For": "127.0.0.1"}, {"Via": "1.1 tunnel"}):
                body = server.request("GET", setup, headers=forwarded)[2]
                assert body["data"]["apiKey"] != key
                assert body["data"]["setupHere"]["reason"] == "proxy"

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_rotate_key_on_the_server_completes_setup(self, make_app, root):
        app = make_app()
        out = run_cli("rotate-key", "--root", str(root))
        assert out.returncode == 0, out.stderr
        new = out.stdout.strip()
        assert "Setup is complete" in out.stderr
        st = app.app.service.state.read()
        assert st["setupComplete"] is True
        assert "apiKey" not in st  # kept hashed only
        assert st["keyHash"] == notesvc.key_hash(new)
        p = data(app.get(f"{API}/system/setup", extra_environ=LOCAL))
        assert p["setupComplete"] is True
        assert p["apiKey"] == "nsk_…" + new[-4:]
        assert data(with_key(app, new).post(f"{API}/auth/verify"))["valid"]

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_claiming_an_admin_pairing_made_by_pair_completes_setup(self, make_app, root):
        app = make_app()
        state = app.app.service.state
        # an admin pairing made over the API with the setup key does not (link does)
        made = data(with_key(app).post_json(f"{API}/auth/devices/pairings", {"scope": "admin"}))
        claim(app, made["secret"], **self.STRANGER)
        assert not state.read()["setupComplete"]
        for scope, done in (("write", False), ("admin", True)):
            out = run_cli("pair", "--root", str(root), "--scope", scope)
            assert out.returncode == 0, out.stderr
            secret = re.search(r"#pair=([a-z2-7]+)", out.stdout).group(1)
            claim(app, secret, **self.STRANGER)  # made on the server: claimed from anywhere
            assert bool(state.read()["setupComplete"]) is done, scope
        assert "apiKey" not in state.read()

    @pytest.mark.parametrize("scope", ["admin", "write"])
    def test_a_setup_made_as_readme_says_audits_clean_but_for_plain_http(
        self, make_app, root, scope
    ):
        # README's first run: start (defaults), open the page on the server (setup: an admin
        # pairing made with the setup key, claimed as this browser's device, linked), then
        # Add a device for a phone, which scans the code (issue 42: that made a write key
        # that never expires, and the notes folder was created readable by all)
        app = make_app()
        key = data(app.get(f"{API}/system/setup", extra_environ=LOCAL))["apiKey"]
        made = data(
            with_key(app, key).post_json(
                f"{API}/auth/devices/pairings", {"name": "laptop", "scope": "admin"}
            )
        )
        device_key = claim(app, made["secret"], name="laptop", **LOCAL)["key"]
        browser = webtest.TestApp(
            app.app, extra_environ={"HTTP_X_SERVICE_KEY": device_key, **LOCAL}
        )
        browser.post_json(f"{API}/auth/link", {"clientName": "web client on laptop"})
        phone = data(browser.post_json(f"{API}/auth/devices/pairings", {"scope": scope}))
        claim(app, phone["secret"], name="phone", REMOTE_ADDR="192.168.1.30")
        report = data(browser.get(f"{API}/security/audit"))
        assert ids(report) == {"plain-http-all-interfaces"}, report["findings"]
        assert report["score"] == 90
        listed = data(browser.get(f"{API}/auth/keys"))["keys"]
        assert all(k["expiresAt"] for k in listed if k["kind"] == "device")  # idle: 90 days

    @pytest.mark.real_server
    @pytest.mark.slow
    @pytest.mark.parametrize(
        "env",
        [
            {"SERVICE_HOST": "0.0.0.0"},
            {"SERVICE_HOST": "127.0.0.1", "SERVICE_RELAY_URL": "https://relay.example.org"},
        ],
    )
    def test_the_audit_command_calls_an_unfinished_reachable_setup_critical(
        self, make_app, root, env
    ):
        make_app()  # a fresh root: setup incomplete
        out = run_cli("audit", "--root", str(root), env=env)
        assert out.returncode == 1, out.stdout + out.stderr  # a critical finding
        assert "!! [critical] Setup is not complete on a reachable server (setup-exposed)" in (
            out.stdout
        )
        assert "pair" in out.stdout

    def test_server_id_and_key_survive_restart(self, make_app, root):
        first = data(make_app().get(f"{API}/system/setup", extra_environ=LOCAL))
        second = data(make_app().get(f"{API}/system/setup", extra_environ=LOCAL))
        assert first["serverId"] == second["serverId"]
        assert first["apiKey"] == second["apiKey"]
        assert first["pairing"]["relayCode"] == second["pairing"]["relayCode"]


PROTECTED_ROUTES = [r for r in notesvc.ROUTES if not r.public]


PUBLIC_ROUTES = [r for r in notesvc.ROUTES if r.public]


def refuses_missing_and_wrong_key(anon, method: str, rule: str) -> None:
    wrong = with_key(anon, "nsk_" + "A" * 43)
    for app, who in ((anon, "no key"), (wrong, "a wrong key")):
        resp = app.request(sample_url(rule), method=method, status="*", expect_errors=True)
        assert resp.status_int == 401, f"{method} {rule} with {who}: {resp.status}"
        if anon.app.answers_jsonrpc(rule):  # /mcp answers JSON-RPC: the same refusal, its shape
            assert resp.json["error"]["data"] == {"status": 401, "code": "UNAUTHORIZED"}
        else:
            assert_error(resp, 401, "UNAUTHORIZED")


class TestAuth:
    def test_the_route_table_has_protected_and_public_routes(self):
        assert len(PROTECTED_ROUTES) >= 5
        assert PUBLIC_ROUTES

    @pytest.mark.parametrize("route", PROTECTED_ROUTES, ids=route_id)
    @pytest.mark.slow
    def test_every_protected_route_refuses_missing_and_wrong_key(self, anon, route):
        refuses_missing_and_wrong_key(anon, route.method, route.rule)

    @pytest.mark.slow
    def test_every_documented_secured_operation_refuses_missing_and_wrong_key(self, make_app):
        """Routes from outside the table too (plugins, providers): as the OpenAPI says."""
        doc = make_app().get(f"{API}/openapi.json").json
        secured = [
            (method.upper(), re.sub(r"\{(\w+)\}", r"<\1>", path))
            for path, operations in doc["paths"].items()
            for method, op in operations.items()
            if op.get("security", doc["security"])
        ]
        assert len(secured) >= len(PROTECTED_ROUTES) + 3  # and the built-in plugins' routes
        for method, rule in secured:
            refuses_missing_and_wrong_key(make_app(), method, rule)  # a fresh app: no lockout

    @pytest.mark.parametrize("route", PUBLIC_ROUTES, ids=route_id)
    @pytest.mark.slow
    def test_public_routes_need_no_key(self, anon, route):
        resp = anon.request(sample_url(route), method=route.method, expect_errors=True)
        assert resp.status_int != 401, route_id(route)
        assert anon.get(f"{API}/health").status_int == 200

    def test_verify_returns_identity(self, client):
        d = data(client.post(f"{API}/auth/verify"))
        assert d == {
            "valid": True,
            "serverId": client.app.service.state.read()["serverId"],
            "setupComplete": False,
            "linkHere": False,  # WebTest names no peer: not at home, so no link is tried
        }
        home = data(client.post(f"{API}/auth/verify", extra_environ=LOCAL))
        assert home["linkHere"] is True
        client.post(f"{API}/auth/link", extra_environ=LOCAL)
        assert "linkHere" not in data(client.post(f"{API}/auth/verify"))  # setup is done

    def test_link_records_clients_and_repeats_fine(self, client, root):
        client.post_json(f"{API}/auth/link", {"clientName": "phone"}, extra_environ=LOCAL)
        client.post(f"{API}/auth/link", extra_environ=LOCAL)
        state = json.loads((root / ".notesvc" / "state.json").read_text())
        assert [c["name"] for c in state["linkedClients"]] == ["phone", "unnamed client"]
        assert state["setupComplete"] is True
        assert "apiKey" not in state
        assert len(state["keyHash"]) == 64

    @pytest.mark.parametrize("body", [{"clientName": 5}, {"clientName": "x" * 101}])
    def test_link_rejects_bad_client_name(self, client, body):
        assert_error(
            client.post_json(f"{API}/auth/link", body, status=400, extra_environ=LOCAL),
            400,
            "VALIDATION_ERROR",
        )

    def test_state_file_is_private(self, client, root):
        client.post(f"{API}/auth/link", extra_environ=LOCAL)
        folder = root / ".notesvc"
        assert stat.S_IMODE(os.stat(folder / "state.json").st_mode) == 0o600
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700

    def test_rotate_replaces_the_key_and_keeps_the_derived_relay_code(self, anon, client):
        st = anon.app.service.state.read()
        old_code = st["relayCode"]
        assert old_code == notesvc.relay_code_of(st["relayToken"])  # it finds, it opens nothing
        new = data(client.post(f"{API}/auth/rotate"))
        assert re.fullmatch(r"nsk_[A-Za-z0-9_-]{43}", new["apiKey"])
        assert new["relayCode"] == old_code
        assert_error(client.post(f"{API}/auth/verify", status=401), 401, "UNAUTHORIZED")
        assert data(with_key(anon, new["apiKey"]).post(f"{API}/auth/verify"))["valid"]

    def test_lockout_after_ten_failures(self, anon):
        for i in range(10):  # ten different wrong keys (the same one again counts once)
            with_key(anon, f"nsk_wrong{i}").post(f"{API}/auth/verify", status=401)
        resp = with_key(anon, "nsk_wrong").post(f"{API}/auth/verify", status=429)
        assert_error(resp, 429, "RATE_LIMITED")
        assert 1 <= int(resp.headers["Retry-After"]) <= 60
        # Locked out means locked out, even with the right key ...
        with_key(anon).post(f"{API}/auth/verify", status=429)
        # ... but only for that address.
        with_key(anon).post(f"{API}/auth/verify", extra_environ={"REMOTE_ADDR": "10.9.9.9"})

    def test_a_spray_of_addresses_keeps_the_lockout_small(self):
        now = [0.0]
        lockout = notesvc.Lockout(clock=lambda: now[0], tracked=100)
        for i in range(1000):  # every address fresh, none ever stale
            lockout.fail(f"10.0.{i // 250}.{i % 250}")
            now[0] += 0.001
        assert len(lockout._fails) <= 100
        for _ in range(10):  # a real attacker is still locked out
            lockout.fail("192.0.2.1")
        assert lockout.retry_after("192.0.2.1") > 0

    def test_requests_without_a_credential_never_count(self, anon):
        for _ in range(15):
            assert_error(anon.post(f"{API}/auth/verify", status=401), 401, "UNAUTHORIZED")
        with_key(anon).post(f"{API}/auth/verify")

    def test_success_clears_the_failures_of_its_address(self, anon):
        wrong, right = with_key(anon, "nsk_wrong"), with_key(anon)
        for _ in range(2):
            for _ in range(9):
                wrong.post(f"{API}/auth/verify", status=401)
            right.post(f"{API}/auth/verify")
        wrong.post(f"{API}/auth/verify", status=401)

    def test_locked_out_address_gets_401_without_a_credential(self, anon):
        for i in range(10):
            with_key(anon, f"nsk_wrong{i}").post(f"{API}/auth/verify", status=401)
        assert_error(anon.post(f"{API}/auth/verify", status=401), 401, "UNAUTHORIZED")
        resp = with_key(anon).post(f"{API}/auth/verify", status=429)
        assert 1 <= int(resp.headers["Retry-After"]) <= 60

    def test_relayed_clients_have_their_own_buckets(self, anon):
        relayed = {"notesvc.relayed": True, "REMOTE_ADDR": ""}
        for i in range(10):
            with_key(anon, f"nsk_wrong{i}").post(
                f"{API}/auth/verify", status=401, extra_environ=relayed
            )
        with_key(anon).post(f"{API}/auth/verify", status=429, extra_environ=relayed)
        with_key(anon).post(f"{API}/auth/verify")  # WebTest's own (empty) peer address
        local = {"notesvc.relayed": True, "REMOTE_ADDR": "127.0.0.1"}
        with_key(anon).post(f"{API}/auth/verify", extra_environ=local)
        cfg = anon.app.service.config
        assert notesvc.client_address(cfg, relayed) == "relay:?"
        assert notesvc.client_address(cfg, local) == "relay:127.0.0.1"

    @pytest.mark.parametrize(
        ("peer", "forwarded", "client"),
        [
            ("10.0.0.2", "198.51.100.1, 203.0.113.4, 10.0.0.3", "203.0.113.4"),
            ("10.0.0.2", "203.0.113.4:5555", "203.0.113.4"),
            ("10.0.0.2", "10.0.0.9, 10.0.0.3", "10.0.0.9"),  # only proxies: the farthest
            ("10.0.0.2", "", "10.0.0.2"),
            ("10.0.0.2", "unknown", "via:10.0.0.2"),  # no client named: the proxy's bucket
            ("10.0.0.2", "[2001:db8::7]:80", "2001:db8::7"),
            ("192.0.2.1", "203.0.113.4", "192.0.2.1"),  # an untrusted peer's claim counts nothing
        ],
    )
    def test_client_address_behind_trusted_proxies(self, peer, forwarded, client):
        cfg = notesvc.load_config(env={"SERVICE_TRUST_PROXY": "10.0.0.0/8, ::1"})
        assert cfg.trust_proxy == ("10.0.0.0/8", "::1/128")
        environ = {"REMOTE_ADDR": peer, "HTTP_X_FORWARDED_FOR": forwarded}
        assert notesvc.client_address(cfg, environ) == client

    @pytest.mark.parametrize(
        ("headers", "client"),
        [
            ({"HTTP_X_REAL_IP": "203.0.113.4"}, "203.0.113.4"),
            ({"HTTP_FORWARDED": "for=203.0.113.4"}, "203.0.113.4"),
            (
                {"HTTP_X_REAL_IP": "203.0.113.4", "HTTP_X_FORWARDED_FOR": "203.0.113.4"},
                "203.0.113.4",
            ),
            # nginx's $proxy_add_x_forwarded_for beside X-Real-IP: they agree
            (
                {"HTTP_X_REAL_IP": "203.0.113.4", "HTTP_X_FORWARDED_FOR": "1.2.3.4, 203.0.113.4"},
                "203.0.113.4",
            ),
            # a proxy hop in one header (every hop trusted) names no client beside another
            (
                {"HTTP_X_REAL_IP": "10.0.0.3", "HTTP_X_FORWARDED_FOR": "203.0.113.4, 10.0.0.3"},
                "203.0.113.4",
            ),
            # which one the proxy wrote cannot be told: one bucket for all such, the proxy's
            (
                {"HTTP_X_REAL_IP": "203.0.113.4", "HTTP_X_FORWARDED_FOR": "198.51.100.9"},
                "via:10.0.0.2",
            ),
            (
                {"HTTP_FORWARDED": "for=203.0.113.4", "HTTP_X_REAL_IP": "198.51.100.9"},
                "via:10.0.0.2",
            ),
            ({"HTTP_X_REAL_IP": "203.0.113.4", "HTTP_X_FORWARDED_FOR": "unknown"}, "via:10.0.0.2"),
        ],
    )
    def test_client_address_when_the_forwarding_headers_disagree(self, headers, client):
        cfg = notesvc.load_config(env={"SERVICE_TRUST_PROXY": "10.0.0.0/8"})
        assert notesvc.client_address(cfg, {"REMOTE_ADDR": "10.0.0.2", **headers}) == client
        untrusted = {"REMOTE_ADDR": "192.0.2.1", **headers}  # a peer nobody named: its own
        assert notesvc.client_address(cfg, untrusted) == "192.0.2.1"

    def test_the_same_wrong_credential_again_counts_once(self):
        now = [0.0]
        lock = notesvc.Lockout(limit=3, window=60, clock=lambda: now[0])
        for _ in range(50):  # a revoked device retrying its key
            lock.fail("a", "nsd_revoked")
            now[0] += 1
        assert lock.retry_after("a") == 0
        lock.fail("a", "nsk_guess1")
        lock.fail("a", "nsk_guess2")  # three different ones in the window: locked
        assert lock.retry_after("a") == 60
        assert lock.retry_after("b") == 0

    def test_trust_proxy_setting_forms(self, make_app):
        load = notesvc.load_config
        assert load(env={}).trust_proxy == ()
        assert load(env={"SERVICE_TRUST_PROXY": "true"}).trust_proxy == ("127.0.0.0/8", "::1/128")
        assert load(env={"SERVICE_TRUST_PROXY": "192.0.2.5"}).trust_proxy == ("192.0.2.5/32",)
        app = with_key(make_app(SERVICE_TRUST_PROXY="true"))
        assert data(app.get(f"{API}/system/config"))["server"]["trustProxy"] == [
            "127.0.0.0/8",
            "::1/128",
        ]
        network = data(app.get(f"{API}/security/config"))["network"]
        assert network["trustProxy"] == ["127.0.0.0/8", "::1/128"]

    def test_lockout_window_and_expiry(self):
        now = [1000.0]
        lock = notesvc.Lockout(limit=3, window=60, clock=lambda: now[0])
        lock.fail("a")
        lock.fail("a")
        now[0] += 61  # old failures fall out of the window
        lock.fail("a")
        assert lock.retry_after("a") == 0
        lock.fail("a")
        lock.fail("a")
        assert lock.retry_after("a") == 60
        now[0] += 30
        assert lock.retry_after("a") == 30
        now[0] += 31
        assert lock.retry_after("a") == 0

    def test_auth_mode_none_needs_no_key(self, make_app):
        app = make_app(SERVICE_AUTH_MODE="none")
        assert data(app.get(f"{API}/system/info"))["version"] == notesvc.__version__
        assert data(app.get(f"{API}/system/setup"))["auth"]["method"] == "none"

    def test_a_near_miss_key_is_refused(self, anon):
        key = key_of(anon)
        other = lambda c: "A" if c != "A" else "B"  # noqa: E731
        for near in (
            key[:-1] + other(key[-1]),  # only the last character differs
            other(key[0]) + key[1:],  # only the first
            key[:-1],  # a prefix
            key + "A",  # the key and more
            key.upper() if key.upper() != key else key.lower(),
            f" {key}",
        ):
            verify = with_key(anon, near).post(
                f"{API}/auth/verify", status=401, extra_environ={"REMOTE_ADDR": "10.1.1.1"}
            )
            assert_error(verify, 401, "UNAUTHORIZED")
            anon.post(f"{API}/auth/verify", status=401)  # and without a key: nothing leaks
        assert data(with_key(anon).post(f"{API}/auth/verify"))["valid"] is True

    @pytest.mark.slow
    def test_key_check_takes_as_long_however_much_of_the_key_is_right(self, anon):
        """Wrong keys sharing all but the last character with the real key are refused as
        fast as keys wrong from the first character: nothing to learn from the timing.

        Medians over many interleaved pairs, each from a fresh address (no lockout), with a
        generous bound so it never flakes on a loaded machine. What it can see: an early-exit
        comparison doing >= 0.5 us of work per matching character fails it; a plain `==` on
        the key (nanoseconds per character) is below what timing through the app can show.
        """
        key = key_of(anon)
        alphabet = [c for c in string.ascii_letters + string.digits if c not in key[-1] + key[4]]
        trials = 1000
        wsgi = anon.app

        def timed_verify(candidate: str, n: int) -> int:
            addr = f"10.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}"
            req = webtest.TestRequest.blank(
                f"{API}/auth/verify",
                method="POST",
                headers={"X-Service-Key": candidate},
                environ={"REMOTE_ADDR": addr},
            )
            started = time.perf_counter_ns()
            resp = req.get_response(wsgi)
            took = time.perf_counter_ns() - started
            assert resp.status_int == 401
            return took

        for n in range(20):  # warm up
            timed_verify(key[:-1] + alphabet[n % len(alphabet)], 100_000 + n)
        late, early, diffs = [], [], []
        for n in range(trials):
            c = alphabet[n % len(alphabet)]
            near = key[:-1] + c  # right up to the last character
            far = key[:4] + c + key[5:]  # wrong at the first character after "nsk_"
            if n % 2:
                t_near, t_far = timed_verify(near, 2 * n), timed_verify(far, 2 * n + 1)
            else:
                t_far, t_near = timed_verify(far, 2 * n + 1), timed_verify(near, 2 * n)
            late.append(t_near)
            early.append(t_far)
            diffs.append(t_near - t_far)
        median = statistics.median(late + early)
        shift = statistics.median(diffs)
        ratio = statistics.median(late) / statistics.median(early)
        assert abs(shift) < 0.25 * median, (shift, median)
        assert 0.8 < ratio < 1.25, ratio

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_rotate_key_cli_while_serving(self, anon, root):
        old = key_of(anon)
        client = with_key(anon, old)
        client.post_json(f"{API}/auth/link", {"clientName": "laptop"}, extra_environ=LOCAL)
        out = run_cli("rotate-key", "--root", str(root))
        assert out.returncode == 0, out.stderr
        new = out.stdout.strip()
        assert re.fullmatch(r"nsk_[A-Za-z0-9_-]{43}", new)
        # The running app sees the new key at once; the old one is refused.
        client.post(f"{API}/auth/verify", status=401)
        fresh = with_key(anon, new)
        assert data(fresh.post(f"{API}/auth/verify"))["setupComplete"] is True
        # A later write by the running app keeps the new key.
        fresh.post_json(f"{API}/auth/link", {"clientName": "tablet"}, extra_environ=LOCAL)
        state = json.loads((root / ".notesvc" / "state.json").read_text())
        assert state["keyHash"] == notesvc.key_hash(new)
        assert [c["name"] for c in state["linkedClients"]] == ["laptop", "tablet"]
        # The setup payload never shows the rotated key once setup is complete.
        assert new not in anon.get(f"{API}/system/setup").text


def forge(claims: dict, header: dict | None = None, secret: str = JWT_SECRET, digest=None) -> str:
    import base64
    import hashlib
    import hmac

    def b64(obj) -> str:
        raw = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    head = b64(header or {"alg": "HS256", "typ": "JWT"})
    body = b64(claims)
    sig = hmac.new(secret.encode(), f"{head}.{body}".encode(), digest or hashlib.sha256)
    return f"{head}.{body}.{b64(sig.digest())}"


class TestJwt:
    @pytest.fixture
    def app(self, make_app):
        return make_app(SERVICE_AUTH_MODE="jwt", SERVICE_JWT_SECRET=JWT_SECRET)

    def bearer(self, app, token, status=200):
        return app.post(
            f"{API}/auth/verify", headers={"Authorization": f"Bearer {token}"}, status=status
        )

    def claims(self, app, **over):
        now = int(time.time())
        kid = app.app.service.state.read()["keyHash"][:16]
        return {"sub": "owner", "iat": now, "nbf": now, "exp": now + 600, "kid": kid, **over}

    def test_issued_token_works_and_key_still_does(self, app):
        token = data(with_key(app).post(f"{API}/auth/token"))
        assert token["tokenType"] == "Bearer"
        assert token["expiresIn"] == 3600
        assert data(self.bearer(app, token["token"]))["valid"] is True
        assert data(with_key(app).post(f"{API}/auth/verify"))["valid"] is True

    def test_hand_made_valid_token_is_accepted(self, app):
        self.bearer(app, forge(self.claims(app)))

    @pytest.mark.parametrize(
        "case",
        [
            "expired",
            "not-yet-valid",
            "tampered",
            "alg-none",
            "hs512",
            "wrong-secret",
            "no-exp",
            "garbage",
            "old-key",
        ],
    )
    def test_bad_tokens_are_refused(self, app, case):
        now = int(time.time())
        claims = self.claims(app)
        if case == "expired":
            token = forge({**claims, "exp": now - 31})
        elif case == "not-yet-valid":
            token = forge({**claims, "nbf": now + 31})
        elif case == "tampered":
            head, _, sig = forge(claims).split(".")
            other = forge({**claims, "sub": "admin"}).split(".")[1]
            token = f"{head}.{other}.{sig}"
        elif case == "alg-none":
            token = forge(claims, {"alg": "none", "typ": "JWT"}).rsplit(".", 1)[0] + "."
        elif case == "hs512":
            import hashlib

            token = forge(claims, {"alg": "HS512", "typ": "JWT"}, digest=hashlib.sha512)
        elif case == "wrong-secret":
            token = forge(claims, secret="another-secret-of-enough-length-000")
        elif case == "no-exp":
            token = forge({k: v for k, v in claims.items() if k != "exp"})
        elif case == "garbage":
            token = "not.a.jwt"
        else:  # a token from before a key rotation
            token = forge(claims)
            with_key(app).post(f"{API}/auth/rotate")
        assert_error(self.bearer(app, token, 401), 401, "UNAUTHORIZED")

    def test_token_cannot_mint_tokens_or_rotate_the_key(self, app):
        token = data(with_key(app).post(f"{API}/auth/token"))["token"]
        bearer = {"Authorization": f"Bearer {token}"}
        assert data(app.get(f"{API}/system/info", headers=bearer))["version"]
        for path in ("/auth/token", "/auth/rotate"):
            assert_error(app.post(f"{API}{path}", headers=bearer, status=403), 403, "FORBIDDEN")
        assert data(self.bearer(app, token))["valid"] is True  # still the same key
        key_only = {(r.method, r.path) for r in app.app.service.routes if r.key_only}
        assert key_only == {("POST", "/auth/token"), ("POST", "/auth/rotate")}
        assert data(with_key(app).post(f"{API}/auth/rotate"))["apiKey"]

    def test_leeway_of_30_seconds(self, app):
        now = int(time.time())
        self.bearer(app, forge(self.claims(app, exp=now - 20)))
        self.bearer(app, forge(self.claims(app, nbf=now + 20)))

    def test_token_endpoint_refuses_outside_jwt_mode(self, client):
        assert_error(client.post(f"{API}/auth/token", status=403), 403, "FORBIDDEN")

    def test_bearer_is_ignored_in_api_key_mode(self, anon):
        token = forge({"exp": time.time() + 60})
        resp = anon.post(
            f"{API}/auth/verify", headers={"Authorization": f"Bearer {token}"}, status=401
        )
        assert_error(resp, 401, "UNAUTHORIZED")
