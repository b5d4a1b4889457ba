"""The server's GET path: the Cython one against its pure-Python twin, on a real replica.

Both must give byte-identical replies, stop at the same request and count the same misses,
on vectors and on generated runs; the native one must also follow the writer's map growth
and databases created after it opened. The feed here is a stand-in with only what the GET
path asks of it (`fresh_for_all`), so that staleness can be switched at will.

Bucket `other` has a near cache (a real NearCache in the replica's file) holding `c.v` (a
value), `c.none` (a cached not-found) and `c.ttl` (expired): its keys under `c.` are planned
onto the cache (Plan.cache), so every test and generated run covers cached hits, cached
not-founds and the keys the generic path must answer after all (`c.ttl`, `c.miss`).
"""
from __future__ import annotations

import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcache.native import native_or_none
from kvcache.read.policy import Plan
from kvcache.resp import GET_LEN
from kvcache.serve import server_get as twin
from kvcache.store.near_hits import LRU_SAMPLE, TOUCH_MAX
from kvcache.store.nearcache import NearCache
from kvcache.store.record import LONG_KEY_PREFIX, RECORD, item, lmdb_key
from kvcache.store.replica import BucketMeta, Replica

native = native_or_none("server_get")  # None: not built (an error with KVCACHE_REQUIRE_EXTENSIONS=1)

IMPLS = [
    pytest.param(twin, id="python"),
    pytest.param(native, id="native",
                 marks=pytest.mark.skipif(native is None, reason="kvcache._native.server_get not built")),
]
MiB = 1 << 20
LONG = "long." + "k" * 600
VALUES = {"a": b"1", "empty": b"", "bin": b"\r\n$-1\r\n\x00\xff", "nine": b"x" * 9999,
          "ten": b"y" * 10000, "big": bytes(range(256)) * 400, LONG: b"long value",
          "dot.ted.key": b"dotted", "b/c=d_e-f": b"punct"}
OTHER = {"a": b"other a", "only.here": b"o"}


class Feed:
    """What the GET path asks of kvcache.feed.feed.Feed: may the replica answer now?"""

    def __init__(self, bucket: str) -> None:
        self.bucket = bucket
        self.fresh = True
        self.asked = 0
        self.max_age_ns = 0  # the stream's max_age: records older than it are absent
        self.cache: NearCache | None = None

    def fresh_for_all(self, max_stale_ms: int) -> bool:
        self.asked += 1
        return self.fresh


def load(replica: Replica, bucket: str, values: dict[str, bytes]) -> None:
    items = [item(k.encode(), v, i + 1, 1_700_000_000_000_000_000) for i, (k, v) in enumerate(values.items())]
    replica.apply_items(bucket, items, BucketMeta(stream=f"KV_{bucket}", applied_seq=len(items), synced=True))


class Planner:
    """ReadPolicy.plan's contract, for buckets `main` (default, every key) and `other`
    (only keys under `only.` are replicated: the rest is remote)."""

    def __init__(self, feeds: dict[str, Feed], replica: Replica) -> None:
        self.feeds = feeds
        self.replica = replica
        self.calls = 0

    def __call__(self, raw: bytes):
        self.calls += 1
        text = raw.decode()
        bucket, sep, key = text.partition(":")
        if not sep:
            bucket, key = "main", text
        if bucket not in self.feeds or not key or ":" in key or key.startswith(".") \
                or key.endswith(".") or ".." in key:
            return False
        lkey = lmdb_key(key)
        if bucket == "other" and not key.startswith("only."):
            cache = self.feeds[bucket].cache
            if cache is None or not key.startswith("c."):
                return False
            return Plan(self.feeds[bucket], 1000, bucket, lkey, cache.db, RECORD.size, cache)
        return Plan(self.feeds[bucket], 1000, bucket, lkey, self.replica.db(bucket),
                    None if lkey.startswith(LONG_KEY_PREFIX) else RECORD.size)


