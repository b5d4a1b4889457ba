"""Checkers for the fault tests and the soak script (bench/soak.py): is the replica the
bucket, did any key's reads go back in time, how far behind does the replica run.

They only observe: the bucket through nats-py, the replica through its LMDB files
(kvcache.LocalReader) or the sidecar's socket (kvcache.AsyncClient). Nothing here knows how
the sidecar works inside, so a checker cannot agree with a bug by sharing its code.
"""
from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hiredis
import nats
import nats.errors
import nats.js.errors

from kvcache import LocalReader
from kvcache.app.client import AsyncClient, KvcacheError
from kvcache.app.reader import StaleReplica
from support.poll import until
from support.topology import SETTLING, settled

State = dict[str, tuple[bytes, int]]   # key -> (value, revision) of every live key


# ----------------------------------------------------------------------------- waiting

# SETTLING and settled (set-up calls retried while a replicated stream elects its leader)
# live with the cluster helpers, support.topology; imported here for the existing callers.


async def kill_stream_leader(js, cluster, stream: str):
    """SIGKILL the server leading `stream` and wait until another one leads it; returns the
    killed server, for the caller to start again."""
    leader = (await settled(lambda: js.stream_info(stream))).cluster.leader
    victim = cluster.server(leader)
    victim.kill()

    async def new_leader() -> bool:
        info = await settled(lambda: js.stream_info(stream))
        return info.cluster.leader not in (None, leader)
    await until(new_leader, 60, "a new stream leader")
    return victim


def new_bucket() -> str:
    return "t" + uuid.uuid4().hex[:10]


# ----------------------------------------------------------------------------- the sidecar's view

def bucket_info(sc, bucket: str) -> dict:
    """The sidecar's INFO `# Buckets` row for `bucket` (synced, keys, applied_seq, ...)."""
    return sc.buckets()[bucket]


async def wait_synced(sc, bucket: str, keys: int | None = None, timeout: float = 60.0) -> dict:
    """Until the sidecar reports `bucket` synced with no lag (and `keys` keys, if given)."""
    def ok():
        row = bucket_info(sc, bucket)
        if row["synced"] == 1 and row["lag_ms"] == 0 and (keys is None or row["keys"] == keys):
            return row
        return None
    return await until(ok, timeout, f"bucket {bucket} synced" + (f" with {keys} keys" if keys is not None else ""))


# ----------------------------------------------------------------------------- convergence

def replica_state(data_dir: str | Path, bucket: str) -> State:
    """key -> (value, revision), straight from a sidecar's LMDB files."""
    with LocalReader(str(data_dir), max_stale_ms=10**9, bucket=bucket) as r:
        out = {}
        for key in r.keys("*", bucket=bucket):
            e = r.entry(f"{bucket}:{key}")
            if e is not None:  # None: it expired between the listing and the read
                out[key] = (e.value, e.revision)
        return out


async def upstream_state(kv) -> State:
    """key -> (value, revision) of every live key, as the stream leader sees the bucket.

    Keys come from STREAM.INFO's per-subject state rather than nats-py's kv.keys(): keys()
    runs an ordered consumer, and right after a leader change it can end early with a
    partial list (seen in CI), which would make a correct replica look wrong."""
    async def read() -> State:
        info = await kv._js.stream_info(kv._stream, subjects_filter=f"{kv._pre}>")
        out = {}
        for subject in (info.state.subjects or {}):
            key = subject[len(kv._pre):]
            try:
                e = await kv.get(key)
            except nats.js.errors.KeyNotFoundError:  # deleted or purged: its marker is the last message
                continue
            out[key] = (e.value or b"", e.revision)
        return out
    return await settled(read)


