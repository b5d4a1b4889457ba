# A message's header block: CRLF search, name and value spans, which KV operation the block
# stands for (KV-Operation, server markers), and its Nats-TTL as nats-server finds it.
# Included by natsproto.pyx.


cdef int _delete_op(const unsigned char* h, Py_ssize_t hn) except -1:
    """What this header block stands for, by Operation.of's rules: 0 for a put, _MARK_DEL or
    _MARK_PURGE. The last `KV-Operation` value decides (DEL or PURGE, any case; anything else
    is a put); without one, a server marker (`Nats-Marker-Reason`) is a DEL when the last
    reason is `Remove` (case-sensitive), else a PURGE."""
    cdef Py_ssize_t i, ns, ne, vs, ve
    cdef Py_ssize_t kv_s = -1, kv_e = 0     # the last KV-Operation value
    cdef Py_ssize_t mr_s = -1, mr_e = 0     # the last Nats-Marker-Reason value
    i = _crlf(h, 0, hn) + 2
    while i < hn:
        i = _header_line(h, i, hn, &ns, &ne, &vs, &ve)
        if ne - ns == 12 and memcmp(h + ns, b"KV-Operation", 12) == 0:
            kv_s = vs
            kv_e = ve
        elif ne - ns == 18 and memcmp(h + ns, b"Nats-Marker-Reason", 18) == 0:
            mr_s = vs
            mr_e = ve
    # Values arrive trimmed of bytes.strip()'s whitespace; Operation.of then str.strip()s the
    # decoded value, which also removes \x1c-\x1f and non-ASCII spaces (NBSP, U+2000..). A
    # value with such a byte at an edge is rare and left to the twin's rule itself.
    if kv_s >= 0:
        if not _plain_edges(h + kv_s, kv_e - kv_s):
            return _py_mark_op({"KV-Operation": _utf8(h + kv_s, kv_e - kv_s)})
        if _ieq(h + kv_s, kv_e - kv_s, b"DEL", 3):
            return _MARK_DEL
        return _MARK_PURGE if _ieq(h + kv_s, kv_e - kv_s, b"PURGE", 5) else 0
    if mr_s >= 0:
        if not _plain_edges(h + mr_s, mr_e - mr_s):
            return _py_mark_op({"Nats-Marker-Reason": _utf8(h + mr_s, mr_e - mr_s)})
        return _MARK_DEL if mr_e - mr_s == 6 and memcmp(h + mr_s, b"Remove", 6) == 0 else _MARK_PURGE
    return 0


cdef Py_ssize_t _ttl_span(const unsigned char* h, Py_ssize_t hn, Py_ssize_t* end) noexcept nogil:
    """Where the `Nats-TTL` value nats-server reads starts (its end in *end), or -1 without
    one: kvcache.store.msgttl.ttl_header, step for step (getHeaderKeyIndex's search for the
    name after a CRLF with ':' right after it, its quirk included: a candidate found within 2
    bytes of where the search resumed ends it; then the value after its spaces, to the CRLF)."""
    cdef Py_ssize_t offset = 0, i, s
    cdef const unsigned char* q
    while True:
        i = offset
        while True:  # the name's next occurrence at or after offset
            q = <const unsigned char*>memchr(h + i, 78, hn - i) if i < hn else NULL  # 'N'
            if q == NULL:
                return -1
            i = q - h
            if hn - i < 8:
                return -1
            if memcmp(h + i, b"Nats-TTL", 8) == 0:
                break
            i += 1
        if i - offset < 2:
            return -1
        if h[i - 1] != 10 or h[i - 2] != 13:
            offset = i + 8
            continue
        if i + 8 >= hn:
            return -1
        if h[i + 8] != 58:  # ':'
            offset = i + 8
            continue
        break
    s = i + 9
    while s < hn and h[s] == 32:
        s += 1
    end[0] = _crlf(h, s, hn)
    return s


cdef inline bint _plain_edges(const unsigned char* v, Py_ssize_t n) noexcept nogil:
    """Would str.strip() leave this (bytes.strip()ped) value's decoded text as it is? True
    when its first and last bytes are ASCII and not \x1c-\x1f (an ASCII byte always decodes to
    itself, even beside invalid UTF-8)."""
    return n == 0 or (v[0] < 0x80 and not (28 <= v[0] <= 31)
                      and v[n - 1] < 0x80 and not (28 <= v[n - 1] <= 31))


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
