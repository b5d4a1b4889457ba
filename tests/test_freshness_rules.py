"""How old a replica is known to be (kvcache.feed.freshness) and what quorum evidence proves
(kvcache.feed.quorum), rule by rule on a clock the test sets: where the silence of a
caught-up link starts to count, from which moment a catching-up replica's age runs, which
evidence a replica at a sequence has reached, and the exact bounds (an age equal to the bound
is within it). An off-by-one here keeps a replica fresh one heartbeat or one evidence too
long; a wrong default makes a new feed look current before it heard anything.
"""
from __future__ import annotations

import logging

import pytest

from kvcache.config import BucketConfig
from kvcache.feed.freshness import Freshness
from kvcache.feed.quorum import PENDING_MAX, Evidence, Proofs, evidence, group_size, needs_quorum

MS = 1_000_000
S = 1000 * MS
T0 = 1_700_000_000 * S  # a wall-clock moment


class Clock:
    def __init__(self, now: int = T0) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


def fresh(max_stale_ms: int = 2000, heartbeat_s: float = 1.0, heard_ns: int = T0,
          clock: Clock | None = None) -> tuple[Freshness, Clock]:
    clock = clock or Clock()
    return Freshness(BucketConfig(name="b", max_stale_ms=max_stale_ms), heartbeat_s, heard_ns, clock), clock


def replicated(last_seq: int = 10, active_ns: int = 100 * MS) -> dict:
    """A three-member stream's info whose leader heard a follower `active_ns` ago."""
    return {"config": {"name": "KV_b", "num_replicas": 3}, "state": {"last_seq": last_seq},
            "cluster": {"name": "c", "leader": "n0",
                        "replicas": [{"name": "n1", "active": active_ns}, {"name": "n2", "active": 9 * S}]}}


# ---------------------------------------------------------------------- a new feed

def test_a_new_feed_is_as_old_as_its_last_word_and_has_one_copy():
    """Before the consumer says anything, the replica is as old as the moment given
    (`heard_ns`, the meta's last fresh moment), however long the heartbeat; a stream not yet
    known to be replicated needs no quorum."""
    fr, clock = fresh(heartbeat_s=30.0)
    clock.now = T0 + 10 * S
    assert fr.ages_ms(0) == (10_000, 0)
    assert fr.lag_ms(0) == 10_000
    assert not fr.within(2000, 0)


def test_a_catching_up_replica_is_as_old_as_its_last_caught_up_moment_not_its_newest_message():
    fr, clock = fresh()
    fr.last_msg_ns = T0 + 5 * S  # a message of 5 s after the last word, applied while catching up
    clock.now = T0 + 10 * S
    assert fr.ages_ms(0)[0] == 10_000  # interrupted: from the last word, not the message
    fr.interrupted = False  # catching up without an interruption: the newest message counts
    assert fr.ages_ms(0)[0] == 5_000


def test_never_caught_up_and_no_message_is_no_age_to_count():
    fr, clock = fresh(heard_ns=0)
    fr.interrupted = False
    clock.now = T0 + 10 * S
    assert fr.ages_ms(0) == (0, 0)


def test_ages_are_whole_milliseconds():
    fr, clock = fresh()
    clock.now = T0 + 10 * S + MS // 2
    assert fr.ages_ms(0) == (10_000, 0)
    assert isinstance(fr.ages_ms(0)[0], int)
    clock.now = T0  # and an age of nothing is 0, not 1
    assert fr.ages_ms(0) == (0, 0)


# ---------------------------------------------------------------------- a caught-up link's silence

