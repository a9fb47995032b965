"""The relay's DNS: authoritative for its domain (UDP, TCP), or RFC 2136 updates with TSIG.

A passthrough relay's servers get their certificates by ACME DNS-01: the CA looks up
`TXT _acme-challenge.<id>.D`, and only server <id> may set it, over its authenticated
link (`PUT /relay/v1/acme/<id>`). A single relay answers DNS for D itself (the domain
delegated to it: NS records at the parent); several relays behind a load balancer keep
no DNS of their own and send RFC 2136 updates, signed with a TSIG key, to a DNS server
the operator runs (Knot, BIND, PowerDNS).

What the relay's own DNS answers (authoritative for D only, AA set):

    D                        SOA, NS (ns.D), A/AAAA (SERVICE_RELAY_DNS_ADDRESSES)
    <label>.D                A/AAAA (the wildcard *.D: every server's own name, ns.D)
    _acme-challenge.<id>.D   TXT, while server <id> has set it (at most 10 minutes)
    other types at those     NOERROR, no answer, the SOA in authority (CAA, MX, HTTPS...)
    other names under D      NXDOMAIN, the SOA in authority
    names outside D          REFUSED (not a resolver)
    ANY                      RFC 8482's minimal answer (one HINFO "RFC8482")

UDP answers over 512 bytes (or the EDNS size asked, at most 1232) are cut to the question
with TC set: the asker comes again over TCP.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import hmac
import ipaddress
import secrets
import struct
import time

from notesvc.boot import log
from notesvc.helpers import log_safe

# record types and classes (RFC 1035, 3596, 6891, 8945)
DNS_A, DNS_NS, DNS_SOA, DNS_HINFO, DNS_TXT, DNS_AAAA = 1, 2, 6, 13, 16, 28
DNS_OPT, DNS_TSIG, DNS_IXFR, DNS_AXFR, DNS_ANY = 41, 250, 251, 252, 255
DNS_IN, DNS_CLASS_NONE, DNS_CLASS_ANY = 1, 254, 255
# response codes
NOERROR, FORMERR, SERVFAIL, NXDOMAIN, NOTIMP, REFUSED, NOTAUTH = 0, 1, 2, 3, 4, 5, 9
OPCODE_QUERY, OPCODE_UPDATE = 0, 5

DNS_MAX_QUERY = 4096  # bytes of a query, over UDP or TCP (a real one is under 300)
DNS_UDP_PLAIN = 512  # an answer's largest size over UDP without EDNS
DNS_UDP_EDNS = 1232  # ... and with it, at most (DNS flag day 2020)
DNS_TCP_SECONDS = 10.0  # a TCP query's bytes must all come within this
DNS_TCP_MAX = 256  # TCP connections at once (the oldest closed first)
CHALLENGE_TTL = 600.0  # seconds a challenge record is kept at most
CHALLENGE_MAX_VALUES = 4
CHALLENGE_MAX_BYTES = 255
TTL_ADDRESS, TTL_ZONE, TTL_CHALLENGE, TTL_NEGATIVE = 300, 3600, 60, 60


class DnsError(ValueError):
    """A message the DNS code will not read: `rcode` is what it answers (FORMERR...)."""

    def __init__(self, message: str, rcode: int = FORMERR):
        super().__init__(message)
        self.rcode = rcode


# -- names and messages --------------------------------------------------------------------


def encode_name(name: str) -> bytes:
    """Return a DNS name in wire form (no compression); "" or "." is the root."""
    out = bytearray()
    for label in name.rstrip(".").split(".") if name.strip(".") else []:
        raw = label.encode("ascii")
        if not 0 < len(raw) < 64:
            raise DnsError(f"a label of {len(raw)} bytes")
        out += bytes([len(raw)]) + raw
    if len(out) + 1 > 255:
        raise DnsError("a name over 255 bytes")
    return bytes(out) + b"\0"


def read_name(data: bytes, at: int) -> tuple:
    """Return (the name at `at`, as text in its own case, the offset after it), following
    compression pointers (backwards only, so no loop). Raises DnsError when malformed."""
    labels, end, seen, size = [], None, 0, 0
    while True:
        if at >= len(data):
            raise DnsError("a truncated name")
        length = data[at]
        if length & 0xC0 == 0xC0:
            if at + 1 >= len(data):
                raise DnsError("a truncated name")
            target = ((length & 0x3F) << 8) | data[at + 1]
            if end is None:
                end = at + 2
            if target >= at or seen > 127:
                raise DnsError("a compression pointer that does not point back")
            at, seen = target, seen + 1
            continue
        if length & 0xC0:
            raise DnsError("an unknown label type")
        at += 1
        if length == 0:
            return ".".join(labels), end if end is not None else at
        if at + length > len(data):
            raise DnsError("a truncated label")
        size += length + 1
        if size > 254:
            raise DnsError("a name over 255 bytes")
        labels.append(data[at : at + length].decode("latin-1"))
        at += length


@dataclasses.dataclass
class DnsQuery:
    id: int
    flags: int
    name: str  # as asked (its case kept: DNS 0x20), no final dot
    qtype: int
    qclass: int
    question: bytes  # the question's bytes, echoed in the answer
    edns: int | None  # the asker's UDP size when it sent an OPT record, else None
    edns_version: int = 0

    @property
    def opcode(self) -> int:
        return (self.flags >> 11) & 0xF


def parse_query(data: bytes) -> DnsQuery:
    """Return the query in a DNS message. Raises DnsError (FORMERR, NOTIMP) for a message
    that is no single question, or that says it is an answer (rcode -1: dropped)."""
    if len(data) < 12:
        raise DnsError("a message shorter than its header", -1)
    ident, flags, qd, an, ns, ar = struct.unpack_from("!HHHHHH", data)
    if flags & 0x8000:
        raise DnsError("an answer, not a query", -1)
    if len(data) > DNS_MAX_QUERY:
        raise DnsError(f"a query over {DNS_MAX_QUERY} bytes")
    opcode = (flags >> 11) & 0xF
    if opcode != OPCODE_QUERY:
        raise DnsError("only queries are answered here", NOTIMP)
    if qd != 1 or an or ns:
        raise DnsError("a query asks exactly one question")
    name, at = read_name(data, 12)
    if at + 4 > len(data):
        raise DnsError("a truncated question")
    qtype, qclass = struct.unpack_from("!HH", data, at)
    question = data[12 : at + 4]
    at += 4
    edns, version = None, 0
    for _ in range(ar):
        _rname, at = read_name(data, at)
        if at + 10 > len(data):
            raise DnsError("a truncated record")
        rtype, rclass, ttl, size = struct.unpack_from("!HHIH", data, at)
        at += 10 + size
        if at > len(data):
            raise DnsError("a truncated record")
        if rtype == DNS_OPT:
            if edns is not None:
                raise DnsError("two OPT records")
            edns, version = max(DNS_UDP_PLAIN, rclass), (ttl >> 16) & 0xFF
    return DnsQuery(ident, flags, name, qtype, qclass, question, edns, version)


def _record(owner: bytes, rtype: int, ttl: int, rdata: bytes, rclass: int = DNS_IN) -> bytes:
    return owner + struct.pack("!HHIH", rtype, rclass, ttl, len(rdata)) + rdata


def txt_rdata(value: str) -> bytes:
    raw = value.encode("utf-8")
    return bytes([len(raw)]) + raw


# -- the zone ------------------------------------------------------------------------------


class ChallengeRecords:
    """The `TXT _acme-challenge.<id>.D` values each server set, each gone after
    CHALLENGE_TTL (one event loop, no lock)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.values: dict = {}  # server id -> (values, monotonic time they go)
        self.changed = int(time.time())

    def set(self, server_id: str, values: list) -> None:
        self._expire()
        if server_id not in self.values and len(self.values) >= self.limit:
            raise DnsError("the relay holds its maximum of challenge records", REFUSED)
        self.values[server_id] = (tuple(values), time.monotonic() + CHALLENGE_TTL)
        self.changed = max(self.changed + 1, int(time.time()))

    def clear(self, server_id: str) -> None:
        if self.values.pop(server_id, None) is not None:
            self.changed = max(self.changed + 1, int(time.time()))

    def get(self, server_id: str) -> tuple:
        entry = self.values.get(server_id)
        if entry is None or entry[1] < time.monotonic():
            self.values.pop(server_id, None)
            return ()
        return entry[0]

    def _expire(self) -> None:
        now = time.monotonic()
        for sid in [s for s, (_v, until) in self.values.items() if until < now]:
            del self.values[sid]


