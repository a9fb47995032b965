"""The FTS5-behind-Bottle reference server of `bench_search.py --http`.

    python bench/fts5_server.py --db /tmp/fts.db [--port 0] [--threads 8]

A tiny Bottle app under waitress (notesvc's WSGI server, with its default of 8 threads):

- `GET /search?q=...&limit=10`: the top hits of an SQLite FTS5 query by bm25() with
  snippet(), the same SQL as the in-process FTS5 reference of bench_search.py, as JSON;
  one read-only connection per waitress thread;
- `GET /bare`: a small JSON answer and nothing else (the leanness reference: what Bottle
  and waitress cost by themselves).

It prints `listening on http://127.0.0.1:<port>` on stderr once it accepts connections.
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
import threading

import bottle
import waitress.server

TOP = (
    "SELECT path, title, snippet(notes, 2, '', '', '…', 40), bm25(notes, 0.0, 2.0, 1.0) "
    "FROM notes WHERE notes MATCH ? ORDER BY bm25(notes, 0.0, 2.0, 1.0) LIMIT ?"
)


def make_app(db_path: str) -> bottle.Bottle:
    app = bottle.Bottle()
    local = threading.local()

    def connection() -> sqlite3.Connection:
        db = getattr(local, "db", None)
        if db is None:
            db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, check_same_thread=False)
            local.db = db
        return db

    @app.get("/search")
    def search():
        q = bottle.request.query.getunicode("q", "")
        limit = int(bottle.request.query.get("limit", "10"))
        try:
            rows = connection().execute(TOP, (q, limit)).fetchall()
        except sqlite3.OperationalError as e:
            bottle.response.status = 400
            return {"success": False, "error": str(e)}
        results = [
            {"path": p, "title": t, "snippet": s, "score": round(-b, 4)} for p, t, s, b in rows
        ]
        return {"success": True, "data": {"query": q, "results": results}}

    @app.get("/bare")
    def bare():
        return {"success": True, "data": {"status": "ok"}}

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--db", required=True, help="an SQLite file holding the FTS5 table notes")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--threads", type=int, default=8, help="waitress threads (notesvc: 8)")
    args = ap.parse_args()
    server = waitress.server.create_server(
        make_app(args.db),
        host="127.0.0.1",
        port=args.port,
        threads=args.threads,
        asyncore_use_poll=True,
        ident="fts5ref",
    )
    print(f"listening on http://127.0.0.1:{server.effective_port}", file=sys.stderr, flush=True)
    server.run()


if __name__ == "__main__":
    main()
