"""Replication lag under a steady write load: from a write's publish to the sidecar serving
it over its socket, next to a nats-py KV watch (what an application would otherwise run to
keep a copy) receiving the same writes in the same run.

    python bench/lag_bench.py --rate 1000 --seconds 20

One JetStream server (R1 bucket) and a 3-node cluster (R3 bucket), on 127.0.0.1. The writer
publishes value i to one key at `rate`/s without waiting for acks (tests/checkers.py
lag_probe); the sidecar's lag of write i is when it first served a value >= i; the watch's is
when its watcher yielded value i. Both include the server's own commit (R3: a quorum).
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import nats

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.checkers import lag_probe, percentile, settled
from support.sidecar_proc import SidecarProcess
from support.topology import replicated_kv, start_cluster, start_single

BUCKET = "lag"
KEY = "lag.probe"


async def measure(urls: list[str], replicas: int, tmp: Path, rate: float, seconds: float) -> dict:
    nc = await nats.connect(servers=urls)
    sc = None
    try:
        js = nc.jetstream(timeout=10)
        kv = await replicated_kv(js, bucket=BUCKET, replicas=replicas)
        await settled(lambda: kv.put(KEY, b"-1"))
        sc = await asyncio.to_thread(SidecarProcess(tmp / f"sc{replicas}", ",".join(urls), buckets=[BUCKET],
                                             extra=["--log-level", "warning"]).start)
        arrived: dict[int, float] = {}
        watcher = await kv.watch(KEY)

        async def watch() -> None:
            async for e in watcher:
                if e is not None and e.value:
                    arrived[int(e.value)] = time.monotonic()

        watching = asyncio.create_task(watch())
        lag = await lag_probe(js, BUCKET, sc.socket, rate=rate, seconds=seconds, key=KEY)
        deadline = time.monotonic() + 10
        while len(arrived) < lag.writes + 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        watching.cancel()
        await watcher.stop()
        watch_lag = [arrived[i] - t for i, t in enumerate(lag.sent) if i in arrived]
        return {"sidecar": lag, "watch": watch_lag, "watch_missing": lag.writes - len(watch_lag)}
    finally:
        if sc:
            sc.kill()
        await nc.close()


def row(label: str, samples: list[float], extra: str = "") -> str:
    ms = [x * 1e3 for x in samples]
    return (f"| {label} | {len(ms)} | {percentile(ms, 50):.2f} | {percentile(ms, 99):.2f} | "
            f"{max(ms, default=float('nan')):.2f} | {extra} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--seconds", type=float, default=20.0)
    args = ap.parse_args()
    lines = []
    with tempfile.TemporaryDirectory(prefix="kvlag-") as d:
        tmp = Path(d)
        srv = start_single(tmp / "single")
        try:
            single = asyncio.run(measure([srv.url], 1, tmp, args.rate, args.seconds))
        finally:
            srv.stop()
        cluster = start_cluster(tmp / "hub", 3, None)
        try:
            r3 = asyncio.run(measure(cluster.urls, 3, tmp, args.rate, args.seconds))
        finally:
            cluster.stop()
    for name, res in (("single server, R1", single), ("3-node cluster, R3", r3)):
        lag = res["sidecar"]
        lines.append(row(f"{name}: sidecar serves it (socket)", lag.samples,
                         f"{lag.rate:.0f} writes/s, {lag.unseen} unseen"))
        lines.append(row(f"{name}: nats-py KV watch receives it", res["watch"],
                         f"{res['watch_missing']} missing"))
    print(f"\nreplication lag, {args.rate:.0f} writes/s for {args.seconds:.0f} s (ms)\n")
    print("| path | writes | p50 | p99 | max | |")
    print("|---|---:|---:|---:|---:|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
