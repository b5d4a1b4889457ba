"""Fuzz harness: the server's GET path, ext/server_get.pyx (with the native RESP reader) against
kvcache/serve/server_get.py (with the twin's), on a small real LMDB replica in a temporary
directory: bucket `main` (the default, every key replicated, values from empty to 100 kB, a
key long enough to be stored under a digest), bucket `other` (only keys under `only.` are
replicated; keys under `c.` are planned onto its near cache, which holds a value, a cached
not-found and an expired value) and bucket `later` (no database yet).

Two ways to drive it, as the server does (tests/test_server_get.py drives both on vectors):
`answer` on each chunk, then every command the fast path hands over through `next_command`
(with `answer` again after each), the replies concatenated, the commands in order with where
they came in the replies, and the reads counted per bucket; or (options bit 5) a
GetConnection fed each chunk by `data_received`, writing to one end of a real socket pair
whose send buffer the choice bytes pick (values of LARGE_VALUE bytes and more go from the map
to the socket), its generic path here only taking the commands handed over: what the client
receives and what the connection counted.

The options byte: bit 0 the protocol (RESP2, RESP3), bits 1-2 the budget of one `answer`
(BUDGETS), bit 3 buckets planned by the planner alone (no `set_buckets`), bit 4 bucket
`other`'s feed stale, bit 5 the connection.
"""
from __future__ import annotations

import atexit
import shutil
import socket
import tempfile
import time
from types import ModuleType
from typing import Any

from harness import Raised, decode, differential, encode, native_module

from kvcache import resp as twin_resp
from kvcache.errors import ProtocolError
from kvcache.read.policy import Plan
from kvcache.resp import GET_LEN
from kvcache.serve import server_get as twin
from kvcache.stats import Stats
from kvcache.store.nearcache import NearCache
from kvcache.store.record import LONG_KEY_PREFIX, RECORD, item, lmdb_key
from kvcache.store.replica import BucketMeta, Replica

MiB = 1 << 20
LONG = "long." + "k" * 600
VALUES = {"a": b"1", "empty": b"", "bin": b"\r\n$-1\r\n\x00\xff", "nine": b"x" * 4095, "ten": b"y" * 4096,
          "big": bytes(range(256)) * 400, LONG: b"long value", "dot.ted.key": b"dotted", "b/c=d_e-f": b"punct"}
OTHER = {"a": b"other a", "only.here": b"o"}
BUDGETS = [1 << 30, 4100, 30, 1]
SNDBUF = [4096, 65536, 1 << 22]
NOW = time.time_ns()

native: ModuleType | None = None
native_resp: ModuleType | None = None
CONNECTIONS: dict[ModuleType, type] = {}  # module -> connection_class(module)
replica: Replica | None = None
feeds: dict[str, Feed] = {}


class Feed:
    """What the GET path asks of a bucket's feed: may the replica answer now?"""

    def __init__(self) -> None:
        self.fresh = True
        self.max_age_ns = 0
        self.cache: NearCache | None = None

    def fresh_for_all(self, max_stale_ms: int) -> bool:
        return self.fresh


class Planner:
    """ReadPolicy.plan's contract for the three buckets (tests/test_server_get.py's)."""

    def __call__(self, raw: bytes) -> Plan | bool:
        assert replica is not None
        try:
            text = raw.decode()
        except UnicodeDecodeError:
            return False
        bucket, sep, key = text.partition(":")
        if not sep:
            bucket, key = "main", text
        if bucket not in feeds or not key or ":" in key or key.startswith(".") or key.endswith(".") \
                or ".." in key:
            return False
        lkey = lmdb_key(key)
        if bucket == "other" and not key.startswith("only."):
            cache = feeds[bucket].cache
            if cache is None or not key.startswith("c."):
                return False
            return Plan(feeds[bucket], 1000, bucket, lkey, cache.db, RECORD.size, cache)
        return Plan(feeds[bucket], 1000, bucket, lkey, replica.db(bucket),
                    None if lkey.startswith(LONG_KEY_PREFIX) else RECORD.size)


def _load(bucket: str, values: dict[str, bytes]) -> None:
    assert replica is not None
    items = [item(k.encode(), v, i + 1, 1_700_000_000_000_000_000) for i, (k, v) in enumerate(values.items())]
    replica.apply_items(bucket, items, BucketMeta(stream=f"KV_{bucket}", applied_seq=len(items), synced=True))


def setup() -> None:
    global native, native_resp, replica
    native_resp = native_module("resp")
    native = native_module("server_get")
    where = tempfile.mkdtemp(prefix="kvcache-fuzz-")
    replica = Replica(f"{where}/replica", map_size=4 * MiB)
    atexit.register(shutil.rmtree, where, ignore_errors=True)
    atexit.register(replica.close)
    _load("main", VALUES)
    _load("other", OTHER)
    feeds.update(main=Feed(), other=Feed(), later=Feed())
    cache = NearCache(replica, "other", max_keys=100)
    cache.offer_entry("c.v", b"c.v", b"cached", 5, NOW, 0)
    cache.offer_absent(b"c.none", 6)
    cache.offer_entry("c.ttl", b"c.ttl", b"gone", 7, NOW - 10_000_000_000, NOW - 9_000_000_000)
    feeds["other"].cache = cache
    CONNECTIONS.update({native: connection_class(native), twin: connection_class(twin)})


