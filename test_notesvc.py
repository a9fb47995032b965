"""Tests for notesvc: WebTest in-process, plus real servers where they matter."""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import webtest

import notesvc

HERE = Path(__file__).resolve().parent
NOTESVC = str(HERE / "notesvc.py")
API = "/api/v1"


# -- fixtures and helpers ---------------------------------------------------------


def make_env(root: Path, **env: str) -> dict:
    base = {"SERVICE_NOTES_ROOT": str(root), "SERVICE_RESCAN_SECONDS": "0"}
    base.update(env)
    return base


@pytest.fixture
def root(tmp_path):
    return tmp_path / "root"


@pytest.fixture
def make_app(root):
    """Build a TestApp over create_app() for a root and SERVICE_* overrides."""

    def make(app_root: Path | None = None, **env: str) -> webtest.TestApp:
        cfg = notesvc.load_config(env=make_env(app_root or root, **env))
        return webtest.TestApp(notesvc.create_app(cfg))

    return make


@pytest.fixture
def anon(make_app):
    return make_app()


def key_of(app: webtest.TestApp) -> str:
    return app.app.service.state.read()["apiKey"]


def with_key(app: webtest.TestApp, key: str | None = None) -> webtest.TestApp:
    key = key if key is not None else key_of(app)
    return webtest.TestApp(app.app, extra_environ={"HTTP_X_SERVICE_KEY": key})


@pytest.fixture
def client(anon):
    return with_key(anon)


def assert_error(resp, status: int, code: str) -> dict:
    assert resp.status_int == status
    assert resp.content_type == "application/json"
    body = resp.json
    assert body["success"] is False
    assert body["error"]["code"] == code
    assert isinstance(body["error"]["message"], str)
    assert body["error"]["message"]
    assert "Traceback" not in resp.text
    return body["error"]


def data(resp) -> dict:
    assert resp.json["success"] is True
    return resp.json["data"]


def sample_url(route: notesvc.Route) -> str:
    """Return a concrete URL for a route rule (placeholders filled)."""
    url = re.sub(r"<path(?::path)?>", "notes%2Fx.md", route.rule)
    return re.sub(r"<(\w+)(?::[^>]*)?>", "x", url)


class Server:
    """A real `python notesvc.py` process on a free loopback port."""

    def __init__(self, root: Path, *args: str, env: dict | None = None):
        cmd = [sys.executable, NOTESVC, *args, "--host", "127.0.0.1", "--port", "0"]
        cmd += ["--root", str(root)]
        full_env = {**os.environ, "SERVICE_RESCAN_SECONDS": "0", **(env or {})}
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=full_env
        )
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.port = 0
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        if not self.ready.wait(20):
            self.stop()
            raise RuntimeError("server did not start:\n" + "".join(self.lines))
        self.url = f"http://127.0.0.1:{self.port}"

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            if m:
                self.port = int(m.group(1))
                self.ready.set()
        self.ready.set()

    def request(self, method: str, path: str, body=None, headers: dict | None = None):
        """Return (status, headers, parsed JSON body) for one HTTP request."""
        payload = json.dumps(body).encode() if body is not None else None
        hdrs = {"Content-Type": "application/json"} if payload is not None else {}
        hdrs.update(headers or {})
        req = urllib.request.Request(self.url + path, payload, hdrs, method=method)
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, resp.headers, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, e.headers, json.loads(e.read() or b"null")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.reader.join(5)
        self.proc.stderr.close()


@contextlib.contextmanager
def running(root: Path, *args: str, env: dict | None = None):
    server = Server(root, *args, env=env)
    try:
        yield server
    finally:
        server.stop()


def run_cli(*args: str, env: dict | None = None, timeout: float = 30):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SERVICE_")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, NOTESVC, *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
    )


# -- configuration ------------------------------------------------------------------


