"""ClientHellos read for their name, PROXY headers, certificate names
(src/notesvc/passthrough/wire.py)."""

from __future__ import annotations

import datetime as dt
import struct

import pytest

from conftest import notesvc
from passthrough_kit import TestCA, client_hello


def records(handshake: bytes, size: int) -> bytes:
    """The handshake message cut into TLS records of `size` bytes each."""
    return b"".join(
        struct.pack("!BHH", 22, 0x0301, len(handshake[i : i + size])) + handshake[i : i + size]
        for i in range(0, len(handshake), size)
    )


def extensions_of(hello: bytes) -> tuple:
    """Split a real ClientHello (one record) into (its body up to the extensions, the
    extensions as (type, data) pairs)."""
    body = hello[9:]  # record header (5) and handshake header (4) off
    at = 2 + 32
    at += 1 + body[at]
    at += 2 + int.from_bytes(body[at : at + 2], "big")
    at += 1 + body[at]
    exts, i = [], at + 2
    while i < len(body):
        kind, size = struct.unpack_from("!HH", body, i)
        exts.append((kind, body[i + 4 : i + 4 + size]))
        i += 4 + size
    return body[:at], exts


def rebuilt(head: bytes, exts: list) -> bytes:
    """A ClientHello record of this head and these extensions, the lengths mended."""
    packed = b"".join(struct.pack("!HH", k, len(v)) + v for k, v in exts)
    body = head + struct.pack("!H", len(packed)) + packed
    return records(b"\x01" + len(body).to_bytes(3, "big") + body, 16384)


def sni_extension(names: list) -> bytes:
    entries = b"".join(b"\x00" + struct.pack("!H", len(n)) + n for n in names)
    return struct.pack("!H", len(entries)) + entries


def with_sni(hello: bytes, names: list) -> bytes:
    """A real ClientHello whose server_name extension names `names` (raw bytes each)."""
    head, exts = extensions_of(hello)
    return rebuilt(head, [(k, sni_extension(names) if k == 0 else v) for k, v in exts])


def other(names: list) -> bytes:
    return with_sni(client_hello("x.relay.test"), names)


class TestClientHello:
    NAME = "abcdefghijklmnopqrst.relay.test"

    def test_a_real_client_hello_gives_its_name_and_its_length(self):
        hello = client_hello(self.NAME)
        size, name = notesvc.client_hello_sni(hello + b"more bytes after it")
        assert (size, name) == (len(hello), self.NAME)

    def test_upper_case_and_a_final_dot_are_the_same_name(self):
        hello = with_sni(client_hello(self.NAME), [b"ABCDEFGHIJKLMNOPQRST.Relay.Test."])
        assert notesvc.client_hello_sni(hello)[1] == self.NAME

    @pytest.mark.parametrize("size", [1, 7, 100])
    def test_a_hello_fragmented_over_many_records_is_read_whole(self, size):
        hello = client_hello(self.NAME)
        handshake = hello[5:]
        fragmented = records(handshake, size)
        assert notesvc.client_hello_sni(fragmented) == (len(fragmented), self.NAME)

    def test_a_truncated_hello_asks_for_more_at_every_length(self):
        hello = records(client_hello(self.NAME)[5:], 50)
        for cut in range(len(hello)):
            assert notesvc.client_hello_sni(hello[:cut]) is None, cut

    @pytest.mark.parametrize(
        ("hello", "said"),
        [
            (lambda: client_hello(None), "no server name"),
            (lambda: other([b"a.relay.test", b"b.relay.test"]), "several server names"),
            (lambda: other([b"127.0.0.1"]), "IP literal"),
            (lambda: other([b"[::1]"]), "IP literal"),
            (lambda: other([b"a" * 300]), "over 253"),
            (lambda: other([b"a" * 70 + b".test"]), "not a host name"),
            (lambda: other([b"caf\xc3\xa9.test"]), "not ASCII"),
            (lambda: other([b"a b.test"]), "not a host name"),
            (lambda: b"GET / HTTP/1.1\r\n\r\n", "not a TLS handshake"),
            (lambda: b"\x16\x03\x01\x00\x00", "malformed TLS record"),
            (lambda: b"\x16\x07\x01\x00\x05hello", "malformed TLS record"),
            (lambda: b"\x16\x03\x01\x00\x04\x02\x00\x00\x00", "not a ClientHello"),
            (lambda: b"\x16\x03\x01\x00\x04\x01\xff\xff\xff", "over 16384 bytes"),
            (lambda: records(b"\x01\x00\x00\x05" + b"\x03\x03abc", 100), "truncated"),
        ],
    )
    def test_what_cannot_be_spliced_says_why(self, hello, said):
        with pytest.raises(notesvc.HelloError, match=said):
            notesvc.client_hello_sni(hello())

    def test_a_hello_spread_over_too_many_bytes_is_refused(self):
        handshake = client_hello(self.NAME)[5:]
        padded = records(b"\x01" + (70000).to_bytes(3, "big"), 4) + records(b"x" * 200, 1) * 80
        with pytest.raises(notesvc.HelloError):
            notesvc.client_hello_sni(padded)
        assert notesvc.client_hello_sni(records(handshake, 1))[1] == self.NAME  # (1-byte is fine)

    def test_an_extension_given_twice_is_refused(self):
        head, exts = extensions_of(client_hello(self.NAME))
        twice = rebuilt(head, [*exts, next(e for e in exts if e[0] == 0)])
        with pytest.raises(notesvc.HelloError, match="given twice"):
            notesvc.client_hello_sni(twice)


