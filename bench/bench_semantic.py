"""Benchmark: search quality of keyword, semantic and hybrid search, with a real model.

    nice python bench/bench_semantic.py                  # ~1,200 man pages, three query sets
    nice python bench/bench_semantic.py --notes 300 --keyword-only   # a quick look, no model

The collection is built from text no one here wrote: the manual pages of sections 1, 3, 5,
7 and 8 on this machine (/usr/share/man/manN). Every regular page (not a link, not a `.so`
redirect) is ordered by the SHA-1 of its file name and rendered with `man -l` (MANWIDTH=100,
no hyphenation or justification, `col -bx`); a page is taken, until --notes are, when its
NAME section reads "names - description" with a description of 3 to 20 words, none of its
names is a word of that description, its text is 1,000 to 60,000 characters, its
DESCRIPTION opens with a sentence of 3 words or more, no page taken before has the same
description or title, and its family (the name up to the first `_`, `-` or `.`: gcloud_*,
git-*) holds fewer than 5 % of the notes. The collection is built once per size and kept in
~/.cache/notesvc-bench (never in the repository), frozen: pages installed later change
nothing until --rebuild; its digest (pages, notes and queries) is printed so runs can be
compared.

A page becomes one note, `man/<first 10 hex of sha1(file name)>.md`:

- its NAME section, the header and footer lines are dropped, and every one of its names
  (the file's and NAME's, whole words, any case) is removed from the text;
- section headings become `## Heading`, subsection headings `### Heading`, the rest is
  the rendered text dedented, cut after the paragraph that passes 6,000 characters;
- its title, a `# ` heading on the first line, is the first sentence of DESCRIPTION (names
  removed, at most 12 words).

Three query sets, one relevant note per query:

1. "name": the page's NAME description ("compress or expand files");
2. "synonyms": the same with each lower-case content word replaced by a WordNet synonym
   that shares no stem with it (Debian's `wordnet` database read directly: a verb for the
   first word when WordNet has one, else a noun, adjective, verb, adverb in that order;
   lemmas of the first sense, then of its hypernym, then of the second sense; words
   WordNet lacks, names and capitalised words stay), so it shares few words with the page;
   the average share of a query's content words found in its note is reported before and
   after;
3. "title": the note's title (a known item).

Characters that are query syntax for notesvc (`"`, `*`, a leading `-`, upper-case `OR`)
are removed from the queries. The run writes the notes into a fresh root, starts
bench/embed_server.py (all-MiniLM-L6-v2, see its docstring for the install) and a real
`notesvc.py` with the default settings plus SERVICE_EMBED_URL and SERVICE_EMBED_MODEL,
waits until every note is found by keyword and `embeddings.embedded == embeddings.total` in
`/api/v1/system/info`, then sends each query over HTTP with mode=keyword, semantic and
hybrid (limit 10) and reports MRR@10, nDCG@10 and recall@10 per set and mode, and the goals.

Exact search: for every query, the top 10 notes by the best cosine between the query's
vector and the vectors of the note's chunks, computed by the benchmark (NumPy, float32) from
the same model through the same embed server; the chunks are made by notesvc's own chunking
function imported from notesvc.py (named in the output). Reported: the share of exact top
10 that notesvc's semantic mode returns in its top 10 (recall@10 against exact; goal 0.95).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import gzip
import hashlib
import http.client
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path
from types import MappingProxyType

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import notesvc  # noqa: E402

MAN_ROOT = Path("/usr/share/man")
MAN_SECTIONS = ("man1", "man3", "man5", "man7", "man8")
WORDNET = Path("/usr/share/wordnet")
CACHE = Path.home() / ".cache" / "notesvc-bench"
COLLECTION_VERSION = 2  # change when the way pages become notes changes
MAX_NOTE_CHARS = 6000
TITLE_WORDS = 12
MODES = ("keyword", "semantic", "hybrid")
SETS = ("name", "synonyms", "title")

STOPWORDS = set(
    """a about above after again against all also am an and any are as at be because been
    before being below between both but by can could did do does doing down during each few
    for from further had has have having here how if in into is it its itself just may more
    most no nor not now of off on once only or other our out over own same should so some
    such than that the their them then there these they this those through to too under
    until up very via was we were what when where which while who whom why will with would
    you your one two three four five six seven eight nine ten""".split()
)
DASH = "\u2010\u2011\u2012\u2013\u2014\u2212-"  # "-" last: not a range
NAME_RE = re.compile(rf"^(?P<names>[^\s{DASH}][^{DASH}]*?)\s+[{DASH}]\s+(?P<desc>.+)$")


# == WordNet =================================================================


class WordNet:
    """The part of Debian's WordNet 3.0 database the synonym rewrite needs: lemma -> senses
    (synset offsets, most frequent first) per part of speech, synsets' lemmas and
    hypernyms, and the base form of an inflected word (WordNet's morphy)."""

    POS = MappingProxyType({"n": "noun", "v": "verb", "a": "adj", "r": "adv"})
    DETACH = MappingProxyType(
        {
            "n": (
                *(("s", ""), ("ses", "s"), ("xes", "x"), ("zes", "z"), ("ches", "ch")),
                *(("shes", "sh"), ("men", "man"), ("ies", "y")),
            ),
            "v": (
                *(("s", ""), ("ies", "y"), ("es", "e"), ("es", ""), ("ed", "e"), ("ed", "")),
                *(("ing", "e"), ("ing", "")),
            ),
            "a": (("er", ""), ("est", ""), ("er", "e"), ("est", "e")),
            "r": (),
        }
    )

    def __init__(self, folder: Path = WORDNET):
        if not (folder / "index.noun").is_file():
            sys.exit("bench_semantic: apt-get install wordnet (its database is needed)")
        self.index: dict = {}  # pos -> lemma -> (tagsense_cnt, [offsets])
        self.exc: dict = {}
        self.data = {p: (folder / f"data.{name}").open("rb") for p, name in self.POS.items()}
        for p, name in self.POS.items():
            table = self.index[p] = {}
            for line in (folder / f"index.{name}").read_text("latin-1").splitlines():
                if line.startswith(" "):
                    continue
                f = line.split()
                n_ptr = int(f[3])
                synset_cnt, tagsense = int(f[2]), int(f[5 + n_ptr])
                table[f[0]] = (tagsense, f[6 + n_ptr : 6 + n_ptr + synset_cnt])
            exc = self.exc[p] = {}
            for line in (folder / f"{name}.exc").read_text("latin-1").splitlines():
                f = line.split()
                if len(f) >= 2:
                    exc.setdefault(f[0], f[1])
        self._synsets: dict = {}

    def lemmas(self) -> set:
        return {w for table in self.index.values() for w in table}

    def base(self, word: str, pos: str) -> str | None:
        if word in self.index[pos]:
            return word
        if self.exc[pos].get(word) in self.index[pos]:
            return self.exc[pos][word]
        for old, new in self.DETACH[pos]:
            if word.endswith(old) and word[: len(word) - len(old)] + new in self.index[pos]:
                return word[: len(word) - len(old)] + new
        return None

    def synset(self, pos: str, offset: str) -> tuple:
        """(lemmas, hypernym (pos, offset) pairs) of one synset."""
        key = (pos, offset)
        if key not in self._synsets:
            f = self.data[pos]
            f.seek(int(offset))
            fields = f.readline().decode("latin-1").split(" | ")[0].split()
            w_cnt = int(fields[3], 16)
            words = [fields[4 + 2 * i] for i in range(w_cnt)]
            words = [re.sub(r"\([a-z]+\)$", "", w) for w in words]  # adj markers: (a), (p)
            i = 4 + 2 * w_cnt
            p_cnt, hyper = int(fields[i]), []
            for k in range(p_cnt):
                sym, off, ppos = fields[i + 1 + 4 * k : i + 4 + 4 * k]
                if sym in ("@", "@i"):
                    hyper.append(("a" if ppos == "s" else ppos, off))
            self._synsets[key] = (words, hyper)
        return self._synsets[key]

    def synonym(self, word: str, first: bool) -> str | None:
        """A synonym of word that shares no stem with it, or None."""
        found = []
        for pos in ("n", "v", "a", "r"):
            base = self.base(word, pos)
            if base:
                found.append((pos == "v" and first, pos, base, self.index[pos][base][1]))
        if not found:
            return None
        found.sort(key=lambda t: (not t[0], "nvar".index(t[1])))
        _, pos, base, offsets = found[0]
        own = {notesvc.stem(word), notesvc.stem(base)}
        senses = [(pos, offsets[0])]
        senses += self.synset(pos, offsets[0])[1][:1]  # the first sense's hypernym
        senses += [(pos, o) for o in offsets[1:2]]
        for spos, off in senses:
            for lemma in self.synset(spos, off)[0]:
                words = lemma.lower().replace("_", " ").split()
                if len(words) > 2 or lemma.lower() in (word, base):
                    continue
                stems = {notesvc.stem(w) for w in words}
                if not stems & own and all(w.isalpha() for w in words):
                    return " ".join(words)
        return None


def content_words(text: str) -> list:
    return [w for w in re.findall(r"[A-Za-z][A-Za-z'-]*", text) if w.lower() not in STOPWORDS]


def rewrite(query: str, wn: WordNet) -> str:
    """The query with each content word swapped for a WordNet synonym (see the docstring)."""
    out = []
    for i, token in enumerate(query.split()):
        m = re.fullmatch(r"(\W*)([A-Za-z]+)(\W*)", token)
        if not m or not m.group(2).islower() or m.group(2) in STOPWORDS or len(m.group(2)) < 3:
            out.append(token)
            continue
        syn = wn.synonym(m.group(2).lower(), first=(i == 0))
        out.append(m.group(1) + syn + m.group(3) if syn else token)
    return " ".join(out)


def sanitize(query: str) -> str:
    """Drop what notesvc's keyword search reads as syntax: quotes, `*`, a leading `-`, `OR`."""
    q = re.sub(r'["*]', " ", query)
    q = re.sub(r"(^|\s)-+", r"\1", q)
    q = re.sub(r"\bOR\b", "or", q)
    return " ".join(q.split())


def overlap(query: str, note_stems: set) -> float | None:
    """Share of the query's distinct content-word stems found in the note."""
    stems = {notesvc.stem(t) for w in content_words(query) for t in notesvc.tokenize(w)}
    return len(stems & note_stems) / len(stems) if stems else None


# == The collection ============================================================


def man_files() -> list:
    """Regular pages (sectionN/file), not links, not `.so` redirects, by SHA-1 of the name."""
    files = []
    for p in (p for s in MAN_SECTIONS for p in (MAN_ROOT / s).iterdir()):
        if p.is_symlink() or not p.is_file():
            continue
        try:
            opener = gzip.open if p.suffix == ".gz" else open
            with opener(p, "rb") as f:
                head = f.read(512)
        except OSError:
            continue
        if re.match(rb"\s*\.so\s", head):
            continue
        files.append(f"{p.parent.name}/{p.name}")
    return sorted(files, key=lambda n: hashlib.sha1(n.encode(), usedforsecurity=False).hexdigest())


def render(name: str) -> str:
    env = dict(os.environ, MANWIDTH="100", MAN_KEEP_FORMATTING="0", LANG="C.UTF-8")
    env.pop("MANPAGER", None)
    cmd = [
        "man",
        "--no-hyphenation",
        "--no-justification",
        "-E",
        "UTF-8",
        "-l",
        str(MAN_ROOT / name),
    ]
    out = subprocess.run(cmd, capture_output=True, env=env, timeout=60).stdout
    col = subprocess.run(["col", "-bx"], input=out, capture_output=True, timeout=60).stdout
    return col.decode("utf-8", "replace")


def page_name(file: str) -> str:
    base = file.rsplit("/", 1)[-1]
    base = base[:-3] if base.endswith(".gz") else base
    return base.rsplit(".", 1)[0]  # gzip.1 -> gzip, CA.pl.1ssl -> CA.pl


def sections(text: str) -> list:
    """[(heading, [lines])] of a rendered page, header and footer dropped."""
    lines = text.splitlines()
    while lines and not lines[0].strip():
        lines.pop(0)
    while lines and not lines[-1].strip():
        lines.pop()
    lines = lines[1:-1]  # the header "GZIP(1) ... GZIP(1)" and the footer
    out: list = []
    for line in lines:
        if line.strip() and not line[0].isspace():
            out.append((line.strip(), []))
        elif out:
            out[-1][1].append(line.rstrip())
    return out


def names_regex(names: list) -> re.Pattern:
    alts = "|".join(re.escape(n) for n in sorted(set(names), key=len, reverse=True))
    return re.compile(rf"(?<![\w.])(?<!\w-)(?:{alts})(?![\w]|-\w)", re.I)  # not in git-add


def first_sentence(lines: list, strip: re.Pattern) -> str:
    para = []
    for line in lines:
        if not line.strip():
            if para:
                break
            continue
        para.append(line.strip())
    text = " ".join(strip.sub("", " ".join(para)).split())
    sentence = re.split(r"(?<=[.!?:;])\s", text, maxsplit=1)[0]
    words = sentence.split()[:TITLE_WORDS]
    return " ".join(words).rstrip(".,:;!?")


def family(file: str) -> str:
    """gcloud_alpha_... -> gcloud, git-add -> git: no family fills the collection."""
    return re.split(r"[._-]", page_name(file), maxsplit=1)[0].lower()


def make_note(file: str, text: str) -> dict | None:
    """The note made of one rendered page, or None when the page is not taken."""
    secs = sections(text)
    if not secs or secs[0][0].upper() != "NAME":
        return None
    name_line = " ".join(" ".join(secs[0][1]).split())
    m = NAME_RE.match(name_line)
    if not m:
        return None
    names = [n.strip() for n in m.group("names").split(",") if n.strip()]
    names.append(page_name(file))
    desc = " ".join(m.group("desc").split())
    desc_words = {w.lower() for w in re.findall(r"[\w.+-]+", desc)}
    if not 3 <= len(desc.split()) <= 20 or not desc.isascii():
        return None
    if any(len(n) < 2 or n.lower() in desc_words for n in names):
        return None
    strip = names_regex(names)
    described = [lines for head, lines in secs if head.upper() == "DESCRIPTION"]
    title = first_sentence(described[0], strip) if described else ""
    if len(title.split()) < 3:
        return None
    body, size = [], 0
    for head, lines in secs[1:]:
        body.append(f"## {strip.sub('', head).strip() or head.title()}")
        para: list = []
        for line in [*lines, ""]:
            if line.startswith("   ") and not line.startswith("    ") and line.strip():
                if para:
                    body.append("\n".join(para))
                    para = []
                body.append(f"### {strip.sub('', line).strip()}")  # a subsection heading
                continue
            if line.strip():
                content = line[7:] if line[:7].isspace() else line.strip()
                para.append(strip.sub("", content).rstrip())
            elif para:
                body.append("\n".join(para))
                size += sum(len(x) for x in para)
                para = []
        if size > MAX_NOTE_CHARS:
            break
    text_body = "\n\n".join(body)
    if not 1000 <= len(text) <= 60000 or len(text_body) < 500:
        return None
    sha = hashlib.sha1(file.encode(), usedforsecurity=False).hexdigest()
    return {
        "file": file,
        "path": f"man/{sha[:10]}.md",
        "names": sorted(set(names)),
        "query": desc,
        "title": title,
        "text": f"# {title}\n\n{text_body}\n",
    }


def build_collection(n: int, rebuild: bool = False) -> tuple:
    """([note], digest): built once per size and kept in CACHE (frozen: pages installed
    later change nothing until --rebuild)."""
    cached = CACHE / f"man-v{COLLECTION_VERSION}-{n}.json"
    if cached.is_file() and not rebuild:
        notes = json.loads(cached.read_text())
    else:
        files = man_files()
        notes, seen, families, pos = [], set(), {}, 0
        cap = max(5, n // 20)
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            while len(notes) < n and pos < len(files):
                chunk = files[pos : pos + 64]
                pos += len(chunk)
                chunk = [f for f in chunk if families.get(family(f), 0) < cap]
                for file, text in zip(chunk, pool.map(render, chunk)):
                    fam = family(file)
                    if len(notes) >= n or families.get(fam, 0) >= cap:
                        continue
                    note = make_note(file, text)
                    keys = (note["query"].lower(), note["title"].lower()) if note else ()
                    if note and not seen.intersection(keys):
                        seen.update(keys)
                        families[fam] = families.get(fam, 0) + 1
                        notes.append(note)
                print(f"  collection: {pos} pages rendered, {len(notes)} taken", file=sys.stderr)
        print(f"  collection built in {time.perf_counter() - started:.0f} s", file=sys.stderr)
        CACHE.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps(notes))
    notes.sort(key=lambda x: x["file"])
    digest = hashlib.sha256(
        json.dumps([[x["file"], x["text"], x["query"]] for x in notes]).encode()
    ).hexdigest()[:16]
    return notes, digest


def api_path(note: dict) -> str:
    """The note's path in the API: notesvc keeps the notes in <root>/notes/."""
    return f"notes/{note['path']}"


def make_queries(notes: list, wn: WordNet) -> dict:
    """{set: [(query, relevant path)]}, and the word overlaps of sets 1 and 2."""
    sets: dict = {name: [] for name in SETS}
    shares: dict = {"name": [], "synonyms": []}
    for note in notes:
        stems = set(notesvc.tokenize(note["text"]))
        q1 = sanitize(note["query"])
        q2 = rewrite(q1, wn)
        path = api_path(note)
        sets["name"].append((q1, path))
        sets["synonyms"].append((q2, path))
        sets["title"].append((sanitize(note["title"]), path))
        for name, q in (("name", q1), ("synonyms", q2)):
            share = overlap(q, stems)
            if share is not None:
                shares[name].append(share)
    return sets, {k: sum(v) / len(v) for k, v in shares.items() if v}


# == Servers and HTTP ==========================================================


class Client:
    """One keep-alive HTTP/1.1 connection, reconnecting when it is closed."""

    def __init__(self, port: int, headers: dict | None = None):
        self.port, self.headers = port, dict(headers or {})
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)

    def request(self, method: str, path: str, body: dict | None = None) -> tuple:
        headers = dict(self.headers)
        raw = None
        if body is not None:
            headers["Content-Type"] = "application/json"
            raw = json.dumps(body).encode()
        for attempt in (0, 1):
            try:
                self.conn.request(method, path, body=raw, headers=headers)
                r = self.conn.getresponse()
                return r.status, r.read()
            except (http.client.HTTPException, ConnectionError):
                self.conn.close()
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def json(self, method: str, path: str, body: dict | None = None) -> dict:
        status, raw = self.request(method, path, body)
        if status != 200:
            raise RuntimeError(f"{method} {path}: {status} {raw[:300]!r}")
        return json.loads(raw)

    def close(self) -> None:
        self.conn.close()


