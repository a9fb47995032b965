"""Three-way merges, names from titles, diffs (src/notesvc/notes/merge.py)."""

from __future__ import annotations

import datetime as dt
import re
import threading
import time

import pytest

from conftest import (
    API,
    assert_error,
    claim,
    data,
    feed,
    hits,
    new_grant,
    note_url,
    notesvc,
    pair,
    put_note,
    with_key,
)

MERGE_CASES = [
    # (what, base, current, edit, merged text or None for a conflict)
    ("disjoint", "a\nb\nc\nd\n", "A\nb\nc\nd\n", "a\nb\nc\nD\n", "A\nb\nc\nD\n"),
    ("adjacent lines", "a\nb\nc\n", "A\nb\nc\n", "a\nB\nc\n", "A\nB\nc\n"),
    ("the same line", "a\nb\nc\n", "a\nX\nc\n", "a\nY\nc\n", None),
    ("the same change twice", "a\nb\n", "a\nB\n", "a\nB\n", "a\nB\n"),
    ("a deletion and an edit elsewhere", "a\nb\nc\n", "a\nc\n", "a\nb\nC\n", "a\nC\n"),
    ("a deletion of what the edit changed", "a\nb\nc\n", "a\nc\n", "a\nB\nc\n", None),
    ("both append", "a\n", "a\nb\n", "a\nc\n", None),
    ("one appends, one prepends", "a\n", "a\nz\n", "0\na\n", "0\na\nz\n"),
    ("CRLF against LF", "a\nb\nc\n", "a\r\nb\r\nc\r\n", "a\nb\nC\n", "a\r\nb\r\nC\n"),
    ("no newline at the end", "a\nb", "a\nb\nc", "A\nb", "A\nb\nc"),
    # a note that ends without a newline keeps it so (issue 42): merge3 gives each side's
    # last line one to compare, and takes it back unless a side changed that ending
    ("different lines, no newline at the end", "a\nb\nc", "A\nb\nc", "a\nb\nC", "A\nb\nC"),
    ("the edit ends the note with a newline", "a\nb", "A\nb", "a\nb\n", "A\nb\n"),
    ("current ends it with a newline", "a\nb", "a\nb\n", "A\nb", "A\nb\n"),
    ("the edit drops the last CRLF", "a\r\nb\r\n", "A\r\nb\r\n", "a\r\nb", "A\r\nb"),
    ("an empty base", "", "x\n", "x\n", "x\n"),
    ("nothing changed", "a\n", "a\n", "a\n", "a\n"),
    ("an applied edit sent again", "a\nb\n", "a\nB\nc\n", "a\nb\nc\n", "a\nB\nc\n"),
]


