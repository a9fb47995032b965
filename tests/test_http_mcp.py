"""MCP over HTTP: JSON-RPC and the official SDK (src/notesvc/http/mcp.py)."""

from __future__ import annotations

import json
import re

import pytest
import webtest

from conftest import (
    API,
    FOLDER_NOTES,
    Server,
    _boom,
    as_key,
    assert_error,
    audit,
    call_tool,
    data,
    ids,
    inside_family,
    key_of,
    listed_tools,
    make_env,
    new_grant,
    notesvc,
    ok_tool,
    paths_in,
    put_note,
    raw_http,
    relay_servers,
    rpc,
    running,
    tmp_path_factory_root,
    tokens_for,
    tool_refused,
    wait_for,
    with_key,
    with_status,
)
from standins import ToolModel, last_tool_results, seed_notes


def bearer(app: webtest.TestApp, token: str) -> webtest.TestApp:
    return webtest.TestApp(app.app, extra_environ={"HTTP_AUTHORIZATION": f"Bearer {token}"})


MODERN = "2026-07-28"


def modern_meta(version: str = MODERN) -> dict:
    return {
        "io.modelcontextprotocol/protocolVersion": version,
        "io.modelcontextprotocol/clientCapabilities": {},
        "io.modelcontextprotocol/clientInfo": {"name": "test", "version": "1"},
    }


def modern(client, method, params=None, status="*", headers=None, version=MODERN, **extra):
    """POST one 2026-07-28 request (its _meta and headers filled in); return the response."""
    params = {"_meta": modern_meta(version), **(params or {})}
    hdrs = {
        "Content-Type": "application/json",
        "MCP-Protocol-Version": version,
        "Mcp-Method": method,
    }
    if method == "tools/call":
        hdrs["Mcp-Name"] = params.get("name", "")
    hdrs.update(headers or {})
    body = {"jsonrpc": "2.0", "id": "m-1", "method": method, "params": params, **extra}
    resp = client.post(f"{API}/mcp", json.dumps(body), headers=hdrs, expect_errors=True)
    return with_status(resp, status)


def raw_mcp(client, body: bytes | str, status="*", **headers):
    hdrs = {"Content-Type": "application/json", **headers}
    body = body.encode() if isinstance(body, str) else body
    return with_status(client.post(f"{API}/mcp", body, headers=hdrs, expect_errors=True), status)


def initialize(client, version: str = "2025-11-25", **headers):
    """POST initialize (handshake era); return the response (its Mcp-Session-Id header)."""
    params = {
        "protocolVersion": version,
        "capabilities": {},
        "clientInfo": {"name": "t", "version": "1"},
    }
    body = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": params}
    return raw_mcp(client, json.dumps(body), 200, **headers)


def rpc_error(resp, status: int, code: int) -> dict:
    """Assert a JSON-RPC error answer (no envelope, no traceback); return its error."""
    assert resp.status_int == status, resp.text
    assert resp.content_type == "application/json"
    body = resp.json
    assert set(body) == {"jsonrpc", "id", "error"}
    assert body["jsonrpc"] == "2.0"
    assert body["error"]["code"] == code, body
    assert body["error"]["message"]
    assert "Traceback" not in resp.text
    return body["error"]