class TestConfig:
    def test_defaults_match_the_contract(self):
        cfg = notesvc.load_config(env={})
        assert (cfg.host, cfg.port, cfg.auth_mode, cfg.pairing) == (
            "0.0.0.0",
            3000,
            "api-key",
            "relay",
        )
        assert cfg.max_body_bytes == 1048576
        assert cfg.rescan_seconds == 5
        assert cfg.threads == 8
        assert cfg.agent_timeout == 60
        assert cfg.root == Path("./data").resolve()

    def test_flag_beats_variable_beats_default(self):
        assert notesvc.load_config(env={"SERVICE_PORT": "4000"}).port == 4000
        assert notesvc.load_config(env={"SERVICE_PORT": "4000"}, port="5000").port == 5000

    @pytest.mark.parametrize(
        ("env", "names"),
        [
            ({"SERVICE_PORT": "abc"}, "SERVICE_PORT"),
            ({"SERVICE_PORT": "70000"}, "SERVICE_PORT"),
            ({"SERVICE_AUTH_MODE": "magic"}, "SERVICE_AUTH_MODE"),
            ({"SERVICE_AUTH_MODE": "jwt"}, "SERVICE_JWT_SECRET"),
            ({"SERVICE_AUTH_MODE": "jwt", "SERVICE_JWT_SECRET": "short"}, "SERVICE_JWT_SECRET"),
            ({"SERVICE_TRUST_PROXY": "maybe"}, "SERVICE_TRUST_PROXY"),
            ({"SERVICE_PAIRING_MODE": "carrier-pigeon"}, "SERVICE_PAIRING_MODE"),
            ({"SERVICE_PUBLIC_URL": "ftp://x"}, "SERVICE_PUBLIC_URL"),
            ({"SERVICE_CORS_ORIGINS": "not a url"}, "SERVICE_CORS_ORIGINS"),
            ({"SERVICE_MAX_BODY_BYTES": "-1"}, "SERVICE_MAX_BODY_BYTES"),
            ({"SERVICE_AGENT_TIMEOUT": "soon"}, "SERVICE_AGENT_TIMEOUT"),
            ({"SERVICE_THREADS": "0"}, "SERVICE_THREADS"),
            ({"SERVICE_LOG_LEVEL": "loud"}, "SERVICE_LOG_LEVEL"),
        ],
    )
    def test_bad_value_raises_config_error_naming_it(self, env, names):
        with pytest.raises(notesvc.ConfigError, match=names):
            notesvc.load_config(env=env)

    def test_jwt_with_long_secret_is_accepted(self):
        cfg = notesvc.load_config(env={"SERVICE_AUTH_MODE": "jwt", "SERVICE_JWT_SECRET": "x" * 32})
        assert cfg.auth_mode == "jwt"

    def test_every_setting_is_a_config_field(self):
        fields = {f.name for f in notesvc.dataclasses.fields(notesvc.Config)}
        assert {s.name for s in notesvc.SETTINGS} == fields

    def test_importing_the_module_creates_no_files(self, tmp_path):
        code = "import notesvc, os; print(sorted(os.listdir('.')))"
        out = subprocess.run(
            [sys.executable, "-c", code],
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(HERE)},
            capture_output=True,
            text=True,
            check=True,
        )
        assert out.stdout.strip() == "[]"


# -- envelope and errors -----------------------------------------------------------------


def _boom(svc):
    raise RuntimeError("secret internals /etc/passwd")


def _echo(svc):
    return {"body": notesvc.read_json(svc.config.max_body_bytes)}


