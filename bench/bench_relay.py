"""Benchmark: the relay under many servers, against direct access (not run by the tests).

    python bench/bench_relay.py --servers 1000
    python bench/bench_relay.py --servers 1000 --slow413 10000
    python bench/bench_relay.py --servers 5000 --hold 60
    python bench/bench_relay.py --servers 1000 --attackers 1000

Starts a real relay (`notesvc.py relay`, with per-server origins under relay.test), one
real notesvc server registered with it, and N simulated servers: one asyncio process
holding N long-polls (each from its own loopback source address, 50 per address) that
answers its own share of the traffic. Then it measures, in one run:

- latency of one client, request by request, direct to the real server, through the
  relay by path (/r/<id>/api/v1/...) and through the relay by Host (the server's own
  origin, <id>.relay.test) (p50/p95/p99 and the milliseconds each adds);
- requests/s through the relay with 16 concurrent clients spread over all the servers,
  by path and by Host;
- with --slow413 K: K clients that declare a body over the relay's limit and then write
  it slowly (each gets its 413 at once; the relay lingers, reading what they still send,
  for a bounded time): the relay's RssAnon against its idle figure, and the latency of
  another client meanwhile;
- the relay's private memory (RssAnon) and CPU time, and every error;
- with --attackers A: A idle connections from one address held open during the run;
- with --hold S: the N servers stay connected S seconds while clients keep asking, and
  any error counts.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
NOTESVC = str(HERE.parent / "notesvc.py")
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from _common import print_header, server_env  # noqa: E402


def start(*args: str, env: dict) -> tuple:
    proc = subprocess.Popen(
        [sys.executable, NOTESVC, *args, "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=server_env(env),  # notesvc's defaults, but for the settings given
    )
    ready, port = threading.Event(), []

    def read():
        for line in proc.stderr:
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            if m:
                port.append(int(m.group(1)))
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(30):
        raise SystemExit(f"{args} did not start")
    return proc, port[0]


def proc_figures(pid: int) -> dict:
    """Return RssAnon (MB) and CPU seconds of a process."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss = int(re.search(r"RssAnon:\s+(\d+) kB", status).group(1)) / 1024
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return {"rss_mb": round(rss, 1), "cpu_s": round(cpu, 2)}


# -- a tiny HTTP/1.1 client on asyncio streams (keep-alive) -------------------------------


async def http(
    reader, writer, method: str, path: str, body: bytes = b"", headers=None, host: str = "relay"
):
    head = [f"{method} {path} HTTP/1.1", f"Host: {host}"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if body or method == "POST":
        head.append(f"Content-Length: {len(body)}")
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
    await writer.drain()
    status_line = await reader.readline()
    status = int(status_line.split()[1])
    length = 0
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b""):
            break
        name, _, value = line.decode("latin-1").partition(":")
        if name.lower() == "content-length":
            length = int(value)
    data = await reader.readexactly(length) if length else b""
    return status, data


async def open_conn(port: int, source: str):
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


# -- simulated servers (a subprocess: python bench_relay.py --simulate ...) --------------


async def simulate(port: int, n: int, ready_file: str) -> None:
    import notesvc

    answer = base64.b64encode(b'{"success":true,"data":{"status":"ok","simulated":true}}')
    reply_body_tail = b'","status":200,"headers":[["Content-Type","application/json"]]}'
    ids = []
    errors = 0

    async def one(i: int) -> None:
        nonlocal errors
        token = secrets.token_urlsafe(32)
        sid = notesvc.relay_server_id(token)
        source = f"127.1.{i // 50 // 250}.{i // 50 % 250 + 1}"
        reader, writer = await open_conn(port, source)
        body = json.dumps({"token": token, "relayCode": notesvc.relay_code_of(token)}).encode()
        hdrs = {"Content-Type": "application/json"}
        for _ in range(20):
            status, _ = await http(reader, writer, "POST", f"/relay/v1/register/{sid}", body, hdrs)
            if status == 200:
                break
            await asyncio.sleep(1)
        else:
            errors += 1
            return
        ids.append(sid)
        auth = {"X-Relay-Token": token}
        reply_hdrs = {**auth, "Content-Type": "application/json"}
        while True:
            try:
                status, data = await http(reader, writer, "GET", f"/relay/v1/poll/{sid}", b"", auth)
                if status == 204:
                    continue
                if status != 200:
                    errors += 1
                    await asyncio.sleep(1)
                    continue
                rid = json.loads(data)["data"]["id"]
                reply = b'{"body":"' + answer + reply_body_tail
                await http(
                    reader, writer, "POST", f"/relay/v1/reply/{sid}/{rid}", reply, reply_hdrs
                )
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
    Path(ready_file).write_text(json.dumps({"ids": ids, "errors": errors}))
    await asyncio.gather(*tasks)


