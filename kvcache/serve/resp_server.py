"""The RESP server's listeners: the Unix socket (and the TCP listener, `listen`), the
connections they accept up to max_clients (kvcache.serve.client_connection), and a graceful stop
(requests in flight finish, the socket file is removed).

Beside it, what the sidecar wires the server with: the GET fast path over the read policy
(server_gets, direct_buckets), the open-files limit max_clients needs, and the claim of the
socket path left by a dead process. One client's request loop is kvcache.serve.client_connection's.
"""
from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import os
import resource
import socket
import stat
from typing import TYPE_CHECKING

from ..errors import KvcacheError
from .client_connection import SERVER_GET, ClientConnection
from .links import LinkConnection
from .socket_file import SocketFile

if TYPE_CHECKING:
    from ..config import Config
    from ..read.ledger import Witness
    from ..read.policy import ReadPolicy
    from ..stats import Stats
    from .commands import Commands
    from .server_get import ServerGets

__all__ = ["FD_MARGIN", "ClientConnection", "RespServer", "bind_tcp", "bind_unix", "claim_socket_path",
           "direct_buckets", "listen_label", "raise_fd_limit", "server_gets"]

log = logging.getLogger("kvcache.server")

# File descriptors beyond max_clients: NATS connections, LMDB, logs, the listening socket.
FD_MARGIN = 256


class RespServer:
    """The Unix-socket listener: accepts client connections (ClientConnection) up to
    max_clients, shares the GET fast path and the command table among them, and stops
    gracefully (requests in flight finish, the socket file is removed)."""

    def __init__(self, cfg: Config, commands: Commands, stats: Stats, gets: ServerGets,
                 by_id: dict[int, ClientConnection], internal: str | None = None) -> None:
        self.cfg = cfg
        self.commands = commands
        self.stats = stats
        self.gets = gets  # the GET fast path (server_gets)
        # `internal`: with workers (kvcache.supervisors.workers), the feed's process listens
        # only there, mode 0600, for its workers' links; the workers serve the sockets
        self.internal = internal is not None
        self.path = os.path.abspath(internal or cfg.socket_path)
        self.mode = 0o600 if internal is not None else cfg.socket_mode
        self.connection_class = LinkConnection if internal is not None else ClientConnection
        self.connections: set[ClientConnection] = set()
        # REDIRECT targets and CLIENT LIST / KILL, by CLIENT ID (oldest first: ids grow); the
        # sidecar hands the same registry to tracking and the session commands
        self.by_id = by_id
        self.push_limit = cfg.pubsub_max_output_bytes
        self._tcp: asyncio.Server | None = None
        self._server: asyncio.AbstractServer | None = None
        self._ids = itertools.count(1)
        self.file = SocketFile(self.path, self.mode)  # made again when removed (check_socket)
        self.closing = False
        self.write_stall_s = cfg.client_write_stall_ms / 1000

    async def start(self) -> None:
        raise_fd_limit(self.cfg.max_clients + FD_MARGIN)
        claim_socket_path(self.path)
        loop = asyncio.get_running_loop()
        self.gets.call_soon = loop.call_soon
        try:
            self._server = await self._listen_unix()
        except OSError as e:
            raise KvcacheError(f"cannot listen on {self.path}: {e.strerror}") from None
        if self.internal:
            log.debug("serving the workers' links on %s", self.path)
            return
        log.info("serving RESP on %s (mode %o)", self.path, self.cfg.socket_mode)
        address = self.cfg.listen_address
        if address is not None:
            await self._listen_tcp(*address)

    async def _listen_unix(self) -> asyncio.AbstractServer:
        """A listener on the socket path, bound here (not by the loop) so that the umask that
        keeps it from being more open than socket_mode covers the bind alone, with no other
        callback running meanwhile. Raises OSError."""
        sock, inode = bind_unix(self.path, self.mode)
        try:  # from here the file is this listener's: removed if it cannot serve (or is cancelled)
            server = await asyncio.get_running_loop().create_unix_server(
                lambda: self.connection_class(self, next(self._ids)), sock=sock, backlog=1024)
        except BaseException:
            sock.close()
            try:
                os.unlink(self.path)
            except OSError:
                pass
            raise
        self.file.bound(inode)
        return server

    @property
    def socket_fault(self) -> str | None:
        """Why the socket is not served (removed, and it cannot be made again), else None:
        /readyz says it."""
        return self.file.fault

    async def check_socket(self) -> None:
        """Is the socket file still the one bound? (A stat: the sidecar asks every CHECK_S
        seconds; kvcache.serve.socket_file says why.) Made again when it is not (a stale
        socket at the path is replaced, as at start); when it cannot be (its directory gone
        too, another process serving there, a file there), `socket_fault` until it can."""
        if self._server is None or self.closing or not self.file.needs_remaking():
            return
        old = self._server
        try:
            claim_socket_path(self.path)
            self._server = await self._listen_unix()
        except (KvcacheError, OSError) as e:
            self.file.cannot_bind(e)
            return
        if old is not None:
            old.close()  # the file it listened on is gone; its clients keep their connections
        self.file.remade(self.file.inode)  # type: ignore[arg-type]  # set by _listen_unix

    async def _listen_tcp(self, host: str, port: int) -> None:
        """The TCP listener (`listen`): for pods whose containers share no volume, and for
        clients whose client-side cache works over TCP only (redis-py)."""
        loop = asyncio.get_running_loop()
        try:
            self._tcp = await loop.create_server(
                lambda: ClientConnection(self, next(self._ids), tcp=True), host, port,
                backlog=1024, reuse_address=True)
        except OSError as e:
            raise KvcacheError(f"cannot listen on {self.cfg.listen}: {e.strerror}") from None
        for sock in self._tcp.sockets:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.stats.listen = listen_label(self._tcp.sockets[0])
        if self.cfg.requirepass:
            log.info("serving RESP on %s (TCP, AUTH required)", self.stats.listen)
        else:
            log.warning("serving RESP on %s (TCP) without a password: any local process can "
                        "read through it (set requirepass_file or KVCACHE_REQUIREPASS)", self.stats.listen)

    @property
    def tcp_port(self) -> int | None:
        """The TCP listener's port (`listen` may ask for port 0), None without one."""
        if self._tcp is None or not self._tcp.sockets:
            return None
        return self._tcp.sockets[0].getsockname()[1]

    async def stop(self, grace: float = 5.0) -> None:
        """Stop accepting, let requests in flight finish, close every connection, remove the socket."""
        if self._server is None:
            return
        self.closing = True
        self._server.close()
        if self._tcp is not None:
            self._tcp.close()
        self._remove_socket()  # new clients get ENOENT at once, not a connection we drop
        # a blocked stream read is a request in flight that never ends by itself: end it
        # with its error reply first, so the drain below waits only for real requests
        self.commands.streams.end_all("kvcache is shutting down")
        await self.drain_all(grace)
        for server in (self._server, self._tcp):
            if server is None:
                continue
            try:
                await asyncio.wait_for(server.wait_closed(), grace)
            except TimeoutError:
                pass
        self._server = self._tcp = None
        self._remove_socket()

    async def drain_all(self, grace: float) -> None:
        """Every connection answers what is in flight (within `grace`) and closes."""
        conns = list(self.connections)
        if conns:
            await asyncio.wait([asyncio.ensure_future(c.drain()) for c in conns], timeout=grace)
        for c in conns:
            if c.transport and not c.transport.is_closing():
                c.transport.close()

    def _remove_socket(self) -> None:
        self.file.remove()