class TestMcp:
    """The JSON-RPC endpoint in-process: both protocol eras, every error code, auth, Origin."""

    @pytest.fixture
    def mcp(self, make_app):
        client = with_key(make_app())
        seed_notes(client)
        return client

    def test_handshake_era_initialize_notification_ping(self, mcp):
        for asked, given in [
            ("2025-06-18", "2025-06-18"),
            ("2025-11-25", "2025-11-25"),
            ("2024-11-05", "2025-11-25"),
            ("2031-01-01", "2025-11-25"),
        ]:
            params = {
                "protocolVersion": asked,
                "capabilities": {},
                "clientInfo": {"name": "t", "version": "1"},
            }
            resp = mcp.post(
                f"{API}/mcp",
                json.dumps({"jsonrpc": "2.0", "id": 7, "method": "initialize", "params": params}),
                headers={"Content-Type": "application/json"},
            )
            assert resp.content_type == "application/json"
            assert re.fullmatch(r"[A-Za-z0-9_-]{22}", resp.headers["Mcp-Session-Id"])
            result = resp.json["result"]
            assert resp.json["id"] == 7
            assert result["protocolVersion"] == given
            assert result["capabilities"] == {
                "tools": {"listChanged": False},
                "resources": {"subscribe": True, "listChanged": True},
                "prompts": {"listChanged": False},
                "completions": {},
            }
            assert result["serverInfo"]["name"] == "notesvc"
            assert result["serverInfo"]["version"] == notesvc.__version__
            assert "search_notes" in result["instructions"]
        note = raw_mcp(mcp, '{"jsonrpc": "2.0", "method": "notifications/initialized"}')
        assert (note.status_int, note.body) == (202, b"")
        assert rpc(mcp, "ping") == {"jsonrpc": "2.0", "id": 1, "result": {}}
        hdr = {"MCP-Protocol-Version": "2025-06-18"}
        assert rpc(mcp, "tools/list", **hdr)["result"]["tools"]
        answered = raw_mcp(mcp, '{"jsonrpc": "2.0", "id": 5, "result": {}}')  # a response
        assert (answered.status_int, answered.body) == (202, b"")

    def test_stateless_era_discover_list_call(self, mcp):
        found = modern(mcp, "server/discover", status=200).json
        assert found["id"] == "m-1"
        result = found["result"]
        assert result["supportedVersions"] == ["2025-06-18", "2025-11-25", "2026-07-28"]
        assert result["capabilities"] == {  # no stream in this era: no subscriptions
            "tools": {"listChanged": False},
            "resources": {"subscribe": False, "listChanged": False},
            "prompts": {"listChanged": False},
            "completions": {},
        }
        assert result["resultType"] == "complete"
        assert result["cacheScope"] == "private"
        assert result["ttlMs"] >= 0
        info = result["_meta"]["io.modelcontextprotocol/serverInfo"]
        assert info == {"name": "notesvc", "title": "notesvc notes", "version": notesvc.__version__}
        listed = modern(mcp, "tools/list", status=200).json["result"]
        assert {t["name"] for t in listed["tools"]} == {
            n for n, t in notesvc.TOOLS.items() if t.read_only
        }
        assert (listed["resultType"], listed["cacheScope"]) == ("complete", "private")
        called = modern(
            mcp, "tools/call", {"name": "search_notes", "arguments": {"query": "keys"}}, status=200
        ).json["result"]
        assert called["resultType"] == "complete"
        assert called["isError"] is False
        assert called["structuredContent"]["results"][0]["path"] == "notes/home/keys.md"
        note = mcp.post(
            f"{API}/mcp",
            json.dumps({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {}}),
            headers={"Content-Type": "application/json", "MCP-Protocol-Version": MODERN},
            status=202,
        )
        assert note.body == b""

    def test_tool_errors_are_results_with_structured_content(self, mcp):
        for era in ("handshake", "stateless"):
            params = {"name": "read_note", "arguments": {"path": "notes/none.md"}}
            if era == "handshake":
                result = rpc(mcp, "tools/call", params)["result"]
            else:
                result = modern(mcp, "tools/call", params, status=200).json["result"]
            assert result["isError"] is True
            assert result["structuredContent"] == {
                "error": {"code": "NOT_FOUND", "message": "no note at notes/none.md"}
            }

    @pytest.mark.parametrize(
        ("body", "status", "code"),
        [
            ("{not json", 400, -32700),
            ("", 400, -32700),
            ('{"jsonrpc": "2.0", "id": 1, "method": "ping", "x": NaN}', 400, -32700),
            (b'{"jsonrpc": "2.0", "id": 1, "method": "p\xffng"}', 400, -32700),
            ("[" * 100000 + "]" * 100000, 400, -32700),
            ('[{"jsonrpc": "2.0", "id": 1, "method": "ping"}]', 400, -32600),
            ("[]", 400, -32600),
            ('"ping"', 400, -32600),
            ("42", 400, -32600),
            ('{"id": 1, "method": "ping"}', 400, -32600),
            ('{"jsonrpc": "1.0", "id": 1, "method": "ping"}', 400, -32600),
            ('{"jsonrpc": "2.0", "id": 1, "method": 5}', 400, -32600),
            ('{"jsonrpc": "2.0", "id": 1, "method": ""}', 400, -32600),
            ('{"jsonrpc": "2.0", "id": true, "method": "ping"}', 400, -32600),
            ('{"jsonrpc": "2.0", "id": 1.5, "method": "ping"}', 400, -32600),
            ('{"jsonrpc": "2.0", "id": {"a": 1}, "method": "ping"}', 400, -32600),
            ('{"jsonrpc": "2.0", "id": null, "method": "ping"}', 400, -32600),
            ('{"jsonrpc": "2.0", "id": 1, "method": "sampling/createMessage"}', 200, -32601),
            ('{"jsonrpc": "2.0", "id": 1, "method": "' + "x" * 5000 + '"}', 200, -32601),
            ('{"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": [1]}', 200, -32602),
            (
                '{"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"cursor": "x"}}',
                200,
                -32602,
            ),
            ('{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {}}', 200, -32602),
            (
                '{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": 5}}',
                200,
                -32602,
            ),
            (
                '{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "nope"}}',
                200,
                -32602,
            ),
            (
                '{"jsonrpc": "2.0", "id": 1, "method": "tools/call",'
                ' "params": {"name": "read_note", "arguments": "notes/x.md"}}',
                200,
                -32602,
            ),
        ],
    )
    @pytest.mark.slow
    def test_malformed_json_rpc_gets_the_specs_codes(self, mcp, body, status, code):
        error = rpc_error(raw_mcp(mcp, body), status, code)
        assert len(error["message"]) < 300

    def test_the_request_id_comes_back_when_it_could_be_read(self, mcp):
        resp = raw_mcp(mcp, '{"jsonrpc": "2.0", "id": "abc", "method": "nope"}')
        assert resp.json["id"] == "abc"
        resp = raw_mcp(mcp, '{"jsonrpc": "1.0", "id": 9, "method": "ping"}')
        assert resp.json["id"] == 9
        resp = raw_mcp(mcp, '{"jsonrpc": "2.0", "id": [9], "method": "ping"}')
        assert resp.json["id"] is None

    def test_stateless_methods_not_served_are_404(self, mcp):
        for method in ("initialize", "ping", "logging/setLevel"):
            rpc_error(modern(mcp, method), 404, -32601)

    def test_stateless_envelope_and_version_checks(self, mcp):
        no_meta = mcp.post(
            f"{API}/mcp",
            json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}),
            headers={
                "Content-Type": "application/json",
                "MCP-Protocol-Version": MODERN,
                "Mcp-Method": "tools/list",
            },
            expect_errors=True,
        )
        assert "_meta" in rpc_error(no_meta, 400, -32602)["message"]
        half = {"_meta": {"io.modelcontextprotocol/protocolVersion": MODERN}}
        resp = mcp.post(
            f"{API}/mcp",
            json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": half}),
            headers={
                "Content-Type": "application/json",
                "MCP-Protocol-Version": MODERN,
                "Mcp-Method": "tools/list",
            },
            expect_errors=True,
        )
        assert "clientCapabilities" in rpc_error(resp, 400, -32602)["message"]
        error = rpc_error(modern(mcp, "tools/list", version="2099-01-01"), 400, -32022)
        assert error["data"] == {
            "supported": ["2025-06-18", "2025-11-25", "2026-07-28"],
            "requested": "2099-01-01",
        }
        rpc_error(modern(mcp, "server/discover", version="banana"), 400, -32022)
        long = modern(mcp, "server/discover", version="v" * 5000)
        assert rpc_error(long, 400, -32022)["data"]["requested"] == "v" * 64
        params = {"_meta": {**modern_meta(), "io.modelcontextprotocol/protocolVersion": 7}}
        resp = raw_mcp(
            mcp,
            json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": params}),
            **{"MCP-Protocol-Version": "7", "Mcp-Method": "tools/list"},
        )
        rpc_error(resp, 400, -32020)  # the header (text) can never equal a number
        # a handshake-era request naming a revision this server does not serve
        resp = raw_mcp(
            mcp,
            '{"jsonrpc": "2.0", "id": 1, "method": "tools/list"}',
            **{"MCP-Protocol-Version": "2025-03-26"},
        )
        assert rpc_error(resp, 400, -32022)["data"]["requested"] == "2025-03-26"
        # a notification at a version not served
        resp = raw_mcp(
            mcp, '{"jsonrpc": "2.0", "method": "notifications/x"}', **{"MCP-Protocol-Version": "9"}
        )
        rpc_error(resp, 400, -32022)

    @pytest.mark.parametrize(
        ("headers", "says"),
        [
            ({"MCP-Protocol-Version": "2099-01-01"}, "MCP-Protocol-Version"),
            ({"Mcp-Method": "tools/list"}, "Mcp-Method"),
            ({"Mcp-Method": ""}, "Mcp-Method"),
            ({"Mcp-Name": "read_note"}, "Mcp-Name"),
            ({"Mcp-Name": "=?base64?cmVhZF9ub3Rl?="}, "Mcp-Name"),
            ({"Mcp-Name": "=?base64?not base64?="}, "Mcp-Name"),
        ],
    )
    def test_headers_that_do_not_repeat_the_body_are_32020(self, mcp, headers, says):
        params = {"name": "search_notes", "arguments": {"query": "keys"}}
        resp = modern(mcp, "tools/call", params, headers=headers)
        assert says in rpc_error(resp, 400, -32020)["message"]

    def test_header_mismatches_in_the_stateless_era(self, mcp):
        params = {"_meta": modern_meta(), "name": "search_notes", "arguments": {"query": "keys"}}
        body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": params})
        # the body names the stateless era but no header is sent
        resp = raw_mcp(mcp, body)
        assert "MCP-Protocol-Version" in rpc_error(resp, 400, -32020)["message"]
        other = {
            "MCP-Protocol-Version": "2099-01-01",
            "Mcp-Method": "tools/call",
            "Mcp-Name": "search_notes",
        }
        rpc_error(raw_mcp(mcp, body, **other), 400, -32020)
        sentinel = {
            "MCP-Protocol-Version": MODERN,
            "Mcp-Method": "tools/call",
            "Mcp-Name": "=?base64?c2VhcmNoX25vdGVz?=",
        }
        assert raw_mcp(mcp, body, **sentinel).json["result"]["isError"] is False
        # a handshake-era header names that era (as the SDKs route): _meta is then ignored
        old = {"MCP-Protocol-Version": "2025-11-25"}
        assert "resultType" not in raw_mcp(mcp, body, **old).json["result"]

    def test_get_delete_put_are_405_in_json_rpc(self, mcp, anon):
        # GET and DELETE without a session, PUT and PATCH always: 405 in JSON-RPC
        for method in ("GET", "DELETE", "PUT", "PATCH"):
            resp = mcp.request(f"{API}/mcp", method=method, expect_errors=True)
            error = rpc_error(resp, 405, -32000)
            assert error["data"] == {"status": 405, "code": "METHOD_NOT_ALLOWED"}
            assert "POST" in resp.headers["Allow"]
        # credentials first: whatever the session id, a missing key is 401
        resp = anon.get(f"{API}/mcp", headers={"Mcp-Session-Id": "x" * 22}, expect_errors=True)
        rpc_error(resp, 401, -32000)
        # with a session: DELETE ends it (204); then it is unknown (404) to GET, POST, DELETE
        sid = initialize(mcp).headers["Mcp-Session-Id"]
        hdr = {"Mcp-Session-Id": sid}
        # HEAD (Bottle routes it as GET) opens no stream: 405, whatever the session
        head = mcp.request(f"{API}/mcp", method="HEAD", headers=hdr, expect_errors=True)
        assert (head.status_int, head.headers["Allow"]) == (405, "POST, GET, DELETE")
        assert mcp.delete(f"{API}/mcp", headers=hdr, status=204).body == b""
        for method in ("GET", "DELETE"):
            resp = mcp.request(f"{API}/mcp", method=method, headers=hdr, expect_errors=True)
            rpc_error(resp, 404, -32000)
        rpc_error(raw_mcp(mcp, '{"jsonrpc": "2.0", "id": 1, "method": "ping"}', **hdr), 404, -32000)
        for method in ("PUT", "PATCH"):  # a session changes nothing for these
            resp = mcp.request(f"{API}/mcp", method=method, headers=hdr, expect_errors=True)
            rpc_error(resp, 405, -32000)

    @pytest.mark.slow
    def test_the_stream_says_ok_then_a_comment_a_while_and_ends_at_its_time(
        self, make_app, monkeypatch
    ):
        monkeypatch.setattr(notesvc.McpSessions, "COMMENT_SECONDS", 0.15)
        client = with_key(make_app(SERVICE_MCP_STREAM_SECONDS="1"))
        sid = initialize(client).headers["Mcp-Session-Id"]
        hdr = {"Mcp-Session-Id": sid, "Accept": "text/event-stream"}
        resp = client.get(f"{API}/mcp", headers=hdr)  # read to its end: 1 s
        assert resp.content_type == "text/event-stream"
        blocks = resp.body.decode().split("\n\n")
        assert blocks[0] == ": ok"
        assert blocks[-1] == ""
        # nothing happened: only comments, about one each 0.15 s of the 1 s (a busy machine
        # sends fewer, never more)
        assert set(blocks[1:-1]) == {": keep-alive"}
        assert 2 <= len(blocks[1:-1]) <= 7

    def test_sessions_are_capped_least_recently_used_first_and_dropped_when_idle(
        self, mcp, monkeypatch
    ):
        monkeypatch.setattr(notesvc.McpSessions, "MAX_SESSIONS", 3)
        ping = '{"jsonrpc": "2.0", "id": 1, "method": "ping"}'
        sids = [initialize(mcp).headers["Mcp-Session-Id"] for _ in range(3)]
        raw_mcp(mcp, ping, 200, **{"Mcp-Session-Id": sids[0]})  # the first is used again
        sids.append(initialize(mcp).headers["Mcp-Session-Id"])  # over the cap: sids[1] goes
        for sid, status in zip(sids, (200, 404, 200, 200)):
            raw_mcp(mcp, ping, status, **{"Mcp-Session-Id": sid})
        error = rpc_error(raw_mcp(mcp, ping, **{"Mcp-Session-Id": sids[1]}), 404, -32000)
        assert "initialize again" in error["message"]
        monkeypatch.setattr(notesvc.McpSessions, "IDLE_SECONDS", 0)  # all unused too long
        raw_mcp(mcp, ping, 404, **{"Mcp-Session-Id": sids[3]})

    def test_a_browser_client_may_send_and_read_the_session_id(self, make_app):
        client = with_key(make_app(SERVICE_CORS_ORIGINS="https://app.example"))
        origin = {"Origin": "https://app.example"}
        asked = client.options(
            f"{API}/mcp",
            headers={
                **origin,
                "Access-Control-Request-Method": "GET",
                "Access-Control-Request-Headers": "mcp-session-id",
            },
        )
        assert "Mcp-Session-Id" in asked.headers["Access-Control-Allow-Headers"]
        started = initialize(client, **origin)
        assert "Mcp-Session-Id" in started.headers["Access-Control-Expose-Headers"]
        assert len(started.headers["Mcp-Session-Id"]) == 22

    def test_sessions_through_passthrough_but_not_the_terminating_relay(self, mcp):
        key = key_of(mcp)
        relayed = as_key(mcp, key, **{"notesvc.relayed": True})
        spliced = as_key(mcp, key, **{"notesvc.relayed": True, "notesvc.spliced": True})
        started = initialize(relayed)  # the relay ends TLS: no session, no subscriptions
        assert "Mcp-Session-Id" not in started.headers
        caps = started.json["result"]["capabilities"]["resources"]
        assert caps == {"subscribe": False, "listChanged": False}
        started = initialize(spliced)  # TLS ends here (passthrough): as a direct connection
        caps = started.json["result"]["capabilities"]["resources"]
        assert caps == {"subscribe": True, "listChanged": True}
        hdr = {"Mcp-Session-Id": started.headers["Mcp-Session-Id"]}
        ping = '{"jsonrpc": "2.0", "id": 1, "method": "ping"}'
        raw_mcp(spliced, ping, 200, **hdr)
        resp = relayed.get(f"{API}/mcp", headers=hdr, expect_errors=True)
        assert rpc_error(resp, 405, -32000)["data"]["code"] == "METHOD_NOT_ALLOWED"

    def test_limits_are_json_rpc_errors(self, make_app):
        client = with_key(make_app(SERVICE_MAX_BODY_BYTES="2048"))
        big = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "ping", "pad": "x" * 3000})
        error = rpc_error(raw_mcp(client, big), 413, -32600)
        assert error["data"] == {"status": 413, "code": "PAYLOAD_TOO_LARGE"}
        resp = client.post(
            f"{API}/mcp", "{}", headers={"Content-Type": "text/plain"}, expect_errors=True
        )
        assert rpc_error(resp, 415, -32600)["data"]["code"] == "UNSUPPORTED_MEDIA_TYPE"

    def test_the_key_is_accepted_in_each_of_its_headers(self, anon):
        key = key_of(anon)
        for name, value in [
            ("X-Service-Key", key),
            ("Authorization", f"Bearer {key}"),
            ("Authorization", f"bearer {key}"),
            ("X-API-Key", key),
        ]:
            assert rpc(anon, "ping", **{name: value}) == {"jsonrpc": "2.0", "id": 1, "result": {}}
        for headers in [
            {},
            {"X-Service-Key": "nsk_wrong"},
            {"Authorization": "Bearer nsk_wrong"},
            {"Authorization": f"Basic {key}"},
            {"X-API-Key": "nsk_wrong"},
            {"X-Auth-Token": key},
        ]:
            resp = raw_mcp(anon, '{"jsonrpc": "2.0", "id": 1, "method": "ping"}', **headers)
            error = rpc_error(resp, 401, -32000)
            assert error["data"] == {"status": 401, "code": "UNAUTHORIZED"}
            assert "Authorization: Bearer" in error["message"]
            assert key not in resp.text
        # only /mcp takes them: the rest of the API wants X-Service-Key (or a JWT)
        for name, value in [("Authorization", f"Bearer {key}"), ("X-API-Key", key)]:
            resp = anon.get(f"{API}/system/info", headers={name: value}, status=401)
            assert_error(resp, 401, "UNAUTHORIZED")

    def test_wrong_keys_on_mcp_count_toward_the_lockout(self, anon):
        key = key_of(anon)
        for i in range(10):
            headers = [{"Authorization": f"Bearer nsk_x{i}"}, {"X-API-Key": f"nsk_y{i}"}][i % 2]
            rpc_error(raw_mcp(anon, "{}", **headers), 401, -32000)
        resp = raw_mcp(
            anon, '{"jsonrpc": "2.0", "id": 1, "method": "ping"}', Authorization=f"Bearer {key}"
        )
        error = rpc_error(resp, 429, -32000)
        assert error["data"]["code"] == "RATE_LIMITED"
        assert int(resp.headers["Retry-After"]) > 0
        assert_error(
            anon.get(f"{API}/system/info", headers={"X-Service-Key": key}, status=429),
            429,
            "RATE_LIMITED",
        )

    def test_jwt_mode_takes_a_token_or_the_key_as_bearer(self, make_app):
        app = make_app(SERVICE_AUTH_MODE="jwt", SERVICE_JWT_SECRET="j" * 40)
        key = key_of(app)
        token = data(with_key(app).post(f"{API}/auth/token"))["token"]
        for value in (token, key):
            assert rpc(app, "ping", Authorization=f"Bearer {value}")["result"] == {}
        resp = raw_mcp(app, "{}", Authorization=f"Bearer {token[:-2]}xx")
        rpc_error(resp, 401, -32000)

    def test_auth_off_asks_no_key_but_still_checks_the_origin(self, make_app):
        app = make_app(SERVICE_AUTH_MODE="none")
        assert rpc(app, "ping")["result"] == {}
        resp = raw_mcp(
            app, '{"jsonrpc": "2.0", "id": 1, "method": "ping"}', Origin="http://evil.example"
        )
        assert rpc_error(resp, 403, -32000)["data"]["code"] == "FORBIDDEN"

    def test_origin_must_be_an_allowed_one(self, make_app, root):
        app = make_app(SERVICE_CORS_ORIGINS="https://notes.example")
        key = key_of(app)
        ping = '{"jsonrpc": "2.0", "id": 1, "method": "ping"}'
        ok = raw_mcp(app, ping, Origin="https://notes.example", **{"X-API-Key": key})
        assert ok.json["result"] == {}
        assert ok.headers["Access-Control-Allow-Origin"] == "https://notes.example"
        for origin in (
            "https://evil.example",
            "null",
            "http://127.0.0.1:3000",
            "https://notes.example.evil.example",
        ):
            resp = raw_mcp(app, ping, Origin=origin, **{"X-API-Key": key})
            error = rpc_error(resp, 403, -32000)
            assert "SERVICE_CORS_ORIGINS" in error["message"]
        # refused before the key is even looked at: no lockout, no oracle
        for _ in range(12):
            raw_mcp(app, ping, Origin="https://evil.example", **{"X-API-Key": "nsk_bad"})
        assert raw_mcp(app, ping, **{"X-API-Key": key}).json["result"] == {}
        pre = app.options(
            f"{API}/mcp",
            headers={"Origin": "https://notes.example", "Access-Control-Request-Method": "POST"},
        )
        allowed = pre.headers["Access-Control-Allow-Headers"]
        for name in (
            "Authorization",
            "X-API-Key",
            "MCP-Protocol-Version",
            "Mcp-Method",
            "Mcp-Name",
        ):
            assert name in allowed
        star = make_app(tmp_path_factory_root(root), SERVICE_CORS_ORIGINS="*")
        resp = raw_mcp(star, ping, Origin="https://anywhere.example", **{"X-API-Key": key_of(star)})
        assert resp.json["result"] == {}

    def test_self_relay_prefix_answers_json_rpc_too(self, mcp):
        sid = mcp.app.service.state.read()["serverId"]
        resp = mcp.post(
            f"/r/{sid}{API}/mcp",
            '{"jsonrpc": "2.0", "id": 1, "method": "ping"}',
            headers={"Content-Type": "application/json"},
        )
        assert resp.json["result"] == {}
        other = mcp.post(
            f"/r/aaaaaaaaaaaaaaaaaaaa{API}/mcp",
            "{}",
            headers={"Content-Type": "application/json"},
            expect_errors=True,
        )
        assert rpc_error(other, 404, -32000)["data"]["code"] == "NOT_FOUND"
        found = call_tool(mcp, "search", query="keys")["structuredContent"]["results"][0]
        assert found["url"] == "http://localhost:80/api/v1/notes/notes%2Fhome%2Fkeys.md"
        via = mcp.post(
            f"/r/{sid}{API}/mcp",
            json.dumps(
                {
                    "jsonrpc": "2.0",
                    "id": 1,
                    "method": "tools/call",
                    "params": {"name": "search", "arguments": {"query": "keys"}},
                }
            ),
            headers={"Content-Type": "application/json"},
        ).json
        url = via["result"]["structuredContent"]["results"][0]["url"]
        assert url == f"http://localhost:80/r/{sid}/api/v1/notes/notes%2Fhome%2Fkeys.md"

    def test_a_crash_behind_a_json_rpc_route_is_32603_with_the_request_id(self, root, caplog):
        cfg = notesvc.load_config(env=make_env(root))
        service = notesvc.build_service(cfg).start()
        extra = (notesvc.Route("POST", "/boom-rpc", _boom, jsonrpc=True, scope="read"),)
        app = webtest.TestApp(notesvc.NotesApp(service, notesvc.ROUTES + extra))
        key = service.state.read()["apiKey"]
        resp = app.post(f"{API}/boom-rpc", "{}", headers={"X-API-Key": key}, status=500)
        error = rpc_error(resp, 500, -32603)
        assert resp.headers["X-Request-Id"] in error["message"]
        assert "secret" not in resp.text
        assert "passwd" not in resp.text
        assert service.routes[-1].jsonrpc is True
        assert {r.rule for r in service.routes if r.jsonrpc} == {f"{API}/mcp", f"{API}/boom-rpc"}

    def test_only_mcp_answers_json_rpc(self, anon):
        assert {r.rule for r in anon.app.service.routes if r.jsonrpc} == {f"{API}/mcp"}
        assert notesvc.RELAYED_JSONRPC_RE.match(f"/r/abc{API}/mcp")
        assert_error(anon.get(f"{API}/mcpx", status=404), 404, "NOT_FOUND")

    def test_openapi_documents_mcp(self, anon):
        doc = anon.get(f"{API}/openapi.json").json
        op = doc["paths"]["/api/v1/mcp"]["post"]
        assert set(op["responses"]) == {"200", "202", "default"}
        assert {"bearerKey": []} in op["security"]
        assert {"xApiKey": []} in op["security"]
        assert doc["components"]["securitySchemes"]["xApiKey"]["name"] == "X-API-Key"

    def test_config_and_audit_report_the_write_tools(self, make_app, root):
        cfg = data(with_key(make_app()).get(f"{API}/system/config"))
        assert cfg["mcp"] == {
            "path": "/api/v1/mcp",
            "write": False,
            "protocolVersions": ["2025-06-18", "2025-11-25", "2026-07-28"],
        }
        assert (cfg["agent"]["write"], cfg["agent"]["maxSteps"]) == (False, 6)
        app = make_app(
            tmp_path_factory_root(root),
            SERVICE_MCP_WRITE="true",
            SERVICE_AGENT_WRITE="true",
            SERVICE_AGENT_MAX_STEPS="9",
        )
        client = with_key(app)
        cfg = data(client.get(f"{API}/system/config"))
        assert (cfg["mcp"]["write"], cfg["agent"]["write"], cfg["agent"]["maxSteps"]) == (
            True,
            True,
            9,
        )
        assert "tool-writes-without-auth" not in ids(audit(client))
        client.post_json(f"{API}/channels", {"provider": "web", "config": {}}, status=201)
        findings = {f["id"]: f for f in audit(client)["findings"]}
        assert findings["agent-writes-from-channels"]["severity"] == "info"
        open_app = make_app(
            tmp_path_factory_root(root), SERVICE_AUTH_MODE="none", SERVICE_MCP_WRITE="true"
        )
        findings = {f["id"]: f for f in audit(open_app)["findings"]}
        assert findings["tool-writes-without-auth"]["severity"] == "medium"
        assert "SERVICE_MCP_WRITE" in findings["tool-writes-without-auth"]["detail"]
        quiet = make_app(tmp_path_factory_root(root), SERVICE_AUTH_MODE="none")
        assert "tool-writes-without-auth" not in ids(audit(quiet))

    @pytest.mark.parametrize(
        ("env", "names"),
        [
            ({"SERVICE_MCP_WRITE": "maybe"}, "SERVICE_MCP_WRITE"),
            ({"SERVICE_AGENT_WRITE": "2"}, "SERVICE_AGENT_WRITE"),
            ({"SERVICE_AGENT_MAX_STEPS": "0"}, "SERVICE_AGENT_MAX_STEPS"),
            ({"SERVICE_AGENT_MAX_STEPS": "21"}, "SERVICE_AGENT_MAX_STEPS"),
            ({"SERVICE_AGENT_MAX_STEPS": "six"}, "SERVICE_AGENT_MAX_STEPS"),
        ],
    )
    def test_bad_settings_stop_start_up(self, env, names):
        with pytest.raises(notesvc.ConfigError, match=names):
            notesvc.load_config(env=env)