@dataclass
class Differences:
    """How a replica differs from its bucket: keys only it has, keys it lacks, keys whose
    value or revision differ (a few of each named)."""

    extra: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    differ: list[str] = field(default_factory=list)

    @classmethod
    def between(cls, want: State, have: State) -> Differences:
        return cls(sorted(set(have) - set(want)), sorted(set(want) - set(have)),
                   sorted(k for k in set(want) & set(have) if want[k] != have[k]))

    @property
    def count(self) -> int:
        return len(self.extra) + len(self.missing) + len(self.differ)

    def __str__(self) -> str:
        return (f"{self.count} differences: extra {self.extra[:10]}, missing {self.missing[:10]}, "
                f"differ {self.differ[:10]}")


async def differences(data_dir: str | Path, kv, bucket: str, timeout: float = 30.0) -> Differences:
    """Wait (up to `timeout`) for the replica to equal the bucket; the differences left then
    (none when it converged). The bucket is read again while waiting: writes may still land."""
    diff = Differences()
    deadline = time.monotonic() + timeout
    while True:
        want = await upstream_state(kv)
        try:
            diff = Differences.between(want, replica_state(data_dir, bucket))
        except StaleReplica:  # a resync under way (synced=0): not there yet
            if time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.1)
            continue
        if not diff.count or time.monotonic() >= deadline:
            return diff
        await asyncio.sleep(0.1)


async def converged(sc, kv, bucket: str, timeout: float = 30.0) -> State:
    """Until the replica of sidecar `sc` equals the bucket (keys, values and revisions);
    the bucket's state. Fails with the differences and the sidecar's log."""
    diff = await differences(sc.data_dir, kv, bucket, timeout)
    if diff.count:
        raise AssertionError(f"replica of {bucket} != upstream: {diff}\n{sc.log()}")
    return await upstream_state(kv)


# ----------------------------------------------------------------------------- monotonic reads

@dataclass
class Regression:
    key: str
    before: int     # the highest revision read before
    after: int      # the lower one read later
    at: float       # seconds since the reader started
    command: str = ""   # the read that went back (MixedReads)


