"""Writes one partition's rows into a KV bucket over its own NATS connection (runs on executors).

A KV put is a JetStream publish to `$KV.<bucket>.<key>` answered by a publish ack. Rather than
one request (a future and a timer) per row as nats-py's `kv.put` does, the writer publishes
with reply subjects under one wildcard inbox subscription and keeps a bounded window of rows
in flight: pipelined, so the round trip is paid once per window, not once per row. The
connection is nats-py with kvcache's wire reader (`kvcache.natsconn`), and the inbox is a fast
lane: the acks of one socket read arrive as one list, with no Msg object, queue or coroutine
step per ack.

A row whose ack is an error, a 503 (no JetStream responder: a server restarting), or does not
arrive in time is sent again after an exponential backoff with jitter, up to `retries` times;
then it is counted as failed with an example. A row sent twice (a lost ack) is stored twice
with the same value: the key's final value is the same, which is what makes reruns and
retries safe. Invalid keys (ADR-8) and null values are counted with examples, never written.
"""
from __future__ import annotations

import asyncio
import heapq
import json
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Iterator

import nats.errors

from ..natsconn import Connection
from .keys import key_problem

BACKOFF_BASE_S = 0.05
BACKOFF_MAX_S = 2.0
EXPIRE_EVERY_S = 0.05


@dataclass(frozen=True)
class WriteOptions:
    """What every partition needs to write (pickled to the executors)."""

    servers: tuple[str, ...]
    bucket: str
    max_inflight: int = 4096
    retries: int = 10
    ack_timeout_s: float = 5.0
    connect_timeout_s: float = 30.0
    examples: int = 5
    creds: str | None = None
    token: str | None = None
    user: str | None = None
    password: str | None = None

    def connect_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {}
        if self.creds:
            opts["user_credentials"] = self.creds
        if self.token:
            opts["token"] = self.token
        if self.user:
            opts["user"], opts["password"] = self.user, self.password
        return opts


