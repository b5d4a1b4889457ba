"""kvcache.read.peer.Peer's requests against a real nats-server, small and quick enough to run
once per mutant (`make mutation`): which request each read form sends (a second client
subscribed to the stream's Direct Get subjects sees every request go by), what each reply
turns into, and what fails how. Where the peers come from (kvcache.read.peerset) and the
bucket's last revision (Router.last_revision) are asked of the same server.

A server that takes a request and never answers is a plain subscriber on a Direct Get subject
of a stream that does not exist (STALL): the request times out, as one to a stalled server does.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import nats
import pytest
from nats.js.api import StreamConfig, StreamSource
from support.poll import until
from support.topology import nats_run

from kvcache.config import PeerConfig
from kvcache.entry import Operation
from kvcache.errors import BehindQuorum, ReplyBudget, ReplyTooLarge, UpstreamError
from kvcache.feed.quorum import Fence
from kvcache.natsio import jetstream as jsapi
from kvcache.natsio.nats_connection import NatsConnection
from kvcache.read import peer as peer_mod
from kvcache.read.peer import Peer
from kvcache.read.peerset import PeerConnections, configured_peers
from kvcache.read.router import Router, RouterSettings

# In `make mutation`'s selection (pyproject.toml); a mutant that leaves a request waiting
# forever fails in seconds (the server and its data included), not at the suite's 300 s.
pytestmark = [pytest.mark.mutation, pytest.mark.timeout(30)]

TIMEOUT = 5.0
BIG = 1025        # subjects under $KV.big.>: one more than a multi_last may match


@pytest.fixture(scope="module")
def data(nats_server_module) -> dict:
    url = nats_server_module.url
    out: dict = {"url": url}

    async def setup(js):
        kv = await js.create_key_value(bucket="pl", direct=True, history=5)
        out["a"] = await kv.put("a", b"A")
        out["b"] = await kv.put("b", b"B")
        await kv.put("gone", b"x")
        await kv.delete("gone")
        out["gone"] = (await js.stream_info("KV_pl")).state.last_seq
        out["pit"] = await kv.put("pit", b"old")
        out["pit2"] = await kv.put("pit", b"new")
        await kv.put("w.1", b"w")
        await kv.put("w.2", b"w")
        out["empty"] = await kv.put("empty", b"")
        out["last"] = out["empty"]
        await js.create_key_value(bucket="plempty", direct=True)
        nd = await js.create_key_value(bucket="plnd")        # no allow_direct
        out["nd"] = await nd.put("k", b"K")
        await js.add_stream(StreamConfig(name="KV_pl_m", mirror=StreamSource(name="KV_pl"),
                                         mirror_direct=True, allow_direct=True))
        await js.add_stream(StreamConfig(name="OTHER", subjects=["other.>"], allow_direct=True))
        await js.add_stream(StreamConfig(name="BIGS", subjects=["$KV.big.>"], allow_direct=True))
        nc = js._nc
        for i in range(BIG):
            await nc.publish(f"$KV.big.{i}", b"b")
        await nc.flush()

        async def all_in() -> bool:
            return (await js.stream_info("BIGS")).state.messages == BIG
        await until(all_in, 30, "the big stream to hold every message")

    nats_run(url, setup)
    return out


@pytest.fixture
async def nc(data) -> AsyncIterator[NatsConnection]:
    conn = NatsConnection()
    await conn.connect(servers=[data["url"]])
    try:
        yield conn
    finally:
        await conn.close()


@pytest.fixture
async def plain(data) -> AsyncIterator[nats.NATS]:
    """A nats-py client: the peer's path for a connection that is not kvcache's."""
    conn = await nats.connect(data["url"])
    try:
        yield conn
    finally:
        await conn.close()


@pytest.fixture(params=["kvcache", "nats-py"])
async def either(request, data) -> AsyncIterator[nats.NATS]:
    """kvcache's connection (its fast lanes), then a nats-py client (nats-py's requests)."""
    conn = NatsConnection() if request.param == "kvcache" else nats.NATS()
    await conn.connect(servers=[data["url"]])
    try:
        yield conn
    finally:
        await conn.close()


class Tap:
    """Every Direct Get request sent to a stream, as a plain subscriber sees it go by."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, bytes]] = []

    async def start(self, nc, stream: str, sender) -> Tap:
        """Subscribed, and seen to see: markers (no reply subject: no server answers them)
        are sent over the connection the requests will go by until one arrives. (The first
        message another connection sends right after the subscription's PONG can miss it:
        seen here about once in thirty.)"""
        marker = f"$JS.API.DIRECT.GET.{stream}.tap"
        ready = False

        async def cb(msg):
            nonlocal ready
            if msg.subject == marker:    # a late marker is no request
                ready = True
            else:
                self.seen.append((msg.subject, msg.data))
        for subject in (f"$JS.API.DIRECT.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}.>"):
            await nc.subscribe(subject, cb=cb)
        await nc.flush()

        async def marked() -> bool:
            if ready:
                return True
            await sender.publish(marker, b"")
            await sender.flush()
            return False
        await until(marked, 10, "the tap's marker")
        self.seen.clear()
        return self

    async def requests(self, n: int) -> list[dict]:
        """The JSON requests once `n` have gone by (a subject-appended one as {"subject": ...})."""
        async def arrived() -> bool:
            return len(self.seen) >= n
        await until(arrived, 10, f"{n} Direct Get requests", detail=lambda: f"seen: {self.seen}")
        got = [json.loads(data) if data else {"subject": subject} for subject, data in self.seen]
        self.seen.clear()
        return got


