# A near cache's hit counter in C (kvcache.store.near_hits.HitCounter; ext/near_hits.pyx
# implements it), declared for the GET path's extension (ext/server_get.pyx), which hands
# each near-cache hit to `take_one`: a C call, no Python call per hit.
#
# Why this file sits under ext/kvcache/_native/: a cimported class is looked up at run time
# in the module its .pxd names, and that name is its path under an include directory
# (setup.py's is ext/). Here it is kvcache._native.near_hits, the module setup.py builds
# ext/near_hits.pyx into; as ext/near_hits.pxd the GET path would import a `near_hits`
# that does not exist.
from cpython.ref cimport PyObject


cdef class HitCounter:
    cdef readonly object sketch            # kvcache.store.sketch.FrequencySketch
    cdef readonly list touched             # sampled keys not yet moved in the LRU order
    cdef readonly unsigned long long hits  # hits taken, since start
    cdef readonly Py_ssize_t pending       # hits not yet handed to the sketch's aging
    cdef Py_ssize_t _unsampled             # hits since the last sampled one
    cdef object _lru                       # the cache's LRU order (an OrderedDict)
    cdef bytearray _counts                 # sketch.counts: aged in place, never replaced
    cdef unsigned long long _shift         # sketch.shift: log2 of its 64-counter blocks

    # One hit of lkey `key` (n bytes); `obj` is its bytes object when the caller has one
    # (borrowed; NULL: made here if the key is sampled)
    cdef int take_one(self, const unsigned char* key, Py_ssize_t n, PyObject* obj) except -1
    cdef int _hand_over(self) except -1
