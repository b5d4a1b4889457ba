"""A bucket's stream tail (kvcache.serve.stream_tail) against the revision index it caches:
after every batch of a generated history, the tail's answer for every ID it covers is the
index's own (same entries, same bytes), with COUNT and the reply budget; trimming keeps it
exact; an entry past its deadline makes it step aside."""
from __future__ import annotations

import random
import time

from test_revindex import deliver
from test_revindex import replica as replica  # the fixture

from kvcache import resp
from kvcache.serve import stream_tail
from kvcache.serve.stream_tail import Tail
from kvcache.serve.streams import _encode
from kvcache.store import revindex
from kvcache.store.record import item
from kvcache.store.replica import BucketMeta

U64 = (1 << 64) - 1


def from_index(rep, after: int, count: int | None, budget: int | None) -> tuple[bytes, int]:
    rdb = rep.revs_ro("b")
    out, size = [], 0
    with rep.env.begin(buffers=True) as txn:
        for e in revindex.entries(txn, rep.db("b"), rdb, after + 1, U64, count, False, time.time_ns(), 0):
            out.append(_encode(e))
            size += len(e.key) + len(e.value or b"")
            if budget is not None and size >= budget:
                break
    return resp.array(out), len(out)


def extend(rep, tail: Tail) -> None:
    with rep.env.begin(buffers=True) as txn:
        tail.extend(revindex.entries(txn, rep.db("b"), rep.revs_ro("b"), tail.top + 1, U64, None, False,
                                     time.time_ns(), 0))


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


