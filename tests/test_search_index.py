"""`SearchIndex` and `GET /search` against a reference BM25 (src/notesvc/search/index.py)."""

from __future__ import annotations

import collections
import heapq
import operator
import os
import random
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from conftest import (
    API,
    assert_error,
    data,
    hits,
    note_url,
    notesvc,
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


class TestSearch:
    @pytest.fixture
    def corpus(self, client):
        notes = {
            "notes/keys.md": "# Household\n\nSpare keys are under the blue flowerpot. "
            "The car key is in the kitchen drawer.",
            "notes/run.md": "# Running log\n\nI went running today. Runs are fun.",
            "notes/pie.md": "# Recipes\n\nApple pies need cinnamon. Crème brûlée too.",
            "notes/pi.md": "# Math\n\nThe number pi is about 3.14159.",
            "notes/work/meeting.md": "# Meeting notes\n\nThe quick brown fox and the e-mail "
            "migration.",
            "notes/work/todo.md": "# Todo\n\nBuy a blue flowerpot. Call the plumber.",
        }
        for path, text in notes.items():
            put_note(client, path, text)
        return client

    def test_response_shape(self, corpus):
        d = search(corpus, "flowerpot", limit=5)
        assert set(d) == {
            *("query", "total", "limit", "offset", "results", "tookMs", "mode", "fallback")
        }
        assert (d["query"], d["total"], d["limit"], d["offset"]) == ("flowerpot", 2, 5, 0)
        assert (d["mode"], d["fallback"]) == ("keyword", False)
        assert set(d["results"][0]) == {"path", "title", "score", "snippet"}
        assert d["results"][0]["score"] >= d["results"][1]["score"] > 0
        assert d["tookMs"] >= 0

    def test_words_must_all_match(self, corpus):
        assert hits(corpus, "blue flowerpot spare") == ["notes/keys.md"]
        assert sorted(hits(corpus, "blue flowerpot")) == ["notes/keys.md", "notes/work/todo.md"]
        assert hits(corpus, "blue unicorn") == []

    def test_phrase(self, corpus):
        assert hits(corpus, '"quick brown"') == ["notes/work/meeting.md"]
        assert hits(corpus, '"brown quick"') == []
        assert hits(corpus, '"blue flowerpot" spare') == ["notes/keys.md"]

    def test_prefix(self, corpus):
        assert hits(corpus, "flowerp*") != []
        assert hits(corpus, "meet*") == ["notes/work/meeting.md"]
        assert hits(corpus, "zzq*") == []

    def test_exclude(self, corpus):
        assert hits(corpus, "flowerpot -spare") == ["notes/work/todo.md"]
        assert hits(corpus, 'flowerpot -"car key"') == ["notes/work/todo.md"]

    def test_or(self, corpus):
        assert sorted(hits(corpus, "pi OR cinnamon")) == ["notes/pi.md", "notes/pie.md"]
        assert hits(corpus, "blue plumber OR spare") != []
        assert sorted(hits(corpus, "flowerpot plumber OR keys")) == [
            "notes/keys.md",
            "notes/work/todo.md",
        ]

    def test_folder_filter(self, corpus):
        assert hits(corpus, "flowerpot", folder="notes/work") == ["notes/work/todo.md"]
        assert sorted(hits(corpus, "the", folder="notes/work")) == [
            "notes/work/meeting.md",
            "notes/work/todo.md",
        ]
        assert_error(search(corpus, "x", 400, folder="../etc"), 400, "VALIDATION_ERROR")

    def test_case_accents_and_plurals_fold(self, corpus):
        assert hits(corpus, "CREME BRULEE") == ["notes/pie.md"]
        assert hits(corpus, "crème") == ["notes/pie.md"]
        assert hits(corpus, "key") == ["notes/keys.md"]
        assert hits(corpus, "run") == ["notes/run.md"]
        assert hits(corpus, "pies") == ["notes/pie.md"]
        assert hits(corpus, "pi") == ["notes/pi.md"]

    def test_words_with_punctuation_are_phrases(self, corpus):
        assert hits(corpus, "e-mail") == ["notes/work/meeting.md"]

    def test_limit_and_offset(self, corpus):
        everything = hits(corpus, "the", limit=100)
        assert len(everything) == 4
        assert hits(corpus, "the", limit=2) == everything[:2]
        assert hits(corpus, "the", limit=2, offset=2) == everything[2:]
        assert search(corpus, "the", limit=1)["total"] == 4

    def test_snippet_is_short_and_around_the_match(self, client):
        words = " ".join(f"filler{i}" for i in range(300))
        put_note(client, "notes/long.md", f"# Long\n\n{words} the needle is here {words}")
        result = search(client, "needle")["results"][0]
        assert "needle" in result["snippet"]
        assert len(result["snippet"]) <= 240
        assert result["snippet"].startswith("…")

    def test_a_snippet_comes_from_the_note_as_it_is_now(self, client):
        """Snippets are cut from texts kept for the version the index holds: a note
        changed through the API or on disk gives its new text at once, even with the same
        size (a kept text of the old version is never given again)."""
        put_note(client, "notes/kept.md", "# Kept\n\nalpha needle gamma")
        assert "gamma" in search(client, "needle")["results"][0]["snippet"]
        assert "gamma" in search(client, "needle")["results"][0]["snippet"]  # from the kept text
        client.put_json(note_url("notes/kept.md"), {"content": "# Kept\n\nalpha needle delta"})
        assert "delta" in search(client, "needle")["results"][0]["snippet"]
        service = client.app.service
        file = service.notes.base / "notes/kept.md"
        st = file.stat()
        file.write_text("# Kept\n\nalpha needle omega")  # the same size, the same mtime
        os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns))
        service.index.add("notes/kept.md", file.read_text(), st.st_size, st.st_mtime_ns)
        assert "omega" in search(client, "needle")["results"][0]["snippet"]

    def test_the_kept_snippet_texts_stay_within_their_bound(self):
        cache = notesvc.TextCache()
        cache.put("a.md", (5, 1), "aaaaa")
        assert cache.get("a.md", (5, 1)) == "aaaaa"
        assert cache.get("a.md", (5, 2)) is None  # another version: read again
        cache.put("huge.md", (1, 1), "x" * (cache.MAX_NOTE_CHARS + 1))
        assert cache.get("huge.md", (1, 1)) is None  # too big to keep
        text = "y" * (cache.MAX_NOTE_CHARS // 2)
        for i in range(2 * cache.MAX_CHARS // len(text)):
            cache.put(f"{i}.md", (1, i), text)
        assert cache._chars <= cache.MAX_CHARS
        assert cache.get("a.md", (5, 1)) is None  # the least recent went first
        assert cache.get(f"{i}.md", (1, i)) == text
        cache.drop(f"{i}.md")
        assert cache.get(f"{i}.md", (1, i)) is None

    def test_a_snippet_shows_the_word_as_typed_else_its_first_form(self, client):
        """A word's snippet is around where it stands as typed (case aside, whole, `_`
        separating), else around the first word of the same stem; a text whose lowercase
        is longer than itself (İ) is counted token by token."""
        far = " ".join(f"filler{i}" for i in range(60))
        text = f"# Legs\n\n{far} they RUN here {far} overrunning my_running {far} end"
        put_note(client, "notes/run.md", text)
        put_note(client, "notes/istanbul.md", f"# İstanbul\n\n{text}")

        def snippet(q: str, path: str = "notes/run.md") -> str:
            found = {r["path"]: r["snippet"] for r in search(client, q)["results"]}
            return found[path]

        assert "my_running" in snippet("running")  # not inside "overrunning"
        assert "my_running" in snippet("RUNNING")
        assert "they RUN here" in snippet("runs")  # not typed anywhere: its first form
        assert "they RUN here" in snippet("run")
        assert "they RUN here" in snippet("running", "notes/istanbul.md")
        assert "my_running" in snippet('"my running"')  # a phrase: its tokens counted

    @pytest.mark.parametrize("size", [0, 5, 16, 511, 512, 513, 2000])
    def test_the_largest_are_heapq_s_whether_sorted_or_heaped(self, size):
        """_largest sorts up to SORT_UP_TO items and uses heapq beyond: the same list either
        way, equal scores (many here) in their original order."""
        rnd = random.Random(size)
        scores = {d: float(rnd.randint(0, 9)) for d in range(size)}
        for n in (1, 15, size + 1):
            want = heapq.nlargest(n, scores.items(), key=operator.itemgetter(1))
            assert notesvc._largest(n, scores.items(), operator.itemgetter(1)) == want
            ids = range(size)
            want = heapq.nlargest(n, ids, key=scores.__getitem__)
            assert notesvc._largest(n, ids, scores.__getitem__) == want

    def test_a_snippet_starts_after_a_space_before_its_match(self):
        """The snippet's start: 60 characters before the match, moved back to just after
        a space, 90 characters before it at most (the start of the note when nearer)."""

        def expected(text: str, at: int) -> int:
            start = max(0, at - 60)
            while start > 0 and not text[start - 1].isspace() and at - start < 90:
                start -= 1
            return start

        rnd = random.Random(5)
        words = ["a", "word", "x" * 40, "y" * 70, "\u00a0", "\u3000", "\n", "—", "é"]
        for _ in range(400):
            text = "".join(rnd.choice(words) + rnd.choice(["", " "]) for _ in range(60))
            text += " needle and the rest"
            at = text.index("needle")
            toks = "".join(chr(0x100 + (w == "needle")) for w in notesvc.WORD_RE.findall(text))
            snippet = notesvc.body_snippet(text, toks, {chr(0x101): ""})  # the tokens counted
            assert notesvc.body_snippet(text, toks, {chr(0x101): "needle"}) == snippet  # as typed
            start, body = expected(text, at), snippet.removeprefix("…").removesuffix("…")
            assert snippet.startswith("…") == (start > 0)
            assert len(body) > 20
            assert " ".join(text[start:].split()).startswith(body), snippet

    def test_a_table_of_symbols_gets_its_snippet_at_once(self):
        """A note of thousands of kinds of separators (a table of symbols) would cost the
        split one pass over the note for each: the regex takes it instead."""
        chars = [chr(c) for c in range(0x2000, 0x2C00) if not chr(c).isalnum()]
        text = "# Symbols\n" + "\n".join(f"U+{ord(c):04X} {c} dagger déjà" for c in chars)
        started = time.thread_time()
        at = notesvc._token_offset(text, 1500)
        took = time.thread_time() - started
        assert at == [m.start() for m in notesvc.WORD_RE.finditer(text)][1500]
        assert took < 0.05, f"{took:.3f} s"  # 0.9 s with one pass per separator

    @pytest.mark.parametrize("small", [False, True])  # the split looks 200 characters in
    @pytest.mark.parametrize("split_up_to", [2000, 50])  # 50: both ways in one text
    @pytest.mark.parametrize("ascii_only", [False, True])
    @pytest.mark.slow
    def test_a_snippet_finds_the_token_where_a_tokenizer_would(
        self, monkeypatch, ascii_only, split_up_to, small
    ):
        """_token_offset skips tokens by splitting the text's bytes, or deeper in with one
        regular expression (possessive on 3.11): it must land where the k-th word starts,
        never inside a word split in two, whatever characters separate the words, and
        wherever the split gives up (Split.CHARS, Split.WORK)."""
        monkeypatch.setattr(notesvc.Split, "TOKENS_UP_TO", split_up_to)
        if small:
            monkeypatch.setattr(notesvc.Split, "CHARS", 200)
            monkeypatch.setattr(notesvc.Split, "WORK", 1500)
        rnd = random.Random(3)
        words = ["alpha", "beta_x", "x", "a1", "...", "C++", "foo-bar", "\n", "\x1f", "\t~"]
        if not ascii_only:  # letters and digits of other scripts; separators of 2-4 bytes
            words += ["Ünïcode", "—", "l’été", "straße", "漢字", "٣٤", "Ⅻ", "a\u0301b", "😀x"]
            words += ["\u00a0", "\u2028", "«»", "x\ud800y", "\x85", "café…"]
        for _ in range(300):
            text = " ".join(rnd.choice(words) for _ in range(rnd.randint(0, 260)))
            starts = [m.start() for m in notesvc.WORD_RE.finditer(text)]
            for k in {0, 1, 5, 99, 100, 101, 250, len(starts) - 1, len(starts), len(starts) + 3}:
                if k >= 0:
                    want = starts[k] if k < len(starts) else None
                    assert notesvc._token_offset(text, k) == want, (k, text[:60])
        assert notesvc._token_offset("abc", 1) is None  # one word is not two

    @pytest.mark.parametrize(
        ("q", "says"),
        [
            ('"unbalanced', "quote"),
            ("-only -exclusions", "only excludes"),
            ("x" * 513, "longer than 512"),
            ("", "required"),
            ("a*", "prefix"),
            ("OR cats", "OR"),
            ("cats OR", "OR"),
            ("!!! ???", "no searchable words"),
        ],
    )
    def test_malformed_query_is_400_saying_what_to_fix(self, client, q, says):
        err = assert_error(search(client, q, 400), 400, "VALIDATION_ERROR")
        assert says in err["message"]

    def test_missing_q_and_bad_paging_are_400(self, client):
        assert_error(client.get(f"{API}/search", status=400), 400, "VALIDATION_ERROR")
        for params in ({"limit": 0}, {"limit": 101}, {"offset": -1}, {"limit": "x"}):
            resp = client.get(f"{API}/search", {"q": "a", **params}, status=400)
            assert_error(resp, 400, "VALIDATION_ERROR")

    def test_unicode_query(self, corpus):
        put_note(corpus, "notes/ru.md", "# Заметка\n\nКлючи под горшком.")
        assert hits(corpus, "ключи") == ["notes/ru.md"]
        assert hits(corpus, "Заметка") == ["notes/ru.md"]


class TestSearchIndexLive:
    def test_index_follows_create_update_move_delete(self, client):
        put_note(client, "notes/a.md", "walrus")
        assert hits(client, "walrus") == ["notes/a.md"]
        client.put_json(note_url("notes/a.md"), {"content": "narwhal"})
        assert hits(client, "walrus") == []
        assert hits(client, "narwhal") == ["notes/a.md"]
        client.patch_json(note_url("notes/a.md") + "/move", {"path": "notes/b/c.md"})
        assert hits(client, "narwhal") == ["notes/b/c.md"]
        client.delete(note_url("notes/b/c.md"))
        assert hits(client, "narwhal") == []
        assert search(client, "narwhal")["total"] == 0

    def test_external_edit_found_after_rescan(self, client, root):
        put_note(client, "notes/a.md", "before")
        (root / "notes" / "a.md").write_text("after the edit")
        (root / "notes" / "new.md").write_text("brand new capybara")
        (root / "notes" / "sub").mkdir()
        (root / "notes" / "sub" / "x.md").write_text("capybara too")
        svc = client.app.service
        stats = svc.sync_index()
        assert stats["read"] == 3
        assert hits(client, "before") == []
        assert hits(client, "edit") == ["notes/a.md"]
        assert sorted(hits(client, "capybara")) == ["notes/new.md", "notes/sub/x.md"]
        (root / "notes" / "new.md").unlink()
        assert svc.sync_index()["removed"] == 1
        assert hits(client, "capybara") == ["notes/sub/x.md"]
        for _ in range(2):  # nothing changed: nothing read (its "seconds" vary by run)
            assert {k: svc.sync_index()[k] for k in ("read", "removed")} == {
                "read": 0,
                "removed": 0,
            }

    def test_restart_reads_only_what_changed(self, make_app, root):
        app = with_key(make_app())
        for i in range(30):
            put_note(app, f"notes/n{i}.md", f"note number {i} mongoose")
        app.app.service.close()  # saves the cache
        (root / "notes" / "n3.md").write_text("changed while stopped: wombat")
        (root / "notes" / "n4.md").unlink()
        again = with_key(make_app())
        assert again.app.service.last_sync["read"] == 1
        assert again.app.service.last_sync["removed"] == 1
        assert hits(again, "wombat") == ["notes/n3.md"]
        assert search(again, "mongoose")["total"] == 28

    @pytest.mark.parametrize(
        "damage",
        [b"garbage", b"", "truncate", "foreign-pickle"],
    )
    def test_corrupt_cache_is_rebuilt(self, make_app, root, damage, caplog):
        app = with_key(make_app())
        put_note(app, "notes/a.md", "ocelot")
        app.app.service.close()
        cache = root / ".notesvc" / "index.cache"
        if damage == "truncate":
            cache.write_bytes(cache.read_bytes()[:-10])
        elif damage == "foreign-pickle":
            import pickle

            class Evil:
                def __reduce__(self):
                    return (os.system, ("touch " + str(root / "pwned"),))

            cache.write_bytes(pickle.dumps(Evil()))
        else:
            cache.write_bytes(damage)
        again = with_key(make_app())
        assert hits(again, "ocelot") == ["notes/a.md"]
        assert again.app.service.last_sync["read"] == 1
        assert not (root / "pwned").exists()

    def test_system_info_reports_the_index(self, client):
        put_note(client, "notes/a.md", "hello world")
        info = data(client.get(f"{API}/system/info"))
        assert info["index"]["documents"] == 1
        assert info["index"]["terms"] >= 2


def change_notes(rnd: random.Random, index, notes: dict, root: Path, count: int) -> None:
    """Rewrite count notes on disk and in the index, the way the API's listener does."""
    for path in rnd.sample(sorted(notes), count):
        text = " ".join(rnd.choice(REF_WORDS) for _ in range(rnd.randint(1, 60)))
        if rnd.random() < 0.5:
            text = f"# {rnd.choice(REF_WORDS)} title\n{text}"
        notes[path] = text
        (root / path).write_text(text, encoding="utf-8")
        st = (root / path).stat()
        index.add(path, text, st.st_size, st.st_mtime_ns)


class TestSearchReference:
    """The index's top-10 (paths, order, scores) equals a brute-force BM25's, whatever its
    segments look like: one bulk segment, changes in memory, flushed files with deletions,
    a merge, a reopened index."""

    @pytest.mark.slow
    @pytest.mark.parametrize("seed", [1, 2])
    def test_every_stage_answers_like_brute_force_bm25(self, disk_index, tmp_path, seed):
        rnd = random.Random(seed)
        notes = make_ref_notes(rnd, 300)
        write_notes(tmp_path, notes)
        index = disk_index

        def check(stage: str):
            ref = ReferenceBM25(notes)
            for q in ref_queries(random.Random(seed), notes):
                assert_answers_like(index, ref, q)
            for folder in ("notes/work", "notes/home/"):
                for q in ("the", "apple OR zebra", "gard*", "the -apple"):
                    assert_answers_like(index, ref, q, folder)
            assert index.stats()["documents"] == len(notes), stage

        assert index.sync()["read"] == 300  # the bulk path: one segment file
        check("bulk")
        change_notes(rnd, index, notes, tmp_path, 40)  # replaced in memory, old ones deleted
        remove_notes(rnd, index, notes, tmp_path, 25)
        check("live")
        assert index.flush()
        check("flushed")
        change_notes(rnd, index, notes, tmp_path, 30)
        assert index.flush()
        remove_notes(rnd, index, notes, tmp_path, 10)
        check("files with deletions")
        files = [s for s in index._segs if isinstance(s, notesvc.DiskSegment)]
        assert len(files) >= 3
        assert index.merge(files)
        assert len(index._segs) == 1
        check("merged")
        index.close()
        reopened = notesvc.SearchIndex.open(tmp_path / ".notesvc", index.notes)
        index = reopened
        check("reopened")
        synced = reopened.sync()
        assert (synced["read"], synced["removed"]) == (0, 0)
        reopened.close()

    @pytest.mark.slow
    def test_scores_stay_exact_when_the_average_length_drifts(self, disk_index, tmp_path):
        rnd = random.Random(5)
        notes = make_ref_notes(rnd, 200)
        write_notes(tmp_path, notes)
        disk_index.sync()
        for i in range(80):  # much longer notes: the averages move far from the stored ones
            text = " ".join(rnd.choice(REF_WORDS) for _ in range(400))
            notes[f"notes/long{i}.md"] = text
            (tmp_path / f"notes/long{i}.md").write_text(text)
            disk_index.add(f"notes/long{i}.md", text, len(text), 1)
        ref = ReferenceBM25(notes)
        for q in ref_queries(random.Random(5), notes):
            assert_answers_like(disk_index, ref, q)


class TestServerSearch:
    pytestmark = [pytest.mark.real_server, pytest.mark.slow]

    def test_concurrent_searches_during_writes_never_error(self, tmp_path):
        with running(tmp_path, "--auth-mode", "none") as server:
            for i in range(20):
                server.request(
                    "POST", f"{API}/notes", {"path": f"notes/n{i}.md", "content": f"seed {i} heron"}
                )
            stop = threading.Event()
            bad = []
            done = collections.Counter()  # requests answered, by method

            def writer(w):
                v = 0
                while not stop.is_set():
                    v += 1
                    path = f"notes/n{(v + w) % 20}.md"
                    status, _, _ = server.request(
                        "PUT", note_url(path), {"content": f"heron {w} {v} kingfisher"}
                    )
                    done["PUT"] += 1
                    if status != 200:
                        bad.append(("PUT", status))

            def searcher():
                while not stop.is_set():
                    for q in ("heron", "kingfisher", '"heron 1"', "her*", "heron -seed"):
                        status, _, body = server.request(
                            "GET", f"{API}/search?" + urllib.parse.urlencode({"q": q})
                        )
                        done["GET"] += 1
                        if status != 200 or not body["success"]:
                            bad.append(("GET", status))

            threads = [threading.Thread(target=writer, args=(w,)) for w in range(3)]
            threads += [threading.Thread(target=searcher) for _ in range(3)]
            for t in threads:
                t.start()
            wait_for(lambda: done["PUT"] >= 150 and done["GET"] >= 300, timeout=60)
            stop.set()
            for t in threads:
                t.join(30)
            assert bad == []
            _, _, body = server.request("GET", f"{API}/search?q=heron")
            assert body["data"]["total"] == 20

    def test_background_rescan_picks_up_external_files(self, tmp_path):
        with running(tmp_path, "--auth-mode", "none", env={"SERVICE_RESCAN_SECONDS": "1"}) as s:
            (tmp_path / "notes" / "dropped.md").write_text("synced by syncthing: axolotl")
            found = wait_for(
                lambda: s.request("GET", f"{API}/search?q=axolotl")[2]["data"]["results"],
                timeout=10,
                step=0.3,
            )
            assert [r["path"] for r in found] == ["notes/dropped.md"]


class TestFolderCounts:
    def test_counts_follow_single_changes_and_match_a_recount(self):
        index = notesvc.SearchIndex()
        for i in range(30):
            index.add(f"notes/a/b{i % 3}/n{i}.md", f"note {i}", 6, i)
        counts = dict(index.folder_counts())
        assert counts["notes"] == 30
        assert counts["notes/a"] == 30
        assert counts["notes/a/b1"] == 10
        index.add("notes/a/b1/n1.md", "changed", 7, 99)  # an update: no new note
        index.add("notes/c/new.md", "new", 3, 1)
        index.remove("notes/a/b2/n2.md")
        index.move("notes/a/b0/n0.md", "notes/c/n0.md", 6, 1)  # not readable: removed only
        kept = dict(index.folder_counts())
        index._folder_counts = (-1, None)  # counted again from the index
        assert {k: v for k, v in kept.items() if v} == dict(index.folder_counts())
        assert kept["notes/c"] == 1
        assert kept["notes/a/b2"] == 9
        assert kept["notes"] == 29