# -- clients ------------------------------------------------------------------------------


DOMAIN = "relay.test"


async def latency(port: int, path_of, count: int, key: str, host_of=None) -> list:
    reader, writer = await open_conn(port, "127.0.0.1")
    times, errors = [], 0
    for i in range(count):
        started = time.perf_counter()
        host = host_of(i) if host_of else "relay"
        status, _ = await http(reader, writer, "GET", path_of(i), b"", {"X-Service-Key": key}, host)
        times.append((time.perf_counter() - started) * 1000)
        errors += status != 200
    writer.close()
    return times, errors


async def load(port: int, paths: list, seconds: float, key: str, clients: int = 16) -> tuple:
    """paths: (Host, path) pairs, taken in turn by `clients` concurrent clients."""
    done, errors, times = 0, 0, []
    deadline = time.monotonic() + seconds

    async def client(c: int) -> None:
        nonlocal done, errors
        reader, writer = await open_conn(port, f"127.0.2.{c + 1}")
        i = c
        while time.monotonic() < deadline:
            started = time.perf_counter()
            host, path = paths[i % len(paths)]
            try:
                status, _ = await http(
                    reader, writer, "GET", path, b"", {"X-Service-Key": key}, host
                )
            except (OSError, asyncio.IncompleteReadError):
                errors += 1
                reader, writer = await open_conn(port, f"127.0.2.{c + 1}")
                continue
            times.append((time.perf_counter() - started) * 1000)
            done += 1
            errors += status != 200
            i += clients * 7 + 1
        writer.close()

    started = time.monotonic()
    await asyncio.gather(*(client(c) for c in range(clients)))
    return done / (time.monotonic() - started), errors, times


def pct(values: list, p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p / 100))] if values else float("nan")


async def attack(port: int, count: int) -> list:
    """Open `count` idle connections from one address (an unfinished request each)."""
    socks = []
    for _ in range(count):
        try:
            _reader, writer = await open_conn(port, "127.0.3.1")
            writer.write(b"GET /hea")
            socks.append(writer)
        except OSError:
            break
    return socks


async def slow_413s(port: int, count: int, limit: int, key: str, sid: str) -> dict:
    """`count` slow writers over the relay's limit (500 at a time, 50 per source address),
    while another client asks through the relay every 20 ms; return what was seen."""
    head = (
        f"POST /r/{sid}/api/v1/notes HTTP/1.1\r\nHost: relay\r\n"
        f"Content-Type: application/json\r\nContent-Length: {limit * 4}\r\n\r\n"
    ).encode()
    chunk = b"x" * 4096
    refused = errors = cut = 0
    started = 0
    done = asyncio.Event()

    async def writer_(n: int) -> None:
        """One slow writer: its head, its 413, then 4 KB every 100 ms for a second (it
        stays a second even when the relay closes on it: the flood's rate is the same)."""
        nonlocal refused, errors, cut
        source = f"127.4.{n // 50 // 250 % 250}.{n // 50 % 250 + 1}"
        try:
            reader, writer = await open_conn(port, source)
            writer.write(head)
            await writer.drain()
            status_line = await asyncio.wait_for(reader.readline(), 10)
            refused += status_line.startswith(b"HTTP/1.1 413")
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            errors += 1
            return
        closed = False
        for _ in range(10):
            if not closed:
                try:
                    writer.write(chunk)
                    await writer.drain()
                except OSError:
                    closed, cut = True, cut + 1
            await asyncio.sleep(0.1)
        writer.close()

    async def pool() -> None:
        nonlocal started
        running: set = set()
        while started < count:
            while len(running) < 500 and started < count:
                running.add(asyncio.create_task(writer_(started)))
                started += 1
            _, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
        await asyncio.gather(*running)
        done.set()

    async def probe() -> list:
        """Another client, in a process of its own (this one is busy with the writers)."""
        out = Path(tempfile.mkdtemp()) / "probe.json"
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--probe",
            str(port),
            sid,
            key,
            str(out),
            stdin=asyncio.subprocess.PIPE,
        )
        await done.wait()
        proc.stdin.close()
        await proc.wait()
        return json.loads(out.read_text())

    peak = 0.0

    async def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, proc_figures_of_port(port).get("rss_mb", 0))
            await asyncio.sleep(0.25)

    begun = time.monotonic()
    _, times, _ = await asyncio.gather(pool(), probe(), sample())
    return {
        "count": count,
        "refused": refused,
        "errors": errors,
        "cut": cut,
        "seconds": time.monotonic() - begun,
        "probe": times,
        "peak_mb": peak,
    }


