"""The middleware on a real waitress: limits, CORS, compression (src/notesvc/http/app.py)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import http.server
import json
import logging
import os
import re
import select
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
import webtest

from conftest import (
    API,
    CALLBACK,
    HERE,
    KEY,
    LOCAL,
    NOTESVC,
    Server,
    assert_gzipped,
    att_url,
    basic,
    key_of,
    note_url,
    notesvc,
    pkce_pair,
    put_note,
    raw_answer,
    raw_http,
    relay_servers,
    run_cli,
    running,
    sample_url,
    timed_health,
    wait_for,
)
from standins import ForwardingProxy


def call(base: str, method: str, path: str, headers: dict | None = None, source="127.0.0.1"):
    """Return (status, parsed JSON body) for one request from a chosen loopback address."""
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(
        url.hostname, url.port, timeout=10, source_address=(source, 0)
    )
    try:
        conn.request(method, path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


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


# What a secret looks like in an answer (T10): a field named for one, holding more than a
# redacted hint, or a value shaped like one anywhere: a key or an OAuth token or code, a
# link that holds a code, a pairing, a share or a feed, a JWT.
SECRET_FIELDS = {"key", "apikey", "secret", "token", "access_token", "refresh_token", "code"}


SECRET_FIELDS |= {"bindcode"}


SECRET_SHAPE_RE = re.compile(
    r"\bns[kgdarc]_[A-Za-z0-9_-]{20,}"
    r"|[?&#](?:code|start|pair)=[A-Za-z0-9_-]{8,}"
    r"|/s/[A-Za-z0-9_-]{22}(?![A-Za-z0-9_-])|/ics/[A-Za-z0-9_-]{32}\.ics"
    r"|\beyJ[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+"
)


def carries_secret(answer) -> bool:
    """Return whether a JSON answer holds a secret or a code (SECRET_FIELDS, SECRET_SHAPE_RE)."""
    if isinstance(answer, dict):
        for name, value in answer.items():
            named = name.lower() in SECRET_FIELDS and isinstance(value, str)
            if named and len(value) >= 8 and "…" not in value and not value.isupper():
                return True
            if carries_secret(value):
                return True
        return False
    if isinstance(answer, list):
        return any(map(carries_secret, answer))
    return isinstance(answer, str) and bool(SECRET_SHAPE_RE.search(answer))


def secret_answers(ask, key: str, note: str = "notes/shared.md") -> dict:
    """Ask every route that answers a secret or a code, each as a client would, its answer
    made longer than gzip's threshold where the request can (a long name, the client's own
    `state`); return {(method, rule): (status, headers, raw answer)}. `ask(method, path,
    body=None, headers=None, form=None)` sends it (WebTest or the wire) with gzip asked.
    The rotate comes last: it ends `key`."""
    owner, long = {KEY: key}, "n" * 100
    got: dict = {}

    def call(method: str, rule: str, path: str = "", **how) -> dict:
        status, headers, raw = ask(method, path or rule, **how)
        got[(method, rule)] = (status, headers, raw)
        assert "Content-Encoding" not in headers, f"{method} {rule} was compressed"
        assert 200 <= status < 300, (rule, status, raw[:300])
        return json.loads(raw)

    call("GET", f"{API}/system/setup")
    call("POST", f"{API}/auth/keys", body={"name": long, "scope": "write"}, headers=owner)
    body = {"name": long, "scope": "write"}
    made = call("POST", f"{API}/auth/devices/pairings", body=body, headers=owner)["data"]
    claim = {"secret": made["secret"], "deviceName": long}
    call("POST", f"{API}/auth/devices/claim", body=claim)
    call("POST", f"{API}/auth/feeds", body={"name": long}, headers=owner)
    person = call("POST", f"{API}/people", body={"name": "Ann " + "n" * 50}, headers=owner)
    more = f"{API}/people/{person['data']['person']['id']}/pairings"
    call("POST", f"{API}/people/<person_id>/pairings", more, body={"name": long}, headers=owner)
    theirs = {"secret": person["data"]["pairing"]["secret"], "deviceName": "Ann's phone"}
    _, _, raw = ask("POST", f"{API}/auth/devices/claim", body=theirs)
    ann = {KEY: json.loads(raw)["data"]["key"]}
    ask("POST", f"{API}/notes", body={"path": note, "content": "x"}, headers=owner)
    call("POST", f"{API}/shares", body={"path": note}, headers=owner)
    call("POST", f"{API}/channels", body={"provider": "web", "name": long}, headers=owner)
    body = {"botToken": "123456:ABC-good", "name": long}
    connected = call("POST", f"{API}/channels/connect/telegram", body=body, headers=owner)
    bind = f"{API}/channels/{connected['data']['channel']['id']}/bind"
    call("POST", f"{API}/channels/<channel_id>/bind", bind, headers=owner)
    link = f"{API}/channels/{connected['data']['channel']['id']}/link"  # a person's chat
    call("POST", f"{API}/channels/<channel_id>/link", link, headers=ann)
    client = {"redirect_uris": [CALLBACK], "client_name": "Pocket assistant"}
    cid = json.loads(ask("POST", "/oauth/register", body=client)[2])["client_id"]
    verifier, challenge = pkce_pair()
    body = {
        "clientId": cid,
        "redirectUri": CALLBACK,
        "state": "s" * 1024,  # the client's own text, beside the code
        "codeChallenge": challenge,
        "scope": "notes:read",
    }
    redirect = call("POST", f"{API}/oauth/approve", body=body, headers=owner)["data"]["redirect"]
    code = urllib.parse.parse_qs(urllib.parse.urlsplit(redirect).query)["code"][0]
    form = {
        "grant_type": "authorization_code",
        "code": code,
        "client_id": cid,
        "redirect_uri": CALLBACK,
        "code_verifier": verifier,
    }
    call("POST", "/oauth/token", form=form)
    call("POST", f"{API}/auth/token", headers=owner)
    call("POST", f"{API}/auth/rotate", headers=owner)
    return got


SECRET_APP_ENV = {"SERVICE_AUTH_MODE": "jwt", "SERVICE_JWT_SECRET": "j" * 40}


class TestCompression:
    """gzip for pages, scripts and JSON over ~1 KB when asked (docs/api.md: Compression)."""

    def test_accept_encoding_is_read_with_its_q_values(self):
        takes = notesvc.accepts_gzip
        assert takes("gzip")
        assert takes("gzip, deflate, br, zstd")
        assert takes("GZIP;Q=0.5")
        assert takes("*")
        assert takes("x-gzip")
        assert takes("br, *;q=0.1")
        for refused in ("", "identity", "br", "gzip;q=0", "gzip; q=0.0", "*;q=1, gzip;q=0"):
            assert not takes(refused), refused
        assert not takes("gzip;q=nope")  # a q-value not understood takes nothing

    def test_routes_that_answer_a_secret_are_never_gzipped(self, anon):
        secret = {(r.method, r.rule): r for r in anon.app.service.routes if r.secret and not r.gzip}
        for method, rule in (
            ("GET", f"{API}/system/setup"),
            ("POST", f"{API}/auth/rotate"),
            ("POST", f"{API}/auth/token"),
            ("POST", f"{API}/auth/keys"),
            ("POST", f"{API}/auth/devices/pairings"),
            ("POST", f"{API}/auth/devices/claim"),
            ("POST", f"{API}/shares"),
            ("POST", f"{API}/channels"),
            ("POST", f"{API}/channels/connect/telegram"),
            ("POST", f"{API}/channels/<channel_id>/bind"),
            ("POST", f"{API}/channels/<channel_id>/link"),
            ("POST", f"{API}/auth/feeds"),
            ("POST", f"{API}/oauth/approve"),
            ("POST", "/oauth/token"),
        ):
            assert (method, rule) in secret, rule
        files = [r for r in anon.app.service.routes if r.media in ("*/*", "application/zip")]
        assert files
        assert not any(r.gzip for r in files)
        mine = notesvc.PluginRoute("POST", "/token", lambda svc: {}, secret=True)
        (route,) = notesvc.plugin_routes([notesvc.Plugin("p", routes=(mine,))])
        assert route.secret
        assert not route.gzip

    def test_every_answer_with_a_secret_comes_from_a_secret_route(self, make_app, upstream):
        """T10, derived from the answers themselves: every route is asked (the ones that
        make a secret as a client would, the rest with sample values), and an answer that
        carries a key, a token, a secret, a code or a link holding one must come from a
        route marked secret; each route marked secret shows one."""
        env = {**SECRET_APP_ENV, "SERVICE_TELEGRAM_API_BASE": upstream.url}
        app = webtest.TestApp(make_app(**env).app, extra_environ=LOCAL)
        key = key_of(app)
        routes = {(r.method, r.rule): r for r in app.app.service.routes}
        carried: set = set()

        def ask(method, path, body=None, headers=None, form=None):
            hdrs = {"Accept-Encoding": "gzip", **(headers or {})}
            if form is not None:
                resp = app.post(path, form, headers=hdrs, status="*")
            elif body is not None:
                payload = json.dumps(body).encode()
                hdrs["Content-Type"] = "application/json"
                resp = app.request(path, method=method, body=payload, headers=hdrs, status="*")
            else:
                resp = app.request(path, method=method, headers=hdrs, status="*")
            return resp.status_int, resp.headers, resp.body

        made = secret_answers(ask, key)
        key = key_of(app)  # rotated last
        rotate = ("POST", f"{API}/auth/rotate")
        for method, rule in routes:  # the rest, with sample values
            if (method, rule) not in made and (method, rule) != rotate:
                made[(method, rule)] = ask(method, sample_url(rule), headers={KEY: key})
        for where, (status, headers, raw) in made.items():
            is_json = headers.get("Content-Type", "").startswith("application/json")
            if 200 <= status < 300 and is_json and carries_secret(json.loads(raw)):
                carried.add(where)
        unmarked = sorted(f"{m} {r}" for m, r in carried if not routes[(m, r)].secret)
        assert unmarked == []
        assert {w for w, r in routes.items() if r.secret} == carried
        assert not any(routes[w].gzip for w in carried)

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_no_answer_with_a_secret_or_a_code_is_gzipped_on_the_wire(self, tmp_path, upstream):
        """T10 on a real server: every route that answers a secret or a code, asked with
        `Accept-Encoding: gzip`, answers without Content-Encoding (BREACH) — the OAuth
        approval's code beside 1 KB of the client's own `state` included."""
        env = {**SECRET_APP_ENV, "SERVICE_TELEGRAM_API_BASE": upstream.url}
        with running(tmp_path / "root", env=env) as server:

            def ask(method, path, body=None, headers=None, form=None):
                hdrs = {"Accept-Encoding": "gzip", **(headers or {})}
                if form is None:
                    return raw_answer(server, method, path, hdrs, body)
                conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
                try:
                    hdrs["Content-Type"] = "application/x-www-form-urlencoded"
                    conn.request(method, path, urllib.parse.urlencode(form), hdrs)
                    resp = conn.getresponse()
                    return resp.status, resp.headers, resp.read()
                finally:
                    conn.close()

            key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]
            made = secret_answers(ask, key)
            assert set(made) == {(r.method, r.rule) for r in notesvc.ROUTES if r.secret}
            for (method, rule), (_, headers, raw) in made.items():
                assert "Content-Encoding" not in headers, f"{method} {rule}"
                assert carries_secret(json.loads(raw)), f"{method} {rule}"
            assert len(made[("POST", f"{API}/oauth/approve")][2]) > 1024  # gzip's threshold

    def test_a_webtest_answer_says_vary_and_what_it_was_before(self, client):
        """(WebTest decodes gzip itself: here only what it keeps; the wire is below.)"""
        for i in range(20):
            put_note(client, f"notes/v/n{i:02}.md", "words " * 20)
        asked = client.get(f"{API}/notes", headers={"Accept-Encoding": "gzip"})
        plain = client.get(f"{API}/notes")
        assert "Accept-Encoding" in asked.headers["Vary"]
        assert asked.json == plain.json
        assert "Accept-Encoding" in plain.headers["Vary"]
        assert "Accept-Encoding" in client.get(f"{API}/health").headers["Vary"]

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_on_the_wire_json_and_the_page_are_gzipped_when_asked_and_only_then(self, tmp_path):
        gz = {"Accept-Encoding": "gzip, deflate, br"}
        with running(tmp_path / "root") as server:
            setup = server.request("GET", f"{API}/system/setup")[2]["data"]
            key = {"X-Service-Key": setup["apiKey"]}
            for i in range(30):
                body = {"path": f"notes/gz/n{i:02}.md", "content": f"# Note {i}\n\n" + "x y " * 50}
                assert server.request("POST", f"{API}/notes", body, key)[0] == 201
            # a JSON list over 1 KB: gzipped, with Vary, decoding to the same JSON
            status, h, plain = raw_answer(server, "GET", f"{API}/notes", key)
            assert status == 200
            assert len(plain) > 1024
            assert "Content-Encoding" not in h
            assert "accept-encoding" in h["Vary"].lower()
            status, h, packed = raw_answer(server, "GET", f"{API}/notes", {**key, **gz})
            assert status == 200
            assert len(packed) < len(plain) / 3
            assert json.loads(assert_gzipped(h, packed)) == json.loads(plain)
            # refused, or not asked: identity (Vary all the same)
            for refuse in ({"Accept-Encoding": "gzip;q=0, br"}, {"Accept-Encoding": "identity"}):
                status, h, body = raw_answer(server, "GET", f"{API}/notes", {**key, **refuse})
                assert "Content-Encoding" not in h
                assert body == plain
                assert "accept-encoding" in h["Vary"].lower()
            # a small answer goes as it is
            status, h, body = raw_answer(server, "GET", f"{API}/health", gz)
            assert "Content-Encoding" not in h
            assert json.loads(body)["success"]
            # the ETag is the one of the bytes before, and a 304 works the same with gzip
            url = note_url("notes/gz/n01.md")
            _, h_plain, _ = raw_answer(server, "GET", url, key)
            _, h_gz, _ = raw_answer(server, "GET", url, {**key, **gz})
            assert h_plain["ETag"] == h_gz["ETag"]
            _, h_plain, _ = raw_answer(server, "GET", f"{API}/system/features")
            _, h_gz, _ = raw_answer(server, "GET", f"{API}/system/features", gz)
            assert h_plain["ETag"] == h_gz["ETag"]
            again = {**gz, "If-None-Match": h_gz["ETag"]}
            status, h, body = raw_answer(server, "GET", f"{API}/system/features", again)
            assert status == 304
            assert body == b""
            assert h["ETag"] == h_gz["ETag"]
            # the page: its gzip (made once, at start) decodes to the very page
            status, h, page = raw_answer(server, "GET", "/")
            assert status == 200
            assert "Content-Encoding" not in h
            assert "accept-encoding" in h["Vary"].lower()
            status, h, packed = raw_answer(server, "GET", "/", gz)
            assert assert_gzipped(h, packed) == page
            assert len(packed) < len(page) / 2
            status, h, _ = raw_answer(server, "HEAD", "/", gz)
            assert "Content-Encoding" not in h
            assert int(h["Content-Length"]) == len(page)
            # the setup's full key and a key's creation: never gzipped
            status, h, body = raw_answer(server, "GET", f"{API}/system/setup", gz)
            assert setup["apiKey"] in body.decode()
            assert "Content-Encoding" not in h
            made = {"name": "phone " + "n" * 90, "scope": "read"}
            status, h, body = raw_answer(server, "POST", f"{API}/auth/keys", {**key, **gz}, made)
            assert status == 201
            assert "Content-Encoding" not in h
            assert json.loads(body)["data"]["key"].startswith("nsg_")
            # an attachment (JSON, over 1 KB), its Range, and WebDAV: never
            doc = json.dumps([{"n": i, "text": "same words again"} for i in range(100)]).encode()
            att = att_url("attachments/big.json")
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
            conn.request("PUT", att, doc, {**key, "Content-Type": "application/octet-stream"})
            assert conn.getresponse().status == 201
            conn.close()
            status, h, body = raw_answer(server, "GET", att, {**key, **gz})
            assert status == 200
            assert body == doc
            assert "Content-Encoding" not in h
            status, h, body = raw_answer(server, "GET", att, {**key, **gz, "Range": "bytes=0-1499"})
            assert status == 206
            assert body == doc[:1500]
            assert "Content-Encoding" not in h
            dav = {"Authorization": basic(setup["apiKey"]), **gz}
            status, h, body = raw_answer(server, "GET", "/dav/attachments/big.json", dav)
            assert status == 200
            assert body == doc
            assert "Content-Encoding" not in h


def hold_idle_connections(port: int, count: int) -> list:
    """Open `count` connections that never finish a request (half send nothing at all)."""
    socks = []
    for i in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        socks.append(sock)
        if i % 4 == 1:
            sock.sendall(b"GET /api/v1/hea")  # an unfinished request line
        elif i % 4 == 3:
            sock.sendall(b"GET /api/v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    return socks


def open_sockets(pid: int) -> int:
    """How many sockets process pid has open (Linux /proc). Sockets only: the files a
    starting server opens and closes meanwhile (its index, its state) would blur the count."""
    found = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            found += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return found


def closed_by_peer(socks: list) -> int:
    """How many of socks the other end has closed (read nothing: peeks at the EOF)."""
    poller = select.poll()
    for sock in socks:
        poller.register(sock, select.POLLIN)
    ready = {fd for fd, _ in poller.poll(0)}
    return sum(s.fileno() in ready and s.recv(1, socket.MSG_PEEK) == b"" for s in socks)


@pytest.fixture
def many_files():
    """Let this process hold a few hundred sockets."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < 2048:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(2048, hard), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture(scope="class")
