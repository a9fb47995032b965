"""Hybrid search: by meaning and by words, fused; a note's related notes."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from notesvc.errors import bad_request
from notesvc.search.text import Query, tokenize
from notesvc.search.vectors import MAX_SEMANTIC_NOTES, chunk_body, chunk_note, fuse

if TYPE_CHECKING:  # svc is duck-typed: its index and its embedder
    from notesvc.service import Service

# -- searching by meaning and by words ---------------------------------------------------

MODES = ("hybrid", "semantic", "keyword")

_QUOTED_RE = re.compile(r'(?:^|\s)"([^"]*)"')  # a "quoted phrase", not a -"exclusion"


def _lexical_only(query: Query) -> bool:
    """A "quoted phrase" or a prefix* is about the words as typed: those queries stay
    keyword. A word with inner punctuation (command-line, e-mail) is a phrase to the index
    but not to the person typing it: it is searched by meaning too."""
    if any(alt[0] == "prefix" for clause in query.clauses for alt in clause):
        return True
    return any(len(tokenize(p)) > 1 for p in _QUOTED_RE.findall(query.text))


def _embedding_text(query: Query) -> str:
    """Return what to embed: the words asked for, without OR and -exclusions."""
    words = [w for w in query.text.split() if w != "OR" and not w.startswith("-")]
    return " ".join(words) or query.text


def _chunk_snippet(svc: Service, path: str, chunk: int) -> str:
    doc = svc.index.document(path)
    if doc is None:
        return ""
    chunks = chunk_note(doc[1], doc[2])
    if chunk >= len(chunks):
        return ""
    text = " ".join(chunk_body(chunks[chunk]).split())
    return text if len(text) <= 200 else text[:199].rsplit(" ", 1)[0] + "…"


def find_notes(
    svc: Service,
    query: Query,
    folder: str | tuple,
    limit: int,
    offset: int,
    mode: str = "",
    reach: tuple = (),
) -> dict:
    """Search as `mode` asks (hybrid by default when embeddings are on), among the notes of
    `folder` (a folder, or several: "" or () every note) within `reach` (the folders of a
    principal that sees part of the notes, () everything: they alone give the words' scores
    their statistics, SearchIndex.search): {total, results: [(path, title, score, snippet)],
    mode, fallback}. Never fails because the endpoint does: it answers in keyword mode with
    fallback true."""
    embedder = svc.embedder
    folder = folder or reach  # never wider than the reach
    if mode and mode not in MODES:
        raise bad_request(f"'mode' must be one of {', '.join(MODES)}")
    mode = mode or ("hybrid" if embedder is not None else "keyword")
    reader = getattr(svc, "reader", None)
    in_files = []
    if reader is not None and mode != "semantic":
        in_files = reader.find(query, folder, snippets=offset + limit)
    if in_files and query.excludes:  # a note whose own words the query excludes stays out
        out = svc.index.excluded(query.excludes, [n for n, _, _ in in_files])
        in_files = [hit for hit in in_files if hit[0] not in out]
    page = (offset + limit, 0) if in_files else (limit, offset)
    if mode != "keyword" and embedder is not None and not _lexical_only(query):
        vector = embedder.query_vector(_embedding_text(query))
        if vector is not None:
            found = _by_meaning(svc, query, folder, page, mode, vector, reach)
            return _with_files(svc, found, in_files, limit, offset)
    total, hits = svc.index.search(query, folder, *page, reach=reach)
    found = {"total": total, "results": hits, "mode": "keyword", "fallback": mode != "keyword"}
    return _with_files(svc, found, in_files, limit, offset)


def _with_files(svc: Service, found: dict, in_files: list, limit: int, offset: int) -> dict:
    """Return the answer with the notes found through the text of files they link: a note
    found by its own words too keeps its own snippet and adds the file's score; one found
    only in a file gets the file's snippet (`scan.pdf, p. 3: ...`). `found` holds the first
    offset + limit results when in_files has any (the page is cut here)."""
    if not in_files:
        return found
    results = {p: [t, s, sn] for p, t, s, sn in found["results"]}
    fresh = [n for n, _, _ in in_files if n not in results]
    titles = svc.index.titles(fresh)
    for note, score, snippet in in_files:
        if note in results:
            results[note][1] = round(results[note][1] + score, 4)
        elif note in titles:  # (a note the index does not hold is not answered)
            results[note] = [titles[note], score, snippet]
    ranked = sorted(results.items(), key=lambda kv: -kv[1][1])[offset : offset + limit]
    added = sum(1 for n in fresh if n in titles)
    return {
        **found,
        "total": found["total"] + added,
        "results": [(p, t, s, sn) for p, (t, s, sn) in ranked],
    }


def _by_meaning(
    svc: Service, query: Query, folder: str | tuple, page: tuple, mode: str, vector, reach: tuple
) -> dict:
    near = svc.embedder.nearest(vector, folder)
    if query.excludes:
        out = svc.index.excluded(query.excludes, [p for p, _, _ in near])
        near = [n for n in near if n[0] not in out]
    chunk_of = {p: c for p, _, c in near}
    if mode == "semantic":
        ranked = [(p, round(s, 4)) for p, s, _ in near]
    else:
        _, hits = svc.index.search(
            query, folder, MAX_SEMANTIC_NOTES, 0, snippets=False, reach=reach
        )
        words = [p for p, *_ in hits]
        ranked = [(p, round(s, 6)) for p, s in fuse(words, list(chunk_of))]
    limit, offset = page
    results = _with_snippets(svc, query, ranked[offset : offset + limit], chunk_of)
    return {"total": len(ranked), "results": results, "mode": mode, "fallback": False}


def _with_snippets(svc: Service, query: Query, page: list, chunk_of: dict) -> list:
    """Return [(path, title, score, snippet)]: the best chunk's start for a note the
    meaning found, the words' snippet for one only the words found."""
    titles = svc.index.titles(p for p, _ in page)
    lexical = [p for p, _ in page if p not in chunk_of]
    snippets = svc.index.snippets(query, lexical) if lexical else {}
    results = []
    for path, score in page:
        if path in chunk_of:
            snippet = _chunk_snippet(svc, path, chunk_of[path])
        else:
            snippet = snippets.get(path, "")
        results.append((path, titles.get(path) or "", score, snippet))
    return results


def related_notes(svc: Service, path: str, folder: str | tuple, limit: int) -> list:
    """Return [(path, title, score)] of the notes nearest a note (its chunks' mean) that
    clear the floor: fewer than `limit`, or none, when no other note is near."""
    embedder = svc.embedder
    store = None if embedder is None else embedder.store
    if store is None:
        return []
    vector = store.note_vector(path)
    if vector is None:
        return []
    near = [n for n in embedder.nearest(vector, folder, limit + 1) if n[0] != path][:limit]
    titles = svc.index.titles(p for p, _, _ in near)
    return [(p, titles.get(p) or "", round(s, 4)) for p, s, _ in near]
