"""Import and export: every importer, the export zip, the command (src/notesvc/transfer/)."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import logging
import os
import shutil
import urllib.error
import urllib.parse
import urllib.request
import zlib
from pathlib import Path

import pytest

from browsers import BROWSER_TESTS, expect, unexpected
from conftest import (
    API,
    J_NOTE,
    JOPLIN_JEX,
    KEEP_TAKEOUT,
    PNG,
    TINY_PNG,
    all_files,
    as_key,
    assert_error,
    assert_nothing_imported,
    data,
    feed,
    import_file,
    keep_json,
    make_state,
    multipart,
    new_grant,
    notesvc,
    run_cli,
    running,
    search,
    tar_of,
    with_key,
    zip_of,
)


def raw_zip(members: list) -> bytes:
    """A zip written byte by byte, to say what zipfile would not: each member a dict of
    `name`, `data` (the bytes as stored), `method` (0 stored, 8 deflated), `crc`, `size`
    (the size declared), optionally `flags`, `local_name` (another name in the local header)
    or `at` (the index of an earlier member: this central-directory entry, the rest of its
    fields that member's, points at its local header; no local file of its own)."""
    import struct

    out, central, offsets = bytearray(), bytearray(), []
    for m in members:
        m = {**members[m["at"]], **m} if "at" in m else m
        name = m["name"].encode()
        data = m.get("data", b"")
        head = (m.get("flags", 0), m.get("method", 0), 0, 0x21, m["crc"], len(data), m["size"])
        if "at" in m:
            offset = offsets[m["at"]]
        else:
            offset = len(out)
            local = m.get("local_name", m["name"]).encode()
            out += struct.pack("<4sHHHHHLLLHH", b"PK\x03\x04", 20, *head, len(local), 0)
            out += local + data
        offsets.append(offset)
        central += struct.pack(
            "<4sHHHHHHLLLHHHHHLL", b"PK\x01\x02", 20, 20, *head, len(name), 0, 0, 0, 0, 0, offset
        )
        central += name
    end = struct.pack(
        "<4sHHHHLLH", b"PK\x05\x06", 0, 0, len(members), len(members), len(central), len(out), 0
    )
    return bytes(out + central + end)


def deflated(data: bytes) -> bytes:
    """Raw deflate, as a zip stores it."""
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    return packer.compress(data) + packer.flush()


def letters_zip(count: int, size: int) -> bytes:
    """`count` notes of `size` bytes of one letter each: a tiny upload, a huge import."""
    body = b"x" * size
    packed, crc = deflated(body), zlib.crc32(body)
    return raw_zip(
        [
            {"name": f"n{i:03}.md", "data": packed, "method": 8, "crc": crc, "size": size}
            for i in range(count)
        ]
    )


def enex_export() -> bytes:
    b64 = base64.b64encode(TINY_PNG).decode()
    wrapped = "\n".join(b64[i : i + 40] for i in range(0, len(b64), 40))
    return (
        ENEX_TEMPLATE.replace(
            "{md5}", hashlib.md5(TINY_PNG, usedforsecurity=False).hexdigest()
        ).replace("{b64}", wrapped)
    ).encode()


NOTION_ID = "0123456789abcdef0123456789abcdef"


NOTION_SUB = "fedcba9876543210fedcba9876543210"


NOTION_DB = "11112222333344445555666677778888"


NOTION_EXPORT = {
    f"Projects {NOTION_ID}.md": (
        "# Projects\n\nSee [Roadmap](Projects%20"
        f"{NOTION_ID}/Roadmap%20{NOTION_SUB}.md) and the "
        f"[tasks](Projects%20{NOTION_ID}/Tasks%20{NOTION_DB}.csv).\n\n"
        f"![diagram](Projects%20{NOTION_ID}/diagram.png)\n"
    ),
    f"Projects {NOTION_ID}/Roadmap {NOTION_SUB}.md": "# Roadmap\n\nQ1: ship\n",
    f"Projects {NOTION_ID}/diagram.png": TINY_PNG,
    f"Projects {NOTION_ID}/Tasks {NOTION_DB}.csv": (
        "\ufeffName,Status,Due\nWrite,Done,2024-01-02\nTest|it,Doing,\n"
    ),
    f"Projects {NOTION_ID}/Tasks {NOTION_DB}_all.csv": "Name,Status,Due\nWrite,Done,2024-01-02\n",
}


OBSIDIAN_VAULT = {
    ".obsidian/app.json": "{}",
    ".obsidian/workspace.json": "{}",
    "Daily/2024-01-01.md": "# Monday\n\nIdeas: [[Ideas]], [[Ideas|my ideas]] and ![[pic.png]]\n"
    "[rel](../Ideas.md)\n",
    "Ideas.md": "# Ideas\n\n- a garden\n",
    "assets/pic.png": TINY_PNG,
    "plain.txt": "just text\n",
    "tool.exe": b"MZ\x00\x00",
}


def note_text(root: Path, path: str) -> str:
    return (root / path).read_text("utf-8")


class TestImport:
    """POST /import: each source's notes as Markdown, never over anything, refusals first."""

    @pytest.mark.slow
    def test_keep_takeout(self, client, root):
        report = import_file(client, zip_of(KEEP_TAKEOUT), "takeout-20231105.zip")
        assert report["into"] == "notes/imported/keep"
        assert report["kind"] == "keep"
        assert (report["created"], report["attachments"], report["renamed"]) == (3, 1, 0)
        reasons = {s["source"]: s["reason"] for s in report["skipped"]}
        assert reasons["Takeout/Keep/Old.json"] == "in Keep's trash"
        assert reasons["Takeout/Keep/Broken.json"].startswith("not valid JSON")
        groceries = note_text(root, "notes/imported/keep/Groceries.md")
        assert groceries == (
            '---\ntags: ["Shopping"]\ncreated: "2023-07-22T04:26:40.000Z"\n'
            'updated: "2023-11-14T22:13:20.000Z"\npinned: true\ncolor: "yellow"\n'
            'source: "Google Keep"\n---\n# Groceries\n\n- [ ] Milk\n- [x] Eggs\n'
        )
        trip = note_text(root, "notes/imported/keep/Lisbon trip.md")
        assert "archived: true" in trip
        assert "Tram 28 early.\nPastéis de Belém!" in trip
        assert "![1a2b3c4d.png](../../../attachments/imported/keep/1a2b3c4d.png)" in trip
        assert "- [Tram 28](https://example.org/28)" in trip
        assert (root / "attachments/imported/keep/1a2b3c4d.png").read_bytes() == TINY_PNG
        assert note_text(root, "notes/imported/keep/Call the plumber.md").endswith(
            "---\nCall the plumber\n"
        )
        assert search(client, "plumber")["results"][0]["path"].endswith("Call the plumber.md")
        kinds = [c["kind"] for c in feed(client)["changes"]]
        assert kinds.count("created") == 3

    @pytest.mark.slow
    def test_a_keep_picture_the_takeout_lacks_is_named_and_never_a_dangling_link(
        self, client, root
    ):
        takeout = {
            "Takeout/Keep/Beach.json": keep_json(
                title="Beach",
                textContent="Sand!",
                attachments=[
                    {"filePath": "beach.jpg", "mimetype": "image/jpeg"},
                    {"filePath": "sunset.jpeg", "mimetype": "image/jpeg"},  # the zip: .jpg
                    {"filePath": "waves.3gp", "mimetype": "audio/3gpp"},
                ],
            ),
            "Takeout/Keep/sunset.jpg": TINY_PNG,
        }
        body = zip_of(takeout)
        dry = import_file(client, body, "takeout.zip", status=200, dryRun=True)
        assert dry["missing"] == 2
        assert dry["skipped"] == [
            {
                "source": "beach.jpg",
                "reason": (
                    "picture beach.jpg named by Takeout/Keep/Beach.json is not in the archive"
                ),
            },
            {
                "source": "waves.3gp",
                "reason": "file waves.3gp named by Takeout/Keep/Beach.json is not in the archive",
            },
        ]
        real = import_file(client, body, "takeout.zip")
        assert {**dry, "dryRun": False} == real
        text = note_text(root, "notes/imported/keep/Beach.md")
        assert text.endswith(
            "# Beach\n\nSand!\n\n(picture missing from the export: beach.jpg)\n\n"
            "![sunset.jpg](../../../attachments/imported/keep/sunset.jpg)\n\n"
            "(file missing from the export: waves.3gp)\n"
        )
        assert "](beach.jpg)" not in text
        ok = import_file(client, zip_of(KEEP_TAKEOUT), "takeout.zip", status=200, dryRun=True)
        assert (ok["missing"], len(ok["skipped"])) == (0, 2)  # the trashed and the broken note

    @pytest.mark.slow
    def test_a_dry_run_reports_the_same_and_writes_nothing(self, client, root):
        body = zip_of(KEEP_TAKEOUT)
        dry = import_file(client, body, "takeout.zip", status=200, dryRun=True)
        assert dry["dryRun"] is True
        assert not (root / "notes/imported").exists()
        assert not (root / "attachments/imported").exists()
        assert feed(client)["changes"] == []
        real = import_file(client, body, "takeout.zip")
        assert {**dry, "dryRun": False} == real

    @pytest.mark.slow
    def test_never_overwrites_a_taken_name(self, client, root):
        client.post_json(
            f"{API}/notes", {"path": "notes/imported/keep/Groceries.md", "content": "mine\n"}
        )
        report = import_file(client, zip_of(KEEP_TAKEOUT), "takeout.zip")
        assert report["renamed"] == 1
        assert note_text(root, "notes/imported/keep/Groceries.md") == "mine\n"
        assert "- [x] Eggs" in note_text(root, "notes/imported/keep/Groceries 2.md")
        again = import_file(client, zip_of(KEEP_TAKEOUT), "takeout.zip")
        assert again["renamed"] == 4  # three notes and the picture, each once more
        assert (root / "attachments/imported/keep/1a2b3c4d 2.png").read_bytes() == TINY_PNG
        trip = note_text(root, "notes/imported/keep/Lisbon trip 2.md")
        assert "(../../../attachments/imported/keep/1a2b3c4d%202.png)" in trip

    @pytest.mark.slow
    def test_evernote_enex(self, client, root):
        report = import_file(client, enex_export(), "My Notes.enex", into="notes/from evernote")
        assert (report["created"], report["attachments"], report["kind"]) == (2, 1, "evernote")
        text = note_text(root, "notes/from evernote/Recipe & notes 2.md")
        assert text.startswith(
            '---\ntags: ["cooking", "family"]\ncreated: "2020-01-02T03:04:05.000Z"\n'
            'updated: "2023-11-04T10:10:10.000Z"\nsource_url: "https://example.org/pie"\n'
            'author: "Ann"\nsource: "Evernote"\n---\n# Recipe & notes 2\n\n## Apple pie\n'
        )
        assert "**Bake** at 180°C, see [the site](https://example.org/pie)." in text
        assert "- [x] Buy apples\n- [ ] Buy butter\n" in text
        assert "- flour\n- sugar\n" in text
        assert "| Step | Minutes |\n| --- | --- |\n| Bake | 45 |" in text
        assert "![pie.png](../../attachments/from%20evernote/pie.png)" in text
        assert "```\nx = 1\ny = 2\n```" in text
        assert (root / "attachments/from evernote/pie.png").read_bytes() == TINY_PNG
        assert note_text(root, "notes/from evernote/Second.md").endswith("# Second\n\nJust text\n")

    def test_evernote_10_checklists_come_in_as_tasks_with_their_ticks(self, client, root, caplog):
        caplog.set_level(logging.INFO, logger="notesvc")
        report = import_file(client, EVERNOTE_10_ENEX.encode(), "Packing.enex")
        assert "import of 1 note and 0 files into notes/imported/evernote" in caplog.text
        assert (report["created"], report["skipped"]) == (1, [])
        text = note_text(root, "notes/imported/evernote/Packing.md")
        assert text.split("---\n", 2)[2] == (
            "# Packing\n\n"
            "Before the trip:\n"
            "- [x] Passport\n"
            "- [ ] Charger\n"
            "   - [x] USB-C cable\n"
            "   - [ ] Plug for the UK\n"
            "- [ ] Sun cream\n"
            "Shops:\n"
            "- Chemist\n"
            "   - aspirin\n"
            "1. Pack\n"
            "2. Go\n"
            "- [x] Old style\n"
        )

    @pytest.mark.slow
    def test_enex_entities_and_dtds(self, client, root):
        bomb = (
            '<?xml version="1.0"?><!DOCTYPE en-export [<!ENTITY a "aaaaaaaaaa">'
            '<!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;">]><en-export><note><title>&b;</title>'
            "<content><![CDATA[<en-note>x</en-note>]]></content></note></en-export>"
        )
        resp = import_file(client, bomb.encode(), "bomb.enex", status=400)
        assert "DTD" in resp["error"]["message"]
        assert "nothing was imported" in resp["error"]["message"]
        external = (
            '<?xml version="1.0"?><!DOCTYPE en-export SYSTEM "http://127.0.0.1:9/x.dtd">'
            "<en-export><note><title>caf&eacute; &unknownthing;</title><content><![CDATA["
            "<en-note>&lt;b&gt; &hearts;</en-note>]]></content></note></en-export>"
        )
        report = import_file(client, external.encode(), "ext.enex")
        assert report["created"] == 1
        assert "café" in note_text(root, "notes/imported/evernote/café.md")
        broken = b'<?xml version="1.0"?><en-export><note><title>x</title></en-export'
        resp = import_file(client, broken, "broken.enex", status=400)
        assert "not well-formed" in resp["error"]["message"]
        assert not (root / "notes/imported/evernote/x.md").exists()

    def test_notion_export(self, client, root):
        report = import_file(client, zip_of(NOTION_EXPORT), "Export-1234.zip")
        assert report["kind"] == "notion"
        assert (report["created"], report["attachments"]) == (3, 1)
        base = "notes/imported/notion"
        projects = note_text(root, f"{base}/Projects.md")
        assert "[Roadmap](Projects/Roadmap.md)" in projects
        assert "[tasks](Projects/Tasks.md)" in projects
        assert "![diagram](../../../attachments/imported/notion/Projects/diagram.png)" in projects
        assert note_text(root, f"{base}/Projects/Tasks.md") == (
            "# Tasks\n\n| Name | Status | Due |\n| --- | --- | --- |\n"
            "| Write | Done | 2024-01-02 |\n| Test\\|it | Doing |  |\n"
        )
        assert not (root / f"{base}/Projects/Tasks_all.md").exists()

    @pytest.mark.slow
    def test_obsidian_vault(self, client, root):
        client.post_json(
            f"{API}/notes", {"path": "notes/imported/obsidian/Ideas.md", "content": "x\n"}
        )
        report = import_file(client, zip_of(OBSIDIAN_VAULT), "vault.zip")
        assert report["kind"] == "obsidian"
        assert report["renamed"] == 1
        assert (report["created"], report["attachments"]) == (3, 1)
        assert {s["source"] for s in report["skipped"]} == {"tool.exe"}
        base = "notes/imported/obsidian"
        daily = note_text(root, f"{base}/Daily/2024-01-01.md")
        assert "[[Ideas 2|Ideas]], [[Ideas 2|my ideas]] and ![[pic.png]]" in daily
        assert "[rel](../Ideas%202.md)" in daily
        assert note_text(root, f"{base}/Ideas 2.md") == "# Ideas\n\n- a garden\n"
        assert note_text(root, f"{base}/plain.md") == "just text\n"
        assert (root / "attachments/imported/obsidian/assets/pic.png").read_bytes() == TINY_PNG

    @pytest.mark.slow
    def test_joplin_jex(self, client, root):
        report = import_file(client, tar_of(JOPLIN_JEX), "export.jex")
        assert report["kind"] == "joplin"
        assert (report["created"], report["attachments"], report["skipped"]) == (2, 1, [])
        meeting = note_text(root, "notes/imported/joplin/Work/Meeting.md")
        assert 'tags: ["urgent"]' in meeting
        assert 'created: "2022-03-04T05:06:07.000Z"' in meeting
        assert (
            "# Meeting\n\nAgenda\n\n![chart](../../../../attachments/imported/joplin/chart.png)"
            in meeting
        )
        todo = note_text(root, "notes/imported/joplin/File taxes.md")
        assert "- [x] File taxes" in todo

    def test_names_that_are_not_paths(self, client, root):
        files = {
            "CON.md": "reserved\n",
            "a\x07b?.md": "control\n",
            ("x" * 300) + ".md": "long\n",
            "same.md": "one\n",
            "Same.md": "two\n",
        }
        report = import_file(client, zip_of(files), "files.zip", into="notes/odd")
        assert report["kind"] == "files"
        assert report["created"] == 5
        names = sorted(p.name for p in (root / "notes/odd").iterdir())
        assert "CON_.md" in names
        assert "a b.md" in names
        assert "same.md" in names
        assert "Same 2.md" in names  # one name on a case-blind disk (Finder, Windows)
        assert any(len(n.encode()) <= 255 and n.startswith("xxxx") for n in names)

    @pytest.mark.slow
    def test_a_notesvc_export_comes_back_byte_for_byte(self, client, root, make_app, tmp_path):
        client.post_json(f"{API}/notes", {"path": "notes/a/b.md", "content": "# B\r\n\r\ncrlf\r\n"})
        client.post_json(f"{API}/notes", {"path": "notes/ünï/ç.md", "content": "\ufeffbom\n"})
        client.put(f"{API}/attachments/attachments/pics/p.png", TINY_PNG, content_type="image/png")
        (root / "notes/a/side.png").write_bytes(TINY_PNG)
        (root / "notes/.hidden.md").write_text("secret\n")
        resp = client.get(f"{API}/export.zip")
        assert resp.content_type == "application/zip"
        assert "attachment" in resp.headers["Content-Disposition"]
        import zipfile

        zf = zipfile.ZipFile(io.BytesIO(resp.body))
        names = zf.namelist()
        assert "notesvc-export.json" in names
        assert "notes/.hidden.md" not in names
        manifest = json.loads(zf.read("notesvc-export.json"))
        assert (manifest["notes"], manifest["files"]) == (2, 2)
        other = with_key(make_app(tmp_path / "other"))
        report = import_file(other, resp.body, "export.zip")
        assert report["kind"] == "notesvc"
        assert report["renamed"] == 0
        before = {k: v for k, v in all_files(root).items()}
        assert all_files(tmp_path / "other") == before

    @pytest.mark.slow
    def test_a_folder_grant_imports_and_exports_its_folder_only(self, client, anon, root):
        client.post_json(f"{API}/notes", {"path": "notes/other/x.md", "content": "not yours\n"})
        rec = new_grant(client, "write", "notes/family")
        family = as_key(anon, rec["key"])
        report = import_file(family, zip_of(KEEP_TAKEOUT), "takeout.zip")
        assert report["into"] == "notes/family/imported/keep"
        assert (root / "attachments/family/imported/keep/1a2b3c4d.png").is_file()
        resp = import_file(family, zip_of(KEEP_TAKEOUT), "t.zip", status=404, into="notes/other")
        assert resp["error"]["code"] == "NOT_FOUND"
        import zipfile

        exported = zipfile.ZipFile(io.BytesIO(family.get(f"{API}/export.zip").body)).namelist()
        assert "notes/other/x.md" not in exported
        assert "notes/family/imported/keep/Groceries.md" in exported
        # a notesvc export with notes outside the folder: those are skipped
        everything = client.get(f"{API}/export.zip").body
        report = import_file(family, everything, "all.zip")
        assert "notes/other/x.md" in {s["source"] for s in report["skipped"]}
        reader = as_key(anon, new_grant(client, "read")["key"])
        import_file(reader, zip_of(KEEP_TAKEOUT), "t.zip", status=403)

    @pytest.mark.parametrize(
        "name",
        ["../evil.md", "/etc/evil.md", "C:/evil.md", "a/../../evil.md", "..\\evil.md"],
    )
    @pytest.mark.slow
    def test_zip_slip_is_refused_whole(self, client, root, name):
        body = zip_of({"good.md": "fine\n", name: "evil\n"})
        resp = import_file(client, body, "slip.zip", status=400)
        assert "outside itself" in resp["error"]["message"]
        assert not (root / "notes/imported").exists()
        assert not (root.parent / "evil.md").exists()

    @pytest.mark.slow
    def test_links_in_archives_are_refused(self, client, root):
        resp = import_file(
            client, zip_of({"a.md": "x\n"}, {"link.md": "/etc/passwd"}), "l.zip", status=400
        )
        assert "symbolic link" in resp["error"]["message"]
        resp = import_file(
            client, tar_of(JOPLIN_JEX, {"evil.md": "/etc/passwd"}), "l.jex", status=400
        )
        assert "link" in resp["error"]["message"]
        assert not (root / "notes/imported").exists()

    @pytest.mark.slow
    def test_zip_bombs_are_refused(self, client, make_app, tmp_path):
        bomb = zip_of({"a.md": "fine\n", "zeros.md": b"\0" * (8 << 20)})
        resp = import_file(client, bomb, "bomb.zip", status=413)
        assert "100 times" in resp["error"]["message"]
        small = with_key(make_app(SERVICE_MAX_IMPORT_EXPANDED_BYTES="4096"))
        body = zip_of({f"n{i}.md": os.urandom(1000).hex() for i in range(5)})
        resp = import_file(small, body, "big.zip", status=413)
        assert "SERVICE_MAX_IMPORT_EXPANDED_BYTES" in resp["error"]["message"]

    # S3 / S4 of the third attack (issue 40): an archive is bounded as a whole, and an entry
    # that cannot be read is 400, never 500; a refusal writes nothing, dry run or not.

    @pytest.mark.slow
    def test_entries_sharing_one_local_file_are_refused(self, client, root):
        body = ("a note of ordinary length\n" * 80).encode()
        one = {"name": "a.md", "data": body, "crc": zlib.crc32(body), "size": len(body)}
        bomb = raw_zip([one] + [{"name": "a.md", "at": 0}] * 49)
        assert len(body) < 1 << 20  # no ratio trips: only the sharing refuses it
        assert 50 * len(body) < 100 * len(bomb)
        for dry in (True, False):
            resp = import_file(client, bomb, "bomb.zip", status=413, dryRun=dry)
            assert resp["error"]["code"] == "PAYLOAD_TOO_LARGE"
            assert "share their bytes" in resp["error"]["message"]
        assert_nothing_imported(client, root)

    @pytest.mark.slow
    def test_many_small_entries_of_one_letter_are_refused_whole(self, client, root):
        bomb = letters_zip(300, 900 << 10)  # 300 KB expanding to 270 MB; no entry over 1 MiB
        for dry in (True, False):
            resp = import_file(client, bomb, "letters.zip", status=413, dryRun=dry)
            assert resp["error"]["code"] == "PAYLOAD_TOO_LARGE"
            assert "more than 100 times its" in resp["error"]["message"]
        resp = client.post(f"{API}/import", bomb, content_type="application/zip", status=413)
        assert "zip bomb" in resp.json["error"]["message"]
        assert_nothing_imported(client, root)
        fine = letters_zip(3, 300 << 10)  # under a mebibyte in all: imported
        assert import_file(client, fine, "fine.zip")["created"] == 3

    @pytest.mark.slow
    def test_a_header_that_lies_about_the_size_is_refused(self, client, root):
        real = b"a" * (4 << 20)
        lie = {"name": "big.md", "data": deflated(real), "method": 8, "size": 100}
        lie["crc"] = zlib.crc32(real[:100])  # what zipfile checks after reading 100 bytes
        ok = {"name": "ok.md", "data": b"fine\n", "crc": zlib.crc32(b"fine\n"), "size": 5}
        bomb = raw_zip([ok, lie])
        for dry in (True, False):
            resp = import_file(client, bomb, "lie.zip", status=413, dryRun=dry)
            assert "more than the 100 bytes its header declares" in resp["error"]["message"]
        assert_nothing_imported(client, root)

    @pytest.mark.parametrize(
        "member",
        [
            {"local_name": "b.md"},  # S4: the central directory and the local header differ
            {"crc": 1},  # a bad CRC
            {"method": 8, "data": b"\xff\xff not deflate"},  # zlib.error
            {"method": 99},  # NotImplementedError: a method zipfile does not know
            {"flags": 1},  # RuntimeError: encrypted
            {"method": 8, "data": deflated(b"fine\n")[:2]},  # truncated: EOFError
        ],
        ids=["name", "crc", "deflate", "method", "encrypted", "truncated"],
    )
    @pytest.mark.slow
    def test_an_unreadable_entry_is_400_not_500(self, client, root, member):
        body = b"fine\n"
        good = {"name": "a.md", "data": body, "crc": zlib.crc32(body), "size": len(body)}
        first = {"name": "first.md", "data": body, "crc": zlib.crc32(body), "size": len(body)}
        broken = raw_zip([first, {**good, **member}])
        for dry in (True, False):
            resp = client.post(
                f"{API}/import?dryRun={str(dry).lower()}",
                broken,
                content_type="application/zip",
                status=400,
            )
            err = assert_error(resp, 400, "VALIDATION_ERROR")
            assert err["message"].startswith("nothing was imported: the file is not a readable zip")
        assert_nothing_imported(client, root)

    @pytest.mark.slow
    def test_jex_tars_are_bounded_as_a_whole(self, client, root):
        import tarfile

        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tf:  # 60 KB expanding to 50 MiB
            for i in range(50):
                info = tarfile.TarInfo(f"{i:032x}.md")
                info.size = 1 << 20
                tf.addfile(info, io.BytesIO(b"x" * info.size))
        resp = import_file(client, buf.getvalue(), "big.jex", status=413, dryRun=True)
        assert "more than 100 times its" in resp["error"]["message"]
        import_file(client, buf.getvalue(), "big.jex", status=413)
        huge = io.BytesIO()  # a header declaring 16 GiB, and nothing behind it
        with tarfile.open(fileobj=huge, mode="w", format=tarfile.GNU_FORMAT) as tf:
            info = tarfile.TarInfo(f"{J_NOTE}.md")
            info.size = 16 << 30
            tf.addfile(info)
        resp = import_file(client, huge.getvalue(), "huge.jex", status=413)
        assert "SERVICE_MAX_IMPORT_EXPANDED_BYTES" in resp["error"]["message"]
        cut = tar_of(JOPLIN_JEX)  # a member's data cut short: not readable, 400
        cut = cut[: cut.index(b"IHDR")]
        resp = import_file(client, cut, "cut.jex", status=400)
        assert "not a readable tar" in resp["error"]["message"]
        assert_nothing_imported(client, root)

    @pytest.mark.slow
    def test_a_directory_pointing_before_the_archive_is_400(self, client, root):
        """A central directory whose recorded offset lies past where it is makes zipfile
        place every local header before the file's start (a negative offset): 400."""
        import struct

        body = b"fine\n"
        good = raw_zip([{"name": "a.md", "data": body, "crc": zlib.crc32(body), "size": 5}])
        end = good.rindex(b"PK\x05\x06")
        at = struct.unpack("<L", good[end + 16 : end + 20])[0]
        broken = good[: end + 16] + struct.pack("<L", at + 50) + good[end + 20 :]
        for dry in (True, False):
            resp = client.post(
                f"{API}/import?dryRun={str(dry).lower()}",
                broken,
                content_type="application/zip",
                status=400,
            )
            err = assert_error(resp, 400, "VALIDATION_ERROR")
            assert err["message"].startswith("nothing was imported: the file is not a readable zip")
        assert_nothing_imported(client, root)

    @pytest.mark.parametrize("pack", ["gz", "bz2", "xz"])
    @pytest.mark.slow
    def test_a_compressed_tars_headers_are_bounded_too(self, client, root, pack):
        """A pax header (or a GNU long name) is read whole into memory: in a compressed
        tar, 40 MiB of one letter packs into a few hundred bytes. The tar as it unpacks is
        bounded like its members, before the header is read."""
        import tarfile

        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode=f"w:{pack}", format=tarfile.PAX_FORMAT) as tf:
            info = tarfile.TarInfo(f"{J_NOTE}.md")
            info.pax_headers = {"comment": "z" * (40 << 20)}
            info.size = 5
            tf.addfile(info, io.BytesIO(b"fine\n"))
        bomb = buf.getvalue()
        assert len(bomb) < 200 << 10
        for dry in (True, False):
            resp = import_file(client, bomb, "bomb.jex", status=413, dryRun=dry)
            assert resp["error"]["code"] == "PAYLOAD_TOO_LARGE"
            assert "more than 100 times its" in resp["error"]["message"]
        assert_nothing_imported(client, root)

    @pytest.mark.slow
    def test_an_import_leaving_the_disk_under_its_margin_is_507(self, make_app, root, monkeypatch):
        import collections

        usage = collections.namedtuple("usage", "total used free")
        mib, gib = 1 << 20, 1 << 30
        disk = [usage(100 * gib, 100 * gib - 150 * mib, 150 * mib)]
        monkeypatch.setattr(shutil, "disk_usage", lambda path: disk[0])
        assert notesvc.load_config(env={}).import_min_free_bytes == 200 * mib
        client = with_key(make_app(SERVICE_IMPORT_MIN_FREE_BYTES=str(200 * mib)))
        body = zip_of({"a.md": "a\n"})
        for dry in (True, False):  # 150 MiB free: under 200 MiB (and 5 % of 100 GiB)
            resp = import_file(client, body, "a.zip", status=507, dryRun=dry)
            err = resp["error"]
            assert err["code"] == "INSUFFICIENT_STORAGE"
            assert "SERVICE_IMPORT_MIN_FREE_BYTES" in err["message"]
        resp = client.post(
            f"{API}/import", enex_export(), content_type="application/xml", status=507
        )
        assert_error(resp, 507, "INSUFFICIENT_STORAGE")
        assert_nothing_imported(client, root)
        lower = with_key(make_app(SERVICE_IMPORT_MIN_FREE_BYTES=str(100 * mib)))
        assert import_file(lower, body, "a.zip")["created"] == 1  # 150 MiB leave 100 MiB
        small = [usage(gib, gib - 50 * mib, 50 * mib)]  # a 1 GiB disk: 5 % of it is the margin
        disk[:] = small
        huge = with_key(make_app(SERVICE_IMPORT_MIN_FREE_BYTES=str(10**18)))
        resp = import_file(huge, body, "a.zip", status=507)
        assert "leave less than 53687091 bytes free" in resp["error"]["message"]
        disk[:] = [usage(gib, gib - 60 * mib, 60 * mib)]
        assert import_file(huge, body, "b.zip", into="notes/b")["created"] == 1

    @pytest.mark.slow
    def test_an_upload_over_the_limit(self, make_app):
        small = with_key(make_app(SERVICE_MAX_IMPORT_BYTES="2048"))
        resp = import_file(small, os.urandom(4096), "x.zip", status=413)
        assert resp["error"]["code"] == "PAYLOAD_TOO_LARGE"
        resp = small.post(
            f"{API}/import", os.urandom(4096), content_type="application/zip", status=413
        )
        assert "SERVICE_MAX_IMPORT_BYTES" in resp.json["error"]["message"]

    @pytest.mark.slow
    def test_bad_input(self, client, root):
        assert import_file(client, b"hello", "x.exe", status=415)["error"]["code"] == (
            "UNSUPPORTED_MEDIA_TYPE"
        )
        resp = client.post(f"{API}/import", b"x", content_type="image/png", status=415)
        assert_error(resp, 415, "UNSUPPORTED_MEDIA_TYPE")
        resp = import_file(client, b"PK\x03\x04broken", "x.zip", status=400)
        assert "not a readable zip" in resp["error"]["message"]
        form, ctype = multipart(("into", "notes/x"))
        resp = client.request(
            f"{API}/import", method="POST", body=form, headers={"Content-Type": ctype}, status=400
        )
        assert "file" in resp.json["error"]["message"]
        resp = import_file(client, zip_of({"a.md": "x"}), "a.zip", status=400, dryRun="maybe")
        assert "dryRun" in resp["error"]["message"]
        resp = import_file(client, zip_of({"a.md": "x"}), "a.zip", status=400, into="notes/../x")
        resp = client.post(
            f"{API}/import?into=notes/raw",
            zip_of({"r.md": "raw\n"}),
            content_type="application/zip",
            status=201,
        )
        assert data(resp)["into"] == "notes/raw"
        assert (root / "notes/raw/r.md").read_text() == "raw\n"
        resp = client.post(
            f"{API}/import", enex_export(), content_type="application/xml", status=201
        )
        assert data(resp)["kind"] == "evernote"
        resp = client.post(
            f"{API}/import", tar_of(JOPLIN_JEX), content_type="application/x-tar", status=201
        )
        assert data(resp)["kind"] == "joplin"


