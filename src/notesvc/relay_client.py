"""The server's link to its relay: RelayClient registers, long-polls, answers, dials in.

The relay (relay.py) hands each client request to the server through a long-poll; the
server answers it in process, on a small pool of workers. A relay that offers passthrough
also hands over dials: the server then opens a data connection for a client whose TLS
ends here (passthrough/server.py).
"""

from __future__ import annotations

import base64
import io
import json
import socket
import sys
import threading
import time
import urllib.parse
from typing import TYPE_CHECKING, Any

from notesvc.boot import log
from notesvc.errors import to_json
from notesvc.helpers import iso, scrub, utcnow, valid_host
from notesvc.passthrough.server import Passthrough
from notesvc.providers.base import UpstreamError
from notesvc.relay import RELAY_CODE_TTL, RELAY_POLL_WAIT

if TYPE_CHECKING:  # annotations only: these modules come later
    from notesvc.http.app import NotesApp


RELAY_WORKERS = 4  # relayed requests a server answers at once (change-feed waits: half)


class RelayClient:
    """The server side: register at SERVICE_RELAY_URL, long-poll, answer in-process.

    Polls run on one thread over a kept-alive connection; each request is answered by a
    small worker pool, so a slow request never holds up the next poll.
    """

    def __init__(self, app: NotesApp, listener: Any = None):
        import concurrent.futures

        self.app, self.svc = app, app.service
        self.url = self.svc.config.relay_url
        # passthrough (SERVICE_RELAY_PASSTHROUGH=auto): `listener` is waitress's, which
        # spliced connections join as channels of their own
        self.passthrough = (
            Passthrough(self.svc, listener, self._call, self.register)
            if self.svc.config.relay_passthrough == "auto"
            else None
        )
        self.state, self.error, self.since = "connecting", None, iso(utcnow())
        self._stop = threading.Event()
        self._registered_code = None
        self._code_sent_at = 0.0
        self._local = threading.local()
        self._workers = concurrent.futures.ThreadPoolExecutor(RELAY_WORKERS, "notesvc-relay-worker")
        self._thread = threading.Thread(target=self._run, name="notesvc-relay", daemon=True)

    def start(self) -> RelayClient:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._workers.shutdown(wait=False)
        if self.passthrough is not None:
            self.passthrough.stop()

    def status(self) -> dict:
        found = {"url": self.url, "state": self.state, "since": self.since, "lastError": self.error}
        found["mode"] = "relayed"  # TLS ends at the relay (or before it): it can read requests
        if self.passthrough is not None:
            found["passthrough"] = self.passthrough.status()
            if self.passthrough.active:
                found["mode"] = "passthrough"
        return found

    def _set(self, state: str, error: str | None = None) -> None:
        if state != self.state:
            self.state, self.since = state, iso(utcnow())
        self.error = error

    # -- HTTP to the relay ----------------------------------------------------------

    def _call(self, method: str, path: str, body: dict | None = None, timeout: float = 15):
        """Return (status, parsed JSON or None) of one call to the relay (kept-alive per thread).

        Raises UpstreamError when the relay cannot be reached.
        """
        import http.client

        parts = urllib.parse.urlsplit(self.url)
        conn = getattr(self._local, "conn", None)
        if conn is None or conn.timeout != timeout:
            kind = (
                http.client.HTTPSConnection
                if parts.scheme == "https"
                else http.client.HTTPConnection
            )
            conn = self._local.conn = kind(parts.netloc, timeout=timeout)
        st = self.svc.state.read()
        headers = {"X-Relay-Token": st["relayToken"]}
        payload = None
        if body is not None:
            payload = to_json(body)
            headers["Content-Type"] = "application/json"
        for attempt in (1, 2):  # a kept-alive connection the relay closed: once more, fresh
            try:
                conn.request(method, parts.path.rstrip("/") + path, payload, headers)
                resp = conn.getresponse()
                raw = resp.read()
                break
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                if attempt == 2 or self._stop.is_set():
                    reason = "timed out" if isinstance(e, (socket.timeout, TimeoutError)) else e
                    raise UpstreamError(f"{method} {path.split('/')[3]}: {reason}") from None
        try:
            return resp.status, json.loads(raw) if raw else None
        except ValueError:
            return resp.status, None

    def register(self) -> None:
        """Register this server (and its relay code); UpstreamError, or RelayRefused."""
        st = self.svc.state.read()
        sid, code = st["serverId"], st["relayCode"]
        asked = self.passthrough is not None and self.passthrough.wanted()
        body = {"token": st["relayToken"], "relayCode": code}
        if asked:  # a certificate for <id>.D in hand: the relay splices its clients to us
            body["passthrough"] = True
        status, answer = self._call("POST", f"/relay/v1/register/{sid}", body)
        said = [st["relayToken"]]  # a relay that says it back: never into the log or the info
        if status != 200:
            raise RelayRefused(status, scrub(_relay_message(answer, status), said))
        if self.passthrough is not None:
            data = answer.get("data") if isinstance(answer, dict) else None
            self.passthrough.registered(asked, data if isinstance(data, dict) else {})
        status, answer = self._call(
            "POST", f"/relay/v1/code/{code}", {"serverId": sid, "token": st["relayToken"]}
        )
        if status != 200:
            raise RelayRefused(status, scrub(_relay_message(answer, status), said))
        self._registered_code, self._code_sent_at = code, time.monotonic()
        self._learn_origin(sid)

    def _learn_origin(self, sid: str) -> None:
        """Ask the relay whether it gives servers their own origins, and remember this
        server's (links, share URLs and the OAuth issuer name it; docs/design.md: relay)."""
        status, answer = self._call("GET", "/relay/v1/info")
        info = answer.get("data") if status == 200 and isinstance(answer, dict) else None
        origin = ""
        if isinstance(info, dict) and info.get("perServerOrigins") and info.get("domain"):
            parts = urllib.parse.urlsplit(str(info.get("publicUrl") or self.url))
            domain = str(info["domain"]).lower()
            if parts.scheme in ("http", "https") and valid_host(f"{sid}.{domain}"):
                port = f":{parts.port}" if parts.port else ""
                origin = f"{parts.scheme}://{sid}.{domain}{port}"
        if self.passthrough is not None and isinstance(info, dict):
            origin = self.passthrough.learn(info, sid) or origin  # https://<id>.D, TLS here
        known = {"relay": self.url, "origin": origin}
        if self.svc.state.read().get("relayOrigin") != known:
            self.svc.state.update(lambda data: data.update(relayOrigin=known))
            if origin:
                log.info("relay: this server's own origin there is %s", origin)

    def _run(self) -> None:
        backoff = 1.0
        while not self._stop.is_set():
            try:
                self.register()
                self._set("connected")
                backoff = 1.0
                log.info("relay: connected to %s", self.url)
                while not self._stop.is_set():
                    stale = time.monotonic() - self._code_sent_at > RELAY_CODE_TTL / 3
                    if stale or self.svc.state.read()["relayCode"] != self._registered_code:
                        self.register()  # the key (and with it the relay code) was rotated
                    request = self._poll()
                    if request is not None and request.get("kind") == "dial":
                        if self.passthrough is not None:  # a client on the TLS port: dial in
                            self.passthrough.dial(request)
                    elif request is not None:
                        self._workers.submit(self._serve, request)
            except RelayRefused as e:
                self._set("refused", e.message)
                log.warning("relay %s refused this server: %s", self.url, e.message)
                self._stop.wait(max(backoff, 30.0 if e.status == 429 else 60.0))
                backoff = min(backoff * 2, 300.0)
            except UpstreamError as e:  # relay down or restarted: try again, more slowly
                self._set("error" if self.state != "connecting" else "connecting", str(e))
                log.warning("relay %s: %s; retrying in %.0f s", self.url, e, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)
            except Exception as e:
                self._set("error", type(e).__name__)
                log.exception("relay %s: unexpected failure; retrying in %.0f s", self.url, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)

    def _poll(self) -> dict | None:
        sid = self.svc.state.read()["serverId"]
        status, answer = self._call("GET", f"/relay/v1/poll/{sid}", timeout=RELAY_POLL_WAIT + 15)
        if status == 204:
            return None
        if status == 200 and isinstance(answer, dict) and isinstance(answer.get("data"), dict):
            return answer["data"]
        if status in (401, 403):  # the relay forgot us (restart, expiry): register again
            raise UpstreamError(f"poll answered HTTP {status}; registering again")
        raise UpstreamError(f"poll answered HTTP {status}")

    def _serve(self, request: dict) -> None:
        try:
            status, headers, body = self._dispatch(request)
            sid = self.svc.state.read()["serverId"]
            self._call(
                "POST",
                f"/relay/v1/reply/{sid}/{request['id']}",
                {
                    "status": status,
                    "headers": headers,
                    "body": base64.b64encode(body).decode("ascii"),
                },
                timeout=30,
            )
        except Exception:  # the client gets a 504 from the relay; we log why
            log.exception("relay: answering request %s failed", request.get("id"))

    def _dispatch(self, request: dict) -> tuple:
        """Run one relayed request through the app in-process; return (status, headers, body)."""
        if self.passthrough is not None:  # (the relay could read this one: counted)
            self.passthrough.terminated.add()
        body = base64.b64decode(request.get("body", ""))
        sid = self.svc.state.read()["serverId"]
        # "" when the request came to this server's own origin on the relay, else /r/<id>
        on_origin = request.get("prefix") == "" and bool(self.svc.relay_origin())
        environ = {
            "REQUEST_METHOD": request["method"],
            "SCRIPT_NAME": "" if on_origin else f"/r/{sid}",
            "PATH_INFO": request["path"].encode("utf-8").decode("latin-1"),
            "QUERY_STRING": request.get("query", ""),
            "SERVER_NAME": "relay",
            "SERVER_PORT": "443" if request.get("scheme") == "https" else "80",
            "SERVER_PROTOCOL": "HTTP/1.1",
            "REMOTE_ADDR": request.get("client", ""),  # the lockout counts per real client
            "wsgi.version": (1, 0),
            "wsgi.url_scheme": request.get("scheme", "http"),
            "wsgi.input": io.BytesIO(body),
            "wsgi.errors": sys.stderr,
            "wsgi.multithread": True,
            "wsgi.multiprocess": False,
            "wsgi.run_once": False,
            "CONTENT_LENGTH": str(len(body)),
            "notesvc.relayed": True,
            "notesvc.relay_origin": self.svc.relay_origin() if on_origin else "",
        }
        for name, value in request.get("headers", []):
            key = name.upper().replace("-", "_")
            if key == "CONTENT_TYPE":
                environ["CONTENT_TYPE"] = value
            elif key not in (
                "CONTENT_LENGTH",
                "X_FORWARDED_FOR",
                "X_FORWARDED_PROTO",
                "X_FORWARDED_HOST",
            ):
                environ[f"HTTP_{key}"] = value
        if request.get("host"):
            environ["HTTP_HOST"] = request["host"]
        seen: dict = {}

        def start_response(status, headers, exc_info=None):
            seen["status"], seen["headers"] = int(status.split()[0]), headers

        chunks = self.app(environ, start_response)
        try:
            data = b"".join(chunks)
        finally:
            if hasattr(chunks, "close"):
                chunks.close()
        return seen["status"], [list(h) for h in seen["headers"]], data


class RelayRefused(Exception):
    """The relay answered a registration with a refusal (status and its message)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def _relay_message(answer: Any, status: int) -> str:
    try:
        return f"HTTP {status}: {answer['error']['message']}"[:300]
    except (TypeError, KeyError):
        return f"HTTP {status}"
