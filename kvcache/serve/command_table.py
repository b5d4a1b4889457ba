"""The command surface as data: every command kvcache answers, declared once.

One row per command says which handler runs it, how many arguments it takes (Redis's arity:
`n` exactly, `-n` at least), its flags, where its keys are (first, last, step), its ACL
categories and its COMMAND DOCS entry. Everything that asks about a command reads the row:
the arity check dispatch makes before any handler runs (and MULTI makes when it queues),
COMMAND, COMMAND INFO/COUNT/LIST/DOCS, CLIENT TRACKING's key positions, who may run before
AUTH, and CLIENT LIST's `cmd` (a container's subcommand: `client|list`). So a command is added
or changed here, and nowhere can disagree with COMMAND about it.

The rows are Redis 7's for the commands Redis has (arity, flags, keys, categories, since), so
clients that introspect (redis-py's command(), redis-cli) get real rows. Their order is
COMMAND's reply order.

A handler is named, not referenced (`"session.ping"`: the `ping` method of the part the
command layer calls `session`): the parts are built at run time and import this module, so
the table cannot hold them; kvcache.serve.commands binds every name when it is built, and a
name that binds to nothing fails there, at start.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from .. import resp
from ..errors import CommandError

__all__ = ["BY_NAME", "COMMANDS", "TRACKED", "WRITES", "CommandSpec", "arity_error", "command_reply",
           "key_args"]


@dataclass(frozen=True, slots=True, eq=False)
class CommandSpec:
    """One command. `subcommands`, for a container (CLIENT, CONFIG, COMMAND, PUBSUB, XINFO):
    every subcommand Redis 7.4 has, by lower-case name, with its own arity (`client|getname`:
    2) when kvcache runs it, None when kvcache does not (its handler answers Redis's unknown
    subcommand error; CLIENT LIST's `cmd` still names it, as Redis does). `most`: an upper
    bound on the arguments whose excess is also Redis's arity error (PING takes one message at
    most), 0 for none."""

    name: str
    handler: str  # "<part>.<method>": see the module docstring
    arity: int
    flags: tuple[str, ...]
    keys: tuple[int, int, int]  # first key, last key (-1: the last argument), step; 0s: none
    categories: tuple[str, ...]
    summary: str
    group: str
    since: str | None  # the Redis version that introduced it; None: kvcache's own
    subcommands: Mapping[bytes, int | None] = field(default_factory=lambda: MappingProxyType({}))
    most: int = 0

    @property
    def tracked(self) -> bool:
        """Does CLIENT TRACKING remember this command's keys? As Redis: a read-only command
        that names keys; but not the streams' (`@bucket` names a bucket's stream, never a key
        a change invalidates)."""
        return "readonly" in self.flags and self.keys[0] > 0 and "@stream" not in self.categories


def arity_error(spec: CommandSpec, args: Sequence[bytes]) -> str | None:
    """Redis's error for a wrong number of arguments (the command's, or its subcommand's as
    `client|getname`), None when the count fits."""
    n = len(args)
    want = spec.arity
    if (n != want if want > 0 else n < -want) or (spec.most and n > spec.most):
        return f"ERR wrong number of arguments for '{spec.name}' command"
    if spec.subcommands and n > 1:
        sub = args[1].lower()
        want_sub = spec.subcommands.get(sub)
        if want_sub is not None and ((n != want_sub) if want_sub > 0 else (n < -want_sub)):
            return f"ERR wrong number of arguments for '{spec.name}|{sub.decode()}' command"
    return None


def key_args(spec: CommandSpec, args: list[bytes]) -> list[bytes]:
    """The key names among a command's arguments, by its key positions."""
    first, last, step = spec.keys
    if not first:
        return []
    end = len(args) if last < 0 else min(last + 1, len(args))
    return args[first:end:step]


def _subs(**arities: int | None) -> Mapping[bytes, int | None]:
    return MappingProxyType({name.replace("_", "-").encode(): n for name, n in arities.items()})


# Flag sets several commands share (Redis's)
_CONN = ("noscript", "loading", "stale", "fast", "no_auth", "allow_busy")  # runs before AUTH
_TX = ("noscript", "loading", "stale", "fast", "allow_busy")
_PUBSUB = ("pubsub", "noscript", "loading", "stale")
_READ_FAST = ("readonly", "fast")
_KEY = (1, 1, 1)
_KEYS = (1, -1, 1)
_NONE = (0, 0, 0)


