# The near caches on the GET path (kvcache.store.nearcache): a cache read as a bucket of its
# own, and each answer counted into the cache. Included by server_get.pyx.


cdef _Bucket _cache_bucket(ServerGets self, str name, near):
    """The near cache of bucket `name`, as a bucket of its own (keyed by its database's
    name, which no bucket's can be)."""
    db_name = near.db_name
    cdef _Bucket b = self._buckets.get(db_name)
    if b is None or b.near is not near:
        b = _Bucket.__new__(_Bucket)
        b.name = name
        b.prefix = name.encode() + b":"
        b.db_name = db_name
        b.cache = True
        b.near = near
        b.touched = near.touched
        sketch = near.sketch
        b.counts = sketch.counts
        b.sk_shift = sketch.shift
        self._buckets[db_name] = b
    return b


cdef int _touch(ServerGets self, _Bucket b, WalkKey* w, int i) except -1:
    """A near-cache answer, counted into the cache (see kvcache.serve.server_get.ServerGets._touch):
    its sketch at once; its key into `touched` (made here for a key that came straight
    from the socket) while rarely read, else every LRU_SAMPLE-th hit; the count handed
    over every TOUCH_MAX."""
    cdef int estimate = _sketch_add(b, w.key, w.klen)
    b.sampled += 1
    if estimate < _LRU_EXACT_BELOW or b.sampled >= _LRU_SAMPLE:
        b.sampled = 0
        if self._key_obj[i] != NULL:
            PyList_Append(b.touched, <object>self._key_obj[i])
        else:
            PyList_Append(b.touched, PyBytes_FromStringAndSize(<const char*>w.key, w.klen))
    b.undrained += 1
    self.cached += 1
    if b.undrained >= _TOUCH_MAX:
        n, b.undrained = b.undrained, 0
        b.near.handover(n)
    return 0