class TestEnvelope:
    @pytest.fixture
    def app(self, root):
        cfg = notesvc.load_config(env=make_env(root, SERVICE_MAX_BODY_BYTES="2048"))
        service = notesvc.Service(cfg)
        extra = (
            notesvc.Route("GET", "/boom", _boom),
            notesvc.Route("POST", "/echo", _echo),
        )
        wsgi = notesvc.NotesApp(service, notesvc.ROUTES + extra)
        key = service.state.read()["apiKey"]
        return webtest.TestApp(wsgi, extra_environ={"HTTP_X_SERVICE_KEY": key})

    def test_unknown_route_is_json_404(self, anon):
        err = assert_error(anon.get(f"{API}/nope", status=404), 404, "NOT_FOUND")
        assert "/api/v1/nope" in err["message"]

    def test_unknown_path_outside_api_is_json_404(self, anon):
        assert_error(anon.get("/favicon.ico", status=404), 404, "NOT_FOUND")

    def test_wrong_method_is_405_with_allow(self, client):
        resp = client.delete(f"{API}/health", status=405)
        assert_error(resp, 405, "METHOD_NOT_ALLOWED")
        assert "GET" in resp.headers["Allow"]

    def test_patch_system_config_is_405(self, client):
        resp = client.patch_json(f"{API}/system/config", {"x": 1}, status=405)
        assert_error(resp, 405, "METHOD_NOT_ALLOWED")
        assert resp.headers["Allow"] == "GET"

    @pytest.mark.parametrize(
        ("method", "path", "names"),
        [("POST", "/folders", "/folders/tree"), ("GET", "/agent/tools", "/agent/status")],
    )
    def test_replaced_endpoint_names_its_replacement(self, client, method, path, names):
        resp = client.request(API + path, method=method, status=404)
        assert names in assert_error(resp, 404, "NOT_FOUND")["message"]

    def test_crash_is_500_with_request_id_and_no_details(self, app, caplog):
        resp = app.get(f"{API}/boom", status=500)
        err = assert_error(resp, 500, "INTERNAL_ERROR")
        rid = resp.headers["X-Request-Id"]
        assert rid in err["message"]
        assert "secret" not in resp.text
        assert "passwd" not in resp.text
        assert any(rid in r.getMessage() for r in caplog.records)

    def test_every_response_has_a_request_id(self, anon):
        ids = {anon.get(f"{API}/health").headers["X-Request-Id"] for _ in range(3)}
        assert len(ids) == 3
        assert anon.get(f"{API}/nope", status=404).headers["X-Request-Id"]

    def test_sane_incoming_request_id_is_kept(self, anon):
        resp = anon.get(f"{API}/health", headers={"X-Request-Id": "trace-1234abcd"})
        assert resp.headers["X-Request-Id"] == "trace-1234abcd"
        resp = anon.get(f"{API}/health", headers={"X-Request-Id": "bad id\x01"})
        assert resp.headers["X-Request-Id"] != "bad id\x01"

    def test_protected_responses_are_no_store(self, client):
        assert client.get(f"{API}/system/info").headers["Cache-Control"] == "no-store"
        resp = client.get(f"{API}/nope", status=404)
        assert resp.headers["Cache-Control"] == "no-store"

    def test_json_body_round_trips(self, app):
        body = {"text": "Grüße ✓", "n": [1, 2]}
        assert data(app.post_json(f"{API}/echo", body))["body"] == body

    def test_broken_json_is_400(self, app):
        resp = app.post(f"{API}/echo", "{bad", content_type="application/json", status=400)
        assert "JSON" in assert_error(resp, 400, "VALIDATION_ERROR")["message"]

    @pytest.mark.parametrize("raw", ["[1,2]", '"text"', "42", "null", '{"a": NaN}'])
    def test_non_object_or_nonstandard_json_is_400(self, app, raw):
        resp = app.post(f"{API}/echo", raw, content_type="application/json", status=400)
        assert_error(resp, 400, "VALIDATION_ERROR")

    def test_deeply_nested_json_is_400_not_500(self, app):
        raw = "[" * 100000 + "]" * 100000
        resp = app.post(f"{API}/echo", raw[:2000], content_type="application/json", status=400)
        assert_error(resp, 400, "VALIDATION_ERROR")

    def test_invalid_utf8_body_is_400(self, app):
        resp = app.post(
            f"{API}/echo", b'{"a": "\xff"}', content_type="application/json", status=400
        )
        assert "UTF-8" in assert_error(resp, 400, "VALIDATION_ERROR")["message"]

    def test_missing_body_is_400(self, app):
        assert_error(app.post(f"{API}/echo", status=400), 400, "VALIDATION_ERROR")

    def test_wrong_content_type_is_415(self, app):
        resp = app.post(f"{API}/echo", "a=1", content_type="text/plain", status=415)
        assert_error(resp, 415, "UNSUPPORTED_MEDIA_TYPE")

    def test_huge_body_is_413(self, app):
        resp = app.post_json(f"{API}/echo", {"a": "x" * 5000}, status=413)
        assert_error(resp, 413, "PAYLOAD_TOO_LARGE")

    def test_invalid_utf8_url_is_400(self, client):
        resp = client.get("/api/v1/notes/notes%2F%FF.md", status=400)
        assert_error(resp, 400, "VALIDATION_ERROR")


