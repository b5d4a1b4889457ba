"""The executor of a read's route (kvcache/read/reads.py), branch by branch, in process: the
real read policy, ledger, near cache, feeds (never started, their clock set by the test) and
LMDB replica of tests/test_readpolicy.py, and a stand-in for NATS behind the router's three
calls (`get_from`, `get_many_from`, `last_revision`), answered as the test says and each
recorded; it can hold a request in flight until the test lets it answer. No process is
started: the quick tier, and each test takes milliseconds, so that `make mutation` runs them
against every mutant of reads.py (tests/test_guarantees.py reaches the same code through the
whole table, too slowly for that).

Each test states what a read answers, from which source, what it counted and logged, and
which requests it sent: the routes Local, Cached, Held and Remote for one key and for many,
joined requests in flight (plain, strong, MINREV), the stale fallback and its errors, the
reply budget, the one LMDB transaction of a read of many keys, and the access log's latency
per key (on a clock the test moves: a request to NATS takes about 7 ms, the wait for the
replica about 3 ms). When a read arrived decides which request in flight it may join, so each
read here arrives on that clock too. MINREV's questions to the leader and STREAM.INFO are
tests/test_minrev.py's; here, how MINREV joins requests in flight.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace

import pytest
from test_readpolicy import NOW, feed_of, stale

from kvcache.config import BucketConfig, Config
from kvcache.entry import Entry, Operation
from kvcache.errors import CommandError, KvcacheError, ReplyBudget, ReplyTooLarge, UpstreamError
from kvcache.read import reads as reads_module
from kvcache.read.ledger import Ledger
from kvcache.read.policy import ReadPolicy
from kvcache.read.reads import Reads
from kvcache.stats import Stats
from kvcache.store.nearcache import NearCache
from kvcache.store.record import item
from kvcache.store.replica import BucketMeta, Replica

MS = 1_000_000
# on the test's clock (ns, not whole µs: the log's latency is whole µs, rounded down)
ASK_NS = 7_001_500   # a request to NATS
WAIT_NS = 3_000_700  # the wait for the replica (Held)
ASK_US, WAIT_US, BOTH_US = ASK_NS // 1000, WAIT_NS // 1000, (WAIT_NS + ASK_NS) // 1000
LATER = NOW + 3_600_000_000_000  # rep.t's own expiry, an hour on


class Clock:
    """time.perf_counter_ns and time.monotonic_ns as reads.py (and its Flights) see them:
    still, unless the test, a request or a wait moves them."""

    def __init__(self) -> None:
        self.now = 1_000_000_000_000

    def ns(self) -> int:
        return self.now

    def advance(self, ms: int = 0, ns: int = 0) -> None:
        self.now += ms * MS + ns


class Nats:
    """The router as Reads calls it: each key's answer from `truth` ((bucket, key) -> (value,
    revision, operation); absent: not found), `fail` raised instead when set, and every call
    recorded in `calls`. A request takes ASK_NS on the clock; with `gated`, each waits for
    `release(n)` (its number in `calls`). The bucket's own stream answers: a value names
    `main.BUCKET` (the leader: "leader"), as kvcache.read.peer does. A batch charges its
    values to the budget it is given, as the router does."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.truth: dict[tuple[str, str], tuple[bytes | None, int, Operation]] = {}
        self.fail: KvcacheError | None = None
        self.last = 0
        self.calls: list[tuple] = []
        self.gated = False
        self.gates: list[asyncio.Event] = []

    def put(self, key: str, value: bytes | None, revision: int, bucket: str = "b",
            op: Operation = Operation.PUT) -> None:
        self.truth[(bucket, key)] = (value, revision, op)

    def release(self, n: int) -> None:
        self.gates[n].set()

    async def _asked(self, call: tuple) -> None:
        self.calls.append(call)
        gate = asyncio.Event()
        self.gates.append(gate)
        if not self.gated:
            gate.set()
        await gate.wait()
        self.clock.advance(ns=ASK_NS)
        if self.fail is not None:
            raise self.fail

    def _entry(self, bucket: str, key: str, strong: bool) -> Entry | None:
        got = self.truth.get((bucket, key))
        if got is None:
            return None
        value, revision, op = got
        return Entry(bucket, key, value, revision, NOW, 0, op, "leader" if strong else f"main.{bucket}")

    async def get_from(self, bucket: str, key: str, strong: bool = False) -> tuple[Entry | None, str]:
        await self._asked(("get", bucket, key, strong))
        return self._entry(bucket, key, strong), f"main.{bucket}"

    async def get_many_from(self, bucket: str, keys: list[str], budget: ReplyBudget | None = None
                            ) -> tuple[dict[str, Entry | None], dict[str, str]]:
        await self._asked(("many", bucket, tuple(keys)))
        found = {k: self._entry(bucket, k, False) for k in keys}
        if budget is not None:
            for e in found.values():
                if e is not None and e.value:
                    budget.spend(len(e.value))
        return found, dict.fromkeys(keys, f"main.{bucket}")

    async def last_revision(self, bucket: str) -> int:
        await self._asked(("info", bucket))
        return self.last


class Recorder:
    """kvcache.ops.accesslog.AccessLog's interface: on or off (`enabled`), sampling every
    read or none (`sample`), each record kept as (bucket, key, source, hit, latency µs,
    command), and each `sampled()` asked counted."""

    def __init__(self, enabled: bool = True, sample: bool = True) -> None:
        self.enabled, self.sample = enabled, sample
        self.asked = 0
        self.log: list[tuple[str, str, str, bool, int, str]] = []

    def sampled(self) -> bool:
        self.asked += 1
        return self.sample

    def record(self, bucket: str, key: str, source: str, hit: bool, latency_us: int, command: str) -> None:
        self.log.append((bucket, key, source, hit, latency_us, command))


