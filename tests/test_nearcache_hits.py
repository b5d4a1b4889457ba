"""A near cache's hit bookkeeping (kvcache/store/near_hits.py and its C twin ext/near_hits.pyx):
the one owner of the cache's sketch and sampled LRU moves, which both GET paths only hand hits
to. By table on either twin: hits counted, which hits move their key, the handover's aging
and drain; the twins against each other on generated sequences (counter for counter, the same
LRU order); the GET path's two twins over either counter; and the GET path's extension chosen
only with its counter's.
"""
from __future__ import annotations

import time
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import native
from kvcache.resp import GET_LEN
from kvcache.serve import server_get as server_get_twin
from kvcache.store import near_hits as twin
from kvcache.store import nearcache
from kvcache.store.near_hits import LRU_EXACT_BELOW, LRU_SAMPLE, TOUCH_MAX
from kvcache.store.nearcache import NearCache
from kvcache.store.replica import Replica
from kvcache.store.sketch import MAX_COUNT

c_hits = native.native_or_none("near_hits")  # None: not built (an error with KVCACHE_REQUIRE_EXTENSIONS=1)
c_server_get = native.native_or_none("server_get")

NEEDS_C = pytest.mark.skipif(c_hits is None, reason="kvcache._native.near_hits not built")
IMPLS = [pytest.param(twin, id="python"), pytest.param(c_hits, id="native", marks=NEEDS_C)]

K, J = b"k", b"j"  # two keys of the table's LRU order


def run(mod, capacity: int, ops: list[tuple],
        keys: tuple[bytes, ...] = (K, J)) -> tuple[object, OrderedDict[bytes, int]]:
    """A counter over an LRU order holding `keys` in order, after `ops`: ("take", keys),
    ("read", key), ("drain",), ("evict", key: gone from the order, as an eviction or
    invalidation)."""
    lru: OrderedDict[bytes, int] = OrderedDict((k, 1) for k in keys)
    counter = mod.HitCounter(capacity, lru)
    for op, *args in ops:
        if op == "take":
            counter.take(args[0])
        elif op == "read":
            counter.read(args[0])
        elif op == "drain":
            counter.drain()
        else:
            lru.pop(args[0], None)
    return counter, lru


