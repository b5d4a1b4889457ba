"""A worker process (`workers = N`): serves the sidecar's sockets from the replica's files.

LMDB lets any number of processes read one map at once without locks, so N processes can
answer GETs where one event loop stops at one core. A worker has no NATS connection, no feed
and no read ledger: those stay in the feed's process (kvcache.sidecar), so the cluster sees
one connection and one consumer per bucket per host whatever N is. A worker:
- serves the client connections the feed's process accepts on the sockets and hands to its
  workers in turn (a descriptor passed over a socket pair);
- answers GET (and the runs of pipelined GETs) with the same GET path as the feed's process
  (kvcache.serve.server_get, in C when built) over its own read-only view of the map, for the
  buckets that replicate every key, when the board (kvcache.supervisors.board) says the
  replica is fresh and nothing is held;
- sends everything else to the feed's process over a link per client connection
  (kvcache.serve.relay), where it runs as it would on the socket;
- writes its counters to the board twice a second, and ends when the feed's process does
  (its parent gone) or on SIGTERM, after the requests in flight are answered.

Started by kvcache.supervisors.workers with `python -m kvcache.supervisors.worker`, its
WorkerSpec on stdin.
"""
from __future__ import annotations

import asyncio
import logging
import os
import pickle
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass

from .. import native
from ..config import Config
from ..ops import logformat
from ..serve.client_connection import SERVER_GET
from ..serve.relay import MainLink, RelayCommands, WorkerConnection
from ..serve.resp_server import FD_MARGIN, RespServer, raise_fd_limit
from ..stats import Stats
from ..store.replica import Replica
from .board import Board, conns_path

log = logging.getLogger("kvcache.worker")

REPORT_S = 0.5  # how often a worker writes its counters to the board


@dataclass
class WorkerSpec:
    """What the feed's process tells a worker it starts (pickled to its stdin)."""

    cfg: Config
    index: int           # 0..N-1: its slot on the board, and its name in the logs
    hand_fd: int         # its end of the pair the connections are handed over on, inherited
    board: str           # the board's path
    main_path: str       # the feed's process's internal socket
    parent: int          # the feed's process's pid: a worker outliving it ends
    grace: float         # SIGTERM: how long requests in flight may take to finish


