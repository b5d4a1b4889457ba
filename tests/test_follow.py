"""A bucket whose stream has RePublish is followed with no consumer of the sidecar's own
(kvcache.feed.follow): real nats-server, real Feeds over a real connection.

Lost messages are made two ways: by dropping chosen messages from what the connection hands
the follower (as a link that loses core messages would: the server sends them), and by a
message published on the RePublish subject with a forged, future sequence. Either way the
replica must end equal to the stream, and a replica that misses messages must not count as
fresh.
"""
from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack

import pytest
from nats.js.api import KeyValueConfig, RePublish
from support.checkers import new_bucket, upstream_state
from support.poll import until

from kvcache.config import BucketConfig
from kvcache.feed.feed import Feed
from kvcache.natsio.nats_connection import NatsConnection
from kvcache.store.replica import Replica

pytestmark = pytest.mark.timeout(180)

MAX_STALE_MS = 2000


async def _opened(stack: AsyncExitStack, url: str, tmp_path, buckets: list[str]) -> tuple[Replica, NatsConnection]:
    replica = Replica(str(tmp_path / "replica"), buckets=len(buckets))
    replica.set_buckets(buckets)
    stack.callback(replica.close)
    nc = NatsConnection()
    await nc.connect(servers=[url], connect_timeout=5)
    stack.push_async_callback(nc.close)
    return replica, nc


async def _kv(nc, bucket: str, republish: bool = True, direct: bool = True):
    js = nc.jetstream(timeout=10)
    rp = RePublish(src=f"$KV.{bucket}.>", dest=f"rp.{bucket}.>") if republish else None
    return await js.create_key_value(KeyValueConfig(bucket=bucket, history=1, republish=rp, direct=direct))


async def _started(stack: AsyncExitStack, nc, replica, bucket: str, keys: list[str] | None = None) -> Feed:
    feed = Feed(nc, BucketConfig(bucket, keys=keys or [">"], max_stale_ms=MAX_STALE_MS), replica,
                heartbeat_s=1.0)
    await feed.start()
    stack.push_async_callback(feed.stop)
    await feed.wait_synced(30)
    return feed


async def _consumers(nc, bucket: str) -> int:
    info = await nc.jetstream(timeout=10).stream_info(f"KV_{bucket}")
    return info.state.consumer_count


async def _no_consumers(nc, bucket: str) -> bool:
    return await _consumers(nc, bucket) == 0


async def _followed(stack: AsyncExitStack, url: str, tmp_path, direct: bool = True) -> tuple:
    """A new bucket with RePublish and one key, its feed synced and following it:
    (bucket, replica, connection, kv, feed)."""
    b = new_bucket()
    replica, nc = await _opened(stack, url, tmp_path, [b])
    kv = await _kv(nc, b, direct=direct)
    await kv.put("seed", b"s")
    feed = await _started(stack, nc, replica, b)
    await _following(nc, feed)
    return b, replica, nc, kv, feed


def _state(replica: Replica, bucket: str) -> dict[str, tuple[bytes, int]]:
    out = {}
    for _, key in replica.iter_keys(bucket):
        rec = replica.get(bucket, key)
        if rec is not None:
            out[rec.key] = (rec.value, rec.revision)
    return out


async def _converged(replica: Replica, kv, bucket: str, timeout: float = 30.0) -> dict:
    async def same():
        want = await upstream_state(kv)
        return want if _state(replica, bucket) == want else None
    return await until(same, timeout, f"replica of {bucket} equal to the stream")


async def _following(nc, feed: Feed) -> None:
    async def ok():
        return feed.follow_mode == "republish" and await _consumers(nc, feed.bucket) == 0
    await until(ok, 30, f"bucket {feed.bucket} followed with no consumer on the stream")


def _drop_on_follower(nc: NatsConnection, feed: Feed, drop) -> list[int]:
    """From now on the follower's lane loses the messages `drop(seq)` picks (the server sends
    them; the link loses them): the sequences dropped are listed in what is returned."""
    follower = feed._follower
    assert follower is not None
    lanes = nc._parser.lanes
    (sid,) = [sid for sid, (_, h) in lanes.items() if getattr(h, "__self__", None) is follower]
    n, handler = lanes[sid]
    dropped: list[int] = []

    def lossy(batch: list) -> None:
        kept = []
        for ev in batch:
            seq = int((getattr(ev, "headers", None) or {}).get("Nats-Sequence", 0) or 0)
            if seq and drop(seq):
                dropped.append(seq)
            else:
                kept.append(ev)
        if kept:
            handler(kept)

    lanes[sid] = (n, lossy)
    return dropped