def _c(name: str, handler: str, arity: int, flags: tuple[str, ...], keys: tuple[int, int, int],
       categories: tuple[str, ...], summary: str, group: str, since: str | None, **more) -> CommandSpec:
    return CommandSpec(name, handler, arity, flags, keys, categories, summary, group, since, **more)


COMMANDS: tuple[CommandSpec, ...] = (
    _c("get", "commands.get", 2, _READ_FAST, _KEY, ("@read", "@string", "@fast"),
       "Get the value of a key", "string", "1.0.0"),
    _c("mget", "commands.mget", -2, _READ_FAST, _KEYS, ("@read", "@string", "@fast"),
       "Get the values of all the given keys", "string", "1.0.0"),
    _c("exists", "commands.exists", -2, _READ_FAST, _KEYS, ("@keyspace", "@read", "@fast"),
       "Determine how many of the given keys exist", "generic", "1.0.0"),
    _c("kv.get", "commands.kv_get", -2, ("readonly",), _KEY, ("@read", "@string"),
       "Get a key's value with its revision, creation time, operation and source", "string", None),
    _c("keys", "commands.keys", 2, ("readonly",), _NONE, ("@keyspace", "@read", "@slow", "@dangerous"),
       "Find all keys matching the given pattern", "generic", "1.0.0"),
    _c("scan", "commands.scan", -2, ("readonly",), _NONE, ("@keyspace", "@read", "@slow"),
       "Incrementally iterate the keys space", "generic", "2.8.0"),
    _c("dbsize", "commands.dbsize", 1, _READ_FAST, _NONE, ("@keyspace", "@read", "@fast"),
       "Return the number of keys in the default bucket", "server", "1.0.0"),
    _c("info", "commands.info", -1, ("loading", "stale"), _NONE, ("@slow", "@dangerous"),
       "Get information and statistics about the sidecar", "server", "1.0.0"),
    _c("ping", "session.ping", -1, ("fast",), _NONE, ("@fast", "@connection"),
       "Ping the server", "connection", "1.0.0", most=2),
    _c("echo", "session.echo", 2, ("fast",), _NONE, ("@fast", "@connection"),
       "Echo the given string", "connection", "1.0.0"),
    _c("quit", "session.quit", -1, _CONN, _NONE, ("@fast", "@connection"),
       "Close the connection", "connection", "1.0.0"),
    _c("hello", "session.hello", -1, _CONN, _NONE, ("@fast", "@connection"),
       "Handshake with the server", "connection", "6.0.0"),
    _c("client", "session.client", -2, (), _NONE, ("@slow", "@connection"),
       "A container for client connection commands", "connection", "2.4.0",
       subcommands=_subs(caching=3, getname=2, getredir=2, help=None, id=2, info=2, kill=-3, list=-2,
                         no_evict=3, no_touch=3, pause=None, reply=3, setinfo=4, setname=3, tracking=-3,
                         trackinginfo=2, unblock=None, unpause=None)),
    _c("command", "commands.command", -1, ("loading", "stale"), _NONE, ("@slow", "@connection"),
       "Get array of command details", "server", "2.8.13",
       subcommands=_subs(count=2, docs=-2, getkeys=None, getkeysandflags=None, help=None, info=-2,
                         list=-2)),
    _c("select", "session.select", 2, ("loading", "stale", "fast"), _NONE, ("@fast", "@connection"),
       "Change the selected database (only 0 exists)", "connection", "1.0.0"),
    _c("config", "commands.config", -2, (), _NONE, ("@admin", "@slow", "@dangerous"),
       "Get configuration parameters (CONFIG SET notify-keyspace-events only)", "server", "2.0.0",
       subcommands=_subs(get=-3, help=None, resetstat=None, rewrite=None, set=-4)),
    _c("auth", "session.auth", -2, _CONN, _NONE, ("@fast", "@connection"),
       "Authenticate to the server", "connection", "1.0.0"),
    _c("ttl", "commands.ttl", 2, _READ_FAST, _KEY, ("@keyspace", "@read", "@fast"),
       "Get the time to live for a key in seconds", "generic", "1.0.0"),
    _c("pttl", "commands.pttl", 2, _READ_FAST, _KEY, ("@keyspace", "@read", "@fast"),
       "Get the time to live for a key in milliseconds", "generic", "2.6.0"),
    _c("expiretime", "commands.expiretime", 2, _READ_FAST, _KEY, ("@keyspace", "@read", "@fast"),
       "Get the expiration Unix timestamp for a key", "generic", "7.0.0"),
    _c("pexpiretime", "commands.pexpiretime", 2, _READ_FAST, _KEY, ("@keyspace", "@read", "@fast"),
       "Get the expiration Unix timestamp for a key in milliseconds", "generic", "7.0.0"),
    _c("type", "commands.type", 2, _READ_FAST, _KEY, ("@keyspace", "@read", "@fast"),
       "Determine the type stored at key", "generic", "1.0.0"),
    _c("strlen", "commands.strlen", 2, _READ_FAST, _KEY, ("@read", "@string", "@fast"),
       "Get the length of the value stored in a key", "string", "2.2.0"),
    _c("getrange", "commands.getrange", 4, ("readonly",), _KEY, ("@read", "@string", "@slow"),
       "Get a substring of the string stored at a key", "string", "2.4.0"),
    _c("multi", "session.multi", 1, _TX, _NONE, ("@fast", "@transaction"),
       "Mark the start of a transaction block", "transactions", "1.2.0"),
    _c("exec", "session.exec", 1, ("noscript", "loading", "stale", "skip_slowlog"), _NONE,
       ("@slow", "@transaction"), "Execute all commands issued after MULTI", "transactions", "1.2.0"),
    _c("discard", "session.discard", 1, _TX, _NONE, ("@fast", "@transaction"),
       "Discard all commands issued after MULTI", "transactions", "2.0.0"),
    _c("watch", "session.watch", -2, _TX, _KEYS, ("@fast", "@transaction"),
       "Watch the given keys to determine execution of the MULTI/EXEC block", "transactions", "2.2.0"),
    _c("unwatch", "session.unwatch", 1, _TX, _NONE, ("@fast", "@transaction"),
       "Forget about all watched keys", "transactions", "2.2.0"),
    _c("subscribe", "session.subscribe", -2, _PUBSUB, _NONE, ("@pubsub", "@slow"),
       "Listen for messages published to the given channels", "pubsub", "2.0.0"),
    _c("psubscribe", "session.psubscribe", -2, _PUBSUB, _NONE, ("@pubsub", "@slow"),
       "Listen for messages published to channels matching the given patterns", "pubsub", "2.0.0"),
    _c("unsubscribe", "session.unsubscribe", -1, _PUBSUB, _NONE, ("@pubsub", "@slow"),
       "Stop listening for messages posted to the given channels", "pubsub", "2.0.0"),
    _c("punsubscribe", "session.punsubscribe", -1, _PUBSUB, _NONE, ("@pubsub", "@slow"),
       "Stop listening for messages posted to channels matching the given patterns", "pubsub", "2.0.0"),
    _c("pubsub", "session.pubsub_command", -2, (), _NONE, ("@slow",),
       "A container for Pub/Sub commands", "pubsub", "2.8.0",
       subcommands=_subs(channels=-2, help=None, numpat=2, numsub=-2, shardchannels=None,
                         shardnumsub=None)),
    _c("reset", "session.reset", 1, _CONN, _NONE, ("@fast", "@connection"),
       "Reset the connection", "connection", "6.2.0"),
    _c("xread", "streams.xread", -4, ("readonly", "blocking", "movablekeys"), _NONE,
       ("@read", "@stream", "@slow", "@blocking"),
       "Return new entries of a bucket's stream (@bucket), blocking if asked", "stream", "5.0.0"),
    _c("xrange", "streams.xrange", -4, ("readonly",), _KEY, ("@read", "@stream", "@slow"),
       "Return a range of a bucket's stream (@bucket) by revision", "stream", "5.0.0"),
    _c("xrevrange", "streams.xrevrange", -4, ("readonly",), _KEY, ("@read", "@stream", "@slow"),
       "Return a range of a bucket's stream (@bucket) in reverse", "stream", "5.0.0"),
    _c("xlen", "streams.xlen", 2, _READ_FAST, _KEY, ("@read", "@stream", "@fast"),
       "Return the number of entries of a bucket's stream (@bucket)", "stream", "5.0.0"),
    _c("xinfo", "streams.xinfo", -2, (), _NONE, ("@slow",),
       "A container for stream introspection commands", "stream", "5.0.0",
       subcommands=_subs(consumers=4, groups=3, help=2, stream=-3)),
    _c("xpending", "commands.xpending", -3, ("readonly",), _KEY, ("@read", "@stream", "@slow"),
       "Pending entries of a consumer group (a bucket's stream has none)", "stream", "5.0.0"),
)