@pytest.fixture
def w(tmp_path, monkeypatch):
    """Bucket `b` (default) replicates `rep.>` (rep.a at 5, rep.t at 6 with a TTL an hour
    on) and has a near cache; `all` replicates every key (x at 3, y at 4), has no cache and
    serves stale; `f` replicates `rep.>` (rep.f at 2), has no cache and serves no stale. Each
    replica applied 10 and is fresh."""
    clock = Clock()
    monkeypatch.setattr(reads_module, "time", SimpleNamespace(perf_counter_ns=clock.ns, monotonic_ns=clock.ns))
    monkeypatch.setattr(reads_module, "MINREV_WAIT_S", 0.001)
    replica = Replica(str(tmp_path / "replica"), buckets=4)
    b = BucketConfig(name="b", keys=["rep.>"], max_stale_ms=1000)
    every = BucketConfig(name="all", max_stale_ms=2000, serve_stale=True)
    filtered = BucketConfig(name="f", keys=["rep.>"], max_stale_ms=1000)
    cfg = Config(buckets=[b, every, filtered])
    replica.apply_items("b", [item(b"rep.a", b"A", 5, NOW), item(b"rep.t", b"T", 6, NOW, LATER - NOW)],
                        BucketMeta(stream="KV_b", applied_seq=10, synced=True))
    replica.apply_items("all", [item(b"x", b"X", 3, NOW), item(b"y", b"YY", 4, NOW)],
                        BucketMeta(stream="KV_all", applied_seq=10, synced=True))
    replica.apply_items("f", [item(b"rep.f", b"F", 2, NOW)], BucketMeta(stream="KV_f", applied_seq=10, synced=True))
    cache = NearCache(replica, "b", max_keys=100)
    feeds = {"b": feed_of(b, replica, cache), "all": feed_of(every, replica), "f": feed_of(filtered, replica)}
    ledger = Ledger()
    policy = ReadPolicy(cfg, replica, feeds, ledger)
    nats = Nats(clock)
    stats = Stats()
    access = Recorder()
    reads = Reads(cfg, policy, nats, stats, access)  # type: ignore[arg-type]
    reads.flights.clock = clock.ns
    waits: list[tuple[str, int, float]] = []
    meanwhile: dict[str, Callable[[], None]] = {}
    for name, feed in feeds.items():
        real = feed.wait_applied

        async def wait_applied(seq: int, timeout: float, name: str = name, real=real) -> bool:
            """The feed's own wait, recorded; what the story does meanwhile happens first."""
            waits.append((name, seq, timeout))
            clock.advance(ns=WAIT_NS)
            if name in meanwhile:
                meanwhile.pop(name)()
            return await real(seq, timeout)
        monkeypatch.setattr(feed, "wait_applied", wait_applied)
    yield SimpleNamespace(reads=reads, nats=nats, stats=stats, access=access, clock=clock, cache=cache,
                          feeds=feeds, replica=replica, ledger=ledger, policy=policy, waits=waits,
                          meanwhile=meanwhile, wb=ledger.witness(feeds["b"]))
    replica.close()


def reached(w, bucket: str, key: bytes, value: bytes, revision: int) -> Callable[[], None]:
    """The replica applies `key` at `revision` (its position moves there) while a read waits."""
    def apply() -> None:
        feed = w.feeds[bucket]
        feed.meta.applied_seq = revision
        w.replica.apply_items(bucket, [item(key, value, revision, NOW)], feed.meta)
        w.ledger.applied(bucket, feed.meta)
    return apply


def answer(e: Entry | None) -> Entry | None:
    return e


async def kv_get(w, raw: bytes, command: str = "KV.GET", **kw) -> Entry | None:
    reply = w.reads.one(raw, command, answer, **kw)
    return await reply if asyncio.iscoroutine(reply) else reply


def values(vs: list) -> list:
    """An MGET's reply: each value copied (a memoryview points into the read transaction),
    with its type as it came."""
    return [None if v is None else (bytes(v), type(v).__name__) for v in vs]


async def mget(w, raws: list[bytes], budget: ReplyBudget | None = None, command: str = "MGET") -> list:
    reply = w.reads.many(raws, command, values, budget)
    return await reply if asyncio.iscoroutine(reply) else reply


def seen(e: Entry | None) -> tuple | None:
    return None if e is None else (e.value, e.revision, e.source)


async def until(cond: Callable[[], bool]) -> None:
    """Let the loop run until `cond` holds (the reads and requests in flight get their turns)."""
    for _ in range(1000):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError("never happened")


# ---------------------------------------------------------------------- one key, answered here

async def test_a_local_answer_is_the_replicas_record_as_it_is_with_no_request(w):
    reply = w.reads.one(b"rep.t", "GET", answer)
    assert not asyncio.iscoroutine(reply)   # bytes at once: the server relies on it
    assert reply == Entry("b", "rep.t", b"T", 6, NOW, 0, Operation.PUT, "local", LATER)
    assert w.reads.one(b"rep.none", "TTL", answer) is None
    assert w.nats.calls == []
    s = w.stats
    assert (s.gets_local, s.gets_notfound, s.gets_remote, s.gets_cached) == (2, 1, 0, 0)
    assert s.reads == {("b", "local", "hit"): 1, ("b", "local", "miss"): 1}
    assert w.access.log == [("b", "rep.t", "local", True, 0, "GET"), ("b", "rep.none", "local", False, 0, "TTL")]


