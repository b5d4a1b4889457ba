"""The fleet's relay (kvcache.feed.relay): one sidecar per bucket republishes the bucket's
stream on a core subject, shaped exactly as the stream's own RePublish would, so that the
followers need no consumer of their own; the role is elected and moves when its holder goes.

Real nats-server; the relays and elections are the objects a sidecar runs, each on a
connection of its own. What the fleet receives is checked against the stream itself (the
server's own RePublish of the same messages, and the message stored at each sequence).
"""
from __future__ import annotations

import asyncio
import os
import time

import nats
import nats.js.errors
import pytest
from nats.js.api import KeyValueConfig, RePublish
from support.checkers import new_bucket
from support.poll import until

from kvcache.feed.names import RELAY_SUFFIX, relay_name
from kvcache.feed.relay import (
    EARLY_503_RETRIES,
    PLACEMENT_TRIES,
    Relay,
    RelayElection,
    RelayLost,
    Seat,
    changes_subject,
    rfc3339_ns,
)
from kvcache.natsio.nats_connection import NatsConnection

pytestmark = pytest.mark.timeout(180)

PERIOD_S = 0.5


async def _connect(url: str) -> NatsConnection:
    nc = NatsConnection()
    await nc.connect(servers=[url], connect_timeout=5, allow_reconnect=False)
    return nc


async def _relay_consumers(js, stream: str) -> list[str]:
    return sorted(c.name for c in await js.consumers_info(stream) if c.name.endswith(RELAY_SUFFIX))


async def _stored(nc, stream: str, seq: int):
    """The message the stream holds at `seq` (STREAM.MSG.GET: subject, data, headers)."""
    return await nc.jetstream().get_msg(stream, seq)


class _Collect:
    """A fleet member's view of the changes subject: every message, in arrival order."""

    def __init__(self) -> None:
        self.msgs: list = []

    async def add(self, msg) -> None:
        self.msgs.append(msg)

    def seqs(self) -> list[int]:
        return [int(m.headers["Nats-Sequence"]) for m in self.msgs]


# ----------------------------------------------------------------------------- the message contract

@pytest.mark.quick
def test_time_stamps_are_written_as_republish_writes_them():
    assert rfc3339_ns(1_700_000_000_123_456_789) == "2023-11-14T22:13:20.123456789Z"
    assert rfc3339_ns(1_700_000_000_120_000_000) == "2023-11-14T22:13:20.12Z"
    assert rfc3339_ns(1_700_000_000_000_000_000) == "2023-11-14T22:13:20Z"


async def test_the_relay_publishes_what_the_stream_republishes(nats_server):
    """A bucket whose stream also RePublishes (to `rp.<bucket>.>`): the relay's messages must
    be the server's own copies, header for header (bar Nats-Last-Sequence, which the relay
    omits) and byte for byte, for puts, deletes, purges and TTL'd puts, from the sequence it
    was told to start at; and each payload must be what the stream holds at its sequence."""
    b = new_bucket()
    stream = f"KV_{b}"
    nc = await _connect(nats_server.url)
    try:
        js = nc.jetstream()
        kv = await js.create_key_value(KeyValueConfig(
            bucket=b, history=64, republish=RePublish(src=f"$KV.{b}.>", dest=f"rp.{b}.>")))
        await kv.put("before", b"not relayed")  # seq 1: the relay starts after it
        server_copies, relayed = _Collect(), _Collect()
        await nc.subscribe(f"rp.{b}.>", cb=server_copies.add)
        await nc.subscribe(changes_subject(None, b), cb=relayed.add)
        relay = Relay(nc, b, subject=changes_subject(None, b), name=relay_name("0123456789abcdef", "t"),
                      start_seq=2, heartbeat_s=1.0)
        task = asyncio.ensure_future(relay.run())
        await until(lambda: _relay_consumers(js, stream), what="the relay's consumer")
        rev = await kv.create("made", b"once")  # puts with expectation headers
        await kv.update("made", b"twice", last=rev)
        last = 0
        for i in range(50):
            last = await kv.put(f"k{i % 7}", f"value {i}".encode() * (i % 3 + 1))
        await kv.delete("k1")
        await kv.purge("k2")
        await kv.put("empty", b"")
        last = await kv.put("k3", bytes(range(256)))
        await until(lambda: relay.last_seq >= last and len(server_copies.msgs) >= last - 1,
                    what="every message relayed")
        relay.stop()
        await asyncio.wait_for(task, 10)
        assert await _relay_consumers(js, stream) == [], "the relay's consumer deleted when it stops"
        # the server republished seq 1 too (before the relay began); the relay starts at 2
        copies = [m for m in server_copies.msgs if int(m.headers["Nats-Sequence"]) >= 2]
        assert relayed.seqs() == list(range(2, last + 1))
        assert len(copies) == len(relayed.msgs)
        ops = set()
        for ours, theirs in zip(relayed.msgs, copies, strict=True):
            expected = dict(theirs.headers)
            expected.pop("Nats-Last-Sequence", None)
            assert ours.headers == expected
            assert ours.data == theirs.data
            try:
                got = await _stored(nc, stream, int(ours.headers["Nats-Sequence"]))
            except nats.js.errors.NotFoundError:  # what the purge of k2 removed
                assert ours.headers["Nats-Subject"] == f"$KV.{b}.k2"
                continue
            assert (got.data or b"") == ours.data and got.subject == ours.headers["Nats-Subject"]
            assert (got.headers or {}).items() <= ours.headers.items()
            ops.add(ours.headers.get("KV-Operation", "PUT"))
        assert ops == {"PUT", "DEL", "PURGE"}
        assert relay.relayed == last - 1 and relay.missed == 0
    finally:
        await nc.close()


