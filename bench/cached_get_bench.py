"""GETs the near cache answers against GETs the replica answers: server CPU per GET.

    python bench/cached_get_bench.py [--keys 10000] [--requests 400000] [--repeat 3] [--value-size 100]

One bucket of --keys keys and two sidecars on it, side by side: `replicated` replicates the
whole bucket; `cached` replicates nothing (`--bucket key:`) and holds every key in its near
cache (`--cache-max-keys`), warmed by reading each key once before the runs. redis-benchmark
(`-t get -r <keys>`, so every GET names one of the bucket's keys) drives each in turn, `-c 50
-P 16` and `-c 50`, --repeat times, alternating; the server's CPU per GET comes from
/proc/<pid>/stat (utime + stime) over each run. The cached sidecar must answer every GET
without NATS: INFO `gets_remote` and `routed_requests` do not move during its runs (checked).

Prints the median throughput and CPU per GET of each, their spread, and the ratio cached /
replicated per run pair. Native modules: the table's header says which serve (kvcache.native).
Starts its own nats-server and sidecars (127.0.0.1, Unix sockets) and stops only those.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from socket_bench import BUCKET, benchmark, cpu_seconds, exit_on_sigterm, load_bucket, start_sidecar, stop, work_dir
from socket_bench import key as key_of
from socket_bench import wait_until as poll

from kvcache import native
from kvcache.app.client import Client
from kvcache.natsio.nats_server import NatsServer, die_with_parent

VARIANTS = [("-c 50 -P 16", ["-c", "50", "-P", "16"]), ("-c 50", ["-c", "50"])]


def start_cached(work: Path, url: str, keys: int) -> tuple[subprocess.Popen, str]:
    """The sidecar that replicates nothing of the bucket and caches every key."""
    sock = str(work / "cached.sock")
    log = open(work / "cached.log", "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcache", "serve", "--nats", url, "--bucket", f"{BUCKET}:",
         "--cache-max-keys", str(keys * 2), "--data-dir", str(work / "data-cached"), "--socket", sock,
         "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT, preexec_fn=die_with_parent)
    log.close()

    def synced() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"sidecar exited with {proc.returncode}; see {work}/cached.log")
        with Client(sock, timeout=2) as c:
            return c.info("buckets")["buckets"].get(BUCKET, {}).get("synced") == 1
    poll(synced, 120, "the cached sidecar synced")
    with Client(sock, timeout=60) as c:
        for start in range(0, keys, 200):
            c.mget([f"{BUCKET}:{key_of(i)}" for i in range(start, min(keys, start + 200))])
        for i in range(0, keys, max(1, keys // 100)):  # a GET of a cached key reaches the fast path
            c.get(f"{BUCKET}:{key_of(i)}")
        cached = c.info("buckets")["buckets"][BUCKET].get("cache_keys", 0)
    if cached != keys:
        raise RuntimeError(f"the near cache holds {cached} keys of {keys}")
    return proc, sock


def upstream(sock: str) -> tuple[int, int]:
    with Client(sock) as c:
        info = c.info("all")
    return int(info["stats"]["gets_remote"]), int(info["routing"]["routed_requests"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keys", type=int, default=10_000)
    p.add_argument("--requests", type=int, default=400_000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--value-size", type=int, default=100)
    p.add_argument("--timeout", type=float, default=300)
    a = p.parse_args()
    exit_on_sigterm()
    with work_dir("kvcached-", lambda: False) as work:
        server = NatsServer(work / "nats").start()
        procs: list[subprocess.Popen] = []
        try:
            asyncio.run(load_bucket(server.url, b"v" * a.value_size, a.keys))
            rep, rep_sock = start_sidecar(work, server.url, a.keys, name="replicated")
            procs.append(rep)
            cac, cac_sock = start_cached(work, server.url, a.keys)
            procs.append(cac)
            targets = {"replicated": (rep, rep_sock), "cached": (cac, cac_sock)}
            rps: dict[tuple[str, str], list[float]] = {}
            cpu: dict[tuple[str, str], list[float]] = {}
            before = upstream(cac_sock)
            for label, args in VARIANTS:
                for run in range(a.repeat):
                    for name, (proc, sock) in targets.items():
                        c0 = cpu_seconds(proc.pid)
                        got = benchmark(sock, a.requests, args, a.timeout, reads_over=a.keys)
                        us = (cpu_seconds(proc.pid) - c0) / a.requests * 1e6
                        rps.setdefault((name, label), []).append(got["rps"])
                        cpu.setdefault((name, label), []).append(us)
                        print(f"{label:12} {name:10} run {run + 1}: {got['rps']:>10,.0f} GET/s "
                              f"{us:6.2f} CPU us/GET", file=sys.stderr)
            after = upstream(cac_sock)
            if after != before:
                raise RuntimeError(f"the cached sidecar asked NATS during the runs: (gets_remote, "
                                   f"routed_requests) {before} -> {after}")
            print(f"\n{a.keys} keys of {a.value_size} bytes, {a.requests} GETs a run, {a.repeat} runs "
                  f"each, alternating; native: {native.report()}")
            print("the cached sidecar asked NATS 0 times during the runs\n")
            print("| redis-benchmark | sidecar | GET/s (median, min-max) | server CPU us/GET (median, min-max) "
                  "| CPU cached / replicated (per run pair) |")
            print("|---|---|---:|---:|---:|")
            for label, _ in VARIANTS:
                ratios = [c / r for c, r in zip(cpu[("cached", label)], cpu[("replicated", label)], strict=True)]
                for name in targets:
                    r, c = rps[(name, label)], cpu[(name, label)]
                    ratio = (f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
                             if name == "cached" else "")
                    print(f"| `{label}` | {name} | {statistics.median(r):,.0f} ({min(r):,.0f}-{max(r):,.0f}) | "
                          f"{statistics.median(c):.2f} ({min(c):.2f}-{max(c):.2f}) | {ratio} |")
        finally:
            for proc in procs:
                stop(proc)
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
