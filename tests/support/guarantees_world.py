"""The executor of the guarantees' table (tests/support/guarantees.py: the model): one sidecar's
read side wired as kvcache.sidecar wires it, in process, over a real LMDB replica, with three
stand-ins and nothing else:

- the clock: the feed's wall clock (its freshness, its meta record, LocalReader's check) is a
  FakeClock the story moves; asyncio's own time runs as it does;
- the consumer: a feed state is played on the real kvcache.feed.feed.Feed by the calls its
  consumer loop makes (`_choose_start`, `_new_consumer`, `_on_batch`, `_on_idle`,
  `note_evidence`, and what `_run` does on a lost consumer or a failed write), each at its
  moment of the story, so the ledger, the near cache, the change hub and the replica's
  meta record hear of it as they would;
- NATS: ScriptedPeer, a kvcache.read.peer.Peer whose requests are answered from the leader's
  truth (the model's history, as acknowledged by now), a Direct Get optionally by a follower
  that lags, fenced as the real one is; it fails or times out when the row says so, and
  records every request (keys, leader or not, fence).

The router (kvcache.read.router.Router, its floors the ledger's), the reads (kvcache.read.reads),
the command layer, both twins of the GET fast path and LocalReader are the real ones; the
reads come in through real client connections (tests/support/command_layer's recording
transport). A held read waits MINREV_WAIT_S, which the table sets to a millisecond: whether
the replica reaches the revision meanwhile is the story's to say, not the wait's length.
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import os
import time
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace

from kvcache.app import app_get as app_get_twin
from kvcache.app.client import encode_command
from kvcache.app.reader import LocalReader
from kvcache.config import BucketConfig, Config
from kvcache.entry import Entry
from kvcache.errors import BehindQuorum, KvcacheError, ReplicaError, UpstreamError
from kvcache.feed.changes import ChangeHub
from kvcache.feed.feed import Feed
from kvcache.feed.quorum import NO_FENCE, Fence
from kvcache.natsio.natsproto import Run
from kvcache.read.ledger import Ledger
from kvcache.read.peer import Peer
from kvcache.read.policy import ReadPolicy
from kvcache.read.reads import Reads
from kvcache.read.router import Router
from kvcache.resp import ReplyError, ReplyReader
from kvcache.serve.commands import Commands
from kvcache.serve.info import Info
from kvcache.serve.multi import Transactions
from kvcache.serve.pubsub import PubSub
from kvcache.serve.resp_server import RespServer
from kvcache.serve.streams import Streams
from kvcache.serve.tracking import Tracking
from kvcache.stats import Stats
from kvcache.store.nearcache import NearCache, drop_store
from kvcache.store.record import item
from kvcache.store.replica import BucketMeta, Replica
from kvcache.store.revindex import put_entry
from support import guarantees as g
from support.command_layer import RecordingTransport, connection_module

MS = 1_000_000
MAP_BYTES = 1 << 20  # the replica's map, fixed: a write larger than it fails (a full disk)
ROUTER_TIMEOUT_S = 0.005
NOT_YET = object()


class FakeClock:
    """The wall clock of the feed and of LocalReader: `t0` is the read's moment; the story
    moves `now` forward with `at(ms)`, ms relative to t0."""

    def __init__(self) -> None:
        self.t0 = time.time_ns()
        self.now = self.t0 - 20_000 * MS

    def time_ns(self) -> int:
        return self.now

    def at(self, ms: int) -> None:
        assert self.t0 + ms * MS >= self.now, "the story goes forward"
        self.now = self.t0 + ms * MS

    def ns(self, ms: int) -> int:
        return self.t0 + ms * MS


class FakeNc:
    """The NATS connection a never-started feed and the peer are built with: nothing is sent."""

    is_connected = True
    max_payload = 1 << 20

    def new_inbox(self) -> str:
        return "_INBOX.guarantees"


@dataclass
class Asked:
    keys: tuple[str, ...]
    leader: bool
    fence: int
    mode: str


class Upstream:
    """The leader's truth (the story's writes acknowledged by now, in the stream's current
    numbering) and how NATS answers: `mode` up, down or timeout; `follower_seq`: Direct Gets
    are answered by a member holding up to that sequence."""

    def __init__(self, clock: FakeClock, state: g.State) -> None:
        self.clock = clock
        self.state = state
        self.gen = 1
        self.mode = "up"
        self.follower_seq: int | None = None
        self.asked: list[Asked] = []

    def visible(self, upto: int | None = None) -> list[g.Write]:
        now = self.clock.now
        return [w for w in self.state.history if w.gen == self.gen and self.clock.ns(w.at_ms) <= now
                and (upto is None or w.seq <= upto)]

    def last_seq(self) -> int:
        return max((w.seq for w in self.visible()), default=0)

    def entry(self, key: str, upto: int | None, source: str) -> Entry | None:
        found = [w for w in self.visible(upto) if w.key == key]
        if not found:
            return None
        w = found[-1]
        return Entry(g.BUCKET, key, g.value_of(w), w.seq, self.clock.ns(w.at_ms), 0, source=source)


class ScriptedPeer(Peer):
    """The bucket's one peer (the main connection's, on the bucket's own stream), answering
    from Upstream; see the module docstring."""

    truth: Upstream

    async def get(self, key: str, timeout: float, leader: bool = False, fence: Fence = NO_FENCE) -> Entry | None:
        return (await self._answer([key], timeout, leader, fence))[key]

    async def get_many(self, keys: list[str], timeout: float, up_to_seq: int | None = None,
                       budget=None, fence: Fence = NO_FENCE) -> dict[str, Entry | None]:
        got = await self._answer(keys, timeout, False, fence)
        if budget is not None:
            for e in got.values():
                if e is not None and e.value:
                    budget.spend(len(e.value))
        return got

    async def _answer(self, keys: list[str], timeout: float, leader: bool, fence: Fence) -> dict[str, Entry | None]:
        up = self.truth
        up.asked.append(Asked(tuple(keys), leader, fence.seq, up.mode))
        self.stats.requests += 1
        if up.mode == "down":
            raise UpstreamError(f"peer {self.label}: no responders")
        if up.mode == "timeout":
            await asyncio.sleep(timeout)
            raise UpstreamError(f"peer {self.label}: Direct Get timed out after {timeout:.3f}s")
        upto = None if leader else up.follower_seq
        if not leader and fence.seq:
            held = min(upto, up.last_seq()) if upto is not None else up.last_seq()
            if held < fence.seq:
                raise BehindQuorum(f"peer {self.label}: holds the stream up to {held}, below {fence.seq}")
        return {k: up.entry(k, upto, "leader" if leader else self.label) for k in keys}


class AccessRecorder:
    """kvcache.ops.accesslog.AccessLog's interface, on and sampling every read: which source
    the read path says answered each key (the GET fast path records none)."""

    enabled = True
    records = 0

    def __init__(self) -> None:
        self.log: list[tuple[str, str, str]] = []

    def sampled(self) -> bool:
        return True

    def record(self, bucket: str, key: str, source: str, hit: bool, latency_us: int, command: str) -> None:
        self.log.append((key, source, command))


def _no_plan(key: bytes) -> bool:
    return False


class Shared:
    """What every row shares: the replica's files, the connection modules of both twins, the
    GET fast paths (the native one keeps its LMDB environment open for good, so one per
    process), and the copies LocalReader reads (Shared.snapshot). `current` is the
    world of the row being run: the fast paths plan through its read policy."""

    def __init__(self, tmp) -> None:
        self.dir = str(tmp)
        self.replica = Replica(str(tmp / "replica"), map_size=MAP_BYTES, max_map_size=MAP_BYTES, buckets=1)
        self.replica.set_buckets([g.BUCKET])
        self.replica.put_meta(g.BUCKET, BucketMeta(stream="KV_b", synced=True, filters=["in.>"]))
        self.twin = connection_module(True)
        self.native = connection_module(False)
        self.current: World | None = None

        def planner(raw: bytes):
            assert self.current is not None
            return self.current.policy.plan(raw)
        self.gets = {
            "twin": self.twin.SERVER_GET.ServerGets(self.replica, planner),
            "native": self.native.SERVER_GET.ServerGets(self.replica, planner),
            "generic": self.twin.SERVER_GET.ServerGets(self.replica, _no_plan),
        }
        self.copies = itertools.count(1)

    def time_module(self) -> SimpleNamespace:
        """What `import time` gives the feed and LocalReader: the current row's FakeClock for
        the wall clock (the real one between rows), the real rest."""
        def now() -> int:
            return self.current.clock.now if self.current is not None else time.time_ns()
        return SimpleNamespace(time_ns=now, time=lambda: now() / 1e9, monotonic=time.monotonic,
                               monotonic_ns=time.monotonic_ns, perf_counter=time.perf_counter,
                               perf_counter_ns=time.perf_counter_ns)

    def reset(self) -> None:
        """An empty bucket: records, indexes, near cache and meta."""
        self.replica.clear_bucket(g.BUCKET)
        drop_store(self.replica, g.BUCKET)
        self.replica.put_meta(g.BUCKET, BucketMeta())

    def snapshot(self) -> str:
        """A data directory holding a consistent copy of the replica as it is now: what an
        application's process maps (py-lmdb opens a path once per process, and the writer
        has it open here)."""
        path = os.path.join(self.dir, f"app{next(self.copies)}")
        os.makedirs(os.path.join(path, "replica"))
        self.replica.env.copy(os.path.join(path, "replica"))
        return path

    def close(self) -> None:
        self.replica.close()


def _path_of(form: g.Form) -> tuple[str, str]:
    """(connection module, fast path) a form's reads come through: the generic path's forms
    over a fast path that plans nothing, the twin's over the pure-Python one, the rest (as a
    sidecar serves) over the native one."""
    if form.name.endswith("generic path"):
        return "twin", "generic"
    if form.name.endswith("(twin)") and form.kind == "point":
        return "twin", "twin"
    return "native", "native"


@dataclass
class Seen:
    """One key's answer as the checker sees it: its source in the model's words, revision
    (0: not found), numbering, and the error's text."""

    source: str = ""
    revision: int = 0
    gen: int = 0
    error: str = ""
    top: int = 0  # a stream read: the highest revision it gave

    def show(self) -> str:
        if self.error:
            return f"error ({self.error[:90]})"
        return f"{self.source} g{self.gen}@{self.revision}" + (f" top {self.top}" if self.top else "")


