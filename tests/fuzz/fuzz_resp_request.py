"""Fuzz harness: the server's RESP request reader, ext/resp.pyx against kvcache/resp.py.

The options byte picks the limits (bits 0-1, LIMITS) and how the reader is driven (bits 2-3):
0, `next_command` alone (the generic path); 1, the server's loop (ClientConnection._process
with the GET fast path: `take_gets` first, each GET kept only when its declared length is its
key's, rewound to the first that is not, or past the first the fast path cannot answer, here
a key starting with `r`); 2, the same with the choice bytes saying how many of each run to keep
(any count a caller may pass); 3, the same with a count one outside that range either way, a
caller's mistake, which both twins must meet alike (ProtocolError or ValueError).
"""
from __future__ import annotations

from types import ModuleType
from typing import Any

from harness import Case, Raised, decode, differential, encode, native_module
from support.resp_vectors import LIMIT_VECTORS, MB, REQUEST_VECTORS

from kvcache import resp as twin
from kvcache.errors import ProtocolError

LIMITS: list[dict[str, int]] = [{}, {"max_request_bytes": 1 << 16, "max_args": 1000},
                                {"max_request_bytes": 100, "max_args": 10}, {"max_request_bytes": 40, "max_args": 3}]
COMMANDS, SERVER, CHOSEN, WRONG = range(4)
native: ModuleType | None = None


def setup() -> None:
    global native
    native = native_module("resp")


def caught(e: ProtocolError) -> Raised:
    return Raised(f"{type(e).__module__}.{type(e).__qualname__}", str(e))


def run(mod: ModuleType, chunks: list[bytes], case: Case) -> tuple[list, Raised | None, int, bool]:
    """Every command (and fast-path GET) in order, the protocol error that ended them, what
    stayed buffered and whether the reader is idle."""
    limits = LIMITS[case.options & 3]
    mode = (case.options >> 2) & 3
    reader = mod.RequestReader(**limits)
    out: list = []
    runs = 0
    steps = 4 * sum(map(len, chunks)) + 16  # each call consumes input or says "not yet"
    try:
        for chunk in chunks:
            reader.feed(chunk)
            while True:
                steps -= 1
                if steps < 0:
                    if mode != WRONG:
                        raise AssertionError("the reader makes no progress")
                    out.append(("no progress",))  # a wrong rewind may go back for ever
                    return out, None, reader.buffered, reader.idle()
                if mode != COMMANDS and (got := reader.take_gets()) is not None:
                    lengths, keys, start = got
                    runs += 1
                    if mode == SERVER:
                        keep = len(keys)
                        for i, (declared, key) in enumerate(zip(lengths, keys, strict=True)):
                            if declared != twin.GET_LEN[len(key)]:
                                keep = i
                                break
                            if key.startswith(b"r"):  # a key the generic path answers
                                keep = i + 1
                                out.append(("slow", key))
                                break
                            out.append(("fast", key))
                    elif mode == CHOSEN:
                        keep = case.choice(runs, len(keys) + 1)
                        out.append(("fast", keys[:keep]))
                    else:
                        keep = -1 if case.choice(runs, 2) == 0 else len(keys) + 1
                        out.append(("wrong", keep))
                    out.append(("lengths", lengths, start))
                    if keep < len(keys) or mode == WRONG:
                        reader.rewind_gets(start, lengths, keys, keep)
                    else:
                        continue
                args = reader.next_command()
                if args is None:
                    break
                out.append(("cmd", args))
    except ProtocolError as e:
        return out, caught(e), reader.buffered, reader.idle()
    return out, None, reader.buffered, reader.idle()


def whole_as_cut(value: Any) -> Any:
    """Fed whole or cut, the same commands and error. Left free: which GETs the fast path takes
    (a GET cut in two is the full parser's once it has begun it) and, after an error, what
    stays buffered (the reader stops where it found it)."""
    if not isinstance(value, tuple):
        return value
    out, err, buffered, idle = value
    commands = [("cmd", [b"GET", c[1]]) if c[0] in ("fast", "slow") else c for c in out if c[0] != "lengths"]
    return (commands, err) if err is not None else (commands, err, buffered, idle)


def check(data: bytes) -> None:
    case = decode(data)
    mode = (case.options >> 2) & 3
    assert native is not None, "setup() first"
    differential("resp_request", case, lambda mod, chunks: run(mod, chunks, case), native, twin,
                 allowed=(ProtocolError, ValueError) if mode == WRONG else (ProtocolError,),
                 same_whole_as_cut=whole_as_cut if mode in (COMMANDS, SERVER) else None,
                 settings=f"limits {LIMITS[case.options & 3]}, mode {mode}")


def seeds() -> list[bytes]:
    wires = [v[1] for v in REQUEST_VECTORS] + [v[1] for v in LIMIT_VECTORS if len(v[1]) < 4096] + [
        b"*2\r\n$3\r\nGET\r\n$3\r\nfoo\r\n" * 3 + b"*1\r\n$4\r\nPING\r\n",
        b"*2\r\n$3\r\nGET\r\n$03\r\nfoo\r\n*2\r\n$3\r\nGET\r\n$4\r\nrfoo\r\n*2\r\n$3\r\nGET\r\n$1\r\nx\r\n",
        b"*2\r\n$3\r\nGET\r\n$3\r\nf\xffo\r\n*2\r\n$3\r\nget\r\n$1\r\nx\r\n" + MB,
        b"*3\r\n$4\r\nMGET\r\n$1\r\na\r\n$1\r\nb\r\nGET a\r\n",
    ]
    out = []
    for wire in wires:
        for options in (0, 1 << 2, 2 << 2, 2 | 1 << 2):
            out.append(encode(wire, options))
        out.append(encode(wire, 1 << 2, bytes([3, 0, 7])))
    return out


DICTIONARY = [b"\r\n", b"*2\r\n$3\r\nGET\r\n", b"$3\r\nGET\r\n", b"GET", b"get", b"MGET", b"PING", b"*1\r\n",
              b"*-1\r\n", b"$-1\r\n", b"$0\r\n\r\n", b'"', b"'", b"\\x41", b"\\\"", b"9223372036854775807",
              b"9223372036854775808", b"18446744073709551616", b"-9223372036854775808", b"65536", b"$01\r\n"]
