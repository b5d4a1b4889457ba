"""Live updates at the rate the server delivers: under a sustained write load into a large
bucket, the rate at which the sidecar's feed applies the stream and how far behind it stays,
beside a raw consumer of the same stream, and whether the replica equals the stream after.

A measurement script, not a test. sync_bench.py measures the initial sync; this is the state
after it, which a sidecar spends its life in: a replicated bucket and writes arriving as fast
as several publishers can make them. The question is whether the feed keeps up with what the
server delivers (applied rate against a raw consumer's on the same stream in the same run),
whether its lag stays bounded rather than growing through the run, and whether it loses or
misorders anything (the replica read back against every write's acknowledgement).

One run, everything on 127.0.0.1 and Unix sockets:

  1. one nats-server (JetStream, a temporary directory); bucket `live` (history 1) loaded with
     --keys keys of --value-size bytes by pipelined nats-py publishes, as sync_bench.py loads;
  2. `kvcache serve` on it (a process, as sync_bench.py starts it; --other-src DIR: the kvcache
     of another source tree) until INFO says synced with every key;
  3. a raw consumer in its own process: a bare NATS connection (no nats-py) that creates an
     ephemeral pull consumer (AckNone, deliver_policy new, in memory), keeps two pull requests
     of --window messages in flight and only searches each read's bytes for the deliveries'
     ack subjects (sync_bench.py's `raw-scan`), noting the stream sequence of the last one:
     what the server delivers to one connection, the reference;
  4. --publishers processes, each a bare NATS connection publishing puts of --value-size bytes
     (`live:p<publisher>:w<write>:...`) to random existing keys, at most --inflight
     unacknowledged, for --seconds (or until --max-writes in all), each keeping the stream
     sequence its acknowledgement gave every write. Bare sockets rather than nats-py: a
     nats-py publish costs its process tens of µs of CPU, a bare one a few, and on a small
     machine the writers' CPU is taken from the server and the readers;
  5. once a second: the stream's last sequence (STREAM.INFO), the sidecar's `applied_seq` and
     `lag_ms` (INFO buckets), the raw consumer's last sequence, and each process's CPU time
     (/proc/<pid>/stat);
  6. after the publishers stop: until both readers reach the stream's last sequence (bounded),
     then every written key read through the sidecar (MGET over its socket) against its write
     with the highest acknowledged sequence across publishers, a sample of untouched keys
     against their loaded values, and a sample of written keys against the stream itself
     (STREAM.MSG.GET of the subject's last message: does the expectation hold?).

Rates are over the publishing window (the first sample, at the start, to the last before the
first publisher stopped): messages applied (or delivered, or stored) per second. Lag in
messages is the stream's last sequence minus the reader's; the stream is asked just after
the sidecar, so it errs high by what arrives in between. Its least-squares slope over the
window (messages/s) and its median and max in the first and last 10 s say whether it grows.
The sidecar's CPU per applied message is over the same window.

    python bench/live_bench.py                          # 1,000,000 keys, 4 publishers, 60 s
    python bench/live_bench.py --keys 20000 --seconds 10 --publishers 2

Every process it starts is stopped by its PID on every exit path (and gets SIGTERM if this
script dies: PR_SET_PDEATHSIG); every wait is bounded in time.
"""
from __future__ import annotations

import argparse
import array
import asyncio
import itertools
import json
import os
import random
import re
import secrets
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import nats

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from socket_bench import exit_on_sigterm, stop, work_dir
from sync_bench import versions

from kvcache.app.client import Client, ConnectionFailed
from kvcache.natsio.nats_server import NatsServer, die_with_parent

BUCKET = "live"
STREAM = f"KV_{BUCKET}"
CHILD = "_child"  # argv[1] when this script runs as a publisher or the raw consumer
# A delivery's reply subject (v1 form: $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>...)
ACK = f" $JS.ACK.{STREAM}.".encode()
SEQ = re.compile(rb'"seq":(\d+)')
SEND_BATCH = 512  # puts per socket write in a publisher
REPORT_S = 0.02  # the raw consumer's progress lines, at most this often
MGET_BATCH = 1000
TICK = os.sysconf("SC_CLK_TCK")


# ----------------------------------------------------------------------------- values

def key_name(i: int) -> str:
    return f"k.{i:08d}"


def loaded_value(i: int, size: int) -> bytes:
    head = b"load:%08d:" % i
    return head + b"-" * (size - len(head))


def written_value(publisher: int, j: int, size: int) -> bytes:
    """Write j of publisher `publisher`: recognizable in the replica, and recomputable."""
    head = b"live:p%d:w%010d:" % (publisher, j)
    return head + b"." * (size - len(head))


