"""The near cache against its alternatives on a bucket too big to replicate (issue 17).

    python bench/nearcache_bench.py [--keys 1000000] [--cache 10000] [--reads 60000]

A bucket of --keys keys of 100 bytes, named `g<rank // 100>.<rank % 100>` (groups of 100, so
`kvcache hotkeys` has parents to propose filters over). A Zipf(--zipf) read workload of --reads
GETs through kvcache.Client, while a writer updates 1% of the hot keys (the --cache most read)
each second. Four sidecars in turn, on the same bucket and the same reads:

- no cache: the bucket replicates nothing and reads every key from NATS (today);
- plain LRU: a near cache of --cache keys admitting every answer (`cache_admission = lru`);
- near cache: the same size, admitting by frequency (the default);
- hotkeys filter: the filters `kvcache hotkeys --cover 0.9` proposes from the no-cache run's
  access logs, replicated (no cache).

For each: the share of reads answered without NATS, p50/p99 read latency, Direct Gets sent
upstream per second, reads older than max_stale_ms (a newer write acknowledged more than
max_stale_ms before the read) and read regressions (a key read older than before), and the
sidecar's RSS and replica file size at the end; then for the near cache, the same after a
scan of --scan distinct cold keys (the bucket's tail, read once each, then keys it does not
hold), for the plain LRU and the near cache.

`--absent N` leaves every Nth key by rank unwritten (ranks N-1, 2N-1, ...), hot ones included:
a workload where a share of reads, some of them hot, ask for keys the bucket does not hold
(the near cache keeps not-founds too).

Starts its own nats-server and sidecars (Unix socket); every loop bounded by count and time.
"""
from __future__ import annotations

import argparse
import asyncio
import bisect
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import nats

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.checkers import percentile
from support.sidecar_proc import SidecarProcess

from kvcache import native
from kvcache.app.client import Client, ResponseError
from kvcache.natsio.server import NatsServer

BUCKET = "zipf"
MAX_STALE_MS = 5000


def key_of(rank: int) -> str:
    return f"g{rank // 100}.{rank % 100}"


def zipf_sample(n_keys: int, s: float, count: int, seed: int) -> list[int]:
    """`count` ranks drawn from Zipf(s) over n_keys (rank 0 the most read)."""
    weights = [1.0 / (r + 1) ** s for r in range(n_keys)]
    cdf, acc = [], 0.0
    for w in weights:
        acc += w
        cdf.append(acc)
    rnd = random.Random(seed)
    return [min(bisect.bisect_left(cdf, rnd.random() * acc), n_keys - 1) for _ in range(count)]


@dataclass
class Writer:
    """Updates 1% of the hot keys each second; remembers when each value was acknowledged."""

    url: str
    hot: list[str]
    per_second: int
    acked: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    writes: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    async def _run(self) -> None:
        nc = await nats.connect(self.url)
        js = nc.jetstream()
        rnd = random.Random(11)
        t0 = time.monotonic()
        while not self._stop.is_set() and self.writes < 1_000_000:
            target = t0 + self.writes / self.per_second
            delay = target - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            key = rnd.choice(self.hot)
            n = len(self.acked.get(key, ()))
            await js.publish(f"$KV.{BUCKET}.{key}", b"w%d" % n)
            self.acked.setdefault(key, []).append((time.monotonic(), n))
            self.writes += 1
        await nc.close()

    def newest_before(self, key: str, t: float) -> int:
        """The counter of the newest write of `key` acknowledged before `t` (-1: none)."""
        log = self.acked.get(key)
        if not log:
            return -1
        i = bisect.bisect_right(log, (t, 1 << 60))
        return log[i - 1][1] if i else -1


def counter(value: bytes | None) -> int:
    return int(value[1:]) if value and value[:1] == b"w" else -1


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def replica_mb(data_dir: Path) -> float:
    return sum(f.stat().st_size for f in (data_dir / "replica").glob("*")) / (1 << 20)


