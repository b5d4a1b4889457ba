"""The commands about a connection rather than the data: its protocol and identity (HELLO,
AUTH, CLIENT, SELECT, PING, ECHO, QUIT, RESET), client-side caching's CLIENT TRACKING family
(kvcache.serve.tracking), pub/sub (kvcache.serve.pubsub) and transactions
(kvcache.serve.multi). Each answers as Redis does, byte for byte where clients look.

Authentication: with a password set (`requirepass_file` or KVCACHE_REQUIREPASS), TCP clients
must AUTH (or HELLO ... AUTH) before anything but AUTH, HELLO, QUIT and RESET, which get
`-NOAUTH`; the Unix socket keeps its file-mode guard and needs none. With no password, Redis's
answers for the `default` user without one.
"""
from __future__ import annotations

import hmac
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING

from .. import __version__, resp
from ..config import Config
from ..errors import CommandError
from .arguments import I32_MAX, I32_MIN, integer
from .info import REDIS_VERSION
from .multi import Transactions
from .pubsub import PubSub
from .tracking import Tracking, caching, getredir, parse_tracking, tracking_info

if TYPE_CHECKING:
    from .session import Session as ClientConnection

Reply = bytes | Awaitable[bytes]

# CLIENT LIST TYPE / CLIENT KILL TYPE: Redis's names. kvcache has no master or replica
# connections: those types are accepted and match none.
CLIENT_TYPES = {"normal": "normal", "pubsub": "pubsub", "master": "master", "slave": "slave",
                "replica": "slave"}
WRONGPASS = "WRONGPASS invalid username-password pair or user is disabled."
AUTH_WITHOUT_PASSWORD = ("ERR AUTH <password> called without any password configured for the "
                         "default user. Are you sure your configuration is correct?")
NOAUTH = resp.error("NOAUTH Authentication required.")
HELLO_NOAUTH = ("NOAUTH HELLO must be called with the client already authenticated, otherwise the "
                "HELLO <proto> AUTH <user> <pass> option can be used to authenticate the client and "
                "select the RESP protocol version at the same time")
RESET = b"+RESET\r\n"


