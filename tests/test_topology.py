"""The fixtures start real topologies that behave as the rest of the suite assumes."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

import nats
import nats.js.errors
import pytest
from nats.aio.client import Client as NATS
from nats.js.api import ExternalStream, StreamConfig, StreamSource
from support.topology import Cluster, replicated_kv, settled

from kvcache.errors import KvcacheError
from kvcache.natsio.nats_server import NatsServer, find_binary, free_port

T = TypeVar("T")

# each test starts its own servers
pytestmark = [pytest.mark.timeout(90), pytest.mark.servers]


@asynccontextmanager
async def connect(url: str) -> AsyncIterator[NATS]:
    """A connection pinned to one server: no discovered servers, no reconnect elsewhere."""
    nc = await nats.connect(servers=[url], connect_timeout=2, allow_reconnect=False)
    try:
        yield nc
    finally:
        await nc.close()


async def eventually(fn: Callable[[], Awaitable[T]], timeout: float, what: str) -> T:
    """Retry `fn` until it returns a truthy value without raising, within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            result = await fn()
            if result:
                return result
        except Exception as exc:
            last = exc
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}; last error: {last!r}")


# -- NatsServer itself --------------------------------------------------------------------


def test_find_binary_and_free_port() -> None:
    assert find_binary().endswith("nats-server")
    ports = {free_port() for _ in range(20)}
    assert len(ports) == 20


def test_start_failure_reports_log(tmp_path) -> None:
    srv = NatsServer(tmp_path / "js", extra_conf="this is { not valid")
    with pytest.raises(KvcacheError, match="nats-server exited"):
        srv.start(timeout=5)
    assert srv.pid is None


async def test_lifecycle_pause_resume_restart(tmp_path) -> None:
    with NatsServer(tmp_path / "js", server_name="life") as srv:
        pid = srv.pid
        assert pid and srv.running
        async with connect(srv.url) as nc:
            kv = await nc.jetstream().create_key_value(bucket="life", direct=True)
            await kv.put("k", b"v1")
        srv.pause()
        # A stopped process still accepts TCP (the kernel does) but never sends INFO.
        with pytest.raises((asyncio.TimeoutError, nats.errors.NoServersError)):
            await nats.connect(servers=[srv.url], connect_timeout=1, allow_reconnect=False)
        srv.resume()
        srv.restart()
        assert srv.pid != pid
        async with connect(srv.url) as nc:  # same port, same store: the data survived
            # Ready means JetStream is enabled, not that every stream is recovered yet.
            deadline = time.monotonic() + 30
            while True:
                try:
                    kv = await nc.jetstream(timeout=2).key_value("life")
                    value = (await kv.get("k")).value
                    break
                except (nats.errors.Error, nats.js.errors.Error):
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.1)
            assert value == b"v1"
        srv.kill()
        assert not srv.running
        srv.stop()
        srv.stop()
    assert srv.pid is None


# -- single server ------------------------------------------------------------------------


async def test_single_server_kv(nats_server: NatsServer) -> None:
    async with connect(nats_server.url) as nc:
        js = nc.jetstream(timeout=2)
        kv = await js.create_key_value(bucket="single", direct=True)
        rev = await kv.put("greeting", b"hello")
        entry = await kv.get("greeting")
        assert entry.value == b"hello" and entry.revision == rev
        info = await js.stream_info("KV_single")
        assert info.config.allow_direct


# -- cluster --------------------------------------------------------------------------------


async def test_replicated_kv_returns_a_led_and_current_bucket(nats_cluster: Cluster) -> None:
    """Fixtures rely on replicated_kv returning only once the new R3 stream has a leader and
    both followers are online and current, as STREAM.INFO (asked again here, through another
    member) reports them; and the cluster it runs on is routed and meta-current. Before that, a
    put made as soon as the create was answered could find no responder."""
    assert nats_cluster.wait_ready() in {s.server_name for s in nats_cluster.servers}
    async with connect(nats_cluster.servers[1].url) as nc:
        js = nc.jetstream(timeout=5)
        kv = await replicated_kv(js, bucket="ready", replicas=3, history=1)
        info = await js.stream_info("KV_ready")
        assert info.cluster is not None and info.cluster.leader
        assert len(info.cluster.replicas or []) == 2, info.cluster
        assert all(r.current and not r.offline for r in info.cluster.replicas), info.cluster
        rev = await settled(lambda: kv.put("k", b"v"))
        assert (await kv.get("k")).revision == rev
        await js.delete_key_value("ready")