# Evernote 10 writes a checklist as a list styled `--en-todo:true`, each item ticked or not by
# its own style, its text in a <div> (and the older <en-todo> still turns up in old notes)
EVERNOTE_10_ENEX = """<?xml version="1.0" encoding="UTF-8"?>
<!DOCTYPE en-export SYSTEM "http://xml.evernote.com/pub/evernote-export4.dtd">
<en-export export-date="20240301T101010Z" application="Evernote" version="10.72.4">
  <note>
    <title>Packing</title>
    <created>20240301T090000Z</created>
    <updated>20240301T100000Z</updated>
    <note-attributes></note-attributes>
    <content><![CDATA[<?xml version="1.0" encoding="UTF-8" standalone="no"?>
<!DOCTYPE en-note SYSTEM "http://xml.evernote.com/pub/enml2.dtd">\
<en-note><div>Before the trip:</div>\
<ul style="--en-todo:true;"><li style="--en-checked:true;"><div>Passport</div></li>\
<li style="--en-checked:false;"><div>Charger</div><ul style="--en-todo: true;">\
<li style="--en-checked: true;"><div>USB-C cable</div></li>\
<li style="--en-checked:false;"><div>Plug for the UK</div></li></ul></li>\
<li style="--en-checked:false;"><div>Sun cream</div></li></ul>\
<div>Shops:</div><ul><li><div>Chemist</div><ul><li><div>aspirin</div></li></ul></li></ul>\
<ol><li><div>Pack</div></li><li><div>Go</div></li></ol>\
<div><en-todo checked="true"/>Old style</div></en-note>      ]]>
    </content>
  </note>
</en-export>
"""


