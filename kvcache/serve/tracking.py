"""Server-assisted client-side caching, as Redis 6+ defines it (CLIENT TRACKING).

A client that turns tracking on caches what it reads; kvcache promises to tell it when a value
it read may have changed, with the RESP3 `invalidate` push (or, for `REDIRECT` to a RESP2
connection subscribed to `__redis__:invalidate`, a message on that channel). The promise is
kept from the feed (kvcache.feed.changes): every PUT, DEL, PURGE, expiry and removal without a
message invalidates the keys it touches, and whenever kvcache cannot vouch for a bucket any
more (a resync, a lost consumer, the replica past max_stale_ms) every tracking client is told
to drop everything (the null invalidation, Redis's answer to FLUSHALL).

What is vouched for: a value read from the replica while it is fresh within max_stale_ms, in
the same event-loop step as the read that answered it, so no change can slip in between. A
key answered by a peer or the stream leader has no feed watching it (outside the bucket's
filters), and a reply that had to wait (NATS, a held key, a transaction with such a read) was
read in an earlier step than the one that writes it: kvcache cannot promise to invalidate
either, so their keys are invalidated right after the reply. A client may then use the value
it just read, but never caches it past that moment. The price is a re-read of such keys, the
alternative a value kept cached for ever.

Default mode keeps a table of key names -> connections, one-shot like Redis's (a key is
forgotten once invalidated, until read again) and bounded by `tracking_table_max_keys`: past
it, the oldest keys are invalidated and forgotten, as Redis evicts them. BCAST keeps no table:
every change under a registered prefix goes to the connections that asked. Key names are the
ones clients read: `key` for the default bucket, `bucket:key` for any bucket.

NOLOOP is accepted and has nothing to do: no client writes through kvcache.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import resp
from ..errors import CommandError
from ..feed.changes import Change
from .arguments import integer
from .tracking_mode import ClientTracking

if TYPE_CHECKING:
    from .session import Session as ClientConnection

INVALIDATE_CHANNEL = b"__redis__:invalidate"
# The push and the pub/sub message Redis sends, up to the keys array (or null)
PUSH_HEAD = b">2\r\n$10\r\ninvalidate\r\n"
MESSAGE_HEAD = b"*3\r\n$7\r\nmessage\r\n$20\r\n__redis__:invalidate\r\n"
NULL_KEYS = {2: b"$-1\r\n", 3: b"_\r\n"}
# Which commands' keys are remembered, and where their keys are: the command table's
# (kvcache.serve.command_table: CommandSpec.tracked, key_args), applied by the command layer.


class Tracking:
    """The server's tracking state: the key table, the BCAST prefixes, and the invalidations
    the feed's changes (kvcache.feed.changes) turn into. A ChangeHub listener."""

    def __init__(self, max_keys: int, default_bucket: str | None,
                 connection: Callable[[int], ClientConnection | None],
                 on_first: Callable[[], None] | None = None) -> None:
        self.max_keys = max_keys
        self.default_bucket = default_bucket
        self.connection = connection  # id -> live connection (REDIRECT targets)
        self.table: dict[bytes, set[ClientConnection]] = {}
        self.bcast: dict[bytes, set[ClientConnection]] = {}
        self.clients: set[ClientConnection] = set()
        self.invalidations = 0  # invalidation messages sent (a flush counts one)
        self.on_first = on_first  # the first tracking client: the hub's staleness watch wakes

    # ------------------------------------------------------------------ Listener

    @property
    def listening(self) -> bool:
        return bool(self.clients)

    @property
    def wants_flushes(self) -> bool:
        return bool(self.clients)

    def changed(self, bucket: str, changes: list[Change]) -> None:
        batches: dict[ClientConnection, list[bytes]] = {}
        table, bcast = self.table, self.bcast
        default = bucket == self.default_bucket
        for key, _event in changes:
            full = f"{bucket}:{key}".encode()
            names = (key.encode(), full) if default else (full,)
            for name in names:
                conns = table.pop(name, None)
                if conns:
                    for c in conns:
                        t = c.tracking
                        if t is not None:
                            t.keys.discard(name)
                            batches.setdefault(c, []).append(name)
                if bcast:
                    for prefix, conns in bcast.items():
                        if name.startswith(prefix):
                            for c in conns:
                                batches.setdefault(c, []).append(name)
        for c, batch in batches.items():
            self.send(c, batch)

    def flushed(self, bucket: str, why: str) -> None:
        self.table.clear()
        for c in list(self.clients):
            if c.tracking is not None:
                c.tracking.keys.clear()
            self.send(c, None)

    # ------------------------------------------------------------------ connections

    def enable(self, conn: ClientConnection, mode: ClientTracking) -> None:
        old = conn.tracking
        if old is not None:  # options change, the keys it tracks stay (as in Redis)
            mode.keys = old.keys
            self._drop_prefixes(conn, old)
            if mode.bcast:
                mode.prefixes = list(dict.fromkeys(old.prefixes + mode.prefixes))
        conn.tracking = mode
        if mode.bcast:
            for p in mode.prefixes:
                self.bcast.setdefault(p, set()).add(conn)
        first = not self.clients
        self.clients.add(conn)
        conn.refresh_path()
        if first and self.on_first is not None:
            self.on_first()

    def disable(self, conn: ClientConnection) -> None:
        """CLIENT TRACKING OFF, RESET, or the connection closed: forget it everywhere."""
        t = conn.tracking
        if t is None:
            return
        table = self.table
        for name in t.keys:
            conns = table.get(name)
            if conns is not None:
                conns.discard(conn)
                if not conns:
                    del table[name]
        self._drop_prefixes(conn, t)
        self.clients.discard(conn)
        conn.tracking = None
        conn.refresh_path()

    def _drop_prefixes(self, conn: ClientConnection, t: ClientTracking) -> None:
        if not t.bcast:
            return
        for p in t.prefixes:
            conns = self.bcast.get(p)
            if conns is not None:
                conns.discard(conn)
                if not conns:
                    del self.bcast[p]

    def remember(self, conn: ClientConnection, names: list[bytes]) -> None:
        """Keys `conn` just read from the replica: tell it when they change."""
        t = conn.tracking
        assert t is not None
        table = self.table
        for name in names:
            conns = table.get(name)
            if conns is None:
                if len(table) >= self.max_keys:
                    self._evict()
                table[name] = {conn}
            else:
                conns.add(conn)
            t.keys.add(name)

    def _evict(self) -> None:
        """The table is full: the oldest key is invalidated and forgotten (Redis evicts keys
        from a full table the same way: its clients are told, the promise ends)."""
        name = next(iter(self.table))
        for c in self.table.pop(name):
            if c.tracking is not None:
                c.tracking.keys.discard(name)
                self.send(c, [name])

    # ------------------------------------------------------------------ sending

    def send(self, conn: ClientConnection, names: list[bytes] | None) -> None:
        """One invalidation (None: drop everything) to `conn`, or where it redirects them."""
        t = conn.tracking
        if t is None:
            return
        target = conn
        if t.redirect:
            found = self.connection(t.redirect)
            if found is None:
                if conn.proto == 3 and not t.broken:  # Redis tells a RESP3 client once
                    conn.push(b">2\r\n$20\r\ntracking-redir-broken\r\n" + resp.integer(t.redirect))
                t.broken = True
                return
            target = found
        keys = NULL_KEYS[target.proto] if names is None else resp.array([resp.bulk(n) for n in names])
        if target.proto == 3:
            target.push(PUSH_HEAD + keys)
        elif target.subscribed:
            target.push(MESSAGE_HEAD + keys)
        else:
            return  # a RESP2 redirect target that is not subscribed: Redis sends nothing
        self.invalidations += 1

    def after_reply(self, conn: ClientConnection, names: list[bytes]) -> None:
        """Keys answered in a way kvcache cannot vouch for (see the module's docstring): the
        client may use the reply it just got, not keep it."""
        if names:
            self.send(conn, list(dict.fromkeys(names)))

    # ------------------------------------------------------------------ INFO

    def info(self) -> list[tuple[str, object]]:
        return [
            ("tracking_total_keys", len(self.table)),
            ("tracking_total_items", sum(len(c) for c in self.table.values())),
            ("tracking_total_prefixes", len(self.bcast)),
            ("tracking_invalidations", self.invalidations),
        ]


