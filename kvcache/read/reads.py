"""The read of a key, written once: every read the RESP command layer hands out goes through here.

    reads = Reads(cfg, policy, router, stats, access)
    reply = reads.one(raw_key, "GET", answer)                  # bytes, or a coroutine
    reply = reads.many(raw_keys, "MGET", reply_of, budget)     # bytes, or a coroutine

One key (`one`: GET on the generic path, KV.GET with CONSISTENCY, MAXSTALE and MINREV,
TTL/PTTL/EXPIRETIME/PEXPIRETIME, TYPE, STRLEN, GETRANGE), in this order, each step asking
kvcache.read.policy whether it may answer:
  1. the replica, when the key is replicated and the replica fresh within the bound; a held
     key (a newer revision was handed out from NATS) waits up to MINREV_WAIT_S for it first;
  2. the near cache, for a key outside the filters;
  3. NATS through the router (peers by latency, the leader for CONSISTENCY strong or MINREV
     the replica cannot reach), joining a request for the key already in flight when the
     policy allows (kvcache.read.flights: one request for a hot key's concurrent readers);
     the newer of NATS's and the replica's answers wins, and the answer is offered to the
     near cache; when no peer can answer, the bucket's serve_stale decides between the stale
     replica and an error.
Many keys (`many`: MGET, EXISTS) take the same steps per key, with one LMDB read transaction
for every key the replica answers, one wait per bucket for its held keys, and one batched
NATS read per bucket for the rest (less the keys that join requests in flight).

Each read is counted (kvcache.ops.stats: INFO and the metrics) and, when sampled, written to the
access log (kvcache.ops.accesslog) here, once. The contract the server relies on: the reply is
bytes when the replica or the near cache answers, and a coroutine only when the read must
wait (a held key) or ask NATS. The callers give the encoding: `answer(entry)` for one key
(None: not found), `reply(values)` for many.
"""
from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from ..entry import Entry, Operation
from ..errors import CommandError, KvcacheError, ReplyBudget, ReplyTooLarge
from ..store.record import stored_value
from .flights import Answer as NatsAnswer
from .flights import Flights, answer_of
from .policy import MINREV_WAIT_S, STALE_SOURCE, ReadPolicy, may_join

if TYPE_CHECKING:
    import lmdb

    from ..config import BucketConfig, Config
    from ..ops.accesslog import AccessLog
    from ..stats import Stats
    from ..store.record import Record
    from .router import Router

Reply = bytes | Awaitable[bytes]
Value = bytes | memoryview | None  # a value of MGET/EXISTS: a memoryview into the replica's map
Answer = Callable[["Entry | None"], bytes]
# MGET/EXISTS: keys NATS answers, by bucket: [(position, key)]; held keys: [(position, key,
# the sequence the replica must reach)]
Misses = dict[str, list[tuple[int, str]]]
Held = dict[str, list[tuple[int, str, int]]]


