"""Provider records, outbound HTTP, retrieval and the TOOLS registry."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import re
import socket
import threading
import urllib.parse
from typing import Any, Callable

from notesvc.boot import log
from notesvc.errors import ApiError, DiskFull, bad_request, to_json
from notesvc.grants import request_principal
from notesvc.helpers import BODY_CHUNK
from notesvc.notes.paths import MAX_SCAN_CHARS
from notesvc.search.text import MAX_QUERY_CHARS, WORD_RE, Query, fold, stem, tokenize
from notesvc.service import Service, current_request_id

# -- Providers -----------------------------------------------------------------------------
#
# Agents answer questions from the notes; channels carry messages in and replies
# out. Both are registries of small records filled by decorators, so a plugin adds
# one exactly the way the built-ins are added.

STOPWORDS = frozenset(
    """a about am an and any are as at be been but by can could did do does doing for from
    get got had has have having he her here hers him his how i if in into is it its just
    me my mine no nor not now of off on once only or our ours out over own please put
    said same she should so some such than that the their theirs them then there these
    they this those to too under until up very was we were what when where which while
    who whom why will with would you your yours""".split()
)
CONTEXT_BUDGET = 12000  # characters of notes an upstream model is given
REPLY_LIMIT = 4000  # characters of a reply sent through a messaging channel
MAX_MESSAGE_CHARS = 8000  # of a question to the agent

# The built-in registries are filled by the decorators below. While a plugin file loads,
# the same decorators fill that plugin's own registries instead (see load_plugins), so
# each app sees the built-ins plus its own plugins' providers, never another app's.
_COLLECTING = threading.local()


def registry_of(kind: str, builtin: dict) -> dict:
    target = getattr(_COLLECTING, "registries", None)
    return builtin if target is None else target.setdefault(kind, {})


@contextlib.contextmanager
def collecting_registrations():
    """Within the block, provider decorators fill the yielded dict, not the built-ins."""
    registries: dict = {}
    _COLLECTING.registries = registries
    try:
        yield registries
    finally:
        _COLLECTING.registries = None


class UpstreamError(Exception):
    """An outbound call failed; `timeout` tells a time-out from any other failure."""

    def __init__(self, message: str, timeout: bool = False, status: int = 0):
        super().__init__(message)
        self.timeout = timeout
        self.status = status  # the HTTP status the other side answered, 0 when none

    def api_error(self, what: str) -> ApiError:
        if self.timeout:
            return ApiError(504, "UPSTREAM_TIMEOUT", f"{what} did not answer in time: {self}")
        return ApiError(502, "UPSTREAM_ERROR", f"{what} failed: {self}")


def _no_redirects() -> Any:
    """Return a urllib opener that follows no redirect: a 3xx is an HTTPError (urllib would
    send the Authorization header on to wherever the 3xx points)."""
    import urllib.request

    class Refuse(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any, **kwargs: Any) -> None:
            return None

    return urllib.request.build_opener(Refuse)


def post_json(url: str, body: dict, headers: dict | None = None, timeout: float = 30) -> dict:
    """POST body as JSON and return the JSON answer; UpstreamError on any failure (a
    redirect included: never followed).

    Messages never include the URL (it may carry a bot token) or the headers.
    """
    import http.client  # outbound calls only: kept off the start-up path
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode()
    req = urllib.request.Request(
        url, data, {"Content-Type": "application/json", **(headers or {})}, method="POST"
    )
    try:
        with _no_redirects().open(req, timeout=timeout) as resp:
            raw = resp.read(4 << 20)
    except urllib.error.HTTPError as e:
        e.close()  # it holds the response (and its socket) open
        raise UpstreamError(f"HTTP {e.code}", status=e.code) from None
    except urllib.error.URLError as e:
        timed_out = isinstance(e.reason, (socket.timeout, TimeoutError))
        raise UpstreamError(
            str(getattr(e.reason, "strerror", None) or e.reason), timed_out
        ) from None
    except (socket.timeout, TimeoutError):
        raise UpstreamError("timed out", timeout=True) from None
    except (OSError, http.client.HTTPException) as e:
        raise UpstreamError(type(e).__name__) from None
    try:
        answer = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise UpstreamError("the answer was not JSON") from None
    if not isinstance(answer, dict):
        raise UpstreamError("the answer was not a JSON object")
    return answer


class Outbound:
    """Outbound HTTP(S) calls over one kept-alive connection, with bounded answers.

    abort() from another thread ends a call in flight at once (a poller's long poll when
    its channel is switched off). Messages never include the URL (a bot token is in it).
    A 2xx answer's body goes to `sink` chunk by chunk when one is given (a download
    straight to disk), else it is returned; any answer over `limit` is an UpstreamError.
    """

    def __init__(self):
        self._conn: Any = None
        self._origin: tuple = ()
        self._aborted = False
        self._lock = threading.Lock()

    def __enter__(self) -> Outbound:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            conn = self._conn
        sock = getattr(conn, "sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _drop(self, conn: Any) -> None:
        with self._lock:
            if self._conn is conn:
                self._conn = None
        conn.close()

    def _connection(self, scheme: str, host: str, timeout: float) -> tuple:
        import http.client

        with self._lock:
            if self._aborted:
                raise UpstreamError("stopped")
            fresh = self._conn is None or self._origin != (scheme, host)
            if fresh:
                if self._conn is not None:
                    self._conn.close()
                https = scheme == "https"
                kind = http.client.HTTPSConnection if https else http.client.HTTPConnection
                self._conn, self._origin = kind(host, timeout=timeout), (scheme, host)
            conn = self._conn
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn, fresh

    def request(
        self,
        method: str,
        url: str,
        body: Any = None,
        headers: dict | None = None,
        timeout: float = 30.0,
        limit: int = 4 << 20,
        sink: Callable | None = None,
    ) -> tuple:
        """Return (status, {lower-case header: value}, body bytes) of one call."""
        import http.client

        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise UpstreamError("not an http(s) URL")
        host = parts.netloc.rpartition("@")[2]
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        for attempt in (1, 2):
            conn, fresh = self._connection(parts.scheme, host, timeout)
            try:
                conn.request(method, target, body=body, headers=headers or {})
                resp = conn.getresponse()
                break
            except (OSError, http.client.HTTPException) as e:
                self._drop(conn)
                resend = body is None or isinstance(body, bytes)
                if attempt == 2 or fresh or self._aborted or not resend or _timed_out(e):
                    raise _upstream_error(e) from None
        try:
            status = resp.status
            answer = {k.lower(): v for k, v in resp.getheaders()}
            good = 200 <= status < 300
            cap = limit if good else 65536
            declared = answer.get("content-length", "")
            if declared.isdigit() and int(declared) > cap:
                raise UpstreamError(f"the answer is over {cap} bytes")
            data, seen = bytearray(), 0
            while True:
                chunk = resp.read(BODY_CHUNK)
                if not chunk:
                    break
                seen += len(chunk)
                if seen > cap:
                    raise UpstreamError(f"the answer is over {cap} bytes")
                if good and sink is not None:
                    sink(chunk)
                else:
                    data += chunk
        except DiskFull:
            self._drop(conn)
            raise
        except UpstreamError:
            self._drop(conn)
            raise
        except (OSError, http.client.HTTPException) as e:
            self._drop(conn)
            raise _upstream_error(e) from None
        if resp.will_close:
            self._drop(conn)
        return status, answer, bytes(data)


def _timed_out(e: BaseException) -> bool:
    return isinstance(e, (socket.timeout, TimeoutError))


def _upstream_error(e: BaseException) -> UpstreamError:
    if _timed_out(e):
        return UpstreamError("timed out", timeout=True)
    return UpstreamError(str(getattr(e, "strerror", None) or type(e).__name__))


# -- retrieval ---------------------------------------------------------------------


def question_stems(question: str) -> list:
    """Return the stems of a natural-language question, stopwords dropped."""
    words = [w for w in WORD_RE.findall(fold(question)) if w not in STOPWORDS]
    return [stem(w) for w in dict.fromkeys(words)]


_SENTENCE_RE = re.compile(r"(?<=[.!?])\s+|\n+")
# Markdown a quoted sentence leaves out; every pattern runs in linear time.
_MD_LEAD_RE = re.compile(
    r"^(?:#{1,6}[ \t]+|>[ \t]*|(?:[-*+]|\d{1,9}[.)])[ \t]+(?:\[[ xX]\][ \t]+)?)+"
)
_MD_LINK_RE = re.compile(r"!?\[([^\[\]\n]*)\]\([^()\s]*(?:[ \t]+\"[^\"\n]*\")?\)")
_MD_WIKILINK_RE = re.compile(r"\[\[([^\[\]|\n]*)(?:\|([^\[\]\n]*))?\]\]")
_MD_MARKS_RE = re.compile(
    r"\*\*|__|~~|`|(?<![\w*])\*(?=\S)|(?<=\S)\*(?![\w*])|(?<!\w)_(?=\S)|(?<=\S)_(?!\w)"
)
_MD_INLINE_RE = re.compile(r"[*_~`\[]")  # a sentence without these has no inline marks
_HEADING_MARK_RE = re.compile(r"^[ \t]*#{1,6}[ \t]+", re.M)
_LINE_MARKS_RE = re.compile(
    r"^[ \t]*(?:>[ \t]*|(?:[-*+]|\d{1,9}[.)])[ \t]+(?:\[[ xX]\][ \t]+)?)+", re.M
)


def plain_text(line: str) -> str:
    """Return a line of Markdown as plain text: no heading, quote or list marks, no emphasis
    or code marks, links as their text.

    >>> plain_text("- [ ] **Buy** [milk](shop.md) and [[eggs|the eggs]] for *Anna*, `now`")
    'Buy milk and the eggs for Anna, now'
    """
    line = _MD_LEAD_RE.sub("", line.strip())
    line = _MD_WIKILINK_RE.sub(lambda m: m.group(2) or m.group(1), line)
    line = _MD_LINK_RE.sub(r"\1", line)
    return " ".join(_MD_MARKS_RE.sub("", line).split())


def best_passages(weights: dict, text: str, keep: int = 2) -> list:
    """Return up to `keep` sentences of text that hold the most (and rarest) query terms.

    weights: {stem: idf}. Needs no index (so no lock); reads the first MAX_SCAN_CHARS.
    """
    scored = []
    stems: dict = {}  # word -> stem, each computed once
    # Line marks go first (so "1. " ends no sentence); a heading is marked with \x01.
    text = _LINE_MARKS_RE.sub("", _HEADING_MARK_RE.sub("\x01", text[:MAX_SCAN_CHARS]))
    for i, sentence in enumerate(_SENTENCE_RE.split(text)):
        heading = sentence.startswith("\x01")  # quoted only when no other sentence matches
        sentence = sentence.strip("\x01 \t\r")
        if not sentence:
            continue
        if _MD_INLINE_RE.search(sentence):
            sentence = plain_text(sentence)
        words = set(WORD_RE.findall(fold(sentence)))
        for w in words.difference(stems):
            stems[w] = stem(w)
        present = set(map(stems.__getitem__, words)) & weights.keys()
        if present:
            scored.append((heading, -sum(weights[t] for t in present), i, sentence))
    scored.sort()
    if scored and not scored[0][0]:
        scored = [item for item in scored if not item[0]]
    return [clip(item[3], 400) for item in scored[:keep]]


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1].rsplit(" ", 1)[0] + "…"


def _hits_in_folder(svc: Service, question: str, folder: str | tuple, limit: int) -> list:
    """Return the top (path, title, text, score) inside a folder (a folder grant's sources):
    the question's words as one OR query of the index, restricted to the folder."""
    words = list(dict.fromkeys(w for w in WORD_RE.findall(fold(question)) if w not in STOPWORDS))
    text = ""
    for word in words:
        if len(text) + len(word) + 4 > MAX_QUERY_CHARS:
            break
        text = f"{text} OR {word}" if text else word
    try:
        _, ranked = svc.index.search(Query(text), folder, limit, reach=folder)
    except ApiError:  # no searchable word in the question
        return []
    hits = []
    for path, title, score, _ in ranked:
        with contextlib.suppress(ApiError):
            hits.append((path, title, svc.notes.get(path)["content"], score))
    return hits


def retrieve(
    svc: Service, question: str, note: str | None, limit: int = 3, folder: str | tuple = ""
) -> list:
    """Return [(path, title, [passages])]: the best hits, best first (inside `folder` only,
    when a folder grant asks).

    The note asked about (`notePath`) comes first when its passages match the question;
    otherwise it comes last with its opening, context for a model that no one quotes.
    """
    index = svc.index
    weights = index.stem_weights(question_stems(question))
    if folder:
        hits = _hits_in_folder(svc, question, folder, limit)
    else:
        hits = index.search_any(list(weights), limit)  # the passages are cut without the lock
    if svc.embedder is not None:  # and by meaning: the two rankings fused
        hits = svc.embedder.fuse_hits(question, folder, hits, limit)
    found = [(p, title, best_passages(weights, text)) for p, title, text, _ in hits if p != note]
    if note:
        rec = svc.notes.get(note)
        passages = best_passages(weights, rec["content"])
        if passages:
            found.insert(0, (note, rec["title"], passages))
        else:
            opening = clip(" ".join(rec["content"][:MAX_SCAN_CHARS].split()), 600)
            found.append((note, rec["title"], [opening]))
    return found


def matching(stems: set, passages: list) -> list:
    """Return the best of the passages (best first) that hold one of the stems, and the
    next ones while they hold as many of them."""
    counts = [len(stems.intersection(tokenize(p))) for p in passages]
    return [p for p, n in zip(passages, counts) if n and n == counts[0]]


# -- tools: what MCP clients and the agent may call -------------------------------------
#
# A tool is a small function of the service with a JSON Schema for its arguments, a
# description a model can act on, and MCP's annotations. MCP clients call tools through
# /api/v1/mcp and the `openai` agent through its tool loop; both run the same functions,
# which go through the store (its locks, hooks and history) and the index like every HTTP
# handler: there is no second write path. Write tools are offered only where the owner
# allows writes (SERVICE_MCP_WRITE, SERVICE_AGENT_WRITE). The built-ins register at the
# end of Plugins, like the built-in plugins (two of them use the links and tags plugins).

# the MCP protocol versions the server speaks (HTTP: MCP), named in /system/info too
MCP_HANDSHAKE_VERSIONS = ("2025-06-18", "2025-11-25")
MCP_STATELESS_VERSIONS = ("2026-07-28",)
MCP_VERSIONS = (*MCP_HANDSHAKE_VERSIONS, *MCP_STATELESS_VERSIONS)

TOOL_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}\Z")  # what MCP and OpenAI both accept


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str
    run: Callable  # (svc, **arguments) -> dict, the structured result; raises ApiError
    description: str
    schema: dict  # JSON Schema of the arguments: an object, no other properties
    title: str = ""
    read_only: bool = True
    destructive: bool = False  # may overwrite or remove what is there (not only add)
    idempotent: bool = False  # calling it again with the same arguments changes nothing more
    plugin: str = ""  # offered only while this plugin is on ("": always)
    text: Callable | None = None  # structured result -> the text a model reads (default JSON)
    alias_of: str = ""  # the same service under a name some client expects (MCP only)
    output: dict | None = None  # JSON Schema of the structured result (MCP's outputSchema)
    app_only: bool = False  # for MCP Apps only (the review card's): offered in suggest mode,
    # hidden from the model (`_meta.ui.visibility: ["app"]`), never to the agent
    review: bool = False  # its result shows in the review card (`_meta.ui.resourceUri`)

    def annotations(self) -> dict:
        """Return MCP's annotations of the tool (hints for clients, never enforced by them)."""
        return {
            "title": self.title or self.name.replace("_", " "),
            "readOnlyHint": self.read_only,
            "destructiveHint": self.destructive,
            "idempotentHint": self.idempotent,
            "openWorldHint": False,  # the notes are a closed world
        }


