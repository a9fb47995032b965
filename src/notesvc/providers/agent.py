"""Agent providers: answering with a model."""

from __future__ import annotations

import base64
import dataclasses
import json
import urllib.parse
from typing import Any, Callable

from notesvc.boot import log
from notesvc.errors import ApiError
from notesvc.helpers import scrub, url_secrets
from notesvc.providers.base import (
    CONTEXT_BUDGET,
    Tool,
    UpstreamError,
    available_tools,
    call_tool,
    clip,
    matching,
    post_json,
    question_stems,
    registry_of,
    retrieve,
    tool_error,
)
from notesvc.service import Service, current_request_id
from notesvc.settings import Config

# -- agent providers ------------------------------------------------------------------


# (svc, question, found) -> (reply, model) or (reply, model, [paths of the sources]); with
# two items the sources are every note in `found`.
AnswerFn = Callable[[Any, str, list], tuple]


@dataclasses.dataclass(frozen=True)
class AgentProvider:
    name: str
    answer: AnswerFn  # raises UpstreamError when the model fails
    model: Callable[[Config], str]  # the model name reported by /agent/status
    enabled: bool = True
    description: str = ""
    requires: tuple = ()  # Config fields that must be set to use it (checked at start)


AGENT_PROVIDERS: dict[str, AgentProvider] = {}


def agent_provider(
    name: str,
    model: Callable[[Config], str],
    enabled: bool = True,
    description: str = "",
    requires: tuple = (),
) -> Callable[[AnswerFn], AnswerFn]:
    """Register an agent provider function under name."""

    def register(fn: AnswerFn) -> AnswerFn:
        provider = AgentProvider(name, fn, model, enabled, description, requires)
        registry_of("agent", AGENT_PROVIDERS)[name] = provider
        return fn

    return register


@agent_provider(
    "local",
    model=lambda cfg: "notesvc-local",
    description="offline: quotes the best-matching passages of your notes",
)
def answer_locally(svc: Service, question: str, found: list) -> tuple:
    """Quote the best-matching plain sentence of each note that matches, best note first."""
    quoted, stems = [], set(question_stems(question))
    for path, _, passages in found:
        best = matching(stems, passages)  # best_passages put the best one first
        if best:
            quoted.append((path, " ".join(best)))
    if not quoted:
        return f"Nothing in your notes matches “{clip(question, 80)}”.", "notesvc-local", []
    lines = ["From your notes:", *(f"• {passage} — {path}" for path, passage in quoted[:4])]
    return "\n".join(lines), "notesvc-local", [path for path, _ in quoted[:4]]


SYSTEM_PROMPT = (
    "You answer questions about the user's personal notes. Use only the notes below; "
    "name the note path you took an answer from; if the notes do not say, say so."
)
TOOLS_PROMPT = (
    "When the notes below do not answer the question, call the tools: search_notes to "
    "search again, read_note to read a whole note."
)
WRITE_PROMPT = (
    "Change notes only when the user asks you to; read a note first and pass the etag you "
    "read to update_note or move_note."
)
# who the agent's suggestions come from (SERVICE_AGENT_WRITE=suggest): their connector
AGENT_CONNECTOR = {"id": "agent", "name": "Agent"}
MAX_TOOL_CALLS_PER_STEP = 8  # run of one model answer; the others are answered "skipped"
MAX_TOOL_TEXT = 16000  # characters of one tool result a model is given


def model_context(found: list, budget: int = CONTEXT_BUDGET) -> str:
    """Return the notes for an upstream model, trimmed to the character budget."""
    parts, used = [], 0
    for path, title, passages in found:
        block = f"## {path} ({title})\n" + "\n".join(f"- {p}" for p in passages)
        if used + len(block) > budget:
            block = block[: max(0, budget - used)]
        if block:
            parts.append(block)
            used += len(block)
    return "\n\n".join(parts) or "(no note matched the question)"


