"""The feed, end to end: `kvcache serve` as a real process against real nats-server processes,
with nats-py as the writer. The replica's content is read back with kvcache.LocalReader (the
LMDB files themselves) or over the socket, and compared with what nats-py's `kv.get` says.
"""
from __future__ import annotations

import asyncio
import os

import nats
import nats.js.errors
import pytest
from nats.js.api import KeyValueConfig
from support.checkers import (
    bucket_info,
    converged,
    new_bucket,
    replica_state,
    settled,
    until,
    upstream_state,
    wait_synced,
)
from support.scrape import METRICS_ENV, metrics_address, replica_error_retries
from support.sidecar_proc import SidecarProcess
from support.topology import replicated_kv, start_single

from kvcache import LocalReader
from kvcache.errors import UpstreamError
from kvcache.feed.consumer import PullConsumer
from kvcache.natsio import jetstream as jsapi
from kvcache.natsio.nats_connection import NatsConnection
from kvcache.store.replica import Replica

pytestmark = pytest.mark.timeout(120)



# ----------------------------------------------------------------------------- helpers

def log_since(sc: SidecarProcess, offset: int) -> str:
    return sc.log_path.read_bytes()[offset:].decode(errors="replace")


def log_size(sc: SidecarProcess) -> int:
    return sc.log_path.stat().st_size if sc.log_path.exists() else 0


# ----------------------------------------------------------------------------- initial sync

async def test_initial_sync_matches_upstream(nats_server_module, nc, sidecars):
    js = nc.jetstream()
    b = new_bucket()
    kv = await js.create_key_value(bucket=b, history=5)
    long_key = "long." + ".".join(["segment-0123456789"] * 40)
    for i in range(300):
        await kv.put(f"k.{i:03d}", f"value {i}".encode())
    for i in range(0, 300, 7):
        await kv.put(f"k.{i:03d}", f"updated {i}".encode())
    for i in range(0, 300, 11):
        await kv.delete(f"k.{i:03d}")
    for i in range(5, 300, 13):
        await kv.purge(f"k.{i:03d}")
    await kv.put("bin", b"\r\n\x00\xff*1\r\n$4\r\nPING\r\n")
    await kv.put(long_key, b"long")
    await kv.put("big", os.urandom(512 * 1024))

    sc = sidecars(nats_server_module.url, b).start(wait_synced=False)
    want = await upstream_state(kv)
    row = await wait_synced(sc, b, keys=len(want))
    assert replica_state(sc.data_dir, b) == want
    assert long_key in want and "bin" in want and "k.000" not in want and "k.005" not in want
    status = await js.stream_info(f"KV_{b}")
    assert row["applied_seq"] == status.state.last_seq
    assert row["resyncs"] == 0
    with sc.client() as c:
        assert c.get(f"{b}:bin") == b"\r\n\x00\xff*1\r\n$4\r\nPING\r\n"
        assert c.get(f"{b}:{long_key}") == b"long"
        assert c.get(f"{b}:k.011") is None  # deleted upstream
        assert sorted(c.keys("*")) == sorted(want)


async def test_empty_bucket_syncs(nats_server_module, nc, sidecars):
    js = nc.jetstream()
    b = new_bucket()
    kv = await js.create_key_value(bucket=b)
    sc = sidecars(nats_server_module.url, b).start(wait_synced=False)
    row = await wait_synced(sc, b, keys=0)
    assert (row["keys"], row["applied_seq"], row["resyncs"]) == (0, 0, 0)
    # ...and then live updates arrive.
    await kv.put("first", b"1")
    await until(lambda: replica_state(sc.data_dir, b) == {"first": (b"1", 1)}, what="first live put")


