# The connection side of the GET path: GetConnection (what runs on every socket read) and the
# deferred reads of many clients (_stash, _flush_stash). Included by server_get.pyx.


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


cdef int _socket_fd(transport):
    """The transport's socket descriptor, -1 without one (a value is then always copied)."""
    if transport is None:
        return -1
    sock = transport.get_extra_info("socket")
    return -1 if sock is None else sock.fileno()


cdef class GetConnection:
    """See kvcache.serve.server_get.GetConnection: the same attributes and data_received, in C.
    `transport.write` is looked up once, when the transport is set."""
    cdef public ServerGets gets
    cdef public object stats, reader, _busy
    cdef object _transport, _write
    cdef int _fd  # the socket's descriptor (large values are written to it: server_get_write.pxi), or -1
    cdef public int proto
    cdef public bint _closing, _paused_writing, _eof, _draining, _muted
    # CLIENT LIST's idle and cmd: when the client last sent anything (CLOCK_MONOTONIC, ns,
    # at tick resolution), and the last command run (GET here; the generic path sets the rest)
    cdef public long long _last_io
    cdef public object last_cmd

    def __init__(self, ServerGets gets, stats, reader):
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
        self._fd = _socket_fd(transport)

    def data_received(self, data):
        cdef Py_ssize_t local = 0, notfound = 0
        cdef bint more = False
        cdef ServerGets gets = self.gets
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
        gets._fd = self._fd
        gets._transport = self._transport
        try:
            replies = gets._answer(self.reader, data, self.proto, _FLUSH_AT, &local, &notfound, &more)
        finally:
            gets._fd = -1
            gets._transport = None
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
        raise NotImplementedError  # the generic request loop: kvcache.serve.resp_server.ClientConnection


# A read of more GETs than this is answered at once: its own GETs overlap their misses
# already, and gathering it would only delay it (and redo its parse when the group is full).
cdef enum:
    GATHER_MAX = 4
    _GATHER_BYTES = GATHER_MAX * 540  # a GET of a 511-byte key is 535 bytes: longer, not GATHER_MAX GETs


cdef int _stash(ServerGets gets, GetConnection conn, bytes data) except -1:
    """Take a GET-only read into the group answered when this event-loop iteration's reads
    are done (ServerGets.flush, by call_soon): 1, or 0 (nothing taken) when the read is not
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


cdef int _flush_stash(ServerGets gets) except -1:
    cdef list stashed = gets._stashed
    cdef GetConnection conn
    cdef Py_ssize_t start = 0, end, answered = gets._nkeys
    cdef int fd
    gets._stashed = []
    try:
        gets._stash_flush = True
        try:
            gets._answer_group(PY_SSIZE_T_MAX)
        finally:
            gets._stash_flush = False
        for entry in stashed:
            conn = <GetConnection>entry[0]
            end = gets._key_end[<Py_ssize_t>entry[2] - 1]
            if not conn._closing and conn._write is not None:
                if gets._nseg == 0:
                    conn._write(PyBytes_FromStringAndSize(<char*>gets._out + start, end - start))
                else:  # large values: from the map to the socket when its output is empty
                    fd = conn._fd if conn._transport.get_write_buffer_size() == 0 else -1
                    data = _output_range(gets, start, end, fd)
                    if data:
                        conn._write(data)
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
