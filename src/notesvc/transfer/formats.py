"""The importers: folders (Obsidian, Notion), Keep, Evernote, Joplin."""

from __future__ import annotations

import base64
import datetime as dt
import functools
import hashlib
import io
import json
import posixpath
import re
import tempfile
import unicodedata
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

from notesvc.errors import ApiError, not_found
from notesvc.grants import OWNER, Principal, inside, no_link_below
from notesvc.helpers import BODY_CHUNK, iso
from notesvc.notes.merge import title_filename
from notesvc.notes.paths import (
    ATTACHMENT_TYPES,
    ATTACHMENTS,
    NOTES,
    attachment_path,
    folder_path,
    note_file_path,
    note_path,
)
from notesvc.plugins import MDLINK_RE, WIKILINK_RE, md_target
from notesvc.transfer.plan import (
    DISK_BLOCK,
    EXPORT_MANIFEST,
    IMPORT_DISK_SLACK,
    IMPORT_TEXT_TYPES,
    NOTION_ID_RE,
    Draft,
    ImportEntry,
    ImportPlan,
    ImportSource,
    decode_text,
    front_matter,
    import_budget,
    import_kind,
    import_refused,
    import_room,
    import_segment,
    import_too_big,
    import_too_many,
    iso_or_none,
    link_token,
    note_need,
    sniff_import,
)

# -- folders of Markdown: Obsidian, Notion, plain files, notesvc's own export ---------------


def _note_name_of(name: str) -> tuple:
    """Return (stem, extension) of a source file name, lower-case extension."""
    stem, dot, ext = name.rpartition(".")
    return (stem, ext.lower()) if dot and stem else (name, "")


def _target_segments(name: str, strip_ids: bool) -> list:
    segments = []
    for seg in name.split("/"):
        if strip_ids:
            stem, ext = _note_name_of(seg)
            stem = NOTION_ID_RE.sub("", stem) or stem
            seg = f"{stem}.{ext}" if ext else stem
        segments.append(import_segment(seg))
    return segments


def _relink(text: str, source: str, known: Mapping) -> str:
    """Return a Markdown note's text with its links to files of the import as tokens."""
    here = posixpath.dirname(source)

    def md(m: re.Match) -> str:
        href = m.group(2)
        target = md_target(href)
        if target is None or "://" in target:
            return m.group(0)
        inner = urllib.parse.unquote(target.strip("<>"))
        resolved = posixpath.normpath(posixpath.join(here, inner)) if here else inner
        resolved = unicodedata.normalize("NFC", resolved)
        if resolved not in known:
            return m.group(0)
        rest = href[len(target) :]
        return f"{m.group(1)}{link_token(resolved, target)}{rest}{m.group(3)}"

    return MDLINK_RE.sub(md, text)


def plan_tree(plan: ImportPlan, source: ImportSource, kind: str) -> None:
    """Import a tree of Markdown and files (Obsidian, Notion, any folder, notesvc's export)."""
    notes, files = [], []
    for entry in source.entries:
        place = _tree_place(plan, entry.name, kind)
        if place is not None:
            is_note, want = place
            (notes if is_note else files).append((entry, want))
    if kind == "notion":
        notes = _without_csv_twins(notes)
    drafts = [Draft(e.name, want, open=e.open, size=e.size) for e, want in files]
    links: list = []  # (the sources imported, renamed notes' names): known once all are named
    links_or_none = None if kind == "notesvc" else links
    plan.load = functools.partial(_tree_text, source, csv_title=None, links=links_or_none)
    drafts += _tree_note_drafts(plan, source, notes, links_or_none)
    for d in drafts:
        plan.name(d)
        plan.looked()
    links.extend([plan.by_source, _renamed_notes(plan) if kind == "obsidian" else {}])
    plan.add_all(drafts)


def _tree_place(plan: ImportPlan, name: str, kind: str) -> tuple | None:
    """Return (whether it is a note, where it goes) of a file of a tree, or None for one the
    import skips (the plan says why). A Notion database's CSV goes to None: it is named by
    its title later."""
    ext = _note_name_of(name.rsplit("/", 1)[-1])[1]
    if name == EXPORT_MANIFEST:
        return None
    if any(seg.startswith(".") for seg in name.split("/")):
        if not name.startswith(".obsidian/"):
            plan.skip(name, "a hidden file")
        return None
    if kind == "notesvc":
        return _own_export_place(plan, name, ext)
    strip_ids = kind == "notion"
    if ext == "csv" and strip_ids:
        return True, None
    if ext in IMPORT_TEXT_TYPES:
        segs = _target_segments(name, strip_ids)
        segs[-1] = import_segment(_note_name_of(segs[-1])[0]) + ".md"
        return True, "/".join([plan.into, *segs])
    if ext in ATTACHMENT_TYPES:
        return False, "/".join([plan.files_into, *_target_segments(name, strip_ids)])
    plan.skip(name, f"files ending .{ext or '(none)'} are not imported")
    return None


def _own_export_place(plan: ImportPlan, name: str, ext: str) -> tuple | None:
    """Return (whether it is a note, its path) of a file of notesvc's own export, kept where
    the export had it, or None for one the import skips (the plan says why)."""
    top = name.split("/", 1)[0]
    try:
        if top == NOTES and ext == "md":
            want = note_path(name)
        elif top in (NOTES, ATTACHMENTS) and ext in ATTACHMENT_TYPES:
            want = (attachment_path if top == ATTACHMENTS else note_file_path)(name)
        else:
            plan.skip(name, "not a note or a file of a notesvc export")
            return None
    except ApiError as e:
        plan.skip(name, e.message)
        return None
    grant = getattr(plan, "grant", None)
    if grant is not None and not grant.whole and not grant.may_write(want):
        plan.skip(name, "outside the folders this key may write")
        return None
    return ext == "md", want


def _without_csv_twins(notes: list) -> list:
    """Return a Notion import's (entry, path) notes less each database's `_all.csv` whose
    plain twin is there too."""
    names = {e.name for e, _ in notes}
    kept = []
    for entry, want in notes:
        twin = entry.name[: -len("_all.csv")] + ".csv"
        if want is None and entry.name.endswith("_all.csv") and twin in names:
            continue
        kept.append((entry, want))
    return kept


def _tree_note_drafts(plan: ImportPlan, source: ImportSource, notes: list, links) -> list:
    """Return the drafts of a tree's (entry, path) notes, each read when written (the
    plan's `load`; a Notion database's CSV named by its title); one over the size limit is
    skipped."""
    drafts = []
    for entry, want in notes:
        if entry.size > plan.max_note * 4:
            plan.skip(entry.name, "over SERVICE_MAX_BODY_BYTES")
            continue
        text: Any = entry  # read by plan.load when written
        if want is None:  # a Notion database
            stem = _note_name_of(entry.name.rsplit("/", 1)[-1])[0]
            title = NOTION_ID_RE.sub("", stem.removesuffix("_all")) or stem
            segs = _target_segments(entry.name, True)[:-1]
            want = "/".join([plan.into, *segs, import_segment(title) + ".md"])
            text = functools.partial(_tree_text, source, entry, csv_title=title, links=links)
        drafts.append(Draft(entry.name, want, text=text))
    return drafts


