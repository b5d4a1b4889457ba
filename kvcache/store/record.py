"""The replica's record format, shared by the replica, its readers and the feed's fast lane.

A record is `revision u64 | created_ns u64 | flags+full_key_len u32 | [expires_ns u64] |
[full key] | value` (little-endian), stored under the key itself. LMDB keys are at most 511
bytes while NATS keys may be longer, so a long key is stored under `NUL '#' sha256(key)` (NUL
never occurs in a NATS subject) and its full text rides in the record (full_key_len > 0).

Expiry is data: a message put with a `Nats-TTL` header (ADR-43, per-message TTL) is removed by
the server when its TTL passes, with no message the feed could follow, so its record carries
the moment (FLAG_TTL set in the u32, `expires_ns` after the header; NEVER for `Nats-TTL:
never`, which the stream's max_age does not remove either). The bucket's max_age is applied at
read time from `created_ns` (see `deadline`): it can change, a stored copy could not follow.
Every reader asks `live_value`/`deadline`, so an expired record is absent at once, whatever
the sweep that removes it later has done.

ext/natsproto.pyx builds records for the feed's fast lane in C, and ext/server_get.pyx and
ext/app_get.pyx read them in C; they must agree with this module (tests/test_natsproto.py,
tests/test_server_get.py and tests/test_app_reader.py check that they do).
"""
from __future__ import annotations

import hashlib
import struct
import time
from dataclasses import dataclass
from typing import TypeVar

from .msgttl import expires_at
from .msgttl import parse_msg_ttl as parse_msg_ttl  # its readers import it from here

RECORD = struct.Struct("<QQI")
EXPIRES = struct.Struct("<Q")
MAX_LMDB_KEY = 511
LONG_KEY_PREFIX = b"\x00#"
FLAG_TTL = 0x8000_0000      # in the u32: an expires_ns field follows the header
KLEN_MASK = 0x7FFF_FFFF
NEVER = 0xFFFF_FFFF_FFFF_FFFF  # expires_ns of `Nats-TTL: never`: exempt from max_age too
# FLAG_TTL as the byte it lives in (the u32 is little-endian: its top byte is the record's 20th):
# `raw[TTL_BYTE] >= TTL_BIT` is `has_ttl(raw)`, spelled out where a call costs too much
# (ext/server_get.pyx and ext/app_get.pyx name the same byte and bit)
TTL_BYTE = 19
TTL_BIT = 0x80


def has_ttl(raw: bytes | memoryview) -> bool:
    """Does this stored record carry an expiry of its own (FLAG_TTL: an expires_ns field)?"""
    return raw[TTL_BYTE] >= TTL_BIT


@dataclass(slots=True)
class Record:
    """A replica record decoded: the key, its value, revision (stream sequence) and creation time."""

    key: str
    value: bytes
    revision: int
    created: int
    expires: int = 0  # its own TTL's moment (ns), NEVER for `Nats-TTL: never`, 0 for none


def is_long(raw: bytes) -> bool:
    """Must this key be stored under a digest?"""
    return len(raw) > MAX_LMDB_KEY or raw[:1] == b"\x00"


def lkey_of(raw: bytes) -> bytes:
    """The LMDB key for a NATS key's bytes: itself, or a digest when it is too long."""
    return LONG_KEY_PREFIX + hashlib.sha256(raw).digest() if is_long(raw) else raw


def lmdb_key(key: str) -> bytes:
    """The LMDB key a NATS key is stored under: itself, or a digest when it is too long."""
    return lkey_of(key.encode())


def encode_record(key_bytes: bytes, lkey: bytes, value: bytes, revision: int, created: int,
                  ttl_ns: int = 0) -> bytes:
    """`ttl_ns`: the message's own TTL (0 none, -1 never; see parse_msg_ttl)."""
    full = b"" if lkey is key_bytes or lkey == key_bytes else key_bytes
    if not ttl_ns:
        return RECORD.pack(revision, created, len(full)) + full + value
    expires = NEVER if ttl_ns < 0 else expires_at(created, ttl_ns)
    return RECORD.pack(revision, created, len(full) | FLAG_TTL) + EXPIRES.pack(expires) + full + value


