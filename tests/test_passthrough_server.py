"""Passthrough end to end: a certificate from pebble through the relay's DNS, TLS ended on
the server, every client through the relay by name, and what the relay sees
(src/notesvc/passthrough/server.py, relay_client.py)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import secrets
import shutil
import subprocess
import time
import types
from pathlib import Path

import pytest

from conftest import API, DOMAIN, Server, wait_for
from passthrough_kit import (
    CURL,
    ConnectProxy,
    Pebble,
    RecordingProxy,
    TlsClient,
    connection_of,
    passthrough_relay,
    relay_ports,
    tls_json,
    wait_passthrough,
)

REAL = [pytest.mark.real_server, pytest.mark.slow]
RCLONE = shutil.which("rclone")


@contextlib.contextmanager
def acme_pair(base: Path, ca, validity: int = 0, link_proxy: bool = False, **env: str):
    """A passthrough relay, pebble checking DNS-01 against the relay's DNS, and a server
    that gets its certificate from pebble and serves in passthrough mode. With
    `link_proxy`, the server's link to its relay goes through a RecordingProxy."""
    relay = passthrough_relay(base / "relay", ca)
    pebble = server = recorder = None
    try:
        ports = relay_ports(relay)
        pebble = Pebble(base / "pebble", ca, f"127.0.0.1:{ports['dns']}", validity=validity)
        link = relay.url
        if link_proxy:
            recorder = RecordingProxy(relay.port)
            link = f"http://127.0.0.1:{recorder.port}"
        settings = {
            "SERVICE_RELAY_URL": link,
            "SERVICE_ACME_DIRECTORY": pebble.directory,
            "SERVICE_ACME_CA_FILE": str(ca.path),
            "SERVICE_ACME_EMAIL": "owner@example.org",
            **env,
        }
        server = Server(base / "srv", env=settings)
        setup = server.request("GET", f"{API}/system/setup")[2]["data"]
        key = setup["apiKey"]
        connection = wait_passthrough(server, key, timeout=60)
        yield types.SimpleNamespace(
            relay=relay,
            pebble=pebble,
            server=server,
            ports=ports,
            tls=ports["tls"],
            sid=setup["serverId"],
            name=f"{setup['serverId']}.{DOMAIN}",
            origin=f"https://{setup['serverId']}.{DOMAIN}:{ports['tls']}",
            key=key,
            root=base / "srv",
            connection=connection,
            link=recorder,
        )
    finally:
        for part in (server, pebble, relay, recorder):
            if part is not None:
                (part.close if hasattr(part, "close") and part is recorder else part.stop)()


@pytest.fixture(scope="class")
def pt(tmp_path_factory, test_ca):
    with acme_pair(tmp_path_factory.mktemp("acme"), test_ca) as found:
        yield found


def key_of(pt) -> dict:
    return {"X-Service-Key": pt.key}


