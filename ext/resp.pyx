# cython: language_level=3
"""Native RESP readers: the Cython twin of kvcache/resp.py (same API, same errors).

`RequestReader` and `ReplyReader` work on a malloc'd receive buffer through C pointers, parse
lengths and integers by hand, and create Python objects only for what they return. The
encoders, constants, `ReplyError` and `GET_LEN` are kvcache.resp's own objects, re-exported,
so this module is a drop-in for kvcache.resp in every name the server and the client use.
Rare paths (inline commands with quotes, doubles, bignums, maps with aggregate keys, error
messages) call the twin's helpers, so their semantics cannot drift.
"""
from cpython.buffer cimport PyBUF_SIMPLE, PyObject_GetBuffer, PyBuffer_Release
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.dict cimport PyDict_SetItem
from cpython.list cimport PyList_Append, PyList_GET_ITEM, PyList_GET_SIZE
from cpython.long cimport PyLong_FromLongLong, PyLong_FromUnsignedLongLong
from cpython.mem cimport PyMem_Free, PyMem_Realloc
from libc.string cimport memchr, memcpy, memmove

from resp_get cimport match_get

from kvcache import resp as _twin
from kvcache.errors import ProtocolError
from kvcache.resp import (  # noqa: F401  (re-exported: this module stands in for kvcache.resp)
    CRLF, EMPTY_ARRAY, GET_LEN, INLINE_MAX, NIL2, NIL3, NULL_ARRAY2, OK, ONE, PONG, ZERO,
    ReplyError, array, boolean, bulk, bulk_array, double, error, integer, map_, null, push, set_, simple,
    verbatim,
)

__all__ = list(_twin.__all__)

cdef object _split_inline = _twin._split_inline
cdef object _hashable = _twin._hashable
cdef object _rewind_to = _twin._rewind_to
cdef list _GET_LEN = GET_LEN
cdef object _SKIP = object()

cdef enum:
    _INLINE_MAX = 64 * 1024
    _COMPACT_AT = 64 * 1024
    _GET_UNIT_MAX = 18 + 4 + 9999
    _CR = 13
    _LF = 10

cdef unsigned long long LLMAX = 9223372036854775807ULL
# the most pairs a map or an attribute may declare: twice that still fits a long long
cdef unsigned long long LLMAX_PAIRS = 4611686018427387903ULL
assert LLMAX == _twin._COUNT_MAX and LLMAX_PAIRS * 2 + 1 == LLMAX
cdef long long _MBULK_MAX = 2147483647
assert _MBULK_MAX == _twin._MBULK_MAX



cdef inline bint _parse_int(const unsigned char* p, Py_ssize_t n, bint* neg,
                            unsigned long long* mag) noexcept nogil:
    """An optionally negative decimal of 1..19 ASCII digits (the twin's `_fail_int`): True if
    valid, with its sign and magnitude (< 10**19, so it fits an unsigned 64-bit integer)."""
    cdef Py_ssize_t i = 0
    cdef unsigned long long v = 0
    neg[0] = n > 0 and p[0] == 45
    if neg[0]:
        i = 1
    if n - i < 1 or n - i > 19:
        return False
    while i < n:
        if p[i] < 48 or p[i] > 57:
            return False
        v = v * 10 + (p[i] - 48)
        i += 1
    mag[0] = v
    return True


cdef inline bint _leading_zero(const unsigned char* p, Py_ssize_t n) noexcept nogil:
    """For a number _parse_int accepted: True when Redis's string2ll would not, for a zero
    before other digits or after a `-` (`007`, `-0`): the twin's `_fail_ll`."""
    cdef Py_ssize_t i = 1 if p[0] == 45 else 0
    return n > 1 and p[i] == 48


cdef inline long long _sat(bint neg, unsigned long long mag) noexcept nogil:
    """The value saturated to ±LLONG_MAX: every comparison with a long long limit holds."""
    if mag > LLMAX:
        mag = LLMAX
    return -<long long>mag if neg else <long long>mag