def _tree_text(source: ImportSource, entry: ImportEntry, csv_title: Any, links: Any) -> str:
    """Return a note of a tree as it is imported: its text (a database's CSV as a table),
    its links to what the import holds as tokens, wikilinks to renamed notes renamed."""
    text = decode_text(source.read(entry))
    if csv_title is not None:
        text = csv_to_markdown(csv_title, text)
    if links:
        known, renamed = links
        text = _relink(text, entry.name, known)
        if renamed:
            text = _rename_wikilinks(text, renamed)
    return text


def _renamed_notes(plan: ImportPlan) -> dict:
    """Return {old note name, casefolded: its new name} of the notes the import renamed."""
    renamed: dict = {}
    for src, path in plan.by_source.items():
        old = _note_name_of(src.rsplit("/", 1)[-1])[0]
        new = _note_name_of(path.rsplit("/", 1)[-1])[0]
        if old != new and path.endswith(".md"):
            renamed.setdefault(old.casefold(), new)
    return renamed


def _rename_wikilinks(text: str, renamed: Mapping) -> str:
    """Point [[wikilinks]] at the new name of a note the import had to rename."""

    def fix(m: re.Match) -> str:
        target = m.group(1)
        new = renamed.get(target.strip().casefold())
        if new is None:
            return m.group(0)
        rest = m.group(2) or ""
        return f"[[{new}{rest if '|' in rest else rest + '|' + target}]]"

    return WIKILINK_RE.sub(fix, text)


def csv_to_markdown(title: str, text: str) -> str:
    """Return a Notion database's CSV as a note: its name as the title, a Markdown table."""
    import csv

    rows = list(csv.reader(io.StringIO(text.lstrip("\ufeff"))))
    rows = [r for r in rows if any(c.strip() for c in r)]
    if not rows:
        return f"# {title}\n"
    width = max(len(r) for r in rows)

    def cell(c: str) -> str:
        return " ".join(c.replace("|", "\\|").split())

    lines = [f"# {title}", ""]
    for i, r in enumerate(rows):
        lines.append("| " + " | ".join(cell(c) for c in r + [""] * (width - len(r))) + " |")
        if i == 0:
            lines.append("|" + " --- |" * width)
    return "\n".join(lines) + "\n"


# -- Google Keep (Takeout) --------------------------------------------------------------------

KEEP_COLOURS = {"DEFAULT", ""}


def keep_note(data: Any, files: Mapping | None = None) -> tuple:
    """Return (title, Markdown, reason to skip or None) of one Keep note's JSON. `files`
    maps the names of the archive's files to whether they are imported (None: link every
    attachment); see _keep_attachments."""
    if not isinstance(data, dict):
        return "", "", "not a Keep note (a JSON object was expected)"
    if data.get("isTrashed") is True:
        return "", "", "in Keep's trash"
    title = _keep_str(data, "title").strip()
    body = _keep_str(data, "textContent").replace("\r\n", "\n")
    tasks = _keep_tasks(data.get("listContent"))
    meta = _keep_meta(data)
    parts = [f"# {title}" if title else ""]
    if body.strip():
        parts.append(body.strip("\n"))
    if tasks:
        parts.append("\n".join(tasks))
    parts += _keep_attachments(data, files)
    links = _keep_links(data)
    if links:
        parts.append("\n".join(links))
    md = "\n\n".join(p for p in parts if p).strip("\n") + "\n"
    return title, front_matter(meta) + md, None


def _keep_str(data: dict, key: str) -> str:
    """Return a Keep note's text field, '' where it is missing or not text."""
    v = data.get(key)
    return v if isinstance(v, str) else ""


def _keep_tasks(items: Any) -> list:
    """Return a Keep checklist (listContent) as Markdown task lines."""
    tasks = []
    if isinstance(items, list):
        for item in items:
            if isinstance(item, dict) and isinstance(item.get("text"), str):
                mark = "x" if item.get("isChecked") is True else " "
                tasks.append(f"- [{mark}] {' '.join(item['text'].split())}")
    return tasks


def _keep_meta(data: dict) -> dict:
    """Return the front matter of a Keep note: its labels as tags, dates, pin, archive,
    colour (none for the default)."""
    labels = [
        str(lb["name"]).replace(",", " ").strip()
        for lb in data.get("labels") or []
        if isinstance(lb, dict) and isinstance(lb.get("name"), str) and lb["name"].strip()
    ]

    def usec(key: str) -> str | None:
        v = data.get(key)
        return iso_or_none(v / 1e6) if isinstance(v, (int, float)) and v > 0 else None

    colour = _keep_str(data, "color").upper()
    return {
        "tags": labels,
        "created": usec("createdTimestampUsec"),
        "updated": usec("userEditedTimestampUsec"),
        "pinned": data.get("isPinned") is True,
        "archived": data.get("isArchived") is True,
        "color": colour.lower() if colour not in KEEP_COLOURS else "",
        "source": "Google Keep",
    }


def keep_attachments(data: Any) -> list:
    """Return (file name, whether it is a picture) of each file a Keep note's JSON attaches."""
    named = []
    for a in (data.get("attachments") if isinstance(data, dict) else None) or []:
        if isinstance(a, dict) and isinstance(a.get("filePath"), str):
            leaf = a["filePath"].replace("\\", "/").rsplit("/", 1)[-1]
            named.append((leaf, str(a.get("mimetype", "image")).startswith("image")))
    return named


def _keep_file(leaf: str, files: Mapping) -> str | None:
    """Return the name of the archive's file that a Keep note's attachment names: the name
    itself, else the one that differs only by case or by .jpg / .jpeg (Takeout writes
    either); None when the archive has none."""
    if leaf in files:
        return leaf
    stem, ext = _note_name_of(leaf)
    same = {"jpeg": "jpg", "jpg": "jpg"}
    want = (stem.casefold(), same.get(ext, ext))
    for name in files:
        other_stem, other_ext = _note_name_of(name)
        if (other_stem.casefold(), same.get(other_ext, other_ext)) == want:
            return name
    return None


def _keep_attachments(data: dict, files: Mapping | None) -> list:
    """Return a Keep note's links to its attached files (an image shown, as `![...]`); one
    the archive lacks is a plain mention, "(picture missing from the export: x.jpg)", and
    one it holds but does not import "(x.3gp: not imported)": never a link to nothing."""
    lines = []
    for leaf, picture in keep_attachments(data):
        found = leaf if files is None else _keep_file(leaf, files)
        if found is None:
            lines.append(f"({'picture' if picture else 'file'} missing from the export: {leaf})")
        elif files is not None and not files[found]:
            lines.append(f"({found}: not imported)")
        else:
            lines.append(f"{'!' if picture else ''}[{found}]({link_token(found, found)})")
    return lines