def run_one(label: str, url: str, tmp: Path, spec: str, extra: list[str], ranks: list[int],
            writer: Writer, scan: int = 0, n_keys: int = 0) -> dict:
    sc = SidecarProcess(tmp / label.replace(" ", "-"), url, [spec],
                        extra=["--log-level", "warning", "--max-stale-ms", str(MAX_STALE_MS), *extra])
    sc.start(timeout=900)
    try:
        c = Client(sc.socket, timeout=30)
        s0 = c.info("stats")["stats"]
        lat: list[float] = []
        stale = regressions = 0
        highest: dict[str, int] = {}
        t_start = time.monotonic()
        for rank in ranks:
            key = key_of(rank)
            t0 = time.perf_counter()
            value = c.get(key)
            lat.append((time.perf_counter() - t0) * 1e6)
            n = counter(value)
            if key in writer.acked:
                if n < writer.newest_before(key, time.monotonic() - MAX_STALE_MS / 1000):
                    stale += 1
                if n < highest.get(key, -1):
                    regressions += 1
                highest[key] = max(highest.get(key, -1), n)
        elapsed = time.monotonic() - t_start
        s1 = c.info("stats")["stats"]
        local = (s1["gets_local"] - s0["gets_local"]) + (s1.get("gets_cached", 0) - s0.get("gets_cached", 0))
        remote = s1["gets_remote"] - s0["gets_remote"]
        lat.sort()
        out = {"label": label, "reads": len(ranks), "without_nats": local / max(local + remote, 1),
               "p50_us": statistics.median(lat), "p99_us": percentile(lat, 99),
               "direct_gets_per_s": remote / elapsed, "reads_per_s": len(ranks) / elapsed,
               "stale": stale, "regressions": regressions,
               "rss_mb": rss_mb(sc.proc.pid), "replica_mb": replica_mb(sc.data_dir)}
        bucket = c.info("buckets")["buckets"][BUCKET]
        out["cache_keys"] = bucket.get("cache_keys", 0)
        out["replica_keys"] = bucket["keys"]
        if scan:
            # distinct cold keys: every existing key from rank 10 x the cache's size down the
            # tail (each read once, so each answer is offered to the cache), then keys that do
            # not exist, up to `scan`; in MGETs of 100, each followed by 10 reads of the Zipf
            # workload, whose share answered without NATS says whether the hot keys stayed
            cold = [key_of(r) for r in range(min(10 * len(writer.hot), n_keys), n_keys)][:scan]
            cold += [f"cold.{i}" for i in range(scan - len(cold))]
            hits = reads = 0
            for start in range(0, len(cold), 100):
                c.mget(cold[start:start + 100])
                for _ in range(10):
                    e = c.entry(key_of(ranks[reads % len(ranks)]))
                    reads += 1
                    hits += e is not None and e.source in ("cache", "local")
            bucket = c.info("buckets")["buckets"][BUCKET]
            out["after_scan"] = {"cache_keys": bucket.get("cache_keys", 0), "rss_mb": rss_mb(sc.proc.pid),
                                 "replica_mb": replica_mb(sc.data_dir), "hit_ratio": hits / reads,
                                 "reads": reads}
        c.close()
        return out
    finally:
        sc.stop()


def hotkeys_filters(log_dir: Path, out_dir: Path) -> list[str]:
    """What `kvcache hotkeys --cover 0.9` proposes for the bucket, from its filters.toml."""
    subprocess.run([sys.executable, "-m", "kvcache", "hotkeys", str(log_dir), "--cover", "0.9",
                    "--out", str(out_dir)], check=True, stdout=subprocess.DEVNULL, timeout=900)
    for line in (out_dir / "filters.toml").read_text().splitlines():
        if line.startswith("keys = ["):
            return [f.strip().strip('"') for f in line[len("keys = ["):line.index("]")].split(",")]
    raise SystemExit("hotkeys proposed no filter")


def written(rank: int, absent: int) -> bool:
    """Is this rank's key in the bucket (--absent leaves every Nth out)?"""
    return not absent or rank % absent != absent - 1


