"""The Unix-socket RESP server: an asyncio Protocol per connection, replies in request order.

Pipelined requests that can be answered at once are answered in one write. A request that
needs NATS suspends the connection's reading until its reply is written, which keeps replies
in order and applies backpressure to a client that pipelines faster than upstream answers.
A client that does not read its replies is paused the same way (transport write buffer
limits), so neither can grow our memory without bound.
"""
from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import os
import socket
import stat
from typing import TYPE_CHECKING

from . import resp
from .errors import KvcacheError, ProtocolError

if TYPE_CHECKING:
    from .commands import Commands, Stats
    from .config import Config

log = logging.getLogger("kvcache.server")

WRITE_HIGH_WATER = 1 << 20
TOO_MANY_CLIENTS = resp.error("ERR max number of clients reached")


class Connection(asyncio.Protocol):
    __slots__ = ("srv", "id", "proto", "name", "transport", "reader", "_busy", "_closing",
                 "_paused_writing")

    def __init__(self, srv: "RespServer", conn_id: int) -> None:
        self.srv = srv
        self.id = conn_id
        self.proto = 2
        self.name = b""
        self.transport: asyncio.Transport | None = None
        self.reader = resp.RequestReader(srv.cfg.max_request_bytes, srv.cfg.max_args)
        self._busy: asyncio.Task | None = None
        self._closing = False
        self._paused_writing = False

    # ------------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.srv.stats.connections_received += 1
        if len(self.srv.connections) >= self.srv.cfg.max_clients:
            self.srv.stats.rejected_connections += 1
            transport.write(TOO_MANY_CLIENTS)  # type: ignore[attr-defined]
            transport.close()
            return
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)  # type: ignore[attr-defined]
        self.srv.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.srv.connections.discard(self)
        self._closing = True
        if self._busy is not None:
            self._busy.cancel()

    def data_received(self, data: bytes) -> None:
        try:
            self.reader.feed(data)
        except ProtocolError as e:
            self._protocol_error(e)
            return
        if self._busy is None:
            self._process()

    def pause_writing(self) -> None:
        self._paused_writing = True
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._paused_writing = False
        if self._busy is None and not self._closing:
            self.transport.resume_reading()
            self._process()

    # ------------------------------------------------------------------ request loop

    def _process(self) -> None:
        """Answer buffered requests until one needs NATS, the buffer is empty or we must wait."""
        out: list[bytes] = []
        dispatch = self.srv.commands.dispatch
        reader = self.reader
        while not self._closing and not self._paused_writing:
            try:
                args = reader.next_command()
            except ProtocolError as e:
                if out:
                    self.transport.write(b"".join(out))
                self._protocol_error(e)
                return
            if args is None:
                break
            try:
                reply = dispatch(self, args)
            except Exception:  # a bug must cost one reply, never the sidecar
                log.exception("command %r failed", args[:1])
                reply = resp.error("ERR internal error")
            if reply.__class__ is bytes:
                out.append(reply)
                continue
            if out:
                self.transport.write(b"".join(out))
                out = []
            self.transport.pause_reading()
            self._busy = asyncio.ensure_future(self._finish(reply))
            return
        if out:
            self.transport.write(b"".join(out))
        if self._closing and self.transport and not self.transport.is_closing():
            self.transport.close()

    async def _finish(self, pending) -> None:
        try:
            reply = await pending
        except asyncio.CancelledError:
            raise
        except KvcacheError as e:
            reply = resp.error(str(e) if str(e).startswith(("ERR", "READONLY")) else f"ERR {e}")
        except Exception:
            log.exception("async command failed")
            reply = resp.error("ERR internal error")
        self._busy = None
        if self.transport.is_closing():
            return
        self.transport.write(reply)
        if not self._paused_writing:
            self.transport.resume_reading()
        self._process()

    def close_after_reply(self) -> None:
        self._closing = True

    def _protocol_error(self, e: ProtocolError) -> None:
        """Framing is lost: say why, then close, as Redis does."""
        self.srv.stats.protocol_errors += 1
        msg = str(e)
        self.transport.write(resp.error(msg if msg.startswith("ERR") else f"ERR {msg}"))
        self._closing = True
        self.transport.close()

    async def drain(self) -> None:
        """Wait for the request in flight, if any (graceful shutdown)."""
        if self._busy is not None:
            try:
                await asyncio.shield(self._busy)
            except (asyncio.CancelledError, Exception):
                pass


class RespServer:
    def __init__(self, cfg: "Config", commands: "Commands", stats: "Stats") -> None:
        self.cfg = cfg
        self.commands = commands
        self.stats = stats
        self.path = os.path.abspath(cfg.socket_path)
        self.connections: set[Connection] = set()
        self._server: asyncio.AbstractServer | None = None
        self._ids = itertools.count(1)
        self._inode: int | None = None

    @property
    def client_count(self) -> int:
        return len(self.connections)

    async def start(self) -> None:
        claim_socket_path(self.path)
        loop = asyncio.get_running_loop()
        old_umask = os.umask(0o177)  # no window in which the socket is more open than asked
        try:
            self._server = await loop.create_unix_server(
                lambda: Connection(self, next(self._ids)), self.path, backlog=1024)
        except OSError as e:
            raise KvcacheError(f"cannot listen on {self.path}: {e.strerror}") from None
        finally:
            os.umask(old_umask)
        os.chmod(self.path, self.cfg.socket_mode)
        self._inode = os.stat(self.path).st_ino
        log.info("serving RESP on %s (mode %o)", self.path, self.cfg.socket_mode)

    async def stop(self, grace: float = 5.0) -> None:
        """Stop accepting, let requests in flight finish, close every connection, remove the socket."""
        if self._server is None:
            return
        self._server.close()
        conns = list(self.connections)
        if conns:
            await asyncio.wait([asyncio.ensure_future(c.drain()) for c in conns], timeout=grace)
        for c in conns:
            if c.transport and not c.transport.is_closing():
                c.transport.close()
        try:
            await asyncio.wait_for(self._server.wait_closed(), grace)
        except asyncio.TimeoutError:
            pass
        self._server = None
        self._remove_socket()

    def _remove_socket(self) -> None:
        try:
            if os.stat(self.path).st_ino == self._inode:
                os.unlink(self.path)
        except FileNotFoundError:
            pass


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
