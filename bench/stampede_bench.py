"""A hot key outside the filters read by many clients at once: how many Direct Gets.

    python bench/stampede_bench.py [--readers 100] [--connections C] [--repeat 3] [--sidecar-src DIR]

A bucket replicated for `in.>` only, and the key `out.hot` outside its filters, so every read
of it the near cache cannot answer goes to NATS. A burst is --readers GETs of `out.hot` sent at
the same moment: --connections raw Unix-socket connections (default: one per reader, at most
100) are opened and PINGed first, then each is written its share of the GETs (pipelined when
readers > connections) back-to-back in one loop, then every reply is read. INFO `routed_requests`
(`# Routing`) before and after is what the burst cost upstream; INFO `reads_coalesced`
(`# Stats`) how many reads joined a request already in flight (0 where the field does not
exist). Cases, each its own burst:

1. no near cache;
2. near cache, the key cached (checked first: INFO `cache_keys` >= 1 and `KV.GET` answering
   from `cache`);
3. near cache, right after one write of the key upstream (nats-py `js.publish`), once the
   sidecar's feed has applied it (INFO `applied_seq` >= the write's sequence);
4. near cache, the burst after that.

Every answer of a burst must be the same bytes, and the value last written; the table says so
per case. `--repeat R` runs every case R times (a new write each time for case 3).

`--sidecar-src DIR` runs every case against the kvcache of source tree DIR too (e.g. `git
worktree add /tmp/kv-old <commit>`, with `kvcache/_native/*.so` copied in for like-for-like
figures), as `python -P -m kvcache serve` with PYTHONPATH=DIR, so one run shows before and
after side by side. This checkout's sidecar is started the same way, with PYTHONPATH=<this
checkout>.

Starts its own nats-server and sidecars (127.0.0.1, Unix sockets), one sidecar at a time, and
stops only those; every loop is bounded by count and time.
"""
from __future__ import annotations

import argparse
import asyncio
import resource
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import nats

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from support.poll import WaitTimeout, wait_until
from support.sidecar_proc import SidecarProcess, check_src

from kvcache.app.client import Client, ResponseError
from kvcache.natsio.nats_server import NatsServer

BUCKET = "stampede"
HOT = "out.hot"
GET_HOT = b"*2\r\n$3\r\nGET\r\n$%d\r\n%b\r\n" % (len(HOT), HOT.encode())
DEFAULT_MAX_CLIENTS = 10_000  # the sidecar's max_clients default

CASES = [
    ("no near cache", "nocache"),
    ("near cache, key cached", "cached"),
    ("near cache, right after one write of the key", "after_write"),
    ("near cache, the burst after that", "next"),
]


# --------------------------------------------------------------------------- one burst


@dataclass
class Burst:
    direct_gets: int
    coalesced: int
    answers: list[bytes]
    expected: bytes  # the RESP bulk reply of the value last written
    elapsed_ms: float
    note: str = ""

    def verdict(self) -> str:
        distinct = set(self.answers)
        if len(distinct) > 1:
            return f"no ({len(distinct)} distinct)"
        if distinct != {self.expected}:
            return "yes, but not the value last written"
        return "yes"


def bulk(value: bytes) -> bytes:
    return b"$%d\r\n%b\r\n" % (len(value), value)


def read_replies(sock: socket.socket, count: int, deadline: float) -> list[bytes]:
    """`count` RESP2 replies from `sock`, each as its raw bytes (bulk strings, nils, errors,
    simple strings and integers: what GET and PING answer)."""
    buf = bytearray()
    pos = 0
    out: list[bytes] = []
    while True:
        while len(out) < count:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break
            stop = eol + 2
            if buf[pos:pos + 1] == b"$":
                size = int(buf[pos + 1:eol])
                if size >= 0:
                    stop += size + 2
                if len(buf) < stop:
                    break
            out.append(bytes(buf[pos:stop]))
            pos = stop
        if len(out) >= count:
            return out
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{len(out)} of {count} replies before the deadline")
        sock.settimeout(left)
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError(f"the sidecar closed a connection after {len(out)} of {count} replies")
        buf += chunk


