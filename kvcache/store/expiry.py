"""A bucket's expiry index (`x:<bucket>`): `deadline u64 BE | lkey or its digest` -> lkey, one
entry per record with a deadline (record.deadline: its own `Nats-TTL`, or the bucket's
max_age), so that the sweep removes what has expired by reading only what is due, never the
whole bucket. The index is cleaned lazily: an entry whose record was since replaced is dropped
when it comes due.

Why a module of its own: the index's layout and the work done over it inside a transaction
(filing, refiling, sweeping), apart from kvcache.store.replica, which holds the database
handles and runs the write transactions (Replica.refile, next_due, sweep_expired).
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable

import lmdb

from .lmdbenv import as_bytes
from .record import MAX_LMDB_KEY, Item, deadline, decode_key, has_ttl
from .revindex import Index

DUE = struct.Struct(">Q")  # the expiry index's key prefix: big-endian, so LMDB orders by time


def index_name(bucket: str) -> bytes:
    """The name of `bucket`'s expiry index database."""
    return b"x:" + bucket.encode()


def due_key(due: int, lkey: bytes) -> bytes:
    """An expiry index key: the deadline, then the LMDB key (its digest when the two would
    pass LMDB's key size), so that entries are unique and ordered by time."""
    return DUE.pack(due) + (lkey if len(lkey) <= MAX_LMDB_KEY - DUE.size else hashlib.sha256(lkey).digest())


def due_entries(items: Iterable[Item], max_age: int) -> list[tuple[bytes, bytes]]:
    """Expiry index entries for the records among `items` that have a deadline (`max_age`:
    the bucket's, in ns, 0 for none)."""
    out = []
    for lk, rec in items:
        if rec is not None and (max_age or has_ttl(rec)):
            due = deadline(rec, max_age)
            if due:
                out.append((due_key(due, lk), lk))
    return out


def refile(txn: lmdb.Transaction, db: lmdb._Database, index: lmdb._Database, max_age: int,
           after: bytes | None, limit: int) -> bytes | None:
    """In a write transaction: file up to `limit` records of `db` after `after` in `index`
    under their deadline with `max_age`; where the next page starts, None at the end."""
    cur = txn.cursor(db=db)
    ok = cur.set_range(after) if after is not None else cur.first()
    if ok and after is not None and cur.key() == after:
        ok = cur.next()
    batch: list[Item] = []
    last = None
    while ok and len(batch) < limit:
        last = as_bytes(cur.key())
        batch.append((last, as_bytes(cur.value())))
        ok = cur.next()
    due = due_entries(batch, max_age)
    if due:
        txn.cursor(db=index).putmulti(due)
    return last if ok else None


def first_due(txn: lmdb.Transaction, index: lmdb._Database) -> int | None:
    """The earliest deadline filed in `index` (ns), None when it is empty."""
    cur = txn.cursor(db=index)
    return DUE.unpack_from(cur.key())[0] if cur.first() else None


def sweep(txn: lmdb.Transaction, db: lmdb._Database, index: lmdb._Database, max_age: int,
          now_ns: int, limit: int, removed_keys: list[str] | None = None,
          revs: Index | None = None) -> tuple[int, bool]:
    """In a write transaction: remove the records of `db` whose deadline has passed by
    `now_ns`, reading at most `limit` due entries of `index`: (records removed, whether more
    entries are due). `revs`: the bucket's revision index, whose entries of the removed
    records go with them. See Replica.sweep_expired."""
    cur = txn.cursor(db=index)
    removed = seen = 0
    again: list[tuple[bytes, bytes]] = []
    ok = cur.first()
    while ok and seen < limit:
        if DUE.unpack_from(cur.key())[0] > now_ns:
            return removed, False
        lk = as_bytes(cur.value())
        raw = as_bytes(txn.get(lk, db=db))
        if raw is not None:
            due = deadline(raw, max_age)
            if due and due <= now_ns:
                if revs is not None:
                    revs.remove([lk])
                else:
                    txn.delete(lk, db=db)
                removed += 1
                if removed_keys is not None:
                    removed_keys.append(decode_key(lk, raw))
            elif due:
                again.append((due_key(due, lk), lk))
        seen += 1
        ok = cur.delete() and bool(cur.key())
    for k, v in again:
        txn.put(k, v, db=index)
    return removed, ok
