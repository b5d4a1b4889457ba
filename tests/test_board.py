"""The workers' board (kvcache.supervisors.board): what a worker's GET path believes must be
exactly what the feed's process would answer itself.

- `Freshness.fresh_until_ns` is `Freshness.within` as a deadline: for every state the freshness
  rules know (caught up or not, interrupted, silent past the heartbeats, quorum evidence reached
  or not, none heard yet) and every moment around the edges, `clock <= deadline` is `within`.
  An off-by-one here keeps a worker answering from the replica one millisecond (or one
  heartbeat) past its bound.
- The board's words: what is published is what a BoardWitness reads, per bucket; a worker's
  counters come back to the feed's process as written.
- `reply_end` (kvcache.serve.relay) finds where each RESP2/RESP3 reply ends, cut anywhere.
"""
from __future__ import annotations

import itertools

import pytest

from kvcache import resp
from kvcache.config import BucketConfig
from kvcache.feed.freshness import NEVER, Freshness
from kvcache.feed.quorum import Evidence
from kvcache.serve.relay import command_bytes, reply_end
from kvcache.supervisors.board import Board

pytestmark = pytest.mark.quick

MS = 1_000_000
T0 = 1_700_000_000_000 * MS


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> int:
        return self.now


def states():
    """(name, Freshness, applied): the states the freshness rules tell apart."""
    for bound, heartbeat_s in ((2000, 1.0), (500, 1.0), (0, 0.2)):
        for caught_up, interrupted, heard, last_msg, quorum, ev in itertools.product(
                (True, False), (True, False), (0, T0 - 300 * MS), (0, T0 - 100 * MS), (False, True),
                (None, (5, T0 - 700 * MS), (50, T0 - 200 * MS))):
            clock = Clock()
            f = Freshness(BucketConfig(name="b", max_stale_ms=bound), heartbeat_s, heard, clock)
            f.caught_up, f.interrupted, f.last_msg_ns = caught_up, interrupted, last_msg
            f.quorum = quorum
            if ev is not None:
                f.proofs.add(Evidence(as_of_ns=ev[1], seq=ev[0], leader="n0"), 10)
            yield (f"bound={bound} caught_up={caught_up} interrupted={interrupted} heard={bool(heard)} "
                   f"last_msg={bool(last_msg)} quorum={quorum} ev={ev}"), f, clock, bound


def test_deadline_is_within_at_every_edge() -> None:
    checked = 0
    for name, f, clock, bound in states():
        deadline = f.fresh_until_ns(bound, 10)
        edges = {T0, T0 + 1}
        if deadline != NEVER:
            edges |= {deadline - 1, deadline, deadline + 1, deadline + MS}
        for moment in sorted(edges):
            clock.now = moment
            assert (moment <= deadline) == f.within(bound, 10), (name, moment - T0, deadline - T0)
            checked += 1
    assert checked > 500


def test_board_words_round_trip(tmp_path) -> None:
    path = str(tmp_path / "workers.board")
    main = Board(path, ["a", "b"], 3, create=True)
    worker = Board(path, ["a", "b"], 3, create=False)
    wa, wb = worker.witness("a"), worker.witness("b")
    assert not wa.fresh_for_all(1000) and not wb.fresh_for_all(1000)  # nothing published: stale
    main.publish("a", NEVER, 7 * MS)
    assert wa.fresh_for_all(1000) and wa.max_age_ns == 7 * MS and not wb.fresh_for_all(1000)
    main.publish("a", 0, 0)  # a hold, or a resync
    assert not wa.fresh_for_all(1000)
    worker.report(2, {"pid": 42, "gets_local": 5}, {"b": (3, 2)})
    assert main.worker(2)["pid"] == 42 and main.worker(2)["gets_local"] == 5
    assert main.worker_reads(2) == {"a": (0, 0), "b": (3, 2)} and main.worker_reads(1) == {"a": (0, 0), "b": (0, 0)}
    main.clear_worker(2)
    assert main.worker(2)["pid"] == 0 and main.worker_reads(2)["b"] == (0, 0)
    with pytest.raises(ValueError):
        Board(path, ["a"], 3, create=False)  # another sidecar's layout