@pytest.fixture
async def tap(data, request) -> AsyncIterator[Tap]:
    """A Tap on stream KV_pl, over a connection of its own, ready for requests sent over
    the test's connection (`either` or `nc`)."""
    sender = request.getfixturevalue("either" if "either" in request.fixturenames else "nc")
    watcher = await nats.connect(data["url"])
    try:
        yield await Tap().start(watcher, "KV_pl", sender)
    finally:
        await watcher.close()


async def stalled(nc) -> None:
    """A subscriber that takes Direct Get requests for stream STALL and never answers."""
    await nc.subscribe("$JS.API.DIRECT.GET.STALL", cb=_ignore)
    await nc.subscribe("$JS.API.DIRECT.GET.STALL.>", cb=_ignore)
    await nc.flush()


async def _ignore(msg) -> None:
    pass


def peer(nc, bucket: str = "pl", stream: str | None = None, name: str = "main", direct: bool = True) -> Peer:
    return Peer(name, nc, stream or f"KV_{bucket}", bucket, direct=direct)


def subjects(req: dict) -> list[str]:
    return [s.rsplit(".", 1)[1] for s in req["multi_last"]]


# --------------------------------------------------------------------------- single key


async def test_direct_get_found_missing_deleted(either, data, tap):
    p = peer(either)
    t = tap
    e = await p.get("a", TIMEOUT)
    assert (e.bucket, e.key, e.value, e.revision, e.operation, e.source) == (
        "pl", "a", b"A", data["a"], Operation.PUT, "main.pl")
    assert e.created > 0
    assert await p.get("nosuch", TIMEOUT) is None
    gone = await p.get("gone", TIMEOUT)
    assert (gone.operation, gone.value, gone.revision) == (Operation.DEL, None, data["gone"])
    assert [r["subject"] for r in await t.requests(3)] == [
        "$JS.API.DIRECT.GET.KV_pl.$KV.pl.a", "$JS.API.DIRECT.GET.KV_pl.$KV.pl.nosuch",
        "$JS.API.DIRECT.GET.KV_pl.$KV.pl.gone"]
    assert (p.stats.requests, p.stats.errors, p.inflight, len(p.stats.samples)) == (3, 0, 0, 3)
    assert p.direct and list(p._has_message) == ["a", "gone"]


