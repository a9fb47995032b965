"""Channels that fetch their own updates."""

from __future__ import annotations

import json
import threading
import time

from notesvc.boot import log
from notesvc.helpers import atomic_write, scrub
from notesvc.providers.base import Outbound, UpstreamError
from notesvc.providers.channels import (
    TelegramError,
    channel_mode,
    channel_secrets,
    channels_of,
    process_update,
    set_channel_status,
)
from notesvc.service import Service

# -- polling: channels that fetch their own updates ------------------------------------

POLL_WAIT = 25.0  # seconds the provider holds a long poll open (Telegram allows up to 50)
POLL_BACKOFF = 60.0  # longest pause after failures in a row
POLL_REFUSED_PAUSE = 300.0  # after the provider refused the credentials


def _channel(svc: Service, channel_id: str) -> dict | None:
    return next((c for c in channels_of(svc) if c["id"] == channel_id), None)


class ChannelPollers:
    """A thread per enabled channel in polling mode (a provider with a poller and
    config.mode "polling"): for Telegram, getUpdates with a long-poll time-out, so a server
    behind NAT needs nothing exposed.

    Each channel's offset is recorded in <state>/channel-offsets.json after every update
    it handled: no update is handled twice or lost across restarts (only a crash in the
    instant between handling one and recording it hands that one over again). sync(),
    called after every change of the channels, starts and stops the threads; close()
    stops them all at once (a long poll in flight is aborted).
    """

    def __init__(self, svc: Service, wait: float = POLL_WAIT):
        self.svc, self.wait = svc, wait
        self.path = svc.config.state_dir / "channel-offsets.json"
        self._pollers: dict = {}  # channel id -> ChannelPoller
        self._offsets: dict | None = None
        self._lock = threading.Lock()
        self._offsets_lock = threading.Lock()
        self._closed = False

    def start(self) -> None:
        self.sync()

    def sync(self, join: float = 0.0) -> None:
        """Run a poller for each enabled polling channel and for none other; join: wait up
        to that many seconds for the pollers stopped to be done (before a webhook is set:
        a getUpdates that met it would delete it)."""
        svc = self.svc
        if svc.readonly:
            return
        stopped = []
        wanted = {}
        for c in channels_of(svc):
            prov = svc.channel_providers.get(c["provider"])
            if prov and prov.poll and c["enabled"] and channel_mode(c) == "polling":
                secret = {f.name for f in prov.fields if f.secret}
                key = {k: v for k, v in c["config"].items() if k in secret or k == "mode"}
                wanted[c["id"]] = (prov, json.dumps(key, sort_keys=True))
        with self._lock:
            if self._closed:
                return
            for cid, poller in list(self._pollers.items()):
                if cid not in wanted or wanted[cid][1] != poller.signature:
                    poller.stop()
                    stopped.append(poller)
                    del self._pollers[cid]
                    if cid in wanted:  # its credentials changed: the new one waits for it
                        prov, sig = wanted[cid]
                        self._pollers[cid] = ChannelPoller(self, cid, prov, sig, poller).start()
            for cid, (prov, sig) in wanted.items():
                if cid not in self._pollers:
                    self._pollers[cid] = ChannelPoller(self, cid, prov, sig).start()
        deadline = time.monotonic() + join
        for poller in stopped if join > 0 else ():
            poller.thread.join(max(0.0, deadline - time.monotonic()))
        known = {c["id"] for c in channels_of(svc)}
        with self._offsets_lock:  # a deleted channel's offset goes with it
            offsets = self._read_offsets()
            if any(cid not in known for cid in offsets):
                self._offsets = {k: v for k, v in offsets.items() if k in known}
                self._write_offsets()

    def running(self) -> list:
        """Return the ids of the channels being polled."""
        with self._lock:
            return sorted(cid for cid, p in self._pollers.items() if p.thread.is_alive())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pollers, self._pollers = list(self._pollers.values()), {}
        for poller in pollers:
            poller.stop()
        for poller in pollers:
            poller.thread.join(15)

    # -- offsets -------------------------------------------------------------------

    def _read_offsets(self) -> dict:
        if self._offsets is None:
            try:
                loaded = json.loads(self.path.read_text("utf-8"))
            except (OSError, ValueError):
                loaded = {}
            self._offsets = {
                k: v
                for k, v in (loaded if isinstance(loaded, dict) else {}).items()
                if type(v) is int
            }
        return self._offsets

    def offset(self, channel_id: str) -> int:
        with self._offsets_lock:
            return self._read_offsets().get(channel_id, 0)

    def set_offset(self, channel_id: str, value: int) -> None:
        with self._offsets_lock:
            self._read_offsets()[channel_id] = value
            self._write_offsets()

    def _write_offsets(self) -> None:
        try:
            atomic_write(self.path, json.dumps(self._offsets).encode("utf-8"), mode=0o600)
        except OSError as e:  # the update was handled; a full disk must not stop polling
            log.warning("could not record the channels' offsets: %s", e)


