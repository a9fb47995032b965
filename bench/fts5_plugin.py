"""SQLite FTS5 behind notesvc's own route chain: the reference of `bench_search.py --http`.

bench_search copies this file into a scratch server's `.notesvc/plugins/` and starts that
server (`notesvc.py`, default settings, its key): a search of the FTS5 table then passes
through everything a search of notesvc passes through — waitress and its 8 threads, the
middleware, the key check, the route's scope, the envelope — and only the index differs.

- `GET /api/v1/plugins/fts5ref/search?q=...&limit=10`: the top hits of an FTS5 query by
  bm25() (title weighted 2, like notesvc) with snippet() (about notesvc's snippet length),
  answered as notesvc answers a search: query, total, limit, offset, results (path, title,
  score, snippet). `total` is counted as notesvc counts it (SELECT count(*)).

The FTS5 file is read-only (`FTS5REF_DB`), one connection per waitress thread.
"""

from __future__ import annotations

import os
import sqlite3
import threading

import notesvc

TOP = (
    "SELECT path, title, snippet(notes, 2, '', '', '…', 40), bm25(notes, 0.0, 2.0, 1.0) "
    "FROM notes WHERE notes MATCH ? ORDER BY bm25(notes, 0.0, 2.0, 1.0) LIMIT ?"
)
COUNT = "SELECT count(*) FROM notes WHERE notes MATCH ?"
_local = threading.local()


def _db() -> sqlite3.Connection:
    db = getattr(_local, "db", None)
    if db is None:
        path = os.environ["FTS5REF_DB"]
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
        _local.db = db
    return db


def search(svc) -> dict:
    q = notesvc.query_str("q")
    limit = notesvc.query_int("limit", 10, 1, 100)
    try:
        rows = _db().execute(TOP, (q, limit)).fetchall()
        total = _db().execute(COUNT, (q,)).fetchone()[0]
    except sqlite3.OperationalError as e:
        raise notesvc.ApiError(400, "BAD_QUERY", str(e)) from None
    results = [{"path": p, "title": t, "score": round(-b, 4), "snippet": s} for p, t, s, b in rows]
    return {"query": q, "total": total, "limit": limit, "offset": 0, "results": results}


PLUGIN = notesvc.Plugin(
    name="fts5ref",
    description="SQLite FTS5 behind notesvc's route chain (bench_search.py's reference)",
    routes=(notesvc.PluginRoute("GET", "/search", search, scope="read"),),
)