def shares(readers: int, connections: int) -> list[int]:
    """How many GETs each connection pipelines: readers spread as evenly as they go."""
    base, extra = divmod(readers, connections)
    return [base + (i < extra) for i in range(connections)]


def burst_gets(path: str, readers: int, connections: int, timeout: float) -> tuple[list[bytes], float]:
    """Open every connection (each answers a PING first, so the server has accepted it), then
    write each its GETs of the hot key in one loop, then read every reply. The answers, and ms
    from the first write to the last reply."""
    socks: list[socket.socket] = []
    deadline = time.monotonic() + timeout
    try:
        for _ in range(connections):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(max(0.1, deadline - time.monotonic()))
            s.connect(path)
            socks.append(s)
        for s in socks:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
        for s in socks:
            if read_replies(s, 1, deadline) != [b"+PONG\r\n"]:
                raise RuntimeError("a connection did not answer PING with PONG")
        payloads = [GET_HOT * n for n in shares(readers, connections)]
        t0 = time.perf_counter()
        for s, payload in zip(socks, payloads, strict=True):
            s.sendall(payload)
        answers: list[bytes] = []
        for s, n in zip(socks, shares(readers, connections), strict=True):
            answers += read_replies(s, n, deadline)
        return answers, (time.perf_counter() - t0) * 1000
    finally:
        for s in socks:
            s.close()


def counters(c: Client) -> tuple[int, int]:
    """INFO routed_requests and reads_coalesced now (0 for a field this sidecar lacks)."""
    routing = c.info("routing").get("routing", {})
    stats = c.info("stats").get("stats", {})
    return int(routing.get("routed_requests", 0)), int(stats.get("reads_coalesced", 0))


def measure(c: Client, path: str, args: argparse.Namespace, expected: bytes, note: str = "") -> Burst:
    r0, k0 = counters(c)
    answers, ms = burst_gets(path, args.readers, args.connections, args.timeout)
    r1, k1 = counters(c)
    return Burst(r1 - r0, k1 - k0, answers, bulk(expected), ms, note)


# --------------------------------------------------------------------------- writes upstream


class Upstream:
    """The bucket, through nats-py: create it, write the hot key (and a few replicated keys)."""

    def __init__(self, url: str, value_bytes: int) -> None:
        self.url = url
        self.value_bytes = value_bytes
        self.writes = 0
        self.value = b""

    def _next_value(self) -> bytes:
        head = b"hot-%d-" % self.writes
        return head + b"x" * max(0, self.value_bytes - len(head))

    async def _create(self) -> None:
        nc = await nats.connect(self.url)
        try:
            js = nc.jetstream()
            await js.create_key_value(bucket=BUCKET, direct=True)
            for i in range(10):
                await js.publish(f"$KV.{BUCKET}.in.k{i}", b"in-%d" % i)
        finally:
            await nc.close()

    async def _write(self, value: bytes) -> int:
        nc = await nats.connect(self.url)
        try:
            ack = await nc.jetstream().publish(f"$KV.{BUCKET}.{HOT}", value)
            return ack.seq
        finally:
            await nc.close()

    def create(self) -> None:
        asyncio.run(self._create())
        self.write()

    def write(self) -> int:
        """One write of the hot key; its stream sequence."""
        value = self._next_value()
        seq = asyncio.run(self._write(value))
        self.writes += 1
        self.value = value
        return seq


# --------------------------------------------------------------------------- sidecars


def sidecar(data_dir: Path, url: str, src: Path, extra: list[str]) -> SidecarProcess:
    """`python -P -m kvcache serve` with PYTHONPATH=src: the kvcache of that source tree
    (-P: the working directory is not put before it on sys.path)."""
    sc = SidecarProcess(data_dir, url, [f"{BUCKET}:in.>"],
                        extra=["--log-level", "warning", *extra], env={"PYTHONPATH": str(src)})
    sc.args[1:1] = ["-P"]
    return sc


