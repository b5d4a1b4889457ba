"""Pure-Python RESP codec: the reference twin of the Cython parser in `ext/`.

Push-style and I/O-free (feed bytes in, take parsed items out) so the same objects serve the
asyncio server, the blocking client and the tests, and so the native version can be checked
against this one on the same wire vectors, as hiredis is against redis-py's Python parser.

- `RequestReader`: server side, RESP multibulk requests and inline commands.
- `ReplyReader`: client side, RESP2 and RESP3 replies, with the shape of `hiredis.Reader`.
- Encoders (`simple`, `error`, `integer`, `bulk`, `array`, `map_`, ...): server replies.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from operator import index as _index
from typing import Final

from kvcache.errors import ProtocolError
from kvcache.keys import TOKEN_CHARS as _TOKEN_CHARS

__all__ = [
    "CRLF",
    "EMPTY_ARRAY",
    "GET_LEN",
    "INLINE_MAX",
    "NIL2",
    "NIL3",
    "NULL_ARRAY2",
    "OK",
    "ONE",
    "PONG",
    "ZERO",
    "ReplyError",
    "ReplyReader",
    "RequestReader",
    "array",
    "boolean",
    "bulk",
    "bulk_array",
    "double",
    "error",
    "integer",
    "map_",
    "null",
    "simple",
    "verbatim",
]

INLINE_MAX: Final = 64 * 1024
"""Longest inline command or header line, as Redis's PROTO_INLINE_MAX_SIZE."""

# Consumed bytes at the front of a buffer are dropped once they pass this size, so pipelined
# input costs O(n) overall instead of one copy of the remainder per command.
_COMPACT_AT: Final = 64 * 1024

_CR, _LF, _ZERO = 13, 10, 48
_STAR, _DOLLAR, _PLUS, _MINUS, _COLON = 42, 36, 43, 45, 58
_UNDERSCORE, _COMMA, _HASH, _LPAREN, _EQUALS, _BANG = 95, 44, 35, 40, 61, 33
_PERCENT, _TILDE, _GT, _PIPE = 37, 126, 62, 124
_AGGREGATES: Final = frozenset((_STAR, _PERCENT, _TILDE, _GT, _PIPE))
# The most elements an aggregate may declare (a map or an attribute twice its count): what a
# signed 64-bit count holds, the native reader's; more is a protocol error in both twins.
_COUNT_MAX: Final = 2**63 - 1
# The most arguments a request may declare before the count itself is malformed: Redis's
# processMultibulkBuffer refuses a count past INT_MAX as `invalid multibulk length` (kvcache's
# own `max_args`, lower, then says `too many arguments`); a count of zero or below, however
# negative, is no command at all there, not an error.
_MBULK_MAX: Final = 2**31 - 1


def _fail_int(line: bytes | bytearray) -> bool:
    """True unless `line` is an optionally negative decimal of 1 to 19 digits: how replies'
    lengths and integers are read (leading zeros allowed, as hiredis allows them)."""
    digits = line[1:] if line[:1] == b"-" else line
    return not digits.isdigit() or len(digits) > 19


def _fail_ll(line: bytes | bytearray) -> bool:
    """True unless `line` is a number as Redis's string2ll reads a request's counts and
    lengths: `0`, or an optional `-` and 1 to 19 digits without a leading zero (so `-0`,
    `007`, `+1` and ` 1` are not numbers: `invalid multibulk length` or `invalid bulk length`)."""
    return _fail_int(line) or (len(line) > 1 and line[line[0] == _MINUS] == _ZERO)


class _BufferedReader:
    """What both readers share: a receive buffer consumed from a read position, compacted only
    when the consumed prefix is large (no quadratic copying), and a sticky protocol error."""

    __slots__ = ("_buf", "_error", "_pos")

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pos = 0
        self._error: str | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet consumed."""
        return len(self._buf) - self._pos

    def take_rest(self) -> bytes:
        """The bytes received and not consumed, handed over: the buffer is empty after. A
        worker's connection that becomes a pipe (kvcache.serve.relay) sends them on as they are."""
        rest = bytes(self._buf[self._pos:])
        self._pos = len(self._buf)
        return rest

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        buf = self._buf
        if self._pos == len(buf):
            buf.clear()
            self._pos = 0
        elif self._pos >= _COMPACT_AT:
            del buf[: self._pos]
            self._pos = 0
        buf += data

    def _fail(self, message: str) -> ProtocolError:
        self._error = "Protocol error: " + message
        return ProtocolError(self._error)