def spawn(cmd: list, env: dict | None = None, what: str = "server", limit: float = 300.0):
    """Start a process that prints "listening on http://127.0.0.1:PORT" on stderr."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    )
    timer = threading.Timer(limit, proc.kill)
    timer.start()
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            if m:
                threading.Thread(target=proc.stderr.read, daemon=True).start()  # drain
                return proc, int(m.group(1))
    finally:
        timer.cancel()
    raise RuntimeError(f"the {what} did not start: {''.join(lines[-20:])}")


def stop(proc) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def start_notesvc(root: Path, embed_url: str | None) -> tuple:
    """A real notesvc.py with the default settings (plus the embeddings endpoint)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVICE_")}
    if embed_url:
        env.update(SERVICE_EMBED_URL=embed_url, SERVICE_EMBED_MODEL=EMBED_MODEL)
    cmd = [sys.executable, str(HERE.parent / "notesvc.py"), "--root", str(root)]
    cmd += ["--host", "127.0.0.1", "--port", "0"]
    proc, port = spawn(cmd, env, "notesvc server")
    state = json.loads((root / ".notesvc" / "state.json").read_text())
    return proc, port, {"X-Service-Key": state["apiKey"]}


EMBED_MODEL = "all-MiniLM-L6-v2"


def search(client: Client, q: str, mode: str | None, limit: int = 10) -> dict:
    path = f"/api/v1/search?q={urllib.parse.quote(q, safe='')}&limit={limit}"
    if mode:
        path += f"&mode={mode}"
    return client.json("GET", path)["data"]


