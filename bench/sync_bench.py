"""Initial sync speed: kvcache's feed against nats-py's `kv.watchall()` and a raw consumer.

A measurement script, not a test. It starts its own nats-server (loopback, temporary
directory), loads N keys into a KV bucket with pipelined JetStream publishes, then measures in
the same run:

  (a) `kvcache serve` on the bucket, from process start until INFO reports synced=1, keys=N;
  (b) nats-py `kv.watchall()` with default settings, until its end-of-initial-data marker
      (the `None` entry) -- or until it stalls or times out, reporting how many entries came;
  (c) the same watch with the subscription's pending limits raised so that it can finish.
      `KeyValue.watch()` has no parameter for them: it calls `js.subscribe(...)` with the
      defaults (pending_msgs_limit=512*1024, pending_bytes_limit=256 MiB), so this script
      wraps that KeyValue's `js.subscribe` to pass pending_msgs_limit=N+65536 and
      pending_bytes_limit=0 (0 disables nats-py's byte limit);
  (d) a raw consumer: a bare NATS client on an asyncio stream (no nats-py) that creates the
      same kind of consumer as the feed (ephemeral, AckNone, last_per_subject, in memory) with
      raw JSON over the JetStream API, keeps two pull requests of --window messages in flight,
      and only counts deliveries until it has N. `raw` walks every frame (what any Python
      client must at least do); `raw-scan` only searches the bytes for the deliveries' ack
      subjects, so the server, not the counting, is the limit: its delivery rate to one
      connection, the reference for the feed.

--methods picks a subset (kvcache,raw,raw-scan,watch,watch-raised); `run()` and `SyncRun`
are what bench/compare.py imports.

Everything is bounded in time, and every process it starts is stopped by its own PID.

    python bench/sync_bench.py --keys 100000
    python bench/sync_bench.py --keys 1000000
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import nats
import nats.errors

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from socket_bench import exit_on_sigterm

from kvcache.app.client import Client, ConnectionFailed
from kvcache.natsio.nats_server import NatsServer, die_with_parent

BUCKET = "bench"


@dataclass
class Result:
    method: str
    keys: int
    seconds: float | None
    finished: bool
    note: str = ""
    kind: str = ""  # kvcache, raw, watch, watch-raised: what ratios refer to


# ----------------------------------------------------------------------------- loading

async def load(url: str, n: int, value_size: int, chunk: int, deadline: float) -> float:
    """Create the bucket and write n keys with pipelined acked publishes; returns seconds."""
    nc = await nats.connect(url, connect_timeout=5, allow_reconnect=False)
    try:
        js = nc.jetstream(timeout=30)
        await js.create_key_value(bucket=BUCKET, history=1)
        pad = b"x" * max(0, value_size - 24)
        t0 = time.monotonic()
        for start in range(0, n, chunk):
            if time.monotonic() > deadline:
                raise TimeoutError(f"loading did not finish in time ({start} of {n} written)")
            await asyncio.gather(*(
                js.publish(f"$KV.{BUCKET}.k.{i:08d}", b"%08d:" % i + pad + b"%016d" % i)
                for i in range(start, min(start + chunk, n))))
        seconds = time.monotonic() - t0
        info = await js.stream_info(f"KV_{BUCKET}")
        if info.state.messages != n:
            raise RuntimeError(f"stream holds {info.state.messages} messages, expected {n}")
        return seconds
    finally:
        await nc.close()


# ----------------------------------------------------------------------------- (a) kvcache

def replica_disk_bytes(data_dir: Path) -> int:
    """What the replica's LMDB file takes on disk (allocated blocks: the map is sparse)."""
    f = data_dir / "replica" / "data.mdb"
    return f.stat().st_blocks * 512 if f.exists() else 0


_COMPILED: set[Path] = set()


