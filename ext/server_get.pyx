"""The server's per-request GET path in C: same API and replies as kvcache/serve/server_get.py.

Per GET: a plan looked up in a dict (the key's bytes come from take_gets), `mdb_get` on a
read transaction of our own, and the bulk reply copied straight from the memory map into one
output buffer. No Python object is made per GET beyond the key take_gets already made.

The transaction comes from a second LMDB environment on the replica's files, opened
MDB_RDONLY | MDB_NOLOCK with the LMDB compiled into this extension (setup.py takes its source
from the `lmdb` package on the index: the library py-lmdb bundles, so no system package is
needed to build or run it; its symbols are hidden). That is sound only because of how the
sidecar uses it, and `serve` checks the first condition on every call:
- it runs on the thread that owns the writer (the event loop: the feed writes there too), and
  its transaction never outlives one `serve` call, so no write commits while it is open and
  no page it reads can be reused under it; readers in other processes keep registering in
  the lock file through their own environments, which this one never touches;
- it never resets the lock file (NOLOCK), so the writer's environment in the same process is
  undisturbed; and it is never closed before the process exits (closing an fd of a file the
  writer has locked would drop the writer's POSIX locks), so `close()` only stops using it.
A map grown by the writer shows up as MDB_MAP_RESIZED at the next batch and is adopted.
"""
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE, PyBytes_FromStringAndSize
from cpython.dict cimport PyDict_GetItem
from cpython.list cimport PyList_Append, PyList_GET_ITEM, PyList_GET_SIZE
from cpython.object cimport PyObject_Hash
from cpython.mem cimport PyMem_Free, PyMem_Realloc
from cpython.ref cimport PyObject
from cpython.pyport cimport PY_SSIZE_T_MAX
from libc.string cimport memchr, memcmp, memcpy

from resp_get cimport match_get
from lmdb_walk cimport (GROUP, WALK_FALLBACK, WALK_FOUND, WalkKey, WalkMap, walk_all,
                        walk_map_base, walk_start)
from kvcache._native.near_hits cimport HitCounter

import logging
import os

from kvcache.errors import ReplicaError
from kvcache.ops.latency import BOUNDS_NS
from kvcache.read.policy import PLAN_CACHE
from kvcache.serve.server_get import FLUSH_AT, FRESH_VERDICT_S, LARGE_VALUE
from kvcache.store.nearcache import REVISION
from kvcache.store.record import FLAG_TTL, KLEN_MASK, RECORD, TTL_BIT, TTL_BYTE
from kvcache.store.replica import MAX_DBS
from kvcache.resp import GET_LEN

assert RECORD.format == "<QQI" and RECORD.size == 20, "record layout changed: update serve()"
# kvcache.store.record's FLAG_TTL (the record carries its own expiry), as the u32's bit and as the
# bit of its top byte (record.TTL_BYTE / TTL_BIT), and the key length's mask: taken from there
cdef unsigned int _FLAG_TTL = FLAG_TTL
cdef unsigned int _KLEN_MASK = KLEN_MASK
cdef Py_ssize_t _TTL_BYTE = TTL_BYTE
cdef unsigned char _TTL_BIT = TTL_BIT
# kvcache.store.nearcache: a cached not-found is its revision alone. Its hits go to the cache's
# counter (ext/near_hits.pyx, cimported above: its C entry, one call per hit), which alone
# knows the sketch and the sampling
assert REVISION.size == 8, "cached not-found layout changed: update _reply()"

log = logging.getLogger("kvcache.server")

include "server_get_defs.pxi"


cdef list _GET_LEN = GET_LEN
cdef object _PLAN_CACHE = PLAN_CACHE
# The LMDB compiled into this extension, as it names itself ("LMDB 0.9.x: (date)").
LMDB_VERSION = mdb_version(NULL, NULL, NULL).decode()


include "server_get_view.pxi"


