"""The sidecar's NATS connections: nats-py, reading the wire with kvcache's NatsReader.

nats-py keeps doing what it does well (connecting, reconnecting, auth, TLS, requests, the
JetStream API); only its regex parser is replaced. `NatsConnection` installs a parser adapter that
feeds the native reader (or its pure-Python twin) and hands the events to nats-py's own
`_process_*` hooks, with headers already decoded. It also opens **fast lanes**: a subscription
registered with `add_lane()` gets its JetStream deliveries as `Run` batches, once per event-loop
turn (everything the turn's socket reads brought), instead of one `Msg` object, queue entry and
coroutine step per message.

Why per turn, and why a wide read buffer (READ_BUFFER_BYTES): a feed applies each batch in one
LMDB transaction, and a transaction, its meta record and its commit cost the same for 100
messages as for 10,000. nats-py reads 32 KiB at a time and its stream reader stops reading the
socket past 64 KiB buffered, so a first sync came in batches of ~140 messages (7,000
transactions for 1M keys). With the reader's limit raised, a turn drains what the kernel holds
(nats-py's read loop does not yield while data is buffered) and a batch is thousands.

This leans on nats-py internals (`_ps`, `_process_msg` and friends, stable since 2.0); the
version range in pyproject.toml is the one these were checked against, and
tests/test_natsconn.py runs the adapter against a real server.
"""
from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from .. import native
from ..errors import ProtocolError
from .natsproto import status_headers

proto = native.load("natsproto")
_Msg, _HMsg, _Run = proto.Msg, proto.HMsg, proto.Run
_Ping, _Pong, _Info, _Err = type(proto.PING), type(proto.PONG), proto.Info, proto.Err

# A lane handler gets, in wire order, everything one event-loop turn brought for its sid: Run
# batches and the ordinary HMsg/Msg events in between (heartbeats, pull statuses).
LaneHandler = Callable[[list], None]
# What a connection may hold read but not yet parsed: asyncio's stream reader stops reading the
# socket past twice this (nats-py sets 32 KiB). See the module docstring.
READ_BUFFER_BYTES = 1 << 20


def nats_headers(ev) -> dict | None:
    """nats-py's view of an HMsg's headers: inline status as `Status`/`Description`."""
    return status_headers(ev.status, ev.description, ev.headers) or None


class _Parser:
    """Stands in for nats.protocol.parser.Parser: same `parse()` and `reset()`."""

    def __init__(self, nc: NatsConnection) -> None:
        self.nc = nc
        self.lanes: dict[int, tuple[int, LaneHandler]] = {}
        # lane events parsed this event-loop turn, by sid, handed over at its end (_hand_over)
        self._turn: dict[int, list] | None = None
        self.reset()

    def reset(self) -> None:
        """A new connection starts a new stream of bytes (nats-py calls this on reconnect)."""
        self.reader = proto.NatsReader()
        for sid, (prefix_len, _) in self.lanes.items():
            self.reader.add_lane(sid, prefix_len)

    async def parse(self, data: bytes = b"") -> None:
        error = None
        try:
            events = self.reader.feed(data)
        except ProtocolError as e:
            events, error = e.events, e
        nc = self.nc
        lanes = self.lanes
        batches = self._turn
        for ev in events:
            t = type(ev)
            if t is _Run or ((t is _HMsg or t is _Msg) and ev.sid in lanes):
                if batches is None:
                    batches = self._turn = {}
                    asyncio.get_running_loop().call_soon(self._hand_over)
                batches.setdefault(ev.sid, []).append(ev)
            elif t is _HMsg:
                await nc._process_msg(ev.sid, ev.subject.encode(), ev.reply.encode(), ev.payload,
                                      nats_headers(ev))  # type: ignore[arg-type]  # decoded: see _process_headers
            elif t is _Msg:
                await nc._process_msg(ev.sid, ev.subject.encode(), ev.reply.encode(), ev.payload,
                                      None)  # type: ignore[arg-type]  # no headers: see _process_headers
            elif t is _Ping:
                await nc._process_ping()
            elif t is _Pong:
                await nc._process_pong()
            elif t is _Info:
                await nc._process_info(ev.info)
            elif t is _Err:
                # nats-py matches error texts in lower case; the subject a permissions
                # violation names (in double quotes) keeps its case for the log.
                head, quote, subject = ev.text.partition('"')
                await nc._process_err(f"'{head.lower()}{quote}{subject}'")
            # +OK: nothing to do
        if error is not None:
            raise nats.errors.ProtocolError() from error

    def _hand_over(self) -> None:
        """The end of an event-loop turn: each lane gets what the turn's reads brought it."""
        batches, self._turn = self._turn, None
        if not batches:
            return
        lanes = self.lanes
        stats = self.nc.stats
        for sid, batch in batches.items():
            lane = lanes.get(sid)
            if lane is None:   # removed meanwhile: the subscription is gone
                continue
            stats["in_msgs"] += sum(len(ev.items) if type(ev) is _Run else 1 for ev in batch)
            lane[1](batch)



