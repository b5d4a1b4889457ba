"""The staleness policy against a real nats-server and a real sidecar process.

The sidecar's main connection (its feeds, and the `main.<bucket>` peers) goes through one
DelayProxy, its [[peer]] entries through another, both to the same server. Freezing the first
cuts the feed off (longer than max_stale_ms: the replica is stale); freezing the second too
leaves no peer that can answer. Writes are made with nats-py straight to the server.

Bucket `on` inherits the top-level `serve_stale = true`, bucket `off` sets
`serve_stale = false` for itself. Assertions are about sources, values, errors and counts,
never about times.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import nats
import pytest
from support.poll import until
from support.sidecar_proc import SidecarProcess
from support.topology import DelayProxy

from kvcache.app.client import AsyncClient, ResponseError

pytestmark = pytest.mark.timeout(180)

MAX_STALE_MS = 300
HEARTBEAT_MS = 300
REQUEST_TIMEOUT_MS = 500


def _toml(**kv) -> str:
    return "\n".join(f"{k} = {json.dumps(v)}" for k, v in kv.items())


def _config(path, main: str, peer: str, off_max_stale_ms: int = MAX_STALE_MS,
            heartbeat_ms: int = HEARTBEAT_MS, max_stale_ms: int = MAX_STALE_MS) -> str:
    text = _toml(heartbeat_ms=heartbeat_ms, serve_stale=True)
    text += "\n[nats]\n" + _toml(servers=[main], request_timeout_ms=REQUEST_TIMEOUT_MS)
    text += "\n[[bucket]]\n" + _toml(name="on", max_stale_ms=max_stale_ms)
    text += "\n[[bucket]]\n" + _toml(name="off", max_stale_ms=off_max_stale_ms, serve_stale=False)
    for b in ("on", "off"):
        text += "\n[[peer]]\n" + _toml(name=f"peer-{b}", servers=[peer], stream=f"KV_{b}")
    path.write_text(text + "\n")
    return str(path)


class Setup:
    def __init__(self, sc: SidecarProcess, main: DelayProxy, peer: DelayProxy, js, client: AsyncClient):
        self.sc, self.main, self.peer, self.js, self.c = sc, main, peer, js, client
        self.revs: dict[str, int] = {}

    async def put(self, bucket: str, key: str, value: bytes) -> int:
        rev = await (await self.js.key_value(bucket)).put(key, value)
        self.revs[f"{bucket}:{key}"] = rev
        return rev

    async def stats(self) -> dict:
        return (await self.c.info("stats"))["stats"]

    async def stale(self) -> None:
        """Until INFO shows both replicas behind by more than max_stale_ms (no read needed)."""
        async def behind():
            rows = (await self.c.info("buckets"))["buckets"]
            return all(rows[b]["lag_ms"] > MAX_STALE_MS for b in ("on", "off"))
        await until(behind, 30, "replicas stale")


@pytest.fixture(params=[MAX_STALE_MS])
async def setup(nats_server, tmp_path, request) -> AsyncIterator[Setup]:
    """A sidecar whose feed connection and peer go through proxies the test can freeze.
    Buckets `on` (serve_stale) and `off` (not); `off`'s max_stale_ms is the parameter, or a
    dict of _config's settings."""
    settings = request.param if isinstance(request.param, dict) else {"off_max_stale_ms": request.param}
    port = nats_server.port
    async with AsyncExitStack() as stack:
        nc = await nats.connect(nats_server.url)
        stack.push_async_callback(nc.close)
        js = nc.jetstream()
        for b in ("on", "off"):
            kv = await js.create_key_value(bucket=b, direct=True, history=5)
            for key in ("a", "b", "c"):
                await kv.put(key, f"{key}1".encode())
        main = DelayProxy(port).start()
        stack.callback(main.stop)
        peer = DelayProxy(port).start()
        stack.callback(peer.stop)
        sc = SidecarProcess(tmp_path / "sc", None,
                     extra=["--config", _config(tmp_path / "kvcache.toml", main.url, peer.url,
                                                **settings)])
        stack.callback(sc.kill)
        sc.start()
        client = AsyncClient(sc.socket, timeout=30)
        stack.push_async_callback(client.aclose)
        s = Setup(sc, main, peer, js, client)
        for b in ("on", "off"):
            e = await client.entry(f"{b}:a")
            assert e is not None and (e.value, e.source) == (b"a1", "local")
        yield s