class TestMerge:
    """POST /notes/:path/merge: an edit made from an older version, merged three ways."""

    @pytest.mark.parametrize(
        ("what", "base", "current", "edit", "merged"), MERGE_CASES, ids=[c[0] for c in MERGE_CASES]
    )
    def test_merge3(self, what, base, current, edit, merged):
        text, clash = notesvc.merge3(base, current, edit)
        if merged is None:
            assert clash
            assert text.replace("\r", "") != edit.replace("\r", "")  # current's side kept
        else:
            assert (text, clash) == (merged, False)

    def etag_after(self, client, path: str, content: str) -> str:
        return put_note(client, path, content).json["data"]["etag"]

    @pytest.mark.parametrize(
        ("what", "base", "current", "edit", "merged"),
        [c for c in MERGE_CASES if c[1]],
        ids=[c[0] for c in MERGE_CASES if c[1]],
    )
    @pytest.mark.slow
    def test_merge_over_http(self, client, root, what, base, current, edit, merged):
        url = note_url("notes/m.md")
        start = self.etag_after(client, "notes/m.md", base)
        client.put_json(url, {"content": current})
        resp = client.post_json(
            f"{url}/merge", {"base": start, "content": edit}, status=409 if merged is None else 200
        )
        if merged is None:
            err = assert_error(resp, 409, "CONFLICT")
            assert err["path"] == "notes/m.md"
            assert re.fullmatch(
                r"notes/m \(conflict owner \d{4}-\d\d-\d\d \d\d-\d\d\)\.md", err["conflictPath"]
            )
            assert (root / err["conflictPath"]).read_text() == edit  # the edit is safe
            assert (root / "notes" / "m.md").read_text() == current  # and nothing else changed
        else:
            got = data(resp)
            assert got["merged"] == (merged != edit or current != base)
            assert (root / "notes" / "m.md").read_bytes().decode() == merged
            assert resp.headers["ETag"] == got["note"]["etag"]

    def test_a_current_base_is_a_plain_write_and_a_merge_is_a_version(self, client):
        url = note_url("notes/m.md")
        base = self.etag_after(client, "notes/m.md", "a\nb\n")
        got = data(client.post_json(f"{url}/merge", {"base": base, "content": "a\nB\n"}))
        assert got["merged"] is False
        client.put_json(url, {"content": "A\nB\n"})
        got = data(
            client.post_json(f"{url}/merge", {"base": got["note"]["etag"], "content": "a\nB\nc\n"})
        )
        assert got == {**got, "merged": True}
        assert got["note"]["content"] == "A\nB\nc\n"
        reasons = [v["reason"] for v in data(client.get(f"{url}/versions"))["versions"]]
        assert reasons[0] == "merged"

    def test_a_base_from_another_note_or_gone_from_history_is_a_conflict(self, make_app, root):
        client = with_key(make_app(SERVICE_HISTORY_MAX_VERSIONS="0"))
        other = self.etag_after(client, "notes/other.md", "x\n")
        url = note_url("notes/m.md")
        self.etag_after(client, "notes/m.md", "a\n")
        client.put_json(url, {"content": "b\n"})
        for base in (other, '"' + "0" * 32 + '"'):
            resp = client.post_json(f"{url}/merge", {"base": base, "content": "c\n"}, status=409)
            copy = assert_error(resp, 409, "CONFLICT")["conflictPath"]
            assert (root / copy).read_text() == "c\n"
        assert (root / "notes" / "m.md").read_text() == "b\n"

    def test_an_unknown_base_with_the_text_already_there_is_no_conflict(self, client, root):
        url = note_url("notes/m.md")
        self.etag_after(client, "notes/m.md", "b\n")
        got = data(
            client.post_json(f"{url}/merge", {"base": '"' + "0" * 32 + '"', "content": "b\n"})
        )
        assert got["merged"] is False
        assert got["note"]["content"] == "b\n"
        assert sorted(p.name for p in (root / "notes").iterdir()) == ["m.md"]  # no copy

    def test_a_conflict_copy_of_a_note_with_a_long_name_fits_the_name_rule(self, client, root):
        name = "ä" * 120  # 240 bytes: no room left for " (conflict ...)" as it is
        url = note_url(f"notes/{name}.md")
        self.etag_after(client, f"notes/{name}.md", "a\n")
        client.put_json(url, {"content": "b\n"})
        resp = client.post_json(
            f"{url}/merge", {"base": '"' + "0" * 32 + '"', "content": "c\n"}, status=409
        )
        copy = assert_error(resp, 409, "CONFLICT")["conflictPath"]
        assert len(copy.rsplit("/", 1)[1].encode()) <= 255
        assert "(conflict owner" in copy
        assert (root / copy).read_text() == "c\n"

    def conflict(self, client, path: str, current: str, edit: str) -> dict:
        """Make `edit` clash with `current` on the note at path; return the 409's error."""
        start = self.etag_after(client, path, "x\n")
        client.put_json(note_url(path), {"content": current})
        resp = client.post_json(
            f"{note_url(path)}/merge", {"base": start, "content": edit}, status=409
        )
        return assert_error(resp, 409, "CONFLICT")

    def test_a_conflict_copy_is_named_in_the_servers_time_zone_by_the_device(self, make_app, root):
        zone = "Pacific/Kiritimati"  # UTC+14: never the same day and hour as UTC
        client = with_key(make_app(SERVICE_TIMEZONE=zone))
        phone = with_key(client, claim(client, pair(client)["secret"], name="Anna's phone")["key"])
        now = notesvc.local_time(time.time(), notesvc.time_zone(zone))
        copy = self.conflict(phone, "notes/m.md", "a\n", "b\n")["conflictPath"]
        stamps = {(now + dt.timedelta(minutes=m)).strftime("%Y-%m-%d %H-%M") for m in (0, 1)}
        assert copy in {f"notes/m (conflict Anna's phone {s}).md" for s in stamps}

    def test_the_change_feed_tells_every_device_a_copy_was_made(self, client, root):
        # the device whose edit won never sees the 409: the feed's `created` entry of the
        # copy names the note it is a copy of
        since = feed(client)["last"]
        copy = self.conflict(client, "notes/m.md", "a\n", "b\n")["conflictPath"]
        put_note(client, "notes/plain (conflict owner 2026-01-01 10-00).md", "only named so")
        created = [c for c in feed(client, since)["changes"] if c["kind"] == "created"]
        assert [(c["path"], c.get("conflictOf")) for c in created] == [
            ("notes/m.md", None),
            (copy, "notes/m.md"),
            ("notes/plain (conflict owner 2026-01-01 10-00).md", None),
        ]

    def test_a_conflict_copy_ranks_below_its_note_as_long_as_it_is_one(self, make_app, root):
        client = with_key(make_app())
        copy = self.conflict(client, "notes/m.md", "kiwi one\n", "kiwi kiwi two\n")
        copy = copy["conflictPath"]
        lookalike = "notes/n (conflict owner 2026-01-01 10-00).md"  # named like one: not one
        put_note(client, lookalike, "kiwi kiwi three\n")
        assert hits(client, "kiwi") == [lookalike, "notes/m.md", copy]
        assert hits(with_key(make_app()), "kiwi")[-1] == copy  # kept
        client.patch_json(f"{note_url(copy)}/move", {"path": "notes/kept.md"})  # adopted
        assert hits(client, "kiwi")[0] in ("notes/kept.md", lookalike)
        assert hits(client, "kiwi")[-1] == "notes/m.md"

    def test_an_edit_by_another_program_not_yet_rescanned_is_merged(self, client, root):
        # vim replaced the note on disk; the server still knows what was there (its copy)
        url = note_url("notes/m.md")
        base = self.etag_after(client, "notes/m.md", "a\nb\nc\nd\n")
        (root / "notes" / "m.md").write_text("A\nb\nc\nd\n")
        got = data(client.post_json(f"{url}/merge", {"base": base, "content": "a\nb\nc\nD\n"}))
        assert got["merged"] is True
        assert (root / "notes" / "m.md").read_text() == "A\nb\nc\nD\n"
        reasons = [v["reason"] for v in data(client.get(f"{url}/versions"))["versions"]]
        assert "merged" in reasons

    def test_two_devices_autosaving_at_once_lose_nothing(self, client, root):
        url = note_url("notes/m.md")
        lines = [f"line {i}\n" for i in range(20)]
        base = self.etag_after(client, "notes/m.md", "".join(lines))
        edits = []
        for k in range(2):  # each changes its own half
            mine = lines[:]
            for i in range(k * 10, k * 10 + 10):
                mine[i] = f"line {i} by device {k}\n"
            edits.append("".join(mine))
        results = []

        def save(edit):
            results.append(client.post_json(f"{url}/merge", {"base": base, "content": edit}).json)

        threads = [threading.Thread(target=save, args=(e,)) for e in edits]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        text = (root / "notes" / "m.md").read_text()
        assert all(f"line {i} by device {i // 10}" in text for i in range(20))
        assert not list((root / "notes").glob("m (conflict*"))

    def test_an_outbox_replayed_twice_does_nothing_twice(self, client, root):
        url = note_url("notes/m.md")
        base = self.etag_after(client, "notes/m.md", "a\nb\n")
        client.put_json(url, {"content": "a\nB\n"})
        once = {"Idempotency-Key": "outbox-7"}
        first = client.post_json(
            f"{url}/merge", {"base": base, "content": "a\nb\nc\n"}, headers=once
        )
        again = client.post_json(
            f"{url}/merge", {"base": base, "content": "a\nb\nc\n"}, headers=once
        )
        assert first.json == again.json
        assert (root / "notes" / "m.md").read_text() == "a\nB\nc\n"
        # without the key, a replay of an applied edit merges to the same text: no paragraph twice
        client.post_json(f"{url}/merge", {"base": base, "content": "a\nb\nc\n"})
        assert (root / "notes" / "m.md").read_text() == "a\nB\nc\n"
        made = {"Idempotency-Key": "outbox-8"}
        for _ in range(2):
            client.post_json(f"{API}/notes", {"content": "# Offline\n"}, headers=made, status=201)
        assert sorted(p.name for p in (root / "notes" / "inbox").iterdir()) == ["Offline.md"]
        bad = {"Idempotency-Key": "x" * 101}
        resp = client.post_json(f"{API}/notes", {"content": "# B\n"}, headers=bad, status=400)
        assert_error(resp, 400, "VALIDATION_ERROR")

    def test_one_key_sent_twice_at_once_is_done_once(self, client, root):
        # two tabs sending one outbox: the second waits for the first's answer
        once = {"Idempotency-Key": "outbox-9"}
        answers = []

        def create():
            resp = client.post_json(f"{API}/notes", {"content": "# Twice\n"}, headers=once)
            answers.append(resp.json)

        threads = [threading.Thread(target=create) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [p.name for p in (root / "notes" / "inbox").iterdir()] == ["Twice.md"]
        assert all(a == answers[0] for a in answers)

    @pytest.mark.parametrize(
        ("body", "status"),
        [
            ({"content": "x"}, 400),
            ({"base": 7, "content": "x"}, 400),
            ({"base": '"abc"', "content": 5}, 400),
            ({"base": "x" * 101, "content": "x"}, 400),
        ],
    )
    def test_bad_merges_are_refused(self, client, body, status):
        put_note(client, "notes/m.md", "a\n")
        resp = client.post_json(f"{note_url('notes/m.md')}/merge", body, status=status)
        assert_error(resp, status, "VALIDATION_ERROR")

    def test_a_merge_needs_the_note_and_write(self, client, anon):
        resp = client.post_json(
            f"{note_url('notes/none.md')}/merge", {"base": '"x"', "content": "x"}, status=404
        )
        assert_error(resp, 404, "NOT_FOUND")
        put_note(client, "notes/m.md", "a\n")
        reader = with_key(anon, new_grant(client, "read")["key"])
        reader.post_json(
            f"{note_url('notes/m.md')}/merge", {"base": '"x"', "content": "x"}, status=403
        )