def _keep_links(data: dict) -> list:
    """Return the web links Keep saw in a note (its annotations) as a Markdown list."""
    links = []
    for a in data.get("annotations") or []:
        if isinstance(a, dict) and isinstance(a.get("url"), str) and a["url"].startswith("http"):
            label = " ".join(str(a.get("title") or a["url"]).split()).replace("]", ")")
            links.append(f"- [{label}]({a['url']})")
    return links


def plan_keep(plan: ImportPlan, source: ImportSource) -> None:
    """Import a Keep Takeout: each note's .json (its .html twin is the same note), the files
    they attach (every other file is kept as an attachment too)."""
    jsons, files = [], []
    for entry in source.entries:
        leaf = entry.name.rsplit("/", 1)[-1]
        ext = _note_name_of(leaf)[1]
        if ext == "json":
            jsons.append(entry)
        elif ext == "html" or leaf == "Labels.txt":
            continue  # the .json beside it holds the same note
        elif ext in ATTACHMENT_TYPES:
            files.append(entry)
        else:
            plan.skip(entry.name, f"files ending .{ext or '(none)'} are not imported")
    drafts = []
    for entry in files:
        leaf = import_segment(entry.name.rsplit("/", 1)[-1])
        d = Draft(entry.name.rsplit("/", 1)[-1], f"{plan.files_into}/{leaf}", open=entry.open)
        plan.name(d)
        drafts.append(d)
    # every file of the archive by name: whether it is imported (a note links only to those)
    held = {e.name.rsplit("/", 1)[-1]: False for e in source.entries}
    held.update({d.source: True for d in drafts})
    plan.load = functools.partial(_keep_text, source, held=held)
    drafts += filter(None, map(functools.partial(_keep_note_draft, plan, source, held=held), jsons))
    plan.named()
    with plan.writing():
        for d in drafts:
            (plan.add_file if d.open else plan.add_note)(d)


def _keep_note_draft(
    plan: ImportPlan, source: ImportSource, entry: ImportEntry, held: Mapping
) -> Draft | None:
    """Return the named draft of a Keep note's .json (None, and the plan says why, for one
    skipped); the files it names that the archive lacks go in the report."""
    try:
        data = json.loads(source.read(entry, plan.max_note * 4))
    except (ValueError, UnicodeDecodeError) as e:
        plan.skip(entry.name, f"not valid JSON ({str(e)[:80]})")
        return None
    title, text, reason = keep_note(data, held)
    if reason:
        plan.skip(entry.name, reason)
        return None
    _keep_missing(plan, entry, data, held)
    name = import_segment(title_filename(title or text.split("---\n", 2)[-1]))
    d = Draft(entry.name, f"{plan.into}/{name}.md", text=entry)  # read again when written
    plan.name(d)
    plan.looked()
    return d


def _keep_missing(plan: ImportPlan, entry: ImportEntry, data: dict, held: Mapping) -> None:
    """Name in the plan's report (as skipped) each file a Keep note attaches that the
    archive lacks: the dry run says so before the import."""
    for leaf, picture in keep_attachments(data):
        if _keep_file(leaf, held) is None:
            what = "picture" if picture else "file"
            plan.missing += 1
            plan.skip(leaf, f"{what} {leaf} named by {entry.name} is not in the archive")


def _keep_text(source: ImportSource, entry: ImportEntry, held: Mapping) -> str:
    """Return a Keep note's Markdown, its .json read again (the plan holds no texts)."""
    return keep_note(json.loads(source.read(entry)), held)[1]


# -- Evernote (.enex, read as a stream) --------------------------------------------------------


ENML_BLOCKS = frozenset(
    "div p h1 h2 h3 h4 h5 h6 li blockquote center section article header footer dl dt dd "
    "address pre".split()
)
ENML_MARKS = {"b": "**", "strong": "**", "i": "*", "em": "*", "s": "~~", "strike": "~~"}
ENML_MARKS.update({"del": "~~", "code": "`", "tt": "`"})
_TASK_MARK_RE = re.compile(r"\[[ x]\] $")


