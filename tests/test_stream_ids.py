"""Stream IDs of the `@<bucket>` streams (kvcache.serve.stream_ids): Redis's grammar and
errors (docs/sources.md, "Redis stream IDs"), and the revisions an ID bound selects
when every entry's ID is `<revision>-0`."""
from __future__ import annotations

import pytest

from kvcache.errors import CommandError
from kvcache.serve.stream_ids import BAD_END, BAD_START, INVALID, U64, after, interval, parse


def test_parse_as_redis_string2ull():
    assert parse(b"5-3", 0) == (5, 3)
    assert parse(b"5", 7) == (5, 7)
    assert parse(b"01-1", 0) == (1, 1)
    assert parse(b"+5", 0) == (5, 0)
    assert parse(b"18446744073709551615-18446744073709551615", 0) == (U64, U64)
    for bad in (b"-1", b"1-", b"1-x", b"1-1-1", b"18446744073709551616", b"", b"x", b"1" * 128):
        with pytest.raises(CommandError, match=INVALID):
            parse(bad, 0)


def test_interval_in_revisions():
    assert interval(b"-", b"+") == (0, U64)
    assert interval(b"5", b"9") == (5, 9)          # 5-0 .. 9-max
    assert interval(b"5-1", b"9-0") == (6, 9)      # 5-1 excludes 5-0; 9-0 includes it
    assert interval(b"(5-0", b"+") == (6, U64)     # exclusive start
    assert interval(b"-", b"(9-0") == (0, 8)       # exclusive end: 8-max
    assert interval(b"-", b"(9-4") == (0, 9)       # 9-3 still includes 9-0
    assert interval(b"(5", b"(5") == (6, 5)        # empty: 5-1 .. 5-(max-1)
    with pytest.raises(CommandError, match=BAD_START):
        interval(f"({U64}-{U64}".encode(), b"+")
    with pytest.raises(CommandError, match=BAD_END):
        interval(b"-", b"(0-0")
    for bad in (b"(-", b"(+"):
        with pytest.raises(CommandError, match=INVALID):
            interval(bad, b"+")


def test_after_is_exclusive():
    assert after(b"0") == 0
    assert after(b"5-0") == 5
    assert after(b"5-9") == 5  # entries are n-0: the next one after 5-9 is 6-0
