# The C-level helpers the reader is built from: NamedTuple events filled in place, the
# character classes of the NATS and header grammars, hand-parsed integers, and str/bytes
# views of a span. Included by natsproto.pyx.


cdef inline object _new_tuple(object cls, Py_ssize_t n):
    """An empty instance of a NamedTuple class (no __dict__), to be filled with _put."""
    return (<_TypeObject*><PyObject*>cls).tp_alloc(cls, n)


cdef inline void _put(object t, Py_ssize_t i, object v):
    Py_INCREF(v)
    PyTuple_SET_ITEM(t, i, v)


cdef inline bint _is_ws(unsigned char c) noexcept nogil:
    # bytes.strip()'s set: space \t \n \r \v \f
    return c == 32 or (9 <= c <= 13)


cdef inline bint _name_bad(unsigned char c) noexcept nogil:
    # non-ASCII, or str.isspace() for an ASCII char
    return c >= 0x80 or c == 32 or (9 <= c <= 13) or (28 <= c <= 31)


cdef inline int _digits(const unsigned char* p, Py_ssize_t n, unsigned long long* out) noexcept nogil:
    """Plain ASCII digits fitting 64 bits → 0 and *out, else -1."""
    cdef unsigned long long v = 0
    cdef unsigned long long d
    cdef Py_ssize_t i
    if n <= 0 or n > 20:
        return -1
    for i in range(n):
        d = p[i] - 48
        if d > 9:
            return -1
        if v > (18446744073709551615ULL - d) // 10:
            return -1
        v = v * 10 + d
    out[0] = v
    return 0


cdef inline bint _ieq(const unsigned char* p, Py_ssize_t n, const char* lit, Py_ssize_t ln) noexcept nogil:
    cdef Py_ssize_t i
    if n != ln:
        return False
    for i in range(n):
        if (p[i] | 0x20) != (<unsigned char>lit[i] | 0x20):
            return False
    return True


cdef inline object _utf8(const unsigned char* p, Py_ssize_t n):
    return PyUnicode_DecodeUTF8(<const char*>p, n, "replace")


cdef object _raw(const unsigned char* line, Py_ssize_t s, Py_ssize_t e):
    return repr(PyBytes_FromStringAndSize(<const char*>line + s, min(e - s, 32)))
