"""Data and socket helpers shared by the sidecar tests: putting keys, reading raw replies, seeding buckets."""
from __future__ import annotations

import asyncio
import socket

from kvcache.app.client import Client
from support.topology import nats_run


async def _put_all(kv, items: dict[str, bytes]) -> None:
    pairs = list(items.items())
    for i in range(0, len(pairs), 200):
        await asyncio.gather(*(kv.put(k, v) for k, v in pairs[i:i + 200]))


async def change(kv, key: str, op: str, value: bytes | None = None) -> int | None:
    """One change of a key through nats-py's KV (`op`: put, delete or purge); a put's
    revision (a delete's or purge's: the stream's last sequence, which the caller asks)."""
    if op == "put":
        return await kv.put(key, value)
    if op == "delete":
        await kv.delete(key)
    else:
        await kv.purge(key)
    return None


def read_until(s: socket.socket, until: bytes | None) -> bytes:
    """Read until `until` is in what was read, or EOF when `until` is None."""
    got = b""
    while until is None or until not in got:
        chunk = s.recv(65536)
        if not chunk:
            break
        got += chunk
    return got



BIG = b"B" * (512 * 1024)


def key(i: int) -> str:
    return f"{i:012d}"  # what redis-benchmark -r generates after `key:`


def seed_bucket(url: str, values: dict[str, bytes]) -> str:
    """Bucket `key` (Direct Get on) holding `values`, plus `out.remote` (outside the sidecars'
    single-token filter: a remote read) and `big` (512 KiB); returns `url`."""
    async def setup(js):
        kv = await js.create_key_value(bucket="key", direct=True)
        await _put_all(kv, values)
        await kv.put("out.remote", b"remote value")
        await kv.put("big", BIG)
    nats_run(url, setup)
    return url


def info(sock: str, section: str = "stats") -> dict:
    with Client(sock) as c:
        return c.info(section)[section]


def connect(sock: str, timeout: float = 10) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(timeout)
    s.connect(sock)
    return s


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def kv_put(url: str, bucket: str, key: str, value: bytes, ttl: str | None = None) -> int:
    """One PUT with nats-py (with a `Nats-TTL` header when `ttl` is given); its revision."""
    async def fn(js):
        if ttl is not None:
            return (await js.publish(f"$KV.{bucket}.{key}", value, headers={"Nats-TTL": ttl})).seq
        return await (await js.key_value(bucket)).put(key, value)
    return nats_run(url, fn)


def kv_delete(url: str, bucket: str, key: str, purge: bool = False) -> None:
    """DEL (or PURGE) of one key with nats-py."""
    async def fn(js):
        kv = await js.key_value(bucket)
        await (kv.purge(key) if purge else kv.delete(key))
    nats_run(url, fn)
