"""Many buckets in one sidecar: start-up, memory and the idle load per bucket.

    python bench/buckets_bench.py --buckets 1000 --seconds 20

A test nats-server (with its monitoring port, for the JetStream API request count) holds
`--buckets` buckets of one key each; the sidecar is started on all of them. Reported: the
time from process start to every bucket synced, the sidecar's RSS, and, while idle for
`--seconds`, its CPU and the JetStream API requests it makes (per second and per bucket).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import nats
from support.sidecar_proc import SidecarProcess

from kvcache.natsserver import NatsServer, free_port


async def make_buckets(url: str, n: int) -> None:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        for i in range(0, n, 50):
            kvs = await asyncio.gather(*(js.create_key_value(bucket=f"t{j:04d}") for j in range(i, min(i + 50, n))))
            await asyncio.gather(*(kv.put("k", b"v") for kv in kvs))
    finally:
        await nc.close()


def api_requests(monitor: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/jsz", timeout=10) as r:
        return json.load(r)["api"]["total"]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().split()
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--buckets", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=20.0, help="idle measurement")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvbuckets-") as d:
        monitor = free_port()
        ns = NatsServer(Path(d) / "ns", monitor_port=monitor).start()
        try:
            asyncio.run(make_buckets(ns.url, args.buckets))
            sc = SidecarProcess(Path(d) / "sc", ns.url, buckets=[f"t{j:04d}" for j in range(args.buckets)])
            t0 = time.monotonic()
            with sc:
                sc.start(timeout=600)
                started = time.monotonic() - t0
                pid = sc.proc.pid
                rss_kb = int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0])
                a0, c0 = api_requests(monitor), cpu_seconds(pid)
                time.sleep(args.seconds)
                a1, c1 = api_requests(monitor), cpu_seconds(pid)
                sc.stop()
        finally:
            ns.stop()
    rate = (a1 - a0) / args.seconds
    print(f"{args.buckets} buckets: every one synced {started:.1f} s after start; RSS {rss_kb / 1024:.0f} MiB; "
          f"idle: {100 * (c1 - c0) / args.seconds:.1f}% of a core, {rate:.0f} JetStream API requests/s "
          f"({rate / args.buckets:.2f} per bucket)")


if __name__ == "__main__":
    main()
