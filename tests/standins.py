"""Loopback stand-ins that speak the real wire formats: an OpenAI-compatible model,
Telegram and WhatsApp, an embeddings endpoint, a relay's server, a forwarding proxy."""

from __future__ import annotations

import base64
import contextlib
import functools
import http.client
import http.server
import json
import operator
import os
import random
import re
import socket
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from conftest import Server, notesvc, put_note

# -- search by meaning: a loopback embeddings endpoint -------------------------------------

# Words a stand-in model takes as one meaning: "car repair" is near "Fixing the automobile".
MEANINGS = {
    "automobile": "car",
    "vehicle": "car",
    "fixing": "repair",
    "fix": "repair",
    "mend": "repair",
    "mending": "repair",
    "puppy": "dog",
    "canine": "dog",
    "hound": "dog",
}


EMBED_STOPWORDS = {"the", "a", "an", "of", "and", "to", "in", "my", "is", "for", "on"}


@functools.lru_cache(maxsize=65536)
def _meaning_vector(word: str, dim: int) -> tuple:
    rnd = random.Random(f"{MEANINGS.get(word, word)}/{dim}")
    return tuple(rnd.gauss(0, 1) for _ in range(dim))


def stand_in_vector(text: str, dim: int) -> list:
    """A deterministic embedding: the sum of one random vector per meaning."""
    vec = [0.0] * dim
    for word in re.findall(r"[a-z0-9]+", text.lower()):
        if word not in EMBED_STOPWORDS:
            vec = list(map(operator.add, vec, _meaning_vector(word, dim)))
    if not any(vec):
        vec[0] = 1.0
    return vec


