"""Where a read is answered: the decisions, for every path that hands out a value.

A key is answered by the replica when it is inside its bucket's filters, the replica is fresh
within the bound the read allows (`max_stale_ms`, or KV.GET's MAXSTALE), and the replica's
record does not go back below a revision already handed out from NATS (the feed's floors);
otherwise by NATS through the router (peers, then the leader), and the newer of the two
answers wins; when NATS cannot answer, a stale replica may (the bucket's `serve_stale`).

This module decides and does nothing else: it reads the replica, the feeds' positions, the
near cache and the router's floors to answer a question, and never counts, logs, waits or asks
NATS. The questions: where may this key be answered (`local`, `held`, `local_now`, `cached`),
may a read join a request to NATS already in flight (`may_join`), which answer is handed out
(`newest`), may it fill the near cache (`fill`), and, when NATS fails, a stale answer or an
error (`stale_entry`).

Users: kvcache.read.reads, which carries out every read of the RESP command layer in that order
(replica, wait for a held key, near cache, NATS, fill) and counts and logs it; the server's
GET fast path (kvcache.serve.get and its C twin), which plans each raw key once through
`ReadPolicy.plan` and asks per batch only the feed's `fresh_for_all`; and LocalReader in an
application's process, which shares the addressing (kvcache.keys.split_address) and the
freshness rule for a replica read from its files (kvcache.store.replica.meta_fresh), and loads
nothing of this module. See docs/architecture.md, "Consistency".
"""
from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from ..entry import Entry, Operation
from ..errors import CommandError, KvcacheError, UpstreamError
from ..keys import KEY_RE, RESERVED_PREFIX, split_address
from ..store.record import LONG_KEY_PREFIX, RECORD, Record, expiry, lmdb_key

if TYPE_CHECKING:
    from ..config import BucketConfig, Config
    from ..feed.feed import Feed
    from ..store.nearcache import NearCache
    from ..store.replica import Replica
    from .flights import Flight
    from .router import Floors

# How long a read of a held key (the replica could not answer it without going back) waits
# for the replica to reach the revision already handed out (MINREV waits the same) before
# asking NATS.
MINREV_WAIT_S = 0.25
# Plans kept (raw key -> Plan), here and in the GET fast path's own map (kvcache.serve.get
# and its C twin); each is cleared whole when full. Issue 15 revisits this bound.
PLAN_CACHE = 100_000
# KV.GET's source for an answer from a replica too stale to be trusted, given because no peer
# could answer and the bucket has serve_stale on (config.py keeps it from naming a peer).
STALE_SOURCE = "stale"


