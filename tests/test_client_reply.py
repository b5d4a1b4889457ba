"""CLIENT REPLY ON|OFF|SKIP, byte for byte as redis-server does it.

The same raw pipelines go to a real redis-server (Unix socket only, no TCP) and to real
sidecars holding the same keys, and the bytes that come back must be identical. One sidecar
runs the native extensions, one the pure-Python twins (KVCACHE_NO_EXTENSIONS=1), so both the
C GET path (GetConnection.data_received answering GET runs itself) and its twin are covered,
as are the generic loop, remote reads answered later from NATS (`out.*` is not replicated),
errors, protocol errors and QUIT.
"""
from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
import redis
from support.redis_ref import END, END_REPLY, bucket_holding, redis_server, twin_sidecar

from kvcache.app.client import encode_command as encode

VALUES = {f"in.k{i}": b"v%d" % i for i in range(10)}
VALUES |= {"in.big": b"B" * (300 * 1024), "out.r1": b"remote1", "out.r2": b"remote2"}


@pytest.fixture(scope="module")
def redis_sock(tmp_path_factory) -> Iterator[str]:
    """A real redis-server holding VALUES."""
    with redis_server(tmp_path_factory.mktemp("redis"), VALUES) as path:
        yield path


@pytest.fixture(scope="module")
def bucket_url(nats_server_module) -> str:
    return bucket_holding(nats_server_module.url, "rm", VALUES)


@pytest.fixture(scope="module", params=["native", "twins"])
def sidecar_sock(request, bucket_url, tmp_path_factory) -> Iterator[str]:
    """A sidecar replicating `in.>` of bucket rm (its default bucket): `out.*` are remote."""
    with twin_sidecar(request.param, tmp_path_factory.mktemp(request.param), bucket_url, "rm:in.>") as path:
        yield path


def exchange(path: str, parts: list[bytes], until_eof: bool = False, pause: float = 0.0,
             quiet: float | None = None) -> bytes:
    """Send `parts` one write each (`pause` between them, so the server reads them apart),
    then read until END_REPLY ends what came back, or until EOF; with `quiet`, also until
    nothing came for that long."""
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(quiet or 10)
    s.connect(path)
    try:
        for i, part in enumerate(parts):
            if i and pause:
                time.sleep(pause)
            s.sendall(part)
        got = b""
        while until_eof or not got.endswith(END_REPLY):
            try:
                chunk = s.recv(1 << 20)
            except TimeoutError:
                if quiet is None:
                    raise
                break
            if not chunk:
                break
            got += chunk
        return got
    finally:
        s.close()


def cmds(*commands: list[str] | bytes) -> bytes:
    return b"".join(c if isinstance(c, bytes) else encode(c) for c in commands)


def gets(*keys: str) -> bytes:
    return b"".join(encode(["GET", k]) for k in keys)


ON, OFF, SKIP = (["CLIENT", "REPLY", m] for m in ("ON", "OFF", "SKIP"))
KEYS = [f"in.k{i}" for i in range(10)]

PIPELINES = {
    "skip-then-get-run": cmds(SKIP, gets(*KEYS)),
    "off-gets-mget-ping-errors-on": cmds(OFF, gets(*KEYS), ["MGET", "in.k1", "in.nosuch"], ["PING"],
                                         ["NOSUCH"], ["GET"], ["ECHO", "x"], ON, gets("in.k4")),
    "skip-skip": cmds(SKIP, SKIP, ["PING"], ["PING", "a"]),
    "skip-then-on": cmds(SKIP, ON, ["PING"]),
    "off-skip-on": cmds(OFF, SKIP, ["PING"], ON, ["PING", "b"]),
    "skip-off-on": cmds(SKIP, OFF, ["PING"], ON, ["PING", "c"]),
    "on-while-on": cmds(ON, gets("in.k1")),
    "mixed": cmds(gets("in.k1", "in.k2"), SKIP, gets("in.k3", "in.k4", "in.k5"),
                  ["MGET", "in.k1", "in.k2"], SKIP, ["MGET", "in.k3", "out.r1"], ["PING"], SKIP,
                  ["NOSUCH"], gets("in.k6"), OFF, gets("in.k7", "out.r1"), ["get", "in.k8"],
                  b"GET in.k9\r\n", ON, gets("out.r1", "in.k9"), SKIP, ["get", "in.k1"],
                  b"GET in.k2\r\n", ["EXISTS", "in.k1", "in.nosuch"]),
    "skip-remote": cmds(SKIP, gets("out.r1", "out.r2", "in.k1")),
    "off-remote-on": cmds(OFF, gets("out.r1", "in.k1", "out.r2"), ON, gets("out.r2")),
    "remote-skip-remote": cmds(gets("out.r1"), SKIP, gets("out.r2"), gets("out.r1", "in.k0")),
    "off-bad-client-reply": cmds(OFF, ["CLIENT", "REPLY", "maybe"], ["CLIENT", "REPLY"],
                                 ["CLIENT", "REPLY", "on", "x"], ["PING"]),
    "bad-client-reply": cmds(["CLIENT", "REPLY", "maybe"], ["CLIENT", "REPLY"], SKIP,
                             ["CLIENT", "REPLY", "maybe"], ["PING"]),
    "big-values": cmds(OFF, gets("in.big", "in.big", "in.big"), ON, SKIP, gets("in.big", "in.big"),
                       gets("in.k1")),
    "long-get-runs": cmds(gets(*KEYS * 50), SKIP, gets(*KEYS * 50), OFF, gets(*KEYS * 50), ON,
                          gets(*KEYS * 10), SKIP, gets(*KEYS * 50)),
}