async def test_followed_with_no_consumer(nats_server, tmp_path):
    """Synced by a consumer, then followed on the RePublish subject with none on the stream;
    puts, deletes, purges and a whole-stream purge reach the replica, and the replica stays
    fresh on the state answers alone."""
    b = new_bucket()
    async with AsyncExitStack() as stack:
        replica, nc = await _opened(stack, nats_server.url, tmp_path, [b])
        kv = await _kv(nc, b)
        for i in range(50):
            await kv.put(f"k.{i}", f"v{i}".encode())
        feed = await _started(stack, nc, replica, b)
        await _following(nc, feed)
        assert feed.consumers_created == 1
        for i in range(0, 50, 3):
            await kv.put(f"k.{i}", f"w{i}".encode())
        for i in range(1, 50, 7):
            await kv.delete(f"k.{i}")
        await kv.purge("k.2")
        await kv.put("new", b"n")
        await _converged(replica, kv, b)
        assert feed.follow_received > 0 and feed.gaps_filled == 0
        # fresh on the state answers alone, across more than two poll periods
        t_end = time.monotonic() + 3 * feed.follow_period()
        while time.monotonic() < t_end:
            await until(lambda: feed.fresh_within(MAX_STALE_MS), 10, "fresh while following")
            await asyncio.sleep(0.2)
        await nc.jetstream(timeout=10).purge_stream(f"KV_{b}")
        await until(lambda: replica.count(b) == 0, 30, "the stream's purge reached the replica")
        await kv.put("after", b"a")
        await _converged(replica, kv, b)
        # the purge request's reconcile pass reads the keys with a consumer of its own, deleted
        # once done: a moment's, not the feed's (consumers_created counts the feed's)
        await until(lambda: _no_consumers(nc, b), 30, "no consumer on the stream after the reconcile pass")
        assert feed.follow_mode == "republish"
        assert feed.consumers_created == 1, "followed all along"


async def test_bucket_without_republish_keeps_its_consumer(nats_server, tmp_path):
    """No RePublish: the feed keeps its consumer; one added later is followed from then on."""
    b = new_bucket()
    async with AsyncExitStack() as stack:
        replica, nc = await _opened(stack, nats_server.url, tmp_path, [b])
        kv = await _kv(nc, b, republish=False)
        await kv.put("a", b"1")
        feed = await _started(stack, nc, replica, b)
        await kv.put("b", b"2")
        await _converged(replica, kv, b)
        assert feed.follow_mode == "consumer"
        assert await _consumers(nc, b) == 1
        # the operator adds a RePublish: taken up from the next state answer, no restart
        js = nc.jetstream(timeout=10)
        config = (await js.stream_info(f"KV_{b}")).config
        config.republish = RePublish(src=f"$KV.{b}.>", dest=f"rp.{b}.>")
        await js.update_stream(config)
        await _following(nc, feed)
        await kv.put("c", b"3")
        await _converged(replica, kv, b)
        assert feed.consumers_created == 1


async def test_lost_messages_are_filled_by_direct_get(nats_server, tmp_path):
    """Every third message lost on the way: each gap is found from the next message and
    filled by a Direct Get batch; the feed never goes back to a consumer."""
    async with AsyncExitStack() as stack:
        b, replica, nc, kv, feed = await _followed(stack, nats_server.url, tmp_path)
        dropped = _drop_on_follower(nc, feed, lambda seq: seq % 3 == 0)
        for i in range(200):
            await kv.put(f"k.{i % 40}", f"v{i}".encode())
        await kv.delete("k.3")
        await _converged(replica, kv, b)
        print(f"dropped {len(dropped)}, gaps filled {feed.gaps_filled} with {feed.gap_fill_messages} "
              f"messages in {feed.gap_fill_seconds * 1000:.1f} ms")
        assert dropped and feed.gaps_filled > 0 and feed.gap_fill_messages > 0
        assert feed.follow_mode == "republish" and feed.consumers_created == 1
        assert not feed.follow_ends


