"""Reads never go back in time, whatever mix of commands and consistency levels reads a key
(they once did: `KV.GET k CONSISTENCY strong` answered revision r from the stream leader,
and the next plain `KV.GET k` on the same connection answered a revision below r from the
replica, which may lag within max_stale_ms).

A writer updates a few keys about 2,000 times/s (each value is the key's write counter)
while connections read them every way (tests/checkers.py MixedReads: strong, MINREV, plain
KV.GET, GET, MGET, EXISTS, pipelined), on one server and across a stream leader kill on a
3-node cluster. One key lies outside the sidecar's filters: always read from NATS. The
figures are printed (`pytest -s`); assertions are about regressions and errors, never times.
"""
from __future__ import annotations

import asyncio

import nats
import pytest
from support.checkers import (
    CounterWriter,
    MixedReads,
    kill_stream_leader,
    new_bucket,
    until,
    wait_synced,
)
from support.topology import replicated_kv, start_server

pytestmark = pytest.mark.timeout(300)

REPLICATED = [f"k.{i}" for i in range(4)]
OUTSIDE = "x.0"           # not in the sidecar's filters (`<bucket>:k.>`)
KEYS = [*REPLICATED, OUTSIDE]
WRITE_RATE = 2000.0
READS = 100_000


def _figures(name: str, reads: MixedReads, writer: CounterWriter) -> str:
    return (f"{name}: {reads.summary()}; writes {writer.ok} ok / {writer.failed} failed "
            f"at {writer.achieved:.0f}/s")


async def test_reads_never_go_back_across_consistency_levels(nats_server, sidecars):
    nc = await nats.connect(nats_server.url, allow_reconnect=False)
    try:
        b = new_bucket()
        kv = await nc.jetstream().create_key_value(bucket=b, history=1)
        writer = CounterWriter(kv, KEYS, rate=WRITE_RATE)
        await writer.prime()
        sc = sidecars(nats_server.url, f"{b}:k.>").start(wait_synced=False)
        await wait_synced(sc, b, keys=len(REPLICATED))
        writer.start()
        try:
            reads = await MixedReads(sc.socket, KEYS, reads=READS).run()
        finally:
            await writer.stop()
        with sc.client() as c:
            stats = c.info("stats")["stats"]
        print("\n" + _figures("one server", reads, writer), stats)
        assert not reads.regressions, reads.summary()
        assert reads.missing == 0 and reads.failed == 0, reads.summary()
        assert reads.reads >= READS, reads.summary()
        assert stats["gets_local"] > 0 and stats["gets_remote"] > 0, stats
    finally:
        await nc.close()


async def test_reads_never_go_back_across_a_leader_kill(nats_cluster, sidecars):
    """The same reads while the stream leader is killed and restarted: strong reads fail
    during the election (counted, not judged), the rest must still never go back."""
    nc = await nats.connect(servers=nats_cluster.urls, connect_timeout=5, reconnect_time_wait=0.2,
                            max_reconnect_attempts=-1)
    js = nc.jetstream(timeout=2)
    try:
        b = new_bucket()
        kv = await replicated_kv(js, bucket=b, replicas=3, history=1)
        writer = CounterWriter(kv, KEYS, rate=WRITE_RATE)
        await writer.prime()
        sc = sidecars(",".join(nats_cluster.urls), f"{b}:k.>").start(wait_synced=False)
        await wait_synced(sc, b, keys=len(REPLICATED))
        writer.start()
        reads = MixedReads(sc.socket, KEYS, reads=10 * READS)
        running = asyncio.create_task(reads.run())

        async def progressed(n: int) -> None:
            await until(lambda: running.done() or reads.reads >= n, 240, f"{n} reads")
            if running.done():
                running.result()  # a reader failed: say how

        try:
            await progressed(READS // 5)
            victim = await kill_stream_leader(js, nats_cluster, f"KV_{b}")
            await progressed(reads.reads + READS // 5)  # reads and writes with the new leader
            await start_server(victim)
            await asyncio.to_thread(nats_cluster.wait_ready)
            await progressed(max(READS, reads.reads + READS // 5))
        finally:
            reads.stop()
            await running
            await writer.stop()
            for s in nats_cluster.servers:  # whatever happened, leave the cluster whole
                if not s.running:
                    s.start()
            nats_cluster.wait_ready()
        print("\n" + _figures("leader kill", reads, writer))
        assert not reads.regressions, reads.summary()
        assert reads.missing == 0, reads.summary()
        assert reads.reads >= READS, reads.summary()
    finally:
        await nc.close()