class DnsZone:
    """The answers for one domain (see this module's docstring)."""

    def __init__(self, domain: str, addresses: tuple, challenges: ChallengeRecords):
        self.domain, self.challenges = domain.lower(), challenges
        self.v4 = [ipaddress.ip_address(a).packed for a in addresses if ":" not in a]
        self.v6 = [ipaddress.ip_address(a.strip("[]")).packed for a in addresses if ":" in a]

    def soa_rdata(self) -> bytes:
        # mname ns.D, rname hostmaster.D, serial, refresh, retry, expire, minimum (the
        # negative TTL: short, so a challenge set after a miss is seen within a minute)
        serial = self.challenges.changed & 0xFFFFFFFF
        return (
            encode_name(f"ns.{self.domain}")
            + encode_name(f"hostmaster.{self.domain}")
            + struct.pack("!IIIII", serial, 3600, 600, 604800, TTL_NEGATIVE)
        )

    def answer(self, query: DnsQuery, limit: int | None) -> bytes:
        """Return the answer to a query; `limit`: the largest size it may have (UDP), None
        over TCP."""
        rcode, answers, authority, additional = self._lookup(query)
        flags = 0x8000 | (query.flags & 0x0100)  # QR, RD copied; AA when authoritative
        if rcode in (NOERROR, NXDOMAIN):
            flags |= 0x0400
        opt = b""
        if query.edns is not None:
            ext = 0
            if query.edns_version != 0:  # BADVERS: extended rcode 16 = (1 << 4) | 0
                rcode, answers, authority, additional, ext = NOERROR, [], [], [], 1
            opt = b"\0" + struct.pack("!HHIH", DNS_OPT, DNS_UDP_EDNS, ext << 24, 0)
        sections = (answers, authority, [*additional, opt] if opt else additional)
        head = struct.pack("!HHHHHH", query.id, flags | rcode, 1, *(len(s) for s in sections))
        message = head + query.question + b"".join(b"".join(s) for s in sections)
        if limit is not None and len(message) > limit:  # cut to the question: TC, come by TCP
            counts = struct.pack("!HHHH", 1, 0, 0, 1 if opt else 0)
            message = (
                struct.pack("!HH", query.id, flags | 0x0200 | rcode) + counts + query.question + opt
            )
        return message

    def _lookup(self, query: DnsQuery) -> tuple:
        """Return (rcode, answer, authority and additional records) for a query."""
        name = query.name.lower().rstrip(".")
        domain = self.domain
        if name != domain and not name.endswith("." + domain):
            return REFUSED, [], [], []
        if query.qclass not in (DNS_IN, DNS_CLASS_ANY):
            return REFUSED, [], [], []
        if query.qtype in (DNS_AXFR, DNS_IXFR, DNS_OPT, DNS_TSIG):
            return REFUSED, [], [], []
        labels = name[: -len(domain)].rstrip(".").split(".") if name != domain else []
        own = b"\xc0\x0c"  # the question's name
        soa = _record(encode_name(domain), DNS_SOA, TTL_NEGATIVE, self.soa_rdata())
        records: dict = {}  # type -> (ttl, [rdata])
        if len(labels) <= 1:
            records[DNS_A] = (TTL_ADDRESS, self.v4)
            records[DNS_AAAA] = (TTL_ADDRESS, self.v6)
        if not labels:
            records[DNS_SOA] = (TTL_ZONE, [self.soa_rdata()])
            records[DNS_NS] = (TTL_ZONE, [encode_name(f"ns.{domain}")])
        if len(labels) == 2 and labels[0] == "_acme-challenge":
            values = self.challenges.get(labels[1])
            if not values:
                return NXDOMAIN, [], [soa], []
            records[DNS_TXT] = (TTL_CHALLENGE, [txt_rdata(v) for v in values])
        elif len(labels) > 1:
            return NXDOMAIN, [], [soa], []
        qtype = query.qtype
        if qtype == DNS_ANY:  # RFC 8482 4.2: one synthesised HINFO, not everything
            if DNS_TXT in records:
                qtype = DNS_TXT
            else:
                hinfo = b"\x07RFC8482\x00"
                return NOERROR, [_record(own, DNS_HINFO, TTL_ADDRESS, hinfo)], [], []
        ttl, rdatas = records.get(qtype, (0, []))
        if not rdatas:
            return NOERROR, [], [soa], []
        answers = [_record(own, qtype, ttl, r) for r in rdatas]
        additional = []
        if qtype == DNS_NS:
            glue = encode_name(f"ns.{domain}")
            additional = [_record(glue, DNS_A, TTL_ADDRESS, a) for a in self.v4]
            additional += [_record(glue, DNS_AAAA, TTL_ADDRESS, a) for a in self.v6]
        return NOERROR, answers, [], additional