async def test_stale_replica_reads_go_to_a_reachable_peer(setup: Setup):
    s, c = setup, setup.c
    s.main.freeze()                     # the feed is cut off; the peers still answer
    await s.put("on", "a", b"a2")        # a write the replica cannot see
    await s.put("off", "a", b"a2")
    await s.stale()
    for b in ("on", "off"):             # serve_stale plays no part while a peer answers
        e = await c.entry(f"{b}:a")
        assert e is not None
        assert (e.value, e.revision, e.source) == (b"a2", s.revs[f"{b}:a"], f"peer-{b}")
        assert await c.get(f"{b}:a") == b"a2"
        assert await c.mget([f"{b}:a", f"{b}:b", f"{b}:nosuch"]) == [b"a2", b"b1", None]
    st = await s.stats()
    assert st["gets_stale"] == 0 and st["gets_remote"] >= 6
    assert (await c.info("buckets"))["buckets"]["on"]["synced"] == 1
    # 300 ms bounds under two 300 ms heartbeats: said once, naming both buckets
    assert s.sc.log().count("max_stale_ms 300 (on, off) is under two heartbeats (heartbeat_ms 300)") == 1


async def test_no_peer_reachable_serve_stale_decides(setup: Setup):
    s, c = setup, setup.c
    s.main.freeze()
    await s.put("on", "a", b"a2")        # neither written value can be read below
    await s.put("off", "a", b"a2")
    await s.put("on", "c", b"c2")
    await s.stale()
    e = await c.entry("on:c")           # read from a peer: on:c's reads may not go back now
    assert e is not None and (e.value, e.source) == (b"c2", "peer-on")
    s.peer.freeze()                     # and now nothing can answer
    before = await s.stats()

    # serve_stale = false: a clear error, for every read command
    for call in (lambda: c.get("off:a"), lambda: c.entry("off:a"),
                 lambda: c.mget(["off:a", "off:b"])):
        with pytest.raises(ResponseError) as err:
            await call()
        text = str(err.value)
        assert text.startswith("ERR bucket off: replica stale (") and "max_stale_ms 300" in text, text
        assert "no peer could answer" in text, text

    # serve_stale = true (inherited): the last known value, marked stale where the reply can say so
    assert await c.get("on:a") == b"a1"
    e = await c.entry("on:a")
    assert e is not None and (e.value, e.source) == (b"a1", "stale")
    assert e.revision < s.revs["on:a"]
    raw = await c.execute("KV.GET", "on:b")
    assert raw[0] == b"b1" and raw[4] == b"stale"
    assert await c.mget(["on:a", "on:b", "on:nosuch", "on:a"]) == [b"a1", b"b1", None, b"a1"]
    assert await c.get("on:nosuch") is None    # the synced replica knows it does not exist
    # ... but never older than what was read already, nor for a read that asked for the leader
    with pytest.raises(ResponseError, match="a newer revision of the key was already read"):
        await c.get("on:c")
    with pytest.raises(ResponseError, match=r"^ERR upstream read failed"):
        await c.entry("on:b", consistency="strong")

    after = await s.stats()
    # on:a (GET), on:a (KV.GET), on:b (KV.GET), MGET's 3 distinct keys, on:nosuch (GET)
    assert after["gets_stale"] - before["gets_stale"] == 7
    assert after["gets_local"] == before["gets_local"]
    # each read above asked the peers first and failed: 3 in `off`, 7 in `on` (an MGET's
    # misses of one bucket are one batched request)
    assert after["remote_errors"] - before["remote_errors"] == 10


async def test_reads_are_local_again_after_the_feed_is_restored(setup: Setup):
    s, c = setup, setup.c
    s.main.freeze()
    s.peer.freeze()
    await s.put("on", "a", b"a2")
    await s.stale()
    assert (await c.entry("on:a")).source == "stale"
    s.main.thaw()
    s.peer.thaw()

    async def local_again():
        e = await c.entry("on:a")
        return e is not None and (e.value, e.source) == (b"a2", "local")
    await until(local_again, 60, "on:a read locally again with the value written during the cut")
    async def caught_up():
        rows = (await c.info("buckets"))["buckets"]
        return all(rows[b]["lag_ms"] == 0 for b in ("on", "off"))
    await until(caught_up, 60, "both replicas caught up")
    before = await s.stats()
    assert await c.get("on:a") == b"a2"
    assert await c.mget(["on:a", "off:b"]) == [b"a2", b"b1"]
    assert (await c.entry("off:a")).source == "local"
    after = await s.stats()
    assert after["gets_local"] - before["gets_local"] == 4
    assert after["gets_remote"] == before["gets_remote"]
    assert after["gets_stale"] == before["gets_stale"]