async def test_key_filters(nats_server_module, nc, sidecars):
    js = nc.jetstream()
    b = new_bucket()
    kv = await js.create_key_value(bucket=b)
    every = ["a.1", "a.x.y", "b.1", "b.1.2", "c.1", "ab.1"]
    for key in every:
        await kv.put(key, key.encode())
    sc = sidecars(nats_server_module.url, f"{b}:a.>,b.*").start(wait_synced=False)
    await wait_synced(sc, b, keys=3)
    assert sorted(replica_state(sc.data_dir, b)) == ["a.1", "a.x.y", "b.1"]
    with sc.client() as c:
        assert sorted(c.keys("*")) == ["a.1", "a.x.y", "b.1"]

    # Live: only matching keys arrive.
    await kv.put("c.2", b"no")
    await kv.put("a.2", b"yes")
    await kv.delete("b.1")
    every += ["c.2", "a.2"]
    await until(lambda: sorted(replica_state(sc.data_dir, b)) == ["a.1", "a.2", "a.x.y"], what="filtered live updates")

    # Unmatched keys churn: the position still follows the stream (the consumer's heartbeats
    # say how far it has looked), and is stored.
    for i in range(20):
        last = await kv.put("c.1", f"{i}".encode())

    def stored_position():
        with LocalReader(str(sc.data_dir), max_stale_ms=10**9, bucket=b) as r:
            return r.meta(b).applied_seq
    await until(lambda: stored_position() == last, what=f"stored position to reach {last}")
    sc.kill()

    # While down, every key changes (history=1), so the stream's first sequence moves past
    # everything before: a replica that had stopped at the last *matching* message could not
    # resume, one that followed the heartbeats can.
    for key in every:
        await kv.put(key, b"while down")
    await kv.put("b.9", b"new")
    first = (await js.stream_info(f"KV_{b}")).state.first_seq
    assert first == last + 1
    offset = log_size(sc)
    sc.start(wait_synced=False)
    await until(lambda: sorted(replica_state(sc.data_dir, b)) == ["a.1", "a.2", "a.x.y", "b.1", "b.9"],
                what="resumed filtered replica")
    row = await wait_synced(sc, b)
    assert row["resyncs"] == 0
    assert f"resuming after sequence {last}" in log_since(sc, offset)
    assert replica_state(sc.data_dir, b)["a.1"][0] == b"while down"


# ----------------------------------------------------------------------------- live updates

async def test_live_put_del_purge(nats_server_module, nc, sidecars):
    js = nc.jetstream()
    b = new_bucket()
    kv = await js.create_key_value(bucket=b, history=10)
    await kv.put("stay", b"s")
    sc = sidecars(nats_server_module.url, b).start(wait_synced=False)
    await wait_synced(sc, b, keys=1)

    rev = await kv.put("k", b"v1")
    await until(lambda: replica_state(sc.data_dir, b).get("k") == (b"v1", rev), what="put")
    rev = await kv.put("k", b"v2")
    await until(lambda: replica_state(sc.data_dir, b).get("k") == (b"v2", rev), what="update")
    await kv.delete("k")
    await until(lambda: "k" not in replica_state(sc.data_dir, b), what="delete")
    rev = await kv.put("k", b"v3")
    await until(lambda: replica_state(sc.data_dir, b).get("k") == (b"v3", rev), what="put after delete")
    await kv.purge("k")
    await until(lambda: "k" not in replica_state(sc.data_dir, b), what="purge")
    rev = await kv.put("k", b"v4")
    await until(lambda: replica_state(sc.data_dir, b).get("k") == (b"v4", rev), what="put after purge")
    with sc.client() as c:
        assert c.get(f"{b}:k") == b"v4"
    await converged(sc, kv, b)


async def test_server_placed_expiry_markers_remove_keys(nats_server_module, nc, sidecars):
    """A bucket with limit markers: the server itself writes a marker (Nats-Marker-Reason,
    no KV-Operation) when a key's TTL runs out; the feed must treat it as a delete."""
    js = nc.jetstream()
    b = new_bucket()
    kv = await js.create_key_value(KeyValueConfig(bucket=b, ttl=1.0, limit_marker_ttl=1.0))
    sc = sidecars(nats_server_module.url, b).start(wait_synced=False)
    await wait_synced(sc, b, keys=0)
    await kv.put("short-lived", b"x")
    await until(lambda: "short-lived" in replica_state(sc.data_dir, b), what="put")
    await until(lambda: "short-lived" not in replica_state(sc.data_dir, b), timeout=30, what="expiry marker applied")


