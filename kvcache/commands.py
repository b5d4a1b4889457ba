"""The RESP command set (DESIGN.md's table): decode arguments, answer from the replica when it
may, hand the rest to the router, encode the reply.

A handler returns the encoded reply as bytes when it can answer at once (the common case: a
local read), or a coroutine when it must ask NATS; the server keeps replies in request order.
"""
from __future__ import annotations

import functools
import os
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

from . import __version__, native, resp
from .accesslog import AccessLog
from .config import BucketConfig
from .entry import Entry, Operation
from .errors import KvcacheError, ReplyBudget, ReplyTooLarge, UpstreamError
from .record import Record, live_value
from .replica import LONG_KEY_PREFIX, RECORD, lmdb_key

if TYPE_CHECKING:
    from .server import Connection
    from .sidecar import Sidecar

Reply = Union[bytes, Awaitable[bytes]]
# fullmatch, never match(): `$` also matches before a trailing "\n", and a newline in a key
# would end the NATS protocol line of the Direct Get request built from it.
KEY_RE = re.compile(r"[-/_=a-zA-Z0-9]+(?:\.[-/_=a-zA-Z0-9]+)*")
SCAN_CURSORS = 10_000
MINREV_WAIT_S = 0.25
PLAN_CACHE = 100_000
# KV.GET's source for an answer from a replica too stale to be trusted, given because no peer
# could answer and the bucket has serve_stale on (config.py keeps it from naming a peer).
STALE_SOURCE = "stale"

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
    "config": ("Get configuration parameters (CONFIG GET only)", "server", "2.0.0"),
    "auth": ("Authenticate to the server", "connection", "1.0.0"),
}

# CLIENT subcommands kvcache performs -> their exact argument count (Redis's `client|<sub>`
# arity, checked before the subcommand runs, with Redis's wording). TRACKING takes options.
CLIENT_ARITY = {
    b"setname": 3, b"getname": 2, b"setinfo": 4, b"id": 2, b"info": 2, b"reply": 3,
    b"no-evict": 3, b"no-touch": 3, b"caching": 3, b"getredir": 2, b"trackinginfo": 2,
}
TRACKING_UNSUPPORTED = (
    "ERR kvcache does not support CLIENT TRACKING (client-side caching) yet: it sends no "
    "invalidations, so replies must not be cached client-side")
CACHING_WITHOUT_TRACKING = ("ERR CLIENT CACHING can be called only when the client is in "
                            "tracking mode with OPTIN or OPTOUT mode enabled")
# CLIENT TRACKINGINFO with tracking off, as Redis answers it (RESP3: flags is a set)
TRACKINGINFO_OFF = {
    2: b"*6\r\n$5\r\nflags\r\n*1\r\n$3\r\noff\r\n$8\r\nredirect\r\n:-1\r\n"
       b"$8\r\nprefixes\r\n*0\r\n",
    3: b"%3\r\n$5\r\nflags\r\n~1\r\n$3\r\noff\r\n$8\r\nredirect\r\n:-1\r\n"
       b"$8\r\nprefixes\r\n*0\r\n",
}
# kvcache has Redis's `default` user only, without a password: the socket's file mode is its
# access control. These are Redis's answers when no password is configured.
WRONGPASS = "WRONGPASS invalid username-password pair or user is disabled."
AUTH_WITHOUT_PASSWORD = ("ERR AUTH <password> called without any password configured for the "
                         "default user. Are you sure your configuration is correct?")


class CommandError(KvcacheError):
    """Answered to the client as a RESP error; the connection stays usable."""


@dataclass
class Stats:
    gets_local: int = 0
    gets_remote: int = 0
    gets_notfound: int = 0
    remote_errors: int = 0
    gets_stale: int = 0  # answered from a stale replica (serve_stale) after a failed remote read
    commands: int = 0
    connections_received: int = 0
    rejected_connections: int = 0
    protocol_errors: int = 0
    clients_cut_off: int = 0  # read none of their queued replies for client_write_stall_ms
    started: float = field(default_factory=time.time)


def arity(n: int, exact: bool = True):
    """Reject a wrong argument count with Redis's own wording before the handler runs."""
    def wrap(fn):
        @functools.wraps(fn)
        def checked(self, conn, args):
            if (len(args) != n) if exact else (len(args) < n):
                raise CommandError(f"ERR wrong number of arguments for '{args[0].decode(errors='replace').lower()}' command")
            return fn(self, conn, args)
        return checked
    return wrap


