"""`kvcache load`: read a dataset with Spark and put every row into a KV bucket.

The driver checks the arguments, the NATS credentials and the bucket (creating it when
missing), builds a (key, value) DataFrame, and runs `writer.arrow_partition_fn` on every
partition: each partition writes over its own NATS connection, with the same credentials and
TLS files. It prints a line as each stage starts (Spark can take seconds to start and to read
its input before the first row is written), progress while the job runs and a summary at the
end; the exit code is 1 when any row failed or was invalid.

The NATS credential and TLS flags are `serve`'s own (kvcache.cli adds them to both parsers,
with dests `nats_<NatsConfig field>`), checked by the same `validate_nats_auth`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import ssl
import sys
import threading
import time
from collections.abc import Awaitable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, TextIO

import nats
import nats.errors

from ..config import BUCKET_NAME, Config, NatsConfig, redact_url, url_auth
from ..config_nats import validate_nats_auth
from ..errors import BucketNotFound, ConfigError, UpstreamError
from ..natsio import jetstream as jsapi
from ..natsio.first_connect import first_connect, quiet_tls_eof
from . import spark as sparkio
from .keys import KeySpec
from .writer import (
    RECONNECT_WAIT,
    RESULT_DDL,
    PartitionResult,
    WriteOptions,
    arrow_partition_fn,
    result_from_row,
)

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

EXAMPLES = 10
# --empty-values: what an empty CSV field is
EMPTY_INVALID, EMPTY_PUT = "invalid", "put"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The job's own flags; kvcache.cli adds the NATS credential and TLS flags after them
    (`serve`'s, one definition for both)."""
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="files or directories (or URIs Spark reads)")
    p.add_argument("--nats", required=True, action="append", metavar="URL", help="NATS server URL (repeatable)")
    p.add_argument("--bucket", required=True, help="KV bucket to write (created when missing)")
    p.add_argument("--key", required=True, metavar="COL|TEMPLATE",
                   help="key column, or a template over columns such as '{region}.{id}'")
    value = p.add_mutually_exclusive_group()
    value.add_argument("--value", metavar="COL", help="value column (bytes, or text stored as UTF-8)")
    value.add_argument("--json", metavar="COL,...",
                       help="value: a JSON object of these columns ('*' for all; the default)")
    p.add_argument("--format", choices=("parquet", "csv", "json"), help="input format (default: extension)")
    p.add_argument("--master", metavar="URL", help="Spark master (default local[*], or spark-submit's)")
    p.add_argument("--partitions", type=int, metavar="N",
                   help="write partitions (default: at least Spark's default parallelism)")
    p.add_argument("--max-inflight", type=int, default=4096, metavar="N",
                   help="unacknowledged puts per partition (default 4096)")
    p.add_argument("--retries", type=int, default=10, help="attempts after the first for a row (default 10)")
    p.add_argument("--ack-timeout", type=float, default=5.0, metavar="S",
                   help="seconds to wait for a put's ack before sending it again (default 5)")
    p.add_argument("--history", type=int, default=1, help="new bucket: values kept per key (1-64)")
    p.add_argument("--ttl", type=float, default=0, metavar="S", help="new bucket: value lifetime, 0 = forever")
    p.add_argument("--replicas", type=int, default=1, help="new bucket: stream replicas (1-5)")
    p.add_argument("--skip-invalid", action="store_true",
                   help="invalid rows (a bad key, a null value, input Spark could not read) are "
                        "reported but do not make the exit code non-zero")
    p.add_argument("--delimiter", metavar="C", help="CSV field separator (default ',' or tab for .tsv)")
    p.add_argument("--infer-schema", action="store_true", help="CSV: infer column types (default: text)")
    p.add_argument("--csv-single-line", action="store_true",
                   help="CSV: no field holds a line break, so Spark may split files across tasks "
                        "(default: quoted fields may span lines; each file is read by one task)")
    p.add_argument("--empty-values", choices=(EMPTY_INVALID, EMPTY_PUT), default=EMPTY_INVALID,
                   help="CSV: an empty field is null: as the value its row is invalid, in a JSON "
                        "value null (invalid, the default); or it is the empty string: a zero-length "
                        "value, \"\" in a JSON value (put)")
    p.add_argument("--multiline", action="store_true", help="JSON: documents span lines (default: JSON lines)")
    p.add_argument("--progress", type=float, default=5.0, metavar="S",
                   help="progress on stderr: a line as Spark starts, reads and writes, then one every "
                        "S seconds; 0 = none (default 5)")
    p.add_argument("--summary-json", metavar="FILE", help="also write the summary as JSON here")