class EmbedStandIn:
    """An embeddings endpoint on 127.0.0.1 speaking Ollama's /api/embed and OpenAI's
    /v1/embeddings, deterministic; `how` makes it misbehave the ways real ones do."""

    def __init__(self, dim: int = 384):
        self.dim = dim
        self.how = "ok"
        self.calls: list = []  # (path, number of inputs, Authorization header)
        self.inputs: list = []
        stand_in = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                texts = body["input"]
                stand_in.calls.append((self.path, len(texts), self.headers.get("Authorization")))
                stand_in.inputs.extend(texts)
                stand_in.answer(self, texts)

        class Quiet(http.server.ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):
                if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
                    super().handle_error(request, client_address)  # a client gone: expected

        self.server = Quiet(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        ).start()

    def url(self, kind: str = "ollama", query: str = "") -> str:
        path = "/api/embed" if kind == "ollama" else "/v1/embeddings"
        return f"http://127.0.0.1:{self.port}{path}{query}"

    def answer(self, handler, texts: list) -> None:
        how = self.how
        vectors = [stand_in_vector(t, self.dim) for t in texts]
        if how == "nan":
            vectors[0][3] = float("nan")
        elif how == "count":
            vectors = vectors[:-1] or [[1.0] * self.dim, [1.0] * self.dim]
        elif how == "huge":
            vectors = [[0.5] * 5000 for _ in texts]
        elif how == "empty":
            vectors = [[] for _ in texts]
        if how == "500":
            return self.send(handler, 500, b'{"error": "model crashed, key=sk-secret-123"}')
        if how.startswith("echo-"):  # an endpoint that says back the key it was sent, spelt anew
            auth = handler.headers.get("Authorization", "")
            key = auth.partition(" ")[2]
            said = {
                "echo-lower": key.lower(),
                "echo-upper": key.upper(),
                "echo-base64": base64.b64encode(auth.encode()).decode(),
                "echo-url": urllib.parse.quote(key, safe="").lower(),
                "echo-cut": key[:20] + "...",
            }[how]
            raw = json.dumps({"error": {"message": f"Incorrect API key provided: {said}"}})
            return self.send(handler, 401, raw.encode())
        if how == "html":
            return self.send(handler, 200, b"<html>Bad gateway</html>", "text/html")
        if how == "redirect":
            return self.send(handler, 307, b"", headers={"Location": "http://127.0.0.1:9/x"})
        if how == "slow":
            time.sleep(3)
        if handler.path.startswith("/api/embed"):
            body = {"model": "stand-in", "embeddings": vectors}
        else:
            data = [
                {"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)
            ]
            body = {"object": "list", "data": data[::-1], "model": "stand-in"}  # any order
        raw = json.dumps(body, allow_nan=True).encode()
        if how == "trickle":  # a byte a quarter second: each read is quick, the whole is not
            handler.send_response(200)
            handler.send_header("Content-Length", str(len(raw)))
            handler.end_headers()
            for i in range(len(raw)):
                handler.wfile.write(raw[i : i + 1])
                handler.wfile.flush()
                time.sleep(0.25)
            return None
        return self.send(handler, 200, raw)

    @staticmethod
    def send(handler, status: int, raw: bytes, ctype: str = "application/json", headers=None):
        handler.send_response(status)
        handler.send_header("Content-Type", ctype)
        handler.send_header("Content-Length", str(len(raw)))
        for k, v in (headers or {}).items():
            handler.send_header(k, v)
        handler.end_headers()
        handler.wfile.write(raw)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def embed_endpoint():
    stand_in = EmbedStandIn()
    yield stand_in
    stand_in.close()


def embed_env(endpoint: EmbedStandIn, kind: str = "ollama", **env: str) -> dict:
    return {"SERVICE_EMBED_URL": endpoint.url(kind), "SERVICE_EMBED_MODEL": "stand-in", **env}


MEANING_NOTES = {
    "notes/garage.md": "# Fixing the automobile\n\nThe mechanic changed the brake pads.",
    "notes/pets.md": "# Walking the puppy\n\nTwice a day around the park, with treats.",
    "notes/work/budget.md": "# Budget\n\nSpreadsheet of quarterly costs: rent, salaries, travel.",
    "notes/work/car.md": "# Company vehicle\n\nMend the dent before the inspection in March.",
}


class FakeUpstream:
    """A loopback HTTP server speaking the OpenAI chat-completions and /audio/transcriptions,
    Telegram Bot API and WhatsApp Cloud API formats.

    `requests` records what it is sent (chat completions, sendMessage, WhatsApp messages,
    transcriptions); the Bot API's own bookkeeping, which pollers call in the background
    (getUpdates, setWebhook, deleteWebhook, getFile), goes to `bot_calls`, and GETs
    (file and media downloads) to `downloads`. Telegram updates queued with push() are
    handed out by getUpdates with Telegram's offset rules and long-poll time-out (held at
    most `max_hold` seconds); setWebhook makes getUpdates answer 409 until deleteWebhook.
    """

    BOT_METHODS = ("getUpdates", "setWebhook", "deleteWebhook", "getFile", "getMe")
    WHATSAPP_TOKEN = "EAAG-whatsapp-token"

    def __init__(self):
        self.requests: list = []
        self.bot_calls: list = []
        self.downloads: list = []
        self.status = 200
        self.delay = 0.0
        self.reply = "The spare keys are under the blue flowerpot (notes/home/keys.md)."
        self.raw = None  # bytes to answer instead of the usual JSON
        self.updates: list = []  # queued Telegram updates (push)
        self.next_update_id = 500000
        self.max_hold = 1.0
        self.polls = 0
        self.poll_status = 200  # getUpdates answers this (e.g. 401: a revoked token)
        self.poll_error = "Unauthorized"  # ... with this description
        self.refused_token = ""  # every Bot API call with this token answers 401
        self.webhook: dict | None = None
        self.webhook_error = ""  # setWebhook refuses with this description
        self.files: dict = {}  # Telegram file_id -> (file_path, bytes)
        self.media: dict = {}  # WhatsApp media id -> (mime type, bytes)
        self.transcript = "Remember to buy oat milk and call the plumber."
        self.closed = False
        self.cond = threading.Condition()
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, status: int, payload: bytes, ctype: str = "application/json"):
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                with contextlib.suppress(OSError):
                    self.wfile.write(payload)

            def do_POST(self):
                length = int(self.headers.get("Content-Length", 0))
                raw = self.rfile.read(length)
                path = self.path.split("?")[0]
                method = path.rsplit("/", 1)[-1]
                if path.endswith("/audio/transcriptions"):
                    form = fake.parse_form(raw, self.headers.get("Content-Type", ""))
                    fake.requests.append(
                        {"path": self.path, "headers": dict(self.headers), "form": form}
                    )
                    if "file" not in form:
                        return self._send(400, b'{"error": {"message": "no file"}}')
                    return self._send(200, json.dumps({"text": fake.transcript}).encode())
                body = json.loads(raw or b"null")
                if path.startswith("/bot") and method in fake.BOT_METHODS:
                    fake.bot_calls.append({"path": self.path, "json": body})
                    if fake.refused_token and path.startswith(f"/bot{fake.refused_token}/"):
                        unauthorized = {
                            "ok": False,
                            "error_code": 401,
                            "description": "Unauthorized",
                        }
                        return self._send(401, json.dumps(unauthorized).encode())
                    status, answer = fake.bot_api(method, body)
                    return self._send(status, json.dumps(answer).encode())
                fake.requests.append(
                    {"path": self.path, "headers": dict(self.headers), "json": body}
                )
                time.sleep(fake.delay)
                payload = (
                    fake.raw
                    if fake.raw is not None
                    else json.dumps(fake.answer(self.path, body)).encode()
                )
                self._send(fake.status, payload)

            def do_GET(self):
                path = urllib.parse.unquote(self.path.split("?")[0])
                fake.downloads.append({"path": path, "headers": dict(self.headers)})
                m = re.match(r"^/file/bot[^/]+/(.+)$", path)
                if m:
                    found = [data for p, data in fake.files.values() if p == m.group(1)]
                    if not found:
                        return self._send(404, b'{"ok": false, "description": "Not Found"}')
                    return self._send(200, found[0], "application/octet-stream")
                bearer = self.headers.get("Authorization") == f"Bearer {fake.WHATSAPP_TOKEN}"
                m = re.match(r"^/v21\.0/([^/]+)$", path)
                if m and m.group(1) in fake.media:
                    if not bearer:
                        return self._send(401, b'{"error": {"code": 190}}')
                    mime, data = fake.media[m.group(1)]
                    info = {
                        "messaging_product": "whatsapp",
                        "url": f"{fake.url}/whatsapp-media/{m.group(1)}?ext=1",
                        "mime_type": mime,
                        "file_size": len(data),
                        "id": m.group(1),
                    }
                    return self._send(200, json.dumps(info).encode())
                m = re.match(r"^/whatsapp-media/([^/]+)$", path)
                if m and m.group(1) in fake.media:
                    if not bearer:
                        return self._send(401, b"")
                    mime, data = fake.media[m.group(1)]
                    return self._send(200, data, mime)
                self._send(404, b'{"error": "unknown path"}')

        class Counting(http.server.ThreadingHTTPServer):
            def process_request(self, request, client_address):
                with fake.cond:
                    fake.connections += 1
                super().process_request(request, client_address)

            def shutdown_request(self, request):
                super().shutdown_request(request)
                with fake.cond:
                    fake.connections -= 1

        self.connections = 0  # accepted and not yet closed: requests on their way or answered
        self.server = Counting(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        ).start()

    @staticmethod
    def parse_form(raw: bytes, ctype: str) -> dict:
        """Return {name: (filename, bytes)} of a multipart/form-data body."""
        import email.parser
        import email.policy

        msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
            f"Content-Type: {ctype}\r\n\r\n".encode() + raw
        )
        if not msg.is_multipart():
            return {}
        return {
            part.get_param("name", header="content-disposition"): (
                part.get_filename(),
                part.get_payload(decode=True),
            )
            for part in msg.iter_parts()
        }

    def push(self, update: dict) -> int:
        """Queue a Telegram update for getUpdates; return its update_id."""
        with self.cond:
            self.next_update_id += 1
            self.updates.append({**update, "update_id": self.next_update_id})
            self.cond.notify_all()
            return self.next_update_id

    def add_file(self, file_id: str, file_path: str, data: bytes) -> None:
        self.files[file_id] = (file_path, data)

    def bot_api(self, method: str, body: dict) -> tuple:
        if method == "getUpdates":
            if self.poll_status != 200:
                answer = {
                    "ok": False,
                    "error_code": self.poll_status,
                    "description": self.poll_error,
                }
                return self.poll_status, answer
            if self.webhook is not None:
                return 409, {
                    "ok": False,
                    "error_code": 409,
                    "description": "Conflict: can't use getUpdates method while webhook is "
                    "active; use deleteWebhook to delete the webhook first",
                }
            offset = body.get("offset", 0)
            deadline = time.monotonic() + min(body.get("timeout", 0), self.max_hold)
            with self.cond:
                self.polls += 1
                self.updates = [u for u in self.updates if u["update_id"] >= offset]
                while not self.updates and not self.closed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self.cond.wait(left)
                return 200, {"ok": True, "result": list(self.updates[:100])}
        if method == "setWebhook":
            if self.webhook_error:
                return 400, {"ok": False, "error_code": 400, "description": self.webhook_error}
            self.webhook = body
            return 200, {"ok": True, "result": True, "description": "Webhook was set"}
        if method == "deleteWebhook":
            self.webhook = None
            return 200, {"ok": True, "result": True, "description": "Webhook was deleted"}
        if method == "getFile":
            found = self.files.get(body.get("file_id"))
            if found is None:
                return 400, {
                    "ok": False,
                    "error_code": 400,
                    "description": "Bad Request: invalid file_id",
                }
            return 200, {
                "ok": True,
                "result": {
                    "file_id": body["file_id"],
                    "file_unique_id": "u" + body["file_id"],
                    "file_size": len(found[1]),
                    "file_path": found[0],
                },
            }
        return 200, {"ok": True, "result": {"id": 1, "is_bot": True, "username": "notes_bot"}}

    def answer(self, path: str, body: dict) -> dict:
        path = path.split("?")[0]
        if path.endswith("/chat/completions"):
            return {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": 1700000000,
                "model": body["model"] + "-served",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": self.reply},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
            }
        if "/sendMessage" in path:
            return {
                "ok": True,
                "result": {"message_id": 7, "chat": {"id": body["chat_id"]}, "text": body["text"]},
            }
        if path.endswith("/messages"):
            return {
                "messaging_product": "whatsapp",
                "contacts": [{"input": body["to"], "wa_id": body["to"]}],
                "messages": [{"id": "wamid.HBgLMTY1MDM4Nzk0MzkVAgARGBI3"}],
            }
        return {"error": "unknown path"}

    def sent(self) -> list:
        """Return the texts sent through sendMessage and WhatsApp /messages, in order."""
        out = []
        for r in self.requests:
            body = r.get("json") or {}
            if "/sendMessage" in r["path"]:
                out.append(body["text"])
            elif r["path"].endswith("/messages"):
                out.append(body["text"]["body"])
        return out

    def close(self):
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def upstream():
    fake = FakeUpstream()
    yield fake
    fake.close()


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


