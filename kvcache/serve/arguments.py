"""Command arguments read as Redis reads them: the one integer parser, and the few readings
built on it (a timeout, a SCAN cursor, `NAME value` options).

Redis reads an integer argument with string2ll: `0`, or an optional `-` then digits without a
leading zero, within 64 bits; no spaces, no `+`, no `_` (all of which Python's int() would
take). Each command then has its own words for a bad one (`ERR value is not an integer or out
of range` unless it says otherwise: HELLO's protocol version, CLIENT KILL's ID, XREAD's BLOCK)
and its own range. Every command reads its integers here, so they agree on what a number is.
"""
from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import CommandError

I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1
I32_MIN, I32_MAX = -(1 << 31), (1 << 31) - 1
U64_MAX = (1 << 64) - 1

NOT_AN_INTEGER = "ERR value is not an integer or out of range"
SYNTAX_ERROR = "ERR syntax error"

_STRING2LL = re.compile(rb"0|-?[1-9][0-9]*")
_STRTOULL = re.compile(rb"([+-]?)([0-9]+)")


def integer(raw: bytes, error: str = NOT_AN_INTEGER, lo: int = I64_MIN, hi: int = I64_MAX,
            range_error: str | None = None) -> int:
    """`raw` as a 64-bit integer (Redis's string2ll), else CommandError(error); outside
    [lo, hi], CommandError(range_error), by default `error` too (Redis's getRangeLong...:
    its own words for the range when a command has them)."""
    if _STRING2LL.fullmatch(raw) is None:
        raise CommandError(error)
    n = int(raw)
    if not I64_MIN <= n <= I64_MAX:
        raise CommandError(error)
    if not lo <= n <= hi:
        raise CommandError(range_error or error)
    return n


def non_negative(raw: bytes) -> int:
    """An integer that may not be negative, in Redis's words for one
    (getPositiveLongFromObjectOrReply)."""
    return integer(raw, lo=0, range_error="ERR value is out of range, must be positive")


def timeout_ms(raw: bytes) -> int:
    """A blocking command's timeout in milliseconds (XREAD BLOCK; 0: none), as Redis 7.4's
    getTimeoutFromObjectOrReply: its words for a bad one, a negative one, and one whose
    deadline would pass the 64-bit clock."""
    ms = integer(raw, "ERR timeout is not an integer or out of range")
    if ms < 0:
        raise CommandError("ERR timeout is negative")
    if ms > I64_MAX - time.time_ns() // 1_000_000:
        raise CommandError("ERR timeout is out of range")
    return ms


def cursor(raw: bytes) -> int:
    """A SCAN cursor, as Redis reads one (string2ull, which falls back to strtoull: `00` and
    `+0` are 0 too, `-n` wraps); anything else is `ERR invalid cursor`."""
    m = _STRTOULL.fullmatch(raw)
    if m is None or int(m[2]) > U64_MAX:
        raise CommandError("ERR invalid cursor")
    n = int(m[2])
    return (-n) & U64_MAX if m[1] == b"-" else n


def options(args: list[bytes], spec: Mapping[bytes, Callable[[bytes], Any]]) -> dict[bytes, Any]:
    """`NAME value` pairs (names case-insensitive, a name given twice: the last wins), each
    value read by its name's reader; an unknown name or a missing value is a syntax error."""
    if len(args) % 2:
        raise CommandError(SYNTAX_ERROR)
    out: dict[bytes, Any] = {}
    for i in range(0, len(args), 2):
        name = args[i].lower()
        read = spec.get(name)
        if read is None:
            raise CommandError(SYNTAX_ERROR)
        out[name] = read(args[i + 1])
    return out


def text(raw: bytes) -> str:
    """A value read as text (options whose value is a word)."""
    return raw.decode(errors="replace")


def as_is(raw: bytes) -> bytes:
    return raw
