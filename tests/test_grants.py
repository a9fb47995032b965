"""Scopes, scoped keys, folder grants, share links (src/notesvc/grants.py)."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import http.client
import http.server
import json
import os
import re
import secrets
import threading
import urllib.error
import urllib.parse
import urllib.request

import pytest
import webtest

from conftest import (
    API,
    FOLDER_NOTES,
    KEY,
    PNG,
    as_key,
    assert_error,
    att_url,
    data,
    inside_family,
    key_of,
    listed_tools,
    make_env,
    multipart,
    new_grant,
    note_url,
    notesvc,
    owner_headers,
    paths_in,
    post_form,
    put_note,
    raw_answer,
    route_id,
    rpc,
    running,
    sample_url,
    upload,
    wait_for,
    with_key,
)
from standins import telegram_update


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
    @pytest.mark.slow
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
    @pytest.mark.slow
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
            "createdBy",
        }
        assert (rec["scope"], rec["folder"], rec["kind"]) == ("write", "notes/family", "key")
        days = (notesvc.epoch_of(rec["expiresAt"]) - notesvc.epoch_of(rec["createdAt"])) / 86400
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
        for _ in range(12):  # the same expired key again and again: one failure
            assert_error(expired.get(f"{API}/notes", status=401), 401, "UNAUTHORIZED")
        for i in range(9):  # ... which counts like any wrong key: nine more lock it out
            as_key(client, f"nsg_wrong{i}", REMOTE_ADDR="192.0.2.7").get(f"{API}/notes", status=401)
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
    @pytest.mark.slow
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
    @pytest.mark.slow
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
        mine = data(owner.get(f"{API}/changes?since=latest"))["last"]  # (theirs: older)
        owner.patch_json(note_url("notes/work/c.md") + "/move", {"path": "notes/family/c.md"})
        owner.patch_json(note_url("notes/family/a.md") + "/move", {"path": "notes/work/a.md"})
        put_note(owner, "notes/work/new.md", "outside")
        seen = data(member.get(f"{API}/changes?since={last}"))["changes"]
        assert [(c["kind"], c["path"]) for c in seen] == [
            ("created", "notes/family/c.md"),
            ("deleted", "notes/family/a.md"),
        ]
        assert all("from" not in c for c in seen)
        everything = data(owner.get(f"{API}/changes?since={mine}"))["changes"]
        assert [c["kind"] for c in everything] == ["moved", "moved", "created"]

    @pytest.mark.slow
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

    @pytest.mark.parametrize(
        ("guard", "store", "inside", "outside", "bad", "what"),
        [
            ("visible_note", "notes", "notes/family/a.md", "notes/work/c.md", ".exe", "note"),
            (
                "visible_attachment",
                "attachments",
                "attachments/family/p.png",
                "attachments/work/w.png",
                ".exe",
                "attachment",
            ),
            (
                "visible_note_file",
                "note_files",
                "notes/family/i.png",
                "notes/work/i.png",
                ".exe",
                "attachment",
            ),
        ],
    )
    def test_each_guard_checks_the_folder_then_the_path_then_links(
        self, family, root, guard, store, inside, outside, bad, what
    ):
        owner, _ = family
        svc = owner.app.service
        check, where = getattr(notesvc, guard), getattr(svc, store)
        member = notesvc.Principal("key", "write", "notes/family")
        assert check(where, inside, member) == inside
        assert check(where, outside, notesvc.OWNER) == outside
        odd = outside.rsplit(".", 1)[0] + bad  # against the path's rules as well
        for raw in (outside, odd, outside.replace("/work/", "/family/../work/"), None):
            with pytest.raises(notesvc.ApiError) as e:
                check(where, raw, member)
            assert (e.value.status_code, e.value.message) == (404, f"no {what} at {raw}")
        with pytest.raises(notesvc.ApiError) as e:  # inside: the path's own rules
            check(where, inside.rsplit(".", 1)[0] + bad, member)
        assert e.value.status_code == 400
        top = inside.rsplit("/", 1)[0]
        (root / top).mkdir(parents=True, exist_ok=True)
        (root / top / "link").symlink_to(root / outside.rsplit("/", 1)[0])
        linked = f"{top}/link/{outside.rsplit('/', 1)[1]}"
        with pytest.raises(notesvc.ApiError) as e:
            check(where, linked, member)
        assert (e.value.status_code, e.value.message) == (404, f"no {what} at {linked}")

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
        assert set(d) == {"id", "path", "url", "createdAt", "expiresAt", "createdBy", "homeOnly"}
        assert d["homeOnly"] is True  # localhost: it opens at home only (the dialog says so)
        sid = client.app.service.state.read()["serverId"]
        assert re.fullmatch(rf"http://localhost:80/r/{sid}/s/[A-Za-z0-9_-]{{22}}", d["url"])
        days = (notesvc.epoch_of(d["expiresAt"]) - notesvc.epoch_of(d["createdAt"])) / 86400
        assert round(days) == 7
        assert self.token(d) not in (root / ".notesvc" / "state.json").read_text()

    @pytest.mark.parametrize(
        ("host", "home"),
        [
            ("127.0.0.1:3000", True),
            ("192.168.1.20:3000", True),
            ("[fd00::20]:3000", True),
            ("raspberrypi:3000", True),
            ("pi.local:3000", True),
            ("100.101.102.103", True),  # a tailnet's
            ("notes.example.org", False),
            ("203.0.113.7:3000", False),
            ("[2001:db8::7]", False),
        ],
    )
    @pytest.mark.slow
    def test_a_link_says_whether_it_opens_only_at_home(self, make_app, host, home):
        client = with_key(make_app(SERVICE_PAIRING_MODE="open-port"))
        put_note(client, "notes/x.md", "x")
        body = {"path": "notes/x.md"}
        d = data(client.post_json(f"{API}/shares", body, extra_environ={"HTTP_HOST": host}))
        assert d["url"].startswith(f"http://{host}/s/")
        assert d["homeOnly"] is home

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

    def test_revoking_a_device_ends_its_feeds_and_unbinds_the_chat_it_connected(
        self, tmp_path, upstream
    ):
        """T5: a device's own secrets end with it on any revoke (its calendar feeds, the
        Telegram chat it connected with a bind code), and with cascade those of the devices
        it made too; the chat becomes a refused sender and gets no passage of any note."""
        env = {"SERVICE_TELEGRAM_API_BASE": upstream.url}
        with running(tmp_path, env=env) as server:
            setup = server.request("GET", f"{API}/system/setup")[2]["data"]
            owner = owner_headers(setup)

            def device(maker: dict, name: str) -> tuple:
                body = {"name": name, "scope": "admin"}
                made = server.request("POST", f"{API}/auth/devices/pairings", body, maker)[2]
                claim = {"secret": made["data"]["secret"], "deviceName": name}
                got = server.request("POST", f"{API}/auth/devices/claim", claim)[2]["data"]
                return got["deviceId"], {KEY: got["key"]}

            def feed(maker: dict, name: str) -> str:
                made = server.request("POST", f"{API}/auth/feeds", {"name": name}, maker)[2]
                return urllib.parse.urlsplit(made["data"]["url"]).path

            def feed_status(path: str) -> int:
                return raw_answer(server, "GET", path)[0]

            def sent_to(chat: str) -> list:
                return [
                    r["json"]["text"]
                    for r in upstream.requests
                    if "/sendMessage" in r["path"] and r["json"]["chat_id"] == chat
                ]

            phone, phone_key = device(owner, "phone")
            tablet, tablet_key = device(phone_key, "tablet")  # made by the phone
            laptop, laptop_key = device(phone_key, "laptop")
            feeds = {
                "owner": feed(owner, "mine"),
                "phone": feed(phone_key, "phone's"),
                "tablet": feed(tablet_key, "tablet's"),
                "laptop": feed(laptop_key, "laptop's"),
            }
            assert {feed_status(f) for f in feeds.values()} == {200}
            body = {"path": "notes/home/keys.md", "content": "# Keys\n\nUnder the flowerpot."}
            assert server.request("POST", f"{API}/notes", body, owner)[0] == 201
            body = {"botToken": "123456:ABC-telegram-token"}
            made = server.request("POST", f"{API}/channels/connect/telegram", body, phone_key)[2]
            channel = f"{API}/channels/{made['data']['channel']['id']}"
            upstream.push(telegram_update(f"/start {made['data']['bindCode']}", chat_id=42))
            wait_for(
                lambda: "boundChat" in server.request("GET", channel, headers=owner)[2]["data"]
            )
            upstream.push(telegram_update("/search flowerpot", chat_id=42))
            wait_for(lambda: any("notes/home/keys.md" in t for t in sent_to("42")))
            # A plain revoke: the device's own feed ends, and no other.
            assert server.request("DELETE", f"{API}/auth/keys/{tablet}", headers=owner)[0] == 200
            assert feed_status(feeds["tablet"]) == 404
            assert feed_status(feeds["laptop"]) == feed_status(feeds["phone"]) == 200
            # The phone with cascade: its feed, the laptop's, and the chat it connected.
            gone = f"{API}/auth/keys/{phone}?cascade=true"
            status, _, answer = server.request("DELETE", gone, headers=owner)
            assert status == 200
            assert answer["data"]["alsoRevoked"] == [laptop]
            assert [feed_status(feeds[k]) for k in ("phone", "laptop", "owner")] == [404, 404, 200]
            listed = server.request("GET", f"{API}/auth/feeds", headers=owner)[2]["data"]["feeds"]
            assert [f["name"] for f in listed] == ["mine"]
            shown = server.request("GET", channel, headers=owner)[2]["data"]
            assert "boundChat" not in shown
            assert shown["config"]["allowedChatIds"] == []
            assert set(shown["binding"]) == {"until"}  # nobody, until a new code (never anyone)
            answered = len(sent_to("42"))
            upstream.push(telegram_update("/search flowerpot", chat_id=42))
            refused = lambda: server.request("GET", channel, headers=owner)[2]["data"]  # noqa: E731
            wait_for(lambda: "42" in [r["sender"] for r in refused()["refusedSenders"]])
            upstream.push(telegram_update("/ask where are the keys?", chat_id=7))  # a stranger
            wait_for(lambda: "7" in [r["sender"] for r in refused()["refusedSenders"]])
            assert len(sent_to("42")) == answered
            assert sent_to("7") == []
            # The owner connects a chat of their own again: the channel itself stays.
            code = server.request("POST", f"{channel}/bind", headers=owner)[2]["data"]["bindCode"]
            upstream.push(telegram_update(code, chat_id=43))
            wait_for(lambda: refused().get("boundChat", {}).get("id") == "43")
            upstream.push(telegram_update("/search flowerpot", chat_id=43))
            wait_for(lambda: any("notes/home/keys.md" in t for t in sent_to("43")))
            logged = "".join(server.lines)
            assert "chat 42 unbound" in logged
            assert not any(path.split("/")[-1][:-4] in logged for path in feeds.values())

    def test_a_revoked_device_retrying_never_locks_its_owner_out(self, tmp_path):
        """A phone left with a revoked key retries it from the owner's own address (the same
        Wi-Fi, the same NAT): the same wrong key again counts once, so the owner is never
        locked out by it, while ten different wrong keys still lock a guesser out."""
        with running(tmp_path) as server:
            setup = server.request("GET", f"{API}/system/setup")[2]["data"]
            owner = owner_headers(setup)
            body = {"name": "old phone", "scope": "write"}
            made = server.request("POST", f"{API}/auth/devices/pairings", body, owner)[2]["data"]
            claim = {"secret": made["secret"], "deviceName": "old phone"}
            device = server.request("POST", f"{API}/auth/devices/claim", claim)[2]["data"]
            phone = {KEY: device["key"]}
            assert server.request("GET", f"{API}/notes", headers=phone)[0] == 200
            gone = f"{API}/auth/keys/{device['deviceId']}"
            assert server.request("DELETE", gone, headers=owner)[0] == 200
            for _ in range(30):  # the phone's page polls on with its key
                assert server.request("GET", f"{API}/changes", headers=phone)[0] == 401
                assert server.request("GET", f"{API}/notes", headers=owner)[0] == 200
            for _ in range(3):  # (the owner's success above cleared this address)
                assert server.request("GET", f"{API}/changes", headers=phone)[0] == 401
            for i in range(9):  # a revoked key counts like any wrong key: nine more lock out
                status = server.request("GET", f"{API}/notes", headers={KEY: f"nsk_guess{i}"})[0]
                assert status == 401
            status, headers, _ = server.request("GET", f"{API}/notes", headers=owner)
            assert status == 429
            assert int(headers["Retry-After"]) > 0
            assert device["key"] not in "".join(server.lines)

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
