# A read-only search of LMDB's B+tree, straight over the memory map, for many keys at once.
#
# Why: at 1M keys a GET's cost is memory latency, not instructions. `mdb_get` descends one key
# at a time, and each step (a page's header, then each probe of its binary search) waits on a
# cache miss that depends on the one before: perf put 40% of the server's time under -P 16 on
# two loads (mdb_page_search reading a page's flags, mdb_node_search reading a node's key
# size). Here the GETs of one socket read are searched together, one step of each in turn,
# and each step prefetches what the next step of the same key will read: the misses of up to
# GROUP keys overlap instead of queueing.
#
# The format read is LMDB 0.9's (lmdb.h's MDB_page/MDB_node, PAGEBASE 0, pgno_t 64-bit), for
# the databases the replica writes: plain keys (no DUPSORT, INTEGERKEY or REVERSEKEY), compared
# as LMDB's default does (memcmp over the shorter length, then the shorter first). Everything
# is bounds-checked against the map; a page or node that does not look as expected ends the
# walk for that key with WALK_FALLBACK, and the caller asks mdb_get, which judges it (the
# same answer, or LMDB's error). tests/test_lmdb_walk.py holds the two equal on generated
# trees: random keys and sizes, overflow values, deletes, every depth up to 4.
from libc.string cimport memcpy

cdef extern from *:
    """
    #define KV_PREFETCH(p) __builtin_prefetch((const void *)(p), 0, 3)
    """
    void KV_PREFETCH(const void* p) nogil

cdef enum:
    GROUP = 32              # keys searched together (a pipelined socket read's GETs)
    SPREAD = 5              # probes prefetched ahead on a page: all of a 31-key page
    SPREAD_UNDER = 4        # ... when fewer keys than this are searched together
    WALK_FOUND = 0
    WALK_NOTFOUND = 1
    WALK_FALLBACK = 2       # ask mdb_get
    _SEEK = 3               # at a page whose header is on its way
    _PROBE = 4              # binary search in progress
    _PAGEHDR = 16           # offsetof(MDB_page, mp_ptrs)
    _NODEHDR = 8            # offsetof(MDB_node, mn_data)
    _P_BRANCH = 0x01
    _P_LEAF = 0x02
    _P_OVERFLOW = 0x04
    _P_LEAF2 = 0x20
    _P_SUBP = 0x40
    _F_BIGDATA = 0x01
    _F_SUBDATA = 0x02
    _F_DUPDATA = 0x04
    _MAX_DEPTH = 32

cdef struct WalkMap:
    const unsigned char* base   # the map (mdb_env_info's me_mapaddr)
    size_t size                 # its length
    size_t psize                # page size
    size_t last_pgno            # the snapshot's last page
    int spread                  # probes prefetched ahead on each page (walk_all sets it)

cdef struct WalkKey:
    const unsigned char* key
    size_t klen
    size_t root                 # the database's root page (from its MDB_db record)
    # search state
    const unsigned char* page
    int state, low, high, mid, best, branch, depth
    unsigned int upper          # the page's mp_upper: nodes lie in [upper, psize)
    # the answer, when state is WALK_FOUND
    const unsigned char* data
    size_t dsize


cdef inline unsigned int _u16(const unsigned char* p) noexcept nogil:
    cdef unsigned short v
    memcpy(&v, p, 2)
    return v


cdef inline const unsigned char* walk_map_base(const unsigned char* rec, size_t psize) noexcept nogil:
    """Where the map starts, found from a value mdb_get returned off a leaf page (NULL if the
    page does not look like one): the page begins at the psize boundary below the value and
    holds its own number. (mdb_env_info's me_mapaddr is the address a MDB_FIXEDMAP file asks
    for, not where this process mapped it.)"""
    cdef size_t addr = <size_t>rec, page = addr - addr % psize, pgno
    memcpy(&pgno, <const void*>page, 8)
    if pgno < 2 or pgno > page // psize or not (_u16(<const unsigned char*>page + 10) & _P_LEAF):
        return NULL
    return <const unsigned char*>(page - pgno * psize)