def dns_reply(zone: DnsZone, data: bytes, udp: bool) -> bytes | None:
    """Return the answer to a message (None: nothing to answer, e.g. a stray answer);
    over UDP cut to 512 bytes, or to the EDNS size asked (at most DNS_UDP_EDNS)."""
    try:
        query = parse_query(data)
    except DnsError as e:
        if e.rcode < 0 or len(data) < 12:
            return None
        ident, flags = struct.unpack_from("!HH", data)
        return struct.pack("!HHHHHH", ident, 0x8000 | (flags & 0x7900) | e.rcode, 0, 0, 0, 0)
    limit = (min(query.edns, DNS_UDP_EDNS) if query.edns else DNS_UDP_PLAIN) if udp else None
    return zone.answer(query, limit)


# -- the server ------------------------------------------------------------------------------


class _DnsUdp(asyncio.DatagramProtocol):
    def __init__(self, zone: DnsZone):
        self.zone = zone
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        try:
            answer = dns_reply(self.zone, data, True)
        except Exception:
            log.exception("dns: a query from %s failed", log_safe(str(addr[0]), 64))
            return
        if answer is not None and self.transport is not None:
            self.transport.sendto(answer, addr)


class DnsServer:
    """The relay's authoritative DNS for its domain on UDP and TCP (one port)."""

    def __init__(self, zone: DnsZone, host: str, port: int):
        self.zone, self.host, self.port = zone, host, port
        self.udp = None
        self.tcp: asyncio.AbstractServer | None = None
        self.connections: dict = {}  # TCP writer -> None, oldest first

    async def start(self) -> int:
        """Listen on UDP and TCP; return the port (port 0: a free one, the same for both)."""
        loop = asyncio.get_running_loop()
        last: OSError | None = None
        for _ in range(20 if self.port == 0 else 1):
            transport, _proto = await loop.create_datagram_endpoint(
                lambda: _DnsUdp(self.zone), local_addr=(self.host, self.port)
            )
            port = transport.get_extra_info("sockname")[1]
            try:
                self.tcp = await asyncio.start_server(self._serve_tcp, self.host, port)
            except OSError as e:  # that port is taken for TCP: another one
                transport.close()
                last = e
                continue
            self.udp = transport
            self.port = port
            return port
        raise last or OSError("no port for DNS")

    def close(self) -> None:
        if self.udp is not None:
            self.udp.close()
        if self.tcp is not None:
            self.tcp.close()
        for writer in list(self.connections):
            writer.close()

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.connections[writer] = None
        while len(self.connections) > DNS_TCP_MAX:
            oldest = next(iter(self.connections))
            self.connections.pop(oldest, None)
            oldest.close()
        try:
            while True:
                # the whole message within DNS_TCP_SECONDS: a slow sender holds nothing long
                try:
                    size = struct.unpack("!H", await asyncio.wait_for(reader.readexactly(2), 30))
                    if size[0] > DNS_MAX_QUERY:  # no query is that long: not read at all
                        return
                    data = await asyncio.wait_for(reader.readexactly(size[0]), DNS_TCP_SECONDS)
                except (asyncio.TimeoutError, asyncio.IncompleteReadError):
                    return
                answer = dns_reply(self.zone, data, False)
                if answer is None:
                    return
                writer.write(struct.pack("!H", len(answer)) + answer)
                await asyncio.wait_for(writer.drain(), DNS_TCP_SECONDS)
        except (OSError, asyncio.TimeoutError):
            pass
        except Exception:
            log.exception("dns: a TCP query failed")
        finally:
            self.connections.pop(writer, None)
            writer.close()


