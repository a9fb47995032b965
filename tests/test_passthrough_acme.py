"""The server's certificate: ACME (RFC 8555) by DNS-01 against pebble, a CA that is down,
slow or refusing, renewal and backoff (src/notesvc/passthrough/acme.py)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import http.server
import json
import socket
import ssl
import threading
import time
from pathlib import Path

import pytest

from conftest import DOMAIN, notesvc, patch_global, wait_for
from passthrough_kit import Pebble, TestCA, free_port

REAL = [pytest.mark.real_server, pytest.mark.slow]
SID = "abcdefghijklmnopqrst"
NAME = f"{SID}.{DOMAIN}"


class ThreadDns:
    """The relay's DNS code (DnsServer) on a thread of the test: what pebble asks."""

    def __init__(self):
        self.records = notesvc.ChallengeRecords(10)
        zone = notesvc.DnsZone(DOMAIN, ("127.0.0.1",), self.records)
        self.loop = asyncio.new_event_loop()
        self.server = notesvc.DnsServer(zone, "127.0.0.1", 0)
        self.port = self.loop.run_until_complete(self.server.start())
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.published: list = []

    def publish(self, values: list) -> None:
        self.published.append(list(values))
        done = threading.Event()

        def put():
            self.records.set(SID, values)
            done.set()

        self.loop.call_soon_threadsafe(put)
        done.wait(5)

    def withdraw(self) -> None:
        self.loop.call_soon_threadsafe(self.records.clear, SID)

    def close(self) -> None:
        async def shut() -> None:
            self.server.close()
            await asyncio.sleep(0.05)  # a transport's socket closes on a later turn

        asyncio.run_coroutine_threadsafe(shut(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture
def dns():
    found = ThreadDns()
    yield found
    found.close()


def verify_chain(chain: bytes, root: bytes, name: str) -> dict:
    """Verify a chain against a root for a name as a TLS client would; return the leaf's
    getpeercert()."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    return _handshake(server_ctx, chain, root, name)


def _handshake(server_ctx, chain: bytes, root: bytes, name: str, key: bytes = b"") -> dict:
    import tempfile

    with tempfile.NamedTemporaryFile("wb", suffix=".pem") as f:
        f.write(key + b"\n" + chain)
        f.flush()
        server_ctx.load_cert_chain(f.name)
    client_ctx = ssl.create_default_context(cadata=root.decode())
    a, b = socket.socketpair()
    with a, b:
        found = {}

        def serve():
            with contextlib.suppress(ssl.SSLError, OSError):
                server_ctx.wrap_socket(a, server_side=True).close()

        t = threading.Thread(target=serve)
        t.start()
        with client_ctx.wrap_socket(b, server_hostname=name) as tls:
            found = tls.getpeercert()
        t.join(5)
    return found


class TestAcmeAgainstPebble:
    pytestmark = REAL

    def test_dns01_gets_a_p256_certificate_that_verifies_against_pebbles_root(
        self, tmp_path, test_ca, dns
    ):
        pebble = Pebble(tmp_path / "pebble", test_ca, f"127.0.0.1:{dns.port}")
        try:
            folder = notesvc.TlsFolder(tmp_path / "state")
            client = notesvc.AcmeClient(pebble.directory, str(test_ca.path), folder.account_key())
            key_pem, chain = client.obtain(NAME, dns.publish, dns.withdraw)
        finally:
            pebble.stop()
        assert len(dns.published) == 1
        assert len(dns.published[0]) == 1  # one authorisation, one TXT value
        assert dns.records.get(SID) == ()  # withdrawn after
        from cryptography import x509
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.hazmat.primitives.serialization import load_pem_private_key

        key = load_pem_private_key(key_pem, None)
        assert isinstance(key.curve, ec.SECP256R1)
        leaf = x509.load_pem_x509_certificate(chain)
        assert leaf.public_key().public_numbers() == key.public_key().public_numbers()
        names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert names.get_values_for_type(x509.DNSName) == [NAME]
        peer = _handshake(
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), chain, pebble.root, NAME, key_pem
        )
        assert peer["subjectAltName"] == (("DNS", NAME),)
        folder.save(key_pem, chain)  # and kept: the key and the chain in one file, 0600
        pem = folder.path / "server.pem"
        assert oct(pem.stat().st_mode & 0o777) == "0o600"
        assert oct(folder.path.stat().st_mode & 0o777) == "0o700"
        assert oct((folder.path / "account.pem").stat().st_mode & 0o777) == "0o600"
        assert folder.facts()["names"] == [NAME]
        assert folder.context() is not None

    def test_bad_nonces_are_retried(self, tmp_path, test_ca, dns):
        """pebble refusing half of all good nonces (it refuses 5 % by default)."""
        pebble = Pebble(
            tmp_path / "pebble", test_ca, f"127.0.0.1:{dns.port}", PEBBLE_WFE_NONCEREJECT="50"
        )
        try:
            folder = notesvc.TlsFolder(tmp_path / "state")
            client = notesvc.AcmeClient(pebble.directory, str(test_ca.path), folder.account_key())
            client.NONCE_RETRIES = 12
            refused, real = [], client._http

            def counting(method, url, body=None):
                status, headers, raw = real(method, url, body)
                if b"badNonce" in raw:
                    refused.append(url)
                return status, headers, raw

            client._http = counting
            _key, chain = client.obtain(NAME, dns.publish, dns.withdraw)
            assert b"BEGIN CERTIFICATE" in chain
        finally:
            pebble.stop()
        assert refused  # pebble did refuse some, and each was tried again

    def test_a_record_nobody_published_fails_dns01(self, tmp_path, test_ca, dns):
        pebble = Pebble(tmp_path / "pebble", test_ca, f"127.0.0.1:{dns.port}")
        try:
            client = notesvc.AcmeClient(
                pebble.directory, str(test_ca.path), notesvc.TlsFolder(tmp_path).account_key()
            )
            with pytest.raises(notesvc.AcmeError, match="DNS-01 failed"):
                client.obtain(NAME, lambda values: None, dns.withdraw)  # (published nowhere)
        finally:
            pebble.stop()

    def test_the_keeper_renews_when_due_and_the_old_certificate_serves_until_then(
        self, tmp_path, test_ca, dns
    ):
        """A certificate two thirds through its life: while the CA is down the keeper backs
        off, doubling, and keeps serving it; once the CA answers, a new one replaces it."""
        folder = notesvc.TlsFolder(tmp_path / "state")
        now = dt.datetime.now(dt.timezone.utc)
        key, cert = test_ca.leaf(
            [NAME], not_before=now - dt.timedelta(hours=2), not_after=now + dt.timedelta(hours=1)
        )
        folder.path.mkdir(parents=True)
        folder.save(key, cert)
        changes = []
        keeper = notesvc.CertKeeper(
            folder,
            f"https://127.0.0.1:{free_port()}/dir",  # nobody there
            str(test_ca.path),
            "",
            dns.publish,
            dns.withdraw,
            lambda: changes.append(time.time()),
        )
        keeper.BACKOFF_FIRST = 0.3
        keeper.name = NAME
        waits = []
        for _ in range(3):  # each try as its time comes (_run waits that long between)
            keeper.next_attempt = 0.0
            waits.append(keeper._step())
        old = keeper.context()
        assert old is not None  # the old one serves on
        assert keeper.state == "error"
        assert "cannot be reached" in keeper.last_error
        assert keeper.failures == 3
        assert waits == pytest.approx([0.3, 0.6, 1.2], rel=0.11)  # doubling, each ±10 %
        status = keeper.status()
        assert status["certificate"]["issuer"] == "notesvc test CA"
        assert status["nextAttemptAt"] is not None
        pebble = Pebble(tmp_path / "pebble", test_ca, f"127.0.0.1:{dns.port}")
        try:
            keeper.directory = pebble.directory
            keeper.next_attempt = 0.0
            keeper._step()
        finally:
            pebble.stop()
        assert keeper.state == "valid"
        assert keeper.failures == 0
        assert keeper.last_error is None
        assert keeper.context() is not old
        assert keeper.status()["certificate"]["issuer"].startswith("Pebble")
        assert changes  # the link registers again and the splices take the new one


# -- a CA that is down, slow or refusing --------------------------------------------------------


class StandInCa:
    """An ACME directory on plain HTTP (loopback) that answers as told: `hang` never
    answers; otherwise a directory and nonces, and a problem document for every POST."""

    def __init__(self, hang: bool = False, kind: str = "rejectedIdentifier"):
        ca = self
        self.seen: list = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def answer(self, status, body=b"", ctype="application/json", **headers):
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Replay-Nonce", f"nonce-{time.monotonic_ns()}")
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                ca.seen.append(("GET", self.path))
                if hang:
                    time.sleep(3)
                    return
                base = f"http://127.0.0.1:{ca.port}"
                urls = {k: f"{base}/{k}" for k in ("newNonce", "newAccount", "newOrder")}
                self.answer(200, json.dumps(urls).encode())

            def do_HEAD(self):
                ca.seen.append(("HEAD", self.path))
                self.answer(200)

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                ca.seen.append(("POST", self.path))
                if self.path == "/newAccount":
                    self.answer(201, b"{}", Location=f"http://127.0.0.1:{ca.port}/acct/1")
                    return
                problem = {
                    "type": f"urn:ietf:params:acme:error:{kind}",
                    "detail": "Error creating new order :: policy forbids issuing for name",
                }
                self.answer(400, json.dumps(problem).encode(), "application/problem+json")

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.directory = f"http://127.0.0.1:{self.port}/dir"
        threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        ).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class TestAUnwillingCa:
    def client(self, tmp_path: Path, directory: str) -> notesvc.AcmeClient:
        pytest.importorskip("cryptography")
        return notesvc.AcmeClient(directory, "", notesvc.TlsFolder(tmp_path).account_key())

    def test_a_ca_that_is_down(self, tmp_path):
        client = self.client(tmp_path, f"http://127.0.0.1:{free_port()}/dir")
        with pytest.raises(notesvc.AcmeError, match="cannot be reached"):
            client.obtain(NAME, lambda v: None, lambda: None)

    @pytest.mark.slow
    def test_a_ca_that_never_answers(self, tmp_path):
        ca = StandInCa(hang=True)
        try:
            client = self.client(tmp_path, ca.directory)
            client.TIMEOUT = 0.5
            started = time.monotonic()
            with pytest.raises(notesvc.AcmeError, match="timed out"):
                client.obtain(NAME, lambda v: None, lambda: None)
            assert time.monotonic() - started < 2.5
        finally:
            ca.close()

    def test_a_ca_that_refuses_says_why_and_publishes_nothing(self, tmp_path):
        ca = StandInCa()
        published = []
        try:
            client = self.client(tmp_path, ca.directory)
            with pytest.raises(notesvc.AcmeError, match="rejectedIdentifier") as refused:
                client.obtain(NAME, published.append, lambda: None)
        finally:
            ca.close()
        assert "policy forbids" in str(refused.value)
        assert refused.value.status == 400
        assert published == []
        assert [p for m, p in ca.seen if m == "POST"] == ["/newAccount", "/newOrder"]

    @pytest.mark.slow
    def test_a_directory_that_is_not_acme(self, tmp_path):
        class NotAcme(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                body = b"<html>hello</html>"
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotAcme)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        try:
            client = self.client(tmp_path, f"http://127.0.0.1:{httpd.server_address[1]}/dir")
            with pytest.raises(notesvc.AcmeError, match="is not an ACME directory"):
                client.obtain(NAME, lambda v: None, lambda: None)
        finally:
            httpd.shutdown()
            httpd.server_close()

    def test_the_keeper_backs_off_from_a_minute_to_six_hours(self, tmp_path):
        pytest.importorskip("cryptography")
        keeper = notesvc.CertKeeper(
            notesvc.TlsFolder(tmp_path),
            f"http://127.0.0.1:{free_port()}/dir",
            "",
            "",
            lambda v: None,
            lambda: None,
            lambda: None,
        )
        keeper.name = NAME
        waits = []
        for _ in range(12):
            keeper.next_attempt = 0.0
            waits.append(keeper._step())
        for wait, want in zip(waits, [60, 120, 240, 480, 960, 1920, 3840, 7680, 15360, 21600]):
            assert wait == pytest.approx(want, rel=0.11)
        assert waits[-1] == pytest.approx(21600, rel=0.11)
        assert keeper.context() is None
        assert keeper.status()["state"] == "error"


class TestWithoutCryptography:
    def test_the_mode_says_so_and_stays_off(self, anon, monkeypatch, caplog):
        patch_global(monkeypatch, "has_cryptography", lambda: False)
        svc = anon.app.service
        mode = notesvc.Passthrough(svc, object(), lambda *a: (200, {}), lambda: None)
        assert "python3-cryptography" in mode.reason
        assert mode.learn({"passthrough": True, "domain": DOMAIN, "tlsPort": 443}, SID) == ""
        assert "staying off" in caplog.text
        assert mode.wanted() is False
        status = mode.status()
        assert status["state"] == "unavailable"
        assert "cryptography" in status["reason"]

    def test_a_relay_that_does_not_offer_it(self, anon):
        pytest.importorskip("cryptography")
        mode = notesvc.Passthrough(anon.app.service, object(), lambda *a: (200, {}), lambda: None)
        assert mode.learn({"passthrough": False, "domain": DOMAIN}, SID) == ""
        assert mode.status()["state"] == "not offered"
        assert mode.keeper.name == ""  # nothing asked of any CA


def test_renewal_is_two_thirds_into_the_lifetime():
    assert notesvc.renew_at({"notBefore": 0, "notAfter": 90 * 86400}) == 60 * 86400


def test_the_dns01_value_is_rfc_8555s():
    # RFC 8555 8.1 and 8.4: base64url(SHA-256(token "." thumbprint)); RFC 7638's example JWK
    jwk = {
        "crv": "P-256",
        "kty": "EC",
        "x": "f83OJ3D2xF1Bg8vub9tLe1gHMzV76e8Tus9uPHvRVEU",
        "y": "x_FEzRu9m36HLN_tue659LNpXW6pCyStikYjKIWI5a0",
    }
    thumbprint = notesvc.jwk_thumbprint(jwk)
    import base64
    import hashlib

    canonical = json.dumps(jwk, sort_keys=True, separators=(",", ":")).encode()
    assert (
        thumbprint
        == base64.urlsafe_b64encode(hashlib.sha256(canonical).digest()).rstrip(b"=").decode()
    )
    value = notesvc.dns01_value("token-1", thumbprint)
    expect = hashlib.sha256(f"token-1.{thumbprint}".encode()).digest()
    assert value == base64.urlsafe_b64encode(expect).rstrip(b"=").decode()
    assert len(value) == 43


def test_a_test_ca_certificate_is_seen_through(tmp_path):
    ca = TestCA(tmp_path)
    _key, cert = ca.leaf([NAME])
    assert notesvc.certificate_facts(cert.decode())["names"] == [NAME]
    assert wait_for(lambda: True)