KEYS_NOTE = (
    "# Keys\n\nThe car key hangs by the door. Spare keys are under the blue flowerpot.\n"
    "Ask Anna if they are gone."
)


def seed_notes(client):
    put_note(client, "notes/home/keys.md", KEYS_NOTE)
    put_note(client, "notes/garden.md", "# Garden\n\nPlant tomatoes in May. Water them daily.")
    put_note(client, "notes/work.md", "# Work\n\nThe meeting is on Tuesday at ten.")


def telegram_update(text, chat_id=42, **extra):
    message = {
        "message_id": 11,
        "from": {"id": chat_id, "is_bot": False, "first_name": "Ada", "language_code": "en"},
        "chat": {"id": chat_id, "first_name": "Ada", "type": "private"},
        "date": 1763731200,
        **extra,
    }
    if text is not None:
        message["text"] = text
    return {"update_id": 100001, "message": message}


def whatsapp_update(text, number="15551234567"):
    message = {"from": number, "id": "wamid.ID", "timestamp": "1763731200"}
    if text is None:  # no text and nothing to capture: a shared location
        message.update(type="location", location={"latitude": 52.52, "longitude": 13.40})
    else:
        message.update(type="text", text={"body": text})
    return {
        "object": "whatsapp_business_account",
        "entry": [
            {
                "id": "102290129340398",
                "changes": [
                    {
                        "value": {
                            "messaging_product": "whatsapp",
                            "metadata": {
                                "display_phone_number": "15550783881",
                                "phone_number_id": "106540352242922",
                            },
                            "contacts": [{"profile": {"name": "Ada"}, "wa_id": number}],
                            "messages": [message],
                        },
                        "field": "messages",
                    }
                ],
            }
        ],
    }


