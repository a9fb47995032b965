"""Search by meaning: vectors, embeddings, the floor (src/notesvc/search/vectors.py)."""

from __future__ import annotations

import base64
import importlib.util
import json
import operator
import os
import random
import re
import socket
import statistics
import threading
import time
import types
import typing
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from conftest import (
    API,
    HERE,
    Server,
    as_key,
    assert_error,
    call_tool,
    data,
    hits,
    make_env,
    make_state,
    new_grant,
    note_url,
    notesvc,
    ok_tool,
    put_note,
    running,
    search,
    update,
    wait_for,
    with_key,
)
from search_reference import write_notes
from standins import MEANING_NOTES, embed_env


def embedded(client) -> dict:
    return data(client.get(f"{API}/system/info"))["embeddings"]


def embedder_settled(client, endpoint, tag: str) -> list:
    """Write a note and wait until it is embedded: the embedder takes its changes in passes,
    so what it was given before is done too (a wait on the event, not on the clock). Return
    what the endpoint was asked, the note's own text left out."""
    put_note(client, f"notes/zz-settled-{tag}.md", f"# Settled {tag}\n\nnow.")
    wait_for(lambda: any(f"Settled {tag}" in x for x in endpoint.inputs))
    all_embedded(client)
    return [x for x in endpoint.inputs if not x.startswith("Settled ")]


def all_embedded(client) -> dict:
    """Wait until every note is embedded and the floor is made from all of them; return
    the status."""

    def done(e: dict) -> typing.Any:
        made = "floor" not in e or (e["floor"] or {}).get("notes") == e["total"]
        return e["total"] and e["embedded"] == e["total"] and made and e

    return wait_for(lambda: done(embedded(client)))


# A person's first month of notes (29): what "search never says nothing" was found on.
PERSONAL_NOTES = {
    "notes/groceries.md": (
        "# Groceries\n\n- [ ] oat milk\n- [ ] eggs\n- [ ] sourdough bread\n- [ ] bananas\n- [ ] "
        "coffee beans"
    ),
    "notes/recipes/lasagne.md": (
        "# Lasagne\n\nBrown the minced beef with onion and garlic, add tomato passata and simmer "
        "40 minutes. Layer with pasta sheets and béchamel, bake at 180 °C for 45 minutes."
    ),
    "notes/recipes/pancakes.md": (
        "# Sunday pancakes\n\n200 g flour, 2 eggs, 300 ml milk, a pinch of salt. Rest the batter "
        "for half an hour; fry in butter."
    ),
    "notes/car.md": (
        "# Car\n\nThe mechanic changed the brake pads in May. Next service at 60,000 km: oil, "
        "filters, tyre rotation. Winter tyres are in the garage."
    ),
    "notes/dog.md": (
        "# Biscuit the dog\n\nWalk twice a day, around the park. Vet check-up and vaccinations "
        "every spring. He gets a dental chew at night."
    ),
    "notes/garden.md": (
        "# Vegetable garden\n\nSow tomatoes and courgettes indoors in March, plant out after the "
        "last frost. Water the seedlings every morning in June."
    ),
    "notes/travel/lisbon.md": (
        "# Trip to Lisbon\n\nFlight TP 1351, boarding at 7:40, gate B12, seat 14C. Hotel near "
        "Alfama, two nights. Try the pastéis de nata in Belém."
    ),
    "notes/travel/packing.md": (
        "# Packing list\n\nPassport, phone charger, adapter, sunscreen, swimsuit, a light jumper "
        "for the evenings."
    ),
    "notes/work/standup.md": (
        "# Team stand-up\n\nMaria finishes the invoice export this week. Tom is blocked on the "
        "database migration. Release moved to Thursday."
    ),
    "notes/work/budget.md": (
        "# Budget 2025\n\nSpreadsheet of the quarterly costs: rent, salaries, software licences "
        "and travel. Marketing asks for 10 % more."
    ),
    "notes/work/onboarding.md": (
        "# Onboarding the new hire\n\nLaptop ordered, accounts for email and the code "
        "repository, a buddy for the first two weeks."
    ),
    "notes/health.md": (
        "# Doctor\n\nAppointment with Dr Okafor on the 14th at 9:30 about the knee. Bring the "
        "X-ray and the list of medicines."
    ),
    "notes/books.md": (
        "# Books to read\n\n- The Left Hand of Darkness\n- Middlemarch\n- Thinking, Fast and "
        "Slow\n- A Gentleman in Moscow"
    ),
    "notes/gifts.md": (
        "# Birthday presents\n\nMum: a scarf or a pottery class. Sam: the new Zelda game. "
        "Grandad: a photo book of the summer."
    ),
    "notes/home/boiler.md": (
        "# Boiler\n\nThe heating engineer services the boiler every October. Pressure should "
        "read 1.5 bar; top it up with the valve under the tank."
    ),
    "notes/home/internet.md": (
        "# Home internet\n\nRouter in the hallway cupboard. Restart it when the video calls "
        "stutter; the provider's support line is open until 8 pm."
    ),
    "notes/home/bills.md": (
        "# Household bills\n\nElectricity by direct debit on the 3rd, water quarterly, council "
        "tax in ten instalments."
    ),
    "notes/running.md": (
        "# Running plan\n\nThree runs a week: an easy 5 km, intervals on Wednesday, a long run "
        "on Sunday. Half marathon in October."
    ),
    "notes/ideas.md": (
        "# Blog ideas\n\nWhy I switched to plain-text notes. A year of sourdough. What I learned "
        "from fixing my bike."
    ),
    "notes/bike.md": (
        "# Bike\n\nThe chain skips in the highest gear: adjust the derailleur. Pump the tyres to "
        "4 bar before long rides."
    ),
    "notes/movies.md": (
        "# Films to watch\n\nPerfect Days, Past Lives, the new Miyazaki, and the documentary "
        "about the Apollo missions."
    ),
    "notes/insurance.md": (
        "# Home insurance\n\nPolicy renews in September. The contents cover was raised after the "
        "new sofa; the excess is 250 euros."
    ),
    "notes/meeting-school.md": (
        "# Parents' evening\n\nMs Patel says Lily reads well above her level but should practise "
        "times tables. Next term: the school trip to the museum."
    ),
    "notes/wifi-guests.md": (
        "# Party on Saturday\n\nTwelve guests. Order the cake by Thursday, borrow folding chairs "
        "from the neighbours, make a playlist."
    ),
    "notes/language.md": (
        "# Learning Spanish\n\nTen minutes a day on the app. Irregular verbs: ser, ir, tener. "
        "Conversation class on Tuesdays at the library."
    ),
    "notes/plants.md": (
        "# House plants\n\nThe monstera wants indirect light and water once a week; the cactus "
        "once a month. Repot the fern in spring."
    ),
    "notes/photos.md": (
        "# Photo backup\n\nCopy the phone's pictures to the external drive on the first of the "
        "month; keep a second copy at my sister's."
    ),
    "notes/daily/2025-03-02.md": (
        "# 2 March\n\nRainy. Finished the quarterly report, called Mum, made soup with the "
        "leftover vegetables."
    ),
    "notes/cleaning.md": (
        "# Cleaning rota\n\nMonday bathroom, Wednesday kitchen floor, Friday hoover the stairs, "
        "Sunday change the bed sheets."
    ),
}


