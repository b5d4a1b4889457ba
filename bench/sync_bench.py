"""Initial sync speed: kvcache's feed against nats-py's `kv.watchall()`.

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
      pending_bytes_limit=0 (0 disables nats-py's byte limit).

Everything is bounded in time, and every process it starts is stopped by its own PID.

    python bench/sync_bench.py --keys 100000
    python bench/sync_bench.py --keys 1000000
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import nats
import nats.errors

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvcache.client import Client, ConnectionFailed  # noqa: E402
from kvcache.natsserver import NatsServer  # noqa: E402

BUCKET = "bench"


@dataclass
class Result:
    method: str
    keys: int
    seconds: float | None
    finished: bool
    note: str = ""


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

def bench_kvcache(url: str, n: int, work: Path, timeout: float) -> Result:
    data_dir = work / "kvcache"
    sock = str(work / "kvcache.sock")
    log_path = work / "kvcache.log"
    args = [sys.executable, "-m", "kvcache", "serve", "--nats", url, "--bucket", BUCKET,
            "--data-dir", str(data_dir), "--socket", sock, "--log-level", "info"]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log_path, "ab") as log:
        t0 = time.monotonic()
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env)
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
                return Result("kvcache serve (process start to synced)", n, seconds, True,
                              f"feed's own log: {note}" if note else "")
            time.sleep(0.02)
        return Result("kvcache serve (process start to synced)", state.get("keys", 0), None, False,
                      f"not synced after {timeout:.0f}s: {state}")
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
                except asyncio.TimeoutError:
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
            except Exception:  # noqa: BLE001 - the measurement is done either way
                pass
        note = f"{count} entries before the end marker"
        if not finished:
            note = f"no end marker ({reason}); got {count} entries"
        if slow:
            note += f"; {slow} slow-consumer drops reported"
        return Result(label, count, seconds if finished else None, finished, note)
    finally:
        try:
            await asyncio.wait_for(nc.close(), 10)
        except Exception:  # noqa: BLE001
            pass


# ----------------------------------------------------------------------------- report

def versions() -> str:
    from importlib.metadata import version

    from kvcache.natsserver import find_binary
    try:
        server = subprocess.run([find_binary(), "--version"], capture_output=True, text=True,
                                timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        server = "nats-server ?"
    return f"{server}, nats-py {version('nats-py')}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs"


def table(results: list[Result], n: int, reference: Result | None) -> str:
    ref = reference.seconds if reference and reference.finished else None
    lines = ["| method | keys | seconds | keys/s | ratio vs nats-py (raised limits) |",
             "|---|---:|---:|---:|---:|"]
    for r in results:
        secs = f"{r.seconds:.2f}" if r.finished and r.seconds else "did not finish"
        rate = f"{n / r.seconds:,.0f}" if r.finished and r.seconds else "-"
        ratio = f"{ref / r.seconds:.2f}x" if ref and r.finished and r.seconds else "-"
        lines.append(f"| {r.method} | {r.keys:,} | {secs} | {rate} | {ratio} |")
    notes = [f"- {r.method}: {r.note}" for r in results if r.note]
    return "\n".join(lines + [""] + notes)


async def main_async(args: argparse.Namespace) -> int:
    n = args.keys
    with tempfile.TemporaryDirectory(prefix="kvcache-bench-") as tmp:
        work = Path(tmp)
        server = NatsServer(work / "js", server_name="bench", max_file_store="32GB")
        server.start()
        try:
            load_s = await load(server.url, n, args.value_size, args.chunk,
                                time.monotonic() + args.load_timeout)
            print(f"loaded {n:,} keys ({args.value_size} B values) in {load_s:.1f}s "
                  f"({n / load_s:,.0f} publishes/s); {versions()}", flush=True)
            results = [bench_kvcache(server.url, n, work, args.timeout)]
            print(f"kvcache: {results[-1].seconds}", flush=True)
            default = await bench_watch(server.url, n, False, args.timeout, args.stall)
            print(f"watch default: {default.seconds} ({default.note})", flush=True)
            raised = await bench_watch(server.url, n, True, args.timeout, args.stall)
            print(f"watch raised: {raised.seconds} ({raised.note})", flush=True)
            results += [default, raised]
        finally:
            server.stop()
    print()
    print(f"### initial sync, {n:,} keys, {args.value_size} B values, loopback\n")
    print(table(results, n, raised))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=int, default=100_000)
    p.add_argument("--value-size", type=int, default=100)
    p.add_argument("--chunk", type=int, default=5000, help="publishes in flight per gather")
    p.add_argument("--timeout", type=float, default=300, help="bound for each sync measurement (s)")
    p.add_argument("--stall", type=float, default=15, help="a watch silent this long has stalled (s)")
    p.add_argument("--load-timeout", type=float, default=900)
    args = p.parse_args()
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
