"""A peer's bookkeeping and reply reading in process (kvcache.read.peer, kvcache.read.peerset):
the latency estimate and percentiles the router decides by, how a failed request is counted
and what it raises, the keys remembered with a message, an entry read from a Direct Get reply
(a nats-py Msg as the client hands it over), and where the peers come from. Sending the
requests to a real server is tests/test_peer_live.py's.
"""
from __future__ import annotations

import math

import nats.errors
import pytest
from nats.aio.msg import Msg

from kvcache.entry import Entry, Operation
from kvcache.errors import UpstreamError
from kvcache.read import peer as peer_mod
from kvcache.read.peer import KNOWN_KEYS, Peer, PeerStats, header_int
from kvcache.read.peerset import PeerConnections, bucket_of, discovered_peers
from kvcache.store.record import NEVER

pytestmark = pytest.mark.timeout(10)   # a mutant stuck in a loop fails in seconds

STAMP = "2024-01-02 03:04:05.000000006 +0000 UTC"
STAMP_NS = 1704164645_000000006


class Conn:
    is_connected = True


def clock(monkeypatch, t: list[float]) -> None:
    monkeypatch.setattr(peer_mod.time, "monotonic", lambda: t[0])


# --------------------------------------------------------------------------- PeerStats


def test_the_estimate_takes_a_slower_sample_at_once_and_a_faster_one_by_its_age(monkeypatch):
    t = [100.0]
    clock(monkeypatch, t)
    s = PeerStats()
    s.observe(0.001)
    assert (s.ewma_us, s.last_sample, list(s.samples)) == (pytest.approx(1000.0), 100.0, [pytest.approx(1000.0)])
    s.observe(0.0)                       # at once after: weighs EWMA_ALPHA
    assert s.ewma_us == pytest.approx(900.0)
    t[0] = 100.5                         # half a second later: 1 - e^-1 of it
    s.observe(0.0)
    assert s.ewma_us == pytest.approx(900.0 * math.exp(-1))
    s.observe(0.002)                     # slower: taken at once, however recent the last
    assert s.ewma_us == pytest.approx(2000.0)
    t[0] = 110.0                         # long ago: almost all of the new one
    s.observe(0.001)
    assert s.ewma_us == pytest.approx(1000.0, rel=1e-6)
    assert len(s.samples) == 5 and s._fresh == 5
    s2 = PeerStats(ewma_us=5000.0)       # never sampled (last_sample 0): the first is taken as is
    s2.observe(0.001)
    assert s2.ewma_us == pytest.approx(1000.0)


def test_restart_forgets_every_figure():
    s = PeerStats()
    for us in range(20):
        s.observe(us / 1e6)
    s.percentile(0.5)
    s.restart()
    assert (list(s.samples), s._sorted, s._fresh, s.ewma_us, s.last_sample) == ([], [], 0, 0.0, 0.0)
    assert s.percentile(0.5) == 0.0


def test_percentiles_are_re_sorted_every_16_samples():
    s = PeerStats()
    assert s.percentile(0.5) == 0.0
    for us in (5.0, 1.0, 3.0):
        s.samples.append(us)
        s._fresh += 1
    assert [s.percentile(q) for q in (0.0, 0.5, 0.99, 1.0)] == [1.0, 3.0, 5.0, 5.0]   # fewer than 16: always
    for us in range(100, 113):
        s._sample(float(us), 1.0)
    assert s.percentile(1.0) == 112.0    # 16 samples: sorted again
    assert s._fresh == 0 and len(s._sorted) == 16
    for us in range(200, 215):
        s._sample(float(us), 1.0)
    assert s.percentile(1.0) == 112.0    # 15 new ones: the sorted copy stands
    s._sample(300.0, 1.0)
    assert s.percentile(1.0) == 300.0 and s.percentile(0.5) == 200.0
    s2 = PeerStats()
    for us in range(1, 101):
        s2.samples.append(float(us))
    assert [s2.percentile(q) for q in (0.5, 0.95, 0.99)] == [51.0, 96.0, 100.0]


# --------------------------------------------------------------------------- Peer bookkeeping


def peer(name: str = "p", stream: str = "KV_b", bucket: str = "b", domain: str | None = None) -> Peer:
    return Peer(name, Conn(), stream, bucket, domain=domain)  # type: ignore[arg-type]


def test_names_api_and_upstream():
    assert peer("main").label == "main.b" and peer("m1").label == "m1"
    assert peer().api == "$JS.API" and peer(domain="hub").api == "$JS.hub.API"
    assert peer().upstream and not peer(stream="KV_b_mirror").upstream
    p = peer()
    assert p.direct and p.domain is None and p.unanswered_since == 0.0 and p.inflight == 0


