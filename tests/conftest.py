"""What every test file shares: the app fixtures, `Server` (a real notesvc.py on
loopback), `assert_error`, `wait_for`, and the small helpers of several rooms.

Larger stand-ins live in standins.py, browsers.py and search_reference.py, loaded as
plugins below so that their fixtures are every file's too.
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import hashlib
import http.client
import http.server
import io
import json
import os
import re
import secrets
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import webtest

HERE = Path(__file__).resolve().parent.parent  # the checkout: src/, web/, notesvc.py, docs/
NOTESVC = str(HERE / "notesvc.py")
# Which notesvc the in-process tests run: by default the package, the modules in
# src/notesvc/ as they are now (no build needed); with NOTESVC_FORM=artifact the shipped
# file notesvc.py, imported by its path whatever else is installed. The tests that start
# real processes always run notesvc.py, as people do (`python .ci/build.py` first).
FORM = os.environ.get("NOTESVC_FORM", "package")
if FORM == "package":
    sys.path.insert(0, str(HERE / "src"))
    import notesvc
else:
    import importlib.util as _util

    _spec = _util.spec_from_file_location("notesvc", NOTESVC)
    notesvc = sys.modules["notesvc"] = _util.module_from_spec(_spec)
    _spec.loader.exec_module(notesvc)
assert notesvc.__file__ == str(
    HERE / ("src/notesvc/__init__.py" if FORM == "package" else "notesvc.py")
)


def patch_global(monkeypatch, name: str, value) -> None:
    """Set a module-level name of notesvc for one test, in every module that holds it (the
    one file, or each module of the package that defines or imports it)."""
    old = getattr(notesvc, name)
    for mod_name, module in list(sys.modules.items()):
        if mod_name.split(".")[0] == "notesvc" and getattr(module, name, None) is old:
            monkeypatch.setattr(module, name, value)


API = "/api/v1"


# Outbound channel calls go nowhere unless a test points them at a stand-in: a closed
# loopback port (a channel's poller then only retries, and never leaves this machine).
NOWHERE = "http://127.0.0.1:1"


def make_env(root: Path, **env: str) -> dict:
    base = {
        "SERVICE_NOTES_ROOT": str(root),
        "SERVICE_RESCAN_SECONDS": "0",
        "SERVICE_TELEGRAM_API_BASE": NOWHERE,
        "SERVICE_WHATSAPP_API_BASE": NOWHERE,
        "SERVICE_IMPORT_MIN_FREE_BYTES": "0",  # imports need no margin on a test's disk
        # who may set up: loopback and home networks, never `auto` (this machine's own
        # address would decide)
        "SERVICE_SETUP_LOCAL_ONLY": "false",
    }
    base.update(env)
    return base


@pytest.fixture
def root(tmp_path):
    return tmp_path / "root"


@pytest.fixture
def make_app(root):
    """Build a TestApp over create_app() for a root and SERVICE_* overrides.

    Every app built is closed (its Service stopped) when the test ends.
    """
    built = []

    def make(app_root: Path | None = None, **env: str) -> webtest.TestApp:
        cfg = notesvc.load_config(env=make_env(app_root or root, **env))
        wsgi = notesvc.create_app(cfg)
        built.append(wsgi)
        wsgi.test_key = wsgi.service.state.read().get("apiKey")  # gone from state after link
        return webtest.TestApp(wsgi)

    yield make
    for wsgi in built:
        wsgi.service.close()


@pytest.fixture
def anon(make_app):
    return make_app()


LOCAL = {"REMOTE_ADDR": "127.0.0.1"}  # a client on this machine (WebTest sets no peer)


KEY = "X-Service-Key"


def key_of(app: webtest.TestApp) -> str:
    return app.app.service.state.read().get("apiKey") or app.app.test_key


def with_key(app: webtest.TestApp, key: str | None = None) -> webtest.TestApp:
    key = key if key is not None else key_of(app)
    return webtest.TestApp(app.app, extra_environ={"HTTP_X_SERVICE_KEY": key})


@pytest.fixture
def client(anon):
    return with_key(anon)


def assert_error(resp, status: int, code: str) -> dict:
    assert resp.status_int == status
    assert resp.content_type == "application/json"
    body = resp.json
    assert body["success"] is False
    assert body["error"]["code"] == code
    assert isinstance(body["error"]["message"], str)
    assert body["error"]["message"]
    assert "Traceback" not in resp.text
    return body["error"]


def data(resp) -> dict:
    assert resp.json["success"] is True
    return resp.json["data"]


RUNNING_TEST: list = [None]  # the test being run (its markers are checked below)


@pytest.fixture(autouse=True)
def _the_running_test(request):
    RUNNING_TEST[0] = request.node
    yield
    RUNNING_TEST[0] = None


def must_be_marked(marker: str) -> None:
    """Fail a test that starts a real process (or a browser) without saying so: the fast
    loop (`-m "not slow"`) must hold none of them."""
    node = RUNNING_TEST[0]
    if node is not None:
        assert node.get_closest_marker(marker), f"{node.nodeid} needs @pytest.mark.{marker}"
        assert node.get_closest_marker("slow"), f"{node.nodeid} needs @pytest.mark.slow"


class Server:
    """A real `python notesvc.py` process on a free loopback port."""

    def __init__(
        self,
        root: Path,
        *args: str,
        env: dict | None = None,
        port: int = 0,
        program: tuple = (NOTESVC,),
        cwd: Path | None = None,
        host: str = "127.0.0.1",  # 0.0.0.0: also on this machine's network (as phones need)
    ):
        must_be_marked("real_server")
        cmd = [sys.executable, *program, *args, "--host", host, "--port", str(port)]
        cmd += [] if args[:1] == ("relay",) else ["--root", str(root)]  # a relay has no root
        full_env = {
            **os.environ,
            "SERVICE_RESCAN_SECONDS": "0",
            "SERVICE_SETUP_LOCAL_ONLY": "false",  # never `auto`: see make_env
            **(env or {}),
        }
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=full_env,
            cwd=cwd,
        )
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.port = 0
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        if not self.ready.wait(20):
            self.stop()
            raise RuntimeError("server did not start:\n" + "".join(self.lines))
        self.url = f"http://127.0.0.1:{self.port}"

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            if m:
                self.port = int(m.group(1))
                self.ready.set()
        self.ready.set()

    def request(self, method: str, path: str, body=None, headers: dict | None = None):
        """Return (status, headers, parsed JSON body) for one HTTP request."""
        payload = json.dumps(body).encode() if body is not None else None
        hdrs = {"Content-Type": "application/json"} if payload is not None else {}
        hdrs.update(headers or {})
        req = urllib.request.Request(self.url + path, payload, hdrs, method=method)
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, resp.headers, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, e.headers, json.loads(e.read() or b"null")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.reader.join(5)
        self.proc.stderr.close()


@contextlib.contextmanager
def running(root: Path, *args: str, env: dict | None = None, port: int = 0, **how):
    server = Server(root, *args, env=env, port=port, **how)
    try:
        yield server
    finally:
        server.stop()


def note_url(path: str) -> str:
    return f"{API}/notes/" + urllib.parse.quote(path, safe="")


def put_note(client, path: str, content: str = "text"):
    return client.post_json(f"{API}/notes", {"path": path, "content": content}, status=201)


def search(client, q: str, status: int = 200, **params) -> dict:
    resp = client.get(f"{API}/search", {"q": q, **params}, status=status)
    return resp.json["data"] if status == 200 else resp


def wait_for(predicate, timeout: float = 15.0, step: float = 0.05):
    """Return predicate()'s first true value, asked every `step` seconds; fail after
    `timeout` (a wait on the thing itself, never a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise AssertionError("condition not met in time")


def _boom(svc):
    raise RuntimeError("secret internals /etc/passwd")


def ids(report) -> set:
    return {f["id"] for f in report["findings"]}


HOSTILE_PATHS = [
    ("../etc/passwd.md", "start with notes/"),
    ("notes/../../etc/passwd.md", "'..'"),
    ("notes/a/../../x.md", "'..'"),
    ("notes/./x.md", "'.'"),
    ("/etc/passwd.md", "relative"),
    ("/notes/x.md", "relative"),
    ("notes\\..\\x.md", "backslash"),
    ("notes/a\\b.md", "backslash"),
    ("notes/x\x00.md", "control"),
    ("notes/x\n.md", "control"),
    ("notes/.hidden.md", "hidden"),
    ("notes/.git/config.md", "hidden"),
    ("notes/.md", "hidden"),
    ("notes//x.md", "empty segment"),
    ("notes/x.txt", ".md"),
    ("notes", ".md"),
    ("notes/", "empty segment"),
    ("other/x.md", "start with notes/"),
    ("x.md", "start with notes/"),
    ("notes/a:b.md", "forbidden"),
    ("notes/a*b.md", "forbidden"),
    ("notes/a?b.md", "forbidden"),
    ('notes/a"b.md', "forbidden"),
    ("notes/a<b>.md", "forbidden"),
    ("notes/a|b.md", "forbidden"),
    ("notes/" + "x" * 256 + ".md", "255 bytes"),
    ("notes/" + "é" * 130 + ".md", "255 bytes"),
    ("notes/" + "/".join(["abcdefgh"] * 60) + ".md", "512"),
    ("", "empty"),
    ("notes/invoice\u202egpj.md", "bidi"),
    ("notes/a\u202ab.md", "bidi"),
    ("notes/\u2066x\u2069.md", "bidi"),
    ("notes/a\u200bb.md", "zero-width"),
    ("notes/a\u200d/b.md", "zero-width"),
    ("notes/x\u2060.md", "zero-width"),
    ("notes/\ufeffx.md", "zero-width"),
]


MiB = 1024 * 1024


def leftovers(root: Path) -> list:
    """Return temp files under the attachments and the notes (the state folder's index
    cache has its own, written in the background)."""
    return [
        p
        for top in (root / "attachments", root / "notes")
        for p in top.rglob("*")
        if p.name.startswith(".tmp-")
    ]


PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8  # 2056 bytes, every byte value


def att_url(path: str) -> str:
    return f"{API}/attachments/{urllib.parse.quote(path, safe='')}"


def multipart(*parts: tuple, boundary: str = "b0undary-1234") -> tuple:
    """Return (body, content type) of a form: parts are (name, value[, filename[, type]])."""
    out = b""
    for part in parts:
        name, value = part[0], part[1]
        value = value if isinstance(value, bytes) else value.encode()
        head = f'Content-Disposition: form-data; name="{name}"'
        if len(part) > 2:
            ctype = part[3] if len(part) > 3 else "application/octet-stream"
            head += f'; filename="{part[2]}"\r\nContent-Type: {ctype}'
        out += f"--{boundary}\r\n{head}\r\n\r\n".encode() + value + b"\r\n"
    out += f"--{boundary}--\r\n".encode()
    return out, f"multipart/form-data; boundary={boundary}"


def post_form(client, body: bytes, ctype: str, status: int = 201):
    """POST a form as it is (WebTest's post() would encode a multipart body again)."""
    return client.request(
        f"{API}/attachments",
        method="POST",
        body=body,
        headers={"Content-Type": ctype},
        status=status,
    )


def upload(client, path: str, data: bytes = PNG, status: int = 201, **headers):
    return client.put(
        att_url(path),
        data,
        headers={"Content-Type": "application/octet-stream", **headers},
        status=status,
    )


def raw_http(port: int, request: bytes, timeout: float = 5.0) -> tuple:
    """Send raw bytes; return (status, headers as a lower-cased dict, body bytes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(
            (k.strip().lower(), v.strip()) for k, v in (h.split(":", 1) for h in lines[1:])
        )
        while len(body) < int(headers.get("content-length", 0)):
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
    return int(lines[0].split()[1]), headers, body


def make_state(root: Path) -> dict:
    """Give root a notesvc state (state.json only, as a first start leaves it); return it."""
    return notesvc.StateStore(root / ".notesvc").read()


def tmp_path_factory_root(root: Path) -> Path:
    """Return a fresh notes root beside `root` (another app in the same test)."""
    other = root.parent / f"other-{len(list(root.parent.glob('other-*')))}"
    return other


def versions_of(client, path: str, status: int = 200, **params) -> dict:
    query = f"?{urllib.parse.urlencode(params)}" if params else ""
    return data(client.get(note_url(path) + "/versions" + query, status=status))


def versions_of_raw(client, path: str, status: int):
    return client.get(note_url(path) + "/versions", status=status)


def version_contents(client, path: str) -> list:
    """Return the contents of a note's versions, newest first."""
    found = versions_of(client, path)["versions"]
    return [data(client.get(f"{note_url(path)}/versions/{v['id']}"))["content"] for v in found]


def feed(client, since: int = 0, **params) -> dict:
    query = urllib.parse.urlencode({"since": since, **params})
    return data(client.get(f"{API}/changes?{query}"))


def update(client, path: str, content: str, **kwargs):
    return client.put_json(note_url(path), {"content": content}, **kwargs)


def web_channel(client) -> dict:
    return data(client.post_json(f"{API}/channels", {"provider": "web", "config": {}}, status=201))


def save_by_channel(client, channel: dict, text: str) -> dict:
    anon = webtest.TestApp(client.app)
    headers = {"X-Service-Channel-Secret": channel["secret"]}
    return data(anon.post_json(f"{API}/channels/webhook/web", web_update(text), headers=headers))


def web_update(text, sender="page"):
    return {"text": text, "sender": sender} if text is not None else {"sender": sender}


def trash_items(client) -> list:
    return data(client.get(f"{API}/trash"))["items"]


def relay_servers(relay: Server) -> int:
    try:
        return relay.request("GET", "/health")[2]["data"]["servers"]
    except OSError:
        return 0


def hits(client, q: str, **params) -> list:
    return [r["path"] for r in search(client, q, **params)["results"]]


def sample_url(route: notesvc.Route | str) -> str:
    """Return a concrete URL for a route rule (placeholders filled)."""
    rule = route if isinstance(route, str) else route.rule
    url = re.sub(r"<path(?::path)?>", "notes%2Fx.md", rule)
    return re.sub(r"<(\w+)(?::[^>]*)?>", "x", url)


def run_cli(*args: str, env: dict | None = None, timeout: float = 30):
    must_be_marked("real_server")
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SERVICE_")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, NOTESVC, *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
    )


