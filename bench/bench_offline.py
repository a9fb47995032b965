"""Benchmark: "Keep notes on this device" through a relay origin, and autosave (Chromium).

    python bench/bench_offline.py          # 1,000 notes; ~1 min once the corpus is built
    python bench/bench_offline.py --corpus ~/corpus/1k --notes 1000 --type-seconds 10

Issue 25's goals, one run each:

1. The first offline copy of 1,000 notes through a relay origin takes at most 10 s in
   Chromium, and the page stays responsive meanwhile. The notes are real text: the first N
   notes of /work/shared/bench/corpus.py's corpus (built once into --corpus when missing,
   ~100 s; keep it outside the repository), written as notes/<area>/<title>.md (16
   folders) before the server starts. A real relay (`notesvc.py relay`, per-server origins
   under relay.test) and a real server registered with it. Chromium (phone viewport,
   390x844) resolves *.relay.test to loopback and treats the server's origin
   http://<serverId>.relay.test:<port> as secure (--unsafely-treat-insecure-origin-as-secure;
   in real life that origin is HTTPS). It signs in with the key and turns the option on; the
   time is the page's own, from the click (a performance mark) to `notesvc:offline-copied`.
   The reference, in the same run: the same requests (the listing, then the 1,000 GETs) by a
   plain Python client, 6 threads with a keep-alive connection each, through the same relay
   origin. Responsiveness meanwhile, in the page: how late a 50 ms interval timer fires, the
   gaps between animation frames, the long tasks, and the delay from a key press (one every
   200 ms, on an input of the bench's own) to its handler. Also the CPU seconds the relay,
   the server and Chromium spent on the copy (all share the machine's cores here).
2. Autosave sends at most one request a second while typing: a note opened, Edit, then
   typing at its end at a person's pace (120 ms a key) for --type-seconds; every POST
   .../merge the page sent (its resource timings) gives the rate and the most in any 1-second
   window, and a thread watching the file gives the time from the last key until the text is
   on disk.

Also the relay's and the server's RssAnon just after the copy.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import print_header  # noqa: E402
from bench_relay import DOMAIN, pct, proc_figures, start  # noqa: E402

CORPUS_PY = Path("/work/shared/bench/corpus.py")
API = "/api/v1"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = [  # as tests/browsers.py launches it
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PHONE = {"viewport": {"width": 390, "height": 844}, "has_touch": True, "is_mobile": True}
WORKERS = 6  # as copyAll() in web/offline.js

# In the page before the click: a 50 ms timer's lateness, animation frame gaps, long tasks,
# the delay of each key press on an input of its own (the event's time to its handler), a
# mark at the click, and resource timings from there on.
PROBES = """() => {
  const b = (window.bench = {late: [], frames: [], keys: []});
  let last = performance.now();
  b.timer = setInterval(() => {
    const now = performance.now();
    b.late.push(now - last - 50);
    last = now;
  }, 50);
  let frame = performance.now();
  const tick = (t) => {
    b.frames.push(t - frame);
    frame = t;
    if (!b.stop) requestAnimationFrame(tick);
  };
  requestAnimationFrame(tick);
  const input = document.createElement("input");
  input.id = "bench-probe";
  input.style.cssText = "position:fixed;left:0;bottom:0;width:40px;opacity:0.01";
  input.addEventListener("keydown", (e) => b.keys.push(performance.now() - e.timeStamp));
  document.body.append(input);
  b.long = [];
  b.observer = new PerformanceObserver((list) => {
    for (const e of list.getEntries()) b.long.push(e.duration);
  });
  b.observer.observe({type: "longtask"});
  performance.setResourceTimingBufferSize(10000);
  performance.clearResourceTimings();
  document.getElementById("menu-offline").addEventListener(
    "click", () => performance.mark("bench:click"), {capture: true});
}"""

STOP_PROBES = """() => {
  const b = window.bench;
  clearInterval(b.timer);
  b.stop = true;
  b.observer.disconnect();
  document.getElementById("bench-probe").remove();
  const mark = (n) => (performance.getEntriesByName(n)[0] || {}).startTime;
  const api = performance.getEntriesByType("resource").filter((e) => e.name.includes("/api/v1/"));
  return {late: b.late, frames: b.frames, keys: b.keys, long: b.long,
          click: mark("bench:click"), copied: mark("notesvc:offline-copied"),
          requests: api.map((e) => [
            e.name.includes("/api/v1/notes/") ? "note" : new URL(e.name).pathname,
            e.responseStatus, e.responseEnd - e.startTime])};
}"""


# -- the corpus and the notes root ----------------------------------------------------------


def corpus_notes(corpus: Path, n: int) -> list:
    """Return the first n notes of corpus.py's corpus in `corpus` (built there when missing)."""
    files = corpus / "files.txt"
    if not files.exists() or len(files.read_text().split()) < n:
        if corpus.exists() and any(corpus.iterdir()):
            raise SystemExit(f"{corpus} holds no corpus of {n} notes: name another --corpus")
        print(f"building the corpus ({n} notes) into {corpus} with {CORPUS_PY} ...", flush=True)
        started = time.monotonic()
        subprocess.run(
            [sys.executable, str(CORPUS_PY), "--n", str(n), "--out", str(corpus)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        print(f"  built in {time.monotonic() - started:.0f} s", flush=True)
    rels = files.read_text().split()[:n]
    return [(rel, (corpus / rel).read_text(encoding="utf-8")) for rel in rels]


def title_name(text: str) -> str:
    """Return a file name from a note's '# Title' line (letters, digits, spaces, - and ,)."""
    title = text.split("\n", 1)[0].lstrip("# ")
    name = re.sub(r"[^\w ,-]+", " ", title)
    return re.sub(r"\s+", " ", name).strip()[:60].strip() or "note"


def seed_root(root: Path, notes: list) -> list:
    """Write the notes as notes/<area>/<title>.md; return their paths."""
    paths = []
    for rel, text in notes:
        area = rel.split("/")[1]
        name, k = title_name(text), 2
        path = f"notes/{area}/{name}.md"
        while (root / path).exists():
            path, k = f"notes/{area}/{name} {k}.md", k + 1
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


# -- the relay and the server ---------------------------------------------------------------


def get_json(url: str, key: str = "") -> dict:
    headers = {"X-Service-Key": key} if key else {}
    req = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())["data"]


def start_pair(root: Path) -> dict:
    """Start a relay with per-server origins and a server registered with it; return both,
    the key, the server's origin and its connect link (once the server knows its origin)."""
    # What the bench cannot run without: per-server origins on the relay, the server on it.
    relay, relay_port = start("relay", env={"SERVICE_RELAY_DOMAIN": DOMAIN})
    relay_url = f"http://127.0.0.1:{relay_port}"
    server, port = start("--root", str(root), env={"SERVICE_RELAY_URL": relay_url})
    pair = {"relay": relay, "server": server, "relay_port": relay_port, "port": port}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        setup = get_json(f"http://127.0.0.1:{port}{API}/system/setup")
        origin = f"http://{setup['serverId']}.{DOMAIN}:{relay_port}"
        if setup["links"]["relayApiBase"] == f"{origin}{API}":
            pair.update(key=setup["apiKey"], origin=origin, link=setup["links"]["connect"])
            return pair
        time.sleep(0.2)
    stop_pair(pair)
    raise SystemExit("the server did not learn its origin on the relay")


def stop_pair(pair: dict) -> None:
    for proc in (pair["server"], pair["relay"]):
        if proc.poll() is None:
            proc.terminate()
            proc.wait(10)


def warm_up(pair: dict) -> None:
    """The server's index built and its first answers given, before anything is timed."""
    base, key = f"http://127.0.0.1:{pair['port']}{API}", pair["key"]
    get_json(f"{base}/search?q=the", key)
    get_json(f"{base}/notes?limit=10", key)


# -- the reference: the same requests by a plain client --------------------------------------


def reference_copy(pair: dict) -> dict:
    """List the notes, then GET each with 6 threads (a keep-alive connection each), through
    the relay on the server's origin; return the seconds, each GET's ms and the errors."""
    host = urllib.parse.urlsplit(pair["origin"]).netloc
    headers = {"X-Service-Key": pair["key"], "Host": host}
    errors, times = [], []
    started = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", pair["relay_port"], timeout=60)
    conn.request("GET", f"{API}/notes?limit=1000&offset=0", headers=headers)
    paths = [n["path"] for n in json.loads(conn.getresponse().read())["data"]["notes"]]
    conn.close()
    lock = threading.Lock()

    def worker() -> None:
        c = http.client.HTTPConnection("127.0.0.1", pair["relay_port"], timeout=60)
        while True:
            with lock:
                if not paths:
                    break
                path = paths.pop()
            begun = time.perf_counter()
            c.request("GET", f"{API}/notes/{urllib.parse.quote(path, safe='')}", headers=headers)
            resp = c.getresponse()
            json.loads(resp.read())  # as the page parses each answer
            times.append((time.perf_counter() - begun) * 1000)
            if resp.status != 200:
                errors.append((resp.status, path))
        c.close()

    threads = [threading.Thread(target=worker) for _ in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"seconds": time.perf_counter() - started, "times": times, "errors": errors}


# -- CPU time of the processes taking part -----------------------------------------------------


def chromium_kind(pid: int) -> str:
    """Which of Chromium's processes: browser, renderer, network, gpu or other."""
    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    kind = re.search(r"--type=(\S+)", cmd)
    if not kind:
        return "browser"
    if "NetworkService" in cmd:
        return "network"
    return {"renderer": "renderer", "gpu-process": "gpu"}.get(kind.group(1), "other")


def machine_busy() -> float:
    """CPU seconds the whole machine has spent busy (all cores, /proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def cpu_by_process(pair: dict) -> dict:
    """CPU seconds so far of the relay, the server, Chromium's processes (by kind) and the
    Playwright driver: the descendants of this process."""
    parent, cpu, name = {}, {}, {}
    tick = os.sysconf("SC_CLK_TCK")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            comm, fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)
        except OSError:
            continue
        fields = fields.split()
        parent[int(pid)] = int(fields[1])
        cpu[int(pid)] = (int(fields[11]) + int(fields[12])) / tick
        name[int(pid)] = comm.split("(", 1)[1]
    out = dict.fromkeys(("relay", "server", "driver", "browser", "renderer", "network"), 0.0)
    out.update(gpu=0.0, other=0.0, bench=sum(os.times()[:2]), machine=machine_busy())
    roles = {pair["relay"].pid: "relay", pair["server"].pid: "server"}
    for pid in cpu:
        p = pid
        while p not in (0, 1, os.getpid()) and p in parent:
            p = parent[p]
        if p != os.getpid():
            continue
        try:
            role = roles.get(pid) or (chromium_kind(pid) if "chrom" in name[pid] else "driver")
        except OSError:
            continue
        out[role] += cpu[pid]
    return out


# -- the browser ------------------------------------------------------------------------------


def launch(pw, origin: str):
    """Chromium resolving *.relay.test to loopback, the server's origin treated as secure."""
    rules = f"--host-resolver-rules=MAP *.{DOMAIN} 127.0.0.1, MAP {DOMAIN} 127.0.0.1"
    secure = f"--unsafely-treat-insecure-origin-as-secure={origin}"
    return pw.chromium.launch(executable_path=CHROMIUM, args=[*CHROMIUM_ARGS, rules, secure])


def open_session(browser, pair: dict):
    """A phone context signed in on the server's origin (as the tests sign in); return it,
    its page and the page's errors (console errors, failed requests)."""
    context = browser.new_context(**PHONE)
    context.set_default_timeout(20_000)
    page = context.new_page()
    errors: list = []
    page.on("console", lambda m: m.type == "error" and errors.append(m.text))
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("requestfailed", lambda r: errors.append(f"{r.failure} {r.url}"))
    page.goto(pair["link"]["hosted"])
    page.fill("#key", pair["key"])
    page.click("#connect")
    page.wait_for_selector("#tree button, #tree .empty")
    return context, page, errors


COUNT_KEPT = """() => new Promise((ok, no) => {
  const open = indexedDB.open("notesvc");
  open.onsuccess = () => {
    const req = open.result.transaction("notes").objectStore("notes").count();
    req.onsuccess = () => { ok(req.result); open.result.close(); };
  };
  open.onerror = () => no(open.error);
})"""


def offline_copy(page, pair: dict) -> dict:
    """Turn "Keep notes on this device" on, pressing a key on the probe's input every 200 ms
    until the copy is done; return the page's timings, the probes and the CPU it took."""
    page.evaluate(PROBES)
    page.click("#menu summary")
    before = cpu_by_process(pair)
    page.click("#menu-offline")
    page.focus("#bench-probe")
    deadline = time.monotonic() + 120
    copied = "() => performance.getEntriesByName('notesvc:offline-copied').length"
    while not page.evaluate(copied) and time.monotonic() < deadline:
        page.keyboard.press("a")
        time.sleep(0.2)
    after = cpu_by_process(pair)
    out = page.evaluate(STOP_PROBES)
    out["cpu"] = {k: after[k] - before[k] for k in after}
    kinds = ("browser", "renderer", "network", "gpu", "other")
    out["cpu"]["chromium"] = sum(out["cpu"][k] for k in kinds)
    ours = ("relay", "server", "driver", "bench", "chromium")
    out["cpu"]["elsewhere"] = out["cpu"]["machine"] - sum(out["cpu"][k] for k in ours)
    out["badge"] = page.inner_text("#offline-state")
    out["secure"] = page.evaluate("window.isSecureContext")
    out["sw"] = page.evaluate("navigator.serviceWorker.getRegistrations().then(r => r.length)")
    out["kept"] = page.evaluate(COUNT_KEPT)
    return out


def open_note(page, path: str) -> None:
    """Open a note from the tree on the phone (its Notes pane, then its folder)."""
    if page.get_attribute("#app", "data-pane") != "notes":
        page.tap(".tabs button[data-pane=notes]")
    folder = page.locator(f'#tree button.dir[data-path="{path.rsplit("/", 1)[0]}"]')
    if folder.get_attribute("aria-expanded") != "true":
        folder.click()
    page.click(f'#tree button.note[data-path="{path}"]')
    page.wait_for_function("p => document.getElementById('path').textContent.includes(p)", arg=path)


def watch_file(file: Path, wanted: str, stop: threading.Event, seen: list) -> None:
    """Note the time (epoch ms) the file first holds `wanted`; look every 5 ms."""
    while not stop.is_set():
        if file.read_text(encoding="utf-8") == wanted:
            seen.append(time.time() * 1000)
            return
        time.sleep(0.005)


KEY_TIMES = """() => {
  performance.clearResourceTimings();
  window.keysAt = [];
  document.getElementById("editor").addEventListener(
    "keydown", () => window.keysAt.push(performance.timeOrigin + performance.now()));
}"""

# Every API request since the first key: [kind, start, end (epoch ms), status].
TYPING_REQUESTS = """() => ({
  api: performance.getEntriesByType("resource")
    .filter((e) => e.name.includes("/api/v1/"))
    .map((e) => {
      const path = new URL(e.name).pathname.split("/api/v1")[1];
      const kind = path.endsWith("/merge") ? "merge"
        : path.startsWith("/notes/") ? "note"
        : path.split("/").slice(0, 3).join("/");
      return [kind, performance.timeOrigin + e.startTime, performance.timeOrigin + e.responseEnd,
              e.responseStatus];
    }),
  keys: [window.keysAt[0], window.keysAt[window.keysAt.length - 1], window.keysAt.length],
  value: document.getElementById("editor").value,
  status: document.getElementById("status").textContent,
})"""


def autosave(page, root: Path, path: str, text: str) -> dict:
    """Edit the note, type `text` at its end at a person's pace (120 ms a key); return the
    merges (epoch ms), the first and last key, and when the whole text was on disk."""
    open_note(page, path)
    page.click("#edit")
    page.focus("#editor")
    page.keyboard.press("Control+End")
    page.evaluate(KEY_TIMES)
    file = root / path
    wanted = file.read_text(encoding="utf-8") + text
    stop, seen, sent = threading.Event(), [], []
    watcher = threading.Thread(target=watch_file, args=(file, wanted, stop, seen))
    watcher.start()

    def count(request) -> None:
        if request.url.endswith("/merge"):
            sent.append(request.method)

    page.on("request", count)
    page.keyboard.type(text, delay=120)
    deadline = time.monotonic() + 15
    while watcher.is_alive() and time.monotonic() < deadline:
        page.wait_for_timeout(50)  # the page's events keep coming meanwhile
    stop.set()
    watcher.join()
    page.wait_for_timeout(300)  # a late answer is in the timings too
    page.remove_listener("request", count)
    out = page.evaluate(TYPING_REQUESTS)
    out["merges"] = [row[1:] for row in out["api"] if row[0] == "merge"]
    out["on_disk"] = seen[0] if seen else None
    out["request_events"] = len(sent)
    out["as_typed"] = out.pop("value") == wanted
    return out


def browser_run(pair: dict, root: Path, paths: list, text: str) -> dict:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = launch(pw, pair["origin"])
        try:
            context, page, errors = open_session(browser, pair)
            if not page.evaluate("window.isSecureContext"):
                raise SystemExit(f"{pair['origin']} is not a secure context: no offline copy")
            copy = offline_copy(page, pair)
            memory = {
                "relay": proc_figures(pair["relay"].pid)["rss_mb"],
                "server": proc_figures(pair["server"].pid)["rss_mb"],
            }
            typing = autosave(page, root, paths[len(paths) // 2], text)
            context.close()
        finally:
            browser.close()
    return {"copy": copy, "memory": memory, "typing": typing, "errors": errors}


# -- the report -------------------------------------------------------------------------------


def most_in_a_second(times: list) -> int:
    """The most of `times` (ms) in any window [t, t + 1000)."""
    times = sorted(times)
    return max((sum(t <= u < t + 1000 for u in times) for t in times), default=0)


def p95_max(values: list) -> str:
    return f"{pct(values, 95):.0f} / {max(values, default=float('nan')):.0f} ms"


def copy_rows(ref: dict, run: dict) -> tuple:
    """The copy's rows, its seconds, and whether it finished."""
    c, cpu = run["copy"], run["copy"]["cpu"]
    done = c["copied"] is not None and c["click"] is not None
    sync_s = (c["copied"] - c["click"]) / 1000 if done else float("nan")
    gets = [ms for kind, _, ms in c["requests"] if kind == "note"]
    bad = [(kind, status) for kind, status, _ in c["requests"] if status not in (200, 0)]
    long = c["long"]
    rows = [
        ("secure context / service workers registered", f"{c['secure']} / {c['sw']}"),
        ("badge / notes in IndexedDB", f"{c['badge']} / {c['kept']}"),
        (
            "API requests in the copy / note GETs / not 200",
            f"{len(c['requests'])} / {len(gets)} / {len(bad)}",
        ),
        ("offline copy: click to notesvc:offline-copied", f"{sync_s:.2f} s"),
        ("reference: the same GETs, Python, 6 keep-alive", f"{ref['seconds']:.2f} s"),
        ("ratio (page / reference)", f"{sync_s / ref['seconds']:.2f}"),
        (
            "one note GET p50: page / reference",
            f"{pct(gets, 50):.0f} / {pct(ref['times'], 50):.0f} ms",
        ),
        (
            "CPU s in the copy: Chromium / relay / server",
            f"{cpu['chromium']:.1f} / {cpu['relay']:.1f} / {cpu['server']:.1f}",
        ),
        (
            "  Chromium's: browser / renderer / network / other",
            f"{cpu['browser']:.1f} / {cpu['renderer']:.1f} / {cpu['network']:.1f} / "
            f"{cpu['gpu'] + cpu['other']:.1f}",
        ),
        (
            "CPU s meanwhile: Playwright + bench / all else",
            f"{cpu['driver'] + cpu['bench']:.1f} / {cpu['elsewhere']:.1f}",
        ),
        ("50 ms timer lateness p95 / max", p95_max(c["late"])),
        ("animation frame gap p95 / max", p95_max(c["frames"])),
        (f"key press to its handler p95 / max ({len(c['keys'])})", p95_max(c["keys"])),
        (
            f"long tasks: {len(long)}, total / max",
            f"{sum(long):.0f} / {max(long, default=0):.0f} ms",
        ),
        (
            "relay / server RssAnon after the copy",
            f"{run['memory']['relay']} / {run['memory']['server']} MB",
        ),
    ]
    return rows, sync_s, done and sync_s <= 10, bad


def typing_rows(t: dict) -> tuple:
    """The autosave's rows, and the most requests in a second."""
    first, last, keys = t["keys"]
    starts = [s for s, _, _ in t["merges"]]
    during = [s for s in starts if s <= last]
    window = most_in_a_second(starts)
    api_starts = [s for _, s, _, _ in t["api"] if first <= s <= last]
    kinds = collections.Counter(k for k, s, _, _ in t["api"] if first <= s <= last)
    ends = t["on_disk"] or max((e for _, e, _ in t["merges"]), default=last)
    to_disk = (t["on_disk"] - last) / 1000 if t["on_disk"] else float("nan")
    rows = [
        (f"typing: {keys} keys over", f"{(last - first) / 1000:.1f} s"),
        (
            "merges while typing / in all / request events",
            f"{len(during)} / {len(starts)} / {t['request_events']}",
        ),
        (
            "merges a second: while typing / to the disk",
            f"{len(during) / (last - first) * 1000:.2f}"
            f" / {len(starts) / (ends - first) * 1000:.2f}",
        ),
        ("most merge requests in any 1 s window", str(window)),
        (
            "all API requests while typing: a second / most in 1 s",
            f"{len(api_starts) / (last - first) * 1000:.2f} / {most_in_a_second(api_starts)}",
        ),
        ("  of them", ", ".join(f"{k} {v}" for k, v in kinds.most_common())),
        ("last key to the text on disk", f"{to_disk:.2f} s"),
        ("editor holds what was typed / status", f"{t['as_typed']} / {t['status']}"),
    ]
    return rows, window


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def report(n: int, ref: dict, run: dict) -> None:
    rows, sync_s, met, bad = copy_rows(ref, run)
    more, window = typing_rows(run["typing"])
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\n{n} notes of real text; relay origin <id>.{DOMAIN}; Chromium at 390x844")
    print(f"(load average at the end: {load})")
    for name, value in rows + more:
        print(f"  {name:<52} {value:>24}")
    print(f"goal 1, first offline copy <= 10 s: {sync_s:.2f} s, {verdict(met)}")
    print(f"goal 2, autosave <= 1 request a second: at most {window}, {verdict(window <= 1)}")
    errors = run["errors"] + ref["errors"] + bad
    print(f"errors: {len(errors)}")
    for e in errors[:20]:
        print(f"  {e}")


def typed_text(notes: list, seconds: float) -> str:
    """About `seconds` of typing at 120 ms a key: another note's first words, real text."""
    words = notes[0][1].split("\n", 2)[-1].split()
    text = ""
    for word in words:
        if len(text) >= seconds / 0.12:
            break
        text += " " + word
    return text


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--notes", type=int, default=1000)
    ap.add_argument("--corpus", type=Path, default=Path("~/corpus/1k").expanduser())
    ap.add_argument("--type-seconds", type=float, default=10)
    args = ap.parse_args()
    print_header(
        {"SERVICE_RELAY_DOMAIN": f"{DOMAIN} (the relay)", "SERVICE_RELAY_URL": "the relay"}
    )
    if not CHROMIUM:
        raise SystemExit("no Chromium on this machine")
    notes = corpus_notes(args.corpus, args.notes)
    text = typed_text(notes, args.type_seconds)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        paths = seed_root(root, notes)
        pair = start_pair(root)
        try:
            warm_up(pair)
            ref = reference_copy(pair)
            run = browser_run(pair, root, paths, text)
        finally:
            stop_pair(pair)
    report(len(paths), ref, run)


if __name__ == "__main__":
    main()
