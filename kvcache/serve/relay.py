"""A worker process's client connections: the GET path answers from the replica; everything
else goes to the feed's process, which owns NATS, the read ledger and every per-connection
state (kvcache.supervisors.worker says why).

Each client connection of a worker has one link to the feed's process (its internal socket,
`<data_dir>/workers.sock`), opened as the client connects: there it is an ordinary client
connection, so CLIENT LIST, CLIENT KILL, CLIENT ID and REDIRECT see every client of every
worker, and a command relayed runs with everything that connection was told before.

Two ways a command travels the link:
- *counted*: a command that leaves the connection's state as the GET path reads it (a GET
  the replica cannot answer, KV.GET, MGET, INFO, CLIENT SETNAME, ...) is sent and answered by
  the next reply on the link; the connection's request loop waits for it as for a read that
  needs NATS (kvcache.serve.client_connection), with the commands pipelined behind it sent
  too (`pipelined_keys`), so replies stay in request order. After each such reply the GET
  path asks its witnesses again (a reply from NATS may have placed a hold).
- *piped*: a command after which the GET path may not answer for the connection any more
  (HELLO, MULTI, WATCH, SUBSCRIBE and its kin, CLIENT TRACKING, CLIENT REPLY, RESET, MONITOR,
  SELECT) makes the connection a pipe for the rest of its life, once every reply before it
  is out: the client's socket is handed to a RawPipe, the bytes not yet read go to the link
  as they are and so does everything after; whatever the link carries (replies, invalidations,
  messages) goes to the client as it comes. The feed's process then sees the client's bytes
  themselves (a protocol error, QUIT under CLIENT REPLY OFF: its own rules), and nothing is
  answered here, so nothing can overtake a reply.

The link's first command tells the feed's process who the client is (KVCACHE.LINK,
kvcache.serve.links): a TCP client must AUTH there as on a sidecar without workers. Until it
has, the GET path here stands aside (every command goes over the link, which answers NOAUTH);
an AUTH answered +OK lets it answer again.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque

from .. import resp
from ..errors import KvcacheError
from .client_connection import ClientConnection
from .command_table import listed_name

log = logging.getLogger("kvcache.worker")

# Commands after which the connection is a pipe (see the module docstring)
PIPED = frozenset({b"hello", b"multi", b"watch", b"subscribe", b"psubscribe", b"ssubscribe",
                   b"reset", b"monitor", b"select"})
PIPED_CLIENT = frozenset({b"tracking", b"reply", b"caching"})
LINK_DOWN = "ERR kvcache: the feed's process did not answer (its worker link is closed)"


def makes_pipe(args: list[bytes]) -> bool:
    """Is the command one after which the connection is a pipe (PIPED, PIPED_CLIENT)?"""
    name = args[0].lower()
    return name in PIPED or (name == b"client" and len(args) > 1 and args[1].lower() in PIPED_CLIENT)


def command_bytes(args: list[bytes]) -> bytes:
    """A command as a RESP multibulk."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


def reply_end(buf: bytes | bytearray, pos: int = 0) -> int:
    """Where the complete RESP2/RESP3 reply starting at `pos` ends (the offset after it), or
    -1 while it is incomplete. Aggregates are walked with a count of what they still hold."""
    pending = 1  # replies still to read at this level and above, flattened
    n = len(buf)
    while pending:
        if pos >= n:
            return -1
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return -1
        kind = buf[pos]
        pending -= 1
        if kind in b"$=!":  # blob string, verbatim, blob error: a length, then the bytes
            size = int(buf[pos + 1:eol])
            if size < 0:
                pos = eol + 2
                continue
            end = eol + 2 + size + 2
            if end > n:
                return -1
            pos = end
        elif kind in b"*~>":  # array, set, push
            count = int(buf[pos + 1:eol])
            pending += max(count, 0)
            pos = eol + 2
        elif kind in b"%|":  # map, attribute: two per entry
            pending += 2 * int(buf[pos + 1:eol])
            if kind == ord("|"):
                pending += 1  # an attribute precedes the reply it describes
            pos = eol + 2
        else:  # + - : _ # , ( : one line
            pos = eol + 2
    return pos


