"""Where a read is answered: the one place that decides it, for every path that hands out a value.

A key is answered by the replica when it is inside its bucket's filters, the replica is fresh
within the bound the read allows (`max_stale_ms`, or KV.GET's MAXSTALE), and the replica's
record does not go back below a revision already handed out from NATS (the feed's floors);
otherwise by NATS through the router (peers, then the leader), and the newer of the two
answers wins; when NATS cannot answer, a stale replica may (the bucket's `serve_stale`).

Users of the policy: the RESP command layer (kvcache.commands), the server's GET fast path,
which plans each raw key once through `ReadPolicy.plan` and asks only freshness per batch
(kvcache.server_get and its C twin), and LocalReader in an application's process, which shares
the addressing (`split_address`) and the freshness rule for a replica read from its files
(`meta_fresh`). See docs/architecture.md, "Consistency".
"""
from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from .entry import Entry, Operation
from .errors import CommandError, KvcacheError, ReplyBudget, UpstreamError
from .keys import KEY_RE, RESERVED_PREFIX
from .nearcache import absent, is_absent, revision_of
from .record import LONG_KEY_PREFIX, NEVER, RECORD, Record, decode_record, encode_record, expiry, lmdb_key

if TYPE_CHECKING:
    from .config import BucketConfig, Config
    from .feed import Feed
    from .replica import BucketMeta, Replica
    from .router import Router

# How long a read that the replica could not answer without going back waits for it to reach
# the revision already handed out (MINREV waits the same) before asking NATS.
MINREV_WAIT_S = 0.25
# Plans kept (raw key -> Plan); cleared whole when full. Issue 15 revisits this bound.
PLAN_CACHE = 100_000
# KV.GET's source for an answer from a replica too stale to be trusted, given because no peer
# could answer and the bucket has serve_stale on (config.py keeps it from naming a peer).
STALE_SOURCE = "stale"


class Plan(NamedTuple):
    """How the replica answers one raw key, worked out once per distinct key: the bucket's
    feed (asked whether it is fresh enough, per batch), the bound, the bucket's name and LMDB
    database, the key as stored, and where the value starts in its record (None for a long
    key stored under a digest: read the record's own key length)."""

    feed: Feed
    max_stale_ms: int
    bucket: str
    lkey: bytes
    db: Any  # the bucket's LMDB database handle
    offset: int | None


def split_address(text: str, default: str | None) -> tuple[str, str, bool]:
    """`bucket:key` names the bucket; a bare key reads the default (first) bucket:
    (bucket, key, whether the bucket was named). The one addressing rule of the socket and
    of LocalReader."""
    bucket, sep, key = text.partition(":")
    if not sep:
        return default or "", text, False
    return bucket, key, True


def meta_fresh(meta: BucketMeta, max_stale_ms: int, now_ns: int) -> tuple[bool, float]:
    """For a reader of the replica's files (no feed in its process): the replica may answer
    when synced and confirmed current by the sidecar within `max_stale_ms`: (ok, age in ms)."""
    age_ms = (now_ns - meta.fresh_at_ns) / 1e6
    return bool(meta.synced) and age_ms <= max_stale_ms, age_ms