# ----------------------------------------------------------------------------- restarts

async def test_warm_restart_after_kill_resumes_without_resync(nats_server_module, nc, sidecars):
    js = nc.jetstream()
    b = new_bucket()
    kv = await js.create_key_value(bucket=b, history=3)
    for i in range(200):
        await kv.put(f"k.{i:03d}", f"v{i}".encode())
    sc = sidecars(nats_server_module.url, b).start(wait_synced=False)
    await wait_synced(sc, b, keys=200)
    sc.kill()

    for i in range(200, 250):
        await kv.put(f"k.{i:03d}", b"new while down")
    for i in range(0, 50):
        await kv.put(f"k.{i:03d}", b"updated while down")
    for i in range(50, 80):
        await kv.delete(f"k.{i:03d}")
    for i in range(80, 90):
        await kv.purge(f"k.{i:03d}")

    offset = log_size(sc)
    sc.start(wait_synced=False)
    want = await converged(sc, kv, b)
    assert len(want) == 250 - 40
    row = await wait_synced(sc, b, keys=len(want))
    assert row["resyncs"] == 0
    status = await js.stream_info(f"KV_{b}")
    assert row["applied_seq"] == status.state.last_seq
    log = log_since(sc, offset)
    assert "resuming after sequence 200" in log
    assert "full resync" not in log


async def test_reconcile_removes_keys_that_vanished_while_down(nats_server_module, nc, sidecars):
    """A delete whose marker was purged before the sidecar saw it leaves nothing in the stream
    to replay: only the reconcile pass after the resume can find it."""
    js = nc.jetstream()
    b = new_bucket()
    kv = await js.create_key_value(bucket=b, history=5)
    for i in range(20):
        await kv.put(f"k.{i:02d}", b"v")
    sc = sidecars(nats_server_module.url, b).start(wait_synced=False)
    await wait_synced(sc, b, keys=20)
    sc.kill()

    await kv.delete("k.03")
    await kv.delete("k.07")
    await js.purge_stream(f"KV_{b}", subject=f"$KV.{b}.k.03")  # takes the DEL marker with it
    await js.purge_stream(f"KV_{b}", subject=f"$KV.{b}.k.07")
    await kv.put("k.20", b"added")

    offset = log_size(sc)
    sc.start(wait_synced=False)
    want = await converged(sc, kv, b)
    assert "k.03" not in want and "k.07" not in want and "k.20" in want
    row = await wait_synced(sc, b, keys=19)
    assert row["resyncs"] == 0  # resumed, and reconciled: no full resync
    await until(lambda: "reconcile removed 2 keys" in log_since(sc, offset), what="reconcile log line")


async def test_stream_purged_while_down(nats_server_module, nc, sidecars):
    js = nc.jetstream()
    b = new_bucket()
    kv = await js.create_key_value(bucket=b)
    for i in range(10):
        await kv.put(f"k.{i}", b"v")
    sc = sidecars(nats_server_module.url, b).start(wait_synced=False)
    await wait_synced(sc, b, keys=10)
    sc.kill()
    await js.purge_stream(f"KV_{b}")  # everything gone, nothing left to replay
    sc.start(wait_synced=False)
    await until(lambda: replica_state(sc.data_dir, b) == {}, what="purged bucket reflected")
    await kv.put("after", b"a")
    await converged(sc, kv, b)


async def test_ttl_expiry_while_down(nats_server_module, nc, sidecars):
    js = nc.jetstream()
    b = new_bucket()
    kv = await js.create_key_value(bucket=b, ttl=1.0)
    for i in range(10):
        await kv.put(f"k.{i}", b"v")
    sc = sidecars(nats_server_module.url, b).start(wait_synced=False)
    await wait_synced(sc, b, keys=10)
    sc.kill()

    async def expired():
        return (await js.stream_info(f"KV_{b}")).state.messages == 0
    await until(expired, timeout=30, what="keys expired upstream")
    await kv.put("fresh", b"f")
    sc.start(wait_synced=False)
    # "fresh" has the same 1 s TTL and may itself expire while a loaded machine starts the
    # sidecar (an expiry without a marker is only seen by the next reconcile): what this
    # test is about is that no k.* survives the restart.
    await until(lambda: not any(k.startswith("k.") for k in replica_state(sc.data_dir, b))
                and bucket_info(sc, b)["synced"] == 1, what="expired keys gone")


