"""Passthrough's judges and stand-ins: a test CA, pebble (a real ACME CA), a relay in
passthrough mode with a server behind it, TLS clients that verify against a root, a DNS
client, a recording TCP proxy and a CONNECT proxy.

The tests make their own CA: for the relay's certificate for its domain, for pebble's own
HTTPS (Debian's pebble ships none) and, where no ACME is wanted, for a server's
`<id>.relay.test` certificate put in its `.notesvc/tls/` before it starts. The
`cryptography` package (a test extra) is imported only inside these functions, so
collecting the tests needs none of it.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import ipaddress
import json
import os
import re
import select
import shutil
import socket
import ssl
import struct
import subprocess
import threading
import urllib.request
from pathlib import Path

import pytest

from conftest import API, DOMAIN, Server, must_be_marked, notesvc, wait_for

PEBBLE = shutil.which("pebble")
KNOTD = shutil.which("knotd") or ("/usr/sbin/knotd" if os.path.exists("/usr/sbin/knotd") else None)
CURL = shutil.which("curl")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def crypto():
    """Return the cryptography modules the test CA uses (skip without the package)."""
    pytest.importorskip("cryptography")
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    return x509, hashes, serialization, ec, NameOID


class TestCA:
    """A CA of the test's own: its root in `path` (PEM), leaves made on demand."""

    __test__ = False  # (not a test class)

    def __init__(self, folder: Path, name: str = "notesvc test CA"):
        x509, hashes, serialization, ec, NameOID = crypto()
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = dt.datetime.now(dt.timezone.utc)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=1))
            .not_valid_after(now + dt.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), critical=False
            )
            .sign(self.key, hashes.SHA256())
        )
        self.pem = self.cert.public_bytes(serialization.Encoding.PEM)
        self.path = folder / "test-ca.pem"
        self.path.write_bytes(self.pem)

    def leaf(self, names: list, ips: tuple = (), not_before=None, not_after=None) -> tuple:
        """Return (key PEM, certificate PEM) of a server certificate for these names."""
        x509, hashes, serialization, ec, NameOID = crypto()
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.timezone.utc)
        san = [x509.DNSName(n) for n in names]
        san += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before or now - dt.timedelta(hours=1))
            .not_valid_after(not_after or now + dt.timedelta(days=10))
            .add_extension(x509.SubjectAlternativeName(san), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                critical=False,
            )
            .sign(self.key, hashes.SHA256())
        )
        key_pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        return key_pem, cert.public_bytes(serialization.Encoding.PEM)

    def files(self, stem: str, names: list, ips: tuple = ()) -> tuple:
        """Write a leaf's key and certificate beside the root; return their paths."""
        key, cert = self.leaf(names, ips)
        (self.folder / f"{stem}.key").write_bytes(key)
        (self.folder / f"{stem}.pem").write_bytes(cert)
        return self.folder / f"{stem}.pem", self.folder / f"{stem}.key"


@pytest.fixture(scope="class")
def test_ca(tmp_path_factory):
    return TestCA(tmp_path_factory.mktemp("ca"))


# -- pebble ------------------------------------------------------------------------------------


class Pebble:
    """Debian's pebble on loopback: its HTTPS by a leaf of the test CA, DNS-01 checked
    against `dns` (host:port), no sleep before validating. `root` is the PEM of the root
    it issues under (from its management port)."""

    def __init__(self, folder: Path, ca: TestCA, dns: str, validity: int = 0, **env: str):
        must_be_marked("real_server")
        if not PEBBLE:
            pytest.skip("pebble is not installed (sudo apt install pebble)")
        folder.mkdir(parents=True, exist_ok=True)
        cert, key = ca.files("pebble", ["localhost"], ("127.0.0.1",))
        self.port, self.management = free_port(), free_port()
        config = {
            "listenAddress": f"127.0.0.1:{self.port}",
            "managementListenAddress": f"127.0.0.1:{self.management}",
            "certificate": str(cert),
            "privateKey": str(key),
            "httpPort": free_port(),
            "tlsPort": free_port(),
            "ocspResponderURL": "",
            "externalAccountBindingRequired": False,
        }
        if validity:
            config["certificateValidityPeriod"] = validity
        (folder / "pebble.json").write_text(json.dumps({"pebble": config}))
        self.log = folder / "pebble.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [PEBBLE, "-config", str(folder / "pebble.json"), "-dnsserver", dns],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PEBBLE_VA_NOSLEEP": "1", **env},
            )
        self.directory = f"https://127.0.0.1:{self.port}/dir"
        self.ca = ca
        context = ssl.create_default_context(cafile=str(ca.path))

        def root():
            assert self.proc.poll() is None, self.log.read_text()
            with contextlib.suppress(OSError):
                url = f"https://127.0.0.1:{self.management}/roots/0"
                with urllib.request.urlopen(url, timeout=5, context=context) as resp:
                    return resp.read()
            return None

        self.root = wait_for(root)
        self.root_path = folder / "pebble-root.pem"
        self.root_path.write_bytes(self.root)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