def agent_endpoint(base_url: str, path: str, api_key: str = "") -> tuple:
    """Return (url, headers) for a call to path under an OpenAI-compatible base URL.

    urllib cannot send a `user:pass@` from the URL, so userinfo becomes a Basic
    credential (an API key, when set, wins as Bearer); a query string stays after the path.
    """
    parts = urllib.parse.urlsplit(base_url)
    userinfo, _, hostport = parts.netloc.rpartition("@")
    headers = {}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    elif userinfo:
        user, _, password = userinfo.partition(":")
        plain = f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password)}"
        headers["Authorization"] = "Basic " + base64.b64encode(plain.encode()).decode()
    full = parts._replace(netloc=hostport, path=parts.path.rstrip("/") + path, fragment="")
    return urllib.parse.urlunsplit(full), headers


@agent_provider(
    "openai",
    model=lambda cfg: cfg.agent_model,
    description="any OpenAI-compatible /chat/completions (Ollama, llama.cpp, vLLM, OpenAI)",
    requires=("agent_base_url", "agent_model"),
)
def answer_with_model(svc: Service, question: str, found: list) -> tuple:
    """Answer through an OpenAI-compatible model, in a bounded tool loop.

    The first call carries the best passages as context together with the tools, so a
    model that answers at once answers from the notes. Each answer with `tool_calls` gets
    the tools' results (`role: tool`) and another call, at most SERVICE_AGENT_MAX_STEPS
    calls in all (the last one with `tool_choice: "none"`). A model or server that refuses
    `tools` (HTTP 400 or 422) gets today's single call without them.
    """
    cfg = svc.config
    url, headers = agent_endpoint(cfg.agent_base_url, "/chat/completions", cfg.agent_api_key)
    tools = [t for t in available_tools(svc, cfg.agent_write) if not t.alias_of and not t.app_only]
    specs = [openai_tool(t) for t in tools]
    prompt = SYSTEM_PROMPT + (f" {TOOLS_PROMPT}" if specs else "")
    prompt += f" {WRITE_PROMPT}" if any(not t.read_only for t in tools) else ""
    messages = [
        {"role": "system", "content": f"{prompt}\n\n{model_context(found)}"},
        {"role": "user", "content": question},
    ]
    body = {"model": cfg.agent_model, "messages": messages, "temperature": 0.2, "stream": False}
    touched: list = []  # notes the tools read or changed, in order
    context = [path for path, _, _ in found]
    model = cfg.agent_model
    for step in range(cfg.agent_max_steps):
        last = step == cfg.agent_max_steps - 1
        if specs:
            body["tools"] = specs
            if last:  # the model must answer now (some servers refuse an explicit "auto")
                body["tool_choice"] = "none"
        try:
            answer = post_json(url, body, headers, cfg.agent_timeout)
        except UpstreamError as e:
            if not (step == 0 and specs and e.status in (400, 422)):
                raise
            log.info(
                "request %s: the model refused tools (%s); asking without them",
                current_request_id(),
                e,
            )
            specs = []
            body.pop("tools")
            body.pop("tool_choice", None)
            answer = post_json(url, body, headers, cfg.agent_timeout)
        message = _assistant_message(answer)
        model = str(answer.get("model") or cfg.agent_model)
        calls = message.get("tool_calls") if specs else None
        if not calls or not isinstance(calls, list):
            return _reply_text(message), model, touched + context
        if last:
            break
        content = message.get("content") or ""
        messages.append({"role": "assistant", "content": content, "tool_calls": calls})
        for i, call in enumerate(calls):
            if i < MAX_TOOL_CALLS_PER_STEP:
                messages.append(run_tool_call(svc, tools, call, touched))
            else:  # every call needs its answer, or the next request is refused
                messages.append(
                    _tool_message(call, f"skipped: at most {MAX_TOOL_CALLS_PER_STEP} calls at once")
                )
        log.debug(
            "request %s: agent step %d ran %d tool calls",
            current_request_id(),
            step + 1,
            len(calls),
        )
    reply = (
        f"I stopped after {cfg.agent_max_steps} model calls (SERVICE_AGENT_MAX_STEPS) without "
        "an answer; the notes I looked at are listed as sources."
    )
    return reply, model, touched + context