async def test_a_near_cache_answer_and_a_cached_not_found(w):
    w.cache.offer_entry("o.k", b"o.k", b"V", 4, NOW, 0)
    w.cache.offer_absent(b"o.gone", 6)
    assert seen(w.reads.one(b"o.k", "GET", answer)) == (b"V", 4, "cache")
    assert w.reads.one(b"o.gone", "GET", answer) is None
    s = w.stats
    assert (s.gets_cached, s.gets_notfound, s.gets_local) == (2, 1, 0)
    assert s.reads == {("b", "cache", "hit"): 1, ("b", "cache", "miss"): 1}
    assert w.access.log == [("b", "o.k", "cache", True, 0, "GET"), ("b", "o.gone", "cache", False, 0, "GET")]
    assert w.nats.calls == []


async def test_the_reads_options_reach_its_route(w):
    """strong: the leader, never the replica; MAXSTALE: the read's own bound; MINREV: a
    revision the replica lacks is NATS's."""
    w.nats.put("rep.a", b"A9", 9)
    assert seen(await kv_get(w, b"rep.a", strong=True)) == (b"A9", 9, "leader")
    stale(w.feeds["b"], 500)                      # within the bucket's 1000 ms, not within 100
    assert seen(await kv_get(w, b"rep.a")) == (b"A", 5, "local")
    assert seen(await kv_get(w, b"rep.a", max_stale_ms=100)) == (b"A9", 9, "main.b")
    assert w.nats.calls == [("get", "b", "rep.a", True), ("get", "b", "rep.a", False)]


def test_max_age_is_the_buckets_feeds(w):
    w.feeds["b"].max_age_ns = 5_000 * MS
    assert w.reads.max_age_ns("b") == 5_000 * MS
    assert w.reads.max_age_ns("all") == 0
    assert w.reads.max_age_ns("nosuch") == 0


# ---------------------------------------------------------------------- one key, from NATS

async def test_a_key_outside_the_filters_is_natss_answer_and_fills_the_near_cache(w):
    w.nats.put("o.k", b"VAL", 8)
    assert seen(await kv_get(w, b"o.k", "GET")) == (b"VAL", 8, "main.b")
    assert w.nats.calls == [("get", "b", "o.k", False)]         # one key: its own request
    assert w.cache.current_revision(b"o.k") == (8, False)       # offered to the near cache
    assert w.cache.lookup(b"o.k")[0] == b"VAL"
    s = w.stats
    assert (s.gets_remote, s.gets_notfound, s.reads_coalesced, s.remote_errors) == (1, 0, 0, 0)
    assert s.reads == {("b", "peer", "hit"): 1}
    assert w.access.log == [("b", "o.k", "main.b", True, ASK_US, "GET")]


async def test_a_not_found_from_nats_is_counted_and_cached_as_one(w):
    assert await kv_get(w, b"o.none", "GET") is None
    assert w.cache.current_revision(b"o.none") == (0, True)
    s = w.stats
    assert (s.gets_remote, s.gets_notfound) == (1, 1)
    assert s.reads == {("b", "peer", "miss"): 1}
    assert w.access.log == [("b", "o.none", "remote", False, ASK_US, "GET")]


async def test_a_deletion_from_nats_is_not_found(w):
    w.nats.put("o.del", None, 9, op=Operation.DEL)
    assert await kv_get(w, b"o.del", "GET") is None
    assert w.stats.reads == {("b", "peer", "miss"): 1} and w.stats.gets_notfound == 1
    assert w.access.log == [("b", "o.del", "main.b", False, ASK_US, "GET")]


async def test_a_strong_read_is_the_leaders_and_counted_so(w):
    w.nats.put("rep.a", b"A12", 12)
    assert seen(await kv_get(w, b"rep.a", strong=True)) == (b"A12", 12, "leader")
    assert w.stats.reads == {("b", "leader", "hit"): 1}
    assert w.access.log == [("b", "rep.a", "leader", True, ASK_US, "KV.GET")]
    assert w.wb.held_until("rep.a") == 12       # handed out ahead of the replica: held


async def test_the_replicas_newer_record_wins_over_a_lagging_answer(w):
    stale(w.feeds["b"])
    w.nats.put("rep.a", b"old", 3)
    assert seen(await kv_get(w, b"rep.a", "GET")) == (b"A", 5, "local")
    assert w.stats.reads == {("b", "peer", "hit"): 1}           # NATS was asked all the same
    assert w.access.log[0][2] == "local"


async def test_no_access_log_no_clock_and_no_sampling(w):
    w.access.enabled = False
    w.nats.put("o.k", b"V", 8)
    await kv_get(w, b"o.k")
    await kv_get(w, b"rep.a")
    await mget(w, [b"rep.a", b"o.k", b"o.none"])
    assert w.access.log == [] and w.access.asked == 0


async def test_a_read_not_sampled_is_not_logged(w):
    w.access.sample = False
    w.nats.put("o.k", b"V", 8)
    await kv_get(w, b"o.k")
    await kv_get(w, b"rep.a")
    await mget(w, [b"rep.a", b"o.k"])
    assert w.access.log == [] and w.access.asked == 4


# ---------------------------------------------------------------------- held keys

