"""The relay's DNS for its domain, the challenge records only their server may set, and RFC
2136 updates to Knot (src/notesvc/passthrough/dns.py)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import shutil
import socket
import struct
import subprocess
import time

import pytest

from conftest import DOMAIN, notesvc, patch_global, wait_for
from passthrough_kit import (
    Knot,
    dns_answer,
    dns_query,
    free_port,
    passthrough_relay,
    relay_ports,
    txt_values,
)
from standins import FakeRelayServer

REAL = [pytest.mark.real_server, pytest.mark.slow]
SID = "abcdefghijklmnopqrst"
A, NS, SOA, HINFO, TXT, AAAA, CAA, ANY, AXFR = 1, 2, 6, 13, 16, 28, 257, 255, 252


def query(name: str, qtype: int, qclass: int = 1, edns: int = 0, version: int = 0, flags=0x100):
    message = struct.pack("!HHHHHH", 0x4242, flags, 1, 0, 0, 1 if edns else 0)
    message += notesvc.encode_name(name) + struct.pack("!HH", qtype, qclass)
    if edns:
        message += b"\0" + struct.pack("!HHIH", 41, edns, version << 16, 0)
    return message


@pytest.fixture
def zone():
    records = notesvc.ChallengeRecords(limit=3)
    return notesvc.DnsZone(DOMAIN, ("127.0.0.1", "::1"), records)


def ask(zone, name: str, qtype: int, udp: bool = True, **how) -> dict:
    return dns_answer(notesvc.dns_reply(zone, query(name, qtype, **how), udp))


class TestZone:
    @pytest.mark.parametrize(
        ("name", "qtype", "rcode", "answers", "authority"),
        [
            (DOMAIN, SOA, 0, [SOA], []),
            (DOMAIN, NS, 0, [NS], []),
            (DOMAIN, A, 0, [A], []),
            (DOMAIN, AAAA, 0, [AAAA], []),
            (f"ns.{DOMAIN}", A, 0, [A], []),
            (f"{SID}.{DOMAIN}", A, 0, [A], []),  # the wildcard: every server's own name
            (f"{SID}.{DOMAIN}", CAA, 0, [], [SOA]),  # a name there, not that type
            (DOMAIN, 65, 0, [], [SOA]),  # HTTPS
            (DOMAIN, 15, 0, [], [SOA]),  # MX
            (f"a.b.{DOMAIN}", A, 3, [], [SOA]),  # no such name
            (f"_acme-challenge.{SID}.{DOMAIN}", TXT, 3, [], [SOA]),  # none set
            ("example.org", A, 5, [], []),  # not ours: refused, never resolved
            ("test", A, 5, [], []),
            (f"x{DOMAIN}", A, 5, [], []),
            (DOMAIN, AXFR, 5, [], []),  # no zone transfers
        ],
    )
    def test_what_it_answers(self, zone, name, qtype, rcode, answers, authority):
        got = ask(zone, name, qtype)
        assert got["rcode"] == rcode
        assert [t for t, _ in got["answers"]] == answers
        assert got["authority"] == authority
        assert got["aa"] is (rcode in (0, 3))

    def test_addresses_are_the_relays_own(self, zone):
        rdata = [r for _t, r in ask(zone, f"x.{DOMAIN}", A)["answers"]]
        assert rdata == [bytes([127, 0, 0, 1])]
        rdata = [r for _t, r in ask(zone, DOMAIN, AAAA)["answers"]]
        assert rdata == [bytes(15) + b"\1"]
        assert ask(zone, DOMAIN, NS)["additional"] == [A, AAAA]  # ns.D's addresses

    def test_any_gets_rfc_8482s_minimal_answer(self, zone):
        got = ask(zone, DOMAIN, ANY)
        assert [(t, r) for t, r in got["answers"]] == [(HINFO, b"\x07RFC8482\x00")]
        zone.challenges.set(SID, ["v1"])
        got = ask(zone, f"_acme-challenge.{SID}.{DOMAIN}", ANY)
        assert [t for t, _r in got["answers"]] == [TXT]

    def test_the_question_keeps_the_askers_case(self, zone):
        raw = notesvc.dns_reply(zone, query("ReLaY.TeSt", A), True)
        assert notesvc.read_name(raw, 12)[0] == "ReLaY.TeSt"
        assert dns_answer(raw)["answers"]

    def test_a_challenge_is_set_cleared_and_gone_after_ten_minutes(self, zone, monkeypatch):
        name = f"_acme-challenge.{SID}.{DOMAIN}"
        zone.challenges.set(SID, ["first", "second"])
        raw = notesvc.dns_reply(zone, query(name, TXT), True)
        assert txt_values(raw) == ["first", "second"]
        assert ask(zone, f"_acme-challenge.{'b' * 20}.{DOMAIN}", TXT)["rcode"] == 3  # per id
        zone.challenges.clear(SID)
        assert ask(zone, name, TXT)["rcode"] == 3
        patch_global(monkeypatch, "CHALLENGE_TTL", 0.05)
        zone.challenges.set(SID, ["short-lived"])
        assert ask(zone, name, TXT)["answers"]
        wait_for(lambda: ask(zone, name, TXT)["rcode"] == 3)

    def test_the_soa_serial_moves_with_the_records(self, zone):
        serial = lambda: struct.unpack("!I", ask(zone, DOMAIN, SOA)["answers"][0][1][-20:-16])[0]  # noqa: E731
        before = serial()
        zone.challenges.set(SID, ["v"])
        assert serial() > before

    def test_records_held_are_capped(self, zone):
        for i in range(3):
            zone.challenges.set(f"{i}" * 20, ["v"])
        with pytest.raises(notesvc.DnsError):
            zone.challenges.set("9" * 20, ["v"])
        zone.challenges.set("0" * 20, ["again"])  # one held may be set again

    def test_an_answer_over_512_bytes_is_cut_with_tc_unless_edns_or_tcp(self, zone):
        zone.challenges.set(SID, ["x" * 255] * 4)
        name = f"_acme-challenge.{SID}.{DOMAIN}"
        cut = notesvc.dns_reply(zone, query(name, TXT), True)
        assert len(cut) <= 512
        assert dns_answer(cut)["tc"]
        assert dns_answer(cut)["answers"] == []
        whole = notesvc.dns_reply(zone, query(name, TXT, edns=4096), True)
        assert not dns_answer(whole)["tc"]
        assert len(txt_values(whole)) == 4
        assert len(whole) <= 1232  # the most it sends over UDP
        assert txt_values(notesvc.dns_reply(zone, query(name, TXT), False)) == ["x" * 255] * 4

    def test_an_edns_version_it_does_not_speak_is_badvers(self, zone):
        raw = notesvc.dns_reply(zone, query(DOMAIN, A, edns=1232, version=1), True)
        opt = raw[-11:]
        assert raw[3] & 0xF == 0
        assert opt[5] == 1  # extended rcode 1: BADVERS (16)

    @pytest.mark.parametrize(
        ("raw", "rcode"),
        [
            (query(DOMAIN, A)[:-2], 1),  # a truncated question
            (struct.pack("!HHHHHH", 1, 0x100, 2, 0, 0, 0) + query(DOMAIN, A)[12:] * 2, 1),
            (struct.pack("!HHHHHH", 1, 0x100, 0, 0, 0, 0), 1),  # no question
            (query(DOMAIN, A, flags=0x2800), 4),  # an UPDATE: not here
            (query(DOMAIN, A) + b"\0" * 5000, 1),  # oversized
            (struct.pack("!HHHHHH", 1, 0x100, 1, 0, 0, 0) + b"\xc0\x0c\x00\x01\x00\x01", 1),
            (struct.pack("!HHHHHH", 1, 0x100, 1, 0, 0, 0) + b"\x40abc\x00\x00\x01\x00\x01", 1),
        ],
    )
    def test_what_is_malformed_gets_formerr_or_notimp(self, zone, raw, rcode):
        answer = notesvc.dns_reply(zone, raw, True)
        assert answer[:2] == raw[:2]
        assert answer[3] & 0xF == rcode
        assert struct.unpack("!HHHH", answer[4:12]) == (0, 0, 0, 0)

    def test_what_is_no_query_is_not_answered(self, zone):
        assert notesvc.dns_reply(zone, b"\x01\x02", True) is None  # not even a header
        assert notesvc.dns_reply(zone, query(DOMAIN, A, flags=0x8000), True) is None  # an answer


class TestTsig:
    KEY = base64.b64decode(base64.b64encode(b"k" * 32))

    def test_an_answer_not_signed_for_this_request_does_not_verify(self):
        """(Knot's real answers verify: TestRfc2136.) An answer signed on its own, not over
        the request's MAC, or signed by another key, or unsigned, is refused."""
        message = notesvc.DnsUpdater("127.0.0.1:53", "k1", self.KEY, DOMAIN).message(SID, ["v"])
        _signed, mac = notesvc.tsig_sign(message, "k1", self.KEY)
        answer = bytearray(message)
        answer[2] |= 0x80  # QR: an answer
        alone, _ = notesvc.tsig_sign(bytes(answer), "k1", self.KEY)
        with pytest.raises(notesvc.DnsError, match="does not match"):
            notesvc.tsig_verify(alone, "k1", self.KEY, mac)
        other, _ = notesvc.tsig_sign(bytes(answer), "k2", self.KEY)
        with pytest.raises(notesvc.DnsError, match="another key"):
            notesvc.tsig_verify(other, "k1", self.KEY, mac)
        with pytest.raises(notesvc.DnsError, match="not signed"):
            notesvc.tsig_verify(bytes(answer), "k1", self.KEY, mac)

    def test_the_setting_reads_name_and_secret(self):
        secret = base64.b64encode(b"s" * 32).decode()
        assert notesvc.tsig_setting(f"relay-key:{secret}") == ("relay-key", b"s" * 32)
        assert notesvc.tsig_setting("") == ("", b"")
        for bad in ("no-colon", f":{secret}", "k:not base64!", "k:c2hvcnQ="):
            with pytest.raises(ValueError, match=r"malformed|give it|shorter"):
                notesvc.tsig_setting(bad)
        with pytest.raises(notesvc.ConfigError, match="SERVICE_RELAY_DNS_TSIG"):
            notesvc.load_config({"SERVICE_RELAY_DNS_TSIG": "k:c2hvcnQ="})
        with pytest.raises(notesvc.ConfigError, match="SERVICE_RELAY_DNS_TSIG"):
            notesvc.load_config({"SERVICE_RELAY_DNS_UPDATE": "127.0.0.1:53"})


# -- the relay's own DNS, and the records through its API ----------------------------------


def put_challenge(fake: FakeRelayServer, server_id: str, values, token=None, method="PUT"):
    body = None if method == "DELETE" else {"values": values}
    return fake.call(method, f"/relay/v1/acme/{server_id}", body, token=token)


@pytest.fixture(scope="class")
def relay(tmp_path_factory, test_ca):
    relay = passthrough_relay(tmp_path_factory.mktemp("dns") / "relay", test_ca)
    relay.dns = relay_ports(relay)["dns"]
    yield relay
    relay.stop()


@pytest.fixture(scope="class")
def knot(tmp_path_factory):
    knot = Knot(tmp_path_factory.mktemp("knot"))
    yield knot
    knot.stop()


class TestRelayDns:
    pytestmark = REAL

    def test_it_answers_over_udp_and_tcp(self, relay):
        for tcp in (False, True):
            got = dns_answer(dns_query(relay.dns, f"{SID}.{DOMAIN}", A, tcp=tcp))
            assert got["answers"] == [(A, bytes([127, 0, 0, 1]))]
            assert got["aa"]
            assert dns_answer(dns_query(relay.dns, "example.org", A, tcp=tcp))["rcode"] == 5

    def test_only_a_servers_own_token_sets_its_challenge_record(self, relay):
        owner, other = FakeRelayServer(relay), FakeRelayServer(relay)
        assert owner.register() == 200
        assert other.register() == 200
        name = f"_acme-challenge.{owner.server_id}.{DOMAIN}"
        status, _h, answer = put_challenge(owner, owner.server_id, ["token-value-1"])
        assert status == 200
        assert answer["data"] == {"name": name, "values": ["token-value-1"]}
        assert txt_values(dns_query(relay.dns, name, TXT)) == ["token-value-1"]
        # another server, with its own valid token, cannot set or clear it
        assert put_challenge(other, owner.server_id, ["evil"])[0] == 403
        assert put_challenge(other, owner.server_id, [], method="DELETE")[0] == 403
        assert txt_values(dns_query(relay.dns, name, TXT, tcp=True)) == ["token-value-1"]
        # nor can anyone without a registration, or with no token
        stranger = FakeRelayServer(relay)
        assert put_challenge(stranger, stranger.server_id, ["v"])[0] == 401
        assert put_challenge(owner, owner.server_id, ["v"], token="")[0] == 403
        assert put_challenge(owner, owner.server_id, [], method="DELETE")[0] == 200
        assert dns_answer(dns_query(relay.dns, name, TXT))["rcode"] == 3

    @pytest.mark.parametrize(
        "values",
        [[], ["a"] * 5, ["x" * 256], "one", [1], [""], ["two words"], ["tab\there"], None],
    )
    def test_bad_values_are_400(self, relay, values):
        owner = FakeRelayServer(relay)
        assert owner.register() == 200
        status, _h, answer = put_challenge(owner, owner.server_id, values)
        assert status == 400
        assert answer["error"]["code"] == "VALIDATION_ERROR"

    def test_a_body_that_is_not_json_is_refused(self, relay):
        import http.client

        owner = FakeRelayServer(relay)
        assert owner.register() == 200
        for ctype, body, status in (
            ("application/json", b"{not json", 400),
            ("text/plain", b'{"values": ["v"]}', 415),
            ("application/json", b'["v"]', 400),
        ):
            conn = http.client.HTTPConnection("127.0.0.1", relay.port, timeout=10)
            try:
                conn.request(
                    "PUT",
                    f"/relay/v1/acme/{owner.server_id}",
                    body,
                    {"Content-Type": ctype, "X-Relay-Token": owner.token},
                )
                assert conn.getresponse().status == status
            finally:
                conn.close()

    def test_a_slow_tcp_sender_is_closed_and_udp_still_answered(self, relay):
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", relay.dns), timeout=20) as s:
            s.sendall(struct.pack("!H", 40))
            closed = False
            for _ in range(30):
                try:
                    s.sendall(b"x")
                    assert dns_answer(dns_query(relay.dns, DOMAIN, A))["answers"]
                    ready = s.recv(1, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    time.sleep(0.5)
                    continue
                except OSError:
                    closed = True
                    break
                closed = ready == b""
                if closed:
                    break
        assert closed
        assert 9 < time.monotonic() - started < 16

    def test_an_oversized_tcp_query_is_not_read(self, relay):
        with socket.create_connection(("127.0.0.1", relay.dns), timeout=10) as s:
            s.sendall(struct.pack("!H", 60000) + b"x" * 1000)
            with contextlib.suppress(ConnectionResetError):
                assert s.recv(10) == b""

    def test_held_tcp_connections_are_capped(self, relay):
        held = []
        try:
            for _ in range(300):
                s = socket.create_connection(("127.0.0.1", relay.dns), timeout=10)
                held.append(s)
            closed = 0
            for s in held[:44]:  # the oldest went to make room
                with contextlib.suppress(ConnectionResetError):
                    closed += s.recv(1) == b""
            assert closed >= 40
            assert dns_answer(dns_query(relay.dns, DOMAIN, A, tcp=True))["answers"]
        finally:
            for s in held:
                s.close()

    @pytest.mark.skipif(not shutil.which("kdig"), reason="kdig is not installed (knot-dnsutils)")
    def test_kdig_reads_its_answers(self, relay):
        owner = FakeRelayServer(relay)
        assert owner.register() == 200
        assert put_challenge(owner, owner.server_id, ["judge-value"])[0] == 200
        name = f"_acme-challenge.{owner.server_id}.{DOMAIN}"
        for transport in ("+notcp", "+tcp"):
            done = subprocess.run(
                ["kdig", "@127.0.0.1", "-p", str(relay.dns), name, "TXT", transport],
                capture_output=True,
                text=True,
                timeout=20,
            )
            assert "status: NOERROR" in done.stdout
            assert "Flags: qr aa" in done.stdout
            assert '"judge-value"' in done.stdout
        done = subprocess.run(
            ["kdig", "@127.0.0.1", "-p", str(relay.dns), f"nothing.here.{DOMAIN}", "A"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        assert "status: NXDOMAIN" in done.stdout
        assert "SOA" in done.stdout


class TestRfc2136:
    """Several relays keep no DNS: the challenge records go to Knot by signed updates."""

    pytestmark = REAL

    def test_the_updater_sets_and_clears_a_record_in_knot(self, knot):
        secret = base64.b64decode(knot.secret)
        updater = notesvc.DnsUpdater(f"127.0.0.1:{knot.port}", "relay-key", secret, DOMAIN)
        asyncio.run(updater.send(SID, ["one", "two"]))
        assert sorted(knot.txt(SID)) == ["one", "two"]
        asyncio.run(updater.send(SID, ["three"]))  # replaces, never adds up
        assert knot.txt(SID) == ["three"]
        asyncio.run(updater.send(SID, []))
        assert knot.txt(SID) == []

    def test_a_wrong_key_is_refused_and_knot_keeps_its_records(self, knot):
        updater = notesvc.DnsUpdater(f"127.0.0.1:{knot.port}", "relay-key", b"w" * 32, DOMAIN)
        with pytest.raises(notesvc.DnsError, match="refused the signature"):
            asyncio.run(updater.send(SID, ["evil"]))
        assert knot.txt(SID) == []
        nobody = notesvc.DnsUpdater(f"127.0.0.1:{free_port()}", "relay-key", b"w" * 32, DOMAIN)
        with pytest.raises(OSError, match=r"Connect call failed"):  # (the relay says 502)
            asyncio.run(nobody.send(SID, ["v"]))

    def test_a_relay_with_updates_sets_only_its_servers_records_in_knot(
        self, knot, tmp_path, test_ca
    ):
        env = {"SERVICE_RELAY_DNS_UPDATE": f"127.0.0.1:{knot.port}"}
        relay = passthrough_relay(
            tmp_path / "relay", test_ca, SERVICE_RELAY_DNS_TSIG=knot.tsig, **env
        )
        wrong = passthrough_relay(
            tmp_path / "wrong",
            test_ca,
            SERVICE_RELAY_DNS_TSIG="relay-key:" + base64.b64encode(b"w" * 32).decode(),
            **env,
        )
        try:
            assert "dns" not in relay_ports(relay)  # no DNS of its own
            assert "challenge records to" in "".join(relay.lines)
            owner, other = FakeRelayServer(relay), FakeRelayServer(relay)
            assert owner.register() == 200
            assert other.register() == 200
            assert put_challenge(owner, owner.server_id, ["from-the-owner"])[0] == 200
            assert knot.txt(owner.server_id) == ["from-the-owner"]
            assert put_challenge(other, owner.server_id, ["evil"])[0] == 403
            assert knot.txt(owner.server_id) == ["from-the-owner"]
            assert put_challenge(owner, owner.server_id, [], method="DELETE")[0] == 200
            assert knot.txt(owner.server_id) == []
            relay_ports(wrong)
            fake = FakeRelayServer(wrong)
            assert fake.register() == 200
            status, _h, answer = put_challenge(fake, fake.server_id, ["v"])
            assert status == 502
            assert answer["error"]["code"] == "UPSTREAM_ERROR"
            assert knot.secret not in "".join(relay.lines + wrong.lines)  # never logged
        finally:
            relay.stop()
            wrong.stop()