async def test_a_relay_that_delivers_nothing_the_stream_holds_is_lost(nats_server):
    """A consumer that heartbeats but delivers nothing while the sidecar knows the stream
    holds more (one on a replica cut off from its group's writes; here, a sidecar told of a
    sequence the relay's consumer does not reach) ends the relay after three heartbeats, so
    that the fleet elects again rather than following a relay that relays nothing."""
    b = new_bucket()
    nc = await _connect(nats_server.url)
    try:
        kv = await nc.jetstream().create_key_value(KeyValueConfig(bucket=b, history=64))
        last = await kv.put("a", b"1")
        relay = Relay(nc, b, subject=changes_subject(None, b), name=relay_name("0123456789abcdef", "t"),
                      start_seq=1, heartbeat_s=0.3, newest=lambda: last + 5)
        with pytest.raises(RelayLost, match=f"holds sequence {last + 5}"):
            await asyncio.wait_for(relay.run(), 30)
        assert relay.last_seq == last, "what the stream held was relayed first"
        assert await _relay_consumers(nc.jetstream(), f"KV_{b}") == [], "its consumer deleted"
    finally:
        await nc.close()


@pytest.mark.quick
def test_no_responders_right_after_creation_is_asked_again_and_later_ends_the_relay():
    """On a cluster the first pull can reach a server the new consumer's interest has not
    reached yet (503 No Responders, seen in tests/test_relay.py's cluster runs): asked again
    shortly, a few times. Once the server has answered, a 503 ends the relay."""
    relay = Relay(None, "b", subject="s", name="n", start_seq=1)  # type: ignore[arg-type]  # statuses only
    for _ in range(EARLY_503_RETRIES):
        relay._status({"Status": "503"})
        assert relay._failure is None and relay._repull_at > 0 and relay._pending == 0
    relay._status({"Status": "503"})
    assert relay._failure is not None, "not forever"
    heard = Relay(None, "b", subject="s", name="n", start_seq=1)  # type: ignore[arg-type]
    heard._status({"Status": "100", "Nats-Last-Consumer": "0"})
    heard._status({"Status": "503"})
    assert heard._failure == "consumer ended: 503"


# ----------------------------------------------------------------------------- who relays

class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class _Conn:
    is_connected = True


def _election(clock: _Clock, sid: str) -> tuple[RelayElection, Seat]:
    e = RelayElection(_Conn(), sid=sid, name="n", clock=clock)  # type: ignore[arg-type]  # only the choice
    seat = Seat("b", PERIOD_S, lambda: 0, lambda: True, lambda: 0, silent_since=clock.t)
    e.seats["b"] = seat
    return e, seat