ENEX_TEMPLATE = """<?xml version="1.0" encoding="UTF-8"?>
<!DOCTYPE en-export SYSTEM "http://xml.evernote.com/pub/evernote-export4.dtd">
<en-export export-date="20231105T101010Z" application="Evernote" version="10.63.2">
  <note>
    <title>Recipe &amp; notes&nbsp;2</title>
    <created>20200102T030405Z</created>
    <updated>20231104T101010Z</updated>
    <tag>cooking</tag><tag>family</tag>
    <note-attributes><author>Ann</author><source-url>https://example.org/pie</source-url></note-attributes>
    <content><![CDATA[<?xml version="1.0" encoding="UTF-8"?>
<!DOCTYPE en-note SYSTEM "http://xml.evernote.com/pub/enml2.dtd">
<en-note><h2>Apple pie</h2><div><b>Bake</b> at 180&deg;C, see
<a href="https://example.org/pie">the site</a>.</div>
<div><en-todo checked="true"/>Buy apples</div><div><en-todo checked="false"/>Buy butter</div>
<ul><li>flour</li><li>sugar</li></ul>
<table><tr><td>Step</td><td>Minutes</td></tr><tr><td>Bake</td><td>45</td></tr></table>
<div><en-media hash="{md5}" type="image/png"/></div>
<div style="-en-codeblock:true"><div>x = 1</div><div>y = 2</div></div>
</en-note>]]></content>
    <resource>
      <data encoding="base64">
{b64}
      </data>
      <mime>image/png</mime>
      <resource-attributes><file-name>pie.png</file-name></resource-attributes>
    </resource>
  </note>
  <note>
    <title>Second</title>
    <created>20210101T000000Z</created>
    <content><![CDATA[<en-note><div>Just text</div></en-note>]]></content>
  </note>
</en-export>
"""