# --------------------------------------------------------------------------- requests


class RequestReader(_BufferedReader):
    """Splits a client's byte stream into commands (lists of bytes arguments).

    State survives between `feed` calls (the argument count still expected, the length of a
    bulk whose header was read), so a large request arriving in many chunks is parsed once.
    After a `ProtocolError` the framing is lost: every later call raises it again.
    """

    __slots__ = (
        "_argc",
        "_args",
        "_bulklen",
        "_inline_max",
        "_no_fast",
        "_reqsize",
        "_taken",
        "max_args",
        "max_request_bytes",
    )

    def __init__(self, max_request_bytes: int = 4 * 1024 * 1024, max_args: int = 1_048_576) -> None:
        super().__init__()
        self.max_request_bytes = max_request_bytes
        self.max_args = max_args
        self._argc = 0            # arguments still expected by the current multibulk (0: idle)
        self._args: list[bytes] = []
        self._bulklen = -1        # declared length of the bulk being read (-1: header next)
        self._reqsize = 0         # declared size of the current multibulk so far
        self._taken: tuple[int, int] | None = None  # the last take_gets' start and end, to rewind
        # take_gets does not check request sizes: with a limit below its largest unit, every
        # request goes through next_command, which does.
        self._no_fast = max_request_bytes < _GET_UNIT_MAX
        self._inline_max = min(INLINE_MAX, max_request_bytes)  # an inline request is a request


    def idle(self) -> bool:
        """Nothing held: no partial request, no error, the fast path allowed. The next bytes
        start a new command (the GET path may then read GETs from them directly)."""
        return (not self.buffered and self._argc == 0 and self._bulklen < 0
                and self._error is None and not self._no_fast)

    def take_gets(self) -> tuple[list[bytes], list[bytes], int] | None:
        """The run of complete multibulk `GET <key>` commands at the front of the buffer (the
        server's fast path), consumed: `(bulk headers "$<n>", keys, start offset)`; None when
        the next command is anything else (ask `next_command`).

        One regex match finds where the run ends, in C; one split cuts it into its fields
        (a buffer holding a single GET, the unpipelined case, is taken from one match):
        the key pattern (KV key characters and `:`, never CR or LF) makes every unit exactly
        five CRLF-terminated fields. The caller must still check each declared length against
        its key (`GET_LEN[len(key)] == declared`) and, where it stops early, `rewind_gets`.
        """
        if self._argc or self._no_fast:
            return None
        buf = self._buf
        pos = self._pos
        m = _GET_ONE(buf, pos)
        if m is None:
            return None
        end = m.end()
        if end == len(buf):  # the whole buffer is one GET: no run to split
            self._pos = end
            self._taken = (pos, end)
            return [m[1]], [m[2]], pos
        m = _GET_RUN(buf, pos)
        assert m is not None  # _GET_ONE matched here, so the run has at least that GET
        end = m.end()
        self._pos = end
        self._taken = (pos, end)
        fields = bytes(buf[pos:end]).split(b"\r\n")
        return fields[3::5], fields[4::5], pos

    def rewind_gets(self, start: int, lengths: list[bytes], keys: list[bytes], count: int) -> None:
        """Consume only the first `count` of the GETs `take_gets` returned from `start`: right
        after that take_gets (nothing read since), else ValueError and nothing changes."""
        self._pos = _rewind_to(self._taken, self._pos, start, lengths, keys, count)
        self._taken = None

    def next_command(self) -> list[bytes] | None:
        """The next complete command, or None until more data is fed."""
        if self._error is not None:
            raise ProtocolError(self._error)
        buf = self._buf
        end = len(buf)
        pos = self._pos
        while True:
            if self._argc == 0:
                # between commands: a multibulk header, an inline line, or nothing yet
                if pos >= end:
                    self._pos = pos
                    return None
                if buf[pos] != _STAR:
                    nl = buf.find(b"\n", pos)
                    if nl < 0:
                        if end - pos > self._inline_max + 1:
                            raise self._fail("too big inline request")
                        self._pos = pos
                        return None
                    stop = nl - 1 if nl > pos and buf[nl - 1] == _CR else nl
                    if stop - pos > self._inline_max:
                        raise self._fail("too big inline request")
                    inline = bytes(buf[pos:stop])
                    pos = nl + 1
                    args = _split_inline(inline)
                    if args is None:
                        raise self._fail("unbalanced quotes in request")
                    if args:
                        self._pos = pos
                        return args
                    continue  # an empty line is skipped, as Redis does
                crlf = buf.find(b"\r\n", pos)
                if crlf < 0 or crlf - pos > INLINE_MAX:
                    if crlf >= 0 or end - pos > INLINE_MAX + 1:
                        raise self._fail("too big mbulk count string")
                    self._pos = pos
                    return None
                line = buf[pos + 1:crlf]
                if _fail_ll(line):
                    raise self._fail("invalid multibulk length")
                count = int(line)
                if count > _MBULK_MAX:
                    raise self._fail("invalid multibulk length")
                if count > self.max_args:
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
                if buf[pos] != _DOLLAR:
                    raise self._fail(f"expected '$', got '{chr(buf[pos])}'")
                crlf = buf.find(b"\r\n", pos)
                if crlf < 0 or crlf - pos > INLINE_MAX:
                    if crlf >= 0 or end - pos > INLINE_MAX + 1:
                        raise self._fail("too big bulk count string")
                    self._pos = pos
                    return None
                line = buf[pos + 1:crlf]
                if line[:1] == b"-" or _fail_ll(line):
                    raise self._fail("invalid bulk length")
                size = int(line)
                if size > self.max_request_bytes:
                    raise self._fail("invalid bulk length")
                self._reqsize += crlf + 2 - pos + size + 2
                if self._reqsize > self.max_request_bytes:
                    raise self._fail("request too large")
                pos = crlf + 2
                self._bulklen = size

            stop = pos + self._bulklen
            if stop + 2 > end:
                self._pos = pos
                return None
            if buf[stop] != _CR or buf[stop + 1] != _LF:
                raise self._fail("bulk not terminated by CRLF")
            self._args.append(bytes(buf[pos:stop]))
            pos = stop + 2
            self._bulklen = -1
            self._argc -= 1
            if self._argc == 0:
                self._pos = pos
                args, self._args = self._args, []
                return args