async def test_ttl_expiry_while_running(nats_server_module, nc, sidecars):
    """Keys expired by the bucket's TTL leave a running sidecar's replica (no marker tells
    the feed; the stream's first sequence does), while a key written again stays."""
    js = nc.jetstream()
    b = new_bucket()
    kv = await js.create_key_value(bucket=b, ttl=2.0)
    for i in range(10):
        await kv.put(f"k.{i}", b"v")
    sc = sidecars(nats_server_module.url, b).start(wait_synced=False)
    await wait_synced(sc, b, keys=10)

    async def keep_writing() -> None:
        while True:
            await kv.put("kept", b"again")
            await asyncio.sleep(0.3)
    writer = asyncio.create_task(keep_writing())
    try:
        await until(lambda: sorted(replica_state(sc.data_dir, b)) == ["kept"], timeout=30,
                    what="expired keys gone from the running sidecar")
        with sc.client() as c:
            assert c.get(f"{b}:k.0") is None and c.get(f"{b}:kept") == b"again"
    finally:
        writer.cancel()
    assert bucket_info(sc, b)["resyncs"] == 0
    assert bucket_info(sc, b)["removed_upstream"] >= 10


async def test_full_resync_when_bucket_recreated_while_down(nats_server_module, nc, sidecars):
    js = nc.jetstream()
    b = new_bucket()
    kv = await js.create_key_value(bucket=b)
    for key in ("a", "b", "c"):
        await kv.put(key, b"old " + key.encode())
    for i in range(10):
        await kv.put("c", f"churn {i}".encode())  # the old stream's sequences run ahead
    sc = sidecars(nats_server_module.url, b).start(wait_synced=False)
    await wait_synced(sc, b, keys=3)
    sc.kill()

    await js.delete_key_value(b)
    kv = await js.create_key_value(bucket=b)
    await kv.put("b", b"new b")
    await kv.put("d", b"new d")

    offset = log_size(sc)
    sc.start(wait_synced=False)
    want = await converged(sc, kv, b)
    assert want == {"b": (b"new b", 1), "d": (b"new d", 2)}
    row = await wait_synced(sc, b, keys=2)
    assert row["resyncs"] == 1
    assert row["applied_seq"] == 2
    assert "full resync: stream was recreated" in log_since(sc, offset)


async def test_full_resync_when_the_stream_is_behind_the_replica(nats_server_module, nc, sidecars):
    """The same stream (same creation time) whose last sequence is below what the replica
    applied, as after a stream restored from an older backup: the replica cannot be trusted
    to hold only what the stream holds, so it is synced again from scratch. Made here by
    moving the replica's position ahead while the sidecar is down."""
    js = nc.jetstream()
    b = new_bucket()
    kv = await js.create_key_value(bucket=b)
    for key in ("a", "b", "c"):
        await kv.put(key, b"v " + key.encode())
    sc = sidecars(nats_server_module.url, b).start(wait_synced=False)
    await wait_synced(sc, b, keys=3)
    sc.stop()
    replica = Replica(str(sc.data_dir / "replica"))
    try:
        meta = replica.meta(b)
        assert meta.applied_seq == 3
        meta.applied_seq = 1000  # the stream "went back" from 1000 to 3
        replica.put_meta(b, meta)
    finally:
        replica.close()
    await kv.delete("a")

    offset = log_size(sc)
    sc.start(wait_synced=False)
    want = await converged(sc, kv, b)
    assert set(want) == {"b", "c"}
    row = await wait_synced(sc, b, keys=2)
    assert row["resyncs"] == 1 and row["applied_seq"] == 4
    assert "full resync: stream sequence went backwards (4 < 1000)" in log_since(sc, offset)


