# The C-level parts the GET path's classes share: LMDB's API (the library compiled into this
# extension), the clocks, the record's fields, and the per-bucket and per-key state ServerGets
# keeps (_Bucket, _Plan). Included by server_get.pyx.


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


cdef class _Bucket:
    cdef object witness  # the bucket's witness (kvcache.read.ledger.Witness)
    cdef object max_stale
    cdef long long fresh_until_ns  # witness.fresh_for_all said yes: believed until then
    # A worker process's bucket (kvcache.supervisors.board): the board's words for it, the
    # deadline (wall clock, ns) and max_age_ns, read here each batch instead of asking the
    # witness (NULL: ask the witness)
    cdef const volatile long long* board
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
    # answer is handed to the cache's hit counter (_count_hit)
    cdef bint cache
    cdef object near        # the NearCache
    cdef HitCounter counter  # near.counter, when native (a C call per hit), else None
    cdef object counter_py  # near.counter, when its twin (a Python call per hit)


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

# kvcache.ops.latency.BOUNDS_NS, for the fast path's latency histogram (ServerGets.timed)
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


cdef inline long long _wall_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_REALTIME, &ts)
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


# Values of at least LARGE_VALUE bytes are written to the socket from the map (with writev,
# server_get_write.pxi) instead of being copied into the output; at most MAXSEG a call.
cdef enum:
    MAXSEG = 64
cdef Py_ssize_t _LARGE_VALUE = LARGE_VALUE