def route_id(route: notesvc.Route) -> str:
    return f"{route.method} {route.rule}"


JWT_SECRET = "k3y-" + "Zq8vN2xR7mL4pT9wB5cJ1hF6dG0sY3aE"


def new_grant(client, scope: str = "read", folder: str | None = None, **extra) -> dict:
    """Create a scoped key with the API key; return its record (with the key)."""
    body = {"name": f"{scope} key", "scope": scope, **extra}  # extra may name it
    if folder is not None:
        body["folder"] = folder
    return data(client.post_json(f"{API}/auth/keys", body, status=201))


def as_key(app: webtest.TestApp, key: str, **environ: str) -> webtest.TestApp:
    return webtest.TestApp(app.app, extra_environ={"HTTP_X_SERVICE_KEY": key, **environ})


def with_status(resp, status):
    """Return resp once its status is `status` (an int, a list of them, "*" or None: any).
    For requests made with expect_errors=True, with which WebTest checks no status."""
    if status not in (None, "*"):
        wanted = status if isinstance(status, (list, tuple)) else [status]
        assert resp.status_int in wanted, (resp.request.path, resp.status, resp.text[:500])
    return resp


def rpc(client, method: str, params: dict | None = None, status: int | str = 200, **headers):
    """POST one JSON-RPC request (handshake era) to /mcp; return the parsed answer."""
    body: dict = {"jsonrpc": "2.0", "id": 1, "method": method}
    if params is not None:
        body["params"] = params
    resp = client.post(
        f"{API}/mcp",
        json.dumps(body),
        headers={"Content-Type": "application/json", **headers},
        expect_errors=True,
    )
    return with_status(resp, status).json if resp.body else None


