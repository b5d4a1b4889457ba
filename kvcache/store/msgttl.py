"""A message's own TTL (ADR-43, the `Nats-TTL` header), read exactly as nats-server reads it.

A key put with a TTL is removed by the server when it passes, with no message the feed could
follow, so the replica must know the deadline the server keeps: a TTL read differently is a
key served past its removal (or missing before it). nats-server (server/stream.go,
getMessageTTL and parseMessageTTL; checked against a live server by
tests/test_twin_agreement.py) reads it so:

- the header: the first line named exactly `Nats-TTL` (case-sensitive, the ':' right after
  the name), its value after any spaces (not tabs), up to the CRLF, trailing bytes kept (and
  the server's search quirk, `ttl_header`);
- an empty value: no TTL of its own; `never` in any case: never expires (not even by the
  stream's max_age);
- a Go duration (time.ParseDuration: an optional sign, then numbers with an optional
  fraction, each with a unit `ns`, `us`, `µs` (U+00B5), `μs` (U+03BC), `ms`, `s`, `m`, `h`; ASCII
  digits only; 64-bit overflow refused): at least 1 s, truncated to whole seconds;
- else a count of seconds: ASCII digits only, accumulated in a signed 64-bit integer that
  wraps (20 digits can wrap to a small TTL), refused when negative.

Anything else (`0`, `0.5s`, `-5s`, `5s ` with its trailing space, `²`, other digits) nats-server
refuses: the put fails, so no stream holds such a message unless a server before 2.11 took
it, ignoring the header; nats-server's own store then reads it as no TTL. So does the replica
(`parse_msg_ttl` returns 0) and says so once in the log, since it also means a value this
module reads differently from the server. The deadline is the message's timestamp plus the
TTL in the server's int64 nanoseconds (`expires_at`): where that overflows the server removes
the message at once, and the replica holds it as expired.

Both twins of the NATS reader (kvcache/natsio/natsproto.py, ext/natsproto.pyx) take the TTL
from here, the native one by finding the same header line in C.
"""
from __future__ import annotations

import logging

log = logging.getLogger("kvcache.feed")

NAME = b"Nats-TTL"
_SEC = 1_000_000_000
_I64_MAX = (1 << 63) - 1
_U64 = (1 << 64) - 1
# time.ParseDuration's units, as their UTF-8 bytes (Go compares a unit's bytes)
_UNITS = {b"ns": 1, b"us": 1_000, "\u00b5s".encode(): 1_000, "\u03bcs".encode(): 1_000,
          b"ms": 1_000_000, b"s": _SEC, b"m": 60 * _SEC, b"h": 3600 * _SEC}
_warned = False


def ttl_header(block: bytes) -> bytes | None:
    """The `Nats-TTL` value nats-server reads in a `NATS/1.0` header block (module docstring),
    or None when it finds none: getHeaderKeyIndex and sliceHeader, step for step. Their
    search for the name resumes after each candidate that is not a line's start or not
    followed by ':', and gives up when the next one lies within 2 bytes of where it resumed
    (`X: Nats-TTLNats-TTL` in a value hides a later `Nats-TTL:` line from the server)."""
    n = len(block)
    offset = 0
    while True:
        i = block.find(NAME, offset)
        if i < 0 or i - offset < 2:
            return None
        if block[i - 1] != 10 or block[i - 2] != 13:
            offset = i + len(NAME)
            continue
        if i + len(NAME) >= n:
            return None
        if block[i + len(NAME)] != 58:  # ':'
            offset = i + len(NAME)
            continue
        break
    s = i + len(NAME) + 1
    while s < n and block[s] == 32:
        s += 1
    e = block.find(b"\r\n", s)
    return block[s:e if e >= 0 else n]


def go_duration(s: bytes) -> int | None:
    """Go's time.ParseDuration, in ns, or None where it fails: the same steps in the same
    integer and float arithmetic, so the same result to the nanosecond."""
    neg = False
    if s[:1] in (b"-", b"+"):
        neg = s[:1] == b"-"
        s = s[1:]
    if s == b"0":
        return 0
    if not s:
        return None
    d = 0
    i, n = 0, len(s)
    while i < n:
        c = s[i]
        if not (c == 46 or 48 <= c <= 57):  # the next character must be [0-9.]
            return None
        v = 0
        first = i
        while i < n and 48 <= s[i] <= 57:  # leadingInt: overflow past 2**63 is an error
            if v > (1 << 63) // 10:
                return None
            v = v * 10 + s[i] - 48
            if v > 1 << 63:
                return None
            i += 1
        pre = i != first
        f, scale, post = 0, 1.0, False
        if i < n and s[i] == 46:  # leadingFraction: overflow stops adding precision
            i += 1
            first = i
            overflow = False
            while i < n and 48 <= s[i] <= 57:
                if not overflow:
                    if f > _I64_MAX // 10:
                        overflow = True
                    else:
                        y = f * 10 + s[i] - 48
                        if y > 1 << 63:
                            overflow = True
                        else:
                            f = y
                            scale *= 10
                i += 1
            post = i != first
        if not pre and not post:
            return None
        first = i
        while i < n and not (s[i] == 46 or 48 <= s[i] <= 57):
            i += 1
        unit = _UNITS.get(s[first:i]) if i != first else None
        if unit is None:
            return None
        if v > (1 << 63) // unit:
            return None
        v *= unit
        if f > 0:
            v += int(float(f) * (float(unit) / scale))
            if v > 1 << 63:
                return None
        d = (d + v) & _U64  # a uint64 in Go: 2**63 + 2**63 wraps to 0
        if d > 1 << 63:
            return None
    if neg:
        return -d
    return None if d > _I64_MAX else d


def msg_ttl(value: bytes) -> int | None:
    """nats-server's parseMessageTTL of a header value: seconds (0: none of its own), -1 for
    never, or None where it refuses the value."""
    if not value:
        return 0
    if value.lower() == b"never":
        return -1
    d = go_duration(value)
    if d is not None:
        if d < _SEC:
            return None
        sec, nsec = divmod(d, _SEC)
        return int(float(sec) + float(nsec) / 1e9)  # int64(Duration.Seconds())
    t = 0
    for c in value:  # parseInt64: ASCII digits, an int64 that wraps
        if not 48 <= c <= 57:
            return None
        t = (t * 10 + c - 48) & _U64
    return None if t > _I64_MAX else t


def parse_msg_ttl(value: str | bytes | None) -> int:
    """A message's own TTL in ns, for kvcache.store.record: -1 for never, 0 for none (no
    header, an empty value, or one nats-server refuses: logged once). A str is read as its
    UTF-8 bytes; leading spaces are skipped, as nats-server skips them."""
    global _warned
    if value is None:
        return 0
    raw = value.encode("utf-8", "replace") if isinstance(value, str) else bytes(value)
    seconds = msg_ttl(raw.lstrip(b" "))
    if seconds is None:
        if not _warned:
            _warned = True
            log.warning("a message's Nats-TTL %r is not one nats-server takes (a put from a server "
                        "before 2.11?): kept with no TTL of its own, as nats-server keeps it "
                        "(logged once)", raw[:64])
        return 0
    return -1 if seconds < 0 else seconds * _SEC


def expires_at(created: int, ttl_ns: int) -> int:
    """When a message created at `created` (ns) with this TTL (ns, > 0) leaves the stream:
    nats-server's `ts + ttl`, in int64 nanoseconds that wrap; a deadline at or before the
    epoch (the server removes the message at once) is 1, long past."""
    at = (created + ttl_ns) & _U64
    return at if 0 < at <= _I64_MAX else 1
