"""Imports bounded in entries, memory and disk (src/notesvc/transfer/plan.py)."""

from __future__ import annotations

import base64
import collections
import contextlib
import errno
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import threading
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from conftest import (
    API,
    JOPLIN_JEX,
    KEEP_TAKEOUT,
    KEY,
    TINY_PNG,
    Server,
    all_files,
    assert_error,
    assert_nothing_imported,
    data,
    feed,
    import_file,
    note_url,
    notesvc,
    running,
    search,
    tar_of,
    wait_for,
    with_key,
    zip_of,
)

# Issue 50, T4 and T11: an import is bounded in entries (SERVICE_MAX_IMPORT_ENTRIES, read from
# a zip's end record before zipfile reads its directory), in memory (what a plan keeps of each
# entry, what an .enex note's text may take) and in disk (the free-space check counts what the
# import really writes; an import that fails midway takes back what it wrote).


def zip64_ended(body: bytes, count: int | None = None) -> bytes:
    """The zip with a Zip64 end record and its locator before its end record, whose counts
    then read 0xFFFF (as zipfile writes them past 65,535 entries); the Zip64 record declares
    `count` entries (by default the end record's own count)."""
    import struct

    end = body.rindex(b"PK\x05\x06")
    _, _, _, entries, _, size, offset, _ = struct.unpack("<4sHHHHLLH", body[end : end + 22])
    count = entries if count is None else count
    record = struct.pack(
        "<4sQHHLLQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, size, offset
    )
    locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, end, 1)
    classic = struct.pack("<4sHHHHLLH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, size, offset, 0)
    return body[:end] + record + locator + classic


def empty_entries_zip(count: int, name: bytes = b"n%06d.md") -> bytes:
    """A zip of `count` empty notes written byte by byte, as the attack's was (200,000 of
    them make 19 MB, in a fraction of zipfile's time); past 65,535 with a Zip64 end record."""
    import struct

    local, central, at = [], [], 0
    for i in range(count):
        leaf = name % i if b"%" in name else name
        head = (0, 0, 0, 0x21, 0, 0, 0)  # flags, method, time, date, CRC, sizes: all empty
        local.append(struct.pack("<4sHHHHHLLLHH", b"PK\x03\x04", 20, *head, len(leaf), 0))
        local.append(leaf)
        central.append(
            struct.pack(
                "<4sHHHHHHLLLHHHHHLL", b"PK\x01\x02", 20, 20, *head, len(leaf), 0, 0, 0, 0, 0, at
            )
        )
        central.append(leaf)
        at += 30 + len(leaf)
    directory = b"".join(central)
    short = min(count, 0xFFFF)
    end = struct.pack("<4sHHHHLLH", b"PK\x05\x06", 0, 0, short, short, len(directory), at, 0)
    body = b"".join(local) + directory + end
    return zip64_ended(body, count) if count > 0xFFFF else body


def enex_of(*notes: str) -> bytes:
    """An .enex holding these <note> elements."""
    head = '<?xml version="1.0" encoding="UTF-8"?>\n<en-export application="Evernote">'
    return (head + "".join(notes) + "</en-export>\n").encode()


def enex_note(title: str, enml: str, resource: bytes = b"") -> str:
    """One .enex note; `resource`: a PNG's bytes it shows (by hash, base64 in 76 columns)."""
    media = res = ""
    if resource:
        digest = hashlib.md5(resource, usedforsecurity=False).hexdigest()
        media = f'<en-media hash="{digest}" type="image/png"/>'
        data = base64.encodebytes(resource).decode()
        res = f"<resource><data encoding='base64'>{data}</data><mime>image/png</mime></resource>"
    return (
        f"<note><title>{title}</title><content><![CDATA[<en-note>{enml}{media}</en-note>]]>"
        f"</content>{res}</note>"
    )


def traced_peak(run) -> tuple:
    """Return (what run() gave, the most Python heap it held at once, in bytes)."""
    import tracemalloc

    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        result = run()
        return result, tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


class TestImportBounds:
    """Imports bounded in entries, in memory and in disk (issue 50: T4, T11)."""

    @staticmethod
    def message(resp: dict, status: int) -> str:
        assert resp["success"] is False
        assert resp["error"]["code"] == notesvc.STATUS_CODES[status]
        return resp["error"]["message"]

    @pytest.mark.slow
    def test_import_of_more_entries_than_the_setting_is_refused_by_the_end_record(
        self, make_app, root
    ):
        assert notesvc.load_config(env={}).max_import_entries == 50_000
        client = with_key(make_app(SERVICE_MAX_IMPORT_ENTRIES="100"))
        body = empty_entries_zip(101)
        for dry in (True, False):
            said = self.message(import_file(client, body, "n.zip", status=413, dryRun=dry), 413)
            assert said == (
                "nothing was imported: the archive holds 101 entries; an import takes at most "
                "100 (SERVICE_MAX_IMPORT_ENTRIES): split it, or raise the setting"
            )
        # the end record is read before zipfile reads the directory: behind an end record
        # counting 101, a directory zipfile could not read is refused for its count (not 400)
        end = body.rindex(b"PK\x05\x06")
        garbled = body[: end - 300] + b"\xff" * 300 + body[end:]
        resp = client.post(f"{API}/import", garbled, content_type="application/zip", status=413)
        assert "101 entries" in assert_error(resp, 413, "PAYLOAD_TOO_LARGE")["message"]
        assert_nothing_imported(client, root)
        assert import_file(client, empty_entries_zip(100), "n.zip")["created"] == 100

    @pytest.mark.slow
    def test_import_of_a_zip_whose_end_record_understates_its_entries_counts_its_directory(
        self, make_app, root
    ):
        client = with_key(make_app(SERVICE_MAX_IMPORT_ENTRIES="100"))
        body = empty_entries_zip(101)
        end = body.rindex(b"PK\x05\x06")
        three = body[: end + 8] + (3).to_bytes(2, "little") * 2 + body[end + 12 :]
        for lie in (three, zip64_ended(body, count=3)):
            said = self.message(import_file(client, lie, "n.zip", status=413), 413)
            assert "holds more than 100 entries" in said
        said = self.message(import_file(client, zip64_ended(body), "n.zip", status=413), 413)
        assert "holds 101 entries" in said  # Zip64's count, not the end record's 0xFFFF
        assert_nothing_imported(client, root)
        fine = import_file(
            client, zip64_ended(empty_entries_zip(60)), "n.zip", status=200, dryRun=True
        )
        assert fine["created"] == 60  # a Zip64 end record is found where zipfile finds it
        other = root.parent / "other"
        two = with_key(make_app(other, SERVICE_MAX_IMPORT_ENTRIES="2"))
        long_names = empty_entries_zip(2, b"%03d" + b"x" * 400 + b".md")
        said = self.message(import_file(two, long_names, "n.zip", status=413), 413)
        assert "the zip's directory takes 904 bytes, more than 320 for each of the 2" in said
        assert not (other / "notes/imported").exists()

    @pytest.mark.slow
    def test_import_of_a_tar_an_enex_or_a_folder_past_the_setting_is_refused_unwritten(
        self, make_app, root, tmp_path
    ):
        client = with_key(make_app(SERVICE_MAX_IMPORT_ENTRIES="6"))
        said = self.message(import_file(client, tar_of(JOPLIN_JEX), "j.jex", status=413), 413)
        assert "the archive holds more than 6 entries" in said  # a Joplin export of 7 files
        # three notes and three pictures: the first note and its picture would be written
        # before the count passed 6; the .enex is counted through before the first write
        enex = enex_of(*(enex_note(f"N{i}", "text", TINY_PNG + bytes([i])) for i in range(3)))
        more = enex.replace(b"</en-export>", enex_note("N3", "x").encode() + b"</en-export>")
        for dry in (True, False):
            resp = client.post(
                f"{API}/import?dryRun={str(dry).lower()}",
                more,
                content_type="application/xml",
                status=413,
            )
            assert "the .enex holds more than 6 entries" in resp.json["error"]["message"]
        assert_nothing_imported(client, root)
        assert import_file(client, enex, "six.enex")["created"] == 3  # 6 entries: at the cap
        vault = tmp_path / "vault"
        for i in range(7):
            (vault / f"sub{i % 2}").mkdir(parents=True, exist_ok=True)
            (vault / f"sub{i % 2}/n{i}.md").write_text(f"# {i}\n")
        with pytest.raises(notesvc.ApiError) as refused:
            notesvc.import_path(client.app.service, vault, None, True)
        assert refused.value.status_code == 413
        assert "the folder holds more than 6 entries" in refused.value.message

    @pytest.mark.slow
    def test_import_plans_keep_little_of_each_entry(self, client, tmp_path):
        """The attack's dry run of 200,000 empty notes took 480 MB: the plan kept several
        objects and copies a note. Now a note costs under 1.6 KB of Python heap at the
        peak, zipfile's directory included (about 1 KB here)."""
        upload = tmp_path / "n.zip"
        upload.write_bytes(empty_entries_zip(5_000))
        svc = client.app.service
        owner = notesvc.Principal("key", "write", "notes/family")

        def dry_run() -> dict:
            with open(upload, "rb") as f:
                return notesvc.run_import(svc, f, "n.zip", None, True, owner)

        # tracemalloc counts every thread's heap: another thread's work (a service of an
        # earlier test in this worker) can land in one run's peak; the least of three is
        # the plan's own
        peaks = []
        for _ in range(3):
            report, peak = traced_peak(dry_run)
            assert (report["created"], report["into"]) == (5_000, "notes/family/imported/files")
            peaks.append(peak)
            if peak < 5_000 * 1600:
                break
        assert min(peaks) < 5_000 * 1600, f"{min(peaks) / 5_000:.0f} bytes a note"

    @pytest.mark.slow
    def test_import_of_an_enex_note_over_the_size_limit_holds_little_of_it(
        self, client, root, tmp_path
    ):
        """One 63 MB .enex note peaked at 1,144 MB (T4). A note's text is gathered up to 4
        times SERVICE_MAX_BODY_BYTES and no further: past it the note is skipped (its
        pictures too, which it alone would link to) as it streams by."""
        para = "<div>" + "lorem ipsum dolor sit amet " * 30 + "</div>"
        huge = para * (40_000_000 // len(para))  # 40 MB of text
        upload = tmp_path / "big.enex"
        upload.write_bytes(
            enex_of(enex_note("Big", huge, TINY_PNG), enex_note("Small", "<div>fine</div>"))
        )
        del huge
        svc = client.app.service

        def real_run() -> dict:
            with open(upload, "rb") as f:
                return notesvc.run_import(svc, f, "big.enex", None, False)

        report, peak = traced_peak(real_run)
        assert peak < 12 << 20, f"{peak / 2**20:.1f} MiB"  # the text alone is 40 MB
        assert report["skipped"] == [
            {"source": "big.enex: Big", "reason": "over SERVICE_MAX_BODY_BYTES"}
        ]
        assert (report["created"], report["attachments"]) == (1, 0)
        assert list(all_files(root)) == ["notes/imported/evernote/Small.md"]

    @pytest.mark.parametrize("where", ["attribute", "comment"])
    @pytest.mark.slow
    def test_import_of_an_enex_holding_a_giant_token_is_refused(self, client, root, where):
        """expat holds a tag (its attributes) or a comment whole, where text and CDATA flow
        in pieces: one of over 4 MiB is refused before it grows further."""
        giant = "x" * (5 << 20)
        hostile = {
            "attribute": f'<en-export><note title="{giant}"/></en-export>',
            "comment": f"<en-export><!--{giant}--></en-export>",
        }[where]
        for dry in ("true", "false"):
            resp = client.post(
                f"{API}/import?dryRun={dry}",
                hostile.encode(),
                content_type="application/xml",
                status=413,
            )
            said = assert_error(resp, 413, "PAYLOAD_TOO_LARGE")["message"]
            assert "a tag, comment or declaration of over 4 MiB" in said
        assert_nothing_imported(client, root)

    @pytest.mark.slow
    def test_import_room_counts_the_history_copy_and_the_index(self, make_app, root, monkeypatch):
        """T11: on a 64 MB disk the check passed on the notes' declared sizes, then the
        history's copy of each note filled the disk. Each note now counts its file in whole
        blocks, twice its size again (the history's copy, the index) and a block; a file
        its blocks and a block; and 8 MiB for the SQLite files' journals meanwhile."""
        import collections

        usage = collections.namedtuple("usage", "total used free")
        mib = 1 << 20
        disk = [usage(100 << 30, (100 << 30) - 6 * mib, 6 * mib)]
        monkeypatch.setattr(shutil, "disk_usage", lambda path: disk[0])
        client = with_key(make_app(SERVICE_IMPORT_MIN_FREE_BYTES="0"))
        notes = {f"n{i:02}.md": os.urandom(50_000).hex() for i in range(25)}
        body = zip_of(notes)
        declared = sum(len(t) for t in notes.values())
        assert declared < disk[0].free  # what the check counted before: it passed
        for dry in (True, False):
            said = self.message(import_file(client, body, "n.zip", status=507, dryRun=dry), 507)
            need = 25 * (102_400 + 4096 + 200_000) + 8 * mib
            assert said == (
                f"nothing was imported: it may take up to {need} bytes of the notes' disk (the "
                "notes, their history's copies and search index, the files) and leave less "
                f"than 0 bytes free ({6 * mib} free now; the margin is 5 % of the disk or "
                "SERVICE_IMPORT_MIN_FREE_BYTES, whichever is less): free some space first"
            )
        assert_nothing_imported(client, root)
        disk[:] = [usage(100 << 30, (100 << 30) - 16 * mib, 16 * mib)]
        assert import_file(client, body, "n.zip")["created"] == 25

    @staticmethod
    def failing_note_writes(monkeypatch, at: int, before=None) -> list:
        """Make the `at`-th note an import writes meet a full disk (as atomic_write raises
        it), `before(paths written)` run first; return the paths asked for."""
        real = notesvc.NoteStore.create
        asked: list = []

        def create(store, path, content, conflict_of=None):
            if path.startswith("notes/imported/"):
                asked.append(path)
                if len(asked) == at:
                    if before:
                        before(store, asked[:-1])
                    raise notesvc.DiskFull(OSError(errno.ENOSPC, "No space left on device"))
            return real(store, path, content, conflict_of)

        monkeypatch.setattr(notesvc.NoteStore, "create", create)
        return asked

    @pytest.mark.slow
    def test_import_failing_midway_takes_back_what_it_wrote(self, client, root, monkeypatch):
        """T11: the disk filled at the 25th of 25 notes and the answer said "nothing was
        changed" over the 24 written. Now what the import wrote is removed again (no trash,
        no version: nothing was there before it) and the answer says so."""
        asked = self.failing_note_writes(monkeypatch, 3)
        import_file(client, zip_of(KEEP_TAKEOUT), "t.zip", status=200, dryRun=True)
        assert asked == []  # a dry run writes nothing, so meets no full disk
        resp = import_file(client, zip_of(KEEP_TAKEOUT), "t.zip", status=507)
        assert len(asked) == 3
        assert self.message(resp, 507) == (
            "the notes' disk filled up during the import: the import removed the 2 notes and "
            "1 file it had written, so nothing was changed; free some space and import again"
        )
        assert all_files(root) == {}
        assert not (root / "notes/imported").exists()
        changes = feed(client)["changes"]
        assert [(c["kind"], c["path"]) for c in changes] == [
            ("created", asked[0]),
            ("created", asked[1]),
            ("deleted", asked[1]),
            ("deleted", asked[0]),
        ]
        assert data(client.get(f"{API}/trash"))["items"] == []
        assert search(client, "plumber")["total"] == search(client, "eggs")["total"] == 0
        for path in asked[:2]:
            client.get(note_url(path) + "/versions", status=404)
        monkeypatch.undo()
        again = import_file(client, zip_of(KEEP_TAKEOUT), "t.zip")
        assert (again["created"], again["attachments"], again["renamed"]) == (3, 1, 0)

    @pytest.mark.slow
    def test_import_taking_back_its_writes_leaves_a_note_edited_meanwhile(
        self, client, root, monkeypatch
    ):
        def edit_first(store, written: list) -> None:
            store.update(written[0], "mine now\n")

        asked = self.failing_note_writes(monkeypatch, 3, before=edit_first)
        said = self.message(import_file(client, zip_of(KEEP_TAKEOUT), "t.zip", status=507), 507)
        assert said == (
            "the notes' disk filled up during the import: the import removed the 1 note and "
            "1 file it had written; it left 1 that changed since (or could not be removed: "
            f"see the log): {asked[0]}; free some space and import again"
        )
        assert all_files(root) == {asked[0]: b"mine now\n"}


def rss_anon_mb(pid: int) -> float:
    """A process's RssAnon (its own memory, not the files it maps), in MB."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"RssAnon:\s+(\d+) kB", status).group(1)) / 1024


@contextlib.contextmanager
def small_disk(tmp_path: Path, size: str):
    """A tmpfs of `size` to be a notes root's disk, unmounted after; the test skips where
    mounting needs a root this process is not."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)],
        capture_output=True,
        timeout=10,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode()[:200]}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True, timeout=10)