class TestEndToEnd:
    pytestmark = REAL

    def test_the_server_got_its_certificate_from_pebble_through_the_relays_dns(self, pt):
        cert = pt.connection["passthrough"]["certificate"]
        assert cert["name"] == pt.name
        assert cert["state"] == "valid"
        assert cert["certificate"]["issuer"].startswith("Pebble Intermediate CA")
        assert cert["acmeDirectory"] == pt.pebble.directory
        assert pt.connection["passthrough"]["origin"] == pt.origin
        kept = pt.root / ".notesvc" / "tls"
        assert oct(kept.stat().st_mode & 0o777) == "0o700"
        for name in ("server.pem", "account.pem"):
            assert oct((kept / name).stat().st_mode & 0o777) == "0o600"
        said = "relay: this server's own origin there is " + pt.origin
        wait_for(lambda: said in "".join(pt.server.lines))  # (the log is written in batches)

    def test_python_ssl_verifies_the_chain_and_the_name(self, pt):
        import ssl

        status, answer = tls_json(pt.tls, pt.name, pt.pebble.root_path, "GET", f"{API}/health")
        assert status == 200
        assert answer["data"]["status"] == "ok"
        with pytest.raises(ssl.SSLCertVerificationError, match="unable to get local issuer"):
            TlsClient(pt.tls, pt.name, pt.pebble.ca.path)  # another root: refused

    @pytest.mark.skipif(not CURL, reason="curl is not installed")
    def test_curl_writes_and_reads_a_note(self, pt):
        base = f"{pt.origin}{API}"
        common = [
            CURL, "-sS", "--fail-with-body", "--cacert", str(pt.pebble.root_path),
            "--resolve", f"{pt.name}:{pt.tls}:127.0.0.1", "-H", f"X-Service-Key: {pt.key}",
        ]  # fmt: skip
        body = json.dumps({"path": "notes/curl.md", "content": "# Curl\n\nthrough TLS\n"})
        made = subprocess.run(
            [*common, "-H", "Content-Type: application/json", "-d", body, f"{base}/notes"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert made.returncode == 0, made.stderr + made.stdout
        facts = "\n%{ssl_verify_result} %{http_version}"
        read = subprocess.run(
            [*common, "-w", facts, f"{base}/notes/notes%2Fcurl.md"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        body, _, facts = read.stdout.rpartition("\n")
        assert json.loads(body)["data"]["content"] == "# Curl\n\nthrough TLS\n"
        assert facts == "0 1.1"  # verified; HTTP/1.1 (no h2 offered)

    @pytest.mark.skipif(not RCLONE, reason="rclone is not installed (apt install rclone)")
    def test_rclone_over_webdav_through_a_connect_proxy(self, pt, tmp_path):
        from test_http_dav import rclone_env

        proxy = ConnectProxy()
        try:
            env = rclone_env(f"{pt.origin}/dav/", pt.key)
            env.update(HTTPS_PROXY=proxy.url, RCLONE_CA_CERT=str(pt.pebble.root_path))
            for name in ("https_proxy", "NO_PROXY", "no_proxy"):
                env.pop(name, None)
            local = tmp_path / "vault"
            (local / "sub").mkdir(parents=True)
            (local / "a.md").write_text("# A\n\nfrom rclone\n")
            (local / "sub/b.md").write_text("# B\n")
            run = lambda *args: subprocess.run(  # noqa: E731
                [RCLONE, *args], capture_output=True, text=True, env=env, timeout=120
            )
            done = run("sync", str(local), ":webdav:notes/rclone")
            assert done.returncode == 0, done.stderr[-2000:]
            assert (pt.root / "notes/rclone/sub/b.md").read_text() == "# B\n"
            done = run("check", "--download", str(local), ":webdav:notes/rclone")
            assert "0 differences found" in done.stderr
        finally:
            proxy.close()
        assert f"{pt.name}:{pt.tls}" in proxy.asked

    def test_the_caldav_library_through_a_connect_proxy(self, pt):
        caldav = pytest.importorskip("caldav")
        body = {"path": "notes/home/todo.md", "content": "# Todo\n\n- [ ] buy milk\n"}
        assert pt.server.request("POST", f"{API}/notes", body, key_of(pt))[0] == 201
        proxy = ConnectProxy()
        try:
            client = caldav.DAVClient(
                url=f"{pt.origin}/.well-known/caldav",
                username="me",
                password=pt.key,
                proxy=proxy.url,
                ssl_verify_cert=str(pt.pebble.root_path),
            )
            with client:
                lists = {c.get_display_name(): c for c in client.principal().calendars()}
                todos = lists["home"].todos()
                assert [str(t.icalendar_component["SUMMARY"]) for t in todos] == ["buy milk"]
                todos[0].complete()
        finally:
            proxy.close()
        assert "- [x] buy milk" in (pt.root / "notes/home/todo.md").read_text()
        assert f"{pt.name}:{pt.tls}" in proxy.asked

    def test_the_mcp_sdk_through_a_connect_proxy(self, pt):
        pytest.importorskip("mcp.client.client")
        httpx2 = pytest.importorskip("httpx2")
        client_module = pytest.importorskip("mcp.client.client")
        transport = pytest.importorskip("mcp.client.streamable_http")
        import ssl

        body = {"path": "notes/mcp.md", "content": "# Garden\n\nPlant tomatoes in May."}
        assert pt.server.request("POST", f"{API}/notes", body, key_of(pt))[0] == 201
        proxy = ConnectProxy()
        context = ssl.create_default_context(cafile=str(pt.pebble.root_path))

        async def main():
            async with httpx2.AsyncClient(
                headers={"Authorization": f"Bearer {pt.key}"},
                timeout=30,
                verify=context,
                proxy=proxy.url,
            ) as http:
                connection = transport.streamable_http_client(
                    f"{pt.origin}{API}/mcp", http_client=http
                )
                async with client_module.Client(connection) as session:
                    hits = await session.call_tool("search_notes", {"query": "tomatoes"})
                    return [t.name for t in (await session.list_tools()).tools], hits

        try:
            names, hits = asyncio.run(main())
        finally:
            proxy.close()
        assert "search_notes" in names
        assert "notes/mcp.md" in json.dumps(hits.structured_content)
        assert f"{pt.name}:{pt.tls}" in proxy.asked

    def test_links_share_urls_oauth_and_mcp_name_the_https_origin(self, pt):
        setup = pt.server.request("GET", f"{API}/system/setup")[2]["data"]
        assert setup["links"]["relayApiBase"] == f"{pt.origin}{API}"
        assert setup["links"]["connect"]["hosted"].startswith(pt.origin + "/?relayCode=")
        status, meta = tls_json(
            pt.tls, pt.name, pt.pebble.root_path, "GET", "/.well-known/oauth-authorization-server"
        )
        assert status == 200
        assert meta["issuer"] == pt.origin
        assert meta["token_endpoint"] == f"{pt.origin}/oauth/token"
        body = {"path": "notes/shared.md", "content": "# Shared\n"}
        assert pt.server.request("POST", f"{API}/notes", body, key_of(pt))[0] == 201
        status, made = tls_json(
            pt.tls, pt.name, pt.pebble.root_path, "POST", f"{API}/shares", pt.key,
            {"path": "notes/shared.md"},
        )  # fmt: skip
        assert status == 201, made
        assert made["data"]["url"].startswith(f"{pt.origin}/s/")
        status, pair = tls_json(
            pt.tls, pt.name, pt.pebble.root_path, "GET",
            f"/relay/v1/pair/{setup['pairing']['relayCode']}",
        )  # fmt: skip
        assert pair["data"]["relayApiBase"] == f"{pt.origin}{API}"

    def test_the_certificates_key_is_the_servers_and_never_in_the_relay(self, pt):
        """The key was made on the server and never left it: the certificate shown through
        the relay is the one on the server's disk, and neither its PEM nor its private
        number is anywhere in the relay process's memory."""
        from cryptography.hazmat.primitives.serialization import load_pem_private_key

        pem = (pt.root / ".notesvc" / "tls" / "server.pem").read_bytes()
        key_pem = re.search(rb"-----BEGIN PRIVATE KEY-----.+?-----END PRIVATE KEY-----", pem, re.S)
        scalar = load_pem_private_key(key_pem.group(0), None).private_numbers().private_value
        secret = scalar.to_bytes(32, "big")
        client = TlsClient(pt.tls, pt.name, pt.pebble.root_path)
        try:
            from cryptography import x509

            shown = x509.load_der_x509_certificate(client.peer_der)
        finally:
            client.close()
        public = load_pem_private_key(key_pem.group(0), None).public_key().public_numbers()
        assert shown.public_key().public_numbers() == public
        memory = relay_memory(pt.relay.proc.pid)
        assert len(memory) > 1 << 20
        assert secret not in memory
        assert key_pem.group(0)[40:120] not in memory

    def test_system_info_and_the_audit_say_the_mode_and_the_expiry(self, pt):
        connection = connection_of(pt.server, pt.key)
        assert connection["mode"] == "passthrough"
        assert connection["passthrough"]["state"] == "active"
        assert connection["passthrough"]["certificate"]["certificate"]["notAfter"]
        findings = pt.server.request("GET", f"{API}/security/audit", headers=key_of(pt))[2]
        ids = {f["id"] for f in findings["data"]["findings"]}
        assert "passthrough-certificate" not in ids  # nothing wrong with it


def relay_memory(pid: int) -> bytes:
    """Every readable, writable mapping of a process (its heap, its Python objects)."""
    chunks = []
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb") as mem:
        for line in maps:
            span, perms = line.split()[:2]
            if not perms.startswith("rw"):
                continue
            start, end = (int(x, 16) for x in span.split("-"))
            with contextlib.suppress(OSError, ValueError):
                mem.seek(start)
                chunks.append(mem.read(end - start))
    return b"".join(chunks)


class TestWhatTheRelaySees:
    """A recording proxy on both sides of the relay (its link to the server, and its
    clients' side) keeps every byte the relay reads and writes."""

    pytestmark = REAL

    def test_no_byte_of_a_note_crosses_the_relay_in_passthrough_and_it_does_otherwise(
        self, tmp_path, test_ca
    ):
        marker = "kumquat-" + secrets.token_hex(12)
        with acme_pair(tmp_path / "pt", test_ca, link_proxy=True) as pt:
            front = RecordingProxy(pt.tls)  # the clients' side of the relay
            try:
                body = {"path": "notes/secret.md", "content": f"# Secret\n\n{marker}\n"}
                client = TlsClient(front.port, pt.name, pt.pebble.root_path)
                try:
                    payload = json.dumps(body).encode()
                    headers = {**key_of(pt), "Content-Type": "application/json"}
                    assert client.request("POST", f"{API}/notes", payload, headers)[0] == 201
                    status, _h, raw = client.request(
                        "GET", f"{API}/notes/notes%2Fsecret.md", headers=key_of(pt)
                    )
                finally:
                    client.close()
                assert status == 200
                assert marker in raw.decode()  # the client has it
                seen = bytes(front.seen) + bytes(pt.link.seen)
                assert len(front.seen) > 1000
                assert len(pt.link.seen) > 1000  # the dial's data connection went by it
                assert not found_in(seen, marker)
                assert not found_in(seen, pt.key)  # nor the key
                # today's mode on the same relay and server: path-based, TLS (if any) ends
                # at the relay, which reads the request and the answer
                plain = RecordingProxy(pt.relay.port)
                try:
                    path = f"/r/{pt.sid}{API}/notes/notes%2Fsecret.md"
                    got = asyncio_get(plain.port, path, pt.key)
                    assert marker in got
                    assert found_in(bytes(plain.seen) + bytes(pt.link.seen), marker)
                finally:
                    plain.close()
            finally:
                front.close()


def found_in(recorded: bytes, text: str) -> bool:
    """Whether `text` is in the bytes, as is or inside any base64 the relay protocol
    carries (a relayed answer's body is base64 in the JSON of its long-poll)."""
    if text.encode() in recorded:
        return True
    for blob in re.findall(rb'"body":\s*"([A-Za-z0-9+/=]+)"', recorded):
        with contextlib.suppress(ValueError):
            if text.encode() in base64.b64decode(blob):
                return True
    return False


def asyncio_get(port: int, path: str, key: str) -> str:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path, headers={"X-Service-Key": key})
        return conn.getresponse().read().decode()
    finally:
        conn.close()


class TestRenewal:
    pytestmark = REAL

    def test_a_short_lived_certificate_is_renewed_at_two_thirds_and_served(self, tmp_path, test_ca):
        """pebble issuing for 30 s: the server renews after 20, and the relay's clients
        get the new certificate with nothing restarted."""
        with acme_pair(tmp_path, test_ca, validity=30) as pt:
            first = pt.connection["passthrough"]["certificate"]["certificate"]
            client = TlsClient(pt.tls, pt.name, pt.pebble.root_path)
            before = client.peer_der
            client.close()

            def renewed():
                cert = connection_of(pt.server, pt.key)["passthrough"]["certificate"]
                return cert["certificate"]["notBefore"] != first["notBefore"] and cert

            cert = wait_for(renewed, timeout=45, step=0.5)
            assert cert["state"] == "valid"
            started = time.strptime(first["notBefore"][:19], "%Y-%m-%dT%H:%M:%S")
            renewed_at = time.strptime(cert["certificate"]["notBefore"][:19], "%Y-%m-%dT%H:%M:%S")
            assert 18 <= time.mktime(renewed_at) - time.mktime(started) <= 30
            client = TlsClient(pt.tls, pt.name, pt.pebble.root_path)
            assert client.peer_der != before
            assert client.request("GET", f"{API}/health")[0] == 200
            client.close()

    def test_a_ca_that_goes_down_leaves_the_old_certificate_serving(self, tmp_path, test_ca):
        with acme_pair(tmp_path, test_ca, validity=30) as pt:
            pt.pebble.stop()  # renewal from 20 s on fails, and backs off

            def failing():
                cert = connection_of(pt.server, pt.key)["passthrough"]["certificate"]
                return cert["state"] == "error" and cert

            cert = wait_for(failing, timeout=40, step=0.5)
            assert "cannot be reached" in cert["lastError"]
            assert cert["nextAttemptAt"] is not None
            status, _a = tls_json(pt.tls, pt.name, pt.pebble.root_path, "GET", f"{API}/health")
            assert status == 200  # the old one, still valid, serves
            findings = pt.server.request("GET", f"{API}/security/audit", headers=key_of(pt))[2]
            found = [
                f for f in findings["data"]["findings"] if f["id"] == "passthrough-certificate"
            ]
            assert found
            assert found[0]["severity"] == "medium"
            assert "keeps serving until" in found[0]["detail"]


NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
STREAM_MODULE = "/usr/lib/nginx/modules/ngx_stream_module.so"


class TestScaleOut:
    """deploy/nginx-passthrough.conf: two passthrough relays behind nginx's stream module
    (by SNI) and its http module (the relay's own name), the challenge records in Knot by
    RFC 2136 updates, pebble asking Knot."""

    pytestmark = REAL

    @pytest.mark.skipif(not NGINX, reason="nginx is not installed (apt install nginx)")
    @pytest.mark.skipif(
        not os.path.exists(STREAM_MODULE),
        reason="nginx's stream module is not installed (apt install libnginx-mod-stream)",
    )
    def test_two_relays_behind_nginx_splice_each_servers_clients_to_its_relay(
        self, tmp_path, test_ca
    ):
        from passthrough_kit import Knot, free_port

        knot = Knot(tmp_path / "knot")
        relays, servers, nginx, pebble = [], [], None, None
        try:
            ports = [free_port(), free_port()]
            front, site = free_port(), free_port()
            cert, key = test_ca.files("nginx-site", [DOMAIN], ("127.0.0.1",))
            conf = (Path(__file__).parent.parent / "deploy" / "nginx-passthrough.conf").read_text()
            for old, new in (
                ("127.0.0.1:8441", f"127.0.0.1:{ports[0]}"),
                ("127.0.0.1:8442", f"127.0.0.1:{ports[1]}"),
                ("127.0.0.1:8443", f"127.0.0.1:{site}"),
                ("listen 443;", f"listen 127.0.0.1:{front};"),
                (r"relay\.example\.org", r"relay\.test"),
                ("relay.example.org", DOMAIN),
                ("/etc/letsencrypt/live/relay.test/fullchain.pem", str(cert)),
                ("/etc/letsencrypt/live/relay.test/privkey.pem", str(key)),
                ("http {\n", "http {\n    access_log off; client_body_temp_path tmp; "
                 "proxy_temp_path tmp;\n"),
            ):  # fmt: skip
                assert old in conf, old
                conf = conf.replace(old, new)
            (tmp_path / "logs").mkdir()
            (tmp_path / "tmp").mkdir()
            (tmp_path / "nginx.conf").write_text(
                f"load_module {STREAM_MODULE};\n"
                "daemon off; master_process off; pid nginx.pid; error_log logs/error.log warn;\n"
                "events { worker_connections 1024; }\n" + conf
            )
            env = {
                "SERVICE_TRUST_PROXY": "true",
                "SERVICE_PUBLIC_URL": f"https://{DOMAIN}:{front}",
                "SERVICE_RELAY_DNS_UPDATE": f"127.0.0.1:{knot.port}",
                "SERVICE_RELAY_DNS_TSIG": knot.tsig,
                "SERVICE_RELAY_TLS_CERT": "",
                "SERVICE_RELAY_TLS_KEY": "",
            }
            for i, port in enumerate(ports):
                env["SERVICE_RELAY_TLS_PORT"] = str(port)
                relays.append(passthrough_relay(tmp_path / f"relay{i}", test_ca, port=port, **env))
            nginx = subprocess.Popen(
                [NGINX, "-p", str(tmp_path), "-c", "nginx.conf"],
                stderr=subprocess.PIPE,
                text=True,
            )
            pebble = Pebble(tmp_path / "pebble", test_ca, f"127.0.0.1:{knot.port}")
            link = f"https://127.0.0.1:{front}"  # no SNI: nginx's own site, TLS for relay.test

            def up() -> bool:
                assert nginx.poll() is None, nginx.stderr.read()
                with contextlib.suppress(OSError):
                    status, info = tls_json(front, DOMAIN, test_ca.path, "GET", "/relay/v1/info")
                    return status == 200 and info
                return False

            info = wait_for(up)["data"]
            assert info["passthrough"] is True
            assert info["tlsPort"] == front
            held = lambda r: r.request("GET", "/health")[2]["data"]["passthrough"]["servers"]  # noqa: E731
            for i in range(10):  # until both relays hold a server in passthrough
                server = Server(
                    tmp_path / f"srv{i}",
                    env={
                        "SERVICE_RELAY_URL": link,
                        "SSL_CERT_FILE": str(test_ca.path),  # the link's certificate
                        "SERVICE_ACME_DIRECTORY": pebble.directory,
                        "SERVICE_ACME_CA_FILE": str(test_ca.path),
                    },
                )
                servers.append(server)
                server.key = server.request("GET", "/api/v1/system/setup")[2]["data"]["apiKey"]
                wait_passthrough(server, server.key, timeout=60)
                count = len(servers)
                wait_for(lambda count=count: sum(map(held, relays)) == count)
                if len(servers) >= 2 and all(map(held, relays)):
                    break
            assert all(map(held, relays)), "every server landed on one relay"
            for n, server in enumerate(servers):
                setup = server.request("GET", f"{API}/system/setup")[2]["data"]
                name = f"{setup['serverId']}.{DOMAIN}"
                assert setup["links"]["relayApiBase"] == f"https://{name}:{front}{API}"
                # the server's link finishes setup directly, then a client far away links
                linked = server.request("POST", f"{API}/auth/link", {"clientName": "home"},
                                        {"X-Service-Key": server.key})  # fmt: skip
                assert linked[0] == 200
                client = TlsClient(front, name, pebble.root_path, source=f"127.0.0.{20 + n}")
                try:
                    status, _h, raw = client.request(
                        "GET", f"{API}/system/info", headers={"X-Service-Key": server.key}
                    )
                    assert status == 200
                    assert json.loads(raw)["data"]["serverId"] == setup["serverId"]
                    body = json.dumps({"clientName": f"far-{n}"}).encode()
                    headers = {"X-Service-Key": server.key, "Content-Type": "application/json"}
                    assert client.request("POST", f"{API}/auth/link", body, headers)[0] == 200
                finally:
                    client.close()
                # the client's address came through nginx (PROXY v1), then the relay (v2)
                said = f"client 'far-{n}' linked from relay:127.0.0.{20 + n}"
                wait_for(lambda s=server, t=said: t in "".join(s.lines))
                values = knot.txt(setup["serverId"])
                assert values == []  # each challenge record withdrawn once used
            assert "DDNS" in knot.log.read_text()  # the records went to Knot
        finally:
            for server in servers:
                server.stop()
            if nginx is not None:
                nginx.terminate()
                nginx.wait(10)
                nginx.stderr.close()
            for part in (pebble, *relays, knot):
                if part is not None:
                    part.stop()


CERTUTIL = shutil.which("certutil")


class TestInChromium:
    """The web client through the relay, its TLS ended on the server: Chromium trusts
    pebble's root through an NSS database in a test HOME, and resolves relay.test names
    to loopback."""

    pytestmark = [
        pytest.mark.browser,
        pytest.mark.real_server,
        pytest.mark.slow,
        pytest.mark.xdist_group("browser"),
    ]

    def test_the_web_client_signs_in_and_saves_on_the_servers_https_origin(self, tmp_path, test_ca):
        sync_api = pytest.importorskip("playwright.sync_api")
        from browsers import CHROMIUM, CHROMIUM_ARGS, WebSession

        if not CHROMIUM:
            pytest.skip("no Chromium on this machine")
        if not CERTUTIL:
            pytest.skip("certutil is not installed (apt install libnss3-tools)")
        with acme_pair(tmp_path / "pt", test_ca) as pt:
            home = tmp_path / "home"
            nssdb = home / ".pki" / "nssdb"
            nssdb.mkdir(parents=True)
            subprocess.run([CERTUTIL, "-d", f"sql:{nssdb}", "-N", "--empty-password"], check=True)
            subprocess.run(
                [CERTUTIL, "-d", f"sql:{nssdb}", "-A", "-t", "C,,", "-n", "pebble root",
                 "-i", str(pt.pebble.root_path)],
                check=True,
            )  # fmt: skip
            setup = pt.server.request("GET", f"{API}/system/setup")[2]["data"]
            hosted = setup["links"]["connect"]["hosted"]
            assert hosted.startswith(pt.origin + "/?relayCode=")
            rules = f"--host-resolver-rules=MAP *.{DOMAIN} 127.0.0.1"
            with sync_api.sync_playwright() as playwright:
                chromium = playwright.chromium.launch(
                    executable_path=CHROMIUM,
                    args=[*CHROMIUM_ARGS, rules],
                    env={**os.environ, "HOME": str(home)},
                )
                try:
                    web = WebSession(chromium, tmp_path, "desktop")
                    web.login(hosted, pt.key)
                    assert web.page.evaluate("location.origin") == pt.origin
                    assert web.page.evaluate("window.isSecureContext") is True
                    path = web.write_new("Through the relay\n\nit cannot read this line")
                    web.shot("passthrough")
                    errors = web.close()
                finally:
                    chromium.close()
            assert "it cannot read this line" in (pt.root / path).read_text()
            assert not [e for e in errors if "ERR_CERT" in e]
            spliced = connection_of(pt.server, pt.key)["passthrough"]["spliced"]
            assert spliced["served"] >= 1