class MonotonicReads:
    """Reads keys through the sidecar (`KV.GET`, as an application would) in a loop, with
    `clients` connections at once, and records every key whose revision went down: a cache
    must never serve a key older than it served it before. A not-found after a value is not
    counted (the key may have been deleted); an older value after it is.

        async with MonotonicReads(sc.socket, keys) as reads:
            ...inject a fault...
        assert not reads.regressions
    """

    def __init__(self, socket: str, keys: Iterable[str], clients: int = 2, pause_s: float = 0.0,
                 timeout: float = 5.0) -> None:
        self.socket = socket
        self.keys = list(keys)
        self.clients = clients
        self.pause_s = pause_s
        self.timeout = timeout
        self.highest: dict[str, int] = {}
        self.regressions: list[Regression] = []
        self.reads = 0
        self.failed = 0
        self.errors: dict[str, int] = {}
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._t0 = 0.0

    async def __aenter__(self) -> MonotonicReads:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._tasks = [asyncio.create_task(self._run(i)) for i in range(self.clients)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    def observe(self, key: str, revision: int | None) -> None:
        """One answer: a revision, or None for not found."""
        self.reads += 1
        if revision is None:
            return
        high = self.highest.get(key, 0)
        if revision < high:
            self.regressions.append(Regression(key, high, revision, time.monotonic() - self._t0))
        else:
            self.highest[key] = revision

    async def _run(self, n: int) -> None:
        client = AsyncClient(self.socket, timeout=self.timeout)
        i = n
        try:
            while not self._stop.is_set():
                key = self.keys[i % len(self.keys)]
                i += self.clients
                try:
                    e = await client.entry(key)
                except (KvcacheError, OSError) as exc:
                    self.failed += 1
                    name = type(exc).__name__
                    self.errors[name] = self.errors.get(name, 0) + 1
                    await asyncio.sleep(0.01)  # the sidecar may be down: don't spin
                    continue
                self.observe(key, e.revision if e is not None else None)
                if self.pause_s:
                    await asyncio.sleep(self.pause_s)
                elif i % 64 < self.clients:
                    await asyncio.sleep(0)  # let the fault injector and the writers run
        finally:
            await client.aclose()

    def summary(self) -> str:
        return (f"{self.reads} reads, {self.failed} failed {self.errors or ''}, "
                f"{len(self.regressions)} regressions {self.regressions[:5] or ''}")


# ----------------------------------------------------------------------------- mixed reads

class CounterWriter:
    """Puts to each of `keys` in a loop of its own, about `rate` writes/s in all, until
    stopped or `limit` writes. A key's value is its own write counter (b"0", b"1", ...) and
    its puts are awaited one after the other, so a higher value of a key is a later revision:
    a read that answers only the value (GET, MGET) still says how new it is. A failed put (an
    election, NATS down) is counted and tried again with the same counter, never raised."""

    def __init__(self, kv, keys: Iterable[str], rate: float = 2000.0, limit: int = 1_000_000) -> None:
        self.kv = kv
        self.keys = list(keys)
        self.rate = rate
        self.limit = limit
        self.ok = self.failed = 0
        self.next: dict[str, int] = {k: 0 for k in self.keys}  # each key's next counter
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._t0 = self._t1 = 0.0

    async def prime(self) -> None:
        """Write counter 0 of every key (so that the keys exist before anyone reads)."""
        for key in self.keys:
            await settled(lambda key=key: self.kv.put(key, b"0"))
            self.next[key] = 1

    def start(self) -> CounterWriter:
        self._t0 = time.monotonic()
        self._tasks = [asyncio.create_task(self._run(k)) for k in self.keys]
        return self

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        self._t1 = self._t1 or time.monotonic()

    @property
    def achieved(self) -> float:
        """Writes/s over the run (until stop)."""
        return self.ok / max((self._t1 or time.monotonic()) - self._t0, 1e-9)

    async def _run(self, key: str) -> None:
        per_key = self.rate / len(self.keys)
        t0, n = time.monotonic(), 0
        while not self._stop.is_set() and self.ok < self.limit:
            delay = t0 + n / per_key - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            elif delay < -0.1:  # fell behind (an election): go on at the rate, no burst
                t0 = time.monotonic() - n / per_key
            try:
                await self.kv.put(key, b"%d" % self.next[key])
            except (TimeoutError, nats.errors.Error, *SETTLING):
                self.failed += 1
                await asyncio.sleep(0.05)
                continue
            self.next[key] += 1
            self.ok += 1
            n += 1
        self._t1 = self._t1 or time.monotonic()


# What MixedReads sends, with weights: every way an application reads a key.
READ_MIX = (("strong", 25), ("minrev", 15), ("kv.get", 20), ("get", 25), ("mget", 10), ("exists", 5))


def _resp_command(args: list[bytes]) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


class MixedReads:
    """Reads `keys` through the sidecar's socket every way an application can, mixed on every
    connection: `KV.GET k CONSISTENCY strong`, `KV.GET k MINREV r` (r: the highest revision of
    k read so far), plain `KV.GET k`, `GET k`, `MGET` and `EXISTS`, `batch` requests pipelined
    at a time on each of `clients` connections, until `reads` reads (or `seconds`, a guard
    against a hang). Values are per-key write counters (CounterWriter), never deleted keys.

    A read goes back in time when it answers a key below what an already completed read
    answered: one whose reply this checker had processed before it sent the request (on any
    connection), or one sent before it on the same connection (the sidecar answers each
    connection's requests one after the other). Reads in flight together are not compared:
    either order is right for them. A value missing (nil, EXISTS 0) is counted apart: these
    keys exist throughout. Error replies are counted, not judged (an election, say).

        reads = MixedReads(sc.socket, keys)
        await reads.run()
        assert not reads.regressions
    """

    def __init__(self, socket: str, keys: Iterable[str], clients: int = 4, batch: int = 16,
                 reads: int = 100_000, seconds: float = 240.0, timeout: float = 30.0,
                 seed: int = 12) -> None:
        self.socket = socket
        self.keys = [k.encode() for k in keys]
        self.clients = clients
        self.batch = batch
        self.target = reads
        self.seconds = seconds
        self.timeout = timeout
        self.seed = seed
        self.high: dict[bytes, int] = {}   # key -> highest counter of the completed reads
        self.rev: dict[bytes, int] = {}    # key -> highest revision a KV.GET answered
        self.regressions: list[Regression] = []
        self.reads = 0                     # commands answered without an error
        self.values = 0                    # key values checked (an MGET checks several)
        self.missing = 0
        self.failed = 0
        self.errors: dict[str, int] = {}
        self.commands: dict[str, int] = {}
        self._stop = asyncio.Event()
        self._t0 = 0.0

    def stop(self) -> None:
        """End the run early (after the batches in flight)."""
        self._stop.set()

    async def run(self) -> MixedReads:
        self._t0 = time.monotonic()
        await asyncio.gather(*(self._client(i) for i in range(self.clients)))
        return self

    def _done(self) -> bool:
        return (self._stop.is_set() or self.reads + self.failed >= self.target
                or time.monotonic() - self._t0 >= self.seconds)

    def _command(self, rng, prev: bytes) -> tuple[str, list[bytes], list[bytes]]:
        """(kind, keys read, RESP arguments); half the time the key just read again, so that
        a strong read is often followed by a local one of the same key."""
        kind = rng.choices([k for k, _ in READ_MIX], [w for _, w in READ_MIX])[0]
        key = prev if rng.random() < 0.5 else rng.choice(self.keys)
        if kind == "strong":
            return kind, [key], [b"KV.GET", key, b"CONSISTENCY", b"strong"]
        if kind == "minrev" and key in self.rev:
            return kind, [key], [b"KV.GET", key, b"MINREV", b"%d" % self.rev[key]]
        if kind in ("minrev", "kv.get"):
            return "kv.get", [key], [b"KV.GET", key]
        if kind == "get":
            return kind, [key], [b"GET", key]
        keys = [key, *rng.sample(self.keys, min(2, len(self.keys)))]
        return kind, keys, [kind.upper().encode(), *keys]

    async def _client(self, n: int) -> None:
        rng = random.Random(self.seed * 1000 + n)
        reader, writer = await asyncio.open_unix_connection(self.socket)
        parser = hiredis.Reader()
        prev = self.keys[n % len(self.keys)]
        try:
            while not self._done():
                cmds = []
                for _ in range(self.batch):
                    cmds.append(self._command(rng, prev))
                    prev = cmds[-1][1][0]
                floor = dict(self.high)  # what completed reads answered, as these leave
                writer.write(b"".join(_resp_command(args) for _, _, args in cmds))
                replies: list = []
                while len(replies) < len(cmds):
                    data = await asyncio.wait_for(reader.read(1 << 16), self.timeout)
                    if not data:
                        raise ConnectionError("the sidecar closed the connection")
                    parser.feed(data)
                    while (reply := parser.gets()) is not False:
                        replies.append(reply)
                for (kind, keys, _), reply in zip(cmds, replies, strict=True):
                    self._check(kind, keys, reply, floor)
        finally:
            writer.close()

    def _check(self, kind: str, keys: list[bytes], reply: Any, floor: dict[bytes, int]) -> None:
        self.commands[kind] = self.commands.get(kind, 0) + 1
        if isinstance(reply, hiredis.ReplyError):
            self.failed += 1
            what = str(reply)[:80]
            self.errors[what] = self.errors.get(what, 0) + 1
            return
        self.reads += 1
        if kind == "exists":
            self.missing += len(keys) - reply
            return
        if kind == "mget":
            values = reply
        elif kind == "get":
            values = [reply]
        else:  # KV.GET: [value, revision, created, operation, source]
            values = [reply[0] if reply else None]
            if reply and reply[1] > self.rev.get(keys[0], 0):
                self.rev[keys[0]] = reply[1]
        for key, value in zip(keys, values, strict=True):
            self.values += 1
            if value is None:
                self.missing += 1
                continue
            counter = int(value)
            if counter < floor.get(key, 0):
                self.regressions.append(Regression(key.decode(), floor[key], counter,
                                                   time.monotonic() - self._t0, kind))
            else:
                floor[key] = counter
            if counter > self.high.get(key, -1):
                self.high[key] = counter

    def summary(self) -> str:
        return (f"{self.reads} reads ({self.values} values; {self.commands}), {self.failed} failed "
                f"{self.errors or ''}, {self.missing} missing, {len(self.regressions)} regressions "
                f"{self.regressions[:5] or ''}")


# ----------------------------------------------------------------------------- staleness

LAG_POLL_S = 0.0002   # a polite poll: a busy one would take the CPU the sidecar needs (2 cores)


def percentile(samples: list[float], p: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))] if s else float("nan")


