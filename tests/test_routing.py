"""kvcache.read.router.Router against real nats-servers, with latency put in by DelayProxy.

Each peer is its own kvcache NatsConnection through its own proxy to the same server (or to one
member of a cluster), so the peers differ only in what the proxy does to them: a delay, a
freeze (a stall), or being gone. Assertions are about choices and counts, never about times.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import nats
import pytest
import redis
from nats.js.api import StreamConfig, StreamSource
from support.poll import until, wait_until
from support.sidecar_proc import SidecarProcess, write_config
from support.topology import DelayProxy, add_hub_mirror, nats_run, replicated_kv, settled

from kvcache.natsio import jetstream as jsapi
from kvcache.natsio.nats_connection import NatsConnection
from kvcache.natsio.nats_server import NatsServer
from kvcache.read.router import Peer, Router, RouterSettings

pytestmark = pytest.mark.timeout(120)

TIMEOUT = 2.0
# One-way delays (s): apart by tens of ms, so that a loaded machine's own jitter (a few ms)
# cannot reorder them; the assertions compare request counts, never times.
FAST, MID, SLOW = 0.0, 0.010, 0.040


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def server(nats_server_module) -> str:
    async def setup(js):
        kv = await js.create_key_value(bucket="rr", direct=True, history=5)
        await kv.put("k", b"v1")
        nd = await js.create_key_value(bucket="rrnd")     # no allow_direct
        await nd.put("k", b"nd")
        await js.add_stream(StreamConfig(name="KV_rr_m", mirror=StreamSource(name="KV_rr"),
                                         mirror_direct=True, allow_direct=True))
    nats_run(nats_server_module.url, setup)
    return nats_server_module.url


async def close_quietly(nc: NatsConnection) -> None:
    """nats-py's close() can raise on a connection whose server is gone."""
    try:
        await nc.close()
    except OSError:
        pass


@asynccontextmanager
async def peers_via(url: str, delays: list[float], bucket: str = "rr",
                    streams: list[str] | None = None) -> AsyncIterator[tuple[list[DelayProxy], list[Peer]]]:
    """One proxy, NatsConnection and Peer per delay; peer names p0, p1, ..."""
    async with AsyncExitStack() as stack:
        proxies, peers = [], []
        for i, d in enumerate(delays):
            px = DelayProxy(port_of(url), delay=d).start()
            stack.callback(px.stop)
            nc = NatsConnection()
            await nc.connect(servers=[px.url], connect_timeout=5, max_reconnect_attempts=-1,
                             reconnect_time_wait=0.2)
            stack.push_async_callback(close_quietly, nc)
            stream = streams[i] if streams else f"KV_{bucket}"
            proxies.append(px)
            peers.append(Peer(f"p{i}", nc, stream, bucket))
        yield proxies, peers


@pytest.fixture
async def router_of():
    """Makes routers over given peers (with RouterSettings overrides); closes them afterwards."""
    made: list[Router] = []

    def make(peers: list[Peer], timeout: float = TIMEOUT, **hedging) -> Router:
        r = Router(timeout, RouterSettings(**hedging))
        for p in peers:
            r.add(p)
        made.append(r)
        return r
    yield make
    for r in made:
        await r.close()


def requests(peers: list[Peer]) -> list[int]:
    return [p.stats.requests for p in peers]


async def read_n(r: Router, n: int, bucket: str = "rr", key: str = "k") -> None:
    for _ in range(n):
        e = await r.get(bucket, key)
        assert e is not None and e.value


async def read_until(r: Router, done, bucket: str = "rr", limit_s: float = 20.0) -> None:
    """Read (every read must succeed) until `done()`; a bound on wall time, not an expectation."""
    deadline = time.monotonic() + limit_s
    while not done() and time.monotonic() < deadline:
        await read_n(r, 1, bucket)
        await asyncio.sleep(0.002)


# --------------------------------------------------------------------------- choice


