"""Tests for notesvc: WebTest in-process, plus real servers where they matter."""

from __future__ import annotations

import array
import base64
import collections
import concurrent.futures
import contextlib
import dataclasses
import datetime as dt
import errno
import gzip
import hashlib
import heapq
import http.client
import http.server
import importlib.util
import io
import itertools
import json
import logging
import math
import operator
import os
import random
import re
import secrets
import select
import shutil
import socket
import sqlite3
import ssl
import stat
import statistics
import string
import subprocess
import sys
import tempfile
import threading
import time
import types
import typing
import unicodedata
import urllib.error
import urllib.parse
import urllib.request
import wave
import zlib
from pathlib import Path

import pytest
import webtest

import notesvc

HERE = Path(__file__).resolve().parent


NOTESVC = str(HERE / "notesvc.py")


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

    def __init__(self, root: Path, *args: str, env: dict | None = None, port: int = 0):
        must_be_marked("real_server")
        cmd = [sys.executable, NOTESVC, *args, "--host", "127.0.0.1", "--port", str(port)]
        cmd += [] if args[:1] == ("relay",) else ["--root", str(root)]  # a relay has no root
        full_env = {
            **os.environ,
            "SERVICE_RESCAN_SECONDS": "0",
            "SERVICE_SETUP_LOCAL_ONLY": "false",  # never `auto`: see make_env
            **(env or {}),
        }
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=full_env
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
def running(root: Path, *args: str, env: dict | None = None, port: int = 0):
    server = Server(root, *args, env=env, port=port)
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


class TestConfig:
    def test_defaults_match_the_contract(self):
        cfg = notesvc.load_config(env={})
        assert (cfg.host, cfg.port, cfg.auth_mode, cfg.pairing) == (
            "0.0.0.0",
            3000,
            "api-key",
            "relay",
        )
        assert cfg.max_body_bytes == 1048576
        assert cfg.rescan_seconds == 5
        assert cfg.threads == 8
        assert cfg.agent_timeout == 60
        assert cfg.root == Path("./data").resolve()

    def test_flag_beats_variable_beats_default(self):
        assert notesvc.load_config(env={"SERVICE_PORT": "4000"}).port == 4000
        assert notesvc.load_config(env={"SERVICE_PORT": "4000"}, port="5000").port == 5000

    @pytest.mark.parametrize(
        ("env", "names"),
        [
            ({"SERVICE_PORT": "abc"}, "SERVICE_PORT"),
            ({"SERVICE_PORT": "70000"}, "SERVICE_PORT"),
            ({"SERVICE_AUTH_MODE": "magic"}, "SERVICE_AUTH_MODE"),
            ({"SERVICE_AUTH_MODE": "jwt"}, "SERVICE_JWT_SECRET"),
            ({"SERVICE_AUTH_MODE": "jwt", "SERVICE_JWT_SECRET": "short"}, "SERVICE_JWT_SECRET"),
            ({"SERVICE_TRUST_PROXY": "maybe"}, "SERVICE_TRUST_PROXY"),
            ({"SERVICE_PAIRING_MODE": "carrier-pigeon"}, "SERVICE_PAIRING_MODE"),
            ({"SERVICE_PUBLIC_URL": "ftp://x"}, "SERVICE_PUBLIC_URL"),
            ({"SERVICE_CORS_ORIGINS": "not a url"}, "SERVICE_CORS_ORIGINS"),
            ({"SERVICE_MAX_BODY_BYTES": "-1"}, "SERVICE_MAX_BODY_BYTES"),
            ({"SERVICE_AGENT_TIMEOUT": "soon"}, "SERVICE_AGENT_TIMEOUT"),
            ({"SERVICE_THREADS": "0"}, "SERVICE_THREADS"),
            ({"SERVICE_LOG_LEVEL": "loud"}, "SERVICE_LOG_LEVEL"),
        ],
    )
    def test_bad_value_raises_config_error_naming_it(self, env, names):
        with pytest.raises(notesvc.ConfigError, match=names):
            notesvc.load_config(env=env)

    def test_jwt_with_long_secret_is_accepted(self):
        cfg = notesvc.load_config(env={"SERVICE_AUTH_MODE": "jwt", "SERVICE_JWT_SECRET": "x" * 32})
        assert cfg.auth_mode == "jwt"

    def test_every_setting_is_a_config_field(self):
        fields = {f.name for f in notesvc.dataclasses.fields(notesvc.Config)}
        assert {s.name for s in notesvc.SETTINGS} == fields

    def test_importing_the_module_creates_no_files(self, tmp_path):
        code = "import notesvc, os; print(sorted(os.listdir('.')))"
        out = subprocess.run(
            [sys.executable, "-c", code],
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(HERE)},
            capture_output=True,
            text=True,
            check=True,
        )
        assert out.stdout.strip() == "[]"


def _boom(svc):
    raise RuntimeError("secret internals /etc/passwd")


def _echo(svc):
    return {"body": notesvc.read_json(svc.config.max_body_bytes)}


def ids(report) -> set:
    return {f["id"] for f in report["findings"]}


class TestEnvelope:
    @pytest.fixture
    def app(self, root):
        cfg = notesvc.load_config(env=make_env(root, SERVICE_MAX_BODY_BYTES="2048"))
        service = notesvc.build_service(cfg).start()
        extra = (
            notesvc.Route("GET", "/boom", _boom, scope="read"),
            notesvc.Route("POST", "/echo", _echo, scope="read"),
        )
        wsgi = notesvc.NotesApp(service, notesvc.ROUTES + extra)
        key = service.state.read()["apiKey"]
        yield webtest.TestApp(wsgi, extra_environ={"HTTP_X_SERVICE_KEY": key})
        service.close()

    def test_unknown_route_is_json_404(self, anon):
        err = assert_error(anon.get(f"{API}/nope", status=404), 404, "NOT_FOUND")
        assert "/api/v1/nope" in err["message"]

    def test_unknown_path_outside_api_is_json_404(self, anon):
        assert_error(anon.get("/favicon.ico", status=404), 404, "NOT_FOUND")

    def test_wrong_method_is_405_with_allow(self, client):
        resp = client.delete(f"{API}/health", status=405)
        assert_error(resp, 405, "METHOD_NOT_ALLOWED")
        assert "GET" in resp.headers["Allow"]

    def test_patch_system_config_is_405(self, client):
        resp = client.patch_json(f"{API}/system/config", {"x": 1}, status=405)
        assert_error(resp, 405, "METHOD_NOT_ALLOWED")
        assert resp.headers["Allow"] == "GET"

    @pytest.mark.parametrize(
        ("method", "path", "names"),
        [("POST", "/folders", "/folders/tree"), ("GET", "/agent/tools", "/agent/status")],
    )
    def test_replaced_endpoint_names_its_replacement(self, client, method, path, names):
        resp = client.request(API + path, method=method, status=404)
        assert names in assert_error(resp, 404, "NOT_FOUND")["message"]

    def test_crash_is_500_with_request_id_and_no_details(self, app, caplog):
        resp = app.get(f"{API}/boom", status=500)
        err = assert_error(resp, 500, "INTERNAL_ERROR")
        rid = resp.headers["X-Request-Id"]
        assert rid in err["message"]
        assert "secret" not in resp.text
        assert "passwd" not in resp.text
        assert any(rid in r.getMessage() for r in caplog.records)

    def test_every_response_has_a_request_id(self, anon):
        ids = {anon.get(f"{API}/health").headers["X-Request-Id"] for _ in range(3)}
        assert len(ids) == 3
        assert anon.get(f"{API}/nope", status=404).headers["X-Request-Id"]

    def test_sane_incoming_request_id_is_kept(self, anon):
        resp = anon.get(f"{API}/health", headers={"X-Request-Id": "trace-1234abcd"})
        assert resp.headers["X-Request-Id"] == "trace-1234abcd"
        resp = anon.get(f"{API}/health", headers={"X-Request-Id": "bad id\x01"})
        assert resp.headers["X-Request-Id"] != "bad id\x01"

    def test_request_log_lines_are_written_together_and_warnings_at_once(self):
        stream = io.StringIO()
        handler = notesvc.BatchedLogHandler(stream)
        handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        logger = logging.getLogger("notesvc-test-batched")
        logger.propagate, logger.level = False, logging.INFO
        logger.addHandler(handler)
        try:
            logger.info("GET /one")
            assert stream.getvalue() == ""  # waits for the writer thread
            logger.warning("careful")  # flushes what waits, in order, and itself
            assert stream.getvalue() == "INFO GET /one\nWARNING careful\n"
            logger.info("GET /two")
            deadline = time.monotonic() + 5
            while "GET /two" not in stream.getvalue() and time.monotonic() < deadline:
                time.sleep(0.02)
            assert stream.getvalue().endswith("INFO GET /two\n")
            logger.info("GET /three")
            handler.flush()  # what logging.shutdown does at exit
            assert stream.getvalue().endswith("INFO GET /three\n")
        finally:
            logger.removeHandler(handler)

    def test_a_quick_request_line_reads_as_logging_writes_it_and_keeps_its_turn(self):
        """main() sends each request's line straight to its handler (no LogRecord): the
        line is the one logging would have written, and lines stay in order."""
        stream = io.StringIO()
        handler = notesvc.BatchedLogHandler(stream)
        handler.setFormatter(logging.Formatter(notesvc.LOG_FORMAT))
        args = ("GET", "/api/v1/health", "200", 0.25, "0123456789abcdef")
        for created in (1764244800.0, 1764244800.9996, 1764244801.5):
            record = logging.LogRecord(
                "notesvc", logging.INFO, __file__, 1, "%s %s %s %.1fms %s", args, None
            )
            record.created, record.msecs = created, int((created - int(created)) * 1000) + 0.0
            handler.handle(record)
            handler.quick(created, "%s %s %s %.1fms %s", args)
        handler.emit(
            logging.makeLogRecord(
                {"name": "notesvc", "levelno": 30, "levelname": "WARNING", "msg": "last"}
            )
        )
        lines = stream.getvalue().splitlines()
        assert len(lines) == 7
        assert lines[-1].endswith("WARNING notesvc: last")
        assert lines[0:6:2] == lines[1:6:2]
        assert lines[0].endswith(" INFO notesvc: GET /api/v1/health 200 0.2ms 0123456789abcdef")
        # Only while main()'s handler alone writes the log: else logging, as usual.
        saved = notesvc._QUICK_LOG, logging.root.handlers[:], logging.root.level
        try:
            notesvc._QUICK_LOG = handler
            logging.root.handlers[:] = [handler]
            logging.root.setLevel(logging.INFO)
            notesvc.quick_info("%s", "quick")
            own = logging.StreamHandler(io.StringIO())
            notesvc.log.addHandler(own)
            try:
                notesvc.quick_info("%s", "through logging")
            finally:
                notesvc.log.removeHandler(own)
            assert own.stream.getvalue() == "through logging\n"
            handler.flush()
            quick, logged = stream.getvalue().splitlines()[-2:]
            assert quick.endswith("INFO notesvc: quick")
            assert logged.endswith("INFO notesvc: through logging")  # propagated, in turn
        finally:
            notesvc._QUICK_LOG = saved[0]
            logging.root.handlers[:] = saved[1]
            logging.root.setLevel(saved[2])

    def test_a_channel_runs_waitress_own_readable_and_writable(self):
        """The I/O loop asks every channel at every turn, holding the GIL: a Python frame
        more there cost a third of the requests per second. Only a lingering channel
        (after an early 413) gets its own, on the instance."""
        import waitress.channel
        import waitress.server

        listener = notesvc._hardened(waitress.server.TcpWSGIServer)
        channel = listener.channel_class
        for name in ("readable", "writable", "handle_read"):
            assert getattr(channel, name) is getattr(waitress.channel.HTTPChannel, name)

    def test_the_state_read_without_its_lock_never_goes_back_in_time(self, tmp_path):
        """Requests read the state without its lock (a stat, then the kept copy): while
        another thread updates it, each reader sees each change once it is written and
        never an older state after a newer one."""
        store = notesvc.StateStore(tmp_path / "state")
        store.update(lambda d: d.__setitem__("n", 0))
        seen: dict = {i: [] for i in range(4)}
        done = threading.Event()

        def reader(i: int) -> None:
            while not done.is_set():
                seen[i].append(store.read()["n"])

        threads = [threading.Thread(target=reader, args=(i,)) for i in seen]
        for t in threads:
            t.start()
        try:
            for n in range(1, 60):
                store.update(lambda d, n=n: d.__setitem__("n", n))
                assert store.read()["n"] == n  # the writer's own next read sees it
        finally:
            done.set()
            for t in threads:
                t.join(10)
        for values in seen.values():
            assert values == sorted(values)
        assert store.read()["n"] == 59

    def test_protected_responses_are_no_store(self, client):
        assert client.get(f"{API}/system/info").headers["Cache-Control"] == "no-store"
        resp = client.get(f"{API}/nope", status=404)
        assert resp.headers["Cache-Control"] == "no-store"

    def test_json_body_round_trips(self, app):
        body = {"text": "Grüße ✓", "n": [1, 2]}
        assert data(app.post_json(f"{API}/echo", body))["body"] == body

    def test_broken_json_is_400(self, app):
        resp = app.post(f"{API}/echo", "{bad", content_type="application/json", status=400)
        assert "JSON" in assert_error(resp, 400, "VALIDATION_ERROR")["message"]

    @pytest.mark.parametrize("raw", ["[1,2]", '"text"', "42", "null", '{"a": NaN}'])
    def test_non_object_or_nonstandard_json_is_400(self, app, raw):
        resp = app.post(f"{API}/echo", raw, content_type="application/json", status=400)
        assert_error(resp, 400, "VALIDATION_ERROR")

    def test_deeply_nested_json_is_400_not_500(self, app):
        raw = "[" * 100000 + "]" * 100000
        resp = app.post(f"{API}/echo", raw[:2000], content_type="application/json", status=400)
        assert_error(resp, 400, "VALIDATION_ERROR")

    def test_invalid_utf8_body_is_400(self, app):
        resp = app.post(
            f"{API}/echo", b'{"a": "\xff"}', content_type="application/json", status=400
        )
        assert "UTF-8" in assert_error(resp, 400, "VALIDATION_ERROR")["message"]

    def test_missing_body_is_400(self, app):
        assert_error(app.post(f"{API}/echo", status=400), 400, "VALIDATION_ERROR")

    def test_wrong_content_type_is_415(self, app):
        resp = app.post(f"{API}/echo", "a=1", content_type="text/plain", status=415)
        assert_error(resp, 415, "UNSUPPORTED_MEDIA_TYPE")

    def test_huge_body_is_413(self, app):
        resp = app.post_json(f"{API}/echo", {"a": "x" * 5000}, status=413)
        assert_error(resp, 413, "PAYLOAD_TOO_LARGE")

    def test_invalid_utf8_url_is_400(self, client):
        resp = client.get("/api/v1/notes/notes%2F%FF.md", status=400)
        assert_error(resp, 400, "VALIDATION_ERROR")


class TestNotes:
    def test_create_returns_201_record_location_and_etag(self, client, root):
        resp = put_note(client, "notes/ideas/new.md", "# Big idea\n\nbody")
        rec = data(resp)
        assert rec["path"] == "notes/ideas/new.md"
        assert rec["title"] == "Big idea"
        assert rec["content"] == "# Big idea\n\nbody"
        assert rec["size"] == len(b"# Big idea\n\nbody")
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", rec["modified"])
        assert resp.headers["ETag"] == rec["etag"]
        assert resp.headers["Location"] == note_url("notes/ideas/new.md")
        assert (root / "notes" / "ideas" / "new.md").read_text() == "# Big idea\n\nbody"

    def test_title_falls_back_to_file_name(self, client):
        assert data(put_note(client, "notes/plain.md", "no heading"))["title"] == "plain"

    def test_create_onto_existing_is_409_and_keeps_content(self, client, root):
        put_note(client, "notes/a.md", "first")
        resp = client.post_json(
            f"{API}/notes", {"path": "notes/a.md", "content": "second"}, status=409
        )
        assert_error(resp, 409, "CONFLICT")
        assert (root / "notes" / "a.md").read_text() == "first"

    @pytest.mark.parametrize(
        "body",
        [
            {"path": "notes/a.md"},
            {"path": 5, "content": "x"},
            {"path": "notes/a.md", "content": 5},
            {"path": "notes/a.md", "content": ["x"]},
            {"content": "x", "folder": 7},
            {"content": "x", "folder": "notes/../etc"},
            {"content": "x", "folder": "attachments/x"},
        ],
    )
    def test_create_with_missing_or_ill_typed_field_is_400(self, client, body):
        assert_error(client.post_json(f"{API}/notes", body, status=400), 400, "VALIDATION_ERROR")

    def test_lone_surrogate_content_is_400(self, client):
        raw = '{"path": "notes/s.md", "content": "\\ud800"}'
        resp = client.post(f"{API}/notes", raw, content_type="application/json", status=400)
        assert_error(resp, 400, "VALIDATION_ERROR")

    def test_unicode_paths_are_nfc_normalised(self, client):
        nfd = "notes/cafe\u0301.md"
        rec = data(put_note(client, nfd, "☕ Grüße"))
        assert rec["path"] == "notes/caf\u00e9.md"
        assert data(client.get(note_url("notes/caf\u00e9.md")))["content"] == "☕ Grüße"
        assert data(client.get(note_url(nfd)))["path"] == "notes/caf\u00e9.md"

    def test_get_accepts_encoded_and_plain_slashes(self, client):
        put_note(client, "notes/a/b/c.md", "deep")
        assert data(client.get(note_url("notes/a/b/c.md")))["content"] == "deep"
        assert data(client.get(f"{API}/notes/notes/a/b/c.md"))["content"] == "deep"

    def test_get_missing_is_404(self, client):
        assert_error(client.get(note_url("notes/none.md"), status=404), 404, "NOT_FOUND")

    def test_get_sets_etag(self, client):
        etag = data(put_note(client, "notes/e.md"))["etag"]
        assert client.get(note_url("notes/e.md")).headers["ETag"] == etag

    def test_list_sorted_paged_without_content(self, client):
        for name in ["c", "a", "b/z", "b/y", "d"]:
            put_note(client, f"notes/{name}.md", name)
        d = data(client.get(f"{API}/notes"))
        assert [n["path"] for n in d["notes"]] == [
            "notes/a.md",
            "notes/b/y.md",
            "notes/b/z.md",
            "notes/c.md",
            "notes/d.md",
        ]
        assert d["total"] == 5
        assert (d["limit"], d["offset"]) == (100, 0)
        assert all("content" not in n for n in d["notes"])
        assert set(d["notes"][0]) == {"path", "title", "size", "modified", "etag"}
        page = data(client.get(f"{API}/notes?limit=2&offset=1"))
        assert [n["path"] for n in page["notes"]] == ["notes/b/y.md", "notes/b/z.md"]
        assert page["total"] == 5
        sub = data(client.get(f"{API}/notes?folder=notes/b"))
        assert [n["path"] for n in sub["notes"]] == ["notes/b/y.md", "notes/b/z.md"]

    @pytest.mark.parametrize(
        "query",
        ["limit=0", "limit=1001", "limit=abc", "offset=-1", "folder=../x", "folder=other"],
    )
    def test_list_bad_parameters_are_400(self, client, query):
        resp = client.get(f"{API}/notes?{query}", status=400)
        assert_error(resp, 400, "VALIDATION_ERROR")

    def test_list_missing_folder_is_404(self, client):
        assert_error(client.get(f"{API}/notes?folder=notes/nope", status=404), 404, "NOT_FOUND")

    def test_update_replaces_content(self, client, root):
        put_note(client, "notes/u.md", "old")
        resp = client.put_json(note_url("notes/u.md"), {"content": "# New\nnew"})
        rec = data(resp)
        assert rec["content"] == "# New\nnew"
        assert rec["title"] == "New"
        assert resp.headers["ETag"] == rec["etag"]
        assert (root / "notes" / "u.md").read_text() == "# New\nnew"

    def test_update_missing_is_404_not_upsert(self, client, root):
        resp = client.put_json(note_url("notes/ghost.md"), {"content": "x"}, status=404)
        assert_error(resp, 404, "NOT_FOUND")
        assert not (root / "notes" / "ghost.md").exists()

    def test_update_with_other_path_points_at_move(self, client):
        put_note(client, "notes/p.md")
        resp = client.put_json(
            note_url("notes/p.md"), {"content": "x", "path": "notes/q.md"}, status=400
        )
        assert "/move" in assert_error(resp, 400, "VALIDATION_ERROR")["message"]
        client.put_json(note_url("notes/p.md"), {"content": "x", "path": "notes/p.md"})

    def test_update_without_content_is_400(self, client):
        put_note(client, "notes/p.md")
        resp = client.put_json(note_url("notes/p.md"), {"text": "x"}, status=400)
        assert_error(resp, 400, "VALIDATION_ERROR")

    def test_move_returns_record_with_from_and_prunes_folders(self, client, root):
        put_note(client, "notes/old/deep/m.md", "moving")
        rec = data(
            client.patch_json(
                note_url("notes/old/deep/m.md") + "/move", {"path": "notes/new/m2.md"}
            )
        )
        assert rec["path"] == "notes/new/m2.md"
        assert rec["from"] == "notes/old/deep/m.md"
        assert rec["content"] == "moving"
        assert (root / "notes" / "new" / "m2.md").read_text() == "moving"
        assert not (root / "notes" / "old").exists()
        assert (root / "notes").is_dir()

    def test_move_missing_is_404(self, client):
        resp = client.patch_json(
            note_url("notes/none.md") + "/move", {"path": "notes/x.md"}, status=404
        )
        assert_error(resp, 404, "NOT_FOUND")

    def test_move_never_overwrites(self, client, root):
        put_note(client, "notes/a.md", "A")
        put_note(client, "notes/b.md", "B")
        resp = client.patch_json(
            note_url("notes/a.md") + "/move", {"path": "notes/b.md"}, status=409
        )
        assert_error(resp, 409, "CONFLICT")
        assert (root / "notes" / "a.md").read_text() == "A"
        assert (root / "notes" / "b.md").read_text() == "B"

    @pytest.mark.parametrize("body", [{}, {"path": 3}, {"path": "notes/../x.md"}])
    def test_move_bad_body_is_400(self, client, body):
        put_note(client, "notes/a.md")
        resp = client.patch_json(note_url("notes/a.md") + "/move", body, status=400)
        assert_error(resp, 400, "VALIDATION_ERROR")

    def test_delete_moves_to_trash_and_prunes(self, client, root):
        put_note(client, "notes/gone/soon.md", "keep me somewhere")
        d = data(client.delete(note_url("notes/gone/soon.md")))
        assert d["path"] == "notes/gone/soon.md"
        assert d["deleted"] is True
        assert not (root / "notes" / "gone").exists()
        trashed = list((root / ".notesvc" / "trash").glob("*/notes/gone/soon.md"))
        assert len(trashed) == 1
        assert trashed[0].read_text() == "keep me somewhere"
        assert re.fullmatch(r"\d{8}T\d{6}\.\d{6}Z", trashed[0].parents[2].name)
        client.get(note_url("notes/gone/soon.md"), status=404)
        assert_error(client.delete(note_url("notes/gone/soon.md"), status=404), 404, "NOT_FOUND")

    def test_delete_twice_keeps_both_versions_in_trash(self, client, root):
        for text in ("one", "two"):
            put_note(client, "notes/t.md", text)
            client.delete(note_url("notes/t.md"))
        trashed = sorted(p.read_text() for p in (root / ".notesvc" / "trash").rglob("t.md"))
        assert trashed == ["one", "two"]

    def test_invalid_utf8_on_disk_is_a_clear_error(self, client, root):
        (root / "notes" / "bin.md").write_bytes(b"caf\xe9")
        resp = client.get(note_url("notes/bin.md"), status=409)
        assert "UTF-8" in assert_error(resp, 409, "CONFLICT")["message"]
        listed = data(client.get(f"{API}/notes"))["notes"]
        assert [n["path"] for n in listed] == ["notes/bin.md"]
        client.put_json(note_url("notes/bin.md"), {"content": "café"})  # fixing it works
        assert data(client.get(note_url("notes/bin.md")))["content"] == "café"

    def test_external_edits_are_seen_at_once(self, client, root):
        put_note(client, "notes/ext.md", "ours")
        (root / "notes" / "ext.md").write_text("# Theirs\nchanged by vim")
        (root / "notes" / "added").mkdir()
        (root / "notes" / "added" / "new.md").write_text("from syncthing")
        assert data(client.get(note_url("notes/ext.md")))["title"] == "Theirs"
        paths = [n["path"] for n in data(client.get(f"{API}/notes"))["notes"]]
        assert paths == ["notes/added/new.md", "notes/ext.md"]
        tree = data(client.get(f"{API}/folders/tree"))
        assert [c["name"] for c in tree["children"]] == ["added", "ext.md"]
        (root / "notes" / "ext.md").unlink()
        client.get(note_url("notes/ext.md"), status=404)
        assert data(client.get(f"{API}/notes"))["total"] == 1


class TestNotesForPeople:
    """Notes without paths, listings by date with titles and previews (CONTRACT 24)."""

    @pytest.mark.parametrize(
        ("content", "name"),
        [
            ("# Apple pie\n\nflour\n", "Apple pie"),
            ("\n\nBuy milk: 2 l / 3 eggs?\nmore\n", "Buy milk 2 l 3 eggs"),
            ("some intro\n\n## Plan for May\n", "Plan for May"),
            ("---\ntitle: x\n---\nAfter the front matter\n", "After the front matter"),
            ("#!?*\n", "#!"),
            ("...\n", "untitled"),
            ("", "untitled"),
            ("\u202eevil\u202c name\u200b\n", "evil name"),
            ("# שלום עולם\n", "שלום עולם"),
            ("# 🍎 pie 🥧\n", "🍎 pie 🥧"),
            ("# Cafe\u0301\n", "Café"),
            ("   ..hidden.  \n", "hidden"),
        ],
    )
    def test_a_note_without_a_path_is_named_from_its_title(self, client, content, name):
        rec = data(client.post_json(f"{API}/notes", {"content": content}, status=201))
        assert rec["path"] == f"notes/inbox/{name}.md"
        assert rec["content"] == content

    def test_long_titles_are_cut_and_taken_names_numbered(self, client, root):
        long = "word " * 1000
        rec = data(client.post_json(f"{API}/notes", {"content": long}, status=201))
        name = rec["path"][len("notes/inbox/") : -3]
        assert len(name) <= 80
        assert len(name.encode()) <= 200
        put_note(client, "notes/ideas/Pie.md", "# Pie\n\nmine")
        paths = [
            data(client.post_json(f"{API}/notes", {"content": "# Pie\n", "folder": "notes/ideas"}))[
                "path"
            ]
            for _ in range(2)
        ]
        assert paths == ["notes/ideas/Pie 2.md", "notes/ideas/Pie 3.md"]
        assert (root / "notes" / "ideas" / "Pie.md").read_text() == "# Pie\n\nmine"  # untouched

    def test_a_folder_key_writes_into_its_own_folder(self, client, anon):
        key = with_key(anon, new_grant(client, "write", "notes/family")["key"])
        rec = data(key.post_json(f"{API}/notes", {"content": "# Gifts\n"}, status=201))
        assert rec["path"] == "notes/family/Gifts.md"
        rec = data(key.post_json(f"{API}/notes", {"content": "# Up\n", "folder": "notes"}))
        assert rec["path"] == "notes/family/Up.md"
        resp = key.post_json(
            f"{API}/notes", {"content": "# Out\n", "folder": "notes/work"}, status=404
        )
        assert_error(resp, 404, "NOT_FOUND")

    def test_the_listing_for_people_newest_first_with_previews_and_tags(self, client, root):
        for i, name in enumerate(("old", "mid", "new")):
            put_note(client, f"notes/{name}.md", f"# {name.title()}\n\n**Note** {i} #tag{i}\n")
            os.utime(root / "notes" / f"{name}.md", (1_700_000_000 + i, 1_700_000_000 + i))
        listing = data(client.get(f"{API}/notes?sort=modified&fields=title,preview,modified,tags"))
        assert [n["title"] for n in listing["notes"]] == ["New", "Mid", "Old"]
        assert listing["notes"][0]["preview"] == "Note 2 #tag2"
        assert listing["notes"][0]["tags"] == ["tag2"]
        assert "content" not in listing["notes"][0]
        plain = data(client.get(f"{API}/notes"))
        assert [n["path"] for n in plain["notes"]] == [
            "notes/mid.md",
            "notes/new.md",
            "notes/old.md",
        ]
        assert "preview" not in plain["notes"][0]
        for bad in ("sort=size", "fields=content", "fields=title,secret"):
            assert_error(client.get(f"{API}/notes?{bad}", status=400), 400, "VALIDATION_ERROR")


MERGE_CASES = [
    # (what, base, current, edit, merged text or None for a conflict)
    ("disjoint", "a\nb\nc\nd\n", "A\nb\nc\nd\n", "a\nb\nc\nD\n", "A\nb\nc\nD\n"),
    ("adjacent lines", "a\nb\nc\n", "A\nb\nc\n", "a\nB\nc\n", "A\nB\nc\n"),
    ("the same line", "a\nb\nc\n", "a\nX\nc\n", "a\nY\nc\n", None),
    ("the same change twice", "a\nb\n", "a\nB\n", "a\nB\n", "a\nB\n"),
    ("a deletion and an edit elsewhere", "a\nb\nc\n", "a\nc\n", "a\nb\nC\n", "a\nC\n"),
    ("a deletion of what the edit changed", "a\nb\nc\n", "a\nc\n", "a\nB\nc\n", None),
    ("both append", "a\n", "a\nb\n", "a\nc\n", None),
    ("one appends, one prepends", "a\n", "a\nz\n", "0\na\n", "0\na\nz\n"),
    ("CRLF against LF", "a\nb\nc\n", "a\r\nb\r\nc\r\n", "a\nb\nC\n", "a\r\nb\r\nC\n"),
    ("no newline at the end", "a\nb", "a\nb\nc", "A\nb", "A\nb\nc\n"),
    ("an empty base", "", "x\n", "x\n", "x\n"),
    ("nothing changed", "a\n", "a\n", "a\n", "a\n"),
    ("an applied edit sent again", "a\nb\n", "a\nB\nc\n", "a\nb\nc\n", "a\nB\nc\n"),
]


class TestMerge:
    """POST /notes/:path/merge: an edit made from an older version, merged three ways."""

    @pytest.mark.parametrize(
        ("what", "base", "current", "edit", "merged"), MERGE_CASES, ids=[c[0] for c in MERGE_CASES]
    )
    def test_merge3(self, what, base, current, edit, merged):
        text, clash = notesvc.merge3(base, current, edit)
        if merged is None:
            assert clash
            assert text.replace("\r", "") != edit.replace("\r", "")  # current's side kept
        else:
            assert (text, clash) == (merged, False)

    def etag_after(self, client, path: str, content: str) -> str:
        return put_note(client, path, content).json["data"]["etag"]

    @pytest.mark.parametrize(
        ("what", "base", "current", "edit", "merged"),
        [c for c in MERGE_CASES if c[1]],
        ids=[c[0] for c in MERGE_CASES if c[1]],
    )
    def test_merge_over_http(self, client, root, what, base, current, edit, merged):
        url = note_url("notes/m.md")
        start = self.etag_after(client, "notes/m.md", base)
        client.put_json(url, {"content": current})
        resp = client.post_json(
            f"{url}/merge", {"base": start, "content": edit}, status=409 if merged is None else 200
        )
        if merged is None:
            err = assert_error(resp, 409, "CONFLICT")
            assert err["path"] == "notes/m.md"
            assert re.fullmatch(
                r"notes/m \(conflict owner \d{4}-\d\d-\d\d \d\d-\d\d UTC\)\.md", err["conflictPath"]
            )
            assert (root / err["conflictPath"]).read_text() == edit  # the edit is safe
            assert (root / "notes" / "m.md").read_text() == current  # and nothing else changed
        else:
            got = data(resp)
            assert got["merged"] == (merged != edit or current != base)
            assert (root / "notes" / "m.md").read_bytes().decode() == merged
            assert resp.headers["ETag"] == got["note"]["etag"]

    def test_a_current_base_is_a_plain_write_and_a_merge_is_a_version(self, client):
        url = note_url("notes/m.md")
        base = self.etag_after(client, "notes/m.md", "a\nb\n")
        got = data(client.post_json(f"{url}/merge", {"base": base, "content": "a\nB\n"}))
        assert got["merged"] is False
        client.put_json(url, {"content": "A\nB\n"})
        got = data(
            client.post_json(f"{url}/merge", {"base": got["note"]["etag"], "content": "a\nB\nc\n"})
        )
        assert got == {**got, "merged": True}
        assert got["note"]["content"] == "A\nB\nc\n"
        reasons = [v["reason"] for v in data(client.get(f"{url}/versions"))["versions"]]
        assert reasons[0] == "merged"

    def test_a_base_from_another_note_or_gone_from_history_is_a_conflict(self, make_app, root):
        client = with_key(make_app(SERVICE_HISTORY_MAX_VERSIONS="0"))
        other = self.etag_after(client, "notes/other.md", "x\n")
        url = note_url("notes/m.md")
        self.etag_after(client, "notes/m.md", "a\n")
        client.put_json(url, {"content": "b\n"})
        for base in (other, '"' + "0" * 32 + '"'):
            resp = client.post_json(f"{url}/merge", {"base": base, "content": "c\n"}, status=409)
            copy = assert_error(resp, 409, "CONFLICT")["conflictPath"]
            assert (root / copy).read_text() == "c\n"
        assert (root / "notes" / "m.md").read_text() == "b\n"

    def test_an_unknown_base_with_the_text_already_there_is_no_conflict(self, client, root):
        url = note_url("notes/m.md")
        self.etag_after(client, "notes/m.md", "b\n")
        got = data(
            client.post_json(f"{url}/merge", {"base": '"' + "0" * 32 + '"', "content": "b\n"})
        )
        assert got["merged"] is False
        assert got["note"]["content"] == "b\n"
        assert sorted(p.name for p in (root / "notes").iterdir()) == ["m.md"]  # no copy

    def test_a_conflict_copy_of_a_note_with_a_long_name_fits_the_name_rule(self, client, root):
        name = "ä" * 120  # 240 bytes: no room left for " (conflict ...)" as it is
        url = note_url(f"notes/{name}.md")
        self.etag_after(client, f"notes/{name}.md", "a\n")
        client.put_json(url, {"content": "b\n"})
        resp = client.post_json(
            f"{url}/merge", {"base": '"' + "0" * 32 + '"', "content": "c\n"}, status=409
        )
        copy = assert_error(resp, 409, "CONFLICT")["conflictPath"]
        assert len(copy.rsplit("/", 1)[1].encode()) <= 255
        assert "(conflict owner" in copy
        assert (root / copy).read_text() == "c\n"

    def test_an_edit_by_another_program_not_yet_rescanned_is_merged(self, client, root):
        # vim replaced the note on disk; the server still knows what was there (its copy)
        url = note_url("notes/m.md")
        base = self.etag_after(client, "notes/m.md", "a\nb\nc\nd\n")
        (root / "notes" / "m.md").write_text("A\nb\nc\nd\n")
        got = data(client.post_json(f"{url}/merge", {"base": base, "content": "a\nb\nc\nD\n"}))
        assert got["merged"] is True
        assert (root / "notes" / "m.md").read_text() == "A\nb\nc\nD\n"
        reasons = [v["reason"] for v in data(client.get(f"{url}/versions"))["versions"]]
        assert "merged" in reasons

    def test_two_devices_autosaving_at_once_lose_nothing(self, client, root):
        url = note_url("notes/m.md")
        lines = [f"line {i}\n" for i in range(20)]
        base = self.etag_after(client, "notes/m.md", "".join(lines))
        edits = []
        for k in range(2):  # each changes its own half
            mine = lines[:]
            for i in range(k * 10, k * 10 + 10):
                mine[i] = f"line {i} by device {k}\n"
            edits.append("".join(mine))
        results = []

        def save(edit):
            results.append(client.post_json(f"{url}/merge", {"base": base, "content": edit}).json)

        threads = [threading.Thread(target=save, args=(e,)) for e in edits]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        text = (root / "notes" / "m.md").read_text()
        assert all(f"line {i} by device {i // 10}" in text for i in range(20))
        assert not list((root / "notes").glob("m (conflict*"))

    def test_an_outbox_replayed_twice_does_nothing_twice(self, client, root):
        url = note_url("notes/m.md")
        base = self.etag_after(client, "notes/m.md", "a\nb\n")
        client.put_json(url, {"content": "a\nB\n"})
        once = {"Idempotency-Key": "outbox-7"}
        first = client.post_json(
            f"{url}/merge", {"base": base, "content": "a\nb\nc\n"}, headers=once
        )
        again = client.post_json(
            f"{url}/merge", {"base": base, "content": "a\nb\nc\n"}, headers=once
        )
        assert first.json == again.json
        assert (root / "notes" / "m.md").read_text() == "a\nB\nc\n"
        # without the key, a replay of an applied edit merges to the same text: no paragraph twice
        client.post_json(f"{url}/merge", {"base": base, "content": "a\nb\nc\n"})
        assert (root / "notes" / "m.md").read_text() == "a\nB\nc\n"
        made = {"Idempotency-Key": "outbox-8"}
        for _ in range(2):
            client.post_json(f"{API}/notes", {"content": "# Offline\n"}, headers=made, status=201)
        assert sorted(p.name for p in (root / "notes" / "inbox").iterdir()) == ["Offline.md"]
        bad = {"Idempotency-Key": "x" * 101}
        resp = client.post_json(f"{API}/notes", {"content": "# B\n"}, headers=bad, status=400)
        assert_error(resp, 400, "VALIDATION_ERROR")

    def test_one_key_sent_twice_at_once_is_done_once(self, client, root):
        # two tabs sending one outbox: the second waits for the first's answer
        once = {"Idempotency-Key": "outbox-9"}
        answers = []

        def create():
            resp = client.post_json(f"{API}/notes", {"content": "# Twice\n"}, headers=once)
            answers.append(resp.json)

        threads = [threading.Thread(target=create) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [p.name for p in (root / "notes" / "inbox").iterdir()] == ["Twice.md"]
        assert all(a == answers[0] for a in answers)

    @pytest.mark.parametrize(
        ("body", "status"),
        [
            ({"content": "x"}, 400),
            ({"base": 7, "content": "x"}, 400),
            ({"base": '"abc"', "content": 5}, 400),
            ({"base": "x" * 101, "content": "x"}, 400),
        ],
    )
    def test_bad_merges_are_refused(self, client, body, status):
        put_note(client, "notes/m.md", "a\n")
        resp = client.post_json(f"{note_url('notes/m.md')}/merge", body, status=status)
        assert_error(resp, status, "VALIDATION_ERROR")

    def test_a_merge_needs_the_note_and_write(self, client, anon):
        resp = client.post_json(
            f"{note_url('notes/none.md')}/merge", {"base": '"x"', "content": "x"}, status=404
        )
        assert_error(resp, 404, "NOT_FOUND")
        put_note(client, "notes/m.md", "a\n")
        reader = with_key(anon, new_grant(client, "read")["key"])
        reader.post_json(
            f"{note_url('notes/m.md')}/merge", {"base": '"x"', "content": "x"}, status=403
        )


class TestIfMatch:
    def test_put_with_matching_etag_succeeds_and_stale_is_412(self, client):
        etag = data(put_note(client, "notes/m.md", "v1"))["etag"]
        new = client.put_json(note_url("notes/m.md"), {"content": "v2"}, headers={"If-Match": etag})
        resp = client.put_json(
            note_url("notes/m.md"), {"content": "v3"}, headers={"If-Match": etag}, status=412
        )
        assert_error(resp, 412, "PRECONDITION_FAILED")
        assert data(client.get(note_url("notes/m.md")))["content"] == "v2"
        client.put_json(
            note_url("notes/m.md"), {"content": "v3"}, headers={"If-Match": new.headers["ETag"]}
        )

    def test_star_and_lists_and_unquoted(self, client):
        etag = data(put_note(client, "notes/m.md", "v1"))["etag"]
        client.put_json(note_url("notes/m.md"), {"content": "v2"}, headers={"If-Match": "*"})
        etag = client.get(note_url("notes/m.md")).headers["ETag"]
        client.put_json(
            note_url("notes/m.md"), {"content": "v3"}, headers={"If-Match": f'"nope", {etag}'}
        )
        etag = client.get(note_url("notes/m.md")).headers["ETag"]
        client.put_json(
            note_url("notes/m.md"), {"content": "v4"}, headers={"If-Match": etag.strip('"')}
        )

    def test_move_and_delete_honour_if_match(self, client, root):
        put_note(client, "notes/m.md", "v1")
        stale = '"0000"'
        resp = client.patch_json(
            note_url("notes/m.md") + "/move",
            {"path": "notes/n.md"},
            headers={"If-Match": stale},
            status=412,
        )
        assert_error(resp, 412, "PRECONDITION_FAILED")
        assert_error(
            client.delete(note_url("notes/m.md"), headers={"If-Match": stale}, status=412),
            412,
            "PRECONDITION_FAILED",
        )
        assert (root / "notes" / "m.md").exists()
        etag = client.get(note_url("notes/m.md")).headers["ETag"]
        client.patch_json(
            note_url("notes/m.md") + "/move", {"path": "notes/n.md"}, headers={"If-Match": etag}
        )
        client.delete(note_url("notes/n.md"), headers={"If-Match": etag})

    def test_two_writers_with_same_etag_exactly_one_wins(self, client):
        etag = data(put_note(client, "notes/race.md", "start"))["etag"]
        barrier = threading.Barrier(2)
        results = []

        def writer(text):
            app = webtest.TestApp(client.app, extra_environ=client.extra_environ)
            barrier.wait()
            resp = app.put_json(
                note_url("notes/race.md"),
                {"content": text},
                headers={"If-Match": etag},
                expect_errors=True,
            )
            results.append((resp.status_int, text))

        threads = [threading.Thread(target=writer, args=(t,)) for t in ("left", "right")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(s for s, _ in results) == [200, 412]
        winner = next(text for s, text in results if s == 200)
        assert data(client.get(note_url("notes/race.md")))["content"] == winner


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


class TestHostilePaths:
    @pytest.mark.parametrize(("path", "rule"), HOSTILE_PATHS)
    def test_body_path_is_refused_naming_the_rule(self, client, root, path, rule):
        resp = client.post_json(f"{API}/notes", {"path": path, "content": "x"}, status=400)
        assert rule in assert_error(resp, 400, "VALIDATION_ERROR")["message"]
        assert not (root / "etc").exists()

    @pytest.mark.parametrize(("path", "rule"), [p for p in HOSTILE_PATHS if "\x00" not in p[0]])
    def test_url_path_is_refused(self, client, path, rule):
        resp = client.get(
            f"{API}/notes/" + urllib.parse.quote(path, safe=""), status="*", expect_errors=True
        )
        # An empty or bare path is no note route at all; everything else is a 400.
        assert resp.status_int in (400, 404) if path in ("", "notes/") else resp.status_int == 400
        assert resp.json["success"] is False

    @pytest.mark.parametrize(
        "raw",
        [
            "/api/v1/notes/notes%2F%2E%2E%2F%2E%2E%2Fsecret.md",
            "/api/v1/notes/notes%2F..%2Fsecret.md",
            "/api/v1/notes/notes/%2e%2e/secret.md",
            "/api/v1/notes/%2Fetc%2Fpasswd",
            "/api/v1/notes/notes%5C..%5Csecret.md",
            "/api/v1/notes/notes%2Fa%00.md",
        ],
    )
    def test_encoded_traversal_in_url_is_400(self, client, raw):
        assert_error(client.get(raw, status=400), 400, "VALIDATION_ERROR")

    def test_symlink_escape_is_refused(self, client, root, tmp_path):
        outside = tmp_path / "outside"
        outside.mkdir()
        (outside / "secret.md").write_text("top secret")
        os.symlink(outside, root / "notes" / "link")
        os.symlink(outside / "secret.md", root / "notes" / "file.md")
        for path in ("notes/link/secret.md", "notes/file.md"):
            resp = client.get(note_url(path), status=400)
            assert "outside" in assert_error(resp, 400, "VALIDATION_ERROR")["message"]
            assert "top secret" not in resp.text
        resp = client.post_json(
            f"{API}/notes", {"path": "notes/link/new.md", "content": "x"}, status=400
        )
        assert_error(resp, 400, "VALIDATION_ERROR")
        assert sorted(os.listdir(outside)) == ["secret.md"]
        resp = client.put_json(note_url("notes/file.md"), {"content": "pwned"}, status=400)
        assert (outside / "secret.md").read_text() == "top secret"
        listed = data(client.get(f"{API}/notes"))
        assert listed["total"] == 0  # links are not followed in listings
        assert "secret" not in client.get(f"{API}/folders/tree").text

    def test_a_link_inside_the_folder_is_read_and_one_planted_later_is_refused(
        self, client, root, tmp_path
    ):
        """The descriptor is opened, then the kernel says where it leads (/proc/self/fd on
        Linux): a link that stays inside is read, one leading out is 400, and a note read
        before (kept by the read cache) that becomes such a link is refused, not served."""
        put_note(client, "notes/real/a.md", "# A\n\ninside")
        os.symlink(root / "notes" / "real", root / "notes" / "alias")
        assert data(client.get(note_url("notes/alias/a.md")))["content"] == "# A\n\ninside"
        outside = tmp_path / "outside"
        outside.mkdir()
        (outside / "b.md").write_text("top secret")
        put_note(client, "notes/b.md", "mine")
        old = time.time() - 60
        os.utime(root / "notes" / "b.md", (old, old))
        store = client.app.service.notes
        store.cache.RACY_SECONDS = 0  # ctime cannot be set back: keep it even though new
        assert data(client.get(note_url("notes/b.md")))["content"] == "mine"
        assert "notes/b.md" in store.cache._items
        os.unlink(root / "notes" / "b.md")
        os.symlink(outside / "b.md", root / "notes" / "b.md")
        resp = client.get(note_url("notes/b.md"), status=400)
        assert "outside" in assert_error(resp, 400, "VALIDATION_ERROR")["message"]
        assert "top secret" not in resp.text
        os.symlink(outside / "gone", root / "notes" / "dangling.md")  # 400, not 404
        assert_error(client.get(note_url("notes/dangling.md"), status=400), 400, "VALIDATION_ERROR")

    def test_the_read_cache_gives_a_note_again_only_while_its_file_is_unchanged(self, client, root):
        store = client.app.service.notes
        put_note(client, "notes/c.md", "# C\n\none")
        path = root / "notes" / "c.md"
        assert data(client.get(note_url("notes/c.md")))["content"] == "# C\n\none"
        assert "notes/c.md" not in store.cache._items  # written just now: racy, not kept
        store.cache.RACY_SECONDS = 0
        client.get(note_url("notes/c.md"))
        assert "notes/c.md" in store.cache._items
        mtime = path.stat().st_mtime_ns
        with open(path, "r+b") as f:  # another editor, in place, same size, same mtime
            f.write(b"# C\n\ntwo")
        os.utime(path, ns=(mtime, mtime))
        got = data(client.get(note_url("notes/c.md")))
        assert got["content"] == "# C\n\ntwo"  # ctime changed: read again
        assert got["etag"] == notesvc.make_etag(b"# C\n\ntwo")
        update(client, "notes/c.md", "# C\n\nthree")  # our own write: a new inode
        assert data(client.get(note_url("notes/c.md")))["content"] == "# C\n\nthree"
        path.unlink()
        assert_error(client.get(note_url("notes/c.md"), status=404), 404, "NOT_FOUND")

    def test_the_read_cache_holds_at_most_its_budget(self):
        cache = notesvc.ReadCache()
        cache.RACY_SECONDS = 0
        cache.MAX_BYTES = 1000
        for i in range(30):
            fake = types.SimpleNamespace(
                st_dev=1, st_ino=i, st_size=100, st_mtime_ns=0, st_ctime_ns=0
            )
            cache.put(f"notes/{i}.md", fake, {"content": "x" * 100})
        assert len(cache._items) == 10
        assert cache._bytes == 1000
        assert next(iter(cache._items)) == "notes/20.md"  # the least recent went first
        big = types.SimpleNamespace(
            st_dev=1, st_ino=99, st_size=cache.MAX_NOTE_BYTES + 1, st_mtime_ns=0, st_ctime_ns=0
        )
        cache.put("notes/big.md", big, {})
        assert "notes/big.md" not in cache._items

    def test_the_read_cache_keeps_a_gets_answer_once_and_counts_it(self, tmp_path):
        cache = notesvc.ReadCache()
        cache.RACY_SECONDS = 0
        files = {}
        for name in ("a", "b"):
            files[name] = tmp_path / f"{name}.md"
            files[name].write_text(name * 100)
            os.utime(files[name], (time.time() - 60,) * 2)
        rec = {"path": "notes/a.md", "etag": '"ea"', "content": "a" * 100}
        assert cache.answer("notes/a.md", files["a"]) is None  # nothing kept yet
        cache.put("notes/a.md", files["a"].stat(), rec)
        etag, body = cache.answer("notes/a.md", files["a"])
        assert etag == '"ea"'
        assert json.loads(body) == {"success": True, "data": rec}
        assert cache._bytes == 100 + len(body)
        assert cache.answer("notes/a.md", files["a"])[1] is body  # encoded once
        cache.MAX_BYTES = 100 + len(body) + 99  # b's 100 bytes do not fit beside a's answer
        cache.put("notes/b.md", files["b"].stat(), {"etag": '"eb"'})
        assert list(cache._items) == ["notes/b.md"]
        assert cache._bytes == 100
        cache.put("notes/a.md", files["a"].stat(), rec)
        files["a"].write_text("c" * 100)  # changed on disk: no answer kept for it
        assert cache.answer("notes/a.md", files["a"]) is None

    def test_move_target_is_checked_too(self, client, root, tmp_path):
        put_note(client, "notes/a.md")
        outside = tmp_path / "outside"
        outside.mkdir()
        os.symlink(outside, root / "notes" / "link")
        for target in ("../a.md", "notes/../a.md", "notes/link/a.md"):
            resp = client.patch_json(note_url("notes/a.md") + "/move", {"path": target}, status=400)
            assert_error(resp, 400, "VALIDATION_ERROR")
        assert os.listdir(outside) == []

    def test_file_standing_where_a_folder_should_be_is_409(self, client):
        put_note(client, "notes/a.md")
        (client.app.service.notes.root / "plain").write_text("file")
        resp = client.post_json(
            f"{API}/notes", {"path": "notes/plain/x.md", "content": "x"}, status=409
        )
        assert_error(resp, 409, "CONFLICT")


SLOW_PLUGIN = """
import pathlib
import time
import notesvc

def build(notes):
    pathlib.Path(__file__).with_name("slow.started").touch()  # for the test to see
    time.sleep(1.5)  # a plugin's slow computation over the notes
    return len(notes)

def count(svc):
    return {"notes": notesvc.derived(svc, "slow-count", build)}

PLUGIN = notesvc.Plugin(name="slow", routes=(notesvc.PluginRoute("GET", "/count", count),))
"""


MiB = 1024 * 1024


BRACKET_NOTES = {  # 1 MiB notes that made the link scan quadratic
    "notes/open.md": "[" * MiB,
    "notes/wiki.md": "[[" * (MiB // 2),
    "notes/mixed.md": ("[](" * (MiB // 3) + "[[a|" + "](x.md" * 1000)[:MiB],
}


def timed(fn, *args):
    started = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - started


def tree_paths(node: dict) -> list:
    return [node["path"]] + [p for child in node.get("children", []) for p in tree_paths(child)]


def leftovers(root: Path) -> list:
    """Return temp files under the attachments and the notes (the state folder's index
    cache has its own, written in the background)."""
    return [
        p
        for top in (root / "attachments", root / "notes")
        for p in top.rglob("*")
        if p.name.startswith(".tmp-")
    ]


class TestStorageSafety:
    """Huge notes, full disks, NFD names and crash leftovers (issue 10, items 4, 9, 10)."""

    @pytest.mark.parametrize(
        "unit", ["[", "[[", "[](", "](x.md", "[[a#b|c", "[](<a", '[](x "', "`", "```\n", "#1"]
    )
    def test_link_and_tag_scans_grow_linearly(self, unit):
        resolver = notesvc.LinkResolver(["notes/x.md", "notes/a.md"])

        def scan(size: int) -> float:
            """This thread's CPU seconds for the scans: what the other tests running beside
            it (another worker, their servers) do to the machine does not count."""
            text = (unit * (size // len(unit) + 1))[:size]
            started = time.thread_time()
            resolver.links(text, "notes/s.md")
            notesvc.rewrite_links(text, "notes/s.md", "notes/x.md", "notes/y.md", resolver)
            notesvc.note_tags(text)
            notesvc.note_title(text, "notes/s.md")
            return time.thread_time() - started

        small, big = scan(100 * 1024), scan(MiB)  # rewrite_links reads the whole MiB
        assert big < 1.0, f"{unit!r}: {big:.2f} s for 1 MiB"
        assert big < 30 * small + 0.05, f"{unit!r}: {small:.3f} s -> {big:.3f} s is not linear"

    def test_heading_scan_is_linear(self):
        text = "# a" + " " * MiB + "b"
        title, took = timed(notesvc.note_title, text, "notes/x.md")
        assert title.startswith("a")
        assert took < 0.5

    def test_scans_read_at_most_the_cap(self):
        far = "x" * notesvc.MAX_SCAN_CHARS
        resolver = notesvc.LinkResolver(["notes/a.md"])
        assert resolver.links("[[a]] " + far, "notes/s.md") == {"notes/a.md"}
        assert resolver.links(far + " [[a]]", "notes/s.md") == set()
        assert notesvc.note_tags(far + " #late") == set()

    def test_huge_bracket_notes_link_move_and_search_fast(self, make_app):
        client = with_key(make_app(SERVICE_MAX_BODY_BYTES=str(4 * MiB)))
        put_note(client, "notes/target.md", "# Target\n\nzebra")
        for path, text in BRACKET_NOTES.items():
            _, took = timed(put_note, client, path, "[[target]] zebra\n" + text)
            assert took < 2.0, f"creating {path} took {took:.2f} s"
        resp, took = timed(client.get, f"{API}/plugins/backlinks/notes%2Ftarget.md")
        assert sorted(b["path"] for b in data(resp)["backlinks"]) == sorted(BRACKET_NOTES)
        assert took < 2.0, f"backlinks took {took:.2f} s"
        resp, took = timed(
            client.patch_json,
            note_url("notes/target.md") + "/move",
            {"path": "notes/moved.md", "updateLinks": True},
        )
        assert sorted(data(resp)["linksUpdated"]) == sorted(BRACKET_NOTES)
        assert took < 2.0, f"the move took {took:.2f} s"
        assert data(client.get(note_url("notes/open.md")))["content"].startswith("[[moved]] zebra")
        resp, took = timed(client.get, f"{API}/search?q=zebra")
        assert data(resp)["total"] == 4
        assert took < 2.0, f"search took {took:.2f} s"
        _, took = timed(client.get, f"{API}/plugins/tags")
        assert took < 2.0, f"tags took {took:.2f} s"

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_search_is_answered_while_links_and_plugins_build(self, tmp_path):
        plugins = tmp_path / ".notesvc" / "plugins"
        plugins.mkdir(parents=True)
        (plugins / "slow.py").write_text(SLOW_PLUGIN)
        env = {"SERVICE_MAX_BODY_BYTES": str(4 * MiB)}
        with running(tmp_path, "--auth-mode", "none", env=env) as server:
            server.request("POST", f"{API}/notes", {"path": "notes/a.md", "content": "# A"})
            for path, text in BRACKET_NOTES.items():
                status, _, _ = server.request(
                    "POST", f"{API}/notes", {"path": path, "content": "[[a]] zebra " + text}
                )
                assert status == 201
            waits = []
            results = {}

            def ask(name: str, path: str) -> None:
                results[name] = timed(server.request, "GET", path)

            builders = [
                threading.Thread(target=ask, args=("slow", f"{API}/plugins/slow/count")),
                threading.Thread(
                    target=ask, args=("links", f"{API}/plugins/backlinks/notes%2Fa.md")
                ),
            ]
            for t in builders:
                t.start()
            wait_for((plugins / "slow.started").exists)  # the slow build is under way
            for _ in range(3):
                (status, _, body), took = timed(server.request, "GET", f"{API}/search?q=zebra")
                assert status == 200
                assert body["data"]["total"] == 3
                waits.append(took)
            for t in builders:
                t.join(30)
            assert results["slow"][0][2]["data"] == {"notes": 4}
            assert results["slow"][1] >= 1.5  # the build did run while we searched
            status, _, body = results["links"][0]
            assert status == 200
            assert sorted(b["path"] for b in body["data"]["backlinks"]) == sorted(BRACKET_NOTES)
            assert max(waits) < 0.5, f"searches waited {waits} during the builds"

    def test_disk_full_guard_turns_enospc_and_edquot_into_507(self):
        import errno

        for code in (errno.ENOSPC, errno.EDQUOT):
            with pytest.raises(notesvc.ApiError) as caught, notesvc.disk_writes():
                raise OSError(code, os.strerror(code))
            assert caught.value.status_code == 507
            assert caught.value.code == "INSUFFICIENT_STORAGE"
            assert caught.value.message == "the disk is full; nothing was changed"
            assert isinstance(caught.value, OSError)  # background savers still just log it
        with pytest.raises(PermissionError), notesvc.disk_writes():
            raise PermissionError(errno.EACCES, "denied")

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_full_disk_is_507_and_changes_nothing_real_server(self, tmp_path):
        if os.geteuid() != 0 or not shutil.which("mount"):
            pytest.skip("mounting a small tmpfs needs root")
        disk = tmp_path / "disk"
        disk.mkdir()
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)],
            capture_output=True,
            timeout=10,
        )
        if mounted.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode()[:200]}")
        try:
            with running(disk, "--auth-mode", "none") as server:
                url = note_url("notes/keep.md")
                status, _, _ = server.request(
                    "POST", f"{API}/notes", {"path": "notes/keep.md", "content": "old content"}
                )
                assert status == 201
                wait_for((disk / ".notesvc" / "index").is_dir)  # the index is open
                filler = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
                try:  # fill the disk to the last block
                    with contextlib.suppress(OSError):
                        while True:
                            os.write(filler, b"\0" * 4096)
                finally:
                    os.close(filler)
                big = "new content " * 2000
                status, _, body = server.request("PUT", url, {"content": big})
                assert status == 507, body
                assert body["error"] == {
                    "code": "INSUFFICIENT_STORAGE",
                    "message": "the disk is full; nothing was changed",
                }
                status, _, body = server.request(
                    "POST", f"{API}/notes", {"path": "notes/new/deep/x.md", "content": big}
                )
                assert status == 507
                assert (disk / "notes" / "keep.md").read_text() == "old content"
                assert not (disk / "notes" / "new").exists()
                leftovers = [p for p in disk.rglob("*") if p.name.startswith(".tmp-")]
                assert leftovers == []
                status, _, body = server.request("GET", url)
                assert status == 200
                assert body["data"]["content"] == "old content"
                status, _, body = server.request("GET", f"{API}/search?q=old")
                assert status == 200
                assert body["data"]["total"] == 1
            assert "Traceback" not in "".join(server.lines)
        finally:
            subprocess.run(["umount", str(disk)], capture_output=True, timeout=10)

    def test_nfd_named_note_is_reached_through_its_nfc_path(self, client, root):
        import unicodedata

        nfc_folder, nfc_name = "Café", "crème brûlée.md"
        nfd_folder = unicodedata.normalize("NFD", nfc_folder)
        nfd_name = unicodedata.normalize("NFD", nfc_name)
        assert nfd_name != nfc_name
        folder = root / "notes" / nfd_folder
        folder.mkdir(parents=True)
        (folder / nfd_name).write_text("# Dessert\n\ncaramelised sugar")
        client.app.service.sync_index()
        path = f"notes/{nfc_folder}/{nfc_name}"

        rec = data(client.get(note_url(path)))
        assert rec["path"] == path
        assert "caramelised" in rec["content"]
        assert [n["path"] for n in data(client.get(f"{API}/notes"))["notes"]] == [path]
        assert path in tree_paths(data(client.get(f"{API}/folders/tree")))
        assert [r["path"] for r in search(client, "caramelised")["results"]] == [path]

        client.put_json(note_url(path), {"content": "# Dessert\n\nburnt sugar"})
        assert os.listdir(root / "notes") == [nfd_folder]  # no NFC twin of the folder
        assert os.listdir(folder) == [nfd_name]  # updated in place, no duplicate
        assert (folder / nfd_name).read_text() == "# Dessert\n\nburnt sugar"
        assert [r["path"] for r in search(client, "burnt")["results"]] == [path]
        assert (
            client.post_json(f"{API}/notes", {"path": path, "content": "x"}, status=409).json[
                "error"
            ]["code"]
            == "CONFLICT"
        )

        moved = f"notes/{nfc_folder}/tarte.md"
        rec = data(client.patch_json(note_url(path) + "/move", {"path": moved}))
        assert rec["from"] == path
        assert sorted(os.listdir(folder)) == ["tarte.md"]  # into the NFD folder itself
        data(client.delete(note_url(moved)))
        assert not folder.exists()
        assert data(client.get(f"{API}/notes"))["total"] == 0

    def test_nfd_note_is_deleted_through_its_nfc_path(self, client, root):
        import unicodedata

        nfd = unicodedata.normalize("NFD", "é.md")
        (root / "notes").mkdir(parents=True, exist_ok=True)
        (root / "notes" / nfd).write_text("x")
        data(client.delete(note_url("notes/é.md")))
        assert os.listdir(root / "notes") == []

    def test_openapi_states_the_real_bounds_and_507(self, client):
        doc = client.get(f"{API}/openapi.json").json
        error = doc["components"]["schemas"]["Error"]["properties"]["error"]
        assert "INSUFFICIENT_STORAGE" in error["properties"]["code"]["enum"]
        listing = doc["paths"]["/api/v1/notes"]["get"]
        assert "507" in listing["responses"]["default"]["description"]
        params = {p["name"]: p["schema"] for p in listing["parameters"]}
        assert (params["limit"]["minimum"], params["limit"]["maximum"]) == (1, 1000)
        assert (params["offset"]["minimum"], params["offset"]["maximum"]) == (0, 10**9)
        search_params = doc["paths"]["/api/v1/search"]["get"]["parameters"]
        found = {p["name"]: p["schema"] for p in search_params}
        assert (found["q"]["minLength"], found["q"]["maxLength"]) == (1, 512)
        assert (found["limit"]["minimum"], found["limit"]["maximum"]) == (1, 100)
        note = doc["paths"]["/api/v1/notes/{path}"]["get"]["parameters"][0]["schema"]
        assert note["pattern"] == notesvc.NOTE_PATH_PARAM["pattern"]
        # The bounds are the server's own: at the bound accepted, past it refused.
        client.get(f"{API}/notes?limit=1000&offset={10**9}")
        client.get(f"{API}/notes?limit=1001", status=400)
        client.get(f"{API}/search?q=x&limit=101", status=400)

    def test_path_patterns_admit_only_paths_the_server_accepts(self):
        import unicodedata

        schema = notesvc.NOTE_PATH_SCHEMA
        pattern = re.compile(schema["pattern"])

        def admitted(path: str) -> bool:
            return len(path) <= schema["maxLength"] and bool(pattern.search(path))

        for path, _ in HOSTILE_PATHS:
            assert not admitted(path), path
        fine = [
            "notes/a.md",
            "notes/" + "x" * 252 + ".md",
            "notes/" + "é" * 62 + ".md",
            "notes/" + "\U0001f600" * 62 + ".md",
            "notes/" + "/".join(["\u6f22" * 63] * 3) + "/x.md",
            "notes/ a (1) [draft] #2 & co.md",
        ]
        for path in fine:
            assert admitted(path), path
            assert notesvc.note_path(path) == path
        assert not admitted("notes/" + "x" * 253 + ".md")
        assert not admitted("notes/" + "\U0001f600" * 63 + ".md")
        # The characters left out because NFC makes them longer are all there are.
        grows = "".join(
            chr(cp)
            for cp in range(0x80, 0x110000)
            if not 0xD800 <= cp <= 0xDFFF
            and unicodedata.decomposition(chr(cp))[:1] not in ("", "<")
            and len(unicodedata.normalize("NFC", chr(cp)).encode()) > len(chr(cp).encode())
        )
        assert re.fullmatch(f"[{notesvc._NFC_GROWS}]*", grows)
        assert not any(admitted(f"notes/a{ch}.md") for ch in grows)

    def test_crash_leftovers_in_the_state_folder_are_swept_at_start(self, make_app, root):
        make_app()  # creates the root and its state folder
        state = root / ".notesvc"
        stamp = time.strftime("%Y%m%dT%H%M%S.000000Z", time.gmtime())  # not yet expired
        stale = [
            state / ".tmp-abc123.part",
            state / "trash" / stamp / "notes" / ".tmp-x.part",
            state / "plugins" / ".tmp-y.part",
            state / "sub" / "deeper" / ".tmp-z.part",
            root / "notes" / "folder" / ".tmp-n.part",
        ]
        kept = [
            state / "trash" / stamp / "notes" / "tmp-x.part.md",
            root / "notes" / "tmp-1.part.md",
            state / "plugins" / "tmp-y.py",
        ]
        for path in stale + kept:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("left over")
        client = with_key(make_app())
        for path in stale:
            assert not path.exists(), path
        for path in kept:
            assert path.read_text() == "left over"
        assert data(client.get(note_url("notes/tmp-1.part.md")))["content"] == "left over"


class TestFolders:
    def test_tree_nests_folders_first_then_notes_by_name(self, client, root):
        for path in ["notes/b.md", "notes/A.md", "notes/zeta/x.md", "notes/alpha/y/z.md"]:
            put_note(client, path, "t")
        (root / "notes" / ".hidden").mkdir()
        (root / "notes" / ".hidden" / "h.md").write_text("h")
        (root / "notes" / ".dot.md").write_text("h")
        (root / "notes" / "image.png").write_bytes(b"\x89PNG")
        (root / "notes" / "empty").mkdir()
        tree = data(client.get(f"{API}/folders/tree"))
        assert (tree["name"], tree["path"], tree["type"]) == ("notes", "notes", "folder")
        assert [(c["name"], c["type"]) for c in tree["children"]] == [
            ("alpha", "folder"),
            ("empty", "folder"),
            ("zeta", "folder"),
            ("A.md", "note"),
            ("b.md", "note"),
        ]
        alpha = tree["children"][0]
        assert alpha["path"] == "notes/alpha"
        assert alpha["children"][0]["children"][0] == {
            "name": "z.md",
            "path": "notes/alpha/y/z.md",
            "type": "note",
            "size": 1,
            "modified": alpha["children"][0]["children"][0]["modified"],
        }

    def test_subtree(self, client):
        put_note(client, "notes/p/q/r.md")
        for url in (f"{API}/folders/tree/notes%2Fp", f"{API}/folders/tree/notes/p"):
            node = data(client.get(url))
            assert node["path"] == "notes/p"
            assert node["children"][0]["path"] == "notes/p/q"
        assert data(client.get(f"{API}/folders/tree/notes"))["path"] == "notes"

    def test_missing_folder_is_404_and_note_is_not_a_folder(self, client):
        put_note(client, "notes/n.md")
        assert_error(client.get(f"{API}/folders/tree/notes%2Fnope", status=404), 404, "NOT_FOUND")
        client.get(f"{API}/folders/tree/notes%2Fn.md", status=404)

    @pytest.mark.parametrize(
        "path", ["..%2Fetc", "notes%2F..%2F..", "%2Fetc", "other", "notes%2F.git"]
    )
    def test_bad_folder_path_is_400(self, client, path):
        resp = client.get(f"{API}/folders/tree/{path}", status=400)
        assert_error(resp, 400, "VALIDATION_ERROR")

    def test_post_folders_does_not_exist(self, client):
        resp = client.post_json(f"{API}/folders", {"path": "notes/x"}, status=404)
        assert "/folders/tree" in assert_error(resp, 404, "NOT_FOUND")["message"]

    def test_large_tree_is_fast_enough(self, client, root):
        # A smoke check of scale, not a benchmark (bench/bench_notes.py measures).
        for f in range(50):
            folder = root / "notes" / f"f{f:03d}"
            folder.mkdir()
            for n in range(20):
                (folder / f"n{n:03d}.md").write_text("x")
        tree = data(client.get(f"{API}/folders/tree"))
        assert sum(len(c["children"]) for c in tree["children"]) == 1000
        assert data(client.get(f"{API}/notes?limit=1000"))["total"] == 1000


class TestFolderDepth:
    """`?depth=N` lists N levels; folders below the cut carry `count` instead of `children`."""

    @pytest.fixture
    def tree_client(self, client, root):
        for path in [
            "notes/top.md",
            "notes/a/one.md",
            "notes/a/b/two.md",
            "notes/a/b/c/three.md",
            "notes/a/b/c/four.md",
            "notes/z/five.md",
        ]:
            put_note(client, path, "t")
        (root / "notes" / "empty").mkdir()
        (root / "notes" / "a" / ".hidden").mkdir()
        (root / "notes" / "a" / ".hidden" / "h.md").write_text("h")
        return client

    def test_depth_one_lists_children_with_counts_for_folders(self, tree_client):
        tree = data(tree_client.get(f"{API}/folders/tree?depth=1"))
        assert tree["path"] == "notes"
        assert "count" not in tree
        assert tree["children"] == [
            {"name": "a", "path": "notes/a", "type": "folder", "count": 4},
            {"name": "empty", "path": "notes/empty", "type": "folder", "count": 0},
            {"name": "z", "path": "notes/z", "type": "folder", "count": 1},
            tree["children"][3],
        ]
        assert tree["children"][3]["path"] == "notes/top.md"
        assert set(tree["children"][3]) == {"name", "path", "type", "size", "modified"}

    def test_depth_two_lists_one_more_level(self, tree_client):
        tree = data(tree_client.get(f"{API}/folders/tree?depth=2"))
        a = tree["children"][0]
        assert "count" not in a
        assert [(c["name"], c.get("count")) for c in a["children"]] == [("b", 3), ("one.md", None)]
        assert "children" not in a["children"][0]

    def test_subtree_with_depth(self, tree_client):
        for url in (
            f"{API}/folders/tree/notes%2Fa%2Fb?depth=1",
            f"{API}/folders/tree/notes/a/b?depth=1",
        ):
            node = data(tree_client.get(url))
            assert node["path"] == "notes/a/b"
            assert node["children"][0] == {
                "name": "c",
                "path": "notes/a/b/c",
                "type": "folder",
                "count": 2,
            }
            assert node["children"][1]["path"] == "notes/a/b/two.md"

    def test_deep_enough_equals_the_whole_tree(self, tree_client):
        whole = data(tree_client.get(f"{API}/folders/tree"))
        for depth in (4, 64):
            assert data(tree_client.get(f"{API}/folders/tree?depth={depth}")) == whole
        assert "count" not in json.dumps(whole)

    def test_a_large_folder_cut_at_depth_one_still_counts_every_note(self, client, root):
        for f in range(20):
            for n in range(10):
                (root / "notes" / f"f{f:02d}" / f"d{n}").mkdir(parents=True)
                (root / "notes" / f"f{f:02d}" / f"d{n}" / "x.md").write_text("x")
        client.app.service.sync_index()
        tree = data(client.get(f"{API}/folders/tree?depth=1"))
        assert [c["count"] for c in tree["children"]] == [10] * 20
        assert "children" not in json.dumps(tree["children"])

    @pytest.mark.parametrize("depth", ["0", "65", "-1", "x", "1.5", "99999999999", "%00", "1 "])
    def test_bad_depth_is_400(self, client, depth):
        for url in (f"{API}/folders/tree?depth={depth}", f"{API}/folders/tree/notes?depth={depth}"):
            resp = client.get(url, status=400)
            assert "depth" in assert_error(resp, 400, "VALIDATION_ERROR")["message"]

    def test_depth_on_a_missing_or_hostile_folder(self, client):
        assert_error(
            client.get(f"{API}/folders/tree/notes%2Fnope?depth=1", status=404), 404, "NOT_FOUND"
        )
        resp = client.get(f"{API}/folders/tree/..%2Fetc?depth=1", status=400)
        assert_error(resp, 400, "VALIDATION_ERROR")

    def test_depth_is_in_the_openapi_document(self, client):
        paths = client.get(f"{API}/openapi.json").json["paths"]
        for path in ("/api/v1/folders/tree", "/api/v1/folders/tree/{path}"):
            params = {p["name"]: p for p in paths[path]["get"]["parameters"]}
            assert params["depth"]["in"] == "query"
            assert params["depth"]["schema"]["maximum"] == 64


class TestServerNotes:
    pytestmark = [pytest.mark.real_server, pytest.mark.slow]

    def test_concurrent_if_match_increments_lose_nothing(self, tmp_path):
        with running(tmp_path, "--auth-mode", "none") as server:
            status, _, _ = server.request(
                "POST", f"{API}/notes", {"path": "notes/counter.md", "content": "0"}
            )
            assert status == 201
            url = note_url("notes/counter.md")
            conflicts = []
            errors = []

            def client():
                done = 0
                while done < 20:
                    status, headers, body = server.request("GET", url)
                    if status != 200:
                        errors.append(status)
                        return
                    value = int(body["data"]["content"])
                    status, _, _ = server.request(
                        "PUT", url, {"content": str(value + 1)}, {"If-Match": headers["ETag"]}
                    )
                    if status == 200:
                        done += 1
                    elif status == 412:
                        conflicts.append(1)
                    else:
                        errors.append(status)
                        return

            threads = [threading.Thread(target=client) for _ in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert errors == []
            _, _, body = server.request("GET", url)
            assert body["data"]["content"] == "120"

    def test_sigkill_mid_write_leaves_every_note_whole(self, tmp_path):
        server = Server(tmp_path, "--auth-mode", "none")
        sent: dict = {}
        try:
            for i in range(20):
                content = f"note {i} version 0\n" + "." * 1000 + f"\nend {i} 0\n"
                sent[f"notes/n{i:02d}.md"] = {content}
                server.request(
                    "POST", f"{API}/notes", {"path": f"notes/n{i:02d}.md", "content": content}
                )
            stop = threading.Event()
            done = []  # writes the server finished

            def writer(w):
                v = 0
                while not stop.is_set():
                    v += 1
                    i = (v * 7 + w) % 20
                    path = f"notes/n{i:02d}.md"
                    # Large, varied sizes make torn writes visible if they could happen.
                    content = (
                        f"note {i} version {w}-{v}\n"
                        + "x" * (20000 + (v % 7) * 9000)
                        + f"\nend {i} {w}-{v}\n"
                    )
                    sent[path].add(content)
                    try:
                        done.append(server.request("PUT", note_url(path), {"content": content}))
                    except (OSError, http.client.HTTPException, ValueError):
                        return  # the server was killed under this request

            threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
            for t in threads:
                t.start()
            # Killed in full flow: every writer busy, hundreds of writes behind them.
            wait_for(lambda: len(done) >= 200, timeout=60)
            server.proc.kill()
            server.proc.wait()
            stop.set()
            for t in threads:
                t.join(30)
        finally:
            server.stop()
        notes = tmp_path / "notes"
        for path, versions in sent.items():
            content = (tmp_path / path).read_text()
            assert content in versions, f"{path} holds a torn or foreign version"
        # A restart sweeps temp files a crash left behind and lists exactly the 20 notes.
        with running(tmp_path, "--auth-mode", "none") as again:
            _, _, body = again.request("GET", f"{API}/notes")
            assert body["data"]["total"] == 20
        assert [p for p in notes.iterdir() if p.name.startswith(".tmp-")] == []


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


class TestAttachments:
    def test_put_then_get_round_trips_with_every_header(self, client, root):
        resp = upload(client, "attachments/trip/beach.png")
        rec = data(resp)
        assert set(rec) == {"path", "size", "contentType", "modified", "etag"}
        assert rec["path"] == "attachments/trip/beach.png"
        assert rec["size"] == len(PNG)
        assert rec["contentType"] == "image/png"
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", rec["modified"])
        assert resp.headers["ETag"] == rec["etag"]
        assert resp.headers["Location"].endswith(att_url("attachments/trip/beach.png"))
        assert (root / "attachments" / "trip" / "beach.png").read_bytes() == PNG
        got = client.get(att_url("attachments/trip/beach.png"))
        assert got.body == PNG
        assert got.headers["Content-Type"] == "image/png"
        assert got.headers["Content-Length"] == str(len(PNG))
        assert got.headers["ETag"] == rec["etag"]
        assert got.headers["Accept-Ranges"] == "bytes"
        assert got.headers["X-Content-Type-Options"] == "nosniff"
        assert "sandbox" in got.headers["Content-Security-Policy"]
        assert got.headers["Content-Disposition"].startswith('inline; filename="beach.png"')
        assert got.headers["Cache-Control"] == "no-store"
        head = client.head(att_url("attachments/trip/beach.png"))
        assert head.body == b""
        assert head.headers["ETag"] == rec["etag"]
        # PUT again replaces it: 200, a new ETag.
        again = data(upload(client, "attachments/trip/beach.png", PNG[::-1], status=200))
        assert again["etag"] != rec["etag"]
        assert client.get(att_url("attachments/trip/beach.png")).body == PNG[::-1]
        assert leftovers(root) == []

    def test_preconditions_guard_a_replacement(self, client, root):
        rec = data(upload(client, "attachments/a.jpg"))
        resp = upload(client, "attachments/a.jpg", b"x", 412, **{"If-Match": '"nope"'})
        assert_error(resp, 412, "PRECONDITION_FAILED")
        resp = upload(client, "attachments/a.jpg", b"x", 412, **{"If-None-Match": "*"})
        assert_error(resp, 412, "PRECONDITION_FAILED")
        assert (root / "attachments" / "a.jpg").read_bytes() == PNG
        upload(client, "attachments/a.jpg", b"new", 200, **{"If-Match": rec["etag"]})
        upload(client, "attachments/b.jpg", b"x", 201, **{"If-None-Match": "*"})
        resp = upload(client, "attachments/c.jpg", b"x", 412, **{"If-Match": rec["etag"]})
        assert_error(resp, 412, "PRECONDITION_FAILED")  # nothing there to match
        assert not (root / "attachments" / "c.jpg").exists()

    def test_ranges_and_conditional_gets(self, client):
        etag = data(upload(client, "attachments/v.mp4"))["etag"]
        url, size = att_url("attachments/v.mp4"), len(PNG)
        part = client.get(url, headers={"Range": "bytes=0-9"}, status=206)
        assert part.body == PNG[:10]
        assert part.headers["Content-Range"] == f"bytes 0-9/{size}"
        assert part.headers["Content-Length"] == "10"
        tail = client.get(url, headers={"Range": "bytes=-5"}, status=206)
        assert tail.body == PNG[-5:]
        rest = client.get(url, headers={"Range": f"bytes={size - 3}-"}, status=206)
        assert rest.body == PNG[-3:]
        clipped = client.get(url, headers={"Range": f"bytes=10-{size * 2}"}, status=206)
        assert clipped.body == PNG[10:]
        for whole in ("bytes=0-1,5-6", "pages=1-2", "bytes=9-3", "bytes=-"):
            assert client.get(url, headers={"Range": whole}, status=200).body == PNG
        outside = client.get(url, headers={"Range": f"bytes={size}-"}, status=416)
        assert_error(outside, 416, "VALIDATION_ERROR")
        assert outside.headers["Content-Range"] == f"bytes */{size}"
        stale = client.get(url, headers={"Range": "bytes=0-9", "If-Range": '"old"'}, status=200)
        assert stale.body == PNG
        fresh = client.get(url, headers={"Range": "bytes=0-9", "If-Range": etag}, status=206)
        assert fresh.body == PNG[:10]
        assert client.get(url, headers={"If-None-Match": etag}, status=304).body == b""
        assert client.get(url, headers={"If-None-Match": '"other"'}, status=200).body == PNG

    @pytest.mark.parametrize(
        ("name", "ctype"),
        [("page.html", "text/html"), ("page.HTM", "text/html"), ("logo.svg", "image/svg+xml")],
    )
    def test_html_and_svg_are_downloads_under_a_sandbox(self, client, name, ctype):
        active = b"<svg xmlns='http://www.w3.org/2000/svg'><script>alert(1)</script></svg>"
        upload(client, f"attachments/{name}", active)
        got = client.get(att_url(f"attachments/{name}"))
        assert got.body == active
        assert got.headers["Content-Type"].split(";")[0] == ctype
        assert got.headers["Content-Disposition"].startswith("attachment;")
        assert got.headers["Content-Security-Policy"] == "default-src 'none'; sandbox"
        assert got.headers["X-Content-Type-Options"] == "nosniff"

    def test_documents_are_downloads_and_names_are_quoted(self, client):
        upload(client, "attachments/Überweisung (2026) März.pdf", b"%PDF-1.4")
        got = client.get(att_url("attachments/Überweisung (2026) März.pdf"))
        disposition = got.headers["Content-Disposition"]
        assert disposition.startswith('attachment; filename="_berweisung _2026_ M_rz.pdf"')
        assert "filename*=UTF-8''%C3%9Cberweisung%20%282026%29%20M%C3%A4rz.pdf" in disposition

    def test_multipart_upload_never_overwrites(self, client, root):
        body, ctype = multipart(
            ("path", "attachments/cam/photo.jpg"), ("file", PNG, "IMG_1.jpg", "image/jpeg")
        )
        first = data(post_form(client, body, ctype, 201))
        assert first["path"] == "attachments/cam/photo.jpg"
        assert first["size"] == len(PNG)
        assert (root / "attachments" / "cam" / "photo.jpg").read_bytes() == PNG
        # The file part first, an unknown field ignored; the taken name gets -2, then -3.
        body, ctype = multipart(
            ("file", b"second", "x.jpg"), ("note", "hi"), ("path", "attachments/cam/photo.jpg")
        )
        second = data(post_form(client, body, ctype, 201))
        assert second["path"] == "attachments/cam/photo-2.jpg"
        third = data(post_form(client, body, ctype, 201))
        assert third["path"] == "attachments/cam/photo-3.jpg"
        assert client.get(att_url(second["path"])).body == b"second"
        assert (root / "attachments" / "cam" / "photo.jpg").read_bytes() == PNG
        # An empty file, the form a browser sends for an empty pick, is a file too.
        empty = (
            '--e\r\nContent-Disposition: form-data; name="path"\r\n\r\nattachments/e.txt\r\n'
            '--e\r\nContent-Disposition: form-data; name="file"; filename="e.txt"\r\n\r\n--e--\r\n'
        )
        rec = data(
            post_form(
                client,
                empty.encode(),
                "multipart/form-data; boundary=e",
                201,
            )
        )
        assert rec["size"] == 0
        assert leftovers(root) == []

    @pytest.mark.parametrize(
        ("body", "ctype", "status"),
        [
            pytest.param(*multipart(("path", "attachments/a.jpg")), 400, id="no-file"),
            pytest.param(*multipart(("file", b"x", "a.jpg")), 400, id="no-path"),
            pytest.param(
                *multipart(("path", "notes/a.jpg"), ("file", b"x", "a.jpg")), 400, id="notes-path"
            ),
            pytest.param(
                *multipart(("path", "attachments/a.exe"), ("file", b"x", "a.exe")), 400, id="exe"
            ),
            pytest.param(
                *multipart(("path", "attachments/../x.jpg"), ("file", b"x", "a.jpg")),
                400,
                id="dotdot",
            ),
            pytest.param(
                *multipart(("path", "attachments/" + "a" * 3000 + ".jpg"), ("file", b"x", "a.jpg")),
                400,
                id="long-path",
            ),
            pytest.param(
                *multipart(("path", b"attachments/\xff.jpg"), ("file", b"x", "a.jpg")),
                400,
                id="not-utf8",
            ),
            pytest.param(
                *multipart(("path", "attachments/a.jpg"), ("file", b"x", "a"), ("file", b"y", "b")),
                400,
                id="two-files",
            ),
            pytest.param(*multipart(*[("f", "x")] * 20), 400, id="many-parts"),
            pytest.param(
                b'--b\r\nContent-Disposition: form-data; name="file"\r\n\r\nnever ends',
                "multipart/form-data; boundary=b",
                400,
                id="unterminated",
            ),
            pytest.param(
                b"--b\r\nX-Big: " + b"h" * 9000 + b"\r\n\r\nx\r\n--b--",
                "multipart/form-data; boundary=b",
                400,
                id="huge-headers",
            ),
            pytest.param(
                b"--b\r\nContent-Type: text/plain\r\n\r\nx\r\n--b--",
                "multipart/form-data; boundary=b",
                400,
                id="no-disposition",
            ),
            pytest.param(b"junk", "multipart/form-data", 400, id="no-boundary"),
            pytest.param(b"junk", 'multipart/form-data; boundary="a\x7fb"', 400, id="bad-boundary"),
            pytest.param(b'{"path": "attachments/a.jpg"}', "application/json", 415, id="json"),
            pytest.param(
                b"path=attachments/a.jpg", "application/x-www-form-urlencoded", 415, id="urlencoded"
            ),
        ],
    )
    def test_multipart_refusals(self, client, root, body, ctype, status):
        resp = post_form(client, body, ctype, status)
        assert_error(
            resp, status, "VALIDATION_ERROR" if status == 400 else "UNSUPPORTED_MEDIA_TYPE"
        )
        assert (
            not (root / "attachments").exists() or list((root / "attachments").rglob("*.*")) == []
        )
        assert leftovers(root) == []

    @pytest.mark.parametrize(
        "path",
        [
            "notes/a.jpg",
            "attachments/a.exe",
            "attachments/noext",
            "attachments/.hidden.jpg",
            "attachments/../notes/a.jpg",
            "attachments//a.jpg",
            "attachments/a\\b.jpg",
            "attachments/a\x01.jpg",
            "attachments/a\u202e.jpg",
            "attachments/" + "x" * 300 + ".jpg",
            "/attachments/a.jpg",
            "attachments",
            "attachments/.jpg",
        ],
    )
    def test_hostile_paths_are_400(self, client, root, path):
        for resp in (
            client.put(att_url(path), b"x", content_type="image/jpeg", status=400),
            client.delete(att_url(path), status=400),
        ):
            assert_error(resp, 400, "VALIDATION_ERROR")
        # reading notes/a.jpg names a file kept beside the notes (WebDAV): none is there
        got = client.get(att_url(path), status=404 if path == "notes/a.jpg" else 400)
        assert_error(
            got, got.status_int, "NOT_FOUND" if got.status_int == 404 else "VALIDATION_ERROR"
        )
        assert not (root / "notes" / "a.jpg").exists()

    def test_a_symbolic_link_out_of_attachments_is_refused(self, client, root, tmp_path):
        outside = tmp_path / "outside"
        outside.mkdir()
        (root / "attachments").mkdir(parents=True)
        (root / "attachments" / "link").symlink_to(outside)
        resp = client.put(
            att_url("attachments/link/x.jpg"), b"x", content_type="image/jpeg", status=400
        )
        assert (
            "outside the attachments folder"
            in assert_error(resp, 400, "VALIDATION_ERROR")["message"]
        )
        assert list(outside.iterdir()) == []
        (outside / "secret.jpg").write_bytes(b"secret")
        assert_error(
            client.get(att_url("attachments/link/secret.jpg"), status=400), 400, "VALIDATION_ERROR"
        )
        assert data(client.get(f"{API}/attachments"))["total"] == 0  # links are not followed

    def test_size_limit(self, make_app, root):
        client = with_key(make_app(SERVICE_MAX_ATTACHMENT_BYTES="2048"))
        upload(client, "attachments/fits.bin.zip", b"x" * 2048)
        resp = upload(client, "attachments/big.zip", b"x" * 2049, status=413)
        message = assert_error(resp, 413, "PAYLOAD_TOO_LARGE")["message"]
        assert "2048" in message
        assert "SERVICE_MAX_ATTACHMENT_BYTES" in message
        body, ctype = multipart(("path", "attachments/big2.zip"), ("file", b"x" * 2049, "b.zip"))
        resp = post_form(client, body, ctype, 413)
        assert_error(resp, 413, "PAYLOAD_TOO_LARGE")
        assert sorted(p.name for p in (root / "attachments").iterdir()) == ["fits.bin.zip"]
        assert leftovers(root) == []

    def test_list_pages_by_path_and_leaves_out_the_rest(self, client, root):
        for path in ("attachments/b/2.png", "attachments/a.pdf", "attachments/b/1.PNG"):
            upload(client, path)
        (root / "attachments" / "tool.exe").write_bytes(b"MZ")
        (root / "attachments" / ".hidden.png").write_bytes(b"x")
        (root / "attachments" / "b" / ".tmp-x.part").write_bytes(b"x")
        listing = data(client.get(f"{API}/attachments"))
        assert [a["path"] for a in listing["attachments"]] == [
            "attachments/a.pdf",
            "attachments/b/1.PNG",
            "attachments/b/2.png",
        ]
        assert listing["total"] == 3
        assert set(listing["attachments"][0]) == {"path", "size", "contentType", "modified", "etag"}
        page = data(
            client.get(f"{API}/attachments", {"folder": "attachments/b", "limit": 1, "offset": 1})
        )
        assert [a["path"] for a in page["attachments"]] == ["attachments/b/2.png"]
        assert (page["total"], page["limit"], page["offset"]) == (2, 1, 1)
        assert_error(
            client.get(f"{API}/attachments", {"folder": "attachments/none"}, status=404),
            404,
            "NOT_FOUND",
        )
        for bad in (
            {"folder": "notes"},
            {"folder": "attachments/../x"},
            {"limit": "0"},
            {"offset": "-1"},
            {"limit": "x"},
        ):
            assert_error(client.get(f"{API}/attachments", bad, status=400), 400, "VALIDATION_ERROR")
        info = data(client.get(f"{API}/system/info"))
        assert info["attachments"] == {"count": 3, "bytes": 3 * len(PNG)}

    def test_an_empty_root_lists_nothing(self, client, root):
        assert data(client.get(f"{API}/attachments")) == {
            "attachments": [],
            "total": 0,
            "limit": 100,
            "offset": 0,
        }
        assert not (root / "attachments").exists()  # created by the first upload only

    def test_delete_moves_it_into_the_notes_trash(self, client, root):
        rec = data(upload(client, "attachments/old/scan.pdf", b"%PDF"))
        resp = client.delete(
            att_url("attachments/old/scan.pdf"), headers={"If-Match": '"x"'}, status=412
        )
        assert_error(resp, 412, "PRECONDITION_FAILED")
        gone = data(
            client.delete(att_url("attachments/old/scan.pdf"), headers={"If-Match": rec["etag"]})
        )
        assert gone["path"] == "attachments/old/scan.pdf"
        assert gone["deleted"] is True
        m = re.fullmatch(
            r"\.notesvc/trash/(\d{8}T\d{6}\.\d{6}Z)/attachments/old/scan\.pdf", gone["trash"]
        )
        assert m, gone["trash"]
        assert (root / gone["trash"]).read_bytes() == b"%PDF"  # the same layout as notes
        assert not (root / "attachments" / "old").exists()  # its emptied folder is pruned
        assert_error(client.get(att_url("attachments/old/scan.pdf"), status=404), 404, "NOT_FOUND")
        assert_error(
            client.delete(att_url("attachments/old/scan.pdf"), status=404), 404, "NOT_FOUND"
        )

    def test_move_rewrites_the_links_to_it(self, client, root):
        upload(client, "attachments/trip/a.jpg")
        put_note(
            client,
            "notes/days/monday.md",
            '# Monday\n\n![beach](../../attachments/trip/a.jpg "Sea")\n',
        )
        put_note(
            client,
            "notes/index.md",
            "[photo](/attachments/trip/a.jpg) and ![[a.jpg]] and [[trip/a.jpg|pic]]\n",
        )
        put_note(client, "notes/other.md", "![other](../attachments/trip/b.jpg) [a](a.md)\n")
        url = att_url("attachments/trip/a.jpg")
        body = {"path": "attachments/2026/sea.jpg", "updateLinks": True}
        moved = data(client.patch_json(url + "/move", body))
        assert moved["path"] == "attachments/2026/sea.jpg"
        assert moved["from"] == "attachments/trip/a.jpg"
        assert moved["linksUpdated"] == ["notes/days/monday.md", "notes/index.md"]
        assert (
            root / "notes/days/monday.md"
        ).read_text() == '# Monday\n\n![beach](../../attachments/2026/sea.jpg "Sea")\n'
        assert (
            (root / "notes/index.md").read_text()
            == "[photo](/attachments/2026/sea.jpg) and ![[sea.jpg]] and [[2026/sea.jpg|pic]]\n"
        )
        assert (
            root / "notes/other.md"
        ).read_text() == "![other](../attachments/trip/b.jpg) [a](a.md)\n"
        assert client.get(att_url("attachments/2026/sea.jpg")).body == PNG
        assert not (root / "attachments" / "trip").exists()
        # Without updateLinks the notes stay as they are.
        plain = data(
            client.patch_json(
                att_url("attachments/2026/sea.jpg") + "/move", {"path": "attachments/x.jpg"}
            )
        )
        assert "linksUpdated" not in plain
        assert "2026/sea.jpg" in (root / "notes/index.md").read_text()

    def test_move_finds_the_links_as_the_notes_are_now(self, client, root, monkeypatch):
        # The notes' links are kept between moves: an edit in between is seen. (Every
        # note is just written: without the racy-clean wait they are kept at once.)
        monkeypatch.setattr(notesvc.ReadCache, "RACY_SECONDS", 0)
        upload(client, "attachments/a.jpg")
        put_note(client, "notes/one.md", "![a](../attachments/a.jpg)\n")
        put_note(client, "notes/two.md", "no link yet\n")
        put_note(client, "notes/three.md", "a [[note]] and [b](b.md)\n")
        url = att_url("attachments/a.jpg")
        moved = data(
            client.patch_json(url + "/move", {"path": "attachments/b.jpg", "updateLinks": True})
        )
        assert moved["linksUpdated"] == ["notes/one.md"]
        client.put_json(note_url("notes/two.md"), {"content": "now ![[b.jpg]]\n"})
        client.put_json(note_url("notes/one.md"), {"content": "the link is gone\n"})
        url = att_url("attachments/b.jpg")
        moved = data(
            client.patch_json(url + "/move", {"path": "attachments/c.jpg", "updateLinks": True})
        )
        assert moved["linksUpdated"] == ["notes/two.md"]
        assert (root / "notes/two.md").read_text() == "now ![[c.jpg]]\n"
        assert (root / "notes/three.md").read_text() == "a [[note]] and [b](b.md)\n"

    def test_move_refusals(self, client, root):
        rec = data(upload(client, "attachments/a.jpg"))
        upload(client, "attachments/b.jpg", b"other")
        url = att_url("attachments/a.jpg") + "/move"
        assert_error(
            client.patch_json(url, {"path": "attachments/b.jpg"}, status=409), 409, "CONFLICT"
        )
        assert_error(
            client.patch_json(
                url, {"path": "attachments/c.jpg"}, headers={"If-Match": '"x"'}, status=412
            ),
            412,
            "PRECONDITION_FAILED",
        )
        assert_error(
            client.patch_json(
                att_url("attachments/none.jpg") + "/move", {"path": "attachments/c.jpg"}, status=404
            ),
            404,
            "NOT_FOUND",
        )
        for body in (
            {"path": "attachments/c.exe"},
            {"path": "notes/c.md"},
            {"path": 5},
            {},
            {"path": "attachments/c.jpg", "updateLinks": "yes"},
        ):
            assert_error(client.patch_json(url, body, status=400), 400, "VALIDATION_ERROR")
        assert_error(
            client.patch(url, b'{"path": ', content_type="application/json", status=400),
            400,
            "VALIDATION_ERROR",
        )
        assert_error(
            client.patch(url, b"path=x", content_type="text/plain", status=415),
            415,
            "UNSUPPORTED_MEDIA_TYPE",
        )
        assert (root / "attachments/a.jpg").read_bytes() == PNG
        assert (root / "attachments/b.jpg").read_bytes() == b"other"
        same = data(
            client.patch_json(url, {"path": "attachments/a.jpg"}, headers={"If-Match": rec["etag"]})
        )
        assert same["path"] == same["from"] == "attachments/a.jpg"

    def test_a_moved_note_keeps_its_attachment_links_working(self, client, root):
        upload(client, "attachments/x.jpg")
        put_note(client, "notes/a.md", "![x](../attachments/x.jpg) ![[x.jpg]]\n")
        moved = data(
            client.patch_json(
                note_url("notes/a.md") + "/move",
                {"path": "notes/deep/er/a.md", "updateLinks": True},
            )
        )
        assert moved["linksUpdated"] == ["notes/deep/er/a.md"]
        assert (
            root / "notes/deep/er/a.md"
        ).read_text() == "![x](../../../attachments/x.jpg) ![[x.jpg]]\n"

    def test_raw_put_refuses_a_multipart_body(self, client):
        body, ctype = multipart(("path", "attachments/a.jpg"), ("file", b"x", "a.jpg"))
        resp = client.put(att_url("attachments/a.jpg"), body, content_type=ctype, status=415)
        assert (
            "POST /api/v1/attachments"
            in assert_error(resp, 415, "UNSUPPORTED_MEDIA_TYPE")["message"]
        )

    def test_a_crash_leftover_is_swept_at_start(self, make_app, root):
        folder = root / "attachments"
        folder.mkdir(parents=True)
        (folder / ".tmp-abc.part").write_bytes(b"half an upload")
        with_key(make_app())
        assert leftovers(root) == []

    def test_a_client_on_another_allowed_origin_may_ask_for_ranges(self, make_app):
        app = make_app(SERVICE_CORS_ORIGINS="https://app.example")
        pre = app.options(
            att_url("attachments/a.mp4"),
            headers={
                "Origin": "https://app.example",
                "Access-Control-Request-Method": "GET",
                "Access-Control-Request-Headers": "range, if-none-match",
            },
            status=204,
        )
        allowed = pre.headers["Access-Control-Allow-Headers"]
        assert "Range" in allowed
        assert "If-None-Match" in allowed
        client = with_key(app)
        upload(client, "attachments/a.mp4")
        got = client.get(
            att_url("attachments/a.mp4"),
            headers={"Origin": "https://app.example", "Range": "bytes=0-1"},
            status=206,
        )
        assert "Content-Range" in got.headers["Access-Control-Expose-Headers"]

    def test_every_route_needs_the_key(self, anon):
        for method, url in (
            ("GET", f"{API}/attachments"),
            ("POST", f"{API}/attachments"),
            ("GET", att_url("attachments/a.jpg")),
            ("PUT", att_url("attachments/a.jpg")),
            ("DELETE", att_url("attachments/a.jpg")),
            ("PATCH", att_url("attachments/a.jpg") + "/move"),
        ):
            assert_error(anon.request(url, method=method, status=401), 401, "UNAUTHORIZED")


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


class TestServerAttachments:
    pytestmark = [pytest.mark.real_server, pytest.mark.slow]

    def test_header_bytes_that_are_not_utf8_act_as_absent(self, tmp_path):
        with running(tmp_path) as server:
            owner = {"X-Service-Key": make_state(tmp_path)["apiKey"]}
            req = urllib.request.Request(
                server.url + att_url("attachments/a.png"),
                PNG,
                {**owner, "Content-Type": "image/png"},
                method="PUT",
            )
            with urllib.request.urlopen(req, timeout=10) as resp:
                assert resp.status == 201
            body = {"path": "notes/a.md", "content": "![a](../attachments/a.png)\n"}
            assert server.request("POST", f"{API}/notes", body, owner)[0] == 201
            share = server.request("POST", f"{API}/shares", {"path": "notes/a.md"}, owner)[2]
            token = share["data"]["url"].rsplit("/", 1)[1]
            key = owner["X-Service-Key"].encode()
            for path, credential in (
                (att_url("attachments/a.png"), b"X-Service-Key: " + key + b"\r\n"),
                (f"{API}/shared/{token}/attachments/attachments/a.png", b""),
            ):
                for header in (
                    b"Range: bytes=\xff\xfe-\x80",
                    b"If-Range: \xc3\x28",
                    b"If-None-Match: \xff",
                    b"Range: bytes=0-3\r\nIf-Range: \xe2\x82",
                ):
                    request = (
                        f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n".encode()
                        + credential
                        + header
                        + b"\r\n\r\n"
                    )
                    status, _, data = raw_http(server.port, request)
                    assert (status, data) == (200, PNG), (path, header)
            # If-Match of such bytes matches nothing: 412, never a write and never a 500.
            request = (
                f"PUT {note_url('notes/a.md')} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                "Content-Type: application/json\r\nContent-Length: 15\r\n".encode()
                + b"X-Service-Key: "
                + key
                + b"\r\nIf-Match: \xff\xfe\r\n\r\n"
                + b'{"content":"x"}'
            )
            status, _, data = raw_http(server.port, request)
            assert status == 412, data
            assert (tmp_path / "notes" / "a.md").read_text() == body["content"]

    def test_uploads_get_their_own_body_limit_and_others_keep_theirs(self, tmp_path):
        env = {"SERVICE_MAX_BODY_BYTES": "4096", "SERVICE_MAX_ATTACHMENT_BYTES": "65536"}
        with running(tmp_path, "--auth-mode", "none", env=env) as server:
            big = b"x" * 60000
            req = urllib.request.Request(
                server.url + att_url("attachments/a.zip"),
                big,
                {"Content-Type": "application/zip"},
                method="PUT",
            )
            with urllib.request.urlopen(req, timeout=10) as resp:
                assert resp.status == 201
            assert (tmp_path / "attachments" / "a.zip").read_bytes() == big
            # Declared lengths over the limits are refused before any body is read.
            for method, path, length, setting in (
                ("POST", f"{API}/notes", 5000, "SERVICE_MAX_BODY_BYTES"),
                ("PUT", note_url("notes/a.md"), 5000, "SERVICE_MAX_BODY_BYTES"),
                (
                    "PUT",
                    att_url("attachments/b.zip"),
                    70000 + 65536,
                    "SERVICE_MAX_ATTACHMENT_BYTES",
                ),
                ("POST", f"{API}/attachments", 70000 + 65536, "SERVICE_MAX_ATTACHMENT_BYTES"),
            ):
                head = (
                    f"{method} {path} HTTP/1.1\r\nHost: x\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
                )
                started = time.monotonic()
                status, _, text = raw_http(server.port, head.encode())
                assert status == 413, text
                assert time.monotonic() - started < 2
                assert setting in text.decode()
            # The app still holds a JSON body to SERVICE_MAX_BODY_BYTES on an upload's path.
            status, _, _ = server.request(
                "PATCH",
                att_url("attachments/a.zip") + "/move",
                {"path": "attachments/c.zip", "pad": "x" * 5000},
            )
            assert status == 413
            # A chunked upload is counted too.
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
            conn.putrequest("PUT", att_url("attachments/chunked.zip"))
            conn.putheader("Transfer-Encoding", "chunked")
            conn.putheader("Content-Type", "application/zip")
            conn.endheaders()
            for _ in range(3):
                conn.send(b"2710\r\n" + b"y" * 10000 + b"\r\n")
            conn.send(b"0\r\n\r\n")
            resp = conn.getresponse()
            assert resp.status == 201, resp.read()
            conn.close()
            assert (tmp_path / "attachments" / "chunked.zip").read_bytes() == b"y" * 30000

    def test_full_disk_is_507_and_leaves_nothing(self, tmp_path):
        if os.geteuid() != 0 or not shutil.which("mount"):
            pytest.skip("mounting a small tmpfs needs root")
        disk = tmp_path / "disk"
        disk.mkdir()
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)],
            capture_output=True,
            timeout=10,
        )
        if mounted.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode()[:200]}")
        try:
            with running(disk, "--auth-mode", "none") as server:
                req = urllib.request.Request(
                    server.url + att_url("attachments/deep/er/big.zip"),
                    b"z" * 400_000,
                    {"Content-Type": "application/zip"},
                    method="PUT",
                )
                with pytest.raises(urllib.error.HTTPError) as caught:
                    urllib.request.urlopen(req, timeout=10)
                assert caught.value.code == 507
                assert json.loads(caught.value.read())["error"]["code"] == "INSUFFICIENT_STORAGE"
                assert not (disk / "attachments" / "deep").exists()
                assert leftovers(disk) == []
            assert "Traceback" not in "".join(server.lines)
        finally:
            subprocess.run(["umount", str(disk)], capture_output=True, timeout=10)


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


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


PHONE = {"viewport": {"width": 390, "height": 844}, "has_touch": True, "is_mobile": True}


DESKTOP = {"viewport": {"width": 1280, "height": 800}}


DEVICES = {"phone": PHONE, "desktop": DESKTOP}


SEED_NOTES = {
    "home/keys.md": "# Spare keys\n\nThe spare keys are in the blue kumquat jar on the shelf.\n\n"
    "- [ ] copy the garage key\n- [x] give one to Anna\n\n"
    "See [[pancakes]] and [the recipe](../kitchen/pancakes.md).\n",
    "kitchen/pancakes.md": "# Pancakes\n\n1. Flour, eggs and milk.\n2. Whisk **well**.\n\n"
    "| step | minutes |\n|---|--:|\n| rest | 10 |\n| fry | 2 |\n",
    "todo.md": "# Todo\n\n- buy oat milk\n",
}


# A name for loopback that is not "localhost" or 127.0.0.1: plain HTTP there is not a
# secure context, as a LAN address is not.
PLAIN_HTTP_HOST = "notes.lan.test"


# A browser test's marks. Its group keeps every browser test on one xdist worker, one after
# another: two Chromiums at once on two cores starve each other's timers (a pause in typing
# long enough to name a new note from its first letter was seen), while the other worker
# runs everything else.
BROWSER_TESTS = [
    pytest.mark.browser,
    pytest.mark.real_server,
    pytest.mark.slow,
    pytest.mark.xdist_group("browser"),
]


@pytest.fixture(scope="class")
def browser():
    """One Chromium for the class (each test gets its own context)."""
    sync_api = pytest.importorskip("playwright.sync_api")
    if not CHROMIUM:
        pytest.skip("no Chromium on this machine")
    rules = f"--host-resolver-rules=MAP {PLAIN_HTTP_HOST} 127.0.0.1"
    with sync_api.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=[*CHROMIUM_ARGS, rules])
        try:
            yield chromium
        finally:
            chromium.close()


def expect(locator):
    from playwright.sync_api import expect as playwright_expect

    return playwright_expect(locator)


class WebSession:
    """A browser context on the page of a real server, with the errors it logs."""

    def __init__(self, browser, tmp_path: Path, device: str = "phone", **context):
        must_be_marked("browser")
        self.context = browser.new_context(**DEVICES[device], **context)
        self.context.set_default_timeout(10_000)
        self.page = self.context.new_page()
        self.device, self.tmp_path = device, tmp_path
        self.errors: list = []
        self.requests: list = []
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("request", lambda r: self.requests.append(r))
        self.failed: list = []  # (status, method, URL) of every answer >= 400
        self.page.on(
            "response",
            lambda r: r.status >= 400 and self.failed.append((r.status, r.request.method, r.url)),
        )

    def login(self, url: str, key: str) -> None:
        self.page.goto(url)
        self.page.fill("#key", key)
        self.page.click("#connect")
        self.page.wait_for_selector("#app", state="visible")
        self.page.wait_for_selector("#tree button, #tree .empty")

    def shot(self, name: str) -> Path:
        path = self.tmp_path / f"{name}-{self.device}.png"
        self.page.screenshot(path=str(path))
        return path

    def tap(self, selector: str) -> None:
        """Click (desktop) or tap (phone) the element."""
        if self.device == "phone":
            self.page.tap(selector)
        else:
            self.page.click(selector)

    def tree_open(self, path: str) -> None:
        """Open a note from the tree, opening its folders first (Notes pane on a phone)."""
        if self.device == "phone" and self.page.get_attribute("#app", "data-pane") != "notes":
            self.tap(".tabs button[data-pane=notes]")
        parts = path.split("/")
        for i in range(2, len(parts)):
            folder = self.page.locator(f'#tree button.dir[data-path="{"/".join(parts[:i])}"]')
            if folder.get_attribute("aria-expanded") != "true":
                folder.click()
        self.page.click(f'#tree button.note[data-path="{path}"]')
        expect(self.page.locator("#path")).to_contain_text(path)

    def write_new(self, text: str) -> str:
        """Write a new note as a person does (New note, type, Ctrl+S); return its path."""
        # The phone in the person's hand: with two contexts open, the other page may hold
        # the browser's focus, and an element of a page without it is never focused.
        self.page.bring_to_front()
        self.tap("#new")
        expect(self.page.locator("#editor")).to_be_focused()
        # (the first line at once: a loaded machine can stall typing past the five quiet
        # seconds after which a new note takes its name from the words typed so far)
        first, _, rest = text.partition("\n")
        self.page.keyboard.insert_text(first + ("\n" if _ else ""))
        self.page.keyboard.type(rest)
        self.page.keyboard.press("Control+s")
        expect(self.page.locator("#status")).to_have_text("Saved")
        return self.page.inner_text("#path").split(" · ")[0]

    def dialog_choose(self, value: str) -> None:
        """Answer the open dialog, then wait until it is answered: closed, or (a question
        asked from another dialog, such as the keys screen) back to what it showed before."""
        button = self.page.locator(f'#dlg[open] #dlg-buttons button[data-value="{value}"]')
        button.evaluate("b => { b.dataset.chosen = '1'; }")
        button.click()
        # (polled from here: a predicate polled in the page is an eval, which its policy refuses)
        wait_for(lambda: self.page.evaluate("!document.querySelector('#dlg[open] [data-chosen]')"))

    def api_calls(self, suffix: str) -> list:
        return [r for r in self.requests if urllib.parse.urlsplit(r.url).path.endswith(suffix)]

    def close(self) -> list:
        self.context.close()
        # The browser logs every non-2xx fetch; those the test caused on purpose are named.
        return self.errors


@pytest.fixture
def web(browser, tmp_path):
    """A real server with a few notes, and a function opening a logged-in browser session."""
    root = tmp_path / "root"
    for rel, text in SEED_NOTES.items():
        (root / "notes" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "notes" / rel).write_text(text)
    server = Server(root)
    setup = server.request("GET", f"{API}/system/setup")[2]["data"]
    sessions = []

    def open_session(device: str = "phone", login: bool = True, **context) -> WebSession:
        session = WebSession(browser, tmp_path, device, **context)
        sessions.append(session)
        if login:
            session.login(setup["links"]["connect"]["hosted"], setup["apiKey"])
        return session

    open_session.server, open_session.setup, open_session.root = server, setup, root
    try:
        yield open_session
    finally:
        for s in sessions:
            with contextlib.suppress(Exception):
                s.context.close()
        server.stop()


class TestHistory:
    def test_each_write_keeps_the_content_it_replaced_newest_first(self, client, root):
        put_note(client, "notes/h.md", "one")
        update(client, "notes/h.md", "two")
        update(client, "notes/h.md", "three")
        listing = versions_of(client, "notes/h.md")
        assert listing["total"] == 2
        assert (listing["limit"], listing["offset"]) == (100, 0)
        first, second = listing["versions"]
        assert set(first) == {"id", "savedAt", "size", "etag", "reason"}
        assert re.fullmatch(r"[A-Za-z0-9_-]+", first["id"])
        assert "/" not in first["id"]
        assert "notes" not in first["id"]
        assert first["reason"] == second["reason"] == "updated"
        assert first["savedAt"] >= second["savedAt"]
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["savedAt"])
        one = data(client.get(f"{note_url('notes/h.md')}/versions/{second['id']}"))
        assert one["content"] == "one"
        assert one["path"] == "notes/h.md"
        assert one["id"] == second["id"]
        assert one["etag"] == second["etag"] == notesvc.make_etag(b"one")
        assert (first["size"], second["size"]) == (3, 3)
        assert version_contents(client, "notes/h.md") == ["two", "one"]
        history = root / ".notesvc" / "history"
        assert stat.S_IMODE(history.stat().st_mode) == 0o700
        for path in history.rglob("*"):
            assert stat.S_IMODE(path.stat().st_mode) == (0o700 if path.is_dir() else 0o600), path

    def test_identical_consecutive_contents_are_stored_once(self, client):
        put_note(client, "notes/same.md", "a")
        for _ in range(3):
            update(client, "notes/same.md", "b")
        update(client, "notes/same.md", "a")
        update(client, "notes/same.md", "b")
        assert version_contents(client, "notes/same.md") == ["a", "b", "a"]

    def test_channels_link_rewrites_moves_and_deletes_keep_versions(self, client):
        channel = web_channel(client)
        save_by_channel(client, channel, "/save first thought")
        save_by_channel(client, channel, "/save second thought")
        inbox = data(client.get(f"{API}/notes?folder=notes/daily"))["notes"][0]["path"]
        (kept,) = version_contents(client, inbox)
        assert "first thought" in kept
        assert "second thought" not in kept
        put_note(client, "notes/target.md", "# Target")
        put_note(client, "notes/linker.md", "see [[target]]")
        client.patch_json(
            note_url("notes/target.md") + "/move", {"path": "notes/moved.md", "updateLinks": True}
        )
        linker = versions_of(client, "notes/linker.md")["versions"]
        assert [v["reason"] for v in linker] == ["linksRewritten"]
        assert version_contents(client, "notes/linker.md") == ["see [[target]]"]
        assert [v["reason"] for v in versions_of(client, "notes/moved.md")["versions"]] == ["moved"]
        update(client, "notes/moved.md", "# Target, edited")
        client.delete(note_url("notes/moved.md"))
        deleted = versions_of(client, "notes/moved.md")["versions"]
        assert [v["reason"] for v in deleted] == ["deleted", "moved"]
        assert version_contents(client, "notes/moved.md")[0] == "# Target, edited"

    def test_history_follows_a_note_across_moves(self, client):
        put_note(client, "notes/a.md", "v1")
        update(client, "notes/a.md", "v2")
        client.patch_json(note_url("notes/a.md") + "/move", {"path": "notes/deep/b.md"})
        update(client, "notes/deep/b.md", "v3")
        assert version_contents(client, "notes/deep/b.md") == ["v2", "v1"]
        assert_error(versions_of_raw(client, "notes/a.md", 404), 404, "NOT_FOUND")

    def test_a_move_onto_the_path_of_a_deleted_note_merges_their_histories(self, client):
        put_note(client, "notes/old.md", "old 1")
        update(client, "notes/old.md", "old 2")
        client.delete(note_url("notes/old.md"))
        put_note(client, "notes/new.md", "new 1")
        update(client, "notes/new.md", "new 2")
        client.patch_json(note_url("notes/new.md") + "/move", {"path": "notes/old.md"})
        assert sorted(version_contents(client, "notes/old.md")) == [
            "new 1",
            "new 2",
            "old 1",
            "old 2",
        ]

    def test_restore_is_a_write_guarded_by_if_match_that_keeps_what_it_replaced(self, client):
        put_note(client, "notes/r.md", "first")
        update(client, "notes/r.md", "second")
        (old,) = versions_of(client, "notes/r.md")["versions"]
        url = f"{note_url('notes/r.md')}/versions/{old['id']}/restore"
        resp = client.post(url, headers={"If-Match": '"stale"'}, status=412)
        assert_error(resp, 412, "PRECONDITION_FAILED")
        current = client.get(note_url("notes/r.md")).headers["ETag"]
        resp = client.post(url, headers={"If-Match": current})
        rec = data(resp)
        assert rec["content"] == "first"
        assert resp.headers["ETag"] == rec["etag"] == notesvc.make_etag(b"first")
        assert data(client.get(note_url("notes/r.md")))["content"] == "first"
        newest = versions_of(client, "notes/r.md")["versions"][0]
        assert newest["reason"] == "restored"
        assert version_contents(client, "notes/r.md") == ["second", "first"]
        assert feed(client)["changes"][-1]["kind"] == "restored"
        assert search(client, "first")["total"] == 1  # the index follows

    def test_restoring_a_version_of_a_deleted_note_recreates_it(self, client):
        put_note(client, "notes/gone/x.md", "keep me")
        update(client, "notes/gone/x.md", "keep me too")
        client.delete(note_url("notes/gone/x.md"))
        client.get(note_url("notes/gone/x.md"), status=404)
        listing = versions_of(client, "notes/gone/x.md")["versions"]
        assert [v["reason"] for v in listing] == ["deleted", "updated"]
        url = f"{note_url('notes/gone/x.md')}/versions/{listing[1]['id']}/restore"
        client.post(url, headers={"If-Match": "*"}, status=412)  # there is no note to match
        assert data(client.post(url))["content"] == "keep me"
        assert data(client.get(note_url("notes/gone/x.md")))["content"] == "keep me"

    def test_diff_against_the_current_note_or_another_version(self, client):
        put_note(client, "notes/d.md", "alpha\nbeta\ngamma\n")
        update(client, "notes/d.md", "alpha\nBETA\ngamma\n")
        update(client, "notes/d.md", "alpha\nBETA\ngamma\ndelta")
        newer, older = versions_of(client, "notes/d.md")["versions"]
        base = f"{note_url('notes/d.md')}/versions/{older['id']}/diff"
        d = data(client.get(base))
        assert d["against"] == "current"
        assert d["diff"] == (
            f"--- notes/d.md@{older['id']}\n"
            "+++ notes/d.md@current\n"
            "@@ -1,3 +1,4 @@\n"
            " alpha\n"
            "-beta\n"
            "+BETA\n"
            " gamma\n"
            "+delta\n"
            "\\ No newline at end of file\n"
        )
        d = data(client.get(f"{base}?against={newer['id']}"))
        assert "-beta\n+BETA\n" in d["diff"]
        assert "delta" not in d["diff"]
        same = data(
            client.get(
                f"{note_url('notes/d.md')}/versions/{newer['id']}/diff?against={newer['id']}"
            )
        )
        assert same["diff"] == ""
        other = "1795388114646622-updated-" + "0" * 32
        assert_error(client.get(f"{base}?against={other}", status=404), 404, "NOT_FOUND")
        assert_error(client.get(f"{base}?against=..%2F..", status=400), 400, "VALIDATION_ERROR")

    def test_a_large_diff_stays_linear_and_patches_correctly(self, client):
        import random

        rnd = random.Random(5)
        old = "".join(f"{rnd.randrange(150)}\n" for _ in range(12000))
        new = "".join(f"{rnd.randrange(150)}\n" for _ in range(12000))
        put_note(client, "notes/big.md", old)
        update(client, "notes/big.md", new)
        (v,) = versions_of(client, "notes/big.md")["versions"]
        started = time.monotonic()
        diff = data(client.get(f"{note_url('notes/big.md')}/versions/{v['id']}/diff"))["diff"]
        assert time.monotonic() - started < 5
        if shutil.which("patch"):
            with tempfile.TemporaryDirectory() as tmp:
                Path(tmp, "f").write_text(old)
                Path(tmp, "p").write_text(diff)
                subprocess.run(["patch", "-s", f"{tmp}/f", f"{tmp}/p"], check=True, timeout=30)
                assert Path(tmp, "f").read_text() == new

    def test_bad_ids_paths_and_pages(self, client):
        put_note(client, "notes/v.md", "a")
        for i in range(3):
            update(client, "notes/v.md", f"b{i}")
        page = versions_of(client, "notes/v.md", limit=1, offset=1)
        assert (page["total"], len(page["versions"]), page["limit"], page["offset"]) == (3, 1, 1, 1)
        assert (
            version_contents(client, "notes/v.md")[1]
            == data(client.get(f"{note_url('notes/v.md')}/versions/{page['versions'][0]['id']}"))[
                "content"
            ]
        )
        url = note_url("notes/v.md") + "/versions"
        for bad in ("limit=0", "limit=1001", "limit=x", "offset=-1", "offset=1.5"):
            assert_error(client.get(f"{url}?{bad}", status=400), 400, "VALIDATION_ERROR")
        for garbage in ("nope", "..%2F..%2Fstate.json", "1" * 300, "%00", "head"):
            for suffix in ("", "/diff"):
                resp = client.get(f"{url}/{garbage}{suffix}", status=400)
                assert_error(resp, 400, "VALIDATION_ERROR")
            resp = client.post(f"{url}/{garbage}/restore", status=[400, 405])
            assert resp.json["success"] is False  # a decoded %2F leaves no such route: 405
        unknown = "1795388114646622-updated-" + "f" * 32
        for method, suffix in (("get", ""), ("get", "/diff"), ("post", "/restore")):
            resp = getattr(client, method)(f"{url}/{unknown}{suffix}", status=404)
            assert_error(resp, 404, "NOT_FOUND")
        assert_error(versions_of_raw(client, "notes/never.md", 404), 404, "NOT_FOUND")
        for hostile in ("notes/../x.md", "../etc/passwd", "notes/.hidden/x.md", "notes/a\u202e.md"):
            assert_error(versions_of_raw(client, hostile, 400), 400, "VALIDATION_ERROR")

    def test_a_note_in_a_folder_named_like_the_versions_route_is_still_read(self, client):
        put_note(client, "notes/x.md/versions/y.md", "tricky")
        assert data(client.get(note_url("notes/x.md/versions/y.md")))["content"] == "tricky"

    def test_retention_keeps_the_newest_and_whatever_is_younger_than_its_days(self, make_app):
        client = with_key(make_app(SERVICE_HISTORY_MAX_VERSIONS="3", SERVICE_HISTORY_DAYS="1"))
        svc = client.app.service
        now = [time.time()]
        svc.history.clock = lambda: now[0]  # the injectable clock
        put_note(client, "notes/r.md", "v0")
        for i in range(1, 7):
            update(client, "notes/r.md", f"v{i}")
        assert versions_of(client, "notes/r.md")["total"] == 6  # all younger than a day
        now[0] += 2 * 86400
        assert svc.notes.sweep_history() == 3  # what the hourly retention runs
        assert version_contents(client, "notes/r.md") == ["v5", "v4", "v3"]
        update(client, "notes/r.md", "v7")  # each write applies the retention to its note
        assert version_contents(client, "notes/r.md") == ["v6", "v5", "v4"]
        client.delete(note_url("notes/r.md"))
        now[0] += 2 * 86400
        svc.notes.sweep_history()
        assert len(version_contents(client, "notes/r.md")) == 3  # a deleted note's too
        svc.history.max_versions = 1
        svc.notes.sweep_history()
        assert version_contents(client, "notes/r.md") == ["v7"]

    def test_retention_by_count_only_when_days_is_zero(self, make_app):
        client = with_key(make_app(SERVICE_HISTORY_MAX_VERSIONS="2", SERVICE_HISTORY_DAYS="0"))
        put_note(client, "notes/c.md", "v0")
        for i in range(1, 6):
            update(client, "notes/c.md", f"v{i}")
        assert version_contents(client, "notes/c.md") == ["v4", "v3"]

    def test_history_off_keeps_nothing_and_the_audit_says_so(self, make_app, root):
        client = with_key(make_app(SERVICE_HISTORY_MAX_VERSIONS="0"))
        put_note(client, "notes/off.md", "a")
        update(client, "notes/off.md", "b")
        assert versions_of(client, "notes/off.md")["total"] == 0
        assert not (root / ".notesvc" / "history").exists()
        found = {f["id"]: f for f in data(client.get(f"{API}/security/audit"))["findings"]}
        assert found["history-off"]["severity"] == "low"
        assert "SERVICE_HISTORY_MAX_VERSIONS" in found["history-off"]["recommendation"]
        assert feed(client)["changes"][-1]["kind"] == "updated"  # the feed runs without it
        on = with_key(make_app(tmp_path_factory_root(root)))
        assert "history-off" not in {
            f["id"] for f in data(on.get(f"{API}/security/audit"))["findings"]
        }

    def test_an_external_edit_keeps_what_it_replaced(self, client, root):
        put_note(client, "notes/e.md", "mine 1")
        update(client, "notes/e.md", "mine 2")
        (root / "notes" / "e.md").write_text("theirs")  # another program, in place
        client.app.service.sync_index()  # what the rescan runs
        listing = versions_of(client, "notes/e.md")["versions"]
        assert [v["reason"] for v in listing] == ["external", "updated"]
        assert version_contents(client, "notes/e.md") == ["mine 2", "mine 1"]
        (root / "notes" / "e.md").unlink()
        client.app.service.sync_index()
        assert version_contents(client, "notes/e.md")[0] == "theirs"
        changes = feed(client)["changes"]
        assert [(c["kind"], c["path"]) for c in changes[-2:]] == [
            ("updated", "notes/e.md"),
            ("deleted", "notes/e.md"),
        ]
        assert changes[-2]["etag"] == notesvc.make_etag(b"theirs")

    def test_a_note_that_was_there_before_gets_its_copy_at_start(self, make_app, root):
        (root / "notes").mkdir(parents=True)
        (root / "notes" / "pre.md").write_text("from before notesvc")
        client = with_key(make_app())
        (root / "notes" / "pre.md").write_text("edited by hand")
        client.app.service.sync_index()
        assert version_contents(client, "notes/pre.md") == ["from before notesvc"]
        changes = feed(client)["changes"]
        assert [(c["kind"], c["path"]) for c in changes] == [("updated", "notes/pre.md")]

    def test_system_info_reports_history_trash_and_the_feed(self, client):
        put_note(client, "notes/i.md", "12345")
        update(client, "notes/i.md", "123")
        put_note(client, "notes/j.md", "xy")
        client.delete(note_url("notes/j.md"))
        info = data(client.get(f"{API}/system/info"))
        assert info["history"]["notes"] == 2
        assert info["history"]["versions"] == 2  # 12345 and the deleted xy
        assert info["history"]["bytes"] >= 7
        assert info["history"]["maxVersions"] == 50
        assert info["trash"] == {"items": 1, "bytes": 2}
        assert info["changes"] == {"last": 4, "floor": 0, "waiting": 0}
        sync = data(client.get(f"{API}/system/config"))["sync"]
        assert (sync["historyMaxVersions"], sync["historyDays"], sync["trashDays"]) == (50, 90, 30)
        assert sync["maxWaiters"] == 4


def trash_items(client) -> list:
    return data(client.get(f"{API}/trash"))["items"]


def plant_in_trash(root: Path, path: str, content: bytes, when: float | None = None) -> Path:
    """Put a file into the trash the way a delete does (attachments' deletes included)."""
    stamp = time.strftime("%Y%m%dT%H%M%S.000000Z", time.gmtime(when or time.time()))
    target = root / ".notesvc" / "trash" / stamp / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(content)
    return target


class TestTrash:
    def test_list_read_restore_and_purge(self, client, root):
        put_note(client, "notes/t/one.md", "# One")
        put_note(client, "notes/t/two.md", "# Two")
        gone = data(client.delete(note_url("notes/t/one.md")))
        client.delete(note_url("notes/t/two.md"))
        listing = data(client.get(f"{API}/trash"))
        assert (listing["total"], listing["limit"], listing["offset"]) == (2, 100, 0)
        two, one = listing["items"]  # the most recent first
        assert (one["path"], two["path"]) == ("notes/t/one.md", "notes/t/two.md")
        assert one["id"] == gone["trashId"]
        assert set(one) == {"id", "path", "kind", "deletedAt", "size"}
        assert (one["kind"], one["size"]) == ("note", 5)
        assert re.fullmatch(r"[A-Za-z0-9_-]+", one["id"])
        assert "notes" not in one["id"]
        item = data(client.get(f"{API}/trash/{one['id']}"))
        assert item["content"] == "# One"
        assert item["path"] == "notes/t/one.md"
        rec = data(client.post(f"{API}/trash/{one['id']}/restore"))
        assert rec["path"] == "notes/t/one.md"
        assert rec["content"] == "# One"
        assert data(client.get(note_url("notes/t/one.md")))["content"] == "# One"
        assert search(client, "one")["total"] == 1
        assert feed(client)["changes"][-1]["kind"] == "restored"
        assert data(client.delete(f"{API}/trash/{two['id']}")) == {"id": two["id"], "purged": True}
        assert trash_items(client) == []
        assert_error(client.get(f"{API}/trash/{two['id']}", status=404), 404, "NOT_FOUND")
        assert_error(client.delete(f"{API}/trash/{two['id']}", status=404), 404, "NOT_FOUND")
        assert list((root / ".notesvc" / "trash").iterdir()) == []  # emptied folders go

    def test_restore_refuses_a_taken_path_and_restores_elsewhere_with_its_history(self, client):
        put_note(client, "notes/x.md", "old 1")
        update(client, "notes/x.md", "old 2")
        client.delete(note_url("notes/x.md"))
        put_note(client, "notes/x.md", "a new note there")
        (item,) = trash_items(client)
        url = f"{API}/trash/{item['id']}/restore"
        err = assert_error(client.post(url, status=409), 409, "CONFLICT")
        assert '"path"' in err["message"]
        taken = client.post_json(url, {"path": "notes/x.md"}, status=409)
        assert_error(taken, 409, "CONFLICT")
        rec = data(client.post_json(url, {"path": "notes/elsewhere/x.md"}))
        assert rec["content"] == "old 2"
        assert version_contents(client, "notes/elsewhere/x.md") == ["old 2", "old 1"]
        assert version_contents(client, "notes/x.md") == ["old 2", "old 1"]  # still its own
        assert data(client.get(note_url("notes/x.md")))["content"] == "a new note there"

    def test_restoring_to_its_own_free_path_brings_its_history_back(self, client):
        put_note(client, "notes/y.md", "y1")
        update(client, "notes/y.md", "y2")
        client.delete(note_url("notes/y.md"))
        (item,) = trash_items(client)
        client.post(f"{API}/trash/{item['id']}/restore")
        update(client, "notes/y.md", "y3")
        assert version_contents(client, "notes/y.md") == ["y2", "y1"]

    def test_bad_ids_bodies_and_paths(self, client):
        put_note(client, "notes/z.md", "z")
        client.delete(note_url("notes/z.md"))
        (item,) = trash_items(client)
        url = f"{API}/trash/{item['id']}/restore"
        for garbage in ("nope", "x" * 300 + "-0123456789abcdef", "%00", "..", "a-b"):
            assert_error(client.get(f"{API}/trash/{garbage}", status=400), 400, "VALIDATION_ERROR")
            resp = client.post(f"{API}/trash/{garbage}/restore", status=400)
            assert_error(resp, 400, "VALIDATION_ERROR")
            resp = client.delete(f"{API}/trash/{garbage}", status=400)
            assert_error(resp, 400, "VALIDATION_ERROR")
        for method in ("get", "delete"):  # a decoded %2F leaves no such route
            resp = getattr(client, method)(f"{API}/trash/..%2F..%2Fstate.json", status=404)
            assert_error(resp, 404, "NOT_FOUND")
        for bad in ("limit=0", "limit=1001", "offset=-1", "limit=ten"):
            resp = client.get(f"{API}/trash?{bad}", status=400)
            assert_error(resp, 400, "VALIDATION_ERROR")
        unknown = "20240101T000000000000Z-0123456789abcdef"
        assert_error(client.post(f"{API}/trash/{unknown}/restore", status=404), 404, "NOT_FOUND")
        resp = client.post(url, b"{not json", content_type="application/json", status=400)
        assert_error(resp, 400, "VALIDATION_ERROR")
        for body in ([1], {"path": 5}, {"path": ["notes/a.md"]}, {"path": ""}):
            assert_error(client.post_json(url, body, status=400), 400, "VALIDATION_ERROR")
        for hostile in (
            "notes/../../state.json",
            "/etc/passwd",
            "notes/.notesvc/x.md",
            "attachments/cat.png",  # a note goes back under notes/
            "notes/a\u200b.md",
        ):
            resp = client.post_json(url, {"path": hostile}, status=400)
            assert_error(resp, 400, "VALIDATION_ERROR")
        resp = client.post(url, "x", content_type="text/plain", status=415)
        assert_error(resp, 415, "UNSUPPORTED_MEDIA_TYPE")
        big = {"path": "notes/a.md", "pad": "x" * 1_100_000}
        assert_error(client.post_json(url, big, status=413), 413, "PAYLOAD_TOO_LARGE")
        assert len(trash_items(client)) == 1  # nothing happened

    def test_an_item_whose_path_breaks_the_rules_is_restored_only_elsewhere(self, client, root):
        plant_in_trash(root, "notes/a:b.md", b"planted by hand")
        (item,) = trash_items(client)
        url = f"{API}/trash/{item['id']}/restore"
        assert_error(client.post(url, status=400), 400, "VALIDATION_ERROR")
        assert not (root / "notes" / "a:b.md").exists()
        rec = data(client.post_json(url, {"path": "notes/ab.md"}))
        assert rec["content"] == "planted by hand"

    def test_items_older_than_trash_days_are_purged(self, make_app, root):
        client = with_key(make_app(SERVICE_TRASH_DAYS="1"))
        put_note(client, "notes/old.md", "old")
        client.delete(note_url("notes/old.md"))
        trash = client.app.service.trash
        assert trash.purge_expired() == 0
        trash.clock = lambda: time.time() + 2 * 86400  # the injectable clock
        assert trash.purge_expired() == 1
        assert trash_items(client) == []
        keeper = with_key(make_app(tmp_path_factory_root(root), SERVICE_TRASH_DAYS="0"))
        put_note(keeper, "notes/k.md", "k")
        keeper.delete(note_url("notes/k.md"))
        keeper.app.service.trash.clock = lambda: time.time() + 3650 * 86400
        assert keeper.app.service.trash.purge_expired() == 0

    def test_an_expired_item_goes_when_the_server_starts(self, make_app, root):
        make_app()
        planted = plant_in_trash(root, "notes/ancient.md", b"x", when=time.time() - 40 * 86400)
        fresh = plant_in_trash(root, "notes/recent.md", b"y")
        client = with_key(make_app())
        wait_for(lambda: not planted.exists(), timeout=10)
        assert fresh.exists()
        assert [i["path"] for i in trash_items(client)] == ["notes/recent.md"]

    def test_a_trashed_attachment_is_listed_and_restored_as_a_file(self, client, root):
        png = b"\x89PNG\r\n\x1a\n" + bytes(range(256))
        plant_in_trash(root, "attachments/photos/cat.png", png)
        (item,) = trash_items(client)
        assert (item["kind"], item["path"], item["size"]) == (
            "attachment",
            "attachments/photos/cat.png",
            len(png),
        )
        assert data(client.get(f"{API}/trash/{item['id']}"))["content"] is None
        url = f"{API}/trash/{item['id']}/restore"
        for wrong in (
            "notes/cat.md",
            "attachments/../x.png",
            "attachments/.h/x.png",
            "attachments/cat.exe",  # not an allowed kind of attachment
        ):
            resp = client.post_json(url, {"path": wrong}, status=400)
            assert_error(resp, 400, "VALIDATION_ERROR")
        (root / "attachments" / "photos").mkdir(parents=True)
        (root / "attachments" / "photos" / "cat.png").write_bytes(b"another cat")
        assert_error(client.post(url, status=409), 409, "CONFLICT")
        rec = data(client.post_json(url, {"path": "attachments/photos/cat-2.png"}))
        assert rec["path"] == "attachments/photos/cat-2.png"
        assert rec["size"] == len(png)
        assert rec["contentType"] == "image/png"
        served = client.get(f"{API}/attachments/" + urllib.parse.quote(rec["path"], safe=""))
        assert served.body == png
        assert served.headers["ETag"] == rec["etag"]
        assert (root / "attachments" / "photos" / "cat-2.png").read_bytes() == png
        assert (root / "attachments" / "photos" / "cat.png").read_bytes() == b"another cat"
        assert trash_items(client) == []
        assert data(client.get(f"{API}/system/info"))["history"]["notes"] == 0  # none kept

    def test_a_deleted_attachment_comes_back_from_the_trash(self, client, root):
        upload(client, "attachments/trip/photo.png")
        gone = data(client.delete(att_url("attachments/trip/photo.png")))
        (item,) = trash_items(client)
        assert (item["id"], item["kind"], item["path"]) == (
            gone["trashId"],
            "attachment",
            "attachments/trip/photo.png",
        )
        assert stat.S_IMODE((root / ".notesvc" / "trash").stat().st_mode) == 0o700
        rec = data(client.post(f"{API}/trash/{item['id']}/restore"))
        assert rec["path"] == "attachments/trip/photo.png"
        assert client.get(att_url("attachments/trip/photo.png")).body == PNG
        assert trash_items(client) == []
        assert feed(client)["changes"] == []  # the feed is about notes

    def test_a_restore_cannot_escape_through_a_symbolic_link(self, client, root, tmp_path):
        outside = tmp_path / "outside"
        outside.mkdir()
        plant_in_trash(root, "attachments/evil/x.png", b"x")
        (root / "attachments").mkdir()
        (root / "attachments" / "evil").symlink_to(outside)
        (item,) = trash_items(client)
        resp = client.post(f"{API}/trash/{item['id']}/restore", status=400)
        assert_error(resp, 400, "VALIDATION_ERROR")
        assert list(outside.iterdir()) == []
        plant_in_trash(root, "notes/evil/n.md", b"n")
        (root / "notes" / "evil").symlink_to(outside)
        note = next(i for i in trash_items(client) if i["kind"] == "note")
        resp = client.post(f"{API}/trash/{note['id']}/restore", status=400)
        assert_error(resp, 400, "VALIDATION_ERROR")
        assert list(outside.iterdir()) == []


def at(text: str, zone: str = "Europe/Paris") -> float:
    return notesvc.timestamp_of(
        notesvc.dt.datetime.strptime(text, "%Y-%m-%d %H:%M"), notesvc.time_zone(zone)
    )


class TestChanges:
    def test_every_kind_of_change_in_order(self, client):
        assert feed(client) == {"changes": [], "last": 0, "more": False}
        put_note(client, "notes/f.md", "a")
        update(client, "notes/f.md", "b")
        client.patch_json(note_url("notes/f.md") + "/move", {"path": "notes/g.md"})
        client.delete(note_url("notes/g.md"))
        (item,) = trash_items(client)
        client.post(f"{API}/trash/{item['id']}/restore")
        d = feed(client)
        assert d["last"] == 5
        assert d["more"] is False
        assert [(c["seq"], c["kind"], c["path"]) for c in d["changes"]] == [
            (1, "created", "notes/f.md"),
            (2, "updated", "notes/f.md"),
            (3, "moved", "notes/g.md"),
            (4, "deleted", "notes/g.md"),
            (5, "restored", "notes/g.md"),
        ]
        moved, deleted = d["changes"][2], d["changes"][3]
        assert moved["from"] == "notes/f.md"
        assert moved["etag"] == notesvc.make_etag(b"b")
        assert "etag" not in deleted
        assert "from" not in deleted
        for c in d["changes"]:
            assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", c["at"])
        page = feed(client, since=1, limit=2)
        assert [c["seq"] for c in page["changes"]] == [2, 3]
        assert (page["last"], page["more"]) == (3, True)
        assert feed(client, since=5) == {"changes": [], "last": 5, "more": False}

    def test_channels_plugins_and_link_rewrites_are_in_the_feed(self, client):
        channel = web_channel(client)
        save_by_channel(client, channel, "/save an idea")  # creates today's daily note
        client.post(f"{API}/plugins/daily/today", status=200)  # which is there already
        save_by_channel(client, channel, "/save another")
        put_note(client, "notes/t.md", "# T")
        put_note(client, "notes/l.md", "[[t]]")
        client.patch_json(
            note_url("notes/t.md") + "/move", {"path": "notes/u.md", "updateLinks": True}
        )
        kinds = [(c["kind"], c["path"].split("/")[1]) for c in feed(client)["changes"]]
        assert kinds == [
            ("created", "daily"),
            ("updated", "daily"),
            ("created", "t.md"),
            ("created", "l.md"),
            ("moved", "u.md"),
            ("updated", "l.md"),
        ]

    def test_bad_cursors_and_parameters(self, client):
        put_note(client, "notes/a.md", "a")
        for bad in (
            "since=-1",
            "since=x",
            "since=1.5",
            "since=99999999999",
            "wait=26",
            "wait=-1",
            "limit=0",
            "limit=1001",
            "since=%00",
        ):
            resp = client.get(f"{API}/changes?{bad}", status=400)
            assert_error(resp, 400, "VALIDATION_ERROR")
        err = assert_error(client.get(f"{API}/changes?since=2", status=410), 410, "GONE")
        assert err["resetRequired"] is True
        assert "since=1" in err["message"]

    def test_410_after_compaction_and_the_journal_survives_a_restart(self, make_app, root):
        client = with_key(make_app())
        client.app.service.journal.keep = 3  # injectable, as the clocks
        for i in range(8):
            put_note(client, f"notes/c{i}.md", "x")
        journal = client.app.service.journal
        assert journal.floor > 0
        err = assert_error(client.get(f"{API}/changes?since=0", status=410), 410, "GONE")
        assert err["resetRequired"] is True
        d = feed(client, since=journal.floor)
        assert d["changes"][-1]["seq"] == 8
        again = with_key(make_app())
        assert again.app.service.journal.floor == journal.floor
        put_note(again, "notes/after.md", "y")
        assert feed(again, since=8)["changes"][0]["seq"] == 9
        client.get(f"{API}/changes?since=0", status=410)
        log_file = root / ".notesvc" / "changes.log"
        assert stat.S_IMODE(log_file.stat().st_mode) == 0o600

    def test_a_torn_last_line_is_dropped_and_numbering_goes_on(self, make_app, root):
        client = with_key(make_app())
        put_note(client, "notes/a.md", "a")
        put_note(client, "notes/b.md", "b")
        log_file = root / ".notesvc" / "changes.log"
        raw = log_file.read_bytes()
        end = raw.index(b"\0") if b"\0" in raw else len(raw)
        with open(log_file, "r+b") as f:  # a crash in the middle of the next line
            f.seek(end)
            f.write(b'{"seq":3,"kind":"upd')
        again = with_key(make_app())
        assert feed(again)["last"] == 2
        put_note(again, "notes/c.md", "c")
        put_note(again, "notes/d.md", "d")
        third = with_key(make_app())
        assert [c["path"] for c in feed(third)["changes"]] == [
            "notes/a.md",
            "notes/b.md",
            "notes/c.md",
            "notes/d.md",
        ]

    def test_an_unreadable_journal_starts_over_with_410_for_old_cursors(self, make_app, root):
        client = with_key(make_app())
        put_note(client, "notes/a.md", "a")
        put_note(client, "notes/b.md", "b")
        log_file = root / ".notesvc" / "changes.log"
        log_file.write_bytes(b"garbage\n" + log_file.read_bytes().split(b"\n", 1)[1])
        again = with_key(make_app())
        assert_error(again.get(f"{API}/changes?since=1", status=410), 410, "GONE")
        put_note(again, "notes/c.md", "c")
        assert feed(again, since=2)["changes"][0]["seq"] == 3

    def test_with_history_off_a_rebuilt_index_resets_the_feed(self, make_app, root):
        client = with_key(make_app(SERVICE_HISTORY_MAX_VERSIONS="0"))
        put_note(client, "notes/a.md", "a")
        (root / ".notesvc" / "index.cache").unlink(missing_ok=True)
        again = with_key(make_app(SERVICE_HISTORY_MAX_VERSIONS="0"))
        assert_error(again.get(f"{API}/changes?since=0", status=410), 410, "GONE")
        assert feed(again, since=1)["changes"] == []

    def test_max_waiters_setting(self):
        cfg = notesvc.load_config(env={"SERVICE_THREADS": "8"})
        assert cfg.max_waiters == 4
        assert notesvc.load_config(env={"SERVICE_THREADS": "1"}).max_waiters == 0
        assert notesvc.load_config(env={"SERVICE_MAX_WAITERS": "7"}).max_waiters == 7
        for bad in ("8", "x", "-1", "256"):
            with pytest.raises(notesvc.ConfigError, match="SERVICE_MAX_WAITERS"):
                notesvc.load_config(env={"SERVICE_MAX_WAITERS": bad})
        for name in ("HISTORY_MAX_VERSIONS", "HISTORY_DAYS", "TRASH_DAYS"):
            with pytest.raises(notesvc.ConfigError, match=name):
                notesvc.load_config(env={f"SERVICE_{name}": "-1"})


def long_poll(server: Server, since: int, wait: float, prefix: str = "", headers=None) -> tuple:
    """Return (status, headers, data, seconds) of one change-feed request."""
    started = time.monotonic()
    status, hdrs, body = server.request(
        "GET", f"{prefix}{API}/changes?since={since}&wait={wait}", headers=headers
    )
    return status, hdrs, (body or {}).get("data"), time.monotonic() - started


def feed_waiting(server: Server, prefix: str = "", headers=None) -> int:
    return server.request("GET", f"{prefix}{API}/system/info", headers=headers)[2]["data"][
        "changes"
    ]["waiting"]


def relay_servers(relay: Server) -> int:
    try:
        return relay.request("GET", "/health")[2]["data"]["servers"]
    except OSError:
        return 0


class TestHistoryServer:
    """History and the change feed on real servers: crashes, long-polls, the relay."""

    pytestmark = [pytest.mark.real_server, pytest.mark.slow]

    def test_a_folder_grant_sees_no_version_saved_before_the_move_into_its_folder(self, tmp_path):
        with running(tmp_path) as server:
            owner = {"X-Service-Key": make_state(tmp_path)["apiKey"]}
            secret = "# Plan\n\nthe safe's code is 4711\n"
            body = {"path": "notes/private/plan.md", "content": secret}
            assert server.request("POST", f"{API}/notes", body, owner)[0] == 201
            url = note_url("notes/private/plan.md")
            assert (
                server.request("PUT", url, {"content": "# Plan\n\nnothing here\n"}, owner)[0] == 200
            )
            moved = {"path": "notes/family/plan.md"}
            assert server.request("PATCH", url + "/move", moved, owner)[0] == 200
            url = note_url("notes/family/plan.md")
            for text in ("# Plan\n\nfor all\n", "# Plan\n\nfor all, again\n"):
                assert server.request("PUT", url, {"content": text}, owner)[0] == 200
            grant = {"name": "family", "scope": "write", "folder": "notes/family"}
            status, _, made = server.request("POST", f"{API}/auth/keys", grant, owner)
            family = {"X-Service-Key": made["data"]["key"]}
            everything = server.request("GET", url + "/versions", None, owner)[2]["data"]
            seen = server.request("GET", url + "/versions", None, family)[2]["data"]
            before = {v["id"] for v in everything["versions"]} - {v["id"] for v in seen["versions"]}
            assert before
            assert seen["total"] == len(seen["versions"]) >= 1
            for v in everything["versions"]:  # the owner still sees the whole history
                text = server.request("GET", f"{url}/versions/{v['id']}", None, owner)[2]
                assert text["success"]
            leaked = [
                server.request("GET", f"{url}/versions/{v['id']}", None, family)[2]["data"][
                    "content"
                ]
                for v in seen["versions"]
            ]
            assert not any("4711" in text for text in leaked)
            after = seen["versions"][0]["id"]
            for vid in before:  # every way of reading an older version is 404 for the grant
                for method, path in (
                    ("GET", f"{url}/versions/{vid}"),
                    ("GET", f"{url}/versions/{vid}/diff"),
                    ("GET", f"{url}/versions/{after}/diff?against={vid}"),
                    ("POST", f"{url}/versions/{vid}/restore"),
                ):
                    status, _, answer = server.request(method, path, None, family)
                    assert (status, answer["error"]["code"]) == (404, "NOT_FOUND"), path
                    assert "4711" not in json.dumps(answer)
            assert server.request("GET", f"{url}/versions/{after}/diff", None, family)[0] == 200
            assert (
                "4711"
                in server.request("GET", f"{url}/versions/{min(before)}", None, owner)[2]["data"][
                    "content"
                ]
            )

    def test_sigkill_during_puts_leaves_old_or_new_and_the_history_whole(self, tmp_path):
        root = tmp_path / "srv"
        contents = [f"# v{i}\n\n" + f"line {i}\n" * 3000 for i in range(40)]
        url = note_url("notes/crash.md")
        for round_ in range(2):
            server = Server(root, "--auth-mode", "none")
            acked = []  # contents whose PUT answered 200, in order
            try:
                if round_ == 0:
                    status, _, _ = server.request(
                        "POST", f"{API}/notes", {"path": "notes/crash.md", "content": contents[0]}
                    )
                    assert status == 201
                current = server.request("GET", url)[2]["data"]["content"]
                acked.append(current)

                def writer(start: int, acked=acked, server=server):
                    i = start
                    while True:
                        content = contents[i % len(contents)]
                        try:
                            status, _, _ = server.request("PUT", url, {"content": content})
                        except (OSError, http.client.HTTPException):  # killed
                            return
                        if status == 200:
                            acked.append(content)
                        i += 1

                start = contents.index(current) + 1 if current in contents else 0
                t = threading.Thread(target=writer, args=(start,))
                t.start()
                enough = 8 + 8 * round_  # well under way
                wait_for(lambda acked=acked, enough=enough: len(acked) > enough, step=0.01)
                server.proc.kill()  # SIGKILL, in the middle of the next PUT: no clean-up
                server.proc.wait(10)
                t.join(30)
            finally:
                server.stop()
            assert len(acked) > 3
            on_disk = (root / "notes" / "crash.md").read_text()
            assert on_disk in (*contents, acked[0])  # old or new, never torn
            history = root / ".notesvc" / "history"
            kept = {}
            for f in history.rglob("*"):
                if f.is_file() and notesvc.VERSION_ID_RE.match(f.name):
                    raw = f.read_bytes()
                    assert f.name.endswith(notesvc.make_etag(raw)[1:-1]), "a torn version"
                    kept[f.name] = raw.decode()
            replaced = set(acked[:-1])  # every acknowledged PUT kept what it replaced
            if on_disk != acked[-1]:  # the PUT in flight replaced the note: that too
                replaced.add(acked[-1])
            assert replaced <= set(kept.values())
            with running(root, "--auth-mode", "none") as again:
                assert again.request("GET", url)[2]["data"]["content"] == on_disk
                listing = again.request("GET", url + "/versions?limit=1000")[2]["data"]
                assert set(kept) <= {v["id"] for v in listing["versions"]}
                for v in listing["versions"][:5]:
                    body = again.request("GET", f"{url}/versions/{v['id']}")[2]["data"]
                    assert body["content"] == kept[v["id"]]
                changes = again.request("GET", f"{API}/changes?limit=1000")[2]["data"]["changes"]
                seqs = [c["seq"] for c in changes]
                assert seqs == list(range(1, len(seqs) + 1))
                etags = {c.get("etag") for c in changes}
                assert {notesvc.make_etag(c.encode()) for c in acked[1:]} <= etags
                status, _, _ = again.request("PUT", url, {"content": "after the crash"})
                assert status == 200
            leftovers = [p for p in root.rglob("*") if p.name.startswith(".tmp-")]
            assert leftovers == []

    def test_a_waiting_feed_gets_the_next_change_at_once(self, tmp_path):
        with running(tmp_path, "--auth-mode", "none", env={"SERVICE_RESCAN_SECONDS": "1"}) as s:
            status, _, d, took = long_poll(s, 0, 1)
            assert (status, d, took >= 0.9) == (
                200,
                {"changes": [], "last": 0, "more": False},
                True,
            )
            got = []
            t = threading.Thread(target=lambda: got.append(long_poll(s, 0, 20)))
            t.start()
            wait_for(lambda: feed_waiting(s) == 1)
            sent = time.monotonic()
            s.request("POST", f"{API}/notes", {"path": "notes/n.md", "content": "hello"})
            t.join(25)
            status, _, d, _ = got[0]
            assert status == 200
            assert [(c["seq"], c["kind"], c["path"]) for c in d["changes"]] == [
                (1, "created", "notes/n.md")
            ]
            assert time.monotonic() - sent < 2
            # another program's edit reaches a waiting feed through the rescan
            t = threading.Thread(target=lambda: got.append(long_poll(s, 1, 20)))
            t.start()
            wait_for(lambda: feed_waiting(s) == 1)
            (tmp_path / "notes" / "n.md").write_text("edited elsewhere")
            t.join(25)
            change = got[1][2]["changes"][0]
            assert (change["kind"], change["path"]) == ("updated", "notes/n.md")
            assert change["etag"] == notesvc.make_etag(b"edited elsewhere")
            versions = s.request("GET", note_url("notes/n.md") + "/versions")[2]["data"]
            assert [v["reason"] for v in versions["versions"]] == ["external"]

    def test_over_the_waiter_cap_the_answer_is_at_once_and_others_still_answer(self, tmp_path):
        with running(tmp_path, "--auth-mode", "none", env={"SERVICE_THREADS": "4"}) as s:
            info = s.request("GET", f"{API}/system/config")[2]["data"]["sync"]
            assert info["maxWaiters"] == 2  # half of 4 threads
            held = []
            threads = [
                threading.Thread(target=lambda: held.append(long_poll(s, 0, 20))) for _ in range(2)
            ]
            for t in threads:
                t.start()
            wait_for(lambda: feed_waiting(s) == 2)
            status, headers, d, took = long_poll(s, 0, 20)
            assert status == 200
            assert took < 1
            assert d == {"changes": [], "last": 0, "more": False, "retryAfter": 1}
            assert headers["Retry-After"] == "1"
            for _ in range(5):  # the cap keeps threads for everything else
                started = time.monotonic()
                assert s.request("GET", f"{API}/notes")[0] == 200
                assert time.monotonic() - started < 1
            s.request("POST", f"{API}/notes", {"path": "notes/x.md", "content": "x"})
            for t in threads:
                t.join(25)
            assert [len(h[2]["changes"]) for h in held] == [1, 1]
            assert max(h[3] for h in held) < 15
            assert feed_waiting(s) == 0

    def test_twenty_followers_see_every_change_once_and_in_order(self, tmp_path):
        with running(tmp_path, "--auth-mode", "none", env={"SERVICE_THREADS": "8"}) as s:
            writes, followers = 30, 20
            done, errors = threading.Event(), []
            seen = [[] for _ in range(followers)]
            retried = [0] * followers

            def follow(k: int) -> None:
                since, deadline = 0, time.monotonic() + 90
                try:
                    while time.monotonic() < deadline:
                        status, headers, body = s.request(
                            "GET", f"{API}/changes?since={since}&wait=5&limit=7"
                        )
                        assert status == 200, body
                        d = body["data"]
                        if "retryAfter" in d:  # over the cap: retry as told
                            assert headers["Retry-After"] == str(d["retryAfter"])
                            retried[k] += 1
                            time.sleep(d["retryAfter"])
                            continue
                        seen[k].extend(d["changes"])
                        since = d["last"]
                        if done.is_set() and not d["more"] and since >= final[0]:
                            return
                    errors.append(f"follower {k} timed out at {since}")
                except Exception as e:
                    errors.append(f"follower {k}: {e!r}")

            def write(w: int) -> None:
                for i in range(writes):
                    path = f"notes/w{w}/n{i % 5}.md"
                    if i < 5:
                        s.request("POST", f"{API}/notes", {"path": path, "content": f"{w}/{i}"})
                    else:
                        s.request("PUT", note_url(path), {"content": f"{w}/{i}"})

            final = [10**9]
            readers = [threading.Thread(target=follow, args=(k,)) for k in range(followers)]
            writers = [threading.Thread(target=write, args=(w,)) for w in range(3)]
            for t in readers + writers:
                t.start()
            for t in writers:
                t.join(60)
            everything = s.request("GET", f"{API}/changes?limit=1000")[2]["data"]
            final[0] = everything["last"]
            done.set()
            for t in readers:
                t.join(100)
            assert errors == []
            assert final[0] == 3 * writes
            for k in range(followers):
                assert seen[k] == everything["changes"], f"follower {k}"
            assert sum(retried) > 0  # 20 followers, 4 may wait at once

    def test_the_feed_passes_through_the_relay(self, tmp_path):
        relay = Server(tmp_path / "relay", "relay")
        server = Server(tmp_path / "srv", env={"SERVICE_RELAY_URL": relay.url})
        try:
            wait_for(lambda: relay_servers(relay) == 1)
            setup = server.request("GET", f"{API}/system/setup")[2]["data"]
            key = {"X-Service-Key": setup["apiKey"]}
            prefix = f"/r/{setup['serverId']}"

            def relayed(since: int, wait: float) -> tuple:
                started = time.monotonic()
                status, hdrs, body = relay.request(
                    "GET", f"{prefix}{API}/changes?since={since}&wait={wait}", headers=key
                )
                return status, hdrs, body["data"], time.monotonic() - started

            got = []
            waiters = [
                threading.Thread(target=lambda: got.append(relayed(0, 15))) for _ in range(2)
            ]
            for t in waiters:
                t.start()
            wait_for(lambda: feed_waiting(server, headers=key) == 2)
            status, headers, d, took = relayed(0, 15)  # relayed waits: half the relay's workers
            assert (status, d["retryAfter"], headers["Retry-After"]) == (200, 1, "1")
            assert took < 3
            status, _, body = relay.request("GET", f"{prefix}{API}/notes", headers=key)
            assert status == 200  # still answered through the relay
            sent = time.monotonic()
            server.request(
                "POST", f"{API}/notes", {"path": "notes/r.md", "content": "via relay"}, key
            )
            for t in waiters:
                t.join(20)
            assert time.monotonic() - sent < 5
            assert [g[0] for g in got] == [200, 200]
            for g in got:
                assert [(c["kind"], c["path"]) for c in g[2]["changes"]] == [
                    ("created", "notes/r.md")
                ]
            status, _, body = relay.request("GET", f"{prefix}{API}/changes?since=5", headers=key)
            assert status == 410
            assert body["error"]["resetRequired"] is True
        finally:
            server.stop()
            relay.stop()

    def test_waiting_feeds_do_not_hold_up_a_stopping_server(self, tmp_path):
        server = Server(tmp_path, "--auth-mode", "none")
        try:

            def poll() -> None:
                with contextlib.suppress(OSError, http.client.HTTPException):
                    long_poll(server, 0, 25)  # cut off, or answered: either way at once

            t = threading.Thread(target=poll)
            t.start()
            wait_for(lambda: feed_waiting(server) == 1)
            started = time.monotonic()
            server.proc.terminate()
            assert server.proc.wait(10) == 0
            assert time.monotonic() - started < 3  # waitress waits 5 s for busy threads
            t.join(30)
            assert not t.is_alive()
        finally:
            server.stop()

    def test_a_full_disk_during_a_history_write_is_507_and_changes_nothing(self, tmp_path):
        if os.geteuid() != 0 or not shutil.which("mount"):
            pytest.skip("mounting a small tmpfs needs root")
        disk = tmp_path / "disk"
        disk.mkdir()
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(disk)],
            capture_output=True,
            timeout=10,
        )
        if mounted.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode()[:200]}")
        try:
            with running(disk, "--auth-mode", "none") as server:
                big = "x" * 60000
                url = note_url("notes/big.md")
                assert (
                    server.request(
                        "POST", f"{API}/notes", {"path": "notes/big.md", "content": big}
                    )[0]
                    == 201
                )
                assert server.request("PUT", url, {"content": big + "!"})[0] == 200
                vid = server.request("GET", url + "/versions")[2]["data"]["versions"][0]["id"]
                wait_for((disk / ".notesvc" / "index").is_dir)  # the index is open
                before = server.request("GET", f"{API}/changes")[2]["data"]["last"]
                filler = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
                try:
                    with contextlib.suppress(OSError):
                        while True:
                            os.write(filler, b"\0" * 4096)
                finally:
                    os.close(filler)
                attempts = [
                    ("PATCH", url + "/move", {"path": "notes/moved.md"}),  # copies the content
                    ("DELETE", url, None),
                    ("PUT", url, {"content": big + "?"}),
                    ("POST", f"{url}/versions/{vid}/restore", None),
                ]
                for method, target, body in attempts:
                    status, _, answer = server.request(method, target, body)
                    assert status == 507, (method, answer)
                    assert answer["error"]["code"] == "INSUFFICIENT_STORAGE"
                assert (disk / "notes" / "big.md").read_text() == big + "!"
                assert not (disk / "notes" / "moved.md").exists()
                listing = server.request("GET", url + "/versions")[2]["data"]
                assert [v["id"] for v in listing["versions"]] == [vid]
                assert server.request("GET", f"{API}/trash")[2]["data"]["items"] == []
                assert server.request("GET", f"{API}/changes")[2]["data"]["last"] == before
                assert [p for p in disk.rglob("*") if p.name.startswith(".tmp-")] == []
                os.unlink(disk / "filler")
                assert server.request("PUT", url, {"content": "small"})[0] == 200
                changes = server.request("GET", f"{API}/changes?since={before}")[2]["data"]
                assert [c["seq"] for c in changes["changes"]] == [before + 1]
            assert "Traceback" not in "".join(server.lines)
        finally:
            subprocess.run(["umount", str(disk)], capture_output=True, timeout=10)


class TestTokenizer:
    def test_doctests(self):
        import doctest

        result = doctest.testmod(notesvc)
        assert result.attempted >= 4
        assert result.failed == 0

    @pytest.mark.parametrize(
        ("a", "b"),
        [
            ("run", "running"),
            ("runs", "run"),
            ("keys", "key"),
            ("cities", "city"),
            ("boxes", "box"),
            ("notes", "note"),
            ("making", "make"),
            ("stopped", "stop"),
            ("Café", "cafe"),
            ("ÉCOLE", "ecole"),
            ("Straße", "strasse"),
        ],
    )
    def test_forms_that_fold_together(self, a, b):
        assert notesvc.tokenize(a) == notesvc.tokenize(b)

    @pytest.mark.parametrize(
        ("a", "b"), [("pies", "pi"), ("news", "new"), ("need", "ne"), ("this", "thi")]
    )
    def test_unrelated_words_stay_apart(self, a, b):
        assert notesvc.tokenize(a) != notesvc.tokenize(b)

    @pytest.mark.parametrize(
        ("word", "expected"),
        [
            ("informing", "inform"),
            ("informed", "inform"),
            ("information", "inform"),
            ("running", "run"),
            ("hopping", "hop"),
            ("hoped", "hope"),
            ("cities", "citi"),
            ("ties", "tie"),
            ("generously", "generous"),
            ("general", "general"),
            ("communism", "communism"),
            ("connections", "connect"),
            ("relational", "relat"),
            ("happiness", "happi"),
            ("dying", "die"),
            ("skies", "sky"),
            ("early", "earli"),
            ("inning", "inning"),
            ("proceeding", "proceed"),
            ("succeeded", "succeed"),
            ("agreed", "agre"),
            ("saying", "say"),
            ("news", "news"),
            ("gas", "gas"),
            ("by", "by"),
            ("x86", "x86"),  # digits and mixed tokens stay as they are
            ("2024", "2024"),
            ("naïve", "naïve"),  # only ASCII words are stemmed (fold() strips accents first)
        ],
    )
    def test_porter2_stems(self, word, expected):
        assert notesvc.stem(word) == expected

    def test_porter2_matches_the_snowball_word_list(self):
        """Every 15th pair of Snowball's English word list (docs/porter2-sample.txt)."""
        lines = (HERE / "docs" / "porter2-sample.txt").read_text().splitlines()
        pairs = [line.split() for line in lines if line and not line.startswith("#")]
        assert len(pairs) > 2500
        wrong = [(w, s, notesvc.stem(w)) for w, s in pairs if notesvc.stem(w) != s]
        assert wrong == []

    def test_bm25_idf_is_positive_and_falls_with_df(self):
        assert notesvc.bm25_idf(10, 10) > 0
        assert notesvc.bm25_idf(10, 1) > notesvc.bm25_idf(10, 5)


def hits(client, q: str, **params) -> list:
    return [r["path"] for r in search(client, q, **params)["results"]]


class TestSearch:
    @pytest.fixture
    def corpus(self, client):
        notes = {
            "notes/keys.md": "# Household\n\nSpare keys are under the blue flowerpot. "
            "The car key is in the kitchen drawer.",
            "notes/run.md": "# Running log\n\nI went running today. Runs are fun.",
            "notes/pie.md": "# Recipes\n\nApple pies need cinnamon. Crème brûlée too.",
            "notes/pi.md": "# Math\n\nThe number pi is about 3.14159.",
            "notes/work/meeting.md": "# Meeting notes\n\nThe quick brown fox and the e-mail "
            "migration.",
            "notes/work/todo.md": "# Todo\n\nBuy a blue flowerpot. Call the plumber.",
        }
        for path, text in notes.items():
            put_note(client, path, text)
        return client

    def test_response_shape(self, corpus):
        d = search(corpus, "flowerpot", limit=5)
        assert set(d) == {"query", "total", "limit", "offset", "results", "tookMs"}
        assert (d["query"], d["total"], d["limit"], d["offset"]) == ("flowerpot", 2, 5, 0)
        assert set(d["results"][0]) == {"path", "title", "score", "snippet"}
        assert d["results"][0]["score"] >= d["results"][1]["score"] > 0
        assert d["tookMs"] >= 0

    def test_words_must_all_match(self, corpus):
        assert hits(corpus, "blue flowerpot spare") == ["notes/keys.md"]
        assert sorted(hits(corpus, "blue flowerpot")) == ["notes/keys.md", "notes/work/todo.md"]
        assert hits(corpus, "blue unicorn") == []

    def test_phrase(self, corpus):
        assert hits(corpus, '"quick brown"') == ["notes/work/meeting.md"]
        assert hits(corpus, '"brown quick"') == []
        assert hits(corpus, '"blue flowerpot" spare') == ["notes/keys.md"]

    def test_prefix(self, corpus):
        assert hits(corpus, "flowerp*") != []
        assert hits(corpus, "meet*") == ["notes/work/meeting.md"]
        assert hits(corpus, "zzq*") == []

    def test_exclude(self, corpus):
        assert hits(corpus, "flowerpot -spare") == ["notes/work/todo.md"]
        assert hits(corpus, 'flowerpot -"car key"') == ["notes/work/todo.md"]

    def test_or(self, corpus):
        assert sorted(hits(corpus, "pi OR cinnamon")) == ["notes/pi.md", "notes/pie.md"]
        assert hits(corpus, "blue plumber OR spare") != []
        assert sorted(hits(corpus, "flowerpot plumber OR keys")) == [
            "notes/keys.md",
            "notes/work/todo.md",
        ]

    def test_folder_filter(self, corpus):
        assert hits(corpus, "flowerpot", folder="notes/work") == ["notes/work/todo.md"]
        assert sorted(hits(corpus, "the", folder="notes/work")) == [
            "notes/work/meeting.md",
            "notes/work/todo.md",
        ]
        assert_error(search(corpus, "x", 400, folder="../etc"), 400, "VALIDATION_ERROR")

    def test_case_accents_and_plurals_fold(self, corpus):
        assert hits(corpus, "CREME BRULEE") == ["notes/pie.md"]
        assert hits(corpus, "crème") == ["notes/pie.md"]
        assert hits(corpus, "key") == ["notes/keys.md"]
        assert hits(corpus, "run") == ["notes/run.md"]
        assert hits(corpus, "pies") == ["notes/pie.md"]
        assert hits(corpus, "pi") == ["notes/pi.md"]

    def test_words_with_punctuation_are_phrases(self, corpus):
        assert hits(corpus, "e-mail") == ["notes/work/meeting.md"]

    def test_limit_and_offset(self, corpus):
        everything = hits(corpus, "the", limit=100)
        assert len(everything) == 4
        assert hits(corpus, "the", limit=2) == everything[:2]
        assert hits(corpus, "the", limit=2, offset=2) == everything[2:]
        assert search(corpus, "the", limit=1)["total"] == 4

    def test_snippet_is_short_and_around_the_match(self, client):
        words = " ".join(f"filler{i}" for i in range(300))
        put_note(client, "notes/long.md", f"# Long\n\n{words} the needle is here {words}")
        result = search(client, "needle")["results"][0]
        assert "needle" in result["snippet"]
        assert len(result["snippet"]) <= 240
        assert result["snippet"].startswith("…")

    def test_a_snippet_shows_the_word_as_typed_else_its_first_form(self, client):
        """A word's snippet is around where it stands as typed (case aside, whole, `_`
        separating), else around the first word of the same stem; a text whose lowercase
        is longer than itself (İ) is counted token by token."""
        far = " ".join(f"filler{i}" for i in range(60))
        text = f"# Legs\n\n{far} they RUN here {far} overrunning my_running {far} end"
        put_note(client, "notes/run.md", text)
        put_note(client, "notes/istanbul.md", f"# İstanbul\n\n{text}")

        def snippet(q: str, path: str = "notes/run.md") -> str:
            found = {r["path"]: r["snippet"] for r in search(client, q)["results"]}
            return found[path]

        assert "my_running" in snippet("running")  # not inside "overrunning"
        assert "my_running" in snippet("RUNNING")
        assert "they RUN here" in snippet("runs")  # not typed anywhere: its first form
        assert "they RUN here" in snippet("run")
        assert "they RUN here" in snippet("running", "notes/istanbul.md")
        assert "my_running" in snippet('"my running"')  # a phrase: its tokens counted

    @pytest.mark.parametrize("size", [0, 5, 16, 511, 512, 513, 2000])
    def test_the_largest_are_heapq_s_whether_sorted_or_heaped(self, size):
        """_largest sorts up to SORT_UP_TO items and uses heapq beyond: the same list either
        way, equal scores (many here) in their original order."""
        rnd = random.Random(size)
        scores = {d: float(rnd.randint(0, 9)) for d in range(size)}
        for n in (1, 15, size + 1):
            want = heapq.nlargest(n, scores.items(), key=operator.itemgetter(1))
            assert notesvc._largest(n, scores.items(), operator.itemgetter(1)) == want
            ids = range(size)
            want = heapq.nlargest(n, ids, key=scores.__getitem__)
            assert notesvc._largest(n, ids, scores.__getitem__) == want

    def test_a_snippet_starts_after_a_space_before_its_match(self):
        """The snippet's start: 60 characters before the match, moved back to just after
        a space, 90 characters before it at most (the start of the note when nearer)."""

        def expected(text: str, at: int) -> int:
            start = max(0, at - 60)
            while start > 0 and not text[start - 1].isspace() and at - start < 90:
                start -= 1
            return start

        rnd = random.Random(5)
        words = ["a", "word", "x" * 40, "y" * 70, "\u00a0", "\u3000", "\n", "—", "é"]
        for _ in range(400):
            text = "".join(rnd.choice(words) + rnd.choice(["", " "]) for _ in range(60))
            text += " needle and the rest"
            at = text.index("needle")
            toks = "".join(chr(0x100 + (w == "needle")) for w in notesvc._WORD_RE.findall(text))
            snippet = notesvc._snippet(text, toks, {chr(0x101): ""})  # the tokens counted
            assert notesvc._snippet(text, toks, {chr(0x101): "needle"}) == snippet  # as typed
            start, body = expected(text, at), snippet.removeprefix("…").removesuffix("…")
            assert snippet.startswith("…") == (start > 0)
            assert len(body) > 20
            assert " ".join(text[start:].split()).startswith(body), snippet

    def test_a_table_of_symbols_gets_its_snippet_at_once(self):
        """A note of thousands of kinds of separators (a table of symbols) would cost the
        split one pass over the note for each: the regex takes it instead."""
        chars = [chr(c) for c in range(0x2000, 0x2C00) if not chr(c).isalnum()]
        text = "# Symbols\n" + "\n".join(f"U+{ord(c):04X} {c} dagger déjà" for c in chars)
        started = time.thread_time()
        at = notesvc._token_offset(text, 1500)
        took = time.thread_time() - started
        assert at == [m.start() for m in notesvc._WORD_RE.finditer(text)][1500]
        assert took < 0.05, f"{took:.3f} s"  # 0.9 s with one pass per separator

    @pytest.mark.parametrize("small", [False, True])  # the split looks 200 characters in
    @pytest.mark.parametrize("split_up_to", [2000, 50])  # 50: both ways in one text
    @pytest.mark.parametrize("ascii_only", [False, True])
    def test_a_snippet_finds_the_token_where_a_tokenizer_would(
        self, monkeypatch, ascii_only, split_up_to, small
    ):
        """_token_offset skips tokens by splitting the text's bytes, or deeper in with one
        regular expression (possessive on 3.11): it must land where the k-th word starts,
        never inside a word split in two, whatever characters separate the words, and
        wherever the split gives up (SPLIT_CHARS, SPLIT_WORK)."""
        monkeypatch.setattr(notesvc, "SPLIT_TOKENS_UP_TO", split_up_to)
        if small:
            monkeypatch.setattr(notesvc, "SPLIT_CHARS", 200)
            monkeypatch.setattr(notesvc, "SPLIT_WORK", 1500)
        rnd = random.Random(3)
        words = ["alpha", "beta_x", "x", "a1", "...", "C++", "foo-bar", "\n", "\x1f", "\t~"]
        if not ascii_only:  # letters and digits of other scripts; separators of 2-4 bytes
            words += ["Ünïcode", "—", "l’été", "straße", "漢字", "٣٤", "Ⅻ", "a\u0301b", "😀x"]
            words += ["\u00a0", "\u2028", "«»", "x\ud800y", "\x85", "café…"]
        for _ in range(300):
            text = " ".join(rnd.choice(words) for _ in range(rnd.randint(0, 260)))
            starts = [m.start() for m in notesvc._WORD_RE.finditer(text)]
            for k in {0, 1, 5, 99, 100, 101, 250, len(starts) - 1, len(starts), len(starts) + 3}:
                if k >= 0:
                    want = starts[k] if k < len(starts) else None
                    assert notesvc._token_offset(text, k) == want, (k, text[:60])
        assert notesvc._token_offset("abc", 1) is None  # one word is not two

    @pytest.mark.parametrize(
        ("q", "says"),
        [
            ('"unbalanced', "quote"),
            ("-only -exclusions", "only excludes"),
            ("x" * 513, "longer than 512"),
            ("", "required"),
            ("a*", "prefix"),
            ("OR cats", "OR"),
            ("cats OR", "OR"),
            ("!!! ???", "no searchable words"),
        ],
    )
    def test_malformed_query_is_400_saying_what_to_fix(self, client, q, says):
        err = assert_error(search(client, q, 400), 400, "VALIDATION_ERROR")
        assert says in err["message"]

    def test_missing_q_and_bad_paging_are_400(self, client):
        assert_error(client.get(f"{API}/search", status=400), 400, "VALIDATION_ERROR")
        for params in ({"limit": 0}, {"limit": 101}, {"offset": -1}, {"limit": "x"}):
            resp = client.get(f"{API}/search", {"q": "a", **params}, status=400)
            assert_error(resp, 400, "VALIDATION_ERROR")

    def test_unicode_query(self, corpus):
        put_note(corpus, "notes/ru.md", "# Заметка\n\nКлючи под горшком.")
        assert hits(corpus, "ключи") == ["notes/ru.md"]
        assert hits(corpus, "Заметка") == ["notes/ru.md"]


class TestRanking:
    def test_title_beats_body(self, client):
        put_note(client, "notes/a.md", "# Lighthouse\n\nsome other words here")
        put_note(client, "notes/b.md", "# Other\n\nsome lighthouse words here")
        assert hits(client, "lighthouse") == ["notes/a.md", "notes/b.md"]

    def test_rarer_term_beats_common(self, client):
        put_note(client, "notes/a.md", "alpha zebra")
        put_note(client, "notes/b.md", "alpha common")
        put_note(client, "notes/c.md", "common words")
        put_note(client, "notes/d.md", "common things")
        assert hits(client, "zebra OR common")[0] == "notes/a.md"

    def test_shorter_doc_beats_longer_at_equal_tf(self, client):
        put_note(client, "notes/short.md", "pelican and two words")
        put_note(client, "notes/long.md", "pelican " + "filler " * 60)
        assert hits(client, "pelican") == ["notes/short.md", "notes/long.md"]

    def test_more_occurrences_rank_higher(self, client):
        put_note(client, "notes/one.md", "otter a b c d e f")
        put_note(client, "notes/three.md", "otter otter otter d e f g")
        assert hits(client, "otter")[0] == "notes/three.md"


class TestSearchIndexLive:
    def test_index_follows_create_update_move_delete(self, client):
        put_note(client, "notes/a.md", "walrus")
        assert hits(client, "walrus") == ["notes/a.md"]
        client.put_json(note_url("notes/a.md"), {"content": "narwhal"})
        assert hits(client, "walrus") == []
        assert hits(client, "narwhal") == ["notes/a.md"]
        client.patch_json(note_url("notes/a.md") + "/move", {"path": "notes/b/c.md"})
        assert hits(client, "narwhal") == ["notes/b/c.md"]
        client.delete(note_url("notes/b/c.md"))
        assert hits(client, "narwhal") == []
        assert search(client, "narwhal")["total"] == 0

    def test_external_edit_found_after_rescan(self, client, root):
        put_note(client, "notes/a.md", "before")
        (root / "notes" / "a.md").write_text("after the edit")
        (root / "notes" / "new.md").write_text("brand new capybara")
        (root / "notes" / "sub").mkdir()
        (root / "notes" / "sub" / "x.md").write_text("capybara too")
        svc = client.app.service
        stats = svc.sync_index()
        assert stats["read"] == 3
        assert hits(client, "before") == []
        assert hits(client, "edit") == ["notes/a.md"]
        assert sorted(hits(client, "capybara")) == ["notes/new.md", "notes/sub/x.md"]
        (root / "notes" / "new.md").unlink()
        assert svc.sync_index()["removed"] == 1
        assert hits(client, "capybara") == ["notes/sub/x.md"]
        for _ in range(2):  # nothing changed: nothing read (its "seconds" vary by run)
            assert {k: svc.sync_index()[k] for k in ("read", "removed")} == {
                "read": 0,
                "removed": 0,
            }

    def test_restart_reads_only_what_changed(self, make_app, root):
        app = with_key(make_app())
        for i in range(30):
            put_note(app, f"notes/n{i}.md", f"note number {i} mongoose")
        app.app.service.close()  # saves the cache
        (root / "notes" / "n3.md").write_text("changed while stopped: wombat")
        (root / "notes" / "n4.md").unlink()
        again = with_key(make_app())
        assert again.app.service.last_sync["read"] == 1
        assert again.app.service.last_sync["removed"] == 1
        assert hits(again, "wombat") == ["notes/n3.md"]
        assert search(again, "mongoose")["total"] == 28

    @pytest.mark.parametrize(
        "damage",
        [b"garbage", b"", "truncate", "foreign-pickle"],
    )
    def test_corrupt_cache_is_rebuilt(self, make_app, root, damage, caplog):
        app = with_key(make_app())
        put_note(app, "notes/a.md", "ocelot")
        app.app.service.close()
        cache = root / ".notesvc" / "index.cache"
        if damage == "truncate":
            cache.write_bytes(cache.read_bytes()[:-10])
        elif damage == "foreign-pickle":
            import pickle

            class Evil:
                def __reduce__(self):
                    return (os.system, ("touch " + str(root / "pwned"),))

            cache.write_bytes(pickle.dumps(Evil()))
        else:
            cache.write_bytes(damage)
        again = with_key(make_app())
        assert hits(again, "ocelot") == ["notes/a.md"]
        assert again.app.service.last_sync["read"] == 1
        assert not (root / "pwned").exists()

    def test_system_info_reports_the_index(self, client):
        put_note(client, "notes/a.md", "hello world")
        info = data(client.get(f"{API}/system/info"))
        assert info["index"]["documents"] == 1
        assert info["index"]["terms"] >= 2


REF_WORDS = (
    "apple apples banana bananas cherry garden gardens gardening kitchen keys key spare blue "
    "flowerpot drawer window windows running runs run walked walking walk river mountain coffee "
    "recipe recipes the a of and to in note notes meeting meetings plan plans zebra yak "
    "xylophone quokka narwhal pelican otter heron café crème brûlée"
).split()


def make_ref_notes(rnd: random.Random, n: int, start: int = 0) -> dict:
    """Return {path: text} of n generated notes over REF_WORDS (some without a heading)."""
    notes = {}
    for i in range(start, start + n):
        folder = rnd.choice(["notes", "notes/work", "notes/home", "notes/work/deep"])
        vocab = REF_WORDS[: rnd.choice((20, 40, len(REF_WORDS)))]
        body = " ".join(rnd.choice(vocab) for _ in range(rnd.randint(3, 80)))
        if rnd.random() < 0.8:
            title = " ".join(rnd.choice(REF_WORDS) for _ in range(rnd.randint(1, 3)))
            body = f"# {title}\n\n{body}\n"
        notes[f"{folder}/n{i:05d}.md"] = body
    return notes


def write_notes(root: Path, notes: dict) -> None:
    for path, text in notes.items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")


class ReferenceBM25:
    """A brute-force BM25 over notesvc's tokens: every fast path must give its answers.

    Score: for each clause, alternative and term (a phrase's terms one by one, a prefix's
    expansions), in body (weight 1) and title (weight 2): idf * tf (k1 + 1) / (tf + k1 (1 - b
    + b dl / avgdl)), with Lucene's idf, k1 1.2, b 0.75; ties ordered by path.
    """

    def __init__(self, notes: dict):
        self.docs = {}
        words: set = set()
        for path, text in notes.items():
            text = unicodedata.normalize("NFC", text)
            title = notesvc.note_title(text, path)
            self.docs[path] = (notesvc.tokenize(text), notesvc.tokenize(title))
            for part in (text, title):
                words.update(re.findall(r"\w+", notesvc.fold(part)))
        self.words = sorted(words)
        self.n = len(self.docs)
        self.df: list = [{}, {}]
        for toks in self.docs.values():
            for f in (0, 1):
                for t in set(toks[f]):
                    self.df[f][t] = self.df[f].get(t, 0) + 1
        self.avg = [max(sum(len(t[f]) for t in self.docs.values()) / self.n, 1.0) for f in (0, 1)]

    def _resolve(self, alt: tuple) -> tuple:
        kind, arg = alt
        if kind == "prefix":  # the first 1024 words, their stems, commonest 64 in bodies
            first = [w for w in self.words if w.startswith(arg)][:1024]
            stems = sorted({notesvc.stem(w) for w in first})
            return kind, sorted(stems, key=lambda s: (-self.df[0].get(s, 0), s))[:64]
        return kind, [arg] if kind == "word" else list(arg)

    @staticmethod
    def _matches(toks: tuple, alt: tuple) -> bool:
        kind, stems = alt
        if kind != "phrase":
            return any(s in toks[0] or s in toks[1] for s in stems)
        k = len(stems)
        return any(field[i : i + k] == stems for field in toks for i in range(len(field) - k + 1))

    def _score(self, toks: tuple, clauses: list) -> float:
        score = 0.0
        for clause in clauses:
            for _, stems in clause:
                for s in stems:
                    for f, weight in ((0, 1.0), (1, 2.0)):
                        tf = toks[f].count(s)
                        if tf:
                            df = self.df[f][s]
                            idf = math.log(1 + (self.n - df + 0.5) / (df + 0.5))
                            norm = 1.2 * (1 - 0.75 + 0.75 * len(toks[f]) / self.avg[f])
                            score += weight * idf * tf * 2.2 / (tf + norm)
        return score

    def search(self, q: str, folder: str = "") -> tuple:
        query = notesvc.Query(q)
        clauses = [[self._resolve(a) for a in clause] for clause in query.clauses]
        excludes = [self._resolve(a) for a in query.excludes]
        prefix = folder.rstrip("/") + "/" if folder else ""
        found = []
        for path, toks in self.docs.items():
            if not path.startswith(prefix):
                continue
            wanted = all(any(self._matches(toks, a) for a in c) for c in clauses)
            if wanted and not any(self._matches(toks, a) for a in excludes):
                found.append((self._score(toks, clauses), path))
        found.sort(key=lambda h: (-h[0], h[1]))
        return len(found), found


def assert_answers_like(index: notesvc.SearchIndex, ref: ReferenceBM25, q: str, folder=""):
    total, results = index.search(notesvc.Query(q), folder, 10, 0)
    want_total, want = ref.search(q, folder)
    assert total == want_total, q
    assert len(results) == min(10, want_total), q
    for i, (path, _, score, _) in enumerate(results):
        best = want[i][0]
        assert abs(score - best) <= max(1e-4 * best, 6e-5), (q, i, path, score, want[i])
        if path != want[i][1]:  # only equal scores may come in another order
            tied = {p for s, p in want if abs(s - best) <= 1e-9 * max(best, 1.0)}
            assert path in tied, (q, i, path, want[:10])


def ref_queries(rnd: random.Random, notes: dict) -> list:
    """Single words (common, rare, folded forms), AND, OR, exclusions, prefixes, phrases."""
    qs = ["apple", "keys", "key", "garden", "the", "zebra", "café", "CREME", "runs", "walking"]
    qs += ["ap*", "gard*", "ke*", "wa*", "run*", "me*", "cr*", "zz*"]
    for _ in range(12):
        qs.append(" ".join(rnd.sample(REF_WORDS[:30], rnd.choice((2, 3)))))
        qs.append(f"{rnd.choice(REF_WORDS)} OR {rnd.choice(REF_WORDS)}")
        qs.append(f"{rnd.choice(REF_WORDS[:20])} -{rnd.choice(REF_WORDS[:20])}")
        prefix = rnd.choice([w for w in REF_WORDS[10:40] if len(w) > 3])[:3]
        qs.append(f"{rnd.choice(REF_WORDS[:10])} {prefix}*")
    bodies = sorted(notes.values())
    for _ in range(12):
        words = re.findall(r"\w+", rnd.choice(bodies))
        if len(words) > 3:
            j = rnd.randrange(len(words) - 2)
            qs.append(f'"{words[j]} {words[j + 1]}"')
            qs.append(f'{words[j]} -"{words[j + 1]} {words[j + 2]}"')
    return qs


@pytest.fixture
def disk_index(tmp_path):
    """A SearchIndex kept under tmp_path/.notesvc, reading notes from tmp_path/notes."""
    state = tmp_path / ".notesvc"
    state.mkdir()
    (tmp_path / "notes").mkdir()
    index = notesvc.SearchIndex.open(state, notesvc.NoteStore(tmp_path / "notes", state / "trash"))
    yield index
    index.close()


def change_notes(rnd: random.Random, index, notes: dict, root: Path, count: int) -> None:
    """Rewrite count notes on disk and in the index, the way the API's listener does."""
    for path in rnd.sample(sorted(notes), count):
        text = " ".join(rnd.choice(REF_WORDS) for _ in range(rnd.randint(1, 60)))
        if rnd.random() < 0.5:
            text = f"# {rnd.choice(REF_WORDS)} title\n{text}"
        notes[path] = text
        (root / path).write_text(text, encoding="utf-8")
        st = (root / path).stat()
        index.add(path, text, st.st_size, st.st_mtime_ns)


def remove_notes(rnd: random.Random, index, notes: dict, root: Path, count: int) -> None:
    for path in rnd.sample(sorted(notes), count):
        del notes[path]
        (root / path).unlink()
        index.remove(path)


class TestSearchReference:
    """The index's top-10 (paths, order, scores) equals a brute-force BM25's, whatever its
    segments look like: one bulk segment, changes in memory, flushed files with deletions,
    a merge, a reopened index."""

    @pytest.mark.slow
    @pytest.mark.parametrize("seed", [1, 2])
    def test_every_stage_answers_like_brute_force_bm25(self, disk_index, tmp_path, seed):
        rnd = random.Random(seed)
        notes = make_ref_notes(rnd, 300)
        write_notes(tmp_path, notes)
        index = disk_index

        def check(stage: str):
            ref = ReferenceBM25(notes)
            for q in ref_queries(random.Random(seed), notes):
                assert_answers_like(index, ref, q)
            for folder in ("notes/work", "notes/home/"):
                for q in ("the", "apple OR zebra", "gard*", "the -apple"):
                    assert_answers_like(index, ref, q, folder)
            assert index.stats()["documents"] == len(notes), stage

        assert index.sync()["read"] == 300  # the bulk path: one segment file
        check("bulk")
        change_notes(rnd, index, notes, tmp_path, 40)  # replaced in memory, old ones deleted
        remove_notes(rnd, index, notes, tmp_path, 25)
        check("live")
        assert index.flush()
        check("flushed")
        change_notes(rnd, index, notes, tmp_path, 30)
        assert index.flush()
        remove_notes(rnd, index, notes, tmp_path, 10)
        check("files with deletions")
        files = [s for s in index._segs if isinstance(s, notesvc.DiskSegment)]
        assert len(files) >= 3
        assert index.merge(files)
        assert len(index._segs) == 1
        check("merged")
        index.close()
        reopened = notesvc.SearchIndex.open(tmp_path / ".notesvc", index.notes)
        index = reopened
        check("reopened")
        synced = reopened.sync()
        assert (synced["read"], synced["removed"]) == (0, 0)
        reopened.close()

    @pytest.mark.slow
    def test_scores_stay_exact_when_the_average_length_drifts(self, disk_index, tmp_path):
        rnd = random.Random(5)
        notes = make_ref_notes(rnd, 200)
        write_notes(tmp_path, notes)
        disk_index.sync()
        for i in range(80):  # much longer notes: the averages move far from the stored ones
            text = " ".join(rnd.choice(REF_WORDS) for _ in range(400))
            notes[f"notes/long{i}.md"] = text
            (tmp_path / f"notes/long{i}.md").write_text(text)
            disk_index.add(f"notes/long{i}.md", text, len(text), 1)
        ref = ReferenceBM25(notes)
        for q in ref_queries(random.Random(5), notes):
            assert_answers_like(disk_index, ref, q)


def index_files(root: Path) -> list:
    return sorted(p.name for p in (root / ".notesvc" / "index").iterdir())


def damage_index(root: Path, damage: str) -> None:
    state = root / ".notesvc"
    segment = next(p for p in sorted((state / "index").iterdir()) if p.suffix == ".seg")
    raw = segment.read_bytes()
    commit = state / "index.cache"
    if damage == "commit truncated":
        commit.write_bytes(commit.read_bytes()[:-7])
    elif damage == "commit random bytes":
        commit.write_bytes(os.urandom(commit.stat().st_size))
    elif damage == "commit flipped byte":
        data = bytearray(commit.read_bytes())
        data[len(data) // 3] ^= 0x55
        commit.write_bytes(bytes(data))
    elif damage == "segment truncated":
        segment.write_bytes(raw[: len(raw) // 2])
    elif damage == "segment random bytes":
        segment.write_bytes(os.urandom(len(raw)))
    elif damage == "segment flipped bytes":  # the frame is intact: only the checksum tells
        data = bytearray(raw)
        for at in range(64, len(data) // 2, 97):
            data[at] ^= 0xFF
        segment.write_bytes(bytes(data))
    elif damage == "segment empty":
        segment.write_bytes(b"")
    elif damage == "segment missing":
        segment.unlink()
    elif damage == "segment of another index":
        vocab = notesvc._Vocab()
        seg = notesvc.MemorySegment(vocab)
        seg.add(vocab.analyse("notes/zz.md", "unrelated words only", 20, 1), (3.0, 1.0))
        with open(segment, "wb") as f:
            notesvc.write_segment(f, [seg], [set()], [({}, {})])


PAIR_VOCAB = [f"w{i}x" for i in range(700)]  # words that are their own stems


def pair_notes(rnd: random.Random, n: int) -> dict:
    """Notes over 700 words with Zipf-like frequencies: a merge numbers them commonest
    first, so phrases fall on every side of PAIR_COMMON and PAIR_TERMS."""
    weights = [1 / (i + 1) for i in range(len(PAIR_VOCAB))]
    notes = {}
    for i in range(n):
        words = rnd.choices(PAIR_VOCAB, weights, k=rnd.randint(2, 120))
        title = " ".join(rnd.choices(PAIR_VOCAB, weights, k=rnd.randint(1, 4)))
        notes[f"notes/p{i:04d}.md"] = f"# {title}\n\n{' '.join(words)}\n"
    return notes


def phrase_queries(rnd: random.Random, notes: dict, seg) -> dict:
    """Return {phrase query: kind}: phrases found in the notes' bodies and titles and
    made-up ones, of 2 and 3 words, whose pairs have a list (kind "pairs") or not."""
    texts = sorted(notes.values())
    out = {}
    while len(out) < 160:
        words = re.findall(r"w\d+x", rnd.choice(texts))
        size = rnd.choice((2, 2, 3))
        if len(words) < size:
            continue
        if rnd.random() < 0.7:
            j = rnd.randrange(len(words) - size + 1)
            words = words[j : j + size]
        else:
            words = rnd.sample(PAIR_VOCAB[:600], size)
        keys = seg.keys(words)
        listed = None not in keys and seg.pair_ids(keys, 0) is not None
        out[f'"{" ".join(words)}"'] = "pairs" if listed else "search"
    return out


def read_footer(path: Path) -> dict:
    raw = path.read_bytes()
    size = notesvc._TRAILER.unpack(raw[-notesvc._TRAILER.size :])[0]
    return json.loads(raw[-notesvc._TRAILER.size - size : -notesvc._TRAILER.size])


def rewrite_footer(path: Path, footer: dict) -> None:
    """Write a segment file's footer again at its length (padded with spaces), so the
    commit file still names the file: what another version could have written."""
    raw = path.read_bytes()
    size, _, magic = notesvc._TRAILER.unpack(raw[-notesvc._TRAILER.size :])
    text = json.dumps(footer, separators=(",", ":")).encode()
    assert len(text) <= size
    text = text.ljust(size)
    body = raw[: -notesvc._TRAILER.size - size]
    path.write_bytes(body + text + notesvc._TRAILER.pack(size, zlib.crc32(text), magic))


def bounds_of(path: Path, section: str) -> list:
    """Return [start, length] of a section of a segment file, from its footer."""
    return read_footer(path)["sections"][section]


class TestPhrasePairs:
    """A segment file lists the notes of each pair of its commoner terms; phrases answered
    from those lists are the brute-force BM25's, and a file without them still answers."""

    def build(self, disk_index, tmp_path, n: int = 400) -> tuple:
        notes = pair_notes(random.Random(11), n)
        write_notes(tmp_path, notes)
        assert disk_index.sync()["read"] == n
        (bulk,) = disk_index._segs[:1]
        assert bulk._pairs is None  # a first build's file: none (merged soon)
        notes["notes/extra.md"] = "w0x w1x w2x"  # in a second file, to merge
        write_notes(tmp_path, {"notes/extra.md": notes["notes/extra.md"]})
        st = (tmp_path / "notes/extra.md").stat()
        disk_index.add("notes/extra.md", notes["notes/extra.md"], st.st_size, st.st_mtime_ns)
        assert disk_index.flush()
        files = [s for s in disk_index._segs if isinstance(s, notesvc.DiskSegment)]
        assert disk_index.merge(files)  # one file, its terms numbered commonest first
        seg = disk_index._segs[0]
        assert isinstance(seg, notesvc.DiskSegment)
        return notes, seg

    @pytest.mark.parametrize("spill", [None, 37])
    def test_phrases_from_pair_lists_answer_like_brute_force(
        self, disk_index, tmp_path, monkeypatch, spill
    ):
        if spill:  # the merge writes its pair lists in runs of 37 ids to a file, then merges
            monkeypatch.setattr(notesvc, "PAIR_SPILL_IDS", spill)
        notes, seg = self.build(disk_index, tmp_path)
        assert seg.nt > notesvc.PAIR_TERMS  # terms past the lists' range too
        queries = phrase_queries(random.Random(4), notes, seg)
        kinds = collections.Counter(queries.values())
        assert kinds["pairs"] >= 40, kinds
        assert kinds["search"] >= 20, kinds
        ref = ReferenceBM25(notes)
        for q in queries:
            assert_answers_like(disk_index, ref, q)
        rnd = random.Random(5)
        remove_notes(rnd, disk_index, notes, tmp_path, 60)  # deleted in the file
        ref = ReferenceBM25(notes)
        for q in queries:
            assert_answers_like(disk_index, ref, q)

    @pytest.mark.parametrize("spill", [None, 37])
    def test_a_pair_list_is_exactly_the_notes_holding_the_pair(
        self, disk_index, tmp_path, monkeypatch, spill
    ):
        if spill:
            monkeypatch.setattr(notesvc, "PAIR_SPILL_IDS", spill)
        notes, seg = self.build(disk_index, tmp_path)
        terms = {w: k for w, k in zip(PAIR_VOCAB, seg.keys(PAIR_VOCAB)) if k is not None}
        paths = [seg.path(d) for d in range(seg.n)]
        common = [w for w in PAIR_VOCAB if terms.get(w, 10**9) < notesvc.PAIR_COMMON][:6]
        middle = [
            w for w in PAIR_VOCAB if notesvc.PAIR_COMMON <= terms.get(w, -1) < notesvc.PAIR_TERMS
        ][:6]
        assert len(common) == 6
        assert len(middle) == 6
        fields = {  # each note's body and title as notesvc reads them
            p: (notesvc.tokenize(t), notesvc.tokenize(notesvc.note_title(t, p)))
            for p, t in notes.items()
        }
        for a, b in [*itertools.product(common, common + middle), *zip(middle, common)]:
            for f in (0, 1):
                want = {p for p, toks in fields.items() if (a, b) in zip(toks[f], toks[f][1:])}
                (ids,) = seg.pair_ids([terms[a], terms[b]], f)
                assert {paths[d] for d in ids} == want, (a, b, f)
        for a, b in itertools.product(middle, middle):  # neither among the commonest
            assert seg.pair_ids([terms[a], terms[b]], 0) is None

    def test_a_file_without_pair_lists_still_answers_phrases(self, disk_index, tmp_path):
        notes, seg = self.build(disk_index, tmp_path)
        queries = phrase_queries(random.Random(6), notes, seg)
        before = {q: disk_index.search(notesvc.Query(q), "", 10, 0) for q in queries}
        path = seg.file
        disk_index.close()
        footer = read_footer(path)  # now as 0.3 wrote it: no pair lists
        del footer["pair_terms"]
        for name in ("pair_keys", "pair_off", "pair_ids"):
            del footer["sections"][name]
        rewrite_footer(path, footer)
        index = notesvc.SearchIndex.open(tmp_path / ".notesvc", disk_index.notes)
        try:
            (old,) = [s for s in index._segs if isinstance(s, notesvc.DiskSegment)]
            assert old._pairs is None
            assert old.pair_ids([0, 1], 0) is None
            for q, want in before.items():
                assert index.search(notesvc.Query(q), "", 10, 0) == want, q
            assert index.sync()["read"] == 0  # kept, not read again
        finally:
            index.close()

    def test_a_big_file_without_pair_lists_is_written_again_once(
        self, disk_index, tmp_path, monkeypatch
    ):
        notes = pair_notes(random.Random(12), 300)
        write_notes(tmp_path, notes)
        assert disk_index.sync()["read"] == 300
        (bulk,) = disk_index._segs[:1]
        assert bulk._pairs is None
        assert disk_index._pick_merge() == []  # under PAIR_REWRITE_NOTES: left as it is
        monkeypatch.setattr(notesvc, "PAIR_REWRITE_NOTES", 250)
        assert disk_index._pick_merge() == [bulk]
        assert disk_index.merge([bulk])
        (seg,) = [s for s in disk_index._segs if isinstance(s, notesvc.DiskSegment)]
        assert seg is not bulk
        assert seg._pairs is not None
        assert disk_index._pick_merge() == []  # once
        ref = ReferenceBM25(notes)
        for q in list(phrase_queries(random.Random(8), notes, seg))[:40]:
            assert_answers_like(disk_index, ref, q)

    def test_a_phrase_after_another_clause_keeps_to_that_clause_on_every_path(
        self, disk_index, tmp_path
    ):
        notes = {
            "notes/n1.md": "a b",  # the phrase, without c
            **{f"notes/t{i}/a x b.md": "zzz" for i in range(3)},  # a and b in titles only
            **{f"notes/c{i}.md": "c c" for i in range(2)},
            **{f"notes/f{i}.md": "filler" for i in range(60)},
        }
        write_notes(tmp_path, notes)
        ref = ReferenceBM25(notes)
        queries = ['c "a b"', '"a b" c', 'c "a b" -zzz', 'filler OR c "a b"']
        memory = notesvc.SearchIndex()
        for path, text in notes.items():
            memory.add(path, text, len(text), 1)
        assert disk_index.sync()["read"] == len(notes)
        (bulk,) = [s for s in disk_index._segs if isinstance(s, notesvc.DiskSegment)]
        assert bulk._pairs is None  # the substring search
        for q in queries:
            assert_answers_like(memory, ref, q)
            assert_answers_like(disk_index, ref, q)
        assert disk_index.merge([bulk])
        assert disk_index._segs[0]._pairs is not None  # the pair lists
        for q in queries:
            assert_answers_like(disk_index, ref, q)

    def test_a_rare_word_in_a_longer_phrase_still_narrows_the_search(
        self, disk_index, tmp_path, monkeypatch
    ):
        words = PAIR_VOCAB[:601]
        notes = {f"notes/n{i}.md": f"out of the blue {words[i]} {words[i + 1]}" for i in range(600)}
        notes["notes/rare.md"] = "out of the zebra"
        write_notes(tmp_path, notes)
        assert disk_index.sync()["read"] == len(notes)
        disk_index.add("notes/extra.md", "out of the blue", 15, 1)  # a second file...
        assert disk_index.flush()
        files = [s for s in disk_index._segs if isinstance(s, notesvc.DiskSegment)]
        assert disk_index.merge(files)  # ...so that the merge numbers terms commonest first
        seg = disk_index._segs[0]
        keys = seg.keys(["of", "the", "zebra"])
        assert keys[2] >= notesvc.PAIR_TERMS  # numbered after 600 commoner words
        assert len(seg.pair_ids(keys, 0)) == 1  # "of the" has a list; "the zebra" none
        checked = []
        phrase = notesvc.DiskSegment.phrase

        def counted(self, cands, chars, f):  # the search itself, its candidates counted
            cands = list(cands)
            checked.append(len(cands))
            return phrase(self, cands, chars, f)

        monkeypatch.setattr(notesvc.DiskSegment, "phrase", counted)
        total, hits = disk_index.search(notesvc.Query('"of the zebra"'), "", 10, 0)
        assert (total, [h[0] for h in hits]) == (1, ["notes/rare.md"])
        assert max(checked) == 1  # from zebra's one note, not the 601 holding "of the"

    def test_a_failed_rewrite_waits_and_other_settings_files_are_left_to_merges(
        self, disk_index, tmp_path, monkeypatch
    ):
        notes = pair_notes(random.Random(13), 300)
        write_notes(tmp_path, notes)
        assert disk_index.sync()["read"] == 300
        monkeypatch.setattr(notesvc, "PAIR_REWRITE_NOTES", 250)
        calls = []

        def full(*args, **kwargs):  # a full disk, as the writer meets it
            calls.append(1)
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(notesvc, "write_segment", full)
        for _ in range(5):
            disk_index.maintain(force=True)
        assert len(calls) == 1  # tried once: not again within PAIR_REWRITE_RETRY
        monkeypatch.setattr(notesvc, "PAIR_REWRITE_RETRY", 0.0)
        disk_index.maintain(force=True)
        assert len(calls) == 2
        monkeypatch.undo()
        (bulk,) = [s for s in disk_index._segs if isinstance(s, notesvc.DiskSegment)]
        assert disk_index.merge([bulk])  # the disk has room again
        path = disk_index._segs[0].file
        disk_index.close()
        footer = read_footer(path)
        footer["pair_terms"] = [64, 256]  # written by another version's settings
        rewrite_footer(path, footer)
        index = notesvc.SearchIndex.open(tmp_path / ".notesvc", disk_index.notes)
        try:
            monkeypatch.setattr(notesvc, "PAIR_REWRITE_NOTES", 250)
            (seg,) = [s for s in index._segs if isinstance(s, notesvc.DiskSegment)]
            assert seg._pairs is None
            assert index._pick_merge() == []  # no rewrite (a rewrite could loop on it)
            ref = ReferenceBM25(notes)
            for q in list(phrase_queries(random.Random(9), notes, seg))[:30]:
                assert_answers_like(index, ref, q)
        finally:
            index.close()

    def test_a_list_naming_a_note_past_the_file_is_not_trusted(self, disk_index, tmp_path):
        notes, seg = self.build(disk_index, tmp_path)
        words = ["w0x", "w1x"]
        keys = seg.keys(words)
        (ids,) = seg.pair_ids(keys, 0)
        assert len(ids) > 1
        listed, off, _ = seg._pairs
        i = listed.tolist().index(notesvc._pair_key(*keys, 0))
        at = int(bounds_of(seg.file, "pair_ids")[0]) + 4 * (off[i + 1] - 1)
        path = seg.file
        disk_index.close()
        raw = bytearray(path.read_bytes())
        raw[at : at + 4] = (seg.n + 5).to_bytes(4, sys.byteorder)  # past the last note
        path.write_bytes(bytes(raw))
        index = notesvc.SearchIndex.open(tmp_path / ".notesvc", disk_index.notes)
        try:
            (damaged,) = [s for s in index._segs if isinstance(s, notesvc.DiskSegment)]
            assert damaged.pair_ids(keys, 0) is None  # the substring search instead
            ref = ReferenceBM25(notes)
            for offset in (0, len(ids) - 2):
                total, _ = index.search(notesvc.Query('"w0x w1x"'), "", 10, offset)
                assert total == ref.search('"w0x w1x"', "")[0]
            assert_answers_like(index, ref, '"w0x w1x"')
        finally:
            index.close()

    @pytest.mark.parametrize("damage", ["bounds", "offsets", "torn"])
    def test_damaged_pair_lists_drop_the_file_and_its_notes_are_read_again(
        self, disk_index, tmp_path, damage
    ):
        notes, seg = self.build(disk_index, tmp_path)
        path = seg.file
        disk_index.close()
        footer = read_footer(path)
        start, length = footer["sections"]["pair_off"]
        if damage == "bounds":
            footer["sections"]["pair_ids"][0] = 8
        elif damage == "offsets":
            footer["sections"]["pair_off"] = [start, length - 4]
        else:
            footer["sections"]["pair_keys"][1] -= 2
        rewrite_footer(path, footer)
        with pytest.raises(notesvc.IndexFileError):
            notesvc.DiskSegment(path)
        index = notesvc.SearchIndex.open(tmp_path / ".notesvc", disk_index.notes)
        try:
            assert index.sync()["read"] == len(notes)
            ref = ReferenceBM25(notes)
            for q in list(phrase_queries(random.Random(7), notes, index._segs[0]))[:30]:
                assert_answers_like(index, ref, q)
        finally:
            index.close()


class TestSearchSegments:
    """Segment files, the commit file, merges, damage and a full disk (in process)."""

    @pytest.mark.slow
    def test_changes_while_merging_are_kept(self, make_app, root):
        rnd = random.Random(9)
        notes = make_ref_notes(rnd, 1200)
        write_notes(root, notes)
        app = with_key(make_app())
        index = app.app.service.index
        overlapped: list = []
        kinds = itertools.cycle(("create", "update", "move", "delete"))

        # Rounds until each kind of change has overlapped a merge (a merge of small files
        # can take a few milliseconds: the kinds take turns, so a round's first change
        # goes on where the last round's stopped).
        for round_ in range(40):
            if round_ >= 3 and {"create", "update", "move", "delete"} <= set(overlapped):
                break
            for path in rnd.sample(sorted(notes), 150):  # make a few segment files
                text = " ".join(rnd.choice(REF_WORDS) for _ in range(rnd.randint(5, 40)))
                notes[path] = text
                app.put_json(note_url(path), {"content": text})
            assert index.flush()
            files = [s for s in index._segs if isinstance(s, notesvc.DiskSegment)]
            assert len(files) >= 2
            merging = threading.Event()

            def merge(files=files, merging=merging):
                merging.set()
                index.merge(files)
                merging.clear()

            merger = threading.Thread(target=merge)
            merger.start()
            merging.wait(5)
            while merger.is_alive():  # create, update, move and delete while it runs
                kind, began = next(kinds), merging.is_set()
                path = rnd.choice(sorted(notes))
                text = " ".join(rnd.choice(REF_WORDS) for _ in range(rnd.randint(5, 40)))
                if kind == "create":
                    path = f"notes/new/r{round_}-{rnd.randrange(10**9)}.md"
                    notes[path] = text
                    put_note(app, path, text)
                elif kind == "update":
                    notes[path] = text
                    app.put_json(note_url(path), {"content": text})
                elif kind == "move":
                    new = f"notes/moved/{rnd.randrange(10**9)}.md"
                    notes[new] = notes.pop(path)
                    app.patch_json(note_url(path) + "/move", {"path": new})
                else:
                    del notes[path]
                    app.delete(note_url(path))
                if began or merging.is_set():
                    overlapped.append(kind)
            merger.join()
        assert {"create", "update", "move", "delete"} <= set(overlapped)
        ref = ReferenceBM25(notes)
        for q in ref_queries(random.Random(3), notes):
            assert_answers_like(index, ref, q)
        assert set(index.paths()) == set(notes)
        assert app.app.service.sync_index()["read"] == 0

    @pytest.mark.parametrize(
        "damage",
        [
            "commit truncated",
            "commit random bytes",
            "commit flipped byte",
            "segment truncated",
            "segment random bytes",
            "segment flipped bytes",
            "segment empty",
            "segment missing",
            "segment of another index",
        ],
    )
    @pytest.mark.slow
    def test_damaged_index_is_discarded_and_rebuilt(self, make_app, root, damage, caplog):
        rnd = random.Random(4)
        notes = make_ref_notes(rnd, 200)
        write_notes(root, notes)
        app = make_app()
        assert app.app.service.last_sync["read"] == 200
        app.app.service.close()
        damage_index(root, damage)
        caplog.clear()
        again = make_app()
        assert again.app.service.last_sync["read"] == 200  # every note read again
        ref = ReferenceBM25(notes)
        for q in ("apple", "the keys", '"spare blue"', "gard*", "zebra -apple"):
            assert_answers_like(again.app.service.index, ref, q)
        said = " ".join(r.getMessage() for r in caplog.records)
        assert "discarded, rebuilding" in said or "dropped" in said
        assert "Traceback" not in said
        again.app.service.close()
        third = make_app()  # the rebuilt index is whole again: nothing to read
        assert third.app.service.last_sync["read"] == 0

    def test_an_index_of_another_stemmer_is_rebuilt(self, make_app, root, caplog, monkeypatch):
        notes = {
            f"notes/n{i}.md": f"# Note {i}\n\nShared generously, item {i}.\n" for i in range(30)
        }
        write_notes(root, notes)
        with monkeypatch.context() as m:  # an index written by an older stemmer (here: none)
            m.setattr(notesvc, "INDEX_FORMAT", (*notesvc.INDEX_FORMAT[:-1], "stem-1"))
            m.setattr(notesvc, "stem", lambda word: word)
            app = make_app()
            assert app.app.service.index.search(notesvc.Query("generous"))[0] == 0
            app.app.service.close()
        caplog.clear()
        again = make_app()
        assert again.app.service.last_sync["read"] == 30  # every note read again
        assert again.app.service.index.search(notesvc.Query("generous"))[0] == 30
        said = " ".join(r.getMessage() for r in caplog.records)
        assert "an index of another format" in said
        assert "discarded, rebuilding" in said
        again.app.service.close()

    @pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
    @pytest.mark.parametrize("count", [1, 60])  # one by one, and the bulk path
    def test_a_named_pipe_called_like_a_note_is_skipped_not_waited_on(self, make_app, root, count):
        notes = {f"notes/n{i}.md": f"alpha note {i}" for i in range(count)}
        write_notes(root, notes)
        os.mkfifo(root / "notes" / "pipe.md")
        made: dict = {}
        starter = threading.Thread(target=lambda: made.update(app=make_app()), daemon=True)
        starter.start()
        starter.join(30)
        assert "app" in made  # the start-up check did not hang on the pipe
        app = with_key(made["app"])
        assert search(app, "alpha")["total"] == count
        assert app.app.service.index.title_of("notes/pipe.md") is None
        (root / "attachments").mkdir(exist_ok=True)
        os.mkfifo(root / "attachments" / "pipe.jpg")
        answers: list = []

        def read_both():  # asked for by name, each answers 404 at once
            answers.append(app.get(note_url("notes/pipe.md"), status="*").status_int)
            answers.append(
                app.get(f"{API}/attachments/attachments/pipe.jpg", status="*").status_int
            )

        reader = threading.Thread(target=read_both, daemon=True)
        reader.start()
        reader.join(30)
        assert answers == [404, 404]
        app.app.service.close()

    def test_files_are_private_and_leftovers_are_swept(self, make_app, root):
        write_notes(root, make_ref_notes(random.Random(1), 100))
        app = make_app()
        app.app.service.close()
        index_dir = root / ".notesvc" / "index"
        (index_dir / "99999999.seg").write_bytes(b"a segment no commit names")
        (index_dir / ".tmp-abc.part").write_bytes(b"a write a crash cut short")
        make_app().app.service.close()
        assert stat.S_IMODE(index_dir.stat().st_mode) == 0o700
        names = index_files(root)
        assert names
        assert all(n.endswith(".seg") for n in names)
        assert "99999999.seg" not in names
        for path in [*index_dir.iterdir(), root / ".notesvc" / "index.cache"]:
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path

    @pytest.mark.slow
    def test_cold_start_bulk_path_indexes_thousands_of_notes(self, make_app, root, caplog):
        rnd = random.Random(8)
        notes = make_ref_notes(rnd, 4500)
        write_notes(root, notes)
        caplog.set_level("INFO", logger="notesvc")
        app = make_app()
        svc = app.app.service
        assert svc.last_sync["read"] == 4500
        if (os.cpu_count() or 1) > 1:  # a helper process did every other batch, unharmed
            assert "a helper process" in caplog.text
            assert "one core" not in caplog.text
        files = [s for s in svc.index._segs if isinstance(s, notesvc.DiskSegment)]
        assert len(files) == 3  # one per BULK_CHUNK_NOTES
        ref = ReferenceBM25(notes)
        for q in ("apple", "the keys", '"spare blue"', "gard*", "zebra -apple", "yak OR heron"):
            assert_answers_like(svc.index, ref, q)
        svc.index.maintain(force=True)  # the background thread's merge, now
        assert len(svc.index._segs) == 1
        for q in ("apple", '"spare blue"', "gard*"):
            assert_answers_like(svc.index, ref, q)
        # The merge was written by a helper process (off the server's GIL), stopped after.
        assert "merges segment files" in caplog.text
        assert "merging in this process" not in caplog.text
        assert svc.index._merger is None
        assert not list((svc.config.state_dir / "index").glob(notesvc.TEMP_PREFIX + "*"))
        # A restart that finds every note changed (a `touch` of everything): the helper
        # analyses every batch, and this process only installs its files.
        svc.close()
        later = time.time_ns() + 10**9
        for path in root.joinpath("notes").rglob("*.md"):
            os.utime(path, ns=(later, later))
        caplog.clear()
        again = make_app().app.service
        assert again.last_sync["read"] == 4500
        if (os.cpu_count() or 1) > 1:
            assert "4500 notes in" in caplog.text
            assert "(3 batches by the helper process)" in caplog.text
        for q in ("apple", "the keys", '"spare blue"', "gard*", "zebra -apple"):
            assert_answers_like(again.index, ref, q)
        again.close()

    def test_deleted_counts_are_four_bytes_a_term_and_come_back_after_a_restart(
        self, make_app, root
    ):
        """A segment file's notes replaced by newer ones keep counting out of the document
        frequencies (in an array, 4 bytes a term): the same answers before and after a
        restart, which reads them back from the commit file."""
        rnd = random.Random(12)
        notes = make_ref_notes(rnd, 300)
        write_notes(root, notes)
        svc = make_app().app.service
        svc.index.maintain(force=True)
        (seg,) = [s for s in svc.index._segs if isinstance(s, notesvc.DiskSegment)]
        for path in rnd.sample(sorted(notes), 120):  # replaced: deleted in the segment file
            notes[path] = " ".join(rnd.choice(REF_WORDS) for _ in range(rnd.randint(3, 30)))
            (root / path).write_text(notes[path])
            st = (root / path).stat()
            svc.index.add(path, notes[path], st.st_size, st.st_mtime_ns)
        svc.index.flush()
        counts = seg.del_df[0]
        assert len(seg.deleted) == 120
        assert counts.counts.itemsize == 4
        assert len(counts.counts) == seg.nt
        ref = ReferenceBM25(notes)
        queries = ref_queries(random.Random(5), notes)
        for q in queries:
            assert_answers_like(svc.index, ref, q)
        kept = {f: seg.del_df[f].pairs().tolist() for f in (0, 1)}
        svc.close()
        name = seg.name
        svc = make_app().app.service  # a restart: the counts come from the commit file
        (seg,) = [s for s in svc.index._segs if s.name == name]
        assert {f: seg.del_df[f].pairs().tolist() for f in (0, 1)} == kept
        for q in queries:
            assert_answers_like(svc.index, ref, q)
        # A commit file naming a term past the segment's (only a damaged or forged one):
        # left out, never an array of that size.
        counts = notesvc._DeletedCounts(10)
        counts.load(array.array("I", [3, 2, 4_000_000_000, 7, 9, 1]))
        assert counts.pairs().tolist() == [3, 2, 9, 1]
        counts.add([1, 9, 4_000_000_000])
        assert counts.pairs().tolist() == [1, 1, 3, 2, 9, 2]
        assert counts.get(None) == counts.get(10) == counts.get(-1) == 0
        assert len(counts.counts) == 10

    def test_a_string_table_made_word_by_word_is_the_one_made_from_a_list(self):
        words = sorted(
            {"".join(random.Random(i).choices("abcé🙂z", k=i % 9 + 1)) for i in range(300)}
        )
        table = notesvc._StringTable()
        for w in words:
            table.append(w)
        assert len(table) == len(words)
        made, listed = notesvc._text_table(table), notesvc._text_table(words)
        assert (bytes(made[0]), made[1], bytes(made[2])) == listed
        assert notesvc._text_table(notesvc._StringTable())[1].tolist() == [0]

    def test_a_merge_the_helper_cannot_write_is_written_by_the_server(self, root, tmp_path, caplog):
        """The helper opens the segment files by name; one gone from the folder (the index
        still has it mapped) makes it fail: the index merges it itself, nothing lost."""
        rnd = random.Random(21)
        notes = make_ref_notes(rnd, 4500)
        write_notes(root, notes)
        caplog.set_level("INFO", logger="notesvc")
        store = notesvc.NoteStore(root / "notes", tmp_path / "trash")
        (tmp_path / "index").mkdir()
        index = notesvc.SearchIndex(tmp_path / "index", store)  # no background thread
        try:
            index.sync(store)
            files = [s for s in index._segs if isinstance(s, notesvc.DiskSegment)]
            assert len(files) == 3
            assert index.merge(files[:2])  # through the helper, kept for the next merge
            assert "merges segment files" in caplog.text
            files = [s for s in index._segs if isinstance(s, notesvc.DiskSegment)]
            files[0].file.unlink()
            assert index.merge(files)
            assert "merging in this process" in caplog.text
            assert [type(s) for s in index._segs] == [notesvc.DiskSegment]
            ref = ReferenceBM25(notes)
            for q in ("apple", "the keys", '"spare blue"', "gard*", "zebra -apple"):
                assert_answers_like(index, ref, q)
            assert not list((tmp_path / "index").glob(notesvc.TEMP_PREFIX + "*"))
        finally:
            index.close()
        assert index._merger is None

    def test_full_disk_while_writing_a_segment_keeps_serving(self, tmp_path, caplog):
        if os.geteuid() != 0 or not shutil.which("mount"):
            pytest.skip("mounting a small tmpfs needs root")
        disk = tmp_path / "disk"
        disk.mkdir()
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)],
            capture_output=True,
            timeout=10,
        )
        if mounted.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode()[:200]}")
        try:
            state = disk / ".notesvc"
            state.mkdir()
            (disk / "notes").mkdir()
            index = notesvc.SearchIndex.open(state, notesvc.NoteStore(disk / "notes", state))
            index.add("notes/a.md", "# Before\n\nkept in a file", 30, 1)
            assert index.flush()
            for i in range(200):
                index.add(f"notes/m{i}.md", f"in memory only {i} " + "word " * 100, 600, 1)
            filler = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
            try:  # fill the disk to the last block
                with contextlib.suppress(OSError):
                    while True:
                        os.write(filler, b"\0" * 4096)
            finally:
                os.close(filler)
            assert index.flush() is False
            assert "could not write segment" in caplog.text
            assert index.search(notesvc.Query("memory"), "", 5, 0)[0] == 200
            assert index.search(notesvc.Query("kept"), "", 5, 0)[0] == 1
            assert not [p for p in (state / "index").iterdir() if p.name.startswith(".tmp-")]
            os.unlink(disk / "filler")
            assert index.flush()
            index.close()
            again = notesvc.SearchIndex.open(state, notesvc.NoteStore(disk / "notes", state))
            assert again.search(notesvc.Query("memory"), "", 5, 0)[0] == 200
            again.close()
            del index, again  # their segment files are mapped until collected
        finally:
            import gc

            gc.collect()
            subprocess.run(["umount", str(disk)], capture_output=True, timeout=10)
            subprocess.run(["umount", "-l", str(disk)], capture_output=True, timeout=10)


class TestServerSearch:
    pytestmark = [pytest.mark.real_server, pytest.mark.slow]

    def test_concurrent_searches_during_writes_never_error(self, tmp_path):
        with running(tmp_path, "--auth-mode", "none") as server:
            for i in range(20):
                server.request(
                    "POST", f"{API}/notes", {"path": f"notes/n{i}.md", "content": f"seed {i} heron"}
                )
            stop = threading.Event()
            bad = []
            done = collections.Counter()  # requests answered, by method

            def writer(w):
                v = 0
                while not stop.is_set():
                    v += 1
                    path = f"notes/n{(v + w) % 20}.md"
                    status, _, _ = server.request(
                        "PUT", note_url(path), {"content": f"heron {w} {v} kingfisher"}
                    )
                    done["PUT"] += 1
                    if status != 200:
                        bad.append(("PUT", status))

            def searcher():
                while not stop.is_set():
                    for q in ("heron", "kingfisher", '"heron 1"', "her*", "heron -seed"):
                        status, _, body = server.request(
                            "GET", f"{API}/search?" + urllib.parse.urlencode({"q": q})
                        )
                        done["GET"] += 1
                        if status != 200 or not body["success"]:
                            bad.append(("GET", status))

            threads = [threading.Thread(target=writer, args=(w,)) for w in range(3)]
            threads += [threading.Thread(target=searcher) for _ in range(3)]
            for t in threads:
                t.start()
            wait_for(lambda: done["PUT"] >= 150 and done["GET"] >= 300, timeout=60)
            stop.set()
            for t in threads:
                t.join(30)
            assert bad == []
            _, _, body = server.request("GET", f"{API}/search?q=heron")
            assert body["data"]["total"] == 20

    def test_background_rescan_picks_up_external_files(self, tmp_path):
        with running(tmp_path, "--auth-mode", "none", env={"SERVICE_RESCAN_SECONDS": "1"}) as s:
            (tmp_path / "notes" / "dropped.md").write_text("synced by syncthing: axolotl")
            found = wait_for(
                lambda: s.request("GET", f"{API}/search?q=axolotl")[2]["data"]["results"],
                timeout=10,
                step=0.3,
            )
            assert [r["path"] for r in found] == ["notes/dropped.md"]


def temp_files(index_dir: Path) -> list:
    with contextlib.suppress(FileNotFoundError):
        return [p for p in index_dir.iterdir() if p.name.startswith(".tmp-")]
    return []


def unique_notes(n: int, start: int = 0) -> dict:
    """Notes that each hold the word "common" and a word of their own (u<number>x)."""
    return {
        f"notes/d{i % 7}/n{i:05d}.md": f"# Note {i}\n\ncommon words u{i}x and then some more "
        f"filler text {i % 13} to make it a note"
        for i in range(start, start + n)
    }


def assert_server_answers(server, notes: dict) -> None:
    status, _, body = server.request("GET", f"{API}/search?q=common&limit=1")
    assert status == 200
    assert body["data"]["total"] == len(notes)
    for path in sorted(notes)[:: max(1, len(notes) // 25)]:
        word = re.search(r"u\d+x", notes[path]).group(0)
        _, _, body = server.request("GET", f"{API}/search?q={word}")
        assert [r["path"] for r in body["data"]["results"]] == [path], word


class TestServerSearchSegments:
    """Real servers: SIGKILL during a segment write and during a merge, then a restart that
    answers exactly what the files say; a restart that answers before its check."""

    pytestmark = [pytest.mark.real_server, pytest.mark.slow]

    def test_sigkill_during_a_segment_write_then_restart(self, tmp_path):
        notes = unique_notes(3000)
        write_notes(tmp_path, notes)
        index_dir = tmp_path / ".notesvc" / "index"
        server = Server(tmp_path, "--auth-mode", "none", env={"SERVICE_RESCAN_SECONDS": "1"})
        try:  # the first check reads every note and writes a segment file in the background
            wait_for(lambda: temp_files(index_dir), timeout=30, step=0.002)
            server.proc.kill()
            server.proc.wait(10)
        finally:
            server.stop()
        assert temp_files(index_dir)  # it died in the middle of the write
        with running(tmp_path, "--auth-mode", "none") as again:
            assert_server_answers(again, notes)
        assert not temp_files(index_dir)

    def test_sigkill_during_a_merge_then_restart(self, tmp_path):
        notes = unique_notes(5000)  # three segment files (BULK_CHUNK_NOTES), then one merge
        write_notes(tmp_path, notes)
        index_dir = tmp_path / ".notesvc" / "index"
        server = Server(tmp_path, "--auth-mode", "none", env={"SERVICE_RESCAN_SECONDS": "3600"})
        try:

            def synced():
                _, _, body = server.request("GET", f"{API}/system/info")
                return body["data"]["index"]["lastSync"]

            wait_for(
                lambda: len([p for p in index_dir.iterdir() if p.suffix == ".seg"]) >= 3, timeout=30
            )
            # Killed while the index writes a file: the merge's, or on a busy machine the last
            # bulk segment's (the merge can finish before a poll sees it): either way the
            # restart must answer exactly what the files say.
            wait_for(lambda: temp_files(index_dir) or synced(), timeout=30, step=0.002)
            server.proc.kill()
            server.proc.wait(10)
        finally:
            server.stop()
        assert len([p for p in index_dir.iterdir() if p.suffix == ".seg"]) >= 1
        moved = sorted(notes)[:5]  # and edits made while it was down
        for path in moved:
            notes[path] = notes[path].replace("common", "uncommon")
            (tmp_path / path).write_text(notes[path])
        with running(tmp_path, "--auth-mode", "none") as again:
            _, _, body = again.request("GET", f"{API}/search?q=common&limit=1")
            assert body["data"]["total"] == len(notes) - len(moved)
            _, _, body = again.request("GET", f"{API}/search?q=uncommon&limit=10")
            assert sorted(r["path"] for r in body["data"]["results"]) == moved
        with running(tmp_path, "--auth-mode", "none") as third:
            for path in moved:
                notes[path] = notes[path].replace("uncommon", "common")
            assert_server_answers(third, {p: t for p, t in notes.items() if p not in moved})

    def test_restart_with_5000_notes_answers_before_its_check_and_finds_external_edits(
        self, tmp_path
    ):
        notes = unique_notes(5000)
        write_notes(tmp_path, notes)
        with running(tmp_path, "--auth-mode", "none") as first:  # builds, then commits at stop
            assert_server_answers(first, notes)
        for i, path in enumerate(sorted(notes)[:1500]):  # edited while the server was down
            notes[path] = notes[path].replace("filler", f"edited{i % 3}")
            (tmp_path / path).write_text(notes[path])
        later = time.time_ns() + 10**9
        for path in notes:  # and every other note touched: the check reads them all again
            os.utime(tmp_path / path, ns=(later, later))
        gone = sorted(notes)[-1]
        (tmp_path / gone).unlink()
        del notes[gone]
        env = {"SERVICE_RESCAN_SECONDS": "600"}
        with running(tmp_path, "--auth-mode", "none", env=env) as again:
            status, _, body = again.request("GET", f"{API}/search?q=common&limit=3")
            _, _, info = again.request("GET", f"{API}/system/info")
            assert status == 200
            assert body["data"]["total"] >= 4999  # answered from the segment files...
            assert info["data"]["index"]["lastSync"] == {}  # ...before the check finished

            def edited():
                _, _, body = again.request("GET", f"{API}/search?q=edited0")
                return body["data"]["total"] == 500

            wait_for(edited, timeout=60, step=0.05)
            assert_server_answers(again, notes)

            def synced():  # the first edits are found while the check reads the rest
                _, _, info = again.request("GET", f"{API}/system/info")
                return info["data"]["index"]["lastSync"]

            assert wait_for(synced, timeout=60, step=0.05) == {
                **synced(),
                "read": 4999,
                "removed": 1,
            }


SETUP_FIELDS = [
    "serverId",
    "apiKey",
    "setupComplete",
    "version",
    "auth.method",
    "auth.header",
    "auth.note",
    "pairing.mode",
    "pairing.relayCode",
    "pairing.relayUrl",
    "server.url",
    "server.port",
    "server.host",
    "server.cors",
    "links.setupApi",
    "links.health",
    "links.apiBase",
    "links.directApiBase",
    "links.relayApiBase",
    "links.connect.testHosted",
    "links.connect.hosted",
    "links.connect.localDevUi",
    "instructions",
]


def dig(obj: dict, dotted: str):
    for part in dotted.split("."):
        obj = obj[part]
    return obj


class TestSetup:
    def test_payload_has_every_spec_field(self, anon):
        payload = data(anon.get(f"{API}/system/setup"))
        for name in SETUP_FIELDS:
            dig(payload, name)  # KeyError names a missing field
        assert payload["auth"]["method"] == "api-key"
        assert payload["auth"]["header"] == "X-Service-Key"
        assert payload["server"]["port"] == 3000
        assert re.fullmatch(r"\d+\.\d+\.\d+", payload["version"])
        assert payload["version"] == notesvc.__version__

    def test_key_has_prefix_and_43_urlsafe_chars(self, anon):
        key = data(anon.get(f"{API}/system/setup", extra_environ=LOCAL))["apiKey"]
        assert re.fullmatch(r"nsk_[A-Za-z0-9_-]{43}", key)

    def test_relay_mode_links(self, anon):
        p = data(anon.get(f"{API}/system/setup", headers={"Host": "notes.example:3000"}))
        sid, code = p["serverId"], p["pairing"]["relayCode"]
        links = p["links"]
        assert p["server"]["url"] == "http://notes.example:3000"
        assert links["directApiBase"] == "http://notes.example:3000/api/v1"
        assert links["relayApiBase"] == f"http://notes.example:3000/r/{sid}/api/v1"
        assert links["apiBase"] == links["relayApiBase"]
        assert links["setupApi"] == "http://notes.example:3000/api/v1/system/setup"
        assert links["health"] == "http://notes.example:3000/api/v1/health"
        assert links["connect"]["hosted"].endswith(f"?relayCode={code}")
        assert links["connect"]["testHosted"].endswith(f"?relayCode={code}")
        assert "relayUrl=http%3A%2F%2Fnotes.example%3A3000" in links["connect"]["localDevUi"]

    def test_open_port_mode_uses_direct_api_base(self, make_app):
        p = data(make_app(SERVICE_PAIRING_MODE="open-port").get(f"{API}/system/setup"))
        assert p["pairing"]["mode"] == "open-port"
        assert p["links"]["apiBase"] == p["links"]["directApiBase"]

    def test_configured_relay_and_client_urls(self, make_app):
        app = make_app(
            SERVICE_RELAY_URL="https://relay.example",
            SERVICE_CLIENT_URL="https://app.example/connect",
            SERVICE_TEST_CLIENT_URL="https://test.example/?v=2",
        )
        p = data(app.get(f"{API}/system/setup"))
        code = p["pairing"]["relayCode"]
        assert p["pairing"]["relayUrl"] == "https://relay.example"
        assert p["links"]["relayApiBase"].startswith("https://relay.example/r/")
        assert p["links"]["connect"]["hosted"] == f"https://app.example/connect?relayCode={code}"
        assert p["links"]["connect"]["testHosted"] == f"https://test.example/?v=2&relayCode={code}"

    @pytest.mark.parametrize(
        "host", ["evil.example/phish", "a b", "user@evil.example", "x:99999", "<script>", ""]
    )
    def test_invalid_host_header_is_ignored(self, anon, host):
        p = data(anon.get(f"{API}/system/setup", headers={"Host": host}))
        assert p["server"]["url"] == "http://127.0.0.1:80"  # WebTest's SERVER_PORT
        assert "evil" not in json.dumps(p)

    def test_forwarded_headers_ignored_unless_proxy_trusted(self, make_app):
        headers = {"X-Forwarded-Proto": "https", "X-Forwarded-Host": "notes.example"}
        untrusted = data(make_app().get(f"{API}/system/setup", headers=headers))
        assert "notes.example" not in untrusted["server"]["url"]
        trusted_app = make_app(SERVICE_TRUST_PROXY="true")
        proxy = {"REMOTE_ADDR": "127.0.0.1"}  # the peer is the (loopback) proxy
        trusted = data(trusted_app.get(f"{API}/system/setup", headers=headers, extra_environ=proxy))
        assert trusted["server"]["url"] == "https://notes.example"
        elsewhere = {"REMOTE_ADDR": "192.0.2.7"}  # trusted proxies only, not any peer
        other = trusted_app.get(f"{API}/system/setup", headers=headers, extra_environ=elsewhere)
        assert "notes.example" not in data(other)["server"]["url"]

    def test_public_url_wins(self, make_app):
        app = make_app(SERVICE_PUBLIC_URL="https://pi.example/")
        p = data(app.get(f"{API}/system/setup", headers={"Host": "other:1"}))
        assert p["server"]["url"] == "https://pi.example"

    def test_link_completes_setup_and_redacts_key(self, anon, client):
        key = key_of(anon)
        before = data(anon.get(f"{API}/system/setup", extra_environ=LOCAL))
        assert before["setupComplete"] is False
        assert before["apiKey"] == key
        assert before["instructions"]
        link = client.post_json(f"{API}/auth/link", {"clientName": "phone"}, extra_environ=LOCAL)
        linked = data(link)
        assert linked["linked"] is True
        assert linked["setupComplete"] is True
        after = data(anon.get(f"{API}/system/setup"))
        assert after["setupComplete"] is True
        assert after["apiKey"] == "nsk_…" + key[-4:]
        assert key not in json.dumps(after)
        assert "instructions" not in after
        # The key keeps working after it is redacted.
        assert data(client.post(f"{API}/auth/verify"))["setupComplete"] is True

    def test_setup_local_only_hides_key_from_remote_clients(self, make_app):
        app = make_app(SERVICE_SETUP_LOCAL_ONLY="true")
        key = key_of(app)
        home = {"REMOTE_ADDR": "192.168.1.7"}  # its own network: not loopback
        remote = data(app.get(f"{API}/system/setup", extra_environ=home))
        assert remote["apiKey"] != key
        assert remote["apiKey"].startswith("nsk_…")
        local = data(app.get(f"{API}/system/setup", extra_environ={"REMOTE_ADDR": "127.0.0.1"}))
        assert local["apiKey"] == key

    @pytest.mark.parametrize(
        ("host", "shown"),
        [
            ("127.0.0.1:3000", True),
            ("[::1]:3000", True),
            ("192.168.1.20", True),
            ("LocalHost:3000", True),
            (socket.gethostname().upper(), True),
            (f"{socket.gethostname()}.local:3000", True),
            ("notes.example", True),  # SERVICE_PUBLIC_URL's host
            ("rebind.attacker.example", False),
            ("localhost.attacker.example", False),
            (f"{socket.gethostname()}.attacker.example", False),
            ("", False),
        ],
    )
    def test_full_key_only_for_hosts_naming_this_machine(self, make_app, host, shown):
        app = make_app(SERVICE_PUBLIC_URL="https://notes.example")
        key = key_of(app)
        p = data(app.get(f"{API}/system/setup", headers={"Host": host}, extra_environ=LOCAL))
        assert (p["apiKey"] == key) is shown
        if not shown:
            assert p["apiKey"] == "nsk_…" + key[-4:]

    def test_forwarded_host_counts_for_the_key_only_from_a_trusted_proxy(self, make_app):
        app = make_app(SERVICE_TRUST_PROXY="true")
        key = key_of(app)
        home = {"Host": "127.0.0.1", "X-Forwarded-For": "192.168.1.5"}
        rebind = {**home, "X-Forwarded-Host": "rebind.attacker.example"}
        via_proxy = {"REMOTE_ADDR": "127.0.0.1"}
        assert (
            data(app.get(f"{API}/system/setup", headers=home, extra_environ=via_proxy))["apiKey"]
            == key
        )
        p = data(app.get(f"{API}/system/setup", headers=rebind, extra_environ=via_proxy))
        assert p["apiKey"] != key  # the proxy was asked for the attacker's name
        assert p["setupHere"] == {"allowed": False, "reason": "host"}

    # -- who may set up: the TCP peer decides, never a header ---------------------------

    STRANGER = {"REMOTE_ADDR": "203.0.113.5"}  # beyond any home network

    @pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.1:3000", "localhost", "[::1]:3000"])
    def test_a_stranger_naming_this_machine_gets_no_key_and_cannot_link(self, make_app, host):
        """S1: the Host header is the client's to write; it never earns the key."""
        app = make_app()
        key = key_of(app)
        p = data(
            app.get(f"{API}/system/setup", headers={"Host": host}, extra_environ=self.STRANGER)
        )
        assert p["apiKey"] == "nsk_…" + key[-4:]
        assert p["browserSetup"] is False
        assert p["setupHere"] == {"allowed": False, "reason": "remote"}
        for _ in range(12):  # more than the lockout's 10: a refusal here is not a failure
            resp = with_key(app).post(
                f"{API}/auth/link", headers={"Host": host}, extra_environ=self.STRANGER, status=403
            )
            err = assert_error(resp, 403, "FORBIDDEN")
            assert err["message"] == (
                "finish setup on this machine or its home network, or run `pair` on the server"
            )
        assert not app.app.service.state.read()["setupComplete"]
        assert data(with_key(app).get(f"{API}/notes", extra_environ=self.STRANGER)) is not None
        # from home the same key links at once
        with_key(app).post(f"{API}/auth/link", extra_environ={"REMOTE_ADDR": "192.168.1.5"})
        assert app.app.service.state.read()["setupComplete"]

    @pytest.mark.parametrize(
        ("peer", "home"),
        [
            ("127.0.0.1", True),
            ("127.8.9.10", True),
            ("::1", True),
            ("10.1.2.3", True),
            ("172.16.5.4", True),
            ("172.31.255.254", True),
            ("172.32.0.1", False),
            ("192.168.1.5", True),
            ("100.64.1.2", True),  # a tailnet
            ("100.127.255.254", True),
            ("100.128.0.1", False),
            ("169.254.3.4", True),
            ("fd00::1", True),
            ("fe80::1", True),
            ("::ffff:192.168.1.5", True),  # IPv4-mapped, unwrapped
            ("::ffff:203.0.113.5", False),
            ("2a01:4f8::1", False),  # a global IPv6 address is not home
            ("203.0.113.5", False),
            ("8.8.8.8", False),
            ("", False),  # no peer at all: not local
        ],
    )
    def test_home_ranges_decide_by_the_peer(self, make_app, peer, home):
        app = make_app()
        key = key_of(app)
        env = {"REMOTE_ADDR": peer} if peer else {}
        p = data(app.get(f"{API}/system/setup", headers={"Host": "127.0.0.1"}, extra_environ=env))
        assert (p["apiKey"] == key) is home
        assert p["setupHere"]["allowed"] is home
        assert p["browserSetup"] is home
        if not home:
            assert p["setupHere"]["reason"] == "remote"

    @pytest.mark.parametrize(
        "header",
        [
            ("X-Forwarded-For", "127.0.0.1"),
            ("Forwarded", "for=127.0.0.1"),
            ("X-Real-IP", "127.0.0.1"),
            ("X-Forwarded-Host", "127.0.0.1"),
            ("X-Forwarded-Proto", "http"),
            ("Via", "1.1 tunnel"),
            ("CF-Connecting-IP", "127.0.0.1"),
            ("True-Client-IP", "127.0.0.1"),
        ],
    )
    def test_a_forwarding_header_from_an_untrusted_peer_is_not_local(self, make_app, header):
        """A proxy or tunnel nobody named in SERVICE_TRUST_PROXY: whoever it carries, the
        loopback peer is not the client."""
        app = make_app()
        key = key_of(app)
        p = data(app.get(f"{API}/system/setup", headers=dict([header]), extra_environ=LOCAL))
        assert p["apiKey"] != key
        assert p["setupHere"] == {"allowed": False, "reason": "proxy"}
        resp = with_key(app).post(
            f"{API}/auth/link", headers=dict([header]), extra_environ=LOCAL, status=403
        )
        assert_error(resp, 403, "FORBIDDEN")

    @pytest.mark.parametrize(
        ("headers", "shown"),
        [
            ({"X-Forwarded-For": "203.0.113.5"}, False),
            ({"X-Forwarded-For": "192.168.1.5"}, True),
            ({"X-Forwarded-For": "192.168.1.5, 203.0.113.5"}, False),  # the left is the client's
            ({"X-Forwarded-For": "203.0.113.5, 127.0.0.1"}, False),  # a second trusted hop
            ({"X-Forwarded-For": "10.0.0.7, 127.0.0.1"}, True),
            ({"X-Forwarded-For": "unknown"}, False),
            ({"X-Forwarded-For": "127.0.0.1"}, True),  # a trusted proxy's client on loopback
            ({"X-Forwarded-For": "203.0.113.5, 127.0.0.1, 127.0.0.1"}, False),
            ({"Forwarded": 'for="[fd00::5]:4711";proto=https'}, True),
            ({"Forwarded": "for=203.0.113.5"}, False),
            ({"Forwarded": "for=_hidden"}, False),
            ({"X-Real-IP": "10.0.0.2"}, True),
            ({"X-Real-IP": "203.0.113.5"}, False),
            ({}, False),  # a trusted proxy that names no client
            ({"X-Forwarded-Proto": "https"}, False),
        ],
    )
    def test_a_trusted_proxy_names_the_client(self, make_app, headers, shown):
        app = make_app(SERVICE_TRUST_PROXY="127.0.0.1")
        key = key_of(app)
        hdrs = {"Host": "127.0.0.1", **headers}
        p = data(app.get(f"{API}/system/setup", headers=hdrs, extra_environ=LOCAL))
        assert (p["apiKey"] == key) is shown
        if not shown:
            assert p["setupHere"] == {"allowed": False, "reason": "remote"}

    def test_a_relayed_request_is_never_local(self, make_app):
        app = make_app()
        relayed = {**LOCAL, "notesvc.relayed": True}
        p = data(app.get(f"{API}/system/setup", extra_environ=relayed))
        assert p["apiKey"] != key_of(app)
        assert p["setupHere"] == {"allowed": False, "reason": "relayed"}
        assert_error(
            with_key(app).post(f"{API}/auth/link", extra_environ=relayed, status=403),
            403,
            "FORBIDDEN",
        )

    def test_local_only_narrows_to_loopback(self, make_app):
        app = make_app(SERVICE_SETUP_LOCAL_ONLY="true")
        home = {"REMOTE_ADDR": "192.168.1.7"}
        p = data(app.get(f"{API}/system/setup", extra_environ=home))
        assert p["setupHere"] == {"allowed": False, "reason": "loopback-only"}
        assert_error(
            with_key(app).post(f"{API}/auth/link", extra_environ=home, status=403), 403, "FORBIDDEN"
        )
        assert data(app.get(f"{API}/system/setup", extra_environ=LOCAL))["setupHere"]["allowed"]

    def test_the_key_is_offered_only_during_the_setup_window(self, make_app):
        app = make_app(SERVICE_SETUP_WINDOW="1")
        key = key_of(app)
        assert data(app.get(f"{API}/system/setup", extra_environ=LOCAL))["apiKey"] == key

        def closed() -> dict:
            p = data(app.get(f"{API}/system/setup", extra_environ=LOCAL))
            return p if p["setupHere"]["reason"] == "window" else {}

        p = wait_for(closed, timeout=5)
        assert p["apiKey"] == "nsk_…" + key[-4:]
        assert p["browserSetup"] is False
        err = assert_error(
            with_key(app).post(f"{API}/auth/link", extra_environ=LOCAL, status=403),
            403,
            "FORBIDDEN",
        )
        assert "restart" in err["message"]
        assert "pair" in err["message"]
        # A start opens it again (the window runs from the start).
        assert data(make_app().get(f"{API}/system/setup", extra_environ=LOCAL))["apiKey"] == key
        never = make_app(SERVICE_SETUP_WINDOW="0")
        assert data(never.get(f"{API}/system/setup", extra_environ=LOCAL))["apiKey"] != key

    @pytest.mark.parametrize(
        ("raw", "seconds"), [("1800", 1800), ("90s", 90), ("30m", 1800), ("2h", 7200), ("0", 0)]
    )
    def test_setup_window_values(self, root, raw, seconds):
        cfg = notesvc.load_config(env=make_env(root, SERVICE_SETUP_WINDOW=raw))
        assert cfg.setup_window == seconds
        assert notesvc.load_config(env=make_env(root)).setup_window == 1800

    @pytest.mark.parametrize("raw", ["soon", "-5", "30d", "m"])
    def test_setup_window_refuses_what_is_not_a_duration(self, root, raw):
        with pytest.raises(notesvc.ConfigError, match="SERVICE_SETUP_WINDOW"):
            notesvc.load_config(env=make_env(root, SERVICE_SETUP_WINDOW=raw))

    @pytest.mark.parametrize(
        ("mode", "own", "container", "loopback_only"),
        [
            ("auto", "203.0.113.7", False, True),  # a VPS: its neighbours are strangers
            ("auto", "192.168.1.20", False, False),  # a Pi at home
            ("auto", "10.0.0.4", False, False),
            ("auto", "100.101.102.103", False, False),  # on a tailnet
            ("auto", "[fd00::4]", False, False),
            ("auto", "[2a01:4f8::1]", False, True),
            ("auto", "", False, True),  # no network at all
            ("auto", "192.168.1.20", True, True),  # a container: all arrive via its gateway
            ("true", "192.168.1.20", False, True),
            ("false", "203.0.113.7", True, False),
        ],
    )
    def test_auto_mode_decides_from_this_machine(self, mode, own, container, loopback_only):
        assert notesvc.setup_loopback_only(mode, own, container) is loopback_only

    @pytest.mark.parametrize(
        ("raw", "mode"), [("", "false"), ("auto", "auto"), ("AUTO", "auto"), ("yes", "true")]
    )
    def test_setup_local_only_values(self, root, raw, mode):
        env = make_env(root, SERVICE_SETUP_LOCAL_ONLY=raw)
        assert notesvc.load_config(env=env).setup_local_only == mode
        env.pop("SERVICE_SETUP_LOCAL_ONLY")
        assert notesvc.load_config(env=env).setup_local_only == "auto"  # the default

    def test_no_route_but_the_setup_payload_shows_the_key_and_only_at_home(self, make_app):
        """Every GET route, as a stranger and at home, with and without the key: the full
        setup key is in no answer but GET /system/setup's to the client at home."""
        app = make_app()
        key = key_of(app)
        put_note(with_key(app), "notes/a.md", "a")
        routes = [r for r in app.app.service.routes if r.method == "GET"]
        assert len(routes) > 30
        setup_rule = f"{API}/system/setup"
        for who, env in (("stranger", self.STRANGER), ("home", LOCAL)):
            for creds in ({}, {"X-Service-Key": key}):
                for r in routes:
                    url = sample_url(r)
                    resp = app.get(url, headers=creds, extra_environ=env, status="*")
                    seen = resp.body + str(resp.headers).encode()
                    if r.rule == setup_rule and who == "home":
                        assert key.encode() in seen
                    else:
                        assert key.encode() not in seen, f"{who} {r.method} {r.rule}"

    def test_the_page_says_why_it_cannot_set_up_here(self):
        """The web client shows setupHere's reason and what to do (pair, rotate-key)."""
        devices = (HERE / "web" / "devices.js").read_text()
        assert "setupHere" in devices
        for reason in ("remote", "loopback-only", "relayed", "proxy", "window", "host"):
            assert re.search(rf'(?:"{reason}"|\b{reason}):', devices), reason
        assert "python3 notesvc.py pair" in devices
        assert "python3 notesvc.py rotate-key" in devices
        assert 'id="setup-elsewhere"' in (HERE / "web" / "app.html").read_text()

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_a_real_server_judges_the_client_a_trusted_proxy_names(self, tmp_path):
        """S1 on a real server behind a (loopback) proxy it trusts: the forwarded address
        decides, whatever Host says."""
        setup, link = f"{API}/system/setup", f"{API}/auth/link"
        env = {"SERVICE_TRUST_PROXY": "127.0.0.1"}
        with running(tmp_path / "root", env=env) as server:
            stranger = {"X-Forwarded-For": "203.0.113.5", "Host": "127.0.0.1"}
            home = {"X-Forwarded-For": "192.168.1.5", "Host": "127.0.0.1"}
            key = server.request("GET", setup, headers=home)[2]["data"]["apiKey"]
            assert re.fullmatch(r"nsk_[A-Za-z0-9_-]{43}", key)
            for headers in (stranger, {"Host": "localhost"}):  # the latter names no client
                status, _, body = server.request("GET", setup, headers=headers)
                assert status == 200
                assert body["data"]["apiKey"] == "nsk_…" + key[-4:]
                assert body["data"]["setupHere"] == {"allowed": False, "reason": "remote"}
                assert key not in json.dumps(body)
            status, _, body = server.request("POST", link, headers={**stranger, KEY: key})
            assert status == 403
            assert body["error"]["code"] == "FORBIDDEN"
            assert "run `pair` on the server" in body["error"]["message"]
            assert not server.request("GET", setup, headers=home)[2]["data"]["setupComplete"]
            status, _, body = server.request("GET", f"{API}/notes", headers={**stranger, KEY: key})
            assert status == 200  # the key itself works from anywhere; setup waits
            status, _, body = server.request("POST", link, headers={**home, KEY: key})
            assert status == 200
            assert server.request("GET", setup, headers=home)[2]["data"]["setupComplete"]

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_a_real_server_trusts_no_forwarding_header_by_default(self, tmp_path):
        with running(tmp_path / "root") as server:
            setup = f"{API}/system/setup"
            key = server.request("GET", setup)[2]["data"]["apiKey"]
            assert re.fullmatch(r"nsk_[A-Za-z0-9_-]{43}", key)  # loopback, no header: local
            for forwarded in ({"X-Forwarded-For": "127.0.0.1"}, {"Via": "1.1 tunnel"}):
                body = server.request("GET", setup, headers=forwarded)[2]
                assert body["data"]["apiKey"] != key
                assert body["data"]["setupHere"]["reason"] == "proxy"

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_rotate_key_on_the_server_completes_setup(self, make_app, root):
        app = make_app()
        out = run_cli("rotate-key", "--root", str(root))
        assert out.returncode == 0, out.stderr
        new = out.stdout.strip()
        assert "Setup is complete" in out.stderr
        st = app.app.service.state.read()
        assert st["setupComplete"] is True
        assert "apiKey" not in st  # kept hashed only
        assert st["keyHash"] == notesvc.key_hash(new)
        p = data(app.get(f"{API}/system/setup", extra_environ=LOCAL))
        assert p["setupComplete"] is True
        assert p["apiKey"] == "nsk_…" + new[-4:]
        assert data(with_key(app, new).post(f"{API}/auth/verify"))["valid"]

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_claiming_an_admin_pairing_made_by_pair_completes_setup(self, make_app, root):
        app = make_app()
        state = app.app.service.state
        # an admin pairing made over the API with the setup key does not (link does)
        made = data(with_key(app).post_json(f"{API}/auth/devices/pairings", {"scope": "admin"}))
        claim(app, made["secret"], **self.STRANGER)
        assert not state.read()["setupComplete"]
        for scope, done in (("write", False), ("admin", True)):
            out = run_cli("pair", "--root", str(root), "--scope", scope)
            assert out.returncode == 0, out.stderr
            secret = re.search(r"#pair=([a-z2-7]+)", out.stdout).group(1)
            claim(app, secret, **self.STRANGER)  # made on the server: claimed from anywhere
            assert bool(state.read()["setupComplete"]) is done, scope
        assert "apiKey" not in state.read()

    @pytest.mark.real_server
    @pytest.mark.slow
    @pytest.mark.parametrize(
        "env",
        [
            {"SERVICE_HOST": "0.0.0.0"},
            {"SERVICE_HOST": "127.0.0.1", "SERVICE_RELAY_URL": "https://relay.example.org"},
        ],
    )
    def test_the_audit_command_calls_an_unfinished_reachable_setup_critical(
        self, make_app, root, env
    ):
        make_app()  # a fresh root: setup incomplete
        out = run_cli("audit", "--root", str(root), env=env)
        assert out.returncode == 1, out.stdout + out.stderr  # a critical finding
        assert "!! [critical] Setup is not complete on a reachable server (setup-exposed)" in (
            out.stdout
        )
        assert "pair" in out.stdout

    def test_server_id_and_key_survive_restart(self, make_app, root):
        first = data(make_app().get(f"{API}/system/setup", extra_environ=LOCAL))
        second = data(make_app().get(f"{API}/system/setup", extra_environ=LOCAL))
        assert first["serverId"] == second["serverId"]
        assert first["apiKey"] == second["apiKey"]
        assert first["pairing"]["relayCode"] == second["pairing"]["relayCode"]


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


PROTECTED_ROUTES = [r for r in notesvc.ROUTES if not r.public]


PUBLIC_ROUTES = [r for r in notesvc.ROUTES if r.public]


def refuses_missing_and_wrong_key(anon, method: str, rule: str) -> None:
    wrong = with_key(anon, "nsk_" + "A" * 43)
    for app, who in ((anon, "no key"), (wrong, "a wrong key")):
        resp = app.request(sample_url(rule), method=method, status="*", expect_errors=True)
        assert resp.status_int == 401, f"{method} {rule} with {who}: {resp.status}"
        if anon.app.answers_jsonrpc(rule):  # /mcp answers JSON-RPC: the same refusal, its shape
            assert resp.json["error"]["data"] == {"status": 401, "code": "UNAUTHORIZED"}
        else:
            assert_error(resp, 401, "UNAUTHORIZED")


class TestAuth:
    def test_the_route_table_has_protected_and_public_routes(self):
        assert len(PROTECTED_ROUTES) >= 5
        assert PUBLIC_ROUTES

    @pytest.mark.parametrize("route", PROTECTED_ROUTES, ids=route_id)
    def test_every_protected_route_refuses_missing_and_wrong_key(self, anon, route):
        refuses_missing_and_wrong_key(anon, route.method, route.rule)

    @pytest.mark.slow
    def test_every_documented_secured_operation_refuses_missing_and_wrong_key(self, make_app):
        """Routes from outside the table too (plugins, providers): as the OpenAPI says."""
        doc = make_app().get(f"{API}/openapi.json").json
        secured = [
            (method.upper(), re.sub(r"\{(\w+)\}", r"<\1>", path))
            for path, operations in doc["paths"].items()
            for method, op in operations.items()
            if op.get("security", doc["security"])
        ]
        assert len(secured) >= len(PROTECTED_ROUTES) + 3  # and the built-in plugins' routes
        for method, rule in secured:
            refuses_missing_and_wrong_key(make_app(), method, rule)  # a fresh app: no lockout

    @pytest.mark.parametrize("route", PUBLIC_ROUTES, ids=route_id)
    def test_public_routes_need_no_key(self, anon, route):
        resp = anon.request(sample_url(route), method=route.method, expect_errors=True)
        assert resp.status_int != 401, route_id(route)
        assert anon.get(f"{API}/health").status_int == 200

    def test_verify_returns_identity(self, client):
        d = data(client.post(f"{API}/auth/verify"))
        assert d == {
            "valid": True,
            "serverId": client.app.service.state.read()["serverId"],
            "setupComplete": False,
        }

    def test_link_records_clients_and_repeats_fine(self, client, root):
        client.post_json(f"{API}/auth/link", {"clientName": "phone"}, extra_environ=LOCAL)
        client.post(f"{API}/auth/link", extra_environ=LOCAL)
        state = json.loads((root / ".notesvc" / "state.json").read_text())
        assert [c["name"] for c in state["linkedClients"]] == ["phone", "unnamed client"]
        assert state["setupComplete"] is True
        assert "apiKey" not in state
        assert len(state["keyHash"]) == 64

    @pytest.mark.parametrize("body", [{"clientName": 5}, {"clientName": "x" * 101}])
    def test_link_rejects_bad_client_name(self, client, body):
        assert_error(
            client.post_json(f"{API}/auth/link", body, status=400, extra_environ=LOCAL),
            400,
            "VALIDATION_ERROR",
        )

    def test_state_file_is_private(self, client, root):
        client.post(f"{API}/auth/link", extra_environ=LOCAL)
        folder = root / ".notesvc"
        assert stat.S_IMODE(os.stat(folder / "state.json").st_mode) == 0o600
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700

    def test_rotate_replaces_the_key_and_keeps_the_derived_relay_code(self, anon, client):
        st = anon.app.service.state.read()
        old_code = st["relayCode"]
        assert old_code == notesvc.relay_code_of(st["relayToken"])  # it finds, it opens nothing
        new = data(client.post(f"{API}/auth/rotate"))
        assert re.fullmatch(r"nsk_[A-Za-z0-9_-]{43}", new["apiKey"])
        assert new["relayCode"] == old_code
        assert_error(client.post(f"{API}/auth/verify", status=401), 401, "UNAUTHORIZED")
        assert data(with_key(anon, new["apiKey"]).post(f"{API}/auth/verify"))["valid"]

    def test_lockout_after_ten_failures(self, anon):
        wrong = with_key(anon, "nsk_wrong")
        for _ in range(10):
            wrong.post(f"{API}/auth/verify", status=401)
        resp = wrong.post(f"{API}/auth/verify", status=429)
        assert_error(resp, 429, "RATE_LIMITED")
        assert 1 <= int(resp.headers["Retry-After"]) <= 60
        # Locked out means locked out, even with the right key ...
        with_key(anon).post(f"{API}/auth/verify", status=429)
        # ... but only for that address.
        with_key(anon).post(f"{API}/auth/verify", extra_environ={"REMOTE_ADDR": "10.9.9.9"})

    def test_a_spray_of_addresses_keeps_the_lockout_small(self):
        now = [0.0]
        lockout = notesvc.Lockout(clock=lambda: now[0], tracked=100)
        for i in range(1000):  # every address fresh, none ever stale
            lockout.fail(f"10.0.{i // 250}.{i % 250}")
            now[0] += 0.001
        assert len(lockout._fails) <= 100
        for _ in range(10):  # a real attacker is still locked out
            lockout.fail("192.0.2.1")
        assert lockout.retry_after("192.0.2.1") > 0

    def test_requests_without_a_credential_never_count(self, anon):
        for _ in range(15):
            assert_error(anon.post(f"{API}/auth/verify", status=401), 401, "UNAUTHORIZED")
        with_key(anon).post(f"{API}/auth/verify")

    def test_success_clears_the_failures_of_its_address(self, anon):
        wrong, right = with_key(anon, "nsk_wrong"), with_key(anon)
        for _ in range(2):
            for _ in range(9):
                wrong.post(f"{API}/auth/verify", status=401)
            right.post(f"{API}/auth/verify")
        wrong.post(f"{API}/auth/verify", status=401)

    def test_locked_out_address_gets_401_without_a_credential(self, anon):
        for _ in range(10):
            with_key(anon, "nsk_wrong").post(f"{API}/auth/verify", status=401)
        assert_error(anon.post(f"{API}/auth/verify", status=401), 401, "UNAUTHORIZED")
        resp = with_key(anon).post(f"{API}/auth/verify", status=429)
        assert 1 <= int(resp.headers["Retry-After"]) <= 60

    def test_relayed_clients_have_their_own_buckets(self, anon):
        relayed = {"notesvc.relayed": True, "REMOTE_ADDR": ""}
        for _ in range(10):
            with_key(anon, "nsk_wrong").post(
                f"{API}/auth/verify", status=401, extra_environ=relayed
            )
        with_key(anon).post(f"{API}/auth/verify", status=429, extra_environ=relayed)
        with_key(anon).post(f"{API}/auth/verify")  # WebTest's own (empty) peer address
        local = {"notesvc.relayed": True, "REMOTE_ADDR": "127.0.0.1"}
        with_key(anon).post(f"{API}/auth/verify", extra_environ=local)
        cfg = anon.app.service.config
        assert notesvc.client_address(cfg, relayed) == "relay:?"
        assert notesvc.client_address(cfg, local) == "relay:127.0.0.1"

    @pytest.mark.parametrize(
        ("peer", "forwarded", "client"),
        [
            ("10.0.0.2", "198.51.100.1, 203.0.113.4, 10.0.0.3", "203.0.113.4"),
            ("10.0.0.2", "203.0.113.4:5555", "203.0.113.4"),
            ("10.0.0.2", "10.0.0.9, 10.0.0.3", "10.0.0.9"),  # only proxies: the farthest
            ("10.0.0.2", "", "10.0.0.2"),
            ("10.0.0.2", "unknown", "10.0.0.2"),
            ("10.0.0.2", "[2001:db8::7]:80", "2001:db8::7"),
            ("192.0.2.1", "203.0.113.4", "192.0.2.1"),  # an untrusted peer's claim counts nothing
        ],
    )
    def test_client_address_behind_trusted_proxies(self, peer, forwarded, client):
        cfg = notesvc.load_config(env={"SERVICE_TRUST_PROXY": "10.0.0.0/8, ::1"})
        assert cfg.trust_proxy == ("10.0.0.0/8", "::1/128")
        environ = {"REMOTE_ADDR": peer, "HTTP_X_FORWARDED_FOR": forwarded}
        assert notesvc.client_address(cfg, environ) == client

    def test_trust_proxy_setting_forms(self, make_app):
        load = notesvc.load_config
        assert load(env={}).trust_proxy == ()
        assert load(env={"SERVICE_TRUST_PROXY": "true"}).trust_proxy == ("127.0.0.0/8", "::1/128")
        assert load(env={"SERVICE_TRUST_PROXY": "192.0.2.5"}).trust_proxy == ("192.0.2.5/32",)
        app = with_key(make_app(SERVICE_TRUST_PROXY="true"))
        assert data(app.get(f"{API}/system/config"))["server"]["trustProxy"] == [
            "127.0.0.0/8",
            "::1/128",
        ]
        network = data(app.get(f"{API}/security/config"))["network"]
        assert network["trustProxy"] == ["127.0.0.0/8", "::1/128"]

    def test_lockout_window_and_expiry(self):
        now = [1000.0]
        lock = notesvc.Lockout(limit=3, window=60, clock=lambda: now[0])
        lock.fail("a")
        lock.fail("a")
        now[0] += 61  # old failures fall out of the window
        lock.fail("a")
        assert lock.retry_after("a") == 0
        lock.fail("a")
        lock.fail("a")
        assert lock.retry_after("a") == 60
        now[0] += 30
        assert lock.retry_after("a") == 30
        now[0] += 31
        assert lock.retry_after("a") == 0

    def test_auth_mode_none_needs_no_key(self, make_app):
        app = make_app(SERVICE_AUTH_MODE="none")
        assert data(app.get(f"{API}/system/info"))["version"] == notesvc.__version__
        assert data(app.get(f"{API}/system/setup"))["auth"]["method"] == "none"

    def test_a_near_miss_key_is_refused(self, anon):
        key = key_of(anon)
        other = lambda c: "A" if c != "A" else "B"  # noqa: E731
        for near in (
            key[:-1] + other(key[-1]),  # only the last character differs
            other(key[0]) + key[1:],  # only the first
            key[:-1],  # a prefix
            key + "A",  # the key and more
            key.upper() if key.upper() != key else key.lower(),
            f" {key}",
        ):
            verify = with_key(anon, near).post(
                f"{API}/auth/verify", status=401, extra_environ={"REMOTE_ADDR": "10.1.1.1"}
            )
            assert_error(verify, 401, "UNAUTHORIZED")
            anon.post(f"{API}/auth/verify", status=401)  # and without a key: nothing leaks
        assert data(with_key(anon).post(f"{API}/auth/verify"))["valid"] is True

    @pytest.mark.slow
    def test_key_check_takes_as_long_however_much_of_the_key_is_right(self, anon):
        """Wrong keys sharing all but the last character with the real key are refused as
        fast as keys wrong from the first character: nothing to learn from the timing.

        Medians over many interleaved pairs, each from a fresh address (no lockout), with a
        generous bound so it never flakes on a loaded machine. What it can see: an early-exit
        comparison doing >= 0.5 us of work per matching character fails it; a plain `==` on
        the key (nanoseconds per character) is below what timing through the app can show.
        """
        key = key_of(anon)
        alphabet = [c for c in string.ascii_letters + string.digits if c not in key[-1] + key[4]]
        trials = 1000
        wsgi = anon.app

        def timed_verify(candidate: str, n: int) -> int:
            addr = f"10.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}"
            req = webtest.TestRequest.blank(
                f"{API}/auth/verify",
                method="POST",
                headers={"X-Service-Key": candidate},
                environ={"REMOTE_ADDR": addr},
            )
            started = time.perf_counter_ns()
            resp = req.get_response(wsgi)
            took = time.perf_counter_ns() - started
            assert resp.status_int == 401
            return took

        for n in range(20):  # warm up
            timed_verify(key[:-1] + alphabet[n % len(alphabet)], 100_000 + n)
        late, early, diffs = [], [], []
        for n in range(trials):
            c = alphabet[n % len(alphabet)]
            near = key[:-1] + c  # right up to the last character
            far = key[:4] + c + key[5:]  # wrong at the first character after "nsk_"
            if n % 2:
                t_near, t_far = timed_verify(near, 2 * n), timed_verify(far, 2 * n + 1)
            else:
                t_far, t_near = timed_verify(far, 2 * n + 1), timed_verify(near, 2 * n)
            late.append(t_near)
            early.append(t_far)
            diffs.append(t_near - t_far)
        median = statistics.median(late + early)
        shift = statistics.median(diffs)
        ratio = statistics.median(late) / statistics.median(early)
        assert abs(shift) < 0.25 * median, (shift, median)
        assert 0.8 < ratio < 1.25, ratio

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_rotate_key_cli_while_serving(self, anon, root):
        old = key_of(anon)
        client = with_key(anon, old)
        client.post_json(f"{API}/auth/link", {"clientName": "laptop"}, extra_environ=LOCAL)
        out = run_cli("rotate-key", "--root", str(root))
        assert out.returncode == 0, out.stderr
        new = out.stdout.strip()
        assert re.fullmatch(r"nsk_[A-Za-z0-9_-]{43}", new)
        # The running app sees the new key at once; the old one is refused.
        client.post(f"{API}/auth/verify", status=401)
        fresh = with_key(anon, new)
        assert data(fresh.post(f"{API}/auth/verify"))["setupComplete"] is True
        # A later write by the running app keeps the new key.
        fresh.post_json(f"{API}/auth/link", {"clientName": "tablet"}, extra_environ=LOCAL)
        state = json.loads((root / ".notesvc" / "state.json").read_text())
        assert state["keyHash"] == notesvc.key_hash(new)
        assert [c["name"] for c in state["linkedClients"]] == ["laptop", "tablet"]
        # The setup payload never shows the rotated key once setup is complete.
        assert new not in anon.get(f"{API}/system/setup").text


JWT_SECRET = "k3y-" + "Zq8vN2xR7mL4pT9wB5cJ1hF6dG0sY3aE"


def forge(claims: dict, header: dict | None = None, secret: str = JWT_SECRET, digest=None) -> str:
    import base64
    import hashlib
    import hmac

    def b64(obj) -> str:
        raw = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    head = b64(header or {"alg": "HS256", "typ": "JWT"})
    body = b64(claims)
    sig = hmac.new(secret.encode(), f"{head}.{body}".encode(), digest or hashlib.sha256)
    return f"{head}.{body}.{b64(sig.digest())}"


def bearer(app: webtest.TestApp, token: str) -> webtest.TestApp:
    return webtest.TestApp(app.app, extra_environ={"HTTP_AUTHORIZATION": f"Bearer {token}"})


class TestJwt:
    @pytest.fixture
    def app(self, make_app):
        return make_app(SERVICE_AUTH_MODE="jwt", SERVICE_JWT_SECRET=JWT_SECRET)

    def bearer(self, app, token, status=200):
        return app.post(
            f"{API}/auth/verify", headers={"Authorization": f"Bearer {token}"}, status=status
        )

    def claims(self, app, **over):
        now = int(time.time())
        kid = app.app.service.state.read()["keyHash"][:16]
        return {"sub": "owner", "iat": now, "nbf": now, "exp": now + 600, "kid": kid, **over}

    def test_issued_token_works_and_key_still_does(self, app):
        token = data(with_key(app).post(f"{API}/auth/token"))
        assert token["tokenType"] == "Bearer"
        assert token["expiresIn"] == 3600
        assert data(self.bearer(app, token["token"]))["valid"] is True
        assert data(with_key(app).post(f"{API}/auth/verify"))["valid"] is True

    def test_hand_made_valid_token_is_accepted(self, app):
        self.bearer(app, forge(self.claims(app)))

    @pytest.mark.parametrize(
        "case",
        [
            "expired",
            "not-yet-valid",
            "tampered",
            "alg-none",
            "hs512",
            "wrong-secret",
            "no-exp",
            "garbage",
            "old-key",
        ],
    )
    def test_bad_tokens_are_refused(self, app, case):
        now = int(time.time())
        claims = self.claims(app)
        if case == "expired":
            token = forge({**claims, "exp": now - 31})
        elif case == "not-yet-valid":
            token = forge({**claims, "nbf": now + 31})
        elif case == "tampered":
            head, _, sig = forge(claims).split(".")
            other = forge({**claims, "sub": "admin"}).split(".")[1]
            token = f"{head}.{other}.{sig}"
        elif case == "alg-none":
            token = forge(claims, {"alg": "none", "typ": "JWT"}).rsplit(".", 1)[0] + "."
        elif case == "hs512":
            import hashlib

            token = forge(claims, {"alg": "HS512", "typ": "JWT"}, digest=hashlib.sha512)
        elif case == "wrong-secret":
            token = forge(claims, secret="another-secret-of-enough-length-000")
        elif case == "no-exp":
            token = forge({k: v for k, v in claims.items() if k != "exp"})
        elif case == "garbage":
            token = "not.a.jwt"
        else:  # a token from before a key rotation
            token = forge(claims)
            with_key(app).post(f"{API}/auth/rotate")
        assert_error(self.bearer(app, token, 401), 401, "UNAUTHORIZED")

    def test_token_cannot_mint_tokens_or_rotate_the_key(self, app):
        token = data(with_key(app).post(f"{API}/auth/token"))["token"]
        bearer = {"Authorization": f"Bearer {token}"}
        assert data(app.get(f"{API}/system/info", headers=bearer))["version"]
        for path in ("/auth/token", "/auth/rotate"):
            assert_error(app.post(f"{API}{path}", headers=bearer, status=403), 403, "FORBIDDEN")
        assert data(self.bearer(app, token))["valid"] is True  # still the same key
        key_only = {(r.method, r.path) for r in app.app.service.routes if r.key_only}
        assert key_only == {("POST", "/auth/token"), ("POST", "/auth/rotate")}
        assert data(with_key(app).post(f"{API}/auth/rotate"))["apiKey"]

    def test_leeway_of_30_seconds(self, app):
        now = int(time.time())
        self.bearer(app, forge(self.claims(app, exp=now - 20)))
        self.bearer(app, forge(self.claims(app, nbf=now + 20)))

    def test_token_endpoint_refuses_outside_jwt_mode(self, client):
        assert_error(client.post(f"{API}/auth/token", status=403), 403, "FORBIDDEN")

    def test_bearer_is_ignored_in_api_key_mode(self, anon):
        token = forge({"exp": time.time() + 60})
        resp = anon.post(
            f"{API}/auth/verify", headers={"Authorization": f"Bearer {token}"}, status=401
        )
        assert_error(resp, 401, "UNAUTHORIZED")


def new_grant(client, scope: str = "read", folder: str | None = None, **extra) -> dict:
    """Create a scoped key with the API key; return its record (with the key)."""
    body = {"name": f"{scope} key", "scope": scope, **extra}  # extra may name it
    if folder is not None:
        body["folder"] = folder
    return data(client.post_json(f"{API}/auth/keys", body, status=201))


def as_key(app: webtest.TestApp, key: str, **environ: str) -> webtest.TestApp:
    return webtest.TestApp(app.app, extra_environ={"HTTP_X_SERVICE_KEY": key, **environ})


def all_routes(app: webtest.TestApp) -> list:
    return list(app.app.service.routes)


SCOPED_ROUTES = [r for r in notesvc.ROUTES if not r.public]


@pytest.fixture(scope="module")
def scope_keys(tmp_path_factory):
    """One app for the scope tests, with a read and a write key (no lockout)."""
    cfg = notesvc.load_config(
        env=make_env(tmp_path_factory.mktemp("scopes") / "root", SERVICE_HOST="127.0.0.1")
    )
    wsgi = notesvc.create_app(cfg)
    wsgi.service.lockout = notesvc.Lockout(limit=10**9)
    owner = webtest.TestApp(
        wsgi, extra_environ={"HTTP_X_SERVICE_KEY": wsgi.service.state.read()["apiKey"]}
    )
    made = {s: new_grant(owner, s)["key"] for s in ("read", "write")}
    yield wsgi, made
    wsgi.service.close()


class TestGrantScopes:
    """Every route declares its scope; a grant gets exactly as far as its scope."""

    def test_every_route_declares_a_scope(self, anon):
        for r in all_routes(anon):
            assert r.public or r.scope in notesvc.SCOPES, f"{r.method} {r.rule}"
        plugin = [r for r in all_routes(anon) if r.rule.startswith(f"{API}/plugins/")]
        assert {r.scope for r in plugin} >= {"read", "write"}

    def test_a_route_without_a_scope_stops_the_app(self, root):
        cfg = notesvc.load_config(env=make_env(root))
        svc = notesvc.build_service(cfg)
        try:
            unscoped = notesvc.Route("GET", "/unscoped", lambda svc: {})
            with pytest.raises(notesvc.ConfigError, match="GET /api/v1/unscoped"):
                notesvc.NotesApp(svc, (*notesvc.ROUTES, unscoped))
            notesvc.NotesApp(svc, (*notesvc.ROUTES, dataclasses.replace(unscoped, public=True)))
        finally:
            svc.close()

    def test_a_plugin_route_without_a_scope_is_admin(self):
        route = notesvc.PluginRoute("GET", "/x", lambda svc: {})
        assert notesvc.plugin_routes([notesvc.Plugin("p", routes=(route,))])[0].scope == "admin"

    def test_openapi_shows_each_scope(self, anon):
        doc = anon.get(f"{API}/openapi.json").json
        for r in all_routes(anon):
            if r.api:
                op = doc["paths"][notesvc.openapi_path(r.rule)][r.method.lower()]
                assert op.get("x-scope") == (None if r.public else r.scope), route_id(r)

    @pytest.mark.parametrize("route", SCOPED_ROUTES, ids=route_id)
    def test_a_read_key_is_refused_above_read(self, scope_keys, route):
        wsgi, made = scope_keys
        app = webtest.TestApp(wsgi, extra_environ={"HTTP_X_SERVICE_KEY": made["read"]})
        resp = app.request(sample_url(route), method=route.method, expect_errors=True)
        if route.scope == "read":
            assert resp.status_int != 403, resp.text
            return
        err = assert_error(resp, 403, "FORBIDDEN")
        assert route.scope in err["message"]

    @pytest.mark.parametrize("route", SCOPED_ROUTES, ids=route_id)
    def test_a_write_key_is_refused_on_admin_routes(self, scope_keys, route):
        wsgi, made = scope_keys
        app = webtest.TestApp(wsgi, extra_environ={"HTTP_X_SERVICE_KEY": made["write"]})
        resp = app.request(sample_url(route), method=route.method, expect_errors=True)
        assert (resp.status_int == 403) == (route.scope == "admin"), resp.text

    def test_plugin_routes_follow_their_scope(self, scope_keys):
        wsgi, made = scope_keys
        reader = webtest.TestApp(wsgi, extra_environ={"HTTP_X_SERVICE_KEY": made["read"]})
        for r in wsgi.service.routes:
            if r.rule.startswith(f"{API}/plugins/") and r not in notesvc.ROUTES:
                resp = reader.request(sample_url(r), method=r.method, expect_errors=True)
                assert (resp.status_int == 403) == (r.scope != "read"), route_id(r)

    def test_a_plugin_page_shows_only_what_its_scope_allows(self, make_app, root):
        folder = root / ".notesvc" / "plugins"
        folder.mkdir(parents=True)
        (folder / "secret.py").write_text(
            "import notesvc\n"
            "def everything(svc):\n"
            "    return {'paths': svc.index.paths()}\n"
            "PLUGIN = notesvc.Plugin(name='secret', routes=(notesvc.PluginRoute('GET', '', "
            "everything),))\n"
        )
        client = with_key(make_app())
        put_note(client, "notes/work/w.md", "w")
        assert data(client.get(f"{API}/plugins/secret"))["paths"] == ["notes/work/w.md"]
        for grant in (new_grant(client, "write"), new_grant(client, "read", "notes/family")):
            page = data(as_key(client, grant["key"]).get(f"{API}/plugins/secret"))
            assert "paths" not in page
        tags = data(
            as_key(client, new_grant(client, "read", "notes/x")["key"]).get(f"{API}/plugins/tags")
        )
        assert tags["tags"] == []  # a built-in page filters itself

    def test_the_api_key_and_a_jwt_hold_admin(self, make_app):
        secret = "s" * 48
        app = make_app(SERVICE_AUTH_MODE="jwt", SERVICE_JWT_SECRET=secret)
        token = data(with_key(app).post(f"{API}/auth/token"))["token"]
        bearer = webtest.TestApp(app.app, extra_environ={"HTTP_AUTHORIZATION": f"Bearer {token}"})
        assert data(bearer.get(f"{API}/auth/keys"))["keys"] == []
        assert data(with_key(app).get(f"{API}/security/config"))["grants"]["key"] == 0


class TestScopedKeys:
    def test_create_shows_the_key_once_and_stores_its_hash(self, client, root):
        rec = new_grant(client, "write", "notes/family", expiresInDays=30)
        assert re.fullmatch(r"nsg_[A-Za-z0-9_-]{43}", rec["key"])
        assert set(rec) == {
            "id",
            "name",
            "scope",
            "folder",
            "createdAt",
            "expiresAt",
            "key",
            "kind",
            "lastUsedAt",
        }
        assert (rec["scope"], rec["folder"], rec["kind"]) == ("write", "notes/family", "key")
        days = (notesvc._epoch(rec["expiresAt"]) - notesvc._epoch(rec["createdAt"])) / 86400
        assert round(days) == 30
        state = (root / ".notesvc" / "state.json").read_text()
        assert rec["key"] not in state
        assert hashlib.sha256(rec["key"].encode()).hexdigest() in state
        listed = data(client.get(f"{API}/auth/keys"))["keys"]
        assert [k["id"] for k in listed] == [rec["id"]]
        assert "key" not in listed[0]
        assert "keyHash" not in listed[0]
        assert rec["key"] not in client.get(f"{API}/auth/keys").text

    def test_a_key_works_as_header_and_as_bearer(self, client):
        key = new_grant(client)["key"]
        put_note(client, "notes/a.md", "apple")
        assert data(as_key(client, key).get(note_url("notes/a.md")))["content"] == "apple"
        bearer = webtest.TestApp(client.app, extra_environ={"HTTP_AUTHORIZATION": f"Bearer {key}"})
        assert data(bearer.get(note_url("notes/a.md")))["content"] == "apple"

    def test_verify_tells_a_key_its_scope(self, client):
        key = new_grant(client, "read", "notes/kids")["key"]
        d = data(as_key(client, key).post(f"{API}/auth/verify"))
        assert d["grant"] == {"kind": "key", "scope": "read", "folder": "notes/kids"}
        assert "grant" not in data(client.post(f"{API}/auth/verify"))

    def test_revoke_is_effective_at_once(self, client):
        rec = new_grant(client)
        reader = as_key(client, rec["key"])
        reader.get(f"{API}/notes", status=200)
        assert data(client.delete(f"{API}/auth/keys/{rec['id']}")) == {
            "id": rec["id"],
            "revoked": True,
        }
        assert_error(reader.get(f"{API}/notes", status=401), 401, "UNAUTHORIZED")
        assert_error(client.delete(f"{API}/auth/keys/{rec['id']}", status=404), 404, "NOT_FOUND")

    def test_an_expired_key_is_401_and_counts_toward_the_lockout(self, client, root):
        key = new_grant(client, expiresInDays=1)["key"]
        state_file = root / ".notesvc" / "state.json"
        state = json.loads(state_file.read_text())
        state["grants"][0]["expiresAt"] = "2020-01-01T00:00:00.000Z"
        state_file.write_text(json.dumps(state))  # another process may edit it too
        expired = as_key(client, key, REMOTE_ADDR="192.0.2.7")
        for _ in range(10):
            assert_error(expired.get(f"{API}/notes", status=401), 401, "UNAUTHORIZED")
        assert_error(expired.get(f"{API}/notes", status=429), 429, "RATE_LIMITED")

    def test_last_use_is_recorded(self, client):
        rec = new_grant(client)
        assert data(client.get(f"{API}/auth/keys"))["keys"][0]["lastUsedAt"] is None
        as_key(client, rec["key"]).get(f"{API}/notes")
        used = data(client.get(f"{API}/auth/keys"))["keys"][0]["lastUsedAt"]
        assert used
        assert used >= rec["createdAt"]
        svc = client.app.service
        svc.grants.flush(force=True)
        assert svc.state.read()["grants"][0]["lastUsedAt"] == used

    @pytest.mark.parametrize(
        "body",
        [
            {"name": "x", "scope": "admin"},
            {"name": "x", "scope": "everything"},
            {"name": "x"},
            {"scope": "read"},
            {"name": "", "scope": "read"},
            {"name": 5, "scope": "read"},
            {"name": "x" * 101, "scope": "read"},
            {"name": "x", "scope": "read", "folder": "../etc"},
            {"name": "x", "scope": "read", "folder": "notes/../x"},
            {"name": "x", "scope": "read", "folder": 7},
            {"name": "x", "scope": "read", "expiresInDays": 0},
            {"name": "x", "scope": "read", "expiresInDays": 3651},
            {"name": "x", "scope": "read", "expiresInDays": "7"},
            {"name": "x", "scope": "read", "expiresInDays": True},
        ],
    )
    def test_bad_key_requests_are_400(self, client, body):
        resp = client.post_json(f"{API}/auth/keys", body, status=400)
        assert_error(resp, 400, "VALIDATION_ERROR")

    def test_broken_and_huge_bodies(self, client):
        url = f"{API}/auth/keys"
        bad = client.post(url, "{nope", {"Content-Type": "application/json"}, status=400)
        assert_error(bad, 400, "VALIDATION_ERROR")
        assert_error(client.post(url, "x", status=415), 415, "UNSUPPORTED_MEDIA_TYPE")
        huge = json.dumps({"name": "x" * 2_000_000, "scope": "read"})
        big = client.post(url, huge, {"Content-Type": "application/json"}, status=413)
        assert_error(big, 413, "PAYLOAD_TOO_LARGE")

    def test_a_scoped_key_cannot_mint_keys_or_read_settings(self, client):
        key = new_grant(client, "write")["key"]
        writer = as_key(client, key)
        for method, url in (
            ("POST", f"{API}/auth/keys"),
            ("GET", f"{API}/auth/keys"),
            ("POST", f"{API}/auth/rotate"),
            ("GET", f"{API}/system/config"),
            ("GET", f"{API}/channels"),
        ):
            resp = writer.request(url, method=method, expect_errors=True)
            assert_error(resp, 403, "FORBIDDEN")

    def test_a_name_of_control_characters_is_cleaned(self, client):
        assert new_grant(client, name="\x07\x1b[31mtab\u2028")["name"] == "[31mtab"
        assert new_grant(client, name="\u200b\u2060")["name"] == "unnamed key"  # invisible
        body = {"name": "\x07\x08", "scope": "read"}  # blank: refused, as the schema says
        assert_error(
            client.post_json(f"{API}/auth/keys", body, status=400), 400, "VALIDATION_ERROR"
        )

    def test_the_owner_alone_lists_every_grant(self, client):
        new_grant(client, "read")
        new_grant(client, "write", "notes/x")
        kinds = collections.Counter(
            k["scope"] for k in data(client.get(f"{API}/auth/keys"))["keys"]
        )
        assert kinds == {"read": 1, "write": 1}
        assert data(client.get(f"{API}/security/config"))["grants"] == {
            "key": 2,
            "oauth": 0,
            "share": 0,
            "oauthClients": 0,
        }


def call(base: str, method: str, path: str, headers: dict | None = None, source="127.0.0.1"):
    """Return (status, parsed JSON body) for one request from a chosen loopback address."""
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(
        url.hostname, url.port, timeout=10, source_address=(source, 0)
    )
    try:
        conn.request(method, path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


def rpc(client, method: str, params: dict | None = None, status: int | str = 200, **headers):
    """POST one JSON-RPC request (handshake era) to /mcp; return the parsed answer."""
    body: dict = {"jsonrpc": "2.0", "id": 1, "method": method}
    if params is not None:
        body["params"] = params
    resp = client.post(
        f"{API}/mcp",
        json.dumps(body),
        headers={"Content-Type": "application/json", **headers},
        status=status,
        expect_errors=True,
    )
    return resp.json if resp.body else None


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


LISTING_CALLS = [
    ("GET", "/notes", None),
    ("GET", "/notes?folder=notes", None),
    ("GET", "/notes?folder=notes/family/sub", None),
    ("GET", "/folders/tree", None),
    ("GET", "/folders/tree/notes", None),
    ("GET", "/search?q=apple", None),
    ("GET", "/search?q=apple&folder=notes", None),
    ("GET", "/search?q=apple%20OR%20contract%20OR%20neighbour", None),
    ("GET", "/plugins/tags", None),
    ("GET", "/plugins/tags/common", None),
    ("GET", "/plugins/backlinks/notes%2Ffamily%2Fa.md", None),
    ("POST", "/agent/chat", {"message": "apple contract neighbour top"}),
    ("POST", "/agent/chat", {"message": "apple", "notePath": "notes/family/a.md"}),
    ("GET", "/shares", None),
    ("GET", "/attachments", None),
    ("GET", "/attachments?folder=attachments", None),
    ("GET", "/reminders", None),
    ("GET", "/trash", None),
    ("GET", "/changes?since=0", None),
    ("GET", "/folders/tree?depth=1", None),
    ("GET", "/folders/tree?depth=2", None),
]


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


class TestDevices:
    """Pairings and device keys: a one-time secret in a link's fragment, a key per device."""

    def test_a_pairing_is_a_one_time_link_and_its_qr_code(self, client, anon):
        made = pair(client, name="Anna's phone", scope="read", folder="notes/family")
        assert re.fullmatch(r"[a-z2-7]{26}", made["secret"])  # 128 bits
        assert made["url"] == f"http://localhost:80/#pair={made['secret']}"
        assert made["scope"] == "read"
        assert made["folder"] == "notes/family"
        expires = dt.datetime.fromisoformat(made["expiresAt"].replace("Z", "+00:00"))
        assert 590 <= (expires - dt.datetime.now(dt.timezone.utc)).total_seconds() <= 600
        if importlib.util.find_spec("segno"):
            assert made["qrSvg"].startswith("<svg")
        state = json.dumps(client.app.service.state.read())
        assert made["secret"] not in state  # only its SHA-256 is kept

    def test_claiming_gives_a_device_key_with_the_pairings_scope_and_folder(self, client, anon):
        put_note(client, "notes/family/list.md", "# List")
        put_note(client, "notes/work/plan.md", "# Plan")
        made = pair(client, name="Anna's phone", scope="write", folder="notes/family")
        got = claim(anon, made["secret"].upper(), name="Anna's\x07 Pixel")
        assert re.fullmatch(r"nsd_[A-Za-z0-9_-]{43}", got["key"])
        assert got["apiBase"] == f"http://localhost:80{API}"
        device = with_key(anon, got["key"])
        grant = data(device.post(f"{API}/auth/verify"))["grant"]
        assert grant == {
            "kind": "device",
            "scope": "write",
            "folder": "notes/family",
            "name": "Anna's Pixel",
        }
        assert data(device.get(note_url("notes/family/list.md")))["title"] == "List"
        assert_error(device.get(note_url("notes/work/plan.md"), status=404), 404, "NOT_FOUND")
        put_note(device, "notes/family/new.md", "mine")
        assert_error(device.get(f"{API}/auth/keys", status=403), 403, "FORBIDDEN")
        listed = [k for k in data(client.get(f"{API}/auth/keys"))["keys"] if k["kind"] == "device"]
        assert [(k["id"], k["name"], k["scope"]) for k in listed] == [
            (got["deviceId"], "Anna's Pixel", "write")
        ]
        assert listed[0]["lastUsedAt"]
        # used once: never again, for anyone
        assert_error(
            anon.post_json(f"{API}/auth/devices/claim", {"secret": made["secret"]}, status=404),
            404,
            "NOT_FOUND",
        )

    def test_a_secret_is_good_only_on_the_server_that_made_it(self, client, make_app, root):
        other = make_app(tmp_path_factory_root(root))
        made = pair(client)
        assert_error(claim(other, made["secret"], status=404), 404, "NOT_FOUND")
        claim(client, made["secret"])  # still good where it was made

    def test_a_revoked_device_is_out_on_its_next_request(self, client, anon):
        got = claim(anon, pair(client)["secret"])
        device = with_key(anon, got["key"])
        device.post(f"{API}/auth/verify")
        assert data(client.delete(f"{API}/auth/keys/{got['deviceId']}"))["revoked"]
        assert_error(device.post(f"{API}/auth/verify", status=401), 401, "UNAUTHORIZED")

    def test_an_admin_device_is_the_owner_but_for_the_key_itself(self, client, anon):
        got = claim(anon, pair(client, scope="admin")["secret"])
        device = with_key(anon, got["key"])
        assert data(device.post(f"{API}/auth/verify"))["grant"]["scope"] == "admin"
        data(device.get(f"{API}/auth/keys"))
        data(device.get(f"{API}/security/audit"))
        put_note(client, "notes/s.md")
        shared = data(client.post_json(f"{API}/shares", {"path": "notes/s.md"}))
        assert [s["id"] for s in data(device.get(f"{API}/shares"))["shares"]] == [shared["id"]]
        for url in (f"{API}/auth/rotate", f"{API}/auth/token"):
            assert_error(device.post(url, status=403), 403, "FORBIDDEN")

    @pytest.mark.parametrize(
        ("body", "status"),
        [
            ({"scope": "admin", "folder": "notes/family"}, 400),  # admin sees every note
            ({"scope": "owner"}, 400),
            ({"scope": "write", "folder": "notes/../etc"}, 400),
            ({"scope": "write", "name": 7}, 400),
        ],
    )
    def test_bad_pairings_are_refused(self, client, body, status):
        resp = client.post_json(f"{API}/auth/devices/pairings", body, status=status)
        assert_error(resp, status, "VALIDATION_ERROR")

    def test_only_the_admin_makes_pairings(self, client, anon):
        anon.post_json(f"{API}/auth/devices/pairings", {"scope": "read"}, status=401)
        for scope in ("read", "write"):
            key = with_key(anon, new_grant(client, scope)["key"])
            resp = key.post_json(f"{API}/auth/devices/pairings", {"scope": "read"}, status=403)
            assert "admin" in assert_error(resp, 403, "FORBIDDEN")["message"]
        writer = with_key(anon, claim(anon, pair(client, scope="write")["secret"])["key"])
        writer.post_json(f"{API}/auth/devices/pairings", {"scope": "read"}, status=403)

    def test_an_expired_secret_is_404(self, client, anon):
        made = pair(client)
        grants = client.app.service.grants
        grants.clock = lambda: time.time() + client.app.service.config.pairing_ttl + 1
        assert_error(claim(anon, made["secret"], status=404), 404, "NOT_FOUND")
        grants.clock = time.time  # gone for good: expired pairings are dropped
        assert_error(claim(anon, made["secret"], status=404), 404, "NOT_FOUND")

    def test_a_secret_in_a_url_is_refused_and_never_logged(self, client, anon, caplog):
        made = pair(client)
        caplog.set_level(logging.DEBUG)
        resp = anon.post_json(
            f"{API}/auth/devices/claim?secret={made['secret']}",
            {"secret": made["secret"]},
            status=400,
        )
        assert "body" in assert_error(resp, 400, "VALIDATION_ERROR")["message"]
        claim(anon, made["secret"])  # still good: the refused call used nothing up
        logged = "\n".join(r.getMessage() for r in caplog.records)
        assert made["secret"] not in logged
        assert made["secret"][:13] not in logged

    def test_guessing_secrets_locks_the_address_out(self, client, anon):
        made = pair(client)
        guesser = {"REMOTE_ADDR": "203.0.113.9"}
        for _ in range(10):
            claim(anon, "a" * 26, status=404, **guesser)
        resp = anon.post_json(
            f"{API}/auth/devices/claim",
            {"secret": made["secret"]},
            status=429,
            extra_environ=guesser,
        )
        assert_error(resp, 429, "RATE_LIMITED")
        assert int(resp.headers["Retry-After"]) >= 1
        claim(anon, made["secret"], **{"REMOTE_ADDR": "203.0.113.10"})  # others are not

    @pytest.mark.parametrize(
        ("env", "remote", "offered"),
        [
            ({}, "127.0.0.1", True),
            ({}, "192.168.1.20", True),
            ({}, "fd12::5", True),
            ({}, "203.0.113.5", False),  # beyond the home network
            ({"SERVICE_SETUP_LOCAL_ONLY": "true"}, "192.168.1.20", False),
            ({"SERVICE_SETUP_LOCAL_ONLY": "true"}, "127.0.0.1", True),
        ],
    )
    def test_the_browser_may_set_up_only_a_new_server_at_home(self, make_app, env, remote, offered):
        app = make_app(**env)
        setup = data(app.get(f"{API}/system/setup", extra_environ={"REMOTE_ADDR": remote}))
        assert setup["browserSetup"] is offered
        sid = setup["serverId"]  # through the /r/<id> prefix (a relay's path): never
        assert not data(
            app.get(f"/r/{sid}{API}/system/setup", extra_environ={"REMOTE_ADDR": remote})
        )["browserSetup"]
        with_key(app).post(f"{API}/auth/link", extra_environ=LOCAL)
        assert not data(app.get(f"{API}/system/setup"))["browserSetup"]


class TestTelegramConnect:
    """ "Connect Telegram": the token checked first, then a code that binds one chat."""

    @pytest.fixture
    def tg(self, make_app, upstream):
        return with_key(make_app(SERVICE_TELEGRAM_API_BASE=upstream.url)), upstream

    def connect(self, client, status=201, token="123456:ABC-good") -> dict:
        resp = client.post_json(
            f"{API}/channels/connect/telegram", {"botToken": token}, status=status
        )
        return resp.json["data"] if status == 201 else resp

    def test_a_refused_token_stores_nothing(self, tg):
        client, upstream = tg
        upstream.refused_token = "123456:ABC-bad"
        resp = self.connect(client, 400, token="123456:ABC-bad")
        assert "Unauthorized" in assert_error(resp, 400, "VALIDATION_ERROR")["message"]
        assert data(client.get(f"{API}/channels"))["channels"] == []
        assert "ABC-bad" not in resp.text

    def test_telegram_unreachable_is_502_and_stores_nothing(self, make_app):
        client = with_key(make_app(SERVICE_TELEGRAM_API_BASE=closed_port_url()))
        resp = self.connect(client, 502)
        assert_error(resp, 502, "UPSTREAM_ERROR")
        assert data(client.get(f"{API}/channels"))["channels"] == []

    def test_the_first_chat_to_send_the_code_is_the_only_one_allowed(self, tg):
        client, upstream = tg
        made = self.connect(client)
        code = made["bindCode"]
        assert re.fullmatch(r"[a-z2-7]{12}", code)
        assert made["link"] == f"https://t.me/notes_bot?start={code}"
        ch = made["channel"]
        assert ch["config"]["mode"] == "polling"
        assert ch["config"]["allowedChatIds"] == []
        assert ch["name"] == "@notes_bot"
        url = f"{API}/channels/{ch['id']}"
        shown = data(client.get(url))
        assert set(shown["binding"]) == {"until"}  # the code is never shown again
        assert code not in json.dumps(shown)
        # before the code: nobody, though the allowlist is empty
        upstream.push(telegram_update("/save sneaky", chat_id=7))
        wait_for(lambda: data(client.get(url))["refusedSenders"])
        upstream.push(telegram_update(f"/start {code}", chat_id=42))
        wait_for(lambda: "boundChat" in data(client.get(url)))
        bound = data(client.get(url))
        assert bound["boundChat"]["id"] == "42"
        assert bound["boundChat"]["name"] == "Ada"
        assert bound["config"]["allowedChatIds"] == ["42"]
        assert "binding" not in bound
        wait_for(lambda: any("Connected" in t for t in upstream.sent()))
        upstream.push(telegram_update(code, chat_id=9))  # a second chat with the same code
        wait_for(lambda: "9" in [r["sender"] for r in data(client.get(url))["refusedSenders"]])
        upstream.push(telegram_update("/save oat milk", chat_id=42))
        wait_for(lambda: today_note(client).exists())
        assert "oat milk" in today_note(client).read_text()
        assert "sneaky" not in today_note(client).read_text()

    def test_a_new_code_rebinds_and_an_expired_one_binds_nothing(self, tg):
        client, upstream = tg
        ch = self.connect(client)["channel"]
        url = f"{API}/channels/{ch['id']}"
        again = data(client.post(f"{url}/bind"))
        svc = client.app.service

        def expire(data_: dict) -> None:
            for c in data_["channels"]:
                c["binding"]["until"] = "2000-01-01T00:00:00Z"

        svc.state.update(expire)
        upstream.push(telegram_update(f"/start {again['bindCode']}", chat_id=42))
        wait_for(lambda: data(client.get(url))["refusedSenders"])
        assert "boundChat" not in data(client.get(url))
        fresh = data(client.post(f"{url}/bind"))
        upstream.push(telegram_update(fresh["bindCode"], chat_id=43))
        wait_for(lambda: "boundChat" in data(client.get(url)))
        assert data(client.get(url))["config"]["allowedChatIds"] == ["43"]

    def test_bind_refuses_other_channels(self, client):
        web = data(client.post_json(f"{API}/channels", {"provider": "web"}, status=201))
        resp = client.post(f"{API}/channels/{web['id']}/bind", status=400)
        assert_error(resp, 400, "VALIDATION_ERROR")
        assert_error(client.post(f"{API}/channels/ch_nope/bind", status=404), 404, "NOT_FOUND")


class TestFolderGrants:
    @pytest.fixture
    def family(self, client):
        for path, text in FOLDER_NOTES.items():
            put_note(client, path, text)
        for path in ("attachments/family/p.png", "attachments/work/w.png", "attachments/t.png"):
            upload(client, path)
        for path in ("notes/family/gone.md", "notes/work/gone.md"):  # the trash has both
            put_note(client, path, "bye")
            client.delete(note_url(path))
        client.post_json(f"{API}/shares", {"path": "notes/work/c.md"}, status=201)
        key = new_grant(client, "write", "notes/family")["key"]
        return client, as_key(client, key)

    @pytest.mark.parametrize(("method", "url", "body"), LISTING_CALLS)
    def test_a_folder_key_never_sees_outside_its_folder(self, family, method, url, body):
        owner, member = family
        call = (
            (lambda app: app.post_json(API + url, body))
            if body
            else (lambda app: app.get(API + url))
        )
        seen = paths_in(data(call(member)))
        assert all(map(inside_family, seen)), seen
        if url not in ("/shares", "/plugins/tags") and "sub" not in url:  # counts, or nothing
            everything = paths_in(data(call(owner)))
            assert everything - set(filter(inside_family, everything)), url

    def test_a_symbolic_link_in_the_folder_lists_nothing_outside_it(self, family, root):
        _, member = family
        (root / "notes/family/link").symlink_to(root / "notes/work", target_is_directory=True)
        (root / "attachments/family/link").symlink_to(root / "attachments/work")
        for url in (
            "/notes?folder=notes/family/link",
            "/folders/tree/notes%2Ffamily%2Flink",
            "/folders/tree/notes%2Ffamily%2Flink%2F?depth=1",
            "/search?q=apple&folder=notes/family/link",
            "/attachments?folder=attachments/family/link",
        ):
            resp = member.get(API + url, status="*")
            assert resp.status_int == 404, url
            assert "notes/work" not in resp.text, url
            assert "w.png" not in resp.text, url
        answer = rpc(
            member,
            "tools/call",
            {"name": "list_folder", "arguments": {"path": "notes/family/link"}},
        )
        assert "notes/work" not in json.dumps(answer)
        answer = rpc(
            member,
            "tools/call",
            {
                "name": "search_notes",
                "arguments": {"query": "apple", "folder": "notes/family/link"},
            },
        )
        assert "notes/work" not in json.dumps(answer)

    def test_a_move_with_updated_links_tells_nothing_of_other_folders(self, family):
        _, member = family
        text = "[a](../work/c.md) [b](../work/nothere.md) ![c](../../attachments/work/w.png)"
        put_note(member, "notes/family/probe.md", text)
        moved = data(
            member.patch_json(
                note_url("notes/family/probe.md") + "/move",
                {"path": "notes/family/sub/probe.md", "updateLinks": True},
            )
        )
        assert moved["content"] == text  # an existing note elsewhere is not told by a rewrite
        assert "notes/family/sub/probe.md" not in moved.get("linksUpdated", [])

    def test_a_plugins_tool_is_not_offered_to_a_folder_grant(self, make_app, root):
        folder = root / ".notesvc" / "plugins"
        folder.mkdir(parents=True)
        (folder / "everything.py").write_text(
            "import notesvc\n"
            "@notesvc.tool('all_paths', 'every path')\n"
            "def all_paths(svc):\n"
            "    return {'paths': svc.index.paths()}\n"
            "PLUGIN = notesvc.Plugin(name='everything')\n"
        )
        client = with_key(make_app())
        put_note(client, "notes/work/secret.md", "s")
        put_note(client, "notes/family/a.md", "a")
        assert "all_paths" in listed_tools(client)
        member = as_key(client, new_grant(client, "read", "notes/family")["key"])
        reader = as_key(client, new_grant(client, "read")["key"])
        assert "all_paths" not in listed_tools(member)
        assert "all_paths" in listed_tools(reader)  # a grant to everything may use it
        answer = rpc(member, "tools/call", {"name": "all_paths", "arguments": {}})
        assert "notes/work/secret.md" not in json.dumps(answer)
        assert "plugin's tool" in json.dumps(answer)

    def test_listings_count_only_the_folder(self, family):
        _, member = family
        assert data(member.get(f"{API}/notes"))["total"] == 2
        assert data(member.get(f"{API}/search?q=apple"))["total"] == 2
        tags = data(member.get(f"{API}/plugins/tags"))["tags"]
        assert tags == [{"tag": "common", "count": 2}]
        assert_error(member.get(f"{API}/plugins/tags/work", status=404), 404, "NOT_FOUND")

    def test_the_tree_shows_only_the_way_down(self, family):
        _, member = family
        root = data(member.get(f"{API}/folders/tree"))
        assert [c["path"] for c in root["children"]] == ["notes/family"]
        family_node = data(member.get(f"{API}/folders/tree/notes%2Ffamily"))
        assert [c["name"] for c in family_node["children"]] == ["sub", "a.md"]

    @pytest.mark.parametrize(
        "url",
        [
            "/notes/notes%2Fwork%2Fc.md",
            "/notes/notes/work/c.md",
            "/notes/notes%2Ffamily%2F..%2Fwork%2Fc.md",
            "/notes/notes%2Ffamily%2F.%2F..%2Fwork%2Fc.md",
            "/notes/notes%2Ffamilyx%2Fd.md",
            "/notes/notes%2Ftop.md",
            "/notes/..%2Fstate.json",
            "/notes?folder=notes/work",
            "/notes?folder=notes/familyx",
            "/notes?folder=notes%2Ffamily%2F..%2Fwork",
            "/folders/tree/notes%2Fwork",
            "/folders/tree/notes%2Ffamily%2F..%2Fwork",
            "/search?q=apple&folder=notes/work",
            "/search?q=contract&folder=notes%2Ffamily%2F..%2Fwork",
            "/plugins/backlinks/notes%2Fwork%2Fc.md",
            "/attachments/attachments%2Fwork%2Fw.png",
            "/attachments/attachments%2Ft.png",
            "/attachments/attachments%2Ffamily%2F..%2Fwork%2Fw.png",
            "/attachments?folder=attachments/work",
            "/attachments?folder=attachments%2Ffamily%2F..",
        ],
    )
    def test_outside_answers_as_if_nothing_were_there(self, family, url):
        _, member = family
        assert_error(member.get(API + url, status=404), 404, "NOT_FOUND")

    def test_a_search_that_would_match_outside_finds_nothing_there(self, family):
        _, member = family
        assert data(member.get(f"{API}/search?q=contract"))["total"] == 0
        assert data(member.get(f"{API}/search?q=neighbour"))["total"] == 0

    def test_writes_stay_inside(self, family, root):
        _, member = family
        a = note_url("notes/family/a.md")
        for method, url, body in (
            ("POST", f"{API}/notes", {"path": "notes/work/new.md", "content": "x"}),
            ("POST", f"{API}/notes", {"path": "notes/family/../work/new.md", "content": "x"}),
            ("PUT", note_url("notes/work/c.md"), {"content": "overwritten"}),
            ("DELETE", note_url("notes/work/c.md"), None),
            ("PATCH", f"{a}/move", {"path": "notes/work/a.md"}),
            ("PATCH", f"{a}/move", {"path": "notes/familyx/a.md"}),
            ("PATCH", note_url("notes/work/c.md") + "/move", {"path": "notes/family/c.md"}),
            ("POST", f"{API}/plugins/daily/today", None),
            ("POST", f"{API}/shares", {"path": "notes/work/c.md"}),
        ):
            resp = member.request(
                url,
                method=method,
                body=json.dumps(body).encode() if body else b"",
                headers={"Content-Type": "application/json"},
                expect_errors=True,
            )
            assert_error(resp, 404, "NOT_FOUND")
        assert (root / "notes/work/c.md").read_text() == FOLDER_NOTES["notes/work/c.md"]
        assert not (root / "notes/work/a.md").exists()
        assert (root / "notes/family/a.md").exists()
        assert not (root / "notes/daily").exists()

    def test_attachments_of_the_folder_only(self, family, root):
        _, member = family
        assert member.get(att_url("attachments/family/p.png")).body == PNG
        listed = data(member.get(f"{API}/attachments"))
        assert [a["path"] for a in listed["attachments"]] == ["attachments/family/p.png"]
        upload(member, "attachments/family/new.png")
        for resp in (
            upload(member, "attachments/work/new.png", status=404),
            upload(member, "attachments/new.png", status=404),
            member.delete(att_url("attachments/work/w.png"), status=404),
            member.patch_json(
                att_url("attachments/family/p.png") + "/move",
                {"path": "attachments/work/p.png"},
                status=404,
            ),
        ):
            assert_error(resp, 404, "NOT_FOUND")
        form, ctype = multipart(("path", "attachments/work/x.png"), ("file", PNG, "x.png"))
        assert_error(post_form(member, form, ctype, status=404), 404, "NOT_FOUND")
        assert not (root / "attachments/work/new.png").exists()
        assert (root / "attachments/work/w.png").exists()
        owner = with_key(member, key_of(member))
        reader = as_key(member, new_grant(owner, "read", "notes/family")["key"])
        assert_error(upload(reader, "attachments/family/r.png", status=403), 403, "FORBIDDEN")

    def test_writes_inside_work(self, family):
        _, member = family
        member.post_json(
            f"{API}/notes", {"path": "notes/family/new.md", "content": "n"}, status=201
        )
        moved = data(
            member.patch_json(
                note_url("notes/family/new.md") + "/move", {"path": "notes/family/sub/new.md"}
            )
        )
        assert moved["path"] == "notes/family/sub/new.md"
        member.delete(note_url("notes/family/sub/new.md"), status=200)

    def test_history_and_trash_of_the_folder_only(self, family):
        owner, member = family
        owner.put_json(note_url("notes/work/c.md"), {"content": "changed"})
        owner.put_json(note_url("notes/family/a.md"), {"content": "changed"})
        url = note_url("notes/family/a.md") + "/versions"
        versions = data(member.get(url))["versions"]
        assert versions
        vid = versions[0]["id"]
        assert "Apple" in data(member.get(f"{url}/{vid}"))["content"]
        assert data(member.get(f"{url}/{vid}/diff"))["diff"]
        member.post(f"{url}/{vid}/restore", status=200)
        work = note_url("notes/work/c.md") + "/versions"
        assert_error(member.get(work, status=404), 404, "NOT_FOUND")
        owner_vid = data(owner.get(work))["versions"][0]["id"]
        for resp in (
            member.get(f"{work}/{owner_vid}", status=404),
            member.get(f"{work}/{owner_vid}/diff", status=404),
            member.post(f"{work}/{owner_vid}/restore", status=404),
        ):
            assert_error(resp, 404, "NOT_FOUND")
        trash = data(member.get(f"{API}/trash"))
        assert [i["path"] for i in trash["items"]] == ["notes/family/gone.md"]
        assert trash["total"] == 1
        theirs = next(
            i["id"] for i in data(owner.get(f"{API}/trash"))["items"] if "work" in i["path"]
        )
        assert_error(member.get(f"{API}/trash/{theirs}", status=404), 404, "NOT_FOUND")
        assert_error(member.post(f"{API}/trash/{theirs}/restore", status=404), 404, "NOT_FOUND")
        mine = trash["items"][0]["id"]
        away = member.post_json(
            f"{API}/trash/{mine}/restore", {"path": "notes/work/gone.md"}, status=404
        )
        assert_error(away, 404, "NOT_FOUND")
        assert_error(member.delete(f"{API}/trash/{mine}", status=403), 403, "FORBIDDEN")
        member.post(f"{API}/trash/{mine}/restore", status=200)

    def test_the_change_feed_of_the_folder(self, family):
        owner, member = family
        last = data(member.get(f"{API}/changes?since=0"))["last"]
        owner.patch_json(note_url("notes/work/c.md") + "/move", {"path": "notes/family/c.md"})
        owner.patch_json(note_url("notes/family/a.md") + "/move", {"path": "notes/work/a.md"})
        put_note(owner, "notes/work/new.md", "outside")
        seen = data(member.get(f"{API}/changes?since={last}"))["changes"]
        assert [(c["kind"], c["path"]) for c in seen] == [
            ("created", "notes/family/c.md"),
            ("deleted", "notes/family/a.md"),
        ]
        assert all("from" not in c for c in seen)
        everything = data(owner.get(f"{API}/changes?since={last}"))["changes"]
        assert [c["kind"] for c in everything] == ["moved", "moved", "created"]

    def test_a_waiting_feed_waits_past_changes_it_may_not_see(self, family):
        owner, member = family
        last = data(member.get(f"{API}/changes?since=0"))["last"]
        journal = owner.app.service.journal
        answer: dict = {}

        def feed():
            answer["seen"] = data(member.get(f"{API}/changes?since={last}&wait=10"))

        reader = threading.Thread(target=feed)
        reader.start()
        wait_for(lambda: journal.waiting() == 1)  # the member's feed is waiting
        put_note(owner, "notes/work/x.md", "not theirs")
        reader.join(0.5)  # woken by a change it may not see, it waits on: no answer
        assert reader.is_alive()
        put_note(owner, "notes/family/x.md", "theirs")
        reader.join(10)
        assert [c["path"] for c in answer["seen"]["changes"]] == ["notes/family/x.md"]

    def test_a_symbolic_link_out_of_the_folder_leads_nowhere(self, family, root):
        _, member = family
        os.symlink(root / "notes" / "work", root / "notes" / "family" / "link")
        assert_error(member.get(note_url("notes/family/link/c.md"), status=404), 404, "NOT_FOUND")
        assert "notes/work" not in json.dumps(data(member.get(f"{API}/folders/tree")))

    def test_agent_sources_stay_inside(self, family):
        _, member = family
        d = data(member.post_json(f"{API}/agent/chat", {"message": "secret contract apple"}))
        assert d["sources"]
        assert all(s["path"].startswith("notes/family/") for s in d["sources"])
        assert "contract" not in d["reply"].lower()
        bad = member.post_json(
            f"{API}/agent/chat", {"message": "x", "notePath": "notes/work/c.md"}, status=404
        )
        assert_error(bad, 404, "NOT_FOUND")

    def test_a_daily_note_for_the_daily_folder(self, client):
        member = as_key(client, new_grant(client, "write", "notes/daily")["key"])
        assert member.post(f"{API}/plugins/daily/today").status_int == 201

    def test_a_folder_not_created_yet_lists_empty(self, client):
        member = as_key(client, new_grant(client, "read", "notes/later")["key"])
        assert data(member.get(f"{API}/notes"))["total"] == 0
        assert data(member.get(f"{API}/folders/tree"))["children"][0]["children"] == []
        assert data(member.get(f"{API}/search?q=anything"))["total"] == 0


class TestShareLinks:
    @pytest.fixture
    def shared(self, client):
        put_note(client, "notes/recipes/pie.md", "# Pie\n\n- apples\n- [x] butter\n")
        d = data(client.post_json(f"{API}/shares", {"path": "notes/recipes/pie.md"}, status=201))
        return client, d

    def token(self, d: dict) -> str:
        return d["url"].rsplit("/s/", 1)[1]

    def test_create_gives_a_link_that_expires_in_seven_days(self, shared, root):
        client, d = shared
        assert set(d) == {"id", "path", "url", "createdAt", "expiresAt", "createdBy"}
        sid = client.app.service.state.read()["serverId"]
        assert re.fullmatch(rf"http://localhost:80/r/{sid}/s/[A-Za-z0-9_-]{{22}}", d["url"])
        days = (notesvc._epoch(d["expiresAt"]) - notesvc._epoch(d["createdAt"])) / 86400
        assert round(days) == 7
        assert self.token(d) not in (root / ".notesvc" / "state.json").read_text()

    def test_open_port_mode_links_to_the_server_itself(self, make_app):
        client = with_key(make_app(SERVICE_PAIRING_MODE="open-port"))
        put_note(client, "notes/x.md", "x")
        d = data(client.post_json(f"{API}/shares", {"path": "notes/x.md", "expiresInDays": 1}))
        assert d["url"].startswith("http://localhost:80/s/")

    def test_anyone_with_the_link_reads_the_note(self, shared, anon):
        _, d = shared
        resp = anon.get(f"{API}/shared/{self.token(d)}")
        assert data(resp) == {
            "title": "Pie",
            "content": "# Pie\n\n- apples\n- [x] butter\n",
            "modified": data(resp)["modified"],
            "attachments": {},
        }
        assert resp.headers["X-Robots-Tag"] == "noindex, nofollow"
        assert resp.headers["Referrer-Policy"] == "no-referrer"
        assert resp.headers["Cache-Control"] == "no-store"

    def test_the_share_page_is_static_noindex_and_locked_down(self, shared, anon):
        _, d = shared
        sid = anon.app.service.state.read()["serverId"]
        for url in (f"/s/{self.token(d)}", f"/r/{sid}/s/{self.token(d)}"):
            resp = anon.get(url)
            assert resp.content_type == "text/html"
            assert resp.headers["Referrer-Policy"] == "no-referrer"
            assert "noindex" in resp.headers["X-Robots-Tag"]
            assert '<meta name="robots" content="noindex, nofollow">' in resp.text
            csp = resp.headers["Content-Security-Policy"]
            assert "frame-ancestors 'none'" in csp
            assert "unsafe-inline" not in csp
            assert "Pie" not in resp.text  # the note comes from the API, never in the HTML
            assert resp.body == notesvc.share_page().encode()

    def test_revoked_expired_unknown_and_deleted_are_404(self, shared, anon, root):
        client, d = shared
        token = self.token(d)
        other = data(client.post_json(f"{API}/shares", {"path": "notes/recipes/pie.md"}))
        client.delete(f"{API}/shares/{d['id']}", status=200)
        assert_error(anon.get(f"{API}/shared/{token}", status=404), 404, "NOT_FOUND")
        state_file = root / ".notesvc" / "state.json"
        state = json.loads(state_file.read_text())
        state["shares"][0]["expiresAt"] = "2020-01-01T00:00:00.000Z"
        state_file.write_text(json.dumps(state))
        assert_error(anon.get(f"{API}/shared/{self.token(other)}", status=404), 404, "NOT_FOUND")
        third = data(client.post_json(f"{API}/shares", {"path": "notes/recipes/pie.md"}))
        anon.get(f"{API}/shared/{self.token(third)}", status=200)
        client.delete(note_url("notes/recipes/pie.md"))
        assert_error(anon.get(f"{API}/shared/{self.token(third)}", status=404), 404, "NOT_FOUND")
        put_note(client, "notes/recipes/pie.md", "a new note at the same path")  # not shared
        assert_error(anon.get(f"{API}/shared/{self.token(third)}", status=404), 404, "NOT_FOUND")

    def test_a_folder_keys_link_reads_as_that_key(self, client, anon, root):
        upload(client, "attachments/work/secret.png", data=PNG + b"secret")
        upload(client, "attachments/family/p.png")
        member = as_key(client, new_grant(client, "write", "notes/family")["key"])
        text = "![a](/attachments/work/secret.png)\n![b](../../attachments/family/p.png)\n"
        member.post_json(f"{API}/notes", {"path": "notes/family/leak.md", "content": text})
        token = self.token(
            data(member.post_json(f"{API}/shares", {"path": "notes/family/leak.md"}))
        )
        shared = data(anon.get(f"{API}/shared/{token}"))
        assert shared["attachments"] == {
            "../../attachments/family/p.png": "attachments/family/p.png"
        }
        anon.get(f"{API}/shared/{token}/attachments/attachments/family/p.png", status=200)
        for path in ("attachments/work/secret.png", "attachments%2Fwork%2Fsecret.png"):
            got = anon.get(f"{API}/shared/{token}/attachments/{path}", status=404)
            assert b"secret" not in got.body
        # Moved out of the key's folder by the owner: the link reads nothing, and the key's
        # list of links does not name where the note went.
        client.patch_json(note_url("notes/family/leak.md") + "/move", {"path": "notes/work/l.md"})
        assert_error(anon.get(f"{API}/shared/{token}", status=404), 404, "NOT_FOUND")
        assert data(member.get(f"{API}/shares"))["shares"] == []
        client.patch_json(note_url("notes/work/l.md") + "/move", {"path": "notes/family/l.md"})
        assert data(anon.get(f"{API}/shared/{token}"))["content"] == text
        # The key expires: its links end with it.
        state_file = root / ".notesvc" / "state.json"
        state = json.loads(state_file.read_text())
        state["grants"][0]["expiresAt"] = "2020-01-01T00:00:00.000Z"
        state_file.write_text(json.dumps(state))
        assert_error(anon.get(f"{API}/shared/{token}", status=404), 404, "NOT_FOUND")
        assert data(client.get(f"{API}/security/config"))["grants"]["key"] == 0

    def test_a_moved_note_keeps_its_link(self, shared, anon):
        client, d = shared
        client.patch_json(note_url("notes/recipes/pie.md") + "/move", {"path": "notes/pie.md"})
        assert data(anon.get(f"{API}/shared/{self.token(d)}"))["title"] == "Pie"
        assert data(client.get(f"{API}/shares"))["shares"][0]["path"] == "notes/pie.md"

    def test_guessing_is_rate_limited_and_finds_nothing(self, shared, anon):
        _, d = shared
        guesser = webtest.TestApp(anon.app, extra_environ={"REMOTE_ADDR": "203.0.113.9"})
        for _ in range(10):
            guess = secrets.token_urlsafe(16)
            assert_error(guesser.get(f"{API}/shared/{guess}", status=404), 404, "NOT_FOUND")
        locked = guesser.get(f"{API}/shared/{self.token(d)}", status=429)  # even the right one
        assert_error(locked, 429, "RATE_LIMITED")
        assert int(locked.headers["Retry-After"]) > 0
        assert data(anon.get(f"{API}/shared/{self.token(d)}"))["title"] == "Pie"  # others fine

    def test_reading_is_rate_limited_per_address(self, shared, anon):
        _, d = shared
        reader = webtest.TestApp(anon.app, extra_environ={"REMOTE_ADDR": "203.0.113.10"})
        statuses = [
            reader.get(f"{API}/shared/{self.token(d)}", expect_errors=True).status_int
            for _ in range(61)
        ]
        assert statuses[:60] == [200] * 60
        assert statuses[60] == 429

    @pytest.mark.parametrize(
        "token", ["x", "A" * 23, "A" * 21 + "!", "%00" * 8, "../../state.json", "A" * 5000]
    )
    def test_hostile_tokens_are_404(self, anon, token):
        resp = anon.get(f"{API}/shared/{urllib.parse.quote(token, safe='')}", status=404)
        assert_error(resp, 404, "NOT_FOUND")

    @pytest.mark.parametrize(
        "body",
        [
            {},
            {"path": 5},
            {"path": "../x.md"},
            {"path": "notes/recipes/pie.md", "expiresInDays": 0},
            {"path": "notes/recipes/pie.md", "expiresInDays": 366},
            {"path": "notes/recipes/pie.md", "expiresInDays": 1.5},
        ],
    )
    def test_bad_share_requests_are_400(self, shared, body):
        client, _ = shared
        assert_error(client.post_json(f"{API}/shares", body, status=400), 400, "VALIDATION_ERROR")

    def test_a_missing_note_cannot_be_shared(self, client):
        resp = client.post_json(f"{API}/shares", {"path": "notes/none.md"}, status=404)
        assert_error(resp, 404, "NOT_FOUND")

    def test_a_grant_sees_and_revokes_its_own_links_only(self, shared):
        client, owners = shared
        writer = as_key(client, new_grant(client, "write")["key"])
        mine = data(writer.post_json(f"{API}/shares", {"path": "notes/recipes/pie.md"}))
        assert mine["createdBy"] != "owner"
        assert [s["id"] for s in data(writer.get(f"{API}/shares"))["shares"]] == [mine["id"]]
        assert len(data(client.get(f"{API}/shares"))["shares"]) == 2
        gone = writer.delete(f"{API}/shares/{owners['id']}", status=404)
        assert_error(gone, 404, "NOT_FOUND")
        reader = as_key(client, new_grant(client, "read")["key"])
        assert_error(
            reader.post_json(f"{API}/shares", {"path": "notes/recipes/pie.md"}, status=403),
            403,
            "FORBIDDEN",
        )
        writer.delete(f"{API}/shares/{mine['id']}", status=200)

    def test_revoking_a_key_ends_its_links(self, shared, anon):
        client, _ = shared
        rec = new_grant(client, "write")
        link = data(
            as_key(client, rec["key"]).post_json(f"{API}/shares", {"path": "notes/recipes/pie.md"})
        )
        client.delete(f"{API}/auth/keys/{rec['id']}")
        assert_error(anon.get(f"{API}/shared/{self.token(link)}", status=404), 404, "NOT_FOUND")

    def test_a_shared_note_loads_the_images_it_links_and_no_other(self, client, anon):
        text = (
            "# Rome\n\n![view](../../attachments/trips/view.png)\n![top](/attachments/top.png)\n"
            "![web](https://img.example/a.png) [file](../../attachments/trips/gone.png)\n"
        )
        put_note(client, "notes/trips/rome.md", text)
        for path in ("attachments/trips/view.png", "attachments/top.png", "attachments/secret.png"):
            upload(client, path)
        d = data(client.post_json(f"{API}/shares", {"path": "notes/trips/rome.md"}))
        token = self.token(d)
        assert data(anon.get(f"{API}/shared/{token}"))["attachments"] == {
            "../../attachments/trips/view.png": "attachments/trips/view.png",
            "/attachments/top.png": "attachments/top.png",
            "../../attachments/trips/gone.png": "attachments/trips/gone.png",
        }
        resp = anon.get(f"{API}/shared/{token}/attachments/attachments/trips/view.png")
        assert resp.body == PNG
        assert resp.content_type == "image/png"
        assert resp.headers["Content-Security-Policy"] == notesvc.ATTACHMENT_CSP
        anon.get(f"{API}/shared/{token}/attachments/attachments%2Ftop.png", status=200)
        for path in ("attachments/secret.png", "attachments/trips/gone.png", "notes/trips/rome.md"):
            url = f"{API}/shared/{token}/attachments/{urllib.parse.quote(path, safe='')}"
            assert_error(anon.get(url, status=404), 404, "NOT_FOUND")
        client.delete(f"{API}/shares/{d['id']}")
        url = f"{API}/shared/{token}/attachments/attachments/top.png"
        assert_error(anon.get(url, status=404), 404, "NOT_FOUND")

    def test_share_tokens_never_reach_the_log(self, shared, anon, caplog):
        _, d = shared
        caplog.set_level("INFO", logger="notesvc")
        anon.get(f"{API}/shared/{self.token(d)}")
        anon.get(f"/s/{self.token(d)}")
        text = "\n".join(r.getMessage() for r in caplog.records)
        assert "/shared/" in text
        assert self.token(d) not in text


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


class TestOAuth:
    def test_metadata_documents(self, anon):
        prm = anon.get("/.well-known/oauth-protected-resource").json
        assert prm == {
            "resource": "http://localhost:80/api/v1/mcp",
            "authorization_servers": ["http://localhost:80"],
            "scopes_supported": ["notes:read", "notes:write"],
            "bearer_methods_supported": ["header"],
            "resource_name": "notesvc",
        }
        assert anon.get("/.well-known/oauth-protected-resource/api/v1/mcp").json == prm
        asm = anon.get("/.well-known/oauth-authorization-server").json
        assert asm["issuer"] == "http://localhost:80"
        for name in ("authorize", "token", "register", "revoke"):
            key = {"authorize": "authorization_endpoint", "register": "registration_endpoint"}.get(
                name, f"{name if name != 'revoke' else 'revocation'}_endpoint"
            )
            assert asm[key] == f"http://localhost:80/oauth/{name}"
        assert asm["code_challenge_methods_supported"] == ["S256"]
        assert asm["token_endpoint_auth_methods_supported"] == ["none"]
        assert asm["grant_types_supported"] == ["authorization_code", "refresh_token"]
        assert asm["response_types_supported"] == ["code"]
        assert asm["client_id_metadata_document_supported"] is True
        assert anon.get("/.well-known/openid-configuration").json == asm

    def test_the_relay_prefix_has_its_own_issuer(self, anon):
        sid = anon.app.service.state.read()["serverId"]
        base = f"http://localhost:80/r/{sid}"
        asm = anon.get(f"/.well-known/oauth-authorization-server/r/{sid}").json
        assert asm["issuer"] == base
        assert asm["token_endpoint"] == f"{base}/oauth/token"
        prm = anon.get(f"/.well-known/oauth-protected-resource/r/{sid}/api/v1/mcp").json
        assert prm["resource"] == f"{base}/api/v1/mcp"
        assert prm["authorization_servers"] == [base]
        assert anon.get(f"/.well-known/openid-configuration/r/{sid}").json == asm
        assert_error(
            anon.get("/.well-known/oauth-authorization-server/r/someoneelse", status=404),
            404,
            "NOT_FOUND",
        )

    def test_public_url_is_the_issuer(self, make_app):
        app = make_app(SERVICE_PUBLIC_URL="https://notes.example.org")
        assert app.get("/.well-known/oauth-authorization-server").json["issuer"] == (
            "https://notes.example.org"
        )

    def test_registration(self, anon):
        reg = register_client(anon, [CALLBACK, "https://claude.ai/api/mcp/auth_callback"])
        assert reg["client_id"].startswith("mcp_")
        assert reg["token_endpoint_auth_method"] == "none"
        assert reg["redirect_uris"] == [CALLBACK, "https://claude.ai/api/mcp/auth_callback"]
        assert reg["client_name"] == "Pocket assistant"
        secret = register_client(anon, token_endpoint_auth_method="client_secret_basic")
        assert secret["token_endpoint_auth_method"] == "none"
        assert "client_secret" not in secret

    @pytest.mark.parametrize(
        ("body", "error"),
        [
            ({}, "invalid_redirect_uri"),
            ({"redirect_uris": []}, "invalid_redirect_uri"),
            ({"redirect_uris": "https://a.example/cb"}, "invalid_redirect_uri"),
            ({"redirect_uris": ["http://evil.example/cb"]}, "invalid_redirect_uri"),
            ({"redirect_uris": ["http://10.0.0.5/cb"]}, "invalid_redirect_uri"),
            ({"redirect_uris": ["javascript:alert(1)"]}, "invalid_redirect_uri"),
            ({"redirect_uris": ["myapp://callback"]}, "invalid_redirect_uri"),
            ({"redirect_uris": ["https://a.example/cb#frag"]}, "invalid_redirect_uri"),
            ({"redirect_uris": ["https://user:pw@a.example/cb"]}, "invalid_redirect_uri"),
            ({"redirect_uris": ["https://a.example/c b"]}, "invalid_redirect_uri"),
            ({"redirect_uris": ["https://a.example/" + "x" * 2000]}, "invalid_redirect_uri"),
            (
                {"redirect_uris": [f"https://a.example/{i}" for i in range(11)]},
                "invalid_redirect_uri",
            ),
            (
                {"redirect_uris": [CALLBACK], "grant_types": ["client_credentials"]},
                "invalid_client_metadata",
            ),
            ({"redirect_uris": [CALLBACK], "response_types": ["token"]}, "invalid_client_metadata"),
            ({"redirect_uris": [CALLBACK], "client_name": ["x"]}, "invalid_client_metadata"),
        ],
    )
    def test_bad_registrations(self, anon, body, error):
        resp = anon.post_json("/oauth/register", body, status=400)
        oauth_error(resp, 400, error)

    def test_broken_registration_bodies(self, anon):
        resp = anon.post("/oauth/register", "{", {"Content-Type": "application/json"}, status=400)
        oauth_error(resp, 400, "invalid_client_metadata")
        resp = anon.post("/oauth/register", "[1]", {"Content-Type": "application/json"}, status=400)
        oauth_error(resp, 400, "invalid_client_metadata")
        resp = anon.post("/oauth/register", "x=1", status=415)
        oauth_error(resp, 415, "invalid_client_metadata")
        huge = json.dumps({"redirect_uris": [CALLBACK], "client_name": "x" * 70000})
        resp = anon.post("/oauth/register", huge, {"Content-Type": "application/json"}, status=413)
        oauth_error(resp, 413, "invalid_client_metadata")

    @pytest.mark.slow
    def test_a_registration_flood_stops_at_the_cap(self, anon):
        one = webtest.TestApp(anon.app, extra_environ={"REMOTE_ADDR": "198.51.100.200"})
        body = {"redirect_uris": [CALLBACK]}
        statuses = [
            one.post_json("/oauth/register", body, status="*").status_int for _ in range(11)
        ]
        assert statuses == [201] * 10 + [429]
        for i in range(notesvc.MAX_OAUTH_CLIENTS):  # from many addresses, up to the cap
            app = webtest.TestApp(
                anon.app, extra_environ={"REMOTE_ADDR": f"10.9.{i // 200}.{i % 200}"}
            )
            app.post_json("/oauth/register", body, status="*")
        resp = webtest.TestApp(anon.app, extra_environ={"REMOTE_ADDR": "10.8.0.1"}).post_json(
            "/oauth/register", body, status=503
        )
        oauth_error(resp, 503, "temporarily_unavailable")
        assert len(anon.app.service.state.read()["oauthClients"]) == notesvc.MAX_OAUTH_CLIENTS

    @pytest.mark.slow
    def test_at_the_cap_old_never_used_clients_give_way(self, anon, root):
        for i in range(notesvc.MAX_OAUTH_CLIENTS):
            register_client(anon, addr=f"10.7.{i // 200}.{i % 200}")
        state_file = root / ".notesvc" / "state.json"
        state = json.loads(state_file.read_text())
        oldest = sorted(state["oauthClients"])[0]
        state["oauthClients"][oldest]["createdAt"] = notesvc.iso(time.time() - 7200)
        state_file.write_text(json.dumps(state))
        register_client(anon, addr="10.6.0.1")
        clients = anon.app.service.state.read()["oauthClients"]
        assert len(clients) == notesvc.MAX_OAUTH_CLIENTS
        assert oldest not in clients

    def test_consent_facts_for_a_good_request(self, anon):
        cid = register_client(anon)["client_id"]
        _, challenge = pkce_pair()
        q = urllib.parse.urlencode(
            {
                "client_id": cid,
                "redirect_uri": "http://127.0.0.1:53682/callback",  # loopback: any port
                "response_type": "code",
                "code_challenge": challenge,
                "code_challenge_method": "S256",
                "state": "abc",
                "scope": "notes:read notes:write",
                "resource": mcp_url(anon),
            }
        )
        d = data(anon.get(f"{API}/oauth/consent?{q}"))
        assert d["client"] == {"id": cid, "name": "Pocket assistant", "uri": ""}
        assert d["redirectHost"] == "127.0.0.1:53682"
        assert d["scope"] == "read"
        assert d["writeAllowed"] is False
        deny = urllib.parse.urlsplit(d["deny"])
        assert deny.netloc == "127.0.0.1:53682"
        assert urllib.parse.parse_qs(deny.query)["error"] == ["access_denied"]
        assert urllib.parse.parse_qs(deny.query)["state"] == ["abc"]

    @pytest.mark.parametrize(
        ("client_id", "redirect", "status"),
        [
            ("mcp_unknown", CALLBACK, 404),
            ("", CALLBACK, 400),
            (None, "http://127.0.0.1:9/other", 400),  # not registered
            (None, "https://evil.example/callback", 400),
            (None, "http://evil.example/callback", 400),  # http off loopback
            (None, "", 400),
            ("https://127.0.0.1/client.json", CALLBACK, 400),
        ],
    )
    def test_a_bad_client_or_redirect_is_shown_never_redirected(
        self, client, anon, client_id, redirect, status
    ):
        cid = register_client(anon)["client_id"] if client_id is None else client_id
        _, challenge = pkce_pair()
        q = urllib.parse.urlencode(
            {
                "client_id": cid,
                "redirect_uri": redirect,
                "response_type": "code",
                "code_challenge": challenge,
                "code_challenge_method": "S256",
            }
        )
        resp = anon.get(f"{API}/oauth/consent?{q}", status=status)
        err = assert_error(resp, status, "NOT_FOUND" if status == 404 else "VALIDATION_ERROR")
        assert "redirect" not in err
        body = {
            "clientId": cid,
            "redirectUri": redirect,
            "codeChallenge": challenge,
            "scope": "notes:read",
        }
        refused = client.post_json(f"{API}/oauth/approve", body, status=status)
        assert "redirect" not in refused.json["error"]

    @pytest.mark.parametrize(
        ("change", "problem"),
        [
            ({"response_type": "token"}, "response_type"),
            ({"code_challenge_method": "plain"}, "S256"),
            ({"code_challenge": "short"}, "code_challenge"),
            ({"code_challenge": None}, "code_challenge"),
            ({"resource": "https://elsewhere.example/mcp"}, "resource"),
        ],
    )
    def test_other_problems_go_back_to_the_client(self, anon, change, problem):
        cid = register_client(anon)["client_id"]
        _, challenge = pkce_pair()
        params = {
            "client_id": cid,
            "redirect_uri": CALLBACK,
            "response_type": "code",
            "code_challenge": challenge,
            "code_challenge_method": "S256",
            "state": "s1",
        }
        params.update(change)
        q = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        err = assert_error(
            anon.get(f"{API}/oauth/consent?{q}", status=400), 400, "VALIDATION_ERROR"
        )
        assert problem in err["message"]
        back = urllib.parse.urlsplit(err["redirect"])
        assert back.netloc == "127.0.0.1:9"
        assert urllib.parse.parse_qs(back.query)["error"] == ["invalid_request"]
        assert urllib.parse.parse_qs(back.query)["state"] == ["s1"]

    def test_write_is_offered_only_while_mcp_writes_are_on(self, make_app):
        app = make_app(SERVICE_MCP_WRITE="true")
        client = with_key(app)
        cid = register_client(app)["client_id"]
        _, challenge = pkce_pair()
        q = urllib.parse.urlencode(
            {
                "client_id": cid,
                "redirect_uri": CALLBACK,
                "response_type": "code",
                "code_challenge": challenge,
                "code_challenge_method": "S256",
                "scope": "notes:read notes:write",
            }
        )
        facts = data(app.get(f"{API}/oauth/consent?{q}"))
        assert (facts["writeAllowed"], facts["scope"]) == (True, "write")
        code, verifier, _ = approve(client, cid, "notes:read notes:write")
        answer = token_call(
            app,
            200,
            grant_type="authorization_code",
            code=code,
            client_id=cid,
            redirect_uri=CALLBACK,
            code_verifier=verifier,
        ).json
        assert answer["scope"] == "notes:read notes:write"
        assert data(client.get(f"{API}/auth/keys"))["keys"][0]["scope"] == "write"

    def test_approval_needs_the_api_key(self, client, anon):
        cid = register_client(anon)["client_id"]
        _, challenge = pkce_pair()
        body = {
            "clientId": cid,
            "redirectUri": CALLBACK,
            "codeChallenge": challenge,
            "scope": "notes:read",
        }
        assert_error(anon.post_json(f"{API}/oauth/approve", body, status=401), 401, "UNAUTHORIZED")
        writer = as_key(client, new_grant(client, "write")["key"])
        assert_error(writer.post_json(f"{API}/oauth/approve", body, status=403), 403, "FORBIDDEN")
        write = {**body, "scope": "notes:read notes:write"}
        assert_error(client.post_json(f"{API}/oauth/approve", write, status=403), 403, "FORBIDDEN")
        for bad in (
            {"codeChallenge": "x"},
            {"scope": "admin"},
            {"folder": "../x"},
            {"resource": "https://elsewhere.example/mcp"},
            {"state": "s" * 1025},
        ):
            resp = client.post_json(f"{API}/oauth/approve", {**body, **bad}, status=400)
            assert_error(resp, 400, "VALIDATION_ERROR")

    def test_the_whole_flow(self, client, anon):
        cid = register_client(anon)["client_id"]
        code, verifier, query = approve(client, cid, folder="notes/family")
        assert query["state"] == ["st8"]
        assert query["iss"] == ["http://localhost:80"]
        assert code.startswith("nsc_")
        answer = token_call(
            anon,
            200,
            grant_type="authorization_code",
            code=code,
            client_id=cid,
            redirect_uri=CALLBACK,
            code_verifier=verifier,
            resource=mcp_url(anon),
        )
        assert answer.headers["Cache-Control"] == "no-store"
        t = answer.json
        assert t["token_type"] == "Bearer"
        assert t["expires_in"] == 3600
        assert t["scope"] == "notes:read"
        assert t["access_token"].startswith("nsa_")
        assert t["refresh_token"].startswith("nsr_")
        grants = data(client.get(f"{API}/auth/keys"))["keys"]
        assert grants == [
            {
                "id": grants[0]["id"],
                "kind": "oauth",
                "name": "Pocket assistant",
                "scope": "read",
                "folder": "notes/family",
                "createdAt": grants[0]["createdAt"],
                "expiresAt": grants[0]["expiresAt"],
                "lastUsedAt": None,
                "client": {"id": cid, "name": "Pocket assistant"},
            }
        ]
        state = json.dumps(client.app.service.state.read())
        assert t["access_token"] not in state
        assert t["refresh_token"] not in state
        assert data(client.get(f"{API}/security/config"))["grants"]["oauth"] == 1

    def test_an_oauth_token_on_the_rest_api_is_401(self, client, anon):
        _, t = tokens_for(client, anon)
        bearer = webtest.TestApp(
            anon.app, extra_environ={"HTTP_AUTHORIZATION": f"Bearer {t['access_token']}"}
        )
        for url in (f"{API}/notes", f"{API}/auth/verify", f"{API}/search?q=x"):
            resp = bearer.request(
                url, method="POST" if "verify" in url else "GET", expect_errors=True
            )
            err = assert_error(resp, 401, "UNAUTHORIZED")
            assert "mcp" in err["message"]
        header = as_key(anon, t["access_token"])
        assert_error(header.get(f"{API}/notes", status=401), 401, "UNAUTHORIZED")

    def test_a_code_is_single_use_and_a_replay_revokes_its_tokens(self, client, anon):
        cid = register_client(anon)["client_id"]
        code, verifier, _ = approve(client, cid)
        form = dict(
            grant_type="authorization_code",
            code=code,
            client_id=cid,
            redirect_uri=CALLBACK,
            code_verifier=verifier,
        )
        first = token_call(anon, 200, **form).json
        oauth_error(token_call(anon, **form), 400, "invalid_grant")
        assert data(client.get(f"{API}/auth/keys"))["keys"] == []  # revoked
        refresh = dict(
            grant_type="refresh_token", refresh_token=first["refresh_token"], client_id=cid
        )
        oauth_error(token_call(anon, **refresh), 400, "invalid_grant")

    def test_an_expired_code_is_refused(self, client, anon):
        cid = register_client(anon)["client_id"]
        code, verifier, _ = approve(client, cid)
        for entry in client.app.service.grants.codes.values():
            entry["expires"] = time.time() - 1  # 60 s have passed
        oauth_error(
            token_call(
                anon,
                grant_type="authorization_code",
                code=code,
                client_id=cid,
                redirect_uri=CALLBACK,
                code_verifier=verifier,
            ),
            400,
            "invalid_grant",
        )

    @pytest.mark.parametrize(
        ("change", "error"),
        [
            ({"code_verifier": "x" * 43}, "invalid_grant"),
            ({"code_verifier": ""}, "invalid_grant"),
            ({"client_id": "mcp_other"}, "invalid_grant"),
            ({"redirect_uri": "http://127.0.0.1:9/other"}, "invalid_grant"),
            ({"redirect_uri": "http://127.0.0.1:10/callback"}, "invalid_grant"),
            ({"code": "nsc_" + "A" * 43}, "invalid_grant"),
            ({"code": ""}, "invalid_grant"),
            ({"resource": "https://elsewhere.example/api/v1/mcp"}, "invalid_target"),
            ({"grant_type": "password"}, "unsupported_grant_type"),
            ({"grant_type": "client_credentials"}, "unsupported_grant_type"),
            ({"grant_type": ""}, "invalid_request"),
        ],
    )
    def test_a_code_redeemed_wrongly_is_refused_and_spent(self, client, anon, change, error):
        cid = register_client(anon)["client_id"]
        code, verifier, _ = approve(client, cid)
        form = dict(
            grant_type="authorization_code",
            code=code,
            client_id=cid,
            redirect_uri=CALLBACK,
            code_verifier=verifier,
        )
        oauth_error(token_call(anon, **{**form, **change}), 400, error)
        if "code" not in change and "grant_type" not in change:  # spent: the right try fails too
            oauth_error(token_call(anon, **form), 400, "invalid_grant")

    def test_token_requests_must_be_forms(self, anon):
        resp = anon.post_json("/oauth/token", {"grant_type": "authorization_code"}, status=400)
        oauth_error(resp, 400, "invalid_request")
        resp = anon.post("/oauth/token", "grant_type=a&grant_type=b", status=400)
        oauth_error(resp, 400, "invalid_request")
        resp = anon.post("/oauth/token", b"grant_type=\xff", status=400)
        oauth_error(resp, 400, "invalid_request")
        resp = anon.post("/oauth/token", "x=" + "y" * 70000, status=413)
        oauth_error(resp, 413, "invalid_request")
        resp = anon.post("/oauth/token", "&".join(f"k{i}=v" for i in range(100)), status=400)
        oauth_error(resp, 400, "invalid_request")

    def test_refresh_rotates_and_reuse_revokes_the_grant(self, client, anon):
        cid, first = tokens_for(client, anon)
        form = dict(
            grant_type="refresh_token",
            refresh_token=first["refresh_token"],
            client_id=cid,
            resource=mcp_url(anon),
        )
        second = token_call(anon, 200, **form).json
        assert second["refresh_token"] != first["refresh_token"]
        assert second["access_token"] != first["access_token"]
        assert second["scope"] == "notes:read"
        svc = anon.app.service
        assert svc.grants.principal(first["access_token"]) is None  # the old access token ends
        assert svc.grants.principal(second["access_token"]).kind == "oauth"
        oauth_error(token_call(anon, **form), 400, "invalid_grant")  # the first one, again
        assert svc.grants.principal(second["access_token"]) is None  # the grant is gone
        again = dict(form, refresh_token=second["refresh_token"])
        oauth_error(token_call(anon, **again), 400, "invalid_grant")
        assert data(client.get(f"{API}/auth/keys"))["keys"] == []

    @pytest.mark.parametrize(
        ("change", "error"),
        [
            ({"client_id": "mcp_other"}, "invalid_grant"),
            ({"client_id": ""}, "invalid_request"),
            ({"resource": "https://elsewhere.example/mcp"}, "invalid_target"),
            ({"scope": "notes:read notes:write"}, "invalid_scope"),
            ({"refresh_token": "nsr_unknown"}, "invalid_grant"),
        ],
    )
    def test_bad_refreshes(self, client, anon, change, error):
        cid, first = tokens_for(client, anon)
        form = dict(grant_type="refresh_token", refresh_token=first["refresh_token"], client_id=cid)
        oauth_error(token_call(anon, **{**form, **change}), 400, error)
        token_call(anon, 200, **form)  # a refused refresh spends nothing

    def test_revocation(self, client, anon):
        cid, t = tokens_for(client, anon)
        svc = anon.app.service
        resp = anon.post("/oauth/revoke", {"token": t["access_token"], "client_id": "mcp_other"})
        assert resp.status_int == 200
        assert svc.grants.principal(t["access_token"]) is not None
        assert (
            anon.post("/oauth/revoke", {"token": t["refresh_token"], "client_id": cid}).json == {}
        )
        assert svc.grants.principal(t["access_token"]) is None
        assert anon.post("/oauth/revoke", {"token": "nsa_unknown"}).status_int == 200
        oauth_error(anon.post("/oauth/revoke", {}, status=400), 400, "invalid_request")
        refresh = dict(grant_type="refresh_token", refresh_token=t["refresh_token"], client_id=cid)
        oauth_error(token_call(anon, **refresh), 400, "invalid_grant")

    def test_the_owner_revokes_an_oauth_grant_like_a_key(self, client, anon):
        _, t = tokens_for(client, anon)
        gid = data(client.get(f"{API}/auth/keys"))["keys"][0]["id"]
        client.delete(f"{API}/auth/keys/{gid}", status=200)
        assert anon.app.service.grants.principal(t["access_token"]) is None

    def test_the_consent_page_cannot_be_framed(self, anon):
        sid = anon.app.service.state.read()["serverId"]
        for url in ("/oauth/authorize?client_id=x", f"/r/{sid}/oauth/authorize"):
            resp = anon.get(url)
            assert resp.content_type == "text/html"
            assert resp.headers["X-Frame-Options"] == "DENY"
            csp = dict(
                d.strip().split(" ", 1) for d in resp.headers["Content-Security-Policy"].split(";")
            )
            assert csp["frame-ancestors"] == "'none'"
            assert csp["connect-src"] == "'self'"
            assert csp["form-action"] == "'none'"
            assert resp.headers["Referrer-Policy"] == "no-referrer"
            assert resp.body == notesvc.consent_page().encode()


class LocalTls:
    """A loopback HTTPS stand-in for a client's metadata host (a self-signed certificate).

    `routes`: path -> (status, headers, body, seconds to stall before the body[, seconds
    between the body's bytes]).
    """

    def __init__(self, tmp: Path):
        if not shutil.which("openssl"):
            pytest.skip("openssl is needed to make a test certificate")
        cert, key = tmp / "cert.pem", tmp / "key.pem"
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "1",
                "-subj",
                "/CN=localhost",
                "-addext",
                "subjectAltName=DNS:localhost",
                "-keyout",
                str(key),
                "-out",
                str(cert),
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        self.context = ssl.create_default_context(cafile=str(cert))
        self.routes: dict = {}
        tls = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                status, headers, body, pause, *drip = tls.routes.get(self.path, (404, {}, b"", 0))
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if pause:
                    time.sleep(pause)
                with contextlib.suppress(OSError):
                    for part in [body[i : i + 1] for i in range(len(body))] if drip else [body]:
                        self.wfile.write(part)
                        self.wfile.flush()
                        time.sleep(drip[0] if drip else 0)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server_ctx.load_cert_chain(str(cert), str(key))
        self.httpd.socket = server_ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def url(self, path: str) -> str:
        return f"https://localhost:{self.port}{path}"

    @staticmethod
    def loopback(host, port, **kwargs) -> list:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]

    def fetch(self, path: str, **kwargs) -> dict:
        """fetch_client_metadata with this loopback host counted as public."""
        return notesvc.fetch_client_metadata(
            self.url(path),
            resolve=self.loopback,
            allow=lambda ip: True,
            context=self.context,
            **kwargs,
        )

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


class TestClientMetadataDocuments:
    @pytest.mark.parametrize(
        "url",
        [
            "https://127.0.0.1/client.json",
            "https://127.8.9.10:8443/client.json",
            "https://10.1.2.3/client.json",
            "https://192.168.1.20/client.json",
            "https://172.16.5.5/client.json",
            "https://169.254.169.254/latest/meta-data",
            "https://[::1]/client.json",
            "https://[::ffff:127.0.0.1]/client.json",
            "https://[fe80::1]/client.json",
            "https://224.0.0.1/client.json",
            "https://0.0.0.0/client.json",
            "https://localhost/client.json",
        ],
    )
    def test_private_and_loopback_hosts_are_refused(self, anon, url):
        _, challenge = pkce_pair()
        q = urllib.parse.urlencode(
            {
                "client_id": url,
                "redirect_uri": CALLBACK,
                "response_type": "code",
                "code_challenge": challenge,
                "code_challenge_method": "S256",
            }
        )
        err = assert_error(
            anon.get(f"{API}/oauth/consent?{q}", status=400), 400, "VALIDATION_ERROR"
        )
        assert "not a public address" in err["message"]
        with pytest.raises(ValueError, match="not a public address"):
            notesvc.fetch_client_metadata(url)

    @pytest.mark.parametrize(
        "url",
        [
            "http://client.example/c.json",
            "https://client.example",
            "https://client.example/",
            "https://u:p@client.example/c.json",
            "https://client.example/c.json#x",
            "ftp://x/y",
        ],
    )
    def test_only_https_urls_with_a_path(self, url):
        with pytest.raises(ValueError, match="https"):
            notesvc.fetch_client_metadata(url)

    def test_a_public_address_is_fine_and_a_private_one_not(self):
        import ipaddress

        assert notesvc.public_address(ipaddress.ip_address("93.184.216.34"))
        assert notesvc.public_address(ipaddress.ip_address("2606:4700::6810:84e5"))
        for ip in ("100.64.0.1", "198.18.0.1", "fc00::1", "::ffff:10.0.0.1", "255.255.255.255"):
            assert not notesvc.public_address(ipaddress.ip_address(ip)), ip

    @pytest.mark.slow
    def test_fetching_safely(self, tmp_path):
        tls = LocalTls(tmp_path)
        doc = {
            "client_id": tls.url("/app.json"),
            "client_name": "Meta",
            "redirect_uris": [CALLBACK],
        }
        tls.routes.update(
            {
                "/app.json": (
                    200,
                    {"Content-Type": "application/json"},
                    json.dumps(doc).encode(),
                    0,
                ),
                "/moved": (302, {"Location": tls.url("/app.json")}, b"", 0),
                "/big": (200, {}, b"{" + b" " * 70000 + b"}", 0),
                "/slow": (200, {}, b"{}", 2),
                "/drip": (200, {}, b"{" + b" " * 60 + b"}", 0, 0.1),  # never a read time-out
                "/list": (200, {}, b"[]", 0),
                "/text": (200, {}, b"hello", 0),
                "/gone": (410, {}, b"", 0),
            }
        )
        try:
            assert tls.fetch("/app.json") == doc
            with pytest.raises(ValueError, match="redirect"):
                tls.fetch("/moved")
            with pytest.raises(ValueError, match="over 65536 bytes"):
                tls.fetch("/big")
            started = time.monotonic()
            with pytest.raises(ValueError, match=r"timed out|took over"):
                tls.fetch("/slow", timeout=0.5)
            assert time.monotonic() - started < 2
            started = time.monotonic()  # a byte now and then: the whole fetch is timed
            with pytest.raises(ValueError, match=r"took over 0\.5 s"):
                tls.fetch("/drip", timeout=0.5)
            assert time.monotonic() - started < 2
            with pytest.raises(ValueError, match="not a JSON object"):
                tls.fetch("/list")
            with pytest.raises(ValueError, match="not JSON"):
                tls.fetch("/text")
            with pytest.raises(ValueError, match="HTTP 410"):
                tls.fetch("/gone")
            with pytest.raises(ValueError, match="could not be fetched"):  # an unknown certificate
                notesvc.fetch_client_metadata(
                    tls.url("/app.json"), resolve=tls.loopback, allow=lambda ip: True
                )
        finally:
            tls.close()

    def test_a_metadata_client_is_used_and_cached(self, root, tmp_path):
        svc = notesvc.build_service(notesvc.load_config(env=make_env(root)))
        calls = []
        url = "https://app.example/oauth/client.json"

        def fetch(u):
            calls.append(u)
            return {"client_id": u, "client_name": "Meta\x07 app", "redirect_uris": [CALLBACK]}

        try:
            client = svc.grants.client(url, fetch=fetch)
            assert client == {"id": url, "name": "Meta app", "redirectUris": [CALLBACK], "uri": ""}
            assert svc.grants.client(url, fetch=fetch) == client
            assert calls == [url]
            bad_documents = {
                url + "1": {
                    "client_id": "https://other.example/c.json",
                    "redirect_uris": [CALLBACK],
                },
                url + "2": {"client_id": url + "2", "redirect_uris": ["http://evil.example/cb"]},
                url + "3": {"client_id": url + "3"},
            }
            for bad_url, doc in bad_documents.items():
                with pytest.raises(notesvc.OAuthError) as e:
                    svc.grants.client(bad_url, fetch=lambda u, doc=doc: doc)
                assert e.value.error == "invalid_client"
        finally:
            svc.close()


def owner_headers(setup: dict) -> dict:
    return {"X-Service-Key": setup["apiKey"]}


class TestGrantsLive:
    pytestmark = [pytest.mark.real_server, pytest.mark.slow]

    def test_a_key_revoked_while_in_use_is_refused_on_its_next_request(self, tmp_path):
        with running(tmp_path, env={"SERVICE_THREADS": "4"}) as server:
            setup = server.request("GET", f"{API}/system/setup")[2]["data"]
            body = {"name": "tablet", "scope": "read"}
            _, _, made = server.request("POST", f"{API}/auth/keys", body, owner_headers(setup))
            grant = made["data"]
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
            try:

                def notes() -> int:  # on one kept-alive connection
                    conn.request("GET", f"{API}/notes", headers={"X-Service-Key": grant["key"]})
                    resp = conn.getresponse()
                    resp.read()
                    return resp.status

                assert [notes() for _ in range(3)] == [200, 200, 200]
                status, _, _ = server.request(
                    "DELETE", f"{API}/auth/keys/{grant['id']}", headers=owner_headers(setup)
                )
                assert status == 200
                assert notes() == 401
            finally:
                conn.close()
            state = (tmp_path / ".notesvc" / "state.json").read_text()
            assert grant["key"] not in state
            assert grant["id"] not in state
            assert grant["key"] not in "".join(server.lines)

    def test_a_key_revoked_by_another_process_is_refused(self, tmp_path):
        with running(tmp_path) as server:
            setup = server.request("GET", f"{API}/system/setup")[2]["data"]
            body = {"name": "tablet", "scope": "read"}
            grant = server.request("POST", f"{API}/auth/keys", body, owner_headers(setup))[2][
                "data"
            ]
            headers = {"X-Service-Key": grant["key"]}
            assert server.request("GET", f"{API}/notes", headers=headers)[0] == 200
            state_file = tmp_path / ".notesvc" / "state.json"  # as another tool would
            state = json.loads(state_file.read_text())
            state["grants"] = []
            tmp = state_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(state))
            os.replace(tmp, state_file)
            assert server.request("GET", f"{API}/notes", headers=headers)[0] == 401


class TestStructure:
    """The module's shape: sections in data-flow order, and what the Service owns."""

    @pytest.mark.slow
    def test_no_section_uses_a_name_defined_in_a_later_one(self):
        import ast
        import bisect

        src = Path(NOTESVC).read_text()
        tree = ast.parse(src)
        lines = src.splitlines()
        banners = [i + 1 for i, line in enumerate(lines) if line.startswith("# == ")]

        def section(lineno: int) -> int:
            return bisect.bisect_right(banners, lineno)

        defined: dict = {}
        for node in tree.body:
            names = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names = [node.target.id]
            for name in names:
                defined.setdefault(name, section(node.lineno))

        class Uses(ast.NodeVisitor):  # every name loaded, annotations left out
            def __init__(self):
                self.names: list = []

            def visit_arg(self, node):
                pass

            def visit_FunctionDef(self, node):
                for part in [*node.decorator_list, *node.args.defaults, *node.body]:
                    self.visit(part)
                for default in node.args.kw_defaults:
                    if default is not None:
                        self.visit(default)

            visit_AsyncFunctionDef = visit_FunctionDef

            def visit_AnnAssign(self, node):
                if node.value is not None:
                    self.visit(node.value)

            def visit_Name(self, node):
                if isinstance(node.ctx, ast.Load):
                    self.names.append((node.lineno, node.id))

        outline = [lines[b - 1][5:].strip(" =") for b in banners]
        late = []
        for node in tree.body:
            uses = Uses()
            uses.visit(node)
            here = section(node.lineno)
            late += [
                f"line {line}: {name} (defined in {outline[defined[name] - 1]})"
                for line, name in uses.names
                if defined.get(name, 0) > here
            ]
        assert late == []
        assert outline.index("Service") == outline.index("State and auth") + 1
        assert outline.index("Web client") < outline.index("Relay") < outline.index("HTTP")

    def test_service_declares_every_attribute_in_init(self, anon):
        svc = anon.app.service
        declared = set(vars(notesvc.build_service(svc.config, readonly=True)))
        assert set(vars(svc)) <= declared

    def test_a_failed_index_update_is_retried_by_the_next_rescan(self, make_app, caplog):
        client = with_key(make_app())
        svc = client.app.service

        class FlakyIndex(notesvc.SearchIndex):  # the write happens; indexing it fails once
            failed = False

            def add(self, *args, **kwargs):
                if not FlakyIndex.failed:
                    FlakyIndex.failed = True
                    raise RuntimeError("index full of gremlins")
                return super().add(*args, **kwargs)

        svc.index = FlakyIndex()
        svc.sync_index()
        caplog.set_level("ERROR", logger="notesvc")
        rid = "gremlin-request-1"
        client.post_json(
            f"{API}/notes",
            {"path": "notes/g.md", "content": "kumquat"},
            headers={"X-Request-Id": rid},
            status=201,
        )
        assert any(rid in r.getMessage() and "notes/g.md" in r.getMessage() for r in caplog.records)
        assert search(client, "kumquat")["total"] == 0  # not indexed yet
        svc.sync_index()  # what the rescan runs
        assert search(client, "kumquat")["total"] == 1


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

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
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


class TestAgent:
    @pytest.fixture
    def app(self, make_app, upstream):
        def make(**env):
            env.setdefault("SERVICE_TELEGRAM_API_BASE", upstream.url)
            env.setdefault("SERVICE_WHATSAPP_API_BASE", upstream.url + "/v21.0")
            client = with_key(make_app(**env))
            if not client.app.service.notes.exists("notes/home/keys.md"):
                seed_notes(client)
            return client

        return make

    def test_status_local(self, app):
        assert data(app().get(f"{API}/agent/status")) == {
            "enabled": True,
            "provider": "local",
            "model": "notesvc-local",
        }

    def test_local_answers_a_natural_question_from_the_notes(self, app):
        d = data(app().post_json(f"{API}/agent/chat", {"message": "where are the spare keys?"}))
        assert d["provider"] == "local"
        assert "Spare keys are under the blue flowerpot." in d["reply"]
        assert "notes/home/keys.md" in d["reply"]
        assert d["sources"][0] == {"path": "notes/home/keys.md", "title": "Keys"}

    def test_local_is_deterministic(self, app):
        client = app()
        replies = {
            data(client.post_json(f"{API}/agent/chat", {"message": "when do I water tomatoes"}))[
                "reply"
            ]
            for _ in range(3)
        }
        assert len(replies) == 1
        assert "Water them daily." in replies.pop()

    def test_local_says_honestly_when_nothing_matches(self, app):
        d = data(app().post_json(f"{API}/agent/chat", {"message": "where is the submarine?"}))
        assert d["reply"].startswith("Nothing in your notes matches")
        assert d["sources"] == []

    def test_note_path_comes_first_only_when_it_matches(self, app):
        client = app()
        d = data(
            client.post_json(
                f"{API}/agent/chat", {"message": "what about tomatoes", "notePath": "notes/work.md"}
            )
        )  # issue 16: the open note no longer comes first whatever the question
        assert [s["path"] for s in d["sources"]] == ["notes/garden.md"]
        assert "Tuesday" not in d["reply"]
        put_note(client, "notes/more.md", "# More\n\nTomatoes again, and the meeting moved.")
        d = data(
            client.post_json(
                f"{API}/agent/chat", {"message": "the meeting", "notePath": "notes/work.md"}
            )
        )
        assert d["sources"][0]["path"] == "notes/work.md"

    @pytest.mark.parametrize(
        ("body", "status"),
        [
            ({}, 400),
            ({"message": ""}, 400),
            ({"message": "   "}, 400),
            ({"message": "x" * 8001}, 400),
            ({"message": 5}, 400),
            ({"message": "hi", "channel": "fax"}, 400),
            ({"message": "hi", "notePath": "../etc/passwd"}, 400),
            ({"message": "hi", "notePath": 7}, 400),
            ({"message": "hi", "notePath": "notes/missing.md"}, 404),
        ],
    )
    def test_chat_validation(self, app, body, status):
        resp = app().post_json(f"{API}/agent/chat", body, status=status)
        assert_error(resp, status, "VALIDATION_ERROR" if status == 400 else "NOT_FOUND")

    def test_message_of_8000_chars_and_channel_are_accepted(self, app):
        client = app()
        client.post_json(f"{API}/agent/chat", {"message": "k" * 8000, "channel": "web"})

    def test_none_provider(self, app):
        client = app(SERVICE_AGENT_PROVIDER="none")
        assert data(client.get(f"{API}/agent/status"))["enabled"] is False
        resp = client.post_json(f"{API}/agent/chat", {"message": "hi"}, status=503)
        assert_error(resp, 503, "AGENT_DISABLED")

    def test_openai_gets_the_notes_and_the_question(self, app, upstream):
        client = app(
            SERVICE_AGENT_PROVIDER="openai",
            SERVICE_AGENT_BASE_URL=upstream.url + "/v1",
            SERVICE_AGENT_MODEL="llama3.2",
            SERVICE_AGENT_API_KEY="sk-test-agent-key",
        )
        status = data(client.get(f"{API}/agent/status"))
        assert status == {"enabled": True, "provider": "openai", "model": "llama3.2"}
        d = data(client.post_json(f"{API}/agent/chat", {"message": "where are the spare keys?"}))
        assert d["reply"] == upstream.reply
        assert d["provider"] == "openai"
        assert d["model"] == "llama3.2-served"
        assert d["sources"][0]["path"] == "notes/home/keys.md"
        sent = upstream.requests[-1]
        assert sent["path"] == "/v1/chat/completions"
        assert sent["headers"]["Authorization"] == "Bearer sk-test-agent-key"
        assert sent["json"]["model"] == "llama3.2"
        system, user = sent["json"]["messages"]
        assert system["role"] == "system"
        assert "Spare keys are under the blue flowerpot." in system["content"]
        assert "notes/home/keys.md" in system["content"]
        assert user == {"role": "user", "content": "where are the spare keys?"}

    def test_openai_without_key_sends_no_authorization(self, app, upstream):
        client = app(
            SERVICE_AGENT_PROVIDER="openai",
            SERVICE_AGENT_BASE_URL=upstream.url + "/v1",
            SERVICE_AGENT_MODEL="m",
        )
        client.post_json(f"{API}/agent/chat", {"message": "hi", "notePath": "notes/work.md"})
        sent = upstream.requests[-1]
        assert "Authorization" not in sent["headers"]
        assert "The meeting is on Tuesday at ten." in sent["json"]["messages"][0]["content"]

    def test_openai_context_is_trimmed_to_the_budget(self, app, upstream):
        client = app(
            SERVICE_AGENT_PROVIDER="openai",
            SERVICE_AGENT_BASE_URL=upstream.url + "/v1",
            SERVICE_AGENT_MODEL="m",
        )
        put_note(client, "notes/huge.md", "# Huge\n\n" + "giraffe facts. " * 20000)
        client.post_json(f"{API}/agent/chat", {"message": "giraffe", "notePath": "notes/huge.md"})
        system = upstream.requests[-1]["json"]["messages"][0]["content"]
        assert len(system) < notesvc.CONTEXT_BUDGET + 1000

    @pytest.mark.parametrize(
        ("setup", "status", "code"),
        [
            ("http500", 502, "UPSTREAM_ERROR"),
            ("not-json", 502, "UPSTREAM_ERROR"),
            ("no-choices", 502, "UPSTREAM_ERROR"),
            ("unreachable", 502, "UPSTREAM_ERROR"),
            ("slow", 504, "UPSTREAM_TIMEOUT"),
        ],
    )
    def test_openai_failures(self, app, upstream, setup, status, code):
        base = upstream.url + "/v1"
        if setup == "http500":
            upstream.status = 500
        elif setup == "not-json":
            upstream.raw = b"<html>oops</html>"
        elif setup == "no-choices":
            upstream.raw = b'{"object": "chat.completion", "choices": []}'
        elif setup == "unreachable":
            base = closed_port_url()
        elif setup == "slow":
            upstream.delay = 3
        client = app(
            SERVICE_AGENT_PROVIDER="openai",
            SERVICE_AGENT_BASE_URL=base,
            SERVICE_AGENT_MODEL="m",
            SERVICE_AGENT_API_KEY="sk-never-shown",
            SERVICE_AGENT_TIMEOUT="0.5",
        )
        started = time.monotonic()
        resp = client.post_json(f"{API}/agent/chat", {"message": "keys"}, status=status)
        assert time.monotonic() - started < 2.5
        assert_error(resp, status, code)
        assert "sk-never-shown" not in resp.text

    @pytest.mark.parametrize(
        ("env", "names"),
        [
            ({"SERVICE_AGENT_PROVIDER": "skynet"}, "SERVICE_AGENT_PROVIDER"),
            ({"SERVICE_AGENT_PROVIDER": "openai", "SERVICE_AGENT_MODEL": "m"}, "BASE_URL"),
            (
                {"SERVICE_AGENT_PROVIDER": "openai", "SERVICE_AGENT_BASE_URL": "http://x/v1"},
                "SERVICE_AGENT_MODEL",
            ),
        ],
    )
    def test_bad_agent_config_stops_startup(self, root, env, names):
        with pytest.raises(notesvc.ConfigError, match=names):
            notesvc.create_app(notesvc.load_config(env=make_env(root, **env)))

    @pytest.mark.parametrize("name", list(notesvc.AGENT_PROVIDERS))
    def test_every_agent_provider_answers(self, app, upstream, name):
        provider = notesvc.AGENT_PROVIDERS[name]
        client = app(
            SERVICE_AGENT_PROVIDER=name,
            SERVICE_AGENT_BASE_URL=upstream.url + "/v1",
            SERVICE_AGENT_MODEL="m",
        )
        status = data(client.get(f"{API}/agent/status"))
        assert status["provider"] == name
        assert status["enabled"] is provider.enabled
        resp = client.post_json(f"{API}/agent/chat", {"message": "spare keys"}, expect_errors=True)
        if provider.enabled:
            assert data(resp)["reply"]
        else:
            assert_error(resp, 503, "AGENT_DISABLED")

    def test_agent_url_userinfo_becomes_basic_and_secrets_stay_hidden(self, app, upstream):
        port = upstream.url.rsplit(":", 1)[1]
        client = app(
            SERVICE_AGENT_PROVIDER="openai",
            SERVICE_AGENT_BASE_URL=f"http://user:pa%40ss@127.0.0.1:{port}/v1?token=abc",
            SERVICE_AGENT_MODEL="m",
        )
        d = data(client.post_json(f"{API}/agent/chat", {"message": "where are the spare keys?"}))
        assert d["reply"] == upstream.reply
        sent = upstream.requests[-1]
        assert sent["path"] == "/v1/chat/completions?token=abc"
        assert (
            sent["headers"]["Authorization"] == "Basic " + base64.b64encode(b"user:pa@ss").decode()
        )
        shown = {
            "system": data(client.get(f"{API}/system/config"))["agent"]["baseUrl"],
            "security": data(client.get(f"{API}/security/config"))["agent"]["baseUrl"],
        }
        for url in shown.values():
            assert url == f"http://127.0.0.1:{port}/v1?token=…"
            assert "pa" not in url
            assert "abc" not in url
        for path in ("/system/config", "/security/config"):
            text = client.get(f"{API}{path}").text
            assert "pa%40ss" not in text
            assert "pa@ss" not in text
            assert "abc" not in text

    def test_agent_api_key_wins_over_url_userinfo(self, app, upstream):
        port = upstream.url.rsplit(":", 1)[1]
        client = app(
            SERVICE_AGENT_PROVIDER="openai",
            SERVICE_AGENT_BASE_URL=f"http://user:pass@127.0.0.1:{port}/v1/",
            SERVICE_AGENT_MODEL="m",
            SERVICE_AGENT_API_KEY="sk-wins",
        )
        client.post_json(f"{API}/agent/chat", {"message": "keys"})
        sent = upstream.requests[-1]
        assert sent["path"] == "/v1/chat/completions"
        assert sent["headers"]["Authorization"] == "Bearer sk-wins"


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


UPDATES = {"telegram": telegram_update, "whatsapp": whatsapp_update, "web": web_update}


MINIMAL_CONFIG = {
    "telegram": {"botToken": "123456:ABC-telegram-token"},
    "whatsapp": {
        "accessToken": "EAAG-whatsapp-token",
        "phoneNumberId": "106540352242922",
        "verifyToken": "verify-me-please",
    },
    "web": {},
}


class TestChannels:
    @pytest.fixture
    def client(self, make_app, upstream):
        client = with_key(
            make_app(
                SERVICE_TELEGRAM_API_BASE=upstream.url,
                SERVICE_WHATSAPP_API_BASE=upstream.url + "/v21.0",
            )
        )
        seed_notes(client)
        return client

    def create(self, client, provider, **config):
        body = {"provider": provider, "config": {**MINIMAL_CONFIG[provider], **config}}
        return data(client.post_json(f"{API}/channels", body, status=201))

    def hook(self, client, provider, payload, secret, status=200, how="header"):
        url = f"{API}/channels/webhook/{provider}"
        headers = {}
        if how == "header":
            headers["X-Service-Channel-Secret"] = secret
        elif how == "telegram":
            headers["X-Telegram-Bot-Api-Secret-Token"] = secret
        else:
            url += "?" + urllib.parse.urlencode({"secret": secret})
        anon = webtest.TestApp(client.app)
        return anon.post_json(url, payload, headers=headers, status=status)

    def test_providers_list_their_config_fields(self, client):
        providers = data(client.get(f"{API}/channels/providers"))["providers"]
        assert [p["name"] for p in providers] == list(notesvc.CHANNEL_PROVIDERS)
        telegram = next(p for p in providers if p["name"] == "telegram")
        fields = {f["name"]: f for f in telegram["fields"]}
        assert fields["botToken"]["required"] is True
        assert fields["botToken"]["secret"] is True
        assert "allowedChatIds" in fields
        whatsapp = next(p for p in providers if p["name"] == "whatsapp")
        assert {"accessToken", "phoneNumberId", "verifyToken", "allowedNumbers"} <= {
            f["name"] for f in whatsapp["fields"]
        }

    def test_create_shows_secrets_once_and_lists_redact(self, client, root):
        ch = self.create(client, "telegram", allowedChatIds=[42])
        assert set(ch) == {
            "id",
            "provider",
            "name",
            "enabled",
            "createdAt",
            "webhookUrl",
            "secret",
            "config",
        }
        assert ch["config"]["botToken"] == "123456:ABC-telegram-token"
        assert ch["config"]["allowedChatIds"] == ["42"]
        assert ch["webhookUrl"].endswith("/api/v1/channels/webhook/telegram")
        assert len(ch["secret"]) >= 32
        listed = data(client.get(f"{API}/channels"))["channels"]
        text = json.dumps(listed)
        assert ch["secret"] not in text
        assert "ABC-telegram-token" not in text
        assert listed[0]["config"]["botToken"].startswith("…")
        state = root / ".notesvc" / "state.json"
        assert stat.S_IMODE(os.stat(state).st_mode) == 0o600

    def test_channels_survive_a_restart(self, client, make_app):
        ch = self.create(client, "web")
        again = with_key(make_app())
        assert [c["id"] for c in data(again.get(f"{API}/channels"))["channels"]] == [ch["id"]]

    @pytest.mark.parametrize(
        "body",
        [
            {"provider": "carrier-pigeon", "config": {}},
            {"config": {}},
            {"provider": "telegram", "config": {}},
            {"provider": "telegram", "config": {"botToken": 5}},
            {"provider": "telegram", "config": {"botToken": "t", "allowedChatIds": "42"}},
            {"provider": "telegram", "config": {"botToken": "t", "extra": 1}},
            {"provider": "telegram", "config": "token"},
            {"provider": "whatsapp", "config": {"accessToken": "a"}},
            {"provider": "web", "name": "x" * 101},
        ],
    )
    def test_create_validation(self, client, body):
        resp = client.post_json(f"{API}/channels", body, status=400)
        assert_error(resp, 400, "VALIDATION_ERROR")

    def test_toggle_and_delete(self, client):
        ch = self.create(client, "web")
        off = data(client.post(f"{API}/channels/{ch['id']}/toggle"))
        assert off["enabled"] is False
        assert ch["secret"] not in json.dumps(off)
        assert data(client.post(f"{API}/channels/{ch['id']}/toggle"))["enabled"] is True
        assert data(client.delete(f"{API}/channels/{ch['id']}")) == {
            "id": ch["id"],
            "deleted": True,
        }
        assert data(client.get(f"{API}/channels"))["channels"] == []
        for method, url in (
            ("POST", f"{API}/channels/{ch['id']}/toggle"),
            ("DELETE", f"{API}/channels/{ch['id']}"),
        ):
            resp = client.request(url, method=method, status=404)
            assert_error(resp, 404, "NOT_FOUND")

    def test_webhook_errors(self, client):
        ch = self.create(client, "web")
        assert_error(
            self.hook(client, "pigeon", web_update("hi"), ch["secret"], 404), 404, "NOT_FOUND"
        )
        assert_error(self.hook(client, "web", web_update("hi"), "wrong", 401), 401, "UNAUTHORIZED")
        assert_error(self.hook(client, "web", web_update("hi"), "", 401), 401, "UNAUTHORIZED")
        # A secret of another provider's channel is wrong here.
        tg = self.create(client, "telegram")
        self.hook(client, "web", web_update("hi"), tg["secret"], 401)
        client.post(f"{API}/channels/{ch['id']}/toggle")
        resp = self.hook(client, "web", web_update("hi"), ch["secret"], 403)
        assert_error(resp, 403, "CHANNEL_DISABLED")

    def test_webhook_failures_count_toward_lockout(self, client):
        self.create(client, "web")
        for _ in range(10):
            self.hook(client, "web", web_update("hi"), "wrong", 401)
        resp = self.hook(client, "web", web_update("hi"), "wrong", 429)
        assert_error(resp, 429, "RATE_LIMITED")

    def test_telegram_save_writes_the_daily_note_and_replies(self, client, upstream, root):
        ch = self.create(client, "telegram", allowedChatIds=[42])
        resp = self.hook(
            client, "telegram", telegram_update("/save buy milk"), ch["secret"], how="telegram"
        )
        assert data(resp) == {"handled": True, "delivered": True}
        inbox = list((root / "notes" / "daily").glob("*.md"))  # CONTRACT 20: the daily note
        assert len(inbox) == 1
        text = inbox[0].read_text()
        assert re.search(r"^- \d\d:\d\d buy milk$", text, re.M)
        assert text.startswith("# " + notesvc.day_note(notesvc.dt.date.today())[1])
        sent = upstream.requests[-1]
        assert sent["path"] == "/bot123456:ABC-telegram-token/sendMessage"
        assert sent["json"]["chat_id"] == "42"
        assert "Saved to notes/daily/" in sent["json"]["text"]
        # A second /save appends to the same note; the index follows.
        self.hook(client, "telegram", telegram_update("/save@my_bot call mum"), ch["secret"])
        assert "call mum" in inbox[0].read_text()
        assert "buy milk" in inbox[0].read_text()
        assert hits(client, "milk") == [str(inbox[0].relative_to(root))]

    def test_telegram_question_reaches_the_agent_and_the_chat(self, client, upstream):
        ch = self.create(client, "telegram")
        self.hook(
            client, "telegram", telegram_update("where did I put the spare keys?"), ch["secret"]
        )
        reply = upstream.requests[-1]["json"]["text"]
        assert "Spare keys are under the blue flowerpot." in reply

    def test_search_command(self, client, upstream):
        ch = self.create(client, "telegram")
        self.hook(client, "telegram", telegram_update("/search tomatoes"), ch["secret"])
        reply = upstream.requests[-1]["json"]["text"]
        assert "Garden — notes/garden.md" in reply
        self.hook(client, "telegram", telegram_update('/search "open'), ch["secret"])
        assert "quote" in upstream.requests[-1]["json"]["text"]

    def test_update_without_text_is_not_handled(self, client, upstream):
        ch = self.create(client, "telegram")
        sticker = telegram_update(None, sticker={"file_id": "x", "emoji": "👍"})
        assert data(self.hook(client, "telegram", sticker, ch["secret"]))["handled"] is False
        assert (
            data(self.hook(client, "telegram", {"update_id": 5}, ch["secret"]))["handled"] is False
        )
        assert upstream.requests == []

    def test_sender_outside_allowlist_learns_nothing(self, client, upstream):
        ch = self.create(client, "telegram", allowedChatIds=["42"])
        resp = self.hook(
            client, "telegram", telegram_update("spare keys", chat_id=666), ch["secret"]
        )
        assert data(resp) == {"handled": False, "reason": "sender not allowed"}
        assert "flowerpot" not in resp.text
        assert upstream.requests == []

    def test_failed_delivery_is_200_delivered_false(self, client, upstream, caplog):
        ch = self.create(client, "telegram")
        upstream.status = 500
        resp = self.hook(client, "telegram", telegram_update("keys"), ch["secret"])
        assert data(resp) == {"handled": True, "delivered": False}
        assert any("delivering the reply failed" in r.getMessage() for r in caplog.records)

    def test_whatsapp_round_trip_and_verification(self, client, upstream):
        ch = self.create(client, "whatsapp", allowedNumbers=["15551234567"])
        resp = self.hook(
            client,
            "whatsapp",
            whatsapp_update("where are the spare keys"),
            ch["secret"],
            how="query",
        )
        assert data(resp) == {"handled": True, "delivered": True}
        sent = upstream.requests[-1]
        assert sent["path"] == "/v21.0/106540352242922/messages"
        assert sent["headers"]["Authorization"] == "Bearer EAAG-whatsapp-token"
        assert sent["json"]["to"] == "15551234567"
        assert sent["json"]["messaging_product"] == "whatsapp"
        assert "flowerpot" in sent["json"]["text"]["body"]
        assert client.app.service.query_secret_seen_at > 0
        anon = webtest.TestApp(client.app)
        ok = anon.get(
            f"{API}/channels/webhook/whatsapp",
            {
                "hub.mode": "subscribe",
                "hub.verify_token": "verify-me-please",
                "hub.challenge": "1158201444",
            },
        )
        assert ok.text == "1158201444"
        bad = anon.get(
            f"{API}/channels/webhook/whatsapp",
            {"hub.mode": "subscribe", "hub.verify_token": "nope", "hub.challenge": "1"},
            status=403,
        )
        assert_error(bad, 403, "FORBIDDEN")
        image = whatsapp_update(None)
        assert data(self.hook(client, "whatsapp", image, ch["secret"]))["handled"] is False

    def test_web_replies_inline(self, client, upstream):
        ch = self.create(client, "web")
        d = data(self.hook(client, "web", web_update("when do I plant tomatoes?"), ch["secret"]))
        assert d["handled"] is True
        assert "Plant tomatoes in May." in d["reply"]
        assert upstream.requests == []

    @pytest.mark.parametrize("name", list(notesvc.CHANNEL_PROVIDERS))
    def test_every_channel_provider_handles_a_text_update(self, client, upstream, name):
        assert name in UPDATES, f"add a sample update of channel provider {name} to UPDATES"
        assert name in MINIMAL_CONFIG, f"add channel provider {name} to MINIMAL_CONFIG"
        ch = self.create(client, name)
        resp = self.hook(client, name, UPDATES[name]("/search tomatoes"), ch["secret"])
        assert data(resp)["handled"] is True
        empty = self.hook(client, name, UPDATES[name](None), ch["secret"])
        assert data(empty)["handled"] is False

    def test_no_secret_in_any_log_line(self, client, upstream, caplog):
        caplog.set_level("DEBUG", logger="notesvc")
        tg = self.create(client, "telegram")
        wa = self.create(client, "whatsapp")
        self.hook(client, "telegram", telegram_update("keys"), tg["secret"])
        self.hook(client, "whatsapp", whatsapp_update("keys"), wa["secret"], how="query")
        upstream.status = 500
        self.hook(client, "telegram", telegram_update("keys"), tg["secret"])
        logged = "\n".join(r.getMessage() for r in caplog.records)
        for secret in (
            tg["secret"],
            wa["secret"],
            "ABC-telegram-token",
            "EAAG-whatsapp-token",
            "verify-me-please",
            key_of(client),
        ):
            assert secret not in logged

    def test_webhook_url_through_the_relay_prefix_carries_it(self, client):
        sid = client.app.service.state.read()["serverId"]
        direct = self.create(client, "web")["webhookUrl"]
        body = {"provider": "web", "config": {}}
        ch = data(client.post_json(f"/r/{sid}{API}/channels", body, status=201))
        assert ch["webhookUrl"] == direct.replace(API, f"/r/{sid}{API}")
        assert ch["webhookUrl"].endswith(f"/r/{sid}/api/v1/channels/webhook/web")
        hook = urllib.parse.urlsplit(ch["webhookUrl"]).path
        anon = webtest.TestApp(client.app)
        resp = anon.post_json(
            hook,
            web_update("when do I plant tomatoes?"),
            headers={"X-Service-Channel-Secret": ch["secret"]},
        )
        assert "Plant tomatoes in May." in data(resp)["reply"]

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_webhook_url_through_a_real_relay_carries_the_prefix(self, tmp_path):
        relay = Server(tmp_path / "relay", "relay", env={"SERVICE_RELAY_TIMEOUT": "5"})
        server = Server(tmp_path / "srv", env={"SERVICE_RELAY_URL": relay.url})
        try:
            wait_for(lambda: relay_servers(relay) == 1)
            setup = server.request("GET", f"{API}/system/setup")[2]["data"]
            prefix = f"/r/{setup['serverId']}{API}"
            key = {"X-Service-Key": setup["apiKey"]}
            body = {"provider": "web", "config": {}}
            status, _, answer = relay.request("POST", f"{prefix}/channels", body, key)
            assert status == 201
            ch = answer["data"]
            assert ch["webhookUrl"] == f"{relay.url}{prefix}/channels/webhook/web"
            hook = ch["webhookUrl"][len(relay.url) :]
            secret = {"X-Service-Channel-Secret": ch["secret"]}
            status, _, answer = relay.request("POST", hook, web_update("hello"), secret)
            assert status == 200
            assert answer["data"]["handled"] is True
        finally:
            server.stop()
            relay.stop()

    def test_patch_merges_config_and_keeps_the_secret(self, client, upstream, root):
        ch = self.create(client, "telegram", allowedChatIds=[42])
        url = f"{API}/channels/{ch['id']}"
        body = {"name": "Family bot", "config": {"allowedChatIds": [42, "7"]}}
        changed = data(client.patch_json(url, body))
        assert changed["name"] == "Family bot"
        assert changed["config"]["allowedChatIds"] == ["42", "7"]
        assert changed["config"]["botToken"].startswith("…")
        assert changed["secret"] == notesvc.redact(ch["secret"])
        assert ch["secret"] not in json.dumps(changed)
        assert "ABC-telegram-token" not in json.dumps(changed)
        assert set(changed) == set(ch)
        stored = json.loads((root / ".notesvc" / "state.json").read_text())["channels"][0]
        assert stored["secret"] == ch["secret"]
        assert stored["config"]["botToken"] == "123456:ABC-telegram-token"
        # The new sender gets through with the old secret; the name alone changes only it.
        resp = self.hook(client, "telegram", telegram_update("keys", chat_id=7), ch["secret"])
        assert data(resp) == {"handled": True, "delivered": True}
        assert upstream.requests[-1]["path"] == "/bot123456:ABC-telegram-token/sendMessage"
        again = data(client.patch_json(url, {"name": "Bot"}))
        assert again["name"] == "Bot"
        assert again["config"]["allowedChatIds"] == ["42", "7"]
        assert data(client.get(url))["name"] == "Bot"

    @pytest.mark.parametrize(
        ("body", "status"),
        [
            ({}, 400),
            ({"secret": "mine"}, 400),
            ({"enabled": False}, 400),
            ({"provider": "web"}, 400),
            ({"config": {"extra": 1}}, 400),
            ({"config": {"allowedChatIds": "42"}}, 400),
            ({"config": {"allowedChatIds": [True]}}, 400),
            ({"config": {"botToken": 5}}, 400),
            ({"config": {"botToken": ""}}, 400),
            ({"config": {"botToken": "line\nbreak"}}, 400),
            ({"config": "token"}, 400),
            ({"config": []}, 400),
            ({"name": 5}, 400),
            ({"name": ""}, 400),
            ({"name": "x" * 101}, 400),
            (b'{"name": "x"', 400),
            (b"[1, 2]", 400),
            (b"", 400),
            pytest.param(b'{"name": "' + b"x" * 1_100_000 + b'"}', 413, id="huge-body"),
        ],
    )
    def test_patch_validation(self, client, root, body, status):
        ch = self.create(client, "telegram", allowedChatIds=[42])
        url = f"{API}/channels/{ch['id']}"
        state = root / ".notesvc" / "state.json"
        before = json.loads(state.read_text())["channels"]
        if isinstance(body, bytes):
            resp = client.patch(url, body, content_type="application/json", status=status)
        else:
            resp = client.patch_json(url, body, status=status)
        assert_error(resp, status, "VALIDATION_ERROR" if status == 400 else "PAYLOAD_TOO_LARGE")
        assert json.loads(state.read_text())["channels"] == before
        assert ch["secret"] not in resp.text

    def test_patch_and_get_of_an_unknown_channel_are_404(self, client):
        for resp in (
            client.patch_json(f"{API}/channels/ch_nope", {"name": "x"}, status=404),
            client.get(f"{API}/channels/ch_nope", status=404),
        ):
            assert_error(resp, 404, "NOT_FOUND")
        anon = webtest.TestApp(client.app)
        ch = self.create(client, "web")
        url = f"{API}/channels/{ch['id']}"
        resp = client.patch(url, "x", content_type="text/plain", status=415)
        assert_error(resp, 415, "UNSUPPORTED_MEDIA_TYPE")
        for method in ("GET", "PATCH"):
            resp = anon.request(f"{API}/channels/{ch['id']}", method=method, status=401)
            assert_error(resp, 401, "UNAUTHORIZED")

    def test_get_shows_refused_senders_and_the_log_names_them(self, client, upstream, caplog):
        caplog.set_level("INFO", logger="notesvc")
        ch = self.create(client, "telegram", allowedChatIds=[42])
        url = f"{API}/channels/{ch['id']}"
        fresh = data(client.get(url))
        assert fresh["refusedSenders"] == []
        assert fresh["secret"] == notesvc.redact(ch["secret"])
        assert fresh["config"]["botToken"].startswith("…")
        assert ch["secret"] not in json.dumps(fresh)
        update = telegram_update("the secret diary text", chat_id=666)
        update["message"]["from"]["first_name"] = "Mallory"
        resp = self.hook(client, "telegram", update, ch["secret"])
        assert data(resp) == {"handled": False, "reason": "sender not allowed"}
        refused = data(client.get(url))["refusedSenders"]
        assert [(r["sender"], r["name"]) for r in refused] == [("666", "Mallory")]
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z", refused[0]["at"])
        logged = [r for r in caplog.records if "refused sender" in r.getMessage()]
        assert [r.levelname for r in logged] == ["INFO"]
        assert logged[0].getMessage() == (
            f"channel {ch['id']}: refused sender 666 (Mallory) — "
            "add it to config.allowedChatIds to allow"
        )
        everything = "\n".join(r.getMessage() for r in caplog.records)
        assert "secret diary" not in everything
        # Listings stay as they were; the refused senders survive a toggle and a PATCH.
        assert "refusedSenders" not in data(client.get(f"{API}/channels"))["channels"][0]
        client.post(f"{API}/channels/{ch['id']}/toggle")
        client.post(f"{API}/channels/{ch['id']}/toggle")
        client.patch_json(url, {"name": "renamed"})
        assert data(client.get(url))["refusedSenders"] == refused
        assert upstream.requests == []

    def test_refused_senders_keep_the_last_ten_distinct(self, client):
        ch = self.create(client, "telegram", allowedChatIds=[42])
        for chat_id in [*range(1000, 1012), 1003]:
            self.hook(client, "telegram", telegram_update("hi", chat_id=chat_id), ch["secret"])
        refused = data(client.get(f"{API}/channels/{ch['id']}"))["refusedSenders"]
        # 1000 and 1001 fell off; 1003 wrote again and moved to the end, once.
        assert [r["sender"] for r in refused] == [str(i) for i in (1002, *range(1004, 1012), 1003)]

    def test_whatsapp_refused_sender_has_the_contact_name(self, client, upstream):
        ch = self.create(client, "whatsapp", allowedNumbers=["15551234567"])
        self.hook(client, "whatsapp", whatsapp_update("hi", number="15550000000"), ch["secret"])
        refused = data(client.get(f"{API}/channels/{ch['id']}"))["refusedSenders"]
        assert [(r["sender"], r["name"]) for r in refused] == [("15550000000", "Ada")]
        assert upstream.requests == []

    def test_plugin_provider_parsing_pairs_still_works(self, make_app, root):
        plugins = root / ".notesvc" / "plugins"
        plugins.mkdir(parents=True)
        (plugins / "pigeon.py").write_text(
            "import notesvc\n"
            "@notesvc.channel_provider('pigeon', (notesvc.ConfigField('allowedBirds', 'list'),),\n"
            "                          allow='allowedBirds')\n"
            "def parse(payload):\n"
            "    return [(str(payload.get('bird', '')), payload.get('text'))]\n"
            "PLUGIN = notesvc.Plugin(name='pigeon', description='carrier pigeons')\n"
        )
        try:
            client = with_key(make_app())
            body = {"provider": "pigeon", "config": {"allowedBirds": ["rex"]}}
            ch = data(client.post_json(f"{API}/channels", body, status=201))
            anon = webtest.TestApp(client.app)
            hook = f"{API}/channels/webhook/pigeon"
            secret = {"X-Service-Channel-Secret": ch["secret"]}
            ok = data(anon.post_json(hook, {"bird": "rex", "text": "/save seed"}, headers=secret))
            assert ok["handled"] is True
            no = data(anon.post_json(hook, {"bird": "crow", "text": "hi"}, headers=secret))
            assert no == {"handled": False, "reason": "sender not allowed"}
            refused = data(client.get(f"{API}/channels/{ch['id']}"))["refusedSenders"]
            assert [(r["sender"], r["name"]) for r in refused] == [("crow", "")]
            changed = client.patch_json(
                f"{API}/channels/{ch['id']}", {"config": {"allowedBirds": ["crow"]}}
            )
            assert data(changed)["config"]["allowedBirds"] == ["crow"]
        finally:
            notesvc.CHANNEL_PROVIDERS.pop("pigeon", None)


OGG = b"OggS\x00\x02" + bytes(range(200))


def photo_update(*sizes: tuple, caption: str | None = None, chat_id: int = 42) -> dict:
    """A Telegram photo message: sizes are (file_id, width, height, file_size)."""
    photo = [
        {"file_id": f, "file_unique_id": f"u{f}", "width": w, "height": h, "file_size": n}
        for f, w, h, n in sizes
    ]
    extra = {"caption": caption} if caption else {}
    return telegram_update(None, chat_id, photo=photo, **extra)


def today_note(client, folder: str = "notes/daily") -> Path:
    day = notesvc.local_now(client.app.service).date()
    return client.app.service.config.root / folder / f"{day:%Y-%m-%d}.md"


def whatsapp_media(kind: str, media_id: str, number: str = "15551234567", **fields) -> dict:
    update = whatsapp_update("x", number)
    message = update["entry"][0]["changes"][0]["value"]["messages"][0]
    del message["text"]
    message.update(type=kind, **{kind: {"id": media_id, **fields}})
    return update


def whatsapp_signature(body: bytes, secret: str) -> str:
    import hashlib
    import hmac

    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def audit(app) -> dict:
    return data(with_key(app).get(f"{API}/security/audit"))


class TestCapture:
    @pytest.fixture
    def client(self, make_app, upstream):
        return with_key(
            make_app(
                SERVICE_TELEGRAM_API_BASE=upstream.url,
                SERVICE_WHATSAPP_API_BASE=upstream.url + "/v21.0",
                SERVICE_TRANSCRIBE_URL=upstream.url + "/v1",
                SERVICE_TRANSCRIBE_API_KEY="tr-key-123",
            )
        )

    def create(self, client, provider="telegram", status=201, **config):
        base = {**MINIMAL_CONFIG[provider]}
        if provider == "telegram":
            base.update(allowedChatIds=[42], mode="webhook")
        elif provider == "whatsapp":
            base.update(allowedNumbers=["15551234567"])
        body = {"provider": provider, "config": {**base, **config}}
        return data(client.post_json(f"{API}/channels", body, status=status))

    def hook(self, client, provider, payload, secret, status=200, headers=None):
        anon = webtest.TestApp(client.app)
        headers = {"X-Service-Channel-Secret": secret, **(headers or {})} if secret else headers
        return anon.post_json(
            f"{API}/channels/webhook/{provider}", payload, headers=headers or {}, status=status
        )

    def test_a_photo_becomes_an_attachment_linked_from_the_daily_note(self, client, upstream):
        ch = self.create(client)
        upstream.add_file("ph-s", "photos/file_6.jpg", b"small")
        upstream.add_file("ph-b", "photos/file_7.jpg", PNG)
        update = photo_update(("ph-s", 90, 67, 5), ("ph-b", 1280, 960, len(PNG)), caption="Beach")
        assert data(self.hook(client, "telegram", update, ch["secret"])) == {
            "handled": True,
            "delivered": True,
        }
        text = today_note(client).read_text()
        m = re.search(
            r"^- \d\d:\d\d !\[photo\]\(\.\./\.\./(attachments/inbox/\d{4}-\d\d-\d\d/"
            r"\d{6}-photo\.jpg)\) Beach$",
            text,
            re.M,
        )
        assert m, text
        assert text.startswith("# " + notesvc.day_note(notesvc.local_now(client.app.service))[1])
        assert client.get(att_url(m.group(1))).body == PNG  # the largest size was fetched
        files = [c["json"]["file_id"] for c in upstream.bot_calls if "/getFile" in c["path"]]
        assert files == ["ph-b"]
        assert (
            upstream.downloads[-1]["path"] == "/file/bot123456:ABC-telegram-token/photos/file_7.jpg"
        )
        note = str(today_note(client).relative_to(client.app.service.config.root))
        assert upstream.sent()[-1] == f"Saved the photo to {note}."
        # The same photo again gets its own file, never overwriting the first.
        self.hook(client, "telegram", update, ch["secret"])
        assert len(re.findall(r"-photo(?:-2)?\.jpg", today_note(client).read_text())) == 2

    def test_a_voice_message_is_transcribed_under_its_link(self, client, upstream):
        ch = self.create(client)
        upstream.add_file("vc1", "voice/file_3.oga", OGG)
        voice = {"file_id": "vc1", "file_unique_id": "v", "duration": 4, "mime_type": "audio/ogg"}
        self.hook(client, "telegram", telegram_update(None, voice=voice), ch["secret"])
        text = today_note(client).read_text()
        m = re.search(
            r"^- \d\d:\d\d \[voice message\]\(\.\./\.\./(attachments/inbox/[^)]+-voice\.ogg)\)\n"
            r"  > Remember to buy oat milk and call the plumber\.$",
            text,
            re.M,
        )
        assert m, text
        assert client.get(att_url(m.group(1))).body == OGG
        asked = next(r for r in upstream.requests if r["path"] == "/v1/audio/transcriptions")
        assert asked["headers"]["Authorization"] == "Bearer tr-key-123"
        assert asked["form"]["model"] == (None, b"whisper-1")
        assert asked["form"]["file"][0].endswith("voice.ogg")
        assert asked["form"]["file"][1] == OGG
        assert "call the plumber" in upstream.sent()[-1]
        assert hits(client, "plumber") == [
            str(today_note(client).relative_to(client.app.service.config.root))
        ]

    def test_without_a_transcription_service_the_audio_is_kept_and_said_so(
        self, make_app, upstream
    ):
        client = with_key(make_app(SERVICE_TELEGRAM_API_BASE=upstream.url))
        ch = self.create(client)
        upstream.add_file("au1", "music/file_1.mp3", b"ID3" + bytes(50))
        audio = {"file_id": "au1", "mime_type": "audio/mpeg", "file_name": "Idea 1.mp3"}
        self.hook(client, "telegram", telegram_update(None, audio=audio), ch["secret"])
        text = today_note(client).read_text()
        assert re.search(
            r"\[Idea 1\.mp3\]\(\.\./\.\./attachments/inbox/[^)]+-Idea-1\.mp3\) \(not transcribed\)",
            text,
        ), text
        assert "SERVICE_TRANSCRIBE_URL is not set" in upstream.sent()[-1]
        assert not [r for r in upstream.requests if "transcriptions" in r["path"]]

    def test_a_failed_transcription_keeps_the_audio(self, make_app, upstream, caplog):
        client = with_key(
            make_app(
                SERVICE_TELEGRAM_API_BASE=upstream.url,
                SERVICE_TRANSCRIBE_URL=NOWHERE + "/v1/audio/transcriptions",
            )
        )
        ch = self.create(client)
        upstream.add_file("vc2", "voice/file_4.oga", OGG)
        voice = {"file_id": "vc2", "mime_type": "audio/ogg"}
        self.hook(client, "telegram", telegram_update(None, voice=voice), ch["secret"])
        text = today_note(client).read_text()
        assert "(transcription failed: " in text
        assert len(data(client.get(f"{API}/attachments"))["attachments"]) == 1
        assert any("transcription failed" in r.getMessage() for r in caplog.records)

    def test_files_of_other_types_or_over_the_limit_are_not_saved(self, make_app, upstream, root):
        client = with_key(
            make_app(SERVICE_TELEGRAM_API_BASE=upstream.url, SERVICE_MAX_ATTACHMENT_BYTES="4096")
        )
        ch = self.create(client)
        exe = {"file_id": "d1", "file_name": "setup.exe", "mime_type": "application/x-msdownload"}
        self.hook(client, "telegram", telegram_update(None, document=exe), ch["secret"])
        assert "not accepted" in upstream.sent()[-1]
        big = {
            "file_id": "d2",
            "file_name": "scan.pdf",
            "mime_type": "application/pdf",
            "file_size": 5000,
        }
        self.hook(client, "telegram", telegram_update(None, document=big), ch["secret"])
        assert "over 4096 bytes" in upstream.sent()[-1]
        assert not [c for c in upstream.bot_calls if "/getFile" in c["path"]]  # nothing fetched
        # A size Telegram did not announce is enforced while downloading.
        upstream.add_file("d3", "documents/file_9.pdf", b"%PDF" + b"x" * 5000)
        quiet = {"file_id": "d3", "file_name": "quiet.pdf", "mime_type": "application/pdf"}
        self.hook(client, "telegram", telegram_update(None, document=quiet), ch["secret"])
        assert "over 4096 bytes" in upstream.sent()[-1]
        assert not (root / "attachments").exists() or not list(
            (root / "attachments").rglob("*.pdf")
        )
        assert leftovers(root) == []
        assert not today_note(client).exists()  # nothing saved, nothing written
        # A named document of an accepted type is kept under its own name.
        upstream.add_file("d4", "documents/file_10.pdf", b"%PDF-1.7")
        named = {
            "file_id": "d4",
            "file_name": "Tax return 2026.pdf",
            "mime_type": "application/pdf",
        }
        self.hook(client, "telegram", telegram_update(None, document=named), ch["secret"])
        assert "[Tax return 2026.pdf](../../attachments/inbox/" in today_note(client).read_text()

    def test_whatsapp_image_and_voice_are_fetched_with_the_bearer_token(self, client, upstream):
        ch = self.create(client, "whatsapp")
        upstream.media["img-1"] = ("image/jpeg", PNG)
        upstream.media["aud-1"] = ("audio/ogg; codecs=opus", OGG)
        image = whatsapp_media("image", "img-1", mime_type="image/jpeg", caption="Receipt")
        assert data(self.hook(client, "whatsapp", image, ch["secret"]))["handled"] is True
        voice = whatsapp_media("audio", "aud-1", mime_type="audio/ogg; codecs=opus", voice=True)
        self.hook(client, "whatsapp", voice, ch["secret"])
        text = today_note(client).read_text()
        assert re.search(
            r"!\[photo\]\(\.\./\.\./attachments/inbox/[^)]+-photo\.jpg\) Receipt", text
        )
        assert re.search(
            r"\[voice message\]\([^)]+-voice\.ogg\)\n  > Remember to buy oat milk", text
        )
        fetched = [
            d for d in upstream.downloads if "whatsapp-media" in d["path"] or "/v21.0/" in d["path"]
        ]
        assert len(fetched) == 4
        assert all(d["headers"]["Authorization"] == "Bearer EAAG-whatsapp-token" for d in fetched)
        assert upstream.requests[-1]["json"]["to"] == "15551234567"
        assert "Saved the photo" in upstream.sent()[-2]

    def test_hostile_file_names_and_media_urls_go_nowhere(self, client, upstream, root):
        ch = self.create(client)
        upstream.add_file("h1", "documents/../../etc/passwd", b"root:x:0:0")
        doc = {"file_id": "h1", "file_name": "../../notes/evil.pdf", "mime_type": "application/pdf"}
        self.hook(client, "telegram", telegram_update(None, document=doc), ch["secret"])
        assert "not saved" in upstream.sent()[-1]  # Telegram's path with .. is not followed
        upstream.add_file("h2", "documents/file_2.pdf", b"%PDF")
        doc = {"file_id": "h2", "file_name": "../../notes/evil.pdf", "mime_type": "application/pdf"}
        self.hook(client, "telegram", telegram_update(None, document=doc), ch["secret"])
        saved = data(client.get(f"{API}/attachments"))["attachments"]
        assert [a["path"].rsplit("/", 1)[-1][7:] for a in saved] == ["notes-evil.pdf"]
        assert saved[0]["path"].startswith("attachments/inbox/")
        assert not (root / "notes" / "evil.pdf").exists()
        # A media URL on another plain-HTTP origin never gets the WhatsApp token.
        wa = self.create(client, "whatsapp")
        other = FakeUpstream()
        try:
            upstream.media["m1"] = ("image/jpeg", PNG)
            original = upstream.url
            upstream.url = other.url  # the Graph API answers with a URL elsewhere
            image = whatsapp_media("image", "m1", mime_type="image/jpeg")
            self.hook(client, "whatsapp", image, wa["secret"])
            upstream.url = original
            assert other.downloads == []
            assert "not https" in upstream.sent()[-1]
        finally:
            other.close()

    def test_commands_and_save_to(self, client, upstream, root):
        ch = self.create(client)

        def say(text):
            self.hook(client, "telegram", telegram_update(text), ch["secret"])
            return upstream.sent()[-1]

        assert "/save <text>" in say("/help")
        assert "/save <text>" in say("/start")
        assert "Unknown command /frobnicate" in say("/frobnicate now")
        assert say("/save") == "Usage: /save <text to keep>"
        assert say("/ask") == "Usage: /ask <question>"
        assert say("/search") == "Usage: /search <words>"
        assert say("/today").startswith("Nothing in notes/daily/")
        say("/save first thought")
        today = say("/today")
        assert today.startswith("notes/daily/")
        assert "first thought" in today
        put_note(client, "notes/home/keys.md", KEYS_NOTE)
        assert "flowerpot" in say("/ask where are the spare keys?")
        # saveTo: /save and captures go to a note per day in that folder.
        client.patch_json(f"{API}/channels/{ch['id']}", {"config": {"saveTo": "notes/journal"}})
        assert say("/save second thought").startswith("Saved to notes/journal/")
        assert "second thought" in today_note(client, "notes/journal").read_text()
        assert "second thought" not in today_note(client).read_text()
        assert "second thought" in say("/today")
        upstream.add_file("ph", "photos/p.jpg", PNG)
        self.hook(client, "telegram", photo_update(("ph", 10, 10, len(PNG))), ch["secret"])
        assert "](../../attachments/inbox/" in today_note(client, "notes/journal").read_text()

    @pytest.mark.parametrize(
        "config",
        [
            {"mode": "carrier-pigeon"},
            {"mode": 1},
            {"notify": "yes"},
            {"saveTo": "../etc"},
            {"saveTo": "journal"},
            {"saveTo": "notes/.hidden"},
            {"saveTo": 5},
            {"appSecret": "x"},  # a WhatsApp field
        ],
    )
    def test_new_config_fields_are_validated(self, client, config):
        resp = client.post_json(
            f"{API}/channels",
            {"provider": "telegram", "config": {**MINIMAL_CONFIG["telegram"], **config}},
            status=400,
        )
        assert_error(resp, 400, "VALIDATION_ERROR")

    def test_webhook_mode_sets_the_webhook_with_the_secret(self, client, upstream):
        ch = self.create(client)
        assert upstream.webhook == {
            "url": ch["webhookUrl"],
            "secret_token": ch["secret"],
            "allowed_updates": ["message", "edited_message", "channel_post"],
            "drop_pending_updates": False,
        }
        assert ch["status"]["ok"] is True
        upstream.webhook = None
        changed = data(
            client.patch_json(f"{API}/channels/{ch['id']}", {"config": {"allowedChatIds": [42, 7]}})
        )
        assert upstream.webhook["secret_token"] == ch["secret"]  # PATCH sets it again
        assert changed["status"]["ok"] is True

    def test_a_refused_set_webhook_is_shown_not_failed(self, client, upstream, caplog):
        upstream.webhook_error = (
            "Bad Request: bad webhook: An HTTPS URL must be provided for webhook"
        )
        ch = self.create(client)  # still 201
        assert ch["status"]["ok"] is False
        assert "HTTPS URL must be provided" in ch["status"]["error"]
        shown = data(client.get(f"{API}/channels/{ch['id']}"))
        assert shown["status"] == ch["status"]
        logged = "\n".join(r.getMessage() for r in caplog.records)
        assert "HTTPS URL must be provided" in logged
        for secret in (ch["secret"], "ABC-telegram-token"):
            assert secret not in logged
            assert secret not in json.dumps(shown)

    def test_an_unreachable_telegram_is_shown_not_failed(self, make_app):
        client = with_key(make_app())  # the Bot API base is a closed port
        body = {"provider": "telegram", "config": {**MINIMAL_CONFIG["telegram"], "mode": "webhook"}}
        ch = data(client.post_json(f"{API}/channels", body, status=201))
        assert ch["status"]["ok"] is False
        assert ch["status"]["error"]
        assert "ABC-telegram-token" not in ch["status"]["error"]

    def test_a_channel_stored_before_modes_stays_a_webhook(self, client, upstream, root):
        ch = self.create(client)
        state_file = root / ".notesvc" / "state.json"
        state = json.loads(state_file.read_text())
        for field in ("mode", "saveTo", "notify"):
            del state["channels"][0]["config"][field]
        state_file.write_text(json.dumps(state))
        changed = data(client.patch_json(f"{API}/channels/{ch['id']}", {"name": "old bot"}))
        assert "mode" not in changed["config"]  # a name change leaves the config alone
        changed = data(
            client.patch_json(f"{API}/channels/{ch['id']}", {"config": {"notify": True}})
        )
        assert changed["config"]["mode"] == "webhook"
        assert client.app.service.pollers.running() == []

    def test_whatsapp_with_an_app_secret_needs_meta_s_signature(self, client, upstream):
        ch = self.create(client, "whatsapp", appSecret="meta-app-secret")
        assert ch["config"]["appSecret"] == "meta-app-secret"
        listed = data(client.get(f"{API}/channels/{ch['id']}"))
        assert "meta-app-secret" not in json.dumps(listed)
        body = json.dumps(whatsapp_update("/search tomatoes")).encode()
        anon = webtest.TestApp(client.app)
        url = f"{API}/channels/webhook/whatsapp"

        def post(headers, status, query=""):
            return anon.post(
                url + query,
                body,
                headers={"Content-Type": "application/json", **headers},
                status=status,
            )

        good = whatsapp_signature(body, "meta-app-secret")
        # The signature alone authenticates: no secret in the URL needed.
        assert data(post({"X-Hub-Signature-256": good}, 200))["handled"] is True
        # With the secret, the signature is still required, and must be right.
        assert_error(post({}, 401, f"?secret={ch['secret']}"), 401, "UNAUTHORIZED")
        wrong = whatsapp_signature(body, "another-secret")
        assert_error(
            post({"X-Hub-Signature-256": wrong}, 401, f"?secret={ch['secret']}"),
            401,
            "UNAUTHORIZED",
        )
        assert (
            data(post({"X-Hub-Signature-256": good}, 200, f"?secret={ch['secret']}"))["handled"]
            is True
        )
        tampered = whatsapp_signature(body + b" ", "meta-app-secret")
        assert_error(post({"X-Hub-Signature-256": tampered}, 401), 401, "UNAUTHORIZED")
        assert_error(post({"X-Hub-Signature-256": "sha256=" + "0" * 64}, 401), 401, "UNAUTHORIZED")
        # A channel without an app secret is not reached by a signature.
        plain = self.create(client, "whatsapp", phoneNumberId="2")
        assert plain["config"]["appSecret"] == ""
        other = whatsapp_signature(body, "")
        assert_error(post({"X-Hub-Signature-256": other}, 401), 401, "UNAUTHORIZED")
        # Bad signatures count toward the lockout.
        for _ in range(10):
            post({"X-Hub-Signature-256": wrong}, [401, 429])
        assert_error(post({"X-Hub-Signature-256": good}, 429), 429, "RATE_LIMITED")

    def test_the_audit_flags_unsigned_whatsapp_and_query_secrets(self, client, upstream):
        signed = self.create(client, "whatsapp", appSecret="meta-app-secret")
        unsigned = self.create(client, "whatsapp", phoneNumberId="2")
        found = {f["id"]: f["severity"] for f in audit(client)["findings"]}
        assert found[f"channel-unsigned-{unsigned['id']}"] == "high"
        assert f"channel-unsigned-{signed['id']}" not in found
        anon = webtest.TestApp(client.app)
        anon.post_json(
            f"{API}/channels/webhook/whatsapp?secret={unsigned['secret']}", whatsapp_update("hi")
        )
        found = {f["id"]: f["severity"] for f in audit(client)["findings"]}
        assert found["secret-in-query"] == "medium"


class TestPolling:
    @pytest.fixture
    def client(self, make_app, upstream):
        return with_key(make_app(SERVICE_TELEGRAM_API_BASE=upstream.url))

    def create(self, client, **config):
        body = {
            "provider": "telegram",
            "config": {**MINIMAL_CONFIG["telegram"], "allowedChatIds": [42], **config},
        }
        return data(client.post_json(f"{API}/channels", body, status=201))

    def test_a_new_telegram_channel_polls_and_handles_updates(self, client, upstream, root):
        ch = self.create(client)
        assert ch["config"]["mode"] == "polling"  # the default for a new channel
        assert upstream.webhook is None  # no setWebhook in polling mode
        wait_for(lambda: client.app.service.pollers.running() == [ch["id"]])
        first = upstream.push(telegram_update("/save from the bus"))
        wait_for(
            lambda: today_note(client).exists() and "from the bus" in today_note(client).read_text()
        )
        wait_for(lambda: upstream.sent())
        assert upstream.sent()[-1].startswith("Saved to notes/daily/")
        offsets = root / ".notesvc" / "channel-offsets.json"
        wait_for(
            lambda: offsets.exists() and json.loads(offsets.read_text()) == {ch["id"]: first + 1}
        )
        assert stat.S_IMODE(os.stat(offsets).st_mode) == 0o600
        polls = [c["json"] for c in upstream.bot_calls if c["path"].endswith("/getUpdates")]
        assert polls[0]["timeout"] == 25
        assert polls[0]["allowed_updates"] == ["message", "edited_message", "channel_post"]
        wait_for(
            lambda: any(
                c["json"].get("offset") == first + 1
                for c in upstream.bot_calls
                if c["path"].endswith("/getUpdates")
            )
        )
        # A stranger's update is refused like a webhook's.
        upstream.push(telegram_update("let me in", chat_id=666))
        wait_for(lambda: data(client.get(f"{API}/channels/{ch['id']}"))["refusedSenders"])

    def test_a_webhook_in_the_way_is_deleted(self, client, upstream):
        upstream.webhook = {"url": "https://old.example/hook"}
        upstream.push(telegram_update("/save after the webhook"))
        self.create(client)
        wait_for(lambda: today_note(client).exists())
        assert upstream.webhook is None
        assert any(c["path"].endswith("/deleteWebhook") for c in upstream.bot_calls)
        assert [c["json"] for c in upstream.bot_calls if c["path"].endswith("/deleteWebhook")] == [
            {"drop_pending_updates": False}
        ]

    def test_switching_off_or_deleting_stops_the_poller_at_once(self, client, upstream):
        upstream.max_hold = 30  # a long poll is in flight when the channel stops
        ch = self.create(client)
        pollers = client.app.service.pollers
        wait_for(lambda: pollers.running() == [ch["id"]] and upstream.polls)
        started = time.monotonic()
        client.post(f"{API}/channels/{ch['id']}/toggle")
        wait_for(lambda: pollers.running() == [], timeout=10)
        assert time.monotonic() - started < 10  # not the poll's 30 s hold (a loaded CI: slack)
        upstream.push(telegram_update("/save while off"))
        assert [u["message"]["text"] for u in upstream.updates] == ["/save while off"]  # untaken
        assert not today_note(client).exists()
        client.post(f"{API}/channels/{ch['id']}/toggle")  # on again: what waited arrives
        wait_for(lambda: today_note(client).exists())
        client.delete(f"{API}/channels/{ch['id']}")
        wait_for(lambda: pollers.running() == [], timeout=10)
        offsets = client.app.service.config.state_dir / "channel-offsets.json"
        # (no file: no offset was kept yet, for any channel)
        assert ch["id"] not in json.loads(offsets.read_text() if offsets.exists() else "{}")
        # Switching to webhook mode stops polling too, and sets the webhook.
        ch = self.create(client)
        wait_for(lambda: pollers.running() == [ch["id"]])
        client.patch_json(f"{API}/channels/{ch['id']}", {"config": {"mode": "webhook"}})
        wait_for(lambda: pollers.running() == [], timeout=10)
        assert upstream.webhook["secret_token"] == ch["secret"]

    def test_switching_to_webhook_mode_keeps_the_webhook_from_the_stopping_poller(
        self, client, upstream
    ):
        """A poller between two getUpdates when the webhook is set would meet it (409) and
        delete it: the PATCH stops the poller, and waits for it, before setWebhook."""
        upstream.max_hold = 0.0  # every getUpdates answers at once: the poller never rests
        for i in range(6):
            ch = self.create(client)
            if i % 2:  # else at once: its first getUpdates may still be on its way
                before = upstream.polls
                wait_for(lambda before=before: upstream.polls >= before + 3)
            url = f"{API}/channels/{ch['id']}"
            client.patch_json(url, {"config": {"mode": "webhook"}})
            assert client.app.service.pollers.running() == []
            calls = [c["path"].rsplit("/", 1)[-1] for c in upstream.bot_calls]
            assert calls[-1] == "setWebhook"
            time.sleep(0.2)  # nothing comes after it
            assert [c["path"].rsplit("/", 1)[-1] for c in upstream.bot_calls] == calls
            assert upstream.webhook["secret_token"] == ch["secret"]
            assert data(client.get(url))["status"]["ok"] is True
            client.delete(url)
            upstream.webhook = None

    def test_a_refused_token_is_shown_as_the_channel_status(self, client, upstream, caplog):
        upstream.poll_status = 401
        ch = self.create(client)
        url = f"{API}/channels/{ch['id']}"
        wait_for(lambda: "status" in data(client.get(url)))
        status = data(client.get(url))["status"]
        assert status["ok"] is False
        assert "Unauthorized" in status["error"]
        logged = "\n".join(r.getMessage() for r in caplog.records)
        assert "ABC-telegram-token" not in logged + json.dumps(status)

    @pytest.mark.slow
    def test_another_poller_of_the_same_bot_is_not_fought(self, client, upstream):
        upstream.poll_status = 409
        upstream.poll_error = (
            "Conflict: terminated by other getUpdates request; "
            "make sure that only one bot instance is running"
        )
        ch = self.create(client)
        url = f"{API}/channels/{ch['id']}"
        wait_for(lambda: "status" in data(client.get(url)))
        failed = time.monotonic()
        assert "only one bot instance" in data(client.get(url))["status"]["error"]

        def polls() -> int:
            return len([c for c in upstream.bot_calls if c["path"].endswith("/getUpdates")])

        wait_for(lambda: polls() >= 2, timeout=10)  # it tries again ...
        assert time.monotonic() - failed >= 0.5  # ... after backing off, not at once
        assert not any(c["path"].endswith("/deleteWebhook") for c in upstream.bot_calls)

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_polling_delivers_each_update_once_across_a_restart(self, tmp_path, upstream):
        env = {"SERVICE_TELEGRAM_API_BASE": upstream.url}
        root = tmp_path / "root"
        with running(root, "--auth-mode", "none", env=env) as server:
            body = {
                "provider": "telegram",
                "config": {"botToken": "123456:ABC-telegram-token", "allowedChatIds": [42]},
            }
            status, _, _ = server.request("POST", f"{API}/channels", body)
            assert status == 201
            upstream.push(telegram_update("/save alpha"))
            wait_for(lambda: len(upstream.sent()) == 1)
        # While the server is down two more arrive; they wait at Telegram.
        upstream.push(telegram_update("/save beta"))
        upstream.push(telegram_update("/save gamma"))
        with running(root, "--auth-mode", "none", env=env):
            wait_for(lambda: len(upstream.sent()) == 3)
            polls = upstream.polls
            wait_for(lambda: upstream.polls >= polls + 2)  # two polls more: nothing again
        daily = next((root / "notes" / "daily").glob("*.md")).read_text()
        for word in ("alpha", "beta", "gamma"):
            assert len(re.findall(rf"^- \d\d:\d\d {word}$", daily, re.M)) == 1, daily
        assert len(upstream.sent()) == 3


class FakeClock:
    """An injectable clock for the reminder scheduler."""

    def __init__(self, when: float):
        self.now = when

    def __call__(self) -> float:
        return self.now


class TestReminders:
    @pytest.fixture
    def client(self, make_app, upstream):
        client = with_key(
            make_app(SERVICE_TELEGRAM_API_BASE=upstream.url, SERVICE_TIMEZONE="Europe/Paris")
        )
        body = {
            "provider": "telegram",
            "config": {
                **MINIMAL_CONFIG["telegram"],
                "allowedChatIds": [42],
                "mode": "webhook",
                "notify": True,
            },
        }
        client.post_json(f"{API}/channels", body, status=201)
        return client

    def scheduler(self, client, when: str):
        """Give the app a scheduler on a clock the test sets (ticked by the test itself)."""
        svc = client.app.service
        svc.reminders.close()
        svc.notes.after.remove(svc.reminders._note_changed)
        svc.reminders = notesvc.ReminderScheduler(svc, clock=FakeClock(at(when)))
        svc.notes.after.append(svc.reminders._note_changed)  # as start() does, without its thread
        return svc.reminders

    @staticmethod
    def reads(svc) -> list:
        """Spy on the index's reads of note files: the list of paths read from now on."""
        read, index_read = [], svc.index._read
        svc.index._read = lambda path, *a: read.append(path) or index_read(path, *a)
        return read

    def reminders_sent(self, upstream) -> list:
        return [t for t in upstream.sent() if t.startswith("⏰")]

    def test_a_reminder_fires_once_at_its_time(self, client, upstream):
        put_note(client, "notes/plans.md", "# Plans\n\n- dentist ⏰ 2031-01-06 09:00\n")
        listed = data(client.get(f"{API}/reminders"))
        assert listed["timeZone"] == "Europe/Paris"
        assert listed["total"] == 1
        (item,) = listed["reminders"]
        assert item["path"] == "notes/plans.md"
        assert item["title"] == "Plans"
        assert item["line"] == "- dentist ⏰ 2031-01-06 09:00"
        assert item["local"] == "2031-01-06 09:00"
        assert item["due"] == "2031-01-06T08:00:00.000Z"  # Paris is UTC+1 in January
        sched = self.scheduler(client, "2031-01-06 08:59")
        assert 59 < sched.tick() <= 60
        assert self.reminders_sent(upstream) == []
        sched.clock.now = at("2031-01-06 09:00") + 1
        sched.tick()
        assert self.reminders_sent(upstream) == [
            "⏰ Reminder (2031-01-06 09:00): Plans\n- dentist ⏰ 2031-01-06 09:00\nnotes/plans.md"
        ]
        assert upstream.requests[-1]["json"]["chat_id"] == "42"
        sched.tick()
        sched.clock.now += 3600
        sched.tick()
        assert len(self.reminders_sent(upstream)) == 1
        assert data(client.get(f"{API}/reminders"))["total"] == 0
        saved = client.app.service.config.state_dir / "reminders.json"
        assert stat.S_IMODE(os.stat(saved).st_mode) == 0o600

    def test_not_again_after_a_restart_and_a_missed_one_fires_late(
        self, client, upstream, make_app, root
    ):
        put_note(
            client,
            "notes/plans.md",
            "# Plans\n\n- dentist ⏰ 2031-01-06 09:00\n- call Ada ⏰ 2031-01-06 10:00\n",
        )
        sched = self.scheduler(client, "2031-01-06 09:00")
        sched.tick()
        assert len(self.reminders_sent(upstream)) == 1
        client.app.service.close()  # the server goes down before 10:00
        again = with_key(
            make_app(SERVICE_TELEGRAM_API_BASE=upstream.url, SERVICE_TIMEZONE="Europe/Paris")
        )
        later = self.scheduler(again, "2031-01-06 10:30")
        later.tick()
        sent = self.reminders_sent(upstream)
        assert len(sent) == 2  # the dentist not again; Ada late
        assert sent[-1].startswith("⏰ Late reminder (2031-01-06 10:00): Plans\n- call Ada")

    def test_one_written_after_its_time_is_not_sent(self, client, upstream):
        put_note(client, "notes/log.md", "# Log\n\n- done ⏰ 2031-01-06 07:00\n")
        sched = self.scheduler(client, "2031-01-06 09:00")
        sched.tick()
        assert self.reminders_sent(upstream) == []
        sched.clock.now += 3600
        sched.tick()
        assert self.reminders_sent(upstream) == []

    def test_editing_or_deleting_the_line_cancels_it(self, client, upstream):
        put_note(client, "notes/a.md", "- a ⏰ 2031-01-06 09:00\n")
        put_note(client, "notes/b.md", "- b ⏰ 2031-01-06 09:00\n")
        sched = self.scheduler(client, "2031-01-06 08:00")
        sched.tick()
        client.put_json(note_url("notes/a.md"), {"content": "- a ⏰ 2031-01-06 11:00\n"})
        client.delete(note_url("notes/b.md"))
        sched.clock.now = at("2031-01-06 09:01")
        sched.tick()
        assert self.reminders_sent(upstream) == []
        sched.clock.now = at("2031-01-06 11:00")
        sched.tick()
        assert len(self.reminders_sent(upstream)) == 1
        assert "- a ⏰ 2031-01-06 11:00" in self.reminders_sent(upstream)[0]

    def test_only_the_notes_that_changed_are_read_again(self, client, upstream, root, monkeypatch):
        """(Notes written just now are read at every look while RACY_SECONDS old: here every
        key is remembered at once; test_a_second_save_in_the_same_clock_tick... tests that.)"""
        monkeypatch.setattr(notesvc.ReadCache, "RACY_SECONDS", 0.0)
        svc = client.app.service
        for i in range(30):
            put_note(client, f"notes/n{i:02}.md", f"# N{i}\n\nplain note {i}\n")
        put_note(client, "notes/a.md", "- a ⏰ 2031-01-06 09:00\n")
        sched = self.scheduler(client, "2031-01-06 08:00")
        read = self.reads(svc)
        sched.tick()
        assert len(read) == 31  # the first look reads every note
        del read[:]
        sched.tick()
        assert read == []  # nothing changed: nothing read
        client.put_json(note_url("notes/n05.md"), {"content": "# N5\n\n- b ⏰ 2031-01-06 10:00\n"})
        client.patch_json(note_url("notes/a.md") + "/move", {"path": "notes/moved/a.md"})
        (root / "notes" / "n07.md").write_text("- c ⏰ 2031-01-06 11:00\n")
        svc.sync_index()  # an edit by another program, as the rescan finds it
        client.delete(note_url("notes/n09.md"))
        del read[:]  # (the index reads a moved note too)
        sched.tick()
        assert sorted(read) == ["notes/moved/a.md", "notes/n05.md", "notes/n07.md"]
        assert [(r["path"], r["wall"]) for r in sched.upcoming()] == [
            ("notes/moved/a.md", "2031-01-06 09:00"),
            ("notes/n05.md", "2031-01-06 10:00"),
            ("notes/n07.md", "2031-01-06 11:00"),
        ]
        client.put_json(note_url("notes/n05.md"), {"content": "# N5\n\nno reminder now\n"})
        client.delete(note_url("notes/moved/a.md"))
        sched.clock.now = at("2031-01-06 12:00")
        sched.tick()
        sent = self.reminders_sent(upstream)
        (only,) = sent
        assert "- c ⏰ 2031-01-06 11:00" in only

    def test_a_save_through_the_api_reads_that_note_only(self, client, upstream):
        """Not every note's key after each save: that much Python holding the GIL made each
        of a PUT's system calls wait (PUTs per second 6 times fewer at 10,000 notes)."""
        svc = client.app.service
        for i in range(20):
            put_note(client, f"notes/n{i:02}.md", f"plain note {i}\n")
        sched = self.scheduler(client, "2031-01-06 08:00")
        sched.tick()
        looks, note_keys = [], svc.index.note_keys
        svc.index.note_keys = lambda: looks.append(1) or note_keys()
        read = self.reads(svc)
        client.put_json(note_url("notes/n03.md"), {"content": "- n ⏰ 2031-01-06 09:00\n"})
        sched.tick()
        assert read == ["notes/n03.md"]
        assert looks == []
        assert [r["path"] for r in sched.upcoming()] == ["notes/n03.md"]

    def test_an_edit_that_kept_size_and_mtime_is_read_again(self, client, upstream, root):
        """A clock that ticks coarsely: the edit leaves the file's size and mtime as they
        were, and the scheduler looks at the notes between the index taking the edit and
        the write's hook (which runs once the note's lock is let go)."""
        svc = client.app.service
        put_note(client, "notes/a.md", "- a ⏰ 2031-01-06 09:00\n")
        sched = self.scheduler(client, "2031-01-06 08:00")
        sched.tick()
        note = root / "notes" / "a.md"
        st = note.stat()
        note.write_text("- a ⏰ 2031-01-06 10:00\n")  # the same size
        os.utime(note, ns=(st.st_atime_ns, st.st_mtime_ns))  # in the same clock tick
        svc.index.add("notes/a.md", note.read_text(), st.st_size, st.st_mtime_ns)
        sched.tick()  # the index changed, the note's key did not
        sched._note_changed("saved", "notes/a.md")  # the write's hook, afterwards
        sched.tick()
        assert [r["wall"] for r in sched.upcoming()] == ["2031-01-06 10:00"]

    def test_while_the_index_reads_many_notes_in_the_loop_waits_to_look(
        self, client, upstream, root
    ):
        svc = client.app.service
        put_note(client, "notes/a.md", "- a ⏰ 2031-01-06 09:00\n")
        sched = self.scheduler(client, "2031-01-06 08:00")
        sched.tick()
        for i in range(80):  # a restored backup: more than a rescan reads one by one
            (root / "notes" / f"r{i:02}.md").write_text(f"- r{i} ⏰ 2031-01-06 09:00\n")
        seen = []
        bulk_add = svc.index.bulk_add
        svc.index.bulk_add = lambda *a: seen.append(svc.index.reading) or bulk_add(*a)
        assert svc.index.reading is False
        svc.sync_index()
        assert seen
        assert all(seen)  # what the loop asks before it looks
        sched.clock.now = at("2031-01-06 09:00")
        sched.tick(refresh=False)  # from the notes as last looked at
        assert len(self.reminders_sent(upstream)) == 1
        sched.tick()
        assert len(self.reminders_sent(upstream)) == 81

    def test_while_the_index_reads_notes_in_a_deleted_note_is_cancelled_and_none_lost(
        self, client, upstream
    ):
        svc = client.app.service
        put_note(client, "notes/a.md", "- a ⏰ 2031-01-06 09:00\n")
        put_note(client, "notes/b.md", "- b ⏰ 2031-01-06 09:00\n")
        sched = self.scheduler(client, "2031-01-06 08:00")
        sched.tick()
        booked = json.loads(sched.path.read_text())["scheduled"]
        assert len(booked) == 2
        client.delete(note_url("notes/a.md"))
        # A scheduler that looks while the index is read in (a first build, a discarded
        # index) sees few notes or none: it cancels nothing it has not seen gone
        again = self.scheduler(client, "2031-01-06 08:00")
        svc.index._bulks += 1
        try:
            again.tick(refresh=not svc.index.reading)
        finally:
            svc.index._bulks -= 1
        assert json.loads(again.path.read_text())["scheduled"] == booked
        sched = self.scheduler(client, "2031-01-06 08:00")
        sched.tick()
        client.delete(note_url("notes/b.md"))
        sched.clock.now = at("2031-01-06 09:00")
        sched.tick(refresh=False)  # the deleted note is read again even so
        assert self.reminders_sent(upstream) == []

    @pytest.mark.parametrize("width", [64, 32])
    def test_note_keys_are_64_bits_where_str_hashes_have_32(self, monkeypatch, width):
        info = types.SimpleNamespace(width=width)
        monkeypatch.setattr(notesvc, "sys", types.SimpleNamespace(hash_info=info))
        key = notesvc._note_key
        keys = [key(f"notes/{i}.md", (10, 7)) for i in range(2000)]
        keys += [key("notes/0.md", (11, 7)), key("notes/0.md", (10, 8))]
        assert len(set(keys)) == len(keys)
        assert key("notes/0.md", (10, 7)) == keys[0]
        assert array.array("q", keys)  # each fits the 8 bytes it is kept in

    def test_front_matter_and_only_notifying_channels(self, client, upstream):
        body = {
            "provider": "whatsapp",
            "config": {**MINIMAL_CONFIG["whatsapp"], "allowedNumbers": ["15551234567"]},
        }
        client.post_json(f"{API}/channels", body, status=201)  # notify is off
        put_note(
            client, "notes/trip.md", "---\ntitle: Trip\nremind: 2031-01-06 12:30\n---\n# Trip\n"
        )
        put_note(client, "notes/bad.md", "- never ⏰ 2031-02-30 09:00 and ⏰ 2031-01-06 25:00\n")
        assert [r["local"] for r in data(client.get(f"{API}/reminders"))["reminders"]] == [
            "2031-01-06 12:30"
        ]
        sched = self.scheduler(client, "2031-01-06 12:30")
        sched.tick()
        (sent,) = self.reminders_sent(upstream)
        assert "Trip\nremind: 2031-01-06 12:30\nnotes/trip.md" in sent
        assert not any(r["path"].endswith("/messages") for r in upstream.requests)

    def test_a_reminder_no_channel_takes_is_tried_again(self, client, upstream):
        put_note(client, "notes/a.md", "- a ⏰ 2031-01-06 09:00\n")
        upstream.status = 500
        sched = self.scheduler(client, "2031-01-06 09:00")
        assert sched.tick() == notesvc.REMINDER_RETRY
        upstream.status = 200
        sched.clock.now += 61
        sched.tick()
        assert len(self.reminders_sent(upstream)) == 2  # the failed try, then the good one
        sched.clock.now += 61
        sched.tick()
        assert len(self.reminders_sent(upstream)) == 2

    def test_time_zone_setting_and_its_fallback(self, caplog, make_app):
        assert notesvc.load_config({"SERVICE_TIMEZONE": "Asia/Tokyo"}).timezone == "Asia/Tokyo"
        with pytest.raises(notesvc.ConfigError, match="SERVICE_TIMEZONE"):
            notesvc.load_config({"SERVICE_TIMEZONE": "Mars/Olympus_Mons"})
        # Where no time zone database knows a name, the system's local time is used, logged.
        assert notesvc.time_zone("Nowhere/Else") is None
        assert any("Nowhere/Else" in r.getMessage() for r in caplog.records)
        assert notesvc.time_zone("UTC") is notesvc.dt.timezone.utc
        client = with_key(
            make_app(SERVICE_TIMEZONE="Asia/Tokyo", SERVICE_TRANSCRIBE_API_KEY="tr-secret-9")
        )
        config = data(client.get(f"{API}/system/config"))
        assert config["capture"]["timeZone"] == "Asia/Tokyo"
        assert config["capture"]["transcribeApiKeySet"] is True
        assert "tr-secret-9" not in json.dumps(config)
        assert config["server"]["maxAttachmentBytes"] == 20971520

    def test_the_running_scheduler_sends_a_reminder_due_now(self, make_app, upstream):
        client = with_key(make_app(SERVICE_TELEGRAM_API_BASE=upstream.url))
        body = {
            "provider": "telegram",
            "config": {
                **MINIMAL_CONFIG["telegram"],
                "allowedChatIds": [42],
                "mode": "webhook",
                "notify": True,
            },
        }
        client.post_json(f"{API}/channels", body, status=201)
        # inside the minute the reminder names: not in its last two seconds
        now = wait_for(
            lambda: (n := notesvc.local_now(client.app.service)).second < 58 and n, timeout=5
        )
        put_note(client, "notes/now.md", f"# Now\n\n- stretch ⏰ {now:%Y-%m-%d %H:%M}\n")
        wait_for(lambda: self.reminders_sent(upstream), timeout=10)
        assert "stretch" in self.reminders_sent(upstream)[0]


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


TOOL_PLUGIN = """
import notesvc

EVENTS = []

def saved(svc, path, content):
    EVENTS.append(["saved", path])

def moved(svc, old, new):
    EVENTS.append(["moved", old, new])

def deleted(svc, path):
    EVENTS.append(["deleted", path])

def events(svc):
    return {"events": EVENTS}

@notesvc.tool("word_count", "Count the words of a note.", {"path": {"type": "string"}}, ("path",))
def word_count(svc, path):
    return {"path": path, "words": len(svc.notes.get(notesvc.note_path(path))["content"].split())}

@notesvc.tool("explode", "Fails.")
def explode(svc):
    raise RuntimeError("secret internals /etc/passwd")

PLUGIN = notesvc.Plugin(
    name="toolbox",
    hooks={"note_saved": saved, "note_moved": moved, "note_deleted": deleted},
    routes=(notesvc.PluginRoute("GET", "/events", events),),
)
"""


class TestTools:
    @pytest.fixture
    def tools(self, make_app):
        client = with_key(make_app(SERVICE_MCP_WRITE="true"))
        seed_notes(client)
        return client

    def test_every_tool_is_listed_documented_and_tested(self, tools):
        assert listed_tools(tools) == set(notesvc.TOOLS)
        reference = (HERE / "docs" / "api.md").read_text()
        tests = [name for name in dir(type(self)) if name.startswith("test_tool_")]
        for name in notesvc.TOOLS:
            assert f"`{name}`" in reference, name
            longer = [o for o in notesvc.TOOLS if o != name and o.startswith(name + "_")]
            mine = [
                t
                for t in tests
                if t.startswith(f"test_tool_{name}_")
                and not any(t.startswith(f"test_tool_{o}_") for o in longer)
            ]
            assert mine, f"no test_tool_{name}_... test"

    def test_tools_are_described_for_a_model(self, tools):
        jsonschema = pytest.importorskip("jsonschema")
        for listed in rpc(tools, "tools/list")["result"]["tools"]:
            tool = notesvc.TOOLS[listed["name"]]
            assert notesvc.TOOL_NAME_RE.match(tool.name)
            assert len(tool.description) > 20
            jsonschema.Draft202012Validator.check_schema(listed["inputSchema"])
            assert listed["inputSchema"]["additionalProperties"] is False
            hints = listed["annotations"]
            assert hints["readOnlyHint"] is tool.read_only
            assert hints["openWorldHint"] is False
            if tool.read_only:
                assert not hints["destructiveHint"]
        hints = {t.name: t.annotations() for t in notesvc.TOOLS.values()}
        assert hints["append_to_note"]["destructiveHint"] is False  # it only adds
        for name in ("update_note", "replace_in_note", "move_note", "delete_note"):
            assert hints[name]["destructiveHint"] is True

    def test_write_tools_are_listed_and_callable_only_with_mcp_write(self, make_app):
        client = with_key(make_app())
        seed_notes(client)
        listed = listed_tools(client)
        assert listed == {n for n, t in notesvc.TOOLS.items() if t.read_only}
        for name in ("create_note", "append_to_note", "update_note", "delete_note"):
            answer = rpc(client, "tools/call", {"name": name, "arguments": {"path": "notes/w.md"}})
            assert answer["error"]["code"] == -32602
            assert "SERVICE_MCP_WRITE" in answer["error"]["message"]
        assert not client.app.service.notes.exists("notes/w.md")
        assert ok_tool(client, "read_note", path="notes/work.md")["title"] == "Work"

    def test_arguments_are_checked_against_the_schema(self, tools):
        cases = [
            ("read_note", {}, "missing required argument(s): path"),
            ("read_note", {"path": 5}, "'path' must be a string"),
            ("read_note", {"path": "notes/work.md", "offset": "3"}, "'offset' must be an integer"),
            ("read_note", {"path": "notes/work.md", "offset": True}, "'offset' must be an int"),
            ("read_note", {"path": "notes/work.md", "maxChars": 0}, "'maxChars' must be from 1"),
            ("read_note", {"path": "notes/work.md", "colour": "red"}, "unknown argument(s)"),
            ("read_note", {"path": "x" * 513}, "longer than 512"),
            ("search_notes", {"query": ""}, "'query' must not be empty"),
            (
                "move_note",
                {
                    "path": "notes/work.md",
                    "newPath": "notes/w.md",
                    "etag": "e",
                    "updateLinks": "yes",
                },
                "'updateLinks' must be a boolean",
            ),
        ]
        for name, arguments, says in cases:
            message = tool_refused(tools, name, "VALIDATION_ERROR", **arguments)
            assert says in message, (name, message)
        # null is absent; 20.0 is 20
        assert ok_tool(tools, "read_note", path="notes/work.md", offset=None)["offset"] == 0
        assert len(ok_tool(tools, "read_note", path="notes/work.md", maxChars=5.0)["content"]) == 5

    def test_a_failing_plugin_tool_answers_with_the_request_id_only(self, make_app, root, caplog):
        (root / ".notesvc" / "plugins").mkdir(parents=True)
        (root / ".notesvc" / "plugins" / "toolbox.py").write_text(TOOL_PLUGIN)
        client = with_key(make_app())
        resp = client.post(
            f"{API}/mcp",
            json.dumps(
                {"jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": {"name": "explode"}}
            ),
            headers={"Content-Type": "application/json", "X-Request-Id": "explode-request-1"},
        )
        result = resp.json["result"]
        assert result["isError"] is True
        assert result["structuredContent"]["error"]["code"] == "INTERNAL_ERROR"
        assert "explode-request-1" in result["content"][0]["text"]
        assert "secret" not in resp.text
        assert "passwd" not in resp.text
        assert any("explode-request-1" in r.getMessage() for r in caplog.records)

    def test_plugin_tools_belong_to_their_app_and_follow_its_switch(self, make_app, root):
        (root / ".notesvc" / "plugins").mkdir(parents=True)
        (root / ".notesvc" / "plugins" / "toolbox.py").write_text(TOOL_PLUGIN)
        client = with_key(make_app())
        put_note(client, "notes/a.md", "one two three")
        assert "word_count" in listed_tools(client)
        assert ok_tool(client, "word_count", path="notes/a.md") == {
            "path": "notes/a.md",
            "words": 3,
        }
        assert "word_count" not in notesvc.TOOLS
        other = with_key(make_app(tmp_path_factory_root(root)))
        assert "word_count" not in listed_tools(other)
        client.post(f"{API}/plugins/toolbox/toggle")
        assert "word_count" not in listed_tools(client)
        answer = rpc(client, "tools/call", {"name": "word_count", "arguments": {"path": "x"}})
        assert answer["error"]["code"] == -32602
        assert "toolbox plugin" in answer["error"]["message"]

    def test_tools_write_through_the_store_hooks_and_index(self, make_app, root):
        (root / ".notesvc" / "plugins").mkdir(parents=True)
        (root / ".notesvc" / "plugins" / "toolbox.py").write_text(TOOL_PLUGIN)
        client = with_key(make_app(SERVICE_MCP_WRITE="true"))
        ok_tool(client, "create_note", path="notes/t.md", content="# T\n\nkumquat")
        ok_tool(client, "append_to_note", path="notes/t.md", text="- quince")
        ok_tool(client, "replace_in_note", path="notes/t.md", old="kumquat", new="loquat")
        etag = ok_tool(client, "read_note", path="notes/t.md")["etag"]
        ok_tool(client, "update_note", path="notes/t.md", content="# T\n\nmedlar", etag=etag)
        etag = ok_tool(client, "read_note", path="notes/t.md")["etag"]
        ok_tool(client, "move_note", path="notes/t.md", newPath="notes/u.md", etag=etag)
        assert [h["path"] for h in search(client, "medlar")["results"]] == ["notes/u.md"]
        assert search(client, "kumquat")["total"] == 0
        ok_tool(client, "delete_note", path="notes/u.md")
        assert search(client, "medlar")["total"] == 0
        events = data(client.get(f"{API}/plugins/toolbox/events"))["events"]
        assert events == [
            ["saved", "notes/t.md"],
            ["saved", "notes/t.md"],
            ["saved", "notes/t.md"],
            ["saved", "notes/t.md"],
            ["moved", "notes/t.md", "notes/u.md"],
            ["deleted", "notes/u.md"],
        ]

    @pytest.mark.parametrize(
        "path",
        [
            "../.notesvc/state.json",
            "/etc/passwd",
            "notes/../.notesvc/state.json",
            "notes/.hidden.md",
            "notes/a\\b.md",
            "notes/a\u202eb.md",
            "notes/x\x00.md",
            "notes/link/secret.md",
        ],
    )
    def test_hostile_paths_are_refused_by_every_tool(self, tools, root, tmp_path, path):
        outside = tmp_path / "outside"
        outside.mkdir(exist_ok=True)
        (outside / "secret.md").write_text("the crown jewels")
        with contextlib.suppress(FileExistsError):
            os.symlink(outside, root / "notes" / "link")
        key = key_of(tools)
        etag = data(tools.get(note_url("notes/work.md")))["etag"]
        for name, arguments in [
            ("read_note", {"path": path}),
            ("fetch", {"id": path}),
            ("list_folder", {"path": path}),
            ("create_note", {"path": path, "content": "x"}),
            ("append_to_note", {"path": path, "text": "x"}),
            ("replace_in_note", {"path": path, "old": "a", "new": "b"}),
            ("update_note", {"path": path, "content": "x", "etag": "e"}),
            ("move_note", {"path": "notes/work.md", "newPath": path, "etag": etag}),
            ("delete_note", {"path": path}),
        ]:
            result = call_tool(tools, name, **arguments)
            assert result["isError"] is True, (name, path)
            assert result["structuredContent"]["error"]["code"] in ("VALIDATION_ERROR", "NOT_FOUND")
            text = json.dumps(result)
            assert "crown jewels" not in text
            assert key not in text
            assert str(tmp_path) not in text
        assert (outside / "secret.md").read_text() == "the crown jewels"
        assert sorted(p.name for p in outside.iterdir()) == ["secret.md"]

    def test_tool_search_notes_speaks_the_query_language(self, tools):
        found = ok_tool(tools, "search_notes", query="spare keys")
        assert found["results"][0]["path"] == "notes/home/keys.md"
        assert set(found["results"][0]) == {"path", "title", "snippet", "score"}
        either = ok_tool(tools, "search_notes", query="tomatoes OR meeting")
        assert {r["path"] for r in either["results"]} == {"notes/garden.md", "notes/work.md"}
        assert either["total"] == 2
        assert ok_tool(tools, "search_notes", query="tomatoes OR meeting", limit=1)["total"] == 2
        assert (
            len(ok_tool(tools, "search_notes", query="tomatoes OR meeting", limit=1)["results"])
            == 1
        )
        assert ok_tool(tools, "search_notes", query='"blue flowerpot"')["total"] == 1
        assert ok_tool(tools, "search_notes", query="keys -spare")["total"] == 0
        assert ok_tool(tools, "search_notes", query="flower*")["total"] == 1
        assert ok_tool(tools, "search_notes", query="keys", folder="notes/home")["total"] == 1
        assert ok_tool(tools, "search_notes", query="keys", folder="notes/work")["total"] == 0
        assert ok_tool(tools, "search_notes", query="keys", folder="notes")["total"] == 1
        result = call_tool(tools, "search_notes", query="tomatoes OR meeting")
        lines = result["content"][0]["text"].splitlines()
        assert len(lines) == 2
        assert any(line.startswith("notes/garden.md — Garden: ") for line in lines)
        assert call_tool(tools, "search_notes", query="submarine")["content"][0]["text"] == (
            "No note matches."
        )

    @pytest.mark.parametrize(
        ("arguments", "says"),
        [
            ({"query": "cats OR"}, "OR needs a word"),
            ({"query": '"open'}, "unbalanced quote"),
            ({"query": "-only"}, "only excludes"),
            ({"query": "x" * 513}, "longer than 512"),
            ({"query": "keys", "limit": 51}, "'limit' must be from 1 to 50"),
            ({"query": "keys", "folder": "../etc"}, "must start with notes/"),
            ({"query": ["keys"]}, "'query' must be a string"),
        ],
    )
    def test_tool_search_notes_explains_a_bad_query(self, tools, arguments, says):
        assert says in tool_refused(tools, "search_notes", "VALIDATION_ERROR", **arguments)

    def test_tool_read_note_gives_the_record_and_pages(self, tools):
        note = ok_tool(tools, "read_note", path="notes/home/keys.md")
        record = data(tools.get(note_url("notes/home/keys.md")))
        assert note["content"] == record["content"]
        assert note["etag"] == record["etag"]
        assert (note["title"], note["size"], note["offset"], note["truncated"]) == (
            "Keys",
            record["size"],
            0,
            False,
        )
        text = call_tool(tools, "read_note", path="notes/home/keys.md")["content"][0]["text"]
        assert text.startswith(f"notes/home/keys.md — Keys\netag: {record['etag']}\n\n")
        assert text.endswith(KEYS_NOTE)
        long = "# Long\n\n" + "".join(f"line {i:05d} ü\n" for i in range(3000))
        put_note(tools, "notes/long.md", long)
        parts, offset = [], 0
        while True:
            part = ok_tool(tools, "read_note", path="notes/long.md", offset=offset, maxChars=7000)
            parts.append(part["content"])
            if not part["truncated"]:
                break
            offset += len(part["content"])
        assert "".join(parts) == long
        assert len(parts) == -(-len(long) // 7000)
        text = call_tool(tools, "read_note", path="notes/long.md", maxChars=100)
        assert "read on with offset=100" in text["content"][0]["text"]
        beyond = ok_tool(tools, "read_note", path="notes/long.md", offset=10**6)
        assert (beyond["content"], beyond["truncated"]) == ("", False)

    def test_tool_read_note_missing_or_unreadable(self, tools, root):
        assert "notes/nope.md" in tool_refused(
            tools, "read_note", "NOT_FOUND", path="notes/nope.md"
        )
        (root / "notes" / "latin1.md").write_bytes(b"caf\xe9")
        assert "UTF-8" in tool_refused(tools, "read_note", "CONFLICT", path="notes/latin1.md")
        tool_refused(tools, "read_note", "VALIDATION_ERROR", path="notes/folder")

    def test_tool_list_folder_lists_levels_and_counts_below(self, tools):
        put_note(tools, "notes/home/deep/er/x.md", "x")
        top = ok_tool(tools, "list_folder")
        assert top["path"] == "notes"
        assert [(c["name"], c["type"]) for c in top["children"]] == [
            ("home", "folder"),
            ("garden.md", "note"),
            ("work.md", "note"),
        ]
        assert top["children"][0]["count"] == 2
        assert "children" not in top["children"][0]
        two = ok_tool(tools, "list_folder", path="notes/home", depth=2)
        deep = two["children"][0]
        assert (deep["name"], [c["name"] for c in deep["children"]]) == ("deep", ["er"])
        assert deep["children"][0]["count"] == 1
        text = call_tool(tools, "list_folder")["content"][0]["text"]
        assert text == "notes/\n  home/ (2 notes)\n  garden.md\n  work.md"
        assert ok_tool(tools, "list_folder", path="notes/", depth=10)["children"][0]["children"]

    def test_tool_list_folder_refuses_bad_folders(self, tools):
        tool_refused(tools, "list_folder", "NOT_FOUND", path="notes/nowhere")
        tool_refused(tools, "list_folder", "VALIDATION_ERROR", path="elsewhere")
        tool_refused(tools, "list_folder", "VALIDATION_ERROR", depth=11)
        tool_refused(tools, "list_folder", "NOT_FOUND", path="notes/work.md")

    def test_tool_recent_changes_newest_first(self, tools, root):
        for i, name in enumerate(["home/keys", "garden", "work"]):
            os.utime(root / "notes" / f"{name}.md", (1_700_000_000 + i, 1_700_000_000 + i))
        (root / "notes" / "outside-edit.md").write_text("# Edited elsewhere\n")
        recent = ok_tool(tools, "recent_changes")
        assert [c["path"] for c in recent["changes"]] == [
            "notes/outside-edit.md",
            "notes/work.md",
            "notes/garden.md",
            "notes/home/keys.md",
        ]
        assert recent["changes"][1]["modified"] == "2023-11-14T22:13:22.000Z"
        assert recent["changes"][1]["title"] == "Work"
        since = ok_tool(tools, "recent_changes", since="2023-11-14T22:13:21Z", limit=2)
        assert [c["path"] for c in since["changes"]] == ["notes/outside-edit.md", "notes/work.md"]
        assert since["total"] == 2
        text = call_tool(tools, "recent_changes", limit=1)["content"][0]["text"]
        assert text.endswith(" notes/outside-edit.md — outside-edit")
        assert ok_tool(tools, "recent_changes", since="2099-01-01T00:00:00+02:00")["changes"] == []
        for bad in ("yesterday", "2024-13-01", "x" * 41):
            tool_refused(tools, "recent_changes", "VALIDATION_ERROR", since=bad)

    def test_tool_list_tags_follows_the_tags_plugin(self, tools):
        put_note(tools, "notes/t.md", "# T\n\n#garden #todo and `#code`")
        put_note(tools, "notes/u.md", "---\ntags: [garden]\n---\nx")
        assert ok_tool(tools, "list_tags") == {
            "tags": [{"tag": "garden", "count": 2}, {"tag": "todo", "count": 1}]
        }
        assert call_tool(tools, "list_tags")["content"][0]["text"] == "#garden (2)\n#todo (1)"
        tool_refused(tools, "list_tags", "VALIDATION_ERROR", tag="garden")
        tools.post(f"{API}/plugins/tags/toggle")
        assert "list_tags" not in listed_tools(tools)
        answer = rpc(tools, "tools/call", {"name": "list_tags", "arguments": {}})
        assert "tags plugin" in answer["error"]["message"]

    def test_tool_create_note_makes_folders_and_never_overwrites(self, tools, root):
        made = ok_tool(tools, "create_note", path="notes/new/idea.md", content="# Idea\n\nzeppelin")
        assert set(made) == {"path", "title", "etag", "size", "modified"}
        assert (root / "notes" / "new" / "idea.md").read_text() == "# Idea\n\nzeppelin"
        assert search(tools, "zeppelin")["total"] == 1
        tool_refused(tools, "create_note", "CONFLICT", path="notes/work.md", content="gone?")
        assert "Tuesday" in (root / "notes" / "work.md").read_text()
        tool_refused(tools, "create_note", "VALIDATION_ERROR", path="notes/x.txt", content="x")
        tool_refused(tools, "create_note", "VALIDATION_ERROR", path="notes/x.md")
        tool_refused(tools, "create_note", "VALIDATION_ERROR", path="notes/x.md", content=7)

    def test_tool_append_to_note_adds_a_line(self, tools, root):
        ok_tool(tools, "append_to_note", path="notes/work.md", text="- bring cake")
        assert (root / "notes" / "work.md").read_text().endswith("at ten.\n- bring cake\n")
        ok_tool(tools, "append_to_note", path="notes/work.md", text="- and tea\n")
        assert (root / "notes" / "work.md").read_text().endswith("- bring cake\n- and tea\n")
        assert search(tools, "cake")["total"] == 1
        tool_refused(tools, "append_to_note", "NOT_FOUND", path="notes/none.md", text="x")
        assert not (root / "notes" / "none.md").exists()
        tool_refused(tools, "append_to_note", "VALIDATION_ERROR", path="notes/work.md", text="")

    def test_tool_replace_in_note_needs_exactly_one_match(self, tools, root):
        done = ok_tool(tools, "replace_in_note", path="notes/work.md", old="Tuesday", new="Friday")
        assert done["replaced"] == 1
        assert "on Friday at ten" in (root / "notes" / "work.md").read_text()
        put_note(tools, "notes/twice.md", "cat and cat")
        says = tool_refused(
            tools, "replace_in_note", "CONFLICT", path="notes/twice.md", old="cat", new="dog"
        )
        assert "occurs 2 times" in says
        says = tool_refused(
            tools, "replace_in_note", "CONFLICT", path="notes/twice.md", old="emu", new="dog"
        )
        assert "not in notes/twice.md" in says
        assert (root / "notes" / "twice.md").read_text() == "cat and cat"
        tool_refused(tools, "replace_in_note", "NOT_FOUND", path="notes/no.md", old="a", new="b")
        tool_refused(tools, "replace_in_note", "VALIDATION_ERROR", path="notes/twice.md", old="")

    def test_tool_update_note_needs_the_etag_it_read(self, tools, root):
        etag = ok_tool(tools, "read_note", path="notes/work.md")["etag"]
        tools.put_json(note_url("notes/work.md"), {"content": "# Work\n\nsomeone else changed it"})
        tool_refused(
            tools,
            "update_note",
            "PRECONDITION_FAILED",
            path="notes/work.md",
            content="x",
            etag=etag,
        )
        assert "someone else" in (root / "notes" / "work.md").read_text()
        etag = ok_tool(tools, "read_note", path="notes/work.md")["etag"]
        done = ok_tool(tools, "update_note", path="notes/work.md", content="# W\n\nnew", etag=etag)
        assert done["etag"] != etag
        assert (root / "notes" / "work.md").read_text() == "# W\n\nnew"
        assert (
            ok_tool(
                tools,
                "update_note",
                path="notes/work.md",
                content="# W\n\nnew2",
                etag=done["etag"].strip('"'),
            )["title"]
            == "W"
        )
        tool_refused(tools, "update_note", "VALIDATION_ERROR", path="notes/work.md", content="x")
        tool_refused(
            tools, "update_note", "NOT_FOUND", path="notes/none.md", content="x", etag=etag
        )

    def test_tool_move_note_needs_the_etag_and_updates_links(self, tools, root):
        put_note(tools, "notes/index.md", "See [[garden]] and [plan](garden.md).")
        etag = ok_tool(tools, "read_note", path="notes/garden.md")["etag"]
        tool_refused(
            tools,
            "move_note",
            "PRECONDITION_FAILED",
            path="notes/garden.md",
            newPath="notes/g2.md",
            etag='"0000"',
        )
        tool_refused(
            tools,
            "move_note",
            "CONFLICT",
            path="notes/garden.md",
            newPath="notes/work.md",
            etag=etag,
        )
        moved = ok_tool(
            tools,
            "move_note",
            path="notes/garden.md",
            newPath="notes/outside/garden.md",
            etag=etag,
            updateLinks=True,
        )
        assert moved["from"] == "notes/garden.md"
        assert moved["path"] == "notes/outside/garden.md"
        assert moved["linksUpdated"] == ["notes/index.md"]
        assert (root / "notes" / "index.md").read_text() == (
            "See [[garden]] and [plan](outside/garden.md)."
        )
        assert not (root / "notes" / "garden.md").exists()
        tool_refused(tools, "move_note", "VALIDATION_ERROR", path="notes/work.md", newPath="x")

    def test_tool_delete_note_goes_to_the_trash(self, tools, root):
        tool_refused(tools, "delete_note", "PRECONDITION_FAILED", path="notes/work.md", etag='"1"')
        assert (root / "notes" / "work.md").exists()
        assert ok_tool(tools, "delete_note", path="notes/work.md") == {
            "path": "notes/work.md",
            "deleted": True,
        }
        assert not (root / "notes" / "work.md").exists()
        assert list((root / ".notesvc" / "trash").glob("*/notes/work.md"))
        tool_refused(tools, "delete_note", "NOT_FOUND", path="notes/work.md")

    def test_tool_search_has_chatgpts_shape(self, tools):
        found = ok_tool(tools, "search", query="spare keys")
        assert found == {
            "results": [
                {
                    "id": "notes/home/keys.md",
                    "title": "Keys",
                    "url": "http://localhost:80/api/v1/notes/notes%2Fhome%2Fkeys.md",
                }
            ]
        }
        text = call_tool(tools, "search", query="spare keys")["content"][0]["text"]
        assert json.loads(text) == found
        tool_refused(tools, "search", "VALIDATION_ERROR", query="a OR")

    def test_tool_fetch_reads_a_whole_note_by_id(self, tools):
        fetched = ok_tool(tools, "fetch", id="notes/home/keys.md")
        assert fetched["text"] == KEYS_NOTE
        assert fetched["title"] == "Keys"
        assert fetched["url"].endswith("/api/v1/notes/notes%2Fhome%2Fkeys.md")
        assert (
            fetched["metadata"]["etag"] == data(tools.get(note_url("notes/home/keys.md")))["etag"]
        )
        tool_refused(tools, "fetch", "NOT_FOUND", id="notes/none.md")


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


GARDEN_NOTES = {
    "notes/garden/decisions.md": "# Garden decisions\n\nWe decided to grow only heirloom "
    "tomatoes this year.\n\nThe greenhouse stays closed until April.",
    "notes/garden/budget.md": "# Garden budget\n\nAt most 200 euros for seeds; the garden "
    "decision about the greenhouse heater waits for the budget.",
    "notes/shopping.md": "# Shopping list\n\n- bread\n- eggs\n",
}


class TestAgentTools:
    """The `openai` provider's tool loop against a stand-in model on loopback."""

    @pytest.fixture
    def agent(self, make_app):
        made = []

        def make(*script, **env):
            model = ToolModel(*script)
            made.append(model)
            env = {
                "SERVICE_AGENT_PROVIDER": "openai",
                "SERVICE_AGENT_BASE_URL": model.url + "/v1",
                "SERVICE_AGENT_MODEL": "tool-llama",
                "SERVICE_TELEGRAM_API_BASE": model.url,
                **env,
            }
            client = with_key(make_app(**env))
            for path, text in GARDEN_NOTES.items():
                put_note(client, path, text)
            return client, model

        yield make
        for model in made:
            model.close()

    def ask(self, client, message: str, status: int = 200) -> dict:
        resp = client.post_json(f"{API}/agent/chat", {"message": message}, status=status)
        return data(resp) if status == 200 else resp

    def test_searches_reads_two_notes_and_answers_with_their_sources(self, agent):
        def read_both(messages):
            hits = last_tool_results(messages)[0].splitlines()
            return [("read_note", {"path": line.split(" — ")[0]}) for line in hits[:2]]

        client, model = agent(
            lambda messages: [("search_notes", {"query": "garden decision"})],
            read_both,
            lambda messages: "You chose heirloom tomatoes (notes/garden/decisions.md).",
        )
        d = self.ask(client, "what did I decide about the garden?")
        assert d["reply"] == "You chose heirloom tomatoes (notes/garden/decisions.md)."
        assert d["model"] == "tool-llama-served"
        paths = [s["path"] for s in d["sources"]]
        assert set(paths[:2]) == {"notes/garden/decisions.md", "notes/garden/budget.md"}
        assert d["sources"][0]["title"].startswith("Garden ")
        assert len(model.requests) == 3
        first, second, third = (r["json"] for r in model.requests)
        offered = {t["function"]["name"] for t in first["tools"]}
        assert offered == {n for n, t in notesvc.TOOLS.items() if t.read_only and not t.alias_of}
        assert "tool_choice" not in first  # "auto" is the default; vLLM refuses it unless set up
        assert "notes/garden/budget.md" in first["messages"][0]["content"]  # the passages too
        assert first["messages"][1] == {
            "role": "user",
            "content": "what did I decide about the garden?",
        }
        call = second["messages"][2]["tool_calls"][0]
        assert second["messages"][3]["tool_call_id"] == call["id"]
        assert second["messages"][3]["role"] == "tool"
        assert "notes/garden/decisions.md — Garden decisions: " in second["messages"][3]["content"]
        read = last_tool_results(third["messages"])
        assert len(read) == 2
        assert any("The greenhouse stays closed until April." in r for r in read)
        assert any("etag: " in r for r in read)

    def test_a_model_that_answers_at_once_answers_from_the_notes(self, agent):
        client, model = agent()
        model.reply = "Heirloom tomatoes."
        d = self.ask(client, "which tomatoes did we decide on?")
        assert d["reply"] == "Heirloom tomatoes."
        assert len(model.requests) == 1
        sent = model.requests[0]["json"]
        assert sent["tools"]
        assert "only heirloom tomatoes" in sent["messages"][0]["content"]
        assert d["sources"][0]["path"] == "notes/garden/decisions.md"

    def test_a_server_refusing_tools_gets_one_call_without_them(self, agent):
        client, model = agent()
        model.refuse_tools = True
        d = self.ask(client, "which tomatoes did we decide on?")
        assert d["reply"] == model.reply
        assert [("tools" in r["json"]) for r in model.requests] == [True, False]
        assert "only heirloom tomatoes" in model.requests[1]["json"]["messages"][0]["content"]

    def test_the_step_limit_ends_the_loop(self, agent):
        forever = [lambda messages: [("search_notes", {"query": "garden"})]] * 10
        client, model = agent(*forever, SERVICE_AGENT_MAX_STEPS="3")
        d = self.ask(client, "garden?")
        assert len(model.requests) == 3
        assert [r["json"].get("tool_choice") for r in model.requests] == [None, None, "none"]
        assert "SERVICE_AGENT_MAX_STEPS" in d["reply"]
        assert d["sources"]  # what it had in context

    def test_a_write_is_refused_while_agent_writes_are_off(self, agent, root):
        client, model = agent(
            lambda messages: [("append_to_note", {"path": "notes/shopping.md", "text": "- milk"})],
            lambda messages: "Sorry: " + last_tool_results(messages)[0],
        )
        d = self.ask(client, "add milk to my shopping list")
        assert "SERVICE_AGENT_WRITE" in d["reply"]
        assert "FORBIDDEN" in d["reply"]
        assert "milk" not in (root / "notes" / "shopping.md").read_text()
        offered = {t["function"]["name"] for t in model.requests[0]["json"]["tools"]}
        assert "append_to_note" not in offered

    def test_add_milk_from_telegram_when_the_owner_allows_writes(self, agent, root):
        def append(messages):
            path = last_tool_results(messages)[0].split(" — ")[0]
            return [("append_to_note", {"path": path, "text": "- milk"})]

        client, model = agent(
            lambda messages: [("search_notes", {"query": "shopping list"})],
            append,
            lambda messages: "Added milk to notes/shopping.md.",
            SERVICE_AGENT_WRITE="true",
        )
        ch = data(
            client.post_json(
                f"{API}/channels",
                {
                    "provider": "telegram",
                    "config": {"botToken": "123:abc", "allowedChatIds": ["42"]},
                },
            )
        )
        resp = client.post_json(
            f"{API}/channels/webhook/telegram",
            telegram_update("add milk to my shopping list"),
            headers={"X-Telegram-Bot-Api-Secret-Token": ch["secret"]},
        )
        assert data(resp)["delivered"] is True
        assert (
            root / "notes" / "shopping.md"
        ).read_text() == "# Shopping list\n\n- bread\n- eggs\n- milk\n"
        sent = [r for r in model.requests if "/sendMessage" in r["path"]]
        assert sent[-1]["json"]["text"] == "Added milk to notes/shopping.md."
        offered = {t["function"]["name"] for t in model.requests[0]["json"]["tools"]}
        assert {"append_to_note", "update_note", "create_note"} <= offered
        assert "pass the etag" in model.requests[0]["json"]["messages"][0]["content"]
        assert search(client, "milk")["total"] == 1

    def test_bad_tool_calls_are_answered_not_crashed(self, agent):
        client, _ = agent(
            lambda messages: [
                ("launch_rockets", {}),
                ("read_note", "{not json"),
                ("read_note", {"path": 7}),
                ("read_note", {"path": "../../etc/passwd"}),
                ("fetch", {"id": "notes/shopping.md"}),  # an MCP alias, not offered here
            ],
            lambda messages: "\n".join(last_tool_results(messages)),
        )
        d = self.ask(client, "garden?")
        lines = d["reply"].splitlines()
        assert lines[0].startswith("Error (NOT_FOUND): there is no tool 'launch_rockets'")
        assert lines[1] == "Error (VALIDATION_ERROR): the arguments are not valid JSON"
        assert lines[2] == "Error (VALIDATION_ERROR): 'path' must be a string"
        assert lines[3].startswith("Error (VALIDATION_ERROR): the note path must")
        assert lines[4].startswith("Error (NOT_FOUND): there is no tool 'fetch'")

    def test_more_calls_at_once_than_allowed_are_each_answered(self, agent):
        many = [("read_note", {"path": "notes/shopping.md"})] * 10
        client, model = agent(lambda messages: many, lambda messages: "done")
        assert self.ask(client, "shopping?")["reply"] == "done"
        results = last_tool_results(model.requests[1]["json"]["messages"])
        assert len(results) == 10
        assert results[-1] == "skipped: at most 8 calls at once"
        assert results[0].startswith("notes/shopping.md — Shopping list")

    def test_a_model_failing_mid_loop_is_502(self, agent):
        client, model = agent(
            lambda messages: [("search_notes", {"query": "garden"})], lambda messages: 500
        )
        resp = self.ask(client, "garden?", status=502)
        assert_error(resp, 502, "UPSTREAM_ERROR")
        assert len(model.requests) == 2


class TestLocalAgent:
    """Issue 16, item 5: the offline agent answers in plain sentences."""

    def test_quotes_plain_sentences_without_markdown(self, client):
        put_note(
            client,
            "notes/fridge.md",
            "## Fridge\n\n- **Milk** is on the *top* shelf, see [the plan](plan.md).\n"
            "> The [[cheese|cheeses]] stay in the `drawer`.\n1. [ ] Buy more milk __soon__\n",
        )
        d = data(client.post_json(f"{API}/agent/chat", {"message": "where is the milk?"}))
        lines = d["reply"].splitlines()
        assert lines == [
            "From your notes:",
            "• Milk is on the top shelf, see the plan. Buy more milk soon — notes/fridge.md",
        ]
        for mark in ("#", "**", "__", "[", "`", "> ", "- "):
            assert mark not in d["reply"], mark

    def test_prefers_the_best_matching_sentence_of_each_note(self, client):
        put_note(
            client,
            "notes/car.md",
            "# Car\n\nThe car is blue. The car key is in the drawer. Tyres were changed.",
        )
        d = data(client.post_json(f"{API}/agent/chat", {"message": "where is the car key?"}))
        assert d["reply"] == "From your notes:\n• The car key is in the drawer. — notes/car.md"
        assert d["sources"] == [{"path": "notes/car.md", "title": "Car"}]

    def test_the_open_note_counts_only_when_it_matches(self, client):
        put_note(client, "notes/car.md", "# Car\n\nThe car key is in the drawer.")
        put_note(client, "notes/open.md", "# Open\n\nNothing about vehicles here at all.")
        d = data(
            client.post_json(
                f"{API}/agent/chat", {"message": "car key?", "notePath": "notes/open.md"}
            )
        )
        assert [s["path"] for s in d["sources"]] == ["notes/car.md"]
        assert "vehicles" not in d["reply"]
        client.put_json(
            note_url("notes/open.md"), {"content": "# Open\n\nThe spare car key is at Anna's."}
        )
        d = data(
            client.post_json(
                f"{API}/agent/chat", {"message": "car key?", "notePath": "notes/open.md"}
            )
        )
        assert d["sources"][0]["path"] == "notes/open.md"
        assert d["reply"].splitlines()[1] == "• The spare car key is at Anna's. — notes/open.md"


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


BROKEN_HOOK_PLUGIN = """
import notesvc

def explode(svc, path, content):
    raise RuntimeError("boom in a hook")

PLUGIN = notesvc.Plugin(name="explosive", hooks={"note_saved": explode})
"""


class TestPlugins:
    @pytest.fixture
    def plugin_app(self, make_app, root):
        plugins = root / ".notesvc" / "plugins"
        plugins.mkdir(parents=True)
        (plugins / "hello.py").write_text(HELLO_PLUGIN)
        (plugins / "explosive.py").write_text(BROKEN_HOOK_PLUGIN)
        (plugins / "broken_import.py").write_text("import no_such_module_anywhere\n")
        (plugins / "no_plugin.py").write_text("x = 1\n")
        return with_key(make_app())

    def test_list_and_get(self, client):
        plugins = data(client.get(f"{API}/plugins"))["plugins"]
        names = [p["name"] for p in plugins]
        assert {"backlinks", "tags", "daily"} <= set(names)
        for p in plugins:
            assert {"name", "version", "description", "enabled", "builtin", "error"} <= set(p)
        daily = data(client.get(f"{API}/plugins/daily"))
        assert daily["builtin"] is True
        assert daily["enabled"] is True
        assert_error(client.get(f"{API}/plugins/nope", status=404), 404, "NOT_FOUND")

    def test_toggle_is_persisted_and_routes_refuse(self, client, make_app):
        assert data(client.post(f"{API}/plugins/daily/toggle"))["enabled"] is False
        assert_error(client.post(f"{API}/plugins/daily/today", status=403), 403, "PLUGIN_DISABLED")
        again = with_key(make_app())
        assert data(again.get(f"{API}/plugins/daily"))["enabled"] is False
        assert data(again.post(f"{API}/plugins/daily/toggle"))["enabled"] is True
        again.post(f"{API}/plugins/daily/today", status=201)

    def test_daily_creates_once(self, client):
        today = time.strftime("%Y-%m-%d")
        first = data(client.post(f"{API}/plugins/daily/today", status=201))
        assert first["path"] == f"notes/daily/{today}.md"
        second = data(client.post(f"{API}/plugins/daily/today", status=200))
        assert second["path"] == first["path"]
        assert hits(client, time.strftime("%B")) == [first["path"]]

    def test_backlinks(self, client):
        put_note(client, "notes/target.md", "# Target")
        put_note(client, "notes/a.md", "see [[target]] and [[Target|alias]]")
        put_note(client, "notes/sub/b.md", "see [the target](../target.md)")
        put_note(client, "notes/c.md", "see [[notes/target.md]]")
        put_note(client, "notes/d.md", "no link to target here; [x](https://e.org/target.md)")
        d = data(client.get(f"{API}/plugins/backlinks/notes%2Ftarget.md"))
        assert [b["path"] for b in d["backlinks"]] == ["notes/a.md", "notes/c.md", "notes/sub/b.md"]
        assert_error(
            client.get(f"{API}/plugins/backlinks/notes%2Fnone.md", status=404), 404, "NOT_FOUND"
        )
        assert_error(
            client.get(f"{API}/plugins/backlinks/..%2Fx", status=400), 400, "VALIDATION_ERROR"
        )

    def test_tags(self, client):
        put_note(client, "notes/a.md", "---\ntags: [Work, urgent]\n---\n# A #idea\n")
        put_note(client, "notes/b.md", "#idea here\n```\n#notatag in code\n```\n`#nor` this")
        put_note(client, "notes/c.md", "---\ntags:\n  - work\n---\nbody #project/alpha")
        tags = data(client.get(f"{API}/plugins/tags"))
        assert tags["name"] == "tags"
        assert {t["tag"]: t["count"] for t in tags["tags"]} == {
            "idea": 2,
            "project/alpha": 1,
            "urgent": 1,
            "work": 2,
        }
        idea = data(client.get(f"{API}/plugins/tags/idea"))
        assert [n["path"] for n in idea["notes"]] == ["notes/a.md", "notes/b.md"]
        assert (
            data(client.get(f"{API}/plugins/tags/project/alpha"))["notes"][0]["path"]
            == "notes/c.md"
        )
        assert_error(client.get(f"{API}/plugins/tags/nope", status=404), 404, "NOT_FOUND")

    def test_tags_and_backlinks_follow_each_change_reading_only_the_changed_notes(
        self, client, root, make_app, monkeypatch
    ):
        """The tags and backlinks kept between looks are read again only for the notes
        whose file changed, yet answer as a server starting on the same notes would: a
        note's [[name]] leads elsewhere once another note takes that name first."""
        monkeypatch.setattr(notesvc.ReadCache, "RACY_SECONDS", 0.0)  # every key remembered
        svc = client.app.service
        reads, here = [], threading.get_ident()  # not the reminders' thread
        document = svc.index._document

        def counted(path, *rest):
            if threading.get_ident() == here:
                reads.append(path)
            return document(path, *rest)

        monkeypatch.setattr(svc.index, "_document", counted)

        def answers(app) -> tuple:
            tags = data(app.get(f"{API}/plugins/tags"))["tags"]
            tagged = {t["tag"]: data(app.get(f"{API}/plugins/tags/{t['tag']}")) for t in tags}
            linked = {
                p: data(app.get(f"{API}/plugins/backlinks/{urllib.parse.quote(p, safe='')}"))
                for p in ("notes/b/target.md", "notes/a/target.md", "notes/plain.md")
                if (root / p).exists()
            }
            return tags, tagged, linked

        def same_as_a_fresh_start() -> None:
            assert answers(client) == answers(with_key(make_app()))

        for i in range(20):
            put_note(client, f"notes/filler/{i}.md", f"# Filler {i}\n\nnothing to see")
        put_note(client, "notes/b/target.md", "# Target B #work")
        put_note(client, "notes/links.md", "see [[target]] and [p](plain.md) #idea")
        put_note(client, "notes/plain.md", "---\ntags: [home]\n---\nplain")
        reads.clear()
        same_as_a_fresh_start()
        assert len(set(reads)) == 23  # the first look reads every note
        reads.clear()
        put_note(client, "notes/a/target.md", "# Target A #work #new")  # sorts first
        client.put_json(note_url("notes/plain.md"), {"content": "no tags now"})
        same_as_a_fresh_start()
        assert sorted(set(reads)) == ["notes/a/target.md", "notes/plain.md"]
        linked = data(client.get(f"{API}/plugins/backlinks/notes%2Fa%2Ftarget.md"))
        assert [b["path"] for b in linked["backlinks"]] == ["notes/links.md"]
        client.delete(note_url("notes/a/target.md"))
        (root / "notes/links.md").write_text("edited elsewhere #idea #outside\n[[target]]")
        svc.sync_index()  # what the rescan runs (the reminders' first look reads every note)
        reads.clear()
        same_as_a_fresh_start()
        assert sorted(set(reads)) == ["notes/links.md"]
        assert "outside" in {t["tag"] for t in data(client.get(f"{API}/plugins/tags"))["tags"]}
        reads.clear()
        client.patch_json(note_url("notes/b/target.md") + "/move", {"path": "notes/c/goal.md"})
        same_as_a_fresh_start()
        assert sorted(set(reads)) == ["notes/c/goal.md"]

    def test_a_second_save_in_the_same_clock_tick_is_not_missed(self, client, root, make_app):
        """A note's key is its path, size and mtime: a save of the same size in the same
        clock tick (coarse timestamps: FAT, network shares, older kernels) keeps it. A note
        changed in the last RACY_SECONDS is therefore read again at every look."""
        svc = client.app.service

        def tags(app) -> set:
            return {t["tag"] for t in data(app.get(f"{API}/plugins/tags"))["tags"]}

        put_note(client, "notes/n.md", "hello #alpha")
        assert tags(client) == {"alpha"}
        note = root / "notes/n.md"
        before = os.stat(note)
        client.put_json(note_url("notes/n.md"), {"content": "hello #omega"})
        os.utime(note, ns=(before.st_atime_ns, before.st_mtime_ns))  # the same tick
        after = os.stat(note)
        assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
        svc.index.add("notes/n.md", note.read_text(), after.st_size, after.st_mtime_ns)
        put_note(client, "notes/other.md", "the index moves on")
        assert tags(client) == tags(with_key(make_app())) == {"omega"}

    def test_a_note_unreadable_for_one_look_is_read_at_the_next(
        self, client, make_app, monkeypatch
    ):
        svc = client.app.service
        monkeypatch.setattr(notesvc.ReadCache, "RACY_SECONDS", 0.0)  # every key remembered
        put_note(client, "notes/n.md", "hello #alpha [[other]]")
        put_note(client, "notes/other.md", "x")
        read = svc.index._read
        monkeypatch.setattr(
            svc.index, "_read", lambda p, *a: None if p == "notes/n.md" else read(p, *a)
        )
        data(client.get(f"{API}/plugins/tags"))  # EMFILE, EIO... during this look
        data(client.get(f"{API}/plugins/backlinks/notes%2Fother.md"))
        monkeypatch.setattr(svc.index, "_read", read)
        put_note(client, "notes/third.md", "y")  # the index changes; that note does not
        fresh = with_key(make_app())
        for url in (f"{API}/plugins/tags", f"{API}/plugins/backlinks/notes%2Fother.md"):
            assert data(client.get(url)) == data(fresh.get(url))
        assert data(client.get(f"{API}/plugins/tags/alpha"))["notes"][0]["path"] == "notes/n.md"

    def test_move_with_update_links_rewrites_every_linking_note(self, client, root):
        put_note(client, "notes/old/target.md", "# Target\n\nsee [other](../other.md)")
        put_note(client, "notes/other.md", "# Other")
        put_note(client, "notes/a.md", "by name [[target]], aliased [[target|T]]")
        put_note(client, "notes/b.md", "by path [[old/target]] and [[notes/old/target.md]]")
        put_note(
            client,
            "notes/deep/c.md",
            "markdown [t](../old/target.md#part) and [abs](/notes/old/target.md)",
        )
        put_note(client, "notes/d.md", "unrelated [[other]]")
        rec = data(
            client.patch_json(
                note_url("notes/old/target.md") + "/move",
                {"path": "notes/new/place/goal.md", "updateLinks": True},
            )
        )
        assert rec["path"] == "notes/new/place/goal.md"
        assert set(rec["linksUpdated"]) == {
            "notes/a.md",
            "notes/b.md",
            "notes/deep/c.md",
            "notes/new/place/goal.md",
        }
        read = lambda p: (root / p).read_text()  # noqa: E731
        assert read("notes/a.md") == "by name [[goal]], aliased [[goal|T]]"
        assert read("notes/b.md") == "by path [[new/place/goal]] and [[notes/new/place/goal.md]]"
        assert read("notes/deep/c.md") == (
            "markdown [t](../new/place/goal.md#part) and [abs](/notes/new/place/goal.md)"
        )
        assert read("notes/d.md") == "unrelated [[other]]"
        # The moved note's own relative link still reaches its target.
        assert "[other](../../other.md)" in read("notes/new/place/goal.md")
        backlinks = data(client.get(f"{API}/plugins/backlinks/notes%2Fnew%2Fplace%2Fgoal.md"))
        assert len(backlinks["backlinks"]) == 3

    def test_move_without_update_links_leaves_links(self, client, root):
        put_note(client, "notes/t.md", "t")
        put_note(client, "notes/a.md", "[[t]]")
        rec = data(client.patch_json(note_url("notes/t.md") + "/move", {"path": "notes/u.md"}))
        assert "linksUpdated" not in rec
        assert (root / "notes/a.md").read_text() == "[[t]]"
        resp = client.patch_json(
            note_url("notes/u.md") + "/move",
            {"path": "notes/v.md", "updateLinks": "yes"},
            status=400,
        )
        assert_error(resp, 400, "VALIDATION_ERROR")

    def test_third_party_plugins_load_and_fail_in_isolation(self, plugin_app, caplog):
        plugins = {p["name"]: p for p in data(plugin_app.get(f"{API}/plugins"))["plugins"]}
        assert plugins["hello"]["builtin"] is False
        assert plugins["hello"]["error"] is None
        assert "ModuleNotFoundError" in plugins["broken-import"]["error"]
        assert "PLUGIN" in plugins["no-plugin"]["error"]
        assert plugins["broken-import"]["enabled"] is False
        # A hook that raises does not fail the save; the plugin is listed with the error.
        put_note(plugin_app, "notes/x.md", "saved anyway")
        assert data(plugin_app.get(f"{API}/plugins/explosive"))["error"].endswith("boom in a hook")
        assert any("explosive" in r.getMessage() for r in caplog.records)
        greeting = data(plugin_app.get(f"{API}/plugins/hello/greeting"))
        assert greeting == {"hello": "world", "saved": ["notes/x.md"]}
        plugin_app.post(f"{API}/plugins/hello/toggle")
        assert_error(
            plugin_app.get(f"{API}/plugins/hello/greeting", status=403), 403, "PLUGIN_DISABLED"
        )
        assert_error(
            plugin_app.post(f"{API}/plugins/broken-import/toggle", status=409), 409, "CONFLICT"
        )

    def test_plugin_can_bring_an_agent_provider(self, make_app, root):
        plugins = root / ".notesvc" / "plugins"
        plugins.mkdir(parents=True)
        (plugins / "echo.py").write_text(
            "import notesvc\n"
            "@notesvc.agent_provider('echo', model=lambda cfg: 'parrot-1')\n"
            "def echo(svc, question, found):\n"
            "    return 'you asked: ' + question + ' (' + str(len(found)) + ' notes)', 'parrot-1'\n"
            "PLUGIN = notesvc.Plugin(name='echo', description='repeats the question')\n"
        )
        client = with_key(make_app(SERVICE_AGENT_PROVIDER="echo"))
        put_note(client, "notes/a.md", "parrots talk")
        assert data(client.get(f"{API}/agent/status"))["model"] == "parrot-1"
        reply = data(client.post_json(f"{API}/agent/chat", {"message": "parrots?"}))
        assert reply["reply"] == "you asked: parrots? (1 notes)"
        assert reply["provider"] == "echo"
        # The provider is this app's: the module-wide registry and another app never see it.
        assert "echo" not in notesvc.AGENT_PROVIDERS
        other = make_app(tmp_path_factory_root(root))
        assert "echo" not in other.app.service.agent_providers
        with pytest.raises(notesvc.ConfigError, match="SERVICE_AGENT_PROVIDER"):
            make_app(tmp_path_factory_root(root), SERVICE_AGENT_PROVIDER="echo")

    def test_plugin_routes_are_in_openapi(self, plugin_app):
        doc = plugin_app.get(f"{API}/openapi.json").json
        assert "/api/v1/plugins/hello/greeting" in doc["paths"]
        assert "/api/v1/plugins/daily/today" in doc["paths"]


RECORDER_PLUGIN = """
import notesvc

CALLS = []

def saved(svc, path, content):
    CALLS.append(["note_saved", path, content])

def moved(svc, old_path, new_path):
    CALLS.append(["note_moved", old_path, new_path])

def deleted(svc, path):
    CALLS.append(["note_deleted", path])

def restored(svc, path, content):
    CALLS.append(["note_restored", path, content])

def calls(svc):
    return {"calls": CALLS}

PLUGIN = notesvc.Plugin(
    name="recorder",
    hooks={
        "note_saved": saved,
        "note_moved": moved,
        "note_deleted": deleted,
        "note_restored": restored,
    },
    routes=(notesvc.PluginRoute("GET", "/calls", calls),),
)
"""


class TestPluginHooks:
    """Each hook in notesvc.HOOKS reaches a third-party plugin with its documented arguments.

    Every hook has a `test_hook_<name>` here; test_every_hook_has_a_test enforces it.
    """

    @pytest.fixture
    def client(self, make_app, root):
        plugins = root / ".notesvc" / "plugins"
        plugins.mkdir(parents=True)
        (plugins / "recorder.py").write_text(RECORDER_PLUGIN)
        client = with_key(make_app())
        assert data(client.get(f"{API}/plugins/recorder"))["error"] is None
        return client

    @staticmethod
    def calls(client) -> list:
        return data(client.get(f"{API}/plugins/recorder/calls"))["calls"]

    def test_every_hook_has_a_test(self):
        source = Path(__file__).read_text()
        untested = [h for h in notesvc.HOOKS if f"def test_hook_{h}(" not in source]
        assert not untested, (
            f"notesvc.HOOKS has hooks without a test: {', '.join(untested)}. For each, add "
            + ", ".join(f"`def test_hook_{h}(self, client)`" for h in untested)
            + " to TestPluginHooks in test_notesvc.py: give RECORDER_PLUGIN a function for "
            "the hook, trigger it through the API and assert the arguments it was called with."
        )

    def test_hook_note_saved(self, client):
        put_note(client, "notes/a.md", "first")
        client.put_json(note_url("notes/a.md"), {"content": "second"})
        assert self.calls(client) == [
            ["note_saved", "notes/a.md", "first"],
            ["note_saved", "notes/a.md", "second"],
        ]
        # An append (a channel's /save) is a save too, with the note's whole new content.
        ch = data(client.post_json(f"{API}/channels", {"provider": "web"}, status=201))
        webtest.TestApp(client.app).post_json(
            f"{API}/channels/webhook/web",
            web_update("/save buy milk"),
            headers={"X-Service-Channel-Secret": ch["secret"]},
        )
        last = self.calls(client)[-1]
        assert last[0] == "note_saved"
        assert last[1].startswith("notes/daily/")  # CONTRACT 20: /save goes to the daily note
        assert "buy milk" in last[2]
        # A refused write calls nothing.
        before = self.calls(client)
        client.post_json(f"{API}/notes", {"path": "notes/a.md", "content": "x"}, status=409)
        client.put_json(
            note_url("notes/a.md"), {"content": "x"}, headers={"If-Match": '"0"'}, status=412
        )
        assert self.calls(client) == before

    def test_hook_note_moved(self, client):
        put_note(client, "notes/old.md", "# Old")
        put_note(client, "notes/taken.md", "# Taken")
        start = len(self.calls(client))
        client.patch_json(note_url("notes/old.md") + "/move", {"path": "notes/sub/new.md"})
        assert self.calls(client)[start:] == [["note_moved", "notes/old.md", "notes/sub/new.md"]]
        # Moving with updateLinks also saves each note whose links were rewritten.
        put_note(client, "notes/linking.md", "see [[new]]")
        start = len(self.calls(client))
        client.patch_json(
            note_url("notes/sub/new.md") + "/move", {"path": "notes/newer.md", "updateLinks": True}
        )
        assert self.calls(client)[start:] == [
            ["note_moved", "notes/sub/new.md", "notes/newer.md"],
            ["note_saved", "notes/linking.md", "see [[newer]]"],
        ]
        # A refused move calls nothing.
        before = self.calls(client)
        resp = client.patch_json(
            note_url("notes/newer.md") + "/move", {"path": "notes/taken.md"}, status=409
        )
        assert_error(resp, 409, "CONFLICT")
        client.patch_json(note_url("notes/gone.md") + "/move", {"path": "notes/x.md"}, status=404)
        assert self.calls(client) == before

    def test_hook_note_deleted(self, client):
        put_note(client, "notes/doomed.md", "bye")
        put_note(client, "notes/kept.md", "stay")
        start = len(self.calls(client))
        client.delete(note_url("notes/doomed.md"))
        assert self.calls(client)[start:] == [["note_deleted", "notes/doomed.md"]]
        # A refused delete calls nothing, and a switched-off plugin hears nothing.
        client.delete(note_url("notes/doomed.md"), status=404)
        client.delete(note_url("notes/kept.md"), headers={"If-Match": '"0"'}, status=412)
        before = self.calls(client)
        assert data(client.post(f"{API}/plugins/recorder/toggle"))["enabled"] is False
        client.delete(note_url("notes/kept.md"))
        assert data(client.post(f"{API}/plugins/recorder/toggle"))["enabled"] is True
        assert self.calls(client) == before

    def test_hook_note_restored(self, client):
        put_note(client, "notes/p.md", "one")
        client.put_json(note_url("notes/p.md"), {"content": "two"})
        (version,) = data(client.get(note_url("notes/p.md") + "/versions"))["versions"]
        start = len(self.calls(client))
        restore = f"{note_url('notes/p.md')}/versions/{version['id']}/restore"
        client.post(restore)  # from a version: note_restored, not note_saved
        client.delete(note_url("notes/p.md"))
        (item,) = data(client.get(f"{API}/trash"))["items"]
        client.post_json(f"{API}/trash/{item['id']}/restore", {"path": "notes/q.md"})
        assert self.calls(client)[start:] == [
            ["note_restored", "notes/p.md", "one"],
            ["note_deleted", "notes/p.md"],
            ["note_restored", "notes/q.md", "one"],
        ]
        # A refused restore calls nothing (the history went along to notes/q.md).
        before = self.calls(client)
        client.post(restore.replace("p.md", "q.md"), headers={"If-Match": '"0"'}, status=412)
        client.delete(note_url("notes/q.md"))
        put_note(client, "notes/q.md", "taken")
        (item,) = data(client.get(f"{API}/trash"))["items"]
        client.post(f"{API}/trash/{item['id']}/restore", status=409)
        assert self.calls(client)[len(before) :] == [
            ["note_deleted", "notes/q.md"],
            ["note_saved", "notes/q.md", "taken"],
        ]


def expected_score(findings: list) -> int:
    """The documented formula, from the findings' severities."""
    count = collections.Counter(f["severity"] for f in findings)
    raw = 100 - 40 * count["critical"] - 20 * count["high"] - 10 * count["medium"]
    return max(0, raw - 3 * count["low"])


def _open_state_files(app, root: Path) -> None:
    os.chmod(root / ".notesvc" / "state.json", 0o644)


def _open_notes_folder(app, root: Path) -> None:
    os.chmod(root / "notes", 0o777)


def _a_plugin_file(app, root: Path) -> None:
    plugins = root / ".notesvc" / "plugins"
    plugins.mkdir(mode=0o700, exist_ok=True)
    (plugins / "planted.py").write_text("x = 1\n")
    os.chmod(plugins / "planted.py", 0o600)


def _telegram_channel_without_allowlist(app, root: Path) -> None:
    body = {"provider": "telegram", "config": {"botToken": "1:x"}}
    with_key(app).post_json(f"{API}/channels", body, status=201)


def _webhook_secret_in_a_query_string(app, root: Path) -> None:
    body = {"provider": "telegram", "config": {"botToken": "1:x", "allowedChatIds": [42]}}
    ch = data(with_key(app).post_json(f"{API}/channels", body, status=201))
    url = f"{API}/channels/webhook/telegram?secret={ch['secret']}"
    assert data(webtest.TestApp(app.app).post_json(url, {"update_id": 1}))["handled"] is False


def _whatsapp_channel_without_app_secret(app, root: Path) -> None:
    config = {**MINIMAL_CONFIG["whatsapp"], "allowedNumbers": ["15551234567"]}
    body = {"provider": "whatsapp", "config": config}
    with_key(app).post_json(f"{API}/channels", body, status=201)


def _an_old_key(app, root: Path) -> None:
    state_file = root / ".notesvc" / "state.json"
    state = json.loads(state_file.read_text())
    state["keyCreatedAt"] = "2020-01-01T00:00:00.000Z"
    state_file.write_text(json.dumps(state))


def _a_write_key_without_expiry(app, root: Path) -> None:
    body = {"name": "helper", "scope": "write"}
    with_key(app).post_json(f"{API}/auth/keys", body, status=201)


def _an_old_share_link(app, root: Path) -> None:
    put_note(with_key(app), "notes/old.md", "old")
    with_key(app).post_json(f"{API}/shares", {"path": "notes/old.md", "expiresInDays": 365})
    state_file = root / ".notesvc" / "state.json"
    state = json.loads(state_file.read_text())
    state["shares"][0]["createdAt"] = "2020-01-01T00:00:00.000Z"
    state_file.write_text(json.dumps(state))


def _many_oauth_clients(app, root: Path) -> None:
    for i in range(21):  # from 21 addresses: registration is rate-limited per address
        webtest.TestApp(app.app, extra_environ={"REMOTE_ADDR": f"198.51.100.{i}"}).post_json(
            "/oauth/register", {"redirect_uris": ["https://app.example/cb"]}, status=201
        )


@dataclasses.dataclass(frozen=True)
class Firing:
    """A configuration in which an audit check fires, and the id its finding must match."""

    id: str  # a regular expression
    env: dict = dataclasses.field(default_factory=dict)  # SERVICE_* settings over the safe ones
    change: typing.Callable | None = None  # change(app, root) after the start
    linked: bool = True  # a client has linked (setup complete)


# For every audit check: a configuration in which it fires. The rest of the configuration
# is the safe one (loopback, linked, private folders), in which it must not.
FIRING_CONFIGURATIONS = {
    "auth_off": Firing("auth-off", {"SERVICE_AUTH_MODE": "none"}),
    "setup_exposed": Firing("setup-exposed", {"SERVICE_HOST": "0.0.0.0"}, linked=False),
    "cors_wildcard": Firing("cors-wildcard", {"SERVICE_CORS_ORIGINS": "*"}),
    "jwt_secret": Firing(
        "jwt-secret-weak", {"SERVICE_AUTH_MODE": "jwt", "SERVICE_JWT_SECRET": "a" * 40}
    ),
    "state_private": Firing("state-readable-file", change=_open_state_files),
    "notes_folder": Firing("notes-writable", change=_open_notes_folder),
    "plugins": Firing("plugin-planted", change=_a_plugin_file),
    "channel_allowlists": Firing(r"channel-open-\S+", change=_telegram_channel_without_allowlist),
    "query_secrets": Firing("secret-in-query", change=_webhook_secret_in_a_query_string),
    "channel_signatures": Firing(
        r"channel-unsigned-\S+", change=_whatsapp_channel_without_app_secret
    ),
    "plain_http_upstreams": Firing(
        "relay-plain-http", {"SERVICE_RELAY_URL": "http://relay.example.org"}
    ),
    "relay_in_transit": Firing(
        "relay-sees-transit", {"SERVICE_RELAY_URL": "https://relay.example.org"}
    ),
    "key_age": Firing("key-old", change=_an_old_key),
    "plain_http_bind": Firing("plain-http-all-interfaces", {"SERVICE_HOST": "0.0.0.0"}),
    "tool_writes": Firing(
        "tool-writes-without-auth", {"SERVICE_AUTH_MODE": "none", "SERVICE_MCP_WRITE": "true"}
    ),
    "history_off": Firing("history-off", {"SERVICE_HISTORY_MAX_VERSIONS": "0"}),
    "grants": Firing("grant-write-forever", change=_a_write_key_without_expiry),
    "share_links": Firing("share-links-old", change=_an_old_share_link),
    "oauth_clients": Firing("oauth-clients-many", change=_many_oauth_clients),
}


class TestSecurity:
    @pytest.fixture
    def safe(self, make_app, root):
        """A configuration with no finding: loopback, linked, private folders."""
        app = make_app(SERVICE_HOST="127.0.0.1")
        with_key(app).post(f"{API}/auth/link", extra_environ=LOCAL)
        os.chmod(root / "notes", 0o700)
        return app

    def test_safe_configuration_scores_100(self, safe):
        report = audit(safe)
        assert report["score"] == 100, report["findings"]
        assert report["summary"] == {"critical": 0, "high": 0, "medium": 0, "low": 0, "info": 0}

    def test_finding_shape_and_summary(self, make_app):
        report = audit(make_app(SERVICE_AUTH_MODE="none"))
        for f in report["findings"]:
            assert set(f) == {"id", "severity", "title", "detail", "recommendation"}
            assert f["severity"] in notesvc.SEVERITIES
        assert sum(report["summary"].values()) == len(report["findings"])
        order = [notesvc.SEVERITIES.index(f["severity"]) for f in report["findings"]]
        assert order == sorted(order)

    def test_score_formula(self, make_app, root):
        app = make_app(
            SERVICE_HOST="127.0.0.1",
            SERVICE_CORS_ORIGINS="*",
            SERVICE_AUTH_MODE="jwt",
            SERVICE_JWT_SECRET="a" * 40,
            SERVICE_RELAY_URL="http://relay.example.org",
        )
        os.chmod(root / "notes", 0o755)
        report = notesvc.run_audit(app.app.service)
        assert {f["id"]: f["severity"] for f in report["findings"]} == {
            "setup-exposed": "critical",  # registered with a relay: reachable from anywhere
            "cors-wildcard": "high",
            "jwt-secret-weak": "high",
            "relay-plain-http": "medium",
            "notes-readable": "low",
            "relay-sees-transit": "info",
        }
        assert report["score"] == expected_score(report["findings"]) == 100 - 40 - 20 - 20 - 10 - 3
        assert audit(app)["score"] == report["score"]  # the endpoint says the same

    def test_score_never_below_zero(self, make_app, root):
        app = make_app(SERVICE_HOST="0.0.0.0", SERVICE_AUTH_MODE="none", SERVICE_CORS_ORIGINS="*")
        os.chmod(root / "notes", 0o777)
        os.chmod(root / ".notesvc" / "state.json", 0o644)
        os.chmod(root / ".notesvc", 0o755)
        report = audit(app)
        costs = sum(notesvc.SEVERITY_COST[f["severity"]] for f in report["findings"])
        assert costs > 100, report["findings"]  # the formula alone would go negative
        assert report["score"] == 0

    @pytest.mark.parametrize(
        ("env", "finding", "severity"),
        [
            ({"SERVICE_AUTH_MODE": "none"}, "auth-off", "critical"),
            ({"SERVICE_HOST": "0.0.0.0"}, "setup-exposed", "critical"),
            ({"SERVICE_CORS_ORIGINS": "*"}, "cors-wildcard", "high"),
            (
                {"SERVICE_AUTH_MODE": "jwt", "SERVICE_JWT_SECRET": "a" * 40},
                "jwt-secret-weak",
                "high",
            ),
            ({"SERVICE_RELAY_URL": "http://relay.example.org"}, "relay-plain-http", "medium"),
            (
                {
                    "SERVICE_AGENT_PROVIDER": "openai",
                    "SERVICE_AGENT_BASE_URL": "http://gpu.lan:8080/v1",
                    "SERVICE_AGENT_MODEL": "m",
                    "SERVICE_AGENT_API_KEY": "k",
                },
                "model-plain-http",
                "high",
            ),
            ({"SERVICE_HOST": "0.0.0.0"}, "plain-http-all-interfaces", "medium"),
        ],
    )
    def test_configuration_checks_trigger(self, make_app, root, env, finding, severity):
        env = {"SERVICE_HOST": "127.0.0.1", **env}
        report = audit(make_app(**env))
        found = {f["id"]: f["severity"] for f in report["findings"]}
        assert found.get(finding) == severity, report["findings"]

    def test_configuration_checks_stay_quiet_when_fine(self, make_app, tmp_path):
        for i, env in enumerate(
            (
                {"SERVICE_AUTH_MODE": "jwt", "SERVICE_JWT_SECRET": JWT_SECRET},
                {"SERVICE_RELAY_URL": "https://relay.example.org"},
                {
                    "SERVICE_AGENT_PROVIDER": "openai",
                    "SERVICE_AGENT_BASE_URL": "http://127.0.0.1:11434/v1",
                    "SERVICE_AGENT_MODEL": "m",
                },
                {"SERVICE_HOST": "0.0.0.0", "SERVICE_TRUST_PROXY": "true"},
                {"SERVICE_CORS_ORIGINS": "https://app.example"},
            )
        ):
            app_root = tmp_path / f"quiet{i}"
            app = make_app(app_root, SERVICE_HOST=env.pop("SERVICE_HOST", "127.0.0.1"), **env)
            home = {"REMOTE_ADDR": "192.168.1.9"}  # not the trusted proxy: a client at home
            with_key(app).post(f"{API}/auth/link", extra_environ=home)
            os.chmod(app_root / "notes", 0o700)
            report = audit(app)
            assert all(f["severity"] == "info" for f in report["findings"]), report["findings"]

    @pytest.mark.parametrize(
        "env",
        [
            {"SERVICE_HOST": "0.0.0.0"},
            {"SERVICE_HOST": "0.0.0.0", "SERVICE_SETUP_LOCAL_ONLY": "true"},
            {"SERVICE_HOST": "127.0.0.1", "SERVICE_RELAY_URL": "https://relay.example.org"},
            {"SERVICE_HOST": "127.0.0.1", "SERVICE_RELAY_URL": "http://127.0.0.1:8441"},
        ],
    )
    def test_an_incomplete_setup_reachable_beyond_loopback_is_critical(self, make_app, env):
        """Bound beyond loopback or registered with a relay: whoever sets it up first owns
        it, whatever SERVICE_SETUP_LOCAL_ONLY says (a proxy or tunnel can make anyone local)."""
        report = audit(make_app(**env))
        found = {f["id"]: f for f in report["findings"]}
        assert found["setup-exposed"]["severity"] == "critical"
        assert "setup-incomplete" not in found
        assert "pair" in found["setup-exposed"]["recommendation"]
        assert report["summary"]["critical"] >= 1

    def test_an_incomplete_setup_on_loopback_alone_is_low(self, make_app):
        found = {
            f["id"]: f["severity"] for f in audit(make_app(SERVICE_HOST="127.0.0.1"))["findings"]
        }
        assert found["setup-incomplete"] == "low"
        assert "setup-exposed" not in found
        open_port = make_app(
            SERVICE_HOST="127.0.0.1",
            SERVICE_RELAY_URL="https://relay.example.org",
            SERVICE_PAIRING_MODE="open-port",  # a relay named, but never registered with
        )
        assert "setup-exposed" not in ids(audit(open_port))

    def test_file_mode_checks(self, safe, root):
        os.chmod(root / ".notesvc" / "state.json", 0o644)
        os.chmod(root / ".notesvc", 0o755)
        os.chmod(root / "notes", 0o777)
        plugins = root / ".notesvc" / "plugins"
        plugins.mkdir()
        os.chmod(plugins, 0o777)
        found = ids(audit(safe))
        assert {
            "state-readable-file",
            "state-readable-dir",
            "notes-writable",
            "plugins-writable",
        } <= found
        os.chmod(root / "notes", 0o755)
        assert "notes-readable" in ids(audit(safe))

    def test_key_age(self, safe, root):
        state_file = root / ".notesvc" / "state.json"
        state = json.loads(state_file.read_text())
        state["keyCreatedAt"] = "2020-01-01T00:00:00.000Z"
        state_file.write_text(json.dumps(state))
        assert "key-old" in ids(audit(safe))

    def test_channel_without_allowlist_and_query_secret(self, safe):
        client = with_key(safe)
        ch = data(
            client.post_json(
                f"{API}/channels",
                {"provider": "telegram", "config": {"botToken": "1:x"}},
                status=201,
            )
        )
        assert f"channel-open-{ch['id']}" in ids(audit(safe))
        webtest.TestApp(safe.app).post_json(
            f"{API}/channels/webhook/telegram?secret={ch['secret']}", {"update_id": 1}
        )
        assert "secret-in-query" in ids(audit(safe))

    def test_third_party_plugin_is_reported(self, make_app, root):
        plugins = root / ".notesvc" / "plugins"
        plugins.mkdir(parents=True)
        (plugins / "hello.py").write_text(HELLO_PLUGIN)
        assert "plugin-hello" in ids(audit(make_app(SERVICE_HOST="127.0.0.1")))

    def test_plugin_files_writable_symlinked_or_foreign_are_flagged(self, safe, root, tmp_path):
        plugins = root / ".notesvc" / "plugins"
        plugins.mkdir(mode=0o700)
        (plugins / "open.py").write_text("x = 1\n")
        os.chmod(plugins / "open.py", 0o666)
        elsewhere = tmp_path / "elsewhere.py"
        elsewhere.write_text("x = 1\n")
        (plugins / "linked.py").symlink_to(elsewhere)
        (plugins / "fine.py").write_text("x = 1\n")
        os.chmod(plugins / "fine.py", 0o600)
        if os.geteuid() == 0:
            os.chown(plugins / "fine.py", 65534, 65534)
        report = audit(safe)
        found = {f["id"]: f["severity"] for f in report["findings"]}
        assert found["plugin-writable-open"] == "high"
        assert found["plugin-symlink-linked"] == "high"
        assert "plugin-writable-fine" not in found
        assert "plugin-symlink-fine" not in found
        if os.geteuid() == 0:
            assert found["plugin-owner-fine"] == "high"
        # Files are listed by name even when they are no valid plugin.
        assert {"plugin-open", "plugin-linked", "plugin-fine"} <= set(found)

    def test_plugins_parent_writable_by_others_is_flagged_unless_sticky(self, make_app, tmp_path):
        shared = tmp_path / "shared"
        (shared / "plugins").mkdir(parents=True)
        os.chmod(shared / "plugins", 0o700)
        app = make_app(SERVICE_HOST="127.0.0.1", SERVICE_PLUGINS_DIR=str(shared / "plugins"))
        os.chmod(shared, 0o777)
        finding = {f["id"]: f for f in audit(app)["findings"]}["plugins-parent-writable"]
        assert finding["severity"] == "high"
        assert str(shared) in finding["detail"]
        os.chmod(shared, 0o1777)  # like /tmp: others cannot replace what is ours
        assert "plugins-parent-writable" not in ids(audit(app))
        os.chmod(shared, 0o755)
        assert "plugins-parent-writable" not in ids(audit(app))

    @pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0, reason="needs root")
    def test_plugins_folder_owned_by_another_user_is_flagged(self, make_app, tmp_path):
        owned = tmp_path / "owned"
        (owned / "plugins").mkdir(parents=True)
        app = make_app(SERVICE_HOST="127.0.0.1", SERVICE_PLUGINS_DIR=str(owned / "plugins"))
        assert "plugins-owner" not in ids(audit(app))
        os.chown(owned, 65534, 65534)
        finding = {f["id"]: f for f in audit(app)["findings"]}["plugins-owner"]
        assert finding["severity"] == "high"
        assert f"{owned} (uid 65534)" in finding["detail"]

    def test_web_channel_allowlist_is_not_counted_as_authentication(self, safe):
        client = with_key(safe)
        open_web = data(client.post_json(f"{API}/channels", {"provider": "web"}, status=201))
        listed = data(
            client.post_json(
                f"{API}/channels",
                {"provider": "web", "config": {"allowedSenders": ["kitchen"]}},
                status=201,
            )
        )
        report = audit(safe)
        found = {f["id"]: f for f in report["findings"]}
        for ch in (open_web, listed):  # the allowlist changes nothing: the secret is the lock
            assert found[f"channel-web-{ch['id']}"]["severity"] == "info"
            assert "not authentication" in found[f"channel-web-{ch['id']}"]["detail"]
            assert f"channel-open-{ch['id']}" not in found
        assert report["score"] == 100

    def test_every_audit_check_has_a_configuration_where_it_fires(self):
        missing = sorted(set(notesvc.AUDIT_CHECKS) - set(FIRING_CONFIGURATIONS))
        stale = sorted(set(FIRING_CONFIGURATIONS) - set(notesvc.AUDIT_CHECKS))
        assert not missing, (
            f"audit checks without an entry in FIRING_CONFIGURATIONS: {missing}; add one "
            "giving the settings / change under which each returns a finding, and its id"
        )
        assert not stale, f"FIRING_CONFIGURATIONS names checks that are gone: {stale}"

    @pytest.mark.parametrize("name", list(notesvc.AUDIT_CHECKS))
    def test_every_audit_check_fires_with_findings_of_the_right_shape(
        self, make_app, tmp_path, name
    ):
        assert name in FIRING_CONFIGURATIONS, f"add {name!r} to FIRING_CONFIGURATIONS"
        firing = FIRING_CONFIGURATIONS[name]
        reports = {}
        for label, case in (("safe", Firing(firing.id)), ("firing", firing)):
            app_root = tmp_path / label
            app = make_app(app_root, **{"SERVICE_HOST": "127.0.0.1", **case.env})
            if case.linked:
                with_key(app).post(f"{API}/auth/link", extra_environ=LOCAL)
            os.chmod(app_root / "notes", 0o700)
            if case.change:
                case.change(app, app_root)
            reports[label] = audit(app)
        matching = lambda report: [  # noqa: E731
            f for f in report["findings"] if re.fullmatch(firing.id, f["id"])
        ]
        assert matching(reports["firing"]), f"{name} did not fire: {reports['firing']}"
        assert not matching(reports["safe"]), f"{name} fires in the safe configuration"
        for report in reports.values():
            assert f"check-{name}" not in ids(report), "the check raised"
            for f in report["findings"]:
                assert set(f) == {"id", "severity", "title", "detail", "recommendation"}
                assert f["severity"] in notesvc.SEVERITIES
                for key in ("id", "title", "detail", "recommendation"):
                    assert isinstance(f[key], str), (key, f)
                    assert f[key].strip(), (key, f)

    def test_config_view_has_no_secret(self, make_app):
        app = make_app(
            SERVICE_AUTH_MODE="jwt",
            SERVICE_JWT_SECRET=JWT_SECRET,
            SERVICE_AGENT_API_KEY="sk-hidden",
        )
        d = data(with_key(app).get(f"{API}/security/config"))
        assert d["auth"]["mode"] == "jwt"
        assert d["auth"]["header"] == "X-Service-Key"
        assert d["auth"]["keyAgeDays"] == 0
        assert d["limits"]["lockout"]["failures"] == 10
        for key in ("setup", "network", "limits", "channels", "plugins"):
            assert key in d
        text = json.dumps(d)
        for secret in (JWT_SECRET, "sk-hidden", key_of(app)):
            assert secret not in text

    def test_recommendations_most_severe_first(self, make_app):
        recs = data(
            with_key(make_app(SERVICE_AUTH_MODE="none", SERVICE_CORS_ORIGINS="*")).get(
                f"{API}/security/recommendations"
            )
        )["recommendations"]
        assert recs[0]["severity"] == "critical"
        assert set(recs[0]) == {"id", "severity", "title", "action"}
        order = [notesvc.SEVERITIES.index(r["severity"]) for r in recs]
        assert order == sorted(order)

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_audit_cli_exit_status(self, tmp_path, make_app):
        make_app(tmp_path / "a")
        make_app(tmp_path / "b")
        bad = run_cli("audit", "--root", str(tmp_path / "a"), env={"SERVICE_HOST": "0.0.0.0"})
        assert bad.returncode == 1
        assert "[critical]" in bad.stdout
        assert "score" in bad.stdout
        good = run_cli("audit", "--root", str(tmp_path / "b"), env={"SERVICE_HOST": "127.0.0.1"})
        assert good.returncode == 0, good.stdout


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


def png_size(data: bytes) -> tuple:
    """Return (width, height) of a PNG, checking its signature, chunk CRCs and pixel data."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        length = int.from_bytes(data[pos : pos + 4], "big")
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        crc = int.from_bytes(data[pos + 8 + length : pos + 12 + length], "big")
        assert zlib.crc32(kind + body) == crc
        chunks[kind] = body
        pos += 12 + length
    width, height = (
        int.from_bytes(chunks[b"IHDR"][:4], "big"),
        int.from_bytes(chunks[b"IHDR"][4:8], "big"),
    )
    assert len(zlib.decompress(chunks[b"IDAT"])) == height * (1 + width * 3)
    assert b"IEND" in chunks
    return width, height


class TestWebClientPage:
    """The page as served: one locked-down response, its manifest and icons."""

    def test_page_is_small_self_contained_and_locked_down(self, anon):
        resp = anon.get("/")
        assert resp.content_type == "text/html"
        assert len(gzip.compress(resp.body)) < 60_000  # the budget: one response < 60 KB gzipped
        csp = resp.headers["Content-Security-Policy"]
        assert "default-src 'none'" in csp
        assert "unsafe-inline" not in csp
        assert "unsafe-eval" not in csp
        assert "script-src 'sha256-" in csp
        assert "<script src" not in resp.text
        assert resp.text.count("<script>") == 1
        assert resp.text.count("<style>") == 1
        markup = re.sub(r"<(script|style)>.*?</\1>", "", resp.text, flags=re.S)
        assert "http" not in markup.lower()  # nothing from elsewhere: no CDN, no fonts
        assert resp.headers["X-Frame-Options"] == "DENY"
        assert resp.headers["Referrer-Policy"] == "no-referrer"

    def test_csp_hashes_match_the_inline_script_and_style(self, anon):
        resp = anon.get("/")
        csp = resp.headers["Content-Security-Policy"]
        directives = dict(d.strip().split(" ", 1) for d in csp.split(";") if d.strip())
        script = re.search(r"<script>(.*)</script>", resp.text, re.S).group(1)
        style = re.search(r"<style>(.*)</style>", resp.text, re.S).group(1)
        digest = lambda t: base64.b64encode(hashlib.sha256(t.encode()).digest()).decode()  # noqa: E731
        assert directives["script-src"] == f"'sha256-{digest(script)}'"
        assert directives["style-src"] == f"'sha256-{digest(style)}'"
        assert directives["connect-src"] == "'self'"
        assert directives["manifest-src"] == "'self'"
        assert directives["frame-ancestors"] == "'none'"

    def test_script_reads_no_relay_url_and_never_builds_an_absolute_api_url(self):
        js = notesvc.WEB_JS
        assert "relayUrl" not in js.replace("a relayUrl", "")  # only the comment names it
        assert "ownOrigin(url)" in js  # every request is checked against the page's origin
        assert 'mode: "same-origin"' in js

    def test_script_is_valid_javascript(self, tmp_path):
        node = shutil.which("node") or shutil.which("nodejs")
        if not node:
            pytest.skip("no node on this machine (.ci/run installs Debian's nodejs)")
        script = tmp_path / "web-client.js"
        script.write_text(notesvc.WEB_JS)
        done = subprocess.run([node, "--check", str(script)], capture_output=True, timeout=60)
        assert done.returncode == 0, done.stderr.decode()

    def test_manifest_is_public_cacheable_and_points_at_served_icons(self, anon):
        resp = anon.get("/manifest.webmanifest")
        assert resp.headers["Content-Type"].startswith("application/manifest+json")
        assert resp.headers["Cache-Control"] == "public, max-age=86400"
        manifest = json.loads(resp.body)
        assert manifest["display"] == "standalone"
        assert manifest["start_url"] == "."
        assert manifest["theme_color"].startswith("#")
        purposes = {i.get("purpose", "any") for i in manifest["icons"]}
        assert purposes == {"any", "maskable"}
        for icon in manifest["icons"]:
            got = anon.get("/" + icon["src"])
            assert got.headers["Content-Type"] == icon["type"]
            if icon["type"] == "image/png":
                assert png_size(got.body) == tuple(map(int, icon["sizes"].split("x")))

    @pytest.mark.parametrize(
        ("path", "size"),
        [("/icon-192.png", 192), ("/icon-512.png", 512), ("/apple-touch-icon.png", 180)],
    )
    def test_png_icons_are_valid_pngs(self, anon, path, size):
        resp = anon.get(path)
        assert resp.headers["Cache-Control"] == "public, max-age=86400"
        assert resp.headers["X-Content-Type-Options"] == "nosniff"
        assert png_size(resp.body) == (size, size)
        assert len(resp.body) < 10_000

    def test_svg_icon_is_inert(self, anon):
        resp = anon.get("/icon.svg")
        assert resp.headers["Content-Type"] == "image/svg+xml"
        assert resp.headers["Content-Security-Policy"] == "default-src 'none'"
        assert "<script" not in resp.text
        assert not re.search(r"\son\w+=|href=", resp.text)

    def test_assets_need_no_key_and_refuse_other_methods(self, anon):
        for path in notesvc.WEB_ASSETS:
            anon.get(path, status=200)
            anon.post(path, status=405)
        anon.get("/icon.png", status=404)
        anon.get("/manifest.webmanifest/..%2f..%2fetc%2fpasswd", status=404)

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_the_relay_serves_the_same_page_manifest_and_icons(self, anon, tmp_path):
        relay = Server(tmp_path / "relay", "relay")
        try:
            head, body = relay_raw_get(relay, "/")
            # a relay without a domain: the same page, marked to keep nothing in storage
            assert body == notesvc.shared_origin_page(anon.get("/").text).encode()
            assert f"Content-Security-Policy: {notesvc.WEB_CSP}" in head
            for path in notesvc.WEB_ASSETS:
                head, body = relay_raw_get(relay, path)
                assert head.startswith("HTTP/1.1 200"), path
                assert body == anon.get(path).body
                # the same headers as the server's (the worker: revalidated, may fetch)
                for name, value in notesvc.web_asset_headers(path).items():
                    assert f"{name}: {value}" in head, (path, name)
            head, _ = relay_raw_get(relay, "/icon.png")
            assert head.startswith("HTTP/1.1 404")
        finally:
            relay.stop()


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


def needs(server: Server, path: str, what: str) -> None:
    """Skip unless the server's OpenAPI document has the path (a feature of another issue)."""
    doc = server.request("GET", f"{API}/openapi.json")[2]
    if f"{API}{path}" not in doc["paths"]:
        pytest.skip(f"not on this server yet: {what}")


def unexpected(errors: list, *allowed: str) -> list:
    return [e for e in errors if not any(f"status of {a}" in e for a in allowed)]


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


class TestWebClient:
    pytestmark = BROWSER_TESTS

    @pytest.mark.parametrize("device", ["phone", "desktop"])
    def test_connect_open_formatted_edit_and_save(self, web, device):
        s = web(device)
        page = s.page
        assert "relayCode=" in web.setup["links"]["connect"]["hosted"]
        expect(page.locator("#tree")).to_contain_text("home")
        s.shot("tree")
        s.tree_open("notes/home/keys.md")
        # Formatted: a heading, a task list, links; the editor is not shown.
        expect(page.locator("#view h1")).to_have_text("Spare keys")
        assert page.is_hidden("#editor")
        assert page.locator("#view input[type=checkbox]").count() == 2
        assert page.locator("#view a[data-note='notes/kitchen/pancakes.md']").count() == 1
        s.shot("note")
        page.click("#edit")
        expect(page.locator("#editor")).to_be_visible()
        page.fill("#editor", "# Spare keys\n\nThe spare keys moved to the *red* box.\n")
        expect(page.locator("#status")).to_have_text(re.compile("Unsaved"))
        s.shot("editing")
        page.click("#save")
        expect(page.locator("#status")).to_have_text("Saved")
        on_disk = web.root / "notes/home/keys.md"
        assert on_disk.read_text() == "# Spare keys\n\nThe spare keys moved to the *red* box.\n"
        # A save goes through merge, from the version the edit started from.
        (save,) = s.api_calls("/notes/notes%2Fhome%2Fkeys.md/merge")
        assert json.loads(save.post_data)["base"].startswith('"')
        page.click("#edit")  # back to the formatted view, with the saved text
        expect(page.locator("#view em")).to_have_text("red")
        # The page linked this browser: setup is complete now.
        assert web.server.request("GET", f"{API}/system/setup")[2]["data"]["setupComplete"]
        assert unexpected(s.close()) == []

    def test_phone_shows_one_pane_at_a_time_and_keeps_save_above_the_keyboard(self, web):
        s = web("phone")
        page = s.page
        panes = ["#pane-notes", "#pane-search", "#pane-note", "#pane-ask"]
        visible = lambda: [p for p in panes if page.is_visible(p)]  # noqa: E731
        assert visible() == ["#pane-notes"]
        assert page.evaluate("document.documentElement.scrollWidth") <= 390
        for pane in ("ask", "search", "note", "notes"):
            s.tap(f".tabs button[data-pane={pane}]")
            assert visible() == [f"#pane-{pane}"]
        # Touch targets: the bar, the tabs and the tree are at least 44 px high.
        for sel in (".tabs button", "#tree button", "#new", "#capture-add", ".bar summary"):
            for box in page.locator(sel).evaluate_all(
                "els => els.map(e => e.getBoundingClientRect().height)"
            ):
                assert box >= 44, sel
        s.tree_open("notes/todo.md")
        assert visible() == ["#pane-note"]
        page.click("#edit")
        page.focus("#editor")
        # The keyboard takes the lower half: the page fits what is left, Save stays in view.
        page.set_viewport_size({"width": 390, "height": 420})
        page.evaluate("window.dispatchEvent(new Event('resize'))")
        save = page.locator("#save").bounding_box()
        assert save["y"] >= 0
        assert save["y"] + save["height"] <= 420
        assert page.is_hidden(".tabs")  # the tabs step aside while typing
        editor = page.locator("#editor").bounding_box()
        assert editor["height"] > 200
        assert editor["y"] + editor["height"] <= 421
        page.set_viewport_size({"width": 390, "height": 844})
        # The back button returns to the notes; so does the browser's Back.
        page.click("#back")
        assert visible() == ["#pane-notes"]
        page.go_back()
        expect(page.locator("#pane-note")).to_be_visible()
        assert unexpected(s.close()) == []

    def test_no_note_open_offers_new_instead_of_an_editor(self, web):
        s = web("desktop")
        page = s.page
        assert page.is_hidden("#editor")
        assert page.is_hidden("#save")
        expect(page.locator("#empty")).to_contain_text("No note is open")
        page.click("#empty-new")
        # Write first: no path is asked for; the first line is the title.
        expect(page.locator("#editor")).to_be_focused()
        page.keyboard.type("Garden\n\nTomatoes by the wall.")
        page.keyboard.press("Control+s")
        expect(page.locator("#status")).to_have_text("Saved")
        expect(page.locator("#path")).to_contain_text("notes/inbox/Garden.md")
        text = (web.root / "notes/inbox/Garden.md").read_text()
        assert text == "Garden\n\nTomatoes by the wall."
        expect(page.locator("#recent")).to_contain_text("Garden")
        assert unexpected(s.close()) == []

    def test_typing_is_saved_with_no_button_and_two_pages_keep_both_edits(self, web):
        one, two = web("phone"), web("phone")
        for s in (one, two):
            s.tree_open("notes/todo.md")
            s.page.click("#edit")
        on_disk = web.root / "notes/todo.md"
        # Page one types at the end and leaves it: on the server within 3 s, no button.
        one.page.focus("#editor")
        one.page.keyboard.press("Control+End")
        one.page.keyboard.type("- from page one\n")
        typed = time.monotonic()
        wait_for(lambda: "from page one" in on_disk.read_text(), timeout=3)
        print(f"on the server {time.monotonic() - typed:.2f} s after the last keystroke")
        # Page two, still on the version it opened, changes the title meanwhile.
        two.page.focus("#editor")
        two.page.keyboard.press("Control+Home")
        two.page.keyboard.press("End")
        two.page.keyboard.type(" list")
        both = "# Todo list\n\n- buy oat milk\n- from page one\n"
        wait_for(lambda: on_disk.read_text() == both, timeout=5)
        expect(two.page.locator("#editor")).to_have_value(both)  # merged in as it saved
        expect(one.page.locator("#editor")).to_have_value(both)  # the change feed
        assert not list(on_disk.parent.glob("todo (conflict*"))
        for s in (one, two):
            assert [r for r in s.requests if r.method == "PUT"] == []  # all through merge
            assert unexpected(s.close()) == []

    def test_leaving_a_note_saves_it_and_a_draft_survives_a_failed_save(self, web):
        s = web("desktop")
        page = s.page
        s.tree_open("notes/todo.md")
        page.click("#edit")
        page.fill("#editor", "# Todo\n\n- buy oat milk\n- call the plumber\n")
        # Opening another note saves this one first: nothing is asked.
        s.tree_open("notes/kitchen/pancakes.md")
        expect(page.locator("#path")).to_contain_text("notes/kitchen/pancakes.md")
        assert "plumber" in (web.root / "notes/todo.md").read_text()
        # The server gone: the text is kept in this browser, and leaving asks.
        page.click("#edit")
        page.route("**/notes/**", lambda route: route.abort())
        page.fill("#editor", "# Pancakes\n\nscratch\n")
        page.wait_for_timeout(400)  # the draft is written 300 ms after the last keystroke
        page.click("#menu summary")
        page.click("#logout")
        expect(page.locator("#dlg-title")).to_have_text("Not saved")
        s.shot("not-saved-prompt")
        s.dialog_choose("cancel")
        page.unroute("**/notes/**")
        # Reloaded: what was typed goes out as the page hides.
        page.on("dialog", lambda d: d.accept())  # "leave the page?" while unsaved
        page.reload()
        page.wait_for_selector("#note-bar", state="visible")
        assert "scratch" in (web.root / "notes/kitchen/pancakes.md").read_text()
        assert page.is_hidden("#draft")
        # Too large to send as the page closes, and the server gone: the text waits in
        # this browser as a draft, offered on the next visit.
        page.route("**/merge", lambda route: route.abort())
        page.click("#edit")
        big = "# Pancakes\n\n" + "lots of batter " * 5000
        page.fill("#editor", big)
        page.wait_for_timeout(400)  # the draft is written 300 ms after the last keystroke
        page.reload()
        page.wait_for_selector("#note-bar", state="visible")
        expect(page.locator("#draft")).to_be_visible()
        expect(page.locator("#draft-text")).to_contain_text("unsaved draft")
        assert page.input_value("#editor") == big
        s.shot("draft-restored")
        page.unroute("**/merge")
        # Discarding the draft brings back the saved text.
        page.click("#draft-discard")
        expect(page.locator("#editor")).to_have_value(re.compile("scratch"))
        expect(page.locator("#draft")).to_be_hidden()
        assert "batter" not in (web.root / "notes/kitchen/pancakes.md").read_text()
        assert page.evaluate("Object.keys(localStorage).filter(k => k.includes('draft'))") == []
        failed = [e for e in unexpected(s.close()) if "ERR_FAILED" not in e]
        assert failed == []

    @pytest.mark.parametrize("device", ["phone", "desktop"])
    def test_search_is_seen_and_used_with_the_keyboard(self, web, device):
        s = web(device)
        page = s.page
        page.keyboard.press("/")
        expect(page.locator("#search")).to_be_focused()
        page.keyboard.type("kumquat")
        page.keyboard.press("Enter")
        expect(page.locator("#results mark").first).to_have_text(re.compile("kumquat", re.I))
        expect(page.locator("#results-info")).to_have_text(re.compile(r"^1 note · [\d.]+ ms$"))
        assert page.is_visible("#pane-search")
        assert page.is_hidden("#pane-notes")
        hit = page.locator("#results button").first
        assert "notes/home/keys.md" in hit.inner_text()
        assert "Spare keys" in hit.inner_text()
        s.shot("search")
        page.keyboard.press("ArrowDown")
        expect(hit).to_be_focused()
        page.keyboard.press("Enter")
        expect(page.locator("#path")).to_contain_text("notes/home/keys.md")
        expect(page.locator("#view h1")).to_have_text("Spare keys")
        # Esc returns to the tree.
        page.keyboard.press("/")  # focuses the search box with its text selected
        page.keyboard.type("pancake")
        page.keyboard.press("Enter")
        expect(page.locator("#results button")).to_have_count(2)
        page.keyboard.press("ArrowDown")
        page.keyboard.press("ArrowDown")
        expect(page.locator("#results button").nth(1)).to_be_focused()
        page.keyboard.press("ArrowUp")
        expect(page.locator("#results button").nth(0)).to_be_focused()
        page.keyboard.press("Escape")
        expect(page.locator("#pane-notes")).to_be_visible()
        assert page.is_hidden("#pane-search")
        assert page.input_value("#search") == ""
        assert unexpected(s.close()) == []

    def test_chat_asks_all_notes_unless_about_this_note_is_on(self, web):
        s = web("desktop")
        page = s.page
        s.tree_open("notes/kitchen/pancakes.md")
        assert not page.is_checked("#about")
        page.fill("#chat-input", "where are the spare keys?")
        page.keyboard.press("Enter")
        answer = page.locator("#chat-log .msg:not(.me)").first
        expect(answer.locator("ul.sources button").first).to_be_visible()
        (first,) = s.api_calls("/agent/chat")
        assert first.post_data_json == {"message": "where are the spare keys?", "channel": "web"}
        assert "Spare keys" in answer.locator("ul.sources").inner_text()
        assert answer.locator(".md").count() == 1  # the answer is rendered Markdown
        page.check("#about")
        expect(page.locator("#about-label")).to_contain_text("Pancakes")
        page.fill("#chat-input", "how long do they rest?")
        page.click("#chat-send")
        expect(page.locator("#chat-log .msg:not(.me)")).to_have_count(2)
        expect(page.locator("#chat-log .msg:not(.me)").last).not_to_contain_text("Thinking")
        second = s.api_calls("/agent/chat")[1]
        assert second.post_data_json["notePath"] == "notes/kitchen/pancakes.md"
        s.shot("chat")
        # A source opens its note.
        answer.locator("ul.sources button", has_text="Spare keys").click()
        expect(page.locator("#path")).to_contain_text("notes/home/keys.md")
        assert unexpected(s.close()) == []

    def test_an_external_edit_is_merged_and_an_overlap_keeps_both_versions(self, web):
        s = web("phone")
        page = s.page
        on_disk = web.root / "notes/todo.md"
        key = {"X-Service-Key": web.setup["apiKey"]}
        start = {"content": "# Todo\n\n- buy oat milk\n\nand then\n\n- call the plumber\n"}
        assert web.server.request("PUT", f"{API}/notes/notes%2Ftodo.md", start, key)[0] == 200
        s.tree_open("notes/todo.md")
        page.click("#edit")
        # Edited in vim meanwhile, on other lines: both edits are kept, no question asked.
        on_disk.write_text("# Todo\n\n- buy oat milk\n\nand then\n\n- call the electrician\n")
        page.fill("#editor", "# Todo\n\n- buy rice milk\n\nand then\n\n- call the plumber\n")
        page.click("#save")
        expect(page.locator("#status")).to_have_text("Saved")
        both = "# Todo\n\n- buy rice milk\n\nand then\n\n- call the electrician\n"
        assert on_disk.read_text() == both
        expect(page.locator("#editor")).to_have_value(both)  # what was merged in shows
        assert page.is_hidden("#conflict")
        # The same line changed on both sides: the note keeps theirs, mine is kept whole
        # beside it, and the page says where.
        on_disk.write_text(both.replace("rice", "soy"))
        page.fill("#editor", both.replace("rice", "oat"))
        page.click("#save")
        expect(page.locator("#conflict")).to_be_visible()
        expect(page.locator("#conflict")).to_contain_text("yours is kept, whole, as")
        s.shot("conflict")
        assert on_disk.read_text() == both.replace("rice", "soy")
        assert page.input_value("#editor") == both.replace("rice", "soy")
        (copy,) = [p for p in on_disk.parent.glob("todo (conflict*).md")]
        assert copy.read_text() == both.replace("rice", "oat")
        page.click("#open-copy")
        expect(page.locator("#path")).to_contain_text(copy.name)
        assert "oat milk" in page.input_value("#editor")
        assert unexpected(s.close(), 409) == []

    def test_coming_back_to_the_page_picks_up_changes_and_a_deletion(self, web):
        s = web("desktop")
        page = s.page
        on_disk = web.root / "notes/todo.md"
        s.tree_open("notes/todo.md")
        on_disk.write_text("# Todo\n\n- changed in vim\n")
        (web.root / "notes/new-from-vim.md").write_text("# New\n")
        page.evaluate("document.dispatchEvent(new Event('visibilitychange'))")
        expect(page.locator("#view")).to_contain_text("changed in vim")  # nothing unsaved here
        expect(page.locator("#toast")).to_contain_text("changed elsewhere")
        expect(page.locator('#tree button[data-path="notes/new-from-vim.md"]')).to_be_visible()
        # Deleted elsewhere while edited here: saving says so; "Keep mine" writes it again.
        page.click("#edit")
        page.fill("#editor", "# Todo\n\n- mine\n")
        on_disk.unlink()
        page.click("#save")
        expect(page.locator("#conflict")).to_contain_text("deleted or moved elsewhere")
        page.click("#overwrite")
        expect(page.locator("#status")).to_have_text("Saved")
        assert on_disk.read_text() == "# Todo\n\n- mine\n"
        # Deleted again, and this time theirs wins: the note closes.
        on_disk.unlink()
        page.fill("#editor", "# Todo\n\n- mine again\n")
        page.click("#save")
        page.click("#reload")
        expect(page.locator("#empty")).to_be_visible()
        assert not on_disk.exists()
        assert unexpected(s.close(), 404) == []

    def test_a_task_row_tapped_anywhere_is_ticked_and_saved_through_merge(self, web):
        s = web("phone")
        page = s.page
        s.tree_open("notes/home/keys.md")
        rows = page.locator("#view li.task")
        # A 44 px row with a 24 px box: the words tick it too.
        for box in rows.evaluate_all("els => els.map(e => e.getBoundingClientRect().height)"):
            assert box >= 44
        assert page.locator("#view li.task input").first.bounding_box()["width"] >= 24
        s.tap("#view li.task >> text=copy the garage key")
        expect(page.locator("#status")).to_have_text("Saved")
        path = web.root / "notes/home/keys.md"
        assert "- [x] copy the garage key" in path.read_text()
        (save,) = s.api_calls("/notes/notes%2Fhome%2Fkeys.md/merge")
        assert json.loads(save.post_data)["base"]
        # Changed elsewhere in between, on another line: the tick and the change both stay.
        # Written whole, as an editor saves: a page that reads the note during a truncating
        # write_text would show it empty, with no second task to tap.
        changed = path.with_name("keys.md.tmp")
        changed.write_text(path.read_text().replace("blue kumquat jar", "red tin"))
        os.replace(changed, path)
        page.locator("#view li.task input").nth(1).click()
        expect(page.locator("#view")).to_contain_text("red tin")
        text = path.read_text()
        assert "- [ ] give one to Anna" in text
        assert "red tin" in text
        assert "- [x] copy the garage key" in text
        assert unexpected(s.close()) == []

    def test_links_open_notes_and_html_in_a_note_stays_text(self, web):
        hostile = (
            "# <img src=x onerror=alert(1)>\n\n<script>window.pwned = 1</script>\n\n"
            "[click](javascript:window.pwned=2) [data](data:text/html,x) "
            "![pic](https://tracker.example/p.png) [ok](https://example.com/a_b)\n\n"
            "snake_case_name and *em* **strong** ~~gone~~ `<b>code</b>` [[Pancakes]] "
            "[up](../todo.md) [[nowhere here]]\n\n> quoted <iframe>\n\n"
            "```\n<script>x</script>\n```\n"
        )
        web.server.request(
            "POST",
            f"{API}/notes",
            {"path": "notes/web/hostile.md", "content": hostile},
            {"X-Service-Key": web.setup["apiKey"]},
        )
        s = web("desktop")
        page = s.page
        s.tree_open("notes/web/hostile.md")
        view = page.locator("#view")
        expect(view.locator("h1")).to_have_text("<img src=x onerror=alert(1)>")
        assert view.locator("img, script, iframe").count() == 0
        assert page.evaluate("window.pwned") is None
        hrefs = view.locator("a").evaluate_all("els => els.map(e => e.getAttribute('href'))")
        # An image from elsewhere is a link to follow, never loaded on its own.
        allowed = ("#", "https://example.com/a_b", "https://tracker.example/p.png")
        assert [h for h in hrefs if h not in allowed] == []
        assert "snake_case_name" in view.inner_text()
        assert view.locator("em").all_inner_texts() == ["em"]
        assert view.locator("strong").all_inner_texts() == ["strong"]
        assert view.locator("del").all_inner_texts() == ["gone"]
        assert view.locator("code").first.inner_text() == "<b>code</b>"
        assert view.locator("pre code").inner_text() == "<script>x</script>"
        assert view.locator("a[rel='noopener noreferrer']").count() == 2
        # A relative link and a [[wikilink]] open their notes.
        view.locator("a", has_text="up").click()
        expect(page.locator("#path")).to_contain_text("notes/todo.md")
        s.tree_open("notes/web/hostile.md")
        view.locator("a", has_text="Pancakes").click()
        expect(page.locator("#path")).to_contain_text("notes/kitchen/pancakes.md")
        expect(page.locator("#view table td.al-r").first).to_have_text("10")
        # A [[link]] to no note offers to create it.
        s.tree_open("notes/web/hostile.md")
        view.locator("a", has_text="nowhere here").click()
        expect(page.locator("#dlg-title")).to_contain_text("No note named")
        s.dialog_choose("cancel")
        assert unexpected(s.close(), 404) == []

    def test_markdown_renderer(self, web):
        s = web("desktop", login=False)
        page = s.page
        page.goto(web.server.url + "/")
        render = lambda md: page.evaluate("(t) => renderMarkdown(t, {}).innerHTML", md)  # noqa: E731
        assert render("# T\n\npara *a* _b_\nline two") == (
            "<h1>T</h1><p>para <em>a</em> <em>b</em><br>line two</p>"
        )
        assert render("- a\n  - b\n- c") == "<ul><li>a<ul><li>b</li></ul></li><li>c</li></ul>"
        assert render("3. x\n4. y") == '<ol start="3"><li>x</li><li>y</li></ol>'
        assert render("a | b\n--|:-:\n1 | 2") == (
            '<div class="table"><table><thead><tr><th>a</th><th class="al-c">b</th></tr></thead>'
            '<tbody><tr><td>1</td><td class="al-c">2</td></tr></tbody></table></div>'
        )
        assert render("---\ntags: [a]\n---\n# After") == (
            '<pre class="front">tags: [a]</pre><h1>After</h1>'
        )
        assert (
            render("> q\n> > deeper")
            == "<blockquote><p>q</p><blockquote><p>deeper</p></blockquote></blockquote>"
        )
        assert (
            render("***\n\n~~~py\nx = 1\n~~~")
            == '<hr><pre><code class="lang-py">x = 1</code></pre>'
        )
        assert render("a\\*b\\* ==hi==") == "<p>a*b* <mark>hi</mark></p>"
        assert render("<b>x</b> &amp;") == "<p>&lt;b&gt;x&lt;/b&gt; &amp;amp;</p>"
        # Pathological input renders in linear-ish time.
        took = page.evaluate(
            "() => { const t = performance.now(); "
            "renderMarkdown('*_'.repeat(4000) + '['.repeat(3000), {}); "
            "return performance.now() - t; }"
        )
        assert took < 2000
        assert unexpected(s.close()) == []

    def test_move_with_update_links_and_delete_to_the_trash(self, web):
        s = web("desktop")
        page = s.page
        s.tree_open("notes/kitchen/pancakes.md")
        page.click("#note-menu summary")
        page.click("#move")
        page.fill("#move-path", "recipes/pancakes")
        assert page.is_checked("#move-links")
        s.dialog_choose("move")
        expect(page.locator("#path")).to_contain_text("notes/recipes/pancakes.md")
        assert (web.root / "notes/recipes/pancakes.md").exists()
        assert "(../recipes/pancakes.md)" in (web.root / "notes/home/keys.md").read_text()
        expect(
            page.locator('#tree button.note[data-path="notes/recipes/pancakes.md"]')
        ).to_be_visible()
        page.click("#note-menu summary")
        page.click("#delete")
        s.dialog_choose("delete")
        expect(page.locator("#empty")).to_be_visible()
        assert not (web.root / "notes/recipes/pancakes.md").exists()
        assert list((web.root / ".notesvc" / "trash").rglob("pancakes.md"))
        expect(
            page.locator('#tree button.note[data-path="notes/recipes/pancakes.md"]')
        ).to_have_count(0)
        # The deleted note's folder goes with it (emptied): a refresh of the tree or the
        # open note racing the change feed may ask for one of them once, and hear 404.
        gone = [url for status, _, url in s.failed if status == 404]
        assert all("recipes" in urllib.parse.unquote(url) for url in gone), s.failed
        assert unexpected(s.close(), *(["404"] if gone else [])) == []

    def test_quick_capture_appends_to_todays_note(self, web):
        s = web("phone")
        page = s.page
        page.fill("#capture", "call the plumber about the tap")
        page.keyboard.press("Enter")
        expect(page.locator("#toast")).to_contain_text("Added to")
        page.fill("#capture", "buy washers")
        page.click("#capture-add")
        expect(page.locator("#capture")).to_have_value("")
        (daily,) = (web.root / "notes" / "daily").glob("*.md")
        lines = daily.read_text().splitlines()
        assert re.fullmatch(r"- \d\d:\d\d call the plumber about the tap", lines[-2])
        assert re.fullmatch(r"- \d\d:\d\d buy washers", lines[-1])
        expect(page.locator('#tree button.dir[data-path="notes/daily"]')).to_be_visible()
        assert unexpected(s.close()) == []

    def test_the_key_stays_in_the_session_unless_remembered(self, web):
        s = web("phone", login=False)
        page = s.page
        page.goto(web.setup["links"]["connect"]["hosted"])
        assert page.is_hidden("#remember-warn")
        page.check("#remember")
        expect(page.locator("#remember-warn")).to_be_visible()
        page.uncheck("#remember")
        page.fill("#key", "nsk_" + "x" * 43)
        page.click("#connect")
        expect(page.locator("#login-msg")).to_contain_text("not accepted")
        assert page.evaluate("sessionStorage.getItem('notesvc.key')") is None
        page.fill("#key", web.setup["apiKey"])
        page.click("#connect")
        page.wait_for_selector("#app", state="visible")
        stored = "k => [sessionStorage.getItem(k), localStorage.getItem(k)]"
        assert page.evaluate(stored, "notesvc.key") == [web.setup["apiKey"], None]
        # A new tab of the same browser (a new session) asks again.
        other = s.context.new_page()
        other.goto(web.server.url + "/")
        expect(other.locator("#login")).to_be_visible()
        other.close()
        # Remembered: in localStorage, and a new tab goes straight in.
        page.click("#menu summary")
        page.click("#logout")
        page.wait_for_selector("#login", state="visible")
        assert page.evaluate("Object.keys(localStorage).concat(Object.keys(sessionStorage))") == []
        page.fill("#key", web.setup["apiKey"])
        page.check("#remember")
        page.click("#connect")
        page.wait_for_selector("#app", state="visible")
        assert page.evaluate(stored, "notesvc.key")[1] == web.setup["apiKey"]
        other = s.context.new_page()
        other.goto(web.server.url + "/")
        other.wait_for_selector("#app", state="visible")
        assert unexpected(s.close(), 401) == []

    def test_a_rotated_key_returns_to_the_key_screen_and_a_lockout_shows_its_wait(self, web):
        s = web("phone")
        page = s.page
        status, _, body = web.server.request(
            "POST", f"{API}/auth/rotate", headers={"X-Service-Key": web.setup["apiKey"]}
        )
        assert status == 200
        # The next request with the old key, a click or the change feed's next poll
        # (whichever comes first), brings the key screen back.
        note = page.locator('#tree button.note[data-path="notes/todo.md"]')
        if not page.locator("#login").is_visible():
            with contextlib.suppress(Exception):  # the feed's poll may hide the tree meanwhile
                note.click(timeout=2000)
        expect(page.locator("#login")).to_be_visible()
        expect(page.locator("#login-msg")).to_contain_text("rotated")
        assert page.evaluate("sessionStorage.getItem('notesvc.key')") is None
        s.shot("key-rotated")
        # Wrong keys until this address is locked out: the wait is shown.
        for _ in range(10):
            web.server.request("POST", f"{API}/auth/verify", headers={"X-Service-Key": "nsk_wrong"})
        page.fill("#key", body["data"]["apiKey"])
        page.click("#connect")
        expect(page.locator("#login-msg")).to_have_text(re.compile(r"try again in \d+ s"))
        # 404: the link's relay code changed with the key (the page fell back to the server)
        assert unexpected(s.close(), 401, 404, 429) == []

    def test_dark_mode_and_accessibility_in_both_themes(self, web):
        for scheme in ("light", "dark"):
            for device in ("phone", "desktop"):
                s = web(device, login=False, color_scheme=scheme)
                page = s.page
                page.goto(web.setup["links"]["connect"]["hosted"])
                problems = page.evaluate(A11Y_AUDIT)
                page.fill("#key", web.setup["apiKey"])
                page.click("#connect")
                page.wait_for_selector("#tree button")
                problems += page.evaluate(A11Y_AUDIT)
                s.tree_open("notes/home/keys.md")
                problems += page.evaluate(A11Y_AUDIT)
                page.click("#edit")
                page.fill("#editor", page.input_value("#editor") + "\nmore")
                problems += page.evaluate(A11Y_AUDIT)
                page.click("#save")
                page.fill("#search", "kumquat")
                page.keyboard.press("Enter")
                page.wait_for_selector("#results mark")
                problems += page.evaluate(A11Y_AUDIT)
                if device == "phone":
                    s.tap(".tabs button[data-pane=ask]")
                page.fill("#chat-input", "spare keys?")
                page.click("#chat-send")
                page.wait_for_selector("#chat-log ul.sources")
                problems += page.evaluate(A11Y_AUDIT)
                page.click("#menu summary")
                page.click("#menu-new")
                expect(page.locator("#editor")).to_be_focused()
                problems += page.evaluate(A11Y_AUDIT)
                if device == "phone":
                    s.tap("#back")
                else:
                    page.click("#results-close")
                s.tree_open("notes/home/keys.md")
                page.click("#note-menu summary")
                page.click("#history")
                page.locator("#versions button", has_text="Changes").first.click()
                page.wait_for_selector("#version-detail p.words")
                problems += page.evaluate(A11Y_AUDIT)
                s.dialog_choose("cancel")
                # Focus is visible: Tab lands on a control that draws an outline.
                page.keyboard.press("Tab")
                style = page.evaluate(
                    "() => { const s = getComputedStyle(document.activeElement); "
                    "return [s.outlineStyle, parseFloat(s.outlineWidth)]; }"
                )
                assert style[0] != "none", (scheme, device)
                assert style[1] >= 2, (scheme, device)
                bg = page.evaluate("getComputedStyle(document.body).backgroundColor")
                assert (bg == "rgb(15, 20, 25)") == (scheme == "dark")
                s.shot(f"theme-{scheme}")
                assert problems == [], (scheme, device)
                assert unexpected(s.close()) == []

    def test_keyboard_alone_reaches_a_note_and_saves_it(self, web):
        s = web("desktop")
        page = s.page
        seen = []
        for _ in range(40):  # Tab through the page until the tree's note is reached
            page.keyboard.press("Tab")
            seen.append(
                page.evaluate("document.activeElement.dataset.path || document.activeElement.id")
            )
            if seen[-1] == "notes/todo.md":
                break
        assert seen[-1] == "notes/todo.md", seen
        page.keyboard.press("Enter")
        expect(page.locator("#path")).to_contain_text("notes/todo.md")
        page.focus("#edit")
        page.keyboard.press("Enter")
        expect(page.locator("#editor")).to_be_focused()
        page.keyboard.press("End")
        page.keyboard.type(" - and bread")
        page.keyboard.press("Control+s")
        expect(page.locator("#status")).to_have_text("Saved")
        assert "and bread" in (web.root / "notes/todo.md").read_text()
        assert unexpected(s.close()) == []

    def test_two_thousand_notes_load_lazily_and_fast(self, browser, tmp_path):
        root = tmp_path / "root"
        for f in range(20):
            folder = root / "notes" / f"project-{f:02d}"
            folder.mkdir(parents=True)
            for n in range(50):
                (folder / f"note-{n:03d}.md").write_text(f"# Note {f}-{n}\n\nbody {n}\n")
        for n in range(1000):
            (root / "notes" / f"inbox-{n:04d}.md").write_text(f"# Inbox {n}\n\nbody {n}\n")
        with running(root) as server:
            setup = server.request("GET", f"{API}/system/setup")[2]["data"]
            s = WebSession(browser, tmp_path, "desktop")
            s.login(setup["links"]["connect"]["hosted"], setup["apiKey"])
            page = s.page
            timings = []
            shown = "performance.getEntriesByName('notesvc:tree-shown').map(e => e.startTime)"
            for _ in range(3):
                page.reload()
                expect(page.locator("#tree button")).to_have_count(1020)
                (at,) = page.evaluate(shown)  # the page marks when the tree is on screen
                timings.append(at)
            # One request for the first level: the folders come with counts, not their notes.
            trees = [r.url for r in s.requests if "/folders/tree" in r.url]
            assert {urllib.parse.urlsplit(u).query for u in trees} == {"depth=1"}
            assert page.locator("#tree .count").first.inner_text() == "50"
            page.click('#tree button.dir[data-path="notes/project-07"]')
            expect(
                page.locator('#tree button.dir[data-path="notes/project-07"] + ul button')
            ).to_have_count(50)
            s.shot("tree-2000")
            s.close()
        best = min(timings)
        (tmp_path / "tree-2000-ms.txt").write_text(f"{best:.0f}\n")
        print(f"2,000-note tree shown {best:.0f} ms after navigation (best of 3: {timings})")
        assert best < 3000  # the goal is 1 s (bench/bench_web.py measures it); this is a guard

    # -- with the history, trash and change feed of CONTRACT 18 (issue 13) ----------------

    def test_history_lists_diffs_and_restores_a_version(self, web):
        needs(web.server, "/notes/{path}/versions", "history (issue 13)")
        key = {"X-Service-Key": web.setup["apiKey"]}
        url = f"{API}/notes/notes%2Ftodo.md"
        for text in ("# Todo\n\n- buy oat milk\n- bread\n", "# Todo\n\n- bread only\n"):
            assert web.server.request("PUT", url, {"content": text}, key)[0] == 200
        s = web("phone")
        page = s.page
        s.tree_open("notes/todo.md")
        page.click("#note-menu summary")
        page.click("#history")
        expect(page.locator("#dlg-title")).to_have_text("History of Todo")
        rows = page.locator("#versions li")
        expect(rows).to_have_count(2)
        # A timeline a person reads: the day and time, why, how large.
        expect(rows.nth(0)).to_contain_text(re.compile(r"Today, \d{1,2}:\d{2}"))
        expect(rows.nth(0)).to_contain_text("edited")
        # What changed since, word by word, fitting the phone's width.
        rows.nth(0).locator("button", has_text="Changes").click()
        expect(page.locator("#version-detail p.words ins")).to_contain_text(["only"])
        expect(page.locator("#version-detail p.words del")).to_contain_text(["oat milk"])
        fits = "el => el.scrollWidth <= el.clientWidth"
        assert page.locator("#dlg").evaluate(fits)
        assert page.locator("#version-detail p.words").evaluate(fits)
        s.shot("history")
        rows.nth(1).locator("button", has_text="View").click()
        expect(page.locator("#version-detail pre")).to_have_text(SEED_NOTES["todo.md"])
        assert page.evaluate(A11Y_AUDIT) == []
        rows.nth(1).locator("button", has_text="Restore").click()
        expect(page.locator("#dlg")).to_be_hidden()
        expect(page.locator("#view")).to_contain_text("buy oat milk")
        assert (web.root / "notes/todo.md").read_text() == SEED_NOTES["todo.md"]
        (restore,) = [r for r in s.requests if r.url.endswith("/restore")]
        assert restore.headers["if-match"].startswith('"')
        assert unexpected(s.close()) == []

    def test_trash_restores_and_a_delete_can_be_undone(self, web):
        needs(web.server, "/trash", "the trash (issue 13)")
        s = web("phone", color_scheme="dark")
        page = s.page
        s.tree_open("notes/todo.md")
        page.clock.install()
        page.click("#note-menu summary")
        page.click("#delete")
        s.dialog_choose("delete")
        expect(page.locator("#toast")).to_contain_text("to the trash")
        undo = page.locator("#toast button", has_text="Undo")
        assert undo.bounding_box()["height"] >= 44
        assert undo.bounding_box()["width"] >= 44
        page.clock.fast_forward(9000)  # still there 9 s later (it waits 15 s)
        expect(undo).to_be_visible()
        undo.click()
        expect(page.locator("#path")).to_contain_text("notes/todo.md")
        assert (web.root / "notes/todo.md").read_text() == SEED_NOTES["todo.md"]
        # Deleted elsewhere, restored from the Trash dialog.
        key = {"X-Service-Key": web.setup["apiKey"]}
        url = f"{API}/notes/notes%2Fkitchen%2Fpancakes.md"
        assert web.server.request("DELETE", url, headers=key)[0] == 200
        page.click("#menu summary")
        page.click("#menu-trash")
        item = page.locator("#trash-items li", has_text="notes/kitchen/pancakes.md")
        expect(item).to_have_count(1)
        item.locator("button", has_text="View").click()
        expect(page.locator("#trash-detail pre")).to_contain_text("Whisk")
        s.shot("trash")
        assert page.evaluate(A11Y_AUDIT) == []
        item.locator("button", has_text="Restore").click()
        expect(page.locator("#path")).to_contain_text("notes/kitchen/pancakes.md")
        assert (web.root / "notes/kitchen/pancakes.md").exists()
        # A note already at its path: it comes back under another name. (The page sees the
        # open note deleted first, so that its change feed never acts on it mid-restore.)
        assert web.server.request("DELETE", url, headers=key)[0] == 200
        expect(page.locator("#toast")).to_contain_text("deleted elsewhere")
        body = {"path": "notes/kitchen/pancakes.md", "content": "# New pancakes\n"}
        assert web.server.request("POST", f"{API}/notes", body, key)[0] == 201
        page.click("#menu summary")
        page.click("#menu-trash")
        page.locator("#trash-items li", has_text="pancakes.md").locator(
            "button", has_text="Restore"
        ).click()
        expect(page.locator("#dlg-title")).to_have_text("Restore under another name")
        page.fill("#restore-path", "notes/kitchen/old-pancakes.md")
        s.dialog_choose("restore")
        expect(page.locator("#path")).to_contain_text("notes/kitchen/old-pancakes.md")
        assert "Whisk" in (web.root / "notes/kitchen/old-pancakes.md").read_text()
        assert (web.root / "notes/kitchen/pancakes.md").read_text() == "# New pancakes\n"
        errors = s.close()
        # A 404 only for what was deleted elsewhere, asked for before the change feed told
        # the page: the note (a backlink or a check), or its folder, emptied by the delete,
        # when the tree reloads it. The page takes either in its stride.
        gone = [f for f in s.failed if f[0] == 404]
        assert all("pancakes" in url or "/tree/notes%2Fkitchen?" in url for *_, url in gone), gone
        assert unexpected(errors, 409, *(["404"] if gone else [])) == []

    def test_the_change_feed_keeps_the_tree_and_the_open_note_current(self, web):
        needs(web.server, "/changes", "the change feed (issue 13)")
        key = {"X-Service-Key": web.setup["apiKey"]}
        s = web("desktop")
        page = s.page
        s.tree_open("notes/todo.md")
        page.wait_for_timeout(300)  # the page has its cursor and waits for changes
        todo = f"{API}/notes/notes%2Ftodo.md"
        status, _, put = web.server.request(
            "PUT", todo, {"content": "# Todo\n\n- from the phone\n"}, key
        )
        assert status == 200
        expect(page.locator("#view")).to_contain_text("from the phone")  # no reload, no focus
        expect(page.locator("#toast")).to_contain_text("changed elsewhere")
        body = {"path": "notes/from-elsewhere.md", "content": "# Elsewhere\n"}
        assert web.server.request("POST", f"{API}/notes", body, key)[0] == 201
        expect(page.locator('#tree button[data-path="notes/from-elsewhere.md"]')).to_be_visible()
        # Typed here while another device saved the same note (both through merge, from
        # the version they started from): whichever lands first, both edits are kept.
        page.click("#edit")
        page.fill("#editor", "# Todo\n\n- from the phone\n- typed here\n")
        there = {"base": put["data"]["etag"], "content": "# Todo, shared\n\n- from the phone\n"}
        assert web.server.request("POST", todo + "/merge", there, key)[0] == 200
        both = "# Todo, shared\n\n- from the phone\n- typed here\n"
        expect(page.locator("#editor")).to_have_value(both)
        expect(page.locator("#status")).to_have_text("Saved")
        wait_for(lambda: (web.root / "notes/todo.md").read_text() == both)
        # Our own save comes back through the feed without a conflict.
        page.wait_for_timeout(500)
        assert page.is_hidden("#conflict")
        # Moved elsewhere: the page follows; deleted elsewhere: it closes.
        move = {"path": "notes/archive/todo.md"}
        assert web.server.request("PATCH", todo + "/move", move, key)[0] == 200
        expect(page.locator("#path")).to_contain_text("notes/archive/todo.md")
        expect(page.locator('#tree button[data-path="notes/archive/todo.md"]')).to_be_visible()
        page.fill("#editor", "# Todo\n\n- typed after the move\n")  # still editing
        page.click("#save")  # saved where it is now
        expect(page.locator("#status")).to_have_text("Saved")
        archived = web.root / "notes/archive/todo.md"
        assert archived.read_text() == "# Todo\n\n- typed after the move\n"
        assert not (web.root / "notes/todo.md").exists()
        gone = f"{API}/notes/notes%2Farchive%2Ftodo.md"
        assert web.server.request("DELETE", gone, headers=key)[0] == 200
        expect(page.locator("#empty")).to_be_visible()
        expect(page.locator("#toast")).to_contain_text("deleted elsewhere")
        # 404: the page's own reads (backlinks, a look at the note) may meet the deletion
        assert unexpected(s.close(), 404) == []

    # -- with the attachments of CONTRACT 20 (issue 17) -------------------------------------

    def test_a_vaults_images_beside_its_notes_show_in_the_note(self, web):
        # as Obsidian keeps them, put there over WebDAV: beside the note, linked two ways
        png = notesvc.web_icon_png(192)
        (web.root / "notes/home/photo.png").write_bytes(png)
        (web.root / "notes/home/vault.md").write_text(
            "# Vault\n\n![a photo](photo.png)\n\n![[photo.png]]\n"
        )
        s = web("phone")
        page = s.page
        s.tree_open("notes/home/vault.md")
        for img in (page.locator("#view img[alt='a photo']"), page.locator("#view img").nth(1)):
            expect(img).to_have_attribute("src", re.compile("^blob:"))
            expect(img).to_have_js_property("naturalWidth", 192)
        assert "not found" not in page.inner_text("#view")
        assert unexpected(s.close()) == []

    def test_images_show_and_files_photos_and_pastes_are_attached(self, web):
        needs(web.server, "/attachments", "attachments (issue 17)")
        png = notesvc.web_icon_png(192)
        key = {"X-Service-Key": web.setup["apiKey"], "Content-Type": "image/png"}
        req = urllib.request.Request(
            web.server.url + f"{API}/attachments/attachments%2Fhome%2Flogo.png",
            png,
            key,
            method="PUT",
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 201
        body = {
            "path": "notes/home/pic.md",
            "content": "# Pic\n\n![our logo](../../attachments/home/logo.png)\n",
        }
        web.server.request("POST", f"{API}/notes", body, {"X-Service-Key": web.setup["apiKey"]})
        s = web("phone")
        page = s.page
        s.tree_open("notes/home/pic.md")
        img = page.locator("#view img[alt='our logo']")
        expect(img).to_have_attribute("src", re.compile("^blob:"))
        expect(img).to_have_js_property("naturalWidth", 192)
        s.shot("image")
        # A photo (the camera's input), a picked file, a pasted image.
        page.set_input_files(
            "#attach-photo",
            files=[{"name": "IMG 1.PNG", "mimeType": "image/png", "buffer": png}],
        )
        expect(page.locator("#editor")).to_have_value(
            re.compile(r"!\[IMG 1\.PNG\]\(\.\./\.\./attachments/home/\d{8}-\d{6}-IMG-1\.png\)")
        )
        page.set_input_files(
            "#attach-file",
            files=[
                {"name": "notes.pdf", "mimeType": "application/pdf", "buffer": b"%PDF-1.4 test"}
            ],
        )
        expect(page.locator("#editor")).to_have_value(
            re.compile(r"\n\[notes\.pdf\]\(\.\./\.\./attachments/home/\d{8}-\d{6}-notes\.pdf\)")
        )
        page.evaluate(
            """(bytes) => {
              const dt = new DataTransfer();
              dt.items.add(new File([new Uint8Array(bytes)], "image.png", {type: "image/png"}));
              const ed = document.getElementById("editor");
              const init = {clipboardData: dt, bubbles: true, cancelable: true};
              ed.dispatchEvent(new ClipboardEvent("paste", init));
            }""",
            list(png),
        )
        expect(page.locator("#editor")).to_have_value(re.compile(r"-image\.png\)"))
        page.click("#save")
        expect(page.locator("#status")).to_have_text("Saved")
        page.click("#edit")
        expect(page.locator("#view img")).to_have_count(3)
        uploaded = sorted(p.name for p in (web.root / "attachments" / "home").iterdir())
        assert len(uploaded) == 4
        assert any(n.endswith("-IMG-1.png") for n in uploaded)
        puts = [r for r in s.requests if r.method == "PUT" and "/attachments/" in r.url]
        assert {r.headers["if-none-match"] for r in puts} == {"*"}
        assert unexpected(s.close()) == []

    def test_embeds_play_and_download_attachments_without_opening_them(self, web):
        needs(web.server, "/attachments", "attachments (issue 17)")
        sound = io.BytesIO()
        with wave.open(sound, "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(8000)
            w.writeframes(b"\0\0" * 800)
        files = {
            "attachments/inbox/2026-01-02/090000-photo.png": (
                notesvc.web_icon_png(192),
                "image/png",
            ),
            "attachments/inbox/2026-01-02/090100-voice.wav": (sound.getvalue(), "audio/wav"),
            "attachments/docs/manual.pdf": (b"%PDF-1.4 manual", "application/pdf"),
            "attachments/docs/page.html": (b"<script>window.pwned=1</script>", "text/html"),
        }
        for path, (data, ctype) in files.items():
            headers = {"X-Service-Key": web.setup["apiKey"], "Content-Type": ctype}
            url = web.server.url + f"{API}/attachments/" + urllib.parse.quote(path, safe="")
            with urllib.request.urlopen(
                urllib.request.Request(url, data, headers, method="PUT"), timeout=10
            ) as resp:
                assert resp.status == 201
        text = (
            "# Media\n\n![[090000-photo.png|the photo]] ![[missing.png]]\n\n"
            "[voice](../attachments/inbox/2026-01-02/090100-voice.wav) [[manual.pdf]] "
            "[[docs/page.html]]\n"
        )
        body = {"path": "notes/media.md", "content": text}
        web.server.request("POST", f"{API}/notes", body, {"X-Service-Key": web.setup["apiKey"]})
        s = web("desktop")
        page = s.page
        s.tree_open("notes/media.md")
        view = page.locator("#view")
        photo = view.locator("img[alt='the photo']")
        expect(photo).to_have_js_property("naturalWidth", 192)
        assert (
            photo.get_attribute("data-attachment")
            == "attachments/inbox/2026-01-02/090000-photo.png"
        )
        expect(view).to_contain_text("[image not found: missing.png]")
        view.locator("a.file", has_text="voice").click()
        expect(view.locator("audio")).to_have_attribute("src", re.compile("^blob:"))
        with page.expect_download() as download:
            view.locator("a.file", has_text="manual.pdf").click()
        assert download.value.suggested_filename == "manual.pdf"
        with page.expect_download() as download:  # HTML is a file to keep, never a page here
            view.locator("a.file", has_text="page.html").click()
        assert download.value.suggested_filename == "page.html"
        assert page.evaluate("window.pwned") is None
        assert len(s.context.pages) == 1
        s.shot("media")
        # (a missing embed is looked for beside the note too: that answer is a 404)
        assert unexpected(s.close(), 404) == []

    def test_a_tap_while_the_page_still_starts_is_not_undone_by_its_restore(self, web):
        # (CI once tapped New note while the page still read the server's features: the
        # start then restored the pane it remembered, the list, and the editor was gone)
        s = web("phone", login=False)
        page = s.page
        held = []
        page.route("**/openapi.json", lambda route: held.append(route))  # the features answer waits
        s.login(web.server.url + "/", web.setup["apiKey"])
        wait_for(lambda: held or page.wait_for_timeout(50))
        s.tap("#new")
        expect(page.locator("#editor")).to_be_focused()
        held[0].continue_()
        page.unroute("**/openapi.json")
        wait_for(lambda: page.evaluate("!document.getElementById('history').hidden"))
        assert page.get_attribute("#app", "data-pane") == "note"
        expect(page.locator("#editor")).to_be_focused()
        page.keyboard.insert_text("Quick one\n")
        page.keyboard.type("typed at once")
        page.keyboard.press("Control+s")
        expect(page.locator("#status")).to_have_text("Saved")
        assert (web.root / "notes/inbox/Quick one.md").read_text().endswith("typed at once")
        assert unexpected(s.close()) == []

    def test_a_note_opened_before_the_features_are_read_shows_its_embeds(self, web):
        # (a CI-like run under load opened a note before the server's features were read:
        # its embedded photo was rendered as if the server had no attachments)
        needs(web.server, "/attachments", "attachments (issue 17)")
        path = "attachments/inbox/2026-01-02/090000-photo.png"
        headers = {"X-Service-Key": web.setup["apiKey"], "Content-Type": "image/png"}
        url = web.server.url + f"{API}/attachments/" + urllib.parse.quote(path, safe="")
        request = urllib.request.Request(url, notesvc.web_icon_png(192), headers, method="PUT")
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert resp.status == 201
        body = {"path": "notes/photo.md", "content": "# Photo\n\n![[090000-photo.png|it]]\n"}
        web.server.request("POST", f"{API}/notes", body, {"X-Service-Key": web.setup["apiKey"]})
        s = web("desktop", login=False)
        page = s.page
        held = []
        page.route("**/openapi.json", lambda route: held.append(route))  # the answer waits
        s.login(web.server.url + "/", web.setup["apiKey"])
        wait_for(lambda: held or page.wait_for_timeout(50))
        with page.expect_response(lambda r: r.url.endswith("photo.md")):  # it is not held
            page.click('#tree button.note[data-path="notes/photo.md"]')
        held[0].continue_()
        page.unroute("**/openapi.json")
        expect(page.locator("#path")).to_contain_text("notes/photo.md")
        expect(page.locator("#view img[alt='it']")).to_have_js_property("naturalWidth", 192)
        assert unexpected(s.close()) == []

    def test_foreign_relay_url_never_gets_a_request(self, web):
        evil = EvilRelay()
        try:
            code = web.setup["pairing"]["relayCode"]
            s = web("phone", login=False)
            s.login(f"{web.server.url}/?relayCode={code}&relayUrl={evil.url}", web.setup["apiKey"])
            page = s.page
            assert s.write_new("Origin\n\nwritten here") == "notes/inbox/Origin.md"
            s.tap("#back")
            page.fill("#capture", "kept on this origin")
            page.keyboard.press("Enter")
            expect(page.locator("#toast")).to_contain_text("Added to")
            requested = [r.url for r in s.requests]
            assert unexpected(s.close()) == []
        finally:
            evil.close()
        assert (web.root / "notes/inbox/Origin.md").exists()
        assert evil.requests == []
        origins = {re.match(r"^[a-z]+://[^/]+", u).group(0) for u in requested if "://" in u}
        assert origins == {web.server.url}
        paths = [urllib.parse.urlsplit(u).path for u in requested]
        assert f"/relay/v1/pair/{code}" in paths
        assert f"/r/{web.setup['serverId']}{API}/auth/verify" in paths

    def test_page_on_the_server_stays_there_when_the_relay_is_elsewhere(self, browser, tmp_path):
        relay = Server(tmp_path / "relay", "relay")
        server = Server(tmp_path / "srv", env={"SERVICE_RELAY_URL": relay.url})
        try:
            wait_for(lambda: relay_servers(relay) == 1)
            setup = server.request("GET", f"{API}/system/setup")[2]["data"]
            assert setup["links"]["relayApiBase"].startswith(relay.url)
            s = WebSession(browser, tmp_path, "desktop")
            s.login(f"{server.url}/?relayCode={setup['pairing']['relayCode']}", setup["apiKey"])
            expect(s.page.locator("#tree")).to_contain_text("No notes yet")
            requested = [r.url for r in s.requests]
            assert unexpected(s.close()) == []
        finally:
            server.stop()
            relay.stop()
        assert {u.startswith(server.url + "/") for u in requested} == {True}
        assert f"{server.url}/r/{setup['serverId']}{API}/folders/tree?depth=1" in requested

    def test_phone_away_from_home_uses_the_relay_copy(self, browser, tmp_path):
        """The connect link opens the relay's own page, which talks to /r/<id> on its origin."""
        relay = Server(tmp_path / "relay", "relay")
        server = Server(tmp_path / "srv", env={"SERVICE_RELAY_URL": relay.url})
        try:
            wait_for(lambda: relay_servers(relay) == 1)
            setup = server.request("GET", f"{API}/system/setup")[2]["data"]
            link = setup["links"]["connect"]["hosted"]
            assert link.startswith(relay.url + "/?relayCode=")
            s = WebSession(browser, tmp_path, "phone")
            page = s.page
            s.login(link, setup["apiKey"])
            # The manifest and icons come from the relay too.
            manifest = page.evaluate("fetch('manifest.webmanifest').then(r => r.ok && r.json())")
            assert manifest["name"] == "notesvc"
            for icon in manifest["icons"]:
                assert page.evaluate("(u) => fetch(u).then(r => r.status)", icon["src"]) == 200
            path = s.write_new("# Keys\n\nThe spare kumquat key is under the mat.")
            assert path == "notes/inbox/Keys.md"
            page.fill("#search", "kumquat")
            page.press("#search", "Enter")
            page.wait_for_selector("#results mark")
            assert "notes/inbox/Keys.md" in page.inner_text("#results")
            s.shot("relay-phone")
            requested = [r.url for r in s.requests]
            assert unexpected(s.close()) == []
        finally:
            server.stop()
            relay.stop()
        on_disk = tmp_path / "srv/notes/inbox/Keys.md"
        assert "kumquat" in on_disk.read_text()
        assert {u.startswith(relay.url + "/") for u in requested} == {True}
        assert f"{relay.url}/r/{setup['serverId']}{API}/folders/tree?depth=1" in requested

    def test_a_relays_shared_origin_keeps_no_key_for_any_page(self, browser, tmp_path):
        """On a relay without a domain every server's pages share the relay's origin: the
        web client keeps nothing there, so no other server's page can find a key."""
        relay = Server(tmp_path / "relay", "relay")
        mine = Server(tmp_path / "mine", env={"SERVICE_RELAY_URL": relay.url})
        other = Server(tmp_path / "other", env={"SERVICE_RELAY_URL": relay.url})
        try:
            wait_for(lambda: relay_servers(relay) == 2)
            setup = mine.request("GET", f"{API}/system/setup")[2]["data"]
            sids = {
                "mine": setup["serverId"],
                "other": other.request("GET", f"{API}/system/setup")[2]["data"]["serverId"],
            }

            def consent_url(sid: str) -> str:
                reg = relay.request(
                    "POST", f"/r/{sid}/oauth/register", {"redirect_uris": [CALLBACK]}
                )[2]
                _, challenge = pkce_pair()
                q = urllib.parse.urlencode(
                    {
                        "response_type": "code",
                        "client_id": reg["client_id"],
                        "redirect_uri": CALLBACK,
                        "code_challenge": challenge,
                        "code_challenge_method": "S256",
                        "resource": f"{relay.url}/r/{sid}{API}/mcp",
                    }
                )
                return f"{relay.url}/r/{sid}/oauth/authorize?{q}"

            s = WebSession(browser, tmp_path, "phone")
            page = s.page
            page.goto(setup["links"]["connect"]["hosted"])
            expect(page.locator("#shared-origin")).to_be_visible()  # says why, and the fix
            expect(page.locator("#remember")).to_be_hidden()
            page.fill("#key", setup["apiKey"])
            page.click("#connect")
            page.wait_for_selector("#app", state="visible")
            page.wait_for_selector("#tree button, #tree .empty")
            stored = "() => [localStorage.length, sessionStorage.length, document.cookie]"
            assert page.evaluate(stored) == [0, 0, ""]
            for sid in sids.values():
                page.goto(consent_url(sid))  # the same tab
                expect(page.locator("#ask")).to_be_visible()
                assert page.input_value("#key") == ""
            page.goto(setup["links"]["connect"]["hosted"])  # back: the key is asked again
            expect(page.locator("#login")).to_be_visible()
            assert page.evaluate(stored) == [0, 0, ""]
            s.close()
        finally:
            other.stop()
            mine.stop()
            relay.stop()


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


ZBARIMG = shutil.which("zbarimg")


def decode_qr(png: Path) -> str:
    """Return the text of the QR code in a picture (Debian's zbarimg: a real decoder)."""
    done = subprocess.run(
        [ZBARIMG, "--quiet", "--raw", str(png)], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def todays_note(root: Path) -> Path | None:
    """The note the share sheet wrote to (the only one mentioning what it shares)."""
    found = [p for p in (root / "notes").rglob("*.md") if "Worth reading" in p.read_text()]
    return found[0] if found else None


def share_to(s: WebSession, url: str, *files: tuple):
    """Share a page's title, text and link and the files (name, bytes) to the app at url,
    as the share sheet does: a top-level multipart POST to its share-target, from outside
    it. Returns the tab the app opens in (its errors join the session's)."""
    tab = s.context.new_page()
    tab.on("pageerror", lambda e: s.errors.append(str(e)))
    tab.on("console", lambda m: m.type == "error" and s.errors.append(m.text))
    tab.set_content(
        f'<form method="POST" action="{url}/share-target" enctype="multipart/form-data">'
        '<input name="title" value="A page"><input name="text" value="Worth reading">'
        '<input name="url" value="https://example.com/read">'
        '<input type="file" name="image" multiple></form>'
    )
    if files:
        for name, content in files:
            (s.tmp_path / name).write_bytes(content)
        tab.set_input_files("input[type=file]", [s.tmp_path / name for name, _ in files])
    tab.evaluate("document.forms[0].submit()")
    return tab


def accept_shared(tab, answer: str = "add") -> None:
    """Say yes (or no) in the app to what was shared: any page can post to the share
    address, so nothing goes to today's note before the person has seen it."""
    expect(tab.locator("#dlg-title")).to_have_text("Shared to notesvc", timeout=20_000)
    expect(tab.locator("#dlg-body")).to_contain_text("Worth reading")
    tab.click(f'#dlg button[data-value="{answer}"]')


class TestOfflineInChromium:
    """Keep notes on this device (a secure context: http://127.0.0.1 is one): the app and
    the notes open without the server; what is written meanwhile lands once, when it is
    back; the share sheet's POST is kept for today's note."""

    pytestmark = BROWSER_TESTS

    def keep_offline(self, s: WebSession) -> None:
        page = s.page
        page.click("#menu summary")
        page.click("#menu-offline")
        expect(page.locator("#toast")).to_contain_text("kept on this device", timeout=20_000)
        wait_for(lambda: page.evaluate("navigator.serviceWorker.controller !== null"))

    def test_edit_two_and_create_one_offline_reload_then_all_land_once(self, web):
        s = web("phone")
        page = s.page
        self.keep_offline(s)
        expect(page.locator("#offline-state")).to_have_text("3 notes kept")
        s.context.set_offline(True)
        s.tree_open("notes/todo.md")
        page.click("#edit")
        page.fill("#editor", "# Todo\n\n- buy oat milk\n- written offline\n")
        page.click("#save")
        expect(page.locator("#status")).to_have_text("Kept on this device")
        s.tap("#back")
        s.tree_open("notes/kitchen/pancakes.md")
        page.click("#edit")
        page.fill("#editor", "# Pancakes\n\nOffline batter.\n")
        page.click("#save")
        expect(page.locator("#status")).to_have_text("Kept on this device")
        s.tap("#back")
        s.tap("#new")
        page.keyboard.insert_text("Made offline\n")  # (its name, at once: see write_new)
        page.keyboard.type("\non the train")
        page.click("#save")
        expect(page.locator("#status")).to_have_text("Kept on this device")
        expect(page.locator("#offline-state")).to_have_text("Offline · 3 to send")
        title = page.get_attribute("#offline-state", "title")
        assert title.endswith("3 changes wait to be sent")
        s.tap("#back")
        assert page.evaluate("document.documentElement.scrollWidth") <= 390  # the badge fits
        s.shot("offline")
        # Reloaded without a connection: the app and the notes still open.
        page.reload()
        page.wait_for_selector("#app", state="visible")
        expect(page.locator("#recent")).to_contain_text("Made offline")
        s.tree_open("notes/todo.md")
        expect(page.locator("#view")).to_contain_text("written offline")
        expect(page.locator("#offline-state")).to_contain_text("3 to send")
        assert "written offline" not in (web.root / "notes/todo.md").read_text()
        # Back online: everything lands, once.
        s.context.set_offline(False)
        page.evaluate("window.dispatchEvent(new Event('online'))")
        expect(page.locator("#offline-state")).to_be_hidden(timeout=15_000)
        todo = web.root / "notes/todo.md"
        assert todo.read_text() == "# Todo\n\n- buy oat milk\n- written offline\n"
        pancakes = (web.root / "notes/kitchen/pancakes.md").read_text()
        assert pancakes == "# Pancakes\n\nOffline batter.\n"
        (made,) = (web.root / "notes/inbox").iterdir()
        assert made.name == "Made offline.md"
        assert made.read_text() == "Made offline\n\non the train"
        page.reload()  # and again: nothing waits, nothing is sent twice
        page.wait_for_selector("#app", state="visible")
        assert "to send" not in page.inner_text("#offline-state")
        assert [p.name for p in (web.root / "notes/inbox").iterdir()] == ["Made offline.md"]
        offline_noise = ("ERR_INTERNET_DISCONNECTED", "ERR_FAILED", "status of 0")
        errors = [e for e in s.close() if not any(n in e for n in offline_noise)]
        assert errors == []

    def test_the_share_sheet_puts_text_and_an_image_in_todays_note(self, web):
        s = web("phone")
        self.keep_offline(s)
        tab = share_to(s, web.server.url, ("photo.png", PNG))
        expect(tab.locator("#dlg-body")).to_contain_text("photo.png", timeout=20_000)
        accept_shared(tab)
        assert "shared" not in tab.url
        today = wait_for(lambda: todays_note(web.root))
        text = wait_for(lambda: "photo.png" in today.read_text() and today.read_text())
        assert "A page Worth reading https://example.com/read" in text
        (image,) = re.findall(r"!\[photo.png\]\(\.\./\.\./(attachments/[^)]+)\)", text)
        assert (web.root / image).read_bytes() == PNG
        tab.screenshot(path=str(s.tmp_path / "shared-phone.png"))
        # (sent, and out of the outbox, before the tab goes: closed sooner, the item stays
        # marked sent, and goes again, once, with the next one)
        expect(tab.locator("#offline-state")).not_to_contain_text("to send")
        tab.close()
        # Offline, the share waits with the other changes and goes when the server is back.
        s.context.set_offline(True)
        tab = share_to(s, web.server.url, ("later.png", PNG))
        tab.wait_for_selector("#app", state="visible")
        accept_shared(tab)
        expect(tab.locator("#offline-state")).to_contain_text("1 to send")
        s.context.set_offline(False)
        tab.evaluate("window.dispatchEvent(new Event('online'))")
        wait_for(lambda: "later.png" in today.read_text())
        expect(tab.locator("#offline-state")).to_be_hidden()
        assert today.read_text().count("Worth reading") == 2
        offline_noise = ("ERR_INTERNET_DISCONNECTED", "ERR_FAILED", "status of 0")
        assert [e for e in s.close() if not any(n in e for n in offline_noise)] == []

    def test_an_image_over_the_limit_is_refused_with_a_clear_message(self, web):
        s = web("phone")
        self.keep_offline(s)
        big = b"\x89PNG\r\n\x1a\n" + bytes(30 * 1024 * 1024)
        tab = share_to(s, web.server.url, ("huge.png", big))
        accept_shared(tab)
        expect(tab.locator("#toast")).to_contain_text(
            re.compile(r"“huge.png” \(30.0 MB\) was not added: this server takes files up to 20"),
            timeout=20_000,
        )
        today = wait_for(lambda: todays_note(web.root))
        text = today.read_text()
        assert "huge.png" not in text
        assert not list(web.root.glob("attachments/**/huge*"))
        assert unexpected(s.close(), 413) == []

    def test_what_another_site_posts_to_the_share_address_goes_nowhere_unseen(self, web):
        s = web("phone")
        self.keep_offline(s)
        tab = share_to(s, web.server.url)  # as a hostile page's hidden form would
        accept_shared(tab, "drop")
        expect(tab.locator("#dlg")).to_be_hidden()
        tab.wait_for_timeout(1000)  # (the outbox was empty; nothing may have gone out)
        assert todays_note(web.root) is None
        assert tab.evaluate("indexedDB.databases().then(d => d.length)") == 1
        assert "to send" not in tab.inner_text("#offline-state")
        assert unexpected(s.close()) == []

    def test_without_the_worker_the_share_sheet_is_told_what_to_turn_on(self, web):
        s = web("phone")
        tab = share_to(s, web.server.url)
        expect(tab.locator("#toast")).to_contain_text("needs “Keep notes on this device”")
        assert "share=" not in tab.url
        assert unexpected(s.close()) == []

    def test_a_revoked_key_wipes_the_copy_on_this_device(self, web):
        key = {"X-Service-Key": web.setup["apiKey"]}
        body = {"name": "phone", "scope": "write"}
        grant = web.server.request("POST", f"{API}/auth/keys", body, key)[2]["data"]
        s = web("phone", login=False)
        s.login(web.setup["links"]["connect"]["hosted"], grant["key"])
        page = s.page
        self.keep_offline(s)
        assert "notesvc" in page.evaluate("indexedDB.databases().then(d => d.map(x => x.name))")
        s.context.set_offline(True)  # an edit waits on this device...
        s.tree_open("notes/todo.md")
        page.click("#edit")
        page.fill("#editor", "# Todo\n\n- written on the train\n")
        page.click("#save")
        expect(page.locator("#status")).to_have_text("Kept on this device")
        gone = web.server.request("DELETE", f"{API}/auth/keys/{grant['id']}", headers=key)
        assert gone[0] == 200
        s.context.set_offline(False)
        page.evaluate("window.dispatchEvent(new Event('online'))")
        expect(page.locator("#login")).to_be_visible()  # the next contact: the key is refused
        page.reload()
        expect(page.locator("#login")).to_be_visible()
        wait_for(
            lambda: (
                "notesvc"
                not in page.evaluate("indexedDB.databases().then(d => d.map(x => x.name))")
            )
        )
        assert page.evaluate("navigator.serviceWorker.getRegistrations().then(r => r.length)") == 0
        assert page.evaluate("localStorage.getItem('notesvc.offline')") is None
        # ...and what waited stays in this browser as the note's draft, for the next key
        drafts = page.evaluate(
            "() => Object.keys(localStorage).filter(k => k.startsWith('notesvc.draft:'))"
            ".map(k => [k.split('|')[1], JSON.parse(localStorage.getItem(k)).content])"
        )
        assert drafts == [["notes/todo.md", "# Todo\n\n- written on the train\n"]]
        assert "train" not in (web.root / "notes/todo.md").read_text()
        offline_noise = "ERR_INTERNET_DISCONNECTED"
        assert [e for e in unexpected(s.close(), 401) if offline_noise not in e] == []

    def test_on_plain_http_elsewhere_the_option_says_why_it_stays_off(self, web):
        s = web("phone", login=False)
        page = s.page
        # the same server by another name than 127.0.0.1 or localhost: not a secure context
        url = web.setup["links"]["connect"]["hosted"].replace("127.0.0.1", PLAIN_HTTP_HOST)
        s.login(url, web.setup["apiKey"])
        page.click("#menu summary")
        page.click("#menu-offline")
        expect(page.locator("#dlg")).to_contain_text("needs a secure connection")
        assert page.evaluate("window.isSecureContext") is False
        assert unexpected(s.close()) == []


class TestDevicesInChromium:
    """A phone joins by scanning: real servers, Chromium at 390x844, the QR code decoded by
    zbarimg from a screenshot."""

    pytestmark = BROWSER_TESTS

    def set_up_from_the_page(self, browser, tmp_path, server) -> WebSession:
        s = WebSession(browser, tmp_path, "phone")
        s.page.goto(server.url + "/")
        s.page.fill("#setup-name", "Ada's phone")
        s.page.click("#setup")
        expect(s.page.locator("#dlg-title")).to_have_text("Keep this key safe")
        s.dialog_choose("done")
        expect(s.page.locator("#app")).to_be_visible()
        return s

    def test_a_page_opened_from_elsewhere_says_why_and_what_to_do(self, browser, tmp_path):
        """A new server reached from beyond its home network (through a proxy it trusts):
        no *Set up this server*, the reason and the commands; the key, pasted, still works."""
        server = Server(tmp_path / "srv", env={"SERVICE_TRUST_PROXY": "127.0.0.1"})
        try:
            with ForwardingProxy(server.url) as proxy:  # reports 203.0.113.1: a stranger
                s = WebSession(browser, tmp_path, "phone")
                page = s.page
                page.goto(proxy.url + "/")
                why = page.locator("#setup-why")
                expect(why).to_contain_text("set up only from the server itself or its home")
                expect(why).to_contain_text("python3 notesvc.py pair")
                expect(why).to_contain_text("python3 notesvc.py rotate-key")
                expect(page.locator("#setup-box")).to_be_hidden()
                s.shot("setup-elsewhere")
                state = json.loads((tmp_path / "srv/.notesvc/state.json").read_text())
                s.login(proxy.url + "/", state["apiKey"])  # the owner's key, from the server
                assert not server.request(
                    "GET", f"{API}/system/setup", headers={"X-Forwarded-For": "127.0.0.1"}
                )[2]["data"]["setupComplete"]  # the link was refused: setup waits
                assert unexpected(s.close(), 403) == []
            late = Server(tmp_path / "late", env={"SERVICE_SETUP_WINDOW": "0"})
            try:
                s = WebSession(browser, tmp_path, "phone")
                s.page.goto(late.url + "/")
                why = s.page.locator("#setup-why")
                expect(why).to_contain_text("setup window has passed")
                expect(why).to_contain_text("Restart the server")
                expect(s.page.locator("#setup-box")).to_be_hidden()
                assert unexpected(s.close()) == []
            finally:
                late.stop()
        finally:
            server.stop()

    def test_the_consent_page_signs_in_with_this_browsers_admin_device(self, browser, tmp_path):
        server = Server(tmp_path / "srv")
        callback = Callback()
        try:
            s = self.set_up_from_the_page(browser, tmp_path, server)
            status, _, reg = server.request(
                "POST", "/oauth/register", {"redirect_uris": [callback.url], "client_name": "Far"}
            )
            assert status == 201
            _, challenge = pkce_pair()
            query = urllib.parse.urlencode(
                {
                    "response_type": "code",
                    "client_id": reg["client_id"],
                    "redirect_uri": callback.url,
                    "state": "s1",
                    "code_challenge": challenge,
                    "code_challenge_method": "S256",
                }
            )
            page = s.page
            page.goto(f"{server.url}/oauth/authorize?{query}")
            expect(page.locator("#signed-in")).to_contain_text("Signed in as Ada's phone")
            expect(page.locator("#key")).to_be_hidden()  # no key to paste
            assert page.evaluate("localStorage.getItem('notesvc.key')").startswith("nsd_")
            page.click("#allow")
            back = callback.query()  # approved with the device's key: a code for the app
            assert back["state"] == ["s1"]
            assert back["code"][0].startswith("nsc_")
            assert unexpected(s.close()) == []
        finally:
            callback.close()
            server.stop()

    def test_a_new_server_is_set_up_from_the_phone_and_a_second_phone_joins(
        self, browser, tmp_path
    ):
        server = Server(tmp_path / "srv")
        try:
            first = WebSession(browser, tmp_path, "phone")
            page = first.page
            page.goto(server.url + "/")
            expect(page.locator("#setup-box")).to_be_visible()
            first.shot("first-run")
            page.fill("#setup-name", "Ada's phone")
            page.click("#setup")
            expect(page.locator("#dlg-title")).to_have_text("Keep this key safe")
            api_key = page.input_value("#setup-key")
            assert re.fullmatch(r"nsk_[A-Za-z0-9_-]{43}", api_key)
            first.dialog_choose("done")
            expect(page.locator("#app")).to_be_visible()
            kept = page.evaluate("localStorage.getItem('notesvc.key')")
            assert kept.startswith("nsd_")  # the browser keeps a device key, not the API key
            assert api_key not in json.dumps(page.evaluate("Object.assign({}, localStorage)"))
            setup = server.request("GET", f"{API}/system/setup")[2]["data"]
            assert setup["setupComplete"]
            assert setup["apiKey"] != api_key  # redacted from now on
            assert not setup["browserSetup"]
            # Add a device: the QR code on the screen is the link, decoded by a real decoder.
            page.click("#menu summary")
            page.click("#menu-keys")
            page.click("#add-device")
            page.fill("#device-name", "Second phone")
            first.dialog_choose("make")
            qr = page.locator("#pair-qr")
            expect(qr).to_be_visible()
            url = page.input_value("#pair-url")
            assert url.startswith(server.url + "/#pair=")
            if ZBARIMG:
                shot = tmp_path / "pair-qr.png"
                qr.screenshot(path=str(shot))
                assert decode_qr(shot) == url
            first.shot("pairing")
            started = time.monotonic()
            second = WebSession(browser, tmp_path, "phone")
            other = second.page
            other.goto(url)
            expect(other.locator("#pair-box")).to_be_visible()
            assert "#pair=" not in other.url  # out of the address bar and the history
            other.click("#pair-join")
            expect(other.locator("#app")).to_be_visible()
            assert (
                second.write_new("From the second phone\n")
                == "notes/inbox/From the second phone.md"
            )
            took = time.monotonic() - started
            print(f"pairing to first note on the second device: {took:.1f} s of page time")
            assert (tmp_path / "srv/notes/inbox/From the second phone.md").exists()
            expect(page.locator("#pair-status")).to_contain_text("joined", timeout=10_000)
            devices = [
                k
                for k in server.request(
                    "GET", f"{API}/auth/keys", headers={"X-Service-Key": api_key}
                )[2]["data"]["keys"]
                if k["kind"] == "device"
            ]
            assert sorted(d["name"] for d in devices) == ["Ada's phone", "Second phone"]
            # the link is good once
            third = WebSession(browser, tmp_path, "phone")
            third.page.goto(url)
            third.page.click("#pair-join")
            expect(third.page.locator("#pair-msg")).to_contain_text("used already")
            assert unexpected(first.close(), "404") == []
            assert unexpected(second.close()) == []
            assert unexpected(third.close(), "404") == []
        finally:
            server.stop()

    def test_a_folder_pairing_lands_in_its_folder(self, browser, tmp_path):
        root = tmp_path / "srv"
        (root / "notes" / "family").mkdir(parents=True)
        (root / "notes" / "family" / "list.md").write_text("# Shopping\n\n- bread\n")
        (root / "notes" / "private.md").write_text("# Private\n")
        server = Server(root)
        try:
            key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]
            owner = WebSession(browser, tmp_path, "desktop")
            owner.login(server.url + "/", key)
            page = owner.page
            page.click("#menu summary")
            page.click("#menu-keys")
            page.click("#add-folder")
            page.fill("#device-name", "Anna")
            page.fill("#device-folder", "family")
            page.select_option("#device-scope", "write")
            owner.dialog_choose("make")
            code = page.locator("#pair-code")
            expect(code).to_have_text(re.compile(r"^([a-z2-7]{4}-){6}[a-z2-7]{2}$"))
            anna = WebSession(browser, tmp_path, "phone")  # no camera: the code is typed
            anna.page.goto(server.url + "/")
            anna.page.click("#code-box summary")
            anna.page.fill("#join-code", code.text_content().upper().replace("-", " "))
            anna.page.click("#join")
            expect(anna.page.locator("#app")).to_be_visible()
            expect(anna.page.locator("#tree")).to_contain_text("family")
            expect(anna.page.locator("#tree")).not_to_contain_text("private")
            assert anna.page.get_attribute("#app", "data-folder") == "notes/family"
            expect(anna.page.locator("#menu-keys")).to_be_hidden()
            assert unexpected(owner.close()) == []
            assert unexpected(anna.close()) == []
        finally:
            server.stop()

    def test_telegram_connects_from_the_page(self, browser, tmp_path, upstream):
        server = Server(tmp_path / "srv", env={"SERVICE_TELEGRAM_API_BASE": upstream.url})
        try:
            key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]
            s = WebSession(browser, tmp_path, "phone")
            s.login(server.url + "/", key)
            page = s.page
            page.click("#menu summary")
            page.click("#menu-telegram")
            upstream.refused_token = "111:bad"
            page.fill("#tg-token", "111:bad")
            s.dialog_choose("connect")
            expect(page.locator("#dlg-error")).to_contain_text("refused this token")
            expect(page.locator("#tg-token")).to_have_value("111:bad")  # kept, to correct
            page.fill("#tg-token", "222:good-token")
            s.dialog_choose("connect")
            code = page.locator("#tg-code")
            expect(code).to_have_text(re.compile(r"^[a-z2-7]{12}$"))
            expect(page.locator("#dlg-body a")).to_have_attribute(
                "href", f"https://t.me/notes_bot?start={code.text_content()}"
            )
            s.shot("telegram")
            upstream.push(telegram_update(f"/start {code.text_content()}", chat_id=42))
            expect(page.locator("#tg-status")).to_contain_text("Connected to Ada", timeout=15_000)
            s.dialog_choose("cancel")
            page.click("#menu summary")
            page.click("#menu-telegram")
            expect(page.locator("#dlg-body")).to_contain_text("saves what “Ada” sends it")
            assert unexpected(s.close(), "400") == []
        finally:
            server.stop()


class TestWebClientGrants:
    """The keys screen, the Share action, and a scoped key's page (issue 19, item 6)."""

    pytestmark = BROWSER_TESTS

    def test_keys_and_connections(self, web):
        s = web("desktop")
        page = s.page
        owner = owner_headers(web.setup)
        # A connected app, as an OAuth client would make one.
        _, _, reg = web.server.request(
            "POST", "/oauth/register", {"redirect_uris": [CALLBACK], "client_name": "Pocket AI"}
        )
        verifier, challenge = pkce_pair()
        approval = {
            "clientId": reg["client_id"],
            "redirectUri": CALLBACK,
            "codeChallenge": challenge,
            "scope": "notes:read",
            "resource": f"{web.server.url}{API}/mcp",
        }
        _, _, ok = web.server.request("POST", f"{API}/oauth/approve", approval, owner)
        code = urllib.parse.parse_qs(urllib.parse.urlsplit(ok["data"]["redirect"]).query)["code"]
        status, _ = post_oauth_form(
            f"{web.server.url}/oauth/token",
            {
                "grant_type": "authorization_code",
                "code": code[0],
                "client_id": reg["client_id"],
                "redirect_uri": CALLBACK,
                "code_verifier": verifier,
            },
        )
        assert status == 200
        page.click("#menu summary")
        page.click("#menu-keys")
        expect(page.locator("#dlg-title")).to_have_text("Keys and devices")
        expect(page.locator("#connections-list")).to_contain_text("Pocket AI")
        expect(page.locator("#keys-list")).to_contain_text("No scoped keys yet")
        page.fill("#key-name", "kitchen tablet")
        page.select_option("#key-scope", "write")
        page.fill("#key-folder", "kitchen")
        page.select_option("#key-days", "365")
        page.click("#key-create")
        expect(page.locator("#new-key")).to_have_value(re.compile(r"^nsg_[A-Za-z0-9_-]{43}$"))
        key = page.input_value("#new-key")
        row = page.locator("#keys-list li")
        expect(row).to_contain_text("kitchen tablet")
        expect(row).to_contain_text("read and write · only notes/kitchen")
        s.shot("keys")
        _, _, listed = web.server.request("GET", f"{API}/auth/keys", headers=owner)
        made = next(k for k in listed["data"]["keys"] if k["kind"] == "key")
        assert (made["scope"], made["folder"], made["expiresAt"] is not None) == (
            "write",
            "notes/kitchen",
            True,
        )
        assert web.server.request("GET", f"{API}/notes", headers={"X-Service-Key": key})[0] == 200
        # Revoked from the screen: refused at once.
        row.locator("button", has_text="Revoke").click()
        s.dialog_choose("revoke")
        expect(page.locator("#keys-list")).to_contain_text("No scoped keys yet")
        assert web.server.request("GET", f"{API}/notes", headers={"X-Service-Key": key})[0] == 401
        page.locator("#connections-list li button", has_text="Revoke").click()
        s.dialog_choose("revoke")
        expect(page.locator("#connections-list")).to_contain_text("No app is connected")
        assert unexpected(s.close()) == []

    def test_share_a_note_and_open_the_link_in_a_fresh_browser(self, web, browser):
        s = web("phone")
        page = s.page
        s.tree_open("notes/kitchen/pancakes.md")
        page.click("#note-menu summary")
        page.click("#share")
        expect(page.locator("#share-links")).to_contain_text("Not shared yet")
        page.click("#share-create")
        expect(page.locator("#share-url")).to_have_value(re.compile(r"/s/[A-Za-z0-9_-]{22}$"))
        url = page.input_value("#share-url")
        expect(page.locator("#share-links")).to_contain_text("pancakes · expires")
        s.shot("share")
        stranger = browser.new_context()  # no key, nothing stored
        try:
            other = stranger.new_page()
            other.goto(url)
            expect(other.locator("article h1")).to_have_text("Pancakes")
            expect(other.locator("article td")).to_have_count(4)
            page.locator("#share-links li button", has_text="Revoke").click()
            expect(page.locator("#share-links")).to_contain_text("Not shared yet")
            other.reload()
            expect(other.locator("#msg")).to_contain_text("expired or been revoked")
        finally:
            stranger.close()
        assert unexpected(s.close()) == []

    def test_a_read_key_for_one_folder_sees_that_folder_and_no_edit(self, web):
        owner = owner_headers(web.setup)
        body = {"name": "fridge screen", "scope": "read", "folder": "notes/home"}
        key = web.server.request("POST", f"{API}/auth/keys", body, owner)[2]["data"]["key"]
        s = web("phone", login=False)
        page = s.page
        s.login(web.setup["links"]["connect"]["hosted"], key)
        expect(page.locator("#tree")).to_contain_text("home")
        assert page.locator("#tree").inner_text().count("kitchen") == 0
        assert page.locator('#tree button[data-path="notes/todo.md"]').count() == 0
        for hidden in ("#new", "#menu-new", "#menu-keys", ".capture"):
            assert page.locator(hidden).is_hidden(), hidden
        s.tree_open("notes/home/keys.md")
        expect(page.locator("#view h1")).to_have_text("Spare keys")
        for hidden in ("#edit", "#save", "#share", "#move", "#delete", "#attach"):
            assert page.locator(hidden).is_hidden(), hidden
        assert all(
            page.locator("#view input[type=checkbox]").evaluate_all("bs => bs.map(b => b.disabled)")
        )
        s.shot("read-key")
        # The page never asked for what the key may not do.
        assert s.api_calls("/auth/link") == []
        assert not [
            r
            for r in s.requests
            if r.method in ("PUT", "POST", "PATCH", "DELETE")
            and not r.url.endswith(("/auth/verify", "/agent/chat"))
        ]
        assert unexpected(s.close()) == []


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
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def query(self, timeout: float = 15) -> dict:
        assert self.arrived.wait(timeout), "nothing reached the redirect URI"
        self.arrived.clear()
        return urllib.parse.parse_qs(urllib.parse.urlsplit(self.hits[-1]).query)

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def tiny_png() -> bytes:
    """A real 1x1 PNG (a browser decodes it)."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
        return struct.pack(">I", len(body)) + kind + body + crc

    header = struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)
    pixels = zlib.compress(b"\x00\xc0\x30\x30")
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")
    )


class TestGrantPages:
    """The consent page and the share page in a real browser."""

    pytestmark = BROWSER_TESTS

    @pytest.fixture
    def browser(self):
        sync_api = pytest.importorskip("playwright.sync_api")
        if not CHROMIUM:
            pytest.skip("no Chromium on this machine")
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                yield browser, sync_api.expect
            finally:
                browser.close()

    def test_consent_on_a_phone(self, tmp_path, browser):
        browser, expect = browser
        cb = Callback()
        try:
            with running(tmp_path) as server:
                setup = server.request("GET", f"{API}/system/setup")[2]["data"]
                reg = server.request(
                    "POST",
                    "/oauth/register",
                    {"redirect_uris": [cb.url], "client_name": "Phone app"},
                )[2]
                endpoint = server.request("GET", "/.well-known/oauth-authorization-server")[2][
                    "authorization_endpoint"
                ]
                resource = f"{server.url}/api/v1/mcp"

                def authorize_url(client_id: str, state: str) -> tuple:
                    verifier, challenge = pkce_pair()
                    q = urllib.parse.urlencode(
                        {
                            "response_type": "code",
                            "client_id": client_id,
                            "redirect_uri": cb.url,
                            "state": state,
                            "code_challenge": challenge,
                            "code_challenge_method": "S256",
                            "scope": "notes:read",
                            "resource": resource,
                        }
                    )
                    return f"{endpoint}?{q}", verifier

                context = browser.new_context(
                    viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True
                )
                page = context.new_page()
                url, verifier = authorize_url(reg["client_id"], "phone-1")
                page.goto(url)
                expect(page.locator("#client")).to_have_text("Phone app")
                expect(page.locator("#host")).to_have_text(urllib.parse.urlsplit(cb.url).netloc)
                expect(page.locator("#write-row")).to_be_hidden()  # SERVICE_MCP_WRITE is off
                page.screenshot(path=str(tmp_path / "consent-390x844.png"), full_page=True)
                assert page.evaluate("document.documentElement.scrollWidth") <= 390
                page.fill("#key", "nsk_" + "w" * 43)
                page.fill("#folder", "family")
                page.click("#allow")
                expect(page.locator("#msg")).to_contain_text("wrong")
                assert cb.hits == []
                page.fill("#key", setup["apiKey"])
                page.click("#allow")
                page.wait_for_url(re.compile(r".*/callback\?"))
                query = cb.query()
                assert query["state"] == ["phone-1"]
                assert query["iss"] == [server.url]
                status, tokens = post_oauth_form(
                    f"{server.url}/oauth/token",
                    {
                        "grant_type": "authorization_code",
                        "code": query["code"][0],
                        "client_id": reg["client_id"],
                        "redirect_uri": cb.url,
                        "code_verifier": verifier,
                        "resource": resource,
                    },
                )
                assert status == 200
                assert tokens["scope"] == "notes:read"
                _, _, keys = server.request("GET", f"{API}/auth/keys", headers=owner_headers(setup))
                assert keys["data"]["keys"][0]["folder"] == "notes/family"
                # Deny goes back with access_denied.
                url, _ = authorize_url(reg["client_id"], "phone-2")
                page.goto(url)
                expect(page.locator("#client")).to_have_text("Phone app")
                page.click("#deny")
                page.wait_for_url(re.compile(r".*/callback\?.*error="))
                query = cb.query()
                assert query["error"] == ["access_denied"]
                assert query["state"] == ["phone-2"]
                # An unknown client is shown and nothing is redirected to.
                url, _ = authorize_url("mcp_nobody", "phone-3")
                page.goto(url)
                expect(page.locator("#msg")).to_contain_text("no client is registered")
                expect(page.locator("#ask")).to_be_hidden()
                assert len(cb.hits) == 2
                # Framed by another page, it never shows.
                page.goto(cb.url)
                page.evaluate(
                    "(src) => new Promise((done) => { const f = document.createElement('iframe');"
                    " f.onload = () => done(); f.src = src; document.body.appendChild(f); })",
                    authorize_url(reg["client_id"], "framed")[0],
                )
                framed = page.frames[1]
                assert framed.url.startswith("chrome-error://") or not framed.query_selector(
                    "#allow"
                )
                context.close()
        finally:
            cb.close()

    def test_a_share_link_in_a_fresh_browser(self, tmp_path, browser):
        browser, expect = browser
        with running(tmp_path) as server:
            setup = server.request("GET", f"{API}/system/setup")[2]["data"]
            owner = owner_headers(setup)
            text = (
                "# Grandma's pie\n\nMix **apples** and *butter*; "
                "see [the shop](https://shop.example).\n\n- [x] apples\n- [ ] sugar\n\n"
                "> keep it warm\n\n```\n<script>alert(1)</script>\n```\n\n"
                "| step | minutes |\n|---|---|\n| bake | 40 |\n\n<img src=x onerror=alert(2)>\n"
                "\n![the pie](../attachments/pie.png) ![elsewhere](https://img.example/x.png)\n"
            )
            put = urllib.request.Request(
                f"{server.url}{API}/attachments/attachments%2Fpie.png",
                tiny_png(),
                {**owner, "Content-Type": "application/octet-stream"},
                method="PUT",
            )
            urllib.request.urlopen(put, timeout=30).close()
            server.request("POST", f"{API}/notes", {"path": "notes/pie.md", "content": text}, owner)
            _, _, made = server.request("POST", f"{API}/shares", {"path": "notes/pie.md"}, owner)
            context = browser.new_context()  # no key, no storage
            page = context.new_page()
            dialogs, sent = [], []
            page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
            page.on("request", lambda r: sent.append((r.url, r.headers)))
            page.goto(made["data"]["url"])
            expect(page.locator("article h1")).to_have_text("Grandma's pie")
            assert page.title() == "Grandma's pie"
            expect(page.locator("article strong")).to_have_text("apples")
            expect(page.locator("article li")).to_have_count(2)
            assert page.locator("article input[type=checkbox]").first.is_checked()
            assert page.locator("article a").get_attribute("rel") == "noopener noreferrer nofollow"
            expect(page.locator("article pre")).to_have_text("<script>alert(1)</script>")
            expect(page.locator("article td")).to_have_count(2)
            assert "<img src=x onerror=alert(2)>" in page.inner_text("article")
            image = page.locator("article img")
            expect(image).to_have_count(1)  # the note's own attachment; never another host's
            assert image.get_attribute("alt") == "the pie"
            wait_for(lambda: page.evaluate("document.querySelector('article img').complete"))
            assert image.evaluate("(img) => img.naturalWidth") == 1
            assert "[image: elsewhere]" in page.inner_text("article")
            assert dialogs == []
            page.screenshot(path=str(tmp_path / "share.png"), full_page=True)
            assert all(
                "x-service-key" not in h and "authorization" not in h and not h.get("referer")
                for _, h in sent
            )
            origins = {urllib.parse.urlsplit(u).netloc for u, _ in sent}
            assert origins == {urllib.parse.urlsplit(server.url).netloc}
            # A revoked link says so.
            _, _, listed = server.request("GET", f"{API}/shares", headers=owner)
            share_id = listed["data"]["shares"][0]["id"]
            server.request("DELETE", f"{API}/shares/{share_id}", headers=owner)
            page.reload()
            expect(page.locator("#msg")).to_contain_text("expired or been revoked")
            expect(page.locator("article")).to_be_empty()
            context.close()


class TestSelfRelay:
    def test_relay_prefix_answers_like_the_api(self, anon, client):
        sid = anon.app.service.state.read()["serverId"]
        assert data(anon.get(f"/r/{sid}{API}/health"))["status"] == "ok"
        assert data(client.get(f"/r/{sid}{API}/system/info"))["serverId"] == sid
        assert_error(anon.get(f"/r/{sid}{API}/system/info", status=401), 401, "UNAUTHORIZED")
        assert_error(anon.get(f"/r/{sid}{API}/nope", status=404), 404, "NOT_FOUND")

    def test_other_server_id_is_404(self, anon):
        assert_error(anon.get(f"/r/someoneelse{API}/health", status=404), 404, "NOT_FOUND")

    def test_relay_api_base_from_setup_works(self, anon):
        base = data(anon.get(f"{API}/system/setup"))["links"]["relayApiBase"]
        path = base.split("://", 1)[1].split("/", 1)[1]
        assert data(anon.get(f"/{path}/health"))["status"] == "ok"

    def test_pair_code_resolves(self, anon):
        code = anon.app.service.state.read()["relayCode"]
        d = data(anon.get(f"/relay/v1/pair/{code}"))
        assert d["serverId"] == anon.app.service.state.read()["serverId"]
        assert d["relayApiBase"].endswith(f"/r/{d['serverId']}/api/v1")
        assert_error(anon.get("/relay/v1/pair/AAAA-BBBB-CCCC", status=404), 404, "NOT_FOUND")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)


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


def relay_queued(relay: Server, fake: FakeRelayServer) -> int:
    return relay.request("GET", "/health")[2]["data"].get("queued", 0)


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


class TestRelay:
    @pytest.fixture
    def pair(self, tmp_path):
        """A real relay and a real server registered with it; yields (relay, server, ids)."""
        relay = Server(tmp_path / "relay", "relay", env={"SERVICE_RELAY_TIMEOUT": "3"})
        server = Server(tmp_path / "srv", env={"SERVICE_RELAY_URL": relay.url})
        try:
            wait_for(lambda: relay_servers(relay) == 1)
            setup = server.request("GET", f"{API}/system/setup")[2]["data"]
            yield relay, server, setup
        finally:
            server.stop()
            relay.stop()

    def via(self, relay, setup, method, path, body=None, key=None, headers=None):
        hdrs = {"X-Service-Key": setup["apiKey"] if key is None else key, **(headers or {})}
        return relay.request(method, f"/r/{setup['serverId']}{API}{path}", body, hdrs)

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_read_write_and_errors_through_the_relay(self, pair):
        relay, server, setup = pair
        assert setup["links"]["relayApiBase"] == f"{relay.url}/r/{setup['serverId']}/api/v1"
        text = '# Über\n\nUnicode ✓ 🗝️ «ключи» \u00a0and \\ back\\slashes "quotes"\n'
        status, headers, body = self.via(
            relay, setup, "POST", "/notes", {"path": "notes/relay/ü.md", "content": text}
        )
        assert status == 201
        assert headers["ETag"] == body["data"]["etag"]
        assert headers["Location"].endswith("/api/v1/notes/notes%2Frelay%2F%C3%BC.md")
        status, headers, body = self.via(relay, setup, "GET", "/notes/notes%2Frelay%2F%C3%BC.md")
        assert status == 200
        assert body["data"]["content"] == text
        on_disk = Path(server.proc.args[-1]) / "notes/relay/ü.md"
        assert on_disk.read_text() == text
        status, _, body = self.via(relay, setup, "GET", "/system/info", key="nsk_wrong")
        assert status == 401
        assert body["error"]["code"] == "UNAUTHORIZED"
        status, _, body = self.via(relay, setup, "GET", "/notes/notes%2Fnope.md")
        assert status == 404
        assert body["error"]["code"] == "NOT_FOUND"
        status, _, body = self.via(relay, setup, "GET", "/system/info")
        assert body["data"]["connection"]["state"] == "connected"

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_the_setup_key_never_goes_through_the_relay(self, pair):
        """S2: whatever Host a client sends through the relay, a new server's key stays
        home and /auth/link through the relay is refused."""
        relay, server, setup = pair
        key, sid = setup["apiKey"], setup["serverId"]
        assert re.fullmatch(r"nsk_[A-Za-z0-9_-]{43}", key)  # read directly, on loopback
        hosts = [f"127.0.0.1:{server.port}", f"127.0.0.1:{relay.port}", "localhost", "[::1]"]
        for host in hosts:
            status, _, raw = host_request(relay.port, host, "GET", f"/r/{sid}{API}/system/setup")
            assert status == 200, raw
            assert key.encode() not in raw
            body = json.loads(raw)["data"]
            assert body["apiKey"] == "nsk_…" + key[-4:]
            assert body["browserSetup"] is False
            assert body["setupHere"] == {"allowed": False, "reason": "relayed"}
            status, _, raw = host_request(
                relay.port, host, "POST", f"/r/{sid}{API}/auth/link", {}, {KEY: key}
            )
            assert status == 403, raw
            assert json.loads(raw)["error"]["code"] == "FORBIDDEN"
        assert not server.request("GET", f"{API}/system/setup")[2]["data"]["setupComplete"]
        # The audit of this running server, registered with a relay: critical.
        out = run_cli("audit", "--root", server.proc.args[-1])
        assert out.returncode == 1, out.stdout + out.stderr
        assert "[critical] Setup is not complete on a reachable server" in out.stdout
        assert "is registered with the relay" in out.stdout

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_raw_bytes_pass_unchanged(self, pair):
        relay, _, setup = pair
        req = urllib.request.Request(
            f"{relay.url}/r/{setup['serverId']}{API}/notes",
            b'{"path": "notes/x.md", "content": "\xff\xfe"}',
            {"Content-Type": "application/json", "X-Service-Key": setup["apiKey"]},
            method="POST",
        )
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        assert err.value.code == 400
        assert "UTF-8" in json.loads(err.value.read())["error"]["message"]
        err.value.close()

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_pair_lookup(self, pair):
        relay, _, setup = pair
        status, _, body = relay.request("GET", f"/relay/v1/pair/{setup['pairing']['relayCode']}")
        assert status == 200
        assert body["data"] == {
            "serverId": setup["serverId"],
            "relayApiBase": f"{relay.url}/r/{setup['serverId']}/api/v1",
        }
        assert relay.request("GET", "/relay/v1/pair/AAAA-BBBB-CCCC")[0] == 404

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_rotating_the_key_keeps_the_code_paired(self, pair):
        relay, _, setup = pair
        status, _, body = self.via(relay, setup, "POST", "/auth/rotate")
        assert status == 200
        assert body["data"]["relayCode"] == setup["pairing"]["relayCode"]
        status, _, body = relay.request("GET", f"/relay/v1/pair/{setup['pairing']['relayCode']}")
        assert status == 200
        assert body["data"]["serverId"] == setup["serverId"]

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_server_stopping_gives_504(self, pair):
        relay, server, setup = pair
        server.stop()
        started = time.monotonic()
        status, _, body = self.via(relay, setup, "GET", "/health")
        assert status == 504
        assert body["error"]["code"] == "UPSTREAM_TIMEOUT"
        assert time.monotonic() - started < 10

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_unknown_server_is_504_and_relay_serves_no_server_pages(self, pair):
        relay = pair[0]
        assert relay.request("GET", f"/r/{'a' * 20}{API}/health")[0] == 504
        assert relay.request("GET", f"{API}/system/setup")[0] == 404
        status, _, body = relay.request("GET", "/r/x/notes")
        assert status == 404
        assert body["error"]["code"] == "NOT_FOUND"

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_relay_restart_server_reconnects(self, tmp_path):
        port = free_port()
        relay = Server(tmp_path / "relay", "relay", port=port)
        server = Server(tmp_path / "srv", env={"SERVICE_RELAY_URL": relay.url})
        try:
            wait_for(lambda: relay_servers(relay) == 1)
            setup = server.request("GET", f"{API}/system/setup")[2]["data"]
            relay.stop()
            relay = Server(tmp_path / "relay", "relay", port=port)
            wait_for(lambda: relay_servers(relay) == 1, timeout=40)
            status, _, body = self.via(relay, setup, "GET", "/health")
            assert status == 200
            assert body["data"]["status"] == "ok"
        finally:
            server.stop()
            relay.stop()

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_queue_limit_and_tokens(self, tmp_path):
        env = {"SERVICE_RELAY_MAX_QUEUE": "2", "SERVICE_RELAY_TIMEOUT": "2"}
        with running(tmp_path, "relay", env=env) as relay:
            a, b = FakeRelayServer(relay), FakeRelayServer(relay)
            assert a.register() == 200
            assert b.register() == 200
            # Another server's token never polls this queue, nor takes the id over.
            assert a.poll(server_id=b.server_id)[0] == 403
            assert a.register(server_id=b.server_id) == 403
            results = []

            def client():
                results.append(relay.request("GET", f"/r/{a.server_id}{API}/health")[0])

            threads = [threading.Thread(target=client) for _ in range(2)]
            for t in threads:
                t.start()
            wait_for(lambda: relay_queued(relay, a) == 2)
            status, _, body = relay.request("GET", f"/r/{a.server_id}{API}/health")
            assert status == 429
            assert body["error"]["code"] == "RATE_LIMITED"
            for t in threads:
                t.join(10)
            assert results == [504, 504]
            # The server picks up a request with its own token and answers it.
            t = threading.Thread(target=client)
            t.start()
            status, _, body = a.poll()
            assert status == 200
            request = body["data"]
            assert request["method"] == "GET"
            assert request["path"] == "/api/v1/health"
            assert request["client"] == "127.0.0.1"
            assert a.reply(request["id"], 200, [["Content-Type", "application/json"]], b"{}") == 200
            t.join(10)
            assert results[-1] == 200

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_ids_cannot_be_hijacked_even_after_a_restart(self, tmp_path):
        port = free_port()
        relay = Server(tmp_path / "relay", "relay", port=port)
        server = Server(tmp_path / "srv", env={"SERVICE_RELAY_URL": relay.url})
        try:
            wait_for(lambda: relay_servers(relay) == 1)
            setup = server.request("GET", f"{API}/system/setup")[2]["data"]
            victim = setup["serverId"]
            thief = FakeRelayServer(relay)
            assert thief.register(server_id=victim) == 403
            assert thief.poll(server_id=victim)[0] == 403
            relay.stop()  # the relay forgets everything; the id is still the victim's
            relay = Server(tmp_path / "relay", "relay", port=port)
            assert thief.register(server_id=victim) == 403
            assert thief.poll(server_id=victim)[0] == 403
            wait_for(lambda: relay_servers(relay) == 1, timeout=40)
            hdrs = {"X-Service-Key": setup["apiKey"]}
            assert relay.request("GET", f"/r/{victim}{API}/system/info", None, hdrs)[0] == 200
        finally:
            server.stop()
            relay.stop()

    def test_server_id_derives_from_the_relay_token(self, anon):
        st = anon.app.service.state.read()
        assert st["serverId"] == notesvc.relay_server_id(st["relayToken"])
        assert re.fullmatch(r"[a-z2-7]{20}", st["serverId"])
        assert st["relayToken"] not in anon.get(f"{API}/system/setup").text

    def test_a_state_file_from_0_1_gets_a_token_and_a_derived_id(self, root, make_app):
        (root / ".notesvc").mkdir(parents=True)
        old = {
            "version": 1,
            "serverId": "0123456789abcdef",
            "keyHash": notesvc.key_hash("nsk_old"),
            "keyHint": "_old",
            "setupComplete": True,
            "linkedClients": [],
            "relayCode": "ABCD-EFGH-JKMN",
        }
        (root / ".notesvc" / "state.json").write_text(json.dumps(old))
        st = make_app().app.service.state.read()
        assert st["serverId"] == notesvc.relay_server_id(st["relayToken"])
        assert st["keyHash"] == old["keyHash"]  # the key survives
        assert st["relayCode"] == notesvc.relay_code_of(st["relayToken"])  # changes once

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_registrations_are_rate_limited_per_address(self, tmp_path):
        env = {"SERVICE_RELAY_REGISTRATIONS_PER_MINUTE": "5"}
        with running(tmp_path, "relay", env=env) as relay:
            fakes = [FakeRelayServer(relay) for _ in range(6)]
            assert [f.register() for f in fakes] == [200] * 5 + [429]
            other = FakeRelayServer(relay, source="127.0.0.2")
            assert other.register() == 200  # another address has its own budget

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_a_refused_server_says_so(self, tmp_path):
        env = {"SERVICE_RELAY_MAX_SERVERS": "1"}
        with running(tmp_path / "relay", "relay", env=env) as relay:
            assert FakeRelayServer(relay).register() == 200  # the one slot is taken
            with running(tmp_path / "srv", env={"SERVICE_RELAY_URL": relay.url}) as server:
                key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]

                def refused():
                    info = server.request("GET", f"{API}/system/info", None, {"X-Service-Key": key})
                    return info[2]["data"]["connection"]["state"] == "refused" and info

                info = wait_for(refused)[2]["data"]["connection"]
                assert "maximum" in info["lastError"]
                wait_for(lambda: any("refused this server" in line for line in server.lines))

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_two_hundred_long_polls_do_not_block_a_client(self, pair):
        relay, _, setup = pair
        fakes = [FakeRelayServer(relay, source=f"127.0.1.{i % 200 + 1}") for i in range(200)]
        socks = []
        try:
            for fake in fakes:
                assert fake.register() == 200
                socks.append(fake.open_poll())
            wait_for(lambda: relay_servers(relay) == 201)
            started = time.monotonic()
            status, _, _body = self.via(relay, setup, "GET", "/system/info")
            took = time.monotonic() - started
            assert status == 200
            assert took < 1.0, f"{took:.2f} s with 200 polls held"
        finally:
            for s in socks:
                s.close()

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_a_note_of_the_largest_size_passes_both_ways(self, pair):
        relay, server, setup = pair
        limit = 1048576
        prefix = '{"path": "notes/big.md", "content": "'
        filler = 'Ünïcødé ✓ 🗝️ \\\\ \\" \\n'  # JSON-escaped text, many byte widths
        room = limit - len((prefix + '"}').encode())
        body = prefix + filler * (room // len(filler.encode()))
        body += "x" * (limit - len((body + '"}').encode())) + '"}'
        raw = body.encode()
        assert len(raw) == limit
        content = json.loads(raw)["content"]
        req = urllib.request.Request(
            f"{relay.url}/r/{setup['serverId']}{API}/notes",
            raw,
            {"Content-Type": "application/json", "X-Service-Key": setup["apiKey"]},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 201
            assert json.loads(resp.read())["data"]["size"] == len(content.encode())
        assert (Path(server.proc.args[-1]) / "notes/big.md").read_text() == content
        status, headers, got = self.via(relay, setup, "GET", "/notes/notes%2Fbig.md")
        assert status == 200
        assert got["data"]["content"] == content
        assert headers["Content-Type"].startswith("application/json")

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_an_over_limit_body_is_413_at_once(self, pair):
        relay, _, setup = pair
        with socket.create_connection(("127.0.0.1", relay.port), timeout=5) as s:
            s.sendall(
                f"PUT /r/{setup['serverId']}{API}/notes/notes%2Fx.md HTTP/1.1\r\n"
                "Host: relay\r\nContent-Type: application/json\r\n"
                "Content-Length: 1048577\r\n\r\n".encode()
            )
            started = time.monotonic()
            answer = recv_all(s)
        assert time.monotonic() - started < 1
        assert answer.startswith(b"HTTP/1.1 413 ")
        body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
        assert body["error"]["code"] == "PAYLOAD_TOO_LARGE"
        assert "1048576" in body["error"]["message"]

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_forwarded_answers_are_api_answers(self, tmp_path):
        with running(tmp_path, "relay") as relay:
            fake = FakeRelayServer(relay)
            assert fake.register() == 200
            out = []
            t = threading.Thread(
                target=lambda: out.append(relay_raw_get(relay, f"/r/{fake.server_id}{API}/x"))
            )
            t.start()
            _status, _, body = fake.poll()
            headers = [
                ["Content-Type", "text/html"],
                ["Set-Cookie", "session=evil; Path=/"],
                ["Access-Control-Allow-Origin", "*"],
                ["Content-Security-Policy", "script-src *"],
                ["ETag", '"abc"'],
            ]
            page = b"<script>alert(document.cookie)</script>"
            assert fake.reply(body["data"]["id"], 200, headers, page) == 200
            t.join(10)
        head, got = out[0]
        assert head.startswith("HTTP/1.1 200 ")
        lines = head.lower().split("\r\n")
        assert "content-type: application/json; charset=utf-8" in lines
        assert "x-content-type-options: nosniff" in lines
        assert "content-security-policy: default-src 'none'; sandbox" in lines
        assert 'etag: "abc"' in lines
        assert not any(h.startswith(("set-cookie", "access-control-")) for h in lines)
        assert got == page

    @pytest.mark.real_server
    @pytest.mark.slow
    @pytest.mark.parametrize(
        ("head", "status"),
        [
            (b"POST /health HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n", 411),
            (b"GET /health HTTP/1.1\r\nHost: r\r\nX-A: 1\r\n  folded\r\n\r\n", 400),
            (b"POST /health HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\nx", 400),
            (b"POST /health HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400),
            (b"GET /health HTTP/1.1\r\nNo colon here\r\n\r\n", 400),
            (b"GET health HTTP/1.1\r\n\r\n", 400),
            (b"GET /health HTTP/2.0\r\n\r\n", 400),
            (b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n", 431),
        ],
    )
    def test_http_is_parsed_strictly(self, tmp_path, head, status):
        with running(tmp_path, "relay") as relay:
            with socket.create_connection(("127.0.0.1", relay.port), timeout=5) as s:
                s.sendall(head)
                answer = recv_all(s)
            assert answer.startswith(f"HTTP/1.1 {status} ".encode())
            assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["success"] is False
            assert relay.request("GET", "/health")[0] == 200

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_keep_alive_serves_several_requests_on_one_connection(self, tmp_path):
        with running(tmp_path, "relay") as relay:
            conn = http.client.HTTPConnection("127.0.0.1", relay.port, timeout=5)
            for _ in range(3):
                conn.request("GET", "/health")
                resp = conn.getresponse()
                assert resp.status == 200
                assert json.loads(resp.read())["data"]["role"] == "relay"
            conn.close()

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_idle_connections_from_one_address_are_capped(self, tmp_path):
        env = {"SERVICE_RELAY_MAX_IDLE_PER_ADDRESS": "16"}
        with running(tmp_path, "relay", env=env) as relay:
            socks = []
            try:
                for _ in range(60):
                    s = socket.socket()
                    s.settimeout(5)
                    s.bind(("127.0.0.9", 0))
                    s.connect(("127.0.0.1", relay.port))
                    s.sendall(b"GET /hea")  # an incomplete request: slowloris
                    socks.append(s)
                started = time.monotonic()
                assert relay.request("GET", "/health")[0] == 200
                assert time.monotonic() - started < 1
                closed = sum(recv_all(s) == b"" for s in socks[:40])
                assert closed == 40  # the oldest went first
            finally:
                for s in socks:
                    s.close()

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_relay_serves_its_own_copy_of_the_web_client(self, pair):
        relay, _server, setup = pair
        with urllib.request.urlopen(relay.url + "/", timeout=10) as resp:
            page = resp.read().decode()
            csp = resp.headers["Content-Security-Policy"]
        assert "<title>notesvc</title>" in page
        assert "connect-src 'self'" in csp
        assert setup["links"]["connect"]["hosted"] == (
            f"{relay.url}/?relayCode={setup['pairing']['relayCode']}"
        )

    @pytest.mark.real_server
    @pytest.mark.slow
    @pytest.mark.skipif(not NGINX, reason="nginx is not installed (apt install nginx)")
    def test_two_relays_behind_nginx_share_the_servers(self, tmp_path):
        """deploy/nginx-relay.conf: servers and clients spread over two relay processes."""
        ports = [free_port(), free_port()]
        front = free_port()
        conf = (HERE / "deploy" / "nginx-relay.conf").read_text()
        conf = conf.replace("127.0.0.1:8441", f"127.0.0.1:{ports[0]}")
        conf = conf.replace("127.0.0.1:8442", f"127.0.0.1:{ports[1]}")
        conf = re.sub(
            r"    listen 443 ssl;\n.*?ssl_certificate_key [^\n]*\n",
            f"    listen 127.0.0.1:{front};\n",
            conf,
            flags=re.S,
        )
        (tmp_path / "logs").mkdir()
        (tmp_path / "nginx.conf").write_text(
            "daemon off; master_process off; pid nginx.pid; error_log logs/error.log warn;\n"
            "events { worker_connections 1024; }\n"
            "http { access_log off; client_body_temp_path tmp; proxy_temp_path tmp;\n"
            + conf
            + "\n}\n"
        )
        (tmp_path / "tmp").mkdir()
        env = {"SERVICE_TRUST_PROXY": "true", "SERVICE_RELAY_DOMAIN": DOMAIN}
        relays = [
            Server(tmp_path / f"relay{i}", "relay", env=env, port=p) for i, p in enumerate(ports)
        ]
        nginx = subprocess.Popen(
            [NGINX, "-p", str(tmp_path), "-c", "nginx.conf"], stderr=subprocess.PIPE, text=True
        )
        servers = []
        try:
            url = f"http://127.0.0.1:{front}"

            def up() -> bool:
                assert nginx.poll() is None, nginx.stderr.read()
                with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as resp:
                    return resp.status == 200
                return False

            wait_for(up)
            for i in range(10):  # until both relays hold a server (consistent hashing decides)
                servers.append(Server(tmp_path / f"srv{i}", env={"SERVICE_RELAY_URL": url}))
                held = len(servers)
                wait_for(lambda held=held: sum(map(relay_servers, relays)) == held)
                if len(servers) >= 2 and all(map(relay_servers, relays)):
                    break
            assert all(map(relay_servers, relays)), "every server landed on one relay"
            for n, server in enumerate(servers):
                setup = server.request("GET", f"{API}/system/setup")[2]["data"]
                code = setup["pairing"]["relayCode"]
                with urllib.request.urlopen(f"{url}/relay/v1/pair/{code}", timeout=10) as resp:
                    origin = json.loads(resp.read())["data"]["origin"]
                sid = setup["serverId"]
                assert origin == f"http://{sid}.{DOMAIN}:{front}"
                # By Host: the server's own origin reaches the relay process that holds it.
                host = f"{sid}.{DOMAIN}:{front}"
                status, _, raw = host_request(front, host, "GET", f"{API}/system/setup")
                assert (status, json.loads(raw)["data"]["serverId"]) == (200, sid)
                status, _, raw = host_request(
                    front, host, "GET", "/.well-known/oauth-authorization-server"
                )
                assert json.loads(raw)["issuer"] == origin
                status, _, raw = host_request(
                    front, "127.0.0.1", "GET", f"/.well-known/oauth-authorization-server/r/{sid}"
                )
                assert status == 200
                base = f"{url}/r/{sid}/api/v1"  # and the path-based JSON routes
                key = {"X-Service-Key": setup["apiKey"], "Content-Type": "application/json"}
                note = json.dumps({"path": f"notes/n{n}.md", "content": f"# Note {n}"}).encode()
                req = urllib.request.Request(f"{base}/notes", note, key, method="POST")
                with urllib.request.urlopen(req, timeout=10) as resp:
                    assert resp.status == 201
                req = urllib.request.Request(f"{base}/notes/notes%2Fn{n}.md", headers=key)
                with urllib.request.urlopen(req, timeout=10) as resp:
                    assert json.loads(resp.read())["data"]["title"] == f"Note {n}"
                req = urllib.request.Request(f"{base}/system/info", headers=key)
                with urllib.request.urlopen(req, timeout=10) as resp:
                    assert json.loads(resp.read())["data"]["connection"]["state"] == "connected"
        finally:
            for server in servers:
                server.stop()
            nginx.terminate()
            nginx.wait(10)
            nginx.stderr.close()
            for relay in relays:
                relay.stop()


class TestRelayAttachments:
    """Attachments through a relay: up to its body limit both ways, larger at once 413, and
    a server's answer never becomes a page on the relay's origin."""

    LIMIT = 65536

    @pytest.fixture
    def pair(self, tmp_path):
        env = {"SERVICE_RELAY_TIMEOUT": "10", "SERVICE_MAX_BODY_BYTES": str(self.LIMIT)}
        relay = Server(tmp_path / "relay", "relay", env=env)
        server = Server(tmp_path / "srv", env={"SERVICE_RELAY_URL": relay.url})
        try:
            wait_for(lambda: relay_servers(relay) == 1)
            setup = server.request("GET", f"{API}/system/setup")[2]["data"]
            yield relay, server, setup, tmp_path / "srv"
        finally:
            server.stop()
            relay.stop()

    @staticmethod
    def send(base: str, method: str, path: str, setup: dict, body=None, headers=None) -> tuple:
        hdrs = {"X-Service-Key": setup["apiKey"], **(headers or {})}
        req = urllib.request.Request(base + path, body, hdrs, method=method)
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, resp.headers, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, e.headers, e.read()

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_an_attachment_of_the_relays_limit_passes_both_ways(self, pair):
        relay, _, setup, root = pair
        prefix = f"/r/{setup['serverId']}{API}"
        image = (b"\x89PNG\r\n\x1a\n" + os.urandom(self.LIMIT))[: self.LIMIT]
        url = prefix + att_url("attachments/big.png")[len(API) :]
        status, _, body = self.send(
            relay.url, "PUT", url, setup, image, {"Content-Type": "image/png"}
        )
        assert status == 201, body
        assert (root / "attachments" / "big.png").read_bytes() == image
        status, headers, got = self.send(relay.url, "GET", url, setup)
        assert status == 200
        assert got == image
        assert headers["Content-Type"] == "image/png"  # its own type, for an <img> from a blob
        assert headers["Content-Disposition"] == 'attachment; filename="big.png"'
        assert headers["Content-Security-Policy"] == "default-src 'none'; sandbox"
        assert headers["X-Content-Type-Options"] == "nosniff"
        status, headers, got = self.send(
            relay.url, "GET", url, setup, headers={"Range": "bytes=100-199"}
        )
        assert status == 206
        assert got == image[100:200]
        assert headers["Content-Range"] == f"bytes 100-199/{self.LIMIT}"
        form, ctype = multipart(("path", "attachments/cam/a.jpg"), ("file", image[:60000], "a.jpg"))
        status, _, body = self.send(
            relay.url, "POST", prefix + "/attachments", setup, form, {"Content-Type": ctype}
        )
        assert status == 201, body
        assert json.loads(body)["data"]["path"] == "attachments/cam/a.jpg"

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_larger_ones_are_413_at_once_both_ways(self, pair):
        relay, server, setup, _ = pair
        prefix = f"/r/{setup['serverId']}{API}"
        url = prefix + att_url("attachments/big.zip")[len(API) :]
        with socket.create_connection(("127.0.0.1", relay.port), timeout=5) as s:
            s.sendall(
                f"PUT {url} HTTP/1.1\r\nHost: relay\r\nContent-Type: application/zip\r\n"
                f"Content-Length: {self.LIMIT + 1}\r\n\r\n".encode()
            )
            started = time.monotonic()
            answer = recv_all(s)
        assert time.monotonic() - started < 1
        assert answer.startswith(b"HTTP/1.1 413 ")
        assert str(self.LIMIT) in json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["message"]
        # One put on the server directly is too large to come back whole through the relay.
        big = os.urandom(4 * self.LIMIT)
        direct = att_url("attachments/big.zip")
        status, _, _ = self.send(
            server.url, "PUT", direct, setup, big, {"Content-Type": "application/zip"}
        )
        assert status == 201
        started = time.monotonic()
        status, headers, body = self.send(relay.url, "GET", url, setup)
        assert time.monotonic() - started < 5  # not the relay's 10 s time-out
        assert status == 413
        error = json.loads(body)["error"]
        assert error["code"] == "PAYLOAD_TOO_LARGE"
        assert str(self.LIMIT) in error["message"]
        assert "Range" in error["message"]
        assert headers["Content-Type"].startswith("application/json")
        status, _, got = self.send(
            relay.url, "GET", url, setup, headers={"Range": f"bytes=0-{self.LIMIT // 2 - 1}"}
        )
        assert status == 206
        assert got == big[: self.LIMIT // 2]

    @pytest.mark.real_server
    @pytest.mark.slow
    @pytest.mark.parametrize(
        ("served", "shown"),
        [
            ("text/html; charset=utf-8", "application/octet-stream"),
            ("image/svg+xml", "application/octet-stream"),
            ("application/xhtml+xml", "application/octet-stream"),
            ("image/png", "image/png"),
            ("audio/ogg", "audio/ogg"),
        ],
    )
    def test_a_server_cannot_publish_a_page_as_an_attachment(self, tmp_path, served, shown):
        with running(tmp_path, "relay") as relay:
            fake = FakeRelayServer(relay)
            assert fake.register() == 200
            out = []
            path = f"/r/{fake.server_id}{API}/attachments/attachments%2Fx.html"
            t = threading.Thread(target=lambda: out.append(relay_raw_get(relay, path)))
            t.start()
            _status, _, body = fake.poll()
            headers = [
                ["Content-Type", served],
                ["Content-Disposition", "inline"],
                ["Set-Cookie", "session=evil; Path=/"],
                ["Content-Security-Policy", "script-src *"],
                ["Refresh", "0; url=https://evil.example/"],
                ["ETag", '"abc"'],
            ]
            page = b"<script>alert(document.cookie)</script>"
            assert fake.reply(body["data"]["id"], 200, headers, page) == 200
            t.join(10)
        head, got = out[0]
        lines = head.lower().split("\r\n")
        assert f"content-type: {shown}" in lines
        assert 'content-disposition: attachment; filename="x.html"' in lines
        assert "content-security-policy: default-src 'none'; sandbox" in lines
        assert "x-content-type-options: nosniff" in lines
        assert 'etag: "abc"' in lines
        assert not any(
            h.startswith(("set-cookie", "refresh", "content-disposition: inline")) for h in lines
        )
        assert got == page

    def test_relay_answer_headers_of_a_download_and_of_an_api_answer(self):
        served = [["Content-Type", "image/jpeg"], ["Content-Disposition", 'inline; filename="a"']]
        download = notesvc.relay_answer_headers(
            "/api/v1/attachments/attachments/a b.jpg", served, True
        )
        assert ("Content-Type", "image/jpeg") in download
        assert ("Content-Disposition", 'attachment; filename="a_b.jpg"') in download
        answer = notesvc.relay_answer_headers("/api/v1/attachments/attachments/a.jpg", served)
        assert ("Content-Type", notesvc.JSON_TYPE) in answer  # an API answer is JSON, whatever
        assert ("Content-Disposition", 'inline; filename="a"') in answer  # on the allowlist
        assert notesvc.relayed_download("GET", "/api/v1/attachments/attachments/a.jpg", 206)
        for args in (
            ("GET", "/api/v1/attachments/attachments/a.jpg", 404),
            ("PUT", "/api/v1/attachments/attachments/a.jpg", 201),
            ("GET", "/api/v1/attachments", 200),
            ("GET", "/api/v1/notes/x", 200),
        ):
            assert not notesvc.relayed_download(*args)


def get_raw(url: str) -> tuple:
    """GET a URL; return (status, headers, bytes)."""
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.headers, e.read()


class TestGrantsThroughTheRelay:
    pytestmark = [pytest.mark.real_server, pytest.mark.slow]

    @pytest.fixture
    def pair(self, tmp_path):
        relay = Server(tmp_path / "relay", "relay", env={"SERVICE_RELAY_TIMEOUT": "5"})
        server = Server(tmp_path / "srv", env={"SERVICE_RELAY_URL": relay.url})
        try:
            wait_for(lambda: relay_servers(relay) == 1)
            setup = server.request("GET", f"{API}/system/setup")[2]["data"]
            yield relay, server, setup
        finally:
            server.stop()
            relay.stop()

    def test_metadata_documents_name_the_relay(self, pair):
        relay, _, setup = pair
        sid = setup["serverId"]
        base = f"{relay.url}/r/{sid}"
        status, headers, raw = get_raw(
            f"{relay.url}/.well-known/oauth-protected-resource/r/{sid}/api/v1/mcp"
        )
        assert status == 200
        assert headers["Content-Type"].startswith("application/json")
        assert json.loads(raw) == {
            "resource": f"{base}/api/v1/mcp",
            "authorization_servers": [base],
            "scopes_supported": ["notes:read", "notes:write"],
            "bearer_methods_supported": ["header"],
            "resource_name": "notesvc",
        }
        for name in ("oauth-authorization-server", "openid-configuration"):
            status, _, raw = get_raw(f"{relay.url}/.well-known/{name}/r/{sid}")
            asm = json.loads(raw)
            assert status == 200
            assert asm["issuer"] == base
            assert asm["token_endpoint"] == f"{base}/oauth/token"
        status, _, _ = get_raw(f"{relay.url}/.well-known/oauth-authorization-server/r/{'a' * 20}")
        assert status == 504  # no such server connected

    def test_oauth_flow_and_pages_through_the_relay(self, pair):
        relay, _server, setup = pair
        sid = setup["serverId"]
        base = f"{relay.url}/r/{sid}"
        # The consent page is the relay's own copy, whatever the server would send.
        status, headers, page = get_raw(f"{base}/oauth/authorize?client_id=x")
        assert status == 200  # a relay without a domain: the page keeps nothing in storage
        assert page == notesvc.shared_origin_page(notesvc.consent_page()).encode()
        assert headers["X-Frame-Options"] == "DENY"
        assert "frame-ancestors 'none'" in headers["Content-Security-Policy"]
        assert get_raw(f"{relay.url}/r/NOT-AN-ID/oauth/authorize")[0] == 404
        # Registration and tokens are forwarded to the server.
        status, _, reg = relay.request(
            "POST", f"/r/{sid}/oauth/register", {"redirect_uris": [CALLBACK], "client_name": "Far"}
        )
        assert status == 201
        cid = reg["client_id"]
        verifier, challenge = pkce_pair()
        approval = {
            "clientId": cid,
            "redirectUri": CALLBACK,
            "codeChallenge": challenge,
            "scope": "notes:read",
            "resource": f"{base}/api/v1/mcp",
        }
        status, _, body = relay.request(
            "POST", f"/r/{sid}{API}/oauth/approve", approval, owner_headers(setup)
        )
        assert status == 200, body
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(body["data"]["redirect"]).query)
        assert query["iss"] == [base]
        form = {
            "grant_type": "authorization_code",
            "code": query["code"][0],
            "client_id": cid,
            "redirect_uri": CALLBACK,
            "code_verifier": verifier,
            "resource": f"{base}/api/v1/mcp",
        }
        status, tokens = post_oauth_form(f"{base}/oauth/token", form)
        assert status == 200
        assert tokens["scope"] == "notes:read"
        status, again = post_oauth_form(f"{base}/oauth/token", form)
        assert (status, again["error"]) == (400, "invalid_grant")
        status, _ = post_oauth_form(f"{base}/oauth/revoke", {"token": tokens["refresh_token"]})
        assert status == 200
        assert get_raw(f"{base}/oauth/token")[0] == 405

    def test_a_share_link_through_the_relay(self, pair):
        relay, server, setup = pair
        sid = setup["serverId"]
        owner = owner_headers(setup)
        note = {"path": "notes/p.md", "content": "# P\n\n![pic](../attachments/p.png)\n"}
        relay.request("POST", f"/r/{sid}{API}/notes", note, owner)
        put = urllib.request.Request(
            f"{relay.url}/r/{sid}{API}/attachments/attachments%2Fp.png",
            PNG,
            {**owner, "Content-Type": "application/octet-stream"},
            method="PUT",
        )
        with urllib.request.urlopen(put, timeout=30) as resp:
            assert resp.status == 201
        status, _, body = relay.request(
            "POST", f"/r/{sid}{API}/shares", {"path": "notes/p.md"}, owner
        )
        url = body["data"]["url"]
        assert status == 201
        assert url.startswith(f"{relay.url}/r/{sid}/s/")
        status, headers, page = get_raw(url)
        assert status == 200
        assert page == notesvc.shared_origin_page(notesvc.share_page()).encode()
        assert headers["Referrer-Policy"] == "no-referrer"
        assert "noindex" in headers["X-Robots-Tag"]
        token = url.rsplit("/", 1)[1]
        status, _, raw = get_raw(f"{relay.url}/r/{sid}{API}/shared/{token}")
        assert status == 200
        assert json.loads(raw)["data"]["title"] == "P"
        image = f"{relay.url}/r/{sid}{API}/shared/{token}/attachments/attachments/p.png"
        status, headers, raw = get_raw(image)
        assert (status, raw, headers["Content-Type"]) == (200, PNG, "image/png")
        assert headers["Content-Security-Policy"] == notesvc.RELAY_ANSWER_CSP
        assert get_raw(f"{relay.url}/r/{sid}/s/..%2F..%2Fetc")[0] == 404
        # A share made directly in relay mode names the relay too.
        status, _, direct = server.request("POST", f"{API}/shares", {"path": "notes/p.md"}, owner)
        assert direct["data"]["url"].startswith(f"{relay.url}/r/{sid}/s/")


class TestRelayOrigins:
    """SERVICE_RELAY_DOMAIN: every server on its own origin, codes no one else can take,
    answers the relay vets; against a real relay and real servers (Host headers)."""

    pytestmark = [pytest.mark.real_server, pytest.mark.slow]

    def test_links_share_urls_and_oauth_name_the_servers_own_origin(self, origins):
        relay, server, setup, origin = origins
        host = urllib.parse.urlsplit(origin).netloc
        key = {"X-Service-Key": setup["apiKey"]}
        links = setup["links"]
        assert links["apiBase"] == links["relayApiBase"] == f"{origin}{API}"
        code = setup["pairing"]["relayCode"]
        assert links["connect"]["hosted"] == f"{origin}/?relayCode={code}"
        assert links["directApiBase"] == f"{server.url}{API}"  # the LAN route stays
        status, _, raw = host_request(
            relay.port, f"127.0.0.1:{relay.port}", "GET", "/relay/v1/info"
        )
        assert status == 200
        assert json.loads(raw)["data"] == {
            "domain": DOMAIN,
            "perServerOrigins": True,
            "publicUrl": relay.url,
        }
        # The API on the origin, as the server's own paths.
        status, _, raw = host_request(relay.port, host, "POST", f"{API}/auth/verify", headers=key)
        assert status == 200
        assert json.loads(raw)["data"]["serverId"] == setup["serverId"]
        body = {"path": "notes/p.md", "content": "# P\n\nshared"}
        assert host_request(relay.port, host, "POST", f"{API}/notes", body, key)[0] == 201
        status, _, raw = host_request(
            relay.port, host, "POST", f"{API}/shares", {"path": "notes/p.md"}, key
        )
        assert status == 201
        share = json.loads(raw)["data"]["url"]
        assert share.startswith(f"{origin}/s/")
        token = share.rsplit("/", 1)[1]
        status, headers, page = host_request(relay.port, host, "GET", f"/s/{token}")
        assert status == 200
        assert page == notesvc.share_page().encode()  # storage allowed: its own origin
        status, _, raw = host_request(relay.port, host, "GET", f"{API}/shared/{token}")
        assert json.loads(raw)["data"]["content"] == "# P\n\nshared"
        # A share made through the server directly names the relay origin too.
        status, _, body = server.request("POST", f"{API}/shares", {"path": "notes/p.md"}, key)
        assert body["data"]["url"].startswith(f"{origin}/s/")
        # OAuth: issuer, endpoints, resource and the 401's metadata URL on the origin.
        status, _, raw = host_request(
            relay.port, host, "GET", "/.well-known/oauth-authorization-server"
        )
        meta = json.loads(raw)
        assert meta["issuer"] == origin
        assert meta["authorization_endpoint"] == f"{origin}/oauth/authorize"
        status, headers, _ = host_request(relay.port, host, "POST", f"{API}/mcp", b"{}")
        assert status == 401
        assert (
            f'resource_metadata="{origin}/.well-known/oauth-protected-resource/api/v1/mcp"'
            in (headers["WWW-Authenticate"])
        )
        status, headers, page = host_request(relay.port, host, "GET", "/oauth/authorize?x=1")
        assert status == 200
        assert page == notesvc.consent_page().encode()
        assert headers["X-Frame-Options"] == "DENY"
        status, headers, page = host_request(relay.port, host, "GET", "/")
        assert page == notesvc.web_client_page().encode()
        assert 'data-origin="shared"' not in page.decode()
        # The path-based JSON routes stay, with their own issuer (connectors set up before).
        status, _, body = relay.request(
            "POST", f"/r/{setup['serverId']}{API}/auth/verify", None, key
        )
        assert status == 200
        status, _, raw = get_raw(
            f"{relay.url}/.well-known/oauth-authorization-server/r/{setup['serverId']}"
        )
        assert json.loads(raw)["issuer"] == f"{relay.url}/r/{setup['serverId']}"

    def test_the_relays_own_host_opens_no_server(self, origins):
        relay, _, setup, origin = origins
        sid, code = setup["serverId"], setup["pairing"]["relayCode"]
        status, headers, page = get_raw(f"{relay.url}/")
        assert status == 200
        assert page == notesvc.RELAY_LANDING_PAGE
        assert b"<script" not in page
        assert headers["Content-Security-Policy"].startswith("default-src 'none'")
        # Old connect links and old browser links go on to the server's own origin.
        for old, new in (
            (f"/?relayCode={code}", f"{origin}/"),
            (f"/?relayCode={code.upper()}", f"{origin}/"),
            (f"/r/{sid}/", f"{origin}/"),
            (
                f"/r/{sid}/oauth/authorize?client_id=a&state=b",
                f"{origin}/oauth/authorize?client_id=a&state=b",
            ),
            (f"/r/{sid}/s/tok_en-1", f"{origin}/s/tok_en-1"),
        ):
            status, headers, _ = host_request(relay.port, f"127.0.0.1:{relay.port}", "GET", old)
            assert (status, headers["Location"]) == (302, new), old
        assert host_request(relay.port, DOMAIN, "GET", "/?relayCode=zzzzzzzzzzzzzzzz")[0] == 404
        assert host_request(relay.port, DOMAIN, "GET", "/r/NOT-AN-ID/")[0] == 404
        # The relay's host forwards nothing but the path-based routes.
        for path in (f"{API}/health", "/dav/notes/", "/s/abc", "/oauth/authorize"):
            assert host_request(relay.port, DOMAIN, "GET", path)[0] == 404, path
        # A name that is not <serverId>.<domain> is the relay's own host.
        for host in (
            f"evil.{DOMAIN}",
            f"{sid}.other.test",
            f"x.{sid}.{DOMAIN}",
            f"{sid}.{DOMAIN}.evil",
        ):
            assert host_request(relay.port, host, "GET", f"{API}/health")[0] == 404, host

    def test_old_connectors_authorise_on_the_origin_with_their_path_based_resource(self, origins):
        relay, _, setup, origin = origins
        sid, host = setup["serverId"], urllib.parse.urlsplit(origin).netloc
        old_base = f"{relay.url}/r/{sid}"
        status, _, raw = relay.request(
            "POST", f"/r/{sid}/oauth/register", {"redirect_uris": [CALLBACK], "client_name": "Old"}
        )
        client_id = raw["client_id"]
        verifier, challenge = pkce_pair()
        query = urllib.parse.urlencode(
            {
                "response_type": "code",
                "client_id": client_id,
                "redirect_uri": CALLBACK,
                "state": "s1",
                "code_challenge": challenge,
                "code_challenge_method": "S256",
                "resource": f"{old_base}/api/v1/mcp",
            }
        )
        status, _, raw = host_request(relay.port, host, "GET", f"{API}/oauth/consent?{query}")
        assert status == 200, raw
        assert json.loads(raw)["data"]["resource"] == f"{old_base}/api/v1/mcp"
        approve = {
            "clientId": client_id,
            "redirectUri": CALLBACK,
            "state": "s1",
            "codeChallenge": challenge,
            "scope": "notes:read",
            "resource": f"{old_base}/api/v1/mcp",
        }
        key = {"X-Service-Key": setup["apiKey"]}
        status, _, raw = host_request(
            relay.port, host, "POST", f"{API}/oauth/approve", approve, key
        )
        assert status == 200, raw
        redirect = json.loads(raw)["data"]["redirect"]
        params = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(redirect).query))
        assert params["iss"] == old_base
        form = urllib.parse.urlencode(
            {
                "grant_type": "authorization_code",
                "code": params["code"],
                "redirect_uri": CALLBACK,
                "client_id": client_id,
                "code_verifier": verifier,
                "resource": f"{old_base}/api/v1/mcp",
            }
        ).encode()
        req = urllib.request.Request(
            f"{old_base}/oauth/token", form, {"Content-Type": "application/x-www-form-urlencoded"}
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            token = json.loads(resp.read())["access_token"]
        ping = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
        status, _, body = relay.request(
            "POST", f"/r/{sid}{API}/mcp", ping, {"Authorization": f"Bearer {token}"}
        )
        assert (status, body["result"]) == (200, {})
        # Another server's resource is refused on this origin.
        approve["resource"] = f"{relay.url}/r/{'a' * 20}/api/v1/mcp"
        assert (
            host_request(relay.port, host, "POST", f"{API}/oauth/approve", approve, key)[0] == 400
        )

    def test_a_code_belongs_to_the_server_whose_token_it_derives_from(self, origins):
        relay, _, setup, _ = origins
        code = setup["pairing"]["relayCode"]
        stranger = FakeRelayServer(relay)
        assert stranger.register() == 200
        # Taking the owner's (public) code: on register and on the code call, 403.
        body = {"token": stranger.token, "relayCode": code}
        assert stranger.call("POST", f"/relay/v1/register/{stranger.server_id}", body)[0] == 403
        body = {"serverId": stranger.server_id, "token": stranger.token}
        status, _, answer = stranger.call("POST", f"/relay/v1/code/{code}", body)
        assert (status, answer["error"]["code"]) == (403, "FORBIDDEN")
        status, _, body = relay.request("GET", f"/relay/v1/pair/{code}")
        assert body["data"]["serverId"] == setup["serverId"]
        # Its own code it may map; a made-up one it may not.
        body = {"serverId": stranger.server_id, "token": stranger.token}
        assert stranger.call("POST", f"/relay/v1/code/{stranger.code}", body)[0] == 200
        assert stranger.call("POST", "/relay/v1/code/MADE-UP-CODE", body)[0] == 403

    def test_code_calls_count_as_registrations_and_the_codes_held_are_capped(self, tmp_path):
        """A code call is a registration of the code (behind a load balancer that hashes on
        the code, the server's own registration lives in another relay process): it counts
        toward the per-address limit, expires, and the codes held are capped."""
        env = {"SERVICE_RELAY_REGISTRATIONS_PER_MINUTE": "5", "SERVICE_RELAY_MAX_SERVERS": "2"}
        with running(tmp_path, "relay", env=env) as relay:
            held = []
            for n in range(3):
                fake = FakeRelayServer(relay, source=f"127.0.0.{n + 3}")
                body = {"serverId": fake.server_id, "token": fake.token}
                held.append(fake.call("POST", f"/relay/v1/code/{fake.code}", body)[0])
                if n == 0:
                    first = fake
            assert held == [200, 200, 429]  # at most SERVICE_RELAY_MAX_SERVERS codes
            status, _, body = relay.request("GET", f"/relay/v1/pair/{first.code}")
            assert (status, body["data"]["serverId"]) == (200, first.server_id)
            # The same code again holds nothing more; every call counts toward the limit.
            body = {"serverId": first.server_id, "token": first.token}
            answers = [
                first.call("POST", f"/relay/v1/code/{first.code}", body)[0] for _ in range(5)
            ]
            assert answers == [200] * 4 + [429]
            # A registered server's code is its own, whatever the cap on the others.
            other = FakeRelayServer(relay, source="127.0.0.9")
            assert other.register() == 200
            assert relay.request("GET", f"/relay/v1/pair/{other.code}")[0] == 200

    def test_a_server_cannot_make_the_relay_serve_a_page(self, tmp_path):
        env = {"SERVICE_RELAY_DOMAIN": DOMAIN, "SERVICE_RELAY_TIMEOUT": "5"}
        with running(tmp_path, "relay", env=env) as relay:
            evil = FakeRelayServer(relay)
            assert evil.register() == 200
            hostile = [
                ["Content-Type", "text/html; x=json"],
                ["X-Frame-Options", "ALLOWALL"],
                ["Set-Cookie", "a=b"],
                ["Refresh", "0; url=https://evil.example/"],
                ["Link", "<https://evil.example/x.css>; rel=stylesheet"],
                ["Content-Security-Policy", "default-src *"],
                ["Access-Control-Allow-Origin", "*"],
                ["Service-Worker-Allowed", "/"],
                ["ETag", '"e1"'],
                ["X-Request-Id", "r1"],
                ["Retry-After", "3"],
            ]
            body = b"<script>alert(1)</script>"
            for host, path in (
                (f"{evil.server_id}.{DOMAIN}:{relay.port}", f"{API}/openapi.json"),
                (f"127.0.0.1:{relay.port}", f"/r/{evil.server_id}{API}/openapi.json"),
                (f"{evil.server_id}.{DOMAIN}", "/dav/notes/a.html"),
                (f"{evil.server_id}.{DOMAIN}", f"{API}/export.zip"),
            ):
                answers: dict = {}

                def client(host=host, path=path, answers=answers):
                    answers["r"] = host_request(relay.port, host, "GET", path)

                t = threading.Thread(target=client)
                t.start()
                status, _, polled = evil.poll()
                assert status == 200
                assert evil.reply(polled["data"]["id"], 200, hostile, body) == 200
                t.join(10)
                status, headers, raw = answers["r"]
                assert status == 200
                assert raw == body  # the bytes pass; nothing makes them a page
                ctype = headers["Content-Type"]
                assert ctype in (notesvc.JSON_TYPE, "application/octet-stream"), (path, ctype)
                assert headers["X-Content-Type-Options"] == "nosniff"
                assert headers["Content-Security-Policy"] == notesvc.RELAY_ANSWER_CSP
                names = {k.lower() for k in headers}
                for dropped in ("x-frame-options", "set-cookie", "refresh", "link"):
                    assert dropped not in names, (path, dropped)
                assert "access-control-allow-origin" not in names
                assert "service-worker-allowed" not in names
                assert (headers["ETag"], headers["X-Request-Id"], headers["Retry-After"]) == (
                    '"e1"',
                    "r1",
                    "3",
                )


class Stranger(FakeRelayServer):
    """Another person's server on the same relay: it records every request it is handed
    (what a page of someone else's would send it) and answers each with an empty 200."""

    def __init__(self, relay: Server):
        super().__init__(relay)
        self.seen: list = []
        self.stopped = threading.Event()
        assert self.register() == 200
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopped.is_set():
            with contextlib.suppress(OSError):
                status, _, body = self.poll()
                if status == 200:
                    request = body["data"]
                    self.seen.append(request)
                    answer = json.dumps({"success": True, "data": {}}).encode()
                    self.reply(request["id"], 200, [["Content-Type", "application/json"]], answer)

    def keys_seen(self) -> list:
        """Every credential a request handed to this server carried."""
        found = []
        for request in self.seen:
            for name, value in request["headers"]:
                if name.lower() in ("x-service-key", "authorization", "x-api-key"):
                    found.append(value)
            found += re.findall(
                r"ns[kdg]_[A-Za-z0-9_-]{20,}", base64.b64decode(request["body"]).decode("latin-1")
            )
        return found

    def close(self) -> None:
        self.stopped.set()


@pytest.fixture(scope="class")
def relay_browser():
    """Chromium resolving *.relay.test (and relay.test) to loopback: per-server origins."""
    sync_api = pytest.importorskip("playwright.sync_api")
    if not CHROMIUM:
        pytest.skip("no Chromium on this machine")
    rules = f"--host-resolver-rules=MAP *.{DOMAIN} 127.0.0.1, MAP {DOMAIN} 127.0.0.1"
    with sync_api.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=[*CHROMIUM_ARGS, rules])
        try:
            yield chromium
        finally:
            chromium.close()


class TestRelayOriginsInChromium:
    """The attack run's F1 and F3, in Chromium against a real relay: a stranger's server on
    the same relay must receive no key, and an SVG must not become a page of the origin."""

    pytestmark = BROWSER_TESTS

    def test_copy_works_on_plain_http_and_errors_show_in_their_dialog(
        self, relay_browser, tmp_path
    ):
        server = Server(tmp_path / "srv")
        try:
            key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]
            s = WebSession(relay_browser, tmp_path, "phone")
            page = s.page
            url = f"http://{DOMAIN}:{server.port}/"  # a name, plain HTTP: no secure context
            page.goto(url)
            assert page.evaluate("window.isSecureContext") is False
            assert page.evaluate("typeof navigator.clipboard") == "undefined"
            page.fill("#key", key)
            page.click("#connect")
            expect(page.locator("#app")).to_be_visible()
            page.click("#menu summary")
            page.click("#menu-keys")
            page.click("#add-device")
            s.dialog_choose("make")
            page.click("#dlg-body .once button")
            toast = page.locator("#dlg #toast")  # inside the dialog, above its backdrop
            expect(toast).to_have_text("Link copied")
            expect(toast).to_be_visible()
            s.dialog_choose("cancel")
            page.click("#add-folder")
            page.fill("#device-name", "Anna")
            s.dialog_choose("make")  # no folder named: the dialog says so, and keeps the name
            expect(page.locator("#dlg #dlg-error")).to_contain_text("Name the folder")
            expect(page.locator("#device-name")).to_have_value("Anna")
            assert unexpected(s.close()) == []
        finally:
            server.stop()

    def test_a_strangers_code_delivers_no_key(self, relay_browser, origins, tmp_path):
        relay, _, setup, origin = origins
        stranger = Stranger(relay)
        try:
            s = WebSession(relay_browser, tmp_path, "phone")
            page = s.page
            # The owner signs in on the server's own origin and keeps the key there.
            page.goto(setup["links"]["connect"]["hosted"])
            expect(page.locator("#login")).to_be_visible()  # a code in the URL: no auto-connect
            expect(page.locator("#shared-origin")).to_be_hidden()
            page.check("#remember")
            page.fill("#key", setup["apiKey"])
            page.click("#connect")
            page.wait_for_selector("#tree button, #tree .empty")
            assert urllib.parse.urlsplit(page.url).netloc == urllib.parse.urlsplit(origin).netloc
            assert page.evaluate("localStorage.getItem('notesvc.keyFor')") == API
            # The attack: one visit to the relay with the stranger's code.
            page.goto(f"http://{DOMAIN}:{relay.port}/?relayCode={stranger.code}")
            stranger_origin = f"http://{stranger.server_id}.{DOMAIN}:{relay.port}"
            page.wait_for_url(f"{stranger_origin}/")
            expect(page.locator("#login")).to_be_visible()  # another origin: nothing kept
            assert page.evaluate("localStorage.length") == 0
            page.click("#connect")  # even a click sends nothing without a key typed
            expect(page.locator("#login-msg")).to_contain_text("Paste the API key")
            # Belt and braces, on the owner's origin: a code there for the stranger's server
            # never sends the kept key; it leaves for the stranger's own page instead.
            page.goto(f"{origin}/?relayCode={stranger.code}")
            expect(page.locator("#login")).to_be_visible()
            page.click("#connect")
            page.wait_for_url(f"{stranger_origin}/")
            # And the owner's own code on the owner's origin: one click, the kept key.
            page.goto(setup["links"]["connect"]["hosted"])
            expect(page.locator("#login")).to_be_visible()
            page.click("#connect")
            page.wait_for_selector("#tree button, #tree .empty")
            s.shot("relay-origin")
            assert unexpected(s.close()) == []  # each request was answered: seen before that
        finally:
            stranger.close()
        assert stranger.keys_seen() == []

    def test_an_svg_attachment_never_runs_on_the_origin(self, relay_browser, origins, tmp_path):
        relay, server, setup, origin = origins
        host = urllib.parse.urlsplit(origin).netloc
        key = {"X-Service-Key": setup["apiKey"]}
        svg = (
            b'<svg xmlns="http://www.w3.org/2000/svg" width="20" height="20">'
            b'<rect width="20" height="20" fill="red"/><script>'
            b"try { document.title = 'stolen:' + localStorage.getItem('notesvc.key'); }"
            b" catch (e) { document.title = 'refused'; }</script></svg>"
        )
        path = urllib.parse.quote("attachments/family/x.svg", safe="")
        status, _, _ = host_request(
            relay.port,
            host,
            "PUT",
            f"{API}/attachments/{path}",
            svg,
            {**key, "Content-Type": "image/svg+xml"},
        )
        assert status == 201
        note = {"path": "notes/pic.md", "content": "# Pic\n\n![[attachments/family/x.svg|x]]\n"}
        assert host_request(relay.port, host, "POST", f"{API}/notes", note, key)[0] == 201
        s = WebSession(relay_browser, tmp_path, "desktop")
        page = s.page
        page.goto(f"{origin}/")
        page.check("#remember")
        page.fill("#key", setup["apiKey"])
        page.click("#connect")
        s.tree_open("notes/pic.md")
        img = page.locator("#view img[alt='x']")
        expect(img).to_have_js_property("naturalWidth", 20)  # it shows
        src = img.get_attribute("src")
        assert src.startswith("data:image/svg+xml"), src[:40]  # never a blob: of this origin
        # Opened alone (a new tab), it has no origin of ours to read.
        other = s.context.new_page()
        with contextlib.suppress(Exception):
            other.goto(src)
        title = other.title()
        assert "nsk_" not in title
        # Straight from the API (the relay's answer), it is a download, never a page.
        status, headers, _ = host_request(
            relay.port, host, "GET", f"{API}/attachments/{path}", headers=key
        )
        assert headers["Content-Type"] == "application/octet-stream"
        assert headers["Content-Disposition"].startswith("attachment")
        assert "nsk_" not in (page.title() + other.title())
        s.close()
        # On the server's own address the SVG comes typed image/svg+xml: shown the same way.
        s = WebSession(relay_browser, tmp_path, "desktop")
        s.login(f"{server.url}/", setup["apiKey"])
        s.tree_open("notes/pic.md")
        img = s.page.locator("#view img[alt='x']")
        expect(img).to_have_js_property("naturalWidth", 20)
        assert img.get_attribute("src").startswith("data:image/svg+xml")
        assert unexpected(s.close()) == []


class TestSystem:
    def test_health(self, anon):
        d = data(anon.get(f"{API}/health"))
        assert d["status"] == "ok"
        assert d["version"] == notesvc.__version__
        assert d["uptimeSeconds"] >= 0

    def test_info(self, client, root):
        (root / "notes" / "a").mkdir(parents=True)
        (root / "notes" / "a" / "x.md").write_text("hello")
        (root / "notes" / "skip.txt").write_text("not a note")
        d = data(client.get(f"{API}/system/info"))
        assert d["version"] == notesvc.__version__
        assert d["notes"] == {"count": 1, "bytes": 5}
        assert d["python"] == notesvc.platform.python_version()
        for name in ("serverId", "uptimeSeconds", "platform", "index"):
            assert name in d

    def test_config_groups_and_no_secrets(self, make_app):
        secret = "s3cr3t-" + "x" * 40
        app = make_app(
            SERVICE_AUTH_MODE="jwt",
            SERVICE_JWT_SECRET=secret,
            SERVICE_AGENT_API_KEY="sk-agent-secret",
            SERVICE_AGENT_BASE_URL="https://user:pw@models.example/v1",
            SERVICE_CORS_ORIGINS="https://a.example",
        )
        d = data(with_key(app).get(f"{API}/system/config"))
        for group in ("server", "auth", "connection", "agent", "search", "sync", "plugins"):
            assert group in d
        assert d["server"]["port"] == 3000
        assert d["server"]["cors"] == ["https://a.example"]
        assert d["auth"]["mode"] == "jwt"
        text = json.dumps(d)
        for secret_text in (secret, "sk-agent-secret", "pw@", key_of(app)):
            assert secret_text not in text
        assert d["agent"]["baseUrl"] == "https://models.example/v1"


class TestCors:
    def test_allowed_origin_gets_headers(self, make_app):
        app = make_app(SERVICE_CORS_ORIGINS="https://app.example")
        resp = app.get(f"{API}/health", headers={"Origin": "https://app.example"})
        assert resp.headers["Access-Control-Allow-Origin"] == "https://app.example"
        assert "ETag" in resp.headers["Access-Control-Expose-Headers"]

    def test_preflight(self, make_app):
        app = make_app(SERVICE_CORS_ORIGINS="https://app.example")
        resp = app.options(
            f"{API}/notes",
            headers={
                "Origin": "https://app.example",
                "Access-Control-Request-Method": "PUT",
                "Access-Control-Request-Headers": "x-service-key, if-match",
            },
        )
        assert resp.status_int == 204
        allowed = resp.headers["Access-Control-Allow-Headers"]
        for h in ("X-Service-Key", "Content-Type", "Authorization", "If-Match"):
            assert h in allowed
        assert "PUT" in resp.headers["Access-Control-Allow-Methods"]

    def test_other_origin_gets_no_cors_headers(self, make_app):
        app = make_app(SERVICE_CORS_ORIGINS="https://app.example")
        resp = app.get(f"{API}/health", headers={"Origin": "https://evil.example"})
        assert "Access-Control-Allow-Origin" not in resp.headers
        pre = app.options(
            f"{API}/health",
            headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "GET"},
            status="*",
            expect_errors=True,
        )
        assert "Access-Control-Allow-Origin" not in pre.headers

    def test_no_cors_configured_means_no_headers(self, anon):
        resp = anon.get(f"{API}/health", headers={"Origin": "https://app.example"})
        assert "Access-Control-Allow-Origin" not in resp.headers


class TestOpenApi:
    def test_document_and_route_table_agree(self, anon):
        doc = anon.get(f"{API}/openapi.json").json
        assert doc["openapi"].startswith("3.1")
        documented = {
            (method.upper(), path) for path, ops in doc["paths"].items() for method in ops
        }
        routes = {
            (r.method, notesvc.openapi_path(r.rule))
            for r in anon.app.service.routes
            if r.rule.startswith(API)
        }
        assert documented == routes
        # Every route the Bottle app really has under /api/v1 is in the table.
        bottle_routes = {
            (r.method, notesvc.openapi_path(r.rule))
            for r in anon.app.bottle.routes
            if r.rule.startswith(API)
        }
        assert bottle_routes == routes
        schemes = doc["components"]["securitySchemes"]
        assert schemes["apiKey"]["name"] == "X-Service-Key"
        assert schemes["bearerJwt"]["scheme"] == "bearer"

    def test_public_routes_are_marked_public(self, anon):
        doc = anon.get(f"{API}/openapi.json").json
        assert doc["paths"]["/api/v1/health"]["get"]["security"] == []
        assert "security" not in doc["paths"]["/api/v1/system/info"]["get"]


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
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> ForwardingProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


def hold_idle_connections(port: int, count: int) -> list:
    """Open `count` connections that never finish a request (half send nothing at all)."""
    socks = []
    for i in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        socks.append(sock)
        if i % 4 == 1:
            sock.sendall(b"GET /api/v1/hea")  # an unfinished request line
        elif i % 4 == 3:
            sock.sendall(b"GET /api/v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    return socks


def open_sockets(pid: int) -> int:
    """How many sockets process pid has open (Linux /proc). Sockets only: the files a
    starting server opens and closes meanwhile (its index, its state) would blur the count."""
    found = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            found += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return found


def closed_by_peer(socks: list) -> int:
    """How many of socks the other end has closed (read nothing: peeks at the EOF)."""
    poller = select.poll()
    for sock in socks:
        poller.register(sock, select.POLLIN)
    ready = {fd for fd, _ in poller.poll(0)}
    return sum(s.fileno() in ready and s.recv(1, socket.MSG_PEEK) == b"" for s in socks)


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


@pytest.fixture
def many_files():
    """Let this process hold a few hundred sockets."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < 2048:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(2048, hard), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture(scope="class")
def small_bodies(tmp_path_factory):
    """One real server taking bodies of at most 2048 bytes (shared by a class's tests)."""
    root = tmp_path_factory.mktemp("small-bodies")
    with running(root, env={"SERVICE_MAX_BODY_BYTES": "2048"}) as server:
        yield server


class TestEdge:
    @pytest.mark.real_server
    @pytest.mark.slow
    def test_a_body_over_the_limit_gets_its_413_even_when_written_before_reading(self, tmp_path):
        """urllib writes the whole body before it reads: the server lingers (keeps reading
        and discarding for a bounded time) instead of closing into a reset."""
        env = {"SERVICE_MAX_BODY_BYTES": "65536"}
        with running(tmp_path, "--auth-mode", "none", env=env) as server:
            body = json.dumps({"path": "notes/big.md", "content": "x" * 2_000_000}).encode()
            for _ in range(5):
                req = urllib.request.Request(
                    f"{server.url}{API}/notes", body, {"Content-Type": "application/json"}
                )
                with pytest.raises(urllib.error.HTTPError) as refused:
                    urllib.request.urlopen(req, timeout=30)
                with refused.value as answer:
                    assert answer.code == 413
                    assert json.loads(answer.read())["error"]["code"] == "PAYLOAD_TOO_LARGE"
            assert server.request("GET", f"{API}/health")[0] == 200
            # Bounded: a client that stops sending is closed after the idle bound.
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
                sock.sendall(
                    f"POST {API}/notes HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    "Content-Length: 900000\r\n\r\n".encode()
                )
                answer = b""
                started = time.monotonic()
                while True:
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    answer += chunk
                assert answer.startswith(b"HTTP/1.1 413")
                assert time.monotonic() - started < notesvc.LINGER_IDLE_SECONDS + 3

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_the_relay_lingers_after_its_own_413_too(self, tmp_path):
        env = {"SERVICE_MAX_BODY_BYTES": "65536"}
        with running(tmp_path, "relay", env=env) as relay:
            body = json.dumps({"path": "notes/big.md", "content": "x" * 8_000_000}).encode()
            for _ in range(5):
                req = urllib.request.Request(
                    f"{relay.url}/r/{'a' * 20}{API}/notes",
                    body,
                    {"Content-Type": "application/json"},
                )
                with pytest.raises(urllib.error.HTTPError) as refused:
                    urllib.request.urlopen(req, timeout=30)
                with refused.value as answer:
                    assert answer.code == 413
                    assert json.loads(answer.read())["error"]["code"] == "PAYLOAD_TOO_LARGE"
            assert relay.request("GET", "/health")[0] == 200

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_trusted_proxy_gives_https_links_real_clients_and_their_own_lockout(self, tmp_path):
        env = {"SERVICE_TRUST_PROXY": "true", "SERVICE_SETUP_LOCAL_ONLY": "true"}
        with running(tmp_path, env=env) as server, ForwardingProxy(server.url) as proxy:
            setup = f"{API}/system/setup"
            key = json.loads((tmp_path / ".notesvc" / "state.json").read_text())["apiKey"]
            # From the trusted proxy's own address, naming no client: not local either.
            assert server.request("GET", setup)[2]["data"]["apiKey"] == "nsk_…" + key[-4:]
            status, body = call(proxy.url, "GET", setup, {"Host": "notes.example"}, "127.0.0.5")
            assert status == 200
            assert body["data"]["server"]["url"] == "https://notes.example"
            assert body["data"]["links"]["directApiBase"] == "https://notes.example/api/v1"
            # A remote client behind the proxy never sees the key (SERVICE_SETUP_LOCAL_ONLY).
            remote = call(proxy.url, "GET", setup, source="127.0.0.5")[1]["data"]
            assert remote["apiKey"] == "nsk_…" + key[-4:]
            # One remote client's failures lock out that client only.
            for _ in range(10):
                status, _ = call(
                    proxy.url, "POST", f"{API}/auth/verify", {"X-Service-Key": "nsk_x"}, "127.0.0.5"
                )
                assert status == 401
            right = {"X-Service-Key": key}
            assert call(proxy.url, "POST", f"{API}/auth/verify", right, "127.0.0.5")[0] == 429
            assert call(proxy.url, "POST", f"{API}/auth/verify", right, "127.0.0.6")[0] == 200
            assert server.request("POST", f"{API}/auth/verify", headers=right)[0] == 200

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_forwarded_headers_from_an_untrusted_peer_are_ignored(self, tmp_path):
        env = {"SERVICE_TRUST_PROXY": "127.0.0.2", "SERVICE_SETUP_LOCAL_ONLY": "true"}
        with running(tmp_path, env=env) as server:
            forged = {
                "X-Forwarded-For": "203.0.113.9",
                "X-Forwarded-Proto": "https",
                "X-Forwarded-Host": "evil.example",
            }
            setup = server.request("GET", f"{API}/system/setup", headers=forged)[2]["data"]
            assert setup["server"]["url"] == server.url  # 127.0.0.1 is not the named proxy
            # ... and a forwarding header from a peer not named is never local for setup
            assert setup["setupHere"] == {"allowed": False, "reason": "proxy"}
            key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]
            assert setup["apiKey"] == "nsk_…" + key[-4:]
            for i in range(10):  # forged addresses do not spread the failures
                hdrs = {"X-Service-Key": "nsk_x", "X-Forwarded-For": f"203.0.113.{i}"}
                assert server.request("POST", f"{API}/auth/verify", headers=hdrs)[0] == 401
            hdrs = {"X-Service-Key": key, "X-Forwarded-For": "203.0.113.77"}
            assert server.request("POST", f"{API}/auth/verify", headers=hdrs)[0] == 429
            # The proxy the operator named is trusted.
            with ForwardingProxy(server.url, source="127.0.0.2") as proxy:
                _, body = call(
                    proxy.url, "GET", f"{API}/system/setup", {"Host": "notes.example"}, "127.0.0.5"
                )
                assert body["data"]["server"]["url"] == "https://notes.example"
                right = {"X-Service-Key": key}
                assert call(proxy.url, "POST", f"{API}/auth/verify", right, "127.0.0.5")[0] == 200

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_relayed_failures_never_lock_out_a_loopback_client(self, tmp_path):
        relay = Server(tmp_path / "relay", "relay", env={"SERVICE_RELAY_TIMEOUT": "5"})
        server = Server(tmp_path / "srv", env={"SERVICE_RELAY_URL": relay.url})
        try:
            wait_for(lambda: relay_servers(relay) == 1)
            setup = server.request("GET", f"{API}/system/setup")[2]["data"]
            verify = f"/r/{setup['serverId']}{API}/auth/verify"
            for _ in range(10):
                assert relay.request("POST", verify, headers={"X-Service-Key": "nsk_x"})[0] == 401
            right = {"X-Service-Key": setup["apiKey"]}
            assert relay.request("POST", verify, headers=right)[0] == 429  # that client is out
            # ... but the owner on the server's own machine is not,
            assert server.request("POST", f"{API}/auth/verify", headers=right)[0] == 200
            # nor the owner reaching the relay from another address.
            assert call(relay.url, "POST", verify, right, source="127.0.0.7")[0] == 200
            assert call(relay.url, "POST", verify, right, source="127.0.0.1")[0] == 429
        finally:
            server.stop()
            relay.stop()

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_rebinding_host_gets_the_key_redacted_from_the_real_server(self, tmp_path):
        with running(tmp_path) as server:
            key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]
            status, _, body = raw_http(
                server.port,
                b"GET /api/v1/system/setup HTTP/1.1\r\nHost: rebind.attacker.example\r\n"
                b"Connection: close\r\n\r\n",
            )
            assert status == 200
            payload = json.loads(body)["data"]
            assert payload["apiKey"] == "nsk_…" + key[-4:]
            assert key not in body.decode()

    @pytest.mark.real_server
    @pytest.mark.slow
    @pytest.mark.parametrize(
        ("case", "headers", "body", "status", "code"),
        [
            ("huge", "Content-Length: 100000000000000000000\r\n", b"", 413, "PAYLOAD_TOO_LARGE"),
            ("just over", "Content-Length: 2049\r\n", b"", 413, "PAYLOAD_TOO_LARGE"),
            ("negative", "Content-Length: -1\r\n", b"", 400, "VALIDATION_ERROR"),
            ("not a number", "Content-Length: ten\r\n", b"", 400, "VALIDATION_ERROR"),
            (
                "repeated",
                "Content-Length: 2\r\nContent-Length: 2\r\n",
                b"{}",
                400,
                "VALIDATION_ERROR",
            ),
            (
                "chunked over",
                "Transfer-Encoding: chunked\r\n",
                b"bb8\r\n" + b"x" * 3000 + b"\r\n0\r\n\r\n",
                413,
                "PAYLOAD_TOO_LARGE",
            ),
        ],
        ids=["huge", "just-over", "negative", "not-a-number", "repeated", "chunked-over"],
    )
    def test_waitress_refusals_are_json_envelopes(
        self, small_bodies, case, headers, body, status, code
    ):
        server = small_bodies
        request = (
            f"POST {API}/notes HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Service-Key: nsk_x\r\n"
            f"Content-Type: application/json\r\n{headers}\r\n"
        ).encode() + body
        got, resp_headers, resp_body = raw_http(server.port, request)
        assert got == status, resp_body
        assert resp_headers["content-type"] == "application/json; charset=utf-8"
        error = json.loads(resp_body)["error"]
        assert error["code"] == code
        assert "waitress" not in resp_body.decode()
        assert resp_headers["x-request-id"]

    def test_body_of_the_largest_size_passes_chunked_and_plain(self, small_bodies):
        server = small_bodies
        key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]
        note = json.dumps({"path": "notes/big.md", "content": ""})
        note = note.replace('""', '"' + "x" * (2048 - len(note)) + '"').encode()
        assert len(note) == 2048
        head = (
            f"POST {API}/notes HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Service-Key: {key}\r\n"
            "Content-Type: application/json\r\n"
        )
        request = f"{head}Content-Length: {len(note)}\r\n\r\n".encode() + note
        assert raw_http(server.port, request)[0] == 201
        small = b'{"path": "notes/chunked.md", "content": "hi"}'
        chunked = f"{head}Transfer-Encoding: chunked\r\n\r\n".encode()
        chunked += f"{len(small):x}\r\n".encode() + small + b"\r\n0\r\n\r\n"
        assert raw_http(server.port, chunked)[0] == 201

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_control_characters_in_the_path_are_escaped_in_the_log(self, tmp_path):
        with running(tmp_path) as server:
            status, _, _ = raw_http(
                server.port,
                b"GET /api/v1/x%0d%0aFORGED%20GET%20/ok%20200\x1b[2J HTTP/1.1\r\n"
                b"Host: 127.0.0.1\r\nX-Request-Id: edge-log-test-01\r\nConnection: close\r\n\r\n",
            )
            assert status == 404
            wait_for(lambda: any("edge-log-test-01" in line for line in server.lines))
            forged = [line for line in server.lines if "FORGED" in line]
            assert len(forged) == 1, forged
            assert "edge-log-test-01" in forged[0]
            assert "\\r\\nFORGED GET /ok 200\\x1b[2J" in forged[0]
            assert "\x1b" not in "".join(server.lines)

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_300_idle_connections_do_not_keep_the_owner_out(self, tmp_path, many_files):
        with running(tmp_path) as server:
            socks = []
            try:
                before = open_sockets(server.proc.pid)
                socks = hold_idle_connections(server.port, 300)
                wait_for(lambda: open_sockets(server.proc.pid) >= before + 300)  # all taken in
                status, seconds = timed_health(server.port)
                assert status == 200
                assert seconds < 1.0
            finally:
                for sock in socks:
                    sock.close()

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_a_flood_over_max_connections_closes_the_oldest_idle(self, tmp_path, many_files):
        with running(tmp_path, env={"SERVICE_MAX_CONNECTIONS": "50"}) as server:
            socks = []
            try:
                socks = hold_idle_connections(server.port, 80)
                wait_for(lambda: closed_by_peer(socks) >= 80 - 50)  # all taken in, room made
                status, seconds = timed_health(server.port)
                assert status == 200
                assert seconds < 1.0
                # The server made room by closing the oldest idle connections.
                closed = 0
                for sock in socks:
                    sock.settimeout(0.01)
                    with contextlib.suppress(TimeoutError, socket.timeout):
                        closed += sock.recv(1) == b""
                assert closed >= 80 - 50
                assert all(sock.recv(1) == b"" for sock in socks[:20]), "the oldest go first"
            finally:
                for sock in socks:
                    sock.close()

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_idle_connections_are_closed_after_the_idle_timeout(self, tmp_path):
        with running(tmp_path, env={"SERVICE_IDLE_TIMEOUT": "1"}) as server:
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            try:
                sock.sendall(b"GET /api/v1/health HTTP/1.1\r\n")
                started = time.monotonic()
                assert sock.recv(1) == b""  # closed by the server, not by our time-out
                assert time.monotonic() - started < 4
            finally:
                sock.close()


class TestServer:
    @pytest.mark.real_server
    @pytest.mark.slow
    def test_real_server_round_trip(self, tmp_path):
        with running(tmp_path) as server:
            # the banner's lines after "listening on" may still be on their way
            banner = wait_for(lambda: "key:" in "".join(server.lines) and "".join(server.lines))
            status, _, body = server.request("GET", f"{API}/system/setup")
            assert status == 200
            key = body["data"]["apiKey"]
            assert key not in banner  # stderr is no terminal here: the key stays off the log
            assert f"{server.url}{API}/system/setup" in banner
            status, headers, body = server.request("POST", f"{API}/auth/verify")
            assert status == 401
            assert body["error"]["code"] == "UNAUTHORIZED"
            assert headers["X-Request-Id"]
            status, _, body = server.request(
                "POST", f"{API}/auth/link", {"clientName": "cli"}, {"X-Service-Key": key}
            )
            assert status == 200
            assert body["data"]["setupComplete"] is True
        # After a restart the state is read back: setup stays complete, key stays valid.
        with running(tmp_path) as server:
            assert key not in "".join(server.lines)
            status, _, body = server.request(
                "POST", f"{API}/auth/verify", headers={"X-Service-Key": key}
            )
            assert status == 200
            assert body["data"]["setupComplete"] is True

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_falls_back_to_wsgiref_without_waitress(self, tmp_path):
        hidden = tmp_path / "no-waitress" / "waitress"  # found first, and fails as if absent
        hidden.mkdir(parents=True)
        (hidden / "__init__.py").write_text("raise ImportError('waitress is hidden here')\n")
        path = os.pathsep.join([str(hidden.parent), os.environ.get("PYTHONPATH", "")])
        proc = subprocess.Popen(
            [
                sys.executable,
                NOTESVC,
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--root",
                str(tmp_path / "root"),
            ],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "SERVICE_RESCAN_SECONDS": "0", "PYTHONPATH": path},
        )
        try:
            lines = []
            for line in proc.stderr:
                lines.append(line)
                m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
                if m:
                    break
            assert any("waitress is not installed" in line for line in lines)
            url = f"http://127.0.0.1:{m.group(1)}{API}/health"
            with urllib.request.urlopen(url, timeout=10) as resp:
                assert json.loads(resp.read())["data"]["status"] == "ok"
        finally:
            proc.terminate()
            proc.wait(10)
            proc.stderr.close()

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_busy_threads_say_so_once_not_per_request(self, tmp_path):
        """waitress warns "Task queue depth is N" for each request that finds every thread
        busy; the server says it once, with how many waited, until a minute has passed."""
        with running(tmp_path, env={"SERVICE_THREADS": "1"}) as server:

            def burst(_):
                for _ in range(15):
                    assert server.request("GET", f"{API}/health")[0] == 200

            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                list(pool.map(burst, range(16)))
            said = wait_for(lambda: [x for x in server.lines if "waited for a free thread" in x])
            time.sleep(0.5)  # a second line would be written at once too
            assert len([x for x in server.lines if "waited for a free thread" in x]) == 1
            assert "SERVICE_THREADS=1" in said[0]
            assert not [x for x in server.lines if "Task queue depth" in x]
            wait_for(lambda: sum(f"GET {API}/health 200" in x for x in server.lines) == 16 * 15)

    def test_queue_notice_counts_what_it_kept_quiet(self, caplog):
        notice = notesvc.QueueNotice(8)
        with caplog.at_level(logging.WARNING, logger="notesvc"):
            for depth in (1, 3, 2) * 40:
                notice.warning("Task queue depth is %d", depth)
            assert [r.getMessage() for r in caplog.records] == [
                "1 request(s) waited for a free thread (SERVICE_THREADS=8, at most 1 waiting) "
                "since the last such line; if answers are slow, raise it"
            ]
            notice.quiet_until = 0.0  # a minute later
            notice.warning("Task queue depth is %d")  # no depth given: counted as one
        assert (
            caplog.records[-1]
            .getMessage()
            .startswith(
                "120 request(s) waited for a free thread (SERVICE_THREADS=8, at most 3 waiting)"
            )
        )

    def test_module_app_is_built_on_first_use(self, tmp_path):
        code = "import notesvc; print(type(notesvc.app).__name__, notesvc.app is notesvc.app)"
        out = subprocess.run(
            [sys.executable, "-c", code],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            env={
                **os.environ,
                "PYTHONPATH": str(HERE),
                "SERVICE_NOTES_ROOT": str(tmp_path),
                "SERVICE_RESCAN_SECONDS": "0",
            },
            check=True,
        )
        assert out.stdout.split() == ["NotesApp", "True"]
        assert (tmp_path / ".notesvc" / "state.json").exists()

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_second_process_on_same_root_refuses(self, tmp_path):
        with running(tmp_path):
            out = run_cli("--root", str(tmp_path), "--port", "0", "--host", "127.0.0.1")
            assert out.returncode == 2
            assert "already serving" in out.stderr

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_sigterm_stops_cleanly(self, tmp_path):
        server = Server(tmp_path)
        try:
            server.proc.terminate()
            assert server.proc.wait(10) == 0
        finally:
            server.stop()


# Strings a person would call empty: White_Space and control characters only (CONTRACT 3).
BLANK_PROBES = [" ", "\t\n", "\u001e", "\u001c\u001f", "\x00", "\x7f", "\u0085", "\u00a0"]

BLANK_PROBES += ["\u1680", "\u2007", "\u2028", "\u202f", "\u205f", "\u3000", " \u3000\r "]


KEPT_PROBES = ["x", "\u200bx", "é", " a ", "\u00ad", "\u2060"]


def body_string_schemas(doc: dict):
    """Yield (operation id, field name, schema) of every string field of every JSON body."""

    def walk(schema: dict, name: str):
        if not isinstance(schema, dict):
            return
        if schema.get("type") == "string" or "pattern" in schema:
            yield name, schema
        for key, sub in (schema.get("properties") or {}).items():
            yield from walk(sub, key)
        for sub in schema.get("oneOf", []) + schema.get("anyOf", []) + schema.get("allOf", []):
            yield from walk(sub, name)

    for methods in doc["paths"].values():
        for op in methods.values():
            content = (op.get("requestBody") or {}).get("content", {})
            schema = content.get("application/json", {}).get("schema")
            for name, field in walk(schema or {}, ""):
                yield op.get("operationId"), name, field


def schema_accepts(schema: dict, value: str) -> bool:
    """Whether a string passes a string schema's length and pattern (as JSON Schema says)."""
    if len(value) < schema.get("minLength", 0) or len(value) > schema.get("maxLength", 10**9):
        return False
    return "pattern" not in schema or re.search(schema["pattern"], value) is not None


class TestBlankRule:
    """The OpenAPI document and the server call the same strings empty (CONTRACT 3)."""

    def test_blank_is_white_space_and_control_characters_for_every_character(self):
        for code in range(0x10000):
            ch = chr(code)
            expected = ch.isspace() or unicodedata.category(ch) == "Cc"
            assert notesvc.is_blank(ch) == expected, hex(code)

    def test_every_pattern_of_the_document_agrees_with_the_server_on_blank_strings(self, client):
        doc = client.get(f"{API}/openapi.json").json
        not_blank = [
            (op, name, schema)
            for op, name, schema in body_string_schemas(doc)
            if schema.get("pattern") == notesvc.NOT_BLANK_PATTERN
        ]
        assert {(op, name) for op, name, _ in not_blank} >= {
            ("agent_chat", "message"),
            ("create_scoped_key", "name"),
            ("patch_channel", "name"),
        }
        for op, name, schema in not_blank:
            for probe in BLANK_PROBES:
                assert not schema_accepts(schema, probe), (op, name, probe)
            for probe in KEPT_PROBES:
                assert schema_accepts(schema, probe), (op, name, probe)

    def test_schema_valid_strings_are_never_refused_as_empty(self, client):
        doc = client.get(f"{API}/openapi.json").json
        schemas = {(op, name): schema for op, name, schema in body_string_schemas(doc)}
        channel = client.post_json(f"{API}/channels", {"provider": "web"}, status=201).json
        cases = [
            ("agent_chat", "message", "POST", f"{API}/agent/chat", lambda v: {"message": v}),
            (
                "create_scoped_key",
                "name",
                "POST",
                f"{API}/auth/keys",
                lambda v: {"name": v, "scope": "read"},
            ),
            (
                "patch_channel",
                "name",
                "PATCH",
                f"{API}/channels/{channel['data']['id']}",
                lambda v: {"name": v},
            ),
        ]
        for op, name, method, url, body in cases:
            schema = schemas[(op, name)]
            for probe in BLANK_PROBES + KEPT_PROBES:
                resp = client.request(
                    url,
                    method=method,
                    body=json.dumps(body(probe)).encode(),
                    content_type="application/json",
                    expect_errors=True,
                )
                valid = schema_accepts(schema, probe)
                assert (resp.status_int < 400) == valid, (op, probe, resp.status_int, resp.text)
                if not valid:
                    assert_error(resp, 400, "VALIDATION_ERROR")


FRESH_FUZZ = os.environ.get("NOTESVC_FUZZ") == "fresh"


class TestSchemathesis:
    pytestmark = pytest.mark.slow

    def test_api_conforms_to_its_openapi_document(self, make_app):
        schemathesis = pytest.importorskip("schemathesis")
        hypothesis = pytest.importorskip("hypothesis")
        app = make_app(SERVICE_HOST="127.0.0.1")
        key = key_of(app)
        client = with_key(app)
        seed_notes(client)
        wsgi = app.app
        wsgi.service.lockout = notesvc.Lockout(limit=10**9)  # 401 probes must not lock us out
        # Schema-valid data must be accepted (the document states the real bounds and path
        # rules), except for two rules JSON Schema cannot say: a search query's grammar
        # (`a OR`, only `-word`s, an odd quote, no letter or digit) and PUT's optional body
        # `path`, which must equal the note's own. Only those operations skip the check.
        from schemathesis.checks import not_a_server_error
        from schemathesis.specs.openapi.checks import positive_data_acceptance

        beyond_json_schema = {
            "search_notes": [positive_data_acceptance],
            "update_note": [positive_data_acceptance],
            # its documented 502: Telegram is out of reach from the tests (no stand-in here)
            "connect_telegram": [not_a_server_error],
            # an import's bytes must be a zip, an .enex or a .jex (TestImport): 400 / 415
            "post_import": [positive_data_acceptance],
        }

        schema = schemathesis.openapi.from_wsgi("/api/v1/openapi.json", wsgi)
        skip = {
            "rotate_api_key",
            "link_client",
            "delete_note",
            "delete_channel",
            "toggle_channel",
            "toggle_plugin",
            "receive_webhook",
            "issue_token",
            "list_changes",  # a schema-valid wait holds the test up to 25 s; TestChanges
        }
        tested = 0
        for result in schema.get_all_operations():
            operation = result.ok()
            operation_id = operation.definition.raw.get("operationId")
            if operation_id in skip:
                continue

            @hypothesis.settings(
                max_examples=12,
                deadline=None,
                database=None,
                suppress_health_check=list(hypothesis.HealthCheck),
                phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
                # CI is deterministic: the same examples every run. NOTESVC_FUZZ=fresh draws
                # new ones (a failure prints the blob that reproduces it).
                derandomize=not FRESH_FUZZ,
                print_blob=True,
            )
            @hypothesis.given(case=operation.as_strategy())
            def check(case):
                leave_out = beyond_json_schema.get(case.operation.definition.raw["operationId"], [])
                case.call_and_validate(headers={"X-Service-Key": key}, excluded_checks=leave_out)

            check()
            tested += 1
        assert tested >= 20


MODERN = "2026-07-28"


def modern_meta(version: str = MODERN) -> dict:
    return {
        "io.modelcontextprotocol/protocolVersion": version,
        "io.modelcontextprotocol/clientCapabilities": {},
        "io.modelcontextprotocol/clientInfo": {"name": "test", "version": "1"},
    }


def modern(client, method, params=None, status="*", headers=None, version=MODERN, **extra):
    """POST one 2026-07-28 request (its _meta and headers filled in); return the response."""
    params = {"_meta": modern_meta(version), **(params or {})}
    hdrs = {
        "Content-Type": "application/json",
        "MCP-Protocol-Version": version,
        "Mcp-Method": method,
    }
    if method == "tools/call":
        hdrs["Mcp-Name"] = params.get("name", "")
    hdrs.update(headers or {})
    body = {"jsonrpc": "2.0", "id": "m-1", "method": method, "params": params, **extra}
    return client.post(
        f"{API}/mcp", json.dumps(body), headers=hdrs, status=status, expect_errors=True
    )


def raw_mcp(client, body: bytes | str, status="*", **headers):
    hdrs = {"Content-Type": "application/json", **headers}
    body = body.encode() if isinstance(body, str) else body
    return client.post(f"{API}/mcp", body, headers=hdrs, status=status, expect_errors=True)


def rpc_error(resp, status: int, code: int) -> dict:
    """Assert a JSON-RPC error answer (no envelope, no traceback); return its error."""
    assert resp.status_int == status, resp.text
    assert resp.content_type == "application/json"
    body = resp.json
    assert set(body) == {"jsonrpc", "id", "error"}
    assert body["jsonrpc"] == "2.0"
    assert body["error"]["code"] == code, body
    assert body["error"]["message"]
    assert "Traceback" not in resp.text
    return body["error"]


class TestMcp:
    """The JSON-RPC endpoint in-process: both protocol eras, every error code, auth, Origin."""

    @pytest.fixture
    def mcp(self, make_app):
        client = with_key(make_app())
        seed_notes(client)
        return client

    def test_handshake_era_initialize_notification_ping(self, mcp):
        for asked, given in [
            ("2025-06-18", "2025-06-18"),
            ("2025-11-25", "2025-11-25"),
            ("2024-11-05", "2025-11-25"),
            ("2031-01-01", "2025-11-25"),
        ]:
            params = {
                "protocolVersion": asked,
                "capabilities": {},
                "clientInfo": {"name": "t", "version": "1"},
            }
            resp = mcp.post(
                f"{API}/mcp",
                json.dumps({"jsonrpc": "2.0", "id": 7, "method": "initialize", "params": params}),
                headers={"Content-Type": "application/json"},
            )
            assert resp.content_type == "application/json"
            assert "Mcp-Session-Id" not in resp.headers  # nothing is kept between requests
            result = resp.json["result"]
            assert resp.json["id"] == 7
            assert result["protocolVersion"] == given
            assert result["capabilities"] == {"tools": {"listChanged": False}}
            assert result["serverInfo"]["name"] == "notesvc"
            assert result["serverInfo"]["version"] == notesvc.__version__
            assert "search_notes" in result["instructions"]
        note = raw_mcp(mcp, '{"jsonrpc": "2.0", "method": "notifications/initialized"}')
        assert (note.status_int, note.body) == (202, b"")
        assert rpc(mcp, "ping") == {"jsonrpc": "2.0", "id": 1, "result": {}}
        hdr = {"MCP-Protocol-Version": "2025-06-18"}
        assert rpc(mcp, "tools/list", **hdr)["result"]["tools"]
        answered = raw_mcp(mcp, '{"jsonrpc": "2.0", "id": 5, "result": {}}')  # a response
        assert (answered.status_int, answered.body) == (202, b"")

    def test_stateless_era_discover_list_call(self, mcp):
        found = modern(mcp, "server/discover", status=200).json
        assert found["id"] == "m-1"
        result = found["result"]
        assert result["supportedVersions"] == ["2025-06-18", "2025-11-25", "2026-07-28"]
        assert result["capabilities"] == {"tools": {"listChanged": False}}
        assert result["resultType"] == "complete"
        assert result["cacheScope"] == "private"
        assert result["ttlMs"] >= 0
        info = result["_meta"]["io.modelcontextprotocol/serverInfo"]
        assert info == {"name": "notesvc", "title": "notesvc notes", "version": notesvc.__version__}
        listed = modern(mcp, "tools/list", status=200).json["result"]
        assert {t["name"] for t in listed["tools"]} == {
            n for n, t in notesvc.TOOLS.items() if t.read_only
        }
        assert (listed["resultType"], listed["cacheScope"]) == ("complete", "private")
        called = modern(
            mcp, "tools/call", {"name": "search_notes", "arguments": {"query": "keys"}}, status=200
        ).json["result"]
        assert called["resultType"] == "complete"
        assert called["isError"] is False
        assert called["structuredContent"]["results"][0]["path"] == "notes/home/keys.md"
        note = mcp.post(
            f"{API}/mcp",
            json.dumps({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {}}),
            headers={"Content-Type": "application/json", "MCP-Protocol-Version": MODERN},
            status=202,
        )
        assert note.body == b""

    def test_tool_errors_are_results_with_structured_content(self, mcp):
        for era in ("handshake", "stateless"):
            params = {"name": "read_note", "arguments": {"path": "notes/none.md"}}
            if era == "handshake":
                result = rpc(mcp, "tools/call", params)["result"]
            else:
                result = modern(mcp, "tools/call", params, status=200).json["result"]
            assert result["isError"] is True
            assert result["structuredContent"] == {
                "error": {"code": "NOT_FOUND", "message": "no note at notes/none.md"}
            }

    @pytest.mark.parametrize(
        ("body", "status", "code"),
        [
            ("{not json", 400, -32700),
            ("", 400, -32700),
            ('{"jsonrpc": "2.0", "id": 1, "method": "ping", "x": NaN}', 400, -32700),
            (b'{"jsonrpc": "2.0", "id": 1, "method": "p\xffng"}', 400, -32700),
            ("[" * 100000 + "]" * 100000, 400, -32700),
            ('[{"jsonrpc": "2.0", "id": 1, "method": "ping"}]', 400, -32600),
            ("[]", 400, -32600),
            ('"ping"', 400, -32600),
            ("42", 400, -32600),
            ('{"id": 1, "method": "ping"}', 400, -32600),
            ('{"jsonrpc": "1.0", "id": 1, "method": "ping"}', 400, -32600),
            ('{"jsonrpc": "2.0", "id": 1, "method": 5}', 400, -32600),
            ('{"jsonrpc": "2.0", "id": 1, "method": ""}', 400, -32600),
            ('{"jsonrpc": "2.0", "id": true, "method": "ping"}', 400, -32600),
            ('{"jsonrpc": "2.0", "id": 1.5, "method": "ping"}', 400, -32600),
            ('{"jsonrpc": "2.0", "id": {"a": 1}, "method": "ping"}', 400, -32600),
            ('{"jsonrpc": "2.0", "id": null, "method": "ping"}', 400, -32600),
            ('{"jsonrpc": "2.0", "id": 1, "method": "resources/list"}', 200, -32601),
            ('{"jsonrpc": "2.0", "id": 1, "method": "' + "x" * 5000 + '"}', 200, -32601),
            ('{"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": [1]}', 200, -32602),
            (
                '{"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"cursor": "x"}}',
                200,
                -32602,
            ),
            ('{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {}}', 200, -32602),
            (
                '{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": 5}}',
                200,
                -32602,
            ),
            (
                '{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "nope"}}',
                200,
                -32602,
            ),
            (
                '{"jsonrpc": "2.0", "id": 1, "method": "tools/call",'
                ' "params": {"name": "read_note", "arguments": "notes/x.md"}}',
                200,
                -32602,
            ),
        ],
    )
    def test_malformed_json_rpc_gets_the_specs_codes(self, mcp, body, status, code):
        error = rpc_error(raw_mcp(mcp, body), status, code)
        assert len(error["message"]) < 300

    def test_the_request_id_comes_back_when_it_could_be_read(self, mcp):
        resp = raw_mcp(mcp, '{"jsonrpc": "2.0", "id": "abc", "method": "nope"}')
        assert resp.json["id"] == "abc"
        resp = raw_mcp(mcp, '{"jsonrpc": "1.0", "id": 9, "method": "ping"}')
        assert resp.json["id"] == 9
        resp = raw_mcp(mcp, '{"jsonrpc": "2.0", "id": [9], "method": "ping"}')
        assert resp.json["id"] is None

    def test_stateless_methods_not_served_are_404(self, mcp):
        for method in ("initialize", "ping", "resources/list"):
            rpc_error(modern(mcp, method), 404, -32601)

    def test_stateless_envelope_and_version_checks(self, mcp):
        no_meta = mcp.post(
            f"{API}/mcp",
            json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}),
            headers={
                "Content-Type": "application/json",
                "MCP-Protocol-Version": MODERN,
                "Mcp-Method": "tools/list",
            },
            expect_errors=True,
        )
        assert "_meta" in rpc_error(no_meta, 400, -32602)["message"]
        half = {"_meta": {"io.modelcontextprotocol/protocolVersion": MODERN}}
        resp = mcp.post(
            f"{API}/mcp",
            json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": half}),
            headers={
                "Content-Type": "application/json",
                "MCP-Protocol-Version": MODERN,
                "Mcp-Method": "tools/list",
            },
            expect_errors=True,
        )
        assert "clientCapabilities" in rpc_error(resp, 400, -32602)["message"]
        error = rpc_error(modern(mcp, "tools/list", version="2099-01-01"), 400, -32022)
        assert error["data"] == {
            "supported": ["2025-06-18", "2025-11-25", "2026-07-28"],
            "requested": "2099-01-01",
        }
        rpc_error(modern(mcp, "server/discover", version="banana"), 400, -32022)
        long = modern(mcp, "server/discover", version="v" * 5000)
        assert rpc_error(long, 400, -32022)["data"]["requested"] == "v" * 64
        params = {"_meta": {**modern_meta(), "io.modelcontextprotocol/protocolVersion": 7}}
        resp = raw_mcp(
            mcp,
            json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": params}),
            **{"MCP-Protocol-Version": "7", "Mcp-Method": "tools/list"},
        )
        rpc_error(resp, 400, -32020)  # the header (text) can never equal a number
        # a handshake-era request naming a revision this server does not serve
        resp = raw_mcp(
            mcp,
            '{"jsonrpc": "2.0", "id": 1, "method": "tools/list"}',
            **{"MCP-Protocol-Version": "2025-03-26"},
        )
        assert rpc_error(resp, 400, -32022)["data"]["requested"] == "2025-03-26"
        # a notification at a version not served
        resp = raw_mcp(
            mcp, '{"jsonrpc": "2.0", "method": "notifications/x"}', **{"MCP-Protocol-Version": "9"}
        )
        rpc_error(resp, 400, -32022)

    @pytest.mark.parametrize(
        ("headers", "says"),
        [
            ({"MCP-Protocol-Version": "2099-01-01"}, "MCP-Protocol-Version"),
            ({"Mcp-Method": "tools/list"}, "Mcp-Method"),
            ({"Mcp-Method": ""}, "Mcp-Method"),
            ({"Mcp-Name": "read_note"}, "Mcp-Name"),
            ({"Mcp-Name": "=?base64?cmVhZF9ub3Rl?="}, "Mcp-Name"),
            ({"Mcp-Name": "=?base64?not base64?="}, "Mcp-Name"),
        ],
    )
    def test_headers_that_do_not_repeat_the_body_are_32020(self, mcp, headers, says):
        params = {"name": "search_notes", "arguments": {"query": "keys"}}
        resp = modern(mcp, "tools/call", params, headers=headers)
        assert says in rpc_error(resp, 400, -32020)["message"]

    def test_header_mismatches_in_the_stateless_era(self, mcp):
        params = {"_meta": modern_meta(), "name": "search_notes", "arguments": {"query": "keys"}}
        body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": params})
        # the body names the stateless era but no header is sent
        resp = raw_mcp(mcp, body)
        assert "MCP-Protocol-Version" in rpc_error(resp, 400, -32020)["message"]
        other = {
            "MCP-Protocol-Version": "2099-01-01",
            "Mcp-Method": "tools/call",
            "Mcp-Name": "search_notes",
        }
        rpc_error(raw_mcp(mcp, body, **other), 400, -32020)
        sentinel = {
            "MCP-Protocol-Version": MODERN,
            "Mcp-Method": "tools/call",
            "Mcp-Name": "=?base64?c2VhcmNoX25vdGVz?=",
        }
        assert raw_mcp(mcp, body, **sentinel).json["result"]["isError"] is False
        # a handshake-era header names that era (as the SDKs route): _meta is then ignored
        old = {"MCP-Protocol-Version": "2025-11-25"}
        assert "resultType" not in raw_mcp(mcp, body, **old).json["result"]

    def test_get_delete_put_are_405_in_json_rpc(self, mcp):
        for method in ("GET", "DELETE", "PUT", "PATCH"):
            resp = mcp.request(f"{API}/mcp", method=method, expect_errors=True)
            error = rpc_error(resp, 405, -32000)
            assert error["data"] == {"status": 405, "code": "METHOD_NOT_ALLOWED"}
            assert resp.headers["Allow"] == "POST"

    def test_limits_are_json_rpc_errors(self, make_app):
        client = with_key(make_app(SERVICE_MAX_BODY_BYTES="2048"))
        big = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "ping", "pad": "x" * 3000})
        error = rpc_error(raw_mcp(client, big), 413, -32600)
        assert error["data"] == {"status": 413, "code": "PAYLOAD_TOO_LARGE"}
        resp = client.post(
            f"{API}/mcp", "{}", headers={"Content-Type": "text/plain"}, expect_errors=True
        )
        assert rpc_error(resp, 415, -32600)["data"]["code"] == "UNSUPPORTED_MEDIA_TYPE"

    def test_the_key_is_accepted_in_each_of_its_headers(self, anon):
        key = key_of(anon)
        for name, value in [
            ("X-Service-Key", key),
            ("Authorization", f"Bearer {key}"),
            ("Authorization", f"bearer {key}"),
            ("X-API-Key", key),
        ]:
            assert rpc(anon, "ping", **{name: value}) == {"jsonrpc": "2.0", "id": 1, "result": {}}
        for headers in [
            {},
            {"X-Service-Key": "nsk_wrong"},
            {"Authorization": "Bearer nsk_wrong"},
            {"Authorization": f"Basic {key}"},
            {"X-API-Key": "nsk_wrong"},
            {"X-Auth-Token": key},
        ]:
            resp = raw_mcp(anon, '{"jsonrpc": "2.0", "id": 1, "method": "ping"}', **headers)
            error = rpc_error(resp, 401, -32000)
            assert error["data"] == {"status": 401, "code": "UNAUTHORIZED"}
            assert "Authorization: Bearer" in error["message"]
            assert key not in resp.text
        # only /mcp takes them: the rest of the API wants X-Service-Key (or a JWT)
        for name, value in [("Authorization", f"Bearer {key}"), ("X-API-Key", key)]:
            resp = anon.get(f"{API}/system/info", headers={name: value}, status=401)
            assert_error(resp, 401, "UNAUTHORIZED")

    def test_wrong_keys_on_mcp_count_toward_the_lockout(self, anon):
        key = key_of(anon)
        for i in range(10):
            headers = [{"Authorization": "Bearer nsk_x"}, {"X-API-Key": "nsk_y"}][i % 2]
            rpc_error(raw_mcp(anon, "{}", **headers), 401, -32000)
        resp = raw_mcp(
            anon, '{"jsonrpc": "2.0", "id": 1, "method": "ping"}', Authorization=f"Bearer {key}"
        )
        error = rpc_error(resp, 429, -32000)
        assert error["data"]["code"] == "RATE_LIMITED"
        assert int(resp.headers["Retry-After"]) > 0
        assert_error(
            anon.get(f"{API}/system/info", headers={"X-Service-Key": key}, status=429),
            429,
            "RATE_LIMITED",
        )

    def test_jwt_mode_takes_a_token_or_the_key_as_bearer(self, make_app):
        app = make_app(SERVICE_AUTH_MODE="jwt", SERVICE_JWT_SECRET="j" * 40)
        key = key_of(app)
        token = data(with_key(app).post(f"{API}/auth/token"))["token"]
        for value in (token, key):
            assert rpc(app, "ping", Authorization=f"Bearer {value}")["result"] == {}
        resp = raw_mcp(app, "{}", Authorization=f"Bearer {token[:-2]}xx")
        rpc_error(resp, 401, -32000)

    def test_auth_off_asks_no_key_but_still_checks_the_origin(self, make_app):
        app = make_app(SERVICE_AUTH_MODE="none")
        assert rpc(app, "ping")["result"] == {}
        resp = raw_mcp(
            app, '{"jsonrpc": "2.0", "id": 1, "method": "ping"}', Origin="http://evil.example"
        )
        assert rpc_error(resp, 403, -32000)["data"]["code"] == "FORBIDDEN"

    def test_origin_must_be_an_allowed_one(self, make_app, root):
        app = make_app(SERVICE_CORS_ORIGINS="https://notes.example")
        key = key_of(app)
        ping = '{"jsonrpc": "2.0", "id": 1, "method": "ping"}'
        ok = raw_mcp(app, ping, Origin="https://notes.example", **{"X-API-Key": key})
        assert ok.json["result"] == {}
        assert ok.headers["Access-Control-Allow-Origin"] == "https://notes.example"
        for origin in (
            "https://evil.example",
            "null",
            "http://127.0.0.1:3000",
            "https://notes.example.evil.example",
        ):
            resp = raw_mcp(app, ping, Origin=origin, **{"X-API-Key": key})
            error = rpc_error(resp, 403, -32000)
            assert "SERVICE_CORS_ORIGINS" in error["message"]
        # refused before the key is even looked at: no lockout, no oracle
        for _ in range(12):
            raw_mcp(app, ping, Origin="https://evil.example", **{"X-API-Key": "nsk_bad"})
        assert raw_mcp(app, ping, **{"X-API-Key": key}).json["result"] == {}
        pre = app.options(
            f"{API}/mcp",
            headers={"Origin": "https://notes.example", "Access-Control-Request-Method": "POST"},
        )
        allowed = pre.headers["Access-Control-Allow-Headers"]
        for name in (
            "Authorization",
            "X-API-Key",
            "MCP-Protocol-Version",
            "Mcp-Method",
            "Mcp-Name",
        ):
            assert name in allowed
        star = make_app(tmp_path_factory_root(root), SERVICE_CORS_ORIGINS="*")
        resp = raw_mcp(star, ping, Origin="https://anywhere.example", **{"X-API-Key": key_of(star)})
        assert resp.json["result"] == {}

    def test_self_relay_prefix_answers_json_rpc_too(self, mcp):
        sid = mcp.app.service.state.read()["serverId"]
        resp = mcp.post(
            f"/r/{sid}{API}/mcp",
            '{"jsonrpc": "2.0", "id": 1, "method": "ping"}',
            headers={"Content-Type": "application/json"},
        )
        assert resp.json["result"] == {}
        other = mcp.post(
            f"/r/aaaaaaaaaaaaaaaaaaaa{API}/mcp",
            "{}",
            headers={"Content-Type": "application/json"},
            expect_errors=True,
        )
        assert rpc_error(other, 404, -32000)["data"]["code"] == "NOT_FOUND"
        found = call_tool(mcp, "search", query="keys")["structuredContent"]["results"][0]
        assert found["url"] == "http://localhost:80/api/v1/notes/notes%2Fhome%2Fkeys.md"
        via = mcp.post(
            f"/r/{sid}{API}/mcp",
            json.dumps(
                {
                    "jsonrpc": "2.0",
                    "id": 1,
                    "method": "tools/call",
                    "params": {"name": "search", "arguments": {"query": "keys"}},
                }
            ),
            headers={"Content-Type": "application/json"},
        ).json
        url = via["result"]["structuredContent"]["results"][0]["url"]
        assert url == f"http://localhost:80/r/{sid}/api/v1/notes/notes%2Fhome%2Fkeys.md"

    def test_a_crash_behind_a_json_rpc_route_is_32603_with_the_request_id(self, root, caplog):
        cfg = notesvc.load_config(env=make_env(root))
        service = notesvc.build_service(cfg).start()
        extra = (notesvc.Route("POST", "/boom-rpc", _boom, jsonrpc=True, scope="read"),)
        app = webtest.TestApp(notesvc.NotesApp(service, notesvc.ROUTES + extra))
        key = service.state.read()["apiKey"]
        resp = app.post(f"{API}/boom-rpc", "{}", headers={"X-API-Key": key}, status=500)
        error = rpc_error(resp, 500, -32603)
        assert resp.headers["X-Request-Id"] in error["message"]
        assert "secret" not in resp.text
        assert "passwd" not in resp.text
        assert service.routes[-1].jsonrpc is True
        assert {r.rule for r in service.routes if r.jsonrpc} == {f"{API}/mcp", f"{API}/boom-rpc"}

    def test_only_mcp_answers_json_rpc(self, anon):
        assert {r.rule for r in anon.app.service.routes if r.jsonrpc} == {f"{API}/mcp"}
        assert notesvc.RELAYED_JSONRPC_RE.match(f"/r/abc{API}/mcp")
        assert_error(anon.get(f"{API}/mcpx", status=404), 404, "NOT_FOUND")

    def test_openapi_documents_mcp(self, anon):
        doc = anon.get(f"{API}/openapi.json").json
        op = doc["paths"]["/api/v1/mcp"]["post"]
        assert set(op["responses"]) == {"200", "202", "default"}
        assert {"bearerKey": []} in op["security"]
        assert {"xApiKey": []} in op["security"]
        assert doc["components"]["securitySchemes"]["xApiKey"]["name"] == "X-API-Key"

    def test_config_and_audit_report_the_write_tools(self, make_app, root):
        cfg = data(with_key(make_app()).get(f"{API}/system/config"))
        assert cfg["mcp"] == {
            "path": "/api/v1/mcp",
            "write": False,
            "protocolVersions": ["2025-06-18", "2025-11-25", "2026-07-28"],
        }
        assert (cfg["agent"]["write"], cfg["agent"]["maxSteps"]) == (False, 6)
        app = make_app(
            tmp_path_factory_root(root),
            SERVICE_MCP_WRITE="true",
            SERVICE_AGENT_WRITE="true",
            SERVICE_AGENT_MAX_STEPS="9",
        )
        client = with_key(app)
        cfg = data(client.get(f"{API}/system/config"))
        assert (cfg["mcp"]["write"], cfg["agent"]["write"], cfg["agent"]["maxSteps"]) == (
            True,
            True,
            9,
        )
        assert "tool-writes-without-auth" not in ids(audit(client))
        client.post_json(f"{API}/channels", {"provider": "web", "config": {}}, status=201)
        findings = {f["id"]: f for f in audit(client)["findings"]}
        assert findings["agent-writes-from-channels"]["severity"] == "info"
        open_app = make_app(
            tmp_path_factory_root(root), SERVICE_AUTH_MODE="none", SERVICE_MCP_WRITE="true"
        )
        findings = {f["id"]: f for f in audit(open_app)["findings"]}
        assert findings["tool-writes-without-auth"]["severity"] == "medium"
        assert "SERVICE_MCP_WRITE" in findings["tool-writes-without-auth"]["detail"]
        quiet = make_app(tmp_path_factory_root(root), SERVICE_AUTH_MODE="none")
        assert "tool-writes-without-auth" not in ids(audit(quiet))

    @pytest.mark.parametrize(
        ("env", "names"),
        [
            ({"SERVICE_MCP_WRITE": "maybe"}, "SERVICE_MCP_WRITE"),
            ({"SERVICE_AGENT_WRITE": "2"}, "SERVICE_AGENT_WRITE"),
            ({"SERVICE_AGENT_MAX_STEPS": "0"}, "SERVICE_AGENT_MAX_STEPS"),
            ({"SERVICE_AGENT_MAX_STEPS": "21"}, "SERVICE_AGENT_MAX_STEPS"),
            ({"SERVICE_AGENT_MAX_STEPS": "six"}, "SERVICE_AGENT_MAX_STEPS"),
        ],
    )
    def test_bad_settings_stop_start_up(self, env, names):
        with pytest.raises(notesvc.ConfigError, match=names):
            notesvc.load_config(env=env)


def sdk_session(url: str, headers: dict, mode: str, steps):
    """Run `steps(client)` in an official MCP SDK session with a real server; return its result."""
    import asyncio

    client_module = pytest.importorskip("mcp.client.client")
    transport = pytest.importorskip("mcp.client.streamable_http")
    httpx2 = pytest.importorskip("httpx2")

    async def main():
        async with httpx2.AsyncClient(headers=headers, timeout=30) as http:
            connection = transport.streamable_http_client(url, http_client=http)
            async with client_module.Client(connection, mode=mode) as session:
                return await steps(session)

    return asyncio.run(main())


def post_rpc(server: Server, path: str, body, headers: dict | None = None) -> tuple:
    """POST a JSON-RPC body to a real server or relay; return (status, headers, answer)."""
    return server.request("POST", path, body, headers)


class TestMcpServer:
    """A real `python notesvc.py` (and a real relay): the official SDK, limits, the relay."""

    pytestmark = [pytest.mark.real_server, pytest.mark.slow]

    @pytest.fixture
    def server(self, tmp_path):
        with running(tmp_path / "srv", env={"SERVICE_MCP_WRITE": "true"}) as server:
            key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]
            for path, text in [("notes/garden.md", "# Garden\n\nPlant tomatoes in May.")]:
                server.request(
                    "POST", f"{API}/notes", {"path": path, "content": text}, {"X-Service-Key": key}
                )
            server.key = key
            yield server

    @pytest.mark.parametrize(("mode", "version"), [("legacy", "2025-11-25"), ("auto", MODERN)])
    def test_the_official_sdk_lists_searches_reads_creates_and_is_refused_a_stale_etag(
        self, server, mode, version
    ):
        async def steps(session):
            names = [t.name for t in (await session.list_tools()).tools]
            hits = await session.call_tool("search_notes", {"query": "tomatoes"})
            note = await session.call_tool("read_note", {"path": "notes/garden.md"})
            made = await session.call_tool(
                "create_note", {"path": "notes/sdk.md", "content": "# SDK\n\nmade by the SDK"}
            )
            etag = note.structured_content["etag"]
            server.request(
                "PUT",
                f"{API}/notes/notes%2Fgarden.md",
                {"content": "# Garden\n\nchanged"},
                {"X-Service-Key": server.key},
            )
            stale = await session.call_tool(
                "update_note", {"path": "notes/garden.md", "content": "overwrite", "etag": etag}
            )
            return session.protocol_version, names, hits, note, made, stale

        got, names, hits, note, made, stale = sdk_session(
            server.url + f"{API}/mcp", {"Authorization": f"Bearer {server.key}"}, mode, steps
        )
        assert got == version
        assert set(names) == set(notesvc.TOOLS)
        assert hits.is_error is False
        assert hits.content[0].text.startswith("notes/garden.md — Garden: ")
        assert hits.structured_content["results"][0]["path"] == "notes/garden.md"
        assert note.structured_content["content"] == "# Garden\n\nPlant tomatoes in May."
        assert made.is_error is False
        assert made.structured_content["path"] == "notes/sdk.md"
        assert stale.is_error is True
        assert stale.structured_content["error"]["code"] == "PRECONDITION_FAILED"
        _, _, body = server.request(
            "GET", f"{API}/notes/notes%2Fgarden.md", headers={"X-Service-Key": server.key}
        )
        assert body["data"]["content"] == "# Garden\n\nchanged"
        _, _, body = server.request(
            "GET", f"{API}/search?q=SDK", headers={"X-Service-Key": server.key}
        )
        assert body["data"]["results"][0]["path"] == "notes/sdk.md"

    def test_waitress_refusals_on_mcp_are_json_rpc(self, server):
        for headers, status, code in [
            ("Content-Length: 99999999\r\n", 413, "PAYLOAD_TOO_LARGE"),
            ("Content-Length: abc\r\n", 400, "VALIDATION_ERROR"),
            ("Content-Length: 5\r\nContent-Length: 6\r\n", 400, "VALIDATION_ERROR"),
        ]:
            request = (
                f"POST {API}/mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"{headers}\r\n"
            ).encode()
            got, resp_headers, body = raw_http(server.port, request)
            assert got == status, body
            answer = json.loads(body)
            assert answer["jsonrpc"] == "2.0"
            assert answer["error"]["data"]["code"] == code
            assert resp_headers["content-type"] == "application/json; charset=utf-8"

    @pytest.fixture
    def relayed(self, tmp_path):
        relay = Server(tmp_path / "relay", "relay", env={"SERVICE_RELAY_TIMEOUT": "3"})
        server = Server(tmp_path / "srv", env={"SERVICE_RELAY_URL": relay.url})
        try:
            wait_for(lambda: relay_servers(relay) == 1)
            setup = server.request("GET", f"{API}/system/setup")[2]["data"]
            server.request(
                "POST",
                f"{API}/notes",
                {"path": "notes/garden.md", "content": "# Garden\n\nPlant tomatoes in May."},
                {"X-Service-Key": setup["apiKey"]},
            )
            yield relay, setup
        finally:
            server.stop()
            relay.stop()

    def test_json_rpc_through_the_relay(self, relayed):
        relay, setup = relayed
        path = f"/r/{setup['serverId']}{API}/mcp"
        assert setup["links"]["relayApiBase"] + "/mcp" == relay.url + path
        bearer = {"Authorization": f"Bearer {setup['apiKey']}"}
        init = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-06-18",
                "capabilities": {},
                "clientInfo": {"name": "t", "version": "1"},
            },
        }
        status, headers, answer = post_rpc(relay, path, init, bearer)
        assert status == 200
        assert answer["result"]["protocolVersion"] == "2025-06-18"
        note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
        assert post_rpc(relay, path, note, bearer)[::2] == (202, None)
        call = {
            "jsonrpc": "2.0",
            "id": 2,
            "method": "tools/call",
            "params": {
                "_meta": modern_meta(),
                "name": "fetch",
                "arguments": {"id": "notes/garden.md"},
            },
        }
        stateless = {
            **bearer,
            "MCP-Protocol-Version": MODERN,
            "Mcp-Method": "tools/call",
            "Mcp-Name": "fetch",
        }
        status, _, answer = post_rpc(relay, path, call, stateless)
        assert status == 200
        fetched = answer["result"]["structuredContent"]
        assert fetched["text"] == "# Garden\n\nPlant tomatoes in May."
        assert fetched["url"] == f"{relay.url}/r/{setup['serverId']}/api/v1/notes/notes%2Fgarden.md"
        status, _, answer = post_rpc(relay, path, call, {**stateless, "Mcp-Name": "search"})
        assert (status, answer["error"]["code"]) == (400, -32020)
        for headers, want in [
            ({"X-API-Key": "nsk_wrong"}, (401, "UNAUTHORIZED")),
            ({**bearer, "Origin": "https://evil.example"}, (403, "FORBIDDEN")),
        ]:
            status, _, answer = post_rpc(
                relay, path, {"jsonrpc": "2.0", "id": 3, "method": "ping"}, headers
            )
            assert (status, answer["error"]["data"]["code"]) == want
        status, _, answer = relay.request("GET", path, headers=bearer)
        assert (status, answer["error"]["data"]["code"]) == (405, "METHOD_NOT_ALLOWED")
        # the relay's own refusals of a request to /mcp are JSON-RPC errors too
        status, _, answer = post_rpc(
            relay,
            f"/r/aaaaaaaaaaaaaaaaaaaa{API}/mcp",
            {"jsonrpc": "2.0", "id": 4, "method": "ping"},
        )
        assert status == 504
        assert answer["error"]["data"]["code"] == "UPSTREAM_TIMEOUT"
        request = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            "Content-Length: 99999999\r\n\r\n"
        ).encode()
        status, _, body = raw_http(relay.port, request)
        assert status == 413
        assert json.loads(body)["error"]["data"]["code"] == "PAYLOAD_TOO_LARGE"

    def test_the_official_sdk_through_the_relay_without_writes(self, relayed):
        _, setup = relayed

        async def steps(session):
            tools = [t.name for t in (await session.list_tools()).tools]
            note = await session.call_tool("read_note", {"path": "notes/garden.md"})
            return session.protocol_version, tools, note

        version, tools, note = sdk_session(
            setup["links"]["relayApiBase"] + "/mcp", {"X-API-Key": setup["apiKey"]}, "auto", steps
        )
        assert version == MODERN
        assert set(tools) == {n for n, t in notesvc.TOOLS.items() if t.read_only}
        assert note.structured_content["title"] == "Garden"


class TestGrantsOnMcp:
    """OAuth tokens and scoped keys on /api/v1/mcp: the challenge, the audience, the scope,
    the folder."""

    @pytest.fixture
    def server(self, make_app):
        client = with_key(make_app(SERVICE_MCP_WRITE="true"))
        for path, text in FOLDER_NOTES.items():
            put_note(client, path, text)
        return client

    def test_no_credential_is_401_with_the_challenge(self, anon):
        resp = anon.post(f"{API}/mcp", "{}", {"Content-Type": "application/json"}, status=401)
        assert resp.headers["WWW-Authenticate"] == (
            'Bearer resource_metadata="http://localhost:80/.well-known/oauth-protected-resource'
            '/api/v1/mcp", scope="notes:read"'
        )
        assert resp.json["jsonrpc"] == "2.0"
        assert "error" in resp.json
        sid = anon.app.service.state.read()["serverId"]
        relayed = anon.post(
            f"/r/{sid}{API}/mcp", "{}", {"Content-Type": "application/json"}, status=401
        )
        meta = re.search(r'resource_metadata="([^"]+)"', relayed.headers["WWW-Authenticate"]).group(
            1
        )
        assert (
            meta == f"http://localhost:80/.well-known/oauth-protected-resource/r/{sid}/api/v1/mcp"
        )
        assert anon.get(meta.split(":80", 1)[1]).json["resource"] == (
            f"http://localhost:80/r/{sid}/api/v1/mcp"
        )
        wrong = bearer(anon, "nsa_" + "x" * 43).post(
            f"{API}/mcp", "{}", {"Content-Type": "application/json"}, status=401
        )
        assert 'error="invalid_token"' in wrong.headers["WWW-Authenticate"]
        rest = anon.get(f"{API}/notes", status=401)
        assert "WWW-Authenticate" not in rest.headers

    def test_a_token_works_on_mcp_for_its_own_url_only(self, server):
        _, t = tokens_for(server, server)
        mcp = bearer(server, t["access_token"])
        assert "search_notes" in listed_tools(mcp)
        sid = server.app.service.state.read()["serverId"]
        answer = rpc(mcp.__class__(server.app), "tools/list")  # no credential at all
        assert answer["error"]
        elsewhere = mcp.post(
            f"/r/{sid}{API}/mcp",
            json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}),
            {"Content-Type": "application/json"},
            status=401,
        )
        assert 'error="invalid_token"' in elsewhere.headers["WWW-Authenticate"]

    def test_an_expired_token_is_401_with_the_challenge(self, server, root):
        _, t = tokens_for(server, server)
        state_file = root / ".notesvc" / "state.json"
        state = json.loads(state_file.read_text())
        state["grants"][0]["accessExpiresAt"] = "2020-01-01T00:00:00.000Z"
        state_file.write_text(json.dumps(state))
        resp = bearer(server, t["access_token"]).post(
            f"{API}/mcp", "{}", {"Content-Type": "application/json"}, status=401
        )
        assert resp.headers["WWW-Authenticate"].startswith('Bearer resource_metadata="')

    def test_a_read_token_cannot_call_write_tools(self, server, root):
        _, t = tokens_for(server, server)  # notes:read, while SERVICE_MCP_WRITE is on
        mcp = bearer(server, t["access_token"])
        assert listed_tools(mcp) == {n for n, tool in notesvc.TOOLS.items() if tool.read_only}
        for name, args in (
            ("create_note", {"path": "notes/x.md", "content": "x"}),
            ("append_to_note", {"path": "notes/top.md", "text": "x"}),
            ("delete_note", {"path": "notes/top.md"}),
        ):
            answer = rpc(mcp, "tools/call", {"name": name, "arguments": args})
            assert answer["error"]["code"] == -32602
            assert "reading only" in answer["error"]["message"]
        assert not (root / "notes/x.md").exists()
        assert (root / "notes/top.md").read_text() == FOLDER_NOTES["notes/top.md"]
        writer = bearer(
            server, tokens_for(server, server, "notes:read notes:write")[1]["access_token"]
        )
        assert (
            ok_tool(writer, "create_note", path="notes/x.md", content="x")["path"] == "notes/x.md"
        )

    def test_a_folder_token_sees_its_folder_through_every_tool(self, server):
        _, t = tokens_for(server, server, "notes:read notes:write", folder="notes/family")
        mcp = bearer(server, t["access_token"])
        hits = ok_tool(mcp, "search_notes", query="apple")
        assert {h["path"] for h in hits["results"]} == {
            "notes/family/a.md",
            "notes/family/sub/b.md",
        }
        assert hits["total"] == 2
        assert {r["id"] for r in ok_tool(mcp, "search", query="apple")["results"]} == {
            "notes/family/a.md",
            "notes/family/sub/b.md",
        }
        tree = ok_tool(mcp, "list_folder", depth=5)
        assert paths_in(tree) == {"notes/family/a.md", "notes/family/sub/b.md"}
        changes = ok_tool(mcp, "recent_changes")
        assert {c["path"] for c in changes["changes"]} == {
            "notes/family/a.md",
            "notes/family/sub/b.md",
        }
        assert ok_tool(mcp, "list_tags")["tags"] == [{"tag": "common", "count": 2}]
        assert ok_tool(mcp, "read_note", path="notes/family/a.md")["title"] == "Apple pie"
        for name, args in (
            ("read_note", {"path": "notes/work/c.md"}),
            ("fetch", {"id": "notes/family/../work/c.md"}),
            ("search_notes", {"query": "apple", "folder": "notes/work"}),
            ("list_folder", {"path": "notes/work"}),
            ("create_note", {"path": "notes/work/new.md", "content": "x"}),
            ("update_note", {"path": "notes/work/c.md", "content": "x", "etag": '"0"'}),
            (
                "move_note",
                {"path": "notes/family/a.md", "newPath": "notes/work/a.md", "etag": '"0"'},
            ),
            ("delete_note", {"path": "notes/top.md"}),
            ("replace_in_note", {"path": "notes/work/c.md", "old": "secret", "new": "public"}),
        ):
            tool_refused(mcp, name, "NOT_FOUND", **args)
        assert ok_tool(mcp, "create_note", path="notes/family/new.md", content="n")["path"]

    def test_a_scoped_key_works_on_mcp_in_every_header(self, server):
        key = new_grant(server, "read", "notes/family")["key"]
        for headers in (
            {"X-Service-Key": key},
            {"X-API-Key": key},
            {"Authorization": f"Bearer {key}"},
        ):
            answer = rpc(
                server.__class__(server.app),
                "tools/call",
                {"name": "search_notes", "arguments": {"query": "apple"}},
                **headers,
            )
            assert {h["path"] for h in answer["result"]["structuredContent"]["results"]} == {
                "notes/family/a.md",
                "notes/family/sub/b.md",
            }

    def test_the_agent_of_a_read_key_gets_no_write_tools(self, make_app):
        model = ToolModel(
            lambda messages: [("search_notes", {"query": "apple"})],
            lambda messages: "Found: " + last_tool_results(messages)[0],
        )
        try:
            client = with_key(
                make_app(
                    SERVICE_AGENT_PROVIDER="openai",
                    SERVICE_AGENT_BASE_URL=model.url + "/v1",
                    SERVICE_AGENT_MODEL="tool-llama",
                    SERVICE_AGENT_WRITE="true",
                )
            )
            for path, text in FOLDER_NOTES.items():
                put_note(client, path, text)
            member = as_key(client, new_grant(client, "read", "notes/family")["key"])
            d = data(member.post_json(f"{API}/agent/chat", {"message": "apple"}))
            offered = {t["function"]["name"] for t in model.requests[0]["json"]["tools"]}
            assert offered
            assert all(notesvc.TOOLS[name].read_only for name in offered)
            assert paths_in(d)
            assert all(map(inside_family, paths_in(d)))
            assert all(map(inside_family, paths_in(model.requests)))  # nothing else was sent
        finally:
            model.close()


def sdk_oauth_session(mcp_url: str, key: str, steps, scope: str = "notes:read"):
    """Run `steps(session, provider)` in an official MCP SDK session that authorises itself
    with the SDK's OAuth client (mcp.client.auth): it registers, is sent to the consent
    page, where the owner's approval is given with the key (POST /api/v1/oauth/approve, as
    the page does), and redeems the code. Returns (steps' result, transcript, storage)."""
    import asyncio

    auth = pytest.importorskip("mcp.client.auth")
    shared = pytest.importorskip("mcp.shared.auth")
    client_module = pytest.importorskip("mcp.client.client")
    transport = pytest.importorskip("mcp.client.streamable_http")
    httpx2 = pytest.importorskip("httpx2")
    transcript: list = []
    approved: dict = {}

    class Storage(auth.TokenStorage):
        tokens = client = None

        async def get_tokens(self):
            return self.tokens

        async def set_tokens(self, tokens):
            self.tokens = tokens

        async def get_client_info(self):
            return self.client

        async def set_client_info(self, client):
            self.client = client

    def approve_as_owner(url: str) -> None:
        ask = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(url).query))
        api = url.split("/oauth/authorize")[0] + API
        body = {
            "clientId": ask["client_id"],
            "redirectUri": ask["redirect_uri"],
            "state": ask["state"],
            "codeChallenge": ask["code_challenge"],
            "scope": scope,
            "resource": ask["resource"],
        }
        req = urllib.request.Request(
            f"{api}/oauth/approve",
            json.dumps(body).encode(),
            {"Content-Type": "application/json", "X-Service-Key": key},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            redirect = json.loads(resp.read())["data"]["redirect"]
        approved.update(urllib.parse.parse_qsl(urllib.parse.urlsplit(redirect).query))
        transcript.append(f"consent: {ask['client_id']} asked {ask.get('scope')}; approved {scope}")

    async def redirect_handler(url: str) -> None:
        transcript.append(f"authorize: {url.split('?')[0]}")
        await asyncio.get_running_loop().run_in_executor(None, approve_as_owner, url)

    async def callback_handler():
        return shared.AuthorizationCodeResult(
            code=approved["code"], state=approved.get("state"), iss=approved.get("iss")
        )

    async def record(response) -> None:
        request = response.request
        transcript.append(f"{request.method} {request.url} -> {response.status_code}")

    storage = Storage()
    provider = auth.OAuthClientProvider(
        server_url=mcp_url,
        client_metadata=shared.OAuthClientMetadata(
            client_name="notesvc SDK test", redirect_uris=[CALLBACK]
        ),
        storage=storage,
        redirect_handler=redirect_handler,
        callback_handler=callback_handler,
    )

    async def main():
        async with httpx2.AsyncClient(
            auth=provider, timeout=30, event_hooks={"response": [record]}
        ) as http:
            connection = transport.streamable_http_client(mcp_url, http_client=http)
            async with client_module.Client(connection, mode="legacy") as session:
                return await steps(session, provider)

    return asyncio.run(main()), transcript, storage


def mcp_with_token(url: str, token: str) -> tuple:
    """POST tools/list with a bearer token; return (status, headers)."""
    body = json.dumps({"jsonrpc": "2.0", "id": 9, "method": "tools/list"}).encode()
    req = urllib.request.Request(
        url,
        body,
        {
            "Content-Type": "application/json",
            "Authorization": f"Bearer {token}",
            "MCP-Protocol-Version": "2025-11-25",
        },
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.headers
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.headers


class TestSdkOAuth:
    """The official MCP SDK's OAuth client is the judge: directly and through a real relay."""

    pytestmark = [pytest.mark.real_server, pytest.mark.slow]

    def session(self, mcp_url: str, key: str):
        async def steps(session, provider):
            tools = [t.name for t in (await session.list_tools()).tools]
            hit = await session.call_tool("search_notes", {"query": "tomatoes"})
            first = provider.context.current_tokens
            provider.context.token_expiry_time = time.time() - 1  # the hour is up: refresh
            again = await session.call_tool("read_note", {"path": "notes/garden.md"})
            return tools, hit, first, provider.context.current_tokens, again

        return sdk_oauth_session(mcp_url, key, steps)

    def check(self, mcp_url: str, key: str, log_to: Path):
        (tools, hit, first, second, again), transcript, _ = self.session(mcp_url, key)
        (log_to / "sdk-oauth-transcript.txt").write_text("\n".join(transcript) + "\n")
        assert set(tools) == {n for n, t in notesvc.TOOLS.items() if t.read_only}
        assert hit.is_error is False
        assert hit.structured_content["results"][0]["path"] == "notes/garden.md"
        assert again.structured_content["content"].startswith("# Garden")
        assert second.refresh_token != first.refresh_token  # rotated
        assert second.access_token != first.access_token
        steps = [line.split(" -> ")[0].split(" ", 1)[-1] for line in transcript]
        base, path = mcp_url.split("/api/v1/mcp")[0], urllib.parse.urlsplit(mcp_url).path
        origin = (
            f"{urllib.parse.urlsplit(mcp_url).scheme}://{urllib.parse.urlsplit(mcp_url).netloc}"
        )
        issuer_path = urllib.parse.urlsplit(base).path
        for expected in (
            mcp_url,
            f"{origin}/.well-known/oauth-protected-resource{path}",
            f"{origin}/.well-known/oauth-authorization-server{issuer_path}",
            f"{base}/oauth/register",
            f"{base}/oauth/token",
        ):
            assert expected in steps, (expected, transcript)
        assert f"POST {mcp_url} -> 401" in transcript
        assert sum(s == f"{base}/oauth/token" for s in steps) == 2  # the code, then a refresh
        # Revocation: the grant ends; the MCP endpoint answers 401 with the challenge.
        status, answer = post_oauth_form(f"{base}/oauth/revoke", {"token": second.refresh_token})
        assert (status, answer) == (200, {})
        status, headers = mcp_with_token(mcp_url, second.access_token)
        assert status == 401
        assert headers["WWW-Authenticate"] == (
            f'Bearer resource_metadata="{origin}/.well-known/oauth-protected-resource{path}", '
            'scope="notes:read", error="invalid_token"'
        )
        status, _ = mcp_with_token(mcp_url, first.access_token)
        assert status == 401
        return transcript

    def test_the_sdk_authorises_itself_directly(self, tmp_path):
        with running(tmp_path / "srv") as server:
            setup = server.request("GET", f"{API}/system/setup")[2]["data"]
            server.request(
                "POST",
                f"{API}/notes",
                {"path": "notes/garden.md", "content": "# Garden\n\nPlant tomatoes in May."},
                owner_headers(setup),
            )
            self.check(f"{server.url}{API}/mcp", setup["apiKey"], tmp_path)
            _, _, keys = server.request("GET", f"{API}/auth/keys", headers=owner_headers(setup))
            assert keys["data"]["keys"] == []  # revoked

    def test_the_sdk_authorises_itself_through_a_relay(self, tmp_path):
        relay = Server(tmp_path / "relay", "relay", env={"SERVICE_RELAY_TIMEOUT": "10"})
        try:
            with running(tmp_path / "srv", env={"SERVICE_RELAY_URL": relay.url}) as server:
                wait_for(lambda: relay_servers(relay) == 1)
                setup = server.request("GET", f"{API}/system/setup")[2]["data"]
                server.request(
                    "POST",
                    f"{API}/notes",
                    {"path": "notes/garden.md", "content": "# Garden\n\nPlant tomatoes in May."},
                    owner_headers(setup),
                )
                url = setup["links"]["relayApiBase"] + "/mcp"
                assert url.startswith(f"{relay.url}/r/")
                transcript = self.check(url, setup["apiKey"], tmp_path)
                assert all(
                    line.startswith(("consent", "authorize")) or relay.url in line
                    for line in transcript
                )
        finally:
            relay.stop()


class TestCli:
    pytestmark = [pytest.mark.real_server, pytest.mark.slow]

    def test_pair_prints_a_link_the_running_server_honours_at_once(self, tmp_path):
        with running(tmp_path) as server:
            done = run_cli("pair", "--root", str(tmp_path), "--scope", "read", "--name", "Tablet")
            assert done.returncode == 0, done.stderr
            found = re.search(r"(http://\S+)/#pair=([a-z2-7]{26})\n", done.stdout)
            origin, secret = found.groups()
            assert origin.endswith(f":{server.port}")  # the running server's, as its banner
            if importlib.util.find_spec("segno"):
                assert "▄" in done.stdout  # a QR code in Unicode blocks
            started = time.monotonic()
            status, _, body = server.request(
                "POST", f"{API}/auth/devices/claim", {"secret": secret, "deviceName": "Tab"}
            )
            assert status == 201
            assert time.monotonic() - started < 1.0
            assert body["data"]["device"]["scope"] == "read"
            assert secret not in done.stderr + "".join(server.lines)
        refused = run_cli("pair", "--root", str(tmp_path), "--scope", "admin", "--folder", "x")
        assert refused.returncode == 2
        assert refused.stderr.startswith("notesvc: error: an admin device sees every note")
        assert refused.stdout == ""
        nothing = run_cli("pair", "--root", str(tmp_path / "none"))
        assert nothing.returncode == 2
        assert "no notesvc state" in nothing.stderr
        assert not (tmp_path / "none").exists()

    @pytest.mark.parametrize(
        ("args", "env", "names"),
        [
            (["--port", "abc"], {}, "--port"),
            ([], {"SERVICE_PORT": "abc"}, "SERVICE_PORT"),
            (["--auth-mode", "magic"], {}, "--auth-mode"),
            (["--auth-mode", "jwt"], {}, "SERVICE_JWT_SECRET"),
            ([], {"SERVICE_TRUST_PROXY": "perhaps"}, "SERVICE_TRUST_PROXY"),
            (["--no-such-flag"], {}, "--no-such-flag"),
        ],
    )
    def test_bad_values_exit_2_with_one_line(self, tmp_path, args, env, names):
        out = run_cli(*args, "--root", str(tmp_path), env=env)
        assert out.returncode == 2
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1, out.stderr
        assert names in lines[0]
        assert "Traceback" not in out.stderr

    def test_version(self):
        out = run_cli("--version")
        assert out.returncode == 0
        assert out.stdout.strip() == f"notesvc {notesvc.__version__}"

    def test_help_lists_every_variable(self):
        out = run_cli("--help")
        assert out.returncode == 0
        for s in notesvc.SETTINGS:
            assert s.env in out.stdout
            if s.flag:
                assert s.flag in out.stdout

    def test_corrupt_state_file_stops_startup_cleanly(self, tmp_path):
        (tmp_path / ".notesvc").mkdir()
        (tmp_path / ".notesvc" / "state.json").write_text("{broken")
        out = run_cli("--root", str(tmp_path), "--port", "0", "--host", "127.0.0.1")
        assert out.returncode == 2
        assert "state.json" in out.stderr
        assert "Traceback" not in out.stderr


def tree_snapshot(root: Path) -> dict:
    """Every path under root with what a write would change (mode, owner, mtime, size)."""
    snap = {}
    for path in [root, *sorted(root.rglob("*"))]:
        st = os.lstat(path)
        snap[str(path)] = (st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns, st.st_size)
    return snap


def system_python_with_bottle() -> str | None:
    """Return /usr/bin/python3 when it imports bottle and waitress by itself (Debian's)."""
    exe = "/usr/bin/python3"
    if not os.path.exists(exe):
        return None
    probe = subprocess.run([exe, "-I", "-c", "import bottle, waitress"], capture_output=True)
    return exe if probe.returncode == 0 else None


MARKER_PLUGIN = """
import pathlib
pathlib.Path({marker!r}).write_text("plugin code ran")
"""


class TestCliSafety:
    """Issue 10, items 6, 10, 11, 13: the CLI is safe as root, honest, and self-explaining."""

    @pytest.mark.real_server
    @pytest.mark.slow
    @pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs /proc")
    @pytest.mark.parametrize("options", [["-I", "-Xfaulthandler"], ["-Xfaulthandler"]])
    def test_the_script_runs_as_the_module_with_the_same_options(self, tmp_path, options):
        """`python notesvc.py` hands over (same process) to an interpreter that imports the
        file as `notesvc`, so the script's syntax tree is not kept; its options go along."""
        (tmp_path / "cwd").mkdir()
        (tmp_path / "cwd" / "secrets.py").write_text("raise SystemExit('shadowed')\n")
        args = ["--root", str(tmp_path / "r"), "--host", "127.0.0.1", "--port", "0"]
        proc = subprocess.Popen(
            [sys.executable, *options, NOTESVC, *args],
            cwd=tmp_path / "cwd",  # a module here never shadows the standard library's
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            lines = []
            for line in proc.stderr:
                lines.append(line)
                if "listening on" in line:
                    break
            assert any("listening on" in line for line in lines), lines
            argv = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")[:-1]
            dash_c = argv.index(b"-c")
            assert argv[0] == sys.executable.encode()
            assert set(map(str.encode, options)) <= set(argv[1:dash_c])
            assert argv[dash_c + 2 :] == [os.path.abspath(NOTESVC).encode(), *map(str.encode, args)]
            environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
            assert b"MALLOC_ARENA_MAX=1" in environ  # one malloc arena, not one per thread
        finally:
            proc.terminate()
            assert proc.wait(30) == 0
            proc.stderr.close()

    @pytest.mark.real_server
    @pytest.mark.slow
    @pytest.mark.parametrize("command", ["audit", "rotate-key"])
    def test_command_on_root_without_state_refuses_and_creates_nothing(self, tmp_path, command):
        typo = tmp_path / "typo"
        out = run_cli(command, "--root", str(typo))
        assert out.returncode == 2
        assert out.stderr.splitlines() == [
            f"notesvc: error: no notesvc state at {typo}/.notesvc "
            "(start the server there first, or check --root)"
        ]
        assert out.stdout == ""
        assert not typo.exists()

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_subcommand_help_lists_only_the_flags_it_reads(self):
        flags = {s.flag for s in notesvc.SETTINGS if s.flag}
        for command in notesvc.COMMANDS:
            out = run_cli(command, "--help")
            assert out.returncode == 0
            shown = set(re.findall(r"(--[a-z-]+)", out.stdout)) & flags
            expected = {
                s.flag
                for s in notesvc.SETTINGS
                if s.flag and command in notesvc.setting_commands(s)
            }
            assert shown == expected, command
        rotate = run_cli("rotate-key", "--help").stdout
        assert set(re.findall(r"(--[a-z-]+)", rotate)) == {"--help", "--root", "--log-level"}
        relay = run_cli("relay", "--help").stdout
        for flag in ("--auth-mode", "--pairing", "--root", "--cors", "--relay-url"):
            assert flag not in relay
        assert "SERVICE_RELAY_TIMEOUT" in relay
        assert "SERVICE_JWT_SECRET" not in relay

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_flag_of_another_command_is_refused_in_one_line(self, tmp_path):
        make_state(tmp_path)
        out = run_cli("--pairing", "relay", "rotate-key", "--root", str(tmp_path))
        assert out.returncode == 2
        assert len(out.stderr.strip().splitlines()) == 1
        assert "--pairing does not apply to rotate-key" in out.stderr

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_rotate_key_ignores_variables_it_does_not_read(self, tmp_path):
        make_state(tmp_path)
        out = run_cli("rotate-key", "--root", str(tmp_path), env={"SERVICE_AUTH_MODE": "jwt"})
        assert out.returncode == 0, out.stderr
        assert re.fullmatch(r"nsk_[A-Za-z0-9_-]{43}", out.stdout.strip())

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_audit_never_runs_plugin_code_and_writes_nothing(self, tmp_path):
        root = tmp_path / "root"
        make_state(root)
        plugins = root / ".notesvc" / "plugins"
        plugins.mkdir(mode=0o700)
        marker = tmp_path / "ran.txt"
        (plugins / "evil_one.py").write_text(MARKER_PLUGIN.format(marker=str(marker)))
        if os.geteuid() == 0:  # the service's own user owns the state; cron runs as root
            for path in [root, *root.rglob("*")]:
                os.chown(path, 65534, 65534)
        before = tree_snapshot(root)
        out = run_cli("audit", "--root", str(root), env={"SERVICE_HOST": "127.0.0.1"})
        assert out.returncode == 0, out.stdout + out.stderr
        assert not marker.exists()  # the plugin file was never executed
        assert "evil_one.py" in out.stdout
        assert "(plugin-evil-one)" in out.stdout
        assert tree_snapshot(root) == before  # nothing created, rewritten or re-owned
        assert "no server is running on this root" in out.stdout.splitlines()[1]

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_audit_reads_the_running_servers_effective_settings(self, tmp_path):
        secret = "Zq8vN3xR7tLp2Wc9Hs5Kd1Fg6Jm4Yb0Ue"
        env = {"SERVICE_AUTH_MODE": "jwt", "SERVICE_JWT_SECRET": secret}
        with running(tmp_path, "--cors", "*", env=env) as server:
            record_path = tmp_path / ".notesvc" / "effective.json"
            assert stat.S_IMODE(record_path.stat().st_mode) == 0o600
            text = record_path.read_text()
            assert secret not in text
            record = json.loads(text)
            assert record["pid"] == server.proc.pid
            assert record["startedAt"].endswith("Z")
            assert record["settings"]["cors"] == ["*"]
            assert record["settings"]["port"] == server.port
            assert record["secrets"]["jwt_secret"]["set"] is True
            assert record["secrets"]["agent_api_key"]["set"] is False
            assert "jwt_secret" not in record["settings"]
            # The CLI's own environment says nothing of CORS or JWT: the record wins.
            out = run_cli("audit", "--root", str(tmp_path))
            lines = out.stdout.splitlines()
            assert lines[1].startswith(
                f"auditing the running server (pid {server.proc.pid}, started "
            ), lines[:3]
            assert lines[1].endswith("with its effective settings")
            assert "(cors-wildcard)" in out.stdout
            assert "(jwt-mode)" in out.stdout  # a strong secret, judged by recorded figures
            assert "(jwt-secret-weak)" not in out.stdout
            assert secret not in out.stdout
        assert not record_path.exists()  # a clean stop takes the record away
        out = run_cli("audit", "--root", str(tmp_path))
        assert "no server is running on this root" in out.stdout.splitlines()[1]
        assert "(cors-wildcard)" not in out.stdout

    @pytest.mark.real_server
    @pytest.mark.slow
    @pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0, reason="needs root")
    def test_rotate_key_as_root_writes_the_state_as_its_owner(self, tmp_path):
        folder = tmp_path / ".notesvc"
        make_state(tmp_path)
        for path in [tmp_path, folder, *folder.iterdir()]:
            os.chown(path, 65534, 65534)
        out = run_cli("rotate-key", "--root", str(tmp_path))
        assert out.returncode == 0, out.stderr
        key = out.stdout.strip()
        for name in ("state.json", "state.lock"):
            st = (folder / name).stat()
            assert (st.st_uid, st.st_gid) == (65534, 65534), name
            assert stat.S_IMODE(st.st_mode) == 0o600
        state = json.loads((folder / "state.json").read_text())
        assert state["keyHash"] == notesvc.key_hash(key)
        assert not list(folder.glob(".tmp-*"))

    def test_rotate_key_as_another_user_names_sudo(self, tmp_path, monkeypatch, capsys):
        make_state(tmp_path)
        before = (tmp_path / ".notesvc" / "state.json").read_bytes()
        owner = (tmp_path / ".notesvc").stat().st_uid
        monkeypatch.setattr(os, "geteuid", lambda: owner + 4242)  # a user who is not root
        assert notesvc.main(["rotate-key", "--root", str(tmp_path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1
        assert re.search(r"run: sudo -u \S+ .*rotate-key --root ", err[0]), err
        assert (tmp_path / ".notesvc" / "state.json").read_bytes() == before

    @pytest.mark.real_server
    @pytest.mark.slow
    @pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0, reason="needs root")
    def test_rotate_key_as_a_real_other_user_refuses(self, tmp_path):
        python = system_python_with_bottle()
        if python is None:
            pytest.skip("needs Debian's python3-bottle under /usr/bin/python3")
        root = Path(tempfile.mkdtemp(prefix="notesvc-other-", dir="/tmp"))
        try:
            os.chmod(root, 0o755)
            make_state(root)
            os.chmod(root / ".notesvc", 0o755)  # nobody may look, not write
            os.chmod(root / ".notesvc" / "state.json", 0o644)
            out = subprocess.run(
                [python, "-I", NOTESVC, "rotate-key", "--root", str(root)],
                capture_output=True,
                text=True,
                user=65534,
                timeout=30,
                cwd="/",
            )
            assert out.returncode == 2, out.stderr
            assert out.stderr.strip().splitlines() == [
                f"notesvc: error: the state at {root}/.notesvc belongs to root; run: "
                f"sudo -u root python3 notesvc.py rotate-key --root {root}"
            ]
        finally:
            shutil.rmtree(root)

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_banner_without_a_terminal_shows_no_key(self, tmp_path):
        with running(tmp_path) as server:
            # the banner's lines after "listening on" may still be on their way
            banner = wait_for(
                lambda: "open the setup URL" in "".join(server.lines) and "".join(server.lines)
            )
            _, _, body = server.request("GET", f"{API}/system/setup")
            key = body["data"]["apiKey"]
            assert key.startswith("nsk_")
            assert "nsk_" not in banner
            assert "open the setup URL on this machine" in banner
            assert f"setup:  {server.url}{API}/system/setup" in banner

    @pytest.mark.real_server
    @pytest.mark.slow
    @pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
    def test_banner_on_a_terminal_shows_the_key(self, tmp_path):
        master, slave = os.openpty()
        proc = subprocess.Popen(
            [
                sys.executable,
                NOTESVC,
                "--port",
                "0",
                "--host",
                "127.0.0.1",
                "--root",
                str(tmp_path),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=slave,
            env={**os.environ, "SERVICE_RESCAN_SECONDS": "0"},
        )
        os.close(slave)
        try:
            text, deadline = "", time.monotonic() + 20
            while not re.search(r"key: .*\n", text) and time.monotonic() < deadline:
                ready, _, _ = select.select([master], [], [], 0.5)
                if ready:
                    text += os.read(master, 4096).decode(errors="replace")
            port = re.search(r"listening on http://127\.0\.0\.1:(\d+)", text).group(1)
            url = f"http://127.0.0.1:{port}{API}/system/setup"
            with urllib.request.urlopen(url, timeout=10) as resp:
                key = json.loads(resp.read())["data"]["apiKey"]
            assert f"key:    {key}" in text
        finally:
            proc.terminate()
            proc.wait(10)
            os.close(master)

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_missing_bottle_prints_one_line_and_exits_2(self, tmp_path):
        # -I -S: no user or site packages, so neither pip's nor Debian's bottle is found.
        probe = subprocess.run([sys.executable, "-I", "-S", "-c", "import bottle"])
        if probe.returncode == 0:
            pytest.skip("bottle is importable without site-packages here")
        out = subprocess.run(
            [sys.executable, "-I", "-S", NOTESVC, "--root", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 2
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1, out.stderr
        assert "sudo apt install python3-bottle python3-waitress" in lines[0]
        assert "pip" in lines[0]
        assert "Traceback" not in out.stderr
        assert not (tmp_path / ".notesvc").exists()
        # `import notesvc` (tests, plugins) still fails the ordinary way.
        code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import notesvc"
        imp = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True)
        assert imp.returncode == 1
        assert b"ModuleNotFoundError" in imp.stderr


class TestDocs:
    @pytest.mark.slow
    @pytest.mark.skipif(not shutil.which("node"), reason="no node (apt install nodejs)")
    def test_the_web_clients_logic_passes_its_own_tests(self):
        tests = sorted(str(p) for p in (HERE / "web" / "test").glob("*.test.js"))
        assert len(tests) >= 3
        done = subprocess.run(
            ["node", "--test", *tests], capture_output=True, text=True, timeout=120, cwd=HERE
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]

    def test_the_web_sources_are_what_notesvc_py_carries(self):
        """web/ is embedded by .ci/embed_web.py: --check fails on any difference."""
        done = subprocess.run(
            [sys.executable, str(HERE / ".ci" / "embed_web.py"), "--check"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        for name in ("app.html", "app.css", "app.js", "markdown.js", "consent.js", "share.js"):
            assert (HERE / "web" / name).is_file(), name
        assert (HERE / "web" / "markdown.js").read_text("utf-8") == notesvc.MARKDOWN_JS

    def test_the_documented_example_plugin_works(self, make_app, root):
        api = (HERE / "docs" / "api.md").read_text()
        code = re.search(r"```python\n(import notesvc\n.*?)```", api, re.S).group(1)
        assert len([line for line in code.splitlines() if line.strip()]) <= 10
        (root / ".notesvc" / "plugins").mkdir(parents=True)
        (root / ".notesvc" / "plugins" / "wordcount.py").write_text(code)
        client = with_key(make_app())
        put_note(client, "notes/a.md", "one two three")
        put_note(client, "notes/b.md", "four five")
        assert data(client.get(f"{API}/plugins/wordcount/totals")) == {"words": 5, "notes": 2}

    def test_every_setting_is_documented(self):
        reference = (HERE / "docs" / "configuration.md").read_text()
        for s in notesvc.SETTINGS:
            assert f"`{s.env}`" in reference, s.env
            if s.flag:
                assert f"`{s.flag}`" in reference, s.flag

    def test_readme_is_a_guide_and_its_links_resolve(self):
        readme = (HERE / "README.md").read_text()
        assert len(readme.splitlines()) <= 450
        documents = [HERE / "README.md", *sorted((HERE / "docs").glob("*.md"))]
        documents.append(HERE / "bench" / "README.md")
        for doc in documents:
            text = doc.read_text()
            # nothing a user of the project cannot see: no issue numbers, no outside documents
            outside = re.search(r"\bissue \d|\bCONTRACT\b|\bthe contract\b", text)
            assert outside is None, doc.name
            prose = re.sub(r"```.*?```|`[^`\n]*`", "", text, flags=re.S)  # examples aside
            for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", prose):
                if "://" not in target:
                    assert (doc.parent / target).exists(), f"{doc.name}: {target}"
        first_run = readme[readme.index("## First run") : readme.index("## On a Raspberry Pi")]
        assert "on your phone" in first_run
        assert "Set up this server" in first_run

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_the_venv_command_installs_and_runs_as_written(self, tmp_path):
        """README's second command, in a copy of the project (it needs PyPI or a wheel cache)."""
        readme = (HERE / "README.md").read_text()
        command = re.findall(r"```sh\n(.*?)```", readme, re.S)[1].strip()
        for name in ("notesvc.py", "pyproject.toml", "README.md", "LICENSE"):
            shutil.copy(HERE / name, tmp_path / name)
        env = {
            **os.environ,
            "SERVICE_PORT": "0",
            "SERVICE_HOST": "127.0.0.1",
            "SERVICE_NOTES_ROOT": str(tmp_path / "data"),
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        }
        proc = subprocess.Popen(
            ["bash", "-c", command],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            lines = []
            deadline = time.monotonic() + 240
            for line in proc.stderr:
                lines.append(line)
                if re.search(r"listening on http://127\.0\.0\.1:\d+", line):
                    break
                assert time.monotonic() < deadline, "".join(lines[-20:])
            assert any(f"notesvc {notesvc.__version__} serving" in x for x in lines), lines[-20:]
        finally:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(20)
            if proc.poll() is None:
                proc.kill()
            proc.stderr.close()

    def test_readme_starts_with_the_debian_command_then_the_venv_ones(self):
        readme = (HERE / "README.md").read_text()
        blocks = re.findall(r"```sh\n(.*?)```", readme, re.S)
        assert blocks[0].strip() == (
            "sudo apt install python3-bottle python3-waitress python3-segno && python3 notesvc.py"
        )
        assert blocks[1].strip() == (
            "python3 -m venv .venv && .venv/bin/pip install . && .venv/bin/notesvc"
        )
        assert blocks[2].strip() == (
            "python3 -m venv .venv && .venv/bin/pip install '.[test]' && .venv/bin/pytest"
        )

    def test_readme_banner_samples_match_the_real_banner(self, monkeypatch, capsys):
        readme = (HERE / "README.md").read_text()
        blocks = re.findall(r"\n   ```\n((?:   .*\n)+?)   ```", readme)
        sample = next(b for b in blocks if " serving " in b).replace("\n   ", "\n")[3:]
        key = re.search(r"nsk_[A-Za-z0-9_-]{43}", sample).group(0)
        config = notesvc.load_config(env={"SERVICE_NOTES_ROOT": "/home/pi/data"})
        state = {"setupComplete": False, "apiKey": key}
        phone = notesvc.phone_url(config, 3000)  # this machine's, as a phone would open it

        class Terminal(io.StringIO):
            def isatty(self) -> bool:
                return True

        terminal = Terminal()
        monkeypatch.setattr(sys, "stderr", terminal)
        notesvc.print_banner(config, state, 3000)
        text, _, qr = terminal.getvalue().partition("█")  # the words, then the QR code
        text = text[: text.rindex("\n") + 1]
        assert text.replace(phone, "http://raspberrypi.local:3000") == sample
        if importlib.util.find_spec("segno"):
            assert qr  # a terminal gets the phone's address as a QR code too
        monkeypatch.undo()
        notesvc.print_banner(config, state, 3000)  # to pytest's capture: no terminal
        journal = capsys.readouterr().err
        assert key not in journal
        key_line = next(line for line in journal.splitlines() if "key:" in line)
        assert f"```\n   {key_line}\n   ```" in readme  # indented in a list item

    def test_every_subcommand_and_the_proxy_example_are_documented(self):
        readme = (HERE / "README.md").read_text()
        reference = (HERE / "docs" / "configuration.md").read_text()
        for command in notesvc.COMMANDS:
            assert re.search(rf"^\| `{command}`", reference, re.M), command
        caddyfile = (HERE / "deploy" / "Caddyfile").read_text()
        assert "reverse_proxy 127.0.0.1:3000" in caddyfile
        proxy = reference[reference.index("## Behind a reverse proxy") :]
        assert "SERVICE_TRUST_PROXY=true" in proxy
        assert "SERVICE_PUBLIC_URL=https://" in proxy
        for kept in ("notes/", ".notesvc/state.json", ".notesvc/trash/", ".notesvc/effective.json"):
            assert f"`{kept}`" in readme[readme.index("## Backup and restore") :], kept

    def test_every_proxy_example_names_the_client_and_the_readme_says_who_sets_up(self):
        """Setup judges the client a trusted proxy names: every example in deploy/ names it
        (Caddy's reverse_proxy sets X-Forwarded-For by itself; nginx is told to)."""
        for path in sorted((HERE / "deploy").iterdir()):
            text = path.read_text()
            if "Caddyfile" in path.name:
                assert "reverse_proxy" in text, path.name
                assert "header_up -X-Forwarded-For" not in text, path.name
            elif "proxy_pass" in text:
                assert re.search(
                    r"proxy_set_header X-Forwarded-For \$proxy_add_x_forwarded_for", text
                )
        readme = " ".join((HERE / "README.md").read_text().split())
        for sentence in (
            "Only a browser on the server itself or on its own network (home Wi-Fi) can set up a "
            "new server, and only until the first device is set up. This holds for the API as "
            "well:",
            "A tunnel or proxy in front of notesvc that adds no `X-Forwarded-For` makes every "
            "client look local;",
        ):
            assert sentence in readme


# -- WebDAV (CONTRACT 25) --------------------------------------------------------------------

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
        return self.app.request(
            "/dav/" + urllib.parse.quote(path),
            method=method,
            body=body,
            headers=headers,
            status=status,
            expect_errors=True,
        )

    def hrefs(self, path: str) -> list:
        resp = self("PROPFIND", path, PROPFIND_BODY, status=207, Depth="1")
        return [urllib.parse.unquote(h) for h in re.findall(r"<D:href>([^<]*)</D:href>", resp.text)]


@pytest.fixture
def dav(client):
    return Dav(client, key_of(client))


class TestDav:
    """/dav/: notes and the other files of a vault, through the stores, for other apps."""

    def test_options_need_no_key_and_the_rest_asks_for_basic(self, anon, dav):
        anon = webtest.TestApp(anon.app, lint=False)
        resp = anon.request("/dav/", method="OPTIONS")
        assert resp.headers["DAV"] == "1, 2"
        assert "PROPFIND" in resp.headers["Allow"]
        resp = anon.request("/dav/notes/", method="PROPFIND", headers={"Depth": "1"}, status=401)
        assert resp.headers["WWW-Authenticate"].startswith('Basic realm="notesvc"')
        assert "Traceback" not in resp.text
        bearer = {"Authorization": f"Bearer {key_of(anon)}", "Depth": "0"}
        assert anon.request("/dav/notes/", method="PROPFIND", headers=bearer).status_int == 207

    def test_wrong_passwords_count_toward_the_lockout(self, anon):
        wrong = Dav(anon, "nsk_wrong")
        for _ in range(10):
            wrong("PROPFIND", "notes", status=401, Depth="0")
        wrong("PROPFIND", "notes", status=429, Depth="0")
        Dav(anon, key_of(anon))("PROPFIND", "notes", status=429, Depth="0")  # locked out

    def test_a_note_written_over_dav_is_a_note(self, client, dav, root):
        dav("PUT", "notes/trip/plan.md", b"# Plan\n", status=409)  # no folder yet
        dav("MKCOL", "notes/trip", status=201)
        resp = dav("PUT", "notes/trip/plan.md", b"# Plan\n\nPack the tent\n", status=201)
        api = data(client.get(note_url("notes/trip/plan.md")))
        assert resp.headers["ETag"] == api["etag"]
        resp = dav("PUT", "notes/trip/plan.md", b"# Plan\n\nPack the stove\n", status=204)
        assert dav("GET", "notes/trip/plan.md").body == b"# Plan\n\nPack the stove\n"
        versions = data(client.get(f"{note_url('notes/trip/plan.md')}/versions"))["versions"]
        assert versions[0]["reason"] == "dav"
        assert search(client, "stove")["results"][0]["path"] == "notes/trip/plan.md"
        assert [c["kind"] for c in feed(client)["changes"]] == ["created", "updated"]
        listed = dav("PROPFIND", "notes/trip", PROPFIND_BODY, status=207, Depth="1").text
        etag = data(client.get(note_url("notes/trip/plan.md")))["etag"]
        assert f"<D:getetag>{etag.replace(chr(34), '&quot;')}</D:getetag>" in listed
        assert dav("GET", "notes/trip/plan.md").headers["ETag"] == etag

    def test_a_vaults_other_files_are_kept_byte_for_byte_out_of_the_apis_sight(
        self, client, dav, root
    ):
        dav("MKCOL", "notes/vault", status=201)
        dav("MKCOL", "notes/vault/.obsidian", status=201)
        png = PNG + bytes(range(256))
        for path, body in (
            ("notes/vault/photo.png", png),
            ("notes/vault/board.canvas", b'{"nodes":[]}'),
            ("notes/vault/.obsidian/app.json", b'{"theme":"dark"}'),
            ("notes/vault/.obsidian/notes.md", b"settings, not a note"),
            ("notes/vault/Welcome.md", b"# Welcome\n\n![[photo.png]]\n"),
        ):
            dav("PUT", path, body, status=201)
            assert dav("GET", path).body == body
            assert (root / path).read_bytes() == body
        assert [
            n["path"] for n in data(client.get(f"{API}/notes?folder=notes/vault"))["notes"]
        ] == ["notes/vault/Welcome.md"]
        tree = client.get(f"{API}/folders/tree?folder=notes/vault").text
        assert ".obsidian" not in tree
        assert "canvas" not in tree
        assert search(client, "settings")["total"] == 0
        assert sorted(dav.hrefs("notes/vault"))[1:] == [
            "/dav/notes/vault/.obsidian/",
            "/dav/notes/vault/Welcome.md",
            "/dav/notes/vault/board.canvas",
            "/dav/notes/vault/photo.png",
        ]
        # the API serves the image beside the note (the web client shows it in the note)
        got = client.get(
            f"{API}/attachments/" + urllib.parse.quote("notes/vault/photo.png", safe="")
        )
        assert got.body == png
        assert got.headers["Content-Security-Policy"] == notesvc.ATTACHMENT_CSP
        for hidden in ("notes/vault/.obsidian/app.json", "notes/vault/Welcome.md"):
            client.get(f"{API}/attachments/" + urllib.parse.quote(hidden, safe=""), status=400)
        elsewhere = as_key(client, new_grant(client, "read", folder="notes/other")["key"])
        elsewhere.get(f"{API}/attachments/notes%2Fvault%2Fphoto.png", status=404)
        # a range of a file, as a player asks for it
        part = dav("GET", "notes/vault/photo.png", Range="bytes=2-5", status=206)
        assert part.body == png[2:6]
        assert part.headers["Content-Security-Policy"] == notesvc.ATTACHMENT_CSP

    def test_propfind_depth_infinity_is_refused_by_name(self, dav):
        resp = dav("PROPFIND", "notes", PROPFIND_BODY, status=403, Depth="infinity")
        assert "<D:propfind-finite-depth/>" in resp.text
        dav("PROPFIND", "notes", PROPFIND_BODY, status=403)  # no Depth means infinity

    @pytest.mark.parametrize(
        "body",
        [
            b'<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol2 "&lol;&lol;'
            b'&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">]><d:propfind xmlns:d="DAV:">'
            b"<d:prop>&lol2;</d:prop></d:propfind>",
            b'<?xml version="1.0"?><!DOCTYPE d [<!ENTITY x SYSTEM "file:///etc/passwd">]>'
            b'<d:propfind xmlns:d="DAV:"><d:prop><d:x>&x;</d:x></d:prop></d:propfind>',
            b"<d:propfind xmlns:d='DAV:'><d:prop>",  # not well formed
        ],
        ids=["billion-laughs", "external-entity", "broken"],
    )
    def test_hostile_xml_is_400_at_once(self, dav, body):
        started = time.monotonic()
        for method in ("PROPFIND", "PROPPATCH", "LOCK"):
            resp = dav(method, "notes", body, status=400, Depth="0")
            assert "root:" not in resp.text
            assert "Traceback" not in resp.text
        assert time.monotonic() - started < 1

    def test_a_50_mb_xml_body_is_413(self, dav):
        dav("PROPFIND", "notes", b" " * (50 * 1024 * 1024), status=413, Depth="0")

    @pytest.mark.parametrize(
        ("destination", "status"),
        [
            ("http://elsewhere.example/dav/notes/b.md", 502),
            ("/api/v1/notes/b.md", 403),
            ("/dav/notes/../notes/b.md", 403),
            ("/dav/notes/x%2F..%2F..%2Fb.md", 403),
            ("/dav/../etc/b.md", 403),
            ("/dav/", 403),
            ("", 400),
        ],
    )
    def test_a_destination_elsewhere_is_refused(self, dav, root, destination, status):
        dav("PUT", "notes/a.md", b"a", status=201)
        for method in ("COPY", "MOVE"):
            dav(method, "notes/a.md", status=status, Destination=destination)
        assert (root / "notes/a.md").read_bytes() == b"a"

    def test_move_onto_a_note_with_overwrite_f_is_412_and_t_keeps_the_old_in_the_trash(
        self, client, dav, root
    ):
        dav("PUT", "notes/a.md", b"# A\n", status=201)
        dav("PUT", "notes/b.md", b"# B\n", status=201)
        dav("MOVE", "notes/a.md", status=412, Destination="/dav/notes/b.md", Overwrite="F")
        assert (root / "notes/b.md").read_bytes() == b"# B\n"
        dav("MOVE", "notes/a.md", status=204, Destination="http://localhost:80/dav/notes/b.md")
        assert (root / "notes/b.md").read_bytes() == b"# A\n"
        assert not (root / "notes/a.md").exists()
        assert [i["path"] for i in trash_items(client)] == ["notes/b.md"]
        dav("COPY", "notes/b.md", status=201, Destination="/dav/notes/c.md")
        assert search(client, "A")["total"] == 2

    @pytest.mark.parametrize(
        "path",
        ["attachments/tool.exe", "notes/bad\x01name.md", "notes/\u202eevil.md", "notes/a/../b.md"],
    )
    def test_a_name_the_api_refuses_is_403(self, dav, root, path):
        dav("PUT", path, b"x", status=403)
        assert not list(root.glob("attachments/*"))
        assert not list(root.glob("notes/*"))

    def test_a_lock_keeps_others_out_until_its_token_is_given(self, client, dav, root):
        dav("PUT", "notes/a.md", b"mine", status=201)
        body = (
            b'<?xml version="1.0"?><d:lockinfo xmlns:d="DAV:"><d:lockscope><d:exclusive/>'
            b"</d:lockscope><d:locktype><d:write/></d:locktype><d:owner>ada</d:owner></d:lockinfo>"
        )
        resp = dav("LOCK", "notes/a.md", body, status=200, Timeout="Second-60")
        token = resp.headers["Lock-Token"]
        other = Dav(client, new_grant(client, "write")["key"])
        other("PUT", "notes/a.md", b"theirs", status=423)
        other("DELETE", "notes/a.md", status=423)
        other("MOVE", "notes/a.md", status=423, Destination="/dav/notes/b.md")
        other("LOCK", "notes/a.md", body, status=423)
        other("PUT", "notes/a.md", b"theirs", status=412, If="(<urn:uuid:not-the-token>)")
        other("UNLOCK", "notes/a.md", status=403, Lock_Token=token)
        assert (root / "notes/a.md").read_bytes() == b"mine"
        dav("PUT", "notes/a.md", b"mine, edited", status=204, If=f"({token})")
        dav("UNLOCK", "notes/a.md", status=204, Lock_Token=token)
        other("PUT", "notes/a.md", b"theirs", status=204)

    def test_deleting_a_folder_puts_each_thing_in_the_trash_to_restore(self, client, dav, root):
        dav("MKCOL", "notes/old", status=201)
        dav("MKCOL", "notes/old/deep", status=201)
        dav("PUT", "notes/old/one.md", b"# One\n", status=201)
        dav("PUT", "notes/old/deep/two.md", b"# Two\n", status=201)
        dav("PUT", "notes/old/deep/pic.png", PNG, status=201)
        dav("DELETE", "notes/old", status=204, Depth="infinity")
        assert not (root / "notes/old").exists()
        items = {i["path"]: i for i in trash_items(client)}
        assert set(items) == {"notes/old/one.md", "notes/old/deep/two.md", "notes/old/deep/pic.png"}
        client.post(f"{API}/trash/{items['notes/old/deep/two.md']['id']}/restore")
        assert data(client.get(note_url("notes/old/deep/two.md")))["content"] == "# Two\n"

    def test_a_folder_key_sees_and_writes_its_folder_only(self, client, dav, root):
        put_note(client, "notes/family/list.md", "milk")
        put_note(client, "notes/private/diary.md", "secret")
        mine = Dav(client, new_grant(client, "write", folder="notes/family")["key"])
        assert mine.hrefs("") == ["/dav/", "/dav/notes/", "/dav/attachments/"]
        assert mine.hrefs("notes") == ["/dav/notes/", "/dav/notes/family/"]
        assert "secret" not in mine("PROPFIND", "notes", status=207, Depth="1").text
        mine("GET", "notes/private/diary.md", status=404)
        mine("PROPFIND", "notes/private", status=404, Depth="0")
        mine("PUT", "notes/private/x.md", b"x", status=403)
        mine("PUT", "notes/x.md", b"x", status=403)
        mine("MOVE", "notes/family/list.md", status=403, Destination="/dav/notes/private/l.md")
        mine("COPY", "notes/family/list.md", status=403, Destination="/dav/notes/l.md")
        mine("PUT", "notes/family/new.md", b"bread", status=201)
        assert sorted(p.name for p in (root / "notes/private").iterdir()) == ["diary.md"]
        # a new folder key's folder is not there yet: its first MKCOL makes it
        fresh = Dav(client, new_grant(client, "write", folder="notes/trip")["key"])
        fresh("PUT", "notes/trip/plan.md", b"x", status=409)
        fresh("MKCOL", "notes/trip", status=201)
        fresh("PUT", "notes/trip/plan.md", b"x", status=201)
        fresh("MKCOL", "notes/elsewhere", status=403)

    def test_two_writers_with_one_old_etag_the_second_is_412(self, client, dav, root):
        etag = dav("PUT", "notes/a.md", b"v1", status=201).headers["ETag"]
        dav("PUT", "notes/a.md", b"v2 from the laptop", status=204, If_Match=etag)
        dav("PUT", "notes/a.md", b"v2 from the phone", status=412, If_Match=etag)
        assert (root / "notes/a.md").read_bytes() == b"v2 from the laptop"
        dav("PUT", "notes/a.md", b"again", status=412, If_None_Match="*")

    def test_a_read_key_reads_and_writes_nothing(self, client, dav, root):
        dav("PUT", "notes/a.md", b"a", status=201)
        reader = Dav(client, new_grant(client, "read")["key"])
        assert reader("GET", "notes/a.md", status=200).body == b"a"
        for method in ("PUT", "DELETE", "MKCOL", "PROPPATCH", "LOCK"):
            reader(method, "notes/a.md", status=403)
        reader("MOVE", "notes/a.md", status=403, Destination="/dav/notes/b.md")

    def test_dead_properties_are_kept_moved_and_dropped(self, dav):
        dav("PUT", "notes/a.md", b"a", status=201)
        patch = (
            b'<?xml version="1.0"?><d:propertyupdate xmlns:d="DAV:" xmlns:z="urn:x">'
            b"<d:set><d:prop><z:colour>blue</z:colour></d:prop></d:set></d:propertyupdate>"
        )
        dav("PROPPATCH", "notes/a.md", patch, status=207)
        ask = (
            b'<d:propfind xmlns:d="DAV:" xmlns:z="urn:x"><d:prop><z:colour/></d:prop></d:propfind>'
        )
        dav("MOVE", "notes/a.md", status=201, Destination="/dav/notes/b.md")
        assert ">blue</" in dav("PROPFIND", "notes/b.md", ask, status=207, Depth="0").text
        protected = patch.replace(b"<z:colour>blue</z:colour>", b"<d:getetag>x</d:getetag>")
        assert "403 Forbidden" in dav("PROPPATCH", "notes/b.md", protected, status=207).text
        dav("DELETE", "notes/b.md", status=204)
        dav("PUT", "notes/b.md", b"b", status=201)
        assert "404 Not Found" in dav("PROPFIND", "notes/b.md", ask, status=207, Depth="0").text


LITMUS = shutil.which("litmus")
RCLONE = shutil.which("rclone")
CADAVER = shutil.which("cadaver")


def rclone_env(url: str, key: str, proxy: str = "") -> dict:
    """rclone's WebDAV remote `:webdav:` from the environment (no config file)."""
    obscured = subprocess.run(
        [RCLONE, "obscure", key], capture_output=True, text=True, check=True
    ).stdout.strip()
    env = {
        **os.environ,
        "RCLONE_CONFIG": "/dev/null",
        "RCLONE_WEBDAV_URL": url,
        "RCLONE_WEBDAV_VENDOR": "other",
        "RCLONE_WEBDAV_USER": "rclone",
        "RCLONE_WEBDAV_PASS": obscured,
    }
    for name in ("HTTP_PROXY", "http_proxy", "NO_PROXY", "no_proxy"):
        env.pop(name, None)
    if proxy:  # the relay's per-server origin by its name, through the relay itself
        env["HTTP_PROXY"] = proxy
    return env


def rclone(env: dict, *args: str) -> str:
    done = subprocess.run(
        [RCLONE, "--transfers", "4", "--checkers", "4", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def a_vault(folder: Path, notes: int = 500) -> dict:
    """A vault of real-looking notes in 10 folders, images beside some, its settings folder."""
    files = {}
    for i in range(notes):
        files[f"area {i % 10}/note {i:03}.md"] = (
            f"# Note {i}\n\nMet with team {i % 7} about the plan. [[note {(i + 1) % notes:03}]]\n"
        ).encode()
    for i in range(0, notes, 25):
        files[f"area {i % 10}/photo {i}.png"] = PNG + i.to_bytes(4, "big")
    files[".obsidian/app.json"] = b'{"livePreview": true}'
    for rel, body in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(body)
    return files


class TestDavJudges:
    """/dav/ judged by real clients against a real server: litmus, rclone (also through a
    relay's per-server origin), cadaver."""

    pytestmark = [pytest.mark.real_server, pytest.mark.slow]

    def test_litmus_basic_copymove_props_and_locks_pass(self, tmp_path):
        if not LITMUS:
            pytest.skip("no litmus on this machine (Debian: apt install litmus)")
        with running(tmp_path / "root") as server:
            key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]
            done = subprocess.run(
                [LITMUS, f"{server.url}/dav/notes/", "litmus", key],
                capture_output=True,
                text=True,
                timeout=300,
                cwd=tmp_path,
                env={**os.environ, "TESTS": "basic copymove props locks"},
            )
            assert not any("Traceback" in line for line in server.lines)
        summaries = re.findall(
            r"<- summary for `(\w+)': of (\d+) tests run: (\d+) passed", done.stdout
        )
        assert [s[0] for s in summaries] == ["basic", "copymove", "props", "locks"], done.stdout
        for suite, ran, passed in summaries:
            assert ran == passed, (suite, done.stdout)
        assert done.returncode == 0

    def sync_both_ways(self, tmp_path: Path, root: Path, server: Server, env: dict) -> None:
        """rclone sync of a vault up, edits through the API, sync down, check clean."""
        local = tmp_path / "vault"
        files = a_vault(local)
        owner = {"X-Service-Key": server.key}
        rclone(env, "sync", str(local), ":webdav:notes/vault")
        for rel, body in files.items():
            assert (root / "notes/vault" / rel).read_bytes() == body, rel
        notes = server.request("GET", f"{API}/notes?folder=notes/vault&limit=1000", None, owner)
        assert notes[2]["data"]["total"] == 500  # the notes, not the images or the settings
        # edits elsewhere: through the API
        for i in (3, 4):
            path = urllib.parse.quote(f"notes/vault/area {i}/note {i:03}.md", safe="")
            body = {"content": f"# Note {i}\n\nEdited on the phone, with more words.\n"}
            assert server.request("PUT", f"{API}/notes/{path}", body, owner)[0] == 200
        made = {"path": "notes/vault/area 0/from the phone.md", "content": "# New\n"}
        assert server.request("POST", f"{API}/notes", made, owner)[0] == 201
        gone = urllib.parse.quote("notes/vault/area 1/note 001.md", safe="")
        assert server.request("DELETE", f"{API}/notes/{gone}", None, owner)[0] == 200
        rclone(env, "sync", ":webdav:notes/vault", str(local))
        assert "Edited on the phone" in (local / "area 3/note 003.md").read_text()
        assert (local / "area 0/from the phone.md").read_text() == "# New\n"
        assert not (local / "area 1/note 001.md").exists()
        out = rclone(env, "check", "--download", str(local), ":webdav:notes/vault")
        assert "0 differences found" in out

    def test_rclone_syncs_a_vault_both_ways_and_checks_clean(self, tmp_path):
        if not RCLONE:
            pytest.skip("no rclone on this machine (Debian: apt install rclone)")
        with running(tmp_path / "root") as server:
            server.key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]
            dav = rclone_env(f"{server.url}/dav/", server.key)
            self.sync_both_ways(tmp_path, tmp_path / "root", server, dav)
            assert not any("Traceback" in line for line in server.lines)

    def test_rclone_through_a_relays_per_server_origin(self, tmp_path, origins):
        if not RCLONE:
            pytest.skip("no rclone on this machine (Debian: apt install rclone)")
        relay, server, setup, origin = origins
        server.key = setup["apiKey"]
        # the origin's name resolves nowhere here: rclone asks the relay for it by name, as
        # a proxy (absolute-form requests), and the relay serves that origin
        dav = rclone_env(f"{origin}/dav/", server.key, proxy=relay.url)
        self.sync_both_ways(tmp_path, tmp_path / "srv", server, dav)

    def test_a_file_over_the_json_limit_is_put_whole_and_a_note_is_not(self, tmp_path):
        # waitress refuses large bodies before the app sees them: a file over WebDAV has
        # the attachment limit, a note the body limit
        with running(tmp_path / "root") as server:
            key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]

            def put(path: str, body: bytes) -> int:
                req = urllib.request.Request(
                    f"{server.url}/dav/{path}", body, {"Authorization": basic(key)}, method="PUT"
                )
                try:
                    with urllib.request.urlopen(req, timeout=30) as resp:
                        return resp.status
                except urllib.error.HTTPError as e:
                    return e.code

            big = PNG + bytes(2 * MiB)
            assert put("attachments/big.png", big) == 201
            assert (tmp_path / "root/attachments/big.png").read_bytes() == big
            assert put("notes/big.md", b"x" * (2 * MiB)) == 413

    def test_a_cadaver_session(self, tmp_path):
        if not CADAVER:
            pytest.skip("no cadaver on this machine (Debian: apt install cadaver)")
        local = tmp_path / "shopping.md"
        local.write_text("# Shopping\n\n- oat milk\n")
        script = "\n".join(
            [
                "mkcol lists",
                "cd lists",
                f"put {local} shopping.md",
                "ls",
                "propset shopping.md colour green",
                "propget shopping.md colour",
                "lock shopping.md",
                "unlock shopping.md",
                "move shopping.md groceries.md",
                f"get groceries.md {tmp_path / 'back.md'}",
                "delete groceries.md",
                "ls",
                "quit",
            ]
        )
        with running(tmp_path / "root") as server:
            key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]
            (tmp_path / ".netrc").write_text(f"machine 127.0.0.1 login me password {key}\n")
            (tmp_path / ".netrc").chmod(0o600)
            done = subprocess.run(
                [CADAVER, f"{server.url}/dav/notes/"],
                input=script + "\n",
                capture_output=True,
                text=True,
                timeout=60,
                env={**os.environ, "HOME": str(tmp_path)},
            )
            owner = {"X-Service-Key": key}
            trash = server.request("GET", f"{API}/trash", None, owner)[2]["data"]["items"]
        out = done.stdout
        assert "shopping.md" in out, out
        assert "succeeded" in out, out
        assert "green" in out, out
        assert "failed" not in out.lower(), out
        assert (tmp_path / "back.md").read_text() == "# Shopping\n\n- oat milk\n"
        assert [i["path"] for i in trash] == ["notes/lists/groceries.md"]


LOCKINFO = (
    b'<?xml version="1.0"?><d:lockinfo xmlns:d="DAV:"><d:lockscope><d:exclusive/>'
    b"</d:lockscope><d:locktype><d:write/></d:locktype><d:owner>ada</d:owner></d:lockinfo>"
)


class TestDavMisuse:
    """What an attack run against /dav/ found, each tried again."""

    def test_a_dtd_in_utf_16_is_refused_too(self, dav, root):
        dav("PUT", "notes/a.md", b"a", status=201)
        body = (
            '<?xml version="1.0" encoding="UTF-16"?><!DOCTYPE d [<!ENTITY e "'
            + "x" * 1000
            + '">]><d:propertyupdate xmlns:d="DAV:" xmlns:z="urn:z"><d:set><d:prop>'
            "<z:big>&e;&e;&e;</z:big></d:prop></d:set></d:propertyupdate>"
        ).encode("utf-16")
        dav("PROPPATCH", "notes/a.md", body, status=400)
        assert not (root / ".notesvc/dav-properties.json").exists()

    def test_deep_xml_is_400_and_a_lock_leaves_nothing_behind(self, dav, root):
        deep = b"<x>" * 5000 + b"</x>" * 5000
        patch = b'<d:propertyupdate xmlns:d="DAV:"><d:set><d:prop>' + deep
        patch += b"</d:prop></d:set></d:propertyupdate>"
        dav("PUT", "notes/a.md", b"a", status=201)
        dav("PROPPATCH", "notes/a.md", patch, status=400)
        lock = LOCKINFO.replace(b"ada", deep)
        dav("LOCK", "notes/new.md", lock, status=400)
        assert not (root / "notes/new.md").exists()

    def test_dead_properties_are_bounded(self, dav):
        dav("PUT", "notes/a.md", b"a", status=201)
        big = b"x" * (70 * 1024)
        patch = (
            b'<d:propertyupdate xmlns:d="DAV:" xmlns:z="urn:z"><d:set><d:prop><z:big>'
            + big
            + b"</z:big></d:prop></d:set></d:propertyupdate>"
        )
        dav("PROPPATCH", "notes/a.md", patch, status=507)

    def test_a_lock_token_counts_for_the_key_that_took_the_lock(self, client, dav, root):
        dav("PUT", "notes/a.md", b"mine", status=201)
        token = dav("LOCK", "notes/a.md", LOCKINFO, status=200).headers["Lock-Token"]
        other = Dav(client, new_grant(client, "write")["key"])
        assert token.strip("<>") in other("PROPFIND", "notes/a.md", status=207, Depth="0").text
        other("PUT", "notes/a.md", b"hijack", status=423, If=f"({token})")
        other("DELETE", "notes/a.md", status=423, If=f"({token})")
        other("LOCK", "notes/a.md", b"", status=412, If=f"({token})")  # no refresh either
        assert (root / "notes/a.md").read_bytes() == b"mine"

    def test_one_key_cannot_hold_every_lock_and_the_owner_ends_any(self, client, dav):
        grant = new_grant(client, "write")
        other = Dav(client, grant["key"])
        for i in range(notesvc.DAV_LOCKS_PER_KEY):
            other("PUT", f"notes/f{i}.md", b"x", status=201)
            other("LOCK", f"notes/f{i}.md", LOCKINFO, status=200)
        other("PUT", "notes/one-more.md", b"x", status=201)
        other("LOCK", "notes/one-more.md", LOCKINFO, status=507)
        dav("LOCK", "notes/one-more.md", LOCKINFO, status=200)  # others still lock
        held = other("PROPFIND", "notes/f0.md", status=207, Depth="0").text
        token = re.search(r"urn:uuid:[0-9a-f-]+", held).group(0)
        dav("UNLOCK", "notes/f0.md", status=204, Lock_Token=f"<{token}>")  # the owner may
        dav("PUT", "notes/f0.md", b"owner's", status=204)
        client.delete(f"{API}/auth/keys/{grant['id']}")  # a revoked key's locks end with it
        dav("PUT", "notes/f1.md", b"owner's", status=204)

    def test_copy_or_move_onto_the_folder_holding_it_is_refused(self, client, dav, root):
        dav("MKCOL", "notes/t", status=201)
        dav("MKCOL", "notes/t/sub", status=201)
        dav("PUT", "notes/t/other.md", b"other", status=201)
        dav("PUT", "notes/t/sub/s.md", b"s", status=201)
        dav("COPY", "notes/t/other.md", status=403, Destination="/dav/notes/t")
        dav("MOVE", "notes/t/sub", status=403, Destination="/dav/notes/t")
        assert (root / "notes/t/other.md").read_bytes() == b"other"
        assert (root / "notes/t/sub/s.md").read_bytes() == b"s"
        assert trash_items(client) == []

    def test_a_refused_copy_leaves_the_destination_as_it_was(self, client, dav, root):
        dav("PUT", "notes/keep.md", b"important", status=201)
        dav("PUT", "notes/blob.bin", b"\xff\xfe not text", status=201)
        dav("COPY", "notes/blob.bin", status=415, Destination="/dav/notes/keep.md")
        dav("PUT", "attachments/z.png", PNG, status=201)
        dav("COPY", "notes/blob.bin", status=403, Destination="/dav/attachments/z.exe")
        dav("MOVE", "attachments/z.png", status=403, Destination="/dav/attachments/z.exe")
        assert (root / "notes/keep.md").read_bytes() == b"important"
        assert (root / "attachments/z.png").read_bytes() == PNG
        assert trash_items(client) == []

    def test_odd_names_on_disk_stay_out_of_listings(self, dav, root):
        (root / "notes/weird").mkdir(parents=True)
        (root / "notes/weird/fine.md").write_text("fine")
        os.close(
            os.open(
                os.path.join(str(root / "notes/weird").encode(), b"bad\xff.md"),
                os.O_CREAT | os.O_WRONLY,
            )
        )
        (root / "notes/weird/ctl\x01x.md").write_text("x")
        resp = dav("PROPFIND", "notes/weird", status=207, Depth="1")
        import xml.etree.ElementTree as ET

        ET.fromstring(resp.body)  # noqa: S314 - our own answer: well formed
        assert dav.hrefs("notes/weird") == ["/dav/notes/weird/", "/dav/notes/weird/fine.md"]

    def test_the_if_header_says_nothing_of_notes_a_key_cannot_see(self, client, dav):
        put_note(client, "notes/work/secret.md", "the plan")
        put_note(client, "notes/family/a.md", "a")
        etag = data(client.get(note_url("notes/work/secret.md")))["etag"]
        mine = Dav(client, new_grant(client, "write", folder="notes/family")["key"])
        guess = f'<http://localhost/dav/notes/work/secret.md> (["{etag.strip(chr(34))}"])'
        wrong = '<http://localhost/dav/notes/work/secret.md> (["0"])'
        for header in (guess, wrong):  # the same answer, right guess or wrong
            mine("PROPFIND", "notes/family", status=412, Depth="0", If=header)

    def test_a_deleted_or_moved_resource_takes_its_locks_along(self, client, dav):
        other = Dav(client, new_grant(client, "write")["key"])
        for verb, extra in (("DELETE", {}), ("MOVE", {"Destination": "/dav/notes/b.md"})):
            dav("PUT", "notes/a.md", b"a", status=201)
            token = dav("LOCK", "notes/a.md", LOCKINFO, status=200).headers["Lock-Token"]
            dav(verb, "notes/a.md", status=201 if verb == "MOVE" else 204, If=f"({token})", **extra)
            other("PUT", "notes/a.md", b"free again", status=201)  # no lock is left behind
            other("DELETE", "notes/a.md", status=204)

    def test_files_in_a_folder_named_in_nfd_are_written_in_place(self, client, dav, root):
        nfd = unicodedata.normalize("NFD", "Café")
        (root / "notes" / nfd).mkdir(parents=True)
        (root / "notes" / nfd / "photo.png").write_bytes(PNG)
        dav("PUT", "notes/Café/photo.png", PNG + b"new", status=204)
        assert os.listdir(root / "notes") == [nfd]  # no second, NFC folder beside it
        assert (root / "notes" / nfd / "photo.png").read_bytes() == PNG + b"new"
        got = client.get(
            f"{API}/attachments/" + urllib.parse.quote("notes/Café/photo.png", safe="")
        )
        assert got.body == PNG + b"new"
        dav("DELETE", "notes/Café/photo.png", status=204)

    def test_a_broken_absolute_form_request_line_is_400(self):
        for line in (
            b"GET http://[::1/x HTTP/1.1",
            b"GET http:///x HTTP/1.1",
            b"GET http://u@h/x HTTP/1.1",
        ):
            with pytest.raises(notesvc._Refuse):
                notesvc.parse_request_head(line + b"\r\nHost: a\r\n\r\n", "127.0.0.1")
        method, path, *_ = notesvc.parse_request_head(
            b"PROPFIND http://abc.relay.test:8/dav/notes/ HTTP/1.1\r\nHost: x\r\n\r\n", "127.0.0.1"
        )
        assert (method, path) == ("PROPFIND", "/dav/notes/")


# -- import and export (CONTRACT 26) -----------------------------------------------------------

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


def enex_export() -> bytes:
    b64 = base64.b64encode(TINY_PNG).decode()
    wrapped = "\n".join(b64[i : i + 40] for i in range(0, len(b64), 40))
    return (
        ENEX_TEMPLATE.replace(
            "{md5}", hashlib.md5(TINY_PNG, usedforsecurity=False).hexdigest()
        ).replace("{b64}", wrapped)
    ).encode()


NOTION_ID = "0123456789abcdef0123456789abcdef"
NOTION_SUB = "fedcba9876543210fedcba9876543210"
NOTION_DB = "11112222333344445555666677778888"
NOTION_EXPORT = {
    f"Projects {NOTION_ID}.md": (
        "# Projects\n\nSee [Roadmap](Projects%20"
        f"{NOTION_ID}/Roadmap%20{NOTION_SUB}.md) and the "
        f"[tasks](Projects%20{NOTION_ID}/Tasks%20{NOTION_DB}.csv).\n\n"
        f"![diagram](Projects%20{NOTION_ID}/diagram.png)\n"
    ),
    f"Projects {NOTION_ID}/Roadmap {NOTION_SUB}.md": "# Roadmap\n\nQ1: ship\n",
    f"Projects {NOTION_ID}/diagram.png": TINY_PNG,
    f"Projects {NOTION_ID}/Tasks {NOTION_DB}.csv": (
        "\ufeffName,Status,Due\nWrite,Done,2024-01-02\nTest|it,Doing,\n"
    ),
    f"Projects {NOTION_ID}/Tasks {NOTION_DB}_all.csv": "Name,Status,Due\nWrite,Done,2024-01-02\n",
}

OBSIDIAN_VAULT = {
    ".obsidian/app.json": "{}",
    ".obsidian/workspace.json": "{}",
    "Daily/2024-01-01.md": "# Monday\n\nIdeas: [[Ideas]], [[Ideas|my ideas]] and ![[pic.png]]\n"
    "[rel](../Ideas.md)\n",
    "Ideas.md": "# Ideas\n\n- a garden\n",
    "assets/pic.png": TINY_PNG,
    "plain.txt": "just text\n",
    "tool.exe": b"MZ\x00\x00",
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


def note_text(root: Path, path: str) -> str:
    return (root / path).read_text("utf-8")


def all_files(root: Path) -> dict:
    found = {}
    for top in ("notes", "attachments"):
        for p in sorted((root / top).rglob("*")):
            if p.is_file() and not any(s.startswith(".") for s in p.relative_to(root).parts):
                found[p.relative_to(root).as_posix()] = p.read_bytes()
    return found


class TestImport:
    """POST /import: each source's notes as Markdown, never over anything, refusals first."""

    def test_keep_takeout(self, client, root):
        report = import_file(client, zip_of(KEEP_TAKEOUT), "takeout-20231105.zip")
        assert report["into"] == "notes/imported/keep"
        assert report["kind"] == "keep"
        assert (report["created"], report["attachments"], report["renamed"]) == (3, 1, 0)
        reasons = {s["source"]: s["reason"] for s in report["skipped"]}
        assert reasons["Takeout/Keep/Old.json"] == "in Keep's trash"
        assert reasons["Takeout/Keep/Broken.json"].startswith("not valid JSON")
        groceries = note_text(root, "notes/imported/keep/Groceries.md")
        assert groceries == (
            '---\ntags: ["Shopping"]\ncreated: "2023-07-22T04:26:40.000Z"\n'
            'updated: "2023-11-14T22:13:20.000Z"\npinned: true\ncolor: "yellow"\n'
            'source: "Google Keep"\n---\n# Groceries\n\n- [ ] Milk\n- [x] Eggs\n'
        )
        trip = note_text(root, "notes/imported/keep/Lisbon trip.md")
        assert "archived: true" in trip
        assert "Tram 28 early.\nPastéis de Belém!" in trip
        assert "![1a2b3c4d.png](../../../attachments/imported/keep/1a2b3c4d.png)" in trip
        assert "- [Tram 28](https://example.org/28)" in trip
        assert (root / "attachments/imported/keep/1a2b3c4d.png").read_bytes() == TINY_PNG
        assert note_text(root, "notes/imported/keep/Call the plumber.md").endswith(
            "---\nCall the plumber\n"
        )
        assert search(client, "plumber")["results"][0]["path"].endswith("Call the plumber.md")
        kinds = [c["kind"] for c in feed(client)["changes"]]
        assert kinds.count("created") == 3

    def test_a_dry_run_reports_the_same_and_writes_nothing(self, client, root):
        body = zip_of(KEEP_TAKEOUT)
        dry = import_file(client, body, "takeout.zip", status=200, dryRun=True)
        assert dry["dryRun"] is True
        assert not (root / "notes/imported").exists()
        assert not (root / "attachments/imported").exists()
        assert feed(client)["changes"] == []
        real = import_file(client, body, "takeout.zip")
        assert {**dry, "dryRun": False} == real

    def test_never_overwrites_a_taken_name(self, client, root):
        client.post_json(
            f"{API}/notes", {"path": "notes/imported/keep/Groceries.md", "content": "mine\n"}
        )
        report = import_file(client, zip_of(KEEP_TAKEOUT), "takeout.zip")
        assert report["renamed"] == 1
        assert note_text(root, "notes/imported/keep/Groceries.md") == "mine\n"
        assert "- [x] Eggs" in note_text(root, "notes/imported/keep/Groceries 2.md")
        again = import_file(client, zip_of(KEEP_TAKEOUT), "takeout.zip")
        assert again["renamed"] == 4  # three notes and the picture, each once more
        assert (root / "attachments/imported/keep/1a2b3c4d 2.png").read_bytes() == TINY_PNG
        trip = note_text(root, "notes/imported/keep/Lisbon trip 2.md")
        assert "(../../../attachments/imported/keep/1a2b3c4d%202.png)" in trip

    def test_evernote_enex(self, client, root):
        report = import_file(client, enex_export(), "My Notes.enex", into="notes/from evernote")
        assert (report["created"], report["attachments"], report["kind"]) == (2, 1, "evernote")
        text = note_text(root, "notes/from evernote/Recipe & notes 2.md")
        assert text.startswith(
            '---\ntags: ["cooking", "family"]\ncreated: "2020-01-02T03:04:05.000Z"\n'
            'updated: "2023-11-04T10:10:10.000Z"\nsource_url: "https://example.org/pie"\n'
            'author: "Ann"\nsource: "Evernote"\n---\n# Recipe & notes 2\n\n## Apple pie\n'
        )
        assert "**Bake** at 180°C, see [the site](https://example.org/pie)." in text
        assert "- [x] Buy apples\n- [ ] Buy butter\n" in text
        assert "- flour\n- sugar\n" in text
        assert "| Step | Minutes |\n| --- | --- |\n| Bake | 45 |" in text
        assert "![pie.png](../../attachments/from%20evernote/pie.png)" in text
        assert "```\nx = 1\ny = 2\n```" in text
        assert (root / "attachments/from evernote/pie.png").read_bytes() == TINY_PNG
        assert note_text(root, "notes/from evernote/Second.md").endswith("# Second\n\nJust text\n")

    def test_enex_entities_and_dtds(self, client, root):
        bomb = (
            '<?xml version="1.0"?><!DOCTYPE en-export [<!ENTITY a "aaaaaaaaaa">'
            '<!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;">]><en-export><note><title>&b;</title>'
            "<content><![CDATA[<en-note>x</en-note>]]></content></note></en-export>"
        )
        resp = import_file(client, bomb.encode(), "bomb.enex", status=400)
        assert "DTD" in resp["error"]["message"]
        assert "nothing was imported" in resp["error"]["message"]
        external = (
            '<?xml version="1.0"?><!DOCTYPE en-export SYSTEM "http://127.0.0.1:9/x.dtd">'
            "<en-export><note><title>caf&eacute; &unknownthing;</title><content><![CDATA["
            "<en-note>&lt;b&gt; &hearts;</en-note>]]></content></note></en-export>"
        )
        report = import_file(client, external.encode(), "ext.enex")
        assert report["created"] == 1
        assert "café" in note_text(root, "notes/imported/evernote/café.md")
        broken = b'<?xml version="1.0"?><en-export><note><title>x</title></en-export'
        resp = import_file(client, broken, "broken.enex", status=400)
        assert "not well-formed" in resp["error"]["message"]
        assert not (root / "notes/imported/evernote/x.md").exists()

    def test_notion_export(self, client, root):
        report = import_file(client, zip_of(NOTION_EXPORT), "Export-1234.zip")
        assert report["kind"] == "notion"
        assert (report["created"], report["attachments"]) == (3, 1)
        base = "notes/imported/notion"
        projects = note_text(root, f"{base}/Projects.md")
        assert "[Roadmap](Projects/Roadmap.md)" in projects
        assert "[tasks](Projects/Tasks.md)" in projects
        assert "![diagram](../../../attachments/imported/notion/Projects/diagram.png)" in projects
        assert note_text(root, f"{base}/Projects/Tasks.md") == (
            "# Tasks\n\n| Name | Status | Due |\n| --- | --- | --- |\n"
            "| Write | Done | 2024-01-02 |\n| Test\\|it | Doing |  |\n"
        )
        assert not (root / f"{base}/Projects/Tasks_all.md").exists()

    def test_obsidian_vault(self, client, root):
        client.post_json(
            f"{API}/notes", {"path": "notes/imported/obsidian/Ideas.md", "content": "x\n"}
        )
        report = import_file(client, zip_of(OBSIDIAN_VAULT), "vault.zip")
        assert report["kind"] == "obsidian"
        assert report["renamed"] == 1
        assert (report["created"], report["attachments"]) == (3, 1)
        assert {s["source"] for s in report["skipped"]} == {"tool.exe"}
        base = "notes/imported/obsidian"
        daily = note_text(root, f"{base}/Daily/2024-01-01.md")
        assert "[[Ideas 2|Ideas]], [[Ideas 2|my ideas]] and ![[pic.png]]" in daily
        assert "[rel](../Ideas%202.md)" in daily
        assert note_text(root, f"{base}/Ideas 2.md") == "# Ideas\n\n- a garden\n"
        assert note_text(root, f"{base}/plain.md") == "just text\n"
        assert (root / "attachments/imported/obsidian/assets/pic.png").read_bytes() == TINY_PNG

    def test_joplin_jex(self, client, root):
        report = import_file(client, tar_of(JOPLIN_JEX), "export.jex")
        assert report["kind"] == "joplin"
        assert (report["created"], report["attachments"], report["skipped"]) == (2, 1, [])
        meeting = note_text(root, "notes/imported/joplin/Work/Meeting.md")
        assert 'tags: ["urgent"]' in meeting
        assert 'created: "2022-03-04T05:06:07.000Z"' in meeting
        assert (
            "# Meeting\n\nAgenda\n\n![chart](../../../../attachments/imported/joplin/chart.png)"
            in meeting
        )
        todo = note_text(root, "notes/imported/joplin/File taxes.md")
        assert "- [x] File taxes" in todo

    def test_names_that_are_not_paths(self, client, root):
        files = {
            "CON.md": "reserved\n",
            "a\x07b?.md": "control\n",
            ("x" * 300) + ".md": "long\n",
            "same.md": "one\n",
            "Same.md": "two\n",
        }
        report = import_file(client, zip_of(files), "files.zip", into="notes/odd")
        assert report["kind"] == "files"
        assert report["created"] == 5
        names = sorted(p.name for p in (root / "notes/odd").iterdir())
        assert "CON_.md" in names
        assert "a b.md" in names
        assert "same.md" in names
        assert "Same 2.md" in names  # one name on a case-blind disk (Finder, Windows)
        assert any(len(n.encode()) <= 255 and n.startswith("xxxx") for n in names)

    def test_a_notesvc_export_comes_back_byte_for_byte(self, client, root, make_app, tmp_path):
        client.post_json(f"{API}/notes", {"path": "notes/a/b.md", "content": "# B\r\n\r\ncrlf\r\n"})
        client.post_json(f"{API}/notes", {"path": "notes/ünï/ç.md", "content": "\ufeffbom\n"})
        client.put(f"{API}/attachments/attachments/pics/p.png", TINY_PNG, content_type="image/png")
        (root / "notes/a/side.png").write_bytes(TINY_PNG)
        (root / "notes/.hidden.md").write_text("secret\n")
        resp = client.get(f"{API}/export.zip")
        assert resp.content_type == "application/zip"
        assert "attachment" in resp.headers["Content-Disposition"]
        import zipfile

        zf = zipfile.ZipFile(io.BytesIO(resp.body))
        names = zf.namelist()
        assert "notesvc-export.json" in names
        assert "notes/.hidden.md" not in names
        manifest = json.loads(zf.read("notesvc-export.json"))
        assert (manifest["notes"], manifest["files"]) == (2, 2)
        other = with_key(make_app(tmp_path / "other"))
        report = import_file(other, resp.body, "export.zip")
        assert report["kind"] == "notesvc"
        assert report["renamed"] == 0
        before = {k: v for k, v in all_files(root).items()}
        assert all_files(tmp_path / "other") == before

    def test_a_folder_grant_imports_and_exports_its_folder_only(self, client, anon, root):
        client.post_json(f"{API}/notes", {"path": "notes/other/x.md", "content": "not yours\n"})
        rec = new_grant(client, "write", "notes/family")
        family = as_key(anon, rec["key"])
        report = import_file(family, zip_of(KEEP_TAKEOUT), "takeout.zip")
        assert report["into"] == "notes/family/imported/keep"
        assert (root / "attachments/family/imported/keep/1a2b3c4d.png").is_file()
        resp = import_file(family, zip_of(KEEP_TAKEOUT), "t.zip", status=404, into="notes/other")
        assert resp["error"]["code"] == "NOT_FOUND"
        import zipfile

        exported = zipfile.ZipFile(io.BytesIO(family.get(f"{API}/export.zip").body)).namelist()
        assert "notes/other/x.md" not in exported
        assert "notes/family/imported/keep/Groceries.md" in exported
        # a notesvc export with notes outside the folder: those are skipped
        everything = client.get(f"{API}/export.zip").body
        report = import_file(family, everything, "all.zip")
        assert "notes/other/x.md" in {s["source"] for s in report["skipped"]}
        reader = as_key(anon, new_grant(client, "read")["key"])
        import_file(reader, zip_of(KEEP_TAKEOUT), "t.zip", status=403)

    @pytest.mark.parametrize(
        "name",
        ["../evil.md", "/etc/evil.md", "C:/evil.md", "a/../../evil.md", "..\\evil.md"],
    )
    def test_zip_slip_is_refused_whole(self, client, root, name):
        body = zip_of({"good.md": "fine\n", name: "evil\n"})
        resp = import_file(client, body, "slip.zip", status=400)
        assert "outside itself" in resp["error"]["message"]
        assert not (root / "notes/imported").exists()
        assert not (root.parent / "evil.md").exists()

    def test_links_in_archives_are_refused(self, client, root):
        resp = import_file(
            client, zip_of({"a.md": "x\n"}, {"link.md": "/etc/passwd"}), "l.zip", status=400
        )
        assert "symbolic link" in resp["error"]["message"]
        resp = import_file(
            client, tar_of(JOPLIN_JEX, {"evil.md": "/etc/passwd"}), "l.jex", status=400
        )
        assert "link" in resp["error"]["message"]
        assert not (root / "notes/imported").exists()

    def test_zip_bombs_are_refused(self, client, make_app, tmp_path):
        bomb = zip_of({"a.md": "fine\n", "zeros.md": b"\0" * (8 << 20)})
        resp = import_file(client, bomb, "bomb.zip", status=413)
        assert "100 times" in resp["error"]["message"]
        small = with_key(make_app(SERVICE_MAX_IMPORT_EXPANDED_BYTES="4096"))
        body = zip_of({f"n{i}.md": os.urandom(1000).hex() for i in range(5)})
        resp = import_file(small, body, "big.zip", status=413)
        assert "SERVICE_MAX_IMPORT_EXPANDED_BYTES" in resp["error"]["message"]

    def test_an_upload_over_the_limit(self, make_app):
        small = with_key(make_app(SERVICE_MAX_IMPORT_BYTES="2048"))
        resp = import_file(small, os.urandom(4096), "x.zip", status=413)
        assert resp["error"]["code"] == "PAYLOAD_TOO_LARGE"
        resp = small.post(
            f"{API}/import", os.urandom(4096), content_type="application/zip", status=413
        )
        assert "SERVICE_MAX_IMPORT_BYTES" in resp.json["error"]["message"]

    def test_bad_input(self, client, root):
        assert import_file(client, b"hello", "x.exe", status=415)["error"]["code"] == (
            "UNSUPPORTED_MEDIA_TYPE"
        )
        resp = client.post(f"{API}/import", b"x", content_type="image/png", status=415)
        assert_error(resp, 415, "UNSUPPORTED_MEDIA_TYPE")
        resp = import_file(client, b"PK\x03\x04broken", "x.zip", status=400)
        assert "not a readable zip" in resp["error"]["message"]
        form, ctype = multipart(("into", "notes/x"))
        resp = client.request(
            f"{API}/import", method="POST", body=form, headers={"Content-Type": ctype}, status=400
        )
        assert "file" in resp.json["error"]["message"]
        resp = import_file(client, zip_of({"a.md": "x"}), "a.zip", status=400, dryRun="maybe")
        assert "dryRun" in resp["error"]["message"]
        resp = import_file(client, zip_of({"a.md": "x"}), "a.zip", status=400, into="notes/../x")
        resp = client.post(
            f"{API}/import?into=notes/raw",
            zip_of({"r.md": "raw\n"}),
            content_type="application/zip",
            status=201,
        )
        assert data(resp)["into"] == "notes/raw"
        assert (root / "notes/raw/r.md").read_text() == "raw\n"
        resp = client.post(
            f"{API}/import", enex_export(), content_type="application/xml", status=201
        )
        assert data(resp)["kind"] == "evernote"
        resp = client.post(
            f"{API}/import", tar_of(JOPLIN_JEX), content_type="application/x-tar", status=201
        )
        assert data(resp)["kind"] == "joplin"


ENEX_TEMPLATE = """<?xml version="1.0" encoding="UTF-8"?>
<!DOCTYPE en-export SYSTEM "http://xml.evernote.com/pub/evernote-export4.dtd">
<en-export export-date="20231105T101010Z" application="Evernote" version="10.63.2">
  <note>
    <title>Recipe &amp; notes&nbsp;2</title>
    <created>20200102T030405Z</created>
    <updated>20231104T101010Z</updated>
    <tag>cooking</tag><tag>family</tag>
    <note-attributes><author>Ann</author><source-url>https://example.org/pie</source-url></note-attributes>
    <content><![CDATA[<?xml version="1.0" encoding="UTF-8"?>
<!DOCTYPE en-note SYSTEM "http://xml.evernote.com/pub/enml2.dtd">
<en-note><h2>Apple pie</h2><div><b>Bake</b> at 180&deg;C, see
<a href="https://example.org/pie">the site</a>.</div>
<div><en-todo checked="true"/>Buy apples</div><div><en-todo checked="false"/>Buy butter</div>
<ul><li>flour</li><li>sugar</li></ul>
<table><tr><td>Step</td><td>Minutes</td></tr><tr><td>Bake</td><td>45</td></tr></table>
<div><en-media hash="{md5}" type="image/png"/></div>
<div style="-en-codeblock:true"><div>x = 1</div><div>y = 2</div></div>
</en-note>]]></content>
    <resource>
      <data encoding="base64">
{b64}
      </data>
      <mime>image/png</mime>
      <resource-attributes><file-name>pie.png</file-name></resource-attributes>
    </resource>
  </note>
  <note>
    <title>Second</title>
    <created>20210101T000000Z</created>
    <content><![CDATA[<en-note><div>Just text</div></en-note>]]></content>
  </note>
</en-export>
"""


@pytest.mark.real_server
@pytest.mark.slow
class TestImportCommand:
    """`notesvc import` / `export`: on their own, and handing the import to a running server."""

    def test_on_its_own_the_dry_run_and_the_real_run_agree(self, tmp_path):
        vault = tmp_path / "vault"
        for name, body in OBSIDIAN_VAULT.items():
            (vault / name).parent.mkdir(parents=True, exist_ok=True)
            (vault / name).write_bytes(body if isinstance(body, bytes) else body.encode())
        (vault / "link.md").symlink_to("/etc/passwd")
        root = tmp_path / "root"
        dry = run_cli("import", str(vault), "--root", str(root), "--dry-run")
        assert dry.returncode == 0, dry.stderr
        assert "Dry run: would create 3 notes and 1 files in notes/imported/obsidian" in dry.stdout
        assert "skipped link.md: a symbolic link (not followed)" in dry.stdout
        assert not (root / "notes/imported").exists()
        real = run_cli("import", str(vault), "--root", str(root))
        assert real.returncode == 0, real.stderr
        assert real.stdout.splitlines()[0] == dry.stdout.splitlines()[0].replace(
            "Dry run: would create", "created"
        )
        assert (root / "notes/imported/obsidian/Ideas.md").read_text() == "# Ideas\n\n- a garden\n"
        out = tmp_path / "all.zip"
        done = run_cli("export", str(out), "--root", str(root))
        assert done.returncode == 0, done.stderr
        assert "Exported 3 notes and 1 files" in done.stdout
        again = run_cli("export", str(out), "--root", str(root))
        assert again.returncode == 2
        assert "exists already" in again.stderr
        missing = run_cli("import", str(tmp_path / "nothing"), "--root", str(root))
        assert missing.returncode == 2
        assert "no file or folder" in missing.stderr
        slip = tmp_path / "slip.zip"
        slip.write_bytes(zip_of({"../evil.md": "x"}))
        refused = run_cli("import", str(slip), "--root", str(root))
        assert refused.returncode == 2
        assert "outside itself" in refused.stderr

    def test_a_running_server_does_the_import(self, tmp_path):
        root = tmp_path / "root"
        takeout = tmp_path / "takeout.zip"
        takeout.write_bytes(zip_of(KEEP_TAKEOUT))
        with running(root) as server:
            key = json.loads((root / ".notesvc/state.json").read_text())["apiKey"]
            owner = {"X-Service-Key": key}
            out = run_cli("import", str(takeout), "--root", str(root), "--into", "notes/keep")
            assert out.returncode == 0, out.stderr
            assert "it does the import" in out.stderr
            assert out.stdout.startswith("created 3 notes and 1 files in notes/keep")
            status, _, body = server.request("GET", f"{API}/search?q=plumber", headers=owner)
            assert status == 200
            assert body["data"]["results"][0]["path"].startswith("notes/keep/")
            status, _, body = server.request("GET", f"{API}/changes", headers=owner)
            assert [c["kind"] for c in body["data"]["changes"]].count("created") == 3
            status, _, body = server.request("GET", f"{API}/auth/keys", headers=owner)
            assert body["data"]["keys"] == []  # the key made for the import is gone
            dry = run_cli("import", str(takeout), "--root", str(root), "--dry-run")
            assert dry.returncode == 0
            assert dry.stdout.startswith("Dry run: would create 3")
            export = tmp_path / "out.zip"
            done = run_cli("export", str(export), "--root", str(root))
            assert done.returncode == 0, done.stderr
            import zipfile

            names = zipfile.ZipFile(export).namelist()
            assert "notes/keep/Groceries.md" in names
            assert "notesvc-export.json" in names


class TestImportInChromium:
    """The menu's Import (choose, see the dry run, confirm) and Export, on a phone."""

    pytestmark = BROWSER_TESTS

    def test_import_a_takeout_then_export_everything(self, web, tmp_path):
        s = web("phone")
        page = s.page
        takeout = tmp_path / "takeout-2023.zip"
        takeout.write_bytes(zip_of(KEEP_TAKEOUT))
        page.click("#menu summary")
        page.click("#menu-import")
        page.set_input_files("#import-file", str(takeout))
        s.dialog_choose("check")
        expect(page.locator("#import-summary")).to_have_text(
            "Would bring in 3 notes and 1 file into notes/imported/keep."
        )
        expect(page.locator("#import-skipped")).to_contain_text("in Keep's trash")
        s.shot("import-dry-run")
        assert not (web.root / "notes/imported").exists()
        s.dialog_choose("import")
        expect(page.locator("#import-summary")).to_have_text(
            "Brought in 3 notes and 1 file into notes/imported/keep."
        )
        s.shot("import-done")
        s.dialog_choose("ok")
        assert "- [x] Eggs" in (web.root / "notes/imported/keep/Groceries.md").read_text()
        expect(page.locator("#tree")).to_contain_text("imported")
        page.click("#menu summary")
        with page.expect_download() as got:
            page.click("#menu-export")
        path = tmp_path / "export.zip"
        got.value.save_as(path)
        expect(page.locator("#export-progress")).to_contain_text("Saved")
        import zipfile

        names = zipfile.ZipFile(path).namelist()
        assert "notes/imported/keep/Groceries.md" in names
        assert "attachments/imported/keep/1a2b3c4d.png" in names
        assert s.errors == []


class TestFolderCounts:
    def test_counts_follow_single_changes_and_match_a_recount(self):
        index = notesvc.SearchIndex()
        for i in range(30):
            index.add(f"notes/a/b{i % 3}/n{i}.md", f"note {i}", 6, i)
        counts = dict(index.folder_counts())
        assert counts["notes"] == 30
        assert counts["notes/a"] == 30
        assert counts["notes/a/b1"] == 10
        index.add("notes/a/b1/n1.md", "changed", 7, 99)  # an update: no new note
        index.add("notes/c/new.md", "new", 3, 1)
        index.remove("notes/a/b2/n2.md")
        index.move("notes/a/b0/n0.md", "notes/c/n0.md", 6, 1)  # not readable: removed only
        kept = dict(index.folder_counts())
        index._folder_counts = (-1, None)  # counted again from the index
        assert {k: v for k, v in kept.items() if v} == dict(index.folder_counts())
        assert kept["notes/c"] == 1
        assert kept["notes/a/b2"] == 9
        assert kept["notes"] == 29


class TestWords:
    def test_underscores_separate_words_and_snippets_stay_on_them(self, client):
        body = (
            "# C locale\n\n"
            + "filler words here " * 40
            + "call nl_langinfo(CODESET) then gain_analysis\n"
        )
        client.post_json(f"{API}/notes", {"path": "notes/c.md", "content": body})
        hit = search(client, "langinfo")["results"][0]
        assert hit["path"] == "notes/c.md"
        assert "nl_langinfo" in hit["snippet"]
        assert search(client, '"nl langinfo"')["results"][0]["path"] == "notes/c.md"
        assert search(client, "gain")["results"][0]["path"] == "notes/c.md"

    def test_porter2_folds_what_people_type(self, client):
        client.post_json(
            f"{API}/notes", {"path": "notes/i.md", "content": "# Memo\n\nWe informed them.\n"}
        )
        for q in ("informing", "information", "inform", "INFORMED"):
            assert [r["path"] for r in search(client, q)["results"]] == ["notes/i.md"], q


class TestHeadStore:
    """The history's copies of the notes as last seen: one compressed SQLite file."""

    def test_an_older_historys_copies_move_into_one_file(self, make_app, root):
        path, old = "notes/a/plan.md", b"# Plan\n\nthe text before\n"
        (root / "notes/a").mkdir(parents=True)
        (root / path).write_bytes(old)
        history = root / ".notesvc/history"
        folder = history / hashlib.sha256(path.encode()).hexdigest()[:32]
        folder.mkdir(parents=True)
        etag = notesvc.make_etag(old)[1:-1]
        (folder / "head").write_bytes(f"{etag} {path}\n".encode() + old)
        (root / path).write_bytes(b"# Plan\n\nchanged by another program\n")
        client = with_key(make_app())  # its first check finds the outside edit
        svc = client.app.service
        assert not (folder / "head").exists()
        assert (history / "heads.db").is_file()
        assert stat.S_IMODE((history / "heads.db").stat().st_mode) == 0o600
        assert version_contents(client, path) == [old.decode()]  # what the edit replaced
        assert svc.history.read_head(path) == (root / path).read_bytes()

    def test_a_first_start_keeps_a_small_starting_copy(self, make_app, root):
        words = "garden kitchen river mountain coffee recipe letter market".split()
        total = 0
        for i in range(300):
            text = f"# Note {i}\n\n" + " ".join(words[(i + k) % 8] for k in range(300)) + "\n"
            (root / f"notes/f{i % 10}").mkdir(parents=True, exist_ok=True)
            (root / f"notes/f{i % 10}/n{i}.md").write_text(text)
            total += len(text)
        client = with_key(make_app())
        svc = client.app.service
        svc.sync_index()
        history = root / ".notesvc/history"
        assert len(list(history.iterdir())) <= 3  # heads.db (and its log): no folder per note
        svc.history.heads.close()  # the log folded into the file, as at a stop
        used = sum(p.stat().st_size for p in history.rglob("*") if p.is_file())
        assert used <= 0.5 * total, (used, total)
        assert svc.history.read_head("notes/f3/n3.md") == (root / "notes/f3/n3.md").read_bytes()
        assert svc.history.heads._run("SELECT count(*) FROM pack")[0][0] == 3  # 100 a pack
        svc.history.heads._run("UPDATE pack SET data = ?", (b"x\x9c torn",))
        assert svc.history.read_head("notes/f3/n3.md") is None  # a damaged copy: unknown


def history_folder_of(root: Path, path: str) -> Path:
    return root / ".notesvc/history" / hashlib.sha256(path.encode()).hexdigest()[:32]


def loose_versions(root: Path) -> list:
    """Return the versions kept as files anywhere in the history."""
    history = root / ".notesvc/history"
    return [f for f in history.rglob("*") if f.is_file() and notesvc.VERSION_ID_RE.match(f.name)]


class TestVersionPacks:
    """Versions a sweep found settled move from their files into one compressed,
    content-addressed SQLite file (git's loose objects and packs)."""

    @staticmethod
    def edited(make_app, edits: int = 30, **settings):
        """A note edited `edits` times, a line changed each time; the app's clock in hand."""
        client = with_key(make_app(**settings))
        svc = client.app.service
        now = [time.time()]
        svc.history.clock = lambda: now[0]
        lines = [
            f"Line {i}: the garden by the river needs water and some care.\n" for i in range(300)
        ]
        put_note(client, "notes/long.md", "# Long\n\n" + "".join(lines))
        for i in range(edits):
            lines[(i * 37) % 300] = f"Line changed in edit {i}.\n"
            update(client, "notes/long.md", "# Long\n\n" + "".join(lines))
        return client, svc, now

    def test_a_settled_history_is_packed_to_a_fraction_and_reads_the_same(self, make_app, root):
        client, svc, now = self.edited(make_app)
        before = versions_of(client, "notes/long.md")
        contents = version_contents(client, "notes/long.md")
        loose_bytes = sum(f.stat().st_size for f in loose_versions(root))
        assert before["total"] == len(loose_versions(root)) == 30
        svc.notes.sweep_history()  # younger than an hour: they stay files
        assert len(loose_versions(root)) == 30
        now[0] += 2 * 3600
        svc.notes.sweep_history()
        assert loose_versions(root) == []
        assert not history_folder_of(root, "notes/long.md").exists()  # no folder, no file each
        db = root / ".notesvc/history/versions.db"
        assert stat.S_IMODE(db.stat().st_mode) == 0o600
        svc.history.close()  # the log folded into the file, as at a stop
        assert db.stat().st_size <= loose_bytes / 10, (db.stat().st_size, loose_bytes)
        assert versions_of(client, "notes/long.md") == before  # ids, sizes, etags, reasons
        assert version_contents(client, "notes/long.md") == contents
        first, last = before["versions"][-1]["id"], before["versions"][0]["id"]
        diff = data(client.get(f"{note_url('notes/long.md')}/versions/{first}/diff?against={last}"))
        assert "+Line changed in edit 28." in diff["diff"]
        info = data(client.get(f"{API}/system/info"))["history"]
        assert (info["notes"], info["versions"]) == (1, 30)
        etag = client.get(note_url("notes/long.md")).headers["ETag"]
        client.post(
            f"{note_url('notes/long.md')}/versions/{first}/restore", headers={"If-Match": etag}
        )
        assert data(client.get(note_url("notes/long.md")))["content"] == contents[-1]
        assert versions_of(client, "notes/long.md")["total"] == 31  # a new loose one, beside

    def test_the_same_content_is_kept_once(self, make_app, root):
        client = with_key(make_app())
        svc = client.app.service
        now = [time.time()]
        svc.history.clock = lambda: now[0]
        for name in ("a", "b", "c"):
            put_note(client, f"notes/{name}.md", "# Template\n\nthe same first text\n")
            update(client, f"notes/{name}.md", f"# {name}\n\nits own text\n")
        now[0] += 2 * 3600
        svc.notes.sweep_history()
        packs = svc.history.packs
        assert packs._run("SELECT count(*) FROM version")[0][0] == 3
        assert packs._run("SELECT count(*) FROM object")[0][0] == 1
        for name in ("a", "b", "c"):
            assert version_contents(client, f"notes/{name}.md") == [
                "# Template\n\nthe same first text\n"
            ]

    def test_retention_drops_packed_versions_and_tidies_the_packs(self, make_app, root):
        client, svc, now = self.edited(make_app, SERVICE_HISTORY_DAYS="1")
        contents = version_contents(client, "notes/long.md")
        now[0] += 2 * 3600
        svc.notes.sweep_history()
        packs = svc.history.packs
        assert packs._run("SELECT count(*) FROM pack")[0][0] == 1
        (whole,) = packs._run("SELECT size FROM pack")[0]
        svc.history.close()  # the log folded into the file, as at a stop
        db = root / ".notesvc/history/versions.db"
        full = db.stat().st_size
        now[0] += 2 * 86400
        svc.history.max_versions = 5
        assert svc.notes.sweep_history() == 25
        svc.history.close()
        assert db.stat().st_size < full  # the freed pages went back
        assert version_contents(client, "notes/long.md") == contents[:5]
        assert packs._run("SELECT count(*) FROM object")[0][0] == 5  # the others collected
        (size,) = packs._run("SELECT size FROM pack")[0]  # rewritten: mostly dead
        assert size < whole / 2
        current = data(client.get(note_url("notes/long.md")))["content"]
        update(client, "notes/long.md", "# Long\n\nshort now\n")  # a save applies it too
        assert version_contents(client, "notes/long.md") == [current, *contents[:4]]
        client.delete(note_url("notes/long.md"))
        svc.history.max_versions = 1
        now[0] += 2 * 86400
        svc.notes.sweep_history()
        assert versions_of(client, "notes/long.md")["total"] == 1

    def test_a_packed_history_follows_its_note_across_moves_and_restores(self, make_app, root):
        client, svc, now = self.edited(make_app, edits=3)
        contents = version_contents(client, "notes/long.md")
        now[0] += 2 * 3600
        svc.notes.sweep_history()
        assert loose_versions(root) == []
        client.patch_json(f"{note_url('notes/long.md')}/move", {"path": "notes/moved.md"})
        assert version_contents(client, "notes/moved.md")[1:] == contents  # and "moved"
        versions_of_raw(client, "notes/long.md", 404)  # nothing left under the old path
        now[0] += 2 * 3600
        svc.notes.sweep_history()  # the "moved" version packed too: all in the packs
        client.delete(note_url("notes/moved.md"))
        put_note(client, "notes/moved.md", "someone else's note now")
        item = data(client.get(f"{API}/trash"))["items"][0]
        client.post_json(f"{API}/trash/{item['id']}/restore", {"path": "notes/back.md"})
        assert version_contents(client, "notes/back.md")[-3:] == contents  # copied along
        assert version_contents(client, "notes/moved.md")[-3:] == contents  # and still there

    def test_a_damaged_pack_shows_no_wrong_version(self, make_app, root, caplog):
        client, svc, now = self.edited(make_app, edits=3)
        now[0] += 2 * 3600
        svc.notes.sweep_history()
        packs = svc.history.packs
        (data_,) = packs._run("SELECT data FROM pack")[0]
        torn = zlib.compress(zlib.decompress(data_).replace(b"garden", b"GARDEN", 1), 9)
        packs._run("UPDATE pack SET data = ?", (torn,))
        found = versions_of(client, "notes/long.md")["versions"]
        oldest = found[-1]["id"]  # its text comes first in the pack: the one changed
        resp = client.get(f"{note_url('notes/long.md')}/versions/{oldest}", status=404)
        assert_error(resp, 404, "NOT_FOUND")
        assert "damaged" in caplog.text
        assert data(client.get(f"{note_url('notes/long.md')}/versions/{found[0]['id']}"))["content"]

    def test_versions_stay_files_when_the_packs_cannot_be_written(self, make_app, root, caplog):
        client, svc, now = self.edited(make_app, edits=3)
        contents = version_contents(client, "notes/long.md")
        (root / ".notesvc/history/versions.db").mkdir()  # not a file: SQLite cannot open it
        now[0] += 2 * 3600
        svc.notes.sweep_history()
        assert len(loose_versions(root)) == 3
        assert version_contents(client, "notes/long.md") == contents
        assert "not packed" in caplog.text
        client.patch_json(f"{note_url('notes/long.md')}/move", {"path": "notes/moved.md"})
        assert version_contents(client, "notes/moved.md")[1:] == contents  # files move on

    def test_a_crash_between_packing_and_removing_the_files_lists_each_version_once(
        self, make_app, root
    ):
        client, svc, now = self.edited(make_app, edits=3)
        before = versions_of(client, "notes/long.md")
        files = {f: f.read_bytes() for f in loose_versions(root)}
        now[0] += 2 * 3600
        svc.notes.sweep_history()
        for f, raw in files.items():  # as if the process had died before the unlinks
            f.parent.mkdir(mode=0o700, exist_ok=True)
            f.write_bytes(raw)
        svc.history._changed(next(iter(files)).parent)
        assert versions_of(client, "notes/long.md") == before
        svc.notes.sweep_history()
        assert loose_versions(root) == []
        assert versions_of(client, "notes/long.md") == before


@pytest.mark.real_server
@pytest.mark.slow
def test_a_server_packs_an_older_historys_version_files_and_keeps_them_across_a_kill(tmp_path):
    """A history written before packs (one file per version, days old) is packed by the
    server's first sweep; a SIGKILL right after loses none of it."""
    root, path = tmp_path / "srv", "notes/old.md"
    (root / "notes").mkdir(parents=True)
    (root / path).write_text("# Old\n\nnow\n")
    folder = history_folder_of(root, path)
    folder.mkdir(parents=True)
    texts = [f"# Old\n\nversion {i}\n" + "the same long paragraph again. " * 50 for i in range(20)]
    start_us = int((time.time() - 3 * 86400) * 1_000_000)
    for i, text in enumerate(texts):
        raw = text.encode()
        (folder / f"{start_us + i:016d}-updated-{notesvc.make_etag(raw)[1:-1]}").write_bytes(raw)
    url = note_url(path) + "/versions"
    with running(root, "--auth-mode", "none") as server:
        wait_for(lambda: not loose_versions(root), timeout=20)
        server.proc.kill()
        server.proc.wait(10)
    with running(root, "--auth-mode", "none") as server:
        found = server.request("GET", url + "?limit=100")[2]["data"]["versions"]
        assert len(found) == 20
        got = [server.request("GET", f"{url}/{v['id']}")[2]["data"]["content"] for v in found]
        assert got == texts[::-1]


class TestVersionPacksRaces:
    """What a folder grant may see, and what a sweep racing a save, a move or a read
    does, when versions are packed (found by a review of the packs)."""

    @staticmethod
    def app(make_app):
        client = with_key(make_app())
        svc = client.app.service
        now = [time.time()]
        svc.history.clock = lambda: now[0]
        return client, svc, now

    @staticmethod
    def family_sees(client, path: str) -> list:
        grant = {"name": "family", "scope": "read", "folder": "notes/family"}
        family = with_key(
            client, data(client.post_json(f"{API}/auth/keys", grant, status=201))["key"]
        )
        seen = versions_of(family, path)["versions"]
        return [data(family.get(f"{note_url(path)}/versions/{v['id']}"))["content"] for v in seen]

    def private_note(self, make_app, packed: bool = False):
        client, svc, now = self.app(make_app)
        put_note(client, "notes/private/plan.md", "# Plan\n\nthe safe's code is 4711\n")
        update(client, "notes/private/plan.md", "# Plan\n\nnothing here\n")
        if packed:  # an hour on, swept: its versions packed
            now[0] += 2 * 3600
            svc.notes.sweep_history()
        return client, svc, now

    @staticmethod
    def move(client, new: str = "notes/family/plan.md"):
        client.patch_json(f"{note_url('notes/private/plan.md')}/move", {"path": new})

    @staticmethod
    def family_key(client):
        grant = {"name": "family", "scope": "write", "folder": "notes/family"}
        return with_key(
            client, data(client.post_json(f"{API}/auth/keys", grant, status=201))["key"]
        )

    def secret_moved_in(self, make_app, packed: bool = True):
        client, svc, now = self.private_note(make_app, packed)
        self.move(client)
        (secret,) = [
            v["id"]
            for v in versions_of(client, "notes/family/plan.md")["versions"]
            if "4711"
            in data(client.get(f"{note_url('notes/family/plan.md')}/versions/{v['id']}"))["content"]
        ]
        return client, svc, now, secret

    def test_a_packed_history_moved_into_a_grants_folder_shows_it_nothing_from_before(
        self, make_app, root
    ):
        client, svc, now = self.private_note(make_app)
        now[0] += 2 * 3600
        svc.notes.sweep_history()
        assert not history_folder_of(root, "notes/private/plan.md").exists()  # only packed
        self.move(client)
        assert len(version_contents(client, "notes/family/plan.md")) == 2  # the owner: all
        assert not any("4711" in t for t in self.family_sees(client, "notes/family/plan.md"))

    @pytest.mark.parametrize("packed", [False, True])
    def test_a_restore_from_the_trash_into_a_grants_folder_shows_it_nothing_from_before(
        self, make_app, root, packed
    ):
        client, _svc, _now = self.private_note(make_app, packed)
        client.delete(note_url("notes/private/plan.md"))
        item = data(client.get(f"{API}/trash"))["items"][0]
        client.post_json(f"{API}/trash/{item['id']}/restore", {"path": "notes/family/plan.md"})
        assert any("4711" in t for t in version_contents(client, "notes/family/plan.md"))
        assert not any("4711" in t for t in self.family_sees(client, "notes/family/plan.md"))

    def test_a_sweep_that_cannot_read_the_packs_keeps_the_origins(
        self, make_app, root, monkeypatch
    ):
        client, svc, now = self.private_note(make_app)
        self.move(client)
        now[0] += 2 * 3600
        svc.notes.sweep_history()  # all packed: the folder stays for its origins
        folder = history_folder_of(root, "notes/family/plan.md")
        assert (folder / "origins").exists()

        def broken(*args, **kwargs):
            raise notesvc.HeadStoreError("disk I/O error")

        with monkeypatch.context() as m:  # versions.db unreadable for one sweep
            m.setattr(svc.history.packs, "_run", broken)
            svc.notes.sweep_history()
        assert (folder / "origins").exists()
        assert not any("4711" in t for t in self.family_sees(client, "notes/family/plan.md"))

    def test_a_move_that_fails_halfway_shows_a_grant_nothing_from_before(
        self, make_app, root, monkeypatch
    ):
        client, svc, now = self.private_note(make_app)
        now[0] += 2 * 3600
        svc.notes.sweep_history()
        move = svc.history.packs.move

        def move_then_fail(*args, **kwargs):  # a kill or a failed rename after the commit
            move(*args, **kwargs)
            raise OSError("the process stops here")

        monkeypatch.setattr(svc.history.packs, "move", move_then_fail)
        self.move(client)
        assert not any("4711" in t for t in self.family_sees(client, "notes/family/plan.md"))

    def test_a_version_read_while_a_sweep_rewrites_its_pack_is_still_read(
        self, make_app, root, monkeypatch
    ):
        client, svc, now = self.app(make_app)
        put_note(client, "notes/a.md", "# A\n\none\n")
        update(client, "notes/a.md", "# A\n\ntwo\n")
        now[0] += 2 * 3600
        svc.notes.sweep_history()
        update(client, "notes/a.md", "# A\n\nthree\n")
        etag = notesvc.make_etag(b"# A\n\none\n")
        (vid,) = [
            v["id"] for v in versions_of(client, "notes/a.md")["versions"] if v["etag"] == etag
        ]
        now[0] += 2 * 3600
        unpack, inside = notesvc.VersionPacks._unpack, []

        def sweep_first(blob, objects):  # the read has its row: the sweep rewrites the pack
            if not inside:
                inside.append(True)
                svc.notes.sweep_history()
            return unpack(blob, objects)

        monkeypatch.setattr(notesvc.VersionPacks, "_unpack", staticmethod(sweep_first))
        got = data(client.get(f"{note_url('notes/a.md')}/versions/{vid}"))
        assert got["content"] == "# A\n\none\n"
        assert inside

    def test_a_version_the_retention_drops_while_it_is_packed_stays_dropped(
        self, make_app, root, monkeypatch
    ):
        client, svc, now = self.app(make_app)
        svc.history.max_versions, svc.history.days = 2, 0
        put_note(client, "notes/a.md", "v0")
        for i in (1, 2):
            update(client, "notes/a.md", f"v{i}")
        now[0] += 2 * 3600
        add = svc.history.packs.add

        def save_meanwhile(folder, versions):  # a save under the note's lock: v0 dropped
            update(client, "notes/a.md", "v3")
            return add(folder, versions)

        monkeypatch.setattr(svc.history.packs, "add", save_meanwhile)
        svc.history.pack(history_folder_of(root, "notes/a.md"))
        svc.history._changed(history_folder_of(root, "notes/a.md"))
        assert version_contents(client, "notes/a.md") == ["v2", "v1"]

    def test_a_damaged_copy_in_the_packs_is_replaced_not_trusted(self, make_app, root, monkeypatch):
        client, svc, now = self.app(make_app)
        put_note(client, "notes/a.md", "shared text")
        update(client, "notes/a.md", "a2")
        now[0] += 2 * 3600
        svc.notes.sweep_history()
        packs = svc.history.packs
        (raw,) = packs._run("SELECT data FROM pack")[0]
        torn = zlib.compress(zlib.decompress(raw).replace(b"shared", b"SHARED"), 9)
        packs._run("UPDATE pack SET data = ?", (torn,))
        put_note(client, "notes/b.md", "shared text")
        update(client, "notes/b.md", "b2")
        monkeypatch.setattr(notesvc.VersionPacks, "PACK_BYTES", 4)  # a history past 1 MiB
        now[0] += 2 * 3600
        svc.notes.sweep_history()
        assert loose_versions(root) == []
        assert version_contents(client, "notes/b.md") == ["shared text"]
        assert version_contents(client, "notes/a.md") == ["shared text"]  # mended too


class TestVersionPacksOrigins:
    """Where each version was saved, through crashes, races and odd ids (a second review)."""

    app = staticmethod(TestVersionPacksRaces.app)
    family_sees = staticmethod(TestVersionPacksRaces.family_sees)
    family_key = staticmethod(TestVersionPacksRaces.family_key)
    private_note = TestVersionPacksRaces.private_note
    secret_moved_in = TestVersionPacksRaces.secret_moved_in
    move = staticmethod(TestVersionPacksRaces.move)

    def test_a_version_id_with_a_trailing_newline_reads_a_packed_version_past_origins(
        self, make_app, root
    ):
        client, _svc, _now, secret = self.secret_moved_in(make_app)
        family = self.family_key(client)
        family.get(f"{note_url('notes/family/plan.md')}/versions/{secret}", status=404)
        resp = family.get(
            f"{note_url('notes/family/plan.md')}/versions/{secret}%0A", expect_errors=True
        )
        assert "4711" not in resp.text, resp.text[:300]

    def test_a_whole_folder_move_that_fails_after_the_rename_keeps_the_origins(
        self, make_app, root, monkeypatch
    ):
        client, svc, _now = self.private_note(make_app)  # loose versions: a whole-folder rename
        write = svc.history._write_origins

        def fail_once(*args, **kwargs):  # a kill (or ENOSPC) right after os.replace
            monkeypatch.setattr(svc.history, "_write_origins", write)
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(svc.history, "_write_origins", fail_once)
        self.move(client)
        assert not any("4711" in t for t in self.family_sees(client, "notes/family/plan.md"))

    def test_a_sweep_racing_a_move_in_keeps_the_origins(self, make_app, root, monkeypatch):
        client, svc, now = self.app(make_app)
        put_note(client, "notes/family/a.md", "# A\n")
        update(client, "notes/family/a.md", "# A\n\nv2\n")
        client.patch_json(f"{note_url('notes/family/a.md')}/move", {"path": "notes/family/plan.md"})
        now[0] += 2 * 3600
        svc.notes.sweep_history()  # packed: the folder stays for its origins
        client.patch_json(f"{note_url('notes/family/plan.md')}/move", {"path": "notes/family/x.md"})
        assert [f.name for f in history_folder_of(root, "notes/family/plan.md").iterdir()] == [
            "origins"
        ]  # left behind by the move: the next sweep removes it
        put_note(client, "notes/private/plan.md", "# Plan\n\nthe safe's code is 4711\n")
        update(client, "notes/private/plan.md", "# Plan\n\nnothing here\n")
        target = history_folder_of(root, "notes/family/plan.md")
        packed, done = svc.history._packed, []

        def move_in_meanwhile(folder, strict=False):  # the sweep found the folder empty
            found = packed(folder, strict)
            if strict and folder == target and not done:  # a move, from another request
                done.append(threading.Thread(target=self.move, args=(client,)))
                done[0].start()
                done[0].join(1.0)  # it lands now, unless it waits for the sweep's check
            return found

        monkeypatch.setattr(svc.history, "_packed", move_in_meanwhile)
        svc.notes.sweep_history()
        done[0].join(10)
        assert not any("4711" in t for t in self.family_sees(client, "notes/family/plan.md"))

    def test_a_move_while_the_packs_cannot_be_read_leaves_no_version_behind(
        self, make_app, root, monkeypatch
    ):
        client, svc, now = self.private_note(make_app)
        self.move(client)  # into the family folder: origins say where they were saved
        now[0] += 2 * 3600
        svc.notes.sweep_history()
        update(client, "notes/family/plan.md", "# Plan\n\nfamily text\n")
        update(client, "notes/family/plan.md", "# Plan\n\nfamily text, again\n")  # a loose one
        before = version_contents(client, "notes/family/plan.md")
        assert len(before) == 3
        ids, failed = svc.history.packs.ids, []

        def fail_once(folder):
            if not failed:
                failed.append(True)
                raise notesvc.HeadStoreError("database is locked")
            return ids(folder)

        monkeypatch.setattr(svc.history.packs, "ids", fail_once)
        client.patch_json(
            f"{note_url('notes/family/plan.md')}/move", {"path": "notes/family/other.md"}
        )
        assert failed  # the packs failed once, and were read again
        assert version_contents(client, "notes/family/other.md")[1:] == before  # none behind
        put_note(client, "notes/family/plan.md", "# a new note, where the old one was\n")
        assert not any("4711" in t for t in self.family_sees(client, "notes/family/plan.md"))

    def test_origins_that_cannot_be_read_show_a_grant_nothing(self, make_app, root, monkeypatch):
        client, _svc, _now = self.private_note(make_app)
        self.move(client)
        origins = history_folder_of(root, "notes/family/plan.md") / "origins"
        assert origins.exists()
        read_text = Path.read_text

        def emfile(self, *args, **kwargs):  # too many open files, an I/O error
            if self == origins:
                raise OSError(24, "Too many open files")
            return read_text(self, *args, **kwargs)

        monkeypatch.setattr(Path, "read_text", emfile)
        assert not any("4711" in t for t in self.family_sees(client, "notes/family/plan.md"))

    def test_a_version_loose_and_packed_stays_dropped_by_the_retention(self, make_app, root):
        client, svc, now = self.app(make_app)
        svc.history.max_versions, svc.history.days = 2, 0
        put_note(client, "notes/a.md", "v0")
        for i in (1, 2):
            update(client, "notes/a.md", f"v{i}")
        files = {f: f.read_bytes() for f in loose_versions(root)}
        now[0] += 2 * 3600
        svc.notes.sweep_history()
        for f, raw in files.items():  # a kill between the pack's commit and the unlinks
            f.parent.mkdir(mode=0o700, exist_ok=True)
            f.write_bytes(raw)
        svc.history._changed(next(iter(files)).parent)
        update(client, "notes/a.md", "v3")  # its retention drops v0
        svc.history._changed(next(iter(files)).parent)
        assert version_contents(client, "notes/a.md") == ["v2", "v1"]

    def test_an_origin_path_with_a_line_separator_is_read_whole(self, make_app, root):
        client, svc, _now = self.app(make_app)
        odd = "notes/family\u2028x/plan.md"  # U+2028: a path may hold it, splitlines() splits
        put_note(client, odd, "# Plan\n\nthe safe's code is 4711\n")
        update(client, odd, "# Plan\n\nnothing here\n")
        client.patch_json(f"{note_url(odd)}/move", {"path": "notes/family/plan.md"})
        assert (
            svc.history.saved_at(
                "notes/family/plan.md",
                versions_of(client, "notes/family/plan.md")["versions"][-1]["id"],
            )
            == odd
        )

    def test_a_large_old_history_is_packed_a_bounded_batch_at_a_time(
        self, make_app, root, monkeypatch
    ):
        _client, svc, now = self.app(make_app)
        svc.history.max_versions = 1000
        monkeypatch.setattr(notesvc.VersionPacks, "PACK_BYTES", 64 * 1024)
        folder = history_folder_of(root, "notes/old.md")
        folder.mkdir(parents=True)
        start = int((now[0] - 86400) * 1_000_000)
        for i in range(400):  # 400 x 8 KiB, one file each (a history from before packs)
            raw = (f"version {i}\n" + "x" * 8192).encode()
            (folder / f"{start + i:016d}-updated-{notesvc._etag_hex(raw)}").write_bytes(raw)
        add, held = svc.history.packs.add, []

        def measured(name, versions):  # what one transaction (the store's lock) takes in
            held.append(sum(len(d) for _, d in versions))
            return add(name, versions)

        monkeypatch.setattr(svc.history.packs, "add", measured)
        svc.notes.sweep_history()
        assert loose_versions(root) == []
        assert max(held) <= 4 * notesvc.VersionPacks.PACK_BYTES, held  # not all 3.2 MB at once


class TestVersionPacksAttacks:
    """What a third review of the packs found (an attacker's ids, races, a power cut)."""

    app = staticmethod(TestVersionPacksRaces.app)
    family_key = staticmethod(TestVersionPacksRaces.family_key)
    private_note = TestVersionPacksRaces.private_note
    secret_moved_in = TestVersionPacksRaces.secret_moved_in
    move = staticmethod(TestVersionPacksRaces.move)

    @pytest.mark.parametrize("how", ["get", "diff", "against", "restore"])
    def test_a_version_id_in_other_digits_reads_a_packed_version_past_origins(
        self, make_app, root, how
    ):
        client, _svc, _now, secret = self.secret_moved_in(make_app)
        family = self.family_key(client)
        url = f"{note_url('notes/family/plan.md')}/versions"
        family.get(f"{url}/{secret}", status=404)
        odd = "".join(chr(0xFF10 + int(c)) for c in secret[:16]) + secret[16:]  # fullwidth
        assert not notesvc.VERSION_ID_RE.match(odd)  # an id's digits are ASCII
        assert odd != secret
        q = urllib.parse.quote
        if how == "get":
            text = family.get(f"{url}/{q(odd)}", expect_errors=True).text
        elif how == "diff":
            text = family.get(f"{url}/{q(odd)}/diff", expect_errors=True).text
        elif how == "against":
            update(family, "notes/family/plan.md", "# Plan\n\nthe family's text\n")
            update(family, "notes/family/plan.md", "# Plan\n\nthe family's, again\n")
            (mine,) = [v["id"] for v in versions_of(family, "notes/family/plan.md")["versions"]]
            text = family.get(f"{url}/{mine}/diff?against={q(odd)}", expect_errors=True).text
        else:
            etag = family.get(note_url("notes/family/plan.md")).headers["ETag"]
            family.post(f"{url}/{q(odd)}/restore", headers={"If-Match": etag}, expect_errors=True)
            text = family.get(note_url("notes/family/plan.md")).text
        assert "4711" not in text, text[:300]

    @pytest.mark.parametrize("packed", [False, True])
    def test_a_listing_racing_a_move_in_shows_no_version_from_outside(
        self, make_app, root, monkeypatch, packed
    ):
        client, svc, _now = self.private_note(make_app, packed)
        family = self.family_key(client)
        put_note(client, "notes/family/other.md", "# Other\n")  # the grant sees something
        target = history_folder_of(root, "notes/family/plan.md")
        origins, moved = svc.history._origins, []

        def move_meanwhile(folder):  # the owner moves the note in right after this read
            found = origins(folder)
            if folder == target and not moved:
                moved.append(threading.Thread(target=self.move, args=(client,)))
                moved[0].start()
                moved[0].join(10)
            return found

        monkeypatch.setattr(svc.history, "_origins", move_meanwhile)
        resp = family.get(f"{note_url('notes/family/plan.md')}/versions", expect_errors=True)
        assert moved
        assert not moved[0].is_alive()
        secret = notesvc._etag_hex(b"# Plan\n\nthe safe's code is 4711\n")
        assert secret not in resp.text, resp.text[:400]  # its etag: 4 digits to guess

    @pytest.mark.parametrize("packed", [False, True])
    def test_a_read_racing_a_move_in_shows_no_version_from_outside(
        self, make_app, root, monkeypatch, packed
    ):
        client, svc, _now = self.private_note(make_app, packed)
        (secret,) = [  # its id, as a listing that raced a move in showed it (see above)
            v["id"]
            for v in versions_of(client, "notes/private/plan.md")["versions"]
            if "4711"
            in data(client.get(f"{note_url('notes/private/plan.md')}/versions/{v['id']}"))[
                "content"
            ]
        ]
        family = self.family_key(client)
        read, moved = svc.history.read, []

        def move_meanwhile(path, vid):  # the owner moves the note in just before this read
            if not moved:
                moved.append(threading.Thread(target=self.move, args=(client,)))
                moved[0].start()
                moved[0].join(10)
            return read(path, vid)

        monkeypatch.setattr(svc.history, "read", move_meanwhile)
        url = f"{note_url('notes/family/plan.md')}/versions/{secret}"
        resp = family.get(url, expect_errors=True)
        assert moved
        assert not moved[0].is_alive()
        assert "4711" not in resp.text, resp.text[:300]

    def test_a_merge_based_on_a_version_from_outside_tells_a_grant_nothing(self, make_app, root):
        client, _svc, _now = self.private_note(make_app)
        self.move(client)  # loose or packed alike: merge reads versions past their origins
        family = self.family_key(client)
        secret = notesvc.make_etag(b"# Plan\n\nthe safe's code is 4711\n")  # its etag, as a
        url = f"{note_url('notes/family/plan.md')}/merge"  # listing that raced a move showed
        answers = []
        for guess in ("1234", "4711"):  # right: "merged"; wrong: 409 (an oracle on the text)
            body = {"base": secret, "content": f"# Plan\n\nthe safe's code is {guess}\n\nmore\n"}
            answers.append(family.post_json(url, body, expect_errors=True).status_int)
        assert answers[0] == answers[1], answers

    def test_a_move_with_a_damaged_packed_row_takes_every_version_along(self, make_app, root):
        client, svc, now = self.app(make_app)
        put_note(client, "notes/a.md", "v0")
        for i in (1, 2, 3):
            now[0] += 1
            update(client, "notes/a.md", f"v{i}")
        now[0] += 2 * 3600
        svc.notes.sweep_history()
        assert loose_versions(root) == []
        before = version_contents(client, "notes/a.md")
        assert before == ["v2", "v1", "v0"]
        name = bytes.fromhex(history_folder_of(root, "notes/a.md").name)
        (at0, oid0), (at1, _) = svc.history.packs._run(
            "SELECT at, object FROM version ORDER BY at LIMIT 2"
        )
        with svc.history.packs._transaction() as db:  # a row _vids leaves out (damaged)
            db.execute(
                "INSERT INTO version VALUES (?, ?, 'renamed', ?)", (name, (at0 + at1) // 2, oid0)
            )
        assert version_contents(client, "notes/a.md") == before  # left out, as it should be
        client.patch_json(f"{note_url('notes/a.md')}/move", {"path": "notes/b.md"})
        assert version_contents(client, "notes/b.md")[1:] == before
        versions_of_raw(client, "notes/a.md", 404)  # nothing readable left behind

    def test_a_versions_db_of_another_format_answers_no_500(self, make_app, root):
        client, svc, now = self.app(make_app)
        put_note(client, "notes/a.md", "# A\n\none\n")
        update(client, "notes/a.md", "# A\n\ntwo\n")
        db = root / ".notesvc/history/versions.db"
        other = sqlite3.connect(db)  # the same tables, other types (ids as hex text)
        other.execute("CREATE TABLE version (folder, at, reason, object)")
        other.execute("CREATE TABLE object (id, pack, start, size)")
        other.execute("CREATE TABLE pack (id INTEGER PRIMARY KEY, size, data)")
        folder = bytes.fromhex(history_folder_of(root, "notes/a.md").name)
        other.execute(
            "INSERT INTO version VALUES (?, 1700000000000000, 'updated', ?)", (folder, "ab" * 16)
        )
        other.execute("INSERT INTO object VALUES (?, 1, NULL, NULL)", ("ab" * 16,))
        other.execute("INSERT INTO pack VALUES (1, 5, 'hello')")
        other.commit()
        other.close()
        url = f"{note_url('notes/a.md')}/versions"
        assert client.get(url, expect_errors=True).status_int < 500
        odd = "1700000000000000-updated-" + "ab" * 16
        assert client.get(f"{url}/{odd}", expect_errors=True).status_int < 500
        moved = f"{note_url('notes/a.md')}/move"
        assert client.patch_json(moved, {"path": "notes/b.md"}, expect_errors=True).status_int < 500
        now[0] += 2 * 3600
        svc.notes.sweep_history()  # raised: every sweep (and the trash's purge) stops here


@pytest.mark.real_server
@pytest.mark.slow
def test_a_server_killed_while_it_packs_an_old_history_loses_no_version(tmp_path):
    """SIGKILL a server in the middle of its first sweep's packing (some versions packed,
    some still files): after a restart every version reads back whole."""
    root, path = tmp_path / "srv", "notes/big.md"
    (root / "notes").mkdir(parents=True)
    (root / path).write_text("# Big\n\nnow\n")
    folder = history_folder_of(root, path)
    folder.mkdir(parents=True)
    rnd = random.Random(3)
    start_us = int((time.time() - 3 * 86400) * 1_000_000)
    texts = {}
    for i in range(600):  # 12 MB that zlib cannot shrink much: a dozen batches to pack
        raw = f"# Big {i}\n\n".encode() + rnd.randbytes(20_000).hex().encode()[:20_000]
        vid = f"{start_us + i:016d}-updated-{notesvc._etag_hex(raw)}"
        (folder / vid).write_bytes(raw)
        texts[vid] = raw.decode()
    server = Server(root, "--auth-mode", "none", env={"SERVICE_HISTORY_MAX_VERSIONS": "1000"})
    try:
        wait_for(lambda: len(loose_versions(root)) < 600, timeout=20, step=0.002)
        server.proc.kill()  # mid-sweep: no clean-up
        server.proc.wait(10)
    finally:
        server.stop()
    left = len(loose_versions(root))
    url = note_url(path) + "/versions"
    with running(root, "--auth-mode", "none", env={"SERVICE_HISTORY_MAX_VERSIONS": "1000"}) as s:
        found = s.request("GET", url + "?limit=1000")[2]["data"]["versions"]
        assert {v["id"] for v in found} == set(texts), left
        for v in found[::37]:
            assert s.request("GET", f"{url}/{v['id']}")[2]["data"]["content"] == texts[v["id"]]
    assert 0 < left < 600  # it was killed in the middle