def precompile(src: Path) -> None:
    """Byte-compile the tree's package once, as an install does: a process start then loads
    the bytecode instead of compiling every module (about 0.1 s here), whatever
    PYTHONDONTWRITEBYTECODE says (it only stops writing)."""
    if src not in _COMPILED:
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(src / "kvcache")], check=True)
        _COMPILED.add(src)


def bench_kvcache(url: str, n: int, work: Path, timeout: float, src: Path = ROOT,
                  kind: str = "kvcache") -> Result:
    precompile(src)
    data_dir = work / "kvcache"
    sock = str(work / "kvcache.sock")
    log_path = work / "kvcache.log"
    args = [sys.executable, "-m", "kvcache", "serve", "--nats", url, "--bucket", BUCKET,
            "--data-dir", str(data_dir), "--socket", sock, "--log-level", "info"]
    env = {**os.environ, "PYTHONPATH": str(src) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    name = "kvcache serve (process start to synced)" if src == ROOT else f"kvcache from {src} (process start to synced)"
    with open(log_path, "ab") as log:
        t0 = time.monotonic()
        # started in `src`: `python -m` puts the working directory before PYTHONPATH
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=src,
                                stdin=subprocess.DEVNULL, env=env, preexec_fn=die_with_parent)
    try:
        deadline = t0 + timeout
        state: dict = {}
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"kvcache exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
            try:
                with Client(sock, timeout=5) as c:
                    state = c.info("buckets").get("buckets", {}).get(BUCKET, {})
            except (ConnectionFailed, OSError):
                state = {}
            if state.get("synced") == 1 and state.get("keys") == n:
                seconds = time.monotonic() - t0
                own = [ln for ln in log_path.read_text().splitlines() if "synced" in ln and "keys in" in ln]
                note = own[-1].split(": ", 1)[-1] if own else ""
                disk = f"replica {replica_disk_bytes(data_dir) / (1 << 20):,.0f} MiB on disk"
                return Result(name, n, seconds, True,
                              f"feed's own log: {note}; {disk}" if note else disk, kind=kind)
            time.sleep(0.02)
        return Result(name, state.get("keys", 0), None, False,
                      f"not synced after {timeout:.0f}s: {state}", kind=kind)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# ----------------------------------------------------------------------------- (b) nats-py

async def bench_watch(url: str, n: int, raised: bool, timeout: float, stall_s: float) -> Result:
    """kv.watchall() until the None marker; stops at `timeout` or after `stall_s` of silence."""
    slow = 0

    async def on_error(e: Exception) -> None:
        nonlocal slow
        if isinstance(e, nats.errors.SlowConsumerError):
            slow += 1

    nc = await nats.connect(url, connect_timeout=5, allow_reconnect=False, error_cb=on_error)
    label = "nats-py kv.watchall(), " + ("pending limits raised" if raised else "defaults")
    try:
        js = nc.jetstream(timeout=30)
        kv = await js.key_value(BUCKET)
        if raised:
            # watch() has no knob for the subscription's pending limits: pass them through.
            kv._js.subscribe = functools.partial(
                kv._js.subscribe, pending_msgs_limit=n + 65536, pending_bytes_limit=0)
        t0 = time.monotonic()
        deadline = t0 + timeout
        watcher = await kv.watchall()
        count = 0
        finished = False
        reason = ""
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    reason = f"timed out after {timeout:.0f}s"
                    break
                try:
                    entry = await asyncio.wait_for(watcher._updates.get(), min(stall_s, left))
                except TimeoutError:
                    if time.monotonic() < deadline:
                        reason = f"stalled: nothing for {stall_s:.0f}s"
                    else:
                        reason = f"timed out after {timeout:.0f}s"
                    break
                if entry is None:
                    finished = True
                    break
                count += 1
            seconds = time.monotonic() - t0
        finally:
            try:
                await asyncio.wait_for(watcher.stop(), 5)
            except Exception:
                pass
        note = f"{count} entries before the end marker"
        if not finished:
            note = f"no end marker ({reason}); got {count} entries"
        if slow:
            note += f"; {slow} slow-consumer drops reported"
        return Result(label, count, seconds if finished else None, finished, note,
                      kind="watch-raised" if raised else "watch")
    finally:
        try:
            await asyncio.wait_for(nc.close(), 10)
        except Exception:
            pass