async def test_a_held_key_waits_for_the_replica_and_is_answered_there(w):
    w.wb.handed_out("rep.a", 12)
    w.meanwhile["b"] = reached(w, "b", b"rep.a", b"A12", 12)
    assert seen(await kv_get(w, b"rep.a", "GET")) == (b"A12", 12, "local")
    assert w.waits == [("b", 12, reads_module.MINREV_WAIT_S)]
    assert w.nats.calls == []
    assert w.stats.reads == {("b", "local", "hit"): 1} and w.stats.gets_local == 1
    assert w.access.log == [("b", "rep.a", "local", True, WAIT_US, "GET")]


async def test_a_held_key_the_replica_does_not_reach_is_natss(w):
    w.wb.handed_out("rep.a", 12)
    w.nats.put("rep.a", b"A12", 12)
    assert seen(await kv_get(w, b"rep.a", "GET")) == (b"A12", 12, "main.b")
    assert w.waits == [("b", 12, reads_module.MINREV_WAIT_S)]
    assert w.nats.calls == [("get", "b", "rep.a", False)]
    assert w.access.log == [("b", "rep.a", "main.b", True, BOTH_US, "GET")]


async def test_a_held_key_is_routed_again_with_its_own_bound(w):
    """MAXSTALE 100: the replica reached the key's revision meanwhile, but is now 500 ms
    behind: within the bucket's bound, not the read's, so NATS answers."""
    w.wb.handed_out("rep.a", 12)
    w.nats.put("rep.a", b"A13", 13)

    def meanwhile() -> None:
        reached(w, "b", b"rep.a", b"A12", 12)()
        stale(w.feeds["b"], 500)
    w.meanwhile["b"] = meanwhile
    assert seen(await kv_get(w, b"rep.a", max_stale_ms=100)) == (b"A13", 13, "main.b")
    assert w.nats.calls == [("get", "b", "rep.a", False)]


async def test_minrev_the_replica_does_not_reach_is_asked_with_minrev(w):
    """MINREV 11 waits for the replica, which stays at 10 (rep.a's record is 5, below): the
    leader is asked, and its answer at 11 stands."""
    w.nats.put("rep.a", b"A11", 11)
    assert seen(await kv_get(w, b"rep.a", min_rev=11)) == (b"A11", 11, "leader")
    assert w.waits == [("b", 11, reads_module.MINREV_WAIT_S)]
    assert w.nats.calls == [("get", "b", "rep.a", True)]


async def test_minrev_the_replica_reaches_while_waiting(w):
    w.meanwhile["b"] = reached(w, "b", b"rep.other", b"O", 11)
    assert seen(await kv_get(w, b"rep.a", min_rev=11)) == (b"A", 5, "local")   # the bucket at 11
    assert w.nats.calls == []


async def test_an_unsynced_replicas_position_is_not_what_the_bucket_reached(w):
    """An unsynced replica at 12 does not show the bucket at MINREV 12: the leader's older
    answer needs STREAM.INFO to stand."""
    w.feeds["b"].meta.synced = False
    w.feeds["b"].meta.applied_seq = 12
    w.nats.put("rep.a", b"A5", 5)
    w.nats.last = 12
    assert seen(await kv_get(w, b"rep.a", min_rev=12)) == (b"A5", 5, "leader")
    assert w.nats.calls == [("get", "b", "rep.a", True), ("info", "b"), ("get", "b", "rep.a", True)]
    w.nats.calls.clear()          # not even revision 1
    assert await kv_get(w, b"rep.none", min_rev=1) is None
    assert w.nats.calls == [("get", "b", "rep.none", True), ("info", "b"), ("get", "b", "rep.none", True)]


async def test_a_stale_synced_replicas_position_is_what_the_bucket_reached(w):
    """The replica holds MINREV 10 but is stale: the leader answers, and its older revision
    stands without STREAM.INFO (the feed saw the stream at 10)."""
    stale(w.feeds["b"])
    w.nats.put("rep.a", b"A5", 5)
    assert seen(await kv_get(w, b"rep.a", min_rev=10)) == (b"A5", 5, "leader")
    assert w.nats.calls == [("get", "b", "rep.a", True)]


async def test_minrev_of_a_key_outside_the_filters_fills_the_near_cache(w):
    w.nats.put("o.k", b"V7", 7)
    assert seen(await kv_get(w, b"o.k", min_rev=7)) == (b"V7", 7, "leader")
    assert w.cache.current_revision(b"o.k") == (7, False)
    assert await kv_get(w, b"o.none", min_rev=1) is None   # the bucket at 10 has no such key
    assert w.cache.current_revision(b"o.none") == (0, True)


# ---------------------------------------------------------------------- many keys

async def test_many_keys_answered_here_reply_at_once_from_the_transaction(w):
    w.cache.offer_entry("o.k", b"o.k", b"CV", 4, NOW, 0)
    w.cache.offer_absent(b"o.gone", 6)
    budget = ReplyBudget(100)
    reply = w.reads.many([b"rep.a", b"rep.none", b"o.k", b"o.gone", b"all:y"], "MGET", values, budget)
    assert reply == [(b"A", "memoryview"), None, (b"CV", "bytes"), None, (b"YY", "memoryview")]
    assert budget.left == 100 - 1 - 2 - 2
    s = w.stats
    assert (s.gets_local, s.gets_cached, s.gets_notfound, s.gets_remote) == (3, 2, 2, 0)
    assert s.reads == {("b", "local", "hit"): 1, ("b", "local", "miss"): 1, ("b", "cache", "hit"): 1,
                       ("b", "cache", "miss"): 1, ("all", "local", "hit"): 1}
    assert [r[1:] for r in w.access.log] == [
        ("rep.a", "local", True, 0, "MGET"), ("rep.none", "local", False, 0, "MGET"),
        ("o.k", "cache", True, 0, "MGET"), ("o.gone", "cache", False, 0, "MGET"), ("y", "local", True, 0, "MGET")]
    assert w.nats.calls == []


