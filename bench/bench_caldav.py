"""Benchmark: notesvc's task lists over CalDAV against Radicale and Xandikos (not run by the tests).

    python bench/bench_caldav.py                       # 5,000 tasks in 500 notes; ~3 min
    python bench/bench_caldav.py --notes 100 --rounds 3

The tasks: --notes notes of 10 task lines each (every kind notesvc reads: `-`, `*`, `1.`
markers, ticked ones, `📅` and `due:` dates, `⏰` times, `#tags`, nested ones), written as
notes/f<N>/n<i>.md (10 folders) before notesvc starts. notesvc serves them from the notes
(its "All tasks" list); the peers get the very VTODOs notesvc serves, PUT one by one into
one calendar each, so all three hold the same tasks. All three run at once, on loopback:

- notesvc: `notesvc.py --root <root>` (default settings), HTTP Basic with a
  device-style scoped key (write), checked on every request;
- Radicale (pip install radicale): its default server, `--auth-type htpasswd` (one user,
  plain), a filesystem storage in a temporary folder, no request log;
- Xandikos (pip install xandikos): its default server (`xandikos.web --defaults`); it has
  no authentication of its own, so it runs without.

The client is the same for all three and syncs as DAVx5 does: a `sync-collection` REPORT
(getetag), then `calendar-multiget` of the hrefs it lacks, 100 at a time, on one
keep-alive connection. Rows, each the median of --rounds (servers asked in turn, round by
round, so noise hits all alike), each answer checked (207, every item back):

- first full sync: no token; every item's calendar data;
- sync after 10 changed tasks: 10 tasks ticked or unticked by PUT (with If-Match) from
  another connection, then a sync from the last token: exactly those 10 come back;
- a tick, notesvc only, against its reference: a CalDAV PUT that ticks a task (the note
  rewritten, versioned) against `PUT /api/v1/notes/<path>` of a note of the same size.

Goals (issue text): at or under Radicale on both syncs; a tick at most 2x a note PUT.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import importlib.metadata
import json
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import print_header  # noqa: E402
from bench_relay import pct, proc_figures, start  # noqa: E402

FOLDERS = 10
BATCH = 100  # hrefs a multiget asks for at once (DAVx5's default)
CAL = "urn:ietf:params:xml:ns:caldav"


# -- the tasks -------------------------------------------------------------------------------


def task_note(i: int) -> str:
    """A note of 10 task lines of every kind, with text around them."""
    lines = [f"# Note {i}", "", f"Plans for week {i % 52}, written as a person writes them.", ""]
    for j in range(10):
        box = "x" if j % 7 == 3 else " "
        marker = ("-", "*", f"{j + 1}.")[j % 3]
        indent = "  " if j % 5 == 2 else ""
        text = f"task {i}.{j}: call about the {('boiler', 'roof', 'car', 'bank')[j % 4]}"
        if j % 3 == 0:
            text += f" 📅 2026-12-{j % 28 + 1:02d}"
        elif j % 6 == 4:
            text += " ⏰ 2026-12-10 09:00"
        elif j % 9 == 1:
            text += " due:2027-01-15"
        if j % 4 == 1:
            text += f" #area{j % 5}"
        lines.append(f"{indent}{marker} [{box}] {text}")
    return "\n".join([*lines, "", "Done for now.", ""])


def seed(root: Path, notes: int) -> None:
    for i in range(notes):
        path = root / "notes" / f"f{i % FOLDERS}" / f"n{i}.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(task_note(i), encoding="utf-8")


# -- servers ---------------------------------------------------------------------------------


@dataclass
class Peer:
    name: str
    proc: subprocess.Popen
    port: int
    collection: str  # the path of the task list
    auth: str  # an Authorization header ("" for none)
    version: str = ""

    def conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)

    def headers(self, **more: str) -> dict:
        return {**({"Authorization": self.auth} if self.auth else {}), **more}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, name: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise SystemExit(f"{name} did not start")


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def request(conn, method: str, path: str, body: bytes = b"", headers=None) -> tuple:
    conn.request(method, path, body, headers or {})
    resp = conn.getresponse()
    return resp.status, resp.getheaders(), resp.read()


def start_notesvc(root: Path) -> Peer:
    proc, port = start("--root", str(root), env={})  # notesvc's defaults
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    _, _, body = request(conn, "GET", "/api/v1/system/setup")
    key = json.loads(body)["data"]["apiKey"]
    made = json.dumps({"name": "phone", "scope": "write"}).encode()
    hdrs = {"X-Service-Key": key, "Content-Type": "application/json"}
    _, _, body = request(conn, "POST", "/api/v1/auth/keys", made, hdrs)
    peer = Peer(
        "notesvc", proc, port, "/dav/calendars/all/", basic("me", json.loads(body)["data"]["key"])
    )
    peer.api_key = key  # type: ignore[attr-defined]
    return peer


def start_radicale(folder: Path) -> Peer:
    (folder / "users").write_text("bench:secret\n")
    port = free_port()
    cmd = [sys.executable, "-m", "radicale", "--server-hosts", f"127.0.0.1:{port}"]
    cmd += ["--storage-filesystem-folder", str(folder / "collections")]
    cmd += ["--auth-type", "htpasswd", "--auth-htpasswd-filename", str(folder / "users")]
    cmd += ["--auth-htpasswd-encryption", "plain", "--logging-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port, "Radicale")
    peer = Peer("Radicale", proc, port, "/bench/tasks/", basic("bench", "secret"))
    peer.version = importlib.metadata.version("radicale")
    body = (
        f'<C:mkcalendar xmlns:D="DAV:" xmlns:C="{CAL}"><D:set><D:prop>'
        '<C:supported-calendar-component-set><C:comp name="VTODO"/>'
        "</C:supported-calendar-component-set></D:prop></D:set></C:mkcalendar>"
    ).encode()
    status, _, _ = request(peer.conn(), "MKCALENDAR", peer.collection, body, peer.headers())
    assert status == 201, status
    return peer


def start_xandikos(folder: Path) -> Peer:
    port = free_port()
    cmd = [sys.executable, "-m", "xandikos.web", "--directory", str(folder / "dav")]
    cmd += ["--defaults", "-l", "127.0.0.1", "-p", str(port)]
    cmd += ["--state-dir", str(folder / "state")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port, "Xandikos")
    peer = Peer("Xandikos", proc, port, "/user/calendars/calendar/", "")
    peer.version = importlib.metadata.version("xandikos")
    return peer


# -- the client: DAVx5's way -------------------------------------------------------------------


def sync_body(token: str) -> bytes:
    return (
        '<D:sync-collection xmlns:D="DAV:">'
        f"<D:sync-token>{token}</D:sync-token><D:sync-level>1</D:sync-level>"
        "<D:prop><D:getetag/></D:prop></D:sync-collection>"
    ).encode()


def multiget_body(hrefs: list) -> bytes:
    refs = "".join(f"<D:href>{h}</D:href>" for h in hrefs)
    return (
        f'<C:calendar-multiget xmlns:D="DAV:" xmlns:C="{CAL}">'
        f"<D:prop><D:getetag/><C:calendar-data/></D:prop>{refs}</C:calendar-multiget>"
    ).encode()


_RESPONSE_RE = re.compile(rb"<(?:\w+:)?response\b.*?</(?:\w+:)?response>", re.S)
_HREF_RE = re.compile(rb"<(?:\w+:)?href>([^<]+)</(?:\w+:)?href>")
_TOKEN_RE = re.compile(rb"<(?:\w+:)?sync-token>([^<]+)</(?:\w+:)?sync-token>")


def sync(peer: Peer, token: str = "") -> tuple:
    """A client's sync: (new token, {href: calendar data}, hrefs reported gone)."""
    conn = peer.conn()
    hdrs = peer.headers(**{"Content-Type": "application/xml; charset=utf-8", "Depth": "1"})
    status, _, body = request(conn, "REPORT", peer.collection, sync_body(token), hdrs)
    assert status == 207, (peer.name, status, body[:300])
    changed, gone = [], []
    for part in _RESPONSE_RE.findall(body):
        href = _HREF_RE.search(part).group(1).decode()
        (gone if b"404" in part and b"getetag" not in part else changed).append(href)
    got: dict = {}
    for start_at in range(0, len(changed), BATCH):
        batch = changed[start_at : start_at + BATCH]
        status, _, answer = request(conn, "REPORT", peer.collection, multiget_body(batch), hdrs)
        assert status == 207, (peer.name, status, answer[:300])
        for part in _RESPONSE_RE.findall(answer):
            if b"BEGIN:VCALENDAR" in part:
                got[_HREF_RE.search(part).group(1).decode()] = part
    conn.close()
    return _TOKEN_RE.search(body).group(1).decode(), got, gone


