"""Keys starting with `_kv` (ADR-8: NATS's own) read as an error from every read command, on
the GET fast path (C and its twin) as on the generic path, and KEYS/SCAN list none, though
the bucket holds such keys (a NATS client may put them) and the feed replicates them."""
from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import redis
from support.kvdata import _put_all, read_until
from support.sidecar_proc import SidecarProcess
from support.topology import nats_run

from kvcache.app.client import encode_command as encode

VALUES = {"_kv.x": b"hidden", "_kvx": b"hidden too", "ok.k": b"v", "a._kv": b"not reserved"}
RESERVED = ["_kv.x", "_kvx", "rk:_kv.x", "_kv.nosuch"]
ERROR = "invalid key '{key}': keys starting with _kv are reserved for NATS's own use (ADR-8)"


@pytest.fixture(scope="module")
def url(nats_server_module) -> str:
    async def setup(js):
        for bucket in ("rk", "rf"):
            kv = await js.create_key_value(bucket=bucket, direct=True)
            await _put_all(kv, VALUES)  # nats-py puts `_kv` keys: it checks only the characters
    nats_run(nats_server_module.url, setup)
    return nats_server_module.url


@pytest.fixture(scope="module", params=["native", "twins"])
def sock(request, url, tmp_path_factory) -> Iterator[str]:
    """`rk` replicates every key (the fast path reads its keys without the planner), `rf`
    only `ok.>` (the rest would be read from NATS)."""
    env = {"KVCACHE_NO_EXTENSIONS": "1" if request.param == "twins" else "0"}
    sc = SidecarProcess(tmp_path_factory.mktemp(request.param) / "sc", url, ["rk", "rf:ok.>"], env=env)
    with sc:
        sc.start()
        assert sc.buckets()["rk"]["keys"] == len(VALUES)  # replicated, `_kv` keys included
        yield sc.socket
        assert sc.stop() == 0


@pytest.fixture
def r(sock) -> Iterator[redis.Redis]:
    c = redis.Redis(unix_socket_path=sock)
    try:
        yield c
    finally:
        c.close()


def _error(key: str) -> str:
    return ERROR.format(key=key.split(":", 1)[-1])


@pytest.mark.parametrize("key", [*RESERVED, "rf:_kv.x"])
@pytest.mark.parametrize("command", [
    ["GET"], ["EXISTS"], ["MGET"], ["KV.GET"], ["KV.GET", "@", "CONSISTENCY", "strong"], ["TTL"], ["PTTL"],
    ["EXPIRETIME"], ["PEXPIRETIME"], ["TYPE"], ["STRLEN"], ["GETRANGE", "@", "0", "-1"], ["WATCH"],
], ids=lambda c: " ".join(c))
def test_every_read_answers_the_same_error(r, command, key):
    args = [key if a == "@" else a for a in command] if "@" in command else [*command, key]
    with pytest.raises(redis.ResponseError) as e:
        r.execute_command(*args)
    assert str(e.value) == _error(key)


def test_mget_with_one_reserved_key_fails_whole(r):
    with pytest.raises(redis.ResponseError, match="reserved for NATS's own use"):
        r.mget("ok.k", "_kv.x")
    assert r.mget("ok.k", "a._kv") == [b"v", b"not reserved"]


def test_pipelined_gets_on_the_fast_path(sock):
    """A run of GETs the fast path answers, with reserved keys among them: each reserved key
    is the error, the others their values, in order."""
    keys = ["ok.k", "_kv.x", "ok.k", "_kvx", "a._kv", "rk:_kv.x", "rk:ok.k"]
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(sock)
    try:
        s.sendall(b"".join(encode(["GET", k]) for k in keys) + encode(["ECHO", "end"]))
        got = read_until(s, b"$3\r\nend\r\n")
    finally:
        s.close()
    want = b"".join(b"-ERR " + _error(k).encode() + b"\r\n" if k.split(":")[-1].startswith("_kv")
                    else b"$%d\r\n%b\r\n" % (len(VALUES[k.split(':')[-1]]), VALUES[k.split(':')[-1]])
                    for k in keys) + b"$3\r\nend\r\n"
    assert got == want


def test_keys_and_scan_list_no_reserved_key(r):
    assert sorted(r.keys("*")) == [b"a._kv", b"ok.k"]
    assert sorted(r.keys("rk:*")) == [b"rk:a._kv", b"rk:ok.k"]
    assert sorted(r.scan_iter(count=1)) == [b"a._kv", b"ok.k"]
    assert r.keys("_kv*") == []
