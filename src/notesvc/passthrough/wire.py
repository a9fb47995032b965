"""What passthrough reads on the wire: ClientHellos' SNI, PROXY headers, certificate names.

Both sides of the passthrough relay share these: the relay reads a client's ClientHello
for the name it asks for (never decrypting anything) and writes a PROXY protocol v2
header before the client's bytes; the server reads that header back. The relay reads a
PROXY header too, from a proxy it trusts (nginx's `stream` module in front of several
relays), and the names its own certificate covers (does it hold `*.D`?).
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
import re
import socket
import struct

# -- ClientHello -----------------------------------------------------------------------
#
# A TLS record: type (22: handshake), version (3, x), length (1..16384), then the
# fragment; a handshake message may span many records (RFC 8446 5.1), so the fragments
# are joined until the ClientHello's own length is there. Nothing else is accepted before
# it: no SNI, several names, an IP literal or a name no DNS could hold close the
# connection (RFC 6066 3: a host name, never an address).

TLS_HANDSHAKE = 22
MAX_HELLO_BYTES = 16384  # a ClientHello larger than this (post-quantum key shares: ~1.8 KB)
MAX_HELLO_RAW = 65536  # bytes read for one, records' headers included (1-byte fragments)
_SNI_LABEL_RE = re.compile(r"^[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?\Z")


class HelloError(ValueError):
    """What a ClientHello lacks or holds that the relay will not splice: its words."""


def client_hello_sni(data: bytes) -> tuple | None:
    """Return (bytes of the records that hold the whole ClientHello, the server name it
    asks for, lower case) once `data` holds it; None while more bytes are needed.

    Raises HelloError for anything else: another record type, a malformed or oversized
    message, no server name, several, an IP literal or a name that is not a host name.
    """
    handshake = bytearray()
    at = 0
    while True:
        if len(data) - at < 5:
            if len(data) >= MAX_HELLO_RAW:
                raise HelloError("the ClientHello is spread over too many bytes")
            return None
        kind, major, minor, length = struct.unpack_from("!BBBH", data, at)
        if kind != TLS_HANDSHAKE:
            raise HelloError("not a TLS handshake record")
        if major != 3 or minor > 4 or not 0 < length <= 16384:
            raise HelloError("a malformed TLS record")
        if len(data) - at - 5 < length:
            if at + 5 + length > MAX_HELLO_RAW:
                raise HelloError("the ClientHello is spread over too many bytes")
            return None
        handshake += data[at + 5 : at + 5 + length]
        at += 5 + length
        if len(handshake) >= 4:
            if handshake[0] != 1:
                raise HelloError("the first handshake message is not a ClientHello")
            size = int.from_bytes(handshake[1:4], "big")
            if size > MAX_HELLO_BYTES:
                raise HelloError(f"the ClientHello is over {MAX_HELLO_BYTES} bytes")
            if len(handshake) >= 4 + size:
                return at, _hello_server_name(bytes(handshake[4 : 4 + size]))


def _hello_server_name(body: bytes) -> str:
    """Return the one host name a ClientHello's body asks for (see client_hello_sni)."""
    try:
        at = 2 + 32  # legacy_version, random
        at += 1 + body[at]  # legacy_session_id
        suites = int.from_bytes(body[at : at + 2], "big")
        if suites < 2 or suites % 2:
            raise HelloError("a ClientHello without cipher suites")
        at += 2 + suites
        at += 1 + body[at]  # legacy_compression_methods
    except IndexError:
        raise HelloError("a truncated ClientHello") from None
    if at > len(body):
        raise HelloError("a truncated ClientHello")
    if at == len(body):
        raise HelloError("no server name (SNI): the relay splices by name")
    total = int.from_bytes(body[at : at + 2], "big")
    at += 2
    if at + total != len(body):
        raise HelloError("the ClientHello's extensions do not fill it")
    names, seen = [], set()
    while at < len(body):
        if at + 4 > len(body):
            raise HelloError("a truncated extension")
        kind, size = struct.unpack_from("!HH", body, at)
        at += 4
        if at + size > len(body):
            raise HelloError("a truncated extension")
        if kind in seen:
            raise HelloError("an extension given twice")
        seen.add(kind)
        if kind == 0:
            names = _sni_names(body[at : at + size])
        at += size
    if not names:
        raise HelloError("no server name (SNI): the relay splices by name")
    if len(names) > 1:
        raise HelloError("several server names in one ClientHello")
    return host_name_of(names[0])


def _sni_names(ext: bytes) -> list:
    """Return the host_name entries of a server_name extension (RFC 6066 3)."""
    if len(ext) < 2 or int.from_bytes(ext[:2], "big") != len(ext) - 2:
        raise HelloError("a malformed server_name extension")
    names, at = [], 2
    while at < len(ext):
        if at + 3 > len(ext):
            raise HelloError("a malformed server_name extension")
        kind, size = ext[at], int.from_bytes(ext[at + 1 : at + 3], "big")
        at += 3
        if at + size > len(ext) or size == 0:
            raise HelloError("a malformed server_name extension")
        if kind == 0:
            names.append(ext[at : at + size])
        at += size
    return names