async def test_many_keys_past_the_buckets_max_age_are_not_found(w):
    w.feeds["all"].max_age_ns = 1   # x and y were written before the test began
    assert w.reads.many([b"all:x", b"all:y", b"rep.a"], "MGET", values) == [None, None, (b"A", "memoryview")]
    assert w.stats.reads == {("all", "local", "miss"): 2, ("b", "local", "hit"): 1}


async def test_many_keys_over_the_budget_here(w):
    with pytest.raises(ReplyTooLarge):
        w.reads.many([b"all:x", b"all:y"], "MGET", values, ReplyBudget(2))
    w.cache.offer_entry("o.k", b"o.k", b"CV", 4, NOW, 0)
    with pytest.raises(ReplyTooLarge):
        w.reads.many([b"o.k"], "MGET", values, ReplyBudget(1))
    assert w.stats.gets_local == 2   # counted all the same, up to the key over the budget


async def test_an_invalid_key_fails_many_and_one(w):
    with pytest.raises(CommandError, match="no such bucket 'nosuch'"):
        w.reads.many([b"rep.a", b"nosuch:k"], "MGET", values)
    assert w.stats.gets_local == 1
    with pytest.raises(CommandError, match="not UTF-8"):
        w.reads.one(b"\xff", "GET", answer)


async def test_many_keys_from_nats_in_one_batch_per_bucket(w):
    w.nats.put("o.k", b"VV", 8)
    w.nats.put("o.l", b"LLL", 9)
    stale(w.feeds["all"])
    w.nats.put("x", b"X7", 7, bucket="all")
    budget = ReplyBudget(100)
    got = await mget(w, [b"o.k", b"rep.a", b"o.l", b"o.none", b"all:x", b"o.none2"], budget)
    assert got == [(b"VV", "bytes"), (b"A", "bytes"), (b"LLL", "bytes"), None, (b"X7", "bytes"), None]
    assert w.nats.calls == [("many", "b", ("o.k", "o.l", "o.none", "o.none2")), ("many", "all", ("x",))]
    assert budget.left == 100 - 1 - (2 + 3) - 2     # the replica's here, the rest by the router
    assert w.cache.current_revision(b"o.l") == (9, False)
    s = w.stats
    assert (s.gets_local, s.gets_remote, s.gets_notfound) == (1, 5, 2)
    assert s.reads == {("b", "local", "hit"): 1, ("b", "peer", "hit"): 2, ("b", "peer", "miss"): 2,
                       ("all", "peer", "hit"): 1}
    assert [r[1:] for r in w.access.log] == [
        ("rep.a", "local", True, 0, "MGET"), ("o.k", "main.b", True, ASK_US, "MGET"),
        ("o.l", "main.b", True, ASK_US, "MGET"), ("o.none", "remote", False, ASK_US, "MGET"),
        ("o.none2", "remote", False, ASK_US, "MGET"),
        ("x", "main.all", True, ASK_US, "MGET")]   # each from its own request's start


async def test_many_keys_held_wait_once_per_bucket_for_the_highest(w):
    w.wb.handed_out("rep.a", 12)
    w.wb.handed_out("rep.b", 14)
    w.nats.put("rep.b", b"B14", 14)
    w.meanwhile["b"] = reached(w, "b", b"rep.a", b"A12", 12)   # rep.a reached, rep.b not
    budget = ReplyBudget(100)
    got = await mget(w, [b"rep.a", b"rep.b"], budget)
    assert got == [(b"A12", "bytes"), (b"B14", "bytes")]
    assert w.waits == [("b", 14, reads_module.MINREV_WAIT_S)]
    assert w.nats.calls == [("many", "b", ("rep.b",))]
    assert budget.left == 100 - 3 - 3
    assert [r[1:] for r in w.access.log] == [
        ("rep.a", "local", True, WAIT_US, "MGET"), ("rep.b", "main.b", True, ASK_US, "MGET")]


async def test_a_held_key_of_many_over_the_budget(w):
    w.wb.handed_out("rep.a", 12)
    w.meanwhile["b"] = reached(w, "b", b"rep.a", b"A12", 12)
    with pytest.raises(ReplyTooLarge):
        await mget(w, [b"rep.a"], ReplyBudget(2))


async def test_a_batch_over_the_budget_fails_the_command_as_such(w):
    w.nats.put("o.k", b"VVVV", 8)
    with pytest.raises(ReplyTooLarge):
        await mget(w, [b"o.k", b"o.l"], ReplyBudget(3))
    assert w.stats.remote_errors == 0 and w.stats.reads == {}


# ---------------------------------------------------------------------- NATS cannot answer

async def test_a_stale_replica_answers_when_no_peer_can_and_the_bucket_serves_stale(w):
    stale(w.feeds["all"])
    w.nats.fail = UpstreamError("no responders")
    budget = ReplyBudget(100)
    got = await mget(w, [b"all:x", b"all:y", b"all:none"], budget)
    assert got == [(b"X", "bytes"), (b"YY", "bytes"), None]
    assert budget.left == 100 - 1 - 2
    s = w.stats
    assert (s.remote_errors, s.gets_stale, s.gets_remote, s.gets_notfound) == (1, 3, 3, 1)
    assert s.reads == {("all", "stale", "hit"): 2, ("all", "stale", "miss"): 1}
    assert [r[1:4] for r in w.access.log] == [("x", "stale", True), ("y", "stale", True),
                                               ("none", "stale", False)]
    assert seen(await kv_get(w, b"all:x")) == (b"X", 3, "stale")
    assert (s.remote_errors, s.gets_stale) == (2, 4)


