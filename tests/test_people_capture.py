"""Capture across reach (CONTRACT 31 x 29): a file's text joins a note's search entry only
when everyone who reaches the note reaches the file; clips and recordings go home."""

from __future__ import annotations

import shutil

import pytest

from conftest import API, data, put_note, search, upload, wait_for, with_key
from test_people import device_of
from test_providers_reader import settled, text_pdf

pytestmark = pytest.mark.skipif(
    not (shutil.which("pdftotext") and shutil.which("pdfinfo")),
    reason="poppler-utils is not installed",
)


def share(client, folder: str, person: dict, scope: str = "read") -> None:
    body = {"members": [{"person": person["id"], "scope": scope}]}
    client.put_json(f"{API}/folders/{folder.replace('/', '%2F')}/members", body)


class TestFileTextAcrossReach:
    def test_a_shared_note_linking_a_file_its_readers_cannot_reach_is_not_read_with_it(
        self, client, anon
    ):
        ann, as_ann = device_of(client, anon, "Ann")
        upload(
            client,
            "attachments/private/contract.pdf",
            text_pdf(["indemnity clause for the boathouse"]),
        )
        # one note in a folder Ann reaches, one the owner alone reaches, both linking it
        put_note(
            client,
            "notes/Family/plans.md",
            "# Plans\n\n[c](../../attachments/private/contract.pdf)\n",
        )
        put_note(
            client,
            "notes/private/mine.md",
            "# Mine\n\n[c](../../attachments/private/contract.pdf)\n",
        )
        share(client, "notes/Family", ann)
        settled(client, 1)
        owners = [r["path"] for r in search(client, "indemnity")["results"]]
        assert owners == ["notes/private/mine.md"]  # not the shared note: Ann can't read it
        assert search(as_ann, "indemnity")["total"] == 0

    def test_a_file_beside_the_shared_note_is_read_with_it_for_everyone(self, client, anon):
        ann, as_ann = device_of(client, anon, "Ann")
        upload(client, "attachments/Family/menu.pdf", text_pdf(["lasagne on sundays and fridays"]))
        put_note(client, "notes/Family/food.md", "# Food\n\n![[menu.pdf]]\n")
        share(client, "notes/Family", ann)
        settled(client, 1)
        assert [r["path"] for r in search(as_ann, "lasagne")["results"]] == ["notes/Family/food.md"]
        assert search(client, "lasagne")["total"] == 1

    def test_a_folder_grant_counts_too(self, client, anon):
        upload(client, "attachments/other/secret.pdf", text_pdf(["launch codes for the rocket"]))
        put_note(client, "notes/work/n.md", "[s](../../attachments/other/secret.pdf)")
        settled(client, 1)
        assert search(client, "launch")["total"] == 1
        client.post_json(f"{API}/auth/keys", {"name": "w", "scope": "read", "folder": "notes/work"})
        wait_for(lambda: search(client, "launch")["total"] == 0, timeout=5)

    def test_a_person_reaches_the_text_of_files_in_their_home(self, client, anon):
        _ann, as_ann = device_of(client, anon, "Ann")
        upload(as_ann, "attachments/Ann/receipt.pdf", text_pdf(["a receipt for the blue bicycle"]))
        put_note(as_ann, "notes/Ann/bike.md", "[r](../../attachments/Ann/receipt.pdf)")
        settled(as_ann, 1)
        assert [r["path"] for r in search(as_ann, "bicycle")["results"]] == ["notes/Ann/bike.md"]
        key = data(client.post_json(f"{API}/auth/keys", {"name": "x", "scope": "read"}))["key"]
        assert search(with_key(anon, key), "bicycle")["total"] == 1  # the owner's keys see all


class TestReaderLineAcrossReach:
    @pytest.mark.slow
    def test_the_reader_line_counts_the_files_a_person_reaches_and_names_none_else(
        self, client, anon
    ):
        _ann, as_ann = device_of(client, anon, "Ann")
        upload(client, "attachments/owner/divorce.pdf", b"%PDF-1.4 not really a pdf")
        upload(client, "attachments/owner/will.pdf", text_pdf(["the house goes to the cat"]))
        upload(as_ann, "attachments/Ann/receipt.pdf", text_pdf(["a receipt for the bicycle"]))
        owners = settled(client, 3)
        assert (owners["files"], owners["read"]) == (3, 3)
        assert any("divorce.pdf" in said for said in owners["said"])  # the owner sees all
        hers = data(as_ann.get(f"{API}/capture"))["attachmentText"]
        assert (hers["files"], hers["read"], hers["waiting"]) == (1, 1, 0)
        assert (hers["said"], hers["reading"], hers["lastRead"]) == ([], None, None)
        assert "divorce" not in str(hers)
        assert (hers["enabled"], hers["tools"]) == (True, owners["tools"])
