"""The Plugin record, loading, links and the built-in plugins."""

from __future__ import annotations

import array
import collections
import dataclasses
import importlib.util
import posixpath
import re
import urllib.parse
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Callable

from notesvc.boot import bottle, log
from notesvc.errors import ApiError, not_found, ok
from notesvc.grants import Principal, request_principal, visible_note
from notesvc.notes.paths import (
    ATTACHMENT_TYPES,
    ATTACHMENTS,
    DAILY_FOLDER,
    MAX_SCAN_CHARS,
    NOTE_PATH_PARAM,
    NOTES,
    day_note,
    note_tags,
)
from notesvc.providers.agent import AGENT_PROVIDERS
from notesvc.providers.base import TOOLS, collecting_registrations
from notesvc.providers.capture import daily_folder, local_now
from notesvc.providers.channels import CHANNEL_PROVIDERS, unbind_chats, unlink_person
from notesvc.providers.embed import build_embedder
from notesvc.providers.polling import ChannelPollers
from notesvc.providers.reader import FileTextReader
from notesvc.providers.reminders import ReminderScheduler
from notesvc.service import Service, plugins_dir
from notesvc.settings import Config

# -- Plugins -------------------------------------------------------------------------------
#
# A plugin is a small record: hooks called after notes change, routes under
# /api/v1/plugins/<name>/..., and (through the registries above) agent or channel
# providers. The built-ins register exactly like a third-party file does.

HOOKS = ("note_saved", "note_moved", "note_deleted", "note_restored")
# note_saved(svc, path, content)    after a note is created, updated or appended to
# note_moved(svc, old_path, new_path)
# note_deleted(svc, path)
# note_restored(svc, path, content) after a note is restored from the trash or a version
#                                   (note_saved is not called for it)
PLUGIN_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,31}\Z")


@dataclasses.dataclass(frozen=True)
class PluginRoute:
    method: str
    path: str  # a Bottle rule below /api/v1/plugins/<name>; "" is the plugin's own page
    handler: Callable  # (svc, **url_args) -> dict
    summary: str = ""
    status: int = 200  # documented success status (200 is always documented too)
    params: dict | None = None  # JSON schemas of path/query parameters (OpenAPI), by name
    scope: str = "admin"  # what a grant needs to call it; a read or write route must keep
    # a folder grant inside its folder (request_principal())
    secret: bool = False  # its answer can carry a secret or a code: never gzipped


@dataclasses.dataclass(frozen=True)
class Plugin:
    name: str
    version: str = "1.0.0"
    description: str = ""
    hooks: dict = dataclasses.field(default_factory=dict)  # hook name -> function
    routes: tuple = ()  # PluginRoute
    builtin: bool = False
    error: str | None = None  # why it could not be loaded
    # what the plugin's file registered with @agent_provider / @channel_provider / @tool
    # (per app; its tools are offered while it is on)
    agent_providers: dict = dataclasses.field(default_factory=dict)
    channel_providers: dict = dataclasses.field(default_factory=dict)
    tools: dict = dataclasses.field(default_factory=dict)


PLUGINS: dict[str, Plugin] = {}  # the built-ins, registered like any plugin file's PLUGIN


def accept_plugin(plugin: Any, taken: Mapping[str, Plugin]) -> Plugin:
    """Return a plugin record checked like every plugin (built-in or file); ValueError if not."""
    if not isinstance(plugin, Plugin):
        raise TypeError("the file defines no PLUGIN = notesvc.Plugin(...)")
    if not PLUGIN_NAME_RE.match(plugin.name):
        raise ValueError(f"plugin name {plugin.name!r} is not lower-case-with-dashes")
    if plugin.name in taken:
        raise ValueError(f"a plugin named {plugin.name!r} exists already")
    unknown = set(plugin.hooks) - set(HOOKS)
    if unknown:
        raise ValueError(f"unknown hook(s): {', '.join(sorted(unknown))}")
    return dataclasses.replace(plugin, error=None)


def builtin_plugin(plugin: Plugin) -> Plugin:
    """Register a built-in plugin (datasette's DEFAULT_PLUGINS pattern)."""
    PLUGINS[plugin.name] = accept_plugin(dataclasses.replace(plugin, builtin=True), PLUGINS)
    return plugin


