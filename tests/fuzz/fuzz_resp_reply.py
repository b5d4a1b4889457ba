"""Fuzz harness: the clients' RESP2/RESP3 reply reader, ext/resp.pyx against kvcache/resp.py.

Every reply the chunks hold, as `gets` returns them after each feed (a ReplyError compared
by class and message, a NaN as "nan"), the protocol error that ended them (class and
message), what stayed buffered and `has_data()`. The options byte's bit 0 picks the
not-enough-data value: a sentinel of the caller's, or the default False.
"""
from __future__ import annotations

import math
from types import ModuleType
from typing import Any

from harness import Raised, decode, differential, encode, native_module
from support.resp_vectors import REPLY_VECTORS

from kvcache import resp as twin
from kvcache.errors import ProtocolError

native: ModuleType | None = None
_NONE = object()


def setup() -> None:
    global native
    native = native_module("resp")


def norm(value: object) -> object:
    """A reply in a comparable form: errors by class and message, NaN as "nan"."""
    if isinstance(value, Exception):
        return ("error", f"{type(value).__module__}.{type(value).__qualname__}", str(value))
    if isinstance(value, list):
        return [norm(v) for v in value]
    if isinstance(value, tuple):  # an aggregate as a map's key
        return ("tuple", tuple(norm(v) for v in value))
    if isinstance(value, dict):
        return {norm(k): norm(v) for k, v in value.items()}
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return (type(value).__name__, value)  # True is not 1, b"" is not None


def run(mod: ModuleType, chunks: list[bytes], sentinel: bool) -> tuple[list, Raised | None, int, bool]:
    none = _NONE if sentinel else False
    reader = mod.ReplyReader(_NONE) if sentinel else mod.ReplyReader()
    replies: list = []
    steps = 4 * sum(map(len, chunks)) + 16
    try:
        for chunk in chunks:
            reader.feed(chunk)
            while (reply := reader.gets()) is not none:
                replies.append(norm(reply))
                steps -= 1
                if steps < 0:
                    raise AssertionError("gets() returns replies without consuming input")
    except ProtocolError as e:
        return replies, Raised(f"{type(e).__module__}.{type(e).__qualname__}", str(e)), reader.buffered, \
            reader.has_data()
    return replies, None, reader.buffered, reader.has_data()


def whole_as_cut(value: Any) -> Any:
    """Fed whole or cut, the same replies and error; after an error, what stays buffered may
    differ. (With the default False as the not-enough-data value, a `#f` reply stops the
    caller's loop until the next feed, so that mode is compared native against twin only.)"""
    if not isinstance(value, tuple):
        return value
    replies, err, buffered, has_data = value
    return (replies, err) if err is not None else (replies, err, buffered, has_data)


def check(data: bytes) -> None:
    case = decode(data)
    sentinel = not (case.options & 1)
    assert native is not None, "setup() first"
    differential("resp_reply", case, lambda mod, chunks: run(mod, chunks, sentinel), native, twin,
                 allowed=(ProtocolError,), same_whole_as_cut=whole_as_cut if sentinel else None,
                 settings=f"not-enough-data value: {'a sentinel' if sentinel else 'False'}")


def seeds() -> list[bytes]:
    wires = [v[1] for v in REPLY_VECTORS] + [
        b"%2\r\n+a\r\n:1\r\n$1\r\nb\r\n*1\r\n_\r\n|1\r\n+t\r\n:3\r\n=7\r\ntxt:abc\r\n",
        b"%1\r\n*2\r\n:1\r\n:2\r\n+v\r\n%2\r\n+k\r\n:1\r\n+k\r\n:2\r\n",
        b":9999999999999999999\r\n:-9999999999999999999\r\n:-9223372036854775808\r\n(-123456789012345678901\r\n",
        b">3\r\n+message\r\n+ch\r\n$1\r\nx\r\n~1\r\n#t\r\n",
        b"%1\r\n*2\r\n-ERR k\r\n_\r\n:1\r\n",  # a key holding an error: compared by value
    ]
    out = []
    for wire in wires:
        out += [encode(wire), encode(wire, 1), encode(wire, 0, bytes([2, 0, 5]))]
    return out


DICTIONARY = [b"\r\n", b"*", b"$", b"%", b"~", b">", b"|", b"(", b"=", b"!", b",", b"#t", b"#f", b"_\r\n", b":",
              b"+OK\r\n", b"-ERR ", b"txt:", b"$-1\r\n", b"*-1\r\n", b",inf", b",-inf", b",nan", b"1e308",
              b"9223372036854775807", b"9223372036854775808", b"-9223372036854775808", b"4611686018427387904",
              b"18446744073709551616", b"2147483648"]