@functools.cache
def _enml_parser() -> type:
    """Return the ENML parser class (html.parser is imported on the first import only)."""
    import html.parser

    class EnmlToMarkdown(html.parser.HTMLParser):
        """ENML (Evernote's XHTML) to Markdown: blocks, headings, emphasis, links, lists,
        checkboxes (en-todo), tables, code blocks, quotes and media (en-media, by hash)."""

        BLOCKS, MARKS = ENML_BLOCKS, ENML_MARKS
        HIDDEN = ("en-crypt", "style", "script", "title", "head")

        def __init__(self, media: Callable[[dict], str]):
            super().__init__(convert_charrefs=True)
            self.media = media
            self.lines: list = []
            self.inline: list = []
            self.prefix = ""  # a block's mark: "## ", "- ", "1. ", "- [ ] "
            self.lists: list = []  # [tag, items so far]
            self.quote = 0
            self.depth = 0  # open blocks
            self.code_at = -1  # the depth a code block opened at (-1: none)
            self.tables: list = []  # tables being read (rows of cells of pieces), innermost last
            self.hrefs: list = []
            self.hidden = 0

        @property
        def code(self) -> bool:
            return self.code_at >= 0

        def _put(self, text: str) -> None:
            if self.hidden:
                return
            if self.tables:
                rows = self.tables[-1]
                if not rows:
                    rows.append([])
                if not rows[-1]:
                    rows[-1].append([])
                rows[-1][-1].append(text)
            else:
                self.inline.append(text)

        def _flush(self, blank: bool = False) -> None:
            text = "".join(self.inline)
            self.inline = []
            lead = "> " * self.quote
            if self.code:
                self.lines.append(lead + text)
                return
            text = " ".join(text.split())
            if text or self.prefix.strip():
                self.lines.append(lead + self.prefix + text)
                self.prefix = ""
            elif blank:
                self.lines.append(lead.rstrip())

        def _mark(self, tag: str, a: dict) -> str:
            if tag[:1] == "h" and tag[1:].isdigit():
                return "#" * int(tag[1]) + " "
            if tag == "li" and self.lists:
                kind = self.lists[-1]
                kind[1] += 1
                indent = "   " * (len(self.lists) - 1)
                if kind[0] == "todo":  # Evernote 10's checklist: the item's style ticks it
                    return indent + ("- [x] " if enml_style(a, "--en-checked") else "- [ ] ")
                return indent + ("- " if kind[0] == "ul" else f"{kind[1]}. ")
            return ""

        def _carries_item(self, tag: str) -> bool:
            """Return whether a block opens as the first thing of a list item whose mark
            waits for text (Evernote 10 writes `<li><div>text</div></li>`): it takes the
            item's mark instead of leaving it on a line of its own."""
            head = self.prefix.lstrip()[:1]
            return tag in ("div", "p") and (head == "-" or head.isdigit())

        def handle_starttag(self, tag: str, attrs: list) -> None:
            a = {k: v or "" for k, v in attrs}
            if tag in self.HIDDEN:
                if tag == "en-crypt":
                    self._put("(encrypted text, not imported)")
                self.hidden += 1
            elif self.tables and tag in ("tr", "td", "th", "table"):
                self._start_table_part(tag)
            elif tag == "table":
                self._flush()
                self.tables.append([])
            elif self.code and (tag in self.BLOCKS or tag in ("ul", "ol", "hr")):
                self.depth += tag in self.BLOCKS  # a line of the code block
            elif tag in self.BLOCKS:
                self._start_block(tag, a)
            elif tag in ("ul", "ol", "hr"):
                self._flush_before(tag)
                self._start_list(tag, a)
            else:
                self._start_inline(tag, a)

        def _start_table_part(self, tag: str) -> None:
            """A row, a cell, or a table inside a table's cell."""
            rows = self.tables[-1]
            if tag == "tr":
                rows.append([])
            elif tag in ("td", "th"):
                if not rows:
                    rows.append([])
                rows[-1].append([])
            else:
                self.tables.append([])

        def _flush_before(self, tag: str) -> None:
            """End the line before a block, but for the first block of a list item."""
            if not self.tables and (self.inline or not self._carries_item(tag)):
                self._flush()

        def _start_block(self, tag: str, a: dict) -> None:
            """A block: a code block, a quote, a heading's or a list item's mark."""
            self._flush_before(tag)
            self.depth += 1
            codeblock = "-en-codeblock:true" in a.get("style", "").replace(" ", "")
            if (tag == "pre" or codeblock) and not self.tables:
                self.lines.append("> " * self.quote + "```")
                self.code_at = self.depth
            elif tag == "blockquote":
                self.quote += 1
            elif not self.tables:
                self.prefix = self._mark(tag, a) + self.prefix

        def _start_list(self, tag: str, a: dict) -> None:
            """A list (Evernote 10's checklist is a `ul` styled `--en-todo:true`), a rule."""
            if tag == "hr":
                self.lines.append("---")
            else:
                todo = tag == "ul" and enml_style(a, "--en-todo")
                self.lists.append(["todo" if todo else tag, 0])

        def _start_inline(self, tag: str, a: dict) -> None:
            """A line break, emphasis, a link, a checkbox, a picture."""
            if tag == "br":
                self._put(" ") if self.tables else self._flush(blank=True)
            elif tag in self.MARKS and not self.code:
                self._put(self.MARKS[tag])
            elif tag == "a":
                self.hrefs.append(a.get("href", ""))
                if self.hrefs[-1]:
                    self._put("[")
            elif tag == "en-todo":
                self._start_todo(a)
            elif tag == "en-media":
                self._put(self.media(a))
            elif tag == "img" and a.get("src", "").startswith(("http://", "https://")):
                alt = a.get("alt", "").replace("]", ")")
                self._put(f"![{alt}]({a['src'].replace(' ', '%20')})")

        def _start_todo(self, a: dict) -> None:
            """The older checkbox, `<en-todo checked="true"/>`: a task line's mark."""
            mark = "[x] " if a.get("checked", "").lower() == "true" else "[ ] "
            if _TASK_MARK_RE.search(self.prefix):  # in an Evernote 10 checklist's item
                self.prefix = _TASK_MARK_RE.sub(mark, self.prefix)
            elif self.tables:
                self._put(mark)
            elif self.prefix.lstrip()[:1] == "-" or self.prefix[:1].isdigit():
                self.prefix = self.prefix + mark
            else:
                self.prefix = self.prefix + "- " + mark

        def handle_startendtag(self, tag: str, attrs: list) -> None:
            self.handle_starttag(tag, attrs)
            if tag in self.BLOCKS or tag in ("a", "ul", "ol", "table", "tr", "td", "th"):
                self.handle_endtag(tag)

        def handle_endtag(self, tag: str) -> None:
            if tag in self.HIDDEN:
                self.hidden = max(0, self.hidden - 1)
                return
            if self.tables and tag in ("tr", "td", "th", "table"):
                if tag == "table":
                    rows = self.tables.pop()
                    if self.tables:  # an inner table: its text into the outer cell
                        self._put(" ".join("".join(p for c in r for p in c) for r in rows))
                    else:
                        self._table(rows)
                return
            if tag in self.BLOCKS:
                if self.code:
                    if self.depth != self.code_at or self.inline:
                        self._flush()  # a line of the code block
                    if self.depth == self.code_at:
                        self.lines.append("> " * self.quote + "```")
                        self.code_at = -1
                    self.depth = max(0, self.depth - 1)
                    return
                self.depth = max(0, self.depth - 1)
                if not self.tables:
                    self._flush(blank=tag == "p")
                if tag == "blockquote":
                    self.quote = max(0, self.quote - 1)
            elif tag in ("ul", "ol") and self.lists:
                self._flush()
                self.lists.pop()
            elif tag in self.MARKS and not self.code:
                self._put(self.MARKS[tag])
            elif tag == "a":
                href = self.hrefs.pop() if self.hrefs else ""
                if href:
                    self._put(f"]({href.replace(' ', '%20').replace(')', '%29')})")

        def handle_data(self, data: str) -> None:
            self._put(data.replace("|", "\\|") if self.tables else data)

        def _table(self, rows: list) -> None:
            rows = [[" ".join("".join(c).split()) for c in r] for r in rows if r]
            if not rows:
                return
            width = max(len(r) for r in rows)
            if self.lines and self.lines[-1]:
                self.lines.append("")
            for i, r in enumerate(rows):
                self.lines.append("| " + " | ".join(r + [""] * (width - len(r))) + " |")
                if i == 0:
                    self.lines.append("|" + " --- |" * width)
            self.lines.append("")

        def markdown(self) -> str:
            self._flush()
            text = "\n".join(self.lines)
            text = re.sub(r"(?<![*~])(\*\*\*\*|~~~~)(?![*~])", "", text)  # emphasis of nothing
            text = re.sub(r"\n{3,}", "\n\n", text)
            return text.strip("\n") + "\n"

    return EnmlToMarkdown


def enml_style(attrs: dict, name: str) -> bool:
    """Return whether an element's inline style sets the custom property `name` to true, as
    Evernote 10 marks a checklist (`<ul style="--en-todo:true;">`) and a ticked item
    (`<li style="--en-checked:true;">`); spaces and case do not matter."""
    for declaration in attrs.get("style", "").split(";"):
        key, _, value = declaration.partition(":")
        if key.strip().lower() == name:
            return value.strip().lower() == "true"
    return False