MINIMAL_CONFIG = {
    "telegram": {"botToken": "123456:ABC-telegram-token"},
    "whatsapp": {
        "accessToken": "EAAG-whatsapp-token",
        "phoneNumberId": "106540352242922",
        "verifyToken": "verify-me-please",
    },
    "web": {},
}


def today_note(client, folder: str = "notes/daily") -> Path:
    day = notesvc.local_now(client.app.service).date()
    return client.app.service.config.root / folder / f"{day:%Y-%m-%d}.md"


class ToolModel(FakeUpstream):
    """A loopback model speaking chat-completions tool calling. Each answer follows the
    script: a step is a function of the messages so far returning either the reply text or
    a list of (tool name, arguments) calls; past the script it answers `reply`."""

    def __init__(self, *script):
        super().__init__()
        self.script = list(script)
        self.refuse_tools = False  # answer HTTP 400 to a request that offers tools

    def answer(self, path: str, body: dict) -> dict:
        if not path.endswith("/chat/completions"):
            return super().answer(path, body)
        self.status = 400 if self.refuse_tools and "tools" in body else 200
        if self.status == 400:
            return {"error": {"message": "this model does not support tools"}}
        step = self.script.pop(0) if self.script else (lambda messages: self.reply)
        out = step(body["messages"])
        if isinstance(out, int):  # this answer fails with that HTTP status
            self.status = out
            return {"error": {"message": "the model fell over"}}
        answer = super().answer(path, body)
        if isinstance(out, str):
            answer["choices"][0]["message"]["content"] = out
            return answer
        calls = [
            {
                "id": f"call_{len(self.requests)}_{i}",
                "type": "function",
                "function": {
                    "name": name,
                    "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                },
            }
            for i, (name, arguments) in enumerate(out)
        ]
        answer["choices"][0] = {
            "index": 0,
            "message": {"role": "assistant", "content": None, "tool_calls": calls},
            "finish_reason": "tool_calls",
        }
        return answer


def last_tool_results(messages: list) -> list:
    """Return the contents of the `role: tool` messages after the last assistant message."""
    out = []
    for message in reversed(messages):
        if message["role"] != "tool":
            break
        out.insert(0, message["content"])
    return out


class Callback:
    """A loopback stand-in for an OAuth client's redirect URI: records what reaches it."""

    def __init__(self):
        self.hits: list = []
        self.arrived = threading.Event()
        cb = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path.startswith("/callback"):  # not the browser's /favicon.ico
                    cb.hits.append(self.path)
                    cb.arrived.set()
                body = b"<!doctype html><title>back in the app</title><p>done</p>"
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/callback"
        threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        ).start()

    def query(self, timeout: float = 15) -> dict:
        assert self.arrived.wait(timeout), "nothing reached the redirect URI"
        self.arrived.clear()
        return urllib.parse.parse_qs(urllib.parse.urlsplit(self.hits[-1]).query)

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class FakeRelayServer:
    """A server as the relay sees it: its own token and id, raw relay protocol calls."""

    def __init__(self, relay: Server, source: str = "127.0.0.1"):
        self.relay, self.source = relay, source
        self.token = base64.urlsafe_b64encode(os.urandom(32)).decode().rstrip("=")
        self.server_id = notesvc.relay_server_id(self.token)
        self.code = notesvc.relay_code_of(self.token)

    def call(self, method: str, path: str, body=None, token: str | None = None):
        conn = http.client.HTTPConnection(
            "127.0.0.1", self.relay.port, timeout=40, source_address=(self.source, 0)
        )
        try:
            headers = {"X-Relay-Token": self.token if token is None else token}
            payload = None
            if body is not None:
                payload = json.dumps(body).encode()
                headers["Content-Type"] = "application/json"
            conn.request(method, path, payload, headers)
            resp = conn.getresponse()
            raw = resp.read()
            return resp.status, resp.headers, json.loads(raw) if raw else None
        finally:
            conn.close()

    def register(self, server_id: str | None = None) -> int:
        sid = server_id or self.server_id
        body = {"token": self.token, "relayCode": self.code}
        return self.call("POST", f"/relay/v1/register/{sid}", body)[0]

    def poll(self, server_id: str | None = None):
        return self.call("GET", f"/relay/v1/poll/{server_id or self.server_id}")

    def open_poll(self) -> socket.socket:
        """Start a long-poll on a raw socket and leave it waiting."""
        s = socket.socket()
        s.settimeout(5)
        s.bind((self.source, 0))
        s.connect(("127.0.0.1", self.relay.port))
        s.sendall(
            f"GET /relay/v1/poll/{self.server_id} HTTP/1.1\r\nHost: relay\r\n"
            f"X-Relay-Token: {self.token}\r\n\r\n".encode()
        )
        return s

    def reply(self, request_id: str, status: int, headers: list, body: bytes) -> int:
        answer = {"status": status, "headers": headers, "body": base64.b64encode(body).decode()}
        return self.call("POST", f"/relay/v1/reply/{self.server_id}/{request_id}", answer)[0]


