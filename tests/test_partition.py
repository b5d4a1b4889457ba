"""Network partitions against a real 3-node JetStream cluster and a real sidecar, each server
and the sidecar in a network namespace of its own (support/partition.py): the short forms of
bench/partition_bench.py's faults. Every read is judged against the writer's acknowledgements
(support/staleness_check.py): none may be older than a write acknowledged more than
max_stale_ms before it was sent (a tenth of them are `CONSISTENCY strong`: none older than a
write acknowledged before it was sent), none older than an earlier read of the key on its
connection.

Needs root, `ip netns` and iptables (make system-deps); the delay/reordering faults also
NetfilterQueue (the test extra). Skipped, saying which, where any is missing.
"""
from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.partition import (
    FAULTS,
    PartitionEnv,
    RunConfig,
    describe,
    run_fault,
    shaper_unavailable,
    unavailable,
)
from support.staleness_check import row, table

pytestmark = pytest.mark.servers

# Rows for the terminal summary (conftest.pytest_terminal_summary prints them).
PARTITION_ROWS: list[dict[str, str]] = []

# Short forms: a few hundred keys, a fault held 5 s (8 s where a new stream leader must be
# elected and writes acknowledged by it age past max_stale_ms before the old one is healed).
SHORT = dict(keys=300, rate=300.0, warmup=1.5, tail=5.0, max_stale_ms=2000, heartbeat_ms=1000,
             read_rate=1000.0, strong_share=0.1)
HOLD = {"a": 5.0, "b": 5.0, "c": 5.0, "d": 8.0, "e": 5.0, "f": 8.0, "g": 8.0, "h": 0.0, "i": 8.0,
        "j": 8.0}
# After a leader's heal nats-server itself takes seconds to be whole again (its black-holed
# routes are replaced, then the old leader's higher term forces an election): the reads are
# followed long enough to see the sidecar back after that, not timed against it.
TAIL = {"d": 15.0, "f": 15.0, "g": 15.0, "i": 15.0, "j": 15.0}


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Iterator[PartitionEnv]:
    if why := unavailable():
        pytest.skip(f"network partitions: {why}")
    with PartitionEnv(tmp_path_factory.mktemp("partition")) as e:
        yield e


def _run(env: PartitionEnv, fault: str, **over) -> object:
    cfg = RunConfig(**{**SHORT, "hold": HOLD.get(fault, 5.0), "tail": TAIL.get(fault, SHORT["tail"]), **over})
    r = run_fault(env, fault, cfg, log=lambda s: None)
    PARTITION_ROWS.append(row(fault, r.verdict))
    print("\n" + table([PARTITION_ROWS[-1]]) + "\n" + describe(r))
    return r


@pytest.mark.parametrize("fault", sorted(HOLD), ids=[f"{f}-{FAULTS[f][:40]}" for f in sorted(HOLD)])
def test_no_stale_read_and_no_regression(env, fault):
    if fault in ("a", "e") and (why := shaper_unavailable()):
        pytest.skip(why)
    r = _run(env, fault)
    v = r.verdict
    assert v.reads > 1000 and v.acks > 300, f"too little load to judge: {v.reads} reads, {v.acks} acks"
    assert not v.stale, f"{len(v.stale)} stale reads\n{describe(r)}"
    assert not v.regressions, f"{len(v.regressions)} regressions\n{describe(r)}"
    assert v.recovery_s is not None, \
        f"reads still failing or stale {TAIL.get(fault, SHORT['tail'])}s after the heal\n{describe(r)}"
    if fault == "c":
        # two servers stay reachable: the sidecar should mostly go on answering (the bench
        # asks for 90% over a 20 s hold; a 5 s hold is dominated by the switch itself)
        assert v.availability >= 0.6, f"availability {v.availability:.1%} with two servers reachable\n{describe(r)}"


def test_the_checker_catches_an_injected_stale_reader(env):
    """A sidecar told it may serve a replica 10 minutes old, cut from every server while the
    writer goes on: the checker (at 2 s) must count its answers stale."""
    r = _run(env, "stale-injected", hold=5.0, max_stale_ms=600_000, check_stale_ms=2000)
    v = r.verdict
    assert v.stale, f"the checker saw no stale read from a sidecar serving a stale replica\n{describe(r)}"
    s = v.stale[0]
    assert s.read.counter < s.newest_counter or s.read.status == "nil"
    assert s.age_ms > 2000
    # the strong reads' rule (bound 0) sees those answers too
    assert r.plain_at_bound_0 >= len(v.stale) - v.strong_stale