def test_silence_counts_from_the_first_ns_past_two_heartbeats():
    fr, clock = fresh(heartbeat_s=1.0)
    fr.caught_up = True
    clock.now = T0 + 2 * S  # exactly two heartbeats of silence: still current
    assert fr.ages_ms(0) == (0, 0)
    clock.now = T0 + 2 * S + 1  # one ns past: as old as the last word
    assert fr.ages_ms(0) == (2000, 0)
    clock.now = T0 + 2 * S + MS + MS // 2
    assert fr.ages_ms(0) == (2001, 0)
    fr.expect_heartbeats(5.0)  # a new consumer asked for a longer heartbeat: 10 s of silence
    assert fr.ages_ms(0) == (0, 0)


# ---------------------------------------------------------------------- quorum evidence

def test_a_replicated_stream_with_no_evidence_is_as_old_as_the_feed():
    fr, clock = fresh()
    fr.caught_up = True
    fr.quorum = True
    clock.now = T0 + 700 * MS
    assert fr.ages_ms(10) == (0, 700)
    assert fr.proven_with(10, clock.now) == 0
    assert not fr.proven_within(1000)
    assert fr.required() is None


def test_evidence_ages_a_caught_up_replica_only_once_it_holds_the_sequence():
    fr, clock = fresh(max_stale_ms=2000)
    fr.caught_up = True
    fr.heard_ns = T0 + 5 * S
    clock.now = T0 + 5 * S
    ev = fr.note(replicated(last_seq=20, active_ns=100 * MS), T0 + 4 * S, applied=10)
    assert ev == Evidence(T0 + 4 * S - 100 * MS, 20, "n0")
    assert fr.quorum
    # the replica, at 10, has not reached 20: no evidence reached, the age runs from the start
    assert fr.ages_ms(10) == (0, 5000)
    assert fr.proven_with(10, clock.now) == 0
    assert fr.proven_with(20, clock.now) == T0 + 4 * S - 100 * MS  # about to be at 20
    assert fr.proven_with(20, T0) == T0  # never later than the moment it was caught up
    assert fr.ages_ms(20) == (0, 1100)  # reached
    assert fr.lag_ms(20) == 0  # evidence within the bound is no lag to show
    assert fr.within(1100, 20) and not fr.within(1099, 20)
    clock.now = T0 + 6 * S + 900 * MS  # the evidence is now exactly max_stale_ms old
    assert fr.ages_ms(20) == (0, 3000)
    fr.cfg = BucketConfig(name="b", max_stale_ms=3000)
    assert fr.lag_ms(20) == 0
    fr.cfg = BucketConfig(name="b", max_stale_ms=2999)
    assert fr.lag_ms(20) == 3000


def test_lag_shows_evidence_reached_at_the_replicas_position():
    fr, clock = fresh(max_stale_ms=1000)
    fr.caught_up = True
    fr.note(replicated(last_seq=5), T0, applied=5)
    fr.note(replicated(last_seq=9), T0 + 2 * S, applied=5)  # pending until the replica has 9
    clock.now = fr.heard_ns = T0 + 3 * S  # the consumer's word is current
    assert fr.lag_ms(5) == 3100
    assert fr.lag_ms(9) == 1100


def test_proven_within_and_required_look_back_the_bound_from_now():
    fr, clock = fresh(max_stale_ms=2000)
    assert fr.proven_within(1)  # one copy: always
    fr.note(replicated(last_seq=5, active_ns=0 + 1), T0, applied=0)  # as of T0 - 1 ns
    clock.now = T0 + 2 * S - 1
    assert fr.proven_within(2000)
    assert fr.required() == Evidence(T0 - 1, 5, "n0")
    clock.now = T0 + 2 * S
    assert not fr.proven_within(2000)
    assert fr.required() is None
    assert fr.proven_within(2001)