def cpu_seconds(pid: int | None) -> float | None:
    """utime + stime of a live process (all its threads), None once it is gone."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / TICK


# ----------------------------------------------------------------------------- loading

async def load(js: nats.js.JetStreamContext, n: int, size: int, chunk: int, deadline: float) -> float:
    """Create the bucket and write n keys with pipelined acked publishes; returns seconds."""
    await js.create_key_value(bucket=BUCKET, history=1)
    t0 = time.monotonic()
    for start in range(0, n, chunk):
        if time.monotonic() > deadline:
            raise TimeoutError(f"loading did not finish in time ({start} of {n} written)")
        await asyncio.gather(*(js.publish(f"$KV.{BUCKET}.{key_name(i)}", loaded_value(i, size))
                               for i in range(start, min(start + chunk, n))))
    seconds = time.monotonic() - t0
    info = await js.stream_info(STREAM)
    if info.state.messages != n:
        raise RuntimeError(f"stream holds {info.state.messages} messages, expected {n}")
    return seconds


# ----------------------------------------------------------------------------- children: bare NATS

def pub(subject: str, reply: str, payload: bytes) -> bytes:
    return f"PUB {subject} {reply} {len(payload)}\r\n".encode() + payload + b"\r\n"


async def nats_connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A bare NATS connection: INFO, CONNECT, and a PING answered (the server took us)."""
    u = urllib.parse.urlsplit(url)
    reader, writer = await asyncio.wait_for(asyncio.open_connection(u.hostname, u.port), 5)
    if not (await asyncio.wait_for(reader.readline(), 5)).startswith(b"INFO "):
        raise RuntimeError("no INFO from nats-server")
    connect = {"verbose": False, "pedantic": False, "headers": True, "no_responders": True,
               "protocol": 1, "lang": "raw", "version": "0"}
    writer.write(f"CONNECT {json.dumps(connect)}\r\nPING\r\n".encode())
    for _ in range(100):
        line = await asyncio.wait_for(reader.readline(), 5)
        if line.startswith(b"PONG"):
            return reader, writer
        if not line or line.startswith(b"-ERR"):
            raise RuntimeError(f"nats-server refused the connection: {line!r}")
    raise RuntimeError("no PONG from nats-server")


def frames(buf: bytearray, writer: asyncio.StreamWriter) -> tuple[list[tuple[bytes, bytes]], int]:
    """The complete MSG/HMSG frames at the start of buf as (subject, payload with any
    headers), and the bytes they took; answers PINGs, raises on -ERR."""
    out: list[tuple[bytes, bytes]] = []
    pos, size = 0, len(buf)
    while (eol := buf.find(b"\r\n", pos)) >= 0:
        op = buf[pos:pos + 4]
        if op == b"MSG " or op == b"HMSG":
            parts = buf[pos:eol].split()
            end = eol + 4 + int(parts[-1])
            if end > size:
                break
            out.append((bytes(parts[1]), bytes(buf[eol + 2:end - 2])))
            pos = end
        else:
            if op == b"PING":
                writer.write(b"PONG\r\n")
            elif op == b"-ERR":
                raise RuntimeError(f"nats-server: {bytes(buf[pos:eol]).decode(errors='replace')}")
            pos = eol + 2
    return out, pos


@dataclass
class Writes:
    """One publisher's writes, by index j: the key, then the acknowledged stream sequence
    (0 while unacknowledged, -1 refused)."""
    keys: array.array = field(default_factory=lambda: array.array("i"))
    seqs: array.array = field(default_factory=lambda: array.array("q"))
    acked: int = 0
    refused: int = 0

    @property
    def pending(self) -> int:
        return len(self.keys) - self.acked - self.refused


async def receive_acks(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, w: Writes,
                       progress: asyncio.Event) -> None:
    buf = bytearray()
    while True:
        data = await reader.read(1 << 20)
        if not data:
            raise RuntimeError("nats-server closed the connection")
        buf += data
        msgs, pos = frames(buf, writer)
        del buf[:pos]
        for subject, payload in msgs:
            j = int(subject[subject.rfind(b".") + 1:])
            m = SEQ.search(payload)
            if m and b'"error"' not in payload:
                w.seqs[j] = int(m[1])
                w.acked += 1
            else:  # an error reply, or a 503 (no responders) status
                w.seqs[j] = -1
                w.refused += 1
        if msgs:
            progress.set()


async def wait_progress(progress: asyncio.Event, receiving: asyncio.Task, timeout: float) -> None:
    if receiving.done():
        receiving.result()  # raises what stopped it
        raise RuntimeError("the acknowledgement reader stopped")
    progress.clear()
    try:
        await asyncio.wait_for(progress.wait(), timeout)
    except TimeoutError:
        pass


