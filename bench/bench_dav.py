"""Benchmark: notesvc's WebDAV (/dav/) against WsgiDAV and rclone's server (not run by the tests).

    python bench/bench_dav.py                    # all three; ~2 min on 2 cores
    python bench/bench_dav.py --only peers       # WsgiDAV and rclone alone (no notesvc)
    python bench/bench_dav.py --only notesvc --seconds 3 --rounds 100

The tree: the first --notes notes of /work/shared/bench/corpus.py's real-text corpus
(--corpus, built there when missing), written as notes/f<NN>/<name>.md (50 folders, note i
in folder i % 50) plus every one of them again in notes/big/ (the folder of --notes notes).
notesvc gets it in its root; each peer gets a copy of that notes/ subtree, so all three
serve the same bytes. All three run at once, on loopback, in the same run:

- notesvc: `notesvc.py --root <root> --host 127.0.0.1 --port 0` with default settings
  (every SERVICE_* variable of the bench's environment is taken out, and the header says
  so: rescans on, log level info, its line a request written to a file as a service
  manager's journal would take it), at /dav/, HTTP Basic with the API key as password,
  checked on every request;
- WsgiDAV (the Python peer; pip install wsgidav cheroot): its filesystem provider on
  cheroot (its default server) under the same interpreter, `--config <tmp>/wsgidav.json`:
  HTTP Basic for one user of its simple_dc (accept_basic true, accept_digest false,
  default_to_digest false), its default verbosity (3: a line a request, INFO), to a file;
- rclone (the Go peer): `rclone serve webdav <dir> --user bench --pass <random>` (Basic, one
  user) with its other defaults: log level NOTICE, which writes no line a request (its log
  to a file), directory listings kept 5 min (--dir-cache-time).

So all three check Basic auth on every request, serve copies of the same tree in the same
temp folder and write their logs to files there; the contract's "the same log level" as far
as the peers have one: WsgiDAV's default logs a line a request as notesvc's info does,
rclone has no level that logs requests short of DEBUG, so it runs at its default.

The rows, each checked for its status (PROPFIND 207, GET 200, PUT 200/201/204 — RFC 9110
allows 200 or 204 for an overwrite; the API's PUT 200), and every other answer counted as
an error:

- PROPFIND Depth: 1 of notes/big/ with the prop body rclone and Obsidian's plugins send
  (resourcetype, getcontentlength, getlastmodified, getetag, getcontenttype);
- GET of a note of notes/f00/ (in turn);
- PUT of a note of notes/f01/ (in turn; new bytes each time: the note's text plus a line;
  each client its own notes, unless --notes is under 400: then clients share notes, and
  rclone answers 423 to a PUT while another one writes the same file);
- and, notesvc only, the reference for PUT's price: `PUT /api/v1/notes/<path>` with
  {"content": ...} and X-Service-Key, on the same notes.

Each row is measured twice: one client, sequential (--rounds requests, PROPFIND a quarter of
that; the three servers asked in turn, request by request, so noise hits all alike) for
p50/p99; then 8 concurrent clients (threads, a keep-alive http.client connection each) for
--seconds per server and row, one server at a time, for req/s (with the server's CPU ms a
request: the clients are Python on the same cores). Every row, of every server, is asked
by the same 8 clients. Before any of it, each server is warmed up and checked: the PROPFIND
lists --notes + 1 entries, a GET gives the file's bytes, a PUT is read back. After the run,
each server's RssAnon. The header names the commit, Python and the settings of the run.

--where adds where a notesvc GET's time goes: the same GET through the WSGI app in this
process (Bottle and the app, no socket; authentication alone; an OPTIONS that asks for no
key) against the server's CPU a request over HTTP, one client and 8 (the rest: waitress,
the socket and the GIL handoffs among its threads).

Goals (issue text): ahead of WsgiDAV on every row (here: lower p50 and higher req/s); within
2x of rclone's server on PROPFIND and GET (p50 at most 2x, req/s at least half); PUT may pay
for history and fsync, and states that price against a PUT to the API. Issue 45: GET and
PROPFIND at or above WsgiDAV's req/s (8 clients, same run), PUT within 2x of the API's PUT.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import importlib.metadata
import importlib.util
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_offline import corpus_notes  # noqa: E402
from bench_relay import NOTESVC, pct, proc_figures  # noqa: E402

FOLDERS = 50
CLIENTS = 8
RCLONE = shutil.which("rclone") or "/usr/bin/rclone"
PROPFIND_BODY = (
    b'<?xml version="1.0"?><d:propfind xmlns:d="DAV:"><d:prop><d:resourcetype/>'
    b"<d:getcontentlength/><d:getlastmodified/><d:getetag/><d:getcontenttype/>"
    b"</d:prop></d:propfind>"
)
# row -> (label, statuses that count as answered)
ROWS = {
    "propfind": ("PROPFIND depth 1, notes/big/", {207}),
    "get": ("GET a note", {200}),
    "put": ("PUT a note", {200, 201, 204}),
    "api_put": ("ref.: PUT to the API", {200}),
}
PHASES = (("propfind",), ("get",), ("put", "api_put"))  # rows asked in turn, sequentially


# -- the tree -------------------------------------------------------------------------------


def seed_tree(root: Path, notes: list) -> dict:
    """Write notes/f<NN>/<name>.md (note i in folder i % 50) and notes/big/<name>.md under
    `root`; return the paths (relative to root) to GET (f00) and to PUT (f01), and `n`."""
    tree: dict = {"get": [], "put": [], "n": len(notes)}
    for i, (rel, text) in enumerate(notes):
        stem = Path(rel).stem
        for folder in (f"f{i % FOLDERS:02d}", "big"):
            path, k = f"notes/{folder}/{stem}.md", 2
            while (root / path).exists():
                path, k = f"notes/{folder}/{stem}-{k}.md", k + 1
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text(text, encoding="utf-8")
            if folder == "f00":
                tree["get"].append(path)
            elif folder == "f01":
                tree["put"].append(path)
    tree["text"] = {p: (root / p).read_bytes() for p in tree["get"] + tree["put"]}
    tree["root"] = root
    return tree


# -- servers --------------------------------------------------------------------------------


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    port: int
    prefix: str = ""  # where the tree is in its URLs: "/dav" for notesvc
    headers: dict = field(default_factory=dict)  # auth, when it asks for any
    key: str = ""
    version: str = ""

    def connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(proc: subprocess.Popen, port: int, name: str, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited at start ({proc.returncode})")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"{name} did not listen on {port} within {seconds:.0f} s")


USER = "bench"  # the peers' one user (Basic auth); the password is made at each run
WSGIDAV_SETTINGS = (
    "--config <tmp>/wsgidav.json --root <dir> (simple_dc, one user; accept_basic true,"
    " accept_digest false, default_to_digest false), cheroot (its default server), its"
    " default verbosity 3 (a line a request, to a file)"
)
RCLONE_SETTINGS = (
    "--user/--pass (Basic, one user), its default log level NOTICE (no line a request;"
    " its log to a file), listings kept 5 min (--dir-cache-time)"
)


def basic_headers(password: str) -> dict:
    return {"Authorization": "Basic " + base64.b64encode(f"{USER}:{password}".encode()).decode()}


def start_wsgidav(folder: Path) -> Server:
    """WsgiDAV's filesystem provider over `folder`, on cheroot (its default server), under
    this interpreter: HTTP Basic, one user of its simple_dc, from a config file beside
    `folder`; its default verbosity logs a line a request (to stdout: a file here)."""
    if importlib.util.find_spec("wsgidav") is None:
        raise SystemExit("no WsgiDAV here: pip install wsgidav cheroot")
    password = secrets.token_urlsafe(24)
    config = {
        "http_authenticator": {
            "domain_controller": None,  # its SimpleDomainController
            "accept_basic": True,
            "accept_digest": False,
            "default_to_digest": False,
        },
        "simple_dc": {"user_mapping": {"*": {USER: {"password": password}}}},
    }
    config_file = folder.parent / "wsgidav.json"
    config_file.write_text(json.dumps(config), encoding="utf-8")
    port = free_port()
    cmd = [sys.executable, "-m", "wsgidav.server.server_cli", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--root", str(folder), "--config", str(config_file)]
    with open(folder.parent / "wsgidav.log", "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=folder)
    wait_listening(proc, port, "WsgiDAV")
    version = importlib.metadata.version("wsgidav")
    return Server("WsgiDAV", proc, port, headers=basic_headers(password), version=version)


def start_rclone(folder: Path) -> Server:
    """`rclone serve webdav` over `folder`: HTTP Basic with one user (--user/--pass), its
    other defaults (log level NOTICE: no line a request; its log to a file)."""
    if not Path(RCLONE).exists():
        raise SystemExit("no rclone here: apt-get install rclone")
    password = secrets.token_urlsafe(24)
    port = free_port()
    cmd = [RCLONE, "serve", "webdav", str(folder), "--addr", f"127.0.0.1:{port}"]
    cmd += ["--user", USER, "--pass", password]
    with open(folder.parent / "rclone.log", "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    wait_listening(proc, port, "rclone")
    out = subprocess.run([RCLONE, "version"], capture_output=True, text=True, check=False)
    version = out.stdout.split("\n", 1)[0].split()[-1]
    return Server("rclone", proc, port, headers=basic_headers(password), version=version)


def stop(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.terminate()
        try:
            server.proc.wait(10)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()


# -- notesvc: its /dav/ and, for PUT's price, the API's PUT ----------------------------------


def defaults_env() -> dict:
    """This environment without any SERVICE_* variable: notesvc at its default settings."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SERVICE_")}


