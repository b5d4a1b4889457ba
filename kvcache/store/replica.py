"""The LMDB replica: one environment, a named database per bucket plus a meta database.

Records are kvcache.store.record's: `revision u64 | created_ns u64 | flags+full_key_len u32 |
[expires_ns u64] | [full key] | value`. LMDB keys are at most 511 bytes while NATS keys may be
longer, so a long key is stored under `NUL '#' sha256(key)` (NUL never occurs in a NATS
subject) and its full text rides in the record.

Expiry: every read treats a record past its deadline (its own `Nats-TTL`, or the bucket's
max_age, see record.deadline) as absent; `max_age` (per bucket, ns) is told by the feed. Each
bucket has a second database, its expiry index (kvcache.store.expiry), written with the
records, so that `sweep_expired` removes what has expired by reading only what is due, never
the whole replica.

Opening the environment (a damaged file is deleted first), the read-only environment shared in
a process and the map's growth are kvcache.store.lmdbenv's.

Reads open and close their own short transaction and never span an `await`: a read
transaction held open pins old pages and makes the file grow under a busy writer.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import TypeVar

import lmdb

from ..errors import ReplicaError
from ..keys import subject_match
from . import expiry, revindex
from .lmdbenv import MAX_DBS, dbs_for, disk_hint, drop, grow, open_writer, release_readonly_env, shared_readonly_env
from .lmdbenv import as_bytes as _bytes
from .record import (
    LONG_KEY_PREFIX,
    RECORD,
    Item,
    Record,
    deadline,
    decode_key,
    decode_record,
    has_ttl,
    item,
    live_value,
    lmdb_key,
)

T = TypeVar("T")

log = logging.getLogger("kvcache.replica")


# 2: records carry their Nats-TTL expiry; expiry index per bucket. 3: revision index per bucket
FORMAT_VERSION = 3
META_DB = b"__meta__"
FORMAT_KEY = b"__format__"
BUCKETS_KEY = b"__buckets__"  # configured bucket names, default first (for LocalReader)


@dataclass
class BucketMeta:
    """Per-bucket position and health, written in the same transaction as the data it describes."""

    stream: str = ""
    stream_created: str = ""  # the stream's creation time: a new value means a recreated stream
    applied_seq: int = 0
    synced: bool = False
    fresh_at_ns: int = 0  # last moment the replica was known to be caught up with the stream
    last_update_ns: int = 0
    resyncs: int = 0
    max_age_ns: int = 0  # the stream's max_age, for readers in other processes (LocalReader)
    # The position covers every key of the bucket (a near cache is on): the cache's records
    # are vouched for up to it. A position of a filtered consumer says nothing about them.
    whole_bucket: bool = False
    # The bucket's `keys` filters, for readers in other processes (LocalReader tells a key
    # outside them from an absent one). None: written by a version that did not record them.
    filters: list[str] | None = None
    # The revision index (kvcache.store.revindex) is exact for changes after this revision:
    # the stream's first sequence - 1 when the last full sync began. What the stream dropped
    # before that (a delete's marker, a purge) may have left no entry: a reader resuming from
    # below it must start again from 0 (kvcache.serve.streams).
    horizon: int = 0

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes | None) -> BucketMeta:
        if not raw:
            return cls()
        data = json.loads(raw)
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


def meta_fresh(meta: BucketMeta, max_stale_ms: int, now_ns: int) -> tuple[bool, float]:
    """For a reader of the replica's files (no feed in its process): the replica may answer
    when synced and confirmed current by the sidecar within `max_stale_ms`: (ok, age in ms)."""
    age_ms = (now_ns - meta.fresh_at_ns) / 1e6
    return bool(meta.synced) and age_ms <= max_stale_ms, age_ms


class Replica:
    """Owner of the LMDB environment. One writer (the sidecar); any number of readers."""

    def __init__(self, path: str, map_size: int = 1 << 30, max_map_size: int = 1 << 40,
                 readonly: bool = False, buckets: int = 0) -> None:
        self.path = path
        self.max_dbs = MAX_DBS if readonly else dbs_for(buckets)
        self.readonly = readonly
        self.max_map_size = max_map_size
        # Every named database is opened once per process: a second open of the same name in
        # a read-only environment yields an unusable handle in py-lmdb.
        self._dbs: dict[bytes, object] = {}
        # bucket -> its stream's max_age in ns (0: none), applied at every read; see record.deadline
        self.max_age: dict[str, int] = {}
        try:
            if readonly:
                self.env = shared_readonly_env(path)
            else:  # a damaged file is deleted first (lmdbenv.open_writer)
                self.env, self.max_dbs = open_writer(path, map_size, self.max_dbs)
        except lmdb.Error as e:
            raise ReplicaError(f"cannot open replica at {path}: {e}") from None
        if readonly:
            self._meta = self.db_ro(META_DB)
            return
        try:
            self._meta = self._open_rw(META_DB)
            self._check_format()
        except lmdb.Error as e:
            # Damage the check's walk over the keys did not reach (seen: a scribbled page
            # failing the first get with MDB_BAD_TXN): dropped as open_writer drops what the
            # check finds.
            self.env.close()
            self._dbs.clear()
            drop(path, e)
            try:
                self.env, self.max_dbs = open_writer(path, map_size, self.max_dbs)
            except lmdb.Error as e2:
                raise ReplicaError(f"cannot open replica at {path}: {e2}") from None
            self._meta = self._open_rw(META_DB)
            self._check_format()

    def _open_rw(self, name: bytes):
        db = self._dbs.get(name)
        if db is None:
            db = self._dbs[name] = self.env.open_db(name)
        return db

    def _open_ro(self, name: bytes):
        # Without txn=: py-lmdb then opens the handle in a transaction of its own that
        # outlives the call; a handle opened inside a caller's `with begin()` is unusable.
        try:
            return self.env.open_db(name, create=False)
        except lmdb.NotFoundError:
            return None

    def _check_format(self) -> None:
        """A replica written by another format version is dropped and rebuilt from NATS."""
        with self.env.begin(db=self._meta) as txn:
            fmt = txn.get(FORMAT_KEY)
        if fmt is not None and fmt != str(FORMAT_VERSION).encode():
            log.warning("replica at %s is in format %s, this kvcache writes %d: dropping it, it "
                        "will be rebuilt from NATS", self.path, fmt.decode(errors="replace"),
                        FORMAT_VERSION)
            self.wipe()
        self.write("format", lambda txn: txn.put(FORMAT_KEY, str(FORMAT_VERSION).encode(), db=self._meta))

    def wipe(self) -> None:
        """Drop every bucket and all meta (the format marker too)."""
        def write(txn: lmdb.Transaction) -> None:
            names = [bytes(k) for k, _ in txn.cursor()]
            for name in names:
                if not name.startswith((b"kv:", b"x:", b"n:", b"r:", b"t:")):
                    continue
                txn.drop(self.env.open_db(name, txn=txn), delete=True)
            txn.drop(self._meta, delete=False)

        self.write("wipe", write)
        self._dbs = {META_DB: self._meta}

    def db_ro(self, name: bytes):
        """A named database's handle for readers; None until the writer has created it."""
        db = self._dbs.get(name)
        if db is None:
            db = self._open_ro(name)
            if db is not None:
                self._dbs[name] = db
        return db

    def set_buckets(self, names: list[str]) -> None:
        raw = json.dumps(names).encode()
        self.write("meta", lambda txn: txn.put(BUCKETS_KEY, raw, db=self._meta))

    @staticmethod
    def db_name(bucket: str) -> bytes:
        return b"kv:" + bucket.encode()

    def db(self, bucket: str):
        name = self.db_name(bucket)
        return self.db_ro(name) if self.readonly else self._open_rw(name)

    def _index(self, bucket: str):
        """The bucket's expiry index (writer only)."""
        return self._open_rw(expiry.index_name(bucket))

    def _revs(self, bucket: str) -> tuple[lmdb._Database, lmdb._Database]:
        """The bucket's revision index and tombstones (kvcache.store.revindex; writer only)."""
        r, t = revindex.names(bucket)
        return self._open_rw(r), self._open_rw(t)

    def revs_ro(self, bucket: str):
        """The bucket's revision index handle for readers; None until the writer made it."""
        return self.db_ro(revindex.names(bucket)[0])

    # ------------------------------------------------------------------ lent to the near cache

    @staticmethod
    def cache_db_name(bucket: str) -> bytes:
        """The name of the bucket's near-cache database (`n:<bucket>`)."""
        return b"n:" + bucket.encode()

    def cache_db(self, bucket: str):
        """The handle of the bucket's near-cache database (writer only), lent with `env` and
        `write` to kvcache.store.nearcache, which owns what is stored in it."""
        return self._open_rw(self.cache_db_name(bucket))

    # ------------------------------------------------------------------ reads

    def get(self, bucket: str, key: str) -> Record | None:
        db = self.db(bucket)
        if db is None:
            return None
        lkey = lmdb_key(key)
        with self.env.begin(db=db, buffers=False) as txn:
            raw = txn.get(lkey)
        if raw is None or self.expired(bucket, raw):
            return None
        return decode_record(lkey, raw)

    def changes_of(self, bucket: str, items: Sequence[Item]) -> list[tuple[str, str]]:
        """What applying `items` (in order) changes, as kvcache.feed.changes names it: (key, `set`)
        for a record whose revision the replica does not hold, (key, `del`) for a delete of a
        key it holds. Read before the batch is written (a deleted long key's text is only in
        its record). Only asked while something listens (ChangeHub.active)."""
        db = self.db(bucket)
        if db is None:
            return []
        out: list[tuple[str, str]] = []
        now: dict[bytes, bytes | None] = {}  # the batch's own earlier items win over the replica
        with self.env.begin(db=db, buffers=False) as txn:
            for lk, rec in items:
                old = now[lk] if lk in now else txn.get(lk)
                now[lk] = rec
                if rec is not None:
                    if old is None or old[:8] != rec[:8]:
                        out.append((decode_key(lk, rec), "set"))
                elif old is not None:
                    out.append((decode_key(lk, old), "del"))
        return out

    def keys_of(self, bucket: str, lkeys: Iterable[bytes]) -> list[tuple[bytes, str]]:
        """(lkey, full key) of those of `lkeys` the replica holds (before removing them)."""
        db = self.db(bucket)
        out = []
        with self.env.begin(db=db, buffers=False) as txn:
            for lk in lkeys:
                raw = txn.get(lk)
                if raw is not None:
                    out.append((lk, decode_key(lk, raw)))
        return out

    def expired(self, bucket: str, raw: bytes | memoryview, now_ns: int = 0) -> bool:
        """Has this record of `bucket` passed its deadline (record.deadline)?"""
        max_age = self.max_age.get(bucket, 0)
        if not has_ttl(raw) and not max_age:
            return False
        due = deadline(raw, max_age)
        return bool(due) and (now_ns or time.time_ns()) >= due

    def get_raw(self, txn: lmdb.Transaction, db, key: str, bucket: str = "") -> bytes | None:
        """Value only, inside the caller's read transaction (the server's batched path)."""
        raw = _bytes(txn.get(lmdb_key(key), db=db))
        if raw is None:
            return None
        return live_value(raw, time.time_ns(), self.max_age.get(bucket, 0))

    def read_txn(self) -> lmdb.Transaction:
        return self.env.begin(buffers=False)

    def usage(self) -> tuple[int, int]:
        """(map size, bytes in use): the map's pages up to the last one written (freed pages
        inside it are reused before the map grows)."""
        info = self.env.info()
        return info["map_size"], (info["last_pgno"] + 1) * self.env.stat()["psize"]

    def count(self, bucket: str) -> int:
        db = self.db(bucket)
        if db is None:
            return 0
        with self.env.begin(db=db) as txn:
            return txn.stat(db)["entries"]

    def counts(self, buckets: Iterable[str]) -> dict[str, int]:
        """count() of many buckets in one read transaction (a scrape of 1,000 buckets)."""
        out: dict[str, int] = {}
        with self.env.begin() as txn:
            for bucket in buckets:
                db = self.db(bucket)
                out[bucket] = 0 if db is None else txn.stat(db)["entries"]
        return out

    def iter_keys(self, bucket: str, after: bytes | None = None, limit: int | None = None,
                  live: bool = False, start: bytes | None = None) -> Iterator[tuple[bytes, str]]:
        """(lmdb key, full key) in LMDB order, starting after `after` (or at the first key
        not below `start`); one transaction. `live`: leave out expired records (they still
        count towards `limit`, so a SCAN page stays bounded)."""
        db = self.db(bucket)
        if db is None:
            return
        n = 0
        now = time.time_ns()
        with self.env.begin(db=db, buffers=False) as txn:
            cur = txn.cursor()
            if after is not None:
                ok = cur.set_range(after)
                if ok and cur.key() == after:
                    ok = cur.next()
            else:
                ok = cur.set_range(start) if start else cur.first()
            while ok:
                lkey = cur.key()
                if not live or not self.expired(bucket, cur.value(), now):
                    yield lkey, decode_key(lkey, cur.value()) if lkey.startswith(LONG_KEY_PREFIX) else lkey.decode()
                n += 1
                if limit is not None and n >= limit:
                    return
                ok = cur.next()

    def iter_matching(self, bucket: str, pattern: str) -> Iterator[tuple[bytes, str]]:
        """(lmdb key, key) of the records whose key matches the subject filter `pattern`: a
        literal is one lookup; a wildcard lists the keys from its literal prefix on (LMDB keeps
        them in order) and the long keys (stored under digests), not the whole database."""
        if not any(t in ("*", ">") for t in pattern.split(".")):
            lkey = lmdb_key(pattern)
            if self.revision(bucket, lkey):
                yield lkey, pattern
            return
        literal = []
        for token in pattern.split("."):
            if token in ("*", ">"):
                break
            literal.append(token)
        prefix = ".".join(literal).encode() + (b"." if literal else b"")
        for start in ((prefix, LONG_KEY_PREFIX) if prefix else (b"",)):
            for lkey, key in self.iter_keys(bucket, after=None, start=start):
                if not lkey.startswith(start):
                    break
                if subject_match(pattern, key):
                    yield lkey, key

    def older_than(self, bucket: str, seq: int, after: bytes | None = None,
                   limit: int = 10_000) -> tuple[list[bytes], bytes | None]:
        """LMDB keys (among `limit` after `after`) whose record's revision is below `seq`,
        and where the next page starts (None at the end): one read transaction a page."""
        db = self.db(bucket)
        if db is None:
            return [], None
        found: list[bytes] = []
        last = None
        n = 0
        with self.env.begin(db=db, buffers=True) as txn:
            cur = txn.cursor()
            ok = cur.set_range(after) if after is not None else cur.first()
            if ok and after is not None and bytes(cur.key()) == after:
                ok = cur.next()
            while ok and n < limit:
                last = bytes(cur.key())
                if RECORD.unpack_from(cur.value())[0] < seq:
                    found.append(last)
                n += 1
                ok = cur.next()
        return found, (last if ok else None)

    def revision(self, bucket: str, lkey: bytes) -> int:
        """The revision stored under an LMDB key, 0 if absent."""
        db = self.db(bucket)
        if db is None:
            return 0
        with self.env.begin(db=db) as txn:
            raw = txn.get(lkey)
        return RECORD.unpack_from(raw)[0] if raw else 0

    def meta(self, bucket: str) -> BucketMeta:
        if self._meta is None:
            return BucketMeta()
        with self.env.begin(db=self._meta) as txn:
            return BucketMeta.decode(txn.get(bucket.encode()))

    # ------------------------------------------------------------------ writes

    def write(self, what: str, fn: Callable[[lmdb.Transaction], T]) -> T:
        """Run `fn` in one write transaction, growing the map (and retrying) when it is full."""
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    return fn(txn)
            except lmdb.MapFullError:
                grow(self.env, self.max_map_size, what)
            except lmdb.Error as e:
                raise ReplicaError(f"replica write failed ({what}): {e}{disk_hint(self.path)}") from None

    def apply(self, bucket: str, puts: Iterable[tuple[str, bytes, int, int]],
              deletes: Iterable[str], meta: BucketMeta) -> None:
        """Apply one batch and its position in a single transaction, growing the map if full.

        `puts` is (key, value, revision, created_ns); deletes are keys. Deletes are applied
        after puts, so a key should appear in at most one of them. (The feed applies what it
        is delivered with apply_items; this is the same for callers holding plain values.)
        """
        items = [item(key.encode(), value, revision, created) for key, value, revision, created in puts]
        items += [(lmdb_key(key), None) for key in deletes]
        self.apply_items(bucket, items, meta)

    def apply_items(self, bucket: str, items: Sequence[Item], meta: BucketMeta,
                    deletes: bool = True, deadlines: bool = True,
                    marks: Sequence[revindex.Mark] = (), revisions: bool = True, fresh: bool = False,
                    entries: Sequence[tuple[bytes, bytes]] | None = None) -> None:
        """Apply delivered items (see record.item) in stream order, and the position, in a
        single transaction. `deletes=False` promises that no item is a delete, so the whole
        batch goes to LMDB in one putmulti call; `deadlines=False`, that no record has a
        deadline (a stream with neither max_age nor per-message TTLs): no expiry filing.
        `revisions`: keep the bucket's revision index (kvcache.store.revindex) with the
        records; `marks`, the delete items' (kvcache.natsio.natsproto.Run.marks): a delete
        without one leaves no entry, as a removal the stream keeps no marker of. `fresh`:
        the bucket was empty when this full sync began; `entries`, the puts' index entries
        when the caller has them (both: revindex.Index.apply)."""
        db = self.db(bucket)
        meta_key, meta_raw = bucket.encode(), meta.encode()
        due = expiry.due_entries(items, self.max_age.get(bucket, 0)) if deadlines else None
        index = self._index(bucket) if due else None  # opened outside: that takes a write txn
        revs = self._revs(bucket) if revisions else None

        def write(txn: lmdb.Transaction) -> None:
            cur = txn.cursor(db=db)
            if due:
                txn.cursor(db=index).putmulti(due)
            if revs is not None:
                idx = revindex.Index(txn, db, *revs)
                idx.apply(items, marks, fresh, deletes, entries)
                idx.finish(self._meta, bucket)
            elif not deletes:
                cur.putmulti(items)
            else:
                run: list[Item] = []
                for lk, rec in items:
                    if rec is not None:
                        run.append((lk, rec))
                        continue
                    if run:
                        cur.putmulti(run)
                        run = []
                    txn.delete(lk, db=db)
                if run:
                    cur.putmulti(run)
            txn.put(meta_key, meta_raw, db=self._meta)

        self.write(f"bucket {bucket}", write)

    def refile(self, bucket: str, after: bytes | None = None, limit: int = 2_000) -> bytes | None:
        """File up to `limit` records after `after` in the expiry index under their deadline
        now (after max_age changed: records filed before, or never, are due at other times);
        returns where the next page starts, None at the end."""
        db, index = self.db(bucket), self._index(bucket)
        max_age = self.max_age.get(bucket, 0)
        return self.write(f"bucket {bucket} expiry",
                          lambda txn: expiry.refile(txn, db, index, max_age, after, limit))

    def next_due(self, bucket: str) -> int | None:
        """The earliest deadline in the bucket's expiry index (ns), None when it is empty."""
        index = self._index(bucket)
        with self.env.begin(db=index) as txn:
            return expiry.first_due(txn, index)

    def sweep_expired(self, bucket: str, now_ns: int, limit: int = 2_000,
                      removed_keys: list[str] | None = None) -> tuple[int, bool]:
        """Remove the records of `bucket` whose deadline has passed, looking only at the
        expiry index entries due by `now_ns` (at most `limit` of them): (records removed,
        whether more entries are due). An entry whose record was replaced since, or whose
        deadline moved (a new max_age), is dropped or filed again under the new deadline.
        `removed_keys`: the removed records' keys are appended to it."""
        db, index = self.db(bucket), self._index(bucket)
        max_age = self.max_age.get(bucket, 0)
        return self._indexed(bucket, lambda idx: expiry.sweep(idx.txn, db, index, max_age, now_ns, limit,
                                                              removed_keys, idx), " expiry")

    def delete_lkeys(self, bucket: str, lkeys: Iterable[bytes]) -> int:
        """Remove keys the stream no longer holds, with their revision index entries."""
        lkeys = list(lkeys)
        return self._indexed(bucket, lambda idx: idx.remove(lkeys))

    def max_removed(self, bucket: str) -> int:
        """The highest revision ever removed from the bucket's revision index (0: none)."""
        with self.env.begin(db=self._meta) as txn:
            return int(txn.get(revindex.REMOVED_PREFIX + bucket.encode(), b"0"))

    def drop_tombstones(self, bucket: str, keep: set[bytes], max_revision: int | None = None,
                        within: list[str] | None = None) -> int:
        """After a pass listing what the stream holds (a full sync, a reconcile): the
        revision index's deletes of keys it did not deliver (their markers are gone from the
        stream) go too; only up to `max_revision`, only keys matching `within` (patterns)
        when given (revindex.Index.drop_tombstones)."""
        match = None if within is None else (lambda key: any(subject_match(p, key) for p in within))
        return self._indexed(bucket, lambda idx: idx.drop_tombstones(keep, max_revision, match))

    def drop_markers_below(self, bucket: str, first: int) -> int:
        """The stream's first sequence is `first`: deletes and purges below it in the
        revision index have no marker left (revindex.Index.drop_markers_below)."""
        return self._indexed(bucket, lambda idx: idx.drop_markers_below(first))

    def _indexed(self, bucket: str, fn: Callable[[revindex.Index], T], what: str = "") -> T:
        """`fn` on the bucket's records and revision index in one write transaction, the
        highest revision it removed kept for XINFO (revindex.Index.finish)."""
        db, revs = self.db(bucket), self._revs(bucket)

        def write(txn: lmdb.Transaction) -> T:
            idx = revindex.Index(txn, db, *revs)
            out = fn(idx)
            idx.finish(self._meta, bucket)
            return out

        return self.write(f"bucket {bucket}{what}", write)

    def put_meta(self, bucket: str, meta: BucketMeta) -> None:
        raw = meta.encode()
        self.write("meta", lambda txn: txn.put(bucket.encode(), raw, db=self._meta))

    def clear_bucket(self, bucket: str) -> None:
        db, index, (rdb, tdb) = self.db(bucket), self._index(bucket), self._revs(bucket)

        def write(txn: lmdb.Transaction) -> None:
            for d in (db, index, rdb, tdb):
                txn.drop(d, delete=False)

        self.write(f"bucket {bucket}", write)

    def map_size(self) -> int:
        return self.env.info()["map_size"]

    def sync(self) -> None:
        self.env.sync(True)

    def close(self) -> None:
        if self.readonly:
            release_readonly_env(self.path)
            return
        try:
            self.env.sync(True)
        except lmdb.Error:
            pass
        self.env.close()


def now_ns() -> int:
    return time.time_ns()
