"""Client-side caching (CLIENT TRACKING), the TCP listener and AUTH, against a real sidecar
fed by a real nats-server; nats-py is the writer.

Clients: redis-py with `cache_config` over the TCP listener (its cache needs TCP and a server
that says it is redis >= 7.4: `--compat-identity`), and raw sockets for the exact pushes.

Layout: `main` (the default bucket) replicates `in.>`, so `out.*` keys are read from NATS;
`ttl` allows per-message TTLs.
"""
from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
import redis
from redis.cache import CacheConfig
from support.kvdata import kv_delete, kv_put, read_until
from support.poll import wait_until
from support.resp_conn import RespConn
from support.sidecar_proc import SidecarProcess
from support.topology import nats_run

from kvcache.app.client import Client
from kvcache.app.client import encode_command as encode

PASSWORD = "s3cret-pass"


put, delete = kv_put, kv_delete


@pytest.fixture(scope="module")
def env(nats_server_module, tmp_path_factory) -> Iterator[dict]:
    url = nats_server_module.url

    async def setup(js):
        main = await js.create_key_value(bucket="main", direct=True)
        for i in range(10):
            await main.put(f"in.k{i}", b"v%d" % i)
        await main.put("out.r1", b"remote1")
        await js.create_key_value(bucket="ttl", direct=True)
        cfg = (await js.stream_info("KV_ttl")).config
        cfg.allow_msg_ttl = True
        await js.update_stream(cfg)
        second = await js.create_key_value(bucket="second", direct=True)
        await second.put("s.a", b"A")
        await js.create_key_value(bucket="aged", direct=True, ttl=2)  # max_age 2 s

    nats_run(url, setup)
    d = tmp_path_factory.mktemp("trk")
    (d / "pass").write_text(PASSWORD + "\n")
    sc = SidecarProcess(d / "sc", url, ["main:in.>", "ttl", "second", "aged"],
                        extra=["--listen", "127.0.0.1:0", "--requirepass-file", str(d / "pass"),
                               "--compat-identity", "--heartbeat-ms", "500"])
    with sc:
        sc.start()
        with Client(sc.socket) as c:
            host, _, port = c.info("server")["server"]["listen"].rpartition(":")
        yield {"url": url, "sc": sc, "sock": sc.socket, "host": host, "port": int(port)}
        assert sc.stop() == 0


class Raw(RespConn):
    """A raw connection to the sidecar: TCP (authenticated unless `auth=False`) or its socket."""

    def __init__(self, env: dict, tcp: bool = True, auth: bool = True) -> None:
        super().__init__((env["host"], env["port"]) if tcp else env["sock"])
        if tcp and auth:
            assert self.call("AUTH", PASSWORD) == b"+OK\r\n"


def seen(env: dict, key: str, value: bytes | None) -> None:
    """Wait until the sidecar's replica answers `key` with `value`."""
    with Client(env["sock"]) as k:
        wait_until(lambda: k.get(key) == value, 10, f"{key} to be {value!r}")


def push(*keys: str) -> bytes:
    return b">2\r\n$10\r\ninvalidate\r\n" + encode(list(keys))


def hello3(c: Raw) -> None:
    c.call("HELLO", "3", until=b"modules\r\n*0\r\n")


# --------------------------------------------------------------------------- TCP and AUTH