class TestImportMessages:
    """What the import and export commands print: one note, two notes."""

    def test_counts_of_one_are_singular(self, tmp_path, capsys):
        assert [notesvc.plural(n, "note") for n in (0, 1, 2)] == ["0 notes", "1 note", "2 notes"]
        report = {"created": 1, "attachments": 1, "renamed": 0, "skipped": [], "missing": 0}
        notesvc.print_import_report({**report, "into": "notes/x", "kind": "keep", "dryRun": True})
        out = capsys.readouterr().out
        assert out.startswith("Dry run: would create 1 note and 1 file in notes/x (from keep);")
        notesvc.print_import_report(
            {**report, "created": 2, "missing": 1, "into": "n", "kind": "keep", "dryRun": False}
        )
        out = capsys.readouterr().out
        assert out.startswith("created 2 notes and 1 file in n")
        assert "(1 file named but not in the source)" in out
        make_state(tmp_path)
        (tmp_path / "notes").mkdir(exist_ok=True)
        (tmp_path / "notes/only.md").write_text("# Only\n")
        assert notesvc.main(["export", str(tmp_path / "all.zip"), "--root", str(tmp_path)]) == 0
        assert capsys.readouterr().out.startswith("Exported 1 note and 0 files to ")


def test_a_folder_for_a_running_server_is_zipped_without_hidden_files_or_links(tmp_path):
    import zipfile

    folder = tmp_path / "vault"
    files = {
        "a.md": b"# A",
        "sub/b.md": b"# B",
        "sub/deeper/c.png": PNG,
        ".obsidian/app.json": b"{}",
        ".git/config": b"[core]",
        "sub/.DS_Store": b"x",
        ".hidden/d.md": b"# D",
    }
    for rel, body in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(body)
    (folder / "empty").mkdir()
    (folder / "link.md").symlink_to(folder / "a.md")
    (folder / "linked").symlink_to(folder / "sub", target_is_directory=True)
    ticks: list = []
    out = io.BytesIO()
    notesvc._zip_folder(folder, out, lambda line: ticks.append(line()))
    with zipfile.ZipFile(out) as zf:
        infos = zf.infolist()
        assert [i.filename for i in infos] == [
            ".obsidian/app.json",
            "a.md",
            "sub/b.md",
            "sub/deeper/c.png",
        ]
        assert all(i.compress_type == zipfile.ZIP_STORED for i in infos)
        assert {i.filename: zf.read(i) for i in infos} == {
            name: files[name]
            for name in (".obsidian/app.json", "a.md", "sub/b.md", "sub/deeper/c.png")
        }
    assert ticks == [f"  packing {i.filename}..." for i in infos]


