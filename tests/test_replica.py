"""The LMDB replica, in process, on temporary directories."""
from __future__ import annotations

import os

import lmdb
import pytest

from kvcache.entry import Operation
from kvcache.errors import ReplicaError
from kvcache.store.record import MAX_LMDB_KEY, item
from kvcache.store.replica import (
    FORMAT_KEY,
    FORMAT_VERSION,
    LONG_KEY_PREFIX,
    META_DB,
    BucketMeta,
    Replica,
    lmdb_key,
)

PUT, DEL, PURGE = Operation.PUT, Operation.DEL, Operation.PURGE
MiB = 1 << 20


@pytest.fixture
def replica(tmp_path):
    r = Replica(str(tmp_path / "replica"), map_size=16 * MiB)
    try:
        yield r
    finally:
        r.close()


def op(rev: int, key: str, value: bytes | None = None, operation: Operation = PUT, created: int = 0):
    """A delivery as the feed hands it over: (LMDB key, record), or (LMDB key, None) for a delete."""
    value = (value if value is not None else b"") if operation is PUT else None
    return item(key.encode(), value, rev, created or 1_700_000_000_000_000_000 + rev)


def meta_at(seq: int, **kw) -> BucketMeta:
    return BucketMeta(stream="KV_b", applied_seq=seq, synced=True, **kw)


def test_records_round_trip(replica):
    values = {
        "empty": b"",
        "text": b"hello",
        "binary": b"\r\n\x00\xff$3\r\nGET\r\n*2\r\n",
        "big": os.urandom(512 * 1024),
    }
    ops = [op(i + 1, k, v, created=1_700_000_000_123_456_789 + i) for i, (k, v) in enumerate(values.items())]
    replica.apply_items("b", ops, meta_at(len(ops)))
    for i, (key, value) in enumerate(values.items()):
        rec = replica.get("b", key)
        assert rec is not None
        assert (rec.key, rec.value, rec.revision, rec.created) == (key, value, i + 1, 1_700_000_000_123_456_789 + i)
    assert replica.get("b", "missing") is None
    assert replica.get("other", "text") is None  # a bucket never written
    assert replica.count("b") == 4
    with replica.read_txn() as txn:
        assert replica.get_raw(txn, replica.db("b"), "binary") == values["binary"]


def test_apply_with_separate_puts_and_deletes(replica):
    replica.apply("b", [("a", b"1", 1, 10), ("b", b"2", 2, 20)], [], meta_at(2))
    replica.apply("b", [("c", b"3", 4, 40)], ["a"], meta_at(4))
    assert replica.get("b", "a") is None
    assert (replica.get("b", "b").value, replica.get("b", "c").revision) == (b"2", 4)
    assert replica.meta("b").applied_seq == 4


def test_operations_apply_in_stream_order(replica):
    replica.apply_items("b", [op(1, "k", b"v1"), op(2, "k", operation=DEL), op(3, "k", b"v3"),
                            op(4, "gone", b"x"), op(5, "gone", operation=PURGE)], meta_at(5))
    assert replica.get("b", "k").value == b"v3"
    assert replica.get("b", "gone") is None
    replica.apply_items("b", [op(6, "k", operation=DEL), op(7, "never-there", operation=DEL)], meta_at(7))
    assert replica.get("b", "k") is None
    assert replica.count("b") == 0


def test_long_keys_stored_under_a_digest(replica):
    long_key = "long." + ".".join(["segment-0123456789"] * 40)  # ~760 bytes
    edge = "e" * MAX_LMDB_KEY  # the longest key stored as itself
    assert len(long_key.encode()) > MAX_LMDB_KEY
    replica.apply_items("b", [op(1, long_key, b"L"), op(2, edge, b"E"), op(3, "short", b"S")], meta_at(3))

    lkey = lmdb_key(long_key)
    assert lkey.startswith(LONG_KEY_PREFIX) and len(lkey) < MAX_LMDB_KEY
    assert lmdb_key(edge) == edge.encode()
    rec = replica.get("b", long_key)
    assert (rec.key, rec.value, rec.revision) == (long_key, b"L", 1)
    assert replica.get("b", edge).value == b"E"
    assert sorted(k for _, k in replica.iter_keys("b")) == sorted([long_key, edge, "short"])
    assert replica.revision("b", lkey) == 1

    # Long keys are deleted by their full text too.
    replica.apply_items("b", [op(4, long_key, operation=DEL)], meta_at(4))
    assert replica.get("b", long_key) is None
    assert sorted(k for _, k in replica.iter_keys("b")) == sorted([edge, "short"])