@pytest.fixture
def env(tmp_path):
    replica = Replica(str(tmp_path / "replica"), map_size=4 * MiB)
    load(replica, "main", VALUES)
    load(replica, "other", OTHER)
    feeds = {"main": Feed("main"), "other": Feed("other"), "later": Feed("later")}
    feeds["other"].cache = cache_of(replica)
    yield replica, feeds
    replica.close()


NOW = time.time_ns()


def cache_of(replica: Replica) -> NearCache:
    """Bucket `other`'s near cache (see the module docstring); a second one on the same
    database starts with its own sketch and hit list."""
    cache = NearCache(replica, "other", max_keys=100)
    if not len(cache):
        cache.offer_entry("c.v", b"c.v", b"cached", 5, NOW, 0)
        cache.offer_absent(b"c.none", 6)
        cache.offer_entry("c.ttl", b"c.ttl", b"gone", 7, NOW - 10_000_000_000, NOW - 9_000_000_000)
    return cache


def make(mod, replica, feeds, direct: bool = True):
    planner = Planner(feeds, replica)
    gets = mod.ServerGets(replica, planner)
    if direct:
        gets.set_buckets([("main", feeds["main"], 1000, True), ("other", feeds["other"], 1000, False),
                          ("later", feeds["later"], 1000, True)], "main")
    return gets, planner


def request(keys: list[str]) -> tuple[list, list]:
    raw = [k.encode() for k in keys]
    return [GET_LEN[len(k)] for k in raw], raw


def expected(values: list[bytes | None], proto: int = 2) -> bytes:
    nil = b"_\r\n" if proto == 3 else b"$-1\r\n"
    return b"".join(nil if v is None else b"$%d\r\n%s\r\n" % (len(v), v) for v in values)


@pytest.mark.parametrize("mod", IMPLS)
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "planned"])
def test_answers_in_order_with_misses(mod, env, direct):
    replica, feeds = env
    gets, _ = make(mod, replica, feeds, direct)
    keys = [*list(VALUES), "missing", "main:a", "other:only.here", "other:only.gone", "later:x"]
    for proto in (2, 3):
        out, answered, notfound = gets.serve(*request(keys), proto, 1 << 30)
        want = [VALUES[k] for k in VALUES] + [None, b"1", b"o", None, None]
        assert (answered, notfound) == (len(keys), 3)
        assert out == expected(want, proto)


@pytest.mark.parametrize("mod", IMPLS)
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "planned"])
def test_expired_records_are_absent(mod, env, direct):
    """A record past its deadline (its own Nats-TTL, or the bucket's max_age from its
    creation; `never` escapes both) answers nil at once, whatever the sweep has done."""
    replica, feeds = env
    now = time.time_ns()
    s = 1_000_000_000
    ttl = {"ttl.gone": (b"g", now - 3 * s, 2 * s), "ttl.live": (b"l", now, 600 * s),
           "ttl.never": (b"n", now - 900 * s, -1), "old": (b"o", now - 900 * s, 0),
           "new": (b"w", now, 0), LONG + ".gone": (b"lg", now - 3 * s, 2 * s),
           LONG + ".live": (b"ll", now, 600 * s), "ttl.capped": (b"c", now - 400 * s, 600 * s)}
    items = [item(k.encode(), v, 100 + i, created, t) for i, (k, (v, created, t)) in enumerate(ttl.items())]
    replica.apply_items("main", items, BucketMeta(stream="KV_main", applied_seq=200, synced=True))
    gets, _ = make(mod, replica, feeds, direct)
    keys = list(ttl)
    out, answered, notfound = gets.serve(*request(keys), 2, 1 << 30)
    assert out == expected([None, b"l", b"n", b"o", b"w", None, b"ll", b"c"])
    assert (answered, notfound) == (len(keys), 2)
    feeds["main"].max_age_ns = 300 * s  # caps every deadline but `never`'s
    gets, _ = make(mod, replica, feeds, direct)  # a new verdict reads max_age again
    out, answered, notfound = gets.serve(*request(keys), 2, 1 << 30)
    assert out == expected([None, b"l", b"n", None, b"w", None, b"ll", None])
    assert (answered, notfound) == (len(keys), 4)


