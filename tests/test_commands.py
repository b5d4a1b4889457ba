"""Every command of docs/commands.md against a real sidecar process fed by a real nats-server.

Clients: redis-py (RESP2 and RESP3, with hiredis) as the third-party client, kvcache.Client as
ours, and a raw socket where the wire bytes matter. Data is written with nats-py.

Layout (one nats-server and one sidecar for the module):
- `main` (the default bucket, Direct Get on): replicated filter `in.>`; `out.*` keys are remote.
- `second` (Direct Get on): everything replicated.
- `nodirect`: created with nats-py's defaults (no allow_direct); `in.>` replicated, the rest
  read through the leader API.
- `many`: 1500 keys `r.NNNN`, none replicated (`in.>` matches none of them): MGET of all of
  them needs two multi_last requests.
"""
from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator

import pytest
import redis
from support.kvdata import _put_all, read_until
from support.sidecar_proc import SidecarProcess
from support.topology import nats_run

from kvcache.app.client import Client, ResponseError
from kvcache.app.client import encode_command as encode
from kvcache.entry import Operation

LONG_KEY = "in." + "k" * 300 + "." + "y" * 300          # 606 bytes: stored under a digest
LONG_REMOTE = "out." + "r" * 300 + "." + "z" * 300
BINARY = b"\r\n$-1\r\n\x00*2\r\nnul\x00byte\r\n\xff\xfe"
BIG = os.urandom(512 * 1024)
SCAN_KEYS = 1200
MANY = 1500
CLIENT_PROTOS = [2, 3]
KNOWN_LOCAL = [b"in.k%d" % i for i in range(10)] + [b"in.bin", b"in.big", LONG_KEY.encode()] + [
    b"in.scan.%04d" % i for i in range(SCAN_KEYS)]


def put(url: str, bucket: str, key: str, value: bytes) -> int:
    async def fn(js):
        kv = await js.key_value(bucket)
        return await kv.put(key, value)
    return nats_run(url, fn)




@pytest.fixture(scope="module")
def env(nats_server_module, tmp_path_factory) -> Iterator[dict]:
    url = nats_server_module.url
    stamps = {}

    async def setup(js):
        main = await js.create_key_value(bucket="main", direct=True, history=5)
        stamps["before"] = time.time_ns()
        await main.put("in.k0", b"v0")
        stamps["after"] = time.time_ns()
        await _put_all(main, {f"in.k{i}": b"v%d" % i for i in range(1, 10)})
        await _put_all(main, {"in.bin": BINARY, LONG_KEY: b"long", "in.big": BIG,
                              "in.gone": b"x", "out.gone": b"x",
                              "out.r1": b"remote1", "out.r2": b"remote2", "out.bin": BINARY,
                              LONG_REMOTE: b"long remote"})
        await main.delete("in.gone")
        await main.delete("out.gone")
        await _put_all(main, {f"in.scan.{i:04d}": b"s" for i in range(SCAN_KEYS)})
        second = await js.create_key_value(bucket="second", direct=True)
        await _put_all(second, {"s.a": b"A2", "s.b": b"B2"})
        nodirect = await js.create_key_value(bucket="nodirect")  # nats-py default: no allow_direct
        await _put_all(nodirect, {"in.a": b"NA", "out.a": b"NB"})
        many = await js.create_key_value(bucket="many", direct=True)
        await _put_all(many, {f"r.{i:04d}": b"m%d" % i for i in range(MANY)})
        info = await js.stream_info("KV_nodirect")
        assert not info.config.allow_direct

    nats_run(url, setup)
    sc = SidecarProcess(tmp_path_factory.mktemp("cmd") / "sc", url,
                 ["main:in.>", "second", "nodirect:in.>", "many:in.>"])
    with sc:
        sc.start()
        yield {"url": url, "sc": sc, "sock": sc.socket, **stamps}
        assert sc.stop() == 0


@pytest.fixture(params=CLIENT_PROTOS, ids=lambda p: f"resp{p}")
def r(env, request) -> Iterator[redis.Redis]:
    c = redis.Redis(unix_socket_path=env["sock"], protocol=request.param, socket_timeout=30)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def kc(env) -> Iterator[Client]:
    with Client(env["sock"], timeout=30) as c:
        yield c


def stats(env) -> dict:
    with Client(env["sock"]) as c:
        return c.info("stats")["stats"]


def raw(sock_path: str, data: bytes, until: bytes | None = None, timeout: float = 10) -> bytes:
    """Send bytes, read until `until` appears (or EOF)."""
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(timeout)
    s.connect(sock_path)
    try:
        s.sendall(data)
        return read_until(s, until)
    finally:
        s.close()




# --------------------------------------------------------------------------- connection


def test_ping_echo(env, r, kc):
    assert r.ping() is True
    assert kc.execute("PING", "hi") == b"hi"       # redis-py's PING callback wants PONG
    assert raw(env["sock"], b"PING hi\r\n", until=b"\r\nhi\r\n") == b"$2\r\nhi\r\n"
    assert r.echo(b"a\r\nb\x00") == b"a\r\nb\x00"
    with pytest.raises(redis.ResponseError, match="wrong number of arguments for 'ping'"):
        r.execute_command("PING", "a", "b")
    assert r.ping()


