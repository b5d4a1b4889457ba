"""The feed's process's side of `workers = N`: it binds the sockets, starts N worker processes
(kvcache.supervisors.worker), hands each connection it accepts to the next one in turn,
replaces one that dies, and stops them all first on shutdown. nginx's master and workers are
the model; the hand-over is Node's cluster's round robin: two processes accepting on one Unix
socket share its connections as the kernel wakes them, which here gave one worker 98% of
redis-benchmark's 50 connections. The feed's process itself serves only its workers' links,
on an internal socket.

A worker that dies takes its client connections with it (they see a closed connection, never
a wrong answer: every answer a worker gives is the GET path's over the board's verdict, or the
feed's process's own); it is started again at once, then after a growing pause if it keeps
dying (RESTART_MAX_S), and the feed never stops meanwhile.
"""
from __future__ import annotations

import asyncio
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import time

from ..config import Config
from ..errors import KvcacheError
from ..serve.resp_server import bind_unix, claim_socket_path
from ..serve.socket_file import SocketFile
from ..stats import WorkerTotals
from .board import WORKER_COUNTS, Board, board_path, conns_path
from .worker import WorkerSpec

log = logging.getLogger("kvcache.workers")

ACCEPT_BATCH = 64     # connections accepted per readiness of a listener, at most
READY_S = 30.0        # a worker not serving this long after its start is a failed start
RESTART_MAX_S = 10.0  # the longest pause before starting again a worker that keeps dying
STOP_S = 5.0          # past a worker's own grace for its requests in flight: SIGKILL


def main_socket_path(data_dir: str) -> str:
    """The feed's process's internal socket, which only its workers' links connect to."""
    return os.path.join(os.path.abspath(data_dir), "workers.sock")