def probe_process(port: int, sid: str, key: str, out: str) -> None:
    """GET /health through the relay every 20 ms until stdin closes; write the times."""
    import http.client

    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    times = []
    while not stop.is_set():
        started = time.perf_counter()
        conn.request("GET", f"/r/{sid}/api/v1/health", headers={"X-Service-Key": key})
        conn.getresponse().read()
        times.append((time.perf_counter() - started) * 1000)
        time.sleep(0.02)
    Path(out).write_text(json.dumps(times))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--servers", type=int, default=100, help="simulated servers")
    ap.add_argument("--requests", type=int, default=500, help="sequential requests each way")
    ap.add_argument("--seconds", type=float, default=10, help="length of the load phase")
    ap.add_argument("--hold", type=float, default=0, help="keep the servers S seconds more")
    ap.add_argument("--attackers", type=int, default=0, help="idle connections from one address")
    ap.add_argument("--slow413", type=int, default=0, help="slow writers over the body limit")
    ap.add_argument("--simulate", nargs=3, metavar=("PORT", "N", "READY"), help=argparse.SUPPRESS)
    ap.add_argument("--probe", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        port, sid, key, out = args.probe
        probe_process(int(port), sid, key, out)
        return
    if args.simulate:
        port, n, ready = args.simulate
        asyncio.run(simulate(int(port), int(n), ready))
        return
    import resource

    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    with tempfile.TemporaryDirectory() as tmp:
        relay_env = {  # what the bench cannot run without:
            "SERVICE_RELAY_MAX_SERVERS": str(args.servers + 100),  # room for every server
            "SERVICE_RELAY_DOMAIN": DOMAIN,  # the rows by Host (each server's own origin)
        }
        relay, relay_port = start("relay", env=relay_env)
        relay_url = f"http://127.0.0.1:{relay_port}"
        server_settings = {"SERVICE_RELAY_URL": relay_url}  # the real server, on the relay
        print_header({**relay_env, **server_settings})  # the relay's, the server's
        server, direct_port = start("--root", tmp, env=server_settings)
        sim = None
        try:
            import urllib.request

            with urllib.request.urlopen(
                f"http://127.0.0.1:{direct_port}/api/v1/system/setup", timeout=10
            ) as resp:
                setup = json.loads(resp.read())["data"]
            key, sid = setup["apiKey"], setup["serverId"]
            idle = proc_figures(relay.pid)
            ready = Path(tmp) / "ready.json"
            started = time.monotonic()
            sim = subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--simulate",
                    str(relay_port),
                    str(args.servers),
                    str(ready),
                ]
            )
            while not ready.exists():
                time.sleep(0.2)
                if sim.poll() is not None:
                    raise SystemExit("the simulated servers stopped")
            simulated = json.loads(ready.read_text())
            connect_s = time.monotonic() - started
            figures = asyncio.run(
                measure(args, relay_port, direct_port, key, sid, simulated["ids"])
            )
            figures["relay_idle"] = idle
            figures["connect_s"] = round(connect_s, 1)
            figures["register_errors"] = simulated["errors"]
            report(args, figures)
        finally:
            for proc in (sim, server, relay):
                if proc is not None and proc.poll() is None:
                    proc.terminate()
                    proc.wait(10)