# -- a relay in passthrough mode, and a server ----------------------------------------------


def relay_ports(relay: Server) -> dict:
    """Return the relay's ports from its banner: http, tls, dns (dns absent with updates)."""

    def found():
        text = "".join(relay.lines)
        tls = re.search(r"TLS on 127\.0\.0\.1:(\d+)", text)
        dns = re.search(r"dns on 127\.0\.0\.1:(\d+)", text)
        if not tls or not (dns or "dns: challenge records" in text):
            return None
        ports = {"http": relay.port, "tls": int(tls.group(1))}
        if dns:
            ports["dns"] = int(dns.group(1))
        return ports

    return wait_for(found)


def passthrough_relay(
    folder: Path, ca: TestCA, port: int = 0, wildcard: bool = True, **env: str
) -> Server:
    """A relay with SERVICE_RELAY_TLS=passthrough for relay.test, its own certificate for
    relay.test (and *.relay.test) from the test CA, TLS and DNS on free ports."""
    names = [DOMAIN, f"*.{DOMAIN}"] if wildcard else [DOMAIN]
    cert, key = ca.files(f"relay-{folder.parent.name}-{folder.name}", names)
    settings = {
        "SERVICE_RELAY_DOMAIN": DOMAIN,
        "SERVICE_RELAY_TLS": "passthrough",
        "SERVICE_RELAY_TLS_PORT": "0",
        "SERVICE_RELAY_DNS_PORT": "0",
        "SERVICE_RELAY_DNS_ADDRESSES": "127.0.0.1",
        "SERVICE_RELAY_TLS_CERT": str(cert),
        "SERVICE_RELAY_TLS_KEY": str(key),
        "SERVICE_RELAY_TIMEOUT": "5",
        **env,
    }
    relay = Server(folder, "relay", env=settings, port=port)
    relay.cert_pem = cert.read_bytes()
    return relay


def server_with_certificate(root: Path, ca: TestCA, **leaf) -> str:
    """Give a new root its state and a certificate for <its id>.relay.test from the test
    CA (so it needs no ACME); return the server id."""
    sid = notesvc.StateStore(root / ".notesvc").read()["serverId"]
    key, cert = ca.leaf([f"{sid}.{DOMAIN}"], **leaf)
    tls = root / ".notesvc" / "tls"
    tls.mkdir(mode=0o700)
    (tls / "server.pem").write_bytes(key + b"\n" + cert)
    os.chmod(tls / "server.pem", 0o600)
    return sid


def connection_of(server: Server, key: str) -> dict:
    headers = {"X-Service-Key": key}
    return server.request("GET", f"{API}/system/info", headers=headers)[2]["data"]["connection"]


def wait_passthrough(server: Server, key: str, timeout: float = 30) -> dict:
    """Wait until the server says it runs in passthrough mode; return its connection."""
    return wait_for(
        lambda: (c := connection_of(server, key))["mode"] == "passthrough" and c, timeout
    )


def client_context(root: Path | bytes) -> ssl.SSLContext:
    if isinstance(root, bytes):
        return ssl.create_default_context(cadata=root.decode())
    return ssl.create_default_context(cafile=str(root))


