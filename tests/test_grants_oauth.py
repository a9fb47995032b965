"""OAuth 2.1 for MCP clients (src/notesvc/grants.py)."""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import shutil
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import webtest

from conftest import (
    API,
    CALLBACK,
    Server,
    approve,
    as_key,
    assert_error,
    data,
    make_env,
    mcp_url,
    new_grant,
    notesvc,
    oauth_error,
    owner_headers,
    pkce_pair,
    post_oauth_form,
    register_client,
    relay_servers,
    running,
    token_call,
    tokens_for,
    wait_for,
    with_key,
)


class TestOAuth:
    def test_metadata_documents(self, anon):
        prm = anon.get("/.well-known/oauth-protected-resource").json
        assert prm == {
            "resource": "http://localhost:80/api/v1/mcp",
            "authorization_servers": ["http://localhost:80"],
            "scopes_supported": ["notes:read", "notes:write"],
            "bearer_methods_supported": ["header"],
            "resource_name": "notesvc",
        }
        assert anon.get("/.well-known/oauth-protected-resource/api/v1/mcp").json == prm
        asm = anon.get("/.well-known/oauth-authorization-server").json
        assert asm["issuer"] == "http://localhost:80"
        for name in ("authorize", "token", "register", "revoke"):
            key = {"authorize": "authorization_endpoint", "register": "registration_endpoint"}.get(
                name, f"{name if name != 'revoke' else 'revocation'}_endpoint"
            )
            assert asm[key] == f"http://localhost:80/oauth/{name}"
        assert asm["code_challenge_methods_supported"] == ["S256"]
        assert asm["token_endpoint_auth_methods_supported"] == ["none"]
        assert asm["grant_types_supported"] == ["authorization_code", "refresh_token"]
        assert asm["response_types_supported"] == ["code"]
        assert asm["client_id_metadata_document_supported"] is True
        assert anon.get("/.well-known/openid-configuration").json == asm

    def test_the_relay_prefix_has_its_own_issuer(self, anon):
        sid = anon.app.service.state.read()["serverId"]
        base = f"http://localhost:80/r/{sid}"
        asm = anon.get(f"/.well-known/oauth-authorization-server/r/{sid}").json
        assert asm["issuer"] == base
        assert asm["token_endpoint"] == f"{base}/oauth/token"
        prm = anon.get(f"/.well-known/oauth-protected-resource/r/{sid}/api/v1/mcp").json
        assert prm["resource"] == f"{base}/api/v1/mcp"
        assert prm["authorization_servers"] == [base]
        assert anon.get(f"/.well-known/openid-configuration/r/{sid}").json == asm
        assert_error(
            anon.get("/.well-known/oauth-authorization-server/r/someoneelse", status=404),
            404,
            "NOT_FOUND",
        )

    def test_public_url_is_the_issuer(self, make_app):
        app = make_app(SERVICE_PUBLIC_URL="https://notes.example.org")
        assert app.get("/.well-known/oauth-authorization-server").json["issuer"] == (
            "https://notes.example.org"
        )

    def test_registration(self, anon):
        reg = register_client(anon, [CALLBACK, "https://claude.ai/api/mcp/auth_callback"])
        assert reg["client_id"].startswith("mcp_")
        assert reg["token_endpoint_auth_method"] == "none"
        assert reg["redirect_uris"] == [CALLBACK, "https://claude.ai/api/mcp/auth_callback"]
        assert reg["client_name"] == "Pocket assistant"
        secret = register_client(anon, token_endpoint_auth_method="client_secret_basic")
        assert secret["token_endpoint_auth_method"] == "none"
        assert "client_secret" not in secret

    @pytest.mark.parametrize(
        ("body", "error"),
        [
            ({}, "invalid_redirect_uri"),
            ({"redirect_uris": []}, "invalid_redirect_uri"),
            ({"redirect_uris": "https://a.example/cb"}, "invalid_redirect_uri"),
            ({"redirect_uris": ["http://evil.example/cb"]}, "invalid_redirect_uri"),
            ({"redirect_uris": ["http://10.0.0.5/cb"]}, "invalid_redirect_uri"),
            ({"redirect_uris": ["javascript:alert(1)"]}, "invalid_redirect_uri"),
            ({"redirect_uris": ["myapp://callback"]}, "invalid_redirect_uri"),
            ({"redirect_uris": ["https://a.example/cb#frag"]}, "invalid_redirect_uri"),
            ({"redirect_uris": ["https://user:pw@a.example/cb"]}, "invalid_redirect_uri"),
            ({"redirect_uris": ["https://a.example/c b"]}, "invalid_redirect_uri"),
            ({"redirect_uris": ["https://a.example/" + "x" * 2000]}, "invalid_redirect_uri"),
            (
                {"redirect_uris": [f"https://a.example/{i}" for i in range(11)]},
                "invalid_redirect_uri",
            ),
            (
                {"redirect_uris": [CALLBACK], "grant_types": ["client_credentials"]},
                "invalid_client_metadata",
            ),
            ({"redirect_uris": [CALLBACK], "response_types": ["token"]}, "invalid_client_metadata"),
            ({"redirect_uris": [CALLBACK], "client_name": ["x"]}, "invalid_client_metadata"),
        ],
    )
    @pytest.mark.slow
    def test_bad_registrations(self, anon, body, error):
        resp = anon.post_json("/oauth/register", body, status=400)
        oauth_error(resp, 400, error)

    def test_broken_registration_bodies(self, anon):
        resp = anon.post("/oauth/register", "{", {"Content-Type": "application/json"}, status=400)
        oauth_error(resp, 400, "invalid_client_metadata")
        resp = anon.post("/oauth/register", "[1]", {"Content-Type": "application/json"}, status=400)
        oauth_error(resp, 400, "invalid_client_metadata")
        resp = anon.post("/oauth/register", "x=1", status=415)
        oauth_error(resp, 415, "invalid_client_metadata")
        huge = json.dumps({"redirect_uris": [CALLBACK], "client_name": "x" * 70000})
        resp = anon.post("/oauth/register", huge, {"Content-Type": "application/json"}, status=413)
        oauth_error(resp, 413, "invalid_client_metadata")

    @pytest.mark.slow
    def test_a_registration_flood_stops_at_the_cap(self, anon):
        one = webtest.TestApp(anon.app, extra_environ={"REMOTE_ADDR": "198.51.100.200"})
        body = {"redirect_uris": [CALLBACK]}
        statuses = [
            one.post_json("/oauth/register", body, status="*").status_int for _ in range(11)
        ]
        assert statuses == [201] * 10 + [429]
        for i in range(notesvc.MAX_OAUTH_CLIENTS):  # from many addresses, up to the cap
            app = webtest.TestApp(
                anon.app, extra_environ={"REMOTE_ADDR": f"10.9.{i // 200}.{i % 200}"}
            )
            app.post_json("/oauth/register", body, status="*")
        resp = webtest.TestApp(anon.app, extra_environ={"REMOTE_ADDR": "10.8.0.1"}).post_json(
            "/oauth/register", body, status=503
        )
        oauth_error(resp, 503, "temporarily_unavailable")
        assert len(anon.app.service.state.read()["oauthClients"]) == notesvc.MAX_OAUTH_CLIENTS

    @pytest.mark.slow
    def test_at_the_cap_old_never_used_clients_give_way(self, anon, root):
        for i in range(notesvc.MAX_OAUTH_CLIENTS):
            register_client(anon, addr=f"10.7.{i // 200}.{i % 200}")
        state_file = root / ".notesvc" / "state.json"
        state = json.loads(state_file.read_text())
        oldest = sorted(state["oauthClients"])[0]
        state["oauthClients"][oldest]["createdAt"] = notesvc.iso(time.time() - 7200)
        state_file.write_text(json.dumps(state))
        register_client(anon, addr="10.6.0.1")
        clients = anon.app.service.state.read()["oauthClients"]
        assert len(clients) == notesvc.MAX_OAUTH_CLIENTS
        assert oldest not in clients

    def test_consent_facts_for_a_good_request(self, anon):
        cid = register_client(anon)["client_id"]
        _, challenge = pkce_pair()
        q = urllib.parse.urlencode(
            {
                "client_id": cid,
                "redirect_uri": "http://127.0.0.1:53682/callback",  # loopback: any port
                "response_type": "code",
                "code_challenge": challenge,
                "code_challenge_method": "S256",
                "state": "abc",
                "scope": "notes:read notes:write",
                "resource": mcp_url(anon),
            }
        )
        d = data(anon.get(f"{API}/oauth/consent?{q}"))
        assert d["client"] == {"id": cid, "name": "Pocket assistant", "uri": ""}
        assert d["redirectHost"] == "127.0.0.1:53682"
        assert d["scope"] == "read"
        assert d["writeAllowed"] is False
        deny = urllib.parse.urlsplit(d["deny"])
        assert deny.netloc == "127.0.0.1:53682"
        assert urllib.parse.parse_qs(deny.query)["error"] == ["access_denied"]
        assert urllib.parse.parse_qs(deny.query)["state"] == ["abc"]

    @pytest.mark.parametrize(
        ("client_id", "redirect", "status"),
        [
            ("mcp_unknown", CALLBACK, 404),
            ("", CALLBACK, 400),
            (None, "http://127.0.0.1:9/other", 400),  # not registered
            (None, "https://evil.example/callback", 400),
            (None, "http://evil.example/callback", 400),  # http off loopback
            (None, "", 400),
            ("https://127.0.0.1/client.json", CALLBACK, 400),
        ],
    )
    def test_a_bad_client_or_redirect_is_shown_never_redirected(
        self, client, anon, client_id, redirect, status
    ):
        cid = register_client(anon)["client_id"] if client_id is None else client_id
        _, challenge = pkce_pair()
        q = urllib.parse.urlencode(
            {
                "client_id": cid,
                "redirect_uri": redirect,
                "response_type": "code",
                "code_challenge": challenge,
                "code_challenge_method": "S256",
            }
        )
        resp = anon.get(f"{API}/oauth/consent?{q}", status=status)
        err = assert_error(resp, status, "NOT_FOUND" if status == 404 else "VALIDATION_ERROR")
        assert "redirect" not in err
        body = {
            "clientId": cid,
            "redirectUri": redirect,
            "codeChallenge": challenge,
            "scope": "notes:read",
        }
        refused = client.post_json(f"{API}/oauth/approve", body, status=status)
        assert "redirect" not in refused.json["error"]

    @pytest.mark.parametrize(
        ("change", "problem"),
        [
            ({"response_type": "token"}, "response_type"),
            ({"code_challenge_method": "plain"}, "S256"),
            ({"code_challenge": "short"}, "code_challenge"),
            ({"code_challenge": None}, "code_challenge"),
            ({"resource": "https://elsewhere.example/mcp"}, "resource"),
        ],
    )
    def test_other_problems_go_back_to_the_client(self, anon, change, problem):
        cid = register_client(anon)["client_id"]
        _, challenge = pkce_pair()
        params = {
            "client_id": cid,
            "redirect_uri": CALLBACK,
            "response_type": "code",
            "code_challenge": challenge,
            "code_challenge_method": "S256",
            "state": "s1",
        }
        params.update(change)
        q = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        err = assert_error(
            anon.get(f"{API}/oauth/consent?{q}", status=400), 400, "VALIDATION_ERROR"
        )
        assert problem in err["message"]
        back = urllib.parse.urlsplit(err["redirect"])
        assert back.netloc == "127.0.0.1:9"
        assert urllib.parse.parse_qs(back.query)["error"] == ["invalid_request"]
        assert urllib.parse.parse_qs(back.query)["state"] == ["s1"]

    def test_write_is_offered_only_while_mcp_writes_are_on(self, make_app):
        app = make_app(SERVICE_MCP_WRITE="true")
        client = with_key(app)
        cid = register_client(app)["client_id"]
        _, challenge = pkce_pair()
        q = urllib.parse.urlencode(
            {
                "client_id": cid,
                "redirect_uri": CALLBACK,
                "response_type": "code",
                "code_challenge": challenge,
                "code_challenge_method": "S256",
                "scope": "notes:read notes:write",
            }
        )
        facts = data(app.get(f"{API}/oauth/consent?{q}"))
        assert (facts["writeAllowed"], facts["scope"]) == (True, "write")
        code, verifier, _ = approve(client, cid, "notes:read notes:write")
        answer = token_call(
            app,
            200,
            grant_type="authorization_code",
            code=code,
            client_id=cid,
            redirect_uri=CALLBACK,
            code_verifier=verifier,
        ).json
        assert answer["scope"] == "notes:read notes:write"
        assert data(client.get(f"{API}/auth/keys"))["keys"][0]["scope"] == "write"

    def test_approval_needs_the_api_key(self, client, anon):
        cid = register_client(anon)["client_id"]
        _, challenge = pkce_pair()
        body = {
            "clientId": cid,
            "redirectUri": CALLBACK,
            "codeChallenge": challenge,
            "scope": "notes:read",
        }
        assert_error(anon.post_json(f"{API}/oauth/approve", body, status=401), 401, "UNAUTHORIZED")
        writer = as_key(client, new_grant(client, "write")["key"])
        assert_error(writer.post_json(f"{API}/oauth/approve", body, status=403), 403, "FORBIDDEN")
        write = {**body, "scope": "notes:read notes:write"}
        assert_error(client.post_json(f"{API}/oauth/approve", write, status=403), 403, "FORBIDDEN")
        for bad in (
            {"codeChallenge": "x"},
            {"scope": "admin"},
            {"folder": "../x"},
            {"resource": "https://elsewhere.example/mcp"},
            {"state": "s" * 1025},
        ):
            resp = client.post_json(f"{API}/oauth/approve", {**body, **bad}, status=400)
            assert_error(resp, 400, "VALIDATION_ERROR")

    def test_the_whole_flow(self, client, anon):
        cid = register_client(anon)["client_id"]
        code, verifier, query = approve(client, cid, folder="notes/family")
        assert query["state"] == ["st8"]
        assert query["iss"] == ["http://localhost:80"]
        assert code.startswith("nsc_")
        answer = token_call(
            anon,
            200,
            grant_type="authorization_code",
            code=code,
            client_id=cid,
            redirect_uri=CALLBACK,
            code_verifier=verifier,
            resource=mcp_url(anon),
        )
        assert answer.headers["Cache-Control"] == "no-store"
        t = answer.json
        assert t["token_type"] == "Bearer"
        assert t["expires_in"] == 3600
        assert t["scope"] == "notes:read"
        assert t["access_token"].startswith("nsa_")
        assert t["refresh_token"].startswith("nsr_")
        grants = data(client.get(f"{API}/auth/keys"))["keys"]
        assert grants == [
            {
                "id": grants[0]["id"],
                "kind": "oauth",
                "name": "Pocket assistant",
                "scope": "read",
                "folder": "notes/family",
                "createdAt": grants[0]["createdAt"],
                "expiresAt": grants[0]["expiresAt"],
                "lastUsedAt": None,
                "createdBy": "owner",
                "client": {"id": cid, "name": "Pocket assistant"},
            }
        ]
        state = json.dumps(client.app.service.state.read())
        assert t["access_token"] not in state
        assert t["refresh_token"] not in state
        assert data(client.get(f"{API}/security/config"))["grants"]["oauth"] == 1

    def test_an_oauth_token_on_the_rest_api_is_401(self, client, anon):
        _, t = tokens_for(client, anon)
        bearer = webtest.TestApp(
            anon.app, extra_environ={"HTTP_AUTHORIZATION": f"Bearer {t['access_token']}"}
        )
        for url in (f"{API}/notes", f"{API}/auth/verify", f"{API}/search?q=x"):
            resp = bearer.request(
                url, method="POST" if "verify" in url else "GET", expect_errors=True
            )
            err = assert_error(resp, 401, "UNAUTHORIZED")
            assert "mcp" in err["message"]
        header = as_key(anon, t["access_token"])
        assert_error(header.get(f"{API}/notes", status=401), 401, "UNAUTHORIZED")

    def test_a_code_is_single_use_and_a_replay_revokes_its_tokens(self, client, anon):
        cid = register_client(anon)["client_id"]
        code, verifier, _ = approve(client, cid)
        form = dict(
            grant_type="authorization_code",
            code=code,
            client_id=cid,
            redirect_uri=CALLBACK,
            code_verifier=verifier,
        )
        first = token_call(anon, 200, **form).json
        oauth_error(token_call(anon, **form), 400, "invalid_grant")
        assert data(client.get(f"{API}/auth/keys"))["keys"] == []  # revoked
        refresh = dict(
            grant_type="refresh_token", refresh_token=first["refresh_token"], client_id=cid
        )
        oauth_error(token_call(anon, **refresh), 400, "invalid_grant")

    def test_an_expired_code_is_refused(self, client, anon):
        cid = register_client(anon)["client_id"]
        code, verifier, _ = approve(client, cid)
        for entry in client.app.service.grants.codes.values():
            entry["expires"] = time.time() - 1  # 60 s have passed
        oauth_error(
            token_call(
                anon,
                grant_type="authorization_code",
                code=code,
                client_id=cid,
                redirect_uri=CALLBACK,
                code_verifier=verifier,
            ),
            400,
            "invalid_grant",
        )

    @pytest.mark.parametrize(
        ("change", "error"),
        [
            ({"code_verifier": "x" * 43}, "invalid_grant"),
            ({"code_verifier": ""}, "invalid_grant"),
            ({"client_id": "mcp_other"}, "invalid_grant"),
            ({"redirect_uri": "http://127.0.0.1:9/other"}, "invalid_grant"),
            ({"redirect_uri": "http://127.0.0.1:10/callback"}, "invalid_grant"),
            ({"code": "nsc_" + "A" * 43}, "invalid_grant"),
            ({"code": ""}, "invalid_grant"),
            ({"resource": "https://elsewhere.example/api/v1/mcp"}, "invalid_target"),
            ({"grant_type": "password"}, "unsupported_grant_type"),
            ({"grant_type": "client_credentials"}, "unsupported_grant_type"),
            ({"grant_type": ""}, "invalid_request"),
        ],
    )
    def test_a_code_redeemed_wrongly_is_refused_and_spent(self, client, anon, change, error):
        cid = register_client(anon)["client_id"]
        code, verifier, _ = approve(client, cid)
        form = dict(
            grant_type="authorization_code",
            code=code,
            client_id=cid,
            redirect_uri=CALLBACK,
            code_verifier=verifier,
        )
        oauth_error(token_call(anon, **{**form, **change}), 400, error)
        if "code" not in change and "grant_type" not in change:  # spent: the right try fails too
            oauth_error(token_call(anon, **form), 400, "invalid_grant")

    def test_token_requests_must_be_forms(self, anon):
        resp = anon.post_json("/oauth/token", {"grant_type": "authorization_code"}, status=400)
        oauth_error(resp, 400, "invalid_request")
        resp = anon.post("/oauth/token", "grant_type=a&grant_type=b", status=400)
        oauth_error(resp, 400, "invalid_request")
        resp = anon.post("/oauth/token", b"grant_type=\xff", status=400)
        oauth_error(resp, 400, "invalid_request")
        resp = anon.post("/oauth/token", "x=" + "y" * 70000, status=413)
        oauth_error(resp, 413, "invalid_request")
        resp = anon.post("/oauth/token", "&".join(f"k{i}=v" for i in range(100)), status=400)
        oauth_error(resp, 400, "invalid_request")

    def test_refresh_rotates_and_reuse_revokes_the_grant(self, client, anon):
        cid, first = tokens_for(client, anon)
        form = dict(
            grant_type="refresh_token",
            refresh_token=first["refresh_token"],
            client_id=cid,
            resource=mcp_url(anon),
        )
        second = token_call(anon, 200, **form).json
        assert second["refresh_token"] != first["refresh_token"]
        assert second["access_token"] != first["access_token"]
        assert second["scope"] == "notes:read"
        svc = anon.app.service
        assert svc.grants.principal(first["access_token"]) is None  # the old access token ends
        assert svc.grants.principal(second["access_token"]).kind == "oauth"
        oauth_error(token_call(anon, **form), 400, "invalid_grant")  # the first one, again
        assert svc.grants.principal(second["access_token"]) is None  # the grant is gone
        again = dict(form, refresh_token=second["refresh_token"])
        oauth_error(token_call(anon, **again), 400, "invalid_grant")
        assert data(client.get(f"{API}/auth/keys"))["keys"] == []

    @pytest.mark.parametrize(
        ("change", "error"),
        [
            ({"client_id": "mcp_other"}, "invalid_grant"),
            ({"client_id": ""}, "invalid_request"),
            ({"resource": "https://elsewhere.example/mcp"}, "invalid_target"),
            ({"scope": "notes:read notes:write"}, "invalid_scope"),
            ({"refresh_token": "nsr_unknown"}, "invalid_grant"),
        ],
    )
    def test_bad_refreshes(self, client, anon, change, error):
        cid, first = tokens_for(client, anon)
        form = dict(grant_type="refresh_token", refresh_token=first["refresh_token"], client_id=cid)
        oauth_error(token_call(anon, **{**form, **change}), 400, error)
        token_call(anon, 200, **form)  # a refused refresh spends nothing

    def test_revocation(self, client, anon):
        cid, t = tokens_for(client, anon)
        svc = anon.app.service
        resp = anon.post("/oauth/revoke", {"token": t["access_token"], "client_id": "mcp_other"})
        assert resp.status_int == 200
        assert svc.grants.principal(t["access_token"]) is not None
        assert (
            anon.post("/oauth/revoke", {"token": t["refresh_token"], "client_id": cid}).json == {}
        )
        assert svc.grants.principal(t["access_token"]) is None
        assert anon.post("/oauth/revoke", {"token": "nsa_unknown"}).status_int == 200
        oauth_error(anon.post("/oauth/revoke", {}, status=400), 400, "invalid_request")
        refresh = dict(grant_type="refresh_token", refresh_token=t["refresh_token"], client_id=cid)
        oauth_error(token_call(anon, **refresh), 400, "invalid_grant")

    def test_the_owner_revokes_an_oauth_grant_like_a_key(self, client, anon):
        _, t = tokens_for(client, anon)
        gid = data(client.get(f"{API}/auth/keys"))["keys"][0]["id"]
        client.delete(f"{API}/auth/keys/{gid}", status=200)
        assert anon.app.service.grants.principal(t["access_token"]) is None

    def test_the_consent_page_cannot_be_framed(self, anon):
        sid = anon.app.service.state.read()["serverId"]
        for url in ("/oauth/authorize?client_id=x", f"/r/{sid}/oauth/authorize"):
            resp = anon.get(url)
            assert resp.content_type == "text/html"
            assert resp.headers["X-Frame-Options"] == "DENY"
            csp = dict(
                d.strip().split(" ", 1) for d in resp.headers["Content-Security-Policy"].split(";")
            )
            assert csp["frame-ancestors"] == "'none'"
            assert csp["connect-src"] == "'self'"
            assert csp["form-action"] == "'none'"
            assert resp.headers["Referrer-Policy"] == "no-referrer"
            assert resp.body == notesvc.consent_page().encode()


