"""Change reaching applications: client-side caching and keyspace notifications, measured.

    python bench/tracking_bench.py latency      [--keys N] [--reads N]
    python bench/tracking_bench.py invalidation [--updates N]
    python bench/tracking_bench.py fanout       [--subscribers N] [--changes N] [--stuck]
    python bench/tracking_bench.py stale        [--rate W] [--seconds S]
    python bench/tracking_bench.py all

- latency: one hot key read over and over, in one run: redis-py with its client-side cache
  (hits, over the TCP listener), redis-py over the Unix socket, kvcache.Client, LocalReader,
  and nats-py's kv.get (Direct Get from nats-server). Values of --value-size bytes in a bucket
  of --keys keys.
- invalidation: per update, the time from the NATS publish until the cached redis-py client
  reads the new value, beside the time until the replica holds it (LocalReader), p50/p99.
- fanout: --subscribers connections subscribed to `__keyevent@0__:set`, --changes PUTs; every
  subscriber must get every change, in order. The NATS consumers on the bucket's stream are
  counted from the stream's own state (nats-server's consumer_count) during the run; the
  sidecar's CPU (utime + stime from /proc) per 1,000 messages delivered. `--stuck` adds one
  subscriber that never reads (cut off at --limit bytes) and reports the others' delays.
- stale: a writer at --rate writes/s over 10 keys; a checker reads each key through the
  Unix socket (no cache: what the sidecar vouches for now), then through the cached client:
  a cached value older than the one the sidecar had just answered is a stale read.

Starts its own nats-server and sidecar on 127.0.0.1 and a Unix socket; every loop is bounded
by its count and --timeout.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import selectors
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import nats
import redis
from redis.cache import CacheConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.checkers import percentile
from support.sidecar_proc import SidecarProcess

from kvcache import LocalReader, native
from kvcache.app.client import Client
from kvcache.app.client import encode_command as encode
from kvcache.natsio.nats_server import NatsServer

BUCKET = "trk"


class Rig:
    """nats-server, a bucket, and the sidecar with its TCP listener (compat identity on)."""

    def __init__(self, tmp: Path, keys: int, value_size: int, extra: list[str] | None = None) -> None:
        self.server = NatsServer(tmp / "nats").start()
        self.loop = asyncio.new_event_loop()
        self.nc = self.loop.run_until_complete(nats.connect(self.server.url))
        self.js = self.nc.jetstream()
        self.kv = self.loop.run_until_complete(self.js.create_key_value(bucket=BUCKET, direct=True))
        value = os.urandom(value_size // 2).hex().encode()[:value_size]
        self.loop.run_until_complete(self._fill(keys, value))
        self.sc = SidecarProcess(tmp / "sc", self.server.url, [BUCKET],
                                 extra=["--listen", "127.0.0.1:0", "--compat-identity",
                                        "--log-level", "warning", *(extra or [])]).start(timeout=600)
        with Client(self.sc.socket) as c:
            host, _, port = c.info("server")["server"]["listen"].rpartition(":")
            held = c.info("buckets")["buckets"][BUCKET]["keys"]
        self.host, self.port = host, int(port)
        print(f"bucket {BUCKET}: {held} keys of {value_size} bytes in the replica")

    async def _fill(self, keys: int, value: bytes) -> None:
        for i in range(0, keys, 1000):
            await asyncio.gather(*(self.js.publish(f"$KV.{BUCKET}.k.{j}", value)
                                   for j in range(i, min(keys, i + 1000))))

    def put(self, key: str, value: bytes) -> int:
        return self.loop.run_until_complete(self.js.publish(f"$KV.{BUCKET}.{key}", value)).seq

    def cached(self) -> redis.Redis:
        return redis.Redis(host=self.host, port=self.port, protocol=3, cache_config=CacheConfig())

    def cpu_s(self) -> float:
        assert self.sc.proc is not None
        fields = Path(f"/proc/{self.sc.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def consumers(self) -> int:
        return self.loop.run_until_complete(self.js.stream_info(f"KV_{BUCKET}")).state.consumer_count

    def close(self) -> None:
        self.sc.stop()
        self.loop.run_until_complete(self.nc.close())
        self.loop.close()
        self.server.stop()


def summary(name: str, us: list[float]) -> str:
    us = sorted(us)
    return (f"{name:<34} p50 {statistics.median(us):8.2f} µs   p99 {percentile(us, 99):8.2f} µs"
            f"   ({len(us)} reads)")


def timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1000)
    return out


# ---------------------------------------------------------------------------- latency

def bench_latency(args, tmp: Path) -> None:
    rig = Rig(tmp, args.keys, args.value_size)
    try:
        key = "k.7"
        want = rig.loop.run_until_complete(rig.kv.get(key)).value
        cached = rig.cached()
        assert cached.get(key) == want
        unix = redis.Redis(unix_socket_path=rig.sc.socket)
        ours = Client(rig.sc.socket)
        reader = LocalReader(str(rig.sc.data_dir))
        assert unix.get(key) == ours.get(key) == reader.get(key) == want
        n = args.reads

        async def nats_gets() -> list[float]:
            out = []
            for _ in range(min(n, 5000)):
                t0 = time.perf_counter_ns()
                await rig.kv.get(key)
                out.append((time.perf_counter_ns() - t0) / 1000)
            return out

        for _ in range(args.repeat):
            print(summary("redis-py + client-side cache (hit)", timed(lambda: cached.get(key), n)))
            print(summary("redis-py over the Unix socket", timed(lambda: unix.get(key), n)))
            print(summary("kvcache.Client", timed(lambda: ours.get(key), n)))
            print(summary("LocalReader", timed(lambda: reader.get(key), n)))
            print(summary("nats-py kv.get (Direct Get)", rig.loop.run_until_complete(nats_gets())))
            print()
        cached.close()
        unix.close()
        ours.close()
        reader.close()
    finally:
        rig.close()


# ---------------------------------------------------------------------------- invalidation

def bench_invalidation(args, tmp: Path) -> None:
    rig = Rig(tmp, 100, args.value_size)
    try:
        cached = rig.cached()
        reader = LocalReader(str(rig.sc.data_dir))
        key = "k.3"
        cached.get(key)
        inval_ms, replica_ms = [], []
        deadline = time.monotonic() + args.timeout
        for i in range(args.updates):
            if time.monotonic() > deadline:
                print(f"stopped after {i} updates: --timeout reached")
                break
            value = b"u%06d" % i
            t0 = time.perf_counter()
            rev = rig.put(key, value)
            t_replica = t_client = 0.0
            while not (t_replica and t_client):
                if time.perf_counter() - t0 > 5:
                    raise SystemExit(f"update {i} not seen in 5 s")
                if not t_replica:
                    e = reader.entry(key)
                    if e is not None and e.revision >= rev:
                        t_replica = time.perf_counter()
                if not t_client and cached.get(key) == value:
                    t_client = time.perf_counter()
            replica_ms.append((t_replica - t0) * 1e3)
            inval_ms.append((t_client - t0) * 1e3)
        for name, ms in (("replica holds it (LocalReader)", replica_ms),
                         ("cached redis-py reads it", inval_ms)):
            ms.sort()
            print(f"{name:<32} p50 {statistics.median(ms):7.3f} ms   p99 {percentile(ms, 99):7.3f} ms"
                  f"   max {ms[-1]:7.3f} ms   ({len(ms)} updates)")
        cached.close()
        reader.close()
    finally:
        rig.close()


# ---------------------------------------------------------------------------- fan-out

def bench_fanout(args, tmp: Path) -> None:
    extra = ["--pubsub-max-output-bytes", str(args.limit)] if args.stuck else []
    rig = Rig(tmp, 10, args.value_size, extra)
    try:
        # a first round warms the sidecar and this process up (its first delays run 10x the
        # later ones, stuck subscriber or not): not reported
        fanout_round(rig, args, False, report=False)
        for stuck in ([True, False] if args.stuck else [False]):
            fanout_round(rig, args, stuck)
    finally:
        rig.close()


def fanout_round(rig: Rig, args, stuck: bool, report: bool = True) -> None:
    subs = []
    sel = selectors.DefaultSelector()
    for i in range(args.subscribers):
        s = socket.socket(socket.AF_UNIX)
        s.connect(rig.sc.socket)
        s.sendall(encode(["SUBSCRIBE", "__keyevent@0__:set"]))
        s.setblocking(False)
        subs.append(s)
        sel.register(s, selectors.EVENT_READ, i)
    hog = None
    if stuck:  # reads nothing, and asks for everything (both channels of every change)
        hog = socket.socket(socket.AF_UNIX)
        hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        hog.connect(rig.sc.socket)
        hog.sendall(encode(["PSUBSCRIBE", "__key*"]))
    time.sleep(0.5)
    bufs = [b"" for _ in subs]
    ack = b":1\r\n"
    for i, s in enumerate(subs):  # the confirmations
        s.setblocking(True)
        while ack not in bufs[i]:
            bufs[i] += s.recv(4096)
        bufs[i] = bufs[i][bufs[i].index(ack) + len(ack):]
        s.setblocking(False)
    with Client(rig.sc.socket) as c:
        cut_before = c.info("clients")["clients"]["subscribers_cut_off"]
    sent: dict[int, float] = {}
    pad = "p" * args.key_pad
    changes = args.changes

    async def writer():
        js = rig.nc.jetstream()
        interval = 1 / args.rate
        start = time.perf_counter()
        for n in range(changes):
            target = start + n * interval
            delay = target - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            sent[n] = time.perf_counter()
            await js.publish(f"$KV.{BUCKET}.f.{pad}{n:07d}", b"x")

    consumers = []

    def write_thread():
        rig.loop.run_until_complete(writer())
        consumers.append(rig.consumers())

    cpu0 = rig.cpu_s()
    t = threading.Thread(target=write_thread)
    t.start()
    got = [0] * len(subs)
    delays: list[float] = []
    out_of_order = 0
    deadline = time.monotonic() + args.timeout
    prefix = f"f.{pad}".encode()
    while min(got) < changes and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=0.5):
            i = key.data
            try:
                chunk = subs[i].recv(1 << 20)
            except BlockingIOError:
                continue
            now = time.perf_counter()
            bufs[i] += chunk
            # each message ends with the key as its last bulk: `...$<len>\r\nf.<pad><n>\r\n`
            while True:
                at = bufs[i].find(prefix)
                end = bufs[i].find(b"\r\n", at) if at >= 0 else -1
                if end < 0:
                    break
                n = int(bufs[i][at + len(prefix):end])
                bufs[i] = bufs[i][end + 2:]
                if n != got[i]:
                    out_of_order += 1
                got[i] = n + 1
                delays.append((now - sent[n]) * 1e3)
    t.join()
    cpu = rig.cpu_s() - cpu0
    with Client(rig.sc.socket) as c:
        cut = c.info("clients")["clients"]["subscribers_cut_off"] - cut_before
    delivered = sum(got)
    delays.sort()
    label = "with one stuck subscriber" if stuck else "all reading"
    if not report:
        print(f"(warm-up round: {delivered} delivered, p99 {percentile(delays, 99):.3f} ms)")
    else:
        print(f"fan-out ({label}): {len(subs)} subscribers x {changes} changes at {args.rate}/s: "
              f"{delivered} delivered ({'all' if delivered == len(subs) * changes else 'MISSING'}), "
              f"out of order {out_of_order}, NATS consumers on the stream: {consumers[0]}")
        print(f"  delivery delay p50 {statistics.median(delays):.3f} ms  p99 {percentile(delays, 99):.3f} ms"
              f"  max {delays[-1]:.3f} ms;  sidecar CPU {cpu * 1e3:.0f} ms = "
              f"{cpu * 1e3 / (delivered / 1000):.2f} ms per 1,000 messages delivered"
              + (f";  stuck subscribers cut off: {cut}" if stuck else ""))
    for s in subs:
        s.close()
    if hog is not None:
        hog.close()
    time.sleep(0.5)


# ---------------------------------------------------------------------------- stale reads

def bench_stale(args, tmp: Path) -> None:
    rig = Rig(tmp, 10, 16)
    keys = [f"k.{i}" for i in range(10)]
    try:
        stop = threading.Event()
        writes = [0]

        async def writer():
            nc = await nats.connect(rig.server.url)
            js = nc.jetstream()
            start = time.perf_counter()
            n = 0
            while not stop.is_set() and n < args.rate * args.seconds:
                target = start + n / args.rate
                delay = target - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                n += 1
                await js.publish(f"$KV.{BUCKET}.{keys[n % len(keys)]}", b"%012d" % n)
            writes[0] = n
            await nc.close()

        t = threading.Thread(target=lambda: asyncio.run(writer()))
        cached = rig.cached()
        unix = Client(rig.sc.socket)
        with Client(rig.sc.socket) as c:
            local0 = c.info("stats")["stats"]["gets_local"]
        t.start()
        reads = stale = checked = 0
        worst = 0
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline:
            for k in keys:
                vouched = unix.get(k)         # what the sidecar answers now
                seen = cached.get(k)          # the caching client: from its cache when it can
                reads += 1
                if vouched is None or seen is None or not vouched.isdigit():
                    continue  # the initial values are not the writer's counters
                checked += 1
                behind = int(vouched) - int(seen) if seen.isdigit() else 1
                if behind > 0:
                    stale += 1
                    worst = max(worst, behind)
        stop.set()
        t.join()
        with Client(rig.sc.socket) as c:
            local = c.info("stats")["stats"]["gets_local"] - local0
        from_server = max(0, local - reads)  # the unix checker's reads are `reads`
        print(f"stale reads: writer {writes[0]} writes in {args.seconds} s ({writes[0] / args.seconds:.0f}/s) "
              f"over {len(keys)} keys; cached client {reads} reads, {reads - from_server} from its "
              f"cache ({(reads - from_server) / reads:.1%}); {checked} compared; "
              f"stale: {stale} (worst {worst} writes behind)")
        cached.close()
        unix.close()
    finally:
        rig.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["latency", "invalidation", "fanout", "stale", "all"])
    p.add_argument("--keys", type=int, default=10_000, help="latency: keys in the bucket")
    p.add_argument("--value-size", type=int, default=100)
    p.add_argument("--reads", type=int, default=20_000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--updates", type=int, default=1000)
    p.add_argument("--subscribers", type=int, default=100)
    p.add_argument("--changes", type=int, default=1000)
    p.add_argument("--rate", type=int, default=1000, help="fanout/stale: writes per second")
    p.add_argument("--key-pad", type=int, default=0, help="fanout: longer keys (bigger messages)")
    p.add_argument("--stuck", action="store_true", help="fanout: a run with a stuck subscriber too")
    p.add_argument("--limit", type=int, default=1 << 20, help="fanout --stuck: pubsub_max_output_bytes")
    p.add_argument("--seconds", type=int, default=10)
    p.add_argument("--timeout", type=float, default=120)
    args = p.parse_args()
    print(f"native: {native.report()}")
    todo = ["latency", "invalidation", "fanout", "stale"] if args.what == "all" else [args.what]
    for what in todo:
        with tempfile.TemporaryDirectory(prefix=f"kvtrk-{what}-") as d:
            {"latency": bench_latency, "invalidation": bench_invalidation,
             "fanout": bench_fanout, "stale": bench_stale}[what](args, Path(d))


if __name__ == "__main__":
    main()