class Commands:
    def __init__(self, sidecar: Sidecar) -> None:
        self.sc = sidecar
        self.cfg = sidecar.cfg
        self.replica = sidecar.replica
        self.stats = sidecar.stats
        self._cursors: OrderedDict[int, tuple[str, bytes]] = OrderedDict()
        self.access = AccessLog.from_config(self.cfg)
        # Raw key -> how to read it locally (see _plan), for MGET/EXISTS; the server's GET
        # path plans through local_plan and caches its own.
        self._plans: dict[bytes, tuple | bool] = {}
        self._next_cursor = 1
        self._table: dict[bytes, Callable[[Connection, list[bytes]], Reply]] = {
            b"get": self.get, b"mget": self.mget, b"exists": self.exists,
            b"kv.get": self.kv_get, b"keys": self.keys, b"scan": self.scan,
            b"dbsize": self.dbsize, b"info": self.info,
            b"ping": self.ping, b"echo": self.echo, b"quit": self.quit, b"hello": self.hello,
            b"client": self.client, b"command": self.command, b"select": self.select,
            b"config": self.config, b"auth": self.auth,
        }

    def dispatch(self, conn: Connection, args: list[bytes]) -> Reply:
        self.stats.commands += 1
        name = args[0].lower()
        handler = self._table.get(name)
        try:
            if handler is not None:
                return handler(conn, args)
            if name in WRITE_COMMANDS:
                return READONLY
            shown = " ".join(f"'{a.decode(errors='replace')[:64]}'" for a in args[1:4])
            return resp.error(f"ERR unknown command '{args[0].decode(errors='replace')[:64]}', "
                              f"with args beginning with: {shown}")
        except (CommandError, ReplyTooLarge) as e:
            return resp.error(str(e))

    # ------------------------------------------------------------------ addressing

    def resolve(self, raw: bytes) -> tuple[BucketConfig, str]:
        """`bucket:key` names the bucket; a bare key reads the default (first) bucket."""
        try:
            text = raw.decode()
        except UnicodeDecodeError:
            raise CommandError("ERR invalid key: not UTF-8") from None
        bucket, sep, key = text.partition(":")
        if not sep:
            bucket, key = self.cfg.default_bucket or "", text
        bc = self.cfg.bucket(bucket)
        if bc is None:
            # It may well exist in NATS: what is missing is this sidecar's configuration.
            if not sep and not bucket:
                raise CommandError("ERR no default bucket: this sidecar replicates no bucket; "
                                   "start it with --bucket NAME or a [[bucket]] entry")
            names = ", ".join(b.name for b in self.cfg.buckets[:8]) + (
                ", ..." if len(self.cfg.buckets) > 8 else "")
            raise CommandError(
                f"ERR no such bucket '{bucket[:64]}' in this sidecar (it replicates: {names or 'none'}); "
                f"to read it, add --bucket {bucket[:64] or 'NAME'} or a [[bucket]] entry and restart")
        if not KEY_RE.fullmatch(key):
            raise CommandError(f"ERR invalid key '{key[:64]}': KV keys use A-Z a-z 0-9 - / _ = and dots between tokens")
        return bc, key

    def local_plan(self, raw: bytes) -> tuple | bool:
        """For the server's GET fast path: `(feed, max_stale_ms, db, lmdb key, value offset or
        None)` when `raw` names a valid key inside its bucket's filters, cached; False when the
        key is invalid or remote (the generic path answers it: error or fallback read).
        Freshness is not part of the plan: the caller checks it (once per batch).
        Always False while the access log is on, so that GETs reach `get` and are logged."""
        if self.access.enabled:
            return False
        return self._plan(raw)

    def _plan(self, raw: bytes) -> tuple | bool:
        try:
            bc, key = self.resolve(raw)
        except CommandError:
            return False
        if not self.sc.in_filters(bc.name, key):
            plan: tuple | bool = False
        else:
            lkey = lmdb_key(key)
            plan = (self.sc.feeds[bc.name], bc.max_stale_ms, self.replica.db(bc.name), lkey,
                    None if lkey.startswith(LONG_KEY_PREFIX) else RECORD.size)
        if len(self._plans) >= PLAN_CACHE:
            self._plans.clear()
        self._plans[raw] = plan
        return plan

    def local_ok(self, bc: BucketConfig, key: str, max_stale_ms: int | None = None) -> bool:
        """Is the key replicated, and the replica fresh within the bound? Whether its record
        may answer without going back in time is asked apart (_behind)."""
        feed = self.sc.feeds[bc.name]
        return self.sc.in_filters(bc.name, key) and feed.fresh_within(
            bc.max_stale_ms if max_stale_ms is None else max_stale_ms)

    def _behind(self, bc: BucketConfig, key: str, rec: Record | None) -> int:
        """0 when the replica's record (None: it has none) may answer the key; else the
        stream sequence it must reach first (a newer revision was handed out from NATS)."""
        return self.sc.feeds[bc.name].behind(key, None if rec is None else rec.revision)

    async def _local_after(self, bc: BucketConfig, key: str, want: int,
                           max_stale_ms: int | None = None) -> tuple[bool, Record | None]:
        """A read the replica could not answer without going back in time: wait (up to
        MINREV_WAIT_S) for it to reach stream sequence `want`, as MINREV does. Then
        (True, the key's record or None) if the replica may answer it now; else (False,
        None), and the caller reads NATS (the router's floors keep that answer at or above
        what was handed out)."""
        if await self.sc.feeds[bc.name].wait_applied(want, MINREV_WAIT_S):
            return self._local_now(bc, key, max_stale_ms)
        return False, None

    def _local_now(self, bc: BucketConfig, key: str,
                   max_stale_ms: int | None = None) -> tuple[bool, Record | None]:
        """(True, the key's record or None) when the replica may answer the key now: fresh
        within the bound and not behind a revision handed out from NATS; else (False, None)."""
        if self.local_ok(bc, key, max_stale_ms):
            rec = self.replica.get(bc.name, key)
            if not self._behind(bc, key, rec):
                return True, rec
        return False, None

    # ------------------------------------------------------------------ reads

    @arity(2)
    def get(self, conn: Connection, args: list[bytes]) -> Reply:
        bc, key = self.resolve(args[1])
        t0 = self._t0()
        if self.local_ok(bc, key):
            rec = self.replica.get(bc.name, key)
            want = self._behind(bc, key, rec)
            if not want:
                return self._local_value(conn, bc, key, rec, t0)
            return self._gated_value(conn, bc, key, want, t0)
        return self._remote_value(conn, bc, key, t0)

    def _local_value(self, conn: Connection, bc: BucketConfig, key: str, rec: Record | None,
                     t0: int = 0) -> bytes:
        self.stats.gets_local += 1
        self._log(t0, bc.name, key, "local", rec is not None, "GET")
        if rec is None:
            self.stats.gets_notfound += 1
            return resp.null(conn.proto)
        return resp.bulk(rec.value, conn.proto)

    async def _gated_value(self, conn: Connection, bc: BucketConfig, key: str, want: int,
                           t0: int = 0) -> bytes:
        """GET of a key whose newer revision was handed out from NATS (see _local_after)."""
        local, rec = await self._local_after(bc, key, want)
        if local:
            return self._local_value(conn, bc, key, rec, t0)
        return await self._remote_value(conn, bc, key, t0)

    async def _remote_value(self, conn: Connection, bc: BucketConfig, key: str, t0: int = 0) -> bytes:
        entry = await self.remote_entry(bc, key, t0=t0, command="GET")
        return resp.bulk(entry.value if entry else None, conn.proto)

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
            entry = await self.sc.router.get(bc.name, key, strong=strong)
        except KvcacheError as e:
            self.stats.remote_errors += 1
            entry = self._stale_entry(bc, key, e, strong, max_stale_ms)  # or CommandError
            source = STALE_SOURCE
            self.stats.gets_stale += 1
        else:
            entry = self._newest(bc, key, entry)
        hit = entry is not None and entry.operation is Operation.PUT
        self._log(t0, bc.name, key, entry.source if entry else source, hit, command)
        if not hit:
            self.stats.gets_notfound += 1
            return None
        return entry

    def _stale_entry(self, bc: BucketConfig, key: str, err: KvcacheError, strong: bool = False,
                     max_stale_ms: int | None = None) -> Entry | None:
        """A fallback read failed. If it was one the replica passed on for staleness (a key of
        the replicated set, neither CONSISTENCY strong nor MINREV) and no peer could answer
        (UpstreamError), the bucket's serve_stale decides: the replica's last known value
        (source STALE_SOURCE; None for a key it knows to be absent), or a RESP error saying why
        neither answered. Even with serve_stale, the replica does not answer what it cannot
        know (a key it lacks while it is not synced) or what would take a key's reads back in
        time (a newer revision was already read from a peer): those stay errors."""
        if strong or not isinstance(err, UpstreamError) or not self.sc.in_filters(bc.name, key):
            raise CommandError(f"ERR upstream read failed: {err}")
        feed = self.sc.feeds[bc.name]
        bound = bc.max_stale_ms if max_stale_ms is None else max_stale_ms
        if not feed.synced:
            why = "replica not synced"
        elif feed.fresh_within(bound):  # the key was gated (Feed.behind), the replica is fresh
            why = "replica behind a revision of the key already read from NATS"
        else:
            why = f"replica stale ({feed.lag_ms() / 1000:.1f}s behind, max_stale_ms {bound})"
        message = f"ERR bucket {bc.name}: {why} and no peer could answer: {err}"
        if not self.cfg.serves_stale(bc):
            raise CommandError(message)
        rec = self.replica.get(bc.name, key)
        entry = None if rec is None else Entry(bc.name, key, rec.value, rec.revision, rec.created,
                                               0, Operation.PUT, STALE_SOURCE)
        if entry is None and not feed.synced:
            raise CommandError(f"{message}; not serving stale: the key may exist, the replica "
                               "has not finished its sync")
        if self.sc.router.floors.behind(bc.name, key, entry) or feed.behind(
                key, None if entry is None else entry.revision):
            raise CommandError(f"{message}; not serving stale: a newer revision of the key "
                               "was already read from a peer")
        return entry

    def _newest(self, bc: BucketConfig, key: str, remote: Entry | None) -> Entry | None:
        """The answer to hand out for a key read from NATS. Higher revision wins. A remote
        not-found carries no revision, and a lagging responder may not have the key yet, so it
        never overrides a record the replica holds; a deletion overrides it through its
        DEL/PURGE marker's higher revision. A remote revision the synced replica has reached
        (at or below its applied sequence) is no newer than what the replica knows, so the
        replica's answer wins, absent included: the key was deleted since, and a lagging
        peer's PUT must not bring it back after a local read showed it gone. A remote answer
        above that is noted (Feed.handed_out): local reads must not go below it."""
        if not self.sc.in_filters(bc.name, key):
            return remote
        rec = self.replica.get(bc.name, key)
        if rec is not None and (remote is None or remote.revision < rec.revision):
            return Entry(bc.name, key, rec.value, rec.revision, rec.created, 0, Operation.PUT, "local")
        if remote is None:
            return None
        feed = self.sc.feeds[bc.name]
        if feed.synced and remote.revision <= feed.meta.applied_seq:
            return remote if rec is not None else None  # with a record: the same revision
        feed.handed_out(key, remote.revision)
        return remote

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
        plans = self._plans
        txn = None
        local = notfound = 0
        try:
            for i, raw in enumerate(raw_keys):
                plan = plans.get(raw)
                if plan is None:
                    plan = self._plan(raw)
                if not plan or not plan[0].fresh_within(plan[1]):
                    bc, key = self.resolve(raw)  # raises for an invalid key
                    misses.setdefault(bc.name, []).append((i, key))
                    continue
                _, _, db, lkey, offset = plan
                if txn is None:
                    txn = self.replica.env.begin()
                rec = txn.get(lkey, None, db)
                if plan[0].floor_seq and self._gate(i, raw, plan[0], rec, gated):
                    continue
                if rec is not None and (rec[19] >= 0x80 or plan[0].max_age_ns):
                    rec, offset = live_value(rec, time.time_ns(), plan[0].max_age_ns), 0
                local += 1
                if t0 and self.access.sampled():  # resolved again only when sampled
                    bc, key = self.resolve(raw)
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

    def _gate(self, i: int, raw: bytes, feed, rec: bytes | None,
              gated: dict[str, list[tuple[int, str, int]]]) -> bool:
        """_lookup's per-key question while some key is gated (Feed.behind): may the replica
        answer `raw` (its raw record `rec`) without going back? If not, it joins `gated`."""
        bc, key = self.resolve(raw)
        live = rec is not None and not self.replica.expired(bc.name, rec)
        want = feed.behind(key, RECORD.unpack_from(rec)[0] if live else None)
        if want:
            gated.setdefault(bc.name, []).append((i, key, want))
        return bool(want)

    async def _gated_many(self, values: list[bytes | None], misses: dict[str, list[tuple[int, str]]],
                          gated: dict[str, list[tuple[int, str, int]]], budget: ReplyBudget | None,
                          t0: int = 0, command: str = "MGET") -> None:
        """MGET/EXISTS keys the replica could not answer without going back (see _gate):
        wait once per bucket (up to MINREV_WAIT_S) for the replica to reach them, answer
        those it may answer then, and leave the others in `misses`, for NATS."""
        for bucket, items in gated.items():
            bc = self.cfg.bucket(bucket)
            await self.sc.feeds[bucket].wait_applied(max(w for _, _, w in items), MINREV_WAIT_S)
            local = 0
            answered: set[int] = set()
            for i, key, _ in items:
                ok, rec = self._local_now(bc, key)
                if not ok:
                    continue
                answered.add(i)
                local += 1
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
    def mget(self, conn: Connection, args: list[bytes]) -> Reply:
        t0 = self._t0()
        budget = ReplyBudget(self.cfg.max_reply_bytes)
        values, misses, gated = self._lookup(args[1:], t0, "MGET", budget)
        if not misses:
            return _values_reply(values, conn.proto)
        return self._remote_many(values, misses, lambda: _values_reply(values, conn.proto), t0, "MGET",
                                 budget, gated)

    @arity(2, exact=False)
    def exists(self, conn: Connection, args: list[bytes]) -> Reply:
        t0 = self._t0()
        values, misses, gated = self._lookup(args[1:], t0, "EXISTS")
        count = lambda: resp.integer(sum(v is not None for v in values))
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
            keys = list(dict.fromkeys(k for _, k in wanted))
            self.stats.gets_remote += len(keys)
            source = "remote"
            try:
                found = await self.sc.router.get_many(bucket, keys, budget)
            except ReplyTooLarge:
                raise
            except KvcacheError as e:
                self.stats.remote_errors += 1
                # every key from the stale replica, or the command fails (_stale_entry)
                found = {k: self._stale_entry(bc, k, e) for k in keys}
                source = STALE_SOURCE
                self.stats.gets_stale += len(keys)
            for i, key in wanted:
                entry = found[key] if source == STALE_SOURCE else self._newest(bc, key, found.get(key))
                self._log(t0, bucket, key, entry.source if entry else source,
                          entry is not None and entry.operation is Operation.PUT, command)
                if entry is None or entry.operation is not Operation.PUT:
                    self.stats.gets_notfound += 1
                else:
                    if source == STALE_SOURCE and budget is not None and entry.value:
                        budget.spend(len(entry.value))  # peers charged what they answered
                    values[i] = entry.value
        return reply()

    @arity(2, exact=False)
    def kv_get(self, conn: Connection, args: list[bytes]) -> Reply:
        bc, key = self.resolve(args[1])
        opts = _options(args[2:], {b"consistency": str, b"maxstale": int, b"minrev": int})
        consistency = opts.get(b"consistency", "local").lower()
        if consistency not in ("local", "strong"):
            raise CommandError("ERR CONSISTENCY must be local or strong")
        max_stale = opts.get(b"maxstale")
        min_rev = opts.get(b"minrev")
        t0 = self._t0()
        if consistency == "local" and min_rev is None and self.local_ok(bc, key, max_stale):
            rec = self.replica.get(bc.name, key)
            want = self._behind(bc, key, rec)
            if not want:
                return self._local_entry(conn, bc, key, rec, t0)
            return self._gated_entry(conn, bc, key, want, max_stale, t0)
        return self._kv_get_remote(conn, bc, key, consistency == "strong", max_stale, min_rev, t0)

    async def _gated_entry(self, conn: Connection, bc: BucketConfig, key: str, want: int,
                           max_stale: int | None, t0: int = 0) -> bytes:
        """KV.GET of a key whose newer revision was handed out from NATS (see _local_after)."""
        local, rec = await self._local_after(bc, key, want, max_stale)
        if local:
            return self._local_entry(conn, bc, key, rec, t0)
        return await self._kv_get_remote(conn, bc, key, False, max_stale, None, t0)

    def _local_entry(self, conn: Connection, bc: BucketConfig, key: str, rec: Record | None,
                     t0: int = 0) -> bytes:
        self.stats.gets_local += 1
        self._log(t0, bc.name, key, "local", rec is not None, "KV.GET")
        if rec is None:
            self.stats.gets_notfound += 1
            return resp.null(conn.proto)
        return _entry_reply(Entry(bc.name, key, rec.value, rec.revision, rec.created), conn.proto)

    async def _kv_get_remote(self, conn: Connection, bc: BucketConfig, key: str, strong: bool,
                             max_stale: int | None, min_rev: int | None, t0: int = 0) -> bytes:
        if min_rev is not None and not strong:
            # A replicated key is served locally once the replica reaches the revision; any
            # other goes to the leader at once instead of waiting for sequences never applied.
            if self.sc.in_filters(bc.name, key):
                local, rec = await self._local_after(bc, key, min_rev, max_stale)
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
    def keys(self, conn: Connection, args: list[bytes]) -> Reply:
        bucket, glob, shown = self._pattern_target(args[1])
        match = glob_matcher(glob)
        out = [resp.bulk((shown + k).encode(), conn.proto)
               for _, k in self.replica.iter_keys(bucket, live=True) if match(k)]
        return resp.array(out, conn.proto)

    @arity(2, exact=False)
    def scan(self, conn: Connection, args: list[bytes]) -> Reply:
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
            saved = self._cursors.get(cursor)
            if saved is None or saved[0] != bucket:
                raise CommandError("ERR invalid cursor")
            self._cursors.move_to_end(cursor)
            after = saved[1]
        match = glob_matcher(glob)
        found: list[bytes] = []
        last = None
        n = 0
        for lkey, key in self.replica.iter_keys(bucket, after=after, limit=count, live=True):
            last = lkey
            n += 1
            if match(key):
                found.append(resp.bulk((shown + key).encode(), conn.proto))
        next_cursor = 0
        if n == count and last is not None:
            next_cursor = self._save_cursor(bucket, last)
        return resp.array([resp.bulk(b"%d" % next_cursor), resp.array(found, conn.proto)], conn.proto)

    def _save_cursor(self, bucket: str, last: bytes) -> int:
        cursor = self._next_cursor
        self._next_cursor += 1
        self._cursors[cursor] = (bucket, last)
        while len(self._cursors) > SCAN_CURSORS:
            self._cursors.popitem(last=False)
        return cursor

    @arity(1)
    def dbsize(self, conn: Connection, args: list[bytes]) -> Reply:
        b = self.cfg.default_bucket
        return resp.integer(self.replica.count(b) if b else 0)

    # ------------------------------------------------------------------ connection

    def ping(self, conn: Connection, args: list[bytes]) -> Reply:
        if len(args) > 2:
            raise CommandError("ERR wrong number of arguments for 'ping' command")
        return resp.bulk(args[1], conn.proto) if len(args) == 2 else resp.PONG

    @arity(2)
    def echo(self, conn: Connection, args: list[bytes]) -> Reply:
        return resp.bulk(args[1], conn.proto)

    def quit(self, conn: Connection, args: list[bytes]) -> Reply:
        conn.close_after_reply()
        return resp.OK

    def hello(self, conn: Connection, args: list[bytes]) -> Reply:
        """Redis's order: every option is parsed, then AUTH checked, then SETNAME validated,
        and only then anything applied, so a failed HELLO changes nothing."""
        proto = conn.proto
        i = 1
        if len(args) > 1:
            try:
                proto = int(args[1])
            except ValueError:
                raise CommandError("ERR Protocol version is not an integer or out of range") from None
            if proto not in (2, 3):
                raise CommandError("NOPROTO unsupported protocol version")
            i = 2
        name = user = None
        while i < len(args):
            opt = args[i].lower()
            if opt == b"auth" and i + 2 < len(args):
                user = args[i + 1]
                i += 3
            elif opt == b"setname" and i + 1 < len(args):
                name = args[i + 1]
                i += 2
            else:
                raise CommandError(f"ERR Syntax error in HELLO option '{args[i].decode(errors='replace')}'")
        if user is not None:
            _authenticate(user)
        if name is not None:
            conn.name = _client_attr(name, "Client names")
        conn.proto = proto
        info = [
            (b"server", resp.bulk(b"kvcache")), (b"version", resp.bulk(__version__.encode())),
            (b"proto", resp.integer(proto)), (b"id", resp.integer(conn.id)),
            (b"mode", resp.bulk(b"standalone")), (b"role", resp.bulk(b"replica")),
            (b"modules", resp.array([], proto)),
        ]
        return resp.map_([(resp.bulk(k), v) for k, v in info], proto)

    @arity(2, exact=False)
    def auth(self, conn: Connection, args: list[bytes]) -> Reply:
        """Redis's answers with no password configured (see WRONGPASS): never an OK that
        pretends a password was checked, never a refusal of the one user that exists."""
        if len(args) > 3:
            raise CommandError("ERR syntax error")
        if len(args) == 2:
            raise CommandError(AUTH_WITHOUT_PASSWORD)
        _authenticate(args[1])
        return resp.OK

    @arity(2, exact=False)
    def client(self, conn: Connection, args: list[bytes]) -> Reply:
        """The subcommands kvcache performs, as Redis does them; everything about
        client-side caching says tracking is off, and turning it on is refused."""
        sub = args[1].lower()
        want = CLIENT_ARITY.get(sub)
        if (want is not None and len(args) != want) or (sub == b"tracking" and len(args) < 3):
            raise CommandError(f"ERR wrong number of arguments for 'client|{sub.decode(errors='replace')}' command")
        if sub == b"getname":
            return resp.bulk(conn.name or None, conn.proto)
        if sub == b"setname":
            conn.name = _client_attr(args[2], "Client names")
            return resp.OK
        if sub == b"setinfo":
            attr = args[2].lower()
            if attr not in (b"lib-name", b"lib-ver"):
                raise CommandError(f"ERR Unrecognized option '{args[2].decode(errors='replace')}'")
            value = _client_attr(args[3], args[2].decode(errors="replace"))
            if attr == b"lib-name":
                conn.lib_name = value
            else:
                conn.lib_ver = value
            return resp.OK
        if sub == b"id":
            return resp.integer(conn.id)
        if sub == b"info":
            return resp.verbatim(conn.client_info(), conn.proto)
        if sub == b"reply":
            mode = args[2].lower()
            if mode not in (b"on", b"off", b"skip"):
                raise CommandError("ERR syntax error")
            return conn.set_reply_mode(mode)
        if sub in (b"no-evict", b"no-touch"):
            # kvcache evicts no client for memory and keeps no LRU/LFU: both are true either way
            if args[2].lower() not in (b"on", b"off"):
                raise CommandError("ERR syntax error")
            return resp.OK
        if sub == b"tracking":
            switch = args[2].lower()
            if switch not in (b"on", b"off"):
                raise CommandError("ERR syntax error")
            if switch == b"off" and len(args) == 3:
                return resp.OK  # tracking is off, and stays off
            raise CommandError(TRACKING_UNSUPPORTED)
        if sub == b"caching":
            raise CommandError(CACHING_WITHOUT_TRACKING)
        if sub == b"getredir":
            return resp.integer(-1)
        if sub == b"trackinginfo":
            return TRACKINGINFO_OFF[conn.proto]
        raise CommandError(f"ERR unknown subcommand '{args[1].decode(errors='replace')[:64]}'. Try CLIENT HELP.")

    def command(self, conn: Connection, args: list[bytes]) -> Reply:
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

    @arity(2)
    def select(self, conn: Connection, args: list[bytes]) -> Reply:
        """Only database 0 exists (CONFIG GET databases says 1); Redis's wording for the rest."""
        if args[1] == b"0":
            return resp.OK
        if not re.fullmatch(rb"-?[1-9][0-9]*", args[1]) or not -(1 << 63) <= int(args[1]) < 1 << 63:
            raise CommandError("ERR value is not an integer or out of range")
        if not -(1 << 31) <= int(args[1]) < 1 << 31:
            raise CommandError("ERR value is out of range, value must between -2147483648 and 2147483647")
        raise CommandError("ERR DB index is out of range")

    @arity(2, exact=False)
    def config(self, conn: Connection, args: list[bytes]) -> Reply:
        if args[1].lower() != b"get":
            raise CommandError("ERR kvcache supports CONFIG GET only")
        if len(args) < 3:
            raise CommandError("ERR wrong number of arguments for 'config|get' command")
        settings = {
            "save": "", "appendonly": "no", "databases": "1",
            "maxclients": str(self.cfg.max_clients),
            "proto-max-bulk-len": str(self.cfg.max_request_bytes),
        }
        found: dict[str, str] = {}  # a setting matched by several patterns is listed once
        for pattern in args[2:]:
            match = glob_matcher(pattern.decode(errors="replace").lower())
            found.update((k, v) for k, v in settings.items() if match(k))
        return resp.map_([(resp.bulk(k.encode()), resp.bulk(v.encode())) for k, v in found.items()],
                         conn.proto)

    # ------------------------------------------------------------------ INFO

    def info(self, conn: Connection, args: list[bytes]) -> Reply:
        wanted = {a.decode(errors="replace").lower() for a in args[1:]}
        return resp.verbatim(self.info_text(wanted), conn.proto)

    def info_text(self, wanted: set[str]) -> str:
        sc, st = self.sc, self.stats
        sections = {
            "server": [
                ("kvcache_version", __version__), ("redis_version", "7.2.0"),
                ("process_id", os.getpid()), ("uptime_in_seconds", int(time.time() - st.started)),
                ("socket", self.cfg.socket_path), ("nats_url", sc.nats_url),
                ("embedded_nats", int(sc.use_embedded)),
                ("native", ",".join(f"{k}={v.split()[0]}" for k, v in native.report().items())),
                ("default_bucket", self.cfg.default_bucket or ""),
            ],
            "clients": [
                ("connected_clients", sc.server.client_count if sc.server else 0),
                ("maxclients", self.cfg.max_clients),
                ("rejected_connections", st.rejected_connections),
                ("clients_cut_off", st.clients_cut_off),
            ],
            "stats": [
                ("gets_local", st.gets_local), ("gets_remote", st.gets_remote),
                ("gets_notfound", st.gets_notfound), ("remote_errors", st.remote_errors),
                ("gets_stale", st.gets_stale),
                ("total_commands_processed", st.commands),
                ("total_connections_received", st.connections_received),
                ("protocol_errors", st.protocol_errors),
                ("access_log_records", self.access.records),
            ],
            "buckets": [(name, _fields(
                synced=int(f.synced), keys=self.replica.count(name), applied_seq=f.meta.applied_seq,
                upstream_seq=max(f.upstream_seq, f.meta.applied_seq), lag_ms=f.lag_ms(),
                resyncs=f.meta.resyncs, removed_upstream=f.removed_upstream,
                state_polls=f.state_polls)) for name, f in sc.feeds.items()],
            "peers": [(p.label, _fields(
                stream=p.stream, state=p.state, ewma_us=int(p.stats.ewma_us),
                requests=p.stats.requests, errors=p.stats.errors, hedges=p.stats.hedges))
                for p in sc.router.peers()],
            "routing": sc.router.info_rows(),
        }
        default = {"server", "clients", "stats", "buckets", "peers"}
        show = default if not wanted or "default" in wanted else wanted
        if wanted & {"all", "everything"}:
            show = set(sections)
        lines: list[str] = []
        for name, items in sections.items():
            if name not in show:
                continue
            lines.append(f"# {name.capitalize()}")
            lines += [f"{k}:{v}" for k, v in items]
            lines.append("")
        return "\r\n".join(lines)