async def test_bucket_deleted_and_recreated_while_running(nats_server_module, nc, sidecars):
    js = nc.jetstream()
    b = new_bucket()
    kv = await js.create_key_value(bucket=b)
    for key in ("a", "b", "c"):
        await kv.put(key, b"old")
    sc = sidecars(nats_server_module.url, b).start(wait_synced=False)
    await wait_synced(sc, b, keys=3)

    await js.delete_key_value(b)
    await until(lambda: "stream KV_" in sc.log() and "not found" in sc.log(), what="feed notices the bucket is gone")
    assert sc.proc.poll() is None  # still running, still serving
    with sc.client() as c:
        assert c.ping()
    kv = await js.create_key_value(bucket=b)
    await kv.put("c", b"new c")
    await kv.put("z", b"new z")
    await converged(sc, kv, b)
    row = await wait_synced(sc, b, keys=2)
    assert row["resyncs"] == 1


async def test_recreated_bucket_forgets_the_floors_of_remote_keys(nats_server_module, nc, sidecars):
    """A key outside the filters is read remotely, and its revision becomes a floor that no
    later read may go below. A bucket deleted and made again numbers from 1: the old floors
    must go with it, or every remote read of such a key fails as 'behind'."""
    js = nc.jetstream()
    b = new_bucket()
    kv = await js.create_key_value(bucket=b)
    for i in range(20):
        await kv.put("out.k", b"old %d" % i)
    await kv.put("in.k", b"in")
    sc = sidecars(nats_server_module.url, f"{b}:in.>").start(wait_synced=False)
    await wait_synced(sc, b, keys=1)
    with sc.client() as c:
        assert c.get(f"{b}:out.k") == b"old 19"   # floor: revision 20
    await js.delete_key_value(b)
    kv = await js.create_key_value(bucket=b)
    await kv.put("out.k", b"new")                  # revision 1
    await kv.put("in.k", b"in again")
    await until(lambda: "stream was recreated" in sc.log(), what="the feed sees the bucket made again")
    await wait_synced(sc, b, keys=1)
    with sc.client() as c:
        assert c.get(f"{b}:out.k") == b"new"


async def test_deleted_consumer_is_recreated(nats_server_module, nc, sidecars):
    js = nc.jetstream()
    b = new_bucket()
    stream = f"KV_{b}"
    kv = await js.create_key_value(bucket=b)
    await kv.put("a", b"1")
    sc = sidecars(nats_server_module.url, b).start(wait_synced=False)
    await wait_synced(sc, b, keys=1)

    async def consumer_names() -> list[str]:
        return sorted(c.name for c in await js.consumers_info(stream) if c.name.startswith("kvcache_"))

    (first,) = await until(consumer_names, what="the feed's consumer")
    made = (await js.consumer_info(stream, first)).created
    await js.delete_consumer(stream, first)
    await until(lambda: "recreating consumer" in sc.log(), what="feed notices the deleted consumer")
    # made again under the same name (the sidecar's, kvcache.feed.names): a new consumer
    assert await until(consumer_names, what="a new consumer") == [first]
    assert (await js.consumer_info(stream, first)).created != made
    rev = await kv.put("b", b"2")
    await until(lambda: replica_state(sc.data_dir, b).get("b") == (b"2", rev), what="updates after recreation")
    row = await wait_synced(sc, b, keys=2)
    assert row["resyncs"] == 0