class Conn:
    """A client connection of the world, its replies parsed off its recording transport
    (RESP3 `invalidate` pushes kept apart)."""

    def __init__(self, world: World, proto: int = 2) -> None:
        self.conn = world.module.ClientConnection(world.server, next(world.ids))
        self.transport = RecordingTransport()
        self.conn.connection_made(self.transport)
        self.reader = ReplyReader(NOT_YET)
        self.taken = 0
        self.replies: list[object] = []
        self.pushes: list[list] = []
        self.proto = proto

    def drain(self) -> None:
        data = self.transport.written
        if len(data) > self.taken:
            self.reader.feed(bytes(data[self.taken:]))
            self.taken = len(data)
        while True:
            r = self.reader.gets()
            if r is NOT_YET:
                return
            if self.proto == 3 and isinstance(r, list) and r and r[0] == b"invalidate":
                self.pushes.append(r)
            else:
                self.replies.append(r)

    async def call(self, *commands) -> list[object]:
        """Send the commands as one read; their replies once all are written (and whatever
        the server pushes right after them)."""
        self.drain()
        start = len(self.replies)
        self.conn.data_received(b"".join(encode_command(c) for c in commands))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 120  # a hang, not a slow host
        while True:
            self.drain()
            if len(self.replies) - start >= len(commands):
                await asyncio.sleep(0)
                self.drain()
                return self.replies[start:start + len(commands)]
            assert loop.time() < deadline, f"no reply to {commands}"
            await asyncio.sleep(0)