@dataclass
class PartitionResult:
    """One partition's counts; the driver adds them up."""

    rows: int = 0
    written: int = 0
    invalid: int = 0
    failed: int = 0
    retried: int = 0
    disconnects: int = 0  # times a partition lost its NATS connection (and reconnected)
    invalid_examples: list[str] = field(default_factory=list)
    failed_examples: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, other: "PartitionResult", examples: int) -> None:
        for name in ("rows", "written", "invalid", "failed", "retried", "disconnects"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.seconds = max(self.seconds, other.seconds)
        _extend(self.invalid_examples, other.invalid_examples, examples)
        _extend(self.failed_examples, other.failed_examples, examples)


# The Arrow/Spark shape of a PartitionResult (examples as JSON text: one schema for both sides).
RESULT_DDL = ("rows long, written long, invalid long, failed long, retried long, disconnects long, "
              "invalid_examples string, failed_examples string, seconds double")


def result_to_row(r: PartitionResult) -> dict[str, Any]:
    d = asdict(r)
    d["invalid_examples"] = json.dumps(r.invalid_examples)
    d["failed_examples"] = json.dumps(r.failed_examples)
    return d


def result_from_row(row: dict[str, Any]) -> PartitionResult:
    d = dict(row)
    d["invalid_examples"] = json.loads(d["invalid_examples"])
    d["failed_examples"] = json.loads(d["failed_examples"])
    return PartitionResult(**d)


def _extend(out: list[str], more: list[str], limit: int) -> None:
    out.extend(more[: max(0, limit - len(out))])


class _Row:
    __slots__ = ("key", "value", "attempts", "deadline")

    def __init__(self, key: str, value: bytes) -> None:
        self.key = key
        self.value = value
        self.attempts = 0
        self.deadline = 0.0


class PartitionWriter:
    """Pipelined KV puts with a bounded window, retries and counts (one per partition)."""

    def __init__(self, opts: WriteOptions) -> None:
        self.opts = opts
        self.result = PartitionResult()
        self.nc: Connection | None = None
        self._subject = f"$KV.{opts.bucket}.".encode()
        self._inbox_b = b""
        self._out: list[bytes] = []  # PUB frames not yet handed to nats-py
        self._out_rids: list[int] = []
        self._inbox = ""
        self._pending: dict[int, _Row] = {}  # reply id -> row, oldest first
        self._retry: list[tuple[float, int, _Row]] = []  # heap by due time
        self._seq = 0
        self._low = max(1, opts.max_inflight // 2)
        self._wake = asyncio.Event()
        self._next_expire = 0.0

    async def write(self, chunks: Iterable[tuple[list[Any], list[Any]]]) -> PartitionResult:
        """Write every (keys, values) chunk; returns the counts. Never raises for rows that
        could not be written: they are counted (a partition that cannot reach NATS at all
        reports every valid row as failed)."""
        start = time.monotonic()
        try:
            await self._connect()
        except (OSError, asyncio.TimeoutError, nats.errors.Error) as e:
            self._fail_all(chunks, f"cannot connect to NATS: {type(e).__name__} {e}".strip())
            self.result.seconds = time.monotonic() - start
            return self.result
        try:
            window = self.opts.max_inflight
            for keys, values in chunks:
                for key, value in zip(keys, values):
                    row = self._accept(key, value)
                    if row is None:
                        continue
                    self._frame(row)
                    if len(self._pending) >= window:
                        await self._flush()
                        while len(self._pending) >= window:
                            await self._turn()
                await self._flush()
                if self._retry and self._retry[0][0] <= time.monotonic():
                    await self._turn()
            await self._flush()
            while self._pending or self._retry:
                await self._turn()
        finally:
            await self._close()
        self.result.seconds = time.monotonic() - start
        return self.result

    # ------------------------------------------------------------------ rows

    def _accept(self, key: Any, value: Any) -> _Row | None:
        r = self.result
        r.rows += 1
        problem = key_problem(key)
        if problem is None and value is None:
            problem = "null value"
        if problem is not None:
            r.invalid += 1
            if len(r.invalid_examples) < self.opts.examples:
                r.invalid_examples.append(f"{key!r}: {problem}")
            return None
        return _Row(key, value if isinstance(value, bytes) else bytes(value))

    def _fail_all(self, chunks: Iterable[tuple[list[Any], list[Any]]], why: str) -> None:
        for keys, values in chunks:
            for key, value in zip(keys, values):
                if self._accept(key, value) is not None:
                    self._failed(key, why)

    def _failed(self, key: str, why: str) -> None:
        r = self.result
        r.failed += 1
        if len(r.failed_examples) < self.opts.examples:
            r.failed_examples.append(f"{key}: {why}")

    # ------------------------------------------------------------------ NATS

    async def _connect(self) -> None:
        """A bounded first connect (nats-py would retry forever), then reconnect forever:
        a server restart mid-load must not end the partition."""
        deadline = time.monotonic() + self.opts.connect_timeout_s
        delay = 0.1
        while True:
            nc = Connection()
            try:
                await nc.connect(
                    servers=list(self.opts.servers), name="kvcache-load", connect_timeout=2,
                    allow_reconnect=True, max_reconnect_attempts=1, reconnect_time_wait=0.2,
                    pending_size=64 << 20, skip_subject_validation=True,
                    error_cb=quiet, disconnected_cb=self._on_disconnect, **self.opts.connect_options())
                break
            except (OSError, asyncio.TimeoutError, nats.errors.Error):
                if time.monotonic() + delay > deadline:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
        nc.options["max_reconnect_attempts"] = -1
        self.nc = nc
        self._inbox = nc.new_inbox()
        self._inbox_b = self._inbox.encode()
        sub = await nc.subscribe(self._inbox + ".*")
        nc.add_lane(sub._id, "", self._on_acks)

    async def _close(self) -> None:
        if self.nc is not None and not self.nc.is_closed:
            try:
                await asyncio.wait_for(self.nc.close(), 5)
            except (asyncio.TimeoutError, nats.errors.Error):
                pass

    def _frame(self, row: _Row) -> None:
        """Queue the PUB frame of one row (sent by `_flush`); the row is in flight from now."""
        if len(row.value) > self.nc.max_payload:
            self._failed(row.key, f"value of {len(row.value)} bytes exceeds the server's max_payload")
            return
        self._seq += 1
        rid = self._seq
        row.deadline = time.monotonic() + self.opts.ack_timeout_s
        self._pending[rid] = row
        self._out.append(b"PUB %b%b %b.%d %d\r\n%b\r\n" % (
            self._subject, row.key.encode(), self._inbox_b, rid, len(row.value), row.value))
        self._out_rids.append(rid)

    async def _flush(self) -> None:
        """Hand the queued frames to nats-py as one write. While reconnecting nats-py buffers
        them (up to its pending_size); past that the rows go back to the retry queue."""
        if not self._out:
            return
        data = b"".join(self._out)
        rids = self._out_rids
        self._out, self._out_rids = [], []
        nc = self.nc
        if nc.is_closed or (not nc.is_connected and
                            nc._pending_data_size + len(data) > nc._max_pending_size):
            for rid in rids:
                row = self._pending.pop(rid, None)
                if row is not None:
                    self._again(row, "disconnected from NATS")
            return
        # One PUB batch through nats-py's own buffer and flusher (publish() does the same
        # per message: this is its _send_command without a coroutine per row).
        await nc._send_command(data)
        await nc._flush_pending()

    async def _on_disconnect(self) -> None:
        if self.nc is not None and not self.nc.is_closed:
            self.result.disconnects += 1

    def _on_acks(self, events: list[Any]) -> None:
        """The publish acks of one socket read (Msg, or HMsg for a status such as 503)."""
        pending = self._pending
        cut = len(self._inbox) + 1
        written = 0
        for ev in events:
            try:
                row = pending.pop(int(ev.subject[cut:]), None)
            except ValueError:
                continue
            if row is None:
                continue  # the ack of a send we already gave up on (and sent again)
            status = getattr(ev, "status", 0)
            if status:
                self._again(row, f"status {status} {ev.description}".strip())
            elif b'"error"' in ev.payload:
                self._again(row, _ack_error(ev.payload))
            else:
                written += 1
        self.result.written += written
        if len(pending) <= self._low:
            self._wake.set()

    # ------------------------------------------------------------------ retries

    def _again(self, row: _Row, why: str) -> None:
        """Schedule another attempt after a backoff, or count the row as failed."""
        row.attempts += 1
        if row.attempts > self.opts.retries:
            self._failed(row.key, f"{why} (after {self.opts.retries} retries)")
            return
        self.result.retried += 1
        backoff = min(BACKOFF_MAX_S, BACKOFF_BASE_S * (2 ** (row.attempts - 1)))
        self._seq += 1
        heapq.heappush(self._retry, (time.monotonic() + backoff * random.uniform(0.5, 1.5), self._seq, row))
        self._wake.set()

    async def _turn(self) -> None:
        """Wait until acks free the window, a retry is due or an ack deadline passes; then
        expire overdue rows and send due retries."""
        now = time.monotonic()
        wait = 0.25
        if self._retry:
            wait = min(wait, self._retry[0][0] - now)
        if self._pending:
            wait = min(wait, next(iter(self._pending.values())).deadline - now)
        if wait > 0 and not self._wake.is_set():
            try:
                await asyncio.wait_for(self._wake.wait(), wait)
            except asyncio.TimeoutError:
                pass
        else:
            await asyncio.sleep(0)  # let acks in
        self._wake.clear()
        now = time.monotonic()
        if now >= self._next_expire:
            self._next_expire = now + EXPIRE_EVERY_S
            overdue = []
            for rid, row in self._pending.items():
                if row.deadline > now:
                    break
                overdue.append(rid)
            for rid in overdue:
                self._again(self._pending.pop(rid), f"no ack within {self.opts.ack_timeout_s:g}s")
        while self._retry and self._retry[0][0] <= now and len(self._pending) < self.opts.max_inflight:
            self._frame(heapq.heappop(self._retry)[2])
        await self._flush()


def _ack_error(payload: bytes) -> str:
    try:
        err = json.loads(payload)["error"]
        return f"{err.get('description', 'error')} (err_code {err.get('err_code', 0)})"
    except (ValueError, KeyError, AttributeError, TypeError):
        return "error ack"


async def quiet(e: Exception) -> None:
    """nats-py's error callback: disconnects are handled by retries, not logged per partition."""


def run_partition(opts: WriteOptions, chunks: Iterable[tuple[list[Any], list[Any]]]) -> PartitionResult:
    """Write one partition on a fresh event loop (uvloop when installed)."""
    try:
        import uvloop
        runner: Callable[..., PartitionResult] = uvloop.run
    except ImportError:
        runner = asyncio.run
    return runner(PartitionWriter(opts).write(chunks))


def arrow_partition_fn(opts: WriteOptions) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """The function `DataFrame.mapInArrow` runs per partition: Arrow batches of (key, value)
    in, one row of counts out."""
    def write_batches(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa

        chunks = ((b.column(0).to_pylist(), b.column(1).to_pylist()) for b in batches)
        result = run_partition(opts, chunks)
        yield pa.RecordBatch.from_pylist([result_to_row(result)])
    return write_batches
