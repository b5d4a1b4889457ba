"""A fleet on one cluster: what N sidecars cost a 3-node JetStream cluster.

    python bench/fleet_bench.py --sizes 10,30 --buckets 2 --keys 2000 --rate 50 --window 30
    python bench/fleet_bench.py --sizes 2,3 --window 5 --skip-storm --skip-rolling   # a quick look
    python bench/fleet_bench.py --sizes 10,30 --republish    # buckets whose streams RePublish
    python bench/fleet_bench.py --sizes 10,30 --relay        # no RePublish: the fleet's relay

A 3-node JetStream cluster on 127.0.0.1 (tests/support/topology.py) holds `--buckets` R3
buckets of `--keys` keys (100-byte values). For each fleet size N of `--sizes`, in the same run:

  * windows of `--window` seconds at steady state (set-up excluded), each counting the
    JetStream API requests by kind (a nats-py subscriber on `$JS.API.>`, with every server's
    URL so it survives restarts; its own and the control connection's requests are left out)
    and the three nats-servers' CPU (/proc/<pid>/stat utime+stime): no sidecars (the
    baseline), idle and with a writer at `--rate` writes/s across the buckets; N plain nats-py
    watchers (one connection per "host", `kv.watchall()` per bucket, in a child process) with
    the writer; then N sidecars (`kvcache serve`, each its own data directory and socket,
    `--max-stale-ms 2000 --heartbeat-ms 1000`, started a few at a time), idle and with the
    writer. Consumers per stream from STREAM.INFO (state.consumer_count), sampled from outside
    before, between and after the fleet's windows; their sum over the buckets' streams is the
    consumers the fleet holds on the cluster at steady state (a sidecar that keeps a consumer
    per bucket: N x buckets; one that follows the stream's RePublish: none of its own).
  * with --republish, the buckets are made with RePublish (`$KV.<bucket>.>` onto
    `kvrp.<bucket>.>`, what an operator sets on the bucket), and the plain watchers are plain
    core subscribers to that subject (one connection per host, one subscription per bucket):
    the least a host can cost the servers to get every write of a bucket.
  * a storm (unless --skip-storm): every sidecar SIGKILLed and all started again at once,
    the writer on: the time until every sidecar reports synced=1 for every bucket, the
    JetStream API requests of the first 70 s, the warnings in the sidecars' logs (those
    naming a failed JetStream API request counted apart), consumers per stream 0, 12 and
    70 s after the restart (the killed sidecars' consumers stay until their inactive
    threshold, 60 s here).
  * a rolling restart of the three servers (unless --skip-rolling), the writer on: each
    stopped (SIGTERM) and started again, then the cluster ready and every stream current,
    then 5 s more; the CONSUMER.CREATE requests of each sidecar (told apart by its
    connection's reply prefix) per bucket in each step, counted by a subscriber of the step's
    own on a server that stays up through it (the run's subscriber is blind while it
    reconnects, just when the sidecars recreate their consumers), and from them the feed
    consumers placed (pulled from) apart from placement retries and reconcile passes.

It prints the cost per sidecar (API requests/s per sidecar per bucket; server CPU per sidecar
above the baseline, idle and with writes, beside a plain watcher's; the consumers on the
cluster), the slope between the sizes and a projection to 10,000 hosts x 20 buckets. Every
process it starts is stopped by its own PID on every exit path; every loop is bounded in count
and time.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import multiprocessing as mp
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import nats
import nats.errors
from nats.js.api import RePublish
from support.sidecar_proc import SidecarProcess, check_src
from support.topology import Cluster, replicated_kv, settled, start_cluster, wait_stream_current

from kvcache.app.client import Client
from kvcache.natsio.nats_server import die_with_parent

CTL_INBOX = "_INBOX_FBCTL"        # the bench's own requests (control, writer): not counted
WATCH_INBOX = "_INBOX_FBWATCH"    # the plain watchers' requests
VALUE_SIZE = 100
HOSTS, HOST_BUCKETS = 10_000, 20  # the projection
SHARED_FROM = 16                  # kvcache.feed.statepoll.SHARED_FROM (not imported: --sidecar-src)
SETTLE_S = 5.0                    # after a fleet is up or the writer starts, before a window
QUIET_S = 5.0                     # after each rolling-restart step (3 heartbeats + backoff)
REPUBLISH_DEST = "kvrp.{bucket}.>"   # --republish: where a bucket's stream RePublishes its messages
STORM_SAMPLES = (0.0, 12.0, 70.0)
STORM_TIMEOUT_S = 300.0
STOPPED_KEY = "right after the fleet's SIGTERM"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def describe_src(src: Path | None) -> str:
    """Which kvcache the sidecars run: a source tree, or this checkout's commit (and whether
    its kvcache/ has changes not committed)."""
    tree = src or ROOT
    try:
        head = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--", "kvcache"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        head, dirty = "", ""
    where = f"source tree {src}" if src else f"this checkout ({ROOT})"
    if head:
        where += f", git {head}" + (f" with {len(dirty.splitlines())} uncommitted change(s) under kvcache/"
                                     if dirty else "")
    return where


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def cpu_s(pid: int | None) -> float:
    """utime + stime of a process, seconds (0 when it is gone)."""
    if not pid:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


# ------------------------------------------------------------------ an asyncio loop in a thread

class Bg:
    """The bench's asyncio side (API counter, control connection, writer) on a loop of its own
    thread, so the main thread can block on processes and sockets."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fleet-bg", daemon=True)

    def start(self) -> Bg:
        self.thread.start()
        return self

    def run(self, coro, timeout: float = 120.0):
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except BaseException:
            fut.cancel()
            raise

    def stop(self) -> None:
        async def cancel_all() -> None:
            me = asyncio.current_task()
            rest = [t for t in asyncio.all_tasks() if t is not me]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)
        try:
            self.run(cancel_all(), 10)
        except Exception:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


# ------------------------------------------------------------------ the JetStream API counter

THREE_TOKEN_VERBS = {"CONSUMER.MSG.NEXT", "CONSUMER.DURABLE.CREATE", "STREAM.MSG.GET", "STREAM.MSG.DELETE",
                     "CONSUMER.LEADER.STEPDOWN", "STREAM.LEADER.STEPDOWN", "META.LEADER.STEPDOWN",
                     "STREAM.PEER.REMOVE", "META.SERVER.REMOVE"}


def api_verb(subject: str) -> str:
    """`$JS.API.CONSUMER.CREATE.KV_b.name` -> CONSUMER.CREATE; `$JS.API.INFO` -> INFO."""
    rest = subject.split(".")[2:]
    if ".".join(rest[:3]) in THREE_TOKEN_VERBS:
        return ".".join(rest[:3])
    if len(rest) > 1 and rest[0] in ("STREAM", "CONSUMER", "DIRECT", "ACCOUNT", "META", "SERVER"):
        return ".".join(rest[:2])
    return rest[0] if rest else "?"


@dataclass(eq=False)  # each request its own (hashed by identity: _pulled's set)
class ConsumerEvent:
    t: float        # time.monotonic()
    verb: str       # CONSUMER.CREATE or CONSUMER.DELETE
    stream: str
    name: str
    conn: str       # the requester's reply prefix (one per nats-py connection: its request mux)
    headers_only: bool = False  # a CREATE of a headers-only consumer (the sidecar's reconcile pass)


