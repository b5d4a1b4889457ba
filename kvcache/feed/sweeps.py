"""The feed's maintenance passes: what keeps a replica equal to its stream when no message
says so.

- Expiry: records past their deadline (per-message TTL, the bucket's max_age) are hidden by
  every reader at once; the sweep removes them when they come due, from the per-bucket expiry
  index (no pass over the replica), and refiles the index when max_age changes.
- Removals with no message, while running: a STREAM.INFO poll every watch_period (or, with
  many buckets, the sidecar's one STREAM.LIST poll: kvcache.feed.statepoll) sees the first
  sequence move past keys (limits, a whole purge); purge and message-delete requests
  seen on the stream's API subjects lead to a headers-only pass over the purged filter.
- Reconcile after a resume: a headers-only pass over the bucket removes keys whose deletion
  left no trace while the sidecar was down.

`Maintenance` is a base class of kvcache.feed.feed.Feed: the passes run on the feed's own state
(its replica, meta, consumer settings and floors) and are kept here so that feed.py holds the
sync itself.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..config import BucketConfig
from ..errors import ReplicaError
from ..natsio.nats_connection import NatsConnection
from ..store.nearcache import NearCache
from ..store.record import decode_key
from ..store.replica import BucketMeta, Replica
from .changes import DEL, EXPIRED, ChangeHub
from .consumer import PullConsumer, Run
from .names import RECONCILE_SUFFIX
from .quorum import RAFT_HEARTBEAT_S, Evidence

if TYPE_CHECKING:
    from .fleet import StateShare

log = logging.getLogger("kvcache.feed")

EXPIRY_PAGE = 2_000     # records looked at per turn of the event loop (~3 ms) by removal passes
SWEEP_MAX_S = 1.0       # the expiry index is looked at least this often (reads hide expired records anyway)
# The stream state poll's period (Maintenance.poll_period), its bounds, and the margin it
# leaves the quorum evidence under max_stale_ms.
STATE_POLL_MIN_S, STATE_POLL_MAX_S = 0.25, 5.0
EVIDENCE_MARGIN_S = 0.25
HINT_CHECKS_S = (0.1, 1.0)  # after a purge request is seen: look again this long after it
RECONCILE_TRIES = 3


class Maintenance:
    """The feed's maintenance passes (see the module docstring); mixed into Feed, whose
    state they work on: these annotations are the part of it they use."""

    nc: NatsConnection
    cfg: BucketConfig
    bucket: str
    stream: str
    prefix: str
    filters: list[str]
    replica: Replica
    meta: BucketMeta
    heartbeat_s: float
    timeout: float
    consumer_name: str | None
    max_age_ns: int
    first_seq: int
    removed_upstream: int
    state_polls: int
    hub: ChangeHub | None
    cache: NearCache | None
    on_removed: Callable[[int | None], None] | None
    _full: bool
    _deadlines: bool
    _sweep_wake: asyncio.Event  # a deadline may have been filed (see _sweep_loop)
    _hint_tasks: set[asyncio.Task]
    # The fleet's shared polls (kvcache.feed.fleet), when the sidecar shares them; set before
    # start. The state checks, own or shared, run one at a time (_state_lock); a shared answer
    # older than the newest already checked (`_state_seq`) is evidence only.
    share: StateShare | None = None
    state_shared: int = 0
    _state_lock: asyncio.Lock | None = None
    _state_seq: int = 0

    if TYPE_CHECKING:  # Feed's properties and methods the passes call
        @property
        def caught_up(self) -> bool: ...
        @property
        def quorum(self) -> bool: ...
        async def _stream_info(self) -> dict: ...
        _info_sent_ns: int
        def note_evidence(self, info: dict, sent_ns: int) -> Evidence | None: ...
        async def wait_applied(self, seq: int, timeout: float) -> bool: ...
        def _clear_cache(self, why: str) -> None: ...

    def _set_deadlines(self, max_age_ns: int, msg_ttl: bool) -> None:
        """The stream's max_age, where every reader applies it (LocalReader: in the meta),
        and whether it takes per-message TTLs. A new max_age moves every record's deadline,
        and per-message TTLs turned on may have come before this saw it: the expiry index is
        filed anew."""
        deadlines = bool(max_age_ns or msg_ttl)
        changed = max_age_ns != self.meta.max_age_ns or (deadlines and not self._deadlines)
        self._deadlines = deadlines
        if deadlines:
            self._sweep_wake.set()
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
            self._sweep_wake.set()
            if after is None:
                return
            await asyncio.sleep(0)

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
        return self._remove(stale) if stale else 0

    def _remove(self, lkeys: list[bytes]) -> int:
        """Delete records that left the stream with no message; tell the hub (`del`)."""
        hub = self.hub
        if hub is None or not hub.active:
            removed = self.replica.delete_lkeys(self.bucket, lkeys)
        else:
            keys = self.replica.keys_of(self.bucket, lkeys)
            removed = self.replica.delete_lkeys(self.bucket, lkeys)
            hub.changed(self.bucket, [(k, DEL) for _, k in keys])
        if hub is not None and hub.followers:
            hub.removed(self.bucket)
        return removed

    async def _sweep_loop(self) -> None:
        """Remove records whose deadline passed (a Nats-TTL of their own, or the bucket's
        max_age), reading only the expiry index's due entries. Reads hide such records at
        once (record.deadline), so this is about space and key counts: it runs when the
        earliest deadline comes, at least every SWEEP_MAX_S."""
        while True:
            self._sweep_wake.clear()
            due = self.replica.next_due(self.bucket)
            if due is None:
                # Nothing filed: no wakeups until a write files a deadline (Feed sets the event
                # after every batch written with deadlines, and when they are turned on or
                # refiled). Waking every SWEEP_MAX_S instead cost a sidecar of 1,000 buckets
                # a thousand wakeups a second.
                await self._sweep_wake.wait()
                continue
            wait = SWEEP_MAX_S if due is None else (due - time.time_ns()) / 1e9
            await asyncio.sleep(min(SWEEP_MAX_S, max(wait, 0.0)) + 0.001)
            try:
                more = True
                while more:
                    hub = self.hub
                    gone: list[str] | None = [] if hub is not None and hub.active else None
                    removed, more = self.replica.sweep_expired(self.bucket, time.time_ns(), EXPIRY_PAGE, gone)
                    self.removed_upstream += removed
                    if removed and hub is not None and hub.followers:
                        hub.removed(self.bucket)
                    if gone:
                        hub.changed(self.bucket, [(k, EXPIRED) for k in gone])  # type: ignore[union-attr]
                    if more:
                        await asyncio.sleep(0)  # a page at a time: reads go on meanwhile
            except ReplicaError as e:  # the next turn tries again
                log.warning("bucket %s: expiry sweep failed: %s", self.bucket, e)

    def watch_period(self) -> float:
        """Seconds between looks at the stream's state: what max_stale_ms leaves for them.

        The look is also the quorum evidence that keeps a replicated stream's replica fresh
        (kvcache.feed.quorum), and evidence is as old as the period plus the followers'
        `active` (up to a raft heartbeat, 1 s, on an idle stream) plus a round trip just
        before the next answer lands. So the period is max_stale_ms less a raft heartbeat and
        EVIDENCE_MARGIN_S, kept between max_stale_ms / 4 and / 2 (and 0.25 s to 5 s): 0.75 s
        at 2 s, 2.5 s at the default 5 s. Polling faster buys nothing a read can see, and it
        is what a fleet's one poller per bucket costs the cluster (kvcache.feed.fleet)."""
        bound = self.cfg.max_stale_ms / 1000
        budget = min(bound / 2, max(bound / 4, bound - RAFT_HEARTBEAT_S - EVIDENCE_MARGIN_S))
        return min(STATE_POLL_MAX_S, max(STATE_POLL_MIN_S, budget))

    def watching(self) -> bool:
        """Is the stream's state to be looked at now? Only while caught up: before that the
        feed itself plans."""
        return self.caught_up and not self._full and self.meta.synced

    async def _watch_loop(self) -> None:
        """Watch the stream's state (one STREAM.INFO every watch_period, 0.25 s to 5 s)
        for removals that leave no message the feed could follow: a whole-stream purge and
        the stream's limits (max_msgs, max_bytes, max_age) remove from the front, so the
        first sequence moves past keys whose newest revision is gone; a max_age change moves
        every deadline. One-subject purges and message deletes are seen as requests
        (_on_removal_request). Only while caught up: before that the feed itself plans."""
        while True:
            await asyncio.sleep(self.watch_period())
            if self.share is not None and not self.share.should_poll(self.bucket, self.watch_period()):
                continue  # another sidecar of the fleet polls for this one (apply_state)
            try:
                if not self.watching():
                    if self.quorum:  # the evidence fallback reads need (Feed.fence) goes on
                        await self._poll_state()
                    continue
                await self.check_state()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the next period tries again; the data is still served
                log.warning("bucket %s: stream state check failed: %s", self.bucket, e)

    async def check_state(self, force: bool = False, info: dict | None = None, sent_ns: int = 0) -> int:
        """Look at the stream once and drop what it no longer holds; records removed.
        `force`: after a purge request, look for keys below the first sequence even where
        max_age alone would explain its moving. `info`: the stream's info as the shared
        poll listed it (kvcache.feed.statepoll) at `sent_ns`, else STREAM.INFO is asked. Either
        way the look is also the feed's quorum evidence (Feed.note_evidence): this poll is
        what keeps a replicated stream's replica fresh."""
        if self._state_lock is None:
            self._state_lock = asyncio.Lock()
        async with self._state_lock:
            return await self._check_state(force, info, sent_ns)

    async def _poll_state(self) -> dict:
        """STREAM.INFO asked by this sidecar, shared with the fleet (kvcache.feed.fleet)."""
        info = await self._stream_info()
        if self.share is not None:
            await self.share.publish(self.bucket, info, self._info_sent_ns)
        return info

    def same_stream(self, info: dict) -> bool:
        """Is `info` about this feed's stream, not another of the same name (recreated since,
        another domain's)? Another sidecar's answer about another stream is no answer for
        this one (kvcache.feed.fleet): neither applied nor a reason not to poll."""
        if (info.get("config") or {}).get("name") != self.stream:
            return False
        created = info.get("created", "")
        return not (created and self.meta.stream_created and created != self.meta.stream_created)

    async def apply_state(self, info: dict, sent_ns: int) -> None:
        """Another sidecar's STREAM.INFO of this stream (`same_stream`), asked at `sent_ns`
        (kvcache.feed.fleet): taken as this feed's own poll would be; one older than the
        newest already checked is evidence only."""
        self.state_shared += 1
        if self.watching() and _last_seq(info) >= self._state_seq:
            await self.check_state(info=info, sent_ns=sent_ns)
        elif self.quorum:
            self.note_evidence(info, sent_ns)

    async def _check_state(self, force: bool, info: dict | None, sent_ns: int) -> int:
        self.state_polls += 1
        if info is None:
            info = await self._poll_state()
        else:
            self.note_evidence(info, sent_ns)
        self._state_seq = max(self._state_seq, _last_seq(info))
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
            # Holding `last` is not enough while the consumer is behind: it passes messages
            # superseded after the snapshot, and what superseded them may be in a later batch
            # (a follower's position stays below such a skip: kvcache.feed.follow). Only once
            # caught up, all of that is applied; until then the next look tries again.
            elif await self.wait_applied(last, self.timeout) and self.caught_up:
                removed = await self._drop_below(first, last)
                self.first_seq = first
            if self.on_removed is not None:
                self.on_removed(first)
        if removed:
            self.removed_upstream += removed
            log.info("bucket %s: %d keys with no message left in the stream removed", self.bucket, removed)
        return removed

    async def _drop_below(self, first: int, last: int) -> int:
        """Remove keys whose newest revision is below the stream's first sequence: they have
        no message left. Everything when the stream is empty (a purge): one drop. Otherwise
        a pass over the records, a page at a time; each page is read and deleted without an
        await in between, so no newer revision can land between the two."""
        if self.cache is not None:  # the near cache too: its records below `first` have no message
            self.cache.drop_below(first)
        if first > last and self.meta.applied_seq <= last:
            n = self.replica.count(self.bucket)
            if n:
                hub = self.hub
                keys = [k for _, k in self.replica.iter_keys(self.bucket)] if hub is not None and hub.active else []
                self.replica.clear_bucket(self.bucket)
                if keys:
                    hub.changed(self.bucket, [(k, DEL) for k in keys])  # type: ignore[union-attr]
                if hub is not None and hub.followers:
                    hub.removed(self.bucket)
            return n
        removed = 0
        if not self._full and self.replica.drop_markers_below(self.bucket, first) and self.hub is not None:
            self.hub.removed(self.bucket)  # deletes the stream no longer holds leave its stream
        after: bytes | None = None
        while True:
            if self._full:
                break
            gone, after = self.replica.older_than(self.bucket, first, after, EXPIRY_PAGE)
            if gone:
                removed += self._remove(gone)
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
        self._clear_cache("a purge or message delete was requested")
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
            self._clear_cache("a purge or message delete was requested")  # a fill may have come between
            if self.on_removed is not None:
                self.on_removed(None)
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
                # The pass cannot tell the two apart: a key is removed when the stream holds no
                # message of it within the filters, which a key left out of narrowed filters lacks too.
                log.info("bucket %s: reconcile removed %d keys that are gone upstream or outside the "
                         "key filters", self.bucket, removed)
            else:
                log.info("bucket %s: reconcile found nothing to remove", self.bucket)
            return

    async def _reconcile_once(self, only: list[str] | None = None) -> int | None:
        """One headers-only pass: keys of the replica absent from the stream go. `only`:
        subjects narrowing the pass (a purge's filter); only replica keys they match go."""
        info = await self._stream_info()
        snapshot = info.get("state", {}).get("last_seq", 0)
        live: set[bytes] = set()
        markers: set[bytes] = set()  # keys whose last message is a delete or purge marker
        consumer: PullConsumer | None = None
        cache = self.cache
        cached = set(cache.keys()) if cache is not None else set()

        def collect(runs: list[Run]) -> bool:
            for r in runs:
                for lk, rec in r.items:
                    if rec is None:
                        live.discard(lk)
                        markers.add(lk)
                        continue
                    markers.discard(lk)
                    if cache is None or lk in cached or self.cfg.replicates(decode_key(lk, rec)):
                        live.add(lk)  # with a near cache, only what the replica or the cache holds
            return runs[-1].last_pending == 0

        def idle(_last: int) -> None:
            if consumer is not None:
                consumer.finish()

        consumer = PullConsumer(
            self.nc, self.stream, self.prefix, only or self.filters, start_seq=None,
            headers_only=True, heartbeat_s=self.heartbeat_s,
            on_batch=collect, on_idle=idle, timeout=self.timeout,
            name=self.consumer_name and self.consumer_name + RECONCILE_SUFFIX,
        )
        await consumer.run()
        if self._full:
            return None
        within = [f[len(self.prefix):] for f in only] if only else None
        if cache is not None:  # cached keys the stream no longer holds go too
            cache.invalidate([lk for lk in cached if lk not in live])
        removed = self._sweep(live, max_revision=snapshot, within=within)
        # the revision index's deletes whose marker the stream no longer holds (purged
        # deletes, a subject purge) go too: a NATS watch would not deliver them either
        if self.replica.drop_tombstones(self.bucket, markers, max_revision=snapshot, within=within) and \
                self.hub is not None:
            self.hub.removed(self.bucket)
        return removed


def _last_seq(info: dict) -> int:
    return int((info.get("state") or {}).get("last_seq", 0) or 0)


def _front_removal_possible(config: dict) -> bool:
    """Can the stream drop messages from its front other than by max_age (for which reads
    and the expiry sweep need no pass over the replica)? Without max_age, anything that moves
    the first sequence is such a removal; with it, only message or byte limits under the
    `old` discard policy (a KV bucket's default policy, `new`, refuses puts instead)."""
    if not config.get("max_age"):
        return True
    return config.get("discard", "old") == "old" and (
        (config.get("max_msgs", -1) or -1) > 0 or (config.get("max_bytes", -1) or -1) > 0)