def test_a_request_is_counted_timed_and_ended():
    p = peer()
    p.unanswered_since = 3.0
    rid, start = p._begin()
    rid2, _ = p._begin()
    assert (rid, rid2, p.inflight, p.stats.requests) == (0, 1, 2, 2)
    assert start > 0 and p._started[rid] == start
    p._done(rid, start)
    assert p.inflight == 1 and len(p.stats.samples) == 1 and p.unanswered_since == 0.0
    assert 0 <= p.stats.samples[0] < 60e6     # the time it took (µs), not a moment


@pytest.mark.parametrize("exc, counted, raised", [
    (nats.errors.NoRespondersError(), (0, 0), nats.errors.NoRespondersError),
    (UpstreamError("x"), (1, 1), UpstreamError),
    (nats.errors.TimeoutError(), (1, 1), UpstreamError),
    (ConnectionResetError("reset"), (1, 1), UpstreamError),
    (ValueError("bug"), (1, 0), ValueError),
])
def test_a_failed_request_is_counted_and_raised_as(exc, counted, raised):
    p = peer("m1")
    rid, _ = p._begin()
    err = p._error(rid, exc)
    assert type(err) is raised and p.inflight == 0
    assert (p.stats.requests, p.stats.errors) == counted
    if raised is UpstreamError and not isinstance(exc, UpstreamError):
        assert str(err) == f"peer m1: {type(exc).__name__}: {exc}"
    else:
        assert err is exc


def test_failures_add_up():
    p = peer("m1")
    for exc in (ConnectionResetError(), nats.errors.TimeoutError(), UpstreamError("x")):
        p._error(p._begin()[0], exc)
    assert (p.stats.requests, p.stats.errors) == (3, 3)


def test_accounted_turns_a_nats_failure_into_an_upstream_error():
    p = peer("m1")
    with pytest.raises(UpstreamError, match=r"^peer m1: ConnectionResetError: gone$") as caught, p._accounted():
        raise ConnectionResetError("gone")
    assert caught.value.__suppress_context__ and p.stats.errors == 1
    mine = UpstreamError("mine")
    with pytest.raises(UpstreamError) as caught2, p._accounted():
        raise mine
    assert caught2.value is mine
    with p._accounted():
        pass
    assert (p.inflight, p.stats.requests, len(p.stats.samples)) == (0, 3, 1)


def test_keys_seen_with_a_message_are_remembered_up_to_known_keys():
    p = peer()
    p._saw("a", True)
    p._saw("b", True)
    p._saw("a", True)                     # already known: stays where it is
    assert list(p._has_message) == ["a", "b"]
    p._saw("a", False)
    p._saw("zz", False)
    assert list(p._has_message) == ["b"]
    for i in range(KNOWN_KEYS):
        p._saw(f"k{i}", True)
    assert len(p._has_message) == KNOWN_KEYS and "b" not in p._has_message
    assert next(iter(p._has_message)) == "k0"
    assert KNOWN_KEYS == 4096


# --------------------------------------------------------------------------- reading a reply


def msg(data: bytes = b"", **headers: str) -> Msg:
    hdrs = {k.replace("_", "-"): v for k, v in headers.items()} or None
    return Msg(None, subject="_INBOX.x", data=data, headers=hdrs)  # type: ignore[arg-type]


def test_an_entry_from_a_direct_get_reply():
    p = peer("m1")
    e = p._entry_from_msg(msg(b"V", Nats_Subject="$KV.b.x.y", Nats_Sequence="42", Nats_Time_Stamp=STAMP))
    assert e == Entry("b", "x.y", b"V", 42, STAMP_NS, 0, Operation.PUT, "m1", 0)
    assert p._entry_from_msg(msg(b"V", Nats_Subject="$KV.b.q", Nats_Sequence="3"), "given").key == "given"
    d = p._entry_from_msg(msg(b"", Nats_Subject="$KV.b.x", Nats_Sequence="7", KV_Operation="DEL"))
    assert (d.operation, d.value, d.revision, d.created) == (Operation.DEL, None, 7, 0)
    assert p._entry_from_msg(msg(b"V")) == Entry("b", "", b"V", 0, 0, 0, Operation.PUT, "m1", 0)
    assert p._entry_from_msg(msg(Status="404", Description="Message Not Found")) is None
    with pytest.raises(UpstreamError, match=r"^peer m1: Direct Get failed: 408 Bad Request$"):
        p._entry_from_msg(msg(Status="408", Description="Bad Request"))
    with pytest.raises(UpstreamError, match=r"^peer m1: Direct Get failed: 503$"):
        p._entry_from_msg(msg(Status="503"))


