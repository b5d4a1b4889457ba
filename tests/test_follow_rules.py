"""The follower's rules that need no server (kvcache.feed.follow): which RePublish can carry a
bucket and on what subject, and that a message reaching the feed another way (a RePublish
subject, a Direct Get batch: its headers already decoded) becomes exactly the replica items a
consumer's delivery of it would (the fast lane's vectors, tests/test_natsproto.py)."""
from __future__ import annotations

import pytest
from test_natsproto import LANE_PREFIX, LANE_SID, LANE_VECTORS, merged

from kvcache.feed.follow import header_block, republish_subject
from kvcache.natsio import natsproto as twin
from kvcache.natsio.jetstream import parse_time_ns


@pytest.mark.parametrize("republish,subject", [
    ({"src": "$KV.b.>", "dest": "rp.b.>"}, "rp.b.>"),
    ({"dest": "all.b"}, "all.b"),
    ({"src": ">", "dest": "x.>"}, "x.>"),
    ({"src": "$KV.b.>", "dest": "x.{{wildcard(1)}}.y.$2.>"}, "x.*.y.*.>"),
    ({"src": "$KV.b.>", "dest": "x.*.>"}, "x.*.>"),
    ({"src": "$KV.b.>", "dest": "rp.>", "headers_only": True}, None),  # no values
    ({"src": "$KV.b.a.>", "dest": "rp.>"}, None),  # narrower than the bucket
    ({"src": "$KV.other.>", "dest": "rp.>"}, None),
    ({"src": "$KV.b.>"}, None),
    (None, None),
])
def test_republish_subject(republish, subject):
    config = {"name": "KV_b"} if republish is None else {"name": "KV_b", "republish": republish}
    assert republish_subject(config, "b") == subject


def _deliveries(wire: bytes) -> list:
    """The lane vector's deliveries as an ordinary subscription sees them (headers decoded)."""
    return [e for e in twin.NatsReader().feed(wire) if type(e) in (twin.HMsg, twin.Msg) and e.sid == LANE_SID]


@pytest.mark.parametrize("name,wire,expected", LANE_VECTORS, ids=[v[0] for v in LANE_VECTORS])
def test_decoded_as_a_consumer_delivery_would_be(name, wire, expected):
    events: list = []
    for ev in _deliveries(wire):
        ack = twin.parse_ack(ev.reply)
        if ack is None:
            continue
        headers = ev.headers if type(ev) is twin.HMsg else {}
        multi = ev.multi if type(ev) is twin.HMsg else None
        block = header_block(headers, multi) if headers else b""
        twin.fold_delivery(events, ack, ev.subject[len(LANE_PREFIX):].encode(), block, ev.payload)
    want = [r for r in expected if r[0] == "Run"]
    got = merged(events)
    if not want:
        assert not got
        return
    # what each message decodes to, across runs (where a run is cut is not the decoding)
    def flat(runs: list, i: int) -> list:
        return [x for r in runs for x in r[i]]
    for i in (7, 9, 11):  # items, marks, entries
        assert flat(got, i) == flat(want, i), (name, i)
    assert sum(r[10] for r in got) == sum(r[10] for r in want), name  # puts with a TTL


def test_republish_time_stamp_to_the_nanosecond():
    assert parse_time_ns("2026-11-29T04:45:54.481956667Z") % 1_000_000_000 == 481956667


class _Feed:
    """What a Follower asks of its feed, with batches recorded instead of written."""

    def __init__(self) -> None:
        from kvcache.config import BucketConfig
        from kvcache.store.replica import BucketMeta

        self.cfg = BucketConfig("b")
        self.stream, self.prefix, self.bucket = "KV_b", "$KV.b.", "b"
        self.cache = None
        self.nc = None
        self.timeout = 1.0
        self.meta = BucketMeta()
        self.follow_received = self.follow_duplicates = self.follow_foreign = 0
        self.applied: list[bytes] = []  # the keys of the items batches brought
        self.pinned_ns = 0

    @property
    def written_seq(self) -> int:
        return self.meta.applied_seq

    def _on_batch(self, runs: list) -> bool:
        self.applied += [lk for r in runs for lk, _ in r.items]
        self.meta.applied_seq = max(self.meta.applied_seq, max(r.top_sseq for r in runs))
        return False


def _msg(seq: int, stream: str = "KV_b") -> tuple[dict, None, bytes]:
    return ({"Nats-Stream": stream, "Nats-Subject": f"$KV.b.k{seq}", "Nats-Sequence": str(seq),
             "Nats-Time-Stamp": "2026-11-29T04:45:54.481956667Z"}, None, b"v")


def _follower(monkeypatch, limit: int):
    from kvcache.feed import follow

    monkeypatch.setattr(follow, "BUFFER_MSGS", limit)
    feed = _Feed()
    f = follow.Follower(feed, "rp.b.>")  # type: ignore[arg-type]  # the parts it uses
    f._holding = False
    return f, feed


def test_in_order_messages_never_fill_the_buffer(monkeypatch):
    """A turn's worth of consecutive messages is applied as it comes, however many: only
    what waits on a gap counts against the bound."""
    f, feed = _follower(monkeypatch, 3)
    f._on_messages([_msg(s) for s in range(1, 51)])
    assert f._ended is None and feed.meta.applied_seq == 50 and len(feed.applied) == 50


def test_what_waits_on_a_gap_is_bounded(monkeypatch):
    from kvcache.feed.follow import FollowEnded

    f, feed = _follower(monkeypatch, 3)
    f._on_messages([_msg(1), _msg(3), _msg(4), _msg(5)])
    assert f._ended is None and feed.meta.applied_seq == 1 and f._gap_end() == 2
    f._on_messages([_msg(6)])
    assert isinstance(f._ended, FollowEnded) and f._ended.reason == "buffer"


def test_duplicates_and_other_streams_are_ignored(monkeypatch):
    f, feed = _follower(monkeypatch, 3)
    f._on_messages([_msg(1), _msg(2), _msg(1), _msg(3, stream="KV_other"), _msg(3)])
    assert feed.meta.applied_seq == 3 and feed.follow_duplicates == 1 and feed.follow_foreign == 1