def test_tcp_needs_auth_the_unix_socket_does_not(env):
    c = Raw(env, auth=False)
    try:
        assert c.call("GET", "in.k1") == b"-NOAUTH Authentication required.\r\n"
        assert c.call("PING") == b"-NOAUTH Authentication required.\r\n"
        assert c.call("HELLO", "3").startswith(b"-NOAUTH HELLO must be called with the client already authenticated")
        assert c.call("AUTH", "wrong") == b"-WRONGPASS invalid username-password pair or user is disabled.\r\n"
        assert c.call("AUTH", "bob", PASSWORD) == b"-WRONGPASS invalid username-password pair or user is disabled.\r\n"
        assert c.call("GET", "in.k1") == b"-NOAUTH Authentication required.\r\n"
        got = c.call("HELLO", "3", "AUTH", "default", PASSWORD, until=b"modules\r\n*0\r\n")
        assert b"$6\r\nserver\r\n$5\r\nredis\r\n$7\r\nversion\r\n$5\r\n7.4.0\r\n" in got  # --compat-identity
        assert c.call("GET", "in.k1", until=b"v1\r\n") == b"$2\r\nv1\r\n"
        assert c.call("RESET") == b"+RESET\r\n"  # and not authenticated any more
        assert c.call("GET", "in.k1") == b"-NOAUTH Authentication required.\r\n"
    finally:
        c.close()
    u = Raw(env, tcp=False)
    try:  # the socket's file mode is its guard; the password is still checked when given
        assert u.call("GET", "in.k1", until=b"v1\r\n") == b"$2\r\nv1\r\n"
        assert u.call("AUTH", "wrong").startswith(b"-WRONGPASS")
        assert u.call("AUTH", PASSWORD) == b"+OK\r\n"
    finally:
        u.close()
    with Client(env["sock"]) as k:
        server = k.info("server")["server"]
        assert server["kvcache_version"] and server["redis_version"] == "7.4.0"
    assert PASSWORD not in env["sc"].log()


def test_redis_py_over_tcp_with_password(env):
    r = redis.Redis(host=env["host"], port=env["port"], password=PASSWORD, protocol=3)
    try:
        assert r.get("in.k2") == b"v2"
        assert r.mget("in.k1", "second:s.a") == [b"v1", b"A"]
        info = r.client_info()
        assert info["addr"].startswith("127.0.0.1:")
    finally:
        r.close()
    bad = redis.Redis(host=env["host"], port=env["port"], password="nope")
    with pytest.raises(redis.AuthenticationError):
        bad.get("in.k1")
    bad.close()


# --------------------------------------------------------------------------- invalidations


def test_invalidation_push_on_every_change(env):
    """RESP3: one invalidation per change of a key read, one-shot (a key not read again is not
    pushed again), never inside a reply; PUT, DEL, PURGE, and the long key forms."""
    url = env["url"]
    put(url, "main", "in.t1", b"a")
    put(url, "second", "s.t", b"a")
    c = Raw(env)
    try:
        hello3(c)
        assert c.call("CLIENT", "TRACKING", "ON") == b"+OK\r\n"
        seen(env, "in.t1", b"a")
        seen(env, "second:s.t", b"a")
        assert c.call("GET", "in.t1", until=b"a\r\n") == b"$1\r\na\r\n"
        assert c.call("GET", "second:s.t", until=b"a\r\n") == b"$1\r\na\r\n"
        put(url, "main", "in.t1", b"b")
        assert c.read(push("in.t1")) == push("in.t1")
        put(url, "main", "in.t1", b"c")  # not read since: nothing
        assert c.nothing_for(0.5)
        assert c.call("GET", "in.t1", until=b"c\r\n") == b"$1\r\nc\r\n"
        delete(url, "main", "in.t1")
        assert c.read(push("in.t1")) == push("in.t1")
        assert c.call("GET", "in.t1") == b"_\r\n"
        put(url, "main", "in.t1", b"d")
        assert c.read(push("in.t1")) == push("in.t1")
        assert c.call("GET", "in.t1", until=b"d\r\n") == b"$1\r\nd\r\n"
        delete(url, "main", "in.t1", purge=True)
        assert c.read(push("in.t1")) == push("in.t1")
        put(url, "second", "s.t", b"b")
        assert c.read(push("second:s.t")) == push("second:s.t")
    finally:
        c.close()


def test_invalidation_on_per_message_ttl_expiry(env):
    put(env["url"], "ttl", "e1", b"short", ttl="2s")
    c = Raw(env)
    try:
        hello3(c)
        c.call("CLIENT", "TRACKING", "ON")
        seen(env, "ttl:e1", b"short")
        c.call("GET", "ttl:e1", until=b"short\r\n")
        ttl = c.call("PTTL", "ttl:e1")
        assert 0 < int(ttl[1:]) <= 2000
        t0 = time.monotonic()
        assert c.read(push("ttl:e1")) == push("ttl:e1")
        assert time.monotonic() - t0 < 4
        assert c.call("GET", "ttl:e1") == b"_\r\n"
    finally:
        c.close()


