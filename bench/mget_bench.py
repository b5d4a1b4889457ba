"""MGET of large values: server CPU per MGET, this checkout's sidecar against another source
tree's, same run.

    python bench/mget_bench.py --other-src /tmp/kv-old [--size 524288] [--keys 200] [--per 3]

One bucket of --keys values of --size bytes and two sidecars on it, this checkout's and the
kvcache of --other-src (a git worktree of an earlier commit with its native modules built), as
socket_bench.py --other-src starts them. redis-benchmark sends `MGET key:__rand_int__ ...`
(--per keys each, `-c 20`, `-P 1`) to each in turn, --repeat times; the server's CPU per MGET
comes from /proc/<pid>/stat. Prints each run, then the medians and the ratio per run pair.
Starts its own nats-server and sidecars (Unix sockets) and stops only those.
"""
from __future__ import annotations

import argparse
import asyncio
import csv
import io
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from socket_bench import REDIS_BENCHMARK, cpu_seconds, exit_on_sigterm, load_bucket, start_sidecar, stop, work_dir

from kvcache.natsio.nats_server import NatsServer


def run(sock: str, keys: int, per: int, requests: int, timeout: float) -> float:
    """MGETs a second of one redis-benchmark run."""
    cmd = [REDIS_BENCHMARK, "-s", sock, "-r", str(keys), "-n", str(requests), "-c", "20", "--csv",
           "MGET", *(["key:__rand_int__"] * per)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    rows = list(csv.DictReader(io.StringIO(r.stdout)))
    if r.returncode != 0 or len(rows) != 1:
        raise RuntimeError(f"{' '.join(cmd)} failed: {r.stdout[-300:]} {r.stderr[-300:]}")
    return float(rows[0]["rps"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--other-src", type=Path, required=True)
    p.add_argument("--size", type=int, default=512 * 1024)
    p.add_argument("--keys", type=int, default=200)
    p.add_argument("--per", type=int, default=3, help="keys per MGET")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300)
    a = p.parse_args()
    exit_on_sigterm()
    extra = "max_payload: 8MB" if a.size > (1 << 20) else ""
    with work_dir("kvmget-", lambda: False) as work:
        server = NatsServer(work / "nats", extra_conf=extra).start()
        procs: list[subprocess.Popen] = []
        try:
            asyncio.run(load_bucket(server.url, b"m" * a.size, a.keys))
            this, this_sock = start_sidecar(work, server.url, a.keys, name="this")
            procs.append(this)
            other, other_sock = start_sidecar(work, server.url, a.keys, name="other", src=a.other_src)
            procs.append(other)
            cpu: dict[str, list[float]] = {"this": [], "other": []}
            rps: dict[str, list[float]] = {"this": [], "other": []}
            for i in range(a.repeat):
                order = [("this", this, this_sock), ("other", other, other_sock)]
                for name, proc, sock in order if i % 2 == 0 else order[::-1]:
                    c0 = cpu_seconds(proc.pid)
                    got = run(sock, a.keys, a.per, a.requests, a.timeout)
                    us = (cpu_seconds(proc.pid) - c0) / a.requests * 1e6
                    cpu[name].append(us)
                    rps[name].append(got)
                    print(f"run {i + 1} {name:5}: {got:10,.0f} MGET/s {us:8.1f} CPU us/MGET", file=sys.stderr)
            ratios = [t / o for t, o in zip(cpu["this"], cpu["other"], strict=True)]
            print(f"\nMGET of {a.per} keys of {a.size} bytes among {a.keys}, -c 20 -P 1, {a.requests} a run; "
                  f"other: {a.other_src}")
            print("| sidecar | MGET/s (median) | server CPU us/MGET (median, min-max) |")
            print("|---|---:|---:|")
            for name in ("this", "other"):
                print(f"| {name} | {statistics.median(rps[name]):,.0f} | {statistics.median(cpu[name]):.1f} "
                      f"({min(cpu[name]):.1f}-{max(cpu[name]):.1f}) |")
            print(f"\nCPU this / other per run pair: median {statistics.median(ratios):.2f} "
                  f"({min(ratios):.2f}-{max(ratios):.2f})")
        finally:
            for proc in procs:
                stop(proc)
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