async def test_maxstale_moves_a_read_and_never_back(setup: Setup):
    """KV.GET's MAXSTALE replaces the bucket's bound for one read: a wider bound reads the
    replica the bucket's own bound would not; once a newer revision was read from a peer, the
    wider bound no longer takes the key back to the replica's older one."""
    s, c = setup, setup.c
    s.main.freeze()
    await s.put("on", "a", b"a2")
    await s.stale()
    wide = await c.entry("on:a", max_stale_ms=3_600_000)
    assert wide is not None and (wide.value, wide.source) == (b"a1", "local")
    narrow = await c.entry("on:a")
    assert narrow is not None and (narrow.value, narrow.source) == (b"a2", "peer-on")
    again = await c.entry("on:a", max_stale_ms=3_600_000)
    assert again is not None and (again.value, again.revision) == (b"a2", s.revs["on:a"])
    assert again.source != "local"


@pytest.mark.parametrize("setup", [600_000], indirect=True, ids=["off-bound-10min"])
async def test_the_get_fast_path_keeps_each_buckets_bound(setup: Setup):
    """Plain GET (the server's fast path) judges each bucket by its own max_stale_ms: with the
    feed cut off past 300 ms, bucket `on` (300 ms) reads from the peer while `off` (10 min)
    still answers from its replica."""
    s, c = setup, setup.c
    s.main.freeze()
    await s.put("on", "a", b"a2")
    await s.put("off", "a", b"a2")
    await s.stale()
    before = await s.stats()
    assert await c.get("off:a") == b"a1"      # its replica, within its own bound
    mid = await s.stats()
    assert (mid["gets_local"] - before["gets_local"], mid["gets_remote"] - before["gets_remote"]) == (1, 0)
    assert await c.get("on:a") == b"a2"       # past its bound: the peer
    after = await s.stats()
    assert (after["gets_local"] - mid["gets_local"], after["gets_remote"] - mid["gets_remote"]) == (0, 1)


SILENT = {"heartbeat_ms": 1000, "max_stale_ms": 2500, "off_max_stale_ms": 2500}


@pytest.mark.parametrize("setup", [SILENT], indirect=True, ids=["heartbeat-1s-bound-2.5s"])
async def test_a_silent_link_is_stale_max_stale_ms_after_the_last_word(setup: Setup):
    """A link that stalls without closing says nothing: no disconnect, no error, and the
    consumer is declared lost only after three heartbeats (3 s here, noticed up to a heartbeat
    later). The replica is known current only as of the last message or heartbeat heard, which
    came before the freeze, so a read begun max_stale_ms (2.5 s) after a write acknowledged
    after the freeze must see the write. An idle link that is not cut stays at lag 0."""
    s, c = setup, setup.c
    for _ in range(8):  # healthy and idle: heartbeats keep it current (4 s, two intervals each)
        rows = (await c.info("buckets"))["buckets"]
        assert [rows[b]["lag_ms"] for b in ("on", "off")] == [0, 0]
        await asyncio.sleep(0.5)
    s.main.freeze()
    for b in ("on", "off"):
        await s.put(b, "a", b"a2")
    await asyncio.sleep(SILENT["max_stale_ms"] / 1000 + 0.05)
    # Begun now, each read is past the bound: the peers answer (the fast path, MGET, KV.GET).
    for b in ("on", "off"):
        assert await c.get(f"{b}:a") == b"a2"
        assert await c.mget([f"{b}:a", f"{b}:b"]) == [b"a2", b"b1"]
        e = await c.entry(f"{b}:a")
        assert e is not None and (e.value, e.revision, e.source) == (b"a2", s.revs[f"{b}:a"], f"peer-{b}")
    rows = (await c.info("buckets"))["buckets"]
    assert all(rows[b]["lag_ms"] > SILENT["max_stale_ms"] for b in ("on", "off")), rows
    assert (await s.stats())["gets_stale"] == 0
    assert "under two heartbeats" not in s.sc.log()