def test_iter_keys_pages_and_delete_lkeys(replica):
    keys = [f"k.{i:03d}" for i in range(25)]
    replica.apply_items("b", [op(i + 1, k, b"v") for i, k in enumerate(keys)], meta_at(25))
    first = list(replica.iter_keys("b", limit=10))
    rest = list(replica.iter_keys("b", after=first[-1][0]))
    assert [k for _, k in first + rest] == keys
    assert replica.delete_lkeys("b", [lmdb_key("k.000"), lmdb_key("k.001"), b"absent"]) == 2
    assert replica.count("b") == 23


def test_older_than_pages_through_every_key(replica):
    """The live expiry pass: keys whose revision is below a sequence, a page at a time."""
    keys = [f"k.{i:03d}" for i in range(25)]
    replica.apply_items("b", [op(i + 1, k, b"v") for i, k in enumerate(keys)], meta_at(25))
    found, after, pages = [], None, 0
    while True:
        page, after = replica.older_than("b", 13, after, limit=4)
        found += page
        pages += 1
        if after is None:
            break
    assert found == [lmdb_key(k) for k in keys[:12]] and pages == 7   # revisions 1..12
    assert replica.older_than("b", 1) == ([], None) and replica.older_than("absent", 99) == ([], None)


def test_apply_writes_data_and_position_in_one_transaction(tmp_path):
    r = Replica(str(tmp_path / "replica"), map_size=MiB, max_map_size=4 * MiB)
    try:
        r.apply_items("b", [op(i + 1, f"k{i}", b"v" * 100) for i in range(100)], meta_at(100))
        # One read transaction sees the data and the position that describes it.
        with r.env.begin() as txn:
            meta = BucketMeta.decode(txn.get(b"b", db=r.db_ro(META_DB)))
            top = max(int.from_bytes(v[:8], "little") for _, v in txn.cursor(db=r.db("b")))
        assert meta.applied_seq == top == 100

        # A batch that cannot be written leaves neither its data nor its position behind.
        too_big = [op(101, "huge", os.urandom(3 * MiB)), op(102, "huge2", os.urandom(3 * MiB))]
        with pytest.raises(ReplicaError):
            r.apply_items("b", too_big, meta_at(102))
        assert r.meta("b").applied_seq == 100
        assert r.get("b", "huge") is None and r.get("b", "huge2") is None
        assert r.count("b") == 100
    finally:
        r.close()


def test_map_grows_when_full(tmp_path):
    r = Replica(str(tmp_path / "replica"), map_size=MiB)
    try:
        assert r.map_size() == MiB
        value = os.urandom(256 * 1024)
        seq = 0
        for _batch in range(10):  # 80 x 256 KiB = 20 MiB
            ops = []
            for _ in range(8):
                seq += 1
                ops.append(op(seq, f"k.{seq:03d}", value))
            r.apply_items("b", ops, meta_at(seq))
        assert r.map_size() >= 20 * MiB
        assert r.count("b") == 80
        assert r.get("b", "k.001").value == value and r.get("b", "k.080").value == value
        assert r.meta("b").applied_seq == 80
        # Every write path grows the map, not only apply: metadata and deletes too.
        r.put_meta("b", meta_at(81))
        assert r.delete_lkeys("b", [lmdb_key(f"k.{i:03d}") for i in range(1, 41)]) == 40
    finally:
        r.close()


