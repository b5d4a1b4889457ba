"""Wires the parts together for `kvcache serve`: NATS connection (or an embedded server),
replica, one feed per bucket, router, RESP server; and takes them down in the right order."""
from __future__ import annotations

import asyncio
import difflib
import functools
import gc
import logging
import os
import shutil
import signal
from collections.abc import Awaitable, Callable

import nats

from . import native
from .config import BucketConfig, Config, ensure_dirs, start_warnings
from .demo import DEMO_BUCKET, ensure_demo_bucket
from .errors import BucketNotFound, KvcacheError, describe
from .feed.changes import ChangeHub
from .feed.consumer import deletions_done
from .feed.feed import Feed
from .feed.fleet import StateShare
from .feed.follow import republish_subject
from .feed.freshness import SILENT_HEARTBEATS
from .feed.names import consumer_name, relay_name, sidecar_id
from .feed.quorum import NO_FENCE
from .feed.relay import RelayElection, changes_subject
from .feed.statepoll import SHARED_FROM, StatePoll
from .natsio import jetstream as jsapi
from .natsio.embedded import EmbeddedNats
from .natsio.nats_connection import NatsConnection
from .natsio.upstream import Upstream
from .ops.accesslog import AccessLog
from .ops.datadir import CHECK_S, LOCK_FILE, NO_SPACE, DataDirLock, check_room, no_room, short_of_room
from .ops.health import BucketState, readiness
from .ops.metrics import SidecarCollector, exposition
from .ops.metrics_http import MetricsServer
from .read.ledger import Ledger
from .read.peerset import PeerConnections, configured_peers, discovered_peers
from .read.policy import ReadPolicy
from .read.reads import Reads
from .read.router import Peer, Router
from .serve.commands import Commands
from .serve.info import Info
from .serve.links import LinkConnection
from .serve.multi import Transactions
from .serve.pubsub import PubSub
from .serve.resp_server import (
    ClientConnection,
    RespServer,
    bind_tcp,
    bind_unix,
    claim_socket_path,
    direct_buckets,
    listen_label,
    server_gets,
)
from .serve.streams import Streams
from .serve.tracking import Tracking
from .stats import Stats
from .store.nearcache import NearCache
from .store.replica import Replica
from .supervisors.board import Board, BoardPublisher, board_path
from .supervisors.workers import Workers, main_socket_path

log = logging.getLogger("kvcache")

STOP_STEP_S = 5.0  # longest wait for one shutdown step (a feed, the router, peer connections)


