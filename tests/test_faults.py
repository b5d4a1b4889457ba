"""Fault injection, end to end: real nats-server processes, real `kvcache serve` processes,
real faults (SIGKILL, SIGTERM, a stalled TCP connection, a full disk, a damaged LMDB file).

Every test runs one scenario through `run_fault`: an application reading through the sidecar
(MonotonicReads) and, where it makes sense, a writer, both running while the fault happens;
then the replica must equal the bucket (zero differences) and no key's reads may have gone
back in time (zero regressions). Each scenario adds a row to FAULT_ROWS, which conftest.py
prints as a table at the end of the run (and writes to $KVCACHE_FAULT_TABLE if set).
Failed reads are counted, not judged: they are expected while the sidecar itself is down.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import lmdb
import nats
import nats.errors
import pytest
from nats.js.api import KeyValueConfig
from support.checkers import (
    SETTLING,
    MonotonicReads,
    bucket_info,
    differences,
    kill_stream_leader,
    new_bucket,
    replica_state,
    settled,
    until,
    wait_synced,
)
from support.scrape import METRICS_ENV, metrics_address, replica_error_retries
from support.sidecar_proc import SidecarProcess
from support.topology import DelayProxy, replicated_kv, start_server

from kvcache.store.replica import FORMAT_KEY, META_DB

pytestmark = pytest.mark.timeout(180)

SMALL_MAP = {"KVCACHE_MAP_SIZE_MB": "1", "KVCACHE_MAX_MAP_SIZE_MB": "4"}
READ_KEYS = [f"k.{i:03d}" for i in range(40)]

# One row per scenario run: read by conftest.py's pytest_terminal_summary.
FAULT_ROWS: list[dict] = []


# ----------------------------------------------------------------------------- the scenario

class Writer:
    """Puts to `keys` in a loop until stopped; failures (a leader election, NATS down) are
    counted and retried, never raised."""

    def __init__(self, kv, keys: list[str]) -> None:
        self.kv, self.keys = kv, keys
        self.ok = self.failed = 0
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> Writer:
        self._task = asyncio.create_task(self._run())
        return self

    async def stop(self) -> None:
        self._stop.set()
        if self._task:
            await self._task

    async def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            try:
                await self.kv.put(self.keys[i % len(self.keys)], b"w%d" % i)
                self.ok += 1
            except (TimeoutError, nats.errors.Error, *SETTLING):
                self.failed += 1
                await asyncio.sleep(0.05)
            i += 1
            await asyncio.sleep(0.002)


async def run_fault(name: str, sc: SidecarProcess, kv, bucket: str, fault: Callable[[], Awaitable[float]],
                    *, keys: list[str] = READ_KEYS, write: bool = True, timeout: float = 60.0,
                    reads_may_fail: bool = False) -> MonotonicReads:
    """Reads (and writes, if `write`) through `fault()`, which injects the fault and returns
    the monotonic time it ended (the thaw, the servers back; for a sidecar, the moment its
    restart was launched). Then: converged, no regressions, and no failed reads unless
    `reads_may_fail` (the sidecar itself was down, or all of NATS for longer than
    max_stale_ms)."""
    writer = Writer(kv, keys) if write else None
    async with MonotonicReads(sc.socket, keys) as reads:
        if writer:
            writer.start()
        try:
            ended = await fault()
        finally:
            if writer:
                await writer.stop()
        # Recovered: caught up with the stream as it is now (cheap to poll, so the time is
        # precise) and equal to the bucket; if the first comparison still finds differences
        # (a reconcile pass under way), the time runs until they are gone.
        last = (await settled(lambda: kv._js.stream_info(kv._stream))).state.last_seq
        caught_up: AssertionError | None = None
        try:
            await until(lambda: (r := bucket_info(sc, bucket))["synced"] == 1 and r["lag_ms"] == 0
                        and r["applied_seq"] >= last, timeout, f"{bucket} caught up with {last}")
        except AssertionError as e:  # the row is still recorded; asserted below
            caught_up = e
        recovered = time.monotonic() - ended
        diff = await differences(sc.data_dir, kv, bucket, 0)
        if diff.count:
            diff = await differences(sc.data_dir, kv, bucket, timeout)
            recovered = time.monotonic() - ended
        await asyncio.sleep(0.2)  # and a few more reads of the converged replica
    FAULT_ROWS.append({
        "fault": name, "differences": diff.count, "regressions": len(reads.regressions),
        "reads": reads.reads, "failed reads": reads.failed,
        "writes": f"{writer.ok} ok / {writer.failed} failed" if writer else "-",
        "recover s": "never" if caught_up or diff.count else f"{recovered:.2f}",
    })
    assert caught_up is None, f"{name}: {caught_up}\n{sc.log()}"
    assert diff.count == 0, f"{name}: replica != bucket: {diff}\n{sc.log()}"
    assert not reads.regressions, f"{name}: {reads.summary()}\n{sc.log()}"
    assert reads.reads > 0, reads.summary()
    if not reads_may_fail:
        assert reads.failed == 0, f"{name}: {reads.summary()}\n{sc.log()}"
    assert sc.proc.poll() is None, sc.log()
    return reads


def restart_after(sc: SidecarProcess, while_down: Callable[[], Awaitable[None]] | None = None,
                  graceful: bool = False) -> Callable[[], Awaitable[float]]:
    """A fault: kill -9 the sidecar (or SIGTERM it), run `while_down`, start it again."""
    async def fault() -> float:
        await asyncio.sleep(0.3)  # reads and writes under way first
        sc.stop() if graceful else sc.kill()
        if while_down:
            await while_down()
        else:
            await asyncio.sleep(0.5)  # writes the sidecar misses
        restarted = time.monotonic()  # recovery includes the process's own start
        await asyncio.to_thread(sc.start, wait_synced=False)
        return restarted
    return fault


async def fill(kv, keys: list[str] = READ_KEYS, value: bytes = b"v0") -> None:
    await asyncio.gather(*(kv.put(k, value) for k in keys))


@pytest.fixture
async def js(nats_server_module):
    conn = await nats.connect(nats_server_module.url, connect_timeout=5, allow_reconnect=False)
    try:
        yield conn.jetstream(timeout=10)
    finally:
        await conn.close()


async def started(js, sidecars, url: str, kv_config: KeyValueConfig | None = None, **make):
    """A bucket with READ_KEYS and a synced sidecar on it."""
    b = new_bucket()
    kv = await js.create_key_value(kv_config or KeyValueConfig(bucket=b, history=64))
    b = kv._name
    await fill(kv)
    sc = sidecars(url, b, **make).start(wait_synced=False)
    await wait_synced(sc, b, keys=len(READ_KEYS))
    return b, kv, sc


# ----------------------------------------------------------------------------- the cluster

@pytest.fixture
async def cluster_js(nats_cluster):
    conn = await nats.connect(servers=nats_cluster.urls, connect_timeout=5, reconnect_time_wait=0.2,
                              max_reconnect_attempts=-1)
    try:
        yield conn.jetstream(timeout=2)
    finally:
        await conn.close()
        for s in nats_cluster.servers:  # whatever happened, leave the cluster whole
            if not s.running:
                s.start()
        nats_cluster.wait_ready()


# In both cluster scenarios JetStream cannot answer for several seconds (an election, or no
# server at all). Once the replica's last confirmed freshness is older than max_stale_ms (5 s),
# reads go to the peers, which cannot answer either, and with serve_stale off (the default)
# fail by design: so failed reads are reported there, not judged.

async def cluster_bucket(js, sidecars, nats_cluster):
    b = new_bucket()
    kv = await replicated_kv(js, bucket=b, replicas=3, history=64)
    for k in READ_KEYS:
        await settled(lambda k=k: kv.put(k, b"v0"))
    sc = sidecars(",".join(nats_cluster.urls), b).start(wait_synced=False)
    await wait_synced(sc, b, keys=len(READ_KEYS))
    return b, kv, sc


async def test_stream_leader_killed_and_restarted_during_writes(nats_cluster, cluster_js, sidecars):
    b, kv, sc = await cluster_bucket(cluster_js, sidecars, nats_cluster)

    async def fault() -> float:
        await asyncio.sleep(0.3)
        victim = await kill_stream_leader(cluster_js, nats_cluster, f"KV_{b}")
        await asyncio.sleep(1.0)  # writes to the new leader
        await start_server(victim)
        await asyncio.to_thread(nats_cluster.wait_ready)
        return time.monotonic()

    await run_fault("stream leader SIGKILL + restart during writes (R3)", sc, kv, b, fault,
                    reads_may_fail=True)
    assert bucket_info(sc, b)["resyncs"] == 0


async def test_all_cluster_servers_restarted(nats_cluster, cluster_js, sidecars):
    b, kv, sc = await cluster_bucket(cluster_js, sidecars, nats_cluster)

    async def fault() -> float:
        await asyncio.sleep(0.3)
        for s in nats_cluster.servers:
            await asyncio.to_thread(s.stop)
        await until(lambda: "disconnected from NATS" in sc.log(), 20, "the sidecar to notice")
        await asyncio.sleep(0.5)  # served from the replica alone meanwhile
        for s in nats_cluster.servers:
            await start_server(s)
        await asyncio.to_thread(nats_cluster.wait_ready)
        return time.monotonic()

    await run_fault("all 3 cluster servers restarted", sc, kv, b, fault, reads_may_fail=True)
    assert bucket_info(sc, b)["resyncs"] == 0


# ----------------------------------------------------------------------------- the connection

async def test_nats_connection_stalled_longer_than_heartbeat(nats_server_module, js, sidecars):
    proxy = DelayProxy(nats_server_module.port).start()
    try:
        b, kv, sc = await started(js, sidecars, proxy.url)

        async def fault() -> float:
            await asyncio.sleep(0.3)
            offset = len(sc.log())
            proxy.freeze()
            # 3 heartbeats of silence make the watchdog give up on the consumer; stay frozen
            # well past that, while the writer goes on writing to the server directly.
            await until(lambda: "no heartbeat" in sc.log()[offset:] or "recreating" in sc.log()[offset:],
                        20, "the feed to notice the silence")
            await asyncio.sleep(1.5)
            proxy.thaw()
            return time.monotonic()

        await run_fault("NATS connection stalled (frozen proxy) > heartbeat", sc, kv, b, fault)
    finally:
        proxy.stop()


# ----------------------------------------------------------------------------- sidecar crashes

async def test_sidecar_killed_during_initial_sync(nats_server_module, js, sidecars):
    """kill -9 in the middle of a 30k-key initial sync (slowed by a delaying proxy so there
    is a middle to hit), then a restart: the sync starts over and completes."""
    n = 30_000
    b = new_bucket()
    kv = await js.create_key_value(bucket=b)
    value = b"x" * 200
    for start in range(0, n, 2000):
        await asyncio.gather(*(js.publish(f"$KV.{b}.user.{i:06d}", value)
                               for i in range(start, min(start + 2000, n))))
    await fill(kv)
    proxy = DelayProxy(nats_server_module.port, delay=0.1).start()
    try:
        sc = sidecars(proxy.url, b)
        offset = 0

        async def fault() -> float:
            nonlocal offset
            await asyncio.to_thread(sc.start, wait_synced=False)
            at = await until(lambda: (r := bucket_info(sc, b))["keys"] > 0 and r, 30, "the sync to start")
            sc.kill()
            assert at["synced"] == 0 and at["keys"] < n + len(READ_KEYS), at  # really in the middle
            offset = len(sc.log())
            proxy.delay = 0.0
            restarted = time.monotonic()
            await asyncio.to_thread(sc.start, wait_synced=False)
            return restarted

        await run_fault("sidecar kill -9 during initial sync (30k keys)", sc, kv, b, fault,
                        reads_may_fail=True, timeout=90)
        assert "previous full sync did not finish" in sc.log()[offset:]
        assert bucket_info(sc, b)["keys"] == n + len(READ_KEYS)
    finally:
        proxy.stop()


async def test_sidecar_killed_during_live_updates(nats_server_module, js, sidecars):
    b, kv, sc = await started(js, sidecars, nats_server_module.url)
    await run_fault("sidecar kill -9 during live updates", sc, kv, b, restart_after(sc),
                    reads_may_fail=True)
    assert bucket_info(sc, b)["resyncs"] == 0


# ----------------------------------------------------------------------------- while down

async def test_deletes_and_purged_markers_while_down(nats_server_module, js, sidecars):
    b, kv, sc = await started(js, sidecars, nats_server_module.url)

    async def while_down() -> None:
        for k in READ_KEYS[:5]:
            await kv.delete(k)
        for k in READ_KEYS[5:10]:
            await kv.purge(k)
        await kv.purge_deletes(olderthan=-1)  # every marker gone: nothing left to replay
        await kv.delete(READ_KEYS[10])          # ...except this one

    await run_fault("keys deleted + delete markers purged while sidecar down", sc, kv, b,
                    restart_after(sc, while_down), write=False, reads_may_fail=True)
    assert not set(READ_KEYS[:11]) & set(replica_state(sc.data_dir, b))


async def test_ttl_expiry_while_down(nats_server_module, js, sidecars):
    b = new_bucket()
    b, kv, sc = await started(js, sidecars, nats_server_module.url,
                              KeyValueConfig(bucket=b, ttl=1.5))

    async def while_down() -> None:
        async def expired():
            return (await js.stream_info(f"KV_{b}")).state.messages == 0
        await until(expired, 30, "every key expired upstream")
        await kv.put(READ_KEYS[0], b"fresh")

    await run_fault("keys expired by bucket TTL while sidecar down", sc, kv, b,
                    restart_after(sc, while_down), write=False, reads_may_fail=True)
    assert sorted(replica_state(sc.data_dir, b)) == [READ_KEYS[0]]


async def test_stream_purged_while_down(nats_server_module, js, sidecars):
    b, kv, sc = await started(js, sidecars, nats_server_module.url)

    async def while_down() -> None:
        await js.purge_stream(f"KV_{b}")
        await kv.put(READ_KEYS[3], b"after the purge")

    await run_fault("stream purged while sidecar down", sc, kv, b, restart_after(sc, while_down),
                    write=False, reads_may_fail=True)
    assert sorted(replica_state(sc.data_dir, b)) == [READ_KEYS[3]]


# ----------------------------------------------------------------------------- the bucket

async def test_bucket_deleted_and_recreated_with_other_content(nats_server_module, js, sidecars):
    """While the sidecar runs. The new bucket's revisions start over, so other keys are
    written first to push them past the old ones: a read of the old stream's data served
    after the new stream's counts as a regression."""
    b, kv, sc = await started(js, sidecars, nats_server_module.url)
    old_top = (await js.stream_info(f"KV_{b}")).state.last_seq

    async def fault() -> float:
        await asyncio.sleep(0.3)
        await js.delete_key_value(b)
        new = await js.create_key_value(bucket=b, history=5)
        await fill(new, [f"other.{i}" for i in range(old_top + 10)], b"new bucket")
        await fill(new, READ_KEYS[::2], b"new bucket")  # half the old keys come back
        return time.monotonic()

    # `kv` names the bucket by name: it reads the new one as well as it read the old.
    await run_fault("bucket deleted + recreated with other content", sc, kv, b, fault, write=False)
    assert bucket_info(sc, b)["resyncs"] == 1
    assert not set(READ_KEYS[1::2]) & set(replica_state(sc.data_dir, b))