def test_hello(env, r):
    proto = r.connection_pool.connection_kwargs.get("protocol", 2)
    for version in (2, 3):
        reply = r.execute_command("HELLO", version)
        info = reply if isinstance(reply, dict) else dict(zip(reply[::2], reply[1::2], strict=True))
        assert info[b"server"] == b"kvcache"
        assert info[b"proto"] == version
        assert info[b"mode"] == b"standalone"
    r.execute_command("HELLO", proto)  # put the connection back as redis-py expects it
    with pytest.raises(redis.ResponseError, match="NOPROTO"):
        r.execute_command("HELLO", 4)
    with pytest.raises(redis.ResponseError, match="Protocol version is not an integer"):
        r.execute_command("HELLO", "x")
    assert r.ping()


def test_hello_wire_shapes(env):
    """RESP3 HELLO is a map (`%`), RESP2 a flat array; replies follow the protocol chosen."""
    got = raw(env["sock"], b"HELLO 3\r\nGET in.nosuch\r\nHELLO 2 SETNAME x\r\nGET in.nosuch\r\n",
              until=b"$-1\r\n")
    assert got.startswith(b"%7\r\n")
    assert b"_\r\n*14\r\n" in got and got.endswith(b"$-1\r\n")


def test_quit(env):
    got = raw(env["sock"], b"PING\r\nQUIT\r\nPING\r\n")  # read until the server closes
    assert got == b"+PONG\r\n+OK\r\n"


def test_client_subcommands(r):
    assert r.client_setname("app-1") is True
    assert r.client_getname() in (b"app-1", "app-1")
    assert r.client_setinfo("LIB-NAME", "tests") is True
    assert r.client_setinfo("LIB-VER", "1.0") is True
    assert isinstance(r.client_id(), int)
    with pytest.raises(redis.ResponseError, match=r"unknown subcommand 'NOSUCH'. Try CLIENT HELP"):
        r.execute_command("CLIENT", "NOSUCH")


def test_client_setname_setinfo_validated_and_shown(env):
    """Names and library attributes are checked as Redis checks them, and CLIENT INFO shows
    what SETINFO stored (a SETINFO that stored nowhere visible would be an empty OK)."""
    with Client(env["sock"]) as c:
        assert c.execute("CLIENT", "SETINFO", "lib-name", "mylib") == b"OK"
        assert c.execute("CLIENT", "SETINFO", "LIB-VER", "2.5") == b"OK"
        assert c.execute("CLIENT", "SETNAME", "worker-1") == b"OK"
        info = c.execute("CLIENT", "INFO").decode()
        fields = dict(f.split("=", 1) for f in info.split())
        assert fields["name"] == "worker-1" and fields["db"] == "0" and fields["resp"] == "2"
        assert fields["lib-name"] == "mylib" and fields["lib-ver"] == "2.5"
        assert fields["id"] == str(c.execute("CLIENT", "ID")) and info.endswith("\n")
        for cmd, err in [
            (["CLIENT", "SETINFO", "foo", "1"], "ERR Unrecognized option 'foo'"),
            (["CLIENT", "SETINFO", "lib-name", "a b"],
             "ERR lib-name cannot contain spaces, newlines or special characters."),
            (["CLIENT", "SETINFO", "LIB-VER", "1\n2"],
             "ERR LIB-VER cannot contain spaces, newlines or special characters."),
            (["CLIENT", "SETINFO", "lib-name"],
             "ERR wrong number of arguments for 'client|setinfo' command"),
            (["CLIENT", "SETNAME", "a b"],
             "ERR Client names cannot contain spaces, newlines or special characters."),
            (["HELLO", "3", "SETNAME", "a\x01"],
             "ERR Client names cannot contain spaces, newlines or special characters."),
            (["CLIENT", "GETNAME", "x"], "ERR wrong number of arguments for 'client|getname' command"),
            (["CLIENT", "INFO", "x"], "ERR wrong number of arguments for 'client|info' command"),
        ]:
            with pytest.raises(ResponseError) as e:
                c.execute(*cmd)
            assert str(e.value) == err, cmd
        # the refused ones changed nothing (HELLO's protocol switch included)
        assert c.execute("CLIENT", "GETNAME") == b"worker-1"
        assert "lib-name=mylib lib-ver=2.5" in c.execute("CLIENT", "INFO").decode()
        assert c.execute("CLIENT", "SETNAME", "") == b"OK"
        assert c.execute("CLIENT", "GETNAME") is None


@pytest.mark.parametrize("sub", ["NO-EVICT", "NO-TOUCH"])
def test_client_no_evict_no_touch(env, sub):
    """Nothing to exempt from (no client eviction for memory, no LRU): ON and OFF are true
    as they are; anything else is refused with Redis's errors."""
    with Client(env["sock"]) as c:
        assert c.execute("CLIENT", sub, "on") == b"OK"
        assert c.execute("CLIENT", sub, "OFF") == b"OK"
        with pytest.raises(ResponseError, match=r"^ERR syntax error$"):
            c.execute("CLIENT", sub, "maybe")
        with pytest.raises(ResponseError, match=f"wrong number of arguments for 'client.{sub.lower()}'"):
            c.execute("CLIENT", sub)


