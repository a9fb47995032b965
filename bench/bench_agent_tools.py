"""Benchmark: the `openai` agent's tool loop against a loopback stand-in model.

    python bench/bench_agent_tools.py --notes 2000 --questions 100

The stand-in speaks the chat-completions tool-calling format and answers at once, so what
is measured is notesvc's own work: retrieval, the tools (search_notes, then read_note on
the two best hits) and three HTTP round trips on loopback. The reference in the same run
is the same stand-in answering the first call with text (the single retrieval call of a
model that never uses tools). Goal: the three-call loop stays under 4x the single call.
"""

from __future__ import annotations

import argparse
import http.server
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import bench_search  # noqa: E402
from _common import print_header, wait_first_check  # noqa: E402

import notesvc  # noqa: E402


class StandIn:
    """A chat-completions endpoint: with `tools` it searches, reads two hits, answers."""

    def __init__(self, use_tools: bool):
        self.use_tools = use_tools
        self.calls = 0
        stand_in = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stand_in.calls += 1
                payload = json.dumps(stand_in.answer(body)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, body: dict) -> dict:
        messages = body["messages"]
        tool_messages = [m for m in messages if m["role"] == "tool"]
        message = {"role": "assistant", "content": "Here is what your notes say."}
        if self.use_tools and "tools" in body and not tool_messages:
            words = messages[1]["content"].split()[-2:]
            message = self._calls([("search_notes", {"query": " OR ".join(words)})])
        elif self.use_tools and len(tool_messages) == 1:
            hits = [line.split(" — ")[0] for line in tool_messages[0]["content"].splitlines()]
            reads = [("read_note", {"path": p}) for p in hits[:2] if p.startswith("notes/")]
            if reads:
                message = self._calls(reads)
        return {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "model": body["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        }

    @staticmethod
    def _calls(calls: list) -> dict:
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": f"call_{i}",
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(args)},
                }
                for i, (name, args) in enumerate(calls)
            ],
        }

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def pct(xs: list, p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def agent_settings(url: str) -> dict:
    """What the bench cannot run without: the agent, on the stand-in model."""
    return {
        "SERVICE_AGENT_PROVIDER": "openai",
        "SERVICE_AGENT_BASE_URL": url,
        "SERVICE_AGENT_MODEL": "stand-in",
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--notes", type=int, default=2000)
    ap.add_argument("--questions", type=int, default=100)
    args = ap.parse_args()
    print_header(agent_settings("(the stand-in's URL)"))
    rnd = random.Random(5)
    with tempfile.TemporaryDirectory() as tmp:
        info = bench_search.make_corpus(Path(tmp), args.notes)
        vocab = info["vocab"]
        questions = [
            f"what did I write about {rnd.choice(vocab[200:3000])} {rnd.choice(vocab[200:3000])}"
            for _ in range(args.questions)
        ]
        results = {}
        for name, use_tools in (("reference: single call", False), ("tool loop", True)):
            model = StandIn(use_tools)
            env = {"SERVICE_NOTES_ROOT": tmp, **agent_settings(model.url)}
            svc = notesvc.build_service(notesvc.load_config(env=env)).start()
            wait_first_check(svc)
            try:
                for q in questions[:10]:  # warm up
                    notesvc.ask_agent(svc, q)
                model.calls = 0
                times, sources = [], []
                for q in questions:
                    started = time.perf_counter()
                    answer = notesvc.ask_agent(svc, q)
                    times.append((time.perf_counter() - started) * 1000)
                    sources.append(len(answer["sources"]))
                results[name] = (times, model.calls / len(questions), statistics.mean(sources))
            finally:
                svc.close()
                model.close()
    print(f"{args.notes} notes, {args.questions} questions, stand-in model on loopback")
    print(f"{'':<24} {'p50 ms':>8} {'p95 ms':>8} {'mean ms':>8} {'calls':>6} {'sources':>8}")
    for name, (xs, calls, sources) in results.items():
        row = f"{pct(xs, 50):>8.2f} {pct(xs, 95):>8.2f} {statistics.mean(xs):>8.2f}"
        print(f"{name:<24} {row} {calls:>6.1f} {sources:>8.1f}")
    ratio = pct(results["tool loop"][0], 50) / pct(results["reference: single call"][0], 50)
    verdict = "met" if ratio < 4 else "MISSED"
    print(f"tool loop / single call (p50): {ratio:.2f}x (goal < 4x: {verdict})")


if __name__ == "__main__":
    main()
