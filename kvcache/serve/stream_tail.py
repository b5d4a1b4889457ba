"""The recent end of one bucket's stream, encoded once for all its readers (kvcache.serve.streams).

Readers following a bucket come back for "everything after my last ID" each at its own pace,
so their IDs differ and one reply cannot simply be shared; but what they ask for is mostly the
same few recent entries. Read from the revision index, each reader would cost a walk and an
encoding per entry: a thousand readers of a bucket changing a thousand times a second is a
million of them a second, more than a core. A Tail holds the entries applied since it began,
each encoded once (when the feed applies it), in revision order; an entry whose key changed
again is blanked. A reader whose ID falls inside it gets its reply from a bisect and a join,
with no work per entry in Python, however many readers there are.

A filtered stream (`@<bucket>:<filter>`) has a Tail of its own, holding only the entries of
its keys: its readers wake at each of the bucket's batches, and each finds what its filter
holds of the batch in its tail, not by walking the index again from its ID. The walk of a
batch asks the filter before reading a record, and `top` moves to the last revision walked
whether or not any matched, so a filter matching few keys of a busy bucket looks at each
revision once.

It is exact or it is not used: a caller drops it when the index loses an entry without a
newer one (a removal with no message: ChangeHub.removed), when the bucket is flushed (a
resync, a renumbered stream), and when one of its entries passes its deadline (`answer`
returns None); it is trimmed from the front past MAX_ENTRIES or MAX_BYTES. A reader whose ID
is below its start reads the index itself.
"""
from __future__ import annotations

import time
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Iterable

from ..store.revindex import StreamEntry

MAX_ENTRIES = 65_536
MAX_BYTES = 32 << 20


class Tail:
    """Entries with revisions above `start`, up to `top`, each encoded by `encode`; of the
    keys `match` accepts (the key's bytes), when given: a filtered stream's."""

    def __init__(self, start: int, encode: Callable[[StreamEntry], bytes],
                 match: Callable[[bytes], bool] | None = None) -> None:
        self.start = start
        self.top = start               # every index entry up to here has been looked at
        self.encode = encode
        self.match = match             # what the caller's walk of the index asks of each key
        self.revs: list[int] = []
        self.parts: list[bytes] = []   # encoded entries; b"" once superseded
        self.cum: list[int] = [0]      # bytes of values before each position (the reply budget)
        self.dead: list[int] = []      # blanked positions, sorted
        self.pos: dict[bytes, int] = {}
        self.deadline = 0              # the earliest deadline among its entries, 0: none
        self.bytes = 0
        self.used = time.monotonic()   # the last time a reader was answered from it

    def extend(self, entries: Iterable[StreamEntry], upto: int = 0) -> None:
        """Entries above `top`, in revision order (the index walked from top + 1, with
        `match`); `upto`: the last revision the walk went through, matched or not (the
        index's last), where the next walk starts after."""
        for e in entries:
            old = self.pos.get(e.key)
            if old is not None:
                self.bytes -= len(self.parts[old])
                self.parts[old] = b""
                insort(self.dead, old)
            part = self.encode(e)
            self.pos[e.key] = len(self.revs)
            self.revs.append(e.revision)
            self.parts.append(part)
            self.cum.append(self.cum[-1] + len(e.key) + (len(e.value) if e.value is not None else 0))
            self.bytes += len(part)
            if e.deadline and (not self.deadline or e.deadline < self.deadline):
                self.deadline = e.deadline
            self.top = e.revision
        self.top = max(self.top, upto)
        if len(self.revs) > MAX_ENTRIES or self.bytes > MAX_BYTES:
            self._trim()

    def _trim(self) -> None:
        """Drop the older half: `start` moves up to the last revision dropped."""
        cut = len(self.revs) // 2
        self.start = self.revs[cut - 1]
        self.bytes -= sum(len(p) for p in self.parts[:cut])
        base = self.cum[cut]
        del self.revs[:cut], self.parts[:cut]
        self.cum = [c - base for c in self.cum[cut:]]
        self.dead = [d - cut for d in self.dead if d >= cut]
        self.pos = {k: p - cut for k, p in self.pos.items() if p >= cut}

    def covers(self, after: int) -> bool:
        return after >= self.start

    def answer(self, after: int, count: int | None, budget: int, now_ns: int) -> tuple[bytes, int, int] | None:
        """The entries above `after` (at most `count`; stopping once their values pass
        `budget`) as one encoded array, their number and the highest revision; None when
        the tail cannot say exactly (an entry past its deadline: drop the tail)."""
        if self.deadline and now_ns >= self.deadline:
            return None
        i = bisect_right(self.revs, after)
        j = len(self.revs)
        dead = len(self.dead) - bisect_left(self.dead, i)
        if self.cum[j] - self.cum[i] > budget:  # up to the entry whose values pass it
            if dead:
                return None  # blanked entries count in `cum`: the caller reads the index
            j = bisect_left(self.cum, self.cum[i] + budget, i + 1)
        n = j - i - dead
        if count is not None and n > count:
            if dead:
                return None  # rare: the caller reads the index
            j = i + count
            n = count
        self.used = time.monotonic()
        if n <= 0:
            return b"", 0, after
        return b"*%d\r\n%b" % (n, b"".join(self.parts[i:j])), n, self.revs[j - 1]