@pytest.mark.quick
def test_the_lowest_rank_takes_first_and_a_relay_of_lower_id_wins():
    clock = _Clock()
    a, sa = _election(clock, "10" + "0" * 14)
    b, sb = _election(clock, "c0" + "0" * 14)
    clock.t += 1.5 * PERIOD_S
    assert a.decide(sa) is None and b.decide(sb) is None, "1.5 periods of silence and a rank to wait"
    clock.t += 0.1 * PERIOD_S
    assert a.decide(sa) == "take" and b.decide(sb) is None, "the lower rank first"
    sa.relay = object()  # type: ignore[assignment]  # relaying
    b._on_beat(sb, b'{"from":"' + a.id.encode() + b'","relaying":true,"last_seq":7}')
    clock.t += 2 * PERIOD_S
    b._on_beat(sb, b'{"from":"' + a.id.encode() + b'","relaying":true,"last_seq":9}')
    assert b.decide(sb) is None, "a relay heard: no other takes"
    assert sb.previous_last == 9
    # both relay (a race): the higher id steps down, the lower goes on
    sb.relay = object()  # type: ignore[assignment]
    a._on_beat(sa, b'{"from":"' + b.id.encode() + b'","relaying":true,"last_seq":9}')
    assert a.decide(sa) is None
    assert (b.decide(sb) or "").startswith("leave:")
    sb.relay = None
    # the relay goes silent: the other takes within 1.5 periods plus its rank (< 2.5 periods)
    clock.t += 2.5 * PERIOD_S
    assert b.decide(sb) == "take"
    # a relay that leaves says so: the wait starts as if it had been silent 1.5 periods
    clock.t += PERIOD_S
    b._on_beat(sb, b'{"from":"' + a.id.encode() + b'","relaying":true,"last_seq":12}')
    assert b.decide(sb) is None
    b._on_beat(sb, b'{"from":"' + a.id.encode() + b'","relaying":false,"last_seq":12}')
    clock.t += 0.8 * PERIOD_S
    assert b.decide(sb) == "take"


@pytest.mark.quick
def test_an_unsynced_or_disconnected_sidecar_does_not_relay():
    clock = _Clock()
    e, seat = _election(clock, "00" + "0" * 14)
    seat.eligible = lambda: False
    clock.t += 10 * PERIOD_S
    assert e.decide(seat) is None
    seat.eligible = lambda: True
    assert e.decide(seat) == "take"
    seat.relay = object()  # type: ignore[assignment]
    e.nc.is_connected = False  # type: ignore[misc]
    assert e.decide(seat) == "leave: the NATS connection was lost"


@pytest.mark.quick
def test_a_new_relay_starts_where_the_last_one_stopped_or_its_replica_is():
    clock = _Clock()
    e, seat = _election(clock, "00" + "0" * 14)
    seat.position = lambda: 500
    assert e._start_seq(seat) == 501
    seat.previous_last = 480
    assert e._start_seq(seat) == 481, "what the last relay may not have published"
    seat.previous_last = 900
    assert e._start_seq(seat) == 501, "the followers hold it already (or fill it)"
    seat.position = lambda: 50_000
    seat.previous_last = 10
    assert e._start_seq(seat) == 40_001, "never more than REPLAY_MAX back"


