"""Text analysis, Porter2, BM25 ranking (src/notesvc/search/text.py)."""

from __future__ import annotations

import sys

import pytest

from conftest import API, HERE, hits, notesvc, put_note, search


class TestTokenizer:
    @pytest.mark.slow
    def test_doctests(self):
        import doctest

        modules = [m for n, m in sorted(sys.modules.items()) if n.split(".")[0] == "notesvc"]
        results = [doctest.testmod(m) for m in modules]  # the file, or each of the package's
        assert sum(r.attempted for r in results) >= 4
        assert sum(r.failed for r in results) == 0

    @pytest.mark.parametrize(
        ("a", "b"),
        [
            ("run", "running"),
            ("runs", "run"),
            ("keys", "key"),
            ("cities", "city"),
            ("boxes", "box"),
            ("notes", "note"),
            ("making", "make"),
            ("stopped", "stop"),
            ("Café", "cafe"),
            ("ÉCOLE", "ecole"),
            ("Straße", "strasse"),
        ],
    )
    def test_forms_that_fold_together(self, a, b):
        assert notesvc.tokenize(a) == notesvc.tokenize(b)

    @pytest.mark.parametrize(
        ("a", "b"), [("pies", "pi"), ("news", "new"), ("need", "ne"), ("this", "thi")]
    )
    def test_unrelated_words_stay_apart(self, a, b):
        assert notesvc.tokenize(a) != notesvc.tokenize(b)

    @pytest.mark.parametrize(
        ("word", "expected"),
        [
            ("informing", "inform"),
            ("informed", "inform"),
            ("information", "inform"),
            ("running", "run"),
            ("hopping", "hop"),
            ("hoped", "hope"),
            ("cities", "citi"),
            ("ties", "tie"),
            ("generously", "generous"),
            ("general", "general"),
            ("communism", "communism"),
            ("connections", "connect"),
            ("relational", "relat"),
            ("happiness", "happi"),
            ("dying", "die"),
            ("skies", "sky"),
            ("early", "earli"),
            ("inning", "inning"),
            ("proceeding", "proceed"),
            ("succeeded", "succeed"),
            ("agreed", "agre"),
            ("saying", "say"),
            ("news", "news"),
            ("gas", "gas"),
            ("by", "by"),
            ("x86", "x86"),  # digits and mixed tokens stay as they are
            ("2024", "2024"),
            ("naïve", "naïve"),  # only ASCII words are stemmed (fold() strips accents first)
        ],
    )
    def test_porter2_stems(self, word, expected):
        assert notesvc.stem(word) == expected

    def test_porter2_matches_the_snowball_word_list(self):
        """Every 15th pair of Snowball's English word list (docs/porter2-sample.txt)."""
        lines = (HERE / "docs" / "porter2-sample.txt").read_text().splitlines()
        pairs = [line.split() for line in lines if line and not line.startswith("#")]
        assert len(pairs) > 2500
        wrong = [(w, s, notesvc.stem(w)) for w, s in pairs if notesvc.stem(w) != s]
        assert wrong == []

    @pytest.mark.parametrize(
        ("word", "expected"),
        [  # the apostrophe pairs of Snowball's English word list (stem() passes letters only)
            ("'", "'"),
            ("''", "''"),
            ("'''", "'"),
            ("'a", "'a"),
            ("'a'", "a"),
            ("'aa", "aa"),
            ("'aa'", "aa"),
            ("'as", "as"),
            ("'as'", "as"),
            ("'s", "'s"),
            ("'s'", "s"),
            ("a'", "a'"),
            ("a''", "a'"),
            ("aa'", "aa"),
            ("there's", "there"),
            ("there's'", "there"),
        ],
    )
    def test_porter2_drops_apostrophes_as_snowball_does(self, word, expected):
        assert notesvc._porter2(word) == expected

    def test_porter2_suffix_tables_put_the_longest_first(self):
        """A step looks at the longest suffix a word ends with: the first one its table lists."""
        tables = [notesvc._P2_STEP0, notesvc._P2_1A, notesvc._P2_1B]
        tables += [tuple(t) for t in (notesvc._P2_STEP2, notesvc._P2_STEP3, notesvc._P2_STEP4)]
        for table in tables:
            assert list(table) == sorted(table, key=len, reverse=True)

    def test_bm25_idf_is_positive_and_falls_with_df(self):
        assert notesvc.bm25_idf(10, 10) > 0
        assert notesvc.bm25_idf(10, 1) > notesvc.bm25_idf(10, 5)


class TestRanking:
    def test_title_beats_body(self, client):
        put_note(client, "notes/a.md", "# Lighthouse\n\nsome other words here")
        put_note(client, "notes/b.md", "# Other\n\nsome lighthouse words here")
        assert hits(client, "lighthouse") == ["notes/a.md", "notes/b.md"]

    def test_rarer_term_beats_common(self, client):
        put_note(client, "notes/a.md", "alpha zebra")
        put_note(client, "notes/b.md", "alpha common")
        put_note(client, "notes/c.md", "common words")
        put_note(client, "notes/d.md", "common things")
        assert hits(client, "zebra OR common")[0] == "notes/a.md"

    def test_shorter_doc_beats_longer_at_equal_tf(self, client):
        put_note(client, "notes/short.md", "pelican and two words")
        put_note(client, "notes/long.md", "pelican " + "filler " * 60)
        assert hits(client, "pelican") == ["notes/short.md", "notes/long.md"]

    def test_more_occurrences_rank_higher(self, client):
        put_note(client, "notes/one.md", "otter a b c d e f")
        put_note(client, "notes/three.md", "otter otter otter d e f g")
        assert hits(client, "otter")[0] == "notes/three.md"


class TestWords:
    def test_underscores_separate_words_and_snippets_stay_on_them(self, client):
        body = (
            "# C locale\n\n"
            + "filler words here " * 40
            + "call nl_langinfo(CODESET) then gain_analysis\n"
        )
        client.post_json(f"{API}/notes", {"path": "notes/c.md", "content": body})
        hit = search(client, "langinfo")["results"][0]
        assert hit["path"] == "notes/c.md"
        assert "nl_langinfo" in hit["snippet"]
        assert search(client, '"nl langinfo"')["results"][0]["path"] == "notes/c.md"
        assert search(client, "gain")["results"][0]["path"] == "notes/c.md"

    def test_porter2_folds_what_people_type(self, client):
        client.post_json(
            f"{API}/notes", {"path": "notes/i.md", "content": "# Memo\n\nWe informed them.\n"}
        )
        for q in ("informing", "information", "inform", "INFORMED"):
            assert [r["path"] for r in search(client, q)["results"]] == ["notes/i.md"], q
