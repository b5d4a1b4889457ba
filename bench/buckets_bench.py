"""Many buckets in one sidecar: start-up, memory and the idle load per bucket.

    python bench/buckets_bench.py --buckets 1000 --keys 100 --seconds 20

A test nats-server (with its monitoring port, for the JetStream API request count) holds
`--buckets` buckets of `--keys` keys each; the sidecar is started on all of them. Reported:
the time from process start to every bucket synced, the sidecar's RSS, the consumers on the
server, and, while idle for `--seconds`, the sidecar's CPU, the JetStream API requests it
makes and the messages the server sends it (consumer heartbeats), per second and per bucket.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import nats
from support.sidecar_proc import SidecarProcess

from kvcache.natsio.nats_server import NatsServer, free_port


async def make_buckets(url: str, n: int, keys: int) -> None:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        for i in range(0, n, 50):
            kvs = await asyncio.gather(*(js.create_key_value(bucket=f"t{j:04d}") for j in range(i, min(i + 50, n))))
            await asyncio.gather(*(kv.put(f"k{k}", b"v" * 100) for kv in kvs for k in range(keys)))
    finally:
        await nc.close()


def monitor_get(monitor: int, what: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/{what}", timeout=10) as r:
        return json.load(r)


def api_requests(monitor: int) -> int:
    return monitor_get(monitor, "jsz")["api"]["total"]


def messages_out(monitor: int) -> int:
    return monitor_get(monitor, "varz")["out_msgs"]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().split()
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--buckets", type=int, default=1000)
    ap.add_argument("--keys", type=int, default=100, help="keys per bucket (100-byte values)")
    ap.add_argument("--seconds", type=float, default=20.0, help="idle measurement")
    ap.add_argument("--metrics", action="store_true",
                    help="metrics listener on: also time scrapes of /metrics (rendered on the event loop)")
    ap.add_argument("--scrapes", type=int, default=10, help="with --metrics: scrapes, a second apart")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvbuckets-") as d:
        monitor = free_port()
        ns = NatsServer(Path(d) / "ns", monitor_port=monitor).start()
        try:
            asyncio.run(make_buckets(ns.url, args.buckets, args.keys))
            sc = SidecarProcess(Path(d) / "sc", ns.url, buckets=[f"t{j:04d}" for j in range(args.buckets)],
                                extra=["--metrics-listen", "127.0.0.1:0"] if args.metrics else [])
            t0 = time.monotonic()
            with sc:
                sc.start(timeout=600)
                started = time.monotonic() - t0
                rows = sc.buckets()
                assert len(rows) == args.buckets and all(r["keys"] == args.keys for r in rows.values()), \
                    "not every bucket synced with every key"
                consumers = monitor_get(monitor, "jsz")["consumers"]
                pid = sc.proc.pid
                rss_kb = int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0])
                a0, c0, m0 = api_requests(monitor), cpu_seconds(pid), messages_out(monitor)
                time.sleep(args.seconds)
                a1, c1, m1 = api_requests(monitor), cpu_seconds(pid), messages_out(monitor)
                scrapes = scrape_times(sc, args.scrapes) if args.metrics else ""
                sc.stop()
        finally:
            ns.stop()
    rate = (a1 - a0) / args.seconds
    msgs = (m1 - m0) / args.seconds
    print(f"{args.buckets} buckets of {args.keys} keys: every one synced {started:.1f} s after start; "
          f"RSS {rss_kb / 1024:.0f} MiB; {consumers} consumers; idle: {100 * (c1 - c0) / args.seconds:.1f}% of a "
          f"core, {rate:.1f} JetStream API requests/s ({rate / args.buckets:.3f} per bucket), {msgs:.0f} "
          f"messages/s from the server ({msgs / args.buckets:.2f} per bucket){scrapes}")


def scrape_times(sc: SidecarProcess, n: int = 10) -> str:
    """GET /metrics n times, a second apart: its size and wall time, the sidecar's CPU time
    per scrape, and the PING round trips a client measured meanwhile against the same
    client's over as long without scrapes (the snapshot holds the event loop for one
    callback; the exposition is built and formatted on it a chunk at a time). The CPU per
    scrape is the sidecar's CPU over the scraped window less its CPU over the quiet one
    (the same pinging client in both), divided by n."""
    assert sc.proc is not None
    pid = sc.proc.pid
    with sc.client() as c:
        address = c.info("server")["server"]["metrics_listen"]

    def pings(seconds: float) -> subprocess.Popen:
        """A client in a process of its own (this one's GIL is busy reading the scrapes)."""
        code = ("import sys, time; from kvcache.app.client import Client; out = []\n"
                f"c = Client({sc.socket!r}); end = time.monotonic() + {seconds}\n"
                "while time.monotonic() < end:\n"
                "    t0 = time.perf_counter(); c.ping(); out.append(time.perf_counter() - t0)\n"
                "print(' '.join(map(str, out)))")
        return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)

    def rtts(proc: subprocess.Popen) -> list[float]:
        return sorted(float(x) for x in proc.communicate(timeout=60)[0].split())

    c0 = cpu_seconds(pid)
    quiet = rtts(pings(n))
    c1 = cpu_seconds(pid)
    pinger = pings(n)
    times, size = [], 0
    for _ in range(n):
        t0 = time.perf_counter()
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as r:
            size = len(r.read())
        times.append(time.perf_counter() - t0)
        time.sleep(max(0.0, 1 - times[-1]))
    during = rtts(pinger)
    scrape_cpu = (cpu_seconds(pid) - c1 - (c1 - c0)) / n
    times.sort()

    def q(xs: list[float], p: float) -> str:
        return f"{1000 * xs[min(len(xs) - 1, int(p * len(xs)))]:.2f}"
    return (f"; /metrics: {size:,} bytes, {1000 * times[n // 2]:.0f} ms median ({1000 * times[-1]:.0f} slowest) of "
            f"{n}, {1000 * scrape_cpu:.1f} ms of the sidecar's CPU each; PING ms p50/p99/max "
            f"without scrapes {q(quiet, .5)}/{q(quiet, .99)}/{q(quiet, 1)}, "
            f"scraped every second {q(during, .5)}/{q(during, .99)}/{q(during, 1)}")

if __name__ == "__main__":
    main()