@pytest.mark.parametrize("mod", IMPLS)
def test_stops_where_the_generic_path_must_answer(mod, env):
    replica, feeds = env
    gets, _ = make(mod, replica, feeds)
    cases = {
        "remote (outside the bucket's filters)": ["a", "other:remote.key", "a"],
        "invalid key": ["a", ".bad", "a"],
        "empty token": ["a", "x..y", "a"],
        "unknown bucket": ["a", "nope:a", "a"],
        "second colon": ["a", "main:a:b", "a"],
    }
    for name, keys in cases.items():
        out, answered, notfound = gets.serve(*request(keys), 2, 1 << 30)
        assert (out, answered, notfound) == (expected([b"1"]), 1, 0), name
    lengths, raw = request(["a", "a"])
    lengths[1] = b"$01"  # a spelling only the full parser may judge
    assert gets.serve(lengths, raw, 2, 1 << 30)[1] == 1


@pytest.mark.parametrize("mod", IMPLS)
def test_stale_replica_is_not_served_and_freshness_is_asked_once_per_call(mod, env):
    replica, feeds = env
    gets, _ = make(mod, replica, feeds)
    assert gets.serve(*request(["a", "bin", "a", "other:only.here"]), 2, 1 << 30)[1] == 4
    assert feeds["main"].asked in (1, 2)   # once per stretch of one bucket's keys
    feeds["main"].fresh = False
    time.sleep(2 * twin.FRESH_VERDICT_S)  # a yes is believed that long
    assert gets.serve(*request(["a"]), 2, 1 << 30) == (b"", 0, 0)
    assert gets.serve(*request(["other:only.here", "a"]), 2, 1 << 30)[1] == 1


@pytest.mark.parametrize("mod", IMPLS)
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "planned"])
def test_forget_fresh_drops_the_cached_verdicts_at_once(mod, env, direct):
    """A feed whose key became held (Holds.on_hold, kvcache.read.ledger) says so at once: the verdict believed
    for FRESH_VERDICT_S must not answer another GET from the replica."""
    replica, feeds = env
    gets, _ = make(mod, replica, feeds, direct)
    assert gets.serve(*request(["a", "other:only.here"]), 2, 1 << 30)[1] == 2
    asked = feeds["main"].asked
    feeds["main"].fresh = feeds["other"].fresh = False
    gets.forget_fresh()
    assert gets.serve(*request(["a"]), 2, 1 << 30) == (b"", 0, 0)
    assert gets.serve(*request(["other:only.here"]), 2, 1 << 30) == (b"", 0, 0)
    assert feeds["main"].asked == asked + 1


@pytest.mark.parametrize("mod", IMPLS)
def test_budget_cuts_after_the_reply_that_reaches_it(mod, env):
    replica, feeds = env
    gets, _ = make(mod, replica, feeds)
    keys = ["nine", "a", "ten", "a"]
    out, answered, _ = gets.serve(*request(keys), 2, 10_010)  # nine's reply is 10,008 bytes
    assert answered == 2 and out == expected([VALUES["nine"], b"1"])
    out, answered, _ = gets.serve(*request(keys), 2, 1)
    assert answered == 1


@pytest.mark.parametrize("mod", IMPLS)
def test_planner_runs_once_per_key(mod, env):
    replica, feeds = env
    gets, planner = make(mod, replica, feeds, direct=False)
    for _ in range(3):
        gets.serve(*request(["a", "bin", "other:only.here", "other:remote"]), 2, 1 << 30)
    assert planner.calls == 4


@pytest.mark.parametrize("mod", IMPLS)
def test_follows_writes_map_growth_and_new_databases(mod, env):
    replica, feeds = env
    gets, _ = make(mod, replica, feeds)
    assert gets.serve(*request(["later:x"]), 2, 1 << 30) == (b"$-1\r\n", 1, 1)
    load(replica, "later", {"x": b"now here"})           # a database created after the open
    assert gets.serve(*request(["later:x"]), 2, 1 << 30)[0] == expected([b"now here"])
    before = replica.map_size()
    big = {f"g.{i}": bytes([i % 256]) * 65536 for i in range(200)}  # 12.5 MiB: the map must grow
    load(replica, "main", big)
    assert replica.map_size() > before
    keys = [f"g.{i}" for i in range(0, 200, 7)]
    out, answered, _ = gets.serve(*request(keys), 2, 1 << 30)
    assert answered == len(keys) and out == expected([big[k] for k in keys])


