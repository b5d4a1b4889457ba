"""kvcache.natsio.jetstream's helpers on their own: the time parser every fallback read goes through,
and the reading of cluster info the feed relies on to trust a consumer."""
from __future__ import annotations

import calendar
from datetime import UTC, datetime, timedelta, timezone

from hypothesis import given
from hypothesis import strategies as st

from kvcache.natsio.jetstream import misplaced, parse_time_ns, stream_leader


def reference_ns(dt: datetime, nanos: int) -> int:
    """calendar.timegm on the UTC time: the arithmetic parse_time_ns replaces."""
    u = dt.astimezone(UTC)
    return calendar.timegm(u.timetuple()) * 1_000_000_000 + nanos


@given(st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30)),
       st.integers(0, 999_999_999), st.integers(-14 * 60, 14 * 60))
def test_go_and_rfc3339_forms_agree_with_timegm(naive: datetime, nanos: int, offset_min: int) -> None:
    tz = timezone(timedelta(minutes=offset_min))
    dt = naive.replace(microsecond=0, tzinfo=tz)
    sign = "+" if offset_min >= 0 else "-"
    hh, mm = divmod(abs(offset_min), 60)
    base = dt.strftime("%Y-%m-%d") if dt.year >= 1000 else f"{dt.year:04d}-{dt.month:02d}-{dt.day:02d}"
    clock = dt.strftime("%H:%M:%S")
    want = reference_ns(dt, nanos)
    go = f"{base} {clock}.{nanos:09d} {sign}{hh:02d}{mm:02d} UTC"        # Nats-Time-Stamp
    rfc = f"{base}T{clock}.{nanos:09d}{sign}{hh:02d}:{mm:02d}"             # the JSON API
    assert parse_time_ns(go) == want
    assert parse_time_ns(rfc) == want


def test_known_values() -> None:
    assert parse_time_ns("1970-01-01T00:00:00Z") == 0
    assert parse_time_ns("2022-08-06 00:29:27.587861324 +0000 UTC") == 1659745767587861324
    assert parse_time_ns("2024-02-29T12:00:00.5Z") == 1709208000500000000   # leap day, short fraction
    assert parse_time_ns("  2000-03-01T00:00:00Z \n") == 951868800 * 1_000_000_000


def test_unparseable_is_zero() -> None:
    for text in ("", "garbage", "2022-08-06", "2022/08/06 00:29:27", "2022-13-06T00:00:00Z",
                 "2022-08-00T00:00:00Z", "\uff12\uff10\uff12\uff12-08-06T00:29:27Z", "2022-08-06T0a:29:27Z",
                 "+022-08-06T00:29:27Z"):
        assert parse_time_ns(text) == 0, text


# ----------------------------------------------------------------------------- cluster info

def test_a_consumer_off_the_stream_leader_is_misplaced() -> None:
    stream = {"cluster": {"name": "hub", "leader": "hub-1", "replicas": [{"name": "hub-0"}, {"name": "hub-2"}]}}
    assert misplaced({"cluster": {"name": "hub", "leader": "hub-1"}}, stream) is None
    assert "hub-0" in misplaced({"cluster": {"name": "hub", "leader": "hub-0"}}, stream)
    assert "no server" in misplaced({"cluster": {"name": "hub"}}, stream)
    # a member answering while the group has no leader: nothing can be trusted
    assert "no leader" in misplaced({"cluster": {"leader": "hub-1"}}, {"cluster": {"name": "hub"}})
    # a single server: no cluster info on the consumer, the one server holds the stream
    assert misplaced({}, {"cluster": {"leader": "single"}}) is None
    assert stream_leader(stream) == "hub-1" and stream_leader({}) == ""
