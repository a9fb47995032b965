"""Suggestions: an assistant's edits kept for approval (src/notesvc/suggestions.py), made by
the write tools in suggest mode, listed, accepted and rejected through /api/v1/suggestions."""

from __future__ import annotations

import json

import pytest
import webtest

from conftest import (
    API,
    CALLBACK,
    approve,
    as_key,
    assert_error,
    call_tool,
    data,
    new_grant,
    notesvc,
    ok_tool,
    pkce_pair,
    put_note,
    register_client,
    rpc,
    tool_refused,
    with_key,
    with_status,
)
from test_people import device_of

GARDEN = "# Garden\n\nPlant tomatoes in May.\n\nWater weekly.\n"


def note(client, path: str) -> dict:
    return data(client.get(f"{API}/notes/{path.replace('/', '%2F')}"))


def suggestions(client, status: int = 200, **params) -> dict:
    resp = client.get(f"{API}/suggestions", params, expect_errors=True)
    return with_status(resp, status).json["data"]


def accept(client, sid: str, status: int = 200):
    resp = client.post(f"{API}/suggestions/{sid}/accept", expect_errors=True)
    return with_status(resp, status)


def reject(client, sid: str, status: int = 200):
    resp = client.post(f"{API}/suggestions/{sid}/reject", expect_errors=True)
    return with_status(resp, status)


def suggested(client, tool: str, **arguments) -> dict:
    """Call a write tool in suggest mode; return the suggestion it made."""
    made = ok_tool(client, tool, **arguments)
    assert set(made) >= {"suggestion"}, made
    return made["suggestion"]


@pytest.fixture
def suggesting(make_app):
    client = with_key(make_app(SERVICE_MCP_WRITE="suggest"))
    put_note(client, "notes/garden.md", GARDEN)
    return client


