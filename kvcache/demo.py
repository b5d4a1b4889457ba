"""The demo bucket: what `kvcache serve` with neither a NATS URL nor a bucket replicates, seeded
on the embedded nats-server so that reads work at once. README.md's snippets and
bench/locustfile.py read it (tests/test_readme.py runs both against it), tests/test_embedded.py
checks it: its keys and values are a contract of their own, apart from the wiring in sidecar.py.

DEMO_KEYS user.NNNN records, a few feature flags, and DEMO_HOT_KEYS hot.NNNNNN / DEMO_COLD_KEYS
cold.NNNNNN keys holding demo_value(key), the 100-byte values bench/compare.py writes and the
locustfile checks."""
from __future__ import annotations

import asyncio
import logging

import nats.js.errors
import nats.js.kv

from .errors import BucketNotFound
from .natsio import jetstream as jsapi
from .natsio.nats_connection import NatsConnection

log = logging.getLogger("kvcache")

DEMO_BUCKET = "demo"
DEMO_KEYS = 100
DEMO_HOT_KEYS = 100
DEMO_COLD_KEYS = 100
DEMO_FLAGS = {"feature.checkout": b'{"enabled":true,"rollout":0.25}', "feature.search": b'{"enabled":false}'}


def demo_value(key: str) -> bytes:
    """A hot.*/cold.* key's value in the demo bucket (bench/compare.py's value_of)."""
    return (b"value-" + key.encode() + b"-").ljust(100, b"x")


def demo_entries() -> dict[str, bytes]:
    """Every key the demo bucket is seeded with, and its value."""
    entries = {"greeting": b"hello from kvcache"}
    entries.update((f"user.{i:04d}", f'{{"id":{i},"name":"user {i}"}}'.encode()) for i in range(DEMO_KEYS))
    entries.update(DEMO_FLAGS)
    for prefix, n in (("hot.", DEMO_HOT_KEYS), ("cold.", DEMO_COLD_KEYS)):
        entries.update((f"{prefix}{i:06d}", demo_value(f"{prefix}{i:06d}")) for i in range(n))
    return entries


async def ensure_demo_bucket(nc: NatsConnection, timeout: float) -> None:
    """First run on the embedded server: the DEMO_BUCKET bucket with the sample keys. A demo
    bucket made by an older kvcache (without the last key seeded now) gets the missing keys;
    one that has them is left as it is (keys the user changed stay changed)."""
    js = nc.jetstream(timeout=timeout)
    entries = demo_entries()
    try:
        await jsapi.stream_info(nc, jsapi.kv_stream(DEMO_BUCKET), timeout)
    except BucketNotFound:
        kv = await js.create_key_value(bucket=DEMO_BUCKET, history=5, direct=True,
                                       description="kvcache demo bucket")
    else:
        kv = await js.key_value(DEMO_BUCKET)
        try:
            await kv.get(next(reversed(entries)))
            return
        except nats.js.errors.KeyNotFoundError:
            entries = {k: v for k, v in entries.items() if not await _has(kv, k)}
    # concurrently, in batches: a few hundred puts in well under a second
    items = list(entries.items())
    for i in range(0, len(items), 100):
        await asyncio.gather(*(kv.put(k, v) for k, v in items[i:i + 100]))
    log.info("seeded demo bucket '%s' with %d keys", DEMO_BUCKET, len(items))


async def _has(kv: nats.js.kv.KeyValue, key: str) -> bool:
    try:
        await kv.get(key)
        return True
    except nats.js.errors.KeyNotFoundError:  # (a deleted key too: seeded again)
        return False