@dataclass
class Summary:
    """What `kvcache load` reports at the end (and writes with --summary-json)."""

    bucket: str
    rows: int
    written: int
    invalid: int
    failed: int
    retried: int
    disconnects: int
    seconds: float
    rows_per_s: float
    partitions: int
    created_bucket: bool
    invalid_examples: list[str]
    failed_examples: list[str]

    def lines(self) -> list[str]:
        out = [f"kvcache load: {self.rows:,} rows read, {self.written:,} written, {self.invalid:,} invalid, "
               f"{self.failed:,} failed ({self.retried:,} retries, {self.disconnects:,} disconnects) "
               f"into bucket '{self.bucket}' in "
               f"{self.seconds:.1f}s: {self.rows_per_s:,.0f} rows/s over {self.partitions} partitions"]
        if self.invalid_examples:
            out.append(f"invalid rows (first {len(self.invalid_examples)}): " + "; ".join(self.invalid_examples))
        if self.failed_examples:
            out.append(f"failed rows (first {len(self.failed_examples)}): " + "; ".join(self.failed_examples))
        return out


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """The `kvcache load` command: 0 when every row was written, 1 otherwise."""
    out, err = out or sys.stdout, err or sys.stderr
    summary = load(args, err=err)
    for line in summary.lines():
        print(line, file=out)
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(asdict(summary), f, indent=1)
    bad = summary.failed + (0 if args.skip_invalid else summary.invalid)
    return 1 if bad else 0