class LocalTls:
    """A loopback HTTPS stand-in for a client's metadata host (a self-signed certificate).

    `routes`: path -> (status, headers, body, seconds to stall before the body[, seconds
    between the body's bytes]).
    """

    def __init__(self, tmp: Path):
        if not shutil.which("openssl"):
            pytest.skip("openssl is needed to make a test certificate")
        cert, key = tmp / "cert.pem", tmp / "key.pem"
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "1",
                "-subj",
                "/CN=localhost",
                "-addext",
                "subjectAltName=DNS:localhost",
                "-keyout",
                str(key),
                "-out",
                str(cert),
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        self.context = ssl.create_default_context(cafile=str(cert))
        self.routes: dict = {}
        tls = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                status, headers, body, pause, *drip = tls.routes.get(self.path, (404, {}, b"", 0))
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if pause:
                    time.sleep(pause)
                with contextlib.suppress(OSError):
                    for part in [body[i : i + 1] for i in range(len(body))] if drip else [body]:
                        self.wfile.write(part)
                        self.wfile.flush()
                        time.sleep(drip[0] if drip else 0)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server_ctx.load_cert_chain(str(cert), str(key))
        self.httpd.socket = server_ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        ).start()

    def url(self, path: str) -> str:
        return f"https://localhost:{self.port}{path}"

    @staticmethod
    def loopback(host, port, **kwargs) -> list:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]

    def fetch(self, path: str, **kwargs) -> dict:
        """fetch_client_metadata with this loopback host counted as public."""
        return notesvc.fetch_client_metadata(
            self.url(path),
            resolve=self.loopback,
            allow=lambda ip: True,
            context=self.context,
            **kwargs,
        )

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


