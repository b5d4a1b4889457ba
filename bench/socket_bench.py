"""GET throughput and latency over the Unix socket: kvcache against redis-server, both driven
by the real `redis-benchmark`.

A measurement script, not a test. Everything runs on this host over loopback and Unix sockets,
in a temporary directory; every process it starts is stopped by its own PID; every wait is
bounded.

  1. starts a nats-server (kvcache.natsio.nats_server.NatsServer) and creates bucket `key` holding
     10,000 keys `000000000000`..`000000009999` (what `redis-benchmark -r 10000` puts after
     `key:`; `key:<n>` addresses bucket `key` in kvcache), then starts `kvcache serve` on it
     and waits until INFO says synced with every key;
  2. starts redis-server (no persistence) on a Unix socket with the same 10,000 keys
     `key:000000000000`... and the same value;
  3. runs `redis-benchmark -s SOCK -t get -r 10000 -n N --csv` with `-c 50`, `-c 50 -P 16`
     and `-c 1` against each (--repeat times, the two targets alternating), and prints a
     markdown table: the best run's requests/s, p50 and p99, the kvcache/redis ratio, and
     the server's own CPU time per request (from /proc/<pid>/stat; the median over the runs),
     which, unlike throughput, barely moves when other work shares the CPUs;
  4. checks kvcache's INFO: no protocol or remote errors, and every GET answered locally
     (gets_remote stays 0);
  5. with --profile, records the sidecar with `py-spy record` under the `-P 16` load and
     prints the functions with the most samples (own time and inclusive).

--bare adds a third target: bench/bare_server.py, a uvloop Protocol that answers each GET
with a fixed reply and looks nothing up: the least any server on uvloop spends per request.

--metrics adds a second sidecar on the same bucket with its metrics listener on (command
latency timed) and a scraper GETting /metrics every second throughout, and prints its
throughput and CPU per request against the first's (same run, runs alternating, the two
sidecars swapping order every other round).

--scale is the run at a realistic size: a 1,000,000-key bucket of 100-byte values (in both
servers), read over a 10,000-key hot set (`-r 10000`) and over every key (`-r 1000000`) at
`-c 50 -P 16` and `-c 50`, and each server's full/hot ratio beside the kvcache/redis one: a
cost that grows with the number of distinct keys read shows there, not in the 10k-key run.

    python bench/socket_bench.py
    python bench/socket_bench.py --requests 200000 --profile
    python bench/socket_bench.py --scale              # 1M keys, 100-byte values, -r 10k and 1M
    python bench/socket_bench.py --scale --bare       # and the bare uvloop server beside them
    python bench/socket_bench.py --metrics            # metrics listener on and scraped, against off
    python bench/socket_bench.py --sizes 4k:20000,64k:2000,512k:200,1m:100,4m:25 --repeat 3

--sizes is the value-size run: per SIZE:KEYS a bucket of KEYS keys of SIZE bytes (random bytes,
its own nats-server, max_payload raised to 8 MiB for values over the 1 MiB default), a sidecar
replicating it and a redis-server holding the same keys; `redis-benchmark -t get -c 20 -r KEYS`
at `-P 1` and `-P 8`, -n scaled by the size (about 2 GB of values a run, 2,000-200,000 GETs;
--requests fixes it), the targets alternating, medians of --repeat runs. Per size: the
kvcache/redis GET/s ratio, each server's CPU per GET (/proc/<pid>/stat), redis-benchmark's own
CPU per GET (getrusage(RUSAGE_CHILDREN) around each run: near a whole core, it is the
bottleneck) and the sidecar's peak RSS (VmHWM), with the native modules the sidecar runs.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import csv
import io
import os
import random
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import nats

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvcache.app.client import Client, ConnectionFailed
from kvcache.natsio.nats_server import NatsServer, die_with_parent

BUCKET = "key"
NKEYS = 10_000   # the default bucket: redis-benchmark -r 10000's whole key space
METRICS = "kvcache+metrics"  # --metrics: the second sidecar, its metrics listener on and scraped
SCALE_KEYS = 1_000_000
REDIS_SERVER = "/usr/bin/redis-server"
REDIS_BENCHMARK = "/usr/bin/redis-benchmark"
VARIANTS = [("-c 50", ["-c", "50"]), ("-c 50 -P 16", ["-c", "50", "-P", "16"]),
            ("-c 1", ["-c", "1"])]
SCALE_VARIANTS = [("-c 50 -P 16", ["-c", "50", "-P", "16"]), ("-c 50", ["-c", "50"])]


def key(i: int) -> str:
    return f"{i:012d}"


def wait_until(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = pred()
            if value:
                return value
        except (ConnectionFailed, OSError):
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{what}: not after {timeout}s")


def exit_on_sigterm() -> None:
    """SIGTERM (`timeout`, a CI runner) raises SystemExit, so every `finally` runs and the
    processes started so far are stopped; by default Python would just die."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