def small_bodies(tmp_path_factory):
    """One real server taking bodies of at most 2048 bytes (shared by a class's tests)."""
    root = tmp_path_factory.mktemp("small-bodies")
    with running(root, env={"SERVICE_MAX_BODY_BYTES": "2048"}) as server:
        yield server


class TestEdge:
    @pytest.mark.real_server
    @pytest.mark.slow
    def test_a_body_over_the_limit_gets_its_413_even_when_written_before_reading(self, tmp_path):
        """urllib writes the whole body before it reads: the server lingers (keeps reading
        and discarding for a bounded time) instead of closing into a reset."""
        env = {"SERVICE_MAX_BODY_BYTES": "65536"}
        with running(tmp_path, "--auth-mode", "none", env=env) as server:
            body = json.dumps({"path": "notes/big.md", "content": "x" * 2_000_000}).encode()
            for _ in range(5):
                req = urllib.request.Request(
                    f"{server.url}{API}/notes", body, {"Content-Type": "application/json"}
                )
                with pytest.raises(urllib.error.HTTPError) as refused:
                    urllib.request.urlopen(req, timeout=30)
                with refused.value as answer:
                    assert answer.code == 413
                    assert json.loads(answer.read())["error"]["code"] == "PAYLOAD_TOO_LARGE"
            assert server.request("GET", f"{API}/health")[0] == 200
            # Bounded: a client that stops sending is closed after the idle bound.
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
                sock.sendall(
                    f"POST {API}/notes HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    "Content-Length: 900000\r\n\r\n".encode()
                )
                answer = b""
                started = time.monotonic()
                while True:
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    answer += chunk
                assert answer.startswith(b"HTTP/1.1 413")
                assert time.monotonic() - started < notesvc.LINGER_IDLE_SECONDS + 3

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_the_relay_lingers_after_its_own_413_too(self, tmp_path):
        env = {"SERVICE_MAX_BODY_BYTES": "65536"}
        with running(tmp_path, "relay", env=env) as relay:
            body = json.dumps({"path": "notes/big.md", "content": "x" * 8_000_000}).encode()
            for _ in range(5):
                req = urllib.request.Request(
                    f"{relay.url}/r/{'a' * 20}{API}/notes",
                    body,
                    {"Content-Type": "application/json"},
                )
                with pytest.raises(urllib.error.HTTPError) as refused:
                    urllib.request.urlopen(req, timeout=30)
                with refused.value as answer:
                    assert answer.code == 413
                    assert json.loads(answer.read())["error"]["code"] == "PAYLOAD_TOO_LARGE"
            assert relay.request("GET", "/health")[0] == 200

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_trusted_proxy_gives_https_links_real_clients_and_their_own_lockout(self, tmp_path):
        env = {"SERVICE_TRUST_PROXY": "true", "SERVICE_SETUP_LOCAL_ONLY": "true"}
        with running(tmp_path, env=env) as server, ForwardingProxy(server.url) as proxy:
            setup = f"{API}/system/setup"
            key = json.loads((tmp_path / ".notesvc" / "state.json").read_text())["apiKey"]
            # From the trusted proxy's own address, naming no client: not local either.
            assert server.request("GET", setup)[2]["data"]["apiKey"] == "nsk_…" + key[-4:]
            status, body = call(proxy.url, "GET", setup, {"Host": "notes.example"}, "127.0.0.5")
            assert status == 200
            assert body["data"]["server"]["url"] == "https://notes.example"
            assert body["data"]["links"]["directApiBase"] == "https://notes.example/api/v1"
            # A remote client behind the proxy never sees the key (SERVICE_SETUP_LOCAL_ONLY).
            remote = call(proxy.url, "GET", setup, source="127.0.0.5")[1]["data"]
            assert remote["apiKey"] == "nsk_…" + key[-4:]
            # One remote client's failures lock out that client only.
            for i in range(10):
                status, _ = call(
                    proxy.url, "POST", f"{API}/auth/verify", {KEY: f"nsk_x{i}"}, "127.0.0.5"
                )
                assert status == 401
            right = {"X-Service-Key": key}
            assert call(proxy.url, "POST", f"{API}/auth/verify", right, "127.0.0.5")[0] == 429
            assert call(proxy.url, "POST", f"{API}/auth/verify", right, "127.0.0.6")[0] == 200
            assert server.request("POST", f"{API}/auth/verify", headers=right)[0] == 200

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_forwarded_headers_from_an_untrusted_peer_are_ignored(self, tmp_path):
        env = {"SERVICE_TRUST_PROXY": "127.0.0.2", "SERVICE_SETUP_LOCAL_ONLY": "true"}
        with running(tmp_path, env=env) as server:
            forged = {
                "X-Forwarded-For": "203.0.113.9",
                "X-Forwarded-Proto": "https",
                "X-Forwarded-Host": "evil.example",
            }
            setup = server.request("GET", f"{API}/system/setup", headers=forged)[2]["data"]
            assert setup["server"]["url"] == server.url  # 127.0.0.1 is not the named proxy
            # ... and a forwarding header from a peer not named is never local for setup
            assert setup["setupHere"] == {"allowed": False, "reason": "proxy"}
            key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]
            assert setup["apiKey"] == "nsk_…" + key[-4:]
            for i in range(10):  # forged addresses do not spread the failures
                hdrs = {"X-Service-Key": f"nsk_x{i}", "X-Forwarded-For": f"203.0.113.{i}"}
                assert server.request("POST", f"{API}/auth/verify", headers=hdrs)[0] == 401
            hdrs = {"X-Service-Key": key, "X-Forwarded-For": "203.0.113.77"}
            assert server.request("POST", f"{API}/auth/verify", headers=hdrs)[0] == 429
            # The proxy the operator named is trusted.
            with ForwardingProxy(server.url, source="127.0.0.2") as proxy:
                _, body = call(
                    proxy.url, "GET", f"{API}/system/setup", {"Host": "notes.example"}, "127.0.0.5"
                )
                assert body["data"]["server"]["url"] == "https://notes.example"
                right = {"X-Service-Key": key}
                assert call(proxy.url, "POST", f"{API}/auth/verify", right, "127.0.0.5")[0] == 200

    @pytest.mark.real_server
    @pytest.mark.slow
    @pytest.mark.parametrize(
        "proxys", [{"X-Real-IP": "203.0.113.50"}, {"Forwarded": "for=203.0.113.50;proto=https"}]
    )
    def test_a_forged_forwarded_for_behind_a_trusted_proxy_dodges_no_limit(self, tmp_path, proxys):
        """T6: a trusted proxy that writes only X-Real-IP (or Forwarded) passes on whatever
        X-Forwarded-For its client sends: rotating it must not spread the failures (nor the
        rate limits), and naming someone else's address must not lock them out."""
        with running(tmp_path, env={"SERVICE_TRUST_PROXY": "127.0.0.1"}) as server:
            key = json.loads((tmp_path / ".notesvc" / "state.json").read_text())["apiKey"]
            verify = f"{API}/auth/verify"
            victim = {"X-Real-IP": "198.51.100.7"}  # (as the proxy writes it for the victim)
            for i in range(10):  # the attacker names the victim, then anyone at all
                forged = {**proxys, "X-Forwarded-For": "198.51.100.7" if i < 5 else f"10.9.{i}.1"}
                status = server.request("POST", verify, headers={**forged, KEY: f"nsk_x{i}"})[0]
                assert status == 401
            forged = {**proxys, "X-Forwarded-For": "192.0.2.200"}
            status, headers, body = server.request("POST", verify, headers={**forged, KEY: key})
            assert status == 429  # locked out, whatever it forges next
            assert body["error"]["code"] == "RATE_LIMITED"
            assert int(headers["Retry-After"]) > 0
            assert server.request("POST", verify, headers={**victim, KEY: key})[0] == 200
            same = {**victim, "X-Forwarded-For": "198.51.100.7"}  # headers that agree: the client
            assert server.request("POST", verify, headers={**same, KEY: key})[0] == 200
            # every rate limit keys on the same client: ten registrations a minute
            form = {"redirect_uris": [CALLBACK], "client_name": "Pocket assistant"}
            statuses = []
            for i in range(11):
                forged = {**proxys, "X-Forwarded-For": f"10.8.{i}.1"}
                statuses.append(server.request("POST", "/oauth/register", form, forged)[0])
            assert statuses == [201] * 10 + [429]
            assert server.request("POST", "/oauth/register", form, victim)[0] == 201
            logged = "".join(server.lines)
            assert "via:127.0.0.1 is locked out for 60 s" in logged
            assert "198.51.100.7 is locked out" not in logged

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_relayed_failures_never_lock_out_a_loopback_client(self, tmp_path):
        relay = Server(tmp_path / "relay", "relay", env={"SERVICE_RELAY_TIMEOUT": "5"})
        server = Server(tmp_path / "srv", env={"SERVICE_RELAY_URL": relay.url})
        try:
            wait_for(lambda: relay_servers(relay) == 1)
            setup = server.request("GET", f"{API}/system/setup")[2]["data"]
            verify = f"/r/{setup['serverId']}{API}/auth/verify"
            for i in range(10):
                assert relay.request("POST", verify, headers={KEY: f"nsk_x{i}"})[0] == 401
            right = {"X-Service-Key": setup["apiKey"]}
            assert relay.request("POST", verify, headers=right)[0] == 429  # that client is out
            # ... but the owner on the server's own machine is not,
            assert server.request("POST", f"{API}/auth/verify", headers=right)[0] == 200
            # nor the owner reaching the relay from another address.
            assert call(relay.url, "POST", verify, right, source="127.0.0.7")[0] == 200
            assert call(relay.url, "POST", verify, right, source="127.0.0.1")[0] == 429
        finally:
            server.stop()
            relay.stop()

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_rebinding_host_gets_the_key_redacted_from_the_real_server(self, tmp_path):
        with running(tmp_path) as server:
            key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]
            status, _, body = raw_http(
                server.port,
                b"GET /api/v1/system/setup HTTP/1.1\r\nHost: rebind.attacker.example\r\n"
                b"Connection: close\r\n\r\n",
            )
            assert status == 200
            payload = json.loads(body)["data"]
            assert payload["apiKey"] == "nsk_…" + key[-4:]
            assert key not in body.decode()

    @pytest.mark.real_server
    @pytest.mark.slow
    @pytest.mark.parametrize(
        ("case", "headers", "body", "status", "code"),
        [
            ("huge", "Content-Length: 100000000000000000000\r\n", b"", 413, "PAYLOAD_TOO_LARGE"),
            ("just over", "Content-Length: 2049\r\n", b"", 413, "PAYLOAD_TOO_LARGE"),
            ("negative", "Content-Length: -1\r\n", b"", 400, "VALIDATION_ERROR"),
            ("not a number", "Content-Length: ten\r\n", b"", 400, "VALIDATION_ERROR"),
            (
                "repeated",
                "Content-Length: 2\r\nContent-Length: 2\r\n",
                b"{}",
                400,
                "VALIDATION_ERROR",
            ),
            (
                "chunked over",
                "Transfer-Encoding: chunked\r\n",
                b"bb8\r\n" + b"x" * 3000 + b"\r\n0\r\n\r\n",
                413,
                "PAYLOAD_TOO_LARGE",
            ),
        ],
        ids=["huge", "just-over", "negative", "not-a-number", "repeated", "chunked-over"],
    )
    def test_waitress_refusals_are_json_envelopes(
        self, small_bodies, case, headers, body, status, code
    ):
        server = small_bodies
        request = (
            f"POST {API}/notes HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Service-Key: nsk_x\r\n"
            f"Content-Type: application/json\r\n{headers}\r\n"
        ).encode() + body
        got, resp_headers, resp_body = raw_http(server.port, request)
        assert got == status, resp_body
        assert resp_headers["content-type"] == "application/json; charset=utf-8"
        error = json.loads(resp_body)["error"]
        assert error["code"] == code
        assert "waitress" not in resp_body.decode()
        assert resp_headers["x-request-id"]

    @pytest.mark.slow
    def test_body_of_the_largest_size_passes_chunked_and_plain(self, small_bodies):
        server = small_bodies
        key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]
        note = json.dumps({"path": "notes/big.md", "content": ""})
        note = note.replace('""', '"' + "x" * (2048 - len(note)) + '"').encode()
        assert len(note) == 2048
        head = (
            f"POST {API}/notes HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Service-Key: {key}\r\n"
            "Content-Type: application/json\r\n"
        )
        request = f"{head}Content-Length: {len(note)}\r\n\r\n".encode() + note
        assert raw_http(server.port, request)[0] == 201
        small = b'{"path": "notes/chunked.md", "content": "hi"}'
        chunked = f"{head}Transfer-Encoding: chunked\r\n\r\n".encode()
        chunked += f"{len(small):x}\r\n".encode() + small + b"\r\n0\r\n\r\n"
        assert raw_http(server.port, chunked)[0] == 201

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_control_characters_in_the_path_are_escaped_in_the_log(self, tmp_path):
        with running(tmp_path) as server:
            status, _, _ = raw_http(
                server.port,
                b"GET /api/v1/x%0d%0aFORGED%20GET%20/ok%20200\x1b[2J HTTP/1.1\r\n"
                b"Host: 127.0.0.1\r\nX-Request-Id: edge-log-test-01\r\nConnection: close\r\n\r\n",
            )
            assert status == 404
            wait_for(lambda: any("edge-log-test-01" in line for line in server.lines))
            forged = [line for line in server.lines if "FORGED" in line]
            assert len(forged) == 1, forged
            assert "edge-log-test-01" in forged[0]
            assert "\\r\\nFORGED GET /ok 200\\x1b[2J" in forged[0]
            assert "\x1b" not in "".join(server.lines)

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_300_idle_connections_do_not_keep_the_owner_out(self, tmp_path, many_files):
        with running(tmp_path) as server:
            socks = []
            try:
                before = open_sockets(server.proc.pid)
                socks = hold_idle_connections(server.port, 300)
                wait_for(lambda: open_sockets(server.proc.pid) >= before + 300)  # all taken in
                status, seconds = timed_health(server.port)
                assert status == 200
                assert seconds < 1.0
            finally:
                for sock in socks:
                    sock.close()

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_a_flood_over_max_connections_closes_the_oldest_idle(self, tmp_path, many_files):
        with running(tmp_path, env={"SERVICE_MAX_CONNECTIONS": "50"}) as server:
            socks = []
            try:
                socks = hold_idle_connections(server.port, 80)
                wait_for(lambda: closed_by_peer(socks) >= 80 - 50)  # all taken in, room made
                status, seconds = timed_health(server.port)
                assert status == 200
                assert seconds < 1.0
                # The server made room by closing the oldest idle connections.
                closed = 0
                for sock in socks:
                    sock.settimeout(0.01)
                    with contextlib.suppress(TimeoutError, socket.timeout):
                        closed += sock.recv(1) == b""
                assert closed >= 80 - 50
                assert all(sock.recv(1) == b"" for sock in socks[:20]), "the oldest go first"
            finally:
                for sock in socks:
                    sock.close()

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_idle_connections_are_closed_after_the_idle_timeout(self, tmp_path):
        with running(tmp_path, env={"SERVICE_IDLE_TIMEOUT": "1"}) as server:
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            try:
                sock.sendall(b"GET /api/v1/health HTTP/1.1\r\n")
                started = time.monotonic()
                assert sock.recv(1) == b""  # closed by the server, not by our time-out
                assert time.monotonic() - started < 4
            finally:
                sock.close()