async def send_writes(writer: asyncio.StreamWriter, inbox: bytes, w: Writes, progress: asyncio.Event,
                      receiving: asyncio.Task, cfg: dict, t0: float) -> None:
    """Puts to random keys, at most cfg["inflight"] unacknowledged, until the time or the
    count is up; at cfg["rate"] per second when that is set."""
    rng = random.Random(cfg["seed"])
    p, n_keys, size, rate = cfg["publisher"], cfg["keys"], cfg["value_size"], cfg["rate"]
    deadline, limit = t0 + cfg["seconds"], cfg["max_writes"]
    prefix = f"$KV.{BUCKET}.".encode()
    while (sent := len(w.keys)) < limit and (now := time.monotonic()) < deadline:
        room = min(cfg["inflight"] - w.pending, SEND_BATCH, limit - sent)
        if rate and int((now - t0) * rate) + 1 - sent < room:
            room = int((now - t0) * rate) + 1 - sent
            if room <= 0:
                await asyncio.sleep(0.001)
                continue
        if room <= 0:
            await wait_progress(progress, receiving, 1)
            continue
        out = []
        for j in range(sent, sent + room):
            k = rng.randrange(n_keys)
            w.keys.append(k)
            w.seqs.append(0)
            v = written_value(p, j, size)
            out.append(b"PUB %bk.%08d %b.%d %d\r\n%b\r\n" % (prefix, k, inbox, j, len(v), v))
        writer.write(b"".join(out))
        await writer.drain()


def last_writes(w: Writes) -> tuple[array.array, list[int]]:
    """Per key, the acknowledged write with the highest sequence, as (key, seq, j) triples;
    and the keys with a write never acknowledged (their value is not known)."""
    best: dict[int, int] = {}
    unknown: set[int] = set()
    seqs = w.seqs
    for j, k in enumerate(w.keys):
        s = seqs[j]
        if s > 0:
            b = best.get(k)
            if b is None or s > seqs[b]:
                best[k] = j
        elif s == 0:
            unknown.add(k)
    out = array.array("q")
    for k, j in best.items():
        out.extend((k, seqs[j], j))
    return out, sorted(unknown)


async def run_publisher(cfg: dict) -> dict:
    reader, writer = await nats_connect(cfg["url"])
    inbox = f"_LIVE.{cfg['publisher']}.{secrets.token_hex(4)}"
    writer.write(f"SUB {inbox}.* 1\r\n".encode())
    w, progress = Writes(), asyncio.Event()
    receiving = asyncio.create_task(receive_acks(reader, writer, w, progress))
    try:
        print("ready", flush=True)
        if (await asyncio.wait_for(asyncio.to_thread(sys.stdin.readline), 120)).strip() != "go":
            raise RuntimeError("no go")
        t0 = time.monotonic()
        await send_writes(writer, inbox.encode(), w, progress, receiving, cfg, t0)
        sending_s = time.monotonic() - t0
        deadline = time.monotonic() + cfg["ack_timeout"]
        while w.pending and time.monotonic() < deadline:
            await wait_progress(progress, receiving, 1)
        print("done", flush=True)  # sending stopped, acknowledgements in
    finally:
        receiving.cancel()
        writer.close()
    triples, unknown = last_writes(w)
    Path(cfg["out"]).write_bytes(triples.tobytes())
    return {"sent": len(w.keys), "acked": w.acked, "refused": w.refused, "unacked": w.pending,
            "sending_s": sending_s, "unknown_keys": unknown}


def last_seq_in(buf: bytes) -> int:
    """The stream sequence of the last delivery in buf whose reply subject is complete."""
    end = len(buf)
    while (i := buf.rfind(ACK, 0, end)) >= 0:
        sp = buf.find(b" ", i + len(ACK))
        if sp > 0:
            return int(buf[i + len(ACK):sp].split(b".")[2])
        end = i
    return 0


async def run_raw(cfg: dict) -> None:
    """The raw consumer: creates its consumer, says "ready", then prints `<monotonic time>
    <deliveries> <last stream seq>` as they move, until killed or cfg["lifetime"] is up."""
    reader, writer = await nats_connect(cfg["url"])
    token = secrets.token_hex(6)
    name, inbox, window = "raw" + token, "_RAW." + token, cfg["window"]
    config = {"name": name, "ack_policy": "none", "deliver_policy": "new", "replay_policy": "instant",
              "filter_subject": f"$KV.{BUCKET}.>", "mem_storage": True, "num_replicas": 1,
              "inactive_threshold": 60 * 10**9}
    writer.write(f"SUB {inbox}.> 1\r\n".encode() + pub(
        f"$JS.API.CONSUMER.CREATE.{STREAM}.{name}", f"{inbox}.create",
        json.dumps({"stream_name": STREAM, "config": config, "action": "create"}).encode()))
    buf = bytearray()
    for _ in range(1000):  # until the create reply; nothing else can come before it
        buf += await asyncio.wait_for(reader.read(1 << 16), 10)
        msgs, pos = frames(buf, writer)
        del buf[:pos]
        if msgs:
            reply = json.loads(msgs[0][1].split(b"\r\n\r\n")[-1])
            if "error" in reply:
                raise RuntimeError(f"consumer create failed: {reply['error']}")
            break
    else:
        raise RuntimeError("no reply to the consumer create")
    print("ready", flush=True)
    lifetime = cfg["lifetime"]
    pull = pub(f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.{name}", f"{inbox}.pull",
               json.dumps({"batch": window, "expires": int(lifetime * 1e9)}).encode())
    count = requested = last = 0
    ctail = ltail = ptail = b""  # each search's overlap with the previous read
    reported, next_report = (-1, -1), 0.0
    deadline = time.monotonic() + lifetime
    while (now := time.monotonic()) < deadline:
        while requested - count < 2 * window:
            writer.write(pull)
            requested += window
        if now >= next_report and (count, last) != reported:
            print(f"{now:.6f} {count} {last}", flush=True)
            reported, next_report = (count, last), now + REPORT_S
        try:
            data = await asyncio.wait_for(reader.read(1 << 20), REPORT_S)
        except TimeoutError:
            continue
        if not data:
            raise RuntimeError("nats-server closed the connection")
        joined = ctail + data  # an ack subject split across reads counts once
        count += joined.count(ACK)
        ctail = joined[1 - len(ACK):]
        joined = ltail + data
        last = max(last, last_seq_in(joined))
        ltail = joined[-256:]
        joined = ptail + data
        if pings := joined.count(b"PING\r\n"):
            writer.write(b"PONG\r\n" * pings)
        ptail = joined[-5:]