def enml_to_markdown(enml: str, media: Callable[[dict], str]) -> str:
    """Return the Markdown of an ENML note body; media(attrs) writes an en-media element.

    >>> enml = '<div><en-todo checked="true"/>milk</div><div><b>x</b></div>'
    >>> enml_to_markdown(f"<en-note>{enml}</en-note>", str)
    '- [x] milk\\n**x**\\n'
    """
    parser = _enml_parser()(media)
    parser.feed(enml)
    parser.close()
    return parser.markdown()


def _enex_time(text: str) -> str | None:
    try:
        return iso(
            dt.datetime.strptime(text.strip(), "%Y%m%dT%H%M%SZ").replace(tzinfo=dt.timezone.utc)
        )
    except ValueError:
        return None


ENEX_NOTE_FIELDS = frozenset(
    ("title", "content", "created", "updated", "tag", "source-url", "author")
)
ENEX_RESOURCE_FIELDS = frozenset(("mime", "file-name"))
ENEX_FIELD_CHARS = 4096  # a title, tag, date, link, author, type or file name: cut there
ENEX_QUIET_BYTES = 4 << 20  # the most expat may hold back in one token (a tag, a comment)


class _EnexStream:
    """An .enex fed to expat in chunks, what both of its readings share: the external
    DOCTYPE accepted and never fetched, an internal DTD subset (where entity bombs live)
    refused, and no token of over ENEX_QUIET_BYTES (expat holds a tag, an attribute, a
    comment or a declaration whole, while text and CDATA flow in pieces): past that with
    no element or text seen, 413. Handlers set `quiet` to 0."""

    def __init__(self):
        import xml.parsers.expat

        p = xml.parsers.expat.ParserCreate()
        p.SetParamEntityParsing(xml.parsers.expat.XML_PARAM_ENTITY_PARSING_NEVER)
        p.UseForeignDTD(False)
        p.StartDoctypeDeclHandler = self._doctype
        p.EntityDeclHandler = self._entity
        p.buffer_text = True
        self.parser, self.error = p, xml.parsers.expat.ExpatError
        self.quiet = 0  # bytes fed since expat last gave an element or text

    def _doctype(self, name, system_id, public_id, has_internal_subset) -> None:
        if has_internal_subset:
            raise import_refused("the .enex declares its own DTD (entities are not accepted)")

    def _entity(self, *args) -> None:
        raise import_refused("the .enex declares entities (not accepted)")

    def feed(self, data: bytes, final: bool = False) -> None:
        self.quiet += len(data)
        try:
            self.parser.Parse(data, final)
        except self.error as e:
            raise import_refused(f"the .enex is not well-formed XML ({e})") from None
        if self.quiet > ENEX_QUIET_BYTES:
            raise import_refused(
                f"the .enex holds a tag, comment or declaration of over "
                f"{ENEX_QUIET_BYTES >> 20} MiB (not what Evernote writes)",
                413,
            )


class EnexSurvey(_EnexStream):
    """The first reading of an .enex, before anything is written: its notes and resources
    counted (one past `most`, SERVICE_MAX_IMPORT_ENTRIES, with `counted` before it: 413
    at once) and the disk their import may take (import_need's rule, from the bytes each
    note's content and each resource's base64 take in the file). Only elements and their
    offsets are looked at: nothing is kept."""

    def __init__(self, most: int, counted: int = 0):
        super().__init__()
        p = self.parser
        p.buffer_size = BODY_CHUNK  # text is not read: the fewer calls, the better
        p.StartElementHandler, p.EndElementHandler = self._start, self._end
        p.CharacterDataHandler = self._text
        self.most, self.count, self.need = most, counted, 0
        self.at = 0  # where the content or data being read began

    def _text(self, data: str) -> None:
        self.quiet = 0

    def _start(self, tag: str, attrs: dict) -> None:
        self.quiet = 0
        if tag in ("note", "resource"):
            self.count += 1
            if self.count > self.most:
                raise import_too_many(self.most, "the .enex holds")
            self.need += DISK_BLOCK
        elif tag in ("content", "data"):
            self.at = self.parser.CurrentByteIndex

    def _end(self, tag: str) -> None:
        self.quiet = 0
        if tag == "content":
            self.need += note_need(self.parser.CurrentByteIndex - self.at)
        elif tag == "data":
            decoded = (self.parser.CurrentByteIndex - self.at) * 3 // 4
            self.need += note_need(decoded) - 2 * decoded  # a file: its blocks only

    def survey(self, read: Callable[[int], bytes], tick: Callable = lambda: None) -> EnexSurvey:
        """Read it all (tick() after each chunk: the command's progress lines); where it
        stops being well-formed (or declares a DTD), stop there: the import's own reading
        says so, at that place."""
        try:
            while chunk := read(BODY_CHUNK):
                self.feed(chunk)
                tick()
            self.feed(b"", final=True)
        except ApiError as e:
            if e.status_code != 400:
                raise
        return self