class TestServer:
    @pytest.mark.real_server
    @pytest.mark.slow
    def test_real_server_round_trip(self, tmp_path):
        with running(tmp_path) as server:
            # the banner's lines after "listening on" may still be on their way
            banner = wait_for(lambda: "key:" in "".join(server.lines) and "".join(server.lines))
            status, _, body = server.request("GET", f"{API}/system/setup")
            assert status == 200
            key = body["data"]["apiKey"]
            assert key not in banner  # stderr is no terminal here: the key stays off the log
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

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_falls_back_to_wsgiref_without_waitress(self, tmp_path):
        hidden = tmp_path / "no-waitress" / "waitress"  # found first, and fails as if absent
        hidden.mkdir(parents=True)
        (hidden / "__init__.py").write_text("raise ImportError('waitress is hidden here')\n")
        path = os.pathsep.join([str(hidden.parent), os.environ.get("PYTHONPATH", "")])
        proc = subprocess.Popen(
            [
                sys.executable,
                NOTESVC,
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--root",
                str(tmp_path / "root"),
            ],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "SERVICE_RESCAN_SECONDS": "0", "PYTHONPATH": path},
        )
        try:
            lines = []
            for line in proc.stderr:
                lines.append(line)
                m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
                if m:
                    break
            assert any("waitress is not installed" in line for line in lines)
            url = f"http://127.0.0.1:{m.group(1)}{API}/health"
            with urllib.request.urlopen(url, timeout=10) as resp:
                assert json.loads(resp.read())["data"]["status"] == "ok"
        finally:
            proc.terminate()
            proc.wait(10)
            proc.stderr.close()

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_busy_threads_say_so_once_not_per_request(self, tmp_path):
        """waitress warns "Task queue depth is N" for each request that finds every thread
        busy; the server says it once, with how many waited, until a minute has passed."""
        with running(tmp_path, env={"SERVICE_THREADS": "1"}) as server:

            def burst(_):
                for _ in range(15):
                    assert server.request("GET", f"{API}/health")[0] == 200

            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                list(pool.map(burst, range(16)))
            # every request's line is logged after any warning its wait made: once all are
            # in, a second warning would be too
            wait_for(lambda: sum(f"GET {API}/health 200" in x for x in server.lines) == 16 * 15)
            said = [x for x in server.lines if "waited for a free thread" in x]
            assert len(said) == 1
            assert "SERVICE_THREADS=1" in said[0]
            assert not [x for x in server.lines if "Task queue depth" in x]

    def test_queue_notice_counts_what_it_kept_quiet(self, caplog):
        notice = notesvc.QueueNotice(8)
        with caplog.at_level(logging.WARNING, logger="notesvc"):
            for depth in (1, 3, 2) * 40:
                notice.warning("Task queue depth is %d", depth)
            assert [r.getMessage() for r in caplog.records] == [
                "1 request(s) waited for a free thread (SERVICE_THREADS=8, at most 1 waiting) "
                "since the last such line; if answers are slow, raise it"
            ]
            notice.quiet_until = 0.0  # a minute later
            notice.warning("Task queue depth is %d")  # no depth given: counted as one
        assert (
            caplog.records[-1]
            .getMessage()
            .startswith(
                "120 request(s) waited for a free thread (SERVICE_THREADS=8, at most 3 waiting)"
            )
        )

    @pytest.mark.slow
    def test_module_app_is_built_on_first_use(self, tmp_path):
        code = "import notesvc; print(type(notesvc.app).__name__, notesvc.app is notesvc.app)"
        out = subprocess.run(
            [sys.executable, "-c", code],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            env={
                **os.environ,
                "PYTHONPATH": str(HERE),
                "SERVICE_NOTES_ROOT": str(tmp_path),
                "SERVICE_RESCAN_SECONDS": "0",
            },
            check=True,
        )
        assert out.stdout.split() == ["NotesApp", "True"]
        assert (tmp_path / ".notesvc" / "state.json").exists()

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_second_process_on_same_root_refuses(self, tmp_path):
        with running(tmp_path):
            out = run_cli("--root", str(tmp_path), "--port", "0", "--host", "127.0.0.1")
            assert out.returncode == 2
            assert "already serving" in out.stderr

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_sigterm_stops_cleanly(self, tmp_path):
        server = Server(tmp_path)
        try:
            server.proc.terminate()
            assert server.proc.wait(10) == 0
        finally:
            server.stop()