async def test_a_fill_that_skips_holds_the_position_below_the_skip(nats_server, tmp_path):
    """A fill finds a lost message superseded since (history 1: gone from the stream) and the
    message that superseded it lost too, past what the fill returns. The records written
    past the skip are then no state the stream was ever in: key `a` at its old revision while
    the stream, at every sequence from s1 on, held a newer one. The feed's position (what
    MINREV, the ledger's holds, the state answers and the sweeps go by) must stay below the
    skip until a state answer asked after it is reached, and then the replica equals the
    stream. Checked at every move of the position: `a`'s record is never older than the
    stream's `a` at that sequence."""
    async with AsyncExitStack() as stack:
        b, replica, nc, kv, feed = await _followed(stack, nats_server.url, tmp_path)
        s0 = await kv.put("a", b"old")
        await _converged(replica, kv, b)
        revisions_of_a = [s0]
        broken: list[tuple[int, int]] = []

        def check(meta) -> None:
            want = max(r for r in revisions_of_a if r <= meta.applied_seq)
            rec = replica.get(b, "a")
            if rec is None or rec.revision < want:
                broken.append((meta.applied_seq, rec.revision if rec else 0))
        feed.on_applied = check

        held: list = []
        follower = feed._follower
        lanes = nc._parser.lanes
        (sid,) = [sid for sid, (_, h) in lanes.items() if getattr(h, "__self__", None) is follower]
        n, handler = lanes[sid]
        lanes[sid] = (n, held.extend)  # everything lost on the way, kept to hand over later
        s1 = await kv.put("a", b"new")       # lost, then superseded by s3
        s2 = await kv.put("b", b"b")         # lost, handed over below: shows the gap at s1
        s3 = await kv.put("a", b"newer")     # lost
        await kv.put("c", b"c")              # lost
        revisions_of_a += [s1, s3]
        (ev_s2,) = [ev for ev in held if int(ev.headers.get("Nats-Sequence", 0)) == s2]
        lanes[sid] = (n, handler)
        handler([ev_s2])
        await until(lambda: replica.get(b, "b") is not None, 10, "the fill to apply b")
        assert feed.meta.applied_seq < s1, "the position passed a skipped sequence"
        await _converged(replica, kv, b)
        await until(lambda: feed.meta.applied_seq >= s3, 10, "the position past the skip")
        assert not broken, f"(position, a's revision) at which `a` was older than the stream's: {broken}"
        assert feed.skips_pinned == 1 and feed.follow_mode == "republish"


async def test_a_silent_subject_is_filled_from_the_state_answers(nats_server, tmp_path):
    """Everything lost, so no later message shows the gap: the state answers do (their last
    sequence past the replica's, past the grace), and the replica ages meanwhile."""
    async with AsyncExitStack() as stack:
        b, replica, nc, kv, feed = await _followed(stack, nats_server.url, tmp_path)
        dropped = _drop_on_follower(nc, feed, lambda seq: True)
        await kv.put("lost", b"l")
        await _converged(replica, kv, b)
        assert dropped and feed.gaps_filled >= 1 and feed.follow_mode == "republish"


async def test_silence_ages_the_replica(nats_server, tmp_path):
    """No state answers (the poll stopped): a following replica is not vouched for past two
    periods of silence."""
    async with AsyncExitStack() as stack:
        *_, feed = await _followed(stack, nats_server.url, tmp_path)
        await until(lambda: feed.fresh_within(MAX_STALE_MS), 10, "fresh while following")
        assert feed._watch_task is not None
        feed._watch_task.cancel()
        await until(lambda: not feed.fresh_within(MAX_STALE_MS), 10, "stale once the state answers stop")
        print(f"lag once silent: {feed.lag_ms()} ms")


async def test_a_forged_future_sequence_does_not_skip_real_messages(nats_server, tmp_path):
    """A message on the RePublish subject naming a sequence the stream does not hold: the
    fill cannot show the sequences below it absent, so the feed goes back to a consumer from
    its position, and follows again once caught up; the forged value is never applied."""
    async with AsyncExitStack() as stack:
        b, replica, nc, kv, feed = await _followed(stack, nats_server.url, tmp_path)
        last = feed.meta.applied_seq
        await nc.publish(f"rp.{b}.forged", b"evil", headers={
            "Nats-Stream": f"KV_{b}", "Nats-Subject": f"$KV.{b}.forged", "Nats-Sequence": str(last + 1000),
            "Nats-Time-Stamp": "2026-01-01T00:00:00Z", "Nats-Last-Sequence": "0"})
        await kv.put("real", b"r")
        await until(lambda: feed.follow_ends["fill"] >= 1, 30, "the fill gave up on the forged gap")
        await _converged(replica, kv, b)
        assert replica.get(b, "forged") is None
        await _following(nc, feed)
        await kv.put("later", b"l")
        await _converged(replica, kv, b)
        assert feed.consumers_created == 2


