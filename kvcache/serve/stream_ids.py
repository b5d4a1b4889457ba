"""Redis stream IDs as the `@<bucket>` streams take them (kvcache.serve.streams): Redis's
grammar and errors, mapped onto revisions. As Redis reads them, an ID is `<ms>-<seq>`, two
unsigned 64-bit decimals (a leading `+` allowed, at most 127 bytes in all); `<ms>` alone is
an incomplete ID, its sequence 0 as a start and 2^64-1 as an end; XRANGE also takes `-` (the
smallest ID), `+` (the largest) and, since Redis 6.2, `(` before an ID for an exclusive bound.
A malformed ID answers "ERR Invalid stream ID specified as stream command argument"; an
exclusive start at the largest ID, "ERR invalid start ID for the interval", and an exclusive
end at the smallest, "ERR invalid end ID for the interval".

An entry's ID is `<revision>-0`, so an ID bound comes down to a revision bound: an interval
`[start, end]` of IDs holds the entries whose revisions are in `[first, last]`, and "after
`<ms>-<seq>`" (XREAD) means revisions above `ms`.
"""
from __future__ import annotations

from ..errors import CommandError

U64 = (1 << 64) - 1
ID_MAX_LEN = 127

INVALID = "ERR Invalid stream ID specified as stream command argument"
BAD_START = "ERR invalid start ID for the interval"
BAD_END = "ERR invalid end ID for the interval"


def _u64(tok: bytes) -> int | None:
    """Redis's string2ull: decimal digits (an optional `+`), no sign, fits 64 bits."""
    if tok[:1] == b"+":
        tok = tok[1:]
    if not tok or not tok.isdigit():
        return None
    n = int(tok)
    return n if n <= U64 else None


def parse(raw: bytes, missing_seq: int) -> tuple[int, int]:
    """`<ms>-<seq>`, or `<ms>` with `missing_seq` for the sequence."""
    if len(raw) > ID_MAX_LEN:
        raise CommandError(INVALID)
    ms_tok, dash, seq_tok = raw.partition(b"-")
    ms = _u64(ms_tok)
    seq = _u64(seq_tok) if dash else missing_seq
    if ms is None or seq is None:
        raise CommandError(INVALID)
    return ms, seq


def interval(start: bytes, end: bytes) -> tuple[int, int]:
    """XRANGE's `start end` (XREVRANGE takes them the other way round) as the revisions
    `[first, last]` of the entries in it (first > last: none). `-`, `+`, incomplete IDs and
    the exclusive `(` prefix as Redis 6.2+."""
    lo = _bound(start, is_start=True)
    hi = _bound(end, is_start=False)
    first = lo[0] if lo[1] == 0 else lo[0] + 1  # (r, 0) >= (ms, seq) for r >= ms, or r > ms
    return first, hi[0]                         # (r, 0) <= (ms, seq) for r <= ms


def _bound(raw: bytes, is_start: bool) -> tuple[int, int]:
    if raw == b"-":
        return 0, 0
    if raw == b"+":
        return U64, U64
    exclusive = raw[:1] == b"("
    if exclusive:
        raw = raw[1:]
        if raw in (b"-", b"+"):
            raise CommandError(INVALID)
    ms, seq = parse(raw, 0 if is_start else U64)
    if not exclusive:
        return ms, seq
    if is_start:  # the next ID after it
        if seq < U64:
            return ms, seq + 1
        if ms == U64:
            raise CommandError(BAD_START)
        return ms + 1, 0
    if seq > 0:   # the ID before it
        return ms, seq - 1
    if ms == 0:
        raise CommandError(BAD_END)
    return ms - 1, U64


def after(raw: bytes) -> int:
    """XREAD's ID (not `$`, `+` or `>`, which the caller resolves): entries after it are
    those with a revision above the returned one."""
    return parse(raw, 0)[0]


def format_id(revision: int) -> bytes:
    return b"%d-0" % revision
