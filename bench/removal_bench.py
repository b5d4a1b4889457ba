"""Removals with no message, on a big bucket: what seeing them costs a running sidecar, and how
soon a removed key stops being served.

A measurement script, not a test. It starts its own nats-server (loopback, temporary
directory), loads N keys (100-byte values; 1,000,000 by default) into a KV bucket whose stream
takes per-message TTLs, starts `kvcache serve` on it, and measures in one run:

  idle        the sidecar's CPU per second and STREAM.INFO requests per second over a quiet
              window (the state poll runs every max_stale_ms / 4; heartbeats and the rest of
              the idle work are in the CPU figure too, so it bounds the poll's cost);
  ttl         100 keys put with `Nats-TTL: 2s`: the time from each key's deadline (its
              creation time as KV.GET reports it, plus 2 s) to the first nil read (an MGET of
              the 100 every 2 ms), and the number of reads after a deadline that still got a
              value (must be 0);
  limits      the stream switched to discard `old` with max_msgs 1,000 below its size, then
              one put: about 1,000 of the oldest messages leave the front; time until none of
              those keys is served, and the sidecar's CPU for it (one pass over the replica);
  subject     a one-subject purge (`STREAM.PURGE` with a filter): time until not served;
  purge       a whole-stream purge: time until no key is served.

    python bench/removal_bench.py                 # 1,000,000 keys
    python bench/removal_bench.py --keys 10000

Everything is bounded in time, and every process it starts is stopped by its own PID.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import nats
import redis
from nats.js.api import DiscardPolicy

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from socket_bench import cpu_seconds, exit_on_sigterm, stop, wait_until, work_dir
from sync_bench import BUCKET, load

from kvcache.natsio.nats_server import NatsServer, die_with_parent

SEC = 1_000_000_000
STREAM = f"KV_{BUCKET}"


def key(i: int) -> str:
    return f"{BUCKET}:k.{i:08d}"  # sync_bench.load's keys, addressed to the bucket


def buckets_row(r: redis.Redis) -> dict:
    """INFO buckets' row of the bench bucket (redis-py parses `a=1,b=2` into a dict)."""
    return r.info("buckets").get(BUCKET, {})


def pass_done(r: redis.Redis, t0: float) -> float:
    """Seconds from t0 until INFO's removed_upstream has stopped moving (unchanged for 1 s)."""
    last, same, at = None, 0, time.monotonic()
    while same < 10:
        now = buckets_row(r).get("removed_upstream")
        if now != last:
            last, same, at = now, 0, time.monotonic()
        else:
            same += 1
        time.sleep(0.1)
    return at - t0