async def test_filtered_bucket_keeps_only_its_keys(nats_server, tmp_path):
    b = new_bucket()
    async with AsyncExitStack() as stack:
        replica, nc = await _opened(stack, nats_server.url, tmp_path, [b])
        kv = await _kv(nc, b)
        await kv.put("in.a", b"1")
        await kv.put("out.a", b"1")
        feed = await _started(stack, nc, replica, b, keys=["in.>"])
        await _following(nc, feed)
        _drop_on_follower(nc, feed, lambda seq: seq % 4 == 0)
        for i in range(40):
            await kv.put(f"{'in' if i % 2 else 'out'}.{i}", b"x")
        top = (await nc.jetstream(timeout=10).stream_info(f"KV_{b}")).state.last_seq
        await until(lambda: feed.meta.applied_seq == top, 30, "position at the stream's last sequence")
        want = {k: v for k, v in (await upstream_state(kv)).items() if k.startswith("in.")}
        assert _state(replica, b) == want


async def test_no_direct_get_falls_back_to_a_consumer(nats_server, tmp_path):
    """A stream without allow_direct cannot fill a gap by Direct Get: the feed goes back to a
    consumer from its position (it catches up), then follows again with none."""
    async with AsyncExitStack() as stack:
        b, replica, nc, kv, feed = await _followed(stack, nats_server.url, tmp_path, direct=False)
        dropped = _drop_on_follower(nc, feed, lambda seq: seq == feed.meta.applied_seq + 1)
        await kv.put("lost", b"l")
        await kv.put("next", b"n")
        await _converged(replica, kv, b)
        assert dropped and feed.follow_ends["fill"] == 1 and feed.gaps_filled == 0
        await _following(nc, feed)
        assert feed.consumers_created == 2


async def test_sidecar_follows_with_no_consumer(nats_server, tmp_path, sidecars):
    """`kvcache serve` on a bucket with RePublish: no consumer on the stream once synced;
    reads (redis-py over the socket, MINREV too) see writes, deletes and purges; INFO says
    how the bucket is followed."""
    import nats
    import redis

    nc = await nats.connect(nats_server.url)
    try:
        b = new_bucket()
        kv = await _kv(nc, b)
        for i in range(20):
            await kv.put(f"k.{i}", f"v{i}".encode())
        sc = sidecars(nats_server.url, b).start(wait_synced=False)

        async def followed():
            row = sc.buckets().get(b) or {}
            return row.get("follow") == "republish" and await _consumers(nc, b) == 0
        await until(followed, 60, f"{b} followed with no consumer", detail=sc.log)
        r = redis.Redis(unix_socket_path=sc.socket, socket_timeout=30)
        rev = await kv.put("k.1", b"new")
        value, got, *_ = r.execute_command("KV.GET", f"{b}:k.1", "MINREV", rev)
        assert (value, got) == (b"new", rev)
        await kv.delete("k.2")
        await kv.purge("k.3")
        await until(lambda: r.get(f"{b}:k.2") is None and r.get(f"{b}:k.3") is None, 30,
                    "delete and purge seen by reads")
        assert r.get(f"{b}:k.4") == b"v4"
        row = sc.buckets()[b]
        print({k: row[k] for k in row if k.startswith(("follow", "gap"))})
        assert await _consumers(nc, b) == 0
    finally:
        await nc.close()


