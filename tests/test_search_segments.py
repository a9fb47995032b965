"""Index segments and phrase pairs, on disk and in memory (src/notesvc/search/segments.py)."""

from __future__ import annotations

import array
import collections
import contextlib
import errno
import itertools
import json
import os
import random
import re
import shutil
import stat
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest

from conftest import (
    API,
    Server,
    note_url,
    notesvc,
    patch_global,
    put_note,
    running,
    search,
    wait_for,
    with_key,
)
from search_reference import (
    REF_WORDS,
    ReferenceBM25,
    assert_answers_like,
    make_ref_notes,
    ref_queries,
    remove_notes,
    write_notes,
)


def index_files(root: Path) -> list:
    return sorted(p.name for p in (root / ".notesvc" / "index").iterdir())


def damage_index(root: Path, damage: str) -> None:
    state = root / ".notesvc"
    segment = next(p for p in sorted((state / "index").iterdir()) if p.suffix == ".seg")
    raw = segment.read_bytes()
    commit = state / "index.cache"
    if damage == "commit truncated":
        commit.write_bytes(commit.read_bytes()[:-7])
    elif damage == "commit random bytes":
        commit.write_bytes(os.urandom(commit.stat().st_size))
    elif damage == "commit flipped byte":
        data = bytearray(commit.read_bytes())
        data[len(data) // 3] ^= 0x55
        commit.write_bytes(bytes(data))
    elif damage == "segment truncated":
        segment.write_bytes(raw[: len(raw) // 2])
    elif damage == "segment random bytes":
        segment.write_bytes(os.urandom(len(raw)))
    elif damage == "segment flipped bytes":  # the frame is intact: only the checksum tells
        data = bytearray(raw)
        for at in range(64, len(data) // 2, 97):
            data[at] ^= 0xFF
        segment.write_bytes(bytes(data))
    elif damage == "segment empty":
        segment.write_bytes(b"")
    elif damage == "segment missing":
        segment.unlink()
    elif damage == "segment of another index":
        vocab = notesvc.Vocab()
        seg = notesvc.MemorySegment(vocab)
        seg.add(vocab.analyse("notes/zz.md", "unrelated words only", 20, 1), (3.0, 1.0))
        with open(segment, "wb") as f:
            notesvc.write_segment(f, [seg], [set()], [({}, {})])


PAIR_VOCAB = [f"w{i}x" for i in range(700)]  # words that are their own stems


def pair_notes(rnd: random.Random, n: int) -> dict:
    """Notes over 700 words with Zipf-like frequencies: a merge numbers them commonest
    first, so phrases fall on every side of PAIR_COMMON and PAIR_TERMS."""
    weights = [1 / (i + 1) for i in range(len(PAIR_VOCAB))]
    notes = {}
    for i in range(n):
        words = rnd.choices(PAIR_VOCAB, weights, k=rnd.randint(2, 120))
        title = " ".join(rnd.choices(PAIR_VOCAB, weights, k=rnd.randint(1, 4)))
        notes[f"notes/p{i:04d}.md"] = f"# {title}\n\n{' '.join(words)}\n"
    return notes


def phrase_queries(rnd: random.Random, notes: dict, seg) -> dict:
    """Return {phrase query: kind}: phrases found in the notes' bodies and titles and
    made-up ones, of 2 and 3 words, whose pairs have a list (kind "pairs") or not."""
    texts = sorted(notes.values())
    out = {}
    while len(out) < 160:
        words = re.findall(r"w\d+x", rnd.choice(texts))
        size = rnd.choice((2, 2, 3))
        if len(words) < size:
            continue
        if rnd.random() < 0.7:
            j = rnd.randrange(len(words) - size + 1)
            words = words[j : j + size]
        else:
            words = rnd.sample(PAIR_VOCAB[:600], size)
        keys = seg.keys(words)
        listed = None not in keys and seg.pair_ids(keys, 0) is not None
        out[f'"{" ".join(words)}"'] = "pairs" if listed else "search"
    return out


def read_footer(path: Path) -> dict:
    raw = path.read_bytes()
    size = notesvc._TRAILER.unpack(raw[-notesvc._TRAILER.size :])[0]
    return json.loads(raw[-notesvc._TRAILER.size - size : -notesvc._TRAILER.size])


def rewrite_footer(path: Path, footer: dict) -> None:
    """Write a segment file's footer again at its length (padded with spaces), so the
    commit file still names the file: what another version could have written."""
    raw = path.read_bytes()
    size, _, magic = notesvc._TRAILER.unpack(raw[-notesvc._TRAILER.size :])
    text = json.dumps(footer, separators=(",", ":")).encode()
    assert len(text) <= size
    text = text.ljust(size)
    body = raw[: -notesvc._TRAILER.size - size]
    path.write_bytes(body + text + notesvc._TRAILER.pack(size, zlib.crc32(text), magic))


def bounds_of(path: Path, section: str) -> list:
    """Return [start, length] of a section of a segment file, from its footer."""
    return read_footer(path)["sections"][section]


class TestPhrasePairs:
    """A segment file lists the notes of each pair of its commoner terms; phrases answered
    from those lists are the brute-force BM25's, and a file without them still answers."""

    def build(self, disk_index, tmp_path, n: int = 400) -> tuple:
        notes = pair_notes(random.Random(11), n)
        write_notes(tmp_path, notes)
        assert disk_index.sync()["read"] == n
        (bulk,) = disk_index._segs[:1]
        assert bulk._pairs is None  # a first build's file: none (merged soon)
        notes["notes/extra.md"] = "w0x w1x w2x"  # in a second file, to merge
        write_notes(tmp_path, {"notes/extra.md": notes["notes/extra.md"]})
        st = (tmp_path / "notes/extra.md").stat()
        disk_index.add("notes/extra.md", notes["notes/extra.md"], st.st_size, st.st_mtime_ns)
        assert disk_index.flush()
        files = [s for s in disk_index._segs if isinstance(s, notesvc.DiskSegment)]
        assert disk_index.merge(files)  # one file, its terms numbered commonest first
        seg = disk_index._segs[0]
        assert isinstance(seg, notesvc.DiskSegment)
        return notes, seg

    @pytest.mark.parametrize("spill", [None, 37])
    @pytest.mark.slow
    def test_phrases_from_pair_lists_answer_like_brute_force(
        self, disk_index, tmp_path, monkeypatch, spill
    ):
        if spill:  # the merge writes its pair lists in runs of 37 ids to a file, then merges
            monkeypatch.setattr(notesvc._PairPostings, "SPILL_IDS", spill)
        notes, seg = self.build(disk_index, tmp_path)
        assert seg.nt > notesvc.PAIR_TERMS  # terms past the lists' range too
        queries = phrase_queries(random.Random(4), notes, seg)
        kinds = collections.Counter(queries.values())
        assert kinds["pairs"] >= 40, kinds
        assert kinds["search"] >= 20, kinds
        ref = ReferenceBM25(notes)
        for q in queries:
            assert_answers_like(disk_index, ref, q)
        rnd = random.Random(5)
        remove_notes(rnd, disk_index, notes, tmp_path, 60)  # deleted in the file
        ref = ReferenceBM25(notes)
        for q in queries:
            assert_answers_like(disk_index, ref, q)

    @pytest.mark.parametrize("spill", [None, 37])
    @pytest.mark.slow
    def test_a_pair_list_is_exactly_the_notes_holding_the_pair(
        self, disk_index, tmp_path, monkeypatch, spill
    ):
        if spill:
            monkeypatch.setattr(notesvc._PairPostings, "SPILL_IDS", spill)
        notes, seg = self.build(disk_index, tmp_path)
        terms = {w: k for w, k in zip(PAIR_VOCAB, seg.keys(PAIR_VOCAB)) if k is not None}
        paths = [seg.path(d) for d in range(seg.n)]
        common = [w for w in PAIR_VOCAB if terms.get(w, 10**9) < notesvc.PAIR_COMMON][:6]
        middle = [
            w for w in PAIR_VOCAB if notesvc.PAIR_COMMON <= terms.get(w, -1) < notesvc.PAIR_TERMS
        ][:6]
        assert len(common) == 6
        assert len(middle) == 6
        fields = {  # each note's body and title as notesvc reads them
            p: (notesvc.tokenize(t), notesvc.tokenize(notesvc.note_title(t, p)))
            for p, t in notes.items()
        }
        for a, b in [*itertools.product(common, common + middle), *zip(middle, common)]:
            for f in (0, 1):
                want = {p for p, toks in fields.items() if (a, b) in zip(toks[f], toks[f][1:])}
                (ids,) = seg.pair_ids([terms[a], terms[b]], f)
                assert {paths[d] for d in ids} == want, (a, b, f)
        for a, b in itertools.product(middle, middle):  # neither among the commonest
            assert seg.pair_ids([terms[a], terms[b]], 0) is None

    @pytest.mark.slow
    def test_a_file_without_pair_lists_still_answers_phrases(self, disk_index, tmp_path):
        notes, seg = self.build(disk_index, tmp_path)
        queries = phrase_queries(random.Random(6), notes, seg)
        before = {q: disk_index.search(notesvc.Query(q), "", 10, 0) for q in queries}
        path = seg.file
        disk_index.close()
        footer = read_footer(path)  # now as 0.3 wrote it: no pair lists
        del footer["pair_terms"]
        for name in ("pair_keys", "pair_off", "pair_ids"):
            del footer["sections"][name]
        rewrite_footer(path, footer)
        index = notesvc.SearchIndex.open(tmp_path / ".notesvc", disk_index.notes)
        try:
            (old,) = [s for s in index._segs if isinstance(s, notesvc.DiskSegment)]
            assert old._pairs is None
            assert old.pair_ids([0, 1], 0) is None
            for q, want in before.items():
                assert index.search(notesvc.Query(q), "", 10, 0) == want, q
            assert index.sync()["read"] == 0  # kept, not read again
        finally:
            index.close()

    @pytest.mark.slow
    def test_a_big_file_without_pair_lists_is_written_again_once(
        self, disk_index, tmp_path, monkeypatch
    ):
        notes = pair_notes(random.Random(12), 300)
        write_notes(tmp_path, notes)
        assert disk_index.sync()["read"] == 300
        (bulk,) = disk_index._segs[:1]
        assert bulk._pairs is None
        assert disk_index._pick_merge() == []  # under PAIR_REWRITE_NOTES: left as it is
        monkeypatch.setattr(notesvc.SearchIndex, "PAIR_REWRITE_NOTES", 250)
        assert disk_index._pick_merge() == [bulk]
        assert disk_index.merge([bulk])
        (seg,) = [s for s in disk_index._segs if isinstance(s, notesvc.DiskSegment)]
        assert seg is not bulk
        assert seg._pairs is not None
        assert disk_index._pick_merge() == []  # once
        ref = ReferenceBM25(notes)
        for q in list(phrase_queries(random.Random(8), notes, seg))[:40]:
            assert_answers_like(disk_index, ref, q)

    def test_a_phrase_after_another_clause_keeps_to_that_clause_on_every_path(
        self, disk_index, tmp_path
    ):
        notes = {
            "notes/n1.md": "a b",  # the phrase, without c
            **{f"notes/t{i}/a x b.md": "zzz" for i in range(3)},  # a and b in titles only
            **{f"notes/c{i}.md": "c c" for i in range(2)},
            **{f"notes/f{i}.md": "filler" for i in range(60)},
        }
        write_notes(tmp_path, notes)
        ref = ReferenceBM25(notes)
        queries = ['c "a b"', '"a b" c', 'c "a b" -zzz', 'filler OR c "a b"']
        memory = notesvc.SearchIndex()
        for path, text in notes.items():
            memory.add(path, text, len(text), 1)
        assert disk_index.sync()["read"] == len(notes)
        (bulk,) = [s for s in disk_index._segs if isinstance(s, notesvc.DiskSegment)]
        assert bulk._pairs is None  # the substring search
        for q in queries:
            assert_answers_like(memory, ref, q)
            assert_answers_like(disk_index, ref, q)
        assert disk_index.merge([bulk])
        assert disk_index._segs[0]._pairs is not None  # the pair lists
        for q in queries:
            assert_answers_like(disk_index, ref, q)

    def test_a_rare_word_in_a_longer_phrase_still_narrows_the_search(
        self, disk_index, tmp_path, monkeypatch
    ):
        words = PAIR_VOCAB[:601]
        notes = {f"notes/n{i}.md": f"out of the blue {words[i]} {words[i + 1]}" for i in range(600)}
        notes["notes/rare.md"] = "out of the zebra"
        write_notes(tmp_path, notes)
        assert disk_index.sync()["read"] == len(notes)
        disk_index.add("notes/extra.md", "out of the blue", 15, 1)  # a second file...
        assert disk_index.flush()
        files = [s for s in disk_index._segs if isinstance(s, notesvc.DiskSegment)]
        assert disk_index.merge(files)  # ...so that the merge numbers terms commonest first
        seg = disk_index._segs[0]
        keys = seg.keys(["of", "the", "zebra"])
        assert keys[2] >= notesvc.PAIR_TERMS  # numbered after 600 commoner words
        assert len(seg.pair_ids(keys, 0)) == 1  # "of the" has a list; "the zebra" none
        checked = []
        phrase = notesvc.DiskSegment.phrase

        def counted(self, cands, chars, f):  # the search itself, its candidates counted
            cands = list(cands)
            checked.append(len(cands))
            return phrase(self, cands, chars, f)

        monkeypatch.setattr(notesvc.DiskSegment, "phrase", counted)
        total, hits = disk_index.search(notesvc.Query('"of the zebra"'), "", 10, 0)
        assert (total, [h[0] for h in hits]) == (1, ["notes/rare.md"])
        assert max(checked) == 1  # from zebra's one note, not the 601 holding "of the"

    @pytest.mark.slow
    def test_a_failed_rewrite_waits_and_other_settings_files_are_left_to_merges(
        self, disk_index, tmp_path, monkeypatch
    ):
        notes = pair_notes(random.Random(13), 300)
        write_notes(tmp_path, notes)
        assert disk_index.sync()["read"] == 300
        monkeypatch.setattr(notesvc.SearchIndex, "PAIR_REWRITE_NOTES", 250)
        calls = []

        def full(*args, **kwargs):  # a full disk, as the writer meets it
            calls.append(1)
            raise OSError(errno.ENOSPC, "No space left on device")

        patch_global(monkeypatch, "write_segment", full)
        for _ in range(5):
            disk_index.maintain(force=True)
        assert len(calls) == 1  # tried once: not again within PAIR_REWRITE_RETRY
        monkeypatch.setattr(notesvc.SearchIndex, "PAIR_REWRITE_RETRY", 0.0)
        disk_index.maintain(force=True)
        assert len(calls) == 2
        monkeypatch.undo()
        (bulk,) = [s for s in disk_index._segs if isinstance(s, notesvc.DiskSegment)]
        assert disk_index.merge([bulk])  # the disk has room again
        path = disk_index._segs[0].file
        disk_index.close()
        footer = read_footer(path)
        footer["pair_terms"] = [64, 256]  # written by another version's settings
        rewrite_footer(path, footer)
        index = notesvc.SearchIndex.open(tmp_path / ".notesvc", disk_index.notes)
        try:
            monkeypatch.setattr(notesvc.SearchIndex, "PAIR_REWRITE_NOTES", 250)
            (seg,) = [s for s in index._segs if isinstance(s, notesvc.DiskSegment)]
            assert seg._pairs is None
            assert index._pick_merge() == []  # no rewrite (a rewrite could loop on it)
            ref = ReferenceBM25(notes)
            for q in list(phrase_queries(random.Random(9), notes, seg))[:30]:
                assert_answers_like(index, ref, q)
        finally:
            index.close()

    @pytest.mark.slow
    def test_a_list_naming_a_note_past_the_file_is_not_trusted(self, disk_index, tmp_path):
        notes, seg = self.build(disk_index, tmp_path)
        words = ["w0x", "w1x"]
        keys = seg.keys(words)
        (ids,) = seg.pair_ids(keys, 0)
        assert len(ids) > 1
        listed, off, _ = seg._pairs
        i = listed.tolist().index(notesvc._pair_key(*keys, 0))
        at = int(bounds_of(seg.file, "pair_ids")[0]) + 4 * (off[i + 1] - 1)
        path = seg.file
        disk_index.close()
        raw = bytearray(path.read_bytes())
        raw[at : at + 4] = (seg.n + 5).to_bytes(4, sys.byteorder)  # past the last note
        path.write_bytes(bytes(raw))
        index = notesvc.SearchIndex.open(tmp_path / ".notesvc", disk_index.notes)
        try:
            (damaged,) = [s for s in index._segs if isinstance(s, notesvc.DiskSegment)]
            assert damaged.pair_ids(keys, 0) is None  # the substring search instead
            ref = ReferenceBM25(notes)
            for offset in (0, len(ids) - 2):
                total, _ = index.search(notesvc.Query('"w0x w1x"'), "", 10, offset)
                assert total == ref.search('"w0x w1x"', "")[0]
            assert_answers_like(index, ref, '"w0x w1x"')
        finally:
            index.close()

    @pytest.mark.parametrize("damage", ["bounds", "offsets", "torn"])
    @pytest.mark.slow
    def test_damaged_pair_lists_drop_the_file_and_its_notes_are_read_again(
        self, disk_index, tmp_path, damage
    ):
        notes, seg = self.build(disk_index, tmp_path)
        path = seg.file
        disk_index.close()
        footer = read_footer(path)
        start, length = footer["sections"]["pair_off"]
        if damage == "bounds":
            footer["sections"]["pair_ids"][0] = 8
        elif damage == "offsets":
            footer["sections"]["pair_off"] = [start, length - 4]
        else:
            footer["sections"]["pair_keys"][1] -= 2
        rewrite_footer(path, footer)
        with pytest.raises(notesvc.IndexFileError):
            notesvc.DiskSegment(path)
        index = notesvc.SearchIndex.open(tmp_path / ".notesvc", disk_index.notes)
        try:
            assert index.sync()["read"] == len(notes)
            ref = ReferenceBM25(notes)
            for q in list(phrase_queries(random.Random(7), notes, index._segs[0]))[:30]:
                assert_answers_like(index, ref, q)
        finally:
            index.close()


class TestSearchSegments:
    """Segment files, the commit file, merges, damage and a full disk (in process)."""

    @pytest.mark.slow
    def test_changes_while_merging_are_kept(self, make_app, root):
        rnd = random.Random(9)
        notes = make_ref_notes(rnd, 1200)
        write_notes(root, notes)
        app = with_key(make_app())
        index = app.app.service.index
        overlapped: list = []
        kinds = itertools.cycle(("create", "update", "move", "delete"))

        # Rounds until each kind of change has overlapped a merge (a merge of small files
        # can take a few milliseconds: the kinds take turns, so a round's first change
        # goes on where the last round's stopped).
        for round_ in range(40):
            if round_ >= 3 and {"create", "update", "move", "delete"} <= set(overlapped):
                break
            for path in rnd.sample(sorted(notes), 150):  # make a few segment files
                text = " ".join(rnd.choice(REF_WORDS) for _ in range(rnd.randint(5, 40)))
                notes[path] = text
                app.put_json(note_url(path), {"content": text})
            assert index.flush()
            files = [s for s in index._segs if isinstance(s, notesvc.DiskSegment)]
            assert len(files) >= 2
            merging = threading.Event()

            def merge(files=files, merging=merging):
                merging.set()
                index.merge(files)
                merging.clear()

            merger = threading.Thread(target=merge)
            merger.start()
            merging.wait(5)
            while merger.is_alive():  # create, update, move and delete while it runs
                kind, began = next(kinds), merging.is_set()
                path = rnd.choice(sorted(notes))
                text = " ".join(rnd.choice(REF_WORDS) for _ in range(rnd.randint(5, 40)))
                if kind == "create":
                    path = f"notes/new/r{round_}-{rnd.randrange(10**9)}.md"
                    notes[path] = text
                    put_note(app, path, text)
                elif kind == "update":
                    notes[path] = text
                    app.put_json(note_url(path), {"content": text})
                elif kind == "move":
                    new = f"notes/moved/{rnd.randrange(10**9)}.md"
                    notes[new] = notes.pop(path)
                    app.patch_json(note_url(path) + "/move", {"path": new})
                else:
                    del notes[path]
                    app.delete(note_url(path))
                if began or merging.is_set():
                    overlapped.append(kind)
            merger.join()
        assert {"create", "update", "move", "delete"} <= set(overlapped)
        ref = ReferenceBM25(notes)
        for q in ref_queries(random.Random(3), notes):
            assert_answers_like(index, ref, q)
        assert set(index.paths()) == set(notes)
        assert app.app.service.sync_index()["read"] == 0

    @pytest.mark.parametrize(
        "damage",
        [
            "commit truncated",
            "commit random bytes",
            "commit flipped byte",
            "segment truncated",
            "segment random bytes",
            "segment flipped bytes",
            "segment empty",
            "segment missing",
            "segment of another index",
        ],
    )
    @pytest.mark.slow
    def test_damaged_index_is_discarded_and_rebuilt(self, make_app, root, damage, caplog):
        rnd = random.Random(4)
        notes = make_ref_notes(rnd, 200)
        write_notes(root, notes)
        app = make_app()
        assert app.app.service.last_sync["read"] == 200
        app.app.service.close()
        damage_index(root, damage)
        caplog.clear()
        again = make_app()
        assert again.app.service.last_sync["read"] == 200  # every note read again
        ref = ReferenceBM25(notes)
        for q in ("apple", "the keys", '"spare blue"', "gard*", "zebra -apple"):
            assert_answers_like(again.app.service.index, ref, q)
        said = " ".join(r.getMessage() for r in caplog.records)
        assert "discarded, rebuilding" in said or "dropped" in said
        assert "Traceback" not in said
        again.app.service.close()
        third = make_app()  # the rebuilt index is whole again: nothing to read
        assert third.app.service.last_sync["read"] == 0

    def test_an_index_of_another_stemmer_is_rebuilt(self, make_app, root, caplog, monkeypatch):
        notes = {
            f"notes/n{i}.md": f"# Note {i}\n\nShared generously, item {i}.\n" for i in range(30)
        }
        write_notes(root, notes)
        with monkeypatch.context() as m:  # an index written by an older stemmer (here: none)
            patch_global(m, "INDEX_FORMAT", (*notesvc.INDEX_FORMAT[:-1], "stem-1"))
            patch_global(m, "stem", lambda word: word)
            app = make_app()
            assert app.app.service.index.search(notesvc.Query("generous"))[0] == 0
            app.app.service.close()
        caplog.clear()
        again = make_app()
        assert again.app.service.last_sync["read"] == 30  # every note read again
        assert again.app.service.index.search(notesvc.Query("generous"))[0] == 30
        said = " ".join(r.getMessage() for r in caplog.records)
        assert "an index of another format" in said
        assert "discarded, rebuilding" in said
        again.app.service.close()

    @pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
    @pytest.mark.parametrize("count", [1, 60])  # one by one, and the bulk path
    def test_a_named_pipe_called_like_a_note_is_skipped_not_waited_on(self, make_app, root, count):
        notes = {f"notes/n{i}.md": f"alpha note {i}" for i in range(count)}
        write_notes(root, notes)
        os.mkfifo(root / "notes" / "pipe.md")
        made: dict = {}
        starter = threading.Thread(target=lambda: made.update(app=make_app()), daemon=True)
        starter.start()
        starter.join(30)
        assert "app" in made  # the start-up check did not hang on the pipe
        app = with_key(made["app"])
        assert search(app, "alpha")["total"] == count
        assert app.app.service.index.title_of("notes/pipe.md") is None
        (root / "attachments").mkdir(exist_ok=True)
        os.mkfifo(root / "attachments" / "pipe.jpg")
        answers: list = []

        def read_both():  # asked for by name, each answers 404 at once
            answers.append(app.get(note_url("notes/pipe.md"), status="*").status_int)
            answers.append(
                app.get(f"{API}/attachments/attachments/pipe.jpg", status="*").status_int
            )

        reader = threading.Thread(target=read_both, daemon=True)
        reader.start()
        reader.join(30)
        assert answers == [404, 404]
        app.app.service.close()

    def test_files_are_private_and_leftovers_are_swept(self, make_app, root):
        write_notes(root, make_ref_notes(random.Random(1), 100))
        app = make_app()
        app.app.service.close()
        index_dir = root / ".notesvc" / "index"
        (index_dir / "99999999.seg").write_bytes(b"a segment no commit names")
        (index_dir / ".tmp-abc.part").write_bytes(b"a write a crash cut short")
        make_app().app.service.close()
        assert stat.S_IMODE(index_dir.stat().st_mode) == 0o700
        names = index_files(root)
        assert names
        assert all(n.endswith(".seg") for n in names)
        assert "99999999.seg" not in names
        for path in [*index_dir.iterdir(), root / ".notesvc" / "index.cache"]:
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path

    @pytest.mark.slow
    @pytest.mark.forms  # the helper process starts by path from notesvc.py, by name from src/
    def test_cold_start_bulk_path_indexes_thousands_of_notes(self, make_app, root, caplog):
        rnd = random.Random(8)
        notes = make_ref_notes(rnd, 4500)
        write_notes(root, notes)
        caplog.set_level("INFO", logger="notesvc")
        app = make_app()
        svc = app.app.service
        assert svc.last_sync["read"] == 4500
        if (os.cpu_count() or 1) > 1:  # a helper process did every other batch, unharmed
            assert "a helper process" in caplog.text
            assert "one core" not in caplog.text
        files = [s for s in svc.index._segs if isinstance(s, notesvc.DiskSegment)]
        # one per BULK_CHUNK_NOTES, or already merged into a fourth by the background
        # thread (the bulk's helper process goes on to write the merge at once)
        assert len(files) in (3, 1)
        ref = ReferenceBM25(notes)
        for q in ("apple", "the keys", '"spare blue"', "gard*", "zebra -apple", "yak OR heron"):
            assert_answers_like(svc.index, ref, q)
        svc.index.maintain(force=True)  # the background thread's merge, now
        assert len(svc.index._segs) == 1
        for q in ("apple", '"spare blue"', "gard*"):
            assert_answers_like(svc.index, ref, q)
        # The merge was written off the server's GIL by the bulk's own helper process,
        # kept for it (no second process started), and stopped after.
        if (os.cpu_count() or 1) > 1:
            assert caplog.text.count("a helper process (pid") == 1
        assert "merging in this process" not in caplog.text
        assert svc.index._merger is None
        assert not list((svc.config.state_dir / "index").glob(notesvc.TEMP_PREFIX + "*"))
        # A restart that finds every note changed (a `touch` of everything): the helper
        # analyses every batch, and this process only installs its files.
        svc.close()
        later = time.time_ns() + 10**9
        for path in root.joinpath("notes").rglob("*.md"):
            os.utime(path, ns=(later, later))
        caplog.clear()
        again = make_app().app.service
        assert again.last_sync["read"] == 4500
        if (os.cpu_count() or 1) > 1:
            assert "4500 notes in" in caplog.text
            assert "(3 batches by the helper process)" in caplog.text
        for q in ("apple", "the keys", '"spare blue"', "gard*", "zebra -apple"):
            assert_answers_like(again.index, ref, q)
        again.close()

    @pytest.mark.slow
    def test_deleted_counts_are_four_bytes_a_term_and_come_back_after_a_restart(
        self, make_app, root
    ):
        """A segment file's notes replaced by newer ones keep counting out of the document
        frequencies (in an array, 4 bytes a term): the same answers before and after a
        restart, which reads them back from the commit file."""
        rnd = random.Random(12)
        notes = make_ref_notes(rnd, 300)
        write_notes(root, notes)
        svc = make_app().app.service
        svc.index.maintain(force=True)
        (seg,) = [s for s in svc.index._segs if isinstance(s, notesvc.DiskSegment)]
        for path in rnd.sample(sorted(notes), 120):  # replaced: deleted in the segment file
            notes[path] = " ".join(rnd.choice(REF_WORDS) for _ in range(rnd.randint(3, 30)))
            (root / path).write_text(notes[path])
            st = (root / path).stat()
            svc.index.add(path, notes[path], st.st_size, st.st_mtime_ns)
        svc.index.flush()
        counts = seg.del_df[0]
        assert len(seg.deleted) == 120
        assert counts.counts.itemsize == 4
        assert len(counts.counts) == seg.nt
        ref = ReferenceBM25(notes)
        queries = ref_queries(random.Random(5), notes)
        for q in queries:
            assert_answers_like(svc.index, ref, q)
        kept = {f: seg.del_df[f].pairs().tolist() for f in (0, 1)}
        svc.close()
        name = seg.name
        svc = make_app().app.service  # a restart: the counts come from the commit file
        (seg,) = [s for s in svc.index._segs if s.name == name]
        assert {f: seg.del_df[f].pairs().tolist() for f in (0, 1)} == kept
        for q in queries:
            assert_answers_like(svc.index, ref, q)
        # A commit file naming a term past the segment's (only a damaged or forged one):
        # left out, never an array of that size.
        counts = notesvc.DeletedCounts(10)
        counts.load(array.array("I", [3, 2, 4_000_000_000, 7, 9, 1]))
        assert counts.pairs().tolist() == [3, 2, 9, 1]
        counts.add([1, 9, 4_000_000_000])
        assert counts.pairs().tolist() == [1, 1, 3, 2, 9, 2]
        assert counts.get(None) == counts.get(10) == counts.get(-1) == 0
        assert len(counts.counts) == 10

    def test_a_string_table_made_word_by_word_is_the_one_made_from_a_list(self):
        words = sorted(
            {"".join(random.Random(i).choices("abcé🙂z", k=i % 9 + 1)) for i in range(300)}
        )
        table = notesvc._StringTable()
        for w in words:
            table.append(w)
        assert len(table) == len(words)
        made, listed = notesvc._text_table(table), notesvc._text_table(words)
        assert (bytes(made[0]), made[1], bytes(made[2])) == listed
        assert notesvc._text_table(notesvc._StringTable())[1].tolist() == [0]

    @pytest.mark.slow
    def test_a_first_build_starts_its_helper_during_the_scan_and_a_small_one_none(
        self, root, tmp_path, caplog
    ):
        """A first build of more than a batch of notes starts its helper process once the
        scan has found that many (one process for the bulk, kept for its merges); a
        folder of one batch starts none."""
        caplog.set_level("INFO", logger="notesvc")
        store = notesvc.NoteStore(root / "notes", tmp_path / "trash")
        write_notes(root, make_ref_notes(random.Random(3), 300))
        (tmp_path / "small").mkdir()
        small = notesvc.SearchIndex(tmp_path / "small", store)
        assert small.sync(store)["read"] == 300
        assert "a helper process" not in caplog.text
        small.close()
        if (os.cpu_count() or 1) < 2:
            return
        write_notes(root, make_ref_notes(random.Random(4), notesvc.BULK_CHUNK_NOTES + 200))
        (tmp_path / "big").mkdir()
        big = notesvc.SearchIndex(tmp_path / "big", store)
        try:
            assert big.sync(store)["read"] > notesvc.BULK_CHUNK_NOTES
            assert caplog.text.count("a helper process (pid") == 1
            assert big._merger is not None  # kept for the merges that follow
        finally:
            big.close()
        assert big._merger is None

    @pytest.mark.slow
    def test_a_merge_the_helper_cannot_write_is_written_by_the_server(self, root, tmp_path, caplog):
        """The helper opens the segment files by name; one gone from the folder (the index
        still has it mapped) makes it fail: the index merges it itself, nothing lost."""
        rnd = random.Random(21)
        notes = make_ref_notes(rnd, 4500)
        write_notes(root, notes)
        caplog.set_level("INFO", logger="notesvc")
        store = notesvc.NoteStore(root / "notes", tmp_path / "trash")
        (tmp_path / "index").mkdir()
        index = notesvc.SearchIndex(tmp_path / "index", store)  # no background thread
        try:
            index.sync(store)
            files = [s for s in index._segs if isinstance(s, notesvc.DiskSegment)]
            assert len(files) == 3
            assert index.merge(files[:2])  # through the bulk's helper, kept for the next merge
            assert "merging in this process" not in caplog.text
            assert index._merger is not None
            files = [s for s in index._segs if isinstance(s, notesvc.DiskSegment)]
            files[0].file.unlink()
            assert index.merge(files)
            assert "merging in this process" in caplog.text
            assert [type(s) for s in index._segs] == [notesvc.DiskSegment]
            ref = ReferenceBM25(notes)
            for q in ("apple", "the keys", '"spare blue"', "gard*", "zebra -apple"):
                assert_answers_like(index, ref, q)
            assert not list((tmp_path / "index").glob(notesvc.TEMP_PREFIX + "*"))
        finally:
            index.close()
        assert index._merger is None

    @pytest.mark.slow
    def test_full_disk_while_writing_a_segment_keeps_serving(self, tmp_path, caplog):
        if os.geteuid() != 0 or not shutil.which("mount"):
            pytest.skip("mounting a small tmpfs needs root")
        disk = tmp_path / "disk"
        disk.mkdir()
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)],
            capture_output=True,
            timeout=10,
        )
        if mounted.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode()[:200]}")
        try:
            state = disk / ".notesvc"
            state.mkdir()
            (disk / "notes").mkdir()
            index = notesvc.SearchIndex.open(state, notesvc.NoteStore(disk / "notes", state))
            index.add("notes/a.md", "# Before\n\nkept in a file", 30, 1)
            assert index.flush()
            for i in range(200):
                index.add(f"notes/m{i}.md", f"in memory only {i} " + "word " * 100, 600, 1)
            filler = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
            try:  # fill the disk to the last block
                with contextlib.suppress(OSError):
                    while True:
                        os.write(filler, b"\0" * 4096)
            finally:
                os.close(filler)
            assert index.flush() is False
            assert "could not write segment" in caplog.text
            assert index.search(notesvc.Query("memory"), "", 5, 0)[0] == 200
            assert index.search(notesvc.Query("kept"), "", 5, 0)[0] == 1
            assert not [p for p in (state / "index").iterdir() if p.name.startswith(".tmp-")]
            os.unlink(disk / "filler")
            assert index.flush()
            index.close()
            again = notesvc.SearchIndex.open(state, notesvc.NoteStore(disk / "notes", state))
            assert again.search(notesvc.Query("memory"), "", 5, 0)[0] == 200
            again.close()
            del index, again  # their segment files are mapped until collected
        finally:
            import gc

            gc.collect()
            subprocess.run(["umount", str(disk)], capture_output=True, timeout=10)
            subprocess.run(["umount", "-l", str(disk)], capture_output=True, timeout=10)