def test_redis_py_keeps_no_cache_on_the_unix_socket(env):
    """redis-py (8.x) keeps no client-side cache on a Unix socket: cache_config is ignored
    there (its cache needs the TCP listener: tests/test_tracking.py), so every read goes to
    the sidecar."""
    from redis.cache import CacheConfig
    c = redis.Redis(unix_socket_path=env["sock"], protocol=3, cache_config=CacheConfig())
    try:
        assert c.get_cache() is None
        assert c.get("in.k1") == b"v1"
    finally:
        c.close()


def test_auth(env):
    """kvcache has Redis's `default` user and no password (the socket's file mode guards it):
    Redis's own answers for that, never an OK for a password nobody checked."""
    with Client(env["sock"]) as c:
        for cmd, err in [
            (["AUTH", "secret"], "ERR AUTH <password> called without any password configured for "
                                 "the default user. Are you sure your configuration is correct?"),
            (["AUTH", "bob", "secret"], "WRONGPASS invalid username-password pair or user is disabled."),
            (["AUTH"], "ERR wrong number of arguments for 'auth' command"),
            (["AUTH", "a", "b", "c"], "ERR syntax error"),
            (["HELLO", "3", "AUTH", "bob", "secret"],
             "WRONGPASS invalid username-password pair or user is disabled."),
            (["HELLO", "3", "AUTH", "Default", "x"],
             "WRONGPASS invalid username-password pair or user is disabled."),
            (["HELLO", "3", "AUTH", "bob", "x", "NOSUCH"], "ERR Syntax error in HELLO option 'NOSUCH'"),
        ]:
            with pytest.raises(ResponseError) as e:
                c.execute(*cmd)
            assert str(e.value) == err, cmd
        assert c.execute("AUTH", "default", "anything") == b"OK"
        hello = c.execute("HELLO", "2", "AUTH", "default", "anything", "SETNAME", "n1")
        assert dict(zip(hello[::2], hello[1::2], strict=True))[b"proto"] == 2
        assert c.execute("CLIENT", "GETNAME") == b"n1"
        assert c.execute("COMMAND", "INFO", "auth")[0][:2] == [b"auth", -2]
    # a refused HELLO switched nothing: the next reply is still RESP2
    got = raw(env["sock"], encode(["HELLO", "3", "AUTH", "bob", "x"]) + encode(["GET", "in.nosuch"]),
              until=b"$-1\r\n")
    assert got == b"-WRONGPASS invalid username-password pair or user is disabled.\r\n$-1\r\n"


def test_command(r, kc):
    table = r.command()
    assert {"get", "mget", "exists", "keys", "scan", "kv.get", "info", "ping"} <= set(table)
    assert table["get"]["arity"] == 2
    assert table["mget"]["arity"] == -2
    assert "readonly" in table["get"]["flags"]
    assert r.command_count() == len(table)
    info = kc.execute("COMMAND", "INFO", "get", "nosuch")  # redis-py would parse it as COMMAND's
    assert info[0][:2] == [b"get", 2] and info[1] is None
    assert b"get" in r.command_list()


def test_command_docs(env):
    """Real entries, in Redis's shape (name -> map), unknown names left out, as Redis does;
    not an empty map, which would say there is no GET. redis-cli asks at start."""
    with Client(env["sock"]) as c:
        docs = c.execute("COMMAND", "DOCS", "get", "nosuch", "kv.get")
        every = c.execute("COMMAND", "DOCS")
    assert docs[::2] == [b"get", b"kv.get"]
    get = dict(zip(docs[1][::2], docs[1][1::2], strict=True))
    assert get[b"summary"] == b"Get the value of a key" and get[b"group"] == b"string"
    assert len(every) // 2 == len(set(every[::2])) >= 17
    got = raw(env["sock"], encode(["HELLO", "3"]) + encode(["COMMAND", "DOCS", "ping"]),
              until=b"1.0.0\r\n")
    assert got.endswith(b"%1\r\n$4\r\nping\r\n%3\r\n$7\r\nsummary\r\n$15\r\nPing the server\r\n"
                        b"$5\r\ngroup\r\n$10\r\nconnection\r\n$5\r\nsince\r\n$5\r\n1.0.0\r\n")


def test_select(r):
    assert r.execute_command("SELECT", 0) in (True, b"OK")
    with pytest.raises(redis.ResponseError, match="DB index is out of range"):
        r.execute_command("SELECT", 1)
    with pytest.raises(redis.ResponseError, match="DB index is out of range"):
        r.execute_command("SELECT", -1)
    for bad in ("x", "00", "+1", " 1", "99999999999999999999"):
        with pytest.raises(redis.ResponseError, match=r"^value is not an integer or out of range$"):
            r.execute_command("SELECT", bad)
    with pytest.raises(redis.ResponseError, match=r"^value is out of range, value must between"):
        r.execute_command("SELECT", 99999999999)


