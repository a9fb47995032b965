"""Service: the object every handler gets as `svc`."""

from __future__ import annotations

import collections
import contextlib
import hmac
import os
import re
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

from notesvc.auth import Lockout, StateStore, jwt_decode, relay_origin_of
from notesvc.boot import API, KEY_HEADER, bottle, log
from notesvc.errors import ApiError, bad_request
from notesvc.grants import (
    OWNER,
    GrantStore,
    Principal,
    acting_via,
    request_principal,
)
from notesvc.helpers import (
    Machine,
    base_url_of,
    client_address,
    ip_of,
    is_home_network,
    is_trusted_proxy,
    key_hash,
    lan_address,
    names_this_machine,
    release_memory,
    request_host,
    setup_client_ip,
    setup_loopback_reason,
)
from notesvc.notes.history import DAY_SECONDS, HeadStoreError, HistoryStore
from notesvc.notes.paths import ATTACHMENTS
from notesvc.notes.store import AttachmentStore, NoteStore
from notesvc.notes.trash import ChangeJournal, Trash, expire_loop
from notesvc.oauth import mcp_challenge
from notesvc.people import PeopleStore
from notesvc.search.index import SearchIndex
from notesvc.settings import SETTINGS, Config, ConfigError

# -- Service -------------------------------------------------------------------------------
#
# The one object every handler, provider, plugin and audit check gets as `svc`: the
# configuration, the state, the notes, the index, the lockout and the app's own
# registries (built-ins plus what its plugins brought). Built by create_app() (or, read
# only, by the audit); its threads start in start().


def plugins_dir(config: Config) -> Path:
    """Return the folder third-party plugins are loaded from."""
    return (
        Path(config.plugins_dir).expanduser()
        if config.plugins_dir
        else config.state_dir / "plugins"
    )


def check_agent_config(config: Config, providers: Mapping[str, Any]) -> None:
    """Raise ConfigError when the agent provider is unknown or lacks a setting it requires."""
    provider = providers.get(config.agent_provider)
    if provider is None:
        names = ", ".join(sorted(providers))
        raise ConfigError(
            f"SERVICE_AGENT_PROVIDER: {config.agent_provider!r} is not one of {names}"
        )
    env_of = {s.name: s.env for s in SETTINGS}
    for name in provider.requires:
        if not getattr(config, name):
            raise ConfigError(f"{env_of[name]}: required by the {provider.name} agent provider")


def current_request_id() -> str:
    """Return the current request's id (for log lines written below a handler)."""
    try:
        return bottle.request.environ.get("notesvc.request_id", "-")
    except (AttributeError, RuntimeError, KeyError):
        return "-"


class Idempotency:
    """The answers to recent writes sent with an Idempotency-Key header: a client replaying
    its outbox after a lost answer gets the first answer again, and nothing is done twice
    (no second note, no second conflict copy). Memory only; a day at most, and at most
    IDEMPOTENCY_BYTES of answers (the oldest go first)."""

    def __init__(self, clock: Callable = time.monotonic):
        self.clock = clock
        self._kept: collections.OrderedDict = collections.OrderedDict()
        self._running: dict = {}  # key -> [its lock, requests holding or waiting]
        self._bytes = 0
        self._lock = threading.Lock()

    @staticmethod
    def key(route: Any, environ: dict) -> tuple | None:
        raw = environ.get("HTTP_IDEMPOTENCY_KEY", "")
        if not raw:
            return None
        if not re.fullmatch(r"[!-~]{1,100}", raw):
            raise bad_request("Idempotency-Key must be 1-100 printable ASCII characters")
        who = environ.get("notesvc.principal", OWNER)
        where = environ.get("SCRIPT_NAME", "") + environ.get("PATH_INFO", "")
        return (who.grant_id or who.kind, route.method, where, raw)

    @contextlib.contextmanager
    def running(self, key: tuple | None):
        """Hold the key while its request runs: the same key sent again at once (two tabs
        sending one outbox) waits for the first answer instead of doing it twice."""
        if key is None:
            yield
            return
        with self._lock:
            held = self._running.setdefault(key, [threading.Lock(), 0])
            held[1] += 1
        got = held[0].acquire(timeout=60)
        try:
            yield
        finally:
            if got:
                held[0].release()
            with self._lock:
                held[1] -= 1
                if not held[1]:
                    del self._running[key]

    def get(self, key: tuple) -> tuple | None:
        with self._lock:
            self._expire()
            found = self._kept.get(key)
            return found[1] if found else None

    def put(self, key: tuple, status: int, headers: list, body: bytes) -> None:
        if len(body) > IDEMPOTENCY_BYTES // 8:
            return
        with self._lock:
            self._kept[key] = (self.clock(), (status, headers, body))
            self._bytes += len(body)
            self._expire()

    def _expire(self) -> None:
        now = self.clock()
        while self._kept:
            at, answer = next(iter(self._kept.values()))
            if now - at < DAY_SECONDS and self._bytes <= IDEMPOTENCY_BYTES:
                break
            self._kept.popitem(last=False)
            self._bytes -= len(answer[2])