# what the counter holds after the ops: hits taken, pending (not handed over), touched (keys
# sampled, not moved), the LRU order, the sketch's additions and the estimate of K
TABLE = [
    pytest.param(100, [("take", [K] * 3)],
                 dict(hits=3, pending=3, touched=[K] * 3, lru=[K, J], additions=0, estimate=3),
                 id="rarely read: every hit sampled, counted at once, not yet noted"),
    pytest.param(100, [("take", [K] * 3), ("drain",)],
                 dict(hits=3, pending=3, touched=[], lru=[J, K], additions=0, estimate=3),
                 id="drain moves the sampled key to the LRU's end"),
    pytest.param(100, [("take", [K] * (LRU_EXACT_BELOW - 1)), ("drain",), ("take", [K] * (2 * LRU_SAMPLE))],
                 dict(hits=LRU_EXACT_BELOW - 1 + 2 * LRU_SAMPLE, pending=LRU_EXACT_BELOW - 1 + 2 * LRU_SAMPLE,
                      touched=[K, K], lru=[J, K], additions=0, estimate=MAX_COUNT),
                 id="read often: every LRU_SAMPLE-th hit sampled"),
    pytest.param(100, [("take", [J] * LRU_SAMPLE), ("take", [K, J]), ("take", [K])],
                 dict(hits=LRU_SAMPLE + 3, pending=LRU_SAMPLE + 3, touched=[J, J, J, K, K], lru=[K, J],
                      additions=0, estimate=2),
                 id="the sample counts hits across keys and batches; a rare key still every hit"),
    pytest.param(1000, [("take", [J] * (TOUCH_MAX - 1) + [K])],
                 dict(hits=TOUCH_MAX, pending=0, touched=[], lru=[J, K], additions=TOUCH_MAX, estimate=1),
                 id="every TOUCH_MAX hits: handed over (noted) and drained"),
    pytest.param(100, [("take", [K] * TOUCH_MAX)],
                 dict(hits=TOUCH_MAX, pending=0, touched=[], lru=[J, K], additions=TOUCH_MAX // 2,
                      estimate=MAX_COUNT // 2),
                 id="a handover past the sketch's sample ages it: every counter halved"),
    pytest.param(100, [("take", [K, J]), ("evict", K), ("drain",)],
                 dict(hits=2, pending=2, touched=[], lru=[J], additions=0, estimate=0),
                 id="a sampled key gone since is skipped"),
    pytest.param(100, [("read", K), ("read", K)],
                 dict(hits=0, pending=0, touched=[], lru=[K, J], additions=2, estimate=2),
                 id="a generic read: counted and noted at once, never sampled"),
]


@pytest.mark.parametrize("mod", IMPLS)
@pytest.mark.parametrize(("capacity", "ops", "want"), TABLE)
def test_hits_by_table(mod, capacity, ops, want):
    counter, lru = run(mod, capacity, ops)
    sketch = counter.sketch
    got = dict(hits=counter.hits, pending=counter.pending, touched=list(counter.touched), lru=list(lru),
               additions=sketch.additions, estimate=sketch.estimate(K) if K in lru else 0)
    assert got == want


@pytest.mark.parametrize("mod", IMPLS)
def test_the_counters_are_the_sketchs_own_for_life(mod):
    """The counter adds to the sketch's one bytearray, which aging halves in place: what a
    caller (and the C entry) holds stays the sketch's."""
    counter = mod.HitCounter(10, OrderedDict())
    counts = counter.sketch.counts
    counter.take([K] * (2 * TOUCH_MAX))  # two handovers, past the sample (100): aged twice
    assert counter.sketch.counts is counts and counter.sketch.estimate(K) == counter.sketch.estimate(K) > 0
    assert counter.take([]) is None and counter.hits == 2 * TOUCH_MAX


# --------------------------------------------------------------------------- the twins agree

_universe = [b"hot.%d" % i for i in range(4)] + [b"k.%d" % i for i in range(60)]
_op = st.one_of(
    st.tuples(st.just("take"), st.lists(st.tuples(st.sampled_from(_universe), st.integers(1, 300)),
                                         min_size=0, max_size=8)),
    st.tuples(st.just("read"), st.sampled_from(_universe)),
    st.tuples(st.just("drain")),
    st.tuples(st.just("evict"), st.sampled_from(_universe)),
)


def _expand(ops: list[tuple]) -> list[tuple]:
    """The generated ops as run() takes them: a take's (key, times) runs spelled out."""
    return [("take", [k for k, n in op[1] for _ in range(n)]) if op[0] == "take" else op for op in ops]


def _state(counter, lru) -> tuple:
    s = counter.sketch
    return (bytes(s.counts), s.additions, list(counter.touched), list(lru), counter.hits, counter.pending)


@NEEDS_C
@settings(max_examples=150, deadline=None)
@given(st.integers(1, 64), st.lists(_op, min_size=1, max_size=30))
def test_twins_agree_on_generated_sequences(capacity, ops):
    """The same hits and reads leave the same counters, additions, sampled keys and LRU order
    (lru: every key of the universe, so that drains move them), handovers and aging included."""
    ops = _expand(ops)
    out = []
    for mod in (twin, c_hits):
        out.append(_state(*run(mod, capacity, ops, tuple(_universe))))
    assert out[0] == out[1]


# --------------------------------------------------------------------------- the GET path hands over


class Witness:
    """What the GET path asks of a bucket's feed: may the cache answer now, and max_age."""

    max_age_ns = 0

    def fresh_for_all(self, max_stale_ms: int) -> bool:
        return True


@pytest.fixture
def replica(tmp_path):
    r = Replica(str(tmp_path / "replica"), map_size=4 << 20)
    yield r
    r.close()


GETS = [pytest.param(server_get_twin, id="gets-python"),
        pytest.param(c_server_get, id="gets-native",
                     marks=pytest.mark.skipif(c_server_get is None, reason="kvcache._native.server_get not built"))]


@pytest.mark.parametrize("gets_mod", GETS)
def test_the_get_path_hands_every_hit_to_either_counter(gets_mod, replica, monkeypatch):
    """Both GET paths over a cache whose counter is either twin (the C GET path calls the
    native one's C entry, and the twin's through Python): the same counters, sampled keys,
    handovers and LRU order as the counter given the same hits directly."""
    now = time.time_ns()
    keys = [b"c.%d" % i for i in range(8)]
    wire = [b"other:" + k for k in keys]
    run_keys = [wire[0]] * 700 + [wire[i % 8] for i in range(700)] + [wire[3]] * 50 + [wire[7], b"other:c.miss"]
    answered = [k.removeprefix(b"other:") for k in run_keys[:-1]]  # a miss stops the run
    out = []
    for counter_mod in (twin, c_hits):
        if counter_mod is None:
            continue
        monkeypatch.setattr(nearcache, "_NEAR_HITS", counter_mod)
        cache = NearCache(replica, f"b{len(out)}", max_keys=100)
        for i, k in enumerate(keys):
            if i % 2:
                cache.offer_absent(k, i + 1)
            else:
                cache.offer_entry(k.decode(), k, b"v%d" % i, i + 1, now, 0)
        alone_lru = OrderedDict(cache.lru)
        alone = counter_mod.HitCounter(100, alone_lru)
        alone.take(answered)
        gets = gets_mod.ServerGets(replica, lambda raw: False)
        gets.set_buckets([("other", Witness(), 1000, False, cache)], "other")
        for start in range(0, len(run_keys), 100):  # as socket reads would cut them
            part = run_keys[start:start + 100]
            gets.serve([GET_LEN[len(k)] for k in part], part, 2, 1 << 30)
        assert gets.cached == len(answered)
        assert _state(cache.counter, cache.lru) == _state(alone, alone_lru)
        out.append(_state(cache.counter, cache.lru))
    assert all(o == out[0] for o in out)


# --------------------------------------------------------------------------- chosen together


@pytest.mark.skipif(c_server_get is None or c_hits is None, reason="the native modules are not built")
def test_the_native_get_path_is_chosen_only_with_its_hit_counter(monkeypatch):
    """server_get's extension calls the counter's C entry: with the counter's extension
    missing, the GET path's twin serves, and says why."""
    monkeypatch.setattr(native, "NO_EXTENSIONS", False)
    monkeypatch.setattr(native, "REQUIRE_EXTENSIONS", False)
    monkeypatch.setattr(native, "CHOSEN", {})
    real = native._load
    monkeypatch.setattr(native, "_load", lambda name: (None, "not built") if name == "near_hits" else real(name))
    assert native.load("server_get") is server_get_twin
    assert native.CHOSEN == {"near_hits": "twin (not built)",
                             "server_get": "twin (its part near_hits is twin (not built))"}
    monkeypatch.setattr(native, "_load", real)
    assert native.load("server_get") is c_server_get and native.load("near_hits") is c_hits
