"""MCP resources, prompts and completion (src/notesvc/mcp_resources.py), in-process over
/api/v1/mcp: the URIs, paging, reading, the reach, bad input, the prompts' bounds."""

from __future__ import annotations

import base64
import json
import sys

import pytest
import webtest

import notesvc
from conftest import API, as_key, new_grant, put_note, rpc, with_key
from test_people import device_of

NOTES = {
    "notes/garden.md": "# Garden\n\nPlant tomatoes in May. #plants\n\n- [ ] buy seeds\n",
    "notes/a b/c@d.md": "# Odd name\n\nLinks to [[Garden]] and [[Missing page]].\n",
    "notes/work/plan.md": "# Plan\n\nThe work plan. #work\n",
    "notes/work/plan copy.md": "# Plan\n\nThe work plan again.\n",
}


@pytest.fixture
def mcp(make_app):
    client = with_key(make_app())
    for path, text in NOTES.items():
        put_note(client, path, text)
    return client


def result(client, method: str, params: dict | None = None) -> dict:
    answer = rpc(client, method, params)
    assert "error" not in answer, answer
    return answer["result"]


def error(client, method: str, params: dict | None = None, code: int = -32602) -> dict:
    answer = rpc(client, method, params, status=400 if code == -32600 else 200)
    assert answer["error"]["code"] == code, answer
    assert "Traceback" not in json.dumps(answer)
    return answer["error"]


def read(client, uri: str) -> dict:
    return result(client, "resources/read", {"uri": uri})["contents"][0]


