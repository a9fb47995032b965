"""The security audit and its score (src/notesvc/audit.py)."""

from __future__ import annotations

import collections
import dataclasses
import http.client
import http.server
import json
import os
import re
import stat
import typing
from pathlib import Path

import pytest
import webtest

from conftest import (
    API,
    HELLO_PLUGIN,
    JWT_SECRET,
    KEY,
    LOCAL,
    PNG,
    att_url,
    audit,
    basic,
    data,
    ids,
    key_of,
    notesvc,
    put_note,
    run_cli,
    running,
    with_key,
)
from standins import MINIMAL_CONFIG


def expected_score(findings: list) -> int:
    """The documented formula, from the findings' severities."""
    count = collections.Counter(f["severity"] for f in findings)
    raw = 100 - 40 * count["critical"] - 20 * count["high"] - 10 * count["medium"]
    return max(0, raw - 3 * count["low"])


def _open_state_files(app, root: Path) -> None:
    os.chmod(root / ".notesvc" / "state.json", 0o644)


def _open_notes_folder(app, root: Path) -> None:
    os.chmod(root / "notes", 0o777)


def _a_plugin_file(app, root: Path) -> None:
    plugins = root / ".notesvc" / "plugins"
    plugins.mkdir(mode=0o700, exist_ok=True)
    (plugins / "planted.py").write_text("x = 1\n")
    os.chmod(plugins / "planted.py", 0o600)


def _telegram_channel_without_allowlist(app, root: Path) -> None:
    body = {"provider": "telegram", "config": {"botToken": "1:x"}}
    with_key(app).post_json(f"{API}/channels", body, status=201)


def _webhook_secret_in_a_query_string(app, root: Path) -> None:
    body = {"provider": "telegram", "config": {"botToken": "1:x", "allowedChatIds": [42]}}
    ch = data(with_key(app).post_json(f"{API}/channels", body, status=201))
    url = f"{API}/channels/webhook/telegram?secret={ch['secret']}"
    assert data(webtest.TestApp(app.app).post_json(url, {"update_id": 1}))["handled"] is False


def _whatsapp_channel_without_app_secret(app, root: Path) -> None:
    config = {**MINIMAL_CONFIG["whatsapp"], "allowedNumbers": ["15551234567"]}
    body = {"provider": "whatsapp", "config": config}
    with_key(app).post_json(f"{API}/channels", body, status=201)


def _an_old_key(app, root: Path) -> None:
    state_file = root / ".notesvc" / "state.json"
    state = json.loads(state_file.read_text())
    state["keyCreatedAt"] = "2020-01-01T00:00:00.000Z"
    state_file.write_text(json.dumps(state))


def _a_write_key_without_expiry(app, root: Path) -> None:
    body = {"name": "helper", "scope": "write"}
    with_key(app).post_json(f"{API}/auth/keys", body, status=201)


def _an_old_share_link(app, root: Path) -> None:
    put_note(with_key(app), "notes/old.md", "old")
    with_key(app).post_json(f"{API}/shares", {"path": "notes/old.md", "expiresInDays": 365})
    state_file = root / ".notesvc" / "state.json"
    state = json.loads(state_file.read_text())
    state["shares"][0]["createdAt"] = "2020-01-01T00:00:00.000Z"
    state_file.write_text(json.dumps(state))


def _many_oauth_clients(app, root: Path) -> None:
    for i in range(21):  # from 21 addresses: registration is rate-limited per address
        webtest.TestApp(app.app, extra_environ={"REMOTE_ADDR": f"198.51.100.{i}"}).post_json(
            "/oauth/register", {"redirect_uris": ["https://app.example/cb"]}, status=201
        )


def _a_persons_admin_device_unused(app, root: Path) -> None:
    owner = with_key(app)
    made = data(owner.post_json(f"{API}/people", {"name": "Ann"}, status=201))
    claim = {"secret": made["pairing"]["secret"], "deviceName": "old phone"}
    webtest.TestApp(app.app).post_json(f"{API}/auth/devices/claim", claim, status=201)
    state_file = root / ".notesvc" / "state.json"
    state = json.loads(state_file.read_text())
    for g in state["grants"]:
        g["createdAt"] = g["lastUsedAt"] = "2020-01-01T00:00:00.000Z"
    state_file.write_text(json.dumps(state))