class SessionCommands:
    """Connection, tracking, pub/sub and transaction commands; `run` is the command table's
    dispatch (EXEC runs the queue through it). Their argument counts are checked before they
    run, from kvcache.serve.command_table (a container's subcommands too: `client|getname`)."""

    def __init__(self, cfg: Config, tracking: Tracking, pubsub: PubSub, transactions: Transactions,
                 run: Callable[[ClientConnection, list[bytes]], Reply],
                 clients: Callable[[], Iterable[ClientConnection]] = lambda: ()) -> None:
        self.cfg = cfg
        self.tracking = tracking
        self.pubsub = pubsub
        self.transactions = transactions
        self.run = run
        self.password = cfg.requirepass
        # Every open connection, oldest first (CLIENT LIST, CLIENT KILL): the server's registry
        self.clients = clients
        # workers > 1: asks every worker what it saw of its clients last (their idle time and
        # last command), before CLIENT LIST and CLIENT INFO (kvcache.serve.links)
        self.seen_in_workers: Callable[[], Awaitable[None]] | None = None

    # ------------------------------------------------------------------ basics

    def ping(self, conn: ClientConnection, args: list[bytes]) -> Reply:
        if conn.proto == 2 and conn.subscribed:  # Redis's answer in RESP2 subscribed mode
            return resp.array([resp.bulk(b"pong"), resp.bulk(args[1] if len(args) == 2 else b"")])
        return resp.bulk(args[1], conn.proto) if len(args) == 2 else resp.PONG

    def echo(self, conn: ClientConnection, args: list[bytes]) -> Reply:
        return resp.bulk(args[1], conn.proto)

    def quit(self, conn: ClientConnection, args: list[bytes]) -> Reply:
        conn.close_after_reply()
        return resp.OK

    def select(self, conn: ClientConnection, args: list[bytes]) -> Reply:
        """Only database 0 exists (CONFIG GET databases says 1); Redis's wording for the rest."""
        index = integer(args[1], lo=I32_MIN, hi=I32_MAX, range_error=(
            f"ERR value is out of range, value must between {I32_MIN} and {I32_MAX}"))
        if index == 0:
            return resp.OK
        raise CommandError("ERR DB index is out of range")

    def reset(self, conn: ClientConnection, args: list[bytes]) -> Reply:
        """Redis's RESET: out of MULTI, no WATCH, tracking off, no subscriptions, RESP2, no
        name, CLIENT REPLY ON, and (with a password) not authenticated."""
        conn.multi = None
        conn.multi_failed = False
        self.transactions.unwatch(conn)
        self.tracking.disable(conn)
        self.pubsub.drop(conn)
        conn.proto = 2
        conn.name = b""
        conn.set_reply_mode(b"on")
        conn.authenticated = not (self.password and conn.needs_auth)
        conn.refresh_path()
        return RESET

    # ------------------------------------------------------------------ HELLO and AUTH

    def hello(self, conn: ClientConnection, args: list[bytes]) -> Reply:
        """Redis's order: every option is parsed, then AUTH checked, then SETNAME validated,
        and only then anything applied, so a failed HELLO changes nothing."""
        proto = conn.proto
        i = 1
        if len(args) > 1:
            proto = integer(args[1], "ERR Protocol version is not an integer or out of range")
            if proto not in (2, 3):
                raise CommandError("NOPROTO unsupported protocol version")
            i = 2
        name = user = password = None
        while i < len(args):
            opt = args[i].lower()
            if opt == b"auth" and i + 2 < len(args):
                user, password = args[i + 1], args[i + 2]
                i += 3
            elif opt == b"setname" and i + 1 < len(args):
                name = args[i + 1]
                i += 2
            else:
                raise CommandError(f"ERR Syntax error in HELLO option '{args[i].decode(errors='replace')}'")
        if user is not None:
            self._authenticate(conn, user, password)  # type: ignore[arg-type]  # set with user
        elif not conn.authenticated:
            raise CommandError(HELLO_NOAUTH)
        if name is not None:
            conn.name = client_attr(name, "Client names")
        conn.proto = proto
        conn.refresh_path()
        compat = self.cfg.compat_identity
        info = [
            (b"server", resp.bulk(b"redis" if compat else b"kvcache")),
            (b"version", resp.bulk((REDIS_VERSION if compat else __version__).encode())),
            (b"proto", resp.integer(proto)), (b"id", resp.integer(conn.id)),
            (b"mode", resp.bulk(b"standalone")), (b"role", resp.bulk(b"master")),
            (b"modules", resp.array([], proto)),
        ]
        return resp.map_([(resp.bulk(k), v) for k, v in info], proto)

    def auth(self, conn: ClientConnection, args: list[bytes]) -> Reply:
        """AUTH [user] password. Without a password configured, Redis's answers for that case:
        never an OK that pretends a password was checked."""
        if len(args) > 3:
            raise CommandError("ERR syntax error")
        if len(args) == 2:
            if not self.password:
                raise CommandError(AUTH_WITHOUT_PASSWORD)
            self._authenticate(conn, b"default", args[1])
        else:
            self._authenticate(conn, args[1], args[2])
        return resp.OK

    def _authenticate(self, conn: ClientConnection, user: bytes, password: bytes) -> None:
        """Only Redis's `default` user exists. With no password configured it accepts any
        password, as Redis's does; with one, only that one (compared in constant time)."""
        if user != b"default":
            raise CommandError(WRONGPASS)
        if self.password and not hmac.compare_digest(password, self.password.encode()):
            raise CommandError(WRONGPASS)
        if not conn.authenticated:
            conn.authenticated = True
            conn.refresh_path()

    # ------------------------------------------------------------------ CLIENT

    def client(self, conn: ClientConnection, args: list[bytes]) -> Reply:
        """The subcommands kvcache performs, as Redis does them (each one's argument count
        checked already: the table's `client|<sub>` arity)."""
        sub = args[1].lower()
        if sub == b"getname":
            return resp.bulk(conn.name or None, conn.proto)
        if sub == b"setname":
            conn.name = client_attr(args[2], "Client names")
            return resp.OK
        if sub == b"setinfo":
            attr = args[2].lower()
            if attr not in (b"lib-name", b"lib-ver"):
                raise CommandError(f"ERR Unrecognized option '{args[2].decode(errors='replace')}'")
            value = client_attr(args[3], args[2].decode(errors="replace"))
            if attr == b"lib-name":
                conn.lib_name = value
            else:
                conn.lib_ver = value
            return resp.OK
        if sub == b"id":
            return resp.integer(conn.id)
        if sub in (b"info", b"list") and self.seen_in_workers is not None:
            return self._after_workers(conn, args)
        if sub == b"info":
            return resp.verbatim(conn.client_info(_argv_mem(args)), conn.proto)
        if sub == b"list":
            return self.client_list(conn, args)
        if sub == b"kill":
            return self.client_kill(conn, args)
        if sub == b"reply":
            mode = args[2].lower()
            if mode not in (b"on", b"off", b"skip"):
                raise CommandError("ERR syntax error")
            return conn.set_reply_mode(mode)
        if sub in (b"no-evict", b"no-touch"):
            # kvcache evicts no client for memory and keeps no LRU/LFU: both are true either
            # way; the flag is kept only for CLIENT LIST's flags (e, T), as Redis shows it
            on = args[2].lower()
            if on not in (b"on", b"off"):
                raise CommandError("ERR syntax error")
            if sub == b"no-evict":
                conn.no_evict = on == b"on"
            else:
                conn.no_touch = on == b"on"
            return resp.OK
        if sub == b"tracking":
            tracking = parse_tracking(args, conn, lambda i: self.tracking.connection(i) is not None)
            if tracking is None:
                self.tracking.disable(conn)
            else:
                self.tracking.enable(conn, tracking)
            return resp.OK
        if sub == b"caching":
            return caching(conn, args[2])
        if sub == b"getredir":
            return getredir(conn)
        if sub == b"trackinginfo":
            return tracking_info(conn)
        raise CommandError(f"ERR unknown subcommand '{args[1].decode(errors='replace')[:64]}'. Try CLIENT HELP.")

    async def _after_workers(self, conn: ClientConnection, args: list[bytes]) -> bytes:
        """CLIENT INFO or LIST once the workers said what they saw of their clients."""
        assert self.seen_in_workers is not None
        await self.seen_in_workers()
        if args[1].lower() == b"info":
            return resp.verbatim(conn.client_info(_argv_mem(args)), conn.proto)
        reply = self.client_list(conn, args)
        assert isinstance(reply, bytes)
        return reply

    def client_list(self, conn: ClientConnection, args: list[bytes]) -> Reply:
        """CLIENT LIST [TYPE type | ID id ...], as Redis 7.4 (networking.c): one line per
        connection, oldest first; IDs that match no connection are left out."""
        if len(args) == 4 and args[2].lower() == b"type":
            kind = _client_type(args[3])
            chosen = [c for c in self.clients() if c.client_type == kind]
        elif len(args) > 3 and args[2].lower() == b"id":
            ids = [integer(a, "ERR Invalid client ID") for a in args[3:]]
            by_id = {c.id: c for c in self.clients()}
            chosen = [by_id[i] for i in ids if i in by_id]
        elif len(args) != 2:
            raise CommandError("ERR syntax error")
        else:
            chosen = list(self.clients())
        argv_mem = _argv_mem(args)
        text = "".join(c.client_info(argv_mem if c is conn else 0) for c in chosen)
        return resp.verbatim(text, conn.proto)

    def client_kill(self, conn: ClientConnection, args: list[bytes]) -> Reply:
        """CLIENT KILL addr:port (+OK, or `No such client`; the caller may kill itself) or
        CLIENT KILL <filter> <value> ... (how many were killed; SKIPME yes by default), as
        Redis 7.4. The caller, when killed, is closed once this reply is written."""
        addr = laddr = kind = None
        client_id = max_age = 0
        skipme = True
        if len(args) == 3:
            addr = args[2].decode(errors="replace")
            skipme = False  # the old form may kill the caller itself
        else:
            i = 2
            while i < len(args):
                opt = args[i].lower()
                if i + 1 >= len(args):
                    raise CommandError("ERR syntax error")
                value = args[i + 1]
                if opt == b"id":
                    client_id = integer(value, "ERR client-id should be greater than 0")
                    if client_id < 1:
                        raise CommandError("ERR client-id should be greater than 0")
                elif opt == b"maxage":
                    max_age = integer(value, "ERR maxage is not an integer or out of range")
                    if max_age <= 0:
                        raise CommandError("ERR maxage should be greater than 0")
                elif opt == b"type":
                    kind = _client_type(value)
                elif opt == b"addr":
                    addr = value.decode(errors="replace")
                elif opt == b"laddr":
                    laddr = value.decode(errors="replace")
                elif opt == b"user":
                    if value != b"default":  # the one user there is (see AUTH)
                        raise CommandError(f"ERR No such user '{value.decode(errors='replace')}'")
                elif opt == b"skipme":
                    yes_no = value.lower()
                    if yes_no not in (b"yes", b"no"):
                        raise CommandError("ERR syntax error")
                    skipme = yes_no == b"yes"
                else:
                    raise CommandError("ERR syntax error")
                i += 2
        now = time.monotonic_ns()
        killed = 0
        for c in list(self.clients()):
            if addr is not None or laddr is not None:
                peer, local = c.addresses()
                if (addr is not None and peer != addr) or (laddr is not None and local != laddr):
                    continue
            if kind is not None and c.client_type != kind:
                continue
            if client_id and c.id != client_id:
                continue
            if c is conn and skipme:
                continue
            if max_age and (now - c.created) // 1_000_000_000 < max_age:
                continue
            if c is conn:
                conn.close_after_reply()  # after this reply, as Redis's CLOSE_AFTER_REPLY
            else:
                c.kill()
            killed += 1
        if len(args) == 3:
            if not killed:
                raise CommandError("ERR No such client")
            return resp.OK
        return resp.integer(killed)

    # ------------------------------------------------------------------ transactions

    def multi(self, conn: ClientConnection, args: list[bytes]) -> Reply:
        if conn.multi is not None:
            raise CommandError("ERR MULTI calls can not be nested")
        conn.multi = []
        conn.refresh_path()
        return resp.OK

    def exec(self, conn: ClientConnection, args: list[bytes]) -> Reply:
        conn.in_exec = True
        try:
            return self.transactions.exec(conn, lambda queued: self.run(conn, queued))
        finally:
            conn.in_exec = False
            conn.last_cmd = b"exec"  # as Redis: the queued commands do not show as the last one

    def discard(self, conn: ClientConnection, args: list[bytes]) -> Reply:
        if conn.multi is None:
            raise CommandError("ERR DISCARD without MULTI")
        self._end_multi(conn)
        return resp.OK

    def abort(self, conn: ClientConnection, error: str) -> bytes:
        """EXEC refused (its own arguments wrong): the transaction is discarded with the
        reason, as Redis's execCommandAbort."""
        self._end_multi(conn)
        return resp.error(f"EXECABORT Transaction discarded because of: {error.removeprefix('ERR ')}")

    def _end_multi(self, conn: ClientConnection) -> None:
        conn.multi = None
        conn.multi_failed = False
        self.transactions.unwatch(conn)
        conn.refresh_path()

    def watch(self, conn: ClientConnection, args: list[bytes]) -> Reply:
        return self.transactions.watch(conn, args[1:])

    def unwatch(self, conn: ClientConnection, args: list[bytes]) -> Reply:
        self.transactions.unwatch(conn)
        return resp.OK

    # ------------------------------------------------------------------ pub/sub

    def subscribe(self, conn: ClientConnection, args: list[bytes]) -> Reply:
        return self.pubsub.subscribe(conn, args[1:], pattern=False)

    def psubscribe(self, conn: ClientConnection, args: list[bytes]) -> Reply:
        return self.pubsub.subscribe(conn, args[1:], pattern=True)

    def unsubscribe(self, conn: ClientConnection, args: list[bytes]) -> Reply:
        return self.pubsub.unsubscribe(conn, args[1:], pattern=False)

    def punsubscribe(self, conn: ClientConnection, args: list[bytes]) -> Reply:
        return self.pubsub.unsubscribe(conn, args[1:], pattern=True)

    def pubsub_command(self, conn: ClientConnection, args: list[bytes]) -> Reply:
        return self.pubsub.pubsub(args, conn.proto)


def _argv_mem(args: list[bytes]) -> int:
    """CLIENT LIST's argv-mem of the command running: its arguments' bytes (Redis's
    argv_len_sum)."""
    return sum(map(len, args))


def _client_type(raw: bytes) -> str:
    kind = CLIENT_TYPES.get(raw.decode(errors="replace").lower())
    if kind is None:
        raise CommandError(f"ERR Unknown client type '{raw.decode(errors='replace')}'")
    return kind


def client_attr(value: bytes, what: str) -> bytes:
    """A client name or library name/version: printable ASCII without spaces, as Redis
    requires (CLIENT INFO's `k=v` fields split on spaces)."""
    if any(c < 0x21 or c > 0x7e for c in value):
        raise CommandError(f"ERR {what} cannot contain spaces, newlines or special characters.")
    return value