def clustered_vectors(n: int, dim: int, seed: int = 7) -> list:
    """Normalised vectors around a few centres, as real embeddings cluster."""
    rnd = random.Random(seed)
    centres = [[rnd.gauss(0, 1) for _ in range(dim)] for _ in range(40)]
    out = []
    for _ in range(n):
        c = rnd.choice(centres)
        out.append(notesvc.normalised([x + rnd.gauss(0, 0.8) for x in c]))
    return out


class TestVectorStore:
    """The vector store alone: both scans, the file's crash safety, compaction."""

    def filled(self, folder: Path, vectors: list, per_note: int = 5, **kw):
        store = notesvc.VectorStore.create(folder, len(vectors[0]), "fp", "m", {}, **kw)
        recs = store.append(list(enumerate(vectors)))
        for i in range(0, len(recs), per_note):
            store.assign(f"notes/n{i // per_note}.md", i, recs[i : i + per_note])
        return store

    @staticmethod
    def exact(vectors: list, query: list, per_note: int = 5) -> list:
        best: dict = {}
        for i, v in enumerate(vectors):
            path = f"notes/n{i // per_note}.md"
            best[path] = max(best.get(path, -2.0), sum(map(operator.mul, v, query)))
        return sorted(best, key=lambda p: -best[p])

    @pytest.mark.parametrize("vectorised", [False, True])
    @pytest.mark.slow
    def test_the_nearest_notes_match_exact_search(self, tmp_path, vectorised):
        if vectorised:
            pytest.importorskip("numpy")
        drawn = clustered_vectors(3020, 384)  # the queries near the notes, as real ones are
        vectors, queries = drawn[:3000], drawn[3000:]
        store = self.filled(tmp_path / "v", vectors, vectorised=vectorised)
        assert (store.np is None) is not vectorised
        recall = []
        for q in queries:
            got = [p for p, _, _ in store.nearest(q, limit=10)]
            recall.append(len(set(got) & set(self.exact(vectors, q)[:10])) / 10)
        assert statistics.mean(recall) >= 0.95
        path, score, chunk = store.nearest(vectors[42])[0]
        assert (path, chunk) == ("notes/n8.md", 2)
        assert score == pytest.approx(1.0, abs=0.01)
        store.assign("notes/sub/x.md", 99, [7])
        store.drop("notes/n0.md")
        store.assign("notes/mixed.md", 98, [4, 0, 2])  # records not in a row: kept as a list
        assert store.records("notes/mixed.md").tolist() == [4, 0, 2]
        path, _, chunk = store.nearest(vectors[0])[0]
        assert (path, chunk) == ("notes/mixed.md", 1)
        assert [p for p, _, _ in store.nearest(vectors[42], folder="notes/sub")] == [
            "notes/sub/x.md"
        ]
        assert store.nearest(vectors[42], folder="notes/none") == []
        store.close()

    @pytest.mark.slow
    def test_both_scans_give_the_same_answer_and_numpy_without_bitwise_count(self, tmp_path):
        np = pytest.importorskip("numpy")
        drawn = clustered_vectors(1505, 64)
        plain = self.filled(tmp_path / "a", drawn[:1500], vectorised=False)
        fast = self.filled(tmp_path / "b", drawn[:1500], vectorised=True)
        for q in drawn[1500:]:
            a = [(p, c) for p, _, c in plain.nearest(q, limit=5)]
            b = [(p, c) for p, _, c in fast.nearest(q, limit=5)]
            assert a == b
        bits = np.array([[0, 1, 255, 128]], "uint8")
        no_bitwise_count = types.SimpleNamespace(array=np.array)  # Debian 12's NumPy 1.24
        assert notesvc._popcount(no_bitwise_count, bits).tolist() == [[0, 1, 8, 1]]
        plain.close()
        fast.close()

    def test_a_damaged_record_cuts_the_file_there_and_its_notes_are_forgotten(self, tmp_path):
        vectors = clustered_vectors(50, 32)
        store = self.filled(tmp_path / "v", vectors)
        store.save()
        store.close()
        (vec,) = (tmp_path / "v").glob("vectors.*.bin")
        raw = bytearray(vec.read_bytes())
        size = (len(raw) - 12) // 50
        raw[12 + 30 * size + 20] ^= 0xFF  # record 30: a flipped byte
        vec.write_bytes(bytes(raw))
        again = notesvc.VectorStore.open(tmp_path / "v")
        assert vec.stat().st_size == 12 + 30 * size
        assert sorted(again.paths()) == sorted(f"notes/n{i}.md" for i in range(6))  # 0..29
        assert again.find(29) == 29
        assert again.find(30) == -1
        again.close()

    def test_records_past_the_map_are_found_by_hash_and_compaction_keeps_the_notes(self, tmp_path):
        vectors = clustered_vectors(40, 32)
        store = self.filled(tmp_path / "v", vectors)
        store.save()
        late = store.append([(1000, vectors[0])])  # appended, the map not saved: a crash
        os.close(store._fd)  # as a crash leaves it
        store._fd = -1
        again = notesvc.VectorStore.open(tmp_path / "v")
        assert again.find(1000) == late[0]  # found, not asked for again
        for i in range(4):
            again.drop(f"notes/n{i}.md")
        assert again.dead() == 21
        before = again.nearest(vectors[33])
        again.compact()
        assert again.dead() == 0
        assert again.stats() == {"notes": 4, "chunks": 20}
        assert again.nearest(vectors[33]) == before
        assert len(list((tmp_path / "v").glob("vectors.*.bin"))) == 1
        again.close()
        reopened = notesvc.VectorStore.open(tmp_path / "v")
        assert reopened.nearest(vectors[33]) == before
        reopened.close()

    def test_the_path_table_finds_adds_renames_and_removes(self):
        table = notesvc._PathTable()
        paths = [f"notes/dossier {i % 7}/note é{i}.md" for i in range(3000)]
        numbers = [table.add(p) for p in paths]
        assert numbers == list(range(3000))
        assert table.add(paths[5]) == 5  # known: the same number
        for i in range(0, 3000, 3):
            table.remove(i)
        for i in range(1, 3000, 3):
            table.rename(i, paths[i].replace("notes/", "notes/moved/"))
        assert table.count == 2000
        assert table.find(paths[0]) is None
        assert table.find(paths[1]) is None
        assert table.find(paths[1].replace("notes/", "notes/moved/")) == 1
        assert table.find(paths[2]) == 2
        assert table.path(0) is None
        assert table.path(4) == paths[4].replace("notes/", "notes/moved/")
        held = dict(table.held())
        assert len(held) == 2000
        assert all(table.find(p) == n for n, p in held.items())
        assert table.find("notes/dossier 1/note é1") is None  # a prefix of a path held

    @pytest.mark.parametrize(
        ("title", "text", "chunks"),
        [
            ("T", "", ["T"]),
            ("", "", []),
            ("T", "---\nsecret: front matter\n---\nbody", ["T\n\nbody"]),
            ("T", "# A\none\n## B\ntwo", ["T\nA\n\none", "T\nA › B\n\ntwo"]),
            ("T", "```\ncode\n\n# not a heading\n```", ["T\n\n```\ncode\n\n# not a heading\n```"]),
        ],
    )
    def test_chunks(self, title, text, chunks):
        assert notesvc.chunk_note(title, text) == chunks

    def test_long_text_is_cut_between_words_and_a_huge_note_is_capped(self):
        words = [f"w{i}" for i in range(1000)]
        chunks = notesvc.chunk_note("T", " ".join(words))
        assert all(len(notesvc.chunk_body(c).split()) <= notesvc.CHUNK_MAX_WORDS for c in chunks)
        assert " ".join(notesvc.chunk_body(c) for c in chunks).split() == words
        huge = "\n\n".join("para " * 200 for _ in range(3000))
        assert len(notesvc.chunk_note("T", huge)) == notesvc.MAX_NOTE_CHUNKS

    @pytest.mark.parametrize(
        "vec",
        [[], [0.0, 0.0], [1.0, float("nan")], [float("inf"), 1.0], ["1", 2], [True, 1.0], "x"],
    )
    def test_bad_vectors_are_refused(self, vec):
        with pytest.raises(notesvc.VectorError):
            notesvc.normalised(vec)