# ---------------------------------------------------------------------- helpers

def _fields(**kv: object) -> str:
    return ",".join(f"{k}={v}" for k, v in kv.items())


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


def _authenticate(user: bytes) -> None:
    """Redis's `default` user without a password accepts any password; no other user exists."""
    if user != b"default":
        raise CommandError(WRONGPASS)


def _client_attr(value: bytes, what: str) -> bytes:
    """A client name or library name/version: printable ASCII without spaces, as Redis
    requires (CLIENT INFO's `k=v` fields split on spaces)."""
    if any(c < 0x21 or c > 0x7e for c in value):
        raise CommandError(f"ERR {what} cannot contain spaces, newlines or special characters.")
    return value


def _options(args: list[bytes], spec: dict[bytes, type]) -> dict[bytes, object]:
    """`NAME value` pairs, case-insensitive names, typed values; anything else is a syntax error."""
    out: dict[bytes, object] = {}
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
                out[name] = int(raw)
            except ValueError:
                raise CommandError("ERR value is not an integer or out of range") from None
            if out[name] < 0:
                raise CommandError("ERR value is out of range, must be positive")
        elif t is str:
            out[name] = raw.decode(errors="replace")
        else:
            out[name] = raw
    return out


@functools.lru_cache(maxsize=256)
def glob_matcher(pattern: str) -> Callable[[str], bool]:
    """Redis glob: * ? [abc] [^a] [a-z] and backslash escapes."""
    if pattern == "*":
        return lambda _: True
    out, i, n = [], 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "*":
            out.append(".*")
        elif c == "?":
            out.append(".")
        elif c == "\\" and i + 1 < n:
            i += 1
            out.append(re.escape(pattern[i]))
        elif c == "[":
            j = pattern.find("]", i + 2 if i + 1 < n and pattern[i + 1] in "^!" else i + 1)
            if j < 0:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1 : j]
                neg = body[:1] in ("^", "!")
                if neg:
                    body = body[1:]
                body = body.replace("\\", "\\\\").replace("]", "\\]")
                out.append(f"[{'^' if neg else ''}{body}]")
                i = j
        else:
            out.append(re.escape(c))
        i += 1
    rx = re.compile("".join(out), re.DOTALL)
    return lambda s: rx.fullmatch(s) is not None