async def test_reads_go_to_the_fastest_peer_and_move_when_latencies_change(server, router_of):
    async with peers_via(server, [SLOW, FAST, MID]) as (proxies, peers):
        r = router_of(peers)
        await read_n(r, 150)
        slow, fast, mid = requests(peers)
        assert fast > 3 * (slow + mid), requests(peers)
        # the fast peer becomes the slowest, the slow one the fastest
        proxies[0].delay, proxies[1].delay = FAST, SLOW
        windows = []
        for _ in range(60):                       # the slow peer's estimate is refreshed by
            before = requests(peers)              # probes (refresh_s), then it takes over
            await read_n(r, 50)
            windows.append([a - b for a, b in zip(requests(peers), before, strict=True)])
            if windows[-1][0] > 3 * (windows[-1][1] + windows[-1][2]):
                break
        assert windows[-1][0] > 3 * (windows[-1][1] + windows[-1][2]), windows


async def test_power_of_two_choices_spreads_equal_peers(server, router_of):
    async with peers_via(server, [FAST, FAST]) as (_, peers):
        r = router_of(peers)
        await asyncio.gather(*(read_n(r, 40) for _ in range(8)))
        # Not an even split: peak EWMA keeps a peer that had one slow answer aside until it is
        # measured again; the in-flight count is what sends concurrent reads to both.
        assert min(requests(peers)) > 0.03 * sum(requests(peers)), requests(peers)


# --------------------------------------------------------------------------- stalls and failures


async def test_stalled_peer_is_hedged_ejected_and_returns(server, router_of):
    async with peers_via(server, [FAST, MID]) as (proxies, peers):
        # A short timeout and refresh: once the stalled peer stops being chosen, the probes
        # that keep measuring it time out, and that is what ejects it.
        r = router_of(peers, timeout=0.5, probe_backoff_s=0.2, refresh_s=0.1)
        await read_n(r, 60)
        fast = peers[0]
        assert fast.stats.requests > peers[1].stats.requests
        proxies[0].freeze()
        await read_until(r, lambda: r.state(fast) == "ejected")      # not one failed read meanwhile
        assert r.state(fast) == "ejected" and fast.stats.ejections == 1
        assert r.hedges_won >= 1 and peers[1].stats.hedges_won >= 1
        proxies[0].thaw()
        await read_until(r, lambda: r.state(fast) == "up")           # probes bring it back
        assert r.state(fast) == "up"
        before = fast.stats.requests
        await read_n(r, 60)
        assert fast.stats.requests - before > 30


async def test_killed_peer_costs_no_failed_read(server, router_of):
    async with peers_via(server, [FAST, MID]) as (proxies, peers):
        r = router_of(peers)
        await read_n(r, 30)
        proxies[0].stop()                         # connections reset, nothing listens
        await read_n(r, 60)
        assert r.state(peers[0]) in ("down", "ejected")
        assert peers[1].stats.requests >= 60


async def test_every_peer_failing_is_an_error(server, router_of):
    from kvcache.errors import UpstreamError
    async with peers_via(server, [FAST, FAST], streams=["KV_nosuch", "KV_nosuch2"]) as (_, peers):
        r = router_of(peers)
        with pytest.raises(UpstreamError):
            await r.get("rr", "k")
        assert [p.stats.errors for p in peers] == [1, 1]   # failed over once, then gave up


async def test_stream_without_allow_direct_is_read_through_the_leader_api(server, router_of):
    async with peers_via(server, [FAST, MID], bucket="rrnd") as (_, peers):
        r = router_of(peers)
        for _ in range(10):
            e = await r.get("rrnd", "k")
            assert (e.value, e.source) == (b"nd", "leader")


# --------------------------------------------------------------------------- hedging budget


async def test_hedging_stays_within_its_budget(server, router_of):
    # Hedge at the primary's fastest sample: almost every read is "late", so only the
    # budget keeps hedges down.
    async with peers_via(server, [MID, MID]) as (_, peers):
        r = router_of(peers, hedge_percentile=0.0, hedge_min_s=0.0, hedge_patience=False,
                      hedge_ratio=0.1, hedge_burst=2)
        await read_n(r, 200)
        assert r.hedges_sent <= 0.1 * r.requests + 2
        assert r.hedges_sent >= 0.05 * r.requests     # the budget was there to be used
        assert sum(p.stats.hedges for p in peers) == r.hedges_sent
        assert r.hedges_won <= r.hedges_sent


# --------------------------------------------------------------------------- consistency


