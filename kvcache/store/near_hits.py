"""A near cache's hit bookkeeping, kept by the cache itself (kvcache.store.nearcache): its
frequency sketch and the sampled order of its hits. Pure-Python twin of ext/near_hits.pyx.

Why one owner: the server's GET fast path answers a cached key without the cache (its own
read transaction, kvcache.serve.server_get and its C twin), and the generic read path asks
the cache (NearCache.get). Both must count every read into the same sketch (admission sees
every read), move hits in the same LRU order and age the sketch by the same rule, so that
rule is written here once; the fast path only hands its hits over:

    counter = HitCounter(capacity, lru)   # NearCache makes it, with its LRU order
    counter.take(keys)                    # the fast path's hits, a batch per serve call
    counter.read(key)                     # a generic read, hit or not (NearCache.get, count)
    counter.drain()                       # the sampled keys to the LRU's end (before an offer)

A fast-path hit is counted into the sketch at once, so admission sees every read. Its key
moves in the LRU order by sample, as Caffeine's lossy read buffer makes it: every hit of a
key read less often than LRU_EXACT_BELOW (its estimate), else every LRU_SAMPLE-th, queued in
`touched` and moved when the cache next looks at the order (`drain`). Moving every hit's key
made a cached GET cost 1.6-1.8x a replicated one's CPU, every 8th 1.26x, every 32nd 1.10x
(bench/cached_get_bench.py, -P 16, 10k keys); which key is evicted matters less than which
gets in, which the sketch decides from every hit, and a hot key is sampled often. Every
TOUCH_MAX hits their number is handed to the sketch (FrequencySketch.note: its aging) and
the queue is drained. A generic read is counted and noted at once (FrequencySketch.increment);
NearCache.get moves its own hits exactly.

The native twin (ext/near_hits.pyx) does the same in C and gives the GET path's extension a
C entry (`take_one`, no Python call per hit); the two are held equal on generated key
sequences (tests/test_nearcache_hits.py).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from .sketch import FrequencySketch

# Hits taken before their count is handed to the sketch (aging) and the sampled keys move
TOUCH_MAX = 1024
# Which hits move their key in the LRU order: every LRU_SAMPLE-th...
LRU_SAMPLE = 16
LRU_EXACT_BELOW = 4  # ...but every hit of a key read less often than this (its estimate)


class HitCounter:
    """One near cache's sketch and sampled LRU moves (see the module docstring)."""

    __slots__ = ("_lru", "_unsampled", "hits", "pending", "sketch", "touched")

    def __init__(self, capacity: int, lru: OrderedDict[bytes, int]) -> None:
        self.sketch = FrequencySketch(capacity)
        self._lru = lru                    # the cache's LRU order (lkey -> bytes charged)
        self.touched: list[bytes] = []     # sampled keys not yet moved (drain)
        self.hits = 0                      # hits taken (take), since start
        self.pending = 0                   # hits not yet handed to the sketch's aging
        self._unsampled = 0                # hits since the last sampled one

    def take(self, keys: Iterable[bytes]) -> None:
        """The GET fast path's hits (lkeys, in the order answered): each counted into the
        sketch, sampled into `touched`, handed over every TOUCH_MAX."""
        add = self.sketch.add_counts
        touched = self.touched
        for key in keys:
            estimate = add(key)
            self._unsampled += 1
            if estimate < LRU_EXACT_BELOW or self._unsampled >= LRU_SAMPLE:
                self._unsampled = 0
                touched.append(key)
            self.hits += 1
            self.pending += 1
            if self.pending >= TOUCH_MAX:
                self._hand_over()

    def read(self, key: bytes) -> None:
        """A read on the generic path (hit or not): counted and noted at once."""
        self.sketch.increment(key)

    def drain(self) -> None:
        """Move the sampled keys (`touched`) to the LRU's end; a key gone since is skipped."""
        touched = self.touched
        if not touched:
            return
        move = self._lru.move_to_end
        for key in touched:
            try:
                move(key)
            except KeyError:  # evicted or invalidated since
                pass
        touched.clear()

    def _hand_over(self) -> None:
        """The sketch learns how many hits it counted (FrequencySketch.note: aging), and the
        sampled keys move."""
        n, self.pending = self.pending, 0
        self.sketch.note(n)
        self.drain()
