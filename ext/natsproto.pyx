"""NATS client protocol reader in Cython: same API, events and errors as kvcache/natsio/natsproto.py.

The event types, AckMeta and ProtocolError are the twin's own (imported from kvcache.natsio.natsproto),
so both implementations return equal, same-typed events. Parsing works on C pointers into the
fed bytes (or the retained tail), integers are parsed by hand, and Python objects are created
only for what is returned. Header names are interned in a small per-reader cache, so a dict
insert reuses a str with its hash already computed.
"""
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE, PyBytes_FromStringAndSize
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE
from cpython.dict cimport PyDict_SetItem
from cpython.list cimport PyList_Append
from cpython.long cimport PyLong_FromLong, PyLong_FromUnsignedLongLong
from cpython.ref cimport Py_INCREF, PyObject
from cpython.unicode cimport PyUnicode_DecodeUTF8, PyUnicode_DecodeASCII
from libc.string cimport memchr, memcmp, memcpy

import json

from kvcache.errors import ProtocolError
from kvcache.natsio.natsproto import (
    MARK_DEL, MARK_PURGE, MAX_CONTROL_LINE, MAX_PAYLOAD, RUN_FIELDS, AckMeta, Err, HMsg, Info, Msg, OK,
    PING, PONG, _limit, mark_op as _py_mark_op,
)
from kvcache.store.msgttl import parse_msg_ttl as _parse_msg_ttl
from kvcache.store.record import MAX_LMDB_KEY, RECORD, item as _py_item
from kvcache.store.revindex import put_entry as _put_entry

cdef extern from "Python.h":
    ctypedef object (*allocfunc)(object, Py_ssize_t)   # a new reference, NULL on error
    ctypedef struct _TypeObject "PyTypeObject":
        allocfunc tp_alloc
    void PyTuple_SET_ITEM(object, Py_ssize_t, object)
    PyObject* PyDict_SetDefault(object, object, object) except NULL
    const char* PyUnicode_AsUTF8AndSize(object, Py_ssize_t*) except NULL
    object PyDict_New()
    Py_ssize_t PyDict_GET_SIZE(object)
    PyObject* PyDict_GetItemWithError(object, object) except? NULL
    object PyBytes_FromStringAndSize_NULL "PyBytes_FromStringAndSize"(const char*, Py_ssize_t)
    char* PyBytes_AS_STRING_W "PyBytes_AS_STRING"(object)
    object PyTuple_New(Py_ssize_t)
    void PyObject_GC_UnTrack(object)
    PyObject* PyTuple_GET_ITEM(object, Py_ssize_t)

cdef object _Msg = Msg
cdef object _HMsg = HMsg
cdef object _Info = Info
cdef object _Err = Err
cdef object _AckMeta = AckMeta
cdef object _PING = PING
cdef object _PONG = PONG
cdef object _OK = OK
cdef object _json_loads = json.loads
cdef object _RUN_FIELDS = RUN_FIELDS
cdef Py_ssize_t _MAX_LMDB_KEY = MAX_LMDB_KEY
# a put's revision-index entry, built in place by _entry: kvcache.store.revindex's layout
assert _put_entry(b"k", 0x0102030405060708) == (b"\x01\x02\x03\x04\x05\x06\x07\x08", b"Pk"), \
    "revision index entry layout changed: update _entry()"
cdef int _MARK_DEL = MARK_DEL
cdef int _MARK_PURGE = MARK_PURGE
assert _MARK_DEL > 0 and _MARK_PURGE > 0 and _MARK_DEL != _MARK_PURGE, "_delete_op: 0 is a put"
assert RECORD.format == "<QQI" and RECORD.size == 20, "record layout changed: update _record()"

include "natsproto_bytes.pxi"
include "natsproto_headers.pxi"
include "natsproto_ack.pxi"
include "natsproto_lane.pxi"


