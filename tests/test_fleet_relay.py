"""A fleet of sidecars on a bucket with no RePublish follows the fleet's relay: one consumer on
the stream for the whole fleet (the relay's), every sidecar's feed (the relay's own too) on
the relay's core subject, and the role moving when its sidecar is killed.

Real nats-server, real `kvcache serve` processes (tests/support/sidecar_proc.py), killed with
SIGKILL by their own PID. Each replica is compared with the stream at the end
(support.checkers.converged); reads are judged as the partition bench judges them
(support.staleness_check); one sidecar is connected through a proxy that drops core messages
on the relay's subject (tests/support/lossy_proxy.py).
"""
from __future__ import annotations

import time

import nats
import pytest
import redis
from nats.js.api import KeyValueConfig
from support.checkers import converged, new_bucket, upstream_state
from support.poll import until
from support.staleness_check import Acks, Read, judge

from kvcache.feed.names import RELAY_SUFFIX

pytestmark = pytest.mark.timeout(300)

MAX_STALE_MS = 2000
FLAGS = ["--max-stale-ms", str(MAX_STALE_MS), "--relay"]


async def _kv(nc, bucket: str):
    """A bucket as `nats kv add` makes it: Direct Get allowed, no RePublish."""
    return await nc.jetstream(timeout=10).create_key_value(KeyValueConfig(bucket=bucket, history=1, direct=True))


async def _consumers(nc, bucket: str) -> list[str]:
    return sorted(c.name for c in await nc.jetstream(timeout=10).consumers_info(f"KV_{bucket}"))


def _row(sc, bucket: str) -> dict:
    try:
        return sc.buckets().get(bucket) or {}
    except OSError:  # not serving (yet, or any more)
        return {}


def _fleet(sidecars, url: str, bucket: str, n: int, extra: list[str] | None = None) -> list:
    made = []
    for i in range(n):
        sc = sidecars(url, bucket, name=f"s{i}")
        sc.args += FLAGS + (extra or [])
        made.append(sc)
    return made


async def _seeded(nc, bucket: str, keys: int):
    """The bucket made (Direct Get on, no RePublish) with keys k.0 .. k.<keys-1>: its KV handle."""
    kv = await _kv(nc, bucket)
    for i in range(keys):
        await kv.put(f"k.{i}", b"%d" % i)
    return kv


def _started(fleet: list) -> list:
    """Every sidecar of `fleet` started, not waiting for their sync (the tests wait on the relay)."""
    for sc in fleet:
        sc.start(wait_synced=False)
    return fleet


async def _one_relay_followed(nc, bucket: str, fleet: list) -> None:
    """Until every sidecar of `fleet` follows the relay's subject and the stream holds one
    consumer, named for a relay."""
    async def settled() -> bool:
        if any(_row(sc, bucket).get("follow") != "relay" for sc in fleet):
            return False
        names = await _consumers(nc, bucket)
        return len(names) == 1 and names[0].endswith(RELAY_SUFFIX)
    await until(settled, 90, f"{bucket}: one relay consumer, every sidecar following it",
                detail=lambda: "\n".join(f"{sc.data_dir.name}: {_row(sc, bucket)}" for sc in fleet))


def _relaying(fleet: list, bucket: str) -> list:
    return [sc for sc in fleet if _row(sc, bucket).get("relaying") == 1]


async def _write_and_read(kv, bucket: str, sc, n: int, min_s: float = 0.0) -> tuple[int, int]:
    """`n` puts at least, for `min_s` seconds at least (and a delete every 10th) on the bucket,
    each followed by a read of an earlier key through `sc`; every read judged against the
    acknowledged writes: (stale, regressions)."""
    acks: list[tuple[str, int, int, float]] = []
    reads: list[Read] = []
    r = redis.Redis(unix_socket_path=sc.socket, socket_timeout=10)
    t0 = time.monotonic()
    i = 0
    while i < n or time.monotonic() - t0 < min_s:
        key = f"k.{i % 100}"
        rev = await kv.put(key, b"%d" % i)
        acks.append((key, i, rev, time.monotonic()))
        if i % 10 == 9:
            await kv.delete(f"d.{i}")
        read_key = f"k.{(i * 7) % 100}"
        sent = time.monotonic()
        value = r.get(f"{bucket}:{read_key}")
        reads.append(Read(1, "get", read_key, sent, time.monotonic(), "nil" if value is None else "ok",
                          -1 if value is None else int(value)))
        i += 1
    verdict = judge(Acks.of(acks), reads, MAX_STALE_MS, (t0, time.monotonic()), t0)
    print(f"{len(reads)} reads through {sc.data_dir.name}: {len(verdict.stale)} stale beyond {MAX_STALE_MS} ms "
          f"(worst {verdict.worst_stale}), {len(verdict.regressions)} regressions")
    return len(verdict.stale), len(verdict.regressions)


