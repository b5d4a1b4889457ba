"""The feed: keeps one bucket's replica equal to its stream.

It manages its own consumer instead of nats-py's `watch()`: a push watch with nats-py's default
pending limits drops messages as a slow consumer on big buckets and never recovers. Here the
consumer is pull-based (ephemeral, AckNone, in memory), the same shape as nats.go's ordered
consumer, so the server never sends more than we asked for: nothing can be dropped, and
memory stays bounded by one pull window.

Deliveries arrive through the connection's fast lane (kvcache.natsconn): everything one socket
read brought, already decoded in C into replica items, is applied in one LMDB transaction
together with the last applied stream sequence; no Python object per message but the item. A consumer-sequence gap, a
silent heartbeat, a deleted consumer or a reconnect recreates the consumer from the last
applied sequence + 1.

Two facts about the server shape the bookkeeping here:
- `last_per_subject` delivers the initial set in subject order, not stream order, so while a
  full sync runs the highest sequence seen says nothing about which keys are still to come. An
  interrupted full sync therefore starts over; only a finished one yields a resumable position.
- A pull request can end in several ways (408 expired, 409 "Batch Completed", 409 "Message
  Size Exceeds MaxBytes", ...); only the ones listed in REQUEST_ENDED are harmless.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from . import jetstream as jsapi
from .config import BucketConfig
from .errors import BucketNotFound, KvcacheError, ReplicaError, UpstreamError
from .natsconn import NatsConnection, proto
from .replica import Replica

log = logging.getLogger("kvcache.feed")

PULL_BATCH = 8192
PULL_MAX_BYTES = 16 * 1024 * 1024
PULL_EXPIRES_S = 30.0
EXPIRY_PAGE = 2_000     # records looked at per turn of the event loop (~3 ms) by removal passes
SWEEP_MAX_S = 1.0       # the expiry index is looked at least this often (reads hide expired records anyway)
WATCH_MIN_S, WATCH_MAX_S = 0.25, 5.0  # bounds of the stream state poll's period (max_stale_ms / 4)
HINT_CHECKS_S = (0.1, 1.0)  # after a purge request is seen: look again this long after it
PLACEMENT_TRIES = 32    # consumers made to get one on the stream leader (R3: all miss with p = 2e-6)
RECONCILE_TRIES = 3
# Keys remembered as handed out from NATS ahead of the replica (Feed.ahead); past this many,
# every key waits for the replica instead (slower, still right) rather than one being forgotten.
AHEAD_MAX = 100_000
META_TOUCH_INTERVAL_NS = 1_000_000_000

# 409 descriptions that end one pull request and nothing more: pull again.
REQUEST_ENDED = ("Batch Completed", "Exceeds MaxBytes", "Exceeded MaxWaiting")


class ConsumerLost(KvcacheError):
    """The consumer can no longer be trusted to deliver in order: recreate it."""


if TYPE_CHECKING:  # the twin's class stands for both in annotations (same fields)
    from .natsproto import Run
else:
    Run = proto.Run  # consecutive deliveries as replica items; see kvcache.natsproto.Run


def _consumer_name() -> str:
    return "kvcache_" + secrets.token_hex(8)


class PullConsumer:
    """One ephemeral pull consumer over a KV stream, delivering in order or failing loudly.

    `on_batch(runs)` runs synchronously for everything a socket read brought (gap-free Runs, in
    order) and returns True to finish; `on_idle(last_stream_seq)` runs when the server reports, while we are
    caught up, that it has nothing more (0 when unknown). An exception raised by either ends
    the consumer and propagates out of `run()`. `after_create(stream_info)` runs once the
    consumer exists on the stream leader, with the leader's STREAM.INFO answer.
    """

    def __init__(self, nc: NatsConnection, stream: str, prefix: str, filters: list[str], *,
                 start_seq: int | None, headers_only: bool, heartbeat_s: float,
                 on_batch: Callable[[list[Run]], bool], on_idle: Callable[[int], None],
                 after_create: Callable[[dict], Awaitable[None]] | None = None,
                 api: str = "$JS.API", timeout: float = 5.0) -> None:
        self.nc = nc
        self.stream = stream
        self.prefix = prefix
        self.filters = filters
        self.start_seq = start_seq
        self.headers_only = headers_only
        self.heartbeat_s = heartbeat_s
        self.on_batch = on_batch
        self.on_idle = on_idle
        self.after_create = after_create
        self.api = api
        self.timeout = timeout
        self.name = _consumer_name()
        self.placement_retries = 0
        self.initial_pending = 0
        self.delivered = 0
        self._inbox = nc.new_inbox()
        self._wake = asyncio.Event()
        self._failure: str | None = None
        self._error: BaseException | None = None
        self._done = False
        self._pending_msgs = 0
        # One request must fit the largest message the server accepts, or it would never arrive.
        self._max_bytes = max(PULL_MAX_BYTES, 2 * (nc.max_payload or 0))
        self._next_cseq = 1
        self._last_activity = time.monotonic()
        self._caught_up = False

    async def run(self) -> None:
        if not isinstance(self.nc, NatsConnection):
            raise TypeError("the feed needs a kvcache.natsconn.NatsConnection (for its fast lane)")
        sub = await self.nc.subscribe(self._inbox)  # messages never reach its queue: the lane takes them
        self.nc.add_lane(sub._id, self.prefix, self._on_lane)
        created = False
        try:
            info, stream_info = await self._create_placed()
            created = True
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
                    await asyncio.wait_for(self._wake.wait(), self.heartbeat_s)
                except TimeoutError:
                    pass
                self._wake.clear()
                if self._error is not None:
                    raise self._error
                if self._failure:
                    raise ConsumerLost(self._failure)
                if time.monotonic() - self._last_activity > 3 * self.heartbeat_s:
                    raise ConsumerLost(f"no heartbeat for {3 * self.heartbeat_s:.1f}s")
                if not self._done and self._pending_msgs <= PULL_BATCH // 2:
                    await self._pull()
        finally:
            self._done = True
            self.nc.remove_lane(sub._id)
            try:
                await sub.unsubscribe()
            except Exception:  # the connection may be gone; the server drops the interest anyway
                pass
            if created:
                asyncio.ensure_future(self._delete_quietly())

    def fail(self, reason: str) -> None:
        self._failure = self._failure or reason
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
                self.name = _consumer_name()
            info = await self._create()
            try:
                stream_info = await jsapi.stream_info(self.nc, self.stream, self.timeout, self.api,
                                                      need_leader=True)
                why = jsapi.misplaced(info, stream_info)
            except jsapi.NoLeader as e:
                await self._delete_quietly()
                raise ConsumerLost(f"no consumer on the stream leader: {e}") from None
            except BaseException:
                asyncio.ensure_future(self._delete_quietly())
                raise
            if why is None:
                if attempt:
                    log.info("%s: consumer on the stream leader after %d misplaced ones", self.stream, attempt)
                return info, stream_info
            await self._delete_quietly()
        raise ConsumerLost(f"no consumer on the stream leader in {PLACEMENT_TRIES} tries: {why}")

    async def _create(self) -> dict:
        cfg: dict = {
            "name": self.name,
            "ack_policy": "none",
            "replay_policy": "instant",
            "mem_storage": True,
            "num_replicas": 1,
            "inactive_threshold": int(max(60.0, 10 * self.heartbeat_s) * 1e9),
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
        return await jsapi.api_request(
            self.nc, f"{self.api}.CONSUMER.CREATE.{self.stream}.{self.name}",
            {"stream_name": self.stream, "config": cfg, "action": "create"}, self.timeout,
        )

    async def _delete_quietly(self) -> None:
        try:
            await jsapi.api_request(
                self.nc, f"{self.api}.CONSUMER.DELETE.{self.stream}.{self.name}", None, 1.0)
        except Exception:  # inactive_threshold reaps it anyway
            pass

    async def _pull(self) -> None:
        """Top the window up to PULL_BATCH messages; each request's bytes are capped too, so
        at most two requests' worth (a few tens of MiB) is ever buffered."""
        want = PULL_BATCH - self._pending_msgs
        if want <= 0:
            return
        req = {
            "batch": want,
            "max_bytes": self._max_bytes,
            "expires": int(PULL_EXPIRES_S * 1e9),
            "idle_heartbeat": int(self.heartbeat_s * 1e9),
        }
        self._pending_msgs += want
        await self.nc.publish(
            f"{self.api}.CONSUMER.MSG.NEXT.{self.stream}.{self.name}",
            json.dumps(req).encode(), reply=self._inbox,
        )

    # -------------------------------------------------------------- delivery path

    def _on_lane(self, batch: list) -> None:
        """Everything one socket read brought for this consumer: Runs and statuses, in order."""
        if self._done or self._failure or self._error:
            return
        self._last_activity = time.monotonic()
        runs: list[Run] = []
        for ev in batch:
            if type(ev) is Run:
                if ev.first_cseq != self._next_cseq:
                    self._failure = f"consumer sequence gap: expected {self._next_cseq}, got {ev.first_cseq}"
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
                                 f"received only up to {self._next_cseq - 1}")
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
            self._failure = f"consumer ended: {status} {desc}".strip()
            return
        log.debug("ignoring status %s %s on %s", status, desc, self.stream)