class ReadPolicy:
    """The read policy of one sidecar: its configuration, replica, feeds and router, and the
    decisions made from them (see the module docstring). It answers questions and keeps the
    plan cache; counting, logging and encoding replies stay with the callers."""

    def __init__(self, cfg: Config, replica: Replica, feeds: dict[str, Feed], router: Router) -> None:
        self.cfg = cfg
        self.replica = replica
        self.feeds = feeds
        self.router = router
        self._plans: dict[bytes, Plan | Literal[False]] = {}
        self.in_filters = functools.lru_cache(maxsize=65536)(self._in_filters)

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
        if not KEY_RE.fullmatch(key):
            raise CommandError(f"ERR invalid key '{key[:64]}': KV keys use A-Z a-z 0-9 - / _ = "
                               "and dots between tokens")
        if key.startswith(RESERVED_PREFIX):
            raise CommandError(f"ERR invalid key '{key[:64]}': keys starting with {RESERVED_PREFIX} are "
                               "reserved for NATS's own use (ADR-8)")
        return bc, key

    def _in_filters(self, bucket: str, key: str) -> bool:
        """Is the key inside the bucket's replicated set (its `keys` filters)? Cached."""
        bc = self.cfg.bucket(bucket)
        return bc is not None and bc.replicates(key)

    def plan(self, raw: bytes) -> Plan | Literal[False]:
        """How the replica reads `raw`, cached per raw key; False when the key is invalid or
        outside the filters (the generic path answers it: an error or a fallback read).
        Freshness is not part of the plan: the caller asks it (once per batch)."""
        plan = self._plans.get(raw)
        if plan is not None:
            return plan
        try:
            bc, key = self.resolve(raw)
        except CommandError:
            plan = False
        else:
            if not self.in_filters(bc.name, key):
                plan = False
            else:
                lkey = lmdb_key(key)
                plan = Plan(self.feeds[bc.name], bc.max_stale_ms, bc.name, lkey,
                            self.replica.db(bc.name),
                            None if lkey.startswith(LONG_KEY_PREFIX) else RECORD.size)
        if len(self._plans) >= PLAN_CACHE:
            self._plans.clear()
        self._plans[raw] = plan
        return plan

    # ------------------------------------------------------------------ may the replica answer?

    def local_ok(self, bc: BucketConfig, key: str, max_stale_ms: int | None = None) -> bool:
        """Is the key replicated, and the replica fresh within the bound? Whether its record
        may answer without going back in time is asked apart (`behind`)."""
        return self.in_filters(bc.name, key) and self.feeds[bc.name].fresh_within(
            bc.max_stale_ms if max_stale_ms is None else max_stale_ms)

    def behind(self, bc: BucketConfig, key: str, rec: Record | None) -> int:
        """0 when the replica's record (None: it has none) may answer the key; else the
        stream sequence it must reach first (a newer revision was handed out from NATS)."""
        return self.feeds[bc.name].behind(key, None if rec is None else rec.revision)

    def local_now(self, bc: BucketConfig, key: str,
                  max_stale_ms: int | None = None) -> tuple[bool, Record | None]:
        """(True, the key's record or None) when the replica may answer the key now: fresh
        within the bound and not behind a revision handed out from NATS; else (False, None)."""
        if self.local_ok(bc, key, max_stale_ms):
            rec = self.replica.get(bc.name, key)
            if not self.behind(bc, key, rec):
                return True, rec
        return False, None

    async def local_after(self, bc: BucketConfig, key: str, want: int,
                          max_stale_ms: int | None = None) -> tuple[bool, Record | None]:
        """A read the replica could not answer without going back in time: wait (up to
        MINREV_WAIT_S) for it to reach stream sequence `want`, as MINREV does. Then
        (True, the key's record or None) if the replica may answer it now; else (False,
        None), and the caller reads NATS (the router's floors keep that answer at or above
        what was handed out)."""
        if await self.feeds[bc.name].wait_applied(want, MINREV_WAIT_S):
            return self.local_now(bc, key, max_stale_ms)
        return False, None

    async def wait_applied(self, bucket: str, seq: int) -> bool:
        """Wait (up to MINREV_WAIT_S) for the bucket's replica to reach stream sequence `seq`."""
        return await self.feeds[bucket].wait_applied(seq, MINREV_WAIT_S)

    def gated(self, raw: bytes, feed: Feed, rec: bytes | None) -> tuple[str, str, int]:
        """For a batch read while some key is gated (Feed.behind): (bucket, key, the sequence
        the replica must reach first, 0 when its raw record `rec` may answer now)."""
        bc, key = self.resolve(raw)
        revision = None
        if rec is not None and not self.replica.expired(bc.name, rec):
            revision = RECORD.unpack_from(rec)[0]
        return bc.name, key, feed.behind(key, revision)

    # ------------------------------------------------------------------ the near cache

    def cached(self, bc: BucketConfig, key: str, max_stale_ms: int | None = None) -> Entry | None:
        """The near cache's answer (source `cache`) for a key outside the filters, or None
        when it has none it may give: not cached, expired, the bucket's feed not fresh within
        the bound (the replica's own rule), or a newer revision already handed out from NATS
        (the router's floors). A cached not-found is an Entry with no value (operation DEL,
        the revision it is known at). Every ask counts towards the key's admission."""
        feed = self.feeds[bc.name]
        cache = feed.cache
        if cache is None or self.in_filters(bc.name, key):
            return None
        lk = lmdb_key(key)
        if not feed.fresh_within(bc.max_stale_ms if max_stale_ms is None else max_stale_ms):
            cache.sketch.increment(lk)
            return None
        raw = cache.get(lk)
        if raw is None:
            return None
        if is_absent(raw):
            gone = Entry(bc.name, key, None, revision_of(raw), 0, 0, Operation.DEL, "cache")
            return None if self.router.floors.behind(bc.name, key, gone) else gone
        rec = decode_record(lk, raw)
        due = expiry(rec.created, rec.expires, feed.max_age_ns)
        if due and time.time_ns() >= due:
            cache.invalidate([lk])
            return None
        entry = Entry(bc.name, key, rec.value, rec.revision, rec.created, 0, Operation.PUT, "cache",
                      rec.expires)
        if self.router.floors.behind(bc.name, key, entry):
            return None
        return entry

    def fill(self, bc: BucketConfig, key: str, entry: Entry | None, answered: str) -> None:
        """A fallback read answered a key outside the filters: offer the answer to the near
        cache (kvcache.nearcache admits it if the key is hot enough). Only an answer of the
        bucket's own stream (its replicas or leader, `answered` by the main connection's peer;
        a mirror may lag without bound), only while the feed vouches for the bucket and saw
        no newer change on the way (Feed.fill_ok: for a not-found, which has no revision of
        its own, no change at all), and never over a newer cached revision. A not-found
        goes in as `absent` where nothing is cached; one that contradicts a cached value
        (a lagging responder, or a removal no message told of) drops it instead, and so
        does an answer that may not go in."""
        feed = self.feeds[bc.name]
        cache = feed.cache
        if cache is None or self.in_filters(bc.name, key):
            return
        lk = lmdb_key(key)
        found = entry is not None and entry.value is not None and entry.operation is Operation.PUT
        # a value names its source; a not-found (or a deletion's marker) is the responder's
        own = (entry.source in (f"main.{bc.name}", "leader") if found and entry is not None
               else answered == f"main.{bc.name}")
        revision = entry.revision if entry is not None else 0
        ok = own and feed.fill_ok(lk, revision)
        current = self.replica.cache_get(bc.name, lk) if lk in cache.lru else None
        if not found:
            if current is not None:
                if revision_of(current) >= revision and (entry is not None or is_absent(current)):
                    return  # what is cached is as new or newer (absent too)
                cache.invalidate([lk])
                if entry is None:  # beside a cached value: a lagging responder, or a removal
                    return         # no message told of: keep neither
            if ok:
                cache.offer(lk, absent(revision))
            return
        assert entry is not None and entry.value is not None
        if not ok:
            if current is not None and revision_of(current) < revision:
                cache.invalidate([lk])
            return
        if current is not None and revision_of(current) >= revision:
            return  # what is cached is as new or newer: a lagging responder's answer
        ttl = -1 if entry.expires == NEVER else (entry.expires - entry.created if entry.expires else 0)
        cache.offer(lk, encode_record(key.encode(), lk, entry.value, entry.revision, entry.created, ttl))

    # ------------------------------------------------------------------ answers from NATS

    async def remote(self, bc: BucketConfig, key: str, strong: bool = False) -> tuple[Entry | None, str]:
        """The router's answer (peers by latency, or the leader when `strong`), and who gave
        it (Router.get_from: what `fill` needs)."""
        return await self.router.get_from(bc.name, key, strong=strong)

    async def remote_many(self, bucket: str, keys: list[str], budget: ReplyBudget | None = None
                          ) -> tuple[dict[str, Entry | None], dict[str, str]]:
        """One batched read of many keys of a bucket (multi_last), within `budget`, and who
        answered each key."""
        return await self.router.get_many_from(bucket, keys, budget)

    def newest(self, bc: BucketConfig, key: str, remote: Entry | None) -> Entry | None:
        """The answer to hand out for a key read from NATS. Higher revision wins. A remote
        not-found carries no revision, and a lagging responder may not have the key yet, so it
        never overrides a record the replica holds; a deletion overrides it through its
        DEL/PURGE marker's higher revision. A remote revision the synced replica has reached
        (at or below its applied sequence) is no newer than what the replica knows, so the
        replica's answer wins, absent included: the key was deleted since, and a lagging
        peer's PUT must not bring it back after a local read showed it gone. A remote answer
        above that is noted (Feed.handed_out): local reads must not go below it."""
        if not self.in_filters(bc.name, key):
            return remote
        rec = self.replica.get(bc.name, key)
        if rec is not None and (remote is None or remote.revision < rec.revision):
            return Entry(bc.name, key, rec.value, rec.revision, rec.created, 0, Operation.PUT, "local")
        if remote is None:
            return None
        feed = self.feeds[bc.name]
        if feed.synced and remote.revision <= feed.meta.applied_seq:
            return remote if rec is not None else None  # with a record: the same revision
        feed.handed_out(key, remote.revision)
        return remote

    def stale_entry(self, bc: BucketConfig, key: str, err: KvcacheError, strong: bool = False,
                    max_stale_ms: int | None = None) -> Entry | None:
        """A fallback read failed. If it was one the replica passed on for staleness (a key of
        the replicated set, neither CONSISTENCY strong nor MINREV) and no peer could answer
        (UpstreamError), the bucket's serve_stale decides: the replica's last known value
        (source STALE_SOURCE; None for a key it knows to be absent), or a RESP error saying why
        neither answered. Even with serve_stale, the replica does not answer what it cannot
        know (a key it lacks while it is not synced) or what would take a key's reads back in
        time (a newer revision was already read from a peer): those stay errors."""
        if strong or not isinstance(err, UpstreamError) or not self.in_filters(bc.name, key):
            raise CommandError(f"ERR upstream read failed: {err}")
        feed = self.feeds[bc.name]
        bound = bc.max_stale_ms if max_stale_ms is None else max_stale_ms
        if not feed.synced:
            why = "replica not synced"
        elif feed.fresh_within(bound):  # the key was gated (Feed.behind), the replica is fresh
            why = "replica behind a revision of the key already read from NATS"
        else:
            why = f"replica stale ({feed.lag_ms() / 1000:.1f}s behind, max_stale_ms {bound})"
        message = f"ERR bucket {bc.name}: {why} and no peer could answer: {err}"
        if not self.cfg.serves_stale(bc):
            raise CommandError(message)
        rec = self.replica.get(bc.name, key)
        entry = None if rec is None else Entry(bc.name, key, rec.value, rec.revision, rec.created,
                                               0, Operation.PUT, STALE_SOURCE)
        if entry is None and not feed.synced:
            raise CommandError(f"{message}; not serving stale: the key may exist, the replica "
                               "has not finished its sync")
        if self.router.floors.behind(bc.name, key, entry) or feed.behind(
                key, None if entry is None else entry.revision):
            raise CommandError(f"{message}; not serving stale: a newer revision of the key "
                               "was already read from a peer")
        return entry
