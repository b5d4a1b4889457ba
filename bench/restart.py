"""`kill -9` then restart: does the sidecar resume (no full resync) with every change made while
it was down? Prints the time to catch up and a verification of every changed key.

    python bench/restart.py --keys 100000 --changes 2000

Starts its own nats-server and sidecar (loopback / Unix socket); bounded by --timeout.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import nats

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.sidecar_proc import SidecarProcess

from kvcache import LocalReader
from kvcache.natsio.nats_server import NatsServer


async def publish_all(js, items, chunk: int = 2000) -> None:
    for i in range(0, len(items), chunk):
        await asyncio.gather(*(js.publish(s, v) for s, v in items[i : i + chunk]))


async def run(keys: int, changes: int, timeout: float, tmp: Path) -> int:
    server = NatsServer(tmp / "nats").start()
    sc = SidecarProcess(tmp / "sc", server.url, ["rs"], extra=["--log-level", "info"])
    try:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        kv = await js.create_key_value(bucket="rs", direct=True, history=1)
        await publish_all(js, [(f"$KV.rs.k.{i}", b"v0-%d" % i) for i in range(keys)])
        sc.start(timeout=timeout)
        before = sc.buckets()["rs"]
        print(f"synced {before['keys']} keys, applied_seq={before['applied_seq']}")

        sc.kill()
        print("sidecar killed with SIGKILL")
        step = max(1, keys // changes)
        updated = [f"k.{i}" for i in range(0, keys, step)][:changes]
        deleted = [f"k.{i}" for i in range(1, keys, step)][: changes // 10]
        purged = [f"k.{i}" for i in range(2, keys, step)][: changes // 10]
        created = [f"new.{i}" for i in range(changes // 10)]
        await publish_all(js, [(f"$KV.rs.{k}", b"v1-" + k.encode()) for k in updated + created])
        for k in deleted:
            await kv.delete(k)
        for k in purged:
            await kv.purge(k)
        print(f"while down: {len(updated)} updated, {len(created)} created, "
              f"{len(deleted)} deleted, {len(purged)} purged")

        t0 = time.perf_counter()
        sc.start(timeout=timeout)
        caught_up = time.perf_counter() - t0
        after = sc.buckets()["rs"]
        resumed = "resuming after sequence" in sc.log()

        wrong = 0
        with LocalReader(str(sc.data_dir)) as r:
            for k in updated + created:
                wrong += r.get(k) != b"v1-" + k.encode()
            for k in deleted + purged:
                wrong += r.get(k) is not None
            expected_keys = keys + len(created) - len(deleted) - len(purged)
        await nc.close()

        print("\n| check | result |\n|---|---|")
        print(f"| restart → synced (process start, resume, catch-up) | {caught_up:.2f} s |")
        print(f"| resumed from stored sequence (log) | {resumed} |")
        print(f"| full resyncs (INFO resyncs) | {after['resyncs']} |")
        print(f"| keys after restart / expected | {after['keys']} / {expected_keys} |")
        changed = len(updated) + len(created) + len(deleted) + len(purged)
        print(f"| changed keys wrong or missing | {wrong} of {changed} |")
        ok = resumed and after["resyncs"] == 0 and wrong == 0 and after["keys"] == expected_keys
        print(f"\n{'PASS' if ok else 'FAIL'}")
        return 0 if ok else 1
    finally:
        sc.kill()
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--changes", type=int, default=2000)
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sys.exit(asyncio.run(run(args.keys, args.changes, args.timeout, Path(tmp))))


if __name__ == "__main__":
    main()