# A stored record as read: bytes, or a memoryview into the map (MGET's read transaction)
Raw = TypeVar("Raw", bytes, memoryview)


def value_offset(raw: bytes | memoryview) -> int:
    """Where the value starts in a record."""
    klen = RECORD.unpack_from(raw)[2]
    if klen & FLAG_TTL:
        return RECORD.size + 8 + (klen & KLEN_MASK)
    return RECORD.size + klen


def deadline(raw: bytes | memoryview, max_age_ns: int = 0) -> int:
    """When the record leaves the bucket (wall-clock ns), 0 for never: its own TTL, else the
    bucket's max_age counted from its creation, whichever comes first (`expiry`)."""
    _, created, klen = RECORD.unpack_from(raw)
    expires = EXPIRES.unpack_from(raw, RECORD.size)[0] if klen & FLAG_TTL else 0
    return expiry(created, expires, max_age_ns)


def live_value(raw: Raw, now_ns: int, max_age_ns: int = 0) -> Raw | None:
    """The record's value, or None once it has expired (see deadline)."""
    if raw[TTL_BYTE] < TTL_BIT and not max_age_ns:
        return raw[RECORD.size + RECORD.unpack_from(raw)[2]:]
    due = deadline(raw, max_age_ns)
    if due and now_ns >= due:
        return None
    return raw[value_offset(raw):]


def stored_value(raw: Raw, offset: int | None, max_age_ns: int) -> Raw | None:
    """The value a record read through a plan (kvcache.read.policy.Plan) answers with: from
    `offset` (None: after the record's own key), or None once expired (see deadline). The
    GET path's twin (kvcache.serve.server_get), MGET and EXISTS (kvcache.read.reads) and LocalReader's
    twin (kvcache.app.app_get) read records this one way."""
    if raw[TTL_BYTE] >= TTL_BIT or max_age_ns:
        return live_value(raw, time.time_ns(), max_age_ns)
    return raw[offset:] if offset is not None else raw[RECORD.size + RECORD.unpack_from(raw)[2]:]


Item = tuple  # (LMDB key, record), or (LMDB key, None) for a delete


def item(key: bytes, value: bytes | None, revision: int, created: int, ttl_ns: int = 0) -> Item:
    """What one delivered KV message does to the replica: store a record (a PUT), or remove
    the key (value None: DEL, PURGE or a server marker). `ttl_ns` as in encode_record. The
    fast lane builds the same in C (and calls this for long keys and messages with a TTL)."""
    lk = lkey_of(key)
    return lk, None if value is None else encode_record(key, lk, value, revision, created, ttl_ns)


def decode_record(lkey: bytes, raw: bytes) -> Record:
    revision, created, klen = RECORD.unpack_from(raw)
    start = RECORD.size
    expires = 0
    if klen & FLAG_TTL:
        expires = EXPIRES.unpack_from(raw, start)[0]
        start += 8
        klen &= KLEN_MASK
    if klen:
        key = raw[start : start + klen].decode()
        start += klen
    else:
        key = lkey.decode()
    return Record(key, raw[start:], revision, created, expires)


def expiry(created: int, expires: int, max_age_ns: int) -> int:
    """When a key leaves the bucket (ns), 0 for never, from its creation, its own TTL's moment
    (`expires` as Record.expires: 0 none, NEVER for `Nats-TTL: never`) and the bucket's
    max_age: the one rule `deadline` (a raw record), the near cache, TTL and the router's
    floors (decoded records and entries read from NATS) all apply."""
    if expires == NEVER:
        return 0
    if expires:
        return min(expires, created + max_age_ns) if max_age_ns else expires
    return created + max_age_ns if max_age_ns else 0


def decode_key(lkey: bytes, raw: bytes) -> str:
    if not lkey.startswith(LONG_KEY_PREFIX):
        return lkey.decode()
    _, _, klen = RECORD.unpack_from(raw)
    start = RECORD.size + (8 if klen & FLAG_TTL else 0)
    return raw[start : start + (klen & KLEN_MASK)].decode()