def wait_ready(client: Client, sets: dict, embeddings: bool, limit: float) -> dict:
    """Until every note is found by its title in keyword mode and, with embeddings, until
    system/info says embedded == total. Returns the last embeddings status and the times."""
    started = time.perf_counter()
    todo = list(sets["title"])
    last_print, keyword_at, info = 0.0, None, None
    while True:
        now = time.perf_counter() - started
        if now > limit:
            raise RuntimeError(f"not ready after {limit:.0f} s: {info}")
        while todo and any(
            r["path"] == todo[0][1] for r in search(client, todo[0][0], "keyword", 100)["results"]
        ):
            todo.pop(0)
        if not todo and keyword_at is None:
            keyword_at = now
        if embeddings:
            info = client.json("GET", "/api/v1/system/info")["data"].get("embeddings")
        done = not todo and (
            not embeddings or (info and info.get("total") and info["embedded"] == info["total"])
        )
        if done:
            return {"embeddings": info, "keyword_s": keyword_at, "ready_s": now}
        if now - last_print >= 15:
            last_print = now
            state = f"{len(sets['title']) - len(todo)}/{len(sets['title'])} notes found by keyword"
            if info:
                state += f", embedded {info.get('embedded')}/{info.get('total')}"
                if info.get("lastError"):
                    state += f", lastError {info['lastError']}"
            print(f"  waiting ({now:.0f} s): {state}", file=sys.stderr)
        time.sleep(1.0)