@contextlib.contextmanager
def work_dir(prefix: str, keep: Callable[[], bool]) -> Iterator[Path]:
    """A temporary directory for one run: removed at the end, unless `keep()` says otherwise
    or the run failed (then its logs are worth reading)."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    failed = True
    try:
        yield work
        failed = False
    finally:
        if failed or keep():
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


def stop(proc: subprocess.Popen | None, timeout: float = 15) -> int | None:
    if proc is None or proc.poll() is not None:
        return proc.returncode if proc else None
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


# ----------------------------------------------------------------------------- setup

async def load_bucket(url: str, value: bytes, keys: int = NKEYS) -> None:
    """`keys` keys in bucket BUCKET: JetStream publishes, up to 500 acknowledgements (and at
    most 32 MB of values) in flight."""
    nc = await nats.connect(url, connect_timeout=5, allow_reconnect=False)
    in_flight = max(1, min(500, (32 << 20) // max(1, len(value))))
    try:
        js = nc.jetstream(timeout=30)
        await js.create_key_value(bucket=BUCKET, direct=True)
        for start in range(0, keys, in_flight):
            await asyncio.gather(*(js.publish(f"$KV.{BUCKET}.{key(i)}", value)
                                   for i in range(start, min(start + in_flight, keys))))
        info = await js.stream_info(f"KV_{BUCKET}")
        if info.state.messages != keys:
            raise RuntimeError(f"stream holds {info.state.messages} messages, expected {keys}")
    finally:
        await nc.close()


def start_sidecar(work: Path, url: str, keys: int = NKEYS, installed: bool = False,
                  name: str = "kvcache", extra: list[str] | None = None,
                  src: Path | None = None) -> tuple[subprocess.Popen, str]:
    """`python -m kvcache serve`: this checkout's kvcache, or with `installed` the one this
    Python has installed (started outside the checkout, so the checkout is not on its path),
    or with `src` the kvcache of that source tree (another checkout or a git worktree, its
    own native modules built there: started there, with it on PYTHONPATH)."""
    sock = str(work / f"{name}.sock")
    log = open(work / f"{name}.log", "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcache", "serve", "--nats", url, "--bucket", BUCKET,
         "--data-dir", str(work / ("data" if name == "kvcache" else f"data-{name}")), "--socket", sock,
         "--log-level", "warning", *(extra or [])],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        cwd=src if src is not None else work if installed else ROOT,
        env={**os.environ, "PYTHONPATH": str(src)} if src is not None else None,
        preexec_fn=die_with_parent)
    log.close()

    def synced():
        if proc.poll() is not None:
            raise RuntimeError(f"sidecar exited with {proc.returncode}; see {work}/{name}.log")
        with Client(sock, timeout=2) as c:
            row = c.info("buckets")["buckets"].get(BUCKET, {})
            return row.get("synced") == 1 and row.get("keys") == keys
    try:
        wait_until(synced, 120 + keys / 10_000, "kvcache synced")
    except BaseException:
        stop(proc)
        raise
    return proc, sock


class Scraper:
    """Prometheus's part in the --metrics run: GET /metrics every `interval` seconds from a
    thread of this process, for as long as the benchmark runs (bounded by stop())."""

    def __init__(self, address: str, interval: float = 1.0) -> None:
        self.url = f"http://{address}/metrics"
        self.interval = interval
        self.scrapes = self.failures = 0
        self.bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scraper", daemon=True)

    def start(self) -> Scraper:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                with urllib.request.urlopen(self.url, timeout=5) as r:
                    self.bytes = len(r.read())
                self.scrapes += 1
            except OSError:
                self.failures += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def start_bare(work: Path, value_size: int) -> tuple[subprocess.Popen, str]:
    sock = str(work / "bare.sock")
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "bare_server.py"), sock, str(value_size)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent)
    try:
        wait_until(lambda: os.path.exists(sock), 20, "bare server up")
    except BaseException:
        stop(proc)
        raise
    return proc, sock


def start_redis(work: Path, value: bytes, keys: int = NKEYS) -> tuple[subprocess.Popen, str]:
    import redis
    sock = str(work / "redis.sock")
    proc = subprocess.Popen(
        [REDIS_SERVER, "--port", "0", "--unixsocket", sock, "--save", "", "--appendonly", "no",
         "--dir", str(work)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        preexec_fn=die_with_parent)
    try:
        r = redis.Redis(unix_socket_path=sock)
        wait_until(lambda: os.path.exists(sock) and r.ping(), 20, "redis-server up")
        batch = max(1, min(10_000, (64 << 20) // max(1, len(value))))  # at most 64 MB a pipeline
        for start in range(0, keys, batch):
            with r.pipeline(transaction=False) as p:
                for i in range(start, min(start + batch, keys)):
                    p.set(f"key:{key(i)}", value)
                p.execute()
        if r.dbsize() != keys:
            raise RuntimeError("redis-server did not take every key")
        r.close()
    except BaseException:
        stop(proc)
        raise
    return proc, sock


def describe_kvcache(server: dict, work: Path, installed: bool = False, src: Path | None = None) -> str:
    """Which kvcache served, from the sidecar's INFO server: version, where from (imported the
    way start_sidecar starts it: `src` for another source tree), the native modules it runs
    (kvcache.native.report() in the sidecar) and its LMDB binding."""
    where = subprocess.run([sys.executable, "-c", "import kvcache; print(kvcache.__file__)"],
                           capture_output=True, text=True,
                           cwd=src if src is not None else work if installed else ROOT,
                           env={**os.environ, "PYTHONPATH": str(src)} if src is not None else None).stdout.strip()
    native = server["native"]
    if isinstance(native, dict):  # the client parses `a=b,c=d` values
        native = ",".join(f"{k}={v}" for k, v in native.items())
    return (f"{server['kvcache_version']} from {os.path.dirname(where)}, native: {native}, "
            f"LMDB {server.get('native_lmdb') or '(py-lmdb)'}")


# ----------------------------------------------------------------------------- measuring

def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def benchmark(sock: str, requests: int, args: list[str], timeout: float, reads_over: int = NKEYS) -> dict[str, float]:
    cmd = [REDIS_BENCHMARK, "-s", sock, "-t", "get", "-r", str(reads_over), "-n", str(requests),
           "--csv", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr or r.stdout}")
    rows = list(csv.DictReader(io.StringIO(r.stdout)))
    if len(rows) != 1 or rows[0].get("test") != "GET":
        raise RuntimeError(f"unexpected redis-benchmark output: {r.stdout!r} {r.stderr!r}")
    return {k: float(v) for k, v in rows[0].items() if k != "test"}


def profile(pid: int, sock: str, requests: int, seconds: int, out: Path, reads_over: int = NKEYS) -> None:
    """py-spy under the -P 16 load; prints the hottest functions by own and total samples."""
    raw = out / "pyspy.txt"
    spy = subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--duration", str(seconds),
                            "--rate", "250", "--format", "raw", "--output", str(raw), "--nonblocking"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1)  # py-spy attaches
    deadline = time.monotonic() + seconds + 60
    while spy.poll() is None and time.monotonic() < deadline:
        benchmark(sock, requests, ["-c", "50", "-P", "16"], timeout=seconds + 60, reads_over=reads_over)
    try:
        spy.wait(max(1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        spy.kill()
        spy.wait()
        raise RuntimeError("py-spy did not finish") from None
    if not raw.exists():
        raise RuntimeError(f"py-spy wrote nothing: {spy.stderr.read().decode(errors='replace')}")
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    lines: collections.Counter[str] = collections.Counter()
    samples = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        samples += n
        frames = stack.split(";")
        lines[frames[-1]] += n
        funcs = [f.rpartition(":")[0] + ")" if f.endswith(")") else f for f in frames]
        own[funcs[-1]] += n
        for f in set(funcs):
            total[f] += n
    print(f"\npy-spy: {samples} samples of the sidecar under -c 50 -P 16 (raw stacks: {raw})\n")
    print("| own % | total % | function |\n|---:|---:|---|")
    for f, n in own.most_common(12):
        print(f"| {100 * n / samples:.1f} | {100 * total[f] / samples:.1f} | `{f}` |")
    print("\n| own % | line |\n|---:|---|")
    for f, n in lines.most_common(15):
        print(f"| {100 * n / samples:.1f} | `{f}` |")


@dataclass
class GetBench:
    """One run's figures: the best run per (target, variant), server CPU per request, and what
    kvcache's INFO said about it. A variant is redis-benchmark's arguments, prefixed with
    `-r N` when the run reads over more than one key space (--scale)."""

    requests: int
    value_size: int
    repeat: int
    keys: int = NKEYS
    reads_over: list[int] = field(default_factory=lambda: [NKEYS])
    variants: list[tuple[str, list[str]]] = field(default_factory=lambda: list(VARIANTS))
    results: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)
    cpu: dict[tuple[str, str], list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    rps: dict[tuple[str, str], list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    problems: list[str] = field(default_factory=list)
    summary: str = ""
    targets: tuple[str, ...] = ("redis", "kvcache")
    kvcache: str = ""  # which kvcache served: version, where from, its native modules
    other: str = ""    # with --other-src: the same of the second sidecar (the other tree's kvcache)
    metrics: str = ""  # with --metrics: the scraper's tally

    def order(self, round_: int) -> tuple[str, ...]:
        """The targets in the order round `round_` runs them. With --metrics the two sidecars
        swap places every other round (A B, B A, ...): the --control run showed the one run
        second slower by several percent, which alternation cancels in the paired ratios."""
        if METRICS not in self.targets or round_ % 2 == 0:
            return self.targets
        swap = {"kvcache": METRICS, METRICS: "kvcache"}
        return tuple(swap.get(t, t) for t in self.targets)

    def label(self, reads_over: int, variant: str) -> str:
        return variant if len(self.reads_over) == 1 else f"-r {reads_over} {variant}"

    def ratio(self, variant: str, target: str = "kvcache") -> float:
        return self.results[(target, variant)]["rps"] / self.results[("redis", variant)]["rps"]

    def table(self) -> str:
        over = ", ".join(f"-r {r}" for r in self.reads_over)
        lines = [f"redis-benchmark -t get {over} -n {self.requests}, a {self.keys:,}-key bucket, "
                 f"{self.value_size}-byte values, {os.cpu_count()} CPUs, best of {self.repeat} runs", "",
                 f"kvcache: {self.kvcache}", "",
                 *([f"{METRICS}: {self.other}", ""] if self.other else []),
                 "| target | reads over | variant | requests/s | p50 ms | p99 ms | kvcache/redis | "
                 "full/hot | server CPU us/req |",
                 "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
        hot = min(self.reads_over)
        for r in self.reads_over:
            for name, _ in self.variants:
                label = self.label(r, name)
                for target in self.targets:
                    res = self.results[(target, label)]
                    ratio = f"{self.ratio(label, target):.2f}" if target.startswith("kvcache") else ""
                    kept = ("" if r == hot else
                            f"{res['rps'] / self.results[(target, self.label(hot, name))]['rps']:.2f}")
                    us = statistics.median(self.cpu[(target, label)])
                    lines.append(f"| {target} | {r:,} | {name} | {res['rps']:,.0f} | {res['p50_latency_ms']:.3f} | "
                                 f"{res['p99_latency_ms']:.3f} | {ratio} | {kept} | {us:.2f} |")
        if "bare" in self.targets:
            lines += ["", "bare: bench/bare_server.py, a uvloop Protocol answering each GET with a fixed "
                      "reply (no lookup): the least a server on uvloop spends per request."]
        if METRICS in self.targets:
            what = ("no listener, not scraped, running the other source tree's kvcache (named above), "
                    "not this checkout's" if self.other else
                    "the metrics listener on (command latency timed) and scraped every second"
                    if not self.metrics.startswith("CONTROL") else "no listener, not scraped: the CONTROL run")
            lines += ["", f"{METRICS}: a second sidecar on the same bucket with {what} ({self.metrics}). "
                      "Same run, runs alternating (the two sidecars swap order every other round); "
                      "second sidecar / first, and per round (its median, 95% interval and range):", "",
                      "| variant | best requests/s | median requests/s | per round requests/s | "
                      "server CPU us/req (median) | per round CPU us/req |",
                      "|---|---:|---:|---:|---:|---:|"]
            for r in self.reads_over:
                for name, _ in self.variants:
                    label = self.label(r, name)
                    on, off = self.rps[(METRICS, label)], self.rps[("kvcache", label)]
                    cpu_on, cpu_off = self.cpu[(METRICS, label)], self.cpu[("kvcache", label)]
                    lines.append(f"| {label} | {max(on) / max(off):.3f} | "
                                 f"{statistics.median(on) / statistics.median(off):.3f} | "
                                 f"{_paired(on, off)} | "
                                 f"{statistics.median(cpu_on) / statistics.median(cpu_off):.3f} | "
                                 f"{_paired(cpu_on, cpu_off)} |")
        if len(self.reads_over) > 1:
            lines += ["", f"full/hot: the share of its own hot-set (`-r {hot}`) throughput a server keeps "
                      "when the same load reads over every key."]
        return "\n".join([*lines, "", self.summary])


def _paired(on: list[float], off: list[float]) -> str:
    """The rounds' own ratios on/off: their median, its 95% bootstrap interval (2,000
    resamples, a fixed seed), and their range. A round's two runs are adjacent in time, so
    the machine's drift mostly cancels in their ratio; what is left shows in the interval."""
    ratios = [a / b for a, b in zip(on, off, strict=True)]
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
    return (f"{statistics.median(ratios):.3f} (95% {medians[50]:.3f}-{medians[1949]:.3f}; "
            f"range {min(ratios):.3f}-{max(ratios):.3f})")


