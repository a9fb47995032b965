"""What every bench shares: the environment its servers get, and the line that says what a
run measured (commit and settings). Each bench is run as `python bench/bench_x.py`."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def server_env(settings: dict | None = None) -> dict:
    """This environment without SERVICE_* settings and without PYTHONDONTWRITEBYTECODE
    (this machine sets it, a user's shell does not), plus the settings given."""
    skip = ("PYTHONDONTWRITEBYTECODE",)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVICE_") and k not in skip}
    env.update(settings or {})
    return env


def commit() -> str:
    """The checkout's short commit, +dirty when notesvc.py differs from it."""
    git = ["git", "-C", str(ROOT)]
    try:
        head = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run([*git, "diff", "--quiet", "HEAD", "--", "notesvc.py"]).returncode
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return head + ("+dirty" if dirty else "")


def print_header(settings: dict | None = None) -> None:
    """Print the run's first line: its commit and every setting it changes."""
    changed = ", ".join(f"{k}={v}" for k, v in (settings or {}).items()) or "none (defaults)"
    print(f"commit {commit()}; settings changed: {changed}", flush=True)


def wait_first_check(svc, limit: float = 900.0) -> None:
    """Wait for an in-process service's first check of the files: at default settings it
    runs in the background (the rescan), and until it is done a search finds part only."""
    deadline = time.monotonic() + limit
    while not svc.last_sync:
        if time.monotonic() > deadline:
            raise SystemExit("the first check of the files did not end")
        time.sleep(0.05)
