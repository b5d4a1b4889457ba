"""The decisions the read side stands on, in process and by table (as asyncpg tests its connect
parameters): the ledger's holds (kvcache/read/ledger.py) and the waits for a feed's position
(kvcache/feed/position.py), freshness on a clock the test sets (kvcache/feed/freshness.py),
where a feed starts on its stream (`start_decision`, kvcache/feed/feed.py), and the stream
reads' rules (kvcache/read/stream_rules.py). No NATS, no process: the quick tier."""
from __future__ import annotations

import asyncio

import pytest

from kvcache.config import BucketConfig
from kvcache.config import BucketConfig as Bucket
from kvcache.errors import CommandError
from kvcache.feed.feed import start_decision
from kvcache.feed.freshness import Freshness
from kvcache.feed.position import Position
from kvcache.read import ledger as ledger_mod
from kvcache.read import stream_rules
from kvcache.read.ledger import Holds, Ledger
from kvcache.store.replica import BucketMeta

S = 1_000_000_000
MS = 1_000_000
T = 1_000 * S  # the test's clock


# ---------------------------------------------------------------------- holds

# (handed out as [(key, revision)], the replica's meta (applied, synced), key asked, its
#  record's revision, held_until's answer)
HOLDS = [
    ([], (10, True), "k", None, 0),                      # nothing handed out: the common case
    ([("k", 12)], (10, True), "k", None, 12),             # ahead of the replica, no record
    ([("k", 12)], (10, True), "k", 11, 12),               # its record below it
    ([("k", 12)], (10, True), "k", 12, 0),                # its record at it
    ([("k", 12)], (12, True), "k", 5, 0),                 # the replica reached it
    ([("k", 12)], (10, True), "other", None, 0),          # another key
    ([("k", 12)], (10, True), None, None, 12),            # any key held? (the GET fast path)
    ([("k", 9)], (10, True), "k", None, 0),               # at or below the replica: not noted
    ([("k", 9)], (10, False), "k", None, 9),              # unsynced: every revision counts
    ([("k", 12), ("k", 11)], (10, True), "k", None, 12),  # the highest handed out
]


@pytest.mark.parametrize(("handed", "meta", "key", "revision", "want"), HOLDS)
def test_held_until(handed, meta, key, revision, want):
    m = BucketMeta(applied_seq=meta[0], synced=meta[1])
    h = Holds()
    for k, r in handed:
        h.handed_out(k, r, m)
    assert h.held_until(key, revision, m) == want


def test_the_first_hold_is_told_once_and_the_replica_releases_it():
    told = []
    h = Holds(on_hold=lambda: told.append(1))
    m = BucketMeta(applied_seq=10, synced=True)
    h.handed_out("a", 12, m)
    h.handed_out("b", 14, m)
    assert told == [1] and h.top == 14
    h.applied(BucketMeta(applied_seq=13, synced=True))
    assert h.held_until("b", None, m) == 14 and h.top == 14  # not all reached yet
    h.applied(BucketMeta(applied_seq=14, synced=True))
    assert h.top == 0 and h.ahead == {}
    h.handed_out("c", 20, m)
    assert told == [1, 1]  # held again: told again


def test_past_the_bound_every_key_waits(monkeypatch):
    monkeypatch.setattr(ledger_mod, "AHEAD_MAX", 2)
    m = BucketMeta(applied_seq=10, synced=True)
    h = Holds()
    for k, r in (("a", 11), ("b", 12), ("c", 15)):
        h.handed_out(k, r, m)
    assert "c" not in h.ahead
    assert h.held_until("a", None, m) == 15 and h.held_until("zzz", None, m) == 15
    h.clear()
    assert h.held_until("a", None, m) == 0


def test_waits_end_when_the_replica_reaches_them():
    async def main():
        h = Position()
        m = BucketMeta(applied_seq=10, synced=True)
        assert await h.wait(10, 0.01, m)              # already there
        assert not await h.wait(11, 0.01, m)          # timed out
        task = asyncio.ensure_future(h.wait(12, 5, m))
        await asyncio.sleep(0)
        h.moved(BucketMeta(applied_seq=11, synced=True))
        await asyncio.sleep(0)
        assert not task.done()
        h.moved(BucketMeta(applied_seq=12, synced=True))
        assert await task and h._waiters == []
    asyncio.run(main())


