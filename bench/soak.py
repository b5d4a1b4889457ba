"""Soak: mixed writes upstream, reads through the sidecar, faults on a schedule; at the end the
checkers (tests/checkers.py) say whether the replica is the bucket and whether any key's
reads went back in time. Loopback only, bounded in time.

    python bench/soak.py --minutes 10

Starts a 3-node JetStream cluster with an R3 bucket; the sidecar reaches the cluster through
delaying proxies (no delay; they exist to freeze its connection). A writer puts, deletes and
purges keys at --write-rate; two readers `KV.GET` the keys through the sidecar the whole time
(MonotonicReads). Every --fault-every seconds the next fault of the cycle is injected:

  leader-kill     the stream leader SIGKILLed, restarted 5 s later
  sidecar-kill9   the sidecar SIGKILLed, restarted at once (warm restart)
  conn-freeze     the sidecar's connections frozen 3 heartbeats, then released
  server-restart  a cluster member that is not the stream leader stopped and restarted
  purge-deletes   the sidecar killed, every delete marker purged upstream, the sidecar
                  restarted (its reconcile pass must drop what vanished)
  sidecar-term    the sidecar stopped gracefully (SIGTERM) and restarted

After each fault a marker key is written; its time to recover is until the sidecar serves it.
At the end the writer stops, the replica must converge (every key, value and revision),
and a staleness probe measures replication lag at 1,000 writes/s.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import nats
import nats.errors
import nats.js.errors

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.checkers import SETTLING, MonotonicReads, differences, lag_probe, percentile, settled
from support.sidecar_proc import SidecarProcess
from support.topology import ProxyHost, replicated_kv, start_cluster

from kvcache.app.client import AsyncClient, KvcacheError

BUCKET = "soak"
HEARTBEAT_MS = 1000
FAULTS = ["leader-kill", "sidecar-kill9", "conn-freeze", "server-restart", "purge-deletes", "sidecar-term"]


@dataclass
class FaultRow:
    name: str
    injected: int = 0
    recover_s: list[float] = field(default_factory=list)
    failed_reads: int = 0
    regressions: int = 0


@dataclass
class Writes:
    ok: int = 0
    failed: int = 0
    by_op: dict[str, int] = field(default_factory=dict)


class Soak:
    def __init__(self, tmp: Path, keys: int, write_rate: float, fault_every: float) -> None:
        self.tmp = tmp
        self.keys = [f"k.{i:05d}" for i in range(keys)]
        self.write_rate = write_rate
        self.fault_every = fault_every
        self.writes = Writes()
        self.writer_conn_errors = 0
        self.rows = {name: FaultRow(name) for name in FAULTS}
        self.rng = random.Random(7)
        self.cluster = None
        self.proxies: ProxyHost | None = None
        self.sc: SidecarProcess | None = None
        self.nc = None
        self.js = None
        self.kv = None

    # ------------------------------------------------------------------ set-up

    async def setup(self) -> None:
        self.cluster = await asyncio.to_thread(start_cluster, self.tmp / "hub", 3, "hub")
        async def quiet(e: Exception) -> None:  # a server being down is the point: count it
            self.writer_conn_errors += 1

        self.nc = await nats.connect(servers=self.cluster.urls, connect_timeout=5, reconnect_time_wait=0.2,
                                     max_reconnect_attempts=-1, error_cb=quiet)
        self.js = self.nc.jetstream(timeout=5)
        self.kv = await replicated_kv(self.js, bucket=BUCKET, replicas=3, history=5)
        for key in self.keys:
            await settled(lambda key=key: self.kv.put(key, b"v0"))
        self.proxies = await asyncio.to_thread(
            ProxyHost, {s.server_name: s.port for s in self.cluster.servers},
            {s.server_name: 0.0 for s in self.cluster.servers})
        self.sc = SidecarProcess(self.tmp / "sc", ",".join(self.proxies.urls.values()), buckets=[BUCKET],
                          extra=["--heartbeat-ms", str(HEARTBEAT_MS), "--log-level", "warning"])
        await asyncio.to_thread(self.sc.start)

    async def teardown(self) -> None:
        if self.sc:
            self.sc.kill()
        if self.nc:
            await self.nc.close()
        if self.proxies:
            await asyncio.to_thread(self.proxies.stop)
        if self.cluster:
            await asyncio.to_thread(self.cluster.stop)

    # ------------------------------------------------------------------ load

    async def writer(self, stop: asyncio.Event) -> None:
        """Puts (80%), deletes (15%) and purges (5%) of random keys at write_rate, in order."""
        t0 = time.monotonic()
        i = 0
        while not stop.is_set():
            due = t0 + i / self.write_rate
            if (delay := due - time.monotonic()) > 0:
                await asyncio.sleep(delay)
            i += 1
            key = self.rng.choice(self.keys)
            r = self.rng.random()
            op = "put" if r < 0.80 else "delete" if r < 0.95 else "purge"
            try:
                if op == "put":
                    await self.kv.put(key, b"v%d" % i)
                elif op == "delete":
                    await self.kv.delete(key)
                else:
                    await self.kv.purge(key)
                self.writes.ok += 1
                self.writes.by_op[op] = self.writes.by_op.get(op, 0) + 1
            except (TimeoutError, *SETTLING, nats.errors.Error):
                self.writes.failed += 1   # a leader election: the write did not happen, or did
                await asyncio.sleep(0.05)

    # ------------------------------------------------------------------ faults

    async def inject(self, name: str) -> float:
        """Inject one fault; returns when it was lifted (time.monotonic()): the server or
        sidecar restarted, the connection released."""
        if name == "leader-kill":
            return await self._bounce(self.cluster.server(await self._leader()), down_s=5, kill=True)
        if name == "server-restart":
            leader = await self._leader()
            follower = next(s for s in self.cluster.servers if s.server_name != leader)
            return await self._bounce(follower, down_s=2, kill=False)
        if name == "conn-freeze":
            for n in self.proxies.urls:
                self.proxies.do("freeze", n)
            await asyncio.sleep(3 * HEARTBEAT_MS / 1000)
            lifted = time.monotonic()
            for n in self.proxies.urls:
                self.proxies.do("thaw", n)
            return lifted
        if name == "sidecar-kill9":
            return await self._restart_sidecar(graceful=False)
        if name == "purge-deletes":
            # While the sidecar is down: a purge removes messages without a KV operation the
            # feed could follow, so only the reconcile pass at start can notice (and a purge
            # racing a put removes a live value: upstream's truth, which the replica must follow).
            return await self._restart_sidecar(
                graceful=False, while_down=lambda: settled(lambda: self.kv.purge_deletes(olderthan=-1)))
        assert name == "sidecar-term", name
        return await self._restart_sidecar(graceful=True)

    async def _leader(self) -> str:
        return (await settled(lambda: self.js.stream_info(f"KV_{BUCKET}"))).cluster.leader

    async def _bounce(self, server, down_s: float, kill: bool) -> float:
        """Take a cluster member down (SIGKILL or SIGTERM) for `down_s`, then back."""
        if kill:
            server.kill()
        else:
            await asyncio.to_thread(server.stop)
        await asyncio.sleep(down_s)
        lifted = time.monotonic()
        await asyncio.to_thread(server.start)
        await asyncio.to_thread(self.cluster.wait_ready, 60)
        return lifted

    async def _restart_sidecar(self, graceful: bool, while_down=None) -> float:
        """Stop the sidecar (SIGTERM or SIGKILL), run `while_down`, start it again."""
        if graceful:
            await asyncio.to_thread(self.sc.stop)
        else:
            self.sc.kill()
        if while_down is not None:
            await while_down()
        lifted = time.monotonic()
        await asyncio.to_thread(self.sc.start, False)
        return lifted

    async def recovered(self, n: int, lifted: float, timeout: float = 120.0) -> float:
        """Seconds from the fault's end (`lifted`) until a marker written now is served."""
        t0 = time.monotonic()
        marker = b"%d" % n
        await settled(lambda: self.kv.put("soak.marker", marker))
        client = AsyncClient(self.sc.socket, timeout=5)
        try:
            while time.monotonic() - t0 < timeout:
                try:
                    if await client.get("soak.marker") == marker:
                        return time.monotonic() - lifted
                except KvcacheError:
                    pass
                await asyncio.sleep(0.01)
            return float("inf")
        finally:
            await client.aclose()

    # ------------------------------------------------------------------ the run

    async def run(self, seconds: float) -> dict:
        await self.setup()
        try:
            stop = asyncio.Event()
            writing = asyncio.create_task(self.writer(stop))
            reads = MonotonicReads(self.sc.socket, [*self.keys[:500], "soak.marker"], clients=2, pause_s=0.001)
            reads.start()
            t_end = time.monotonic() + seconds
            n = 0
            while time.monotonic() + self.fault_every < t_end:
                await asyncio.sleep(self.fault_every / 2)
                name = FAULTS[n % len(FAULTS)]
                row = self.rows[name]
                failed0, regress0 = reads.failed, len(reads.regressions)
                print(f"[{time.strftime('%H:%M:%S')}] fault {n + 1}: {name}", flush=True)
                lifted = await self.inject(name)
                row.recover_s.append(await self.recovered(n, lifted))
                row.injected += 1
                row.failed_reads += reads.failed - failed0
                row.regressions += len(reads.regressions) - regress0
                n += 1
                await asyncio.sleep(max(0.0, self.fault_every / 2 - row.recover_s[-1]))
            await asyncio.sleep(max(0.0, t_end - time.monotonic()))
            stop.set()
            await writing
            diff = await differences(self.sc.data_dir, self.kv, BUCKET, timeout=120)
            await reads.stop()
            lag = await lag_probe(self.js, BUCKET, self.sc.socket, rate=1000, seconds=10)
            return {"seconds": seconds, "faults": n, "writes": self.writes, "reads": reads.reads,
                    "failed_reads": reads.failed, "regressions": reads.regressions,
                    "differences": diff, "lag": lag, "rows": list(self.rows.values())}
        finally:
            await self.teardown()


