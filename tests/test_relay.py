"""`notesvc relay` and the server's relay client (src/notesvc/relay.py)."""

from __future__ import annotations

import base64
import contextlib
import http.client
import http.server
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from conftest import (
    API,
    DOMAIN,
    HERE,
    KEY,
    Server,
    assert_error,
    assert_gzipped,
    att_url,
    data,
    multipart,
    notesvc,
    recv_all,
    relay_raw_get,
    relay_servers,
    run_cli,
    running,
    wait_for,
)
from standins import FakeRelayServer, host_request


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)


def relay_queued(relay: Server, fake: FakeRelayServer) -> int:
    return relay.request("GET", "/health")[2]["data"].get("queued", 0)


class TestRelay:
    @pytest.fixture
    def pair(self, tmp_path):
        """A real relay and a real server registered with it; yields (relay, server, ids)."""
        relay = Server(tmp_path / "relay", "relay", env={"SERVICE_RELAY_TIMEOUT": "3"})
        server = Server(tmp_path / "srv", env={"SERVICE_RELAY_URL": relay.url})
        try:
            wait_for(lambda: relay_servers(relay) == 1)
            setup = server.request("GET", f"{API}/system/setup")[2]["data"]
            yield relay, server, setup
        finally:
            server.stop()
            relay.stop()

    def via(self, relay, setup, method, path, body=None, key=None, headers=None):
        hdrs = {"X-Service-Key": setup["apiKey"] if key is None else key, **(headers or {})}
        return relay.request(method, f"/r/{setup['serverId']}{API}{path}", body, hdrs)

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_read_write_and_errors_through_the_relay(self, pair):
        relay, server, setup = pair
        assert setup["links"]["relayApiBase"] == f"{relay.url}/r/{setup['serverId']}/api/v1"
        text = '# Über\n\nUnicode ✓ 🗝️ «ключи» \u00a0and \\ back\\slashes "quotes"\n'
        status, headers, body = self.via(
            relay, setup, "POST", "/notes", {"path": "notes/relay/ü.md", "content": text}
        )
        assert status == 201
        assert headers["ETag"] == body["data"]["etag"]
        assert headers["Location"].endswith("/api/v1/notes/notes%2Frelay%2F%C3%BC.md")
        status, headers, body = self.via(relay, setup, "GET", "/notes/notes%2Frelay%2F%C3%BC.md")
        assert status == 200
        assert body["data"]["content"] == text
        on_disk = Path(server.proc.args[-1]) / "notes/relay/ü.md"
        assert on_disk.read_text() == text
        status, _, body = self.via(relay, setup, "GET", "/system/info", key="nsk_wrong")
        assert status == 401
        assert body["error"]["code"] == "UNAUTHORIZED"
        status, _, body = self.via(relay, setup, "GET", "/notes/notes%2Fnope.md")
        assert status == 404
        assert body["error"]["code"] == "NOT_FOUND"
        status, _, body = self.via(relay, setup, "GET", "/system/info")
        assert body["data"]["connection"]["state"] == "connected"

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_the_page_and_json_come_gzipped_through_the_relay(self, pair):
        """The relay forwards Accept-Encoding, lets the server's gzip through, and gzips
        its own page (docs/api.md: Compression)."""
        relay, _, setup = pair
        gz = {"Accept-Encoding": "gzip"}
        for i in range(30):
            body = {"path": f"notes/rz/n{i:02}.md", "content": "relayed words " * 20}
            assert self.via(relay, setup, "POST", "/notes", body)[0] == 201
        path, key = f"/r/{setup['serverId']}{API}/notes", {"X-Service-Key": setup["apiKey"]}
        status, h, plain = host_request(relay.port, "relay", "GET", path, headers=key)
        assert status == 200
        assert "Content-Encoding" not in h
        status, h, packed = host_request(relay.port, "relay", "GET", path, headers={**key, **gz})
        assert status == 200
        assert json.loads(assert_gzipped(h, packed)) == json.loads(plain)
        status, h, page = host_request(relay.port, "relay", "GET", "/")
        assert status == 200
        assert "Content-Encoding" not in h
        assert "accept-encoding" in h["Vary"].lower()
        status, h, packed = host_request(relay.port, "relay", "GET", "/", headers=gz)
        assert assert_gzipped(h, packed) == page
        refused = {"Accept-Encoding": "gzip;q=0"}
        assert host_request(relay.port, "relay", "GET", "/", headers=refused)[2] == page

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_the_setup_key_never_goes_through_the_relay(self, pair):
        """S2: whatever Host a client sends through the relay, a new server's key stays
        home and /auth/link through the relay is refused."""
        relay, server, setup = pair
        key, sid = setup["apiKey"], setup["serverId"]
        assert re.fullmatch(r"nsk_[A-Za-z0-9_-]{43}", key)  # read directly, on loopback
        hosts = [f"127.0.0.1:{server.port}", f"127.0.0.1:{relay.port}", "localhost", "[::1]"]
        for host in hosts:
            status, _, raw = host_request(relay.port, host, "GET", f"/r/{sid}{API}/system/setup")
            assert status == 200, raw
            assert key.encode() not in raw
            body = json.loads(raw)["data"]
            assert body["apiKey"] == "nsk_…" + key[-4:]
            assert body["browserSetup"] is False
            assert body["setupHere"] == {"allowed": False, "reason": "relayed"}
            status, _, raw = host_request(
                relay.port, host, "POST", f"/r/{sid}{API}/auth/link", {}, {KEY: key}
            )
            assert status == 403, raw
            assert json.loads(raw)["error"]["code"] == "FORBIDDEN"
        assert not server.request("GET", f"{API}/system/setup")[2]["data"]["setupComplete"]
        # The audit of this running server, registered with a relay: critical.
        out = run_cli("audit", "--root", server.proc.args[-1])
        assert out.returncode == 1, out.stdout + out.stderr
        assert "[critical] Setup is not complete on a reachable server" in out.stdout
        assert "is registered with the relay" in out.stdout

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_raw_bytes_pass_unchanged(self, pair):
        relay, _, setup = pair
        req = urllib.request.Request(
            f"{relay.url}/r/{setup['serverId']}{API}/notes",
            b'{"path": "notes/x.md", "content": "\xff\xfe"}',
            {"Content-Type": "application/json", "X-Service-Key": setup["apiKey"]},
            method="POST",
        )
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        assert err.value.code == 400
        assert "UTF-8" in json.loads(err.value.read())["error"]["message"]
        err.value.close()

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_pair_lookup(self, pair):
        relay, _, setup = pair
        status, _, body = relay.request("GET", f"/relay/v1/pair/{setup['pairing']['relayCode']}")
        assert status == 200
        assert body["data"] == {
            "serverId": setup["serverId"],
            "relayApiBase": f"{relay.url}/r/{setup['serverId']}/api/v1",
        }
        assert relay.request("GET", "/relay/v1/pair/AAAA-BBBB-CCCC")[0] == 404

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_rotating_the_key_keeps_the_code_paired(self, pair):
        relay, _, setup = pair
        status, _, body = self.via(relay, setup, "POST", "/auth/rotate")
        assert status == 200
        assert body["data"]["relayCode"] == setup["pairing"]["relayCode"]
        status, _, body = relay.request("GET", f"/relay/v1/pair/{setup['pairing']['relayCode']}")
        assert status == 200
        assert body["data"]["serverId"] == setup["serverId"]

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_server_stopping_gives_504(self, pair):
        relay, server, setup = pair
        server.stop()
        started = time.monotonic()
        status, _, body = self.via(relay, setup, "GET", "/health")
        assert status == 504
        assert body["error"]["code"] == "UPSTREAM_TIMEOUT"
        assert time.monotonic() - started < 10

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_unknown_server_is_504_and_relay_serves_no_server_pages(self, pair):
        relay = pair[0]
        assert relay.request("GET", f"/r/{'a' * 20}{API}/health")[0] == 504
        assert relay.request("GET", f"{API}/system/setup")[0] == 404
        status, _, body = relay.request("GET", "/r/x/notes")
        assert status == 404
        assert body["error"]["code"] == "NOT_FOUND"

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_relay_restart_server_reconnects(self, tmp_path):
        port = free_port()
        relay = Server(tmp_path / "relay", "relay", port=port)
        server = Server(tmp_path / "srv", env={"SERVICE_RELAY_URL": relay.url})
        try:
            wait_for(lambda: relay_servers(relay) == 1)
            setup = server.request("GET", f"{API}/system/setup")[2]["data"]
            relay.stop()
            relay = Server(tmp_path / "relay", "relay", port=port)
            wait_for(lambda: relay_servers(relay) == 1, timeout=40)
            status, _, body = self.via(relay, setup, "GET", "/health")
            assert status == 200
            assert body["data"]["status"] == "ok"
        finally:
            server.stop()
            relay.stop()

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_queue_limit_and_tokens(self, tmp_path):
        env = {"SERVICE_RELAY_MAX_QUEUE": "2", "SERVICE_RELAY_TIMEOUT": "2"}
        with running(tmp_path, "relay", env=env) as relay:
            a, b = FakeRelayServer(relay), FakeRelayServer(relay)
            assert a.register() == 200
            assert b.register() == 200
            # Another server's token never polls this queue, nor takes the id over.
            assert a.poll(server_id=b.server_id)[0] == 403
            assert a.register(server_id=b.server_id) == 403
            results = []

            def client():
                results.append(relay.request("GET", f"/r/{a.server_id}{API}/health")[0])

            threads = [threading.Thread(target=client) for _ in range(2)]
            for t in threads:
                t.start()
            wait_for(lambda: relay_queued(relay, a) == 2)
            status, _, body = relay.request("GET", f"/r/{a.server_id}{API}/health")
            assert status == 429
            assert body["error"]["code"] == "RATE_LIMITED"
            for t in threads:
                t.join(10)
            assert results == [504, 504]
            # The server picks up a request with its own token and answers it.
            t = threading.Thread(target=client)
            t.start()
            status, _, body = a.poll()
            assert status == 200
            request = body["data"]
            assert request["method"] == "GET"
            assert request["path"] == "/api/v1/health"
            assert request["client"] == "127.0.0.1"
            assert a.reply(request["id"], 200, [["Content-Type", "application/json"]], b"{}") == 200
            t.join(10)
            assert results[-1] == 200

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_ids_cannot_be_hijacked_even_after_a_restart(self, tmp_path):
        port = free_port()
        relay = Server(tmp_path / "relay", "relay", port=port)
        server = Server(tmp_path / "srv", env={"SERVICE_RELAY_URL": relay.url})
        try:
            wait_for(lambda: relay_servers(relay) == 1)
            setup = server.request("GET", f"{API}/system/setup")[2]["data"]
            victim = setup["serverId"]
            thief = FakeRelayServer(relay)
            assert thief.register(server_id=victim) == 403
            assert thief.poll(server_id=victim)[0] == 403
            relay.stop()  # the relay forgets everything; the id is still the victim's
            relay = Server(tmp_path / "relay", "relay", port=port)
            assert thief.register(server_id=victim) == 403
            assert thief.poll(server_id=victim)[0] == 403
            wait_for(lambda: relay_servers(relay) == 1, timeout=40)
            hdrs = {"X-Service-Key": setup["apiKey"]}
            assert relay.request("GET", f"/r/{victim}{API}/system/info", None, hdrs)[0] == 200
        finally:
            server.stop()
            relay.stop()

    def test_server_id_derives_from_the_relay_token(self, anon):
        st = anon.app.service.state.read()
        assert st["serverId"] == notesvc.relay_server_id(st["relayToken"])
        assert re.fullmatch(r"[a-z2-7]{20}", st["serverId"])
        assert st["relayToken"] not in anon.get(f"{API}/system/setup").text

    def test_a_state_file_from_0_1_gets_a_token_and_a_derived_id(self, root, make_app):
        (root / ".notesvc").mkdir(parents=True)
        old = {
            "version": 1,
            "serverId": "0123456789abcdef",
            "keyHash": notesvc.key_hash("nsk_old"),
            "keyHint": "_old",
            "setupComplete": True,
            "linkedClients": [],
            "relayCode": "ABCD-EFGH-JKMN",
        }
        (root / ".notesvc" / "state.json").write_text(json.dumps(old))
        st = make_app().app.service.state.read()
        assert st["serverId"] == notesvc.relay_server_id(st["relayToken"])
        assert st["keyHash"] == old["keyHash"]  # the key survives
        assert st["relayCode"] == notesvc.relay_code_of(st["relayToken"])  # changes once

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_registrations_are_rate_limited_per_address(self, tmp_path):
        env = {"SERVICE_RELAY_REGISTRATIONS_PER_MINUTE": "5"}
        with running(tmp_path, "relay", env=env) as relay:
            fakes = [FakeRelayServer(relay) for _ in range(6)]
            assert [f.register() for f in fakes] == [200] * 5 + [429]
            other = FakeRelayServer(relay, source="127.0.0.2")
            assert other.register() == 200  # another address has its own budget

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_a_refused_server_says_so(self, tmp_path):
        env = {"SERVICE_RELAY_MAX_SERVERS": "1"}
        with running(tmp_path / "relay", "relay", env=env) as relay:
            assert FakeRelayServer(relay).register() == 200  # the one slot is taken
            with running(tmp_path / "srv", env={"SERVICE_RELAY_URL": relay.url}) as server:
                key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]

                def refused():
                    info = server.request("GET", f"{API}/system/info", None, {"X-Service-Key": key})
                    return info[2]["data"]["connection"]["state"] == "refused" and info

                info = wait_for(refused)[2]["data"]["connection"]
                assert "maximum" in info["lastError"]
                wait_for(lambda: any("refused this server" in line for line in server.lines))

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_a_relay_that_says_the_token_back_gets_it_scrubbed(self, tmp_path):
        """T14 for the relay token: a hostile relay refusing with the token it was sent
        (upper-cased) in its message puts it neither in /system/info nor in the log."""
        said: list = []

        class Refusing(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                token = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["token"]
                said.append(token)
                message = f"token {token.upper()} is banned here"
                body = json.dumps(
                    {"success": False, "error": {"code": "FORBIDDEN", "message": message}}
                ).encode()
                self.send_response(403)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        relay = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
        threading.Thread(
            target=relay.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        ).start()
        url = f"http://127.0.0.1:{relay.server_address[1]}"
        try:
            with running(tmp_path, env={"SERVICE_RELAY_URL": url}) as server:
                key = {KEY: server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]}

                def refused():
                    info = server.request("GET", f"{API}/system/info", headers=key)[2]["data"]
                    return info["connection"]["state"] == "refused" and info["connection"]

                shown = wait_for(refused)
                wait_for(lambda: any("refused this server" in line for line in server.lines))
        finally:
            relay.shutdown()
            relay.server_close()
        assert "is banned here" in shown["lastError"]
        token = said[0].lower()
        assert token not in json.dumps(shown).lower()
        assert token not in "".join(server.lines).lower()

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_two_hundred_long_polls_do_not_block_a_client(self, pair):
        relay, _, setup = pair
        fakes = [FakeRelayServer(relay, source=f"127.0.1.{i % 200 + 1}") for i in range(200)]
        socks = []
        try:
            for fake in fakes:
                assert fake.register() == 200
                socks.append(fake.open_poll())
            wait_for(lambda: relay_servers(relay) == 201)
            started = time.monotonic()
            status, _, _body = self.via(relay, setup, "GET", "/system/info")
            took = time.monotonic() - started
            assert status == 200
            assert took < 1.0, f"{took:.2f} s with 200 polls held"
        finally:
            for s in socks:
                s.close()

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_a_note_of_the_largest_size_passes_both_ways(self, pair):
        relay, server, setup = pair
        limit = 1048576
        prefix = '{"path": "notes/big.md", "content": "'
        filler = 'Ünïcødé ✓ 🗝️ \\\\ \\" \\n'  # JSON-escaped text, many byte widths
        room = limit - len((prefix + '"}').encode())
        body = prefix + filler * (room // len(filler.encode()))
        body += "x" * (limit - len((body + '"}').encode())) + '"}'
        raw = body.encode()
        assert len(raw) == limit
        content = json.loads(raw)["content"]
        req = urllib.request.Request(
            f"{relay.url}/r/{setup['serverId']}{API}/notes",
            raw,
            {"Content-Type": "application/json", "X-Service-Key": setup["apiKey"]},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 201
            assert json.loads(resp.read())["data"]["size"] == len(content.encode())
        assert (Path(server.proc.args[-1]) / "notes/big.md").read_text() == content
        status, headers, got = self.via(relay, setup, "GET", "/notes/notes%2Fbig.md")
        assert status == 200
        assert got["data"]["content"] == content
        assert headers["Content-Type"].startswith("application/json")

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_an_over_limit_body_is_413_at_once(self, pair):
        relay, _, setup = pair
        with socket.create_connection(("127.0.0.1", relay.port), timeout=5) as s:
            s.sendall(
                f"PUT /r/{setup['serverId']}{API}/notes/notes%2Fx.md HTTP/1.1\r\n"
                "Host: relay\r\nContent-Type: application/json\r\n"
                "Content-Length: 1048577\r\n\r\n".encode()
            )
            started = time.monotonic()
            answer = recv_all(s)
        assert time.monotonic() - started < 1
        assert answer.startswith(b"HTTP/1.1 413 ")
        body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
        assert body["error"]["code"] == "PAYLOAD_TOO_LARGE"
        assert "1048576" in body["error"]["message"]

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_forwarded_answers_are_api_answers(self, tmp_path):
        with running(tmp_path, "relay") as relay:
            fake = FakeRelayServer(relay)
            assert fake.register() == 200
            out = []
            t = threading.Thread(
                target=lambda: out.append(relay_raw_get(relay, f"/r/{fake.server_id}{API}/x"))
            )
            t.start()
            _status, _, body = fake.poll()
            headers = [
                ["Content-Type", "text/html"],
                ["Set-Cookie", "session=evil; Path=/"],
                ["Access-Control-Allow-Origin", "*"],
                ["Content-Security-Policy", "script-src *"],
                ["ETag", '"abc"'],
            ]
            page = b"<script>alert(document.cookie)</script>"
            assert fake.reply(body["data"]["id"], 200, headers, page) == 200
            t.join(10)
        head, got = out[0]
        assert head.startswith("HTTP/1.1 200 ")
        lines = head.lower().split("\r\n")
        assert "content-type: application/json; charset=utf-8" in lines
        assert "x-content-type-options: nosniff" in lines
        assert "content-security-policy: default-src 'none'; sandbox" in lines
        assert 'etag: "abc"' in lines
        assert not any(h.startswith(("set-cookie", "access-control-")) for h in lines)
        assert got == page

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_a_header_outside_latin_1_is_left_out_and_the_answer_arrives(self, tmp_path):
        """T9: a registered server answering with a header value outside Latin-1 (an `é`
        in a file name, an emoji in an ETag) gets its answer through without that header,
        and the relay logs no traceback; the connection serves on."""
        with running(tmp_path, "relay") as relay:
            fake = FakeRelayServer(relay)
            assert fake.register() == 200
            for value in (
                '"caf\u00e9 \u2615"',
                'attachment; filename="r\u00e9sum\u00e9 \U0001f4c4.pdf"',
            ):
                out: list = []
                path = f"/r/{fake.server_id}{API}/x"
                t = threading.Thread(
                    target=lambda p=path, got=out: got.append(relay_raw_get(relay, p))
                )
                t.start()
                _status, _, body = fake.poll()
                headers = [
                    ["Content-Type", "application/json"],
                    ["ETag" if value.startswith('"') else "Content-Disposition", value],
                    ["X-Request-Id", "r-1"],
                ]
                assert fake.reply(body["data"]["id"], 200, headers, b'{"ok": true}') == 200
                t.join(10)
                head, got = out[0]
                assert head.startswith("HTTP/1.1 200 ")
                assert got == b'{"ok": true}'
                lines = head.lower().split("\r\n")
                assert "x-request-id: r-1" in lines
                assert not any(h.startswith(("etag", "content-disposition")) for h in lines)
            assert relay.request("GET", "/health")[0] == 200
        logged = "".join(relay.lines)
        assert "Traceback" not in logged
        assert "UnicodeEncodeError" not in logged

    @pytest.mark.real_server
    @pytest.mark.slow
    @pytest.mark.parametrize(
        ("head", "status"),
        [
            (b"POST /health HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: gzip\r\n\r\n", 400),
            (b"GET /health HTTP/1.1\r\nHost: r\r\nX-A: 1\r\n  folded\r\n\r\n", 400),
            (b"POST /health HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\nx", 400),
            (b"POST /health HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400),
            (b"GET /health HTTP/1.1\r\nNo colon here\r\n\r\n", 400),
            (b"GET health HTTP/1.1\r\n\r\n", 400),
            (b"GET /health HTTP/2.0\r\n\r\n", 400),
            (b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n", 431),
        ],
    )
    def test_http_is_parsed_strictly(self, tmp_path, head, status):
        with running(tmp_path, "relay") as relay:
            with socket.create_connection(("127.0.0.1", relay.port), timeout=5) as s:
                s.sendall(head)
                answer = recv_all(s)
            assert answer.startswith(f"HTTP/1.1 {status} ".encode())
            assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["success"] is False
            assert relay.request("GET", "/health")[0] == 200

    # -- chunked request bodies (S8) ------------------------------

    @staticmethod
    def exchange(port: int, data: bytes) -> tuple:
        """Send `data`, shut the sending side, read until the relay closes: return (every
        status the relay answered, the raw bytes). Fails if it never closes."""
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(data)
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_WR)
            raw = b""
            while True:
                chunk = s.recv(65536)  # a socket.timeout here: the relay kept it open
                if not chunk:
                    break
                raw += chunk
        return [int(m) for m in re.findall(rb"HTTP/1\.1 (\d{3}) ", raw)], raw

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_a_chunked_body_is_decoded_and_forwarded_with_its_length(self, tmp_path):
        with running(tmp_path, "relay") as relay:
            fake = FakeRelayServer(relay)
            assert fake.register() == 200
            body = b'{"path": "notes/c.md", "content": "' + b"x" * 70000 + b'"}'
            wire = (
                f"PUT /r/{fake.server_id}{API}/notes/notes%2Fc.md HTTP/1.1\r\nHost: relay\r\n"
                "Content-Type: application/json\r\nTransfer-Encoding:  CHUNKED \r\n"
                "Trailer: X-Sum\r\nExpect: 100-continue\r\n\r\n"
            ).encode()
            wire += b"000000000000000a;name=value;x\r\n" + body[:10] + b"\r\n"  # 16 digits
            wire += f"{len(body) - 10:X} ; ext\r\n".encode() + body[10:] + b"\r\n"
            wire += b"0\r\nX-Sum: 1\r\nX-Other: 2\r\n\r\n"
            wire += b"GET /health HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n"
            out: list = []
            t = threading.Thread(target=lambda: out.append(self.exchange(relay.port, wire)))
            t.start()
            status, _, polled = fake.poll()
            assert status == 200
            request = polled["data"]
            assert base64.b64decode(request["body"]) == body
            names = {name.lower() for name, _ in request["headers"]}
            assert names.isdisjoint({"transfer-encoding", "content-length", "trailer", "expect"})
            assert "x-sum" not in names  # trailers are dropped
            answer = [["Content-Type", "application/json"]]
            assert fake.reply(request["id"], 200, answer, b"{}") == 200
            t.join(15)
            statuses, raw = out[0]
            assert statuses == [100, 200, 200]  # Continue, the PUT, then the next request
            assert b'"role":"relay"' in raw.replace(b" ", b"")

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_chunked_requests_that_could_be_read_two_ways_are_refused(self, tmp_path):
        """CL.TE, TE.CL, TE.TE and malformed chunking: 400 (431, 413) and the connection
        closed, nothing forwarded, and what follows on the connection never answered."""
        env = {"SERVICE_MAX_BODY_BYTES": "65536"}
        with running(tmp_path, "relay", env=env) as relay:
            fake = FakeRelayServer(relay)
            assert fake.register() == 200
            head = f"POST /r/{fake.server_id}{API}/notes HTTP/1.1\r\nHost: relay\r\n"
            smuggled = b"GET /health HTTP/1.1\r\nHost: relay\r\n\r\n"
            good = b"5\r\nhello\r\n0\r\n\r\n"
            cases = [
                ("CL.TE", "Content-Length: 6\r\nTransfer-Encoding: chunked\r\n", good, 400),
                ("TE.CL", "Transfer-Encoding: chunked\r\nContent-Length: 4\r\n", good, 400),
                (
                    "TE.TE",
                    "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n",
                    good,
                    400,
                ),
                ("TE.TE", "Transfer-Encoding: chunked\r\nTransfer-Encoding: x\r\n", good, 400),
                ("list", "Transfer-Encoding: chunked, identity\r\n", good, 400),
                ("list", "Transfer-Encoding: identity, chunked\r\n", good, 400),
                ("xchunked", "Transfer-Encoding: xchunked\r\n", good, 400),
                ("gzip", "Transfer-Encoding: gzip\r\n", good, 400),
                ("vtab", "Transfer-Encoding: \x0bchunked\r\n", good, 400),
                ("space", "Transfer-Encoding : chunked\r\n", good, 400),
                ("bare LF", "Transfer-Encoding: chunked\r\n", b"5\nhello\n0\n\n", 400),
                ("bare CR", "Transfer-Encoding: chunked\r\n", b"5\rx\r\nhello\r\n0\r\n\r\n", 400),
                ("LF after data", "Transfer-Encoding: chunked\r\n", b"5\r\nhello\n0\r\n\r\n", 400),
                ("17 digits", "Transfer-Encoding: chunked\r\n", b"0" * 16 + good, 400),
                ("0x", "Transfer-Encoding: chunked\r\n", b"0x5\r\nhello\r\n0\r\n\r\n", 400),
                ("sign", "Transfer-Encoding: chunked\r\n", b"+5\r\nhello\r\n0\r\n\r\n", 400),
                ("no size", "Transfer-Encoding: chunked\r\n", b";x\r\nhello\r\n0\r\n\r\n", 400),
                ("data over", "Transfer-Encoding: chunked\r\n", b"5\r\nhelloXY\r\n0\r\n\r\n", 400),
                ("long ext", "Transfer-Encoding: chunked\r\n", b"5;" + b"e" * 9000 + b"\r\n", 400),
                (
                    "trailers",
                    "Transfer-Encoding: chunked\r\n",
                    b"5\r\nhello\r\n0\r\n"
                    + b"".join(b"X-%d: %s\r\n" % (n, b"t" * 5000) for n in (1, 2)),
                    431,
                ),
                (
                    "over the limit",
                    "Transfer-Encoding: chunked\r\n",
                    b"9c40\r\n" + b"a" * 40000 + b"\r\n9c40\r\n" + b"a" * 40000 + b"\r\n0\r\n\r\n",
                    413,
                ),
                ("huge chunk", "Transfer-Encoding: chunked\r\n", b"ffffffffffffffff\r\n", 413),
            ]
            for name, headers, body, status in cases:
                wire = (head + headers + "\r\n").encode("latin-1") + body + smuggled
                started = time.monotonic()
                statuses, raw = self.exchange(relay.port, wire)
                assert statuses == [status], (name, raw[:300])
                assert time.monotonic() - started < 5, name  # closed, not timed out
                error = json.loads(raw.split(b"\r\n\r\n", 1)[1])["error"]
                assert error["code"] != "UPSTREAM_TIMEOUT", name
            # HTTP/1.0 has no chunked bodies
            wire = (
                f"POST /r/{fake.server_id}{API}/notes HTTP/1.0\r\n"
                "Transfer-Encoding: chunked\r\n\r\n"
            ).encode() + good
            assert self.exchange(relay.port, wire)[0] == [400]
            assert relay_queued(relay, fake) == 0  # nothing was handed on to the server
            assert relay.request("GET", "/health")[0] == 200

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_keep_alive_serves_several_requests_on_one_connection(self, tmp_path):
        with running(tmp_path, "relay") as relay:
            conn = http.client.HTTPConnection("127.0.0.1", relay.port, timeout=5)
            for _ in range(3):
                conn.request("GET", "/health")
                resp = conn.getresponse()
                assert resp.status == 200
                assert json.loads(resp.read())["data"]["role"] == "relay"
            conn.close()

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_idle_connections_from_one_address_are_capped(self, tmp_path):
        env = {"SERVICE_RELAY_MAX_IDLE_PER_ADDRESS": "16"}
        with running(tmp_path, "relay", env=env) as relay:
            socks = []
            try:
                for _ in range(60):
                    s = socket.socket()
                    s.settimeout(5)
                    s.bind(("127.0.0.9", 0))
                    s.connect(("127.0.0.1", relay.port))
                    s.sendall(b"GET /hea")  # an incomplete request: slowloris
                    socks.append(s)
                started = time.monotonic()
                assert relay.request("GET", "/health")[0] == 200
                assert time.monotonic() - started < 1
                closed = sum(recv_all(s) == b"" for s in socks[:40])
                assert closed == 40  # the oldest went first
            finally:
                for s in socks:
                    s.close()

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_relay_serves_its_own_copy_of_the_web_client(self, pair):
        relay, _server, setup = pair
        with urllib.request.urlopen(relay.url + "/", timeout=10) as resp:
            page = resp.read().decode()
            csp = resp.headers["Content-Security-Policy"]
        assert "<title>notesvc</title>" in page
        assert "connect-src 'self'" in csp
        assert setup["links"]["connect"]["hosted"] == (
            f"{relay.url}/?relayCode={setup['pairing']['relayCode']}"
        )

    @pytest.mark.real_server
    @pytest.mark.slow
    @pytest.mark.skipif(not NGINX, reason="nginx is not installed (apt install nginx)")
    def test_two_relays_behind_nginx_share_the_servers(self, tmp_path):
        """deploy/nginx-relay.conf: servers and clients spread over two relay processes."""
        ports = [free_port(), free_port()]
        front = free_port()
        conf = (HERE / "deploy" / "nginx-relay.conf").read_text()
        conf = conf.replace("127.0.0.1:8441", f"127.0.0.1:{ports[0]}")
        conf = conf.replace("127.0.0.1:8442", f"127.0.0.1:{ports[1]}")
        conf = re.sub(
            r"    listen 443 ssl;\n.*?ssl_certificate_key [^\n]*\n",
            f"    listen 127.0.0.1:{front};\n",
            conf,
            flags=re.S,
        )
        (tmp_path / "logs").mkdir()
        (tmp_path / "nginx.conf").write_text(
            "daemon off; master_process off; pid nginx.pid; error_log logs/error.log warn;\n"
            "events { worker_connections 1024; }\n"
            "http { access_log off; client_body_temp_path tmp; proxy_temp_path tmp;\n"
            + conf
            + "\n}\n"
        )
        (tmp_path / "tmp").mkdir()
        env = {"SERVICE_TRUST_PROXY": "true", "SERVICE_RELAY_DOMAIN": DOMAIN}
        relays = [
            Server(tmp_path / f"relay{i}", "relay", env=env, port=p) for i, p in enumerate(ports)
        ]
        nginx = subprocess.Popen(
            [NGINX, "-p", str(tmp_path), "-c", "nginx.conf"], stderr=subprocess.PIPE, text=True
        )
        servers = []
        try:
            url = f"http://127.0.0.1:{front}"

            def up() -> bool:
                assert nginx.poll() is None, nginx.stderr.read()
                with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as resp:
                    return resp.status == 200
                return False

            wait_for(up)
            for i in range(10):  # until both relays hold a server (consistent hashing decides)
                servers.append(Server(tmp_path / f"srv{i}", env={"SERVICE_RELAY_URL": url}))
                held = len(servers)
                wait_for(lambda held=held: sum(map(relay_servers, relays)) == held)
                if len(servers) >= 2 and all(map(relay_servers, relays)):
                    break
            assert all(map(relay_servers, relays)), "every server landed on one relay"
            for n, server in enumerate(servers):
                setup = server.request("GET", f"{API}/system/setup")[2]["data"]
                code = setup["pairing"]["relayCode"]
                with urllib.request.urlopen(f"{url}/relay/v1/pair/{code}", timeout=10) as resp:
                    origin = json.loads(resp.read())["data"]["origin"]
                sid = setup["serverId"]
                assert origin == f"http://{sid}.{DOMAIN}:{front}"
                # By Host: the server's own origin reaches the relay process that holds it.
                host = f"{sid}.{DOMAIN}:{front}"
                status, _, raw = host_request(front, host, "GET", f"{API}/system/setup")
                assert (status, json.loads(raw)["data"]["serverId"]) == (200, sid)
                status, _, raw = host_request(
                    front, host, "GET", "/.well-known/oauth-authorization-server"
                )
                assert json.loads(raw)["issuer"] == origin
                status, _, raw = host_request(
                    front, "127.0.0.1", "GET", f"/.well-known/oauth-authorization-server/r/{sid}"
                )
                assert status == 200
                base = f"{url}/r/{sid}/api/v1"  # and the path-based JSON routes
                key = {"X-Service-Key": setup["apiKey"], "Content-Type": "application/json"}
                note = json.dumps({"path": f"notes/n{n}.md", "content": f"# Note {n}"}).encode()
                req = urllib.request.Request(f"{base}/notes", note, key, method="POST")
                with urllib.request.urlopen(req, timeout=10) as resp:
                    assert resp.status == 201
                req = urllib.request.Request(f"{base}/notes/notes%2Fn{n}.md", headers=key)
                with urllib.request.urlopen(req, timeout=10) as resp:
                    assert json.loads(resp.read())["data"]["title"] == f"Note {n}"
                req = urllib.request.Request(f"{base}/system/info", headers=key)
                with urllib.request.urlopen(req, timeout=10) as resp:
                    assert json.loads(resp.read())["data"]["connection"]["state"] == "connected"
        finally:
            for server in servers:
                server.stop()
            nginx.terminate()
            nginx.wait(10)
            nginx.stderr.close()
            for relay in relays:
                relay.stop()


class TestRelayAttachments:
    """Attachments through a relay: up to its body limit both ways, larger at once 413, and
    a server's answer never becomes a page on the relay's origin."""

    LIMIT = 65536

    @pytest.fixture
    def pair(self, tmp_path):
        env = {"SERVICE_RELAY_TIMEOUT": "10", "SERVICE_MAX_BODY_BYTES": str(self.LIMIT)}
        relay = Server(tmp_path / "relay", "relay", env=env)
        server = Server(tmp_path / "srv", env={"SERVICE_RELAY_URL": relay.url})
        try:
            wait_for(lambda: relay_servers(relay) == 1)
            setup = server.request("GET", f"{API}/system/setup")[2]["data"]
            yield relay, server, setup, tmp_path / "srv"
        finally:
            server.stop()
            relay.stop()

    @staticmethod
    def send(base: str, method: str, path: str, setup: dict, body=None, headers=None) -> tuple:
        hdrs = {"X-Service-Key": setup["apiKey"], **(headers or {})}
        req = urllib.request.Request(base + path, body, hdrs, method=method)
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, resp.headers, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, e.headers, e.read()

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_an_attachment_of_the_relays_limit_passes_both_ways(self, pair):
        relay, _, setup, root = pair
        prefix = f"/r/{setup['serverId']}{API}"
        image = (b"\x89PNG\r\n\x1a\n" + os.urandom(self.LIMIT))[: self.LIMIT]
        url = prefix + att_url("attachments/big.png")[len(API) :]
        status, _, body = self.send(
            relay.url, "PUT", url, setup, image, {"Content-Type": "image/png"}
        )
        assert status == 201, body
        assert (root / "attachments" / "big.png").read_bytes() == image
        status, headers, got = self.send(relay.url, "GET", url, setup)
        assert status == 200
        assert got == image
        assert headers["Content-Type"] == "image/png"  # its own type, for an <img> from a blob
        assert headers["Content-Disposition"] == 'attachment; filename="big.png"'
        assert headers["Content-Security-Policy"] == "default-src 'none'; sandbox"
        assert headers["X-Content-Type-Options"] == "nosniff"
        status, headers, got = self.send(
            relay.url, "GET", url, setup, headers={"Range": "bytes=100-199"}
        )
        assert status == 206
        assert got == image[100:200]
        assert headers["Content-Range"] == f"bytes 100-199/{self.LIMIT}"
        form, ctype = multipart(("path", "attachments/cam/a.jpg"), ("file", image[:60000], "a.jpg"))
        status, _, body = self.send(
            relay.url, "POST", prefix + "/attachments", setup, form, {"Content-Type": ctype}
        )
        assert status == 201, body
        assert json.loads(body)["data"]["path"] == "attachments/cam/a.jpg"

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_larger_ones_are_413_at_once_both_ways(self, pair):
        relay, server, setup, _ = pair
        prefix = f"/r/{setup['serverId']}{API}"
        url = prefix + att_url("attachments/big.zip")[len(API) :]
        with socket.create_connection(("127.0.0.1", relay.port), timeout=5) as s:
            s.sendall(
                f"PUT {url} HTTP/1.1\r\nHost: relay\r\nContent-Type: application/zip\r\n"
                f"Content-Length: {self.LIMIT + 1}\r\n\r\n".encode()
            )
            started = time.monotonic()
            answer = recv_all(s)
        assert time.monotonic() - started < 1
        assert answer.startswith(b"HTTP/1.1 413 ")
        assert str(self.LIMIT) in json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["message"]
        # One put on the server directly is too large to come back whole through the relay.
        big = os.urandom(4 * self.LIMIT)
        direct = att_url("attachments/big.zip")
        status, _, _ = self.send(
            server.url, "PUT", direct, setup, big, {"Content-Type": "application/zip"}
        )
        assert status == 201
        started = time.monotonic()
        status, headers, body = self.send(relay.url, "GET", url, setup)
        assert time.monotonic() - started < 5  # not the relay's 10 s time-out
        assert status == 413
        error = json.loads(body)["error"]
        assert error["code"] == "PAYLOAD_TOO_LARGE"
        assert str(self.LIMIT) in error["message"]
        assert "Range" in error["message"]
        assert headers["Content-Type"].startswith("application/json")
        status, _, got = self.send(
            relay.url, "GET", url, setup, headers={"Range": f"bytes=0-{self.LIMIT // 2 - 1}"}
        )
        assert status == 206
        assert got == big[: self.LIMIT // 2]

    @pytest.mark.real_server
    @pytest.mark.slow
    @pytest.mark.parametrize(
        ("served", "shown"),
        [
            ("text/html; charset=utf-8", "application/octet-stream"),
            ("image/svg+xml", "application/octet-stream"),
            ("application/xhtml+xml", "application/octet-stream"),
            ("image/png", "image/png"),
            ("audio/ogg", "audio/ogg"),
        ],
    )
    def test_a_server_cannot_publish_a_page_as_an_attachment(self, tmp_path, served, shown):
        with running(tmp_path, "relay") as relay:
            fake = FakeRelayServer(relay)
            assert fake.register() == 200
            out = []
            path = f"/r/{fake.server_id}{API}/attachments/attachments%2Fx.html"
            t = threading.Thread(target=lambda: out.append(relay_raw_get(relay, path)))
            t.start()
            _status, _, body = fake.poll()
            headers = [
                ["Content-Type", served],
                ["Content-Disposition", "inline"],
                ["Set-Cookie", "session=evil; Path=/"],
                ["Content-Security-Policy", "script-src *"],
                ["Refresh", "0; url=https://evil.example/"],
                ["ETag", '"abc"'],
            ]
            page = b"<script>alert(document.cookie)</script>"
            assert fake.reply(body["data"]["id"], 200, headers, page) == 200
            t.join(10)
        head, got = out[0]
        lines = head.lower().split("\r\n")
        assert f"content-type: {shown}" in lines
        assert 'content-disposition: attachment; filename="x.html"' in lines
        assert "content-security-policy: default-src 'none'; sandbox" in lines
        assert "x-content-type-options: nosniff" in lines
        assert 'etag: "abc"' in lines
        assert not any(
            h.startswith(("set-cookie", "refresh", "content-disposition: inline")) for h in lines
        )
        assert got == page

    def test_relay_answer_headers_of_a_download_and_of_an_api_answer(self):
        served = [["Content-Type", "image/jpeg"], ["Content-Disposition", 'inline; filename="a"']]
        download = notesvc.relay_answer_headers(
            "/api/v1/attachments/attachments/a b.jpg", served, True
        )
        assert ("Content-Type", "image/jpeg") in download
        assert ("Content-Disposition", 'attachment; filename="a_b.jpg"') in download
        answer = notesvc.relay_answer_headers("/api/v1/attachments/attachments/a.jpg", served)
        assert ("Content-Type", notesvc.JSON_TYPE) in answer  # an API answer is JSON, whatever
        assert ("Content-Disposition", 'inline; filename="a"') in answer  # on the allowlist
        gzipped = [["Content-Type", "application/json"], ["Content-Encoding", "gzip"]]
        assert ("Content-Encoding", "gzip") in notesvc.relay_answer_headers("/api/v1/x", gzipped)
        for encoding in ("br", "gzip, gzip", "identity"):  # only the server's own gzip
            coded = [["Content-Type", "application/json"], ["Content-Encoding", encoding]]
            passed = notesvc.relay_answer_headers("/api/v1/x", coded)
            assert not any(k == "Content-Encoding" for k, _ in passed)
        attached = notesvc.relay_answer_headers("/api/v1/attachments/a.json", gzipped, True)
        assert not any(k == "Content-Encoding" for k, _ in attached)  # never on file bytes
        assert notesvc.relayed_download("GET", "/api/v1/attachments/attachments/a.jpg", 206)
        for args in (
            ("GET", "/api/v1/attachments/attachments/a.jpg", 404),
            ("PUT", "/api/v1/attachments/attachments/a.jpg", 201),
            ("GET", "/api/v1/attachments", 200),
            ("GET", "/api/v1/notes/x", 200),
        ):
            assert not notesvc.relayed_download(*args)