def run(work: Path, requests: int = 200_000, value_size: int = 3, repeat: int = 3,
        timeout: float = 600, profile_seconds: int | None = None, keys: int = NKEYS,
        reads_over: list[int] | None = None,
        variants: list[tuple[str, list[str]]] | None = None, bare: bool = False,
        installed: bool = False, metrics: bool = False, control: bool = False,
        other_src: Path | None = None) -> GetBench:
    """Start nats-server, kvcache and redis-server under `work` with `keys` keys, run every
    variant over every key space `repeat` times against both (alternating), stop everything (by
    PID) and return the figures."""
    work.mkdir(parents=True, exist_ok=True)
    value = b"x" * value_size
    bench = GetBench(requests, value_size, repeat, keys, reads_over or [keys], variants or list(VARIANTS))
    nats_srv = None
    sidecar = redis_proc = bare_proc = metered = None
    scraper: Scraper | None = None
    if bare:
        bench.targets = ("redis", "kvcache", "bare")
    if metrics:
        bench.targets = (*bench.targets, METRICS)
    try:
        nats_srv = NatsServer(work / "nats" / "js", host="127.0.0.1", server_name="bench").start()
        t0 = time.monotonic()
        asyncio.run(load_bucket(nats_srv.url, value, keys))
        print(f"  bucket loaded: {keys:,} keys in {time.monotonic() - t0:.1f}s", file=sys.stderr)
        sidecar, kv_sock = start_sidecar(work, nats_srv.url, keys, installed)
        redis_proc, redis_sock = start_redis(work, value, keys)
        socks = {"redis": redis_sock, "kvcache": kv_sock}
        pids = {"redis": redis_proc.pid, "kvcache": sidecar.pid}
        if bare:
            bare_proc, socks["bare"] = start_bare(work, value_size)
            pids["bare"] = bare_proc.pid
        if metrics:
            metered, socks[METRICS] = start_sidecar(work, nats_srv.url, keys, installed, "kvcache-metrics",
                                                    [] if control else ["--metrics-listen", "127.0.0.1:0"],
                                                    src=other_src)
            pids[METRICS] = metered.pid
            if other_src is not None:
                bench.metrics = f"CONTROL: no listener, not scraped; OTHER SOURCE: the kvcache of {other_src}"
            elif control:
                bench.metrics = "CONTROL: no listener, not scraped"
            else:
                with Client(socks[METRICS]) as c:
                    scraper = Scraper(str(c.info("server")["server"]["metrics_listen"])).start()
        # Every sidecar is checked alike: a second one that answered from NATS, or with errors,
        # would look cheaper or dearer per GET for a reason that is not its GET path.
        sidecars = {t: socks[t] for t in bench.targets if t.startswith("kvcache")}
        before: dict[str, dict] = {}
        for target, sock in sidecars.items():
            with Client(sock) as c:
                if not (c.get(f"key:{key(1)}") == value and c.get(f"key:{key(keys - 1)}") == value):
                    raise RuntimeError(f"{target}: a value differs from the bucket's")
                before[target] = c.info("stats")["stats"]
                server = c.info("server")["server"]
            if target == "kvcache":
                bench.kvcache = describe_kvcache(server, work, installed)
            elif other_src is not None:
                bench.other = describe_kvcache(server, work, src=other_src)

        for r in bench.reads_over:
            for name, extra in bench.variants:
                label = bench.label(r, name)
                for i in range(repeat):
                    for target in bench.order(i):
                        sock = socks[target]
                        c0 = cpu_seconds(pids[target])
                        res = benchmark(sock, requests, extra, timeout, r)
                        bench.cpu[(target, label)].append((cpu_seconds(pids[target]) - c0) / requests * 1e6)
                        bench.rps[(target, label)].append(res["rps"])
                        best = bench.results.get((target, label))
                        if best is None or res["rps"] > best["rps"]:
                            bench.results[(target, label)] = res
                        print(f"  {target:8s} {label:22s} {res['rps']:>12,.0f} req/s "
                              f"{bench.cpu[(target, label)][-1]:6.2f} CPU us/req", file=sys.stderr)

        if scraper is not None:
            scraper.stop()
            bench.metrics = f"{scraper.scrapes} scrapes of {scraper.bytes:,} bytes, {scraper.failures} failed"
            if scraper.failures or not scraper.scrapes:
                bench.problems.append(f"metrics: {bench.metrics}")
        expected = requests * len(bench.variants) * len(bench.reads_over) * repeat
        told = []
        for target, sock in sidecars.items():
            with Client(sock) as c:
                after = c.info("stats")["stats"]
            was = before[target]
            gets = after["gets_local"] - was["gets_local"]
            for f in ("protocol_errors", "remote_errors", "gets_remote", "gets_notfound"):
                if after[f] != was[f]:
                    bench.problems.append(f"{target}: {f} went {was[f]} -> {after[f]}")
            if gets < expected:
                bench.problems.append(f"{target}: only {gets} local GETs for {expected} requests")
            told.append(f"{target} INFO: {gets} local GETs, gets_remote +{after['gets_remote'] - was['gets_remote']}, "
                        f"protocol_errors {after['protocol_errors']}, remote_errors {after['remote_errors']}")
        bench.summary = ("; ".join(told)
                         + (f"; PROBLEMS: {'; '.join(bench.problems)}" if bench.problems else " (all checks passed)"))

        if profile_seconds:
            profile(sidecar.pid, kv_sock, requests, profile_seconds, work, max(bench.reads_over))
        return bench
    finally:
        if scraper is not None:
            scraper.stop()
        code = stop(sidecar)
        if code not in (None, 0):
            bench.problems.append(f"sidecar exited with {code}; log in {work}/kvcache.log")
        code = stop(metered)
        if code not in (None, 0):
            bench.problems.append(f"metered sidecar exited with {code}; log in {work}/kvcache-metrics.log")
        stop(redis_proc)
        stop(bare_proc)
        if nats_srv:
            nats_srv.stop()