class MainLink(asyncio.Protocol):
    """One client connection's link to the feed's process (see the module docstring)."""

    def __init__(self, conn: WorkerConnection, announce: bytes) -> None:
        self.conn = conn
        self.transport: asyncio.Transport | None = None
        # the replies awaited, in order; None: KVCACHE.LINK's, handled here as it comes
        self.waiting: deque[asyncio.Future[bytes] | None] = deque()
        self.buf = bytearray()
        self.closed = False
        self.done = asyncio.Event()  # set once closed
        # sent before the link was up; first, the KVCACHE.LINK that says who the client is
        # (its reply is the link's first, and `_told`'s: `waiting` starts with None for it)
        self._queued: list[bytes] = [announce]
        self.waiting.append(None)
        # the worker's links not yet closed: a client counts on its worker until its link is
        # gone too, since until then it may still count in the feed's process (max_clients)
        conn.srv.links.add(self)  # type: ignore[attr-defined]  # a WorkerServer's

    def _told(self, reply: bytes) -> None:
        """KVCACHE.LINK's answer, `:<id>`: the client's id in the feed's process. Anything else
        is the feed's process refusing the client (max_clients counts every worker's, there):
        the client gets the reply, and the link closes after it."""
        if reply.startswith(b":"):
            self.conn.main_id = int(reply[1:-2])
        else:
            self.conn.from_link(reply)

    # --------------------------------------------------------------- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream's
        if self.closed:  # the client left while the link was being made
            transport.close()
            return
        if self._queued:
            transport.write(b"".join(self._queued))  # type: ignore[attr-defined]
            self._queued.clear()

    def data_received(self, data: bytes) -> None:
        if self.conn.piped:
            self.conn.from_link(data)
            return
        buf = self.buf
        buf += data
        while self.waiting:
            end = reply_end(buf)
            if end < 0:
                break
            reply = bytes(buf[:end])
            del buf[:end]
            fut = self.waiting.popleft()
            if fut is None:
                self._told(reply)
            elif not fut.done():
                fut.set_result(reply)
        if buf and not self.waiting:  # nothing asked for it (the feed's process closing)
            self.conn.from_link(bytes(buf))
            buf.clear()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.done.set()
        self.conn.srv.links.discard(self)  # type: ignore[attr-defined]
        while self.waiting:
            fut = self.waiting.popleft()
            if fut is not None and not fut.done():
                fut.set_exception(KvcacheError(LINK_DOWN))
        self.conn.link_lost()

    # --------------------------------------------------------------- the connection's side

    def send(self, payload: bytes) -> None:
        """Piped: write, no reply awaited here."""
        if self.closed:
            return
        if self.transport is None:
            self._queued.append(payload)
        else:
            self.transport.write(payload)

    async def request(self, payload: bytes) -> bytes:
        """Counted: write, and the next reply on the link is this one's."""
        if self.closed:
            raise KvcacheError(LINK_DOWN)
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.waiting.append(fut)
        self.send(payload)
        return await fut

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
        elif self.transport is None:
            self.closed = True