REPLIES = [resp.OK, resp.error("ERR x"), resp.integer(-3), resp.bulk(b"a\r\nb"), resp.bulk(None),
           resp.bulk(None, 3), resp.bulk_array([b"x", None, b""]), resp.array(None),
           resp.map_([(resp.bulk(b"k"), resp.array([resp.integer(1), resp.bulk(b"v")]))], 3),
           resp.push([resp.bulk(b"invalidate"), resp.array([resp.bulk(b"k")])], 3),
           resp.double(1.5, 3), resp.boolean(True, 3), resp.verbatim("txt", 3), resp.set_([resp.bulk(b"m")], 3),
           b"|1\r\n+key\r\n+val\r\n:5\r\n", b"!5\r\nERR x\r\n", b"(123\r\n", resp.array([])]


def test_reply_end_finds_each_reply_cut_anywhere() -> None:
    stream = b"".join(REPLIES)
    ends = list(itertools.accumulate(len(r) for r in REPLIES))
    pos, found = 0, []
    while pos < len(stream):
        end = reply_end(stream, pos)
        assert end > pos
        found.append(end)
        pos = end
    assert found == ends
    for reply in REPLIES:
        for cut in range(len(reply)):
            assert reply_end(reply[:cut]) == -1, (reply, cut)
        assert reply_end(reply) == len(reply)


def test_command_bytes_is_what_the_request_reader_reads() -> None:
    reader = resp.RequestReader()
    args = [b"SET", b"a b", b"", b"\r\n"]
    reader.feed(command_bytes(args))
    assert reader.next_command() == args


def test_the_publisher_follows_every_change_before_control_returns(tmp_path) -> None:
    """The sidecar's wiring, in process: a real Feed (no connection) and Ledger publishing on a
    real Board, read by a worker's BoardWitness. What the worker believes must follow the
    witness's own fresh_for_all at once: a hold placed (the ledger calls the publisher before
    the answer that placed it can go out), the replica reaching it, a lost connection."""
    import functools

    from kvcache.feed.feed import Feed
    from kvcache.read.ledger import Ledger
    from kvcache.store.replica import Replica
    from kvcache.supervisors.board import BoardPublisher

    replica = Replica(str(tmp_path / "replica"), buckets=1)
    replica.set_buckets(["b"])
    ledger = Ledger()
    # a heartbeat long enough that a caught-up feed's silence never counts here; heard 3 s ago
    # (past the 2 s bound: only being caught up keeps it fresh)
    feed = Feed(None, BucketConfig(name="b", max_stale_ms=2000), replica, heartbeat_s=60.0,  # type: ignore[arg-type]
                on_applied=functools.partial(ledger.applied, "b"))
    fr = feed.freshness
    fr.caught_up, fr.interrupted, fr.heard_ns = True, False, time_ns() - 3000 * MS
    feed.meta.synced, feed.meta.applied_seq = True, 10
    witness = ledger.witness(feed)
    main = Board(str(tmp_path / "workers.board"), ["b"], 1, create=True)
    worker = Board(str(tmp_path / "workers.board"), ["b"], 1, create=False).witness("b")
    forgotten = []
    publisher = BoardPublisher(main, {"b": feed}, ledger, lambda: forgotten.append(1))
    feed.on_state = functools.partial(publisher.publish, "b")
    ledger.on_hold = publisher.held
    publisher.publish_all()

    def agree() -> bool:
        ours = witness.fresh_for_all(2000)
        assert worker.fresh_for_all(2000) == ours
        return ours

    assert agree()
    witness.handed_out("k", 12)  # revision 12 went out from NATS, the replica at 10
    assert not agree() and forgotten == [1]
    feed._on_idle(12)  # the replica reaches it: the hold ends
    assert agree()
    assert agree()
    fr.heard_ns = time_ns() - 3000 * MS  # as if that was 3 s ago: caught up, it is still fresh
    assert agree()
    feed.connection_lost()  # interrupted: as old as the last word, 3 s ago
    assert not agree()


def time_ns() -> int:
    import time
    return time.time_ns()