class TestSuggestionsFromTools:
    """Suggest mode: each write tool changes nothing and makes a suggestion instead."""

    def test_every_write_tool_makes_a_suggestion_and_changes_nothing(self, suggesting):
        etag = note(suggesting, "notes/garden.md")["etag"]
        made = [
            suggested(suggesting, "create_note", path="notes/new.md", content="# New\n"),
            suggested(
                suggesting, "update_note", path="notes/garden.md", content="# G\n", etag=etag
            ),
            suggested(suggesting, "append_to_note", path="notes/garden.md", text="- basil"),
            suggested(suggesting, "replace_in_note", path="notes/garden.md", old="May", new="June"),
            suggested(
                suggesting, "move_note", path="notes/garden.md", newPath="notes/g2.md", etag=etag
            ),
            suggested(suggesting, "delete_note", path="notes/garden.md"),
        ]
        assert [s["kind"] for s in made] == ["create", "edit", "edit", "edit", "move", "delete"]
        assert note(suggesting, "notes/garden.md")["content"] == GARDEN  # untouched
        suggesting.get(f"{API}/notes/notes%2Fnew.md", status=404)
        for s in made:
            assert s["url"].endswith(f"/#suggestion={s['id']}")
        assert "+- basil" in made[2]["diff"]
        assert "-Plant tomatoes in May." in made[3]["diff"]
        assert "+Plant tomatoes in June." in made[3]["diff"]
        listed = suggestions(suggesting)
        assert listed["total"] == 6
        assert [s["id"] for s in listed["suggestions"]] == [s["id"] for s in reversed(made)]
        first = listed["suggestions"][-1]
        assert set(first) == {
            "id",
            "kind",
            "path",
            "base",
            "content",
            "diff",
            "connector",
            "createdAt",
            "url",
        }
        assert first["base"] is None  # a create starts from nothing
        assert first["connector"] == {"id": "owner", "name": "API key"}
        move = listed["suggestions"][1]
        assert (move["newPath"], move["base"]) == ("notes/g2.md", etag)
        assert move["diff"] == "rename from notes/garden.md\nrename to notes/g2.md\n"

    def test_the_text_says_it_is_a_suggestion_with_its_link(self, suggesting):
        result = call_tool(suggesting, "append_to_note", path="notes/garden.md", text="- basil")
        text = result["content"][0]["text"]
        assert text.startswith("Suggested (edit notes/garden.md), not applied")
        assert "#suggestion=" in text
        assert "+- basil" in text

    def test_refusals_are_the_same_as_for_writes(self, suggesting):
        tool_refused(suggesting, "create_note", "CONFLICT", path="notes/garden.md", content="x")
        tool_refused(
            suggesting, "update_note", "PRECONDITION_FAILED", path="notes/garden.md",
            content="x", etag='"0"',
        )  # fmt: skip
        tool_refused(
            suggesting, "replace_in_note", "CONFLICT", path="notes/garden.md", old="nope", new="x"
        )
        tool_refused(suggesting, "append_to_note", "NOT_FOUND", path="notes/none.md", text="x")
        tool_refused(suggesting, "create_note", "VALIDATION_ERROR", path="../x.md", content="x")
        assert suggestions(suggesting)["total"] == 0

    def test_restore_version_is_a_suggestion_too(self, suggesting):
        suggesting.put_json(f"{API}/notes/notes%2Fgarden.md", {"content": "# Garden\n\nnew\n"})
        vid = ok_tool(suggesting, "note_history", path="notes/garden.md")["versions"][0]["id"]
        etag = note(suggesting, "notes/garden.md")["etag"]
        s = suggested(
            suggesting, "restore_version", path="notes/garden.md", versionId=vid, etag=etag
        )
        assert s["kind"] == "edit"
        assert note(suggesting, "notes/garden.md")["content"] == "# Garden\n\nnew\n"
        accept(suggesting, s["id"])
        assert note(suggesting, "notes/garden.md")["content"] == GARDEN

    def test_the_tools_say_suggest_mode_in_their_schema_and_meta(self, suggesting):
        listed = {t["name"]: t for t in rpc(suggesting, "tools/list")["result"]["tools"]}
        for name in ("create_note", "update_note", "move_note", "delete_note", "restore_version"):
            tool = listed[name]
            assert tool["outputSchema"]["required"] == ["suggestion"]
            assert tool["_meta"]["ui"]["resourceUri"] == "ui://notesvc/review"
        for name in ("accept_suggestion", "reject_suggestion"):
            assert listed[name]["_meta"]["ui"]["visibility"] == ["app"]
        assert listed["note_diff"]["_meta"]["ui"]["resourceUri"] == "ui://notesvc/review"
        assert "_meta" not in listed["read_note"]
        init = rpc(suggesting, "initialize", {"protocolVersion": "2025-11-25"})["result"]
        assert "suggestions" in init["instructions"]