class ApiCounter:
    """Counts the requests published on `$JS.API.>` by verb. A subscriber in the account sees
    every request, whichever server its client is on; its own connection knows every server,
    and the windows it was disconnected are kept (`missed`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: collections.Counter[str] = collections.Counter()
        self.events: list[ConsumerEvent] = []
        # CONSUMER.MSG.NEXT requests, (stream, name) -> when: a consumer pulled from was in use
        self.pulls: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
        self.missed: list[list[float | None]] = []  # [disconnected at, reconnected at or None]
        self.errors: list[str] = []
        self.nc = None

    async def start(self, urls: list[str]) -> None:
        async def disconnected() -> None:
            with self.lock:
                self.missed.append([time.monotonic(), None])

        async def reconnected() -> None:
            with self.lock:
                if self.missed and self.missed[-1][1] is None:
                    self.missed[-1][1] = time.monotonic()

        async def error(e: Exception) -> None:
            with self.lock:
                self.errors.append(f"{type(e).__name__}: {e}")

        self.nc = await nats.connect(servers=urls, name="fleet-bench-api", inbox_prefix=CTL_INBOX,
                                     allow_reconnect=True, max_reconnect_attempts=-1,
                                     reconnect_time_wait=0.1, connect_timeout=5,
                                     disconnected_cb=disconnected, reconnected_cb=reconnected,
                                     error_cb=error)
        await self.nc.subscribe("$JS.API.>", cb=self._on, pending_msgs_limit=1_000_000,
                                pending_bytes_limit=512 * 1024 * 1024)
        await self.nc.flush()

    async def _on(self, msg) -> None:
        reply = msg.reply or ""
        if reply.startswith(CTL_INBOX):
            return
        verb = api_verb(msg.subject)
        with self.lock:
            self.counts[verb] += 1
            if verb == "CONSUMER.MSG.NEXT":
                parts = msg.subject.split(".")
                self.pulls[(parts[-2], parts[-1])].append(time.monotonic())
            elif verb in ("CONSUMER.CREATE", "CONSUMER.DELETE"):
                parts = msg.subject.split(".")
                r = reply.split(".")
                ho = False
                if verb == "CONSUMER.CREATE":
                    try:
                        ho = bool(json.loads(msg.data)["config"].get("headers_only"))
                    except (ValueError, KeyError, TypeError, AttributeError):
                        pass
                self.events.append(ConsumerEvent(time.monotonic(), verb, parts[4] if len(parts) > 4 else "?",
                                                 parts[5] if len(parts) > 5 else "",
                                                 ".".join(r[:2]), ho))

    def _pulled(self, events: list[ConsumerEvent]) -> set[ConsumerEvent]:
        """The CREATEs whose consumer was pulled from before the next CREATE or DELETE of its
        name on its stream: the ones placed and used. A sidecar's consumers keep one name
        (kvcache.feed.names) across placement tries and restarts, so a name alone no longer
        tells a kept consumer from a misplaced try."""
        marks: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
        for e in events:
            marks[(e.stream, e.name)].append(e.t)
        used = set()
        for e in events:
            if e.verb != "CONSUMER.CREATE":
                continue
            later = [t for t in marks[(e.stream, e.name)] if t > e.t]
            until = min(later, default=float("inf"))
            if any(e.t <= t < until for t in self.pulls.get((e.stream, e.name), ())):
                used.add(e)
        return used

    def snapshot(self) -> collections.Counter[str]:
        with self.lock:
            return collections.Counter(self.counts)

    def tally(self, t0: float, t1: float) -> Creates:
        with self.lock:
            return tally([e for e in self.events if t0 <= e.t < t1], self._pulled(self.events))

    def events_between(self, t0: float, t1: float) -> list[ConsumerEvent]:
        with self.lock:
            return [e for e in self.events if t0 <= e.t < t1]

    def dump(self, path: Path, t_zero: float) -> None:
        """Every CONSUMER.CREATE/DELETE seen, one a line (seconds since t_zero)."""
        with self.lock:
            rows, pulled = list(self.events), self._pulled(self.events)
        with open(path, "w") as f:
            f.write("t_s\tverb\tstream\tname\tconn\theaders_only\tpulled_from\n")
            for e in rows:
                f.write(f"{e.t - t_zero:.3f}\t{e.verb}\t{e.stream}\t{e.name}\t{e.conn}\t{int(e.headers_only)}\t"
                        f"{int(e in pulled)}\n")

    def missed_between(self, t0: float, t1: float) -> float:
        """Seconds of [t0, t1) the subscriber was disconnected."""
        now = time.monotonic()
        with self.lock:
            spans = [(a, b if b is not None else now) for a, b in self.missed]
        return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in spans)

    async def close(self) -> None:
        if self.nc is not None:
            try:
                await self.nc.close()
            except Exception:
                pass


# ------------------------------------------------------------------ control connection and writer

class Control:
    """The bench's own connection (not counted): buckets, stream state, and the writer."""

    def __init__(self, urls: list[str], buckets: list[str], keys: int, republish: bool = False,
                 direct: bool = False) -> None:
        self.urls, self.buckets, self.keys = urls, buckets, keys
        self.republish = republish
        self.direct = direct
        self.nc = None
        self.js = None
        self.kvs: dict = {}
        self.writer_task: asyncio.Task | None = None
        self.writer_stop: asyncio.Event | None = None
        self.w = collections.Counter()

    async def connect(self) -> None:
        self.nc = await nats.connect(servers=self.urls, name="fleet-bench-ctl", inbox_prefix=CTL_INBOX,
                                     allow_reconnect=True, max_reconnect_attempts=-1, reconnect_time_wait=0.1,
                                     connect_timeout=5, error_cb=self._quiet)
        self.js = self.nc.jetstream(timeout=5)

    async def _quiet(self, e: Exception) -> None:
        pass

    async def make_buckets(self) -> None:
        pad = b"x" * VALUE_SIZE
        for b in self.buckets:
            extra = ({"republish": RePublish(src=f"$KV.{b}.>", dest=REPUBLISH_DEST.format(bucket=b))}
                     if self.republish else {})
            if self.direct:
                extra["direct"] = True
            kv = await replicated_kv(self.js, bucket=b, history=1, replicas=3, **extra)
            self.kvs[b] = kv
            for i in range(0, self.keys, 250):
                await asyncio.gather(*(settled(lambda k=k, kv=kv: kv.put(f"k{k}", pad), 30)
                                       for k in range(i, min(i + 250, self.keys))))

    async def streams_current(self, timeout: float = 120.0) -> None:
        for b in self.buckets:
            await wait_stream_current(self.js, f"KV_{b}", timeout)

    async def consumer_counts(self) -> dict[str, int | None]:
        out: dict[str, int | None] = {}
        for b in self.buckets:
            try:
                info = await settled(lambda b=b: self.js.stream_info(f"KV_{b}"), 10)
                out[b] = info.state.consumer_count
            except Exception:
                out[b] = None
        return out

    async def republish_of(self) -> dict[str, dict | None]:
        """Each bucket's stream's RePublish as the servers hold it (None: not set): the run
        reports what it measured, not what it asked for."""
        out: dict[str, dict | None] = {}
        for b in self.buckets:
            info = await settled(lambda b=b: self.js.stream_info(f"KV_{b}"), 10)
            rp = info.config.republish
            out[b] = {"src": rp.src, "dest": rp.dest, "headers_only": bool(rp.headers_only)} if rp else None
        return out

    async def delete_consumers(self, deliver_prefix: str) -> int:
        """Delete the push consumers delivering to `deliver_prefix`...: nats-py's ordered
        consumers (kv.watchall) are left behind when their connection closes, with an inactive
        threshold of 5 minutes."""
        n = 0
        for b in self.buckets:
            for ci in await settled(lambda b=b: self.js.consumers_info(f"KV_{b}"), 30):
                if (ci.config.deliver_subject or "").startswith(deliver_prefix):
                    try:
                        await self.js.delete_consumer(f"KV_{b}", ci.name)
                        n += 1
                    except Exception:
                        pass
        return n

    async def leaders(self) -> dict[str, str]:
        out = {}
        for b in self.buckets:
            try:
                info = await settled(lambda b=b: self.js.stream_info(f"KV_{b}"), 10)
                out[b] = (info.cluster.leader if info.cluster else "") or "?"
            except Exception:
                out[b] = "?"
        return out

    async def start_writer(self, rate: float, max_s: float) -> None:
        await self.stop_writer()
        self.writer_stop = asyncio.Event()
        self.writer_task = asyncio.create_task(self._write(rate, max_s))

    async def stop_writer(self) -> collections.Counter:
        if self.writer_task is not None:
            self.writer_stop.set()
            try:
                await asyncio.wait_for(self.writer_task, 10)
            except Exception:
                self.writer_task.cancel()
            self.writer_task = None
        return collections.Counter(self.w)

    async def _write(self, rate: float, max_s: float) -> None:
        """`rate` acknowledged puts a second, round robin over the buckets, random keys; each
        put bounded to 2 s, at most 500 in flight; ends at stop or after max_s."""
        inflight: set[asyncio.Task] = set()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        i = 0
        rnd = random.Random(36)

        async def put(kv, key: str, value: bytes) -> None:
            try:
                await asyncio.wait_for(kv.put(key, value), 2.0)
                self.w["acked"] += 1
            except Exception as e:
                self.w["errors"] += 1
                self.w[f"error {type(e).__name__}"] += 1

        while not self.writer_stop.is_set() and loop.time() - t0 < max_s:
            due = t0 + i / rate
            if due > loop.time():
                try:
                    await asyncio.wait_for(self.writer_stop.wait(), due - loop.time())
                    break
                except TimeoutError:
                    pass
            b = self.buckets[i % len(self.buckets)]
            i += 1
            if len(inflight) >= 500:
                self.w["skipped"] += 1
                continue
            self.w["sent"] += 1
            value = f"{i:012d}".encode().ljust(VALUE_SIZE, b"v")
            t = asyncio.create_task(put(self.kvs[b], f"k{rnd.randrange(self.keys)}", value))
            inflight.add(t)
            t.add_done_callback(inflight.discard)
        if inflight:
            await asyncio.wait(inflight, timeout=3)

    async def close(self) -> None:
        await self.stop_writer()
        if self.nc is not None:
            try:
                await self.nc.close()
            except Exception:
                pass


