"""The server's per-request GET path: a run of pipelined GETs answered from the replica.

Pure-Python twin of ext/server_get.pyx (same API, same replies). The server hands over what
`RequestReader.take_gets()` cut from a client's buffer; `serve()` answers GETs in order, in
one LMDB read transaction, until one cannot be answered locally (a key that is invalid, remote
or in a replica that is not fresh enough: the generic path answers that one) or the replies
reach the byte budget (the server writes them out first, then calls again).

    gets = ServerGets(replica, planner)
    replies, answered, notfound = gets.serve(lengths, keys, proto, budget)
    replies, answered, notfound, more = gets.answer(reader, data, proto, budget)

`GetConnection` is the part of the server's connection that runs on every socket read: its
`data_received` answers GET-only reads with one `answer` call and hands anything else to the
subclass's `_process` (kvcache.serve.client_connection.ClientConnection). In C it is one call from uvloop to the reply.

`answer` is the server's whole per-read step for GET-only traffic: feed the bytes to the
request reader, then cut and serve GET runs until the buffer is empty (more=False), or
something other than an answerable GET is next or the budget is reached (more=True: the
server's generic loop takes over from there).

`planner(key)` says how to read a raw key locally: a kvcache.read.policy.Plan, or False when
the generic path must answer it. A valid key of a bucket that replicates every key (see
set_buckets) needs no planner: its plan is worked out from the key itself, with no per-key
state, so reading over a million keys costs what reading over ten thousand does. Other keys'
plans are cached (a bounded dict, policy.PLAN_CACHE, for filtered buckets and keys the
generic path answers). A key outside the filters of a bucket with a near cache is planned onto
the cache's database (Plan.cache): a cached value or not-found is answered here like a
replica's record, its hit handed to the cache's counter (NearCache.counter: the cache's
own bookkeeping, one batch per call here, one C call per hit in the C twin), and a key not
cached or expired goes to the generic path. A bucket that
replicates no key and has a near cache is planned like one that replicates every key: all its
valid keys onto the cache. Freshness
(`witness.fresh_for_all(max_stale_ms)`: the read side's one rule, kvcache.store.verdict, for
every key of the bucket at once: fresh within the bound and no key held) is asked at most
once per bucket per call, and a yes is believed for FRESH_VERDICT_S. The decisions are the read
policy's (kvcache.read.policy): its plan, the witness's verdict, and the record read the one way
every local read reads it (record.stored_value).
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import time
from bisect import bisect_left
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, cast

from ..keys import RESERVED_PREFIX, TOKEN_CHARS
from ..ops.latency import BOUNDS_NS
from ..read.policy import PLAN_CACHE, Plan
from ..resp import GET_LEN, NIL2, NIL3
from ..store.nearcache import is_absent
from ..store.record import MAX_LMDB_KEY, RECORD, stored_value
from ..store.replica import Replica

if TYPE_CHECKING:
    from ..resp import RequestReader
    from ..stats import Stats
    from ..store.near_hits import HitCounter

FLUSH_AT = 256 * 1024  # write out what a batch has answered once it is this big
# A value of at least this many bytes, answered while its connection's output is empty, is
# written to the socket from the map with the replies around it (one writev) instead of being
# copied into the output; at most MAXSEG of them a call (ext/server_get_write.pxi says why)
LARGE_VALUE = 4096
MAXSEG = 64
# A reply of SNDBUF_FROM bytes or more, about to be written with its values from the map,
# first raises its socket's send buffer to hold it whole, up to SNDBUF_MAX (Linux caps it at
# net.core.wmem_max and books twice the size set). Past the default buffer (about 208 KiB on
# Linux) the rest of a reply is copied into the output and waits for a writable event: for a
# 512 KiB value that copy and the second write were a third of the server's CPU per GET
# (bench/socket_bench.py --sizes). The buffer is a limit, not an allocation: the kernel holds
# only what the client has not read, and a client that stops reading is cut off after
# client_write_stall_ms as before (docs/architecture.md, "Large values").
SNDBUF_FROM = 128 << 10
SNDBUF_MAX = 1 << 20
# How long a bucket's "fresh enough" verdict is reused. The bound a read promises is
# max_stale_ms (seconds, typically); reusing the answer for a millisecond saves a Python
# call per batch, which at one GET a batch is a good part of the request's cost.
FRESH_VERDICT_S = 0.001
BULK_HEADER = [b"$%d\r\n" % n for n in range(10_000)]

_monotonic = time.monotonic
_monotonic_ns = time.monotonic_ns
GET_CMD = b"get"  # CLIENT LIST's cmd after GETs this path answered

Planner = Callable[[bytes], "Plan | Literal[False]"]
# kvcache.keys.readable_key over bytes (KEY_RE, not starting with the reserved `_kv`), at most
# MAX_LMDB_KEY long (a longer key is stored under a digest: the planner handles it); the C
# twin is server_get.pyx's _kv_key
_DIRECT_KEY = re.compile(rb"(?!%s)[%s]+(?:\.[%s]+)*" % (
    RESERVED_PREFIX.encode(), TOKEN_CHARS.encode(), TOKEN_CHARS.encode()))


class ServerGets:
    """The server's GET fast path over the replica (twin of ext/server_get.pyx): answers runs
    of pipelined GETs from plans (kvcache.read.policy.Plan) in one read transaction."""

    def __init__(self, replica: Replica, planner: Planner, writer_here: bool = True) -> None:
        self.replica = replica
        self.planner = planner
        # how long a witness's yes is believed: a worker process (no writer here) asks every
        # batch, the feed's process changing the verdict at any moment (kvcache.supervisors.board)
        self._verdict_s = FRESH_VERDICT_S if writer_here else 0.0
        self.plans: dict[bytes, Plan | Literal[False]] = {}
        # Large values written from the map (LARGE_VALUE): the connection's socket and transport
        # while GetConnection's call runs (-1: copy every value into the output)
        self._fd = -1
        self._transport: asyncio.Transport | None = None
        self._last_size = 0  # the last serve's output, written directly or not
        self._fresh_until: dict[object, float] = {}  # witness -> monotonic time
        # The native path defers GET-only reads of many clients to the end of an event-loop
        # iteration (ext/server_get.pyx, _stash); this one answers each read at once: `defer`
        # and `call_soon` are taken and unused, `flush` has nothing to do.
        self.defer = False
        self.call_soon: Callable | None = None
        # set_buckets: `name` -> the plan of the buckets that replicate every key, less its key
        self._direct: dict[bytes, Plan] = {}
        self._default: Plan | None = None
        self._reads: dict[str, list[int]] = {}  # bucket -> [found, not found] (bucket_reads)
        self._cache_reads: dict[str, list[int]] = {}  # the same of near caches (cache_reads)
        # Near-cache answers (hits and cached not-founds) not yet counted by the connection
        # (GetConnection._count moves them from gets_local to gets_cached)
        self.cached = 0
        # the latency histogram (kvcache.ops.latency), kept while `timed` (the metrics listener is on)
        self.timed = False
        self._lat = [0] * (len(BOUNDS_NS) + 1)
        self._lat_sum_ns = 0

    def observe(self, ns: int, n: int) -> None:
        """n GETs answered together in ns (kvcache.ops.latency)."""
        self._lat[bisect_left(BOUNDS_NS, ns)] += n
        self._lat_sum_ns += ns * n

    def latency(self) -> tuple[list[int], int]:
        """The fast path's histogram: counts per bucket of kvcache.ops.latency.BOUNDS_NS (+Inf
        last), and their sum, ns."""
        return list(self._lat), self._lat_sum_ns

    def bucket_reads(self) -> dict[str, tuple[int, int]]:
        """GETs this path answered from the replica per bucket, `(found, not found)`, since
        start: the local reads the command layer never sees, which kvcache.ops.metrics adds to
        its own count."""
        return {name: (c[0], c[1]) for name, c in self._reads.items()}

    def cache_reads(self) -> dict[str, tuple[int, int]]:
        """The same for the GETs this path answered from a bucket's near cache."""
        return {name: (c[0], c[1]) for name, c in self._cache_reads.items()}

    def forget_fresh(self) -> None:
        """Drop every cached "fresh enough" verdict: the next GET of each bucket asks again.
        The ledger asks for this when a key becomes held (Holds.on_hold): a verdict reused for
        FRESH_VERDICT_S would answer that key from the replica, below a revision already
        handed out from NATS."""
        self._fresh_until.clear()

    def flush(self) -> None:
        """Nothing deferred here (see __init__)."""

    def set_buckets(self, buckets: list[tuple], default: str | None) -> None:
        """`[(name, witness, max_stale_ms, replicates_every_key[, near_cache])]` and the default
        bucket's name (None: no default); `near_cache` for a bucket that replicates no key and
        has a near cache (every key is planned onto it). A valid key of a bucket that
        replicates every key, or of such a bucket, is then read without asking the planner:
        the same plan the planner would make, worked out from the key. Call it only when the
        planner would plan such keys (not with the access log on, where every GET must reach
        the command layer)."""
        self._direct = {}
        for name, witness, max_stale, every, *rest in buckets:
            cache = rest[0] if rest else None
            if cache is not None:
                self._direct[name.encode()] = Plan(witness, max_stale, name, b"", cache.db, RECORD.size, cache,
                                                   replicated=False)
            elif every:
                self._direct[name.encode()] = Plan(witness, max_stale, name, b"", self.replica.db(name), RECORD.size)
        self._default = self._direct.get(default.encode()) if default is not None else None
        self.plans.clear()

    def _direct_plan(self, key: bytes) -> Plan | None:
        """The plan of a valid key of a bucket that replicates every key (or none, with a near
        cache); None otherwise."""
        bucket, sep, name = key.partition(b":")
        target = self._direct.get(bucket) if sep else self._default
        if target is None or target.db is None:  # (no database yet: the planner's to judge)
            return None
        if not sep:
            name = key
        if len(name) > MAX_LMDB_KEY or _DIRECT_KEY.fullmatch(name) is None:
            return None
        return target._replace(lkey=name)

    def _plan(self, key: bytes) -> Plan | Literal[False]:
        plan = self.planner(key)
        if len(self.plans) >= PLAN_CACHE:
            self.plans.clear()
        self.plans[key] = plan
        return plan

    def answer(self, reader, data: bytes, proto: int, budget: int) -> tuple[bytes, int, int, bool]:
        reader.feed(data)
        out: list[bytes] = []
        size = answered = notfound = 0
        while True:
            run = reader.take_gets()
            if run is None:
                break
            lengths, keys, start = run
            replies, n, nf = self.serve(lengths, keys, proto, budget - size)
            if replies:
                out.append(replies)
                self._fd = -1  # replies wait in `out`: no later one may go out before them
            size += self._last_size
            answered += n
            notfound += nf
            if n < len(keys):
                reader.rewind_gets(start, lengths, keys, n)
                return b"".join(out), answered, notfound, True
            if size >= budget:
                break
        return b"".join(out), answered, notfound, reader.buffered > 0

    def serve(self, lengths: list, keys: list, proto: int, budget: int) -> tuple[bytes, int, int]:
        """Replies for the longest answerable prefix of the run: (bytes, answered, not found)."""
        out: list[bytes] = []
        append = out.append
        plans = self.plans
        nil = NIL3 if proto == 3 else NIL2
        size = answered = notfound = 0
        fresh = txn = None
        direct = -1 if self._fd >= 0 else 0  # may values be written from the map? (-1: ask)
        large = 0
        hits: dict[HitCounter, list[bytes]] | None = None  # near-cache hits, handed over at the end
        try:
            for declared, key in zip(lengths, keys, strict=True):
                if declared != GET_LEN[len(key)]:
                    break  # a length the full parser must judge
                plan: Plan | Literal[False] | None = self._direct_plan(key) if self._direct else None
                if plan is None:
                    plan = plans.get(key)
                if plan is None:
                    plan = self._plan(key)
                    if txn is not None:  # the plan may have created its database: a
                        txn.abort()      # transaction begun before could not see it
                        txn = None
                if not plan:
                    break
                witness = plan.witness
                max_age = witness.max_age_ns
                if witness is not fresh:
                    now = _monotonic()
                    if self._fresh_until.get(witness, 0.0) <= now:
                        if not witness.fresh_for_all(plan.max_stale_ms):
                            break
                        self._fresh_until[witness] = now + self._verdict_s
                    fresh = witness
                if txn is None:
                    txn = self.replica.env.begin()
                raw = txn.get(plan.lkey, None, plan.db)
                cache = plan.cache
                bucket = plan.bucket
                if cache is None:
                    value = None if raw is None else stored_value(raw, plan.offset, max_age)
                    reads = self._reads
                else:  # the near cache's record: a miss or an expired one is the generic path's
                    if raw is None:
                        break
                    if is_absent(raw):
                        value = None
                    else:
                        value = stored_value(raw, plan.offset, max_age)
                        if value is None:
                            break
                    if hits is None:
                        hits = {}
                    lkeys = hits.get(cache.counter)
                    if lkeys is None:
                        lkeys = hits[cache.counter] = []
                    lkeys.append(plan.lkey)
                    self.cached += 1
                    reads = self._cache_reads
                answered += 1
                counts = reads.get(bucket)
                if counts is None:
                    counts = reads[bucket] = [0, 0]
                counts[value is None] += 1
                if value is None:
                    notfound += 1
                    append(nil)
                    size += len(nil)
                else:
                    n = len(value)
                    header = BULK_HEADER[n] if n < 10_000 else b"$%d\r\n" % n
                    if n >= LARGE_VALUE and direct and large < MAXSEG:
                        if direct < 0:
                            direct = 1 if self._transport.get_write_buffer_size() == 0 else 0  # type: ignore[union-attr]
                        large += direct
                    append(header)
                    append(value)
                    append(b"\r\n")
                    size += len(header) + n + 2
                if size >= budget:
                    break
            self._last_size = size
            if large and size >= SNDBUF_FROM:
                fit_send_buffer(self._transport, size)
            replies = _write_out(self._fd, out) if large else b"".join(out)
        finally:
            if txn is not None:
                txn.abort()
            if hits is not None:  # each cache counts its own (kvcache.store.near_hits)
                for counter, lkeys in hits.items():
                    counter.take(lkeys)
        return replies, answered, notfound