class TestEmbeddings:
    """Hybrid search through an embeddings endpoint: the plumbing, with a stand-in model."""

    @pytest.fixture
    def meaning(self, make_app, embed_endpoint):
        client = with_key(make_app(**embed_env(embed_endpoint)))
        for path, text in MEANING_NOTES.items():
            put_note(client, path, text)
        all_embedded(client)
        return client

    def test_off_changes_nothing_and_removes_a_leftover_store(self, make_app, root):
        leftover = root / ".notesvc" / "vectors"
        leftover.mkdir(parents=True)
        (leftover / "meta.json").write_text("{}")
        client = with_key(make_app())
        assert not leftover.exists()
        svc = client.app.service
        assert svc.embedder is None
        assert not [t for t in threading.enumerate() if t.name == "notesvc-embed"]
        put_note(client, "notes/a.md", "# Car\n\nrepair")
        d = search(client, "car repair")
        assert (d["mode"], d["fallback"]) == ("keyword", False)
        assert "embeddings" not in d
        assert data(client.get(f"{API}/system/info"))["embeddings"] is None
        d = search(client, "car", mode="hybrid")  # asked for, but off: words, and it says so
        assert (d["mode"], d["fallback"]) == ("keyword", True)

    def test_settings_are_checked_at_start(self, root):
        with pytest.raises(notesvc.ConfigError, match=r"SERVICE_EMBED_URL.*neither"):
            notesvc.load_config(env=make_env(root, SERVICE_EMBED_URL="http://h/v1/chat?key=s3cr3t"))
        with pytest.raises(notesvc.ConfigError) as refused:
            notesvc.load_config(env=make_env(root, SERVICE_EMBED_URL="http://h/x?key=s3cr3t"))
        assert "s3cr3t" not in str(refused.value)
        with pytest.raises(notesvc.ConfigError, match="SERVICE_EMBED_MODEL"):
            notesvc.load_config(env=make_env(root, SERVICE_EMBED_URL="http://h/api/embed"))
        with pytest.raises(notesvc.ConfigError, match="SERVICE_EMBED_URL"):
            notesvc.load_config(env=make_env(root, SERVICE_EMBED_URL="ftp://h/api/embed"))
        cfg = notesvc.load_config(
            env=make_env(root, SERVICE_EMBED_URL="https://h/v1/embeddings", SERVICE_EMBED_MODEL="m")
        )
        assert (cfg.embed_url, cfg.embed_model) == ("https://h/v1/embeddings", "m")

    @pytest.mark.parametrize("kind", ["ollama", "openai"])
    def test_both_wire_formats_find_a_note_by_meaning(self, make_app, embed_endpoint, kind):
        client = with_key(make_app(**embed_env(embed_endpoint, kind, SERVICE_EMBED_KEY="sk-abc")))
        for path, text in MEANING_NOTES.items():
            put_note(client, path, text)
        status = all_embedded(client)
        assert status["model"] == "stand-in"
        assert hits(client, "car repair", mode="keyword") == []  # no note has both words
        d = search(client, "car repair")
        assert (d["mode"], d["fallback"]) == ("hybrid", False)
        assert d["results"][0]["path"] in ("notes/garage.md", "notes/work/car.md")
        assert {"notes/garage.md", "notes/work/car.md"} <= {r["path"] for r in d["results"][:2]}
        assert d["embeddings"] == {"embedded": 4, "total": 4, "model": "stand-in"}
        sem = search(client, "car repair", mode="semantic")
        assert sem["mode"] == "semantic"
        assert sem["results"][0]["path"] in d["results"][0]["path"]
        assert set(sem["results"][0]) == {"path", "title", "score", "snippet"}
        assert {c[2] for c in embed_endpoint.calls} == {"Bearer sk-abc"}
        assert {c[0] for c in embed_endpoint.calls} == {
            urllib.parse.urlsplit(embed_endpoint.url(kind)).path
        }
        info = embedded(client)
        assert info["dimensions"] == 384
        assert info["lastError"] is None
        assert re.fullmatch(r"[0-9a-f]{16}", info["fingerprint"])
        config = data(client.get(f"{API}/system/config"))["search"]
        assert config["embedKeySet"] is True
        assert "sk-abc" not in json.dumps(config)

    @pytest.mark.slow
    def test_snippet_comes_from_the_best_chunk(self, make_app, embed_endpoint):
        client = with_key(make_app(**embed_env(embed_endpoint)))
        body = "# Trip\n\n## Packing\n\nSocks, a jumper, the charger.\n\n## The puppy\n\n" + (
            "The hound stays with the neighbours, who feed him at noon. " * 40
        )
        put_note(client, "notes/trip.md", body)
        put_note(client, "notes/other.md", "# Other\n\nNothing about animals here at all.")
        all_embedded(client)
        top = search(client, "canine", mode="semantic")["results"][0]
        assert top["path"] == "notes/trip.md"
        assert "neighbours" in top["snippet"]
        assert "Socks" not in top["snippet"]
        assert len(top["snippet"]) <= 200

    @pytest.mark.slow
    def test_batches_hold_at_most_64_chunks(self, make_app, embed_endpoint, root):
        write_notes(root, {f"notes/n{i:03}.md": f"# Note {i}\n\nword{i} text" for i in range(150)})
        client = with_key(make_app(**embed_env(embed_endpoint)))
        assert all_embedded(client)["embedded"] == 150
        sizes = [c[1] for c in embed_endpoint.calls]
        assert max(sizes) == 64
        assert sum(sizes) == 150 + 1

    @pytest.mark.slow
    def test_an_edit_embeds_only_its_changed_chunk_and_a_move_nothing(
        self, meaning, embed_endpoint
    ):
        client = meaning
        long = "# Long\n\n" + "\n\n".join(
            f"Paragraph {i}. " + "filler words here " * 60 for i in range(4)
        )
        put_note(client, "notes/long.md", long)
        all_embedded(client)
        before = len(embed_endpoint.inputs)  # (no note settled yet)
        update(client, "notes/long.md", long.replace("Paragraph 3.", "Paragraph three."))
        wait_for(lambda: len(embed_endpoint.inputs) > before)
        all_embedded(client)
        asked = embedder_settled(client, embed_endpoint, "edit")
        assert len(asked) - before == 1  # one chunk of four
        before = len(asked)
        client.patch_json(note_url("notes/long.md") + "/move", {"path": "notes/work/long.md"})
        client.patch_json(note_url("notes/garage.md") + "/move", {"path": "notes/cars/garage.md"})
        all_embedded(client)
        assert search(client, "car repair", mode="semantic")["results"][0]["path"].startswith(
            ("notes/cars/garage.md", "notes/work/car.md")
        )
        asked = embedder_settled(client, embed_endpoint, "moves")
        assert [x[:60] for x in asked[before:] if x != "car repair"] == []

    def test_a_deleted_note_leaves_the_results(self, meaning):
        meaning.delete(note_url("notes/garage.md"))
        wait_for(lambda: "notes/garage.md" not in hits(meaning, "car repair", mode="semantic"))
        assert embedded(meaning)["total"] == 3

    @pytest.mark.parametrize("how", ["500", "html", "nan", "count", "huge", "empty", "redirect"])
    @pytest.mark.slow
    def test_a_failing_endpoint_never_fails_a_search(self, meaning, embed_endpoint, how):
        embed_endpoint.how = how
        d = search(meaning, "car repair")
        assert (d["mode"], d["fallback"]) == ("keyword", True)
        assert d["results"] == []  # the words alone: no note has both
        assert search(meaning, "brake")["results"][0]["path"] == "notes/garage.md"
        err = embedded(meaning)["lastError"]
        assert err["class"] in ("http", "answer", "dimension")
        assert len(err["message"].encode()) <= 200
        if how in ("500", "redirect"):
            assert err["status"] == int(how.replace("redirect", "307"))
        # paused: the next searches do not ask the endpoint for 30 s
        calls = len(embed_endpoint.calls)
        search(meaning, "car repair")
        assert len(embed_endpoint.calls) == calls

    @pytest.mark.slow
    def test_a_slow_or_trickling_endpoint_costs_a_search_at_most_the_budget(
        self, meaning, embed_endpoint
    ):
        for how in ("slow", "trickle"):
            embed_endpoint.how = how
            meaning.app.service.embedder._paused_until = 0
            started = time.monotonic()
            d = search(meaning, "car repair")
            assert time.monotonic() - started < 2.5
            assert (d["mode"], d["fallback"]) == ("keyword", True)
            assert embedded(meaning)["lastError"]["class"] == "timeout"

    def test_the_key_in_an_error_is_scrubbed(self, make_app, embed_endpoint, caplog):
        env = embed_env(embed_endpoint, SERVICE_EMBED_KEY="sk-secret-123")
        env["SERVICE_EMBED_URL"] = embed_endpoint.url("ollama", "?token=urltok42")
        embed_endpoint.how = "500"
        client = with_key(make_app(**env))
        put_note(client, "notes/a.md", "# A\n\ntext")
        err = wait_for(lambda: embedded(client)["lastError"])
        assert err["status"] == 500
        assert "model crashed" in err["message"]
        assert "sk-secret-123" not in err["message"]
        everything = json.dumps(data(client.get(f"{API}/system/info"))) + caplog.text
        everything += json.dumps(data(client.get(f"{API}/system/config")))
        assert "sk-secret-123" not in everything
        assert "urltok42" not in everything

    @pytest.mark.parametrize(
        "how", ["echo-lower", "echo-upper", "echo-base64", "echo-url", "echo-cut"]
    )
    def test_a_key_the_endpoint_echoes_in_any_spelling_is_scrubbed(
        self, make_app, embed_endpoint, caplog, how
    ):
        """T14: an endpoint that says the key back lower-cased, upper-cased, in base64,
        URL-encoded or cut short puts it neither into /system/info nor into the log."""
        key = "sk-Proj-AbCdEf:0123456789_ghIJ-klMN"
        embed_endpoint.how = how
        client = with_key(make_app(**embed_env(embed_endpoint, "openai", SERVICE_EMBED_KEY=key)))
        put_note(client, "notes/a.md", "# A\n\ntext")
        err = wait_for(lambda: embedded(client)["lastError"])
        assert err["status"] == 401
        assert "Incorrect API key provided" in err["message"]
        everything = json.dumps(data(client.get(f"{API}/system/info"))) + caplog.text
        spellings = [key, key.lower(), key.upper(), urllib.parse.quote(key, safe="")]
        spellings += [base64.b64encode(f"Bearer {key}".encode()).decode()[8:-4], key[:20]]
        for spelt in spellings:
            assert spelt.lower() not in everything.lower(), spelt

    def test_phrase_and_prefix_stay_keyword_and_exclusions_apply(self, meaning):
        for q in ('"brake pads"', "brak*"):
            d = search(meaning, q)
            assert (d["mode"], d["fallback"]) == ("keyword", True)
            assert [r["path"] for r in d["results"]] == ["notes/garage.md"]
        d = search(meaning, "car-repair")  # a phrase to the index, meaning to a person
        assert (d["mode"], d["fallback"]) == ("hybrid", False)
        assert d["results"][0]["path"] in ("notes/garage.md", "notes/work/car.md")
        assert "notes/work/car.md" in hits(meaning, "car repair")
        assert "notes/work/car.md" not in hits(meaning, "car repair -inspection")
        assert "notes/work/car.md" not in hits(meaning, "car repair -inspection", mode="semantic")

    def test_bad_mode_is_a_400(self, meaning):
        resp = meaning.get(f"{API}/search", {"q": "car", "mode": "vibes"}, status=400)
        assert_error(resp, 400, "VALIDATION_ERROR")

    def test_a_folder_grant_finds_by_meaning_in_its_folder_only(self, meaning):
        grant = new_grant(meaning, "read", folder="notes/work")
        scoped = as_key(meaning, grant["key"])
        for mode in ("semantic", "hybrid"):
            found = hits(scoped, "car repair", mode=mode)
            assert found
            assert all(p.startswith("notes/work/") for p in found)
        related = data(scoped.get(note_url("notes/work/car.md") + "/related"))["results"]
        assert all(r["path"].startswith("notes/work/") for r in related)
        scoped.get(note_url("notes/garage.md") + "/related", status=404)

    def test_related_notes(self, meaning):
        d = data(meaning.get(note_url("notes/garage.md") + "/related", {"limit": 2}))
        assert d["path"] == "notes/garage.md"
        # only the note about the same thing: the others are under the floor (fewer than 2)
        assert [r["path"] for r in d["results"]] == ["notes/work/car.md"]
        assert d["results"][0]["score"] >= embedded(meaning)["floor"]["cosine"]
        assert set(d["results"][0]) == {"path", "title", "score"}
        assert_error(
            meaning.get(note_url("notes/nope.md") + "/related", status=404), 404, "NOT_FOUND"
        )
        meaning.get(note_url("notes/garage.md") + "/related", {"limit": 0}, status=400)
        meaning.get(note_url("notes/garage.md") + "/related", {"limit": "x"}, status=400)

    def test_related_is_empty_while_embeddings_are_off(self, client):
        put_note(client, "notes/a.md", "# A\n\ntext")
        assert data(client.get(note_url("notes/a.md") + "/related"))["results"] == []

    def test_mcp_search_takes_a_mode_and_related_notes_is_a_tool(self, meaning):
        found = ok_tool(meaning, "search_notes", query="car repair", mode="semantic")
        assert found["mode"] == "semantic"
        assert found["results"][0]["path"] in (
            "notes/garage.md",
            "notes/work/car.md",
        )
        assert ok_tool(meaning, "search_notes", query="car repair", mode="keyword")["results"] == []
        near = ok_tool(meaning, "related_notes", path="notes/garage.md", limit=1)
        assert near["results"][0]["path"] == "notes/work/car.md"
        bad = call_tool(meaning, "search_notes", query="car", mode="vibes")
        assert bad["isError"] is True

    def test_the_agent_retrieves_by_meaning(self, meaning):
        found = notesvc.retrieve(meaning.app.service, "how do I mend my automobile?", None)
        assert found
        assert found[0][0] in ("notes/garage.md", "notes/work/car.md")

    def test_a_new_dimension_rebuilds_in_the_background_while_search_answers(
        self, meaning, embed_endpoint
    ):
        svc = meaning.app.service
        old = embedded(meaning)["fingerprint"]
        embed_endpoint.dim = 32
        svc.embedder._paused_until = 0
        d = search(meaning, "car repair")  # the query's vector no longer fits: keyword
        assert (d["mode"], d["fallback"]) == ("keyword", True)
        svc.embedder.look_again()
        info = wait_for(
            lambda: (lambda e: e["dimensions"] == 32 and e["embedded"] == 4 and e)(
                embedded(meaning)
            )
        )
        assert info["fingerprint"] != old
        svc.embedder._paused_until = 0
        assert search(meaning, "car repair")["mode"] == "hybrid"

    def test_a_torn_tail_is_cut_and_embedded_again(self, make_app, embed_endpoint, root):
        client = with_key(make_app(**embed_env(embed_endpoint)))
        for path, text in MEANING_NOTES.items():
            put_note(client, path, text)
        all_embedded(client)
        client.app.service.close()
        folder = root / ".notesvc" / "vectors"
        (vec,) = folder.glob("vectors.*.bin")
        size = vec.stat().st_size
        with open(vec, "r+b") as f:
            f.truncate(size - 7)  # the last record torn
        again = with_key(make_app(**embed_env(embed_endpoint)))
        calls = len(embed_endpoint.inputs)
        assert all_embedded(again)["embedded"] == 4
        assert 1 <= len(embed_endpoint.inputs) - calls <= 2  # the probe and the torn chunk
        assert search(again, "car repair", mode="semantic")["results"]

    @pytest.mark.slow
    def test_a_huge_note_and_many_notes_at_once(self, make_app, embed_endpoint, root):
        words = " ".join(f"w{i % 5000}" for i in range(900_000))  # ~5 MB
        write_notes(root, {"notes/huge.md": "# Huge\n\n" + words})
        write_notes(root, {f"notes/m/{i}.md": f"# M {i}\n\nmend car {i}" for i in range(2000)})
        client = with_key(make_app(**embed_env(embed_endpoint)))
        assert all_embedded(client)["embedded"] == 2001
        assert max(c[1] for c in embed_endpoint.calls) <= 64
        assert search(client, "repair automobile", mode="semantic")["results"]


