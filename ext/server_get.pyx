"""The server's per-request GET path in C: same API and replies as kvcache/serve/get.py.

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
from cpython.bytearray cimport PyByteArray_AS_STRING
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

import logging
import os

from kvcache.errors import ReplicaError
from kvcache.ops.latency import BOUNDS_NS
from kvcache.read.policy import PLAN_CACHE
from kvcache.serve.get import FLUSH_AT, FRESH_VERDICT_S
from kvcache.store.nearcache import REVISION, TOUCH_MAX
from kvcache.store.record import FLAG_TTL, KLEN_MASK, RECORD, TTL_BIT, TTL_BYTE
from kvcache.store.replica import MAX_DBS
from kvcache.store.sketch import MAX_COUNT, ROWS, _SEEDS
from kvcache.resp import GET_LEN

assert RECORD.format == "<QQI" and RECORD.size == 20, "record layout changed: update serve()"
# kvcache.store.record's FLAG_TTL (the record carries its own expiry), as the u32's bit and as the
# bit of its top byte (record.TTL_BYTE / TTL_BIT), and the key length's mask: taken from there
cdef unsigned int _FLAG_TTL = FLAG_TTL
cdef unsigned int _KLEN_MASK = KLEN_MASK
cdef Py_ssize_t _TTL_BYTE = TTL_BYTE
cdef unsigned char _TTL_BIT = TTL_BIT
# kvcache.store.nearcache: a cached not-found is its revision alone; hits handed over in batches
assert REVISION.size == 8, "cached not-found layout changed: update _reply()"
cdef Py_ssize_t _TOUCH_MAX = TOUCH_MAX
# kvcache.store.sketch's counters, added to in C (_sketch_add)
assert ROWS == 4 and MAX_COUNT == 15, "sketch layout changed: update _sketch_add()"
cdef unsigned long long _SEED[4]
for _i, _s in enumerate(_SEEDS):
    _SEED[_i] = _s

log = logging.getLogger("kvcache.server")

cdef extern from "lmdb.h" nogil:
    ctypedef struct MDB_env:
        pass
    ctypedef struct MDB_txn:
        pass
    ctypedef unsigned int MDB_dbi
    ctypedef struct MDB_val:
        size_t mv_size
        void* mv_data
    enum:
        MDB_RDONLY
        MDB_NOLOCK
        MDB_NORDAHEAD
        MDB_NOTLS
        MDB_NOTFOUND
        MDB_MAP_RESIZED
    int mdb_env_create(MDB_env** env)
    int mdb_env_set_maxdbs(MDB_env* env, MDB_dbi dbs)
    int mdb_env_set_mapsize(MDB_env* env, size_t size)
    int mdb_env_open(MDB_env* env, const char* path, unsigned int flags, unsigned int mode)
    void mdb_env_close(MDB_env* env)
    int mdb_txn_begin(MDB_env* env, MDB_txn* parent, unsigned int flags, MDB_txn** txn)
    int mdb_txn_commit(MDB_txn* txn)
    void mdb_txn_abort(MDB_txn* txn)
    void mdb_txn_reset(MDB_txn* txn)
    int mdb_txn_renew(MDB_txn* txn)
    size_t mdb_txn_id(MDB_txn* txn)
    int mdb_dbi_open(MDB_txn* txn, const char* name, unsigned int flags, MDB_dbi* dbi)
    int mdb_get(MDB_txn* txn, MDB_dbi dbi, MDB_val* key, MDB_val* data)
    ctypedef struct MDB_envinfo:
        void* me_mapaddr
        size_t me_mapsize
        size_t me_last_pgno
    ctypedef struct MDB_stat:
        unsigned int ms_psize
    int mdb_env_info(MDB_env* env, MDB_envinfo* info)
    int mdb_env_stat(MDB_env* env, MDB_stat* stat)
    char* mdb_strerror(int err)
    char* mdb_version(int* major, int* minor, int* patch)

cdef extern from "<pthread.h>" nogil:
    ctypedef unsigned long pthread_t
    pthread_t pthread_self()

cdef list _GET_LEN = GET_LEN
cdef object _PLAN_CACHE = PLAN_CACHE
# The LMDB compiled into this extension, as it names itself ("LMDB 0.9.x: (date)").
LMDB_VERSION = mdb_version(NULL, NULL, NULL).decode()


cdef class _Bucket:
    cdef object feed
    cdef object max_stale
    cdef long long fresh_until_ns  # feed.fresh_for_all said yes: believed until then
    cdef unsigned long long max_age_ns  # the stream's max_age (0: none), read with the verdict
    cdef str name
    cdef bytes prefix      # b"<name>:"
    cdef MDB_dbi dbi
    cdef bint has_dbi
    cdef bint all_keys     # replicates every key: a valid key needs no filter check
    cdef bytes db_name     # its database's name in the replica
    # its B+tree's root in the current transaction (lmdb_walk), looked up once per transaction
    cdef size_t root
    cdef unsigned long long root_txn
    cdef bint walkable     # a plain database lmdb_walk can search (else mdb_get)
    # GETs this path answered for the bucket, found and not: read at scrape time by
    # kvcache.ops.metrics (bucket_reads), so counting costs a C increment per key
    cdef unsigned long long hits, misses
    # A bucket's near cache (kvcache.store.nearcache), read as a bucket of its own: a cached
    # not-found answers nil, a key not cached (or expired) goes to the generic path, and each
    # answer is counted into the cache (its sketch's counters here, its key into `touched`)
    cdef bint cache
    cdef object near        # the NearCache
    cdef list touched       # near.touched
    cdef object counts      # near.sketch.counts (a bytearray, aged in place)
    cdef unsigned long long sk_width, sk_mask, sk_shift


cdef inline void _sketch_add(_Bucket b, object key) except *:
    """kvcache.store.sketch.FrequencySketch.add_counts in C: the same 4 slots from the key's
    hash (cached in the bytes object), each counter saturating at MAX_COUNT."""
    cdef unsigned long long h = <unsigned long long>PyObject_Hash(key)
    cdef unsigned char* counts = <unsigned char*>PyByteArray_AS_STRING(b.counts)
    cdef unsigned long long i
    cdef int row
    for row in range(4):
        i = row * b.sk_width + (((h * _SEED[row]) >> (64 - b.sk_shift)) & b.sk_mask)
        if counts[i] < 15:
            counts[i] += 1


cdef class _Plan:
    cdef _Bucket bucket
    cdef bytes lkey


cdef inline bint _kv_key(const unsigned char* k, Py_ssize_t n) noexcept nogil:
    """kvcache.keys.readable_key in C (tests/test_keys.py holds them equal): dot-separated
    tokens of [-/_=a-zA-Z0-9], not starting with the reserved `_kv`; at most 511 bytes (a
    longer key is stored under a digest: the planner handles it)."""
    cdef Py_ssize_t i
    cdef unsigned char c
    if n == 0 or n > 511 or k[0] == 46 or k[n - 1] == 46:
        return False
    if n >= 3 and k[0] == 95 and k[1] == 107 and k[2] == 118:  # `_kv`: reserved (ADR-8)
        return False
    for i in range(n):
        c = k[i]
        if c == 46:
            if k[i - 1] == 46:
                return False
        elif not (48 <= c <= 57 or 65 <= c <= 90 or 97 <= c <= 122 or c == 45 or c == 47
                  or c == 95 or c == 61):
            return False
    return True


from libc.time cimport timespec

cdef extern from "<time.h>" nogil:
    int clock_gettime(int clk_id, timespec* tp)
    enum: CLOCK_MONOTONIC
    enum: CLOCK_MONOTONIC_COARSE
    enum: CLOCK_REALTIME

cdef long long FRESH_VERDICT_NS = FRESH_VERDICT_S * 1_000_000_000

# kvcache.ops.latency.BOUNDS_NS, for the fast path's latency histogram (LocalGets.timed)
cdef enum:
    _LAT_MAX = 32
cdef long long _LAT_BOUNDS[_LAT_MAX]
cdef int _LAT_NB = len(BOUNDS_NS)
assert _LAT_NB < _LAT_MAX
for _i, _b in enumerate(BOUNDS_NS):
    _LAT_BOUNDS[_i] = _b


cdef inline long long _now_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec * 1_000_000_000LL + ts.tv_nsec


cdef inline long long _coarse_ns() noexcept nogil:
    """CLOCK_MONOTONIC at tick resolution (a few ms): about 5 ns a call against 25 for
    _now_ns, cheap enough for every socket read (CLIENT LIST's idle, in whole seconds)."""
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts)
    return ts.tv_sec * 1_000_000_000LL + ts.tv_nsec