def child_main(cfg: dict) -> int:
    if cfg["role"] == "publisher":
        print(json.dumps(asyncio.run(run_publisher(cfg))), flush=True)
    else:
        asyncio.run(run_raw(cfg))
    return 0


# ----------------------------------------------------------------------------- processes

class Child:
    """This script as a publisher or the raw consumer: a process of its own (PDEATHSIG),
    its stdout read by a thread (`ready`, then progress lines or a JSON summary)."""

    def __init__(self, name: str, cfg: dict, work: Path) -> None:
        self.name = name
        self.log_path = work / f"{name}.log"
        self.ready = threading.Event()
        self.done = threading.Event()  # a publisher's writes are all sent and acknowledged
        self.last_line = ""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), CHILD, json.dumps(cfg)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                         cwd=ROOT, preexec_fn=die_with_parent)
        self.thread = threading.Thread(target=self._read, name=name, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:  # ends when the process does
            line = raw.decode(errors="replace").strip()
            if line == "ready":
                self.ready.set()
            elif line == "done":
                self.done.set()
            elif line:
                self.last_line = line

    def wait_ready(self, deadline: float) -> None:
        while not self.ready.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready ({self.proc.poll()}): {self.log_tail()}")

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.flush()

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""

    def summary(self) -> dict:
        """A publisher's JSON summary, once it has exited."""
        self.thread.join(10)
        if self.proc.returncode != 0 or not self.last_line.startswith("{"):
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self.log_tail()}")
        return json.loads(self.last_line)

    def raw_progress(self) -> tuple[float, int, int]:
        """The raw consumer's latest (monotonic time, deliveries, last stream seq)."""
        t, count, seq = (self.last_line or "0 0 0").split()
        return float(t), int(count), int(seq)

    def stop(self) -> None:
        stop(self.proc, 10)
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass


@dataclass
class Sidecar:
    proc: subprocess.Popen
    socket: str
    log_path: Path

    def bucket(self) -> dict:
        with Client(self.socket, timeout=10) as c:
            return dict(c.info("buckets").get("buckets", {}).get(BUCKET, {}))

    def stop(self) -> None:
        stop(self.proc, 15)


def start_sidecar(url: str, work: Path, src: Path) -> Sidecar:
    """`kvcache serve` from source tree `src`, started in it (`python -m` puts the working
    directory before PYTHONPATH), as sync_bench.py starts it."""
    sock = str(work / "kvcache.sock")
    log_path = work / "kvcache.log"
    args = [sys.executable, "-m", "kvcache", "serve", "--nats", url, "--bucket", BUCKET,
            "--data-dir", str(work / "kvcache"), "--socket", sock, "--log-level", "info"]
    env = {**os.environ, "PYTHONPATH": str(src) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=src,
                                stdin=subprocess.DEVNULL, env=env, preexec_fn=die_with_parent)
    return Sidecar(proc, sock, log_path)


def wait_synced(sc: Sidecar, n: int, timeout: float) -> float:
    t0 = time.monotonic()
    state: dict = {}
    while time.monotonic() < t0 + timeout:
        if sc.proc.poll() is not None:
            raise RuntimeError(f"kvcache exited with {sc.proc.returncode}: {sc.log_path.read_text()[-2000:]}")
        try:
            state = sc.bucket()
        except (ConnectionFailed, OSError):
            state = {}
        if state.get("synced") == 1 and state.get("keys") == n:
            return time.monotonic() - t0
        time.sleep(0.1)
    raise TimeoutError(f"kvcache not synced with {n} keys after {timeout:.0f}s: {state}")


# ----------------------------------------------------------------------------- sampling

