"""A replica its feed cannot write, in process: a Feed over a real LMDB replica whose map may
not grow (LMDB's MapFullError past max_map_size_mb: the same state as a full disk, which
tests/test_disk_full.py makes live), batches handed to it as the consumer hands them, and a
clock the test sets. No NATS, no process: the quick tier.

What must hold: deliveries received but not written leave the replica as old as the last time
it applied everything it received, however often a retry receives the stream's end (the
feed once counted that as caught up before writing, so each retry made a full replica fresh
again); the lag grows; one log line as it begins and one once the backlog is applied."""
from __future__ import annotations

import asyncio
import logging

import pytest

from kvcache.config import BucketConfig
from kvcache.errors import ReplicaError
from kvcache.feed import unwritable as unwritable_mod
from kvcache.feed.feed import Feed
from kvcache.natsio.natsproto import Run
from kvcache.ops.health import BucketState, readiness
from kvcache.store.record import item
from kvcache.store.replica import Replica
from kvcache.store.revindex import put_entry

S = 1_000_000_000
MS = 1_000_000
T = 1_000 * S  # the test's clock
BOUND_MS = 2000
MAP = 1 << 20  # the replica's map, which may not grow: 1 MiB
BIG = b"x" * 10_000


class Clock:
    def __init__(self) -> None:
        self.now = T

    def __call__(self) -> int:
        return self.now

    def advance(self, ms: int) -> None:
        self.now += ms * MS


def run(first_seq: int, values: list[tuple[str, bytes]], cseq: int, pending: int = 0) -> Run:
    """The consumer's delivery of `values` at stream sequences from `first_seq`, `pending`
    left on the server after it (0: the stream's end)."""
    r = Run(1, cseq)
    for i, (key, value) in enumerate(values):
        lk, rec = item(key.encode(), value, first_seq + i, T)
        r.items.append((lk, rec))
        r.entries.append(put_entry(lk, first_seq + i))
    r.last_cseq = cseq + len(values) - 1
    r.top_sseq = first_seq + len(values) - 1
    r.last_ts = T
    r.last_pending = pending
    return r


@pytest.fixture
def feed(tmp_path):
    replica = Replica(str(tmp_path / "replica"), map_size=MAP, max_map_size=MAP)
    f = Feed(None, BucketConfig(name="b", max_stale_ms=BOUND_MS), replica)  # type: ignore[arg-type]
    clock = Clock()
    f.freshness.clock = f.unwritable.clock = clock
    f.clock = clock  # type: ignore[attr-defined]  # the test's handle on it
    yield f
    replica.close()


def ready(f: Feed) -> bool:
    return readiness([BucketState("b", f.synced, f.lag_ms(), BOUND_MS, f.unwritable_ms())], True, False)[0]


def test_received_but_not_written_is_not_fresh_past_the_bound(feed, caplog):
    caplog.set_level(logging.DEBUG, "kvcache.feed")
    clock = feed.clock
    feed._on_batch([run(1, [("probe", b"old")], cseq=1)])
    assert feed.fresh_within(BOUND_MS) and feed.lag_ms() == 0 and ready(feed)

    # `probe` changes behind more than the map holds; each retry receives the stream's end.
    backlog = [(f"big.{i}", BIG) for i in range(150)] + [("probe", b"new")]
    lags = []
    for attempt in range(4):
        clock.advance(1500)
        with pytest.raises(ReplicaError, match="map is full"):
            feed._on_batch([run(2, backlog, cseq=1)])
        lags.append(feed.lag_ms())
        assert feed.meta.applied_seq == 1
        assert feed.fresh_within(BOUND_MS) is (attempt == 0), (attempt, lags)
        assert ready(feed) is (attempt == 0)
    assert lags == [1500, 3000, 4500, 6000]
    assert feed.unwritable_ms() == 4500
    assert "not written for 4.5s" in readiness(
        [BucketState("b", True, feed.lag_ms(), BOUND_MS, feed.unwritable_ms())], True, False)[1]

    # Room again (the map may grow): the backlog is written, the replica is current.
    feed.replica.max_map_size = 64 * MAP
    clock.advance(500)
    feed._on_batch([run(2, backlog, cseq=1)])
    assert feed.meta.applied_seq == 152 and feed.replica.revision("b", b"probe") == 152
    assert feed.fresh_within(BOUND_MS) and feed.lag_ms() == 0 and ready(feed)
    assert feed.unwritable_ms() == 0
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert sum("cannot write the replica" in m for m in lines) == 1, lines
    assert sum("replica written again" in m for m in lines) == 1, lines


