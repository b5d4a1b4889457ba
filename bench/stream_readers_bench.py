"""Many local readers following one bucket as a Redis stream: N connections blocked
in `XREAD BLOCK 0 STREAMS @key <last ID>`, a writer changing the bucket at a steady rate. What
does fan-in cost, and does a reader that stops reading hurt the others?

A measurement script, not a test. Everything runs on this host, over 127.0.0.1 (nats-server)
and Unix sockets, in a temporary directory; every process it starts is stopped by its own PID;
every loop and wait is bounded in count and time.

  1. starts a nats-server and `kvcache serve` on an empty bucket `key`
     (`--client-write-stall-ms` --stall-ms), and notes the stream's consumer count;
  2. opens --readers connections in a child process (uvloop, raw RESP: the readers' own
     parsing is a regex over each reply, so that they cost the machine little), each blocked
     in XREAD from `$`, each sending the next XREAD from the last ID it got as soon as a reply
     is in; plus --stuck connections that, once the stream has filled a while, pipeline 100
     `XREAD ... STREAMS @key 0` (full listings) and never read their socket;
  3. a writer puts --rate distinct keys a second for --seconds (`s.<n>`, the value its
     wall-clock publish time in ns), so every change is an entry every reader must get;
  4. each reader records, per entry, the delay from the put to the reply that carried it;
     at the end: delivery delay p50/p99/max over every reader and entry, entries missing at
     any reader (must be 0), the sidecar's CPU per 1,000 deliveries (/proc/<pid>/stat over
     the writing window), the stream's consumer count during the run (must equal the one
     before: the readers add none), INFO's clients_cut_off (the stuck readers, alone).

    python bench/stream_readers_bench.py                       # 1,000 readers, 1,000 changes/s, 10 s
    python bench/stream_readers_bench.py --readers 100 --seconds 5
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
from array import array
from pathlib import Path

import nats

sys.path.insert(0, str(Path(__file__).resolve().parent))
from socket_bench import BUCKET, cpu_seconds, exit_on_sigterm, start_sidecar, stop, work_dir

from kvcache.app.client import Client
from kvcache.natsio.nats_server import NatsServer

STREAM = f"@{BUCKET}".encode()
STUCK_AFTER_S = 3.0  # after the readers are ready: the writer has been writing about 2 s


def xread(last: bytes) -> bytes:
    return b"*6\r\n$5\r\nXREAD\r\n$5\r\nBLOCK\r\n$1\r\n0\r\n$7\r\nSTREAMS\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (
        len(STREAM), STREAM, len(last), last)


# ----------------------------------------------------------------------------- the readers (child)

class Reader(asyncio.Protocol):
    """One blocked reader: XREAD from its last ID again as soon as a reply is complete. Its
    work per reply is a few searches in C, none per entry (a thousand readers must not need
    more CPU than the sidecar they measure): the reply's entry count, its first and last
    revisions (the bucket starts empty and every change is a new key, so the revisions a
    reader gets must run 1, 2, 3... with no gap: `got` counts them, a gap shows as missing)
    and the delays of its oldest and newest entries."""

    def __init__(self, drop: int = 0) -> None:
        self.drop = drop  # --inject-miss: skip a reply now and then (the checker must see it)
        self.buf = bytearray()
        self.last = b"$"
        self.top = 0          # the highest revision got
        self.got = 0          # entries got, with no gap
        self.gaps = 0         # revisions skipped
        self.replies = array("q")  # per reply: entries, oldest delay, newest delay
        self.error = ""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.write(xread(self.last))

    def data_received(self, data: bytes) -> None:
        now = time.time_ns()
        buf = self.buf
        buf += data
        if buf[:1] == b"-" or buf[:3] == b"*-1":
            if not buf.endswith(b"\r\n"):
                return
            if buf[:1] == b"-":
                self.error = buf[:200].decode(errors="replace")
        else:
            head = HEAD.match(buf)
            if head is None:
                return
            n = int(head.group(1))
            if buf.count(b"$7\r\ncreated\r\n") < n or TAIL.search(buf, len(buf) - 48) is None:
                return
            first = FIRST.search(buf, head.end())
            last_at = buf.rfind(b"$3\r\nkey\r\n")
            last = LAST.match(buf, buf.rfind(b"\r\n", 0, buf.rfind(b"-0\r\n*", 0, last_at)) + 2)
            r0, r1 = int(first.group(1)), int(last.group(1))
            self.replies.extend((n, now - int(first.group(2)), now - int(last.group(2))))
            skip = self.drop and len(self.replies) % (3 * self.drop) == 0
            if not skip:
                self.gaps += max(0, r0 - self.top - 1) + (r1 - r0 + 1 - n)
                self.got += n
            self.top = r1
            self.last = b"%d-0" % r1
        self.buf = bytearray()
        self.transport.write(xread(self.last))


HEAD = re.compile(rb"\*1\r\n\*2\r\n\$\d+\r\n@[^\r]+\r\n\*(\d+)\r\n")
TAIL = re.compile(rb"\$7\r\ncreated\r\n\$\d+\r\n\d+\r\n\Z")
# an entry's revision and its value (the publish time): the first from a position, the last
# from the start of its ID line
_ENTRY = rb"(\d+)-0\r\n\*8\r\n\$3\r\nkey\r\n\$\d+\r\n[^\r]*\r\n\$5\r\nvalue\r\n\$\d+\r\n(\d+)\r\n"
FIRST = re.compile(rb"\*2\r\n\$\d+\r\n" + _ENTRY)
LAST = re.compile(_ENTRY)


def delay_percentiles(replies: array, qs: tuple[float, ...]) -> list[float]:
    """Percentiles of the entries' delays, each reply's spread evenly between its oldest and
    newest entry's (exact for changes made at a steady rate and sent in one reply)."""
    points: list[tuple[float, float]] = []  # (delay, weight)
    for k in range(0, len(replies), 3):
        n, old, new = replies[k:k + 3]
        m = min(n, 8)
        for t in range(m):
            points.append((old + (new - old) * (t / (m - 1) if m > 1 else 0), n / m))
    points.sort()
    total = sum(w for _, w in points)
    out, acc, i = [], 0.0, 0
    for q in qs:
        while i < len(points) and acc + points[i][1] < q * total:
            acc += points[i][1]
            i += 1
        out.append(points[min(i, len(points) - 1)][0] if points else 0.0)
    return out