@pytest.mark.skipif(native is None, reason="kvcache._native.server_get not built")
def test_native_refuses_other_threads(env):
    replica, feeds = env
    gets, _ = make(native, replica, feeds)
    errors = []

    def other():
        try:
            gets.serve(*request(["a"]), 2, 1 << 30)
        except RuntimeError as e:
            errors.append(e)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert errors and "thread" in str(errors[0])


_keys = st.sampled_from([*list(VALUES), "missing", "main:a", "main:missing", "other:a", "other:only.here",
                         "other:only.x", "later:x", "nope:a", ".bad", "x..y", "a.", "a:b:c", LONG + "x",
                         "main:" + LONG, "other:c.v", "other:c.none", "other:c.ttl", "other:c.miss"])


@pytest.mark.parametrize("mod", IMPLS)
def test_near_cache_hits_are_answered_and_counted_into_the_cache(mod, env):
    """A cached value and a cached not-found are answered like the replica's records, and
    each is counted into the cache: its sketch at once, every LRU_SAMPLE-th key into
    `touched` (moved to the LRU's end by the next drain), the count handed over every
    TOUCH_MAX (the sketch's aging); a key not cached, or expired, stops the run for the
    generic path; a stale feed stops it before the cache is read."""
    replica, feeds = env
    cache = feeds["other"].cache
    gets, _ = make(mod, replica, feeds)
    keys = ["other:c.v", "a", "other:c.none", "other:c.v", "other:c.miss", "a"]
    assert gets.serve(*request(keys), 2, 1 << 30) == (expected([b"cached", b"1", None, b"cached"]), 4, 1)
    assert gets.cached == 3 and cache.touched == [b"c.v", b"c.none", b"c.v"]  # rarely read: every hit
    assert cache.sketch.estimate(b"c.v") == 2 and cache.sketch.estimate(b"c.none") == 1
    assert gets.cache_reads() == {"other": (2, 1)} and counted(gets) == {"main": (1, 0)}
    assert gets.serve(*request(["other:c.ttl", "a"]), 2, 1 << 30) == (b"", 0, 0)  # expired: generic
    feeds["other"].fresh = False
    gets.forget_fresh()  # (a yes is believed for FRESH_VERDICT_S)
    assert gets.serve(*request(["other:c.v"]), 3, 1 << 30) == (b"", 0, 0)
    feeds["other"].fresh = True
    cache.lru.move_to_end(b"c.none")
    cache.drain()
    assert cache.touched == [] and list(cache.lru)[-1] == b"c.v"
    additions = cache.sketch.additions
    n = TOUCH_MAX - 3
    gets.serve(*request(["other:c.v"] * n), 2, 1 << 30)  # read often now: every LRU_SAMPLE-th hit
    handed = additions + TOUCH_MAX  # handed over (and, past the sketch's sample, aged: halved)
    assert cache.sketch.additions == (handed // 2 if handed >= cache.sketch.sample else handed)
    assert cache.touched == [] and list(cache.lru)[-1] == b"c.v"  # drained by the handover
    gets.serve(*request(["other:c.v"] * (2 * LRU_SAMPLE)), 2, 1 << 30)
    assert cache.touched == [b"c.v", b"c.v"]
    assert gets.cache_reads() == {"other": (TOUCH_MAX - 1 + 2 * LRU_SAMPLE, 1)}


@pytest.mark.parametrize("mod", IMPLS)
def test_a_bucket_with_only_a_near_cache_needs_no_planner(mod, env):
    """set_buckets' fifth field: a bucket that replicates no key and has a near cache has
    every valid key planned onto the cache from the key itself, like a bucket that replicates
    every key (with or without its prefix, as the default bucket)."""
    replica, feeds = env
    gets, planner = make(mod, replica, feeds, direct=False)
    gets.set_buckets([("other", feeds["other"], 1000, False, feeds["other"].cache)], "other")
    keys = ["other:c.v", "c.none", "other:c.v", "c.miss"]
    assert gets.serve(*request(keys), 2, 1 << 30) == (expected([b"cached", None, b"cached"]), 3, 1)
    assert planner.calls == 0 and gets.cached == 3
    assert gets.serve(*request(["other:bad..key"]), 2, 1 << 30) == (b"", 0, 0)  # the planner's to judge


@pytest.mark.skipif(native is None, reason="kvcache._native.server_get not built")
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(["other:c.v", "other:c.none", "a", "other:c.miss"]), min_size=1, max_size=40))
def test_twins_count_the_same_into_the_sketch(env, keys):
    """The C twin adds to the sketch's counters itself (_sketch_add): counter for counter what
    FrequencySketch.add_counts does."""
    replica, feeds = env
    out = []
    for mod in (twin, native):
        feeds["other"].cache = cache_of(replica)
        gets, _ = make(mod, replica, feeds)
        gets.serve(*request(keys), 2, 1 << 30)
        c = feeds["other"].cache
        out.append((bytes(c.sketch.counts), list(c.touched), gets.cached))
    assert out[0] == out[1]