# ----------------------------------------------------------------------------- space

async def test_map_grows_then_fills_up(nats_server_module, js, sidecars):
    """The map starts at 1 MiB and may grow to 4: 2 MB of values fit (it grows), 5.4 MB more
    do not (a clear error; the feed stops without skipping and the replica keeps serving what
    it has). A restart with room converges."""
    b, kv, sc = await started(js, sidecars, nats_server_module.url, env={**SMALL_MAP, **METRICS_ENV})
    metrics = metrics_address(sc)
    offset = 0

    async def fault() -> float:
        nonlocal offset
        for i in range(2):
            await kv.put(f"grow.{i}", os.urandom(1_000_000))
        await until(lambda: "grow.1" in replica_state(sc.data_dir, b), 30, "the map to grow")
        for i in range(6):
            await kv.put(f"big.{i}", os.urandom(900_000))
        await until(lambda: replica_error_retries(metrics, b) >= 2, 30, "the map to fill up")
        assert "may not grow beyond max_map_size_mb=4" in sc.log()
        assert "big.5" not in replica_state(sc.data_dir, b)
        assert sc.proc.poll() is None
        sc.kill()
        offset = len(sc.log())
        sc.env = {k: v for k, v in sc.env.items() if k not in SMALL_MAP}  # room: default map size
        restarted = time.monotonic()
        await asyncio.to_thread(sc.start, wait_synced=False)
        return restarted

    await run_fault("LMDB map full (1 MiB, max 4 MiB), then restart with room", sc, kv, b, fault,
                    reads_may_fail=True)
    assert "full resync" not in sc.log()[offset:]


