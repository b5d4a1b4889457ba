"""Slow readers of large values: N connections pipeline GETs of 1 MiB values and
never read their socket. Does the sidecar's memory stay bounded, and does another client's
latency stay where it was?

A measurement script, not a test. Everything runs on this host, over 127.0.0.1 (nats-server)
and Unix sockets, in a temporary directory; every process it starts is stopped by its own PID;
every loop and wait is bounded in count and time.

  1. starts a nats-server (max_payload raised to 8 MiB, so 1 MiB values pass with room for
     their headers) and fills bucket `key` with --large keys of --value-size random bytes
     (`key:000000000000`...) and one small key (`key:<--large>`, 100 bytes); starts
     `kvcache serve` with `--client-write-stall-ms` (--stall-ms) and waits until it is synced;
     reads every large key once (so the replica's pages are in the sidecar's RSS in every phase);
  2. baseline: a bystander (kvcache.Client, one connection) GETs the small key --gets times,
     one at a time; its p50/p99/max, and the sidecar's VmRSS and RssAnon sampled every 0.2 s
     (the max kept), INFO's connected_clients and clients_cut_off;
  3. stuck: --stuck raw Unix-socket connections each send --pipeline GETs of large keys in one
     write and never read; after --settle seconds the same bystander measurement while they
     stay stuck (before client_write_stall_ms has passed), and CLIENT LIST's omem (the replies
     the sidecar holds for them, its transport buffers) summed over them;
  4. cut off: waits until client_write_stall_ms has cut every stuck connection off (INFO
     clients_cut_off), then measures again, RSS from then on (skipped with --stall-ms 0: the
     sidecar never cuts off; the default 10 s keeps the run short, the sidecar's is 60 s);
  5. closed: the stuck sockets are closed by this script, measures again.

Prints a markdown table: per phase the bystander's p50/p99/max, the sidecar's RSS (max while
the phase ran, and at its end), connected clients and clients_cut_off.

    python bench/slow_readers_bench.py                          # 100 stuck, 50 GETs each
    python bench/slow_readers_bench.py --stuck 20 --gets 1000   # a quick look
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import random
import resource
import socket
import struct
import sys
import termios
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import nats

sys.path.insert(0, str(Path(__file__).resolve().parent))
from socket_bench import (
    BUCKET,
    exit_on_sigterm,
    key,
    load_bucket,
    proc_status,
    start_sidecar,
    stop,
    wait_until,
    work_dir,
)

from kvcache.app.client import Client
from kvcache.natsio.nats_server import NatsServer

MIB = 1 << 20
MAX_PAYLOAD = 8 << 20      # nats-server's max_payload here (the default is 1 MiB)
SMALL_VALUE = b"s" * 100
SAMPLE_EVERY = 0.2         # seconds between RSS samples
WRITE_HIGH_WATER = MIB     # kvcache/serve/client_connection.py: a connection's transport pauses above it


def raise_nofile(wanted: int) -> None:
    """The soft RLIMIT_NOFILE toward `wanted`, never above the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


class RssSampler:
    """VmRSS and RssAnon of one process every SAMPLE_EVERY seconds, from a thread; the max since
    the last reset(). Bounded: stop() ends it, and it ends by itself after `limit` seconds."""

    def __init__(self, pid: int, limit: float = 900) -> None:
        self.pid = pid
        self.limit = limit
        self.lock = threading.Lock()
        self.max_rss = self.max_anon = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss", daemon=True)

    def start(self) -> RssSampler:
        self.reset()
        self._thread.start()
        return self

    def sample(self) -> tuple[int, int]:
        rss, anon = proc_status(self.pid, "VmRSS"), proc_status(self.pid, "RssAnon")
        with self.lock:
            self.max_rss = max(self.max_rss, rss)
            self.max_anon = max(self.max_anon, anon)
        return rss, anon

    def reset(self) -> None:
        with self.lock:
            self.max_rss = self.max_anon = 0
        with contextlib.suppress(OSError, KeyError):
            self.sample()

    def maxima(self) -> tuple[int, int]:
        with contextlib.suppress(OSError, KeyError):
            self.sample()
        with self.lock:
            return self.max_rss, self.max_anon

    def _run(self) -> None:
        deadline = time.monotonic() + self.limit
        while not self._stop.wait(SAMPLE_EVERY) and time.monotonic() < deadline:
            try:
                self.sample()
            except (OSError, KeyError):
                return  # the process is gone

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


