"""The RESP command set (docs/commands.md): decode arguments, hand each read to kvcache.read.reads
(which carries it out: replica, near cache or NATS, counted and logged), encode the reply.

A handler returns the encoded reply as bytes when it can answer at once (the common case: a
local read), or a coroutine when it must ask NATS; the server keeps replies in request order.
The parts it uses (reads, tracking, pub/sub, transactions, INFO) are built and wired by the
sidecar (kvcache.sidecar) and passed in.
"""
from __future__ import annotations

import asyncio
import functools
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, cast

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
from .commands_session import NO_AUTH, NOAUTH, SessionCommands
from .info import Info
from .multi import CONTROL, QUEUED, Transactions
from .pubsub import SUBSCRIBED_OK, PubSub
from .scan import KeyListing
from .streams import Streams
from .tracking import TRACKED, Tracking, key_args

__all__ = ["CommandError", "Commands"]

Reply = bytes | Awaitable[bytes]

READONLY = resp.error("READONLY kvcache is a read replica")
WRITE_COMMANDS = frozenset(b"""
append bitfield bitop blmove blmpop blpop brpop brpoplpush bzmpop bzpopmax bzpopmin copy decr
decrby del eval evalsha expire expireat flushall flushdb fcall function geoadd georadius
georadiusbymember getdel getex getset hdel hincrby hincrbyfloat hmset hset hsetnx incr incrby
incrbyfloat linsert lmove lmpop lpop lpush lpushx lrem lset ltrim migrate move mset msetnx
persist pexpire pexpireat pfadd pfmerge psetex publish rename renamenx restore rpop rpoplpush
rpush rpushx sadd sdiffstore set setbit setex setnx setrange sinterstore smove spop srem
sunionstore swapdb unlink xack xadd xautoclaim xclaim xdel xgroup xreadgroup xsetid xtrim zadd zdiffstore zincrby
zinterstore zmpop zpopmax zpopmin zrangestore zrem zremrangebylex zremrangebyrank
zremrangebyscore zunionstore sort restore-asking
""".split())

# Redis 7.4's subcommands of the container commands kvcache has (CLIENT LIST's `cmd` names a
# subcommand as `client|list`; one Redis does not have is NULL there, as in Redis)
SUBCOMMANDS: dict[bytes, frozenset[bytes]] = {
    b"client": frozenset(b"""caching getname getredir help id info kill list no-evict no-touch pause
                          reply setinfo setname tracking trackinginfo unblock unpause""".split()),
    b"config": frozenset(b"get help resetstat rewrite set".split()),
    b"command": frozenset(b"count docs getkeys getkeysandflags help info list".split()),
    b"pubsub": frozenset(b"channels help numpat numsub shardchannels shardnumsub".split()),
    b"xinfo": frozenset(b"consumers groups help stream".split()),
}


def _full_name(name: bytes, args: list[bytes]) -> bytes | None:
    if len(args) == 1:
        return name
    sub = args[1].lower()
    return name + b"|" + sub if sub in SUBCOMMANDS[name] else None