def listed_tools(client) -> set:
    return {t["name"] for t in rpc(client, "tools/list")["result"]["tools"]}


FOLDER_NOTES = {
    "notes/family/a.md": "# Apple pie\n\nGrandma's apple pie #common, see [[c]].\n"
    "⏰ 2099-01-01 09:00 bake\n",
    "notes/family/sub/b.md": "# Birthdays\n\napple birthday list #common\n",
    "notes/work/c.md": "# Contract\n\nsecret apple contract #common #work, see [[a]].\n"
    "⏰ 2099-01-01 10:00 sign\n",
    "notes/familyx/d.md": "# Neighbour\n\napple neighbour folder, not the family #common\n",
    "notes/top.md": "# Top\n\napple at the top #common\n",
}


def paths_in(answer) -> set:
    """Every note or attachment path mentioned anywhere in an answer (keys, values, text)."""
    text = json.dumps(answer, ensure_ascii=False)
    return set(re.findall(r"(?:notes/[\w./-]+?\.md|attachments/[\w./-]+?\.png)", text))


def inside_family(path: str) -> bool:
    return path.startswith(("notes/family/", "attachments/family/"))


def pair(client, status: int = 201, **body) -> dict:
    """Make a pairing with the API key; return its answer."""
    resp = client.post_json(
        f"{API}/auth/devices/pairings", {"scope": "write", **body}, status=status
    )
    return resp.json["data"] if status == 201 else resp