# -- setup payload ---------------------------------------------------------------------------


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
        key = data(anon.get(f"{API}/system/setup"))["apiKey"]
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
        trusted = data(trusted_app.get(f"{API}/system/setup", headers=headers))
        assert trusted["server"]["url"] == "https://notes.example"

    def test_public_url_wins(self, make_app):
        app = make_app(SERVICE_PUBLIC_URL="https://pi.example/")
        p = data(app.get(f"{API}/system/setup", headers={"Host": "other:1"}))
        assert p["server"]["url"] == "https://pi.example"

    def test_link_completes_setup_and_redacts_key(self, anon, client):
        key = key_of(anon)
        before = data(anon.get(f"{API}/system/setup"))
        assert before["setupComplete"] is False
        assert before["apiKey"] == key
        assert before["instructions"]
        linked = data(client.post_json(f"{API}/auth/link", {"clientName": "phone"}))
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
        remote = data(app.get(f"{API}/system/setup", extra_environ={"REMOTE_ADDR": "192.0.2.7"}))
        assert remote["apiKey"] != key
        assert remote["apiKey"].startswith("nsk_…")
        local = data(app.get(f"{API}/system/setup", extra_environ={"REMOTE_ADDR": "127.0.0.1"}))
        assert local["apiKey"] == key

    def test_server_id_and_key_survive_restart(self, make_app, root):
        first = data(make_app().get(f"{API}/system/setup"))
        second = data(make_app().get(f"{API}/system/setup"))
        assert first["serverId"] == second["serverId"]
        assert first["apiKey"] == second["apiKey"]
        assert first["pairing"]["relayCode"] == second["pairing"]["relayCode"]


# -- auth ---------------------------------------------------------------------------------


class TestAuth:
    def test_every_protected_route_refuses_missing_and_wrong_key(self, anon):
        protected = [r for r in anon.app.service.routes if not r.public]
        assert len(protected) >= 5
        wrong = with_key(anon, "nsk_" + "A" * 43)
        for route in protected:
            url = sample_url(route)
            for app in (anon, wrong):
                resp = app.request(url, method=route.method, status="*", expect_errors=True)
                assert_error(resp, 401, "UNAUTHORIZED")
            anon.app.service.lockout = notesvc.Lockout()  # keep the lockout out of this test

    def test_public_routes_need_no_key(self, anon):
        for route in anon.app.service.routes:
            if route.public and "<" not in route.rule:
                assert anon.request(route.rule, method=route.method).status_int == 200

    def test_verify_returns_identity(self, client):
        d = data(client.post(f"{API}/auth/verify"))
        assert d == {
            "valid": True,
            "serverId": client.app.service.state.read()["serverId"],
            "setupComplete": False,
        }

    def test_link_records_clients_and_repeats_fine(self, client, root):
        client.post_json(f"{API}/auth/link", {"clientName": "phone"})
        client.post(f"{API}/auth/link")
        state = json.loads((root / ".notesvc" / "state.json").read_text())
        assert [c["name"] for c in state["linkedClients"]] == ["phone", "unnamed client"]
        assert state["setupComplete"] is True
        assert "apiKey" not in state
        assert len(state["keyHash"]) == 64

    @pytest.mark.parametrize("body", [{"clientName": 5}, {"clientName": "x" * 101}])
    def test_link_rejects_bad_client_name(self, client, body):
        assert_error(
            client.post_json(f"{API}/auth/link", body, status=400), 400, "VALIDATION_ERROR"
        )

    def test_state_file_is_private(self, client, root):
        client.post(f"{API}/auth/link")
        folder = root / ".notesvc"
        assert stat.S_IMODE(os.stat(folder / "state.json").st_mode) == 0o600
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700

    def test_rotate_replaces_key_and_relay_code(self, anon, client):
        old_code = anon.app.service.state.read()["relayCode"]
        new = data(client.post(f"{API}/auth/rotate"))
        assert re.fullmatch(r"nsk_[A-Za-z0-9_-]{43}", new["apiKey"])
        assert new["relayCode"] != old_code
        assert_error(client.post(f"{API}/auth/verify", status=401), 401, "UNAUTHORIZED")
        assert data(with_key(anon, new["apiKey"]).post(f"{API}/auth/verify"))["valid"]

    def test_lockout_after_ten_failures(self, anon):
        wrong = with_key(anon, "nsk_wrong")
        for _ in range(10):
            wrong.post(f"{API}/auth/verify", status=401)
        resp = wrong.post(f"{API}/auth/verify", status=429)
        assert_error(resp, 429, "RATE_LIMITED")
        assert 1 <= int(resp.headers["Retry-After"]) <= 60
        # Locked out means locked out, even with the right key ...
        with_key(anon).post(f"{API}/auth/verify", status=429)
        # ... but only for that address.
        with_key(anon).post(f"{API}/auth/verify", extra_environ={"REMOTE_ADDR": "10.9.9.9"})

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

    def test_key_check_is_constant_time_on_hashes(self):
        # The comparison is hmac.compare_digest over SHA-256 digests of equal length.
        src = Path(NOTESVC).read_text()
        assert "hmac.compare_digest(key_hash(key), stored)" in src

    def test_rotate_key_cli_while_serving(self, anon, root):
        old = key_of(anon)
        client = with_key(anon, old)
        client.post_json(f"{API}/auth/link", {"clientName": "laptop"})
        out = run_cli("rotate-key", "--root", str(root))
        assert out.returncode == 0, out.stderr
        new = out.stdout.strip()
        assert re.fullmatch(r"nsk_[A-Za-z0-9_-]{43}", new)
        # The running app sees the new key at once; the old one is refused.
        client.post(f"{API}/auth/verify", status=401)
        fresh = with_key(anon, new)
        assert data(fresh.post(f"{API}/auth/verify"))["setupComplete"] is True
        # A later write by the running app keeps the new key.
        fresh.post_json(f"{API}/auth/link", {"clientName": "tablet"})
        state = json.loads((root / ".notesvc" / "state.json").read_text())
        assert state["keyHash"] == notesvc.key_hash(new)
        assert [c["name"] for c in state["linkedClients"]] == ["laptop", "tablet"]
        # The setup payload never shows the rotated key once setup is complete.
        assert new not in anon.get(f"{API}/system/setup").text