cdef inline Py_ssize_t _find_crlf(const unsigned char* buf, Py_ssize_t pos,
                                  Py_ssize_t end) noexcept nogil:
    """Index of the first CRLF in buf[pos:end], or -1."""
    cdef const unsigned char* p
    while pos < end - 1:
        p = <const unsigned char*>memchr(buf + pos, _CR, end - 1 - pos)
        if p == NULL:
            return -1
        pos = p - buf
        if buf[pos + 1] == _LF:
            return pos
        pos += 1
    return -1


cdef class _BufferedReader:
    """What both readers share: a receive buffer (PyMem, so tracemalloc sees it) consumed from a read position, compacted only
    when the consumed prefix is large (no quadratic copying), and a sticky protocol error."""

    cdef unsigned char* _data
    cdef Py_ssize_t _len, _cap, _pos
    cdef object _error

    def __dealloc__(self):
        PyMem_Free(self._data)

    @property
    def buffered(self):
        """Bytes received but not yet consumed."""
        return self._len - self._pos

    @property
    def _buf(self):
        """A copy of the whole buffer, consumed prefix included (for tests of compaction)."""
        return PyBytes_FromStringAndSize(<char*>self._data, self._len)

    def take_rest(self):
        """The bytes received and not consumed, handed over: the buffer is empty after. A
        worker's connection that becomes a pipe (kvcache.serve.relay) sends them on as they are."""
        rest = PyBytes_FromStringAndSize(<char*>self._data + self._pos, self._len - self._pos)
        self._pos = self._len
        return rest

    def feed(self, data):
        cdef Py_buffer view
        cdef Py_ssize_t need
        cdef unsigned char* grown
        PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
        try:
            if self._pos == self._len:
                self._len = self._pos = 0
            elif self._pos >= _COMPACT_AT:
                memmove(self._data, self._data + self._pos, self._len - self._pos)
                self._len -= self._pos
                self._pos = 0
            need = self._len + view.len
            if need > self._cap:
                need = max(need, self._cap * 2, 4096)
                grown = <unsigned char*>PyMem_Realloc(self._data, need)
                if grown == NULL:
                    raise MemoryError()
                self._data = grown
                self._cap = need
            if view.len:
                memcpy(self._data + self._len, view.buf, view.len)
                self._len += view.len
        finally:
            PyBuffer_Release(&view)

    cdef object _fail(self, str message):
        self._error = "Protocol error: " + message
        return ProtocolError(self._error)


# --------------------------------------------------------------------------- requests


cdef Py_ssize_t _match_get(const unsigned char* buf, Py_ssize_t pos, Py_ssize_t end,
                           list lengths, list keys) except -2:
    """End of the GET unit at pos (its header and key appended to the lists), or -1."""
    cdef Py_ssize_t d0, nd, v, k0, kn
    cdef Py_ssize_t unit_end = match_get(buf, pos, end, &d0, &nd, &v, &k0, &kn)
    if unit_end < 0:
        return -1
    if buf[d0] != 48 or nd == 1:
        PyList_Append(lengths, <object>PyList_GET_ITEM(_GET_LEN, v))
    else:  # leading zeros: not GET_LEN's spelling, so the caller's check fails as in the twin
        PyList_Append(lengths, PyBytes_FromStringAndSize(<const char*>buf + d0 - 1, nd + 1))
    PyList_Append(keys, PyBytes_FromStringAndSize(<const char*>buf + k0, kn))
    return unit_end