def claim(anon, secret: str, status: int = 201, name: str = "Pixel", **environ) -> dict:
    resp = anon.post_json(
        f"{API}/auth/devices/claim",
        {"secret": secret, "deviceName": name},
        status=status,
        extra_environ=environ or None,
    )
    return resp.json["data"] if status == 201 else resp


def pkce_pair() -> tuple:
    verifier = secrets.token_urlsafe(48)
    digest = hashlib.sha256(verifier.encode()).digest()
    return verifier, base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


CALLBACK = "http://127.0.0.1:9/callback"


def register_client(anon, uris=(CALLBACK,), addr: str = "198.51.100.1", **extra) -> dict:
    app = webtest.TestApp(anon.app, extra_environ={"REMOTE_ADDR": addr})
    body = {"redirect_uris": list(uris), "client_name": "Pocket assistant", **extra}
    return app.post_json("/oauth/register", body, status=201).json


def mcp_url(anon) -> str:
    return anon.get("/.well-known/oauth-protected-resource").json["resource"]


def approve(client, cid: str, scope="notes:read", folder=None, redirect=CALLBACK, state="st8"):
    """Approve as the owner; return (code, verifier, redirect query)."""
    verifier, challenge = pkce_pair()
    body = {
        "clientId": cid,
        "redirectUri": redirect,
        "state": state,
        "codeChallenge": challenge,
        "scope": scope,
        "resource": mcp_url(client),
    }
    if folder:
        body["folder"] = folder
    target = data(client.post_json(f"{API}/oauth/approve", body))["redirect"]
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(target).query)
    return query["code"][0], verifier, query