class TestResources:
    def test_list_is_the_notes_newest_first_with_their_fields(self, mcp):
        listed = result(mcp, "resources/list")
        assert "nextCursor" not in listed
        uris = [r["uri"] for r in listed["resources"]]
        assert uris == [
            "notesvc://note/notes/work/plan%20copy.md",
            "notesvc://note/notes/work/plan.md",
            "notesvc://note/notes/a%20b/c%40d.md",
            "notesvc://note/notes/garden.md",
        ]
        first = listed["resources"][-1]
        assert first["name"] == "notes/garden.md"
        assert first["title"] == "Garden"
        assert first["mimeType"] == "text/markdown"
        assert first["size"] == len(NOTES["notes/garden.md"].encode())
        assert first["annotations"]["lastModified"].endswith("Z")

    @pytest.mark.slow
    def test_pages_of_100_follow_the_cursor_and_forged_cursors_are_refused(self, mcp):
        for i in range(150):
            put_note(mcp, f"notes/many/n{i:03d}.md", f"# N{i}\n")
        first = result(mcp, "resources/list")
        assert len(first["resources"]) == 100
        second = result(mcp, "resources/list", {"cursor": first["nextCursor"]})
        assert len(second["resources"]) == 54
        assert "nextCursor" not in second
        seen = [r["uri"] for r in first["resources"] + second["resources"]]
        assert len(set(seen)) == 154
        other = as_key(mcp, new_grant(mcp, "read")["key"])  # another caller's cursor
        for bad in ("x", "", "MTAwLmFiYw", first["nextCursor"] + "A", 5, "a" * 200):
            message = error(mcp, "resources/list", {"cursor": bad})["message"]
            assert "cursor" in message
        assert (
            "cursor" in error(other, "resources/list", {"cursor": first["nextCursor"]})["message"]
        )
        for method in ("resources/templates/list", "prompts/list", "tools/list"):
            error(mcp, method, {"cursor": "x"})

    @pytest.mark.slow
    def test_stale_cursors(self, mcp, monkeypatch):
        for i in range(120):
            put_note(mcp, f"notes/many/n{i:03d}.md", f"# N{i}\n")
        cursor = result(mcp, "resources/list")["nextCursor"]
        for i in range(100):  # the list shrinks under the cursor: a shorter (empty) page
            mcp.delete(f"{API}/notes/notes%2Fmany%2Fn{i:03d}.md")
        assert result(mcp, "resources/list", {"cursor": cursor}) == {"resources": []}
        # a restart: the key cursors are signed with is new (the package's module or the file)
        where = sys.modules.get("notesvc.mcp_resources", notesvc)
        monkeypatch.setattr(where, "_CURSOR_KEY", b"another server run")
        assert "restart" in error(mcp, "resources/list", {"cursor": cursor})["message"]

    def test_templates(self, mcp):
        templates = result(mcp, "resources/templates/list")["resourceTemplates"]
        assert [t["uriTemplate"] for t in templates] == [
            "notesvc://note/{path}",
            "notesvc://folder/{path}",
            "notesvc://version/{path}@{versionId}",
            "notesvc://attachment/{path}",
        ]
        assert all(t["name"] and t["description"] for t in templates)

    def test_read_a_note_a_folder_and_a_version(self, mcp):
        content = read(mcp, "notesvc://note/notes/a%20b/c%40d.md")
        assert content["text"] == NOTES["notes/a b/c@d.md"]
        assert content["mimeType"] == "text/markdown"
        assert content["_meta"]["etag"].startswith('"')
        assert read(mcp, "notesvc://note/notes%2Fgarden.md")["text"] == NOTES["notes/garden.md"]
        folder = read(mcp, "notesvc://folder/notes/work")["text"]
        assert folder.startswith("# notes/work\n")
        assert "- [Plan](notesvc://note/notes/work/plan.md)" in folder
        top = read(mcp, "notesvc://folder/notes")["text"]
        assert "- [work/](notesvc://folder/notes/work)" in top
        mcp.put_json(f"{API}/notes/notes%2Fgarden.md", {"content": "# Garden\n\nnow\n"})
        versions = mcp.get(f"{API}/notes/notes%2Fgarden.md/versions").json["data"]["versions"]
        old = read(mcp, f"notesvc://version/notes/garden.md@{versions[0]['id']}")
        assert old["text"] == NOTES["notes/garden.md"]
        assert old["_meta"]["etag"] == versions[0]["etag"]

    def test_attachments_are_blobs_up_to_1_mib_and_links_beyond(self, mcp):
        small = bytes(range(256)) * 4
        mcp.put(
            f"{API}/attachments/attachments%2Fx.png", small, headers={"Content-Type": "image/png"}
        )
        got = read(mcp, "notesvc://attachment/attachments/x.png")
        assert got["mimeType"] == "image/png"
        assert base64.b64decode(got["blob"]) == small
        big = b"\0" * ((1 << 20) + 1)
        mcp.put(f"{API}/attachments/attachments%2Fbig.pdf", big)
        link = read(mcp, "notesvc://attachment/attachments/big.pdf")
        assert link["mimeType"] == "text/uri-list"
        assert link["text"].endswith("/api/v1/attachments/attachments/big.pdf")
        assert link["_meta"]["tooLarge"] is True

    @pytest.mark.parametrize(
        "uri",
        [
            "notesvc://note/notes/../secret.md",
            "notesvc://note/notes/%2E%2E/x.md",
            "notesvc://note/notes%2F..%2Fx.md",
            "notesvc://note/notes//x.md",
            "notesvc://evil.example/notes/garden.md",
            "notesvc://note/notes/garden.md?x=1",
            "notesvc://note/notes/garden.md#top",
            "file:///etc/passwd",
            "https://example.com/notes/garden.md",
            "notesvc://version/notes/garden.md",
            "notesvc://note/notes/%ff.md",
            "notesvc://note/",
            "",
            "x" * 5000,
        ],
    )
    @pytest.mark.slow
    def test_hostile_uris_are_invalid_params(self, mcp, uri):
        assert error(mcp, "resources/read", {"uri": uri})["message"]

    def test_non_strings_and_missing_things(self, mcp):
        for params in ({}, {"uri": 5}, {"uri": ["notesvc://note/notes/garden.md"]}):
            error(mcp, "resources/read", params)
        for uri in (
            "notesvc://note/notes/none.md",
            "notesvc://folder/notes/none",
            "notesvc://attachment/attachments/none.png",
            "notesvc://version/notes/garden.md@0000000000000001-updated-" + "0" * 32,
        ):
            got = error(mcp, "resources/read", {"uri": uri}, -32002)
            assert got["data"] == {"uri": uri}
        error(mcp, "resources/read", {"uri": "notesvc://note/notes/x.txt"})  # not a note path

    def test_a_folder_key_reads_its_folder_only(self, mcp):
        work = as_key(mcp, new_grant(mcp, "read", folder="notes/work")["key"])
        names = [r["name"] for r in result(work, "resources/list")["resources"]]
        assert sorted(names) == ["notes/work/plan copy.md", "notes/work/plan.md"]
        assert read(work, "notesvc://note/notes/work/plan.md")["text"].startswith("# Plan")
        for uri in ("notesvc://note/notes/garden.md", "notesvc://folder/notes/a%20b"):
            error(work, "resources/read", {"uri": uri}, -32002)  # as if not there

    def test_a_person_lists_and_reads_their_reach(self, mcp):
        person, ann = device_of(mcp, webtest.TestApp(mcp.app), "Ann")
        put_note(ann, f"{person['home']}/mine.md", "# Mine\n")
        names = [r["name"] for r in result(ann, "resources/list")["resources"]]
        assert names == [f"{person['home']}/mine.md"]
        error(ann, "resources/read", {"uri": "notesvc://note/notes/garden.md"}, -32002)

    def test_subscribing_needs_a_session(self, mcp):
        for method in ("resources/subscribe", "resources/unsubscribe"):
            got = error(mcp, method, {"uri": "notesvc://note/notes/garden.md"}, -32600)
            assert "Mcp-Session-Id" in got["message"]

    def test_a_sessions_subscriptions_are_bounded_and_said(self, mcp, monkeypatch):
        monkeypatch.setattr(notesvc.McpSessions, "MAX_SUBSCRIPTIONS", 3)
        init = {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t"}}
        started = mcp.post_json(
            f"{API}/mcp", {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": init}
        )
        sid = {"Mcp-Session-Id": started.headers["Mcp-Session-Id"]}
        uris = [f"notesvc://note/notes/n{i}.md" for i in range(4)]
        for i in range(4):
            put_note(mcp, f"notes/n{i}.md", f"# N{i}\n")
        for uri in uris[:3]:
            assert rpc(mcp, "resources/subscribe", {"uri": uri}, **sid)["result"] == {}
        assert rpc(mcp, "resources/subscribe", {"uri": uris[0]}, **sid)["result"] == {}  # held
        over = rpc(mcp, "resources/subscribe", {"uri": uris[3]}, **sid)["error"]
        assert over["code"] == -32602
        assert "at most 3 subscriptions" in over["message"]
        assert over["data"] == {"uri": uris[3]}
        assert rpc(mcp, "resources/unsubscribe", {"uri": uris[1]}, **sid)["result"] == {}
        assert rpc(mcp, "resources/subscribe", {"uri": uris[3]}, **sid)["result"] == {}


class TestPrompts:
    def test_list_names_each_with_description_and_arguments(self, mcp):
        prompts = {p["name"]: p for p in result(mcp, "prompts/list")["prompts"]}
        assert set(prompts) == {"ingest", "weekly-review", "summarize-folder", "tidy"}
        for p in prompts.values():
            assert p["description"]
            assert p["title"]
            assert all({"name", "description", "required"} <= set(a) for a in p["arguments"])
        assert [a["name"] for a in prompts["ingest"]["arguments"] if a["required"]] == ["source"]

    def embedded(self, got: dict) -> list:
        return [
            m["content"]["resource"]["uri"]
            for m in got["messages"]
            if m["content"]["type"] == "resource"
        ]

    def test_ingest_embeds_the_source_note_and_related_notes(self, mcp):
        got = result(
            mcp, "prompts/get", {"name": "ingest", "arguments": {"source": "notes/a b/c@d.md"}}
        )
        assert got["description"]
        assert self.embedded(got)[0] == "notesvc://note/notes/a%20b/c%40d.md"
        text = result(
            mcp,
            "prompts/get",
            {
                "name": "ingest",
                "arguments": {"source": "Tomatoes like warm plants.", "folder": "notes/work"},
            },
        )
        assert "notes/work/" in text["messages"][0]["content"]["text"]
        assert "notesvc://note/notes/garden.md" in self.embedded(text)

    def test_weekly_review_lists_changes_and_open_tasks(self, mcp):
        got = result(mcp, "prompts/get", {"name": "weekly-review", "arguments": {}})
        intro = got["messages"][0]["content"]["text"]
        assert "- [ ] buy seeds (notes/garden.md)" in intro
        assert "notesvc://note/notes/garden.md" in self.embedded(got)
        future = result(
            mcp, "prompts/get", {"name": "weekly-review", "arguments": {"since": "2999-01-01"}}
        )
        assert self.embedded(future) == []

    def test_summarize_folder_and_tidy(self, mcp):
        got = result(
            mcp, "prompts/get", {"name": "summarize-folder", "arguments": {"path": "notes/work"}}
        )
        assert sorted(self.embedded(got)) == [
            "notesvc://note/notes/work/plan%20copy.md",
            "notesvc://note/notes/work/plan.md",
        ]
        tidy = result(mcp, "prompts/get", {"name": "tidy"})["messages"][0]["content"]["text"]
        assert "notes/a b/c@d.md: [[Missing page]]" in tidy
        assert "notes/work/plan.md · notes/work/plan copy.md" in tidy or (
            "notes/work/plan copy.md · notes/work/plan.md" in tidy
        )
        assert "Untagged:\n- notes/a b/c@d.md" in tidy

    def test_prompts_are_bounded_to_50_kb(self, mcp):
        for i in range(30):
            put_note(mcp, f"notes/big/n{i}.md", f"# N{i}\n\n" + "word " * 2000)
        got = result(
            mcp, "prompts/get", {"name": "summarize-folder", "arguments": {"path": "notes/big"}}
        )
        size = sum(
            len((m["content"].get("text") or m["content"]["resource"]["text"]).encode())
            for m in got["messages"]
        )
        assert 40_000 < size <= 50_000
        huge = result(mcp, "prompts/get", {"name": "ingest", "arguments": {"source": "x " * 40000}})
        assert len(json.dumps(huge)) < 60_000

    @pytest.mark.parametrize(
        ("params", "says"),
        [
            ({"name": "nope"}, "unknown prompt"),
            ({"name": 5}, "unknown prompt"),
            ({"name": "ingest"}, "source"),
            ({"name": "ingest", "arguments": {"source": 5}}, "string"),
            ({"name": "ingest", "arguments": []}, "object"),
            ({"name": "summarize-folder", "arguments": {"path": "notes/../x"}}, ""),
            ({"name": "summarize-folder", "arguments": {"path": "notes/none"}}, ""),
            ({"name": "weekly-review", "arguments": {"since": "last week"}}, "since"),
            ({"name": "tidy", "arguments": {"folder": "/etc"}}, ""),
            ({"name": "ingest", "arguments": {"source": "x" * 100_001}}, "100,000"),
        ],
    )
    @pytest.mark.slow
    def test_bad_arguments_are_invalid_params(self, mcp, params, says):
        assert says in error(mcp, "prompts/get", params)["message"]

    def test_a_folder_key_gets_prompts_of_its_reach(self, mcp):
        work = as_key(mcp, new_grant(mcp, "read", folder="notes/work")["key"])
        got = result(work, "prompts/get", {"name": "weekly-review"})
        assert all(u.startswith("notesvc://note/notes/work/") for u in self.embedded(got))
        error(work, "prompts/get", {"name": "summarize-folder", "arguments": {"path": "notes/a b"}})


class TestCompletion:
    def test_paths_in_reach_for_path_arguments(self, mcp):
        def values(ref, name, value):
            params = {"ref": ref, "argument": {"name": name, "value": value}}
            return result(mcp, "completion/complete", params)["completion"]

        folder = values({"type": "ref/prompt", "name": "summarize-folder"}, "path", "notes/w")
        assert folder["values"] == ["notes/work"]
        notes = values({"type": "ref/resource", "uri": "notesvc://note/{path}"}, "path", "plan")
        assert notes["values"] == ["notes/work/plan copy.md", "notes/work/plan.md"]
        assert values({"type": "ref/prompt", "name": "x"}, "arg1", "p") == {
            "values": [],
            "total": 0,
            "hasMore": False,
        }
        for bad in ({"ref": 5}, {"ref": {"type": "ref/x"}, "argument": {"name": "a", "value": ""}}):
            error(mcp, "completion/complete", bad)