def upload(peer: Peer, items: dict, folder: Path) -> None:
    """Load every {name: iCalendar} into the peer's list the quickest way it takes: one PUT
    of the whole calendar into Radicale's collection (a PUT an item costs Radicale and
    Xandikos 60-80 ms, and more as the list grows), one commit into Xandikos' git folder."""
    if peer.name == "Radicale":
        todos = [
            re.search(rb"BEGIN:VTODO.*END:VTODO\r\n", d, re.S).group(0) for d in items.values()
        ]
        whole = b"BEGIN:VCALENDAR\r\nVERSION:2.0\r\nPRODID:-//bench//EN\r\n"
        whole += b"".join(todos) + b"END:VCALENDAR\r\n"
        hdrs = peer.headers(**{"Content-Type": "text/calendar; charset=utf-8"})
        status, _, body = request(peer.conn(), "PUT", peer.collection, whole, hdrs)
        assert status in (201, 204), (peer.name, status, body[:300])
        return
    if peer.name == "Xandikos":
        repo = folder / "dav" / peer.collection.strip("/")
        for name, data in items.items():
            (repo / name).write_bytes(data)
        git = ["git", "-C", str(repo), "-c", "user.name=bench", "-c", "user.email=bench@x"]
        subprocess.run([*git, "add", "-A"], check=True)
        subprocess.run([*git, "commit", "-qm", "tasks"], check=True)
        return

    def put(chunk: list) -> None:
        conn = peer.conn()
        for name, data in chunk:
            hdrs = peer.headers(**{"Content-Type": "text/calendar; charset=utf-8"})
            status, _, body = request(conn, "PUT", peer.collection + name, data, hdrs)
            assert status in (201, 204), (peer.name, status, body[:300])
        conn.close()

    pairs = list(items.items())
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(put, [pairs[k::8] for k in range(8)]))


