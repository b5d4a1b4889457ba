"""The feed: keeps one bucket's replica equal to its stream.

It manages its own consumer instead of nats-py's `watch()`: a push watch with nats-py's default
pending limits drops messages as a slow consumer on big buckets and never recovers. Here the
consumer is pull-based (ephemeral, AckNone, in memory), the same shape as nats.go's ordered
consumer, so the server never sends more than we asked for: nothing can be dropped, and
memory stays bounded by one pull window.

Deliveries are folded into batches (everything one socket read brought) and applied in one
LMDB transaction together with the last applied stream sequence. A consumer-sequence gap, a
silent heartbeat, a deleted consumer or a reconnect recreates the consumer from the last
applied sequence + 1.
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import secrets
import time
from dataclasses import dataclass
from typing import Callable

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from . import jetstream as jsapi
from .config import BucketConfig
from .entry import Operation
from .errors import KvcacheError, ReplicaError, UpstreamError
from .replica import BucketMeta, Replica, lmdb_key

log = logging.getLogger("kvcache.feed")

PULL_BATCH = 4096
PULL_MAX_BYTES = 16 * 1024 * 1024
PULL_EXPIRES_S = 30.0
META_TOUCH_INTERVAL_NS = 1_000_000_000


class ConsumerLost(KvcacheError):
    """The consumer can no longer be trusted to deliver in order: recreate it."""


@dataclass(slots=True)
class Delivery:
    seq: int
    key: str
    operation: Operation
    value: bytes
    created: int
    pending: int


class PullConsumer:
    """One ephemeral pull consumer over a KV stream, delivering in order or failing loudly.

    `on_batch(deliveries)` runs synchronously for everything a socket read brought and returns
    True to finish; `on_idle()` runs when the server reports nothing left to deliver.
    """

    def __init__(self, nc: NATS, stream: str, prefix: str, filters: list[str], *,
                 start_seq: int | None, headers_only: bool, heartbeat_s: float,
                 on_batch: Callable[[list[Delivery]], bool], on_idle: Callable[[], None],
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
        self.api = api
        self.timeout = timeout
        self.name = "kvcache_" + secrets.token_hex(8)
        self.initial_pending = 0
        self._inbox = nc.new_inbox()
        self._incoming: list[Msg] = []
        self._drain_scheduled = False
        self._wake = asyncio.Event()
        self._failure: str | None = None
        self._done = False
        self._pending_msgs = 0
        # One request must fit the largest message the server accepts, or it would never arrive.
        self._max_bytes = max(PULL_MAX_BYTES, 2 * (nc.max_payload or 0))
        self._next_cseq = 1
        self._last_activity = time.monotonic()
        self._caught_up = False

    async def run(self) -> None:
        sub = await self.nc.subscribe(
            self._inbox, cb=self._on_msg,
            pending_msgs_limit=PULL_BATCH * 4, pending_bytes_limit=self._max_bytes * 4,
        )
        created = False
        try:
            info = await self._create()
            created = True
            self.initial_pending = info.get("num_pending", 0)
            if self.initial_pending == 0:
                self._caught_up = True
                self.on_idle()
            await self._pull()
            while not self._done:
                try:
                    await asyncio.wait_for(self._wake.wait(), self.heartbeat_s)
                except asyncio.TimeoutError:
                    pass
                self._wake.clear()
                if self._failure:
                    raise ConsumerLost(self._failure)
                if time.monotonic() - self._last_activity > 3 * self.heartbeat_s:
                    raise ConsumerLost(f"no heartbeat for {3 * self.heartbeat_s:.1f}s")
                if not self._done and self._pending_msgs <= PULL_BATCH // 2:
                    await self._pull()
        finally:
            self._done = True
            try:
                await sub.unsubscribe()
            except Exception:  # the connection may be gone; the server drops the interest anyway
                pass
            if created:
                asyncio.ensure_future(self._delete_quietly())

    def fail(self, reason: str) -> None:
        self._failure = reason
        self._wake.set()

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

    async def _on_msg(self, msg: Msg) -> None:
        self._incoming.append(msg)
        if not self._drain_scheduled:
            self._drain_scheduled = True
            asyncio.get_running_loop().call_soon(self._drain)

    def _drain(self) -> None:
        self._drain_scheduled = False
        msgs, self._incoming = self._incoming, []
        if self._done or self._failure:
            return
        self._last_activity = time.monotonic()
        batch: list[Delivery] = []
        plen = len(self.prefix)
        for msg in msgs:
            meta = jsapi.parse_ack(msg.reply) if msg.reply else None
            if meta is None:
                self._status(msg)
                if self._failure:
                    break
                continue
            if meta.consumer_seq != self._next_cseq:
                self._failure = f"consumer sequence gap: expected {self._next_cseq}, got {meta.consumer_seq}"
                break
            self._next_cseq += 1
            self._pending_msgs -= 1
            hdrs = msg.headers
            op = Operation.from_header(hdrs.get("KV-Operation")) if hdrs else Operation.PUT
            batch.append(Delivery(meta.stream_seq, msg.subject[plen:], op, msg.data,
                                  meta.timestamp, meta.pending))
        if batch:
            self._caught_up = batch[-1].pending == 0
            if self.on_batch(batch):
                self._done = True
        if self._failure or self._done or self._pending_msgs <= PULL_BATCH // 2:
            self._wake.set()

    def _status(self, msg: Msg) -> None:
        hdrs = msg.headers or {}
        status = hdrs.get("Status", "")
        desc = hdrs.get("Description", "")
        if status == "100":
            if self._caught_up:
                self.on_idle()
            return
        if status in ("404", "408") or (status == "409" and "Exceeds MaxBytes" in desc):
            # The pull request ended; what it did not deliver is no longer owed to us.
            self._pending_msgs -= int(hdrs.get("Nats-Pending-Messages", 0) or 0)
            self._pending_msgs = max(self._pending_msgs, 0)
            return
        if status == "409":
            self._failure = f"consumer ended: {desc or status}"
            return
        log.debug("ignoring status %s %s on %s", status, desc, self.stream)


class Feed:
    """Keeps one bucket's replica in step with its stream; owns its position and health."""

    def __init__(self, nc: NATS, bucket: BucketConfig, replica: Replica, *,
                 heartbeat_s: float = 2.0, timeout: float = 5.0) -> None:
        self.nc = nc
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
        self.consumers_created = 0
        self._full = False
        self._seen: set[bytes] | None = None
        self._reconcile_pending = False
        self._consumer: PullConsumer | None = None
        self._task: asyncio.Task | None = None
        self._reconcile_task: asyncio.Task | None = None
        self._synced_event = asyncio.Event()
        self._last_meta_write = 0
        self._sync_started = 0.0
        self._waiters: list[tuple[int, asyncio.Future]] = []
        if self.meta.synced:
            self._synced_event.set()

    # -------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Check the bucket exists and choose resume or full resync; raises BucketNotFound."""
        info = await jsapi.stream_info(self.nc, self.stream, self.timeout)
        self._plan(info, reconcile=True)
        self._task = asyncio.create_task(self._run(), name=f"feed:{self.bucket}")

    def _plan(self, info: dict, reconcile: bool = False) -> None:
        """Resume or resync. `reconcile`: also check, once caught up, for keys that vanished
        without a trace in the stream (done after a process start, when that is likely)."""
        self.stream_config = info.get("config", {})
        state = info.get("state", {})
        first, last = state.get("first_seq", 0), state.get("last_seq", 0)
        created = info.get("created", "")
        self.upstream_seq = max(self.upstream_seq, last)
        m = self.meta
        reason = None
        if m.applied_seq == 0 or not m.stream:
            reason = "first sync"
        elif m.stream_created and created and m.stream_created != created:
            reason = "stream was recreated"
        elif last < m.applied_seq:
            reason = f"stream sequence went backwards ({last} < {m.applied_seq})"
        elif first > m.applied_seq + 1:
            reason = f"stream no longer holds sequence {m.applied_seq + 1} (first is {first})"
        self._full = reason is not None
        if self._full:
            if m.applied_seq:
                m.resyncs += 1
                log.warning("bucket %s: full resync: %s", self.bucket, reason)
            m.synced = False
            m.applied_seq = 0
            self._synced_event.clear()
        else:
            log.info("bucket %s: resuming after sequence %d", self.bucket, m.applied_seq)
            self._reconcile_pending = reconcile
        m.stream = self.stream
        m.stream_created = created
        self.replica.put_meta(self.bucket, m)

    async def stop(self) -> None:
        for task in (self._task, self._reconcile_task):
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
        if self.meta.applied_seq >= seq:
            return True
        fut = asyncio.get_running_loop().create_future()
        item = (seq, fut)
        self._waiters.append(item)
        try:
            await asyncio.wait_for(fut, timeout)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            if item in self._waiters:
                self._waiters.remove(item)

    def _wake_waiters(self) -> None:
        applied = self.meta.applied_seq
        for seq, fut in self._waiters:
            if seq <= applied and not fut.done():
                fut.set_result(None)

    def connection_lost(self) -> None:
        """Called on disconnect: stop claiming freshness, and start over on reconnect."""
        self.caught_up = False
        if self._consumer:
            self._consumer.fail("connection lost")

    # -------------------------------------------------------------- health

    @property
    def synced(self) -> bool:
        return self.meta.synced

    def lag_ms(self) -> int:
        """0 while caught up; else the age of the newest state we are sure to hold."""
        if self.caught_up:
            return 0
        fresh = max(self.meta.fresh_at_ns, self.last_msg_ns)
        return max(0, (time.time_ns() - fresh) // 1_000_000) if fresh else 0

    def fresh_enough(self, max_stale_ms: int) -> bool:
        """May reads be answered locally? Synced, and not staler than the bound."""
        return self.meta.synced and (self.caught_up or self.lag_ms() <= max_stale_ms)

    # -------------------------------------------------------------- consumer loop

    async def _run(self) -> None:
        backoff = 0.1
        while True:
            start = None if self._full else self.meta.applied_seq + 1
            consumer = PullConsumer(
                self.nc, self.stream, self.prefix, self.filters, start_seq=start,
                headers_only=False, heartbeat_s=self.heartbeat_s,
                on_batch=self._on_batch, on_idle=self._on_idle, timeout=self.timeout,
            )
            self._consumer = consumer
            if self._full:
                self._seen = set()
                self._sync_started = time.monotonic()
            try:
                self.consumers_created += 1
                await consumer.run()
            except asyncio.CancelledError:
                raise
            except ReplicaError as e:
                log.error("bucket %s: %s", self.bucket, e)
            except (ConsumerLost, UpstreamError) as e:
                log.warning("bucket %s: recreating consumer: %s", self.bucket, e)
            except Exception:
                log.exception("bucket %s: feed failed; recreating consumer", self.bucket)
            self.caught_up = False
            await asyncio.sleep(backoff * (0.5 + random.random()))
            backoff = min(backoff * 2, 5.0)
            if consumer.initial_pending or consumer._next_cseq > 1:
                backoff = 0.1
            await self._replan()

    async def _replan(self) -> None:
        """Before recreating, check the stream: it may have been purged or recreated meanwhile."""
        try:
            info = await jsapi.stream_info(self.nc, self.stream, self.timeout)
        except UpstreamError as e:  # includes BucketNotFound: keep trying, serve what we have
            log.warning("bucket %s: %s", self.bucket, e)
            return
        if self._full and not self.meta.synced:
            # An interrupted full resync restarts from scratch: its key set is incomplete.
            self.meta.applied_seq = 0
        self._plan(info)

    def _on_batch(self, batch: list[Delivery]) -> bool:
        changes: dict[str, Delivery] = {}
        for d in batch:
            changes[d.key] = d
        if self._seen is not None:
            self._seen.update(lmdb_key(k) for k in changes)
        puts = [(k, d.value, d.seq, d.created) for k, d in changes.items() if d.operation is Operation.PUT]
        deletes = [k for k, d in changes.items() if d.operation is not Operation.PUT]
        last = batch[-1]
        m = self.meta
        m.applied_seq = last.seq
        m.last_update_ns = time.time_ns()
        self.last_msg_ns = last.created
        self.upstream_seq = max(self.upstream_seq, last.seq + last.pending)
        caught_up = last.pending == 0
        finishing = caught_up and not m.synced
        if caught_up:
            m.fresh_at_ns = m.last_update_ns
        if finishing and self._seen is None:
            m.synced = True
        self.replica.apply(self.bucket, puts, deletes, m)
        self._last_meta_write = m.last_update_ns
        if self._waiters:
            self._wake_waiters()
        if caught_up:
            self._reached_end()
        self.caught_up = caught_up
        return False

    def _on_idle(self) -> None:
        self.caught_up = True
        now = time.time_ns()
        self.meta.fresh_at_ns = now
        self._reached_end()
        if now - self._last_meta_write >= META_TOUCH_INTERVAL_NS:
            self._last_meta_write = now
            self.replica.put_meta(self.bucket, self.meta)

    def _reached_end(self) -> None:
        """End of initial data: finish a full resync's sweep, or start a resume's reconcile."""
        if self._seen is not None:
            removed = self._sweep(self._seen)
            self._seen = None
            self._full = False
            self.meta.synced = True
            self.replica.put_meta(self.bucket, self.meta)
            log.info("bucket %s: synced %d keys in %.2fs (%d stale keys removed)",
                     self.bucket, self.replica.count(self.bucket),
                     time.monotonic() - self._sync_started, removed)
        elif not self.meta.synced:
            self.meta.synced = True
            self.replica.put_meta(self.bucket, self.meta)
        self._synced_event.set()
        if self._reconcile_pending:
            self._reconcile_pending = False
            self._reconcile_task = asyncio.create_task(self._reconcile(), name=f"reconcile:{self.bucket}")

    def _sweep(self, keep: set[bytes], max_revision: int | None = None) -> int:
        """Delete replica keys absent from `keep` (and not newer than max_revision)."""
        stale = [lk for lk, _ in self.replica.iter_keys(self.bucket) if lk not in keep]
        if max_revision is not None:
            stale = [lk for lk in stale if self._revision(lk) <= max_revision]
        return self.replica.delete_lkeys(self.bucket, stale) if stale else 0

    def _revision(self, lkey: bytes) -> int:
        db = self.replica.db(self.bucket)
        with self.replica.env.begin(db=db) as txn:
            raw = txn.get(lkey)
        return int.from_bytes(raw[:8], "little") if raw else 0

    # -------------------------------------------------------------- reconcile

    async def _reconcile(self) -> None:
        """After a resume, find keys that vanished while we were down (purged delete markers,
        TTL expiry, stream purge) with a headers-only last-per-subject pass, and drop them."""
        try:
            info = await jsapi.stream_info(self.nc, self.stream, self.timeout)
            snapshot = info.get("state", {}).get("last_seq", 0)
            live: set[bytes] = set()

            def collect(batch: list[Delivery]) -> bool:
                for d in batch:
                    if d.operation is Operation.PUT:
                        live.add(lmdb_key(d.key))
                    else:
                        live.discard(lmdb_key(d.key))
                return batch[-1].pending == 0

            finished = False

            def idle() -> None:
                nonlocal finished
                finished = True
                if consumer:
                    consumer._done = True
                    consumer._wake.set()

            consumer = None
            consumer = PullConsumer(
                self.nc, self.stream, self.prefix, self.filters, start_seq=None,
                headers_only=True, heartbeat_s=self.heartbeat_s,
                on_batch=collect, on_idle=idle, timeout=self.timeout,
            )
            await consumer.run()
            removed = self._sweep(live, max_revision=snapshot)
            if removed:
                log.info("bucket %s: reconcile removed %d keys that vanished upstream", self.bucket, removed)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the next restart will try again; the data is still served
            log.warning("bucket %s: reconcile pass failed: %s", self.bucket, e)