def test_invalidation_when_the_buckets_max_age_passes(env):
    put(env["url"], "aged", "m1", b"aging")
    c = Raw(env)
    try:
        hello3(c)
        c.call("CLIENT", "TRACKING", "ON")
        seen(env, "aged:m1", b"aging")
        c.call("GET", "aged:m1", until=b"aging\r\n")
        assert c.read(push("aged:m1")) == push("aged:m1")
        assert c.call("GET", "aged:m1") == b"_\r\n"
    finally:
        c.close()


def test_rueidis_cached_read_pattern(env):
    """rueidis: OPTIN tracking, then CLIENT CACHING YES, MULTI, PTTL, the read, EXEC. The keys
    read inside EXEC are tracked (CACHING YES covers the whole transaction)."""
    url = env["url"]
    put(url, "main", "in.ru", b"r1")
    seen(env, "in.ru", b"r1")
    c = Raw(env)
    try:
        hello3(c)
        assert c.call("CLIENT", "TRACKING", "ON", "OPTIN") == b"+OK\r\n"
        c.send("CLIENT", "CACHING", "YES")
        c.send("MULTI")
        c.send("PTTL", "in.ru")
        c.send("GET", "in.ru")
        c.send("EXEC")
        assert c.read(b"r1\r\n") == (b"+OK\r\n+OK\r\n+QUEUED\r\n+QUEUED\r\n"
                                      b"*2\r\n:-1\r\n$2\r\nr1\r\n")
        put(url, "main", "in.ru", b"r2")
        assert c.read(push("in.ru")) == push("in.ru")
    finally:
        c.close()


def test_exec_reads_at_exec_not_at_queue_time(env):
    """A writer changes the key between MULTI and EXEC: EXEC answers the new value (the
    commands run at EXEC, as in Redis); with WATCH before MULTI, EXEC answers nil."""
    url = env["url"]
    put(url, "main", "in.mx", b"before")
    seen(env, "in.mx", b"before")
    c = Raw(env, tcp=False)
    try:
        assert c.call("MULTI") == b"+OK\r\n"
        assert c.call("GET", "in.mx") == b"+QUEUED\r\n"
        put(url, "main", "in.mx", b"after")
        seen(env, "in.mx", b"after")
        assert c.call("EXEC", until=b"after\r\n") == b"*1\r\n$5\r\nafter\r\n"
        assert c.call("WATCH", "in.mx") == b"+OK\r\n"
        assert c.call("MULTI") == b"+OK\r\n"
        assert c.call("GET", "in.mx") == b"+QUEUED\r\n"
        put(url, "main", "in.mx", b"again")
        seen(env, "in.mx", b"again")
        assert c.call("EXEC") == b"*-1\r\n"
    finally:
        c.close()


def test_remote_keys_are_invalidated_right_after_the_reply(env):
    """`out.*` is not replicated: no feed watches it, so kvcache never lets a client keep it."""
    c = Raw(env)
    try:
        hello3(c)
        c.call("CLIENT", "TRACKING", "ON")
        got = c.call("GET", "out.r1", until=push("out.r1"))
        assert got == b"$7\r\nremote1\r\n" + push("out.r1")
        got = c.call("MGET", "in.k1", "out.r1", until=push("in.k1", "out.r1"))
        assert got == b"*2\r\n$2\r\nv1\r\n$7\r\nremote1\r\n" + push("in.k1", "out.r1")
    finally:
        c.close()