async def readers_main(sock: str, n: int, stuck: int, seconds: float, ready_file: str, out_file: str,
                       drop: int) -> None:
    loop = asyncio.get_running_loop()
    readers = [Reader(drop) for _ in range(n)]
    for r in readers:
        await loop.create_unix_connection(lambda r=r: r, sock)
    stuck_socks = []
    for _ in range(stuck):
        s = socket.socket(socket.AF_UNIX)
        s.connect(sock)
        s.setblocking(False)
        stuck_socks.append(s)
    Path(ready_file).write_text("ready")
    # the stuck readers ask, once the writer has filled the stream a while: 100 full listings
    # each, never read (as much as their socket takes: the sidecar stops reading them)
    await asyncio.sleep(STUCK_AFTER_S)
    ask = b"".join(b"*4\r\n$5\r\nXREAD\r\n$7\r\nSTREAMS\r\n$%d\r\n%s\r\n$1\r\n0\r\n" % (len(STREAM), STREAM)
                   for _ in range(100))
    for s in stuck_socks:
        try:
            s.send(ask)
        except BlockingIOError:
            pass
    await asyncio.sleep(seconds - STUCK_AFTER_S)
    replies = array("q")
    for r in readers:
        replies.extend(r.replies)
    p50, p99 = delay_percentiles(replies, (0.5, 0.99))
    Path(out_file).write_text(json.dumps({
        "deliveries": sum(r.got for r in readers), "p50": p50, "p99": p99,
        "max": max(replies[1::3], default=0), "replies": len(replies) // 3,
        "got": [r.got - r.gaps for r in readers], "errors": [r.error for r in readers if r.error][:5],
        "cpu": time.process_time()}))
    for s in stuck_socks:
        s.close()


# ----------------------------------------------------------------------------- the run

async def writer(url: str, rate: float, seconds: float) -> list[int]:
    nc = await nats.connect(url)
    revs = []
    try:
        kv = await nc.jetstream().key_value(BUCKET)
        t0 = time.monotonic()
        i = 0
        while (elapsed := time.monotonic() - t0) < seconds:
            due = int(elapsed * rate)
            while i < due:
                revs.append(await kv.put(f"s.{i}", b"%d" % time.time_ns()))
                i += 1
            await asyncio.sleep(0.001)
    finally:
        await nc.close()
    return revs


