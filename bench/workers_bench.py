"""GETs per second and server CPU per GET with `workers = N`, beside redis-server with its I/O
threads, same run.

    python bench/workers_bench.py                          # workers 1 and 2, redis io-threads 1
    python bench/workers_bench.py --workers 1,2,4,8 --io-threads 1,4,8 --threads 8 --clients 256
    python bench/workers_bench.py --other-src /path/to/older/checkout   # + that tree, one process

One nats-server and one bucket of `--keys` keys of `--value-size` bytes; a sidecar per
`--workers` value (each its own data directory, all on the one stream), and with
`--other-src` one more running that tree's kvcache (its native modules built or copied in) as
the baseline; a redis-server per `--io-threads` value holding the same keys. Each variant of
redis-benchmark (`-c C` and `-c C -P 16`, with `--threads T` when given) runs against every
target in turn, `--repeat` rounds. A target's CPU is its whole process tree's (a sidecar's
own process and its workers; a redis-server's threads), from /proc, over the run.

Reported per variant and target: the median GET/s, the spread (min-max), CPU per GET (µs,
median), and the cores used (CPU seconds over wall seconds). Ratios are within this run only:
the host, its load and its syscall costs are the same for every target.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from socket_bench import (  # the same bucket, sidecar, redis-server and redis-benchmark runs
    NKEYS,
    REDIS_BENCHMARK,
    REDIS_SERVER,
    benchmark,
    load_bucket,
    start_redis,
    start_sidecar,
    stop,
    work_dir,
)
from support.topology import NatsServer


def tree(pid: int) -> list[int]:
    """`pid` and every descendant (a sidecar's workers), from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += parents.get(p, [])
    return out


def tree_cpu(pids: list[int]) -> float:
    """utime + stime of the processes (all their threads), seconds."""
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError):
            pass
    return total / os.sysconf("SC_CLK_TCK")


def start_redis_threads(work: Path, value: bytes, keys: int, io_threads: int) -> tuple[subprocess.Popen, str]:
    """redis-server with `io_threads` (1: none), loaded like socket_bench's."""
    sub = work / f"redis-io{io_threads}"
    sub.mkdir(parents=True, exist_ok=True)
    if io_threads == 1:
        return start_redis(sub, value, keys)
    real = REDIS_SERVER
    wrapper = sub / "redis-server"
    wrapper.write_text(f"#!/bin/sh\nexec {real} \"$@\" --io-threads {io_threads} --io-threads-do-reads yes\n")
    wrapper.chmod(0o755)
    import socket_bench
    socket_bench.REDIS_SERVER = str(wrapper)
    try:
        return start_redis(sub, value, keys)
    finally:
        socket_bench.REDIS_SERVER = real


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="1,2", help="comma-separated `workers` values (default 1,2)")
    ap.add_argument("--io-threads", default="1", help="comma-separated redis-server io-threads (default 1)")
    ap.add_argument("--other-src", type=Path, help="also run this source tree's kvcache (one process)")
    ap.add_argument("--keys", type=int, default=NKEYS)
    ap.add_argument("--value-size", type=int, default=100)
    ap.add_argument("--requests", type=int, default=200_000)
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--threads", type=int, default=0, help="redis-benchmark --threads (0: its default)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    workers = [int(w) for w in args.workers.split(",")]
    io_threads = [int(t) for t in args.io_threads.split(",")]
    base = ["-c", str(args.clients)] + (["--threads", str(args.threads)] if args.threads else [])
    piped = [*base, "-P", "16"]
    variants = [(" ".join(base), base), (" ".join(piped), piped)]
    value = b"x" * args.value_size
    targets: dict[str, tuple[subprocess.Popen, str]] = {}
    nats_srv = None
    with work_dir("kvcache-workers-bench-", lambda: args.keep) as work:
        try:
            nats_srv = NatsServer(work / "nats" / "js", host="127.0.0.1", server_name="bench").start()
            t0 = time.monotonic()
            asyncio.run(load_bucket(nats_srv.url, value, args.keys))
            print(f"bucket loaded: {args.keys:,} keys of {args.value_size} B in {time.monotonic() - t0:.1f}s",
                  file=sys.stderr)
            if args.other_src is not None:
                targets["other tree, 1 process"] = start_sidecar(work, nats_srv.url, args.keys, name="other",
                                                                src=args.other_src)
            for n in workers:
                targets[f"kvcache workers {n}"] = start_sidecar(work, nats_srv.url, args.keys, name=f"w{n}",
                                                               extra=["--workers", str(n)])
            for t in io_threads:
                targets[f"redis io-threads {t}"] = start_redis_threads(work, value, args.keys, t)
            rows: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
            for rnd in range(args.repeat):
                for label, vargs in variants:
                    for name, (proc, sock) in targets.items():
                        pids = tree(proc.pid)
                        c0, w0 = tree_cpu(pids), time.monotonic()
                        res = benchmark(sock, args.requests, vargs, 600, args.keys)
                        cpu, wall = tree_cpu(pids) - c0, time.monotonic() - w0
                        rows.setdefault((label, name), []).append(
                            (res["rps"], cpu / args.requests * 1e6, cpu / wall))
                        print(f"round {rnd + 1} {label:>22} {name:>24}: {res['rps']:>12,.0f} GET/s, "
                              f"{cpu / args.requests * 1e6:6.2f} CPU us/GET, {cpu / wall:4.2f} cores ({len(pids)} "
                              f"processes)", file=sys.stderr)
        finally:
            for proc, _ in targets.values():
                stop(proc)
            if nats_srv is not None:
                nats_srv.stop()
    print(f"\n{args.keys:,} keys of {args.value_size} B, {args.requests:,} GETs a run, median of "
          f"{args.repeat} rounds; {os.cpu_count()} CPUs; redis-benchmark at {REDIS_BENCHMARK}\n")
    print("| redis-benchmark | target | GET/s (median) | min-max | server CPU µs/GET | cores |")
    print("|---|---|---:|---:|---:|---:|")
    for label, _ in variants:
        for name in targets:
            got = rows[(label, name)]
            rps = [r for r, _, _ in got]
            print(f"| `{label}` | {name} | {statistics.median(rps):,.0f} | {min(rps):,.0f}-{max(rps):,.0f} | "
                  f"{statistics.median(c for _, c, _ in got):.2f} | {statistics.median(k for _, _, k in got):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
