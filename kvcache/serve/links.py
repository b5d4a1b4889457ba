"""The feed's process's side of its workers' links (kvcache.serve.relay is the workers' side).

With `workers = N`, the feed's process accepts only on its internal socket, one connection per
client of a worker. Each is a LinkConnection: an ordinary client connection, but for the first
command a worker sends on it, `KVCACHE.LINK <tcp 0|1> <addr> <laddr>`, which says who the
client is (answered with the connection's id here, which the worker's reports use). From then
on the connection stands for that client: AUTH applies to it as to a TCP client when it is one
(RESET takes it away again, HELLO's AUTH gives it), and CLIENT LIST, CLIENT INFO and CLIENT
KILL ADDR/LADDR/TYPE see the client's own addresses, not the internal socket's, and its idle
time and last command as the worker last saw them (`seen_in_worker`: asked of every worker
before each CLIENT LIST and CLIENT INFO, kvcache.supervisors.workers). The command exists only
here: on the sockets clients use it is unknown.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from .. import resp
from .client_connection import ClientConnection

LINK = b"KVCACHE.LINK"
LINK_ARGS = 4
LINK_BYTES = 4096  # two addresses: a socket path (at most 107 bytes) or an ip:port each


class LinkConnection(ClientConnection):
    """A worker's client, as the feed's process serves it (see the module docstring)."""

    __slots__ = ("peer", "refused")

    def __init__(self, srv, conn_id: int, tcp: bool = False) -> None:  # srv: a Listener
        super().__init__(srv, conn_id, tcp)
        self.peer: tuple[str, str] | None = None  # the client's (addr, laddr), once told
        self.refused = False  # over max_clients or shutting down: see connection_made
        # room for KVCACHE.LINK itself under any max_args and max_request_bytes; the client's
        # own limits apply from the next command on (_link)
        self.reader.max_args = max(LINK_ARGS, srv.cfg.max_args)
        self.reader.max_request_bytes = max(LINK_BYTES, srv.cfg.max_request_bytes)

    def _refused(self, stream: asyncio.Transport) -> None:
        """Refused as a client on the socket would be (max_clients counts every worker's
        clients here), but half-closed: the worker's KVCACHE.LINK, and what its client sent
        meanwhile, may be unread, and a Unix socket closed with unread data resets its peer,
        whose read then loses the reply (the client saw a closed connection, not why). The
        worker passes the reply on and closes the link; until then what it sends is dropped."""
        self.refused = True
        stream.write_eof()

    def data_received(self, data: bytes) -> None:
        if not self.refused:
            super().data_received(data)

    def eof_received(self) -> bool:
        if self.refused:
            self.transport.close()
            return False
        return super().eof_received()

    def seen_in_worker(self, last_io: int, cmd: bytes) -> None:
        """What the worker saw of the client last: it reads every byte the client sends and
        names every command (its GETs answered there never come here), so CLIENT LIST's idle
        and cmd are its (not for a piped connection, which it no longer reads: kvcache.serve.relay)."""
        self._last_io = last_io
        self.last_cmd = None if cmd == b"NULL" else cmd

    def reading(self) -> bool:
        """The worker reads the client for as long as the link is open (CLIENT LIST's `r`),
        also while this connection waits on a command it runs for it."""
        return not self._closing and self.transport is not None and not self.transport.is_closing()

    def addresses(self) -> tuple[str, str]:
        return self.peer if self.peer is not None else super().addresses()

    def _dispatch(self, args: list[bytes]) -> bytes | Awaitable[bytes]:
        if args[0] == LINK and self.peer is None:
            return self._link(args)
        return super()._dispatch(args)

    def _link(self, args: list[bytes]) -> bytes:
        if len(args) != 4 or args[1] not in (b"0", b"1"):
            return resp.error("ERR KVCACHE.LINK tcp addr laddr")
        tcp = args[1] == b"1"
        self.needs_auth = tcp
        self.authenticated = not (tcp and self.srv.cfg.requirepass)
        self.peer = (args[2].decode(errors="replace"), args[3].decode(errors="replace"))
        self.reader.max_args = self.srv.cfg.max_args
        self.reader.max_request_bytes = self.srv.cfg.max_request_bytes
        self.refresh_path()
        return resp.integer(self.id)  # the worker keeps it: its reports name the client by it