class EnexReader(_EnexStream):
    """Reads an .enex as a stream (expat, fed in chunks): one note at a time. Only what a
    note keeps is gathered (title, content, dates, tags, source, author; a resource's type
    and name), each bounded: a note's text at `note_limit` characters (past it the note
    is skipped, its text no more kept), any other field cut at ENEX_FIELD_CHARS. Each
    resource is decoded from base64 as it arrives into one spooled file per note, so
    neither a 200 MB export nor a 63 MB note sits in memory. HTML entities are mapped; a
    note or resource past `most` entries is 413 (EnexSurvey said so before, normally)."""

    def __init__(
        self,
        on_note: Callable[[dict], None],
        spool: Callable[[], Any],
        note_limit: int,
        most: int = 1 << 62,
        counted: int = 0,
    ):
        super().__init__()
        p = self.parser
        p.SkippedEntityHandler = self._skipped_entity
        p.StartElementHandler = self._start
        p.EndElementHandler = self._end
        p.CharacterDataHandler = self._text
        self.on_note, self.spool, self.note_limit = on_note, spool, note_limit
        self.most, self.count = most, counted
        self.path: list = []
        self.note: dict | None = None
        self.text: list = []
        self.kept = 0  # characters of the element being read kept so far; -1: none kept
        self.res: dict | None = None
        self.b64 = b""

    def _skipped_entity(self, name: str, is_parameter: bool) -> None:
        import html.entities

        code = html.entities.name2codepoint.get(name)
        if code is not None and not is_parameter:
            self._text(chr(code))

    def _counted(self) -> None:
        self.count += 1
        if self.count > self.most:
            raise import_too_many(self.most, "the .enex holds")

    def _start(self, tag: str, attrs: dict) -> None:
        self.quiet = 0
        self.path.append(tag)
        note = self.note
        if tag == "note":
            self._counted()
            self.note = {"title": "", "tags": [], "resources": [], "content": ""}
            self.note.update(over=None, chars=0, spool=None)
        elif tag == "resource" and note is not None:
            self._counted()
            md5 = hashlib.md5(usedforsecurity=False)
            self.res = {"mime": "", "name": "", "md5": md5, "size": 0, "start": 0}
        elif tag == "data" and self.res is not None:
            self.b64 = b""
            if note["spool"] is None and not note["over"]:
                note["spool"] = self.spool()  # None in a dry run: nothing is written
            if note["spool"] is not None:
                self.res["start"] = note["spool"].seek(0, io.SEEK_END)
        self.text = []
        fields = ENEX_RESOURCE_FIELDS if self.res is not None else ENEX_NOTE_FIELDS
        self.kept = 0 if note is not None and tag in fields and not note["over"] else -1

    def _text(self, data: str) -> None:
        self.quiet = 0
        if self.path[-1:] == ["data"] and self.res is not None:
            self._data(data)
        elif self.kept >= 0:
            self._keep(data)

    def _data(self, data: str) -> None:
        """A piece of a resource's base64: decoded, hashed, spooled."""
        raw = self.b64 + "".join(data.split()).encode("ascii", "ignore")
        cut = len(raw) - len(raw) % 4
        self.b64 = raw[cut:]
        try:
            chunk = base64.b64decode(raw[:cut])
        except ValueError:
            chunk = b""
        self.res["md5"].update(chunk)
        self.res["size"] += len(chunk)
        spool = self.note["spool"]
        if spool is not None and not self.note["over"]:
            spool.write(chunk)

    def _keep(self, data: str) -> None:
        """A piece of a field's text, kept within its bounds."""
        note, tag = self.note, self.path[-1]
        if tag == "content" or self.res is None:
            note["chars"] += len(data)
            if note["chars"] > self.note_limit:
                note["over"] = "over SERVICE_MAX_BODY_BYTES"
                self.kept, self.text = -1, []
                return
        if tag != "content":
            data = data[: ENEX_FIELD_CHARS - self.kept]
            if not data:
                return
        self.kept += len(data)
        self.text.append(data)

    def _end(self, tag: str) -> None:
        self.quiet = 0
        text = "".join(self.text) if self.kept > 0 else ""
        self.text, self.kept = [], -1
        self.path.pop()
        note, res = self.note, self.res
        if note is None:
            return
        if res is not None and tag != "resource":
            if tag == "mime":
                res["mime"] = text.strip()
            elif tag == "file-name":
                res["name"] = text.strip()
            return
        if tag == "resource" and res is not None:
            res["hash"] = res.pop("md5").hexdigest()
            note["resources"].append(res)
            self.res = None
        elif tag in ("title", "content", "created", "updated"):
            note[tag] = text
        elif tag == "tag":
            note["tags"].append(text.strip())
        elif tag in ("source-url", "author"):
            note[tag] = text.strip()
        elif tag == "note":
            self.note = None
            self.on_note(note)


MIME_EXTENSIONS = {v: k for k, v in ATTACHMENT_TYPES.items()}


def plan_enex(plan: ImportPlan, read: Callable[[int], bytes], name: str) -> None:
    """Import an .enex read from read(n) as it arrives: each note written when its end
    tag is read, its resources (spooled into one temp file) first."""
    spool_dir = plan.svc.config.state_dir

    def spool():
        return None if plan.dry_run else tempfile.TemporaryFile(dir=spool_dir)

    count = [0]
    limit = plan.svc.config.max_import_expanded_bytes
    seen = [0, 0]  # bytes read of the .enex, bytes of notes and files it gave

    def on_note(note: dict) -> None:
        count[0] += 1
        seen[1] += len(note["content"]) + sum(r["size"] for r in note["resources"])
        try:
            if seen[1] > import_budget(seen[0], limit):
                raise import_too_big(seen[1], seen[0], limit)
            _enex_note(plan, note, f"{name}: {_enex_title(note) or 'note ' + str(count[0])}")
        finally:
            if note["spool"] is not None:
                note["spool"].close()

    reader = EnexReader(on_note, spool, plan.max_note * 4, plan.most, plan.entries)
    with plan.writing():
        while chunk := read(BODY_CHUNK):
            seen[0] += len(chunk)
            reader.feed(chunk)
        reader.feed(b"", final=True)
    plan.entries = reader.count


def _enex_title(note: dict) -> str:
    """Return an .enex note's title, its spaces folded."""
    return " ".join(note["title"].split())


def _enex_note(plan: ImportPlan, note: dict, label: str) -> None:
    """Write one note of an .enex (its resources first), or skip it saying why."""
    if note["over"]:
        plan.skip(label, note["over"])
        return
    by_hash: dict = {}
    drafts = []
    for r in note["resources"]:
        leaf = import_segment(r["name"] or r["hash"])
        ext = _note_name_of(leaf)[1]
        if ext not in ATTACHMENT_TYPES:
            guess = MIME_EXTENSIONS.get(r["mime"])
            if guess is None:
                plan.skip(f"{label}: {leaf}", f"files of type {r['mime'] or '?'} are not imported")
                by_hash[r["hash"]] = (leaf, None, r)
                continue
            leaf = f"{leaf}.{guess}"
        opener = functools.partial(_Region, note["spool"], r["start"], r["size"])
        d = Draft(f"{label}: {leaf}#{r['hash']}", f"{plan.files_into}/{leaf}", open=opener)
        plan.name(d)
        by_hash[r["hash"]] = (leaf, d, r)
        drafts.append(d)

    def media(attrs: dict) -> str:
        found = by_hash.get((attrs.get("hash") or "").lower())
        if found is None:
            return ""
        leaf, d, r = found
        if d is None:
            return f"({leaf}: not imported)"
        bang = "!" if r["mime"].startswith("image/") else ""
        return f"{bang}[{leaf}]({link_token(d.source, leaf)})"

    try:
        body = enml_to_markdown(note["content"], media)
    except Exception as e:  # a broken note is skipped, the rest come in
        plan.skip(label, f"its content could not be read ({type(e).__name__})")
        return
    title = _enex_title(note)
    meta = {
        "tags": [t for t in note["tags"] if t],
        "created": _enex_time(note.get("created", "")),
        "updated": _enex_time(note.get("updated", "")),
        "source_url": note.get("source-url"),
        "author": note.get("author"),
        "source": "Evernote",
    }
    text = front_matter(meta) + (f"# {title}\n\n" if title else "") + body
    stem = import_segment(title_filename(title or body))
    d = Draft(label, f"{plan.into}/{stem}.md", text=text)
    plan.name(d)
    for f in drafts:
        plan.add_file(f)
    plan.add_note(d)