class Sidecar:
    """The application object of `kvcache serve`: builds the parts in order (NATS, replica,
    feeds, router, read policy, RESP server), supervises what can fail while serving (the
    embedded nats-server, a feed's fatal error, signals) and stops them in reverse order,
    whatever state each is in. Nothing below it holds a reference back to it."""

    def __init__(self, cfg: Config, relay: bool | None = None) -> None:
        self.cfg = cfg
        # Take part in the fleet's relays (kvcache.feed.relay) for the buckets whose stream has
        # no usable RePublish of its own, and follow them: the `relay` setting, unless given.
        self.relay = cfg.relay if relay is None else relay
        self.relays: RelayElection | None = None
        self.stats = Stats()
        self.embedded: EmbeddedNats | None = None
        self.replica: Replica | None = None
        self.feeds: dict[str, Feed] = {}
        self.state_poll: StatePoll | None = None  # with SHARED_FROM buckets or more
        self.share: StateShare | None = None  # the fleet's shared stream-state polls
        feeds = self.feeds
        # A bucket's max_age and what its fallback answers must show, from its feed (the
        # feeds dict fills as each bucket starts)
        # What was handed out, so that no read goes back below it (kvcache.read.ledger): the
        # router's floors, the holds, the streams' revisions per connection.
        self.ledger = Ledger(max_age=lambda bucket: feeds[bucket].max_age_ns if bucket in feeds else 0)
        self.router = Router(cfg.nats.request_timeout_ms / 1000,
                             fence=lambda bucket: feeds[bucket].fence() if bucket in feeds else NO_FENCE,
                             floors=self.ledger.floors,
                             proven=lambda bucket, ms: feeds[bucket].proven_within(ms) if bucket in feeds else True)
        self.hub = ChangeHub()  # the feeds' changes, to tracking, pub/sub and WATCH
        self.peer_conns: PeerConnections | None = None
        self.server: RespServer | None = None
        self.metrics: MetricsServer | None = None  # with metrics_listen
        # workers > 1 (kvcache.supervisors): the board this process publishes each bucket's
        # verdict on, and the worker processes serving the sockets
        self.board: Board | None = None
        self.publisher: BoardPublisher | None = None
        self.workers: Workers | None = None
        self.commands: Commands | None = None
        self.use_embedded = cfg.embedded  # decided once: starting it fills in nats.servers
        self.exit_code = 0
        self._stopping = asyncio.Event()
        # the main NATS connection (once started) and the peers': they tell the feeds of a
        # reconnect, move off a server that shows no quorum, and end the sidecar on a
        # permission the feeds cannot do without
        self.upstream = Upstream(cfg, self.stats, self.feeds, self._stopping, self._fail)
        self._supervisor: asyncio.Task | None = None
        self._hopper: asyncio.Task | None = None  # Upstream.leave_servers_without_quorum
        self._dirlock = DataDirLock(cfg.data_dir)  # one sidecar per data directory (kvcache.ops.datadir)
        self._dirwatch: asyncio.Task | None = None  # _watch_host
        self._fatal_error: KvcacheError | None = None
        self._trail: StartTrail | None = None  # what start found, for a failed start to restore
        self._undo_start = False  # set when start failed: stop() removes what it created

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._trail = StartTrail(self.cfg)  # a failed start leaves the file system as it was
        ensure_dirs(self.cfg)
        # Refuse a data directory another sidecar uses, then a live socket, before doing
        # anything else: a second sidecar must fail at once, not after starting an embedded
        # nats-server, opening the replica, connecting, syncing and logging.
        self._dirlock.acquire()
        self._trail.locked()
        self._dirwatch = asyncio.ensure_future(self._watch_host())
        check_room(self.cfg.data_dir, self.cfg.socket_path)  # one line for a full disk, not a write's failure
        claim_socket_path(os.path.abspath(self.cfg.socket_path))
        self._warn_bounds_under_heartbeats()
        if self.use_embedded:
            self.embedded = EmbeddedNats(self.cfg.data_dir, self.cfg.embedded_port)
            self.cfg.nats.servers = [self.embedded.start()]
            self._supervisor = asyncio.ensure_future(self.embedded.supervise(self._stopping, self._give_up))
        nc = await self.upstream.open()
        self.stats.embedded_nats = self.use_embedded
        if self.use_embedded and not self.cfg.buckets:
            self.cfg.buckets = [BucketConfig(name=DEMO_BUCKET)]
            await ensure_demo_bucket(nc, self.cfg.nats.request_timeout_ms / 1000)
        for line in start_warnings(self.cfg):
            log.warning("%s", line)
        self.replica = Replica(
            os.path.join(self.cfg.data_dir, "replica"),
            map_size=self.cfg.map_size_mb << 20, max_map_size=self.cfg.max_map_size_mb << 20,
            buckets=len(self.cfg.buckets))
        self.replica.set_buckets([b.name for b in self.cfg.buckets])
        self._dirlock.keep(os.path.join(self.replica.path, "data.mdb"))
        timeout = self.cfg.nats.request_timeout_ms / 1000
        shared_watch = len(self.cfg.buckets) >= SHARED_FROM
        # The parts, built and wired here and nowhere else: the read decisions and the GET
        # fast path over the feeds (the `feeds` dict fills as each bucket starts), the change
        # hub and its listeners, the reads, the command table, the server.
        access = AccessLog.from_config(self.cfg)
        ledger = self.ledger
        policy = ReadPolicy(self.cfg, self.replica, self.feeds, ledger)
        gets = server_gets(self.cfg, policy, every_get_to_commands=access.enabled)
        ledger.on_hold = gets.forget_fresh  # a held key must not ride a cached verdict
        if self.cfg.workers > 1:
            # the workers' GET path reads each bucket's verdict from the board: published after
            # every change of it (Feed.on_state), and as a hold is placed, before its answer
            # goes out (kvcache.supervisors.board)
            self.board = Board(board_path(self.cfg.data_dir), [b.name for b in self.cfg.buckets],
                               self.cfg.workers, create=True)
            self.publisher = BoardPublisher(self.board, self.feeds, ledger, gets.forget_fresh)
            ledger.on_hold = self.publisher.held
        hub = self.hub
        # The fleet's shared stream-state polls (kvcache.feed.fleet): set on each feed before it
        # starts, followed once it has (the answers are checked against its stream's identity).
        # Who this sidecar is among the fleet, kept in the data directory (kvcache.feed.names):
        # its consumers' name, which a restart finds and replaces, and its place in the polls.
        sid = sidecar_id(self.cfg.data_dir)
        share = self.share = StateShare(nc, sid=sid) if self.cfg.share_stream_state else None
        for b in self.cfg.buckets:
            feed = Feed(nc, b, self.replica, heartbeat_s=self.cfg.heartbeat_ms / 1000,
                        timeout=timeout, on_fatal=self._fatal,
                        # the feed reports what it applied; the ledger keeps what was handed out
                        on_applied=functools.partial(ledger.applied, b.name),
                        on_resync=functools.partial(ledger.resync_began, b.name),
                        on_renumbered=functools.partial(ledger.renumbered, b.name),
                        on_removed=functools.partial(ledger.removed, b.name), hub=hub,
                        consumer_name=consumer_name(sid))
            max_keys, max_bytes = self.cfg.cache_bounds(b)
            if (max_keys or max_bytes) and ">" not in b.keys:
                feed.set_cache(NearCache(self.replica, b.name, max_keys, max_bytes, self.cfg.cache_admission))
            feed.share = share
            if self.publisher is not None:
                feed.on_state = functools.partial(self.publisher.publish, b.name)
            try:
                await feed.start(watch=not shared_watch)
            except BucketNotFound:
                names = await kv_bucket_names(nc, min(timeout, 1.0))
                raise BucketNotFound(missing_bucket(b.name, self.upstream.url, names, self.use_embedded)) from None
            except BaseException:  # not in self.feeds yet: stop what its start began (a consumer)
                await _step(f"feed {b.name}", feed.stop(), STOP_STEP_S)
                raise
            self.feeds[b.name] = feed
            ledger.witness(feed)
            if share is not None:
                await share.follow(feed)
            self.router.add(Peer("main", nc, feed.stream, b.name,
                                 direct=bool(feed.stream_config.get("allow_direct"))))
        if self.relay:
            await self._join_relays(nc, sid, timeout)
        if shared_watch:
            self.state_poll = StatePoll(nc, self.feeds.values(), timeout, self.stats, share)
            self.state_poll.start()
        await self._add_peers(timeout)
        self._hopper = asyncio.ensure_future(self.upstream.leave_servers_without_quorum())
        if not access.enabled:
            direct_buckets(gets, self.cfg, ledger.witnesses)
        clients: dict[int, ClientConnection] = {}  # the server's registry, by CLIENT ID
        tracking = Tracking(self.cfg.tracking_table_max_keys, self.cfg.default_bucket, clients.get,
                            on_first=hub.wake)
        pubsub = PubSub(self.cfg.notify_keyspace_events, self.cfg.default_bucket)
        transactions = Transactions(policy)
        streams = Streams(self.cfg, self.replica, self.feeds, ledger, on_first=hub.wake)
        for listener in (tracking, pubsub, transactions, streams):  # one hub: one consumer per bucket
            hub.add(listener)
        hub.follow(streams)
        reads = Reads(self.cfg, policy, self.router, self.stats, access)
        info = Info(self.cfg, self.stats, self.replica, self.feeds, self.router, access, tracking, pubsub,
                    gets.cache_reads, streams)
        info.relays = self.relays
        self.commands = Commands(self.cfg, reads, self.stats, tracking, pubsub, transactions, info,
                                 streams, clients.values)
        hub.start_watch(self.feeds.values())
        internal = main_socket_path(self.cfg.data_dir) if self.cfg.workers > 1 else None
        if internal is not None:
            claim_socket_path(internal)
        self.server = RespServer(self.cfg, self.commands, self.stats, gets, clients, internal=internal)
        await self.server.start()
        if self.board is not None:
            await self._start_workers(info)
        if self.cfg.metrics_address is not None:
            await self._start_metrics(*self.cfg.metrics_address)
        # Which implementation serves each native module: logged once serving (a mistake
        # before that is the one line a user sees), a warning when any twin serves.
        chosen = native.report()
        log.log(logging.INFO if native.all_native() else logging.WARNING,
                "implementations: %s", ", ".join(f"{k} {v}" for k, v in chosen.items()))
        # What start built (feeds, consumers, subscriptions, peers: a heap that grows with the
        # buckets) lives as long as the process: out of the cyclic GC's sight, so that a full
        # collection (which a scrape's allocations can set off) walks only what came after.
        gc.freeze()

    async def _join_relays(self, nc: NatsConnection, sid: str, timeout: float) -> None:
        """Stand for the relay of each bucket whose stream has no usable RePublish (a stream
        that has one serves the fleet itself) and allows Direct Get (how a follower fills what
        core NATS dropped: without it every gap would cost a consumer), and follow the relay's
        subject whenever one is heard: the relay's own feed too, so that the cluster holds one
        consumer per bucket for the whole fleet. A sidecar relays only while its replica is
        synced, from its applied sequence; the relay's lag counts from the newest sequence its
        feed saw."""
        relays = self.relays = RelayElection(nc, sid=sid, name=relay_name(sid),
                                             heartbeat_s=self.cfg.heartbeat_ms / 1000, timeout=timeout)
        for name, feed in self.feeds.items():
            if republish_subject(feed.stream_config, name) is not None or not feed.stream_config.get("allow_direct"):
                continue
            feed.follow_relay(changes_subject(relays.domain, name), functools.partial(relays.heard_within, name))
            await relays.follow(name, feed.watch_period(), *_relay_views(feed), on_relay=feed.relay_heard)

    # ------------------------------------------------------------------ workers

    async def _start_workers(self, info: Info) -> None:
        """Bind the sockets the workers accept on, and start them (kvcache.supervisors.workers);
        INFO adds up their counters from the first client on."""
        assert self.board is not None and self.publisher is not None
        self.publisher.publish_all()
        path = os.path.abspath(self.cfg.socket_path)
        claim_socket_path(path)
        try:
            unix, inode = bind_unix(path, self.cfg.socket_mode)
        except OSError as e:
            raise KvcacheError(f"cannot listen on {path}: {e.strerror}") from None
        tcp = None
        if self.cfg.listen_address is not None:
            try:
                tcp = bind_tcp(*self.cfg.listen_address)
            except OSError as e:
                unix.close()
                raise KvcacheError(f"cannot listen on {self.cfg.listen}: {e.strerror}") from None
            self.stats.listen = listen_label(tcp)
        self.workers = Workers(self.cfg, self.board, unix, inode, tcp)
        info.workers = self.workers.totals
        info.refresh = self.workers.refresh
        assert self.commands is not None
        self.commands.session.seen_in_workers = self._seen_in_workers
        await self.workers.start()
        log.info("serving RESP on %s (mode %o) with %d workers%s", path, self.cfg.socket_mode, self.cfg.workers,
                 f", and on {self.stats.listen} (TCP)" if tcp is not None else "")

    async def _seen_in_workers(self) -> None:
        """What every worker saw of its clients last, on their links here (kvcache.serve.links)."""
        if self.workers is None or self.server is None:
            return
        seen = await self.workers.connections()
        for conn_id, (last_io, cmd) in seen.items():
            conn = self.server.by_id.get(conn_id)
            if isinstance(conn, LinkConnection):
                conn.seen_in_worker(last_io, cmd)

    async def _stop_workers(self) -> None:
        """New clients get ENOENT at once (the socket file goes first), the workers answer
        what is in flight (their links are this process's clients: its server stops after)."""
        if self.workers is not None:
            await self.workers.stop(self.workers.grace)  # (stop() begins with stop_accepting)
            self.workers = None

    def _close_board(self) -> None:
        """The board unmapped and removed, once the feeds have stopped: they publish on it until
        they are told not to (kvcache.supervisors.board.BoardPublisher)."""
        if self.board is not None:
            for feed in self.feeds.values():  # (a reconnect's news may still reach a feed)
                feed.on_state = None
            self.board.close()
            self.board = None
            try:
                os.unlink(board_path(self.cfg.data_dir))
            except OSError:
                pass

    async def run(self) -> None:
        """Serve until SIGTERM, SIGINT or SIGHUP, then shut down gracefully. A signal during
        start abandons the start; either way stop() runs and finishes whatever state NATS is
        in. SIGHUP (a closed terminal, or a supervisor asking for a reload kvcache cannot do)
        stops it too, saying so, rather than killing it with its socket file left behind."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            starting = asyncio.ensure_future(self.start())
            stopping = asyncio.ensure_future(self._stopping.wait())
            interrupted = False
            try:
                await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not starting.done():  # stopped (signal, fatal error) before start finished
                    interrupted = True
                    starting.cancel()
                    await asyncio.wait({starting})
                if not stopping.done():
                    stopping.cancel()
            if interrupted:
                error = None if starting.cancelled() else starting.exception()
                if error is not None:
                    log.info("start abandoned: %s", describe(error))
                # ended by a fatal error (not a signal): as failed as a start that raised
                self._undo_start = self._fatal_error is not None
            else:
                error = starting.exception()
                self._undo_start = error is not None
                if error is not None and not isinstance(error, KvcacheError) and (
                        (isinstance(error, OSError) and error.errno in NO_SPACE) or short_of_room(self.cfg.data_dir)):
                    # a write the start's check_room could not foresee (the disk filled meanwhile)
                    raise no_room(self.cfg.data_dir) from None
                starting.result()  # a failed start: its one-line error reaches the CLI
            await self._stopping.wait()
            log.info("shutting down")
        finally:
            await self.stop()
        if self._fatal_error is not None:
            raise self._fatal_error

    async def _start_metrics(self, host: str, port: int) -> None:
        """The metrics listener, and command latency timed from now on (kvcache.ops.latency)."""
        assert self.commands is not None and self.server is not None
        self.commands.time_commands()
        self.server.gets.timed = True
        collector = SidecarCollector(self.cfg, self.stats, self.commands, self.server.gets, self._connections)
        if self.workers is not None:
            collector.workers = self.workers.totals  # /metrics adds up every worker
        collector.relays = self.relays
        self.metrics = MetricsServer(lambda accept: exposition(collector.snapshot(), accept), self.readiness)
        self.stats.metrics_listen = await self.metrics.start(host, port, self.cfg.metrics_listen)
        log.info("serving metrics on http://%s/metrics (and /healthz, /readyz)", self.stats.metrics_listen)

    def _connections(self) -> dict[str, nats.NATS]:
        """The NATS connections in use, by name: `main`, and each configured peer's."""
        conns = {p.name: p.nc for p in self.router.peers()}
        if self.upstream.nc is not None:
            conns["main"] = self.upstream.nc
        return conns

    def readiness(self) -> tuple[bool, str]:
        """/readyz's answer: kvcache.ops.health's rule over the feeds as they are now; not ready
        while the socket, removed, cannot be made again (RespServer.socket_fault)."""
        if self._stopping.is_set():
            return False, "not ready: shutting down"
        fault = (self.server and self.server.socket_fault) or (self.workers and self.workers.file.fault)
        if fault:
            return False, f"not ready: {fault}"
        return readiness((BucketState(name, f.synced, f.lag_ms(), f.cfg.max_stale_ms, f.unwritable_ms())
                          for name, f in self.feeds.items()),
                         self.stats.nats_connected, self.cfg.ready_on_fallback)

    async def _watch_host(self) -> None:
        """What the host can take away while the sidecar runs, looked at every CHECK_S seconds
        (a few stats): the data directory removed ends the sidecar (exit 1, its one line),
        since its replica and lock went with it and a supervisor's restart makes them anew;
        a lock file or the socket removed is made again (RespServer.check_socket)."""
        while True:
            await asyncio.sleep(CHECK_S)
            why = self._dirlock.check()
            if why is not None:
                log.error("%s", why)
                self._fail(KvcacheError(why))
                return
            if self.server is not None and not self.server.closing:
                await self.server.check_socket()  # with workers, the internal socket
            if self.workers is not None:
                self.workers.check_socket()

    def _warn_bounds_under_heartbeats(self) -> None:
        """A caught-up replica counts as behind only after two heartbeats of silence
        (Feed.lag_ms): a max_stale_ms under that cannot hold on a link that stalls without
        closing. Not an error (the bound still holds on every link that closes or errs), one
        line naming what to change."""
        hb = self.cfg.heartbeat_ms
        silence = SILENT_HEARTBEATS * hb
        for bound in sorted({b.max_stale_ms for b in self.cfg.buckets if b.max_stale_ms < silence}):
            names = ", ".join(b.name for b in self.cfg.buckets if b.max_stale_ms == bound)
            log.warning("max_stale_ms %d (%s) is under two heartbeats (heartbeat_ms %d): a NATS link "
                        "that stalls without closing is noticed %d ms after its last word, not %d; "
                        "heartbeat_ms %d or less keeps the bound", bound, names, hb, silence, bound,
                        bound // SILENT_HEARTBEATS)

    def _on_signal(self, sig: int) -> None:
        if self._stopping.is_set():
            log.info("%s: already shutting down", signal.Signals(sig).name)
        elif sig == signal.SIGHUP:
            log.warning("SIGHUP: kvcache does not reload its configuration; stopping (start it "
                        "again to apply a change)")
        self._stopping.set()

    def _fatal(self, exc: BaseException) -> None:
        """A part that cannot go on: stop gracefully and exit non-zero."""
        self.exit_code = 1
        self._stopping.set()

    async def stop(self) -> None:
        """Take everything down in order. Every step is bounded and its failure only logged:
        NATS may be gone, hung or half-closed, and the replica, the embedded server, the
        socket and the data-directory lock must be released all the same. Safe to call twice."""
        self._stopping.set()
        served = self.server is not None
        if self.workers is not None:  # new clients get ENOENT from here on (see _stop_workers)
            self.workers.stop_accepting()
        if self._dirwatch is not None:
            self._dirwatch.cancel()
            await asyncio.wait({self._dirwatch})
            self._dirwatch = None
        if self._hopper is not None:
            self._hopper.cancel()
            await asyncio.wait({self._hopper})
            self._hopper = None
        if self._supervisor is not None:
            self._supervisor.cancel()
            await asyncio.wait({self._supervisor})
            self._supervisor = None
        drain = max(5.0, self.cfg.nats.request_timeout_ms / 1000 + 1)  # the drains' grace (see below)
        await _step("workers", self._stop_workers(), drain + STOP_STEP_S + 5)
        if self.server:
            # A request in flight ends within the request timeout (a fallback read gives up
            # then), so that long is enough, and never less than the default 5 s.
            grace = max(5.0, self.cfg.nats.request_timeout_ms / 1000 + 1)
            await _step("socket server", self.server.stop(grace=grace), grace + 5)
        if self.metrics is not None:
            # after the clients' drain: meanwhile /readyz answers 503 "shutting down", so a
            # load balancer stops sending before the socket is gone, and the last scrape
            # still sees the drain's numbers
            await _step("metrics listener", self.metrics.stop(), STOP_STEP_S)
            self.metrics = None
        if self.commands is not None:
            await _step("staleness watch", self.hub.stop(), STOP_STEP_S)
        await _step("router", self.router.close(), STOP_STEP_S)
        if self.peer_conns:
            await _step("peer connections", self.peer_conns.close(), STOP_STEP_S)
        if self.state_poll is not None:
            await _step("stream state poll", self.state_poll.stop(), STOP_STEP_S)
        if self.share is not None:
            await _step("shared stream state", self.share.close(), STOP_STEP_S)
        if self.relays is not None:  # the fleet is told, and the consumer deleted, before NATS closes
            await _step("fleet relays", self.relays.close(), STOP_STEP_S)
        for name, feed in self.feeds.items():
            await _step(f"feed {name}", feed.stop(), STOP_STEP_S)
        self._close_board()
        # the consumers' deletions, before the connection closes: a failed start (or a stop)
        # leaves no consumer behind for the server to reap a minute later
        await _step("consumer deletions", deletions_done(STOP_STEP_S), STOP_STEP_S)
        if self.upstream.nc and not self.upstream.nc.is_closed:
            # Bounded: shutdown must finish whatever state the connection is in.
            await _step("NATS close", self.upstream.close(), 2)
        if self.replica:
            try:
                self.replica.close()
            except Exception as e:
                log.warning("shutdown: replica close: %s", describe(e))
            self.replica = None
        if self.embedded:
            try:
                self.embedded.stop()
            except Exception as e:
                log.warning("shutdown: embedded nats-server stop: %s", describe(e))
            self.embedded = None
        if self._undo_start and self._trail is not None:
            # with the lock still held: the lock file goes before another start can take it
            self._trail.undo(locked=self._dirlock.held)
            self._undo_start = False
        self._dirlock.release()
        if served:
            log.info("stopped")

    def _give_up(self, err: KvcacheError) -> None:
        """_fail, logged as critical (the embedded nats-server cannot stay up)."""
        log.critical("%s", err)
        self._fail(err)

    def _fail(self, err: KvcacheError) -> None:
        """Stop with exit code 1; `run` raises `err` after the shutdown, so the CLI ends with
        it as its one error line."""
        self._fatal_error = err
        self._fatal(err)

    async def _add_peers(self, timeout: float) -> None:
        """The [[peer]] entries (one connection per server set) and, when asked, the mirrors
        each bucket stream lists as alternates."""
        nc = self.upstream.nc
        assert nc is not None
        self.peer_conns = PeerConnections(self.cfg.nats.servers, nc,
                                          functools.partial(self.upstream.connect, peer=True))
        for p in await configured_peers(self.cfg.peers, set(self.feeds), self.peer_conns, timeout):
            self.router.add(p)
        if self.cfg.discover_peers:
            for name, feed in self.feeds.items():
                info = await jsapi.stream_info(nc, feed.stream, timeout)
                for p in discovered_peers(nc, name, info, self.router.peers()):
                    self.router.add(p)
        for p in self.router.peers():
            log.info("peer %s: stream %s%s", p.label, p.stream, f" in domain {p.domain}" if p.domain else "")


class StartTrail:
    """What the file system held before a start, so that a failed one (a missing bucket, NATS
    unreachable) leaves it as it was: the directories the start made (ensure_dirs, with their
    parents) go if empty, and the data directory's entries it added (lock file, replica,
    embedded server's store, config and log, sidecar id) go. Nothing that was there before:
    a replica a start found is never removed."""

    def __init__(self, cfg: Config) -> None:
        self.data_dir = os.path.abspath(cfg.data_dir)
        dirs = [self.data_dir, os.path.dirname(os.path.abspath(cfg.socket_path))]
        if cfg.access_log_rate > 0:
            dirs.append(os.path.abspath(cfg.access_log_dir or os.path.join(cfg.data_dir, "access-logs")))
        self.made: set[str] = set()  # directories that do not exist yet (ensure_dirs makes them)
        for d in dirs:
            while d != os.path.dirname(d) and not os.path.lexists(d):
                self.made.add(d)
                d = os.path.dirname(d)
        self.found = _entries(self.data_dir)
        self.kept = set(self.found)

    def locked(self) -> None:
        """The data directory's lock is held: what else is in it now was not made by this
        start either (only the lock file and ensure_dirs' directories were), so it stays."""
        ours = {LOCK_FILE} | {os.path.basename(d) for d in self.made if os.path.dirname(d) == self.data_dir}
        self.kept = self.found | (_entries(self.data_dir) - ours)

    def undo(self, locked: bool) -> None:
        """Remove what this start added. Its data-directory entries only while it holds the
        lock (without it another sidecar may own them); its empty directories always."""
        if locked:
            for name in sorted(_entries(self.data_dir) - self.kept):
                path = os.path.join(self.data_dir, name)
                try:
                    if os.path.isdir(path) and not os.path.islink(path):
                        shutil.rmtree(path)
                    else:
                        os.unlink(path)
                except OSError as e:
                    log.warning("failed start: cannot remove %s: %s", path, e.strerror)
        for d in sorted(self.made, key=lambda d: d.count(os.sep), reverse=True):
            try:
                os.rmdir(d)
            except OSError:  # not empty: something else put a file there
                pass


def _relay_views(feed: Feed) -> tuple[Callable[[], int], Callable[[], bool], Callable[[], int]]:
    """What a bucket's relay election reads of its feed: the applied sequence (where a relay
    starts), whether the replica is synced (who may relay), the newest sequence seen (lag)."""
    return (lambda: feed.meta.applied_seq), (lambda: feed.synced), (lambda: feed.upstream_seq)


def _entries(directory: str) -> set[str]:
    try:
        return set(os.listdir(directory))
    except OSError:
        return set()


async def kv_bucket_names(nc: nats.NATS, timeout: float) -> list[str] | None:
    """The KV buckets on the server (streams `KV_<name>`), for the missing-bucket error; None
    when they cannot be listed (a user without $JS.API.STREAM.NAMES: the error goes without)."""
    names: list[str] = []
    offset = 0
    try:
        for _ in range(10):  # 1024 streams a page: enough for a did-you-mean
            doc = await jsapi.api_request(nc, "$JS.API.STREAM.NAMES", {"offset": offset}, timeout)
            page = doc.get("streams") or []
            names += [s[3:] for s in page if s.startswith("KV_")]
            offset += len(page)
            if not page or offset >= int(doc.get("total", 0)):
                break
    except KvcacheError:
        return None
    return names


MISSING_BUCKET_LIST = 10  # buckets a missing-bucket error names at most


def missing_bucket(name: str, url: str, names: list[str] | None, embedded: bool) -> str:
    """The error of a configured bucket the server lacks: the buckets it has (at most
    MISSING_BUCKET_LIST), the one most likely meant (same name but for case first), and, when
    no NATS URL was given, that the server is an embedded one this start made."""
    if names is None:
        there = ""
    elif not names:
        there = "it has no KV buckets"
    else:
        folded = [n for n in names if n.lower() == name.lower()]
        meant = folded or difflib.get_close_matches(name, names, n=1) or difflib.get_close_matches(
            name.lower(), [n.lower() for n in names], n=1)
        if meant and meant[0] not in names:  # matched in lower case: the real name
            meant = [next(n for n in names if n.lower() == meant[0])]
        shown = sorted(names)[:MISSING_BUCKET_LIST]
        more = f" and {len(names) - len(shown)} more" if len(names) > len(shown) else ""
        there = (f"did you mean '{meant[0]}'? " if meant else "") + f"buckets there: {', '.join(shown)}{more}"
    if embedded:
        return (f"bucket '{name}' does not exist on the embedded nats-server {url}"
                f"{f' ({there})' if there else ''}: no NATS URL was given (KVCACHE_NATS_SERVERS / "
                "--nats), so an embedded server was started")
    return f"bucket '{name}' does not exist on {url}{f' ({there})' if there else ''}"


async def _step(what: str, aw: Awaitable, timeout: float) -> None:
    """One shutdown step: bounded, and a failure is logged, never raised (the next steps
    must run whatever state NATS is in)."""
    log.debug("shutdown: %s", what)
    try:
        await asyncio.wait_for(aw, timeout)
    except TimeoutError:
        log.warning("shutdown: %s did not finish within %gs", what, timeout)
    except Exception as e:  # expected while NATS is gone: debug, not noise
        log.debug("shutdown: %s: %s", what, describe(e))