async def test_stale_values_over_the_budget(w):
    stale(w.feeds["all"])
    w.nats.fail = UpstreamError("no responders")
    with pytest.raises(ReplyTooLarge):
        await mget(w, [b"all:x", b"all:y"], ReplyBudget(2))


async def test_no_stale_answer_is_an_error_counted_per_key(w):
    stale(w.feeds["f"])
    w.nats.fail = UpstreamError("no responders")
    with pytest.raises(CommandError, match=r"^ERR bucket f: replica stale .* no peer could answer: no responders"):
        await mget(w, [b"f:rep.f", b"f:rep.g"])
    assert w.stats.reads == {("f", "peer", "error"): 2} and w.stats.remote_errors == 1
    with pytest.raises(CommandError, match="ERR upstream read failed: no responders"):
        await kv_get(w, b"f:rep.f", strong=True)
    assert w.stats.reads == {("f", "peer", "error"): 3} and w.stats.gets_stale == 0


async def test_minrev_beyond_the_bucket_is_counted_as_a_failed_read(w):
    w.nats.last = 10
    with pytest.raises(CommandError, match="MINREV 50 is beyond bucket b's last revision 10"):
        await kv_get(w, b"o.k", min_rev=50)
    assert w.stats.reads == {("b", "peer", "error"): 1} and w.stats.remote_errors == 0


# ---------------------------------------------------------------------- requests in flight

async def test_concurrent_reads_of_a_key_share_one_request(w):
    w.nats.put("o.k", b"VV", 8)
    budget = ReplyBudget(100)
    got = await asyncio.gather(kv_get(w, b"o.k", "GET"), kv_get(w, b"o.k", "GET"),
                               mget(w, [b"o.k", b"o.none"], budget))
    assert [seen(got[0]), seen(got[1])] == [(b"VV", 8, "main.b")] * 2
    assert got[2] == [(b"VV", "bytes"), None]
    assert w.nats.calls == [("get", "b", "o.k", False), ("many", "b", ("o.none",))]
    assert budget.left == 100 - 2     # the joined answer charged here: the request was another's
    assert w.stats.reads_coalesced == 2 and w.stats.gets_remote == 4


async def test_a_joined_not_found_is_not_charged(w):
    budget = ReplyBudget(100)
    got = await asyncio.gather(kv_get(w, b"o.none", "GET"), mget(w, [b"o.none"], budget))
    assert got == [None, [None]] and budget.left == 100
    assert w.nats.calls == [("get", "b", "o.none", False)]


async def test_a_strong_read_joins_only_a_strong_request(w):
    w.nats.put("o.k", b"VV", 8)
    got = await asyncio.gather(kv_get(w, b"o.k"), kv_get(w, b"o.k", strong=True), kv_get(w, b"o.k", strong=True))
    assert [seen(e) for e in got] == [(b"VV", 8, "main.b"), (b"VV", 8, "leader"), (b"VV", 8, "leader")]
    assert w.nats.calls == [("get", "b", "o.k", False), ("get", "b", "o.k", True)]
    assert w.stats.reads_coalesced == 1


async def test_a_read_joins_a_request_sent_within_its_bound(w):
    """A request sent 1500 ms before a read arrived is too old for the bucket's 1000 ms, not
    for MAXSTALE 2000."""
    w.nats.put("o.k", b"VV", 8)
    w.nats.gated = True
    first = asyncio.ensure_future(kv_get(w, b"o.k"))
    await until(lambda: len(w.nats.calls) == 1)
    w.clock.advance(1500)
    lenient = asyncio.ensure_future(kv_get(w, b"o.k", max_stale_ms=2000))
    late = asyncio.ensure_future(kv_get(w, b"o.k"))
    await until(lambda: len(w.nats.calls) == 2)
    for n in (0, 1):
        w.nats.release(n)
    await asyncio.gather(first, late, lenient)
    assert w.nats.calls == [("get", "b", "o.k", False)] * 2
    assert w.stats.reads_coalesced == 1


async def test_a_joined_batch_over_its_senders_budget_is_asked_again(w):
    w.nats.put("o.k", b"VVVV", 8)
    w.nats.put("o.l", b"LLLL", 9)
    got = await asyncio.gather(mget(w, [b"o.k", b"o.l"], ReplyBudget(5)), mget(w, [b"o.k"], ReplyBudget(100)),
                               return_exceptions=True)
    assert isinstance(got[0], ReplyTooLarge)
    assert got[1] == [(b"VVVV", "bytes")]
    assert w.nats.calls == [("many", "b", ("o.k", "o.l")), ("get", "b", "o.k", False)]


async def test_a_joined_request_that_fails_fails_its_readers_alike(w):
    stale(w.feeds["all"])
    w.nats.fail = UpstreamError("no responders")
    got = await asyncio.gather(kv_get(w, b"all:x"), kv_get(w, b"all:x"))
    assert [seen(e) for e in got] == [(b"X", 3, "stale")] * 2
    assert w.nats.calls == [("get", "all", "x", False)]


async def test_minrev_joins_a_plain_request_that_answers_at_or_above_it(w):
    w.nats.put("o.k", b"VV", 8)
    got = await asyncio.gather(kv_get(w, b"o.k"), kv_get(w, b"o.k", min_rev=8), kv_get(w, b"o.k", min_rev=7))
    assert [seen(e) for e in got] == [(b"VV", 8, "main.b")] * 3
    assert w.nats.calls == [("get", "b", "o.k", False)]
    assert w.stats.reads_coalesced == 2