@dataclass
class Phase:
    name: str
    lat_us: list[float] = field(default_factory=list)
    max_rss: int = 0
    max_anon: int = 0
    end_rss: int = 0
    end_anon: int = 0
    connected: int = 0
    cut_off: int = 0
    omem: int = 0          # CLIENT LIST omem summed over every connection but the bystander's
    kernel: int = 0        # replies queued in the kernel for the stuck sockets (FIONREAD, summed)
    seconds: float = 0.0

    def pct(self, q: float) -> float:
        xs = sorted(self.lat_us)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


# ----------------------------------------------------------------------------- setup

async def add_small_key(url: str, name: str) -> None:
    nc = await nats.connect(url, connect_timeout=5, allow_reconnect=False)
    try:
        await nc.jetstream(timeout=30).publish(f"$KV.{BUCKET}.{name}", SMALL_VALUE)
    finally:
        await nc.close()


def clients(sock: str) -> tuple[int, int, int]:
    """INFO's connected_clients and clients_cut_off, and CLIENT LIST's omem summed over the
    other connections (this one's own line excluded: it has no output queued but this reply)."""
    with Client(sock, timeout=10) as c:
        row = c.info("clients")["clients"]
        listing = c.execute("CLIENT", "LIST")
        me = c.execute("CLIENT", "ID")
    text = listing.decode() if isinstance(listing, bytes) else str(listing)
    omem = 0
    for line in text.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if fields.get("id") != str(me):
            omem += int(fields.get("omem", 0))
    return int(row["connected_clients"]), int(row["clients_cut_off"]), omem


def bystander(sock: str, name: str, gets: int, timeout: float) -> list[float]:
    """`gets` GETs of the small key, one at a time over one connection; latencies in µs, every
    reply checked. 200 warm-up GETs first, not counted."""
    lat = []
    deadline = time.monotonic() + timeout
    with Client(sock, timeout=10) as c:
        for _ in range(200):
            c.get(name)
        for _ in range(gets):
            t0 = time.perf_counter_ns()
            v = c.get(name)
            lat.append((time.perf_counter_ns() - t0) / 1e3)
            if v != SMALL_VALUE:
                raise RuntimeError(f"bystander: {name} answered {v!r:.40}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"bystander: {len(lat)} of {gets} GETs in {timeout}s")
    return lat


def measure(phase: Phase, sock: str, name: str, sampler: RssSampler, gets: int, timeout: float) -> Phase:
    """The bystander's GETs while the sampler keeps the max RSS; then INFO and the RSS now."""
    t0 = time.monotonic()
    phase.lat_us = bystander(sock, name, gets, timeout)
    phase.seconds = time.monotonic() - t0
    phase.max_rss, phase.max_anon = sampler.maxima()
    phase.end_rss, phase.end_anon = sampler.sample()
    phase.connected, phase.cut_off, phase.omem = clients(sock)
    print(f"  {phase.name}: p50 {phase.pct(0.5):.1f} us, p99 {phase.pct(0.99):.1f} us, RSS max "
          f"{phase.max_rss / MIB:.0f} MiB (anon {phase.max_anon / MIB:.0f}), end {phase.end_rss / MIB:.0f} MiB, "
          f"{phase.connected} clients, {phase.cut_off} cut off, omem {phase.omem / MIB:.1f} MiB", file=sys.stderr)
    return phase


def open_stuck(sock: str, n: int, pipeline: int, large: int) -> list[socket.socket]:
    """n connections, each sending `pipeline` GETs of large keys in one write, never reading."""
    conns = []
    try:
        for i in range(n):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(10)
            s.connect(sock)
            names = [f"{BUCKET}:{key((i + j) % large)}".encode() for j in range(pipeline)]
            s.sendall(b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k) for k in names))
            conns.append(s)
    except BaseException:
        for s in conns:
            s.close()
        raise
    return conns


