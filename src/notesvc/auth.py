"""state.json, keys, JWT and the lockout."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import heapq
import hmac
import itertools
import json
import os
import re
import secrets
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

from notesvc.boot import log
from notesvc.helpers import atomic_write, file_lock, iso, key_hash, log_safe, new_key, utcnow
from notesvc.settings import Config


def relay_server_id(token: str) -> str:
    """Return the server id a relay token certifies (docs/design.md: relay).

    >>> relay_server_id("x" * 43)
    'w6p7juq57zv3akfa7qaw'
    """
    digest = hashlib.sha256(b"notesvc-relay-id:" + token.encode("utf-8")).digest()
    return base64.b32encode(digest).decode("ascii").lower()[:20]


def relay_code_of(token: str) -> str:
    """Return the relay code a relay token certifies (docs/design.md: relay): like the server id,
    nobody without the token can claim it, on any relay.

    >>> relay_code_of("x" * 43) == relay_code_of("x" * 43) != relay_server_id("x" * 43)[:16]
    True
    """
    digest = hashlib.sha256(b"notesvc-relay-code:" + token.encode("utf-8")).digest()
    return base64.b32encode(digest).decode("ascii").lower()[:16]


class StateError(Exception):
    """The state file exists but cannot be used (start-up stops with its message)."""


class StateStore:
    """state.json: server id, key (hash), setup state, clients, relay code, channels.

    Every change goes through update(): it takes a file lock, re-reads the file,
    applies the change and writes it back atomically, so a `rotate-key` run by
    another process is never overwritten with an older copy. Reads notice a file
    changed by another process through its (mtime, size, inode) signature.
    """

    def __init__(
        self,
        folder: Path,
        owner: tuple | None = None,
        create: bool = True,
        readonly: bool = False,
    ):
        self.folder = folder
        self.path = folder / "state.json"
        self.owner = owner  # (uid, gid) the files are written as (root acting for the owner)
        self.readonly = readonly
        self.permission_hint = ""  # what to run instead when writing is not allowed
        self._lock = threading.RLock()
        self._current: tuple = (None, {})  # (signature, data): replaced whole, read unlocked
        if not create:  # open what exists; create, chmod and write nothing
            if not self.path.is_file():
                raise StateError(f"no notesvc state at {folder}")
            self._load()
            return
        folder.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            os.chmod(folder, 0o700)
        self.update(self._initialise)

    @classmethod
    def open_existing(cls, folder: Path, readonly: bool = False, owner: tuple | None = None):
        """Return the store of an existing state, creating and writing nothing on open.

        Raises StateError when the folder holds no state.json (or it cannot be read);
        a `readonly` store refuses update().
        """
        return cls(folder, owner=owner, create=False, readonly=readonly)

    @staticmethod
    def _initialise(data: dict) -> None:
        if not data.get("relayToken"):  # a new root, or a state file from 0.1
            data["relayToken"] = secrets.token_urlsafe(32)
            if data.get("serverId"):
                log.warning("the server id changes once (it now derives from a relay token)")
        data["serverId"] = relay_server_id(data["relayToken"])
        code = relay_code_of(data["relayToken"])
        if data.get("relayCode", code) != code:  # a random code of 0.1: connect links change
            log.warning("the relay code changes once (it now derives from the relay token)")
        data["relayCode"] = code
        if data.get("keyHash"):
            return
        key, now = new_key(), iso(utcnow())
        data.update(
            version=1,
            createdAt=now,
            apiKey=key,
            keyHash=key_hash(key),
            keyHint=key[-4:],
            keyCreatedAt=now,
            setupComplete=False,
            linkedClients=[],
        )

    def _signature(self) -> tuple | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _load(self) -> None:
        sig = self._signature()
        if sig == self._current[0] and self._current[1]:
            return
        if sig is None:
            self._current = (None, {})
            return
        try:
            data = json.loads(self.path.read_text("utf-8"))
        except (OSError, ValueError) as e:
            raise StateError(f"{self.path} cannot be read ({e}); restore it or move it away") from e
        if not isinstance(data, dict):
            raise StateError(f"{self.path} does not hold a JSON object; restore it or move it away")
        self._current = (sig, data)

    def read(self) -> dict:
        """Return the current state (do not mutate it; use update).

        Every request reads it: the file's signature is looked at without the lock, which
        is taken only to load a changed file (holding it across the stat lined up
        waitress's threads behind one another: 30 % of their time under load).
        """
        sig = self._signature()
        known, data = self._current
        if data and sig is not None and sig == known:
            return data
        with self._lock:
            self._load()
            return self._current[1]

    def update(self, change: Callable[[dict], Any]) -> Any:
        """Apply change(data) to the freshest state, write it atomically, return its result."""
        if self.readonly:
            raise StateError(f"{self.path} was opened read-only")
        lock_path = self.folder / "state.lock"
        if self.owner:  # the lock file must stay usable by the service's own user
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.fchown(fd, *self.owner)
            finally:
                os.close(fd)
        with self._lock, file_lock(lock_path):
            self._current = (None, self._current[1])
            self._load()
            data = json.loads(json.dumps(self._current[1]))  # a copy: a failure leaves no trace
            result = change(data)
            payload = json.dumps(data, indent=2).encode("utf-8")

            def write(f) -> None:
                if self.owner:  # chown before the rename: the service never sees it root-owned
                    os.fchown(f.fileno(), *self.owner)
                f.write(payload)

            atomic_write(self.path, write, mode=0o600)
            self._current = (self._signature(), data)
            return result


def relay_origin_of(config: Config, state: dict) -> str:
    """Return a server's own origin on its relay (learnt when it registered), or "" when
    its relay has no per-server origins or it has none configured."""
    if not config.relay_url:
        return ""
    known = state.get("relayOrigin") or {}
    return known.get("origin", "") if known.get("relay") == config.relay_url else ""


def rotate_key(data: dict) -> str:
    """Give the state a new key; return the key (shown once). The relay code stays: it
    derives from the relay token, and only finds the server (it opens nothing)."""
    key = new_key()
    data.update(keyHash=key_hash(key), keyHint=key[-4:], keyCreatedAt=iso(utcnow()))
    if data.get("setupComplete"):
        data.pop("apiKey", None)
    else:
        data["apiKey"] = key
    return key


JWT_LEEWAY = 30  # seconds of clock skew allowed on exp / nbf
JWT_LIFETIME = 3600


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64url_decode(text: str) -> bytes:
    if not re.fullmatch(r"[A-Za-z0-9_-]*", text):
        raise ValueError("not base64url")
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def jwt_encode(claims: dict, secret: str) -> str:
    """Return an HS256 JSON Web Token for claims."""
    header = _b64url(json.dumps({"alg": "HS256", "typ": "JWT"}, separators=(",", ":")).encode())
    payload = _b64url(json.dumps(claims, separators=(",", ":")).encode())
    signing_input = f"{header}.{payload}".encode()
    signature = hmac.new(secret.encode(), signing_input, hashlib.sha256).digest()
    return f"{header}.{payload}.{_b64url(signature)}"


def jwt_decode(token: str, secret: str, now: float | None = None) -> dict:
    """Return a token's claims; ValueError saying why when it is not a valid HS256 JWT.

    Only HS256 is accepted (`none`, HS512, RS256 ... are refused before any check), the
    signature is compared in constant time, and exp / nbf allow JWT_LEEWAY seconds.
    """
    parts = token.split(".")
    if len(parts) != 3:
        raise ValueError("not a JWT")
    try:
        header = json.loads(_b64url_decode(parts[0]))
        signature = _b64url_decode(parts[2])
    except (ValueError, UnicodeDecodeError):
        raise ValueError("malformed JWT") from None
    if not isinstance(header, dict) or header.get("alg") != "HS256":
        raise ValueError("only HS256 tokens are accepted")
    expected = hmac.new(secret.encode(), f"{parts[0]}.{parts[1]}".encode(), hashlib.sha256)
    if not hmac.compare_digest(expected.digest(), signature):
        raise ValueError("bad signature")
    try:
        claims = json.loads(_b64url_decode(parts[1]))
    except (ValueError, UnicodeDecodeError):
        raise ValueError("malformed claims") from None
    if not isinstance(claims, dict):
        raise ValueError("malformed claims")
    now = time.time() if now is None else now
    for name in ("exp", "nbf"):
        if name in claims and not isinstance(claims[name], (int, float)):
            raise ValueError(f"{name} is not a number")
    if "exp" not in claims or claims["exp"] + JWT_LEEWAY < now:
        raise ValueError("expired")
    if claims.get("nbf", 0) - JWT_LEEWAY > now:
        raise ValueError("not valid yet")
    return claims


class Lockout:
    """Failed credentials per client address: `limit` distinct wrong credentials in
    `window` s lock it out for `window` s.

    The same wrong credential presented again within the window counts once (each is
    remembered by a short hash of it, never itself): a revoked device that keeps retrying
    its key from the owner's address locks nobody out, while a guesser, whose every try is
    a new credential, still is. Callers that pass no credential count every failure.
    """

    def __init__(
        self,
        limit: int = 10,
        window: float = 60.0,
        clock=time.monotonic,
        tracked: int = 10000,
        what: str = "wrong credentials",
    ):
        self.limit, self.window, self.clock = limit, window, clock
        self.tracked = tracked  # addresses remembered at most (memory under a spray)
        self.what = what  # what failed, as the log says it
        self._fails: dict[str, dict] = {}  # addr -> {credential's hash: last seen}, oldest first
        self._until: dict[str, float] = {}
        self._unnamed = itertools.count()  # failures without a credential: each its own
        self._lock = threading.Lock()

    def retry_after(self, addr: str) -> int:
        """Return the seconds addr must still wait, 0 when it is not locked out."""
        with self._lock:
            until = self._until.get(addr, 0.0)
            left = until - self.clock()
            if left <= 0:
                self._until.pop(addr, None)
                return 0
            return max(1, int(left + 0.999))

    def fail(self, addr: str, credential: str | bytes | None = None) -> None:
        """Count a wrong credential from addr (once per distinct credential in the window)."""
        if credential is None:
            seen: Any = next(self._unnamed)
        else:
            raw = (
                credential.encode("utf-8", "replace") if isinstance(credential, str) else credential
            )
            seen = hashlib.sha256(raw).digest()[:8]
        now = self.clock()
        with self._lock:
            if len(self._fails) >= self.tracked:  # bound memory under a spray of addresses
                self._prune(now)
            tries = self._fails.setdefault(addr, {})
            for old in [c for c, at in tries.items() if at <= now - self.window]:
                del tries[old]
            tries.pop(seen, None)  # seen again: it moves to the end, still one
            tries[seen] = now
            if len(tries) < self.limit:
                return
            self._until[addr] = now + self.window
            tries.clear()
        log.warning(
            "%s is locked out for %d s: %d %s in %d s",
            log_safe(addr, 80),
            self.window,
            self.limit,
            self.what,
            self.window,
        )

    def succeed(self, addr: str) -> None:
        """Forget addr's failures: a right credential from it (a lockout still runs out)."""
        with self._lock:
            self._fails.pop(addr, None)

    def _prune(self, now: float) -> None:
        """Forget stale addresses; when a spray keeps them all fresh, forget the quietest half.

        Pruning makes room for `tracked // 2` new addresses, so its cost is spread thin.
        """
        for addr in [a for a, q in self._fails.items() if _last(q) <= now - self.window]:
            del self._fails[addr]
        for addr in [a for a, until in self._until.items() if until <= now]:
            del self._until[addr]
        excess = len(self._fails) - self.tracked // 2
        if excess > 0:
            last = {a: _last(q) for a, q in self._fails.items()}
            for addr in heapq.nsmallest(excess, last, key=last.__getitem__):
                del self._fails[addr]


def _last(tries: dict) -> float:
    """Return when an address last failed (its newest entry; -inf: none)."""
    return next(reversed(tries.values()), float("-inf"))


class RateLimit:
    """At most `limit` events per `window` seconds per client address (memory bounded)."""

    def __init__(
        self, limit: int, window: float = 60.0, clock=time.monotonic, tracked: int = 10000
    ):
        self.limit, self.window, self.clock, self.tracked = limit, window, clock, tracked
        self._events: dict[str, deque] = {}
        self._lock = threading.Lock()

    def hit(self, addr: str) -> int:
        """Count one event from addr; return 0 when it is allowed, else the seconds to wait."""
        now = self.clock()
        with self._lock:
            if len(self._events) >= self.tracked:  # forget the quiet, then the oldest half
                for a in [a for a, q in self._events.items() if q[-1] <= now - self.window]:
                    del self._events[a]
                for a in list(self._events)[: max(0, len(self._events) - self.tracked // 2)]:
                    del self._events[a]
            q = self._events.setdefault(addr, deque())
            while q and q[0] <= now - self.window:
                q.popleft()
            if len(q) >= self.limit:
                return max(1, int(q[0] + self.window - now + 0.999))
            q.append(now)
            return 0