def sdk_session(url: str, headers: dict, mode: str, steps):
    """Run `steps(client)` in an official MCP SDK session with a real server; return its result."""
    import asyncio

    client_module = pytest.importorskip("mcp.client.client")
    transport = pytest.importorskip("mcp.client.streamable_http")
    httpx2 = pytest.importorskip("httpx2")

    async def main():
        async with httpx2.AsyncClient(headers=headers, timeout=30) as http:
            connection = transport.streamable_http_client(url, http_client=http)
            async with client_module.Client(connection, mode=mode) as session:
                return await steps(session)

    return asyncio.run(main())


def post_rpc(server: Server, path: str, body, headers: dict | None = None) -> tuple:
    """POST a JSON-RPC body to a real server or relay; return (status, headers, answer)."""
    return server.request("POST", path, body, headers)


class TestMcpServer:
    """A real `python notesvc.py` (and a real relay): the official SDK, limits, the relay."""

    pytestmark = [pytest.mark.real_server, pytest.mark.slow]

    @pytest.fixture
    def server(self, tmp_path):
        with running(tmp_path / "srv", env={"SERVICE_MCP_WRITE": "true"}) as server:
            key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]
            for path, text in [("notes/garden.md", "# Garden\n\nPlant tomatoes in May.")]:
                server.request(
                    "POST", f"{API}/notes", {"path": path, "content": text}, {"X-Service-Key": key}
                )
            server.key = key
            yield server

    @pytest.mark.parametrize(("mode", "version"), [("legacy", "2025-11-25"), ("auto", MODERN)])
    def test_the_official_sdk_lists_searches_reads_creates_and_is_refused_a_stale_etag(
        self, server, mode, version
    ):
        async def steps(session):
            names = [t.name for t in (await session.list_tools()).tools]
            hits = await session.call_tool("search_notes", {"query": "tomatoes"})
            note = await session.call_tool("read_note", {"path": "notes/garden.md"})
            made = await session.call_tool(
                "create_note", {"path": "notes/sdk.md", "content": "# SDK\n\nmade by the SDK"}
            )
            etag = note.structured_content["etag"]
            server.request(
                "PUT",
                f"{API}/notes/notes%2Fgarden.md",
                {"content": "# Garden\n\nchanged"},
                {"X-Service-Key": server.key},
            )
            stale = await session.call_tool(
                "update_note", {"path": "notes/garden.md", "content": "overwrite", "etag": etag}
            )
            return session.protocol_version, names, hits, note, made, stale

        got, names, hits, note, made, stale = sdk_session(
            server.url + f"{API}/mcp", {"Authorization": f"Bearer {server.key}"}, mode, steps
        )
        assert got == version
        # every tool but the review card's two (listed in suggest mode only)
        assert set(names) == {n for n, t in notesvc.TOOLS.items() if not t.app_only}
        assert hits.is_error is False
        assert hits.content[0].text.startswith("notes/garden.md — Garden: ")
        assert hits.structured_content["results"][0]["path"] == "notes/garden.md"
        assert note.structured_content["content"] == "# Garden\n\nPlant tomatoes in May."
        assert made.is_error is False
        assert made.structured_content["path"] == "notes/sdk.md"
        assert stale.is_error is True
        assert stale.structured_content["error"]["code"] == "PRECONDITION_FAILED"
        _, _, body = server.request(
            "GET", f"{API}/notes/notes%2Fgarden.md", headers={"X-Service-Key": server.key}
        )
        assert body["data"]["content"] == "# Garden\n\nchanged"
        _, _, body = server.request(
            "GET", f"{API}/search?q=SDK", headers={"X-Service-Key": server.key}
        )
        assert body["data"]["results"][0]["path"] == "notes/sdk.md"

    def test_waitress_refusals_on_mcp_are_json_rpc(self, server):
        for headers, status, code in [
            ("Content-Length: 99999999\r\n", 413, "PAYLOAD_TOO_LARGE"),
            ("Content-Length: abc\r\n", 400, "VALIDATION_ERROR"),
            ("Content-Length: 5\r\nContent-Length: 6\r\n", 400, "VALIDATION_ERROR"),
        ]:
            request = (
                f"POST {API}/mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"{headers}\r\n"
            ).encode()
            got, resp_headers, body = raw_http(server.port, request)
            assert got == status, body
            answer = json.loads(body)
            assert answer["jsonrpc"] == "2.0"
            assert answer["error"]["data"]["code"] == code
            assert resp_headers["content-type"] == "application/json; charset=utf-8"

    @pytest.fixture
    def relayed(self, tmp_path):
        relay = Server(tmp_path / "relay", "relay", env={"SERVICE_RELAY_TIMEOUT": "3"})
        server = Server(tmp_path / "srv", env={"SERVICE_RELAY_URL": relay.url})
        try:
            wait_for(lambda: relay_servers(relay) == 1)
            setup = server.request("GET", f"{API}/system/setup")[2]["data"]
            server.request(
                "POST",
                f"{API}/notes",
                {"path": "notes/garden.md", "content": "# Garden\n\nPlant tomatoes in May."},
                {"X-Service-Key": setup["apiKey"]},
            )
            yield relay, setup
        finally:
            server.stop()
            relay.stop()

    def test_json_rpc_through_the_relay(self, relayed):
        relay, setup = relayed
        path = f"/r/{setup['serverId']}{API}/mcp"
        assert setup["links"]["relayApiBase"] + "/mcp" == relay.url + path
        bearer = {"Authorization": f"Bearer {setup['apiKey']}"}
        init = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-06-18",
                "capabilities": {},
                "clientInfo": {"name": "t", "version": "1"},
            },
        }
        status, headers, answer = post_rpc(relay, path, init, bearer)
        assert status == 200
        assert answer["result"]["protocolVersion"] == "2025-06-18"
        note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
        assert post_rpc(relay, path, note, bearer)[::2] == (202, None)
        call = {
            "jsonrpc": "2.0",
            "id": 2,
            "method": "tools/call",
            "params": {
                "_meta": modern_meta(),
                "name": "fetch",
                "arguments": {"id": "notes/garden.md"},
            },
        }
        stateless = {
            **bearer,
            "MCP-Protocol-Version": MODERN,
            "Mcp-Method": "tools/call",
            "Mcp-Name": "fetch",
        }
        status, _, answer = post_rpc(relay, path, call, stateless)
        assert status == 200
        fetched = answer["result"]["structuredContent"]
        assert fetched["text"] == "# Garden\n\nPlant tomatoes in May."
        assert fetched["url"] == f"{relay.url}/r/{setup['serverId']}/api/v1/notes/notes%2Fgarden.md"
        status, _, answer = post_rpc(relay, path, call, {**stateless, "Mcp-Name": "search"})
        assert (status, answer["error"]["code"]) == (400, -32020)
        for headers, want in [
            ({"X-API-Key": "nsk_wrong"}, (401, "UNAUTHORIZED")),
            ({**bearer, "Origin": "https://evil.example"}, (403, "FORBIDDEN")),
        ]:
            status, _, answer = post_rpc(
                relay, path, {"jsonrpc": "2.0", "id": 3, "method": "ping"}, headers
            )
            assert (status, answer["error"]["data"]["code"]) == want
        status, _, answer = relay.request("GET", path, headers=bearer)
        assert (status, answer["error"]["data"]["code"]) == (405, "METHOD_NOT_ALLOWED")
        # the relay's own refusals of a request to /mcp are JSON-RPC errors too
        status, _, answer = post_rpc(
            relay,
            f"/r/aaaaaaaaaaaaaaaaaaaa{API}/mcp",
            {"jsonrpc": "2.0", "id": 4, "method": "ping"},
        )
        assert status == 504
        assert answer["error"]["data"]["code"] == "UPSTREAM_TIMEOUT"
        request = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            "Content-Length: 99999999\r\n\r\n"
        ).encode()
        status, _, body = raw_http(relay.port, request)
        assert status == 413
        assert json.loads(body)["error"]["data"]["code"] == "PAYLOAD_TOO_LARGE"

    def test_the_official_sdk_through_the_relay_without_writes(self, relayed):
        _, setup = relayed

        async def steps(session):
            tools = [t.name for t in (await session.list_tools()).tools]
            note = await session.call_tool("read_note", {"path": "notes/garden.md"})
            return session.protocol_version, tools, note

        version, tools, note = sdk_session(
            setup["links"]["relayApiBase"] + "/mcp", {"X-API-Key": setup["apiKey"]}, "auto", steps
        )
        assert version == MODERN
        assert set(tools) == {n for n, t in notesvc.TOOLS.items() if t.read_only}
        assert note.structured_content["title"] == "Garden"