# -- system ----------------------------------------------------------------------------------


class TestSystem:
    def test_health(self, anon):
        d = data(anon.get(f"{API}/health"))
        assert d["status"] == "ok"
        assert d["version"] == notesvc.__version__
        assert d["uptimeSeconds"] >= 0

    def test_info(self, client, root):
        (root / "notes" / "a").mkdir(parents=True)
        (root / "notes" / "a" / "x.md").write_text("hello")
        (root / "notes" / "skip.txt").write_text("not a note")
        d = data(client.get(f"{API}/system/info"))
        assert d["version"] == notesvc.__version__
        assert d["notes"] == {"count": 1, "bytes": 5}
        assert d["python"] == notesvc.platform.python_version()
        for name in ("serverId", "uptimeSeconds", "platform", "index"):
            assert name in d

    def test_config_groups_and_no_secrets(self, make_app):
        secret = "s3cr3t-" + "x" * 40
        app = make_app(
            SERVICE_AUTH_MODE="jwt",
            SERVICE_JWT_SECRET=secret,
            SERVICE_AGENT_API_KEY="sk-agent-secret",
            SERVICE_AGENT_BASE_URL="https://user:pw@models.example/v1",
            SERVICE_CORS_ORIGINS="https://a.example",
        )
        d = data(with_key(app).get(f"{API}/system/config"))
        for group in ("server", "auth", "connection", "agent", "search", "sync", "plugins"):
            assert group in d
        assert d["server"]["port"] == 3000
        assert d["server"]["cors"] == ["https://a.example"]
        assert d["auth"]["mode"] == "jwt"
        text = json.dumps(d)
        for secret_text in (secret, "sk-agent-secret", "pw@", key_of(app)):
            assert secret_text not in text
        assert d["agent"]["baseUrl"] == "https://models.example/v1"


# -- CORS ----------------------------------------------------------------------------------