def load(args: argparse.Namespace, err: TextIO | None = None) -> Summary:
    """Check everything that can be checked before Spark starts, then run the job. With
    progress on, a line says each stage as it starts (Spark, the read, the write), so a user
    hears within a second what the seconds before the first row is written are spent on."""
    err = err or sys.stderr
    key = KeySpec.parse(args.key)
    json_cols = _json_columns(args.json)
    if not BUCKET_NAME.match(args.bucket):
        raise ConfigError(f"invalid bucket name '{args.bucket}' (letters, digits, '-' and '_' only)")
    for name, low, high in (("max-inflight", 1, None), ("retries", 0, None), ("history", 1, 64),
                            ("replicas", 1, 5), ("partitions", 1, None)):
        v = getattr(args, name.replace("-", "_"))
        if v is not None and (v < low or (high is not None and v > high)):
            raise ConfigError(f"--{name} must be {low}..{high or 'more'}, got {v}")
    if args.ack_timeout <= 0 or args.ttl < 0:
        raise ConfigError("--ack-timeout must be positive and --ttl not negative")
    fmt = sparkio.detect_format(args.inputs, args.format)
    empty = getattr(args, "empty_values", EMPTY_INVALID)
    if empty == EMPTY_PUT and fmt != "csv":
        raise ConfigError(f"--empty-values put is for CSV input, and this input is {fmt}: there an empty "
                          "string is an empty value already (and a null stays invalid)")
    auth = nats_settings(args)
    opts = WriteOptions(servers=tuple(args.nats), bucket=args.bucket, max_inflight=args.max_inflight,
                        retries=args.retries, ack_timeout_s=args.ack_timeout, creds=auth.creds,
                        nkey=auth.nkey, token=auth.token, user=auth.user, password=auth.password,
                        tls_ca=auth.tls_ca, tls_cert=auth.tls_cert, tls_key=auth.tls_key)
    created = asyncio.run(ensure_bucket(opts, args.history, args.ttl, args.replicas, warn=err))
    if created:
        print(f"kvcache load: created bucket '{args.bucket}' (history {args.history}, "
              f"replicas {args.replicas}, ttl {args.ttl:g}s, allow_direct)", file=err)

    def stage(text: str) -> None:
        if args.progress > 0:
            print(f"kvcache load: {text}", file=err, flush=True)

    launched = "PYSPARK_GATEWAY_PORT" in os.environ
    stage(f"starting Spark (master {args.master or ('from spark-submit' if launched else 'local[*]')})...")
    spark, owned = sparkio.session(args.master, "kvcache load")
    try:
        stage(f"reading {_names(args.inputs)} as {fmt}...")
        df = sparkio.read(spark, args.inputs, fmt, delimiter=args.delimiter,
                          infer_schema=args.infer_schema, multiline=args.multiline,
                          csv_single_line=args.csv_single_line)
        if empty == EMPTY_PUT:
            df = empty_fields_as_text(df)
        kv = key_value_frame(df, key, args.value, json_cols)
        want = args.partitions or spark.sparkContext.defaultParallelism
        have = kv.rdd.getNumPartitions()
        if (args.partitions and have != want) or have < want:
            kv = kv.repartition(want, "key")  # by key: a key's rows share one connection
            have = want
        stage(f"writing into bucket '{args.bucket}' over {have} partition{'s' if have != 1 else ''}...")
        start = time.monotonic()
        with Progress(spark, opts, args.progress, err):
            rows = kv.mapInArrow(arrow_partition_fn(opts), RESULT_DDL).collect()
        seconds = time.monotonic() - start
    except ConfigError:
        raise
    except Exception as e:  # Spark/Py4J: one line, not a JVM stack trace
        raise UpstreamError(f"load failed: {sparkio.read_error(e)}") from None
    finally:
        if owned:
            spark.stop()
    total = PartitionResult()
    for r in rows:
        total.add(result_from_row(r.asDict()), EXAMPLES)
    return Summary(
        bucket=args.bucket, rows=total.rows, written=total.written, invalid=total.invalid,
        failed=total.failed, retried=total.retried, disconnects=total.disconnects, seconds=round(seconds, 3),
        rows_per_s=round(total.written / seconds, 1) if seconds > 0 else 0.0, partitions=have,
        created_bucket=created, invalid_examples=total.invalid_examples,
        failed_examples=total.failed_examples)


def _names(inputs: list[str], most: int = 3) -> str:
    shown = ", ".join(inputs[:most])
    return shown + (f" and {len(inputs) - most} more" if len(inputs) > most else "")


# The NatsConfig fields `serve`'s credential and TLS flags set (as `nats_<field>`).
NATS_AUTH_FIELDS = ("creds", "nkey", "token", "user", "password", "tls_ca", "tls_cert", "tls_key")


def nats_settings(args: argparse.Namespace) -> NatsConfig:
    """The NATS servers, credentials and TLS files of `serve`'s flags (dests `nats_creds`,
    `nats_tls_ca`...), checked as `serve` checks them before anything connects: a missing or
    malformed file, or two kinds of credentials at once, is one line and exit 2."""
    n = NatsConfig(servers=list(args.nats))
    for name in NATS_AUTH_FIELDS:
        setattr(n, name, getattr(args, f"nats_{name}", None))
    validate_nats_auth(Config(nats=n))
    return n