class Feed:
    """Keeps one bucket's replica in step with its stream; owns its position and health."""

    def __init__(self, nc: NatsConnection, bucket: BucketConfig, replica: Replica, *,
                 heartbeat_s: float = 2.0, timeout: float = 5.0,
                 on_fatal: Callable[[BaseException], None] | None = None) -> None:
        self.nc = nc
        self.on_fatal = on_fatal
        self.cfg = bucket
        self.bucket = bucket.name
        self.stream = jsapi.kv_stream(bucket.name)
        self.prefix = f"$KV.{bucket.name}."
        self.filters = [self.prefix + k for k in bucket.keys]
        self.replica = replica
        self.heartbeat_s = heartbeat_s
        self.timeout = timeout
        self.meta = replica.meta(self.bucket)
        self.stream_config: dict = {}
        self.upstream_seq = 0
        self.caught_up = False
        self.last_msg_ns = 0
        # Catching up after an interruption (start, lost consumer, reconnect): see lag_ms.
        self._interrupted = True
        self.consumers_created = 0
        self._full = False
        self._seen: set[bytes] | None = None
        self._reconcile_pending = False
        self._reconnected = False
        self._consumer: PullConsumer | None = None
        self._task: asyncio.Task | None = None
        self._reconcile_task: asyncio.Task | None = None
        self._sweep_task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None
        self._hint_tasks: set[asyncio.Task] = set()
        self._api_subs: list = []
        self.max_age_ns = 0       # the stream's max_age: applied at every read (record.deadline)
        self._deadlines = True    # may records have a deadline (max_age, per-message TTLs)?
        self.first_seq = 0        # the stream's first sequence when last looked at
        self.removed_upstream = 0  # records removed with no message: expiry, limits, purges
        self.state_polls = 0      # STREAM.INFO requests made to watch for such removals
        self._synced_event = asyncio.Event()
        self._last_meta_write = 0
        self._sync_started = 0.0
        self._waiters: list[tuple[int, asyncio.Future]] = []
        # Revisions handed out from NATS that the replica has not reached (see handed_out):
        # key -> the highest such revision, and the highest of all (0: none, the common case).
        self.ahead: dict[str, int] = {}
        self.floor_seq = 0
        self._ahead_overflow = False  # AHEAD_MAX reached: every key waits for floor_seq
        # Called when the first key is gated: the server drops the GET path's cached verdicts
        # (LocalGets.forget_fresh), which would otherwise answer from the replica for a while.
        self.on_gated: Callable[[], None] | None = None
        # Called when the stream was recreated or rewound (its revisions start again): the
        # router forgets the bucket's floors (Router.floors.forget).
        self.on_renumbered: Callable[[], None] | None = None
        if self.meta.synced:
            self._synced_event.set()

    # -------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Check the bucket exists and choose resume or full resync; raises BucketNotFound."""
        info = await self._stream_info()
        self._plan(info, reconcile=True)
        self._task = asyncio.create_task(self._run(), name=f"feed:{self.bucket}")
        self._task.add_done_callback(self._task_done)
        self._sweep_task = asyncio.create_task(self._sweep_loop(), name=f"expiry:{self.bucket}")
        self._watch_task = asyncio.create_task(self._watch_loop(), name=f"removals:{self.bucket}")
        for op in ("PURGE", "MSG.DELETE"):  # requests that remove messages without a marker
            self._api_subs.append(await self.nc.subscribe(
                f"$JS.API.STREAM.{op}.{self.stream}", cb=self._on_removal_request))

    async def _stream_info(self) -> dict:
        """The stream as its leader sees it, waiting up to the request timeout for a leader
        (a member answering meanwhile may be far behind: a lag would look like a purge)."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return await jsapi.stream_info(self.nc, self.stream, self.timeout, need_leader=True)
            except jsapi.NoLeader:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.1)

    def _plan(self, info: dict, reconcile: bool = False) -> None:
        """Resume or resync. `reconcile`: also check, once caught up, for keys that vanished
        without a trace in the stream (after a process start or a reconnect, when that is
        likely)."""
        self.stream_config = info.get("config", {})
        self._set_deadlines(int(self.stream_config.get("max_age", 0) or 0),
                          bool(self.stream_config.get("allow_msg_ttl")))
        state = info.get("state", {})
        first, last = state.get("first_seq", 0), state.get("last_seq", 0)
        self.first_seq = first
        created = info.get("created", "")
        m = self.meta
        reason = None
        count_it = bool(m.applied_seq)
        if not m.stream:
            reason = "first sync"
        elif not m.synced:
            # Also a crash or a lost consumer in the middle of a full sync: the initial set
            # comes in subject order, so its progress cannot be resumed.
            reason = "previous full sync did not finish"
            count_it = False
        elif m.stream_created and created and m.stream_created != created:
            reason = "stream was recreated"
        elif last < m.applied_seq:
            reason = f"stream sequence went backwards ({last} < {m.applied_seq})"
        elif first > m.applied_seq + 1:
            reason = f"stream no longer holds sequence {m.applied_seq + 1} (first is {first})"
        self._full = reason is not None
        if reason is not None and self.on_renumbered is not None and (
                reason == "stream was recreated" or reason.startswith("stream sequence went backwards")):
            self.on_renumbered()
        if self._full:
            if count_it and reason != "first sync":
                m.resyncs += 1
            if m.stream:
                log.warning("bucket %s: full resync: %s", self.bucket, reason)
            m.synced = False
            m.applied_seq = 0
            self.upstream_seq = last
            self._synced_event.clear()
            self._reconcile_pending = False
            if self._reconcile_task and not self._reconcile_task.done():
                self._reconcile_task.cancel()
        else:
            self.upstream_seq = max(self.upstream_seq, last)
            log.info("bucket %s: resuming after sequence %d", self.bucket, m.applied_seq)
            self._reconcile_pending = self._reconcile_pending or reconcile
        m.stream = self.stream
        m.stream_created = created
        m.max_age_ns = self.max_age_ns
        self.replica.put_meta(self.bucket, m)

    def _set_deadlines(self, max_age_ns: int, msg_ttl: bool) -> None:
        """The stream's max_age, where every reader applies it (LocalReader: in the meta),
        and whether it takes per-message TTLs. A new max_age moves every record's deadline,
        and per-message TTLs turned on may have come before this saw it: the expiry index is
        filed anew."""
        deadlines = bool(max_age_ns or msg_ttl)
        changed = max_age_ns != self.meta.max_age_ns or (deadlines and not self._deadlines)
        self._deadlines = deadlines
        self.max_age_ns = max_age_ns
        self.replica.max_age[self.bucket] = max_age_ns
        self.meta.max_age_ns = max_age_ns
        if changed and deadlines and self.replica.count(self.bucket):
            t = asyncio.get_running_loop().create_task(self._refile(), name=f"refile:{self.bucket}")
            self._hint_tasks.add(t)
            t.add_done_callback(self._hint_tasks.discard)

    async def _refile(self) -> None:
        after: bytes | None = None
        while True:
            try:
                after = self.replica.refile(self.bucket, after, EXPIRY_PAGE)
            except ReplicaError as e:
                log.warning("bucket %s: filing records by their new deadline failed: %s", self.bucket, e)
                return
            if after is None:
                return
            await asyncio.sleep(0)

    def _task_done(self, task: asyncio.Task) -> None:
        """The loop retries every failure it knows; if it ends anyway, that is a bug, and a
        replica nobody updates must not go on being served as fresh: say so and let the
        owner stop the process (its supervisor restarts it, and the restart resumes)."""
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.critical("bucket %s: feed stopped", self.bucket, exc_info=exc)
            self.caught_up = False
            if self.on_fatal is not None:
                self.on_fatal(exc)

    async def stop(self) -> None:
        for sub in self._api_subs:
            try:
                await sub.unsubscribe()
            except Exception:  # the connection may be gone already
                pass
        for task in (self._task, self._reconcile_task, self._sweep_task, self._watch_task,
                     *self._hint_tasks):
            if task and not task.done():
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass

    async def wait_synced(self, timeout: float | None = None) -> None:
        await asyncio.wait_for(self._synced_event.wait(), timeout)

    async def wait_applied(self, seq: int, timeout: float) -> bool:
        """True once the replica holds stream sequence `seq` (MINREV), False on timeout."""
        if self.meta.synced and self.meta.applied_seq >= seq:
            return True
        fut = asyncio.get_running_loop().create_future()
        item = (seq, fut)
        self._waiters.append(item)
        try:
            await asyncio.wait_for(fut, timeout)
            return True
        except TimeoutError:
            return False
        finally:
            if item in self._waiters:
                self._waiters.remove(item)

    def _wake_waiters(self) -> None:
        if not self.meta.synced:
            return
        applied = self.meta.applied_seq
        for seq, fut in self._waiters:
            if seq <= applied and not fut.done():
                fut.set_result(None)

    def connection_lost(self) -> None:
        """Called on disconnect: stop claiming freshness, and start over on reconnect."""
        self.caught_up = False
        self._interrupted = True
        self._reconnected = True
        if self._consumer:
            self._consumer.fail("connection lost")

    # -------------------------------------------------------------- health

    @property
    def synced(self) -> bool:
        return self.meta.synced

    def lag_ms(self) -> int:
        """0 while caught up; else the age of the newest state we are sure to hold.

        While catching up after an interruption, the age counts from the last time we were
        caught up, not from the newest message applied: the replica then passes through the
        stream's past states, and reads that went to the peers during the outage may already
        have served newer revisions; serving an intermediate state locally would take those
        keys back in time (seen in tests/test_faults.py with a stream leader killed during
        writes: revision 806 read from a peer, then 406 from the catching-up replica)."""
        if self.caught_up:
            return 0
        fresh = self.meta.fresh_at_ns if self._interrupted else max(self.meta.fresh_at_ns, self.last_msg_ns)
        return max(0, (time.time_ns() - fresh) // 1_000_000) if fresh else 0

    def fresh_enough(self, max_stale_ms: int) -> bool:
        """May reads be answered locally without looking at each key? Fresh within the bound
        (fresh_within), and no key is gated (see handed_out): the GET fast path asks this
        alone, so while a key is gated its GETs go to the command layer, which asks per key."""
        return not self.floor_seq and self.fresh_within(max_stale_ms)

    def fresh_within(self, max_stale_ms: int) -> bool:
        """Is the replica fresh enough to answer: synced, and not staler than the bound?
        Whether a given key may then be answered locally is `behind`'s question."""
        return self.meta.synced and (self.caught_up or self.lag_ms() <= max_stale_ms)

    # -------------------------------------------------------------- revisions handed out

    def handed_out(self, key: str, revision: int) -> None:
        """An answer for `key` at `revision` (a value, or a deletion's marker) was handed out
        from NATS. A replica that has not reached it yet may lag within max_stale_ms, and its
        older record must not answer the key's next read (a strong read, then a plain one):
        until the replica reaches the revision the key is gated (`behind`), and the GET fast
        path, which does not look per key, stands aside (fresh_enough). An unsynced replica's
        position says nothing (a full sync comes in subject order): every revision counts."""
        if revision <= self.meta.applied_seq and self.meta.synced:
            return
        opened = not self.floor_seq
        if key in self.ahead or len(self.ahead) < AHEAD_MAX:
            if revision > self.ahead.get(key, 0):
                self.ahead[key] = revision
        else:
            self._ahead_overflow = True
        if revision > self.floor_seq:
            self.floor_seq = revision
        if opened and self.on_gated is not None:
            self.on_gated()

    def behind(self, key: str, revision: int | None) -> int:
        """0 when the replica may answer `key` without going back in time: its record's
        `revision` (None: it has none) is not below a revision of the key already handed out
        from NATS, or the replica has reached that. Else the stream sequence to wait for."""
        if not self.floor_seq:
            return 0
        want = self.floor_seq if self._ahead_overflow else self.ahead.get(key, 0)
        if not want or (revision is not None and revision >= want) or (
                self.meta.synced and self.meta.applied_seq >= want):
            return 0
        return want

    def _release(self) -> None:
        """The replica reached every revision handed out ahead of it: no key is gated now."""
        if self.meta.synced and self.meta.applied_seq >= self.floor_seq:
            self._clear_gate()

    def _clear_gate(self) -> None:
        self.ahead.clear()
        self.floor_seq = 0
        self._ahead_overflow = False

    # -------------------------------------------------------------- consumer loop

    async def _run(self) -> None:
        backoff = 0.1
        planned = True
        while True:
            if planned:
                consumer = self._new_consumer()
                progressed = True
                try:
                    self.consumers_created += 1
                    await consumer.run()
                except asyncio.CancelledError:
                    raise
                except ReplicaError as e:
                    # Nothing past the failed batch is applied, so nothing is skipped: the
                    # next consumer starts again right after the last batch that made it.
                    log.error("bucket %s: %s; retrying", self.bucket, e)
                    progressed = False
                except (ConsumerLost, UpstreamError, BucketNotFound) as e:
                    log.warning("bucket %s: recreating consumer: %s", self.bucket, e)
                except Exception:
                    log.exception("bucket %s: feed failed; recreating consumer", self.bucket)
                if progressed and consumer.delivered:
                    backoff = 0.1
            self.caught_up = False
            self._interrupted = True
            await asyncio.sleep(backoff * (0.5 + random.random()))
            backoff = min(backoff * 2, 5.0)
            planned = await self._replan()

    def _new_consumer(self) -> PullConsumer:
        start = None if self._full else self.meta.applied_seq + 1
        consumer = PullConsumer(
            self.nc, self.stream, self.prefix, self.filters, start_seq=start,
            headers_only=False, heartbeat_s=self.heartbeat_s,
            on_batch=self._on_batch, on_idle=self._on_idle, after_create=self._check_identity,
            timeout=self.timeout,
        )
        self._consumer = consumer
        if self._full:
            # Keys the sync does not deliver must go at the end; an empty replica has none.
            self._seen = set() if self.replica.count(self.bucket) else None
            self._sync_started = time.monotonic()
            # Nothing is read locally until the sync ends, and then the replica holds every
            # revision handed out before it began; those of a stream since recreated (lower
            # sequences) would otherwise keep their keys gated for good.
            self._clear_gate()
        return consumer

    async def _check_identity(self, info: dict) -> None:
        """Right after creating a consumer: is it on the stream we planned for? The stream may
        have been deleted and recreated between our look at it and the consumer's creation."""
        created = info.get("created", "")
        if created and self.meta.stream_created and created != self.meta.stream_created:
            raise ConsumerLost("the stream was recreated while the consumer was being created")

    async def _replan(self) -> bool:
        """Before recreating, check the stream: it may have been purged or recreated meanwhile.
        False when the stream cannot be looked at (gone, or NATS unreachable): try again later."""
        try:
            info = await self._stream_info()
        except (UpstreamError, BucketNotFound) as e:  # keep trying, serve what we have
            log.warning("bucket %s: %s", self.bucket, e)
            return False
        reconnected, self._reconnected = self._reconnected, False
        self._plan(info, reconcile=reconnected)
        return True

    def _on_batch(self, runs: list[Run]) -> bool:
        last = runs[-1]
        top = max(self.meta.applied_seq, max(r.top_sseq for r in runs))
        now = time.time_ns()
        caught_up = last.last_pending == 0
        # The new position is ours only once the batch is written: a failed write must leave
        # the feed where it was, so that the next consumer starts at this batch again.
        m = dataclasses.replace(self.meta, applied_seq=top, last_update_ns=now)
        if caught_up:
            m.fresh_at_ns = now
            if self._full and self._seen is None:
                m.synced = True  # nothing to sweep: the last batch of the sync says so itself
        items = last.items if len(runs) == 1 else [it for r in runs for it in r.items]
        self.replica.apply_items(self.bucket, items, m, deletes=any(r.deletes for r in runs),
                                 deadlines=self._deadlines)
        self.meta = m
        if self._seen is not None:
            self._seen.update(lk for lk, _ in items)
        self._last_meta_write = now
        self.last_msg_ns = last.last_ts
        self.upstream_seq = max(self.upstream_seq, top)
        self.caught_up = caught_up
        if caught_up:
            self._reached_end()
        if self.floor_seq:
            self._release()
        if self._waiters:
            self._wake_waiters()
        return False

    def _on_idle(self, last_stream_seq: int) -> None:
        """Caught up and the server has nothing more. `last_stream_seq` (from a heartbeat,
        0 if unknown) is how far the consumer has looked: every matching message up to it
        was delivered, so the position may advance to it (keeps filtered buckets resumable)."""
        self.caught_up = True
        now = time.time_ns()
        m = self.meta
        m.fresh_at_ns = now
        if last_stream_seq > m.applied_seq and not self._full:
            m.applied_seq = last_stream_seq
            self.upstream_seq = max(self.upstream_seq, last_stream_seq)
        self._reached_end()
        if now - self._last_meta_write >= META_TOUCH_INTERVAL_NS:
            self._last_meta_write = now
            self.replica.put_meta(self.bucket, m)
        if self.floor_seq:
            self._release()
        if self._waiters:
            self._wake_waiters()

    def _reached_end(self) -> None:
        """End of initial data: finish a full resync's sweep, or start a resume's reconcile."""
        self._interrupted = False
        m = self.meta
        if self._full:
            self._full = False
            removed = self._sweep(self._seen) if self._seen is not None else 0
            self._seen = None
            m.synced = True
            self.replica.put_meta(self.bucket, m)
            log.info("bucket %s: synced %d keys in %.2fs (%d stale keys removed)",
                     self.bucket, self.replica.count(self.bucket),
                     time.monotonic() - self._sync_started, removed)
        elif not m.synced:
            m.synced = True
            self.replica.put_meta(self.bucket, m)
        self._synced_event.set()
        if self._reconcile_pending:
            self._reconcile_pending = False
            if self._reconcile_task and not self._reconcile_task.done():
                self._reconcile_task.cancel()
            self._reconcile_task = asyncio.get_running_loop().create_task(
                self._reconcile(), name=f"reconcile:{self.bucket}")

    def _sweep(self, keep: set[bytes], max_revision: int | None = None,
               within: list[str] | None = None) -> int:
        """Delete replica keys absent from `keep` (and not newer than max_revision; only keys
        matching one of the `within` patterns, when given: those are looked up, or listed
        from their literal prefix on, never the whole replica)."""
        if within is None:
            candidates = self.replica.iter_keys(self.bucket)
        else:
            candidates = (item for pattern in within for item in self.replica.iter_matching(self.bucket, pattern))
        stale = [lk for lk, _ in candidates if lk not in keep]
        if max_revision is not None:
            stale = [lk for lk in stale if self.replica.revision(self.bucket, lk) <= max_revision]
        return self.replica.delete_lkeys(self.bucket, stale) if stale else 0

    # -------------------------------------------------------------- removals with no message

    async def _sweep_loop(self) -> None:
        """Remove records whose deadline passed (a Nats-TTL of their own, or the bucket's
        max_age), reading only the expiry index's due entries. Reads hide such records at
        once (record.deadline), so this is about space and key counts: it runs when the
        earliest deadline comes, at least every SWEEP_MAX_S."""
        while True:
            due = self.replica.next_due(self.bucket)
            wait = SWEEP_MAX_S if due is None else (due - time.time_ns()) / 1e9
            await asyncio.sleep(min(SWEEP_MAX_S, max(wait, 0.0)) + 0.001)
            try:
                more = True
                while more:
                    removed, more = self.replica.sweep_expired(self.bucket, time.time_ns(), EXPIRY_PAGE)
                    self.removed_upstream += removed
                    if more:
                        await asyncio.sleep(0)  # a page at a time: reads go on meanwhile
            except ReplicaError as e:  # the next turn tries again
                log.warning("bucket %s: expiry sweep failed: %s", self.bucket, e)

    def _watch_period(self) -> float:
        return min(WATCH_MAX_S, max(WATCH_MIN_S, self.cfg.max_stale_ms / 4000))

    async def _watch_loop(self) -> None:
        """Watch the stream's state (one STREAM.INFO every max_stale_ms / 4, 0.25 s to 5 s)
        for removals that leave no message the feed could follow: a whole-stream purge and
        the stream's limits (max_msgs, max_bytes, max_age) remove from the front, so the
        first sequence moves past keys whose newest revision is gone; a max_age change moves
        every deadline. One-subject purges and message deletes are seen as requests
        (_on_removal_request). Only while caught up: before that the feed itself plans."""
        while True:
            await asyncio.sleep(self._watch_period())
            if not self.caught_up or self._full or not self.meta.synced:
                continue
            try:
                await self.check_state()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the next period tries again; the data is still served
                log.warning("bucket %s: stream state check failed: %s", self.bucket, e)

    async def check_state(self, force: bool = False) -> int:
        """Look at the stream once and drop what it no longer holds; records removed.
        `force`: after a purge request, look for keys below the first sequence even where
        max_age alone would explain its moving."""
        self.state_polls += 1
        info = await self._stream_info()
        config = info.get("config", {})
        max_age = int(config.get("max_age", 0) or 0)
        msg_ttl = bool(config.get("allow_msg_ttl"))
        if max_age != self.max_age_ns or (msg_ttl and not self._deadlines):
            log.info("bucket %s: max_age is now %ds%s", self.bucket, max_age // 1_000_000_000,
                     ", with per-message TTLs" if msg_ttl else "")
            self._set_deadlines(max_age, msg_ttl)
            self.replica.put_meta(self.bucket, self.meta)
        state = info.get("state", {})
        first, last = state.get("first_seq", 0), state.get("last_seq", 0)
        removed = 0
        if first > self.first_seq:
            if not (force or _front_removal_possible(config) or first > last):
                # max_age moves it: every record below it has passed its deadline, which
                # reads apply by themselves and the sweep follows; a pass is not needed.
                self.first_seq = first
            # Wait for what the snapshot holds: a key's newer revision may still be on its way,
            # and dropping the old one meanwhile would answer "not found" for a key that exists.
            elif await self.wait_applied(last, self.timeout):
                removed = await self._drop_below(first, last)
                self.first_seq = first
        if removed:
            self.removed_upstream += removed
            log.info("bucket %s: %d keys with no message left in the stream removed", self.bucket, removed)
        return removed

    async def _drop_below(self, first: int, last: int) -> int:
        """Remove keys whose newest revision is below the stream's first sequence: they have
        no message left. Everything when the stream is empty (a purge): one drop. Otherwise
        a pass over the records, a page at a time; each page is read and deleted without an
        await in between, so no newer revision can land between the two."""
        if first > last and self.meta.applied_seq <= last:
            n = self.replica.count(self.bucket)
            if n:
                self.replica.clear_bucket(self.bucket)
            return n
        removed = 0
        after: bytes | None = None
        while True:
            if self._full:
                break
            gone, after = self.replica.older_than(self.bucket, first, after, EXPIRY_PAGE)
            if gone:
                removed += self.replica.delete_lkeys(self.bucket, gone)
            if after is None:
                break
            await asyncio.sleep(0)
        return removed

    async def _on_removal_request(self, msg) -> None:
        """A STREAM.PURGE or STREAM.MSG.DELETE request for our stream went by: such removals
        leave no message. Look again once the server has had time to carry it out: the
        stream's state for a purge of everything, the purged keys (or, for a deleted message,
        every key) with a headers-only pass."""
        try:
            req = json.loads(msg.data or b"{}")
        except ValueError:
            req = {}
        subject = req.get("filter", "") if msg.subject.startswith("$JS.API.STREAM.PURGE.") else ""
        if subject and not subject.startswith(self.prefix):
            return
        t = asyncio.get_running_loop().create_task(self._after_removal(subject), name=f"purge:{self.bucket}")
        self._hint_tasks.add(t)
        t.add_done_callback(self._hint_tasks.discard)

    async def _after_removal(self, subject: str) -> None:
        waited = 0.0
        for at in HINT_CHECKS_S:
            await asyncio.sleep(at - waited)
            waited = at
            if self._full or not self.meta.synced:
                return
            try:
                await self.check_state(force=True)  # counts and logs what it removes itself
                removed = await self._reconcile_once([subject] if subject else None) or 0
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("bucket %s: check after a purge request failed: %s", self.bucket, e)
                continue
            if removed:
                self.removed_upstream += removed
                log.info("bucket %s: %d keys removed by a purge or message delete", self.bucket, removed)

    # -------------------------------------------------------------- reconcile

    async def _reconcile(self) -> None:
        """After a resume, find keys that vanished while we were down (purged delete markers,
        TTL expiry, stream purge) with a headers-only last-per-subject pass, and drop them.
        A failed pass (NATS busy electing leaders after a restart) is tried again a little
        later; after RECONCILE_TRIES the next start tries again, and the data is served meanwhile."""
        for attempt in range(1, RECONCILE_TRIES + 1):
            try:
                removed = await self._reconcile_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("bucket %s: reconcile pass failed (try %d of %d): %s",
                            self.bucket, attempt, RECONCILE_TRIES, e)
                if attempt < RECONCILE_TRIES:
                    await asyncio.sleep(attempt * self.heartbeat_s)
                continue
            if removed is None:  # a full resync started meanwhile and sweeps by itself
                return
            if removed:
                log.info("bucket %s: reconcile removed %d keys that vanished upstream", self.bucket, removed)
            else:
                log.info("bucket %s: reconcile found nothing to remove", self.bucket)
            return

    async def _reconcile_once(self, only: list[str] | None = None) -> int | None:
        """One headers-only pass: keys of the replica absent from the stream go. `only`:
        subjects narrowing the pass (a purge's filter); only replica keys they match go."""
        info = await self._stream_info()
        snapshot = info.get("state", {}).get("last_seq", 0)
        live: set[bytes] = set()
        consumer: PullConsumer | None = None

        def collect(runs: list[Run]) -> bool:
            for r in runs:
                for lk, rec in r.items:
                    if rec is not None:
                        live.add(lk)
                    else:
                        live.discard(lk)
            return runs[-1].last_pending == 0

        def idle(_last: int) -> None:
            if consumer is not None:
                consumer.finish()

        consumer = PullConsumer(
            self.nc, self.stream, self.prefix, only or self.filters, start_seq=None,
            headers_only=True, heartbeat_s=self.heartbeat_s,
            on_batch=collect, on_idle=idle, timeout=self.timeout,
        )
        await consumer.run()
        if self._full:
            return None
        within = [f[len(self.prefix):] for f in only] if only else None
        return self._sweep(live, max_revision=snapshot, within=within)


def _front_removal_possible(config: dict) -> bool:
    """Can the stream drop messages from its front other than by max_age (for which reads
    and the expiry sweep need no pass over the replica)? Without max_age, anything that moves
    the first sequence is such a removal; with it, only message or byte limits under the
    `old` discard policy (a KV bucket's default policy, `new`, refuses puts instead)."""
    if not config.get("max_age"):
        return True
    return config.get("discard", "old") == "old" and (
        (config.get("max_msgs", -1) or -1) > 0 or (config.get("max_bytes", -1) or -1) > 0)