class WorkerServer(RespServer):
    """The worker's side of the sockets: the connections the feed's process accepted and handed
    over (`hand`, a SOCK_SEQPACKET pair: one byte, `u` or `t`, and the socket's descriptor),
    each a WorkerConnection. Nothing is bound, accepted or removed here."""

    def __init__(self, spec: WorkerSpec, stats: Stats, gets) -> None:
        super().__init__(spec.cfg, RelayCommands(), stats, gets, {})  # type: ignore[arg-type]
        self.main_path = spec.main_path
        self.spec = spec
        self.hand = socket.socket(fileno=spec.hand_fd)
        self.hand.setblocking(False)
        self.orphaned = asyncio.Event()  # the feed's process closed its end: it is gone
        self._adopting: set[asyncio.Task] = set()  # connect_accepted_socket calls under way
        self.links: set[MainLink] = set()  # links not yet closed (kvcache.serve.relay.MainLink)

    def clients(self) -> int:
        """Client connections, and those closed whose link is not yet: what the feed's process
        may still count of this worker's (max_clients counts links there)."""
        return len(self.connections | {link.conn for link in self.links})

    async def start(self) -> None:
        raise_fd_limit(self.cfg.max_clients + FD_MARGIN)
        loop = asyncio.get_running_loop()
        self.gets.call_soon = loop.call_soon
        loop.add_reader(self.hand.fileno(), self._take)

    def _take(self) -> None:
        """Connections handed over: each served from here on (asyncio's accepted-socket path)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                kind, fds, _, _ = socket.recv_fds(self.hand, 1, 16)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                kind, fds = b"", []
            if not kind and not fds:  # end of file
                loop.remove_reader(self.hand.fileno())
                self.orphaned.set()
                return
            for fd in fds:
                sock = socket.socket(fileno=fd)
                sock.setblocking(False)
                if self.closing:
                    sock.close()
                    continue
                task = loop.create_task(loop.connect_accepted_socket(self._factory(kind == b"t"), sock))
                self._adopting.add(task)
                task.add_done_callback(self._adopting.discard)

    def _factory(self, tcp: bool) -> Callable[[], WorkerConnection]:
        return lambda: WorkerConnection(self, next(self._ids), tcp=tcp)

    async def stop(self, grace: float = 5.0) -> None:
        """Take no more connections; the ones here answer what is in flight and close."""
        self.closing = True
        try:
            asyncio.get_running_loop().remove_reader(self.hand.fileno())
        except (ValueError, OSError):
            pass
        await self.drain_all(grace)

    async def check_socket(self) -> None:
        """The socket file is the feed's process's to watch."""


class Worker:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.stats = Stats()
        self._stop = asyncio.Event()

    async def run(self) -> None:
        spec, cfg = self.spec, self.spec.cfg
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(sig, self._stop.set)
        asked = asyncio.Event()  # SIGUSR1: the feed's process wants the counters now (Board.ask)
        loop.add_signal_handler(signal.SIGUSR1, asked.set)
        board = Board(spec.board, [b.name for b in cfg.buckets], cfg.workers, create=False)
        replica = Replica(os.path.join(cfg.data_dir, "replica"), readonly=True)
        # Only the buckets that replicate every key are answered here (no per-key plan, no
        # near cache: both live in the feed's process); any other key is planned False, so
        # its GET goes over the link. With the access log on, none: every read is recorded
        # by the one process that writes the log, as without workers every GET then takes
        # the command layer (kvcache.serve.resp_server.server_gets).
        gets = SERVER_GET.ServerGets(replica, lambda key: False, False)
        answered = [] if cfg.access_log_rate > 0 else [b for b in cfg.buckets if list(b.keys) == [">"]]
        gets.set_buckets([(b.name, board.witness(b.name), b.max_stale_ms, True) for b in answered],
                         cfg.default_bucket)
        server = WorkerServer(spec, self.stats, gets)
        await server.start()
        orphaned = loop.create_task(server.orphaned.wait())
        orphaned.add_done_callback(lambda _: self._stop.set())
        report = loop.create_task(self._report(board, server, asked))
        board.report(spec.index, {"pid": os.getpid()})
        log.info("worker %d (pid %d) serving", spec.index, os.getpid())
        try:
            await self._stop.wait()
        finally:
            report.cancel()
            orphaned.cancel()
            await server.stop(grace=spec.grace)
            self._write(board, server)

    async def _report(self, board: Board, server: WorkerServer, asked: asyncio.Event) -> None:
        while True:
            try:
                await asyncio.wait_for(asked.wait(), REPORT_S)
            except TimeoutError:
                pass
            asked.clear()
            self._write(board, server)
            if os.getppid() != self.spec.parent:  # the feed's process is gone
                log.warning("worker %d: the feed's process ended; stopping", self.spec.index)
                self._stop.set()

    def _write(self, board: Board, server: WorkerServer) -> None:
        if board.connections_asked():  # before the counters: their write says it is done
            self._write_connections(server)
        s = self.stats
        board.report(self.spec.index, {
            "pid": os.getpid(), "commands": s.commands, "gets_local": s.gets_local,
            "gets_notfound": s.gets_notfound, "clients": server.clients(),
            "connections_received": s.connections_received, "rejected_connections": s.rejected_connections,
            "protocol_errors": s.protocol_errors, "clients_cut_off": s.clients_cut_off,
            "reads_gathered": s.reads_gathered},
            server.gets.bucket_reads())


    def _write_connections(self, server: WorkerServer) -> None:
        """Each connection's last I/O and command (its GETs answered here never reach the feed's
        process), for CLIENT LIST and CLIENT INFO there (kvcache.serve.links)."""
        lines = []
        for c in server.connections:
            main_id = getattr(c, "main_id", 0)
            if main_id and not getattr(c, "piped", False):  # (a pipe: the feed's process sees it all)
                cmd = c.last_cmd.decode(errors="replace") if c.last_cmd else "NULL"
                lines.append(f"{main_id} {c._last_io} {cmd}\n")
        path = conns_path(self.spec.cfg.data_dir, self.spec.index)
        with open(path + ".tmp", "w") as f:
            f.writelines(lines)
        os.replace(path + ".tmp", path)


def main() -> int:
    spec: WorkerSpec = pickle.load(sys.stdin.buffer)
    logformat.setup(spec.cfg.log_level, spec.cfg.log_format)
    import uvloop

    try:
        uvloop.run(Worker(spec).run())
    except KeyboardInterrupt:
        pass
    if not native.all_native():
        log.debug("worker %d: implementations %s", spec.index, native.report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
