"""The relay's TLS port: splices by SNI, dials, its own TLS, the bounds on what waits
(src/notesvc/passthrough/front.py), against real relay and server processes."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import ssl
import time
import types
from pathlib import Path

import pytest

from conftest import API, DOMAIN, Server, relay_servers, wait_for
from passthrough_kit import (
    TestCA,
    TlsClient,
    client_hello,
    closed_without_answer,
    free_port,
    passthrough_relay,
    relay_ports,
    server_with_certificate,
    tls_json,
    wait_passthrough,
)

REAL = [pytest.mark.real_server, pytest.mark.slow]
NO_ACME = "https://127.0.0.1:9/dir"  # a closed port: these servers bring their certificate


def health(relay: Server) -> dict:
    return relay.request("GET", "/health")[2]["data"]


def server_env(relay: Server, **env: str) -> dict:
    return {"SERVICE_RELAY_URL": relay.url, "SERVICE_ACME_DIRECTORY": NO_ACME, **env}


@contextlib.contextmanager
def spliced_pair(tmp_path: Path, ca: TestCA, relay_port: int = 0, relay_env=None, **env: str):
    """A passthrough relay and a server holding a certificate from the test CA, in
    passthrough mode; yields a namespace: relay, server, ports, sid, key, name, root."""
    relay = passthrough_relay(tmp_path / "relay", ca, port=relay_port, **(relay_env or {}))
    server = None
    try:
        ports = relay_ports(relay)
        root = tmp_path / "srv"
        sid = server_with_certificate(root, ca)
        server = Server(root, env=server_env(relay, **env))
        key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]
        wait_passthrough(server, key)
        yield types.SimpleNamespace(
            relay=relay, server=server, ports=ports, sid=sid, key=key, name=f"{sid}.{DOMAIN}",
            root=root, tls=ports["tls"],
        )  # fmt: skip
    finally:
        if server is not None:
            server.stop()
        relay.stop()


def der_of(pem: bytes) -> bytes:
    found = re.search(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", pem, re.S)
    return ssl.PEM_cert_to_DER_cert(found.group(0).decode())


@pytest.fixture(scope="class")
def pair(tmp_path_factory, test_ca):
    with spliced_pair(tmp_path_factory.mktemp("pair"), test_ca) as found:
        yield found


class TestSplice:
    pytestmark = REAL

    def test_a_server_is_reached_by_its_name_with_its_own_certificate(self, pair, test_ca):
        client = TlsClient(pair.tls, pair.name, test_ca.path)
        try:
            status, _headers, body = client.request("GET", f"{API}/health")
            assert status == 200
            assert json.loads(body)["data"]["status"] == "ok"
            for _ in range(3):  # keep-alive: one connection serves request after request
                status, _h, body = client.request(
                    "GET", f"{API}/system/info", headers={"X-Service-Key": pair.key}
                )
                assert status == 200
            shown = client.peer_der
        finally:
            client.close()
        kept = (pair.root / ".notesvc" / "tls" / "server.pem").read_bytes()
        assert shown == der_of(kept)  # the server's own certificate, never the relay's
        assert shown != der_of(pair.relay.cert_pem)
        connection = json.loads(body)["data"]["connection"]
        assert connection["mode"] == "passthrough"
        assert connection["passthrough"]["origin"] == f"https://{pair.name}:{pair.tls}"
        cert = connection["passthrough"]["certificate"]["certificate"]
        assert cert["issuer"] == "notesvc test CA"
        assert cert["notAfter"] > cert["renewAt"]
        assert connection["passthrough"]["spliced"]["served"] >= 1
        said = health(pair.relay)["passthrough"]
        assert said["servers"] == 1
        assert said["spliced"] >= 1

    def test_links_name_the_servers_https_origin(self, pair):
        origin = f"https://{pair.name}:{pair.tls}"
        setup = pair.server.request("GET", f"{API}/system/setup")[2]["data"]
        assert setup["links"]["relayApiBase"] == f"{origin}{API}"
        assert setup["links"]["connect"]["hosted"].startswith(f"{origin}/")

    def test_spliced_requests_are_relayed_ones_with_their_own_lockout(self, pair, test_ca):
        # never setup through a splice: no key in the setup payload
        status, answer = tls_json(pair.tls, pair.name, test_ca.path, "GET", f"{API}/system/setup")
        assert status == 200
        assert answer["data"]["apiKey"] != pair.key
        statuses = [
            tls_json(pair.tls, pair.name, test_ca.path, "GET", f"{API}/system/info", f"nsk_{i}")[0]
            for i in range(12)  # (a wrong key is counted once: twelve different ones)
        ]
        assert statuses[0] == 401
        assert statuses[-1] == 429
        key = {"X-Service-Key": pair.key}
        direct = pair.server.request("GET", f"{API}/system/info", headers=key)
        assert direct[0] == 200  # ... and nobody else (loopback, directly)

    def test_the_relays_own_name_gets_its_own_certificate_and_pages(self, pair, test_ca):
        client = TlsClient(pair.tls, DOMAIN, test_ca.path)
        try:
            status, headers, body = client.request("GET", "/health")
            assert status == 200
            assert json.loads(body)["data"]["role"] == "relay"
            status, headers, body = client.request("GET", "/")
            assert status == 200
            assert headers["content-type"].startswith("text/html")
            status, _h, body = client.request("GET", "/relay/v1/info")
            info = json.loads(body)["data"]
        finally:
            client.close()
        assert info["passthrough"] is True
        assert info["tlsPort"] == pair.tls
        assert info["publicUrl"].startswith("https://")  # TLS ended on the relay

    def test_a_fragmented_client_hello_is_spliced_whole(self, pair, test_ca):
        """A ClientHello cut into 1-byte records still finds its server, and the rest of
        the handshake and a request go through."""
        ctx = ssl.create_default_context(cafile=str(test_ca.path))
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = ctx.wrap_bio(incoming, outgoing, server_hostname=pair.name)
        with contextlib.suppress(ssl.SSLWantReadError):
            tls.do_handshake()
        hello = outgoing.read()
        handshake = hello[5:]
        pieces = b"".join(
            b"\x16\x03\x01\x00\x01" + handshake[i : i + 1] for i in range(len(handshake))
        )
        with socket.create_connection(("127.0.0.1", pair.tls), timeout=10) as s:
            for i in range(0, len(pieces), 50):  # over many TCP segments too
                s.sendall(pieces[i : i + 50])
            while True:
                try:
                    tls.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    s.sendall(outgoing.read())
                    data = s.recv(65536)
                    assert data
                    incoming.write(data)
            s.sendall(outgoing.read())
            tls.write(f"GET {API}/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
            s.sendall(outgoing.read())
            answer = b""
            while b"\r\n\r\n" not in answer:
                data = s.recv(65536)
                assert data
                incoming.write(data)
                with contextlib.suppress(ssl.SSLWantReadError):
                    answer += tls.read(65536)
        assert answer.startswith(b"HTTP/1.1 200")

    @pytest.mark.parametrize(
        "what",
        [
            "no SNI",
            "several names",
            "an IP literal",
            "an oversized name",
            "another domain",
            "a truncated hello, then its end",
            "not TLS at all",
            "a PROXY header from an untrusted peer",
        ],
    )
    def test_what_cannot_be_spliced_is_closed_and_the_relay_keeps_serving(
        self, pair, test_ca, what
    ):
        from test_passthrough_wire import other

        sid = pair.sid
        hello = {
            "no SNI": lambda: client_hello(None),
            "several names": lambda: other([f"{sid}.{DOMAIN}".encode(), b"b.relay.test"]),
            "an IP literal": lambda: other([b"127.0.0.1"]),
            "an oversized name": lambda: other([b"a" * 300]),
            "another domain": lambda: client_hello("example.org"),
            "a truncated hello, then its end": lambda: client_hello(f"{sid}.{DOMAIN}")[:60],
            "not TLS at all": lambda: b"SSH-2.0-OpenSSH_9.2\r\n",
            "a PROXY header from an untrusted peer": lambda: (
                b"PROXY TCP4 203.0.113.9 127.0.0.1 1 2\r\n" + client_hello(f"{sid}.{DOMAIN}")
            ),
        }[what]()
        with socket.create_connection(("127.0.0.1", pair.tls), timeout=15) as s:
            s.sendall(hello)
            with contextlib.suppress(OSError):  # (closed already)
                s.shutdown(socket.SHUT_WR)
            with contextlib.suppress(ConnectionResetError):  # (a reset: bytes left unread)
                assert s.recv(1) == b""  # closed, and nothing said
        assert tls_json(pair.tls, pair.name, test_ca.path, "GET", f"{API}/health")[0] == 200
        assert health(pair.relay)["passthrough"]["closed"] >= 1

    def test_a_hello_that_never_ends_is_closed_after_ten_seconds(self, pair):
        started = time.monotonic()
        assert closed_without_answer(pair.tls, client_hello(pair.name)[:60], 20)
        assert 9 < time.monotonic() - started < 15


class TestTheRelaysOwnTls:
    pytestmark = REAL

    def test_a_server_not_in_passthrough_is_terminated_on_its_own_origin(self, tmp_path, test_ca):
        """With a *.D certificate the relay serves a server that is not in passthrough on
        its own origin (22), TLS ending at the relay."""
        relay = passthrough_relay(tmp_path / "relay", test_ca)
        server = None
        try:
            ports = relay_ports(relay)
            server = Server(
                tmp_path / "srv", env=server_env(relay, SERVICE_RELAY_PASSTHROUGH="off")
            )
            setup = server.request("GET", f"{API}/system/setup")[2]["data"]
            wait_for(lambda: relay_servers(relay) == 1)
            name = f"{setup['serverId']}.{DOMAIN}"
            client = TlsClient(ports["tls"], name, test_ca.path)
            try:
                status, headers, body = client.request(
                    "GET", f"{API}/system/info", headers={"X-Service-Key": setup["apiKey"]}
                )
                shown = client.peer_der
            finally:
                client.close()
            assert status == 200
            assert headers["content-security-policy"] == "default-src 'none'; sandbox"  # relayed
            assert shown == der_of(relay.cert_pem)  # the relay's own (wildcard) certificate
            info = json.loads(body)["data"]["connection"]
            assert info["mode"] == "relayed"
            assert "passthrough" not in info
        finally:
            if server is not None:
                server.stop()
            relay.stop()

    def test_without_a_wildcard_certificate_an_unknown_name_is_closed(self, tmp_path, test_ca):
        relay = passthrough_relay(tmp_path / "relay", test_ca, wildcard=False)
        try:
            tls = relay_ports(relay)["tls"]
            assert closed_without_answer(tls, client_hello(f"{'a' * 20}.{DOMAIN}"))
            assert closed_without_answer(tls, client_hello(f"b.{DOMAIN}"))
            client = TlsClient(tls, DOMAIN, test_ca.path)  # its own name still is its own
            try:
                assert client.request("GET", "/health")[0] == 200
            finally:
                client.close()
        finally:
            relay.stop()

    def test_with_one_an_unknown_server_gets_the_relays_pages_and_a_504(self, pair, test_ca):
        client = TlsClient(pair.tls, f"{'a' * 20}.{DOMAIN}", test_ca.path)
        try:
            assert client.peer_der == der_of(pair.relay.cert_pem)
            assert client.request("GET", f"{API}/health")[0] == 504  # (as over HTTP: 22)
        finally:
            client.close()

    def test_http_and_tls_share_one_port(self, tmp_path, test_ca):
        port = free_port()
        env = {"SERVICE_RELAY_TLS_PORT": str(port)}
        with spliced_pair(tmp_path, test_ca, relay_port=port, relay_env=env) as pt:
            assert pt.ports["tls"] == pt.ports["http"] == port
            assert health(pt.relay)["status"] == "ok"  # plain HTTP on that port
            assert tls_json(port, pt.name, test_ca.path, "GET", f"{API}/health")[0] == 200