class TestAcceptAndReject:
    def test_accepting_an_edit_applies_it_saved_by_the_connector(self, suggesting):
        key = new_grant(suggesting, "write", name="Claude")["key"]
        claude = as_key(suggesting, key)
        s = suggested(claude, "append_to_note", path="notes/garden.md", text="- basil")
        done = data(accept(suggesting, s["id"]))
        assert done["suggestion"] == {"id": s["id"], "status": "accepted"}
        assert done["merged"] is False
        assert done["note"]["content"] == GARDEN + "- basil\n"
        versions = data(suggesting.get(f"{API}/notes/notes%2Fgarden.md/versions"))["versions"]
        assert (versions[0]["reason"], versions[0]["savedBy"]) == ("suggestion", "Claude")
        accept(suggesting, s["id"], 404)  # closed: gone
        reject(suggesting, s["id"], 404)
        assert suggestions(suggesting)["total"] == 0

    def test_an_edit_behind_the_note_is_merged_or_kept_as_a_conflict_copy(self, suggesting):
        far = suggested(
            suggesting, "replace_in_note", path="notes/garden.md", old="May", new="June"
        )
        near = suggested(
            suggesting, "replace_in_note", path="notes/garden.md", old="weekly", new="daily"
        )
        # the note moves on where the first does not touch, and where the second does
        suggesting.put_json(
            f"{API}/notes/notes%2Fgarden.md",
            {"content": GARDEN.replace("Water weekly.", "Water every day.")},
        )
        done = data(accept(suggesting, far["id"]))
        assert done["merged"] is True
        assert done["note"]["content"] == (
            "# Garden\n\nPlant tomatoes in June.\n\nWater every day.\n"
        )
        clash = accept(suggesting, near["id"], 409)
        error = assert_error(clash, 409, "CONFLICT")
        assert error["path"] == "notes/garden.md"
        copy = note(suggesting, error["conflictPath"])
        assert "Water daily." in copy["content"]  # the suggestion, kept whole
        assert "Water every day." in note(suggesting, "notes/garden.md")["content"]
        assert suggestions(suggesting)["total"] == 0  # both closed

    def test_a_create_onto_a_taken_path_gets_2(self, suggesting):
        s = suggested(suggesting, "create_note", path="notes/idea.md", content="# Idea\n")
        put_note(suggesting, "notes/idea.md", "# Mine\n")
        done = data(accept(suggesting, s["id"]))
        assert done["note"]["path"] == "notes/idea 2.md"
        assert note(suggesting, "notes/idea.md")["content"] == "# Mine\n"

    def test_a_move_or_delete_applies_only_while_the_note_is_its_base(self, suggesting):
        etag = note(suggesting, "notes/garden.md")["etag"]
        move = suggested(
            suggesting, "move_note", path="notes/garden.md", newPath="notes/veg.md", etag=etag
        )
        gone = suggested(suggesting, "delete_note", path="notes/garden.md", etag=etag)
        suggesting.put_json(f"{API}/notes/notes%2Fgarden.md", {"content": "# Garden\n\nmore\n"})
        for s in (move, gone):
            assert_error(accept(suggesting, s["id"], 409), 409, "CONFLICT")
        assert suggestions(suggesting)["total"] == 2  # still open
        data(reject(suggesting, move["id"]))
        etag = note(suggesting, "notes/garden.md")["etag"]
        fresh = suggested(suggesting, "delete_note", path="notes/garden.md", etag=etag)
        data(accept(suggesting, fresh["id"]))
        suggesting.get(f"{API}/notes/notes%2Fgarden.md", status=404)
        trash = data(suggesting.get(f"{API}/trash"))["items"]
        assert trash[0]["path"] == "notes/garden.md"

    def test_a_move_accepted_moves_the_note(self, suggesting):
        etag = note(suggesting, "notes/garden.md")["etag"]
        s = suggested(
            suggesting, "move_note", path="notes/garden.md", newPath="notes/veg/g.md", etag=etag
        )
        done = data(accept(suggesting, s["id"]))
        assert done["note"]["path"] == "notes/veg/g.md"
        assert note(suggesting, "notes/veg/g.md")["content"] == GARDEN

    def test_rejecting_changes_nothing(self, suggesting):
        s = suggested(suggesting, "create_note", path="notes/new.md", content="x")
        assert data(reject(suggesting, s["id"])) == {"id": s["id"], "status": "rejected"}
        suggesting.get(f"{API}/notes/notes%2Fnew.md", status=404)
        assert_error(reject(suggesting, s["id"], 404), 404, "NOT_FOUND")

    def test_unknown_and_hostile_ids_are_404(self, suggesting):
        for sid in ("nope", "x" * 64, "..%2F..%2Fetc", "%00"):
            assert_error(accept(suggesting, sid, 404), 404, "NOT_FOUND")
        suggesting.post(f"{API}/suggestions/{'x' * 65}/accept", status=[400, 404])

    def test_accept_takes_no_body_and_ignores_one(self, suggesting):
        s = suggested(suggesting, "append_to_note", path="notes/garden.md", text="- kale")
        resp = suggesting.post(
            f"{API}/suggestions/{s['id']}/accept",
            "{broken",
            headers={"Content-Type": "application/json"},
        )
        assert data(resp)["note"]["content"].endswith("- kale\n")

    @pytest.mark.slow
    def test_the_201st_rejects_the_oldest_and_says_so(self, suggesting, monkeypatch):
        first = suggested(suggesting, "create_note", path="notes/n0.md", content="0")
        store = suggesting.app.service.suggestions
        for i in range(1, 200):  # filled through the store, the way the tool does
            store.add({**store.get(first["id"]), "id": f"s{i:03d}", "path": f"notes/n{i}.md"})
        assert suggestions(suggesting, limit=200)["total"] == 200
        made = ok_tool(suggesting, "create_note", path="notes/last.md", content="x")
        assert made["rejected"] == [{"id": first["id"], "path": "notes/n0.md"}]
        assert "at most 200" in made["note"]
        text = call_tool(suggesting, "create_note", path="notes/last2.md", content="x")
        assert "at most 200" in text["content"][0]["text"]
        listed = suggestions(suggesting, limit=200)
        assert listed["total"] == 200
        assert first["id"] not in {s["id"] for s in listed["suggestions"]}
        accept(suggesting, first["id"], 404)

    def test_paging_and_bad_parameters(self, suggesting):
        for i in range(3):
            suggested(suggesting, "create_note", path=f"notes/p{i}.md", content="x")
        page = suggestions(suggesting, limit=2, offset=1)
        assert (page["total"], page["limit"], page["offset"]) == (3, 2, 1)
        assert [s["path"] for s in page["suggestions"]] == ["notes/p1.md", "notes/p0.md"]
        for bad in ({"limit": "0"}, {"limit": "x"}, {"offset": "-1"}, {"limit": "201"}):
            assert_error(
                suggesting.get(f"{API}/suggestions", bad, expect_errors=True),
                400,
                "VALIDATION_ERROR",
            )

    def test_suggestions_survive_a_restart(self, make_app, root):
        client = with_key(make_app(SERVICE_MCP_WRITE="suggest"))
        put_note(client, "notes/garden.md", GARDEN)
        s = suggested(client, "append_to_note", path="notes/garden.md", text="- leek")
        again = with_key(make_app(SERVICE_MCP_WRITE="suggest"), key=client.extra_environ[
            "HTTP_X_SERVICE_KEY"
        ])  # fmt: skip
        assert [x["id"] for x in suggestions(again)["suggestions"]] == [s["id"]]
        assert data(accept(again, s["id"]))["note"]["content"].endswith("- leek\n")