@dataclass
class Sample:
    t: float  # seconds since the publishers were told to go
    last: int  # the stream's last sequence
    applied: int  # the sidecar's applied_seq
    lag_ms: int  # the sidecar's lag_ms
    raw: int  # the raw consumer's last stream sequence
    raw_count: int
    cpu: dict[str, float]  # CPU seconds so far: sidecar, raw, nats-server, publishers
    info_ms: float  # the INFO round trip


class Sampler:
    def __init__(self, js: nats.js.JetStreamContext, sc: Sidecar, raw: Child, pids: dict[str, list[int]]) -> None:
        self.js, self.sc, self.raw, self.pids = js, sc, raw, pids
        self.cpu_seen: dict[int, float] = {}  # an exited process keeps its last reading
        self.t0 = time.monotonic()
        self.start_seq = 0  # the stream's last sequence at the first sample, before any write

    def cpu(self) -> dict[str, float]:
        out = {}
        for name, pids in self.pids.items():
            for pid in pids:
                if (c := cpu_seconds(pid)) is not None:
                    self.cpu_seen[pid] = c
            out[name] = sum(self.cpu_seen.get(pid, 0.0) for pid in pids)
        return out

    async def sample(self) -> Sample:
        t = time.monotonic()
        state = self.sc.bucket()
        info_ms = (time.monotonic() - t) * 1e3
        _, raw_count, raw = self.raw.raw_progress()  # its latest line: at most REPORT_S old
        last = (await self.js.stream_info(STREAM)).state.last_seq
        if not self.start_seq:
            self.start_seq = last
        raw = raw or self.start_seq  # nothing delivered yet: a consumer of new messages is caught up
        return Sample(time.monotonic() - self.t0, last, int(state["applied_seq"]), int(state["lag_ms"]),
                      raw, raw_count, self.cpu(), info_ms)


# ----------------------------------------------------------------------------- checking

@dataclass
class Check:
    written: int = 0  # keys with a known last write, checked
    differences: int = 0
    untouched: int = 0
    untouched_differences: int = 0
    unknown: int = 0  # keys with an unacknowledged write: not checked
    examples: list[str] = field(default_factory=list)
    remote_reads: int = 0  # gets_remote during the check: reads the replica did not answer
    stream_sample: int = 0
    stream_mismatches: int = 0
    replica_keys: int = 0


def mget_compare(c: Client, keys: Sequence[int], expect: dict[int, bytes], chk: Check) -> int:
    differences = 0
    for i in range(0, len(keys), MGET_BATCH):
        batch = keys[i:i + MGET_BATCH]
        for k, got in zip(batch, c.mget([key_name(k) for k in batch]), strict=True):
            if got != expect[k]:
                differences += 1
                if len(chk.examples) < 5:
                    chk.examples.append(f"{key_name(k)}: {got!r} != {expect[k]!r}")
    return differences


async def check_replica(js: nats.js.JetStreamContext, sc: Sidecar, expected: dict[int, tuple[int, int, int]],
                        unknown: set[int], n: int, size: int, untouched_sample: int, rng: random.Random) -> Check:
    """Every written key through the sidecar against its last acknowledged write, a sample of
    untouched keys against their loaded values, a sample of written keys against the stream."""
    chk = Check(unknown=len(unknown))
    written = sorted(k for k in expected if k not in unknown)
    want = {k: written_value(expected[k][1], expected[k][2], size) for k in written}
    untouched = [i for i in range(n) if i not in expected and i not in unknown]
    untouched = sorted(rng.sample(untouched, min(untouched_sample, len(untouched))))
    want.update((i, loaded_value(i, size)) for i in untouched)
    with Client(sc.socket, timeout=30) as c:
        before = int(c.info("stats")["stats"]["gets_remote"])
        chk.differences = mget_compare(c, written, want, chk)
        chk.untouched_differences = mget_compare(c, untouched, want, chk)
        chk.remote_reads = int(c.info("stats")["stats"]["gets_remote"]) - before
    chk.written, chk.untouched = len(written), len(untouched)
    chk.replica_keys = int(sc.bucket().get("keys", 0))
    for k in rng.sample(written, min(200, len(written))):
        msg = await js.get_last_msg(STREAM, f"$KV.{BUCKET}.{key_name(k)}", direct=False)
        chk.stream_sample += 1
        if msg.seq != expected[k][0] or msg.data != want[k]:
            chk.stream_mismatches += 1
    return chk


# ----------------------------------------------------------------------------- one round