async def test_republish_subject_denied_keeps_a_consumer(tmp_path, sidecars):
    """A user not allowed to subscribe to the RePublish subject: one warning, the bucket keeps
    a consumer of its own (the sidecar does not end: the subject is not one it needs)."""
    import json

    import nats

    from kvcache.natsio.nats_server import NatsServer

    b = new_bucket()
    s = f"KV_{b}"
    pub = [f"$JS.API.STREAM.INFO.{s}", f"$JS.API.CONSUMER.CREATE.{s}.>", f"$JS.API.CONSUMER.MSG.NEXT.{s}.>",
           f"$JS.API.CONSUMER.DELETE.{s}.>", f"$JS.API.DIRECT.GET.{s}", f"$JS.API.DIRECT.GET.{s}.>",
           f"$JS.API.STREAM.MSG.GET.{s}"]
    users = [{"user": "admin", "password": "adminpw"},
             {"user": "kv", "password": "kvpw",
              "permissions": {"publish": {"allow": pub}, "subscribe": {"allow": ["_INBOX.>"]}}}]
    server = NatsServer(tmp_path / "js", server_name="deny",
                        extra_conf=f"authorization {{ users = {json.dumps(users)} }}").start()
    try:
        nc = await nats.connect(server.url, user="admin", password="adminpw")
        try:
            kv = await _kv(nc, b)
            await kv.put("a", b"1")
            sc = sidecars(server.url, b)
            sc.args += ["--user", "kv", "--password", "kvpw"]
            sc.start(wait_synced=False)
            denial = "the bucket keeps a consumer of its own"
            await until(lambda: denial in sc.log(), 60, "the denial reported", detail=sc.log)
            await kv.put("b", b"2")
            def read_back() -> bool:
                with sc.client() as c:
                    return c.get(f"{b}:b") == b"2"
            await until(read_back, 30, "a write read back", detail=sc.log)
            assert sc.buckets()[b]["follow"] == "consumer", sc.log()

            async def one_consumer() -> bool:
                return await _consumers(nc, b) == 1
            await until(one_consumer, 30, "the bucket's one consumer", detail=sc.log)
            assert sc.log().count(denial) == 1
            assert sc.proc is not None and sc.proc.poll() is None
        finally:
            await nc.close()
    finally:
        server.stop()


async def test_replicated_stream_followed_across_a_leader_kill(nats_cluster, tmp_path):
    """R3 with RePublish: followed with no consumer, fresh on the quorum's evidence; messages
    lost on the way and a killed stream leader (the new leader republishes; Direct Get may be
    answered by any replica) still leave the replica equal to the stream."""
    from support.checkers import kill_stream_leader
    from support.topology import replicated_kv, settled

    b = new_bucket()
    async with AsyncExitStack() as stack:
        replica = Replica(str(tmp_path / "replica"), buckets=1)
        replica.set_buckets([b])
        stack.callback(replica.close)
        nc = NatsConnection()
        await nc.connect(servers=nats_cluster.urls, connect_timeout=5)
        stack.push_async_callback(nc.close)
        js = nc.jetstream(timeout=10)
        kv = await replicated_kv(js, bucket=b, replicas=3, direct=True,
                                 republish=RePublish(src=f"$KV.{b}.>", dest=f"rp.{b}.>"))
        await settled(lambda: kv.put("seed", b"s"))
        feed = await _started(stack, nc, replica, b)
        await _following(nc, feed)
        assert feed.quorum
        await until(lambda: feed.fresh_within(MAX_STALE_MS), 20, "fresh on the quorum's evidence")
        _drop_on_follower(nc, feed, lambda seq: seq % 5 == 0)
        for i in range(50):
            await settled(lambda i=i: kv.put(f"k.{i % 10}", f"v{i}".encode()))
        await _converged(replica, kv, b)
        victim = await kill_stream_leader(js, nats_cluster, f"KV_{b}")
        try:
            for i in range(50, 100):
                await settled(lambda i=i: kv.put(f"k.{i % 10}", f"v{i}".encode()))
            await _converged(replica, kv, b, timeout=60)
            await until(lambda: feed.fresh_within(MAX_STALE_MS), 30, "fresh again after the leader change")
        finally:
            victim.start()
        print(f"gaps {feed.gaps_filled} ({feed.gap_fill_messages} messages), back to a consumer "
              f"{dict(feed.follow_ends)}, consumers made {feed.consumers_created}")
        assert feed.gaps_filled > 0
        await _following(nc, feed)


async def test_writes_during_the_hand_over_all_arrive(nats_server, tmp_path):
    """Writes keep coming while the consumer syncs and hands over to the follower: each
    reaches the replica by one path or the other (or a gap fill), none is lost."""
    b = new_bucket()
    async with AsyncExitStack() as stack:
        replica, nc = await _opened(stack, nats_server.url, tmp_path, [b])
        kv = await _kv(nc, b)
        for i in range(200):
            await kv.put(f"k.{i}", b"x" * 200)
        stop = asyncio.Event()

        async def writer() -> int:
            n = 0
            while not stop.is_set():
                await kv.put(f"w.{n % 50}", f"{n}".encode())
                n += 1
            return n
        task = asyncio.create_task(writer())
        feed = await _started(stack, nc, replica, b)
        await _following(nc, feed)
        await kv.put("after", b"a")
        stop.set()
        n = await task
        await _converged(replica, kv, b)
        print(f"{n} writes during the sync and hand-over; gaps filled {feed.gaps_filled}")
        assert feed.consumers_created == 1 and feed.follow_mode == "republish"