TOOLS: dict[str, Tool] = {}


def tool(
    name: str,
    description: str,
    properties: dict | None = None,
    required: tuple = (),
    *,
    title: str = "",
    read_only: bool = True,
    destructive: bool = False,
    idempotent: bool = False,
    plugin: str = "",
    text: Callable | None = None,
    alias_of: str = "",
    output: dict | None = None,
    app_only: bool = False,
    review: bool = False,
) -> Callable:
    """Register a tool function under name; `properties` are its arguments' JSON Schemas,
    `output` the JSON Schema's properties of its structured result."""
    if not TOOL_NAME_RE.match(name):
        raise ValueError(f"tool name {name!r} is not 1-64 of A-Z a-z 0-9 _ -")
    schema = {
        "type": "object",
        "properties": dict(properties or {}),
        "required": list(required),
        "additionalProperties": False,
    }

    def register(fn: Callable) -> Callable:
        registry_of("tool", TOOLS)[name] = Tool(
            name,
            fn,
            description,
            schema,
            title,
            read_only,
            destructive,
            idempotent,
            plugin,
            text,
            alias_of,
            {"type": "object", "properties": dict(output)} if output is not None else None,
            app_only,
            review,
        )
        return fn

    return register


def available_tools(svc: Service, writes: bool | str) -> list:
    """Return the tools this app offers: read-only ones, write ones when `writes` (True or
    "suggest") and the request's grant may write, each only while its plugin is on; the
    review card's own tools in "suggest" mode only. A folder grant gets the built-in tools
    only: they keep it in its folder, a plugin's tool may not."""
    who = request_principal()
    suggest = writes == "suggest"
    writes = bool(writes) and who.allows("write")
    return [
        t
        for t in svc.tools.values()
        if (writes or t.read_only)
        and (suggest or not t.app_only)
        and (not t.plugin or svc.plugin_enabled(t.plugin))
        and (who.whole or TOOLS.get(t.name) is t)
    ]