# ---------------------------------------------------------------------- CLIENT TRACKING

def parse_tracking(args: list[bytes], conn: ClientConnection,
                   exists: Callable[[int], bool]) -> ClientTracking | None:
    """CLIENT TRACKING ON|OFF [REDIRECT id] [BCAST] [PREFIX p]... [OPTIN] [OPTOUT] [NOLOOP]:
    the new mode (None: OFF), or Redis's error for the options and the connection's state."""
    switch = args[2].lower()
    redirect = 0
    bcast = optin = optout = noloop = False
    prefixes: list[bytes] = []
    i = 3
    while i < len(args):
        opt = args[i].lower()
        more = i + 1 < len(args)
        if opt == b"redirect" and more:
            i += 1
            if redirect:
                raise CommandError("ERR A client can only redirect to a single other client")
            redirect = integer(args[i])
            if not exists(redirect):
                raise CommandError("ERR The client ID you want redirect to does not exist")
        elif opt == b"bcast":
            bcast = True
        elif opt == b"optin":
            optin = True
        elif opt == b"optout":
            optout = True
        elif opt == b"noloop":
            noloop = True
        elif opt == b"prefix" and more:
            i += 1
            prefixes.append(args[i])
        else:
            raise CommandError("ERR syntax error")
        i += 1
    if switch == b"off":
        return None
    if switch != b"on":
        raise CommandError("ERR syntax error")
    old = conn.tracking
    if prefixes and not bcast:
        raise CommandError("ERR PREFIX option requires BCAST mode to be enabled")
    if old is not None and old.bcast != bcast:
        raise CommandError("ERR You can't switch BCAST mode on/off before disabling tracking for "
                           "this client, and then re-enabling it with a different mode.")
    if bcast and (optin or optout):
        raise CommandError("ERR OPTIN and OPTOUT are not compatible with BCAST")
    if optin and optout:
        raise CommandError("ERR You can't specify both OPTIN mode and OPTOUT mode")
    if old is not None and ((optin and old.optout) or (optout and old.optin)):
        raise CommandError("ERR You can't switch OPTIN/OPTOUT mode before disabling tracking for "
                           "this client, and then re-enabling it with a different mode.")
    _check_prefixes(prefixes, old.prefixes if old is not None else [])
    if bcast and not prefixes:
        prefixes = [b""]  # every key, shown as the empty prefix
    return ClientTracking(bcast, optin, optout, noloop, redirect, prefixes)