class TrackingClient:
    """A CLIENT TRACKING client that keeps what it reads and, at the next moment of the story,
    reads again whatever it was told to drop."""

    def __init__(self, conn: Conn) -> None:
        self.conn = conn
        self.kept: Seen | None = None
        self.seen_pushes = 0

    def told(self) -> None:
        self.conn.drain()
        pushes = self.conn.pushes[self.seen_pushes:]
        self.seen_pushes = len(self.conn.pushes)
        for p in pushes:
            keys = p[1]
            if keys is None or g.KEY.encode() in keys:
                self.kept = None


class World:
    """One row's sidecar (see the module docstring), built afresh over the shared replica."""

    def __init__(self, shared: Shared, state: g.State, holding: str, upstream: str, form: g.Form) -> None:
        self.shared, self.state, self.holding, self.upstream_mode, self.form = shared, state, holding, upstream, form
        self.clock = FakeClock()
        shared.reset()
        replica = shared.replica
        self.bc = bc = BucketConfig(name=g.BUCKET, keys=["in.>"], max_stale_ms=g.BOUND_MS, cache_max_keys=100,
                                    serve_stale=upstream == "timeout, serve_stale")
        self.cfg = cfg = Config(data_dir=shared.dir, buckets=[bc], heartbeat_ms=g.HEARTBEAT_MS)
        self.stats = Stats()
        self.ledger = ledger = Ledger(max_age=lambda bucket: 0)
        self.feeds: dict[str, Feed] = {}
        feeds = self.feeds
        self.hub = hub = ChangeHub()
        feed = Feed(FakeNc(), bc, replica, heartbeat_s=g.HEARTBEAT_MS / 1000,  # type: ignore[arg-type]
                    timeout=ROUTER_TIMEOUT_S,
                    on_applied=functools.partial(ledger.applied, bc.name),
                    on_resync=functools.partial(ledger.resync_began, bc.name),
                    on_renumbered=functools.partial(ledger.renumbered, bc.name),
                    on_removed=functools.partial(ledger.removed, bc.name), hub=hub)
        feed.set_cache(NearCache(replica, bc.name, max_keys=100))
        feed.freshness.clock = self.clock.time_ns
        feed.freshness._born_ns = self.clock.now
        feed.anchor = g.FILLER  # a key with a message: no background look for one
        self.feed = feeds[bc.name] = feed
        ledger.witness(feed)
        self.upstream = Upstream(self.clock, state)
        self.router = Router(ROUTER_TIMEOUT_S, floors=ledger.floors, fence=lambda b: feeds[b].fence())
        peer = ScriptedPeer("main", FakeNc(), "KV_b", g.BUCKET)  # type: ignore[arg-type]
        peer.truth = self.upstream
        self.router.add(peer)
        self.policy = policy = ReadPolicy(cfg, replica, feeds, ledger)
        module_name, gets_name = _path_of(form)
        self.module: ModuleType = shared.twin if module_name == "twin" else shared.native
        self.gets = gets = shared.gets[gets_name]
        shared.current = self
        gets.set_buckets([(bc.name, ledger.witnesses[bc.name], bc.max_stale_ms, False, None)], bc.name)
        gets.forget_fresh()
        gets.call_soon = asyncio.get_running_loop().call_soon
        ledger.on_hold = gets.forget_fresh  # a held key must not ride a cached verdict
        clients: dict = {}
        self.tracking = Tracking(cfg.tracking_table_max_keys, cfg.default_bucket, clients.get, on_first=hub.wake)
        pubsub = PubSub(cfg.notify_keyspace_events, cfg.default_bucket)
        transactions = Transactions(policy)
        streams = Streams(cfg, replica, feeds, ledger, on_first=hub.wake)
        for listener in (self.tracking, pubsub, transactions, streams):
            hub.add(listener)
        hub.follow(streams)
        self.access = AccessRecorder()
        self.reads = Reads(cfg, policy, self.router, self.stats, self.access)  # type: ignore[arg-type]
        info = Info(cfg, self.stats, replica, feeds, self.router, self.access, self.tracking, pubsub,  # type: ignore[arg-type]
                    gets.cache_reads, streams)
        commands = Commands(cfg, self.reads, self.stats, self.tracking, pubsub, transactions, info,
                            streams, clients.values)
        self.server = RespServer(cfg, commands, self.stats, gets, clients)
        self.ids = itertools.count(1)
        self.conns: list[Conn] = []
        # what was handed out before the read: key -> [(numbering, revision)]; and the highest
        # revision of the bucket's stream the row's connection was handed
        self.handed: dict[str, list[tuple[int, int]]] = {}
        self.stream_handed = 0
        self.row = self.connect()
        self.other = self.connect()
        self.tracker: TrackingClient | None = None
        self.watching = False

    # ------------------------------------------------------------------ connections

    def connect(self, proto: int = 2) -> Conn:
        c = Conn(self, proto)
        self.conns.append(c)
        return c

    async def close(self) -> None:
        for c in self.conns:
            c.conn.connection_lost(None)
        await self.hub.stop()
        await self.router.close()
        self.shared.current = None
        for _ in range(3):  # let requests still in flight (a failed read's) end
            await asyncio.sleep(0)

    # ------------------------------------------------------------------ the feed's consumer

    @property
    def quorum_stream(self) -> bool:
        """Is the bucket's stream replicated (its freshness needs a quorum's evidence)?"""
        return not self.state.quorum or self.state.follower_seq is not None

    def _info(self, first: int = 1) -> dict:
        """The stream's STREAM.INFO as its leader answers it now."""
        info: dict = {"config": {"max_age": 0, "allow_direct": True, "num_replicas": 1},
                      "state": {"first_seq": first, "last_seq": self.upstream.last_seq()},
                      "created": f"gen{self.upstream.gen}"}
        if self.quorum_stream:
            info["config"]["num_replicas"] = 3
            info["cluster"] = {"leader": "n1", "replicas": [{"name": "n2", "active": 50 * MS},
                                                            {"name": "n3", "active": 60 * MS}]}
        return info

    async def at(self, ms: int) -> None:
        """The story's next moment: the clock moves (and with it, more than the GET fast
        path's FRESH_VERDICT_S: its verdicts are asked again), the staleness watch and a
        tracking client get their turn."""
        self.clock.at(ms)
        self.gets.forget_fresh()
        await self.settle()

    async def settle(self) -> None:
        if self.watching:
            await asyncio.sleep(0.003)  # the staleness watch looks (every millisecond here)
        if self.tracker is not None:
            await self._track()

    async def start_over(self, first: int = 1) -> None:
        """The consumer loop's replan (Feed._replan): the stream as its leader shows it, a
        resume or a full resync, and a new consumer."""
        self.feed._choose_start(self._info(first))
        self.feed._new_consumer()
        await self.settle()

    def _run(self, seqs: list[int], pending: int) -> Run:
        by_seq = {w.seq: w for w in self.state.history if w.gen == self.upstream.gen}
        run = Run(1, 1)
        for s in seqs:
            w = by_seq[s]
            lk, rec = item(w.key.encode(), g.value_of(w), w.seq, self.clock.ns(w.at_ms))
            run.items.append((lk, rec))
            run.entries.append(put_entry(lk, w.seq))
            run.last_ts = self.clock.ns(w.at_ms)
        run.last_cseq = len(seqs)  # one consumer sequence per message, as a real delivery has
        run.top_sseq = max(seqs)
        run.last_pending = pending
        return run

    async def deliver(self, seqs: list[int], pending: int = 0) -> None:
        """A batch of the consumer's (in the order given: a full sync's is subject order);
        `pending`: messages the server has still to deliver."""
        self.feed._on_batch([self._run(seqs, pending)])
        await self.settle()

    async def deliver_fails(self, seqs: list[int], pending: int = 0) -> None:
        """A batch whose write fails (the replica's map is full), and what the consumer loop
        does then (Feed._run: a ReplicaError ends the consumer; the next one starts at the
        same batch again)."""
        try:
            self.feed._on_batch([self._run(seqs, pending)])
        except ReplicaError:
            self.feed.recreations["replica_error"] += 1
        else:
            raise AssertionError("the write was to fail: the story is wrong")
        self.feed.freshness.caught_up = False
        self.feed.freshness.interrupted = True
        await self.settle()

    async def idle(self, last_seq: int = 0) -> None:
        """An idle heartbeat: caught up, nothing more (Feed._on_idle)."""
        self.feed._on_idle(last_seq)
        await self.settle()

    async def consumer_lost(self) -> None:
        """What Feed._run does when its consumer is lost (missed heartbeats, a recreated stream)."""
        self.feed.recreations["heartbeat"] += 1
        self.feed._flush("consumer")
        self.feed.freshness.caught_up = False
        self.feed.freshness.interrupted = True
        await self.settle()

    async def evidence(self, last_seq: int, healthy: bool = True) -> None:
        """A state poll's STREAM.INFO of the replicated stream: its followers heard 50 ms ago,
        or none heard (a leader cut off: it proves nothing)."""
        info = self._info()
        info["state"]["last_seq"] = last_seq
        if not healthy:
            info["cluster"]["replicas"] = [{"name": "n2", "offline": True}, {"name": "n3", "active": 0}]
        self.feed.note_evidence(info, self.clock.now)
        await self.settle()

    # ------------------------------------------------------------------ reads before the row's

    def note(self, key: str, value: object) -> Seen:
        """A value handed out (a reply's), noted with its revision."""
        if value is None:
            return Seen(revision=0, gen=self.upstream.gen)
        if isinstance(value, ReplyError):
            return Seen(error=str(value))
        gen, vkey, seq = g.parse_value(value)  # type: ignore[arg-type]
        assert vkey == key, (vkey, key)
        self.handed.setdefault(key, []).append((gen, seq))
        return Seen(revision=seq, gen=gen)

    async def kv_get(self, conn: Conn, key: str, *opts: str) -> None:
        reply, = await conn.call(["KV.GET", key, *opts])
        if isinstance(reply, list):
            self.note(key, reply[0])

    async def acquire(self, when: str) -> None:
        """The row's holding, taken at its moment (`when`: "hold", earlier in the story, or
        "t0", just before the read): see guarantees.HOLDINGS."""
        h, kind = self.holding, self.form.kind
        keys = (g.KEY,) if kind == "stream" else self.form.keys
        if (h == "hold" and when == "hold") or (h == "floor" and when == "t0"):
            if kind == "stream":
                await self.stream_read(self.row)
            else:
                for key in keys:
                    await self.kv_get(self.other, key, "CONSISTENCY", "strong")
        elif h == "minrev" and when == "t0":
            conn = self.row if kind in ("point", "exec_watch", "stream") else self.other
            for key in keys:
                await self.kv_get(conn, key, "MINREV", str(g.latest(self.state, key)))

    async def hold_point(self) -> None:
        await self.acquire("hold")

    async def warm(self) -> None:
        """An application read out.o once: the near cache holds it from then on (the feed
        keeps it current)."""
        reply, = await self.connect().call(["GET", g.OUTSIDE])
        self.note(g.OUTSIDE, reply)

    async def start_tracking(self) -> None:
        c = self.connect(proto=3)
        await c.call(["HELLO", "3"], ["CLIENT", "TRACKING", "ON"])
        self.tracker = TrackingClient(c)
        self.hub.start_watch(self.feeds.values())
        self.watching = True
        await self._track()

    async def _track(self) -> None:
        t = self.tracker
        assert t is not None
        t.told()
        if t.kept is None and self.clock.now < self.clock.t0:
            reply, = await t.conn.call(["GET", g.KEY])
            seen = self.note(g.KEY, reply)
            seen.source = "client"
            t.kept = seen
            t.told()  # an invalidation right after the reply: kept no longer than that

    # ------------------------------------------------------------------ the row's read

    def stream_key(self) -> str:
        return "@b" + (":in.k" if self.form.name.endswith(":in.k") else "")

    async def stream_read(self, conn: Conn) -> Seen:
        """XREAD or XRANGE of the form's stream from the start: in.k's entry and the top."""
        key = self.stream_key()
        if self.form.name.startswith("XREAD"):
            reply, = await conn.call(["XREAD", "STREAMS", key, "0"])
            entries = reply[0][1] if isinstance(reply, list) else []  # type: ignore[index]
        else:
            reply, = await conn.call(["XRANGE", key, "-", "+"])
            entries = reply if isinstance(reply, list) else []
        if isinstance(reply, ReplyError):
            return Seen(error=str(reply))
        seen = Seen(source="index", gen=self.upstream.gen)
        for eid, fields in entries:
            rev = int(eid.split(b"-")[0])
            seen.top = max(seen.top, rev)
            f = dict(zip(fields[::2], fields[1::2], strict=True))
            if f[b"key"] == g.KEY.encode():
                gen, _, seq = g.parse_value(f[b"value"])
                assert seq == rev, (seq, rev)
                seen.revision, seen.gen = seq, gen
        if conn is self.row:
            self.stream_handed = max(self.stream_handed, seen.top)
        return seen

    async def read(self) -> dict[str, Seen]:
        """The row's read at t0: each key's answer, its source as the read path reported it
        (KV.GET's reply; the access log's record; none: the GET fast path)."""
        f = self.form
        if f.kind == "localreader":
            return {g.KEY: self._local_reader()}
        if f.kind == "stream":
            return {g.KEY: await self.stream_read(self.row)}
        if f.kind == "tracking":
            t = self.tracker
            assert t is not None
            t.told()
            return {g.KEY: t.kept or Seen(source="dropped")}
        log_from, asked_from = len(self.access.log), len(self.upstream.asked)
        keys = list(f.keys)
        got: object
        if f.kind == "exec_watch":
            *_, got = await self.row.call(["WATCH", *keys], ["MULTI"], *[["GET", k] for k in keys], ["EXEC"])
            if got is None:
                return {k: Seen(source="null") for k in keys}
        elif f.name.startswith("MULTI"):
            *_, got = await self.row.call(["MULTI"], *[["GET", k] for k in keys], ["EXEC"])
        elif f.name == "MGET":
            got, = await self.row.call(["MGET", *keys])
        elif f.name.startswith("KV.GET"):
            opts: list[str] = []
            if f.strong:
                opts += ["CONSISTENCY", "strong"]
            if f.maxstale is not None:
                opts += ["MAXSTALE", str(f.maxstale)]
            if f.minrev is not None:
                opts += ["MINREV", str(g.minrev_of(f, self.state, keys[0]))]
            got, = await self.row.call(["KV.GET", keys[0], *opts])
            return {keys[0]: self._kv_seen(keys[0], got, asked_from)}
        else:
            got, = await self.row.call(["GET", keys[0]])
            got = [got]
        values = dict(zip(keys, got, strict=True)) if isinstance(got, list) else dict.fromkeys(keys, got)
        logged = self.access.log[log_from:]
        out = {}
        for k, v in values.items():
            seen = self.note(k, v)
            if not seen.error:
                sources = [s for key, s, _ in logged if key == k]
                if not sources:  # the GET fast path answered: it logs nothing
                    seen.source = "local" if k != g.OUTSIDE else "cache"
                else:
                    seen.source = self._source(sources[-1], k, asked_from)
            out[k] = seen
        return out

    def _source(self, reported: str, key: str, asked_from: int) -> str:
        """The model's name for a source the read path reported: `local>nats` for the replica's
        copy found newer than NATS's answer (NATS was asked for the key in this read)."""
        if reported == "local":
            asked = any(key in a.keys for a in self.upstream.asked[asked_from:])
            return "local>nats" if asked else "local"
        if reported in ("cache", "stale", "leader"):
            return reported
        if reported == "remote":  # a not-found from NATS
            return "leader" if self.form.strong else "peer"
        return "peer"  # a peer's label

    def _kv_seen(self, key: str, got: object, asked_from: int) -> Seen:
        if isinstance(got, ReplyError):
            return Seen(error=str(got))
        if got is None:
            return Seen(source=self._source("remote", key, asked_from), gen=self.upstream.gen)
        value, revision, _created, _op, source = got  # type: ignore[misc]
        seen = self.note(key, value)
        assert seen.revision == revision, (value, revision)
        seen.source = self._source(source.decode(), key, asked_from)
        return seen

    def _local_reader(self) -> Seen:
        r = LocalReader(self.shared.snapshot(), max_stale_ms=g.BOUND_MS)
        try:
            if self.form.name.endswith("(twin)"):
                r.get = app_get_twin.LocalGet(r._located, r._fresh_until, r.env.begin,  # type: ignore[method-assign]
                                              r._get_checked)
            try:
                value = r.get(g.KEY)
            except KvcacheError as e:
                return Seen(error=f"{type(e).__name__}: {e}")
        finally:
            r.close()
        if value is None:
            return Seen(source="local", gen=self.upstream.gen)
        gen, _, seq = g.parse_value(value)
        return Seen(source="local", revision=seq, gen=gen)

    def handed_before(self, key: str) -> int:
        """The highest revision of `key` handed out so far, in the stream's current numbering."""
        return max((s for gen, s in self.handed.get(key, ()) if gen == self.upstream.gen), default=0)


