"""kvcache.Client / AsyncClient against a real redis-server on a Unix socket.

Redis speaks the same protocol as the sidecar for GET/MGET/SCAN/INFO, so it checks the
clients' I/O and decoding without depending on the sidecar; KV.GET decoding, which Redis has
no command for, is checked on the shared operation with canned replies.
"""
from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from kvcache.app.client import (
    AsyncClient,
    Client,
    ConnectionFailed,
    ResponseError,
    _entry,
    _keys,
    _step,
    encode_command,
    parse_info,
)
from kvcache.entry import Entry, Operation


def _start_redis(directory: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    path = str(directory / "redis.sock")
    proc = subprocess.Popen(
        ["/usr/bin/redis-server", "--port", "0", "--unixsocket", path, "--save", "",
         "--appendonly", "no", "--dir", str(directory), *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            if redis.Redis(unix_socket_path=path).ping():
                return proc, path
        except redis.ConnectionError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError("redis-server did not start")
        time.sleep(0.02)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def redis_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc, path = _start_redis(tmp_path_factory.mktemp("redis"))
    try:
        yield path
    finally:
        _stop(proc)


@pytest.fixture
def r(redis_path: str) -> Iterator[redis.Redis]:
    conn = redis.Redis(unix_socket_path=redis_path)
    conn.flushall()
    yield conn
    conn.close()


@pytest.fixture
def client(redis_path: str, r: redis.Redis) -> Iterator[Client]:
    with Client(redis_path) as c:
        yield c


# --------------------------------------------------------------------------- blocking


def test_get_and_mget(client: Client, r: redis.Redis) -> None:
    r.set("a", b"1")
    r.set("bin", b"\x00\r\n\xff" * 1000)
    assert client.ping() is True
    assert client.get("a") == b"1"
    assert client.get("missing") is None
    assert client.get("bin") == b"\x00\r\n\xff" * 1000
    assert client.mget(["a", "missing", "bin"]) == [b"1", None, b"\x00\r\n\xff" * 1000]
    assert client.mget([]) == []


def test_large_value(client: Client, r: redis.Redis) -> None:
    value = os.urandom(3 * 1024 * 1024)
    r.set("big", value)
    assert client.get("big") == value


def test_execute(client: Client, r: redis.Redis) -> None:
    assert client.execute("SET", "k", b"v\r\n") == b"OK"
    assert client.execute("INCRBY", "n", 5) == 5
    assert client.execute("GET", "k") == b"v\r\n"
    assert client.execute("LRANGE", "nolist", 0, -1) == []
    with pytest.raises(ResponseError, match="unknown command"):
        client.execute("NOSUCHCOMMAND")
    assert client.execute("GET", "k") == b"v\r\n"  # the connection survives an error reply
    with pytest.raises(TypeError):
        client.execute("GET", None)  # type: ignore[arg-type]


def test_resp3_connection(client: Client, r: redis.Redis) -> None:
    r.set("a", "1")
    hello = client.execute("HELLO", 3)
    assert hello[b"proto"] == 3
    assert client.get("a") == b"1"
    assert client.get("missing") is None
    assert client.execute("CONFIG", "GET", "maxmemory") == {b"maxmemory": b"0"}
    assert client.info("server")["server"]["redis_mode"] == "standalone"  # a verbatim reply


def test_info(client: Client, r: redis.Redis) -> None:
    r.mset({"x": 1, "y": 2})
    info = client.info()
    assert {"server", "clients", "stats", "keyspace"} <= set(info)
    assert isinstance(info["server"]["process_id"], int)
    assert info["server"]["redis_version"].startswith("7.")
    assert info["keyspace"]["db0"]["keys"] == 2
    assert set(client.info("stats")) == {"stats"}


def test_parse_info() -> None:
    text = ("# Stats\r\ngets_local:10\r\nratio:0.5\r\nname:x\r\n\r\n# Buckets\r\n"
            "config:synced=1,keys=10,applied_seq=12,lag_ms=0.5,flag\r\n"
            "# Peers\r\nwest:stream=KV_config_west,state=up,ewma_us=120\r\nlist:a,b,3\r\n")
    assert parse_info(text) == {
        "stats": {"gets_local": 10, "ratio": 0.5, "name": "x"},
        "buckets": {"config": {"synced": 1, "keys": 10, "applied_seq": 12, "lag_ms": 0.5, "flag": True}},
        "peers": {"west": {"stream": "KV_config_west", "state": "up", "ewma_us": 120},
                  "list": ["a", "b", 3]},
    }


def test_keys_pages_through_scan(client: Client, r: redis.Redis) -> None:
    r.mset({f"k{i}": i for i in range(2500)})
    r.set("other", 1)
    keys = client.keys()
    assert sorted(keys) == sorted([f"k{i}" for i in range(2500)] + ["other"])
    assert len(keys) == len(set(keys))
    assert sorted(client.keys("k1?")) == [f"k{i}" for i in range(10, 20)]
    assert client.keys("none*") == []


@pytest.mark.servers  # starts a process
def test_keys_falls_back_to_keys_command(tmp_path_factory: pytest.TempPathFactory) -> None:
    proc, path = _start_redis(tmp_path_factory.mktemp("noscan"), "--rename-command", "SCAN", "")
    try:
        redis.Redis(unix_socket_path=path).mset({"a1": 1, "a2": 2, "b": 3})
        with Client(path) as c:
            with pytest.raises(ResponseError):
                c.execute("SCAN", 0)
            assert sorted(c.keys("a*")) == ["a1", "a2"]
    finally:
        _stop(proc)


def test_reconnects_after_broken_connection(client: Client, r: redis.Redis) -> None:
    r.set("a", "1")
    assert client.get("a") == b"1"
    assert r.client_kill_filter(_type="normal", skipme=True) == 1
    with pytest.raises(ConnectionFailed):
        client.get("a")
    assert client.get("a") == b"1"  # a new connection
    client.close()
    assert client.get("a") == b"1"  # and again after close()


def test_unreachable_socket(tmp_path: Path) -> None:
    with pytest.raises(ConnectionFailed, match=r"missing.sock"):
        Client(str(tmp_path / "missing.sock")).get("a")


@pytest.fixture
def silent_server(tmp_path: Path) -> Iterator[str]:
    """Accepts connections and never answers."""
    path = str(tmp_path / "silent.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    accepted: list[socket.socket] = []
    thread = threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True)
    thread.start()
    yield path
    listener.close()
    for conn in accepted:
        conn.close()


def test_timeout(silent_server: str) -> None:
    c = Client(silent_server, timeout=0.2)
    with pytest.raises(ConnectionFailed) as info:
        c.get("a")
    assert isinstance(info.value.__cause__, TimeoutError)
    assert c._sock is None  # dropped: a late reply must not answer the next request


# --------------------------------------------------------------------------- asyncio


async def test_async_reads(redis_path: str, r: redis.Redis) -> None:
    r.mset({"a": "1", "b": "2"})
    async with AsyncClient(redis_path) as c:
        assert await c.ping() is True
        assert await c.get("a") == b"1"
        assert await c.get("missing") is None
        assert await c.mget(["a", "x", "b"]) == [b"1", None, b"2"]
        assert sorted(await c.keys()) == ["a", "b"]
        assert (await c.info("keyspace"))["keyspace"]["db0"]["keys"] == 2
        assert await c.execute("ECHO", b"\r\n") == b"\r\n"
        with pytest.raises(ResponseError):
            await c.execute("NOSUCHCOMMAND")
        assert await c.get("b") == b"2"


async def test_async_concurrent_calls_are_serialized(redis_path: str, r: redis.Redis) -> None:
    r.mset({f"k{i}": str(i) for i in range(200)})
    async with AsyncClient(redis_path) as c:
        results = await asyncio.gather(*(c.get(f"k{i}") for i in range(200)))
        assert results == [str(i).encode() for i in range(200)]


async def test_async_reconnects(redis_path: str, r: redis.Redis) -> None:
    r.set("a", "1")
    async with AsyncClient(redis_path) as c:
        assert await c.get("a") == b"1"
        r.client_kill_filter(_type="normal", skipme=True)
        with pytest.raises(ConnectionFailed):
            await c.get("a")
        assert await c.get("a") == b"1"


async def test_async_cancel_and_timeout_drop_connection(silent_server: str) -> None:
    c = AsyncClient(silent_server, timeout=0.2)
    with pytest.raises(ConnectionFailed):
        await c.get("a")
    assert c._streams is None
    c.timeout = None
    task = asyncio.create_task(c.get("a"))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert c._streams is None
    await c.aclose()


# --------------------------------------------------------------------------- shared operations


def _drive(op, replies):
    """Runs an operation on canned replies; returns (commands sent, result)."""
    sent = [next(op)]
    try:
        for reply in replies:
            sent.append(_step(op, reply))
    except StopIteration as stop:
        return sent, stop.value
    raise AssertionError("operation wants more replies")


def test_entry_request_and_decoding() -> None:
    sent, e = _drive(_entry("cfg:a.b", "strong", 250, 7),
                     [[b"v", 12, 1_700_000_000_000_000_000, b"PUT", b"leader"]])
    assert encode_command(sent[0]) == encode_command(
        ["KV.GET", "cfg:a.b", "CONSISTENCY", "strong", "MAXSTALE", "250", "MINREV", "7"])
    assert e == Entry(bucket="cfg", key="a.b", value=b"v", revision=12,
                      created=1_700_000_000_000_000_000, operation=Operation.PUT, source="leader")

    # a bare key: the default bucket's name comes from INFO, which only the server knows
    sent, e = _drive(_entry("a.b", None, None, None),
                     [[b"v", b"3", b"5", b"PUT", b"local"], b"# Server\r\ndefault_bucket:main\r\n"])
    assert sent == [["KV.GET", "a.b"], ("INFO", "server")]
    assert (e.bucket, e.key, e.revision, e.created, e.source) == ("main", "a.b", 3, 5, "local")

    _, e = _drive(_entry("cfg:k", None, None, None), [[None, 4, 5, b"DEL", b"west"]])  # 5 elements
    assert (e.bucket, e.key, e.value, e.operation, e.source) == ("cfg", "k", None, Operation.DEL, "west")

    assert _drive(_entry("k", None, None, None), [None])[1] is None


def test_entry_error_reply_raises() -> None:
    from kvcache.resp import ReplyError
    with pytest.raises(ResponseError, match="ERR no such bucket"):
        _drive(_entry("x:k", None, None, None), [ReplyError("ERR no such bucket")])


def test_keys_operation_dedupes_and_falls_back() -> None:
    from kvcache.resp import ReplyError
    sent, keys = _drive(_keys("*"), [[b"17", [b"a", b"b"]], [b"0", [b"b", b"c"]]])
    assert keys == ["a", "b", "c"]
    assert sent[1][:2] == ("SCAN", b"17")
    sent, keys = _drive(_keys("a*"), [ReplyError("ERR unknown command 'SCAN'"), [b"a1"]])
    assert sent[-1] == ("KEYS", "a*") and keys == ["a1"]