@pytest.mark.skipif(native is None, reason="kvcache._native.server_get not built")
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_keys, min_size=1, max_size=20), st.sampled_from([2, 3]), st.integers(1, 40_000),
       st.booleans(), st.booleans())
def test_twins_agree(env, keys, proto, budget, direct, stale_other):
    replica, feeds = env
    feeds["other"].fresh = not stale_other
    try:
        a, _ = make(twin, replica, feeds, direct)
        b, _ = make(native, replica, feeds, direct)
        assert a.serve(*request(keys), proto, budget) == b.serve(*request(keys), proto, budget)
        assert counted(a) == counted(b)
    finally:
        feeds["other"].fresh = True


def counted(gets) -> dict[str, tuple[int, int]]:
    """bucket_reads without the buckets nothing was counted for (the C twin lists every
    bucket it has seen)."""
    return {k: v for k, v in gets.bucket_reads().items() if v != (0, 0)}


@pytest.mark.parametrize("mod", IMPLS)
def test_counts_reads_per_bucket(mod, env):
    """What kvcache_reads_total{source="local"} adds from the fast path: found and absent
    per bucket, the keys the generic path must answer not among them."""
    replica, feeds = env
    gets, _ = make(mod, replica, feeds)
    assert counted(gets) == {}
    keys = ["a", "missing", "main:big", "other:only.here", "other:only.gone", "later:x"]
    gets.serve(*request(keys), 2, 1 << 30)
    gets.serve(*request(["a", "other:not.replicated", "a"]), 2, 1 << 30)  # stops at the remote key
    assert counted(gets) == {"main": (3, 1), "other": (1, 1), "later": (0, 1)}


@pytest.mark.parametrize("mod", IMPLS)
def test_latency_histogram_bounds(mod, env):
    """kvcache.ops.latency's buckets: a time equal to a bound falls in it (Prometheus's `le`),
    past the last in +Inf; both twins agree with kvcache.ops.latency.Latency."""
    from kvcache.ops.latency import BOUNDS_NS, Latency
    replica, feeds = env
    gets, _ = make(mod, replica, feeds)
    ref = Latency()
    for ns, n in ((0, 1), (10_000, 2), (10_001, 3), (999_999, 1), (5_000_000_000, 1), (6_000_000_000, 4)):
        gets.observe(ns, n)
        ref.observe(ns, n)
    counts, total = gets.latency()
    assert (counts, total) == (ref.counts, ref.sum_ns)
    assert len(counts) == len(BOUNDS_NS) + 1
    assert counts[0] == 3 and counts[1] == 3 and counts[-1] == 4 and counts[-2] == 1


def resp_get(key: str) -> bytes:
    k = key.encode()
    return b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k)