cdef class NatsReader:
    """Push-style NATS protocol reader; see kvcache.natsio.natsproto."""
    cdef readonly Py_ssize_t max_control_line
    cdef readonly Py_ssize_t max_payload
    cdef bytearray _buf
    cdef Py_ssize_t _scan
    cdef bint _broken
    # pending frame (control line parsed, body incomplete); offsets relative to frame start
    cdef int _kind          # 0 none, 1 MSG, 2 HMSG
    cdef long _sid
    cdef object _subject
    cdef object _reply
    cdef Py_ssize_t _hdr_len, _total, _body_off
    # fast lanes: sid → prefix length; for a pending lane frame, its key and ack fields
    cdef dict _lanes
    cdef object _lane_key       # bytes, or None when the pending frame is not a lane delivery
    cdef unsigned long long _ack[5]
    # header-name cache: the names' bytes and str (kept alive by the two lists), compared with
    # memcmp, so a dict insert reuses a str whose hash is already computed
    cdef list _name_keys
    cdef list _name_strs
    cdef const char* _np[32]
    cdef Py_ssize_t _nl[32]
    cdef PyObject* _ns[32]
    cdef int _nn

    def __init__(self, max_control_line=MAX_CONTROL_LINE, max_payload=MAX_PAYLOAD):
        # 0 to 2**63 - 1, or the twin's own TypeError or ValueError
        self.max_control_line = _limit("max_control_line", max_control_line)
        self.max_payload = _limit("max_payload", max_payload)
        self._buf = bytearray()
        self._scan = 0
        self._broken = False
        self._kind = 0
        self._name_keys = []
        self._name_strs = []
        self._nn = 0
        self._lanes = {}
        self._lane_key = None

    def add_lane(self, long sid, Py_ssize_t prefix_len):
        """See kvcache.natsio.natsproto.NatsReader.add_lane."""
        self._lanes[sid] = prefix_len

    def remove_lane(self, long sid):
        self._lanes.pop(sid, None)

    def buffered(self):
        """Bytes held between feeds (at most one partial frame)."""
        return PyByteArray_GET_SIZE(self._buf)

    def feed(self, data):
        cdef object buf
        cdef const unsigned char* p
        cdef Py_ssize_t n, pos
        cdef list events = []
        if self._broken:
            raise ProtocolError("nats: reader unusable after a protocol error")
        if not isinstance(data, bytes):
            data = bytes(data)
        if PyByteArray_GET_SIZE(self._buf):
            self._buf += data
            buf = self._buf
            p = <const unsigned char*>PyByteArray_AS_STRING(self._buf)
            n = PyByteArray_GET_SIZE(self._buf)
        else:
            buf = data
            p = <const unsigned char*>PyBytes_AS_STRING(data)
            n = PyBytes_GET_SIZE(data)
        try:
            pos = self._parse(p, n, events)
        except ProtocolError as exc:
            self._broken = True
            self._buf = bytearray()
            exc.events = events
            raise
        except Exception as exc:
            self._broken = True
            self._buf = bytearray()
            err = ProtocolError(f"nats: malformed input ({exc})")
            err.events = events
            raise err from None
        if pos >= n:
            if PyByteArray_GET_SIZE(self._buf):
                self._buf = bytearray()
        elif buf is data:
            self._buf = bytearray(data[pos:])
        else:
            del self._buf[:pos]
        return events

    cdef Py_ssize_t _parse(self, const unsigned char* p, Py_ssize_t n, list events) except -1:
        cdef Py_ssize_t pos = 0, lim, eol, b, need, have
        cdef const unsigned char* q
        cdef object ev, payload
        while pos < n:
            if self._kind == 0:
                lim = n - pos
                if lim - 1 > self.max_control_line:  # (max_control_line + 1 may overflow)
                    lim = self.max_control_line + 1
                q = <const unsigned char*>memchr(p + pos + self._scan, 10, lim - self._scan) \
                    if lim > self._scan else NULL
                if q == NULL:
                    have = n - pos
                    if have > self.max_control_line:
                        raise ProtocolError(
                            f"nats: control line too long (over {self.max_control_line} bytes)")
                    self._scan = have
                    return pos
                self._scan = 0
                eol = q - p
                if self._control(p + pos, eol - pos, eol + 1 - pos, events):
                    pos = eol + 1
                    continue
            need = self._body_off + self._total + 2
            if n - pos < need:
                return pos
            b = pos + self._body_off
            if p[b + self._total] != 13 or p[b + self._total + 1] != 10:
                raise ProtocolError("nats: message payload not followed by CRLF")
            if self._lane_key is not None:
                self._deliver(p + b, events)
            elif self._kind == 1:
                payload = PyBytes_FromStringAndSize(<const char*>p + b, self._total)
                ev = _new_tuple(_Msg, 4)
                _put(ev, 0, PyLong_FromLong(self._sid))
                _put(ev, 1, self._subject)
                _put(ev, 2, self._reply)
                _put(ev, 3, payload)
                PyList_Append(events, ev)
            else:
                PyList_Append(events, self._hmsg(p + b))
            self._kind = 0
            self._subject = None
            self._reply = None
            self._lane_key = None
            pos += need
        return pos

    cdef object _hmsg(self, const unsigned char* b):
        cdef const unsigned char* h = b
        cdef const unsigned char* q
        cdef Py_ssize_t hn = self._hdr_len
        cdef Py_ssize_t i = 0, j, ls, le, ns, ne, vs, ve, k, c
        cdef long status = 0
        cdef object desc = ""
        cdef object headers = PyDict_New()
        cdef object multi = None
        cdef object name, val, old, lst
        cdef PyObject* prev
        # first line
        le = _crlf(h, 0, hn)  # end of first line
        if le >= 8 and memcmp(h, b"NATS/1.0", 8) == 0 and (le == 8 or h[8] == 32 or h[8] == 9):
            # the line stripped of whitespace at both ends (a trailing \v, \f or lone \r
            # included), as the twin strips it, before its status token is cut
            ls = 8
            while ls < le and _is_ws(h[ls]):
                ls += 1
            ve = le
            while ve > ls and _is_ws(h[ve - 1]):
                ve -= 1
            j = ls
            while j < ve and h[j] != 32 and h[j] != 9:
                j += 1
            if 0 < j - ls <= 9:
                status = 0
                for k in range(ls, j):
                    c = h[k] - 48
                    if c < 0 or c > 9:
                        status = 0
                        break
                    status = status * 10 + c
            while j < ve and _is_ws(h[j]):
                j += 1
            if ve > j:
                desc = _utf8(h + j, ve - j)
        # header lines
        i = le + 2
        while i < hn:
            i = _header_line(h, i, hn, &ns, &ne, &vs, &ve)
            if ne == ns:  # no ':', or an empty name
                continue
            for k in range(ns, ne):
                if _name_bad(h[k]):
                    break
            else:
                k = -1
            if k >= 0:
                continue
            name = self._name(h + ns, ne - ns)
            val = _utf8(h + vs, ve - vs)
            c = PyDict_GET_SIZE(headers)
            prev = PyDict_SetDefault(headers, name, val)
            if PyDict_GET_SIZE(headers) == c:
                old = <object>prev
                if multi is None:
                    multi = {}
                lst = multi.get(name)
                if lst is None:
                    multi[name] = [old, val]
                else:
                    lst.append(val)
                PyDict_SetItem(headers, name, val)
        payload = PyBytes_FromStringAndSize(<const char*>b + hn, self._total - hn)
        ev = _new_tuple(_HMsg, 8)
        _put(ev, 0, PyLong_FromLong(self._sid))
        _put(ev, 1, self._subject)
        _put(ev, 2, self._reply)
        _put(ev, 3, PyLong_FromLong(status))
        _put(ev, 4, desc)
        _put(ev, 5, headers)
        _put(ev, 6, payload)
        _put(ev, 7, multi)
        return ev

    cdef bint _lane(self, const unsigned char* subj, Py_ssize_t sn, const unsigned char* reply,
                    Py_ssize_t rn) except -1:
        """Is this frame a delivery on a fast lane? If so, keep its key and ack fields."""
        cdef Py_ssize_t names[4]
        cdef Py_ssize_t plen
        cdef PyObject* o = PyDict_GetItemWithError(self._lanes, PyLong_FromLong(self._sid))
        if o == NULL:
            return False
        plen = <object>o
        if sn < plen or _ack_scan(reply, rn, self._ack, names) < 0:
            return False
        self._lane_key = PyBytes_FromStringAndSize(<const char*>subj + plen, sn - plen)
        return True

    cdef int _deliver(self, const unsigned char* b, list events) except -1:
        """Fold the pending lane frame into the Run at the end of `events` (see the twin)."""
        cdef Run run = None
        cdef object last, it
        # ack fields: delivered, stream seq, consumer seq, timestamp, pending
        cdef unsigned long long sseq = self._ack[1]
        cdef unsigned long long cseq = self._ack[2]
        cdef unsigned long long ts = self._ack[3]
        cdef Py_ssize_t hn = self._hdr_len
        cdef Py_ssize_t ttl_s = -1, ttl_e = 0
        cdef int op = _delete_op(b, hn) if hn > 0 else 0   # 0: a put
        cdef object key = self._lane_key
        cdef Py_ssize_t kn = PyBytes_GET_SIZE(key)
        cdef const unsigned char* kp = <const unsigned char*>PyBytes_AS_STRING(key)
        if events:
            last = events[len(events) - 1]
            if type(last) is Run:
                run = <Run>last
                if run.sid != self._sid or run.last_cseq + 1 != cseq:
                    run = None
        if hn > 0 and not op:  # a put's own TTL, as nats-server finds it in the raw block
            ttl_s = _ttl_span(b, hn, &ttl_e)
        if run is None:
            run = Run.__new__(Run)
            run.sid = self._sid
            run.first_cseq = cseq
            run.items = []
            run.marks = []
            run.entries = []
            run.deletes = 0
            run.ttls = 0
            run.top_sseq = 0
            PyList_Append(events, run)
        if kn > _MAX_LMDB_KEY or (kn > 0 and kp[0] == 0) or (ttl_s >= 0 and not op):
            # long keys and messages with a TTL of their own: the twin's item builder
            it = _py_item(key, None if op else
                          PyBytes_FromStringAndSize(<const char*>b + hn, self._total - hn), sseq, ts,
                          0 if ttl_s < 0 or op else
                          _parse_msg_ttl(PyBytes_FromStringAndSize(<const char*>b + ttl_s, ttl_e - ttl_s)))
            if ttl_s >= 0 and not op:
                run.ttls += 1
        else:
            it = PyTuple_New(2)
            _put(it, 0, key)
            _put(it, 1, None if op else _record(sseq, ts, b + hn, self._total - hn))
            # bytes and None cannot form a cycle: a sync's million items are no work for the
            # garbage collector (each tracked tuple counts toward a collection and is visited)
            PyObject_GC_UnTrack(it)
        PyList_Append(run.items, it)
        if op:
            PyList_Append(run.marks, (key, sseq, op, ts))
            run.deletes += 1
        else:
            PyList_Append(run.entries, _entry(sseq, <object>PyTuple_GET_ITEM(it, 0)))
        run.last_cseq = cseq
        if sseq > run.top_sseq:
            run.top_sseq = sseq
        run.last_ts = ts
        run.last_pending = self._ack[4]
        return 0

    cdef object _name(self, const unsigned char* p, Py_ssize_t n):
        cdef int i
        cdef bytes key
        for i in range(self._nn):
            if self._nl[i] == n and memcmp(self._np[i], p, n) == 0:
                return <object>self._ns[i]
        s = PyUnicode_DecodeASCII(<const char*>p, n, NULL)
        if self._nn < 32:
            key = PyBytes_FromStringAndSize(<const char*>p, n)
            self._name_keys.append(key)
            self._name_strs.append(s)
            self._np[self._nn] = PyBytes_AS_STRING(key)
            self._nl[self._nn] = n
            self._ns[self._nn] = <PyObject*>s
            self._nn += 1
        return s

    cdef bint _control(self, const unsigned char* line, Py_ssize_t n, Py_ssize_t body_off,
                       list events) except -1:
        """Parse one control line (without LF). True if it was a complete op, False when a
        MSG/HMSG body is now pending."""
        cdef Py_ssize_t i, oplen, rs
        cdef Py_ssize_t ts[6]
        cdef Py_ssize_t te[6]
        cdef int nt = 0, want, hmsg
        cdef unsigned long long v, hl, tot
        cdef unsigned char c0
        if n > 0 and line[n - 1] == 13:
            n -= 1
        oplen = 0
        while oplen < n and line[oplen] != 32 and line[oplen] != 9:
            oplen += 1
        rs = oplen + 1 if oplen < n else n
        c0 = line[0] | 0x20 if n > 0 else 0
        hmsg = -1
        if oplen == 3 and c0 == 109 and (line[1] | 0x20) == 115 and (line[2] | 0x20) == 103:
            hmsg = 0  # msg
        elif (oplen == 4 and c0 == 104 and (line[1] | 0x20) == 109 and (line[2] | 0x20) == 115
              and (line[3] | 0x20) == 103):
            hmsg = 1  # hmsg
        if hmsg >= 0:
            want = 4 if hmsg else 3
            i = rs
            while True:
                while i < n and (line[i] == 32 or line[i] == 9):
                    i += 1
                if i >= n:
                    break
                if nt == want + 1:
                    nt += 1
                    break
                ts[nt] = i
                while i < n and line[i] != 32 and line[i] != 9:
                    i += 1
                te[nt] = i
                nt += 1
            op = "HMSG" if hmsg else "MSG"
            if nt != want and nt != want + 1:
                raise ProtocolError(f"nats: malformed {op} control line")
            if _digits(line + ts[1], te[1] - ts[1], &v) < 0 or te[1] - ts[1] > 19 \
                    or v > 0x7fffffffffffffffULL:
                raise ProtocolError(f"nats: bad sid field {_raw(line, ts[1], te[1])}")
            if hmsg:
                if _digits(line + ts[nt - 2], te[nt - 2] - ts[nt - 2], &hl) < 0 \
                        or te[nt - 2] - ts[nt - 2] > 19:
                    raise ProtocolError(f"nats: bad header size field {_raw(line, ts[nt - 2], te[nt - 2])}")
                if _digits(line + ts[nt - 1], te[nt - 1] - ts[nt - 1], &tot) < 0 \
                        or te[nt - 1] - ts[nt - 1] > 19:
                    raise ProtocolError(f"nats: bad total size field {_raw(line, ts[nt - 1], te[nt - 1])}")
                if hl > tot:
                    raise ProtocolError(f"nats: header size {hl} exceeds total size {tot}")
            else:
                hl = 0
                if _digits(line + ts[nt - 1], te[nt - 1] - ts[nt - 1], &tot) < 0 \
                        or te[nt - 1] - ts[nt - 1] > 19:
                    raise ProtocolError(f"nats: bad payload size field {_raw(line, ts[nt - 1], te[nt - 1])}")
            if tot > <unsigned long long>self.max_payload:
                raise ProtocolError(
                    f"nats: payload too large ({tot} bytes, limit {self.max_payload})")
            self._sid = <long>v
            if PyDict_GET_SIZE(self._lanes) and nt == want + 1 and \
                    self._lane(line + ts[0], te[0] - ts[0], line + ts[2], te[2] - ts[2]):
                self._subject = None  # a lane delivery needs only the key and the ack fields
                self._reply = None
            else:
                self._subject = _utf8(line + ts[0], te[0] - ts[0])
                self._reply = _utf8(line + ts[2], te[2] - ts[2]) if nt == want + 1 else ""
            self._hdr_len = <Py_ssize_t>hl
            self._total = <Py_ssize_t>tot
            self._body_off = body_off
            self._kind = 2 if hmsg else 1
            return False
        op = PyBytes_FromStringAndSize(<const char*>line, oplen).upper()
        rest = PyBytes_FromStringAndSize(<const char*>line + rs, n - rs)
        if op == b"PING" and not rest.strip(b" \t\r\n\x0b\x0c"):
            PyList_Append(events, _PING)
        elif op == b"PONG" and not rest.strip(b" \t\r\n\x0b\x0c"):
            PyList_Append(events, _PONG)
        elif op == b"+OK" and not rest.strip(b" \t\r\n\x0b\x0c"):
            PyList_Append(events, _OK)
        elif op == b"-ERR":
            text = rest.strip(b" \t\r\n\x0b\x0c")
            if len(text) >= 2 and text.startswith(b"'") and text.endswith(b"'"):
                text = text[1:len(text) - 1]
            PyList_Append(events, _Err(text.decode("utf-8", "replace")))
        elif op == b"INFO":
            try:
                info = _json_loads(rest)
            except ValueError:
                raise ProtocolError("nats: INFO is not valid JSON") from None
            if not isinstance(info, dict):
                raise ProtocolError("nats: INFO is not a JSON object")
            PyList_Append(events, _Info(info))
        else:
            raise ProtocolError(f"nats: unknown protocol op {PyBytes_FromStringAndSize(<const char*>line, min(n, 32))!r}")
        return True