async def test_nats_server_restart_while_running(tmp_path, sidecars):
    server = start_single(tmp_path / "restart")
    try:
        b = new_bucket()
        conn = await nats.connect(server.url, connect_timeout=5, allow_reconnect=False)
        kv = await conn.jetstream().create_key_value(bucket=b)
        for i in range(50):
            await kv.put(f"k.{i}", b"before")
        await conn.close()
        sc = sidecars(server.url, b).start(wait_synced=False)
        await wait_synced(sc, b, keys=50)

        server.stop()
        await until(lambda: "disconnected from NATS" in sc.log(), what="sidecar notices the outage")
        with sc.client() as c:  # the replica is still served while NATS is away
            assert c.get(f"{b}:k.1") == b"before"
        server.start()

        conn = await nats.connect(server.url, connect_timeout=5, allow_reconnect=False)
        try:
            kv = await conn.jetstream().key_value(b)
            await kv.put("k.1", b"after restart")
            await kv.delete("k.2")
            await kv.put("new", b"n")
            want = await converged(sc, kv, b)
            assert want["k.1"][0] == b"after restart"
            row = await wait_synced(sc, b, keys=50)
            assert row["resyncs"] == 0
            # ...and it keeps following.
            rev = await kv.put("later", b"l")
            await until(lambda: replica_state(sc.data_dir, b).get("later") == (b"l", rev), what="later update")
        finally:
            await conn.close()
    finally:
        server.stop()


async def test_stream_leader_failover(nats_cluster, sidecars):
    """An R3 bucket loses its stream leader while the sidecar follows it: the feed's consumer
    goes with the leader, and the feed finds the new one and converges."""
    b = new_bucket()
    conn = await nats.connect(servers=nats_cluster.urls, connect_timeout=5, reconnect_time_wait=0.2)
    victim = None
    try:
        js = conn.jetstream(timeout=10)
        kv = await replicated_kv(js, bucket=b, replicas=3, history=2)
        for i in range(100):
            await settled(lambda i=i: kv.put(f"k.{i:03d}", b"before"))
        sc = sidecars(",".join(nats_cluster.urls), b).start(wait_synced=False)
        await wait_synced(sc, b, keys=100)

        leader = (await js.stream_info(f"KV_{b}")).cluster.leader
        victim = nats_cluster.server(leader)
        victim.kill()

        await settled(lambda: kv.put("after", b"failover"))  # a new stream leader accepts writes
        for i in range(0, 100, 10):
            await settled(lambda i=i: kv.put(f"k.{i:03d}", b"after failover"))
        await settled(lambda: kv.delete("k.001"))
        want = await converged(sc, kv, b, timeout=60)
        assert want["after"][0] == b"failover" and "k.001" not in want
        assert bucket_info(sc, b)["resyncs"] == 0
    finally:
        await conn.close()
        if victim is not None:
            victim.start()
            nats_cluster.wait_ready()


async def test_consumers_are_made_on_the_stream_leader(nats_cluster):
    """nats-server puts an R1 consumer on a random replica of the stream, and the consumer
    reads that replica's store: one restarted a moment ago may be far behind and still report
    nothing pending (how reads once went back in time with all servers restarted). Each of 12
    consumers made in a row on an R3 stream must be on the leader, where the server alone
    would put each elsewhere 2 times in 3."""
    b = new_bucket()
    nc = NatsConnection()
    await nc.connect(servers=nats_cluster.urls, connect_timeout=5)
    try:
        kv = await replicated_kv(nc.jetstream(timeout=10), bucket=b, replicas=3)
        await settled(lambda: kv.put("k", b"v"))
        stream = f"KV_{b}"
        hosts: list[tuple[str, str]] = []
        retries = 0
        for _ in range(12):
            made: list[PullConsumer] = []  # this round's consumer, for its own callbacks

            async def after_create(stream_info: dict, made=made) -> None:
                info = await jsapi.api_request(nc, f"$JS.API.CONSUMER.INFO.{stream}.{made[0].name}", None, 5)
                hosts.append((jsapi.stream_leader(info), jsapi.stream_leader(stream_info)))

            consumer = PullConsumer(
                nc, stream, f"$KV.{b}.", [f"$KV.{b}.>"], start_seq=None, headers_only=True,
                heartbeat_s=1.0, on_batch=lambda runs: runs[-1].last_pending == 0,
                on_idle=lambda _seq, made=made: made[0].finish(), after_create=after_create)
            made.append(consumer)
            await asyncio.wait_for(consumer.run(), 60)
            retries += consumer.placement_retries
        assert len(hosts) == 12 and all(host == leader != "" for host, leader in hosts), hosts
        assert retries > 0  # the server did misplace some (all 12 on the leader by chance: p = 2e-6)
    finally:
        await nc.close()


