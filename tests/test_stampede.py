"""Hot keys without a stampede, in a running sidecar against a real nats-server:
concurrent reads of one key that must ask NATS share one Direct Get (kvcache/read/flights.py,
under the rule of kvcache.read.policy.may_join), and a write of a cached key reaches the near
cache through the feed, so the next read needs no Direct Get at all. INFO `routed_requests`
counts the requests the router sent, `reads_coalesced` the reads that joined one.

The rules that a strong, bounded or MINREV read never joins a request it may not take are
shown here with the sidecar's NATS connection behind a proxy that delays each way
(support.topology.DelayProxy), so that a request stays in flight long enough for another read
to arrive while it is; each rule is also tested alone in tests/test_flights.py.
"""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import redis
from support.kvdata import _put_all, kv_delete, kv_put
from support.poll import wait_until
from support.sidecar_proc import SidecarProcess
from support.topology import DelayProxy, nats_run

from kvcache.app.client import Client, encode_command

pytestmark = pytest.mark.servers


def counters(sock: str) -> tuple[int, int, int]:
    """(routed_requests, reads_coalesced, gets_cached) now."""
    with Client(sock) as c:
        info = c.info("all")
    return (int(info["routing"]["routed_requests"]), int(info["stats"]["reads_coalesced"]),
            int(info["stats"]["gets_cached"]))


def cache_row(sock: str, bucket: str) -> dict:
    with Client(sock) as c:
        return c.info("buckets")["buckets"][bucket]


def read_reply(s: socket.socket) -> bytes | None:
    """One bulk reply (or nil) from a raw connection."""
    buf = b""
    while b"\r\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            raise EOFError(buf)
        buf += chunk
    head, _, rest = buf.partition(b"\r\n")
    n = int(head[1:])
    if n < 0:
        return None
    while len(rest) < n + 2:
        chunk = s.recv(65536)
        if not chunk:
            raise EOFError(buf)
        rest += chunk
    return rest[:n]


def burst(sock: str, key: str, n: int) -> list[bytes | None]:
    """n connections, each sending one GET of `key`, all sent before any reply is read."""
    conns = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(30)
            s.connect(sock)
            conns.append(s)
        request = encode_command(["GET", key])
        for s in conns:
            s.sendall(request)
        return [read_reply(s) for s in conns]
    finally:
        for s in conns:
            s.close()


@pytest.fixture(scope="module")
def env(nats_server_module, tmp_path_factory) -> Iterator[dict]:
    """Bucket `hot` replicates `in.>` and caches up to 100 other keys."""
    url = nats_server_module.url

    async def setup(js):
        kv = await js.create_key_value(bucket="hot", direct=True)
        await _put_all(kv, {"in.a": b"A", **{f"out.{i}": b"o%d" % i for i in range(20)}})

    nats_run(url, setup)
    d = tmp_path_factory.mktemp("stampede")
    sc = SidecarProcess(d / "sc", url, ["hot:in.>"], extra=["--cache-max-keys", "100"])
    with sc:
        sc.start()
        yield {"url": url, "sock": sc.socket}
        assert sc.stop() == 0


def test_a_write_of_a_cached_key_reaches_the_cache_with_no_direct_get(env):
    """The feed replaces the cached record: the next read (and a burst) gets the new value
    from the cache; a delete becomes a cached not-found, and a later write a value again."""
    sock, url = env["sock"], env["url"]
    r = redis.Redis(unix_socket_path=sock)
    try:
        assert r.get("hot:out.2") == b"o2"
        wait_until(lambda: cache_row(sock, "hot")["cache_keys"] >= 1, 10, "out.2 cached")
        with Client(sock) as c:
            assert c.entry("hot:out.2").source == "cache"
        updates = cache_row(sock, "hot")["cache_updates"]
        routed, _, cached = counters(sock)
        kv_put(url, "hot", "out.2", b"new")
        wait_until(lambda: cache_row(sock, "hot")["cache_updates"] > updates, 10, "the feed's update")
        assert burst(sock, "hot:out.2", 50) == [b"new"] * 50
        assert r.get("hot:out.2") == b"new"
        kv_delete(url, "hot", "out.2")
        wait_until(lambda: cache_row(sock, "hot")["cache_updates"] > updates + 1, 10, "the delete")
        assert r.get("hot:out.2") is None
        kv_put(url, "hot", "out.2", b"again")
        wait_until(lambda: cache_row(sock, "hot")["cache_updates"] > updates + 2, 10, "the write")
        assert r.get("hot:out.2") == b"again"
        routed2, _, cached2 = counters(sock)
        assert routed2 == routed  # not one Direct Get since the key was cached
        assert cached2 - cached == 53
    finally:
        r.close()