async def unsubscribe_quietly(*subs) -> None:
    """Each subscription's interest withdrawn (None: none to withdraw). One whose connection is
    gone or closing is left be: the server drops a closed connection's interest by itself, and
    a stop must go on."""
    for sub in subs:
        if sub is None:
            continue
        try:
            await sub.unsubscribe()
        except Exception:  # the connection may be gone
            pass

def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(nats.errors.TimeoutError())


async def request_batch(nc: Client, subject: str, payload: bytes, timeout: float) -> list[Msg]:
    """A request answered by several messages, up to and including the first with a status
    (a Direct Get batch), over a subscription of its own: any nats-py client
    (NatsConnection.fast_batch's lane is the fast way). Raises nats-py's TimeoutError, and
    NoRespondersError for a 503 with no payload."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        await nc.publish(subject, payload, reply=inbox)
        deadline = asyncio.get_running_loop().time() + timeout
        out: list[Msg] = []
        while True:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                raise nats.errors.TimeoutError
            msg = await sub.next_msg(timeout=left)
            status = (msg.headers or {}).get("Status")
            if status == "503" and not msg.data:
                raise nats.errors.NoRespondersError
            out.append(msg)
            if status:
                return out
    finally:
        try:
            await sub.unsubscribe()
        except nats.errors.Error:
            pass


class NatsConnection(Client):
    """A nats-py client whose wire reader is kvcache's, with fast lanes for the feed."""

    def __init__(self) -> None:
        super().__init__()
        self._parser = _Parser(self)
        self._ps = self._parser  # type: ignore[assignment]  # nats-py reads through _ps
        self._fast_inbox: bytes | None = None
        self._fast_lock = asyncio.Lock()
        self._fast_tokens = itertools.count(1)
        self._fast_waiting: dict[bytes, asyncio.Future] = {}
        self._fast_batches: dict[bytes, tuple[list, asyncio.Future]] = {}  # fast_batch's

    async def _process_connect_init(self) -> None:
        """nats-py's handshake (TLS included), then the wide read buffer: see the module
        docstring. (The transport's stream reader is asyncio's; its limit is the only knob.)"""
        await super()._process_connect_init()
        reader = getattr(self._transport, "_io_reader", None)
        if isinstance(reader, asyncio.StreamReader) and getattr(reader, "_limit", 0) < READ_BUFFER_BYTES:
            reader._limit = READ_BUFFER_BYTES  # type: ignore[attr-defined]  # asyncio's, stable since 3.4

    async def fast_request(self, subject: str, payload: bytes, timeout: float) -> Msg:
        """Request/reply for the sidecar's fallback reads, with nats-py's errors and Msg.

        nats-py's `request` costs several event-loop turns per call (its flusher task writes
        the PUB, a subscription task hands the reply over) and a random inbox token. Here
        one wildcard inbox is a lane: a reply resolves its future straight from the reader,
        and the PUB goes to the transport at once. While (re)connecting or while nats-py has
        anything queued, nats-py's request serves (in order behind what is queued)."""
        if self._fast_inbox is None:
            await self._fast_setup()
        transport = self._transport
        if transport is None or not self.is_connected or self._pending_data_size:
            # Reconnecting, or nats-py has bytes queued (our SUB among them, right after
            # setup): its request keeps them in order.
            return await self.request(subject, payload, timeout=timeout)
        token = b"%d" % next(self._fast_tokens)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._fast_waiting[token] = fut
        # A timer on the future itself: asyncio.wait_for wraps it in another future and
        # callback (tens of µs a read on a slow core).
        timer = loop.call_later(timeout, _expire, fut)
        try:
            transport.write(b"PUB %s %s%s %d\r\n%s\r\n" % (
                subject.encode(), self._fast_inbox, token, len(payload), payload))
            ev = await fut
        finally:
            timer.cancel()
            self._fast_waiting.pop(token, None)
        headers = nats_headers(ev) if type(ev) is _HMsg else None
        if headers and headers.get("Status") == "503" and not ev.payload:
            raise nats.errors.NoRespondersError
        return Msg(_client=self, subject=ev.subject, reply=ev.reply, data=ev.payload, headers=headers)

    async def fast_batch(self, subject: str, payload: bytes, timeout: float) -> list[Msg]:
        """A request answered by several messages, up to and including the first with a
        status (a Direct Get batch: its records, then 204 end-of-batch or 404): fast_request's
        lane, collecting. While nats-py has anything queued, a subscription serves instead."""
        if self._fast_inbox is None:
            await self._fast_setup()
        transport = self._transport
        if transport is None or not self.is_connected or self._pending_data_size:
            return await request_batch(self, subject, payload, timeout)
        token = b"%d" % next(self._fast_tokens)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        got: list = []
        self._fast_batches[token] = (got, fut)
        timer = loop.call_later(timeout, _expire, fut)
        try:
            transport.write(b"PUB %s %s%s %d\r\n%s\r\n" % (
                subject.encode(), self._fast_inbox, token, len(payload), payload))
            await fut
        finally:
            timer.cancel()
            self._fast_batches.pop(token, None)
        out = []
        for ev in got:
            headers = nats_headers(ev) if type(ev) is _HMsg else None
            if headers and headers.get("Status") == "503" and not ev.payload:
                raise nats.errors.NoRespondersError
            out.append(Msg(_client=self, subject=ev.subject, reply=ev.reply, data=ev.payload, headers=headers))
        return out

    async def _fast_setup(self) -> None:
        async with self._fast_lock:
            if self._fast_inbox is not None:
                return
            prefix = self.new_inbox() + "."
            sub = await self.subscribe(prefix + "*")
            self.add_lane(sub._id, prefix, self._fast_replies)
            self._fast_inbox = prefix.encode()

    def _fast_replies(self, batch: list) -> None:
        n = len(self._fast_inbox or b"")
        for ev in batch:
            if type(ev) is _Run:
                continue  # not a JetStream delivery subject: cannot happen
            token = ev.subject.encode()[n:]
            fut = self._fast_waiting.pop(token, None)
            if fut is not None:
                if not fut.done():
                    fut.set_result(ev)
                continue
            collecting = self._fast_batches.get(token)
            if collecting is not None and not collecting[1].done():
                collecting[0].append(ev)
                if type(ev) is _HMsg and ev.status:  # a status ends the batch (204, 404, ...)
                    collecting[1].set_result(None)

    async def _process_headers(self, headers):
        # The reader has decoded them already (see nats_headers).
        return headers

    def add_lane(self, sid: int, prefix: str, handler: LaneHandler) -> None:
        """Deliver the JetStream messages of subscription `sid` to `handler` in Run batches;
        keys are the subjects without `prefix`."""
        n = len(prefix.encode())
        self._parser.lanes[sid] = (n, handler)
        self._parser.reader.add_lane(sid, n)

    def remove_lane(self, sid: int) -> None:
        self._parser.lanes.pop(sid, None)
        self._parser.reader.remove_lane(sid)
