"""Checkers for the fault tests and the soak script (bench/soak.py): is the replica the
bucket, did any key's reads go back in time, how far behind does the replica run.

They only observe: the bucket through nats-py, the replica through its LMDB files
(kvcache.LocalReader) or the sidecar's socket (kvcache.AsyncClient). Nothing here knows how
the sidecar works inside, so a checker cannot agree with a bug by sharing its code.
"""
from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import nats
import nats.errors
import nats.js.errors

from kvcache import LocalReader
from kvcache.client import AsyncClient, KvcacheError

State = dict[str, tuple[bytes, int]]   # key -> (value, revision) of every live key


# ----------------------------------------------------------------------------- waiting

async def until(pred: Callable[[], Any], timeout: float = 30.0, what: str = "condition",
                interval: float = 0.05) -> Any:
    """Poll `pred` (sync or async) until it returns something truthy; fail at the deadline."""
    deadline = time.monotonic() + timeout
    last: Any = None
    err: BaseException | None = None
    while True:
        try:
            last = pred()
            if inspect.isawaitable(last):
                last = await last
            if last:
                return last
            err = None
        except Exception as e:  # noqa: BLE001 - reported at the deadline
            err = e
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}; "
                                 f"last value {last!r}, last error {err!r}")
        await asyncio.sleep(interval)


# What JetStream answers while a clustered stream is being created or elects a new leader.
SETTLING = (nats.errors.NoRespondersError, nats.errors.TimeoutError,
            nats.js.errors.NoStreamResponseError, nats.js.errors.ServiceUnavailableError)


async def settled(call, timeout: float = 60.0):
    """`call()` retried while JetStream is settling (an R3 stream electing a leader)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await call()
        except SETTLING:
            if time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.2)


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
    def between(cls, want: State, have: State) -> "Differences":
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
        diff = Differences.between(want, replica_state(data_dir, bucket))
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

    async def __aenter__(self) -> "MonotonicReads":
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


# ----------------------------------------------------------------------------- staleness

LAG_POLL_S = 0.0002   # a polite poll: a busy one would take the CPU the sidecar needs (2 cores)


def percentile(samples: list[float], p: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))] if s else float("nan")


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
        except (nats.errors.Error, asyncio.TimeoutError):
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