cdef inline const unsigned char* walk_page(const WalkMap* m, size_t pgno) noexcept nogil:
    """The page's address, or NULL when pgno is not a data page of this snapshot."""
    if pgno < 2 or pgno > m.last_pgno or pgno >= m.size // m.psize:
        return NULL
    return m.base + pgno * m.psize


cdef inline void walk_start(const WalkMap* m, WalkKey* w) noexcept nogil:
    """Begin the search for w.key from w.root (P_INVALID: an empty database)."""
    w.depth = 0
    if w.root == <size_t>-1:
        w.state = WALK_NOTFOUND
        return
    _go(m, w, w.root)


cdef inline void _go(const WalkMap* m, WalkKey* w, size_t pgno) noexcept nogil:
    """Move w to page pgno: its header and first pointers on their way (_SEEK next)."""
    w.page = walk_page(m, pgno)
    if w.page == NULL:
        w.state = WALK_FALLBACK
        return
    KV_PREFETCH(w.page)
    KV_PREFETCH(w.page + 64)
    w.state = _SEEK


cdef extern from *:
    """
    #if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    #define KV_BE64(x) (x)
    #else
    #define KV_BE64(x) __builtin_bswap64(x)
    #endif
    """
    unsigned long long KV_BE64(unsigned long long x) nogil


cdef inline int _cmp(const unsigned char* a, size_t an, const unsigned char* b, size_t bn) noexcept nogil:
    """LMDB's default key order (mdb_cmp_memn), eight bytes at a time in registers: keys are
    short (a call to memcmp was 3% of a GET's time), and a key's last bytes are compared as
    one word too, overlapping what is known equal."""
    cdef size_t n = an if an < bn else bn, i = 0
    cdef unsigned long long x, y
    while i + 8 <= n:
        memcpy(&x, a + i, 8)
        memcpy(&y, b + i, 8)
        if x != y:
            return _word_order(x, y)
        i += 8
    if i < n:
        if n >= 8:
            memcpy(&x, a + n - 8, 8)
            memcpy(&y, b + n - 8, 8)
            if x != y:
                return _word_order(x, y)
        else:
            while i < n:
                if a[i] != b[i]:
                    return 1 if a[i] > b[i] else -1
                i += 1
    return (an > bn) - (an < bn)


cdef inline int _word_order(unsigned long long x, unsigned long long y) noexcept nogil:
    """Two unequal 8-byte runs as memcmp orders them: the first differing byte decides."""
    x = KV_BE64(x)
    y = KV_BE64(y)
    return 1 if x > y else -1


cdef inline const unsigned char* _node(const WalkMap* m, WalkKey* w, int i) noexcept nogil:
    """Node i of w.page with its key inside the page, or NULL."""
    cdef size_t off = _u16(w.page + _PAGEHDR + 2 * i)
    if off < w.upper or off + _NODEHDR > m.psize:
        return NULL
    if off + _NODEHDR + _u16(w.page + off + 6) > m.psize:
        return NULL
    return w.page + off


cdef inline void _prefetch_probes(const unsigned char* page, int low, int high, int levels) noexcept nogil:
    """Prefetch the nodes a binary search of [low, high] reads in its first `levels` probes,
    whichever way it goes: with few keys searched at once there are no other keys' misses to
    overlap with, so a page's probes are made to overlap with each other instead."""
    cdef int mid
    while low <= high and levels > 0:
        mid = (low + high) >> 1
        KV_PREFETCH(page + _u16(page + _PAGEHDR + 2 * mid))
        levels -= 1
        _prefetch_probes(page, low, mid - 1, levels)
        low = mid + 1


cdef inline void _aim(WalkKey* w) noexcept nogil:
    """Next probe: prefetch the node it will read."""
    w.mid = (w.low + w.high) >> 1
    KV_PREFETCH(w.page + _u16(w.page + _PAGEHDR + 2 * w.mid))