async def test_strong_reads_use_the_bucket_stream_not_a_mirror(server, router_of):
    async with peers_via(server, [FAST, SLOW], streams=["KV_rr_m", "KV_rr"]) as (_, peers):
        r = router_of(peers)
        nc = await nats.connect(server)
        try:
            kv = await nc.jetstream().key_value("rr")
            for i in range(5):
                rev = await kv.put("k", b"s%d" % i)
                e = await r.get("rr", "k", strong=True)
                assert (e.value, e.revision, e.source) == (b"s%d" % i, rev, "leader")
        finally:
            await nc.close()
        mirror, upstream = peers
        assert mirror.stats.requests == 0 and upstream.stats.requests == 5
        # a local read after them never goes back below what the strong reads handed out: a
        # lagging mirror's older answer is replaced by the leader's (the router's floors)
        e = await r.get("rr", "k")
        assert (e.value, e.revision) == (b"s4", rev)


# --------------------------------------------------------------------------- a real stopped server


@pytest.fixture(scope="module")
def cluster_bucket(nats_cluster):
    """Bucket `rc` (R3) holding `k`, its stream led and every replica current before the put
    (a put made as soon as the create was answered could find no responder)."""
    async def setup(js):
        kv = await replicated_kv(js, bucket="rc", direct=True, replicas=3)
        await settled(lambda: kv.put("k", b"c"))
    nats_run(nats_cluster.urls[0], setup)
    return nats_cluster


async def test_sigstopped_cluster_member_is_hedged_around(cluster_bucket, router_of):
    """Peers pinned to cluster members (a member answers Direct Get from its own replica);
    SIGSTOP one: reads go on through the others, it is ejected, and back once resumed."""
    nats_cluster = cluster_bucket
    async with AsyncExitStack() as stack:
        peers = []
        for _i, s in enumerate(nats_cluster.servers):
            nc = NatsConnection()
            await nc.connect(servers=[s.url], connect_timeout=5, max_reconnect_attempts=-1,
                             reconnect_time_wait=0.2, ping_interval=600)
            stack.push_async_callback(close_quietly, nc)
            peers.append(Peer(s.server_name, nc, "KV_rc", "rc"))
        r = router_of(peers, timeout=0.5, probe_backoff_s=0.2, refresh_s=0.1)
        async def every_replica_has_it() -> bool:
            return all([await p.get("k", TIMEOUT) for p in peers])
        await until(every_replica_has_it, 30, "every member's replica of KV_rc to answer k")
        await read_n(r, 60, "rc")
        # A follower: stopping the stream leader also stalls the other members' Direct Get
        # answers until a new leader is elected (that is the cluster, not the router).
        leader = (await jsapi.stream_info(peers[0].nc, "KV_rc", TIMEOUT))["cluster"]["leader"]
        victim = max((p for p in peers if p.name != leader), key=lambda p: p.stats.requests)
        server = nats_cluster.server(victim.name)
        server.pause()                            # SIGSTOP
        try:
            await read_until(r, lambda: r.state(victim) == "ejected", "rc")
            assert r.state(victim) == "ejected"
        finally:
            server.resume()
        await read_until(r, lambda: r.state(victim) == "up", "rc")
        assert r.state(victim) == "up"


