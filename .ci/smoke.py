"""Smoke test of notesvc.py under Debian's own Python and packages (standard library only).

Run as `/usr/bin/python3 -I .ci/smoke.py`: -I keeps the user's site-packages and every
PYTHON* variable out, so bottle and waitress come from python3-bottle / python3-waitress
(/usr/lib/python3/dist-packages), never from a pip install. It starts a real server on a
free loopback port with a temporary root, reads the setup payload, links, creates a note,
searches it, and stops the server with SIGTERM (exit status 0 expected). notesvc.py runs
as a user runs it: copied alone into an empty folder.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.parse
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
NOTESVC = os.path.join(os.path.dirname(HERE), "notesvc.py")


def check(ok: bool, what) -> None:
    """Stop with what went wrong (asserts vanish under -O; this does not)."""
    if not ok:
        raise SystemExit(f"smoke: failed: {what}")


def call(base: str, method: str, path: str, key: str = "", body=None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"} if data is not None else {}
    if key:
        headers["X-Service-Key"] = key
    req = urllib.request.Request(base + path, data, headers, method=method)
    with urllib.request.urlopen(req, timeout=20) as resp:
        answer = json.loads(resp.read())
    check(answer.get("success") is True, answer)
    return answer["data"]


def main() -> int:
    import bottle  # imported here: which copy is found is what this test is about
    import waitress

    print(f"python {sys.version.split()[0]} at {sys.executable}")
    print(f"bottle {bottle.__version__} from {bottle.__file__}")
    print(f"waitress from {waitress.__file__}")
    for module in (bottle, waitress):
        if not module.__file__.startswith("/usr/lib/python3/dist-packages/"):
            raise SystemExit(f"smoke: {module.__name__} is not Debian's: {module.__file__}")
    with tempfile.TemporaryDirectory(prefix="notesvc-smoke-") as folder:
        # the one file, copied alone into an empty folder, as a user drops it onto a Pi
        alone = os.path.join(folder, "notesvc.py")
        shutil.copy(NOTESVC, alone)
        root = os.path.join(folder, "data")
        cmd = [sys.executable, "-I", alone, "--host", "127.0.0.1", "--port", "0"]
        cmd += ["--root", root]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SERVICE_RESCAN_SECONDS": "0"}
        proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=folder
        )
        lines, found = [], threading.Event()
        port = []

        def read() -> None:
            for line in proc.stderr:
                lines.append(line)
                m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
                if m:
                    port.append(int(m.group(1)))
                    found.set()
            found.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            if not found.wait(30) or not port:
                raise SystemExit("smoke: the server did not start:\n" + "".join(lines))
            base = f"http://127.0.0.1:{port[0]}/api/v1"
            setup = call(base, "GET", "/system/setup")
            key = setup["apiKey"]
            check(key.startswith("nsk_"), setup)
            linked = call(base, "POST", "/auth/link", key, {"clientName": "smoke"})
            check(linked["setupComplete"] is True, linked)
            note = {"path": "notes/smoke/debian.md", "content": "# Debian\n\nbookworm packages"}
            created = call(base, "POST", "/notes", key, note)
            check(created["path"] == note["path"], created)
            query = urllib.parse.urlencode({"q": "bookworm"})
            hits = call(base, "GET", f"/search?{query}", key)["results"]
            check([r["path"] for r in hits] == [note["path"]], hits)
            mcp = {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "tools/call",
                "params": {"name": "search_notes", "arguments": {"query": "bookworm"}},
            }
            req = urllib.request.Request(
                base + "/mcp",
                json.dumps(mcp).encode(),
                {"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
            )
            with urllib.request.urlopen(req, timeout=20) as resp:
                tool_hits = json.loads(resp.read())["result"]["structuredContent"]["results"]
            check([r["path"] for r in tool_hits] == [note["path"]], tool_hits)
            # Grants (issue 19): a read key for one folder, a share link, the OAuth metadata.
            body = {"name": "smoke", "scope": "read", "folder": "notes/smoke"}
            grant = call(base, "POST", "/auth/keys", key, body)
            seen = call(base, "GET", "/notes", grant["key"])["notes"]
            check([n["path"] for n in seen] == [note["path"]], seen)
            try:
                call(
                    base,
                    "POST",
                    "/notes",
                    grant["key"],
                    {"path": "notes/smoke/x.md", "content": ""},
                )
                check(False, "a read key created a note")
            except urllib.error.HTTPError as e:
                e.close()
                check(e.code == 403, e.code)
            link = call(base, "POST", "/shares", key, {"path": note["path"]})["url"]
            token = link.rsplit("/s/", 1)[1]
            check(call(base, "GET", f"/shared/{token}")["title"] == "Debian", link)
            origin = base.rsplit("/api/v1", 1)[0]
            with urllib.request.urlopen(
                origin + "/.well-known/oauth-authorization-server", timeout=20
            ) as r:
                check(json.loads(r.read())["issuer"] == origin, "OAuth metadata")
            # A device pairing; its QR code with Debian's python3-segno when installed.
            made = call(base, "POST", "/auth/devices/pairings", key, {"scope": "read"})
            try:
                import segno  # noqa: F401 - only whether Debian's is there
            except ImportError:
                pass
            else:
                check(made.get("qrSvg", "").startswith("<svg"), "a QR code (python3-segno)")
            claimed = call(base, "POST", "/auth/devices/claim", "", {"secret": made["secret"]})
            check(claimed["key"].startswith("nsd_"), claimed)
            proc.send_signal(signal.SIGTERM)
            status = proc.wait(20)
            reader.join(5)
            if status != 0:
                raise SystemExit(f"smoke: exit status {status} after SIGTERM:\n" + "".join(lines))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    print(
        "smoke: start, setup, link, create, search, MCP tool call, a folder key, a share link, "
        "OAuth metadata, a device pairing, stop (SIGTERM -> 0): ok"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
