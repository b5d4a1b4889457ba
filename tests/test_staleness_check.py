"""The partition checker's judging rules (support/staleness_check.py) on hand-made logs: what
is stale, what is not, what goes back in time, availability and recovery."""
from __future__ import annotations

from support.staleness_check import Acks, Read, judge, read_acks, read_reads

# key a: counter 0 acked at 1.0, 1 at 5.0, 2 at 9.0 (revisions 1, 4, 7)
ACKS = Acks.of([("a", 0, 1, 1.0), ("a", 1, 4, 5.0), ("a", 2, 7, 9.0), ("b", 0, 2, 1.0)])
BOUND_MS = 2000


def one(read: Read, window=(0.0, 100.0), heal=0.0):
    return judge(ACKS, [read], BOUND_MS, window, heal)


def r(sent, counter, conn=0, key="a", status="ok", recv=None, rev=-1):
    return Read(conn, "get", key, sent, sent + 0.001 if recv is None else recv, status, counter, rev)


def test_older_than_a_write_acknowledged_past_the_bound_is_stale():
    v = one(r(7.5, 0))  # counter 1 was acknowledged at 5.0, 2.5 s before
    assert len(v.stale) == 1
    s = v.stale[0]
    assert (s.newest_counter, s.newest_revision, s.newest_ack) == (1, 4, 5.0)
    assert round(s.age_ms) == 2500
    assert "newest acknowledged: counter 1 rev 4" in s.describe()


def test_within_the_bound_is_not_stale():
    assert not one(r(6.9, 0)).stale   # counter 1 acknowledged only 1.9 s before
    assert not one(r(7.5, 1)).stale   # the newest acknowledged past the bound
    assert not one(r(7.5, 2)).stale   # newer than that: fine (a write not yet acknowledged)
    assert not one(r(0.5, 0)).stale   # before any acknowledgement


def test_a_missing_key_is_stale_once_a_write_is_past_the_bound():
    assert one(r(3.5, -1, status="nil")).stale
    assert not one(r(2.5, -1, status="nil")).stale


def test_errors_are_failures_not_stale():
    v = one(r(7.5, -1, status="err"))
    assert not v.stale and v.failures == {"err": 1}


def test_regression_is_per_connection_and_key():
    reads = [r(1.1, 1), r(1.2, 0), r(1.3, 0, conn=1), r(1.4, 0, key="b"), r(1.5, -1, status="nil")]
    v = judge(ACKS, reads, BOUND_MS, (0, 100), 0)
    assert [(x.read.sent, x.before) for x in v.regressions] == [(1.2, 1), (1.5, 1)]


def test_availability_and_recovery():
    # one connection: ok 0-1, error 1-3 (a 2 s timeout), ok 3-4, then its last read; healed at 2
    reads = [r(0.0, 0, key="b", recv=0.5), r(1.0, -1, key="b", status="timeout", recv=3.0),
             r(3.0, 0, key="b", recv=3.1), r(4.0, 0, key="b", recv=4.0)]
    v = judge(ACKS, reads, BOUND_MS, (0.0, 4.5), heal=2.0)
    assert abs(v.availability - 0.5) < 1e-9
    assert v.window_reads == 4 and v.window_ok == 3
    assert abs(v.recovery_s - 1.0) < 1e-9
    # still failing at the end: not recovered
    v = judge(ACKS, reads[:2], BOUND_MS, (0.0, 4.0), heal=2.0)
    assert v.recovery_s is None
    # nothing bad after the heal: 0
    assert judge(ACKS, reads, BOUND_MS, (0.0, 4.0), heal=3.5).recovery_s == 0.0


def test_the_logs_round_trip(tmp_path):
    (tmp_path / "acks").write_text("ack a 0 1 1.000000\nfail a 1 2.0 TimeoutError\nack a 1 4 5.0\n")
    (tmp_path / "reads").write_text("read 0 kv.get a 7.5 7.6 ok 0 1\nread 1 get a 7.7 7.8 timeout -1 -1\n")
    acks, reads = read_acks(tmp_path / "acks"), read_reads(tmp_path / "reads")
    assert acks.count == 2 and len(reads) == 2 and reads[0].revision == 1
    v = judge(acks, reads, BOUND_MS, (0, 10), 0)
    assert len(v.stale) == 1 and v.failures == {"timeout": 1}


def strong(sent, counter, conn=0, key="a", status="ok", recv=None):
    return Read(conn, "strong", key, sent, sent + 0.001 if recv is None else recv, status, counter, 4)


def test_a_strong_read_promises_every_write_acknowledged_before_it():
    v = judge(ACKS, [strong(5.01, 0)], BOUND_MS, (0, 100), 0)   # counter 1 acknowledged 10 ms before
    assert len(v.stale) == 1 and v.strong_stale == 1 and (v.strong_reads, v.strong_ok) == (1, 1)
    assert not judge(ACKS, [strong(4.99, 0), strong(5.01, 1)], BOUND_MS, (0, 100), 0).stale
    # the same answer to a plain read is within its bound
    assert not one(r(5.01, 0)).stale


def test_a_plain_read_after_a_strong_one_must_not_go_back():
    v = judge(ACKS, [strong(5.5, 1), r(5.6, 0)], BOUND_MS, (0, 100), 0)
    assert not v.stale and [(x.read.kind, x.before) for x in v.regressions] == [("get", 1)]


def test_strong_reads_are_left_out_of_availability():
    # a strong read failing (no leader in reach) between two plain reads costs nothing
    reads = [r(0.0, 0, key="b", recv=0.1), strong(1.0, -1, key="b", status="timeout", recv=3.0),
             r(1.0, 0, key="b", recv=1.1), r(2.0, 0, key="b", recv=2.0)]
    v = judge(ACKS, reads, BOUND_MS, (0.0, 2.5), heal=0.5)
    assert v.availability == 1.0 and v.recovery_s == 0.0 and v.failures == {"timeout": 1}
    assert (v.strong_reads, v.strong_ok, v.window_reads) == (1, 0, 3)