# ----------------------------------------------------------------------------- a full replica

SMALL_MAP = {"KVCACHE_MAP_SIZE_MB": "1", "KVCACHE_MAX_MAP_SIZE_MB": "4"}


async def test_interrupted_initial_sync_starts_over(nats_server_module, nc, sidecars):
    """The initial set arrives in subject order, not stream order, so a sync that stopped half
    way (here: its replica hit max_map_size) cannot be resumed from the highest sequence it
    saw. Keys are written in reverse order to make the two orders differ."""
    js = nc.jetstream()
    b = new_bucket()
    kv = await js.create_key_value(bucket=b)
    value = b"v" * 4000
    for i in reversed(range(2000)):
        await kv.put(f"k.{i:04d}", value)
    small = sidecars(nats_server_module.url, b, env=SMALL_MAP).start(wait_synced=False)
    await until(lambda: "replica map is full" in small.log(), what="the replica to fill up")
    row = bucket_info(small, b)
    assert row["synced"] == 0 and 0 < row["keys"] < 2000
    small.kill()

    offset = log_size(small)
    sc = sidecars(nats_server_module.url, b).start(wait_synced=False)  # same data dir, default map
    row = await wait_synced(sc, b, keys=2000)
    assert row["resyncs"] == 0  # finishing a first sync is not a resync
    assert "previous full sync did not finish" in log_since(sc, offset)
    await converged(sc, kv, b)


async def fill_up(kv, sc: SidecarProcess, b: str) -> int:
    """Write more than SMALL_MAP holds, then a small key; wait until the feed has failed to
    write a few times (retried: its metrics count them; its log says so once). Returns the
    small key's revision."""
    for i in range(6):  # 5.4 MB: more than the 4 MiB the map may grow to
        await kv.put(f"big.{i}", os.urandom(900_000))
    after = await kv.put("after", b"later")
    metrics = metrics_address(sc)
    await until(lambda: replica_error_retries(metrics, b) >= 3, what="the feed to fail and retry")
    assert sc.log().count("replica map is full") == 1  # one line for the state, not one a retry
    row = bucket_info(sc, b)
    assert row["applied_seq"] < after
    assert "after" not in replica_state(sc.data_dir, b)
    assert sc.proc.poll() is None
    with sc.client() as c:  # still serving what it has
        assert c.get(f"{b}:a") == b"small"
    return after


async def test_full_replica_stops_the_feed_without_skipping(nats_server_module, nc, sidecars):
    """A batch that cannot be written is retried, never stepped over: given room (here by a
    restart with a larger map), the replica gets every value, the big ones included."""
    js = nc.jetstream()
    b = new_bucket()
    kv = await js.create_key_value(bucket=b)
    await kv.put("a", b"small")
    small = sidecars(nats_server_module.url, b, env={**SMALL_MAP, **METRICS_ENV}).start(wait_synced=False)
    await wait_synced(small, b, keys=1)
    await fill_up(kv, small, b)
    small.kill()

    roomy = sidecars(nats_server_module.url, b).start(wait_synced=False)  # same data dir
    want = await converged(roomy, kv, b)
    assert sorted(want) == ["a", "after"] + [f"big.{i}" for i in range(6)]
    assert bucket_info(roomy, b)["resyncs"] == 0


async def test_full_replica_recovers_when_upstream_shrinks(nats_server_module, nc, sidecars):
    js = nc.jetstream()
    b = new_bucket()
    kv = await js.create_key_value(bucket=b)
    await kv.put("a", b"small")
    sc = sidecars(nats_server_module.url, b, env={**SMALL_MAP, **METRICS_ENV}).start(wait_synced=False)
    await wait_synced(sc, b, keys=1)
    await fill_up(kv, sc, b)
    # Purges roll the big values out of the stream; the feed, retrying from where it
    # stopped, gets through without a restart.
    for i in range(6):
        await kv.purge(f"big.{i}")
    await converged(sc, kv, b)
    assert sorted(replica_state(sc.data_dir, b)) == ["a", "after"]
    await wait_synced(sc, b)  # caught up: the backlog applied, which the log says once
    assert sc.log().count("replica written again") == 1


