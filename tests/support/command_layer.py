"""The command layer in process: the sidecar's parts wired as kvcache.sidecar wires them, over
a real LMDB replica in a temporary directory, with no NATS, driven through real client
connections (kvcache.serve.client_connection's ClientConnection) whose only stand-in is the socket:
a transport that records what is written, as uvicorn tests its protocols.

Each layer is built over one twin of the native paths, chosen as kvcache.native chooses: the
connection module is loaded afresh with KVCACHE_NO_EXTENSIONS in force or not, so its RESP
request reader and GET path (and the ServerGets built from it) are the C ones or the
pure-Python ones, never a mix.

The feeds are real (kvcache.feed.feed.Feed), never started: nothing reaches NATS. Each is told
what its consumer would say once caught up with nothing more to deliver (`_on_idle`, what an
idle heartbeat makes it do), so the replica counts as synced and fresh, as in a sidecar
serving a bucket at rest.
"""
from __future__ import annotations

import asyncio
import functools
import importlib.util
import itertools
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from kvcache import native
from kvcache.app.client import encode_command
from kvcache.config import BucketConfig, Config
from kvcache.feed.changes import ChangeHub
from kvcache.feed.feed import Feed
from kvcache.ops.accesslog import AccessLog
from kvcache.read.ledger import Ledger
from kvcache.read.policy import ReadPolicy
from kvcache.read.reads import Reads
from kvcache.read.router import Router
from kvcache.resp import ReplyReader
from kvcache.serve import client_connection as default_connection
from kvcache.serve.commands import Commands
from kvcache.serve.info import Info
from kvcache.serve.multi import Transactions
from kvcache.serve.pubsub import PubSub
from kvcache.serve.resp_server import RespServer, direct_buckets
from kvcache.serve.streams import Streams
from kvcache.serve.tracking import Tracking
from kvcache.stats import Stats
from kvcache.store.record import item
from kvcache.store.replica import BucketMeta, Replica

NOW = 1_700_000_000_000_000_000
# Bucket `main` (the default) replicates `in.>`; its keys at revisions 1..n in this order
VALUES = {"in.k1": b"v1", "in.k2": b"v2", "in.k3": b"v3", "in.empty": b"", "in.big": b"B" * 5000}
PASSWORD = "secret"  # for TCP connections only (the Unix socket needs none)
NOT_YET = object()


def connection_module(twins: bool) -> ModuleType:
    """kvcache.serve.client_connection loaded afresh, its native modules chosen by kvcache.native
    with KVCACHE_NO_EXTENSIONS on (`twins`) or off. The choice it records is put back."""
    saved, chosen = native.NO_EXTENSIONS, dict(native.CHOSEN)
    native.NO_EXTENSIONS = twins
    try:
        spec = importlib.util.spec_from_file_location(default_connection.__name__, default_connection.__file__)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        native.NO_EXTENSIONS = saved
        native.CHOSEN.clear()
        native.CHOSEN.update(chosen)
    return module