def temp_files(index_dir: Path) -> list:
    with contextlib.suppress(FileNotFoundError):
        return [p for p in index_dir.iterdir() if p.name.startswith(".tmp-")]
    return []


def unique_notes(n: int, start: int = 0) -> dict:
    """Notes that each hold the word "common" and a word of their own (u<number>x)."""
    return {
        f"notes/d{i % 7}/n{i:05d}.md": f"# Note {i}\n\ncommon words u{i}x and then some more "
        f"filler text {i % 13} to make it a note"
        for i in range(start, start + n)
    }


def assert_server_answers(server, notes: dict) -> None:
    status, _, body = server.request("GET", f"{API}/search?q=common&limit=1")
    assert status == 200
    assert body["data"]["total"] == len(notes)
    for path in sorted(notes)[:: max(1, len(notes) // 25)]:
        word = re.search(r"u\d+x", notes[path]).group(0)
        _, _, body = server.request("GET", f"{API}/search?q={word}")
        assert [r["path"] for r in body["data"]["results"]] == [path], word


class TestServerSearchSegments:
    """Real servers: SIGKILL during a segment write and during a merge, then a restart that
    answers exactly what the files say; a restart that answers before its check."""

    pytestmark = [pytest.mark.real_server, pytest.mark.slow]

    def test_sigkill_during_a_segment_write_then_restart(self, tmp_path):
        notes = unique_notes(3000)
        write_notes(tmp_path, notes)
        index_dir = tmp_path / ".notesvc" / "index"
        server = Server(tmp_path, "--auth-mode", "none", env={"SERVICE_RESCAN_SECONDS": "1"})
        try:  # the first check reads every note and writes a segment file in the background
            wait_for(lambda: temp_files(index_dir), timeout=30, step=0.002)
            server.proc.kill()
            server.proc.wait(10)
        finally:
            server.stop()
        assert temp_files(index_dir)  # it died in the middle of the write
        with running(tmp_path, "--auth-mode", "none") as again:
            assert_server_answers(again, notes)
        assert not temp_files(index_dir)

    def test_sigkill_during_a_merge_then_restart(self, tmp_path):
        notes = unique_notes(5000)  # three segment files (BULK_CHUNK_NOTES), then one merge
        write_notes(tmp_path, notes)
        index_dir = tmp_path / ".notesvc" / "index"
        server = Server(tmp_path, "--auth-mode", "none", env={"SERVICE_RESCAN_SECONDS": "3600"})
        try:

            def synced():
                _, _, body = server.request("GET", f"{API}/system/info")
                return body["data"]["index"]["lastSync"]

            wait_for(
                lambda: len([p for p in index_dir.iterdir() if p.suffix == ".seg"]) >= 3, timeout=30
            )
            # Killed while the index writes a file: the merge's, or on a busy machine the last
            # bulk segment's (the merge can finish before a poll sees it): either way the
            # restart must answer exactly what the files say.
            wait_for(lambda: temp_files(index_dir) or synced(), timeout=30, step=0.002)
            server.proc.kill()
            server.proc.wait(10)
        finally:
            server.stop()
        assert len([p for p in index_dir.iterdir() if p.suffix == ".seg"]) >= 1
        moved = sorted(notes)[:5]  # and edits made while it was down
        for path in moved:
            notes[path] = notes[path].replace("common", "uncommon")
            (tmp_path / path).write_text(notes[path])
        with running(tmp_path, "--auth-mode", "none") as again:
            _, _, body = again.request("GET", f"{API}/search?q=common&limit=1")
            assert body["data"]["total"] == len(notes) - len(moved)
            _, _, body = again.request("GET", f"{API}/search?q=uncommon&limit=10")
            assert sorted(r["path"] for r in body["data"]["results"]) == moved
        with running(tmp_path, "--auth-mode", "none") as third:
            for path in moved:
                notes[path] = notes[path].replace("uncommon", "common")
            assert_server_answers(third, {p: t for p, t in notes.items() if p not in moved})

    def test_restart_with_5000_notes_answers_before_its_check_and_finds_external_edits(
        self, tmp_path
    ):
        notes = unique_notes(5000)
        write_notes(tmp_path, notes)
        with running(tmp_path, "--auth-mode", "none") as first:  # builds, then commits at stop
            assert_server_answers(first, notes)
        for i, path in enumerate(sorted(notes)[:1500]):  # edited while the server was down
            notes[path] = notes[path].replace("filler", f"edited{i % 3}")
            (tmp_path / path).write_text(notes[path])
        later = time.time_ns() + 10**9
        for path in notes:  # and every other note touched: the check reads them all again
            os.utime(tmp_path / path, ns=(later, later))
        gone = sorted(notes)[-1]
        (tmp_path / gone).unlink()
        del notes[gone]
        env = {"SERVICE_RESCAN_SECONDS": "600"}
        with running(tmp_path, "--auth-mode", "none", env=env) as again:
            status, _, body = again.request("GET", f"{API}/search?q=common&limit=3")
            _, _, info = again.request("GET", f"{API}/system/info")
            assert status == 200
            assert body["data"]["total"] >= 4999  # answered from the segment files...
            assert info["data"]["index"]["lastSync"] == {}  # ...before the check finished

            def edited():
                _, _, body = again.request("GET", f"{API}/search?q=edited0")
                return body["data"]["total"] == 500

            wait_for(edited, timeout=60, step=0.05)
            assert_server_answers(again, notes)

            def synced():  # the first edits are found while the check reads the rest
                _, _, info = again.request("GET", f"{API}/system/info")
                return info["data"]["index"]["lastSync"]

            assert wait_for(synced, timeout=60, step=0.05) == {
                **synced(),
                "read": 4999,
                "removed": 1,
            }