class TestProxyHeader:
    @pytest.mark.parametrize(
        ("client", "local"),
        [
            (("203.0.113.7", 51000), ("127.0.0.1", 443)),
            (("2001:db8::7", 51000), ("::1", 443)),
            (("203.0.113.7", 1), ("::1", 443)),  # v4 beside v6: both as v6, unwrapped back
        ],
    )
    def test_v2_round_trip(self, client, local):
        header = notesvc.proxy_v2_header(client, local)
        assert header.startswith(notesvc.PROXY_V2_SIGNATURE)
        assert notesvc.parse_proxy_header(header + b"\x16rest") == (len(header), client)

    def test_v2_asks_for_more_until_whole(self):
        header = notesvc.proxy_v2_header(("198.51.100.2", 4000), ("127.0.0.1", 443))
        for cut in range(len(header)):
            assert notesvc.parse_proxy_header(header[:cut]) is None, cut

    def test_v1_as_nginx_writes_it(self):
        line = b"PROXY TCP4 198.51.100.2 127.0.0.1 40312 443\r\n"
        assert notesvc.parse_proxy_header(line + b"\x16\x03") == (
            len(line),
            ("198.51.100.2", 40312),
        )
        line6 = b"PROXY TCP6 2001:db8::2 ::1 40312 443\r\n"
        assert notesvc.parse_proxy_header(line6) == (len(line6), ("2001:db8::2", 40312))
        assert notesvc.parse_proxy_header(b"PROXY UNKNOWN\r\n") == (15, None)
        assert notesvc.parse_proxy_header(b"PROXY TCP4 198.51") is None

    @pytest.mark.parametrize(
        "raw",
        [
            b"GET / HTTP/1.1\r\n",
            b"PROXY TCP4 not-an-ip 127.0.0.1 1 2\r\n",
            b"PROXY TCP4 2001:db8::1 127.0.0.1 1 2\r\n",
            b"PROXY TCP9 1.2.3.4 127.0.0.1 1 2\r\n",
            b"PROXY " + b"x" * 200,
            b"\r\n\r\n\x00\r\nQUIX\n\x21\x11\x00\x0c" + bytes(12),
            b"\r\n\r\n\x00\r\nQUIT\n\x13\x11\x00\x0c" + bytes(12),
            b"\r\n\r\n\x00\r\nQUIT\n\x21\x99\x00\x00",
        ],
    )
    def test_what_is_not_a_proxy_header_is_refused(self, raw):
        with pytest.raises(ValueError, match=r"PROXY|IPv4|address"):
            notesvc.parse_proxy_header(raw)


class TestCertificateFacts:
    def test_names_dates_and_issuer_without_the_cryptography_package(self, tmp_path):
        ca = TestCA(tmp_path)
        start = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
        end = dt.datetime(2051, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)  # GeneralizedTime
        _key, cert = ca.leaf(["relay.test", "*.relay.test"], not_before=start, not_after=end)
        facts = notesvc.certificate_facts(cert.decode() + ca.pem.decode())
        assert facts == {
            "names": ["relay.test", "*.relay.test"],
            "issuer": "notesvc test CA",
            "notBefore": start.timestamp(),
            "notAfter": end.timestamp(),
        }
        assert notesvc.certificate_names(cert.decode()) == ["relay.test", "*.relay.test"]

    @pytest.mark.parametrize(
        "text", ["", "no text", "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----"]
    )
    def test_what_is_not_a_certificate_has_no_facts(self, text):
        assert notesvc.certificate_facts(text) == {}
        assert notesvc.certificate_names(text) == []
