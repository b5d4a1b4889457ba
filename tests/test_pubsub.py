"""Keyspace notifications and pub/sub against a real sidecar fed by a real nats-server:
redis-py's PubSub (RESP2 and RESP3), raw sockets for the exact frames, nats-py as the writer.
Hostile subscribers: one that stops reading is cut off alone; thousands of subscriptions on
one connection."""
from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
import redis
from support.kvdata import kv_put, read_until
from support.poll import wait_until
from support.sidecar_proc import SidecarProcess
from support.topology import nats_run

from kvcache.app.client import Client
from kvcache.app.client import encode_command as encode

put = kv_put


def put_many(url: str, bucket: str, items: list[tuple[str, bytes]]) -> None:
    async def fn(js):
        kv = await js.key_value(bucket)
        for k, v in items:
            await kv.put(k, v)
    nats_run(url, fn)


@pytest.fixture(scope="module")
def env(nats_server_module, tmp_path_factory) -> Iterator[dict]:
    url = nats_server_module.url

    async def setup(js):
        await js.create_key_value(bucket="ps", direct=True)
        await js.create_key_value(bucket="ps2", direct=True)
        cfg = (await js.stream_info("KV_ps")).config
        cfg.allow_msg_ttl = True
        await js.update_stream(cfg)

    nats_run(url, setup)
    sc = SidecarProcess(tmp_path_factory.mktemp("ps") / "sc", url, ["ps", "ps2"],
                        extra=["--pubsub-max-output-bytes", str(4 << 20), "--heartbeat-ms", "500"])
    with sc:
        sc.start()
        yield {"url": url, "sc": sc, "sock": sc.socket}
        assert sc.stop() == 0


def connect(env: dict) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(env["sock"])
    return s


def read_exactly(s: socket.socket, want: bytes) -> bytes:
    got = b""
    while len(got) < len(want):
        chunk = s.recv(len(want) - len(got))
        if not chunk:
            break
        got += chunk
    return got


def msg(channel: str, payload: str, proto: int = 2) -> bytes:
    head = b">3\r\n" if proto == 3 else b"*3\r\n"
    return head + b"$7\r\nmessage\r\n" + encode([channel, payload])[4:]


def test_keyspace_and_keyevent_messages(env):
    """Each change twice, as Redis publishes it: the key's channel with the event, the event's
    channel with the key; bare keys for the default bucket, bucket:key for the others."""
    url = env["url"]
    r = redis.Redis(unix_socket_path=env["sock"])
    p = r.pubsub()
    try:
        p.subscribe("__keyspace@0__:k1", "__keyevent@0__:set", "__keyevent@0__:del")
        p.psubscribe("__keyspace@0__:ps2:*", "__keyevent@0__:exp*")
        for _ in range(5):
            p.get_message(timeout=1)  # the five confirmations
        put(url, "ps", "k1", b"a")
        put(url, "ps2", "x.y", b"b")

        async def rm(js):
            await (await js.key_value("ps")).delete("k1")
            await (await js.key_value("ps")).purge("k2")
        nats_run(url, rm)
        put(url, "ps", "t1", b"soon", ttl="1s")
        got = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(got) < 8:
            m = p.get_message(timeout=1)
            if m:
                got.append((m["type"], m.get("pattern"), m["channel"], m["data"]))
        assert got == [
            ("message", None, b"__keyspace@0__:k1", b"set"),
            ("message", None, b"__keyevent@0__:set", b"k1"),
            ("pmessage", b"__keyspace@0__:ps2:*", b"__keyspace@0__:ps2:x.y", b"set"),
            ("message", None, b"__keyevent@0__:set", b"ps2:x.y"),
            ("message", None, b"__keyspace@0__:k1", b"del"),
            ("message", None, b"__keyevent@0__:del", b"k1"),
            ("message", None, b"__keyevent@0__:set", b"t1"),
            ("pmessage", b"__keyevent@0__:exp*", b"__keyevent@0__:expired", b"t1"),
        ], got  # the purge of k2, a key the replica never held, is no change: no event
    finally:
        p.close()
        r.close()