async def test_a_recreated_stream_is_resynced(nats_server, tmp_path):
    """The bucket deleted and made again while followed: its sequences start over (every
    message at or below the replica's position would look like a duplicate); the state
    answer's `created` shows it, and the feed resyncs with a consumer."""
    b = new_bucket()
    async with AsyncExitStack() as stack:
        replica, nc = await _opened(stack, nats_server.url, tmp_path, [b])
        kv = await _kv(nc, b)
        for i in range(30):
            await kv.put(f"old.{i}", b"o")
        feed = await _started(stack, nc, replica, b)
        await _following(nc, feed)
        await nc.jetstream(timeout=10).delete_key_value(b)
        kv = await _kv(nc, b)
        await kv.put("new", b"n")
        await until(lambda: feed.follow_ends["stream_changed"] >= 1, 30, "the recreation seen")
        await _converged(replica, kv, b)
        assert feed.resync_reasons["recreated"] == 1
        await _following(nc, feed)


LOSSY_MAX_STALE_MS = 1000
BLACKOUT_S = 5.0  # the second run: every message on the subject dropped this long


@pytest.mark.parametrize("loss", ["1% dropped", "all dropped for 5 s"])
async def test_sidecar_behind_a_lossy_link(nats_server, tmp_path, sidecars, loss):
    """`kvcache serve` connected through a proxy that drops messages on the RePublish subject
    (tests/support/lossy_proxy.py), writes going straight to the server: every gap is filled,
    the replica ends equal to the stream, no read answers older than max_stale_ms allows (nor
    goes back), and no consumer is made again."""
    import nats
    import redis
    from support.checkers import converged
    from support.lossy_proxy import LossyProxy
    from support.staleness_check import Acks, Read, judge

    b = new_bucket()
    nc = await nats.connect(nats_server.url)
    try:
        kv = await _kv(nc, b)
        await kv.put("seed", b"s")
        random_drop = 0.01 if loss.startswith("1%") else 0.0
        # on a thread of its own: starting the sidecar blocks this loop until it serves
        with LossyProxy(nats_server.port, [f"rp.{b}.>"], drop=random_drop, seed=7) as px:
            sc = sidecars(px.url, b)
            sc.args += ["--max-stale-ms", str(LOSSY_MAX_STALE_MS)]
            sc.start(wait_synced=False)

            async def followed():
                return (sc.buckets().get(b) or {}).get("follow") == "republish" and await _consumers(nc, b) == 0
            await until(followed, 60, f"{b} followed with no consumer", detail=sc.log)
            if not random_drop:
                px.drop_all(BLACKOUT_S)
            # each put acknowledged, then a read of an earlier key through the sidecar: judged
            # as the partition bench judges its reads (support.staleness_check)
            acks: list[tuple[str, int, int, float]] = []
            reads: list[Read] = []
            r = redis.Redis(unix_socket_path=sc.socket, socket_timeout=10)
            t0 = time.monotonic()
            i = 0
            while i < 1500 or time.monotonic() - t0 < BLACKOUT_S + 0.5:
                key = f"k.{i % 300}"
                rev = await kv.put(key, b"%d" % i)
                acks.append((key, i, rev, time.monotonic()))
                read_key = f"k.{(i * 7) % 300}"
                sent = time.monotonic()
                value = r.get(f"{b}:{read_key}")
                reads.append(Read(1, "get", read_key, sent, time.monotonic(), "nil" if value is None else "ok",
                                  -1 if value is None else int(value)))
                i += 1
            t1 = time.monotonic()
            await converged(sc, kv, b, timeout=60)
            verdict = judge(Acks.of(acks), reads, LOSSY_MAX_STALE_MS, (t0, t1), t0)
            print(f"{loss}: {len(reads)} reads, {len(verdict.stale)} stale beyond {LOSSY_MAX_STALE_MS} ms "
                  f"(worst {verdict.worst_stale}), {len(verdict.regressions)} regressions")
            assert not verdict.stale and not verdict.regressions
            row = sc.buckets()[b]
            gaps = row["gaps_filled"]
            print(f"{loss}: {i} writes, {len(px.dropped)} dropped by the proxy, {gaps} gaps filled with "
                  f"{row['gap_fill_messages']} messages in {row['gap_fill_ms']} ms "
                  f"({row['gap_fill_ms'] / max(gaps, 1):.1f} ms each), follow={row['follow']}")
            assert px.dropped and gaps >= 1 and row["gap_fill_messages"] >= 1
            assert row["follow"] == "republish" and await _consumers(nc, b) == 0
            assert "back to a consumer" not in sc.log()
    finally:
        await nc.close()