async def consumer_count(url: str) -> int:
    nc = await nats.connect(url)
    try:
        return (await nc.jetstream().stream_info(f"KV_{BUCKET}")).state.consumer_count
    finally:
        await nc.close()


async def make_bucket(url: str) -> None:
    nc = await nats.connect(url)
    try:
        await nc.jetstream().create_key_value(bucket=BUCKET, history=1)
    finally:
        await nc.close()


def run(work: Path, args: argparse.Namespace) -> str:
    server = NatsServer(work / "js", host="127.0.0.1", server_name="bench").start()
    sidecar = readers = None
    try:
        asyncio.run(make_bucket(server.url))
        sidecar, sock = start_sidecar(work, server.url, keys=0, src=args.sidecar_src,
                                      extra=["--client-write-stall-ms", str(args.stall_ms), "--max-clients",
                                             str(args.readers + args.stuck + 100)])
        before = asyncio.run(consumer_count(server.url))
        ready, out = work / "ready", work / "out.json"
        wall = args.seconds + 8
        readers = subprocess.Popen([sys.executable, __file__, "--child", sock, str(args.readers), str(args.stuck),
                                    str(wall), str(ready), str(out), str(args.inject_miss)])
        deadline = time.monotonic() + 60
        while not ready.exists():
            if time.monotonic() > deadline or readers.poll() is not None:
                raise RuntimeError("the readers did not connect")
            time.sleep(0.1)
        time.sleep(1.0)
        during = asyncio.run(consumer_count(server.url))
        cpu0, t0 = cpu_seconds(sidecar.pid), time.monotonic()
        revs = asyncio.run(writer(server.url, args.rate, args.seconds))
        time.sleep(2.0)  # the last replies
        cpu = cpu_seconds(sidecar.pid) - cpu0
        window = time.monotonic() - t0
        with Client(sock, timeout=120) as c:  # an overloaded sidecar answers late, not never
            info = c.info("clients")["clients"]
        readers.wait(wall + 120)
        data = json.loads(out.read_text())
    finally:
        if readers is not None and readers.poll() is None:
            readers.kill()
        stop(sidecar)
        server.stop()
    if revs and (revs[0] != 1 or revs[-1] != len(revs)):
        raise RuntimeError(f"the bucket's revisions were not 1..{len(revs)}: {revs[0]}..{revs[-1]}")
    missing = sum(len(revs) - got for got in data["got"])
    deliveries = data["deliveries"]
    ms = 1e6
    return "\n".join([
        f"{args.readers:,} readers blocked in XREAD on @{BUCKET}, {args.stuck} stuck (100 pipelined XREADs each, "
        f"never reading), {len(revs):,} changes at {args.rate:,.0f}/s for {args.seconds:g}s; "
        f"client_write_stall_ms {args.stall_ms:,}", "",
        "| deliveries | missing at some reader | delay p50 ms | p99 ms | max ms | sidecar CPU s "
        "| per 1,000 deliveries ms | consumers before / during | clients_cut_off |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {deliveries:,} | {missing:,} | {data['p50'] / ms:.1f} | {data['p99'] / ms:.1f} | {data['max'] / ms:.1f} | "
        f"{cpu:.2f} (over {window:.1f}s) | {1000 * cpu * 1000 / max(1, deliveries):.2f} | {before} / {during} | "
        f"{info.get('clients_cut_off', '?')} |", "",
        f"The readers' own process used {data['cpu']:.1f} s of CPU (2 CPUs on this machine: it competes with the "
        "sidecar and nats-server).",
        *(f"reader error: {e}" for e in data["errors"]),
    ])


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        import uvloop
        sock, n, stuck, seconds, ready, out, drop = sys.argv[2:9]
        uvloop.run(readers_main(sock, int(n), int(stuck), float(seconds), ready, out, int(drop)))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--readers", type=int, default=1000)
    ap.add_argument("--stuck", type=int, default=1)
    ap.add_argument("--rate", type=float, default=1000.0, help="changes per second")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--stall-ms", type=int, default=3000)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--sidecar-src", type=Path, default=None, metavar="DIR",
                    help="run the kvcache of this source tree (a worktree of another commit, built)")
    ap.add_argument("--inject-miss", type=int, default=0, metavar="N",
                    help="the readers forget every N-th reply: the missing count must show it")
    args = ap.parse_args()
    exit_on_sigterm()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    with work_dir("kvcache-stream-readers-", lambda: args.keep) as work:
        print(run(work, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
