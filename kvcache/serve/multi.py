"""MULTI/EXEC/DISCARD and WATCH/UNWATCH for read commands.

Clients use transactions without asking for them: redis-py's default `pipeline()`, node-redis
and ioredis `multi()`, rueidis's cached reads (`MULTI`, `PTTL`, the read, `EXEC`). kvcache
answers them the way Redis does, for reads:

- Commands after MULTI are checked (known, right number of arguments by the command table,
  not a write: kvcache.serve.commands.dispatch) and queued (`+QUEUED`). A command that fails
  the check answers its error at once and the transaction is discarded at EXEC
  (`-EXECABORT`), as Redis does for a bad command; a write is such a command (`-READONLY`),
  since kvcache performs none.
- EXEC runs the queue in one event-loop step: every read the replica answers comes from the
  same replica state (the feed writes between steps, never during one). Reads NATS must answer
  (keys outside the bucket's filters, a replica past max_stale_ms) are sent in that step and
  answered when NATS replies: such a key is as of its own read, which no replica snapshot
  could give.
- WATCH remembers keys; a change the feed applies to one of them (kvcache.feed.changes), or a flush
  (kvcache can no longer vouch for the bucket), makes EXEC answer the null array, as a
  modified key does in Redis. A key kvcache does not replicate has no feed to tell it of
  changes: WATCH refuses it rather than promise what it cannot see. EXEC also answers null
  when a watched bucket's replica is not fresh within max_stale_ms at that moment.
"""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from .. import resp
from ..errors import CommandError, KvcacheError
from ..feed.changes import Change

if TYPE_CHECKING:
    from ..read.policy import ReadPolicy
    from .session import Session as ClientConnection

log = logging.getLogger("kvcache.multi")

EXECABORT = resp.error("EXECABORT Transaction discarded because of previous errors.")
QUEUED = b"+QUEUED\r\n"
# Commands that act on the transaction itself, never queued
CONTROL = frozenset({b"exec", b"discard", b"multi", b"watch", b"quit", b"reset"})


class Transactions:
    """WATCHed keys of every connection: (bucket, key) -> connections. A ChangeHub listener:
    a change to a watched key marks its watchers' transactions as failed."""

    def __init__(self, policy: ReadPolicy) -> None:
        self.policy = policy
        self.watched: dict[tuple[str, str], set[ClientConnection]] = {}
        self.by_bucket: dict[str, set[ClientConnection]] = {}

    # ------------------------------------------------------------------ Listener

    @property
    def listening(self) -> bool:
        return bool(self.watched)

    @property
    def wants_flushes(self) -> bool:
        return bool(self.watched)

    def changed(self, bucket: str, changes: list[Change]) -> None:
        watched = self.watched
        for key, _ in changes:
            conns = watched.get((bucket, key))
            if conns:
                for c in conns:
                    c.watch_dirty = True

    def flushed(self, bucket: str, why: str) -> None:
        for c in self.by_bucket.get(bucket, ()):
            c.watch_dirty = True

    # ------------------------------------------------------------------ commands

    def watch(self, conn: ClientConnection, raw_keys: list[bytes]) -> bytes:
        if conn.multi is not None:
            raise CommandError("ERR WATCH inside MULTI is not allowed")
        resolved = []
        for raw in raw_keys:
            plan = self.policy.address(raw)  # the key's one address: bucket, key, replicated
            if not plan.replicated:
                raise CommandError(f"ERR kvcache can WATCH only keys it replicates: "
                                   f"'{raw.decode(errors='replace')[:64]}' is read from NATS")
            resolved.append((plan.bucket, plan.key))
        for bk in resolved:
            if bk not in conn.watching:
                conn.watching.add(bk)
                self.watched.setdefault(bk, set()).add(conn)
                self.by_bucket.setdefault(bk[0], set()).add(conn)
        return resp.OK

    def unwatch(self, conn: ClientConnection) -> None:
        for bk in conn.watching:
            conns = self.watched.get(bk)
            if conns is not None:
                conns.discard(conn)
                if not conns:
                    del self.watched[bk]
            conns = self.by_bucket.get(bk[0])
            if conns is not None:
                conns.discard(conn)
                if not conns:
                    del self.by_bucket[bk[0]]
        conn.watching.clear()
        conn.watch_dirty = False

    def watch_holds(self, conn: ClientConnection) -> bool:
        """No watched key changed, and every watched bucket is still vouched for now."""
        if conn.watch_dirty:
            return False
        vouched = self.policy.vouched
        return all(vouched(bucket) for bucket in {b for b, _ in conn.watching})

    def exec(self, conn: ClientConnection, run: Callable[[list[bytes]], bytes | Awaitable[bytes]]
             ) -> bytes | Awaitable[bytes]:
        """EXEC: the queued commands' replies as one array, or null (a watched key changed),
        or EXECABORT (a command was refused when queued)."""
        queued, failed = conn.multi, conn.multi_failed
        if queued is None:
            raise CommandError("ERR EXEC without MULTI")
        conn.multi = None
        conn.multi_failed = False
        holds = self.watch_holds(conn)
        self.unwatch(conn)
        conn.refresh_path()
        if failed:
            return EXECABORT
        if not holds:
            return resp.NIL3 if conn.proto == 3 else resp.NULL_ARRAY2
        replies = [run(args) for args in queued]  # one step: one replica state
        if all(r.__class__ is bytes for r in replies):
            return resp.array(replies, conn.proto)  # type: ignore[arg-type]  # all bytes
        return _gather(replies, conn.proto)


async def _gather(replies: list, proto: int) -> bytes:
    """The replies that wait for NATS, awaited in order; an error is that command's reply,
    as in Redis (the others still answer)."""
    out = []
    try:
        for i, r in enumerate(replies):
            if r.__class__ is bytes:
                out.append(r)
                continue
            try:
                out.append(await r)
            except KvcacheError as e:  # the wording a command alone gets (server._finished)
                msg = str(e)
                out.append(resp.error(msg if msg.startswith(("ERR", "READONLY")) else f"ERR {msg}"))
            except Exception:
                log.exception("command in a transaction failed")
                out.append(resp.error("ERR internal error"))
            replies[i] = None
    finally:  # cancelled (the client left): close what never ran
        for r in replies:
            if r is not None and r.__class__ is not bytes:
                r.close()
    return resp.array(out, proto)