def empty_fields_as_text(df: DataFrame) -> DataFrame:
    """`--empty-values put`: Spark reads an empty CSV field (quoted or not) as null; here every
    text column's null becomes the empty string. In CSV a null has no other source (a row Spark
    could not read is still marked UNREADABLE and never written); columns typed by
    --infer-schema other than text keep their nulls."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import StringType

    return df.select(*(
        F.coalesce(F.col(sparkio.quote(f.name)), F.lit("")).alias(f.name)
        if isinstance(f.dataType, StringType) and f.name != sparkio.UNREADABLE else F.col(sparkio.quote(f.name))
        for f in df.schema.fields))


def _json_columns(spec: str | None) -> list[str] | None:
    if spec is None or spec.strip() == "*":
        return None
    cols = [c.strip() for c in spec.split(",") if c.strip()]
    if not cols:
        raise ConfigError("--json needs column names (or '*')")
    return cols


def key_value_frame(df: DataFrame, key: KeySpec, value: str | None,
                    json_cols: list[str] | None) -> DataFrame:
    """Three columns computed by Spark: `key` (string), `value` (binary) and `unreadable`
    (string: the input record when Spark could not read the row, else null; see
    sparkio.UNREADABLE). The writer counts unreadable rows as invalid and never writes them."""
    from pyspark.sql import functions as F

    columns = [c for c in df.columns if c != sparkio.UNREADABLE]
    missing = [c for c in key.columns + ([value] if value else []) + (json_cols or [])
               if c not in columns]
    if missing:
        raise ConfigError(f"no column {', '.join(repr(c) for c in missing)} in the input "
                          f"(columns: {', '.join(columns)})")
    parts = [F.col(sparkio.quote(t)).cast("string") if is_col else F.lit(t) for t, is_col in key.parts]
    key_col = parts[0] if len(parts) == 1 else F.concat(*parts)
    if value:
        value_col = _as_binary(df, value)
    else:
        cols = json_cols or columns
        value_col = F.to_json(F.struct(*[F.col(sparkio.quote(c)) for c in cols]),
                              {"ignoreNullFields": "false"}).cast("binary")
    unreadable = (F.col(sparkio.UNREADABLE) if sparkio.UNREADABLE in df.columns
                  else F.lit(None).cast("string"))
    return df.select(key_col.alias("key"), value_col.alias("value"), unreadable.alias("unreadable"))


def _as_binary(df: DataFrame, column: str) -> Column:
    from pyspark.sql import functions as F
    from pyspark.sql.types import ArrayType, BinaryType, MapType, StringType, StructType

    col = F.col(sparkio.quote(column))
    t = df.schema[column].dataType
    if isinstance(t, BinaryType):
        return col
    if isinstance(t, (StructType, ArrayType, MapType)):
        return F.to_json(col).cast("binary")
    if not isinstance(t, StringType):
        col = col.cast("string")
    return col.cast("binary")


# ---------------------------------------------------------------------------- bucket

async def ensure_bucket(opts: WriteOptions, history: int, ttl: float, replicas: int,
                        timeout: float = 5.0, warn: TextIO | None = None) -> bool:
    """Create the bucket when its stream does not exist (allow_direct on, so sidecars read
    misses with Direct Get). Returns True when it was created. The connection's warnings go
    to `warn` (this is the run's first connection)."""
    nc = await connect(opts, warn=warn)
    try:
        try:
            await jsapi.stream_info(nc, jsapi.kv_stream(opts.bucket), timeout)
            return False
        except BucketNotFound:
            pass
        js = nc.jetstream(timeout=timeout)
        try:
            await js.create_key_value(bucket=opts.bucket, history=history, ttl=ttl or None,
                                      replicas=replicas, direct=True,
                                      description="created by kvcache load")
        except nats.errors.Error as e:
            raise UpstreamError(f"cannot create bucket '{opts.bucket}': {e}") from None
        return True
    finally:
        await nc.close()


async def connect(opts: WriteOptions, timeout: float = 3.0, warn: TextIO | None = None) -> nats.NATS:
    """One bounded first connection for the driver, within `timeout` seconds in all
    (kvcache.natsio.first_connect): an unreachable server, a port that is not NATS, refused
    credentials or a certificate that does not verify is one clear line naming what was found.
    Warnings (credentials a server without auth does not use) go to `warn`."""
    errors: list[BaseException] = []
    tls_failed = asyncio.Event()

    async def on_error(e: Exception) -> None:
        errors.append(e)
        if isinstance(e, ssl.SSLError):
            tls_failed.set()  # nats-py's connect does not return after a failed handshake

    where = ", ".join(redact_url(u) for u in opts.servers)
    auth = opts.connect_options()  # its files were checked by nats_settings
    if "tls" in auth:
        quiet_tls_eof()
    nc = nats.NATS()

    def attempt(servers: list[str], left: float) -> Awaitable[None]:
        # allow_reconnect with one attempt: nats-py's bounded first connect (see the sidecar).
        # (connect_timeout is annotated int; nats-py only hands it to asyncio.wait_for.)
        return nc.connect(servers=servers, connect_timeout=left,  # type: ignore[arg-type]
                          allow_reconnect=True, max_reconnect_attempts=1, **RECONNECT_WAIT, error_cb=on_error,
                          name="kvcache-load-driver", **auth)

    in_url = any(url_auth(u) != (None, None) for u in opts.servers)
    outcome = await first_connect(
        nc, attempt, list(opts.servers), timeout, tls_failed, errors, shown=redact_url,
        tls="tls" in auth or any(u.startswith("tls://") for u in opts.servers),
        credentials=bool(opts.creds or opts.nkey or opts.token or opts.user or in_url))
    if outcome.error is not None:
        raise UpstreamError(f"cannot connect to NATS at {where}: {outcome.error}")
    if warn is not None:
        for line in outcome.warnings:
            print(f"kvcache load: warning: {line}", file=warn, flush=True)
    return nc


# ---------------------------------------------------------------------------- progress

class Progress:
    """A driver thread printing, every `interval` seconds, the job's finished tasks and how
    far the bucket's stream has moved (its last sequence: stored puts, retries included)."""

    def __init__(self, spark: SparkSession, opts: WriteOptions, interval: float, err: TextIO) -> None:
        self.spark = spark
        self.opts = opts
        self.interval = interval
        self.err = err
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvcache-load-progress", daemon=True)

    def __enter__(self) -> Progress:
        if self.interval > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def _run(self) -> None:
        try:
            asyncio.run(self._loop())
        except Exception as e:  # progress is best effort; the load goes on
            print(f"kvcache load: progress unavailable: {e}", file=self.err)

    async def _loop(self) -> None:
        nc = await connect(self.opts)
        stream = jsapi.kv_stream(self.opts.bucket)
        try:
            first = last = await self._seq(nc, stream)
            started = prev_t = time.monotonic()
            while not self._stop.wait(self.interval):
                seq = await self._seq(nc, stream)
                now = time.monotonic()
                if seq is None or first is None:
                    continue
                rate = (seq - (last or 0)) / max(now - prev_t, 1e-9)
                print(f"kvcache load: {self._tasks()}, {seq - first:,} puts stored in "
                      f"{now - started:.0f}s ({rate:,.0f}/s)", file=self.err, flush=True)
                last, prev_t = seq, now
        finally:
            await nc.close()

    async def _seq(self, nc: nats.NATS, stream: str) -> int | None:
        try:
            info: dict[str, Any] = await jsapi.stream_info(nc, stream, 2.0)
        except UpstreamError:
            return None  # a restarting server: try again next time
        return int(info.get("state", {}).get("last_seq", 0))

    def _tasks(self) -> str:
        tracker = self.spark.sparkContext.statusTracker()
        done = total = 0
        for sid in tracker.getActiveStageIds():
            info = tracker.getStageInfo(sid)
            if info:
                done += info.numCompletedTasks
                total += info.numTasks
        return f"tasks {done}/{total} done" if total else "starting"