cdef inline void _found(const WalkMap* m, WalkKey* w, const unsigned char* node) noexcept nogil:
    cdef unsigned int flags = _u16(node + 4), ksize = _u16(node + 6)
    cdef size_t dsize = _u16(node) | (<size_t>_u16(node + 2) << 16), ov, pages
    cdef const unsigned char* page
    w.state = WALK_FALLBACK
    if flags & (_F_SUBDATA | _F_DUPDATA):
        return
    if flags & _F_BIGDATA:  # the value is on overflow pages; the node holds their first pgno
        if (<size_t>(node - w.page)) + _NODEHDR + ksize + 8 > m.psize:
            return
        memcpy(&ov, node + _NODEHDR + ksize, 8)
        page = walk_page(m, ov)
        if page == NULL or not (_u16(page + 10) & _P_OVERFLOW):
            return
        pages = _u16(page + 12) | (<size_t>_u16(page + 14) << 16)
        if pages == 0 or ov + pages - 1 > m.last_pgno or (ov + pages) * m.psize > m.size \
                or _PAGEHDR + dsize > pages * m.psize:
            return
        w.data = page + _PAGEHDR
    else:
        if (<size_t>(node - w.page)) + _NODEHDR + ksize + dsize > m.psize:
            return
        w.data = node + _NODEHDR + ksize
    w.dsize = dsize
    w.state = WALK_FOUND


cdef inline void walk_step(const WalkMap* m, WalkKey* w) noexcept nogil:
    """One step of w's search: read a page's header, or make one probe. Leaves w.state at
    _SEEK/_PROBE (more to do, its next read prefetched) or at an answer."""
    cdef unsigned int flags, lower, nkeys
    cdef const unsigned char* node
    cdef int c
    cdef size_t child
    if w.state == _SEEK:
        flags = _u16(w.page + 10)
        lower = _u16(w.page + 12)
        w.upper = _u16(w.page + 14)
        if lower < _PAGEHDR or lower > w.upper or w.upper > m.psize or flags & (_P_LEAF2 | _P_SUBP):
            w.state = WALK_FALLBACK
            return
        nkeys = (lower - _PAGEHDR) >> 1
        if flags & _P_BRANCH:
            if nkeys == 0:
                w.state = WALK_FALLBACK
                return
            w.branch = 1
            w.low, w.high, w.best = 1, nkeys - 1, 0  # node 0's key is never compared
        elif flags & _P_LEAF:
            w.branch = 0
            w.low, w.high = 0, <int>nkeys - 1
        else:
            w.state = WALK_FALLBACK
            return
        w.state = _PROBE
        if w.low <= w.high:
            if m.spread:
                _prefetch_probes(w.page, w.low, w.high, m.spread)
            _aim(w)
            return
        if not w.branch:
            w.state = WALK_NOTFOUND
            return
        # a branch page with one child: descend below
    else:
        node = _node(m, w, w.mid)
        if node == NULL:
            w.state = WALK_FALLBACK
            return
        c = _cmp(w.key, w.klen, node + _NODEHDR, _u16(node + 6))
        if w.branch:
            if c >= 0:
                w.best = w.mid
                w.low = w.high + 1 if c == 0 else w.mid + 1
            else:
                w.high = w.mid - 1
        elif c == 0:
            _found(m, w, node)
            return
        elif c > 0:
            w.low = w.mid + 1
        else:
            w.high = w.mid - 1
        if w.low <= w.high:
            _aim(w)
            return
        if not w.branch:
            w.state = WALK_NOTFOUND
            return
    # a branch page searched: the child whose key range holds w.key
    node = _node(m, w, w.best)
    w.depth += 1
    if node == NULL or w.depth > _MAX_DEPTH:
        w.state = WALK_FALLBACK
        return
    child = _u16(node) | (<size_t>_u16(node + 2) << 16) | (<size_t>_u16(node + 4) << 32)
    _go(m, w, child)


cdef inline void walk_all(WalkMap* m, WalkKey* keys, int n) noexcept nogil:
    """Run every key's search to its answer, one step of each in turn. A key searched alone
    (a connection's single GET) prefetches the first SPREAD probes of each page at once;
    among many, the other keys' steps overlap its misses and one probe ahead is enough."""
    cdef int i, busy = 1
    m.spread = SPREAD if n <= SPREAD_UNDER else 0
    while busy:
        busy = 0
        for i in range(n):
            if keys[i].state >= _SEEK:
                walk_step(m, &keys[i])
                busy = 1