async def measure(args, relay_port: int, direct_port: int, key: str, sid: str, ids: list) -> dict:
    out: dict = {}
    attackers = await attack(relay_port, args.attackers) if args.attackers else []
    out["attackers_open"] = len(attackers)
    note = "/api/v1/health"
    origin = f"{sid}.{DOMAIN}:{relay_port}"
    direct, e1 = await latency(direct_port, lambda i: note, args.requests, key)
    # by path and by Host, alternating rounds so that neither gets a warmer relay
    relayed, by_host, e2 = [], [], 0
    for _ in range(5):
        times, e = await latency(relay_port, lambda i: f"/r/{sid}{note}", args.requests // 5, key)
        relayed += times
        times, e3 = await latency(
            relay_port, lambda i: note, args.requests // 5, key, lambda i: origin
        )
        by_host += times
        e2 += e + e3
    out["direct"], out["relayed"], out["by_host"] = direct, relayed, by_host
    out["latency_errors"] = e1 + e2
    everyone = [*ids, sid]
    paths = [("relay", f"/r/{s}{note}") for s in everyone]
    rps, errors, times = await load(relay_port, paths, args.seconds, key)
    out["rps"], out["load_errors"], out["load_times"] = rps, errors, times
    hosts = [(f"{s}.{DOMAIN}:{relay_port}", note) for s in everyone]
    rps, errors, times = await load(relay_port, hosts, args.seconds, key)
    out["rps_host"], out["load_errors"], out["load_times_host"] = (
        rps,
        out["load_errors"] + errors,
        times,
    )
    if args.hold:
        _, hold_errors, _ = await load(relay_port, paths, args.hold, key, clients=2)
        out["hold_errors"] = hold_errors
    out["relay"] = proc_figures_of_port(relay_port)
    if args.slow413:
        out["before_413"] = proc_figures_of_port(relay_port)
        out["slow413"] = await slow_413s(relay_port, args.slow413, 1048576, key, sid)
        await asyncio.sleep(notesvc_linger() + 1)  # the last lingering connections close
        out["after_413"] = proc_figures_of_port(relay_port)
    for w in attackers:
        w.close()
    return out


def notesvc_linger() -> float:
    import notesvc

    return notesvc.LINGER_SECONDS


def proc_figures_of_port(port: int) -> dict:
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"relay" in cmd and NOTESVC.encode() in cmd:
                return proc_figures(int(pid))
    return {}


def report(args, f: dict) -> None:
    d, r, h = f["direct"], f["relayed"], f["by_host"]
    print(
        f"\nrelay with {args.servers} simulated servers + 1 real (connected in {f['connect_s']} s)"
    )
    print(f"{'':30}{'p50':>8}{'p95':>8}{'p99':>8}  ms")
    for name, values in (
        ("direct", d),
        ("relay, by path /r/<id>", r),
        ("relay, by Host <id>.domain", h),
    ):
        print(f"{name:30}{pct(values, 50):8.2f}{pct(values, 95):8.2f}{pct(values, 99):8.2f}")
    for name, values in (("added by path", r), ("added by Host", h)):
        added = [pct(values, p) - pct(d, p) for p in (50, 95, 99)]
        print(f"{name:30}{added[0]:8.2f}{added[1]:8.2f}{added[2]:8.2f}")
    more = [pct(h, p) - pct(r, p) for p in (50, 99)]
    print(
        f"Host against path: p50 {more[0]:+.2f} ms (goal <= 0.2), p99 {more[1]:+.2f} ms (goal <= 2)"
    )
    for name, rps, lt in (
        ("by path", f["rps"], f["load_times"]),
        ("by Host", f["rps_host"], f["load_times_host"]),
    ):
        print(
            f"16 clients over all servers, {name}: {rps:.0f} requests/s, "
            f"p50 {pct(lt, 50):.1f} ms, p99 {pct(lt, 99):.1f} ms"
        )
    print(
        f"relay RssAnon {f['relay'].get('rss_mb')} MB "
        f"(idle before: {f['relay_idle']['rss_mb']} MB), CPU {f['relay'].get('cpu_s')} s"
    )
    if args.attackers:
        print(f"attacker connections opened from one address: {f['attackers_open']}")
    if args.slow413:
        w = f["slow413"]
        before, after = f["before_413"]["rss_mb"], f["after_413"]["rss_mb"]
        print(
            f"{w['count']} slow writers over the limit in {w['seconds']:.0f} s: "
            f"{w['refused']} got their 413, {w['errors']} errors, {w['cut']} cut short "
            f"(over the relay's lingering cap); relay RssAnon "
            f"{before} MB before, peak {w['peak_mb']} MB (+{w['peak_mb'] - before:.1f}, "
            f"goal <= 10), {after} MB after; another client meanwhile: "
            f"p50 {pct(w['probe'], 50):.1f} ms, p99 {pct(w['probe'], 99):.1f} ms (goal <= 50)"
        )
    errors = f["latency_errors"] + f["load_errors"] + f["register_errors"] + f.get("hold_errors", 0)
    held = f" (held {args.hold:.0f} s more)" if args.hold else ""
    print(f"errors: {errors}{held}")


if __name__ == "__main__":
    main()