async def test_near_cache_kept_true_by_the_follower(nats_server, tmp_path):
    """A bucket with a near cache for keys outside its filters: what the follower applies,
    gap fills included, replaces the cached records of keys outside the filters too."""
    from kvcache.store.nearcache import NearCache
    from kvcache.store.record import decode_record, item

    b = new_bucket()
    async with AsyncExitStack() as stack:
        replica, nc = await _opened(stack, nats_server.url, tmp_path, [b])
        kv = await _kv(nc, b)
        rev = await kv.put("out.a", b"old")
        await kv.put("in.a", b"1")
        feed = Feed(nc, BucketConfig(b, keys=["in.>"], max_stale_ms=MAX_STALE_MS), replica, heartbeat_s=1.0)
        cache = NearCache(replica, b, max_keys=100)
        feed.set_cache(cache)
        await feed.start()
        stack.push_async_callback(feed.stop)
        await feed.wait_synced(30)
        await _following(nc, feed)
        lk, rec = item(b"out.a", b"old", rev, 0)
        assert cache.offer(lk, rec)
        _drop_on_follower(nc, feed, lambda seq: seq % 2 == 0)
        for i in range(10):
            await kv.put("out.a", f"new{i}".encode())
            await kv.put(f"in.{i}", b"x")
        top = (await nc.jetstream(timeout=10).stream_info(f"KV_{b}")).state.last_seq
        await until(lambda: feed.meta.applied_seq == top, 30, "position at the stream's last sequence")
        cached = cache.get(lk)
        assert cached is not None and decode_record(lk, cached).value == b"new9"
        assert feed.gaps_filled > 0
        want = {k: v for k, v in (await upstream_state(kv)).items() if k.startswith("in.")}
        assert _state(replica, b) == want


async def test_two_sidecars_follow_on_one_poll(nats_server, tmp_path, sidecars):
    """Two sidecars on a RePublish bucket, sharing the stream-state polls (the default): no
    consumer on the stream, one of them polls, and the other is kept fresh by the shared
    answers alone (its `lag_ms` stays 0 across many periods while it hardly asks itself)."""
    import nats

    b = new_bucket()
    nc = await nats.connect(nats_server.url)
    try:
        kv = await _kv(nc, b)
        await kv.put("a", b"1")
        scs = [sidecars(nats_server.url, b, name=f"sc{i}") for i in range(2)]
        for sc in scs:
            sc.args += ["--max-stale-ms", "2000"]
            sc.start(wait_synced=False)

        async def followed():
            rows = [sc.buckets().get(b) or {} for sc in scs]
            return all(r.get("follow") == "republish" for r in rows) and await _consumers(nc, b) == 0
        await until(followed, 60, "both followed with no consumer")
        await until(lambda: any(sc.buckets()[b]["state_shared"] > 4 for sc in scs), 30,
                    "one sidecar taking the other's answers")
        taker = max(scs, key=lambda sc: sc.buckets()[b]["state_shared"])
        row0 = taker.buckets()[b]
        t_end = time.monotonic() + 6
        while time.monotonic() < t_end:
            row = taker.buckets()[b]
            assert row["lag_ms"] == 0, row
            await asyncio.sleep(0.2)
        row = taker.buckets()[b]
        own = (row["state_polls"] - row["state_shared"]) - (row0["state_polls"] - row0["state_shared"])
        print(f"in 6 s the taker asked {own} times itself, took {row['state_shared'] - row0['state_shared']}")
        assert row["state_shared"] - row0["state_shared"] > own
        await kv.put("b", b"2")
        for sc in scs:
            with sc.client() as c:
                await until(lambda c=c: c.get(f"{b}:b") == b"2", 30, "the write served")
    finally:
        await nc.close()