async def test_leader_get(nc, data):
    p = peer(nc)
    e = await p.get("a", TIMEOUT, leader=True)
    assert (e.key, e.value, e.revision, e.source, e.operation) == ("a", b"A", data["a"], "leader", Operation.PUT)
    assert e.created == (await p.get("a", TIMEOUT)).created
    assert await p.get("nosuch", TIMEOUT, leader=True) is None
    gone = await p.get("gone", TIMEOUT, leader=True)
    assert (gone.operation, gone.value, gone.revision) == (Operation.DEL, None, data["gone"])
    assert (p.stats.requests, p.stats.errors) == (4, 0)
    empty = await p.get("empty", TIMEOUT, leader=True)      # a put of no bytes has no "data"
    assert (empty.value, empty.revision) == (b"", data["empty"])
    for direct in (True, False):     # a stream that is not there is an error, not a miss
        missing = Peer("main", nc, "KV_nosuchbucket", "nosuchbucket", direct=direct)
        with pytest.raises(UpstreamError):
            await missing.get("a", TIMEOUT)
        with pytest.raises(UpstreamError):
            await missing.get("a", TIMEOUT, leader=True)
        assert missing.stats.errors == 2 and missing.inflight == 0


async def test_a_stream_without_allow_direct_is_read_from_its_leader(nc, data):
    p = peer(nc, "plnd")
    e = await p.get("k", TIMEOUT)
    assert (e.value, e.revision, e.source) == (b"K", data["nd"], "leader")
    assert not p.direct and (p.stats.requests, p.stats.errors, p.inflight) == (1, 0, 0)
    assert await p.get("nosuch", TIMEOUT) is None and p.stats.requests == 2


async def test_direct_request_forms_statuses_and_timeout(nc, plain, data):
    p = peer(nc)
    with pytest.raises(UpstreamError, match=r"^peer main.pl: Direct Get failed: 408"):
        await p.direct_request("a", json.dumps({"seq": 1}).encode(), TIMEOUT)
    for conn in (nc, plain):
        e = await peer(conn).direct_request(None, json.dumps({"last_by_subj": "$KV.pl.b"}).encode(), TIMEOUT)
        assert (e.key, e.value, e.revision) == ("b", b"B", data["b"])
    assert not p._has_message
    for conn in (nc, plain):
        await stalled(conn)
        s = Peer("stall", conn, "STALL", "pl")
        with pytest.raises(UpstreamError, match=r"^peer stall: Direct Get timed out after 0\.3s$"):
            await s.get("a", 0.3)
        assert (s.stats.requests, s.stats.errors, s.inflight) == (1, 1, 0)


# --------------------------------------------------------------------------- fenced single key


async def test_a_fenced_read_asks_the_anchor_beside_a_key_not_known_to_have_a_message(nc, data, tap):
    p = peer(nc)
    t = tap
    fence = Fence(data["last"], "a")
    e = await p.get("b", TIMEOUT, fence=fence)
    assert (e.key, e.value, e.revision, e.source) == ("b", b"B", data["b"], "main.pl")
    assert await p.get("b", TIMEOUT, fence=fence) == e               # known now: alone
    assert await p.get("nosuch", TIMEOUT, fence=fence) is None       # anchored: proven
    assert (await p.get("a", TIMEOUT, fence=fence)).value == b"A"    # the anchor itself: alone
    reqs = await t.requests(4)
    assert [(subjects(r), r["batch"]) for r in reqs[:4]] == [
        (["b", "a"], 2), (["b"], 1), (["nosuch", "a"], 2), (["a"], 1)]
    assert list(p._has_message) == ["b", "a"]
    assert (p.stats.requests, p.stats.errors) == (4, 0)