class _Region:
    """A note's resource: `size` bytes from `start` of the note's spooled file, handed to a
    `with` (the file stays open for the note's other resources, and is closed after)."""

    def __init__(self, f: Any, start: int, size: int):
        self.f, self.left = f, size
        f.seek(start)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(self.left if n is None or n < 0 else min(n, self.left))
        self.left -= len(data)
        return data

    def close(self) -> None:
        pass


class _NoClose:
    """A file handed to a `with` that must stay open (a spooled resource is closed later)."""

    def __init__(self, f: Any):
        self.f = f

    def __enter__(self):
        return self.f

    def __exit__(self, *exc) -> None:
        pass

    def read(self, n: int = -1) -> bytes:
        return self.f.read(n)

    def close(self) -> None:
        pass


# -- Joplin (.jex: a tar of items, each Markdown with its properties below) --------------------

JOPLIN_NOTE, JOPLIN_FOLDER, JOPLIN_RESOURCE, JOPLIN_TAG, JOPLIN_NOTE_TAG = 1, 2, 4, 5, 6
_JOPLIN_PROP_RE = re.compile(r"^([a-z_]+): ?(.*)$")
_JOPLIN_LINK_RE = re.compile(r"\(:/([0-9a-f]{32})\)")


def joplin_item(text: str) -> tuple:
    """Return (title, body, properties) of one Joplin item file."""
    lines = text.rstrip("\n").split("\n")
    props: dict = {}
    i = len(lines)
    while i > 0:
        m = _JOPLIN_PROP_RE.match(lines[i - 1])
        if not m:
            if lines[i - 1] == "" and props:
                i -= 1
            break
        props[m.group(1)] = m.group(2)
        i -= 1
    head = lines[:i]
    title = head[0] if head else ""
    body = "\n".join(head[2:] if len(head) > 1 and head[1] == "" else head[1:])
    return title, body.rstrip("\n"), props


def plan_joplin(plan: ImportPlan, source: ImportSource) -> None:
    """Import a Joplin export: notebooks as folders, tags, to-dos, resources, dates. The
    plan keeps of each item what naming needs (its kind, title, notebook); a note's text
    is read again when it is written."""
    items, files = _joplin_items(plan, source)
    drafts = _joplin_resource_drafts(plan, items, files)
    plan.load = functools.partial(_joplin_note_text, source, tags=_joplin_note_tags(items))
    drafts += _joplin_note_drafts(plan, items)
    plan.add_all(drafts)


# what the plan keeps of a Joplin item's properties, by its type (the rest is read again)
_JOPLIN_KEPT = {
    JOPLIN_NOTE: ("parent_id", "is_conflict"),
    JOPLIN_FOLDER: ("parent_id",),
    JOPLIN_RESOURCE: ("file_extension", "mime"),
    JOPLIN_NOTE_TAG: ("note_id", "tag_id"),
}


def _joplin_items(plan: ImportPlan, source: ImportSource) -> tuple:
    """Return ({id: (type, label, kept properties, entry)} of the export's items, {id: the
    entry} of its resources' files); a file that is neither is skipped. The label is a
    note's file stem (from its title, else its first line; its text is read again when it
    is written), any other item's title; the properties kept are _JOPLIN_KEPT's, in order."""
    items: dict = {}
    files: dict = {}
    for entry in source.entries:
        name = entry.name
        if name.startswith("resources/"):
            files[_note_name_of(name.rsplit("/", 1)[-1])[0]] = entry
            continue
        if not name.endswith(".md"):
            plan.skip(name, "not a Joplin item")
            continue
        try:
            title, body, props = joplin_item(decode_text(source.read(entry, plan.max_note * 4)))
        except ValueError:
            plan.skip(name, "over SERVICE_MAX_BODY_BYTES")
            continue
        kind = int(props["type_"]) if props.get("type_", "").isdigit() else 0
        kept = tuple(props.get(k, "") for k in _JOPLIN_KEPT.get(kind, ()))
        label = import_segment(title_filename(title or body)) if kind == JOPLIN_NOTE else title
        items[props.get("id", name[:-3])] = (kind, label, kept, entry)
        plan.looked()
    return items, files


def _joplin_resource_drafts(plan: ImportPlan, items: dict, files: dict) -> list:
    """Return the named drafts of the export's resources (its attached files)."""
    drafts = []
    for rid, (kind, title, kept, item) in items.items():
        if kind != JOPLIN_RESOURCE:
            continue
        extension, mime = kept
        entry = files.get(rid)
        ext = extension.lower() or MIME_EXTENSIONS.get(mime, "")
        if entry is None:
            plan.skip(item.name, "its file is missing from the export")
            continue
        if ext not in ATTACHMENT_TYPES:
            plan.skip(item.name, f"files ending .{ext or '(none)'} are not imported")
            continue
        stem = import_segment(_note_name_of(title)[0] if title else rid)
        d = Draft(rid, f"{plan.files_into}/{stem}.{ext}", open=entry.open, size=entry.size)
        plan.name(d)
        drafts.append(d)
    return drafts


def _joplin_note_drafts(plan: ImportPlan, items: dict) -> list:
    """Return the named drafts of the export's notes and to-dos (their entries, read when
    written); other items (settings, revisions, conflict copies) are skipped."""
    folders = {i: v for i, v in items.items() if v[0] == JOPLIN_FOLDER}
    drafts = []
    for nid, (kind, stem, kept, entry) in items.items():
        if kind != JOPLIN_NOTE:
            if kind not in (JOPLIN_FOLDER, JOPLIN_RESOURCE, JOPLIN_TAG, JOPLIN_NOTE_TAG):
                plan.skip(entry.name, "a Joplin item that is not a note (settings, revisions...)")
            continue
        parent, conflict = kept
        if conflict == "1":
            plan.skip(entry.name, "a Joplin conflict copy")
            continue
        segs = _joplin_folder(folders, parent)
        d = Draft(nid, "/".join([plan.into, *segs, stem + ".md"]), text=entry)
        plan.name(d)
        drafts.append(d)
    return drafts


def _joplin_note_tags(items: dict) -> dict:
    """Return {note id: the titles of its tags} of the export's note-tag items."""
    tags = {i: v[1] for i, v in items.items() if v[0] == JOPLIN_TAG}
    note_tags: dict = {}
    for kind, _, kept, _ in items.values():
        if kind == JOPLIN_NOTE_TAG and kept[1] in tags:
            note_tags.setdefault(kept[0], []).append(tags[kept[1]])
    return note_tags


def _joplin_folder(folders: dict, pid: str, depth: int = 0) -> list:
    """Return the folder segments of a notebook and the notebooks above it (32 at most)."""
    if pid not in folders or depth > 32:
        return []
    _, title, (parent,), _ = folders[pid]
    return [*_joplin_folder(folders, parent, depth + 1), import_segment(title)]


