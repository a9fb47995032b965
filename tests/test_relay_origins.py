"""Per-server relay origins, and grants through the relay (src/notesvc/relay.py)."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from browsers import BROWSER_TESTS, CHROMIUM, CHROMIUM_ARGS, WebSession, expect, unexpected
from conftest import (
    API,
    CALLBACK,
    DOMAIN,
    PNG,
    Server,
    assert_gzipped,
    att_url,
    basic,
    notesvc,
    owner_headers,
    pkce_pair,
    post_oauth_form,
    recv_all,
    relay_servers,
    running,
    wait_for,
    zip_of,
)
from standins import FakeRelayServer, host_request


def get_raw(url: str) -> tuple:
    """GET a URL; return (status, headers, bytes)."""
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.headers, e.read()


class TestGrantsThroughTheRelay:
    pytestmark = [pytest.mark.real_server, pytest.mark.slow]

    @pytest.fixture
    def pair(self, tmp_path):
        relay = Server(tmp_path / "relay", "relay", env={"SERVICE_RELAY_TIMEOUT": "5"})
        server = Server(tmp_path / "srv", env={"SERVICE_RELAY_URL": relay.url})
        try:
            wait_for(lambda: relay_servers(relay) == 1)
            setup = server.request("GET", f"{API}/system/setup")[2]["data"]
            yield relay, server, setup
        finally:
            server.stop()
            relay.stop()

    def test_metadata_documents_name_the_relay(self, pair):
        relay, _, setup = pair
        sid = setup["serverId"]
        base = f"{relay.url}/r/{sid}"
        status, headers, raw = get_raw(
            f"{relay.url}/.well-known/oauth-protected-resource/r/{sid}/api/v1/mcp"
        )
        assert status == 200
        assert headers["Content-Type"].startswith("application/json")
        assert json.loads(raw) == {
            "resource": f"{base}/api/v1/mcp",
            "authorization_servers": [base],
            "scopes_supported": ["notes:read", "notes:write"],
            "bearer_methods_supported": ["header"],
            "resource_name": "notesvc",
        }
        for name in ("oauth-authorization-server", "openid-configuration"):
            status, _, raw = get_raw(f"{relay.url}/.well-known/{name}/r/{sid}")
            asm = json.loads(raw)
            assert status == 200
            assert asm["issuer"] == base
            assert asm["token_endpoint"] == f"{base}/oauth/token"
        status, _, _ = get_raw(f"{relay.url}/.well-known/oauth-authorization-server/r/{'a' * 20}")
        assert status == 504  # no such server connected

    def test_oauth_flow_and_pages_through_the_relay(self, pair):
        relay, _server, setup = pair
        sid = setup["serverId"]
        base = f"{relay.url}/r/{sid}"
        # The consent page is the relay's own copy, whatever the server would send.
        status, headers, page = get_raw(f"{base}/oauth/authorize?client_id=x")
        assert status == 200  # a relay without a domain: the page keeps nothing in storage
        assert page == notesvc.shared_origin_page(notesvc.consent_page()).encode()
        assert headers["X-Frame-Options"] == "DENY"
        assert "frame-ancestors 'none'" in headers["Content-Security-Policy"]
        assert get_raw(f"{relay.url}/r/NOT-AN-ID/oauth/authorize")[0] == 404
        # Registration and tokens are forwarded to the server.
        status, _, reg = relay.request(
            "POST", f"/r/{sid}/oauth/register", {"redirect_uris": [CALLBACK], "client_name": "Far"}
        )
        assert status == 201
        cid = reg["client_id"]
        verifier, challenge = pkce_pair()
        approval = {
            "clientId": cid,
            "redirectUri": CALLBACK,
            "codeChallenge": challenge,
            "scope": "notes:read",
            "resource": f"{base}/api/v1/mcp",
        }
        status, _, body = relay.request(
            "POST", f"/r/{sid}{API}/oauth/approve", approval, owner_headers(setup)
        )
        assert status == 200, body
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(body["data"]["redirect"]).query)
        assert query["iss"] == [base]
        form = {
            "grant_type": "authorization_code",
            "code": query["code"][0],
            "client_id": cid,
            "redirect_uri": CALLBACK,
            "code_verifier": verifier,
            "resource": f"{base}/api/v1/mcp",
        }
        status, tokens = post_oauth_form(f"{base}/oauth/token", form)
        assert status == 200
        assert tokens["scope"] == "notes:read"
        status, again = post_oauth_form(f"{base}/oauth/token", form)
        assert (status, again["error"]) == (400, "invalid_grant")
        status, _ = post_oauth_form(f"{base}/oauth/revoke", {"token": tokens["refresh_token"]})
        assert status == 200
        assert get_raw(f"{base}/oauth/token")[0] == 405

    def test_a_share_link_through_the_relay(self, pair):
        relay, server, setup = pair
        sid = setup["serverId"]
        owner = owner_headers(setup)
        note = {"path": "notes/p.md", "content": "# P\n\n![pic](../attachments/p.png)\n"}
        relay.request("POST", f"/r/{sid}{API}/notes", note, owner)
        put = urllib.request.Request(
            f"{relay.url}/r/{sid}{API}/attachments/attachments%2Fp.png",
            PNG,
            {**owner, "Content-Type": "application/octet-stream"},
            method="PUT",
        )
        with urllib.request.urlopen(put, timeout=30) as resp:
            assert resp.status == 201
        status, _, body = relay.request(
            "POST", f"/r/{sid}{API}/shares", {"path": "notes/p.md"}, owner
        )
        url = body["data"]["url"]
        assert status == 201
        assert url.startswith(f"{relay.url}/r/{sid}/s/")
        status, headers, page = get_raw(url)
        assert status == 200
        assert page == notesvc.shared_origin_page(notesvc.share_page()).encode()
        assert headers["Referrer-Policy"] == "no-referrer"
        assert "noindex" in headers["X-Robots-Tag"]
        token = url.rsplit("/", 1)[1]
        status, _, raw = get_raw(f"{relay.url}/r/{sid}{API}/shared/{token}")
        assert status == 200
        assert json.loads(raw)["data"]["title"] == "P"
        image = f"{relay.url}/r/{sid}{API}/shared/{token}/attachments/attachments/p.png"
        status, headers, raw = get_raw(image)
        assert (status, raw, headers["Content-Type"]) == (200, PNG, "image/png")
        assert headers["Content-Security-Policy"] == notesvc.RELAY_ANSWER_CSP
        assert get_raw(f"{relay.url}/r/{sid}/s/..%2F..%2Fetc")[0] == 404
        # A share made directly in relay mode names the relay too.
        status, _, direct = server.request("POST", f"{API}/shares", {"path": "notes/p.md"}, owner)
        assert direct["data"]["url"].startswith(f"{relay.url}/r/{sid}/s/")


class TestRelayOrigins:
    """SERVICE_RELAY_DOMAIN: every server on its own origin, codes no one else can take,
    answers the relay vets; against a real relay and real servers (Host headers)."""

    pytestmark = [pytest.mark.real_server, pytest.mark.slow]

    def test_links_share_urls_and_oauth_name_the_servers_own_origin(self, origins):
        relay, server, setup, origin = origins
        host = urllib.parse.urlsplit(origin).netloc
        key = {"X-Service-Key": setup["apiKey"]}
        links = setup["links"]
        assert links["apiBase"] == links["relayApiBase"] == f"{origin}{API}"
        code = setup["pairing"]["relayCode"]
        assert links["connect"]["hosted"] == f"{origin}/?relayCode={code}"
        assert links["directApiBase"] == f"{server.url}{API}"  # the LAN route stays
        status, _, raw = host_request(
            relay.port, f"127.0.0.1:{relay.port}", "GET", "/relay/v1/info"
        )
        assert status == 200
        assert json.loads(raw)["data"] == {
            "domain": DOMAIN,
            "perServerOrigins": True,
            "publicUrl": relay.url,
            "passthrough": False,  # SERVICE_RELAY_TLS is off
        }
        # The API on the origin, as the server's own paths.
        status, _, raw = host_request(relay.port, host, "POST", f"{API}/auth/verify", headers=key)
        assert status == 200
        assert json.loads(raw)["data"]["serverId"] == setup["serverId"]
        body = {"path": "notes/p.md", "content": "# P\n\nshared"}
        assert host_request(relay.port, host, "POST", f"{API}/notes", body, key)[0] == 201
        status, _, raw = host_request(
            relay.port, host, "POST", f"{API}/shares", {"path": "notes/p.md"}, key
        )
        assert status == 201
        share = json.loads(raw)["data"]["url"]
        assert share.startswith(f"{origin}/s/")
        token = share.rsplit("/", 1)[1]
        status, headers, page = host_request(relay.port, host, "GET", f"/s/{token}")
        assert status == 200
        assert page == notesvc.share_page().encode()  # storage allowed: its own origin
        status, _, raw = host_request(relay.port, host, "GET", f"{API}/shared/{token}")
        assert json.loads(raw)["data"]["content"] == "# P\n\nshared"
        # A share made through the server directly names the relay origin too.
        status, _, body = server.request("POST", f"{API}/shares", {"path": "notes/p.md"}, key)
        assert body["data"]["url"].startswith(f"{origin}/s/")
        # OAuth: issuer, endpoints, resource and the 401's metadata URL on the origin.
        status, _, raw = host_request(
            relay.port, host, "GET", "/.well-known/oauth-authorization-server"
        )
        meta = json.loads(raw)
        assert meta["issuer"] == origin
        assert meta["authorization_endpoint"] == f"{origin}/oauth/authorize"
        status, headers, _ = host_request(relay.port, host, "POST", f"{API}/mcp", b"{}")
        assert status == 401
        assert (
            f'resource_metadata="{origin}/.well-known/oauth-protected-resource/api/v1/mcp"'
            in (headers["WWW-Authenticate"])
        )
        status, headers, page = host_request(relay.port, host, "GET", "/oauth/authorize?x=1")
        assert status == 200
        assert page == notesvc.consent_page().encode()
        assert headers["X-Frame-Options"] == "DENY"
        status, headers, page = host_request(relay.port, host, "GET", "/")
        assert page == notesvc.web_client_page().encode()
        assert 'data-origin="shared"' not in page.decode()
        # The path-based JSON routes stay, with their own issuer (connectors set up before).
        status, _, body = relay.request(
            "POST", f"/r/{setup['serverId']}{API}/auth/verify", None, key
        )
        assert status == 200
        status, _, raw = get_raw(
            f"{relay.url}/.well-known/oauth-authorization-server/r/{setup['serverId']}"
        )
        assert json.loads(raw)["issuer"] == f"{relay.url}/r/{setup['serverId']}"

    def test_the_relays_own_host_opens_no_server(self, origins):
        relay, _, setup, origin = origins
        sid, code = setup["serverId"], setup["pairing"]["relayCode"]
        status, headers, page = get_raw(f"{relay.url}/")
        assert status == 200
        assert page == notesvc.RELAY_LANDING_PAGE
        _, gz_headers, packed = host_request(
            relay.port, f"127.0.0.1:{relay.port}", "GET", "/", headers={"Accept-Encoding": "gzip"}
        )
        assert assert_gzipped(gz_headers, packed) == notesvc.RELAY_LANDING_PAGE
        assert b"<script" not in page
        assert headers["Content-Security-Policy"].startswith("default-src 'none'")
        # Old connect links and old browser links go on to the server's own origin.
        for old, new in (
            (f"/?relayCode={code}", f"{origin}/"),
            (f"/?relayCode={code.upper()}", f"{origin}/"),
            (f"/r/{sid}/", f"{origin}/"),
            (
                f"/r/{sid}/oauth/authorize?client_id=a&state=b",
                f"{origin}/oauth/authorize?client_id=a&state=b",
            ),
            (f"/r/{sid}/s/tok_en-1", f"{origin}/s/tok_en-1"),
        ):
            status, headers, _ = host_request(relay.port, f"127.0.0.1:{relay.port}", "GET", old)
            assert (status, headers["Location"]) == (302, new), old
        assert host_request(relay.port, DOMAIN, "GET", "/?relayCode=zzzzzzzzzzzzzzzz")[0] == 404
        assert host_request(relay.port, DOMAIN, "GET", "/r/NOT-AN-ID/")[0] == 404
        # The relay's host forwards nothing but the path-based routes.
        for path in (f"{API}/health", "/dav/notes/", "/s/abc", "/oauth/authorize"):
            assert host_request(relay.port, DOMAIN, "GET", path)[0] == 404, path
        # A name that is not <serverId>.<domain> is the relay's own host.
        for host in (
            f"evil.{DOMAIN}",
            f"{sid}.other.test",
            f"x.{sid}.{DOMAIN}",
            f"{sid}.{DOMAIN}.evil",
        ):
            assert host_request(relay.port, host, "GET", f"{API}/health")[0] == 404, host

    def test_old_connectors_authorise_on_the_origin_with_their_path_based_resource(self, origins):
        relay, _, setup, origin = origins
        sid, host = setup["serverId"], urllib.parse.urlsplit(origin).netloc
        old_base = f"{relay.url}/r/{sid}"
        status, _, raw = relay.request(
            "POST", f"/r/{sid}/oauth/register", {"redirect_uris": [CALLBACK], "client_name": "Old"}
        )
        client_id = raw["client_id"]
        verifier, challenge = pkce_pair()
        query = urllib.parse.urlencode(
            {
                "response_type": "code",
                "client_id": client_id,
                "redirect_uri": CALLBACK,
                "state": "s1",
                "code_challenge": challenge,
                "code_challenge_method": "S256",
                "resource": f"{old_base}/api/v1/mcp",
            }
        )
        status, _, raw = host_request(relay.port, host, "GET", f"{API}/oauth/consent?{query}")
        assert status == 200, raw
        assert json.loads(raw)["data"]["resource"] == f"{old_base}/api/v1/mcp"
        approve = {
            "clientId": client_id,
            "redirectUri": CALLBACK,
            "state": "s1",
            "codeChallenge": challenge,
            "scope": "notes:read",
            "resource": f"{old_base}/api/v1/mcp",
        }
        key = {"X-Service-Key": setup["apiKey"]}
        status, _, raw = host_request(
            relay.port, host, "POST", f"{API}/oauth/approve", approve, key
        )
        assert status == 200, raw
        redirect = json.loads(raw)["data"]["redirect"]
        params = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(redirect).query))
        assert params["iss"] == old_base
        form = urllib.parse.urlencode(
            {
                "grant_type": "authorization_code",
                "code": params["code"],
                "redirect_uri": CALLBACK,
                "client_id": client_id,
                "code_verifier": verifier,
                "resource": f"{old_base}/api/v1/mcp",
            }
        ).encode()
        req = urllib.request.Request(
            f"{old_base}/oauth/token", form, {"Content-Type": "application/x-www-form-urlencoded"}
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            token = json.loads(resp.read())["access_token"]
        ping = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
        status, _, body = relay.request(
            "POST", f"/r/{sid}{API}/mcp", ping, {"Authorization": f"Bearer {token}"}
        )
        assert (status, body["result"]) == (200, {})
        # Another server's resource is refused on this origin.
        approve["resource"] = f"{relay.url}/r/{'a' * 20}/api/v1/mcp"
        assert (
            host_request(relay.port, host, "POST", f"{API}/oauth/approve", approve, key)[0] == 400
        )

    def test_a_code_belongs_to_the_server_whose_token_it_derives_from(self, origins):
        relay, _, setup, _ = origins
        code = setup["pairing"]["relayCode"]
        stranger = FakeRelayServer(relay)
        assert stranger.register() == 200
        # Taking the owner's (public) code: on register and on the code call, 403.
        body = {"token": stranger.token, "relayCode": code}
        assert stranger.call("POST", f"/relay/v1/register/{stranger.server_id}", body)[0] == 403
        body = {"serverId": stranger.server_id, "token": stranger.token}
        status, _, answer = stranger.call("POST", f"/relay/v1/code/{code}", body)
        assert (status, answer["error"]["code"]) == (403, "FORBIDDEN")
        status, _, body = relay.request("GET", f"/relay/v1/pair/{code}")
        assert body["data"]["serverId"] == setup["serverId"]
        # Its own code it may map; a made-up one it may not.
        body = {"serverId": stranger.server_id, "token": stranger.token}
        assert stranger.call("POST", f"/relay/v1/code/{stranger.code}", body)[0] == 200
        assert stranger.call("POST", "/relay/v1/code/MADE-UP-CODE", body)[0] == 403

    def test_code_calls_count_as_registrations_and_the_codes_held_are_capped(self, tmp_path):
        """A code call is a registration of the code (behind a load balancer that hashes on
        the code, the server's own registration lives in another relay process): it counts
        toward the per-address limit, expires, and the codes held are capped."""
        env = {"SERVICE_RELAY_REGISTRATIONS_PER_MINUTE": "5", "SERVICE_RELAY_MAX_SERVERS": "2"}
        with running(tmp_path, "relay", env=env) as relay:
            held = []
            for n in range(3):
                fake = FakeRelayServer(relay, source=f"127.0.0.{n + 3}")
                body = {"serverId": fake.server_id, "token": fake.token}
                held.append(fake.call("POST", f"/relay/v1/code/{fake.code}", body)[0])
                if n == 0:
                    first = fake
            assert held == [200, 200, 429]  # at most SERVICE_RELAY_MAX_SERVERS codes
            status, _, body = relay.request("GET", f"/relay/v1/pair/{first.code}")
            assert (status, body["data"]["serverId"]) == (200, first.server_id)
            # The same code again holds nothing more; every call counts toward the limit.
            body = {"serverId": first.server_id, "token": first.token}
            answers = [
                first.call("POST", f"/relay/v1/code/{first.code}", body)[0] for _ in range(5)
            ]
            assert answers == [200] * 4 + [429]
            # A registered server's code is its own, whatever the cap on the others.
            other = FakeRelayServer(relay, source="127.0.0.9")
            assert other.register() == 200
            assert relay.request("GET", f"/relay/v1/pair/{other.code}")[0] == 200

    def test_a_server_cannot_make_the_relay_serve_a_page(self, tmp_path):
        env = {"SERVICE_RELAY_DOMAIN": DOMAIN, "SERVICE_RELAY_TIMEOUT": "5"}
        with running(tmp_path, "relay", env=env) as relay:
            evil = FakeRelayServer(relay)
            assert evil.register() == 200
            hostile = [
                ["Content-Type", "text/html; x=json"],
                ["X-Frame-Options", "ALLOWALL"],
                ["Set-Cookie", "a=b"],
                ["Refresh", "0; url=https://evil.example/"],
                ["Link", "<https://evil.example/x.css>; rel=stylesheet"],
                ["Content-Security-Policy", "default-src *"],
                ["Access-Control-Allow-Origin", "*"],
                ["Service-Worker-Allowed", "/"],
                ["ETag", '"e1"'],
                ["X-Request-Id", "r1"],
                ["Retry-After", "3"],
            ]
            body = b"<script>alert(1)</script>"
            for host, path in (
                (f"{evil.server_id}.{DOMAIN}:{relay.port}", f"{API}/openapi.json"),
                (f"127.0.0.1:{relay.port}", f"/r/{evil.server_id}{API}/openapi.json"),
                (f"{evil.server_id}.{DOMAIN}", "/dav/notes/a.html"),
                (f"{evil.server_id}.{DOMAIN}", f"{API}/export.zip"),
            ):
                answers: dict = {}

                def client(host=host, path=path, answers=answers):
                    answers["r"] = host_request(relay.port, host, "GET", path)

                t = threading.Thread(target=client)
                t.start()
                status, _, polled = evil.poll()
                assert status == 200
                assert evil.reply(polled["data"]["id"], 200, hostile, body) == 200
                t.join(10)
                status, headers, raw = answers["r"]
                assert status == 200
                assert raw == body  # the bytes pass; nothing makes them a page
                ctype = headers["Content-Type"]
                assert ctype in (notesvc.JSON_TYPE, "application/octet-stream"), (path, ctype)
                assert headers["X-Content-Type-Options"] == "nosniff"
                assert headers["Content-Security-Policy"] == notesvc.RELAY_ANSWER_CSP
                names = {k.lower() for k in headers}
                for dropped in ("x-frame-options", "set-cookie", "refresh", "link"):
                    assert dropped not in names, (path, dropped)
                assert "access-control-allow-origin" not in names
                assert "service-worker-allowed" not in names
                assert (headers["ETag"], headers["X-Request-Id"], headers["Retry-After"]) == (
                    '"e1"',
                    "r1",
                    "3",
                )

    def test_a_servers_origin_takes_the_bodies_its_relay_path_takes(self, origins):
        """S6: the same request gets the same limit on <serverId>.<domain> as on /r/<id>/
        (the relay's SERVICE_MAX_BODY_BYTES, 1 MiB here), not the relay's own 64 KiB."""
        relay, server, setup, origin = origins
        sid, root = setup["serverId"], Path(server.proc.args[-1])
        key = {"X-Service-Key": setup["apiKey"]}
        limit = 1048576
        text = ("# Long\n\n" + "Grüße, 🗝️ and a line of words.\n" * 4000)[:100_000]
        image = PNG + os.urandom(1_000_000 - len(PNG))
        archive = zip_of({"big.md": "# Big\n\n" + os.urandom(100_000).hex()})  # ~100 KB
        assert len(archive) > 65536
        for host, prefix in (
            (urllib.parse.urlsplit(origin).netloc, ""),
            (f"127.0.0.1:{relay.port}", f"/r/{sid}"),
        ):
            name = "origin" if not prefix else "path"
            body = {"path": f"notes/long-{name}.md", "content": text}
            status, headers, raw = host_request(
                relay.port, host, "POST", f"{prefix}{API}/notes", body, key
            )
            assert status == 201, (host, raw[:300])
            assert headers["Location"] == f"{prefix}{API}/notes/notes%2Flong-{name}.md"
            assert (root / f"notes/long-{name}.md").read_text() == text
            url = prefix + att_url(f"attachments/photo-{name}.png")
            status, _, raw = host_request(
                relay.port, host, "PUT", url, image, {**key, "Content-Type": "image/png"}
            )
            assert status == 201, (host, raw[:300])
            status, _, got = host_request(relay.port, host, "GET", url, None, key)
            assert (status, got) == (200, image)
            status, _, raw = host_request(
                relay.port,
                host,
                "POST",
                f"{prefix}{API}/import?dryRun=true",
                archive,
                {**key, "Content-Type": "application/zip"},
            )
            assert status == 200, (host, raw[:300])
            assert json.loads(raw)["data"]["created"] == 1
            # One byte over: 413 at once, the same both ways.
            with socket.create_connection(("127.0.0.1", relay.port), timeout=5) as s:
                s.sendall(
                    f"PUT {url} HTTP/1.1\r\nHost: {host}\r\nContent-Type: image/png\r\n"
                    f"Content-Length: {limit + 1}\r\n\r\n".encode()
                )
                answer = recv_all(s)
            assert answer.startswith(b"HTTP/1.1 413 "), (host, answer[:200])
            assert str(limit) in json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["message"]
        # WebDAV is on the origin only: a PUT of a file over 64 KiB.
        host = urllib.parse.urlsplit(origin).netloc
        dav = {"Authorization": basic(setup["apiKey"]), "Content-Type": "image/png"}
        status, _, raw = host_request(
            relay.port, host, "PUT", "/dav/attachments/dav.png", image[:300_000], dav
        )
        assert status == 201, raw[:300]
        assert (root / "attachments/dav.png").read_bytes() == image[:300_000]

    def test_curl_uploads_chunked_through_both_hosts(self, origins, tmp_path):
        """S8: `curl -T file -H 'Transfer-Encoding: chunked'` (how Finder and Windows send
        uploads) through the relay stores the file; over the limit it is 413."""
        curl = shutil.which("curl")
        if not curl:
            pytest.skip("no curl on this machine (Debian: apt install curl)")
        relay, server, setup, origin = origins
        sid, root, key = setup["serverId"], Path(server.proc.args[-1]), setup["apiKey"]
        resolve = ["--resolve", f"{sid}.{DOMAIN}:{relay.port}:127.0.0.1"]
        data = PNG + os.urandom(400_000)
        (tmp_path / "photo.png").write_bytes(data)
        (tmp_path / "big.bin").write_bytes(os.urandom(1048576 + 1))

        def curl_put(url: str, name: str, auth: list) -> int:
            command = [curl, "-sS", "-o", os.devnull, "-w", "%{http_code}", *resolve, *auth]
            command += ["-H", "Transfer-Encoding: chunked", "-T", str(tmp_path / name), url]
            done = subprocess.run(
                command,
                capture_output=True,
                text=True,
                timeout=60,
                env={k: v for k, v in os.environ.items() if "proxy" not in k.lower()},
            )
            return int(done.stdout or 0)

        header = ["-H", f"X-Service-Key: {key}", "-H", "Content-Type: image/png"]
        for base, auth in (
            (f"{relay.url}/r/{sid}{API}/attachments/attachments%2F", header),
            (f"{origin}{API}/attachments/attachments%2F", header),
            (f"{origin}/dav/attachments/", ["-u", f"me:{key}"]),
        ):
            name = f"c{len(list(root.glob('attachments/c*')))}.png"
            assert curl_put(base + name, "photo.png", auth) == 201, base
            assert (root / "attachments" / name).read_bytes() == data
            assert curl_put(base + "big.bin", "big.bin", auth) == 413, base
            assert not (root / "attachments/big.bin").exists()

    def test_a_servers_location_passes_only_to_the_origin_the_request_came_to(self, tmp_path):
        """S5: no open redirect on the relay's origins. A registered server (here a stand-in
        speaking the relay's server protocol) answers 302 with a Location of its choice."""
        env = {"SERVICE_RELAY_DOMAIN": DOMAIN, "SERVICE_RELAY_TIMEOUT": "5"}
        with running(tmp_path, "relay", env=env) as relay:
            evil = FakeRelayServer(relay)
            assert evil.register() == 200
            sid, port = evil.server_id, relay.port
            shared, own = f"127.0.0.1:{port}", f"{sid}.{DOMAIN}:{port}"
            other = f"http://{'a' * 20}.{DOMAIN}:{port}/"
            foreign = [
                "https://evil.example/",
                "HTTPS://EVIL.EXAMPLE/login",
                "//evil.example/x",
                "///evil.example/x",
                "/\\evil.example/x",
                "\\\\evil.example",
                "https:evil.example",
                "javascript:alert(1)",
                f"http://{shared}@evil.example/",
                f"http://{own}@evil.example/",
                f"http://{shared}.evil.example/",
                other,
            ]
            relative = [f"/r/{sid}{API}/notes/notes%2Fa.md", f"{API}/x", "./x?y=1", "?page=2"]
            for host, path, same, cross in (
                (shared, f"/r/{sid}{API}/x", f"http://{shared}/r/{sid}{API}/x", f"http://{own}/"),
                (own, f"{API}/x", f"http://{own}{API}/x", None),
                (own, "/dav/notes/", f"http://{own}/dav/notes/a.md", None),
            ):
                # the server's own origin passes from its path-based routes; the relay's
                # shared host is another origin for a request to the server's own
                passes = relative + [same] + ([cross] if cross else [])
                drops = foreign + ([] if cross else [f"http://{shared}/r/{sid}{API}/x"])
                for location in passes + drops:
                    answers: dict = {}

                    def client(host=host, path=path, answers=answers):
                        answers["r"] = host_request(port, host, "GET", path)

                    t = threading.Thread(target=client)
                    t.start()
                    status, _, polled = evil.poll()
                    assert status == 200
                    headers = [["Location", location], ["Content-Type", "application/json"]]
                    assert evil.reply(polled["data"]["id"], 302, headers, b"{}") == 200
                    t.join(10)
                    status, got, _ = answers["r"]
                    assert status == 302
                    expected = location if location in passes else None
                    assert got.get("Location") == expected, (host, path, location)


class Stranger(FakeRelayServer):
    """Another person's server on the same relay: it records every request it is handed
    (what a page of someone else's would send it) and answers each with an empty 200."""

    def __init__(self, relay: Server):
        super().__init__(relay)
        self.seen: list = []
        self.stopped = threading.Event()
        assert self.register() == 200
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopped.is_set():
            with contextlib.suppress(OSError):
                status, _, body = self.poll()
                if status == 200:
                    request = body["data"]
                    self.seen.append(request)
                    answer = json.dumps({"success": True, "data": {}}).encode()
                    self.reply(request["id"], 200, [["Content-Type", "application/json"]], answer)

    def keys_seen(self) -> list:
        """Every credential a request handed to this server carried."""
        found = []
        for request in self.seen:
            for name, value in request["headers"]:
                if name.lower() in ("x-service-key", "authorization", "x-api-key"):
                    found.append(value)
            found += re.findall(
                r"ns[kdg]_[A-Za-z0-9_-]{20,}", base64.b64decode(request["body"]).decode("latin-1")
            )
        return found

    def close(self) -> None:
        self.stopped.set()


@pytest.fixture(scope="class")
def relay_browser():
    """Chromium resolving *.relay.test (and relay.test) to loopback: per-server origins."""
    sync_api = pytest.importorskip("playwright.sync_api")
    if not CHROMIUM:
        pytest.skip("no Chromium on this machine")
    rules = f"--host-resolver-rules=MAP *.{DOMAIN} 127.0.0.1, MAP {DOMAIN} 127.0.0.1"
    with sync_api.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=[*CHROMIUM_ARGS, rules])
        try:
            yield chromium
        finally:
            chromium.close()


class TestRelayOriginsInChromium:
    """The attack run's F1 and F3, in Chromium against a real relay: a stranger's server on
    the same relay must receive no key, and an SVG must not become a page of the origin."""

    pytestmark = BROWSER_TESTS

    def test_copy_works_on_plain_http_and_errors_show_in_their_dialog(
        self, relay_browser, tmp_path
    ):
        server = Server(tmp_path / "srv")
        try:
            key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]
            s = WebSession(relay_browser, tmp_path, "phone")
            page = s.page
            url = f"http://{DOMAIN}:{server.port}/"  # a name, plain HTTP: no secure context
            page.goto(url)
            assert page.evaluate("window.isSecureContext") is False
            assert page.evaluate("typeof navigator.clipboard") == "undefined"
            page.fill("#key", key)
            page.click("#connect")
            expect(page.locator("#app")).to_be_visible()
            page.click("#menu summary")
            page.click("#menu-keys")
            page.click("#add-device")
            s.dialog_choose("make")
            page.click("#dlg-body .once button")
            toast = page.locator("#dlg #toast")  # inside the dialog, above its backdrop
            expect(toast).to_have_text("Link copied")
            expect(toast).to_be_visible()
            s.dialog_choose("cancel")
            page.click("#add-folder")
            page.fill("#device-name", "Anna")
            s.dialog_choose("make")  # no folder named: the dialog says so, and keeps the name
            expect(page.locator("#dlg #dlg-error")).to_contain_text("Name the folder")
            expect(page.locator("#device-name")).to_have_value("Anna")
            assert unexpected(s.close()) == []
        finally:
            server.stop()

    def test_a_strangers_code_delivers_no_key(self, relay_browser, origins, tmp_path):
        relay, _, setup, origin = origins
        stranger = Stranger(relay)
        try:
            s = WebSession(relay_browser, tmp_path, "phone")
            page = s.page
            # The owner signs in on the server's own origin and keeps the key there.
            page.goto(setup["links"]["connect"]["hosted"])
            expect(page.locator("#login")).to_be_visible()  # a code in the URL: no auto-connect
            expect(page.locator("#shared-origin")).to_be_hidden()
            page.check("#remember")
            page.fill("#key", setup["apiKey"])
            page.click("#connect")
            page.wait_for_selector("#tree button, #tree .empty")
            assert urllib.parse.urlsplit(page.url).netloc == urllib.parse.urlsplit(origin).netloc
            assert page.evaluate("localStorage.getItem('notesvc.keyFor')") == API
            # The attack: one visit to the relay with the stranger's code.
            page.goto(f"http://{DOMAIN}:{relay.port}/?relayCode={stranger.code}")
            stranger_origin = f"http://{stranger.server_id}.{DOMAIN}:{relay.port}"
            page.wait_for_url(f"{stranger_origin}/")
            expect(page.locator("#login")).to_be_visible()  # another origin: nothing kept
            assert page.evaluate("localStorage.length") == 0
            page.click("#connect")  # even a click sends nothing without a key typed
            expect(page.locator("#login-msg")).to_contain_text("Paste the API key")
            # Belt and braces, on the owner's origin: a code there for the stranger's server
            # never sends the kept key; it leaves for the stranger's own page instead.
            page.goto(f"{origin}/?relayCode={stranger.code}")
            expect(page.locator("#login")).to_be_visible()
            page.click("#connect")
            page.wait_for_url(f"{stranger_origin}/")
            # And the owner's own code on the owner's origin: one click, the kept key.
            page.goto(setup["links"]["connect"]["hosted"])
            expect(page.locator("#login")).to_be_visible()
            page.click("#connect")
            page.wait_for_selector("#tree button, #tree .empty")
            s.shot("relay-origin")
            assert unexpected(s.close()) == []  # each request was answered: seen before that
        finally:
            stranger.close()
        assert stranger.keys_seen() == []

    def test_an_svg_attachment_never_runs_on_the_origin(self, relay_browser, origins, tmp_path):
        relay, server, setup, origin = origins
        host = urllib.parse.urlsplit(origin).netloc
        key = {"X-Service-Key": setup["apiKey"]}
        svg = (
            b'<svg xmlns="http://www.w3.org/2000/svg" width="20" height="20">'
            b'<rect width="20" height="20" fill="red"/><script>'
            b"try { document.title = 'stolen:' + localStorage.getItem('notesvc.key'); }"
            b" catch (e) { document.title = 'refused'; }</script></svg>"
        )
        path = urllib.parse.quote("attachments/family/x.svg", safe="")
        status, _, _ = host_request(
            relay.port,
            host,
            "PUT",
            f"{API}/attachments/{path}",
            svg,
            {**key, "Content-Type": "image/svg+xml"},
        )
        assert status == 201
        note = {"path": "notes/pic.md", "content": "# Pic\n\n![[attachments/family/x.svg|x]]\n"}
        assert host_request(relay.port, host, "POST", f"{API}/notes", note, key)[0] == 201
        s = WebSession(relay_browser, tmp_path, "desktop")
        page = s.page
        page.goto(f"{origin}/")
        page.check("#remember")
        page.fill("#key", setup["apiKey"])
        page.click("#connect")
        s.tree_open("notes/pic.md")
        img = page.locator("#view img[alt='x']")
        expect(img).to_have_js_property("naturalWidth", 20)  # it shows
        src = img.get_attribute("src")
        assert src.startswith("data:image/svg+xml"), src[:40]  # never a blob: of this origin
        # Opened alone (a new tab), it has no origin of ours to read.
        other = s.context.new_page()
        with contextlib.suppress(Exception):
            other.goto(src)
        title = other.title()
        assert "nsk_" not in title
        # Straight from the API (the relay's answer), it is a download, never a page.
        status, headers, _ = host_request(
            relay.port, host, "GET", f"{API}/attachments/{path}", headers=key
        )
        assert headers["Content-Type"] == "application/octet-stream"
        assert headers["Content-Disposition"].startswith("attachment")
        assert "nsk_" not in (page.title() + other.title())
        s.close()
        # On the server's own address the SVG comes typed image/svg+xml: shown the same way.
        s = WebSession(relay_browser, tmp_path, "desktop")
        s.login(f"{server.url}/", setup["apiKey"])
        s.tree_open("notes/pic.md")
        img = s.page.locator("#view img[alt='x']")
        expect(img).to_have_js_property("naturalWidth", 20)
        assert img.get_attribute("src").startswith("data:image/svg+xml")
        assert unexpected(s.close()) == []
