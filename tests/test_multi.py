"""MULTI/EXEC/DISCARD/WATCH and the one-key read commands (TTL, PTTL, EXPIRETIME,
PEXPIRETIME, TYPE, STRLEN, GETRANGE) against a real sidecar fed by a real nats-server, with
the exact replies compared to a real redis-server holding the same values where Redis's
answer does not depend on the clock.

Writers (nats-py) change keys between MULTI and EXEC; clients are redis-py (`pipeline()`,
transactional by default) and raw sockets. node-redis and ioredis `multi()` are in
tests/test_node_clients.py.
"""
from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
import redis
from support.kvdata import kv_put, read_until
from support.poll import wait_until
from support.redis_ref import redis_server
from support.sidecar_proc import SidecarProcess
from support.topology import nats_run

from kvcache.app.client import Client
from kvcache.app.client import encode_command as encode

VALUES = {"in.a": b"alpha", "in.b": b"Hello, World", "in.e": b""}


def put(url: str, key: str, value: bytes, ttl: str | None = None) -> None:
    kv_put(url, "tx", key, value, ttl)


@pytest.fixture(scope="module")
def env(nats_server_module, tmp_path_factory) -> Iterator[dict]:
    url = nats_server_module.url

    async def setup(js):
        kv = await js.create_key_value(bucket="tx", direct=True)
        for k, v in VALUES.items():
            await kv.put(k, v)
        await kv.put("out.r", b"remote")
        cfg = (await js.stream_info("KV_tx")).config
        cfg.allow_msg_ttl = True
        await js.update_stream(cfg)
        aged = await js.create_key_value(bucket="aged", direct=True, ttl=3600)
        await aged.put("k", b"v")

    nats_run(url, setup)
    sc = SidecarProcess(tmp_path_factory.mktemp("tx") / "sc", url, ["tx:in.>", "aged"])
    with sc:
        sc.start()
        yield {"url": url, "sc": sc, "sock": sc.socket}
        assert sc.stop() == 0


@pytest.fixture(scope="module")
def redis_sock(tmp_path_factory) -> Iterator[str]:
    with redis_server(tmp_path_factory.mktemp("redis"), VALUES) as path:
        yield path


def exchange(path: str, cmds: list[list[str]], until: bytes) -> bytes:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(path)
    try:
        s.sendall(b"".join(encode(c) for c in cmds) + encode(["ECHO", "__end__"]))
        return read_until(s, until)
    finally:
        s.close()


END = b"$7\r\n__end__\r\n"


@pytest.mark.parametrize("cmds", [
    [["MULTI"], ["GET", "in.a"], ["STRLEN", "in.b"], ["TYPE", "in.a"], ["TYPE", "in.none"], ["EXEC"]],
    [["MULTI"], ["GET", "in.a"], ["SET", "in.a", "x"], ["GET", "in.b"], ["EXEC"]],
    [["MULTI"], ["GET"], ["EXEC"]],
    [["MULTI"], ["NOSUCH", "x"], ["EXEC"]],
    [["MULTI"], ["MULTI"], ["GET", "in.a"], ["EXEC"]],
    [["MULTI"], ["WATCH", "in.a"], ["GET", "in.a"], ["EXEC"]],
    [["EXEC"], ["DISCARD"], ["MULTI"], ["GET", "in.a"], ["DISCARD"], ["GET", "in.a"]],
    [["HELLO", "3"], ["MULTI"], ["GET", "in.none"], ["TTL", "in.a"], ["EXEC"]],
    [["MULTI"], ["EXEC"], ["WATCH", "in.a"], ["UNWATCH"], ["MULTI"], ["EXEC"]],
    [["MULTI"], ["PING"], ["ECHO", "x"], ["EXISTS", "in.a", "in.none"], ["MGET", "in.a", "in.e"], ["EXEC"]],
], ids=lambda c: " ".join(x[0] for x in c))
def test_transactions_answer_as_redis(env, redis_sock, cmds):
    """The same pipeline to redis-server (holding the same values) and to kvcache: the same
    bytes, errors and EXECABORT included. (Redis's own MULTI of a write is queued and
    succeeds; kvcache refuses a write when queued, and that is its one difference here.)"""
    ours = exchange(env["sock"], cmds, END)
    if any(c[0] == "SET" for c in cmds):  # Redis would perform it: not sent there
        assert ours == (b"+OK\r\n+QUEUED\r\n-READONLY kvcache is a read replica\r\n+QUEUED\r\n"
                        b"-EXECABORT Transaction discarded because of previous errors.\r\n" + END)
        return
    theirs = exchange(redis_sock, cmds, END)
    if cmds[0] == ["HELLO", "3"]:  # HELLO's map names the server: compare what follows it
        theirs, ours = theirs[theirs.index(b"modules"):], ours[ours.index(b"modules"):]
    assert ours == theirs


def test_redis_py_transactional_pipeline(env):
    r = redis.Redis(unix_socket_path=env["sock"])
    try:
        with r.pipeline() as pipe:  # transaction=True: MULTI ... EXEC
            pipe.get("in.a").strlen("in.b").getrange("in.b", 0, 4).ttl("in.a").type("in.a")
            assert pipe.execute() == [b"alpha", 12, b"Hello", -1, b"string"]
        with r.pipeline() as pipe:  # the write is refused when queued; EXEC then aborts
            pipe.get("in.a").set("in.a", "x")
            with pytest.raises(redis.exceptions.ReadOnlyError, match="kvcache is a read replica"):
                pipe.execute()
    finally:
        r.close()