# `*2 $3 GET $<n> <key>`: 18 bytes of framing plus the digits and the key. The key pattern
# (KV key characters and `:`, never CR or LF) cannot run past its argument; a declared length
# that disagrees with it is caught by the caller (GET_LEN) and left to the full parser.
# a RESP key: KV key characters, dots, and `:` for a bucket prefix (kvcache.keys)
_KEY_BYTES = rb"[" + _TOKEN_CHARS.encode() + rb".:]"
_GET_ONE = re.compile(rb"\*2\r\n\$3\r\nGET\r\n(\$\d{1,4})\r\n(" + _KEY_BYTES + rb"{1,9999})\r\n").match
_GET_RUN = re.compile(rb"(?:\*2\r\n\$3\r\nGET\r\n\$\d{1,4}\r\n" + _KEY_BYTES + rb"{1,9999}\r\n)+").match
_GET_UNIT_MAX = 18 + 4 + 9999
GET_LEN: Final = [b"$%d" % n for n in range(10_000)]
"""GET_LEN[n] is the bulk header `$<n>` (as take_gets returns them), to compare without int()."""

_SPACES: Final = b" \n\r\t\x0b\x0c\x00"
_ESCAPES: Final = {ord("n"): 10, ord("r"): 13, ord("t"): 9, ord("b"): 8, ord("a"): 7}
_HEX: Final = b"0123456789abcdefABCDEF"