# COMMAND's view of the table: name -> (arity, flags, first key, last key, step, categories),
# Redis 7's shape, so clients that introspect (redis-py's command(), redis-cli) get real rows.
COMMAND_SPECS: dict[str, tuple[int, tuple[str, ...], int, int, int, tuple[str, ...]]] = {
    "get": (2, ("readonly", "fast"), 1, 1, 1, ("@read", "@string", "@fast")),
    "mget": (-2, ("readonly", "fast"), 1, -1, 1, ("@read", "@string", "@fast")),
    "exists": (-2, ("readonly", "fast"), 1, -1, 1, ("@keyspace", "@read", "@fast")),
    "kv.get": (-2, ("readonly",), 1, 1, 1, ("@read", "@string")),
    "keys": (2, ("readonly",), 0, 0, 0, ("@keyspace", "@read", "@slow", "@dangerous")),
    "scan": (-2, ("readonly",), 0, 0, 0, ("@keyspace", "@read", "@slow")),
    "dbsize": (1, ("readonly", "fast"), 0, 0, 0, ("@keyspace", "@read", "@fast")),
    "info": (-1, ("loading", "stale"), 0, 0, 0, ("@slow", "@dangerous")),
    "ping": (-1, ("fast",), 0, 0, 0, ("@fast", "@connection")),
    "echo": (2, ("fast",), 0, 0, 0, ("@fast", "@connection")),
    "quit": (-1, ("noscript", "loading", "stale", "fast", "no_auth", "allow_busy"), 0, 0, 0,
             ("@fast", "@connection")),
    "hello": (-1, ("noscript", "loading", "stale", "fast", "no_auth", "allow_busy"), 0, 0, 0,
              ("@fast", "@connection")),
    "client": (-2, (), 0, 0, 0, ("@slow", "@connection")),
    "command": (-1, ("loading", "stale"), 0, 0, 0, ("@slow", "@connection")),
    "select": (2, ("loading", "stale", "fast"), 0, 0, 0, ("@fast", "@connection")),
    "config": (-2, (), 0, 0, 0, ("@admin", "@slow", "@dangerous")),
    "auth": (-2, ("noscript", "loading", "stale", "fast", "no_auth", "allow_busy"), 0, 0, 0,
             ("@fast", "@connection")),
    "ttl": (2, ("readonly", "fast"), 1, 1, 1, ("@keyspace", "@read", "@fast")),
    "pttl": (2, ("readonly", "fast"), 1, 1, 1, ("@keyspace", "@read", "@fast")),
    "expiretime": (2, ("readonly", "fast"), 1, 1, 1, ("@keyspace", "@read", "@fast")),
    "pexpiretime": (2, ("readonly", "fast"), 1, 1, 1, ("@keyspace", "@read", "@fast")),
    "type": (2, ("readonly", "fast"), 1, 1, 1, ("@keyspace", "@read", "@fast")),
    "strlen": (2, ("readonly", "fast"), 1, 1, 1, ("@read", "@string", "@fast")),
    "getrange": (4, ("readonly",), 1, 1, 1, ("@read", "@string", "@slow")),
    "multi": (1, ("noscript", "loading", "stale", "fast", "allow_busy"), 0, 0, 0, ("@fast", "@transaction")),
    "exec": (1, ("noscript", "loading", "stale", "skip_slowlog"), 0, 0, 0, ("@slow", "@transaction")),
    "discard": (1, ("noscript", "loading", "stale", "fast", "allow_busy"), 0, 0, 0, ("@fast", "@transaction")),
    "watch": (-2, ("noscript", "loading", "stale", "fast", "allow_busy"), 1, -1, 1, ("@fast", "@transaction")),
    "unwatch": (1, ("noscript", "loading", "stale", "fast", "allow_busy"), 0, 0, 0, ("@fast", "@transaction")),
    "subscribe": (-2, ("pubsub", "noscript", "loading", "stale"), 0, 0, 0, ("@pubsub", "@slow")),
    "psubscribe": (-2, ("pubsub", "noscript", "loading", "stale"), 0, 0, 0, ("@pubsub", "@slow")),
    "unsubscribe": (-1, ("pubsub", "noscript", "loading", "stale"), 0, 0, 0, ("@pubsub", "@slow")),
    "punsubscribe": (-1, ("pubsub", "noscript", "loading", "stale"), 0, 0, 0, ("@pubsub", "@slow")),
    "pubsub": (-2, (), 0, 0, 0, ("@slow",)),
    "reset": (1, ("noscript", "loading", "stale", "fast", "no_auth", "allow_busy"), 0, 0, 0,
              ("@fast", "@connection")),
    "xread": (-4, ("readonly", "blocking", "movablekeys"), 0, 0, 0, ("@read", "@stream", "@slow", "@blocking")),
    "xrange": (-4, ("readonly",), 1, 1, 1, ("@read", "@stream", "@slow")),
    "xrevrange": (-4, ("readonly",), 1, 1, 1, ("@read", "@stream", "@slow")),
    "xlen": (2, ("readonly", "fast"), 1, 1, 1, ("@read", "@stream", "@fast")),
    "xinfo": (-2, (), 0, 0, 0, ("@slow",)),
    "xpending": (-3, ("readonly",), 1, 1, 1, ("@read", "@stream", "@slow")),
}