_JSON_TYPES = {"string": str, "integer": int, "boolean": bool, "object": dict, "array": list}


def checked_arguments(schema: dict, arguments: Any) -> dict:
    """Return a tool's arguments checked against its schema (the part of JSON Schema tools
    use: type, required, additionalProperties, min/maxLength, minimum/maximum, enum); null
    counts as absent, 3.0 as 3. Raises 400 saying what is wrong."""
    if not isinstance(arguments, dict):
        raise bad_request("the arguments must be a JSON object")
    props = schema.get("properties", {})
    given = {k: v for k, v in arguments.items() if v is not None}
    missing = [name for name in schema.get("required", ()) if name not in given]
    if missing:
        raise bad_request(f"missing required argument(s): {', '.join(missing)}")
    unknown = sorted(set(given) - set(props))
    if unknown and schema.get("additionalProperties") is False:
        takes = ", ".join(props) or "no arguments"
        raise bad_request(f"unknown argument(s): {', '.join(unknown)}; this tool takes {takes}")
    return {name: _checked_value(name, value, props.get(name, {})) for name, value in given.items()}


def _checked_value(name: str, value: Any, rule: dict) -> Any:
    """Return one argument checked against its rule in the schema (3.0 as 3 for an integer).
    Raises 400 saying what is wrong."""
    value = _checked_type(name, value, rule.get("type"))
    if isinstance(value, str):
        if len(value) < rule.get("minLength", 0):
            raise bad_request(f"'{name}' must not be empty")
        if len(value) > rule.get("maxLength", len(value)):
            raise bad_request(f"'{name}' is longer than {rule['maxLength']} characters")
    if isinstance(value, int) and not (
        rule.get("minimum", value) <= value <= rule.get("maximum", value)
    ):
        raise bad_request(f"'{name}' must be from {rule['minimum']} to {rule['maximum']}")
    if "enum" in rule and value not in rule["enum"]:
        raise bad_request(f"'{name}' must be one of {', '.join(map(str, rule['enum']))}")
    return value


