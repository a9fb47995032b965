"""Benchmark: people on one server (issue 52), a person against the owner, in one run.

    python bench/bench_people.py                  # 10k notes of real text (~/corpus/10k)
    python bench/bench_people.py --notes 10000 --repeat 5 --json /tmp/people.json

A real `notesvc.py` on 127.0.0.1 at its default settings, over keep-alive HTTP. The notes
are the real-text corpus of ../shared/bench/corpus.py (built into ~/corpus/<n> when
missing), spread over 5 homes and 3 shared folders: the corpus's 320 folders are dealt
round to notes/Ann, notes/Bob, notes/Cho, notes/Dev, notes/Eli (each a person's home) and
notes/Family (shared with all five, write), notes/Garden (Ann and Bob, read) and
notes/Trips (Ann and Cho, write), about an eighth of the notes each. The people are added
and the folders shared through the API on an empty server; the notes are then copied in
while it runs, so its rescan indexes them and writes their `created` entries to the change
feed, as for notes another program wrote.

Measured, each with the owner's API key as the reference in the same run (the passes
taking turns, best of --repeat tries per query, as bench_search.py does):

- the first try of every query by each principal (p50: the masks of a reach are made,
  and a word's count within it taken, on a first search);
- search p50 and p95 per query kind (bench_search.py's make_real_queries: common word,
  rare word, 2-3 word AND, phrase, prefix) as Ann (her home and three shared folders: half
  the notes) and as Eli (his home and Family: a quarter), on a device key of their own;
- the change feed: a page of 100 (`GET /changes?since=S&limit=100`) at 200 cursors spread
  over the journal, and the whole feed read from 0 in pages of 1,000;
- adding a person (`POST /people`, which makes their home and a pairing) at 10k notes:
  40 added, each timed, then removed.

Goals (issue 52): a person's search p50 <= 1.1x the owner's same search; the change feed's
read <= 1.1x the owner's; adding a person <= 50 ms.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_header
from bench_search import (
    KINDS,
    SHARED_BENCH,
    Client,
    measure_paired,
    note_paths,
    real_corpus,
    search_path,
    server_key,
    start_server,
    stop,
)
from bench_search import make_real_queries as real_queries

API = "/api/v1"
HOMES = ("Ann", "Bob", "Cho", "Dev", "Eli")
SHARED = {  # folder -> {person: scope}
    "Family": {name: "write" for name in HOMES},
    "Garden": {"Ann": "read", "Bob": "read"},
    "Trips": {"Ann": "write", "Cho": "write"},
}
GROUPS = (*HOMES, *SHARED)  # the 8 top folders the corpus is dealt to


def call(client: Client, method: str, path: str, body: dict | None = None) -> dict:
    raw = json.dumps(body).encode() if body is not None else None
    status, out = client.request(method, path, raw)
    if status >= 300:
        raise RuntimeError(f"{method} {path}: {status} {out[:300]!r}")
    return json.loads(out)["data"]


def device_key(owner: Client, port: int, pairing: dict) -> str:
    anon = Client(port)
    claim = {"secret": pairing["secret"], "deviceName": "bench phone"}
    try:
        return call(anon, "POST", f"{API}/auth/devices/claim", claim)["key"]
    finally:
        anon.close()


def copy_corpus(corpus: Path, root: Path) -> dict:
    """Copy the corpus's notes into the 8 top folders (corpus folder i -> GROUPS[i % 8]);
    return {group: notes}."""
    folders = sorted({p.split("/")[1] for p in note_paths(corpus) if p.count("/") >= 2})
    group_of = {f: GROUPS[i % len(GROUPS)] for i, f in enumerate(folders)}
    counts = dict.fromkeys(GROUPS, 0)
    for rel in note_paths(corpus):
        parts = rel.split("/")
        group = (
            group_of.get(parts[1], GROUPS[hash(rel) % len(GROUPS)])
            if len(parts) > 2
            else (GROUPS[0])
        )
        target = root / "notes" / group / "/".join(parts[1:])
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(corpus / rel, target)
        counts[group] += 1
    return counts


def wait_indexed(owner: Client, n: int, limit: float = 900.0) -> float:
    started = time.monotonic()
    while True:
        info = call(owner, "GET", f"{API}/system/info")
        docs = (info.get("index") or {}).get("documents", 0)
        feed = call(owner, "GET", f"{API}/changes?since=latest")["last"]
        if docs >= n and feed >= n:
            return time.monotonic() - started
        if time.monotonic() - started > limit:
            raise SystemExit(f"only {docs} notes indexed, {feed} changes, after {limit:.0f} s")
        time.sleep(0.5)


def p(values: list, q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def feed_pages(clients: dict, last: int, cursors: int, repeat: int, seed: int = 5) -> dict:
    """p50/p95 (ms) of a page of 100 at `cursors` cursors, best of `repeat` each, the
    clients taking turns; and the whole feed in pages of 1,000 (best of `repeat`)."""
    rnd = random.Random(seed)
    spots = sorted(rnd.randrange(0, max(1, last - 100)) for _ in range(cursors))
    # a person's feed is numbered with gaps and answers their own cursors (one past the
    # newest change they see is 410): at each spot, each asks with the cursor its own
    # client would hold there, the number of the last change it saw at or before it
    cursor_at = {}
    for name, client in clients.items():
        seqs, since = [], 0
        while True:
            page = json.loads(client.get(f"{API}/changes?since={since}&limit=1000"))["data"]
            seqs += [c["seq"] for c in page["changes"]]
            since = page["last"]
            if not page["more"]:
                break
        cursor_at[name] = [seqs[i - 1] if (i := bisect.bisect_right(seqs, s)) else 0 for s in spots]
    best = {name: [float("inf")] * len(spots) for name in clients}
    whole = dict.fromkeys(clients, float("inf"))
    seen = dict.fromkeys(clients, 0)
    for r in range(repeat + 1):  # the first pass warms
        order = list(clients) if r % 2 == 0 else list(clients)[::-1]
        for i in range(len(spots)):
            for name in order:
                since = cursor_at[name][i]
                t = timed(
                    lambda c=clients[name], s=since: c.get(f"{API}/changes?since={s}&limit=100")
                )
                if r:
                    best[name][i] = min(best[name][i], t)
        for name in order:
            client = clients[name]

            def read_all(client=client, name=name) -> None:
                since, count = 0, 0
                while True:
                    page = json.loads(client.get(f"{API}/changes?since={since}&limit=1000"))["data"]
                    count += len(page["changes"])
                    since = page["last"]
                    if not page["more"]:
                        break
                seen[name] = count

            t = timed(read_all)
            if r:
                whole[name] = min(whole[name], t)
    return {
        name: {
            "page_p50_ms": round(statistics.median(best[name]) * 1000, 3),
            "page_p95_ms": round(p(best[name], 0.95) * 1000, 3),
            "whole_ms": round(whole[name] * 1000, 1),
            "entries_seen": seen[name],
        }
        for name in clients
    }


def first_tries(runs: dict, queries: dict) -> dict:
    """p50 (ms) over every query of its first try by each principal, before any other: the
    reach's masks are made and a word's count within it taken on a first search (they are
    kept after). The principals take turns going first, query by query."""
    names = list(runs)
    times: dict = {name: [] for name in names}
    for i, q in enumerate(q for qs in queries.values() for q in qs):
        for name in names if i % 2 else names[::-1]:
            times[name].append(timed(lambda name=name, q=q: runs[name](q)))
    return {name: round(statistics.median(t) * 1000, 3) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--notes", type=int, default=10000)
    ap.add_argument("--corpus-dir", default=None, help="the corpus (default ~/corpus/<n>)")
    ap.add_argument("--queries", type=int, default=40, help="queries per kind")
    ap.add_argument("--repeat", type=int, default=5, help="tries per query (best counts)")
    ap.add_argument("--json", default=None, help="write the figures here too")
    args = ap.parse_args()
    print_header()
    print("load average at the start:", " ".join(f"{x:.2f}" for x in os.getloadavg()), flush=True)
    corpus = real_corpus(args.notes, args.corpus_dir, SHARED_BENCH / "corpus.py")
    queries = real_queries(corpus, args.notes, args.queries)
    out: dict = {"notes": args.notes, "corpus": str(corpus)}
    with tempfile.TemporaryDirectory(prefix="bench-people-") as tmp:
        root = Path(tmp)
        proc, port, _ = start_server(root, {}, auth_mode="api-key")
        try:
            owner = Client(port, server_key(root))
            people, keys = {}, {}
            for name in HOMES:
                made = call(owner, "POST", f"{API}/people", {"name": name})
                people[name] = made["person"]["id"]
                keys[name] = device_key(owner, port, made["pairing"])
            started = time.monotonic()
            counts = copy_corpus(corpus, root)
            print(f"notes per top folder: {counts}", flush=True)
            took = wait_indexed(owner, args.notes)
            print(
                f"{args.notes} notes copied and indexed in {time.monotonic() - started:.1f} s "
                f"(the rescan's {took:.1f} s after the copy)",
                flush=True,
            )
            for folder, members in SHARED.items():
                body = {"members": [{"person": people[n], "scope": s} for n, s in members.items()]}
                call(
                    owner,
                    "PUT",
                    f"{API}/folders/{urllib.parse.quote('notes/' + folder, safe='')}/members",
                    body,
                )
            clients = {"owner": owner}
            for name in ("Ann", "Eli"):
                clients[name] = Client(port, {"X-Service-Key": keys[name]})
            reach = {}
            for name in ("Ann", "Eli"):
                verify = call(clients[name], "POST", f"{API}/auth/verify")
                folders = [r["path"] for r in verify["reach"]]
                reach[name] = (folders, sum(counts[f.split("/")[1]] for f in folders))
                print(f"{name} reaches {folders}: {reach[name][1]} notes", flush=True)
            out["reach"] = reach

            # -- search ---------------------------------------------------------------
            runs = {
                name: (lambda q, c=c: c.get(search_path(f"{API}/search", q)))
                for name, c in clients.items()
            }
            for q in queries["rare word"][:3]:  # each answers within its reach
                for name in ("Ann", "Eli"):
                    hits = json.loads(runs[name](q))["data"]["results"]
                    assert all(h["path"].startswith(tuple(reach[name][0])) for h in hits), q
            cold = first_tries(runs, queries)
            out["search_first_try_p50_ms"] = cold
            print(
                "first try of every query, p50 ms (each principal's first search of it): "
                + ", ".join(f"{n} {ms:.2f} ({ms / cold['owner']:.2f}x)" for n, ms in cold.items())
            )
            figures = measure_paired(runs, queries, args.repeat)
            out["search"] = figures
            print(
                f"\nsearch, p50 / p95 ms over {args.queries} queries a kind (best of "
                f"{args.repeat}); x = against the owner's same search"
            )
            print(f"{'kind':<14}" + "".join(f"{n + ' p50':>12}{'x':>7}" for n in clients))
            every = {name: [] for name in clients}
            for kind in KINDS:
                row = f"{kind:<14}"
                for name in clients:
                    f = figures[name][kind]
                    every[name].append(f["p50"])
                    ref = figures["owner"][kind]["p50"]
                    row += f"{f['p50']:>12.2f}{f['p50'] / ref:>7.2f}"
                print(row)
            for name in clients:
                out.setdefault("search_p50_ratio", {})[name] = round(
                    statistics.median(
                        [figures[name][k]["p50"] / figures["owner"][k]["p50"] for k in KINDS]
                    ),
                    3,
                )
            print("median over the kinds of the p50 ratio:", out["search_p50_ratio"])

            # -- the change feed ------------------------------------------------------
            last = call(owner, "GET", f"{API}/changes?since=latest")["last"]
            feed = feed_pages(clients, last, 200, args.repeat)
            out["feed"] = feed
            print(f"\nthe change feed ({last} entries): a page of 100 at 200 cursors, the whole")
            for name, f in feed.items():
                ref = feed["owner"]
                x = f["page_p50_ms"] / ref["page_p50_ms"]
                print(
                    f"{name:<6} page p50 {f['page_p50_ms']:.3f} ms ({x:.2f}x)"
                    f"  p95 {f['page_p95_ms']:.3f} ms  whole {f['whole_ms']:.1f} ms "
                    f"({f['whole_ms'] / ref['whole_ms']:.2f}x, {f['entries_seen']} entries seen)"
                )

            # -- adding a person ------------------------------------------------------
            adds, added = [], []
            for i in range(40):
                t = time.perf_counter()
                made = call(owner, "POST", f"{API}/people", {"name": f"Guest {i:02d}"})
                adds.append(time.perf_counter() - t)
                added.append(made["person"]["id"])
            for pid in added:
                call(owner, "DELETE", f"{API}/people/{pid}")
            out["add_person_ms"] = {
                "p50": round(statistics.median(adds) * 1000, 2),
                "max": round(max(adds) * 1000, 2),
            }
            print(
                f"\nadding a person at {args.notes} notes: p50 {out['add_person_ms']['p50']} ms,"
                f" max {out['add_person_ms']['max']} ms (40 added)"
            )
            for c in clients.values():
                c.close()
        finally:
            stop(proc)
    out["load_average_at_the_end"] = os.getloadavg()
    print("load average at the end:", " ".join(f"{x:.2f}" for x in out["load_average_at_the_end"]))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