def fill_disk(disk: Path) -> Path:
    """Fill a disk to its last block; return the file that does it."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0" * 65536)
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0" * 4096)
    finally:
        os.close(fd)
    return filler


@pytest.mark.real_server
@pytest.mark.slow
class TestImportBoundsOnARealServer:
    """T4 and T11 against a real `notesvc.py`: its memory under the attack's imports, and
    imports on a disk too small for them."""

    @staticmethod
    def upload(server: Server, key: str, body: bytes, ctype: str, dry: bool) -> tuple:
        """POST a raw import; return (status, answer)."""
        req = urllib.request.Request(
            f"{server.url}{API}/import?dryRun={str(dry).lower()}",
            body,
            {"Content-Type": ctype, "X-Service-Key": key},
            method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def test_hostile_imports_leave_the_servers_memory_bounded(self, tmp_path):
        """T4 as the attack ran it, by a folder key: a 19 MB zip of 200,000 empty entries
        (its dry run took the server from 84 to 561 MB and left it at 447) and one 63 MB
        .enex note (its peak: 1,144 MB). The goal is at most 100 MB of RssAnon over idle at
        the peak and back within 50 MB of it a few seconds after the answer; asserted with
        margin at 60 MB (this run's peaks: a few MB)."""
        many = empty_entries_zip(200_000)
        assert 18_000_000 < len(many) < 20_000_000
        para = b"<div>" + b"lorem ipsum dolor sit amet " * 30 + b"</div>"
        head, tail = enex_of(enex_note("Big", "\x00")).split(b"\x00")
        note = head + para * (63_000_000 // len(para)) + tail
        with running(tmp_path / "root") as server:
            owner = json.loads((tmp_path / "root/.notesvc/state.json").read_text())["apiKey"]
            grant = {"name": "family", "scope": "write", "folder": "notes/family"}
            status, _, made = server.request("POST", f"{API}/auth/keys", grant, {KEY: owner})
            assert status == 201
            folder_key = made["data"]["key"]
            pid = server.proc.pid
            answers = []
            for body, ctype, dry, expected in (
                (many, "application/zip", True, 413),
                (note, "application/xml", True, 200),
                (note, "application/xml", False, 201),
            ):
                idle = rss_anon_mb(pid)
                peak, done = [idle], threading.Event()

                def sample(peak=peak, done=done) -> None:
                    while not done.wait(0.01):
                        peak[0] = max(peak[0], rss_anon_mb(pid))

                sampler = threading.Thread(target=sample)
                sampler.start()
                try:
                    status, answer = self.upload(server, folder_key, body, ctype, dry)
                finally:
                    done.set()
                    sampler.join()
                assert peak[0] - idle < 60, f"{idle:.0f} MB idle, {peak[0]:.0f} MB at the peak"
                assert status == expected, answer
                answers.append(answer)
                wait_for(lambda idle=idle: rss_anon_mb(pid) - idle < 50, timeout=10)
            assert "holds 200,000 entries" in answers[0]["error"]["message"]
            for answer in answers[1:]:
                assert answer["data"]["skipped"] == [
                    {"source": "import.enex: Big", "reason": "over SERVICE_MAX_BODY_BYTES"}
                ]
        assert "Traceback" not in "".join(server.lines)

    def test_an_import_the_disk_cannot_hold_is_refused_before_a_note_is_written(self, tmp_path):
        """T11 as the attack found it: on a 64 MB disk, an import whose notes' declared
        sizes fitted passed the check, filled the disk (each note is kept twice: the note
        and the history's copy) and answered 507 "nothing was changed" over the notes it had
        written. The check now counts those copies (and the index): 507 before the first."""
        import zipfile

        notes = {f"n{i:02}.md": os.urandom(500_000).hex() for i in range(30)}  # 30 MB of text
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
            for name, text in notes.items():
                zf.writestr(name, text)
        body = buf.getvalue()
        with (
            small_disk(tmp_path, "64m") as disk,
            running(disk, env={"SERVICE_IMPORT_MIN_FREE_BYTES": "0"}) as server,
        ):
            key = json.loads((disk / ".notesvc/state.json").read_text())["apiKey"]
            wait_for((disk / ".notesvc" / "index").is_dir)
            free = shutil.disk_usage(disk).free - len(body)  # the upload is kept there too
            assert sum(map(len, notes.values())) < free  # so the check passed before
            status, answer = self.upload(server, key, body, "application/zip", False)
            assert status == 507, answer
            said = answer["error"]["message"]
            assert said.startswith("nothing was imported: it may take up to ")
            assert said.endswith("free some space first")
            assert not (disk / "notes" / "imported").exists()
            status, _, changes = server.request("GET", f"{API}/changes", None, {KEY: key})
            assert changes["data"]["changes"] == []
            assert [p for p in disk.rglob("*") if p.name.startswith(".tmp-")] == []

    def test_a_disk_filling_during_an_import_gets_back_what_the_import_wrote(self, tmp_path):
        """The check passes, and another program fills the disk while the import writes:
        the import removes what it wrote, so that its 507 saying nothing changed is true."""
        notes = {f"n{i:04}.md": f"# Note {i}\n\n" + "words of a note " * 120 for i in range(3000)}
        env = {"SERVICE_IMPORT_MIN_FREE_BYTES": "0", "SERVICE_RESCAN_SECONDS": "1"}
        with small_disk(tmp_path, "64m") as disk, running(disk, env=env) as server:
            key = json.loads((disk / ".notesvc/state.json").read_text())["apiKey"]
            wait_for((disk / ".notesvc" / "index").is_dir)
            result: list = []
            post = threading.Thread(
                target=lambda: result.append(
                    self.upload(server, key, zip_of(notes), "application/zip", False)
                )
            )
            post.start()
            imported = disk / "notes" / "imported" / "files"
            try:
                wait_for(lambda: imported.is_dir() and any(imported.iterdir()), timeout=60)
                filler = fill_disk(disk)
            finally:
                post.join(120)
            status, answer = result[0]
            assert status == 507, answer
            said = answer["error"]["message"]
            assert said.startswith("the notes' disk filled up during the import: the import ")
            assert said.endswith(
                " it had written, so nothing was changed; free some space and import again"
            )
            removed = re.search(r"removed the (\d+) notes? and", said)
            assert removed, said
            assert int(removed.group(1)) > 0, said  # the disk did fill midway
            assert not imported.exists() or list(imported.iterdir()) == []
            os.unlink(filler)
            status, _, listing = server.request("GET", f"{API}/notes?limit=10", None, {KEY: key})
            assert listing["data"]["total"] == 0

            def every_creation_undone() -> bool:
                made: collections.Counter = collections.Counter()
                since, more = 0, True
                while more:
                    query = f"{API}/changes?since={since}&limit=1000"
                    page = server.request("GET", query, None, {KEY: key})[2]["data"]
                    for change in page["changes"]:
                        made[change["path"]] += {"created": 1, "deleted": -1}[change["kind"]]
                    since, more = page["last"], page["more"]
                return bool(made) and not any(made.values())

            wait_for(every_creation_undone, timeout=20)  # the feed says so
