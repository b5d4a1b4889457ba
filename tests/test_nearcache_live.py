"""The near cache in a running sidecar (issue 17): keys outside a bucket's filters, filled by
fallback reads and kept true by the bucket's feed. A real nats-server, the sidecar as a
process, nats-py as the writer, redis-py and kvcache.Client as readers.

Buckets: `big` replicates nothing (`--bucket big:`) and is served by its cache alone; `mix`
replicates `in.>` and caches the rest. Both caches hold at most 50 keys.
"""
from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis
from support.kvdata import _put_all, kv_delete, kv_put
from support.poll import wait_until
from support.sidecar_proc import SidecarProcess
from support.topology import nats_run

from kvcache.client import Client

CACHE_KEYS = 50


@pytest.fixture(scope="module")
def env(nats_server_module, tmp_path_factory) -> Iterator[dict]:
    url = nats_server_module.url

    async def setup(js):
        big = await js.create_key_value(bucket="big", direct=True)
        await _put_all(big, {f"k.{i}": b"v%d" % i for i in range(2000)})
        cfg = (await js.stream_info("KV_big")).config
        cfg.allow_msg_ttl = True
        await js.update_stream(cfg)
        mix = await js.create_key_value(bucket="mix", direct=True)
        await _put_all(mix, {"in.a": b"A", "out.b": b"B", "out.c": b"C"})

    nats_run(url, setup)
    d = tmp_path_factory.mktemp("nc")
    sc = SidecarProcess(d / "sc", url, ["big:", "mix:in.>"],
                        extra=["--cache-max-keys", str(CACHE_KEYS), "--heartbeat-ms", "500"])
    with sc:
        sc.start()
        yield {"url": url, "sc": sc, "sock": sc.socket, "dir": d}
        assert sc.stop() == 0


def stats(env: dict) -> dict:
    with Client(env["sock"]) as c:
        return c.info("stats")["stats"]


def bucket(env: dict, name: str) -> dict:
    with Client(env["sock"]) as c:
        return c.info("buckets")["buckets"][name]


def test_a_second_read_is_a_cache_hit(env):
    with Client(env["sock"]) as c:
        before = stats(env)
        assert c.get("big:k.1") == b"v1"                     # from NATS, then kept
        assert c.get("big:k.1") == b"v1"                     # from the cache
        after = stats(env)
        assert after["gets_remote"] - before["gets_remote"] == 1
        assert after["gets_cached"] - before["gets_cached"] == 1
        e = c.entry("big:k.1")
        assert (e.value, e.source) == (b"v1", "cache")
        assert bucket(env, "big")["cache_keys"] >= 1


def test_writer_changes_reach_cached_keys(env):
    url = env["url"]
    r = redis.Redis(unix_socket_path=env["sock"])
    try:
        assert r.get("big:k.2") == b"v2" and r.get("big:k.2") == b"v2"
        kv_put(url, "big", "k.2", b"new")
        wait_until(lambda: r.get("big:k.2") == b"new", 10, "the new value")
        assert r.get("big:k.2") == b"new"
        kv_delete(url, "big", "k.2")
        wait_until(lambda: r.get("big:k.2") is None, 10, "the delete")
        assert r.get("big:k.3") == b"v3" and r.get("big:k.3") == b"v3"
        kv_delete(url, "big", "k.3", purge=True)
        wait_until(lambda: r.get("big:k.3") is None, 10, "the purge")
        kv_put(url, "big", "t.1", b"short", ttl="2s")
        wait_until(lambda: r.get("big:t.1") == b"short", 10, "the TTL key")
        assert r.get("big:t.1") == b"short"  # cached with its deadline
        assert 0 < r.pttl("big:t.1") <= 2000
        time.sleep(2.2)
        assert r.get("big:t.1") is None
        assert bucket(env, "big")["cache_invalidations"] >= 2
    finally:
        r.close()


def test_mget_mixes_replicated_cached_and_uncached(env):
    with Client(env["sock"]) as c:
        assert c.get("mix:out.b") == b"B"   # now cached
        before = stats(env)
        got = c.mget(["mix:in.a", "mix:out.b", "mix:out.c", "mix:out.none", "big:k.1"])
        assert got == [b"A", b"B", b"C", None, b"v1"]
        after = stats(env)
        assert after["gets_cached"] - before["gets_cached"] == 2   # out.b and big:k.1
        assert after["gets_local"] - before["gets_local"] == 1     # in.a
        assert c.mget(["mix:out.c"]) == [b"C"]                      # cached by the MGET's batch
        assert stats(env)["gets_cached"] - after["gets_cached"] == 1


def test_a_scan_of_cold_keys_keeps_the_bound_and_the_hot_keys(env):
    with Client(env["sock"]) as c:
        hot = [f"big:k.{i}" for i in range(100, 110)]
        for _ in range(6):
            for k in hot:
                c.get(k)
        for i in range(500, 1500):  # a scan, while the hot keys go on being read
            c.get(f"big:k.{i}")
            if i % 50 == 0:
                for k in hot:
                    c.get(k)
        b = bucket(env, "big")
        assert b["cache_keys"] <= CACHE_KEYS
        before = stats(env)["gets_cached"]
        for k in hot:
            c.get(k)
        assert stats(env)["gets_cached"] - before >= 9  # a sketch estimates: one may be out


def test_a_stream_purge_empties_the_cache(env):
    url = env["url"]
    with Client(env["sock"]) as c:
        assert c.get("mix:out.c") == b"C" and c.get("mix:out.c") == b"C"

        async def purge(js):
            await js.purge_stream("KV_mix")
        nats_run(url, purge)
        wait_until(lambda: c.get("mix:out.c") is None, 10, "the purge to reach the cache")
        wait_until(lambda: c.get("mix:in.a") is None, 10, "the purge to reach the replica")
        kv_put(url, "mix", "out.c", b"C2")
        wait_until(lambda: c.get("mix:out.c") == b"C2", 10, "the key again")


def test_a_restart_finds_a_warm_cache_and_what_changed_meanwhile(env):
    url, sc = env["url"], env["sc"]
    with Client(env["sock"]) as c:
        for k in ("big:k.20", "big:k.21"):
            assert c.get(k) and c.get(k)
    assert sc.stop() == 0
    kv_put(url, "big", "k.21", b"changed while down")
    sc.start()
    with Client(env["sock"]) as c:
        before = stats(env)
        assert c.get("big:k.20") == b"v20"
        assert c.get("big:k.21") == b"changed while down"
        after = stats(env)
        assert after["gets_cached"] - before["gets_cached"] == 1  # k.20 from the warm cache
        assert bucket(env, "big")["cache_keys"] >= 1