def host_name_of(raw: bytes) -> str:
    """Return a server name as the relay compares it (lower case, no final dot).

    Raises HelloError for an IP literal, or a name that is not ASCII letters, digits,
    hyphens and underscores in labels of 1-63 within 253 bytes.
    """
    if len(raw) > 254:
        raise HelloError("the server name is over 253 bytes")
    try:
        name = raw.decode("ascii").lower()
    except UnicodeDecodeError:
        raise HelloError("the server name is not ASCII") from None
    name = name[:-1] if name.endswith(".") else name
    try:
        ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        pass
    else:
        raise HelloError("the server name is an IP literal")
    if not name or len(name) > 253 or not all(_SNI_LABEL_RE.match(p) for p in name.split(".")):
        raise HelloError("the server name is not a host name")
    return name


# -- PROXY protocol ----------------------------------------------------------------------
#
# Version 2 (binary) is what the relay writes before a client's bytes on a data
# connection: the client's address and port, and the address it connected to. The relay
# reads version 1 or 2 from a proxy SERVICE_TRUST_PROXY names (nginx's `proxy_protocol
# on` writes version 1).

PROXY_V2_SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"
PROXY_V1_MAX = 107  # "PROXY TCP6 <39> <39> 65535 65535\r\n"


def proxy_v2_header(client: tuple, local: tuple) -> bytes:
    """Return a PROXY v2 header (command PROXY, stream) for a client's (address, port) that
    connected to `local` (address, port); IPv4 in IPv6 when one of the two is IPv6."""
    src, dst = ipaddress.ip_address(client[0]), ipaddress.ip_address(local[0])
    if src.version == dst.version == 4:
        family, body = 0x11, src.packed + dst.packed
    else:
        six = [a if a.version == 6 else ipaddress.IPv6Address(f"::ffff:{a}") for a in (src, dst)]
        family, body = 0x21, six[0].packed + six[1].packed
    body += struct.pack("!HH", int(client[1]), int(local[1]))
    return PROXY_V2_SIGNATURE + struct.pack("!BBH", 0x21, family, len(body)) + body


def parse_proxy_header(data: bytes) -> tuple | None:
    """Return (its length in bytes, the client's (address, port) or None for LOCAL and
    UNKNOWN) of a PROXY v1 or v2 header at the start of `data`; None while more is needed.

    Raises ValueError for anything that is not such a header.
    """
    if data[:1] == b"\r":
        if len(data) < 16:
            if not PROXY_V2_SIGNATURE.startswith(data[:12]):
                raise ValueError("not a PROXY header")
            return None
        if data[:12] != PROXY_V2_SIGNATURE or data[12] >> 4 != 2:
            raise ValueError("not a PROXY v2 header")
        command, family, size = data[12] & 0xF, data[13], int.from_bytes(data[14:16], "big")
        if len(data) < 16 + size:
            return None
        body = data[16 : 16 + size]
        if command == 0:  # LOCAL: the proxy's own connection (a health check)
            return 16 + size, None
        if command != 1:
            raise ValueError("an unknown PROXY v2 command")
        if family == 0x11 and size >= 12:
            port = int.from_bytes(body[8:10], "big")
            return 16 + size, (str(ipaddress.IPv4Address(body[:4])), port)
        if family == 0x21 and size >= 36:
            ip = ipaddress.IPv6Address(body[:16])
            text = str(ip.ipv4_mapped) if ip.ipv4_mapped else str(ip)
            return 16 + size, (text, int.from_bytes(body[32:34], "big"))
        if family == 0:
            return 16 + size, None
        raise ValueError("a PROXY v2 header of an unknown family")
    if not b"PROXY ".startswith(data[:6]):
        raise ValueError("not a PROXY header")
    end = data.find(b"\r\n", 0, PROXY_V1_MAX)
    if end < 0:
        if len(data) >= PROXY_V1_MAX:
            raise ValueError("a PROXY v1 header over 107 bytes")
        return None
    words = data[:end].decode("ascii", "replace").split(" ")
    if words[1:2] == ["UNKNOWN"]:
        return end + 2, None
    if len(words) != 6 or words[1] not in ("TCP4", "TCP6"):
        raise ValueError("a malformed PROXY v1 header")
    ip = ipaddress.ip_address(words[2])
    if (ip.version == 4) != (words[1] == "TCP4") or not words[4].isdigit():
        raise ValueError("a malformed PROXY v1 header")
    return end + 2, (str(ip), int(words[4]))


