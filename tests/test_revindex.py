"""The revision index (kvcache.store.revindex) kept by the replica with its records, on a real
LMDB in a temporary directory: one entry per key at its latest revision, deletes and purges
as entries while their markers last, and removals (sweeps, expiry, a full sync's leftovers)
leaving none. Checked against a model: the latest message per key of the deliveries."""
from __future__ import annotations

import random
import time

import pytest

from kvcache.natsio.natsproto import MARK_DEL, MARK_PURGE
from kvcache.store import revindex
from kvcache.store.record import MAX_LMDB_KEY, item, lkey_of
from kvcache.store.replica import BucketMeta, Replica

MiB = 1 << 20
T0 = 1_700_000_000_000_000_000


@pytest.fixture
def replica(tmp_path):
    r = Replica(str(tmp_path / "replica"), map_size=64 * MiB)
    try:
        yield r
    finally:
        r.close()


def listing(replica: Replica, bucket: str = "b", first: int = 0, last: int = (1 << 64) - 1,
            count: int | None = None, reverse: bool = False) -> list[tuple[int, bytes, str, bytes | None]]:
    rdb = replica.revs_ro(bucket)
    with replica.env.begin() as txn:
        return [(e.revision, bytes(e.key), e.op, None if e.value is None else bytes(e.value))
                for e in revindex.entries(txn, replica.db(bucket), rdb, first, last, count, reverse,
                                          time.time_ns(), replica.max_age.get(bucket, 0))]


def deliver(replica: Replica, msgs: list[tuple[int, bytes, str, bytes | None]], applied: int,
            fresh: bool = False) -> None:
    """Apply messages (seq, key, op, value) the way the feed does: items and delete marks."""
    items, marks = [], []
    for seq, key, op, value in msgs:
        if op == "PUT":
            items.append(item(key, value, seq, T0 + seq))
        else:
            items.append((lkey_of(key), None))
            marks.append((key, seq, MARK_DEL if op == "DEL" else MARK_PURGE, T0 + seq))
    replica.apply_items("b", items, BucketMeta(stream="KV_b", applied_seq=applied, synced=True), marks=marks,
                        fresh=fresh)


def model(msgs) -> list[tuple[int, bytes, str, bytes | None]]:
    latest: dict[bytes, tuple] = {}
    for seq, key, op, value in msgs:
        latest[key] = (seq, key, op, value if op == "PUT" else None)
    return sorted(latest.values())


def test_one_entry_per_key_at_its_latest_revision(replica):
    msgs = [(1, b"a", "PUT", b"1"), (2, b"b", "PUT", b"2"), (3, b"a", "PUT", b"3"),
            (4, b"b", "DEL", None), (5, b"c", "PUT", b"5"), (6, b"c", "PURGE", None),
            (7, b"b", "PUT", b"7"), (8, b"d", "DEL", None)]
    deliver(replica, msgs[:3], 3)
    deliver(replica, msgs[3:], 8)
    assert listing(replica) == model(msgs) == [
        (3, b"a", "PUT", b"3"), (6, b"c", "PURGE", None), (7, b"b", "PUT", b"7"), (8, b"d", "DEL", None)]
    assert listing(replica, first=7) == model(msgs)[2:]
    assert listing(replica, reverse=True, count=2) == model(msgs)[::-1][:2]
    assert listing(replica, first=4, last=6) == [(6, b"c", "PURGE", None)]
    assert replica.max_removed("b") == 5  # c's put, when its purge came


def test_generated_histories_match_the_model(replica):
    rng = random.Random(30)
    keys = [b"k%d" % i for i in range(40)] + [b"long." + b"x" * MAX_LMDB_KEY]
    msgs = []
    seq = 0
    for batch in range(60):
        part = []
        for _ in range(rng.randint(1, 25)):
            seq += 1
            op = rng.choices(["PUT", "DEL", "PURGE"], [8, 1, 1])[0]
            part.append((seq, rng.choice(keys), op, b"v%d" % seq if op == "PUT" else None))
        msgs += part
        deliver(replica, part, seq)
        if batch % 10 == 9:
            assert listing(replica) == model(msgs)
            cut = rng.randint(0, seq)
            assert listing(replica, first=cut + 1) == [e for e in model(msgs) if e[0] > cut]