def native_of(c: Client) -> str:
    native = c.info("server").get("server", {}).get("native", {})
    if isinstance(native, dict):
        twins = sorted(k for k, v in native.items() if v != "native")
        return "all native" if not twins else f"twins: {', '.join(twins)}"
    return str(native or "?")


def wait_applied(c: Client, seq: int, timeout: float) -> str:
    """Until INFO's applied_seq for the bucket reaches `seq`; "" then, else what was seen."""
    def applied() -> bool:
        row = c.info("buckets")["buckets"].get(BUCKET, {})
        return int(row.get("applied_seq", 0)) >= seq
    try:
        wait_until(applied, timeout, f"applied_seq >= {seq}", interval=0.005)
        return ""
    except WaitTimeout:
        row = c.info("buckets")["buckets"].get(BUCKET, {})
        return (f"feed not at seq {seq} after {timeout:g} s (applied_seq={row.get('applied_seq')}, "
                f"upstream_seq={row.get('upstream_seq')})")


def make_cached(c: Client, timeout: float) -> str:
    """Read the hot key until the near cache holds it (TinyLFU admits by frequency: a few reads
    may be needed); "" then, else why not."""
    def cached() -> bool:
        c.get(HOT)
        row = c.info("buckets")["buckets"].get(BUCKET, {})
        entry = c.entry(HOT)
        return int(row.get("cache_keys", 0)) >= 1 and entry is not None and entry.source == "cache"
    try:
        wait_until(cached, timeout, f"{HOT} in the near cache", interval=0.01)
        return ""
    except WaitTimeout:
        return f"{HOT} not in the near cache after {timeout:g} s"


def run_variant(label: str, src: Path, url: str, tmp: Path, up: Upstream,
                args: argparse.Namespace) -> dict[str, list[Burst]]:
    """Every case, --repeat times, against the kvcache of `src`."""
    out: dict[str, list[Burst]] = {key: [] for _, key in CASES}
    clients = ["--max-clients", str(args.connections + 16)] if args.connections + 16 > DEFAULT_MAX_CLIENTS else []
    tag = label.replace(" ", "-").strip("()")
    sc = sidecar(tmp / f"{tag}-nocache", url, src, clients).start(timeout=120)
    try:
        with Client(sc.socket, timeout=30) as c:
            print(f"{label}: kvcache of {src} ({native_of(c)})", flush=True)
            for _ in range(args.repeat):
                out["nocache"].append(measure(c, sc.socket, args, up.value))
    finally:
        sc.stop()
    sc = sidecar(tmp / f"{tag}-cache", url, src,
                 ["--cache-max-keys", str(args.cache_max_keys), *clients]).start(timeout=120)
    try:
        with Client(sc.socket, timeout=30) as c:
            for _ in range(args.repeat):
                note = make_cached(c, 10)
                out["cached"].append(measure(c, sc.socket, args, up.value, note))
                seq = up.write()
                note = wait_applied(c, seq, 10)
                out["after_write"].append(measure(c, sc.socket, args, up.value, note))
                out["next"].append(measure(c, sc.socket, args, up.value))
            row = c.info("buckets")["buckets"].get(BUCKET, {})
            print(f"{label}: near cache at the end: cache_keys={row.get('cache_keys', 0)}, "
                  f"cache_updates={row.get('cache_updates', 0)}, "
                  f"cache_invalidations={row.get('cache_invalidations', 0)}", flush=True)
    finally:
        sc.stop()
    return out


# --------------------------------------------------------------------------- report


def spread(values: list[float], fmt: str = "{:.0f}") -> str:
    """One value, or the values of the repeats as "median (min–max)"."""
    if len(set(values)) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def equal_cell(bursts: list[Burst]) -> str:
    verdicts = [b.verdict() for b in bursts]
    bad = [v for v in verdicts if v != "yes"]
    return "yes" if not bad else f"{bad[0]} in {len(bad)} of {len(verdicts)}"


