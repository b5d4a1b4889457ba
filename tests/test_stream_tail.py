"""A bucket's stream tail (kvcache.serve.stream_tail) against the revision index it caches:
after every batch of a generated history, the tail's answer for every ID it covers is the
index's own (same entries, same bytes), with COUNT and the reply budget; trimming keeps it
exact; an entry past its deadline makes it step aside. A filtered stream's tail
answers as the index walked with its filter, and walks each revision once, matched or not."""
from __future__ import annotations

import random
import time

from test_revindex import deliver
from test_revindex import replica as replica  # the fixture

from kvcache import resp
from kvcache.serve import stream_tail
from kvcache.serve.stream_tail import Tail
from kvcache.serve.streams import _encode, _matcher
from kvcache.store import revindex
from kvcache.store.record import item
from kvcache.store.replica import BucketMeta

U64 = (1 << 64) - 1


def from_index(rep, after: int, count: int | None, budget: int | None, match=None) -> tuple[bytes, int]:
    rdb = rep.revs_ro("b")
    out, size = [], 0
    with rep.env.begin(buffers=True) as txn:
        for e in revindex.entries(txn, rep.db("b"), rdb, after + 1, U64, count, False, time.time_ns(), 0,
                                  match):
            out.append(_encode(e))
            size += len(e.key) + len(e.value or b"")
            if budget is not None and size >= budget:
                break
    return resp.array(out), len(out)


def extend(rep, tail: Tail) -> None:
    """As Streams._extend: the index from the tail's top, with its filter, up to its last revision."""
    rdb = rep.revs_ro("b")
    with rep.env.begin(buffers=True) as txn:
        upto = revindex.bounds(txn, rdb)[1]
        tail.extend(revindex.entries(txn, rep.db("b"), rdb, tail.top + 1, upto, None, False,
                                     time.time_ns(), 0, tail.match), upto)


def test_the_tail_answers_as_the_index(replica, monkeypatch):
    monkeypatch.setattr(stream_tail, "MAX_ENTRIES", 64)  # trims happen within the history
    rng = random.Random(7)
    keys = [b"k%d" % i for i in range(30)]
    deliver(replica, [(1, b"k0", "PUT", b"x")], 1)
    tail = Tail(1, _encode)
    seq = 1
    for _ in range(40):
        part = []
        for _ in range(rng.randint(1, 12)):
            seq += 1
            op = rng.choices(["PUT", "DEL"], [5, 1])[0]
            part.append((seq, rng.choice(keys), op, b"v" * rng.randint(0, 40) if op == "PUT" else None))
        deliver(replica, part, seq)
        extend(replica, tail)
        for after in range(tail.start, seq + 1):
            for count, budget in ((None, 1 << 30), (3, 1 << 30), (None, 50)):
                got = tail.answer(after, count, budget, time.time_ns())
                if got is None:
                    continue  # COUNT among blanked entries: the caller reads the index
                data, n, _ = got
                want, wn = from_index(replica, after, count, budget)
                assert n == wn, (after, count, budget)
                if n:
                    assert data == want, (after, count, budget)
    assert tail.start > 1  # it was trimmed


def test_an_entry_past_its_deadline_makes_the_tail_step_aside(replica):
    now = time.time_ns()
    replica.apply_items("b", [item(b"t", b"x", 1, now, ttl_ns=10**9)],
                        BucketMeta(stream="KV_b", applied_seq=1, synced=True))
    tail = Tail(0, _encode)
    extend(replica, tail)
    assert tail.answer(0, None, 1 << 20, now)[1] == 1
    assert tail.answer(0, None, 1 << 20, now + 2 * 10**9) is None


def test_a_filtered_tail_answers_as_the_filtered_index(replica, monkeypatch):
    """`feature.*` over a bucket mostly of other keys: after every batch the tail's answer
    for every ID it covers is the index's walked with the filter, and its top is the batch's
    last revision even when nothing in the batch matched (the next walk starts after it)."""
    monkeypatch.setattr(stream_tail, "MAX_ENTRIES", 16)
    match = _matcher("feature.*")
    rng = random.Random(39)
    keys = [b"feature.%d" % i for i in range(4)] + [b"feature.0.x", b"other.%d" % 0] + \
        [b"k%d" % i for i in range(40)]
    deliver(replica, [(1, b"k0", "PUT", b"x")], 1)
    tail = Tail(1, _encode, match)
    seq = 1
    walked: list[int] = []
    real = revindex.entries

    def counting(txn, db, rdb, first, *rest):
        walked.append(first)
        return real(txn, db, rdb, first, *rest)
    monkeypatch.setattr(revindex, "entries", counting)
    for _ in range(60):
        part = []
        for _ in range(rng.randint(1, 8)):
            seq += 1
            op = rng.choices(["PUT", "DEL", "PURGE"], [6, 2, 1])[0]
            part.append((seq, rng.choice(keys), op, b"v" * rng.randint(0, 20) if op == "PUT" else None))
        deliver(replica, part, seq)
        before = tail.top
        extend(replica, tail)
        assert walked[-1] == before + 1  # only what the batch added
        assert tail.top == seq
        for after in range(tail.start, seq + 1):
            for count in (None, 2):
                got = tail.answer(after, count, 1 << 30, time.time_ns())
                if got is None:
                    continue
                data, n, _ = got
                want, wn = from_index(replica, after, count, None, match)
                assert n == wn, (after, count)
                if n:
                    assert data == want, (after, count)
    assert tail.start > 1  # it was trimmed
