"""The built-in tools MCP clients and the agent call (src/notesvc/tools.py)."""

from __future__ import annotations

import contextlib
import json
import os

import pytest

from conftest import (
    API,
    HERE,
    call_tool,
    data,
    key_of,
    listed_tools,
    note_url,
    notesvc,
    ok_tool,
    put_note,
    rpc,
    search,
    tmp_path_factory_root,
    tool_refused,
    with_key,
)
from standins import KEYS_NOTE, seed_notes

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

    def test_every_tool_is_listed_documented_and_tested(self, tools, make_app):
        # the review card's own tools are listed in suggest mode only
        assert listed_tools(tools) == {n for n, t in notesvc.TOOLS.items() if not t.app_only}
        assert listed_tools(with_key(make_app(SERVICE_MCP_WRITE="suggest"))) == set(notesvc.TOOLS)
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

    def test_each_argument_is_checked_by_every_rule_of_its_schema(self):
        schema = {
            "properties": {
                "n": {"type": "integer", "minimum": 1, "maximum": 3},
                "mode": {"type": "string", "enum": ["a", "b"]},
                "tags": {"type": "array"},
                "extra": {"type": "object"},
                "anything": {},
            },
            "additionalProperties": False,
        }

        def refused(arguments) -> str:
            with pytest.raises(notesvc.ApiError) as err:
                notesvc.checked_arguments(schema, arguments)
            assert err.value.status_code == 400
            return err.value.message

        assert refused(["n", 1]) == "the arguments must be a JSON object"
        assert refused({"n": 0}) == "'n' must be from 1 to 3"
        assert refused({"n": 2.5}) == "'n' must be an integer"
        assert refused({"n": False}) == "'n' must be an integer"
        assert refused({"mode": "c"}) == "'mode' must be one of a, b"
        assert refused({"tags": "x"}) == "'tags' must be an array"
        assert refused({"extra": []}) == "'extra' must be an object"
        assert refused({"n": 1, "mode": "c", "tags": 1}) == "'mode' must be one of a, b"  # in order
        given = {"n": 3.0, "mode": "b", "tags": [], "extra": {}, "anything": [1], "x": None}
        assert notesvc.checked_arguments(schema, given) == {
            "n": 3,
            "mode": "b",
            "tags": [],
            "extra": {},
            "anything": [1],
        }
        assert type(notesvc.checked_arguments(schema, {"n": 1.0})["n"]) is int

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
    @pytest.mark.slow
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
            ({"query": "keys", "mode": "vibes"}, "'mode' must be one of"),
        ],
    )
    def test_tool_search_notes_explains_a_bad_query(self, tools, arguments, says):
        assert says in tool_refused(tools, "search_notes", "VALIDATION_ERROR", **arguments)

    def test_tool_related_notes_is_empty_while_embeddings_are_off(self, tools):
        found = ok_tool(tools, "related_notes", path="notes/home/keys.md")
        assert found == {"path": "notes/home/keys.md", "results": []}
        text = call_tool(tools, "related_notes", path="notes/home/keys.md")["content"][0]["text"]
        assert "embeddings are off" in text
        tool_refused(tools, "related_notes", "NOT_FOUND", path="notes/nope.md")
        tool_refused(tools, "related_notes", "VALIDATION_ERROR", path="../etc/passwd")

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

    def history(self, tools) -> list:
        """Change notes/garden.md twice; return its versions, newest first."""
        garden = "notes%2Fgarden.md"
        tools.put_json(f"{API}/notes/{garden}", {"content": "# Garden\n\nsecond\n"})
        tools.put_json(f"{API}/notes/{garden}", {"content": "# Garden\n\nthird\n"})
        return ok_tool(tools, "note_history", path="notes/garden.md")["versions"]

    def test_tool_note_history_lists_versions_with_their_fields(self, tools):
        versions = self.history(tools)
        assert len(versions) == 2
        assert set(versions[0]) >= {"id", "savedAt", "size", "etag", "reason", "savedBy", "summary"}
        assert [v["reason"] for v in versions] == ["updated", "updated"]
        assert ok_tool(tools, "note_history", path="notes/garden.md", limit=1)["total"] == 2
        text = call_tool(tools, "note_history", path="notes/garden.md")["content"][0]["text"]
        assert versions[0]["id"] in text
        tool_refused(tools, "note_history", "NOT_FOUND", path="notes/none.md")
        tool_refused(tools, "note_history", "VALIDATION_ERROR", path="notes/../x.md")
        tool_refused(tools, "note_history", "VALIDATION_ERROR", path="notes/garden.md", limit=0)

    def test_tool_note_diff_between_versions_and_now(self, tools):
        versions = self.history(tools)
        diff = ok_tool(tools, "note_diff", path="notes/garden.md", **{"from": versions[0]["id"]})
        assert diff["to"] == "current"
        assert "-second" in diff["diff"]
        assert "+third" in diff["diff"]
        older = ok_tool(
            tools,
            "note_diff",
            path="notes/garden.md",
            to=versions[0]["id"],
            **{"from": versions[1]["id"]},
        )
        assert "+second" in older["diff"]
        for bad in ("nope", "../x", "0" * 100):
            tool_refused(
                tools, "note_diff", "VALIDATION_ERROR", path="notes/garden.md", **{"from": bad}
            )
        missing = "0000000000000001-updated-" + "0" * 32
        tool_refused(tools, "note_diff", "NOT_FOUND", path="notes/garden.md", **{"from": missing})

    def test_tool_restore_version_needs_the_etag(self, tools):
        versions = self.history(tools)
        etag = data(tools.get(note_url("notes/garden.md")))["etag"]
        args = {"path": "notes/garden.md", "versionId": versions[1]["id"]}
        tool_refused(tools, "restore_version", "PRECONDITION_FAILED", etag='"0"', **args)
        done = ok_tool(tools, "restore_version", etag=etag, **args)
        assert data(tools.get(note_url("notes/garden.md")))["content"].startswith(
            "# Garden\n\nPlant"
        )
        assert done["path"] == "notes/garden.md"
        listed = ok_tool(tools, "note_history", path="notes/garden.md")["versions"]
        assert listed[0]["reason"] == "restored"

    def suggesting(self, make_app, root=None):
        client = with_key(make_app(root, SERVICE_MCP_WRITE="suggest"))
        seed_notes(client)
        return client

    def test_tool_accept_suggestion_applies_it_for_the_review_card(self, make_app):
        client = self.suggesting(make_app)
        made = ok_tool(client, "append_to_note", path="notes/garden.md", text="- basil")
        done = ok_tool(client, "accept_suggestion", id=made["suggestion"]["id"])
        assert done["suggestion"]["status"] == "accepted"
        assert done["note"]["path"] == "notes/garden.md"
        assert data(client.get(note_url("notes/garden.md")))["content"].endswith("- basil\n")
        tool_refused(client, "accept_suggestion", "NOT_FOUND", id=made["suggestion"]["id"])

    def test_tool_reject_suggestion_closes_it(self, make_app):
        client = self.suggesting(make_app)
        made = ok_tool(client, "create_note", path="notes/idea.md", content="x")
        assert ok_tool(client, "reject_suggestion", id=made["suggestion"]["id"])["status"] == (
            "rejected"
        )
        client.get(note_url("notes/idea.md"), status=404)
        tool_refused(client, "reject_suggestion", "NOT_FOUND", id="nope")

    @pytest.mark.slow
    def test_every_structured_result_matches_its_output_schema(self, tools, make_app, tmp_path):
        jsonschema = pytest.importorskip("jsonschema")
        versions = self.history(tools)
        etag = data(tools.get(note_url("notes/work.md")))["etag"]
        calls = {
            "search_notes": {"query": "tomatoes"},
            "related_notes": {"path": "notes/garden.md"},
            "read_note": {"path": "notes/garden.md"},
            "list_folder": {},
            "recent_changes": {},
            "list_tags": {},
            "create_note": {"path": "notes/new.md", "content": "x"},
            "append_to_note": {"path": "notes/new.md", "text": "y"},
            "replace_in_note": {"path": "notes/new.md", "old": "y", "new": "z"},
            "update_note": {"path": "notes/work.md", "content": "w", "etag": etag},
            "note_history": {"path": "notes/garden.md"},
            "note_diff": {"path": "notes/garden.md", "from": versions[0]["id"]},
            "search": {"query": "tomatoes"},
            "fetch": {"id": "notes/garden.md"},
        }
        listed = {t["name"]: t for t in rpc(tools, "tools/list")["result"]["tools"]}
        for name, arguments in calls.items():
            schema = listed[name]["outputSchema"]
            jsonschema.Draft202012Validator.check_schema(schema)
            jsonschema.validate(ok_tool(tools, name, **arguments), schema)
        assert all("outputSchema" in t and t["title"] for t in listed.values())
        suggest = self.suggesting(make_app, tmp_path / "suggesting")
        listed = {t["name"]: t for t in rpc(suggest, "tools/list")["result"]["tools"]}
        made = ok_tool(suggest, "create_note", path="notes/s.md", content="x")
        jsonschema.validate(made, listed["create_note"]["outputSchema"])
        done = ok_tool(suggest, "accept_suggestion", id=made["suggestion"]["id"])
        jsonschema.validate(done, listed["accept_suggestion"]["outputSchema"])