def toggle(peer: Peer, names: list) -> list:
    """Tick or untick tasks by PUT, as a phone does (GET, edit STATUS, PUT with If-Match);
    return each PUT's time (ms)."""
    conn, took = peer.conn(), []
    for name in names:
        status, headers, data = request(conn, "GET", peer.collection + name, b"", peer.headers())
        assert status == 200, (peer.name, status)
        etag = dict((k.lower(), v) for k, v in headers)["etag"]
        if b"STATUS:COMPLETED" in data:
            data = data.replace(b"STATUS:COMPLETED", b"STATUS:NEEDS-ACTION")
            data = re.sub(rb"COMPLETED:[0-9TZ]+\r\n", b"", data)
        else:
            data = data.replace(b"STATUS:NEEDS-ACTION", b"STATUS:COMPLETED")
        hdrs = peer.headers(**{"Content-Type": "text/calendar; charset=utf-8", "If-Match": etag})
        started = time.perf_counter()
        status, _, body = request(conn, "PUT", peer.collection + name, data, hdrs)
        took.append((time.perf_counter() - started) * 1000)
        assert status in (200, 204), (peer.name, status, body[:300])
    conn.close()
    return took


def item_data(part: bytes) -> bytes:
    m = re.search(rb"<(?:\w+:)?calendar-data[^>]*>(.*?)</(?:\w+:)?calendar-data>", part, re.S)
    text = m.group(1).decode("utf-8")
    text = text.replace("&#13;", "\r").replace("&lt;", "<").replace("&gt;", ">")
    text = text.replace("&quot;", '"').replace("&amp;", "&")
    if "\r\n" not in text:
        text = text.replace("\n", "\r\n")
    return text.encode("utf-8")


# -- the run ---------------------------------------------------------------------------------


