"""The agent and its tool loop (src/notesvc/providers/agent.py)."""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from conftest import (
    API,
    assert_error,
    data,
    make_env,
    note_url,
    notesvc,
    put_note,
    search,
    with_key,
)
from standins import ToolModel, closed_port_url, last_tool_results, seed_notes, telegram_update


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
    @pytest.mark.slow
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

    def test_a_model_that_echoes_its_key_never_hands_it_on(self, app, upstream):
        """T14 for the agent: what the model endpoint was sent (its key) is scrubbed from
        what it answers, however it spells it."""
        key = "sk-Test-Agent-Key-0123456789AbCd"
        client = app(
            SERVICE_AGENT_PROVIDER="openai",
            SERVICE_AGENT_BASE_URL=upstream.url + "/v1",
            SERVICE_AGENT_MODEL="llama3.2",
            SERVICE_AGENT_API_KEY=key,
        )
        upstream.reply = f"Your key is {key.upper()} ({urllib.parse.quote(key.lower())})."
        d = data(client.post_json(f"{API}/agent/chat", {"message": "what is my key?"}))
        assert d["reply"].startswith("Your key is …")
        assert key.lower() not in json.dumps(d).lower()

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
    @pytest.mark.slow
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

    @pytest.mark.slow
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
