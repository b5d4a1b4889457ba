"""A consumer behind its stream whose deliveries jump over sequences: messages superseded
(history) or removed after they were stored, before the consumer reached them. What
superseded one may come in a later batch, so between the two the replica holds a key's
older revision while its newest message is one the stream stored after the skipped one: no
state the stream was ever in past the jump. The feed's age (kvcache.feed.freshness) must
then run from before the jump until the consumer is caught up again, not from the newest
message applied, or a read within max_stale_ms could get a revision older than one
acknowledged more than max_stale_ms before it.

Driven as the guarantees world drives a feed (support.guarantees_world): a never-started
Feed over a real replica, its batches handed in as the consumer loop would, on a set clock.
"""
from __future__ import annotations

from support.guarantees_world import FakeNc

from kvcache.config import BucketConfig
from kvcache.feed.feed import Feed
from kvcache.natsio.natsproto import Run
from kvcache.store.record import item
from kvcache.store.replica import Replica
from kvcache.store.revindex import put_entry

MS = 1_000_000
T0 = 1_700_000_000_000 * MS
BOUND_MS = 2000


def _run(msgs: list[tuple[int, str, int]], pending: int) -> Run:
    """One batch: (stream sequence, key, stored at ms after T0) each, then `pending`."""
    run = Run(1, 1)
    for seq, key, at_ms in msgs:
        lk, rec = item(key.encode(), f"v{seq}".encode(), seq, T0 + at_ms * MS)
        run.items.append((lk, rec))
        run.entries.append(put_entry(lk, seq))
        run.last_ts = T0 + at_ms * MS
    run.last_cseq = len(msgs)
    run.top_sseq = max(s for s, _, _ in msgs)
    run.last_pending = pending
    return run


def _feed(tmp_path, clock: list[int]) -> Feed:
    replica = Replica(str(tmp_path / "replica"), buckets=1)
    replica.set_buckets(["b"])
    feed = Feed(FakeNc(), BucketConfig(name="b", max_stale_ms=BOUND_MS), replica, heartbeat_s=1.0)  # type: ignore[arg-type]
    feed.freshness.clock = lambda: clock[0]
    feed._choose_start({"config": {"name": "KV_b", "max_age": 0, "allow_direct": True, "num_replicas": 1},
                        "state": {"first_seq": 1, "last_seq": 2}, "created": "gen1"})
    feed._new_consumer()
    feed._on_batch([_run([(1, "k", 0), (2, "f", 10)], pending=0)])  # the first sync, caught up
    assert feed.synced and feed.freshness.caught_up
    return feed


def test_a_behind_consumer_past_a_jump_ages_from_before_it(tmp_path):
    clock = [T0 + 100 * MS]
    feed = _feed(tmp_path, clock)
    # k=v3 stored at +1000 ms, then superseded by k=v6 at +1500 ms before the consumer got
    # there; it delivers 4 and 5 (3 is gone), 6 and more still pending.
    clock[0] = T0 + 1600 * MS
    feed._on_batch([_run([(4, "f", 1200), (5, "f", 1400)], pending=3)])
    assert feed.replica.get("b", "k").revision == 1  # the stream held k=v3 from +1000 ms on
    # The position stays before the jump: a MINREV 3 read, the ledger's hold of a v3 handed
    # out from NATS and the sweeps wait for the consumer to catch up.
    assert feed.meta.applied_seq == 2 and feed.replica.meta("b").applied_seq == 2
    # At +3300 ms, v3 was acknowledged 2.3 s ago: the replica's k=v1 is stale past the bound.
    # Counted from its newest message (+1400 ms), it would look 1.9 s old: within it.
    clock[0] = T0 + 3300 * MS
    assert not feed.fresh_within(BOUND_MS), f"k=v1 served as current (lag {feed.lag_ms()} ms): v3 was acked 2300 ms ago"
    # Caught up: every successor is applied, and the age is the consumer's word again.
    feed._on_batch([_run([(6, "k", 1500), (7, "f", 1600), (8, "f", 1700)], pending=0)])
    assert feed.replica.get("b", "k").revision == 6
    assert feed.fresh_within(BOUND_MS) and feed.meta.applied_seq == 8


def test_a_behind_consumer_with_no_jump_ages_from_its_newest_message(tmp_path):
    """The same moment without a jump (3 delivered): the replica is the stream as of its
    newest message, and counts as current within the bound."""
    clock = [T0 + 100 * MS]
    feed = _feed(tmp_path, clock)
    clock[0] = T0 + 1600 * MS
    feed._on_batch([_run([(3, "k", 1000), (4, "f", 1200), (5, "f", 1400)], pending=3)])
    clock[0] = T0 + 3300 * MS
    assert feed.fresh_within(BOUND_MS), feed.lag_ms()
    assert feed.lag_ms() == 1900 and feed.meta.applied_seq == 5


def test_a_consumer_lost_past_a_jump_starts_again_at_it(tmp_path):
    """The position kept below the jump is where the next consumer starts: it delivers the
    successors again, and everything past the jump once more."""
    clock = [T0 + 100 * MS]
    feed = _feed(tmp_path, clock)
    feed._on_batch([_run([(4, "f", 1200), (5, "f", 1400)], pending=3)])
    feed.freshness.caught_up = False
    feed.freshness.interrupted = True
    assert feed._new_consumer().start_seq == 3
    feed._on_batch([_run([(4, "f", 1200), (5, "f", 1400), (6, "k", 1500)], pending=0)])
    assert feed.meta.applied_seq == 6 and feed.replica.get("b", "k").revision == 6


def test_an_idle_heartbeat_after_a_jump_moves_the_position_to_what_was_written(tmp_path):
    clock = [T0 + 100 * MS]
    feed = _feed(tmp_path, clock)
    feed._on_batch([_run([(4, "f", 1200), (6, "k", 1500)], pending=2)])
    assert feed.meta.applied_seq == 2
    feed._on_idle(0)
    assert feed.meta.applied_seq == 6


def test_the_position_stays_below_a_jump_until_the_consumer_is_caught_up(tmp_path):
    """A later batch with no jump of its own, still behind, leaves the position below the
    jump: whatever superseded another skipped message may still be pending."""
    clock = [T0 + 100 * MS]
    feed = _feed(tmp_path, clock)
    feed._on_batch([_run([(4, "f", 1200), (5, "f", 1400)], pending=3)])
    feed._on_batch([_run([(6, "k", 1500)], pending=2)])
    assert feed.meta.applied_seq == 2 and feed.written_seq == 6 and feed.pinned_ns
    feed._on_batch([_run([(7, "f", 1600), (8, "f", 1700)], pending=0)])
    assert feed.meta.applied_seq == 8 and not feed.pinned_ns