def _a_folder_everyone_writes(app, root: Path) -> None:
    owner = with_key(app)
    put_note(owner, "notes/Family/list.md", "bread")
    people = [
        data(owner.post_json(f"{API}/people", {"name": name}, status=201))["person"]["id"]
        for name in ("Ann", "Bob")
    ]
    body = {"members": [{"person": p, "scope": "write"} for p in people]}
    owner.put_json(f"{API}/folders/notes%2FFamily/members", body)


def _an_expiring_passthrough_certificate(app, root: Path) -> None:
    import datetime as dt

    from passthrough_kit import TestCA

    ca = TestCA(root.parent / "ca")
    now = dt.datetime.now(dt.timezone.utc)
    key, cert = ca.leaf(["x.relay.test"], not_after=now + dt.timedelta(days=3))
    (root / ".notesvc" / "tls").mkdir(mode=0o700)
    (root / ".notesvc" / "tls" / "server.pem").write_bytes(key + cert)


@dataclasses.dataclass(frozen=True)
class Firing:
    """A configuration in which an audit check fires, and the id its finding must match."""

    id: str  # a regular expression
    env: dict = dataclasses.field(default_factory=dict)  # SERVICE_* settings over the safe ones
    change: typing.Callable | None = None  # change(app, root) after the start
    linked: bool = True  # a client has linked (setup complete)


# For every audit check: a configuration in which it fires. The rest of the configuration
# is the safe one (loopback, linked, private folders), in which it must not.
FIRING_CONFIGURATIONS = {
    "auth_off": Firing("auth-off", {"SERVICE_AUTH_MODE": "none"}),
    "setup_exposed": Firing("setup-exposed", {"SERVICE_HOST": "0.0.0.0"}, linked=False),
    "cors_wildcard": Firing("cors-wildcard", {"SERVICE_CORS_ORIGINS": "*"}),
    "jwt_secret": Firing(
        "jwt-secret-weak", {"SERVICE_AUTH_MODE": "jwt", "SERVICE_JWT_SECRET": "a" * 40}
    ),
    "state_private": Firing("state-readable-file", change=_open_state_files),
    "notes_folder": Firing("notes-writable", change=_open_notes_folder),
    "plugins": Firing("plugin-planted", change=_a_plugin_file),
    "channel_allowlists": Firing(r"channel-open-\S+", change=_telegram_channel_without_allowlist),
    "query_secrets": Firing("secret-in-query", change=_webhook_secret_in_a_query_string),
    "channel_signatures": Firing(
        r"channel-unsigned-\S+", change=_whatsapp_channel_without_app_secret
    ),
    "plain_http_upstreams": Firing(
        "relay-plain-http", {"SERVICE_RELAY_URL": "http://relay.example.org"}
    ),
    "relay_in_transit": Firing(
        "relay-sees-transit", {"SERVICE_RELAY_URL": "https://relay.example.org"}
    ),
    "passthrough_certificate": Firing(
        "passthrough-certificate", change=_an_expiring_passthrough_certificate
    ),
    "key_age": Firing("key-old", change=_an_old_key),
    "plain_http_bind": Firing("plain-http-all-interfaces", {"SERVICE_HOST": "0.0.0.0"}),
    "tool_writes": Firing(
        "tool-writes-without-auth", {"SERVICE_AUTH_MODE": "none", "SERVICE_MCP_WRITE": "true"}
    ),
    "history_off": Firing("history-off", {"SERVICE_HISTORY_MAX_VERSIONS": "0"}),
    "grants": Firing("grant-write-forever", change=_a_write_key_without_expiry),
    "share_links": Firing("share-links-old", change=_an_old_share_link),
    "oauth_clients": Firing("oauth-clients-many", change=_many_oauth_clients),
    "people_admin_devices": Firing(
        "people-admin-devices-unused",
        {"SERVICE_DEVICE_IDLE_DAYS": "0"},
        change=_a_persons_admin_device_unused,
    ),
    "shared_to_everyone": Firing("shared-write-everyone", change=_a_folder_everyone_writes),
}


