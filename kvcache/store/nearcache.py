"""The near cache: keys outside a bucket's replicated filters, kept beside the replica after a
fallback read, so a hot key of a bucket too big to replicate costs one Direct Get, not one per
read.

Bounded by `cache_max_keys` and `cache_max_bytes` (either or both; 0 is no bound of that kind,
both 0 is no cache). Records live in the replica's LMDB environment, one database per bucket
(`n:<bucket>`, records in kvcache.store.record's format), so a restart finds them again; which key
is coldest lives in memory (an LRU order rebuilt, arbitrary, at start).

Admission is by frequency (TinyLFU, kvcache.store.sketch): every read of a key outside the filters
is counted, and when the cache is full a candidate gets in only if it is read more often than
the key it would evict. A scan of a million cold keys counts each once and evicts nothing
hot; memory stays at the bounds plus the fixed sketch.

A not-found is cached too (`absent`): an 8-byte record holding only the revision it is known
at (a deletion's marker, or 0 for a key with no message), so a hot missing key costs one
Direct Get, not one per read. Every record starts with its revision (REVISION), absent or not.

The bucket's feed keeps what is cached current (`refresh`): a change of a cached key
replaces its record in stream order (a delete or purge becomes a cached not-found), so a write
of a hot key does not turn its next burst of readers into a stampede on NATS. A record never
goes back: a fill from NATS may be ahead of the feed, and an older change is then skipped.

This module owns the store and its format: the records in the bucket's `n:<bucket>` database
(the replica lends its LMDB environment and that database's handle, nothing more), what a
cached record holds (`CachedRecord`, `absent`) and how an answer is encoded into one
(`offer_entry`). Whether a cached record may answer a read (the bucket's invalidation feed
fresh within max_stale_ms, the floors) and whether an answer may go in are the read policy's
questions (kvcache.read.policy), and keeping it current is the bucket's feed's job.

The server's GET fast path (kvcache.serve.server_get and its C twin) answers hits itself, from the
database through its own read transaction, under the same freshness rules as the replica's
keys, and hands each hit to the cache's `counter` (kvcache.store.near_hits, chosen with its
native twin by kvcache.native): the counter alone keeps the sketch and the sampled LRU moves,
for those hits and for the reads the cache answers itself (`get`, `count`), so the rules of
counting, sampling and aging are written once (near_hits says which and why). The path counts
its answers for INFO itself (ServerGets.cache_reads), and INFO and the metrics add them to
`stats.hits`. A miss, an expired record or a read while the feed is not fresh is left to the
read policy's path.
"""
from __future__ import annotations

import itertools
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

from .. import native
from .record import NEVER, decode_record, encode_record, expiry

if TYPE_CHECKING:
    import lmdb

    from .near_hits import HitCounter
    from .replica import Replica
    from .sketch import FrequencySketch

# The hit counter's implementation: ext/near_hits.pyx, or its twin kvcache.store.near_hits
_NEAR_HITS = native.load("near_hits")

# What a cached key costs beyond its key and record: the LRU entry and LMDB's node header
ENTRY_OVERHEAD = 64
# The revision every cached record starts with; alone, it is a cached not-found (`absent`)
REVISION = struct.Struct("<Q")
# The oldest keys an eviction compares (by frequency) to choose its victim (_victim)
VICTIM_SAMPLE = 8


def absent(revision: int) -> bytes:
    """The cached record of a not-found known at `revision` (0: no message at all)."""
    return REVISION.pack(revision)


def is_absent(raw: bytes) -> bool:
    return len(raw) == REVISION.size


def revision_of(raw: bytes | memoryview) -> int:
    return REVISION.unpack_from(raw)[0]


class CacheWitness(Protocol):
    """What vouches for a bucket's cached answers (kvcache.read.ledger.Witness): the bucket's
    max_age, and the revisions already handed out of each key."""

    @property
    def max_age_ns(self) -> int: ...

    def below(self, key: str, revision: int) -> bool:
        """Is `revision` of `key` older than one already handed out?"""
        ...