def test_a_first_syncs_batches_take_the_fast_path_and_stay_exact(replica):
    """fresh=True (the bucket was empty when the sync began): batches of new keys go in two
    putmulti calls; a key written again (in the batch, or stored by an earlier one) falls
    back per key; a batch with a delete takes the general path. Same index as the model."""
    msgs = [(1, b"a", "PUT", b"1"), (2, b"b", "PUT", b"2"), (3, b"c", "PUT", b"3")]
    deliver(replica, msgs, 3, fresh=True)
    more = [(4, b"d", "PUT", b"4"), (5, b"a", "PUT", b"5"), (6, b"d", "PUT", b"6")]  # a stored, d twice
    deliver(replica, more, 6, fresh=True)
    last = [(7, b"e", "PUT", b"7"), (8, b"b", "DEL", None)]
    deliver(replica, last, 8, fresh=True)
    assert listing(replica) == model(msgs + more + last)
    assert [replica.get("b", k).value for k in ("a", "c", "d", "e")] == [b"5", b"3", b"6", b"7"]


def test_removals_take_their_entries(replica):
    deliver(replica, [(1, b"a", "PUT", b"1"), (2, b"b", "PUT", b"2"), (3, b"c", "DEL", None),
                      (4, b"d", "DEL", None)], 4)
    assert replica.delete_lkeys("b", [b"a", b"c"]) == 1  # a's record; c's marker goes too
    assert [e[1] for e in listing(replica)] == [b"b", b"d"]
    assert replica.drop_tombstones("b", keep={b"b"}) == 1  # d's marker: not in a full sync's listing
    assert [e[1] for e in listing(replica)] == [b"b"]
    deliver(replica, [(5, b"d", "PUT", b"5")], 5)  # a put after a dropped tombstone
    assert listing(replica) == [(2, b"b", "PUT", b"2"), (5, b"d", "PUT", b"5")]


def test_expired_records_and_markers_read_as_absent(replica):
    replica.max_age["b"] = 10**9  # one second
    now = time.time_ns()
    items = [item(b"old", b"x", 1, now - 5 * 10**9), item(b"new", b"y", 2, now)]
    replica.apply_items("b", items, BucketMeta(stream="KV_b", applied_seq=2, synced=True))
    replica.apply_items("b", [(b"gone", None)], BucketMeta(stream="KV_b", applied_seq=3, synced=True),
                        marks=[(b"gone", 3, MARK_DEL, now - 5 * 10**9)])
    assert [e[1] for e in listing(replica)] == [b"new"]
    removed, _ = replica.sweep_expired("b", time.time_ns())
    assert removed == 1
    with replica.env.begin() as txn:
        assert revindex.length(txn, replica.revs_ro("b")) == 2  # new, and the marker (read as absent)


def test_markers_leave_when_the_stream_drops_them(replica):
    deliver(replica, [(1, b"a", "PUT", b"1"), (2, b"b", "DEL", None), (3, b"c.x", "PURGE", None),
                      (4, b"d", "DEL", None), (5, b"e", "PUT", b"5"), (6, b"f", "DEL", None)], 6)
    assert replica.drop_markers_below("b", 3) == 1  # the stream now starts at 3: b's marker is gone
    assert [e[1] for e in listing(replica)] == [b"a", b"c.x", b"d", b"e", b"f"]
    # a pass over `c.*` that saw no marker for c.x, up to sequence 5: c.x's goes, d's and f's stay
    assert replica.drop_tombstones("b", keep=set(), max_revision=5, within=["c.*"]) == 1
    assert replica.drop_tombstones("b", keep={b"d"}, max_revision=5) == 0  # f's is newer than the pass
    assert [e[1] for e in listing(replica)] == [b"a", b"d", b"e", b"f"]
    assert replica.max_removed("b") == 3
    deliver(replica, [(7, b"b", "PUT", b"7")], 7)  # a key whose tombstone went, written again
    assert [e[1] for e in listing(replica)] == [b"a", b"d", b"e", b"f", b"b"]


@pytest.mark.parametrize("old_state", ["PUT", "DEL"])
def test_a_recreated_stream_keeps_the_entry_its_new_numbering_gave_another_key(replica, old_state):
    """A stream recreated since numbers from 1 again. Resynced onto the same replica, a key
    whose old record (or marker) sat at a revision the new stream gave another key must not
    take that key's entry with it when it is replaced."""
    old = [(1, b"in.f", old_state if old_state == "PUT" else "PUT", b"old"), (2, b"x", "PUT", b"x")]
    if old_state == "DEL":
        old.append((3, b"in.f", "DEL", None))
    deliver(replica, old, len(old))
    # the new stream: in.k is its revision 1 (in.f's old one, or its marker's 3 for x's)...
    new = [(1, b"in.k", "PUT", b"k1"), (2, b"y", "PUT", b"y"), (3, b"x", "PUT", b"x3")]
    deliver(replica, new, 3)
    # ...then in.f is written again, replacing its old record or marker
    deliver(replica, [(4, b"in.f", "PUT", b"new")], 4)
    assert listing(replica) == [(1, b"in.k", "PUT", b"k1"), (2, b"y", "PUT", b"y"),
                                (3, b"x", "PUT", b"x3"), (4, b"in.f", "PUT", b"new")]