async def test_a_known_key_answering_404_is_asked_again_with_the_anchor(either, data, tap):
    for conn in (either,):
        p = peer(conn)
        t = tap
        p._has_message["nosuch"] = None           # seen with a message once; none now
        assert await p.get("nosuch", TIMEOUT, fence=Fence(data["last"], "a")) is None
        assert [subjects(r) for r in await t.requests(2)] == [["nosuch"], ["nosuch", "a"]]
        assert "nosuch" not in p._has_message
        p._has_message["nosuch"] = None
        with pytest.raises(BehindQuorum, match=r"^peer main.pl: cannot show it holds stream sequence 3 "):
            await p.get("nosuch", TIMEOUT, fence=Fence(3, ""))   # no anchor to ask beside it


async def test_a_server_behind_the_fence_is_refused(nc, data):
    p = peer(nc)
    ahead = Fence(data["last"] + 1, "a")
    for key in ("b", "b", "nosuch"):              # unknown, then known (alone), then anchored
        with pytest.raises(BehindQuorum, match=f"^peer main.pl: holds the stream up to {data['last']}, "
                                               f"below {data['last'] + 1} which a quorum had"):
            await p.get(key, TIMEOUT, fence=ahead)
        p._has_message["b"] = None
    for fence in (Fence(1, ""), Fence(1, "nosuch"), Fence(1, "alsomissing")):   # nothing to anchor a not-found
        with pytest.raises(BehindQuorum, match=r"no key to anchor the read"):
            await p.get("nosuch", TIMEOUT, fence=fence)
    assert (p.stats.requests, p.stats.errors, p.inflight) == (6, 6, 0)
    p._has_message["nosuch"] = None     # known, gone, and the anchored read again is behind:
    with pytest.raises(BehindQuorum):   # no longer known either way
        await p.get("nosuch", TIMEOUT, fence=ahead)
    assert "nosuch" not in p._has_message


async def test_a_fenced_read_that_cannot_show_the_key_fails(nc, plain, data, tap):
    """A key whose reply never names it (a wildcard: the batch ends before any match of it
    is the key itself) is asked twice, then fails."""
    p = peer(nc)
    t = tap
    with pytest.raises(UpstreamError, match=r"^peer main.pl: no reply showed key \* with the server's sequence$"):
        await p.get("*", TIMEOUT, fence=Fence(data["last"], "a"))
    assert [(subjects(r), r["batch"]) for r in await t.requests(2)] == [(["*", "a"], 2), (["*"], 1)]
    with pytest.raises(UpstreamError, match=r"no reply showed key w\.\*"):   # one more pending, not the key
        await p.get("w.*", TIMEOUT, fence=Fence(data["last"], "a"))
    big = Peer("big", nc, "BIGS", "big")
    with pytest.raises(UpstreamError, match=r"^peer big: multi_last failed: 413 Too Many Results$"):
        await big.get(">", TIMEOUT, fence=Fence(1, "0"))
    for conn in (nc, plain):
        await stalled(conn)
        with pytest.raises(UpstreamError, match=r"^peer stall: multi_last timed out$"):
            await Peer("stall", conn, "STALL", "pl").get("a", 0.3, fence=Fence(1, "b"))


# --------------------------------------------------------------------------- many keys


async def test_multi_last_mixed(either, data, tap):
    p = peer(either)
    t = tap
    got = await p.get_many(["a", "nosuch", "gone"], TIMEOUT)
    assert sorted(got) == ["a", "gone", "nosuch"]
    assert (got["a"].value, got["a"].revision, got["a"].source) == (b"A", data["a"], "main.pl")
    assert got["nosuch"] is None and got["gone"].operation is Operation.DEL
    assert await p.get_many(["nosuch1", "nosuch2"], TIMEOUT) == {"nosuch1": None, "nosuch2": None}
    assert [r for r in await t.requests(2)] == [
        {"multi_last": ["$KV.pl.a", "$KV.pl.nosuch", "$KV.pl.gone"], "batch": 3},
        {"multi_last": ["$KV.pl.nosuch1", "$KV.pl.nosuch2"], "batch": 2}]
    assert list(p._has_message) == ["a", "gone"] and (p.stats.requests, p.inflight) == (2, 0)


