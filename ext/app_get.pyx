"""LocalReader.get's hot path in C: same API and behaviour as kvcache/app/app_get.py.

The plan and freshness lookups, the clock read and the value copy happen here; the read
itself stays with py-lmdb (a short read transaction of the reader's environment), so locking
and reader registration are py-lmdb's as everywhere else in the reader.
"""
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE, PyBytes_FromStringAndSize
from cpython.dict cimport PyDict_GetItem
from cpython.object cimport PyObject_Call
from cpython.ref cimport PyObject
from cpython.tuple cimport PyTuple_GET_ITEM
from libc.time cimport timespec

from kvcache.store.record import FLAG_TTL, KLEN_MASK, RECORD, TTL_BIT, TTL_BYTE

assert RECORD.format == "<QQI" and RECORD.size == 20, "record layout changed: update LocalGet"
# kvcache.store.record's FLAG_TTL (the record carries its own expiry), as the u32's bit and as the
# bit of its top byte (record.TTL_BYTE / TTL_BIT), and the key length's mask: taken from there
cdef unsigned int _FLAG_TTL = FLAG_TTL
cdef unsigned int _KLEN_MASK = KLEN_MASK
cdef Py_ssize_t _TTL_BYTE = TTL_BYTE
cdef unsigned char _TTL_BIT = TTL_BIT

cdef extern from "<time.h>" nogil:
    int clock_gettime(int clk_id, timespec* tp)
    enum: CLOCK_MONOTONIC
    enum: CLOCK_REALTIME

cdef tuple _NOARGS = ()


cdef inline double _monotonic() noexcept nogil:
    # the clock time.monotonic() reads
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef inline unsigned long long _u64le(const unsigned char* p) noexcept nogil:
    cdef unsigned long long v = 0
    cdef int i
    for i in range(7, -1, -1):
        v = (v << 8) | p[i]
    return v


cdef inline bint _expired(const unsigned char* r, unsigned long long max_age) noexcept nogil:
    """kvcache.store.record.deadline passed? (r has 28 bytes when FLAG_TTL is set)"""
    cdef unsigned long long due = 0, created = _u64le(r + 8)
    cdef timespec ts
    if r[_TTL_BYTE] & _TTL_BIT:
        due = _u64le(r + 20)
        if due == 0xFFFFFFFFFFFFFFFFULL:
            return False
        if max_age and created + max_age < due:
            due = created + max_age
    elif max_age:
        due = created + max_age
    if not due:
        return False
    clock_gettime(CLOCK_REALTIME, &ts)
    return ts.tv_sec * 1_000_000_000ULL + ts.tv_nsec >= due


cdef class LocalGet:
    cdef readonly dict plans
    cdef readonly dict fresh_until
    cdef readonly object begin
    cdef readonly object slow
    cdef dict _kwargs_by_db

    def __init__(self, dict plans, dict fresh_until, begin, slow):
        self.plans = plans
        self.fresh_until = fresh_until
        self.begin = begin
        self.slow = slow
        self._kwargs_by_db = {}

    def __call__(self, key):
        cdef PyObject* p = PyDict_GetItem(self.plans, key)
        cdef PyObject* f
        cdef object plan, db, kwargs, raw
        cdef Py_ssize_t offset, n
        cdef unsigned long long max_age
        cdef unsigned int klen
        cdef const unsigned char* r
        if p == NULL:
            return self.slow(key)
        plan = <object>p
        f = PyDict_GetItem(self.fresh_until, <object>PyTuple_GET_ITEM(plan, 0))
        if f == NULL or <double>(<object>f) <= _monotonic():
            return self.slow(key)
        db = <object>PyTuple_GET_ITEM(plan, 1)
        p = PyDict_GetItem(self._kwargs_by_db, db)
        if p == NULL:
            kwargs = {"db": db}
            self._kwargs_by_db[db] = kwargs
        else:
            kwargs = <object>p
        try:
            raw = PyObject_Call(self.begin, _NOARGS, kwargs).get(<object>PyTuple_GET_ITEM(plan, 2))
        except Exception:  # e.g. the writer grew the map: the slow path adopts it, retries
            return self.slow(key)
        if raw is None:
            return None
        r = <const unsigned char*>PyBytes_AS_STRING(raw)
        n = PyBytes_GET_SIZE(raw)
        max_age = <object>PyTuple_GET_ITEM(plan, 3)
        if n < 20:
            raise ValueError("replica record is truncated")
        klen = r[16] | (r[17] << 8) | (r[18] << 16) | (<unsigned int>r[19] << 24)
        offset = 20 + (klen & _KLEN_MASK)
        if klen & _FLAG_TTL:
            offset += 8
            if n < 28:
                raise ValueError("replica record is truncated")
        if (klen & _FLAG_TTL or max_age) and _expired(r, max_age):
            return None
        if offset > n:
            raise ValueError("replica record is truncated")
        return PyBytes_FromStringAndSize(<const char*>r + offset, n - offset)