# ------------------------------------------------------------------ plain watchers (child process)

def _watchers_main(urls: list[str], buckets: list[str], n: int, max_s: float, conn,
                   core: list[str] | None = None) -> None:
    try:
        asyncio.run(_watchers(urls, buckets, n, max_s, conn, core))
    except BaseException as e:  # the parent reads it instead of "ready"
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except Exception:
            pass


async def _watchers(urls: list[str], buckets: list[str], n: int, max_s: float, conn,
                    core: list[str] | None = None) -> None:
    """n connections (hosts), each watching every bucket with `kv.watchall()`, or with `core`
    (one subject per bucket) subscribing to each of those core subjects instead; "ready" once
    every watch has delivered its initial values (every subscription is in place); ends on
    "stop", a gone parent or max_s."""
    parent = os.getppid()
    t0 = time.monotonic()
    ncs, tasks = [], []
    initial = [0]
    updates = [0]

    async def drain(w) -> None:
        done = False
        while True:
            try:
                e = await w.updates(timeout=1.0)
            except nats.errors.TimeoutError:
                continue
            if e is None:
                if not done:
                    done = True
                    initial[0] += 1
                continue
            if done:
                updates[0] += 1

    async def quiet(e: Exception) -> None:
        pass

    async def count(msg) -> None:
        updates[0] += 1

    try:
        for i in range(n):
            nc = await nats.connect(servers=urls, name=f"fleet-watcher-{i}", inbox_prefix=WATCH_INBOX,
                                    allow_reconnect=True, max_reconnect_attempts=-1, error_cb=quiet)
            ncs.append(nc)
            if core is not None:
                for subject in core:
                    await nc.subscribe(subject, cb=count)
                await nc.flush()
                initial[0] += len(buckets)
                continue
            js = nc.jetstream(timeout=10)
            for b in buckets:
                kv = await js.key_value(b)
                tasks.append(asyncio.create_task(drain(await kv.watchall())))
        while initial[0] < n * len(buckets):
            if time.monotonic() - t0 > min(max_s, 300):
                raise TimeoutError(f"{initial[0]} of {n * len(buckets)} watches delivered their initial values")
            await asyncio.sleep(0.1)
        conn.send(("ready", initial[0]))
        while time.monotonic() - t0 < max_s and os.getppid() == parent:
            if await asyncio.to_thread(conn.poll, 0.5):
                conn.recv()
                break
        conn.send(("done", updates[0]))
    finally:
        for t in tasks:
            t.cancel()
        for nc in ncs:
            try:
                await asyncio.wait_for(nc.close(), 5)
            except Exception:
                pass


class Watchers:
    """The plain-watcher fleet in a child process (its CPU apart from the bench's)."""

    def __init__(self, urls: list[str], buckets: list[str], n: int, max_s: float,
                 core: list[str] | None = None) -> None:
        self.conn, child = mp.Pipe()
        self.proc = mp.get_context("spawn").Process(target=_watchers_main,
                                                    args=(urls, buckets, n, max_s, child, core),
                                                    daemon=True, name="fleet-watchers")
        self.proc.start()

    def wait_ready(self, timeout: float) -> None:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"plain watchers not ready in {timeout:g}s")
        what, detail = self.conn.recv()
        if what != "ready":
            raise RuntimeError(f"plain watchers: {detail}")

    def stop(self) -> int | None:
        got = None
        try:
            if self.proc.is_alive():
                self.conn.send("stop")
                if self.conn.poll(15):
                    _, got = self.conn.recv()
        except (OSError, EOFError):
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        return got


# ------------------------------------------------------------------ sidecars

class FleetSidecar(SidecarProcess):
    """SidecarProcess with a launch that does not wait (a storm starts them all at once)."""

    def __init__(self, data_dir: Path, socket: Path, urls: list[str], buckets: list[str],
                 src: Path | None, settings: str = "--max-stale-ms 2000 --heartbeat-ms 1000") -> None:
        super().__init__(data_dir, ",".join(urls), buckets, socket=socket, extra=settings.split(),
                         env={"PYTHONPATH": str(src)} if src else None)
        if src:  # kvcache from that source tree: -P keeps the working directory off sys.path
            self.args[1:1] = ["-P"]

    def launch(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self.env, preexec_fn=die_with_parent)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc and self.proc.poll() is None else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def synced(self, n_buckets: int) -> bool:
        """INFO buckets: every bucket synced=1 (False while it does not answer)."""
        try:
            with Client(self.socket, timeout=2) as c:
                rows = c.info("buckets").get("buckets", {})
        except Exception:
            return False
        return len(rows) == n_buckets and all(r.get("synced") == 1 for r in rows.values())

    def log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def log_since(self, offset: int) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""


API_FAILURE = re.compile(r"JetStream API|\$JS\.API|\(STREAM\.LIST\) failed|stream state check failed|"
                         r"err_code|no JetStream responders|no consumer on the stream leader")
LEVEL = re.compile(r"^\S+ \S+ (WARNING|ERROR|CRITICAL) (\S+): (.*)$")


def normalize(msg: str) -> str:
    msg = re.sub(r"kvcache_[0-9a-f]{16}", "kvcache_<id>", msg)
    msg = re.sub(r"_INBOX\.\S+", "_INBOX.<id>", msg)
    msg = re.sub(r"\b\d+(\.\d+)?\b", "N", msg)
    return msg[:200]


@dataclass
class LogFindings:
    lines: int = 0                  # WARNING and above
    api_failures: int = 0           # of which naming a failed JetStream API request
    tracebacks: int = 0
    kinds: collections.Counter = field(default_factory=collections.Counter)

    def add(self, text: str) -> None:
        self.tracebacks += text.count("Traceback (most recent call last)")
        for line in text.splitlines():
            m = LEVEL.match(line)
            if not m:
                continue
            self.lines += 1
            if API_FAILURE.search(m.group(3)):
                self.api_failures += 1
            self.kinds[f"{m.group(1)} {normalize(m.group(3))}"] += 1

    def show(self, top: int = 12) -> str:
        out = [f"    {self.lines} warning/error lines, {self.api_failures} naming a failed JetStream API request, "
               f"{self.tracebacks} tracebacks"]
        for k, n in self.kinds.most_common(top):
            out.append(f"    {n:6d}  {k}")
        if len(self.kinds) > top:
            out.append(f"    ... {len(self.kinds) - top} more kinds")
        return "\n".join(out)