# One ServerGets per twin and setting, made on first use and kept: the native one keeps its
# read-only LMDB environment (and its file descriptor) open for the life of the process by
# design (ext/server_get.pyx: closing it would drop the writer's POSIX locks), so one made per
# input ran the process out of file descriptors after some 20,000 inputs.
_made: dict[tuple[ModuleType, bool], Any] = {}


def make(mod: ModuleType, direct: bool) -> Any:
    gets = _made.get((mod, direct))
    if gets is None:
        gets = _made[(mod, direct)] = mod.ServerGets(replica, Planner())
        if direct:
            gets.set_buckets([("main", feeds["main"], 1000, True), ("other", feeds["other"], 1000, False),
                              ("later", feeds["later"], 1000, True)], "main")
    return gets


def counts(gets: Any) -> tuple[dict, dict, int]:
    return gets.bucket_reads(), gets.cache_reads(), gets.cached


def counted(gets: Any, before: tuple[dict, dict, int]) -> tuple:
    """The reads counted per bucket and per near cache since `before` (buckets with none left
    out: the C twin lists every bucket it has seen), and the near-cache answers."""
    after = counts(gets)
    delta = []
    for now, then in zip(after[:2], before[:2], strict=True):
        diff = {k: tuple(a - b for a, b in zip(v, then.get(k, (0, 0)), strict=True)) for k, v in now.items()}
        delta.append({k: v for k, v in diff.items() if v != (0, 0)})
    return delta[0], delta[1], after[2] - before[2]


def generic_get(gets: Any, cmd: list[bytes], proto: int) -> tuple[bytes, int, int]:
    """The generic path's part here: a GET it is handed (a GET cut across reads, or spelled
    so that only the full parser may judge it) answered by `serve` when the replica may answer
    it, so that a GET's reply does not depend on where the reads cut it; else nothing."""
    if len(cmd) != 2 or cmd[0] != b"GET":
        return b"", 0, 0
    return gets.serve([GET_LEN[len(cmd[1])]], [cmd[1]], proto, 1 << 30)


def drive(gets: Any, reader_mod: ModuleType, chunks: list[bytes], proto: int, budget: int) -> tuple:
    """`answer` per chunk, and the generic path's turn for what it hands over."""
    gets.forget_fresh()
    before = counts(gets)
    reader = reader_mod.RequestReader()
    out, commands, answered, notfound = b"", [], 0, 0
    steps = 4 * sum(map(len, chunks)) + 16
    for chunk in chunks:
        replies, n, nf, more = gets.answer(reader, chunk, proto, budget)
        out, answered, notfound = out + replies, answered + n, notfound + nf
        while more:
            steps -= 1
            if steps < 0:
                raise AssertionError("the GET path makes no progress")
            try:
                cmd = reader.next_command()
            except ProtocolError as e:
                commands.append((Raised(f"{type(e).__module__}.{type(e).__qualname__}", str(e)), len(out)))
                return out, commands, answered, notfound, counted(gets, before)
            if cmd is None:
                break
            replies, n, nf = generic_get(gets, cmd, proto)
            if n:
                out, answered, notfound = out + replies, answered + n, notfound + nf
            else:
                commands.append((cmd, len(out)))
            replies, n, nf, more = gets.answer(reader, b"", proto, budget)
            out, answered, notfound = out + replies, answered + n, notfound + nf
    return out, commands, answered, notfound, counted(gets, before)