# -- RFC 2136 updates, signed with TSIG (RFC 8945) ------------------------------------------


def tsig_setting(raw: str) -> tuple:
    """Parse SERVICE_RELAY_DNS_TSIG: `<key name>:<base64 HMAC-SHA256 secret>` (as `keymgr`
    and `tsig-keygen` print them) into (name, secret bytes); ("", b"") when empty."""
    raw = raw.strip()
    if not raw:
        return "", b""
    name, sep, secret = raw.partition(":")
    if not sep or not name or not secret:
        raise ValueError("give it as <key name>:<base64 secret>")
    try:
        key = base64.b64decode(secret.strip(), validate=True)
        encode_name(name)
    except (ValueError, DnsError):
        raise ValueError("the key name or its base64 secret is malformed") from None
    if len(key) < 16:
        raise ValueError("the secret is shorter than 16 bytes")
    return name.lower().rstrip("."), key


HMAC_SHA256 = "hmac-sha256"
TSIG_FUDGE = 300


def _tsig_variables(key_name: str, signed: int, error: int = 0, other: bytes = b"") -> bytes:
    return (
        encode_name(key_name)
        + struct.pack("!HI", DNS_CLASS_ANY, 0)
        + encode_name(HMAC_SHA256)
        + signed.to_bytes(6, "big")
        + struct.pack("!HHH", TSIG_FUDGE, error, len(other))
        + other
    )