@dataclass
class Lag:
    """Replication lag samples (seconds): from a write's publish to the sidecar serving it."""

    samples: list[float] = field(default_factory=list)
    writes: int = 0
    unseen: int = 0          # writes never seen served before the probe ended
    failed_writes: int = 0
    sent: list[float] = field(default_factory=list, repr=False)   # time.monotonic() of write i
    rate: float = 0.0        # writes/s achieved

    def p(self, q: float) -> float:
        return percentile(self.samples, q)

    def __str__(self) -> str:
        return (f"{self.writes} writes at {self.rate:.0f}/s: lag p50 {self.p(50) * 1e3:.2f} ms, "
                f"p99 {self.p(99) * 1e3:.2f} ms, max {max(self.samples, default=0) * 1e3:.2f} ms, "
                f"{self.unseen} unseen, {self.failed_writes} failed writes")


async def lag_probe(js, bucket: str, socket: str, rate: float = 1000.0, seconds: float = 5.0,
                    key: str = "lag.probe", settle_s: float = 5.0) -> Lag:
    """Writes `key` at `rate` writes/s for `seconds` (each publish timed; acks awaited in the
    background, so a slow ack never slows the schedule) while polling the sidecar's `KV.GET`
    of it every LAG_POLL_S. Write i's value is i, and one connection publishes them in
    order, so serving value i means writes 0..i are applied: the lag of write i is when a
    value >= i was first served minus when i was published. The poll's period and round trip
    (~0.3-0.5 ms together) bound the resolution. Bounded: `seconds` of writes, then at most `settle_s`."""
    subject = f"$KV.{bucket}.{key}"
    lag = Lag()
    sent = lag.sent
    done_writing = asyncio.Event()
    acks: set[asyncio.Task] = set()

    async def ack(fut) -> None:
        try:
            await fut
        except (TimeoutError, nats.errors.Error):
            lag.failed_writes += 1

    async def writer() -> None:
        t0 = time.monotonic()
        n = int(rate * seconds)
        for i in range(n):
            due = t0 + i / rate
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            sent.append(time.monotonic())
            fut = js.publish(subject, b"%d" % i)
            t = asyncio.ensure_future(ack(fut))
            acks.add(t)
            t.add_done_callback(acks.discard)
        lag.rate = n / max(time.monotonic() - t0, 1e-9)
        lag.writes = n
        await asyncio.gather(*list(acks))
        done_writing.set()

    async def poller() -> None:
        client = AsyncClient(socket, timeout=5)
        seen_upto = 0                       # writes [0, seen_upto) have a lag
        deadline = None
        try:
            while True:
                try:
                    e = await client.entry(key)
                except KvcacheError:
                    e = None
                now = time.monotonic()
                if e is not None and e.value is not None:
                    served = int(e.value)
                    while seen_upto <= served and seen_upto < len(sent):
                        lag.samples.append(now - sent[seen_upto])
                        seen_upto += 1
                if done_writing.is_set():
                    if seen_upto >= lag.writes:
                        break
                    deadline = deadline or now + settle_s
                    if now >= deadline:
                        break
                await asyncio.sleep(LAG_POLL_S)
        finally:
            lag.unseen = max(0, lag.writes - seen_upto)
            await client.aclose()

    await asyncio.gather(writer(), poller())
    return lag