def load_plugins(folder: Path) -> dict[str, Plugin]:
    """Return the built-in plugins and the third-party ones of folder (*.py, each defining
    PLUGIN), by name. A file that fails to load is listed with its error.

    Providers a file registers with the decorators belong to its plugin alone.
    """
    found: dict = dict(PLUGINS)
    for path in sorted(folder.glob("*.py")) if folder.is_dir() else ():
        name = path.stem.lower().replace("_", "-")
        try:
            spec = importlib.util.spec_from_file_location(f"notesvc_plugin_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            with collecting_registrations() as registered:
                spec.loader.exec_module(module)
            plugin = accept_plugin(getattr(module, "PLUGIN", None), found)
            found[plugin.name] = dataclasses.replace(
                plugin,
                builtin=False,
                agent_providers=registered.get("agent", {}),
                channel_providers=registered.get("channel", {}),
                tools={
                    name: dataclasses.replace(t, plugin=plugin.name)
                    for name, t in registered.get("tool", {}).items()
                },
            )
            log.info("plugin %s %s loaded from %s", plugin.name, plugin.version, path.name)
        except Exception as e:
            log.exception("plugin file %s failed to load", path.name)
            found[name] = Plugin(name=name, builtin=False, error=f"{type(e).__name__}: {e}")
    return found


def build_service(config: Config, readonly: bool = False) -> Service:
    """Return the Service of config with its plugins and their providers (not started).

    readonly (the audit): the built-in plugins only, no plugin file is ever imported.
    """
    plugins = PLUGINS if readonly else load_plugins(plugins_dir(config))
    svc = Service(config, plugins, *provider_registries(plugins), readonly=readonly)
    svc.grants.on_revoke.append(unbind_chats(svc.channel_providers))  # its chats go with it
    svc.people.on_remove.append(unlink_person(svc.channel_providers))  # theirs with them
    svc.pollers = ChannelPollers(svc)
    svc.reminders = ReminderScheduler(svc)
    svc.embedder = build_embedder(svc)
    svc.reader = FileTextReader(svc)  # the text inside PDFs and images, for search
    svc.reader.linkers = lambda files: file_linkers(svc, files)
    return svc


def provider_registries(plugins: Mapping[str, Plugin]) -> tuple:
    """Return (agent providers, channel providers, tools) of one app: built-ins, then its
    plugins'."""
    agents, channels, tools = dict(AGENT_PROVIDERS), dict(CHANNEL_PROVIDERS), dict(TOOLS)
    for plugin in plugins.values():
        agents.update(plugin.agent_providers)
        channels.update(plugin.channel_providers)
        tools.update(plugin.tools)
    return agents, channels, tools


# -- links ---------------------------------------------------------------------------------

# Both patterns run in linear time: link text, targets and fragments stop at any bracket,
# so the attempts started at different brackets never scan the same text (a run of `[`
# fails at once at each one), and no repeat nests in another. Whether a Markdown link
# points at a .md note (or an attachment) is decided afterwards (_md_target), not by
# backtracking.
WIKILINK_RE = re.compile(r"\[\[([^\[\]|#\n]+)((?:#[^\[\]|\n]*)?(?:\|[^\[\]\n]*)?)\]\]")
MDLINK_RE = re.compile(
    r"(\[[^\[\]\n]*\]\()(<[^<>\n]*>[^)\s<>\[\]]*|[^)\s<>\[\]]+)((?:\s+\"[^\"\n]*\")?\))"
)


def md_target(href: str) -> str | None:
    """Return the file part of a Markdown link's href (`<...>` kept), or None when it does not
    point at a .md file or an attachment's type; what follows it is a #fragment."""
    if href.startswith("<"):
        end = href.index(">") + 1
        target, inner, rest = href[:end], href[1 : end - 1], href[end:]
    else:
        target, _, rest = href.partition("#")
        inner, rest = target, href[len(target) :]
    if rest and not rest.startswith("#"):
        return None
    if len(inner) > 3 and inner.endswith(".md"):
        return target
    name = inner.rsplit("/", 1)[-1]
    return (
        target if "." in name[1:] and name.rpartition(".")[2].lower() in ATTACHMENT_TYPES else None
    )


def _attachment_name(target: str) -> bool:
    """Return whether a wikilink target names an attachment (`photo.jpg`, `trip/a.pdf`)."""
    name = target.rsplit("/", 1)[-1]
    ext = name.rpartition(".")[2].lower()
    return "." in name[1:] and ext != "md" and ext in ATTACHMENT_TYPES


class LinkResolver:
    """Resolves [[wikilinks]] (by name or path) and Markdown links to note paths, and to
    the attachment paths it is given (`![](../attachments/a.jpg)`, `![[a.jpg]]`)."""

    def __init__(self, paths: Iterable[str], attachments: Iterable[str] = ()):
        self.paths = {p.casefold(): p for p in paths}
        self.names: dict = {}
        for p in sorted(self.paths.values()):
            self.names.setdefault(p.rsplit("/", 1)[-1][:-3].casefold(), p)
        self.files: dict = {}  # an attachment's file name -> its path
        for p in sorted(attachments):
            self.paths[p.casefold()] = p
            self.files.setdefault(p.rsplit("/", 1)[-1].casefold(), p)

    def wikilink(self, target: str) -> str | None:
        t = target.strip()
        if _attachment_name(t):
            if "/" not in t:
                return self.files.get(t.casefold())
            t = t if t.startswith(f"{ATTACHMENTS}/") else f"{ATTACHMENTS}/{t.lstrip('/')}"
            return self.paths.get(t.casefold())
        if t.casefold().endswith(".md"):
            t = t[:-3]
        if "/" in t:
            t = t if t.startswith(f"{NOTES}/") else f"{NOTES}/{t.lstrip('/')}"
            return self.paths.get(f"{t}.md".casefold())
        return self.names.get(t.casefold())

    def mdlink(self, href: str, source: str) -> str | None:
        href = urllib.parse.unquote(href.strip("<>"))
        if "://" in href or href.startswith("mailto:"):
            return None
        if href.startswith("/"):
            href = href.lstrip("/")
            own = href.startswith((f"{NOTES}/", f"{ATTACHMENTS}/"))
            candidate = href if own else f"{NOTES}/{href}"
        else:
            candidate = posixpath.normpath(posixpath.join(posixpath.dirname(source), href))
        return self.paths.get(candidate.casefold())

    def links(self, text: str, source: str) -> set:
        """Return the paths a note's text links to (in its first MAX_SCAN_CHARS)."""
        return self.resolve(link_refs(text), source)

    def resolve(self, refs: tuple, source: str) -> set:
        """Return the paths link_refs' (wikilinks, Markdown targets) of `source` lead to."""
        wikis, targets = refs
        out = {self.wikilink(w) for w in wikis} | {self.mdlink(t, source) for t in targets}
        out.discard(None)
        out.discard(source)
        return out


def link_refs(text: str) -> tuple:
    """Return a note's links as written: ([[wikilink]] targets, Markdown link targets), each
    once, in its first MAX_SCAN_CHARS; LinkResolver.resolve says where they lead."""
    text = text[:MAX_SCAN_CHARS]
    wikis = dict.fromkeys(m.group(1) for m in WIKILINK_RE.finditer(text))
    targets = map(md_target, (m.group(2) for m in MDLINK_RE.finditer(text)))
    return tuple(wikis), tuple(dict.fromkeys(t for t in targets if t))


class _Kept:
    """What a plugin keeps between looks: the index generation it holds for, its answer, the
    key of every note (8 bytes each: path, size and mtime hashed) and what it took of the
    notes that gave something."""

    __slots__ = ("generation", "keys", "taken", "value")

    def __init__(self, generation: int, value: Any, keys: array.array, taken: dict):
        self.generation, self.value, self.keys, self.taken = generation, value, keys, taken


def derived(svc: Service, name: str, build: Callable) -> Any:
    """Return build([(path, title, text)] of every indexed note), kept until the index changes.

    Only taking the snapshot holds the index lock (inside index.documents()); the build runs
    without it, so searches and writes never wait for a plugin's computation. Builds take
    turns, so concurrent callers wait for one build instead of repeating it.
    """
    cached = svc.plugin_cache.get(name)
    if cached and cached[0] == svc.index.generation:
        return cached[1]
    with svc.plugin_build_lock:
        cached = svc.plugin_cache.get(name)
        if cached and cached[0] == svc.index.generation:
            return cached[1]
        generation, notes = svc.index.documents()
        value = build(notes)
        svc.plugin_cache[name] = (generation, value)
        return value


def derived_per_note(svc: Service, name: str, take: Callable, combine: Callable) -> Any:
    """Return combine([every indexed path], {path: take(text)}), kept until the index changes:
    derived() for data that is made of what each note gives.

    take(text) says what a note gives (None or empty: nothing); it is asked again only for
    the notes whose key changed since the last look (the index's note keys: path, size and
    mtime hashed), so after a save at 100,000 notes one note is read, not every one, and no
    more than one note's text is held at a time. The index lock is held only to take the
    snapshot; looks take turns, like derived()'s builds.
    """
    slot = ("per note", name)  # beside derived()'s names: a plugin may use any string
    kept = svc.plugin_cache.get(slot)
    if kept and kept.generation == svc.index.generation:
        return kept.value
    with svc.plugin_build_lock:
        kept = svc.plugin_cache.get(slot)
        if kept and kept.generation == svc.index.generation:
            return kept.value
        generation, notes = svc.index.note_keys()
        known = set(kept.keys) if kept else set()
        before = kept.taken if kept else {}
        keys, taken, paths = array.array("q"), {}, []
        for key, path, read in notes:
            paths.append(path)
            if key is not None and key in known:
                keys.append(key)
                if path in before:
                    taken[path] = before[path]
                continue
            note = read()
            if note is None:  # unreadable now: what it gave last time, and read next time
                if path in before:
                    taken[path] = before[path]
                continue
            if key is not None:  # remembered: read again once its file changes
                keys.append(key)
            got = take(note.text[:MAX_SCAN_CHARS])
            if got:
                taken[path] = got
        del known
        value = combine(paths, taken)
        svc.plugin_cache[slot] = _Kept(generation, value, keys, taken)
        return value


def link_graph(svc: Service) -> dict:
    """Return {note path: set of notes linking to it}, cached until the index changes.

    Each note's links are kept as written and resolved again at every look: a note added
    or moved changes where another note's [[name]] leads without that note changing."""

    def take(text: str) -> tuple | None:
        refs = link_refs(text) if "[[" in text or ".md" in text else ((), ())
        return refs if any(refs) else None

    def combine(paths: list, refs: dict) -> dict:
        resolver = LinkResolver(paths)
        graph: dict = collections.defaultdict(set)
        for path, written in refs.items():
            for target in resolver.resolve(written, path):
                graph[target].add(path)
        return graph

    return derived_per_note(svc, "links", take, combine)


def rewrite_links(
    text: str,
    source: str,
    old: str,
    new: str,
    resolver: LinkResolver,
    moved_from: str | None = None,
) -> str:
    """Return text with its links to `old` pointing at `new` (in the style they were written).

    `moved_from`: the note itself moved from there, so its relative links are rebased.
    """

    def wiki(m: re.Match) -> str:
        target = m.group(1)
        if resolver.wikilink(target) != old:
            return m.group(0)
        t = target.strip()
        if _attachment_name(t):  # ![[photo.jpg]]: by file name, or by path
            if "/" not in t:
                replacement = new.rsplit("/", 1)[-1]
            else:
                own = t.startswith(f"{ATTACHMENTS}/")
                replacement = new if own else new[len(ATTACHMENTS) + 1 :]
        elif "/" not in t:
            replacement = new.rsplit("/", 1)[-1][:-3]
        else:
            replacement = new if t.startswith(f"{NOTES}/") else new[len(NOTES) + 1 :]
            if not t.casefold().endswith(".md"):
                replacement = replacement[:-3]
        return f"[[{replacement}{m.group(2)}]]"

    def markdown(m: re.Match) -> str:
        href = md_target(m.group(2))
        if href is None:
            return m.group(0)
        fragment = m.group(2)[len(href) :]
        base = moved_from or source
        target = resolver.mdlink(href, base)
        if target is None or (target != old and not moved_from):
            return m.group(0)
        target = new if target == old else target
        bare = href.strip("<>")
        if bare.startswith("/") and target.startswith(f"{ATTACHMENTS}/"):
            replacement = "/" + target
        elif bare.startswith("/"):
            replacement = "/" + (
                target if bare.lstrip("/").startswith(f"{NOTES}/") else target[len(NOTES) + 1 :]
            )
        else:
            replacement = posixpath.relpath(target, posixpath.dirname(source))
        if "%" in bare or " " not in replacement:
            replacement = urllib.parse.quote(replacement, safe="/")
        if href.startswith("<"):
            replacement = f"<{urllib.parse.unquote(replacement)}>"
        return f"{m.group(1)}{replacement}{fragment}{m.group(3)}"

    return MDLINK_RE.sub(markdown, WIKILINK_RE.sub(wiki, text))


def update_links(svc: Service, old: str, new: str, linking: set) -> list:
    """Rewrite the links to `old` (a note or an attachment) in each linking note (one atomic
    write each); a moved note's own relative links are rebased too."""
    note, sees = old.startswith(f"{NOTES}/"), request_principal().sees
    resolver = LinkResolver(  # a folder grant's: what the rewritten text shows is its own
        [p for p in [*svc.index.paths(), *([old] if note else [])] if sees(p)],
        [p for p in [*svc.attachments.paths(), *([] if note else [old])] if sees(p)],
    )
    changed = []
    for source in sorted(linking | ({new} if note else set())):
        moved_from = old if source == new else None

        def change(text: str, source=source, moved_from=moved_from) -> str:
            return rewrite_links(text, source, old, new, resolver, moved_from)

        try:
            if svc.notes.rewrite(source, change):
                changed.append(source)
        except ApiError as e:  # a linking note vanished or is not UTF-8: leave it be
            log.warning("links in %s not updated: %s", source, e.message)
    return changed


def relinkable(principal: Principal) -> Callable:
    """Return test(path): whether a move by `principal` may rewrite the links of the note
    at path (the notes it may write; the owner's: every one)."""
    return (lambda _path: True) if principal.whole else principal.may_write


def move_and_relink(
    svc: Service, path: str, new: str, if_match: str | None = None, relink: bool = False
) -> dict:
    """Move a note (If-Match honoured; never overwrites) and, with `relink`, point the links
    to it at its new path; return its record there with `from` (and `linksUpdated`).
    Only notes the mover may write are rewritten: a folder grant's, inside its folder; a
    person's, in their reach and never in a folder shared with them for reading."""
    writes = relinkable(request_principal())
    linking = set(filter(writes, link_graph(svc).get(path, ()))) if relink else set()
    rec = svc.notes.move(path, new, if_match)
    if relink and new != path:
        rec["linksUpdated"] = update_links(svc, path, new, linking - {path})
        if new in rec["linksUpdated"]:  # the note's own relative links were rebased
            rec = {**svc.notes.get(new), "from": path, "linksUpdated": rec["linksUpdated"]}
    return rec


def attachment_refs(svc: Service) -> dict:
    """Return {note: (wikilink targets, Markdown targets)} of the notes' links that may name
    an attachment, as written (derived_per_note: after a save, one note is read again)."""

    def take(text: str) -> tuple | None:
        if "[[" not in text and "](" not in text:
            return None
        wikis, targets = link_refs(text)
        wikis = tuple(w for w in wikis if _attachment_name(w.strip()))  # as wikilink() tells
        targets = tuple(t for t in targets if not t.rstrip(">").casefold().endswith(".md"))
        return (wikis, targets) if wikis or targets else None

    return derived_per_note(svc, "attachment links", take, lambda _paths, refs: refs)


def attachment_linkers(svc: Service, path: str) -> set:
    """Return the notes that link to an attachment (Markdown links, images, ![[embeds]]),
    resolved at every look against the attachments there are now."""
    refs = attachment_refs(svc)
    resolver = LinkResolver(svc.index.paths(), [*svc.attachments.paths(), path])
    return {source for source, written in refs.items() if path in resolver.resolve(written, source)}


def file_linkers(svc: Service, files: set) -> dict:
    """Return {file: the notes linking it} for some of the files the attachment reader
    knows (their names resolved among those files: the reader's, every PDF and image);
    the whole map is kept until the notes or the reader's files change."""
    reader = svc.reader
    key = (svc.index.generation, reader.files_generation)  # (not the pages read meanwhile)
    kept = svc.plugin_cache.get("file linkers")
    if kept is None or kept[0] != key:
        refs = attachment_refs(svc)
        resolver = LinkResolver((), list(reader.files))
        found: dict = {}
        for source, written in refs.items():
            for target in resolver.resolve(written, source):
                found.setdefault(target, set()).add(source)
        kept = (key, found)
        svc.plugin_cache["file linkers"] = kept
    return {f: kept[1].get(f, set()) for f in files}


# -- built-in plugins -----------------------------------------------------------------------


def titled(svc: Service, paths: Iterable[str]) -> list:
    """Return [{path, title}] of the paths that are (still) indexed."""
    out = [{"path": p, "title": svc.index.title_of(p)} for p in paths]
    return [item for item in out if item["title"] is not None]


def get_backlinks(svc: Service, path: str) -> dict:
    path = visible_note(svc.notes, path)
    if not svc.notes.exists(path):
        raise not_found(f"no note at {path}")
    sees = request_principal().sees
    return {
        "path": path,
        "backlinks": titled(svc, sorted(filter(sees, link_graph(svc).get(path, ())))),
    }


builtin_plugin(
    Plugin(
        "backlinks",
        description="notes that link to a note, by [[wikilink]] or Markdown link",
        routes=(
            PluginRoute(
                "GET",
                "/<path:path>",
                get_backlinks,
                "Notes linking to a note",
                params={"path": NOTE_PATH_PARAM},
                scope="read",
            ),
        ),
    )
)


def tag_map(svc: Service) -> dict:
    """Return {tag: sorted note paths}, cached until the index changes."""

    def take(text: str) -> tuple | None:
        return tuple(note_tags(text)) if "#" in text or text.startswith("---") else None

    def combine(paths: list, found: dict) -> dict:
        tags: dict = collections.defaultdict(list)
        for path in sorted(found):
            for tag in found[path]:
                tags[tag].append(path)
        return tags

    return derived_per_note(svc, "tags", take, combine)


def _visible_tags(svc: Service) -> dict:
    """Return {tag: note paths} the request's grant sees (a folder grant: its folder's)."""
    who = request_principal()
    tags = tag_map(svc)
    if who.whole:
        return tags
    seen = {t: [p for p in paths if who.sees(p)] for t, paths in tags.items()}
    return {t: paths for t, paths in seen.items() if paths}


def list_tags(svc: Service) -> dict:
    tags = _visible_tags(svc)
    return {"tags": [{"tag": t, "count": len(tags[t])} for t in sorted(tags)]}


def get_tag(svc: Service, tag: str) -> dict:
    tag = tag.lstrip("#").lower()
    paths = _visible_tags(svc).get(tag)
    if not paths:
        raise not_found(f"no note is tagged #{tag}")
    return {"tag": tag, "notes": titled(svc, paths)}


builtin_plugin(
    Plugin(
        "tags",
        description="#tags outside code and front-matter tags:",
        routes=(
            PluginRoute("GET", "", list_tags, "All tags with their counts", scope="read"),
            PluginRoute("GET", "/<tag:path>", get_tag, "Notes with a tag", scope="read"),
        ),
    )
)


def daily_today(svc: Service) -> bytes:
    """POST /plugins/daily/today: today's note of whoever asks (a person's in their home,
    <home>/daily/YYYY-MM-DD.md; a folder grant's stays notes/daily: 404), created when
    missing."""
    who = request_principal()
    folder = daily_folder(who) if who.person else DAILY_FOLDER
    path, heading = day_note(local_now(svc).date(), folder)
    path = visible_note(svc.notes, path, who, write=True)
    try:
        rec, status = svc.notes.create(path, f"# {heading}\n\n"), 201
    except ApiError as e:
        if e.code != "CONFLICT":
            raise
        rec, status = svc.notes.get(path), 200  # it was there already: not created now
    bottle.response.set_header("ETag", rec["etag"])
    return ok(rec, status)


builtin_plugin(
    Plugin(
        "daily",
        description="a note per day: notes/daily/YYYY-MM-DD.md (a person's: <home>/daily/)",
        routes=(
            PluginRoute(
                "POST",
                "/today",
                daily_today,
                "Today's note, created if missing",
                201,
                scope="write",
            ),
        ),
    )
)
