"""The feed: keeps one bucket's replica equal to its stream.

It manages its own consumer (kvcache.feed.consumer) instead of nats-py's `watch()`: a push watch
with nats-py's default pending limits drops messages as a slow consumer on big buckets and
never recovers. Here the consumer is pull-based, so nothing can be dropped and memory stays
bounded by one pull window. A bucket whose stream has a RePublish covering it is followed on
that core subject once the consumer has caught up, and the consumer deleted
(kvcache.feed.follow: `_consume`, `_follow`): a consumer per sidecar per bucket is what a fleet
would otherwise cost the cluster.

This module holds the sync itself: choosing a start (`start_decision`: resume from the stored
sequence, or a full resync when the stream no longer holds it, was recreated or rewound), and applying each
event-loop turn's deliveries (kvcache.natsio.nats_connection: up to ~1 MiB read) in one LMDB
transaction together with the last applied stream
sequence. The feed composes the rest: how current the replica is known to be (`fresh_within`,
`lag_ms`: kvcache.feed.freshness), the waits for its position (`wait_applied`:
kvcache.feed.position) and the near cache's side (kvcache.feed.cachekeeper); what it applied
it reports (`on_applied`, `on_resync`), and the read side's ledger (kvcache.read.ledger)
keeps what was handed out. The passes that keep the replica equal when no
message says so (expiry, removals, reconcile) are in kvcache.feed.sweeps.

Two facts about the server shape the bookkeeping here:
- `last_per_subject` delivers the initial set in subject order, not stream order, so while a
  full sync runs the highest sequence seen says nothing about which keys are still to come. An
  interrupted full sync therefore starts over; only a finished one yields a resumable position.
- A pull request can end in several ways (408 expired, 409 "Batch Completed", 409 "Message
  Size Exceeds MaxBytes", ...); only the ones listed in consumer.REQUEST_ENDED are harmless.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections import Counter
from collections.abc import Callable

from ..config import BucketConfig
from ..errors import BucketNotFound, ReplicaError, UpstreamError
from ..natsio import jetstream as jsapi
from ..natsio.nats_connection import NatsConnection, unsubscribe_quietly
from ..store.nearcache import NearCache, drop_store
from ..store.record import decode_key
from ..store.replica import BucketMeta, Replica
from .cachekeeper import CacheKeeper
from .changes import ChangeHub
from .consumer import ConsumerLost, PullConsumer, Run
from .follow import FollowEnded, Follower, republish_subject
from .freshness import Freshness
from .position import Position
from .quorum import ANCHOR_MAX_BYTES, NO_FENCE, QUORUM_HEARTBEAT_S, Evidence, Fence
from .relay import HEARD_WITHIN_PERIODS
from .sweeps import Maintenance
from .unwritable import Unwritable

log = logging.getLogger("kvcache.feed")

META_TOUCH_INTERVAL_NS = 1_000_000_000
# A follower of the fleet's relay that has heard no relay for this many state-poll periods
# goes back to its own consumer (a new relay is elected within about 2.5 of them).
RELAY_SILENT_PERIODS = 3.0
# How the log lines name each core subject a feed follows
_SOURCES = {"republish": "stream's RePublish", "relay": "fleet relay's"}


class Feed(Maintenance):
    """Keeps one bucket's replica in step with its stream; owns its position and health, and
    answers what the read policy asks: synced?, fresh within a bound?, may this record
    answer this key?"""

    def __init__(self, nc: NatsConnection, bucket: BucketConfig, replica: Replica, *,
                 heartbeat_s: float = 2.0, timeout: float = 5.0,
                 on_fatal: Callable[[BaseException], None] | None = None,
                 on_applied: Callable[[BucketMeta], None] | None = None,
                 on_resync: Callable[[], None] | None = None,
                 on_renumbered: Callable[[], None] | None = None,
                 on_removed: Callable[[int | None], None] | None = None,
                 hub: ChangeHub | None = None, consumer_name: str | None = None) -> None:
        self.nc = nc
        # The name its consumers take on the stream (kvcache.feed.names); None: random ones.
        self.consumer_name = consumer_name
        self.on_fatal = on_fatal
        self.cfg = bucket
        self.bucket = bucket.name
        self.stream = jsapi.kv_stream(bucket.name)
        self.prefix = f"$KV.{bucket.name}."
        self.filters = [self.prefix + k for k in bucket.keys]
        # The near cache of keys outside the filters (set_cache): with one, the consumer
        # covers the whole bucket, and the keeper (kvcache.feed.cachekeeper) keeps it true.
        self.cache: NearCache | None = None
        self._keeper: CacheKeeper | None = None
        self.replica = replica
        self.heartbeat_s = heartbeat_s
        self.timeout = timeout
        self.meta = replica.meta(self.bucket)
        self.stream_config: dict = {}
        # How current the replica is known to be: the consumer's word and, for a replicated
        # stream, quorum evidence (kvcache.feed.freshness).
        self.freshness = Freshness(bucket, heartbeat_s, self.meta.fresh_at_ns)
        # Failed writes of the replica, retried until one succeeds (kvcache.feed.unwritable).
        self.unwritable = Unwritable(bucket.name, self.freshness.clock)
        self._info_sent_ns = 0  # when the last STREAM.INFO that answered was asked
        self.anchor = ""  # a key with a message in the stream (the last batch's): see Fence
        self._anchor_task: asyncio.Task | None = None
        self.upstream_seq = 0
        self.consumers_created = 0
        # since start, by reason (metrics labels: a few fixed words, never a message)
        self.resync_reasons: Counter[str] = Counter()  # RESYNC_REASONS
        self.recreations: Counter[str] = Counter()  # RECREATION_REASONS (_recreation_reason)
        self._full = False
        self._seen: set[bytes] | None = None
        self._reconcile_pending = False
        self._reconnected = False
        self._retry_now = asyncio.Event()  # cuts the wait between consumers short (reconnected)
        self._consumer: PullConsumer | None = None
        # Following the stream's RePublish with no consumer (kvcache.feed.follow): the follower
        # while it follows; `_handoff` is set when a consumer has caught up (Feed._consume).
        self._follower: Follower | None = None
        self._handoff = asyncio.Event()
        self._republish_denied = False  # the server refused the subscription: keep a consumer
        # The fleet's relay for a bucket whose stream has no usable RePublish (kvcache.feed.relay,
        # set by the sidecar with `follow_relay`): its changes subject, and whether a relay was
        # heard within so many seconds (or this sidecar relays the bucket itself).
        self.relay_subject: str | None = None
        self._relay_heard: Callable[[float], bool] | None = None
        self.follow_received = 0     # messages received on the RePublish subject
        self.follow_duplicates = 0   # ...at or below the replica's position (or twice)
        self.follow_foreign = 0      # ...not of this stream (ignored)
        self.gaps_filled = 0         # gaps found and filled with Direct Get batches
        self.gap_fill_messages = 0   # messages those fills applied
        self.gap_fill_seconds = 0.0  # time spent filling
        self.skips_pinned = 0  # fills that skipped sequences no longer in the stream (Follower._fill)
        # The highest sequence written to the replica (`written_seq`), and the pin (`pin`):
        # when the latest jump over sequences gone from the stream was seen (wall clock, ns),
        # 0 when the position is the highest sequence written.
        self._written_seq = 0
        self.pinned_ns = 0
        self.follow_ends: Counter[str] = Counter()  # back to a consumer, by FOLLOW_END_REASONS
        # Since when (monotonic) a quorum has shown the stream past the replica (`_behind`)
        self._behind_since: float | None = None
        self._task: asyncio.Task | None = None
        self._reconcile_task: asyncio.Task | None = None
        self._sweep_task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None
        self._hint_tasks: set[asyncio.Task] = set()
        self._api_subs: list = []
        self.max_age_ns = 0       # the stream's max_age: applied at every read (record.deadline)
        self._deadlines = True    # may records have a deadline (max_age, per-message TTLs)?
        self._sweep_wake = asyncio.Event()  # see Maintenance._sweep_loop
        self.first_seq = 0        # the stream's first sequence when last looked at
        self.removed_upstream = 0  # records removed with no message: expiry, limits, purges
        self.state_polls = 0      # looks at the stream's state for such removals
        self._synced_event = asyncio.Event()
        self._last_meta_write = 0
        self._sync_started = 0.0
        # Reads waiting for the replica to reach a sequence (kvcache.feed.position); and who is
        # told of each move of the replica (`on_applied`) and of each full sync begun
        # (`on_resync`): the read side's ledger (kvcache.read.ledger).
        self.position = Position()
        self.on_applied = on_applied
        self.on_resync = on_resync
        # Called after every change of what `fresh_within` answers (a batch applied, caught up
        # or not, an interruption, a resync begun or ended, quorum evidence): the workers'
        # board republishes the bucket's deadline (kvcache.supervisors.board). None: nobody.
        self.on_state: Callable[[], None] | None = None
        # Called when the stream was recreated or rewound (its revisions start again): the
        # ledger forgets the bucket's floors (kvcache.read.ledger).
        self.on_renumbered = on_renumbered
        # Called when messages went with no marker: `first` when the stream dropped everything
        # below it, None after a purge or message delete request (which keys is unknown). The
        # ledger forgets the floors those removals make moot (kvcache.read.ledger).
        self.on_removed = on_removed
        # Where the changes this feed applies go (kvcache.feed.changes): tracking clients'
        # invalidations, keyspace notifications, WATCH (the sidecar's one hub).
        self.hub = hub
        if self.meta.synced:
            self._synced_event.set()

    # -------------------------------------------------------------- near cache

    def set_cache(self, cache: NearCache) -> None:
        """Before start: keys outside the filters are cached (kvcache.store.nearcache), and this
        feed keeps them true: its consumer reads the whole bucket from now on."""
        self.cache = cache
        self._keeper = CacheKeeper(self.cfg, cache, self.timeout)
        self.filters = [self.prefix + ">"]

    def fill_ok(self, lkey: bytes, revision: int) -> bool:
        """May a fallback read's answer (at `revision`) go into the near cache? Only while
        this feed vouches for the bucket (fresh within max_stale_ms), and only if it saw no
        newer change of the key while the read was on its way (CacheKeeper.fill_ok)."""
        if not self.fresh_within(self.cfg.max_stale_ms):
            return False
        return self._keeper is None or self._keeper.fill_ok(lkey, revision)

    def _clear_cache(self, why: str) -> None:
        if self._keeper is not None:
            self._keeper.clear(why)

    # -------------------------------------------------------------- lifecycle

    async def start(self, watch: bool = True) -> None:
        """Check the bucket exists and choose resume or full resync; raises BucketNotFound.
        `watch=False`: the stream's state is watched by the sidecar's shared poll
        (kvcache.feed.statepoll), not by a loop of this feed's own."""
        info = await self._stream_info()
        self._choose_start(info, reconcile=True)
        self._task = asyncio.create_task(self._run(), name=f"feed:{self.bucket}")
        self._task.add_done_callback(self._task_done)
        self._sweep_task = asyncio.create_task(self._sweep_loop(), name=f"expiry:{self.bucket}")
        if watch:
            self._watch_task = asyncio.create_task(self._watch_loop(), name=f"removals:{self.bucket}")
        for op in ("PURGE", "MSG.DELETE"):  # requests that remove messages without a marker
            self._api_subs.append(await self.nc.subscribe(
                f"$JS.API.STREAM.{op}.{self.stream}", cb=self._on_removal_request))

    async def _stream_info(self) -> dict:
        """The stream as its leader sees it, waiting up to the request timeout for a leader
        (a member answering meanwhile may be far behind: a lag would look like a purge)."""
        deadline = time.monotonic() + self.timeout
        while True:
            sent = time.time_ns()
            try:
                info = await jsapi.stream_info(self.nc, self.stream, self.timeout, need_leader=True)
                self._info_sent_ns = sent
                self.note_evidence(info, sent)
                return info
            except jsapi.NoLeader:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.1)
            except BucketNotFound:
                # No consumer to lose: a follower would take the messages of a stream made
                # again under the name for the old one's until a state answer showed it.
                if self._follower is not None:
                    self._follower.fail("the stream is gone", "stream_changed")
                raise

    def _choose_start(self, info: dict, reconcile: bool = False) -> None:
        """Resume or resync (start_decision), and set the feed up for it. `reconcile`: also
        check, once caught up, for keys that vanished without a trace in the stream (after a
        process start or a reconnect, when that is likely)."""
        self.stream_config = info.get("config", {})
        self._set_deadlines(int(self.stream_config.get("max_age", 0) or 0),
                          bool(self.stream_config.get("allow_msg_ttl")))
        state = info.get("state", {})
        first, last = state.get("first_seq", 0), state.get("last_seq", 0)
        self.first_seq = first
        created = info.get("created", "")
        m = self.meta
        reason, kind, count_it = start_decision(m, info)
        if kind is not None:
            self.resync_reasons[kind] += 1
        self._full = reason is not None
        if reason is not None and self.on_renumbered is not None and (
                reason == "stream was recreated" or reason.startswith("stream sequence went backwards")):
            self.on_renumbered()
        if reason == "stream was recreated" or (reason or "").startswith("stream sequence went backwards"):
            self.freshness.proofs.clear()  # the old numbering proves nothing; this info's own evidence stays
            self.note_evidence(info, self._info_sent_ns)
        if self._full:
            renumbered = kind in ("recreated", "rewound")
            m.horizon = max(0, first - 1) if renumbered else max(m.horizon, first - 1)
            if count_it and reason != "first sync":
                m.resyncs += 1
            if m.stream:
                log.warning("bucket %s: full resync: %s", self.bucket, reason)
            m.synced = False
            m.applied_seq = 0
            self.upstream_seq = last
            self._synced_event.clear()
            self._state()
            self._reconcile_pending = False
            if self._reconcile_task and not self._reconcile_task.done():
                self._reconcile_task.cancel()
        else:
            self.upstream_seq = max(self.upstream_seq, last)
            # (each retry of a failed write resumes: that state has its own line, not one a try)
            log.log(logging.DEBUG if self.unwritable.since_ns else logging.INFO,
                    "bucket %s: resuming after sequence %d", self.bucket, m.applied_seq)
            self._reconcile_pending = self._reconcile_pending or reconcile
        if self.cache is not None:
            if self._full:
                self._clear_cache("full resync")
            elif not m.whole_bucket:
                self._clear_cache("the previous run did not watch the whole bucket")
            elif first > 1:
                self.cache.drop_below(first)
        elif m.whole_bucket:
            drop_store(self.replica, self.bucket)  # left by a run with a near cache: unwatched now
        m.whole_bucket = self.cache is not None
        m.filters = list(self.cfg.keys)
        m.stream = self.stream
        m.stream_created = created
        m.max_age_ns = self.max_age_ns
        self.replica.put_meta(self.bucket, m)

    def _task_done(self, task: asyncio.Task) -> None:
        """The loop retries every failure it knows; if it ends anyway, that is a bug, and a
        replica nobody updates must not go on being served as fresh: say so and let the
        owner stop the process (its supervisor restarts it, and the restart resumes)."""
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.critical("bucket %s: feed stopped", self.bucket, exc_info=exc)
            self.freshness.caught_up = False
            self._state()
            if self.on_fatal is not None:
                self.on_fatal(exc)

    async def stop(self) -> None:
        await unsubscribe_quietly(*self._api_subs)
        for task in (self._task, self._reconcile_task, self._sweep_task, self._watch_task,
                     self._anchor_task, *self._hint_tasks):
            if task and not task.done():
                await _cancelled(task)

    async def wait_synced(self, timeout: float | None = None) -> None:
        await asyncio.wait_for(self._synced_event.wait(), timeout)

    async def wait_applied(self, seq: int, timeout: float) -> bool:
        """True once the replica holds stream sequence `seq` (MINREV), False on timeout."""
        return await self.position.wait(seq, timeout, self.meta)

    def connection_lost(self) -> None:
        """Called on disconnect: stop claiming freshness, and start over on reconnect."""
        self.freshness.caught_up = False
        self.freshness.interrupted = True
        self._state()
        self._reconnected = True
        if self._consumer:
            self._consumer.fail("connection lost", "connection")
        if self._follower is not None:  # what the subject carried meanwhile is lost to it
            self._follower.fail("connection lost", "connection")

    def reconnected(self) -> None:
        """Called on reconnect. The consumer of the lost connection was failed at the
        disconnect; one made since was made through the new connection (nats-py sends what
        was asked meanwhile once it is back) and is kept: failing it too made a rolling
        restart of the cluster recreate a consumer twice. A wait between consumers is cut
        short, so the feed starts over now rather than after its backoff."""
        self._retry_now.set()

    # -------------------------------------------------------------- health

    @property
    def synced(self) -> bool:
        return self.meta.synced

    @property
    def caught_up(self) -> bool:
        """Has the consumer applied everything the server had (its last word)?"""
        return self.freshness.caught_up

    @property
    def quorum(self) -> bool:
        """Does the stream need quorum evidence to count as current (replicated in a cluster)?"""
        return self.freshness.quorum

    def lag_ms(self) -> int:
        """What INFO, readiness and the lag metric show (Freshness.lag_ms)."""
        return self.freshness.lag_ms(self.meta.applied_seq)

    def unwritable_ms(self) -> int:
        """How long the replica has been unwritable (0: it is not): kvcache.feed.unwritable."""
        return self.unwritable.ms()

    def fresh_within(self, max_stale_ms: int) -> bool:
        """Is the replica fresh enough to answer: synced, and not staler than the bound
        (Freshness.ages_ms)? Whether a given key may then be answered locally is the read
        side's rule (kvcache.store.verdict, with the ledger's holds)."""
        return self.meta.synced and self.freshness.within(max_stale_ms, self.meta.applied_seq)

    def proven_within(self, ms: int) -> bool:
        """Has a quorum shown this stream's state within `ms`? Always for a stream with one
        copy (the sidecar moves off a server that shows none)."""
        return self.freshness.proven_within(ms)

    def fence(self) -> Fence | None:
        """What a fallback answer for this bucket must show (Router.fence): a server holding a
        sequence that a quorum had within max_stale_ms. None when no such evidence exists
        (every answer would be unproven); NO_FENCE for a stream with one copy."""
        if not self.freshness.quorum:
            return NO_FENCE
        ev = self.freshness.required()
        if not self.anchor and not self._anchor_task:
            self._anchor_task = asyncio.get_running_loop().create_task(self._find_anchor())
        return None if ev is None else Fence(ev.seq, self.anchor)

    def _note_anchor(self, items: list) -> None:
        """Fence.anchor from a batch just applied: its newest put whose record is at most
        ANCHOR_MAX_BYTES, else its newest put. A fenced read asks for the anchor beside a key
        not known to have a message (kvcache.read.peer), and the anchor's value comes back
        with it: a small one costs that read a header, a large one its whole value. The
        anchor stays one of the latest puts (as likely as any key to still have its message,
        which is all an anchor must have); the preference is only within the batch."""
        newest = None
        for lk, rec in reversed(items):
            if rec is None:
                continue
            if len(rec) <= ANCHOR_MAX_BYTES:
                self.anchor = decode_key(lk, rec)
                return
            if newest is None:
                newest = (lk, rec)
        if newest is not None:
            self.anchor = decode_key(*newest)

    async def _find_anchor(self) -> None:
        """A key with a message, for Fence.anchor, before the feed applied any: the stream's
        last message (one leader API request, once)."""
        try:
            doc = await jsapi.api_request(self.nc, f"$JS.API.STREAM.MSG.GET.{self.stream}",
                                          {"last_by_subj": self.prefix + ">"}, self.timeout)
            subject = (doc.get("message") or {}).get("subject", "")
            if subject.startswith(self.prefix) and not self.anchor:
                self.anchor = subject[len(self.prefix):]
        except Exception as e:  # an empty bucket, or NATS away: asked again on a later read
            log.debug("bucket %s: no anchor key: %s", self.bucket, e)
            self._anchor_task = None
            return

    def note_evidence(self, info: dict, sent_ns: int) -> Evidence | None:
        """A STREAM.INFO (or STREAM.LIST entry) asked at `sent_ns`: keep what it proves
        (Freshness.note). A consumer not on the leader it names reads a store that may have
        been cut off from the writes the majority acknowledges since (it would report nothing
        pending and keep heartbeating): it is made again, where the leader is."""
        fresh = self.freshness
        ev = fresh.note(info, sent_ns, self.meta.applied_seq)
        if self._follower is not None:  # the follower's word on the replica's freshness
            self._follower.word(info, sent_ns)
        else:
            self._republish_seen(info)
        if ev is None:
            self._state()  # (whether the stream needs quorum evidence may have changed)
            return None
        if ev.seq > self.meta.applied_seq:
            if self._behind_since is None:
                self._behind_since = time.monotonic()
        else:
            self._behind_since = None
        consumer = self._consumer
        if (fresh.quorum and consumer is not None and consumer.host and ev.leader
                and ev.leader != consumer.host and fresh.caught_up):
            consumer.fail(f"the stream leader is now {ev.leader}, the consumer is on {consumer.host}",
                          "placement")
        if fresh.caught_up and fresh.quorum:
            at = fresh.proven_with(self.meta.applied_seq, time.time_ns())
            if at > self.meta.fresh_at_ns:
                self.meta.fresh_at_ns = at
        self._state()
        return ev

    def _applied(self) -> None:
        """The replica moved (a batch applied, or the position advanced): the waits it
        reached end, and the ledger is told."""
        self.position.moved(self.meta)
        if self._behind_since is not None:
            newest = self.freshness.proofs.newest
            if newest is None or self.meta.applied_seq >= newest.seq:
                self._behind_since = None
        if self.on_applied is not None:
            self.on_applied(self.meta)
        self._state()

    def _state(self) -> None:
        """What fresh_within answers may have changed: tell `on_state`."""
        if self.on_state is not None:
            self.on_state()

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
                    follower = await self._consume(consumer)
                    if follower is not None:
                        backoff = 0.1
                        await self._follow(follower)
                except asyncio.CancelledError:
                    raise
                except FollowEnded as e:
                    log.info("bucket %s: back to a consumer: %s", self.bucket, e)
                    self.follow_ends[e.reason] += 1
                except ReplicaError as e:
                    # Nothing past the failed batch is applied, so nothing is skipped: the
                    # next consumer starts again right after the last batch that made it.
                    self.unwritable.failed(e)
                    progressed = False
                    self.recreations["replica_error"] += 1
                except (ConsumerLost, UpstreamError, BucketNotFound) as e:
                    log.warning("bucket %s: recreating consumer: %s", self.bucket, e)
                    self.recreations[_recreation_reason(e)] += 1
                    self._flush("consumer")
                except Exception:
                    log.exception("bucket %s: feed failed; recreating consumer", self.bucket)
                    self.recreations["error"] += 1
                if progressed and consumer.delivered:
                    backoff = 0.1
            self.freshness.caught_up = False
            self.freshness.interrupted = True
            self._state()
            try:
                await asyncio.wait_for(self._retry_now.wait(), backoff * (0.5 + random.random()))
            except TimeoutError:
                pass
            self._retry_now.clear()
            backoff = min(backoff * 2, 5.0)
            planned = await self._replan()

    async def _consume(self, consumer: PullConsumer) -> Follower | None:
        """Run `consumer` until it ends (its error raised), or until it has caught up on a
        stream whose RePublish can carry the bucket (kvcache.feed.follow): then subscribe to
        that subject first and end the consumer after (deleted: PullConsumer.run), so that no
        message falls between the two; the follower, holding what arrived meanwhile, is
        returned. A subscription that fails keeps the consumer."""
        run = asyncio.create_task(consumer.run(), name=f"consumer:{self.bucket}")
        self._handoff.clear()
        try:
            while True:
                waiter = asyncio.ensure_future(self._handoff.wait())
                try:
                    await asyncio.wait({run, waiter}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiter.cancel()
                self._handoff.clear()
                if run.done():
                    run.result()
                    return None
                source = self._follow_source()
                if source is None or not self.freshness.caught_up or self._full:
                    continue  # (a RePublish added later is seen in a state answer: note_evidence)
                subject, mode = source
                follower = Follower(self, subject, mode, alive=self._relay_alive if mode == "relay" else None)
                try:
                    await follower.subscribe()
                except asyncio.CancelledError:
                    await follower.close()
                    raise
                except Exception as e:
                    await follower.close()
                    log.warning("bucket %s: cannot subscribe to the %s subject %s (%s): keeping the consumer",
                                self.bucket, _SOURCES[mode], subject, e)
                    await run
                    return None
                if self._republish_denied:  # the server's refusal comes before the subscription's round trip ends
                    await follower.close()
                    await run
                    return None
                consumer.finish()
                try:
                    await run
                except BaseException:
                    await follower.close()
                    raise
                return follower
        finally:
            if not run.done():
                await _ended(run)

    async def _follow(self, follower: Follower) -> None:
        """Follow the stream's RePublish subject until the follower ends (FollowEnded: back to
        a consumer). The replica stays caught up; its freshness is what the stream's state
        answers prove (Follower.word), which come every watch_period: silence past two of them
        ages it, as a consumer's missing heartbeats would."""
        if self._republish_denied:  # refused after the subscription's round trip, before now
            await follower.close()
            raise FollowEnded(f"permission denied on the {_SOURCES[follower.mode]} subject", "denied")
        self._consumer = None
        self._follower = follower
        self.freshness.expect_heartbeats(self.follow_period())
        self._state()
        log.info("bucket %s: following the %s subject %s, with no consumer",
                 self.bucket, _SOURCES[follower.mode], follower.subject)
        try:
            await follower.follow()
        finally:
            self._follower = None
            await follower.close()

    def follow_period(self) -> float:
        """How often a following feed hears the stream's state (Freshness.expect_heartbeats):
        the state poll's period, at most half of max_stale_ms (silence then ages the replica
        within the bound)."""
        return min(self.watch_period(), self.cfg.max_stale_ms / 2000)

    def follow_proven(self, as_of_ns: int) -> None:
        """The follower showed the replica held every message of the stream as of `as_of_ns`
        (a state answer asked then, whose last sequence it holds): the replica's word, as a
        caught-up consumer's heartbeat is (Feed._on_idle)."""
        fresh = self.freshness
        if as_of_ns > fresh.heard_ns:
            fresh.heard_ns = as_of_ns
        m = self.meta
        m.fresh_at_ns = max(m.fresh_at_ns, fresh.proven_with(m.applied_seq, as_of_ns))
        self._touch_meta()
        self._applied()

    # ------------------------------------------------------------------ the pin

    @property
    def written_seq(self) -> int:
        """The highest sequence the replica holds: the position, or past it while pinned."""
        return max(self.meta.applied_seq, self._written_seq)

    def pin(self) -> None:
        """Records past a jump over sequences the stream no longer holds are being written:
        messages superseded (a key's newer revision, history), deleted or expired since they
        were stored, skipped by a fill (Follower._fill) or by a consumer that is behind
        (`_jumps`). What superseded a skipped message may lie past everything applied so far;
        until the replica holds it, the records past the jump are newer than some and older
        than others of the stream at any one moment: no state the stream was ever in (a key
        whose skipped revision was current would read as its older one, or as missing once
        the sweeps drop it). Reads that wait for a sequence (MINREV, a held key's ledger), the
        state answers that prove freshness and the sweeps all go by the position
        (meta.applied_seq), which therefore stays below the jump, with the replica's age
        (Freshness.last_msg_ns), while the records are written. It moves (`unpin`) once the
        replica is the stream's state again: a consumer caught up (every successor applied),
        or for a follower a state answer asked after the latest jump (`pinned_ns`), whose last
        sequence is at or past whatever superseded a skipped message, reached. A new consumer
        starts at the position, below the jump, and drops the pin (_new_consumer)."""
        self.pinned_ns = time.time_ns()

    def unpin(self) -> None:
        """The replica is the stream's state again up to the highest sequence written: the
        position moves there, and is written at once (it is what MINREV and holds wait for)."""
        if self._release():
            self._touch_meta(force=True)
            self._applied()

    def _release(self) -> bool:
        """Drop the pin, moving the position (in memory) to the highest sequence written;
        True when it moved."""
        self.pinned_ns = 0
        m = self.meta
        if self._written_seq <= m.applied_seq:
            return False
        m.applied_seq = self._written_seq
        self.upstream_seq = max(self.upstream_seq, m.applied_seq)
        return True

    def _touch_meta(self, force: bool = False) -> None:
        """Write the meta record when `force`, or when it was last written over
        META_TOUCH_INTERVAL_NS ago (what a batch brings is written with the batch). A failure
        loses only LocalReader's view of the position and freshness, kept in memory and
        written with the next batch; it is counted (kvcache.feed.unwritable) rather than
        ending the feed, which would make a current replica count as stale."""
        now = self.freshness.clock()
        if not force and now - self._last_meta_write < META_TOUCH_INTERVAL_NS:
            return
        self._last_meta_write = now
        try:
            self.replica.put_meta(self.bucket, self.meta)
            self.unwritable.written()
        except ReplicaError as e:
            self.unwritable.failed(e)

    def republish_denied(self, subject: str) -> bool:
        """The server refused this connection a subscription to `subject` (a permissions
        violation): if it is this feed's RePublish subject, the feed stops following it and
        keeps a consumer from now on (one warning). False when the subject is not ours."""
        follower = self._follower
        ours = {follower.subject} if follower is not None else {
            republish_subject(self.stream_config, self.bucket), self.relay_subject}
        if subject not in ours:
            return False
        what = _SOURCES["relay" if subject == self.relay_subject else "republish"]
        if not self._republish_denied:
            self._republish_denied = True
            log.warning("bucket %s: NATS permission denied: subscribe to \"%s\" (the %s subject): "
                        "the bucket keeps a consumer of its own (README: Permissions)",
                        self.bucket, subject, what)
        if follower is not None:
            follower.fail(f"permission denied on the {what} subject", "denied")
        return True

    def _republish_seen(self, info: dict) -> None:
        """A state answer of the stream: a RePublish the operator added (or changed) since the
        feed planned is taken up by a caught-up consumer at once, not at the next replan."""
        republish = (info.get("config") or {}).get("republish")
        if republish == self.stream_config.get("republish") or not self.same_stream(info):
            return
        self.stream_config = {**self.stream_config, "republish": republish}
        if self.freshness.caught_up and not self._full and self._follow_source() is not None:
            self._handoff.set()

    @property
    def follow_mode(self) -> str:
        """How the feed follows its stream now: `republish` or `relay` (a core subject, no
        consumer), or `consumer`."""
        follower = self._follower
        return follower.mode if follower is not None else "consumer"

    def follow_relay(self, subject: str, heard: Callable[[float], bool]) -> None:
        """Follow the fleet's relay of this bucket (kvcache.feed.relay) on `subject` whenever
        `heard(seconds)` says a relay was heard within HEARD_WITHIN_PERIODS state-poll periods
        and the stream has no usable RePublish of its own (which comes first). The sidecar sets
        it when it stands in the bucket's relay election."""
        self.relay_subject = subject
        self._relay_heard = heard

    def relay_heard(self) -> None:
        """A relay of this bucket was heard (or this sidecar took the role): a caught-up
        consumer hands over to the relay's subject now, not at its next batch."""
        if self._follower is None and self.freshness.caught_up and not self._full \
                and self._follow_source() is not None:
            self._handoff.set()

    def _follow_source(self) -> tuple[str, str] | None:
        """The core subject to follow the stream on with no consumer, and its mode: the
        stream's usable RePublish, else the fleet's relay while one is heard; None: a consumer."""
        if self._republish_denied:
            return None
        subject = republish_subject(self.stream_config, self.bucket)
        if subject is not None:
            return subject, "republish"
        heard = self._relay_heard
        if self.relay_subject is not None and heard is not None and heard(HEARD_WITHIN_PERIODS * self.watch_period()):
            return self.relay_subject, "relay"
        return None

    def _relay_alive(self) -> bool:
        """May a follower of the relay's subject go on? Not once no relay has been heard for
        RELAY_SILENT_PERIODS periods (and this sidecar does not relay): the feed goes back to
        its own consumer rather than age, and hands over again when a relay is heard."""
        heard = self._relay_heard
        return heard is not None and heard(RELAY_SILENT_PERIODS * self.watch_period())

    def _new_consumer(self) -> PullConsumer:
        # A consumer starts after the position: below a jump (`pin`), at the jump again
        self.pinned_ns, self._written_seq = 0, 0
        start = None if self._full else self.meta.applied_seq + 1
        if self._full and not self.cfg.keys:
            # A bucket that replicates nothing has no initial set to sync: its near cache
            # starts empty, and only what changes from now on matters. Its position is the
            # stream's last sequence at once (not at the first heartbeat, seconds later: INFO
            # and the lag metric showed every such bucket thousands of messages behind).
            start = self.upstream_seq + 1
            self.meta.applied_seq = self.upstream_seq
        heartbeat_s = self.consumer_heartbeat_s()
        self.freshness.expect_heartbeats(heartbeat_s)
        self._state()
        self._behind_since = None
        consumer = PullConsumer(
            self.nc, self.stream, self.prefix, self.filters, start_seq=start,
            headers_only=False, heartbeat_s=heartbeat_s, check_s=self.heartbeat_s,
            behind=self._behind if heartbeat_s != self.heartbeat_s else None,
            on_batch=self._on_batch, on_idle=self._on_idle, after_create=self._check_identity,
            timeout=self.timeout, name=self.consumer_name,
        )
        self._consumer = consumer
        if self._full:
            self._flush("resync")
            # Keys the sync does not deliver must go at the end; an empty replica has none.
            self._seen = set() if self.replica.count(self.bucket) else None
            self._sync_started = time.monotonic()
            # Nothing is read locally until the sync ends, and then the replica holds every
            # revision handed out before it began; those of a stream since recreated (lower
            # sequences) would otherwise keep their keys held for good.
            if self.on_resync is not None:
                self.on_resync()
        return consumer

    def consumer_heartbeat_s(self) -> float:
        """The idle heartbeat the next consumer asks its server for. `heartbeat_ms`, unless a
        quorum's evidence bounds the replica's staleness and the consumer reads every message of
        the stream: then the heartbeat proves nothing the evidence does not (Freshness.ages_ms),
        and a stalled consumer shows as evidence of messages it did not deliver (`_behind`), so
        the server is asked for one every QUORUM_HEARTBEAT_S only. Each idle heartbeat costs
        the cluster per consumer: in a fleet, per sidecar per bucket (docs/architecture.md, "A
        fleet on one cluster"). A filtered consumer keeps `heartbeat_ms`: its heartbeat carries
        how far it has looked (`_on_idle`), which is how its position reaches the evidence."""
        if self.freshness.quorum and self.filters == [self.prefix + ">"]:
            return max(self.heartbeat_s, QUORUM_HEARTBEAT_S)
        return self.heartbeat_s

    def _behind(self) -> float | None:
        """Since when (monotonic) the stream's quorum has shown messages the replica does not
        hold; None while it holds everything shown. The consumer asks (PullConsumer.behind)."""
        return self._behind_since

    async def _check_identity(self, info: dict) -> None:
        """Right after creating a consumer: is it on the stream we planned for? The stream may
        have been deleted and recreated between our look at it and the consumer's creation
        (the leader's STREAM.INFO, asked after the creation: Maintenance.same_stream)."""
        if not self.same_stream(info):
            raise ConsumerLost("the stream was recreated while the consumer was being created", "stream_recreated")

    async def _replan(self) -> bool:
        """Before recreating, check the stream: it may have been purged or recreated meanwhile.
        False when the stream cannot be looked at (gone, or NATS unreachable): try again later."""
        try:
            info = await self._stream_info()
        except (UpstreamError, BucketNotFound) as e:  # keep trying, serve what we have
            log.warning("bucket %s: %s", self.bucket, e)
            return False
        reconnected, self._reconnected = self._reconnected, False
        try:
            self._choose_start(info, reconcile=reconnected)
        except ReplicaError as e:
            # The plan could not be written (a full disk): plan again after the backoff (the
            # decision is made again from what is in memory). Raising here ended the feed,
            # and with it the process.
            self._reconnected = self._reconnected or reconnected
            self.unwritable.failed(e)
            return False
        return True

    def _on_batch(self, runs: list[Run]) -> bool:
        last = runs[-1]
        prev = self.meta.applied_seq
        written = self.written_seq
        top = max(written, max(r.top_sseq for r in runs))
        now = self.freshness.clock()
        # A follower's batch says nothing of what else the stream holds: its freshness comes
        # from state answers (follow_proven), so it leaves caught up and heard as they are.
        following = self._follower is not None
        caught_up = last.last_pending == 0 and not following
        jumps = self._jumps(runs, written, top, caught_up, following)
        held = jumps or (bool(self.pinned_ns) and not caught_up)
        # The new position is ours only once the batch is written: a failed write must leave
        # the feed where it was, so that the next consumer starts at this batch again. So is
        # the freshness it brings: caught up counts once written (`_unapplied`).
        m = dataclasses.replace(self.meta, applied_seq=prev if held else top, last_update_ns=now)
        if caught_up:
            m.fresh_at_ns = max(m.fresh_at_ns, self.freshness.proven_with(top, now))
            if self._full and self._seen is None:
                m.synced = True  # nothing to sweep: the last batch of the sync says so itself
        entries: list | None
        if len(runs) == 1:
            items, entries = last.items, last.entries
        else:
            items = [it for r in runs for it in r.items]
            entries = [e for r in runs for e in r.entries]
        hub = self.hub
        outside: list[tuple[str, str]] = []
        if self._keeper is not None:
            items, outside = self._keeper.split(items, top, written)
            entries = None  # the items the replica keeps are some of them
        changes = self.replica.changes_of(self.bucket, items) if hub is not None and hub.active else None
        if outside and changes is not None:
            changes += outside
        deletes = any(r.deletes for r in runs)
        marks = [mk for r in runs for mk in r.marks] if deletes else ()
        # a record has a deadline only by the bucket's max_age or a TTL of its own (Run.ttls)
        deadlines = self._deadlines and (self.max_age_ns > 0 or any(r.ttls for r in runs))
        try:
            self.replica.apply_items(self.bucket, items, m, deletes=deletes, deadlines=deadlines,
                                     marks=marks, fresh=self._full and self._seen is None, entries=entries)
        except ReplicaError as e:
            self._unapplied(e)
            raise
        if self._deadlines:
            self._sweep_wake.set()
        self.meta = m
        if changes:
            hub.changed(self.bucket, changes)  # type: ignore[union-attr]  # set with changes
        if hub is not None and hub.followers:
            hub.advanced(self.bucket)
        if self._seen is not None:
            self._seen.update(lk for lk, _ in items)
        self._note_anchor(last.items)
        self._last_meta_write = now
        self._written_seq = top
        if jumps:
            self.pin()
        elif not held:
            self.pinned_ns = 0  # caught up with this batch: its position is the top
            self.freshness.last_msg_ns = last.last_ts
        self.upstream_seq = max(self.upstream_seq, top)
        if not following:
            self.freshness.caught_up = caught_up
        if caught_up:
            self.freshness.heard_ns = now
            self.unwritable.written()
            self._reached_end()
        self._applied()
        return False

    def _jumps(self, runs: list[Run], written: int, top: int, caught_up: bool, following: bool) -> bool:
        """Does this batch of a consumer that is behind jump over sequences (`pin`)? A
        whole-bucket consumer delivers every message the stream holds, so deliveries that
        skip sequences skip messages gone from it, and what superseded one may come in a
        later batch. A follower pins for itself (its fills see the jump); a caught-up batch
        has every successor; a filtered consumer's deliveries skip the bucket's other keys
        as a matter of course, and a full sync comes in subject order: neither is judged (a
        sync is not served before it ends; a filtered feed's age while behind counts from its
        newest message)."""
        if caught_up or following or self._full or self.filters != [self.prefix + ">"]:
            return False
        delivered = sum(r.last_cseq - r.first_cseq + 1 for r in runs)
        return top - written > delivered

    def _unapplied(self, error: ReplicaError) -> None:
        """Deliveries were received and could not be written (kvcache.feed.unwritable): the
        replica is known current only as of the last time it applied everything it had received
        (Freshness.heard_ns, left as it was), whatever the server says meanwhile. The heard
        time was once set before the write: every retry that received the stream's end made
        the replica fresh again, and a full disk served its old values past max_stale_ms."""
        self.freshness.caught_up = False
        self.freshness.interrupted = True
        self.unwritable.failed(error)
        self._state()

    def _on_idle(self, last_stream_seq: int) -> None:
        """Caught up and the server has nothing more. `last_stream_seq` (from a heartbeat,
        0 if unknown) is how far the consumer has looked: every matching message up to it
        was delivered, so the position may advance to it (keeps filtered buckets resumable)."""
        self.freshness.caught_up = True
        now = self.freshness.clock()
        m = self.meta
        self._release()  # caught up: whatever superseded a skipped message is applied
        if last_stream_seq > m.applied_seq and not self._full:
            m.applied_seq = last_stream_seq
            self.upstream_seq = max(self.upstream_seq, last_stream_seq)
        self.freshness.heard_ns = now
        m.fresh_at_ns = max(m.fresh_at_ns, self.freshness.proven_with(m.applied_seq, now))
        self._reached_end()
        self._touch_meta()
        self._applied()

    def _flush(self, why: str) -> None:
        """What was handed out from this bucket can no longer be vouched for (kvcache.feed.changes)."""
        if self.hub is not None:
            self.hub.flushed(self.bucket, why)

    def _reached_end(self) -> None:
        """End of initial data: finish a full resync's sweep, or start a resume's reconcile."""
        self.freshness.interrupted = False
        m = self.meta
        if self._full:
            self._full = False
            removed = 0
            if self._seen is not None:
                removed = self._sweep(self._seen)
                self.replica.drop_tombstones(self.bucket, self._seen)
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
        if self._follow_source() is not None:
            self._handoff.set()  # a consumer caught up: the feed may follow without it (_consume)
        if self._reconcile_pending:
            self._reconcile_pending = False
            if self._reconcile_task and not self._reconcile_task.done():
                self._reconcile_task.cancel()
            self._reconcile_task = asyncio.get_running_loop().create_task(
                self._reconcile(), name=f"reconcile:{self.bucket}")


def start_decision(meta: BucketMeta, info: dict) -> tuple[str | None, str | None, bool]:
    """Where a feed whose replica is at `meta` starts on the stream its STREAM.INFO `info`
    shows: (why a full resync, None: resume after meta.applied_seq; its RESYNC_REASONS label,
    None for a first sync or a resume; whether it counts as a resync). A pure function of the
    two (Feed._choose_start acts on it)."""
    state = info.get("state", {})
    first, last = state.get("first_seq", 0), state.get("last_seq", 0)
    created = info.get("created", "")
    m = meta
    reason = kind = None
    count_it = bool(m.applied_seq)
    if not m.stream:
        reason = "first sync"
    elif not m.synced:
        # Also a crash or a lost consumer in the middle of a full sync: the initial set
        # comes in subject order, so its progress cannot be resumed.
        reason, kind = "previous full sync did not finish", "unfinished"
        count_it = False
    elif m.stream_created and created and m.stream_created != created:
        reason, kind = "stream was recreated", "recreated"
    elif last < m.applied_seq:
        reason, kind = f"stream sequence went backwards ({last} < {m.applied_seq})", "rewound"
    elif first > m.applied_seq + 1:
        reason = f"stream no longer holds sequence {m.applied_seq + 1} (first is {first})"
        kind = "truncated"
    return reason, kind, count_it


async def _cancelled(task: asyncio.Task) -> None:
    """Cancel `task` and wait until it has ended, cancelling again while it runs on: on Python
    3.11 asyncio.wait_for swallows a cancellation that arrives as what it awaits completes
    (the consumer's wake-up at the end of a sync, say; fixed in 3.12), and the loop around it
    went on until the stop's own 5 s bound gave up on it (a failed start took 5.4 s)."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=CANCEL_AGAIN_S)
    if not task.cancelled():
        task.exception()  # ended by an error while stopping: nothing to report


CANCEL_AGAIN_S = 0.1


async def _ended(task: asyncio.Task) -> None:
    """Cancel `task` (a consumer's run, Feed._consume) and wait until it has ended, however
    often the waiter is cancelled meanwhile: Feed.stop cancels the feed's task again every
    CANCEL_AGAIN_S, and a run cancelled while its CONSUMER.CREATE is on the way waits for the
    answer before it schedules the deletion (PullConsumer._create_request). A feed's task that
    ended first left the run behind it: the stop then closed the connection before the
    deletion was scheduled, and a failed start left its consumer on the stream (1 start in 7 in
    tests/test_failed_start.py). Cancelled meanwhile: raises CancelledError once it has ended."""
    cancelled = False
    while not task.done():
        task.cancel()
        try:
            await asyncio.wait({task}, timeout=CANCEL_AGAIN_S)
        except asyncio.CancelledError:
            cancelled = True
    if not task.cancelled():
        task.exception()  # ended by an error while stopping: nothing to report
    if cancelled:
        raise asyncio.CancelledError


# The reasons metrics give full resyncs and consumer recreations by (every one is exported
# from the start, at 0, so that increase() sees the first)
RESYNC_REASONS = ("unfinished", "recreated", "rewound", "truncated")
RECREATION_REASONS = ("heartbeat", "behind", "gap", "connection", "placement", "ended", "stream_recreated",
                      "bucket_missing", "upstream", "replica_error", "error")


def _recreation_reason(e: Exception) -> str:
    """Why a consumer was recreated, as one of RECREATION_REASONS (a metrics label): a lost
    consumer's own reason, `bucket_missing`, or `upstream` (a JetStream API error)."""
    if isinstance(e, BucketNotFound):
        return "bucket_missing"
    return e.reason if isinstance(e, ConsumerLost) else "upstream"