async def test_batches_of_multi_last_max_keys_share_one_snapshot(nc, data, monkeypatch, tap):
    monkeypatch.setattr(peer_mod, "MULTI_LAST_MAX", 2)
    p = peer(nc)
    t = tap
    keys = ["a", "b", "pit", "gone", "nosuch"]
    got = await p.get_many(keys, TIMEOUT)
    assert [got[k] and got[k].revision for k in keys] == [data["a"], data["b"], data["pit2"], data["gone"], None]
    reqs = await t.requests(3)
    assert [subjects(r) for r in reqs] == [["a", "b"], ["pit", "gone"], ["nosuch"]]
    assert [r.get("up_to_seq") for r in reqs] == [None, data["last"], data["last"]]
    # a point in time: every batch at it
    got = await p.get_many(["a", "pit", "b"], TIMEOUT, up_to_seq=data["pit"])
    assert [got[k].value for k in ("a", "pit", "b")] == [b"A", b"old", b"B"]
    assert [r.get("up_to_seq") for r in await t.requests(2)] == [data["pit"], data["pit"]]
    # a fence: the first batch shows it (with the anchor), the rest go as usual
    got = await p.get_many(["nosuch", "pit", "b"], TIMEOUT, fence=Fence(data["last"], "a"))
    assert [subjects(r) for r in await t.requests(2)] == [["nosuch", "pit", "a"], ["b"]]
    assert got["pit"].value == b"new" and got["nosuch"] is None
    await p.get_many(["a", "b"], TIMEOUT, fence=Fence(data["last"], "a"))
    assert [subjects(r) for r in await t.requests(1)] == [["a", "b"]]     # the anchor is among them


async def test_a_batch_ended_early_is_asked_again_for_the_rest(nc, data, tap):
    """A wildcard among the keys: the server ends the batch at `batch` messages with more
    pending; the keys still missing are asked again, at the first reply's sequence."""
    p = peer(nc)
    t = tap
    got = await p.get_many(["a", "w.*"], TIMEOUT)      # a, w.1, and one more pending
    assert got["a"].value == b"A" and got["w.*"] is None
    reqs = await t.requests(2)
    assert [(subjects(r), r.get("up_to_seq")) for r in reqs] == [(["a", "*"], None), (["*"], data["last"])]
    await p.get_many(["a", "nosuch"], TIMEOUT)       # nothing pending: one request
    await p.get_many(["*", "nosuch"], TIMEOUT)        # no key answered: no second request
    assert len(await t.requests(2)) == 2
    await p.get_many(["nosuch"], TIMEOUT, fence=Fence(0, "a"))   # no fence: no anchor
    assert [subjects(r) for r in await t.requests(1)] == [["nosuch"]]


async def test_multi_last_fences(nc, data):
    p = peer(nc)
    with pytest.raises(BehindQuorum, match=f"^peer main.pl: holds the stream up to {data['last']}, below "):
        await p.get_many(["a", "b"], TIMEOUT, fence=Fence(data["last"] + 1, "a"))
    with pytest.raises(BehindQuorum, match=r"no key to anchor the read"):
        await p.get_many(["nosuch"], TIMEOUT, fence=Fence(1))
    assert await p.get_many(["nosuch"], TIMEOUT, fence=Fence(1, "a")) == {"nosuch": None}
    assert await p.get_many(["nosuch"], TIMEOUT, fence=Fence(0, "a")) == {"nosuch": None}
    assert (p.stats.requests, p.stats.errors) == (4, 2)


async def test_multi_last_errors(nc, plain, data):
    big = Peer("big", nc, "BIGS", "big")
    with pytest.raises(UpstreamError, match=r"^peer big: multi_last failed: 413 Too Many Results$"):
        await big.get_many([">"], TIMEOUT)
    assert big.stats.errors == 1
    for conn in (nc, plain):
        await stalled(conn)
        with pytest.raises(UpstreamError, match=r"^peer stall: multi_last timed out$"):
            await Peer("stall", conn, "STALL", "pl").get_many(["a"], 0.3)