def test_wire_frames_resp2_and_resp3(env):
    url = env["url"]
    s2, s3 = connect(env), connect(env)
    try:
        s2.sendall(encode(["SUBSCRIBE", "__keyspace@0__:w1"]) + encode(["GET", "w1"]) + encode(["PING"])
                   + encode(["PING", "hi"]))
        want = (b"*3\r\n$9\r\nsubscribe\r\n$17\r\n__keyspace@0__:w1\r\n:1\r\n"
                b"-ERR Can't execute 'get': only (P|S)SUBSCRIBE / (P|S)UNSUBSCRIBE / PING / QUIT / RESET "
                b"are allowed in this context\r\n*2\r\n$4\r\npong\r\n$0\r\n\r\n*2\r\n$4\r\npong\r\n$2\r\nhi\r\n")
        assert read_exactly(s2, want) == want
        s3.sendall(encode(["HELLO", "3"]))
        assert read_until(s3, b"modules\r\n*0\r\n").startswith(b"%7\r\n")
        s3.sendall(encode(["SUBSCRIBE", "__keyspace@0__:w1"]) + encode(["GET", "w1"]))
        want3 = b">3\r\n$9\r\nsubscribe\r\n$17\r\n__keyspace@0__:w1\r\n:1\r\n_\r\n"
        assert read_exactly(s3, want3) == want3  # RESP3: any command while subscribed
        put(url, "ps", "w1", b"v")
        assert read_exactly(s2, msg("__keyspace@0__:w1", "set")) == msg("__keyspace@0__:w1", "set")
        assert read_exactly(s3, msg("__keyspace@0__:w1", "set", 3)) == msg("__keyspace@0__:w1", "set", 3)
        s2.sendall(encode(["UNSUBSCRIBE"]) + encode(["UNSUBSCRIBE"]) + encode(["GET", "w1"]))
        want = (b"*3\r\n$11\r\nunsubscribe\r\n$17\r\n__keyspace@0__:w1\r\n:0\r\n"
                b"*3\r\n$11\r\nunsubscribe\r\n$-1\r\n:0\r\n$1\r\nv\r\n")
        assert read_exactly(s2, want) == want
    finally:
        s2.close()
        s3.close()


def pmsg(pattern: str, channel: str, payload: str, proto: int = 2) -> bytes:
    head = b">4\r\n" if proto == 3 else b"*4\r\n"
    return head + b"$8\r\npmessage\r\n" + encode([pattern, channel, payload])[4:]


def ack(kind: str, channel: str | None, count: int, proto: int = 2) -> bytes:
    head = b">3\r\n" if proto == 3 else b"*3\r\n"
    name = encode([kind])[4:]
    ch = encode([channel])[4:] if channel is not None else (b"_\r\n" if proto == 3 else b"$-1\r\n")
    return head + name + ch + b":%d\r\n" % count


@pytest.mark.parametrize("proto,mode", [(2, "OFF"), (2, "SKIP"), (3, "OFF"), (3, "SKIP")])
def test_subscribing_with_client_reply_off_or_skip(env, proto, mode):
    """Redis's own tests (unit/pubsub.tcl: "PubSub messages with CLIENT REPLY OFF" in RESP3,
    the keyspace tests after OFF and SKIP in RESP2) silence replies, subscribe, and wait for
    the confirmation, then for the notification of a change: Redis sends both whatever
    CLIENT REPLY says. A sidecar that dropped the confirmation left them waiting for ever."""
    url = env["url"]
    key = f"silenced{proto}{mode.lower()}"
    space, event = f"__keyspace@0__:{key}", "__keyevent@0__:set"
    s = connect(env)
    try:
        s.sendall(encode(["CLIENT", "REPLY", "SKIP"]) + encode(["HELLO", str(proto)])
                  + encode(["CLIENT", "REPLY", mode]) + encode(["PSUBSCRIBE", f"__keyspace@0__:{key}*"]))
        want = ack("psubscribe", f"__keyspace@0__:{key}*", 1, proto)
        assert read_exactly(s, want) == want
        if proto == 3:  # RESP3: CLIENT REPLY may be set again while subscribed
            s.sendall(encode(["CLIENT", "REPLY", mode]))
        s.sendall(encode(["SUBSCRIBE", event]))
        want = ack("subscribe", event, 2, proto)
        assert read_exactly(s, want) == want
        put(url, "ps", key, b"v")
        want = pmsg(f"__keyspace@0__:{key}*", space, "set", proto) + msg(event, key, proto)
        assert read_exactly(s, want) == want
        if proto == 3:
            s.sendall(encode(["CLIENT", "REPLY", mode]))
        s.sendall(encode(["UNSUBSCRIBE", event]) + encode(["PUNSUBSCRIBE"]))
        want = (ack("unsubscribe", event, 1, proto)
                + ack("punsubscribe", f"__keyspace@0__:{key}*", 0, proto))
        assert read_exactly(s, want) == want
        # SKIP covered one command; OFF is still in force: PING answers only after SKIP
        s.sendall(encode(["PING"]))
        if mode == "SKIP":
            assert read_exactly(s, b"+PONG\r\n") == b"+PONG\r\n"
        s.sendall(encode(["CLIENT", "REPLY", "ON"]) + encode(["ECHO", "end"]))
        assert read_exactly(s, b"+OK\r\n$3\r\nend\r\n") == b"+OK\r\n$3\r\nend\r\n"
    finally:
        s.close()