def scan_logs(scs: list[FleetSidecar], offsets: dict[int, int]) -> LogFindings:
    f = LogFindings()
    for i, sc in enumerate(scs):
        f.add(sc.log_since(offsets.get(i, 0)))
    return f


# ------------------------------------------------------------------ measurement

@dataclass
class Window:
    label: str
    seconds: float
    api: dict[str, float]            # requests/s by verb
    server_cpu: float                # % of one core, the three servers summed
    per_server: list[float]
    other_cpu: float = 0.0           # % of one core: the sidecars (or the watchers' process), summed
    missed_s: float = 0.0            # the API subscriber disconnected this long
    writes: collections.Counter = field(default_factory=collections.Counter)

    @property
    def api_total(self) -> float:
        return sum(self.api.values())


@dataclass
class Ctx:
    args: argparse.Namespace
    work: Path
    sockdir: Path
    cluster: Cluster
    bg: Bg
    api: ApiCounter
    ctl: Control
    buckets: list[str]
    all_sidecars: list[FleetSidecar] = field(default_factory=list)
    watchers: list[Watchers] = field(default_factory=list)

    def server_pids(self) -> list[int | None]:
        return [s.pid for s in self.cluster.servers]

    def jsz_api_errors(self) -> dict[str, tuple[int | None, int]]:
        """Each server's /jsz api.errors (cumulative since it started) and its PID."""
        out = {}
        for s in self.cluster.servers:
            if s.running:
                try:
                    out[s.server_name] = (s.pid, int((s.monitor("/jsz").get("api") or {}).get("errors", 0)))
                except Exception:
                    pass
        return out


def errors_since(before: dict, after: dict) -> int:
    """API errors the servers counted between two jsz_api_errors() (a restarted server from 0)."""
    n = 0
    for name, (pid, errs) in after.items():
        was = before.get(name)
        n += errs - was[1] if was and was[0] == pid else errs
    return n


def measure(ctx: Ctx, label: str, other_pids: list[int | None] = ()) -> Window:
    pids = ctx.server_pids()
    w0 = collections.Counter(ctx.ctl.w)
    c0, t0 = ctx.api.snapshot(), time.monotonic()
    s0 = [cpu_s(p) for p in pids]
    o0 = sum(cpu_s(p) for p in other_pids)
    time.sleep(ctx.args.window)
    c1, t1 = ctx.api.snapshot(), time.monotonic()
    s1 = [cpu_s(p) for p in pids]
    o1 = sum(cpu_s(p) for p in other_pids)
    if pids != ctx.server_pids():
        log(f"  warning: a server restarted during '{label}'")
    dt = t1 - t0
    per = [100 * (b - a) / dt for a, b in zip(s0, s1, strict=True)]
    w = Window(label, dt, {k: (c1[k] - c0[k]) / dt for k in c1 if c1[k] - c0[k]}, sum(per), per,
               100 * (o1 - o0) / dt, ctx.api.missed_between(t0, t1),
               collections.Counter(ctx.ctl.w) - w0)
    log(f"  {label}: {w.api_total:.1f} API req/s, servers {w.server_cpu:.1f}% of a core "
        f"({', '.join(f'{p:.1f}' for p in per)}), fleet processes {w.other_cpu:.1f}%"
        + (f", writes acked {w.writes['acked'] / dt:.1f}/s" if w.writes['sent'] else "")
        + (f", subscriber missed {w.missed_s:.1f}s" if w.missed_s else ""))
    return w


def writer_on(ctx: Ctx, max_s: float) -> None:
    ctx.bg.run(ctx.ctl.start_writer(ctx.args.rate, max_s))
    time.sleep(SETTLE_S / 2)


def writer_off(ctx: Ctx) -> None:
    ctx.bg.run(ctx.ctl.stop_writer(), 30)


