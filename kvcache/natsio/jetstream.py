"""The JetStream JSON API as kvcache uses it (ADR-1), and the wire details it depends on.

We speak the API directly rather than through nats-py's JetStream context: the feed needs
consumer settings nats-py's helpers do not expose together (pull, AckNone, several filters,
explicit start sequence), and the router needs raw Direct Get replies with their status.
"""
from __future__ import annotations

import calendar
import json
import re
from typing import Any

import nats.errors
from nats.aio.client import Client as NATS

from ..errors import BucketNotFound, UpstreamError
from .natsproto import decode_headers, status_headers

STREAM_NOT_FOUND = 10059


def api_prefix(domain: str | None = None) -> str:
    return f"$JS.{domain}.API" if domain else "$JS.API"


async def api_request(nc: NATS, subject: str, payload: dict[str, Any] | None,
                      timeout: float) -> dict[str, Any]:
    """One JSON API call; an error document becomes UpstreamError with its description."""
    data = json.dumps(payload, separators=(",", ":")).encode() if payload is not None else b""
    try:
        msg = await nc.request(subject, data, timeout=timeout)
    except nats.errors.NoRespondersError:
        raise UpstreamError(f"no JetStream responders for {subject} (is JetStream enabled?)") from None
    except nats.errors.TimeoutError:
        raise UpstreamError(f"JetStream API timed out: {subject}") from None
    except nats.errors.Error as e:
        raise UpstreamError(f"JetStream API failed: {subject}: {e}") from None
    try:
        doc = json.loads(msg.data)
    except ValueError:
        raise UpstreamError(f"JetStream API returned invalid JSON for {subject}") from None
    err = doc.get("error")
    if err:
        raise ApiError(err.get("code", 0), err.get("err_code", 0), err.get("description", "error"))
    return doc


class ApiError(UpstreamError):
    """A JetStream API request answered with an error (its code and description kept)."""

    def __init__(self, code: int, err_code: int, description: str) -> None:
        super().__init__(f"{description} (code {code}, err_code {err_code})")
        self.code = code
        self.err_code = err_code
        self.description = description


class NoLeader(UpstreamError):
    """A clustered stream's STREAM.INFO answered while its group has no leader."""


async def stream_info(nc: NATS, stream: str, timeout: float, prefix: str = "$JS.API", *,
                      need_leader: bool = False) -> dict[str, Any]:
    """`need_leader`: the answer must come from the stream's leader. While a clustered stream
    has no leader, every member answers from its own store, and a member restarted a moment
    ago may be many writes behind: its state is no ground for a plan (raises NoLeader)."""
    try:
        info = await api_request(nc, f"{prefix}.STREAM.INFO.{stream}", None, timeout)
    except ApiError as e:
        if e.err_code == STREAM_NOT_FOUND or e.code == 404:
            raise BucketNotFound(f"stream {stream} not found") from None
        raise
    if need_leader and info.get("cluster") is not None and not stream_leader(info):
        raise NoLeader(f"stream {stream} has no leader yet")
    return info


def stream_leader(info: dict[str, Any]) -> str:
    """The server leading a stream or consumer ('' when none is known), from its info."""
    return (info.get("cluster") or {}).get("leader") or ""


def misplaced(consumer: dict[str, Any], stream: dict[str, Any]) -> str | None:
    """Why a consumer may not see the stream as its leader does, or None when it does.

    nats-server puts an R1 consumer on a random active replica of the stream, and the
    consumer reads that replica's store; a replica catching up after a restart may be
    thousands of writes behind, yet its consumer reports nothing pending. Outside a cluster
    (no cluster info) the one server holds the stream."""
    if consumer.get("cluster") is None:
        return None
    host, leader = stream_leader(consumer), stream_leader(stream)
    if not leader:
        return "the stream has no leader"
    if host != leader:
        return f"placed on {host or 'no server'}, not on the stream leader {leader}"
    return None


def kv_stream(bucket: str) -> str:
    return f"KV_{bucket}"


def kv_subject(bucket: str, key: str) -> str:
    return f"$KV.{bucket}.{key}"


# ---------------------------------------------------------------------------- times and headers

_GO_TIME = re.compile(r"^(\d{4})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(?:\.(\d{1,9}))?\s*(Z|[+-]\d\d:?\d\d)?", re.ASCII)


def parse_time_ns(text: str) -> int:
    """Nanoseconds since the epoch from Go's `2022-08-06 00:29:27.587861324 +0000 UTC`
    (Direct Get's Nats-Time-Stamp) or RFC 3339 (the JSON API); 0 when unparseable."""
    m = _GO_TIME.match(text.strip())
    if not m:
        return 0
    y, mo, d, h, mi, s, frac, tz = m.groups()
    if not (1 <= int(mo) <= 12 and 1 <= int(d) <= 31):
        return 0  # timegm would raise on a month 13 and count a day 0 as the month's last
    secs = calendar.timegm((int(y), int(mo), int(d), int(h), int(mi), int(s), 0, 0, 0))
    if tz and tz != "Z":
        sign = 1 if tz[0] == "+" else -1
        tzd = tz[1:].replace(":", "")
        secs -= sign * (int(tzd[:2]) * 3600 + int(tzd[2:]) * 60)
    return secs * 1_000_000_000 + int((frac or "0").ljust(9, "0"))


def parse_header_block(raw: bytes) -> dict[str, str]:
    """`NATS/1.0 [status [desc]]\r\nName: value\r\n...` as a dict, as nats-py shows headers
    (status under `Status`, its text under `Description`); the wire reader's own rules."""
    status, desc, headers, _ = decode_headers(raw)
    return status_headers(status, desc, headers)
