"""The fleet's shared stream-state polls (kvcache.feed.fleet): one sidecar asks, every sidecar of
the bucket learns; the cluster's STREAM.INFO load does not grow with the number of sidecars.

Real 3-node cluster, R3 bucket, three `kvcache serve` processes. What the cluster is asked is
counted by a subscriber on the stream's STREAM.INFO subject (the requests pass it on their way
to the leader).
"""
from __future__ import annotations

import asyncio
import time

import nats
import pytest
from support.poll import until
from support.sidecar_proc import SidecarProcess
from support.topology import replicated_kv, settled

from kvcache.feed.fleet import StateShare

pytestmark = pytest.mark.timeout(180)

BUCKET = "fleet"
STALE_MS = 2000          # the state poll's period at this bound: 0.75 s (Maintenance.watch_period)
PERIOD_S = 0.75


# ----------------------------------------------------------------------------- who polls, in process

class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _share(clock: _Clock, sid: str) -> StateShare:
    s = StateShare(None, clock=clock)  # type: ignore[arg-type]  # no connection: only the choice
    s.id = sid
    return s


@pytest.mark.quick
def test_one_sidecar_polls_the_lowest_id_keeps_it_and_another_takes_over():
    clock = _Clock()
    a, b = _share(clock, "1"), _share(clock, "2")
    assert a.should_poll("k", PERIOD_S) and b.should_poll("k", PERIOD_S), "nobody heard: both poll"
    # both polled and heard each other: the lower id goes on, the higher defers
    for s in (a, b):
        s._polled["k"] = clock.t
    a._heard["k"] = (clock.t, "2")
    b._heard["k"] = (clock.t, "1")
    clock.t += PERIOD_S
    assert a.should_poll("k", PERIOD_S) and not b.should_poll("k", PERIOD_S)
    # b has stopped; a goes on, b hears it every period
    a._polled["k"] = clock.t
    b._heard["k"] = (clock.t, "1")
    clock.t += PERIOD_S
    assert not b.should_poll("k", PERIOD_S)
    # a goes away: b polls once no answer came within 1.5 periods
    clock.t += PERIOD_S
    assert b.should_poll("k", PERIOD_S)
    # a sidecar of higher id that polls does not stop one of lower id that is not polling:
    # the lower waits for the higher's answers only while it does not poll itself
    c = _share(clock, "0")
    c._heard["k"] = (clock.t, "2")
    assert not c.should_poll("k", PERIOD_S)


# ----------------------------------------------------------------------------- three sidecars

async def _stream_info_rate(url: str, stream: str, seconds: float) -> float:
    """STREAM.INFO requests per second for `stream`, seen on its API subject."""
    nc = await nats.connect(url)
    try:
        n = 0

        async def count(_msg) -> None:
            nonlocal n
            n += 1
        sub = await nc.subscribe(f"$JS.API.STREAM.INFO.{stream}", cb=count)
        await nc.flush()
        t0 = time.monotonic()
        await asyncio.sleep(seconds)  # a measurement window, not a wait for a state
        rate = n / (time.monotonic() - t0)
        await sub.unsubscribe()
        return rate
    finally:
        await nc.close()


def _row(sc: SidecarProcess) -> dict:
    return sc.buckets()[BUCKET]


async def test_three_sidecars_ask_the_cluster_as_one(nats_cluster, tmp_path):
    nc = await nats.connect(nats_cluster.urls[0])
    try:
        kv = await replicated_kv(nc.jetstream(), bucket=BUCKET, replicas=3, history=1)
        for i in range(20):
            await settled(lambda i=i: kv.put(f"k.{i}", b"v%d" % i))
    finally:
        await nc.close()
    urls = ",".join(nats_cluster.urls)
    scs = [SidecarProcess(tmp_path / f"sc{i}", urls, buckets=[BUCKET],
                          extra=["--max-stale-ms", str(STALE_MS), "--heartbeat-ms", "1000"])
           for i in range(3)]
    try:
        for sc in scs:
            sc.start(wait_synced=True)
        # settled: every sidecar has taken answers from another, or polls itself
        for sc in scs:
            sc.wait_for(lambda sc=sc: _row(sc)["state_polls"] > 4, 30, "state polls running")
        await until(lambda: sum(_row(sc)["state_shared"] > 0 for sc in scs) >= 2, 30,
                    "two of the three sidecars taking the third's answers")
        rate = await _stream_info_rate(nats_cluster.urls[0], f"KV_{BUCKET}", 5 * PERIOD_S * 2)
        # one poller asks once per period (1.3/s); three pollers would ask 4/s
        assert rate < 1.5 * (1 / PERIOD_S), f"{rate:.1f} STREAM.INFO/s for three sidecars"
        # every sidecar fresh on the shared evidence: a write is served by all three
        nc = await nats.connect(nats_cluster.urls[1])
        try:
            kv = await nc.jetstream().key_value(BUCKET)
            await settled(lambda: kv.put("k.new", b"fresh"))
        finally:
            await nc.close()
        for sc in scs:
            with sc.client() as c:
                await until(lambda c=c: c.get(f"{BUCKET}:k.new") == b"fresh", 30, "the write served")
        # the poller goes away: another takes over, and the fleet stays fresh
        shared = [_row(sc)["state_shared"] for sc in scs]
        poller = min(range(3), key=lambda i: shared[i])
        scs[poller].kill()
        rest = [sc for i, sc in enumerate(scs) if i != poller]
        before = [_row(sc)["state_polls"] - _row(sc)["state_shared"] for sc in rest]
        await until(lambda: any(_row(sc)["state_polls"] - _row(sc)["state_shared"] > b + 2
                                for sc, b in zip(rest, before, strict=True)), 30,
                    "another sidecar polling after the poller stopped")
        # a whole-stream purge leaves no message: every remaining sidecar sees it through
        # whichever of them polls
        nc = await nats.connect(nats_cluster.urls[2])
        try:
            await settled(lambda: nc.jetstream().purge_stream(f"KV_{BUCKET}"))
        finally:
            await nc.close()
        for sc in rest:
            sc.wait_for(lambda sc=sc: _row(sc)["keys"] == 0, 30, "the purge seen")
    finally:
        for sc in scs:
            sc.kill(check=False)
        for sc in scs:
            sc.check_log()
