# Large values written to the client's socket straight from the replica's map.
# Included by server_get.pyx.
#
# A GET of a value of LARGE_VALUE bytes or more, answered while its connection's output is
# empty (nothing buffered in the transport, no earlier reply of the call waiting), leaves the
# value out of the output buffer: _reply notes where it goes, and _take_output writes the
# output with the values in place in one writev (header, value, CRLF, the next replies...)
# while the call's read transaction still holds the pages. What the socket does not take is
# copied once, into the bytes the connection hands its transport, which writes it when the
# client reads (no further copy); before the first write of a reply past SNDBUF_FROM the
# socket's send buffer is raised to hold it (_fit_sndbuf), so that up to SNDBUF_MAX nothing
# is left to copy. So a value costs the kernel's copy into the socket and, past
# the socket's buffer, one copy, against three before (into the output, into a bytes object,
# and what the transport could not write at once); and the transaction never outlives the
# call: a slow client holds the remainder, not the map.

cdef extern from "<sys/uio.h>" nogil:
    struct iovec:
        void* iov_base
        size_t iov_len
    ssize_t writev(int fd, const iovec* iov, int iovcnt)

cdef extern from "<sys/socket.h>" nogil:
    ctypedef unsigned int socklen_t
    int SOL_SOCKET
    int SO_SNDBUF
    int getsockopt(int fd, int level, int name, void* value, socklen_t* size)
    int setsockopt(int fd, int level, int name, const void* value, socklen_t size)

from libc.errno cimport errno, EINTR

from kvcache.serve.server_get import SNDBUF_FROM, SNDBUF_MAX

cdef Py_ssize_t _SNDBUF_FROM = SNDBUF_FROM
cdef Py_ssize_t _SNDBUF_MAX = SNDBUF_MAX


cdef inline void _fit_sndbuf(int fd, Py_ssize_t need) noexcept nogil:
    """kvcache.serve.server_get.fit_send_buffer: the socket's send buffer raised to hold `need`
    bytes, at most SNDBUF_MAX, so that the reply goes in one writev instead of its rest being
    copied and written on a later writable event. Never lowered; errors ignored (the write
    then goes as before)."""
    cdef int cur = 0
    cdef int want = <int>(need if need < _SNDBUF_MAX else _SNDBUF_MAX)
    cdef socklen_t size = sizeof(int)
    if getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &cur, &size) == 0 and cur // 2 < want:  # Linux: 2x
        setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &want, sizeof(int))


cdef inline bint _may_leave_in_map(ServerGets g) except -1:
    """May this value stay in the map until the output is written (_output_range)? For a
    connection's own call, only while its output is empty (asked once a call: the
    transport's buffer); for deferred reads (_flush_stash), always: each connection's share
    is then written, or copied, on its own. And while there is room for one more."""
    if g._nseg >= MAXSEG:
        return False
    if g._stash_flush:
        return True
    if g._fd < 0:
        return False
    if g._writable < 0:
        g._writable = 1 if g._transport.get_write_buffer_size() == 0 else 0
    return g._writable == 1


cdef bytes _take_output(ServerGets g):
    """The call's replies for the transport: all of the output, or, with values left in the
    map, what the socket did not take of the output with the values in place, written now."""
    if g._nseg == 0:
        return PyBytes_FromStringAndSize(<char*>g._out, g._len)
    out = _output_range(g, 0, g._len, g._fd)
    g._nseg = 0
    g._seg_bytes = 0
    return out


cdef bytes _output_range(ServerGets g, Py_ssize_t start, Py_ssize_t end, int fd):
    """Output bytes [start, end) with the values left in the map in place: written to `fd`
    as far as the socket takes them (fd -1: not at all), the rest returned as one bytes
    object (b"" when all went)."""
    cdef iovec iov[2 * MAXSEG + 1]
    cdef int n = 0, i = 0, k
    cdef Py_ssize_t pos = start, total = 0, sent = 0, off = 0
    cdef ssize_t w
    cdef char* dst
    for k in range(g._nseg):
        if g._seg_at[k] < start or g._seg_at[k] >= end:
            continue
        if g._seg_at[k] > pos:
            iov[n].iov_base = g._out + pos
            iov[n].iov_len = g._seg_at[k] - pos
            n += 1
        iov[n].iov_base = <void*>g._seg_ptr[k]
        iov[n].iov_len = g._seg_len[k]
        n += 1
        pos = g._seg_at[k]
    if end > pos:
        iov[n].iov_base = g._out + pos
        iov[n].iov_len = end - pos
        n += 1
    for k in range(n):
        total += iov[k].iov_len
    if fd >= 0 and total >= _SNDBUF_FROM:
        _fit_sndbuf(fd, total)
    while fd >= 0 and i < n:
        w = writev(fd, &iov[i], n - i)
        if w < 0:
            if errno == EINTR:
                continue
            break  # full (EAGAIN), or an error the transport meets and reports with the rest
        sent += w
        while i < n and <size_t>w >= iov[i].iov_len:  # past the entries written whole
            w -= iov[i].iov_len
            i += 1
        if i < n:  # the socket took no more: the rest waits for the transport
            iov[i].iov_base = <char*>iov[i].iov_base + w
            iov[i].iov_len -= w
            break
    if total == sent:
        return b""
    rest = PyBytes_FromStringAndSize(NULL, total - sent)
    dst = PyBytes_AS_STRING(rest)
    while i < n:
        memcpy(dst + off, iov[i].iov_base, iov[i].iov_len)
        off += iov[i].iov_len
        i += 1
    return rest