async def test_cluster_r3_bucket_survives_leader_kill(nats_cluster: Cluster) -> None:
    s0, _, s2 = nats_cluster.servers
    async with connect(s0.url) as nc0:
        kv0 = await replicated_kv(nc0.jetstream(), bucket="ha", direct=True, replicas=3)
        rev = await settled(lambda: kv0.put("k", b"v1"))

    async with connect(s2.url) as nc2:
        kv2 = await nc2.jetstream().key_value("ha")
        entry = await eventually(lambda: kv2.get("k"), 10, "R3 bucket readable on hub-2")
        assert entry.value == b"v1" and entry.revision == rev
        old_leader = (await nc2.jetstream().stream_info("KV_ha")).cluster.leader
    assert old_leader in {s.server_name for s in nats_cluster.servers}

    victim = nats_cluster.server(old_leader)
    victim.kill()
    try:
        for other in (s for s in nats_cluster.servers if s is not victim):
            async with connect(other.url) as nc:
                js = nc.jetstream(timeout=2)

                async def new_leader(js=js) -> str | None:
                    leader = (await js.stream_info("KV_ha")).cluster.leader
                    return leader if leader and leader != old_leader else None

                leader = await eventually(new_leader, 30, f"new KV_ha leader seen from {other.server_name}")
                assert leader != old_leader
                kv = await js.key_value("ha")
                assert (await kv.get("k")).value == b"v1"
                # The new leader accepts writes too.
                await eventually(lambda kv=kv, other=other: kv.put("after", other.server_name.encode()), 10,
                                 "put after failover")

                async def after_visible(kv=kv, other=other):
                    # a Direct Get may be answered by a replica that has not applied the put yet
                    return (await kv.get("after")).value == other.server_name.encode()
                await eventually(after_visible, 10, "the put visible to Direct Get")
    finally:
        victim.start()
        nats_cluster.wait_ready()


# -- leaf nodes ----------------------------------------------------------------------------


async def test_leaf_mirror_and_cross_domain_direct_get(
    nats_cluster: Cluster, leaf_servers: dict[str, NatsServer]
) -> None:
    assert set(leaf_servers) == {"leaf1", "leaf2"}
    leaf1 = leaf_servers["leaf1"]
    async with connect(nats_cluster.servers[0].url) as hub, connect(leaf1.url) as nc1:
        hub_js = hub.jetstream()
        kv = await replicated_kv(hub_js, bucket="lx", direct=True, replicas=3)
        for i in range(10):
            await settled(lambda i=i: kv.put(f"key{i}", f"v{i}".encode()))
        hub_state = (await hub_js.stream_info("KV_lx")).state

        # Direct Get against the hub domain, from a client of leaf1.
        reply = await eventually(
            lambda: nc1.request("$JS.hub.API.DIRECT.GET.KV_lx.$KV.lx.key3", b"", timeout=2),
            10,
            "cross-domain direct get",
        )
        assert reply.data == b"v3", reply.headers
        assert reply.headers and reply.headers.get("Nats-Stream") == "KV_lx"

        # A mirror in leaf1's own domain, sourced from the hub, serving Direct Get.
        js1 = nc1.jetstream()
        await js1.add_stream(
            StreamConfig(
                name="KV_lx_leaf1",
                mirror=StreamSource(name="KV_lx", external=ExternalStream(api="$JS.hub.API")),
                mirror_direct=True,
                allow_direct=True,
                max_msgs_per_subject=1,
            )
        )

        async def caught_up() -> bool:
            state = (await js1.stream_info("KV_lx_leaf1")).state
            return state.messages == hub_state.messages and state.last_seq == hub_state.last_seq

        await eventually(caught_up, 20, "mirror on leaf1 to catch up with the hub")

        # The mirror answers Direct Get under its own name...
        reply = await nc1.request("$JS.API.DIRECT.GET.KV_lx_leaf1.$KV.lx.key7", b"", timeout=2)
        assert reply.data == b"v7"
        assert reply.headers.get("Nats-Stream") == "KV_lx_leaf1"
        # ...and, with mirror_direct, under the origin's name inside leaf1's domain.
        reply = await nc1.request("$JS.API.DIRECT.GET.KV_lx.$KV.lx.key7", b"", timeout=2)
        assert reply.data == b"v7"
        assert reply.headers.get("Nats-Stream") == "KV_lx_leaf1"

        # Live updates flow to the mirror.
        rev = await kv.put("key7", b"new")
        await eventually(
            lambda: _seq_at_least(js1, "KV_lx_leaf1", rev), 10, "live update mirrored to leaf1"
        )
        reply = await nc1.request("$JS.API.DIRECT.GET.KV_lx_leaf1.$KV.lx.key7", b"", timeout=2)
        assert reply.data == b"new"
        assert int(reply.headers["Nats-Sequence"]) == rev

    async with connect(leaf_servers["leaf2"].url) as nc2:
        reply = await nc2.request("$JS.hub.API.DIRECT.GET.KV_lx.$KV.lx.key1", b"", timeout=2)
        assert reply.data == b"v1"


async def _seq_at_least(js, stream: str, seq: int) -> bool:
    return (await js.stream_info(stream)).state.last_seq >= seq