IDEMPOTENCY_BYTES = 8 << 20


class Service:
    """Everything one running app shares across its threads.

    plugins: every plugin of this app, built-in and third-party (load_plugins);
    agent_providers / channel_providers / tools: the registries this app sees (built-ins
    plus its plugins' own). `readonly` (the audit): the state is opened without writing,
    nothing is created, swept, indexed or started.
    """

    def __init__(
        self,
        config: Config,
        plugins: Mapping[str, Any],
        agent_providers: Mapping[str, Any],
        channel_providers: Mapping[str, Any],
        tools: Mapping[str, Any] | None = None,
        readonly: bool = False,
    ):
        self.config = config
        self.readonly = readonly
        self.started = time.time()
        self.setup_opened = time.monotonic()  # the setup window runs from here
        self._setup_loopback_only: bool | None = None  # decided once (setup_loopback_only)
        self.plugins = dict(plugins)
        self.agent_providers = dict(agent_providers)
        self.channel_providers = dict(channel_providers)
        self.tools = dict(tools or {})  # what MCP clients and the agent may call (TOOLS)
        self.plugin_errors: dict = {}  # name -> the last error a hook raised
        self.plugin_cache: dict = {}  # what built-in plugins derive from the index
        self.plugin_build_lock = threading.RLock()  # derived(): one build at a time
        self.routes: tuple = ()  # the app's Route table (NotesApp sets it)
        self.relay_client: Any = None  # a RelayClient while `serve` is connected to a relay
        self.idempotency = Idempotency()
        self.query_secret_seen_at = 0.0  # last webhook call that carried ?secret=
        self.service_uid = os.geteuid() if hasattr(os, "geteuid") else -1  # the audit's
        self.recorded_secrets: dict | None = None  # the audit: a running server's figures
        self.lockout = Lockout()
        self.last_sync: dict = {}
        self.index = SearchIndex()  # in memory until start() opens <state>/index
        self._stop = threading.Event()
        self._threads: list = []
        self._imports = 0  # imports writing now (see importing())
        self._imports_lock = threading.Lock()
        check_agent_config(config, self.agent_providers)
        if readonly:
            self.state = StateStore.open_existing(config.state_dir, readonly=True)
        else:
            config.notes_dir.parent.mkdir(parents=True, exist_ok=True)
            config.notes_dir.mkdir(mode=0o700, exist_ok=True)  # a new one: private (the audit)
            self.state = StateStore(config.state_dir)
        state = config.state_dir  # history, trash and the change feed live with the notes:
        self.history = HistoryStore(
            state / "history", config.history_max_versions, config.history_days
        )
        self.trash = Trash(state / "trash", config.trash_days)
        self.journal = ChangeJournal(state / "changes.log")
        self.notes = NoteStore(config.notes_dir, state / "trash", self.history, self.journal)
        self._acting = threading.local()  # acting_as: who a change is saved by, overridden
        self.notes.actor = self.saved_by  # versions name who saved them
        self.attachments = AttachmentStore(config.root / ATTACHMENTS, config.state_dir / "trash")
        # the other files beside the notes (an image in a vault, put there over WebDAV)
        self.note_files = AttachmentStore(
            config.notes_dir, config.state_dir / "trash", nfd_names=True
        )
        self.grants = GrantStore(  # scoped keys, OAuth grants, share links
            self.state, idle_days=config.device_idle_days
        )
        self.people = PeopleStore(self.state, self.grants, self.notes)  # and shared folders
        self.notes.person = self.acting_person  # the feed names a person's changes
        # who sees what changed: the waiting change feeds look at their principal again
        self.grants.after_revoke.append(self.journal.nudge)
        self.people.after_change.append(self.journal.nudge)
        # A key revoked (or a share removed) mid-request writes nothing once that answered:
        # each change is entered through writing(), and revocations drain() what it let in.
        self._gate = threading.Condition()
        self._writing: dict = {}  # grant id -> [changes under way, its person]
        for store in (self.notes, self.attachments, self.note_files):
            store.guard = self.writing
        self.grants.on_ended.append(lambda gone: self.drain(grants=gone))
        self.people.drain = self.drain
        # Background components of later sections, composed by build_service():
        self.pollers: Any = None  # ChannelPollers: a thread per channel in polling mode
        self.reminders: Any = None  # ReminderScheduler: ⏰ lines sent through the channels
        self.embedder: Any = None  # Embedder: the notes' vectors, when embeddings are on
        self.reader: Any = None  # FileTextReader: the text inside PDFs and images
        # ... and made on first use, by the function named (a request of theirs):
        self.task_book: Any = None  # TaskBook: the tasks' UIDs and sync tokens (task_book)
        self.dav: Any = None  # DavState: WebDAV's locks, properties, ETags (dav_state)
        self.suggestions: Any = None  # SuggestionStore: edits waiting for approval
        self.mcp_sessions: Any = None  # McpSessions: MCP's sessions, streams, subscriptions

    @contextlib.contextmanager
    def acting_as(self, name: str | None):
        """Within it, changes are saved by `name` (history's savedBy): an accepted
        suggestion names the connector that made it, not the person who accepted it."""
        before = getattr(self._acting, "name", None)
        self._acting.name = name
        try:
            yield
        finally:
            self._acting.name = before

    def saved_by(self) -> str | None:
        """Return the name of the grant the current request acts for (a device's or a
        key's, an app's; a person's as `<person> · <device>`), as versions record it; None
        for the owner or outside a request."""
        acting = getattr(self._acting, "name", None)  # a suggestion accepted: its connector
        if acting is not None:
            return acting
        who, via = request_principal(), acting_via()
        if via:  # a chat bound to a person: "<person> · <channel>"
            person = self.people.get(who.person)
            return f"{person['name']} · {via}" if person else None
        grant_id = who.grant_id
        if not grant_id:
            return None
        data = self.state.read()
        for g in data.get("grants", []):
            if g["id"] == grant_id:
                name = (g.get("client") or {}).get("name") or g["name"]
                person = self.people.get(g.get("person"), data)
                return f"{person['name']} · {name}" if person else name
        return None

    def acting_person(self) -> dict | None:
        """Return {id, name} of the person the current request (or chat) acts for; None
        for the owner."""
        person = self.people.get(request_principal().person)
        return {"id": person["id"], "name": person["name"]} if person else None

    @contextlib.contextmanager
    def writing(self, path: str):
        """Around one change of `path` by the current request (the stores enter it under
        the path's lock, before they change anything): its key may still write there
        (GrantStore.still_writes: 401 revoked, 404/403 a person's share gone), and a
        revocation or a share's removal that ends that waits (drain) until the change is
        done. So once `DELETE /people/:id` or a members PUT answers, nothing more is
        written with what it took away, on any thread."""
        principal = request_principal()
        grant_id = principal.grant_id
        if not grant_id:  # the owner's own key (or no request): nothing to end
            yield
            return
        with self._gate:
            self.grants.still_writes(principal, path)
            entry = self._writing.setdefault(grant_id, [0, principal.person])
            entry[0] += 1
        try:
            yield
        finally:
            with self._gate:
                entry[0] -= 1
                if not entry[0]:
                    self._writing.pop(grant_id, None)
                    self._gate.notify_all()

    def drain(self, grants: Any = (), people: Any = (), timeout: float = 30.0) -> None:
        """Wait until the changes under way by these grants, or by any grant of these
        people, are done (called after the state change that ended or narrowed them)."""
        grants, people = set(grants), set(people) - {""}

        def busy() -> bool:
            return any(g in grants or e[1] in people for g, e in self._writing.items())

        with self._gate:
            if not self._gate.wait_for(lambda: not busy(), timeout):
                log.warning("writes begun before a revocation were still under way")

    def start(self) -> Service:
        """Sweep crash leftovers, bring the index up to date, start the background work."""
        if self.readonly or self._threads:
            return self
        _ = self.setup_loopback_only  # decided (and said in the log) at start, not later
        swept = self.notes.sweep_temp_files() + self.attachments.sweep_temp_files()
        if swept:
            log.info("removed %d temp files left by an interrupted write", swept)
        if self.history.enabled:
            try:
                self.history.heads.open()  # an older history's copies move in, once
            except HeadStoreError as e:  # only a cache: serve without it (a full disk?)
                log.warning("history: the copies of the notes are not available: %s", e)
        self.index = SearchIndex.open(self.config.state_dir, self.notes)
        self.notes.listeners.append(self._on_note_event)
        self.notes.after.append(self._run_hooks)
        self.journal.open()
        self.notes.after.append(self.grants.on_note_event)  # share links follow their note
        if not self.config.rescan_seconds:  # nothing else would check the files: now
            self.last_sync = self.sync_index()
        self.index.start()  # flushes, commits and merges in the background
        self._spawn(lambda: expire_loop(self.notes, self.trash, self._stop), "notesvc-expire")
        if self.config.rescan_seconds:  # its first check runs at once: searches need not wait
            self._spawn(self._rescan_loop, "notesvc-rescan")
        for component in (self.pollers, self.reminders, self.embedder, self.reader):
            if component is not None:
                component.start()
        return self

    def _spawn(self, target: Callable, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    # -- the search index ---------------------------------------------------------

    def _on_note_event(self, event: str, path: str, detail: Any) -> None:
        try:
            self._index_event(event, path, detail)
        except Exception:  # the write happened; the rescan sees the file differ and re-reads
            log.exception(
                "request %s: indexing %s failed; the next rescan retries",
                current_request_id(),
                path,
            )

    def _index_event(self, event: str, path: str, detail: Any) -> None:
        if event in ("saved", "restored"):
            content, st = detail
            self.index.add(path, content, st.st_size, st.st_mtime_ns)
        elif event == "moved":
            new, st = detail
            self.index.move(path, new, st.st_size, st.st_mtime_ns)
        elif event == "deleted":
            self.index.remove(path)

    # -- plugins ----------------------------------------------------------------

    def plugin_enabled(self, name: str) -> bool:
        plugin = self.plugins.get(name)
        switches = self.state.read().get("plugins", {})
        return plugin is not None and plugin.error is None and switches.get(name, True)

    def _run_hooks(self, event: str, path: str, detail: Any) -> None:
        hook = {
            "saved": "note_saved",
            "moved": "note_moved",
            "deleted": "note_deleted",
            "restored": "note_restored",
        }[event]
        args = {"deleted": lambda: (path,)}
        for plugin in self.plugins.values():
            fn = plugin.hooks.get(hook)
            if fn is None or not self.plugin_enabled(plugin.name):
                continue
            try:
                fn(self, *args.get(event, lambda: (path, detail[0]))())
            except Exception as e:  # a plugin's failure is its own: log it, list it, go on
                log.exception("plugin %s failed in %s for %s", plugin.name, hook, path)
                self.plugin_errors[plugin.name] = f"{hook}: {type(e).__name__}: {e}"[:300]

    def sync_index(self) -> dict:
        """Bring the index in line with the files; what other programs changed goes into the
        history and the change feed on the way, and the reminders look again."""
        found = self.index.sync(self.notes, observe=self.notes.observe)
        if found["read"] or found["removed"]:
            for component in (self.reminders, self.embedder):
                if component is not None:
                    component.look_again()
        return found

    @contextlib.contextmanager
    def importing(self):
        """Within: an import writes notes. The rescans wait until it is done: the store
        tells the index of each note it writes, and a check of a tree growing by thousands
        of files meanwhile costs memory and time for nothing."""
        with self._imports_lock:
            self._imports += 1
        try:
            yield
        finally:
            with self._imports_lock:
                self._imports -= 1

    def _rescan_loop(self) -> None:
        # The first check starts a second after start: the first searches of a restarted
        # server need not share the interpreter with it. A first start (nothing indexed
        # yet) has nothing to answer with: its check starts at once.
        empty = not self.index.stats().get("documents")
        if self._stop.wait(0 if empty else min(1.0, self.config.rescan_seconds)):
            return
        first = True
        while True:
            if self._imports and not first:  # see importing()
                if self._stop.wait(self.config.rescan_seconds):
                    return
                continue
            try:
                self.last_sync = self.sync_index()
                if first or self.last_sync.get("read") or self.last_sync.get("removed"):
                    release_memory()  # what reading the notes left behind
                first = False
            except Exception:
                log.exception("rescan failed; trying again in %s s", self.config.rescan_seconds)
            if self._stop.wait(self.config.rescan_seconds):
                return

    def close(self) -> None:
        """Stop background work and persist the index (once; a read-only service has none)."""
        self._stop.set()
        for component in (self.pollers, self.reminders, self.embedder, self.reader):
            if component is not None:
                component.close()
        self.journal.close()  # long-polls answer now
        for thread in self._threads:
            thread.join(30)
        if self._threads:
            self._threads = []
            self.index.close()  # the last flush and commit
            self.grants.flush(force=True)
        self.history.close()

    # -- request context ------------------------------------------------------

    def client_addr(self, environ: dict) -> str:
        """Return the client's address (see client_address: proxies and the relay)."""
        return client_address(self.config, environ)

    @property
    def setup_loopback_only(self) -> bool:
        """Whether only loopback clients may set up (SERVICE_SETUP_LOCAL_ONLY, auto decided
        once from this machine's own address and what it runs on: setup_loopback_reason)."""
        if self._setup_loopback_only is None:
            mode = self.config.setup_local_only
            auto = mode == "auto"
            own = lan_address() if auto else ""
            why = setup_loopback_reason(
                mode, own, auto and Machine.in_container(), Machine.cloud() if auto else ""
            )
            self._setup_loopback_only = bool(why)
            if auto and why and not self.state.read().get("setupComplete"):
                log.warning(
                    "setup: only this machine itself may set up (SERVICE_SETUP_LOCAL_ONLY=auto):"
                    " %s. On a home network, SERVICE_SETUP_LOCAL_ONLY=false lets its other"
                    " machines set up too; or run `pair` here and scan its code",
                    why,
                )
        return self._setup_loopback_only

    def setup_here(self, environ: dict, check_host: bool = True) -> tuple:
        """Return (allowed, reason): may this request see the full key, set up from the
        page, or link with the setup key? reason is None when allowed, else one of
        complete, relayed, proxy, remote, loopback-only, window, host.

        The TCP peer decides (setup_client_ip), never a header; the Host check (against
        DNS rebinding) comes on top, not instead.
        """
        if self.state.read().get("setupComplete"):
            return False, "complete"
        if environ.get("notesvc.relayed"):
            return False, "relayed"
        ip = setup_client_ip(self.config, environ)
        if ip is None:
            peer = ip_of(environ.get("REMOTE_ADDR") or "")
            untrusted = peer is not None and not is_trusted_proxy(self.config, str(peer))
            return False, "proxy" if untrusted else "remote"
        if not is_home_network(str(ip)):
            return False, "remote"
        if self.setup_loopback_only and not ip.is_loopback:
            return False, "loopback-only"
        if time.monotonic() - self.setup_opened > self.config.setup_window:
            return False, "window"
        if check_host and not names_this_machine(self.config, request_host(self.config, environ)):
            return False, "host"
        return True, None

    def base_url(self, environ: dict) -> str:
        return base_url_of(self.config, environ)

    def relay_url(self, environ: dict) -> str:
        return self.config.relay_url or self.base_url(environ)

    def relay_origin(self) -> str:
        """Return this server's own origin on its relay, https://<serverId>.<domain>, when
        the relay it is paired with has per-server origins (else "")."""
        return relay_origin_of(self.config, self.state.read())

    def relay_base(self, environ: dict) -> str:
        """Return where browsers and links reach this server through its relay: its own
        origin there, else {relay}/r/<serverId> (path-based)."""
        origin = self.relay_origin()
        return origin or f"{self.relay_url(environ)}/r/{self.state.read()['serverId']}"

    def issuer(self, environ: dict) -> str:
        """Return the OAuth issuer (and share-link base) a request sees: the base URL, the
        server's own origin on its relay for a request that came that way, or
        {relay}/r/<serverId> for one that came through a relay's or this server's /r/<id>."""
        script = environ.get("SCRIPT_NAME", "")
        if environ.get("notesvc.relayed") and self.config.relay_url:
            if environ.get("notesvc.relay_origin"):
                return environ["notesvc.relay_origin"]
            return self.config.relay_url + script
        return self.base_url(environ) + script

    # -- authentication -------------------------------------------------------

    def key_matches(self, key: str | None) -> bool:
        """Return whether key is the current API key (constant-time on the hashes)."""
        stored = self.state.read().get("keyHash", "")
        return bool(key) and hmac.compare_digest(key_hash(key), stored)

    def authenticate(self, environ: dict, key_only: bool = False, mcp: bool = False) -> Principal:
        """Return who a protected request acts for, or raise 401 / 403 / 429.

        Only a credential that was presented and is wrong counts toward the lockout,
        and a right one clears its address's failures; while an address is locked out,
        every credential from it is 429, right or wrong (no oracle for a guesser).
        key_only: the route needs the API key itself, a JWT gets 403.
        mcp: /mcp, where the key may also come as `Authorization: Bearer` or `X-API-Key`,
        OAuth access tokens issued for its URL are good, and a 401 carries the challenge
        that leads a client to them.
        """
        if self.config.auth_mode == "none":
            return OWNER
        key = environ.get("HTTP_X_SERVICE_KEY", "")
        auth = environ.get("HTTP_AUTHORIZATION", "")
        bearer = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        if mcp and not key:  # AI connectors send only authorization, x-api-key, x-auth-token
            key = environ.get("HTTP_X_API_KEY", "") or bearer
        mcp_url = self.issuer(environ) + API + "/mcp" if mcp else ""
        if key or bearer:
            addr = self.client_addr(environ)
            self.check_lockout(addr)
            if self.key_matches(key):
                self.lockout.succeed(addr)
                return OWNER
            if bearer and self.config.auth_mode == "jwt" and self.token_valid(environ):
                self.lockout.succeed(addr)
                if key_only:
                    raise ApiError(
                        403,
                        "FORBIDDEN",
                        f"this needs the API key itself ({KEY_HEADER}), not a token",
                    )
                return OWNER
            for secret in filter(None, dict.fromkeys((key, bearer))):  # a scoped key, a token
                grant = self.grants.principal(secret)
                if grant is not None and grant.kind == "oauth" and not mcp:
                    raise ApiError(401, "UNAUTHORIZED", f"OAuth tokens are good for {API}/mcp only")
                if grant is not None and (grant.kind != "oauth" or grant.resource == mcp_url):
                    self.lockout.succeed(addr)
                    if key_only and grant.allows("admin"):  # an admin device: not these
                        raise ApiError(
                            403, "FORBIDDEN", f"this needs the API key itself ({KEY_HEADER})"
                        )
                    return grant
            self.lockout.fail(addr, f"{key}\n{bearer}")  # the same one again: once
        headers = f"{KEY_HEADER}, Authorization: Bearer or X-API-Key" if mcp else KEY_HEADER
        challenge = {"WWW-Authenticate": mcp_challenge(mcp_url, "invalid_token" if bearer else "")}
        raise ApiError(
            401,
            "UNAUTHORIZED",
            f"missing or wrong {headers} header; see GET {API}/system/setup",
            challenge if mcp else None,
        )

    def token_valid(self, environ: dict) -> bool:
        """Return whether the request carries a valid bearer JWT for the current key."""
        auth = environ.get("HTTP_AUTHORIZATION", "")
        if not auth.lower().startswith("bearer "):
            return False
        try:
            claims = jwt_decode(auth[7:].strip(), self.config.jwt_secret)
        except ValueError:
            return False
        kid = self.state.read().get("keyHash", "")[:16]
        return hmac.compare_digest(str(claims.get("kid", "")).encode(), kid.encode())

    def check_lockout(self, addr: str) -> None:
        wait = self.lockout.retry_after(addr)
        if wait:
            raise ApiError(
                429,
                "RATE_LIMITED",
                f"too many failed credentials from this address; retry in {wait} s",
                {"Retry-After": str(wait)},
            )

    # -- facts shared by several endpoints ------------------------------------

    def uptime(self) -> float:
        return round(time.time() - self.started, 3)

    def note_stats(self) -> tuple:
        """Return (note count, total bytes) of the notes folder."""
        sizes = self.notes.scan()
        return len(sizes), sum(size for size, _ in sizes.values())