def run_set(client: Client, queries: list, mode: str) -> list:
    """[(ranked paths, the mode that ran, fallback, ms)] for each query."""
    out = []
    for q, _ in queries:
        t0 = time.perf_counter()
        data = search(client, q, mode)
        ms = (time.perf_counter() - t0) * 1000
        out.append(
            ([r["path"] for r in data["results"]], data.get("mode"), data.get("fallback"), ms)
        )
    return out


# == Measures ==================================================================


def metrics(queries: list, answers: list, k: int = 10) -> dict:
    """MRR@k, nDCG@k and recall@k with one relevant note per query."""
    mrr = ndcg = hits = 0.0
    for (_, relevant), (ranked, *_rest) in zip(queries, answers):
        ranked = ranked[:k]
        if relevant in ranked:
            r = ranked.index(relevant) + 1
            mrr += 1.0 / r
            ndcg += 1.0 / math.log2(r + 1)
            hits += 1
    n = len(queries) or 1
    return {"mrr": mrr / n, "ndcg": ndcg / n, "recall": hits / n}


def lexical_only(query: str) -> bool:
    """Whether notesvc's parser finds a phrase or prefix in the query (a word with inner
    punctuation, "version's", "read-only", "a/b", is a phrase), which keeps it keyword."""
    try:
        parsed = notesvc.Query(query)
    except Exception:  # a query notesvc refuses is not lexical-only
        return False
    return any(alt[0] != "word" for clause in parsed.clauses for alt in clause)