def _write_out(fd: int, parts: list[bytes]) -> bytes:
    """The C twin's _take_output (ext/server_get_write.pxi): write the replies to the socket
    (writev, while the read transaction holds the values) and return what it did not take."""
    sent = 0
    try:
        for start in range(0, len(parts), 512):
            chunk = parts[start:start + 512]
            n = os.writev(fd, chunk)
            sent += n
            if n < sum(map(len, chunk)):
                break
    except (BlockingIOError, InterruptedError):
        pass
    except OSError:
        pass  # the transport meets the error with the rest, and reports it
    return b"".join(parts)[sent:]


def fit_send_buffer(transport: asyncio.BaseTransport | None, need: int) -> None:
    """Raise the transport's socket send buffer to `need` bytes, at most SNDBUF_MAX (see
    there); never lowers it. The C twin is _fit_sndbuf (ext/server_get_write.pxi)."""
    sock = None if transport is None else transport.get_extra_info("socket")
    if sock is None:
        return
    want = min(need, SNDBUF_MAX)
    with contextlib.suppress(OSError):
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 2 < want:  # Linux reports 2x
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, want)


def _socket_fd(transport: asyncio.BaseTransport | None) -> int:
    """The transport's socket descriptor, -1 without one (a value is then always copied)."""
    sock = None if transport is None else transport.get_extra_info("socket")
    return -1 if sock is None else sock.fileno()


