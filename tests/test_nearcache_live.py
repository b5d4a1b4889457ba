"""The near cache in a running sidecar: keys outside a bucket's filters, filled by
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

from kvcache.app.client import Client

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
        # the put, the delete, the purge and the TTL key's write replaced cached records in
        # place (the feed keeps cached keys current; it used to drop them)
        assert bucket(env, "big")["cache_updates"] >= 3
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
        for k in ("big:k.20", "big:k.21"):  # read until admitted (hot enough against the cache's keys)
            wait_until(lambda k=k: c.get(k) and c.entry(k).source == "cache", 10, f"{k} cached")
    assert sc.stop() == 0
    kv_put(url, "big", "k.21", b"changed while down")
    sc.start()
    with Client(env["sock"]) as c:
        before = stats(env)
        assert c.get("big:k.20") == b"v20"
        assert c.get("big:k.21") == b"changed while down"
        after = stats(env)
        # k.20 from the warm cache, and k.21 too: the feed resumed, delivered the change made
        # while it was down and replaced the cached record (it used to drop it, and
        # k.21 was read from NATS)
        assert after["gets_cached"] - before["gets_cached"] == 2
        assert after["gets_remote"] == before["gets_remote"]
        assert bucket(env, "big")["cache_keys"] >= 1


def test_cached_keys_reach_tracking_clients_and_subscribers(env):
    """A value served by the near cache is vouched for like a replica read: a tracking client
    keeps it and is told when the feed sees it change; keyspace subscribers get the change."""
    from support.resp_conn import RespConn
    url = env["url"]
    c = RespConn(env["sock"])
    sub = RespConn(env["sock"])
    try:
        c.call("HELLO", "3", until=b"modules\r\n*0\r\n")
        assert c.call("CLIENT", "TRACKING", "ON") == b"+OK\r\n"
        push = b">2\r\n$10\r\ninvalidate\r\n*1\r\n$8\r\nbig:k.30\r\n"
        # from NATS: not vouched for, so invalidated right after the reply
        got = c.call("GET", "big:k.30", until=b"v30\r\n")
        assert got == b"$3\r\nv30\r\n", got
        assert c.read(push) == push
        assert c.call("GET", "big:k.30", until=b"v30\r\n") == b"$3\r\nv30\r\n"  # the cache: kept
        # `big` is the default bucket: its keys' channels name them bare
        assert sub.call("SUBSCRIBE", "__keyspace@0__:k.30", until=b":1\r\n").startswith(b"*3")
        kv_put(url, "big", "k.30", b"w30")
        assert c.read(push) == push
        want = b"*3\r\n$7\r\nmessage\r\n$19\r\n__keyspace@0__:k.30\r\n$3\r\nset\r\n"
        assert sub.read(want) == want
    finally:
        c.close()
        sub.close()


def test_a_million_distinct_keys_stay_within_the_bounds(env):
    """Hostile key patterns: MGETs of 1,000,000 distinct keys (2,000 of them exist) go to
    NATS in batches; the cache stays at its bound and the sidecar's memory does not grow
    with them (RSS from /proc, before and after)."""
    sc = env["sc"]

    def rss_kb() -> int:
        for line in open(f"/proc/{sc.proc.pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    rss = []
    with Client(env["sock"], timeout=60) as c:
        for start in range(0, 1_000_000, 1000):
            c.mget([f"big:scan.{i}" for i in range(start, start + 1000)] + [f"big:k.{start % 2000}"])
            if start % 200_000 == 0:
                rss.append(rss_kb())
    rss.append(rss_kb())
    b = bucket(env, "big")
    assert b["cache_keys"] <= CACHE_KEYS
    # The per-key plan caches fill up within the first 200,000 keys (bounded: 65,536 and
    # 100,000 entries); from then on nothing grows with the number of keys seen.
    print("RSS kB at 0, 200k, ... 1M keys:", rss)
    assert rss[-1] - rss[1] < 16 * 1024, rss


def test_consumer_loss_and_recovery(nats_server, tmp_path):
    """The feed cut off (its connection frozen): once it is no longer fresh within
    max_stale_ms the cache answers nothing (the replica's rule); a change made meanwhile is
    seen once the feed is back."""
    from support.topology import DelayProxy

    async def setup(js):
        kv = await js.create_key_value(bucket="cut", direct=True)
        await kv.put("a", b"1")
    nats_run(nats_server.url, setup)
    proxy = DelayProxy(nats_server.port).start()
    sc = SidecarProcess(tmp_path / "sc", proxy.url, ["cut:"],
                        extra=["--cache-max-keys", "10", "--max-stale-ms", "300", "--heartbeat-ms", "200",
                               "--request-timeout-ms", "500"])
    try:
        sc.start()
        with Client(sc.socket, timeout=10) as c:
            assert c.get("a") == b"1" and c.entry("a").source == "cache"
            proxy.freeze()
            wait_until(lambda: c.info("buckets")["buckets"]["cut"]["lag_ms"] > 300, 20, "the feed stale")
            cached = c.info("stats")["stats"]["gets_cached"]
            kv_put(nats_server.url, "cut", "a", b"2")   # straight to the server: unseen
            for _ in range(3):
                try:
                    assert c.get("a") != b"1"  # never the cached value while stale
                except Exception as e:  # NATS is out of reach: an error, not the old value
                    assert "upstream" in str(e) or "timed out" in str(e), e
            assert c.info("stats")["stats"]["gets_cached"] == cached
            proxy.thaw()
            wait_until(lambda: c.get("a") == b"2", 20, "the change once the feed is back")
    finally:
        sc.kill()
        proxy.stop()


def test_a_missing_key_is_cached_until_it_is_written(env):
    """A not-found from the bucket's own stream is cached like a value, so a hot missing key
    costs one Direct Get, not one per read: GET, EXISTS, TTL, MGET and KV.GET answer it from
    the cache. The write that creates the key reaches the cache through the feed; a deletion's
    not-found is cached again and the next write reaches that too. Once the written value was
    read, no read goes back to the not-found."""
    url = env["url"]
    r = redis.Redis(unix_socket_path=env["sock"])
    try:
        def cached_not_found() -> bool:
            before = stats(env)
            assert r.get("big:miss.1") is None
            after = stats(env)
            return (after["gets_cached"] - before["gets_cached"],
                    after["gets_remote"] - before["gets_remote"]) == (1, 0)
        wait_until(cached_not_found, 10, "the not-found answered by the near cache")
        before = stats(env)
        assert r.exists("big:miss.1") == 0
        assert r.ttl("big:miss.1") == -2
        assert r.mget(["big:miss.1", "big:miss.1"]) == [None, None]
        with Client(env["sock"]) as c:
            assert c.entry("big:miss.1") is None
        after = stats(env)
        assert after["gets_remote"] == before["gets_remote"]
        assert after["gets_cached"] - before["gets_cached"] == 5
        assert after["gets_notfound"] - before["gets_notfound"] == 5

        def written(value: bytes) -> None:
            seen = False
            def reads() -> bool:
                nonlocal seen
                got = r.get("big:miss.1")
                assert not (seen and got != value), f"back to {got!r} after {value!r} was read"
                seen = seen or got == value
                return seen
            wait_until(reads, 10, f"the write of {value!r}")
            for _ in range(20):
                assert r.get("big:miss.1") == value

        kv_put(url, "big", "miss.1", b"here")
        written(b"here")
        kv_delete(url, "big", "miss.1")
        wait_until(lambda: r.get("big:miss.1") is None, 10, "the delete")
        wait_until(cached_not_found, 10, "the deletion's not-found cached")
        kv_put(url, "big", "miss.1", b"back")
        written(b"back")
    finally:
        r.close()


def test_not_founds_from_a_mirror_are_not_cached(nats_server, tmp_path):
    """Only answers of the bucket's own stream go into the near cache: a mirror (a [[peer]])
    may lag without bound, and neither its values nor its not-founds are kept. The main
    connection goes through a proxy 0.3 s each way, so once both are measured the router
    sends every read to the mirror."""
    from nats.js.api import StreamConfig, StreamSource
    from support.topology import DelayProxy

    async def setup(js):
        kv = await js.create_key_value(bucket="pn", direct=True)
        await _put_all(kv, {f"w.{i}": b"w%d" % i for i in range(20)})
        await js.add_stream(StreamConfig(name="KV_pn_m", mirror=StreamSource(name="KV_pn"),
                                         allow_direct=True))
    nats_run(nats_server.url, setup)
    main = DelayProxy(nats_server.port, delay=0.3).start()
    conf = tmp_path / "kvcache.toml"
    conf.write_text(f'cache_max_keys = 100\n[nats]\nservers = ["{main.url}"]\n'
                    '[[bucket]]\nname = "pn"\nkeys = []\n'
                    f'[[peer]]\nname = "copy"\nservers = ["{nats_server.url}"]\nstream = "KV_pn_m"\n')
    sc = SidecarProcess(tmp_path / "sc", None, extra=["--config", str(conf)])
    try:
        sc.start()
        r = redis.Redis(unix_socket_path=sc.socket)
        try:
            # every peer measured (the first reads go to the unmeasured ones; what the main
            # connection answered may be cached): then the mirror is cheaper by 0.6 s
            wait_until(lambda: all(r.get(f"pn:w.{i}") == b"w%d" % i for i in range(10)), 30, "reads")

            def requests() -> dict[str, int]:
                with sc.client() as c:
                    return {name: row["requests"] for name, row in c.info("peers")["peers"].items()}
            before, sent = stats({"sock": sc.socket}), requests()
            for _ in range(10):
                assert r.get("pn:nothing") is None
                assert r.get("pn:w.15") == b"w15"
            after, now = stats({"sock": sc.socket}), requests()
            assert now["copy"] - sent["copy"] >= 20  # (a hedge may have gone to main too)
            assert after["gets_remote"] - before["gets_remote"] == 20
            assert after["gets_cached"] == before["gets_cached"]
        finally:
            r.close()
    finally:
        sc.kill()
        main.stop()


def test_a_bucket_replicating_nothing_is_at_the_stream_end_once_synced(nats_server, tmp_path):
    """`keys = []` syncs nothing: its position is the stream's last sequence from the start,
    not from the first heartbeat (INFO and kvcache_replica_lag_messages showed such a bucket
    thousands of messages behind for seconds after every start)."""
    async def setup(js):
        kv = await js.create_key_value(bucket="pz", direct=True)
        await _put_all(kv, {f"z.{i}": b"z" for i in range(300)})
    nats_run(nats_server.url, setup)
    conf = tmp_path / "kvcache.toml"
    conf.write_text(f'cache_max_keys = 100\nheartbeat_ms = 5000\n[nats]\nservers = ["{nats_server.url}"]\n'
                    '[[bucket]]\nname = "pz"\nkeys = []\n')
    sc = SidecarProcess(tmp_path / "sc", None, extra=["--config", str(conf)])
    try:
        sc.start(wait_synced=False)
        seen: list[tuple[int, int]] = []

        def synced_row() -> dict | None:
            with sc.client() as c:
                row = c.info("buckets")["buckets"]["pz"]
            if row["synced"]:
                seen.append((row["applied_seq"], row["upstream_seq"]))
                return row
            return None
        wait_until(synced_row, 30, "the bucket synced")
        assert seen[0] == (300, 300)  # the heartbeat is 5 s away: this is the position at once
    finally:
        sc.kill()
