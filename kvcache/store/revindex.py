"""A bucket's revision index: its keys in revision order, one entry per key at its latest
revision, so that the bucket reads as a Redis stream (`@<bucket>`, kvcache.serve.streams) and
"what changed after revision N" is one range scan, as a NATS watch resumed from N delivers it.

Two databases per bucket, written in the replica's transactions together with the records
they index (Replica.apply_items, the sweeps), so the index never disagrees with the records:

- `r:<bucket>`: `revision u64 BE` -> the entry. A put's entry is `P` + its LMDB key: the record
  under that key holds the value, creation time and full key. A delete's or purge's is `D` or
  `U` + `created u64 LE` + the key's bytes: its marker is still in the stream (a NATS watch
  delivers it), but no record is left to ask.
- `t:<bucket>`: LMDB key -> `revision u64 BE`, for deleted keys only: where a later put of the
  key, or its removal, finds the marker's entry (a put finds its predecessor's revision in the
  record it replaces).

Big-endian revisions make LMDB keep the entries in revision order. Each write looks up the
key's previous revision in the same B-tree operation that writes the record (a cursor's
`replace`/`pop` returns the old value), so the index costs a put (and a delete, for a key
that had an entry) per item; what that does to a 1M-key sync is in bench/README.md.
"""
from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import lmdb

from .record import LONG_KEY_PREFIX, RECORD, Item, deadline, decode_key, expiry, lkey_of, value_offset

REV = struct.Struct(">Q")
assert RECORD.format.startswith("<Q") and REV.size == 8, "record layout changed: update Index._new_puts"
CREATED = struct.Struct("<Q")
PUT, DEL, PURGE = b"P", b"D", b"U"
# the meta database's key of a bucket's highest removed revision (no bucket name has a ':')
REMOVED_PREFIX = b"removed:"
OP_NAMES = {PUT[0]: "PUT", DEL[0]: "DEL", PURGE[0]: "PURGE"}
# kvcache.natsio.natsproto's MARK_DEL / MARK_PURGE -> the entry's tag
_MARK_TAG = {1: DEL, 2: PURGE}

# A delete item's mark (kvcache.natsio.natsproto.Run.marks): (key bytes, sequence, op, created ns)
Mark = tuple[bytes, int, int, int]


def put_entry(lk: bytes, revision: int) -> tuple[bytes, bytes]:
    """A put's index entry: (its revision, big-endian; `P` + its LMDB key). The feed's lane
    builds these in C as it decodes deliveries (kvcache.natsio.natsproto.Run.entries, checked
    against this at import), so a first sync writes them with no Python step per item."""
    return REV.pack(revision), PUT + lk


def _names(entry: bytes, lk: bytes) -> bool:
    """Is `entry` (an index entry) the one of the key stored under `lk`?"""
    if entry[:1] == PUT:
        return entry[1:] == lk
    return lkey_of(entry[1 + CREATED.size:]) == lk


def names(bucket: str) -> tuple[bytes, bytes]:
    """The names of the bucket's index and tombstone databases."""
    b = bucket.encode()
    return b"r:" + b, b"t:" + b


@dataclass(frozen=True, slots=True)
class StreamEntry:
    """One entry of a bucket's stream: the key at `revision`; `value` None for a delete or
    purge (`op` DEL or PURGE). `value` may be a memoryview into the map (a buffers
    transaction): use it before the transaction ends."""

    revision: int
    key: bytes
    op: str
    value: bytes | memoryview | None
    created: int
    deadline: int = 0  # when it leaves the stream (its TTL or the bucket's max_age), 0: never