READERS = [pytest.param("resp", id="twin-reader")]
native_resp = native_or_none("resp")
if native_resp is not None:
    READERS.append(pytest.param("native", id="native-reader"))


@pytest.mark.parametrize("mod", IMPLS)
@pytest.mark.parametrize("reader_kind", READERS)
def test_answer_feeds_cuts_and_hands_over_the_rest(mod, reader_kind, env):
    from kvcache import resp as twin_resp
    wire_mod = twin_resp if reader_kind == "resp" else native_resp
    replica, feeds = env
    gets, _ = make(mod, replica, feeds)
    reader = wire_mod.RequestReader()
    data = resp_get("a") + resp_get("missing") + b"*1\r\n$4\r\nPING\r\n" + resp_get("bin")
    # split in two at every boundary: what was answered plus what is left is always the same
    for cut in range(1, len(data)):
        reader = wire_mod.RequestReader()
        out1, n1, nf1, _more1 = gets.answer(reader, data[:cut], 2, 1 << 30)
        out2, n2, nf2, more2 = gets.answer(reader, data[cut:], 2, 1 << 30)
        assert out1 + out2 == expected([b"1", None])
        assert (n1 + n2, nf1 + nf2, more2) == (2, 1, True)
        assert reader.next_command() == [b"PING"]
        out3, n3, _, more3 = gets.answer(reader, b"", 2, 1 << 30)
        assert (out3, n3, more3) == (expected([VALUES["bin"]]), 1, False)
    # GET-only input: all answered, nothing more to do
    reader = wire_mod.RequestReader()
    assert gets.answer(reader, resp_get("a") * 3, 3, 1 << 30) == (expected([b"1"] * 3, 3), 3, 0, False)
    # the budget stops it with more to do
    reader = wire_mod.RequestReader()
    _out, n, _, more = gets.answer(reader, resp_get("nine") + resp_get("a"), 2, 100)
    assert (n, more) == (1, True)


_wire_units = st.one_of(
    _keys.map(resp_get),
    st.sampled_from([b"*1\r\n$4\r\nPING\r\n", b"PING\r\n", b"*2\r\n$3\r\nget\r\n$1\r\na\r\n",
                     b"*2\r\n$3\r\nGET\r\n$2\r\na\r\n", b"*2\r\n$3\r\nGET\r\n$01\r\na\r\n",
                     b"*3\r\n$3\r\nGET\r\n$1\r\na\r\n$1\r\nb\r\n"]))


def drive(gets, reader_mod, chunks: list[bytes], budget: int) -> list:
    """What the server does with each read: answer, then hand the rest to the full parser."""
    reader = reader_mod.RequestReader()
    seen: list = []
    for chunk in chunks:
        out, n, nf, more = gets.answer(reader, chunk, 2, budget)
        seen.append((out, n, nf))
        while more:
            try:
                cmd = reader.next_command()
            except Exception as e:
                seen.append(("error", str(e)))
                return seen
            if cmd is None:
                break
            seen.append(("cmd", cmd))
            out, n, nf, more = gets.answer(reader, b"", 2, budget)
            seen.append((out, n, nf))
    return seen


@pytest.mark.skipif(native is None or native_resp is None, reason="native modules not built")
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_wire_units, min_size=1, max_size=12), st.randoms(use_true_random=False),
       st.sampled_from([1 << 30, 10_020, 30]))
def test_answer_twins_agree_on_any_split(env, units, rnd, budget):
    """The native answer reads GETs straight from a read's bytes when the reader is idle; the
    twin always goes through the reader. Same replies, same hand-over, whatever the split."""
    from kvcache import resp as twin_resp
    replica, feeds = env
    wire = b"".join(units)
    cuts = sorted(rnd.sample(range(1, len(wire)), min(3, len(wire) - 1))) if len(wire) > 1 else []
    chunks = [wire[a:b] for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True)]

    def flat(seen):  # replies concatenated, commands in order: how the client sees it
        out, cmds = b"", []
        for s in seen:
            if s[0] in ("cmd", "error"):
                cmds.append((s, len(out)))
            else:
                out += s[0]
        return out, cmds, sum(s[1] for s in seen if s[0] not in ("cmd", "error"))

    a, _ = make(twin, replica, feeds)
    b, _ = make(native, replica, feeds)
    assert flat(drive(a, twin_resp, chunks, budget)) == flat(drive(b, native_resp, chunks, budget))