def test_config_get(env, r):
    cfg = r.config_get("*")
    assert cfg["save"] == "" and cfg["appendonly"] == "no"
    assert r.config_get("save") == {"save": ""}
    assert not r.config_get("nosuch")
    with pytest.raises(redis.ResponseError, match="CONFIG SET notify-keyspace-events only, not 'save'"):
        r.execute_command("CONFIG", "SET", "save", "")
    with pytest.raises(redis.ResponseError, match=r"wrong number of arguments for 'config.get'"):
        r.execute_command("CONFIG", "GET")
    # a setting matched by several patterns is listed once (RESP3: a map has unique keys)
    got = raw(env["sock"], encode(["CONFIG", "GET", "save", "s*", "databases"]),
              until=b"$1\r\n1\r\n")
    assert got == b"*4\r\n$4\r\nsave\r\n$0\r\n\r\n$9\r\ndatabases\r\n$1\r\n1\r\n"


# --------------------------------------------------------------------------- GET


def test_get_default_and_named_bucket(r, kc):
    assert r.get("in.k1") == b"v1"
    assert r.get("main:in.k1") == b"v1"
    assert r.get("second:s.a") == b"A2"
    assert r.get("in.nosuch") is None
    assert r.get("in.gone") is None          # last operation DEL
    assert r.get("second:nosuch") is None
    assert kc.get("in.k2") == b"v2"
    assert kc.get("second:s.b") == b"B2"
    assert kc.get("in.gone") is None


@pytest.mark.parametrize("key", ["in.bin", "out.bin"])
def test_binary_values(r, kc, key):
    assert r.get(key) == BINARY
    assert kc.get(key) == BINARY
    assert kc.mget([key, "in.k0"]) == [BINARY, b"v0"]


@pytest.mark.parametrize("key,value", [(LONG_KEY, b"long"), (LONG_REMOTE, b"long remote")])
def test_long_keys(r, kc, key, value):
    assert len(key) > 511
    assert r.get(key) == value
    assert kc.get(key) == value
    e = kc.entry(key)
    assert e.key == key and e.value == value


def test_big_value(r, kc):
    assert r.get("in.big") == BIG
    assert kc.get("in.big") == BIG
    assert r.mget("in.big", "in.k3", "in.big") == [BIG, b"v3", BIG]


def test_invalid_keys_and_buckets(r, kc):
    for bad in ["bad key", "in..x", ".in", "in.", "in.*", "in.>", "in.k1\n", "in.k1\r\n", "",
                "in.\xe9"]:
        with pytest.raises(redis.ResponseError, match="invalid key"):
            r.get(bad)
    with pytest.raises(redis.ResponseError, match="no such bucket 'nob'"):
        r.get("nob:x")
    with pytest.raises(redis.ResponseError, match="invalid key"):
        r.mget("in.k1", "bad key")
    with pytest.raises(ResponseError, match="no such bucket"):
        kc.get("nob:x")
    assert r.get("in.k1") == b"v1"


def test_invalid_utf8_key(env):
    got = raw(env["sock"], b"*2\r\n$3\r\nGET\r\n$2\r\n\xff\xfe\r\nPING\r\n", until=b"+PONG\r\n")
    assert got.startswith(b"-ERR invalid key") and got.endswith(b"+PONG\r\n")


def test_newline_key_does_not_reach_nats(env, r):
    """A key ending in a newline is invalid (`$` in a regex matches before a final newline):
    it must be refused as such, not sent upstream where it costs a remote error and counts
    against the peer."""
    before = stats(env)
    with pytest.raises(redis.ResponseError, match="invalid key"):
        r.get("out.r1\n")
    assert stats(env)["remote_errors"] == before["remote_errors"]
    assert r.get("out.r1") == b"remote1"


# --------------------------------------------------------------------------- MGET / EXISTS


def test_mget_mixed(env, r, kc):
    """Local hits and misses, and remote keys of two buckets: one multi_last per bucket."""
    before = stats(env)
    peers_before = r.info("peers")
    keys = ["in.k1", "in.nosuch", "out.r1", "second:s.a", "out.nosuch", "in.k2", "out.r2",
            "second:nosuch", "out.gone", "in.gone", "out.r1", "many:r.0003", "many:r.9999"]
    want = [b"v1", None, b"remote1", b"A2", None, b"v2", b"remote2", None, None, None, b"remote1",
            b"m3", None]
    assert r.mget(keys) == want
    after = stats(env)
    # remote: out.r1 (asked twice, fetched once), out.nosuch, out.r2, out.gone, r.0003, r.9999
    assert after["gets_remote"] - before["gets_remote"] == 6
    assert after["gets_local"] - before["gets_local"] == 6
    peers = r.info("peers")
    for name in ("main.main", "main.many"):   # one batched request each
        assert peers[name]["requests"] - peers_before[name]["requests"] == 1
    assert kc.mget(keys) == want
    assert kc.mget([]) == []


