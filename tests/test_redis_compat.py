"""Where Redis's own test suite (tag 7.4.1, external-server mode) found kvcache answering
otherwise, checked byte for byte against a real redis-server over raw sockets.

- Pub/sub confirmations under CLIENT REPLY OFF and SKIP (unit/pubsub.tcl, "PubSub messages
  with CLIENT REPLY OFF" and the keyspace tests that subscribe after OFF or SKIP): Redis sends
  (P)(UN)SUBSCRIBE's confirmations whatever CLIENT REPLY says, in RESP2 and RESP3 alike
  (pubsub.c marks them CLIENT_PUSHING, which lifts OFF and SKIP), so a client waiting for one
  must get it. kvcache used to drop them, and such a client waited for ever.
- `*-10\\r\\n` (unit/protocol.tcl, "Negative multibulk length"): no command at all, as `*0` and
  `*-1` are; the connection goes on (kvcache used to close it with a protocol error).
- `*3000000000\\r\\n` ("Out of range multibulk length"): a count past INT_MAX is `invalid
  multibulk length`, before kvcache's own `max_args` would say `too many arguments`.
- Beside them, counts and lengths are numbers as Redis's string2ll reads them: `*01`, `*-0`
  and `$04` are protocol errors there (kvcache read them as 1, 0 and 4).

The request reader is checked in both twins (the Cython one and the pure Python one), and the
server through two real sidecars, one with the native modules and one with the twins
(KVCACHE_NO_EXTENSIONS=1), each against the same redis-server on a Unix socket.
"""
from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from support.redis_ref import END, END_REPLY, bucket_holding, redis_server, twin_sidecar

from kvcache import resp as resp_twin
from kvcache.app.client import encode_command as encode
from kvcache.errors import ProtocolError
from kvcache.native import native_or_none

resp_native = native_or_none("resp")
READERS = [pytest.param(resp_twin, id="python"),
           pytest.param(resp_native, id="native",
                        marks=pytest.mark.skipif(resp_native is None, reason="kvcache._native.resp not built"))]

VALUES = {"k1": b"v1", "k2": b"v2"}


@pytest.fixture(scope="module")
def redis_sock(tmp_path_factory) -> Iterator[str]:
    """The reference: a real redis-server holding VALUES, on a Unix socket only."""
    with redis_server(tmp_path_factory.mktemp("redis"), VALUES) as path:
        yield path


@pytest.fixture(scope="module")
def bucket_url(nats_server_module) -> str:
    return bucket_holding(nats_server_module.url, "rc", VALUES)


@pytest.fixture(scope="module", params=["native", "twins"])
def sidecar_sock(request, bucket_url, tmp_path_factory) -> Iterator[str]:
    """A real sidecar replicating bucket rc (its default bucket), native or pure Python."""
    with twin_sidecar(request.param, tmp_path_factory.mktemp(request.param), bucket_url, "rc") as path:
        yield path


def exchange(path: str, parts: list[bytes], until: bytes | None = END_REPLY) -> bytes:
    """Send `parts`, one write each; read until the reply ends with `until`, or (None) until
    the server closes. A server that never sends what the client waits for times out here."""
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(path)
    try:
        for part in parts:
            s.sendall(part)
        got = b""
        while until is None or not got.endswith(until):
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            got += chunk
        return got
    finally:
        s.close()


def cmds(*commands: list[str]) -> bytes:
    return b"".join(encode(c) for c in commands)


def one_per_write(data: bytes) -> list[bytes]:
    """`data` cut into its commands, so that each arrives in a read of its own."""
    reader = resp_twin.RequestReader()
    reader.feed(data)
    out, pos = [], 0
    while reader.next_command() is not None:
        n = len(data) - reader.buffered - pos
        out.append(data[pos:pos + n])
        pos += n
    assert pos == len(data)
    return out


# --------------------------------------------------------------------------- pub/sub and CLIENT REPLY

ON, OFF, SKIP = (["CLIENT", "REPLY", m] for m in ("ON", "OFF", "SKIP"))
HELLO3 = ["HELLO", "3"]  # always behind a SKIP: its reply names the server and the client id

# Each ends unsubscribed, so END's CLIENT REPLY ON and ECHO run in RESP2 too. UNSUBSCRIBE with
# no argument is used with one subscription at most (Redis lists the rest in hash order).
PUBSUB = {
    "resp2-off": cmds(OFF, ["SUBSCRIBE", "a", "b"], ["PSUBSCRIBE", "a*"], ["PING"], ["PING", "x"],
                      ["SUBSCRIBE"], ["GET", "k1"], ["UNSUBSCRIBE", "a"], ["PUNSUBSCRIBE", "a*"],
                      ["UNSUBSCRIBE", "b"], ["UNSUBSCRIBE"], ["PUNSUBSCRIBE"]),
    "resp2-skip": cmds(SKIP, ["SUBSCRIBE", "a"], ["PING"], SKIP, ["PSUBSCRIBE", "a*", "b*"],
                       ["PING", "x"], SKIP, ["UNSUBSCRIBE", "a"], SKIP, ["PUNSUBSCRIBE", "b*"],
                       ["PUNSUBSCRIBE", "a*"], SKIP, ["PUNSUBSCRIBE"], ["PING"]),
    "resp3-off": cmds(SKIP, HELLO3, OFF, ["SUBSCRIBE", "a"], ["PSUBSCRIBE", "a*"], ["PING"],
                      ["GET", "k1"], ["UNSUBSCRIBE", "a", "b"], ["PUNSUBSCRIBE", "a*"],
                      ["UNSUBSCRIBE"]),
    "resp3-skip": cmds(SKIP, HELLO3, SKIP, ["SUBSCRIBE", "a", "b"], ["PING"], SKIP,
                       ["PSUBSCRIBE", "a*"], ["GET", "k1"], SKIP, ["UNSUBSCRIBE", "b", "a"],
                       SKIP, ["PUNSUBSCRIBE"], ["GET", "k2"]),
    # inside EXEC: the transaction's reply is dropped, its confirmations still go out
    "resp3-off-exec": cmds(SKIP, HELLO3, ["SUBSCRIBE", "q"], OFF, ["MULTI"], ["UNSUBSCRIBE", "q"],
                           ["PING"], ["SUBSCRIBE", "r"], ["EXEC"], ["UNSUBSCRIBE", "r"]),
    "resp2-off-exec": cmds(OFF, ["MULTI"], ["SUBSCRIBE", "a"], ["PING"], ["EXEC"],
                           ["UNSUBSCRIBE", "a"]),
}