def test_numbers_and_failures_of_a_batch_reply():
    assert header_int({"Nats-Num-Pending": "7"}, "Nats-Num-Pending") == 7
    assert header_int({}, "Nats-Num-Pending") == 0 and header_int({"Nats-Num-Pending": ""}, "Nats-Num-Pending") == 0
    p = peer("m1")
    too_many = p._batch_failed("413", {"Description": "Too Many Results"})
    assert str(too_many) == "peer m1: multi_last failed: 413 Too Many Results"
    assert str(p._batch_failed("503", {})) == "peer m1: multi_last failed: 503"


def test_an_entrys_own_ttl():
    p = peer("m1")
    assert p._entry("k", b"v", {"Nats-TTL": "5s"}, 3, 1000).expires == 1000 + 5_000_000_000
    assert p._entry("k", b"v", {"Nats-TTL": "never"}, 3, 1000).expires == NEVER
    assert p._entry("k", b"v", {}, 3, 1000).expires == 0
    e = p._entry("k", b"v", {"KV-Operation": "PURGE"}, 3, 1000, source="leader")
    assert (e.value, e.operation, e.source, e.revision, e.created) == (None, Operation.PURGE, "leader", 3, 1000)


# --------------------------------------------------------------------------- peerset


class Made:
    def __init__(self, servers: list[str], fail: bool = False) -> None:
        self.servers, self.fail, self.closed = servers, fail, False

    async def close(self) -> None:
        self.closed = True
        if self.fail:
            raise nats.errors.ConnectionClosedError()


async def test_one_connection_per_server_set_and_the_main_one_shared():
    main = Made(["a", "b"])
    made: list[Made] = []

    async def connect(servers: list[str]) -> Made:
        made.append(Made(servers, fail=not made))
        return made[-1]

    conns = PeerConnections(["a", "b"], main, connect)  # type: ignore[arg-type]
    assert await conns.get(["b", "a"]) is main and not made
    c1 = await conns.get(["x"])
    assert await conns.get(["x"]) is c1 and len(made) == 1
    c2 = await conns.get(["x", "y"])
    assert c2 is not c1 and len(made) == 2
    await conns.close()
    assert c1.closed and c2.closed and not main.closed and conns._own == {}


def test_the_bucket_a_stream_holds():
    assert bucket_of("KV_b", {}) == "b"
    assert bucket_of("MIRROR", {"config": {"mirror": {"name": "KV_up"}}}) == "up"
    assert bucket_of("KV_own", {"config": {"mirror": {"name": "OTHER"}}}) == "own"
    assert bucket_of("KV_own", {"config": {"mirror": None}}) == "own"
    assert bucket_of("MIRROR", {"config": {"mirror": {"name": "OTHER"}}}) is None
    assert bucket_of("MIRROR", {"config": {}}) is None


def test_mirrors_discovered_from_alternates():
    nc = Conn()
    known = [peer("conf", stream="KV_b_conf", domain="leaf1")]
    info = {"domain": "hub", "alternates": [
        {"name": "KV_b", "domain": "hub"},          # the stream itself
        {"name": "KV_b_here", "domain": "hub"},     # our own domain: the plain API
        {"name": "KV_b_conf", "domain": "leaf1"},   # configured already
        {"name": "KV_b_leaf", "domain": "leaf2"},
        {"name": "KV_b_leaf", "domain": "leaf2"},   # listed twice
        {"name": "", "domain": "leaf3"},
        {"domain": "leaf4"},                        # no name
        {"name": "KV_b_nodom"},
    ]}
    got = discovered_peers(nc, "b", info, known)  # type: ignore[arg-type]
    assert [(p.name, p.stream, p.domain, p.bucket) for p in got] == [
        ("KV_b_here", "KV_b_here", None, "b"), ("KV_b_leaf@leaf2", "KV_b_leaf", "leaf2", "b"),
        ("KV_b_nodom", "KV_b_nodom", None, "b")]
    assert all(p.nc is nc and p.direct for p in got)
    assert discovered_peers(nc, "b", {"alternates": [{"name": "KV_b"}, {"name": "M", "domain": ""}]}, []) \
        [0].domain is None  # type: ignore[arg-type]
    assert discovered_peers(nc, "b", {}, []) == []  # type: ignore[arg-type]
