"""The read decisions (kvcache/read/policy.py and the one rule, kvcache/store/verdict.py), each
branch on its own, by table: a real LMDB replica and near cache in a temporary directory, the
real ledger (kvcache.read.ledger: its floors and holds), and real feeds (kvcache.feed.feed.Feed:
its real freshness, on a clock the test sets; no NATS connection is made, none is needed to
decide). No process is
started: the quick tier. The reads that carry these decisions out are tested end to end with
real servers (tests/test_commands.py, test_monotonic.py, test_nearcache_live.py,
test_staleness.py).

Rewritten from a version whose stand-in Feed re-implemented `held_until` and
answered `fresh_within` from a flag: every assertion of that version is kept (the questions
`local`, `held`, `local_now`, `held_raw` and `cached` are now the routes of `route`), and the
real holds and freshness answer them."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from kvcache.config import BucketConfig, Config
from kvcache.entry import Entry, Operation
from kvcache.errors import CommandError, KvcacheError, UpstreamError
from kvcache.feed.feed import Feed
from kvcache.read.ledger import Ledger
from kvcache.read.policy import PLAN_CACHE, STALE_SOURCE, Cached, Held, Local, Plan, ReadPolicy, Remote
from kvcache.store.nearcache import NearCache
from kvcache.store.record import LONG_KEY_PREFIX, NEVER, RECORD, item
from kvcache.store.replica import BucketMeta, Replica
from kvcache.store.verdict import LOCAL, OUTSIDE, STALE, replica_verdict, stored_revision

NOW = time.time_ns()
LONG = "rep.long." + "k" * 600


def feed_of(cfg: BucketConfig, replica: Replica, cache: NearCache | None = None) -> Feed:
    """A real Feed on the replica, never started, its clock at NOW and its consumer caught up."""
    feed = Feed(None, cfg, replica)  # type: ignore[arg-type]  # no connection: it decides only
    if cache is not None:
        feed.set_cache(cache)
    feed.freshness.clock = lambda: NOW
    fresh(feed)
    return feed


def fresh(feed: Feed) -> None:
    fr = feed.freshness
    fr.caught_up, fr.interrupted, fr.heard_ns = True, False, NOW


def stale(feed: Feed, behind_ms: int = 12_000) -> None:
    """The consumer interrupted, last caught up `behind_ms` ago (Freshness.ages_ms)."""
    fr = feed.freshness
    fr.caught_up, fr.interrupted, fr.heard_ns = False, True, NOW - behind_ms * 1_000_000


@pytest.fixture
def env(tmp_path):
    """Bucket `b` (default) replicates `rep.>` and has a near cache; bucket `all` replicates
    every key, has none and serves stale; bucket `f` replicates `rep.>` and has no cache."""
    replica = Replica(str(tmp_path / "replica"), buckets=4)
    b = BucketConfig(name="b", keys=["rep.>"], max_stale_ms=1000)
    every = BucketConfig(name="all", max_stale_ms=2000, serve_stale=True)
    filtered = BucketConfig(name="f", keys=["rep.>"], max_stale_ms=1000)
    cfg = Config(buckets=[b, every, filtered])
    items = [item(b"rep.a", b"A", 5, NOW), item(LONG.encode(), b"long", 6, NOW),
             item(b"rep.ttl", b"T", 7, NOW - 10_000_000_000, 1_000_000_000)]  # expired 9 s ago
    replica.apply_items("b", items, BucketMeta(stream="KV_b", applied_seq=10, synced=True))
    replica.apply_items("all", [item(b"x", b"X", 3, NOW)], BucketMeta(stream="KV_all", applied_seq=10, synced=True))
    replica.apply_items("f", [], BucketMeta(stream="KV_f", applied_seq=10, synced=True))
    cache = NearCache(replica, "b", max_keys=100)
    feeds = {"b": feed_of(b, replica, cache), "all": feed_of(every, replica), "f": feed_of(filtered, replica)}
    ledger = Ledger()
    policy = ReadPolicy(cfg, replica, feeds, ledger)
    yield SimpleNamespace(policy=policy, replica=replica, feeds=feeds, cache=cache, floors=ledger.floors,
                          ledger=ledger, w={name: ledger.witness(f) for name, f in feeds.items()},
                          b=b, every=every, cfg=cfg)
    replica.close()


def entry(key: str, value: bytes | None, revision: int, source: str = "main.b", bucket: str = "b",
          op: Operation = Operation.PUT, expires: int = 0) -> Entry:
    return Entry(bucket, key, value, revision, NOW, 0, op, source, expires)


# ---------------------------------------------------------------------- the one rule

class Witness:
    """kvcache.store.verdict.Witness with set answers, and what it was asked."""

    def __init__(self, fresh: bool, held: int) -> None:
        self.fresh, self.held, self.max_age_ns, self.asked = fresh, held, 0, []

    def fresh_within(self, max_stale_ms: int) -> bool:
        self.asked.append(("fresh", max_stale_ms))
        return self.fresh

    def held_until(self, key, revision=None) -> int:
        self.asked.append(("held", key))
        return self.held


RULE = [
    # fresh, replicated, held, record's revision, verdict, questions asked
    (False, True, 0, None, STALE, ["fresh"]),
    (False, False, 0, None, STALE, ["fresh"]),          # stale first: LocalReader's order
    (True, False, 0, None, OUTSIDE, ["fresh"]),
    (True, True, 0, None, LOCAL, ["fresh", "held"]),
    (True, True, 0, 4, LOCAL, ["fresh", "held"]),
    (True, True, 9, None, 9, ["fresh", "held"]),         # held, no record
    (True, True, 9, 8, 9, ["fresh", "held"]),            # held, its record below the revision
    (True, True, 9, 9, LOCAL, ["fresh", "held"]),        # its record reached it already
]


@pytest.mark.parametrize(("is_fresh", "replicated", "held", "revision", "verdict", "asked"), RULE)
def test_the_rule(is_fresh, replicated, held, revision, verdict, asked):
    w = Witness(is_fresh, held)
    record = None if revision is None else SimpleNamespace(revision=revision)
    assert replica_verdict(w, 700, replicated, "k", record) == verdict
    assert [q for q, _ in w.asked] == asked and w.asked[0] == ("fresh", 700)


def test_the_rule_reads_a_stored_record_only_when_held(env):
    db = env.replica.db("b")
    with env.replica.env.begin(buffers=True) as txn:
        raw, expired = txn.get(b"rep.a", db=db), txn.get(b"rep.ttl", db=db)
        w = Witness(True, 6)
        assert stored_revision(raw, w) == 5 and stored_revision(expired, w) is None  # expired: absent
        assert replica_verdict(w, 1, True, "rep.a", raw, stored_revision) == 6
        w.held = 5
        assert replica_verdict(w, 1, True, "rep.a", raw, stored_revision) == LOCAL
        w.held = 7
        assert replica_verdict(w, 1, True, "rep.ttl", expired, stored_revision) == 7


# ---------------------------------------------------------------------- addressing and plans

def test_resolve_names_the_bucket_or_says_what_is_wrong(env):
    p = env.policy
    assert p.resolve(b"rep.a") == (env.b, "rep.a")
    assert p.resolve(b"all:x") == (env.every, "x")
    for raw, words in ((b"\xff", "not UTF-8"), (b"a..b", "invalid key"), (b"_kv.x", "reserved"),
                       (b"nope:x", "no such bucket 'nope'")):
        with pytest.raises(CommandError, match=words):
            p.resolve(raw)
        with pytest.raises(CommandError, match=words):
            p.address(raw)  # and again from the cache
        with pytest.raises(CommandError, match=words):
            p.address(raw)
    with pytest.raises(CommandError, match="no default bucket"):
        ReadPolicy(Config(), env.replica, {}, Ledger()).resolve(b"x")


def test_plan_is_made_once_for_keys_the_replica_holds(env):
    p = env.policy
    plan = p.plan(b"rep.a")
    assert plan == Plan(env.w["b"], 1000, "b", b"rep.a", env.replica.db("b"), RECORD.size,
                        None, "rep.a", env.b, True)
    assert p.plan(b"rep.a") is plan and p.address(b"rep.a") is plan  # cached, one for both
    long_plan = p.plan(b"b:" + LONG.encode())
    assert long_plan and long_plan.lkey.startswith(LONG_KEY_PREFIX) and long_plan.offset is None
    # outside the filters of a bucket with a near cache: a plan onto the cache's database
    assert p.plan(b"other.key") == Plan(env.w["b"], 1000, "b", b"other.key", env.cache.db,
                                        RECORD.size, env.cache, "other.key", env.b, False)
    assert p.plan(b"all:x").cache is None
    assert p.plan(b"f:other.key2") is False  # outside the filters, no near cache: NATS
    assert p.address(b"f:other.key2").replicated is False
    assert p.plan(b"a..b") is False       # invalid: the generic path says why
    assert len(p._plans) == 6 and PLAN_CACHE >= 6


def test_plan_cache_is_bounded(env, monkeypatch):
    monkeypatch.setattr("kvcache.read.policy.PLAN_CACHE", 2)
    p = env.policy
    for k in (b"rep.1", b"rep.2", b"rep.3"):
        p.plan(k)
    assert list(p._plans) == [b"rep.3"]  # cleared whole when full


# ---------------------------------------------------------------------- the route, by table

def _rec(env, key):
    return env.replica.get("b", key)


# (case, raw key, what is set first, route kwargs, the route expected)
ROUTES = [
    ("replicated, fresh", b"rep.a", [], {}, lambda e: Local(_rec(e, "rep.a"))),
    ("replicated, absent", b"rep.none", [], {}, lambda e: Local(None)),
    ("replicated, expired: absent", b"rep.ttl", [], {}, lambda e: Local(None)),
    ("replicated, stale", b"rep.a", ["stale"], {},
     lambda e: Remote(False, 1000, None, False, True)),
    ("replicated, unsynced", b"rep.a", ["unsynced"], {},
     lambda e: Remote(False, 1000, None, False, True)),
    ("MAXSTALE is the bound", b"rep.a", ["behind 200 ms"], {"max_stale_ms": 50},
     lambda e: Remote(False, 50, None, False, True)),
    ("within the bucket's bound", b"rep.a", ["behind 200 ms"], {}, lambda e: Local(_rec(e, "rep.a"))),
    ("MAXSTALE below the bound, a quorum's stream: the leader", b"rep.a", ["behind 200 ms", "quorum"],
     {"max_stale_ms": 50}, lambda e: Remote(True, 50, None, False, True)),
    ("MAXSTALE at the bound, a quorum's stream: any peer", b"rep.a", ["stale", "quorum"],
     {"max_stale_ms": 1000}, lambda e: Remote(False, 1000, None, False, True)),
    ("held: its record below a revision handed out", b"rep.a", ["handed rep.a 12"], {},
     lambda e: Held(12, Remote(False, 1000, None, False, True))),
    ("held: no record, NATS had one", b"rep.gone", ["handed rep.gone 11"], {},
     lambda e: Held(11, Remote(False, 1000, None, False, True))),
    ("another key held: not this one", b"rep.a", ["handed rep.gone 11"], {},
     lambda e: Local(_rec(e, "rep.a"))),
    ("held, but stale: NATS", b"rep.a", ["handed rep.a 12", "stale"], {},
     lambda e: Remote(False, 1000, None, False, True)),
    ("strong", b"rep.a", [], {"strong": True}, lambda e: Remote(True, 1000, None, False, False)),
    ("MINREV above the replica: wait for it, then NATS with it", b"rep.a", [], {"min_rev": 11},
     lambda e: Held(11, Remote(False, 1000, 11, False, False))),
    ("MINREV the replica holds: the replica", b"rep.a", [], {"min_rev": 7},
     lambda e: Local(_rec(e, "rep.a"))),
    ("MINREV the replica holds, stale: NATS with it, never stale", b"rep.a", ["stale"], {"min_rev": 7},
     lambda e: Remote(False, 1000, 7, False, False)),
    ("MINREV the replica holds, key held: wait, then NATS with it", b"rep.a", ["handed rep.a 12"],
     {"min_rev": 7}, lambda e: Held(12, Remote(False, 1000, 7, False, False))),
    ("MINREV, unsynced: wait, then NATS with it", b"rep.a", ["unsynced"], {"min_rev": 7},
     lambda e: Held(7, Remote(False, 1000, 7, False, False))),
    ("outside, not cached", b"other.key", [], {}, lambda e: Remote(False, 1000, None, True, False)),
    ("outside, cached", b"other.key", ["cache other.key 4"], {},
     lambda e: Cached(Entry("b", "other.key", b"V", 4, NOW, 0, Operation.PUT, "cache", 0))),
    ("outside, cached, MINREV at it", b"other.key", ["cache other.key 4"], {"min_rev": 4},
     lambda e: Cached(Entry("b", "other.key", b"V", 4, NOW, 0, Operation.PUT, "cache", 0))),
    ("outside, cached, MINREV above it", b"other.key", ["cache other.key 4"], {"min_rev": 5},
     lambda e: Remote(False, 1000, 5, True, False)),
    ("outside, cached, stale", b"other.key", ["cache other.key 4", "stale"], {},
     lambda e: Remote(False, 1000, None, True, False)),
    ("outside, cached, strong", b"other.key", ["cache other.key 4"], {"strong": True},
     lambda e: Remote(True, 1000, None, True, False)),
    ("outside, cached not-found", b"gone", ["absent gone 6"], {},
     lambda e: Cached(Entry("b", "gone", None, 6, 0, 0, Operation.DEL, "cache"))),
    ("outside, cached not-found, MINREV", b"gone", ["absent gone 6"], {"min_rev": 1},
     lambda e: Remote(False, 1000, 1, True, False)),
    ("outside, cached not-found below a floor", b"gone", ["absent gone 6", "floor gone 8"], {},
     lambda e: Remote(False, 1000, None, True, False)),
    ("outside, cached expired", b"short", ["expired short"], {},
     lambda e: Remote(False, 1000, None, True, False)),
    ("outside, cached below a floor", b"kept", ["cache kept 3 never", "floor kept 9"], {},
     lambda e: Remote(False, 1000, None, True, False)),
    ("outside, no near cache", b"f:other", [], {}, lambda e: Remote(False, 1000, None, False, False)),
    ("every key replicated", b"all:x", [], {},
     lambda e: Local(e.replica.get("all", "x"))),
]


def _set(env, what: str) -> None:
    feed = env.feeds["b"]
    word, *args = what.split()
    if word == "stale":
        stale(feed)
    elif word == "quorum":
        feed.freshness.quorum = True
    elif word == "unsynced":
        feed.meta.synced = False
    elif word == "behind":
        stale(feed, int(args[0]))
    elif word == "handed":
        env.w["b"].handed_out(args[0], int(args[1]))
    elif word == "cache":
        env.cache.offer_entry(args[0], args[0].encode(), b"V", int(args[1]), NOW,
                              NEVER if args[2:] == ["never"] else 0)
    elif word == "absent":
        env.cache.offer_absent(args[0].encode(), int(args[1]))
    elif word == "expired":
        env.cache.offer_entry(args[0], args[0].encode(), b"S", 3, NOW - 10_000_000_000, NOW - 1)
    elif word == "floor":
        env.floors.saw("b", args[0], entry(args[0], b"newer", int(args[1])))


@pytest.mark.parametrize(("case", "raw", "setup", "kwargs", "expected"), ROUTES, ids=[r[0] for r in ROUTES])
def test_route(env, case, raw, setup, kwargs, expected):
    for what in setup:
        _set(env, what)
    p = env.policy
    assert p.route(p.address(raw), **kwargs) == expected(env)


def test_route_in_a_transaction_gives_the_stored_record(env):
    p = env.policy
    with env.replica.env.begin(buffers=True) as txn:
        got = p.route(p.address(b"rep.a"), txn=txn)
        assert got.__class__ is Local and bytes(got.record) == bytes(txn.get(b"rep.a", db=env.replica.db("b")))
        assert p.route(p.address(b"rep.ttl"), txn=txn).__class__ is Local  # the reply drops it
        env.w["b"].handed_out("rep.ttl", 12)
        assert p.route(p.address(b"rep.ttl"), txn=txn) == Held(12, Remote(False, 1000, None, False, True))


def test_an_expired_cached_record_is_dropped(env):
    _set(env, "expired short")
    p = env.policy
    p.route(p.address(b"short"))
    assert b"short" not in env.cache


def test_a_route_the_cache_may_not_answer_counts_towards_admission(env):
    p, cache = env.policy, env.cache
    cache.offer_entry("other.key", b"other.key", b"V", 4, NOW, 0)
    stale(env.feeds["b"])
    before = cache.sketch.estimate(b"other.key")
    assert p.route(p.address(b"other.key")).__class__ is Remote  # the feed cannot vouch for it now
    assert cache.sketch.estimate(b"other.key") == before + 1 and cache.stats.hits == 0


def test_a_held_key_is_released_when_the_replica_reaches_it(env):
    """The real ledger: the feed reports what it applied, the hold ends."""
    p, feed, w = env.policy, env.feeds["b"], env.w["b"]
    w.handed_out("rep.a", 12)
    assert not w.fresh_for_all(1000)  # the GET fast path stands aside meanwhile
    assert p.route(p.address(b"rep.a")).__class__ is Held
    feed.meta.applied_seq = 11
    env.ledger.applied("b", feed.meta)
    assert p.route(p.address(b"rep.a")).__class__ is Held
    feed.meta.applied_seq = 12  # the replica's record of rep.a is still 5, and current
    env.ledger.applied("b", feed.meta)
    assert p.route(p.address(b"rep.a")) == Local(_rec(env, "rep.a")) and w.fresh_for_all(1000)
    w.handed_out("rep.a", 14)
    env.ledger.resync_began("b")  # a full sync: its end holds every revision handed out before
    assert w.fresh_for_all(1000)


# ---------------------------------------------------------------------- the near cache's fill

def _fill(env, key, e, answered):
    env.policy.fill(env.policy.address(key.encode()), e, answered)


def test_fill_admits_an_answer_of_the_buckets_own_stream(env):
    cache = env.cache
    _fill(env, "k1", entry("k1", b"v1", 4, "main.b"), "main.b")
    _fill(env, "k2", entry("k2", b"v2", 4, "leader"), "leader")
    _fill(env, "k3", None, "main.b")  # a not-found: cached as one, at revision 0
    assert cache.lookup(b"k1") == (b"v1", 4, NOW, 0)
    assert cache.lookup(b"k2") is not None
    assert cache.lookup(b"k3") == (None, 0, 0, 0)
    _fill(env, "rep.a", entry("rep.a", b"x", 4), "main.b")  # replicated: never cached
    assert b"rep.a" not in cache


def test_fill_refuses_a_mirror_a_stale_feed_and_an_older_answer(env):
    feed, cache = env.feeds["b"], env.cache
    _fill(env, "m", entry("m", b"v", 4, "mirror.b"), "mirror.b")  # a mirror may lag: no
    _fill(env, "n", None, "mirror.b")
    assert b"m" not in cache and b"n" not in cache
    _fill(env, "k", entry("k", b"new", 6), "main.b")
    _fill(env, "k", entry("k", b"old", 5), "main.b")  # a lagging responder's answer
    assert cache.lookup(b"k") == (b"new", 6, NOW, 0)
    stale(feed)  # the feed cannot vouch (Feed.fill_ok)
    _fill(env, "k", entry("k", b"newer", 7), "main.b")
    assert b"k" not in cache  # an answer newer than the cached one that may not go in drops it
    _fill(env, "k", entry("k", b"newer", 7), "main.b")
    assert b"k" not in cache


def test_fill_of_a_not_found_beside_a_cached_value(env):
    cache = env.cache
    _fill(env, "k", entry("k", b"v", 6), "main.b")
    _fill(env, "k", None, "main.b")  # contradicts the cached value: keep neither
    assert b"k" not in cache
    _fill(env, "d", entry("d", None, 9, op=Operation.DEL), "main.b")  # a deletion's marker
    assert cache.lookup(b"d") == (None, 9, 0, 0)
    _fill(env, "d", entry("d", None, 8, op=Operation.DEL), "main.b")  # an older marker
    assert cache.lookup(b"d") == (None, 9, 0, 0)


# ---------------------------------------------------------------------- answers from NATS

def test_newest_wins(env):
    p, feed = env.policy, env.feeds["b"]
    a = p.address
    remote = entry("other.key", b"r", 3)
    assert p.newest(a(b"other.key"), remote) is remote  # outside the filters: NATS's alone
    got = p.newest(a(b"rep.a"), entry("rep.a", b"older", 4))  # the replica holds 5
    assert got == Entry("b", "rep.a", b"A", 5, NOW, 0, Operation.PUT, "local")
    assert p.newest(a(b"rep.a"), None).source == "local"  # a not-found never overrides it
    assert p.newest(a(b"rep.none"), None) is None
    # at or below what the synced replica applied (10): the replica knows better (absent)
    assert p.newest(a(b"rep.none"), entry("rep.none", b"lagging", 9)) is None
    same = entry("rep.a", b"A", 5, "peer")
    assert p.newest(a(b"rep.a"), same) is same
    holds = env.ledger.holds["b"]
    assert holds.ahead == {}
    ahead = entry("rep.a", b"new", 12)  # above the replica: handed out, and noted
    assert p.newest(a(b"rep.a"), ahead) is ahead and holds.ahead == {"rep.a": 12}
    feed.meta.synced = False  # an unsynced replica's position says nothing: every revision counts
    assert p.newest(a(b"rep.none"), entry("rep.none", b"v", 9)) is not None
    assert holds.ahead["rep.none"] == 9


SERVES_STALE = Remote(False, 2000, None, False, True)


def test_stale_entry_or_the_error(env):
    p, feed = env.policy, env.feeds["all"]
    x = p.address(b"all:x")
    down = UpstreamError("no peer answered")
    with pytest.raises(CommandError, match="upstream read failed"):
        p.stale_entry(x, Remote(True, 2000, None, False, False), down)  # CONSISTENCY strong: never stale
    with pytest.raises(CommandError, match="upstream read failed"):
        p.stale_entry(x, SERVES_STALE, KvcacheError("refused"))  # not a peer being away
    outside = p.address(b"other.key")
    with pytest.raises(CommandError, match="upstream read failed"):
        p.stale_entry(outside, p.route(outside), down)  # not replicated: nothing to fall back on
    stale(feed)
    got = p.stale_entry(x, SERVES_STALE, down)
    assert got == Entry("all", "x", b"X", 3, NOW, 0, Operation.PUT, STALE_SOURCE)
    assert p.stale_entry(p.address(b"all:missing"), SERVES_STALE, down) is None  # synced: it knows it is absent
    feed.meta.synced = False
    with pytest.raises(CommandError, match="has not finished its sync"):
        p.stale_entry(p.address(b"all:missing"), SERVES_STALE, down)
    feed.meta.synced = True
    env.floors.saw("all", "x", entry("x", b"newer", 4, bucket="all"))
    with pytest.raises(CommandError, match="newer revision of the key was already read"):
        p.stale_entry(x, SERVES_STALE, down)


def test_stale_refused_when_the_bucket_does_not_serve_stale(env):
    p, feed = env.policy, env.feeds["b"]
    a = p.address(b"rep.a")
    down = UpstreamError("no peer answered")
    stale(feed)
    with pytest.raises(CommandError, match=r"replica stale \(12.0s behind, max_stale_ms 1000\)"):
        p.stale_entry(a, p.route(a), down)
    fresh(feed)  # fresh, so the key was held
    with pytest.raises(CommandError, match="replica behind a revision of the key"):
        p.stale_entry(a, Remote(False, 300, None, False, True), down)
    feed.meta.synced = False
    with pytest.raises(CommandError, match="replica not synced"):
        p.stale_entry(a, p.route(a), down)


def test_vouched(env):
    feed = env.feeds["b"]
    assert env.policy.vouched("b")
    stale(feed, 1001)
    assert not env.policy.vouched("b")
    stale(feed, 1000)
    assert env.policy.vouched("b")