async def test_a_fleet_holds_one_consumer_and_the_relay_moves_when_killed(nats_server, sidecars):
    """3 sidecars with the relay on: one consumer on the stream (the relay's), INFO `follow:
    relay` on each (the relay's own too), writes and deletes reach every replica, no stale
    read; the relay's sidecar killed (-9): another relays, the consumers back to one (the
    killed relay's reaped), the replicas equal to the stream."""
    b = new_bucket()
    nc = await nats.connect(nats_server.url)
    try:
        kv = await _seeded(nc, b, 50)
        fleet = _started(_fleet(sidecars, nats_server.url, b, 3))
        t0 = time.monotonic()
        await _one_relay_followed(nc, b, fleet)
        print(f"one relay consumer, 3 followers after {time.monotonic() - t0:.1f} s")
        [relay] = _relaying(fleet, b)
        reader = next(sc for sc in fleet if sc is not relay)
        stale, regressions = await _write_and_read(kv, b, reader, 300)
        assert (stale, regressions) == (0, 0)
        for sc in fleet:
            await converged(sc, kv, b)
            assert _row(sc, b)["follow"] == "relay"
        assert len(await _consumers(nc, b)) == 1
        relay.kill()
        rest = [sc for sc in fleet if sc is not relay]
        t0 = time.monotonic()
        await until(lambda: len(_relaying(rest, b)) == 1, 60, "another sidecar relaying",
                    detail=lambda: "\n".join(sc.log()[-2000:] for sc in rest))
        print(f"another relay after {time.monotonic() - t0:.1f} s")
        for i in range(100):
            await kv.put(f"k.{i % 100}", b"after %d" % i)
        await _one_relay_followed(nc, b, rest)  # the killed relay's consumer reaped
        print(f"consumers back to 1 after {time.monotonic() - t0:.1f} s")
        for sc in rest:
            await converged(sc, kv, b)
    finally:
        await nc.close()


async def test_relay_off_keeps_a_consumer_per_sidecar(nats_server, sidecars):
    """`--no-relay`: each sidecar keeps a consumer of its own, nobody relays."""
    b = new_bucket()
    nc = await nats.connect(nats_server.url)
    try:
        kv = await _kv(nc, b)
        await kv.put("a", b"1")
        fleet = _fleet(sidecars, nats_server.url, b, 2, ["--no-relay"])
        for sc in fleet:
            sc.start()

        async def two() -> bool:
            names = await _consumers(nc, b)
            return len(names) == 2 and not any(n.endswith(RELAY_SUFFIX) for n in names)
        await until(two, 30, "a consumer per sidecar")
        await kv.put("b", b"2")
        for sc in fleet:
            await converged(sc, kv, b)
            row = _row(sc, b)
            assert row["follow"] == "consumer" and "relaying" not in row, row
        assert len(await _consumers(nc, b)) == 2
    finally:
        await nc.close()


@pytest.mark.parametrize("loss", ["1% dropped", "all dropped for 5 s"])
async def test_a_follower_behind_a_lossy_link_fills_its_gaps(nats_server, sidecars, loss):
    """2 sidecars; the second connected through a proxy dropping 1% of `kvcache.changes.>`
    (or all of it for 5 s): its gaps are filled by Direct Get, its replica ends equal to the
    stream, no stale read, still one consumer, and it never went back to a consumer."""
    from support.lossy_proxy import LossyProxy

    b = new_bucket()
    nc = await nats.connect(nats_server.url)
    try:
        kv = await _kv(nc, b)
        await kv.put("seed", b"s")
        [direct] = _fleet(sidecars, nats_server.url, b, 1)
        direct.start(wait_synced=False)
        await _one_relay_followed(nc, b, [direct])
        window = not loss.startswith("1%")
        with LossyProxy(nats_server.port, ["kvcache.changes.>"], drop=0.0 if window else 0.01, seed=11) as px:
            lossy = sidecars(px.url, b, name="lossy")
            lossy.args += FLAGS
            lossy.start(wait_synced=False)
            await _one_relay_followed(nc, b, [direct, lossy])
            assert _relaying([direct, lossy], b) == [direct]
            if window:
                px.drop_all(5.0)
            stale, regressions = await _write_and_read(kv, b, lossy, 1500, 6.0 if window else 0.0)
            await converged(lossy, kv, b, timeout=60)
            row = _row(lossy, b)
            print(f"{loss}: {len(px.dropped)} dropped by the proxy, {row['gaps_filled']} gaps filled with "
                  f"{row['gap_fill_messages']} messages in {row['gap_fill_ms']} ms")
            assert (stale, regressions) == (0, 0)
            assert px.dropped and row["gaps_filled"] >= 1
            assert row["follow"] == "relay" and len(await _consumers(nc, b)) == 1
            assert "back to a consumer" not in lossy.log()
        await converged(direct, kv, b)
    finally:
        await nc.close()