async def test_a_strong_read_needs_evidence_its_leader_was_not_replaced(cluster_bucket, router_of):
    """CONSISTENCY strong takes the believed leader's answer only while a quorum showed the
    stream's state within STRONG_EVIDENCE_MS (Router.strong_gate): here no feed vouches, so
    the gate asks the leader's STREAM.INFO itself, once for the reads that follow. With both
    followers stopped (SIGSTOP: they can neither answer nor elect), the leader's evidence of
    them ages from the stop, and no strong read is answered once it is older than that."""
    from kvcache.errors import UpstreamError
    from kvcache.feed.quorum import STRONG_EVIDENCE_MS

    nats_cluster = cluster_bucket
    probe = NatsConnection()
    await probe.connect(servers=[nats_cluster.urls[0]], connect_timeout=5)
    try:
        leader = (await jsapi.stream_info(probe, "KV_rc", TIMEOUT))["cluster"]["leader"]
    finally:
        await close_quietly(probe)
    async with AsyncExitStack() as stack:
        nc = NatsConnection()
        await nc.connect(servers=[nats_cluster.server(leader).url], connect_timeout=5, ping_interval=600)
        stack.push_async_callback(close_quietly, nc)
        r = router_of([Peer(leader, nc, "KV_rc", "rc")], timeout=0.5)
        r.proven = lambda bucket, ms: False
        for _ in range(3):
            assert (await r.get("rc", "k", strong=True)).value == b"c"
        assert r.strong_evidence_asked == 1  # the gate's own evidence serves the next reads
        r._strong_as_of.clear()
        followers = [s for s in nats_cluster.servers if s.server_name != leader]
        answered: list[float] = []
        refused: list[str] = []
        for s in followers:
            s.pause()                            # SIGSTOP
        stopped = time.monotonic()
        try:
            while time.monotonic() < stopped + STRONG_EVIDENCE_MS / 1000 + 3.0:
                r._strong_as_of.clear()  # every read asks, as the first after a poll would
                sent = time.monotonic()
                try:
                    await r.get("rc", "k", strong=True)
                    answered.append(sent - stopped)
                except UpstreamError as e:
                    refused.append(str(e))
                await asyncio.sleep(0.05)
        finally:
            for s in followers:
                s.resume()
    # The evidence is never later than the stop (a stopped follower is not heard from), so a
    # read sent past STRONG_EVIDENCE_MS after it cannot pass, however busy the host.
    late = [t for t in answered if t > STRONG_EVIDENCE_MS / 1000 + 0.1]
    assert not late, f"strong reads answered {late} s after both followers stopped"
    assert refused and "strong read cannot show its leader was not replaced" in refused[-1], refused[-3:]
    # the cluster whole again for the tests after this one
    client = await nats.connect(nats_cluster.urls[0])
    try:
        async def current() -> bool:
            try:
                info = await client.jetstream().stream_info("KV_rc")
            except Exception:  # no leader yet
                return False
            c = info.cluster
            return bool(c and c.leader and c.replicas and all(x.current for x in c.replicas))
        await until(current, 60, "KV_rc led and current again")
    finally:
        await client.close()


# --------------------------------------------------------------------------- the sidecar, hub and leaves


@pytest.fixture(scope="module")
def hub_and_mirrors(nats_cluster, leaf_servers):
    """Bucket `rs` (R3) on the hub, led and every replica current before the first write; a
    mirror of it in each leaf's domain, caught up."""
    async def hub(js):
        kv = await replicated_kv(js, bucket="rs", direct=True, replicas=3, history=5)
        await settled(lambda: kv.put("far.k", b"far"))
        await settled(lambda: kv.put("local.k", b"near"))
        return (await js.stream_info("KV_rs")).state.last_seq
    last = nats_run(nats_cluster.urls[0], hub)

    for name, leaf in leaf_servers.items():
        nats_run(leaf.url, lambda js, name=name: add_hub_mirror(js, f"KV_rs_{name}", "KV_rs", last))
    return nats_cluster, leaf_servers


def sidecar_config(path, main: str, peers: list[tuple[str, str]], **extra) -> str:
    """A config file: bucket `rs` replicating `local.>` only (`far.*` is read from peers)."""
    return write_config(path, {"servers": [main], "request_timeout_ms": 500},
                        [{"name": "rs", "keys": ["local.>"]}],
                        [{"name": name, "servers": [url], "stream": f"KV_rs_{name}", "domain": name}
                         for name, url in peers], **extra)


@pytest.fixture
def proxied_sidecar(hub_and_mirrors, tmp_path):
    """A sidecar whose main connection (hub) and two peers (the leaf mirrors) each go through
    a DelayProxy: hub 5 ms, leaf1 0 ms, leaf2 20 ms one way."""
    cluster, leaves = hub_and_mirrors
    proxies = {"hub": DelayProxy(port_of(cluster.urls[0]), 0.005).start(),
               "leaf1": DelayProxy(port_of(leaves["leaf1"].url), 0.0).start(),
               "leaf2": DelayProxy(port_of(leaves["leaf2"].url), 0.020).start()}
    cfg = sidecar_config(tmp_path / "kvcache.toml", proxies["hub"].url,
                         [(n, proxies[n].url) for n in ("leaf1", "leaf2")])
    sc = SidecarProcess(tmp_path / "sc", None, extra=["--config", cfg])
    try:
        sc.start()
        yield sc, proxies, redis.Redis(unix_socket_path=sc.socket, protocol=3)
    finally:
        sc.kill()
        for px in proxies.values():
            px.stop()