class Transport:
    """What GetConnection asks of an asyncio transport: the socket (large values are written to
    it directly while nothing waits in the transport), the size of what waits, and write()."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.written: list[bytes] = []

    def get_extra_info(self, name: str, default: object = None) -> object:
        return self.sock if name == "socket" else default

    def get_write_buffer_size(self) -> int:
        return sum(map(len, self.written))

    def write(self, data: bytes) -> None:
        self.written.append(bytes(data))


_RECEIVED = bytearray(1 << 20)


def receive(sock: socket.socket) -> bytes:
    """What the socket holds now (into one buffer: a fresh 1 MiB per recv is most of a run's
    time under ASan)."""
    out = b""
    while True:
        try:
            n = sock.recv_into(_RECEIVED)
        except BlockingIOError:
            return out
        if not n:
            return out
        out += _RECEIVED[:n]


def connection_class(mod: ModuleType) -> type:
    """A GetConnection of `mod` with the generic path's part here: what the fast path hands
    over (generic_get, or a marker naming the command or the protocol error), then the GETs
    after it."""

    class Conn(mod.GetConnection):  # type: ignore[name-defined,misc]
        def _process(self) -> None:
            while True:
                try:
                    cmd = self.reader.next_command()
                except ProtocolError as e:
                    self.transport.write(b"<protocol error: %s>" % str(e).encode())
                    self._closing = True
                    return
                if cmd is None:
                    return
                replies, n, nf = generic_get(self.gets, cmd, self.proto)
                if n:
                    self._count(n, nf)
                    self.transport.write(replies)
                else:
                    self.transport.write(b"<command %r>" % cmd)
                replies, n, nf, _ = self.gets.answer(self.reader, b"", self.proto, twin.FLUSH_AT)
                if n:
                    self._count(n, nf)
                if replies:
                    self.transport.write(replies)

    return Conn


def connection(gets: Any, conn_class: type, reader_mod: ModuleType, chunks: list[bytes], proto: int,
               sndbuf: int) -> tuple:
    """What a client receives from a GetConnection fed the chunks, and what it counted."""
    gets.forget_fresh()
    before = counts(gets)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        a.setblocking(False)
        b.setblocking(False)
        stats = Stats()
        conn = conn_class(gets, stats, reader_mod.RequestReader())
        conn.proto = proto
        transport = Transport(a)
        conn.transport = transport
        received = b""
        for chunk in chunks:
            conn.data_received(chunk)
            received += receive(b)
        tally = (stats.commands, stats.gets_local, stats.gets_cached, stats.gets_notfound, conn.last_cmd)
        return received + b"".join(transport.written), tally, counted(gets, before)
    finally:
        a.close()
        b.close()


def check(data: bytes) -> None:
    case = decode(data)
    proto = 3 if case.options & 1 else 2
    budget = BUDGETS[(case.options >> 1) & 3]
    direct = not case.options & 8
    stale = bool(case.options & 16)
    sndbuf = SNDBUF[case.choice(1, len(SNDBUF))]
    assert native is not None and native_resp is not None, "setup() first"
    readers = {native: native_resp, twin: twin_resp}
    # one ServerGets per twin for the input, fed whole and cut: the plans they cache are the
    # planner's, the verdicts are dropped and the counts taken as differences at each run
    gets = {native: make(native, direct), twin: make(twin, direct)}
    buckets = f"RESP{proto}, {'set_buckets' if direct else 'planner only'}, other {'stale' if stale else 'fresh'}"
    feeds["other"].fresh = not stale
    try:
        if case.options & 32:
            differential("server_get", case,
                         lambda mod, chunks: connection(gets[mod], CONNECTIONS[mod], readers[mod], chunks, proto,
                                                        sndbuf),
                         native, twin, allowed=(), same_whole_as_cut=lambda v: v if isinstance(v, Raised) else v[0],
                         settings=f"GetConnection, {buckets}, send buffer {sndbuf}")
        else:
            differential("server_get", case,
                         lambda mod, chunks: drive(gets[mod], readers[mod], chunks, proto, budget),
                         native, twin, allowed=(), same_whole_as_cut=lambda v: v if isinstance(v, Raised) else v[:2],
                         settings=f"answer, {buckets}, budget {budget}")
    finally:
        feeds["other"].fresh = True


def resp_get(key: str) -> bytes:
    k = key.encode()
    return b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k)


KEYS = [*VALUES, "missing", "main:a", "main:missing", "other:a", "other:only.here", "other:only.x", "later:x",
        "nope:a", ".bad", "x..y", "a.", "a:b:c", LONG + "x", "main:" + LONG, "other:c.v", "other:c.none",
        "other:c.ttl", "other:c.miss"]
OTHER_UNITS = [b"*1\r\n$4\r\nPING\r\n", b"PING\r\n", b"*2\r\n$3\r\nget\r\n$1\r\na\r\n",
               b"*2\r\n$3\r\nGET\r\n$2\r\na\r\n", b"*2\r\n$3\r\nGET\r\n$01\r\na\r\n",
               b"*3\r\n$3\r\nGET\r\n$1\r\na\r\n$1\r\nb\r\n",
               b"*3\r\n$4\r\nMGET\r\n$1\r\na\r\n$3\r\nbig\r\n", b"GET a\r\n"]


def seeds() -> list[bytes]:
    out = []
    for i, key in enumerate(KEYS):
        wire = resp_get(key) + resp_get(KEYS[(i * 7 + 3) % len(KEYS)]) + OTHER_UNITS[i % len(OTHER_UNITS)]
        out += [encode(wire, (i % 2) | ((i % 4) << 1)), encode(wire, 32 | (i % 2), bytes([i % 3, 20, 5])),
                encode(wire, 8 | 16, bytes([9, 1]))]
    for unit in OTHER_UNITS:
        out.append(encode(resp_get("a") + unit + resp_get("big") + resp_get("other:c.v"), 32, bytes([0, 2])))
    return out


DICTIONARY = [b"*2\r\n$3\r\nGET\r\n", b"\r\n", b"$1\r\n", b"$3\r\n", b"main:", b"other:", b"later:", b"only.",
              b"c.", b"c.v", b"c.none", b"c.ttl", b"big", b"nine", b"ten", b"empty", b"bin", b"MGET", b"PING", b"get",
              b"$01\r\n", b"..", b"long." + b"k" * 64]