# ----------------------------------------------------------------------------- size

@pytest.mark.slow
async def test_big_bucket_syncs_without_loss(nats_server_module, nc, sidecars):
    n = 100_000
    js = nc.jetstream(timeout=30)
    b = new_bucket()
    await js.create_key_value(bucket=b)
    revisions: dict[str, int] = {}
    chunk = 2000
    for start in range(0, n, chunk):
        keys = [f"user.{i:06d}" for i in range(start, min(start + chunk, n))]
        acks = await asyncio.gather(*(js.publish(f"$KV.{b}.{k}", f"value-{k}".encode()) for k in keys))
        revisions.update((k, a.seq) for k, a in zip(keys, acks, strict=True))
    assert len(set(revisions.values())) == n

    sc = sidecars(nats_server_module.url, b).start(wait_synced=False)
    row = await wait_synced(sc, b, keys=n, timeout=90)
    assert row["applied_seq"] == n
    with LocalReader(str(sc.data_dir), max_stale_ms=10**9, bucket=b) as r:
        assert len(r.keys("*")) == n
        bad = []
        for key, rev in revisions.items():
            e = r.entry(key)
            if e is None or e.value != f"value-{key}".encode() or e.revision != rev:
                bad.append((key, e))
        assert not bad[:10]


async def test_a_leaderless_stream_ends_consumer_placement_at_once(nats_cluster):
    """While the stream has no leader, no consumer can be placed on it: one
    CONSUMER.CREATE (and the DELETE of what it made), then ConsumerLost, and the feed's own
    backoff and replan (which waits for a leader) take over, instead of PLACEMENT_TRIES
    creations back to back. The leaderless stream: R2, one of its two servers killed (no
    quorum: it stays so until the server is back), in a cluster that keeps its meta leader.
    A misplaced consumer is still made again: test_consumers_are_made_on_the_stream_leader."""
    from kvcache.feed.consumer import PLACEMENT_TRIES, ConsumerLost
    b = new_bucket()
    stream = f"KV_{b}"
    setup = await nats.connect(servers=nats_cluster.urls, connect_timeout=5)
    try:
        kv = await replicated_kv(setup.jetstream(timeout=10), bucket=b, replicas=2)
        await settled(lambda: kv.put("k", b"v"))
        leader = (await setup.jetstream().stream_info(stream)).cluster.leader
    finally:
        await setup.close()
    victim = nats_cluster.server(leader)
    victim.kill()
    nc = NatsConnection()
    try:
        await nc.connect(servers=[s.url for s in nats_cluster.servers if s is not victim], connect_timeout=5)

        async def leaderless() -> bool:
            try:
                await jsapi.stream_info(nc, stream, 2.0, need_leader=True)
            except jsapi.NoLeader:
                return True
            return False   # (timeouts, too, until the survivor notices the loss: `until` retries)
        await until(leaderless, timeout=60, what=f"{stream} to have no leader")

        api = await nc.subscribe(f"$JS.API.CONSUMER.*.{stream}.>")   # the requests themselves
        await nc.flush()
        consumer = PullConsumer(
            nc, stream, f"$KV.{b}.", [f"$KV.{b}.>"], start_seq=None, headers_only=True,
            heartbeat_s=1.0, on_batch=lambda runs: True, on_idle=lambda _seq: None)
        # ConsumerLost ("no leader"), or the CREATE itself timing out (UpstreamError) when the
        # survivor is still noticing the loss: either way the loop ends after one creation.
        with pytest.raises((ConsumerLost, UpstreamError)):
            await asyncio.wait_for(consumer.run(), 60)
        await nc.flush()   # on this connection, a copy of each request came before its reply
        verbs = []
        while api.pending_msgs:
            verbs.append((await api.next_msg()).subject.split(".")[3])
        assert PLACEMENT_TRIES > 1
        assert verbs in (["CREATE", "DELETE"], ["CREATE"]) and consumer.placement_retries == 0, verbs
    finally:
        await nc.close()
        victim.start()
        nats_cluster.wait_ready()