async def test_one_relay_per_bucket_and_another_when_it_dies(nats_server):
    """Three sidecars' elections on a bucket (each on its own connection): one relays, with
    the one consumer named for a relay on the stream; a subscriber gets every write. The
    relay's connection is then cut (no goodbye reaches the fleet, its consumer is left
    behind; the relay steps down, seeing its connection gone): another takes over,
    the subscriber misses no sequence (the new relay starts where the old one's last beat
    said it was), and the old consumer is reaped."""
    b = new_bucket()
    stream = f"KV_{b}"
    admin = await nats.connect(nats_server.url, connect_timeout=5)
    conns: list[NatsConnection] = []
    elections: list[RelayElection] = []
    writer: asyncio.Task | None = None
    try:
        js = admin.jetstream()
        kv = await js.create_key_value(KeyValueConfig(bucket=b, history=64))  # nothing superseded goes
        seen = _Collect()
        await admin.subscribe(changes_subject(None, b), cb=seen.add)
        held = lambda: max(seen.seqs(), default=0)  # noqa: E731  # the followers' replica
        for _ in range(3):
            nc = await _connect(nats_server.url)
            conns.append(nc)
            sid = os.urandom(8).hex()
            e = RelayElection(nc, sid=sid, name=relay_name(sid, "t"), heartbeat_s=1.0, inactive_s=4.0)
            await e.follow(b, PERIOD_S, held, lambda: True)
            elections.append(e)

        def relays() -> list[RelayElection]:
            return [e for e in elections if e.relaying(b)]

        async def one_relay() -> bool:
            return len(relays()) == 1 and len(await _relay_consumers(js, stream)) == 1

        await until(one_relay, what="one relay and its one consumer")
        first = relays()[0]
        assert await _relay_consumers(js, stream) == [first.name]

        async def write() -> None:
            i = 0
            while True:
                await kv.put(f"k{i % 20}", f"v{i}".encode())
                i += 1
                await asyncio.sleep(0.01)
        writer = asyncio.ensure_future(write())
        await until(lambda: first.relayed(b) >= 20, what="the relay relaying")
        # cut the relay off: its connection closes, nothing it does reaches the server now
        cut = time.monotonic()
        await first.nc.close()
        await until(lambda: not first.relaying(b), what="the cut-off relay stepping down")
        others = [e for e in elections if e is not first]
        await until(lambda: any(e.relaying(b) for e in others), what="another relay")
        took = time.monotonic() - cut

        def settled_relay() -> RelayElection | None:
            now = [e for e in others if e.relaying(b)]
            return now[0] if len(now) == 1 and now[0].relayed(b) >= 20 else None
        second = await until(settled_relay, what="one new relay, relaying")
        writer.cancel()
        writer = None
        last = (await js.stream_info(stream)).state.last_seq
        await until(lambda: held() >= last, what="every write relayed")
        await until(lambda: _only(js, stream, second.name), what="the cut-off relay's consumer reaped")
        got = set(seen.seqs())
        missed = sorted(set(range(1, last + 1)) - got)
        dups = len(seen.msgs) - len(got)
        print(f"takeover after {took:.2f}s ({took / PERIOD_S:.1f} periods); {last} writes, "
              f"{dups} duplicates, missed {missed[:20]}")
        assert missed == []
        assert [e.relaying(b) for e in others].count(True) == 1
        for m in seen.msgs[-20:]:
            got_msg = await _stored(admin, stream, int(m.headers["Nats-Sequence"]))
            assert got_msg.data == m.data
    finally:
        if writer is not None:
            writer.cancel()
        for e in elections:
            await e.close()  # the cut one's too: its relay's end is collected
        for nc in conns:
            await nc.close()
        await admin.close()


async def _only(js, stream: str, name: str) -> bool:
    return await _relay_consumers(js, stream) == [name]


# ----------------------------------------------------------------------------- whole sidecars