class TlsClient:
    """HTTP/1.1 over TLS to <name>:<port> on loopback (keep-alive), verifying the chain
    against `root` and the name; `peer_der` is the certificate the server showed."""

    def __init__(self, port: int, name: str, root, timeout: float = 15, source: str = ""):
        self.sock = socket.create_connection(
            ("127.0.0.1", port), timeout=timeout, source_address=(source, 0) if source else None
        )
        try:
            self.tls = client_context(root).wrap_socket(self.sock, server_hostname=name)
        except BaseException:
            self.sock.close()
            raise
        self.name, self.port = name, port
        self.peer_der = self.tls.getpeercert(binary_form=True)
        self.buffer = b""

    def request(self, method: str, path: str, body: bytes = b"", headers=None) -> tuple:
        head = [f"{method} {path} HTTP/1.1", f"Host: {self.name}:{self.port}"]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        if body or method in ("POST", "PUT"):
            head.append(f"Content-Length: {len(body)}")
        self.tls.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        while b"\r\n\r\n" not in self.buffer:
            self._more()
        raw, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        got = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
        length = int(got.get("content-length", 0))
        while len(self.buffer) < length:
            self._more()
        data, self.buffer = self.buffer[:length], self.buffer[length:]
        return status, got, data

    def _more(self) -> None:
        chunk = self.tls.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        self.buffer += chunk

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.tls.close()


def tls_json(port: int, name: str, root, method: str, path: str, key: str = "", body=None):
    """One request over a new TLS connection; return (status, parsed JSON body)."""
    client = TlsClient(port, name, root)
    try:
        headers = {"X-Service-Key": key} if key else {}
        payload = b""
        if body is not None:
            payload = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        status, _headers, raw = client.request(method, path, payload, headers)
        return status, json.loads(raw or b"null")
    finally:
        client.close()


# -- a DNS client -------------------------------------------------------------------------------


def dns_query(port: int, name: str, qtype: int, tcp: bool = False, edns: int = 0) -> bytes:
    """Ask 127.0.0.1:port one question; return the raw answer."""
    ident = int.from_bytes(os.urandom(2), "big")
    message = struct.pack("!HHHHHH", ident, 0x0100, 1, 0, 0, 1 if edns else 0)
    message += notesvc.encode_name(name) + struct.pack("!HH", qtype, 1)
    if edns:
        message += b"\0" + struct.pack("!HHIH", 41, edns, 0, 0)
    if tcp:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(struct.pack("!H", len(message)) + message)
            size = struct.unpack("!H", _read_exactly(s, 2))[0]
            return _read_exactly(s, size)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(5)
        s.sendto(message, ("127.0.0.1", port))
        return s.recv(65535)


