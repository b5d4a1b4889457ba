# What fast-lane deliveries become: the Run event, and each item's record built in place.
# Included by natsproto.pyx.


cdef class Run:
    """See kvcache.natsio.natsproto.Run (the same fields; equal to a twin Run with equal fields)."""
    cdef readonly long sid
    cdef readonly unsigned long long first_cseq, last_cseq, top_sseq, last_ts, last_pending
    cdef readonly list items
    cdef readonly Py_ssize_t deletes
    cdef readonly list marks
    cdef readonly Py_ssize_t ttls
    cdef readonly list entries

    def fields(self):
        return tuple(getattr(self, f) for f in _RUN_FIELDS)

    def __eq__(self, other):
        fields = getattr(other, "fields", None)
        return fields is not None and type(other).__name__ == "Run" and self.fields() == fields()

    __hash__ = None

    def __repr__(self):
        return f"Run(sid={self.sid}, cseq={self.first_cseq}..{self.last_cseq}, items={len(self.items)})"


cdef inline void _le64(char* o, unsigned long long v) noexcept nogil:
    cdef int i
    for i in range(8):
        o[i] = <char>(v & 0xff)
        v >>= 8


cdef object _entry(unsigned long long rev, object lk):
    """kvcache.store.revindex.put_entry in place: (revision big-endian, b"P" + lkey), a tuple
    the garbage collector need not track (bytes only)."""
    cdef Py_ssize_t kn = PyBytes_GET_SIZE(lk)
    key = PyBytes_FromStringAndSize_NULL(NULL, 8)
    cdef char* o = PyBytes_AS_STRING_W(key)
    cdef int i
    for i in range(8):
        o[7 - i] = <char>(rev & 0xff)
        rev >>= 8
    val = PyBytes_FromStringAndSize_NULL(NULL, 1 + kn)
    o = PyBytes_AS_STRING_W(val)
    o[0] = 80  # 'P'
    memcpy(o + 1, PyBytes_AS_STRING(lk), kn)
    t = PyTuple_New(2)
    _put(t, 0, key)
    _put(t, 1, val)
    PyObject_GC_UnTrack(t)
    return t


cdef object _record(unsigned long long rev, unsigned long long created,
                    const unsigned char* value, Py_ssize_t vn):
    """kvcache.store.record's `<QQI` header (no long key) + value, built in place."""
    rec = PyBytes_FromStringAndSize_NULL(NULL, 20 + vn)
    cdef char* o = PyBytes_AS_STRING_W(rec)
    _le64(o, rev)
    _le64(o + 8, created)
    o[16] = 0
    o[17] = 0
    o[18] = 0
    o[19] = 0
    if vn:
        memcpy(o + 20, value, vn)
    return rec