class Reads:
    """Carries out reads (see the module docstring): the read policy's decisions, the waits,
    the router's answers, the near cache's fill, the counts and the access log."""

    def __init__(self, cfg: Config, policy: ReadPolicy, router: Router, stats: Stats,
                 access: AccessLog) -> None:
        self.cfg = cfg
        self.policy = policy
        self.router = router
        self.replica = policy.replica
        self.feeds = policy.feeds
        self.stats = stats
        self.access = access
        self.flights = Flights(router, may_join)

    def max_age_ns(self, bucket: str) -> int:
        """The bucket's max_age (0: none): what TTL and its kin add to a record's own expiry."""
        feed = self.feeds.get(bucket)
        return feed.max_age_ns if feed is not None else 0

    # ------------------------------------------------------------------ one key

    def one(self, raw: bytes, command: str, answer: Answer, strong: bool = False,
            max_stale_ms: int | None = None, min_rev: int | None = None) -> Reply:
        """Read one raw key and reply `answer(entry)` (None: not found); CommandError for an
        invalid key. `strong`: the stream leader answers (KV.GET CONSISTENCY strong);
        `max_stale_ms`: the read's own bound (MAXSTALE); `min_rev`: only a revision at or
        above it answers (MINREV)."""
        policy = self.policy
        bc, key = policy.resolve(raw)
        t0 = self._t0()
        if not strong and min_rev is None and policy.local(bc, key, max_stale_ms):
            rec = self.replica.get(bc.name, key)
            want = policy.held(bc, key, rec)
            if not want:
                return answer(self._local(bc, key, rec, t0, command))
            return self._held_one(bc, key, want, t0, command, answer, max_stale_ms, time.monotonic_ns())
        if not strong:
            cached = policy.cached(bc, key, max_stale_ms, min_rev)
            if cached is not None:
                self._count_cached(bc, key, cached, t0, command)
                return answer(None if cached.value is None else cached)
        return self._remote_one(bc, key, t0, command, answer, strong, max_stale_ms, min_rev,
                                time.monotonic_ns())

    def _local(self, bc: BucketConfig, key: str, rec: Record | None, t0: int,
               command: str) -> Entry | None:
        """The replica's answer, counted and logged."""
        self.stats.gets_local += 1
        self.stats.read(bc.name, "local", rec is not None)
        self._log(t0, bc.name, key, "local", rec is not None, command)
        if rec is None:
            self.stats.gets_notfound += 1
            return None
        return Entry(bc.name, key, rec.value, rec.revision, rec.created, expires=rec.expires)

    def _count_cached(self, bc: BucketConfig, key: str, entry: Entry, t0: int, command: str) -> None:
        hit = entry.value is not None
        self.stats.gets_cached += 1
        self.stats.read(bc.name, "cache", hit)
        self._log(t0, bc.name, key, "cache", hit, command)
        if not hit:
            self.stats.gets_notfound += 1

    async def _local_after(self, bc: BucketConfig, key: str, want: int,
                           max_stale_ms: int | None) -> tuple[bool, Record | None]:
        """Wait (up to MINREV_WAIT_S) for the replica to reach stream sequence `want`; then
        (True, the key's record or None) if it may answer the key now, else (False, None)
        and NATS answers (the router's floors keep that answer at or above what was handed
        out)."""
        if await self.feeds[bc.name].wait_applied(want, MINREV_WAIT_S):
            return self.policy.local_now(bc, key, max_stale_ms)
        return False, None

    async def _held_one(self, bc: BucketConfig, key: str, want: int, t0: int, command: str,
                        answer: Answer, max_stale_ms: int | None, arrived: int) -> bytes:
        """A held key (its newer revision was handed out from NATS): the replica once it has
        caught up, else NATS."""
        local, rec = await self._local_after(bc, key, want, max_stale_ms)
        if local:
            return answer(self._local(bc, key, rec, t0, command))
        return await self._remote_one(bc, key, t0, command, answer, False, max_stale_ms, None, arrived)

    async def _remote_one(self, bc: BucketConfig, key: str, t0: int, command: str, answer: Answer,
                          strong: bool, max_stale_ms: int | None, min_rev: int | None,
                          arrived: int) -> bytes:
        if min_rev is not None and not strong and self.policy.in_filters(bc.name, key):
            # A replicated key is served locally once the replica reaches the revision; any
            # other goes to NATS at once instead of waiting for sequences never applied.
            local, rec = await self._local_after(bc, key, min_rev, max_stale_ms)
            if local:
                return answer(self._local(bc, key, rec, t0, command))
        return answer(await self._remote_entry(bc, key, strong, t0, command, max_stale_ms, arrived, min_rev))

    async def _ask(self, bc: BucketConfig, key: str, strong: bool, arrived: int, bound_ms: int,
                   min_rev: int | None) -> NatsAnswer:
        """NATS's answer for one key: a request in flight joined when the policy allows
        (ReadPolicy.may_join), else one of our own. MINREV joins as a plain read and keeps the
        answer only at or above its revision; below (or not found), it asks the leader, which
        has every acknowledged revision (a strong read, arriving now)."""
        flights = self.flights
        if min_rev is not None and not strong:
            joined = flights.find(bc.name, key, arrived, False, bound_ms)
            if joined is not None:
                self.stats.reads_coalesced += 1
                try:
                    got = await answer_of(joined, False)
                except (KvcacheError, LookupError):
                    pass  # its failure is not ours: ask on our own
                else:
                    if got[0] is not None and got[0].revision >= min_rev:
                        return got
            strong, arrived = True, flights.clock()
        flight = flights.find(bc.name, key, arrived, strong, bound_ms)
        if flight is not None:
            self.stats.reads_coalesced += 1
            try:
                return await answer_of(flight, False)
            except LookupError:
                pass  # a batch over its sender's budget: ask on our own
        return await answer_of(flights.one(bc.name, key, strong), True)

    async def _remote_entry(self, bc: BucketConfig, key: str, strong: bool, t0: int, command: str,
                            max_stale_ms: int | None, arrived: int, min_rev: int | None = None
                            ) -> Entry | None:
        """NATS's answer (_ask); the replica's copy wins when it is newer (reads never go
        back), and the answer is offered to the near cache. When no peer can answer, a stale
        replica may (ReadPolicy.stale_entry; never for CONSISTENCY strong or MINREV). None:
        not found."""
        policy = self.policy
        self.stats.gets_remote += 1
        source = "remote"
        bound = bc.max_stale_ms if max_stale_ms is None else max_stale_ms
        try:
            entry, answered = await self._ask(bc, key, strong, arrived, bound, min_rev)
        except KvcacheError as e:
            self.stats.remote_errors += 1
            try:
                entry = policy.stale_entry(bc, key, e, strong or min_rev is not None,
                                           max_stale_ms)  # or CommandError
            except CommandError:
                self.stats.read_failed(bc.name)
                raise
            source = STALE_SOURCE
            self.stats.gets_stale += 1
        else:
            entry = policy.newest(bc, key, entry)
            policy.fill(bc, key, entry, answered)
        hit = entry is not None and entry.operation is Operation.PUT
        self.stats.read(bc.name, _read_source(entry, source), hit)
        self._log(t0, bc.name, key, entry.source if entry else source, hit, command)
        if not hit:
            self.stats.gets_notfound += 1
            return None
        return entry

    # ------------------------------------------------------------------ many keys

    def many(self, raw_keys: list[bytes], command: str, reply: Callable[[list[Value]], bytes],
             budget: ReplyBudget | None = None) -> Reply:
        """Read many raw keys and reply `reply(values)` (None: not found), in the keys'
        order. An invalid key fails the whole command (CommandError), and so do values beyond
        `budget` (ReplyTooLarge)."""
        t0 = self._t0()
        values, misses, held, txn = self._local_many(raw_keys, t0, command, budget)
        try:
            if not misses:  # replied while the transaction holds the values it points into
                return reply(values)
            # NATS answers the rest first: the replica's values leave the map now
            values = [bytes(v) if v.__class__ is memoryview else v for v in values]
        finally:
            if txn is not None:
                txn.abort()
        return self._remote_many(values, misses, held, reply, t0, command, budget, time.monotonic_ns())

    def _local_many(self, raw_keys: list[bytes], t0: int, command: str, budget: ReplyBudget | None
                    ) -> tuple[list[Value], Misses, Held, lmdb.Transaction | None]:
        """Local values for the keys the replica may answer (one read transaction for all)
        and the near cache's for keys outside the filters; the rest grouped by bucket. Among
        the rest, the held keys, with the sequence the replica must reach to answer them. The
        replica's values are memoryviews into its map (copied once, by the reply: issue 29),
        so the read transaction is returned open, for the caller to end after the reply."""
        values: list[Value] = [None] * len(raw_keys)
        misses: Misses = {}
        held: Held = {}
        policy = self.policy
        plan_of = policy.plan
        stats = self.stats
        txn = None
        local = notfound = 0
        done = False
        try:
            for i, raw in enumerate(raw_keys):
                plan = plan_of(raw)
                if not plan or plan.cache is not None or not plan.feed.fresh_within(plan.max_stale_ms):
                    bc, key = policy.resolve(raw)  # raises for an invalid key
                    hit = None if plan and plan.cache is None else policy.cached(bc, key)
                    if hit is not None:
                        self._count_cached(bc, key, hit, t0, command)
                        if budget is not None and hit.value is not None:
                            budget.spend(len(hit.value))
                        values[i] = hit.value
                        continue
                    misses.setdefault(bc.name, []).append((i, key))
                    continue
                feed, _, bucket, lkey, db, offset, _ = plan
                if txn is None:
                    txn = self.replica.env.begin(buffers=True)
                rec = txn.get(lkey, None, db)
                if feed.floor_seq:  # some key of the bucket is held: is this one?
                    bucket, key, want = policy.held_raw(raw, feed, rec)
                    if want:
                        held.setdefault(bucket, []).append((i, key, want))
                        continue
                value = None if rec is None else stored_value(rec, offset, feed.max_age_ns)
                local += 1
                stats.read(bucket, "local", value is not None)
                if t0 and self.access.sampled():  # resolved again only when sampled
                    bc, key = policy.resolve(raw)
                    self._record(t0, bc.name, key, "local", value is not None, command)
                if value is None:
                    notfound += 1
                else:
                    if budget is not None:
                        budget.spend(len(value))
                    values[i] = value
            done = True
        finally:
            if txn is not None and not done:
                txn.abort()
            stats.gets_local += local
            stats.gets_notfound += notfound
        for bucket, items in held.items():  # NATS answers those the replica does not
            misses.setdefault(bucket, []).extend((i, key) for i, key, _ in items)
        return values, misses, held, txn

    async def _held_many(self, values: list[Value], misses: Misses, held: Held,
                         budget: ReplyBudget | None, t0: int, command: str) -> None:
        """Held keys of MGET/EXISTS: wait once per bucket (up to MINREV_WAIT_S) for the
        replica to reach them, answer those it may answer then, and leave the others in
        `misses`, for NATS."""
        for bucket, items in held.items():
            bc = self.cfg.bucket(bucket)
            assert bc is not None  # held keys were resolved
            await self.feeds[bucket].wait_applied(max(w for _, _, w in items), MINREV_WAIT_S)
            answered: set[int] = set()
            for i, key, _ in items:
                ok, rec = self.policy.local_now(bc, key)
                if not ok:
                    continue
                answered.add(i)
                entry = self._local(bc, key, rec, t0, command)
                if entry is not None:
                    if budget is not None:
                        budget.spend(len(rec.value))  # type: ignore[union-attr]  # found
                    values[i] = entry.value
            rest = [(i, key) for i, key in misses[bucket] if i not in answered]
            if rest:
                misses[bucket] = rest
            else:
                del misses[bucket]

    async def _ask_many(self, bucket: str, keys: list[str], arrived: int, bound_ms: int,
                        budget: ReplyBudget | None) -> tuple[dict[str, Entry | None], dict[str, str]]:
        """NATS's answers for keys of one bucket: the keys with a request in flight the policy
        lets them join take its answer (charged to `budget` here: the request was another
        read's), the rest go in one batch of our own (charged by the router as it reads)."""
        flights = self.flights
        joined = {}
        for key in keys:
            f = flights.find(bucket, key, arrived, False, bound_ms)
            if f is not None:
                joined[key] = f
        self.stats.reads_coalesced += len(joined)
        rest = [k for k in keys if k not in joined]
        own = flights.many(bucket, rest, budget) if rest else {}
        found: dict[str, Entry | None] = {}
        answered: dict[str, str] = {}
        for key, f in own.items():
            found[key], answered[key] = await answer_of(f, True)
        for key, f in joined.items():
            try:
                e, by = await answer_of(f, False)
            except LookupError:  # a batch over its sender's budget: ask on our own
                e, by = await answer_of(flights.one(bucket, key, False), True)
            if budget is not None and e is not None and e.value:
                budget.spend(len(e.value))
            found[key], answered[key] = e, by
        return found, answered

    async def _remote_many(self, values: list[Value], misses: Misses, held: Held,
                           reply: Callable[[list[Value]], bytes], t0: int, command: str,
                           budget: ReplyBudget | None, arrived: int) -> bytes:
        """Held keys first (_held_many), then the misses: per bucket, requests in flight
        joined and one batched multi_last read for the rest, then the reply."""
        if held:
            await self._held_many(values, misses, held, budget, t0, command)
        policy = self.policy
        stats = self.stats
        for bucket, wanted in misses.items():
            bc = self.cfg.bucket(bucket)
            assert bc is not None  # misses are grouped by buckets resolve() found
            keys = list(dict.fromkeys(k for _, k in wanted))
            stats.gets_remote += len(keys)
            source = "remote"
            answered: dict[str, str] = {}
            try:
                found, answered = await self._ask_many(bucket, keys, arrived, bc.max_stale_ms, budget)
            except ReplyTooLarge:
                raise
            except KvcacheError as e:
                stats.remote_errors += 1
                # every key from the stale replica, or the command fails (stale_entry)
                try:
                    found = {k: policy.stale_entry(bc, k, e) for k in keys}
                except CommandError:
                    stats.read_failed(bucket, len(wanted))
                    raise
                source = STALE_SOURCE
                stats.gets_stale += len(keys)
            if source != STALE_SOURCE:
                for key in keys:
                    policy.fill(bc, key, found.get(key), answered.get(key, ""))
            for i, key in wanted:
                entry = found[key] if source == STALE_SOURCE else policy.newest(bc, key, found.get(key))
                hit = entry is not None and entry.operation is Operation.PUT
                stats.read(bucket, _read_source(entry, source), hit)
                self._log(t0, bucket, key, entry.source if entry else source, hit, command)
                if not hit:
                    stats.gets_notfound += 1
                else:
                    assert entry is not None
                    if source == STALE_SOURCE and budget is not None and entry.value:
                        budget.spend(len(entry.value))  # peers charged what they answered
                    values[i] = entry.value
        return reply(values)

    # ------------------------------------------------------------------ the access log

    def _t0(self) -> int:
        """Start time for the access log's latency; 0 (no clock read) when the log is off."""
        return time.perf_counter_ns() if self.access.enabled else 0

    def _log(self, t0: int, bucket: str, key: str, source: str, hit: bool, command: str) -> None:
        """One read into the access log, if sampled."""
        if t0 and self.access.sampled():
            self._record(t0, bucket, key, source, hit, command)

    def _record(self, t0: int, bucket: str, key: str, source: str, hit: bool, command: str) -> None:
        self.access.record(bucket, key, source, hit, (time.perf_counter_ns() - t0) // 1000, command)


def _read_source(entry: Entry | None, source: str) -> str:
    """A remote read's source as the metrics name it: `leader` (its non-direct read), `stale`,
    or `peer` for a Direct Get's answer, a key NATS reports absent, and a replica copy that
    turned out newer (the read went to NATS all the same, as INFO's gets_remote counts it)."""
    if source == STALE_SOURCE:
        return STALE_SOURCE
    return "leader" if entry is not None and entry.source == "leader" else "peer"