class TestCors:
    def test_allowed_origin_gets_headers(self, make_app):
        app = make_app(SERVICE_CORS_ORIGINS="https://app.example")
        resp = app.get(f"{API}/health", headers={"Origin": "https://app.example"})
        assert resp.headers["Access-Control-Allow-Origin"] == "https://app.example"
        assert "ETag" in resp.headers["Access-Control-Expose-Headers"]

    def test_preflight(self, make_app):
        app = make_app(SERVICE_CORS_ORIGINS="https://app.example")
        resp = app.options(
            f"{API}/notes",
            headers={
                "Origin": "https://app.example",
                "Access-Control-Request-Method": "PUT",
                "Access-Control-Request-Headers": "x-service-key, if-match",
            },
        )
        assert resp.status_int == 204
        allowed = resp.headers["Access-Control-Allow-Headers"]
        for h in ("X-Service-Key", "Content-Type", "Authorization", "If-Match"):
            assert h in allowed
        assert "PUT" in resp.headers["Access-Control-Allow-Methods"]

    def test_other_origin_gets_no_cors_headers(self, make_app):
        app = make_app(SERVICE_CORS_ORIGINS="https://app.example")
        resp = app.get(f"{API}/health", headers={"Origin": "https://evil.example"})
        assert "Access-Control-Allow-Origin" not in resp.headers
        pre = app.options(
            f"{API}/health",
            headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "GET"},
            status="*",
            expect_errors=True,
        )
        assert "Access-Control-Allow-Origin" not in pre.headers

    def test_no_cors_configured_means_no_headers(self, anon):
        resp = anon.get(f"{API}/health", headers={"Origin": "https://app.example"})
        assert "Access-Control-Allow-Origin" not in resp.headers


# -- self-relay and OpenAPI ---------------------------------------------------------------


class TestSelfRelay:
    def test_relay_prefix_answers_like_the_api(self, anon, client):
        sid = anon.app.service.state.read()["serverId"]
        assert data(anon.get(f"/r/{sid}{API}/health"))["status"] == "ok"
        assert data(client.get(f"/r/{sid}{API}/system/info"))["serverId"] == sid
        assert_error(anon.get(f"/r/{sid}{API}/system/info", status=401), 401, "UNAUTHORIZED")
        assert_error(anon.get(f"/r/{sid}{API}/nope", status=404), 404, "NOT_FOUND")

    def test_other_server_id_is_404(self, anon):
        assert_error(anon.get(f"/r/someoneelse{API}/health", status=404), 404, "NOT_FOUND")

    def test_relay_api_base_from_setup_works(self, anon):
        base = data(anon.get(f"{API}/system/setup"))["links"]["relayApiBase"]
        path = base.split("://", 1)[1].split("/", 1)[1]
        assert data(anon.get(f"/{path}/health"))["status"] == "ok"

    def test_pair_code_resolves(self, anon):
        code = anon.app.service.state.read()["relayCode"]
        d = data(anon.get(f"/relay/v1/pair/{code}"))
        assert d["serverId"] == anon.app.service.state.read()["serverId"]
        assert d["relayApiBase"].endswith(f"/r/{d['serverId']}/api/v1")
        assert_error(anon.get("/relay/v1/pair/AAAA-BBBB-CCCC", status=404), 404, "NOT_FOUND")


class TestOpenApi:
    def test_document_and_route_table_agree(self, anon):
        doc = anon.get(f"{API}/openapi.json").json
        assert doc["openapi"].startswith("3.1")
        documented = {
            (method.upper(), path) for path, ops in doc["paths"].items() for method in ops
        }
        routes = {
            (r.method, notesvc.openapi_path(r.rule))
            for r in anon.app.service.routes
            if r.rule.startswith(API)
        }
        assert documented == routes
        # Every route the Bottle app really has under /api/v1 is in the table.
        bottle_routes = {
            (r.method, notesvc.openapi_path(r.rule))
            for r in anon.app.bottle.routes
            if r.rule.startswith(API)
        }
        assert bottle_routes == routes
        schemes = doc["components"]["securitySchemes"]
        assert schemes["apiKey"]["name"] == "X-Service-Key"
        assert schemes["bearerJwt"]["scheme"] == "bearer"

    def test_public_routes_are_marked_public(self, anon):
        doc = anon.get(f"{API}/openapi.json").json
        assert doc["paths"]["/api/v1/health"]["get"]["security"] == []
        assert "security" not in doc["paths"]["/api/v1/system/info"]["get"]