@pytest.fixture
def small_disk(tmp_path):
    """A 6 MiB tmpfs, unmounted at the end (ask for it before `sidecars`, so that the
    sidecars on it are killed first)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs to fill up needs root")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:  # root and still refused: say so, a skip would hide the fault untested
        pytest.fail(f"cannot mount a tmpfs to fill up: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


async def test_disk_full(small_disk, nats_server_module, js, sidecars):
    """The data dir on a tmpfs that fills up: the feed reports a clear error and retries, the
    sidecar keeps serving what it has, and it converges once space is freed."""
    # The data dir is the mount itself: the sidecar's log goes next to it, not onto it.
    b, kv, sc = await started(js, sidecars, nats_server_module.url, data_dir=small_disk)
    filler = small_disk / "filler"

    async def fault() -> float:
        free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
        with open(filler, "wb") as f:  # all but 64 KiB
            f.write(b"\0" * max(0, free - 65536))
        for i in range(8):
            await kv.put(f"big.{i}", os.urandom(200_000))
        await until(lambda: "disk full?" in sc.log(), 30, "a disk full error")
        assert sc.proc.poll() is None
        with sc.client() as c:  # still serving what it has
            assert c.get(f"{b}:{READ_KEYS[0]}") is not None
        assert "big.7" not in replica_state(sc.data_dir, b)
        filler.unlink()
        return time.monotonic()

    await run_fault("disk full (tmpfs), then space freed", sc, kv, b, fault)
    assert bucket_info(sc, b)["resyncs"] == 0


# ----------------------------------------------------------------------------- a damaged replica

def truncate(data: Path) -> None:
    os.truncate(data, data.stat().st_size // 3)


def scribble(data: Path) -> None:
    """Random bytes over the middle half of the file: B-tree pages become garbage."""
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.seek(size // 4)
        f.write(os.urandom(size // 2))


def zero_pages(data: Path) -> None:
    """Zeros over the middle half (pages lost to a crash): LMDB's cursor aborts the process
    on such a page rather than report it."""
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.seek(size // 4)
        f.write(bytes(size // 2))


def old_format(data: Path) -> None:
    env = lmdb.open(str(data.parent), max_dbs=8)
    with env.begin(write=True, db=env.open_db(META_DB)) as txn:
        txn.put(FORMAT_KEY, b"0")
    env.close()


@pytest.mark.parametrize("damage", [truncate, scribble, zero_pages, old_format], ids=lambda f: f.__name__)
async def test_damaged_replica_is_rebuilt(nats_server_module, js, sidecars, damage):
    b, kv, sc = await started(js, sidecars, nats_server_module.url)
    await fill(kv, [f"more.{i:05d}" for i in range(3000)], b"x" * 100)  # a few hundred pages
    await wait_synced(sc, b, keys=3000 + len(READ_KEYS))
    offset = 0

    async def while_down() -> None:
        nonlocal offset
        offset = len(sc.log())
        damage(sc.data_dir / "replica" / "data.mdb")

    await run_fault(f"replica damaged while down: {damage.__name__}", sc, kv, b,
                    restart_after(sc, while_down, graceful=True), reads_may_fail=True)
    said = sc.log()[offset:]
    assert "it will be rebuilt from NATS" in said, said
    assert ("is in format 0" if damage is old_format else "is damaged") in said, said
    assert bucket_info(sc, b)["keys"] == 3000 + len(READ_KEYS)