def test_sidecar_reads_from_the_fastest_mirror_and_strong_reads_from_the_leader(
        proxied_sidecar, hub_and_mirrors):
    _sc, _, r = proxied_sidecar
    for _ in range(100):
        assert r.get("far.k") == b"far"
    peers = r.info("peers")
    assert set(peers) == {"main.rs", "leaf1", "leaf2"}, peers
    assert peers["leaf1"]["requests"] > 2 * (peers["leaf2"]["requests"] + peers["main.rs"]["requests"])
    assert peers["leaf1"]["stream"] == "KV_rs_leaf1" and peers["leaf1"]["state"] == "up"
    value, _, _, _, source = r.execute_command("KV.GET", "far.k")
    assert (value, source) == (b"far", b"leaf1")

    async def put(js):
        return await (await js.key_value("rs")).put("far.k", b"written")
    cluster, _ = hub_and_mirrors
    rev = nats_run(cluster.urls[0], put)
    value, got_rev, _, _, source = r.execute_command("KV.GET", "far.k", "CONSISTENCY", "strong")
    assert (value, got_rev, source) == (b"written", rev, b"leader")
    routing = r.info("routing")
    assert routing["routed_requests"] >= 102 and routing["hedges_sent"] <= 0.1 * routing["routed_requests"] + 10
    assert {"p50_us", "p99_us", "hedges_won", "ejections"} <= set(routing["leaf1"])


def test_sidecar_survives_a_stalled_mirror(proxied_sidecar):
    _sc, proxies, r = proxied_sidecar
    for _ in range(30):
        assert r.get("far.k") is not None
    proxies["leaf1"].freeze()
    try:
        for _ in range(2000):                     # not one failed read meanwhile
            assert r.get("far.k") is not None
            if r.info("peers")["leaf1"]["state"] == "ejected":
                break
        assert r.info("peers")["leaf1"]["state"] == "ejected"
    finally:
        proxies["leaf1"].thaw()
    for _ in range(400):
        if r.info("peers")["leaf1"]["state"] == "up":
            break
        assert r.get("far.k") is not None
        time.sleep(0.02)
    assert r.info("peers")["leaf1"]["state"] == "up"
    assert r.info("routing")["leaf1"]["ejections"] == 1


def test_sidecar_discovers_mirrors_from_alternates(hub_and_mirrors, tmp_path):
    """The server lists as alternates the mirrors its own JetStream cluster holds (the leaf
    domains' mirrors are not among them: those are [[peer]] entries)."""
    cluster, _ = hub_and_mirrors

    def alternates_of(info: dict) -> list[str]:
        return [a["name"] for a in info.get("alternates", [])]

    async def hub_mirror(js):
        await js.add_stream(StreamConfig(name="KV_rs_hubm", mirror=StreamSource(name="KV_rs"),
                                         mirror_direct=True, allow_direct=True, num_replicas=1))
        # KV_rs's leader learns of the new stream from the meta group's log, which may reach
        # it after the create was answered: ask until it lists the mirror
        async def listing() -> dict | None:
            m = await js._nc.request("$JS.API.STREAM.INFO.KV_rs", b"", timeout=TIMEOUT)
            upstream = json.loads(m.data)
            return upstream if "KV_rs_hubm" in alternates_of(upstream) else None
        upstream = await until(listing, 60, "KV_rs's STREAM.INFO to list KV_rs_hubm as an alternate")

        # the new mirror answers Direct Gets at once: until it has caught up, "not found"
        async def caught_up() -> bool:
            return (await js.stream_info("KV_rs_hubm")).state.last_seq >= upstream["state"]["last_seq"]
        await until(caught_up, 60, "mirror KV_rs_hubm to catch up with KV_rs")
        return alternates_of(upstream)
    assert "KV_rs_hubm" in nats_run(cluster.urls[0], hub_mirror)
    cfg = sidecar_config(tmp_path / "kvcache.toml", cluster.urls[0], [], discover_peers=True)
    with SidecarProcess(tmp_path / "sc", None, extra=["--config", cfg]) as sc:
        sc.start()
        r = redis.Redis(unix_socket_path=sc.socket, protocol=3)
        peers = r.info("peers")
        assert set(peers) == {"main.rs", "KV_rs_hubm"}, peers
        assert peers["KV_rs_hubm"]["stream"] == "KV_rs_hubm"
        for _ in range(50):
            assert r.get("far.k") is not None
        assert sum(p["requests"] for p in r.info("peers").values()) >= 50