async def test_a_restart_storm_ends_with_one_consumer(nats_server, sidecars):
    """3 sidecars killed at once and started again at once: all synced, every one following
    the relay, one consumer on the stream."""
    b = new_bucket()
    nc = await nats.connect(nats_server.url)
    try:
        kv = await _seeded(nc, b, 100)
        fleet = _started(_fleet(sidecars, nats_server.url, b, 3))
        await _one_relay_followed(nc, b, fleet)
        for sc in fleet:
            sc.kill()
        for i in range(20):
            await kv.put(f"k.{i}", b"while down %d" % i)
        t0 = time.monotonic()
        for sc in fleet:
            sc.start(wait_synced=False)
        for sc in fleet:
            sc.wait_synced(60)
        print(f"3 restarted and synced in {time.monotonic() - t0:.1f} s")
        await _one_relay_followed(nc, b, fleet)
        print(f"one consumer after {time.monotonic() - t0:.1f} s")
        for sc in fleet:
            await converged(sc, kv, b)
    finally:
        await nc.close()


# ----------------------------------------------------------------------------- no relay heard

async def test_a_follower_that_hears_no_relay_takes_a_consumer_and_hands_back(nats_server, tmp_path):
    """A feed following the relay's subject (a real Relay publishing it) whose relay goes
    unheard goes back to a consumer of its own within a few periods (reason `relay`), keeps
    the replica equal to the stream meanwhile, and follows the relay again once one is heard."""
    import asyncio
    from contextlib import AsyncExitStack

    from kvcache.config import BucketConfig
    from kvcache.feed.feed import Feed
    from kvcache.feed.relay import Relay, changes_subject
    from kvcache.natsio.nats_connection import NatsConnection
    from kvcache.store.replica import Replica

    b = new_bucket()
    subject = changes_subject(None, b)
    async with AsyncExitStack() as stack:
        admin = await nats.connect(nats_server.url)
        stack.push_async_callback(admin.close)
        kv = await _kv(admin, b)
        await kv.put("a", b"1")
        relay_nc = NatsConnection()
        await relay_nc.connect(servers=[nats_server.url], connect_timeout=5)
        stack.push_async_callback(relay_nc.close)
        relay = Relay(relay_nc, b, subject=subject, name="test" + RELAY_SUFFIX, start_seq=1, heartbeat_s=1.0)
        relay_task = asyncio.create_task(relay.run())

        async def stop_relay() -> None:
            relay.stop()
            await relay_task
        stack.push_async_callback(stop_relay)
        replica = Replica(str(tmp_path / "replica"), buckets=1)
        replica.set_buckets([b])
        stack.callback(replica.close)
        nc = NatsConnection()
        await nc.connect(servers=[nats_server.url], connect_timeout=5)
        stack.push_async_callback(nc.close)
        feed = Feed(nc, BucketConfig(b, keys=[">"], max_stale_ms=MAX_STALE_MS), replica, heartbeat_s=1.0)
        heard = {"on": True}
        feed.follow_relay(subject, lambda seconds: heard["on"])
        await feed.start()
        stack.push_async_callback(feed.stop)
        await feed.wait_synced(30)

        async def mode(want: str, consumers: int) -> bool:
            return feed.follow_mode == want and len(await _consumers(admin, b)) == consumers
        await until(lambda: mode("relay", 1), 30, "following the relay")
        seq = await kv.put("b", b"2")
        await until(lambda: feed.meta.applied_seq >= seq, 10, "a put through the relay")
        heard["on"] = False  # the fleet's relay gone silent
        t0 = time.monotonic()
        await until(lambda: mode("consumer", 2), 30, "back to a consumer")
        print(f"back to a consumer {time.monotonic() - t0:.1f} s after the relay went unheard "
              f"(period {feed.watch_period():.2f} s)")
        assert feed.follow_ends["relay"] == 1
        seq = await kv.put("c", b"3")
        await until(lambda: feed.meta.applied_seq >= seq and feed.fresh_within(MAX_STALE_MS), 10,
                    "a put through the consumer")
        heard["on"] = True
        feed.relay_heard()
        await until(lambda: mode("relay", 1), 30, "following the relay again")
        seq = await kv.put("d", b"4")
        await until(lambda: feed.meta.applied_seq >= seq, 10, "a put through the relay again")
        state = {}
        for _, key in replica.iter_keys(b):
            rec = replica.get(b, key)
            if rec is not None:
                state[rec.key] = (rec.value, rec.revision)
        assert state == await upstream_state(kv)