def _split_inline(line: bytes) -> list[bytes] | None:
    """Redis's sdssplitargs: whitespace-separated words, "double" quotes with C-like escapes
    (\\n \\r \\t \\b \\a \\xHH) and 'single' quotes with \\' only. None on unbalanced quotes."""
    if b'"' not in line and b"'" not in line:
        return line.split()
    args: list[bytes] = []
    n = len(line)
    i = 0
    while True:
        while i < n and line[i] in _SPACES:
            i += 1
        if i >= n:
            return args
        word = bytearray()
        in_dq = in_sq = False
        while True:
            c = line[i] if i < n else -1
            if in_dq:
                if c == -1:
                    return None
                if (c == 92 and i + 3 < n and line[i + 1] == 120  # \xHH
                        and line[i + 2] in _HEX and line[i + 3] in _HEX):
                    word.append(int(line[i + 2:i + 4], 16))
                    i += 3
                elif c == 92 and i + 1 < n:
                    i += 1
                    word.append(_ESCAPES.get(line[i], line[i]))
                elif c == 34:
                    if i + 1 < n and line[i + 1] not in _SPACES:
                        return None  # a closing quote must end the word
                    i += 1
                    break
                else:
                    word.append(c)
            elif in_sq:
                if c == -1:
                    return None
                if c == 92 and i + 1 < n and line[i + 1] == 39:
                    i += 1
                    word.append(39)
                elif c == 39:
                    if i + 1 < n and line[i + 1] not in _SPACES:
                        return None
                    i += 1
                    break
                else:
                    word.append(c)
            elif c == -1 or c in _SPACES:
                break
            elif c == 34:
                in_dq = True
            elif c == 39:
                in_sq = True
            else:
                word.append(c)
            i += 1
        args.append(bytes(word))


def _rewind_to(taken: tuple[int, int] | None, pos: int, start: int, lengths: list[bytes],
               keys: list[bytes], count: int) -> int:
    """Where `rewind_gets(start, lengths, keys, count)` leaves the read position: the end of
    the first `count` GETs of the run the last take_gets returned (`taken`: its start and end;
    `pos`: the read position now). A call that does not follow that take_gets is a ValueError
    (a wrong one would move the read position anywhere, and the native reader's memory with
    it): both twins raise it from here, with the same text."""
    start, count = _index(start), _index(count)
    if taken is None or pos != taken[1]:
        raise ValueError("rewind_gets: no take_gets to rewind (none yet, or read on since)")
    if start != taken[0]:
        raise ValueError(f"rewind_gets: start {start} is not where take_gets began ({taken[0]})")
    n = min(len(lengths), len(keys))
    if not 0 <= count <= n:
        raise ValueError(f"rewind_gets: count {count} is not within the {n} GETs take_gets returned")
    # 17 bytes of fixed framing per unit besides its `$<n>` and its key
    to = start + 17 * count + sum(map(len, lengths[:count])) + sum(map(len, keys[:count]))
    if to > taken[1]:
        raise ValueError(f"rewind_gets: the first {count} GETs end at {to}, past where take_gets "
                         f"stopped ({taken[1]})")
    return to


# --------------------------------------------------------------------------- replies


class ReplyError(Exception):
    """An error reply (`-ERR ...` or RESP3 `!`). `ReplyReader.gets` returns it instead of
    raising, as hiredis does with `replyError=`, so errors nested in arrays keep their place;
    callers decide whether to raise it."""


_SKIP: Final = object()  # a finished RESP3 attribute: metadata we drop