class RecordingTransport(asyncio.Transport):
    """The socket's stand-in: records every write, and the reading and closing the
    connection asks for. Its output is always taken at once (no backpressure)."""

    def __init__(self, peer: tuple[str, int] | None = None) -> None:
        super().__init__()
        self.written = bytearray()
        self.closed = False
        self.reading = True
        self.peer = peer

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += data

    def writelines(self, list_of_data) -> None:
        for data in list_of_data:
            self.write(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_reading(self) -> bool:
        return self.reading

    def get_write_buffer_size(self) -> int:
        return 0

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def get_extra_info(self, name: str, default=None):
        if self.peer is None:
            return default
        return {"peername": self.peer, "sockname": ("127.0.0.1", 6379)}.get(name, default)


class Client:
    """One connection of the layer: requests in through data_received, replies out of the
    recording transport."""

    def __init__(self, layer: Layer, tcp: bool = False) -> None:
        self.conn = layer.module.ClientConnection(layer.server, next(layer.ids), tcp=tcp)
        self.transport = RecordingTransport(("127.0.0.1", 50000 + self.conn.id) if tcp else None)
        self.conn.connection_made(self.transport)
        self._taken = 0

    def send(self, *commands: Sequence[str | bytes | int] | bytes, bytewise: bool = False) -> None:
        """The commands as one socket read (raw bytes as they are), or one byte per read."""
        data = b"".join(c if isinstance(c, bytes) else encode_command(c) for c in commands)
        if bytewise:
            for i in range(len(data)):
                self.conn.data_received(data[i:i + 1])
        else:
            self.conn.data_received(data)

    async def take(self, replies: int) -> bytes:
        """The bytes of the next `replies` replies, once they are all written: the event loop
        runs meanwhile (a GET read may be answered at the end of its iteration)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while True:
            end = _end_of(self.transport.written, self._taken, replies)
            if end is not None:
                got = bytes(self.transport.written[self._taken:end])
                self._taken = end
                return got
            assert loop.time() < deadline, f"no {replies} replies in {bytes(self.transport.written[self._taken:])!r}"
            await asyncio.sleep(0)  # one turn of the loop: the callbacks due now run

    async def call(self, *commands: Sequence[str | bytes | int], bytewise: bool = False) -> bytes:
        self.send(*commands, bytewise=bytewise)
        return await self.take(len(commands))


def _end_of(data: bytearray, start: int, replies: int) -> int | None:
    """Where the `replies`-th complete reply after `start` ends, None before it is written."""
    reader = ReplyReader(NOT_YET)
    reader.feed(bytes(data[start:]))
    for _ in range(replies):
        if reader.gets() is NOT_YET:
            return None
    return len(data) - reader.buffered


class Layer:
    """The parts of one sidecar (sidecar.Sidecar.start, without NATS) over `tmp`."""

    def __init__(self, tmp: Path, twins: bool) -> None:
        self.module = connection_module(twins)
        self.cfg = cfg = Config(data_dir=str(tmp), requirepass=PASSWORD, buckets=[
            BucketConfig(name="main", keys=["in.>"], max_stale_ms=60_000)])
        self.replica = replica = Replica(str(tmp / "replica"), buckets=len(cfg.buckets))
        replica.set_buckets([b.name for b in cfg.buckets])
        items = [item(k.encode(), v, i + 1, NOW) for i, (k, v) in enumerate(VALUES.items())]
        replica.apply_items("main", items, BucketMeta(stream="KV_main", applied_seq=len(items), synced=True))
        self.stats = Stats()
        feeds: dict[str, Feed] = {}
        self.feeds = feeds
        ledger = Ledger(max_age=lambda bucket: feeds[bucket].max_age_ns if bucket in feeds else 0)
        router = Router(1.0, floors=ledger.floors)
        access = AccessLog.from_config(cfg)
        policy = ReadPolicy(cfg, replica, feeds, ledger)
        self.gets = gets = self.module.SERVER_GET.ServerGets(replica, policy.plan)
        ledger.on_hold = gets.forget_fresh
        hub = ChangeHub()
        for b in cfg.buckets:
            feed = Feed(None, b, replica, heartbeat_s=3600.0,  # type: ignore[arg-type]  # never started
                        on_applied=functools.partial(ledger.applied, b.name),
                        on_resync=functools.partial(ledger.resync_began, b.name),
                        on_renumbered=functools.partial(ledger.renumbered, b.name),
                        on_removed=functools.partial(ledger.removed, b.name), hub=hub)
            feeds[b.name] = feed
            ledger.witness(feed)
            feed._on_idle(0)  # the consumer's word: caught up, nothing more
        direct_buckets(gets, cfg, ledger.witnesses)
        clients: dict = {}
        self.tracking = Tracking(cfg.tracking_table_max_keys, cfg.default_bucket, clients.get, on_first=hub.wake)
        self.pubsub = PubSub(cfg.notify_keyspace_events, cfg.default_bucket)
        transactions = Transactions(policy)
        streams = Streams(cfg, replica, feeds, ledger, on_first=hub.wake)
        for listener in (self.tracking, self.pubsub, transactions, streams):
            hub.add(listener)
        hub.follow(streams)
        self.hub = hub
        reads = Reads(cfg, policy, router, self.stats, access)
        info = Info(cfg, self.stats, replica, feeds, router, access, self.tracking, self.pubsub,
                    gets.cache_reads, streams)
        self.commands = Commands(cfg, reads, self.stats, self.tracking, self.pubsub, transactions, info,
                                 streams, clients.values)
        self.server = RespServer(cfg, self.commands, self.stats, gets, clients)
        gets.call_soon = asyncio.get_running_loop().call_soon
        self.ids = itertools.count(1)

    def client(self, tcp: bool = False) -> Client:
        return Client(self, tcp)

    def close(self) -> None:
        for c in list(self.server.connections):
            c.connection_lost(None)
        self.replica.close()