def test_mget_many_remote(env, r):
    """1500 keys outside the filters: two multi_last requests, every value back."""
    before = stats(env)
    keys = [f"many:r.{i:04d}" for i in range(MANY)]
    assert r.mget(keys) == [b"m%d" % i for i in range(MANY)]
    after = stats(env)
    assert after["gets_remote"] - before["gets_remote"] == MANY
    assert after["remote_errors"] == before["remote_errors"]


def test_mget_nodirect_bucket(r):
    assert r.mget("nodirect:in.a", "nodirect:out.a", "nodirect:out.nosuch") == [b"NA", b"NB", None]


def test_mget_reply_budget(env, tmp_path):
    """An MGET whose values exceed max_reply_bytes is refused while it is gathered (local
    values and remote ones alike) with a clear error; smaller ones and the connection are fine."""
    sc = SidecarProcess(tmp_path / "sc", env["url"], ["main:in.>", "many:in.>"],
                 extra=["--max-reply-bytes", str(len(BIG) + 4000)])
    with sc:
        sc.start()
        c = redis.Redis(unix_socket_path=sc.socket, socket_timeout=30)
        assert c.mget(["in.big", "in.k1"]) == [BIG, b"v1"]
        with pytest.raises(redis.ResponseError, match=r"reply too large.*max_reply_bytes"):
            c.mget(["in.big", "in.big"])                               # local values
        remote = [f"many:r.{i:04d}" for i in range(MANY)]              # ~6 KB of remote values
        with pytest.raises(redis.ResponseError, match="reply too large"):
            c.mget(["in.big", *remote])
        assert c.mget(remote[:100]) == [b"m%d" % i for i in range(100)]
        assert c.ping() and c.info("stats")["remote_errors"] == 0
        c.close()


def test_exists(r):
    assert r.exists("in.k1") == 1
    assert r.exists("in.k1", "in.k1", "in.nosuch", "in.gone", "out.r1", "out.gone",
                    "second:s.a") == 4
    assert r.exists("in.nosuch") == 0
    with pytest.raises(redis.ResponseError, match="wrong number of arguments"):
        r.execute_command("EXISTS")


# --------------------------------------------------------------------------- KEYS / SCAN


def test_keys_globs(r, kc):
    def keys(p):
        return sorted(r.keys(p))
    assert keys("in.k?") == [b"in.k%d" % i for i in range(10)]
    assert keys("in.k[0-2]") == [b"in.k0", b"in.k1", b"in.k2"]
    assert keys("in.k[^0-7]") == [b"in.k8", b"in.k9"]
    assert keys("in.k[!0-7]") == [b"in.k8", b"in.k9"]
    assert keys("in.b*") == [b"in.big", b"in.bin"]
    assert keys("in.\\b*") == [b"in.big", b"in.bin"]
    assert keys("second:*") == [b"second:s.a", b"second:s.b"]
    assert keys("second:s.[a]") == [b"second:s.a"]
    assert keys("main:in.k1") == [b"main:in.k1"]
    assert keys("out.*") == []          # not replicated: KEYS lists the replica only
    assert keys("in.gone") == []
    assert set(keys("*")) >= set(KNOWN_LOCAL)
    assert LONG_KEY.encode() in keys("in.k*")
    assert sorted(kc.keys("second:*")) == ["second:s.a", "second:s.b"]


def test_scan_iter_over_many_keys(r, kc):
    want = {b"in.scan.%04d" % i for i in range(SCAN_KEYS)}
    got = list(r.scan_iter(match="in.scan.*", count=100))
    assert len(got) == len(set(got)) and set(got) == want
    got = list(r.scan_iter(match="in.scan.*"))     # redis-py's default COUNT (10)
    assert set(got) == want
    assert set(r.scan_iter(match="second:*", count=1)) == {b"second:s.a", b"second:s.b"}
    assert set(kc.keys("in.scan.00*")) == {f"in.scan.{i:04d}" for i in range(100)}
    everything = list(r.scan_iter(count=500))
    assert len(everything) == len(set(everything)) and set(everything) >= set(KNOWN_LOCAL)
    assert set(everything) == set(r.keys("*"))


def test_scan_cursor_protocol(r):
    cursor, batch = r.scan(0, match="in.k*", count=5)
    assert cursor != 0 and len(batch) <= 5
    # the same cursor may be used again (a client retrying after a lost reply)
    again = r.scan(cursor, match="in.k*", count=1000)
    assert r.scan(cursor, match="in.k*", count=1000)[1] == again[1]
    assert set(batch) | set(again[1]) == set(r.keys("in.k*"))
    with pytest.raises(redis.ResponseError, match="invalid cursor"):
        r.scan(987654321)
    with pytest.raises(redis.ResponseError, match="invalid cursor"):
        r.execute_command("SCAN", "abc")
    with pytest.raises(redis.ResponseError, match="syntax error"):
        r.execute_command("SCAN", 0, "MATCH")
    assert r.scan(0, match="in.k1", _type="hash") == (0, [])


# --------------------------------------------------------------------------- KV.GET


def kv_get(r, *args):
    return r.execute_command("KV.GET", *args)


