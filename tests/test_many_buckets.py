"""Many buckets in one sidecar: per-tenant buckets are a common NATS pattern. 300 buckets
need 601 LMDB databases, past the 256 the replica used to be opened with (MDB_DBS_FULL and a
traceback at start, or in a LocalReader reading them all)."""
from __future__ import annotations

import asyncio

import nats
import pytest
from nats.js.api import DiscardPolicy
from support.poll import wait_until
from support.sidecar_proc import SidecarProcess

from kvcache import LocalReader

BUCKETS = 300  # 601 databases

pytestmark = pytest.mark.timeout(240)


async def _make_buckets(url: str) -> None:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        for i in range(0, BUCKETS, 25):
            kvs = await asyncio.gather(*(js.create_key_value(bucket=f"tenant{j:03d}")
                                         for j in range(i, min(i + 25, BUCKETS))))
            await asyncio.gather(*(kv.put("k", b"v%d" % (i + n)) for n, kv in enumerate(kvs)))
    finally:
        await nc.close()


def test_300_buckets_start_and_serve(nats_server, tmp_path):
    asyncio.run(_make_buckets(nats_server.url))
    buckets = [f"tenant{j:03d}" for j in range(BUCKETS)]
    sc = SidecarProcess(tmp_path / "sc", nats_server.url, buckets=buckets)
    with sc:
        sc.start(timeout=180)
        rows = sc.buckets()
        assert len(rows) == BUCKETS and all(r["synced"] == 1 and r["keys"] == 1 for r in rows.values())
        with sc.client() as c:
            assert c.mget([f"tenant{j:03d}:k" for j in range(BUCKETS)]) == [b"v%d" % j for j in range(BUCKETS)]
            assert c.info("stats")["stats"]["gets_remote"] == 0  # every one from its replica
        with LocalReader(str(sc.data_dir), max_stale_ms=60_000) as reader:  # the app side, every bucket
            assert [reader.get(f"tenant{j:03d}:k") for j in range(BUCKETS)] == [b"v%d" % j for j in range(BUCKETS)]
        assert sc.stop() == 0
    # and again on the replica it made: every bucket resumes
    with sc:
        sc.start(timeout=180)
        assert sc.client().get("tenant299:k") == b"v299"
        assert all(r["resyncs"] == 0 for r in sc.buckets().values())
        # One shared STREAM.LIST poll watches them all (statepoll.SHARED_FROM): a removal no
        # message announces (limits moving a stream's first sequence) still reaches the replica.
        asyncio.run(_limit_to_one_message(nats_server.url, "tenant007"))
        with sc.client() as c:
            wait_until(lambda: c.get("tenant007:k") is None, 20, "tenant007:k removed")
            assert c.get("tenant007:k2") == b"new"
            assert c.get("tenant008:k") == b"v8"
            stats = c.info("stats")["stats"]
        assert stats["stream_list_requests"] > 0
        assert sc.buckets()["tenant007"]["state_polls"] > 0
        assert sc.stop() == 0


async def _limit_to_one_message(url: str, bucket: str) -> None:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        kv = await js.key_value(bucket)
        info = await js.stream_info(f"KV_{bucket}")
        info.config.max_msgs = 1
        info.config.discard = DiscardPolicy.OLD  # (KV streams refuse writes past a limit)
        await js.update_stream(info.config)
        await kv.put("k2", b"new")  # the limit drops the oldest message: `k`'s, with no marker
        assert (await js.stream_info(f"KV_{bucket}")).state.messages == 1
    finally:
        await nc.close()