class TestSecurity:
    @pytest.fixture
    def safe(self, make_app, root):
        """A configuration with no finding: loopback, linked, private folders."""
        app = make_app(SERVICE_HOST="127.0.0.1")
        with_key(app).post(f"{API}/auth/link", extra_environ=LOCAL)
        os.chmod(root / "notes", 0o700)
        return app

    def test_safe_configuration_scores_100(self, safe):
        report = audit(safe)
        assert report["score"] == 100, report["findings"]
        assert report["summary"] == {"critical": 0, "high": 0, "medium": 0, "low": 0, "info": 0}

    def test_finding_shape_and_summary(self, make_app):
        report = audit(make_app(SERVICE_AUTH_MODE="none"))
        for f in report["findings"]:
            assert set(f) == {"id", "severity", "title", "detail", "recommendation"}
            assert f["severity"] in notesvc.SEVERITIES
        assert sum(report["summary"].values()) == len(report["findings"])
        order = [notesvc.SEVERITIES.index(f["severity"]) for f in report["findings"]]
        assert order == sorted(order)

    def test_score_formula(self, make_app, root):
        app = make_app(
            SERVICE_HOST="127.0.0.1",
            SERVICE_CORS_ORIGINS="*",
            SERVICE_AUTH_MODE="jwt",
            SERVICE_JWT_SECRET="a" * 40,
            SERVICE_RELAY_URL="http://relay.example.org",
        )
        os.chmod(root / "notes", 0o755)
        report = notesvc.run_audit(app.app.service)
        assert {f["id"]: f["severity"] for f in report["findings"]} == {
            "setup-exposed": "critical",  # registered with a relay: reachable from anywhere
            "cors-wildcard": "high",
            "jwt-secret-weak": "high",
            "relay-plain-http": "medium",
            "notes-readable": "low",
            "relay-sees-transit": "info",
        }
        assert report["score"] == expected_score(report["findings"]) == 100 - 40 - 20 - 20 - 10 - 3
        assert audit(app)["score"] == report["score"]  # the endpoint says the same

    def test_score_never_below_zero(self, make_app, root):
        app = make_app(SERVICE_HOST="0.0.0.0", SERVICE_AUTH_MODE="none", SERVICE_CORS_ORIGINS="*")
        os.chmod(root / "notes", 0o777)
        os.chmod(root / ".notesvc" / "state.json", 0o644)
        os.chmod(root / ".notesvc", 0o755)
        report = audit(app)
        costs = sum(notesvc.SEVERITY_COST[f["severity"]] for f in report["findings"])
        assert costs > 100, report["findings"]  # the formula alone would go negative
        assert report["score"] == 0

    @pytest.mark.parametrize(
        ("env", "finding", "severity"),
        [
            ({"SERVICE_AUTH_MODE": "none"}, "auth-off", "critical"),
            ({"SERVICE_HOST": "0.0.0.0"}, "setup-exposed", "critical"),
            ({"SERVICE_CORS_ORIGINS": "*"}, "cors-wildcard", "high"),
            (
                {"SERVICE_AUTH_MODE": "jwt", "SERVICE_JWT_SECRET": "a" * 40},
                "jwt-secret-weak",
                "high",
            ),
            ({"SERVICE_RELAY_URL": "http://relay.example.org"}, "relay-plain-http", "medium"),
            (
                {
                    "SERVICE_AGENT_PROVIDER": "openai",
                    "SERVICE_AGENT_BASE_URL": "http://gpu.lan:8080/v1",
                    "SERVICE_AGENT_MODEL": "m",
                    "SERVICE_AGENT_API_KEY": "k",
                },
                "model-plain-http",
                "high",
            ),
            ({"SERVICE_HOST": "0.0.0.0"}, "plain-http-all-interfaces", "medium"),
        ],
    )
    def test_configuration_checks_trigger(self, make_app, root, env, finding, severity):
        env = {"SERVICE_HOST": "127.0.0.1", **env}
        report = audit(make_app(**env))
        found = {f["id"]: f["severity"] for f in report["findings"]}
        assert found.get(finding) == severity, report["findings"]

    def test_configuration_checks_stay_quiet_when_fine(self, make_app, tmp_path):
        for i, env in enumerate(
            (
                {"SERVICE_AUTH_MODE": "jwt", "SERVICE_JWT_SECRET": JWT_SECRET},
                {"SERVICE_RELAY_URL": "https://relay.example.org"},
                {
                    "SERVICE_AGENT_PROVIDER": "openai",
                    "SERVICE_AGENT_BASE_URL": "http://127.0.0.1:11434/v1",
                    "SERVICE_AGENT_MODEL": "m",
                },
                {"SERVICE_HOST": "0.0.0.0", "SERVICE_TRUST_PROXY": "true"},
                {"SERVICE_CORS_ORIGINS": "https://app.example"},
            )
        ):
            app_root = tmp_path / f"quiet{i}"
            app = make_app(app_root, SERVICE_HOST=env.pop("SERVICE_HOST", "127.0.0.1"), **env)
            home = {"REMOTE_ADDR": "192.168.1.9"}  # not the trusted proxy: a client at home
            with_key(app).post(f"{API}/auth/link", extra_environ=home)
            os.chmod(app_root / "notes", 0o700)
            report = audit(app)
            assert all(f["severity"] == "info" for f in report["findings"]), report["findings"]

    @pytest.mark.parametrize(
        "env",
        [
            {"SERVICE_HOST": "0.0.0.0"},
            {"SERVICE_HOST": "0.0.0.0", "SERVICE_SETUP_LOCAL_ONLY": "true"},
            {"SERVICE_HOST": "127.0.0.1", "SERVICE_RELAY_URL": "https://relay.example.org"},
            {"SERVICE_HOST": "127.0.0.1", "SERVICE_RELAY_URL": "http://127.0.0.1:8441"},
        ],
    )
    def test_an_incomplete_setup_reachable_beyond_loopback_is_critical(self, make_app, env):
        """Bound beyond loopback or registered with a relay: whoever sets it up first owns
        it, whatever SERVICE_SETUP_LOCAL_ONLY says (a proxy or tunnel can make anyone local)."""
        report = audit(make_app(**env))
        found = {f["id"]: f for f in report["findings"]}
        assert found["setup-exposed"]["severity"] == "critical"
        assert "setup-incomplete" not in found
        assert "pair" in found["setup-exposed"]["recommendation"]
        assert report["summary"]["critical"] >= 1

    def test_an_incomplete_setup_behind_a_trusted_proxy_says_who_is_offered_the_key(self, make_app):
        """The audit's words hold: behind a trusted proxy on this machine, a request from
        this machine straight to the port is not offered the key (it names no client);
        one the proxy reports at home is."""
        app = make_app(SERVICE_HOST="127.0.0.1", SERVICE_TRUST_PROXY="true")
        found = {f["id"]: f for f in audit(app)["findings"]}
        said = found["setup-incomplete"]["detail"]
        assert found["setup-incomplete"]["severity"] == "low"
        assert "offered by GET /system/setup to this machine" not in said
        assert "a client that proxy reports" in said
        assert "a request straight to the port from this machine" in said
        assert "is not offered the key" in said
        assert "through the proxy" in found["setup-incomplete"]["recommendation"]
        key = key_of(app)
        direct = data(app.get(f"{API}/system/setup", extra_environ=LOCAL))
        assert direct["apiKey"] != key  # what the audit says: not to this machine itself
        forwarded = {"X-Forwarded-For": "192.168.1.5", "Host": "127.0.0.1"}
        named = data(app.get(f"{API}/system/setup", headers=forwarded, extra_environ=LOCAL))
        assert named["apiKey"] == key  # ... but to a client the proxy names at home

    def test_an_incomplete_setup_on_loopback_alone_is_low(self, make_app):
        found = {
            f["id"]: f["severity"] for f in audit(make_app(SERVICE_HOST="127.0.0.1"))["findings"]
        }
        assert found["setup-incomplete"] == "low"
        assert "setup-exposed" not in found
        open_port = make_app(
            SERVICE_HOST="127.0.0.1",
            SERVICE_RELAY_URL="https://relay.example.org",
            SERVICE_PAIRING_MODE="open-port",  # a relay named, but never registered with
        )
        assert "setup-exposed" not in ids(audit(open_port))

    def test_file_mode_checks(self, safe, root):
        os.chmod(root / ".notesvc" / "state.json", 0o644)
        os.chmod(root / ".notesvc", 0o755)
        os.chmod(root / "notes", 0o777)
        plugins = root / ".notesvc" / "plugins"
        plugins.mkdir()
        os.chmod(plugins, 0o777)
        found = ids(audit(safe))
        assert {
            "state-readable-file",
            "state-readable-dir",
            "notes-writable",
            "plugins-writable",
        } <= found
        os.chmod(root / "notes", 0o755)
        assert "notes-readable" in ids(audit(safe))

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_a_fresh_servers_own_files_give_the_audit_nothing_to_say(self, tmp_path):
        """New user's point 7: on a fresh server (a usual umask, 022) the first upload, a
        capture's photo or a WebDAV folder makes attachments/ private like notes/, so the
        audit finds nothing notesvc itself did."""
        old = os.umask(0o022)
        try:
            servers = [running(tmp_path / f"root{i}") for i in range(2)]
            with servers[0] as upload, servers[1] as dav:
                for server, make in ((upload, "upload"), (dav, "dav")):
                    setup = server.request("GET", f"{API}/system/setup")[2]["data"]
                    key = {KEY: setup["apiKey"]}
                    assert server.request("POST", f"{API}/auth/link", headers=key)[0] == 200
                    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
                    if make == "upload":
                        path = att_url("attachments/inbox/a.png")
                        conn.request("PUT", path, PNG, {**key, "Content-Type": "image/png"})
                    else:
                        auth = {"Authorization": basic(setup["apiKey"])}
                        conn.request("MKCOL", "/dav/attachments/photos/", headers=auth)
                    assert conn.getresponse().status == 201
                    conn.close()
                    found = server.request("GET", f"{API}/security/audit", headers=key)[2]["data"]
                    mine = [f["id"] for f in found["findings"] if f["severity"] != "info"]
                    assert mine == [], found["findings"]
                    made = tmp_path / f"root{0 if make == 'upload' else 1}"
                    assert stat.S_IMODE(os.stat(made / "attachments").st_mode) == 0o700
                    assert stat.S_IMODE(os.stat(made / "notes").st_mode) == 0o700
        finally:
            os.umask(old)

    def test_key_age(self, safe, root):
        state_file = root / ".notesvc" / "state.json"
        state = json.loads(state_file.read_text())
        state["keyCreatedAt"] = "2020-01-01T00:00:00.000Z"
        state_file.write_text(json.dumps(state))
        assert "key-old" in ids(audit(safe))

    def test_channel_without_allowlist_and_query_secret(self, safe):
        client = with_key(safe)
        ch = data(
            client.post_json(
                f"{API}/channels",
                {"provider": "telegram", "config": {"botToken": "1:x"}},
                status=201,
            )
        )
        assert f"channel-open-{ch['id']}" in ids(audit(safe))
        webtest.TestApp(safe.app).post_json(
            f"{API}/channels/webhook/telegram?secret={ch['secret']}", {"update_id": 1}
        )
        assert "secret-in-query" in ids(audit(safe))

    def test_third_party_plugin_is_reported(self, make_app, root):
        plugins = root / ".notesvc" / "plugins"
        plugins.mkdir(parents=True)
        (plugins / "hello.py").write_text(HELLO_PLUGIN)
        assert "plugin-hello" in ids(audit(make_app(SERVICE_HOST="127.0.0.1")))

    def test_plugin_files_writable_symlinked_or_foreign_are_flagged(self, safe, root, tmp_path):
        plugins = root / ".notesvc" / "plugins"
        plugins.mkdir(mode=0o700)
        (plugins / "open.py").write_text("x = 1\n")
        os.chmod(plugins / "open.py", 0o666)
        elsewhere = tmp_path / "elsewhere.py"
        elsewhere.write_text("x = 1\n")
        (plugins / "linked.py").symlink_to(elsewhere)
        (plugins / "fine.py").write_text("x = 1\n")
        os.chmod(plugins / "fine.py", 0o600)
        if os.geteuid() == 0:
            os.chown(plugins / "fine.py", 65534, 65534)
        report = audit(safe)
        found = {f["id"]: f["severity"] for f in report["findings"]}
        assert found["plugin-writable-open"] == "high"
        assert found["plugin-symlink-linked"] == "high"
        assert "plugin-writable-fine" not in found
        assert "plugin-symlink-fine" not in found
        if os.geteuid() == 0:
            assert found["plugin-owner-fine"] == "high"
        # Files are listed by name even when they are no valid plugin.
        assert {"plugin-open", "plugin-linked", "plugin-fine"} <= set(found)

    def test_plugins_parent_writable_by_others_is_flagged_unless_sticky(self, make_app, tmp_path):
        shared = tmp_path / "shared"
        (shared / "plugins").mkdir(parents=True)
        os.chmod(shared / "plugins", 0o700)
        app = make_app(SERVICE_HOST="127.0.0.1", SERVICE_PLUGINS_DIR=str(shared / "plugins"))
        os.chmod(shared, 0o777)
        finding = {f["id"]: f for f in audit(app)["findings"]}["plugins-parent-writable"]
        assert finding["severity"] == "high"
        assert str(shared) in finding["detail"]
        os.chmod(shared, 0o1777)  # like /tmp: others cannot replace what is ours
        assert "plugins-parent-writable" not in ids(audit(app))
        os.chmod(shared, 0o755)
        assert "plugins-parent-writable" not in ids(audit(app))

    @pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0, reason="needs root")
    def test_plugins_folder_owned_by_another_user_is_flagged(self, make_app, tmp_path):
        owned = tmp_path / "owned"
        (owned / "plugins").mkdir(parents=True)
        app = make_app(SERVICE_HOST="127.0.0.1", SERVICE_PLUGINS_DIR=str(owned / "plugins"))
        assert "plugins-owner" not in ids(audit(app))
        os.chown(owned, 65534, 65534)
        finding = {f["id"]: f for f in audit(app)["findings"]}["plugins-owner"]
        assert finding["severity"] == "high"
        assert f"{owned} (uid 65534)" in finding["detail"]

    def test_web_channel_allowlist_is_not_counted_as_authentication(self, safe):
        client = with_key(safe)
        open_web = data(client.post_json(f"{API}/channels", {"provider": "web"}, status=201))
        listed = data(
            client.post_json(
                f"{API}/channels",
                {"provider": "web", "config": {"allowedSenders": ["kitchen"]}},
                status=201,
            )
        )
        report = audit(safe)
        found = {f["id"]: f for f in report["findings"]}
        for ch in (open_web, listed):  # the allowlist changes nothing: the secret is the lock
            assert found[f"channel-web-{ch['id']}"]["severity"] == "info"
            assert "not authentication" in found[f"channel-web-{ch['id']}"]["detail"]
            assert f"channel-open-{ch['id']}" not in found
        assert report["score"] == 100

    def test_every_audit_check_has_a_configuration_where_it_fires(self):
        missing = sorted(set(notesvc.AUDIT_CHECKS) - set(FIRING_CONFIGURATIONS))
        stale = sorted(set(FIRING_CONFIGURATIONS) - set(notesvc.AUDIT_CHECKS))
        assert not missing, (
            f"audit checks without an entry in FIRING_CONFIGURATIONS: {missing}; add one "
            "giving the settings / change under which each returns a finding, and its id"
        )
        assert not stale, f"FIRING_CONFIGURATIONS names checks that are gone: {stale}"

    @pytest.mark.parametrize("name", list(notesvc.AUDIT_CHECKS))
    @pytest.mark.slow
    def test_every_audit_check_fires_with_findings_of_the_right_shape(
        self, make_app, tmp_path, name
    ):
        assert name in FIRING_CONFIGURATIONS, f"add {name!r} to FIRING_CONFIGURATIONS"
        firing = FIRING_CONFIGURATIONS[name]
        reports = {}
        for label, case in (("safe", Firing(firing.id)), ("firing", firing)):
            app_root = tmp_path / label
            app = make_app(app_root, **{"SERVICE_HOST": "127.0.0.1", **case.env})
            if case.linked:
                with_key(app).post(f"{API}/auth/link", extra_environ=LOCAL)
            os.chmod(app_root / "notes", 0o700)
            if case.change:
                case.change(app, app_root)
            reports[label] = audit(app)
        matching = lambda report: [  # noqa: E731
            f for f in report["findings"] if re.fullmatch(firing.id, f["id"])
        ]
        assert matching(reports["firing"]), f"{name} did not fire: {reports['firing']}"
        assert not matching(reports["safe"]), f"{name} fires in the safe configuration"
        for report in reports.values():
            assert f"check-{name}" not in ids(report), "the check raised"
            for f in report["findings"]:
                assert set(f) == {"id", "severity", "title", "detail", "recommendation"}
                assert f["severity"] in notesvc.SEVERITIES
                for key in ("id", "title", "detail", "recommendation"):
                    assert isinstance(f[key], str), (key, f)
                    assert f[key].strip(), (key, f)

    def test_config_view_has_no_secret(self, make_app):
        app = make_app(
            SERVICE_AUTH_MODE="jwt",
            SERVICE_JWT_SECRET=JWT_SECRET,
            SERVICE_AGENT_API_KEY="sk-hidden",
        )
        d = data(with_key(app).get(f"{API}/security/config"))
        assert d["auth"]["mode"] == "jwt"
        assert d["auth"]["header"] == "X-Service-Key"
        assert d["auth"]["keyAgeDays"] == 0
        assert d["limits"]["lockout"]["failures"] == 10
        for key in ("setup", "network", "limits", "channels", "plugins"):
            assert key in d
        text = json.dumps(d)
        for secret in (JWT_SECRET, "sk-hidden", key_of(app)):
            assert secret not in text

    def test_recommendations_most_severe_first(self, make_app):
        recs = data(
            with_key(make_app(SERVICE_AUTH_MODE="none", SERVICE_CORS_ORIGINS="*")).get(
                f"{API}/security/recommendations"
            )
        )["recommendations"]
        assert recs[0]["severity"] == "critical"
        assert set(recs[0]) == {"id", "severity", "title", "action"}
        order = [notesvc.SEVERITIES.index(r["severity"]) for r in recs]
        assert order == sorted(order)

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_audit_cli_exit_status(self, tmp_path, make_app):
        make_app(tmp_path / "a")
        make_app(tmp_path / "b")
        bad = run_cli("audit", "--root", str(tmp_path / "a"), env={"SERVICE_HOST": "0.0.0.0"})
        assert bad.returncode == 1
        assert "[critical]" in bad.stdout
        assert "score" in bad.stdout
        good = run_cli("audit", "--root", str(tmp_path / "b"), env={"SERVICE_HOST": "127.0.0.1"})
        assert good.returncode == 0, good.stdout


