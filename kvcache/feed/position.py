"""Waits for a feed's replica to reach a stream sequence.

A held key's read, a MINREV read (kvcache.read.reads) and the feed's own sweeps wait for the
replica to apply a sequence (`wait`); the feed reports each move of its replica (`moved`),
which ends the waits it reached. What was handed out and which keys are held is the read
side's ledger (kvcache.read.ledger), which the feed only tells what it applied.
"""
from __future__ import annotations

import asyncio

from ..store.replica import BucketMeta


class Position:
    """Reads waiting for one feed's replica to reach a sequence. `meta`, in every call, is the
    feed's current position (its applied sequence counts only once synced)."""

    def __init__(self) -> None:
        self._waiters: list[tuple[int, asyncio.Future]] = []

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
        """The replica moved to `meta`: the waits for sequences it holds end."""
        if self._waiters and meta.synced:
            applied = meta.applied_seq
            for seq, fut in self._waiters:
                if seq <= applied and not fut.done():
                    fut.set_result(None)
