"""Wires the parts together for `kvcache serve`: NATS connection (or an embedded server),
replica, one feed per bucket, router, RESP server; and takes them down in the right order."""
from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import ssl

import nats
import nats.errors

from . import jetstream as jsapi
from .commands import Commands, Stats
from .config import BucketConfig, Config, ensure_dirs
from .errors import BucketNotFound, UpstreamError
from .feed import Feed
from .natsconn import Connection
from .natsserver import NatsServer
from .peerset import PeerConnections, configured_peers, discovered_peers
from .replica import Replica
from .router import Peer, Router
from .server import RespServer, claim_socket_path
from .subjects import subject_match

log = logging.getLogger("kvcache")

DEMO_BUCKET = "demo"
DEMO_KEYS = 1000


class Sidecar:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.stats = Stats()
        self.embedded: NatsServer | None = None
        self.nc: nats.NATS | None = None
        self.replica: Replica | None = None
        self.feeds: dict[str, Feed] = {}
        self.router = Router(cfg.nats.request_timeout_ms / 1000)
        self.peer_conns: PeerConnections | None = None
        self.server: RespServer | None = None
        self.nats_url = ""
        self.use_embedded = cfg.embedded  # decided once: starting it fills in nats.servers
        self.exit_code = 0
        self._stopping = asyncio.Event()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        ensure_dirs(self.cfg)
        # Refuse a live socket before doing anything else: a second sidecar on the same path
        # must fail at once, not after connecting, syncing and logging.
        claim_socket_path(os.path.abspath(self.cfg.socket_path))
        if self.use_embedded:
            await self._start_embedded()
        self.nc = await self._connect(self.cfg.nats.servers)
        self.nats_url = self.nc.connected_url.geturl() if self.nc.connected_url else ""
        if self.use_embedded and not self.cfg.buckets:
            await self._ensure_demo_bucket()
        self.replica = Replica(
            os.path.join(self.cfg.data_dir, "replica"),
            map_size=self.cfg.map_size_mb << 20, max_map_size=self.cfg.max_map_size_mb << 20)
        self.replica.set_buckets([b.name for b in self.cfg.buckets])
        timeout = self.cfg.nats.request_timeout_ms / 1000
        for b in self.cfg.buckets:
            feed = Feed(self.nc, b, self.replica, heartbeat_s=self.cfg.heartbeat_ms / 1000,
                        timeout=timeout, on_fatal=self._fatal)
            try:
                await feed.start()
            except BucketNotFound:
                raise BucketNotFound(f"bucket '{b.name}' does not exist on {self.nats_url}") from None
            self.feeds[b.name] = feed
            self.router.add(Peer("main", self.nc, feed.stream, b.name,
                                 direct=bool(feed.stream_config.get("allow_direct"))))
        await self._add_peers(timeout)
        self.commands = Commands(self)
        self.server = RespServer(self.cfg, self.commands, self.stats)
        await self.server.start()

    async def run(self) -> None:
        """Serve until SIGTERM/SIGINT, then shut down gracefully."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)
        try:
            await self.start()
            await self._stopping.wait()
            log.info("shutting down")
        finally:
            await self.stop()

    def request_stop(self) -> None:
        self._stopping.set()

    def _fatal(self, exc: BaseException) -> None:
        """A part that cannot go on: stop gracefully and exit non-zero."""
        self.exit_code = 1
        self._stopping.set()

    async def stop(self) -> None:
        self._stopping.set()
        if self.server:
            # A request in flight ends within the request timeout (a fallback read gives up
            # then), so that long is enough, and never less than the default 5 s.
            await self.server.stop(grace=max(5.0, self.cfg.nats.request_timeout_ms / 1000 + 1))
        await self.router.close()
        if self.peer_conns:
            await self.peer_conns.close()
        for feed in self.feeds.values():
            await feed.stop()
        if self.nc and not self.nc.is_closed:
            # Drain when connected; when NATS is gone nats-py may wait on reconnects, so
            # bound both steps: shutdown must finish whatever state the connection is in.
            try:
                if self.nc.is_connected:
                    await asyncio.wait_for(self.nc.drain(), 2)
            except (asyncio.TimeoutError, nats.errors.Error):
                pass
            try:
                await asyncio.wait_for(self.nc.close(), 2)
            except (asyncio.TimeoutError, nats.errors.Error):
                pass
        if self.replica:
            self.replica.close()
            self.replica = None
        if self.embedded:
            self.embedded.stop()
            self.embedded = None

    # ------------------------------------------------------------------ NATS

    async def _start_embedded(self) -> None:
        store = os.path.join(os.path.abspath(self.cfg.data_dir), "nats")
        os.makedirs(store, exist_ok=True)
        self.embedded = NatsServer(store, server_name="kvcache-embedded", conf_dir=self.cfg.data_dir)
        # Started from the main thread on purpose: the server dies with the thread that
        # started it (PR_SET_PDEATHSIG), and executor threads come and go.
        self.embedded.start()
        self.cfg.nats.servers = [self.embedded.url]
        log.info("started embedded nats-server %s (pid %d, store %s)",
                 self.embedded.url, self.embedded.pid, store)

    async def _add_peers(self, timeout: float) -> None:
        """The [[peer]] entries (one connection per server set) and, when asked, the mirrors
        each bucket stream lists as alternates."""
        assert self.nc is not None
        self.peer_conns = PeerConnections(self.cfg.nats.servers, self.nc,
                                          functools.partial(self._connect, peer=True))
        for p in await configured_peers(self.cfg.peers, set(self.feeds), self.peer_conns, timeout):
            self.router.add(p)
        if self.cfg.discover_peers:
            for name, feed in self.feeds.items():
                info = await jsapi.stream_info(self.nc, feed.stream, timeout)
                for p in discovered_peers(self.nc, name, info, self.router.peers()):
                    self.router.add(p)
        for p in self.router.peers():
            log.info("peer %s: stream %s%s", p.label, p.stream, f" in domain {p.domain}" if p.domain else "")

    async def _connect(self, servers: list[str], peer: bool = False) -> nats.NATS:
        n = self.cfg.nats
        opts: dict = dict(
            servers=servers, name="kvcache", connect_timeout=n.connect_timeout_s,
            max_reconnect_attempts=-1, reconnect_time_wait=0.5, allow_reconnect=True,
            error_cb=self._on_error, disconnected_cb=self._on_disconnect,
            reconnected_cb=self._on_reconnect,
        )
        if peer:  # a read-only peer: its connection's ups and downs are no business of the feeds
            opts.update(name="kvcache-peer", error_cb=self._on_error, disconnected_cb=_noop,
                        reconnected_cb=_noop)
        if n.creds:
            opts["user_credentials"] = n.creds
        if n.nkey:
            opts["nkeys_seed"] = n.nkey
        if n.token:
            opts["token"] = n.token
        if n.user:
            opts["user"], opts["password"] = n.user, n.password
        if n.tls_ca or n.tls_cert:
            ctx = ssl.create_default_context(cafile=n.tls_ca)
            if n.tls_cert:
                ctx.load_cert_chain(n.tls_cert, n.tls_key)
            opts["tls"] = ctx
        try:
            # nats-py retries the first connect forever when reconnects are unlimited; a
            # sidecar that cannot reach NATS at start must say so and exit instead. So: a
            # bounded first attempt, then reconnect forever once we have been connected.
            nc = Connection()
            await nc.connect(**{**opts, "max_reconnect_attempts": 1})
            nc.options["max_reconnect_attempts"] = -1
            return nc
        except (OSError, asyncio.TimeoutError, nats.errors.Error) as e:
            raise UpstreamError(f"cannot connect to NATS at {', '.join(servers)}: {_describe(e)}") from None

    async def _on_error(self, e: Exception) -> None:
        # Before the first connection the failure is reported once, as the startup error.
        if self.nc is not None and not self._stopping.is_set():
            log.warning("nats: %s", _describe(e))

    async def _on_disconnect(self) -> None:
        if self._stopping.is_set() or self.nc is None:
            return
        log.warning("disconnected from NATS")
        for feed in self.feeds.values():
            feed.connection_lost()

    async def _on_reconnect(self) -> None:
        log.info("reconnected to NATS at %s", self.nc.connected_url.geturl() if self.nc else "?")
        for feed in self.feeds.values():
            feed.connection_lost()  # recreate consumers now rather than after the watchdog

    async def _ensure_demo_bucket(self) -> None:
        """First run on the embedded server: a bucket with sample keys so reads work at once."""
        self.cfg.buckets = [BucketConfig(name=DEMO_BUCKET)]
        timeout = self.cfg.nats.request_timeout_ms / 1000
        try:
            await jsapi.stream_info(self.nc, jsapi.kv_stream(DEMO_BUCKET), timeout)
            return
        except BucketNotFound:
            pass
        js = self.nc.jetstream(timeout=timeout)
        kv = await js.create_key_value(bucket=DEMO_BUCKET, history=5, direct=True,
                                       description="kvcache demo bucket")
        await kv.put("greeting", b"hello from kvcache")
        for i in range(DEMO_KEYS):
            await kv.put(f"user.{i:04d}", f'{{"id":{i},"name":"user {i}"}}'.encode())
        log.info("created demo bucket '%s' with %d keys", DEMO_BUCKET, DEMO_KEYS + 1)

    # ------------------------------------------------------------------ helpers for commands

    @functools.lru_cache(maxsize=65536)
    def in_filters(self, bucket: str, key: str) -> bool:
        """Is the key inside the bucket's replicated set (its `keys` filters)?"""
        return any(subject_match(f, key) for f in self.cfg.bucket(bucket).keys)


async def _noop() -> None:
    pass


def _describe(e: BaseException) -> str:
    if isinstance(e, asyncio.TimeoutError):
        return "timed out"
    text = str(e) or type(e).__name__
    return text.replace("nats: ", "")