# -- command line ------------------------------------------------------------------------


class TestCli:
    @pytest.mark.parametrize(
        ("args", "env", "names"),
        [
            (["--port", "abc"], {}, "--port"),
            ([], {"SERVICE_PORT": "abc"}, "SERVICE_PORT"),
            (["--auth-mode", "magic"], {}, "--auth-mode"),
            (["--auth-mode", "jwt"], {}, "SERVICE_JWT_SECRET"),
            ([], {"SERVICE_TRUST_PROXY": "perhaps"}, "SERVICE_TRUST_PROXY"),
            (["--no-such-flag"], {}, "--no-such-flag"),
        ],
    )
    def test_bad_values_exit_2_with_one_line(self, tmp_path, args, env, names):
        out = run_cli(*args, "--root", str(tmp_path), env=env)
        assert out.returncode == 2
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1, out.stderr
        assert names in lines[0]
        assert "Traceback" not in out.stderr

    def test_version(self):
        out = run_cli("--version")
        assert out.returncode == 0
        assert out.stdout.strip() == f"notesvc {notesvc.__version__}"

    def test_help_lists_every_variable(self):
        out = run_cli("--help")
        assert out.returncode == 0
        for s in notesvc.SETTINGS:
            assert s.env in out.stdout
            if s.flag:
                assert s.flag in out.stdout

    def test_corrupt_state_file_stops_startup_cleanly(self, tmp_path):
        (tmp_path / ".notesvc").mkdir()
        (tmp_path / ".notesvc" / "state.json").write_text("{broken")
        out = run_cli("--root", str(tmp_path), "--port", "0", "--host", "127.0.0.1")
        assert out.returncode == 2
        assert "state.json" in out.stderr
        assert "Traceback" not in out.stderr


class TestServer:
    def test_real_server_round_trip(self, tmp_path):
        with running(tmp_path) as server:
            banner = "".join(server.lines)
            status, _, body = server.request("GET", f"{API}/system/setup")
            assert status == 200
            key = body["data"]["apiKey"]
            assert key in banner  # the banner shows the key while setup is incomplete
            assert f"{server.url}{API}/system/setup" in banner
            status, headers, body = server.request("POST", f"{API}/auth/verify")
            assert status == 401
            assert body["error"]["code"] == "UNAUTHORIZED"
            assert headers["X-Request-Id"]
            status, _, body = server.request(
                "POST", f"{API}/auth/link", {"clientName": "cli"}, {"X-Service-Key": key}
            )
            assert status == 200
            assert body["data"]["setupComplete"] is True
        # After a restart the state is read back: setup stays complete, key stays valid.
        with running(tmp_path) as server:
            assert key not in "".join(server.lines)
            status, _, body = server.request(
                "POST", f"{API}/auth/verify", headers={"X-Service-Key": key}
            )
            assert status == 200
            assert body["data"]["setupComplete"] is True

    def test_second_process_on_same_root_refuses(self, tmp_path):
        with running(tmp_path):
            out = run_cli("--root", str(tmp_path), "--port", "0", "--host", "127.0.0.1")
            assert out.returncode == 2
            assert "already serving" in out.stderr

    def test_sigterm_stops_cleanly(self, tmp_path):
        server = Server(tmp_path)
        try:
            server.proc.terminate()
            assert server.proc.wait(10) == 0
        finally:
            server.stop()


class TestDocs:
    def test_readme_documents_every_setting(self):
        readme = (HERE / "README.md").read_text()
        for s in notesvc.SETTINGS:
            assert f"`{s.env}`" in readme, s.env
            if s.flag:
                assert f"`{s.flag}`" in readme, s.flag

    def test_readme_starts_with_the_two_commands(self):
        readme = (HERE / "README.md").read_text()
        blocks = re.findall(r"```sh\n(.*?)```", readme, re.S)
        assert blocks[0].strip() == "pip install . && python notesvc.py"
        assert blocks[1].strip() == "pip install '.[test]' && pytest"
