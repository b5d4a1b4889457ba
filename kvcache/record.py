"""The replica's record format, shared by the replica, its readers and the feed's fast lane.

A record is `revision u64 | created_ns u64 | full_key_len u32 | [full key] | value`, stored
under the key itself. LMDB keys are at most 511 bytes while NATS keys may be longer, so a long
key is stored under `NUL '#' sha256(key)` (NUL never occurs in a NATS subject) and its full
text rides in the record (full_key_len > 0). ext/natsproto.pyx builds records for the feed's
fast lane in C and must agree with this module; tests/test_natsproto.py checks that it does.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

RECORD = struct.Struct("<QQI")
MAX_LMDB_KEY = 511
LONG_KEY_PREFIX = b"\x00#"


@dataclass(slots=True)
class Record:
    key: str
    value: bytes
    revision: int
    created: int


def is_long(raw: bytes) -> bool:
    """Must this key be stored under a digest?"""
    return len(raw) > MAX_LMDB_KEY or raw[:1] == b"\x00"


def lkey_of(raw: bytes) -> bytes:
    """The LMDB key for a NATS key's bytes: itself, or a digest when it is too long."""
    return LONG_KEY_PREFIX + hashlib.sha256(raw).digest() if is_long(raw) else raw


def lmdb_key(key: str) -> bytes:
    """The LMDB key a NATS key is stored under: itself, or a digest when it is too long."""
    return lkey_of(key.encode())


def encode_record(key_bytes: bytes, lkey: bytes, value: bytes, revision: int, created: int) -> bytes:
    if lkey is key_bytes or lkey == key_bytes:
        return RECORD.pack(revision, created, 0) + value
    return RECORD.pack(revision, created, len(key_bytes)) + key_bytes + value


Item = tuple  # (LMDB key, record), or (LMDB key, None) for a delete


def item(key: bytes, value: bytes | None, revision: int, created: int) -> Item:
    """What one delivered KV message does to the replica: store a record (a PUT), or remove
    the key (value None: DEL, PURGE or a server marker). The fast lane builds the same in C."""
    if is_long(key):
        lk = LONG_KEY_PREFIX + hashlib.sha256(key).digest()
        return lk, None if value is None else RECORD.pack(revision, created, len(key)) + key + value
    return key, None if value is None else RECORD.pack(revision, created, 0) + value


def decode_record(lkey: bytes, raw: bytes) -> Record:
    revision, created, klen = RECORD.unpack_from(raw)
    start = RECORD.size
    if klen:
        key = raw[start : start + klen].decode()
        start += klen
    else:
        key = lkey.decode()
    return Record(key, raw[start:], revision, created)


def decode_key(lkey: bytes, raw: bytes) -> str:
    if not lkey.startswith(LONG_KEY_PREFIX):
        return lkey.decode()
    _, _, klen = RECORD.unpack_from(raw)
    return raw[RECORD.size : RECORD.size + klen].decode()
