# JetStream ack subjects ($JS.ACK....): the C scan the fast lanes use, and parse_ack, its
# Python face. Included by natsproto.pyx.


cdef int _ack_scan(const unsigned char* p, Py_ssize_t n, unsigned long long* nums,
                   Py_ssize_t* names) noexcept nogil:
    """A JetStream ack subject → 0, the five integers in nums and the stream and consumer
    spans in names[0..3]; -1 when it is not one (see kvcache.natsio.natsproto.parse_ack)."""
    cdef Py_ssize_t i, start
    cdef Py_ssize_t offs[24]
    cdef Py_ssize_t ntok, t0
    cdef int k
    if n < 8 or memcmp(p, b"$JS.ACK.", 8) != 0:
        return -1
    # token starts (offs[k]); token k spans offs[k] .. offs[k+1]-1
    offs[0] = 0
    ntok = 1
    for i in range(n):
        if p[i] == 46:  # '.'
            if ntok < 23:
                offs[ntok] = i + 1
            ntok += 1
    if ntok == 9:
        t0 = 2
    elif ntok >= 12:
        t0 = 4
    else:
        return -1
    if ntok < 23:
        offs[ntok] = n + 1
    # (with 23+ tokens only the first t0 + 7 are used, and those are all recorded)
    if offs[t0 + 1] - offs[t0] - 1 <= 0 or offs[t0 + 2] - offs[t0 + 1] - 1 <= 0:
        return -1
    for k in range(5):
        start = offs[t0 + 2 + k]
        if _digits(p + start, offs[t0 + 3 + k] - 1 - start, &nums[k]) < 0:
            return -1
    names[0] = offs[t0]
    names[1] = offs[t0 + 1] - 1
    names[2] = offs[t0 + 1]
    names[3] = offs[t0 + 2] - 1
    return 0


def parse_ack(reply):
    """See kvcache.natsio.natsproto.parse_ack: same rules, no Python string splitting."""
    cdef const unsigned char* p
    cdef Py_ssize_t n
    cdef Py_ssize_t names[4]
    cdef unsigned long long nums[5]
    cdef int k
    if isinstance(reply, str):
        p = <const unsigned char*>PyUnicode_AsUTF8AndSize(reply, &n)
    elif isinstance(reply, bytes):
        p = <const unsigned char*>PyBytes_AS_STRING(reply)
        n = PyBytes_GET_SIZE(reply)
    else:
        reply = bytes(reply)
        p = <const unsigned char*>PyBytes_AS_STRING(reply)
        n = PyBytes_GET_SIZE(reply)
    if _ack_scan(p, n, nums, names) < 0:
        return None
    t = _new_tuple(_AckMeta, 7)
    _put(t, 0, _utf8(p + names[0], names[1] - names[0]))
    _put(t, 1, _utf8(p + names[2], names[3] - names[2]))
    for k in range(5):
        _put(t, 2 + k, PyLong_FromUnsignedLongLong(nums[k]))
    return t