class CachedRecord(NamedTuple):
    """A cached record decoded: a value (None: a cached not-found, known at `revision`), its
    revision, creation time and own expiry (kvcache.store.record.Record.expires)."""

    value: bytes | None
    revision: int
    created: int = 0
    expires: int = 0


def decode(lkey: bytes, raw: bytes) -> CachedRecord:
    """A stored cached record (kvcache.store.record's format, or `absent`) decoded."""
    if is_absent(raw):
        return CachedRecord(None, revision_of(raw))
    rec = decode_record(lkey, raw)
    return CachedRecord(rec.value, rec.revision, rec.created, rec.expires)


def drop_store(replica: Replica, bucket: str) -> None:
    """Drop what a run with a near cache left for `bucket` (this run has none for it)."""
    db = replica.cache_db(bucket)
    replica.write(f"bucket {bucket} cache", lambda txn: txn.drop(db, delete=False))


@dataclass
class CacheStats:
    """INFO's per-bucket near-cache counters."""

    hits: int = 0
    misses: int = 0
    admissions: int = 0
    rejections: int = 0   # candidates colder than the key they would have evicted
    evictions: int = 0
    invalidations: int = 0
    updates: int = 0      # cached keys the feed replaced with their new value or a not-found


class NearCache:
    """One bucket's near cache: bounded, admitted by frequency, persisted beside the replica."""

    def __init__(self, replica: Replica, bucket: str, max_keys: int = 0, max_bytes: int = 0,
                 admission: str = "frequency") -> None:
        if max_keys <= 0 and max_bytes <= 0:
            raise ValueError("a near cache needs cache_max_keys or cache_max_bytes")
        # What the replica lends: its environment, the bucket's cache database, and its write
        # step (one write transaction, the map grown when full)
        self._env = replica.env
        self._db = replica.cache_db(bucket)
        self.db_name = replica.cache_db_name(bucket)  # for the GET fast path's own environment
        self._write_txn = replica.write
        self.bucket = bucket
        self.max_keys = max_keys
        self.max_bytes = max_bytes
        # "lru": every answer goes in and the least recently used goes out (the plain LRU the
        # frequency admission is measured against: bench/nearcache_bench.py)
        self.by_frequency = admission != "lru"
        self.stats = CacheStats()
        self.lru: OrderedDict[bytes, int] = OrderedDict()  # lkey -> bytes it is charged
        self.bytes = 0
        # Every read's count and the hits' sampled LRU moves: the GET fast path hands its hits
        # here (take, or take_one from C), the cache its own reads (read)
        self.counter: HitCounter = _NEAR_HITS.HitCounter(max_keys or max(1, max_bytes // 256), self.lru)
        self._load()

    @property
    def db(self):  # the bucket's cache database handle (LMDB), for the GET fast path's plans
        return self._db

    @property
    def sketch(self) -> FrequencySketch:
        """How often each key is read (the counter's; the cache reads estimates from it)."""
        return self.counter.sketch

    @property
    def touched(self) -> list[bytes]:
        """The keys of sampled hits not yet moved in the LRU order (the counter's, which moves
        them: here to be looked at)."""
        return self.counter.touched

    def drain(self) -> None:
        """Move the keys of the GET fast path's sampled hits to the LRU's end."""
        self.counter.drain()

    # ------------------------------------------------------------------ the store (LMDB)

    def _read(self, lkey: bytes) -> bytes | None:
        with self._env.begin(db=self._db, buffers=False) as txn:
            return txn.get(lkey)

    def sizes(self) -> list[tuple[bytes, int]]:
        """(lkey, record size) of every stored record."""
        with self._env.begin(db=self._db, buffers=True) as txn:
            return [(bytes(k), len(v)) for k, v in txn.cursor()]

    def _items(self) -> list[tuple[bytes, bytes]]:
        """(lkey, record) of every stored record (bounded by the cache's own bounds)."""
        with self._env.begin(db=self._db, buffers=False) as txn:
            return list(txn.cursor())

    def _store(self, puts: list[tuple[bytes, bytes]], deletes: list[bytes]) -> None:
        db = self._db

        def write(txn: lmdb.Transaction) -> None:
            for lk in deletes:
                txn.delete(lk, db=db)
            for lk, rec in puts:
                txn.put(lk, rec, db=db)

        self._write_txn(f"bucket {self.bucket} cache", write)

    def _load(self) -> None:
        """What a previous run cached, within today's bounds (the excess is dropped)."""
        for lkey, size in self.sizes():
            self.lru[lkey] = size + len(lkey) + ENTRY_OVERHEAD
            self.bytes += self.lru[lkey]
        extra = []
        while self._over(0):
            lkey, size = self.lru.popitem(last=False)
            self.bytes -= size
            extra.append(lkey)
        if extra:
            self._store([], extra)

    def __len__(self) -> int:
        return len(self.lru)

    def __contains__(self, lkey: bytes) -> bool:
        return lkey in self.lru

    def keys(self) -> list[bytes]:
        return list(self.lru)

    def _over(self, adding: int) -> bool:
        n = len(self.lru) + (1 if adding else 0)
        return bool((self.max_keys and n > self.max_keys)
                    or (self.max_bytes and self.bytes + adding > self.max_bytes))

    # ------------------------------------------------------------------ reads

    def count(self, lkey: bytes) -> None:
        """A read of the key the cache may not answer (its feed is not fresh): counted towards
        its admission all the same."""
        self.counter.read(lkey)

    def answer(self, witness: CacheWitness, lkey: bytes, key: str, min_rev: int | None) -> CachedRecord | None:
        """What the near cache may hand out for `key` (a not-found has no value), or None: not
        cached, past its expiry (its own TTL or the bucket's max_age: dropped here), older than
        a revision already handed out from NATS (the witness's floors: answers never go back
        in time), or below `min_rev` (KV.GET's MINREV: a value at that revision or above).
        Every ask counts towards the key's admission. The replica's freshness is the caller's
        question (kvcache.store.verdict), asked first."""
        rec = self.lookup(lkey)
        if rec is None:
            return None
        if rec.value is not None:
            due = expiry(rec.created, rec.expires, witness.max_age_ns)
            if due and time.time_ns() >= due:
                self.invalidate([lkey])
                return None
        if witness.below(key, rec.revision):
            return None
        if min_rev is not None and (rec.value is None or rec.revision < min_rev):
            return None
        return rec

    def lookup(self, lkey: bytes) -> CachedRecord | None:
        """The cached record of a key, decoded (counted as a read); None when not cached."""
        raw = self.get(lkey)
        return None if raw is None else decode(lkey, raw)

    def current_revision(self, lkey: bytes) -> tuple[int, bool] | None:
        """(revision, is a not-found) of what is cached for the key, None when nothing is; not
        counted as a read."""
        if lkey not in self.lru:
            return None
        raw = self._read(lkey)
        return None if raw is None else (revision_of(raw), is_absent(raw))

    def get(self, lkey: bytes) -> bytes | None:
        """The cached record of a key as stored (counted as a read), None when not cached."""
        self.counter.read(lkey)
        if lkey not in self.lru:
            self.stats.misses += 1
            return None
        raw = self._read(lkey)
        if raw is None:  # gone from LMDB behind our back: forget it
            self.bytes -= self.lru.pop(lkey)
            self.stats.misses += 1
            return None
        self.lru.move_to_end(lkey)
        self.stats.hits += 1
        return raw

    # ------------------------------------------------------------------ writes

    def offer_entry(self, key: str, lkey: bytes, value: bytes, revision: int, created: int,
                    expires: int) -> bool:
        """Offer a value read from NATS (`expires`: its own TTL's moment, NEVER, or 0)."""
        ttl = -1 if expires == NEVER else (expires - created if expires else 0)
        return self.offer(lkey, encode_record(key.encode(), lkey, value, revision, created, ttl))

    def offer_absent(self, lkey: bytes, revision: int) -> bool:
        """Offer a not-found known at `revision` (0: no message at all)."""
        return self.offer(lkey, absent(revision))

    def offer(self, lkey: bytes, record: bytes) -> bool:
        """A fallback read's answer for a key: keep it if it is hot enough. True if kept."""
        self.drain()  # the LRU order and the counts the choice of a victim reads
        size = len(lkey) + len(record) + ENTRY_OVERHEAD
        old = self.lru.pop(lkey, None)
        if old is not None:  # a newer answer for a cached key: replace it in place
            self.bytes -= old
        elif self.max_bytes and size > self.max_bytes:
            self.stats.rejections += 1
            return False
        elif self._over(size) and self.lru and self.by_frequency:
            if self.sketch.estimate(lkey) <= self.sketch.estimate(self._victim()):
                self.stats.rejections += 1
                return False
        evicted = []
        while self.lru and self._over(size):
            victim = self._victim()
            self.bytes -= self.lru.pop(victim)
            evicted.append(victim)
        self._store([(lkey, record)], evicted)
        self.lru[lkey] = size
        self.bytes += size
        self.stats.evictions += len(evicted)
        if old is None:
            self.stats.admissions += 1
        return True

    def _victim(self) -> bytes:
        """The key to evict: the least read (by the sketch) of the VICTIM_SAMPLE oldest in the
        LRU order, the oldest among equals. The order is a sample of the hits (drain), so a
        hot key the sample missed may sit among the oldest: comparing a few keeps it from
        being the victim, and from blocking every admission (Redis's eviction samples keys
        the same way). A plain LRU evicts the oldest."""
        if not self.by_frequency:
            return next(iter(self.lru))
        return min(itertools.islice(self.lru, VICTIM_SAMPLE), key=self.sketch.estimate)

    def refresh(self, changes: list[tuple[bytes, bytes | None, int]]) -> int:
        """The bucket's feed delivered these changes of keys outside the filters, in stream
        order: `(lkey, record, revision)`, record None for a delete or purge (then `revision`
        is a lower bound of its sequence: kvcache.feed.feed). Each cached key takes its new
        record (a delete: a cached not-found) unless what is cached is as new or newer (a
        fill from NATS may be ahead of the feed). Not a read (no LRU move, no count); the
        bounds hold as for an offer (the coldest keys go when a value grows past them). How
        many records were replaced."""
        todo = [c for c in changes if c[0] in self.lru]
        if not todo:
            return 0
        db = self._db
        done: dict[bytes, bytes | memoryview] = {}

        def write(txn: lmdb.Transaction) -> None:
            for lk, rec, revision in todo:
                old = done.get(lk)
                if old is None:
                    old = txn.get(lk, db=db)
                if old is not None and revision_of(old) >= revision:
                    continue
                new = absent(revision) if rec is None else rec
                txn.put(lk, new, db=db)
                done[lk] = new

        self._write_txn(f"bucket {self.bucket} cache", write)
        for lk, new in done.items():
            size = len(lk) + len(new) + ENTRY_OVERHEAD
            self.bytes += size - self.lru[lk]
            self.lru[lk] = size
        self.stats.updates += len(done)
        evicted = []
        while self.lru and self._over(0):
            victim = self._victim()
            self.bytes -= self.lru.pop(victim)
            evicted.append(victim)
        if evicted:
            self._store([], evicted)
            self.stats.evictions += len(evicted)
        return len(done)

    def invalidate(self, lkeys: list[bytes]) -> int:
        """The bucket changed these keys: cached ones are dropped. How many were cached."""
        gone = [lk for lk in lkeys if lk in self.lru]
        if gone:
            for lk in gone:
                self.bytes -= self.lru.pop(lk)
            self._store([], gone)
            self.stats.invalidations += len(gone)
        return len(gone)

    def drop_below(self, first_seq: int) -> int:
        """The stream dropped every message below `first_seq` (its limits, a purge): cached
        records older than that have no message left. How many went."""
        gone = [lk for lk, raw in self._items()
                if revision_of(raw) < first_seq]
        return self.invalidate(gone) if gone else 0

    def clear(self) -> int:
        """Everything goes (the bucket was purged or recreated, or its position was lost)."""
        n = len(self.lru)
        db = self._db
        self._write_txn(f"bucket {self.bucket} cache", lambda txn: txn.drop(db, delete=False))
        self.lru.clear()
        self.bytes = 0
        self.stats.invalidations += n
        return n
