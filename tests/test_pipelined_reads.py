"""Pipelined reads that must ask NATS are in flight together (kvcache.serve.client_connection), their
replies in request order and equal to the same reads made one at a time.

The sidecar reaches its server through a proxy that records what the sidecar sends and can
hold all traffic (DelayProxy.freeze). With the traffic held, a client pipelines reads of keys
outside the bucket's filters: every one of their Direct Gets must reach the proxy before any
answer could have come back. Before, a connection sent one request per NATS round trip, so
only the first would (the wait below timed out).
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
import redis
from support.poll import wait_until
from support.sidecar_proc import SidecarProcess
from support.topology import DelayProxy, nats_run

pytestmark = pytest.mark.timeout(120)

BUCKET = "pl"
COLD = 100


class _Recording:
    """A StreamReader whose every read is also appended to `into`."""

    def __init__(self, reader: asyncio.StreamReader, into: bytearray) -> None:
        self.reader, self.into = reader, into

    async def read(self, n: int) -> bytes:
        data = await self.reader.read(n)
        self.into += data
        return data


class RecordingProxy(DelayProxy):
    """A DelayProxy that keeps every byte its clients sent (read as it arrives, also while
    frozen: only forwarding waits)."""

    def __init__(self, target_port: int) -> None:
        super().__init__(target_port)
        self.from_client = bytearray()

    async def _accept(self, creader, cwriter) -> None:  # type: ignore[override]
        await super()._accept(_Recording(creader, self.from_client), cwriter)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def sidecar(nats_server_module, tmp_path_factory) -> Iterator[tuple[SidecarProcess, RecordingProxy]]:
    async def setup(js):
        kv = await js.create_key_value(bucket=BUCKET, direct=True)
        for i in range(COLD * 3):
            await kv.put(f"far.{i}", b"far-%d" % i)
        await kv.put("local.0", b"near")
    nats_run(nats_server_module.url, setup)
    proxy = RecordingProxy(nats_server_module.port).start()
    sc = SidecarProcess(tmp_path_factory.mktemp("pipelined") / "sc", proxy.url, buckets=[f"{BUCKET}:local.>"],
                        extra=["--max-stale-ms", "5000"])
    try:
        sc.start(wait_synced=True)
        yield sc, proxy
    finally:
        sc.kill(check=False)
        proxy.stop()
        sc.check_log()


def _pipeline(sc: SidecarProcess, commands: list[tuple]) -> list:
    r = redis.Redis(unix_socket_path=sc.socket, socket_timeout=30)
    try:
        p = r.pipeline(transaction=False)
        for c in commands:
            p.execute_command(*c)
        return p.execute(raise_on_error=False)
    finally:
        r.close()


def _one_by_one(sc: SidecarProcess, commands: list[tuple]) -> list:
    r = redis.Redis(unix_socket_path=sc.socket, socket_timeout=30)
    try:
        out = []
        for c in commands:
            try:
                out.append(r.execute_command(*c))
            except redis.ResponseError as e:
                out.append(e)
        return out
    finally:
        r.close()


def test_pipelined_cold_reads_are_sent_together(sidecar):
    sc, proxy = sidecar
    keys = [f"far.{i}" for i in range(COLD)]
    proxy.freeze()
    start = proxy.from_client.count(b"DIRECT.GET")
    got: list = []
    reader = threading.Thread(target=lambda: got.extend(_pipeline(sc, [("GET", k) for k in keys])))
    reader.start()
    try:
        # every request sent while nothing can have been answered
        wait_until(lambda: proxy.from_client.count(b"DIRECT.GET") - start >= COLD, 20,
                   f"{COLD} Direct Gets sent with none answered",
                   detail=lambda: f"{proxy.from_client.count(b'DIRECT.GET') - start} sent")
    finally:
        proxy.thaw()
        reader.join(60)
    assert got == [b"far-%d" % i for i in range(COLD)]


def test_pipelined_replies_keep_request_order(sidecar):
    """Remote and local reads, an MGET, a key read twice (the second waits for the first),
    another command (waits for all before it), invalid and unknown keys: the same replies as
    the same commands one at a time, in the same order."""
    sc, _ = sidecar
    base = COLD
    commands = [("GET", f"far.{base}"), ("GET", "local.0"), ("GET", f"far.{base + 1}"),
                ("MGET", f"far.{base + 2}", f"far.{base + 3}", "local.0", "far.none"),
                ("GET", f"far.{base}"), ("GET", "bad..key"), ("PING",), ("GET", f"far.{base + 4}"),
                ("GET", "nobucket:k"), ("GET", f"{BUCKET}:far.{base + 5}"), ("GET", f"far.{base + 5}"),
                ("EXISTS", f"far.{base + 6}"), ("GET", f"far.{base + 7}")]
    piped = _pipeline(sc, commands)
    alone = _one_by_one(sc, commands)
    assert [str(x) if isinstance(x, Exception) else x for x in piped] == \
           [str(x) if isinstance(x, Exception) else x for x in alone]
    assert piped[0] == piped[4] == b"far-%d" % base
    assert piped[3] == [b"far-%d" % (base + 2), b"far-%d" % (base + 3), b"near", None]
    assert piped[6] is True or piped[6] == b"PONG"


def test_a_pipeline_of_many_cold_reads_is_answered_whole(sidecar):
    """More reads than are sent at once (kvcache.serve.client_connection.PIPELINE_MAX): all answered,
    in order."""
    sc, _ = sidecar
    keys = [f"far.{i % (COLD * 3)}" for i in range(1500)]
    got = _pipeline(sc, [("GET", k) for k in keys])
    assert got == [b"far-%d" % (i % (COLD * 3)) for i in range(1500)]