# ---------------------------------------------------------------------- the stories

async def play(w: World) -> None:
    """The row's state, played from the bucket's first sync to the read's moment (t0), then
    the holding taken at t0 and NATS as the row's read finds it."""
    w.clock.at(-20_000)
    if w.quorum_stream:
        await w.evidence(3)
    await w.start_over()           # the first sync
    await w.deliver([1, 2, 3])
    await w.warm()
    if w.form.kind == "tracking":
        await w.start_tracking()
    await STORIES[w.state.name](w)
    await w.at(0)
    w.upstream.follower_seq = w.state.follower_seq
    await w.acquire("t0")
    w.upstream.mode = {"up": "up", "down": "down", "timeout, serve_stale": "timeout"}[w.upstream_mode]


async def _current(w: World) -> None:
    await w.at(-2_990)
    await w.deliver([4, 5])
    await w.at(-1_990)
    await w.deliver([6, 7])
    await w.at(-1_000)
    await w.idle(7)
    await w.at(-250)
    await w.hold_point()           # the replica at 7: 8 handed out ahead of it
    await w.at(-240)
    await w.deliver([8, 9])        # ... and reached
    await w.at(-90)
    await w.deliver([10])


async def _behind_within(w: World) -> None:
    await w.at(-2_990)
    await w.deliver([4, 5])
    await w.at(-400)
    await w.deliver([6, 7])        # caught up at 7; 8 (acked at -300) on its way
    await w.at(-250)
    await w.hold_point()