@pytest.mark.parametrize("name", list(PUBSUB))
def test_pubsub_confirmations_whatever_client_reply_says(redis_sock, sidecar_sock, name):
    """The confirmations come as Redis sends them, with OFF or SKIP in force, RESP2 and RESP3;
    every other reply those modes drop stays dropped. The same bytes whether the pipeline
    arrives in one write or one command per write."""
    data = PUBSUB[name] + END
    want = exchange(redis_sock, [data])
    assert b"subscribe\r\n" in want and want.endswith(END_REPLY), want
    got = exchange(sidecar_sock, [data])
    print(f"{name}: {len(want)} bytes from redis-server, {len(got)} from the sidecar")
    assert got == want
    assert exchange(sidecar_sock, one_per_write(data)) == want


@pytest.mark.parametrize("proto", [2, 3])
@pytest.mark.parametrize("mode", ["OFF", "SKIP"])
@pytest.mark.parametrize("command", [["SUBSCRIBE", "chan", "ch2"], ["PSUBSCRIBE", "ch*"]],
                         ids=["subscribe", "psubscribe"])
def test_a_client_waiting_for_its_confirmation_gets_it(redis_sock, sidecar_sock, proto, mode, command):
    """As Redis's test client does: set the mode, subscribe, then wait for the confirmations
    before going on (RESP3 confirmations are pushes, `>3`). Both servers, the same bytes."""
    head = b">3" if proto == 3 else b"*3"
    kind = command[0].lower()
    want = b"".join(head + b"\r\n" + encode([kind, ch])[4:] + b":%d\r\n" % n
                    for n, ch in enumerate(command[1:], 1))
    for path in (redis_sock, sidecar_sock):
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(10)
        s.connect(path)
        try:
            s.sendall(cmds(SKIP, ["HELLO", str(proto)], ["CLIENT", "REPLY", mode], command))
            got = b""
            while len(got) < len(want):  # times out (a failure) if they never come
                chunk = s.recv(len(want) - len(got))
                assert chunk, got
                got += chunk
            assert got == want, path
        finally:
            s.close()


# --------------------------------------------------------------------------- multibulk counts

@pytest.mark.parametrize("data,until", [
    (b"*-10\r\n" + encode(["PING"]), b"+PONG\r\n"),                        # "Negative multibulk length"
    (b"*-10\r\n*-1\r\n*0\r\n*-2147483649\r\nPING\r\n", b"+PONG\r\n"),     # any negative: nothing
    (b"*3000000000\r\n", None),                                           # "Out of range multibulk length"
    (b"*2147483648\r\n", None),                                           # INT_MAX + 1
    (b"*9223372036854775807\r\n", None),
    (b"*01\r\n$4\r\nPING\r\n", None),                                     # string2ll: no leading zero
    (b"*-0\r\n", None),
    (b"*1\r\n$04\r\nPING\r\n", None),
], ids=["negative", "negatives", "3e9", "int-max+1", "llong-max", "leading-zero", "minus-zero",
        "bulk-leading-zero"])
def test_multibulk_counts_as_redis(redis_sock, sidecar_sock, data, until):
    """A negative count is no command and the connection goes on; a count past INT_MAX, or a
    count or length Redis's string2ll does not read, is Redis's protocol error, then the
    connection closes."""
    want = exchange(redis_sock, [data], until)
    got = exchange(sidecar_sock, [data], until)
    print(f"{data[:24]!r}: redis-server {want!r}, sidecar {got!r}")
    assert got == want
    if until is None:
        assert want.startswith(b"-ERR Protocol error: invalid ") and want.endswith(b" length\r\n")


@pytest.mark.parametrize("mod", READERS)
def test_reader_skips_negative_counts(mod):
    reader = mod.RequestReader()
    reader.feed(b"*-10\r\n*-1\r\n*-9223372036854775808\r\n*0\r\n*1\r\n$4\r\nPING\r\n")
    assert reader.next_command() == [b"PING"]
    assert reader.next_command() is None and reader.buffered == 0


@pytest.mark.parametrize("mod", READERS)
@pytest.mark.parametrize("count,error", [
    (b"3000000000", "invalid multibulk length"),
    (b"2147483648", "invalid multibulk length"),
    (b"9999999999999999999", "invalid multibulk length"),
    (b"2147483647", "too many arguments"),   # within Redis's range: kvcache's own max_args
    (b"1048577", "too many arguments"),
])
def test_reader_count_limits(mod, count, error):
    reader = mod.RequestReader()
    reader.feed(b"*" + count + b"\r\n")
    with pytest.raises(ProtocolError, match=f"^Protocol error: {error}$"):
        reader.next_command()