# ----------------------------------------------------------------------------- (d) raw

def _pub(subject: str, reply: str, payload: bytes) -> bytes:
    return f"PUB {subject} {reply} {len(payload)}\r\n".encode() + payload + b"\r\n"


async def bench_raw(url: str, n: int, timeout: float, stall_s: float, window: int = 16384,
                    scan: bool = False) -> Result:
    """Count deliveries on a bare NATS connection: CONNECT, SUB, the consumer CREATE request as
    raw JSON, then pull requests of `window` messages, two in flight, until n have come.

    Deliveries are told apart by their `$JS.ACK.<stream>.` reply subject. By default every
    frame is walked (control line, then skip the payload by its size): the least a Python
    client must do, about 2 µs a frame here. With `scan`, once the consumer exists, each
    read's bytes are only searched for that reply prefix (bytes.count, in C): exact for this
    benchmark's own values, which cannot contain it, and close to what the server can
    deliver to one connection."""
    label = "raw socket consumer (pull, " + ("scans for ack subjects)" if scan else "walks frames)")
    ack = f" $JS.ACK.KV_{BUCKET}.".encode()
    tail = b""
    u = urllib.parse.urlsplit(url)
    reader, writer = await asyncio.wait_for(asyncio.open_connection(u.hostname, u.port), 5)
    stream, name, inbox = f"KV_{BUCKET}", "raw" + secrets.token_hex(6), "_RAW." + secrets.token_hex(6)
    try:
        if not (await asyncio.wait_for(reader.readline(), 5)).startswith(b"INFO "):
            raise RuntimeError("no INFO from nats-server")
        connect = {"verbose": False, "pedantic": False, "headers": True, "no_responders": True,
                   "protocol": 1, "lang": "raw", "version": "0"}
        config = {"name": name, "ack_policy": "none", "deliver_policy": "last_per_subject",
                  "replay_policy": "instant", "filter_subject": f"$KV.{BUCKET}.>",
                  "mem_storage": True, "num_replicas": 1, "inactive_threshold": 60 * 10**9}
        pull = _pub(f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{name}", f"{inbox}.pull",
                    json.dumps({"batch": window, "expires": int(timeout * 1e9)}).encode())
        t0 = time.monotonic()
        deadline = t0 + timeout
        writer.write(f"CONNECT {json.dumps(connect)}\r\nSUB {inbox}.> 1\r\n".encode() + _pub(
            f"$JS.API.CONSUMER.CREATE.{stream}.{name}", f"{inbox}.create",
            json.dumps({"stream_name": stream, "config": config, "action": "create"}).encode()))
        create_reply = f"{inbox}.create".encode()
        count = requested = statuses = 0
        created = False
        buf = bytearray()
        reason = ""
        while count < n:
            left = deadline - time.monotonic()
            if left <= 0:
                reason = f"timed out after {timeout:.0f}s"
                break
            try:
                data = await asyncio.wait_for(reader.read(1 << 20), min(stall_s, left))
            except TimeoutError:
                reason = f"stalled: nothing for {stall_s:.0f}s"
                break
            if not data:
                raise RuntimeError("nats-server closed the connection")
            if created and scan:
                count += (tail + data).count(ack)  # a prefix split across reads counts once
                tail = data[1 - len(ack):]
            else:
                buf += data
                pos, end_buf = 0, len(buf)
                while True:
                    eol = buf.find(b"\r\n", pos)
                    if eol < 0:
                        break
                    op = buf[pos:pos + 4]
                    if op == b"MSG " or op == b"HMSG":
                        # MSG <subject> <sid> [reply] <size> / HMSG <subject> <sid> [reply] <hdr> <total>
                        parts = buf[pos:eol].split()
                        end = eol + 4 + int(parts[-1])
                        if end > end_buf:
                            break
                        with_reply = len(parts) == (6 if op == b"HMSG" else 5)
                        if with_reply and parts[3].startswith(b"$JS.ACK."):
                            count += 1
                        elif parts[1] == create_reply:
                            reply = json.loads(bytes(buf[eol + 2:end - 2]).split(b"\r\n\r\n")[-1])
                            if "error" in reply:
                                raise RuntimeError(f"consumer create failed: {reply['error']}")
                            created = True
                        else:
                            statuses += 1  # a pull request's end (408/409) or a heartbeat
                        pos = end
                    else:
                        if op == b"PING":
                            writer.write(b"PONG\r\n")
                        elif op == b"-ERR":
                            raise RuntimeError(f"nats-server: {bytes(buf[pos:eol]).decode(errors='replace')}")
                        pos = eol + 2
                del buf[:pos]
            if created:
                while requested - count < 2 * window:
                    writer.write(pull)
                    requested += window
        seconds = time.monotonic() - t0
        finished = count >= n
        note = f"{count} deliveries counted, {statuses} status frames"
        if not finished:
            note = f"did not reach {n} ({reason}); {note}"
        writer.write(_pub(f"$JS.API.CONSUMER.DELETE.{stream}.{name}", f"{inbox}.delete", b""))
        await asyncio.wait_for(writer.drain(), 5)
        return Result(label, count, seconds if finished else None, finished, note,
                      kind="raw-scan" if scan else "raw")
    finally:
        writer.close()
        try:
            await asyncio.wait_for(writer.wait_closed(), 5)
        except (TimeoutError, OSError):
            pass