def wait_no_consumers(ctx: Ctx, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        counts = ctx.bg.run(ctx.ctl.consumer_counts(), 60)
        if all(v == 0 for v in counts.values()) or time.monotonic() > deadline:
            return counts
        time.sleep(2)


def on_cluster(counts: dict[str, int | None]) -> int | None:
    """The consumers on the cluster: the sum over the buckets' streams (None: one unknown)."""
    return None if any(v is None for v in counts.values()) else sum(v or 0 for v in counts.values())


def connections_per_server(ctx: Ctx) -> str:
    out = []
    for s in ctx.cluster.servers:
        try:
            conns = s.monitor("/connz?limit=1024").get("connections") or []
            out.append(f"{s.server_name} {sum(1 for c in conns if c.get('name') == 'kvcache')}")
        except Exception:
            out.append(f"{s.server_name} ?")
    return ", ".join(out)


# ------------------------------------------------------------------ phases

def start_fleet(ctx: Ctx, n: int) -> tuple[list[FleetSidecar], str]:
    a = ctx.args
    scs = []
    for i in range(n):
        name = f"n{n}-sc{i:02d}"
        sc = FleetSidecar(ctx.work / "sidecars" / name, ctx.sockdir / f"{name}.sock", ctx.cluster.urls,
                          ctx.buckets, a.sidecar_src, a.sidecar_settings)
        scs.append(sc)
        ctx.all_sidecars.append(sc)
    t0 = time.monotonic()
    for i in range(0, n, a.start_batch):
        batch = scs[i:i + a.start_batch]
        for sc in batch:
            sc.launch()
        for sc in batch:
            sc.wait_serving(120)
            sc.wait_synced(180)
    took = time.monotonic() - t0
    line = (f"{n} sidecars started {a.start_batch} at a time, all synced with no lag in {took:.1f}s; "
            f"{ctx.api.tally(t0, time.monotonic()).line()}; sidecars' NATS connections "
            f"per server: {connections_per_server(ctx)}")
    log("  " + line)
    return scs, line


def stop_fleet(scs: list[FleetSidecar]) -> list[str]:
    problems = []
    for sc in scs:
        if sc.running():
            sc.proc.send_signal(signal.SIGTERM)
    for sc in scs:
        try:
            sc.stop(30)
        except Exception as e:  # a traceback in its log, or it ignored SIGTERM (then killed)
            problems.append(f"{sc.data_dir.name}: {str(e).splitlines()[0]}")
            sc.kill(check=False)
    return problems


@dataclass
class StormResult:
    all_synced_s: float | None
    synced_s: list[float]
    exited: list[str]
    consumers: list[tuple[float, dict]]
    api: dict[str, int]
    api_s: float
    missed_s: float
    jsz_errors: int
    logs: LogFindings
    writes: collections.Counter
    creates: Creates


def storm(ctx: Ctx, scs: list[FleetSidecar]) -> StormResult:
    n, nb = len(scs), len(ctx.buckets)
    offsets = {i: sc.log_size() for i, sc in enumerate(scs)}
    writer_on(ctx, STORM_TIMEOUT_S + 120)
    w0 = collections.Counter(ctx.ctl.w)
    e0 = ctx.jsz_api_errors()
    for sc in scs:
        sc.kill(check=False)
    c0 = ctx.api.snapshot()
    for sc in scs:
        sc.launch()
    t0 = time.monotonic()
    log(f"  storm: {n} sidecars SIGKILLed and started again at once")
    synced: dict[int, float] = {}
    exited: dict[int, str] = {}
    samples: list[tuple[float, dict]] = []
    c1, t_api = None, None
    pool = ThreadPoolExecutor(max_workers=min(16, n))
    try:
        while time.monotonic() - t0 < STORM_TIMEOUT_S:
            now = time.monotonic() - t0
            if len(samples) < len(STORM_SAMPLES) and now >= STORM_SAMPLES[len(samples)]:
                at = time.monotonic() - t0
                counts = ctx.bg.run(ctx.ctl.consumer_counts(), 60)
                samples.append((at, counts))
                log(f"    consumers per stream at {at:.1f}s: {counts}")
                if len(samples) == len(STORM_SAMPLES):
                    c1, t_api = ctx.api.snapshot(), time.monotonic()
            waiting = [i for i in range(n) if i not in synced and i not in exited]
            for i in waiting:
                if not scs[i].running():
                    exited[i] = f"{scs[i].data_dir.name} exited {scs[i].proc.returncode}"
            waiting = [i for i in waiting if i not in exited]
            if waiting:
                oks = list(pool.map(lambda i: scs[i].synced(nb), waiting))
                at = time.monotonic() - t0
                for i, ok in zip(waiting, oks, strict=True):
                    if ok:
                        synced[i] = at
                if len(synced) == n:
                    log(f"    all {n} synced {at:.1f}s after the restart")
            elif len(samples) == len(STORM_SAMPLES):
                break
            time.sleep(0.25)
    finally:
        pool.shutdown(wait=True)
    if c1 is None:
        c1, t_api = ctx.api.snapshot(), time.monotonic()
    writes = collections.Counter(ctx.ctl.w) - w0
    writer_off(ctx)
    return StormResult(
        all_synced_s=max(synced.values()) if len(synced) == n else None,
        synced_s=sorted(synced.values()), exited=list(exited.values()), consumers=samples,
        api={k: c1[k] - c0[k] for k in c1 if c1[k] - c0[k]}, api_s=t_api - t0,
        missed_s=ctx.api.missed_between(t0, t_api), jsz_errors=errors_since(e0, ctx.jsz_api_errors()),
        logs=scan_logs(scs, offsets), writes=writes, creates=ctx.api.tally(t0, t_api))


@dataclass
class Creates:
    """What the CONSUMER.CREATE/DELETE requests of a span say, per (connection, stream): a
    connection is one sidecar (its nats-py request mux), a stream one bucket. A feed consumer
    was placed (kept) if it was ever sent a pull request: the sidecar pulls from a consumer only
    once it is on the stream leader, and deletes one that is not (a placement retry)."""

    requests: collections.Counter = field(default_factory=collections.Counter)  # CREATEs, all kinds
    placed: collections.Counter = field(default_factory=collections.Counter)    # feed consumers kept
    misplaced: int = 0      # feed CREATEs never pulled from: placement retries (or failed attempts)
    headers: int = 0        # headers-only CREATEs (reconcile passes), their retries included
    deletes: int = 0
    tries: list[int] = field(default_factory=list)  # CREATEs per placed feed consumer

    def line(self) -> str:
        placed = sum(self.placed.values())
        t = sorted(self.tries)
        return (f"CONSUMER.CREATE {sum(self.requests.values())}: {placed} feed consumers placed, "
                f"{self.misplaced} feed placement retries, {self.headers} headers-only (reconcile); "
                f"CONSUMER.DELETE {self.deletes}"
                + (f"; CREATEs per placed feed consumer: mean {statistics.mean(t):.1f}, "
                   f"median {statistics.median(t):g}, max {t[-1]}" if t else ""))


def tally(events: list[ConsumerEvent], pulled: set[ConsumerEvent]) -> Creates:
    c = Creates()
    c.deletes = sum(1 for e in events if e.verb == "CONSUMER.DELETE")
    run: collections.Counter = collections.Counter()  # misplaced feed CREATEs since the last placed one
    for e in sorted((e for e in events if e.verb == "CONSUMER.CREATE"), key=lambda e: e.t):
        key = (e.conn, e.stream)
        c.requests[key] += 1
        if e.headers_only:
            c.headers += 1
            continue
        if e not in pulled:
            c.misplaced += 1
            run[key] += 1
        else:
            c.placed[key] += 1
            c.tries.append(run.pop(key, 0) + 1)
    return c


@dataclass
class Step:
    server: str
    t0: float
    t1: float
    down_s: float
    ready_s: float
    missed_s: float                  # the step's own subscriber (on a server not restarted in the step)
    creates: Creates
    api: dict[str, int]
    via: str = ""                    # the server the step's subscriber was on
    main_creates: int = 0            # CONSUMER.CREATEs the run's subscriber saw in the step
    main_missed_s: float = 0.0       # and how long it was disconnected


@dataclass
class RollingResult:
    steps: list[Step]
    logs: LogFindings
    writes: collections.Counter
    after: str
    jsz_errors: int
    conns_seen: int
    consumers: dict = field(default_factory=dict)  # per stream, once every sidecar is synced again


def rolling(ctx: Ctx, scs: list[FleetSidecar]) -> RollingResult:
    offsets = {i: sc.log_size() for i, sc in enumerate(scs)}
    writer_on(ctx, 3 * 300 + 120)
    w0 = collections.Counter(ctx.ctl.w)
    e0 = ctx.jsz_api_errors()
    steps = []
    servers = ctx.cluster.servers
    for i, s in enumerate(servers):
        # The run's subscriber is blind while it reconnects, which is when the sidecars recreate
        # their consumers: each step is counted by a subscriber of its own, on a server that
        # stays up throughout the step (a single URL; nats-py may discover others, but only
        # reconnects when its server goes).
        via = servers[(i + 1) % len(servers)]
        sub = ApiCounter()
        ctx.bg.run(sub.start([via.url]), 30)
        try:
            time.sleep(0.5)  # its interest reaches the other servers over the routes
            t0 = time.monotonic()
            s.stop()
            t_down = time.monotonic()
            s.start(timeout=60)
            ctx.cluster.wait_ready(120)
            ctx.bg.run(ctx.ctl.streams_current(120), 150)
            t_ready = time.monotonic()
            time.sleep(QUIET_S)
            t1 = time.monotonic()
            c1 = sub.snapshot()
            main = ctx.api.tally(t0, t1)
            st = Step(s.server_name, t0, t1, t_down - t0, t_ready - t_down, sub.missed_between(t0, t1),
                      sub.tally(t0, t1), dict(c1), via.server_name, sum(main.requests.values()),
                      ctx.api.missed_between(t0, t1))
        finally:
            ctx.bg.run(sub.close(), 10)
        steps.append(st)
        log(f"  rolling: {s.server_name} stopped in {st.down_s:.1f}s, started, cluster ready and streams current "
            f"in {st.ready_s:.1f}s; {st.creates.line()}; counted on {via.server_name} (missed {st.missed_s:.2f}s; "
            f"the run's subscriber: {st.main_creates} CREATEs, missed {st.main_missed_s:.2f}s)")
    writes = collections.Counter(ctx.ctl.w) - w0
    writer_off(ctx)
    # afterwards: is every sidecar still up and synced with no lag?
    behind = []
    for sc in scs:
        try:
            sc.wait_synced(60)
        except Exception as e:
            behind.append(f"{sc.data_dir.name}: {str(e).splitlines()[0][:120]}")
    after = "every sidecar synced with no lag" if not behind else "; ".join(behind)
    conns = {k[0] for st in steps for k in st.creates.requests}
    consumers = ctx.bg.run(ctx.ctl.consumer_counts(), 60)
    log(f"  rolling restart done: {after}; consumers per stream now: {consumers}")
    return RollingResult(steps, scan_logs(scs, offsets), writes, after, errors_since(e0, ctx.jsz_api_errors()),
                         len(conns), consumers)


# ------------------------------------------------------------------ one fleet size

@dataclass
class SizeResult:
    n: int
    windows: dict[str, Window]
    storm: StormResult | None = None
    rolling: RollingResult | None = None
    stop_problems: list[str] = field(default_factory=list)
    leftover: dict = field(default_factory=dict)
    setup: str = ""
    consumers: list[tuple[str, dict]] = field(default_factory=list)  # (when, per stream) at steady state

    @property
    def steady(self) -> dict:
        """Consumers per stream at steady state: the last sample."""
        return self.consumers[-1][1] if self.consumers else {}

    @property
    def on_cluster(self) -> int | None:
        """Consumers on the cluster at steady state: the most any sample saw (a consumer seen
        at any of them counts), None when a sample could not be read."""
        totals = [on_cluster(c) for _, c in self.consumers]
        return None if not totals or None in totals else max(t for t in totals if t is not None)

    def per_sidecar(self, nb: int) -> dict[str, float]:
        w = self.windows
        n = self.n
        return {
            "api_idle": (w["sidecars idle"].api_total - w["baseline idle"].api_total) / (n * nb),
            "api_writes": (w["sidecars + writes"].api_total - w["baseline + writes"].api_total) / (n * nb),
            "cpu_idle": (w["sidecars idle"].server_cpu - w["baseline idle"].server_cpu) / n,
            "cpu_writes": (w["sidecars + writes"].server_cpu - w["baseline + writes"].server_cpu) / n,
            "cpu_watch": (w["watchers + writes"].server_cpu - w["baseline + writes"].server_cpu) / n,
            "sc_cpu_idle": w["sidecars idle"].other_cpu / n,
            "sc_cpu_writes": w["sidecars + writes"].other_cpu / n,
            "watch_cpu": w["watchers + writes"].other_cpu / n,
        }


def run_size(ctx: Ctx, n: int) -> SizeResult:
    a = ctx.args
    nb = len(ctx.buckets)
    log(f"fleet of {n}: {nb} buckets each")
    left = wait_no_consumers(ctx)
    if any(v for v in left.values()):
        log(f"  warning: consumers still on the streams before the baseline: {left}")
    ws: dict[str, Window] = {}
    ws["baseline idle"] = measure(ctx, "baseline idle")
    writer_on(ctx, a.window + 60)
    ws["baseline + writes"] = measure(ctx, "baseline + writes")
    writer_off(ctx)

    core = [REPUBLISH_DEST.format(bucket=b) for b in ctx.buckets] if a.republish else None
    wt = Watchers(ctx.cluster.urls, ctx.buckets, n, max_s=a.window + 600, core=core)
    ctx.watchers.append(wt)
    try:
        wt.wait_ready(300)
        time.sleep(SETTLE_S)
        writer_on(ctx, a.window + 60)
        ws["watchers + writes"] = measure(ctx, "watchers + writes", [wt.proc.pid])
        writer_off(ctx)
    finally:
        got = wt.stop()
        log(f"  {watcher_kind(ctx)} hosts: {got} updates received in all (after their initial values)")
        ctx.bg.run(ctx.ctl.delete_consumers(WATCH_INBOX), 120)
    wait_no_consumers(ctx, 60)

    res = SizeResult(n, ws)
    scs, res.setup = start_fleet(ctx, n)
    try:
        time.sleep(SETTLE_S)

        def sample(when: str) -> None:
            counts = ctx.bg.run(ctx.ctl.consumer_counts(), 60)
            res.consumers.append((when, counts))
            log(f"  consumers {when}: {on_cluster(counts)} on the cluster ({counts} per stream)")
        sample("before the idle window")
        ws["sidecars idle"] = measure(ctx, "sidecars idle", [sc.pid for sc in scs])
        sample("after the idle window")
        writer_on(ctx, a.window + 60)
        ws["sidecars + writes"] = measure(ctx, "sidecars + writes", [sc.pid for sc in scs])
        writer_off(ctx)
        sample("after the window with writes")
        print(report_size(ctx, res), flush=True)
        if not a.skip_storm:
            res.storm = storm(ctx, scs)
            print(report_storm(ctx, n, res.storm, res.steady), flush=True)
        if not a.skip_rolling:
            res.rolling = rolling(ctx, scs)
            print(report_rolling(ctx, n, res.rolling, res.steady), flush=True)
    finally:
        res.stop_problems = stop_fleet(scs)
    if res.stop_problems:
        log(f"  stopping the fleet: {res.stop_problems}")
    res.leftover[STOPPED_KEY] = left = ctx.bg.run(ctx.ctl.consumer_counts(), 60)
    log(f"  fleet stopped (SIGTERM); consumers per stream right after: {left}")
    return res


# ------------------------------------------------------------------ reports

def fmt(x: float, d: int = 2) -> str:
    return f"{x:,.{d}f}"


def report_size(ctx: Ctx, r: SizeResult) -> str:
    nb = len(ctx.buckets)
    w = r.windows
    order = ["baseline idle", "sidecars idle", "baseline + writes", "watchers + writes", "sidecars + writes"]
    lines = [f"\n=== {r.n} sidecars x {nb} buckets (R3, {ctx.args.keys} keys, {VALUE_SIZE} B values), "
             f"windows of {ctx.args.window:g}s; writes {ctx.args.rate:g}/s across the buckets",
             f"set-up: {r.setup}",
             f"consumers on the cluster at steady state: {r.on_cluster} (a consumer per sidecar per bucket would "
             f"be {r.n * nb}; sampled {', '.join(f'{w}: {on_cluster(c)}' for w, c in r.consumers)}); per stream "
             f"{r.steady}; right after the fleet's SIGTERM: {r.leftover.get(STOPPED_KEY, '(not yet)')}",
             "| window | API req/s | servers' CPU, % of a core (3 summed) | per server | fleet processes' CPU % | "
             "writes acked/s |",
             "|---|---:|---:|---|---:|---:|"]
    for k in order:
        x = w[k]
        lines.append(f"| {k} | {fmt(x.api_total, 1)} | {fmt(x.server_cpu, 1)} | "
                     f"{' / '.join(fmt(p, 1) for p in x.per_server)} | {fmt(x.other_cpu, 1)} | "
                     f"{fmt(x.writes['acked'] / x.seconds, 1) if x.writes['sent'] else '-'} |"
                     + (f" (subscriber missed {x.missed_s:.1f}s)" if x.missed_s else ""))
    verbs = sorted({v for k in order for v in w[k].api}, key=lambda v: -w["sidecars idle"].api.get(v, 0))
    lines += ["JetStream API requests/s by kind (per sidecar per bucket in brackets):",
              "| kind | sidecars idle | sidecars + writes | watchers + writes | baseline |",
              "|---|---:|---:|---:|---:|"]
    for v in verbs:
        def cell(k: str, v: str = v) -> str:
            x = w[k].api.get(v, 0.0)
            return f"{fmt(x)} ({fmt(x / (r.n * nb), 3)})" if x else "0"
        lines.append(f"| {v} | {cell('sidecars idle')} | {cell('sidecars + writes')} | {cell('watchers + writes')} "
                     f"| {fmt(w['baseline idle'].api.get(v, 0) + w['baseline + writes'].api.get(v, 0))} |")
    p = r.per_sidecar(nb)
    lines += [f"per sidecar: {fmt(p['api_idle'], 3)} API req/s per bucket idle, {fmt(p['api_writes'], 3)} with writes; "
              f"servers' CPU above the baseline {fmt(p['cpu_idle'], 3)}% of a core idle, {fmt(p['cpu_writes'], 3)}% "
              f"with writes (a plain watcher host: {fmt(p['cpu_watch'], 3)}%); the sidecar's own CPU "
              f"{fmt(p['sc_cpu_idle'], 2)}% idle, {fmt(p['sc_cpu_writes'], 2)}% with writes "
              f"(a watcher host's share of its process: {fmt(p['watch_cpu'], 2)}%)"]
    return "\n".join(lines)


def report_storm(ctx: Ctx, n: int, s: StormResult, steady: dict) -> str:
    nb = len(ctx.buckets)
    lines = [f"--- storm, {n} sidecars SIGKILLed and started at once (writer on, {ctx.args.rate:g} writes/s)"]
    if s.all_synced_s is not None:
        lines.append(f"  all synced {s.all_synced_s:.1f}s after the restart; per sidecar: median "
                     f"{statistics.median(s.synced_s):.1f}s, first {s.synced_s[0]:.1f}s")
    else:
        lines.append(f"  NOT all synced within {STORM_TIMEOUT_S:g}s: {len(s.synced_s)} of {n}")
    if s.exited:
        lines.append(f"  exited: {s.exited}")
    for at, counts in s.consumers:
        lines.append(f"  consumers per stream {at:5.1f}s after: {counts}, {on_cluster(counts)} on the cluster "
                     f"(at steady state: {steady}; {'OK' if counts == steady else 'other than at steady state'})")
    total = sum(s.api.values())
    lines.append(f"  JetStream API requests in the first {s.api_s:.0f}s: {total:,} "
                 f"({total / (n * nb):.1f} per sidecar per bucket)"
                 + (f", subscriber missed {s.missed_s:.1f}s" if s.missed_s else ""))
    for v, k in sorted(s.api.items(), key=lambda kv: -kv[1]):
        lines.append(f"    {v:28s} {k:8,d}  ({k / (n * nb):.1f} per sidecar per bucket)")
    lines.append(f"  {s.creates.line()}")
    lines.append(f"  servers' /jsz api.errors during it (3 summed): {s.jsz_errors}; writer: "
                 f"{dict(s.writes)}")
    lines.append("  sidecars' logs since the restart:")
    lines.append(s.logs.show())
    return "\n".join(lines)


def report_rolling(ctx: Ctx, n: int, r: RollingResult, steady: dict) -> str:
    nb = len(ctx.buckets)
    lines = [f"--- rolling restart of the 3 servers, {n} sidecars (writer on): each stopped (SIGTERM), started, "
             f"the cluster ready and every stream current, then {QUIET_S:g}s more. Feed consumers placed per "
             f"sidecar per bucket (a sidecar told apart by its connection's reply prefix: "
             f"{r.conns_seen} seen)",
             "| server restarted | stop s | start to ready s | CONSUMER.CREATE | feed consumers placed | "
             "sidecar-buckets with 0 / 1 / 2+ placed | placement retries | headers-only | DELETE | "
             "counted on (missed s) | the run's subscriber: CREATEs (missed s) |",
             "|---|---:|---:|---:|---:|---|---:|---:|---:|---|---|"]
    total: collections.Counter = collections.Counter()
    for st in r.steps:
        c = st.creates
        total.update(c.placed)
        h = collections.Counter(min(v, 2) for v in c.placed.values())
        h[0] = n * nb - len(c.placed)
        lines.append(f"| {st.server} | {st.down_s:.1f} | {st.ready_s:.1f} | {sum(c.requests.values())} | "
                     f"{sum(c.placed.values())} | {h[0]} / {h[1]} / {h[2]} | {c.misplaced} | {c.headers} | "
                     f"{c.deletes} | {st.via} ({st.missed_s:.2f}) | {st.main_creates} ({st.main_missed_s:.2f}) |")
    h = collections.Counter(min(v, 3) for v in total.values())
    h[0] = n * nb - len(total)
    twice = sum(1 for st in r.steps for v in st.creates.placed.values() if v > 1)
    lines.append(f"  over the whole restart: sidecar-buckets with 0 / 1 / 2 / 3+ feed consumers placed: "
                 f"{h[0]} / {h[1]} / {h[2]} / {h[3]} (of {n * nb}); placed more than once within one step: {twice}")
    tries = sorted(t for st in r.steps for t in st.creates.tries)
    if tries:
        lines.append(f"  CONSUMER.CREATE requests per placed feed consumer: mean {statistics.mean(tries):.1f}, "
                     f"median {statistics.median(tries):g}, max {tries[-1]} (an R1 consumer lands on any replica "
                     "of the stream; the sidecar deletes one not on the stream leader and tries again)")
    api: collections.Counter = collections.Counter()
    for st in r.steps:
        api.update(st.api)
    lines.append("  JetStream API requests during it: " + ", ".join(f"{v} {k:,}" for v, k in api.most_common()))
    lines.append(f"  servers' /jsz api.errors during it: {r.jsz_errors}; writer: {dict(r.writes)}; "
                 f"afterwards: {r.after}; consumers per stream then: {r.consumers} (at steady state: {steady}; a "
                 "consumer whose sidecar could not delete it while its server was down stays until its "
                 "inactive threshold)")
    lines.append("  sidecars' logs during it:")
    lines.append(r.logs.show())
    return "\n".join(lines)


def report_summary(ctx: Ctx, results: list[SizeResult]) -> str:
    nb = len(ctx.buckets)
    rate = ctx.args.rate
    lines = [f"\n=== cost per sidecar ({nb} buckets each; CPU in % of one core, all three servers summed, "
             "above the no-sidecar baseline of the same size's run)",
             "| sidecars | API req/s per sidecar per bucket, idle | with writes | servers' CPU % per sidecar, idle "
             f"| with writes | {watcher_kind(ctx)} host, with writes | sidecar's own CPU %, idle / writes "
             "| consumers on the cluster at steady state |",
             "|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in results:
        p = r.per_sidecar(nb)
        lines.append(f"| {r.n} | {fmt(p['api_idle'], 3)} | {fmt(p['api_writes'], 3)} | {fmt(p['cpu_idle'], 3)} | "
                     f"{fmt(p['cpu_writes'], 3)} | {fmt(p['cpu_watch'], 3)} | "
                     f"{fmt(p['sc_cpu_idle'], 2)} / {fmt(p['sc_cpu_writes'], 2)} | {r.on_cluster} |")
    slopes: dict[str, float] = {}
    if len(results) >= 2:
        a, b = results[0], results[-1]
        dn = b.n - a.n

        def slope(key: str, win: str, base: str) -> float:
            return ((getattr(b.windows[win], key) - getattr(b.windows[base], key))
                    - (getattr(a.windows[win], key) - getattr(a.windows[base], key))) / dn
        slopes = {"api": slope("api_total", "sidecars idle", "baseline idle") / nb,
                  "cpu_idle": slope("server_cpu", "sidecars idle", "baseline idle"),
                  "cpu_writes": slope("server_cpu", "sidecars + writes", "baseline + writes")}
        lines.append(
            f"slope from {a.n} to {b.n} sidecars (each added sidecar): "
            f"{fmt(slope('api_total', 'sidecars idle', 'baseline idle') / nb, 3)} API req/s per bucket idle, "
            f"{fmt(slope('api_total', 'sidecars + writes', 'baseline + writes') / nb, 3)} with writes; servers' CPU "
            f"{fmt(slope('server_cpu', 'sidecars idle', 'baseline idle'), 3)}% idle, "
            f"{fmt(slope('server_cpu', 'sidecars + writes', 'baseline + writes'), 3)}% with writes "
            f"(a plain watcher host: {fmt(slope('server_cpu', 'watchers + writes', 'baseline + writes'), 3)}%)")
    big = results[-1]
    p = big.per_sidecar(nb)
    pairs = HOSTS * HOST_BUCKETS
    w = big.windows["sidecars idle"]
    info_rate = (w.api.get("STREAM.INFO", 0) - big.windows["baseline idle"].api.get("STREAM.INFO", 0)) / (big.n * nb)
    shared = (p["api_idle"] - info_rate) * HOST_BUCKETS * HOSTS + info_rate * HOSTS
    write_part = max(0.0, p["cpu_writes"] - p["cpu_idle"])
    lines += [
        f"projection to {HOSTS:,} hosts x {HOST_BUCKETS} buckets ({pairs:,} sidecar-buckets), from the {big.n}-sidecar "
        f"figures, each cost linear in what it scales with:",
        f"  idle JetStream API requests: {fmt(p['api_idle'] * pairs, 0)}/s ({fmt(p['api_idle'], 3)} per sidecar-bucket "
        f"x {pairs:,}); of which STREAM.INFO {fmt(info_rate * pairs, 0)}/s. From {SHARED_FROM} buckets a sidecar "
        f"polls its streams' state with one STREAM.LIST per period instead of a STREAM.INFO per bucket: then "
        f"~{fmt(shared, 0)}/s, with {HOSTS:,} STREAM.LIST pages per period (not measured here: each costs the "
        f"meta leader a gather from every stream leader)",
        f"  idle servers' CPU: {fmt(p['cpu_idle'] / nb / 100 * pairs, 1)} cores "
        f"({fmt(p['cpu_idle'] / nb, 4)}% of a core per sidecar-bucket x {pairs:,})",
        f"  with writes ({rate:g}/s in all, every host getting every write): + "
        f"{fmt(write_part / 100 * HOSTS, 1)} cores for delivering them ({fmt(write_part, 3)}% per host above idle "
        f"x {HOSTS:,}; a plain watcher host costs {fmt(p['cpu_watch'], 3)}% in all, "
        f"{fmt(p['cpu_watch'] / 100 * HOSTS, 1)} cores for {HOSTS:,}); scales with the write rate",
    ]
    lines.append("  " + consumers_projection(results, nb))
    if slopes:
        lines.append(
            f"  from the slope instead (what each sidecar added from {results[0].n} to {big.n} cost; a cost the fleet "
            f"shares does not grow with it): {fmt(slopes['api'] * pairs, 0)} API requests/s, "
            f"{fmt(slopes['cpu_idle'] / nb / 100 * pairs, 1)} cores idle, + "
            f"{fmt(max(0.0, slopes['cpu_writes'] - slopes['cpu_idle']) / 100 * HOSTS, 1)} cores with writes")
    return "\n".join(lines)


def watcher_kind(ctx: Ctx) -> str:
    return "plain core subscriber (RePublish)" if ctx.args.republish else "plain watcher (kv.watchall)"


def consumers_projection(results: list[SizeResult], nb: int) -> str:
    """The consumers a 10,000-host fleet would hold: flat when the sizes measured agree,
    else the slope between the smallest and the largest size, beside a consumer per sidecar
    per bucket."""
    pairs = HOSTS * HOST_BUCKETS
    known = [r for r in results if r.on_cluster is not None]
    head = f"consumers on the cluster: a consumer per sidecar per bucket would be {pairs:,}; measured "
    if not known:
        return head + "nothing (a sample could not be read)"
    seen = ", ".join(f"{r.on_cluster} at {r.n}" for r in known)
    a, b = known[0], known[-1]
    if a.on_cluster == b.on_cluster and len(known) > 1:
        per_bucket = (b.on_cluster or 0) / nb
        return (head + f"{seen} sidecars: independent of the fleet's size, so {fmt(per_bucket * HOST_BUCKETS, 0)} "
                f"for {HOST_BUCKETS} buckets ({fmt(per_bucket, 1)} per bucket)")
    if len(known) > 1 and b.n != a.n:
        slope = ((b.on_cluster or 0) - (a.on_cluster or 0)) / (b.n - a.n) / nb   # per added sidecar-bucket
        fixed = (b.on_cluster or 0) / nb - slope * b.n                            # per bucket, shared
        return (head + f"{seen} sidecars: {fmt(slope, 2)} per added sidecar per bucket, so "
                f"{fmt(fixed * HOST_BUCKETS + slope * pairs, 0)} at {HOSTS:,} x {HOST_BUCKETS}")
    return (head + f"{seen} sidecars (one size: linear from none, "
            f"{fmt((b.on_cluster or 0) / (b.n * nb) * pairs, 0)} at {HOSTS:,} x {HOST_BUCKETS})")


# ------------------------------------------------------------------ main

def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="10,30", help="fleet sizes (sidecars), comma separated, run in this order")
    p.add_argument("--buckets", type=int, default=2, help="buckets per sidecar (all sidecars replicate the same)")
    p.add_argument("--keys", type=int, default=2000, help="keys per bucket (100-byte values)")
    p.add_argument("--rate", type=float, default=50.0, help="writes/s across the buckets")
    p.add_argument("--window", type=float, default=30.0, help="seconds of each steady-state measurement")
    p.add_argument("--start-batch", type=int, default=3, help="sidecars started together at set-up")
    p.add_argument("--sidecar-settings", default="--max-stale-ms 2000 --heartbeat-ms 1000",
                   help="the sidecars' flags (what a fleet's cost depends on)")
    p.add_argument("--republish", action="store_true",
                   help="make the buckets with RePublish ($KV.<bucket>.> onto "
                        f"{REPUBLISH_DEST.format(bucket='<bucket>')}); the plain watchers are then core "
                        "subscribers to it")
    p.add_argument("--relay", action="store_true",
                   help="make the buckets with Direct Get allowed (as `nats kv add` does), which the sidecars' "
                        "fleet relay needs, and turn the relay on (adds --relay to the sidecars' flags)")
    p.add_argument("--skip-storm", action="store_true")
    p.add_argument("--skip-rolling", action="store_true")
    p.add_argument("--sidecar-src", type=Path, default=None, metavar="DIR",
                   help="run the sidecar from this source tree (PYTHONPATH, python -P) instead of this checkout")
    p.add_argument("--workdir", type=Path, default=None,
                   help="state and logs (the sidecars' too) go here (default: a new temporary directory, kept)")
    a = p.parse_args()
    sizes = [int(x) for x in a.sizes.split(",") if x.strip()]
    if a.relay and not {"--relay", "--no-relay"} & set(a.sidecar_settings.split()):
        a.sidecar_settings += " --relay"  # off by default (docs/configuration.md)
    if not sizes or min(sizes) < 1 or a.buckets < 1 or a.keys < 1 or a.rate <= 0 or a.window <= 0:
        p.error("sizes, buckets, keys, rate and window must be positive")
    if a.sidecar_src:
        a.sidecar_src = a.sidecar_src.resolve()
        check_src(a.sidecar_src, "fleet_bench")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # so every finally runs

    work = (a.workdir or Path(tempfile.mkdtemp(prefix="fleet-bench-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    sockdir = Path(tempfile.mkdtemp(prefix="fb-"))  # short: a socket path has at most 107 bytes
    log(f"state and logs under {work}; sizes {sizes}, {a.buckets} buckets of {a.keys} keys, "
        f"{a.rate:g} writes/s, windows of {a.window:g}s; the sidecar from {describe_src(a.sidecar_src)}")
    buckets = [f"fleet{i}" for i in range(a.buckets)]
    bg = Bg().start()
    api = ApiCounter()
    cluster = None
    ctl = None
    ctx = None
    ok = False
    t_start = time.monotonic()
    try:
        cluster = start_cluster(work / "nats", n=3, domain=None, name="fleet")
        ctl = Control(cluster.urls, buckets, a.keys, republish=a.republish, direct=a.relay)
        bg.run(ctl.connect(), 30)
        bg.run(api.start(cluster.urls), 30)
        t0 = time.monotonic()
        bg.run(ctl.make_buckets(), 600)
        log(f"cluster up, {a.buckets} R3 buckets of {a.keys} keys written in {time.monotonic() - t0:.1f}s; "
            f"stream leaders: {bg.run(ctl.leaders(), 60)}; RePublish: {bg.run(ctl.republish_of(), 60)}")
        ctx = Ctx(a, work, sockdir, cluster, bg, api, ctl, buckets)
        results = []
        for n in sizes:
            results.append(run_size(ctx, n))
        for r in results:
            print(report_size(ctx, r))
            if r.storm:
                print(report_storm(ctx, r.n, r.storm, r.steady))
            if r.rolling:
                print(report_rolling(ctx, r.n, r.rolling, r.steady))
        print(report_summary(ctx, results))
        if api.errors:
            print(f"API subscriber's connection errors: {collections.Counter(api.errors).most_common(5)}")
        print(f"\ndone in {time.monotonic() - t_start:.0f}s; sidecar logs under {work / 'sidecars'}")
        ok = True
        return 0
    finally:
        if ctx is not None:
            api.dump(work / "consumer-events.tsv", t_start)
            for wt in ctx.watchers:
                wt.stop()
            problems = stop_fleet([sc for sc in ctx.all_sidecars if sc.running()])
            if problems and not ok:
                print(f"stopping sidecars: {problems}", file=sys.stderr)
        if ctl is not None:
            try:
                bg.run(ctl.close(), 20)
            except Exception:
                pass
        try:
            bg.run(api.close(), 10)
        except Exception:
            pass
        bg.stop()
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(sockdir, ignore_errors=True)
        if not ok:
            print(f"state and logs kept under {work}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