def test_max_map_size_reached_is_a_clear_error_and_the_replica_stays_readable(tmp_path):
    r = Replica(str(tmp_path / "replica"), map_size=MiB, max_map_size=4 * MiB)
    try:
        value = os.urandom(128 * 1024)
        written = 0
        with pytest.raises(ReplicaError) as err:
            for i in range(1, 200):
                r.apply_items("b", [op(i, f"k.{i:03d}", value)], meta_at(i))
                written = i
        assert "max_map_size_mb=4" in str(err.value) and "full" in str(err.value)
        assert 10 < written < 40
        assert r.map_size() == 4 * MiB
        # Still readable, and consistent with the last batch that made it.
        assert r.count("b") == written
        assert r.meta("b").applied_seq == written
        assert r.get("b", "k.001").value == value
        assert r.get("b", f"k.{written:03d}").value == value
    finally:
        r.close()
    # ...also after reopening, by a read-only user.
    ro = Replica(str(tmp_path / "replica"), readonly=True)
    try:
        assert ro.count("b") == written
        assert ro.get("b", "k.002").value == value
    finally:
        ro.close()


def test_meta_round_trip_and_unknown_fields(replica):
    m = BucketMeta(stream="KV_b", stream_created="2024-01-01T00:00:00Z", applied_seq=42,
                   synced=True, fresh_at_ns=1, last_update_ns=2, resyncs=3)
    replica.put_meta("b", m)
    assert replica.meta("b") == m
    assert replica.meta("never") == BucketMeta()
    # A newer writer may add fields; an older reader ignores them.
    assert BucketMeta.decode(b'{"applied_seq":7,"from_the_future":1}').applied_seq == 7


@pytest.mark.servers  # starts a process
def test_format_version_mismatch_wipes_the_replica(tmp_path):
    path = str(tmp_path / "replica")
    r = Replica(path, map_size=4 * MiB)
    r.apply_items("b", [op(1, "k", b"v")], meta_at(1))
    r.set_buckets(["b"])
    r.close()

    # Same version: kept.
    r = Replica(path, map_size=4 * MiB)
    assert r.get("b", "k").value == b"v"
    r.close()

    # Another version: dropped on open, and the current version written.
    env = lmdb.open(path, max_dbs=8)
    with env.begin(write=True, db=env.open_db(META_DB)) as txn:
        txn.put(FORMAT_KEY, b"0")
    env.close()
    r = Replica(path, map_size=4 * MiB)
    try:
        assert r.get("b", "k") is None
        assert r.count("b") == 0
        assert r.meta("b") == BucketMeta()
        with r.env.begin(db=r.db_ro(META_DB)) as txn:
            assert txn.get(FORMAT_KEY) == str(FORMAT_VERSION).encode()
        # ...and it is writable again at once.
        r.apply_items("b", [op(1, "k2", b"v2")], meta_at(1))
        assert r.get("b", "k2").value == b"v2"
    finally:
        r.close()



