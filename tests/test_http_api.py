"""System routes and the features document (src/notesvc/http/api.py)."""

from __future__ import annotations

import json
import re

from conftest import API, data, key_of, notesvc, with_key


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


class TestFeatures:
    """GET /system/features: what the client read from openapi.json, small (docs/api.md)."""

    def test_public_small_and_what_openapi_json_said(self, anon):
        resp = anon.get(f"{API}/system/features")
        d = data(resp)
        assert d == {
            "version": notesvc.__version__,
            "history": True,
            "attachments": True,
            "changes": True,
            "related": False,
        }
        assert len(resp.body) < 200
        # the same facts the web client reads from the OpenAPI document's paths
        paths = list(anon.get(f"{API}/openapi.json").json["paths"])
        has = lambda end: any(p.endswith(end) for p in paths)  # noqa: E731
        assert d["history"] == (has("/trash") and has("/versions"))
        assert (d["attachments"], d["changes"]) == (has("/attachments"), has("/changes"))

    def test_etag_and_304(self, anon):
        resp = anon.get(f"{API}/system/features")
        etag = resp.headers["ETag"]
        assert re.fullmatch(r'"[0-9a-f]{20}"', etag)
        assert resp.headers["Cache-Control"] == "no-cache"  # kept by a browser, asked again
        for matching in (etag, f"W/{etag}", f'"other", {etag}', "*"):
            again = anon.get(
                f"{API}/system/features", headers={"If-None-Match": matching}, status=304
            )
            assert again.body == b""
            assert again.headers["ETag"] == etag
        other = anon.get(f"{API}/system/features", headers={"If-None-Match": '"other"'})
        assert data(other)["version"] == notesvc.__version__

    def test_a_route_table_without_history_says_so(self, anon):
        svc = anon.app.service
        kept = svc.routes
        try:
            svc.routes = tuple(r for r in kept if not r.rule.endswith("/versions"))
            assert data(anon.get(f"{API}/system/features"))["history"] is False
        finally:
            svc.routes = kept

    def test_in_the_openapi_document_as_public(self, anon):
        op = anon.get(f"{API}/openapi.json").json["paths"][f"{API}/system/features"]["get"]
        assert op["security"] == []
        assert op["operationId"] == "get_features"