def _checked_type(name: str, value: Any, kind: Any) -> Any:
    """Return a value of the JSON type `kind` (any when it names none), 3.0 as 3 for an
    integer. Raises 400 naming the type."""
    if kind == "integer" and isinstance(value, float) and value.is_integer():
        value = int(value)
    expected = _JSON_TYPES.get(kind)
    if expected and (
        not isinstance(value, expected) or (expected is int and isinstance(value, bool))
    ):
        raise bad_request(f"'{name}' must be a{'n' if kind[0] in 'aeio' else ''} {kind}")
    return value


def tool_error(code: str, message: str) -> dict:
    """Return a tool result saying what went wrong, for the model to act on (MCP's isError)."""
    return {
        "content": [{"type": "text", "text": f"Error ({code}): {message}"}],
        "structuredContent": {"error": {"code": code, "message": message}},
        "isError": True,
    }


# While a tool runs for a caller in `suggest` mode (SERVICE_MCP_WRITE or SERVICE_AGENT_WRITE),
# this holds the connector {id, name} the write tools make suggestions for (else None).
SUGGESTING: contextvars.ContextVar = contextvars.ContextVar("notesvc_suggesting", default=None)


def call_tool(svc: Service, tool: Tool, arguments: Any, suggest: dict | None = None) -> dict:
    """Return the result of one tool call as MCP's CallToolResult {content, structuredContent,
    isError}; `suggest`: the connector whose write tools make suggestions instead.

    Whatever a model can recover from (bad arguments, a missing note, a stale etag) is an
    isError result whose text says what to do; a bug is logged and answered with its request
    id only. Nothing raises.
    """
    token = SUGGESTING.set(suggest)
    try:
        data = tool.run(svc, **checked_arguments(tool.schema, arguments))
    except ApiError as e:
        return tool_error(e.code, e.message)
    except Exception:
        rid = current_request_id()
        log.exception("request %s: tool %s failed", rid, tool.name)
        return tool_error("INTERNAL_ERROR", f"internal error; request id {rid}")
    finally:
        SUGGESTING.reset(token)
    text = tool.text(data) if tool.text else to_json(data).decode("utf-8")
    return {
        "content": [{"type": "text", "text": text}],
        "structuredContent": data,
        "isError": False,
    }