# COMMAND DOCS: name -> (summary, group, since: the Redis version that introduced it, or
# None for kvcache's own). Real entries, not an empty map: an empty reply to `COMMAND DOCS get`
# would say there is no GET.
COMMAND_DOCS: dict[str, tuple[str, str, str | None]] = {
    "get": ("Get the value of a key", "string", "1.0.0"),
    "mget": ("Get the values of all the given keys", "string", "1.0.0"),
    "exists": ("Determine how many of the given keys exist", "generic", "1.0.0"),
    "kv.get": ("Get a key's value with its revision, creation time, operation and source",
               "string", None),
    "keys": ("Find all keys matching the given pattern", "generic", "1.0.0"),
    "scan": ("Incrementally iterate the keys space", "generic", "2.8.0"),
    "dbsize": ("Return the number of keys in the default bucket", "server", "1.0.0"),
    "info": ("Get information and statistics about the sidecar", "server", "1.0.0"),
    "ping": ("Ping the server", "connection", "1.0.0"),
    "echo": ("Echo the given string", "connection", "1.0.0"),
    "quit": ("Close the connection", "connection", "1.0.0"),
    "hello": ("Handshake with the server", "connection", "6.0.0"),
    "client": ("A container for client connection commands", "connection", "2.4.0"),
    "command": ("Get array of command details", "server", "2.8.13"),
    "select": ("Change the selected database (only 0 exists)", "connection", "1.0.0"),
    "config": ("Get configuration parameters (CONFIG SET notify-keyspace-events only)", "server", "2.0.0"),
    "auth": ("Authenticate to the server", "connection", "1.0.0"),
    "ttl": ("Get the time to live for a key in seconds", "generic", "1.0.0"),
    "pttl": ("Get the time to live for a key in milliseconds", "generic", "2.6.0"),
    "expiretime": ("Get the expiration Unix timestamp for a key", "generic", "7.0.0"),
    "pexpiretime": ("Get the expiration Unix timestamp for a key in milliseconds", "generic", "7.0.0"),
    "type": ("Determine the type stored at key", "generic", "1.0.0"),
    "strlen": ("Get the length of the value stored in a key", "string", "2.2.0"),
    "getrange": ("Get a substring of the string stored at a key", "string", "2.4.0"),
    "multi": ("Mark the start of a transaction block", "transactions", "1.2.0"),
    "exec": ("Execute all commands issued after MULTI", "transactions", "1.2.0"),
    "discard": ("Discard all commands issued after MULTI", "transactions", "2.0.0"),
    "watch": ("Watch the given keys to determine execution of the MULTI/EXEC block",
              "transactions", "2.2.0"),
    "unwatch": ("Forget about all watched keys", "transactions", "2.2.0"),
    "subscribe": ("Listen for messages published to the given channels", "pubsub", "2.0.0"),
    "psubscribe": ("Listen for messages published to channels matching the given patterns",
                   "pubsub", "2.0.0"),
    "unsubscribe": ("Stop listening for messages posted to the given channels", "pubsub", "2.0.0"),
    "punsubscribe": ("Stop listening for messages posted to channels matching the given patterns",
                     "pubsub", "2.0.0"),
    "pubsub": ("A container for Pub/Sub commands", "pubsub", "2.8.0"),
    "reset": ("Reset the connection", "connection", "6.2.0"),
    "xread": ("Return new entries of a bucket's stream (@bucket), blocking if asked", "stream", "5.0.0"),
    "xrange": ("Return a range of a bucket's stream (@bucket) by revision", "stream", "5.0.0"),
    "xrevrange": ("Return a range of a bucket's stream (@bucket) in reverse", "stream", "5.0.0"),
    "xlen": ("Return the number of entries of a bucket's stream (@bucket)", "stream", "5.0.0"),
    "xinfo": ("A container for stream introspection commands", "stream", "5.0.0"),
    "xpending": ("Pending entries of a consumer group (a bucket's stream has none)", "stream", "5.0.0"),
}

if TYPE_CHECKING:  # the connection the server hands every handler
    from .session import Session


