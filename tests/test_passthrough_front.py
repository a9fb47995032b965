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

from conftest import API, DOMAIN, Server, notesvc, relay_servers, wait_for
from passthrough_kit import (
    TestCA,
    TlsClient,
    client_hello,
    closed_without_answer,
    connection_of,
    free_port,
    passthrough_relay,
    relay_ports,
    server_with_certificate,
    tls_json,
    wait_passthrough,
)
from standins import FakeRelayServer

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


def register_passthrough(fake: FakeRelayServer) -> dict:
    body = {"token": fake.token, "relayCode": fake.code, "passthrough": True}
    status, _h, answer = fake.call("POST", f"/relay/v1/register/{fake.server_id}", body)
    assert status == 200
    return answer["data"]


def dial(relay: Server, server_id: str, token: str, relay_token: str, **headers) -> tuple:
    """Open a data connection as a server does; return (socket, status, bytes after the head)."""
    s = socket.create_connection(("127.0.0.1", relay.port), timeout=15)
    fields = {
        "Host": "relay",
        "X-Relay-Token": relay_token,
        "Connection": "Upgrade",
        "Upgrade": "notesvc-splice",
        "Content-Length": "0",
        **headers,
    }
    head = f"POST /relay/v1/dial/{server_id}/{token} HTTP/1.1\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in fields.items() if v is not None)
    s.sendall((head + "\r\n").encode())
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = s.recv(65536)
        if not chunk:
            break
        got += chunk
    answer, _, rest = got.partition(b"\r\n\r\n")
    status = int(answer.split(b" ", 2)[1]) if answer else 0
    return s, status, rest


def read_until_closed(s: socket.socket) -> bytes:
    data = b""
    with contextlib.suppress(OSError):
        while chunk := s.recv(65536):
            data += chunk
    return data


class TestDials:
    pytestmark = REAL

    @pytest.fixture
    def relay(self, tmp_path, test_ca):
        relay = passthrough_relay(tmp_path / "relay", test_ca)
        relay_ports(relay)
        yield relay
        relay.stop()

    def test_a_dial_is_answered_101_with_the_proxy_header_and_the_clients_bytes(
        self, relay, test_ca
    ):
        fake = FakeRelayServer(relay)
        assert register_passthrough(fake)["passthrough"] is True
        hello = client_hello(f"{fake.server_id}.{DOMAIN}")
        client = socket.create_connection(("127.0.0.1", relay_ports(relay)["tls"]), timeout=15)
        with client:
            client.sendall(hello)
            status, _h, answer = fake.poll()
            assert status == 200
            message = answer["data"]
            assert set(message) == {"kind", "token", "client"}
            assert (message["kind"], message["client"]) == ("dial", "127.0.0.1")
            token = message["token"]
            other = FakeRelayServer(relay)
            refusals = [
                dial(relay, fake.server_id, "x" * 32, fake.token),  # a wrong token
                dial(relay, fake.server_id, token, other.token),  # another server's
                dial(relay, other.server_id, token, other.token),  # for another id
                dial(relay, fake.server_id, token, fake.token, Upgrade="websocket"),
                dial(relay, fake.server_id, token, fake.token, Upgrade=None),
            ]
            statuses = []
            for s, status, _rest in refusals:
                statuses.append(status)
                read_until_closed(s)  # (and closed)
                s.close()
            assert statuses == [403, 403, 403, 400, 400]
            data, status, rest = dial(relay, fake.server_id, token, fake.token)
            with data:
                assert status == 101
                while len(rest) < 28 + len(hello):
                    rest += data.recv(65536)
                size, said = notesvc.parse_proxy_header(rest)
                assert said == client.getsockname()  # the client's address and port
                assert rest[size:] == hello  # then its bytes, exactly
                data.sendall(b"from the server")
                assert client.recv(100) == b"from the server"
                client.sendall(b"from the client")
                assert data.recv(100) == b"from the client"
                again, status, _rest = dial(relay, fake.server_id, token, fake.token)
                again.close()
                assert status == 403  # used up
            assert client.recv(100) == b""  # the server's side closed: so is the client's
        assert health(relay)["passthrough"]["spliced"] == 1

    def test_a_server_that_never_dials_leaves_its_client_closed_after_ten_seconds(self, relay):
        fake = FakeRelayServer(relay)
        register_passthrough(fake)
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", relay_ports(relay)["tls"]), timeout=20) as c:
            c.sendall(client_hello(f"{fake.server_id}.{DOMAIN}"))
            token = fake.poll()[2]["data"]["token"]  # it hears, and does nothing
            with contextlib.suppress(ConnectionResetError):
                assert c.recv(1) == b""
        assert 9.5 < time.monotonic() - started < 14
        late, status, _rest = dial(relay, fake.server_id, token, fake.token)
        late.close()
        assert status == 403  # expired
        assert health(relay)["passthrough"]["dialsMissed"] == 1

    def test_a_server_registered_without_passthrough_gets_no_dial(self, relay, test_ca):
        fake = FakeRelayServer(relay)
        assert fake.register() == 200  # without passthrough: true
        client = TlsClient(relay_ports(relay)["tls"], f"{fake.server_id}.{DOMAIN}", test_ca.path)
        try:  # TLS ended at the relay (its *.D certificate), as 22's own origin over HTTP
            assert client.peer_der == der_of(relay.cert_pem)
        finally:
            client.close()
        assert health(relay)["passthrough"]["waitingForDial"] == 0