def start_defaults(root: Path) -> tuple:
    """`notesvc.py --root root` with default settings, its log (info: a line a request)
    to a file beside root; return (process, port)."""
    log_file = open(root.parent / "notesvc.log", "w+", encoding="utf-8")  # noqa: SIM115
    cmd = [sys.executable, NOTESVC, "--root", str(root), "--host", "127.0.0.1", "--port", "0"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=log_file, env=defaults_env(), text=True
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        log_file.seek(0)
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", log_file.read())
        if m:
            return proc, int(m.group(1))
        time.sleep(0.05)
    proc.kill()
    raise SystemExit(f"notesvc did not start (see {log_file.name})")


def start_notesvc(root: Path) -> Server:
    """A real notesvc server on `root`; WebDAV by Basic auth with the key (any user name)."""
    proc, port = start_defaults(root)
    url = f"http://127.0.0.1:{port}/api/v1/system/setup"
    with urllib.request.urlopen(url, timeout=60) as resp:
        key = json.loads(resp.read())["data"]["apiKey"]
    basic = base64.b64encode(f"bench:{key}".encode()).decode()
    version = re.search(r'^__version__ = "([^"]+)"', (HERE.parent / "notesvc.py").read_text(), re.M)
    return Server(
        "notesvc",
        proc,
        port,
        prefix="/dav",
        headers={"Authorization": f"Basic {basic}"},
        key=key,
        version=version.group(1) if version else "",
    )


def api_put_request(server: Server, tree: dict):
    """The reference for PUT's price: `PUT /api/v1/notes/<path>` {"content"}, the same notes."""

    def make(client: int, i: int) -> tuple:
        path = pick(tree["put"], client, i)
        text = tree["text"][path].decode() + f"\nedit {client}.{i} by the API\n"
        headers = {"X-Service-Key": server.key, "Content-Type": "application/json"}
        body = json.dumps({"content": text}).encode()
        return "PUT", "/api/v1/notes/" + urllib.parse.quote(path, safe=""), body, headers

    return make


def settle_notesvc(server: Server) -> None:
    """Its index caught up with the tree before anything is timed."""
    conn = server.connect()
    conn.request("GET", "/api/v1/search?q=the&limit=1", headers={"X-Service-Key": server.key})
    conn.getresponse().read()
    conn.close()
    time.sleep(1)


# -- requests -------------------------------------------------------------------------------


def pick(paths: list, client: int, i: int) -> str:
    """The i-th path of `client`'s own share (client c takes paths c, c + 8, ...)."""
    mine = paths[client::CLIENTS] or paths
    return mine[i % len(mine)]


def dav_request(server: Server, row: str, tree: dict):
    """Return make(client, i) -> (method, url, body, headers) for a WebDAV row."""
    base = server.headers

    def propfind(client: int, i: int) -> tuple:
        headers = {**base, "Depth": "1", "Content-Type": 'application/xml; charset="utf-8"'}
        return "PROPFIND", f"{server.prefix}/notes/big/", PROPFIND_BODY, headers

    def get(client: int, i: int) -> tuple:
        path = pick(tree["get"], client, i)
        return "GET", server.prefix + "/" + urllib.parse.quote(path), None, base

    def put(client: int, i: int) -> tuple:
        path = pick(tree["put"], client, i)
        body = tree["text"][path] + f"\nedit {client}.{i}\n".encode()
        headers = {**base, "Content-Type": "text/markdown"}
        return "PUT", server.prefix + "/" + urllib.parse.quote(path), body, headers

    return {"propfind": propfind, "get": get, "put": put}[row]


def ask(conn: http.client.HTTPConnection, req: tuple) -> tuple:
    """Send one request; return its status, its body and the ms it took."""
    method, url, body, headers = req
    started = time.perf_counter()
    conn.request(method, url, body, headers)
    resp = conn.getresponse()
    data = resp.read()
    return resp.status, data, (time.perf_counter() - started) * 1000


def check(server: Server, tree: dict) -> list:
    """Warm the server up and check its answers; return what was wrong."""
    conn, wrong = server.connect(), []
    status, data, _ = ask(conn, dav_request(server, "propfind", tree)(0, 0))
    entries = len(re.findall(rb"<(?:[\w-]+:)?response[\s>]", data))
    if status != 207 or entries != tree["n"] + 1:
        wrong.append(
            f"PROPFIND notes/big/: {status}, {entries} entries (want 207, {tree['n'] + 1})"
        )
    path = tree["get"][0]
    status, data, _ = ask(conn, dav_request(server, "get", tree)(0, 0))
    if status != 200 or data != tree["text"][path]:
        wrong.append(f"GET {path}: {status}, {len(data)} bytes (want 200, the file's bytes)")
    req = dav_request(server, "put", tree)(0, 0)
    status, _, _ = ask(conn, req)
    _, back, _ = ask(conn, ("GET", req[1], None, server.headers))
    if status not in ROWS["put"][1] or back != req[2]:
        wrong.append(f"PUT {req[1]}: {status}, read back {'as sent' if back == req[2] else 'not'}")
    for row, count in (("propfind", 5), ("get", 50), ("put", 20)):
        make = dav_request(server, row, tree)
        for i in range(count):
            ask(conn, make(0, i))
    conn.close()
    return wrong


def sequential(targets: list, count: int) -> dict:
    """Ask each target `count` times, one client each, the targets in turn request by
    request; return {(server, row): {"times", "errors"}} (errors: a Counter of what came
    back instead: a status, or an exception's name)."""
    conns = [t["server"].connect() for t in targets]
    out = {(t["server"].name, t["row"]): {"times": [], "errors": Counter()} for t in targets}
    for i in range(count):
        for t, conn in zip(targets, conns):
            res = out[(t["server"].name, t["row"])]
            try:
                status, _, ms = ask(conn, t["make"](0, i))
            except (OSError, http.client.HTTPException) as e:
                res["errors"][type(e).__name__] += 1
                conn.close()
                continue
            res["times"].append(ms)
            if status not in ROWS[t["row"]][1]:
                res["errors"][status] += 1
    for conn in conns:
        conn.close()
    return out


def under_load(target: dict, seconds: float) -> dict:
    """8 clients (threads, a keep-alive connection each) asking for `seconds`; return req/s,
    the times, the errors, the server's CPU ms a request and this process's CPU share."""
    server, row, make = target["server"], target["row"], target["make"]
    wanted = ROWS[row][1]
    times: list = [[] for _ in range(CLIENTS)]
    errors = [Counter() for _ in range(CLIENTS)]
    spans: list = [None] * CLIENTS
    barrier = threading.Barrier(CLIENTS + 1)

    def client(c: int) -> None:
        conn = server.connect()
        barrier.wait()
        begun = time.monotonic()
        i = 0
        while time.monotonic() - begun < seconds:
            try:
                status, _, ms = ask(conn, make(c, i))
            except (OSError, http.client.HTTPException) as e:
                errors[c][type(e).__name__] += 1
                conn.close()
                continue
            times[c].append(ms)
            if status not in wanted:
                errors[c][status] += 1
            i += 1
        spans[c] = (begun, time.monotonic())
        conn.close()

    threads = [threading.Thread(target=client, args=(c,)) for c in range(CLIENTS)]
    for t in threads:
        t.start()
    cpu_before, ours_before = proc_figures(server.proc.pid)["cpu_s"], sum(os.times()[:2])
    barrier.wait()
    for t in threads:
        t.join()
    cpu = proc_figures(server.proc.pid)["cpu_s"] - cpu_before
    ours = sum(os.times()[:2]) - ours_before
    every = [ms for chunk in times for ms in chunk]
    wall = max(e for _, e in spans) - min(b for b, _ in spans)
    done = max(len(every), 1)
    return {
        "rate": len(every) / wall,
        "times": every,
        "errors": sum(errors, Counter()),
        "cpu_ms": cpu * 1000 / done,
        "client_share": ours / (ours + cpu) if ours + cpu else float("nan"),
    }


# -- where a notesvc GET's time goes (--where) -----------------------------------------------


def wsgi_caller(app, path: str, headers: dict, method: str = "GET"):
    """Return call() -> status of one request to a WSGI app in this process."""
    env = {
        "REQUEST_METHOD": method,
        "PATH_INFO": path.encode("utf-8").decode("latin-1"),
        "SCRIPT_NAME": "",
        "QUERY_STRING": "",
        "SERVER_NAME": "127.0.0.1",
        "SERVER_PORT": "80",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "REMOTE_ADDR": "127.0.0.1",
        "HTTP_HOST": "127.0.0.1",
        "wsgi.url_scheme": "http",
        "wsgi.errors": sys.stderr,
        "wsgi.multithread": True,
        "wsgi.multiprocess": False,
        "wsgi.run_once": False,
        **{"HTTP_" + k.upper().replace("-", "_"): v for k, v in headers.items()},
    }
    import io

    def call() -> str:
        seen: list = []
        body = app({**env, "wsgi.input": io.BytesIO()}, lambda s, h, e=None: seen.append(s))
        b"".join(body)
        if hasattr(body, "close"):
            body.close()
        return seen[0]

    return call


def cpu_ms(calls: list, count: int) -> float:
    """This process's CPU ms a call, best of three blocks of `count` (the calls in turn)."""
    best = float("inf")
    for _ in range(3):
        began = time.process_time()
        for i in range(count):
            calls[i % len(calls)]()
        best = min(best, (time.process_time() - began) * 1000 / count)
    return best


def in_process(tree: dict, root: Path, count: int) -> dict:
    """A DAV GET, an API GET and an OPTIONS /dav/ through notesvc's WSGI app in this process
    (its own copy of the tree; default settings, the request log to a file as main() sets
    it up), and authentication alone; CPU ms each."""
    import logging

    sys.path.insert(0, str(HERE.parent))
    import notesvc

    shutil.copytree(tree["root"] / "notes", root / "notes")
    log_file = open(root.parent / "in-process.log", "w", encoding="utf-8")  # noqa: SIM115
    notesvc.BatchedLogHandler.installed = notesvc.BatchedLogHandler(log_file)
    logging.basicConfig(
        level=logging.INFO,
        format=notesvc.LOG_FORMAT,
        handlers=[notesvc.BatchedLogHandler.installed],
    )
    env = {**defaults_env(), "SERVICE_NOTES_ROOT": str(root)}
    app = notesvc.create_app(notesvc.load_config(env=env))
    try:
        svc = app.service
        key = svc.state.read()["apiKey"]
        basic = "Basic " + base64.b64encode(f"bench:{key}".encode()).decode()
        time.sleep(2.5)  # the files settled (ReadCache's racy rule) before anything is kept
        dav = [wsgi_caller(app, "/dav/" + p, {"Authorization": basic}) for p in tree["get"]]
        api = [wsgi_caller(app, "/api/v1/notes/" + p, {"X-Service-Key": key}) for p in tree["get"]]
        options = [wsgi_caller(app, "/dav/", {}, "OPTIONS")]
        for calls in (dav, api, options):
            assert {c() for c in calls} == {"200 OK"}, "in process: not 200"
        envs = [{"HTTP_AUTHORIZATION": basic, "REMOTE_ADDR": "127.0.0.1"}]
        auth = [lambda: notesvc.dav_authenticate(svc, dict(envs[0]))]
        api_env = {"HTTP_X_SERVICE_KEY": key, "REMOTE_ADDR": "127.0.0.1"}
        api_auth = [lambda: svc.authenticate(dict(api_env))]
        return {
            "dav": cpu_ms(dav, count),
            "api": cpu_ms(api, count),
            "options": cpu_ms(options, count),
            "dav_auth": cpu_ms(auth, count),
            "api_auth": cpu_ms(api_auth, count),
        }
    finally:
        app.service.close()
        logging.shutdown()


def where(server: Server, tree: dict, args) -> dict:
    """The server's CPU ms a request over HTTP (1 client: --rounds requests; 8 clients:
    --seconds) for a DAV GET, an API GET and OPTIONS /dav/; then in this process."""

    def api_get(client: int, i: int) -> tuple:
        path = pick(tree["get"], client, i)
        headers = {"X-Service-Key": server.key}
        return "GET", "/api/v1/notes/" + urllib.parse.quote(path, safe=""), None, headers

    def options(client: int, i: int) -> tuple:
        return "OPTIONS", "/dav/", None, {}

    makes = {"dav": dav_request(server, "get", tree), "api": api_get, "options": options}
    out: dict = {}
    for name, make in makes.items():
        conn, pid = server.connect(), server.proc.pid
        before = proc_figures(pid)["cpu_s"]
        count = max(args.rounds, 1000)
        for i in range(count):
            ask(conn, make(0, i))
        conn.close()
        one = (proc_figures(pid)["cpu_s"] - before) * 1000 / count
        load = under_load({"server": server, "row": "get", "make": make}, args.seconds)
        out[name] = {"one": one, "eight": load["cpu_ms"], "rate": load["rate"]}
    with tempfile.TemporaryDirectory() as tmp:
        out["in"] = in_process(tree, Path(tmp) / "root", max(args.rounds, 1000))
    return out


def print_where(w: dict) -> None:
    inside = w["in"]
    print(f"\nwhere a notesvc GET's time goes: CPU ms a request ({CLIENTS} clients: req/s too)")
    print(f"{'':38}{'WebDAV GET':>12}{'API GET':>12}{'OPTIONS /dav/':>15}")
    rows = (
        ("in process: Bottle + the app", inside["dav"], inside["api"], inside["options"]),
        ("  of which authentication", inside["dav_auth"], inside["api_auth"], None),
        ("over HTTP, 1 client", w["dav"]["one"], w["api"]["one"], w["options"]["one"]),
        (f"over HTTP, {CLIENTS} clients", *(w[k]["eight"] for k in ("dav", "api", "options"))),
        (f"  req/s, {CLIENTS} clients", *(w[k]["rate"] for k in ("dav", "api", "options"))),
    )
    for label, *cells in rows:
        shown = [
            "-" if c is None else f"{c:.0f}" if "req/s" in label else f"{c:.3f}" for c in cells
        ]
        print(f"{label:38}{shown[0]:>12}{shown[1]:>12}{shown[2]:>15}")
    print(
        "(over HTTP less in process: waitress, its parsing, the socket's system calls and the"
        " GIL handed among its threads; OPTIONS asks for no key and reads no file)"
    )


# -- the report -----------------------------------------------------------------------------


def figures(results: dict, name: str, row: str) -> tuple:
    """(p50, p99, req/s) of one server's row; NaNs where it was not measured."""
    r = results.get((name, row))
    if not r:
        return (float("nan"),) * 3
    return pct(r["seq"]["times"], 50), pct(r["seq"]["times"], 99), r["load"]["rate"]


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def run_header() -> list:
    """The commit, Python and the settings of the run, as lines."""
    repo = str(HERE.parent)
    git = ["git", "-C", repo]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    changed = subprocess.run(
        [*git, "status", "--porcelain", "--", "notesvc.py", "src", "bench"],
        capture_output=True,
        text=True,
    )
    dirty = " (with changes not committed)" if changed.stdout.strip() else ""
    taken = sorted(k for k in os.environ if k.startswith("SERVICE_"))
    versions = ", ".join(
        f"{m} {importlib.metadata.version(m)}"
        for m in ("bottle", "waitress", "wsgidav", "cheroot")
        if importlib.util.find_spec(m) is not None
    )
    python = sys.version.split()[0]
    return [
        f"commit {commit.stdout.strip() or '?'}{dirty}; Python {python}; {versions}",
        "notesvc: default settings (no SERVICE_* variable, no flag but --root/--host/--port;"
        " rescans every 5 s, log level info with its line a request to a file)"
        + (f"; taken out of the environment: {', '.join(taken)}" if taken else ""),
        f"WsgiDAV: {WSGIDAV_SETTINGS}",
        f"rclone: {RCLONE_SETTINGS}",
    ]


def print_table(results: dict, servers: list, tree: dict, args) -> None:
    names = [s.name for s in servers]
    print()
    for line in run_header():
        print(line)
    print(
        f"\n{tree['n']} notes of real text ({args.corpus}) in {FOLDERS} folders, and all of them"
        f" again in notes/big/; {args.rounds} sequential requests a row ({args.rounds // 4}"
        f" PROPFIND), then {CLIENTS} clients for {args.seconds:g} s"
    )
    print(f"(load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())})")
    head = "".join(f"{f'{s.name} {s.version}':>27}" for s in servers)
    print(f"\n{'':30}{head}")
    print(f"{'':30}" + f"{'p50':>9}{'p99':>8}{'req/s':>10}" * len(servers) + "   (ms)")
    rows = [row for row in ROWS if any((name, row) in results for name in names)]
    for row in rows:
        label, cells = ROWS[row][0], ""
        for name in names:
            if (name, row) in results:
                p50, p99, rate = figures(results, name, row)
                cells += f"{p50:9.2f}{p99:8.2f}{rate:10.0f}"
            else:
                cells += f"{'-':>9}{'-':>8}{'-':>10}"
        print(f"{label:30}{cells}")
    print(f"\nunder load ({CLIENTS} clients): p50 / p99 ms, the server's CPU ms a request")
    print(f"{'':30}" + f"{'p50':>9}{'p99':>8}{'CPU ms':>10}" * len(servers))
    for row in rows:
        label, cells = ROWS[row][0], ""
        for name in names:
            r = results.get((name, row))
            if r:
                load = r["load"]
                cells += (
                    f"{pct(load['times'], 50):9.2f}{pct(load['times'], 99):8.2f}"
                    f"{load['cpu_ms']:10.2f}"
                )
            else:
                cells += f"{'-':>9}{'-':>8}{'-':>10}"
        print(f"{label:30}{cells}")
    if len(tree["put"]) < CLIENTS:
        print(f"(only {len(tree['put'])} notes in notes/f01/: the {CLIENTS} clients share them)")
    shares = [r["load"]["client_share"] for r in results.values()]
    print(
        f"(the clients are Python threads on the same cores: this process took"
        f" {min(shares):.0%}-{max(shares):.0%} of the client + server CPU under load)"
    )


def print_ratios(results: dict, peers: list) -> None:
    print("\nratios, notesvc / peer (p50 and p99: below 1 is faster; req/s: above 1 is more)")
    for peer in peers:
        for row in ("propfind", "get", "put"):
            ours, theirs = figures(results, "notesvc", row), figures(results, peer, row)
            p50, p99, rate = (a / b for a, b in zip(ours, theirs))
            print(
                f"  / {peer:8} {ROWS[row][0]:30} p50 {p50:6.2f}  p99 {p99:6.2f}  req/s {rate:6.2f}"
            )


def print_verdicts(results: dict, peers: list) -> None:
    if "WsgiDAV" in peers:
        print("\ngoal: ahead of WsgiDAV on every row (lower p50, higher req/s)")
        for row in ("propfind", "get", "put"):
            ours, theirs = figures(results, "notesvc", row), figures(results, "WsgiDAV", row)
            ok = ours[0] < theirs[0] and ours[2] > theirs[2]
            print(f"  {ROWS[row][0]:30} {verdict(ok)}")
    if "rclone" in peers:
        print("goal: within 2x of rclone on PROPFIND and GET (p50 <= 2x, req/s >= 0.5x)")
        for row in ("propfind", "get"):
            ours, theirs = figures(results, "notesvc", row), figures(results, "rclone", row)
            ok = ours[0] <= 2 * theirs[0] and ours[2] >= theirs[2] / 2
            print(f"  {ROWS[row][0]:30} {verdict(ok)}")
    dav, api = figures(results, "notesvc", "put"), figures(results, "notesvc", "api_put")
    print(f"goal (issue 45): GET and PROPFIND at or above WsgiDAV's req/s ({CLIENTS} clients),")
    print("  PUT within 2x of the API's PUT (req/s at least half, p50 at most twice)")
    if "WsgiDAV" in peers:
        for row in ("propfind", "get"):
            ours, theirs = figures(results, "notesvc", row), figures(results, "WsgiDAV", row)
            print(
                f"  {ROWS[row][0]:30} {ours[2] / theirs[2]:5.2f}x  {verdict(ours[2] >= theirs[2])}"
            )
    ok = dav[2] >= api[2] / 2 and dav[0] <= 2 * api[0]
    print(f"  {ROWS['put'][0]:30} {dav[2] / api[2]:5.2f}x  {verdict(ok)}")
    print(
        f"PUT's price (history and fsync), reported: WebDAV PUT p50 {dav[0]:.2f} ms,"
        f" {dav[0] / api[0]:.2f}x the API's PUT ({api[0]:.2f} ms); req/s {dav[2]:.0f}"
        f" against {api[2]:.0f} ({dav[2] / api[2]:.2f}x)"
    )


def report(results: dict, servers: list, memory: dict, tree: dict, args, spent=None) -> None:
    print_table(results, servers, tree, args)
    if spent:
        print_where(spent)
    names = [s.name for s in servers]
    peers = [n for n in names if n != "notesvc"]
    if "notesvc" in names:
        if peers:
            print_ratios(results, peers)
        print_verdicts(results, peers)
    else:
        print("\nnotesvc not run (--only peers): no ratios, no verdicts")
    print("\nRssAnon after the run: " + ", ".join(f"{n} {mb} MB" for n, mb in memory.items()))
    if peers:
        print(
            "every server checks Basic auth on every request; notesvc (info) and WsgiDAV"
            " (verbosity 3) write a line a request to a file, rclone (NOTICE) none"
        )
    errors = {k: r["seq"]["errors"] + r["load"]["errors"] for k, r in results.items()}
    print(f"errors: {sum(sum(c.values()) for c in errors.values())}")
    for (name, row), counts in errors.items():
        if counts:
            what = ", ".join(f"{n} x {status}" for status, n in counts.most_common())
            print(f"  {name} {ROWS[row][0]}: {what}")


# -- the run --------------------------------------------------------------------------------


def start_servers(root: Path, only: str) -> list:
    """Start the servers `only` names, each over its own copy of notes/; return them."""
    servers = []
    try:
        if only in ("all", "notesvc"):
            servers.append(start_notesvc(root))
        for name, starter in (("WsgiDAV", start_wsgidav), ("rclone", start_rclone)):
            if only in ("all", "peers"):
                folder = root.parent / name
                shutil.copytree(root / "notes", folder / "notes")
                servers.append(starter(folder))
    except BaseException:
        for s in servers:
            stop(s)
        raise
    return servers


def targets_of(servers: list, tree: dict) -> list:
    out = []
    for s in servers:
        for row in ("propfind", "get", "put"):
            out.append({"server": s, "row": row, "make": dav_request(s, row, tree)})
        if s.name == "notesvc":
            out.append({"server": s, "row": "api_put", "make": api_put_request(s, tree)})
    return out


def measure(servers: list, tree: dict, args) -> tuple:
    """Check and warm up every server, then run the rows; return results and RssAnon."""
    for s in servers:
        if s.name == "notesvc":
            settle_notesvc(s)
        wrong = check(s, tree)
        if wrong:
            hint = " (no /dav/ yet? try --only peers)" if s.name == "notesvc" else ""
            raise SystemExit(f"{s.name} answered wrong{hint}:\n  " + "\n  ".join(wrong))
    targets = targets_of(servers, tree)
    results: dict = {}
    for phase in PHASES:
        ts = [t for t in targets if t["row"] in phase]
        count = args.rounds // 4 if phase == ("propfind",) else args.rounds
        for key, seq in sequential(ts, count).items():
            results[key] = {"seq": seq}
        for t in ts:
            results[(t["server"].name, t["row"])]["load"] = under_load(t, args.seconds)
    memory = {s.name: proc_figures(s.proc.pid)["rss_mb"] for s in servers}
    return results, memory


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--notes", type=int, default=1000, help="notes in the tree, and in big/")
    ap.add_argument("--corpus", type=Path, default=Path("~/corpus/1k").expanduser())
    ap.add_argument("--seconds", type=float, default=5, help="each row under load, a server")
    ap.add_argument("--rounds", type=int, default=200, help="sequential requests a row")
    ap.add_argument("--only", choices=("all", "peers", "notesvc"), default="all")
    ap.add_argument("--where", action="store_true", help="where a notesvc GET's time goes")
    args = ap.parse_args()
    notes = corpus_notes(args.corpus, args.notes)
    spent = None
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "notesvc"
        tree = seed_tree(root, notes)
        servers = start_servers(root, args.only)
        try:
            results, memory = measure(servers, tree, args)
            ours = [s for s in servers if s.name == "notesvc"]
            if args.where and ours:
                for s in servers:
                    if s.name != "notesvc":
                        stop(s)  # idle, but out of the way
                spent = where(ours[0], tree, args)
        finally:
            for s in servers:
                stop(s)
    report(results, servers, memory, tree, args, spent)


if __name__ == "__main__":
    main()