def _truncate(data: str) -> None:
    os.truncate(data, os.path.getsize(data) // 3)


def _bad_header(data: str) -> None:
    with open(data, "r+b") as f:
        f.write(b"\xa5" * 8192)  # both meta pages


def _zeroed_pages(data: str) -> None:
    size = os.path.getsize(data)
    with open(data, "r+b") as f:
        f.seek(size // 4)
        f.write(bytes(size // 2))


@pytest.mark.servers  # starts a process
@pytest.mark.parametrize("damage", [_truncate, _bad_header, _zeroed_pages])
def test_damaged_replica_is_deleted_and_recreated(tmp_path, damage, caplog):
    """Without the check, a truncated file was a SIGBUS at the first read, a bad header
    stopped the sidecar at every start (MDB_INVALID), zeroed pages failed the feed's every
    write (MDB_CORRUPTED)."""
    path = str(tmp_path / "replica")
    r = Replica(path, map_size=16 * MiB)
    r.apply_items("b", [op(i + 1, f"k.{i:05d}", b"v" * 100) for i in range(3000)], meta_at(3000))
    r.close()
    damage(os.path.join(path, "data.mdb"))
    r = Replica(path, map_size=16 * MiB)
    try:
        assert r.count("b") == 0 and r.meta("b") == BucketMeta()
        r.apply_items("b", [op(1, "k", b"v")], meta_at(1))
        assert r.get("b", "k").value == b"v"
    finally:
        r.close()
    assert "is damaged" in caplog.text


@pytest.mark.servers  # starts a process
def test_intact_replica_is_kept(tmp_path, caplog):
    path = str(tmp_path / "replica")
    r = Replica(path, map_size=16 * MiB)
    r.apply_items("b", [op(i + 1, f"k.{i:05d}", b"v" * 100) for i in range(3000)], meta_at(3000))
    r.close()
    r = Replica(path, map_size=16 * MiB)
    try:
        assert r.count("b") == 3000 and r.meta("b").applied_seq == 3000
    finally:
        r.close()
    assert "is damaged" not in caplog.text


@pytest.mark.servers  # starts a process
def test_an_error_that_is_not_damage_keeps_the_files(tmp_path):
    """Only proof of damage costs the replica: an environment LMDB cannot open for another
    reason (here data.mdb is a directory) is reported, and nothing is deleted."""
    path = tmp_path / "replica"
    (path / "data.mdb").mkdir(parents=True)
    (path / "data.mdb" / "keep").write_bytes(b"x")
    with pytest.raises(ReplicaError, match="Is a directory"):
        Replica(str(path), map_size=16 * MiB)
    assert (path / "data.mdb" / "keep").exists()


def test_expiry_index_sweeps_only_what_is_due(replica):
    """Records with a deadline (Nats-TTL, or max_age from their creation) are filed in the
    expiry index; the sweep reads only due entries, removes expired records, drops entries of
    records replaced since, and files a record again when max_age moved its deadline."""
    s = 1_000_000_000
    t = 1_800_000_000 * s
    long_key = b"long." + b"k" * 600
    replica.apply_items("b", [item(b"a", b"1", 1, t, 10 * s), item(b"b", b"2", 2, t, 20 * s),
                              item(long_key, b"3", 3, t, 10 * s), item(b"never", b"4", 4, t, -1),
                              item(b"plain", b"5", 5, t)], BucketMeta())
    assert replica.next_due("b") == t + 10 * s
    replica.apply_items("b", [item(b"a", b"6", 6, t)], BucketMeta())  # replaced: no TTL now
    assert replica.sweep_expired("b", t + 9 * s) == (0, False)
    assert replica.sweep_expired("b", t + 15 * s) == (1, False)  # the long key; `a` was replaced
    assert {k for _, k in replica.iter_keys("b")} == {"a", "b", "never", "plain"}
    assert replica.next_due("b") == t + 20 * s
    replica.max_age["b"] = 30 * s  # every record but `never`'s now also ends at t + 30 s
    replica.apply_items("b", [item(b"c", b"7", 7, t)], BucketMeta())
    assert replica.sweep_expired("b", t + 25 * s, limit=1) == (1, True)  # `b`; c's entry is next
    assert replica.sweep_expired("b", t + 25 * s) == (0, False)          # c's is at t + 30 s
    assert replica.sweep_expired("b", t + 31 * s) == (1, False)          # c
    # `a` and `plain` were filed before max_age existed: reads hide them (max_age applies at
    # read time), a later sweep does not see them; `never` escapes max_age
    assert {k for _, k in replica.iter_keys("b")} == {"a", "never", "plain"}
    assert replica.expired("b", replica.env.begin().get(b"plain", db=replica.db("b")), t + 31 * s)
    assert not replica.expired("b", replica.env.begin().get(b"never", db=replica.db("b")), t + 31 * s)
    # filing them anew (what the feed does when max_age changes) lets the sweep take them
    after = replica.refile("b", None, limit=2)
    while after is not None:
        after = replica.refile("b", after, limit=2)
    assert replica.sweep_expired("b", t + 31 * s) == (2, False)
    assert {k for _, k in replica.iter_keys("b")} == {"never"}


def test_iter_matching_reads_only_what_a_filter_can_match(replica):
    long_key = "a.b." + "k" * 600
    keys = ["a.b.c", "a.b.d", "a.bb.c", "a.c", "b.b.c", long_key, "a"]
    replica.apply_items("m", [item(k.encode(), b"v", i + 1, 1) for i, k in enumerate(keys)], BucketMeta())

    def match(p):
        return sorted(k for _, k in replica.iter_matching("m", p))
    assert match("a.b.c") == ["a.b.c"] and match("a.b.zz") == []
    assert match("a.b.*") == sorted(["a.b.c", "a.b.d", long_key])
    assert match("a.>") == sorted(["a.b.c", "a.b.d", "a.bb.c", "a.c", long_key])
    assert match("*.b.c") == ["a.b.c", "b.b.c"]
    assert match(">") == sorted(keys)