@pytest.mark.parametrize("name", list(PIPELINES))
def test_client_reply_byte_for_byte(redis_sock, sidecar_sock, name):
    data = PIPELINES[name] + END
    want = exchange(redis_sock, [data])
    assert want.endswith(END_REPLY)
    assert exchange(sidecar_sock, [data]) == want
    # the same bytes one command per write: every command arrives in a read of its own
    units = split_commands(data)
    assert exchange(sidecar_sock, units, pause=0.001) == want


def split_commands(data: bytes) -> list[bytes]:
    """`data` cut into its commands (multibulk or inline), as the server parses them."""
    from kvcache.resp import RequestReader
    reader = RequestReader()
    reader.feed(data)
    out, pos = [], 0
    while True:
        args = reader.next_command()
        if args is None:
            break
        n = len(data) - reader.buffered - pos
        out.append(data[pos:pos + n])
        pos += n
    assert pos == len(data)
    return out


SHORT = cmds(gets("in.k1"), SKIP, gets("in.k2", "in.k3"), OFF, gets("in.k4"), ["PING"], ON,
             gets("in.k5"), SKIP, ["MGET", "in.k6"], gets("in.k7")) + END


def test_client_reply_split_at_every_byte(redis_sock, sidecar_sock):
    """A short pipeline cut in two at every byte boundary: the reads the server sees start
    and end anywhere, inside a GET run, a CLIENT REPLY or a bulk header."""
    want = exchange(redis_sock, [SHORT])
    assert want == b"$2\r\nv1\r\n$2\r\nv3\r\n+OK\r\n$2\r\nv5\r\n$2\r\nv7\r\n" + END_REPLY
    for i in range(1, len(SHORT)):
        assert exchange(sidecar_sock, [SHORT[:i], SHORT[i:]], pause=0.002) == want, i


@pytest.mark.parametrize("data", [
    cmds(OFF, gets("in.k1")) + b"*1\r\n$x\r\n",
    cmds(SKIP) + b"*1\r\n$x\r\n",
    cmds(OFF, ["QUIT"]),
    cmds(SKIP, ["QUIT"]),
    cmds(OFF, gets("out.r1"), ["QUIT"]),
], ids=["off-protocol-error", "skip-protocol-error", "off-quit", "skip-quit", "off-remote-quit"])
def test_client_reply_until_close(redis_sock, sidecar_sock, data):
    """Protocol errors and QUIT's +OK are dropped too. The sidecar then closes the
    connection (it must answer EOF here, not time out); redis-server 7.0 reads nothing more
    but leaves it open, since it closes only after writing a reply."""
    want = exchange(redis_sock, [data], until_eof=True, quiet=0.5)
    assert want == b""
    assert exchange(sidecar_sock, [data], until_eof=True) == want


def test_client_reply_stats_still_count(sidecar_sock):
    """Dropped replies are of commands that ran: the GETs are counted (INFO stats)."""
    def local_gets() -> int:
        info = redis.Redis(unix_socket_path=sidecar_sock).info("stats")
        return int(info["gets_local"])
    before = local_gets()
    assert exchange(sidecar_sock, [cmds(OFF, gets(*KEYS)) + END]) == END_REPLY
    assert local_gets() - before == len(KEYS)


def test_client_reply_redis_py(sidecar_sock):
    """redis-py's pipeline around CLIENT REPLY OFF ... ON: only ON's reply comes back."""
    c = redis.Redis(unix_socket_path=sidecar_sock)
    try:
        conn = c.connection_pool.get_connection()
        try:
            conn.send_packed_command([cmds(OFF, gets("in.k1", "out.r1"), ["PING"], ON, gets("in.k2"))])
            assert conn.read_response() == b"OK"
            assert conn.read_response() == b"v2"
            assert not conn.can_read(timeout=0.2)
        finally:
            c.connection_pool.release(conn)
    finally:
        c.close()