class TestGrantsOnMcp:
    """OAuth tokens and scoped keys on /api/v1/mcp: the challenge, the audience, the scope,
    the folder."""

    @pytest.fixture
    def server(self, make_app):
        client = with_key(make_app(SERVICE_MCP_WRITE="true"))
        for path, text in FOLDER_NOTES.items():
            put_note(client, path, text)
        return client

    def test_no_credential_is_401_with_the_challenge(self, anon):
        resp = anon.post(f"{API}/mcp", "{}", {"Content-Type": "application/json"}, status=401)
        assert resp.headers["WWW-Authenticate"] == (
            'Bearer resource_metadata="http://localhost:80/.well-known/oauth-protected-resource'
            '/api/v1/mcp", scope="notes:read"'
        )
        assert resp.json["jsonrpc"] == "2.0"
        assert "error" in resp.json
        sid = anon.app.service.state.read()["serverId"]
        relayed = anon.post(
            f"/r/{sid}{API}/mcp", "{}", {"Content-Type": "application/json"}, status=401
        )
        meta = re.search(r'resource_metadata="([^"]+)"', relayed.headers["WWW-Authenticate"]).group(
            1
        )
        assert (
            meta == f"http://localhost:80/.well-known/oauth-protected-resource/r/{sid}/api/v1/mcp"
        )
        assert anon.get(meta.split(":80", 1)[1]).json["resource"] == (
            f"http://localhost:80/r/{sid}/api/v1/mcp"
        )
        wrong = bearer(anon, "nsa_" + "x" * 43).post(
            f"{API}/mcp", "{}", {"Content-Type": "application/json"}, status=401
        )
        assert 'error="invalid_token"' in wrong.headers["WWW-Authenticate"]
        rest = anon.get(f"{API}/notes", status=401)
        assert "WWW-Authenticate" not in rest.headers

    def test_a_token_works_on_mcp_for_its_own_url_only(self, server):
        _, t = tokens_for(server, server)
        mcp = bearer(server, t["access_token"])
        assert "search_notes" in listed_tools(mcp)
        sid = server.app.service.state.read()["serverId"]
        answer = rpc(mcp.__class__(server.app), "tools/list", status=401)  # no credential
        assert answer["error"]
        elsewhere = mcp.post(
            f"/r/{sid}{API}/mcp",
            json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}),
            {"Content-Type": "application/json"},
            status=401,
        )
        assert 'error="invalid_token"' in elsewhere.headers["WWW-Authenticate"]

    def test_an_expired_token_is_401_with_the_challenge(self, server, root):
        _, t = tokens_for(server, server)
        state_file = root / ".notesvc" / "state.json"
        state = json.loads(state_file.read_text())
        state["grants"][0]["accessExpiresAt"] = "2020-01-01T00:00:00.000Z"
        state_file.write_text(json.dumps(state))
        resp = bearer(server, t["access_token"]).post(
            f"{API}/mcp", "{}", {"Content-Type": "application/json"}, status=401
        )
        assert resp.headers["WWW-Authenticate"].startswith('Bearer resource_metadata="')

    def test_a_read_token_cannot_call_write_tools(self, server, root):
        _, t = tokens_for(server, server)  # notes:read, while SERVICE_MCP_WRITE is on
        mcp = bearer(server, t["access_token"])
        assert listed_tools(mcp) == {n for n, tool in notesvc.TOOLS.items() if tool.read_only}
        for name, args in (
            ("create_note", {"path": "notes/x.md", "content": "x"}),
            ("append_to_note", {"path": "notes/top.md", "text": "x"}),
            ("delete_note", {"path": "notes/top.md"}),
        ):
            answer = rpc(mcp, "tools/call", {"name": name, "arguments": args})
            assert answer["error"]["code"] == -32602
            assert "reading only" in answer["error"]["message"]
        assert not (root / "notes/x.md").exists()
        assert (root / "notes/top.md").read_text() == FOLDER_NOTES["notes/top.md"]
        writer = bearer(
            server, tokens_for(server, server, "notes:read notes:write")[1]["access_token"]
        )
        assert (
            ok_tool(writer, "create_note", path="notes/x.md", content="x")["path"] == "notes/x.md"
        )

    def test_a_folder_token_sees_its_folder_through_every_tool(self, server):
        _, t = tokens_for(server, server, "notes:read notes:write", folder="notes/family")
        mcp = bearer(server, t["access_token"])
        hits = ok_tool(mcp, "search_notes", query="apple")
        assert {h["path"] for h in hits["results"]} == {
            "notes/family/a.md",
            "notes/family/sub/b.md",
        }
        assert hits["total"] == 2
        assert {r["id"] for r in ok_tool(mcp, "search", query="apple")["results"]} == {
            "notes/family/a.md",
            "notes/family/sub/b.md",
        }
        tree = ok_tool(mcp, "list_folder", depth=5)
        assert paths_in(tree) == {"notes/family/a.md", "notes/family/sub/b.md"}
        changes = ok_tool(mcp, "recent_changes")
        assert {c["path"] for c in changes["changes"]} == {
            "notes/family/a.md",
            "notes/family/sub/b.md",
        }
        assert ok_tool(mcp, "list_tags")["tags"] == [{"tag": "common", "count": 2}]
        assert ok_tool(mcp, "read_note", path="notes/family/a.md")["title"] == "Apple pie"
        for name, args in (
            ("read_note", {"path": "notes/work/c.md"}),
            ("fetch", {"id": "notes/family/../work/c.md"}),
            ("search_notes", {"query": "apple", "folder": "notes/work"}),
            ("list_folder", {"path": "notes/work"}),
            ("create_note", {"path": "notes/work/new.md", "content": "x"}),
            ("update_note", {"path": "notes/work/c.md", "content": "x", "etag": '"0"'}),
            (
                "move_note",
                {"path": "notes/family/a.md", "newPath": "notes/work/a.md", "etag": '"0"'},
            ),
            ("delete_note", {"path": "notes/top.md"}),
            ("replace_in_note", {"path": "notes/work/c.md", "old": "secret", "new": "public"}),
        ):
            tool_refused(mcp, name, "NOT_FOUND", **args)
        assert ok_tool(mcp, "create_note", path="notes/family/new.md", content="n")["path"]

    def test_a_scoped_key_works_on_mcp_in_every_header(self, server):
        key = new_grant(server, "read", "notes/family")["key"]
        for headers in (
            {"X-Service-Key": key},
            {"X-API-Key": key},
            {"Authorization": f"Bearer {key}"},
        ):
            answer = rpc(
                server.__class__(server.app),
                "tools/call",
                {"name": "search_notes", "arguments": {"query": "apple"}},
                **headers,
            )
            assert {h["path"] for h in answer["result"]["structuredContent"]["results"]} == {
                "notes/family/a.md",
                "notes/family/sub/b.md",
            }

    def test_the_agent_of_a_read_key_gets_no_write_tools(self, make_app):
        model = ToolModel(
            lambda messages: [("search_notes", {"query": "apple"})],
            lambda messages: "Found: " + last_tool_results(messages)[0],
        )
        try:
            client = with_key(
                make_app(
                    SERVICE_AGENT_PROVIDER="openai",
                    SERVICE_AGENT_BASE_URL=model.url + "/v1",
                    SERVICE_AGENT_MODEL="tool-llama",
                    SERVICE_AGENT_WRITE="true",
                )
            )
            for path, text in FOLDER_NOTES.items():
                put_note(client, path, text)
            member = as_key(client, new_grant(client, "read", "notes/family")["key"])
            d = data(member.post_json(f"{API}/agent/chat", {"message": "apple"}))
            offered = {t["function"]["name"] for t in model.requests[0]["json"]["tools"]}
            assert offered
            assert all(notesvc.TOOLS[name].read_only for name in offered)
            assert paths_in(d)
            assert all(map(inside_family, paths_in(d)))
            assert all(map(inside_family, paths_in(model.requests)))  # nothing else was sent
        finally:
            model.close()
