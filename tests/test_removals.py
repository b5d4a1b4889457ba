"""Removals that leave no message in the stream, seen by a running sidecar: per-message TTL
(ADR-43 `Nats-TTL`, without markers), a whole-stream purge, a one-subject purge and the
stream's limits. Each is checked from outside, over the
socket with redis-py, against real nats-server processes: once the bucket no longer holds a
key, the sidecar must not serve it (at once for an expiry it knows the deadline of; within
max_stale_ms for the others), and keys the bucket still holds must stay.
"""
from __future__ import annotations

import asyncio
import time

import pytest
import redis
from nats.js.api import DiscardPolicy
from support.checkers import bucket_info, new_bucket, percentile, wait_synced
from support.poll import until

pytestmark = pytest.mark.timeout(120)

SEC = 1_000_000_000


async def ttl_bucket(js, history: int = 1) -> tuple[str, object]:
    """A KV bucket whose stream takes per-message TTLs, with no subject delete markers: the
    server removes an expired key without a message anyone could follow."""
    b = new_bucket()
    kv = await js.create_key_value(bucket=b, history=history)
    cfg = (await js.stream_info(f"KV_{b}")).config
    cfg.allow_msg_ttl = True
    await js.update_stream(cfg)
    return b, kv


async def put_ttl(js, bucket: str, key: str, value: bytes, ttl: str) -> int:
    ack = await js.publish(f"$KV.{bucket}.{key}", value, headers={"Nats-TTL": ttl})
    return ack.seq


def reader(sc) -> redis.Redis:
    return redis.Redis(unix_socket_path=sc.socket, socket_timeout=10)


async def test_per_message_ttl_is_not_served_past_its_deadline(nats_server_module, nc, sidecars):
    """100 keys put with `Nats-TTL: 2s`: every read made after a key's deadline (its
    creation time, as KV.GET reports it, plus the TTL) answers nil, through GET, MGET,
    EXISTS, KV.GET and KEYS; keys without a TTL, or with `never`, stay. Prints the time
    from each deadline to the first nil seen (reads every few ms)."""
    js = nc.jetstream()
    b, kv = await ttl_bucket(js)
    await kv.put("plain", b"p")
    sc = sidecars(nats_server_module.url, b).start(wait_synced=False)
    await wait_synced(sc, b, keys=1)
    await put_ttl(js, b, "forever", b"f", "never")
    keys = [f"t.{i:03d}" for i in range(100)]
    for k in keys:
        await put_ttl(js, b, k, b"v" + k.encode(), "2s")
    r = reader(sc)
    await until(lambda: r.exists(*[f"{b}:{k}" for k in keys]) == 100, what="TTL keys replicated")
    due = {k: int(r.execute_command("KV.GET", f"{b}:{k}")[2]) + 2 * SEC for k in keys}
    served_late: list[tuple[str, str]] = []
    first_nil: dict[str, int] = {}
    names = [f"{b}:{k}" for k in keys]
    deadline = time.monotonic() + 30
    while len(first_nil) < len(keys) and time.monotonic() < deadline:
        sent = time.time_ns()
        values = r.mget(names)
        for k, v in zip(keys, values, strict=True):
            if v is None:
                first_nil.setdefault(k, time.time_ns() - due[k])
            elif sent >= due[k]:
                served_late.append((k, "MGET"))
        for k in keys[:10]:  # the GET path (native when built) and KV.GET, one key at a time
            sent = time.time_ns()
            if sent >= due[k]:
                if r.get(f"{b}:{k}") is not None:
                    served_late.append((k, "GET"))
                if r.execute_command("KV.GET", f"{b}:{k}") is not None:
                    served_late.append((k, "KV.GET"))
                if r.exists(f"{b}:{k}"):
                    served_late.append((k, "EXISTS"))
        await asyncio.sleep(0.002)
    assert not served_late, served_late[:10]
    assert len(first_nil) == len(keys)
    assert sorted(x.decode() for x in r.keys(f"{b}:*")) == [f"{b}:forever", f"{b}:plain"]
    assert r.get(f"{b}:plain") == b"p" and r.get(f"{b}:forever") == b"f"
    lat = sorted(v / 1e6 for v in first_nil.values())
    print(f"\nNats-TTL 2s, {len(lat)} keys: deadline -> first nil p50 {percentile(lat, 0.5):.2f} ms, "
          f"p99 {percentile(lat, 0.99):.2f} ms, max {lat[-1]:.2f} ms (a read every ~5 ms)")
    # the sweep takes them out of the replica too (no full pass: the expiry index)
    await until(lambda: bucket_info(sc, b)["keys"] == 2, what="expired records swept")
    assert bucket_info(sc, b)["resyncs"] == 0