class WorkerConnection(ClientConnection):
    """A worker's client connection: ClientConnection with its link (see the module docstring)."""

    __slots__ = ("link", "main_id", "piped")

    def __init__(self, srv, conn_id: int, tcp: bool = False) -> None:
        super().__init__(srv, conn_id, tcp)
        self.piped = False
        self.link: MainLink | None = None
        self.main_id = 0  # the client's id in the feed's process (KVCACHE.LINK's answer)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self._closing:  # refused (max_clients, shutting down)
            return
        addr, laddr = self.addresses()
        link = self.link = MainLink(self, command_bytes(
            [b"KVCACHE.LINK", b"0" if self.unix else b"1", addr.encode(), laddr.encode()]))
        loop = asyncio.get_running_loop()
        task = loop.create_task(loop.create_unix_connection(lambda: link, self.srv.main_path))  # type: ignore[attr-defined]
        task.add_done_callback(self._linked)

    def _linked(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is not None:
            error = None if task.cancelled() else task.exception()
            log.warning("cannot reach the feed's process at %s: %s", self.srv.main_path, error)  # type: ignore[attr-defined]
            if self.link is not None:
                self.link.connection_lost(None)

    def from_link(self, data: bytes) -> None:
        """Bytes from the feed's process for the client as they are (piped, or unasked for)."""
        if not self.transport.is_closing():
            self.transport.write(data)

    def link_lost(self) -> None:
        """The feed's process closed the link (CLIENT KILL, QUIT, its shutdown): so does the
        client's connection, once what was written to it is out."""
        self._closing = True
        if not self.transport.is_closing():
            self.transport.close()

    def pipe(self, first: bytes) -> None:
        """From now on a pipe (see the module docstring): `first`, the command that made it
        one, and every byte after it go to the link as they are. Runs once the request loop
        has written every reply before it (the loop waits on a future that never ends)."""
        link = self.link
        if link is None or self._closing or self.transport.is_closing():
            return
        if link.waiting:  # the link's own first reply (KVCACHE.LINK's) is still to come
            asyncio.get_running_loop().call_later(0.001, self.pipe, first)
            return
        self.piped = True
        rest = self.reader.take_rest()
        pipe = RawPipe(self, link)
        self.transport.set_protocol(pipe)
        link.send(first + rest)
        if link.buf:
            self.from_link(bytes(link.buf))
            link.buf.clear()
        if self._eof:
            pipe.eof_received()
        self.transport.resume_reading()

    async def drain(self) -> None:
        """Graceful shutdown: a pipe half-closes its link, so the feed's process answers what
        it was sent and closes it (then so does the client's connection, link_lost)."""
        if not self.piped:
            await super().drain()
            return
        self._draining = True
        link = self.link
        if link is not None and link.transport is not None and not link.transport.is_closing():
            if link.transport.can_write_eof():
                link.transport.write_eof()
            await link.done.wait()
        if not self.transport.is_closing():
            self.transport.close()

    def pause_writing(self) -> None:
        """The client reads no more: neither does its link, so that replies wait in the feed's
        process (whose own backpressure stops it reading the link), not in this one's memory."""
        super().pause_writing()
        if self.link is not None and self.link.transport is not None and not self.link.transport.is_closing():
            self.link.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.piped:  # no request loop to resume: the pipe reads the client again
            self._paused_writing = False
            self._disarm_stall()
            if not self._closing:
                self.transport.resume_reading()
        else:
            super().resume_writing()
        if self.link is not None and self.link.transport is not None and not self.link.transport.is_closing():
            self.link.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self.link is not None:
            self.link.close()


class RawPipe(asyncio.Protocol):
    """A piped worker connection's socket (see the module docstring): bytes to the link as
    they come; its end, and its backpressure, passed on."""

    def __init__(self, conn: WorkerConnection, link: MainLink) -> None:
        self.conn = conn
        self.link = link

    def data_received(self, data: bytes) -> None:
        self.link.send(data)

    def eof_received(self) -> bool:
        t = self.link.transport
        if t is not None and not t.is_closing() and t.can_write_eof():
            t.write_eof()  # the feed's process answers what it was sent, then closes the link
        return True

    def pause_writing(self) -> None:
        self.conn.pause_writing()

    def resume_writing(self) -> None:
        self.conn.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.conn.connection_lost(exc)


class _NoStreams:
    """A worker blocks no stream read of its own (XREAD runs in the feed's process)."""

    def end_all(self, why: str) -> None:
        pass


class RelayCommands:
    """A worker's command layer (the `commands` of its server): QUIT here, everything else over
    the connection's link (see the module docstring)."""

    streams = _NoStreams()
    tracking = None

    def pipelined_keys(self, args: list[bytes]) -> tuple | None:
        """Counted commands pipeline over the link: the feed's process answers a connection's
        commands in order, so the connection's request loop may send the ones buffered behind
        a command in flight (ClientConnection._run_ahead) with no key of its own to wait on
        (the empty tuple). QUIT, answered here, AUTH, whose +OK lets the GET path answer
        here, and a command that makes the connection a pipe wait for every reply before them
        (None)."""
        return None if makes_pipe(args) or args[0].lower() in (b"auth", b"quit") else ()

    def forget(self, conn: WorkerConnection) -> None:
        if conn.link is not None:
            conn.link.close()

    def dispatch(self, conn: WorkerConnection, args: list[bytes]):  # -> bytes | Awaitable[bytes]
        name = args[0].lower()
        conn.last_cmd = listed_name(args)  # CLIENT LIST's cmd, as the feed's process would set it
        if name == b"quit":
            conn.close_after_reply()
            return resp.OK
        link = conn.link
        if link is None:
            return resp.error(LINK_DOWN)
        if makes_pipe(args):
            # the request loop writes what is answered, then waits on this for ever: the pipe
            # takes the socket over at the next turn of the event loop
            never: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_soon(conn.pipe, command_bytes(args))
            return never
        return self._counted(conn, link, command_bytes(args), name == b"auth")

    async def _counted(self, conn: WorkerConnection, link: MainLink, payload: bytes, auth: bool) -> bytes:
        reply = await link.request(payload)
        conn.srv.gets.forget_fresh()
        if auth and reply == resp.OK and not conn.authenticated:  # the GET path may answer now
            conn.authenticated = True
            conn.refresh_path()
        return reply