def _check_prefixes(new: list[bytes], existing: list[bytes]) -> None:
    """Redis's rule: no prefix of one client may be a prefix of another of its prefixes."""
    for i, p in enumerate(new):
        for q in existing:
            if p.startswith(q) or q.startswith(p):
                raise CommandError(
                    f"ERR Prefix '{p.decode(errors='replace')}' overlaps with an existing prefix "
                    f"'{q.decode(errors='replace')}'. Prefixes for a single client must not overlap.")
        for q in new[i + 1:]:
            if p.startswith(q) or q.startswith(p):
                raise CommandError(
                    f"ERR Prefix '{p.decode(errors='replace')}' overlaps with another provided "
                    f"prefix '{q.decode(errors='replace')}'. Prefixes for a single client must not overlap.")


def caching(conn: ClientConnection, arg: bytes) -> bytes:
    """CLIENT CACHING YES|NO, with Redis's errors."""
    t = conn.tracking
    if t is None:
        raise CommandError("ERR CLIENT CACHING can be called only when the client is in tracking "
                           "mode with OPTIN or OPTOUT mode enabled")
    yes = arg.lower()
    if yes == b"yes":
        if not t.optin:
            raise CommandError("ERR CLIENT CACHING YES is only valid when tracking is enabled in OPTIN mode.")
        t.caching = True
    elif yes == b"no":
        if not t.optout:
            raise CommandError("ERR CLIENT CACHING NO is only valid when tracking is enabled in OPTOUT mode.")
        t.caching = False
    else:
        raise CommandError("ERR syntax error")
    return resp.OK


def tracking_info(conn: ClientConnection) -> bytes:
    """CLIENT TRACKINGINFO: flags (a set in RESP3), redirect, prefixes, as Redis answers."""
    t = conn.tracking
    proto = conn.proto
    if t is None:
        flags, redirect, prefixes = [b"off"], -1, []
    else:
        flags = [b"on"]
        for on, flag in ((t.bcast, b"bcast"), (t.optin, b"optin"), (t.optout, b"optout"),
                         (t.caching is True, b"caching-yes"), (t.caching is False, b"caching-no"),
                         (t.noloop, b"noloop"), (t.broken, b"broken_redirect")):
            if on:
                flags.append(flag)
        redirect, prefixes = t.redirect, t.prefixes
    flag_items = [resp.bulk(f) for f in flags]
    return resp.map_([
        (resp.bulk(b"flags"), resp.set_(flag_items, proto)),
        (resp.bulk(b"redirect"), resp.integer(redirect)),
        (resp.bulk(b"prefixes"), resp.array([resp.bulk(p) for p in prefixes], proto)),
    ], proto)


def getredir(conn: ClientConnection) -> bytes:
    t = conn.tracking
    return resp.integer(-1 if t is None else t.redirect)