def tsig_sign(message: bytes, key_name: str, secret: bytes, signed: int | None = None) -> tuple:
    """Return (the message with a TSIG record added, its MAC)."""
    signed = int(time.time()) if signed is None else signed
    mac = hmac.new(secret, message + _tsig_variables(key_name, signed), hashlib.sha256).digest()
    ident = message[:2]
    rdata = (
        encode_name(HMAC_SHA256)
        + signed.to_bytes(6, "big")
        + struct.pack("!HH", TSIG_FUDGE, len(mac))
        + mac
        + ident
        + struct.pack("!HH", 0, 0)
    )
    count = struct.unpack_from("!H", message, 10)[0] + 1
    head = message[:10] + struct.pack("!H", count)
    record = _record(encode_name(key_name), DNS_TSIG, 0, rdata, DNS_CLASS_ANY)
    return head + message[12:] + record, mac


def tsig_verify(answer: bytes, key_name: str, secret: bytes, request_mac: bytes) -> int:
    """Return the rcode of a TSIG-signed answer to a request whose MAC was `request_mac`.

    Raises DnsError when the answer is not signed by that key (or its time is off).
    """
    if len(answer) < 12:
        raise DnsError("a truncated answer")
    _id, flags, qd, an, ns, ar = struct.unpack_from("!HHHHHH", answer)
    at = 12
    for _ in range(qd):
        _name, at = read_name(answer, at)
        at += 4
    start = None
    for i in range(an + ns + ar):
        record_at = at
        name, at = read_name(answer, at)
        rtype, _cls, _ttl, size = struct.unpack_from("!HHIH", answer, at)
        at += 10
        if rtype == DNS_TSIG and i == an + ns + ar - 1:
            start, rdata, owner = record_at, answer[at : at + size], name
        at += size
    if start is None:
        raise DnsError("the answer is not signed (no TSIG record)", flags & 0xF or NOTAUTH)
    if owner.lower().rstrip(".") != key_name:
        raise DnsError("the answer is signed by another key")
    algorithm, at = read_name(rdata, 0)
    signed = int.from_bytes(rdata[at : at + 6], "big")
    fudge, mac_size = struct.unpack_from("!HH", rdata, at + 6)
    mac = rdata[at + 10 : at + 10 + mac_size]
    original, error, other_size = struct.unpack_from("!HHH", rdata, at + 10 + mac_size)
    other = rdata[at + 16 + mac_size : at + 16 + mac_size + other_size]
    if error:
        raise DnsError(f"the DNS server refused the signature (TSIG error {error})", NOTAUTH)
    if algorithm.lower() != HMAC_SHA256:
        raise DnsError("the answer is signed with another algorithm")
    body = struct.pack("!H", original) + answer[2:10] + struct.pack("!H", ar - 1)
    body += answer[12:start]
    expect = hmac.new(
        secret,
        struct.pack("!H", len(request_mac))
        + request_mac
        + body
        + _tsig_variables(key_name, signed, error, other),
        hashlib.sha256,
    ).digest()
    if not hmac.compare_digest(mac, expect):
        raise DnsError("the answer's TSIG signature does not match")
    if abs(time.time() - signed) > fudge:
        raise DnsError("the answer's TSIG time is off by more than its fudge")
    return flags & 0xF


