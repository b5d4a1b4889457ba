"""The JetStream pull-consumer protocol one feed reads a bucket through.

A consumer is ephemeral, AckNone, in memory and filtered to the bucket's key filters, named
for the sidecar's data directory (kvcache.feed.names: what a killed predecessor left under the
name is replaced, not left to age out), made on the stream leader (nats-server places an R1
consumer on a random replica, whose store may lag), pulled in windows (the server never sends
more than asked for, so a big bucket cannot overflow us as a slow consumer), and watched: a
consumer-sequence gap, silent heartbeats, silence while the stream is known to hold more (the
feed's `behind`), a deleted consumer or a status that ends more than one pull request raise
ConsumerLost, and the feed makes a new one. Deliveries arrive through the connection's fast
lane (kvcache.natsio.nats_connection) as `Run`s of decoded replica items, handed to the feed's
`on_batch`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from ..errors import KvcacheError
from ..natsio import jetstream as jsapi
from ..natsio.nats_connection import NatsConnection, proto, unsubscribe_quietly

log = logging.getLogger("kvcache.feed")

# The pull window, in messages (topped up at half): 16,384 in flight kept a 1M-key sync 0.2 s
# shorter than 8,192 here (the server's delivery never waits on a request); the bytes are
# capped per request (PULL_MAX_BYTES), so big values cannot make it a large buffer.
PULL_BATCH = 16384
PULL_MAX_BYTES = 16 * 1024 * 1024
# A pull request lives this long; its idle heartbeats (every heartbeat_ms) are what shows the
# consumer alive, so its expiry only costs a request per consumer per PULL_EXPIRES_S: in a
# fleet, N x buckets of them (bench/README.md, "A fleet on one cluster").
PULL_EXPIRES_S = 600.0
# Checks the first pull request lives (see PullConsumer._pull)
FIRST_PULL_CHECKS = 4
PLACEMENT_TRIES = 32    # consumers made to get one on the stream leader (R3: all miss with p = 2e-6)
# Creation refused because a consumer of the name exists with another configuration
# (JSConsumerAlreadyExists, JSConsumerNameExistErr): a predecessor's, replaced.
NAME_TAKEN = (10148, 10013)
# 409 descriptions that end one pull request and nothing more: pull again.
REQUEST_ENDED = ("Batch Completed", "Exceeds MaxBytes", "Exceeded MaxWaiting")


class ConsumerLost(KvcacheError):
    """The consumer can no longer be trusted to deliver in order: recreate it. `reason` is
    one word for why (kvcache.feed.feed.RECREATION_REASONS: the metrics' label)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


if TYPE_CHECKING:  # the twin's class stands for both in annotations (same fields)
    from ..natsio.natsproto import Run
else:
    Run = proto.Run  # consecutive deliveries as replica items; see kvcache.natsio.natsproto.Run


# Deletions left to run after their consumer is done with, by (connection, stream, name): held
# here so they are not garbage-collected half-way (asyncio keeps only weak references), and so
# that a consumer made again under the same name waits for its predecessor's deletion rather
# than racing it (the deletion would remove the new one).
_DELETIONS: dict[tuple[int, str, str], asyncio.Future] = {}


def _delete_in_background(consumer: PullConsumer) -> None:
    key = (id(consumer.nc), consumer.stream, consumer.name)
    pending = _DELETIONS.get(key)
    if pending is not None and not pending.done():
        return  # on its way already (a consumer waits for its predecessor's before it is made)
    task = asyncio.ensure_future(consumer._delete_quietly())
    _DELETIONS[key] = task
    task.add_done_callback(lambda t: _DELETIONS.pop(key, None) if _DELETIONS.get(key) is t else None)


async def deletions_done(timeout: float) -> None:
    """Wait (at most `timeout`) for the consumer deletions still on their way. Before the
    connection closes: a deletion left behind then is never sent, and its consumer stays on
    the stream until the server's inactivity reaper (60 s) takes it; a sidecar whose start
    failed, or that stops, must leave none."""
    pending = [t for t in _DELETIONS.values() if not t.done()]
    if pending:
        await asyncio.wait(pending, timeout=timeout)


def _consumer_name() -> str:
    return "kvcache_" + secrets.token_hex(8)


class PullConsumer:
    """One ephemeral pull consumer over a KV stream, delivering in order or failing loudly.

    `on_batch(runs)` runs synchronously for everything an event-loop turn brought (gap-free Runs, in
    order) and returns True to finish; `on_idle(last_stream_seq)` runs when the server reports, while we are
    caught up, that it has nothing more (0 when unknown). An exception raised by either ends
    the consumer and propagates out of `run()`. `after_create(stream_info)` runs once the
    consumer exists on the stream leader, with the leader's STREAM.INFO answer.

    Liveness: the server is asked for an idle heartbeat every `heartbeat_s`, and silence for
    three of them loses the consumer. `behind()`, when given, says since when (monotonic) the
    stream is known to hold messages the consumer has not delivered (None: not known to): a
    consumer silent for three `check_s` past that moment is lost too. A feed whose staleness a
    quorum's evidence bounds asks for rare heartbeats and relies on that check instead
    (kvcache.feed.feed.Feed.consumer_heartbeat_s).
    """

    def __init__(self, nc: NatsConnection, stream: str, prefix: str, filters: list[str], *,
                 start_seq: int | None, headers_only: bool, heartbeat_s: float,
                 on_batch: Callable[[list[Run]], bool], on_idle: Callable[[int], None],
                 after_create: Callable[[dict], Awaitable[None]] | None = None,
                 api: str = "$JS.API", timeout: float = 5.0, name: str | None = None,
                 behind: Callable[[], float | None] | None = None, check_s: float | None = None) -> None:
        self.nc = nc
        self.stream = stream
        self.prefix = prefix
        self.filters = filters
        self.start_seq = start_seq
        self.headers_only = headers_only
        self.heartbeat_s = heartbeat_s
        self.behind = behind
        self.check_s = heartbeat_s if check_s is None else min(check_s, heartbeat_s)
        self.on_batch = on_batch
        self.on_idle = on_idle
        self.after_create = after_create
        self.api = api
        self.timeout = timeout
        # A fixed name (kvcache.feed.names) is kept across placement tries; without one each
        # try gets a random name, as ephemeral consumers do.
        self.name = name or _consumer_name()
        self._fixed_name = name is not None
        self.placement_retries = 0
        self.initial_pending = 0
        self.delivered = 0
        self._inbox = nc.new_inbox()
        self._wake = asyncio.Event()
        self._failure: tuple[str, str] | None = None  # ConsumerLost's message and reason
        self._error: BaseException | None = None
        self._done = False
        self._pending_msgs = 0
        self._heard = False  # has the server answered a pull yet (see _pull)?
        # One request must fit the largest message the server accepts, or it would never arrive.
        self._max_bytes = max(PULL_MAX_BYTES, 2 * (nc.max_payload or 0))
        self._next_cseq = 1
        self._last_activity = time.monotonic()
        self._caught_up = False
        self.host = ""  # the server the consumer was placed on ('' outside a cluster)
        self._requested = False  # a CONSUMER.CREATE was sent: the consumer may exist on the server

    async def run(self) -> None:
        if not isinstance(self.nc, NatsConnection):
            raise TypeError("the feed needs a kvcache.natsio.nats_connection.NatsConnection (for its fast lane)")
        sub = await self.nc.subscribe(self._inbox)  # messages never reach its queue: the lane takes them
        self.nc.add_lane(sub._id, self.prefix, self._on_lane)
        try:
            info, stream_info = await self._create_placed()
            if self.after_create is not None:
                await self.after_create(stream_info)
            self._last_activity = time.monotonic()
            self.initial_pending = info.get("num_pending", 0)
            if self.initial_pending == 0:
                self._caught_up = True
                self.on_idle(0)
            await self._pull()
            while not self._done:
                try:
                    await asyncio.wait_for(self._wake.wait(), self.check_s)
                except TimeoutError:
                    pass
                self._wake.clear()
                if self._error is not None:
                    raise self._error
                if self._failure:
                    raise ConsumerLost(*self._failure)
                self._check_silence(time.monotonic())
                if not self._done and self._pending_msgs <= PULL_BATCH // 2:
                    await self._pull()
        finally:
            self._done = True
            self.nc.remove_lane(sub._id)
            # whatever ended it (a cancelled start too), what it made goes: scheduled before
            # the await below, which a repeated cancel (Feed.stop) may cut short
            if self._requested:
                _delete_in_background(self)
            await unsubscribe_quietly(sub)

    def _check_silence(self, now: float) -> None:
        """Lose the consumer if the server has been silent too long: three idle heartbeats,
        or three checks since the stream was known to hold more than it delivered."""
        silent = now - self._last_activity
        expected = self.heartbeat_s if self._heard else self.check_s  # see _pull
        if silent > 3 * expected:
            raise ConsumerLost(f"no heartbeat for {3 * expected:.1f}s", "heartbeat")
        since = self.behind() if self.behind is not None else None
        if since is not None and now - max(since, self._last_activity) > 3 * self.check_s:
            raise ConsumerLost(f"the stream holds messages the consumer has not delivered, and it has "
                               f"been silent for {silent:.1f}s", "behind")

    def fail(self, message: str, reason: str) -> None:
        """End the consumer with ConsumerLost(message, reason) (the first failure wins)."""
        self._failure = self._failure or (message, reason)
        self._wake.set()

    def finish(self) -> None:
        self._done = True
        self._wake.set()

    async def _create_placed(self) -> tuple[dict, dict]:
        """Create the consumer on the stream leader: the consumer info and the leader's
        STREAM.INFO. A consumer on another replica reads that replica's store (see
        jsapi.misplaced); a feed reading one that lags after a restart would call an old state
        caught up, and reads would go back in time (seen in tests/test_faults.py with all
        servers restarted: revision 110 read from a peer, then 70 from the replica). So a
        misplaced consumer is deleted and made again (a few ms each): each try lands on the
        leader with chance 1/replicas; after PLACEMENT_TRIES the feed backs off and tries later.
        While the stream has no leader no try can land on it, and an election takes seconds:
        that ends the loop at once (ConsumerLost), and the feed's backoff and replan (which
        waits for a leader) take over, rather than PLACEMENT_TRIES creations back to back."""
        why: str | None = ""
        for attempt in range(PLACEMENT_TRIES):
            if attempt:
                self.placement_retries += 1
                if not self._fixed_name:
                    self.name = _consumer_name()
            info = await self._create()
            try:
                stream_info = await jsapi.stream_info(self.nc, self.stream, self.timeout, self.api,
                                                      need_leader=True)
                why = jsapi.misplaced(info, stream_info)
            except jsapi.NoLeader as e:
                await self._delete_quietly()
                raise ConsumerLost(f"no consumer on the stream leader: {e}", "placement") from None
            except BaseException:
                _delete_in_background(self)
                raise
            if why is None:
                self.host = jsapi.stream_leader(info)
                if attempt:
                    log.info("%s: consumer on the stream leader after %d misplaced ones", self.stream, attempt)
                return info, stream_info
            await self._delete_quietly()
        raise ConsumerLost(f"no consumer on the stream leader in {PLACEMENT_TRIES} tries: {why}", "placement")

    async def _create(self) -> dict:
        """CONSUMER.CREATE under our name. One of the name already on the server is a killed
        predecessor's (or ours, whose deletion did not get through): with another
        configuration the server refuses ours; with the same one it hands back the old one,
        which has delivered to an inbox nobody reads. Either way it is deleted and ours made:
        at most one consumer per sidecar and bucket, however often it was killed."""
        pending = _DELETIONS.get((id(self.nc), self.stream, self.name))
        if pending is not None:  # our last consumer of this name is being deleted: not ours to race
            await asyncio.wait([pending])
        try:
            info = await self._create_request()
        except jsapi.ApiError as e:
            if e.err_code not in NAME_TAKEN:
                raise
        else:
            if not ((info.get("delivered") or {}).get("consumer_seq", 0) or info.get("num_waiting", 0)):
                return info  # ours, or an unused one of the name: as good as new
        log.info("%s: replacing consumer %s left by an earlier run", self.stream, self.name)
        await self._delete_quietly(self.timeout)
        return await self._create_request()

    async def _create_request(self) -> dict:
        cfg: dict = {
            "name": self.name,
            "ack_policy": "none",
            "replay_policy": "instant",
            "mem_storage": True,
            "num_replicas": 1,
            "inactive_threshold": int(max(60.0, 10 * self.check_s) * 1e9),
            "headers_only": self.headers_only,
        }
        if self.start_seq is None:
            cfg["deliver_policy"] = "last_per_subject"
        else:
            cfg["deliver_policy"] = "by_start_sequence"
            cfg["opt_start_seq"] = self.start_seq
        if len(self.filters) == 1:
            cfg["filter_subject"] = self.filters[0]
        else:
            cfg["filter_subjects"] = self.filters
        self._requested = True
        request = asyncio.ensure_future(jsapi.api_request(
            self.nc, f"{self.api}.CONSUMER.CREATE.{self.stream}.{self.name}",
            {"stream_name": self.stream, "config": cfg, "action": "create"}, self.timeout,
        ))
        try:
            return await asyncio.shield(request)
        except asyncio.CancelledError:
            # Cancelled (a start abandoned or failed) while the request is on its way: the
            # consumer exists once the server has handled it, and the server handles API
            # requests concurrently, so a deletion sent now could pass it and leave the
            # consumer behind. Let the answer come first (the request's own timeout bounds it).
            while not request.done():
                try:
                    await asyncio.wait({request})
                except asyncio.CancelledError:  # cancelled again (Feed.stop repeats it): still wait
                    continue
            if not request.cancelled():
                request.exception()  # seen: a failed request matters no more to a cancelled run
            raise

    async def _delete_quietly(self, timeout: float = 1.0) -> None:
        try:
            await jsapi.api_request(
                self.nc, f"{self.api}.CONSUMER.DELETE.{self.stream}.{self.name}", None, timeout)
        except jsapi.ApiError:  # not there (gone already): nothing left to delete either
            pass
        except Exception:  # not answered: inactive_threshold reaps it anyway
            return
        self._requested = False  # answered: what this consumer made is gone

    async def _pull(self) -> None:
        """Top the window up to PULL_BATCH messages; each request's bytes are capped too, so
        at most two requests' worth (a few tens of MiB) is ever buffered.

        Until the server has answered once, a request lives FIRST_PULL_CHECKS checks and asks
        for a heartbeat every check: a pull can be lost at creation (the same name made again
        right after a misplaced try was deleted; seen in the fleet bench, most likely the pull
        reaching the dying consumer), and a consumer with rare heartbeats would then be silent
        for three of them on an idle stream. The answer (a heartbeat, a message, the request's expiry) comes
        within a check; then the requests are the long ones."""
        want = PULL_BATCH - self._pending_msgs
        if want <= 0:
            return
        first = not self._heard
        req = {
            "batch": want,
            "max_bytes": self._max_bytes,
            "expires": int((FIRST_PULL_CHECKS * self.check_s if first else PULL_EXPIRES_S) * 1e9),
            "idle_heartbeat": int((self.check_s if first else self.heartbeat_s) * 1e9),
        }
        self._pending_msgs += want
        await self.nc.publish(
            f"{self.api}.CONSUMER.MSG.NEXT.{self.stream}.{self.name}",
            json.dumps(req).encode(), reply=self._inbox,
        )

    # -------------------------------------------------------------- delivery path

    def _on_lane(self, batch: list) -> None:
        """Everything one event-loop turn brought for this consumer: Runs and statuses, in order."""
        if self._done or self._failure or self._error:
            return
        self._last_activity = time.monotonic()
        self._heard = True
        runs: list[Run] = []
        for ev in batch:
            if type(ev) is Run:
                if ev.first_cseq != self._next_cseq:
                    self._failure = (f"consumer sequence gap: expected {self._next_cseq}, got {ev.first_cseq}", "gap")
                    break
                self._next_cseq = ev.last_cseq + 1
                runs.append(ev)
                continue
            # A status speaks about everything before it: apply that first.
            if runs:
                self._deliver(runs)
                runs = []
            if self._done or self._error:
                break
            self._status(ev)
            if self._failure or self._error:
                break
        if runs and not self._error:
            self._deliver(runs)
        self._last_activity = time.monotonic()  # a long write is not the server's silence
        if self._failure or self._error or self._done or self._pending_msgs <= PULL_BATCH // 2:
            self._wake.set()

    def _deliver(self, runs: list[Run]) -> None:
        n = sum(len(r.items) for r in runs)
        self._pending_msgs -= n
        self.delivered += n
        self._caught_up = runs[-1].last_pending == 0
        try:
            if self.on_batch(runs):
                self._done = True
        except BaseException as e:
            self._error = e

    def _status(self, ev) -> None:
        """A message on our inbox that is not a delivery: an HMsg with a status, mostly."""
        hdrs = getattr(ev, "headers", None) or {}
        status = getattr(ev, "status", 0)
        desc = getattr(ev, "description", "")
        if status == 100:
            # Idle heartbeat: it names the last consumer sequence the server sent. If that is
            # ahead of what we received, deliveries were lost on the way.
            last_c = int(hdrs.get("Nats-Last-Consumer", 0) or 0)
            if last_c >= self._next_cseq:
                self._failure = (f"heartbeat reports consumer sequence {last_c}, "
                                 f"received only up to {self._next_cseq - 1}", "gap")
                return
            if self._caught_up and last_c == self._next_cseq - 1:
                try:
                    self.on_idle(int(hdrs.get("Nats-Last-Stream", 0) or 0))
                except BaseException as e:
                    self._error = e
            return
        if status in (404, 408) or (status == 409 and any(d in desc for d in REQUEST_ENDED)):
            # The pull request ended; what it did not deliver is no longer owed to us.
            pending = hdrs.get("Nats-Pending-Messages")
            if pending is not None:
                self._pending_msgs -= int(pending or 0)
            else:
                self._pending_msgs = 0  # cannot tell: assume nothing is owed and ask again
            self._pending_msgs = max(self._pending_msgs, 0)
            return
        if status in (409, 400, 503):
            self._failure = (f"consumer ended: {status} {desc}".strip(), "ended")
            return
        log.debug("ignoring status %s %s on %s", status, desc, self.stream)