async def test_many_keys_without_allow_direct(nc, data):
    p = peer(nc, "plnd")
    got = await p.get_many(["k", "nosuch"], TIMEOUT)
    assert got["k"].value == b"K" and got["k"].source == "leader" and got["nosuch"] is None
    assert not p.direct
    with pytest.raises(UpstreamError, match=r"^peer main.plnd: no Direct Get responders "
                                            r"\(a point-in-time read needs allow_direct\)$"):
        await peer(nc, "plnd").get_many(["k"], TIMEOUT, up_to_seq=1)


@pytest.mark.parametrize("direct", [True, False])
async def test_values_are_charged_to_the_budget(nc, direct, data):
    p = peer(nc, "pl" if direct else "plnd", direct=direct)
    keys = ["a", "b", "gone"] if direct else ["k", "nosuch"]
    budget = ReplyBudget(10)
    await p.get_many(keys, TIMEOUT, budget=budget)
    assert budget.left == 8 if direct else budget.left == 9
    tight = ReplyBudget(1)
    with pytest.raises(ReplyTooLarge):
        await p.get_many(["a", "b"] if direct else ["k", "k"], TIMEOUT, budget=tight)
    assert tight.left == 1      # a failed attempt charges nothing
    if not direct:              # found out on the way: the leader's answers are charged too
        switching = ReplyBudget(10)
        await peer(nc, "plnd").get_many(["k"], TIMEOUT, budget=switching)
        assert switching.left == 9


# --------------------------------------------------------------------------- peerset and router


async def test_configured_peers(nc, data, caplog):
    made: list[NatsConnection] = []

    async def connect(servers: list[str]) -> NatsConnection:
        if servers == ["nats://127.0.0.1:1"]:
            raise OSError("refused")
        conn = NatsConnection()
        await conn.connect(servers=servers)
        made.append(conn)
        return conn

    conns = PeerConnections([data["url"]], nc, connect)
    pcs = [PeerConfig("up", [data["url"]], "KV_pl"), PeerConfig("mirror", [data["url"], data["url"] + "/"], "KV_pl_m"),
           PeerConfig("nd", [data["url"]], "KV_plnd"), PeerConfig("missing", [data["url"]], "NOPE"),
           PeerConfig("other", [data["url"]], "OTHER"), PeerConfig("away", ["nats://127.0.0.1:1"], "KV_pl"),
           PeerConfig("far", [data["url"]], "KV_pl", domain="nowhere")]
    try:
        with caplog.at_level(logging.WARNING, logger="kvcache"):
            got = await configured_peers(pcs, {"pl", "plnd"}, conns, TIMEOUT)
        assert [(p.name, p.stream, p.bucket, p.direct, p.nc is nc) for p in got] == [
            ("up", "KV_pl", "pl", True, True), ("mirror", "KV_pl_m", "pl", True, False),
            ("nd", "KV_plnd", "plnd", False, True)]
        left = [r.getMessage() for r in caplog.records]
        assert left[0].startswith("peer missing left out: ") and left[3].startswith("peer far left out: ")
        assert left[1] == "peer other left out: stream OTHER serves no configured bucket"
        assert left[2] == "peer away left out: refused" and len(left) == 4
        assert (await got[1].get("a", TIMEOUT)).value == b"A"
    finally:
        await conns.close()
    assert all(c.is_closed for c in made)


