"""One client connection of the RESP server: an asyncio Protocol, replies in request order.

Pipelined requests that can be answered at once are answered in one write (one per 256 KiB
of replies). A request that needs NATS suspends the connection's reading until its reply is
written, which keeps replies in order and applies backpressure to a client that pipelines
faster than upstream answers. Pipelined reads (GET, MGET) behind a read that went to NATS
are sent too, up to PIPELINE_MAX in flight, so a pipeline of cold keys costs about one round
trip, not one per key; their replies wait in `_replies` and leave in request order. A read
runs ahead only when no read of one of its keys is in flight on the connection (a later read
of a key must not be answered before an earlier one: floors would then not keep them in
order), and only plain reads do: the first other command waits for everything before it.
A client that does not read its replies is paused the same way (transport write buffer
limits), so neither can grow our memory without bound; one that then reads nothing at all of
what is queued for `client_write_stall_ms` is cut off (its output buffer stayed above the
high-water mark without draining), as Redis's client-output-buffer-limit does, so it does not
hold its slot and buffers for ever.

Local GETs, the bulk of the traffic, skip the generic dispatch: see ClientConnection._process.

A module of its own, apart from the listener (kvcache.serve.resp_server), because the connection is
the request loop and everything a client's state means (CLIENT REPLY, CLIENT LIST's line, the
output buffer limit), while the listener only accepts, counts and stops. What the connection
needs of its listener is the Protocol `Listener`, so this module does not import the server
that constructs it (no import cycle).
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Iterable
from typing import TYPE_CHECKING, Protocol, cast

from .. import native, resp
from ..errors import KvcacheError, ProtocolError
from .server_get import FLUSH_AT, GET_CMD

if TYPE_CHECKING:
    from ..config import Config
    from ..stats import Stats
    from .commands import Commands
    from .server_get import ServerGets
    from .tracking_mode import ClientTracking

log = logging.getLogger("kvcache.server")

# The request parser and the GET path: Cython extensions when built, else their pure-Python
# twins (same API). The listener builds its ServerGets from this same SERVER_GET, so the
# connection and the fast path it drives are always the same implementation.
WIRE = native.load("resp")
SERVER_GET = native.load("server_get")

WRITE_HIGH_WATER = 1 << 20
# From this many connected clients on, the native GET path defers GET-only reads to the end of
# the event loop's iteration and answers them together (ext/server_get.pyx, _stash): with one
# client there is nothing to gather, and the deferral would only add a callback per request.
DEFER_FROM = 2
# Pipelined replies waiting on one connection, and keys of its reads in flight (see the module
# docstring): what a pipeline may hold of the sidecar's memory and of NATS's attention at once
PIPELINE_MAX = 512
TOO_MANY_CLIENTS = resp.error("ERR max number of clients reached")
SHUTTING_DOWN = resp.error("ERR kvcache is shutting down")


if TYPE_CHECKING:  # the twin's class stands for both: same attributes, same methods
    from .server_get import GetConnection as _GetConnection
else:
    _GetConnection = SERVER_GET.GetConnection


class Listener(Protocol):
    """What a connection needs of the listener that accepted it (kvcache.serve.resp_server's
    RespServer): the shared GET path, command table and counters, the registry it joins and
    leaves, and the limits it applies."""

    cfg: Config
    commands: Commands
    stats: Stats
    gets: ServerGets
    path: str                                  # the Unix socket's path (CLIENT LIST's addr)
    connections: set[ClientConnection]
    by_id: dict[int, ClientConnection]
    closing: bool                              # stopping: new connections are refused
    push_limit: int                            # pubsub_max_output_bytes
    write_stall_s: float                       # client_write_stall_ms, in seconds


class ClientConnection(_GetConnection, asyncio.Protocol):
    """One client. The per-read hot path (data_received, and the state it reads: transport,
    reader, proto and the flags) is GetConnection's, in C when built; the rest is here."""

    __slots__ = (
        "_busy_argv",
        "_drop_busy",
        "_in_flight",
        "_in_process",
        "_pushq",
        "_replies",
        "_reply_off",
        "_skip",
        "_skip_next",
        "_stall",
        "_stall_size",
        "_waiting",
        "after_reply",
        "authenticated",
        "channels",
        "confirmations",
        "created",
        "exec_keys",
        "gate",
        "id",
        "in_exec",
        "lib_name",
        "lib_ver",
        "multi",
        "multi_failed",
        "name",
        "needs_auth",
        "no_evict",
        "no_touch",
        "patterns",
        "srv",
        "tracking",
        "watch_dirty",
        "watching",
    )

    def __init__(self, srv: Listener, conn_id: int, tcp: bool = False) -> None:
        super().__init__(srv.gets, srv.stats,
                         WIRE.RequestReader(srv.cfg.max_request_bytes, srv.cfg.max_args))
        self.srv = srv
        self.id = conn_id
        self.created = time.monotonic_ns()  # CLIENT LIST's age
        self.name = b""
        self.lib_name = b""  # CLIENT SETINFO
        self.lib_ver = b""
        # AUTH: TCP clients must give the password when one is set; the Unix socket's file
        # mode is its guard (kvcache.serve.commands_session)
        self.needs_auth = tcp
        self.authenticated = not (tcp and srv.cfg.requirepass)
        # Connection state the command layer keeps (kvcache.serve.commands_session and the
        # server_* modules it uses): tracking mode, subscriptions, MULTI queue, WATCHed keys.
        self.tracking: ClientTracking | None = None
        self.channels: set[bytes] = set()
        self.patterns: set[bytes] = set()
        self.multi: list[list[bytes]] | None = None
        self.multi_failed = False
        self.in_exec = False
        self.exec_keys: list[bytes] = []
        self.watching: set[tuple[str, str]] = set()
        self.watch_dirty = False
        self.after_reply: list[bytes] = []  # keys to invalidate once the reply in flight is written
        # Pushes (invalidations, messages) raised while _process assembles replies wait for
        # them: a push never lands inside or ahead of a reply being built.
        self._in_process = False
        self._pushq: list[bytes] = []
        # `gate`: the command layer must look at every command first (not authenticated, in
        # MULTI, RESP2 subscribed); with it, tracking or a CLIENT REPLY mode, the GET fast
        # path stands aside (GetConnection._muted): see refresh_path.
        self.gate = not self.authenticated
        self._stall: asyncio.TimerHandle | None = None  # the cut-off timer while paused
        self._stall_size = 0                             # write buffer size when armed
        # CLIENT REPLY, as Redis keeps it: OFF; SKIP (this command's reply is dropped);
        # SKIP_NEXT (set by CLIENT REPLY SKIP, becomes SKIP once that command is done).
        # GetConnection._muted says whether any is set.
        self._reply_off = self._skip = self._skip_next = False
        # The reply of the command in flight is to be dropped: what goes out instead (its
        # pub/sub confirmations), None while it is not.
        self._drop_busy: bytes | None = None
        # Pub/sub confirmations of the command running while its reply is dropped (`silenced`):
        # Redis sends them anyway, as pushes (CLIENT_PUSHING lifts CLIENT REPLY OFF and SKIP,
        # in RESP2 as in RESP3), so a client that waits for them does not wait for ever.
        self.confirmations: list[bytes] = []
        self._muted = self.gate
        self.no_evict = self.no_touch = False  # CLIENT NO-EVICT / NO-TOUCH: shown, nothing more
        self._busy_argv = 0  # argument bytes of the commands waiting for NATS (argv-mem)
        # Replies in request order while any waits for NATS: bytes, or the future of a command
        # in flight; `_busy` (the hot path's flag: buffer, answer nothing) is the first future.
        self._replies: deque[bytes | asyncio.Future] = deque()
        self._in_flight: dict[tuple[str, str], int] = {}  # keys of the pipelined reads in flight
        # A command read behind reads in flight that may not run ahead: it runs once they are
        # answered (a ProtocolError: the framing error to answer then).
        self._waiting: list[bytes] | ProtocolError | None = None

    @property
    def subscribed(self) -> bool:
        return bool(self.channels or self.patterns)

    @property
    def silenced(self) -> bool:
        """CLIENT REPLY OFF, or SKIP for the command running now: its reply is dropped."""
        return self._reply_off or self._skip

    def refresh_path(self) -> None:
        """After any change of the state the command layer looks at: does every command go
        through it (`gate`), and may GETs still take the fast path (`_muted` clear)?"""
        self.gate = (not self.authenticated or self.multi is not None
                     or (self.proto == 2 and bool(self.channels or self.patterns)))
        self._muted = (self.gate or self.tracking is not None or self._reply_off or self._skip
                       or self._skip_next)

    def push(self, data: bytes) -> None:
        """Out-of-band data for this client (an invalidation, a pub/sub message), written at
        once unless replies are being assembled (then right after them). A client whose
        pending output passes pubsub_max_output_bytes is cut off, alone."""
        if self._closing:
            return
        if self._in_process:
            self._pushq.append(data)
            return
        transport = self.transport
        transport.write(data)
        size = transport.get_write_buffer_size()
        if size > self.srv.push_limit:
            log.warning("client %d has %d bytes of messages it does not read (over "
                        "pubsub_max_output_bytes %d): disconnecting", self.id, size, self.srv.push_limit)
            self.srv.stats.clients_cut_off += 1
            self.srv.stats.subscribers_cut_off += 1
            self._closing = True
            transport.abort()

    # ------------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream socket's transport: asyncio types the callback with the base class
        self.transport = stream = cast(asyncio.Transport, transport)
        srv = self.srv
        srv.stats.connections_received += 1
        refusal = self.refusal()
        if refusal is not None:
            srv.stats.rejected_connections += 1
            self._closing = True
            stream.write(refusal)
            self._refused(stream)
            return
        stream.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        srv.connections.add(self)
        srv.by_id[self.id] = self
        srv.stats.connected_clients = len(srv.connections)
        srv.gets.defer = len(srv.connections) >= DEFER_FROM

    def refusal(self) -> bytes | None:
        """Why a connection just made is refused (over max_clients, or shutting down), else None."""
        srv = self.srv
        if srv.closing:
            return SHUTTING_DOWN
        return TOO_MANY_CLIENTS if len(srv.connections) >= srv.cfg.max_clients else None

    def _refused(self, stream: asyncio.Transport) -> None:
        """The refusal is written: the connection closes once it is sent."""
        stream.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._unregister()
        self._closing = True
        self._disarm_stall()
        for reply in self._replies:
            if reply.__class__ is not bytes:
                reply.cancel()  # type: ignore[union-attr]  # a future

    def _unregister(self) -> None:
        """Out of the server's registry (CLIENT LIST, REDIRECT targets, max_clients) and the
        command layer's state (tracking, subscriptions, WATCH); once only."""
        srv = self.srv
        if srv.by_id.pop(self.id, None) is not None:
            srv.commands.forget(self)
        srv.connections.discard(self)
        srv.stats.connected_clients = len(srv.connections)
        srv.gets.defer = len(srv.connections) >= DEFER_FROM

    def kill(self) -> None:
        """CLIENT KILL of another connection, as Redis's freeClient: gone from the registry
        at once (a CLIENT LIST after it in the same pipeline does not show it), nothing more
        read or answered (a reply waiting for NATS is dropped), then closed by the usual path
        (connection_lost follows). Output still queued is discarded, as Redis does, so a
        client that reads nothing cannot hold the connection open."""
        if self._closing and self.id not in self.srv.by_id:
            return
        self._closing = True
        self._unregister()
        transport = self.transport
        if transport.get_write_buffer_size():
            transport.abort()
        else:
            transport.close()

    def eof_received(self) -> bool:
        # Keep the write side open: a client may half-close after its last request and still
        # wait for the reply (`nc -U`, shell pipes). _process closes once all is answered.
        self._eof = True
        if self._busy is None:
            self._process()
        return True

    def pause_writing(self) -> None:
        self._paused_writing = True
        if not self._closing:
            self.transport.pause_reading()
        self._arm_stall()  # also when closing: a close waits for the buffer to drain

    def resume_writing(self) -> None:
        self._paused_writing = False
        self._disarm_stall()
        if self._busy is None and not self._closing:
            self.transport.resume_reading()
            self._process()

    # ------------------------------------------------------------------ output buffer limit

    def _arm_stall(self) -> None:
        limit = self.srv.write_stall_s
        if limit and self._stall is None:
            self._stall_size = self.transport.get_write_buffer_size()
            self._stall = asyncio.get_running_loop().call_later(limit, self._stalled)

    def _disarm_stall(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _stalled(self) -> None:
        """Still above the low-water mark a full period after pausing: if the client read
        anything in that period it is slow, not stuck (another period); else cut it off."""
        self._stall = None
        if not self._paused_writing:
            return
        transport = self.transport
        size = transport.get_write_buffer_size()
        if size < self._stall_size:
            self._arm_stall()
            return
        log.warning("client %d read none of its %d bytes of queued replies in %gs: disconnecting",
                    self.id, size, self.srv.write_stall_s)
        self.srv.stats.clients_cut_off += 1
        self._closing = True
        transport.abort()  # connection_lost follows: the slot and the buffers are freed

    # ------------------------------------------------------------------ request loop

    def _process(self) -> None:
        self._in_process = True
        try:
            self._answer_buffered()
        finally:
            self._in_process = False
            if self._pushq:
                queued, self._pushq = self._pushq, []
                for data in queued:
                    self.push(data)

    def _answer_buffered(self) -> None:
        """Answer buffered requests in order until one needs NATS, the buffer is empty, or the
        client stops reading. Replies of one batch go out in one write (or one per FLUSH_AT).

        Runs of `GET` take a fast path, the GET path's `answer` (kvcache.serve.server_get, in C when
        built): cached key plans, freshness asked once per bucket, every read in one LMDB
        read transaction that closes before it returns, never held across an await. Anything else,
        and any GET the fast path cannot
        answer (remote, invalid, stale replica, lower-case or inline), goes through dispatch.
        So does every command while CLIENT REPLY OFF or SKIP is in force (`_muted`): replies
        are then dropped per command (see _reply_mode_step), which a run could not count.
        A read that needs NATS may take the pipelined reads behind it along (_run_ahead)."""
        srv = self.srv
        srv.gets.flush()  # this connection's deferred GETs (if any) are answered before what follows
        if self._closing or self._paused_writing or self._draining or self._replies:
            return
        reader = self.reader
        commands = srv.commands
        gets = srv.gets
        out: list[bytes] = []
        size = local = notfound = 0  # local/notfound: fast-path GETs (dispatch counts the rest)
        t0 = time.monotonic_ns() if gets.timed else 0  # their latency (kvcache.ops.latency)
        try:
            while True:
                waiting, self._waiting = self._waiting, None
                if isinstance(waiting, ProtocolError):  # met behind reads in flight: now its turn
                    self._protocol_error(waiting)
                    return
                # the GETs at the front of the buffer, as data_received answers them
                if waiting is None and not self._muted:
                    replies, answered, nf, _ = gets.answer(reader, b"", self.proto, FLUSH_AT - size)
                    if answered:
                        local += answered
                        notfound += nf
                        self.last_cmd = GET_CMD
                        out.append(replies)
                        size += len(replies)
                        if size >= FLUSH_AT:
                            self.transport.write(b"".join(out))
                            out.clear()
                            size = 0
                            if self._paused_writing:
                                break
                            continue
                # anything else, or a GET the GET path leaves to the generic path
                args: list[bytes] | None = waiting
                if args is None:
                    try:
                        args = reader.next_command()
                    except ProtocolError as e:
                        if out:
                            self.transport.write(b"".join(out))
                            out.clear()
                        self._protocol_error(e)
                        return
                if args is None:
                    break
                # the generic path: counters first, so an INFO in the batch sees them
                if local:
                    self._count(local, notfound)
                    if t0:
                        gets.observe(time.monotonic_ns() - t0, local)
                    local = notfound = 0
                reply = self._dispatch(args)
                if self._reply_off or self._skip or self._skip_next:  # CLIENT REPLY OFF/SKIP
                    reply = self._reply_mode_step(reply)
                if reply.__class__ is bytes:
                    out.append(reply)
                    size += len(reply)
                    if self._closing:  # QUIT
                        break
                    if size >= FLUSH_AT:
                        self.transport.write(b"".join(out))
                        out.clear()
                        size = 0
                        if self._paused_writing:
                            break
                    continue
                # needs NATS: send what is answered, stop reading, resume when it is done
                if out:
                    self.transport.write(b"".join(out))
                    out.clear()
                self.transport.pause_reading()
                keys = None if self._muted else commands.pipelined_keys(args)
                self._send(cast("Awaitable[bytes]", reply), args, keys or ())
                if keys is not None:
                    self._run_ahead()
                return
            if out:
                self.transport.write(b"".join(out))
        finally:
            if local:
                self._count(local, notfound)
                if t0:
                    gets.observe(time.monotonic_ns() - t0, local)
        if self._closing or (self._eof and not self._paused_writing):
            # QUIT, or the client half-closed and everything it sent is answered
            if not self.transport.is_closing():
                self.transport.close()

    def _dispatch(self, args: list[bytes]) -> bytes | Awaitable[bytes]:
        try:
            return self.srv.commands.dispatch(self, args)
        except Exception:  # a bug must cost one reply, never the sidecar
            log.exception("command %r failed", args[:1])
            return resp.error("ERR internal error")

    def _send(self, reply: Awaitable[bytes], args: list[bytes], keys: Iterable[tuple[str, str]]) -> None:
        """A command that waits for NATS: its reply joins `_replies` (`keys`: a pipelined
        read's, in flight until it is answered)."""
        # the command itself is the task (not a wrapper awaiting it), so cancelling it on
        # connection_lost, even before it started, closes the coroutine
        task = asyncio.ensure_future(reply)
        in_flight = self._in_flight
        for k in keys:
            in_flight[k] = in_flight.get(k, 0) + 1
        argv = sum(map(len, args))
        task.add_done_callback(functools.partial(self._landed, keys=keys, argv=argv))
        self._busy_argv += argv  # held until it is answered (argv-mem)
        if self._busy is None:
            self._busy = task
        self._replies.append(task)

    def _run_ahead(self) -> None:
        """Behind a read that went to NATS, send the pipelined reads already buffered (up to
        PIPELINE_MAX replies waiting and PIPELINE_MAX keys in flight), each with a key no read
        in flight has; a read answered at once takes its place in line. Stops at the first
        other command, which waits (`_waiting`)."""
        reader = self.reader
        commands = self.srv.commands
        in_flight = self._in_flight
        while (len(self._replies) < PIPELINE_MAX and len(in_flight) < PIPELINE_MAX and self._waiting is None
               and not self._closing):
            try:
                args = reader.next_command()
            except ProtocolError as e:
                self._waiting = e
                return
            if args is None:
                return
            keys = commands.pipelined_keys(args)
            if keys is None or any(k in in_flight for k in keys):
                self._waiting = args
                return
            reply = self._dispatch(args)
            if reply.__class__ is bytes:
                self._replies.append(reply)
            else:
                self._send(cast("Awaitable[bytes]", reply), args, keys)

    def _landed(self, task: asyncio.Future, keys: Iterable[tuple[str, str]], argv: int) -> None:
        """A command that waited for NATS is done: its keys are no longer in flight; write
        every reply now due in order (a drop for CLIENT REPLY, tracking's invalidations
        after it), then send more pipelined reads or, with nothing left, read again."""
        in_flight = self._in_flight
        for k in keys:
            n = in_flight[k] - 1
            if n:
                in_flight[k] = n
            else:
                del in_flight[k]
        self._busy_argv -= argv
        replies = self._replies
        if not replies or replies[0] is not task:
            return  # answered out of order: it waits for those before it
        self._last_io = time.monotonic_ns()  # a reply written: Redis's lastinteraction too
        transport = self.transport
        out: list[bytes] = []
        while replies:
            head = replies[0]
            if head.__class__ is bytes:
                out.append(cast(bytes, replies.popleft()))
                continue
            if not head.done():
                break
            replies.popleft()
            reply = self._reply_of(head)
            instead, self._drop_busy = self._drop_busy, None
            out.append(reply if instead is None else instead)
            if self.after_reply:  # keys kvcache cannot vouch for (server_tracking): after it
                if out and not transport.is_closing():
                    transport.write(b"".join(out))
                out.clear()
                names, self.after_reply = self.after_reply, []
                self.srv.commands.tracking.after_reply(self, names)
        if transport.is_closing():
            return  # the connection was lost (which cancelled the tasks) or closed meanwhile
        if out:
            transport.write(b"".join(out))
        if replies:
            self._busy = replies[0]
            if not self._draining:
                self._run_ahead()
            return
        self._busy = None
        if self._draining:
            transport.close()
            return
        if not self._paused_writing:
            transport.resume_reading()
        self._process()

    def _reply_of(self, task: asyncio.Future) -> bytes:
        """A command's reply from its finished task: an error reply for its failure."""
        if task.cancelled():  # by connection_lost, or (a bug) from inside: say so, go on
            return resp.error("ERR request cancelled")
        e = task.exception()  # retrieved also when the client is gone: no "never retrieved"
        if e is None:
            return cast(bytes, task.result())
        if isinstance(e, KvcacheError):
            return resp.error(str(e) if str(e).startswith(("ERR", "READONLY")) else f"ERR {e}")
        log.error("async command failed", exc_info=e)
        return resp.error("ERR internal error")

    def close_after_reply(self) -> None:
        self._closing = True

    # ------------------------------------------------------------------ CLIENT REPLY

    def set_reply_mode(self, mode: bytes) -> bytes:
        """CLIENT REPLY ON|OFF|SKIP (mode lower-case, already validated), as Redis does it:
        ON answers +OK (also when it ends a SKIP or OFF); OFF and SKIP answer nothing, and
        SKIP while OFF is in force changes nothing. Returns the command's reply."""
        if mode == b"on":
            self._reply_off = self._skip = self._skip_next = False
            self.refresh_path()
            return resp.OK
        if mode == b"off":
            self._reply_off = True
        elif not self._reply_off:
            self._skip_next = True
        self.refresh_path()
        return b""

    def _reply_mode_step(self, reply: bytes | Awaitable[bytes]) -> bytes | Awaitable[bytes]:
        """A command has run while a reply mode other than ON was in force (or was just set):
        drop its reply if OFF or SKIP applies to it (errors too, as Redis does; a reply still
        to come from NATS when it arrives), then advance SKIP as Redis does after each command.
        A dropped reply leaves its pub/sub confirmations (`confirmations`) in its place: Redis
        sends those whatever CLIENT REPLY says, also from inside an EXEC whose reply it drops."""
        drop = self._reply_off or self._skip
        self._skip, self._skip_next = self._skip_next, False
        self.refresh_path()
        if not drop:
            return reply
        instead = b"".join(self.confirmations) if self.confirmations else b""
        self.confirmations.clear()
        if reply.__class__ is bytes:
            return instead
        self._drop_busy = instead
        return reply

    # ------------------------------------------------------------------ CLIENT LIST / INFO / KILL

    @property
    def unix(self) -> bool:
        return not self.needs_auth  # (needs_auth: a TCP connection, whatever AUTH says)

    @property
    def client_type(self) -> str:
        """Redis's client type (CLIENT LIST TYPE, CLIENT KILL TYPE): `pubsub` with at least
        one subscription (in either protocol, as Redis's CLIENT_PUBSUB), else `normal`."""
        return "pubsub" if (self.channels or self.patterns) else "normal"

    def addresses(self) -> tuple[str, str]:
        """(addr, laddr) as Redis shows them: `ip:port` for TCP, `<socket path>:0` for both
        ends of a Unix socket connection."""
        if self.unix or self.transport is None:
            path = f"{self.srv.path}:0"
            return path, path
        peer, local = (self.transport.get_extra_info(k) for k in ("peername", "sockname"))
        return _tcp_address(peer), _tcp_address(local)

    def client_info(self, argv_mem: int = 0) -> str:
        """This connection's CLIENT LIST / CLIENT INFO line: Redis 7.4's fields in its order
        (networking.c, catClientInfoString), each as docs/commands.md says kvcache fills it.
        `argv_mem`: the arguments of the command running now (the caller's own CLIENT LIST)."""
        now = time.monotonic_ns()
        addr, laddr = self.addresses()
        transport = self.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        fd = sock.fileno() if sock is not None else -1
        pending = transport.get_write_buffer_size() if transport is not None else 0
        qbuf = self.reader.buffered
        # Redis's measure of a queued transaction: argument bytes and a pointer per argument
        multi_mem = sum(sum(map(len, cmd)) + 8 * len(cmd) for cmd in self.multi) if self.multi is not None else 0
        argv_mem = argv_mem or self._busy_argv
        t = self.tracking
        events = ("r" if self.reading() else "") + (
            "w" if pending else "")
        name = self.name.decode()
        cmd = self.last_cmd.decode() if self.last_cmd is not None else "NULL"
        return (f"id={self.id} addr={addr} laddr={laddr} fd={fd} name={name} "
                f"age={(now - self.created) // 1_000_000_000} "
                f"idle={max(0, now - self._last_io) // 1_000_000_000} flags={self._flags()} db=0 "
                f"sub={len(self.channels)} psub={len(self.patterns)} ssub=0 "
                f"multi={len(self.multi) if self.multi is not None else -1} watch={len(self.watching)} "
                f"qbuf={qbuf} qbuf-free=0 argv-mem={argv_mem} multi-mem={multi_mem} rbs=0 rbp=0 "
                f"obl=0 oll=0 omem={pending} tot-mem={qbuf + argv_mem + multi_mem + pending} "
                f"events={events} cmd={cmd} user=default redir={t.redirect if t is not None else -1} "
                f"resp={self.proto} lib-name={self.lib_name.decode()} lib-ver={self.lib_ver.decode()}\n")

    def reading(self) -> bool:
        """CLIENT LIST's `r`: the server waits to read from the client."""
        return self.transport is not None and not self._closing and self.transport.is_reading()

    def _flags(self) -> str:
        """Redis's flag letters, in its order, for the states kvcache has (N: none)."""
        t = self.tracking
        flags = "".join(letter for letter, on in (
            ("P", self.channels or self.patterns), ("x", self.multi is not None),
            ("t", t is not None), ("R", t is not None and t.broken), ("B", t is not None and t.bcast),
            ("d", self.watch_dirty), ("c", self._closing), ("U", self.unix),
            ("e", self.no_evict), ("T", self.no_touch)) if on)
        return flags or "N"

    def _protocol_error(self, e: ProtocolError) -> None:
        """Framing is lost: say why, then close, as Redis does."""
        self.srv.stats.protocol_errors += 1
        msg = str(e)
        if not (self._reply_off or self._skip):  # CLIENT REPLY drops this one too, as in Redis
            self.transport.write(resp.error(msg if msg.startswith("ERR") else f"ERR {msg}"))
        self._closing = True
        self.transport.close()

    async def drain(self) -> None:
        """Graceful shutdown: the requests in flight get their replies, then the connection
        closes; requests not yet started are not answered."""
        self._draining = True
        busy = [r for r in self._replies if isinstance(r, asyncio.Future)]
        if busy:  # (asyncio.wait cancels none of them if the drain itself is cancelled)
            await asyncio.wait(busy)
            # A request that ended just before the drain has its _landed (which writes the
            # reply) scheduled but not run yet, and wait() on done futures does not yield.
            await asyncio.sleep(0)
        if self.transport and not self.transport.is_closing():
            self.transport.close()



def _tcp_address(addr: tuple) -> str:
    """`ip:port` as Redis writes it (anetFormatAddr): `[ip]:port` for IPv6."""
    host = addr[0]
    return f"[{host}]:{addr[1]}" if ":" in host else f"{host}:{addr[1]}"
