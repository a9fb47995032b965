"""Plugins: loading, toggles, hooks, the built-ins (src/notesvc/plugins.py)."""

from __future__ import annotations

import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import webtest

from conftest import (
    API,
    HELLO_PLUGIN,
    assert_error,
    data,
    hits,
    note_url,
    notesvc,
    put_note,
    tmp_path_factory_root,
    web_update,
    with_key,
)

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
            + " to TestPluginHooks in tests/test_plugins.py: give RECORDER_PLUGIN a function for "
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
        assert last[1].startswith("notes/daily/")  # /save goes to the daily note
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