def test_kv_get_local_shape(env, r):
    value, rev, created, op, source = kv_get(r, "in.k0")
    assert value == b"v0" and op == b"PUT" and source == b"local"
    assert isinstance(rev, int) and rev >= 1
    assert env["before"] <= created <= env["after"]
    assert kv_get(r, "in.nosuch") is None
    assert kv_get(r, "in.gone") is None
    assert kv_get(r, "main:in.k0") == [b"v0", rev, created, b"PUT", b"local"]


def test_kv_get_remote_source_is_a_peer(env, r):
    value, _rev, _created, op, source = kv_get(r, "out.r1")
    assert (value, op) == (b"remote1", b"PUT")
    peers = r.info("peers")
    assert source.decode() in peers
    assert peers[source.decode()]["stream"] == "KV_main"
    assert kv_get(r, "out.nosuch") is None
    assert kv_get(r, "out.gone") is None
    assert kv_get(r, "nodirect:out.a")[0::4] == [b"NB", b"leader"]


def test_kv_get_consistency_and_options(env, r):
    local = kv_get(r, "in.k1", "CONSISTENCY", "local")
    assert local[4] == b"local"
    strong = kv_get(r, "in.k1", "CONSISTENCY", "strong")
    assert strong[:4] == local[:4] and strong[4] == b"leader"
    assert kv_get(r, "in.k1", "consistency", "STRONG")[4] == b"leader"
    assert kv_get(r, "in.k1", "MAXSTALE", 60000)[0] == b"v1"
    assert kv_get(r, "out.r2", "CONSISTENCY", "strong")[0::4] == [b"remote2", b"leader"]
    for bad in (["CONSISTENCY", "eventual"], ["MAXSTALE", "x"], ["MAXSTALE", -1], ["NOPE", 1],
                ["MINREV"]):
        with pytest.raises(redis.ResponseError):
            kv_get(r, "in.k1", *bad)


def test_kv_get_minrev_reads_own_write(env, r):
    for key in ("in.rw", "out.rw"):
        for i in range(3):
            rev = put(env["url"], "main", key, b"w%d" % i)
            value, got_rev, _, op, _ = kv_get(r, key, "MINREV", rev)
            assert (value, got_rev, op) == (b"w%d" % i, rev, b"PUT")


def test_entry_client(env, kc):
    e = kc.entry("in.k0")
    assert (e.bucket, e.key, e.value, e.operation, e.source) == ("main", "in.k0", b"v0",
                                                                 Operation.PUT, "local")
    e = kc.entry("second:s.a", consistency="strong")
    assert (e.bucket, e.key, e.value, e.source) == ("second", "s.a", b"A2", "leader")
    assert kc.entry("in.nosuch") is None
    rev = put(env["url"], "second", "s.c", b"C2")
    e = kc.entry("second:s.c", min_rev=rev)
    assert (e.value, e.revision) == (b"C2", rev)


# --------------------------------------------------------------------------- INFO


def test_info(env, r, kc):
    info = r.info()
    for field in ("gets_local", "gets_remote", "gets_notfound", "remote_errors",
                  "connected_clients", "redis_version"):
        assert isinstance(info[field], int) or field == "redis_version", field
    assert info["default_bucket"] == "main"
    # which implementation serves each native module, as the sidecar chose it at start
    expected = "twin" if os.environ.get("KVCACHE_NO_EXTENSIONS") == "1" else None
    assert set(info["native"]) == {"resp", "natsproto", "server_get", "app_get"}
    assert all(v in ("native", "twin") and (expected is None or v == expected) for v in info["native"].values())
    buckets = r.info("buckets")
    assert set(buckets) == {"main", "second", "nodirect", "many"}
    for name, row in buckets.items():
        # the fleet relay's fields only where a sidecar stands for it (`relay` on, off by
        # default): none here
        relay: set[str] = set()
        assert set(row) == {"synced", "keys", "applied_seq", "upstream_seq", "lag_ms", "max_stale_ms",
                            "unwritable_ms", "resyncs", "removed_upstream", "state_polls", "state_shared",
                            "follow", "gaps_filled", "gap_fill_messages", "gap_fill_ms", "gap_fill_skips"} | relay, name
        assert row["synced"] == 1 and row["resyncs"] == 0
        assert row["upstream_seq"] >= row["applied_seq"]
    assert buckets["second"]["keys"] >= 2 and buckets["many"]["keys"] == 0
    peers = r.info("peers")
    assert len(peers) == 4
    for row in peers.values():
        assert set(row) == {"stream", "state", "ewma_us", "requests", "errors", "hedges"}
        assert row["state"] in ("up", "ejected", "down")
    st = r.info("stats")
    assert {"gets_local", "gets_remote", "gets_notfound", "remote_errors"} <= set(st)
    assert "main" not in st and "connected_clients" not in st
    assert set(kc.info()) == {"server", "clients", "stats", "replication", "buckets", "peers"}
    assert kc.info("buckets")["buckets"]["main"]["synced"] == 1


