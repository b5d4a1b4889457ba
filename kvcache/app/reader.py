"""In-process reads straight from the sidecar's LMDB files: no socket, no syscall per read.

The sidecar is the only writer; any number of processes may read. A reader must know whether
the replica is current, so every read checks the bucket's freshness (synced, and caught up
within `max_stale_ms` as the sidecar last recorded it) and raises StaleReplica otherwise.
The check reads the meta record at most every FRESHNESS_TTL_S, to keep reads near raw LMDB cost.

`get` is the hot path: where a key lives (its bucket, database handle, LMDB key and the
bucket's max_age) is worked out once and cached (a bounded dict), so a read costs one dict
lookup, one clock read, one short read transaction and the value's copy. Whether the replica
may answer is the sidecar's own rule (kvcache.store.verdict), with the meta record as its
witness: fresh within max_stale_ms, the key inside its bucket's filters; no key is ever held
here (holds live in the sidecar's memory).
"""
from __future__ import annotations

import json
import os
import time

import lmdb

from .. import native
from ..entry import Entry, Operation
from ..errors import KvcacheError, ReplicaError
from ..keys import FilterSet, glob_matcher, invalid_key, split_address
from ..store.record import live_value
from ..store.replica import BUCKETS_KEY, META_DB, BucketMeta, Replica, decode_record, lmdb_key, meta_fresh
from ..store.verdict import OUTSIDE, STALE, replica_verdict
from .client import ResponseError

_APP_GET = native.load("app_get")

FRESHNESS_TTL_S = 0.05
PLAN_CACHE = 100_000


class StaleReplica(KvcacheError):
    """The replica is not synced, or the sidecar has not confirmed it recently enough."""


class NotReplicated(KvcacheError):
    """The key is outside its bucket's `keys` filters: the replica does not hold it, whether
    or not the bucket does (ask the sidecar's socket, which reads such keys from NATS)."""


