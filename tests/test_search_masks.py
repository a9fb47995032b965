"""Reach masks: a search within a reach scores as if its notes were all there are
(src/notesvc/search/masks.py, SearchIndex.search's `reach`)."""

from __future__ import annotations

import random

import pytest

from conftest import notesvc
from search_reference import (
    REF_WORDS,
    ReferenceBM25,
    make_ref_notes,
    ref_queries,
    remove_notes,
    write_notes,
)

REACH = ("notes/work", "notes/home")  # not notes/ itself: its own notes stay outside


def reached(notes: dict, reach: tuple = REACH) -> dict:
    return {p: t for p, t in notes.items() if p.startswith(tuple(f + "/" for f in reach))}


def assert_reach_answers_like(index, notes: dict, q: str, reach=REACH, folder=()) -> None:
    """The index's answer within `reach` (narrowed to `folder`) is a brute-force BM25's over
    the reached notes alone: the same total, paths, order and scores."""
    ref = ReferenceBM25(reached(notes, reach))
    total, results = index.search(notesvc.Query(q), folder or reach, 10, 0, reach=reach)
    want_total, want = ref.search(q, folder[0] if folder else "")
    assert total == want_total, (q, folder)
    assert len(results) == min(10, want_total), q
    for i, (path, _, score, _) in enumerate(results):
        best = want[i][0]
        assert abs(score - best) <= max(1e-4 * best, 6e-5), (q, i, path, score, want[i])
        if path != want[i][1]:  # only equal scores may come in another order
            tied = {p for s, p in want if abs(s - best) <= 1e-9 * max(best, 1.0)}
            assert path in tied, (q, i, path, want[:10])


def rewrite(rnd: random.Random, index, notes: dict, root, count: int) -> None:
    for path in rnd.sample(sorted(notes), count):
        text = " ".join(rnd.choice(REF_WORDS) for _ in range(rnd.randint(1, 60)))
        notes[path] = text
        (root / path).write_text(text, encoding="utf-8")
        st = (root / path).stat()
        index.add(path, text, st.st_size, st.st_mtime_ns)


class TestReachScoring:
    @pytest.mark.slow
    def test_a_reach_is_scored_as_if_its_notes_were_all_there_are(self, disk_index, tmp_path):
        """At every stage of the segments (one bulk file, changes in memory, flushed files
        with deletions, a merge) the masks follow, and every query kind within a reach
        answers like brute-force BM25 over the reached notes alone."""
        rnd = random.Random(3)
        notes = make_ref_notes(rnd, 300)
        write_notes(tmp_path, notes)
        index = disk_index
        queries = ref_queries(random.Random(3), notes)

        def check() -> None:
            for q in queries:
                assert_reach_answers_like(index, notes, q)
            for q in ("the", "apple OR zebra", "gard*", "the -apple", '"the apple"'):
                assert_reach_answers_like(index, notes, q, folder=("notes/work/deep",))
                assert_reach_answers_like(index, notes, q, reach=("notes/home",))

        index.sync()
        check()
        rewrite(rnd, index, notes, tmp_path, 40)
        remove_notes(rnd, index, notes, tmp_path, 25)
        check()
        assert index.flush()
        rewrite(rnd, index, notes, tmp_path, 30)
        assert index.flush()
        remove_notes(rnd, index, notes, tmp_path, 10)
        check()
        files = [s for s in index._segs if isinstance(s, notesvc.DiskSegment)]
        assert index.merge(files)
        check()

    def test_notes_outside_the_reach_move_no_score(self, disk_index, tmp_path):
        """Hundreds of notes outside the reach holding the word change nothing of the
        answer within it, not even the scores (their counts would show in an IDF)."""
        inside = {
            "notes/home/a.md": "# Quokka\n\nquokka island",
            "notes/home/b.md": "island ferry timetable",
        }
        write_notes(tmp_path, inside)
        disk_index.sync()
        before = [
            disk_index.search(notesvc.Query(q), REACH, 10, 0, reach=REACH)
            for q in (
                "quokka",
                "island",
                "isl*",
                "quokka OR ferry",
                '"quokka island"',
            )
        ]
        outside = {f"notes/x{i}.md": f"quokka island quokka {i}" for i in range(300)}
        write_notes(tmp_path, outside)
        disk_index.sync()
        after = [
            disk_index.search(notesvc.Query(q), REACH, 10, 0, reach=REACH)
            for q in (
                "quokka",
                "island",
                "isl*",
                "quokka OR ferry",
                '"quokka island"',
            )
        ]
        assert after == before
        total, _ = disk_index.search(notesvc.Query("quokka"), "", 10, 0)
        assert total == 301  # the owner's search sees them all

    def test_masks_are_kept_per_reach_and_dropped_least_recently_used(
        self, disk_index, tmp_path, monkeypatch
    ):
        write_notes(tmp_path, {f"notes/f{i}/n.md": "heron" for i in range(6)})
        disk_index.sync()
        monkeypatch.setattr(notesvc.MaskCache, "LIMITS", (3, 1 << 20))
        for i in range(6):
            reach = (f"notes/f{i}",)
            total, hits = disk_index.search(notesvc.Query("heron"), reach, 10, 0, reach=reach)
            assert (total, [h[0] for h in hits]) == (1, [f"notes/f{i}/n.md"])
        assert disk_index._masks.reaches() == [("notes/f3/",), ("notes/f4/",), ("notes/f5/",)]
        monkeypatch.setattr(notesvc.MaskCache, "LIMITS", (64, 1))  # bytes: only the last kept
        for i in (0, 1):
            reach = (f"notes/f{i}",)
            disk_index.search(notesvc.Query("heron"), reach, 10, 0, reach=reach)
        assert disk_index._masks.reaches() == [("notes/f1/",)]