def test_watch_sees_a_writer_between_watch_and_exec(env):
    """redis-py's optimistic-locking idiom: WATCH, read, MULTI, EXEC. A write from NATS in
    between makes EXEC answer nil (WatchError); a write to another key does not."""
    url = env["url"]
    put(url, "in.w", b"1")
    r = redis.Redis(unix_socket_path=env["sock"])
    try:
        wait_until(lambda: r.get("in.w") == b"1", 10, "the key")
        with r.pipeline() as pipe:
            pipe.watch("in.w")
            assert pipe.get("in.w") == b"1"
            put(url, "in.other", b"x")
            wait_until(lambda: r.get("in.other") == b"x", 10, "the other key")
            pipe.multi()
            pipe.get("in.w")
            assert pipe.execute() == [b"1"]
        with r.pipeline() as pipe:
            pipe.watch("in.w")
            put(url, "in.w", b"2")
            wait_until(lambda: r.get("in.w") == b"2", 10, "the change")
            pipe.multi()
            pipe.get("in.w")
            with pytest.raises(redis.WatchError):
                pipe.execute()
        with pytest.raises(redis.ResponseError, match="kvcache can WATCH only keys it replicates"):
            r.execute_command("WATCH", "out.r")
    finally:
        r.close()


def test_exec_reads_one_replica_state_while_a_writer_runs(env):
    """A writer keeps two keys equal (it writes a then b, the same counter); every EXEC that
    reads b then a sees b <= a and never a pair torn by more than the writer's one step."""
    url = env["url"]
    import asyncio
    import threading

    stop = threading.Event()

    def writer() -> None:
        async def go():
            import nats
            nc = await nats.connect(url)
            kv = await nc.jetstream().key_value("tx")
            i = 0
            while not stop.is_set() and i < 2000:
                i += 1
                await kv.put("in.pa", b"%d" % i)
                await kv.put("in.pb", b"%d" % i)
            await nc.close()
        asyncio.run(go())

    put(url, "in.pa", b"0")
    put(url, "in.pb", b"0")
    t = threading.Thread(target=writer)
    t.start()
    r = redis.Redis(unix_socket_path=env["sock"])
    try:
        seen = 0
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with r.pipeline() as pipe:
                b, a = pipe.get("in.pb").get("in.pa").execute()
            if a is None or b is None:
                continue
            assert int(b) <= int(a) <= int(b) + 1, (a, b)
            seen += 1
        assert seen > 50
    finally:
        stop.set()
        t.join()
        r.close()


def test_ttl_family(env):
    url = env["url"]
    put(url, "in.t", b"ttl", ttl="100s")
    put(url, "in.never", b"n", ttl="never")
    r = redis.Redis(unix_socket_path=env["sock"])
    try:
        wait_until(lambda: r.get("in.t") == b"ttl" and r.get("in.never") == b"n", 10, "the keys")
        now_ms = time.time() * 1000
        assert 98 <= r.ttl("in.t") <= 100
        assert 98_000 <= r.pttl("in.t") <= 100_000
        assert abs(r.pexpiretime("in.t") - (now_ms + 100_000)) < 3000
        assert abs(r.expiretime("in.t") - (now_ms / 1000 + 100)) < 3
        assert r.ttl("in.never") == -1 and r.pttl("in.a") == -1
        assert r.ttl("in.none") == -2 and r.expiretime("in.none") == -2
        # the bucket's max_age (1 h) counts from each key's creation
        assert 3590 <= r.ttl("aged:k") <= 3600
        # a remote key: from the entry NATS returned
        assert r.ttl("out.r") == -1 and r.type("out.r") == b"string" and r.strlen("out.r") == 6
        with pytest.raises(redis.ResponseError, match="wrong number of arguments for 'ttl'"):
            r.execute_command("TTL")
    finally:
        r.close()


@pytest.mark.parametrize("start,end", [(0, 4), (-5, -1), (-100, 100), (5, 2), (-1, -5), (0, -1),
                                       (3, 3), (12, 20), (-3, 1), (0, 0)])
def test_getrange_as_redis(env, redis_sock, start, end):
    for key in ("in.b", "in.e", "in.none"):
        cmd = [["GETRANGE", key, str(start), str(end)], ["STRLEN", key], ["TYPE", key]]
        assert exchange(env["sock"], cmd, END) == exchange(redis_sock, cmd, END), (key, start, end)


def test_getrange_bad_offsets_as_redis(env, redis_sock):
    cmd = [["GETRANGE", "in.b", "x", "1"], ["GETRANGE", "in.b", "01", "2"], ["GETRANGE", "in.b", "1"]]
    assert exchange(env["sock"], cmd, END) == exchange(redis_sock, cmd, END)


def test_command_lists_the_new_commands(env):
    with Client(env["sock"]) as c:
        listed = {n.decode() for n in c.execute("COMMAND", "LIST")}
    assert {"multi", "exec", "discard", "watch", "unwatch", "ttl", "pttl", "expiretime",
            "pexpiretime", "type", "strlen", "getrange", "subscribe", "psubscribe", "unsubscribe",
            "punsubscribe", "pubsub", "reset"} <= listed