class LocalReader:
    """Reads the sidecar's replica from the application's own process (the app side of the
    socket): the same answers as GET over the socket for replicated keys, at the cost of an
    LMDB read, and StaleReplica where the sidecar would not vouch for the replica. Read-only;
    keys outside the replicated filters are not here (ask the sidecar)."""

    def __init__(self, data_dir: str, max_stale_ms: int = 5000, bucket: str | None = None) -> None:
        path = os.path.join(data_dir, "replica")
        if not os.path.exists(os.path.join(path, "data.mdb")):
            raise ReplicaError(f"no kvcache replica under {data_dir} (is the sidecar running there?)")
        try:
            self._replica = Replica(path, readonly=True)
        except ReplicaError:
            raise
        except lmdb.Error as e:
            raise ReplicaError(f"cannot open replica at {path}: {e}") from None
        self.env = self._replica.env
        self.max_stale_ms = max_stale_ms
        buckets = self.buckets()
        self.default_bucket = bucket or (buckets[0] if buckets else None)
        self._fresh_until: dict[str, float] = {}
        self._filter_sets: dict[str, FilterSet] = {}  # bucket -> its `keys`, from its meta
        self._stale: dict[str, StaleReplica] = {}  # bucket -> why it is stale (_refresh)
        # key -> where it lives: (bucket, db, lmdb key, the bucket's max_age in ns or 0)
        self._located: dict[str, tuple] = {}
        # The hot path (kvcache.app.app_get / ext/app_get.pyx): a key already located in a bucket
        # still fresh is read at once; anything else goes to _get_checked.
        self.get = _APP_GET.LocalGet(  # type: ignore[method-assign]  # per instance, on purpose
            self._located, self._fresh_until, self.env.begin, self._get_checked)

    def buckets(self) -> list[str]:
        """Configured buckets in the sidecar's order (the first is the default)."""
        raw = self._txn_get(META_DB, BUCKETS_KEY)
        return json.loads(raw) if raw else []

    # ------------------------------------------------------------------ reads

    def get(self, key: str) -> bytes | None:
        """The value of `key` (`bucket:key` names a bucket), None if absent; raises
        StaleReplica, NotReplicated for a key outside its bucket's filters (None would
        say "absent" of a key the bucket may hold), and ResponseError for a name that is no
        KV key, as the socket does. Each instance replaces this with its LocalGet fast path (see
        __init__), which comes back to _get_checked whenever there is checking to do."""
        return self._get_checked(key)

    def _get_checked(self, key: str) -> bytes | None:
        located = self._locate(key)
        if located is None:
            return None
        raw = self._txn_get(Replica.db_name(located[0]), located[2])
        if raw is None:
            return None
        return live_value(raw, time.time_ns(), located[3])

    def _locate(self, key: str) -> tuple | None:
        """May the replica answer `key` (raises StaleReplica, NotReplicated)? Then where it
        lives, cached for the hot path; None while its bucket's database does not exist yet."""
        bucket, name = self._address(key)
        self._verdict(bucket, name)
        db = self._replica.db_ro(Replica.db_name(bucket))
        if db is None:
            return None
        lkey = lmdb_key(name)
        located = (bucket, db, lkey, self._replica.max_age.get(bucket, 0))
        if len(self._located) >= PLAN_CACHE:
            self._located.clear()
        self._located[key] = located
        return located

    def entry(self, key: str) -> Entry | None:
        bucket, name = self._address(key)
        self._verdict(bucket, name)
        lkey = lmdb_key(name)
        raw = self._txn_get(Replica.db_name(bucket), lkey)
        if raw is None or self._replica.expired(bucket, raw):
            return None
        rec = decode_record(lkey, raw)
        return Entry(bucket, rec.key, rec.value, rec.revision, rec.created, 0, Operation.PUT, "local")

    def mget(self, keys: list[str]) -> list[bytes | None]:
        return [self.get(k) for k in keys]

    def keys(self, pattern: str = "*", bucket: str | None = None) -> list[str]:
        bucket = bucket or self._require_default()
        self._check_fresh(bucket)
        match = glob_matcher(pattern)
        return [k for _, k in self._replica.iter_keys(bucket, live=True) if match(k)]

    def meta(self, bucket: str | None = None) -> BucketMeta:
        return BucketMeta.decode(self._txn_get(META_DB, (bucket or self._require_default()).encode()))

    def close(self) -> None:
        self._replica.close()

    def __enter__(self) -> LocalReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _address(self, key: str) -> tuple[str, str]:
        """The bucket and key `key` names, the bucket's state read from its meta record
        (_refresh). A name that is no KV key raises the socket's error for it, as the
        socket's client raises it (ResponseError, `ERR invalid key ...`): None would say
        "absent" of a key no bucket can hold."""
        bucket, name, named = split_address(key, self.default_bucket)
        problem = invalid_key(name)
        if problem:
            raise ResponseError(problem)
        if not named:
            bucket = self._require_default()
        self._refresh(bucket)
        return bucket, name

    def _verdict(self, bucket: str, name: str) -> None:
        """The sidecar's rule (kvcache.store.verdict) over this process's witness: raises
        StaleReplica or NotReplicated when the replica may not answer `name`."""
        v = replica_verdict(_Witness(self, bucket), self.max_stale_ms, self._filters(bucket).match(name))
        if v == STALE:
            raise self._stale[bucket]
        if v == OUTSIDE:
            self._not_replicated(bucket, name)

    def replicates(self, key: str) -> bool:
        """Is `key` (`bucket:key` names a bucket) inside its bucket's filters, so that the
        replica's answer, a value or None, is the bucket's? No freshness check."""
        bucket, name, _ = split_address(key, self.default_bucket)
        return self._filters(bucket or self._require_default()).match(name)

    def _not_replicated(self, bucket: str, name: str) -> None:
        filters = self._filters(bucket)
        raise NotReplicated(f"key '{name}' is outside bucket '{bucket}''s filters "
                                f"(keys = {list(filters.filters)}): the replica does not hold it; "
                                "read it through the sidecar's socket")

    def _filters(self, bucket: str) -> FilterSet:
        got = self._filter_sets.get(bucket)
        if got is None:
            filters = self.meta(bucket).filters
            got = self._filter_sets[bucket] = FilterSet([">"] if filters is None else filters)
        return got

    def _require_default(self) -> str:
        if not self.default_bucket:
            raise ReplicaError("the replica holds no bucket yet")
        return self.default_bucket

    def _check_fresh(self, bucket: str) -> None:
        """StaleReplica unless the bucket's replica is fresh (KEYS: no key to judge)."""
        self._refresh(bucket)
        if bucket in self._stale:
            raise self._stale[bucket]

    def _refresh(self, bucket: str) -> None:
        """The bucket's meta record, read at most every FRESHNESS_TTL_S while it is fresh:
        the filters and max_age the sidecar runs with now, and whether the replica is fresh
        within max_stale_ms (meta_fresh; the reason kept in `_stale` when not)."""
        now = time.monotonic()
        if self._fresh_until.get(bucket, 0.0) > now:
            return
        meta = self.meta(bucket)
        if not meta.stream:
            raise ReplicaError(f"bucket '{bucket}' is not replicated here")
        known = self._filter_sets.get(bucket)
        if known is not None and list(known.filters) != (meta.filters if meta.filters is not None else [">"]):
            del self._filter_sets[bucket]  # the sidecar restarted with other filters
            self._located.clear()
        if self._replica.max_age.get(bucket, 0) != meta.max_age_ns:
            self._replica.max_age[bucket] = meta.max_age_ns  # locations carry it: make them anew
            self._located.clear()
        fresh, age_ms = meta_fresh(meta, self.max_stale_ms, time.time_ns())
        if not fresh:
            self._stale[bucket] = StaleReplica(
                f"bucket '{bucket}' replica is stale: synced={int(meta.synced)}, "
                f"last confirmed {age_ms:.0f} ms ago (max_stale_ms={self.max_stale_ms})")
            return
        self._stale.pop(bucket, None)
        self._fresh_until[bucket] = now + FRESHNESS_TTL_S

    def _txn_get(self, dbname: bytes, key: bytes) -> bytes | None:
        for _ in range(2):
            try:
                db = self._replica.db_ro(dbname)
                if db is None:
                    return None
                with self.env.begin(db=db, buffers=False) as txn:
                    return txn.get(key)
            except lmdb.MapResizedError:
                self.env.set_mapsize(0)  # the writer grew the map: adopt its size
        raise ReplicaError("replica map resized repeatedly; try again")


class _Witness:
    """The sidecar's word on one bucket as this process sees it (kvcache.store.verdict.Witness):
    fresh as the meta record last said (LocalReader._refresh, against the reader's own
    max_stale_ms), and no key held: holds live in the sidecar's memory."""

    __slots__ = ("bucket", "max_age_ns", "reader")

    def __init__(self, reader: LocalReader, bucket: str) -> None:
        self.reader = reader
        self.bucket = bucket
        self.max_age_ns = reader._replica.max_age.get(bucket, 0)

    def fresh_within(self, max_stale_ms: int) -> bool:
        return self.bucket not in self.reader._stale

    def held_until(self, key: str | None, revision: int | None = None) -> int:
        return 0