async def test_minrev_asks_the_leader_when_the_joined_answer_is_below_it(w):
    w.nats.put("o.k", b"VV", 8)
    got = await asyncio.gather(kv_get(w, b"o.k"), kv_get(w, b"o.k", min_rev=9))
    assert [seen(e) for e in got] == [(b"VV", 8, "main.b"), (b"VV", 8, "leader")]   # the bucket at 10
    assert w.nats.calls == [("get", "b", "o.k", False), ("get", "b", "o.k", True)]
    assert w.stats.reads_coalesced == 1


async def test_minrev_asks_the_leader_when_the_joined_request_is_not_found_or_fails(w):
    got = await asyncio.gather(kv_get(w, b"o.none"), kv_get(w, b"o.none", min_rev=1), return_exceptions=True)
    assert w.nats.calls[:2] == [("get", "b", "o.none", False), ("get", "b", "o.none", True)]
    assert got[0] is None
    w.nats.calls.clear()
    w.nats.put("o.k", b"V2", 2)
    w.nats.gated = True
    plain = asyncio.ensure_future(kv_get(w, b"o.k"))
    minrev = asyncio.ensure_future(kv_get(w, b"o.k", min_rev=2))
    await until(lambda: len(w.nats.calls) == 1)
    w.nats.fail = UpstreamError("no responders")
    w.nats.release(len(w.nats.gates) - 1)
    await until(lambda: len(w.nats.calls) == 2)
    assert w.nats.calls == [("get", "b", "o.k", False), ("get", "b", "o.k", True)]
    w.nats.fail = None
    w.nats.release(len(w.nats.gates) - 1)
    assert seen(await minrev) == (b"V2", 2, "leader")
    with pytest.raises(CommandError):
        await plain


async def test_minrev_joins_a_batch_and_asks_the_leader_when_it_is_over_its_senders_budget(w):
    w.nats.put("o.k", b"VVVV", 8)
    got = await asyncio.gather(mget(w, [b"o.k"], ReplyBudget(2)), kv_get(w, b"o.k", min_rev=8),
                               return_exceptions=True)
    assert isinstance(got[0], ReplyTooLarge)
    assert seen(got[1]) == (b"VVVV", 8, "leader")
    assert w.nats.calls == [("many", "b", ("o.k",)), ("get", "b", "o.k", True)]


async def test_strong_minrev_joins_only_a_strong_request(w):
    w.nats.put("o.k", b"VV", 8)
    got = await asyncio.gather(kv_get(w, b"o.k"), kv_get(w, b"o.k", strong=True, min_rev=8))
    assert [seen(e) for e in got] == [(b"VV", 8, "main.b"), (b"VV", 8, "leader")]
    assert w.nats.calls == [("get", "b", "o.k", False), ("get", "b", "o.k", True)]
    assert w.stats.reads_coalesced == 0
    got = await asyncio.gather(kv_get(w, b"o.k", strong=True), kv_get(w, b"o.k", strong=True, min_rev=8),
                               kv_get(w, b"o.k", strong=True, min_rev=7))
    assert [seen(e) for e in got] == [(b"VV", 8, "leader")] * 3
    assert w.nats.calls[2:] == [("get", "b", "o.k", True)]
    assert w.stats.reads_coalesced == 2


async def test_minrev_asks_the_leader_as_of_now_not_as_it_arrived(w):
    """A MINREV read waits on a plain request it joined; a strong request sent meanwhile (after
    the read arrived, before the plain answer came below MINREV) may predate what the leader
    must show now: the read sends its own."""
    w.nats.put("o.k", b"VV", 8)
    w.nats.gated = True
    plain = asyncio.ensure_future(kv_get(w, b"o.k"))
    minrev = asyncio.ensure_future(kv_get(w, b"o.k", min_rev=9))
    await until(lambda: len(w.nats.calls) == 1)
    w.clock.advance(100)
    strong = asyncio.ensure_future(kv_get(w, b"o.k", strong=True))
    await until(lambda: len(w.nats.calls) == 2)
    w.clock.advance(100)
    w.nats.release(0)
    await until(lambda: len(w.nats.calls) == 3)
    w.nats.gated = False
    for n in (1, 2):
        w.nats.release(n)
    await asyncio.gather(plain, strong)
    assert seen(await minrev) == (b"VV", 8, "leader")   # below 9: the bucket at 10 (the feed's)
    assert w.nats.calls == [("get", "b", "o.k", False), ("get", "b", "o.k", True), ("get", "b", "o.k", True)]
    assert w.stats.reads_coalesced == 1