def host_request(port: int, host: str, method: str, path: str, body=None, headers=None) -> tuple:
    """Return (status, headers, raw body) of one request to 127.0.0.1:port with this Host."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        hdrs = {"Host": host, **(headers or {})}
        payload = None
        if body is not None:
            payload = body if isinstance(body, bytes) else json.dumps(body).encode()
            hdrs.setdefault("Content-Type", "application/json")
        conn.request(method, path, payload, hdrs)
        resp = conn.getresponse()
        return resp.status, resp.headers, resp.read()
    finally:
        conn.close()


class ForwardingProxy:
    """A reverse proxy on loopback that forwards like Caddy does.

    It replaces X-Forwarded-For with the client it saw and sets X-Forwarded-Proto
    (`https`: it stands for a TLS proxy) and X-Forwarded-Host (the Host it was asked for).
    Loopback stands in for the internet: a client from 127.0.0.N is reported as
    203.0.113.N. `source` is the proxy's own address toward the server.
    """

    def __init__(self, upstream: str, source: str = "127.0.0.1"):
        target = urllib.parse.urlsplit(upstream)
        hop = {"connection", "keep-alive", "transfer-encoding", "content-length", "date", "server"}

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def forward(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {
                    k: v
                    for k, v in self.headers.items()
                    if k.lower() not in hop and not k.lower().startswith("x-forwarded-")
                }
                headers["X-Forwarded-For"] = "203.0.113." + self.client_address[0].split(".")[-1]
                headers["X-Forwarded-Proto"] = "https"
                headers["X-Forwarded-Host"] = self.headers.get("Host", "")
                conn = http.client.HTTPConnection(
                    target.hostname, target.port, timeout=10, source_address=(source, 0)
                )
                try:
                    conn.request(self.command, self.path, body, headers)
                    resp = conn.getresponse()
                    payload = resp.read()
                finally:
                    conn.close()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in hop:
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = forward

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    def __enter__(self) -> ForwardingProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)
