"""Embeddings: the endpoint's two wire formats and the background embedder.

SERVICE_EMBED_URL names an Ollama `/api/embed` or an OpenAI-compatible `/v1/embeddings`.
The embedder follows the notes in a thread of its own, asks for at most 64 chunks a
request, backs off while the endpoint fails, and keeps what it got in a VectorStore; a
search (search/hybrid.py) asks the endpoint for the query's vector only (1.5 s at most) and
answers in keyword mode, saying so, whenever that fails.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import time
import urllib.parse
from typing import Any

from notesvc.boot import log
from notesvc.helpers import iso, scrub, url_secrets
from notesvc.providers.base import Outbound, UpstreamError
from notesvc.search.vectors import (
    FLOOR_NEIGHBOURS,
    MAX_SEMANTIC_NOTES,
    VectorError,
    VectorStore,
    calibrate_floor,
    chunk_hash,
    chunk_note,
    fuse,
    normalised,
    remove_store,
)
from notesvc.service import Service

BATCH = 64  # chunks a request
MAX_ANSWER_BYTES = 16 << 20
MAX_DIMENSIONS = 4096
QUERY_BUDGET = 1.5  # seconds a search waits for its query's vector
QUERY_PAUSE = 30.0  # after a failed query, keyword answers without asking for this long
REQUEST_SECONDS = 120.0  # a batch that takes longer (a slow trickle) is a failure
BACKOFF = (2.0, 300.0)  # the embedder's wait after a failure: doubling from 2 s to 5 min
SAVE_SECONDS = 10.0  # meta.json at most this often while embedding
FLOOR_SECONDS = 60.0  # while a long backfill runs, the floor is made again at most this often
FLOOR_EVERY_CHANGE = 200  # below this many notes the floor is made again after any change
PROBE = "notesvc: the fingerprint of an embedding model"


class EmbedError(Exception):
    """A failed call to the endpoint: kind (http, timeout, connection, answer), status."""

    def __init__(self, kind: str, message: str, status: int = 0):
        super().__init__(message)
        self.kind = kind
        self.status = status


class EmbedClient:
    """One endpoint: which wire format its path says, the model, the key (a Bearer token)."""

    def __init__(self, url: str, model: str, key: str = ""):
        self.url = url
        self.model = model
        self.key = key
        path = urllib.parse.urlsplit(url).path
        self.ollama = path.endswith("/api/embed")
        self._calls: set = set()  # the Outbounds in flight (close() ends them)
        self._closed = False

    def close(self) -> None:
        """End every call in flight at once (a stopping server waits for none)."""
        self._closed = True
        for out in list(self._calls):
            out.abort()

    def scrub(self, text: str) -> str:
        """Return text (an answer or an error) without the key or the URL's secrets, in any
        spelling an endpoint may echo them (scrub), cut to 200 bytes."""
        return scrub(text, [self.key, *url_secrets(self.url)], 200)

    def embed(self, texts: list, timeout: float, dim: int = 0) -> list:
        """Return the normalised vectors of texts; EmbedError on any failure. The call is
        cut off after `timeout` seconds in all (a slow trickle included)."""
        body = json.dumps({"model": self.model, "input": texts}).encode()
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        fired: list = []

        def time_up() -> None:
            fired.append(True)
            out.abort()

        if self._closed:
            raise EmbedError("connection", "stopped")
        with Outbound() as out:
            self._calls.add(out)
            timer = threading.Timer(timeout, time_up)
            timer.daemon = True
            timer.start()
            try:
                status, _, raw = out.request(
                    "POST", self.url, body, headers, timeout, MAX_ANSWER_BYTES
                )
            except UpstreamError as e:
                if not (e.timeout or fired):
                    raise EmbedError("connection", self.scrub(str(e))) from None
                fired.append(True)
            finally:
                timer.cancel()
                self._calls.discard(out)
        if fired:  # a slow trickle too: each read was quick, the whole was not
            raise EmbedError("timeout", f"no answer in {timeout:g} s")
        if not 200 <= status < 300:  # a 3xx too: never follow (it would carry the key)
            text = raw.decode("utf-8", "replace")
            raise EmbedError("http", self.scrub(f"HTTP {status}: {text}"), status)
        return self._vectors(raw, len(texts), dim)

    def _vectors(self, raw: bytes, count: int, dim: int) -> list:
        try:
            answer = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise EmbedError("answer", "the answer is not JSON") from None
        if not isinstance(answer, dict):
            raise EmbedError("answer", "the answer is not a JSON object")
        if self.ollama:
            vectors = answer.get("embeddings")
        else:
            data = answer.get("data")
            if not isinstance(data, list) or not all(isinstance(d, dict) for d in data):
                raise EmbedError("answer", "the answer has no 'data' list")
            data = sorted(data, key=lambda d: d["index"] if isinstance(d.get("index"), int) else 0)
            vectors = [d.get("embedding") for d in data]
        if not isinstance(vectors, list) or len(vectors) != count:
            raise EmbedError("answer", f"the answer holds no list of {count} vectors")
        out = []
        for vec in vectors:
            if isinstance(vec, list) and len(vec) > MAX_DIMENSIONS:
                raise EmbedError("answer", f"a vector has over {MAX_DIMENSIONS} dimensions")
            try:
                out.append(normalised(vec, dim))
            except VectorError as e:
                kind = "dimension" if "dimensions" in str(e) else "answer"
                raise EmbedError(kind, str(e)) from None
        if len({len(v) for v in out}) > 1:
            raise EmbedError("answer", "the vectors differ in size")
        return out


def model_fingerprint(model: str, probe: list) -> str:
    """Return the digest of (model, dimensions, the probe's vector rounded)."""
    text = json.dumps([model, len(probe), [round(x, 2) for x in probe]])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _same_model(store: VectorStore, model: str, probe: list) -> bool:
    old = store.extra.get("probe") or []
    if store.model != model or store.dim != len(probe) or len(old) != len(probe):
        return False
    return math.fsum(a * b for a, b in zip(old, probe)) >= 0.99  # the same model's noise


class Embedder:
    """Keeps the vector store in line with the notes, in a thread of its own.

    What to embed comes from the search index: at start and after a rescan found changes,
    every note's file key (SearchIndex.note_keys) is compared with the one stored with its
    chunks; between those, the notes' own save, move and delete events name the note.
    """

    def __init__(self, svc: Service, client: EmbedClient):
        self.svc = svc
        self.client = client
        self.folder = svc.config.state_dir / "vectors"
        self.store: VectorStore | None = None
        self.last_error: dict | None = None
        self.fingerprint = ""
        self._lock = threading.Lock()
        self._dirty: set = set()
        self._walk = True
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._paused_until = 0.0  # queries: keyword only until then (a failed query)
        self._saved_at = 0.0
        self._opened = False  # the store on disk was looked for
        self._checked = False  # the endpoint's probe matched the store
        self._floor_lock = threading.Lock()
        self._floor_mark = -1  # store.changes when the floor was made (-1: not this run)
        self._floor_at = 0.0
        self._floor_settled = True  # the floor was made while nothing was left to embed

    # -- life -----------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self.svc.notes.listeners.append(self.on_note_event)
            self._thread = threading.Thread(target=self._run, name="notesvc-embed", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self.client.close()
        if self._thread is not None:
            self._thread.join(30)
        store = self.store
        if store is not None:
            store.close()

    def on_note_event(self, event: str, path: str, detail: Any) -> None:
        store = self.store
        if event == "moved" and store is not None:
            new = detail[0]
            if store.move(path, new):
                return
            path = new
        with self._lock:
            self._dirty.add(path)
        self._wake.set()

    def look_again(self) -> None:
        """Compare every note with what is stored (a rescan found files changed)."""
        self._walk = True
        self._wake.set()

    # -- the loop --------------------------------------------------------------------------

    def _run(self) -> None:
        pause = BACKOFF[0]
        while not self._stop.is_set():
            try:
                if not self._checked:
                    self._connect()
                self._catch_up()
                pause = BACKOFF[0]
            except EmbedError as e:
                self._failed(e)
                self._walk = True  # what was not done is found again by the next walk
                if self._stop.wait(pause):
                    break
                pause = min(pause * 2, BACKOFF[1])
                continue
            except Exception:  # a bug must not stop the notes from being embedded later
                log.exception("embeddings: the embedder failed; trying again in 60 s")
                self._walk = True
                if self._stop.wait(60):
                    break
                continue
            self._idle()
            self._wake.wait(60)
            self._wake.clear()

    def _failed(self, e: EmbedError) -> None:
        self.last_error = {
            "class": e.kind,
            "status": e.status or None,
            "message": self.client.scrub(str(e)),
            "at": iso(time.time()),
        }
        log.warning("embeddings: %s (%s); trying again later", self.last_error["message"], e.kind)
        if e.kind == "dimension":  # the model changed under us: probe it again
            self._checked = False
            self._wake.set()

    def _idle(self) -> None:
        store = self.store
        if store is None:
            return
        if self._floor_due(store, idle=True):
            self._calibrate(store, idle=True)
        if store.dirty:
            store.save()
        if store.dead() > max(1000, store.stats()["chunks"] // 4):
            store.compact()
        store.forget_hashes()

    def _connect(self) -> None:
        """Open the store kept on disk (searches and related notes use it at once), ask for
        the probe's vector, and start a new store when the model is not the store's."""
        model = self.client.model
        if self.store is None and not self._opened:
            self._opened = True
            store = VectorStore.open(self.folder)
            if store is not None and store.model == model:
                self.store, self.fingerprint = store, store.fingerprint
                self._floor_mark = store.changes  # the floor kept with it holds
                if self._floor_due(store):  # a store of an older version: none kept
                    self._calibrate(store)
            elif store is not None:
                store.close()
        probe = self.client.embed([PROBE], REQUEST_SECONDS)[0]
        store = self.store
        if store is None or not _same_model(store, model, probe):
            if store is not None:
                log.info("embeddings: the model changed: embedding every note again")
                self.store = None
                store.close()
            extra = {"probe": [round(x, 6) for x in probe]}
            store = VectorStore.create(
                self.folder, len(probe), model_fingerprint(model, probe), model, extra
            )
        self.fingerprint = store.fingerprint
        self.store = store
        self._checked = True
        self._walk = True

    def _catch_up(self) -> None:
        """Embed what changed: every note when a walk is due, else the notes named."""
        store = self.store
        index = self.svc.index
        if self._walk:
            self._walk = False
            with self._lock:
                self._dirty.clear()
            _, keyed = index.note_keys(stable=True)  # kept on disk: the same after a restart
            seen: set = set()
            todo = []
            for key, path, _ in keyed:
                seen.add(path)
                if key is None or store.key_of(path) != key or not store.holds(path):
                    todo.append(path)
            gone = [p for p in store.paths() if p not in seen]
            for path in gone:
                store.drop(path)
        else:
            with self._lock:
                todo, self._dirty = sorted(self._dirty), set()
        self._embed_notes(todo)

    def _embed_notes(self, paths: list) -> None:
        store, index = self.store, self.svc.index
        pending: list = []  # (path, key, hashes)
        wanted: dict = {}  # chunk hash -> text, not in the store yet
        for path in paths:
            if self._stop.is_set():
                return
            doc = index.document(path)
            if doc is None:
                store.drop(path)
                continue
            key = index.note_key(path)
            chunks = chunk_note(doc[1], doc[2])
            hashes = [chunk_hash(c) for c in chunks]
            for h, c in zip(hashes, chunks):
                if h not in wanted and store.find(h) < 0:
                    wanted[h] = c
            pending.append((path, key, hashes))
            if len(wanted) >= BATCH or len(pending) >= 256:
                self._flush(pending, wanted)
                pending, wanted = [], {}
        self._flush(pending, wanted)

    def _flush(self, pending: list, wanted: dict) -> None:
        store = self.store
        items = list(wanted.items())
        for at in range(0, len(items), BATCH):
            part = items[at : at + BATCH]
            vectors = self.client.embed([c for _, c in part], REQUEST_SECONDS, store.dim)
            store.append([(h, v) for (h, _), v in zip(part, vectors)])
            if self._stop.is_set():
                return
        for path, key, hashes in pending:
            if self.svc.index.document(path) is None:
                store.drop(path)
                continue
            recs = [store.find(h) for h in hashes]
            if all(r >= 0 for r in recs):
                store.assign(path, key, recs)
        self.last_error = None
        if time.monotonic() - self._floor_at > FLOOR_SECONDS and self._floor_due(store):
            self._calibrate(store)  # a long backfill: searches meanwhile get a fitting floor
        if store.dirty and time.monotonic() - self._saved_at > SAVE_SECONDS:
            store.save()
            self._saved_at = time.monotonic()

    # -- what searches ask ---------------------------------------------------------------

    def status(self, folder: str | tuple = "") -> dict:
        """Return {embedded, total, model}: notes whose chunks are all embedded, of all the
        notes beneath `folder` (or the folders of a reach; "" or () every note): a grant's
        count is its reach's. Both counts are kept as notes change: look-ups, no walk."""
        store = self.store
        index = self.svc.index
        folders = (folder,) if isinstance(folder, str) else tuple(folder)
        if any(folders):
            counts = index.folder_counts()
            total = sum(counts.get(f.rstrip("/"), 0) for f in folders if f)
        else:
            total = index.stats().get("documents", 0)
        embedded = min(total, store.count_under(folder)) if store is not None else 0
        return {"embedded": embedded, "total": total, "model": self.client.model}

    def info(self) -> dict:
        store = self.store
        return {
            **self.status(),
            "dimensions": store.dim if store is not None else None,
            "lastError": self.last_error,
            "fingerprint": self.fingerprint or None,
            "floor": self.floor(),
        }

    # -- the floor -------------------------------------------------------------------------

    def _floor_due(self, store: VectorStore, idle: bool = False) -> bool:
        """Whether the floor is missing or out of date: the notes changed by a tenth since it
        was made; while few notes are held (FLOOR_EVERY_CHANGE, a few milliseconds' work)
        any change; and, once the embedder is idle, any change since a floor made during
        a backfill (so the floor of a finished backfill counts every note)."""
        floor = store.extra.get("floor")
        if not isinstance(floor, dict) or not isinstance(floor.get("cosine"), (int, float)):
            return bool(store.stats()["notes"])
        if self._floor_mark < 0:
            return True
        changed = store.changes - self._floor_mark
        notes = int(floor.get("notes") or 0)
        if notes > 1 and not (floor.get("neighbours") or {}).get("notes"):
            return True  # made in a request, without the neighbours: measure them now
        if changed >= max(1, notes // 10):
            return True
        return changed > 0 and (notes < FLOOR_EVERY_CHANGE or (idle and not self._floor_settled))

    def _calibrate(
        self, store: VectorStore, idle: bool = False, neighbours: int = FLOOR_NEIGHBOURS
    ) -> dict | None:
        """Make the floor again from the notes held (calibrate_floor) and keep it with the
        store: it belongs to this model's vectors and goes when they do."""
        probe = store.extra.get("probe")
        if not probe:
            return None
        with self._floor_lock:
            mark = store.changes
            floor = {**calibrate_floor(store, probe, neighbours), "at": iso(time.time())}
            with store.lock:
                store.extra["floor"] = floor
                store.dirty = True
            self._floor_mark = mark
            self._floor_at = time.monotonic()
            self._floor_settled = idle
        log.info(
            "embeddings: the floor is a cosine of %.3f (%d notes)", floor["cosine"], floor["notes"]
        )
        return floor

    def floor(self) -> dict | None:
        """Return the floor in force ({cosine, notes, probe, neighbours, ...}), None while
        no note is embedded. A store that holds notes but no floor yet gets one now."""
        store = self.store
        if store is None:
            return None
        floor = store.extra.get("floor")
        if not isinstance(floor, dict) and store.stats()["notes"]:
            # in a request: the probe's part only (a fraction of a second at any size); the
            # embedder measures the neighbours next
            floor = self._calibrate(store, neighbours=0)
        return floor if isinstance(floor, dict) else None

    def floor_cosine(self) -> float:
        floor = self.floor()
        return float(floor["cosine"]) if floor else -1.0

    def query_vector(self, text: str) -> list | None:
        """Return the query's normalised vector, None when the endpoint failed now or a
        moment ago (then searches answer in keyword mode for QUERY_PAUSE seconds)."""
        store = self.store
        if store is None or time.monotonic() < self._paused_until:
            return None
        try:
            return self.client.embed([text], QUERY_BUDGET, store.dim)[0]
        except EmbedError as e:
            self._paused_until = time.monotonic() + QUERY_PAUSE
            self._failed(e)
            return None

    def fuse_hits(self, question: str, folder: str | tuple, hits: list, limit: int) -> list:
        """Return the agent's sources: keyword hits [(path, title, text, score)] fused with
        the notes nearest the question in meaning (the keyword hits alone when the
        endpoint fails)."""
        vector = self.query_vector(question[:2000])
        if vector is None:
            return hits
        near = [p for p, _, _ in self.nearest(vector, folder, limit)]
        known = {h[0]: h for h in hits}
        out = []
        for path, score in fuse([h[0] for h in hits], near)[:limit]:
            if path in known:
                out.append(known[path])
                continue
            doc = self.svc.index.document(path)
            if doc is not None:
                out.append((path, doc[1], doc[2], score))
        return out

    def nearest(self, vector: list, folder: str | tuple, limit: int = MAX_SEMANTIC_NOTES) -> list:
        """Return [(path, cosine, chunk)] of the notes nearest a vector that clear the floor:
        a query about nothing in the notes finds nothing by meaning."""
        store = self.store
        if store is None:
            return []
        floor = self.floor_cosine()
        return [n for n in store.nearest(vector, folder, limit) if n[1] >= floor]


def build_embedder(svc: Service) -> Embedder | None:
    """Return the embedder of the config, None when embeddings are off (a leftover store
    is then deleted: nothing of it stays on disk or in memory)."""
    cfg = svc.config
    if not cfg.embed_url:
        if not svc.readonly:
            remove_store(cfg.state_dir / "vectors")
        return None
    return Embedder(svc, EmbedClient(cfg.embed_url, cfg.embed_model, cfg.embed_key))