def test_gets_stale_counter(r):
    # answers from a stale replica (serve_stale) are counted apart (test_staleness makes and
    # counts some); this sidecar has serve_stale off and a fresh replica: it never served one
    st = r.info("stats")
    assert st["gets_stale"] == 0


def test_gets_counters(env, r):
    before = stats(env)
    r.get("in.k1")
    r.get("in.nosuch")
    r.get("out.r1")
    r.get("out.nosuch")
    after = stats(env)
    assert after["gets_local"] - before["gets_local"] == 2
    assert after["gets_remote"] - before["gets_remote"] == 2
    assert after["gets_notfound"] - before["gets_notfound"] == 2


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("cmd", [("SET", "in.k1", "x"), ("DEL", "in.k1"), ("INCR", "n"),
                                 ("HSET", "h", "f", "v"), ("FLUSHALL",), ("EXPIRE", "in.k1", 1),
                                 ("MSET", "a", "b"), ("LPUSH", "l", "x")])
def test_writes_are_readonly(r, cmd):
    with pytest.raises(redis.exceptions.ReadOnlyError, match="kvcache is a read replica"):
        r.execute_command(*cmd)
    assert r.get("in.k1") == b"v1"


def test_unknown_and_arity(r, kc):
    with pytest.raises(redis.ResponseError, match="unknown command 'NOSUCH'"):
        r.execute_command("NOSUCH", "a")
    for cmd in [("GET",), ("GET", "a", "b"), ("MGET",), ("KV.GET",), ("KEYS",), ("ECHO",),
                ("SELECT",), ("SCAN",), ("CONFIG",), ("CLIENT",)]:
        with pytest.raises(redis.ResponseError, match=r"wrong number of arguments|syntax"):
            r.execute_command(*cmd)
        assert r.get("in.k1") == b"v1"
    with pytest.raises(ResponseError, match="unknown command"):
        kc.execute("NOSUCH")
    assert kc.get("in.k1") == b"v1"


def test_pipeline_1000_gets(r):
    with r.pipeline(transaction=False) as p:
        for i in range(1000):
            p.get(f"in.k{i % 12}")
        out = p.execute()
    assert out == [b"v%d" % (i % 12) if i % 12 < 10 else None for i in range(1000)]


def test_pipeline_mixed_with_remote_and_errors(r):
    """Replies stay in request order when local, remote and error replies interleave."""
    with r.pipeline(transaction=False) as p:
        for _ in range(50):
            p.get("in.k1")
            p.get("out.r1")
            p.execute_command("KV.GET", "out.r2")
            p.get("bad key")
            p.mget("in.k2", "out.r2", "many:r.0001")
        out = p.execute(raise_on_error=False)
    for i in range(50):
        a, b, c, d, e = out[i * 5:i * 5 + 5]
        assert (a, b, c[0], e) == (b"v1", b"remote1", b"remote2", [b"v2", b"remote2", b"m1"])
        assert isinstance(d, redis.ResponseError)


# --------------------------------------------------------------------------- fallback reads


def test_remote_reads_counted_and_sourced(env, r):
    before = stats(env)
    assert r.get("out.r1") == b"remote1"
    assert r.get("out.nosuch") is None                    # 404 -> nil
    assert r.get("nodirect:out.a") == b"NB"               # leader API
    assert r.get("nodirect:out.nosuch") is None
    assert r.get("many:r.0007") == b"m7"
    after = stats(env)
    assert after["gets_remote"] - before["gets_remote"] == 5
    assert after["remote_errors"] == before["remote_errors"]
    peers = r.info("peers")
    assert any(p["stream"] == "KV_nodirect" and p["requests"] > 0 for p in peers.values())


def test_remote_sees_new_writes(env, r):
    """Keys outside the filters are read from NATS every time: a new value shows at once."""
    for i in range(3):
        put(env["url"], "main", "out.fresh", b"f%d" % i)
        assert r.get("out.fresh") == b"f%d" % i


def test_replica_follows_writes(env):
    sc = env["sc"]
    rev = put(env["url"], "second", "s.live", b"L1")
    sc.wait_for(lambda: sc.buckets()["second"]["applied_seq"] >= rev, what="replica applied")
    with Client(env["sock"]) as c:
        assert c.get("second:s.live") == b"L1"
        assert c.entry("second:s.live").source == "local"


# --------------------------------------------------------------------------- the GET fast path


def _get(key: str | bytes, cmd: bytes = b"GET") -> bytes:
    k = key.encode() if isinstance(key, str) else key
    return b"*2\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n" % (len(cmd), cmd, len(k), k)


def _bulk(v: bytes | None) -> bytes:
    return b"$-1\r\n" if v is None else b"$%d\r\n%b\r\n" % (len(v), v)