# --------------------------------------------------------------------------- peers of different lag


@pytest.fixture(scope="module")
def lagging_mirror(nats_cluster, tmp_path_factory):
    """Bucket `mono` on the hub and its mirror on leaf `lag`, whose leaf connection runs
    through a DelayProxy: freezing it stops the mirror from replicating (a lagging mirror)."""
    hub0 = nats_cluster.servers[0]
    link = DelayProxy(hub0.leafnodes_listen_port).start()
    leaf = NatsServer(tmp_path_factory.mktemp("lag") / "js", host="127.0.0.1", server_name="lag",
                      domain="lag", leaf_remotes=[f"nats-leaf://127.0.0.1:{link.port}"]).start()
    try:
        wait_until(lambda: leaf.monitor("/leafz").get("leafnodes", 0) >= 1, 15, "leaf lag connected")

        async def hub(js):   # led, every replica current, before the first write
            kv = await replicated_kv(js, bucket="mono", direct=True, replicas=3)
            return await settled(lambda: kv.put("k", b"v1"))
        rev = nats_run(hub0.url, hub)

        nats_run(leaf.url, lambda js: add_hub_mirror(js, "KV_mono_lag", "KV_mono", rev))
        yield hub0, leaf, link
    finally:
        leaf.stop()
        link.stop()


async def test_revisions_never_go_back_across_peers_of_different_lag(lagging_mirror, router_of):
    hub0, leaf, link = lagging_mirror
    async with AsyncExitStack() as stack:
        conns = []
        for url in (leaf.url, hub0.url):
            nc = NatsConnection()
            await nc.connect(servers=[url], connect_timeout=5)
            stack.push_async_callback(close_quietly, nc)
            conns.append(nc)
        mirror = Peer("lag", conns[0], "KV_mono_lag", "mono")
        upstream = Peer("hub", conns[1], "KV_mono", "mono")
        r = router_of([mirror, upstream])
        writer = await nats.connect(hub0.url)
        stack.push_async_callback(writer.close)
        kv = await writer.jetstream().key_value("mono")
        link.freeze()                                   # the mirror stops replicating
        try:
            rev2 = await kv.put("k", b"v2")
            rev_new = await kv.put("new", b"n")
            assert (await mirror.get("k", TIMEOUT)).value == b"v1"     # it does lag
            assert await mirror.get("new", TIMEOUT) is None
            e = await r.get("mono", "k", strong=True)
            assert (e.value, e.revision) == (b"v2", rev2)
            e = await r.get("mono", "new", strong=True)
            assert e.revision == rev_new
            for _ in range(30):   # whichever peer answers, never older than what was read
                e = await r.get("mono", "k")
                assert (e.value, e.revision) == (b"v2", rev2)
                e = await r.get("mono", "new")
                assert e is not None and e.revision == rev_new
                got = await r.get_many("mono", ["k", "new"])
                assert [got["k"].revision, got["new"].revision] == [rev2, rev_new]
            assert mirror.stats.requests > 0             # the lagging mirror was asked
        finally:
            link.thaw()


@pytest.fixture(scope="module")
def two_mirrors(lagging_mirror, leaf_servers):
    """`lagging_mirror`, and a second mirror of `mono`, on leaf1, that keeps replicating
    while the lagging one's link is frozen."""
    hub0, lag_leaf, link = lagging_mirror
    leaf1 = leaf_servers["leaf1"]
    nats_run(leaf1.url, lambda js: add_hub_mirror(js, "KV_mono_leaf1", "KV_mono"))
    return hub0, lag_leaf, link, leaf1