# ----------------------------------------------------------------------------- report

def versions() -> str:
    from importlib.metadata import version

    from kvcache.natsio.nats_server import find_binary
    try:
        server = subprocess.run([find_binary(), "--version"], capture_output=True, text=True,
                                timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        server = "nats-server ?"
    return f"{server}, nats-py {version('nats-py')}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs"


METHODS = ("kvcache", "raw", "raw-scan", "watch", "watch-raised")
# seconds each: best of `repeat`; nats-py's watch runs once. kvcache-other: --other-src's kvcache
REPEATED = ("kvcache", "kvcache-other", "raw", "raw-scan")


@dataclass
class SyncRun:
    n: int
    value_size: int
    load_seconds: float = 0.0
    versions: str = ""
    results: list[Result] = field(default_factory=list)

    def result(self, kind: str) -> Result | None:
        return next((r for r in self.results if r.kind == kind), None)

    def rate(self, kind: str) -> float | None:
        r = self.result(kind)
        return self.n / r.seconds if r and r.finished and r.seconds else None

    def table(self) -> str:
        raw = "raw-scan" if self.rate("raw-scan") else "raw"
        refs = [(kind, self.rate(kind)) for kind in (raw, "watch-raised")]
        lines = [f"initial sync, {self.n:,} keys, {self.value_size} B values, loopback; "
                 f"loaded in {self.load_seconds:.1f}s; {self.versions}", "",
                 f"| method | keys | seconds | keys/s | vs {raw} consumer | vs nats-py (raised limits) |",
                 "|---|---:|---:|---:|---:|---:|"]
        for r in self.results:
            done = r.finished and r.seconds
            secs = f"{r.seconds:.2f}" if done else "did not finish"
            rate = f"{self.n / r.seconds:,.0f}" if done else "-"
            ratios = [f"{self.n / r.seconds / ref:.2f}x" if done and ref else "-" for _, ref in refs]
            lines.append(f"| {r.method} | {r.keys:,} | {secs} | {rate} | {' | '.join(ratios)} |")
        notes = [f"- {r.method}: {r.note}" for r in self.results if r.note]
        return "\n".join([*lines, "", *notes])


async def run(work: Path, n: int, value_size: int = 100, chunk: int = 5000, timeout: float = 300,
              stall: float = 15, load_timeout: float = 900, window: int = 16384,
              methods: tuple[str, ...] = METHODS, repeat: int = 1, other_src: Path | None = None) -> SyncRun:
    """Start a nats-server under `work`, load n keys, measure each method in turn (the quick
    ones best of `repeat`), stop it."""
    out = SyncRun(n, value_size, versions=versions())
    server = NatsServer(work / "js", server_name="bench", max_file_store="32GB")
    server.start()
    try:
        out.load_seconds = await load(server.url, n, value_size, chunk, time.monotonic() + load_timeout)
        print(f"loaded {n:,} keys ({value_size} B values) in {out.load_seconds:.1f}s "
              f"({n / out.load_seconds:,.0f} publishes/s); {out.versions}", file=sys.stderr, flush=True)
        if other_src is not None:  # alternate with this tree's kvcache, run after run
            methods = tuple(m for k in methods for m in ((k, "kvcache-other") if k == "kvcache" else (k,)))
        for kind in methods:
            runs: list[Result] = []
            for i in range(repeat if kind in REPEATED else 1):
                if kind in ("kvcache", "kvcache-other"):  # a fresh data directory: a full sync, not a resume
                    run_dir = work / f"{kind}-run{i}"
                    run_dir.mkdir()
                    r = bench_kvcache(server.url, n, run_dir, timeout, *(
                        (other_src, kind) if kind == "kvcache-other" else ()))
                elif kind in ("raw", "raw-scan"):
                    r = await bench_raw(server.url, n, timeout, stall, window, scan=kind == "raw-scan")
                else:
                    r = await bench_watch(server.url, n, kind == "watch-raised", timeout, stall)
                runs.append(r)
                print(f"{r.method}: {r.seconds} ({r.note})", file=sys.stderr, flush=True)
            done = [r for r in runs if r.finished and r.seconds]
            best = min(done, key=lambda r: r.seconds) if done else runs[-1]
            if len(runs) > 1:
                best.note = (f"best of {len(runs)}: " + ", ".join(
                    f"{r.seconds:.2f}" if r.finished and r.seconds else "unfinished" for r in runs)
                    + f" s; {best.note}")
            out.results.append(best)
    finally:
        server.stop()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=int, default=100_000)
    p.add_argument("--value-size", type=int, default=100)
    p.add_argument("--chunk", type=int, default=5000, help="publishes in flight per gather")
    p.add_argument("--timeout", type=float, default=300, help="bound for each sync measurement (s)")
    p.add_argument("--stall", type=float, default=15, help="a watch silent this long has stalled (s)")
    p.add_argument("--load-timeout", type=float, default=900)
    p.add_argument("--window", type=int, default=16384, help="raw consumer: messages per pull request")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument("--repeat", type=int, default=1, help=f"runs of {', '.join(REPEATED)} (the best is kept)")
    p.add_argument("--other-src", type=Path, default=None, metavar="DIR",
                   help="also sync with the kvcache of this source tree (e.g. a worktree of an older "
                        "commit, its extensions built), after each run of this one")
    args = p.parse_args()
    methods = tuple(m for m in args.methods.split(",") if m)
    if unknown := set(methods) - set(METHODS):
        p.error(f"unknown method(s): {', '.join(sorted(unknown))}")
    exit_on_sigterm()
    with tempfile.TemporaryDirectory(prefix="kvcache-bench-") as tmp:
        out = asyncio.run(run(Path(tmp), args.keys, args.value_size, args.chunk, args.timeout,
                              args.stall, args.load_timeout, args.window, methods, args.repeat,
                              args.other_src))
    print("\n" + out.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