class PassthroughLink:
    """A relay link as the audit reads it (RelayClient.status()): passthrough's state."""

    def __init__(self, passthrough: dict):
        self.passthrough = passthrough

    def status(self) -> dict:
        return {"state": "connected", "mode": "relayed", "passthrough": self.passthrough}


CERT = {
    "notBefore": "2026-12-01T00:00:00.000Z",
    "notAfter": "2027-03-01T00:00:00.000Z",
    "renewAt": "2027-01-30T00:00:00.000Z",
    "issuer": "R11",
}


class TestPassthroughFindings:
    """What the audit says of a passthrough relay: the mode, the expiry, the failures."""

    def report(self, make_app, passthrough: dict) -> dict:
        app = make_app(SERVICE_HOST="127.0.0.1", SERVICE_RELAY_URL="https://relay.example.org")
        app.app.service.relay_client = PassthroughLink(passthrough)
        return {f["id"]: f for f in notesvc.run_audit(app.app.service)["findings"]}

    def test_in_passthrough_the_relay_cannot_read_and_the_expiry_is_said(self, make_app):
        found = self.report(
            make_app,
            {
                "state": "active",
                "origin": "https://abc.relay.example.org",
                "certificate": {"state": "valid", "certificate": CERT},
                "terminatedLast7Days": 3,
            },
        )
        assert "relay-sees-transit" not in found
        finding = found["relay-passthrough"]
        assert finding["severity"] == "info"
        assert "cannot read the key or the notes" in finding["detail"]
        assert "valid until 2027-03-01T00:00:00.000Z" in finding["detail"]
        assert "3 request(s) in the last 7 days" in finding["detail"]
        assert "passthrough-certificate" not in found

    def test_a_failing_renewal_is_medium_while_the_old_one_serves(self, make_app):
        keeper = {
            "state": "error",
            "certificate": CERT,
            "lastError": "the ACME CA at https://ca/dir cannot be reached: refused",
            "nextAttemptAt": "2027-02-01T00:00:00.000Z",
            "acmeDirectory": "https://ca/dir",
        }
        found = self.report(make_app, {"state": "active", "certificate": keeper})
        finding = found["passthrough-certificate"]
        assert finding["severity"] == "medium"
        assert "keeps serving until 2027-03-01T00:00:00.000Z" in finding["detail"]
        assert "cannot be reached" in finding["detail"]
        found = self.report(
            make_app, {"state": "error", "certificate": {**keeper, "certificate": None}}
        )
        assert found["passthrough-certificate"]["severity"] == "high"  # none in hand at all
        assert "offers passthrough, which is error here" in found["relay-sees-transit"]["detail"]

    def test_without_cryptography_the_relay_finding_says_why(self, make_app):
        reason = "passthrough needs the cryptography package (sudo apt install ...)"
        found = self.report(make_app, {"state": "unavailable", "reason": reason})
        assert reason in found["relay-sees-transit"]["detail"]