class Workers:
    """N worker processes over the sockets `unix` and `tcp` (None: no TCP listener)."""

    def __init__(self, cfg: Config, board: Board, unix: socket.socket, inode: tuple[int, int],
                 tcp: socket.socket | None) -> None:
        self.cfg = cfg
        self.board = board
        self.unix = unix
        # the socket file `unix` is bound to (`inode`): made again when removed (check_socket)
        self.file = SocketFile(os.path.abspath(cfg.socket_path), cfg.socket_mode)
        self.file.bound(inode)
        self.tcp = tcp
        self.procs: list[subprocess.Popen | None] = [None] * cfg.workers
        self.hands: list[socket.socket | None] = [None] * cfg.workers  # our ends of the pairs
        self._next = 0  # the worker the next connection goes to
        self.started_at = [0.0] * cfg.workers
        self.restarts = [0] * cfg.workers
        self.retired: dict[str, int] = {}  # the counters of workers since replaced
        self.retired_reads: dict[str, tuple[int, int]] = {}
        self._watch: asyncio.Task | None = None
        self.grace = max(5.0, cfg.nats.request_timeout_ms / 1000 + 1)  # as the sidecar's own drain
        self._stopping = False

    def _spawn(self, i: int) -> subprocess.Popen:
        self.board.clear_worker(i)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        spec = WorkerSpec(cfg=self.cfg, index=i, hand_fd=theirs.fileno(),
                          board=board_path(self.cfg.data_dir), main_path=main_socket_path(self.cfg.data_dir),
                          parent=os.getpid(), grace=self.grace)
        try:
            # a session of its own: a terminal's Ctrl-C (SIGINT to the foreground group) reaches
            # the sidecar alone, which stops its workers in order instead of seeing them exit
            # and starting others; a worker whose sidecar is gone ends by itself (its pair closes)
            proc = subprocess.Popen([sys.executable, "-m", "kvcache.supervisors.worker"], stdin=subprocess.PIPE,
                                    pass_fds=[theirs.fileno()], close_fds=True, start_new_session=True)
        finally:
            theirs.close()
        assert proc.stdin is not None
        proc.stdin.write(pickle.dumps(spec))
        proc.stdin.close()
        ours.setblocking(False)
        old, self.hands[i] = self.hands[i], ours
        if old is not None:
            old.close()
        self.procs[i] = proc
        self.started_at[i] = time.monotonic()
        return proc

    async def start(self) -> None:
        """Start every worker and wait until each serves (its pid on the board)."""
        for i in range(self.cfg.workers):
            self._spawn(i)
        deadline = time.monotonic() + READY_S
        while not all(self.board.worker(i)["pid"] for i in range(self.cfg.workers)):
            for i, proc in enumerate(self.procs):
                if proc is not None and proc.poll() is not None:
                    raise KvcacheError(f"worker {i} exited with status {proc.returncode} as it started")
            if time.monotonic() > deadline:
                raise KvcacheError(f"the workers did not start within {READY_S:g}s")
            await asyncio.sleep(0.05)
        log.info("%d workers serving (pids %s)", self.cfg.workers,
                 " ".join(str(p.pid) for p in self.procs if p is not None))
        self._watch = asyncio.ensure_future(self._supervise())
        loop = asyncio.get_running_loop()
        loop.add_reader(self.unix.fileno(), self._accept, self.unix, b"u")
        if self.tcp is not None:
            loop.add_reader(self.tcp.fileno(), self._accept, self.tcp, b"t")

    def _accept(self, listener: socket.socket, kind: bytes) -> None:
        """Accept what is pending (at most ACCEPT_BATCH a turn) and hand each connection to the
        next live worker; with none to take it, the client sees it closed."""
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and kin: the next readiness tries again
                log.warning("accepting a connection for the workers failed: %s", e.strerror or e)
                return
            try:
                for _ in range(self.cfg.workers):
                    i = self._next
                    self._next = (i + 1) % self.cfg.workers
                    hand, proc = self.hands[i], self.procs[i]
                    if hand is None or proc is None or proc.poll() is not None:
                        continue
                    try:
                        socket.send_fds(hand, [kind], [conn.fileno()])
                        break
                    except OSError:
                        continue  # that worker is gone or cannot take it now: the next one
            finally:
                conn.close()  # the worker has its own descriptor now (or nobody took it)

    async def _supervise(self) -> None:
        """Replace a worker that exits while the sidecar serves."""
        while not self._stopping:
            await asyncio.sleep(0.2)
            for i, proc in enumerate(self.procs):
                if self._stopping or proc is None or proc.poll() is None:
                    continue
                lived = time.monotonic() - self.started_at[i]
                why = (f"was killed by signal {-proc.returncode}" if proc.returncode < 0
                       else f"exited with status {proc.returncode}")
                pause = 0.0 if lived > RESTART_MAX_S else min(RESTART_MAX_S, 0.5 * 2 ** min(self.restarts[i], 5))
                log.warning("worker %d (pid %d) %s; starting another%s", i, proc.pid, why,
                            f" in {pause:g}s" if pause else "")
                self.procs[i] = None
                self.restarts[i] += 1
                self._add(i, self.retired, self.retired_reads)
                if pause:
                    await asyncio.sleep(pause)
                if not self._stopping:
                    self._spawn(i)

    async def refresh(self, timeout: float = 0.5, connections: bool = False) -> None:
        """Every live worker's counters written now (INFO waits for it): asked on the board,
        signalled, awaited up to `timeout` (a worker too busy to answer shows its last ones).
        `connections`: their connections' state too (`connections`)."""
        want = self.board.ask(connections)
        live = [(i, p) for i, p in enumerate(self.procs) if p is not None and p.poll() is None
                and self.board.worker(i)["pid"]]
        for _, p in live:
            try:
                p.send_signal(signal.SIGUSR1)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        while any(self.board.answered(i) < want for i, _ in live) and time.monotonic() < deadline:
            await asyncio.sleep(0.001)

    async def connections(self) -> dict[int, tuple[int, bytes]]:
        """Every worker's connections as they last saw them: id in this process (their link's)
        -> (last I/O, monotonic ns; last command)."""
        await self.refresh(connections=True)
        seen: dict[int, tuple[int, bytes]] = {}
        for i in range(self.cfg.workers):
            try:
                with open(conns_path(self.cfg.data_dir, i), "rb") as f:
                    for line in f:
                        main_id, io, cmd = line.split()
                        seen[int(main_id)] = (int(io), cmd)
            except (OSError, ValueError):
                continue
        return seen

    def check_socket(self) -> None:
        """The socket file made again when removed under the workers (RespServer.check_socket
        without workers; kvcache.serve.socket_file says why): accepted here, so only this
        process's listener changes; the connections already handed over keep theirs."""
        if self._stopping or self.unix.fileno() < 0 or not self.file.needs_remaking():
            return
        try:
            claim_socket_path(self.file.path)
            sock, inode = bind_unix(self.file.path, self.file.mode)
        except (KvcacheError, OSError) as e:
            self.file.cannot_bind(e)
            return
        loop = asyncio.get_running_loop()
        loop.remove_reader(self.unix.fileno())
        self.unix.close()
        self.unix = sock
        loop.add_reader(sock.fileno(), self._accept, sock, b"u")
        self.file.remade(inode)

    def stop_accepting(self) -> None:
        """The socket file removed (new clients get ENOENT at once, as from the sidecar's own
        server), this process's copies of the listeners closed. Once only."""
        if self.unix.fileno() < 0:
            return
        loop = asyncio.get_running_loop()
        self.file.remove()
        for sock in (self.unix, self.tcp):
            if sock is not None:
                loop.remove_reader(sock.fileno())
                sock.close()

    async def stop(self, grace: float) -> None:
        """Stop accepting (stop_accepting: the workers' copies go as they stop), SIGTERM each
        (they answer what is in flight, within `grace`, and close), then SIGKILL past STOP_S more."""
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
        self.stop_accepting()
        live = [p for p in self.procs if p is not None and p.poll() is None]
        for p in live:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace + STOP_S
        while any(p.poll() is None for p in live) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for p in live:
            if p.poll() is None:
                log.warning("worker pid %d did not stop within %gs: killed", p.pid, STOP_S)
                p.kill()
                p.wait()
        for i in range(self.cfg.workers):  # what CLIENT LIST had them write (Board.ask)
            try:
                os.unlink(conns_path(self.cfg.data_dir, i))
            except OSError:
                pass

    def totals(self) -> WorkerTotals:
        """Every worker's counters from the board, and their sums with those of the workers
        replaced since start (INFO, /metrics)."""
        each = [self.board.worker(i) for i in range(self.cfg.workers)]
        total = dict(self.retired, clients=sum(w["clients"] for w in each))
        reads = dict(self.retired_reads)
        for i in range(self.cfg.workers):
            self._add(i, total, reads)
        return WorkerTotals(total, each, reads)

    def _add(self, i: int, total: dict[str, int], reads: dict[str, tuple[int, int]]) -> None:
        """Worker i's counts (WORKER_COUNTS, and its GETs per bucket) added to `total`, `reads`."""
        w = self.board.worker(i)
        for k in WORKER_COUNTS:
            total[k] = total.get(k, 0) + w[k]
        for bucket, (found, absent) in self.board.worker_reads(i).items():
            f0, a0 = reads.get(bucket, (0, 0))
            reads[bucket] = (f0 + found, a0 + absent)
