# The near caches on the GET path (kvcache.store.nearcache): a cache read as a bucket of its
# own, and each answer handed to the cache's hit counter. Included by server_get.pyx.


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
        counter = near.counter
        if isinstance(counter, HitCounter):
            b.counter = counter
        else:  # the twin's (kvcache.native never pairs it with this extension; a test may)
            b.counter_py = counter
        self._buckets[db_name] = b
    return b


cdef inline int _count_hit(ServerGets self, _Bucket b, WalkKey* w, int i) except -1:
    """A near-cache answer: counted for the connection, and handed to the cache's hit counter
    (kvcache.store.near_hits: the sketch, the sampled LRU moves and their handover are its
    own), by a C call with the key's bytes (and its object, when the GET has one)."""
    self.cached += 1
    if b.counter is not None:
        return b.counter.take_one(w.key, w.klen, self._key_obj[i])
    if self._key_obj[i] != NULL:
        b.counter_py.take((<object>self._key_obj[i],))
    else:
        b.counter_py.take((PyBytes_FromStringAndSize(<const char*>w.key, w.klen),))
    return 0
