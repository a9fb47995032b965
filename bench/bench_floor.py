"""Benchmark: what the search floor costs in search quality, and what it cuts.

    nice python bench/bench_floor.py --notes 1200        # bench_semantic's man pages
    nice python bench/bench_floor.py --personal          # the tests' 29 personal notes

The collection is bench_semantic.py's (man pages, frozen in ~/.cache/notesvc-bench; queries
the pages' NAME descriptions, one relevant note each), or with --personal the 29 notes of
the tests (PERSONAL_NOTES) with queries about what no note holds. Each note is cut by
notesvc's own chunk_note and embedded with all-MiniLM-L6-v2 (sentence-transformers on
PyTorch, CPU, --threads; see bench/embed_server.py for the install); a note's score is its
best chunk's cosine, as the semantic pass scores it (exact, float32: the pass finds 0.99 of
the same top 10). The floor is made as notesvc makes it (calibrate_floor's rule: the probe
text's median cosine to the notes plus FLOOR_Z robust spreads, the spread weighted with
1/sqrt(dimensions) by FLOOR_PRIOR notes). Reported: the floor; semantic MRR@10 without and
with it; the relevant notes under it; the queries it leaves with nothing by meaning (hybrid
still gives them their keyword hits).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--notes", type=int, default=1200, help="man pages (bench_semantic's)")
    ap.add_argument("--personal", action="store_true", help="the tests' 29 personal notes")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import embed_server
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    import notesvc

    torch.set_num_threads(args.threads)
    if args.personal:
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            "t", HERE.parent / "tests" / "test_search_vectors.py"
        )
        source = spec.loader.get_source("t")
        start = source.index("PERSONAL_NOTES = {")
        personal: dict = {}
        exec(source[start : source.index("\n}\n", start) + 3], personal)  # noqa: S102 - ours
        notes = [
            {"title": notesvc.note_title(t, p), "text": t, "query": None}
            for p, t in personal["PERSONAL_NOTES"].items()
        ]
        label = "the tests' 29 personal notes"
    else:
        import bench_semantic

        notes, digest = bench_semantic.build_collection(args.notes)
        label = f"{len(notes)} man pages, digest {digest}"
    model = SentenceTransformer(str(embed_server.model_dir(None)), device="cpu")
    texts, owner = [], []
    for i, note in enumerate(notes):
        for chunk in notesvc.chunk_note(note["title"], note["text"]):
            texts.append(chunk)
            owner.append(i)
    t = time.perf_counter()
    vectors = model.encode(texts, batch_size=64, normalize_embeddings=True)
    took = time.perf_counter() - t
    owner_a = np.array(owner)

    def scores(vec) -> np.ndarray:
        out = np.full(len(notes), -2.0)
        np.maximum.at(out, owner_a, vectors @ vec)
        return out

    probe = scores(model.encode([notesvc.PROBE], normalize_embeddings=True)[0])
    middle = float(np.median(probe))
    mad = 1.4826 * float(np.median(np.abs(probe - middle)))
    prior, n = 1 / math.sqrt(vectors.shape[1]), len(probe)
    spread = math.sqrt(
        (n * mad * mad + notesvc.FLOOR_PRIOR * prior * prior) / (n + notesvc.FLOOR_PRIOR)
    )
    floor = middle + notesvc.FLOOR_Z * spread
    print(
        f"# {label}: {len(texts)} chunks embedded in {took:.0f} s; floor {floor:.4f} (the probe's "
        f"median {middle:.4f}, spread {spread:.4f})"
    )
    if args.personal:
        for q in (
            "spare keys",
            "quantum physics lecture",
            "chess opening theory",
            "jazz saxophone",
        ):
            s = scores(model.encode([q], normalize_embeddings=True)[0])
            print(f"{q!r}: best note {s.max():.4f}, notes over the floor {int((s >= floor).sum())}")
        return
    import bench_semantic

    queries = [bench_semantic.sanitize(note["query"]) for note in notes]
    qv = model.encode(queries, batch_size=64, normalize_embeddings=True)
    rr, rr_floor, under, empty = [], [], 0, 0
    for i, vec in enumerate(qv):
        s = scores(vec)
        top = list(np.argsort(-s)[:10])
        kept = [o for o in top if s[o] >= floor]
        rr.append(1 / (top.index(i) + 1) if i in top else 0.0)
        rr_floor.append(1 / (kept.index(i) + 1) if i in kept else 0.0)
        under += bool(s[i] < floor)
        empty += not kept
    print(
        f"semantic MRR@10 without the floor {np.mean(rr):.3f}, with it {np.mean(rr_floor):.3f}; "
        f"relevant notes under the floor {under} of {len(qv)}; queries left with nothing by "
        f"meaning {empty}"
    )


if __name__ == "__main__":
    main()