@dataclass
class Round:
    index: int
    publishers: list[dict] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    window_end: float = 0.0  # seconds: until the first publisher stopped sending
    final_seq: int = 0
    caught_up: dict[str, float | None] = field(default_factory=dict)  # seconds after the last ack
    caught_cpu: float = 0.0  # the sidecar's CPU seconds, start to caught up
    check: Check = field(default_factory=Check)

    def window(self) -> list[Sample]:
        return [s for s in self.samples if s.t <= self.window_end + 0.05]

    def rate(self, attr: str) -> float:
        w = self.window()
        a, b = w[0], w[-1]
        return (getattr(b, attr) - getattr(a, attr)) / (b.t - a.t) if b.t > a.t else 0.0

    def cpu_share(self, name: str) -> float:
        """Percent of one core over the window."""
        w = self.window()
        return 100 * (w[-1].cpu[name] - w[0].cpu[name]) / (w[-1].t - w[0].t) if w[-1].t > w[0].t else 0.0

    def cpu_per_applied_us(self) -> float:
        w = self.window()
        applied = w[-1].applied - w[0].applied
        return 1e6 * (w[-1].cpu["sidecar"] - w[0].cpu["sidecar"]) / applied if applied else 0.0

    def per_second(self, attr: str) -> list[float]:
        w = self.window()
        return [(getattr(b, attr) - getattr(a, attr)) / (b.t - a.t) for a, b in itertools.pairwise(w)
                if b.t > a.t]

    def lags(self, which: str, first: bool) -> list[float]:
        """Lag over the first (or last) 10 s of the window: messages (sidecar, raw) or lag_ms."""
        w = self.window()[1:]
        part = [s for s in w if (s.t <= 10 if first else s.t >= self.window_end - 10)]
        if which == "ms":
            return [s.lag_ms for s in part]
        return [max(0, s.last - (s.applied if which == "sidecar" else s.raw)) for s in part]

    def lag_slope(self) -> float:
        """Least-squares slope of the sidecar's lag (messages) over the window, per second."""
        w = self.window()[1:]
        if len(w) < 2:
            return 0.0
        ts, ys = [s.t for s in w], [max(0, s.last - s.applied) for s in w]
        return statistics.linear_regression(ts, ys).slope


def start_children(url: str, r: int, args: argparse.Namespace, work: Path, lifetime: float,
                   started: list[Child]) -> tuple[Child, list[Child]]:
    """The raw consumer and the publishers of round r; each appended to `started` as soon as
    it exists, so that the caller stops whatever was started."""
    raw = Child(f"raw-round{r}", {"role": "raw", "url": url, "window": args.window, "lifetime": lifetime}, work)
    started.append(raw)
    pubs: list[Child] = []
    per = args.max_writes // args.publishers
    for i in range(args.publishers):
        p = r * args.publishers + i  # unique across rounds: each write's value names its writer
        cfg = {"role": "publisher", "url": url, "publisher": p, "keys": args.keys, "value_size": args.value_size,
               "seconds": args.seconds, "max_writes": per, "inflight": args.inflight,
               "rate": args.rate / args.publishers, "ack_timeout": args.ack_timeout,
               "seed": args.seed * 1000 + p, "out": str(work / f"writes-p{p}.bin")}
        pubs.append(Child(f"publisher-{p}", cfg, work))
        started.append(pubs[-1])
    return raw, pubs


def progress_line(a: Sample, b: Sample) -> str:
    dt = b.t - a.t or 1.0
    return (f"t={b.t:5.1f}s  stored {(b.last - a.last) / dt:9,.0f}/s  raw {(b.raw - a.raw) / dt:9,.0f}/s  "
            f"sidecar {(b.applied - a.applied) / dt:9,.0f}/s  lag {max(0, b.last - b.applied):8,} msgs "
            f"{b.lag_ms:5} ms  (raw {max(0, b.last - b.raw):7,})  INFO {b.info_ms:.1f} ms")


async def catch_up(js: nats.js.JetStreamContext, sc: Sidecar, raw: Child, out: Round, timeout: float) -> None:
    """Until the sidecar and the raw consumer reach the stream's last sequence (bounded); the
    publishers are done, so that is final. Times are from now: after the last acknowledgement."""
    out.final_seq = (await js.stream_info(STREAM)).state.last_seq
    t0 = time.monotonic()
    out.caught_up = {"sidecar": None, "raw": None}
    while time.monotonic() < t0 + timeout and None in out.caught_up.values():
        now = time.monotonic() - t0
        if out.caught_up["raw"] is None and raw.raw_progress()[2] >= out.final_seq:
            out.caught_up["raw"] = now
        if out.caught_up["sidecar"] is None and int(sc.bucket()["applied_seq"]) >= out.final_seq:
            out.caught_up["sidecar"] = now
            out.caught_cpu = cpu_seconds(sc.proc.pid) or 0.0
        await asyncio.sleep(0.05)