def test_a_batch_that_is_not_the_streams_end_leaves_the_age_where_it_was(feed):
    """Partly written backlog (a retry writes a small first batch, then fails): still as old
    as the last time everything received was applied, not as the newest message written."""
    clock = feed.clock
    feed._on_batch([run(1, [("a", b"1")], cseq=1)])
    clock.advance(1500)
    with pytest.raises(ReplicaError):
        feed._on_batch([run(2, [(f"big.{i}", BIG) for i in range(150)], cseq=1)])
    feed.replica.max_map_size = 64 * MAP
    clock.advance(1000)
    feed._on_batch([run(2, [("c", b"3")], cseq=1, pending=149)])  # written, more to come
    assert feed.meta.applied_seq == 2
    assert not feed.fresh_within(BOUND_MS) and feed.lag_ms() == 2500


def test_a_touch_that_cannot_be_written_leaves_a_current_replica_current(feed, monkeypatch):
    """Caught up and idle: only the meta's touch (fresh_at_ns, for LocalReader) is written,
    and it fails. The replica holds everything received: it stays fresh, and the consumer is
    not ended for it (which made a current replica count as stale at every retry)."""
    clock = feed.clock
    feed._on_batch([run(1, [("a", b"1")], cseq=1)])

    def full(*args, **kwargs):
        raise ReplicaError("replica write failed (meta): No space left on device")
    monkeypatch.setattr(feed.replica, "put_meta", full)
    for _ in range(3):
        clock.advance(1500)
        feed._on_idle(1)
    assert feed.fresh_within(BOUND_MS) and feed.lag_ms() == 0
    assert feed.unwritable.tries == 3 and feed.unwritable_ms() == 3000
    monkeypatch.undo()
    clock.advance(1500)
    feed._on_idle(1)
    assert feed.unwritable_ms() == 0


def test_a_plan_that_cannot_be_written_is_made_again_later(feed, monkeypatch):
    """A retry's plan (resume after the applied sequence) is written before the consumer is
    made; that write failing ended the feed task, and with it the process."""
    feed._on_batch([run(1, [("a", b"1")], cseq=1)])
    feed.meta.stream, feed.meta.stream_created = "KV_b", "c"  # as start() leaves it
    info = {"config": {}, "state": {"first_seq": 1, "last_seq": 5}, "created": "c"}

    async def stream_info():
        return info
    monkeypatch.setattr(feed, "_stream_info", stream_info)

    def full(*args, **kwargs):
        raise ReplicaError("replica write failed (meta): No space left on device")
    monkeypatch.setattr(feed.replica, "put_meta", full)
    assert asyncio.run(feed._replan()) is False
    assert feed.unwritable.tries == 1
    monkeypatch.undo()
    monkeypatch.setattr(feed, "_stream_info", stream_info)
    assert asyncio.run(feed._replan()) is True
    assert not feed._full and feed.meta.applied_seq == 1  # a resume, planned twice alike


def test_the_state_is_logged_as_it_begins_once_a_minute_and_as_it_ends(caplog):
    caplog.set_level(logging.DEBUG, "kvcache.feed")
    now = [T]
    u = unwritable_mod.Unwritable("b", clock=lambda: now[0])
    for _ in range(30):  # a retry every 5 s for 150 s
        u.failed(ReplicaError("No space left on device"))
        now[0] += 5 * S
    u.written()
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert len(said) == 1 + 2 + 1, said  # begins; at 60 s and 120 s; ends
    assert "cannot write the replica" in said[0] and "still" in said[1] and "written again" in said[-1]
    assert u.ms() == 0 and u.tries == 0
    err = ReplicaError("once")
    u.failed(err)
    u.failed(err)  # where it was raised, then where it was caught: one try
    assert u.tries == 1
