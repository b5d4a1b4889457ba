"""The RESP command set (docs/commands.md): decode arguments, ask the read policy where each
read is answered (kvcache.readpolicy), count and log it, encode the reply.

A handler returns the encoded reply as bytes when it can answer at once (the common case: a
local read), or a coroutine when it must ask NATS; the server keeps replies in request order.
"""
from __future__ import annotations

import functools
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from . import __version__, resp
from .accesslog import AccessLog
from .config import BucketConfig, Config
from .entry import Entry, Operation
from .errors import CommandError, KvcacheError, ReplyBudget, ReplyTooLarge
from .info import Info
from .keys import glob_matcher
from .readpolicy import STALE_SOURCE, ReadPolicy
from .record import Record, live_value
from .replica import RECORD
from .scan import ScanCursors
from .stats import Stats

__all__ = ["CommandError", "Commands", "Session"]

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


class Session(Protocol):
    """What the command layer needs of a client's connection (kvcache.server's
    ClientConnection): its protocol, identity, and the replies it controls."""

    proto: int
    id: int
    name: bytes
    lib_name: bytes
    lib_ver: bytes

    def close_after_reply(self) -> None: ...
    def set_reply_mode(self, mode: bytes) -> bytes: ...
    def client_info(self) -> str: ...


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
        self.info_source = Info(cfg, stats, policy, self.access)
        self._cursors = ScanCursors()
        self._table: dict[bytes, Callable[[Session, list[bytes]], Reply]] = {
            b"get": self.get, b"mget": self.mget, b"exists": self.exists,
            b"kv.get": self.kv_get, b"keys": self.keys, b"scan": self.scan,
            b"dbsize": self.dbsize, b"info": self.info,
            b"ping": self.ping, b"echo": self.echo, b"quit": self.quit, b"hello": self.hello,
            b"client": self.client, b"command": self.command, b"select": self.select,
            b"config": self.config, b"auth": self.auth,
        }

    def dispatch(self, conn: Session, args: list[bytes]) -> Reply:
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

    # ------------------------------------------------------------------ reads

    @arity(2)
    def get(self, conn: Session, args: list[bytes]) -> Reply:
        bc, key = self.policy.resolve(args[1])
        t0 = self._t0()
        if self.policy.local_ok(bc, key):
            rec = self.replica.get(bc.name, key)
            want = self.policy.behind(bc, key, rec)
            if not want:
                return self._local_value(conn, bc, key, rec, t0)
            return self._gated_value(conn, bc, key, want, t0)
        return self._remote_value(conn, bc, key, t0)

    def _local_value(self, conn: Session, bc: BucketConfig, key: str, rec: Record | None,
                     t0: int = 0) -> bytes:
        self.stats.gets_local += 1
        self._log(t0, bc.name, key, "local", rec is not None, "GET")
        if rec is None:
            self.stats.gets_notfound += 1
            return resp.null(conn.proto)
        return resp.bulk(rec.value, conn.proto)

    async def _gated_value(self, conn: Session, bc: BucketConfig, key: str, want: int,
                           t0: int = 0) -> bytes:
        """GET of a key whose newer revision was handed out from NATS (see _local_after)."""
        local, rec = await self.policy.local_after(bc, key, want)
        if local:
            return self._local_value(conn, bc, key, rec, t0)
        return await self._remote_value(conn, bc, key, t0)

    async def _remote_value(self, conn: Session, bc: BucketConfig, key: str, t0: int = 0) -> bytes:
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
            entry = await self.policy.remote(bc, key, strong=strong)
        except KvcacheError as e:
            self.stats.remote_errors += 1
            entry = self.policy.stale_entry(bc, key, e, strong, max_stale_ms)  # or CommandError
            source = STALE_SOURCE
            self.stats.gets_stale += 1
        else:
            entry = self.policy.newest(bc, key, entry)
        hit = entry is not None and entry.operation is Operation.PUT
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
            try:
                found = await self.policy.remote_many(bucket, keys, budget)
            except ReplyTooLarge:
                raise
            except KvcacheError as e:
                self.stats.remote_errors += 1
                # every key from the stale replica, or the command fails (_stale_entry)
                found = {k: self.policy.stale_entry(bc, k, e) for k in keys}
                source = STALE_SOURCE
                self.stats.gets_stale += len(keys)
            for i, key in wanted:
                entry = found[key] if source == STALE_SOURCE else self.policy.newest(bc, key, found.get(key))
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
               for _, k in self.replica.iter_keys(bucket, live=True) if match(k)]
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
            if match(key):
                found.append(resp.bulk((shown + key).encode(), conn.proto))
        next_cursor = 0
        if n == count and last is not None:
            next_cursor = self._cursors.save(bucket, last)
        return resp.array([resp.bulk(b"%d" % next_cursor), resp.array(found, conn.proto)], conn.proto)

    @arity(1)
    def dbsize(self, conn: Session, args: list[bytes]) -> Reply:
        b = self.cfg.default_bucket
        return resp.integer(self.replica.count(b) if b else 0)

    # ------------------------------------------------------------------ connection

    def ping(self, conn: Session, args: list[bytes]) -> Reply:
        if len(args) > 2:
            raise CommandError("ERR wrong number of arguments for 'ping' command")
        return resp.bulk(args[1], conn.proto) if len(args) == 2 else resp.PONG

    @arity(2)
    def echo(self, conn: Session, args: list[bytes]) -> Reply:
        return resp.bulk(args[1], conn.proto)

    def quit(self, conn: Session, args: list[bytes]) -> Reply:
        conn.close_after_reply()
        return resp.OK

    def hello(self, conn: Session, args: list[bytes]) -> Reply:
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
    def auth(self, conn: Session, args: list[bytes]) -> Reply:
        """Redis's answers with no password configured (see WRONGPASS): never an OK that
        pretends a password was checked, never a refusal of the one user that exists."""
        if len(args) > 3:
            raise CommandError("ERR syntax error")
        if len(args) == 2:
            raise CommandError(AUTH_WITHOUT_PASSWORD)
        _authenticate(args[1])
        return resp.OK

    @arity(2, exact=False)
    def client(self, conn: Session, args: list[bytes]) -> Reply:
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

    @arity(2)
    def select(self, conn: Session, args: list[bytes]) -> Reply:
        """Only database 0 exists (CONFIG GET databases says 1); Redis's wording for the rest."""
        if args[1] == b"0":
            return resp.OK
        if not re.fullmatch(rb"-?[1-9][0-9]*", args[1]) or not -(1 << 63) <= int(args[1]) < 1 << 63:
            raise CommandError("ERR value is not an integer or out of range")
        if not -(1 << 31) <= int(args[1]) < 1 << 31:
            raise CommandError("ERR value is out of range, value must between -2147483648 and 2147483647")
        raise CommandError("ERR DB index is out of range")

    @arity(2, exact=False)
    def config(self, conn: Session, args: list[bytes]) -> Reply:
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

    def info(self, conn: Session, args: list[bytes]) -> Reply:
        wanted = {a.decode(errors="replace").lower() for a in args[1:]}
        return resp.verbatim(self.info_text(wanted), conn.proto)

    def info_text(self, wanted: set[str]) -> str:
        return self.info_source.text(wanted)


# ---------------------------------------------------------------------- helpers

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