def token_call(anon, status="*", **form):
    return anon.post("/oauth/token", form, status=status)


def tokens_for(client, anon, scope="notes:read", folder=None) -> tuple:
    """Register, approve and redeem; return (client id, token answer)."""
    cid = register_client(anon)["client_id"]
    code, verifier, _ = approve(client, cid, scope, folder)
    answer = token_call(
        anon,
        200,
        grant_type="authorization_code",
        code=code,
        client_id=cid,
        redirect_uri=CALLBACK,
        code_verifier=verifier,
        resource=mcp_url(anon),
    ).json
    return cid, answer


def oauth_error(resp, status: int, error: str) -> str:
    assert resp.status_int == status, resp.text
    assert resp.content_type == "application/json"
    assert resp.headers["Cache-Control"] == "no-store"
    assert resp.json["error"] == error, resp.json
    return resp.json["error_description"]


def owner_headers(setup: dict) -> dict:
    return {"X-Service-Key": setup["apiKey"]}


def audit(app) -> dict:
    return data(with_key(app).get(f"{API}/security/audit"))


def call_tool(client, name: str, **arguments) -> dict:
    """Return the result of tools/call through /mcp."""
    answer = rpc(client, "tools/call", {"name": name, "arguments": arguments})
    assert "error" not in answer, answer
    result = answer["result"]
    assert isinstance(result["structuredContent"], dict)
    assert [c["type"] for c in result["content"]] == ["text"]
    return result


def ok_tool(client, name: str, **arguments) -> dict:
    result = call_tool(client, name, **arguments)
    assert result["isError"] is False, result
    return result["structuredContent"]


def tool_refused(client, name: str, code: str, **arguments) -> str:
    """Assert a tool call ends in an isError result with this code; return its message."""
    result = call_tool(client, name, **arguments)
    assert result["isError"] is True, result
    error = result["structuredContent"]["error"]
    assert error["code"] == code, error
    assert result["content"][0]["text"] == f"Error ({code}): {error['message']}"
    assert "Traceback" not in json.dumps(result)
    return error["message"]


HELLO_PLUGIN = """
import notesvc

SAVED = []

def remember(svc, path, content):
    SAVED.append(path)

def hello(svc):
    return {"hello": "world", "saved": SAVED}

PLUGIN = notesvc.Plugin(
    name="hello", version="0.1.0", description="says hello",
    hooks={"note_saved": remember},
    routes=(notesvc.PluginRoute("GET", "/greeting", hello),),
)
"""


def recv_all(s: socket.socket) -> bytes:
    """Read until the peer closes (or 5 s pass); b'' when it closed at once."""
    chunks = []
    with contextlib.suppress(socket.timeout, ConnectionResetError):
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks)


def relay_raw_get(relay: Server, path: str) -> tuple:
    """GET on a raw socket; return (head as text, body bytes) exactly as the relay sent them."""
    with socket.create_connection(("127.0.0.1", relay.port), timeout=10) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n".encode())
        raw = recv_all(s)
    head, _, body = raw.partition(b"\r\n\r\n")
    return head.decode("latin-1"), body