class Plan(NamedTuple):
    """How the replica answers one raw key, worked out once per distinct key: the bucket's
    feed (asked per batch whether it is fresh for every key, `Feed.fresh_for_all`, or per
    key), the bound, the bucket's name and LMDB database, the key as stored, and where the
    value starts in its record (None for a long key stored under a digest: read the record's
    own key length). The one plan type of every local read: the GET fast path (both twins),
    MGET and EXISTS (kvcache.read.reads).

    `cache`: the key is outside the filters of a bucket with a near cache, and `db` is the
    cache's database. The GET fast path answers a cached record (a value, or a cached
    not-found) under the same freshness rule as the replica's keys and counts the hit into
    the cache (NearCache.touched); a key not cached, or expired, it leaves to the generic
    path (`cached`, then NATS). MGET and EXISTS take the generic path for such keys."""

    feed: Feed
    max_stale_ms: int
    bucket: str
    lkey: bytes
    db: Any  # the bucket's LMDB database handle (the near cache's, with `cache`)
    offset: int | None
    cache: NearCache | None = None


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

    def __init__(self, cfg: Config, replica: Replica, feeds: dict[str, Feed], floors: Floors) -> None:
        self.cfg = cfg
        self.replica = replica
        self.feeds = feeds
        self.floors = floors
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
        A key outside the filters of a bucket with a near cache is planned onto the cache
        (Plan.cache). Freshness is not part of the plan: the caller asks it (once per batch)."""
        plan = self._plans.get(raw)
        if plan is not None:
            return plan
        try:
            bc, key = self.resolve(raw)
        except CommandError:
            plan = False
        else:
            lkey = lmdb_key(key)
            offset = None if lkey.startswith(LONG_KEY_PREFIX) else RECORD.size
            feed = self.feeds[bc.name]
            if self.in_filters(bc.name, key):
                plan = Plan(feed, bc.max_stale_ms, bc.name, lkey, self.replica.db(bc.name), offset)
            elif feed.cache is not None:
                plan = Plan(feed, bc.max_stale_ms, bc.name, lkey, feed.cache.db, offset, feed.cache)
            else:
                plan = False
        if len(self._plans) >= PLAN_CACHE:
            self._plans.clear()
        self._plans[raw] = plan
        return plan

    # ------------------------------------------------------------------ may the replica answer?

    def local(self, bc: BucketConfig, key: str, max_stale_ms: int | None = None) -> bool:
        """Is the key replicated, and the replica fresh within the bound (the bucket's
        max_stale_ms, or the read's own)? Whether its record may answer without going back
        in time is asked apart (`held`)."""
        return self.in_filters(bc.name, key) and self.feeds[bc.name].fresh_within(
            bc.max_stale_ms if max_stale_ms is None else max_stale_ms)

    def held(self, bc: BucketConfig, key: str, rec: Record | None) -> int:
        """0 when the replica's record (None: it has none) may answer the key; else the key is
        held: the stream sequence the replica must reach first (a newer revision was handed
        out from NATS, Feed.handed_out)."""
        return self.feeds[bc.name].held_until(key, None if rec is None else rec.revision)

    def local_now(self, bc: BucketConfig, key: str,
                  max_stale_ms: int | None = None) -> tuple[bool, Record | None]:
        """(True, the key's record or None) when the replica may answer the key now: fresh
        within the bound and the key not held; else (False, None)."""
        if self.local(bc, key, max_stale_ms):
            rec = self.replica.get(bc.name, key)
            if not self.held(bc, key, rec):
                return True, rec
        return False, None

    def held_raw(self, raw: bytes, feed: Feed, rec: bytes | memoryview | None) -> tuple[str, str, int]:
        """For a batch read while some key of the feed's bucket is held (Feed.floor_seq):
        (bucket, key, the sequence the replica must reach first, 0 when its stored record
        `rec` may answer now)."""
        bc, key = self.resolve(raw)
        revision = None
        if rec is not None and not self.replica.expired(bc.name, rec):
            revision = RECORD.unpack_from(rec)[0]
        return bc.name, key, feed.held_until(key, revision)

    # ------------------------------------------------------------------ the near cache

    def cached(self, bc: BucketConfig, key: str, max_stale_ms: int | None = None,
               min_rev: int | None = None) -> Entry | None:
        """The near cache's answer (source `cache`) for a key outside the filters, or None
        when it has none it may give: not cached, expired, the bucket's feed not fresh within
        the bound (the replica's own rule), a newer revision already handed out from NATS
        (the router's floors), or below `min_rev` (KV.GET's MINREV: only a value at that
        revision or above). A cached not-found is an Entry with no value (operation DEL, the
        revision it is known at). Every ask counts towards the key's admission."""
        feed = self.feeds[bc.name]
        cache = feed.cache
        if cache is None or self.in_filters(bc.name, key):
            return None
        lk = lmdb_key(key)
        if not feed.fresh_within(bc.max_stale_ms if max_stale_ms is None else max_stale_ms):
            cache.count(lk)
            return None
        rec = cache.lookup(lk)
        if rec is None:
            return None
        if rec.value is None:
            entry = Entry(bc.name, key, None, rec.revision, 0, 0, Operation.DEL, "cache")
        else:
            due = expiry(rec.created, rec.expires, feed.max_age_ns)
            if due and time.time_ns() >= due:
                cache.invalidate([lk])
                return None
            entry = Entry(bc.name, key, rec.value, rec.revision, rec.created, 0, Operation.PUT, "cache",
                          rec.expires)
        if self.floors.below(bc.name, key, entry):
            return None
        if min_rev is not None and (entry.value is None or entry.revision < min_rev):
            return None
        return entry

    def fill(self, bc: BucketConfig, key: str, entry: Entry | None, answered: str) -> None:
        """A fallback read answered a key outside the filters: offer the answer to the near
        cache (kvcache.store.nearcache admits it if the key is hot enough). Only an answer of the
        bucket's own stream (its replicas or leader, `answered` by the main connection's peer;
        a mirror may lag without bound), only while the feed vouches for the bucket and saw
        no newer change on the way (Feed.fill_ok: for a not-found, which has no revision of
        its own, no change at all), and never over a newer cached revision. A not-found
        goes in as a cached not-found where nothing is cached; one that contradicts a cached
        value (a lagging responder, or a removal no message told of) drops it instead, and
        so does an answer that may not go in."""
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
        cache.offer_entry(key, lk, entry.value, entry.revision, entry.created, entry.expires)

    # ------------------------------------------------------------------ answers from NATS

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
        elif feed.fresh_within(bound):  # the key was held (Feed.held_until), the replica is fresh
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
        if self.floors.below(bc.name, key, entry) or feed.held_until(
                key, None if entry is None else entry.revision):
            raise CommandError(f"{message}; not serving stale: a newer revision of the key "
                               "was already read from a peer")
        return entry

    def vouched(self, bucket: str) -> bool:
        """Does the bucket's feed vouch for its replica now: fresh within its max_stale_ms?
        (EXEC with WATCHed keys of the bucket asks.)"""
        feed = self.feeds[bucket]
        return feed.fresh_within(feed.cfg.max_stale_ms)