cdef class ServerGets(_ReplicaView):
    """See kvcache.serve.server_get.ServerGets: the GET fast path over the replica (and the near
    caches), on the transactions and maps of its _ReplicaView."""
    cdef pthread_t _thread
    cdef object planner
    cdef dict plans
    cdef dict _buckets     # name -> _Bucket
    cdef list _direct      # _Buckets that take keys without asking the planner
    cdef _Bucket _default
    cdef unsigned char* _out
    cdef Py_ssize_t _cap, _len
    cdef bint _closed
    cdef long long _verdict_ns  # how long a witness's yes is believed (FRESH_VERDICT_NS, or 0)
    # one call's state (see _start/_finish)
    cdef long long _now
    cdef unsigned long long _real  # wall clock for expiry, read once a call when needed
    cdef object _fresh
    cdef Py_ssize_t _notfound
    # GETs waiting for their search (see lmdb_walk): the keys, their buckets (borrowed: every
    # _Bucket stays in _buckets), and the plans whose lkey they point into
    cdef WalkKey _keys[GROUP]
    cdef PyObject* _key_bucket[GROUP]
    cdef PyObject* _key_obj[GROUP]  # each GET's lkey (borrowed from its plan; NULL: direct)
    cdef int _nkeys
    cdef bint _stashing   # _take for _stash: a near-cache key is not taken (a miss would stop the group)
    # Near-cache answers not yet counted by a connection (GetConnection._add)
    cdef public Py_ssize_t cached
    cdef list _held
    cdef public unsigned long long walked, fallbacks  # GETs searched by lmdb_walk / by mdb_get
    cdef Py_ssize_t _key_end[GROUP]  # the output's length after each GET's reply
    # Large values written from the map (server_get_write.pxi): the connection's transport and
    # socket while GetConnection's call runs (fd -1: every value is copied into _out), whether
    # its output is empty (-1: not asked yet this call), and the values left out of _out
    cdef object _transport
    cdef int _fd
    cdef int _writable  # the output is empty (1), not (0), not asked yet (-1)
    cdef int _nseg
    cdef bint _stash_flush  # _flush_stash's group: values may stay in the map (_may_leave_in_map)
    cdef Py_ssize_t _last_size  # the last serve's output, written directly or not
    cdef Py_ssize_t _seg_at[MAXSEG]       # where in _out the value goes
    cdef const unsigned char* _seg_ptr[MAXSEG]  # its bytes in the map
    cdef Py_ssize_t _seg_len[MAXSEG]
    cdef Py_ssize_t _seg_bytes
    # Deferred reads (see _stash): GET-only reads of several connections in one event-loop
    # iteration, answered together when it ends
    cdef public bint defer      # the server turns it on while two or more clients are connected
    cdef public object call_soon  # the event loop's call_soon
    cdef list _stashed          # [(connection, data, number of GETs taken so far)]
    cdef int _stash_proto
    cdef bint _scheduled
    cdef const char* _nil
    cdef Py_ssize_t _nil_len
    # The latency histogram (kvcache.ops.latency), kept while `timed` (the metrics listener is on)
    cdef public bint timed
    cdef unsigned long long _lat[_LAT_MAX]
    cdef unsigned long long _lat_sum_ns
    cdef long long _stash_t0

    def __init__(self, replica, planner, writer_here=True):
        self._open(replica, writer_here)
        # A worker process (no writer here) asks its witness every batch: the feed's process
        # changes the verdict at any moment (kvcache.supervisors.board), with no forget_fresh.
        self._verdict_ns = FRESH_VERDICT_NS if writer_here else 0
        self.planner = planner
        self.plans = {}
        self._buckets = {}
        self._direct = []
        self._default = None
        self._held = []
        self._stashed = []
        self._thread = pthread_self()
        self._fd = -1

    def __dealloc__(self):
        # The environment stays open on purpose (see the module docstring): closing its file
        # descriptors would drop the POSIX locks the writer's environment holds.
        PyMem_Free(self._out)

    def close(self):
        self._closed = True

    def forget_fresh(self):
        """See kvcache.serve.server_get.ServerGets.forget_fresh: every bucket asks its witness again."""
        for b in self._buckets.values():
            (<_Bucket>b).fresh_until_ns = 0

    cdef void _observe(self, long long t0, Py_ssize_t n) noexcept:
        """n GETs answered together, since t0 (_now_ns)."""
        self._count_ns(_now_ns() - t0, n)

    cdef void _count_ns(self, long long ns, Py_ssize_t n) noexcept:
        cdef int i = 0
        while i < _LAT_NB and ns > _LAT_BOUNDS[i]:
            i += 1
        self._lat[i] += n
        self._lat_sum_ns += ns * n

    def observe(self, long long ns, Py_ssize_t n):
        """See kvcache.serve.server_get.ServerGets.observe."""
        self._count_ns(ns, n)

    def latency(self):
        """See kvcache.serve.server_get.ServerGets.latency."""
        return [self._lat[i] for i in range(_LAT_NB + 1)], self._lat_sum_ns

    def bucket_reads(self):
        """See kvcache.serve.server_get.ServerGets.bucket_reads."""
        return {name: ((<_Bucket>b).hits, (<_Bucket>b).misses) for name, b in self._buckets.items()
                if not (<_Bucket>b).cache}

    def cache_reads(self):
        """See kvcache.serve.server_get.ServerGets.cache_reads."""
        return {(<_Bucket>b).name: ((<_Bucket>b).hits, (<_Bucket>b).misses)
                for b in self._buckets.values() if (<_Bucket>b).cache}

    def set_buckets(self, buckets, default):
        """See kvcache.serve.server_get.ServerGets.set_buckets: a valid key of a bucket that
        replicates every key, or none with a near cache, is then read without asking the
        planner (no dict lookup, no plan object): the same answer the planner would give,
        reached in C."""
        cdef _Bucket b
        self._direct = []
        self._default = None
        for name, witness, max_stale, all_keys, *rest in buckets:
            near = rest[0] if rest else None
            b = self._bucket(name)
            b.witness = witness
            b.max_stale = max_stale
            b.all_keys = all_keys
            # a BoardWitness (kvcache.supervisors.board) lends its words' address: read in C
            address = getattr(witness, "address", 0)
            b.board = <const volatile long long*><size_t>address if address else NULL
            if near is not None:
                b = _cache_bucket(self, name, near)
                b.witness = witness
                b.max_stale = max_stale
            if all_keys or near is not None:
                self._direct.append(b)
                if name == default:
                    self._default = b
        self.plans.clear()

    cdef _Bucket _bucket(self, str name):
        cdef _Bucket b = self._buckets.get(name)
        if b is None:
            b = _Bucket.__new__(_Bucket)
            b.name = name
            b.prefix = name.encode() + b":"
            b.db_name = self.replica.db_name(name)
            self._buckets[name] = b
        return b

    cdef _Bucket _direct_bucket(self, const unsigned char* k, Py_ssize_t n, Py_ssize_t* off):
        """The bucket that answers raw key k without the planner, and where its KV key starts;
        None when the planner must decide."""
        cdef const unsigned char* colon = <const unsigned char*>memchr(k, 58, n)
        cdef _Bucket b
        cdef Py_ssize_t pn
        if colon == NULL:
            off[0] = 0
            return self._default
        for o in self._direct:
            b = <_Bucket>o
            pn = PyBytes_GET_SIZE(b.prefix)
            if pn <= n and memcmp(k, PyBytes_AS_STRING(b.prefix), pn) == 0:
                off[0] = pn
                return b
        return None

    cdef int _reserve(self, Py_ssize_t extra) except -1:
        cdef Py_ssize_t need = self._len + extra
        cdef unsigned char* grown
        if need <= self._cap:
            return 0
        need = max(need, self._cap * 2, 65536)
        grown = <unsigned char*>PyMem_Realloc(self._out, need)
        if grown == NULL:
            raise MemoryError()
        self._out = grown
        self._cap = need
        return 0

    cdef object _plan(self, bytes key):
        cdef _Plan p
        plan = self.planner(key)  # a kvcache.read.policy.Plan, or False
        if plan:
            p = _Plan.__new__(_Plan)
            p.bucket = (self._bucket(plan.bucket) if plan.cache is None
                        else _cache_bucket(self, plan.bucket, plan.cache))
            p.bucket.witness = plan.witness
            p.bucket.max_stale = plan.max_stale_ms
            p.lkey = plan.lkey
            plan = p
        if len(self.plans) >= _PLAN_CACHE:
            self.plans.clear()
        self.plans[key] = plan
        return plan

    def answer(self, reader, data, int proto, Py_ssize_t budget):
        """See kvcache.serve.server_get.ServerGets.answer. When the reader holds nothing, the GETs at
        the front of `data` are served from `data` itself and only the rest is fed."""
        cdef Py_ssize_t answered = 0, notfound = 0
        cdef bint more = False
        out = self._answer(reader, data, proto, budget, &answered, &notfound, &more)
        return out, answered, notfound, more

    cdef bytes _answer(self, reader, data, int proto, Py_ssize_t budget, Py_ssize_t* answered,
                       Py_ssize_t* notfound, bint* more):
        """answer() for GetConnection, without its tuple: the replies, the rest through the
        pointers."""
        cdef list parts = []
        cdef Py_ssize_t size = 0, n, nf, used, dn
        cdef list lengths, keys
        if type(data) is bytes and reader.idle():
            dn = PyBytes_GET_SIZE(data)
            self._start(proto)
            try:
                used = self._serve_wire(<const unsigned char*>PyBytes_AS_STRING(data), dn, proto,
                                        budget, answered)
                size = self._len + self._seg_bytes
                first = _take_output(self)
            finally:
                self._finish()
            notfound[0] = self._notfound
            if first:
                parts.append(first)
                self._fd = -1  # replies wait in `parts`: no later one may go out before them
            if used == dn:
                return parts[0] if parts else b""
            reader.feed(data if used == 0 else
                        PyBytes_FromStringAndSize(PyBytes_AS_STRING(data) + used, dn - used))
            if size >= budget:
                more[0] = True
                return parts[0] if parts else b""
        else:
            reader.feed(data)
        while True:
            run = reader.take_gets()
            if run is None:
                break
            lengths, keys, start = run
            replies, n, nf = self.serve(lengths, keys, proto, budget - size)
            size += self._last_size
            if replies:
                parts.append(replies)
                self._fd = -1
            answered[0] += n
            notfound[0] += nf
            if n < PyList_GET_SIZE(keys):
                reader.rewind_gets(start, lengths, keys, n)
                more[0] = True
                return parts[0] if len(parts) == 1 else b"".join(parts)
            if size >= budget:
                break
        more[0] = reader.buffered > 0
        return b"" if not parts else (parts[0] if len(parts) == 1 else b"".join(parts))

    def flush(self):
        """Answer the deferred GETs now (see _stash) and write each connection its replies:
        run by the event loop when an iteration's reads are done, and first thing by any
        other step of a connection, so that its replies keep their order."""
        self._scheduled = False
        if self._stashed:
            _flush_stash(self)

    # ---------------------------------------------------------------- one call's state

    cdef int _start(self, int proto) except -1:
        if self._closed:
            raise ReplicaError("the GET path is closed")
        if pthread_self() != self._thread:
            raise RuntimeError("ServerGets must run on the thread that created it")
        self._len = 0
        self._nseg = 0
        self._seg_bytes = 0
        self._writable = -1
        self._notfound = 0
        self._now = 0
        self._real = 0
        self._fresh = None
        self._nil = b"_\r\n" if proto == 3 else b"$-1\r\n"
        self._nil_len = 3 if proto == 3 else 5
        return 0

    cdef void _finish(self) noexcept:
        self._release()
        self._fresh = None
        self._nkeys = 0
        self._held.clear()

    cdef int _take(self, const unsigned char* kp, Py_ssize_t klen, object key) except -1:
        """Take GET `kp` into the group searched next (_answer_group): 1, or 0 when the
        generic path must answer it. `key` is its bytes object, or None (made here if the
        planner needs it)."""
        cdef Py_ssize_t off
        cdef PyObject* found
        cdef _Bucket b
        cdef WalkKey* w = &self._keys[self._nkeys]
        b = self._direct_bucket(kp, klen, &off) if self._direct else None
        if b is not None and _kv_key(kp + off, klen - off):
            w.key = kp + off
            w.klen = klen - off
            self._key_obj[self._nkeys] = NULL
        else:
            if key is None:
                key = PyBytes_FromStringAndSize(<const char*>kp, klen)
            found = PyDict_GetItem(self.plans, key)
            plan = <object>found if found != NULL else self._plan(key)
            if plan is False:
                return 0
            b = (<_Plan>plan).bucket
            self._held.append(plan)  # its lkey, which w points into, outlives the group
            w.key = <const unsigned char*>PyBytes_AS_STRING((<_Plan>plan).lkey)
            w.klen = PyBytes_GET_SIZE((<_Plan>plan).lkey)
            self._key_obj[self._nkeys] = <PyObject*>(<_Plan>plan).lkey
        if b.cache and self._stashing:
            return 0
        if b.witness is not self._fresh:
            if self._now == 0:
                self._now = _now_ns()
            if b.board != NULL:  # a worker's: the board's deadline, one load (BoardWitness's rule)
                if _wall_ns() > b.board[0]:
                    return 0
                b.max_age_ns = <unsigned long long>b.board[1]
            elif b.fresh_until_ns <= self._now:
                if not b.witness.fresh_for_all(b.max_stale):
                    return 0
                b.fresh_until_ns = self._now + self._verdict_ns
                b.max_age_ns = b.witness.max_age_ns
            self._fresh = b.witness
        if not b.has_dbi:
            self._release()  # a handle opened after a transaction began is not valid in it
            self._open_dbi(b)
        self._key_bucket[self._nkeys] = <PyObject*>b
        self._nkeys += 1
        return 1

    cdef int _answer_group(self, Py_ssize_t budget) except -1:
        """Search the taken GETs together (lmdb_walk) and write their replies in order, up to
        the one that takes the output to `budget` or the first the generic path must answer
        after all (a near-cache key not cached, or expired); returns how many were answered
        (the rest are dropped: the caller leaves them for the next call, as if never taken)."""
        cdef int i, n = self._nkeys, done = 0
        cdef _Bucket b
        cdef WalkKey* w
        if n == 0:
            return 0
        if self._txn == NULL:
            self._read()
        for i in range(n):
            b = <_Bucket>self._key_bucket[i]
            w = &self._keys[i]
            if b.root_txn != self._txns:
                self._find_root(b)
            if b.walkable:
                w.root = b.root
                walk_start(&self._map, w)
            else:
                w.state = WALK_FALLBACK
        walk_all(&self._map, self._keys, n)
        for i in range(n):
            if not self._reply(&self._keys[i], <_Bucket>self._key_bucket[i], i):
                break
            self._key_end[i] = self._len
            done += 1
            if self._len + self._seg_bytes >= budget:
                break
        self._nkeys = 0
        self._held.clear()
        return done

    cdef int _reply(self, WalkKey* w, _Bucket b, int i) except -1:
        """The reply to one searched GET (the group's i-th), into the output buffer: 1, or 0
        when the generic path must answer it (a near-cache key not cached, or expired)."""
        cdef Py_ssize_t off, vlen, hlen
        cdef MDB_val k, v
        cdef int rc
        cdef char head[24]
        cdef const unsigned char* rec
        cdef unsigned int rk  # the record's flags + key length
        cdef unsigned long long due
        if w.state == WALK_FALLBACK:
            self.fallbacks += 1
            k.mv_size = w.klen
            k.mv_data = <void*>w.key
            rc = mdb_get(self._txn, b.dbi, &k, &v) if b.has_dbi else MDB_NOTFOUND
        else:
            self.walked += 1
            rc = 0 if w.state == WALK_FOUND else MDB_NOTFOUND
            v.mv_data = <void*>w.data
            v.mv_size = w.dsize
        if rc == 0 and b.cache and v.mv_size == 8:  # a cached not-found
            _count_hit(self, b, w, i)
            return self._nil_reply(b)
        if rc == 0:
            rec = <const unsigned char*>v.mv_data
            if v.mv_size < 20:
                raise ReplicaError("replica record is truncated")
            rk = _u32le(rec + 16)
            off = 20 + (rk & _KLEN_MASK)
            if rk & _FLAG_TTL:
                off += 8
                if v.mv_size < 28:
                    raise ReplicaError("replica record is truncated")
            if rk & _FLAG_TTL or b.max_age_ns:
                due = _deadline(rec, b.max_age_ns)
                if due:
                    if self._real == 0:
                        self._real = _realtime_ns()
                    if self._real >= due:
                        rc = MDB_NOTFOUND  # expired: absent, whatever the sweep has done
        if rc == MDB_NOTFOUND:
            if b.cache:
                return 0  # not cached, or expired: the read policy's path (then NATS)
            return self._nil_reply(b)
        if rc != 0:
            raise ReplicaError(f"replica read failed: {mdb_strerror(rc).decode()}")
        if <size_t>off > v.mv_size:
            raise ReplicaError("replica record is truncated")
        vlen = v.mv_size - off
        hlen = _bulk_header(head, vlen)
        if vlen >= _LARGE_VALUE and _may_leave_in_map(self):
            self._reserve(hlen + 2)  # the value stays in the map: _take_output writes it
            memcpy(self._out + self._len, head, hlen)
            self._len += hlen
            self._seg_at[self._nseg] = self._len
            self._seg_ptr[self._nseg] = rec + off
            self._seg_len[self._nseg] = vlen
            self._nseg += 1
            self._seg_bytes += vlen
            self._out[self._len] = 13
            self._out[self._len + 1] = 10
            self._len += 2
        else:
            self._reserve(hlen + vlen + 2)
            memcpy(self._out + self._len, head, hlen)
            memcpy(self._out + self._len + hlen, rec + off, vlen)
            self._out[self._len + hlen + vlen] = 13
            self._out[self._len + hlen + vlen + 1] = 10
            self._len += hlen + vlen + 2
        b.hits += 1
        if b.cache:
            _count_hit(self, b, w, i)
        return 1

    cdef inline int _nil_reply(self, _Bucket b) except -1:
        """A not-found's reply, into the output buffer."""
        self._notfound += 1
        b.misses += 1
        self._reserve(self._nil_len)
        memcpy(self._out + self._len, self._nil, self._nil_len)
        self._len += self._nil_len
        return 1

    def serve(self, list lengths, list keys, int proto, Py_ssize_t budget):
        """See kvcache.serve.server_get.ServerGets.serve."""
        cdef Py_ssize_t i, n = PyList_GET_SIZE(keys), klen
        cdef Py_ssize_t answered = 0
        cdef int done
        cdef object key, declared
        self._start(proto)
        try:
            for i in range(n):
                key = <object>PyList_GET_ITEM(keys, i)
                declared = <object>PyList_GET_ITEM(lengths, i)
                klen = PyBytes_GET_SIZE(key)
                if declared is not <object>PyList_GET_ITEM(_GET_LEN, klen) and \
                        declared != <object>PyList_GET_ITEM(_GET_LEN, klen):
                    break  # a length the full parser must judge
                if not self._take(<const unsigned char*>PyBytes_AS_STRING(key), klen, key):
                    break
                if self._nkeys == GROUP:
                    done = self._answer_group(budget)
                    answered += done
                    if self._len + self._seg_bytes >= budget or done < GROUP:
                        break
            if self._nkeys:
                answered += self._answer_group(budget)
            self._last_size = self._len + self._seg_bytes
            out = _take_output(self)
        finally:
            self._finish()
        return out, answered, self._notfound

    cdef Py_ssize_t _serve_wire(self, const unsigned char* p, Py_ssize_t n, int proto,
                                Py_ssize_t budget, Py_ssize_t* answered) except -1:
        """Serve the GET units at the front of a socket read straight from its bytes (no
        copy into the request reader, no key objects); returns how many bytes they took.
        Stops where take_gets + serve would stop: at anything else, at a length the full
        parser must judge, at a GET the generic path must answer, or at the budget."""
        cdef Py_ssize_t pos = 0, start = 0, unit_end, d0, nd, declared, k0, kn
        cdef Py_ssize_t ends[GROUP]  # where each taken GET's unit ends
        cdef int done, taken
        while pos < n:
            unit_end = match_get(p, pos, n, &d0, &nd, &declared, &k0, &kn)
            if unit_end < 0 or declared != kn or (nd > 1 and p[d0] == 48):
                break
            if not self._take(p + k0, kn, None):
                break
            ends[self._nkeys - 1] = unit_end
            pos = unit_end
            if self._nkeys == GROUP:
                done = self._answer_group(budget)
                answered[0] += done
                if self._len + self._seg_bytes >= budget or done < GROUP:
                    return ends[done - 1] if done else start
                start = pos
        taken = self._nkeys
        if taken:
            done = self._answer_group(budget)
            answered[0] += done
            return ends[done - 1] if done else start
        return pos


include "server_get_cache.pxi"


include "server_get_write.pxi"


include "server_get_conn.pxi"


include "server_get_search.pxi"
