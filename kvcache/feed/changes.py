"""Changes the feeds apply, handed to what the server builds on them: client-side caching's
invalidations (kvcache.serve.tracking), keyspace notifications (kvcache.serve.pubsub) and
WATCH (kvcache.serve.multi).

One hub for the sidecar, shared by every feed: one NATS consumer per bucket serves any number
of local listeners. A feed asks `hub.active` before working anything out, so with no
listener (no tracking client, no subscriber, no watched key) a batch costs what it did before
the hub existed.

What a listener is told:
- `changed(bucket, changes)`: (key, event) pairs in the order the replica applied them, one
  call per applied batch. Events are Redis's names: `set` (a PUT whose revision the replica did
  not hold), `del` (DEL, PURGE, a server marker, or a removal that left no message: a purge
  without markers, the stream's limits) and `expired` (per-message TTL or the bucket's
  max_age). Only real changes: a resync delivering a revision the replica holds is none.
- `flushed(bucket, why)`: kvcache can no longer vouch for what it handed out from this
  bucket (a full resync started, the consumer was lost, or the replica passed max_stale_ms);
  whatever a client holds from it must go. The staleness watch (`watch`) runs only while a
  listener wants flushes.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Protocol

from ..config import BucketConfig

log = logging.getLogger("kvcache.changes")

SET, DEL, EXPIRED = "set", "del", "expired"
# How often the staleness watch looks at each bucket, at most and at least: a tenth of the
# smallest max_stale_ms, within these bounds.
STALENESS_WATCH_MAX_S = 0.25
STALENESS_WATCH_MIN_S = 0.005

Change = tuple[str, str]  # (key, event)


class Watched(Protocol):
    """What the staleness watch asks of a feed (kvcache.feed.feed.Feed)."""

    bucket: str
    cfg: BucketConfig

    def fresh_within(self, max_stale_ms: int) -> bool: ...


class Follower(Protocol):
    """Something told of every batch applied and every removal, whatever it held."""

    def advanced(self, bucket: str) -> None: ...
    def removed(self, bucket: str) -> None: ...


class Listener(Protocol):
    """Something in the server that reacts to the replica's changes."""

    @property
    def listening(self) -> bool: ...       # anything to tell at all?
    @property
    def wants_flushes(self) -> bool: ...   # does it hand out values it must take back?
    def changed(self, bucket: str, changes: list[Change]) -> None: ...
    def flushed(self, bucket: str, why: str) -> None: ...


class ChangeHub:
    """Fans the feeds' changes out to the server's listeners."""

    def __init__(self) -> None:
        self.listeners: list[Listener] = []
        self.events = 0      # changes handed to listeners
        self.flushes = 0     # flushes handed to listeners
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        # told of every batch a feed applies and every removal with no message, whatever
        # they held (the buckets' streams: kvcache.serve.streams)
        self.followers: list[Follower] = []

    def add(self, listener: Listener) -> None:
        self.listeners.append(listener)

    def follow(self, follower: Follower) -> None:
        self.followers.append(follower)

    def advanced(self, bucket: str) -> None:
        """A feed applied a batch of `bucket` (its replica and revision index moved on)."""
        for f in self.followers:
            try:
                f.advanced(bucket)
            except Exception:  # a follower's bug must not stop the feed
                log.exception("change follower %r failed", f)

    def removed(self, bucket: str) -> None:
        """Keys of `bucket` left the replica with no message (a purge without markers, the
        stream's limits, expiry, a cleared bucket): its revision index lost entries."""
        for f in self.followers:
            try:
                f.removed(bucket)
            except Exception:
                log.exception("change follower %r failed", f)

    @property
    def active(self) -> bool:
        for listener in self.listeners:
            if listener.listening:
                return True
        return False

    def changed(self, bucket: str, changes: list[Change]) -> None:
        if not changes:
            return
        self.events += len(changes)
        for listener in self.listeners:
            if listener.listening:
                try:
                    listener.changed(bucket, changes)
                except Exception:  # one listener's bug must not stop the feed or the others
                    log.exception("change listener %r failed", listener)

    def flushed(self, bucket: str, why: str) -> None:
        self.flushes += 1
        for listener in self.listeners:
            if listener.wants_flushes:
                try:
                    listener.flushed(bucket, why)
                except Exception:
                    log.exception("change listener %r failed", listener)

    # ------------------------------------------------------------------ staleness watch

    def start_watch(self, feeds: Iterable[Watched]) -> None:
        """Flush a bucket the moment its replica passes max_stale_ms (a feed that stalls says
        nothing by itself: no message arrives). Runs while some listener wants flushes; a
        listener that starts wanting them calls `wake`."""
        self._task = asyncio.get_running_loop().create_task(self._watch(list(feeds)),
                                                            name="staleness-watch")

    def wake(self) -> None:
        self._wake.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _watch(self, feeds: list[Watched]) -> None:
        if not feeds:
            return
        period = min(STALENESS_WATCH_MAX_S, max(STALENESS_WATCH_MIN_S, min(f.cfg.max_stale_ms for f in feeds) / 10_000))
        fresh = {f.bucket: True for f in feeds}
        while True:
            if not any(lst.wants_flushes for lst in self.listeners):
                self._wake.clear()
                await self._wake.wait()
                # what was handed out before nobody listened is nobody's now: start afresh
                fresh = {f.bucket: f.fresh_within(f.cfg.max_stale_ms) for f in feeds}
            await asyncio.sleep(period)
            for f in feeds:
                now = f.fresh_within(f.cfg.max_stale_ms)
                if fresh[f.bucket] and not now:
                    log.info("bucket %s: replica past max_stale_ms (%d ms): flushing client caches",
                             f.bucket, f.cfg.max_stale_ms)
                    self.flushed(f.bucket, "stale")
                fresh[f.bucket] = now