async def fill(url: str, keys: int, absent: int = 0) -> None:
    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.create_key_value(bucket=BUCKET, direct=True)
    value = b"v" * 100
    for i in range(0, keys, 2000):
        await asyncio.gather(*(js.publish(f"$KV.{BUCKET}.{key_of(r)}", value)
                               for r in range(i, min(keys, i + 2000)) if written(r, absent)))
    await nc.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keys", type=int, default=1_000_000)
    p.add_argument("--cache", type=int, default=10_000)
    p.add_argument("--reads", type=int, default=60_000)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--scan", type=int, default=1_000_000)
    p.add_argument("--only", default="none,lru,near,filter")
    p.add_argument("--absent", type=int, default=0, metavar="N", help="leave every Nth key unwritten")
    args = p.parse_args()
    print(f"native: {native.report()}")
    with tempfile.TemporaryDirectory(prefix="kvnc-") as d:
        tmp = Path(d)
        server = NatsServer(tmp / "nats").start()
        try:
            t0 = time.monotonic()
            asyncio.run(fill(server.url, args.keys, args.absent))
            print(f"bucket {BUCKET}: {args.keys} keys of 100 bytes in {time.monotonic() - t0:.0f} s; "
                  f"Zipf({args.zipf}) over them, {args.reads} reads; near caches of {args.cache} keys"
                  + (f"; every {args.absent}th key absent" if args.absent else ""))
            ranks = zipf_sample(args.keys, args.zipf, args.reads, seed=5)
            if args.absent:
                missing = sum(not written(r, args.absent) for r in ranks)
                print(f"reads of absent keys: {missing} ({missing / len(ranks):.1%})")
            hot = [key_of(r) for r in range(args.cache) if written(r, args.absent)]
            writer = Writer(server.url, hot, max(1, args.cache // 100))
            writer.start()
            results = []
            only = args.only.split(",")
            logs = tmp / "access-logs"
            try:
                if "none" in only:
                    results.append(run_one("no cache", server.url, tmp, f"{BUCKET}:none.>",
                                           ["--access-log-rate", "1", "--access-log-dir", str(logs)],
                                           ranks, writer))
                if "lru" in only:
                    results.append(run_one("plain LRU", server.url, tmp, f"{BUCKET}:",
                                           ["--cache-max-keys", str(args.cache), "--cache-admission", "lru"],
                                           ranks, writer, scan=args.scan, n_keys=args.keys))
                if "near" in only:
                    results.append(run_one("near cache (frequency)", server.url, tmp, f"{BUCKET}:",
                                           ["--cache-max-keys", str(args.cache)], ranks, writer, scan=args.scan,
                                           n_keys=args.keys))
                if "filter" in only and logs.exists():
                    filters = hotkeys_filters(logs, tmp / "hotkeys")
                    print(f"hotkeys --cover 0.9 proposes {len(filters)} filters: {', '.join(filters[:6])}"
                          f"{', ...' if len(filters) > 6 else ''}")
                    try:
                        results.append(run_one(f"hotkeys filter ({len(filters)})", server.url, tmp,
                                               f"{BUCKET}:{','.join(filters)}", [], ranks, writer))
                    except Exception as e:  # a sidecar that cannot run the filters is the result
                        print(f"hotkeys filter: the sidecar did not serve with them: {e}")
            finally:
                writer.stop()
            print(f"writer: {writer.writes} writes to {len(writer.acked)} hot keys "
                  f"({writer.per_second}/s)")
            print("\n| variant | without NATS | p50 µs | p99 µs | Direct Gets/s | reads/s | stale | "
                  "regressions | cached / replicated keys | RSS MiB | replica MiB |")
            print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
            for r in results:
                print(f"| {r['label']} | {r['without_nats']:.1%} | {r['p50_us']:.0f} | {r['p99_us']:.0f} | "
                      f"{r['direct_gets_per_s']:.0f} | {r['reads_per_s']:.0f} | {r['stale']} | "
                      f"{r['regressions']} | {r['cache_keys']} / {r['replica_keys']} | "
                      f"{r['rss_mb']:.0f} | {r['replica_mb']:.1f} |")
            for r in results:
                if "after_scan" in r:
                    a = r["after_scan"]
                    print(f"\n{r['label']}, after a scan of {args.scan} distinct cold keys: "
                          f"cached keys {a['cache_keys']}, "
                          f"RSS {a['rss_mb']:.0f} MiB, replica {a['replica_mb']:.1f} MiB; the Zipf reads "
                          f"interleaved with it ({a['reads']}): {a['hit_ratio']:.1%} answered without NATS")
        finally:
            server.stop()


if __name__ == "__main__":
    try:
        main()
    except ResponseError as e:
        raise SystemExit(f"nearcache_bench: {e}") from None
