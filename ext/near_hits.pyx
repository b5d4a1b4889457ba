"""A near cache's hit bookkeeping in C: same API and results as kvcache/store/near_hits.py
(its docstring says what is counted, and why by sample).

Why native: the server's GET path (ext/server_get.pyx) answers a cached key in a few hundred
nanoseconds, and counting the hit must not add a Python call. So this class declares a C
entry (ext/kvcache/_native/near_hits.pxd) that the GET path calls per hit, `take_one`: the
sketch's 4 counters added in place, the key queued when sampled, and a Python call only every
TOUCH_MAX hits (the sketch's aging and the LRU moves). Python callers use `take` (a batch),
`read` and `drain`, as with the twin.

The counters are the sketch's own bytearray (FrequencySketch.counts), added to here at the
same slots from the same hash (what hash() gives for the key's bytes), so the twins agree
counter for counter (tests/test_nearcache_hits.py); the sketch ages them in place.
"""
from cpython.bytearray cimport PyByteArray_AS_STRING
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.list cimport PyList_Append
from cpython.ref cimport PyObject

from kvcache.store.near_hits import LRU_EXACT_BELOW, LRU_SAMPLE, TOUCH_MAX
from kvcache.store.sketch import _BLOCK_SEED as _BLOCK_SEED_PY
from kvcache.store.sketch import _SEEDS, BLOCK, MAX_COUNT, ROWS, FrequencySketch

cdef Py_ssize_t _TOUCH_MAX = TOUCH_MAX
cdef Py_ssize_t _LRU_SAMPLE = LRU_SAMPLE
cdef int _LRU_EXACT_BELOW = LRU_EXACT_BELOW
# kvcache.store.sketch's layout, added to in C (_sketch_add)
assert ROWS == 4 and MAX_COUNT == 15 and BLOCK == 64, "sketch layout changed: update _sketch_add()"
cdef unsigned long long _SEED[4]
for _i, _s in enumerate(_SEEDS):
    _SEED[_i] = _s
cdef unsigned long long _BLOCK_SEED = _BLOCK_SEED_PY


cdef extern from "Python.h":
    Py_hash_t _Py_HashBytes(const void* src, Py_ssize_t len)  # hash(bytes) of those bytes


cdef inline int _sketch_add(unsigned char* counts, unsigned long long shift, const unsigned char* key,
                            Py_ssize_t n) noexcept:
    """FrequencySketch.add_counts in C: the same 4 counters of one 64-byte block from the
    key's hash, each saturating at MAX_COUNT; returns the key's estimate after it."""
    cdef unsigned long long h = <unsigned long long>_Py_HashBytes(key, n)
    cdef unsigned long long block = (h * _BLOCK_SEED) >> (64 - shift) if shift else 0
    cdef unsigned char* c
    cdef int row, low = 15
    for row in range(4):
        c = counts + (block << 6) + row * 16 + ((h * _SEED[row]) >> 60)
        if c[0] < 15:
            c[0] += 1
        if c[0] < low:
            low = c[0]
    return low


cdef class HitCounter:
    """See kvcache.store.near_hits.HitCounter: one near cache's sketch and sampled LRU moves."""

    def __init__(self, int capacity, lru):
        self.sketch = FrequencySketch(capacity)
        self._counts = self.sketch.counts
        self._shift = self.sketch.shift
        self._lru = lru
        self.touched = []

    cdef int take_one(self, const unsigned char* key, Py_ssize_t n, PyObject* obj) except -1:
        cdef int estimate = _sketch_add(<unsigned char*>PyByteArray_AS_STRING(self._counts), self._shift,
                                        key, n)
        self._unsampled += 1
        if estimate < _LRU_EXACT_BELOW or self._unsampled >= _LRU_SAMPLE:
            self._unsampled = 0
            if obj != NULL:
                PyList_Append(self.touched, <object>obj)
            else:
                PyList_Append(self.touched, PyBytes_FromStringAndSize(<const char*>key, n))
        self.hits += 1
        self.pending += 1
        if self.pending >= _TOUCH_MAX:
            self._hand_over()
        return 0

    def take(self, keys):
        """See kvcache.store.near_hits.HitCounter.take."""
        cdef bytes key
        for key in keys:
            self.take_one(<const unsigned char*>PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key),
                          <PyObject*>key)

    def read(self, bytes key):
        """See kvcache.store.near_hits.HitCounter.read."""
        self.sketch.increment(key)

    def drain(self):
        """See kvcache.store.near_hits.HitCounter.drain."""
        cdef list touched = self.touched
        if not touched:
            return
        move = self._lru.move_to_end
        for key in touched:
            try:
                move(key)
            except KeyError:  # evicted or invalidated since
                pass
        del touched[:]

    cdef int _hand_over(self) except -1:
        cdef Py_ssize_t n = self.pending
        self.pending = 0
        self.sketch.note(n)
        self.drain()
        return 0