class TestClientMetadataDocuments:
    @pytest.mark.parametrize(
        "url",
        [
            "https://127.0.0.1/client.json",
            "https://127.8.9.10:8443/client.json",
            "https://10.1.2.3/client.json",
            "https://192.168.1.20/client.json",
            "https://172.16.5.5/client.json",
            "https://169.254.169.254/latest/meta-data",
            "https://[::1]/client.json",
            "https://[::ffff:127.0.0.1]/client.json",
            "https://[fe80::1]/client.json",
            "https://224.0.0.1/client.json",
            "https://0.0.0.0/client.json",
            "https://localhost/client.json",
        ],
    )
    @pytest.mark.slow
    def test_private_and_loopback_hosts_are_refused(self, anon, url):
        _, challenge = pkce_pair()
        q = urllib.parse.urlencode(
            {
                "client_id": url,
                "redirect_uri": CALLBACK,
                "response_type": "code",
                "code_challenge": challenge,
                "code_challenge_method": "S256",
            }
        )
        err = assert_error(
            anon.get(f"{API}/oauth/consent?{q}", status=400), 400, "VALIDATION_ERROR"
        )
        assert "not a public address" in err["message"]
        with pytest.raises(ValueError, match="not a public address"):
            notesvc.fetch_client_metadata(url)

    @pytest.mark.parametrize(
        "url",
        [
            "http://client.example/c.json",
            "https://client.example",
            "https://client.example/",
            "https://u:p@client.example/c.json",
            "https://client.example/c.json#x",
            "ftp://x/y",
        ],
    )
    def test_only_https_urls_with_a_path(self, url):
        with pytest.raises(ValueError, match="https"):
            notesvc.fetch_client_metadata(url)

    def test_a_public_address_is_fine_and_a_private_one_not(self):
        import ipaddress

        assert notesvc.public_address(ipaddress.ip_address("93.184.216.34"))
        assert notesvc.public_address(ipaddress.ip_address("2606:4700::6810:84e5"))
        for ip in ("100.64.0.1", "198.18.0.1", "fc00::1", "::ffff:10.0.0.1", "255.255.255.255"):
            assert not notesvc.public_address(ipaddress.ip_address(ip)), ip

    @pytest.mark.slow
    def test_fetching_safely(self, tmp_path):
        tls = LocalTls(tmp_path)
        doc = {
            "client_id": tls.url("/app.json"),
            "client_name": "Meta",
            "redirect_uris": [CALLBACK],
        }
        tls.routes.update(
            {
                "/app.json": (
                    200,
                    {"Content-Type": "application/json"},
                    json.dumps(doc).encode(),
                    0,
                ),
                "/moved": (302, {"Location": tls.url("/app.json")}, b"", 0),
                "/big": (200, {}, b"{" + b" " * 70000 + b"}", 0),
                "/slow": (200, {}, b"{}", 2),
                "/drip": (200, {}, b"{" + b" " * 60 + b"}", 0, 0.1),  # never a read time-out
                "/list": (200, {}, b"[]", 0),
                "/text": (200, {}, b"hello", 0),
                "/gone": (410, {}, b"", 0),
            }
        )
        try:
            assert tls.fetch("/app.json") == doc
            with pytest.raises(ValueError, match="redirect"):
                tls.fetch("/moved")
            with pytest.raises(ValueError, match="over 65536 bytes"):
                tls.fetch("/big")
            started = time.monotonic()
            with pytest.raises(ValueError, match=r"timed out|took over"):
                tls.fetch("/slow", timeout=0.5)
            assert time.monotonic() - started < 2
            started = time.monotonic()  # a byte now and then: the whole fetch is timed
            with pytest.raises(ValueError, match=r"took over 0\.5 s"):
                tls.fetch("/drip", timeout=0.5)
            assert time.monotonic() - started < 2
            with pytest.raises(ValueError, match="not a JSON object"):
                tls.fetch("/list")
            with pytest.raises(ValueError, match="not JSON"):
                tls.fetch("/text")
            with pytest.raises(ValueError, match="HTTP 410"):
                tls.fetch("/gone")
            with pytest.raises(ValueError, match="could not be fetched"):  # an unknown certificate
                notesvc.fetch_client_metadata(
                    tls.url("/app.json"), resolve=tls.loopback, allow=lambda ip: True
                )
        finally:
            tls.close()

    def test_a_metadata_client_is_used_and_cached(self, root, tmp_path):
        svc = notesvc.build_service(notesvc.load_config(env=make_env(root)))
        calls = []
        url = "https://app.example/oauth/client.json"

        def fetch(u):
            calls.append(u)
            return {"client_id": u, "client_name": "Meta\x07 app", "redirect_uris": [CALLBACK]}

        try:
            client = svc.grants.client(url, fetch=fetch)
            assert client == {"id": url, "name": "Meta app", "redirectUris": [CALLBACK], "uri": ""}
            assert svc.grants.client(url, fetch=fetch) == client
            assert calls == [url]
            bad_documents = {
                url + "1": {
                    "client_id": "https://other.example/c.json",
                    "redirect_uris": [CALLBACK],
                },
                url + "2": {"client_id": url + "2", "redirect_uris": ["http://evil.example/cb"]},
                url + "3": {"client_id": url + "3"},
            }
            for bad_url, doc in bad_documents.items():
                with pytest.raises(notesvc.OAuthError) as e:
                    svc.grants.client(bad_url, fetch=lambda u, doc=doc: doc)
                assert e.value.error == "invalid_client"
        finally:
            svc.close()