cdef class RequestReader(_BufferedReader):
    """Splits a client's byte stream into commands (lists of bytes arguments).

    State survives between `feed` calls (the argument count still expected, the length of a
    bulk whose header was read), so a large request arriving in many chunks is parsed once.
    After a `ProtocolError` the framing is lost: every later call raises it again.
    """

    cdef object _max_request_bytes_obj, _max_args_obj
    cdef long long _max_req, _max_args, _argc, _bulklen, _reqsize, _inline_max
    cdef list _args
    cdef bint _no_fast
    # the last take_gets' run (start -1: none to rewind), as the twin's _taken
    cdef Py_ssize_t _taken_start, _taken_end

    def __init__(self, max_request_bytes=4 * 1024 * 1024, max_args=1_048_576):
        self.max_request_bytes = max_request_bytes
        self.max_args = max_args
        self._argc = 0
        self._args = []
        self._bulklen = -1
        self._reqsize = 0
        self._taken_start = -1
        self._no_fast = max_request_bytes < _GET_UNIT_MAX
        self._inline_max = min(_INLINE_MAX, self._max_req)

    # Public and writable as in the twin, each with a C copy clamped to ±2**62 (a limit no
    # buffer can reach), so sums of sizes cannot overflow.
    @property
    def max_request_bytes(self):
        return self._max_request_bytes_obj

    @max_request_bytes.setter
    def max_request_bytes(self, value):
        self._max_req = min(max(value, -2**62), 2**62)
        self._max_request_bytes_obj = value

    @property
    def max_args(self):
        return self._max_args_obj

    @max_args.setter
    def max_args(self, value):
        self._max_args = min(max(value, -2**62), 2**62)
        self._max_args_obj = value

    def idle(self):
        """Nothing held: no partial request, no error, the fast path allowed. The next bytes
        start a new command (the GET path may then read GETs from them directly)."""
        return (self._pos == self._len and self._argc == 0 and self._bulklen < 0
                and self._error is None and not self._no_fast)

    def take_gets(self):
        """The run of complete multibulk `GET <key>` commands at the front of the buffer (the
        server's fast path), consumed: `(bulk headers "$<n>", keys, start offset)`; None when
        the next command is anything else (ask `next_command`).

        Matches exactly what the twin's regexes match: `*2 $3 GET $<1-4 digits> <key>` with
        the key of KV key characters and `:`. A header `$<n>` written without leading zeros is
        returned as the very object `GET_LEN[n]`. The caller must still check each declared
        length against its key and, where it stops early, `rewind_gets`.
        """
        if self._argc or self._no_fast:
            return None
        cdef const unsigned char* buf = self._data
        cdef Py_ssize_t end = self._len
        cdef Py_ssize_t start = self._pos
        cdef Py_ssize_t pos = start
        cdef Py_ssize_t unit_end
        cdef list lengths = [], keys = []
        while True:
            unit_end = _match_get(buf, pos, end, lengths, keys)
            if unit_end < 0:
                break
            pos = unit_end
        if pos == start:
            return None
        self._pos = pos
        self._taken_start = start
        self._taken_end = pos
        return lengths, keys, start

    def rewind_gets(self, start, lengths, keys, count):
        """Consume only the first `count` of the GETs `take_gets` returned from `start`: right
        after that take_gets (nothing read since), else ValueError and nothing changes (the
        twin's _rewind_to decides and words anything but the plain case)."""
        cdef Py_ssize_t pos, i, c
        if (type(start) is int and type(count) is int and type(lengths) is list and type(keys) is list
                and self._taken_start >= 0 and self._pos == self._taken_end
                and start == self._taken_start and 0 <= count
                and count <= PyList_GET_SIZE(lengths) and count <= PyList_GET_SIZE(keys)):
            c = count
            pos = self._taken_start + 17 * c   # 17 bytes of framing per unit beside `$<n>` and the key
            for i in range(c):
                pos += len(<object>PyList_GET_ITEM(lengths, i)) + len(<object>PyList_GET_ITEM(keys, i))
            if pos <= self._taken_end:
                self._pos = pos
                self._taken_start = -1
                return
        self._pos = _rewind_to((self._taken_start, self._taken_end) if self._taken_start >= 0 else None,
                               self._pos, start, lengths, keys, count)
        self._taken_start = -1

    def next_command(self):
        """The next complete command, or None until more data is fed."""
        if self._error is not None:
            raise ProtocolError(self._error)
        cdef const unsigned char* buf = self._data
        cdef Py_ssize_t end = self._len
        cdef Py_ssize_t pos = self._pos
        cdef Py_ssize_t nl, stop, crlf, window
        cdef const unsigned char* hit
        cdef bint neg
        cdef unsigned long long mag
        cdef long long count, size
        cdef list args
        while True:
            if self._argc == 0:
                # between commands: a multibulk header, an inline line, or nothing yet
                if pos >= end:
                    self._pos = pos
                    return None
                if buf[pos] != 42:
                    # a line of at most inline_max bytes (plus CR) ends within this window
                    window = min(end - pos, self._inline_max + 2) if self._inline_max >= 0 else 0
                    hit = <const unsigned char*>memchr(buf + pos, _LF, window) if window > 0 else NULL
                    if hit == NULL:
                        if end - pos > self._inline_max + 1:
                            raise self._fail("too big inline request")
                        self._pos = pos
                        return None
                    nl = hit - buf
                    stop = nl - 1 if nl > pos and buf[nl - 1] == _CR else nl
                    if stop - pos > self._inline_max:
                        raise self._fail("too big inline request")
                    line = PyBytes_FromStringAndSize(<const char*>buf + pos, stop - pos)
                    pos = nl + 1
                    args = _split_inline(line)
                    if args is None:
                        raise self._fail("unbalanced quotes in request")
                    if args:
                        self._pos = pos
                        return args
                    continue  # an empty line is skipped, as Redis does
                crlf = _find_crlf(buf, pos, min(end, pos + _INLINE_MAX + 2))
                if crlf < 0:
                    if end - pos > _INLINE_MAX + 1:
                        raise self._fail("too big mbulk count string")
                    self._pos = pos
                    return None
                if (not _parse_int(buf + pos + 1, crlf - pos - 1, &neg, &mag)
                        or _leading_zero(buf + pos + 1, crlf - pos - 1)):
                    raise self._fail("invalid multibulk length")
                count = _sat(neg, mag)
                if count > _MBULK_MAX:  # the twin's _MBULK_MAX: Redis's INT_MAX
                    raise self._fail("invalid multibulk length")
                if count > self._max_args:
                    raise self._fail("too many arguments")
                self._reqsize = crlf + 2 - pos
                pos = crlf + 2
                if count <= 0:
                    continue  # *0, *-1 and every negative count are no command at all
                self._argc = count
                self._args = []
                self._bulklen = -1

            if self._bulklen < 0:
                if pos >= end:
                    self._pos = pos
                    return None
                if buf[pos] != 36:
                    raise self._fail(f"expected '$', got '{chr(buf[pos])}'")
                crlf = _find_crlf(buf, pos, min(end, pos + _INLINE_MAX + 2))
                if crlf < 0:
                    if end - pos > _INLINE_MAX + 1:
                        raise self._fail("too big bulk count string")
                    self._pos = pos
                    return None
                if (not _parse_int(buf + pos + 1, crlf - pos - 1, &neg, &mag) or neg
                        or _leading_zero(buf + pos + 1, crlf - pos - 1)):
                    raise self._fail("invalid bulk length")
                size = _sat(neg, mag)
                if size > self._max_req:
                    raise self._fail("invalid bulk length")
                self._reqsize += crlf + 2 - pos + size + 2
                if self._reqsize > self._max_req:
                    raise self._fail("request too large")
                pos = crlf + 2
                self._bulklen = size

            stop = pos + self._bulklen
            if stop + 2 > end:
                self._pos = pos
                return None
            if buf[stop] != _CR or buf[stop + 1] != _LF:
                raise self._fail("bulk not terminated by CRLF")
            PyList_Append(self._args, PyBytes_FromStringAndSize(<const char*>buf + pos, stop - pos))
            pos = stop + 2
            self._bulklen = -1
            self._argc -= 1
            if self._argc == 0:
                self._pos = pos
                args = self._args
                self._args = []
                return args