def test_bcast_prefixes(env):
    url = env["url"]
    c = Raw(env)
    try:
        hello3(c)
        assert c.call("CLIENT", "TRACKING", "ON", "BCAST", "PREFIX", "in.b.", "PREFIX", "second:") == b"+OK\r\n"
        put(url, "main", "in.b.x", b"1")       # never read: BCAST needs no read
        got = c.read(b"in.b.x\r\n")
        assert got.endswith(b"$6\r\nin.b.x\r\n") and got.startswith(b">2\r\n$10\r\ninvalidate\r\n")
        put(url, "main", "in.other", b"1")    # not under a prefix
        put(url, "second", "s.z", b"1")
        got = c.read(b"second:s.z\r\n")
        assert b"in.other" not in got
        info = c.call("CLIENT", "TRACKINGINFO", until=b"second:\r\n")
        assert b"~2\r\n$2\r\non\r\n$5\r\nbcast\r\n" in info
    finally:
        c.close()


def test_optin_optout(env):
    url = env["url"]
    c = Raw(env)
    try:
        hello3(c)
        c.call("CLIENT", "TRACKING", "ON", "OPTIN")
        c.call("GET", "in.k3", until=b"v3\r\n")                  # not cached: no CACHING yes
        assert c.call("CLIENT", "CACHING", "YES") == b"+OK\r\n"
        c.call("GET", "in.k4", until=b"v4\r\n")                  # cached
        put(url, "main", "in.k3", b"v3")
        put(url, "main", "in.k4", b"v4")
        assert c.read(push("in.k4")) == push("in.k4")
        assert c.nothing_for(0.3)
        c.call("CLIENT", "TRACKING", "OFF")
        c.call("CLIENT", "TRACKING", "ON", "OPTOUT")
        assert c.call("CLIENT", "CACHING", "NO") == b"+OK\r\n"
        c.call("GET", "in.k5", until=b"v5\r\n")                  # not cached
        c.call("GET", "in.k6", until=b"v6\r\n")                  # cached
        put(url, "main", "in.k5", b"v5")
        put(url, "main", "in.k6", b"v6")
        assert c.read(push("in.k6")) == push("in.k6")
        assert c.nothing_for(0.3)
    finally:
        c.close()


def test_redirect_to_a_resp2_subscriber(env):
    url = env["url"]
    sub = Raw(env)
    c = Raw(env)
    try:
        sub_id = int(sub.call("CLIENT", "ID")[1:])
        assert sub.call("SUBSCRIBE", "__redis__:invalidate", until=b":1\r\n").startswith(b"*3\r\n$9\r\nsubscribe")
        assert c.call("CLIENT", "TRACKING", "ON", "REDIRECT", str(sub_id)) == b"+OK\r\n"
        assert c.call("CLIENT", "GETREDIR") == b":%d\r\n" % sub_id
        c.call("GET", "in.k7", until=b"v7\r\n")
        put(url, "main", "in.k7", b"v7")
        want = b"*3\r\n$7\r\nmessage\r\n$20\r\n__redis__:invalidate\r\n*1\r\n$5\r\nin.k7\r\n"
        assert sub.read(want) == want
        assert c.nothing_for(0.2)
        sub.close()
        # the redirect target is gone: RESP3 clients are told once (Redis's tracking-redir-broken)
        hello3(c)
        c.call("GET", "in.k7", until=b"v7\r\n")
        put(url, "main", "in.k7", b"v7")
        want = b">2\r\n$20\r\ntracking-redir-broken\r\n:%d\r\n" % sub_id
        assert c.read(want) == want
    finally:
        c.close()