async def wait_for_revision(p: Peer, key: str, rev: int) -> None:
    """Until `p` answers `key` at revision `rev` or later (its mirror has replicated it)."""
    for _ in range(600):
        e = await p.get(key, TIMEOUT)
        if e is not None and e.revision >= rev:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"peer {p.name} never answered {key} at revision {rev}")


@pytest.mark.parametrize("leader", ["absent", "frozen"])
async def test_a_lagging_answer_is_read_again_from_a_caught_up_mirror(two_mirrors, router_of, leader):
    """The lagging mirror answers first, older than revisions already read, and the
    leader is out of reach (no peer reaches the bucket's stream, or the hub connection hangs):
    the caught-up mirror answers, per key for MGET, in one batch. Without it the read fails;
    the stale revision is never handed out."""
    from kvcache.errors import UpstreamError
    hub0, lag_leaf, link, leaf1 = two_mirrors
    streams = {"lag": "KV_mono_lag", "leaf1": "KV_mono_leaf1", "hub": "KV_mono"}
    async with AsyncExitStack() as stack:
        hub_px = DelayProxy(port_of(hub0.url)).start()
        stack.callback(hub_px.stop)
        conns: dict[str, NatsConnection] = {}
        for name, url in (("lag", lag_leaf.url), ("leaf1", leaf1.url), ("hub", hub_px.url)):
            nc = conns[name] = NatsConnection()
            await nc.connect(servers=[url], connect_timeout=5)
            stack.push_async_callback(close_quietly, nc)
        writer = await nats.connect(hub0.url)
        stack.push_async_callback(writer.close)
        kv = await writer.jetstream().key_value("mono")
        keys = [f"{leader}.a", f"{leader}.b", f"{leader}.c"]
        a, b, c = keys
        lag, caught_up = Peer("lag", conns["lag"], streams["lag"], "mono"), \
            Peer("leaf1", conns["leaf1"], streams["leaf1"], "mono")
        await kv.put(a, b"a1")
        rev_c = await kv.put(c, b"c1")
        await wait_for_revision(lag, c, rev_c)

        def router(*names: str) -> tuple[Router, dict[str, Peer]]:
            """New (unmeasured) peers, so the first read goes to the first one named, and no
            hedges; the revisions the caught-up mirror answered count as already read."""
            ps = {n: Peer(n, conns[n], streams[n], "mono") for n in names}
            r = router_of(list(ps.values()), timeout=0.5, hedge_burst=0, hedge_ratio=0)
            for key, e in seen.items():
                r.floors.saw("mono", key, e)
            return r, ps

        link.freeze()                                   # the lag mirror stops replicating
        try:
            rev_a = await kv.put(a, b"a2")
            rev_b = await kv.put(b, b"b1")
            await wait_for_revision(caught_up, b, rev_b)
            seen = await caught_up.get_many(keys, TIMEOUT)
            assert [seen[k].revision for k in keys] == [rev_a, rev_b, rev_c]
            assert (await lag.get(a, TIMEOUT)).revision < rev_a and await lag.get(b, TIMEOUT) is None
            hub = ("hub",) if leader == "frozen" else ()
            if hub:
                hub_px.freeze()

            r, ps = router("lag", "leaf1", *hub)
            e = await r.get("mono", a)
            assert (e.value, e.revision, e.source) == (b"a2", rev_a, "leaf1")
            assert ps["lag"].stats.requests == 1                 # it did answer first

            r, ps = router("lag", "leaf1", *hub)
            got = await r.get_many("mono", keys)
            assert [(got[k].revision, got[k].source) for k in keys] == [
                (rev_a, "leaf1"), (rev_b, "leaf1"), (rev_c, "lag")]
            assert (ps["lag"].stats.requests, ps["leaf1"].stats.requests) == (1, 1)   # a and b: one batch

            r, _ = router("lag", *hub)                  # nobody has a revision at the floor
            with pytest.raises(UpstreamError, match="every reachable peer was behind"):
                await r.get("mono", a)
            with pytest.raises(UpstreamError, match="every reachable peer was behind"):
                await r.get_many("mono", keys)
        finally:
            link.thaw()
            hub_px.thaw()
