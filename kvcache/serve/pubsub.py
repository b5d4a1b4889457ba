"""Pub/sub on the sidecar's sockets, for keyspace notifications (and the channel REDIRECT
invalidations use).

Each change the feeds apply (kvcache.feed.changes) is published twice, as Redis does: on
`__keyspace@0__:<key>` with the event as payload, and on `__keyevent@0__:<event>` with the key
as payload (`set`, `del`, `expired`). Keys are named as clients read them: bare for the
default bucket, `bucket:key` for the others. One feed per bucket serves every subscriber: a
subscriber costs a dictionary entry, never a NATS consumer.

`notify-keyspace-events` takes Redis's flags (config key `notify_keyspace_events`, `CONFIG
SET` at run time), read by kvcache.config.parse_keyspace_events. kvcache's events are in the
classes `g` (del), `$` (set) and `x` (expired) (EVENT_CLASS); the other data-type classes are
accepted and never fire, as they never would in Redis for a database of strings. `m` (key
misses) and `n` (new keys) are refused: kvcache does not send those.

A subscriber that does not read is cut off alone once its pending output passes
`pubsub_max_output_bytes` (Redis's pub/sub output buffer limit); writing to the others does not
wait for it, since a write only appends to that connection's buffer.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from .. import resp
from ..config import KEYSPACE_CLASSES, parse_keyspace_events
from ..errors import CommandError
from ..feed.changes import Change
from ..keys import glob_matcher

if TYPE_CHECKING:
    from .session import Session as ClientConnection

log = logging.getLogger("kvcache.pubsub")

KEYSPACE = b"__keyspace@0__:"
KEYEVENT = b"__keyevent@0__:"
# The keyspace class (kvcache.config.KEYSPACE_CLASSES) of each event kvcache sends
EVENT_CLASS = {"set": "$", "del": "g", "expired": "x"}
# What a RESP2 connection may run while subscribed, and Redis's words for the rest
SUBSCRIBED_OK = frozenset({b"subscribe", b"ssubscribe", b"unsubscribe", b"sunsubscribe",
                           b"psubscribe", b"punsubscribe", b"ping", b"quit", b"reset"})


def _confirm(conn: ClientConnection, confirmations: bytes) -> bytes:
    """(P)(UN)SUBSCRIBE's confirmations, the command's reply. They are pushes in Redis, sent
    whatever CLIENT REPLY says (pubsub.c sets CLIENT_PUSHING around each, which lifts OFF and
    SKIP in RESP2 and RESP3 alike): while this command's reply is to be dropped, they are kept
    on the connection (`confirmations`) to go out in its place. A client that waits for them
    (Redis's own tests, client libraries) would otherwise wait for ever."""
    if conn.silenced:
        conn.confirmations.append(confirmations)
    return confirmations


def pmessage(pattern: bytes, channel: bytes, payload: bytes, proto: int) -> bytes:
    return resp.push([b"$8\r\npmessage\r\n", resp.bulk(pattern), resp.bulk(channel), resp.bulk(payload)], proto)


class PubSub:
    """Channels and patterns of every connection, and the keyspace notifications published on
    them. A ChangeHub listener."""

    def __init__(self, flags: str, default_bucket: str | None) -> None:
        self.channels: dict[bytes, set[ClientConnection]] = {}
        self.patterns: dict[bytes, tuple[Callable[[str], bool], set[ClientConnection]]] = {}
        self.default_bucket = default_bucket
        self.messages = 0  # messages delivered (one per subscriber)
        self.set_flags(parse_keyspace_events(flags))

    def set_flags(self, flags: str) -> None:
        self.flags = flags
        classes = set(KEYSPACE_CLASSES) if "A" in flags else set(flags)
        self._events = {e for e, c in EVENT_CLASS.items() if c in classes}
        self._space = "K" in flags
        self._event = "E" in flags

    # ------------------------------------------------------------------ Listener

    @property
    def listening(self) -> bool:
        return bool(self.channels or self.patterns) and bool(self._events)

    wants_flushes = False

    def changed(self, bucket: str, changes: list[Change]) -> None:
        prefix = "" if bucket == self.default_bucket else bucket + ":"
        out: list[tuple[bytes, bytes]] = []
        for key, event in changes:
            if event not in self._events:
                continue
            name = (prefix + key).encode()
            ev = event.encode()
            if self._space:
                out.append((KEYSPACE + name, ev))
            if self._event:
                out.append((KEYEVENT + ev, name))
        if out:
            self.publish(out)

    def flushed(self, bucket: str, why: str) -> None:
        pass

    # ------------------------------------------------------------------ publishing

    def publish(self, messages: Iterable[tuple[bytes, bytes]]) -> int:
        """Deliver (channel, payload) messages: each subscriber gets its share in one write."""
        batches: dict[ClientConnection, list[bytes]] = {}
        channels, patterns = self.channels, self.patterns
        delivered = 0
        for channel, payload in messages:
            conns = channels.get(channel)
            if conns:
                body = b"$7\r\nmessage\r\n" + resp.bulk(channel) + resp.bulk(payload)
                for c in conns:
                    batches.setdefault(c, []).append((b">3\r\n" if c.proto == 3 else b"*3\r\n") + body)
                delivered += len(conns)
            if patterns:
                text = channel.decode("latin-1")
                for pattern, (match, pconns) in patterns.items():
                    if match(text):
                        for c in pconns:
                            batches.setdefault(c, []).append(pmessage(pattern, channel, payload, c.proto))
                        delivered += len(pconns)
        for c, parts in batches.items():
            c.push(b"".join(parts))
        self.messages += delivered
        return delivered

    # ------------------------------------------------------------------ commands

    def subscribe(self, conn: ClientConnection, channels: list[bytes], pattern: bool) -> bytes:
        kind = b"psubscribe" if pattern else b"subscribe"
        mine = conn.patterns if pattern else conn.channels
        replies = []
        for ch in channels:
            if ch not in mine:
                mine.add(ch)
                if pattern:
                    entry = self.patterns.get(ch)
                    if entry is None:
                        entry = self.patterns[ch] = (glob_matcher(ch.decode("latin-1")), set())
                    entry[1].add(conn)
                else:
                    self.channels.setdefault(ch, set()).add(conn)
            replies.append(self._ack(conn, kind, ch))
        conn.refresh_path()
        return _confirm(conn, b"".join(replies))

    def unsubscribe(self, conn: ClientConnection, channels: list[bytes], pattern: bool) -> bytes:
        kind = b"punsubscribe" if pattern else b"unsubscribe"
        mine = conn.patterns if pattern else conn.channels
        targets = channels or sorted(mine)
        if not targets:
            return _confirm(conn, self._ack(conn, kind, None))
        replies = []
        for ch in targets:
            if ch in mine:
                mine.discard(ch)
                self._forget(conn, ch, pattern)
            replies.append(self._ack(conn, kind, ch))
        conn.refresh_path()
        return _confirm(conn, b"".join(replies))

    def drop(self, conn: ClientConnection) -> None:
        """RESET or a closed connection: every subscription goes."""
        for ch in conn.channels:
            self._forget(conn, ch, False)
        for p in conn.patterns:
            self._forget(conn, p, True)
        conn.channels.clear()
        conn.patterns.clear()

    def _forget(self, conn: ClientConnection, ch: bytes, pattern: bool) -> None:
        if pattern:
            entry = self.patterns.get(ch)
            if entry is not None:
                entry[1].discard(conn)
                if not entry[1]:
                    del self.patterns[ch]
        else:
            conns = self.channels.get(ch)
            if conns is not None:
                conns.discard(conn)
                if not conns:
                    del self.channels[ch]

    @staticmethod
    def _ack(conn: ClientConnection, kind: bytes, ch: bytes | None) -> bytes:
        count = len(conn.channels) + len(conn.patterns)
        return resp.push([resp.bulk(kind), resp.bulk(ch, conn.proto), resp.integer(count)], conn.proto)

    def pubsub(self, args: list[bytes], proto: int) -> bytes:
        """PUBSUB CHANNELS [pattern] | NUMSUB [channel ...] | NUMPAT (their argument counts
        checked already, from the command table; CHANNELS takes one pattern at most)."""
        sub = args[1].lower()
        if sub == b"channels" and len(args) <= 3:
            match = glob_matcher(args[2].decode("latin-1")) if len(args) == 3 else None
            names = [ch for ch in self.channels if match is None or match(ch.decode("latin-1"))]
            return resp.array([resp.bulk(ch) for ch in names], proto)
        if sub == b"numsub":
            out = []
            for ch in args[2:]:
                out += [resp.bulk(ch), resp.integer(len(self.channels.get(ch, ())))]
            return resp.array(out, proto)
        if sub == b"numpat":
            return resp.integer(len(self.patterns))
        if sub == b"channels":
            raise CommandError("ERR wrong number of arguments for 'pubsub|channels' command")
        raise CommandError(f"ERR unknown subcommand '{args[1].decode(errors='replace')[:64]}'. Try PUBSUB HELP.")

    def clients(self) -> int:
        """Connections with at least one subscription."""
        return len({c for conns in self.channels.values() for c in conns}
                   | {c for _, conns in self.patterns.values() for c in conns})

    def info(self) -> list[tuple[str, object]]:
        return [("pubsub_channels", len(self.channels)), ("pubsub_patterns", len(self.patterns)),
                ("pubsub_messages", self.messages)]