async def test_ttl_survives_a_restart_and_a_resync(nats_server_module, nc, sidecars):
    """The deadline is data: a key put with a TTL before the sidecar starts (initial sync)
    or while it is down (resume) expires on time."""
    js = nc.jetstream()
    b, kv = await ttl_bucket(js)
    await put_ttl(js, b, "early", b"e", "3s")
    sc = sidecars(nats_server_module.url, b).start(wait_synced=False)
    await wait_synced(sc, b, keys=1)
    sc.kill()
    await put_ttl(js, b, "while-down", b"w", "3s")
    await kv.put("stays", b"s")
    sc.start(wait_synced=False)
    await wait_synced(sc, b)
    r = reader(sc)
    dues = {k: int(r.execute_command("KV.GET", f"{b}:{k}")[2]) + 3 * SEC for k in ("early", "while-down")}
    await until(lambda: time.time_ns() > max(dues.values()), what="deadlines passed")
    assert r.mget([f"{b}:early", f"{b}:while-down", f"{b}:stays"]) == [None, None, b"s"]


async def until_gone(r: redis.Redis, names: list[str], t0: float, timeout: float = 30) -> float:
    """Seconds from t0 until none of `names` is served (checked every 5 ms)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(v is not None for v in r.mget(names)):
            return time.monotonic() - t0
        await asyncio.sleep(0.005)
    raise AssertionError(f"still served after {timeout}s: {r.mget(names)}")


async def test_purges_while_running_stop_being_served(nats_server_module, nc, sidecars):
    """A one-subject purge, a stream shrunk by its limits and a whole-stream purge, each while
    the sidecar runs: the keys go (within max_stale_ms, 5 s here), the others stay, no resync."""
    js = nc.jetstream()
    b = new_bucket()
    kv = await js.create_key_value(bucket=b)
    stream = f"KV_{b}"
    for i in range(20):
        await kv.put(f"k.{i:02d}", b"v%d" % i)
    sc = sidecars(nats_server_module.url, b).start(wait_synced=False)
    await wait_synced(sc, b, keys=20)
    r = reader(sc)
    took = {}

    t0 = time.monotonic()
    await js.purge_stream(stream, subject=f"$KV.{b}.k.03")
    took["one-subject purge"] = await until_gone(r, [f"{b}:k.03"], t0)

    cfg = (await js.stream_info(stream)).config
    cfg.max_msgs = 15  # enforced at the next put: the five oldest messages leave the front
    cfg.discard = DiscardPolicy.OLD  # (a KV bucket refuses puts over its limits otherwise)
    await js.update_stream(cfg)
    t0 = time.monotonic()
    await kv.put("k.20", b"v20")  # (k.00, k.01, k.02, k.04, k.05: k.03 was purged)
    took["limits (max_msgs)"] = await until_gone(r, [f"{b}:k.0{i}" for i in (0, 1, 2, 4, 5)], t0)
    left = [f"{b}:k.{i:02d}" for i in range(6, 21)]
    assert None not in r.mget(left)

    t0 = time.monotonic()
    await js.purge_stream(stream)
    took["whole-stream purge"] = await until_gone(r, left, t0)
    # each removed key counted once: 1 purged + 5 off the front + the 15 left, whichever
    # of the poll and the purge request's checks (at +0.1 s and +1 s) saw them first
    await until(lambda: bucket_info(sc, b)["removed_upstream"] >= 21, what="removals counted")
    await asyncio.sleep(1.5)
    row = bucket_info(sc, b)
    assert row["removed_upstream"] == 21, row
    assert row["keys"] == 0 and row["resyncs"] == 0 and row["synced"] == 1
    await kv.put("after", b"a")
    await until(lambda: r.get(f"{b}:after") == b"a", what="a put after the purge")
    print("\n" + "\n".join(f"{k}: gone after {v * 1000:.0f} ms" for k, v in took.items())
          + f"\nstream state polls: {row['state_polls']}")
