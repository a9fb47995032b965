"""Benchmark: the local agent's answer latency (retrieval + passages) on a generated corpus.

    python bench/bench_agent.py --notes 10000

Uses bench_search's corpus. Questions are natural sentences built around corpus words,
plus one note that holds the answer to "where are the spare keys?". The reference in the
same run is a plain search for the same content words (GET /search's work).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import bench_search  # noqa: E402
from _common import print_header, wait_first_check  # noqa: E402

import notesvc  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--notes", type=int, default=10000)
    ap.add_argument("--questions", type=int, default=200)
    args = ap.parse_args()
    print_header()
    rnd = random.Random(5)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        info = bench_search.make_corpus(root, args.notes)
        (root / "notes" / "home").mkdir(exist_ok=True)
        (root / "notes" / "home" / "keys.md").write_text(
            "# Keys\n\nSpare keys are under the blue flowerpot.\n"
        )
        cfg = notesvc.load_config(env={"SERVICE_NOTES_ROOT": tmp})  # the default settings
        svc = notesvc.build_service(cfg).start()
        wait_first_check(svc)
        vocab = info["vocab"]
        questions = [
            f"where did I write about {rnd.choice(vocab[200:5000])} and "
            f"{rnd.choice(vocab[200:5000])}?"
            for _ in range(args.questions)
        ]
        answer = notesvc.ask_agent(svc, "where are the spare keys?")
        assert "blue flowerpot" in answer["reply"], answer

        def timed(fn) -> list:
            for q in questions[:20]:
                fn(q)
            out = []
            for q in questions:
                t = time.perf_counter()
                fn(q)
                out.append((time.perf_counter() - t) * 1000)
            return sorted(out)

        agent = timed(lambda q: notesvc.ask_agent(svc, q))
        plain = timed(
            lambda q: svc.index.search(notesvc.Query(" OR ".join(q.split()[5::2])), "", 10, 0)
        )

        def pct(xs, p):
            return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]

        print(f"{args.notes} notes; {len(questions)} questions; local agent answer latency:")
        print(f"{'':<28} {'p50 ms':>8} {'p95 ms':>8} {'mean ms':>8}")
        for name, xs in (("local agent (ask_agent)", agent), ("reference: OR search", plain)):
            print(f"{name:<28} {pct(xs, 50):>8.2f} {pct(xs, 95):>8.2f} {statistics.mean(xs):>8.2f}")
        print("answer to 'where are the spare keys?':", answer["reply"].replace("\n", " | "))


if __name__ == "__main__":
    main()
