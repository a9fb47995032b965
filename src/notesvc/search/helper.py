"""The index's helper process: its entry point, its protocol, starting and stopping it."""

from __future__ import annotations

import array
import base64
import contextlib
import json
import os
import re
import select
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from notesvc.boot import log
from notesvc.errors import ApiError
from notesvc.helpers import TEMP_PREFIX, TEMP_SUFFIX
from notesvc.notes.store import NOFOLLOW_NONBLOCK, NoteStore
from notesvc.search.persistence import DiskSegment, write_batch, write_segment
from notesvc.search.segments import DeletedCounts, Vocab

# -- the helper process ------------------------------------------------------------------
#
# A bulk build (the first start, a restored backup) and the merges of big segment files run
# in a second process of this interpreter and this file: they take a second core, and keep
# their work off the server's GIL and out of its heap. The index talks to it through an
# IndexHelper, one JSON line each way on its stdin and stdout:
#   {"paths": [...]}  ->  {"file": a temp segment file of those notes, or null} | {"error"}
#   {"merge": {"files", "skips", "dels", "avg"}}  ->  {"file", "remaps"} | {"error"}
# The index renames each file it gets into place; a helper that outlives a crashed server
# leaves nothing but temp files, which the next start sweeps away.

MERGE_HELPER_NOTES = 2000  # a merge of this many notes or more: in the helper process


def read_items(notes: NoteStore, paths: list) -> list:
    """Return (path, text, size, mtime_ns) of the notes still there (paths from a scan)."""
    items, base = [], str(notes.base)
    flags = os.O_RDONLY | NOFOLLOW_NONBLOCK
    for path in paths:
        try:  # the common case without pathlib: the name on disk is the path
            fd = os.open(os.path.join(base, path), flags)
        except FileNotFoundError:
            if path.isascii():
                continue
            try:  # an NFD name on disk
                data, st = notes.read_raw(path)
            except ApiError:
                continue
        except OSError:
            continue
        else:
            with open(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    continue
                data = f.read()
        items.append((path, data.decode("utf-8", "replace"), st.st_size, st.st_mtime_ns))
    return items


def analyse_batch(items: list, stems: dict) -> tuple:
    """Return (vocabulary, [Doc], average lengths) of (path, text, size, mtime) items."""
    vocab = Vocab(stems)
    docs = [vocab.analyse(*item) for item in items]
    avg = tuple(max(sum(len(d[4 + f]) for d in docs) / max(len(docs), 1), 1.0) for f in (0, 1))
    return vocab, docs, avg


_HELPER_CODE = (  # loads this file as a module (its cached bytecode) and runs index_helper
    "import importlib.util as u, sys; s = u.spec_from_file_location('notesvc_index_helper', "
    "sys.argv[1]); m = sys.modules[s.name] = u.module_from_spec(s); s.loader.exec_module(m); "
    "m.index_helper(*sys.argv[2:])"
)
# the same from the package (src/notesvc/): by module name, from the folder that holds it
_HELPER_PACKAGE_CODE = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from notesvc.search.helper import index_helper; index_helper(*sys.argv[2:])"
)


def index_helper(notes_root: str, folder: str) -> None:
    """Run as the helper process of a bulk build: for each line {"paths": [...]} on stdin,
    read those notes, write them as a segment to a temp file in folder and answer
    {"file": its path} (or {"error": ...}) on stdout; stop at the end of stdin.

    The server renames each file into place, so a helper that outlives a crashed server
    leaves nothing but a temp file, which the next start sweeps away.
    """
    notes = NoteStore(Path(notes_root), Path(folder) / "trash")
    stems: dict = {}
    for line in sys.stdin:
        name = None
        try:
            request = json.loads(line)
            if "merge" in request:  # {"merge": {files, skips, dels, avg}}: see SearchIndex.merge
                name, reply = _merge_for_server(request["merge"], Path(folder))
                print(json.dumps(reply), flush=True)
                continue
            vocab, docs, avg = analyse_batch(read_items(notes, request["paths"]), stems)
            if docs:
                fd, name = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=TEMP_SUFFIX, dir=folder)
                with os.fdopen(fd, "wb") as f:
                    write_batch(f, docs, vocab, avg)
                    f.flush()
                    os.fsync(f.fileno())
            reply = {"file": name}
        except Exception as e:  # the server indexes the batch itself
            if name:
                with contextlib.suppress(OSError):
                    os.unlink(name)
            reply = {"error": f"{type(e).__name__}: {e}"[:300]}
        print(json.dumps(reply), flush=True)


def _merge_for_server(job: dict, folder: Path) -> tuple:
    """Merge segment files of folder as SearchIndex.merge asks (in the helper process);
    return (the temp file written, the reply: its name and each source's note id map)."""
    sources, dels = [], []
    for name, pairs in zip(job["files"], job["dels"]):
        if not re.fullmatch(r"\d{8}\.seg", name):
            raise ValueError(f"not a segment file: {name!r}")
        sources.append(DiskSegment(folder / name))
        counts = (DeletedCounts(sources[-1].nt), DeletedCounts(sources[-1].nt))
        for c, flat in zip(counts, pairs):
            c.load(array.array("I", flat))
        dels.append(counts)
    skips = [set(skip) for skip in job["skips"]]
    fd, name = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=TEMP_SUFFIX, dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            remaps = write_segment(f, sources, skips, dels, None, folder, tuple(job["avg"]))
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name)
        raise
    maps = [base64.b64encode(remap.tobytes()).decode() for remap in remaps]
    return name, {"file": name, "remaps": maps}