def _joplin_note_text(source: ImportSource, entry: ImportEntry, tags: Mapping) -> str:
    """Return a Joplin note as it is written, read again: its properties as front matter,
    a to-do's title as a task, links to resources as link tokens (their ids: the
    resources' drafts are named by them)."""
    title, body, props = joplin_item(decode_text(source.read(entry)))
    todo = props.get("is_todo") == "1"
    done = todo and props.get("todo_completed", "0") not in ("", "0")
    meta = {
        "tags": sorted(tags.get(props.get("id", entry.name[:-3]), [])),
        "created": props.get("user_created_time") or props.get("created_time"),
        "updated": props.get("user_updated_time") or props.get("updated_time"),
        "source_url": props.get("source_url"),
        "author": props.get("author"),
        "source": "Joplin",
    }
    body = _JOPLIN_LINK_RE.sub(lambda m: f"({link_token(m.group(1), ':/' + m.group(1))})", body)
    heading = f"- [{'x' if done else ' '}] {title}" if todo else f"# {title}"
    return front_matter(meta) + (heading + "\n\n" if title else "") + body + "\n"


IMPORT_PLANNERS = {
    "keep": plan_keep,
    "joplin": plan_joplin,
    "notion": functools.partial(plan_tree, kind="notion"),
    "obsidian": functools.partial(plan_tree, kind="obsidian"),
    "files": functools.partial(plan_tree, kind="files"),
    "notesvc": functools.partial(plan_tree, kind="notesvc"),
}


def import_into(svc: Any, raw: Any, kind: str, principal: Principal) -> str:
    """Return the folder an import goes to: `into`, or notes/imported/<kind> (a folder
    grant's: <its folder>/imported/<kind>; a person's: <home>/imported/<kind>); a folder
    outside the principal's reach is 404, one it may only read 403."""
    if raw in (None, ""):
        return f"{principal.home or NOTES}/imported/{kind}"
    folder = folder_path(raw if str(raw).startswith(NOTES) else f"{NOTES}/{str(raw).strip('/')}")
    if principal.whole:
        return folder
    holder = next((f for f in principal.folders if inside(folder, f)), None)
    if holder is None:
        raise not_found(f"no folder at {folder} (this key writes in its own folders only)")
    no_link_below(svc.notes.on_disk, holder, folder, "folder")
    if not principal.may_write(folder):
        raise ApiError(403, "FORBIDDEN", f"importing into {folder} needs the write scope there")
    return folder


def run_import(
    svc: Any,
    file: Any,
    filename: str,
    into: Any,
    dry_run: bool,
    principal: Principal = OWNER,
    progress: Callable | None = None,
) -> dict:
    """Import one file (a zip, a tar/.jex, an .enex, a Keep .json or a note); return the
    report. Refusals (400, 413, 415, 507) come before anything is written, in a dry run too:
    an archive is opened (its entries counted and their declared sizes bounded, together),
    the disk is asked for room, then every entry is read once (a lying or unreadable one
    refuses it); an .enex is read once through (its notes and resources counted, the
    room they need asked for) before it is read again to be written."""
    head = file.read(512)
    size = file.seek(0, io.SEEK_END)
    file.seek(0)
    form = sniff_import(head, filename)
    limit, most = svc.config.max_import_expanded_bytes, svc.config.max_import_entries
    leaf = import_segment(filename.replace("\\", "/").rsplit("/", 1)[-1] or "import")
    if form == "enex":
        opener = functools.partial(_from_start, file)
        return _import_enex(svc, [(leaf, opener)], into, dry_run, principal, progress)
    if form in ("keep", "text"):
        name = leaf if "." in leaf else f"{leaf}.{'json' if form == 'keep' else 'md'}"
        entry = ImportEntry(name, size, _from_start, ref=file)
        source = ImportSource([entry], "keep" if form == "keep" else "")
        import_room(svc, source.need())
    else:
        if form == "tar":
            source = ImportSource.from_tar(file, limit, size or 1, most)
        else:
            source = ImportSource.from_zip(file, limit, size or 1, most)
        try:
            import_room(svc, source.need())
            source.verify(form, progress)
        except ApiError:
            source.close()
            raise
    try:
        return import_source(svc, source, into, dry_run, principal, progress)
    finally:
        source.close()


def _from_start(file: Any) -> _NoClose:
    """Return an uploaded file from its start, for a `with` that must not close it."""
    file.seek(0)
    return _NoClose(file)


def import_source(
    svc: Any,
    source: ImportSource,
    into: Any,
    dry_run: bool,
    principal: Principal = OWNER,
    progress: Callable | None = None,
) -> dict:
    """Import the files of a checked source (see run_import)."""
    kind = import_kind(source)
    if kind == "evernote":
        files = [(e.name, e.open) for e in source.entries if e.name.endswith(".enex")]
        return _import_enex(svc, files, into, dry_run, principal, progress)
    where = NOTES if kind == "notesvc" else import_into(svc, into, kind, principal)
    plan = ImportPlan(svc, where, dry_run, progress)
    plan.grant = principal
    IMPORT_PLANNERS[kind](plan, source)
    return plan.report(kind)


def _import_enex(svc, files: list, into, dry_run, principal, progress) -> dict:
    """Import .enex files [(name, opener)], each opened twice: surveyed (counted, the disk
    asked for room) all before the first note is written, then read to be written."""
    plan = ImportPlan(svc, import_into(svc, into, "evernote", principal), dry_run, progress)
    counted, need = 0, IMPORT_DISK_SLACK
    for _, opener in files:
        with opener() as f:
            survey = EnexSurvey(plan.most, counted).survey(f.read, lambda: plan.progress(plan))
        counted, need = survey.count, need + survey.need
    import_room(svc, need)
    for name, opener in files:
        try:
            with opener() as f:
                plan_enex(plan, f.read, name)
        except ApiError as e:
            if not (plan.created or plan.attachments) or e.status_code != 400:
                raise
            plan.skip(name, f"stopped: {e.message.removeprefix('nothing was imported: ')}")
    return plan.report("evernote")


def import_path(svc: Any, path: Path, into: Any, dry_run: bool, progress=None) -> dict:
    """Import a folder or a file on this machine (the command line, on its own), bounded
    as an upload is."""
    if path.is_dir():
        skipped: list = []
        source = ImportSource.from_folder(path, skipped, svc.config.max_import_entries)
        total = source.declared()
        if total > svc.config.max_import_expanded_bytes:
            raise import_refused(
                f"the folder holds more than {svc.config.max_import_expanded_bytes} bytes "
                "(SERVICE_MAX_IMPORT_EXPANDED_BYTES)",
                413,
            )
        import_room(svc, source.need())
        report = import_source(svc, source, into, dry_run, OWNER, progress)
        report["skipped"] = skipped + report["skipped"]
        return report
    with open(path, "rb") as f:
        return run_import(svc, f, path.name, into, dry_run, OWNER, progress)
