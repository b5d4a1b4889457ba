"""Writes one partition's rows into a KV bucket over its own NATS connection (runs on executors).

A KV put is a JetStream publish to `$KV.<bucket>.<key>` answered by a publish ack. Rather than
one request (a future and a timer) per row as nats-py's `kv.put` does, the writer publishes
with reply subjects under one wildcard inbox subscription and keeps a bounded window of rows
in flight: pipelined, so the round trip is paid once per window, not once per row. The
connection is nats-py with kvcache's wire reader (`kvcache.natsio.nats_connection`), and the inbox is a fast
lane: the acks of one event-loop turn arrive as one list, with no Msg object, queue or coroutine
step per ack.

A row whose ack is an error, a 503 (no JetStream responder: a server restarting), or does not
arrive in time is sent again after an exponential backoff with jitter, up to `retries` times;
then it is counted as failed with an example. A row sent twice (a lost ack) is stored twice
with the same value: the key's final value is the same, which is what makes reruns and
retries safe. Invalid keys (ADR-8), null values and rows the reader could not read (an optional
third column holding the unreadable record's text) are counted with examples, never written.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import json
import random
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import nats.errors

from ..errors import ConfigError
from ..natsio.first_connect import quiet_tls_eof
from ..natsio.nats_connection import NatsConnection
from .keys import KEY_RE2, RESERVED_PREFIX, key_problem

# nats-py annotates reconnect_time_wait as int but sleeps whatever it is given: a short first
# reconnect wait for the bounded first connect (one attempt, see the sidecar)
RECONNECT_WAIT: dict[str, Any] = {"reconnect_time_wait": 0.2}

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
    # NATS credentials and TLS files (`serve`'s flags): paths, not contexts, since the options
    # are pickled to the executors, which must find the files at the same paths
    creds: str | None = None
    nkey: str | None = None
    token: str | None = None
    user: str | None = None
    password: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    def connect_options(self) -> dict[str, Any]:
        """nats-py's connect arguments for the credentials and TLS files, mapped as the
        sidecar maps them (kvcache.natsio.upstream); the TLS context is made here, on the
        machine that connects. A TLS file it cannot use is a ConfigError."""
        opts: dict[str, Any] = {}
        if self.creds:
            opts["user_credentials"] = self.creds
        if self.nkey:
            opts["nkeys_seed"] = self.nkey
        if self.token:
            opts["token"] = self.token
        if self.user:
            opts["user"], opts["password"] = self.user, self.password
        if self.tls_ca or self.tls_cert or self.tls_key:
            from ..config import NatsConfig, tls_context

            opts["tls"] = tls_context(NatsConfig(tls_ca=self.tls_ca, tls_cert=self.tls_cert, tls_key=self.tls_key))
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

    def add(self, other: PartitionResult, examples: int) -> None:
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
    """A row sent on its own: a retry (first sends go out in slices)."""

    __slots__ = ("attempts", "deadline", "key", "value")

    def __init__(self, key: str, value: bytes, attempts: int = 0) -> None:
        self.key = key
        self.value = value
        self.attempts = attempts
        self.deadline = 0.0

    def row(self, rid: int) -> _Row:
        return self


class _Slice:
    """Rows sent together for the first time: reply ids base .. base+len-1. A row is taken out
    (as a _Row) only when it has to be sent again."""

    __slots__ = ("base", "deadline", "keys", "values")

    def __init__(self, keys: Any, values: Any, base: int, deadline: float) -> None:
        self.keys = keys
        self.values = values
        self.base = base
        self.deadline = deadline

    def row(self, rid: int) -> _Row:
        i = rid - self.base
        return _Row(self.keys[i].as_py(), self.values[i].as_py())


class PartitionWriter:
    """Pipelined KV puts with a bounded window, retries and counts (one per partition).

    Rows come in Arrow batches of (key string, value binary) and go out as slices: validity
    (ADR-8's key rule as a regex) and the PUB frames of a whole slice are computed by Arrow
    kernels, so the per-row Python work on the send side is one dict entry. Rows sent again
    take the per-row path (`_frame`)."""

    def __init__(self, opts: WriteOptions) -> None:
        self.opts = opts
        self.result = PartitionResult()
        self.nc: NatsConnection | None = None
        self._subject = f"$KV.{opts.bucket}.".encode()
        self._inbox = ""
        self._inbox_b = b""
        self._out: list[bytes] = []  # PUB frames not yet handed to nats-py
        self._out_rids: list[range] = []  # their reply ids
        self._pending: dict[int, _Row | _Slice] = {}  # reply id -> its row or slice, oldest first
        self._retry: list[tuple[float, int, _Row]] = []  # heap by due time
        self._seq = 0
        self._low = max(1, opts.max_inflight // 2)
        self._wake = asyncio.Event()
        self._next_expire = 0.0

    async def write(self, batches: Iterable[Any]) -> PartitionResult:
        """Write every Arrow batch (columns: key, value); returns the counts. Never raises for
        rows that could not be written: they are counted (a partition that cannot reach NATS
        at all reports every valid row as failed)."""
        start = time.monotonic()
        try:
            await self._connect()
        except (TimeoutError, OSError, nats.errors.Error, ConfigError) as e:
            why = f"cannot connect to NATS: {type(e).__name__} {e}".strip()
            for batch in batches:
                keys, _ = self._accept(batch)
                if len(keys):
                    self._failed(keys[0].as_py(), why, len(keys))
            self.result.seconds = time.monotonic() - start
            return self.result
        try:
            window = self.opts.max_inflight
            for batch in batches:
                keys, values = self._accept(batch)
                done = 0
                while done < len(keys):
                    free = window - len(self._pending)
                    if free <= 0 or (self._retry and self._retry[0][0] <= time.monotonic()):
                        await self._turn()
                        continue
                    n = min(free, len(keys) - done)
                    self._send_slice(keys.slice(done, n), values.slice(done, n))
                    done += n
                    await self._flush()
            while self._pending or self._retry:
                await self._turn()
        finally:
            await self._close()
        self.result.seconds = time.monotonic() - start
        return self.result

    # ------------------------------------------------------------------ rows

    def _accept(self, batch: Any) -> tuple[Any, Any]:
        """Count the batch; set aside (counted, with examples) rows the reader could not read
        (a non-null third column), rows with an invalid key, a null value or a value over the
        server's max_payload. Returns the (keys, values) to send."""
        import pyarrow as pa
        import pyarrow.compute as pc

        keys, values = batch.column(0), batch.column(1)
        unreadable = batch.column(2) if batch.num_columns > 2 else None
        if not pa.types.is_binary(values.type) and not pa.types.is_large_binary(values.type):
            values = pc.cast(values, pa.binary())
        r = self.result
        r.rows += len(keys)
        ok = pc.and_kleene(pc.match_substring_regex(keys, KEY_RE2),
                           pc.invert(pc.starts_with(keys, RESERVED_PREFIX)))
        ok = pc.and_(pc.fill_null(ok, False), pc.is_valid(values))
        if unreadable is not None and unreadable.null_count < len(unreadable):
            ok = pc.and_(ok, pc.is_null(unreadable))
        bad = pc.indices_nonzero(pc.invert(ok))
        if len(bad):
            r.invalid += len(bad)
            for i in bad.to_pylist()[: max(0, self.opts.examples - len(r.invalid_examples))]:
                record = unreadable[i].as_py() if unreadable is not None else None
                if record is not None:
                    text = record if len(record) <= 100 else record[:100] + "..."
                    r.invalid_examples.append(f"unreadable input row {text!r}")
                    continue
                key = keys[i].as_py()
                r.invalid_examples.append(f"{key!r}: {key_problem(key) or 'null value'}")
        if self.nc is not None:
            big = pc.and_(pc.fill_null(pc.greater(pc.binary_length(values), self.nc.max_payload), False), ok)
            for i in pc.indices_nonzero(big).to_pylist():
                self._failed(keys[i].as_py(), f"value of {len(values[i].as_py())} bytes exceeds "
                             "the server's max_payload")
                ok = pc.and_not(ok, big)
        if len(bad) or not pc.all(ok).as_py():
            keys, values = pc.filter(keys, ok), pc.filter(values, ok)
        return keys, values

    def _failed(self, key: str, why: str, count: int = 1) -> None:
        r = self.result
        r.failed += count
        if len(r.failed_examples) < self.opts.examples:
            r.failed_examples.append(f"{key}: {why}")

    # ------------------------------------------------------------------ NATS

    async def _connect(self) -> None:
        """A bounded first connect (nats-py would retry forever), then reconnect forever:
        a server restart mid-load must not end the partition."""
        deadline = time.monotonic() + self.opts.connect_timeout_s
        delay = 0.1
        auth = self.opts.connect_options()
        if "tls" in auth:
            quiet_tls_eof()
        while True:
            nc = NatsConnection()
            try:
                # bounded: after a failed TLS handshake nats-py's connect does not return
                await asyncio.wait_for(nc.connect(
                    servers=list(self.opts.servers), name="kvcache-load", connect_timeout=2,
                    allow_reconnect=True, max_reconnect_attempts=1, **RECONNECT_WAIT,
                    pending_size=64 << 20, skip_subject_validation=True,
                    error_cb=quiet, disconnected_cb=self._on_disconnect, **auth),
                    max(1.0, deadline - time.monotonic()))
                break
            except (TimeoutError, OSError, nats.errors.Error):
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
            except (TimeoutError, nats.errors.Error):
                pass

    def _frame(self, row: _Row) -> None:
        """Queue the PUB frame of one row sent again (sent by `_flush`)."""
        self._seq += 1
        rid = self._seq
        row.deadline = time.monotonic() + self.opts.ack_timeout_s
        self._pending[rid] = row
        self._out.append(b"PUB %b%b %b.%d %d\r\n%b\r\n" % (
            self._subject, row.key.encode(), self._inbox_b, rid, len(row.value), row.value))
        self._out_rids.append(range(rid, rid + 1))

    def _send_slice(self, keys: Any, values: Any) -> None:
        """Queue the PUB frames of a slice of new rows, built by Arrow kernels into one buffer:
        `PUB $KV.<bucket>.<key> <inbox>.<reply id> <size>\\r\\n<value>\\r\\n` each."""
        import pyarrow as pa
        import pyarrow.compute as pc

        n = len(keys)
        base = self._seq + 1
        self._seq += n
        binary = pa.binary()
        rids = pc.cast(pc.cast(pa.array(range(base, base + n), pa.int64()), pa.string()), binary)
        sizes = pc.cast(pc.cast(pc.binary_length(values), pa.string()), binary)
        frames = pc.binary_join_element_wise(
            b"PUB " + self._subject, pc.cast(keys, binary), b" " + self._inbox_b + b".", rids, b" ",
            sizes, b"\r\n", pc.cast(values, binary), b"\r\n", b"")  # the last argument: separator
        bufs = frames.buffers()
        offsets = pa.Array.from_buffers(pa.int32(), n + 1, [None, bufs[1]], offset=frames.offset)
        self._out.append(bufs[2][offsets[0].as_py():offsets[n].as_py()].to_pybytes())
        ids = range(base, base + n)
        self._out_rids.append(ids)
        sl = _Slice(keys, values, base, time.monotonic() + self.opts.ack_timeout_s)
        self._pending.update(zip(ids, itertools.repeat(sl)))

    async def _flush(self) -> None:
        """Hand the queued frames to nats-py as one write. While reconnecting nats-py buffers
        them (up to its pending_size); past that the rows go back to the retry queue."""
        if not self._out:
            return
        data = b"".join(self._out)
        rids = self._out_rids
        self._out, self._out_rids = [], []
        nc = self.nc
        assert nc is not None  # _flush runs only between connect and close
        if nc.is_closed or (not nc.is_connected and
                            nc._pending_data_size + len(data) > nc._max_pending_size):
            for ids in rids:
                for rid in ids:
                    entry = self._pending.pop(rid, None)
                    if entry is not None:
                        self._again(entry.row(rid), "disconnected from NATS")
            return
        # One PUB batch through nats-py's own buffer and flusher (publish() does the same
        # per message: this is its _send_command without a coroutine per row).
        await nc._send_command(data)
        await nc._flush_pending()

    async def _on_disconnect(self) -> None:
        if self.nc is not None and not self.nc.is_closed:
            self.result.disconnects += 1

    def _on_acks(self, events: list[Any]) -> None:
        """The publish acks of one event-loop turn (Msg, or HMsg for a status such as 503)."""
        pending = self._pending
        cut = len(self._inbox) + 1
        written = 0
        for ev in events:
            try:
                rid = int(ev.subject[cut:])
            except ValueError:
                continue
            entry = pending.pop(rid, None)
            if entry is None:
                continue  # the ack of a send we already gave up on (and sent again)
            status = getattr(ev, "status", 0)
            if status:
                self._again(entry.row(rid), f"status {status} {ev.description}".strip())
            elif b'"error"' in ev.payload:
                self._again(entry.row(rid), _ack_error(ev.payload))
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
            except TimeoutError:
                pass
        else:
            await asyncio.sleep(0)  # let acks in
        self._wake.clear()
        now = time.monotonic()
        if now >= self._next_expire:
            self._next_expire = now + EXPIRE_EVERY_S
            overdue = []
            for rid, entry in self._pending.items():
                if entry.deadline > now:
                    break
                overdue.append(rid)
            for rid in overdue:
                self._again(self._pending.pop(rid).row(rid), f"no ack within {self.opts.ack_timeout_s:g}s")
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


def run_partition(opts: WriteOptions, batches: Iterable[Any]) -> PartitionResult:
    """Write one partition's Arrow batches (key, value) on a fresh event loop (uvloop when
    installed)."""
    try:
        import uvloop
        runner: Callable[..., PartitionResult] = uvloop.run
    except ImportError:
        runner = asyncio.run
    return runner(PartitionWriter(opts).write(batches))


def arrow_partition_fn(opts: WriteOptions) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """The function `DataFrame.mapInArrow` runs per partition: Arrow batches of (key, value[,
    unreadable]) in, one row of counts out."""
    def write_batches(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa

        result = run_partition(opts, batches)
        yield pa.RecordBatch.from_pylist([result_to_row(result)])
    return write_batches