# The accessibility check: every visible control has a name, and every visible text meets
# WCAG AA contrast against the background it is drawn on (alpha composited up the tree).
A11Y_AUDIT = r"""() => {
  const problems = [];
  const shown = (e) => {
    const r = e.getBoundingClientRect(), s = getComputedStyle(e);
    return r.width > 0 && r.height > 0 && s.visibility !== "hidden" && s.display !== "none";
  };
  const nameOf = (e) => {
    const label = (e.getAttribute("aria-label") || "").trim();
    if (label) return label;
    const by = e.getAttribute("aria-labelledby");
    const text = (els) => els.map((l) => l.textContent).join(" ").trim();
    if (by) return text(by.split(" ").map((id) => document.getElementById(id)));
    if (e.labels && e.labels.length) return text([...e.labels]);
    if (/^(BUTTON|SUMMARY|A)$/.test(e.tagName)) return e.textContent.trim();
    return (e.getAttribute("title") || "").trim();
  };
  for (const e of document.querySelectorAll("button, input, textarea, select, summary, a[href]")) {
    if (shown(e) && !nameOf(e)) problems.push("no accessible name: " + e.outerHTML.slice(0, 90));
  }
  const rgba = (c) => {
    const m = /rgba?\(([^)]+)\)/.exec(c);
    if (!m) return [0, 0, 0, 0];
    const p = m[1].split(/[ ,\/]+/).filter(Boolean).map(parseFloat);
    return [p[0], p[1], p[2], p.length > 3 ? p[3] : 1];
  };
  const lum = (c) => {
    const f = (v) => {
      v /= 255;
      return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4);
    };
    return 0.2126 * f(c[0]) + 0.7152 * f(c[1]) + 0.0722 * f(c[2]);
  };
  const over = (top, under) => [0, 1, 2].map((i) => top[i] * top[3] + under[i] * (1 - top[3]));
  const backdrop = (e) => {
    const layers = [];
    for (let n = e; n; n = n.parentElement) {
      const c = rgba(getComputedStyle(n).backgroundColor);
      if (c[3] > 0) { layers.push(c); if (c[3] >= 1) break; }
    }
    let bg = matchMedia("(prefers-color-scheme: dark)").matches ? [0, 0, 0] : [255, 255, 255];
    for (const c of layers.reverse()) bg = over(c, bg);
    return bg;
  };
  const ratio = (a, b) => {
    const x = lum(a), y = lum(b);
    return (Math.max(x, y) + 0.05) / (Math.min(x, y) + 0.05);
  };
  const check = (e, color, what) => {
    const s = getComputedStyle(e);
    const bg = backdrop(e);
    const r = ratio(over(rgba(color), bg), bg);
    const size = parseFloat(s.fontSize), bold = parseInt(s.fontWeight, 10) >= 700;
    const need = size >= 24 || (bold && size >= 18.66) ? 3 : 4.5;
    if (r < need) problems.push(what + " contrast " + r.toFixed(2) + " < " + need + ": " +
      (e.id ? "#" + e.id + " " : "") +
      JSON.stringify((e.textContent || e.placeholder).trim().slice(0, 40)));
  };
  const walk = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  const seen = new Set();
  while (walk.nextNode()) {
    const e = walk.currentNode.parentElement;
    if (!walk.currentNode.textContent.trim() || seen.has(e) || !shown(e)) continue;
    if (e.closest(":disabled, [aria-hidden=true], svg")) continue;  // WCAG exempts disabled ones
    seen.add(e);
    check(e, getComputedStyle(e).color, "text");
  }
  for (const e of document.querySelectorAll("input[placeholder], textarea[placeholder]")) {
    if (!shown(e) || e.value || e.disabled) continue;
    check(e, getComputedStyle(e, "::placeholder").color, "placeholder");
  }
  return problems;
}"""


class EvilRelay:
    """A loopback stand-in for a hostile relay: records every request, answers any pairing
    with an API base of its own, and allows any origin (so only the page can refuse it)."""

    def __init__(self):
        self.requests: list = []
        evil = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def answer(self):
                evil.requests.append((self.command, self.path, dict(self.headers)))
                body = json.dumps(
                    {
                        "success": True,
                        "data": {
                            "serverId": "evil",
                            "relayApiBase": f"{evil.url}/r/evil/api/v1",
                            "valid": True,
                            "setupComplete": True,
                        },
                    }
                ).encode()
                self.send_response(200)
                self.send_header("Access-Control-Allow-Origin", "*")
                self.send_header("Access-Control-Allow-Headers", "*")
                self.send_header("Access-Control-Allow-Methods", "*")
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = answer

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        ).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


DOMAIN = "relay.test"


@pytest.fixture
def origins(tmp_path):
    """A relay with per-server origins (SERVICE_RELAY_DOMAIN=relay.test) and a real server
    paired with it; yields (relay, server, setup, the server's origin)."""
    env = {"SERVICE_RELAY_DOMAIN": DOMAIN, "SERVICE_RELAY_TIMEOUT": "5"}
    relay = Server(tmp_path / "relay", "relay", env=env)
    server = Server(tmp_path / "srv", env={"SERVICE_RELAY_URL": relay.url})
    try:
        wait_for(lambda: relay_servers(relay) == 1)
        origin = f"http://{server_id_of(server)}.{DOMAIN}:{relay.port}"
        setup = wait_for(lambda: _setup_on(server, origin))
        yield relay, server, setup, origin
    finally:
        server.stop()
        relay.stop()


def server_id_of(server: Server) -> str:
    return server.request("GET", f"{API}/system/setup")[2]["data"]["serverId"]


