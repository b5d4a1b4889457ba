"""The quorum fence on fallback reads, as Peer.get sends it: a one-key `multi_last`
batch, with the fence's anchor key beside it only for a key the peer has not seen with a
message. Whichever request form goes out, an answer counts only from a server whose own
end-of-batch reply shows it holds the fence's sequence.

A hub server and a leaf whose mirror of the bucket replicates through a DelayProxy: freezing
the link leaves the mirror behind the hub, a real server behind the fence. Assertions are
about answers and refusals, never about times; waits are on the mirror's stream state.
"""
from __future__ import annotations

from contextlib import AsyncExitStack
from types import SimpleNamespace

import nats
import pytest
from support.poll import until, wait_until
from support.topology import DelayProxy, add_hub_mirror, nats_run

from kvcache.errors import BehindQuorum, UpstreamError
from kvcache.feed.feed import Feed
from kvcache.feed.quorum import ANCHOR_MAX_BYTES, Fence
from kvcache.natsio import jetstream as jsapi
from kvcache.natsio.nats_connection import NatsConnection
from kvcache.natsio.nats_server import NatsServer, free_port
from kvcache.read.router import Peer, Router, RouterSettings

pytestmark = pytest.mark.timeout(120)

TIMEOUT = 2.0
BUCKET = "fc"
ANCHOR = "anchor"


@pytest.fixture(scope="module")
def hub_and_lagging_mirror(tmp_path_factory):
    """Bucket `fc` on hub server `hub` (domain hub), mirrored as KV_fc_lag on leaf `lag`,
    whose leaf connection to the hub runs through a DelayProxy (freeze: the mirror stops
    replicating). Yields (hub, leaf, link)."""
    base = tmp_path_factory.mktemp("fence")
    hub = NatsServer(base / "hub" / "js", server_name="hub", domain="hub",
                     leafnodes_listen_port=free_port("127.0.0.1")).start()
    link = leaf = None
    try:
        link = DelayProxy(hub.leafnodes_listen_port).start()
        leaf = NatsServer(base / "lag" / "js", server_name="lag", domain="lag",
                          leaf_remotes=[f"nats-leaf://127.0.0.1:{link.port}"]).start()
        wait_until(lambda: leaf.monitor("/leafz").get("leafnodes", 0) >= 1, 15, "leaf lag connected")

        async def setup(js):
            kv = await js.create_key_value(bucket=BUCKET, direct=True)
            await kv.put(ANCHOR, b"a")
            await kv.put("k", b"v1")
            return (await js.stream_info(f"KV_{BUCKET}")).state.last_seq
        last = nats_run(hub.url, setup)
        nats_run(leaf.url, lambda js: add_hub_mirror(js, f"KV_{BUCKET}_lag", f"KV_{BUCKET}", last))
        yield hub, leaf, link
    finally:
        if leaf is not None:
            leaf.stop()
        if link is not None:
            link.stop()
        hub.stop()


async def connected(stack: AsyncExitStack, url: str) -> NatsConnection:
    nc = NatsConnection()
    await nc.connect(servers=[url], connect_timeout=5)

    async def close() -> None:
        try:
            await nc.close()
        except OSError:
            pass
    stack.push_async_callback(close)
    return nc


async def last_seq(nc, stream: str, api: str = "$JS.API") -> int:
    return int((await jsapi.stream_info(nc, stream, TIMEOUT, api))["state"]["last_seq"])