async def test_sidecars_with_relays_on_elect_one_and_hand_it_over(nats_server, tmp_path):
    """Two sidecars (in this process) with relays on, one bucket with no RePublish (and Direct
    Get allowed, which the followers fill gaps with): one relays, INFO says which, a put
    reaches the changes subject; the relay stopped (gracefully), the other takes over and the
    stream holds only its consumer named for a relay."""
    from kvcache.config_sources import load as load_config
    from kvcache.sidecar import Sidecar

    b = new_bucket()
    stream = f"KV_{b}"
    admin = await nats.connect(nats_server.url, connect_timeout=5)
    sidecars: list[Sidecar] = []
    try:
        js = admin.jetstream()
        kv = await js.create_key_value(KeyValueConfig(bucket=b, history=64, direct=True))
        await kv.put("a", b"1")
        seen = _Collect()
        await admin.subscribe(changes_subject(None, b), cb=seen.add)
        env = {"KVCACHE_NATS_SERVERS": nats_server.url, "KVCACHE_BUCKETS": b, "KVCACHE_MAX_STALE_MS": "2000",
               "KVCACHE_METRICS_LISTEN": "127.0.0.1:0"}
        for i in range(2):
            cfg = load_config(env=env, overrides={"data_dir": str(tmp_path / f"s{i}")})
            s = Sidecar(cfg, relay=True)
            sidecars.append(s)
            await s.start()

        def relaying() -> list[Sidecar]:
            return [s for s in sidecars if s.relays is not None and s.relays.relaying(b)]

        async def one() -> bool:
            return len(relaying()) == 1 and len(await _relay_consumers(js, stream)) == 1
        await until(one, what="one sidecar relaying")
        first = relaying()[0]
        assert first.commands is not None
        buckets = first.commands.info_source.text({"buckets"})
        assert f"{b}:" in buckets and "relaying=1," in buckets, buckets
        seq = await kv.put("b", b"2")
        await until(lambda: seq in seen.seqs(), what="the put relayed")
        for s in sidecars:  # each says whether it relays; the relay counts what it relayed
            samples = await _relay_samples(s, b)
            assert samples["kvcache_relay_active"] == (s is first)
            assert (samples["kvcache_relay_messages_total"] >= 1) == (s is first)
        # every feed follows the relay's subject, the relay's own too: its consumer is the only one
        await until(lambda: all(s.feeds[b].follow_mode == "relay" for s in sidecars), what="both following the relay")
        for s in sidecars:
            assert await _follow_samples(s, b) == {"relay": 1.0}
        assert len(await js.consumers_info(stream)) == 1
        await first.stop()
        other = next(s for s in sidecars if s is not first)
        await until(lambda: relaying() == [other], what="the other sidecar relaying")
        assert other.relays is not None
        await until(lambda: _only(js, stream, other.relays.name), what="only the new relay's consumer")
        seq = await kv.put("c", b"3")
        await until(lambda: seq in seen.seqs(), what="the next put relayed")
    finally:
        for s in sidecars:
            await s.stop()
        await admin.close()


async def _relay_samples(sidecar, bucket: str) -> dict[str, float]:
    """The sidecar's kvcache_relay_* samples for `bucket`, scraped from its /metrics (in a
    thread: the sidecar serves it on this event loop)."""
    from prometheus_client.parser import text_string_to_metric_families
    from support.scrape import http_get

    status, body = await asyncio.to_thread(http_get, sidecar.stats.metrics_listen, "/metrics")
    assert status == 200
    return {s.name: s.value for fam in text_string_to_metric_families(body) for s in fam.samples
            if s.name.startswith("kvcache_relay_") and s.labels.get("bucket") == bucket}


async def _follow_samples(sidecar, bucket: str) -> dict[str, float]:
    """The sidecar's kvcache_feed_follow samples for `bucket`, by `source`."""
    from prometheus_client.parser import text_string_to_metric_families
    from support.scrape import http_get

    status, body = await asyncio.to_thread(http_get, sidecar.stats.metrics_listen, "/metrics")
    assert status == 200
    return {s.labels["source"]: s.value for fam in text_string_to_metric_families(body) for s in fam.samples
            if s.name == "kvcache_feed_follow" and s.labels.get("bucket") == bucket}


async def test_the_relay_consumer_is_placed_on_the_stream_leader(nats_cluster):
    """R3 stream: nats-server puts an R1 consumer on a random replica; the relay's is made
    again until it is on the leader (each round lands there with chance 1/3: four rounds all
    on it by chance, p = 1.2%, would hide a relay that does not look)."""
    from support.topology import replicated_kv, settled

    b = new_bucket()
    stream = f"KV_{b}"
    nc = await _connect(nats_cluster.urls[0])
    try:
        js = nc.jetstream(timeout=10)
        kv = await replicated_kv(js, bucket=b, replicas=3, history=64)
        await settled(lambda: kv.put("k", b"v"))
        retries = 0
        for _ in range(4):
            relay = Relay(nc, b, subject=changes_subject(None, b), name=relay_name("0123456789abcdef", "t"),
                          start_seq=1, heartbeat_s=1.0)
            task = asyncio.ensure_future(relay.run())
            await until(lambda r=relay, t=task: r.last_seq >= 1 or t.done(), 60, what="the relay relaying")
            assert not task.done(), task.exception()
            consumer = await js.consumer_info(stream, relay.name)
            leader = (await js.stream_info(stream)).cluster.leader
            assert consumer.cluster.leader == leader or relay.placement_retries == PLACEMENT_TRIES - 1
            retries += relay.placement_retries
            relay.stop()
            await asyncio.wait_for(task, 30)
        print(f"{retries} consumers made again in 4 rounds to land on the leader")
        assert retries > 0
    finally:
        await nc.close()