def _read_exactly(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def dns_answer(raw: bytes) -> dict:
    """Return {rcode, aa, tc, answers: [(type, rdata)], authority: [type]} of an answer."""
    _id, flags, qd, an, ns, ar = struct.unpack_from("!HHHHHH", raw)
    at = 12
    for _ in range(qd):
        _n, at = notesvc.read_name(raw, at)
        at += 4
    records = []
    for _ in range(an + ns + ar):
        _n, at = notesvc.read_name(raw, at)
        rtype, _c, _t, size = struct.unpack_from("!HHIH", raw, at)
        records.append((rtype, raw[at + 10 : at + 10 + size]))
        at += 10 + size
    return {
        "rcode": flags & 0xF,
        "aa": bool(flags & 0x0400),
        "tc": bool(flags & 0x0200),
        "answers": records[:an],
        "authority": [t for t, _ in records[an : an + ns]],
        "additional": [t for t, _ in records[an + ns :]],
    }


def txt_values(raw: bytes) -> list:
    values = []
    for rtype, rdata in dns_answer(raw)["answers"]:
        if rtype == 16:
            values.append(rdata[1 : 1 + rdata[0]].decode())
    return values


# -- proxies ---------------------------------------------------------------------------------


class RecordingProxy:
    """A TCP proxy on loopback that keeps every byte it passes, both ways (`seen`)."""

    def __init__(self, upstream_port: int):
        self.upstream = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.seen = bytearray()
        self.lock = threading.Lock()
        self.socks: list = []
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:
                client.close()
                continue
            self.socks += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while not self.closed:
                ready, _, _ = select.select([a, b], [], [], 0.5)
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        return
                    with self.lock:
                        self.seen += data
                    (b if s is a else a).sendall(data)
        except OSError:
            return
        finally:
            a.close()
            b.close()

    def close(self) -> None:
        self.closed = True
        self.listener.close()
        for s in self.socks:
            with contextlib.suppress(OSError):
                s.close()


class ConnectProxy:
    """An HTTP CONNECT proxy on loopback that reaches every host at 127.0.0.1 (the names
    of relay.test are nobody's): how rclone, caldav and the mcp SDK get to <id>.relay.test
    through HTTPS_PROXY. `asked` lists the host:port each CONNECT named."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.asked: list = []
        self.closed = False
        self.socks: list = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.socks.append(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = client.recv(4096)
                if not chunk:
                    return
                head += chunk
            line = head.split(b"\r\n", 1)[0].decode()
            method, target, _ = line.split(" ", 2)
            if method != "CONNECT":
                client.sendall(b"HTTP/1.1 405 Method Not Allowed\r\nContent-Length: 0\r\n\r\n")
                return
            self.asked.append(target)
            port = int(target.rsplit(":", 1)[1])
            upstream = socket.create_connection(("127.0.0.1", port))
            self.socks.append(upstream)
            client.sendall(b"HTTP/1.1 200 Connection Established\r\n\r\n")
            rest = head.split(b"\r\n\r\n", 1)[1]
            if rest:
                upstream.sendall(rest)
            while not self.closed:
                ready, _, _ = select.select([client, upstream], [], [], 0.5)
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        return
                    (upstream if s is client else client).sendall(data)
        except OSError:
            return
        finally:
            client.close()

    def close(self) -> None:
        self.closed = True
        self.listener.close()
        for s in self.socks:
            with contextlib.suppress(OSError):
                s.close()


def client_hello(name: str | None) -> bytes:
    """Return the first flight of a real TLS client (Python's ssl) asking for `name`."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname=name)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def closed_without_answer(port: int, data: bytes, timeout: float = 15) -> bool:
    """Send `data` to 127.0.0.1:port; return whether the relay closed the connection
    without sending a byte back (within `timeout`)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        with contextlib.suppress(OSError):
            s.sendall(data)
        try:
            return s.recv(1) == b""
        except ConnectionResetError:
            return True
        except socket.timeout:
            return False


# -- Knot, an authoritative DNS server taking RFC 2136 updates --------------------------------


class Knot:
    """Debian's knotd on a free loopback port, authoritative for relay.test, taking RFC
    2136 updates signed with one TSIG key (`tsig`: the SERVICE_RELAY_DNS_TSIG value)."""

    ZONE = (
        "$ORIGIN relay.test.\n$TTL 300\n@ SOA ns hostmaster 1 3600 600 604800 60\n"
        "@ NS ns\nns A 127.0.0.1\n* A 127.0.0.1\n"
    )

    def __init__(self, folder: Path):
        must_be_marked("real_server")
        if not KNOTD:
            pytest.skip("knot is not installed (sudo apt install knot)")
        folder.mkdir(parents=True, exist_ok=True)
        self.secret = base64.b64encode(os.urandom(32)).decode()
        self.tsig = f"relay-key:{self.secret}"
        self.port = free_port()
        (folder / "relay.test.zone").write_text(self.ZONE)
        (folder / "knot.conf").write_text(
            f'server:\n    rundir: "{folder}"\n    listen: 127.0.0.1@{self.port}\n'
            f'database:\n    storage: "{folder}"\n'
            f"key:\n  - id: relay-key\n    algorithm: hmac-sha256\n    secret: {self.secret}\n"
            "acl:\n  - id: relay-update\n    key: relay-key\n    action: update\n"
            f'template:\n  - id: default\n    storage: "{folder}"\n    file: "%s.zone"\n'
            "zone:\n  - domain: relay.test\n    acl: relay-update\n"
            "log:\n  - target: stderr\n    any: info\n"
        )
        self.log = folder / "knot.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [KNOTD, "-c", str(folder / "knot.conf")], stdout=out, stderr=subprocess.STDOUT
            )

        def up():
            assert self.proc.poll() is None, self.log.read_text()
            with contextlib.suppress(OSError):
                return dns_answer(dns_query(self.port, DOMAIN, 6))["rcode"] == 0
            return False

        wait_for(up)

    def txt(self, server_id: str) -> list:
        return txt_values(dns_query(self.port, f"_acme-challenge.{server_id}.{DOMAIN}", 16))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