async def test_a_read_of_one_key_is_timed_from_the_commands_start(w):
    """The held key's latency includes the time before its wait began (the coroutine ran
    2 ms after the command came)."""
    w.wb.handed_out("rep.a", 12)
    w.meanwhile["b"] = reached(w, "b", b"rep.a", b"A12", 12)
    reply = w.reads.one(b"rep.a", "GET", answer)
    w.clock.advance(2)
    assert seen(await reply) == (b"A12", 12, "local")
    assert w.access.log == [("b", "rep.a", "local", True, (2 * MS + WAIT_NS) // 1000, "GET")]


async def test_held_keys_of_many_buckets_wait_each_for_its_own(w):
    w.wb.handed_out("rep.a", 12)
    w.ledger.witness(w.feeds["all"]).handed_out("x", 14)
    w.meanwhile["b"] = reached(w, "b", b"rep.a", b"A12", 12)
    w.meanwhile["all"] = reached(w, "all", b"x", b"X14", 14)
    assert await mget(w, [b"rep.a", b"all:x"]) == [(b"A12", "bytes"), (b"X14", "bytes")]
    assert w.waits == [("b", 12, reads_module.MINREV_WAIT_S), ("all", 14, reads_module.MINREV_WAIT_S)]
    assert w.nats.calls == []


class Transactions:
    """The replica's LMDB environment as Reads.many sees it, counting the read transactions
    it begins and aborts."""

    def __init__(self, env) -> None:
        self.env, self.begun, self.aborted = env, 0, 0

    def begin(self, **kw):
        txn = self.env.begin(**kw)
        self.begun += 1
        counter = self

        class Txn:
            def get(self, *a):
                return txn.get(*a)

            def abort(self) -> None:
                counter.aborted += 1
                txn.abort()
        return Txn()


async def test_many_keys_read_the_replica_in_one_transaction(w):
    envs = Transactions(w.replica.env)
    w.reads.replica = SimpleNamespace(env=envs)
    w.nats.put("o.k", b"V", 8)
    assert w.reads.many([b"rep.a", b"all:y", b"rep.none", b"f:rep.f"], "MGET", values) == [
        (b"A", "memoryview"), (b"YY", "memoryview"), None, (b"F", "memoryview")]
    assert (envs.begun, envs.aborted) == (1, 1)
    assert await mget(w, [b"o.k", b"rep.a", b"o.l"]) == [(b"V", "bytes"), (b"A", "bytes"), None]
    assert (envs.begun, envs.aborted) == (2, 2)
    assert await mget(w, [b"o.k", b"o.l"]) == [(b"V", "bytes"), None]    # outside the filters: none
    assert (envs.begun, envs.aborted) == (2, 2)


async def test_reads_join_a_request_sent_before_they_arrived_within_their_bound(w):
    """A plain request sent 500 ms before: MGET and MINREV join it; 1500 ms before: MINREV
    asks the leader (the bucket's bound is 1000 ms)."""
    w.nats.put("o.k", b"VV", 8)
    w.nats.gated = True
    plain = asyncio.ensure_future(kv_get(w, b"o.k"))
    await until(lambda: len(w.nats.calls) == 1)
    w.clock.advance(500)     # each read arrives as it is made (its coroutine runs later)
    many = asyncio.ensure_future(w.reads.many([b"o.k"], "MGET", values))
    minrev = asyncio.ensure_future(w.reads.one(b"o.k", "KV.GET", answer, min_rev=8))
    w.clock.advance(1000)
    late = asyncio.ensure_future(w.reads.one(b"o.k", "KV.GET", answer, min_rev=8))
    await until(lambda: len(w.nats.calls) == 2)
    w.nats.gated = False
    for n in (0, 1):
        w.nats.release(n)
    got = await asyncio.gather(plain, many, minrev, late)
    assert got[1] == [(b"VV", "bytes")]
    assert [seen(got[0]), seen(got[2]), seen(got[3])] == [(b"VV", 8, "main.b"), (b"VV", 8, "main.b"),
                                                           (b"VV", 8, "leader")]
    assert w.nats.calls == [("get", "b", "o.k", False), ("get", "b", "o.k", True)]
    assert w.stats.reads_coalesced == 2


async def test_strong_minrev_joins_a_strong_request_sent_since_it_arrived(w):
    """The read arrived before the strong request was sent (its coroutine ran later): the
    leader's answer shows every write acknowledged before the read arrived."""
    w.nats.put("o.k", b"VV", 8)
    w.nats.gated = True
    reply = w.reads.one(b"o.k", "KV.GET", answer, strong=True, min_rev=8)
    w.clock.advance(50)
    strong = asyncio.ensure_future(kv_get(w, b"o.k", strong=True))
    await until(lambda: len(w.nats.calls) == 1)
    w.clock.advance(50)
    minrev = asyncio.ensure_future(reply)
    await until(lambda: w.stats.reads_coalesced == 1)
    w.nats.release(0)
    assert [seen(e) for e in await asyncio.gather(strong, minrev)] == [(b"VV", 8, "leader")] * 2
    assert w.nats.calls == [("get", "b", "o.k", True)]


async def test_minrev_asked_again_after_stream_info_asks_as_of_now(w):
    """MINREV 12: the leader answers 5, STREAM.INFO shows the bucket at 12; a strong request
    sent before that (by another read) may not show 12: the read asks on its own."""
    w.nats.put("o.k", b"V5", 5)
    w.nats.last = 12
    w.nats.gated = True
    minrev = asyncio.ensure_future(kv_get(w, b"o.k", min_rev=12))
    await until(lambda: len(w.nats.calls) == 1)
    w.nats.release(0)
    await until(lambda: len(w.nats.calls) == 2)          # STREAM.INFO
    strong = asyncio.ensure_future(kv_get(w, b"o.k", strong=True))
    await until(lambda: len(w.nats.calls) == 3)
    w.clock.advance(100)
    w.nats.release(1)
    await until(lambda: len(w.nats.calls) == 4)
    w.nats.gated = False
    for n in (2, 3):
        w.nats.release(n)
    assert [seen(e) for e in await asyncio.gather(minrev, strong)] == [(b"V5", 5, "leader")] * 2
    assert w.nats.calls == [("get", "b", "o.k", True), ("info", "b"), ("get", "b", "o.k", True),
                            ("get", "b", "o.k", True)]