def _readable(f, timeout: float) -> bool:
    """Return whether f has something to read within timeout seconds (poll: a descriptor
    past 1024, as a busy server has, is out of select()'s range)."""
    if hasattr(select, "poll"):
        watch = select.poll()
        watch.register(f, select.POLLIN)
        return bool(watch.poll(timeout * 1000))
    return bool(select.select([f], [], [], timeout)[0])


def discard_temp(folder: Path, name: Any) -> None:
    """Remove a temp file the helper wrote in folder (and nothing else)."""
    tmp = Path(str(name))
    if tmp.parent == folder and tmp.name.startswith(TEMP_PREFIX):
        with contextlib.suppress(OSError):
            tmp.unlink()


class IndexHelper:
    """A running helper process of one index folder: what the index hands it, what it
    answers (ValueError, OSError, KeyError or TypeError when it fails; the index then does
    the work itself)."""

    def __init__(self, proc: Any, folder: Path):
        self.proc, self.folder = proc, folder

    @classmethod
    def start(cls, notes_root: Path, folder: Path, merging: bool = False) -> IndexHelper | None:
        """Start an index_helper process; None where it cannot help (no file; one core,
        except for merges, which it takes off this process's GIL even there)."""
        module = globals().get("__file__")
        one_core = (os.cpu_count() or 1) < 2 and not merging
        if one_core or not module or not sys.executable:
            return None
        import subprocess

        code = _HELPER_CODE  # notesvc.py: this file, by its path
        if __name__.startswith("notesvc."):  # the package: src/notesvc/search/helper.py
            code, module = _HELPER_PACKAGE_CODE, str(Path(module).resolve().parents[2])
        cmd = [sys.executable, "-c", code, module, str(notes_root), str(folder)]
        try:
            proc = subprocess.Popen(  # noqa: S603 (this interpreter and this file)
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, close_fds=True
            )
        except OSError as e:
            log.warning("index: no helper process (%s); indexing on one core", e)
            return None
        what = "merges segment files" if merging else "analyses every other batch"
        log.info("index: a helper process (pid %d) %s", proc.pid, what)
        return cls(proc, folder)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def analyse(self, paths: list) -> str | None:
        """Have it read and analyse these notes into a temp segment file; return the file's
        name (None: none of the notes was left to read)."""
        self.proc.stdin.write(json.dumps({"paths": paths}) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline() or '{"error": "it stopped"}')
        if reply.get("error"):
            raise ValueError(reply["error"])
        return reply.get("file")

    def merge(self, sources: list, skips: list, dels: list, avg: tuple, stop: Any) -> tuple:
        """Have it merge segment files of its folder as SearchIndex.merge took them (each
        source's skipped notes and deleted counts): return (the temp file it wrote, each
        source's note id map). Waiting for it ends when stop (an Event) is set."""
        job = {
            "files": [s.name for s in sources],
            "skips": [sorted(skip) for skip in skips],
            "dels": [[c.pairs().tolist() for c in pair] for pair in dels],
            "avg": list(avg),
        }
        self.proc.stdin.write(json.dumps({"merge": job}) + "\n")
        self.proc.stdin.flush()
        while not _readable(self.proc.stdout, 0.5):
            if stop.is_set() or not self.alive():  # closing: not now
                raise ValueError("stopped")
        reply = json.loads(self.proc.stdout.readline() or '{"error": "it stopped"}')
        try:
            if reply.get("error") or not reply.get("file"):
                raise ValueError(reply.get("error") or "no file")
            remaps = []
            for src, text in zip(sources, reply["remaps"]):
                remap = array.array("i")
                remap.frombytes(base64.b64decode(text))
                if len(remap) != src.n:
                    raise ValueError("a note id map does not add up")
                remaps.append(remap)
            if len(remaps) != len(sources):
                raise ValueError("a note id map is missing")
        except (ValueError, KeyError, TypeError):
            if reply.get("file"):
                discard_temp(self.folder, reply["file"])
            raise
        return reply["file"], remaps

    def stop(self, kill: bool = False) -> None:
        """End it: its stdin closed, it finishes what it does and exits (kill: at once)."""
        if kill:
            self.proc.kill()
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        with contextlib.suppress(OSError):
            self.proc.stdout.close()


class EarlyHelper:
    """A helper process a sync may start before its bulk read (start(), once), then hand
    to it (take()); as a context, the end stops one that no bulk took."""

    def __init__(self, start: Callable):
        self._start, self._helper, self._started = start, None, False

    def __enter__(self) -> EarlyHelper:
        return self

    def __exit__(self, *exc) -> None:
        helper = self.take()
        if helper is not None:
            helper.stop()

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._helper = self._start()

    def take(self) -> IndexHelper | None:
        helper, self._helper = self._helper, None
        return helper