async def _behind_beyond(w: World) -> None:
    await w.at(-1_500)
    await w.deliver([4, 5], pending=2)  # catching up slowly: 6 and 7 pending
    await w.at(-250)
    await w.hold_point()


async def _stalled(w: World) -> None:
    await w.at(-2_500)
    await w.deliver([4, 5])        # caught up at 5; then nothing, and no error: the link stalled
    await w.at(-250)
    await w.hold_point()


async def _resyncing(w: World) -> None:
    await w.at(-1_600)
    await w.hold_point()           # 6 handed out ahead of the replica (at 3)
    await w.at(-1_500)
    await w.consumer_lost()
    await w.at(-1_000)
    await w.start_over(first=5)    # the stream dropped 1-4 meanwhile: a full resync
    await w.at(-900)
    await w.deliver([6], pending=1)  # the initial set in subject order: in.k, then out.o


async def _consumer_recreated(w: World) -> None:
    await w.at(-2_990)
    await w.deliver([4, 5])
    await w.at(-1_990)
    await w.deliver([6, 7])
    await w.at(-600)
    await w.idle(7)
    await w.at(-500)
    await w.consumer_lost()
    await w.at(-450)
    await w.start_over()           # resumes after 7
    await w.at(-250)
    await w.hold_point()
    await w.at(-100)
    await w.deliver([8], pending=2)


