"""Values up to the 8 MB NATS allows with `max_payload` raised: replicated by the
feed, answered from the replica's map (GET, KV.GET, MGET), read from NATS and kept by the near
cache, and through every client: redis-py, kvcache.Client. A limit kvcache imposes (MGET's
max_reply_bytes) refuses with one line naming it. A real nats-server with `max_payload: 8MB`,
the sidecar as a process."""
from __future__ import annotations

import fcntl
import socket
import struct
import termios
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from support.poll import wait_until
from support.sidecar_proc import SidecarProcess
from support.topology import nats_run

from kvcache.app.client import Client
from kvcache.natsio.nats_server import NatsServer
from kvcache.serve.server_get import SNDBUF_MAX

pytestmark = pytest.mark.servers

MiB = 1 << 20
SIZES = {"v1m": MiB, "v4m": 4 * MiB, "v8m": 8 * MiB - 64}  # the largest KV message max_payload takes


def blob(name: str, n: int) -> bytes:
    """n bytes that say where they are (a shifted or truncated copy cannot pass)."""
    unit = name.encode() + b":0123456789abcdef"
    return (unit * (n // len(unit) + 1))[:n]


VALUES = {k: blob(k, n) for k, n in SIZES.items()}


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Iterator[dict]:
    d = tmp_path_factory.mktemp("large")
    server = NatsServer(d / "nats", extra_conf="max_payload: 8MB").start()

    async def setup(js):
        for bucket in ("blobs", "cblobs"):
            kv = await js.create_key_value(bucket=bucket, direct=True, max_value_size=8 * MiB)
            for k, v in VALUES.items():
                await kv.put(k, v)

    try:
        nats_run(server.url, setup)
        conf = d / "kvcache.toml"
        conf.write_text(f'[nats]\nservers = ["{server.url}"]\n[[bucket]]\nname = "blobs"\n'
                        '[[bucket]]\nname = "cblobs"\nkeys = []\ncache_max_keys = 10\n')
        sc = SidecarProcess(d / "sc", None, extra=["--config", str(conf)])
        with sc:
            sc.start(timeout=120)
            yield {"url": server.url, "sock": sc.socket, "dir": d, "server": server}
            assert sc.stop() == 0
    finally:
        server.stop()


def test_large_values_replicate_and_are_served_from_the_map(env):
    r = redis.Redis(unix_socket_path=env["sock"], socket_timeout=60)
    try:
        for k, v in VALUES.items():
            assert r.get(f"blobs:{k}") == v
            assert r.strlen(f"blobs:{k}") == len(v)
        assert r.mget([f"blobs:{k}" for k in VALUES]) == list(VALUES.values())
        p = r.pipeline(transaction=False)  # pipelined: replies of several MB back to back
        for k in [*VALUES, *VALUES]:
            p.get(f"blobs:{k}")
        assert p.execute() == [*VALUES.values(), *VALUES.values()]
        entry = r.execute_command("KV.GET", "blobs:v8m")
        assert entry[0] == VALUES["v8m"] and entry[4] == b"local"
    finally:
        r.close()
    with Client(env["sock"], timeout=60) as c:
        assert c.get("blobs:v4m") == VALUES["v4m"]
        assert c.mget(["blobs:v1m", "blobs:nope", "blobs:v8m"]) == [VALUES["v1m"], None, VALUES["v8m"]]


def test_a_large_reply_goes_into_the_socket_whole(env):
    """A reply past the socket's default send buffer (about 208 KiB) raises the server's send
    buffer to hold it (up to SNDBUF_MAX, net.core.wmem_max permitting): the whole 1 MiB reply
    is in the client's receive queue before the client reads anything, where before only the
    buffer's worth was, the rest copied and waiting for a writable event (kvcache.serve.server_get)."""
    if (wmem_max := int(Path("/proc/sys/net/core/wmem_max").read_text())) < SNDBUF_MAX:
        pytest.skip(f"net.core.wmem_max is {wmem_max}: the send buffer cannot grow to {SNDBUF_MAX}")
    value = VALUES["v1m"]
    reply = b"$%d\r\n%s\r\n" % (len(value), value)
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(env["sock"])
        s.sendall(b"*2\r\n$3\r\nGET\r\n$9\r\nblobs:v1m\r\n")
        queued = wait_until(lambda: (n := _unread(s)) >= len(reply) and n, 10,
                            "the whole reply in the client's receive queue", detail=lambda: f"{_unread(s)} bytes")
        assert queued == len(reply)
        got = b""
        while len(got) < len(reply):
            got += s.recv(1 << 20)
        assert got == reply


def _unread(s: socket.socket) -> int:
    return struct.unpack("i", fcntl.ioctl(s.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]


def test_large_values_come_from_nats_and_then_from_the_near_cache(env):
    with Client(env["sock"], timeout=60) as c:
        for k, v in VALUES.items():
            assert c.get(f"cblobs:{k}") == v                       # a Direct Get of up to 8 MB
            wait_until(lambda k=k: c.entry(f"cblobs:{k}").source == "cache", 10, f"{k} cached")
            assert c.get(f"cblobs:{k}") == v                       # from the cache's map
        assert c.mget([f"cblobs:{k}" for k in VALUES]) == list(VALUES.values())


def test_a_reply_over_max_reply_bytes_is_refused_naming_the_limit(env):
    sc = SidecarProcess(env["dir"] / "small", env["url"], ["blobs"], extra=["--max-reply-bytes", str(6 * MiB)])
    with sc:
        sc.start(timeout=120)
        r = redis.Redis(unix_socket_path=sc.socket, socket_timeout=60)
        try:
            with pytest.raises(redis.ResponseError, match="max_reply_bytes"):
                r.mget(["blobs:v4m", "blobs:v8m"])
            assert r.mget(["blobs:v1m", "blobs:v4m"]) == [VALUES["v1m"], VALUES["v4m"]]
            assert r.get("blobs:v8m") == VALUES["v8m"]  # one value: no reply budget to pass
        finally:
            r.close()
        assert sc.stop() == 0


def test_many_clients_reading_large_values_at_once(env):
    """GET-only reads of several clients in one event-loop turn are answered together (the
    deferred reads): each connection's large value goes from the map to its socket, or is
    copied once when its socket is full. Every client gets exactly its value."""
    import socket

    from kvcache.app.client import encode_command
    keys = [k for k in VALUES for _ in range(4)]
    conns = []
    try:
        for _ in keys:
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(60)
            s.connect(env["sock"])
            conns.append(s)
        for s, k in zip(conns, keys, strict=True):
            s.sendall(encode_command(["GET", f"blobs:{k}"]))
        for s, k in zip(conns, keys, strict=True):
            want = b"$%d\r\n%s\r\n" % (len(VALUES[k]), VALUES[k])
            got = b""
            while len(got) < len(want):
                chunk = s.recv(1 << 20)
                assert chunk, "connection closed"
                got += chunk
            assert got == want
    finally:
        for s in conns:
            s.close()