def rss_anon_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"RssAnon:\s+(\d+) kB", status).group(1)) / 1024


def owner_answered(pt, test_ca, kept: TlsClient) -> None:
    """The owner's kept-alive connection and a new one are both answered."""
    headers = {"X-Service-Key": pt.key}
    assert kept.request("GET", f"{API}/system/info", headers=headers)[0] == 200
    fresh = TlsClient(pt.tls, pt.name, test_ca.path)
    try:
        assert fresh.request("GET", f"{API}/system/info", headers=headers)[0] == 200
    finally:
        fresh.close()


class TestFloods:
    pytestmark = REAL

    def test_ten_thousand_half_open_handshakes_are_bounded_and_the_owner_is_served(
        self, tmp_path, test_ca
    ):
        """10,000 connections that send a third of a ClientHello and wait, from 200
        addresses: the relay holds at most 4,096 of them (the oldest closed first), its
        memory stays bounded, and its owner is answered all along, on a kept connection
        and on new ones."""
        with spliced_pair(tmp_path, test_ca) as pt:
            kept = TlsClient(pt.tls, pt.name, test_ca.path)
            part = client_hello(pt.name)[:100]
            held, idle_mb = [], rss_anon_mb(pt.relay.proc.pid)
            most = 0
            try:
                for i in range(10_000):
                    s = socket.socket()
                    s.settimeout(10)
                    s.bind((f"127.0.{10 + i // 50 // 250}.{i // 50 % 250 + 1}", 0))
                    s.connect(("127.0.0.1", pt.tls))
                    s.sendall(part)
                    held.append(s)
                    if i % 2000 == 1999:
                        owner_answered(pt, test_ca, kept)
                        waiting = health(pt.relay)["passthrough"]["waitingForHello"]
                        most = max(most, waiting)
                        assert waiting <= 4096
                wait_for(lambda: health(pt.relay)["passthrough"]["waitingForHello"] <= 4096)
                owner_answered(pt, test_ca, kept)
                grown = rss_anon_mb(pt.relay.proc.pid) - idle_mb
                assert grown < 48, f"the relay grew {grown:.1f} MB holding them"
                assert most > 1000  # (they were really held)
            finally:
                for s in held:
                    s.close()
                kept.close()
            wait_for(lambda: health(pt.relay)["passthrough"]["waitingForHello"] == 0)

    def test_a_thousand_unfinished_handshakes_for_one_server_are_bounded_both_ends(
        self, tmp_path, test_ca
    ):
        """1,000 whole ClientHellos for the server's name that never go on: the relay
        keeps at most 64 waiting for a dial, the server at most 64 spliced connections
        (the oldest in its handshake makes room), and the owner is still answered."""
        with spliced_pair(tmp_path, test_ca) as pt:
            kept = TlsClient(pt.tls, pt.name, test_ca.path)
            hello = client_hello(pt.name)
            held, most_dials, most_spliced = [], 0, 0
            try:
                for i in range(1000):
                    s = socket.socket()
                    s.settimeout(10)
                    s.bind((f"127.0.{10 + i // 50}.{i % 50 + 1}", 0))
                    s.connect(("127.0.0.1", pt.tls))
                    s.sendall(hello)
                    held.append(s)
                    if i % 100 == 99:
                        most_dials = max(
                            most_dials, health(pt.relay)["passthrough"]["waitingForDial"]
                        )
                        spliced = connection_of(pt.server, pt.key)["passthrough"]["spliced"]
                        most_spliced = max(most_spliced, spliced["open"])
                        assert kept.request("GET", f"{API}/health")[0] == 200
                assert most_dials <= 64
                assert most_spliced <= 64
                owner_answered(pt, test_ca, kept)
            finally:
                for s in held:
                    s.close()
                kept.close()
            spliced = connection_of(pt.server, pt.key)["passthrough"]["spliced"]
            assert spliced["dialed"] >= 64  # (the server did dial for them)
            assert spliced["served"] < 10  # (only the owner's finished a handshake)