async def test_a_server_behind_the_fence_is_refused_whatever_the_request_form(hub_and_lagging_mirror):
    hub, leaf, link = hub_and_lagging_mirror
    async with AsyncExitStack() as stack:
        lag_nc, hub_nc = await connected(stack, leaf.url), await connected(stack, hub.url)
        mirror = Peer("lag", lag_nc, f"KV_{BUCKET}_lag", BUCKET)
        upstream = Peer("hub", hub_nc, f"KV_{BUCKET}", BUCKET)
        writer = await nats.connect(hub.url)
        stack.push_async_callback(writer.close)
        kv = await writer.jetstream().key_value(BUCKET)

        # Caught up: the mirror holds the fence's sequence, and its answers count. After this
        # the peer knows `k` has a message: its fenced reads of `k` go without the anchor.
        at = Fence(await last_seq(hub_nc, f"KV_{BUCKET}"), ANCHOR)
        assert (await mirror.get("k", TIMEOUT, fence=at)).value == b"v1"
        assert await mirror.get("never", TIMEOUT, fence=at) is None   # anchored: a not-found, proven

        link.freeze()                                    # the mirror stops replicating
        try:
            rev2 = await kv.put("k", b"v2")
            await kv.put("new", b"n")
            fence = Fence(await last_seq(hub_nc, f"KV_{BUCKET}"), ANCHOR)
            assert (await mirror.get("k", TIMEOUT)).value == b"v1"      # unfenced, it does lag

            # Behind the fence: refused for a key it knows (the key asked alone), a key it
            # lacks and one nobody wrote (anchored), and by a peer with no hints at all.
            fresh = Peer("lag-fresh", lag_nc, f"KV_{BUCKET}_lag", BUCKET)
            for peer, key in ((mirror, "k"), (mirror, "new"), (mirror, "never"), (fresh, "k")):
                with pytest.raises(BehindQuorum):
                    await peer.get(key, TIMEOUT, fence=fence)

            # The server holding the sequence answers every form.
            e = await upstream.get("k", TIMEOUT, fence=fence)
            assert (e.value, e.revision) == (b"v2", rev2)
            assert (await upstream.get("new", TIMEOUT, fence=fence)).value == b"n"
            assert await upstream.get("never", TIMEOUT, fence=fence) is None

            # Through the router: the mirror alone cannot answer; beside the hub, every read
            # is the hub's current value, whichever peer was asked first.
            alone = Router(TIMEOUT, RouterSettings(), fence=lambda bucket: fence)
            alone.add(mirror)
            with pytest.raises(UpstreamError):
                await alone.get(BUCKET, "k")
            both = Router(TIMEOUT, RouterSettings(hedge_ratio=0.0, hedge_burst=0.0), fence=lambda bucket: fence)
            for p in (Peer("lag2", lag_nc, f"KV_{BUCKET}_lag", BUCKET), Peer("hub2", hub_nc, f"KV_{BUCKET}", BUCKET)):
                both.add(p)
            try:
                for _ in range(20):
                    assert (await both.get(BUCKET, "k")).value == b"v2"
            finally:
                await alone.close()
                await both.close()
        finally:
            link.thaw()

        # Once the mirror holds the sequence, its answers count again.
        async def reached() -> bool:
            return await last_seq(lag_nc, f"KV_{BUCKET}_lag") >= fence.seq
        await until(reached, 30, f"the mirror to reach sequence {fence.seq}")
        e = await mirror.get("k", TIMEOUT, fence=fence)
        assert (e.value, e.revision) == (b"v2", rev2)


async def test_a_known_key_that_lost_its_message_is_asked_again_with_the_anchor(hub_and_lagging_mirror):
    """A key the peer saw with a message goes without the anchor; when its message is gone
    (purged from the stream, no marker), the 404 carries no sequence, so the read is asked
    again with the anchor, and that reply's own sequence is what counts."""
    hub, _, _ = hub_and_lagging_mirror
    async with AsyncExitStack() as stack:
        nc = await connected(stack, hub.url)
        writer = await nats.connect(hub.url)
        stack.push_async_callback(writer.close)
        js = writer.jetstream()
        kv = await js.key_value(BUCKET)
        await kv.put("gone", b"g")
        peer = Peer("hub", nc, f"KV_{BUCKET}", BUCKET)
        seq = await last_seq(nc, f"KV_{BUCKET}")
        assert (await peer.get("gone", TIMEOUT, fence=Fence(seq, ANCHOR))).value == b"g"

        await js.purge_stream(f"KV_{BUCKET}", subject=f"$KV.{BUCKET}.gone")
        assert await peer.get("gone", TIMEOUT, fence=Fence(seq, ANCHOR)) is None
        await kv.put("gone", b"g2")                      # known again, then gone again
        assert (await peer.get("gone", TIMEOUT, fence=Fence(seq, ANCHOR))).value == b"g2"
        await js.purge_stream(f"KV_{BUCKET}", subject=f"$KV.{BUCKET}.gone")
        with pytest.raises(BehindQuorum):                # the anchored reply is checked too
            await peer.get("gone", TIMEOUT, fence=Fence(await last_seq(nc, f"KV_{BUCKET}") + 1, ANCHOR))
        await kv.put("gone", b"g3")
        await peer.get("gone", TIMEOUT, fence=Fence(seq, ANCHOR))
        await js.purge_stream(f"KV_{BUCKET}", subject=f"$KV.{BUCKET}.gone")
        with pytest.raises(BehindQuorum):                # no anchor: nothing can show the sequence
            await peer.get("gone", TIMEOUT, fence=Fence(seq, ""))


def test_the_anchor_is_a_small_put_of_the_latest_batch_when_there_is_one():
    """The anchor's value comes back with every anchored fenced read: the feed takes the
    newest put of the batch within ANCHOR_MAX_BYTES, else the newest put; deletes never."""
    feed = SimpleNamespace(anchor="before")
    big, small = b"x" * (ANCHOR_MAX_BYTES + 1), b"y" * 10
    Feed._note_anchor(feed, [(b"big1", big), (b"small", small), (b"big2", big), (b"deleted", None)])
    assert feed.anchor == "small"
    Feed._note_anchor(feed, [(b"big1", big), (b"big2", big), (b"deleted", None)])
    assert feed.anchor == "big2"
    Feed._note_anchor(feed, [(b"deleted", None)])
    assert feed.anchor == "big2"