async def test_last_revision_is_the_leaders(nc, data):
    r = Router(TIMEOUT)
    r.add(peer(nc, stream="KV_pl_m", name="mirror"))
    with pytest.raises(UpstreamError, match=r"from its leader"):
        await r.last_revision("pl")
    r.add(peer(nc))
    assert await r.last_revision("pl") == (await jsapi.stream_info(nc, "KV_pl", TIMEOUT))["state"]["last_seq"]
    assert await r.last_revision("pl") >= data["last"]
    empty = Router(TIMEOUT)
    empty.add(peer(nc, "plempty"))
    assert await empty.last_revision("plempty") == 0
    far = Router(TIMEOUT)                       # asked through its domain's API, which nobody serves
    far.add(Peer("far", nc, "KV_pl", "pl", domain="nowhere"))
    with pytest.raises(UpstreamError, match=r"no JetStream responders for \$JS.nowhere.API.STREAM.INFO.KV_pl"):
        await far.last_revision("pl")


async def test_last_revision_waits_out_a_stalled_leader_then_fails_over(nc, data):
    """No hedge (STREAM.INFO is no read to race): the router's timeout, then the next peer."""
    await nc.subscribe("$JS.stalled.API.STREAM.INFO.KV_pl", cb=_ignore)
    await nc.flush()
    r = Router(0.3, RouterSettings(hedge_min_s=0.001, hedge_default_s=0.001))
    stalled_peer = Peer("stalled", nc, "KV_pl", "pl", domain="stalled")
    r.add(stalled_peer)
    r.add(peer(nc))
    got = await asyncio.wait_for(r.last_revision("pl"), 10)
    assert got >= data["last"] and r.hedges_sent == 0 and r.health[stalled_peer].failures == 1


async def test_a_stalled_leader_api_times_out_with_the_timeout_given(nc, data):
    """The leader API of a domain nobody answers in time: every form waits the timeout it is
    given, then fails (no Direct Get responders there: the single-key and many-key reads
    switch to the leader API first)."""
    await nc.subscribe("$JS.slow.API.STREAM.MSG.GET.KV_pl", cb=_ignore)
    await nc.flush()
    for p, read in ((Peer("slow", nc, "KV_pl", "pl", domain="slow"), "get"),
                    (Peer("slow", nc, "KV_pl", "pl", domain="slow"), "many"),
                    (Peer("slow", nc, "KV_pl", "pl", domain="slow", direct=False), "many"),
                    (Peer("slow", nc, "KV_pl", "pl", domain="slow"), "leader")):
        call = (p.get("a", 0.3, leader=read == "leader") if read != "many" else p.get_many(["a"], 0.3))
        with pytest.raises(UpstreamError, match=r"JetStream API timed out: \$JS.slow.API.STREAM.MSG.GET.KV_pl"):
            await asyncio.wait_for(call, 10)
        assert p.direct == (read == "leader") and p.stats.errors == 1


async def test_a_closed_connection_is_an_upstream_error(data):
    conn = NatsConnection()
    await conn.connect(servers=[data["url"]])
    await conn.close()
    p = peer(conn)
    with pytest.raises(UpstreamError, match=r"^peer main.pl: ConnectionClosedError: "):
        await p.get("a", TIMEOUT)
    with pytest.raises(UpstreamError, match=r"^peer main.pl: ConnectionClosedError: "):
        await p.get_many(["a"], TIMEOUT)
    assert (p.stats.requests, p.stats.errors, p.inflight) == (2, 2, 0)


async def test_a_slow_direct_get_is_waited_for_as_long_as_asked(plain, data):
    """A Direct Get answered after a second is an answer to a read with a 5 s timeout (nats-py's
    own default would give up at 0.5 s)."""
    async def slow(msg):
        await asyncio.sleep(1.0)       # the server's slowness itself, not a wait for state
        await plain.publish(msg.reply, b"S", headers={"Nats-Subject": "$KV.pl.a", "Nats-Sequence": "9"})
    await plain.subscribe("$JS.API.DIRECT.GET.SLOW.>", cb=slow)
    await plain.flush()
    e = await Peer("slow", plain, "SLOW", "pl").get("a", TIMEOUT)
    assert (e.value, e.revision) == (b"S", 9)