async def _recreated(w: World) -> None:
    await w.at(-2_500)
    await w.deliver([4, 5])        # caught up at 5; 6 and 7 (acked at -2000) never delivered
    await w.at(-1_600)
    await w.hold_point()           # the old stream's 6, ahead of the replica (at 5)
    await w.at(g.RECREATED_AT_MS)
    w.upstream.gen = 2             # the bucket deleted and created again
    await w.at(-1_450)
    await w.consumer_lost()
    await w.at(-1_300)
    await w.start_over()           # recreated: renumbered, a full resync
    await w.deliver([1, 2, 3])
    await w.at(-250)
    await w.idle(3)


async def _no_quorum(w: World) -> None:
    await w.at(-2_990)
    await w.deliver([4, 5])
    await w.at(-2_750)
    await w.evidence(5)            # a quorum shows 5, as of -2800
    await w.at(-1_900)
    await w.hold_point()           # the majority has 6 and 7; the consumer's server is cut off
    await w.at(-1_500)
    await w.evidence(7, healthy=False)
    await w.at(-500)
    await w.evidence(10, healthy=False)
    await w.at(-50)
    await w.idle(5)                # the cut-off server keeps heartbeating


async def _follower_lagging(w: World) -> None:
    await w.at(-2_990)
    await w.deliver([4, 5])
    await w.at(-1_990)
    await w.deliver([6, 7])
    await w.at(-350)
    await w.evidence(7)            # as of -400, reached
    await w.at(-250)
    await w.hold_point()
    await w.at(-150)
    await w.evidence(9)            # pending: the replica is at 7
    await w.at(-50)
    await w.evidence(10)
    await w.at(-40)
    await w.idle(7)


async def _not_applied(w: World) -> None:
    await w.at(-2_500)
    await w.deliver([4, 5])        # the last write that fit
    for at in (-1_990, -1_600, -1_200, -800, -400, -90):  # the consumer loop retrying (Feed._run)
        await w.at(at - 10)
        await w.start_over()
        await w.at(at)
        await w.deliver_fails([w_.seq for w_ in w.upstream.visible() if w_.seq > 5])
        if at == -400:
            await w.at(-250)
            await w.hold_point()


STORIES = {
    "current": _current,
    "behind within the bound": _behind_within,
    "behind beyond the bound": _behind_beyond,
    "stalled link, no evidence": _stalled,
    "resyncing": _resyncing,
    "consumer recreated": _consumer_recreated,
    "bucket recreated": _recreated,
    "no quorum shown": _no_quorum,
    "follower lagging": _follower_lagging,
    "deliveries not applied": _not_applied,
}