def socket_address(sock: socket.socket, peer: bool) -> tuple:
    """Return (address, port) of a socket's peer or own end ("0.0.0.0", 0 if unknown),
    IPv4-mapped IPv6 unwrapped."""
    try:
        addr = sock.getpeername() if peer else sock.getsockname()
    except OSError:
        return "0.0.0.0", 0
    if not isinstance(addr, tuple):  # a Unix socket
        return "0.0.0.0", 0
    host = addr[0]
    if host.startswith("::ffff:") and "." in host:
        host = host[7:]
    return host, addr[1]


# -- certificate names ------------------------------------------------------------------
#
# The relay's own certificate for D may cover *.D as well: it then terminates <id>.D for
# a server that is not in passthrough mode (its per-server origin) instead of closing it.
# The DNS names come from the subjectAltName extension, read from the DER with the
# standard library (no cryptography package on a relay).

_SAN_OID = bytes.fromhex("0603551d11")  # OBJECT IDENTIFIER 2.5.29.17


def _der(data: bytes, at: int) -> tuple:
    """Return (tag, start of its contents, end) of the DER element at `at`."""
    tag, size = data[at], data[at + 1]
    at += 2
    if size & 0x80:
        count = size & 0x7F
        size = int.from_bytes(data[at : at + count], "big")
        at += count
    if at + size > len(data):
        raise ValueError("a truncated DER element")
    return tag, at, at + size


def _der_children(data: bytes, start: int, end: int) -> list:
    children = []
    while start < end:
        tag, body, stop = _der(data, start)
        children.append((tag, body, stop, start))
        start = stop
    return children


def certificate_names(pem: str) -> list:
    """Return the DNS names (subjectAltName) of the first certificate in PEM text; []
    when there is none or it cannot be read."""
    return certificate_facts(pem).get("names", [])


_CN_OID = bytes.fromhex("0603550403")  # 2.5.4.3 commonName
_ORG_OID = bytes.fromhex("060355040a")  # 2.5.4.10 organizationName


def _der_time(der: bytes, tag: int, start: int, end: int) -> float:
    """Return a UTCTime (tag 23) or GeneralizedTime (24) as seconds since the epoch."""
    text = der[start:end].decode("ascii").rstrip("Z")
    if tag == 23:
        text = ("19" if int(text[:2]) >= 50 else "20") + text
    moment = dt.datetime.strptime(text[:14], "%Y%m%d%H%M%S")
    return moment.replace(tzinfo=dt.timezone.utc).timestamp()


def certificate_facts(pem: str) -> dict:
    """Return {names, notBefore, notAfter, issuer} of the first certificate in PEM text
    (times as seconds since the epoch, the issuer's CN or O); {} when there is none or it
    cannot be read. Standard library only: a relay, and `audit`, read certificates
    without the cryptography package."""
    m = re.search(r"-----BEGIN CERTIFICATE-----(.+?)-----END CERTIFICATE-----", pem, re.S)
    if not m:
        return {}
    try:
        der = base64.b64decode("".join(m.group(1).split()))
        _tag, body, _end = _der(der, 0)
        _tag, tbs, tbs_end = _der(der, body)
        parts = _der_children(der, tbs, tbs_end)
        if parts[0][0] == 0xA0:  # [0] version: the fields after it move up one
            parts = parts[1:]
        facts: dict = {"names": [], "issuer": _der_name_text(der, parts[2])}
        times = _der_children(der, parts[3][1], parts[3][2])
        facts["notBefore"] = _der_time(der, *times[0][:3])
        facts["notAfter"] = _der_time(der, *times[1][:3])
        for tag, inner, _stop, _ in parts:
            if tag != 0xA3:  # [3] extensions
                continue
            _tag, exts, exts_end = _der(der, inner)
            for _t, ext, ext_end, _s in _der_children(der, exts, exts_end):
                fields = _der_children(der, ext, ext_end)
                if der[fields[0][3] : fields[0][2]] != _SAN_OID:
                    continue
                _tag, value, _e = _der(der, fields[-1][3])  # the OCTET STRING's contents
                _tag, names, names_end = _der(der, value)
                facts["names"] = [
                    der[b:e].decode("ascii", "replace").lower()
                    for t, b, e, _s in _der_children(der, names, names_end)
                    if t == 0x82  # [2] dNSName
                ]
        return facts
    except (ValueError, IndexError):
        return {}


def _der_name_text(der: bytes, name: tuple) -> str:
    """Return a Name's commonName, else its organizationName ("" without either)."""
    found = {}
    for _t, rdn, rdn_end, _s in _der_children(der, name[1], name[2]):
        for _t2, pair, pair_end, _s2 in _der_children(der, rdn, rdn_end):
            oid, value = _der_children(der, pair, pair_end)[:2]
            found[der[oid[3] : oid[2]]] = der[value[1] : value[2]].decode("utf-8", "replace")
    return found.get(_CN_OID) or found.get(_ORG_OID) or ""