class ReplyReader(_BufferedReader):
    """Parses server replies, RESP2 and RESP3, with the interface of `hiredis.Reader`.

    Types as hiredis gives them: simple and bulk strings, verbatim payloads (without the
    `txt:` prefix) → bytes; map → dict; set and push → list; double → float; boolean → bool;
    nulls → None; errors → `ReplyError` instances (returned, not raised). Unlike hiredis, a
    bignum becomes an int and an attribute is dropped (the reply that follows it is returned).
    Partly received aggregates are kept on a stack between calls, so nothing is parsed twice.
    """

    __slots__ = ("_not_enough", "_stack")

    def __init__(self, not_enough_data: object = False) -> None:
        """`not_enough_data` is what `gets` returns when no full reply is buffered; pass a
        sentinel of your own to tell it apart from a RESP3 `#f`."""
        super().__init__()
        self._stack: list[list] = []  # [type byte, elements still expected, elements]
        self._not_enough = not_enough_data

    def has_data(self) -> bool:
        return len(self._buf) > self._pos


    def gets(self) -> object:
        """The next complete reply, or the `not_enough_data` value (False by default)."""
        if self._error is not None:
            raise ProtocolError(self._error)
        buf = self._buf
        end = len(buf)
        pos = self._pos
        stack = self._stack
        while True:
            crlf = buf.find(b"\r\n", pos)
            if crlf < 0:
                break
            t = buf[pos]
            if t in (_DOLLAR, _EQUALS, _BANG):
                line = buf[pos + 1:crlf]
                if line == b"-1" and t == _DOLLAR:
                    value: object = None
                    pos = crlf + 2
                else:
                    if line[:1] == b"-" or _fail_int(line):
                        raise self._fail("invalid bulk length")
                    start = crlf + 2
                    stop = start + int(line)
                    if stop + 2 > end:
                        break
                    if buf[stop] != _CR or buf[stop + 1] != _LF:
                        raise self._fail("bulk not terminated by CRLF")
                    pos = stop + 2
                    if t == _DOLLAR:
                        value = bytes(buf[start:stop])
                    elif t == _EQUALS:
                        if stop - start < 4 or buf[start + 3] != _COLON:
                            raise self._fail("verbatim string without a format prefix")
                        value = bytes(buf[start + 4:stop])
                    else:
                        value = ReplyError(buf[start:stop].decode("utf-8", "replace"))
            elif t in _AGGREGATES:
                line = buf[pos + 1:crlf]
                if _fail_int(line):
                    raise self._fail("invalid aggregate length")
                count = int(line)
                pos = crlf + 2
                if count < 0:
                    if count != -1:
                        raise self._fail("invalid aggregate length")
                    value = None
                elif count == 0:
                    value = {} if t == _PERCENT else _SKIP if t == _PIPE else []
                else:
                    if t in (_PERCENT, _PIPE):  # a map's or an attribute's count is of pairs
                        count *= 2
                    if count > _COUNT_MAX:
                        raise self._fail("invalid aggregate length")
                    stack.append([t, count, []])
                    continue
            else:
                line = buf[pos + 1:crlf]
                pos = crlf + 2
                if t == _PLUS:
                    value = bytes(line)
                elif t == _COLON or t == _LPAREN:
                    if _fail_int(line) and (t == _COLON or not _is_bignum(line)):
                        raise self._fail("invalid integer")
                    value = int(line)
                elif t == _MINUS:
                    value = ReplyError(line.decode("utf-8", "replace"))
                elif t == _UNDERSCORE:
                    if line:
                        raise self._fail("invalid null")
                    value = None
                elif t == _HASH:
                    if line == b"t":
                        value = True
                    elif line == b"f":
                        value = False
                    else:
                        raise self._fail("invalid boolean")
                elif t == _COMMA:
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
                if not stack:
                    self._pos = pos
                    return value
                frame = stack[-1]
                frame[2].append(value)
                frame[1] -= 1
                if frame[1]:
                    break
                stack.pop()
                value = _finish(frame[0], frame[2])
        self._pos = pos
        return self._not_enough


def _is_bignum(line: bytes | bytearray) -> bool:
    digits = line[1:] if line[:1] == b"-" else line
    return digits.isdigit()


def _finish(t: int, items: list) -> object:
    if t == _PERCENT:
        it = iter(items)
        try:
            return dict(zip(it, it, strict=True))  # of duplicate keys the last wins, as in redis-py
        except TypeError:  # an aggregate as a key: legal RESP3, unhashable in Python
            it = iter(items)
            return {_hashable(k): v for k, v in zip(it, it, strict=True)}
    if t == _PIPE:
        return _SKIP
    return items


def _hashable(value: object) -> object:
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _hashable(v)) for k, v in value.items())
    return value


# --------------------------------------------------------------------------- encoders