# ---------------------------------------------------------------- large values from the map

class Transport:
    """What GetConnection asks of its transport: the socket (whose descriptor large values are
    written to), the size of its buffer, and write() for the rest, recorded."""

    def __init__(self, sock, buffered: int = 0) -> None:
        self.sock = sock
        self.buffered = buffered
        self.written: list[bytes] = []

    def get_extra_info(self, name, default=None):
        return self.sock if name == "socket" else default

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def write(self, data: bytes) -> None:
        self.written.append(bytes(data))


def drain(sock) -> bytes:
    out = b""
    while True:
        try:
            chunk = sock.recv(1 << 20)
        except BlockingIOError:
            return out
        if not chunk:
            return out
        out += chunk


def through_socket(mod, env, wire: bytes, sndbuf: int, buffered: int = 0, proto: int = 2):
    """One socket read `wire` through GetConnection, on a real socketpair whose sending side
    has `sndbuf` bytes of buffer: (what the socket carried, what went to transport.write)."""
    import socket

    from kvcache import resp as twin_resp
    from kvcache.stats import Stats
    replica, feeds = env
    gets, _ = make(mod, replica, feeds)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        a.setblocking(False)
        b.setblocking(False)
        reader_mod = native_resp if (mod is native and native_resp is not None) else twin_resp
        class Conn(mod.GetConnection):
            def _process(self):  # the generic path: not here (the rest stays in the reader)
                pass

        conn = Conn(gets, Stats(), reader_mod.RequestReader())
        conn.proto = proto
        t = Transport(a, buffered)
        conn.transport = t
        conn.data_received(wire)
        return drain(b), b"".join(t.written)
    finally:
        a.close()
        b.close()


LARGE_KEYS = ["big", "a", "ten", "missing", "nine", "big", LONG]


@pytest.mark.parametrize("mod", IMPLS)
@pytest.mark.parametrize("sndbuf", [4096, 65536, 1 << 22])
def test_large_values_go_from_the_map_to_the_socket(mod, env, sndbuf):
    """Values of LARGE_VALUE bytes or more are written to the socket (writev) with the replies
    around them; what the socket does not take goes to the transport, in order, once. The
    client sees exactly the replies, whatever the socket's buffer."""
    wire = b"".join(resp_get(k) for k in LARGE_KEYS)
    want = expected([VALUES.get(k) for k in LARGE_KEYS])
    carried, rest = through_socket(mod, env, wire, sndbuf)
    assert carried + rest == want
    assert len(carried) > 0  # the socket took its share at once
    if sndbuf >= 1 << 22:
        assert rest == b""    # room for it all: nothing left for the transport


@pytest.mark.parametrize("mod", IMPLS)
def test_large_values_wait_behind_a_transport_that_holds_output(mod, env):
    """With output already buffered in the transport, nothing is written around it: every
    reply goes through transport.write, in order."""
    wire = b"".join(resp_get(k) for k in LARGE_KEYS)
    carried, rest = through_socket(mod, env, wire, 1 << 22, buffered=100)
    assert carried == b"" and rest == expected([VALUES.get(k) for k in LARGE_KEYS])


@pytest.mark.skipif(native is None or native_resp is None, reason="native modules not built")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_wire_units, min_size=1, max_size=12), st.sampled_from([4096, 20_000, 300_000, 1 << 22]),
       st.sampled_from([2, 3]))
def test_twins_write_the_same_bytes(env, units, sndbuf, proto):
    """Both twins, any run of GETs and other commands, any socket buffer: the same bytes reach
    the client (socket, then transport, then the rest the generic path would answer)."""
    wire = b"".join(units)
    got = [b"".join(through_socket(mod, env, wire, sndbuf, proto=proto)) for mod in (twin, native)]
    assert got[0] == got[1]