def report(res: dict) -> None:
    w, diff, lag = res["writes"], res["differences"], res["lag"]
    print(f"\nsoak: {res['seconds'] / 60:.1f} min, {res['faults']} faults, {w.ok} writes "
          f"({', '.join(f'{k} {v}' for k, v in sorted(w.by_op.items()))}; {w.failed} refused during "
          f"elections), {res['reads']} reads through the sidecar\n")
    print("| fault | injected | time to recover p50 / max (s) | failed reads | read regressions |")
    print("|---|---:|---:|---:|---:|")
    for row in res["rows"]:
        if row.injected:
            print(f"| {row.name} | {row.injected} | {percentile(row.recover_s, 50):.2f} / "
                  f"{max(row.recover_s):.2f} | {row.failed_reads} | {row.regressions} |")
    print(f"| **total** | {res['faults']} | | {res['failed_reads']} | {len(res['regressions'])} |")
    print(f"\ndifferences after the run (replica vs bucket, every key, value and revision): {diff}")
    print(f"read regressions: {len(res['regressions'])} {res['regressions'][:5]}")
    print(f"replication lag at the end: {lag}")
    ok = diff.count == 0 and not res["regressions"]
    print("\nverdict: " + ("zero differences, zero regressions" if ok else "FAILED"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--keys", type=int, default=2000)
    ap.add_argument("--write-rate", type=float, default=200.0, help="writes/s during the soak")
    ap.add_argument("--fault-every", type=float, default=40.0, help="seconds between faults")
    ap.add_argument("--json", metavar="FILE", help="also write the summary as JSON")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvsoak-") as d:
        res = asyncio.run(Soak(Path(d), args.keys, args.write_rate, args.fault_every).run(args.minutes * 60))
    report(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=lambda o: getattr(o, "__dict__", str(o))))
    sys.exit(0 if res["differences"].count == 0 and not res["regressions"] else 1)


if __name__ == "__main__":
    main()
