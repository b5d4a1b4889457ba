# The multibulk `GET <key>` unit, matched in C: shared by the RESP reader's take_gets
# (ext/resp.pyx) and the GET path's direct parse of a socket read (ext/server_get.pyx), so the
# two can never disagree about what a GET is. Inline only: nothing to import at run time.

cdef inline bint keychar(unsigned char c) noexcept nogil:
    """take_gets' key characters: kvcache.keys.TOKEN_CHARS, `.` and `:` (tests/test_keys.py)"""
    return (48 <= c <= 58 or 65 <= c <= 90 or 97 <= c <= 122 or c == 45 or c == 47
            or c == 95 or c == 61 or c == 46)


cdef inline Py_ssize_t match_get(const unsigned char* buf, Py_ssize_t pos, Py_ssize_t end,
                                 Py_ssize_t* d0, Py_ssize_t* nd, Py_ssize_t* declared,
                                 Py_ssize_t* k0, Py_ssize_t* kn) noexcept nogil:
    """End of the `*2\r\n$3\r\nGET\r\n$<n>\r\n<key>\r\n` unit at pos, or -1. On a match: the
    length digits at d0 (nd of them, 1 to 4, value `declared`) and the key at k0 (kn bytes).
    The declared length is not checked against the key: that is the caller's to judge."""
    cdef Py_ssize_t p, v
    if end - pos < 20 or (buf[pos] != 42 or buf[pos + 1] != 50 or buf[pos + 2] != 13
                          or buf[pos + 3] != 10 or buf[pos + 4] != 36 or buf[pos + 5] != 51
                          or buf[pos + 6] != 13 or buf[pos + 7] != 10 or buf[pos + 8] != 71
                          or buf[pos + 9] != 69 or buf[pos + 10] != 84
                          or buf[pos + 11] != 13 or buf[pos + 12] != 10
                          or buf[pos + 13] != 36):
        return -1
    d0[0] = pos + 14
    p = d0[0]
    v = 0
    while p < end and p - d0[0] < 4 and 48 <= buf[p] <= 57:
        v = v * 10 + (buf[p] - 48)
        p += 1
    nd[0] = p - d0[0]
    if nd[0] == 0 or p + 1 >= end or buf[p] != 13 or buf[p + 1] != 10:
        return -1
    declared[0] = v
    k0[0] = p + 2
    p = k0[0]
    while p < end and p - k0[0] < 9999 and keychar(buf[p]):
        p += 1
    kn[0] = p - k0[0]
    if kn[0] == 0 or p + 1 >= end or buf[p] != 13 or buf[p + 1] != 10:
        return -1
    return p + 2
