"""Quorum evidence (kvcache.feed.quorum) on stream infos shaped as nats-server answers them.

The documents are nats-server's STREAM.INFO `cluster` sections as tests/test_partition.py's
cluster returns them (names, `active` in ns); the arithmetic is the argument in the module
docstring and docs/architecture.md, "Freshness under a partition".
"""
from __future__ import annotations

from kvcache.feed.quorum import Evidence, Proofs, evidence, needs_quorum

S = 1_000_000_000


def info(replicas: int, leader: str | None, actives: list[int | None], last_seq: int = 100,
         offline: tuple[int, ...] = ()) -> dict:
    cluster: dict = {"name": "c"}
    if leader:
        cluster["leader"] = leader
    if replicas > 1:
        cluster["replicas"] = [
            {"name": f"n{i}", "current": True, "peer": f"p{i}",
             **({"active": a} if a is not None else {}), **({"offline": True} if i in offline else {})}
            for i, a in enumerate(actives)]
    return {"config": {"name": "KV_b", "num_replicas": replicas}, "state": {"last_seq": last_seq},
            "cluster": cluster}


def test_a_lone_server_or_r1_stream_is_its_own_proof():
    assert evidence({"config": {"num_replicas": 1}, "state": {"last_seq": 7}}, 5 * S) == Evidence(5 * S, 7, "")
    r1 = info(1, "n0", [])
    assert not needs_quorum(r1)
    assert evidence(r1, 5 * S) == Evidence(5 * S, 100, "n0")


def test_three_members_need_one_follower_heard_from():
    ev = evidence(info(3, "n9", [int(0.3 * S), int(7 * S)]), 10 * S)
    assert ev == Evidence(10 * S - int(0.3 * S), 100, "n9")
    # the cut-off leader: both followers silent for seconds, so the proof ages with them
    ev = evidence(info(3, "n9", [int(8 * S), int(9 * S)]), 10 * S)
    assert ev is not None and ev.as_of_ns == 2 * S


def test_five_members_need_two_followers():
    ev = evidence(info(5, "n9", [int(0.1 * S), int(6 * S), int(0.2 * S), int(9 * S)]), 10 * S)
    assert ev is not None and ev.as_of_ns == 10 * S - int(0.2 * S)


def test_no_leader_offline_or_unmeasured_followers_prove_nothing():
    assert evidence(info(3, None, [0, 0]), 10 * S) is None
    assert evidence(info(3, "n9", [None, None]), 10 * S) is None
    assert evidence(info(3, "n9", [0, 0], offline=(0, 1)), 10 * S) is None
    # a follower marked offline is skipped even with a small active
    ev = evidence(info(3, "n9", [1000, int(2 * S)], offline=(0,)), 10 * S)
    assert ev is not None and ev.as_of_ns == 8 * S


def test_a_follower_never_heard_from_proves_nothing():
    """nats-server reports `active` 0 for a follower it has not heard from since it became
    leader (clusterInfo: a zero last-seen is 0; raft.go zeroes the other followers' on a
    leader change). A leader cut off right after its election shows one follower at 0 and the
    other ageing: seen as "heard just now", the replica stayed fresh at the cut-off leader's
    sequence while the majority moved on (tests/test_partition.py, fault i, 149 stale reads
    in CI at 3d575a0)."""
    assert evidence(info(3, "n9", [0, int(6 * S)]), 10 * S) == Evidence(4 * S, 100, "n9")
    assert evidence(info(3, "n9", [0, 0]), 10 * S) is None
    assert evidence(info(5, "n9", [0, int(0.1 * S), int(0.2 * S), 0]), 10 * S) == \
        Evidence(10 * S - int(0.2 * S), 100, "n9")


def test_two_members_cannot_elect_without_the_leader():
    ev = evidence(info(2, "n9", [int(30 * S)]), 10 * S)
    assert ev == Evidence(10 * S, 100, "n9")


def test_proofs_count_only_what_the_replica_reached():
    p = Proofs()
    p.add(Evidence(1 * S, 10, "a"), applied=10)
    p.add(Evidence(2 * S, 20, "a"), applied=15)   # writes up to 20 still on their way
    assert p.reached(15) == Evidence(1 * S, 10, "a")
    assert p.at(20) == Evidence(2 * S, 20, "a")
    assert p.reached(15) == Evidence(1 * S, 10, "a")  # `at` changed nothing
    assert p.reached(20) == Evidence(2 * S, 20, "a")
    # an older observation never replaces a newer one
    p.add(Evidence(int(1.5 * S), 12, "a"), applied=20)
    assert p.reached(20) == Evidence(2 * S, 20, "a")


def test_required_is_the_least_demanding_recent_proof():
    p = Proofs()
    p.add(Evidence(1 * S, 10, "a"), applied=0)
    p.add(Evidence(2 * S, 20, "a"), applied=0)
    p.add(Evidence(3 * S, 30, "a"), applied=0)
    assert p.required(2 * S) == Evidence(2 * S, 20, "a")
    assert p.required(int(3.5 * S)) is None
    p.clear()
    assert p.required(0) is None and p.reached(100) is None