async def run_round(r: int, js: nats.js.JetStreamContext, server: NatsServer, sc: Sidecar,
                    args: argparse.Namespace, work: Path) -> Round:
    out = Round(r)
    lifetime = args.seconds + args.ack_timeout + args.catchup_timeout + 120
    children: list[Child] = []
    try:
        raw, pubs = start_children(server.url, r, args, work, lifetime, children)
        deadline = time.monotonic() + 60
        for child in (raw, *pubs):
            child.wait_ready(deadline)
        sampler = Sampler(js, sc, raw, {"sidecar": [sc.proc.pid], "raw": [raw.proc.pid],
                                        "nats-server": [server.pid or 0], "publishers": [p.proc.pid for p in pubs]})
        out.samples.append(await sampler.sample())
        sampler.t0 = time.monotonic()
        out.samples[0].t = 0.0
        for p in pubs:
            p.go()
        bound = sampler.t0 + args.seconds + args.ack_timeout + 30
        tick = sampler.t0
        while not all(p.done.is_set() for p in pubs):
            now = time.monotonic()
            if now > bound:
                raise TimeoutError("the publishers did not finish in time")
            if failed := [c for c in (raw, *pubs) if c.proc.poll() is not None and not c.done.is_set()]:
                raise RuntimeError(f"{failed[0].name} exited with {failed[0].proc.returncode}: {failed[0].log_tail()}")
            if now < tick + 1:
                await asyncio.sleep(min(0.05, tick + 1 - now))
                continue
            tick += 1
            out.samples.append(await sampler.sample())
            print(progress_line(out.samples[-2], out.samples[-1]), file=sys.stderr, flush=True)
        await catch_up(js, sc, raw, out, args.catchup_timeout)
        out.samples.append(await sampler.sample())  # after catching up: the raw count's final value
        for p in pubs:
            p.proc.wait(60)
        out.publishers = [p.summary() for p in pubs]
        out.window_end = min(p["sending_s"] for p in out.publishers)
    finally:
        for child in children:
            child.stop()
    return out


def merge_writes(rnd: Round, work: Path, expected: dict[int, tuple[int, int, int]], unknown: set[int]) -> None:
    """Fold a round's publishers' last writes into `expected` (key -> seq, publisher, j)."""
    for i, summary in enumerate(rnd.publishers):
        p = rnd.index * len(rnd.publishers) + i
        triples = array.array("q")
        triples.frombytes((work / f"writes-p{p}.bin").read_bytes())
        for x in range(0, len(triples), 3):
            k, seq, j = triples[x], triples[x + 1], triples[x + 2]
            if k not in expected or seq > expected[k][0]:
                expected[k] = (seq, p, j)
        unknown.update(summary["unknown_keys"])


# ----------------------------------------------------------------------------- report

def p50_max(xs: list[float], fmt: str = ",.0f") -> str:
    return f"{statistics.median(xs):{fmt}} / {max(xs):{fmt}}" if xs else "-"


def fmt_s(x: float | None) -> str:
    return f"{x:.2f}" if x is not None else "not caught up"