TRACKING_SEQUENCE = [
    ["CLIENT", "TRACKING", "ON", "PREFIX", "a"],
    ["CLIENT", "TRACKING", "ON", "BCAST", "OPTIN"],
    ["CLIENT", "TRACKING", "ON", "OPTIN", "OPTOUT"],
    ["CLIENT", "TRACKING", "ON", "REDIRECT", "999999"],
    ["CLIENT", "TRACKING", "ON", "REDIRECT", "x"],
    ["CLIENT", "TRACKING", "ON", "BCAST", "PREFIX", "ab", "PREFIX", "a"],
    ["CLIENT", "TRACKING", "ON", "BCAST", "PREFIX", "b", "PREFIX", "b"],
    ["CLIENT", "TRACKING", "maybe"],
    ["CLIENT", "TRACKING", "ON", "nosuch"],
    ["CLIENT", "CACHING", "YES"],
    ["CLIENT", "TRACKINGINFO"], ["CLIENT", "GETREDIR"],
    ["CLIENT", "TRACKING", "ON", "BCAST", "PREFIX", "ab"],
    ["CLIENT", "TRACKING", "ON"],
    ["CLIENT", "TRACKING", "ON", "BCAST", "PREFIX", "a"],
    ["CLIENT", "TRACKING", "ON", "BCAST", "PREFIX", "c"],
    ["CLIENT", "TRACKINGINFO"], ["CLIENT", "GETREDIR"], ["CLIENT", "CACHING", "NO"],
    ["CLIENT", "TRACKING", "OFF"],
    ["CLIENT", "TRACKING", "ON", "OPTIN"], ["CLIENT", "CACHING", "NO"], ["CLIENT", "CACHING", "YES"],
    ["CLIENT", "TRACKINGINFO"], ["CLIENT", "TRACKING", "ON", "OPTOUT"], ["CLIENT", "CACHING", "maybe"],
    ["CLIENT", "TRACKING", "OFF"], ["CLIENT", "TRACKING", "ON", "BCAST"], ["CLIENT", "TRACKINGINFO"],
    ["CLIENT", "TRACKING", "OFF", "BCAST", "nosuch"], ["CLIENT", "GETREDIR"],
]


@pytest.mark.parametrize("proto", [2, 3])
def test_tracking_commands_answer_as_redis(env, tmp_path, proto):
    """The same CLIENT TRACKING/CACHING/TRACKINGINFO/GETREDIR sequence, errors included, to a
    real redis-server and to kvcache: the same bytes."""
    from support.redis_ref import redis_server

    def run(path: str) -> bytes:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(10)
        s.connect(path)
        try:
            s.sendall(encode(["HELLO", str(proto)]))
            read_until(s, b"modules\r\n*0\r\n")
            s.sendall(b"".join(encode(c) for c in TRACKING_SEQUENCE) + encode(["ECHO", "__end__"]))
            return read_until(s, b"__end__\r\n")
        finally:
            s.close()

    with redis_server(tmp_path) as theirs:
        assert run(env["sock"]) == run(theirs)


def test_tracking_state_is_freed_on_close(env):
    with Client(env["sock"]) as k:
        before = k.info("stats")["stats"]["tracking_total_keys"]
    c = Raw(env)
    hello3(c)
    c.call("CLIENT", "TRACKING", "ON")
    for i in range(50):
        c.call("GET", f"in.free.{i}", until=b"_\r\n")
    with Client(env["sock"]) as k:
        assert k.info("stats")["stats"]["tracking_total_keys"] >= before + 50
    c.close()
    with Client(env["sock"]) as k:
        wait_until(lambda: k.info("stats")["stats"]["tracking_total_keys"] == before, 5,
                   "the closed client's keys to go")
        assert k.info("clients")["clients"]["tracking_clients"] == 0


# --------------------------------------------------------------------------- redis-py's cache


def test_redis_py_client_side_cache(env):
    """redis-py's own cache (CacheConfig) over the TCP listener: hits are served from the
    cache (the sidecar counts no read), a change from NATS is seen on the next read."""
    url = env["url"]
    put(url, "main", "in.c1", b"one")
    seen(env, "in.c1", b"one")
    r = redis.Redis(host=env["host"], port=env["port"], password=PASSWORD, protocol=3,
                    cache_config=CacheConfig())
    try:
        assert r.get_cache() is not None
        wait_until(lambda: r.get("in.c1") == b"one", 5, "the value")
        with Client(env["sock"]) as k:
            before = k.info("stats")["stats"]["gets_local"]
            for _ in range(100):
                assert r.get("in.c1") == b"one"
            assert k.info("stats")["stats"]["gets_local"] - before <= 1  # INFO's own reads aside
        put(url, "main", "in.c1", b"two")
        wait_until(lambda: r.get("in.c1") == b"two", 5, "the cached client to see the change")
        delete(url, "main", "in.c1")
        wait_until(lambda: r.get("in.c1") is None, 5, "the cached client to see the delete")
    finally:
        r.close()
