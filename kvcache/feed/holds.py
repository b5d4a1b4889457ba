"""Holds: what local reads wait for so that they never go back in time.

A read answered from NATS may hand out a revision the replica has not applied yet (a replica
may lag within max_stale_ms). The replica's older record must not then answer that key's next
read, so the key is held until the replica reaches the revision. The common case is no hold at
all, which the read paths check with one attribute (`floor_seq`) before asking per key. A held
key's read, a MINREV read and a state check wait for the replica to reach a sequence (`wait`).

`Holds` is one feed's (kvcache.feed.feed.Feed composes it): the read policy notes revisions
handed out and asks per key whether it is held; the feed reports each move of its replica
(`moved`), which releases the holds and wakes the waits it reached. Kept apart from the
consumer loop: it is the read path's bookkeeping, and needs nothing of the sync but the
feed's position.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from ..store.replica import BucketMeta

# Keys remembered as handed out from NATS ahead of the replica (Holds.ahead); past this many,
# every key waits for the replica instead (slower, still right) rather than one being forgotten.
AHEAD_MAX = 100_000


class Holds:
    """Revisions handed out from NATS that a feed's replica has not reached. `meta`, in every
    call, is the feed's current position (its applied sequence counts only once synced)."""

    def __init__(self, on_hold: Callable[[], None] | None = None) -> None:
        # key -> the highest revision handed out ahead of the replica, and the highest of all
        # (0: none, the common case).
        self.ahead: dict[str, int] = {}
        self.floor_seq = 0
        self._overflow = False  # AHEAD_MAX reached: every key waits for floor_seq
        # Called when the first key is held: the server drops the GET path's cached verdicts
        # (LocalGets.forget_fresh), which would otherwise answer from the replica for a while.
        self.on_hold = on_hold
        self._waiters: list[tuple[int, asyncio.Future]] = []

    def handed_out(self, key: str, revision: int, meta: BucketMeta) -> None:
        """An answer for `key` at `revision` (a value, or a deletion's marker) was handed out
        from NATS. A replica that has not reached it yet may lag within max_stale_ms, and its
        older record must not answer the key's next read (a strong read, then a plain one):
        until the replica reaches the revision the key is held (`held_until`), and the GET fast
        path, which does not look per key, stands aside (Feed.fresh_for_all). An unsynced
        replica's position says nothing (a full sync comes in subject order): every revision
        counts."""
        if revision <= meta.applied_seq and meta.synced:
            return
        opened = not self.floor_seq
        if key in self.ahead or len(self.ahead) < AHEAD_MAX:
            if revision > self.ahead.get(key, 0):
                self.ahead[key] = revision
        else:
            self._overflow = True
        if revision > self.floor_seq:
            self.floor_seq = revision
        if opened and self.on_hold is not None:
            self.on_hold()

    def held_until(self, key: str, revision: int | None, meta: BucketMeta) -> int:
        """0 when the replica may answer `key` without going back in time: its record's
        `revision` (None: it has none) is not below a revision of the key already handed out
        from NATS, or the replica has reached that. Else the key is held: the stream sequence
        to wait for."""
        if not self.floor_seq:
            return 0
        want = self.floor_seq if self._overflow else self.ahead.get(key, 0)
        if not want or (revision is not None and revision >= want) or (
                meta.synced and meta.applied_seq >= want):
            return 0
        return want

    async def wait(self, seq: int, timeout: float, meta: BucketMeta) -> bool:
        """True once the replica (now at `meta`) holds stream sequence `seq`, False on timeout."""
        if meta.synced and meta.applied_seq >= seq:
            return True
        fut = asyncio.get_running_loop().create_future()
        item = (seq, fut)
        self._waiters.append(item)
        try:
            await asyncio.wait_for(fut, timeout)
            return True
        except TimeoutError:
            return False
        finally:
            if item in self._waiters:
                self._waiters.remove(item)

    def moved(self, meta: BucketMeta) -> None:
        """The replica moved to `meta`: if it reached every revision handed out ahead of it,
        no key is held now; the waits for sequences it holds end."""
        if self.floor_seq and meta.synced and meta.applied_seq >= self.floor_seq:
            self.clear()
        if self._waiters and meta.synced:
            applied = meta.applied_seq
            for seq, fut in self._waiters:
                if seq <= applied and not fut.done():
                    fut.set_result(None)

    def clear(self) -> None:
        """Forget every hold: the replica holds them all, or their numbering is gone (a full
        sync of a stream since recreated)."""
        self.ahead.clear()
        self.floor_seq = 0
        self._overflow = False
