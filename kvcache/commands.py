"""The RESP command set (docs/commands.md): decode arguments, ask the read policy where each
read is answered (kvcache.readpolicy), count and log it, encode the reply.

A handler returns the encoded reply as bytes when it can answer at once (the common case: a
local read), or a coroutine when it must ask NATS; the server keeps replies in request order.
"""
from __future__ import annotations

import asyncio
import functools
import re
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from . import resp
from .accesslog import AccessLog
from .changes import ChangeHub
from .commands_session import NO_AUTH, NOAUTH, SessionCommands
from .config import BucketConfig, Config
from .entry import Entry, Operation
from .errors import CommandError, KvcacheError, ReplyBudget, ReplyTooLarge
from .info import Info
from .keys import glob_matcher, reserved_key
from .keyspace_events import parse_flags
from .latency import Latency
from .readpolicy import STALE_SOURCE, ReadPolicy
from .record import Record, expiry, live_value
from .replica import RECORD
from .scan import ScanCursors
from .server_multi import CONTROL, QUEUED, Transactions
from .server_pubsub import SUBSCRIBED_OK, PubSub
from .server_tracking import TRACKED, Tracking, key_args
from .stats import Stats

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
sunionstore swapdb unlink xack xadd xautoclaim xclaim xdel xgroup xtrim zadd zdiffstore zincrby
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
    """The command table: Redis's read commands and KV.GET over the read policy. Handlers
    return the encoded reply, or a coroutine when NATS must answer (the server keeps replies
    in request order); a CommandError becomes the RESP error reply."""

    def __init__(self, cfg: Config, policy: ReadPolicy, stats: Stats,
                 access: AccessLog | None = None) -> None:
        self.cfg = cfg
        self.policy = policy
        self.replica = policy.replica
        self.stats = stats
        self.access = access if access is not None else AccessLog.from_config(cfg)
        self._cursors = ScanCursors()
        # What the server builds on the feeds' changes (kvcache.changes): one hub, its listeners
        self.hub = ChangeHub()
        self.tracking = Tracking(cfg.tracking_table_max_keys, cfg.default_bucket, lambda _id: None)
        self.pubsub = PubSub(cfg.notify_keyspace_events, cfg.default_bucket)
        self.transactions = Transactions(policy)
        self.info_source = Info(cfg, stats, policy, self.access, self.tracking, self.pubsub)
        for listener in (self.tracking, self.pubsub, self.transactions):
            self.hub.add(listener)
        self.tracking.on_first = self.hub.wake
        self.timing: dict[bytes, Latency] | None = None  # per command, once time_commands() is called
        self.session = SessionCommands(cfg, self.tracking, self.pubsub, self.transactions, self.dispatch)
        self._table: dict[bytes, Callable[[Session, list[bytes]], Reply]] = {
            b"get": self.get, b"mget": self.mget, b"exists": self.exists,
            b"kv.get": self.kv_get, b"keys": self.keys, b"scan": self.scan,
            b"dbsize": self.dbsize, b"info": self.info, b"command": self.command,
            b"config": self.config, b"ttl": self.ttl, b"pttl": self.pttl,
            b"expiretime": self.expiretime, b"pexpiretime": self.pexpiretime,
            b"type": self.type, b"strlen": self.strlen, b"getrange": self.getrange,
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

    def forget(self, conn: Session) -> None:
        """A connection closed: its tracking, subscriptions and watched keys go with it."""
        self.tracking.disable(conn)
        self.pubsub.drop(conn)
        self.transactions.unwatch(conn)

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
        """CLIENT TRACKING's bookkeeping after a command (kvcache.server_tracking): keys
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
        return self._one(conn, args[1], "GET",
                         lambda bc, found: resp.bulk(found.value if found else None, proto))

    def _cached(self, bc: BucketConfig, key: str, t0: int, command: str,
                max_stale_ms: int | None = None, min_rev: int | None = None) -> Entry | None:
        """The near cache's answer for a key outside the filters (ReadPolicy.cached), counted
        and logged (source `cache`); None: ask NATS. A cached not-found has no value.
        `min_rev` (KV.GET's MINREV): only a value at that revision or above answers."""
        entry = self.policy.cached(bc, key, max_stale_ms)
        if entry is not None and min_rev is not None and (entry.value is None or entry.revision < min_rev):
            entry = None
        if entry is not None:
            hit = entry.value is not None
            self.stats.gets_cached += 1
            self.stats.read(bc.name, "cache", hit)
            self._log(t0, bc.name, key, "cache", hit, command)
            if not hit:
                self.stats.gets_notfound += 1
        return entry

    def _t0(self) -> int:
        """Start time for the access log's latency; 0 (no clock read) when the log is off."""
        return time.perf_counter_ns() if self.access.enabled else 0

    def _log(self, t0: int, bucket: str, key: str, source: str, hit: bool, command: str) -> None:
        """One read into the access log, if sampled."""
        if t0 and self.access.sampled():
            self._record(t0, bucket, key, source, hit, command)

    def _record(self, t0: int, bucket: str, key: str, source: str, hit: bool, command: str) -> None:
        self.access.record(bucket, key, source, hit, (time.perf_counter_ns() - t0) // 1000, command)

    async def remote_entry(self, bc: BucketConfig, key: str, strong: bool = False, t0: int = 0,
                           command: str = "KV.GET", max_stale_ms: int | None = None) -> Entry | None:
        """A fallback read; the replica's copy wins when it is newer (reads never go back).
        When no peer can answer, a stale replica may (see _stale_entry)."""
        self.stats.gets_remote += 1
        source = "remote"
        try:
            entry, answered = await self.policy.remote(bc, key, strong=strong)
        except KvcacheError as e:
            self.stats.remote_errors += 1
            try:
                entry = self.policy.stale_entry(bc, key, e, strong, max_stale_ms)  # or CommandError
            except CommandError:
                self.stats.read_failed(bc.name)
                raise
            source = STALE_SOURCE
            self.stats.gets_stale += 1
        else:
            entry = self.policy.newest(bc, key, entry)
            self.policy.fill(bc, key, entry, answered)
        hit = entry is not None and entry.operation is Operation.PUT
        self.stats.read(bc.name, _read_source(entry, source), hit)
        self._log(t0, bc.name, key, entry.source if entry else source, hit, command)
        if not hit:
            self.stats.gets_notfound += 1
            return None
        return entry

    def _lookup(self, raw_keys: list[bytes], t0: int = 0, command: str = "MGET",
                budget: ReplyBudget | None = None) -> tuple[list[bytes | None], dict[str, list[tuple[int, str]]],
                                                            dict[str, list[tuple[int, str, int]]]]:
        """Local values for the keys the replica may answer (one read transaction for all),
        and the rest grouped by bucket; among the rest, the keys the replica could answer
        once it reaches a revision already handed out from NATS (with that sequence: see
        _gate). An invalid key fails the whole command, and so do values beyond `budget`
        (ReplyTooLarge)."""
        values: list[bytes | None] = [None] * len(raw_keys)
        misses: dict[str, list[tuple[int, str]]] = {}
        gated: dict[str, list[tuple[int, str, int]]] = {}
        plan_of = self.policy.plan
        txn = None
        local = notfound = 0
        try:
            for i, raw in enumerate(raw_keys):
                plan = plan_of(raw)
                if not plan or not plan.feed.fresh_within(plan.max_stale_ms):
                    bc, key = self.policy.resolve(raw)  # raises for an invalid key
                    hit = None if plan else self._cached(bc, key, t0, command)
                    if hit is not None:
                        if budget is not None and hit.value is not None:
                            budget.spend(len(hit.value))
                        values[i] = hit.value
                        continue
                    misses.setdefault(bc.name, []).append((i, key))
                    continue
                feed, _, _, lkey, db, offset = plan
                if txn is None:
                    txn = self.replica.env.begin()
                rec = txn.get(lkey, None, db)
                if feed.floor_seq:
                    bucket, key, want = self.policy.gated(raw, feed, rec)
                    if want:
                        gated.setdefault(bucket, []).append((i, key, want))
                        continue
                if rec is not None and (rec[19] >= 0x80 or feed.max_age_ns):
                    rec, offset = live_value(rec, time.time_ns(), feed.max_age_ns), 0
                local += 1
                self.stats.read(plan[2], "local", rec is not None)
                if t0 and self.access.sampled():  # resolved again only when sampled
                    bc, key = self.policy.resolve(raw)
                    self._record(t0, bc.name, key, "local", rec is not None, command)
                if rec is None:
                    notfound += 1
                else:
                    start = offset if offset is not None else RECORD.size + RECORD.unpack_from(rec)[2]
                    if budget is not None:
                        budget.spend(len(rec) - start)
                    values[i] = rec[start:]
        finally:
            if txn is not None:
                txn.abort()
            self.stats.gets_local += local
            self.stats.gets_notfound += notfound
        for bucket, items in gated.items():  # NATS answers those the replica does not
            misses.setdefault(bucket, []).extend((i, key) for i, key, _ in items)
        return values, misses, gated

    async def _gated_many(self, values: list[bytes | None], misses: dict[str, list[tuple[int, str]]],
                          gated: dict[str, list[tuple[int, str, int]]], budget: ReplyBudget | None,
                          t0: int = 0, command: str = "MGET") -> None:
        """MGET/EXISTS keys the replica could not answer without going back (see _gate):
        wait once per bucket (up to readpolicy.MINREV_WAIT_S) for the replica to reach them, answer
        those it may answer then, and leave the others in `misses`, for NATS."""
        for bucket, items in gated.items():
            bc = self.cfg.bucket(bucket)
            assert bc is not None  # gated keys were resolved
            await self.policy.wait_applied(bucket, max(w for _, _, w in items))
            local = 0
            answered: set[int] = set()
            for i, key, _ in items:
                ok, rec = self.policy.local_now(bc, key)
                if not ok:
                    continue
                answered.add(i)
                local += 1
                self.stats.read(bucket, "local", rec is not None)
                self._log(t0, bucket, key, "local", rec is not None, command)
                if rec is None:
                    self.stats.gets_notfound += 1
                    continue
                if budget is not None:
                    budget.spend(len(rec.value))
                values[i] = rec.value
            self.stats.gets_local += local
            rest = [(i, key) for i, key in misses[bucket] if i not in answered]
            if rest:
                misses[bucket] = rest
            else:
                del misses[bucket]

    @arity(2, exact=False)
    def mget(self, conn: Session, args: list[bytes]) -> Reply:
        t0 = self._t0()
        budget = ReplyBudget(self.cfg.max_reply_bytes)
        values, misses, gated = self._lookup(args[1:], t0, "MGET", budget)
        if not misses:
            return _values_reply(values, conn.proto)
        return self._remote_many(values, misses, lambda: _values_reply(values, conn.proto), t0, "MGET",
                                 budget, gated)

    @arity(2, exact=False)
    def exists(self, conn: Session, args: list[bytes]) -> Reply:
        t0 = self._t0()
        values, misses, gated = self._lookup(args[1:], t0, "EXISTS")
        def count():
            return resp.integer(sum(v is not None for v in values))
        return self._remote_many(values, misses, count, t0, "EXISTS", gated=gated) if misses else count()

    async def _remote_many(self, values: list[bytes | None], misses: dict[str, list[tuple[int, str]]],
                           reply: Callable[[], bytes], t0: int = 0, command: str = "MGET",
                           budget: ReplyBudget | None = None,
                           gated: dict[str, list[tuple[int, str, int]]] | None = None) -> bytes:
        """Fill the misses with one batched multi_last read per bucket, then encode. Keys
        in `gated` (also in `misses`) may still be answered by the replica (_gated_many)."""
        if gated:
            await self._gated_many(values, misses, gated, budget, t0, command)
        for bucket, wanted in misses.items():
            bc = self.cfg.bucket(bucket)
            assert bc is not None  # misses are grouped by buckets resolve() found
            keys = list(dict.fromkeys(k for _, k in wanted))
            self.stats.gets_remote += len(keys)
            source = "remote"
            answered: dict[str, str] = {}
            try:
                found, answered = await self.policy.remote_many(bucket, keys, budget)
            except ReplyTooLarge:
                raise
            except KvcacheError as e:
                self.stats.remote_errors += 1
                # every key from the stale replica, or the command fails (_stale_entry)
                try:
                    found = {k: self.policy.stale_entry(bc, k, e) for k in keys}
                except CommandError:
                    self.stats.read_failed(bucket, len(wanted))
                    raise
                source = STALE_SOURCE
                self.stats.gets_stale += len(keys)
            if source != STALE_SOURCE:
                for key in keys:
                    self.policy.fill(bc, key, found.get(key), answered.get(key, ""))
            for i, key in wanted:
                entry = found[key] if source == STALE_SOURCE else self.policy.newest(bc, key, found.get(key))
                self.stats.read(bucket, _read_source(entry, source),
                                entry is not None and entry.operation is Operation.PUT)
                self._log(t0, bucket, key, entry.source if entry else source,
                          entry is not None and entry.operation is Operation.PUT, command)
                if entry is None or entry.operation is not Operation.PUT:
                    self.stats.gets_notfound += 1
                else:
                    if source == STALE_SOURCE and budget is not None and entry.value:
                        budget.spend(len(entry.value))  # peers charged what they answered
                    values[i] = entry.value
        return reply()

    # ------------------------------------------------------------------ one key's facts

    def _one(self, conn: Session, raw: bytes, command: str,
             answer: Callable[[BucketConfig, Found | None], bytes]) -> Reply:
        """A read of one key whose reply is worked out from what the key holds (`answer`
        gets None for a missing key): GET on the generic path, TTL and its kin, TYPE,
        STRLEN, GETRANGE. The replica when it may answer (waiting for a gated key), else the
        near cache, else NATS."""
        bc, key = self.policy.resolve(raw)
        t0 = self._t0()
        if self.policy.local_ok(bc, key):
            rec = self.replica.get(bc.name, key)
            want = self.policy.behind(bc, key, rec)
            if not want:
                return answer(bc, self._local_found(bc, key, rec, t0, command))
            return self._one_gated(bc, key, want, t0, command, answer)
        cached = self._cached(bc, key, t0, command)
        if cached is not None:
            return answer(bc, None if cached.value is None else Found(cached.value, cached.created, cached.expires))
        return self._one_remote(bc, key, t0, command, answer)

    def _local_found(self, bc: BucketConfig, key: str, rec: Record | None, t0: int,
                     command: str) -> Found | None:
        self.stats.gets_local += 1
        self.stats.read(bc.name, "local", rec is not None)
        self._log(t0, bc.name, key, "local", rec is not None, command)
        if rec is None:
            self.stats.gets_notfound += 1
            return None
        return Found(rec.value, rec.created, rec.expires)

    async def _one_gated(self, bc: BucketConfig, key: str, want: int, t0: int, command: str,
                         answer: Callable[[BucketConfig, Found | None], bytes]) -> bytes:
        local, rec = await self.policy.local_after(bc, key, want)
        if local:
            return answer(bc, self._local_found(bc, key, rec, t0, command))
        return await self._one_remote(bc, key, t0, command, answer)

    async def _one_remote(self, bc: BucketConfig, key: str, t0: int, command: str,
                          answer: Callable[[BucketConfig, Found | None], bytes]) -> bytes:
        entry = await self.remote_entry(bc, key, t0=t0, command=command)
        if entry is None or entry.value is None:
            return answer(bc, None)
        return answer(bc, Found(entry.value, entry.created, entry.expires))

    def _ttl(self, conn: Session, args: list[bytes], ms: bool, absolute: bool) -> Reply:
        if len(args) != 2:
            name = args[0].decode(errors="replace").lower()
            raise CommandError(f"ERR wrong number of arguments for '{name}' command")

        def answer(bc: BucketConfig, found: Found | None) -> bytes:
            if found is None:
                return resp.integer(-2)
            feed = self.policy.feeds.get(bc.name)
            due = expiry(found.created, found.expires, feed.max_age_ns if feed else 0)
            if not due:
                return resp.integer(-1)
            left = due // 1_000_000 if absolute else max(0, (due - time.time_ns()) // 1_000_000)
            return resp.integer(left if ms else (left + 500) // 1000)
        return self._one(conn, args[1], args[0].decode(errors="replace").upper(), answer)

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
        return self._one(conn, args[1], "TYPE",
                         lambda bc, found: STRING_TYPE if found is not None else NONE_TYPE)

    @arity(2)
    def strlen(self, conn: Session, args: list[bytes]) -> Reply:
        return self._one(conn, args[1], "STRLEN",
                         lambda bc, found: resp.integer(len(found.value) if found else 0))

    @arity(4)
    def getrange(self, conn: Session, args: list[bytes]) -> Reply:
        start, end = _int_arg(args[2]), _int_arg(args[3])
        proto = conn.proto
        return self._one(conn, args[1], "GETRANGE",
                         lambda bc, found: resp.bulk(_range(found.value if found else b"", start, end), proto))

    @arity(2, exact=False)
    def kv_get(self, conn: Session, args: list[bytes]) -> Reply:
        bc, key = self.policy.resolve(args[1])
        opts = _options(args[2:], {b"consistency": str, b"maxstale": int, b"minrev": int})
        consistency = opts.get(b"consistency", "local").lower()
        if consistency not in ("local", "strong"):
            raise CommandError("ERR CONSISTENCY must be local or strong")
        max_stale = opts.get(b"maxstale")
        min_rev = opts.get(b"minrev")
        t0 = self._t0()
        if consistency == "local" and min_rev is None and self.policy.local_ok(bc, key, max_stale):
            rec = self.replica.get(bc.name, key)
            want = self.policy.behind(bc, key, rec)
            if not want:
                return self._local_entry(conn, bc, key, rec, t0)
            return self._gated_entry(conn, bc, key, want, max_stale, t0)
        if consistency == "local":
            cached = self._cached(bc, key, t0, "KV.GET", max_stale, min_rev)
            if cached is not None:
                return resp.null(conn.proto) if cached.value is None else _entry_reply(cached, conn.proto)
        return self._kv_get_remote(conn, bc, key, consistency == "strong", max_stale, min_rev, t0)

    async def _gated_entry(self, conn: Session, bc: BucketConfig, key: str, want: int,
                           max_stale: int | None, t0: int = 0) -> bytes:
        """KV.GET of a key whose newer revision was handed out from NATS (see _local_after)."""
        local, rec = await self.policy.local_after(bc, key, want, max_stale)
        if local:
            return self._local_entry(conn, bc, key, rec, t0)
        return await self._kv_get_remote(conn, bc, key, False, max_stale, None, t0)

    def _local_entry(self, conn: Session, bc: BucketConfig, key: str, rec: Record | None,
                     t0: int = 0) -> bytes:
        self.stats.gets_local += 1
        self.stats.read(bc.name, "local", rec is not None)
        self._log(t0, bc.name, key, "local", rec is not None, "KV.GET")
        if rec is None:
            self.stats.gets_notfound += 1
            return resp.null(conn.proto)
        return _entry_reply(Entry(bc.name, key, rec.value, rec.revision, rec.created), conn.proto)

    async def _kv_get_remote(self, conn: Session, bc: BucketConfig, key: str, strong: bool,
                             max_stale: int | None, min_rev: int | None, t0: int = 0) -> bytes:
        if min_rev is not None and not strong:
            # A replicated key is served locally once the replica reaches the revision; any
            # other goes to the leader at once instead of waiting for sequences never applied.
            if self.policy.in_filters(bc.name, key):
                local, rec = await self.policy.local_after(bc, key, min_rev, max_stale)
                if local:
                    return self._local_entry(conn, bc, key, rec, t0)
            strong = True  # the replica is behind the revision asked for: the leader has it
        entry = await self.remote_entry(bc, key, strong=strong, t0=t0, max_stale_ms=max_stale)
        if entry is None:
            return resp.null(conn.proto)
        return _entry_reply(entry, conn.proto)

    # ------------------------------------------------------------------ key listing

    def _pattern_target(self, pattern: bytes) -> tuple[str, str, str]:
        """(bucket, key glob, prefix to show): `bucket:glob` lists another bucket."""
        text = pattern.decode(errors="replace")
        bucket, sep, glob = text.partition(":")
        if sep and self.cfg.bucket(bucket):
            return bucket, glob, bucket + ":"
        if not self.cfg.default_bucket:
            raise CommandError("ERR no bucket configured")
        return self.cfg.default_bucket, text, ""

    @arity(2)
    def keys(self, conn: Session, args: list[bytes]) -> Reply:
        bucket, glob, shown = self._pattern_target(args[1])
        match = glob_matcher(glob)
        out = [resp.bulk((shown + k).encode(), conn.proto)
               for _, k in self.replica.iter_keys(bucket, live=True) if match(k) and not reserved_key(k)]
        return resp.array(out, conn.proto)

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
        bucket, glob, shown = self._pattern_target(opts.get(b"match", b"*"))
        after = None
        if cursor:
            # Kept, not consumed: a client that lost a reply may send the same cursor again.
            after = self._cursors.resume(cursor, bucket)
            if after is None:
                raise CommandError("ERR invalid cursor")
        match = glob_matcher(glob)
        found: list[bytes] = []
        last = None
        n = 0
        for lkey, key in self.replica.iter_keys(bucket, after=after, limit=count, live=True):
            last = lkey
            n += 1
            if match(key) and not reserved_key(key):  # (a reserved key reads as an error)
                found.append(resp.bulk((shown + key).encode(), conn.proto))
        next_cursor = 0
        if n == count and last is not None:
            next_cursor = self._cursors.save(bucket, last)
        return resp.array([resp.bulk(b"%d" % next_cursor), resp.array(found, conn.proto)], conn.proto)

    @arity(1)
    def dbsize(self, conn: Session, args: list[bytes]) -> Reply:
        b = self.cfg.default_bucket
        return resp.integer(self.replica.count(b) if b else 0)

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

class Found(NamedTuple):
    """What a one-key read found: the value, its creation and own expiry (Record.expires)."""

    value: bytes
    created: int
    expires: int


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


def _values_reply(values: list[bytes | None], proto: int) -> bytes:
    return resp.array([resp.bulk(v, proto) for v in values], proto)


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


def _read_source(entry: Entry | None, source: str) -> str:
    """A remote read's source as the metrics name it: `leader` (its non-direct read), `stale`,
    or `peer` for a Direct Get's answer, a key NATS reports absent, and a replica copy that
    turned out newer (the read went to NATS all the same, as INFO's gets_remote counts it)."""
    if source == STALE_SOURCE:
        return STALE_SOURCE
    return "leader" if entry is not None and entry.source == "leader" else "peer"