def _setup_on(server: Server, origin: str):
    """The setup payload once the server has learnt its origin on the relay (else None)."""
    setup = server.request("GET", f"{API}/system/setup")[2]["data"]
    return setup if setup["links"]["relayApiBase"] == f"{origin}{API}" else None


def post_oauth_form(url: str, form: dict) -> tuple:
    """POST a form; return (status, parsed JSON)."""
    body = urllib.parse.urlencode(form).encode()
    req = urllib.request.Request(url, body, {"Content-Type": "application/x-www-form-urlencoded"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        with e:
            return e.code, json.loads(e.read() or b"null")


def raw_answer(server: Server, method: str, path: str, headers=None, body=None) -> tuple:
    """Return (status, headers, bytes exactly as sent) of one request: nothing decoded."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        payload = json.dumps(body).encode() if body is not None else None
        hdrs = {**({"Content-Type": "application/json"} if payload else {}), **(headers or {})}
        conn.request(method, path, payload, hdrs)
        resp = conn.getresponse()
        return resp.status, resp.headers, resp.read()
    finally:
        conn.close()


def assert_gzipped(headers, body: bytes) -> bytes:
    """Assert an answer went gzipped, with its length and Vary; return its decoded bytes."""
    assert headers["Content-Encoding"] == "gzip"
    assert "accept-encoding" in headers["Vary"].lower()
    assert int(headers["Content-Length"]) == len(body)
    return gzip.decompress(body)


def timed_health(port: int) -> tuple:
    """Return (status, seconds) of one fresh GET /api/v1/health."""
    started = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", f"{API}/health")
        status = conn.getresponse().status
    finally:
        conn.close()
    return status, time.monotonic() - started


# -- WebDAV (docs/api.md: WebDAV) ------------------------------------------------------------------

PROPFIND_BODY = (
    b'<?xml version="1.0"?><d:propfind xmlns:d="DAV:"><d:prop><d:resourcetype/>'
    b"<d:getcontentlength/><d:getetag/><d:getlastmodified/></d:prop></d:propfind>"
)


def basic(key: str) -> str:
    return "Basic " + base64.b64encode(f"anyone:{key}".encode()).decode()


class Dav:
    """WebDAV requests to an app over WebTest, with a key as Basic auth's password."""

    def __init__(self, app: webtest.TestApp, key: str):
        # (WebTest's lint knows only HTTP's own methods)
        self.app, self.auth = webtest.TestApp(app.app, lint=False), basic(key)

    def __call__(self, method: str, path: str, body: bytes = b"", status=None, **headers):
        headers = {
            "Authorization": self.auth,
            **{k.replace("_", "-"): v for k, v in headers.items()},
        }
        resp = self.app.request(
            "/dav/" + urllib.parse.quote(path),
            method=method,
            body=body,
            headers=headers,
            expect_errors=True,  # (which makes WebTest skip its own check of `status`)
        )
        return with_status(resp, status)

    def hrefs(self, path: str) -> list:
        resp = self("PROPFIND", path, PROPFIND_BODY, status=207, Depth="1")
        return [urllib.parse.unquote(h) for h in re.findall(r"<D:href>([^<]*)</D:href>", resp.text)]


@pytest.fixture
def dav(client):
    return Dav(client, key_of(client))


QUERY_TODOS = (
    '<c:calendar-query xmlns:d="DAV:" xmlns:c="urn:ietf:params:xml:ns:caldav">'
    "<d:prop><d:getetag/><c:calendar-data/></d:prop><c:filter>"
    '<c:comp-filter name="VCALENDAR"><c:comp-filter name="VTODO">{}</c:comp-filter>'
    "</c:comp-filter></c:filter></c:calendar-query>"
)


# -- import and export (docs/api.md: Import) -------------------------------------------------------

TINY_PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)


def zip_of(files: dict, symlinks: dict | None = None) -> bytes:
    """A zip of {name: bytes or str}; symlinks {name: target} as Info-ZIP stores them."""
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, body in files.items():
            zf.writestr(name, body.encode() if isinstance(body, str) else body)
        for name, target in (symlinks or {}).items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            zf.writestr(info, target)
    return buf.getvalue()


def tar_of(files: dict, symlinks: dict | None = None) -> bytes:
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, body in files.items():
            raw = body.encode() if isinstance(body, str) else body
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(raw), 1700000000
            tf.addfile(info, io.BytesIO(raw))
        for name, target in (symlinks or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tf.addfile(info)
    return buf.getvalue()


def keep_json(**fields) -> str:
    """One note as Google Takeout writes Keep notes (Takeout/Keep/<title>.json)."""
    note = {
        "color": "DEFAULT",
        "isTrashed": False,
        "isPinned": False,
        "isArchived": False,
        "title": "",
        "userEditedTimestampUsec": 1700000000000000,
        "createdTimestampUsec": 1690000000000000,
    }
    note.update(fields)
    return json.dumps(note)


KEEP_TAKEOUT = {
    "Takeout/archive_browser.html": "<html></html>",
    "Takeout/Keep/Labels.txt": "Shopping\nTravel\n",
    "Takeout/Keep/Groceries.json": keep_json(
        title="Groceries",
        color="YELLOW",
        isPinned=True,
        labels=[{"name": "Shopping"}],
        listContent=[
            {"text": "Milk", "textHtml": "<p>Milk</p>", "isChecked": False},
            {"text": "Eggs", "textHtml": "<p>Eggs</p>", "isChecked": True},
        ],
    ),
    "Takeout/Keep/Groceries.html": "<html>the same note</html>",
    "Takeout/Keep/Lisbon trip.json": keep_json(
        title="Lisbon trip",
        textContent="Tram 28 early.\nPastéis de Belém!",
        isArchived=True,
        labels=[{"name": "Travel"}],
        attachments=[{"filePath": "1a2b3c4d.png", "mimetype": "image/png"}],
        annotations=[
            {
                "description": "",
                "source": "WEBLINK",
                "title": "Tram 28",
                "url": "https://example.org/28",
            }
        ],
    ),
    "Takeout/Keep/1a2b3c4d.png": TINY_PNG,
    "Takeout/Keep/2023-05-01T10_00_00.000+02_00.json": keep_json(textContent="Call the plumber"),
    "Takeout/Keep/Old.json": keep_json(title="Old", textContent="gone", isTrashed=True),
    "Takeout/Keep/Broken.json": '{"title": "Broken", "textContent": ',
}


def joplin_item(title: str, body: str, **props) -> str:
    head = f"{title}\n\n{body}\n\n" if title or body else ""
    return head + "\n".join(f"{k}: {v}" for k, v in props.items())


J_FOLDER, J_NOTE, J_TODO, J_RES, J_TAG, J_NT = (c * 32 for c in "abcdef")


JOPLIN_JEX = {
    f"{J_FOLDER}.md": joplin_item("Work", "", id=J_FOLDER, parent_id="", type_=2),
    f"{J_NOTE}.md": joplin_item(
        "Meeting",
        f"Agenda\n\n![chart](:/{J_RES})",
        id=J_NOTE,
        parent_id=J_FOLDER,
        created_time="2022-03-04T05:06:07.000Z",
        updated_time="2022-03-05T05:06:07.000Z",
        user_created_time="2022-03-04T05:06:07.000Z",
        user_updated_time="2022-03-05T05:06:07.000Z",
        is_conflict=0,
        is_todo=0,
        todo_completed=0,
        source_url="",
        type_=1,
    ),
    f"{J_TODO}.md": joplin_item(
        "File taxes", "", id=J_TODO, parent_id="", is_todo=1, todo_completed=1650000000000, type_=1
    ),
    f"{J_RES}.md": joplin_item(
        "chart.png", "", id=J_RES, mime="image/png", file_extension="png", type_=4
    ),
    f"resources/{J_RES}.png": TINY_PNG,
    f"{J_TAG}.md": joplin_item("urgent", "", id=J_TAG, type_=5),
    f"{J_NT}.md": joplin_item("", "", id=J_NT, note_id=J_NOTE, tag_id=J_TAG, type_=6),
}


def import_file(client, body: bytes, name: str, status: int = 201, **fields) -> dict:
    """POST a file to /import as a form (field file, and into / dryRun)."""
    parts = [(k, str(v).lower() if isinstance(v, bool) else v) for k, v in fields.items()]
    form, ctype = multipart(*parts, ("file", body, name))
    resp = client.request(
        f"{API}/import", method="POST", body=form, headers={"Content-Type": ctype}, status=status
    )
    return data(resp) if status < 300 else resp.json


def all_files(root: Path) -> dict:
    found = {}
    for top in ("notes", "attachments"):
        for p in sorted((root / top).rglob("*")):
            if p.is_file() and not any(s.startswith(".") for s in p.relative_to(root).parts):
                found[p.relative_to(root).as_posix()] = p.read_bytes()
    return found


def assert_nothing_imported(client, root: Path) -> None:
    """An import refused wrote nothing: no file, no folder, no change in the feed."""
    assert all_files(root) == {}
    assert not (root / "notes/imported").exists()
    assert feed(client)["changes"] == []


pytest_plugins = ["search_reference", "standins", "browsers", "passthrough_kit"]