class ChannelPoller:
    """One channel's polling thread (see ChannelPollers)."""

    def __init__(self, owner: ChannelPollers, channel_id: str, prov, signature: str, after=None):
        self.owner, self.channel_id, self.prov = owner, channel_id, prov
        self.signature, self.after = signature, after
        self.stopping = threading.Event()
        self.outbound = Outbound()
        self.failing = False
        self.thread = threading.Thread(
            target=self._run, name=f"notesvc-poll-{channel_id}", daemon=True
        )

    def start(self) -> ChannelPoller:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.outbound.abort()

    def _run(self) -> None:
        if self.after is not None:  # the same channel's previous poller finishes first
            self.after.thread.join()
        svc, backoff = self.owner.svc, 0.0
        try:
            while not self.stopping.is_set():
                channel = _channel(svc, self.channel_id)
                if channel is None or not channel["enabled"] or channel_mode(channel) != "polling":
                    return
                try:
                    batch = self.prov.poll(
                        svc,
                        channel["config"],
                        self.owner.offset(self.channel_id),
                        self.owner.wait,
                        self.outbound,
                    )
                except Exception as e:  # a poller keeps polling, whatever failed
                    if self.stopping.is_set():
                        return
                    backoff = self._failed(e, backoff)
                    self.stopping.wait(backoff)
                    continue
                backoff = 0.0
                if self.failing:
                    self.failing = False
                    log.info("channel %s: polling works again", self.channel_id)
                    set_channel_status(svc, self.channel_id, True)
                self._handle(batch)
        finally:
            self.outbound.close()

    def _handle(self, batch: list) -> None:
        svc = self.owner.svc
        for next_offset, update in batch:
            if self.stopping.is_set():
                return  # not recorded: handed over again at the next start
            channel = _channel(svc, self.channel_id)
            if channel is None or not channel["enabled"]:
                return
            try:
                process_update(svc, channel, self.prov, update)
            except Exception:  # one bad update must not stop the channel
                log.exception("channel %s: an update could not be handled", self.channel_id)
            self.owner.set_offset(self.channel_id, next_offset)

    def _failed(self, e: Exception, backoff: float) -> float:
        """Log and record a failure; return the pause before the next try."""
        if isinstance(e, UpstreamError):  # what the provider said, without the channel's secrets
            reason = scrub(str(e), channel_secrets(self.owner.svc, self.channel_id))
        else:
            reason = type(e).__name__
            log.exception("channel %s: polling failed", self.channel_id)
        refused = isinstance(e, TelegramError) and e.code in (401, 403, 404)
        pause = min(POLL_BACKOFF, max(1.0, backoff * 2))
        if refused:
            pause = POLL_REFUSED_PAUSE
        elif isinstance(e, TelegramError) and e.retry_after:
            pause = min(POLL_REFUSED_PAUSE, e.retry_after)
        if not self.failing:
            self.failing = True
            log.warning("channel %s: polling failed: %s; retrying", self.channel_id, reason)
            set_channel_status(self.owner.svc, self.channel_id, False, reason)
        return pause