def median(values: list) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else float("nan")


# == Exact search ==============================================================


def embed_texts(port: int, texts: list, batch: int = 64):
    """Vectors (float32, unit length) from the embed server, in its OpenAI format."""
    import numpy as np

    client = Client(port)
    out = []
    try:
        for i in range(0, len(texts), batch):
            data = client.json(
                "POST", "/v1/embeddings", {"model": EMBED_MODEL, "input": texts[i : i + batch]}
            )
            out.extend(d["embedding"] for d in sorted(data["data"], key=lambda d: d["index"]))
    finally:
        client.close()
    m = np.asarray(out, dtype=np.float32)
    return m / np.maximum(np.linalg.norm(m, axis=1, keepdims=True), 1e-12)


def note_chunks(note: dict) -> tuple:
    """(texts to embed for the note, how): notesvc's own chunking, as its embedder calls it
    (the note's title as the index gives it, the text as read from the file)."""
    title = notesvc.note_title(note["text"], api_path(note))
    return notesvc.chunk_note(title, note["text"]), "notesvc.chunk_note (the same chunks)"


def exact_top(port: int, notes: list, sets: dict, k: int = 10) -> tuple:
    """{set: [exact top-k paths]} by each note's best chunk cosine, and how chunks were made."""
    import numpy as np

    texts, owner, how = [], [], ""
    for i, note in enumerate(notes):
        chunks, how = note_chunks(note)
        texts.extend(chunks)
        owner.extend([i] * len(chunks))
    chunk_vectors = embed_texts(port, texts)
    owner_arr = np.asarray(owner)
    out = {}
    for name, queries in sets.items():
        qv = embed_texts(port, [q for q, _ in queries])
        sims = qv @ chunk_vectors.T  # queries x chunks
        best = np.full((len(queries), len(notes)), -2.0, dtype=np.float32)
        np.maximum.at(best.T, owner_arr, sims.T)  # each note's best chunk
        top = np.argsort(-best, axis=1, kind="stable")[:, :k]
        out[name] = [[api_path(notes[j]) for j in row] for row in top]
    return out, how, len(texts)