async def test_a_relay_whose_server_hangs_is_replaced_and_the_fleet_misses_nothing(nats_cluster):
    """3-node cluster, R3 bucket, three elections each on its own server. The relay's server
    hangs (SIGSTOP: its sockets stay open, nothing is answered or forwarded): the others hear
    no beat and one takes over; a subscriber on another server, written to all along, misses
    no sequence. The server resumes: the fleet settles back on one relay and one consumer
    named for a relay."""
    from support.topology import replicated_kv, settled

    b = new_bucket()
    stream = f"KV_{b}"
    conns: list[NatsConnection] = []
    elections: list[RelayElection] = []
    writer: asyncio.Task | None = None
    paused = None
    seen = _Collect()
    try:
        for url in nats_cluster.urls:
            conns.append(await _connect(url))
        js = conns[0].jetstream(timeout=10)
        kv = await replicated_kv(js, bucket=b, replicas=3, history=64)
        await settled(lambda: kv.put("k", b"v"))
        held = lambda: max(seen.seqs(), default=0)  # noqa: E731  # the followers' replica
        for nc in conns:
            sid = os.urandom(8).hex()
            e = RelayElection(nc, sid=sid, name=relay_name(sid, "t"), heartbeat_s=1.0, inactive_s=4.0)
            await e.follow(b, PERIOD_S, held, lambda: True)
            elections.append(e)
        await until(lambda: [e.relaying(b) for e in elections].count(True) == 1, 60, what="one relay")
        first = next(e for e in elections if e.relaying(b))
        i = elections.index(first)
        # the subscriber and the writer on another server than the relay's
        other = conns[(i + 1) % 3]
        await other.subscribe(changes_subject(None, b), cb=seen.add)
        await other.flush()
        okv = await other.jetstream(timeout=10).key_value(b)

        async def write() -> None:
            n = 0
            while True:
                try:
                    await okv.put(f"k{n % 20}", f"v{n}".encode())
                    n += 1
                except Exception:  # a new stream leader being elected: go on writing
                    pass
                await asyncio.sleep(0.02)
        writer = asyncio.ensure_future(write())
        await until(lambda: len(seen.msgs) >= 20, 30, what="writes relayed")
        first_seen = seen.seqs()[0]
        paused = nats_cluster.servers[i]
        paused.pause()
        cut = time.monotonic()
        others = [e for e in elections if e is not first]
        await until(lambda: any(e.relaying(b) for e in others), 60, what="a relay on the other servers")
        took = time.monotonic() - cut
        mark = held()
        await until(lambda: held() >= mark + 20, 60, what="writes relayed by the new relay")
        paused.resume()
        paused = None

        def one_relay() -> RelayElection | None:
            now = [e for e in elections if e.relaying(b)]
            return now[0] if len(now) == 1 else None
        await until(one_relay, 60, what="one relay again")
        writer.cancel()
        writer = None
        info = await settled(lambda: other.jetstream(timeout=10).stream_info(stream))
        last = info.state.last_seq
        await until(lambda: held() >= last, 60, what="every write relayed")

        async def settled_on_one() -> bool:
            # read together: the role may still move once more after the hang (the resumed
            # server's election hears the others late), and the consumers follow it
            relay = one_relay()
            return relay is not None and await _only(other.jetstream(timeout=10), stream, relay.name)
        await until(settled_on_one, 60, what="one relay, and one consumer named for a relay: its own")
        got = set(seen.seqs())
        missed = sorted(set(range(first_seen, last + 1)) - got)
        print(f"takeover {took:.2f}s after the hang ({took / PERIOD_S:.1f} periods); {last} writes, "
              f"{len(seen.msgs) - len(got)} duplicates, missed {missed[:20]}")
        assert missed == []
    finally:
        if paused is not None:
            paused.resume()
        if writer is not None:
            writer.cancel()
        for e in elections:
            await e.close()
        for nc in conns:
            await nc.close()