def arity(n: int, exact: bool = True):
    """Reject a wrong argument count with Redis's own wording before the handler runs."""
    def wrap(fn):
        @functools.wraps(fn)
        def checked(self, conn, args):
            if (len(args) != n) if exact else (len(args) < n):
                name = args[0].decode(errors="replace").lower()
                raise CommandError(f"ERR wrong number of arguments for '{name}' command")
            return fn(self, conn, args)
        return checked
    return wrap


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
        self._table: dict[bytes, Callable[[Session, list[bytes]], Reply]] = {
            b"get": self.get, b"mget": self.mget, b"exists": self.exists,
            b"kv.get": self.kv_get, b"keys": self.keys, b"scan": self.scan,
            b"dbsize": self.dbsize, b"info": self.info, b"command": self.command,
            b"config": self.config, b"ttl": self.ttl, b"pttl": self.pttl,
            b"expiretime": self.expiretime, b"pexpiretime": self.pexpiretime,
            b"type": self.type, b"strlen": self.strlen, b"getrange": self.getrange,
            b"xread": streams.xread, b"xrange": streams.xrange, b"xrevrange": streams.xrevrange,
            b"xlen": self.xlen, b"xinfo": self.xinfo, b"xpending": self.xpending,
            **self.session.table(),
        }

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
        connection are still there (a pipelined GET or MGET: kvcache.serve.connection), or
        None for any other command, or a read it cannot resolve (it waits its turn). Keys,
        not raw names: `k` and `bucket:k` are one key, whose reads must not overtake each other."""
        name = args[0].lower()
        if not (name == b"get" and len(args) == 2) and not (name == b"mget" and len(args) > 1):
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
        self.stats.commands += 1
        name = args[0].lower()
        handler = self._table.get(name)
        # CLIENT LIST's cmd: Redis's full name of the command looked up (`client|list`), or
        # NULL (None) for one it does not know (an unknown command or subcommand)
        if handler is not None:
            conn.last_cmd = _full_name(name, args) if name in SUBCOMMANDS else name
        else:
            conn.last_cmd = name if name in WRITE_COMMANDS else None
        try:
            if conn.gate and handler is not None:  # unauthenticated, in MULTI, RESP2 subscribed
                early = self._gate(conn, name, args)
                if early is not None:
                    return early
            if handler is not None:
                reply = handler(conn, args)
            elif name in WRITE_COMMANDS:
                reply = READONLY
            else:
                reply = _unknown(args)
        except (CommandError, ReplyTooLarge) as e:
            reply = resp.error(str(e))
        if conn.multi is not None and handler is None and name != b"multi":
            conn.multi_failed = True  # an unknown command or a write queued: EXECABORT
        if conn.tracking is not None:
            return self._tracked(conn, name, args, reply)
        return reply

    def _gate(self, conn: Session, name: bytes, args: list[bytes]) -> bytes | None:
        """The reply of a command the connection's state stops, as Redis gives it; None to
        run it. In MULTI, a command is checked (arity, not a write) and queued."""
        if not conn.authenticated and name not in NO_AUTH:
            return NOAUTH
        if conn.proto == 2 and conn.subscribed and name not in SUBSCRIBED_OK:
            return resp.error(f"ERR Can't execute '{name.decode(errors='replace')}': only (P|S)SUBSCRIBE / "
                              "(P|S)UNSUBSCRIBE / PING / QUIT / RESET are allowed in this context")
        if conn.multi is not None and name not in CONTROL:
            spec = COMMAND_SPECS.get(name.decode(errors="replace"))
            if spec is not None and ((len(args) != spec[0]) if spec[0] > 0 else (len(args) < -spec[0])):
                conn.multi_failed = True
                return resp.error(f"ERR wrong number of arguments for '{name.decode(errors='replace')}' command")
            conn.multi.append(args)
            return QUEUED
        return None

    def _tracked(self, conn: Session, name: bytes, args: list[bytes], reply: Reply) -> Reply:
        """CLIENT TRACKING's bookkeeping after a command (kvcache.serve.tracking): keys
        read from the replica in this step are remembered; keys of a reply that waited are
        invalidated once it is written; CLIENT CACHING covers one command (or one MULTI)."""
        t = conn.tracking
        if t is None or conn.multi is not None:
            return reply  # queued: the keys are read (and CACHING used) at EXEC
        if name == b"exec":
            names = conn.exec_keys
            conn.exec_keys = []
        elif name in TRACKED:
            names = key_args(name, args)
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

    @arity(2)
    def get(self, conn: Session, args: list[bytes]) -> Reply:
        proto = conn.proto
        return self.reads.one(args[1], "GET", lambda e: resp.bulk(e.value if e else None, proto))

    @arity(2, exact=False)
    def mget(self, conn: Session, args: list[bytes]) -> Reply:
        proto = conn.proto
        return self.reads.many(args[1:], "MGET", lambda values: _values_reply(values, proto),
                               ReplyBudget(self.cfg.max_reply_bytes))

    @arity(2, exact=False)
    def exists(self, conn: Session, args: list[bytes]) -> Reply:
        return self.reads.many(args[1:], "EXISTS",
                               lambda values: resp.integer(sum(v is not None for v in values)))

    def _ttl(self, conn: Session, args: list[bytes], ms: bool, absolute: bool) -> Reply:
        if len(args) != 2:
            name = args[0].decode(errors="replace").lower()
            raise CommandError(f"ERR wrong number of arguments for '{name}' command")

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

    @arity(2)
    def type(self, conn: Session, args: list[bytes]) -> Reply:
        if args[1][:1] == b"@":
            return self.streams.type(conn, args)
        return self.reads.one(args[1], "TYPE", lambda e: STRING_TYPE if e is not None else NONE_TYPE)

    @arity(2)
    def xlen(self, conn: Session, args: list[bytes]) -> Reply:
        return self.streams.xlen(conn, args)

    @arity(2, exact=False)
    def xinfo(self, conn: Session, args: list[bytes]) -> Reply:
        return self.streams.xinfo(conn, args)

    @arity(3, exact=False)
    def xpending(self, conn: Session, args: list[bytes]) -> Reply:
        """No consumer group exists on a bucket's stream (XGROUP CREATE is a write)."""
        self.streams.stream_of(args[1])
        raise CommandError(f"NOGROUP No such key '{args[1][:64].decode(errors='replace')}' or consumer group "
                           f"'{args[2][:64].decode(errors='replace')}'")

    @arity(2)
    def strlen(self, conn: Session, args: list[bytes]) -> Reply:
        return self.reads.one(args[1], "STRLEN",
                              lambda e: resp.integer(len(e.value) if e and e.value else 0))

    @arity(4)
    def getrange(self, conn: Session, args: list[bytes]) -> Reply:
        start, end = _int_arg(args[2]), _int_arg(args[3])
        proto = conn.proto
        return self.reads.one(args[1], "GETRANGE",
                              lambda e: resp.bulk(_range((e.value or b"") if e else b"", start, end), proto))

    @arity(2, exact=False)
    def kv_get(self, conn: Session, args: list[bytes]) -> Reply:
        try:
            opts = _options(args[2:], {b"consistency": str, b"maxstale": int, b"minrev": int})
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

    @arity(2)
    def keys(self, conn: Session, args: list[bytes]) -> Reply:
        return resp.array([resp.bulk(k, conn.proto) for k in self.listing.keys(args[1])], conn.proto)

    @arity(2, exact=False)
    def scan(self, conn: Session, args: list[bytes]) -> Reply:
        try:
            cursor = int(args[1])
        except ValueError:
            raise CommandError("ERR invalid cursor") from None
        opts = _options(args[2:], {b"match": bytes, b"count": int, b"type": str})
        count = opts.get(b"count", 10)
        if count < 1:
            raise CommandError("ERR syntax error")
        if opts.get(b"type", "string").lower() != "string":
            return resp.array([resp.bulk(b"0"), resp.array([])])
        next_cursor, found = self.listing.page(opts.get(b"match", b"*"), cursor, count)
        return resp.array([resp.bulk(b"%d" % next_cursor),
                           resp.array([resp.bulk(k, conn.proto) for k in found], conn.proto)], conn.proto)

    @arity(1)
    def dbsize(self, conn: Session, args: list[bytes]) -> Reply:
        return resp.integer(self.listing.count())

    # ------------------------------------------------------------------ server

    def command(self, conn: Session, args: list[bytes]) -> Reply:
        sub = args[1].lower() if len(args) > 1 else b""
        proto = conn.proto
        if sub == b"" and len(args) == 1:
            return resp.array([_command_info(n, proto) for n in COMMAND_SPECS], proto)
        if sub == b"count" and len(args) == 2:
            return resp.integer(len(COMMAND_SPECS))
        if sub == b"info":
            names = [a.decode(errors="replace").lower() for a in args[2:]] or list(COMMAND_SPECS)
            return resp.array([_command_info(n, proto) for n in names], proto)
        if sub == b"docs":
            # Redis leaves out names it does not know; no names: every command
            names = [a.decode(errors="replace").lower() for a in args[2:]] or list(COMMAND_DOCS)
            return resp.map_([(resp.bulk(n.encode(), proto), _command_docs(n, proto))
                              for n in dict.fromkeys(names) if n in COMMAND_DOCS], proto)
        if sub == b"list":
            return resp.array([resp.bulk(n.encode(), proto) for n in COMMAND_SPECS], proto)
        raise CommandError(f"ERR unknown subcommand '{args[1].decode(errors='replace')[:64]}'. Try COMMAND HELP.")

    @arity(2, exact=False)
    def config(self, conn: Session, args: list[bytes]) -> Reply:
        sub = args[1].lower()
        if sub == b"set":
            return self._config_set(args)
        if sub != b"get":
            raise CommandError("ERR kvcache supports CONFIG GET, and CONFIG SET of notify-keyspace-events")
        if len(args) < 3:
            raise CommandError("ERR wrong number of arguments for 'config|get' command")
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
        if len(args) < 4 or len(args) % 2:
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
        return resp.verbatim(self.info_text(wanted), conn.proto)

    def info_text(self, wanted: set[str]) -> str:
        return self.info_source.text(wanted)


