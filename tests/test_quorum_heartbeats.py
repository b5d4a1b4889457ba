"""A replicated stream's consumer asks for rare idle heartbeats: the quorum's evidence bounds
the replica's staleness, and a stalled consumer shows as evidence of messages it did not
deliver (Feed.consumer_heartbeat_s, PullConsumer.behind). Each heartbeat costs the cluster per
sidecar per bucket (bench/README.md, "A fleet on one cluster").

A real 3-node cluster and real Feeds; the stall is injected by dropping what the connection's
fast lane hands the consumer, as a link that loses deliveries would.
"""
from __future__ import annotations

import asyncio
import json
from contextlib import AsyncExitStack

import pytest
from support.checkers import new_bucket
from support.poll import until
from support.topology import replicated_kv, settled

from kvcache.config import BucketConfig
from kvcache.feed.consumer import FIRST_PULL_CHECKS, PULL_EXPIRES_S
from kvcache.feed.feed import Feed
from kvcache.feed.quorum import QUORUM_HEARTBEAT_S
from kvcache.natsio.nats_connection import NatsConnection
from kvcache.store.replica import Replica

# Three replicated buckets made on a cluster that may still be settling on a busy host: each
# wait is bounded on its own (support.topology, support.poll), this only bounds their sum.
pytestmark = pytest.mark.timeout(420)


async def _opened(stack: AsyncExitStack, urls: list[str], tmp_path,
                  buckets: list[str]) -> tuple[Replica, NatsConnection]:
    """A replica for `buckets` and a connection to the cluster, both closed by `stack`."""
    replica = Replica(str(tmp_path / "replica"), buckets=len(buckets))
    replica.set_buckets(buckets)
    stack.callback(replica.close)
    nc = NatsConnection()
    await nc.connect(servers=urls, connect_timeout=5)
    stack.push_async_callback(nc.close)
    return replica, nc


def _drop_deliveries(nc: NatsConnection, feed: Feed) -> None:
    """From now on the feed's consumer hears nothing: its lane's handler is swapped for one
    that drops every batch (the server goes on sending)."""
    consumer = feed._consumer
    lanes = nc._parser.lanes
    (sid,) = [sid for sid, (_, handler) in lanes.items() if getattr(handler, "__self__", None) is consumer]
    n, _ = lanes[sid]
    lanes[sid] = (n, lambda batch: None)


async def test_heartbeats_by_what_bounds_the_staleness(nats_cluster, tmp_path):
    """R3 over the whole bucket: the rare heartbeat. R1 (its server's word is the proof) and a
    filtered consumer (its heartbeat carries its position) keep heartbeat_ms."""
    whole, single, filtered = new_bucket(), new_bucket(), new_bucket()
    async with AsyncExitStack() as stack:
        replica, nc = await _opened(stack, nats_cluster.urls, tmp_path, [whole, single, filtered])
        js = nc.jetstream(timeout=10)
        for b, replicas in ((whole, 3), (single, 1), (filtered, 3)):
            kv = await replicated_kv(js, bucket=b, replicas=replicas)
            await settled(lambda kv=kv: kv.put("a.1", b"v"))
        pulls: list[dict] = []

        async def pulled(msg) -> None:
            pulls.append(json.loads(msg.data))
        sub = await nc.subscribe(f"$JS.API.CONSUMER.MSG.NEXT.KV_{whole}.>", cb=pulled)
        feeds = {}
        for b, keys in ((whole, [">"]), (single, [">"]), (filtered, ["a.*"])):
            feed = Feed(nc, BucketConfig(b, keys=keys, max_stale_ms=2000), replica, heartbeat_s=1.0)
            await feed.start()
            stack.push_async_callback(feed.stop)
            await asyncio.wait_for(feed.wait_synced(), 60)
            await until(lambda feed=feed: feed._consumer is not None and feed._consumer.host, what="placed")
            feeds[b] = feed
        assert feeds[whole]._consumer.heartbeat_s == QUORUM_HEARTBEAT_S
        assert feeds[whole]._consumer.check_s == 1.0
        # Its first pull is short and heartbeats every check (a pull lost at creation shows
        # within three checks); once answered (here: that pull's expiry), the long one.
        await until(lambda: len(pulls) >= 2, what="the pull after the first one's expiry")
        await sub.unsubscribe()
        first, then = pulls[0], pulls[1]
        assert (first["expires"], first["idle_heartbeat"]) == (FIRST_PULL_CHECKS * 10**9, 10**9)
        assert (then["expires"], then["idle_heartbeat"]) == (int(PULL_EXPIRES_S * 1e9), int(QUORUM_HEARTBEAT_S * 1e9))
        assert feeds[single]._consumer.heartbeat_s == 1.0 and feeds[single]._consumer.behind is None
        assert feeds[filtered]._consumer.heartbeat_s == 1.0 and feeds[filtered]._consumer.behind is None
        # Quiet and heartbeat-free for several of heartbeat_ms, the R3 replica stays fresh on
        # the evidence alone, and its consumer is kept.
        polls = feeds[whole].state_polls
        await until(lambda: feeds[whole].state_polls >= polls + 6, what="six more state polls")
        assert feeds[whole].fresh_within(2000)
        assert feeds[whole].consumers_created == 1 and not feeds[whole].recreations


async def test_a_stalled_consumer_is_found_by_the_evidence(nats_cluster, tmp_path):
    """The consumer stops hearing its server while the stream moves on: the quorum's evidence
    shows the new message, and the consumer is lost three heartbeat_ms after, not three of its
    (30 s) idle heartbeats; the next one delivers the write."""
    b = new_bucket()
    async with AsyncExitStack() as stack:
        replica, nc = await _opened(stack, nats_cluster.urls, tmp_path, [b])
        js = nc.jetstream(timeout=10)
        kv = await replicated_kv(js, bucket=b, replicas=3)
        await settled(lambda: kv.put("k", b"1"))
        feed = Feed(nc, BucketConfig(b, max_stale_ms=2000), replica, heartbeat_s=1.0)
        await feed.start()
        stack.push_async_callback(feed.stop)
        await asyncio.wait_for(feed.wait_synced(), 60)
        await until(lambda: feed._consumer is not None and feed._consumer.host, what="placed")
        assert feed._consumer.heartbeat_s == QUORUM_HEARTBEAT_S
        _drop_deliveries(nc, feed)
        seq = await kv.put("k", b"2")
        # well under the 90 s three idle heartbeats would take
        assert await feed.wait_applied(seq, 3 * QUORUM_HEARTBEAT_S / 2), dict(feed.recreations)
        assert dict(feed.recreations) == {"behind": 1}
        rec = replica.get(b, "k")
        assert rec is not None and rec.value == b"2" and rec.revision == seq