BY_NAME: dict[bytes, CommandSpec] = {c.name.encode(): c for c in COMMANDS}
assert len(BY_NAME) == len(COMMANDS), "a command declared twice"
# The commands whose keys CLIENT TRACKING remembers (CommandSpec.tracked)
TRACKED: frozenset[bytes] = frozenset(name for name, c in BY_NAME.items() if c.tracked)
# What an unauthenticated connection may run: Redis's `no_auth` flag
NO_AUTH: frozenset[bytes] = frozenset(name for name, c in BY_NAME.items() if "no_auth" in c.flags)

# Redis's writes, which kvcache refuses with -READONLY (a replica performs none); CLIENT LIST's
# `cmd` names them, as Redis names a command it refused
WRITES = frozenset(b"""
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


# ---------------------------------------------------------------------- COMMAND's replies

def command_reply(args: list[bytes], proto: int) -> bytes:
    """COMMAND, COMMAND COUNT, COMMAND INFO [name ...], COMMAND DOCS [name ...], COMMAND LIST:
    the table as Redis 7 shapes it (the arity of each subcommand was checked already)."""
    if len(args) == 1:
        return resp.array([_info(c, proto) for c in COMMANDS], proto)
    sub = args[1].lower()
    if sub == b"count":
        return resp.integer(len(COMMANDS))
    if sub == b"info":
        named = [BY_NAME.get(a.lower()) for a in args[2:]] if len(args) > 2 else COMMANDS
        return resp.array([_info(c, proto) for c in named], proto)
    if sub == b"docs":
        # Redis leaves out names it does not know, and lists a name asked twice once; no
        # names: every command
        named = [BY_NAME.get(a.lower()) for a in args[2:]] if len(args) > 2 else COMMANDS
        found = {c.name: c for c in named if c is not None}.values()
        return resp.map_([(resp.bulk(c.name.encode(), proto), _docs(c, proto)) for c in found], proto)
    if sub == b"list":
        return resp.array([resp.bulk(c.name.encode(), proto) for c in COMMANDS], proto)
    raise CommandError(f"ERR unknown subcommand '{args[1].decode(errors='replace')[:64]}'. Try COMMAND HELP.")


def _info(c: CommandSpec | None, proto: int) -> bytes:
    """One COMMAND INFO row (Redis 7's ten fields), or the null for a name kvcache lacks."""
    if c is None:
        return resp.null(proto) if proto == 3 else resp.NULL_ARRAY2
    first, last, step = c.keys
    return resp.array([
        resp.bulk(c.name.encode(), proto), resp.integer(c.arity),
        resp.array([resp.simple(f) for f in c.flags], proto),
        resp.integer(first), resp.integer(last), resp.integer(step),
        resp.array([resp.simple(cat) for cat in c.categories], proto),
        resp.EMPTY_ARRAY, resp.EMPTY_ARRAY, resp.EMPTY_ARRAY,  # tips, key specs, subcommands
    ], proto)


def _docs(c: CommandSpec, proto: int) -> bytes:
    fields = [(b"summary", c.summary), (b"group", c.group)] + ([(b"since", c.since)] if c.since else [])
    return resp.map_([(resp.bulk(k, proto), resp.bulk(v.encode(), proto)) for k, v in fields], proto)


def full_name(spec: CommandSpec, args: list[bytes]) -> bytes | None:
    """CLIENT LIST's `cmd`: Redis's full name (`client|list`); None for a subcommand Redis
    does not have (NULL there, as in Redis)."""
    name = spec.name.encode()
    if len(args) == 1:
        return name
    sub = args[1].lower()
    return name + b"|" + sub if sub in spec.subcommands else None


def listed_name(args: list[bytes]) -> bytes | None:
    """CLIENT LIST's `cmd` after `args` ran: the full name of a known command, the name of a
    write kvcache refuses, NULL (None) for anything else; what the command layer sets, and a
    worker for the commands it relays (kvcache.serve.relay)."""
    name = args[0].lower()
    spec = BY_NAME.get(name)
    if spec is None:
        return name if name in WRITES else None
    return full_name(spec, args) if spec.subcommands else name