class TestSuggestionsAndGrants:
    def test_a_revoked_connectors_suggestion_still_applies_and_it_can_make_no_more(
        self, suggesting
    ):
        grant = new_grant(suggesting, "write", name="Claude")
        claude = as_key(suggesting, grant["key"])
        s = suggested(claude, "append_to_note", path="notes/garden.md", text="- chard")
        suggesting.delete(f"{API}/auth/keys/{grant['id']}")
        resp = claude.post(
            f"{API}/mcp",
            json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}),
            headers={"Content-Type": "application/json"},
            status=401,
        )
        assert resp.json["error"]["data"]["code"] == "UNAUTHORIZED"
        done = data(accept(suggesting, s["id"]))  # the person decides
        assert done["note"]["content"].endswith("- chard\n")

    def test_a_read_key_lists_but_may_not_decide(self, suggesting):
        s = suggested(suggesting, "create_note", path="notes/x.md", content="x")
        reader = as_key(suggesting, new_grant(suggesting, "read")["key"])
        assert suggestions(reader)["total"] == 1
        assert_error(accept(reader, s["id"], 403), 403, "FORBIDDEN")
        assert_error(reject(reader, s["id"], 403), 403, "FORBIDDEN")
        suggesting.get(f"{API}/suggestions", status=401, extra_environ={"HTTP_X_SERVICE_KEY": ""})

    def test_a_person_sees_and_decides_the_suggestions_in_their_reach_only(self, suggesting):
        person, ann = device_of(suggesting, webtest.TestApp(suggesting.app), "Ann")
        home = person["home"]
        put_note(ann, f"{home}/list.md", "# List\n")
        mine = suggested(ann, "append_to_note", path=f"{home}/list.md", text="- milk")
        owners = suggested(suggesting, "create_note", path="notes/private.md", content="x")
        listed = suggestions(ann)
        assert [s["id"] for s in listed["suggestions"]] == [mine["id"]]
        assert listed["suggestions"][0]["connector"]["name"] == "Ann · Ann's phone"
        assert_error(accept(ann, owners["id"], 404), 404, "NOT_FOUND")
        assert_error(reject(ann, owners["id"], 404), 404, "NOT_FOUND")
        assert suggestions(suggesting)["total"] == 2  # the owner sees both
        data(accept(ann, mine["id"]))
        assert note(ann, f"{home}/list.md")["content"] == "# List\n- milk\n"
        # a folder grant's write tools stay in its folder, suggesting or not
        tool_refused(ann, "create_note", "NOT_FOUND", path="notes/elsewhere.md", content="x")

    def test_write_tools_in_a_read_share_are_refused(self, suggesting):
        person, ann = device_of(suggesting, webtest.TestApp(suggesting.app), "Ann")
        put_note(suggesting, "notes/shared/a.md", "# A\n")
        suggesting.put_json(
            f"{API}/folders/notes%2Fshared/members",
            {"members": [{"person": person["id"], "scope": "read"}]},
        )
        tool_refused(ann, "append_to_note", "FORBIDDEN", path="notes/shared/a.md", text="x")
        assert suggestions(suggesting)["total"] == 0


