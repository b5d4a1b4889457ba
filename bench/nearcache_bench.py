"""The near cache against its alternatives on a bucket too big to replicate.

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

`--connections N` spreads the Zipf reads over N concurrent connections (asyncio, one
AsyncClient each, every connection one read in flight, each taking the next read of the
sequence); 1, the default, is one kvcache.Client reading in turn. The checks are the same for
both: a read is stale when it returns a counter older than the newest write acknowledged more
than max_stale_ms before the read was sent, and a regression when it returns an older counter
than a read of the same key (on any connection) that completed before it was sent. Latency is
from send to reply as the client sees it (with N > 1 it includes waiting for the client's own
event loop). NATS requests/s is INFO `routed_requests` over the reads (what went upstream:
reads that joined a request in flight, INFO `reads_coalesced`, sent none); reads via NATS/s is
INFO `gets_remote` (every read NATS answered, joined or not).

`--sidecar-src DIR` runs each variant against the kvcache of source tree DIR first (rows
"(before)"; `python -P -m kvcache serve` with PYTHONPATH=DIR, e.g. a `git worktree` of an older
commit with `kvcache/_native/*.so` copied in), then this checkout's, on the same bucket, reads
and writer. `--inject-stale N` checks the checkers: of the reads whose fault could be seen,
every Nth is taken as having returned an older counter than it did: the one before the newest
write acknowledged more than max_stale_ms before the read was sent (so stale), or, for a key
with no such write yet, one below what a read that completed before it was sent saw (so a
regression). The run prints how many of each it made: stale must come out at least the first.

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
from support.sidecar_proc import SidecarProcess, check_src

from kvcache import native
from kvcache.app.client import AsyncClient, Client, ResponseError
from kvcache.natsio.nats_server import NatsServer

ROOT = Path(__file__).resolve().parent.parent
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


@dataclass
class Checker:
    """The per-read checks, over every connection of a run: `sent` when a read goes out,
    `check` when its reply is in. One thread calls both (the asyncio loop, or the one
    connection's loop), so "completed before this read was sent" is exact: a read counts once
    its reply was seen, and the floor a read is held to is taken when it is sent."""

    writer: Writer
    inject_every: int = 0  # --inject-stale
    stale: int = 0
    regressions: int = 0
    injected: int = 0  # reads made stale on purpose (--inject-stale)
    injected_regressions: int = 0  # reads made older than a completed read, not stale
    highest: dict[str, int] = field(default_factory=dict)  # key -> newest counter read back
    _detectable: int = 0

    def sent(self, key: str) -> tuple[float, int]:
        """When the read of `key` is sent, and the newest counter a completed read saw."""
        return time.monotonic(), self.highest.get(key, -1)

    def check(self, key: str, t_sent: float, floor: int, value: bytes | None) -> None:
        if key not in self.writer.acked:
            return
        n = counter(value)
        # after the reply, so every write acknowledged before t_sent is in the writer's log
        bound = self.writer.newest_before(key, t_sent - MAX_STALE_MS / 1000)
        if self.inject_every and (bound >= 0 or floor >= 0):
            self._detectable += 1
            if self._detectable % self.inject_every == 0:  # a fault on purpose:
                if bound >= 0:
                    n = bound - 1  # the value before that write
                    self.injected += 1
                else:
                    n = floor - 1  # older than a read that completed before this one was sent
                    self.injected_regressions += 1
        if n < bound:
            self.stale += 1
        if n < floor:
            self.regressions += 1
        if n > self.highest.get(key, -1):
            self.highest[key] = n


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def replica_mb(data_dir: Path) -> float:
    return sum(f.stat().st_size for f in (data_dir / "replica").glob("*")) / (1 << 20)


def reads_in_turn(c: Client, ranks: list[int], checker: Checker) -> list[float]:
    """One connection, one read at a time: the latencies (µs)."""
    lat: list[float] = []
    for rank in ranks:
        key = key_of(rank)
        t_sent, floor = checker.sent(key)
        t0 = time.perf_counter()
        value = c.get(key)
        lat.append((time.perf_counter() - t0) * 1e6)
        checker.check(key, t_sent, floor, value)
    return lat


async def reads_concurrent(path: str, ranks: list[int], connections: int, checker: Checker) -> list[float]:
    """`connections` connections, each with one read in flight, taking the reads in order:
    the latencies (µs). All connections are open (a PING each) before the first read."""
    clients = [AsyncClient(path, timeout=30) for _ in range(connections)]
    lat: list[float] = []
    cursor = 0

    async def reader(c: AsyncClient) -> None:
        nonlocal cursor
        while cursor < len(ranks):
            key = key_of(ranks[cursor])
            cursor += 1
            t_sent, floor = checker.sent(key)
            t0 = time.perf_counter()
            value = await c.get(key)
            lat.append((time.perf_counter() - t0) * 1e6)
            checker.check(key, t_sent, floor, value)

    try:
        await asyncio.gather(*(c.ping() for c in clients))
        # every read has its own 30 s timeout; the whole run a bound of its own
        async with asyncio.timeout(max(600.0, len(ranks) / 20)):
            await asyncio.gather(*(reader(c) for c in clients))
    finally:
        await asyncio.gather(*(c.aclose() for c in clients), return_exceptions=True)
    return lat


def sidecar_at(data_dir: Path, url: str, spec: str, extra: list[str], src: Path | None) -> SidecarProcess:
    """The sidecar: this checkout's as always (src None), or the kvcache of source tree `src`,
    `python -P -m kvcache serve` with PYTHONPATH=src (-P: the working directory does not come
    before it on sys.path)."""
    sc = SidecarProcess(data_dir, url, [spec], env=None if src is None else {"PYTHONPATH": str(src)},
                        extra=["--log-level", "warning", "--max-stale-ms", str(MAX_STALE_MS), *extra])
    if src is not None:
        sc.args[1:1] = ["-P"]
    return sc


def upstream(c: Client) -> tuple[int, int]:
    """INFO routed_requests and reads_coalesced (0 for a field this sidecar lacks)."""
    routing = c.info("routing").get("routing", {})
    stats = c.info("stats").get("stats", {})
    return int(routing.get("routed_requests", 0)), int(stats.get("reads_coalesced", 0))


@dataclass
class Run:
    """How a variant's reads are made and checked, and which kvcache serves them."""

    connections: int = 1
    inject_every: int = 0
    src: Path | None = None  # None: this checkout, as always
    suffix: str = ""  # appended to each row's label


def run_one(label: str, url: str, tmp: Path, spec: str, extra: list[str], ranks: list[int],
            writer: Writer, scan: int = 0, n_keys: int = 0, run: Run | None = None) -> dict:
    run = run or Run()
    label += run.suffix
    sc = sidecar_at(tmp / label.replace(" ", "-").replace("(", "").replace(")", ""), url, spec, extra, run.src)
    sc.start(timeout=900)
    try:
        c = Client(sc.socket, timeout=30)
        native = c.info("server").get("server", {}).get("native", {})
        twins = sorted(k for k, v in native.items() if v != "native") if isinstance(native, dict) else []
        if twins:
            print(f"{label}: NOT all native (twins: {', '.join(twins)}): latencies are not comparable",
                  flush=True)
        checker = Checker(writer, run.inject_every)
        s0 = c.info("stats")["stats"]
        r0, k0 = upstream(c)
        t_start = time.monotonic()
        if run.connections == 1:
            lat = reads_in_turn(c, ranks, checker)
        else:
            lat = asyncio.run(reads_concurrent(sc.socket, ranks, run.connections, checker))
        elapsed = time.monotonic() - t_start
        s1 = c.info("stats")["stats"]
        r1, k1 = upstream(c)
        local = (s1["gets_local"] - s0["gets_local"]) + (s1.get("gets_cached", 0) - s0.get("gets_cached", 0))
        remote = s1["gets_remote"] - s0["gets_remote"]
        lat.sort()
        out = {"label": label, "reads": len(ranks), "without_nats": local / max(local + remote, 1),
               "p50_us": statistics.median(lat), "p99_us": percentile(lat, 99),
               "direct_gets_per_s": remote / elapsed, "requests_per_s": (r1 - r0) / elapsed,
               "coalesced": k1 - k0, "reads_per_s": len(ranks) / elapsed,
               "stale": checker.stale, "regressions": checker.regressions, "injected": checker.injected,
               "injected_regressions": checker.injected_regressions,
               "rss_mb": rss_mb(sc.proc.pid), "replica_mb": replica_mb(sc.data_dir)}
        bucket = c.info("buckets")["buckets"][BUCKET]
        out["cache_keys"] = bucket.get("cache_keys", 0)
        out["cache_updates"] = bucket.get("cache_updates", 0)
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
    p.add_argument("--connections", type=int, default=1, metavar="N",
                   help="spread the Zipf reads over N concurrent connections (default 1: one, in turn)")
    p.add_argument("--sidecar-src", type=Path, default=None, metavar="DIR",
                   help="also run each variant against the kvcache of this source tree (rows \"(before)\")")
    p.add_argument("--inject-stale", type=int, default=0, metavar="N",
                   help="check the checkers: every Nth read whose staleness could be seen is taken as stale")
    args = p.parse_args()
    if not 1 <= args.connections <= 10_000:
        raise SystemExit("nearcache_bench: --connections 1..10000")
    print(f"native: {native.report()}")
    runs = [Run(args.connections, args.inject_stale)]
    if args.sidecar_src is not None:
        src = args.sidecar_src.resolve()
        check_src(src, "nearcache_bench")
        check_src(ROOT, "nearcache_bench")
        runs = [Run(args.connections, args.inject_stale, src, " (before)"),
                Run(args.connections, args.inject_stale, ROOT)]
        print(f"before: the kvcache of {src}; then this checkout's ({ROOT})")
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
                    for run in runs:  # this checkout's run (the last) writes the logs hotkeys reads
                        log_dir = logs if run is runs[-1] else tmp / "access-logs-before"
                        results.append(run_one("no cache", server.url, tmp, f"{BUCKET}:none.>",
                                               ["--access-log-rate", "1", "--access-log-dir", str(log_dir)],
                                               ranks, writer, run=run))
                if "lru" in only:
                    for run in runs:
                        results.append(run_one("plain LRU", server.url, tmp, f"{BUCKET}:",
                                               ["--cache-max-keys", str(args.cache), "--cache-admission", "lru"],
                                               ranks, writer, scan=args.scan, n_keys=args.keys, run=run))
                if "near" in only:
                    for run in runs:
                        results.append(run_one("near cache (frequency)", server.url, tmp, f"{BUCKET}:",
                                               ["--cache-max-keys", str(args.cache)], ranks, writer,
                                               scan=args.scan, n_keys=args.keys, run=run))
                if "filter" in only and logs.exists():
                    filters = hotkeys_filters(logs, tmp / "hotkeys")
                    print(f"hotkeys --cover 0.9 proposes {len(filters)} filters: {', '.join(filters[:6])}"
                          f"{', ...' if len(filters) > 6 else ''}")
                    for run in runs:
                        try:
                            results.append(run_one(f"hotkeys filter ({len(filters)})", server.url, tmp,
                                                   f"{BUCKET}:{','.join(filters)}", [], ranks, writer, run=run))
                        except Exception as e:  # a sidecar that cannot run the filters is the result
                            print(f"hotkeys filter{run.suffix}: the sidecar did not serve with them: {e}")
            finally:
                writer.stop()
            print(f"writer: {writer.writes} writes to {len(writer.acked)} hot keys "
                  f"({writer.per_second}/s)")
            if args.inject_stale:
                print("--inject-stale: reads given an older counter on purpose, per variant (stale must "
                      "be at least the first, regressions most likely at least the sum): "
                      + "; ".join(f"{r['label']}: {r['injected']} stale, {r['injected_regressions']} "
                                  "older than a read before only" for r in results))
            print(f"\nreads over {args.connections} connection{'s' if args.connections > 1 else ''}"
                  f"{' (concurrent)' if args.connections > 1 else ' (in turn)'}")
            print("\n| variant | without NATS | p50 µs | p99 µs | reads via NATS/s (gets_remote) | "
                  "NATS requests/s (routed_requests) | reads coalesced | reads/s | stale | "
                  "regressions | cached / replicated keys | cache updates | RSS MiB | replica MiB |")
            print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
            for r in results:
                print(f"| {r['label']} | {r['without_nats']:.1%} | {r['p50_us']:.0f} | {r['p99_us']:.0f} | "
                      f"{r['direct_gets_per_s']:.0f} | {r['requests_per_s']:.0f} | {r['coalesced']} | "
                      f"{r['reads_per_s']:.0f} | {r['stale']} | "
                      f"{r['regressions']} | {r['cache_keys']} / {r['replica_keys']} | {r['cache_updates']} | "
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
