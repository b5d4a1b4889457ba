"""lmdb_walk (ext/lmdb_walk.pxd), the GET path's own search of LMDB's B+tree, against the
reference: py-lmdb's get on the same files. Generated trees of every shape the replica can
hold (random keys and lengths, empty values, values on overflow pages, deletes that merge
pages, several databases, trees four levels deep), looked up with present keys, absent
ones and their neighbours in key order (prefixes, extensions); every answer must be the
reference's and none may fall back to mdb_get."""
from __future__ import annotations

import tempfile

import lmdb
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcache.native import native_or_none

server_get = native_or_none("server_get")
pytestmark = pytest.mark.skipif(server_get is None, reason="kvcache._native.server_get is not built")

GROUP = 32  # lmdb_walk.GROUP: lookups are searched this many at a time


def build(path: str, dbs: dict[bytes, dict[bytes, bytes]], deletes: dict[bytes, list[bytes]] | None = None) -> dict:
    """Write the databases, delete some keys in a later transaction, close; the stats of each."""
    env = lmdb.open(path, max_dbs=len(dbs) + 1, map_size=1 << 30, subdir=True)
    stats = {}
    try:
        handles = {name: env.open_db(name) for name in dbs}
        with env.begin(write=True) as txn:
            for name, items in dbs.items():
                for k, v in items.items():
                    txn.put(k, v, db=handles[name])
        if deletes:
            with env.begin(write=True) as txn:
                for name, keys in deletes.items():
                    for k in keys:
                        txn.delete(k, db=handles[name])
        with env.begin() as txn:
            for name in dbs:
                stats[name] = txn.stat(handles[name])
    finally:
        env.close()
    return stats


def reference(path: str, name: bytes, keys: list[bytes]) -> list[bytes | None]:
    env = lmdb.open(path, max_dbs=16, readonly=True, lock=False, subdir=True)
    try:
        db = env.open_db(name, create=False)
        with env.begin(db=db) as txn:
            return [txn.get(k) for k in keys]
    finally:
        env.close()


def probes(keys: list[bytes], extra: list[bytes]) -> list[bytes]:
    """Present keys, then what sorts right next to them: each one's prefix and extension."""
    out = list(keys) + list(extra)
    for k in keys[:50]:
        out += [k[:-1] or b"\x00", k + b"\x00", k + b"\xff"]
    return out


def check(path: str, name: bytes, lookups: list[bytes]) -> None:
    got, fallbacks = server_get.search(path, name, lookups, 16)
    assert got == reference(path, name, lookups)
    assert fallbacks == 0


keys_st = st.binary(min_size=1, max_size=511)
values_st = st.one_of(st.binary(max_size=200), st.binary(min_size=1500, max_size=9000))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(items=st.dictionaries(keys_st, values_st, max_size=400), extra=st.lists(keys_st, max_size=40),
       delete_share=st.floats(0, 1))
def test_generated_trees_match_mdb_get(items, extra, delete_share):
    keys = sorted(items)
    gone = keys[: int(len(keys) * delete_share)]
    with tempfile.TemporaryDirectory() as d:
        build(d, {b"b": items}, {b"b": gone})
        check(d, b"b", probes(keys, extra))


@pytest.mark.parametrize("n,klen,vlen,depth", [(200_000, 12, 100, 3), (30_000, 400, 8, 4), (3_000, 20, 3000, 2)])
def test_big_trees_match_mdb_get(tmp_path, n, klen, vlen, depth):
    """A 200k-key tree of the benchmark's shape; long keys (four levels); overflow values."""
    items = {f"{i:0{klen}d}".encode(): (b"%d|" % i) * (vlen // 4 + 1) for i in range(n)}
    stats = build(str(tmp_path), {b"b": items}, {b"b": [f"{i:0{klen}d}".encode() for i in range(0, n, 7)]})
    assert stats[b"b"]["depth"] >= depth
    step = max(1, n // 5000)
    lookups = [f"{i:0{klen}d}".encode() for i in range(0, n + 50, step)]
    check(str(tmp_path), b"b", lookups)


def test_four_levels_deep(tmp_path):
    items = {(b"%09d" % i) * 50: b"v" for i in range(30_000)}  # 450-byte keys: few to a page
    stats = build(str(tmp_path), {b"b": items})
    assert stats[b"b"]["depth"] >= 4
    check(str(tmp_path), b"b", [*sorted(items)[::37], b"0" * 450, b"9" * 451])


def test_several_databases_and_an_empty_one(tmp_path):
    dbs = {b"a": {b"k%d" % i: b"a%d" % i for i in range(2_000)},
           b"b": {b"k%d" % i: b"b%d" % i for i in range(0, 4_000, 2)},
           b"empty": {}}
    build(str(tmp_path), dbs, {b"a": [b"k%d" % i for i in range(2_000)][::2]})
    lookups = [b"k%d" % i for i in range(0, 4_100, 3)]
    for name in dbs:
        check(str(tmp_path), name, lookups)


def test_groups_of_every_size(tmp_path):
    """One GROUP and a part of one, each lookup among others at every position."""
    items = {b"%06d" % i: b"%d" % i for i in range(5_000)}
    build(str(tmp_path), {b"b": items})
    for n in (1, 2, GROUP - 1, GROUP, GROUP + 1, 3 * GROUP + 5):
        lookups = [b"%06d" % (i * 97 % 5_500) for i in range(n)]
        check(str(tmp_path), b"b", lookups)