def overlap_at_k(answers: list, exact: list, k: int = 10) -> tuple:
    """(mean share of the exact top k in notesvc's top k, queries counted): only the queries
    that semantic mode answered by meaning (not a keyword fallback)."""
    shares = [
        len(set(a[0][:k]) & set(e[:k])) / len(e[:k])
        for a, e in zip(answers, exact)
        if a[1] == "semantic" and e
    ]
    return (sum(shares) / len(shares) if shares else float("nan")), len(shares)


# == The run ===================================================================


def commit_label() -> str:
    def git(*a):
        return subprocess.run(
            ["git", "-C", str(HERE.parent), *a], capture_output=True, text=True
        ).stdout.strip()

    dirty = git("status", "--porcelain", "--", "src", "notesvc.py")
    return git("rev-parse", "--short", "HEAD") + (" (src changed)" if dirty else "")


def write_notes(root: Path, notes: list) -> None:
    """Write the notes (a note already there as written is left alone: a root kept with
    --root keeps its index and vectors)."""
    for note in notes:
        path = root / api_path(note)
        if path.is_file() and path.read_text(encoding="utf-8") == note["text"]:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(note["text"], encoding="utf-8")


def split_inner(query: str) -> str:
    """The query with punctuation inside a word made a space ("read-only" -> "read only")."""
    return re.sub(r"(?<=\w)[^\w\s]+(?=\w)", " ", query)


def fused_mrr(lists: list, k: float, w: float) -> float:
    """MRR@10 of reciprocal-rank fusion of (keyword, semantic, relevant) lists, the
    semantic list weighted w: score = 1/(k + rank_kw) + w/(k + rank_sem); ties by path."""
    total = 0.0
    for kw, sem, relevant in lists:
        scores: dict = {}
        for weight, ranking in ((1.0, kw), (w, sem)):
            for rank, path in enumerate(ranking, 1):
                scores[path] = scores.get(path, 0.0) + weight / (k + rank)
        top = [p for p, _ in sorted(scores.items(), key=lambda x: (-x[1], x[0]))[:10]]
        total += 1.0 / (top.index(relevant) + 1) if relevant in top else 0.0
    return total / len(lists) if lists else float("nan")


def fusion_study(client: Client, sets: dict) -> dict:
    """Other fusions, from each query's keyword and semantic top 100 (what hybrid fuses),
    over the queries semantic mode answers; and hybrid with inner punctuation split."""
    out: dict = {}
    for name, queries in sets.items():
        lists = []
        for q, relevant in queries:
            sem = search(client, q, "semantic", 100)
            if sem.get("mode") != "semantic":
                continue
            kw = search(client, q, "keyword", 100)
            lists.append(
                ([r["path"] for r in kw["results"]], [r["path"] for r in sem["results"]], relevant)
            )
        rows = {"keyword alone": fused_mrr([(a, [], r) for a, _, r in lists], 60, 1.0)}
        rows["semantic alone"] = fused_mrr([([], b, r) for _, b, r in lists], 60, 1.0)
        for k in (10, 30, 60, 120):
            for w in (1.0, 1.5, 2.0):
                rows[f"RRF k={k} w={w:g}"] = fused_mrr(lists, k, w)
        split = [(split_inner(q), rel) for q, rel in queries]
        answers = run_set(client, split, "hybrid")
        m = metrics(split, answers)
        m["fallbacks"] = sum(1 for a in answers if a[2])
        out[name] = {"queries": len(lists), "mrr": rows, "split_hybrid": m}
    return out


def sample(queries: list, n: int | None) -> list:
    if not n or n >= len(queries):
        return queries
    step = len(queries) / n
    return [queries[int(i * step)] for i in range(n)]