RCODE_NAMES = {
    NOERROR: "NOERROR",
    FORMERR: "FORMERR",
    SERVFAIL: "SERVFAIL",
    NXDOMAIN: "NXDOMAIN",
    NOTIMP: "NOTIMP",
    REFUSED: "REFUSED",
    NOTAUTH: "NOTAUTH",
}


class DnsUpdater:
    """Sets and clears `TXT _acme-challenge.<id>.D` in another DNS server by RFC 2136
    updates over TCP, signed with TSIG (HMAC-SHA256), and clears each after
    CHALLENGE_TTL."""

    TIMEOUT = 10.0

    def __init__(self, target: str, key_name: str, secret: bytes, zone: str):
        host, _, port = target.rpartition(":")
        self.host, self.port = host.strip("[]"), int(port)
        self.key_name, self.secret, self.zone = key_name, secret, zone.lower()
        self.timers: dict = {}  # server id -> the call that clears its record

    def message(self, server_id: str, values: list) -> bytes:
        """Return the unsigned UPDATE: the zone, then delete the name's TXT set and add
        each value (none: a delete alone)."""
        owner = encode_name(f"_acme-challenge.{server_id}.{self.zone}")
        updates = [_record(owner, DNS_TXT, 0, b"", DNS_CLASS_ANY)]  # delete the RRset
        updates += [_record(owner, DNS_TXT, TTL_CHALLENGE, txt_rdata(v)) for v in values]
        head = struct.pack(
            "!HHHHHH", secrets.randbelow(65536), OPCODE_UPDATE << 11, 1, 0, len(updates), 0
        )
        zone = encode_name(self.zone) + struct.pack("!HH", DNS_SOA, DNS_IN)
        return head + zone + b"".join(updates)

    async def send(self, server_id: str, values: list) -> None:
        """Send one update and wait for the server's signed NOERROR.

        Raises DnsError (refused, unsigned, wrong signature) or OSError (unreachable,
        timed out)."""
        request, mac = tsig_sign(self.message(server_id, values), self.key_name, self.secret)
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port), self.TIMEOUT
            )
        except asyncio.TimeoutError:
            raise OSError(f"{self.host}:{self.port} did not answer") from None
        try:
            writer.write(struct.pack("!H", len(request)) + request)
            size = struct.unpack("!H", await asyncio.wait_for(reader.readexactly(2), self.TIMEOUT))
            answer = await asyncio.wait_for(reader.readexactly(size[0]), self.TIMEOUT)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError):
            raise OSError(f"{self.host}:{self.port} did not answer the update") from None
        finally:
            writer.close()
        if answer[:2] != request[:2]:
            raise DnsError("the answer is to another message")
        rcode = tsig_verify(answer, self.key_name, self.secret, mac)
        if rcode != NOERROR:
            raise DnsError(f"the DNS server answered {RCODE_NAMES.get(rcode, rcode)}", rcode)

    async def set(self, server_id: str, values: list) -> None:
        await self.send(server_id, values)
        self._clear_later(server_id)

    async def clear(self, server_id: str) -> None:
        timer = self.timers.pop(server_id, None)
        if timer is not None:
            timer.cancel()
        await self.send(server_id, [])

    def _clear_later(self, server_id: str) -> None:
        timer = self.timers.pop(server_id, None)
        if timer is not None:
            timer.cancel()
        loop = asyncio.get_running_loop()

        def clear() -> None:
            self.timers.pop(server_id, None)
            task = loop.create_task(self.send(server_id, []))
            task.add_done_callback(_log_failed_clear)

        self.timers[server_id] = loop.call_later(CHALLENGE_TTL, clear)


def _log_failed_clear(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("dns: clearing an expired challenge record failed: %s", task.exception())