def _no_plan(key: bytes) -> bool:
    return False


def server_gets(cfg: Config, policy: ReadPolicy, every_get_to_commands: bool) -> ServerGets:
    """The GET fast path (kvcache.serve.server_get, in C when built) over the read policy's plans.
    `every_get_to_commands` (the access log is on: every GET must be logged): it plans
    nothing. Call `direct_buckets` once the feeds exist."""
    return SERVER_GET.ServerGets(policy.replica, _no_plan if every_get_to_commands else policy.plan)


def direct_buckets(gets: ServerGets, cfg: Config, witnesses: dict[str, Witness]) -> None:
    """Tell the fast path each bucket's witness (kvcache.read.ledger) and bound, which
    replicate every key, and which replicate none and have a near cache (their keys need no
    plan: the replica, or the cache); not with the access log on (server_gets)."""
    gets.set_buckets([(b.name, witnesses[b.name], b.max_stale_ms, list(b.keys) == [">"],
                       witnesses[b.name].cache if list(b.keys) == [] else None)
                      for b in cfg.buckets], cfg.default_bucket)


def bind_unix(path: str, mode: int) -> tuple[socket.socket, tuple[int, int]]:
    """A listening Unix socket at `path` with file mode `mode`, and the file's (st_dev,
    st_ino). Bound under a umask that keeps it from being more open than `mode` for the bind
    alone, with no other callback running meanwhile. Raises OSError (the file removed)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        sock.bind(path)
    except BaseException:
        sock.close()
        raise
    finally:
        os.umask(old_umask)
    try:
        os.chmod(path, mode)
        st = os.stat(path)
        sock.listen(1024)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        try:
            os.unlink(path)
        except OSError:
            pass
        raise
    return sock, (st.st_dev, st.st_ino)


def listen_label(sock: socket.socket) -> str:
    """A bound TCP listener's address as INFO's `listen` shows it (an IPv6 host in brackets)."""
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_tcp(host: str, port: int) -> socket.socket:
    """The TCP listener (`listen`) as a socket, for worker processes to accept on. Raises OSError."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by what it accepts
        sock.bind((host, port))
        sock.listen(1024)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def raise_fd_limit(wanted: int) -> int:
    """Raise the soft RLIMIT_NOFILE toward `wanted` (never above the hard limit, never
    lowering it), so max_clients connections do not fail at accept with EMFILE under a
    default soft limit of 1024. Returns the soft limit in force."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return -1
    if soft == resource.RLIM_INFINITY or (soft >= wanted):
        return soft
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (OSError, ValueError) as e:
            log.warning("cannot raise the open-files limit from %d to %d: %s", soft, target, e)
    if soft < wanted:
        log.warning("open-files limit %d (hard %s) is below max_clients + %d = %d: clients "
                    "beyond it will be refused at accept", soft,
                    "unlimited" if hard == resource.RLIM_INFINITY else hard, FD_MARGIN, wanted)
    return soft


def claim_socket_path(path: str) -> None:
    """Replace a stale socket left by a dead process; refuse a live one or a non-socket file."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise KvcacheError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except OSError as e:
        if e.errno in (errno.ECONNREFUSED, errno.ENOENT):
            log.info("removing stale socket %s", path)
            os.unlink(path)
            return
        raise KvcacheError(f"cannot check existing socket {path}: {e.strerror}") from None
    finally:
        probe.close()
    raise KvcacheError(f"another process is already serving on {path}")
