"""A sidecar's consumers on the server: named for its data directory, so what a killed sidecar
left is replaced when it starts again rather than left to age out (kvcache.feed.names), and a
reconnect does not throw away a consumer made on the new connection (Feed.reconnected).

Real nats-server processes (one server; a 3-node cluster for placement), real sidecars and
nats-py clients.
"""
from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

import pytest
from support.checkers import new_bucket, wait_synced
from support.poll import until
from support.topology import replicated_kv, settled

from kvcache.config import BucketConfig
from kvcache.feed.consumer import PullConsumer
from kvcache.feed.feed import Feed
from kvcache.feed.names import consumer_name, sidecar_id
from kvcache.natsio import jetstream as jsapi
from kvcache.natsio.nats_connection import NatsConnection
from kvcache.store.replica import Replica

pytestmark = pytest.mark.timeout(180)


async def _names(js, stream: str) -> list[str]:
    return sorted(c.name for c in await js.consumers_info(stream) if c.name.startswith("kvcache_"))


@pytest.mark.quick
def test_the_id_is_kept_in_the_data_directory_and_the_name_differs_by_host(tmp_path):
    sid = sidecar_id(str(tmp_path))
    assert sid == sidecar_id(str(tmp_path)) and len(sid) == 16
    (tmp_path / "other").mkdir()
    assert sidecar_id(str(tmp_path / "other")) != sid
    assert consumer_name(sid, "host-a") == consumer_name(sid, "host-a")
    assert consumer_name(sid, "host-a") != consumer_name(sid, "host-b"), "a copied data directory"
    (tmp_path / "sidecar.id").write_text("not an id\n")
    assert sidecar_id(str(tmp_path)) != "not an id"


async def test_a_killed_sidecars_consumer_is_replaced_when_it_starts_again(nats_server_module, nc, sidecars):
    """Killed three times in a row (a crash loop), with writes between: after each start the
    stream holds the sidecar's one consumer, under the same name. With random names each kill
    left one behind for the 60 s of its inactive threshold."""
    js = nc.jetstream()
    b = new_bucket()
    stream = f"KV_{b}"
    kv = await js.create_key_value(bucket=b)
    for i in range(20):
        await kv.put(f"k.{i}", b"v")
    sc = sidecars(nats_server_module.url, b).start(wait_synced=False)
    await wait_synced(sc, b, keys=20)
    (name,) = await until(lambda: _names(js, stream), what="the feed's consumer")
    assert name == consumer_name(sidecar_id(str(sc.data_dir)))
    for round_ in range(3):
        sc.kill()
        await kv.put(f"new.{round_}", b"written while down")
        sc.start(wait_synced=False)
        await wait_synced(sc, b, keys=21 + round_)
        # the restart's reconcile pass (its own consumer, `_r`) is deleted when it ends
        names = await until(lambda: _only(js, stream, name), what="one consumer per sidecar")
        assert names == [name]
    assert sc.log().count("replacing consumer") >= 3


async def _only(js, stream: str, name: str) -> list[str] | None:
    names = await _names(js, stream)
    return names if names == [name] else None


async def test_placement_tries_keep_the_fixed_name(nats_cluster):
    """On an R3 stream most creations land off the leader and are deleted and made again: under
    a fixed name each try waits for the last one's deletion, and every round ends on the
    leader with no consumer of the name left once it is done."""
    b = new_bucket()
    nc = NatsConnection()
    await nc.connect(servers=nats_cluster.urls, connect_timeout=5)
    try:
        js = nc.jetstream(timeout=10)
        kv = await replicated_kv(js, bucket=b, replicas=3)
        await settled(lambda: kv.put("k", b"v"))
        stream = f"KV_{b}"
        retries = 0
        for _ in range(6):
            consumer = PullConsumer(
                nc, stream, f"$KV.{b}.", [f"$KV.{b}.>"], start_seq=None, headers_only=True,
                heartbeat_s=1.0, on_batch=lambda runs: runs[-1].last_pending == 0,
                on_idle=lambda _seq: None, name="kvcache_fixed")
            await asyncio.wait_for(consumer.run(), 60)
            assert consumer.name == "kvcache_fixed" and consumer.host
            retries += consumer.placement_retries
        assert retries > 0  # some landed off the leader (none in 6 rounds: p = 0.14%)
        await until(lambda: _none_left(js, stream), what="the last round's consumer deleted")
    finally:
        await nc.close()


async def _none_left(js, stream: str) -> bool:
    return await _names(js, stream) == []


async def test_a_reconnect_keeps_the_consumer_made_since_the_disconnect(nats_server_module, tmp_path):
    """The disconnect fails the consumer in use; the feed makes another (through the new
    connection, once there is one). The reconnect that follows must not fail that one too: a
    rolling restart of the cluster made some consumers twice that way."""
    b = new_bucket()
    replica = Replica(str(tmp_path / "replica"), buckets=1)
    replica.set_buckets([b])
    async with AsyncExitStack() as stack:
        stack.callback(replica.close)
        nc = NatsConnection()
        await nc.connect(servers=[nats_server_module.url], connect_timeout=5)
        stack.push_async_callback(nc.close)
        kv = await nc.jetstream().create_key_value(bucket=b)
        await kv.put("a", b"1")
        # heartbeats 5 s apart: a loaded host's stall of a few seconds is not a lost consumer here
        feed = Feed(nc, BucketConfig(b), replica, heartbeat_s=5.0, consumer_name="kvcache_reconnect")
        await feed.start()
        stack.push_async_callback(feed.stop)
        await asyncio.wait_for(feed.wait_synced(), 30)
        assert feed.consumers_created == 1
        feed.connection_lost()
        await until(lambda: feed.consumers_created == 2 and feed.caught_up, what="a new consumer, caught up")
        feed.reconnected()
        seq = await kv.put("b", b"2")
        assert await feed.wait_applied(seq, 10)
        await until(lambda: feed.caught_up, what="caught up again")
        assert feed.consumers_created == 2, f"the reconnect failed the new consumer: {dict(feed.recreations)}"
        assert dict(feed.recreations) == {"connection": 1}
        # the reconnect's reconcile pass runs beside it under `<name>_r`, deleted when it ends
        assert await until(lambda: _only(nc.jetstream(), jsapi.kv_stream(b), "kvcache_reconnect"),
                           what="the feed's one consumer") == ["kvcache_reconnect"]