# ---------------------------------------------------------------------- helpers

STRING_TYPE = b"+string\r\n"
NONE_TYPE = b"+none\r\n"


def _int_arg(raw: bytes) -> int:
    """An integer argument as Redis reads one (64-bit, no spaces or leading '+')."""
    if not re.fullmatch(rb"0|-?[1-9][0-9]*", raw) or not -(1 << 63) <= int(raw) < 1 << 63:
        raise CommandError("ERR value is not an integer or out of range")
    return int(raw)


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


def _command_info(name: str, proto: int) -> bytes:
    spec = COMMAND_SPECS.get(name)
    if spec is None:
        return resp.null(proto) if proto == 3 else resp.NULL_ARRAY2
    arity_, flags, first, last, step, cats = spec
    return resp.array([
        resp.bulk(name.encode(), proto), resp.integer(arity_),
        resp.array([resp.simple(f) for f in flags], proto),
        resp.integer(first), resp.integer(last), resp.integer(step),
        resp.array([resp.simple(c) for c in cats], proto),
        resp.EMPTY_ARRAY, resp.EMPTY_ARRAY, resp.EMPTY_ARRAY,  # tips, key specs, subcommands
    ], proto)


def _command_docs(name: str, proto: int) -> bytes:
    summary, group, since = COMMAND_DOCS[name]
    fields = [(b"summary", summary), (b"group", group)] + ([(b"since", since)] if since else [])
    return resp.map_([(resp.bulk(k, proto), resp.bulk(v.encode(), proto)) for k, v in fields], proto)


def _options(args: list[bytes], spec: dict[bytes, type]) -> dict[bytes, Any]:
    """`NAME value` pairs, case-insensitive names, typed values; anything else is a syntax error."""
    out: dict[bytes, Any] = {}
    if len(args) % 2:
        raise CommandError("ERR syntax error")
    for i in range(0, len(args), 2):
        name = args[i].lower()
        t = spec.get(name)
        if t is None:
            raise CommandError("ERR syntax error")
        raw = args[i + 1]
        if t is int:
            try:
                number = int(raw)
            except ValueError:
                raise CommandError("ERR value is not an integer or out of range") from None
            if number < 0:
                raise CommandError("ERR value is out of range, must be positive")
            out[name] = number
        elif t is str:
            out[name] = raw.decode(errors="replace")
        else:
            out[name] = raw
    return out