cdef inline unsigned int _u32le(const unsigned char* p) noexcept nogil:
    return p[0] | (p[1] << 8) | (p[2] << 16) | (<unsigned int>p[3] << 24)


cdef inline unsigned long long _u64le(const unsigned char* p) noexcept nogil:
    return _u32le(p) | (<unsigned long long>_u32le(p + 4) << 32)


cdef inline unsigned long long _realtime_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_REALTIME, &ts)
    return ts.tv_sec * 1_000_000_000ULL + ts.tv_nsec


cdef inline unsigned long long _deadline(const unsigned char* rec, unsigned long long max_age) noexcept nogil:
    """kvcache.store.record.deadline in C (rec has at least 28 bytes when FLAG_TTL is set): 0 never."""
    cdef unsigned long long created = _u64le(rec + 8), expires
    if rec[_TTL_BYTE] & _TTL_BIT:
        expires = _u64le(rec + 20)
        if expires == 0xFFFFFFFFFFFFFFFFULL:
            return 0
        if max_age and created + max_age < expires:
            return created + max_age
        return expires
    return created + max_age if max_age else 0


cdef class LocalGets:
    cdef MDB_env* _env
    cdef pthread_t _thread
    cdef object replica
    cdef object planner
    cdef dict plans
    cdef dict _buckets     # name -> _Bucket
    cdef list _direct      # _Buckets that take keys without asking the planner
    cdef _Bucket _default
    cdef unsigned char* _out
    cdef Py_ssize_t _cap, _len
    cdef bint _closed
    # one call's state (see _start/_finish)
    cdef MDB_txn* _txn     # a call's read transaction: _reader, renewed, or NULL
    cdef MDB_txn* _reader  # kept between calls, reset (no snapshot held) and renewed by each
    cdef size_t _map_txnid # the snapshot _map was read for (0: read it again)
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
    cdef WalkMap _map
    cdef unsigned long long _txns   # transactions begun: a bucket's root is good for one
    cdef MDB_dbi _main
    cdef public unsigned long long walked, fallbacks  # GETs searched by lmdb_walk / by mdb_get
    cdef Py_ssize_t _key_end[GROUP]  # the output's length after each GET's reply
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

    def __cinit__(self):
        self._env = NULL
        self._txn = NULL
        self._reader = NULL

    def __init__(self, replica, planner):
        self.replica = replica
        self.planner = planner
        self.plans = {}
        self._buckets = {}
        self._direct = []
        self._default = None
        self._held = []
        self._stashed = []
        self._thread = pthread_self()
        path = os.fsencode(replica.path)
        cdef int rc = mdb_env_create(&self._env)
        if rc == 0:
            rc = mdb_env_set_maxdbs(self._env, max(MAX_DBS, getattr(replica, "max_dbs", MAX_DBS)))
        if rc == 0:
            rc = mdb_env_open(self._env, path, MDB_RDONLY | MDB_NOLOCK | MDB_NORDAHEAD, 0o600)
        if rc != 0:
            raise ReplicaError(f"cannot open the replica for the GET path: {mdb_strerror(rc).decode()}")
        cdef MDB_txn* t = NULL
        self._begin(&t)
        rc = mdb_dbi_open(t, NULL, 0, &self._main)  # the main database: names -> MDB_db records
        mdb_txn_abort(t)
        if rc != 0:
            raise ReplicaError(f"cannot open the replica for the GET path: {mdb_strerror(rc).decode()}")

    def __dealloc__(self):
        # The environment stays open on purpose (see the module docstring): closing its file
        # descriptors would drop the POSIX locks the writer's environment holds.
        PyMem_Free(self._out)

    def close(self):
        self._closed = True

    def forget_fresh(self):
        """See kvcache.serve.get.LocalGets.forget_fresh: every bucket asks its feed again."""
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
        """See kvcache.serve.get.LocalGets.observe."""
        self._count_ns(ns, n)

    def latency(self):
        """See kvcache.serve.get.LocalGets.latency."""
        return [self._lat[i] for i in range(_LAT_NB + 1)], self._lat_sum_ns

    def bucket_reads(self):
        """See kvcache.serve.get.LocalGets.bucket_reads."""
        return {name: ((<_Bucket>b).hits, (<_Bucket>b).misses) for name, b in self._buckets.items()
                if not (<_Bucket>b).cache}

    def cache_reads(self):
        """See kvcache.serve.get.LocalGets.cache_reads."""
        return {(<_Bucket>b).name: ((<_Bucket>b).hits, (<_Bucket>b).misses)
                for b in self._buckets.values() if (<_Bucket>b).cache}

    def set_buckets(self, buckets, default):
        """`[(name, feed, max_stale_ms, replicates_every_key)]` and the default bucket's name
        (None: no default). A valid key of a bucket that replicates every key is then read
        without asking the planner (no dict lookup, no plan object): the same answer the
        planner would give, reached in C. Call it only when the planner would plan such keys
        (not with the access log on, where every GET must reach the command layer)."""
        cdef _Bucket b
        self._direct = []
        self._default = None
        for name, feed, max_stale, all_keys in buckets:
            b = self._bucket(name)
            b.feed = feed
            b.max_stale = max_stale
            b.all_keys = all_keys
            if all_keys:
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

    cdef _Bucket _cache_bucket(self, str name, near):
        """The near cache of bucket `name`, as a bucket of its own (keyed by its database's
        name, which no bucket's can be)."""
        db_name = near.db_name
        cdef _Bucket b = self._buckets.get(db_name)
        if b is None or b.near is not near:
            b = _Bucket.__new__(_Bucket)
            b.name = name
            b.prefix = b""
            b.db_name = db_name
            b.cache = True
            b.near = near
            b.touched = near.touched
            sketch = near.sketch
            b.counts = sketch.counts
            b.sk_width = sketch.width
            b.sk_mask = sketch.width - 1
            b.sk_shift = sketch.shift
            self._buckets[db_name] = b
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

    cdef int _begin(self, MDB_txn** txn) except -1:
        cdef int rc = mdb_txn_begin(self._env, NULL, MDB_RDONLY, txn)
        if rc == MDB_MAP_RESIZED:  # the writer grew the map: adopt its size
            if self._reader != NULL:
                mdb_txn_abort(self._reader)
                self._reader = NULL
            rc = mdb_env_set_mapsize(self._env, 0)
            self._map_txnid = 0
            if rc == 0:
                rc = mdb_txn_begin(self._env, NULL, MDB_RDONLY, txn)
        if rc != 0:
            txn[0] = NULL
            raise ReplicaError(f"replica read failed: {mdb_strerror(rc).decode()}")
        return 0

    cdef int _read(self) except -1:
        """Open the call's read transaction: _reader renewed (no allocation, as LMDB advises
        for frequent reads), begun anew when there is none or the map was resized. The map's
        geometry and the buckets' roots are read again only when the snapshot has moved."""
        cdef int rc
        cdef MDB_envinfo info
        cdef MDB_stat st
        cdef size_t txnid
        if self._reader != NULL:
            rc = mdb_txn_renew(self._reader)
            if rc != 0:
                mdb_txn_abort(self._reader)
                self._reader = NULL
                if rc != MDB_MAP_RESIZED:
                    raise ReplicaError(f"replica read failed: {mdb_strerror(rc).decode()}")
        if self._reader == NULL:
            self._begin(&self._reader)
        self._txn = self._reader
        txnid = mdb_txn_id(self._txn)
        if txnid != self._map_txnid:
            mdb_env_info(self._env, &info)  # the map and the last page of this snapshot
            mdb_env_stat(self._env, &st)    # (nothing commits while it is open: see above)
            self._map.base = NULL  # found with the first root (walk_map_base)
            self._map.size = info.me_mapsize
            self._map.last_pgno = info.me_last_pgno
            self._map.psize = st.ms_psize
            self._map_txnid = txnid
            self._txns += 1  # every bucket's root is looked up again
        return 0

    cdef void _release(self) noexcept:
        if self._txn != NULL:
            mdb_txn_reset(self._txn)
            self._txn = NULL

    cdef int _find_root(self, _Bucket b) except -1:
        """The bucket's B+tree root in this transaction, from its MDB_db record in the main
        database (48 bytes: md_flags at 4, md_root at 40); a database lmdb_walk does not
        read (flags set, an unexpected record) is left to mdb_get."""
        cdef MDB_val k, v
        cdef int rc
        cdef const unsigned char* rec
        b.root_txn = self._txns
        b.walkable = False
        if not b.has_dbi:  # not created yet: every key is a miss (the fallback says so)
            return 0
        k.mv_size = PyBytes_GET_SIZE(b.db_name)
        k.mv_data = PyBytes_AS_STRING(b.db_name)
        rc = mdb_get(self._txn, self._main, &k, &v)
        if rc == 0 and v.mv_size == 48:
            rec = <const unsigned char*>v.mv_data
            if self._map.base == NULL:
                self._map.base = walk_map_base(rec, self._map.psize)
            if rec[4] == 0 and rec[5] == 0 and self._map.base != NULL:
                b.root = <size_t>_u64le(rec + 40)
                b.walkable = True
        return 0

    cdef object _plan(self, bytes key):
        cdef _Plan p
        plan = self.planner(key)  # a kvcache.read.policy.Plan, or False
        if plan:
            p = _Plan.__new__(_Plan)
            p.bucket = (self._bucket(plan.bucket) if plan.cache is None
                        else self._cache_bucket(plan.bucket, plan.cache))
            p.bucket.feed = plan.feed
            p.bucket.max_stale = plan.max_stale_ms
            p.lkey = plan.lkey
            plan = p
        if len(self.plans) >= _PLAN_CACHE:
            self.plans.clear()
        self.plans[key] = plan
        return plan

    cdef int _open_dbi(self, _Bucket b) except -1:
        """Named databases are opened once, in a transaction of their own that is then
        committed: a handle opened in a read transaction lives on only if it commits."""
        cdef MDB_txn* t = NULL
        cdef MDB_dbi dbi
        cdef int rc
        self._begin(&t)
        rc = mdb_dbi_open(t, PyBytes_AS_STRING(b.db_name), 0, &dbi)
        if rc == 0:
            rc = mdb_txn_commit(t)
        else:
            mdb_txn_abort(t)
        if rc == MDB_NOTFOUND:
            return 0  # not created yet by the writer: every key is a miss for now
        if rc != 0:
            raise ReplicaError(f"replica read failed: {mdb_strerror(rc).decode()}")
        b.dbi = dbi
        b.has_dbi = True
        return 0

    def answer(self, reader, data, int proto, Py_ssize_t budget):
        """See kvcache.serve.get.LocalGets.answer. When the reader holds nothing, the GETs at
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
            finally:
                self._finish()
            notfound[0] = self._notfound
            if self._len:
                parts.append(PyBytes_FromStringAndSize(<char*>self._out, self._len))
                size = self._len
            if used == dn:
                return parts[0] if parts else b""
            reader.feed(data if used == 0 else
                        PyBytes_FromStringAndSize(PyBytes_AS_STRING(data) + used, dn - used))
            if size >= budget:
                more[0] = True
                return parts[0]
        else:
            reader.feed(data)
        while True:
            run = reader.take_gets()
            if run is None:
                break
            lengths, keys, start = run
            replies, n, nf = self.serve(lengths, keys, proto, budget - size)
            parts.append(replies)
            size += PyBytes_GET_SIZE(replies)
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
            raise RuntimeError("LocalGets must run on the thread that created it")
        self._len = 0
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
            if b.cache and self._stashing:
                return 0
            self._held.append(plan)  # its lkey, which w points into, outlives the group
            w.key = <const unsigned char*>PyBytes_AS_STRING((<_Plan>plan).lkey)
            w.klen = PyBytes_GET_SIZE((<_Plan>plan).lkey)
            self._key_obj[self._nkeys] = <PyObject*>(<_Plan>plan).lkey
        if b.feed is not self._fresh:
            if self._now == 0:
                self._now = _now_ns()
            if b.fresh_until_ns <= self._now:
                if not b.feed.fresh_for_all(b.max_stale):
                    return 0
                b.fresh_until_ns = self._now + FRESH_VERDICT_NS
                b.max_age_ns = b.feed.max_age_ns
            self._fresh = b.feed
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
            if self._len >= budget:
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
            self._touch(b, i)
            self._notfound += 1
            b.misses += 1
            self._reserve(self._nil_len)
            memcpy(self._out + self._len, self._nil, self._nil_len)
            self._len += self._nil_len
            return 1
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
            self._notfound += 1
            b.misses += 1
            self._reserve(self._nil_len)
            memcpy(self._out + self._len, self._nil, self._nil_len)
            self._len += self._nil_len
            return 1
        if rc != 0:
            raise ReplicaError(f"replica read failed: {mdb_strerror(rc).decode()}")
        if <size_t>off > v.mv_size:
            raise ReplicaError("replica record is truncated")
        vlen = v.mv_size - off
        hlen = _bulk_header(head, vlen)
        self._reserve(hlen + vlen + 2)
        memcpy(self._out + self._len, head, hlen)
        memcpy(self._out + self._len + hlen, rec + off, vlen)
        self._out[self._len + hlen + vlen] = 13
        self._out[self._len + hlen + vlen + 1] = 10
        self._len += hlen + vlen + 2
        b.hits += 1
        if b.cache:
            self._touch(b, i)
        return 1

    cdef int _touch(self, _Bucket b, int i) except -1:
        """A near-cache answer, counted into the cache (kvcache.store.nearcache: drain)."""
        key = <object>self._key_obj[i]
        _sketch_add(b, key)
        PyList_Append(b.touched, key)
        self.cached += 1
        if PyList_GET_SIZE(b.touched) >= _TOUCH_MAX:
            b.near.drain()
        return 0

    def serve(self, list lengths, list keys, int proto, Py_ssize_t budget):
        """See kvcache.serve.get.LocalGets.serve."""
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
                    if self._len >= budget or done < GROUP:
                        break
            if self._nkeys:
                answered += self._answer_group(budget)
        finally:
            self._finish()
        return PyBytes_FromStringAndSize(<char*>self._out, self._len), answered, self._notfound

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
                if self._len >= budget or done < GROUP:
                    return ends[done - 1] if done else start
                start = pos
        taken = self._nkeys
        if taken:
            done = self._answer_group(budget)
            answered[0] += done
            return ends[done - 1] if done else start
        return pos

cdef Py_ssize_t _bulk_header(char* out, Py_ssize_t n) noexcept nogil:
    """`$<n>\\r\\n` into out (24 bytes are enough for any Py_ssize_t); returns its length."""
    cdef char digits[20]
    cdef int d = 0, i
    out[0] = 36
    if n == 0:
        digits[0] = 48
        d = 1
    while n > 0:
        digits[d] = <char>(48 + n % 10)
        n //= 10
        d += 1
    for i in range(d):
        out[1 + i] = digits[d - 1 - i]
    out[1 + d] = 13
    out[2 + d] = 10
    return d + 3


cdef Py_ssize_t _FLUSH_AT = FLUSH_AT


cdef bytes _GET_CMD = b"get"  # CLIENT LIST's cmd after GETs this path answered


cdef class GetConnection:
    """See kvcache.serve.get.GetConnection: the same attributes and data_received, in C.
    `transport.write` is looked up once, when the transport is set."""
    cdef public LocalGets gets
    cdef public object stats, reader, _busy
    cdef object _transport, _write
    cdef public int proto
    cdef public bint _closing, _paused_writing, _eof, _draining, _muted
    # CLIENT LIST's idle and cmd: when the client last sent anything (CLOCK_MONOTONIC, ns,
    # at tick resolution), and the last command run (GET here; the generic path sets the rest)
    cdef public long long _last_io
    cdef public object last_cmd

    def __init__(self, LocalGets gets, stats, reader):
        self.gets = gets
        self.stats = stats
        self.reader = reader
        self.transport = None
        self.proto = 2
        self._busy = None
        self._last_io = _coarse_ns()
        self.last_cmd = None

    @property
    def transport(self):
        return self._transport

    @transport.setter
    def transport(self, transport):
        self._transport = transport
        self._write = None if transport is None else transport.write

    def data_received(self, data):
        cdef Py_ssize_t local = 0, notfound = 0
        cdef bint more = False
        cdef LocalGets gets = self.gets
        cdef long long t0 = 0
        if self._closing:
            return
        self._last_io = _coarse_ns()
        if gets.defer and not (self._busy is not None or self._paused_writing or self._draining
                               or self._muted) and type(data) is bytes and self.reader.idle():
            if _stash(gets, self, data):
                self.last_cmd = _GET_CMD
                return
        if gets._stashed:  # what is deferred goes out first
            gets.flush()
        if self._busy is not None or self._paused_writing or self._draining:
            self.reader.feed(data)
            return
        if self._muted:  # CLIENT REPLY OFF/SKIP: the generic loop counts and drops replies
            self.reader.feed(data)
            self._process()
            return
        if gets.timed:
            t0 = _now_ns()
        replies = gets._answer(self.reader, data, self.proto, _FLUSH_AT, &local, &notfound, &more)
        if local:
            self._add(local, notfound)
            self.last_cmd = _GET_CMD
        if replies:
            self._write(replies)
        if t0 and local:
            gets._observe(t0, local)
        if more:
            self._process()

    cdef void _add(self, Py_ssize_t local, Py_ssize_t notfound) except *:
        stats = self.stats
        cdef Py_ssize_t cached = self.gets.cached
        self.gets.cached = 0
        stats.commands += local
        stats.gets_local += local - cached
        if cached:
            stats.gets_cached += cached
        stats.gets_notfound += notfound

    def _count(self, local, notfound):
        self._add(local, notfound)

    def _process(self):
        raise NotImplementedError  # the generic request loop: kvcache.serve.server.ClientConnection


# A read of more GETs than this is answered at once: its own GETs overlap their misses
# already, and gathering it would only delay it (and redo its parse when the group is full).
cdef enum:
    GATHER_MAX = 4
    _GATHER_BYTES = GATHER_MAX * 540  # a GET of a 511-byte key is 535 bytes: longer, not GATHER_MAX GETs


cdef int _stash(LocalGets gets, GetConnection conn, bytes data) except -1:
    """Take a GET-only read into the group answered when this event-loop iteration's reads
    are done (LocalGets.flush, by call_soon): 1, or 0 (nothing taken) when the read is not
    GETs only, does not fit the group or needs the generic path.

    Why: with many clients each sending one GET at a time, the reads of one iteration are
    then searched together (their cache misses overlap, as a pipeline's do) and answered
    in one burst, as redis-server does before it sleeps; answered one by one, each read
    pays its misses alone and each reply wakes the client alone."""
    cdef Py_ssize_t n = PyBytes_GET_SIZE(data), pos = 0, unit_end, d0 = 0, nd = 0, declared = 0, k0 = 0, kn = 0
    cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(data)
    cdef int first = gets._nkeys, units = 0
    cdef bint fresh = not gets._stashed
    if n == 0 or n > _GATHER_BYTES or (not fresh and conn.proto != gets._stash_proto):
        return 0
    while pos < n:  # GETs only, and few enough? (before any is taken)
        unit_end = match_get(p, pos, n, &d0, &nd, &declared, &k0, &kn)
        if unit_end < 0 or declared != kn or (nd > 1 and p[d0] == 48):
            return 0
        units += 1
        if units > GATHER_MAX:
            return 0
        pos = unit_end
    if first + units > GROUP:
        return 0
    if fresh:
        gets._start(conn.proto)
        gets._stash_proto = conn.proto
        gets._stash_t0 = _now_ns() if gets.timed else 0
    pos = 0
    gets._stashing = True
    try:
        while pos < n:
            unit_end = match_get(p, pos, n, &d0, &nd, &declared, &k0, &kn)
            if not gets._take(p + k0, kn, None):
                gets._nkeys = first
                if fresh:
                    gets._finish()
                return 0
            pos = unit_end
    finally:
        gets._stashing = False
    gets._stashed.append((conn, data, gets._nkeys))
    if not gets._scheduled:
        gets._scheduled = True
        gets.call_soon(gets.flush)
    return 1


cdef int _flush_stash(LocalGets gets) except -1:
    cdef list stashed = gets._stashed
    cdef GetConnection conn
    cdef Py_ssize_t start = 0, end, answered = gets._nkeys
    gets._stashed = []
    try:
        gets._answer_group(PY_SSIZE_T_MAX)
        for entry in stashed:
            conn = <GetConnection>entry[0]
            end = gets._key_end[<Py_ssize_t>entry[2] - 1]
            if not conn._closing and conn._write is not None:
                conn._write(PyBytes_FromStringAndSize(<char*>gets._out + start, end - start))
            start = end
        conn._add(answered, gets._notfound)
        conn.stats.reads_gathered += len(stashed)
        if gets._stash_t0:
            gets._observe(gets._stash_t0, answered)
    except ReplicaError as e:  # as when answered at once: the connections end, the sidecar goes on
        log.error("GET path: %s; closing %d client connection(s)", e, len(stashed))
        for entry in stashed:
            conn = <GetConnection>entry[0]
            if conn._transport is not None:
                conn._transport.close()
    finally:
        gets._finish()
    return 0


def search(path, bytes db_name, list keys, unsigned int max_dbs=MAX_DBS):
    """Each key's value in database `db_name` of the LMDB environment at `path`, found the way
    the GET path finds it (lmdb_walk, GROUP keys at a time, mdb_get where it falls back):
    `(values, fallbacks)`, a value being bytes or None. For the differential tests of
    lmdb_walk against mdb_get (tests/test_lmdb_walk.py). Opens and closes an environment of
    its own: not while this process has the same files open in another."""
    cdef MDB_env* env = NULL
    cdef MDB_txn* txn = NULL
    cdef MDB_dbi main, dbi
    cdef MDB_val k, v
    cdef MDB_envinfo info
    cdef MDB_stat st
    cdef WalkMap m
    cdef WalkKey group[GROUP]
    cdef Py_ssize_t i, j, n, start
    cdef size_t root = <size_t>-1
    cdef bint walkable = False
    cdef int rc = mdb_env_create(&env)
    out = []
    fallbacks = 0
    try:
        if rc == 0:
            rc = mdb_env_set_maxdbs(env, max_dbs)
        if rc == 0:
            rc = mdb_env_open(env, os.fsencode(path), MDB_RDONLY | MDB_NOLOCK | MDB_NORDAHEAD, 0o600)
        if rc == 0:
            rc = mdb_txn_begin(env, NULL, MDB_RDONLY, &txn)
        if rc == 0:
            rc = mdb_dbi_open(txn, NULL, 0, &main)
        if rc == 0:
            rc = mdb_dbi_open(txn, PyBytes_AS_STRING(db_name), 0, &dbi)
        if rc != 0:
            raise ReplicaError(mdb_strerror(rc).decode())
        mdb_env_info(env, &info)
        mdb_env_stat(env, &st)
        m.base = NULL
        m.size = info.me_mapsize
        m.last_pgno = info.me_last_pgno
        m.psize = st.ms_psize
        k.mv_size = PyBytes_GET_SIZE(db_name)
        k.mv_data = PyBytes_AS_STRING(db_name)
        if mdb_get(txn, main, &k, &v) == 0 and v.mv_size == 48:
            m.base = walk_map_base(<const unsigned char*>v.mv_data, m.psize)
            if (<const unsigned char*>v.mv_data)[4] == 0 and (<const unsigned char*>v.mv_data)[5] == 0 \
                    and m.base != NULL:
                root = <size_t>_u64le(<const unsigned char*>v.mv_data + 40)
                walkable = True
        for start in range(0, len(keys), GROUP):
            n = min(GROUP, len(keys) - start)
            for j in range(n):
                key = <bytes>keys[start + j]
                group[j].key = <const unsigned char*>PyBytes_AS_STRING(key)
                group[j].klen = PyBytes_GET_SIZE(key)
                group[j].root = root
                if walkable:
                    walk_start(&m, &group[j])
                else:
                    group[j].state = WALK_FALLBACK
            walk_all(&m, group, <int>n)
            for j in range(n):
                if group[j].state == WALK_FALLBACK:
                    fallbacks += 1
                    k.mv_size = group[j].klen
                    k.mv_data = <void*>group[j].key
                    rc = mdb_get(txn, dbi, &k, &v)
                    if rc == 0:
                        out.append(PyBytes_FromStringAndSize(<const char*>v.mv_data, v.mv_size))
                    elif rc == MDB_NOTFOUND:
                        out.append(None)
                    else:
                        raise ReplicaError(mdb_strerror(rc).decode())
                elif group[j].state == WALK_FOUND:
                    out.append(PyBytes_FromStringAndSize(<const char*>group[j].data, group[j].dsize))
                else:
                    out.append(None)
        return out, fallbacks
    finally:
        if txn != NULL:
            mdb_txn_abort(txn)
        mdb_env_close(env)