def unread(s: socket.socket) -> int:
    """Bytes waiting in a socket's receive queue: for a Unix socket, what the sidecar wrote
    that the kernel holds (charged to the sidecar's send buffer; not in its RSS)."""
    return struct.unpack("i", fcntl.ioctl(s.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]


# ----------------------------------------------------------------------------- the run

def run(work: Path, args: argparse.Namespace) -> tuple[list[Phase], dict[str, object]]:
    value = random.Random(29).randbytes(args.value_size)
    small = f"{BUCKET}:{key(args.large)}"
    phases: list[Phase] = []
    facts: dict[str, object] = {}
    nats_srv = sidecar = sampler = None
    conns: list[socket.socket] = []
    try:
        nats_srv = NatsServer(work / "nats" / "js", host="127.0.0.1", server_name="bench",
                              extra_conf=f"max_payload: {MAX_PAYLOAD}").start()
        t0 = time.monotonic()
        asyncio.run(load_bucket(nats_srv.url, value, args.large))
        asyncio.run(add_small_key(nats_srv.url, key(args.large)))
        print(f"bucket loaded: {args.large} keys of {args.value_size:,} B and one of {len(SMALL_VALUE)} B "
              f"in {time.monotonic() - t0:.1f}s", file=sys.stderr)
        sidecar, sock = start_sidecar(work, nats_srv.url, args.large + 1,
                                      extra=["--client-write-stall-ms", str(args.stall_ms)])
        with Client(sock, timeout=30) as c:
            for i in range(args.large):  # every large value once: its pages now in RSS
                if c.get(f"{BUCKET}:{key(i)}") != value:
                    raise RuntimeError(f"the sidecar's value of {BUCKET}:{key(i)} differs")
            server = c.info("server")["server"]
            facts["native"] = server.get("native")
            facts["version"] = server.get("kvcache_version")
        sampler = RssSampler(sidecar.pid).start()

        phases.append(measure(Phase("baseline"), sock, small, sampler, args.gets, args.timeout))

        # stuck readers: open them, let the sidecar fill their buffers and pause, then measure
        sampler.reset()
        t_open = time.monotonic()
        conns = open_stuck(sock, args.stuck, args.pipeline, args.large)
        facts["open_seconds"] = time.monotonic() - t_open
        # connected_clients counts the INFO connection asking too
        wait_until(lambda: clients(sock)[0] >= args.stuck + 1, 30, f"{args.stuck} stuck connections registered")
        time.sleep(args.settle)
        stuck = measure(Phase(f"{args.stuck} stuck readers"), sock, small, sampler, args.gets, args.timeout)
        stuck.kernel = sum(unread(s) for s in conns)
        stuck.seconds = time.monotonic() - t_open
        phases.append(stuck)
        if args.stall_ms and stuck.cut_off > phases[0].cut_off:
            facts["early_cut_off"] = (f"{stuck.cut_off - phases[0].cut_off} cut off already while the stuck "
                                      f"phase was measured ({stuck.seconds:.1f}s after opening; "
                                      f"--stall-ms {args.stall_ms})")

        if args.stall_ms:
            target = phases[0].cut_off + args.stuck
            wait_until(lambda: clients(sock)[1] >= target, args.stall_ms / 1000 + 30,
                       "client_write_stall_ms to cut every stuck connection off")
            facts["cut_off_after"] = time.monotonic() - t_open
            sampler.reset()  # from the cut-off on
            phases.append(measure(Phase("after the cut-off"), sock, small, sampler, args.gets, args.timeout))

        sampler.reset()
        for s in conns:
            s.close()
        conns = []
        wait_until(lambda: clients(sock)[0] <= 1, 30, "stuck connections gone")
        time.sleep(0.5)
        phases.append(measure(Phase("stuck sockets closed"), sock, small, sampler, args.gets, args.timeout))
        return phases, facts
    finally:
        for s in conns:
            s.close()
        if sampler is not None:
            sampler.stop()
        code = stop(sidecar)
        if code not in (None, 0):
            facts["problem"] = f"sidecar exited with {code}; log in {work}/kvcache.log"
        if nats_srv:
            nats_srv.stop()


def table(phases: list[Phase], facts: dict[str, object], args: argparse.Namespace) -> str:
    base = phases[0]
    lines = [f"{args.stuck} connections each pipelining {args.pipeline} GETs of {args.value_size / MIB:g} MiB values "
             f"({args.stuck * args.pipeline * args.value_size / MIB:,.0f} MiB requested) and never reading; "
             f"a bystander's {args.gets:,} GETs of a {len(SMALL_VALUE)}-byte key per phase (kvcache.Client, "
             f"one at a time); kvcache {facts.get('version', '?')}, native {facts.get('native', '?')}", "",
             "| phase | bystander p50 µs | p99 µs | max µs | sidecar RSS MiB, max during (at end) | RssAnon MiB, "
             "max (at end) | replies held (CLIENT LIST omem) MiB | in the kernel (unread in the sockets) MiB | "
             "connected clients | clients_cut_off |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in phases:
        lines.append(f"| {p.name} | {p.pct(0.5):.1f} | {p.pct(0.99):.1f} | {max(p.lat_us):.0f} | "
                     f"{p.max_rss / MIB:,.0f} ({p.end_rss / MIB:,.0f}) | {p.max_anon / MIB:,.0f} "
                     f"({p.end_anon / MIB:,.0f}) | {p.omem / MIB:,.1f} | {p.kernel / MIB:,.1f} | {p.connected} | "
                     f"{p.cut_off} |")
    stuck = phases[1]
    grown = stuck.max_rss - base.max_rss
    lines += ["",
              f"RSS growth with the stuck readers: {grown / MIB:,.0f} MiB, {grown / max(1, args.stuck) / MIB:.2f} MiB "
              f"per stuck connection (RssAnon {(stuck.max_anon - base.max_anon) / max(1, args.stuck) / MIB:.2f}); "
              f"the replies the sidecar held for them: {stuck.omem / max(1, args.stuck) / MIB:.2f} MiB each "
              f"(of {args.pipeline * args.value_size / MIB:,.0f} MiB requested), and the kernel "
              f"{stuck.kernel / max(1, args.stuck) / MIB:.2f} MiB each (a reply of 128 KiB or more raises its "
              f"socket's send buffer to up to 1 MiB, which Linux books twice: SNDBUF_MAX, "
              f"kvcache/serve/server_get.py); "
              f"p99 {stuck.pct(0.99) / base.pct(0.99):.2f}× the baseline's, p50 {stuck.pct(0.5) / base.pct(0.5):.2f}×.",
              f"Bounds: a connection stops reading requests once more than {WRITE_HIGH_WATER // MIB} MiB of its "
              f"output is unsent (WRITE_HIGH_WATER, kvcache/serve/client_connection.py), so it holds at most that plus "
              f"the reply that crossed it, less what the kernel's socket buffer took (not in RSS), and "
              f"`client_write_stall_ms` (here {args.stall_ms:,}; the default is 60,000) cuts off one that reads "
              f"none of it for that long; `max_clients` bounds how many such connections there can be."]
    if args.stall_ms:
        lines.append(f"Every stuck connection was cut off {facts['cut_off_after']:.1f}s after they were opened.")
    for k in ("early_cut_off", "problem"):
        if k in facts:
            lines.append(f"NOTE: {facts[k]}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stuck", type=int, default=100, help="connections that never read (100)")
    ap.add_argument("--pipeline", type=int, default=50, help="GETs of large values each sends (50)")
    ap.add_argument("--large", type=int, default=100, help="large keys in the bucket (100)")
    ap.add_argument("--value-size", type=int, default=MIB, help="bytes per large value (1 MiB)")
    ap.add_argument("--gets", type=int, default=5000, help="the bystander's GETs per phase (5,000)")
    ap.add_argument("--settle", type=float, default=2.0, help="seconds after opening the stuck readers (2)")
    ap.add_argument("--stall-ms", type=int, default=10_000,
                    help="the sidecar's --client-write-stall-ms (10,000; 0: never cut off, no cut-off phase)")
    ap.add_argument("--timeout", type=float, default=120, help="per bystander phase (120 s)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = ap.parse_args()
    if min(args.stuck, args.pipeline, args.large, args.gets, args.value_size) < 1:
        ap.error("--stuck, --pipeline, --large, --gets and --value-size must be positive")
    if args.value_size > MAX_PAYLOAD - 4096:
        ap.error(f"--value-size: at most {MAX_PAYLOAD - 4096} (nats-server's max_payload here)")
    if args.stall_ms and args.stall_ms / 1000 < args.settle + 3:
        ap.error("--stall-ms: leave the stuck phase time to be measured (more than --settle + 3 s)")
    exit_on_sigterm()
    raise_nofile(args.stuck + 256)
    with work_dir("kvcache-slow-readers-", lambda: args.keep) as work:
        phases, facts = run(work, args)
        print("\n" + table(phases, facts, args))
        args.keep = args.keep or "problem" in facts
        return 1 if "problem" in facts else 0


if __name__ == "__main__":
    sys.exit(main())