CRLF: Final = b"\r\n"
OK: Final = b"+OK\r\n"
PONG: Final = b"+PONG\r\n"
NIL2: Final = b"$-1\r\n"
NIL3: Final = b"_\r\n"
NULL_ARRAY2: Final = b"*-1\r\n"
EMPTY_ARRAY: Final = b"*0\r\n"
ZERO: Final = b":0\r\n"
ONE: Final = b":1\r\n"

_NEWLINES: Final = str.maketrans("\r\n", "  ")

Bytes = bytes | bytearray | memoryview


def simple(s: str) -> bytes:
    """`+s`; CR and LF become spaces, since they would end the line."""
    return b"+%b\r\n" % s.translate(_NEWLINES).encode()


def error(msg: str) -> bytes:
    """`-msg`, where msg starts with its code (`ERR ...`, `READONLY ...`)."""
    return b"-%b\r\n" % msg.translate(_NEWLINES).encode()


def integer(n: int) -> bytes:
    return b":%d\r\n" % n


def null(proto: int = 2) -> bytes:
    """The null bulk string of RESP2, or RESP3's one null."""
    return NIL3 if proto == 3 else NIL2


def bulk(b: Bytes | None, proto: int = 2) -> bytes:
    if b is None:
        return NIL3 if proto == 3 else NIL2
    if type(b) is not bytes:
        b = bytes(b)
    return b"$%d\r\n%b\r\n" % (len(b), b)


def bulk_array(values: Sequence[Bytes | None], proto: int = 2) -> bytes:
    """An array of bulk strings (None: nil), each value copied once, straight from where it
    is (MGET's point into the replica's map) into the reply."""
    nil = NIL3 if proto == 3 else NIL2
    parts: list[Bytes] = [b"*%d\r\n" % len(values)]
    append = parts.append
    for v in values:
        if v is None:
            append(nil)
        else:
            append(b"$%d\r\n" % len(v))
            append(v)
            append(b"\r\n")
    return b"".join(parts)


def array(items: Sequence[bytes] | None, proto: int = 2) -> bytes:
    """An array of already encoded elements; None is the null array."""
    if items is None:
        return NIL3 if proto == 3 else NULL_ARRAY2
    return b"*%d\r\n%b" % (len(items), b"".join(items))


def map_(pairs: Iterable[tuple[bytes, bytes]], proto: int = 2) -> bytes:
    """A map of already encoded keys and values; RESP2 has none, so a flat array of 2n."""
    flat = [part for pair in pairs for part in pair]
    return b"%b%d\r\n%b" % (b"%" if proto == 3 else b"*",
                            len(flat) // 2 if proto == 3 else len(flat), b"".join(flat))


def verbatim(text: str, proto: int = 2) -> bytes:
    """Text meant for humans (INFO): RESP3 verbatim `txt`, RESP2 bulk string."""
    data = text.encode()
    if proto == 3:
        return b"=%d\r\ntxt:%b\r\n" % (len(data) + 4, data)
    return b"$%d\r\n%b\r\n" % (len(data), data)


def boolean(v: bool, proto: int = 2) -> bytes:
    """RESP3 `#t`/`#f`; RESP2 clients get the integers 1/0 Redis sends them."""
    if proto == 3:
        return b"#t\r\n" if v else b"#f\r\n"
    return ONE if v else ZERO


def double(x: float, proto: int = 2) -> bytes:
    """RESP3 `,`; RESP2 a bulk string, as Redis does. repr gives the shortest exact text
    and spells inf, -inf and nan as RESP3 wants."""
    text = repr(float(x)).encode()
    if proto == 3:
        return b",%b\r\n" % text
    return b"$%d\r\n%b\r\n" % (len(text), text)


def set_(items: Sequence[bytes], proto: int = 2) -> bytes:
    """A set of already encoded elements: RESP3 `~`, RESP2 an array."""
    return b"%b%d\r\n%b" % (b"~" if proto == 3 else b"*", len(items), b"".join(items))


def push(items: Sequence[bytes], proto: int = 2) -> bytes:
    """Out-of-band data (pub/sub messages, invalidations): RESP3 `>`, RESP2 an array."""
    return b"%b%d\r\n%b" % (b">" if proto == 3 else b"*", len(items), b"".join(items))
