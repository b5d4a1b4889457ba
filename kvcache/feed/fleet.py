"""A stream's state, asked once for the whole fleet: one sidecar polls, every sidecar learns.

Each feed needs its stream's state every watch_period: the quorum evidence that keeps a
replicated bucket fresh (kvcache.feed.quorum) and the first sequence that shows removals no
message announces (kvcache.feed.sweeps). Asked by every sidecar, that is one STREAM.INFO per
sidecar per bucket per period, landing on the few stream leaders: 0.8 requests/s per sidecar
per bucket at the default bound, ~163,000/s for 10,000 hosts with 20 buckets.

Here the sidecars of a bucket share what they ask. A sidecar that polls publishes the answer
(the stream's info, as its leader gave it, and when it was asked) on a core NATS subject of
the bucket, `kvcache.state.<domain>.<bucket>`; every sidecar of the bucket subscribes and
takes it as if it had asked itself (Feed.apply_state). A sidecar polls only when no other
sidecar's useful answer (one whose evidence proves something, or any for a stream with one
copy) arrived within 1.5 periods, and defers to a sidecar of lower id: after one period one
sidecar per bucket polls for the fleet, and if it goes away another takes over within about
2.5 periods. The cluster answers one STREAM.INFO per bucket per period, whatever the fleet's
size; each sidecar receives one small message per bucket per period (the fan-out NATS does
for any subscription).

**Whose clock.** Evidence is "no new leader before `sent - active`", `sent` the moment the
poller asked, on the poller's clock. A receiver takes `min(sent, received)` on its own clock:
a poller whose clock is behind only makes the evidence look older (safe); one whose clock is
ahead overstates it by at most the lesser of the clocks' offset and the time from the poll to
the receipt (the route's delivery delay: milliseconds), because no answer can have been asked
after it was received. So without any clock assumption the evidence is overstated by at most
the beat's delivery time, and with clocks in step (NTP) by at most their offset. A receipt
that shows the sender's clock ahead by more than CLOCK_AHEAD_WARN_MS is logged once.

**Who can speak.** A server cut off from the majority relays only what its own clients
publish; a poller connected to it gets no quorum evidence (its STREAM.INFO shows silent
followers or no leader), so its answers are not useful: they never stop another sidecar from
polling. A late answer only ages. Anyone allowed to publish on `kvcache.state.>` can speak for
the fleet: give that permission to the sidecars' NATS user only (README, "Permissions").
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Protocol

from ..natsio.nats_connection import NatsConnection, unsubscribe_quietly
from .quorum import evidence, needs_quorum

log = logging.getLogger("kvcache.feed")

SUBJECT_PREFIX = "kvcache.state"
# Another sidecar's useful answer within this many periods: this one does not poll.
HEARD_WITHIN_PERIODS = 1.5
CLOCK_AHEAD_WARN_MS = 1000


class Feed(Protocol):
    """What the shared polls need of a bucket's feed (kvcache.feed.feed.Feed, whose
    maintenance half, kvcache.feed.sweeps, polls and takes the answers): a Protocol, so that
    this module and the feed do not import each other."""

    bucket: str

    def same_stream(self, info: dict) -> bool: ...

    async def apply_state(self, info: dict, sent_ns: int) -> None: ...


def state_subject(domain: str | None, bucket: str) -> str:
    return f"{SUBJECT_PREFIX}.{domain or '_'}.{bucket}"


class StateShare:
    """The sidecar's side of the shared stream-state polls (see the module docstring): one
    subscription per bucket, and `should_poll` / `publish` for the loops that poll."""

    def __init__(self, nc: NatsConnection, domain: str | None = None,
                 clock: Callable[[], float] = time.monotonic, sid: str | None = None) -> None:
        self.nc = nc
        self.domain = domain
        # this sidecar, among the fleet (lower ids poll): its data directory's (kvcache.feed.names)
        self.id = sid or os.urandom(8).hex()
        self._clock = clock
        self._heard: dict[str, tuple[float, str]] = {}   # bucket -> (when, from) of the last useful answer
        self._polled: dict[str, float] = {}               # bucket -> when this sidecar last published
        self._subs: list = []
        self._latest: dict[str, tuple[dict, int]] = {}        # bucket -> the newest answer not yet applied
        self._applying: dict[str, asyncio.Task] = {}
        self._warned_clock = False
        self.published = self.received = 0

    async def follow(self, feed: Feed) -> None:
        """Take the fleet's answers about `feed`'s stream."""
        async def on_state(msg) -> None:
            self._on_state(feed, msg.data)
        self._subs.append(await self.nc.subscribe(state_subject(self.domain, feed.bucket), cb=on_state))

    async def close(self) -> None:
        for task in self._applying.values():
            task.cancel()
        await unsubscribe_quietly(*self._subs)
        self._subs.clear()

    def should_poll(self, bucket: str, period: float) -> bool:
        """Must this sidecar ask the stream's state itself this period? Not when another
        sidecar's useful answer arrived within HEARD_WITHIN_PERIODS periods, from a sidecar
        of lower id, or of higher id while this one is not polling itself."""
        heard = self._heard.get(bucket)
        now = self._clock()
        if heard is None or now - heard[0] > HEARD_WITHIN_PERIODS * period:
            return True
        if heard[1] < self.id:
            return False
        polled = self._polled.get(bucket)
        return polled is not None and now - polled <= HEARD_WITHIN_PERIODS * period

    async def publish(self, bucket: str, info: dict, sent_ns: int) -> None:
        """This sidecar asked `bucket`'s stream at `sent_ns` (its wall clock): tell the fleet.
        A failure is the next period's to mend: the fleet polls for itself meanwhile."""
        self._polled[bucket] = self._clock()
        payload = json.dumps({"from": self.id, "sent_ns": sent_ns, "info": info},
                             separators=(",", ":")).encode()
        try:
            await self.nc.publish(state_subject(self.domain, bucket), payload)
            self.published += 1
        except Exception as e:
            log.debug("bucket %s: stream state not shared: %s", bucket, e)

    def _on_state(self, feed: Feed, data: bytes) -> None:
        try:
            doc = json.loads(data)
            sender, sent_ns, info = str(doc["from"]), int(doc["sent_ns"]), doc["info"]
            if not feed.same_stream(info):
                return  # another stream of the name (recreated, another domain's): not heard
        except (ValueError, KeyError, TypeError, AttributeError):
            log.warning("bucket %s: a stream-state message that is not kvcache's on %s: ignored",
                        feed.bucket, state_subject(self.domain, feed.bucket))
            return
        if sender == self.id:
            return
        received = time.time_ns()
        if sent_ns > received + CLOCK_AHEAD_WARN_MS * 1_000_000 and not self._warned_clock:
            self._warned_clock = True
            log.warning("the clock of fleet member %s is %.1f s ahead of this host's (or more): its "
                        "stream-state answers are taken as of their receipt", sender,
                        (sent_ns - received) / 1e9)
        sent_ns = min(sent_ns, received)
        self.received += 1
        if not needs_quorum(info) or evidence(info, sent_ns) is not None:
            self._heard[feed.bucket] = (self._clock(), sender)
        # Applied one at a time per bucket, the newest first: answers that arrive while one is
        # being checked (a check may wait for the replica to catch up) replace each other.
        self._latest[feed.bucket] = (info, sent_ns)
        task = self._applying.get(feed.bucket)
        if task is None or task.done():
            self._applying[feed.bucket] = asyncio.get_running_loop().create_task(
                self._apply(feed), name=f"shared-state:{feed.bucket}")

    async def _apply(self, feed: Feed) -> None:
        while (latest := self._latest.pop(feed.bucket, None)) is not None:
            try:
                await feed.apply_state(*latest)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # as a failed poll of its own: the next one tries again
                log.warning("bucket %s: stream state check (shared) failed: %s", feed.bucket, e)
