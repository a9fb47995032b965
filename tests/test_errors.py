"""The envelope and the one renderer of every failure (src/notesvc/errors.py)."""

from __future__ import annotations

import io
import json
import logging
import re
import threading
import time
import unicodedata

import pytest
import webtest

from conftest import API, _boom, assert_error, data, make_env, notesvc


def _echo(svc):
    return {"body": notesvc.read_json(svc.config.max_body_bytes)}


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

    @pytest.mark.slow
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
        saved = notesvc.BatchedLogHandler.installed, logging.root.handlers[:], logging.root.level
        try:
            notesvc.BatchedLogHandler.installed = handler
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
            notesvc.BatchedLogHandler.installed = saved[0]
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

    @pytest.mark.slow
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


# Strings a person would call empty: White_Space and control characters only (docs/api.md).
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
    """The OpenAPI document and the server call the same strings empty (docs/api.md)."""

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