def test_the_low_bound_warning_once_when_a_stream_turns_out_replicated(caplog):
    caplog.set_level(logging.WARNING, logger="kvcache.feed")
    lone = {"config": {"num_replicas": 1}, "state": {"last_seq": 1}}
    fr, _ = fresh(max_stale_ms=1000)
    fr.note(lone, T0, applied=0)
    assert not caplog.records  # one copy: no quorum, no warning
    fr.note(replicated(), T0, applied=0)
    assert len(caplog.records) == 1  # said when the stream is first seen replicated
    fr.note(replicated(), T0, applied=0)
    assert [r.getMessage() for r in caplog.records] == [
        "bucket b: max_stale_ms 1000 is below 1500 ms: its stream is replicated, and a quorum's word about "
        "it is up to a raft heartbeat (1 s) plus a state poll (max_stale_ms / 4 at this bound) old, so the "
        "replica will often count as stale"]
    caplog.clear()
    at_least, _ = fresh(max_stale_ms=1500)
    at_least.note(replicated(), T0, applied=0)
    assert not caplog.records


# ---------------------------------------------------------------------- what an info proves

def test_group_size_is_the_configured_replicas_or_the_listed_peers():
    assert group_size({}) == 1
    assert group_size({"config": {"num_replicas": 0}}) == 1
    assert group_size({"config": {"num_replicas": 3}}) == 3
    assert group_size({"config": {"num_replicas": 1}, "cluster": {"replicas": [{}, {}]}}) == 3
    assert group_size({"config": {"num_replicas": 3}, "cluster": {"replicas": [{}, {}, {}]}}) == 4


def test_two_members_need_a_quorum_and_a_leader():
    two = {"config": {"num_replicas": 2}, "state": {"last_seq": 4}, "cluster": {"replicas": [{"active": 1}]}}
    assert needs_quorum(two)
    assert evidence(two, T0) is None  # no leader: nothing proven
    assert evidence({**two, "cluster": {"leader": "", "replicas": [{"active": 1}]}}, T0) is None


def test_an_info_without_a_last_sequence_proves_sequence_0():
    assert evidence({"config": {"num_replicas": 1}}, T0) == Evidence(T0, 0, "")
    assert evidence({"state": {"last_seq": 0}}, T0) == Evidence(T0, 0, "")
    assert evidence({"state": {"last_seq": None}}, T0) == Evidence(T0, 0, "")


def test_proofs_at_counts_pending_evidence_only_up_to_the_sequence():
    p = Proofs()
    p.add(Evidence(2 * S, 20, "a"), applied=10)
    assert p.at(15) is None  # its writes are not all there at 15
    assert p.at(20) == Evidence(2 * S, 20, "a")  # with no evidence reached before
    p.add(Evidence(1 * S, 10, "a"), applied=10)
    assert p.at(10) == Evidence(1 * S, 10, "a")  # what was reached, with nothing pending fit
    assert p.at(15) == Evidence(1 * S, 10, "a")


def test_proofs_keep_pending_max_observations():
    p = Proofs()
    for i in range(PENDING_MAX + 1):  # each ahead of the replica
        p.add(Evidence((i + 1) * S, 100 + i, "a"), applied=0)
    assert p.reached(100) is None  # the oldest was let go
    assert p.reached(101) == Evidence(2 * S, 101, "a")
    assert p.required(0) == Evidence(2 * S, 101, "a")  # and it is out of the recent ones too


@pytest.mark.parametrize("applied", [19, 20])
def test_evidence_at_the_replicas_own_sequence_is_reached_at_once(applied):
    p = Proofs()
    p.add(Evidence(2 * S, 20, "a"), applied=applied)
    assert (p.best is not None) == (applied >= 20)


def test_evidence_age_is_whole_milliseconds_and_0_when_just_shown():
    fr, clock = fresh()
    fr.caught_up = True
    fr.note(replicated(last_seq=5, active_ns=1), T0, applied=5)  # as of T0 - 1 ns
    clock.now = fr.heard_ns = T0 - 1
    assert fr.ages_ms(5) == (0, 0)
    clock.now = T0 - 1 + 1500 * MS + MS // 2
    assert fr.ages_ms(5)[1] == 1500 and isinstance(fr.ages_ms(5)[1], int)