def report(rounds: list[Round], args: argparse.Namespace, header: str) -> str:
    lines = [header, "",
             "| round | writes acked | publishers, writes/s | raw consumer, msgs/s | sidecar applied, msgs/s | "
             "sidecar / raw | per-second median: stored / raw / sidecar | sidecar CPU µs/msg | "
             "CPU % of a core: sidecar / raw / nats-server / publishers |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rounds:
        raw, side = r.rate("raw"), r.rate("applied")
        medians = " / ".join(f"{statistics.median(r.per_second(a)):,.0f}" if r.per_second(a) else "-"
                             for a in ("last", "raw", "applied"))
        shares = " / ".join(f"{r.cpu_share(n):.0f}" for n in ("sidecar", "raw", "nats-server", "publishers"))
        lines.append(f"| {r.index + 1} | {sum(p['acked'] for p in r.publishers):,} | {r.rate('last'):,.0f} | "
                     f"{raw:,.0f} | {side:,.0f} | {side / raw if raw else 0:.2f}x | {medians} | "
                     f"{r.cpu_per_applied_us():.2f} | {shares} |")
    lines += ["", "lag, median / max of the per-second samples (messages: the stream's last sequence minus "
              "the reader's)", "",
              "| round | sidecar msgs, first 10 s | last 10 s | slope, msgs/s | sidecar lag_ms, first 10 s | "
              "last 10 s | raw msgs, first 10 s | last 10 s | caught up, s after the last ack: sidecar / raw |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rounds:
        lines.append(f"| {r.index + 1} | {p50_max(r.lags('sidecar', True))} | {p50_max(r.lags('sidecar', False))} | "
                     f"{r.lag_slope():+,.1f} | {p50_max(r.lags('ms', True))} | {p50_max(r.lags('ms', False))} | "
                     f"{p50_max(r.lags('raw', True))} | {p50_max(r.lags('raw', False))} | "
                     f"{fmt_s(r.caught_up.get('sidecar'))} / {fmt_s(r.caught_up.get('raw'))} |")
    lines += ["", "replica against the stream, after catching up", "",
              "| round | written keys checked | differences | untouched keys checked | differences | "
              "keys with an unacknowledged write (not checked) | reads not from the replica | "
              "expectation against the stream (STREAM.MSG.GET) |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rounds:
        c = r.check
        lines.append(f"| {r.index + 1} | {c.written:,} | {c.differences} | {c.untouched:,} | "
                     f"{c.untouched_differences} | {c.unknown} | {c.remote_reads} | "
                     f"{c.stream_sample - c.stream_mismatches}/{c.stream_sample} agree |")
    lines.append("")
    for r in rounds:
        w = r.window()
        raw_expected = r.final_seq - r.samples[0].last
        sent = sum(p["sent"] for p in r.publishers)
        refused = sum(p["refused"] for p in r.publishers)
        after = r.samples[-1]
        whole = ""
        if r.caught_up.get("sidecar") is not None and after.applied > w[0].applied:
            per_msg = 1e6 * (r.caught_cpu - w[0].cpu["sidecar"]) / (r.final_seq - w[0].applied)
            whole = f"; sidecar CPU from the start to caught up {per_msg:.2f} µs/msg"
        lines.append(f"- round {r.index + 1}: window {w[-1].t:.1f} s ({len(w) - 1} samples), {sent:,} sent, "
                     f"{refused} refused; stream {r.samples[0].last:,} -> {r.final_seq:,}; raw consumer "
                     f"counted {after.raw_count:,} deliveries (stream moved {raw_expected:,}: history 1 drops a "
                     f"write overwritten before its delivery); replica "
                     f"{r.check.replica_keys:,} keys{whole}; INFO round trip max {max(s.info_ms for s in w):.1f} ms")
        lines += [f"  - difference: {e}" for e in r.check.examples]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main

async def run(args: argparse.Namespace, work: Path) -> str:
    server = NatsServer(work / "js", server_name="live", max_file_store="32GB")
    sc: Sidecar | None = None
    server.start()
    try:
        nc = await nats.connect(server.url, connect_timeout=5, allow_reconnect=False)
        try:
            js = nc.jetstream(timeout=30)
            load_s = await load(js, args.keys, args.value_size, args.load_chunk,
                                time.monotonic() + args.load_timeout)
            print(f"loaded {args.keys:,} keys in {load_s:.1f}s", file=sys.stderr, flush=True)
            sc = start_sidecar(server.url, work, args.other_src or ROOT)
            sync_s = await asyncio.to_thread(wait_synced, sc, args.keys, args.sync_timeout)
            print(f"sidecar synced in {sync_s:.1f}s", file=sys.stderr, flush=True)
            rounds: list[Round] = []
            expected: dict[int, tuple[int, int, int]] = {}
            unknown: set[int] = set()
            rng = random.Random(args.seed)
            for r in range(args.repeat):
                rnd = await run_round(r, js, server, sc, args, work)
                merge_writes(rnd, work, expected, unknown)
                rnd.check = await check_replica(js, sc, expected, unknown, args.keys, args.value_size,
                                                args.untouched, rng)
                rounds.append(rnd)
        finally:
            await nc.close()
        src = f"; sidecar from {args.other_src}" if args.other_src else ""
        header = (f"live updates: bucket of {args.keys:,} keys ({args.value_size} B values), "
                  f"{args.publishers} publishers for {args.seconds:.0f} s"
                  f"{f' at {args.rate:,.0f} writes/s' if args.rate else ' as fast as they can'} "
                  f"({args.inflight} unacknowledged each); loaded in {load_s:.1f} s, synced in {sync_s:.1f} s"
                  f"{src}; {versions()}")
        return report(rounds, args, header)
    finally:
        if sc is not None:
            sc.stop()
        server.stop()


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == CHILD:
        return child_main(json.loads(sys.argv[2]))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=int, default=1_000_000)
    p.add_argument("--value-size", type=int, default=100)
    p.add_argument("--publishers", type=int, default=4, help="publisher processes")
    p.add_argument("--seconds", type=float, default=60, help="how long the publishers write")
    p.add_argument("--max-writes", type=int, default=20_000_000, help="writes in all (split between publishers)")
    p.add_argument("--rate", type=float, default=0, help="writes/s in all; 0: as fast as they can")
    p.add_argument("--inflight", type=int, default=4096, help="unacknowledged writes per publisher")
    p.add_argument("--window", type=int, default=16384, help="raw consumer: messages per pull request")
    p.add_argument("--repeat", type=int, default=1, help="rounds on the same server and sidecar")
    p.add_argument("--untouched", type=int, default=10_000, help="untouched keys to check")
    p.add_argument("--load-chunk", type=int, default=5000, help="publishes in flight while loading")
    p.add_argument("--load-timeout", type=float, default=1800)
    p.add_argument("--sync-timeout", type=float, default=600)
    p.add_argument("--ack-timeout", type=float, default=30, help="publishers: wait for the last acks (s)")
    p.add_argument("--catchup-timeout", type=float, default=120, help="readers: reach the last sequence (s)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--other-src", type=Path, default=None, metavar="DIR",
                   help="run the sidecar from this source tree (its extensions built) instead of this one")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, writes)")
    args = p.parse_args()
    if args.value_size < 32 or args.keys < 1 or args.publishers < 1 or args.keys >= 10**8:
        p.error("--value-size at least 32, --keys from 1 to 10^8 - 1, --publishers at least 1")
    exit_on_sigterm()
    with work_dir("kvcache-live-", lambda: args.keep) as work:
        print(asyncio.run(run(args, work)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