class Index:
    """The write side, inside one of the replica's write transactions: `db` the records,
    `rdb`/`tdb` the index and tombstone databases of the same bucket."""

    def __init__(self, txn: lmdb.Transaction, db, rdb, tdb) -> None:
        self.txn = txn
        self.db = db
        self.records = txn.cursor(db=db)
        self.rdb = rdb
        self.tdb = tdb
        self.removed = 0  # the highest revision whose entry this transaction removed
        # Are there tombstones at all? A put then need not look for one (most buckets have
        # few deletes; a lookup per put would be the index's largest cost).
        self.tombs = txn.stat(tdb)["entries"] > 0

    def _forget(self, lk: bytes, old: bytes | memoryview | None) -> None:
        """Drop the entry of the key's previous state: its record `old`, else its tombstone.
        Only while the entry is still the key's: a stream recreated since numbers its
        revisions from 1 again, and a resync may already have given the old revision to
        another key, whose entry must stay."""
        if old is not None:
            rev = RECORD.unpack_from(old)[0]
        elif self.tombs:
            t = self.txn.pop(lk, db=self.tdb)
            if t is None:
                return
            rev = REV.unpack(t)[0]
        else:
            return
        rk = REV.pack(rev)
        entry = self.txn.get(rk, db=self.rdb)
        if entry is None or not _names(bytes(entry), lk):
            return
        self.txn.delete(rk, db=self.rdb)
        if rev > self.removed:
            self.removed = rev

    def finish(self, meta_db, bucket: str) -> None:
        """Keep the highest revision ever removed from the index (XINFO STREAM's
        max-deleted-entry-id) in the meta database, under `removed:<bucket>`."""
        if self.removed:
            key = REMOVED_PREFIX + bucket.encode()
            if self.removed > int(self.txn.get(key, b"0", db=meta_db)):
                self.txn.put(key, b"%d" % self.removed, db=meta_db)

    def apply(self, items: Sequence[Item], marks: Sequence[Mark], fresh: bool = False,
              deletes: bool = True, entries: Sequence[tuple[bytes, bytes]] | None = None) -> None:
        """Write `items` (record.item's, in stream order) to the records and the index; a
        delete item's mark is the next of `marks` whose key it is (marks are in the order of
        the delete items they belong to; a mark whose key is not among the items, one the
        caller filtered out, is skipped). `fresh`: the bucket was empty when this sync
        began, so a batch of puts is most likely all new keys (see _new_puts). `deletes=False`
        promises that no item is a delete (the feed knows it from its Runs); `entries`, the
        puts' index entries (put_entry) in order, when the caller has them already."""
        if fresh and not marks and not self.tombs and self._new_puts(items, deletes, entries):
            return
        txn, cur, rdb = self.txn, self.records, self.rdb
        tdb = self.tdb
        mi = 0
        for lk, rec in items:
            if rec is not None:
                old = cur.replace(lk, rec)
                if old is not None or self.tombs:
                    self._forget(lk, old)
                txn.put(REV.pack(RECORD.unpack_from(rec)[0]), PUT + lk, db=rdb)
                continue
            old = cur.pop(lk)
            self._forget(lk, old)
            while mi < len(marks) and lkey_of(marks[mi][0]) != lk:
                mi += 1
            if mi == len(marks):
                continue  # no mark: a removal the stream keeps no marker of
            key, seq, op, created = marks[mi]
            mi += 1
            rev = REV.pack(seq)
            txn.put(rev, _MARK_TAG.get(op, DEL) + CREATED.pack(created) + key, db=rdb)
            txn.put(lk, rev, db=tdb)
            self.tombs = True

    def _new_puts(self, items: Sequence[Item], deletes: bool = True,
                  entries: Sequence[tuple[bytes, bytes]] | None = None) -> bool:
        """A first sync's batch, written in two C loops instead of a Python step per item:
        the records with putmulti, not overwriting, and, when every one was new (no key
        twice in the batch, none already stored), their entries with another. False, having
        written nothing, when that does not hold (a delete, a key written again)."""
        if deletes and any(rec is None for _, rec in items):
            return False
        consumed, added = self.records.putmulti(items, overwrite=False)
        if added != consumed:  # some key was there already: redo those one by one
            for lk, rec in items:
                if self.txn.get(lk, db=self.db) != rec:
                    self.apply([(lk, rec)], ())
                else:
                    self.txn.put(REV.pack(RECORD.unpack_from(rec)[0]), PUT + lk, db=self.rdb)
            return True
        if entries is None or len(entries) != len(items):
            # put_entry's, from the records: the revision is their first 8 bytes, little-endian,
            # reversed (one slice instead of an unpack and a pack per item)
            entries = [(rec[7::-1], PUT + lk) for lk, rec in items]
        self.txn.cursor(db=self.rdb).putmulti(entries)
        return True

    def remove(self, lkeys: Sequence[bytes]) -> int:
        """Remove keys the stream no longer holds (a purge without markers, its limits, an
        expiry): their records and their entries, a tombstone's too. Returns records removed."""
        n = 0
        for lk in lkeys:
            old = self.records.pop(lk)
            n += old is not None
            self._forget(lk, old)
        return n

    def drop_tombstones(self, keep: set[bytes], max_revision: int | None = None,
                        within: Callable[[str], bool] | None = None) -> int:
        """Remove the tombstones (and their entries) of keys not in `keep`: the markers the
        stream no longer holds, after a pass that listed those it does (a full sync, a
        reconcile). Only markers up to `max_revision` (the pass's snapshot: a later one it
        could not have seen), of keys `within` accepts (the pass's filter), when given.
        Returns how many went."""
        gone = []
        for lk, rev in self.txn.cursor(db=self.tdb):
            if bytes(lk) in keep:
                continue
            if max_revision is not None and REV.unpack(rev)[0] > max_revision:
                continue
            if within is not None:
                raw = self.txn.get(bytes(rev), db=self.rdb)
                if raw is None or not within(bytes(raw[1 + CREATED.size:]).decode()):
                    continue
            gone.append((bytes(lk), bytes(rev)))
        for lk, rev in gone:
            self.txn.delete(lk, db=self.tdb)
            self.txn.delete(rev, db=self.rdb)
            self.removed = max(self.removed, REV.unpack(rev)[0])
        return len(gone)

    def drop_markers_below(self, first: int) -> int:
        """The stream's first sequence moved to `first`: delete and purge entries below it
        have no marker left (records below it go through `remove`). Returns how many went."""
        gone = []
        cur = self.txn.cursor(db=self.rdb)
        ok = cur.first()
        while ok:
            rev = REV.unpack(cur.key())[0]
            if rev >= first:
                break
            raw = cur.value()
            if raw[0] != PUT[0]:
                gone.append((rev, lkey_of(bytes(raw[1 + CREATED.size:]))))
            ok = cur.next()
        for rev, lk in gone:
            self.txn.delete(REV.pack(rev), db=self.rdb)
            self.txn.delete(lk, db=self.tdb)
            self.removed = max(self.removed, rev)
        return len(gone)