@pytest.mark.real_server
@pytest.mark.slow
class TestImportCommand:
    """`notesvc import` / `export`: on their own, and handing the import to a running server."""

    def test_on_its_own_the_dry_run_and_the_real_run_agree(self, tmp_path):
        vault = tmp_path / "vault"
        for name, body in OBSIDIAN_VAULT.items():
            (vault / name).parent.mkdir(parents=True, exist_ok=True)
            (vault / name).write_bytes(body if isinstance(body, bytes) else body.encode())
        (vault / "link.md").symlink_to("/etc/passwd")
        root = tmp_path / "root"
        dry = run_cli("import", str(vault), "--root", str(root), "--dry-run")
        assert dry.returncode == 0, dry.stderr
        assert "Dry run: would create 3 notes and 1 file in notes/imported/obsidian" in dry.stdout
        assert "skipped link.md: a symbolic link (not followed)" in dry.stdout
        assert not (root / "notes/imported").exists()
        real = run_cli("import", str(vault), "--root", str(root))
        assert real.returncode == 0, real.stderr
        assert real.stdout.splitlines()[0] == dry.stdout.splitlines()[0].replace(
            "Dry run: would create", "created"
        )
        assert (root / "notes/imported/obsidian/Ideas.md").read_text() == "# Ideas\n\n- a garden\n"
        out = tmp_path / "all.zip"
        done = run_cli("export", str(out), "--root", str(root))
        assert done.returncode == 0, done.stderr
        assert "Exported 3 notes and 1 file" in done.stdout
        again = run_cli("export", str(out), "--root", str(root))
        assert again.returncode == 2
        assert "exists already" in again.stderr
        missing = run_cli("import", str(tmp_path / "nothing"), "--root", str(root))
        assert missing.returncode == 2
        assert "no file or folder" in missing.stderr
        slip = tmp_path / "slip.zip"
        slip.write_bytes(zip_of({"../evil.md": "x"}))
        refused = run_cli("import", str(slip), "--root", str(root))
        assert refused.returncode == 2
        assert "outside itself" in refused.stderr

    def test_a_running_server_does_the_import(self, tmp_path):
        root = tmp_path / "root"
        takeout = tmp_path / "takeout.zip"
        takeout.write_bytes(zip_of(KEEP_TAKEOUT))
        with running(root) as server:
            key = json.loads((root / ".notesvc/state.json").read_text())["apiKey"]
            owner = {"X-Service-Key": key}
            out = run_cli("import", str(takeout), "--root", str(root), "--into", "notes/keep")
            assert out.returncode == 0, out.stderr
            assert "it does the import" in out.stderr
            assert out.stdout.startswith("created 3 notes and 1 file in notes/keep")
            status, _, body = server.request("GET", f"{API}/search?q=plumber", headers=owner)
            assert status == 200
            assert body["data"]["results"][0]["path"].startswith("notes/keep/")
            status, _, body = server.request("GET", f"{API}/changes", headers=owner)
            assert [c["kind"] for c in body["data"]["changes"]].count("created") == 3
            status, _, body = server.request("GET", f"{API}/auth/keys", headers=owner)
            assert body["data"]["keys"] == []  # the key made for the import is gone
            dry = run_cli("import", str(takeout), "--root", str(root), "--dry-run")
            assert dry.returncode == 0
            assert dry.stdout.startswith("Dry run: would create 3")
            export = tmp_path / "out.zip"
            done = run_cli("export", str(export), "--root", str(root))
            assert done.returncode == 0, done.stderr
            import zipfile

            names = zipfile.ZipFile(export).namelist()
            assert "notes/keep/Groceries.md" in names
            assert "notesvc-export.json" in names

    def test_a_folder_key_cannot_blow_up_an_import_on_a_real_server(self, tmp_path):
        root = tmp_path / "root"
        body = ("a note of ordinary length\n" * 80).encode()
        one = {"name": "a.md", "data": body, "crc": zlib.crc32(body), "size": len(body)}
        shared = raw_zip([one] + [{"name": "a.md", "at": 0}] * 199)  # as the attack sent it
        mismatched = raw_zip([{**one, "local_name": "b.md"}])  # S4
        with running(root, env={"SERVICE_IMPORT_MIN_FREE_BYTES": "0"}) as server:
            key = json.loads((root / ".notesvc/state.json").read_text())["apiKey"]
            owner = {"X-Service-Key": key}
            grant = {"name": "family", "scope": "write", "folder": "notes/family"}
            status, _, made = server.request("POST", f"{API}/auth/keys", grant, owner)
            assert status == 201

            def upload(zipped: bytes, dry: bool) -> tuple:
                req = urllib.request.Request(
                    f"{server.url}{API}/import?dryRun={str(dry).lower()}",
                    zipped,
                    {"Content-Type": "application/zip", "X-Service-Key": made["data"]["key"]},
                    method="POST",
                )
                try:
                    with urllib.request.urlopen(req, timeout=30) as resp:
                        return resp.status, json.loads(resp.read())
                except urllib.error.HTTPError as e:
                    return e.code, json.loads(e.read())

            for dry in (True, False):
                status, answer = upload(shared, dry)
                assert status == 413, answer
                assert "share their bytes" in answer["error"]["message"]
                status, answer = upload(letters_zip(300, 900 << 10), dry)
                assert status == 413, answer
                assert "more than 100 times its" in answer["error"]["message"]
                status, answer = upload(mismatched, dry)
                assert status == 400, answer
                assert answer["error"]["code"] == "VALIDATION_ERROR"
                assert "not a readable zip" in answer["error"]["message"]
            status, _, changes = server.request("GET", f"{API}/changes?since=0", None, owner)
            assert status == 200
            assert changes["data"]["changes"] == []
            assert all_files(root) == {}
            assert "Traceback" not in "".join(server.lines)

    def test_a_folder_larger_than_the_free_space_is_refused_before_anything_is_written(
        self, tmp_path
    ):
        vault = tmp_path / "vault"
        vault.mkdir()
        (vault / "a.md").write_text("# A\n")
        free = shutil.disk_usage(tmp_path).free
        # a file declaring more than the disk holds (never copied: .bin is not imported, so
        # that a regression cannot fill the disk; the declared sizes count all the same)
        with open(vault / "sparse.bin", "wb") as f:
            f.truncate(free + (1 << 30))
        root = tmp_path / "root"
        env = {"SERVICE_MAX_IMPORT_EXPANDED_BYTES": str(1 << 44)}
        for dry in ((), ("--dry-run",)):
            out = run_cli("import", str(vault), "--root", str(root), *dry, env=env)
            assert out.returncode == 2, out.stderr
            assert "SERVICE_IMPORT_MIN_FREE_BYTES" in out.stderr
            assert "free some space first" in out.stderr
        assert all_files(root) == {}

    def test_the_command_obeys_the_entry_cap_on_its_own_and_through_a_server(self, tmp_path):
        vault = tmp_path / "vault"
        vault.mkdir()
        for i in range(4):
            (vault / f"n{i}.md").write_text(f"# {i}\n")
        packed = tmp_path / "four.zip"
        packed.write_bytes(zip_of({f"n{i}.md": f"# {i}\n" for i in range(4)}))
        root = tmp_path / "root"
        cap = {"SERVICE_MAX_IMPORT_ENTRIES": "3"}
        refusals = (
            (vault, "the folder holds more than 3 entries"),
            (packed, "the archive holds 4 entries"),
        )
        for source, said in refusals:
            out = run_cli("import", str(source), "--root", str(root), "--dry-run", env=cap)
            assert out.returncode == 2, out.stderr
            assert said in out.stderr
            assert "at most 3 (SERVICE_MAX_IMPORT_ENTRIES)" in out.stderr
        helped = run_cli("import", "--help")
        assert "SERVICE_MAX_IMPORT_ENTRIES" in helped.stdout
        assert "(default: 50000)" in helped.stdout.split("SERVICE_MAX_IMPORT_ENTRIES")[1]
        with running(root, env=cap):
            for source, said in refusals:  # the command has no cap of its own here: the server's
                out = run_cli("import", str(source), "--root", str(root))
                assert out.returncode == 2, out.stderr
                assert said in out.stderr
        assert all_files(root) == {}