# ---------------------------------------------------------------------- freshness

# (caught_up, interrupted, heard ms ago, newest message ms ago, bound ms, within?, lag ms)
FRESHNESS = [
    (True, False, 0, 0, 1000, True, 0),
    (True, False, 3_000, 0, 1000, True, 0),        # silent within two heartbeats (2 s each)
    (True, False, 5_000, 0, 1000, False, 5_000),   # past two heartbeats: since the last word
    (True, False, 5_000, 0, 6000, True, 5_000),
    (False, True, 800, 100, 1000, True, 800),      # catching up: since last caught up
    (False, True, 1_200, 100, 1000, False, 1_200),
    (False, False, 1_200, 100, 1000, True, 100),   # behind but not interrupted: newest message
    (False, True, 0, 0, 1000, True, 0),            # never heard: nothing to count from
]


@pytest.mark.parametrize(("caught_up", "interrupted", "heard_ago", "msg_ago", "bound", "within", "lag"),
                         FRESHNESS)
def test_freshness(caught_up, interrupted, heard_ago, msg_ago, bound, within, lag):
    fr = Freshness(BucketConfig(name="b", max_stale_ms=10_000), heartbeat_s=2.0, heard_ns=0, clock=lambda: T)
    fr.caught_up, fr.interrupted = caught_up, interrupted
    fr.heard_ns = T - heard_ago * MS if heard_ago or caught_up else 0
    fr.last_msg_ns = T - msg_ago * MS if msg_ago else 0
    assert fr.within(bound, 10) is within
    assert fr.lag_ms(10) == lag


def test_a_replicated_stream_is_as_fresh_as_the_quorum_evidence_it_reached():
    now = [T]
    fr = Freshness(BucketConfig(name="b", max_stale_ms=2000), heartbeat_s=2.0, heard_ns=T, clock=lambda: now[0])
    fr.caught_up, fr.interrupted = True, False
    info = {"config": {"num_replicas": 3}, "cluster": {"leader": "n1", "replicas": [
        {"name": "n2", "current": True, "active": 5 * MS}, {"name": "n3", "current": True, "active": 5 * MS}]},
        "state": {"last_seq": 20}}
    assert fr.note(info, T, 10) is not None and fr.quorum
    assert fr.within(2000, 20)      # the replica holds the sequence the quorum showed
    now[0] = T + 3 * S
    assert not fr.within(2000, 20)  # that evidence is now 3 s old
    assert fr.lag_ms(20) == 3005  # from when the quorum was last heard (5 ms before the poll)


# ---------------------------------------------------------------------- where a feed starts

def info(first: int, last: int, created: str = "c1") -> dict:
    return {"state": {"first_seq": first, "last_seq": last}, "created": created}


# (the replica's meta, the stream's info, (reason starts with, kind, counted))
STARTS = [
    (BucketMeta(), info(1, 50), ("first sync", None, False)),
    (BucketMeta(stream="KV_b", applied_seq=30, synced=False), info(1, 50),
     ("previous full sync did not finish", "unfinished", False)),
    (BucketMeta(stream="KV_b", applied_seq=30, synced=True, stream_created="c0"), info(1, 50),
     ("stream was recreated", "recreated", True)),
    (BucketMeta(stream="KV_b", applied_seq=30, synced=True, stream_created="c1"), info(1, 20),
     ("stream sequence went backwards (20 < 30)", "rewound", True)),
    (BucketMeta(stream="KV_b", applied_seq=30, synced=True, stream_created="c1"), info(40, 50),
     ("stream no longer holds sequence 31 (first is 40)", "truncated", True)),
    (BucketMeta(stream="KV_b", applied_seq=30, synced=True, stream_created="c1"), info(31, 50),
     (None, None, True)),                                   # resume after 30
    (BucketMeta(stream="KV_b", applied_seq=30, synced=True, stream_created="c1"), info(1, 30),
     (None, None, True)),                                   # nothing new: resume
    (BucketMeta(stream="KV_b", applied_seq=30, synced=True), info(1, 50, ""),
     (None, None, True)),                                   # no identity to compare: resume
    (BucketMeta(stream="KV_b", applied_seq=0, synced=True), info(1, 0),
     (None, None, False)),                                  # an empty stream, synced
]