async def until_gone(r: redis.Redis, names: list[str], timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if not any(v is not None for v in r.mget(names)):
            return time.monotonic() - t0
        await asyncio.sleep(0.002)
    raise TimeoutError(f"still served after {timeout}s")


async def run(work: Path, n: int, idle_s: float) -> None:
    server = NatsServer(work / "js", server_name="bench", max_file_store="32GB")
    server.start()
    proc = None
    try:
        t = await load(server.url, n, 100, 5000, time.monotonic() + 1800)
        print(f"loaded {n:,} keys in {t:.1f}s", flush=True)
        nc = await nats.connect(server.url, connect_timeout=5, allow_reconnect=False)
        js = nc.jetstream(timeout=60)
        cfg = (await js.stream_info(STREAM)).config
        cfg.allow_msg_ttl = True
        await js.update_stream(cfg)

        sock = str(work / "kvcache.sock")
        log = open(work / "sidecar.log", "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvcache", "serve", "--nats", server.url, "--bucket", BUCKET,
             "--data-dir", str(work / "data"), "--socket", sock, "--log-level", "info"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
            preexec_fn=die_with_parent)
        log.close()
        r = redis.Redis(unix_socket_path=sock, socket_timeout=120)
        wait_until(lambda: os.path.exists(sock) and buckets_row(r).get("keys") == n
                   and buckets_row(r).get("synced") == 1, 600, "kvcache synced")

        # idle: the poll's cost bounded by everything the sidecar does when nothing happens
        time.sleep(2)
        c0, p0, t0 = cpu_seconds(proc.pid), int(buckets_row(r)["state_polls"]), time.monotonic()
        time.sleep(idle_s)
        c1, p1, t1 = cpu_seconds(proc.pid), int(buckets_row(r)["state_polls"]), time.monotonic()
        idle_rate = (c1 - c0) / (t1 - t0)
        print(f"idle ({n:,} keys, {t1 - t0:.0f}s): sidecar CPU {100 * (c1 - c0) / (t1 - t0):.2f}% of a core, "
              f"STREAM.INFO {(p1 - p0) / (t1 - t0):.2f}/s (whole sidecar: heartbeats and all)", flush=True)

        # ttl: 100 keys with Nats-TTL 2s
        names = [f"{BUCKET}:t.{i:03d}" for i in range(100)]
        for name in names:
            await js.publish("$KV." + name.replace(":", "."), b"t" * 100, headers={"Nats-TTL": "2s"})
        wait_until(lambda: r.exists(*names) == len(names), 60, "TTL keys replicated")
        due = [int(r.execute_command("KV.GET", nm)[2]) + 2 * SEC for nm in names]
        first_nil: dict[int, float] = {}
        late = 0
        end = time.monotonic() + 30
        while len(first_nil) < len(names) and time.monotonic() < end:
            sent = time.time_ns()
            for i, v in enumerate(r.mget(names)):
                if v is None:
                    first_nil.setdefault(i, (time.time_ns() - due[i]) / 1e6)
                elif sent >= due[i]:
                    late += 1
            await asyncio.sleep(0.002)
        lat = sorted(first_nil.values())
        print(f"ttl: 100 keys, deadline -> first nil p50 {lat[len(lat) // 2]:.2f} ms, "
              f"p99 {lat[int(0.99 * (len(lat) - 1))]:.2f} ms, max {lat[-1]:.2f} ms; "
              f"reads after a deadline that got a value: {late}", flush=True)

        # limits: the oldest 1,001 messages leave the front
        info = await js.stream_info(STREAM)
        cfg = info.config
        cfg.discard = DiscardPolicy.OLD
        cfg.max_msgs = info.state.messages - 1000
        await js.update_stream(cfg)
        c0 = cpu_seconds(proc.pid)
        t0 = time.monotonic()
        await js.publish(f"$KV.{BUCKET}.extra", b"x")
        first = (await js.stream_info(STREAM)).state.first_seq  # key(i) is sequence i + 1
        gone = [key(i) for i in range(0, first - 1, max(1, (first - 1) // 40))] + [key(first - 2)]
        took = await until_gone(r, gone, 120)
        settled = pass_done(r, t0)
        cpu = cpu_seconds(proc.pid) - c0 - idle_rate * (time.monotonic() - t0)
        print(f"limits: {first - 1:,} keys off the front of {n:,}: not served after {took * 1000:.0f} ms; "
              f"the pass over the replica ended within {settled * 1000:.0f} ms and cost "
              f"{1000 * cpu:.0f} ms of sidecar CPU (idle rate subtracted)", flush=True)
        assert r.get(key(first - 1)) is not None
        assert r.get(key(n - 1)) is not None

        # one-subject purge
        t0 = time.monotonic()
        await js.purge_stream(STREAM, subject=f"$KV.{BUCKET}.k.{n - 1:08d}")
        took = await until_gone(r, [key(n - 1)], 60)
        print(f"one-subject purge: not served after {took * 1000:.0f} ms", flush=True)

        # whole-stream purge
        sample = [key(i) for i in range(first - 1, n - 1, max(1, n // 50))]
        t0 = time.monotonic()
        await js.purge_stream(STREAM)
        took = await until_gone(r, sample, 120)
        print(f"whole-stream purge of {n:,} keys: not served after {took * 1000:.0f} ms; "
              f"INFO: {buckets_row(r)}", flush=True)
        await nc.close()
    finally:
        stop(proc)
        server.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=int, default=1_000_000)
    p.add_argument("--idle", type=float, default=20.0, help="seconds of the idle window")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    a = p.parse_args()
    exit_on_sigterm()
    with work_dir("kvcache-removal-", lambda: a.keep) as work:
        asyncio.run(run(work, a.keys, a.idle))
    return 0


if __name__ == "__main__":
    sys.exit(main())