def _assistant_message(answer: dict) -> dict:
    try:
        message = answer["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        raise UpstreamError("the answer had no choices[0].message.content") from None
    if not isinstance(message, dict):
        raise UpstreamError("the answer had no choices[0].message.content")
    return message


def _reply_text(message: dict) -> str:
    reply = message.get("content")
    if not isinstance(reply, str):
        raise UpstreamError("the answer's content was not text")
    return reply.strip()


def openai_tool(tool: Tool) -> dict:
    """Return a tool as OpenAI's function-calling declaration."""
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": tool.schema},
    }


def run_tool_call(svc: Service, tools: list, call: Any, touched: list) -> dict:
    """Return the `role: tool` message answering one of a model's tool calls.

    A tool not offered (a write tool while SERVICE_AGENT_WRITE is off, a name the model
    made up) or arguments that are not JSON are refused in that message, for the model to
    read. A note a tool read or changed is added to `touched`.
    """
    call = call if isinstance(call, dict) else {}
    function = call.get("function") if isinstance(call.get("function"), dict) else {}
    name, raw = function.get("name"), function.get("arguments") or "{}"
    offered = {t.name: t for t in tools}
    if name in offered:
        try:
            arguments = json.loads(raw) if isinstance(raw, str) else raw
        except ValueError:
            result = tool_error("VALIDATION_ERROR", "the arguments are not valid JSON")
        else:
            suggest = AGENT_CONNECTOR if svc.config.agent_write == "suggest" else None
            result = call_tool(svc, offered[name], arguments, suggest)
            path = result["structuredContent"].get("path")
            if not result["isError"] and isinstance(path, str) and path not in touched:
                touched.append(path)
    elif name in svc.tools and not svc.tools[name].read_only:
        result = tool_error(
            "FORBIDDEN",
            f"{name} changes notes, and the owner has not allowed the agent to change notes "
            "(SERVICE_AGENT_WRITE is off); tell the user instead",
        )
    else:
        result = tool_error(
            "NOT_FOUND", f"there is no tool {str(name)[:64]!r}; use one of {', '.join(offered)}"
        )
    return _tool_message(call, result["content"][0]["text"])


def _tool_message(call: Any, text: str) -> dict:
    call_id = str(call.get("id", "")) if isinstance(call, dict) else ""
    return {"role": "tool", "tool_call_id": call_id, "content": clip(text, MAX_TOOL_TEXT)}


@agent_provider("none", model=lambda cfg: "", enabled=False, description="agent switched off")
def answer_nothing(svc: Service, question: str, found: list) -> tuple:
    raise ApiError(503, "AGENT_DISABLED", "the agent is off (SERVICE_AGENT_PROVIDER=none)")


def ask_agent(
    svc: Service, question: str, note: str | None = None, folder: str | tuple = ""
) -> dict:
    """Return the agent's {reply, provider, model, sources} for a question (its sources
    inside `folder` only, when a folder grant asks)."""
    provider = svc.agent_providers[svc.config.agent_provider]
    if not provider.enabled:
        raise ApiError(503, "AGENT_DISABLED", "the agent is off (SERVICE_AGENT_PROVIDER=none)")
    found = retrieve(svc, question, note, folder=folder)
    try:
        answer = provider.answer(svc, question, found)
    except UpstreamError as e:
        raise e.api_error("the model endpoint") from None
    cfg = svc.config  # what the model was sent never comes back out (an echoing endpoint)
    sent = [cfg.agent_api_key, *url_secrets(cfg.agent_base_url)]
    reply, model = scrub(answer[0], sent), scrub(str(answer[1]), sent)
    titles = {path: title for path, title, _ in found}
    if len(answer) > 2:  # the provider names its sources (notes that may be gone since)
        paths = [p for p in dict.fromkeys(answer[2]) if p in titles or svc.notes.exists(p)]
    else:
        paths = list(titles)
    if folder:  # a reach: whatever a provider names, no note outside it is a source
        within = tuple(
            f.rstrip("/") + "/" for f in ((folder,) if isinstance(folder, str) else folder)
        )
        paths = [p for p in paths if isinstance(p, str) and p.startswith(within)]
    sources = [{"path": p, "title": titles.get(p) or svc.index.title_of(p) or p} for p in paths]
    return {"reply": reply, "provider": provider.name, "model": model, "sources": sources}
