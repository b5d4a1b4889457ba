"""Replica reads against raw py-lmdb, in one process (the target: LocalReader ≥ 0.8× raw py-lmdb).

    python -m pytest bench/test_bench_replica.py -p no:cacheprovider --benchmark-columns=min,median,ops

A replica of 10,000 keys (100-byte values) is written with Replica.apply, then read 10,000
times per round by: raw py-lmdb with one transaction per get and with one reused transaction
(the baseline), Replica.get, and LocalReader.get / .entry. Every reader uses the same LMDB
environment (py-lmdb allows one per path per process).
"""
from __future__ import annotations

import os
import time

import pytest

from kvcache import LocalReader
from kvcache.store.replica import BucketMeta, Replica, lmdb_key

N = 10_000
KEYS = [f"user.{i:05d}" for i in range(N)]
VALUE = b"x" * 100


@pytest.fixture(scope="module")
def reader(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("replica-bench")
    writer = Replica(os.path.join(data_dir, "replica"))
    meta = BucketMeta(stream="KV_b", applied_seq=N, synced=True, fresh_at_ns=time.time_ns())
    writer.apply("b", [(k, b"x" * 100, i + 1, time.time_ns()) for i, k in enumerate(KEYS)], [], meta)
    writer.set_buckets(["b"])
    writer.close()
    r = LocalReader(str(data_dir), max_stale_ms=10**9)
    yield r
    r.close()


def _db(reader):
    return reader._replica.db("b")


def test_raw_lmdb_txn_per_get(benchmark, reader):
    env, db, lkeys = reader.env, _db(reader), [lmdb_key(k) for k in KEYS]

    def run():
        found = 0
        for k in lkeys:
            with env.begin(db=db) as txn:
                found += txn.get(k) is not None
        return found
    assert benchmark(run) == N  # every key read, not a loop over misses


def test_raw_lmdb_txn_per_get_bare(benchmark, reader):
    """The cheapest transaction-per-get py-lmdb allows: no context manager (the transaction
    is aborted when dropped)."""
    begin, db, lkeys = reader.env.begin, _db(reader), [lmdb_key(k) for k in KEYS]

    def run():
        found = 0
        for k in lkeys:
            found += begin(db=db).get(k) is not None
        return found
    assert benchmark(run) == N


def test_raw_lmdb_reused_txn(benchmark, reader):
    env, db, lkeys = reader.env, _db(reader), [lmdb_key(k) for k in KEYS]

    def run():
        found = 0
        with env.begin(db=db) as txn:
            get = txn.get
            for k in lkeys:
                found += get(k) is not None
        return found
    assert benchmark(run) == N


def test_replica_get(benchmark, reader):
    rep = reader._replica

    def run():
        return sum(rep.get("b", k) is not None for k in KEYS)
    assert benchmark(run) == N


def test_app_reader_get(benchmark, reader):
    get = reader.get
    assert get(KEYS[0]) == b"x" * 100

    def run():
        return sum(get(k) == VALUE for k in KEYS)
    assert benchmark(run) == N


def test_app_reader_entry(benchmark, reader):
    entry = reader.entry

    def run():
        return sum(entry(k).value == VALUE for k in KEYS)
    assert benchmark(run) == N
