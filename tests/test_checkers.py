"""The checkers must be able to fail: a checker that never reports is worse than none."""
from __future__ import annotations

import hiredis
import nats
import pytest
from support.checkers import (
    Differences,
    MixedReads,
    MonotonicReads,
    differences,
    lag_probe,
    new_bucket,
    replica_state,
)
from support.sidecar_proc import SidecarProcess

pytestmark = pytest.mark.timeout(120)


def test_differences_name_extra_missing_and_differing_keys() -> None:
    want = {"a": (b"1", 1), "b": (b"2", 2), "c": (b"3", 3)}
    have = {"a": (b"1", 1), "b": (b"2", 1), "d": (b"4", 4)}
    d = Differences.between(want, have)
    assert (d.extra, d.missing, d.differ, d.count) == (["d"], ["c"], ["b"], 3)
    assert Differences.between(want, dict(want)).count == 0


def test_monotonic_reads_flags_a_revision_going_down() -> None:
    reads = MonotonicReads("/nonexistent", ["k"])
    for key, rev in [("k", 3), ("k", 5), ("k", None), ("j", 1), ("k", 5), ("k", 4)]:
        reads.observe(key, rev)
    assert [(r.key, r.before, r.after) for r in reads.regressions] == [("k", 5, 4)]
    assert reads.reads == 6


def test_mixed_reads_flag_a_value_going_down_after_a_completed_read() -> None:
    reads = MixedReads("/nonexistent", ["k"])
    floor: dict[bytes, int] = {}  # one batch of one connection, replies in order
    reads._check("strong", [b"k"], [b"5", 6, 0, b"PUT", b"leader"], floor)
    reads._check("get", [b"k"], b"4", floor)                 # after the 5, same connection
    reads._check("mget", [b"k", b"k"], [b"5", None], floor)  # a key that exists, missing
    reads._check("exists", [b"k"], 0, floor)
    reads._check("kv.get", [b"k"], hiredis.ReplyError("ERR x"), floor)
    assert [(r.key, r.before, r.after, r.command) for r in reads.regressions] == [("k", 5, 4, "get")]
    assert (reads.reads, reads.failed, reads.missing) == (4, 1, 2)
    assert reads.high == {b"k": 5} and reads.rev == {b"k": 6}
    reads._check("get", [b"k"], b"3", {})  # sent before the 5 was read: not compared
    assert len(reads.regressions) == 1


async def test_checkers_on_a_live_sidecar(nats_server, tmp_path) -> None:
    """A converged replica has no differences; compared with another bucket of other content
    it has many. The staleness probe sees every write it made; the reads saw no regression."""
    nc = await nats.connect(nats_server.url)
    b, other = new_bucket(), new_bucket()
    sc = None
    try:
        js = nc.jetstream()
        kv = await js.create_key_value(bucket=b)
        for i in range(20):
            await kv.put(f"k.{i}", b"%d" % i)
        sc = SidecarProcess(tmp_path / "sc", nats_server.url, buckets=[b]).start()
        async with MonotonicReads(sc.socket, [f"k.{i}" for i in range(20)]) as reads:
            lag = await lag_probe(js, b, sc.socket, rate=200, seconds=1)
        assert lag.writes == 200 and lag.unseen == 0 and len(lag.samples) == 200 and not lag.failed_writes
        assert reads.reads > 0 and not reads.regressions and not reads.failed
        assert (await differences(sc.data_dir, kv, b, timeout=10)).count == 0

        kv2 = await js.create_key_value(bucket=other)
        await kv2.put("k.0", b"x")
        await kv2.put("only.there", b"y")
        d = await differences(sc.data_dir, kv2, b, timeout=0)
        assert d.differ == ["k.0"] and d.missing == ["only.there"] and {"k.1", "lag.probe"} <= set(d.extra)
        assert replica_state(sc.data_dir, b)["k.3"] == (b"3", 4)
    finally:
        if sc:
            sc.kill()
        await nc.close()


def test_a_wait_ends_at_once_when_the_predicate_gives_up():
    """The harness's poller (support.poll): an exception is "not yet", but GiveUp (raised
    when the sidecar awaited has exited, support.sidecar_proc.SidecarExited) ends the wait on
    the spot instead of polling out its timeout."""
    from support.poll import GiveUp, wait_until
    from support.sidecar_proc import SidecarExited
    calls = []

    def exited():
        calls.append(1)
        raise SidecarExited("sidecar exited with 2")
    with pytest.raises(GiveUp, match="exited with 2"):
        wait_until(exited, 3600, "the sidecar to serve", interval=0)
    assert len(calls) == 1

    def flaky():
        calls.append(1)
        if len(calls) < 4:
            raise OSError("not yet")
        return "served"
    assert wait_until(flaky, 3600, "the sidecar to serve", interval=0) == "served"