@dataclass
class Report:
    readers: int
    connections: int
    variants: list[tuple[str, dict[str, list[Burst]]]] = field(default_factory=list)

    def print(self) -> None:
        names = [v for v, _ in self.variants]
        def cols(title: str) -> list[str]:
            return [f"{title} ({n})" if len(names) > 1 else title for n in names]
        per = self.readers / self.connections
        how = (f"{self.readers} concurrent GETs of one key" if per == 1 else
               f"{self.readers} GETs of one key ({self.connections} connections × {per:g} pipelined)")
        head = ["case", *cols(f"Direct Gets for {how}"), *cols("reads_coalesced delta"),
                *cols("all answers equal"), *cols("burst ms")]
        print("\n| " + " | ".join(head) + " |")
        print("|---|" + "---:|" * (len(head) - 1))
        notes: list[str] = []
        for title, key in CASES:
            cells = [title]
            cells += [spread([b.direct_gets for b in res[key]]) for _, res in self.variants]
            cells += [spread([b.coalesced for b in res[key]]) for _, res in self.variants]
            cells += [equal_cell(res[key]) for _, res in self.variants]
            cells += [spread([b.elapsed_ms for b in res[key]], "{:.1f}") for _, res in self.variants]
            print("| " + " | ".join(cells) + " |")
            for name, res in self.variants:
                notes += [f"{name}, {title}: {b.note}" for b in res[key] if b.note]
        for n in notes:
            print(f"- {n}")


def fd_room(connections: int) -> None:
    """Enough file descriptors for the connections (the soft limit raised to the hard one if
    need be; the sidecar inherits it)."""
    need = connections + 64
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise SystemExit(f"stampede_bench: {connections} connections need {need} file descriptors; "
                         f"the limit is {hard} (use --connections)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--readers", type=int, default=100, help="GETs of the hot key in one burst")
    p.add_argument("--connections", type=int, default=0,
                   help="connections they are spread over, pipelined (default: readers, at most 100)")
    p.add_argument("--repeat", type=int, default=3, help="bursts per case")
    p.add_argument("--sidecar-src", type=Path, default=None, metavar="DIR",
                   help="also run every case against the kvcache of this source tree (before)")
    p.add_argument("--cache-max-keys", type=int, default=1000)
    p.add_argument("--value-bytes", type=int, default=100)
    p.add_argument("--timeout", type=float, default=30.0, help="seconds a burst may take")
    args = p.parse_args()
    if not 1 <= args.readers <= 100_000 or not 1 <= args.repeat <= 100:
        raise SystemExit("stampede_bench: --readers 1..100000, --repeat 1..100")
    args.connections = args.connections or min(args.readers, 100)
    if not 1 <= args.connections <= args.readers:
        raise SystemExit("stampede_bench: --connections 1..readers")
    fd_room(args.connections)
    variants: list[tuple[str, Path]] = []
    if args.sidecar_src is not None:
        src = args.sidecar_src.resolve()
        check_src(src, "stampede_bench")
        variants.append(("before", src))
    check_src(ROOT, "stampede_bench")
    variants.append(("this tree" if variants else "kvcache", ROOT))
    with tempfile.TemporaryDirectory(prefix="kvstampede-") as d:
        tmp = Path(d)
        server = NatsServer(tmp / "nats").start()
        try:
            up = Upstream(server.url, args.value_bytes)
            up.create()
            print(f"bucket {BUCKET}: replicated for in.>; {HOT} outside the filters, {args.value_bytes} "
                  f"bytes; bursts of {args.readers} GETs over {args.connections} connections, "
                  f"{args.repeat} per case; near cache of {args.cache_max_keys} keys", flush=True)
            report = Report(args.readers, args.connections)
            for label, src in variants:
                report.variants.append((label, run_variant(label, src, server.url, tmp, up, args)))
            report.print()
        finally:
            server.stop()


if __name__ == "__main__":
    try:
        main()
    except ResponseError as e:
        raise SystemExit(f"stampede_bench: {e}") from None