def report(res: dict) -> list:
    lines = ["", "| set | mode | MRR@10 | nDCG@10 | recall@10 | ran as | fallback | p50 ms* |"]
    lines.append("|---|---|---|---|---|---|---|---|")
    for name in SETS:
        for mode, r in res["results"].get(name, {}).items():
            ran = ", ".join(f"{k} {v}" for k, v in sorted(r["ran"].items()))
            lines.append(
                f"| {name} ({r['queries']}) | {mode} | {r['mrr']:.3f} | {r['ndcg']:.3f} | "
                f"{r['recall']:.3f} | {ran} | {r['fallbacks']} | {r['p50_ms']:.1f} |"
            )
    lines.append(
        "\n*over HTTP, one client; the embed server caches vectors by text, so a query's vector"
        " is computed in semantic mode (run first) and reused by hybrid: hybrid's p50 is not"
        " a person's (bench_vectors.py http --model minilm measures it with no cache)"
    )
    for name in SETS:
        r = res["results"].get(name, {}).get("semantic")
        if r and r["fallback_examples"]:
            shown = "; ".join(repr(q) for q in r["fallback_examples"][:3])
            lines.append(f"\n{name}: {r['fallbacks']} semantic queries fell back, e.g. {shown}")
    fusion = res.get("fusion")
    if fusion:
        names = list(fusion)
        lines += [
            "",
            "Other fusions, MRR@10 over the queries semantic mode answers ("
            + ", ".join(f"{n} {fusion[n]['queries']}" for n in names)
            + "):",
            "",
        ]
        lines += ["| fusion | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for row in fusion[names[0]]["mrr"]:
            lines.append(
                f"| {row} | " + " | ".join(f"{fusion[n]['mrr'][row]:.3f}" for n in names) + " |"
            )
        lines.append(
            "| hybrid as shipped, all queries, inner punctuation made a space | "
            + " | ".join(
                f"{sh['mrr']:.3f} ({sh['fallbacks']} fell back)"
                for sh in (fusion[n]["split_hybrid"] for n in names)
            )
            + " |"
        )
    goals = res.get("goals", [])
    if goals:
        lines += ["", "| goal | figure | wanted | |", "|---|---|---|---|"]
        for g in goals:
            lines.append(
                f"| {g['goal']} | {g['figure']} | {g['wanted']} | "
                f"{'met' if g['met'] else 'MISSED'} |"
            )
    return lines


def goals(res: dict) -> list:
    out = []
    r = res["results"]
    for name, delta in (("name", 0.05), ("synonyms", 0.15), ("title", -0.01)):
        if "hybrid" not in r.get(name, {}):
            continue
        kw, hy = r[name]["keyword"]["mrr"], r[name]["hybrid"]["mrr"]
        want = f"≥ keyword {'+' if delta > 0 else '−'} {abs(delta):.2f}"
        fig = f"{hy:.3f} vs {kw:.3f} ({hy - kw:+.3f})"
        out.append(
            {
                "goal": f"hybrid MRR@10, set {name}",
                "figure": fig,
                "wanted": want,
                "met": hy >= kw + delta - 1e-9,
            }
        )
    if "exact" in res:
        worst = min(v for v in res["exact"]["recall"].values())
        counted = res["exact"]["counted"]
        fig = ", ".join(f"{k} {v:.3f} ({counted[k]} q)" for k, v in res["exact"]["recall"].items())
        out.append(
            {
                "goal": "semantic top 10 ∩ exact top 10",
                "figure": fig,
                "wanted": "≥ 0.95",
                "met": worst >= 0.95,
            }
        )
    return out


def run(args) -> dict:
    started = time.perf_counter()
    wn = WordNet()
    notes, digest = build_collection(args.notes, args.rebuild)
    sets, shares = make_queries(notes, wn)
    sets = {name: sample(q, args.queries) for name, q in sets.items()}
    res = {
        "commit": commit_label(),
        "python": platform.python_version(),
        "collection": {
            "notes": len(notes),
            "digest": digest,
            "sections": MAN_SECTIONS,
            "overlap": shares,
            "bytes": sum(len(n["text"].encode()) for n in notes),
        },
        "results": {},
        "lexical_only": {k: sum(lexical_only(q) for q, _ in v) for k, v in sets.items()},
    }
    with contextlib.suppress(ImportError):
        import numpy

        res["numpy"] = numpy.__version__
    print(
        f"collection: {len(notes)} man pages ({', '.join(MAN_SECTIONS)}), digest {digest}, "
        f"{res['collection']['bytes'] / 1e6:.2f} MB; queries per set: {len(sets['name'])}",
        file=sys.stderr,
    )
    work = Path(tempfile.mkdtemp(prefix="bench-semantic-", dir=args.workdir))
    embed_proc = server = client = None
    try:
        root = Path(args.root).expanduser() if args.root else work / "root"
        write_notes(root, notes)
        embed_url, embed_port = None, None
        if not args.keyword_only:
            cmd = [
                "nice",
                sys.executable,
                str(HERE / "embed_server.py"),
                *("--threads", str(args.threads), "--backend", args.backend),
            ]
            embed_proc, embed_port = spawn(cmd, None, "embed server")
            embed_url = f"http://127.0.0.1:{embed_port}/v1/embeddings"
            health = Client(embed_port).json("GET", "/health")
            backend = health.get("backend", "torch")
            how = "sentence-transformers on PyTorch" if backend == "torch" else "bench/minilm.py"
            res["model"] = f"{health['model']} ({health['dimensions']} dimensions, {how}, CPU)"
        t_start = time.perf_counter()
        server, port, headers = start_notesvc(root, embed_url)
        client = Client(port, headers)
        ready = wait_ready(client, sets, not args.keyword_only, args.wait)
        res["ready"] = dict(ready, started_s=time.perf_counter() - t_start)
        if embed_port:
            res["embed_stats_backfill"] = Client(embed_port).json("GET", "/stats")
        modes = ("keyword",) if args.keyword_only else MODES
        for name, queries in sets.items():
            res["results"][name] = {}
            for mode in modes:
                t0 = time.perf_counter()
                answers = run_set(client, queries, mode)
                m = metrics(queries, answers)
                ran: dict = {}
                for a in answers:
                    ran[str(a[1])] = ran.get(str(a[1]), 0) + 1
                m.update(
                    queries=len(queries),
                    ran=ran,
                    fallbacks=sum(1 for a in answers if a[2]),
                    p50_ms=median([a[3] for a in answers]),
                    seconds=time.perf_counter() - t0,
                )
                res["results"][name][mode] = m
                m["_answers"] = answers
                m["fallback_examples"] = [q for (q, _), a in zip(queries, answers) if a[2]][:5]
                print(
                    f"  {name:8s} {mode:8s} MRR@10 {m['mrr']:.3f} ({m['seconds']:.0f} s)",
                    file=sys.stderr,
                )
        if embed_port and not args.no_exact:
            t0 = time.perf_counter()
            exact, how, n_chunks = exact_top(embed_port, notes, sets)
            recall, counted = {}, {}
            for name in sets:
                answers = res["results"][name]["semantic"]["_answers"]
                recall[name], counted[name] = overlap_at_k(answers, exact[name])
            res["exact"] = {
                "recall": recall,
                "counted": counted,
                "chunks": how,
                "n_chunks": n_chunks,
                "seconds": time.perf_counter() - t0,
            }
            res["embed_stats"] = Client(embed_port).json("GET", "/stats")
        if embed_port and args.fusion_study:
            res["fusion"] = fusion_study(client, sets)
        if embed_port:
            res["embeddings_after"] = client.json("GET", "/api/v1/system/info")["data"][
                "embeddings"
            ]
    finally:
        if client:
            client.close()
        stop(server)
        stop(embed_proc)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept {work}", file=sys.stderr)
    for by_mode in res["results"].values():
        for m in by_mode.values():
            m.pop("_answers", None)
    res["goals"] = goals(res)
    res["seconds"] = time.perf_counter() - started
    return res


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--notes", type=int, default=1200, help="man pages in the collection (1200)")
    ap.add_argument("--queries", type=int, help="queries per set (default: one per note)")
    ap.add_argument("--rebuild", action="store_true", help="build the collection again")
    ap.add_argument("--keyword-only", action="store_true", help="no model: keyword mode only")
    ap.add_argument("--no-exact", action="store_true", help="skip the exact-search comparison")
    ap.add_argument("--threads", type=int, default=2, help="the model's torch threads (2)")
    ap.add_argument("--backend", choices=("torch", "numpy"), default="torch", help="embed_server's")
    ap.add_argument("--wait", type=float, default=1800, help="seconds to wait for the backfill")
    ap.add_argument("--workdir", help="where the temporary root goes (default: the temp folder)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument(
        "--root",
        help="a root to keep and reuse (outside the repository): a rerun skips the backfill",
    )
    ap.add_argument("--fusion-study", action="store_true", help="also MRR of other fusions")
    ap.add_argument("--json", help="write the results here as JSON")
    args = ap.parse_args()
    res = run(args)
    c = res["collection"]
    head = [
        f"# bench_semantic: commit {res['commit']}, Python {res['python']}, "
        f"NumPy {res.get('numpy', '-')}",
        f"model: {res.get('model', 'none (keyword only)')}",
        f"collection: {c['notes']} man pages of {', '.join(c['sections'])}, digest {c['digest']}, "
        f"{c['bytes'] / 1e6:.2f} MB",
        "query words found in the note (content words, stems): "
        + ", ".join(f"{k} {v:.2f}" for k, v in c["overlap"].items()),
    ]
    ready = res.get("ready", {})
    if ready:
        emb = ready.get("embeddings") or {}
        head.append(
            f"ready: every note found by keyword after {ready['keyword_s']:.0f} s, embedded "
            f"{emb.get('embedded', '-')}/{emb.get('total', '-')} after {ready['ready_s']:.0f} s"
            + (f" (dimensions {emb.get('dimensions')}, model {emb.get('model')})" if emb else "")
        )
    if "exact" in res:
        e = res["exact"]
        head.append(f"exact search: {e['n_chunks']} chunks; {e['chunks']}")
    head.append(
        "queries notesvc's parser reads as holding a phrase (kept keyword): "
        + ", ".join(f"{k} {v}" for k, v in res["lexical_only"].items())
    )
    after = res.get("embeddings_after")
    if after:
        head.append(f"embeddings after the queries: lastError {after.get('lastError')!r}")
    head.append(f"time taken: {res['seconds']:.0f} s")
    print("\n".join(head + report(res)))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2, default=str))


if __name__ == "__main__":
    main()