class TestImportInChromium:
    """The menu's Import (choose, see the dry run, confirm) and Export, on a phone."""

    pytestmark = BROWSER_TESTS

    def test_import_a_takeout_then_export_everything(self, web, tmp_path):
        s = web("phone")
        page = s.page
        takeout = tmp_path / "takeout-2023.zip"
        takeout.write_bytes(zip_of(KEEP_TAKEOUT))
        page.click("#menu summary")
        page.click("#menu-import")
        page.set_input_files("#import-file", str(takeout))
        s.dialog_choose("check")
        expect(page.locator("#import-summary")).to_have_text(
            "Would bring in 3 notes and 1 file into notes/imported/keep."
        )
        expect(page.locator("#import-skipped")).to_contain_text("in Keep's trash")
        s.shot("import-dry-run")
        assert not (web.root / "notes/imported").exists()
        s.dialog_choose("import")
        expect(page.locator("#import-summary")).to_have_text(
            "Brought in 3 notes and 1 file into notes/imported/keep."
        )
        s.shot("import-done")
        s.dialog_choose("ok")
        assert "- [x] Eggs" in (web.root / "notes/imported/keep/Groceries.md").read_text()
        expect(page.locator("#tree")).to_contain_text("imported")
        page.click("#menu summary")
        with page.expect_download() as got:
            page.click("#menu-export")
        path = tmp_path / "export.zip"
        got.value.save_as(path)
        expect(page.locator("#export-progress")).to_contain_text("Saved")
        import zipfile

        names = zipfile.ZipFile(path).namelist()
        assert "notes/imported/keep/Groceries.md" in names
        assert "attachments/imported/keep/1a2b3c4d.png" in names
        assert s.errors == []

    def test_one_note_is_counted_as_one(self, web, tmp_path):
        """Counts on the page go through one helper: "Import 1 note", not "1 notes"."""
        s = web("phone")
        page = s.page
        one = tmp_path / "shopping.md"
        one.write_text("# Shopping\n\n- bread\n")
        page.click("#menu summary")
        page.click("#menu-import")
        page.set_input_files("#import-file", str(one))
        s.dialog_choose("check")
        expect(page.locator("#import-summary")).to_contain_text("Would bring in 1 note and 0 files")
        expect(page.locator('#dlg button[data-value="import"]')).to_have_text("Import 1 note")
        s.shot("import-one")
        assert page.evaluate("[0, 1, 2].map((n) => core.counted(n, 'file'))") == [
            "0 files",
            "1 file",
            "2 files",
        ]
        assert unexpected(s.close()) == []