# ----------------------------------------------------------------------------- --sizes

SIZE_VARIANTS = [("-P 1", ["-c", "20"]), ("-P 8", ["-c", "20", "-P", "8"])]
NATS_DEFAULT_MAX_PAYLOAD = 1 << 20  # nats-server's max_payload unless configured
SIZES_MAX_PAYLOAD = 8 << 20         # what --sizes raises it to for values over 1 MiB


def parse_size(text: str) -> int:
    """`512`, `4k`, `64K`, `1m`, `4MB` -> bytes (k and m are 1024 and 1024²)."""
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    mult = {"k": 1 << 10, "m": 1 << 20}.get(t[-1:], 1)
    return int(t[:-1] if mult != 1 else t) * mult


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """`4k:20000,1m:100` -> [(4096, 20000), (1048576, 100)]: value size, keys in the bucket."""
    out = []
    for item in text.split(","):
        size, sep, keys = item.partition(":")
        out.append((parse_size(size), int(keys) if sep else 1000))
    return out


def size_label(size: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift and size % (1 << shift) == 0:
            return f"{size >> shift} {unit}"
    return f"{size} B"


def size_requests(size: int) -> int:
    """redis-benchmark -n for one run at this value size: about 2 GB of values a run, between
    2,000 and 200,000 GETs (a repeat of four runs stays well under a minute on 2 cores)."""
    return max(2000, min(200_000, 2_000_000_000 // size))


def proc_status(pid: int, name: str) -> int:
    """A `kB` line of /proc/<pid>/status (VmHWM, VmRSS, RssAnon...), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(f"{name} not in /proc/{pid}/status")


def children_cpu() -> float:
    """utime + stime of every child this process has waited for: the delta around one
    subprocess.run is that process's own CPU time, exactly."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


@dataclass
class SizeRow:
    """One value size: per (target, variant) the runs' GET/s, the server's CPU µs per GET and
    redis-benchmark's own CPU µs per GET; the sidecar's memory; what went wrong."""

    size: int
    keys: int
    requests: int
    max_payload: int
    rps: dict[tuple[str, str], list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    cpu: dict[tuple[str, str], list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    client_cpu: dict[tuple[str, str], list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    hwm_synced: int = 0   # the sidecar's VmHWM once synced (before any GET)
    hwm: int = 0          # ... after every run
    anon: int = 0         # its RssAnon after every run (not the LMDB map's file pages)
    load_seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    def med(self, what: str, target: str, variant: str) -> float:
        return statistics.median(getattr(self, what)[(target, variant)])

    def label(self) -> str:
        return f"{size_label(self.size)}, {self.keys:,} (`-n {self.requests:,}`)"


def run_size(work: Path, size: int, keys: int, requests: int, repeat: int, timeout: float,
             info: dict[str, str]) -> SizeRow:
    """One bucket of `keys` keys of `size` bytes (a nats-server of its own, max_payload raised
    for values over 1 MiB), a sidecar replicating it and a redis-server holding the same
    keys; each variant `repeat` times against both, alternating. Everything stopped by PID."""
    work.mkdir(parents=True, exist_ok=True)
    value = random.Random(size).randbytes(size)
    # A publish of exactly max_payload bytes is taken (1 MiB runs at the default); one byte more is not
    max_payload = SIZES_MAX_PAYLOAD if size > NATS_DEFAULT_MAX_PAYLOAD else NATS_DEFAULT_MAX_PAYLOAD
    row = SizeRow(size, keys, requests, max_payload)
    nats_srv = sidecar = redis_proc = None
    try:
        nats_srv = NatsServer(work / "nats" / "js", host="127.0.0.1", server_name="bench",
                              extra_conf=(f"max_payload: {max_payload}"
                                          if max_payload != NATS_DEFAULT_MAX_PAYLOAD else "")).start()
        t0 = time.monotonic()
        asyncio.run(load_bucket(nats_srv.url, value, keys))
        row.load_seconds = time.monotonic() - t0
        print(f"  {size_label(size)}: bucket loaded, {keys:,} keys in {row.load_seconds:.1f}s", file=sys.stderr)
        sidecar, kv_sock = start_sidecar(work, nats_srv.url, keys)
        row.hwm_synced = proc_status(sidecar.pid, "VmHWM")
        redis_proc, redis_sock = start_redis(work, value, keys)
        socks = {"redis": redis_sock, "kvcache": kv_sock}
        pids = {"redis": redis_proc.pid, "kvcache": sidecar.pid}
        with Client(kv_sock, timeout=10) as c:
            if c.get(f"key:{key(keys - 1)}") != value:
                raise RuntimeError(f"{size_label(size)}: the sidecar's value of key:{key(keys - 1)} differs")
            before = c.info("stats")["stats"]
            if "kvcache" not in info:
                info["kvcache"] = describe_kvcache(c.info("server")["server"], work)
        for name, extra in SIZE_VARIANTS:
            for i in range(repeat):
                for target in ("redis", "kvcache") if i % 2 == 0 else ("kvcache", "redis"):
                    c0, b0 = cpu_seconds(pids[target]), children_cpu()
                    res = benchmark(socks[target], requests, extra, timeout, keys)
                    row.client_cpu[(target, name)].append((children_cpu() - b0) / requests * 1e6)
                    row.cpu[(target, name)].append((cpu_seconds(pids[target]) - c0) / requests * 1e6)
                    row.rps[(target, name)].append(res["rps"])
                    print(f"  {size_label(size):>8s} {target:8s} {name:5s} {res['rps']:>10,.0f} GET/s "
                          f"{res['rps'] * size / 1e6:>8,.0f} MB/s, server {row.cpu[(target, name)][-1]:7.2f} "
                          f"CPU us/GET, redis-benchmark {row.client_cpu[(target, name)][-1]:7.2f}", file=sys.stderr)
        with Client(kv_sock, timeout=10) as c:
            after = c.info("stats")["stats"]
        for f in ("protocol_errors", "remote_errors", "gets_remote", "gets_notfound"):
            if after[f] != before[f]:
                row.problems.append(f"{size_label(size)}: {f} went {before[f]} -> {after[f]}")
        gets, expected = after["gets_local"] - before["gets_local"], requests * len(SIZE_VARIANTS) * repeat
        if gets < expected:
            row.problems.append(f"{size_label(size)}: only {gets} local GETs for {expected} requests")
        row.hwm = proc_status(sidecar.pid, "VmHWM")
        row.anon = proc_status(sidecar.pid, "RssAnon")
        return row
    finally:
        code = stop(sidecar)
        if code not in (None, 0):
            row.problems.append(f"{size_label(size)}: sidecar exited with {code}; log in {work}/kvcache.log")
        stop(redis_proc)
        if nats_srv:
            nats_srv.stop()


def sizes_table(rows: list[SizeRow], repeat: int, info: dict[str, str]) -> str:
    def pair(row: SizeRow, what: str, name: str, fmt: str = "{:.1f}") -> str:
        return " / ".join(fmt.format(row.med(what, t, name)) for t in ("kvcache", "redis"))

    mib = 1 << 20
    lines = [f"redis-benchmark -t get -c 20 -r <keys> over the Unix socket, `-P 1` and `-P 8`; one bucket "
             f"per value size; median of {repeat} runs per target (alternating); {os.cpu_count()} CPUs", "",
             f"kvcache: {info.get('kvcache', '?')}", "",
             "| value size, keys | `-P 1` kvcache / redis-server (GET/s) | server CPU µs per GET, kvcache / "
             "redis (`-P 1`; `-P 8`) | `-P 8` kvcache / redis-server (GET/s) | redis-benchmark's own CPU µs "
             "per GET, against kvcache / redis (`-P 1`; `-P 8`) | sidecar peak RSS (synced; anon at end) |",
             "|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        ratio = {name: (f"{row.med('rps', 'kvcache', name) / row.med('rps', 'redis', name):.2f} "
                        f"({row.med('rps', 'kvcache', name):,.0f} / {row.med('rps', 'redis', name):,.0f})")
                 for name, _ in SIZE_VARIANTS}
        lines.append(f"| {row.label()} | {ratio['-P 1']} | {pair(row, 'cpu', '-P 1')}; {pair(row, 'cpu', '-P 8')} | "
                     f"{ratio['-P 8']} | {pair(row, 'client_cpu', '-P 1')}; {pair(row, 'client_cpu', '-P 8')} | "
                     f"{row.hwm / mib:,.0f} MiB ({row.hwm_synced / mib:,.0f}; {row.anon / mib:,.0f}) |")
    lines += ["", "Each run's medians: MB/s of values, and how much of one core the server and redis-benchmark "
              "(one thread) were busy: a redis-benchmark near 100% is the bottleneck, not the server.", "",
              "| value size | variant | target | GET/s | MB/s | server CPU, % of a core | "
              "redis-benchmark CPU, % of a core |", "|---|---|---|---:|---:|---:|---:|"]
    for row in rows:
        for name, _ in SIZE_VARIANTS:
            for target in ("kvcache", "redis"):
                rps = row.med("rps", target, name)
                lines.append(f"| {size_label(row.size)} | {name} | {target} | {rps:,.0f} | "
                             f"{rps * row.size / 1e6:,.0f} | {rps * row.med('cpu', target, name) / 1e4:.0f} | "
                             f"{rps * row.med('client_cpu', target, name) / 1e4:.0f} |")
    raised = [size_label(r.size) for r in rows if r.max_payload != NATS_DEFAULT_MAX_PAYLOAD]
    lines += ["", "nats-server max_payload: the 1 MiB default" +
              (f"; raised to {size_label(SIZES_MAX_PAYLOAD)} for {', '.join(raised)} (the bucket's "
               "max_value_size left unlimited, so the stream takes what max_payload lets through)"
               if raised else ""),
              "sidecar peak RSS: VmHWM after the runs (after the initial sync; RssAnon after the runs: "
              "the rest is LMDB's mapped file pages)"]
    problems = [p for r in rows for p in r.problems]
    lines.append("PROBLEMS: " + "; ".join(problems) if problems else
                 "kvcache INFO: every GET answered from the replica, no protocol or remote errors (all checks passed)")
    return "\n".join(lines)


def run_sizes(work: Path, sizes: list[tuple[int, int]], repeat: int, timeout: float,
              requests: int | None, keep: bool) -> tuple[str, bool]:
    """Every size in turn, each in a directory of its own (removed after a clean size unless
    `keep`); the table, and whether anything went wrong."""
    info: dict[str, str] = {}
    rows = []
    for size, keys in sizes:
        sub = work / f"size-{size}"
        row = run_size(sub, size, keys, requests or size_requests(size), repeat, timeout, info)
        rows.append(row)
        if not keep and not row.problems:
            shutil.rmtree(sub, ignore_errors=True)
    return sizes_table(rows, repeat, info), any(r.problems for r in rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=None,
                    help="requests per run (-n; default 200,000; --sizes: scaled by the value size, "
                         "2,000-200,000)")
    ap.add_argument("--value-size", type=int, default=3, help="bytes per value (redis-benchmark's default is 3)")
    ap.add_argument("--profile", action="store_true", help="py-spy the sidecar under -P 16")
    ap.add_argument("--profile-seconds", type=int, default=15)
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    ap.add_argument("--timeout", type=float, default=600, help="per redis-benchmark run")
    ap.add_argument("--repeat", type=int, default=3, help="runs per target and variant")
    ap.add_argument("--keys", type=int, default=None, help=f"keys in the bucket (default {NKEYS:,}; --scale: "
                    f"{SCALE_KEYS:,})")
    ap.add_argument("--reads-over", default=None,
                    help="comma-separated -r values (default: the bucket's size; --scale: 10000 and the size)")
    ap.add_argument("--bare", action="store_true", help="measure bench/bare_server.py beside them")
    ap.add_argument("--installed", action="store_true",
                    help="run the kvcache this Python has installed (pip install .), not this checkout's")
    ap.add_argument("--only", default=None, metavar="VARIANT",
                    help="run only this variant (redis-benchmark's arguments, as the table names it: '-c 50 -P 16')")
    ap.add_argument("--metrics", action="store_true",
                    help="a second sidecar with the metrics listener on, scraped every second, beside the first")
    ap.add_argument("--control", action="store_true",
                    help="with --metrics: the second sidecar without the listener, unscraped (the noise "
                         "between two identical sidecars)")
    ap.add_argument("--other-src", type=Path, default=None, metavar="DIR",
                    help="with --metrics: the second sidecar runs the kvcache of source tree DIR (e.g. a git "
                         "worktree of an earlier commit, its native modules built there), without the "
                         "listener: the ratios are DIR's over this checkout's, same run (implies --control)")
    ap.add_argument("--scale", action="store_true",
                    help=f"{SCALE_KEYS:,} keys of 100 bytes, -r 10000 and -r {SCALE_KEYS}, -P 16 and -P 1")
    ap.add_argument("--sizes", default=None, metavar="SIZE:KEYS,...",
                    help="value-size mode: per SIZE (4k, 512k, 1m...) a bucket of KEYS keys and a redis-server "
                         "with the same, -c 20 at -P 1 and -P 8: GET/s ratio, server and redis-benchmark CPU "
                         "per GET, the sidecar's peak RSS (e.g. 4k:20000,64k:2000,512k:200,1m:100,4m:25)")
    args = ap.parse_args()
    exit_on_sigterm()
    if args.sizes:
        try:
            sizes = parse_sizes(args.sizes)
        except ValueError:
            ap.error(f"--sizes: not SIZE:KEYS,...: {args.sizes!r}")
        too_big = [size_label(s) for s, _ in sizes if s > SIZES_MAX_PAYLOAD]
        if too_big:
            ap.error(f"--sizes: larger than nats-server's {size_label(SIZES_MAX_PAYLOAD)} max_payload: {too_big}")
        with work_dir("kvcache-socket-bench-sizes-", lambda: args.keep) as work:
            table, failed = run_sizes(work, sizes, args.repeat, args.timeout, args.requests, args.keep)
            print("\n" + table)
            args.keep = args.keep or failed
            return 1 if failed else 0
    keys = args.keys or (SCALE_KEYS if args.scale else NKEYS)
    if args.reads_over:
        reads_over = [int(r) for r in args.reads_over.split(",")]
    else:
        reads_over = sorted({min(NKEYS, keys), keys}) if args.scale else [keys]
    value_size = 100 if args.scale and args.value_size == 3 else args.value_size
    variants = SCALE_VARIANTS if args.scale else VARIANTS
    if args.only:
        variants = [v for v in variants if v[0] == args.only]
        if not variants:
            ap.error(f"--only: no variant '{args.only}'")
    with work_dir("kvcache-socket-bench-", lambda: args.keep) as work:
        bench = run(work, args.requests or 200_000, value_size, args.repeat, args.timeout,
                    args.profile_seconds if args.profile else None, keys, reads_over,
                    variants, args.bare, args.installed, args.metrics or args.other_src is not None,
                    args.control or args.other_src is not None,
                    args.other_src.resolve() if args.other_src is not None else None)
        print("\n" + bench.table())
        args.keep = args.keep or bool(bench.problems)
        return 1 if bench.problems else 0


if __name__ == "__main__":
    sys.exit(main())