def test_pubsub_introspection_config_and_reset(env):
    r = redis.Redis(unix_socket_path=env["sock"], decode_responses=True)
    p = r.pubsub()
    try:
        p.subscribe("__keyspace@0__:i1", "chan.x")
        p.psubscribe("__keyevent@0__:*")
        for _ in range(3):
            p.get_message(timeout=1)
        assert set(r.pubsub_channels()) >= {"__keyspace@0__:i1", "chan.x"}
        assert r.pubsub_channels("chan.*") == ["chan.x"]
        assert r.pubsub_numsub("chan.x", "nosuch") == [("chan.x", 1), ("nosuch", 0)]
        assert r.pubsub_numpat() == 1
        assert r.config_get("notify-keyspace-events") == {"notify-keyspace-events": "AKE"}
        assert r.config_set("notify-keyspace-events", "Kx")
        assert r.config_get("notify-keyspace-events") == {"notify-keyspace-events": "xK"}
        with pytest.raises(redis.ResponseError, match="kvcache does not send key-miss events"):
            r.config_set("notify-keyspace-events", "Em")
        with pytest.raises(redis.ResponseError, match="Invalid event class character"):
            r.config_set("notify-keyspace-events", "Kq")
        assert r.config_set("notify-keyspace-events", "KEA")
        with Client(env["sock"]) as k:
            assert k.info("stats")["stats"]["pubsub_patterns"] == 1
            assert k.info("clients")["clients"]["pubsub_clients"] >= 1
    finally:
        p.close()
    s = connect(env)
    try:
        s.sendall(encode(["SUBSCRIBE", "a", "b"]) + encode(["RESET"]) + encode(["GET", "nosuch"]))
        want = (b"*3\r\n$9\r\nsubscribe\r\n$1\r\na\r\n:1\r\n*3\r\n$9\r\nsubscribe\r\n$1\r\nb\r\n:2\r\n"
                b"+RESET\r\n$-1\r\n")
        assert read_exactly(s, want) == want
    finally:
        s.close()
    wait_until(lambda: r.pubsub_numsub("a") == [("a", 0)], 5, "RESET to unsubscribe")
    r.close()


def test_thousands_of_subscriptions_on_one_connection(env):
    url = env["url"]
    r = redis.Redis(unix_socket_path=env["sock"])
    p = r.pubsub()
    try:
        channels = [f"__keyspace@0__:many.{i}" for i in range(5000)]
        for i in range(0, len(channels), 1000):
            p.subscribe(*channels[i:i + 1000])
        n = 0
        while n < len(channels):
            m = p.get_message(timeout=5)
            assert m is not None and m["type"] == "subscribe"
            n += 1
        assert m["data"] == 5000
        put_many(url, "ps", [(f"many.{i}", b"x") for i in (0, 2500, 4999)])
        got = [p.get_message(timeout=5) for _ in range(3)]
        assert [g["channel"] for g in got] == [c.encode() for c in (channels[0], channels[2500], channels[4999])]
        p.unsubscribe()
        n = 0
        while n < len(channels):
            m = p.get_message(timeout=5)
            assert m is not None and m["type"] == "unsubscribe"
            n += 1
        assert m["data"] == 0
    finally:
        p.close()
        r.close()


def test_a_subscriber_that_stops_reading_is_cut_off_alone(env):
    """The stuck one's output passes pubsub_max_output_bytes (4 MiB here) and it is cut off;
    a reading subscriber gets every message, in order, meanwhile."""
    url = env["url"]
    stuck = connect(env)
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stuck.sendall(encode(["PSUBSCRIBE", "__key*"]))
    good = redis.Redis(unix_socket_path=env["sock"])
    p = good.pubsub()
    p.subscribe("__keyevent@0__:set")
    assert p.get_message(timeout=5)["type"] == "subscribe"
    with Client(env["sock"]) as k:
        before = k.info("clients")["clients"]["subscribers_cut_off"]
    big = b"v" * 10
    keys = [f"stuck.{'k' * 200}.{i}" for i in range(12000)]  # ~ 250-byte keys, 4 messages each

    async def fill(js):
        kv = await js.key_value("ps2")
        for i in range(0, len(keys), 500):
            await __import__("asyncio").gather(*(kv.put(k, big) for k in keys[i:i + 500]))
    nats_run(url, fill)
    got = []
    deadline = time.monotonic() + 60
    while len(got) < len(keys) and time.monotonic() < deadline:
        m = p.get_message(timeout=1)
        if m and m["type"] == "message":
            got.append(m["data"])
    assert sorted(got) == sorted(f"ps2:{k}".encode() for k in keys)
    with Client(env["sock"]) as k:
        wait_until(lambda: k.info("clients")["clients"]["subscribers_cut_off"] == before + 1, 10,
                   "the stuck subscriber to be cut off")
    stuck.settimeout(5)
    data = b""
    try:
        while chunk := stuck.recv(1 << 20):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    assert len(data) < 8 << 20  # it never got everything: the connection was cut
    assert "over pubsub_max_output_bytes" in env["sc"].log()
    p.close()
    good.close()
    stuck.close()