# --------------------------------------------------------------------------- replies


cdef inline object _finish(int t, list items):
    cdef dict d
    cdef Py_ssize_t i, n
    if t == 37:  # map: of duplicate keys the last wins, as in redis-py
        d = {}
        n = PyList_GET_SIZE(items)
        try:
            for i in range(0, n - 1, 2):
                PyDict_SetItem(d, <object>PyList_GET_ITEM(items, i), <object>PyList_GET_ITEM(items, i + 1))
        except TypeError:  # an aggregate as a key: legal RESP3, unhashable in Python
            it = iter(items)
            return {_hashable(k): v for k, v in zip(it, it)}
        return d
    if t == 124:
        return _SKIP
    return items


cdef class ReplyReader(_BufferedReader):
    """Parses server replies, RESP2 and RESP3, with the interface of `hiredis.Reader`.

    Types as hiredis gives them: simple and bulk strings, verbatim payloads (without the
    `txt:` prefix) → bytes; map → dict; set and push → list; double → float; boolean → bool;
    nulls → None; errors → `ReplyError` instances (returned, not raised). Unlike hiredis, a
    bignum becomes an int and an attribute is dropped (the reply that follows it is returned).
    Partly received aggregates are kept on a stack between calls, so nothing is parsed twice.
    """

    cdef object _not_enough
    # the open aggregates: type byte and elements still expected in C, elements in a list
    cdef int* _types
    cdef long long* _left
    cdef Py_ssize_t _depth, _stack_cap
    cdef list _items

    def __init__(self, not_enough_data=False):
        """`not_enough_data` is what `gets` returns when no full reply is buffered; pass a
        sentinel of your own to tell it apart from a RESP3 `#f`."""
        self._not_enough = not_enough_data
        self._items = []
        self._depth = 0

    def __dealloc__(self):
        PyMem_Free(self._types)
        PyMem_Free(self._left)

    def has_data(self):
        return self._len > self._pos

    cdef int _push(self, int t, long long count) except -1:
        cdef Py_ssize_t cap
        cdef void* p
        if self._depth == self._stack_cap:
            cap = max(16, self._stack_cap * 2)
            p = PyMem_Realloc(self._types, cap * sizeof(int))
            if p == NULL:
                raise MemoryError()
            self._types = <int*>p
            p = PyMem_Realloc(self._left, cap * sizeof(long long))
            if p == NULL:
                raise MemoryError()
            self._left = <long long*>p
            self._stack_cap = cap
        self._types[self._depth] = t
        self._left[self._depth] = count
        self._depth += 1
        self._items.append([])
        return 0

    def gets(self):
        """The next complete reply, or the `not_enough_data` value (False by default)."""
        if self._error is not None:
            raise ProtocolError(self._error)
        cdef const unsigned char* buf = self._data
        cdef Py_ssize_t end = self._len
        cdef Py_ssize_t pos = self._pos
        cdef Py_ssize_t crlf, start, stop, n
        cdef int t
        cdef bint neg, ok
        cdef unsigned long long mag
        cdef long long count
        cdef object value
        cdef list frame
        while True:
            crlf = _find_crlf(buf, pos, end)
            if crlf < 0:
                break
            t = buf[pos]
            n = crlf - pos - 1  # length of the line after the type byte
            if t == 36 or t == 61 or t == 33:  # $ = !
                if t == 36 and n == 2 and buf[pos + 1] == 45 and buf[pos + 2] == 49:
                    value = None
                    pos = crlf + 2
                else:
                    if not _parse_int(buf + pos + 1, n, &neg, &mag) or neg:
                        raise self._fail("invalid bulk length")
                    start = crlf + 2
                    if mag > <unsigned long long>(end - start):
                        break
                    stop = start + <Py_ssize_t>mag
                    if stop + 2 > end:
                        break
                    if buf[stop] != _CR or buf[stop + 1] != _LF:
                        raise self._fail("bulk not terminated by CRLF")
                    pos = stop + 2
                    if t == 36:
                        value = PyBytes_FromStringAndSize(<const char*>buf + start, stop - start)
                    elif t == 61:
                        if stop - start < 4 or buf[start + 3] != 58:
                            raise self._fail("verbatim string without a format prefix")
                        value = PyBytes_FromStringAndSize(<const char*>buf + start + 4, stop - start - 4)
                    else:
                        value = ReplyError(PyBytes_FromStringAndSize(
                            <const char*>buf + start, stop - start).decode("utf-8", "replace"))
            elif t == 42 or t == 37 or t == 126 or t == 62 or t == 124:  # * % ~ > |
                if not _parse_int(buf + pos + 1, n, &neg, &mag):
                    raise self._fail("invalid aggregate length")
                count = _sat(neg, mag)
                pos = crlf + 2
                if count < 0:
                    if count != -1:
                        raise self._fail("invalid aggregate length")
                    value = None
                elif count == 0:
                    value = {} if t == 37 else _SKIP if t == 124 else []
                else:
                    # bounded before it is doubled: a count of pairs past LLMAX_PAIRS (or of
                    # elements past LLMAX) would overflow a long long
                    if t == 37 or t == 124:
                        if mag > LLMAX_PAIRS:
                            raise self._fail("invalid aggregate length")
                        count = count * 2
                    elif mag > LLMAX:
                        raise self._fail("invalid aggregate length")
                    self._push(t, count)
                    continue
            else:
                start = pos + 1
                pos = crlf + 2
                if t == 43:  # +
                    value = PyBytes_FromStringAndSize(<const char*>buf + start, n)
                elif t == 58 or t == 40:  # : (
                    ok = _parse_int(buf + start, n, &neg, &mag)
                    if ok and mag <= LLMAX:
                        value = PyLong_FromLongLong(-<long long>mag if neg else <long long>mag)
                    elif ok and not neg:
                        value = PyLong_FromUnsignedLongLong(mag)
                    else:
                        line = PyBytes_FromStringAndSize(<const char*>buf + start, n)
                        if not ok and (t == 58 or not _twin._is_bignum(line)):
                            raise self._fail("invalid integer")
                        value = int(line)
                elif t == 45:  # -
                    value = ReplyError(PyBytes_FromStringAndSize(
                        <const char*>buf + start, n).decode("utf-8", "replace"))
                elif t == 95:  # _
                    if n:
                        raise self._fail("invalid null")
                    value = None
                elif t == 35:  # #
                    if n == 1 and buf[start] == 116:
                        value = True
                    elif n == 1 and buf[start] == 102:
                        value = False
                    else:
                        raise self._fail("invalid boolean")
                elif t == 44:  # ,
                    line = PyBytes_FromStringAndSize(<const char*>buf + start, n)
                    try:
                        if b"_" in line:
                            raise ValueError
                        value = float(line)
                    except ValueError:
                        raise self._fail("invalid double") from None
                else:
                    raise self._fail(f"got {chr(t)!r} as reply type byte")

            # a complete value: fold it into the open aggregates, innermost first
            while value is not _SKIP:
                if self._depth == 0:
                    self._pos = pos
                    return value
                frame = <list>PyList_GET_ITEM(self._items, self._depth - 1)
                PyList_Append(frame, value)
                self._left[self._depth - 1] -= 1
                if self._left[self._depth - 1]:
                    break
                self._depth -= 1
                del self._items[self._depth]
                value = _finish(self._types[self._depth], frame)
        self._pos = pos
        return self._not_enough