class TestSearchFloor:
    """Search by meaning says "nothing": only notes whose cosine clears the floor calibrated
    from the notes' own scores are found by meaning (stand-in model, 29 personal notes)."""

    @pytest.fixture
    def personal(self, make_app, embed_endpoint, root):
        write_notes(root, PERSONAL_NOTES)
        client = with_key(make_app(**embed_env(embed_endpoint)))
        assert all_embedded(client)["embedded"] == 29
        return client

    def test_search_about_nothing_in_the_notes_finds_nothing(self, personal):
        for q in ("spare keys", "quantum physics lecture"):
            for mode in ("hybrid", "semantic"):
                d = search(personal, q, mode=mode)
                assert (d["mode"], d["fallback"]) == (mode, False)
                assert (d["total"], d["results"]) == (0, []), (q, mode)

    def test_search_by_meaning_still_finds_its_note_and_keeps_keyword_hits(self, personal):
        floor = embedded(personal)["floor"]["cosine"]
        for q, want in (
            ("vehicle brake pads", "notes/car.md"),
            ("canine vet vaccinations", "notes/dog.md"),
        ):
            assert hits(personal, q, mode="keyword") == []  # no note has every word
            for mode in ("hybrid", "semantic"):
                d = search(personal, q, mode=mode)
                assert [r["path"] for r in d["results"]] == [want], (q, mode)
                assert d["total"] == 1
            assert search(personal, q, mode="semantic")["results"][0]["score"] >= floor
        words = set(hits(personal, "Thursday", mode="keyword"))
        assert words == {"notes/work/standup.md", "notes/wifi-guests.md"}
        assert set(hits(personal, "Thursday")) == words  # meaning adds nothing unrelated

    def test_related_lists_only_notes_over_the_floor_possibly_none(self, personal):
        floor = embedded(personal)["floor"]["cosine"]
        lengths = []
        for path in PERSONAL_NOTES:
            near = data(personal.get(note_url(path) + "/related", {"limit": 5}))["results"]
            assert all(r["score"] >= floor for r in near), (path, near)
            lengths.append(len(near))
        assert data(personal.get(note_url("notes/work/budget.md") + "/related"))["results"] == []
        assert max(lengths) < 5  # noise no longer fills the list

    def test_the_floor_is_stated_and_made_again_as_the_notes_change(self, personal):
        floor = wait_for(
            lambda: (lambda f: f["neighbours"]["notes"] and f)(embedded(personal)["floor"])
        )
        assert floor["notes"] == floor["probe"]["notes"] == 29
        assert 0 < floor["cosine"] < 0.5
        assert floor["probe"]["median"] < floor["cosine"]
        assert floor["neighbours"]["notes"] == 29
        assert "probe text" in floor["method"]
        for i in range(3):  # a small collection: made again after each change
            put_note(personal, f"notes/new{i}.md", f"# New {i}\n\nA puppy called Rex {i}.")
        again = wait_for(lambda: (lambda f: f["notes"] == 32 and f)(embedded(personal)["floor"]))
        assert again["at"] >= floor["at"]
        svc = personal.app.service
        svc.close()  # the floor is kept with the vectors: a restart has it at once
        store = notesvc.VectorStore.open(svc.config.state_dir / "vectors")
        assert store.extra["floor"]["notes"] == 32
        store.close()

    def test_two_notes_have_a_floor_too(self, make_app, embed_endpoint):
        client = with_key(make_app(**embed_env(embed_endpoint)))
        put_note(client, "notes/garage.md", MEANING_NOTES["notes/garage.md"])
        put_note(client, "notes/pets.md", MEANING_NOTES["notes/pets.md"])
        floor = all_embedded(client)["floor"]
        assert floor["notes"] == 2
        assert floor["cosine"] > floor["probe"]["median"]
        assert search(client, "quantum physics lecture")["total"] == 0
        assert hits(client, "car repair", mode="semantic") == ["notes/garage.md"]

    def test_search_counts_embeddings_within_a_folder_grant(self, personal):
        owner = search(personal, "car")["embeddings"]
        assert (owner["embedded"], owner["total"]) == (29, 29)
        for folder, count in (("notes/work", 3), ("notes/recipes", 2)):
            scoped = as_key(personal, new_grant(personal, "read", folder=folder)["key"])
            for mode in ("hybrid", "keyword"):
                e = search(scoped, "car", mode=mode)["embeddings"]
                assert (e["embedded"], e["total"]) == (count, count), folder
        # a note moved out of the folder leaves its counts at once
        personal.patch_json(note_url("notes/work/budget.md") + "/move", {"path": "notes/budget.md"})
        work = as_key(personal, new_grant(personal, "read", folder="notes/work")["key"])
        e = wait_for(lambda: (lambda e: e["total"] == 2 and e)(search(work, "car")["embeddings"]))
        assert e["embedded"] == 2


