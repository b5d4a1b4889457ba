"""In-process reads straight from the sidecar's LMDB files: no socket, no syscall per read.

The sidecar is the only writer; any number of processes may read. A reader must know whether
the replica is current, so every read checks the bucket's freshness (synced, and caught up
within `max_stale_ms` as the sidecar last recorded it) and raises StaleReplica otherwise.
The check reads the meta record at most every FRESHNESS_TTL_S, to keep reads near raw LMDB cost.

`get` is the hot path: a key's bucket, database handle, LMDB key and value offset are worked
out once and cached (a bounded dict), so a read costs one dict lookup, one clock read, one
short read transaction and the value's copy.
"""
from __future__ import annotations

import json
import os
import time

import lmdb

from .. import native
from ..entry import Entry, Operation
from ..errors import KvcacheError, ReplicaError
from ..keys import FilterSet, glob_matcher, split_address
from ..store.record import live_value
from ..store.replica import BUCKETS_KEY, META_DB, BucketMeta, Replica, decode_record, lmdb_key, meta_fresh

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
        self._plans: dict[str, tuple] = {}  # key -> (bucket, db, lmdb key, value offset or 0)
        # The hot path: reads with a plan and a fresh bucket, else calls the method below.
        self.get = _APP_GET.LocalGet(  # type: ignore[method-assign]  # per instance, on purpose
            self._plans, self._fresh_until, self.env.begin, self._get_checked)

    def buckets(self) -> list[str]:
        """Configured buckets in the sidecar's order (the first is the default)."""
        raw = self._txn_get(META_DB, BUCKETS_KEY)
        return json.loads(raw) if raw else []

    # ------------------------------------------------------------------ reads

    def get(self, key: str) -> bytes | None:
        """The value of `key` (`bucket:key` names a bucket), None if absent; raises
        StaleReplica, and NotReplicated for a key outside its bucket's filters (None would
        say "absent" of a key the bucket may hold). Each instance replaces this with its LocalGet fast path (see
        __init__), which comes back to _get_checked whenever there is checking to do."""
        return self._get_checked(key)

    def _get_checked(self, key: str) -> bytes | None:
        plan = self._plan(key)
        if plan is None:
            return None
        raw = self._txn_get(Replica.db_name(plan[0]), plan[2])
        if raw is None:
            return None
        return live_value(raw, time.time_ns(), plan[3])

    def _plan(self, key: str) -> tuple | None:
        """Check freshness (raises StaleReplica) and work out how to read `key`; None while
        its bucket's database does not exist yet."""
        bucket, name = self._address(key)
        self._check_replicated(bucket, name)
        db = self._replica.db_ro(Replica.db_name(bucket))
        if db is None:
            return None
        lkey = lmdb_key(name)
        plan = (bucket, db, lkey, self._replica.max_age.get(bucket, 0))
        if len(self._plans) >= PLAN_CACHE:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def entry(self, key: str) -> Entry | None:
        bucket, name = self._address(key)
        self._check_replicated(bucket, name)
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
        bucket, name, named = split_address(key, self.default_bucket)
        if not named:
            bucket = self._require_default()
        self._check_fresh(bucket)
        return bucket, name

    def replicates(self, key: str) -> bool:
        """Is `key` (`bucket:key` names a bucket) inside its bucket's filters, so that the
        replica's answer, a value or None, is the bucket's? No freshness check."""
        bucket, name, _ = split_address(key, self.default_bucket)
        return self._filters(bucket or self._require_default()).match(name)

    def _check_replicated(self, bucket: str, name: str) -> None:
        filters = self._filters(bucket)
        if not filters.match(name):
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
        now = time.monotonic()
        if self._fresh_until.get(bucket, 0.0) > now:
            return
        meta = self.meta(bucket)
        if not meta.stream:
            raise ReplicaError(f"bucket '{bucket}' is not replicated here")
        known = self._filter_sets.get(bucket)
        if known is not None and list(known.filters) != (meta.filters if meta.filters is not None else [">"]):
            del self._filter_sets[bucket]  # the sidecar restarted with other filters
            self._plans.clear()
        if self._replica.max_age.get(bucket, 0) != meta.max_age_ns:
            self._replica.max_age[bucket] = meta.max_age_ns  # plans carry it: make them anew
            self._plans.clear()
        fresh, age_ms = meta_fresh(meta, self.max_stale_ms, time.time_ns())
        if not fresh:
            raise StaleReplica(
                f"bucket '{bucket}' replica is stale: synced={int(meta.synced)}, "
                f"last confirmed {age_ms:.0f} ms ago (max_stale_ms={self.max_stale_ms})")
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