class GetConnection:
    """Per-connection state of the hot path; kvcache.serve.client_connection.ClientConnection adds the rest."""

    __slots__ = (
        "_busy",
        "_closing",
        "_draining",
        "_eof",
        "_fd",
        "_last_io",
        "_muted",
        "_paused_writing",
        "_transport",
        "gets",
        "last_cmd",
        "proto",
        "reader",
        "stats",
    )

    def __init__(self, gets: ServerGets, stats: Stats, reader: RequestReader) -> None:
        self.gets = gets
        self.stats = stats            # the server's Stats: commands, gets_local, gets_notfound
        self.reader = reader
        self._transport: asyncio.Transport = cast("asyncio.Transport", None)  # connection_made sets it
        self._fd = -1
        self.proto = 2
        self._busy: asyncio.Future[bytes] | None = None
        self._closing = False         # no more requests: QUIT, protocol error, connection lost
        self._paused_writing = False  # the client is not reading: neither do we
        self._eof = False             # the client half-closed: answer what it sent, then close
        self._draining = False        # shutting down: finish the request in flight, then close
        # CLIENT REPLY OFF or SKIP in force: replies are dropped per command, which only the
        # generic loop (_process) counts, so this path answers nothing itself meanwhile
        self._muted = False
        # CLIENT LIST's idle and cmd: when the client last sent anything (monotonic ns), and
        # the last command run (GET here; the generic path sets the others)
        self._last_io = _monotonic_ns()
        self.last_cmd: bytes | None = None

    @property
    def transport(self) -> asyncio.Transport:
        return self._transport

    @transport.setter
    def transport(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._fd = _socket_fd(transport)

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        self._last_io = _monotonic_ns()
        if self._busy is not None or self._paused_writing or self._draining:
            self.reader.feed(data)
            return
        if self._muted:
            self.reader.feed(data)
            self._process()
            return
        t0 = time.monotonic_ns() if self.gets.timed else 0
        gets = self.gets
        gets._fd, gets._transport = self._fd, self._transport
        try:
            replies, local, notfound, more = gets.answer(self.reader, data, self.proto, FLUSH_AT)
        finally:
            gets._fd, gets._transport = -1, None
        if local:
            self._count(local, notfound)
            self.last_cmd = GET_CMD
        if replies:
            self.transport.write(replies)
        if t0 and local:
            self.gets.observe(time.monotonic_ns() - t0, local)
        if more:
            self._process()

    def _count(self, local: int, notfound: int) -> None:
        stats = self.stats
        cached, self.gets.cached = self.gets.cached, 0
        stats.commands += local
        stats.gets_local += local - cached
        stats.gets_cached += cached
        stats.gets_notfound += notfound

    def _process(self) -> None:
        raise NotImplementedError  # the generic request loop: kvcache.serve.client_connection.ClientConnection