def sdk_oauth_session(mcp_url: str, key: str, steps, scope: str = "notes:read"):
    """Run `steps(session, provider)` in an official MCP SDK session that authorises itself
    with the SDK's OAuth client (mcp.client.auth): it registers, is sent to the consent
    page, where the owner's approval is given with the key (POST /api/v1/oauth/approve, as
    the page does), and redeems the code. Returns (steps' result, transcript, storage)."""
    import asyncio

    auth = pytest.importorskip("mcp.client.auth")
    shared = pytest.importorskip("mcp.shared.auth")
    client_module = pytest.importorskip("mcp.client.client")
    transport = pytest.importorskip("mcp.client.streamable_http")
    httpx2 = pytest.importorskip("httpx2")
    transcript: list = []
    approved: dict = {}

    class Storage(auth.TokenStorage):
        tokens = client = None

        async def get_tokens(self):
            return self.tokens

        async def set_tokens(self, tokens):
            self.tokens = tokens

        async def get_client_info(self):
            return self.client

        async def set_client_info(self, client):
            self.client = client

    def approve_as_owner(url: str) -> None:
        ask = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(url).query))
        api = url.split("/oauth/authorize")[0] + API
        body = {
            "clientId": ask["client_id"],
            "redirectUri": ask["redirect_uri"],
            "state": ask["state"],
            "codeChallenge": ask["code_challenge"],
            "scope": scope,
            "resource": ask["resource"],
        }
        req = urllib.request.Request(
            f"{api}/oauth/approve",
            json.dumps(body).encode(),
            {"Content-Type": "application/json", "X-Service-Key": key},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            redirect = json.loads(resp.read())["data"]["redirect"]
        approved.update(urllib.parse.parse_qsl(urllib.parse.urlsplit(redirect).query))
        transcript.append(f"consent: {ask['client_id']} asked {ask.get('scope')}; approved {scope}")

    async def redirect_handler(url: str) -> None:
        transcript.append(f"authorize: {url.split('?')[0]}")
        await asyncio.get_running_loop().run_in_executor(None, approve_as_owner, url)

    async def callback_handler():
        return shared.AuthorizationCodeResult(
            code=approved["code"], state=approved.get("state"), iss=approved.get("iss")
        )

    async def record(response) -> None:
        request = response.request
        transcript.append(f"{request.method} {request.url} -> {response.status_code}")

    storage = Storage()
    provider = auth.OAuthClientProvider(
        server_url=mcp_url,
        client_metadata=shared.OAuthClientMetadata(
            client_name="notesvc SDK test", redirect_uris=[CALLBACK]
        ),
        storage=storage,
        redirect_handler=redirect_handler,
        callback_handler=callback_handler,
    )

    async def main():
        async with httpx2.AsyncClient(
            auth=provider, timeout=30, event_hooks={"response": [record]}
        ) as http:
            connection = transport.streamable_http_client(mcp_url, http_client=http)
            async with client_module.Client(connection, mode="legacy") as session:
                return await steps(session, provider)

    return asyncio.run(main()), transcript, storage


def mcp_with_token(url: str, token: str) -> tuple:
    """POST tools/list with a bearer token; return (status, headers)."""
    body = json.dumps({"jsonrpc": "2.0", "id": 9, "method": "tools/list"}).encode()
    req = urllib.request.Request(
        url,
        body,
        {
            "Content-Type": "application/json",
            "Authorization": f"Bearer {token}",
            "MCP-Protocol-Version": "2025-11-25",
        },
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.headers
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.headers


class TestSdkOAuth:
    """The official MCP SDK's OAuth client is the judge: directly and through a real relay."""

    pytestmark = [pytest.mark.real_server, pytest.mark.slow]

    def session(self, mcp_url: str, key: str):
        async def steps(session, provider):
            tools = [t.name for t in (await session.list_tools()).tools]
            hit = await session.call_tool("search_notes", {"query": "tomatoes"})
            first = provider.context.current_tokens
            provider.context.token_expiry_time = time.time() - 1  # the hour is up: refresh
            again = await session.call_tool("read_note", {"path": "notes/garden.md"})
            return tools, hit, first, provider.context.current_tokens, again

        return sdk_oauth_session(mcp_url, key, steps)

    def check(self, mcp_url: str, key: str, log_to: Path):
        (tools, hit, first, second, again), transcript, _ = self.session(mcp_url, key)
        (log_to / "sdk-oauth-transcript.txt").write_text("\n".join(transcript) + "\n")
        assert set(tools) == {n for n, t in notesvc.TOOLS.items() if t.read_only}
        assert hit.is_error is False
        assert hit.structured_content["results"][0]["path"] == "notes/garden.md"
        assert again.structured_content["content"].startswith("# Garden")
        assert second.refresh_token != first.refresh_token  # rotated
        assert second.access_token != first.access_token
        steps = [line.split(" -> ")[0].split(" ", 1)[-1] for line in transcript]
        base, path = mcp_url.split("/api/v1/mcp")[0], urllib.parse.urlsplit(mcp_url).path
        origin = (
            f"{urllib.parse.urlsplit(mcp_url).scheme}://{urllib.parse.urlsplit(mcp_url).netloc}"
        )
        issuer_path = urllib.parse.urlsplit(base).path
        for expected in (
            mcp_url,
            f"{origin}/.well-known/oauth-protected-resource{path}",
            f"{origin}/.well-known/oauth-authorization-server{issuer_path}",
            f"{base}/oauth/register",
            f"{base}/oauth/token",
        ):
            assert expected in steps, (expected, transcript)
        assert f"POST {mcp_url} -> 401" in transcript
        assert sum(s == f"{base}/oauth/token" for s in steps) == 2  # the code, then a refresh
        # Revocation: the grant ends; the MCP endpoint answers 401 with the challenge.
        status, answer = post_oauth_form(f"{base}/oauth/revoke", {"token": second.refresh_token})
        assert (status, answer) == (200, {})
        status, headers = mcp_with_token(mcp_url, second.access_token)
        assert status == 401
        assert headers["WWW-Authenticate"] == (
            f'Bearer resource_metadata="{origin}/.well-known/oauth-protected-resource{path}", '
            'scope="notes:read", error="invalid_token"'
        )
        status, _ = mcp_with_token(mcp_url, first.access_token)
        assert status == 401
        return transcript

    def test_the_sdk_authorises_itself_directly(self, tmp_path):
        with running(tmp_path / "srv") as server:
            setup = server.request("GET", f"{API}/system/setup")[2]["data"]
            server.request(
                "POST",
                f"{API}/notes",
                {"path": "notes/garden.md", "content": "# Garden\n\nPlant tomatoes in May."},
                owner_headers(setup),
            )
            self.check(f"{server.url}{API}/mcp", setup["apiKey"], tmp_path)
            _, _, keys = server.request("GET", f"{API}/auth/keys", headers=owner_headers(setup))
            assert keys["data"]["keys"] == []  # revoked

    def test_the_sdk_authorises_itself_through_a_relay(self, tmp_path):
        relay = Server(tmp_path / "relay", "relay", env={"SERVICE_RELAY_TIMEOUT": "10"})
        try:
            with running(tmp_path / "srv", env={"SERVICE_RELAY_URL": relay.url}) as server:
                wait_for(lambda: relay_servers(relay) == 1)
                setup = server.request("GET", f"{API}/system/setup")[2]["data"]
                server.request(
                    "POST",
                    f"{API}/notes",
                    {"path": "notes/garden.md", "content": "# Garden\n\nPlant tomatoes in May."},
                    owner_headers(setup),
                )
                url = setup["links"]["relayApiBase"] + "/mcp"
                assert url.startswith(f"{relay.url}/r/")
                transcript = self.check(url, setup["apiKey"], tmp_path)
                assert all(
                    line.startswith(("consent", "authorize")) or relay.url in line
                    for line in transcript
                )
        finally:
            relay.stop()
