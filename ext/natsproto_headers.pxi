# A message's header block, line by line: CRLF search, name and value spans, and whether the
# block stands for a KV delete (KV-Operation, server markers, Nats-TTL). Included by
# natsproto.pyx.


cdef bint _is_delete(const unsigned char* h, Py_ssize_t hn, Py_ssize_t* ttl_s,
                     Py_ssize_t* ttl_e) noexcept nogil:
    """Does this header block stand for a delete? Operation.of's rules: the last
    `KV-Operation` value (DEL or PURGE, any case) decides; without one, a server marker
    (`Nats-Marker-Reason`) is a delete. The last `Nats-TTL` value's span goes to
    ttl_s..ttl_e (ttl_s -1 without one)."""
    cdef Py_ssize_t i, ns, ne, vs, ve
    cdef int op = -1          # -1 no KV-Operation header, 0 put, 1 delete
    cdef bint marker = False
    ttl_s[0] = -1
    i = _crlf(h, 0, hn) + 2
    while i < hn:
        i = _header_line(h, i, hn, &ns, &ne, &vs, &ve)
        if ne - ns == 12 and memcmp(h + ns, b"KV-Operation", 12) == 0:
            op = 1 if (_ieq(h + vs, ve - vs, b"DEL", 3) or _ieq(h + vs, ve - vs, b"PURGE", 5)) else 0
        elif ne - ns == 18 and memcmp(h + ns, b"Nats-Marker-Reason", 18) == 0:
            marker = True
        elif ne - ns == 8 and memcmp(h + ns, b"Nats-TTL", 8) == 0:
            ttl_s[0] = vs
            ttl_e[0] = ve
    return op == 1 if op >= 0 else marker


cdef inline Py_ssize_t _header_line(const unsigned char* h, Py_ssize_t i, Py_ssize_t hn,
                                    Py_ssize_t* ns, Py_ssize_t* ne, Py_ssize_t* vs,
                                    Py_ssize_t* ve) noexcept nogil:
    """The header line at i: its name and value spans, whitespace-trimmed (an empty name when
    the line has no ':'). Returns where the next line starts."""
    cdef Py_ssize_t le = _crlf(h, i, hn)
    cdef const unsigned char* q = <const unsigned char*>memchr(h + i, 58, le - i)
    if q == NULL:
        ns[0] = ne[0] = vs[0] = ve[0] = i
        return le + 2
    ns[0] = i
    ne[0] = q - h
    vs[0] = q - h + 1
    ve[0] = le
    while ns[0] < ne[0] and _is_ws(h[ns[0]]):
        ns[0] += 1
    while ne[0] > ns[0] and _is_ws(h[ne[0] - 1]):
        ne[0] -= 1
    while vs[0] < ve[0] and _is_ws(h[vs[0]]):
        vs[0] += 1
    while ve[0] > vs[0] and _is_ws(h[ve[0] - 1]):
        ve[0] -= 1
    return le + 2


cdef inline Py_ssize_t _crlf(const unsigned char* h, Py_ssize_t i, Py_ssize_t hn) noexcept nogil:
    """Index of the CR of the next CRLF at or after i, or hn."""
    cdef const unsigned char* q
    while i + 1 < hn:
        q = <const unsigned char*>memchr(h + i, 13, hn - 1 - i)
        if q == NULL:
            return hn
        i = q - h
        if h[i + 1] == 10:
            return i
        i += 1
    return hn
