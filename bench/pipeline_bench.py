"""Pipelined cold reads behind a delayed NATS link: one cold GET against a pipeline of 100 GETs
of distinct cold keys on one connection (redis-py `pipeline(transaction=False)`), through the
sidecar, in the same run; optionally the same against another source tree's sidecar.

    python bench/pipeline_bench.py --delay-ms 20 --repeat 10
    python bench/pipeline_bench.py --other-src /tmp/kv-before   # both trees, same run

A nats-server on 127.0.0.1 with bucket `pb` (100-byte values); the sidecar replicates
`local.>` only and reaches NATS through a DelayProxy (a child process: it never competes with
the client for the GIL) that delays every byte `--delay-ms` each way. Every key is read once
(no near cache is configured; each read is a Direct Get). Prints each tree's single-read and
pipeline times (median, min-max over the repeats), their ratio (target: the pipeline within
2x a single read), and checks every pipeline's replies are in order and equal to the values.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.sidecar_proc import SidecarProcess, check_src
from support.topology import ProxyHost, nats_run

from kvcache.natsio.nats_server import NatsServer

BUCKET = "pb"


def value(i: int) -> bytes:
    return (b"%08d" % i) * 12 + b"pad."  # 100 bytes, distinct per key


def setup(url: str, n: int) -> None:
    async def fill(js):
        kv = await js.create_key_value(bucket=BUCKET, direct=True)
        for i in range(n):
            await kv.put(f"far.{i}", value(i))
        await kv.put("local.0", b"near")
    nats_run(url, fill)


def measure(sc: SidecarProcess, first: int, singles: int, repeat: int, width: int) -> dict:
    """Times (s) of `singles` cold GETs one at a time, then of `repeat` pipelines of `width`
    cold GETs; keys from `first` on, each read once."""
    r = redis.Redis(unix_socket_path=sc.socket, socket_timeout=60)
    try:
        r.get("local.0")  # connected, warm
        one, piped = [], []
        k = first
        for _ in range(singles):
            t = time.perf_counter()
            got = r.get(f"far.{k}")
            one.append(time.perf_counter() - t)
            assert got == value(k), (k, got)
            k += 1
        for _ in range(repeat):
            keys = range(k, k + width)
            p = r.pipeline(transaction=False)
            for i in keys:
                p.get(f"far.{i}")
            t = time.perf_counter()
            got = p.execute()
            piped.append(time.perf_counter() - t)
            if got != [value(i) for i in keys]:
                raise SystemExit(f"pipeline replies out of order or wrong at keys {k}..{k + width - 1}")
            k += width
        return {"one": one, "piped": piped, "next": k}
    finally:
        r.close()


def row(name: str, xs: list[float]) -> str:
    return f"{name:<28} {1000 * statistics.median(xs):9.1f} ms  ({1000 * min(xs):.1f}–{1000 * max(xs):.1f})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--delay-ms", type=float, default=20.0, help="one-way delay on the sidecar's NATS link")
    p.add_argument("--width", type=int, default=100, help="GETs per pipeline")
    p.add_argument("--repeat", type=int, default=10, help="pipelines per tree")
    p.add_argument("--singles", type=int, default=20, help="single cold GETs per tree")
    p.add_argument("--other-src", default=None, help="also run the sidecar of this source tree (e.g. a worktree "
                                                     "of an older commit)")
    a = p.parse_args()
    trees = [("this tree", None)] + ([("other tree", a.other_src)] if a.other_src else [])
    if a.other_src:
        check_src(Path(a.other_src), "pipeline_bench")
    n = len(trees) * (a.singles + a.repeat * a.width)
    work = Path(tempfile.mkdtemp(prefix="kv-pipeline-"))
    print(f"logs under {work}", flush=True)
    server = NatsServer(store_dir=work / "nats", jetstream=True).start()
    proxies = None
    try:
        setup(server.url, n)
        proxies = ProxyHost({"nats": server.port}, {"nats": a.delay_ms / 1000})
        results = {}
        first = 0
        for name, src in trees:
            sc = SidecarProcess(work / f"sc-{len(results)}", proxies.urls["nats"], buckets=[f"{BUCKET}:local.>"],
                                extra=["--max-stale-ms", "5000"], env={"PYTHONPATH": src} if src else None)
            if src:
                sc.args[1:1] = ["-P"]  # kvcache from that tree: keep the working directory off sys.path
            sc.start(wait_synced=True)
            try:
                res = measure(sc, first, a.singles, a.repeat, a.width)
            finally:
                sc.stop()
            first = res["next"]
            results[name] = res
        print(f"\n{a.width} pipelined cold GETs vs one cold GET, {a.delay_ms:g} ms each way "
              f"(median, min–max; {a.singles} singles, {a.repeat} pipelines):")
        for name, res in results.items():
            ratio = statistics.median(res["piped"]) / statistics.median(res["one"])
            print(row(f"{name}: one GET", res["one"]))
            print(row(f"{name}: {a.width} pipelined", res["piped"]) + f"   = {ratio:.2f}x one GET "
                  f"({'within' if ratio <= 2 else 'ABOVE'} the 2x target)")
        return 0
    finally:
        if proxies is not None:
            proxies.stop()
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