def tick_against_put(peer: Peer, rounds: int) -> dict:
    """p50/p99 ms of a CalDAV tick and of an API PUT of a note of the same size."""
    conn = peer.conn()
    _, got, _ = sync(peer)
    name = next(h for h, part in got.items() if b"task 0.0:" in part).rsplit("/", 1)[1]
    note = "notes/ref/reference.md"
    api = {"X-Service-Key": peer.api_key, "Content-Type": "application/json"}  # type: ignore[attr-defined]
    text = task_note(0)
    made = json.dumps({"path": note, "content": text}).encode()
    assert request(conn, "POST", "/api/v1/notes", made, api)[0] == 201
    ticks, puts = [], []
    for r in range(rounds):
        ticks += toggle(peer, [name])
        body = json.dumps({"content": text + f"\nedit {r}\n"}).encode()
        started = time.perf_counter()
        status, _, _ = request(
            conn, "PUT", "/api/v1/notes/" + urllib.parse.quote(note, safe=""), body, api
        )
        puts.append((time.perf_counter() - started) * 1000)
        assert status == 200
    return {"tick": ticks, "put": puts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--notes", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ticks", type=int, default=50)
    args = ap.parse_args()
    print_header()
    work = Path(tempfile.mkdtemp(prefix="bench-caldav-"))
    seed(work / "notesvc", args.notes)
    peers = [start_notesvc(work / "notesvc")]
    started = time.perf_counter()
    _, first, _ = sync(peers[0])
    first_look = time.perf_counter() - started
    items = {h.rsplit("/", 1)[1]: item_data(part) for h, part in first.items()}
    print(f"{len(items)} tasks in {args.notes} notes; notesvc's first look {first_look:.2f} s")
    for name, starter in (("radicale", start_radicale), ("xandikos", start_xandikos)):
        (work / name).mkdir()
        peer = starter(work / name)
        upload(peer, items, work / name)
        peers.append(peer)
    figures: dict = {p.name: {"full": [], "ten": [], "cpu_full": [], "cpu_ten": []} for p in peers}
    changes: dict = {}
    try:
        for p in peers:  # warm up, and check that each holds every task
            _, got, _ = sync(p)
            assert len(got) == len(items), (p.name, len(got))
            names = sorted(h.rsplit("/", 1)[1] for h in got)
            changes[p.name] = names[:: max(1, len(names) // 10)][:10]
        for _ in range(args.rounds):
            for p in peers:
                cpu = proc_figures(p.proc.pid)["cpu_s"]
                started = time.perf_counter()
                token, got, _ = sync(p)
                figures[p.name]["full"].append(time.perf_counter() - started)
                figures[p.name]["cpu_full"].append(proc_figures(p.proc.pid)["cpu_s"] - cpu)
                assert len(got) == len(items), (p.name, len(got))
                toggle(p, changes[p.name])
                cpu = proc_figures(p.proc.pid)["cpu_s"]
                started = time.perf_counter()
                _, got, _ = sync(p, token)
                figures[p.name]["ten"].append(time.perf_counter() - started)
                figures[p.name]["cpu_ten"].append(proc_figures(p.proc.pid)["cpu_s"] - cpu)
                assert len(got) == 10, (p.name, len(got))
        ticks = tick_against_put(peers[0], args.ticks)
        rss = {p.name: proc_figures(p.proc.pid)["rss_mb"] for p in peers}
    finally:
        for p in peers:
            p.proc.terminate()
            p.proc.wait()
        shutil.rmtree(work, ignore_errors=True)
    report(args, peers, figures, ticks, rss, len(items))


def report(args, peers, figures, ticks, rss, count) -> None:
    med = statistics.median
    radicale = figures["Radicale"]
    print(
        f"\n{count} tasks in {args.notes} notes, {args.rounds} rounds (median); "
        "server CPU in brackets\n"
    )
    print("| server | first full sync | sync after 10 changes | RssAnon |")
    print("|---|---|---|---|")
    for p in peers:
        f = figures[p.name]
        name = f"{p.name} {p.version}".strip()
        full = f"{med(f['full']) * 1000:.0f} ms ({med(f['cpu_full']) * 1000:.0f} ms)"
        ten = f"{med(f['ten']) * 1000:.1f} ms ({med(f['cpu_ten']) * 1000:.0f} ms)"
        print(f"| {name} | {full} | {ten} | {rss[p.name]:.0f} MB |")
    ours = figures["notesvc"]
    print(
        f"\nnotesvc / Radicale: full sync {med(ours['full']) / med(radicale['full']):.2f}x, "
        f"after 10 changes {med(ours['ten']) / med(radicale['ten']):.2f}x (goal: <= 1)"
    )
    tick, put = ticks["tick"], ticks["put"]
    print(
        f"a tick (the PUT over CalDAV) p50 {pct(tick, 50):.1f} ms, p99 {pct(tick, 99):.1f} ms; "
        f"a note PUT to the API p50 {pct(put, 50):.1f} ms, p99 {pct(put, 99):.1f} ms: "
        f"{pct(tick, 50) / pct(put, 50):.2f}x (goal: <= 2)"
    )


if __name__ == "__main__":
    main()
