"""Where a read is answered: the decisions, for every path that hands out a value.

A key is answered by the replica when the replica is fresh within the bound the read allows
(`max_stale_ms`, or KV.GET's MAXSTALE), the key is inside its bucket's filters, and the key is
not *held* (its record would go back below a revision already handed out from NATS): the one
rule, kvcache.store.verdict. Otherwise by the near cache (a key outside the filters), or by
NATS through the router (peers, then the leader), and the newer of the two answers wins; when
NATS cannot answer, a stale replica may (the bucket's `serve_stale`).

This module decides and does nothing else: it reads the replica, the feeds' positions, the
near cache and the router's floors to answer a question, and never counts, logs, waits or asks
NATS. A key is resolved once (`address`: its Plan, cached per raw key) and routed once
(`route`: Local, Held, Cached or Remote); the other questions are may a read join a request
to NATS already in flight (`may_join`), which answer is handed out (`newest`), may it fill
the near cache (`fill`), and, when NATS fails, a stale answer or an error (`stale_entry`).

Users: kvcache.read.reads, which carries every route of the RESP command layer out (one key or
many, in one loop) and counts and logs it; the server's GET fast path (kvcache.serve.server_get and
its C twin), which plans each raw key once through `ReadPolicy.plan` and asks per batch only
the feed's `fresh_for_all` (the same rule, for every key at once); and LocalReader in an
application's process, which shares the addressing (kvcache.keys.split_address) and the rule
with a witness of its own (the meta record), and loads nothing of this module. See
docs/architecture.md, "Consistency".
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from ..entry import Entry, Operation
from ..errors import CommandError, KvcacheError, UpstreamError
from ..keys import invalid_key, split_address
from ..store.record import LONG_KEY_PREFIX, RECORD, lmdb_key
from ..store.verdict import LOCAL, STALE, replica_verdict, stored_revision

if TYPE_CHECKING:
    from ..config import BucketConfig, Config
    from ..feed.feed import Feed
    from ..store.nearcache import NearCache
    from ..store.replica import Replica
    from .flights import Flight
    from .ledger import Ledger, Witness

# How long a read of a held key (the replica could not answer it without going back) waits
# for the replica to reach the revision already handed out (MINREV waits the same) before
# asking NATS.
MINREV_WAIT_S = 0.25
# Plans kept (raw key -> Plan), here and in the GET fast path's own map (kvcache.serve.server_get
# and its C twin); each is cleared whole when full.
PLAN_CACHE = 100_000
# KV.GET's source for an answer from a replica too stale to be trusted, given because no peer
# could answer and the bucket has serve_stale on (config.py keeps it from naming a peer).
STALE_SOURCE = "stale"


class Plan(NamedTuple):
    """Where one raw key lives, worked out once per distinct key (ReadPolicy.address): the
    bucket's witness (its feed's freshness with the ledger's holds: kvcache.read.ledger; the
    rule asks it, kvcache.store.verdict), the bound, the bucket's
    name and configuration, the KV key, the key as stored, its LMDB database and where the
    value starts in its record (None for a long key stored under a digest: read the record's
    own key length), whether the key is replicated (inside its bucket's filters), and for a key
    outside them the bucket's near cache (`cache`, with `db` the cache's database; `db` None
    when there is none: only NATS can answer). The one address type of every read: the
    GET fast path (both twins: `ReadPolicy.plan`), and the command layer's (`ReadPolicy.route`).

    The GET fast path answers a cached record (a value, or a cached not-found) under the same
    freshness rule as the replica's keys and counts the hit into the cache (NearCache.hits);
    a key not cached, or expired, it leaves to the generic path."""

    witness: Witness
    max_stale_ms: int
    bucket: str
    lkey: bytes
    db: Any  # the bucket's LMDB database handle (the near cache's, with `cache`); None: neither
    offset: int | None
    cache: NearCache | None = None
    key: str = ""
    config: BucketConfig | None = None
    replicated: bool = True


# ---------------------------------------------------------------------- routes
# What ReadPolicy.route decides for one key, and kvcache.read.reads carries out.

class Remote(NamedTuple):
    """NATS answers, through the router: the stream's leader when `strong` (CONSISTENCY strong,
    or a MAXSTALE below what the quorum evidence fencing a follower vouches for); the read's bound
    (max_stale_ms or MAXSTALE: which requests in flight it may join); `min_rev`: only a
    revision at or above it answers (else the leader is asked); `may_fill`: the answer is
    offered to the near cache (a key outside the filters of a bucket with one); `may_serve_stale`:
    when no peer can answer, the bucket's serve_stale may give the replica's stale record (a
    replicated key, neither strong nor MINREV)."""

    strong: bool
    bound: int
    min_rev: int | None
    may_fill: bool
    may_serve_stale: bool


class Local(NamedTuple):
    """The replica answers: its record (None: the key is absent). A decoded Record for a read
    of one key; the stored bytes (a memoryview into the map, read in the caller's
    transaction) for a read of many."""

    record: Any


class Held(NamedTuple):
    """The replica answers once it has applied stream sequence `seq` (a newer revision of the
    key was handed out from NATS, or MINREV asks for it): wait up to MINREV_WAIT_S, route the
    key again and take only a Local answer; else `then`."""

    seq: int
    then: Remote


class Cached(NamedTuple):
    """The near cache answers: its entry (source `cache`; a cached not-found has no value)."""

    entry: Entry


Route = Local | Held | Cached | Remote


def may_join(flight: Flight, arrived_ns: int, strong: bool, bound_ms: int) -> bool:
    """May a read that arrived at `arrived_ns` (monotonic) take the answer of a request for
    the same key already in flight (kvcache.read.flights) instead of sending its own?

    The answer of a request shows the bucket as of some moment after it was sent (`sent_ns`;
    None: not sent yet, it will be after this read arrived). A plain read promises the
    bucket's state within its bound (`bound_ms`: max_stale_ms or MAXSTALE), so it may join a
    request sent no earlier than `bound_ms` before it arrived, strong or not. A strong read
    (CONSISTENCY strong) promises every write acknowledged before it arrived: only a strong
    request (the leader's answer) sent after it arrived shows that. A MINREV read joins as a
    plain one and checks the answer's revision itself (kvcache.read.reads)."""
    sent = flight.sent_ns
    if strong:
        return flight.strong and (sent is None or sent >= arrived_ns)
    return sent is None or sent >= arrived_ns - bound_ms * 1_000_000


class ReadPolicy:
    """The read decisions of one sidecar, made from its configuration, replica, feeds (and
    their near caches) and the router's floors (see the module docstring). It answers
    questions and keeps the plan cache; carrying a read out (waiting, asking NATS, counting,
    logging) is kvcache.read.reads's."""

    def __init__(self, cfg: Config, replica: Replica, feeds: dict[str, Feed], ledger: Ledger) -> None:
        self.cfg = cfg
        self.replica = replica
        self.feeds = feeds
        self.ledger = ledger
        self.floors = ledger.floors
        # raw key -> its Plan, or the CommandError that says why it names no key
        self._plans: dict[bytes, Plan | CommandError] = {}

    # ------------------------------------------------------------------ addressing

    def resolve(self, raw: bytes) -> tuple[BucketConfig, str]:
        """The bucket and KV key a raw key names; CommandError (one line saying what to do)
        for a key that is not UTF-8 or not a valid KV key, or a bucket not configured here."""
        try:
            text = raw.decode()
        except UnicodeDecodeError:
            raise CommandError("ERR invalid key: not UTF-8") from None
        bucket, key, named = split_address(text, self.cfg.default_bucket)
        bc = self.cfg.bucket(bucket)
        if bc is None:
            # It may well exist in NATS: what is missing is this sidecar's configuration.
            if not named and not bucket:
                raise CommandError("ERR no default bucket: this sidecar replicates no bucket; "
                                   "start it with --bucket NAME or a [[bucket]] entry")
            names = ", ".join(b.name for b in self.cfg.buckets[:8]) + (
                ", ..." if len(self.cfg.buckets) > 8 else "")
            raise CommandError(
                f"ERR no such bucket '{bucket[:64]}' in this sidecar (it replicates: "
                f"{names or 'none'}); to read it, add --bucket {bucket[:64] or 'NAME'} or a "
                "[[bucket]] entry and restart")
        problem = invalid_key(key)
        if problem:
            raise CommandError(problem)
        return bc, key

    def address(self, raw: bytes) -> Plan:
        """Where `raw` lives (Plan), worked out once per raw key and cached (the filters are
        asked here, once); CommandError for an invalid key (see `resolve`)."""
        plan = self._plans.get(raw)
        if plan is None:
            try:
                bc, key = self.resolve(raw)
            except CommandError as e:
                plan = e
            else:
                lkey = lmdb_key(key)
                offset = None if lkey.startswith(LONG_KEY_PREFIX) else RECORD.size
                feed = self.feeds[bc.name]
                witness = self.ledger.witness(feed)
                if bc.replicates(key):
                    plan = Plan(witness, bc.max_stale_ms, bc.name, lkey, self.replica.db(bc.name), offset,
                                None, key, bc)
                else:
                    cache = feed.cache
                    plan = Plan(witness, bc.max_stale_ms, bc.name, lkey, None if cache is None else cache.db,
                                offset, cache, key, bc, False)
            if len(self._plans) >= PLAN_CACHE:
                self._plans.clear()
            self._plans[raw] = plan
        if isinstance(plan, CommandError):
            raise CommandError(*plan.args)  # a new one each time: a raised one keeps its traceback
        return plan

    def plan(self, raw: bytes) -> Plan | Literal[False]:
        """The GET fast path's planner: the key's Plan when the replica or the near cache may
        answer it there (its freshness is asked per batch: Witness.fresh_for_all); False when
        the generic path must (an invalid key, or one outside the filters with no near cache)."""
        try:
            plan = self.address(raw)
        except CommandError:
            return False
        return plan if plan.db is not None else False

    # ------------------------------------------------------------------ the route

    def route(self, plan: Plan, strong: bool = False, max_stale_ms: int | None = None,
              min_rev: int | None = None, txn: Any = None) -> Route:
        """Where the key of `plan` is answered, decided once (docs/architecture.md,
        "Consistency"): Local (the replica's record), Held (the replica, once it has applied a
        sequence), Cached (the near cache's entry) or Remote (NATS). `strong`: CONSISTENCY
        strong (the leader, always); `max_stale_ms`: the read's own bound (MAXSTALE);
        `min_rev`: MINREV. `txn`: a read transaction of the caller's (buffers), in which the
        replica's record is read as stored; without one, it is read and decoded (a Record).
        Whether the replica may answer is the one rule, kvcache.store.verdict."""
        witness = plan.witness
        bound = plan.max_stale_ms if max_stale_ms is None else max_stale_ms
        replicated = plan.replicated
        if strong:
            return Remote(True, bound, min_rev, plan.cache is not None, False)
        # A MAXSTALE below the bucket's own bound, on a stream replicated in a cluster: the
        # quorum evidence that fences a follower's answer is kept within max_stale_ms only
        # (Feed.fence), so such a read that NATS answers asks the leader.
        leader = bound < plan.max_stale_ms and witness.feed.quorum
        if min_rev is not None and replicated:
            meta = witness.feed.meta
            if not (meta.synced and meta.applied_seq >= min_rev):
                # the replica answers once it holds the revision asked (a short wait), else
                # NATS with the same MINREV: a second route keeps what the first was asked
                return Held(min_rev, Remote(leader, bound, min_rev, False, False))
        record = None
        if replicated:
            if txn is None:
                record = self.replica.get(plan.bucket, plan.key)
                v = replica_verdict(witness, bound, True, plan.key, record)
            else:
                record = txn.get(plan.lkey, None, plan.db)
                v = replica_verdict(witness, bound, True, plan.key, record, stored_revision)
            if v == LOCAL:
                return Local(record)
            plain = min_rev is None  # MINREV is never answered by a stale replica
            if v > 0:
                return Held(v, Remote(leader, bound, min_rev, False, plain))
            return Remote(leader, bound, min_rev, False, plain)
        cache = plan.cache
        if cache is not None:
            if replica_verdict(witness, bound, False) == STALE:
                cache.count(plan.lkey)  # the ask counts towards the key's admission all the same
            else:
                rec = cache.answer(witness, plan.lkey, plan.key, min_rev)
                if rec is not None:
                    if rec.value is None:  # a cached not-found, known at its revision
                        return Cached(Entry(plan.bucket, plan.key, None, rec.revision, 0, 0, Operation.DEL, "cache"))
                    return Cached(Entry(plan.bucket, plan.key, rec.value, rec.revision, rec.created, 0,
                                        Operation.PUT, "cache", rec.expires))
        return Remote(leader, bound, min_rev, cache is not None, False)

    # ------------------------------------------------------------------ the near cache

    def fill(self, plan: Plan, entry: Entry | None, answered: str) -> None:
        """A fallback read answered a key outside the filters (Remote.may_fill): offer the
        answer to the near cache (kvcache.store.nearcache admits it if the key is hot enough).
        Only an answer of the bucket's own stream (its replicas or leader, `answered` by the
        main connection's peer; a mirror may lag without bound), only while the feed vouches
        for the bucket and saw no newer change on the way (Feed.fill_ok: for a not-found,
        which has no revision of its own, no change at all), and never over a newer cached
        revision. A not-found goes in as a cached not-found where nothing is cached; one that
        contradicts a cached value (a lagging responder, or a removal no message told of)
        drops it instead, and so does an answer that may not go in."""
        cache = plan.cache
        if cache is None:
            return
        bucket, lk = plan.bucket, plan.lkey
        feed = plan.witness.feed
        found = entry is not None and entry.value is not None and entry.operation is Operation.PUT
        # a value names its source; a not-found (or a deletion's marker) is the responder's
        own = (entry.source in (f"main.{bucket}", "leader") if found and entry is not None
               else answered == f"main.{bucket}")
        revision = entry.revision if entry is not None else 0
        ok = own and feed.fill_ok(lk, revision)
        current = cache.current_revision(lk)  # (revision, a not-found) or None
        if not found:
            if current is not None:
                if current[0] >= revision and (entry is not None or current[1]):
                    return  # what is cached is as new or newer (a not-found too)
                cache.invalidate([lk])
                if entry is None:  # beside a cached value: a lagging responder, or a removal
                    return         # no message told of: keep neither
            if ok:
                cache.offer_absent(lk, revision)
            return
        assert entry is not None and entry.value is not None
        if not ok:
            if current is not None and current[0] < revision:
                cache.invalidate([lk])
            return
        if current is not None and current[0] >= revision:
            return  # what is cached is as new or newer: a lagging responder's answer
        cache.offer_entry(plan.key, lk, entry.value, entry.revision, entry.created, entry.expires)

    # ------------------------------------------------------------------ answers from NATS

    def newest(self, plan: Plan, remote: Entry | None) -> Entry | None:
        """The answer to hand out for a key read from NATS. Higher revision wins. A remote
        not-found carries no revision, and a lagging responder may not have the key yet, so it
        never overrides a record the replica holds; a deletion overrides it through its
        DEL/PURGE marker's higher revision. A remote revision the synced replica has reached
        (at or below its applied sequence) is no newer than what the replica knows, so the
        replica's answer wins, absent included: the key was deleted since, and a lagging
        peer's PUT must not bring it back after a local read showed it gone. A remote answer
        above that is noted (the ledger's holds): local reads must not go below it."""
        if not plan.replicated:
            return remote
        bucket, key = plan.bucket, plan.key
        rec = self.replica.get(bucket, key)
        if rec is not None and (remote is None or remote.revision < rec.revision):
            return Entry(bucket, key, rec.value, rec.revision, rec.created, 0, Operation.PUT, "local")
        if remote is None:
            return None
        witness = plan.witness
        feed = witness.feed
        if feed.synced and remote.revision <= feed.meta.applied_seq:
            return remote if rec is not None else None  # with a record: the same revision
        witness.handed_out(key, remote.revision)
        return remote

    def stale_entry(self, plan: Plan, route: Remote, err: KvcacheError) -> Entry | None:
        """A fallback read failed. If it was one the replica passed on for staleness
        (Remote.may_serve_stale: a key of the replicated set, neither CONSISTENCY strong nor
        MINREV) and no peer could answer (UpstreamError), the bucket's serve_stale decides:
        the replica's last known value (source STALE_SOURCE; None for a key it knows to be
        absent), or a RESP error saying why neither answered. Even with serve_stale, the
        replica does not answer what it cannot know (a key it lacks while it is not synced) or
        what would take a key's reads back in time (a newer revision was already read from a
        peer): those stay errors."""
        if not route.may_serve_stale or not isinstance(err, UpstreamError):
            raise CommandError(f"ERR upstream read failed: {err}")
        witness = plan.witness
        feed = witness.feed
        bucket, key = plan.bucket, plan.key
        bound = route.bound
        if not feed.synced:
            why = "replica not synced"
        elif feed.fresh_within(bound):  # the key was held (the ledger's holds), the replica is fresh
            why = "replica behind a revision of the key already read from NATS"
        else:
            why = f"replica stale ({feed.lag_ms() / 1000:.1f}s behind, max_stale_ms {bound})"
        message = f"ERR bucket {bucket}: {why} and no peer could answer: {err}"
        bc = plan.config
        assert bc is not None
        if not self.cfg.serves_stale(bc):
            raise CommandError(message)
        rec = self.replica.get(bucket, key)
        entry = None if rec is None else Entry(bucket, key, rec.value, rec.revision, rec.created,
                                               0, Operation.PUT, STALE_SOURCE)
        if entry is None and not feed.synced:
            raise CommandError(f"{message}; not serving stale: the key may exist, the replica "
                               "has not finished its sync")
        if self.floors.below(bucket, key, entry) or witness.held_until(
                key, None if entry is None else entry.revision):
            raise CommandError(f"{message}; not serving stale: a newer revision of the key "
                               "was already read from a peer")
        return entry

    def vouched(self, bucket: str) -> bool:
        """Does the bucket's feed vouch for its replica now: fresh within its max_stale_ms?
        (EXEC with WATCHed keys of the bucket asks.)"""
        feed = self.feeds[bucket]
        return feed.fresh_within(feed.cfg.max_stale_ms)