def entries(txn: lmdb.Transaction, db, rdb, first: int, last: int, count: int | None,
            reverse: bool, now_ns: int, max_age_ns: int,
            match: Callable[[bytes], bool] | None = None) -> Iterator[StreamEntry]:
    """The entries with revisions in [first, last], ascending (or descending), at most
    `count` (None: all). An entry whose record has expired (its own TTL or the bucket's
    max_age, record.deadline) is absent, as from every read; so is a marker past max_age.
    `match`: only entries whose key (its bytes) it accepts, a filtered stream's; asked
    before the record is read, so a key it refuses costs a step of the walk, no more."""
    if first > last or count == 0:
        return
    cur = txn.cursor(db=rdb)
    if reverse:
        ok = cur.set_range(REV.pack(last))
        if not ok:
            ok = cur.last()
        elif REV.unpack(cur.key())[0] > last:
            ok = cur.prev()
        step = cur.prev
    else:
        ok = cur.set_range(REV.pack(first))
        step = cur.next
    n = 0
    while ok:
        rev = REV.unpack(cur.key())[0]
        if rev < first or rev > last:
            break
        raw = cur.value()
        key = None
        if match is not None:
            key = _index_key(raw)  # None: a long key, asked once its record is read
            if key is not None and not match(key):
                ok = step()
                continue
        e = _entry(txn, db, rev, raw, now_ns, max_age_ns)
        if e is not None and (match is None or key is not None or match(e.key)):
            yield e
            n += 1
            if count is not None and n >= count:
                break
        ok = step()


def _index_key(raw: bytes | memoryview) -> bytes | None:
    """An index entry's key, None for a long key's put (its text rides in its record)."""
    if raw[0] == PUT[0]:
        lk = bytes(raw[1:])
        return None if lk.startswith(LONG_KEY_PREFIX) else lk
    return bytes(raw[1 + CREATED.size:])


def _entry(txn: lmdb.Transaction, db, rev: int, raw: bytes | memoryview, now_ns: int,
           max_age_ns: int) -> StreamEntry | None:
    tag = raw[0]
    if tag == PUT[0]:
        lk = bytes(raw[1:])
        rec = txn.get(lk, db=db)
        if rec is None:
            return None  # cannot happen while index and records are written together
        stored, created, _ = RECORD.unpack_from(rec)
        if stored != rev:
            return None  # nor this
        due = deadline(rec, max_age_ns)
        if due and now_ns >= due:
            return None
        start = value_offset(rec)
        # a long key's text rides in its record (record.LONG_KEY_PREFIX); a short key is its LMDB key
        key = decode_key(lk, bytes(rec[:start])).encode() if lk.startswith(LONG_KEY_PREFIX) else lk
        return StreamEntry(rev, key, "PUT", rec[start:], created, due)
    created = CREATED.unpack_from(raw, 1)[0]
    due = expiry(created, 0, max_age_ns)  # a marker has no TTL of its own: the bucket's max_age
    if due and now_ns >= due:
        return None
    return StreamEntry(rev, bytes(raw[1 + CREATED.size:]), OP_NAMES.get(tag, "DEL"), None, created, due)


def length(txn: lmdb.Transaction, rdb) -> int:
    """Entries in the index (some may have expired and not been swept yet)."""
    return txn.stat(rdb)["entries"]


def count_matching(txn: lmdb.Transaction, db, rdb, match: Callable[[bytes], bool]) -> int:
    """Entries whose key `match` accepts (a filtered stream's XLEN; as `length`, some may
    have expired and not been swept yet): a walk of the whole index, one record read per
    long key only."""
    n = 0
    for raw in txn.cursor(db=rdb).iternext(keys=False, values=True):
        key = _index_key(raw)
        if key is None:
            rec = txn.get(bytes(raw[1:]), db=db)
            if rec is None:
                continue
            key = decode_key(bytes(raw[1:]), bytes(rec)).encode()
        n += match(key)
    return n


def bounds(txn: lmdb.Transaction, rdb) -> tuple[int, int]:
    """The lowest and highest revision with an entry, (0, 0) when there is none."""
    cur = txn.cursor(db=rdb)
    if not cur.first():
        return 0, 0
    lo = REV.unpack(cur.key())[0]
    cur.last()
    return lo, REV.unpack(cur.key())[0]
