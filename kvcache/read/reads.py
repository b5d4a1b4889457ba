"""The read of a key, written once: every read the RESP command layer hands out goes through here.

    reads = Reads(cfg, policy, router, stats, access)
    reply = reads.one(raw_key, "GET", answer)                  # bytes, or a coroutine
    reply = reads.many(raw_keys, "MGET", reply_of, budget)     # bytes, or a coroutine

Each key is resolved once (ReadPolicy.address) and routed once (ReadPolicy.route), and its
route carried out here, in one loop for one key and for many:
  Local   the replica's record answers at once;
  Cached  the near cache's entry answers at once (a key outside the filters);
  Held    the replica answers once it has applied a sequence (a newer revision of the key was
          handed out from NATS, or MINREV): one wait per bucket (up to MINREV_WAIT_S), the key
          routed again, and only a Local route taken; else its Remote;
  Remote  NATS through the router (peers by latency, the leader for CONSISTENCY strong or
          MINREV: an answer below MINREV's revision stands only from a bucket that holds it,
          and a revision beyond the bucket's last is an error, _ask_minrev), joining a
          request for the key already in flight when the policy allows
          (kvcache.read.flights: one request for a hot key's concurrent readers), the rest of a
          bucket's keys in one request (one key: a hedged Direct Get; many: a `multi_last`
          batch); the newer of NATS's and the replica's answers wins, and the answer is
          offered to the near cache; when no peer can answer, the bucket's serve_stale
          decides between the stale replica and an error.
`one` (GET on the generic path, KV.GET with CONSISTENCY, MAXSTALE and MINREV, TTL/PTTL/
EXPIRETIME/PEXPIRETIME, TYPE, STRLEN, GETRANGE) is the batch of one key; `many` (MGET, EXISTS)
reads every key the replica answers in one LMDB read transaction.

Each read is counted (kvcache.stats: INFO and the metrics) and, when sampled, written to the
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
from .flights import Flight, Flights, answer_of
from .policy import MINREV_WAIT_S, STALE_SOURCE, Cached, Held, Local, Plan, ReadPolicy, Remote, may_join

if TYPE_CHECKING:
    from ..config import Config
    from ..ops.accesslog import AccessLog
    from ..stats import Stats
    from ..store.record import Record
    from .router import Router

Reply = bytes | Awaitable[bytes]
Value = bytes | memoryview | None  # a value of MGET/EXISTS: a memoryview into the replica's map
Answer = Callable[["Entry | None"], bytes]
# The keys whose route must wait (Held) or ask NATS (Remote): (position, plan, route)
Later = list[tuple[int, Plan, "Held | Remote"]]


class Reads:
    """Carries out reads (see the module docstring): the read policy's routes, the waits, the
    router's answers, the near cache's fill, the counts and the access log."""

    def __init__(self, cfg: Config, policy: ReadPolicy, router: Router, stats: Stats,
                 access: AccessLog) -> None:
        self.cfg = cfg
        self.policy = policy
        self.router = router
        self.replica = policy.replica  # the command layer's key listing reads it (KEYS, SCAN)
        self.stats = stats
        self.access = access
        self.flights = Flights(router, may_join)

    def max_age_ns(self, bucket: str) -> int:
        """The bucket's max_age (0: none): what TTL and its kin add to a record's own expiry."""
        feed = self.policy.feeds.get(bucket)
        return feed.max_age_ns if feed is not None else 0

    # ------------------------------------------------------------------ one key

    def one(self, raw: bytes, command: str, answer: Answer, strong: bool = False,
            max_stale_ms: int | None = None, min_rev: int | None = None) -> Reply:
        """Read one raw key and reply `answer(entry)` (None: not found); CommandError for an
        invalid key. `strong`: the stream leader answers (KV.GET CONSISTENCY strong);
        `max_stale_ms`: the read's own bound (MAXSTALE); `min_rev`: only a revision at or
        above it answers (MINREV)."""
        policy = self.policy
        plan = policy.address(raw)
        t0 = self._t0()
        route = policy.route(plan, strong, max_stale_ms, min_rev)
        cls = route.__class__
        if cls is Local:
            return answer(self._local(plan, route.record, t0, command))  # type: ignore[union-attr]
        if cls is Cached:
            entry = route.entry  # type: ignore[union-attr]
            self._count_cached(plan, entry, t0, command)
            return answer(None if entry.value is None else entry)
        return self._one_later(plan, route, t0, command, answer, time.monotonic_ns())  # type: ignore[arg-type]

    async def _one_later(self, plan: Plan, route: Held | Remote, t0: int, command: str,
                         answer: Answer, arrived: int) -> bytes:
        """A key that waits or asks NATS: the batch of one (_later)."""
        entries: list[Entry | None] = [None]
        await self._later(entries, [(0, plan, route)], t0, command, None, arrived, True)
        return answer(entries[0])

    def _local(self, plan: Plan, rec: Record | None, t0: int, command: str) -> Entry | None:
        """The replica's answer, counted and logged."""
        self.stats.gets_local += 1
        self._counted(plan, "local", rec is not None, t0, command)
        if rec is None:
            return None
        return Entry(plan.bucket, plan.key, rec.value, rec.revision, rec.created, expires=rec.expires)

    def _count_cached(self, plan: Plan, entry: Entry, t0: int, command: str) -> None:
        self.stats.gets_cached += 1
        self._counted(plan, "cache", entry.value is not None, t0, command)

    def _counted(self, plan: Plan, source: str, hit: bool, t0: int, command: str) -> None:
        """A key answered here (`source`: the replica, "local", or the near cache, "cache"):
        the bucket's reads, not-founds and the access log (the caller counts its source's
        total, in bulk for many keys)."""
        self.stats.read(plan.bucket, source, hit)
        self._log(t0, plan.bucket, plan.key, source, hit, command)
        if not hit:
            self.stats.gets_notfound += 1

    # ------------------------------------------------------------------ many keys

    def many(self, raw_keys: list[bytes], command: str, reply: Callable[[list[Value]], bytes],
             budget: ReplyBudget | None = None) -> Reply:
        """Read many raw keys and reply `reply(values)` (None: not found), in the keys'
        order. An invalid key fails the whole command (CommandError), and so do values beyond
        `budget` (ReplyTooLarge). The replica's values are memoryviews into its map, read in
        one transaction (copied once, by the reply), which ends after the reply.
        Each key's access-log latency is its own: a key answered here, its lookup; a key that
        waits or asks NATS, that phase (_later); never the keys read before it."""
        timed = self.access.enabled
        clock = time.perf_counter_ns
        values: list[Value] = [None] * len(raw_keys)
        later: Later = []
        policy = self.policy
        address, route_of = policy.address, policy.route
        counted = self._counted
        txn = None
        local = 0
        try:
            try:
                for i, raw in enumerate(raw_keys):
                    t0 = clock() if timed else 0
                    plan = address(raw)  # raises for an invalid key
                    if plan.replicated and txn is None:
                        txn = self.replica.env.begin(buffers=True)
                    route = route_of(plan, txn=txn)
                    cls = route.__class__
                    if cls is Local:
                        rec = route.record  # type: ignore[union-attr]
                        value = None if rec is None else stored_value(rec, plan.offset, plan.witness.max_age_ns)
                        local += 1
                        counted(plan, "local", value is not None, t0, command)
                        if value is not None:
                            if budget is not None:
                                budget.spend(len(value))
                            values[i] = value
                    elif cls is Cached:
                        entry = route.entry  # type: ignore[union-attr]
                        self._count_cached(plan, entry, t0, command)
                        if budget is not None and entry.value is not None:
                            budget.spend(len(entry.value))
                        values[i] = entry.value
                    else:
                        later.append((i, plan, route))  # type: ignore[arg-type]
            finally:
                self.stats.gets_local += local
            if not later:  # replied while the transaction holds the values it points into
                return reply(values)
            # the rest waits or asks NATS first: the replica's values leave the map now
            values = [bytes(v) if v.__class__ is memoryview else v for v in values]
        finally:
            if txn is not None:
                txn.abort()
        return self._many_later(values, later, reply, command, budget, time.monotonic_ns())

    async def _many_later(self, values: list[Value], later: Later, reply: Callable[[list[Value]], bytes],
                          command: str, budget: ReplyBudget | None, arrived: int) -> bytes:
        entries: list[Entry | None] = [None] * len(values)
        await self._later(entries, later, self._t0(), command, budget, arrived, False)
        for i, _, _ in later:
            entry = entries[i]
            values[i] = None if entry is None else entry.value
        return reply(values)

    # ------------------------------------------------------------------ waits and NATS

    async def _later(self, entries: list[Entry | None], later: Later, t0: int, command: str,
                     budget: ReplyBudget | None, arrived: int, single: bool) -> None:
        """Carry out the routes that wait or ask NATS, into `entries` (None: not found): the
        held keys first, one wait per bucket, then per bucket and kind of read the keys NATS
        answers (requests in flight joined, the rest in one request: a hedged one for
        `single`, else one batch). The access log's latency: for `single`, from `t0` (the
        command's start); for many keys, from the start of the wait or request that answered
        the key (the keys of one batch share it), not from the command's start."""
        held: dict[str, list[tuple[int, Plan, Held]]] = {}
        # (bucket, strong, bound, min_rev): the keys read alike, each with its own route
        remote: dict[tuple[str, bool, int, int | None], list[tuple[int, Plan, Remote]]] = {}
        for i, plan, route in later:
            if route.__class__ is Held:
                held.setdefault(plan.bucket, []).append((i, plan, route))
            else:
                remote.setdefault((plan.bucket, route.strong, route.bound, route.min_rev),  # type: ignore[union-attr]
                                  []).append((i, plan, route))  # type: ignore[arg-type]
        for items in held.values():
            if not single:
                t0 = self._t0()
            feed = items[0][1].witness.feed
            await feed.wait_applied(max(r.seq for _, _, r in items), MINREV_WAIT_S)
            for i, plan, r in items:
                # routed again as first asked (its bound and MINREV): only the replica's
                # answer is taken from this route; else NATS, as first routed
                now = self.policy.route(plan, max_stale_ms=r.then.bound, min_rev=r.then.min_rev)
                if now.__class__ is Local:
                    rec = now.record
                    entries[i] = self._local(plan, rec, t0, command)
                    if budget is not None and rec is not None:
                        budget.spend(len(rec.value))
                else:  # NATS answers, and the router's floors keep it at or above what was handed out
                    t = r.then
                    remote.setdefault((plan.bucket, t.strong, t.bound, t.min_rev), []).append((i, plan, t))
        for (bucket, *_), wanted in remote.items():
            if not single:
                t0 = self._t0()
            await self._remote(entries, bucket, wanted, t0, command, budget, arrived, single)

    async def _remote(self, entries: list[Entry | None], bucket: str,
                      wanted: list[tuple[int, Plan, Remote]], t0: int, command: str,
                      budget: ReplyBudget | None, arrived: int, single: bool) -> None:
        """NATS's answers for keys of one bucket read alike (_ask); the replica's copy wins when
        it is newer (reads never go back), and each answer is offered to the near cache. When
        no peer can answer, a stale replica may (ReadPolicy.stale_entry; never for
        CONSISTENCY strong or MINREV); else the read fails."""
        policy = self.policy
        stats = self.stats
        routes = {plan.key: (plan, route) for _, plan, route in wanted}
        keys = list(routes)
        stats.gets_remote += len(keys)
        source = "remote"
        try:
            found, answered = await self._ask(bucket, keys, wanted[0][2], arrived, budget, single)
        except ReplyTooLarge:
            raise
        except CommandError:  # the read's own mistake (MINREV beyond the bucket), said as is
            stats.read_failed(bucket, len(wanted))
            raise
        except KvcacheError as e:
            stats.remote_errors += 1
            try:  # every key from the stale replica, or the command fails
                found = {k: policy.stale_entry(*routes[k], e) for k in keys}
            except CommandError:
                stats.read_failed(bucket, len(wanted))
                raise
            source = STALE_SOURCE
            stats.gets_stale += len(keys)
        else:
            for key in keys:
                plan, route = routes[key]
                found[key] = entry = policy.newest(plan, found.get(key))
                if route.may_fill:
                    policy.fill(plan, entry, answered.get(key, ""))
        for i, plan, _ in wanted:
            entry = found[plan.key]
            hit = entry is not None and entry.operation is Operation.PUT
            stats.read(bucket, _read_source(entry, source), hit)
            self._log(t0, bucket, plan.key, entry.source if entry else source, hit, command)
            if not hit:
                stats.gets_notfound += 1
            else:
                assert entry is not None
                if source == STALE_SOURCE and budget is not None and entry.value:
                    budget.spend(len(entry.value))  # peers charged what they answered
                entries[i] = entry

    async def _ask(self, bucket: str, keys: list[str], route: Remote, arrived: int,
                   budget: ReplyBudget | None, single: bool
                   ) -> tuple[dict[str, Entry | None], dict[str, str]]:
        """NATS's answers for keys of one bucket, with who answered each: a key with a request
        in flight the policy lets it join (ReadPolicy.may_join) takes its answer (charged to
        `budget` here: the request was another read's), the rest go in one request of our own
        (charged by the router as it reads). A MINREV read (one key) is _ask_minrev's."""
        if route.min_rev is not None:
            key, = keys
            got = await self._ask_minrev(bucket, key, route, arrived)
            return {key: got[0]}, {key: got[1]}
        flights = self.flights
        strong = route.strong
        found: dict[str, Entry | None] = {}
        answered: dict[str, str] = {}
        joined: dict[str, Flight] = {}
        for key in keys:
            f = flights.find(bucket, key, arrived, strong, route.bound)
            if f is not None:
                joined[key] = f
        self.stats.reads_coalesced += len(joined)
        rest = [k for k in keys if k not in joined]
        if not rest:
            own: dict[str, Flight] = {}
        elif single:
            own = {rest[0]: flights.one(bucket, rest[0], strong)}
        else:
            own = flights.many(bucket, rest, budget)
        for key, f in own.items():
            found[key], answered[key] = await answer_of(f, True)
        for key, f in joined.items():
            try:
                e, by = await answer_of(f, False)
            except LookupError:  # a batch over its sender's budget: ask on our own
                e, by = await answer_of(flights.one(bucket, key, strong), True)
            else:
                if budget is not None and e is not None and e.value:
                    budget.spend(len(e.value))
            found[key], answered[key] = e, by
        return found, answered

    async def _ask_minrev(self, bucket: str, key: str, route: Remote, arrived: int) -> NatsAnswer:
        """MINREV r's answer from NATS: the bucket as of revision r or later. A plain request
        in flight is joined and its answer kept when at or above r; else the leader, which has
        every acknowledged revision, is asked (a strong read arriving now; CONSISTENCY strong
        asks it as it arrived). An answer below r (or not found) is right only if the leader
        answered from a bucket at r or later: the key's own last revision is older than r, a
        write of another key. Known when this sidecar had seen the stream reach r before asking
        (its feed: `_reached`); else the leader's STREAM.INFO says: a last revision below r is
        the error this returns (MINREV beyond the bucket); at or above, the key is asked again,
        now of a bucket that holds r (the first answer may predate r's write)."""
        min_rev = route.min_rev
        assert min_rev is not None
        reached = self._reached(bucket)  # before any request: what the answer is sure to include
        got = None if route.strong else await self._join_minrev(bucket, key, route, arrived)
        if got is not None:
            return got
        got = await self._ask_leader(bucket, key, arrived if route.strong else self.flights.clock(), route.bound)
        entry = got[0]
        if (entry is None or entry.revision < min_rev) and reached < min_rev:
            last = await self.router.last_revision(bucket)
            if last < min_rev:
                raise CommandError(f"ERR MINREV {min_rev} is beyond bucket {bucket}'s last revision {last}")
            got = await self._ask_leader(bucket, key, self.flights.clock(), route.bound)
        return got

    def _reached(self, bucket: str) -> int:
        """The highest stream sequence this sidecar has seen the bucket's stream hold: what
        its synced replica applied, or the stream's last sequence as its feed last saw it."""
        feed = self.policy.feeds[bucket]
        return max(feed.upstream_seq, feed.meta.applied_seq if feed.synced else 0)

    async def _ask_leader(self, bucket: str, key: str, arrived: int, bound: int) -> NatsAnswer:
        """The leader's answer for a read arriving at `arrived`: a strong request in flight
        sent since (or not yet sent) is joined, else one is sent."""
        flights = self.flights
        joined = flights.find(bucket, key, arrived, True, bound)
        if joined is not None:
            self.stats.reads_coalesced += 1
            try:
                return await answer_of(joined, False)
            except LookupError:  # not a batch's: cannot happen for a strong request; ask alone
                pass
        return await answer_of(flights.one(bucket, key, True), True)

    async def _join_minrev(self, bucket: str, key: str, route: Remote, arrived: int) -> NatsAnswer | None:
        """MINREV's answer from a plain request in flight, if one may be joined and answers at
        or above the revision; None: ask the leader."""
        joined = self.flights.find(bucket, key, arrived, False, route.bound)
        if joined is None:
            return None
        self.stats.reads_coalesced += 1
        try:
            got = await answer_of(joined, False)
        except (KvcacheError, LookupError):
            return None  # its failure is not ours: ask on our own
        assert route.min_rev is not None
        if got[0] is not None and got[0].revision >= route.min_rev:
            return got
        return None

    # ------------------------------------------------------------------ the access log

    def _t0(self) -> int:
        """Start time for the access log's latency; 0 (no clock read) when the log is off."""
        return time.perf_counter_ns() if self.access.enabled else 0

    def _log(self, t0: int, bucket: str, key: str, source: str, hit: bool, command: str) -> None:
        """One read into the access log, if sampled."""
        if t0 and self.access.sampled():
            self.access.record(bucket, key, source, hit, (time.perf_counter_ns() - t0) // 1000, command)


def _read_source(entry: Entry | None, source: str) -> str:
    """A remote read's source as the metrics name it: `leader` (its non-direct read), `stale`,
    or `peer` for a Direct Get's answer, a key NATS reports absent, and a replica copy that
    turned out newer (the read went to NATS all the same, as INFO's gets_remote counts it)."""
    if source == STALE_SOURCE:
        return STALE_SOURCE
    return "leader" if entry is not None and entry.source == "leader" else "peer"