def test_cached_hits_answer_on_the_get_fast_path_under_the_same_rules(env):
    """A cached value and a cached not-found answered by GET (the fast path) and MGET/KV.GET
    (the generic path) alike; pipelined GETs mixing cached, uncached and replicated keys keep
    their order."""
    sock = env["sock"]
    r = redis.Redis(unix_socket_path=sock)
    try:
        assert r.get("hot:out.3") == b"o3" and r.get("hot:out.none") is None  # now cached
        routed, _, cached = counters(sock)
        p = r.pipeline(transaction=False)
        for k in ("hot:out.3", "hot:in.a", "hot:out.none", "hot:out.4", "hot:out.3", "hot:out.none"):
            p.get(k)
        assert p.execute() == [b"o3", b"A", None, b"o4", b"o3", None]
        routed2, _, cached2 = counters(sock)
        assert routed2 - routed == 1          # out.4 only
        assert cached2 - cached == 4          # out.3 and out.none, twice each
    finally:
        r.close()


@pytest.fixture
def slow(nats_server, tmp_path) -> Iterator[dict]:
    """A sidecar whose NATS connection is delayed 0.4 s each way: a Direct Get stays in
    flight for 0.8 s. Bucket `slow` replicates nothing (every key is read from NATS) and has no
    near cache, so that every read asks NATS."""
    async def setup(js):
        kv = await js.create_key_value(bucket="slow", direct=True)
        await _put_all(kv, {"k": b"1"})

    nats_run(nats_server.url, setup)
    proxy = DelayProxy(nats_server.port, delay=0.4).start()
    sc = SidecarProcess(tmp_path / "sc", proxy.url, ["slow:none.>"], extra=["--max-stale-ms", "5000"])
    try:
        sc.start(timeout=120)
        yield {"url": nats_server.url, "sock": sc.socket}
    finally:
        sc.kill()
        proxy.stop()


def in_background(fn) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    return t, out


def test_a_burst_on_a_cold_key_sends_one_direct_get(slow):
    """100 connections read one key at once: one request, the other 99 join it. (Against the
    delayed connection, so that every read arrives while the request is in flight: on a fast
    one a read parsed after the answer came back sends a request of its own, as it should.)"""
    sock = slow["sock"]
    routed, coalesced, _ = counters(sock)
    answers = burst(sock, "slow:k", 100)
    routed2, coalesced2, _ = counters(sock)
    assert answers == [b"1"] * 100
    assert routed2 - routed == 1
    assert coalesced2 - coalesced == 99


def test_reads_join_only_the_requests_their_guarantee_allows(slow):
    sock = slow["sock"]
    r = redis.Redis(unix_socket_path=sock, socket_timeout=30)
    try:
        assert r.get("slow:k") == b"1"  # connections up, the peer measured
        routed, coalesced, _ = counters(sock)
        first, out1 = in_background(lambda: redis.Redis(unix_socket_path=sock).get("slow:k"))
        time.sleep(0.3)  # the first request is in flight, sent 0.3 s ago
        joins, out2 = in_background(lambda: redis.Redis(unix_socket_path=sock).get("slow:k"))
        bounded, out3 = in_background(lambda: redis.Redis(unix_socket_path=sock).execute_command(
            "KV.GET", "slow:k", "MAXSTALE", "100"))  # may not take an answer sent 300 ms ago
        time.sleep(0.1)  # (else the bounded read may join the strong one, which is allowed)
        strong, out4 = in_background(lambda: redis.Redis(unix_socket_path=sock).execute_command(
            "KV.GET", "slow:k", "CONSISTENCY", "strong"))  # never one sent before it arrived
        for t in (first, joins, bounded, strong):
            t.join(30)
        assert out1 == out2 == [b"1"] and out3[0][0] == out4[0][0] == b"1"
        routed2, coalesced2, _ = counters(sock)
        assert coalesced2 - coalesced == 1   # the plain read within its bound
        assert routed2 - routed == 3         # the first, the bounded and the strong read
    finally:
        r.close()


def test_a_minrev_read_below_the_joined_answer_asks_again(slow):
    """A MINREV read joins a request in flight as a plain read would; when the answer's
    revision is below its MINREV (the key was written after that request reached the
    server), it asks the leader itself and gets the new revision."""
    sock, url = slow["sock"], slow["url"]
    r = redis.Redis(unix_socket_path=sock, socket_timeout=30)
    try:
        e = r.execute_command("KV.GET", "slow:k")
        rev = int(e[1])
        routed, coalesced, _ = counters(sock)
        first, out1 = in_background(lambda: redis.Redis(unix_socket_path=sock).execute_command(
            "KV.GET", "slow:k"))
        time.sleep(0.55)  # the request reached the server (0.4 s) and its answer is on its way back
        kv_put(url, "slow", "k", b"2")  # a new revision, straight to the server
        minrev, out2 = in_background(lambda: redis.Redis(unix_socket_path=sock).execute_command(
            "KV.GET", "slow:k", "MINREV", str(rev + 1)))
        first.join(30)
        minrev.join(30)
        assert out1[0][0] == b"1" and int(out1[0][1]) == rev
        assert out2[0][0] == b"2" and int(out2[0][1]) == rev + 1
        routed2, coalesced2, _ = counters(sock)
        assert coalesced2 - coalesced == 1   # it joined the first request...
        assert routed2 - routed == 2         # ...and, below its MINREV, asked again
    finally:
        r.close()
