"""Benchmark: a Telegram capture end to end, and what polling costs while nothing happens.

    python bench/bench_capture.py --updates 50 --idle 30

A real `python notesvc.py` talks to a loopback stand-in of the Bot API that holds
getUpdates open like Telegram does (up to the `timeout` the server asks for, 25 s).

- Latency: from the moment the stand-in has an update to the moment the daily note on disk
  holds its text, for a channel in polling mode; the reference in the same run is the same
  update POSTed to the webhook of a channel in webhook mode (timed from the POST).
- Idle CPU: the server's CPU time (all its threads, /proc/<pid>/task/*/schedstat) over
  `--idle` seconds with the polling channel on; the reference is the same server over as
  long with the channel switched off (no poller at all).
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
NOTESVC = str(HERE.parent / "notesvc.py")
sys.path.insert(0, str(HERE))
from _common import print_header, server_env  # noqa: E402

TOKEN = "123456:bench-token"  # noqa: S105 - the stand-in takes any token


class BotApi:
    """getUpdates (offsets, long poll), sendMessage, deleteWebhook, setWebhook."""

    def __init__(self):
        self.updates: list = []
        self.next_id = 1000
        self.polls = 0
        self.cond = threading.Condition()
        self.pushed_at: dict = {}
        bot = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # head and body go out at once, as from Telegram

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                method = self.path.rsplit("/", 1)[-1]
                if method == "getUpdates":
                    result = bot.get_updates(body)
                elif method == "sendMessage":
                    result = {"message_id": 1}
                else:
                    result = True
                payload = json.dumps({"ok": True, "result": result}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                with contextlib.suppress(OSError):  # the server stopped meanwhile
                    self.wfile.write(payload)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def get_updates(self, body: dict) -> list:
        deadline = time.monotonic() + body.get("timeout", 0)
        with self.cond:
            self.polls += 1
            self.updates = [u for u in self.updates if u["update_id"] >= body.get("offset", 0)]
            while not self.updates and time.monotonic() < deadline:
                self.cond.wait(deadline - time.monotonic())
            return list(self.updates)

    def push(self, update: dict) -> None:
        with self.cond:
            self.next_id += 1
            self.updates.append({**update, "update_id": self.next_id})
            self.cond.notify_all()


def message(text: str) -> dict:
    chat = {"id": 42, "first_name": "Ada", "type": "private"}
    return {"message": {"message_id": 1, "from": chat, "chat": chat, "date": 0, "text": text}}


def call(base: str, method: str, path: str, body: dict | None = None, headers=None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(base + path, data, hdrs, method=method)
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def cpu_seconds(pid: int) -> float:
    """Return the CPU time of every thread of a process (schedstat: nanoseconds)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def wait_for_text(note, word: str, timeout: float = 10.0) -> float:
    """Return the moment the file note() names holds word."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if word in note().read_text():
                return time.perf_counter()
        except FileNotFoundError:
            pass
        time.sleep(0.0005)
    raise SystemExit(f"{word} never reached {note()}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--updates", type=int, default=50)
    ap.add_argument("--idle", type=float, default=30.0)
    args = ap.parse_args()
    bot = BotApi()
    with tempfile.TemporaryDirectory() as tmp:
        settings = {"SERVICE_TELEGRAM_API_BASE": bot.url}  # the stand-in, not Telegram
        print_header(settings)
        command = [sys.executable, NOTESVC, "--root", tmp, "--host", "127.0.0.1", "--port", "0"]
        proc = subprocess.Popen(
            command, stderr=subprocess.PIPE, text=True, env=server_env(settings)
        )
        try:
            for line in proc.stderr:
                m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
                if m:
                    base = f"http://127.0.0.1:{m.group(1)}"
                    break
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            state = json.loads((Path(tmp) / ".notesvc" / "state.json").read_text())
            auth = {"X-Service-Key": state["apiKey"]}  # the default auth mode
            config = {"botToken": TOKEN, "allowedChatIds": [42]}
            polling = call(
                base, "POST", "/api/v1/channels", {"provider": "telegram", "config": config}, auth
            )
            webhook = call(
                base,
                "POST",
                "/api/v1/channels",
                {"provider": "telegram", "config": {**config, "mode": "webhook"}},
                auth,
            )["data"]
            polling = polling["data"]
            time.sleep(1.0)  # the poller is up and holding a poll
            daily = Path(tmp) / "notes" / "daily"

            def note() -> Path:
                found = sorted(daily.glob("*.md"))
                return found[-1] if found else daily / "none.md"

            via_poll, via_hook = [], []
            for i in range(args.updates):
                word = f"polled{i}x"
                start = time.perf_counter()
                bot.push(message(f"/save {word}"))
                via_poll.append((wait_for_text(note, word) - start) * 1000)
                word = f"hooked{i}x"
                start = time.perf_counter()
                call(
                    base,
                    "POST",
                    "/api/v1/channels/webhook/telegram",
                    {"update_id": 1, **message(f"/save {word}")},
                    {"X-Telegram-Bot-Api-Secret-Token": webhook["secret"]},
                )
                via_hook.append((wait_for_text(note, word) - start) * 1000)
            polls_before, cpu_before = bot.polls, cpu_seconds(proc.pid)
            time.sleep(args.idle)
            polling_cpu = cpu_seconds(proc.pid) - cpu_before
            polls = bot.polls - polls_before
            call(base, "POST", f"/api/v1/channels/{polling['id']}/toggle", None, auth)
            time.sleep(1.0)
            cpu_before = cpu_seconds(proc.pid)
            time.sleep(args.idle)
            off_cpu = cpu_seconds(proc.pid) - cpu_before
        finally:
            proc.terminate()
            proc.wait(10)

    def pct(xs, p):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]

    print(f"{args.updates} updates each way; time from the update to the saved note:")
    print(f"{'':<34} {'p50 ms':>8} {'p95 ms':>8} {'mean ms':>8}")
    for name, xs in (
        ("polling (getUpdates long poll)", via_poll),
        ("reference: webhook POST", via_hook),
    ):
        print(f"{name:<34} {pct(xs, 50):>8.2f} {pct(xs, 95):>8.2f} {statistics.mean(xs):>8.2f}")
    print(f"ratio polling / webhook (p50): {pct(via_poll, 50) / pct(via_hook, 50):.2f}")
    per_min = 60 / args.idle
    print(f"\nidle {args.idle:.0f} s each; server CPU time:")
    print(
        f"  one polling channel: {polling_cpu * 1000 * per_min:8.1f} ms per minute ({polls} polls)"
    )
    print(f"  reference, no poller: {off_cpu * 1000 * per_min:8.1f} ms per minute")
    ratio = polling_cpu / off_cpu if off_cpu else float("inf")
    print(f"  ratio: {ratio:.2f}; {polling_cpu / args.idle * 100:.3f}% of one core")


if __name__ == "__main__":
    main()