def test_get_pipeline_order_across_every_path(env):
    """One pipeline where runs of GETs are broken by every kind of request: a remote key, an
    invalid key, a lower-case `get`, an inline GET, another command, a long key (stored under
    a digest), a value bigger than one write, a miss. Replies come back in request order."""
    reqs = [
        (_get("in.k1"), _bulk(b"v1")),
        (_get("in.k2"), _bulk(b"v2")),
        (_get("out.r1"), _bulk(b"remote1")),
        (_get("in.k3"), _bulk(b"v3")),
        (_get("bad..key"), None),
        (_get("in.k4", b"get"), _bulk(b"v4")),
        (b"GET in.k5\r\n", _bulk(b"v5")),
        (_get("in.big"), _bulk(BIG)),
        (_get("in.k6"), _bulk(b"v6")),
        (_get(LONG_KEY), _bulk(b"long")),
        (_get("in.nosuch"), _bulk(None)),
        (_get("second:s.a"), _bulk(b"A2")),
        (encode(["EXISTS", "in.k1"]), b":1\r\n"),
        (_get("in.big"), _bulk(BIG)),
        (_get("in.big"), _bulk(BIG)),
        (_get("many:r.0001"), _bulk(b"m1")),
        (_get("in.k7"), _bulk(b"v7")),
    ]
    data = b"".join(r for r, _ in reqs) * 3
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(30)
    s.connect(env["sock"])
    try:
        s.sendall(data)
        want = [reply for _ in range(3) for _, reply in reqs]
        least = sum(len(w) for w in want if w is not None)
        buf = b""
        while len(buf) <= least or not buf.endswith(_bulk(b"v7")):
            chunk = s.recv(1 << 20)
            assert chunk
            buf += chunk
    finally:
        s.close()
    pos = 0
    for w in want:
        if w is None:
            end = buf.index(b"\r\n", pos) + 2
            assert buf[pos:end].startswith(b"-ERR invalid key")
            pos = end
        else:
            assert buf[pos:pos + len(w)] == w, (pos, buf[pos:pos + 80], w[:80])
            pos += len(w)
    assert pos == len(buf)


def test_get_declared_length_mismatch_is_a_protocol_error(env):
    """The fast path must not accept what the full parser refuses: `$3` before a 4-byte key."""
    data = _get("in.k1") + _get("in.k2") + b"*2\r\n$3\r\nGET\r\n$3\r\nin.k\r\n" + _get("in.k3")
    got = raw(env["sock"], data)  # the server answers, then closes
    assert got == _bulk(b"v1") + _bulk(b"v2") + b"-ERR Protocol error: bulk not terminated by CRLF\r\n"
    # `$9` swallows the CRLF and what follows, exactly as the full parser reads it
    data = _get("in.k1") + b"*2\r\n$3\r\nGET\r\n$9\r\nin.k1\r\n*1\r\n$4\r\nPING\r\n"
    got = raw(env["sock"], data, until=b"+PONG\r\n")
    assert got == _bulk(b"v1") + (
        b"-ERR invalid key 'in.k1  *1': KV keys use A-Z a-z 0-9 - / _ = and dots between tokens\r\n"
        b"-ERR unknown command '$4', with args beginning with: \r\n+PONG\r\n")


def test_get_protocol_switch_mid_pipeline(env):
    data = _get("in.nosuch") + encode(["HELLO", "3"]) + _get("in.nosuch") + _get("in.k1") + \
        encode(["HELLO", "2"]) + _get("in.nosuch") + encode(["PING"])
    got = raw(env["sock"], data, until=b"+PONG\r\n")
    assert got.startswith(b"$-1\r\n%7\r\n")
    assert b"_\r\n$2\r\nv1\r\n*14\r\n" in got
    assert got.endswith(b"$-1\r\n+PONG\r\n")


# --------------------------------------------------------------------------- contract details


def test_kv_get_minrev_reached_is_answered_locally(env, r):
    """MINREV of a revision the replica holds: the replica answers (source local); of a key
    outside the filters: the leader, at once."""
    rev = put(env["url"], "main", "in.minrev", b"m1")
    env["sc"].wait_for(lambda: env["sc"].buckets()["main"]["applied_seq"] >= rev, what="applied")
    before = stats(env)
    value, got_rev, _, op, source = kv_get(r, "in.minrev", "MINREV", rev)
    assert (value, got_rev, op, source) == (b"m1", rev, b"PUT", b"local")
    after = stats(env)
    assert (after["gets_local"] - before["gets_local"], after["gets_remote"] - before["gets_remote"]) == (1, 0)
    rev = put(env["url"], "main", "out.minrev", b"o1")
    assert kv_get(r, "out.minrev", "MINREV", rev)[::4] == [b"o1", b"leader"]


def test_kvcache_get_entry_prints_the_entry(env):
    from support.sidecar_proc import run_cli
    rev = put(env["url"], "main", "in.cli", b"c1")
    env["sc"].wait_for(lambda: env["sc"].buckets()["main"]["applied_seq"] >= rev, what="applied")
    out = run_cli("get", "--entry", "in.cli", "--socket", env["sock"])
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(": ", 1) for line in out.stdout.strip().splitlines())
    assert lines["value"] == "b'c1'" and lines["revision"] == str(rev)
    assert lines["operation"] == "PUT" and lines["source"] == "local" and int(lines["created"]) > 0
    out = run_cli("get", "--entry", "in.nosuch", "--socket", env["sock"])
    assert (out.returncode, out.stdout.strip()) == (1, "(nil)")