class TestEmbeddingsServer:
    """Embeddings in the real `python notesvc.py`: restart, a new model, the endpoint down,
    folder grants."""

    pytestmark = [pytest.mark.real_server, pytest.mark.slow]

    @staticmethod
    def status(server: Server, owner: dict) -> dict:
        return server.request("GET", f"{API}/system/info", None, owner)[2]["data"]["embeddings"]

    def wait_embedded(self, server: Server, owner: dict, total: int) -> dict:
        def done():
            e = self.status(server, owner)
            return e["embedded"] == e["total"] == total and e

        return wait_for(done, timeout=30)

    @staticmethod
    def found(server: Server, headers: dict, q: str, mode: str = "") -> tuple:
        query = urllib.parse.urlencode({"q": q, **({"mode": mode} if mode else {})})
        d = server.request("GET", f"{API}/search?{query}", None, headers)[2]["data"]
        return d["mode"], d["fallback"], [r["path"] for r in d["results"]]

    def test_a_restart_resumes_and_a_new_model_rebuilds(self, tmp_path, embed_endpoint):
        write_notes(tmp_path, MEANING_NOTES)
        owner = {"X-Service-Key": make_state(tmp_path)["apiKey"]}
        env = embed_env(embed_endpoint)
        with running(tmp_path, env=env) as server:
            first = self.wait_embedded(server, owner, 4)
            assert self.found(server, owner, "car repair")[0] == "hybrid"
        asked = len(embed_endpoint.inputs)
        write_notes(tmp_path, {"notes/new.md": "# Canine\n\nA hound."})  # while it was down
        with running(tmp_path, env={**env, "SERVICE_RESCAN_SECONDS": "60"}) as server:
            again = self.wait_embedded(server, owner, 5)
            # a note written now is embedded after all it had to do before
            body = {"path": "notes/zz.md", "content": "# Settled\n\nnow."}
            assert server.request("POST", f"{API}/notes", body, owner)[0] == 201
            self.wait_embedded(server, owner, 6)
            # the probe, then the one new note: nothing embedded twice
            assert embed_endpoint.inputs[asked:] == [
                notesvc.PROBE,
                "Canine\n\nA hound.",
                "Settled\n\nnow.",
            ]
            assert again["fingerprint"] == first["fingerprint"]
            assert self.found(server, owner, "puppy", "semantic")[2][0] in (
                "notes/new.md",
                "notes/pets.md",
            )
        with running(tmp_path, env={**env, "SERVICE_EMBED_MODEL": "another"}) as server:
            other = self.wait_embedded(server, owner, 6)
            assert other["fingerprint"] != first["fingerprint"]
            assert other["model"] == "another"
        assert len(list((tmp_path / ".notesvc" / "vectors").glob("vectors.*.bin"))) == 1

    def test_the_endpoint_down_at_start_then_up(self, tmp_path):
        write_notes(tmp_path, MEANING_NOTES)
        owner = {"X-Service-Key": make_state(tmp_path)["apiKey"]}
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {
            "SERVICE_EMBED_URL": f"http://127.0.0.1:{port}/api/embed",
            "SERVICE_EMBED_MODEL": "stand-in",
            "SERVICE_EMBED_KEY": "sk-never-logged-77",
        }
        with running(tmp_path, env=env) as server:
            err = wait_for(lambda: self.status(server, owner)["lastError"], timeout=20)
            assert err["class"] == "connection"
            mode, fallback, paths = self.found(server, owner, "brake")
            assert (mode, fallback, paths) == ("keyword", True, ["notes/garage.md"])
            assert self.status(server, owner)["embedded"] == 0
        assert "sk-never-logged-77" not in "".join(server.lines)

    def test_a_key_echoed_lower_cased_reaches_neither_the_info_nor_the_log(
        self, tmp_path, embed_endpoint
    ):
        """T14 as the attack found it: the endpoint answers 401 with the key lower-cased."""
        write_notes(tmp_path, MEANING_NOTES)
        owner = {"X-Service-Key": make_state(tmp_path)["apiKey"]}
        key = "sk-Never-Logged-AbCdEfGh-77"
        embed_endpoint.how = "echo-lower"
        env = {**embed_env(embed_endpoint, "openai"), "SERVICE_EMBED_KEY": key}
        with running(tmp_path, env=env) as server:
            err = wait_for(lambda: self.status(server, owner)["lastError"], timeout=20)
            assert err["status"] == 401
            info = server.request("GET", f"{API}/system/info", headers=owner)[2]
            wait_for(lambda: any("Incorrect API key" in line for line in server.lines))
        for text in (json.dumps(info), "".join(server.lines)):
            assert key.lower() not in text.lower()

    def test_a_real_small_model_finds_notes_by_meaning(self, tmp_path):
        for module in ("numpy", "safetensors", "tokenizers", "all_minilm_l6_v2"):
            pytest.importorskip(module)
        spec = importlib.util.spec_from_file_location("minilm", HERE / "bench" / "minilm.py")
        minilm = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(minilm)
        model = minilm.serve(minilm.MiniLM.load())
        notes = {
            **MEANING_NOTES,
            "notes/garden.md": "# Tomatoes\n\nWater the seedlings every morning in June.",
            "notes/flight.md": "# Trip to Lisbon\n\nBoarding at 7:40, gate B12, seat 14C.",
        }
        write_notes(tmp_path, notes)
        owner = {"X-Service-Key": make_state(tmp_path)["apiKey"]}
        url = f"http://127.0.0.1:{model.server_address[1]}/v1/embeddings"
        env = {"SERVICE_EMBED_URL": url, "SERVICE_EMBED_MODEL": "all-minilm"}
        try:
            with running(tmp_path, env=env) as server:
                info = self.wait_embedded(server, owner, 6)
                assert info["dimensions"] == 384
                for q, want in [
                    ("car repair", {"notes/garage.md", "notes/work/car.md"}),
                    ("looking after my dog", {"notes/pets.md"}),
                    ("growing vegetables", {"notes/garden.md"}),
                    ("airplane travel", {"notes/flight.md"}),
                ]:
                    mode, fallback, paths = self.found(server, owner, q, "semantic")
                    assert (mode, fallback) == ("semantic", False)
                    assert paths[0] in want, (q, paths)
                assert self.found(server, owner, "car repair", "keyword")[2] == []
                assert self.found(server, owner, "car repair")[2][0] in {
                    "notes/garage.md",
                    "notes/work/car.md",
                }
        finally:
            model.shutdown()
            model.server_close()

    def test_a_real_small_model_says_nothing_about_what_no_note_holds(self, tmp_path):
        for module in ("numpy", "safetensors", "tokenizers", "all_minilm_l6_v2"):
            pytest.importorskip(module)
        spec = importlib.util.spec_from_file_location("minilm", HERE / "bench" / "minilm.py")
        minilm = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(minilm)
        model = minilm.serve(minilm.MiniLM.load())
        write_notes(tmp_path, PERSONAL_NOTES)
        owner = {"X-Service-Key": make_state(tmp_path)["apiKey"]}
        url = f"http://127.0.0.1:{model.server_address[1]}/v1/embeddings"
        env = {"SERVICE_EMBED_URL": url, "SERVICE_EMBED_MODEL": "all-minilm"}

        def answer(q: str, mode: str) -> dict:
            query = urllib.parse.urlencode({"q": q, "mode": mode})
            return server.request("GET", f"{API}/search?{query}", None, owner)[2]["data"]

        def related(path: str) -> list:
            at = note_url(path) + "/related?limit=5"
            return server.request("GET", at, None, owner)[2]["data"]["results"]

        try:
            with running(tmp_path, env=env) as server:
                self.wait_embedded(server, owner, 29)
                floor = wait_for(
                    lambda: (lambda f: f and f["notes"] == 29 and f)(
                        self.status(server, owner)["floor"]
                    ),
                    timeout=30,
                )
                assert floor["probe"]["median"] < floor["cosine"] < 0.5
                for q in ("spare keys", "quantum physics lecture", "chess opening theory"):
                    for mode in ("hybrid", "semantic"):
                        d = answer(q, mode)
                        assert (d["mode"], d["total"], d["results"]) == (mode, 0, []), q
                for q, want in [
                    ("looking after my dog", "notes/dog.md"),
                    ("growing vegetables", "notes/garden.md"),
                    ("broadband is slow", "notes/home/internet.md"),
                    ("back up my pictures", "notes/photos.md"),
                    ("airplane travel", "notes/travel/lisbon.md"),
                ]:
                    for mode in ("semantic", "hybrid"):
                        d = answer(q, mode)
                        assert d["results"][0]["path"] == want, (q, mode, d["results"])
                        assert d["total"] <= 5, (q, mode)  # not 29 of 29
                near = {p: related(p) for p in PERSONAL_NOTES}
                assert all(r["score"] >= floor["cosine"] for n in near.values() for r in n)
                assert "notes/plants.md" in [r["path"] for r in near["notes/garden.md"]]
                for alone in ("notes/dog.md", "notes/health.md", "notes/home/internet.md"):
                    assert near[alone] == [], alone
                assert sum(not n for n in near.values()) >= 10  # no longer 5 links each
        finally:
            model.shutdown()
            model.server_close()

    def test_a_folder_grant_sees_its_folder_only(self, tmp_path, embed_endpoint):
        write_notes(tmp_path, MEANING_NOTES)
        owner = {"X-Service-Key": make_state(tmp_path)["apiKey"]}
        with running(tmp_path, env=embed_env(embed_endpoint)) as server:
            self.wait_embedded(server, owner, 4)
            grant = {"name": "work", "scope": "read", "folder": "notes/work"}
            made = server.request("POST", f"{API}/auth/keys", grant, owner)[2]["data"]
            work = {"X-Service-Key": made["key"]}
            for mode in ("hybrid", "semantic"):
                paths = self.found(server, work, "car repair", mode)[2]
                assert paths == ["notes/work/car.md"] or set(paths) <= {
                    "notes/work/car.md",
                    "notes/work/budget.md",
                }
                assert "notes/garage.md" in self.found(server, owner, "car repair", mode)[2]
            url = note_url("notes/garage.md") + "/related"
            assert server.request("GET", url, None, work)[0] == 404
