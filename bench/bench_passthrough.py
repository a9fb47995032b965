"""Benchmark: the passthrough relay against its references (not run by the tests).

    python bench/bench_passthrough.py
    python bench/bench_passthrough.py --requests 2000 --cpu-requests 4000 --servers 1000

Needs `cryptography` (a CA of the bench's own signs the relay's and the server's
certificates: no ACME here). Measures, in one run:

1. **Latency.** One keep-alive TLS client (Python's ssl) GETs a 2 KB note, request by
   request, from a real server in passthrough mode (a) through a real passthrough relay
   (`<id>.relay.test` by SNI, spliced to the server's dialled data connection) and (b) the
   reference: through a plain TCP forwarder of the bench's own (no SNI parsing) straight
   to the same server's passthrough handler (the same PROXY header, TLS in process and
   waitress channel, entered without a dial: see `serve`). p50/p95/p99, alternating rounds.
   Goal: (a) p50 <= 1.3x (b).
2. **Relay CPU per request.** The same GETs from 8 keep-alive TLS clients (a) through the
   passthrough relay and (b) through today's terminating relay (SERVICE_RELAY_TLS off, the
   server's own origin by Host, the server in today's mode), the TLS ended in front of it by
   a terminator of the bench's own (a process not counted). The relay process's CPU seconds
   over the requests. Goal: (a) <= 0.5x (b).
3. **Memory.** A fresh relay of each kind with N simulated servers long-polling (N=1,000;
   the passthrough ones register with `passthrough: true`): the relay's RssAnon. Goal:
   passthrough <= 1.2x today's.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import re
import secrets
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
NOTESVC = str(HERE.parent / "notesvc.py")
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from _common import print_header, server_env  # noqa: E402
from bench_relay import http, open_conn, pct, proc_figures  # noqa: E402

DOMAIN = "relay.test"
NO_ACME = "https://127.0.0.1:9/dir"  # a closed port: the server brings its certificate
NOTE = "notes/bench/passthrough.md"


# -- processes ---------------------------------------------------------------------------


class Proc:
    """A subprocess whose stderr is read for the patterns a caller waits for."""

    def __init__(self, cmd: list, env: dict):
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
        )
        self.pid = self.proc.pid
        self.text = ""
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            with self._lock:
                self.text += line

    def wait_for(self, pattern: str, timeout: float = 30) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                m = re.search(pattern, self.text)
            if m:
                return m
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise SystemExit(f"{self.proc.args[:4]} never said {pattern!r}:\n{self.text[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def notesvc_proc(*args: str, settings: dict) -> tuple:
    """Start `notesvc.py <args>` on a free loopback port; return (Proc, its HTTP port)."""
    cmd = [sys.executable, NOTESVC, *args, "--host", "127.0.0.1", "--port", "0"]
    proc = Proc(cmd, server_env(settings))
    port = int(proc.wait_for(r"listening on http://127\.0\.0\.1:(\d+)").group(1))
    return proc, port


def bench_proc(*args: str, settings: dict | None = None) -> Proc:
    return Proc([sys.executable, __file__, *args], server_env(settings))


def get_json(url: str, key: str = "") -> dict:
    req = urllib.request.Request(url, headers={"X-Service-Key": key} if key else {})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())["data"]


def wait(pred, timeout: float = 60, what: str = "") -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = pred()
        if found:
            return found
        time.sleep(0.1)
    raise SystemExit(f"timed out waiting for {what}")


# -- certificates (a CA of the bench's own) ----------------------------------------------


class CA:
    def __init__(self, folder: Path):
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        self.x509, self.hashes, self.ser, self.ec, self.oid = (
            x509,
            hashes,
            serialization,
            ec,
            NameOID,
        )
        self.key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "notesvc bench CA")])
        now = dt.datetime.now(dt.timezone.utc)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=1))
            .not_valid_after(now + dt.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.path = folder / "bench-ca.pem"
        self.path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def leaf(self, names: list) -> tuple:
        """Return (key PEM, certificate PEM) for these names, valid 90 days."""
        x509 = self.x509
        key = self.ec.generate_private_key(self.ec.SECP256R1())
        now = dt.datetime.now(dt.timezone.utc)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(self.oid.COMMON_NAME, names[0])]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(hours=1))
            .not_valid_after(now + dt.timedelta(days=90))
            .add_extension(
                x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), critical=False
            )
            .sign(self.key, self.hashes.SHA256())
        )
        pem = self.ser.Encoding.PEM
        return (
            key.private_bytes(pem, self.ser.PrivateFormat.PKCS8, self.ser.NoEncryption()),
            cert.public_bytes(pem),
        )

    def files(self, folder: Path, stem: str, names: list) -> tuple:
        key, cert = self.leaf(names)
        (folder / f"{stem}.key").write_bytes(key)
        (folder / f"{stem}.pem").write_bytes(cert)
        return str(folder / f"{stem}.pem"), str(folder / f"{stem}.key")


def server_root(folder: Path, ca: CA | None) -> str:
    """A server's root with a 2 KB note (and, with `ca`, its certificate for
    <serverId>.relay.test, so it needs no ACME); return its server id."""
    import notesvc

    folder.mkdir()
    (folder / "notes" / "bench").mkdir(parents=True)
    (folder / NOTE).write_text("# Passthrough\n\n" + "A line of a note's text. " * 80 + "\n")
    sid = notesvc.StateStore(folder / ".notesvc").read()["serverId"]
    if ca is not None:
        key, cert = ca.leaf([f"{sid}.{DOMAIN}"])
        tls = folder / ".notesvc" / "tls"
        tls.mkdir(mode=0o700)
        (tls / "server.pem").write_bytes(key + b"\n" + cert)
        os.chmod(tls / "server.pem", 0o600)
    return sid


# -- the server with a second way in (the reference), in a process of its own ------------


def serve(direct_port_file: str, argv: list) -> None:
    """Run notesvc's server (argv) with one more listener: each connection accepted on it
    enters the server's passthrough handler as a dialled data connection would after the
    relay's 101 (a PROXY v2 header for its peer, then its bytes) — the same TLS in process,
    pump thread and waitress channel, only without the relay and its dial."""
    import notesvc

    splicers: list = []
    handed: dict = {}  # token -> accepted socket
    init, open_dial = notesvc.SpliceServer.__init__, notesvc.SpliceServer.open_dial

    def patched_init(self, *a, **kw):
        init(self, *a, **kw)
        splicers.append(self)

    def patched_open_dial(self, token, deadline):
        sock = handed.pop(token, None)
        if sock is None:
            return open_dial(self, token, deadline)
        peer, local = sock.getpeername(), sock.getsockname()
        return sock, notesvc.proxy_v2_header(peer[:2], local[:2])

    notesvc.SpliceServer.__init__ = patched_init
    notesvc.SpliceServer.open_dial = patched_open_dial
    listener = socket.create_server(("127.0.0.1", 0), backlog=128)
    Path(direct_port_file).write_text(str(listener.getsockname()[1]))

    def accept() -> None:
        while True:
            sock, _ = listener.accept()
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while not splicers or splicers[0].context() is None:
                time.sleep(0.05)
            token = "bench-" + secrets.token_urlsafe(16)
            handed[token] = sock
            splicers[0].dial({"token": token})

    threading.Thread(target=accept, daemon=True).start()
    sys.exit(notesvc.main(argv))


# -- the bench's own plain TCP forwarder and TLS terminator (processes of their own) -----


async def pipe(reader, writer) -> None:
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            writer.write(data)
            await writer.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


async def forward(port_file: str, target: int, cert: str = "", key: str = "") -> None:
    """Accept on a free port (TLS ended here with cert/key, else bytes as they come) and
    pass everything to 127.0.0.1:target, both ways."""
    context = None
    if cert:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)

    async def one(reader, writer) -> None:
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target)
        up_writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    server = await asyncio.start_server(one, "127.0.0.1", 0, ssl=context, backlog=128)
    Path(port_file).write_text(str(server.sockets[0].getsockname()[1]))
    await server.serve_forever()


def forwarder(folder: Path, name: str, target: int, cert: str = "", key: str = "") -> tuple:
    port_file = folder / f"{name}.port"
    proc = bench_proc("--forward", str(port_file), str(target), cert, key)
    wait(port_file.exists, 20, name)
    time.sleep(0.05)
    return proc, int(port_file.read_text())


# -- clients -----------------------------------------------------------------------------


class Client:
    """A keep-alive HTTPS client on one TLS connection to 127.0.0.1:port for `name`."""

    def __init__(self, port: int, name: str, context: ssl.SSLContext, key: str):
        raw = socket.create_connection(("127.0.0.1", port), timeout=30)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = context.wrap_socket(raw, server_hostname=name)
        self.file = self.sock.makefile("rb")
        self.head = (
            f"GET /api/v1/notes/{NOTE} HTTP/1.1\r\nHost: {name}\r\nX-Service-Key: {key}\r\n\r\n"
        ).encode()

    def get(self) -> int:
        self.sock.sendall(self.head)
        status = int(self.file.readline().split()[1])
        length = 0
        while True:
            line = self.file.readline()
            if line in (b"\r\n", b""):
                break
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        self.file.read(length)
        return status

    def close(self) -> None:
        self.file.close()
        self.sock.close()


def latency(client: Client, count: int) -> tuple:
    times, errors = [], 0
    for _ in range(count):
        started = time.perf_counter()
        errors += client.get() != 200
        times.append((time.perf_counter() - started) * 1000)
    return times, errors


def concurrent_gets(port: int, name: str, context, key: str, total: int, clients: int) -> int:
    """`total` GETs from `clients` keep-alive clients on threads; return the errors."""
    errors = [0]
    lock = threading.Lock()

    def run() -> None:
        c = Client(port, name, context, key)
        bad = sum(c.get() != 200 for _ in range(total // clients))
        c.close()
        with lock:
            errors[0] += bad

    threads = [threading.Thread(target=run) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors[0]


# -- simulated servers (a process: --simulate PORT N READY PASSTHROUGH) -----------------


async def simulate(port: int, n: int, ready_file: str, passthrough: bool) -> None:
    """N servers that register (with `passthrough: true` when asked) and long-poll, each
    from its own loopback source address (50 per address, as bench_relay)."""
    import notesvc

    ids, errors = [], 0

    async def one(i: int) -> None:
        nonlocal errors
        token = secrets.token_urlsafe(32)
        sid = notesvc.relay_server_id(token)
        source = f"127.5.{i // 50 // 250}.{i // 50 % 250 + 1}"
        reader, writer = await open_conn(port, source)
        body = {"token": token, "relayCode": notesvc.relay_code_of(token)}
        if passthrough:
            body["passthrough"] = True
        hdrs = {"Content-Type": "application/json"}
        for _ in range(20):
            status, data = await http(
                reader, writer, "POST", f"/relay/v1/register/{sid}", json.dumps(body).encode(), hdrs
            )
            if status == 200 and json.loads(data)["data"].get("passthrough") == passthrough:
                break
            await asyncio.sleep(1)
        else:
            errors += 1
            return
        ids.append(sid)
        while True:
            try:
                status, _ = await http(
                    reader, writer, "GET", f"/relay/v1/poll/{sid}", b"", {"X-Relay-Token": token}
                )
                if status not in (200, 204):
                    await asyncio.sleep(1)
            except (OSError, asyncio.IncompleteReadError):
                errors += 1
                await asyncio.sleep(1)
                reader, writer = await open_conn(port, source)

    tasks = []
    for i in range(n):
        tasks.append(asyncio.create_task(one(i)))
        if i % 200 == 199:
            await asyncio.sleep(0.05)
    while len(ids) + errors < n:
        await asyncio.sleep(0.2)
    Path(ready_file).write_text(json.dumps({"ids": len(ids), "errors": errors}))
    await asyncio.gather(*tasks)


def relay_memory(folder: Path, settings: dict, n: int, passthrough: bool) -> dict:
    """A fresh relay with n simulated servers: its RssAnon (MB) idle and with them."""
    relay, port = notesvc_proc("relay", settings=settings)
    sim = None
    try:
        time.sleep(1)
        idle = proc_figures(relay.pid)["rss_mb"]
        ready = folder / f"ready-{passthrough}.json"
        sim = bench_proc("--simulate", str(port), str(n), str(ready), str(int(passthrough)))
        wait(ready.exists, 300, "the simulated servers")
        found = json.loads(ready.read_text())
        time.sleep(3)  # every long-poll in place
        return {"idle": idle, "held": proc_figures(relay.pid)["rss_mb"], **found}
    finally:
        for p in (sim, relay):
            if p is not None:
                p.stop()


# -- the run -----------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000, help="sequential GETs each way")
    ap.add_argument("--cpu-requests", type=int, default=4000, help="GETs for the CPU figure")
    ap.add_argument("--servers", type=int, default=1000, help="registrations for memory")
    ap.add_argument("--serve", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    ap.add_argument("--forward", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--simulate", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve[0], args.serve[1:])
        return
    if args.forward:
        port_file, target, cert, key = args.forward
        asyncio.run(forward(port_file, int(target), cert, key))
        return
    if args.simulate:
        port, n, ready, passthrough = args.simulate
        asyncio.run(simulate(int(port), int(n), ready, passthrough == "1"))
        return
    try:
        import cryptography  # noqa: F401
    except ImportError:
        raise SystemExit(
            "bench_passthrough needs cryptography (apt install python3-cryptography)"
        ) from None
    import resource

    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    with tempfile.TemporaryDirectory() as tmp:
        run(args, Path(tmp))


def run(args, tmp: Path) -> None:
    ca = CA(tmp)
    relay_cert, relay_key = ca.files(tmp, "relay", [DOMAIN, f"*.{DOMAIN}"])
    passthrough_settings = {
        "SERVICE_RELAY_DOMAIN": DOMAIN,
        "SERVICE_RELAY_TLS": "passthrough",
        "SERVICE_RELAY_TLS_PORT": "0",
        "SERVICE_RELAY_DNS_PORT": "0",
        "SERVICE_RELAY_DNS_ADDRESSES": "127.0.0.1",
        "SERVICE_RELAY_TLS_CERT": relay_cert,
        "SERVICE_RELAY_TLS_KEY": relay_key,
        "SERVICE_RELAY_MAX_SERVERS": str(args.servers + 100),
    }
    today_settings = {
        "SERVICE_RELAY_DOMAIN": DOMAIN,
        "SERVICE_RELAY_MAX_SERVERS": str(args.servers + 100),
    }
    server_settings = {
        "SERVICE_ACME_DIRECTORY": NO_ACME,
        "SERVICE_RESCAN_SECONDS": "0",
        "SERVICE_SETUP_LOCAL_ONLY": "false",
    }
    print_header({**passthrough_settings, **server_settings})
    procs: list = []
    try:
        relay_p, relay_p_http = notesvc_proc("relay", settings=passthrough_settings)
        procs.append(relay_p)
        tls_port = int(relay_p.wait_for(r"TLS on 127\.0\.0\.1:(\d+)").group(1))
        relay_t, relay_t_http = notesvc_proc("relay", settings=today_settings)
        procs.append(relay_t)

        sid_p = server_root(tmp / "srv-p", ca)
        direct_file = tmp / "direct.port"
        argv = ["--root", str(tmp / "srv-p"), "--host", "127.0.0.1", "--port", "0"]
        server_p = bench_proc(
            "--serve",
            str(direct_file),
            *argv,
            settings={**server_settings, "SERVICE_RELAY_URL": f"http://127.0.0.1:{relay_p_http}"},
        )
        procs.append(server_p)
        port_p = int(server_p.wait_for(r"listening on http://127\.0\.0\.1:(\d+)").group(1))
        sid_t = server_root(tmp / "srv-t", None)
        server_t, port_t = notesvc_proc(
            "--root",
            str(tmp / "srv-t"),
            settings={
                **server_settings,
                "SERVICE_RELAY_URL": f"http://127.0.0.1:{relay_t_http}",
                "SERVICE_RELAY_PASSTHROUGH": "off",
            },
        )
        procs.append(server_t)
        key_p = get_json(f"http://127.0.0.1:{port_p}/api/v1/system/setup")["apiKey"]
        key_t = get_json(f"http://127.0.0.1:{port_t}/api/v1/system/setup")["apiKey"]

        def connection(port: int, key: str) -> dict:
            return get_json(f"http://127.0.0.1:{port}/api/v1/system/info", key)["connection"]

        wait(lambda: connection(port_p, key_p)["mode"] == "passthrough", 60, "passthrough mode")
        wait(lambda: connection(port_t, key_t)["state"] == "connected", 60, "today's relay link")
        direct_port = int(direct_file.read_text())
        fwd, fwd_port = forwarder(tmp, "forwarder", direct_port)
        procs.append(fwd)
        term, term_port = forwarder(tmp, "terminator", relay_t_http, relay_cert, relay_key)
        procs.append(term)
        context = ssl.create_default_context(cafile=str(ca.path))
        name_p, name_t = f"{sid_p}.{DOMAIN}", f"{sid_t}.{DOMAIN}"

        # 1. latency, one keep-alive client each way, alternating rounds
        through = Client(tls_port, name_p, context, key_p)
        reference = Client(fwd_port, name_p, context, key_p)
        latency(through, 50)  # warm both
        latency(reference, 50)
        t_times, r_times, errors = [], [], 0
        for _ in range(5):
            times, e1 = latency(through, args.requests // 5)
            t_times += times
            times, e2 = latency(reference, args.requests // 5)
            r_times += times
            errors += e1 + e2
        through.close()
        reference.close()

        # 2. the relay's CPU per request: passthrough against today's behind the terminator
        cpu = {}
        for label, relay, port, name, key in (
            ("passthrough", relay_p, tls_port, name_p, key_p),
            ("today", relay_t, term_port, name_t, key_t),
        ):
            concurrent_gets(port, name, context, key, 80, 8)  # warm
            before = proc_figures(relay.pid)["cpu_s"]
            started = time.monotonic()
            errors += concurrent_gets(port, name, context, key, args.cpu_requests, 8)
            seconds = time.monotonic() - started
            used = proc_figures(relay.pid)["cpu_s"] - before
            cpu[label] = {
                "ms_per_request": used * 1000 / args.cpu_requests,
                "rps": args.cpu_requests / seconds,
            }
        for p in procs:
            p.stop()
        procs.clear()

        # 3. memory with N registrations, a fresh relay of each kind
        mem_p = relay_memory(tmp, passthrough_settings, args.servers, True)
        mem_t = relay_memory(tmp, today_settings, args.servers, False)
    finally:
        for p in procs:
            p.stop()
    report(args, t_times, r_times, cpu, mem_p, mem_t, errors)


def report(args, t_times, r_times, cpu, mem_p, mem_t, errors) -> None:
    print(f"\n{'GET of a 2 KB note, keep-alive':44}{'p50':>8}{'p95':>8}{'p99':>8}  ms")
    for label, values in (
        ("through the passthrough relay (SNI, splice)", t_times),
        ("reference: TLS via a plain TCP forwarder", r_times),
    ):
        print(f"{label:44}{pct(values, 50):8.2f}{pct(values, 95):8.2f}{pct(values, 99):8.2f}")
    ratio = pct(t_times, 50) / pct(r_times, 50)
    print(f"p50 ratio {ratio:.2f}x (goal <= 1.3)")
    p, t = cpu["passthrough"], cpu["today"]
    print(
        f"relay CPU per request ({args.cpu_requests} GETs, 8 clients): passthrough "
        f"{p['ms_per_request']:.3f} ms ({p['rps']:.0f}/s), today's terminating relay "
        f"{t['ms_per_request']:.3f} ms ({t['rps']:.0f}/s; TLS ended before it, not counted): "
        f"{p['ms_per_request'] / t['ms_per_request']:.2f}x (goal <= 0.5)"
    )
    print(
        f"relay RssAnon with {args.servers} servers: passthrough {mem_p['held']} MB "
        f"(idle {mem_p['idle']}, {mem_p['ids']} registered), today's {mem_t['held']} MB "
        f"(idle {mem_t['idle']}, {mem_t['ids']} registered): "
        f"{mem_p['held'] / mem_t['held']:.2f}x (goal <= 1.2)"
    )
    print(f"errors: {errors + mem_p['errors'] + mem_t['errors']}")


if __name__ == "__main__":
    main()
