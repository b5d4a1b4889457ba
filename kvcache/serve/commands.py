"""The RESP command set (docs/commands.md): decode arguments, hand each read to kvcache.read.reads
(which carries it out: replica, near cache or NATS, counted and logged), encode the reply.

A handler returns the encoded reply as bytes when it can answer at once (the common case: a
local read), or a coroutine when it must ask NATS; the server keeps replies in request order.
The parts it uses (reads, tracking, pub/sub, transactions, INFO) are built and wired by the
sidecar (kvcache.sidecar) and passed in.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, cast

from .. import resp
from ..config import Config
from ..config import parse_keyspace_events as parse_flags
from ..entry import Entry
from ..errors import CommandError, ReplyBudget, ReplyTooLarge
from ..keys import glob_matcher
from ..ops.latency import Latency
from ..read.reads import Reads
from ..stats import Stats
from ..store.record import expiry
from .arguments import as_is, cursor, integer, non_negative, options, text
from .command_table import (
    BY_NAME,
    COMMANDS,
    NO_AUTH,
    WRITES,
    CommandSpec,
    arity_error,
    command_reply,
    full_name,
    key_args,
)
from .commands_session import NOAUTH, SessionCommands
from .info import Info
from .multi import CONTROL, QUEUED, Transactions
from .pubsub import SUBSCRIBED_OK, PubSub
from .scan import KeyListing
from .streams import Streams
from .tracking import Tracking

__all__ = ["CommandError", "Commands"]

Reply = bytes | Awaitable[bytes]
Handler = Callable[["Session", list[bytes]], Reply]

READONLY = resp.error("READONLY kvcache is a read replica")
# COMMAND's view of the table, by name (docs/commands.md must name each: tests/test_docs.py)
COMMAND_SPECS: dict[str, CommandSpec] = {c.name: c for c in COMMANDS}
# Reads a connection may send ahead while one before it waits for NATS (pipelined_keys)
PIPELINED = frozenset({b"get", b"mget"})


if TYPE_CHECKING:  # the connection the server hands every handler
    from .session import Session


class Commands:
    """The command table: Redis's read commands and KV.GET over kvcache.read.reads. Handlers
    return the encoded reply, or a coroutine when NATS must answer (the server keeps replies
    in request order); a CommandError becomes the RESP error reply."""

    def __init__(self, cfg: Config, reads: Reads, stats: Stats, tracking: Tracking, pubsub: PubSub,
                 transactions: Transactions, info: Info, streams: Streams,
                 clients: Callable[[], Iterable[Session]] = lambda: ()) -> None:
        self.cfg = cfg
        self.reads = reads
        self.stats = stats
        self.access = reads.access
        self.listing = KeyListing(cfg, reads.replica)  # KEYS, SCAN, DBSIZE
        self.tracking = tracking
        self.pubsub = pubsub
        self.transactions = transactions
        self.info_source = info
        self.streams = streams  # XREAD, XRANGE, XREVRANGE, XLEN, XINFO of `@<bucket>`
        self.timing: dict[bytes, Latency] | None = None  # per command, once time_commands() is called
        # `clients`: every open connection, oldest first (CLIENT LIST, CLIENT KILL)
        self.session = SessionCommands(cfg, tracking, pubsub, transactions, self.dispatch, clients)
        # name -> (bound handler, its row): every row of kvcache.serve.command_table, bound
        # here to the part that runs it (a name that binds to nothing fails now, at start)
        parts = {"commands": self, "session": self.session, "streams": streams}
        self._table: dict[bytes, tuple[Handler, CommandSpec]] = {
            name: (_bind(parts, spec.handler), spec) for name, spec in BY_NAME.items()}

    def time_commands(self) -> dict[bytes, Latency]:
        """Keep a latency histogram per command from now on (the metrics listener's
        `kvcache_command_duration_seconds`): dispatch becomes its timed twin, so nothing is
        timed while no one asked."""
        if self.timing is None:
            self.timing = {}
            self.dispatch = self._dispatch_timed  # type: ignore[method-assign]
        return self.timing

    def _dispatch_timed(self, conn: Session, args: list[bytes]) -> Reply:
        """dispatch, and the time until its reply is ready (a reply NATS gives: once it has)."""
        t0 = time.monotonic_ns()
        reply = Commands.dispatch(self, conn, args)
        name = args[0].lower()
        if name not in self._table:
            return reply  # unknown: not a label
        assert self.timing is not None
        hist = self.timing.get(name)
        if hist is None:
            hist = self.timing[name] = Latency()
        if reply.__class__ is bytes:
            hist.observe(time.monotonic_ns() - t0)
            return reply
        # The command itself becomes the task the server awaits (a wrapper coroutine,
        # cancelled before it started, would leave the command never awaited).
        task = asyncio.ensure_future(cast("Awaitable[bytes]", reply))
        task.add_done_callback(lambda _: hist.observe(time.monotonic_ns() - t0))
        return task

    def pipelined_keys(self, args: list[bytes]) -> list[tuple[str, str]] | None:
        """The (bucket, key)s of a read that may go to NATS while reads before it on the same
        connection are still there (a pipelined GET or MGET: kvcache.serve.client_connection), or
        None for any other command, or a read it cannot resolve (it waits its turn). Keys,
        not raw names: `k` and `bucket:k` are one key, whose reads must not overtake each other."""
        name = args[0].lower()
        if name not in PIPELINED or arity_error(BY_NAME[name], args) is not None:
            return None
        resolve = self.reads.policy.resolve
        try:
            return [(bc.name, key) for bc, key in map(resolve, args[1:])]
        except CommandError:
            return None

    def forget(self, conn: Session) -> None:
        """A connection closed: its tracking, subscriptions and watched keys go with it."""
        self.tracking.disable(conn)
        self.pubsub.drop(conn)
        self.transactions.unwatch(conn)
        self.streams.forget(conn)

    def dispatch(self, conn: Session, args: list[bytes]) -> Reply:
        """Run one command, in Redis's order of checks: known (else unknown command, or
        -READONLY for a write), its argument count (the table's arity), then what the
        connection's state stops (`_gate`), then the handler."""
        self.stats.commands += 1
        name = args[0].lower()
        bound = self._table.get(name)
        reply: Reply
        if bound is None:
            # CLIENT LIST's cmd: NULL (None) for a command Redis does not know either
            conn.last_cmd = name if name in WRITES else None
            if conn.multi is not None:
                conn.multi_failed = True  # an unknown command or a write queued: EXECABORT
            reply = READONLY if name in WRITES else _unknown(args)
        else:
            handler, spec = bound
            # CLIENT LIST's cmd: Redis's full name of the command looked up (`client|list`),
            # NULL for a subcommand Redis does not have
            conn.last_cmd = full_name(spec, args) if spec.subcommands else name
            wrong = arity_error(spec, args)
            if wrong is not None:
                reply = resp.error(wrong)
                if conn.multi is not None:  # refused when queued: EXECABORT, as Redis
                    if name == b"exec":  # as Redis's execCommandAbort: the transaction ends
                        return self.session.abort(conn, wrong)
                    conn.multi_failed = True
                    return reply
            else:
                if conn.gate:  # unauthenticated, in MULTI, RESP2 subscribed
                    early = self._gate(conn, name, args)
                    if early is not None:
                        return early
                try:
                    reply = handler(conn, args)
                except (CommandError, ReplyTooLarge) as e:
                    reply = resp.error(str(e))
        if conn.tracking is not None:
            return self._tracked(conn, name, args, reply, bound[1] if bound is not None else None)
        return reply

    def _gate(self, conn: Session, name: bytes, args: list[bytes]) -> bytes | None:
        """The reply of a command the connection's state stops, as Redis gives it; None to
        run it. In MULTI, a command (its arity checked already) is queued."""
        if not conn.authenticated and name not in NO_AUTH:
            return NOAUTH
        if conn.proto == 2 and conn.subscribed and name not in SUBSCRIBED_OK:
            shown = conn.last_cmd or name  # Redis names a subcommand in full: 'client|reply'
            return resp.error(f"ERR Can't execute '{shown.decode(errors='replace')}': only (P|S)SUBSCRIBE / "
                              "(P|S)UNSUBSCRIBE / PING / QUIT / RESET are allowed in this context")
        if conn.multi is not None and name not in CONTROL:
            conn.multi.append(args)
            return QUEUED
        return None

    def _tracked(self, conn: Session, name: bytes, args: list[bytes], reply: Reply,
                 spec: CommandSpec | None) -> Reply:
        """CLIENT TRACKING's bookkeeping after a command (kvcache.serve.tracking): keys
        read from the replica in this step are remembered; keys of a reply that waited are
        invalidated once it is written; CLIENT CACHING covers one command (or one MULTI)."""
        t = conn.tracking
        if t is None or conn.multi is not None:
            return reply  # queued: the keys are read (and CACHING used) at EXEC
        if name == b"exec":
            names = conn.exec_keys
            conn.exec_keys = []
        elif spec is not None and spec.tracked:
            names = key_args(spec, args)
        else:
            names = []
        if conn.in_exec:
            conn.exec_keys.extend(names)
            return reply
        if names:
            if reply.__class__ is bytes:
                if t.wants():
                    self.tracking.remember(conn, names)
            elif t.bcast or t.wants():
                conn.after_reply.extend(names)
        if not (name == b"client" and args[1:2] and args[1].lower() == b"caching"):
            t.caching = None
        return reply

    # ------------------------------------------------------------------ reads

    def get(self, conn: Session, args: list[bytes]) -> Reply:
        proto = conn.proto
        return self.reads.one(args[1], "GET", lambda e: resp.bulk(e.value if e else None, proto))

    def mget(self, conn: Session, args: list[bytes]) -> Reply:
        proto = conn.proto
        return self.reads.many(args[1:], "MGET", lambda values: _values_reply(values, proto),
                               ReplyBudget(self.cfg.max_reply_bytes))

    def exists(self, conn: Session, args: list[bytes]) -> Reply:
        """Keys that exist, each counted as often as it is named (Redis's EXISTS). A stream key
        `@<bucket>` exists when TYPE says `stream` of it: a library that checks a stream
        before reading it (walrus's consumer groups) is told 1, not that the key is invalid."""
        keys = args[1:]
        streams = 0
        if any(k[:1] == b"@" for k in keys):
            streams = sum(self.streams.exists(k) for k in keys if k[:1] == b"@")
            keys = [k for k in keys if k[:1] != b"@"]
            if not keys:
                return resp.integer(streams)
        return self.reads.many(keys, "EXISTS",
                               lambda values: resp.integer(streams + sum(v is not None for v in values)))

    def _ttl(self, conn: Session, args: list[bytes], ms: bool, absolute: bool) -> Reply:
        def answer(found: Entry | None) -> bytes:
            if found is None:
                return resp.integer(-2)
            due = expiry(found.created, found.expires, self.reads.max_age_ns(found.bucket))
            if not due:
                return resp.integer(-1)
            left = due // 1_000_000 if absolute else max(0, (due - time.time_ns()) // 1_000_000)
            return resp.integer(left if ms else (left + 500) // 1000)
        return self.reads.one(args[1], args[0].decode(errors="replace").upper(), answer)

    def ttl(self, conn: Session, args: list[bytes]) -> Reply:
        return self._ttl(conn, args, ms=False, absolute=False)

    def pttl(self, conn: Session, args: list[bytes]) -> Reply:
        return self._ttl(conn, args, ms=True, absolute=False)

    def expiretime(self, conn: Session, args: list[bytes]) -> Reply:
        return self._ttl(conn, args, ms=False, absolute=True)

    def pexpiretime(self, conn: Session, args: list[bytes]) -> Reply:
        return self._ttl(conn, args, ms=True, absolute=True)

    def type(self, conn: Session, args: list[bytes]) -> Reply:
        if args[1][:1] == b"@":
            return self.streams.type(conn, args)
        return self.reads.one(args[1], "TYPE", lambda e: STRING_TYPE if e is not None else NONE_TYPE)

    def xpending(self, conn: Session, args: list[bytes]) -> Reply:
        """No consumer group exists on a bucket's stream (XGROUP CREATE is a write)."""
        self.streams.stream_of(args[1])
        raise CommandError(f"NOGROUP No such key '{args[1][:64].decode(errors='replace')}' or consumer group "
                           f"'{args[2][:64].decode(errors='replace')}'")

    def strlen(self, conn: Session, args: list[bytes]) -> Reply:
        return self.reads.one(args[1], "STRLEN",
                              lambda e: resp.integer(len(e.value) if e and e.value else 0))

    def getrange(self, conn: Session, args: list[bytes]) -> Reply:
        start, end = integer(args[2]), integer(args[3])
        proto = conn.proto
        return self.reads.one(args[1], "GETRANGE",
                              lambda e: resp.bulk(_range((e.value or b"") if e else b"", start, end), proto))

    def kv_get(self, conn: Session, args: list[bytes]) -> Reply:
        try:
            opts = options(args[2:], {b"consistency": text, b"maxstale": non_negative, b"minrev": non_negative})
            consistency = opts.get(b"consistency", "local").lower()
            if consistency not in ("local", "strong"):
                raise CommandError("ERR CONSISTENCY must be local or strong")
        except CommandError:
            self.reads.policy.resolve(args[1])  # an invalid key is the error named first
            raise
        proto = conn.proto
        return self.reads.one(args[1], "KV.GET",
                              lambda e: resp.null(proto) if e is None else _entry_reply(e, proto),
                              strong=consistency == "strong", max_stale_ms=opts.get(b"maxstale"),
                              min_rev=opts.get(b"minrev"))

    # ------------------------------------------------------------------ key listing

    def keys(self, conn: Session, args: list[bytes]) -> Reply:
        return resp.array([resp.bulk(k, conn.proto) for k in self.listing.keys(args[1])], conn.proto)

    def scan(self, conn: Session, args: list[bytes]) -> Reply:
        at = cursor(args[1])
        opts = options(args[2:], {b"match": as_is, b"count": integer, b"type": text})
        count = opts.get(b"count", 10)
        if count < 1:
            raise CommandError("ERR syntax error")
        if opts.get(b"type", "string").lower() != "string":
            return resp.array([resp.bulk(b"0"), resp.array([])])
        next_cursor, found = self.listing.page(opts.get(b"match", b"*"), at, count)
        return resp.array([resp.bulk(b"%d" % next_cursor),
                           resp.array([resp.bulk(k, conn.proto) for k in found], conn.proto)], conn.proto)

    def dbsize(self, conn: Session, args: list[bytes]) -> Reply:
        return resp.integer(self.listing.count())

    # ------------------------------------------------------------------ server

    def command(self, conn: Session, args: list[bytes]) -> Reply:
        """COMMAND and its subcommands: the command table itself (kvcache.serve.command_table)."""
        return command_reply(args, conn.proto)

    def config(self, conn: Session, args: list[bytes]) -> Reply:
        sub = args[1].lower()
        if sub == b"set":
            return self._config_set(args)
        if sub != b"get":
            raise CommandError("ERR kvcache supports CONFIG GET, and CONFIG SET of notify-keyspace-events")
        settings = {
            "save": "", "appendonly": "no", "databases": "1",
            "maxclients": str(self.cfg.max_clients),
            "proto-max-bulk-len": str(self.cfg.max_request_bytes),
            "notify-keyspace-events": self.pubsub.flags,
            "tracking-table-max-keys": str(self.tracking.max_keys),
        }
        found: dict[str, str] = {}  # a setting matched by several patterns is listed once
        for pattern in args[2:]:
            match = glob_matcher(pattern.decode(errors="replace").lower())
            found.update((k, v) for k, v in settings.items() if match(k))
        return resp.map_([(resp.bulk(k.encode()), resp.bulk(v.encode())) for k, v in found.items()],
                         conn.proto)

    def _config_set(self, args: list[bytes]) -> bytes:
        """CONFIG SET notify-keyspace-events FLAGS: the one setting clients change at run time
        (frameworks turn notifications on this way). Not saved: the config file is the
        sidecar's, as redis.conf is Redis's without CONFIG REWRITE."""
        if len(args) % 2:  # (at least 4: the table's arity)
            raise CommandError("ERR wrong number of arguments for 'config|set' command")
        flags = None
        for i in range(2, len(args), 2):
            name = args[i].decode(errors="replace").lower()
            if name != "notify-keyspace-events":
                raise CommandError(f"ERR kvcache can CONFIG SET notify-keyspace-events only, not '{name[:64]}'")
            flags = parse_flags(args[i + 1].decode(errors="replace"))
        assert flags is not None
        self.pubsub.set_flags(flags)
        return resp.OK

    # ------------------------------------------------------------------ INFO

    def info(self, conn: Session, args: list[bytes]) -> Reply:
        wanted = {a.decode(errors="replace").lower() for a in args[1:]}
        refresh = self.info_source.refresh
        if refresh is not None:  # workers: their counters as of now first
            return self._info_after(refresh(), wanted, conn.proto)
        return resp.verbatim(self.info_text(wanted), conn.proto)

    async def _info_after(self, refreshed: Awaitable[None], wanted: set[str], proto: int) -> bytes:
        await refreshed
        return resp.verbatim(self.info_text(wanted), proto)

    def info_text(self, wanted: set[str]) -> str:
        return self.info_source.text(wanted)


# ---------------------------------------------------------------------- helpers

STRING_TYPE = b"+string\r\n"
NONE_TYPE = b"+none\r\n"


def _range(value: bytes, start: int, end: int) -> bytes:
    """GETRANGE's slice, with Redis's rules for negative and out-of-range offsets."""
    n = len(value)
    if start < 0 and end < 0 and start > end:
        return b""
    if start < 0:
        start = max(0, n + start)
    if end < 0:
        end = max(0, n + end)
    end = min(end, n - 1)
    if start > end or n == 0:
        return b""
    return value[start:end + 1]


def _unknown(args: list[bytes]) -> bytes:
    """Redis's words: each argument quoted and followed by a space, up to 128 characters."""
    shown = ""
    for a in args[1:]:
        if len(shown) >= 128:
            break
        shown += f"'{a.decode(errors='replace')[:128 - len(shown)]}' "
    return resp.error(f"ERR unknown command '{args[0].decode(errors='replace')[:128]}', "
                      f"with args beginning with: {shown}")


def _values_reply(values: Sequence[bytes | memoryview | None], proto: int) -> bytes:
    return resp.bulk_array(values, proto)


def _entry_reply(e: Entry, proto: int) -> bytes:
    return resp.array([
        resp.bulk(e.value, proto), resp.integer(e.revision), resp.integer(e.created),
        resp.bulk(e.operation.value.encode(), proto), resp.bulk(e.source.encode(), proto),
    ], proto)


def _bind(parts: dict[str, object], handler: str) -> Handler:
    """A table row's handler name (`session.ping`) as the bound method of that part."""
    part, _, method = handler.partition(".")
    return getattr(parts[part], method)