@pytest.mark.parametrize(("meta", "stream", "expected"), STARTS)
def test_start_decision(meta, stream, expected):
    assert start_decision(meta, stream) == expected


# ---------------------------------------------------------------------- the stream rules

class StreamFeed:
    """What the stream rules ask of a feed: synced?, fresh within a bound?, its lag, its meta."""

    def __init__(self, synced=True, fresh=True, applied=50, horizon=0):
        self.synced, self.fresh = synced, fresh
        self.meta = BucketMeta(applied_seq=applied, synced=synced, horizon=horizon)

    def fresh_within(self, ms):
        return self.fresh

    def lag_ms(self):
        return 7_500


SB = Bucket(name="s", max_stale_ms=1000)

# (the feed, revisions this connection was handed before, the error expected or None)
VOUCH = [
    (StreamFeed(), 0, None),
    (StreamFeed(synced=False), 0, "replica not synced yet"),
    (StreamFeed(fresh=False), 0, r"replica stale \(7.5s behind, max_stale_ms 1000\)"),
    (StreamFeed(applied=50), 50, None),
    (StreamFeed(applied=40), 50, "its last revision 40 is below one this connection already read"),
]


@pytest.mark.parametrize(("feed", "handed", "error"), VOUCH)
def test_stream_vouch(feed, handed, error):
    ledger = Ledger()
    if handed:
        ledger.stream_handed(7, "s", handed)
    if error is None:
        stream_rules.vouch(ledger, 7, SB, feed)
        return
    with pytest.raises(CommandError, match=error):
        stream_rules.vouch(ledger, 7, SB, feed)
    stream_rules.vouch(ledger, 8, SB, StreamFeed())  # another connection: its own ledger entry


def test_stream_regression_is_said_once_and_forgotten_with_the_connection():
    ledger = Ledger()
    ledger.stream_handed(7, "s", 50)
    ledger.stream_handed(7, "s", 30)  # never lowered
    with pytest.raises(CommandError):
        stream_rules.vouch(ledger, 7, SB, StreamFeed(applied=40))
    stream_rules.vouch(ledger, 7, SB, StreamFeed(applied=40))  # a read from 0 starts afresh
    ledger.stream_handed(7, "s", 60)
    ledger.forget(7)
    stream_rules.vouch(ledger, 7, SB, StreamFeed(applied=40))


# (horizon, last revision, after, the error expected or None)
EXACT = [
    (0, 50, 0, None),
    (0, 50, 50, None),
    (0, 50, 51, "revision 51 is past its last revision 50"),
    (20, 50, 0, None),              # from 0: the full listing
    (20, 50, 19, "changes after revision 19 are no longer known exactly"),
    (20, 50, 20, None),
    (20, 50, 30, None),
]


def test_a_range_start_past_the_end_is_named_as_given():
    """XRANGE's start S asks for what changed after S-1: S one past the last revision is the
    end of a listing (empty), two past is an error that names S as the client wrote it."""
    stream_rules.exact_after(SB, 0, 50, 50, b"51")
    with pytest.raises(CommandError, match=r"start 52-0 is past its next revision 51 \(was the bucket recreated"):
        stream_rules.exact_after(SB, 0, 50, 51, b"52-0")


@pytest.mark.parametrize(("horizon", "last", "after", "error"), EXACT)
def test_stream_exact_after(horizon, last, after, error):
    if error is None:
        stream_rules.exact_after(SB, horizon, last, after)
    else:
        with pytest.raises(CommandError, match=error):
            stream_rules.exact_after(SB, horizon, last, after)
