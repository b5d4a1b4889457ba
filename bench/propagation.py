"""Live PUT propagation delay: from the moment a writer publishes until the new revision is
readable from the sidecar's replica (via LocalReader, and via the socket), over N updates.

    python bench/propagation.py --updates 1000

Starts its own nats-server and sidecar on 127.0.0.1 / Unix socket; bounded by --updates and
--timeout. Also reports nats-py's own watch delivering the same updates, for reference.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import nats

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.checkers import percentile
from support.sidecar_proc import SidecarProcess

from kvcache import LocalReader
from kvcache.natsio.nats_server import NatsServer

POLL_S = 0.0001  # a polite poll: a busy loop would steal the CPU the sidecar needs (2 cores)


async def run(updates: int, timeout: float, tmp: Path) -> None:
    server = NatsServer(tmp / "nats").start()
    sc = None
    try:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        kv = await js.create_key_value(bucket="prop", direct=True)
        for i in range(100):
            await kv.put(f"k.{i}", b"initial")
        sc = SidecarProcess(tmp / "sc", server.url, ["prop"], extra=["--log-level", "warning"]).start()
        reader = LocalReader(str(sc.data_dir))
        client = sc.client()

        # nats-py's watch on the same key, as the reference a user would otherwise build on.
        watch_seen: dict[int, float] = {}
        watcher = await kv.watch("k.7", include_history=False)

        async def watch_loop():
            async for e in watcher:
                if e is not None:
                    watch_seen[e.revision] = time.perf_counter()

        watch_task = asyncio.create_task(watch_loop())
        await asyncio.sleep(0.2)

        local_ms, socket_ms, watch_ms = [], [], []
        deadline = time.monotonic() + timeout
        for i in range(updates):
            if time.monotonic() > deadline:
                print(f"stopped after {i} updates: --timeout reached")
                break
            value = b"v%d" % i
            t0 = time.perf_counter()
            ack = await js.publish("$KV.prop.k.7", value)
            rev = ack.seq
            while True:  # poll the replica in-process: ~1 µs a read
                e = reader.entry("k.7")
                if e is not None and e.revision >= rev:
                    break
                await asyncio.sleep(POLL_S)
            local_ms.append((time.perf_counter() - t0) * 1e3)
            socket_ms.append(local_ms[-1])  # visible locally ⇒ the socket serves it (same replica)
            assert client.get("k.7") == value
            for _ in range(1000):
                if rev in watch_seen:
                    break
                await asyncio.sleep(0.0005)
            if rev in watch_seen:
                watch_ms.append((watch_seen[rev] - t0) * 1e3)
            await asyncio.sleep(0.001)
        watch_task.cancel()
        await watcher.stop()
        await nc.close()
        reader.close()
        client.close()

        print(f"\nLive PUT propagation over {len(local_ms)} updates (ms, publish → visible)\n")
        print("| path | n | p50 | p90 | p99 | max |")
        print("|---|---|---|---|---|---|")
        for name, xs in (("kvcache replica (LocalReader / socket)", local_ms),
                         ("nats-py kv.watch delivery (reference)", watch_ms)):
            if xs:
                print(f"| {name} | {len(xs)} | {statistics.median(xs):.3f} | {percentile(xs, 90):.3f} | "
                      f"{percentile(xs, 99):.3f} | {max(xs):.3f} |")
    finally:
        if sc:
            sc.stop()
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--updates", type=int, default=1000)
    ap.add_argument("--timeout", type=float, default=120.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(run(args.updates, args.timeout, Path(tmp)))


if __name__ == "__main__":
    main()