class TestAgentSuggests:
    def test_the_agent_in_suggest_mode_makes_suggestions(self, make_app):
        from standins import ToolModel

        model = ToolModel(
            lambda m: [("append_to_note", {"path": "notes/garden.md", "text": "- x"})],
            lambda m: "I suggested it.",
        )
        try:
            client = with_key(
                make_app(
                    SERVICE_AGENT_PROVIDER="openai",
                    SERVICE_AGENT_BASE_URL=model.url + "/v1",
                    SERVICE_AGENT_MODEL="m",
                    SERVICE_AGENT_WRITE="suggest",
                )
            )
            put_note(client, "notes/garden.md", GARDEN)
            answer = data(client.post_json(f"{API}/agent/chat", {"message": "add x to garden"}))
            asked = [r["json"] for r in model.requests if "tools" in (r.get("json") or {})]
            offered = {t["function"]["name"] for t in asked[0]["tools"]}
        finally:
            model.close()
        assert answer["reply"] == "I suggested it."
        assert note(client, "notes/garden.md")["content"] == GARDEN
        listed = suggestions(client)["suggestions"]
        assert [(s["kind"], s["connector"]) for s in listed] == [
            ("edit", {"id": "agent", "name": "Agent"})
        ]
        assert "accept_suggestion" not in offered  # the agent never approves itself
        assert "append_to_note" in offered
        data(accept(client, listed[0]["id"]))
        versions = data(client.get(f"{API}/notes/notes%2Fgarden.md/versions"))["versions"]
        assert versions[0]["savedBy"] == "Agent"

    def test_the_consent_page_offers_write_as_suggestions(self, suggesting):
        cid = register_client(suggesting)["client_id"]
        _, challenge = pkce_pair()
        q = {
            "client_id": cid,
            "redirect_uri": CALLBACK,
            "response_type": "code",
            "code_challenge": challenge,
            "code_challenge_method": "S256",
            "scope": "notes:read notes:write",
        }
        facts = data(suggesting.get(f"{API}/oauth/consent", q))
        assert (facts["writeAllowed"], facts["scope"]) == ("suggest", "write")
        code, verifier, _ = approve(suggesting, cid, "notes:read notes:write")
        form = {
            "grant_type": "authorization_code",
            "code": code,
            "client_id": cid,
            "redirect_uri": CALLBACK,
            "code_verifier": verifier,
        }
        tokens = suggesting.post("/oauth/token", form).json
        assert tokens["scope"] == "notes:read notes:write"
        connector = as_key(suggesting, tokens["access_token"])
        made = suggested(connector, "create_note", path="notes/new.md", content="# New\n")
        assert [s["id"] for s in suggestions(suggesting)["suggestions"]] == [made["id"]]
        assert suggesting.get(f"{API}/notes/notes%2Fnew.md", expect_errors=True).status_int == 404

    def test_the_settings_take_suggest(self):
        cfg = notesvc.load_config(
            env={"SERVICE_MCP_WRITE": "suggest", "SERVICE_AGENT_WRITE": "suggest"}
        )
        assert (cfg.mcp_write, cfg.agent_write) == ("suggest", "suggest")
        with pytest.raises(notesvc.ConfigError, match="true, false or suggest"):
            notesvc.load_config(env={"SERVICE_MCP_WRITE": "suggestion"})
