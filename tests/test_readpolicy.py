"""The read decisions (kvcache/read/policy.py), each branch on its own: a real LMDB replica and
near cache in a temporary directory, the router's real floors, and a stand-in feed with only
what the policy asks of kvcache.feed.feed.Feed (fresh within a bound? is this key held? may this
answer fill the cache?), so that each answer can be set at will. No process is started: the
quick tier. The reads that carry these decisions out are tested end to end with real servers
(tests/test_commands.py, test_monotonic.py, test_nearcache_live.py, test_staleness.py)."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from kvcache.config import BucketConfig, Config
from kvcache.entry import Entry, Operation
from kvcache.errors import CommandError, KvcacheError, UpstreamError
from kvcache.read.policy import PLAN_CACHE, STALE_SOURCE, Plan, ReadPolicy
from kvcache.read.router import Floors
from kvcache.store.nearcache import NearCache
from kvcache.store.record import LONG_KEY_PREFIX, NEVER, RECORD, item
from kvcache.store.replica import BucketMeta, Replica

NOW = time.time_ns()
LONG = "rep.long." + "k" * 600


class Feed:
    """What ReadPolicy asks of kvcache.feed.feed.Feed, each answer settable."""

    def __init__(self, cfg: BucketConfig, cache: NearCache | None = None) -> None:
        self.cfg = cfg
        self.cache = cache
        self.fresh = True            # fresh_within's answer
        self.bounds: list[int] = []  # the bounds it was asked about
        self.synced = True
        self.meta = SimpleNamespace(applied_seq=10)
        self.max_age_ns = 0
        self.ahead: dict[str, int] = {}  # key -> revision handed out from NATS
        self.floor_seq = 0
        self.fill_allowed = True
        self.handed: list[tuple[str, int]] = []

    def fresh_within(self, max_stale_ms: int) -> bool:
        self.bounds.append(max_stale_ms)
        return self.fresh

    def held_until(self, key: str, revision: int | None) -> int:
        want = self.ahead.get(key, 0)
        return 0 if not want or (revision is not None and revision >= want) else want

    def handed_out(self, key: str, revision: int) -> None:
        self.handed.append((key, revision))

    def fill_ok(self, lkey: bytes, revision: int) -> bool:
        return self.fill_allowed and self.fresh

    def lag_ms(self) -> float:
        return 12_000.0


@pytest.fixture
def env(tmp_path):
    """Bucket `b` (default) replicates `rep.>` and has a near cache; bucket `all` replicates
    every key, has none and serves stale."""
    replica = Replica(str(tmp_path / "replica"), buckets=2)
    b = BucketConfig(name="b", keys=["rep.>"], max_stale_ms=1000)
    every = BucketConfig(name="all", max_stale_ms=2000, serve_stale=True)
    cfg = Config(buckets=[b, every])
    items = [item(b"rep.a", b"A", 5, NOW), item(LONG.encode(), b"long", 6, NOW),
             item(b"rep.ttl", b"T", 7, NOW - 10_000_000_000, 1_000_000_000)]  # expired 9 s ago
    replica.apply_items("b", items, BucketMeta(stream="KV_b", applied_seq=10, synced=True))
    replica.apply_items("all", [item(b"x", b"X", 3, NOW)], BucketMeta(stream="KV_all", applied_seq=10, synced=True))
    cache = NearCache(replica, "b", max_keys=100)
    feeds = {"b": Feed(b, cache), "all": Feed(every)}
    floors = Floors()
    policy = ReadPolicy(cfg, replica, feeds, floors)
    yield SimpleNamespace(policy=policy, replica=replica, feeds=feeds, cache=cache, floors=floors,
                          b=b, every=every, cfg=cfg)
    replica.close()


def entry(key: str, value: bytes | None, revision: int, source: str = "main.b", bucket: str = "b",
          op: Operation = Operation.PUT, expires: int = 0) -> Entry:
    return Entry(bucket, key, value, revision, NOW, 0, op, source, expires)


# ---------------------------------------------------------------------- addressing and plans

def test_resolve_names_the_bucket_or_says_what_is_wrong(env):
    p = env.policy
    assert p.resolve(b"rep.a") == (env.b, "rep.a")
    assert p.resolve(b"all:x") == (env.every, "x")
    for raw, words in ((b"\xff", "not UTF-8"), (b"a..b", "invalid key"), (b"_kv.x", "reserved"),
                       (b"nope:x", "no such bucket 'nope'")):
        with pytest.raises(CommandError, match=words):
            p.resolve(raw)
    with pytest.raises(CommandError, match="no default bucket"):
        ReadPolicy(Config(), env.replica, {}, env.floors).resolve(b"x")


def test_plan_is_made_once_for_keys_the_replica_holds(env):
    p = env.policy
    plan = p.plan(b"rep.a")
    assert plan == Plan(env.feeds["b"], 1000, "b", b"rep.a", env.replica.db("b"), RECORD.size)
    assert p.plan(b"rep.a") is plan  # cached
    long_plan = p.plan(b"b:" + LONG.encode())
    assert long_plan and long_plan.lkey.startswith(LONG_KEY_PREFIX) and long_plan.offset is None
    # outside the filters of a bucket with a near cache: a plan onto the cache's database
    assert p.plan(b"other.key") == Plan(env.feeds["b"], 1000, "b", b"other.key", env.cache.db,
                                        RECORD.size, env.cache)
    assert p.plan(b"all:x").cache is None
    env.feeds["b"].cache = None
    assert p.plan(b"other.key2") is False  # outside the filters, no near cache: NATS
    assert p.plan(b"a..b") is False       # invalid: the generic path says why
    assert len(p._plans) == 6 and PLAN_CACHE >= 6


def test_plan_cache_is_bounded(env, monkeypatch):
    monkeypatch.setattr("kvcache.read.policy.PLAN_CACHE", 2)
    p = env.policy
    for k in (b"rep.1", b"rep.2", b"rep.3"):
        p.plan(k)
    assert list(p._plans) == [b"rep.3"]  # cleared whole when full


# ---------------------------------------------------------------------- local, held

def test_local_when_replicated_and_fresh_within_the_bound(env):
    p, feed = env.policy, env.feeds["b"]
    assert p.local(env.b, "rep.a")
    assert p.local(env.b, "rep.a", 50) and feed.bounds[-2:] == [1000, 50]  # MAXSTALE is the bound
    assert not p.local(env.b, "other.key")  # outside the filters
    feed.fresh = False
    assert not p.local(env.b, "rep.a")      # stale


def test_held_until_the_replica_reaches_a_revision_handed_out(env):
    p, feed = env.policy, env.feeds["b"]
    rec = env.replica.get("b", "rep.a")
    assert rec is not None and rec.revision == 5
    assert p.held(env.b, "rep.a", rec) == 0
    feed.ahead["rep.a"] = 8
    assert p.held(env.b, "rep.a", rec) == 8      # its record (5) is below what was handed out
    assert p.held(env.b, "rep.gone", None) == 0  # nothing handed out for it
    feed.ahead["rep.gone"] = 9
    assert p.held(env.b, "rep.gone", None) == 9  # no record at all, and NATS had one
    assert p.local_now(env.b, "rep.a") == (False, None)
    feed.ahead.clear()
    ok, got = p.local_now(env.b, "rep.a")
    assert ok and got is not None and got.value == b"A"
    assert p.local_now(env.b, "rep.none") == (True, None)  # absent, and the replica may say so
    feed.fresh = False
    assert p.local_now(env.b, "rep.a") == (False, None)


def test_held_raw_reads_the_stored_record(env):
    p, feed = env.policy, env.feeds["b"]
    with env.replica.read_txn() as txn:
        raw = txn.get(b"rep.a", db=env.replica.db("b"))
        expired = txn.get(b"rep.ttl", db=env.replica.db("b"))
    feed.ahead.update({"rep.a": 8, "rep.ttl": 7})
    assert p.held_raw(b"rep.a", feed, raw) == ("b", "rep.a", 8)
    assert p.held_raw(b"rep.ttl", feed, expired) == ("b", "rep.ttl", 7)  # expired: as absent
    feed.ahead["rep.a"] = 5
    assert p.held_raw(b"rep.a", feed, raw) == ("b", "rep.a", 0)


# ---------------------------------------------------------------------- the near cache

def test_cached_answers_what_the_cache_may_give(env):
    p, cache = env.policy, env.cache
    assert p.cached(env.b, "other.key") is None  # not cached
    cache.offer_entry("other.key", b"other.key", b"V", 4, NOW, 0)
    got = p.cached(env.b, "other.key")
    assert got == Entry("b", "other.key", b"V", 4, NOW, 0, Operation.PUT, "cache", 0)
    assert p.cached(env.b, "other.key", min_rev=5) is None  # MINREV above it
    assert p.cached(env.b, "other.key", min_rev=4) == got
    assert p.cached(env.b, "rep.a") is None      # replicated: never the cache's
    assert p.cached(env.every, "x") is None      # a bucket with no cache


def test_cached_counts_a_read_it_may_not_answer(env):
    p, feed, cache = env.policy, env.feeds["b"], env.cache
    cache.offer_entry("other.key", b"other.key", b"V", 4, NOW, 0)
    feed.fresh = False
    before = cache.sketch.estimate(b"other.key")
    assert p.cached(env.b, "other.key") is None  # the feed cannot vouch for it now
    assert cache.sketch.estimate(b"other.key") == before + 1 and cache.stats.hits == 0


def test_cached_not_found_and_expiry_and_floors(env):
    p, cache, floors = env.policy, env.cache, env.floors
    cache.offer_absent(b"gone", 6)
    assert p.cached(env.b, "gone") == Entry("b", "gone", None, 6, 0, 0, Operation.DEL, "cache")
    assert p.cached(env.b, "gone", min_rev=1) is None  # MINREV wants a value
    cache.offer_entry("short", b"short", b"S", 3, NOW - 10_000_000_000, NOW - 1)  # expired
    assert p.cached(env.b, "short") is None and b"short" not in cache
    cache.offer_entry("kept", b"kept", b"K", 3, NOW, NEVER)
    floors.saw("b", "kept", entry("kept", b"newer", 9))  # a newer revision already handed out
    assert p.cached(env.b, "kept") is None
    floors.saw("b", "gone", entry("gone", b"back", 8))
    assert p.cached(env.b, "gone") is None


def test_fill_admits_an_answer_of_the_buckets_own_stream(env):
    p, cache = env.policy, env.cache
    p.fill(env.b, "k1", entry("k1", b"v1", 4, "main.b"), "main.b")
    p.fill(env.b, "k2", entry("k2", b"v2", 4, "leader"), "leader")
    p.fill(env.b, "k3", None, "main.b")  # a not-found: cached as one, at revision 0
    assert cache.lookup(b"k1") == (b"v1", 4, NOW, 0)
    assert cache.lookup(b"k2") is not None
    assert cache.lookup(b"k3") == (None, 0, 0, 0)
    p.fill(env.b, "rep.a", entry("rep.a", b"x", 4), "main.b")  # replicated: never cached
    assert b"rep.a" not in cache


def test_fill_refuses_a_mirror_a_stale_feed_and_an_older_answer(env):
    p, feed, cache = env.policy, env.feeds["b"], env.cache
    p.fill(env.b, "m", entry("m", b"v", 4, "mirror.b"), "mirror.b")  # a mirror may lag: no
    p.fill(env.b, "n", None, "mirror.b")
    assert b"m" not in cache and b"n" not in cache
    p.fill(env.b, "k", entry("k", b"new", 6), "main.b")
    p.fill(env.b, "k", entry("k", b"old", 5), "main.b")  # a lagging responder's answer
    assert cache.lookup(b"k") == (b"new", 6, NOW, 0)
    feed.fill_allowed = False  # the feed saw a newer change on the way, or cannot vouch
    p.fill(env.b, "k", entry("k", b"newer", 7), "main.b")
    assert b"k" not in cache  # an answer newer than the cached one that may not go in drops it
    p.fill(env.b, "k", entry("k", b"newer", 7), "main.b")
    assert b"k" not in cache


def test_fill_of_a_not_found_beside_a_cached_value(env):
    p, cache = env.policy, env.cache
    p.fill(env.b, "k", entry("k", b"v", 6), "main.b")
    p.fill(env.b, "k", None, "main.b")  # contradicts the cached value: keep neither
    assert b"k" not in cache
    p.fill(env.b, "d", entry("d", None, 9, op=Operation.DEL), "main.b")  # a deletion's marker
    assert cache.lookup(b"d") == (None, 9, 0, 0)
    p.fill(env.b, "d", entry("d", None, 8, op=Operation.DEL), "main.b")  # an older marker
    assert cache.lookup(b"d") == (None, 9, 0, 0)


# ---------------------------------------------------------------------- answers from NATS

def test_newest_wins(env):
    p, feed = env.policy, env.feeds["b"]
    remote = entry("other.key", b"r", 3)
    assert p.newest(env.b, "other.key", remote) is remote  # outside the filters: NATS's alone
    got = p.newest(env.b, "rep.a", entry("rep.a", b"older", 4))  # the replica holds 5
    assert got == Entry("b", "rep.a", b"A", 5, NOW, 0, Operation.PUT, "local")
    assert p.newest(env.b, "rep.a", None).source == "local"  # a not-found never overrides it
    assert p.newest(env.b, "rep.none", None) is None
    # at or below what the synced replica applied (10): the replica knows better (absent)
    assert p.newest(env.b, "rep.none", entry("rep.none", b"lagging", 9)) is None
    same = entry("rep.a", b"A", 5, "peer")
    assert p.newest(env.b, "rep.a", same) is same
    assert feed.handed == []
    ahead = entry("rep.a", b"new", 12)  # above the replica: handed out, and noted
    assert p.newest(env.b, "rep.a", ahead) is ahead and feed.handed == [("rep.a", 12)]
    feed.synced = False  # an unsynced replica's position says nothing: every revision counts
    assert p.newest(env.b, "rep.none", entry("rep.none", b"v", 9)) is not None
    assert feed.handed[-1] == ("rep.none", 9)


def test_stale_entry_or_the_error(env):
    p, feed = env.policy, env.feeds["all"]
    down = UpstreamError("no peer answered")
    with pytest.raises(CommandError, match="upstream read failed"):
        p.stale_entry(env.every, "x", down, strong=True)  # CONSISTENCY strong: never stale
    with pytest.raises(CommandError, match="upstream read failed"):
        p.stale_entry(env.every, "x", KvcacheError("refused"))  # not a peer being away
    with pytest.raises(CommandError, match="upstream read failed"):
        p.stale_entry(env.b, "other.key", down)  # not replicated: nothing to fall back on
    feed.fresh = False
    got = p.stale_entry(env.every, "x", down)
    assert got == Entry("all", "x", b"X", 3, NOW, 0, Operation.PUT, STALE_SOURCE)
    assert p.stale_entry(env.every, "missing", down) is None  # synced: it knows it is absent
    feed.synced = False
    with pytest.raises(CommandError, match="has not finished its sync"):
        p.stale_entry(env.every, "missing", down)
    feed.synced = True
    env.floors.saw("all", "x", entry("x", b"newer", 4, bucket="all"))
    with pytest.raises(CommandError, match="newer revision of the key was already read"):
        p.stale_entry(env.every, "x", down)


def test_stale_refused_when_the_bucket_does_not_serve_stale(env):
    p, feed = env.policy, env.feeds["b"]
    down = UpstreamError("no peer answered")
    feed.fresh = False
    with pytest.raises(CommandError, match=r"replica stale \(12.0s behind, max_stale_ms 1000\)"):
        p.stale_entry(env.b, "rep.a", down)
    feed.fresh = True  # fresh, so the key was held
    with pytest.raises(CommandError, match="replica behind a revision of the key"):
        p.stale_entry(env.b, "rep.a", down, max_stale_ms=300)
    feed.synced = False
    with pytest.raises(CommandError, match="replica not synced"):
        p.stale_entry(env.b, "rep.a", down)


def test_vouched(env):
    feed = env.feeds["b"]
    assert env.policy.vouched("b") and feed.bounds[-1] == 1000
    feed.fresh = False
    assert not env.policy.vouched("b")
