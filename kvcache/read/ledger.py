"""The ledger: what this sidecar already handed out, so that no read goes back below it.

One ledger for every read path, three kinds of entry:
- **floors** (`Floors`): per key, the highest revision read from NATS (the most recent
  FLOORS_MAX keys). The router applies them to every answer from a peer: followers and mirrors
  of different lag must not take a key's reads back (kvcache.read.router).
- **holds** (`Holds`, one per bucket): revisions handed out from NATS that the replica has not
  applied yet. Until it has, the replica's older record must not answer the key: the key is
  *held* (the read policy's rule, kvcache.store.verdict, asks `held_until`), and the GET fast
  path, which does not look per key, stands aside (`Witness.fresh_for_all`).
- **streams**: per connection and bucket, the highest revision of a bucket's stream handed
  out (`stream_handed`), so that a stream whose last revision fell below it (the bucket was
  recreated) is refused until the reader starts again (kvcache.read.stream_rules).

The feeds only report what they applied (`applied`, `resync_began`, `renumbered`, `removed`:
the sidecar wires their callbacks here); the decisions ask. A bucket's `Witness` is what the
read decisions take a replica's word from: its feed's freshness with the ledger's holds.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..entry import Entry
from ..store.record import expiry
from ..store.verdict import LOCAL, replica_verdict

if TYPE_CHECKING:
    from ..feed.feed import Feed
    from ..store.nearcache import NearCache
    from ..store.replica import BucketMeta

FLOORS_MAX = 65536
# Keys remembered as handed out from NATS ahead of the replica (Holds.ahead); past this many,
# every key waits for the replica instead (slower, still right) rather than one being forgotten.
AHEAD_MAX = 100_000


class Floors:
    """The highest revision read so far per key (the most recent FLOORS_MAX keys), so that
    reads of a key never go back in time when peers of different lag answer them."""

    def __init__(self, size: int = FLOORS_MAX, max_age: Callable[[str], int] | None = None) -> None:
        # (bucket, key) -> (revision, the moment that revision leaves the bucket, 0: never)
        self._rev: OrderedDict[tuple[str, str], tuple[int, int]] = OrderedDict()
        self._by_bucket: dict[str, set[str]] = {}  # the keys with a floor, per bucket (forget)
        self._size = size
        # A bucket's max_age in ns (the sidecar's feeds say): a revision read may expire, and
        # a not-found after that is the bucket's current state, not a lag.
        self.max_age: Callable[[str], int] = max_age or (lambda bucket: 0)

    def below(self, bucket: str, key: str, e: Entry | None) -> bool:
        """Is this answer older than one already read (a not-found after a read value, too,
        unless that value has expired since: its own TTL or the bucket's max_age)?"""
        floor = self._rev.get((bucket, key))
        if floor is None:
            return False
        if e is None:
            return not (floor[1] and time.time_ns() >= floor[1])
        return e.revision < floor[0]

    def below_revision(self, bucket: str, key: str, revision: int) -> bool:
        """Is `revision` of the key older than one already read?"""
        floor = self._rev.get((bucket, key))
        return floor is not None and revision < floor[0]

    def forget(self, bucket: str, below: int | None = None) -> None:
        """The bucket's stream was recreated (its revisions start again from 1), or purged,
        or dropped every message below `below`: those floors would make remote reads of the
        keys fail as 'behind' when not-found is the bucket's state."""
        keys = self._by_bucket.get(bucket)
        if not keys:
            return
        rev = self._rev
        gone = [key for key in keys if below is None or rev[(bucket, key)][0] < below]
        for key in gone:
            del rev[(bucket, key)]
            keys.discard(key)

    def saw(self, bucket: str, key: str, e: Entry | None) -> None:
        if e is None:
            return
        k = (bucket, key)
        if e.revision > self._rev.get(k, (0, 0))[0]:
            self._rev[k] = (e.revision, expiry(e.created, e.expires, self.max_age(bucket)))
            self._by_bucket.setdefault(bucket, set()).add(key)
        if k in self._rev:
            self._rev.move_to_end(k)
        if len(self._rev) > self._size:
            (old_bucket, old_key), _ = self._rev.popitem(last=False)
            self._by_bucket[old_bucket].discard(old_key)


class Holds:
    """Revisions of one bucket handed out from NATS that its replica has not reached. `meta`,
    in every call, is the feed's current position (its applied sequence counts only once
    synced). The common case is no hold at all (`top` 0), which every question checks first."""

    def __init__(self, on_hold: Callable[[], None] | None = None) -> None:
        # key -> the highest revision handed out ahead of the replica, and the highest of all
        # (0: none, the common case).
        self.ahead: dict[str, int] = {}
        self.top = 0
        self._overflow = False  # AHEAD_MAX reached: every key waits for `top`
        # Called when the first key is held: the server drops the GET path's cached verdicts
        # (ServerGets.forget_fresh), which would otherwise answer from the replica for a while.
        self.on_hold = on_hold

    def handed_out(self, key: str, revision: int, meta: BucketMeta) -> None:
        """An answer for `key` at `revision` (a value, or a deletion's marker) was handed out
        from NATS. A replica that has not reached it yet may lag within max_stale_ms, and its
        older record must not answer the key's next read (a strong read, then a plain one):
        until the replica reaches the revision the key is held (`held_until`). An unsynced
        replica's position says nothing (a full sync comes in subject order): every revision
        counts."""
        if revision <= meta.applied_seq and meta.synced:
            return
        opened = not self.top
        if key in self.ahead or len(self.ahead) < AHEAD_MAX:
            if revision > self.ahead.get(key, 0):
                self.ahead[key] = revision
        else:
            self._overflow = True
        if revision > self.top:
            self.top = revision
        if opened and self.on_hold is not None:
            self.on_hold()

    def held_until(self, key: str | None, revision: int | None, meta: BucketMeta) -> int:
        """0 when the replica may answer `key` without going back in time: its record's
        `revision` (None: it has none) is not below a revision of the key already handed out
        from NATS, or the replica has reached that. Else the key is held: the stream sequence
        to wait for. `key` None: is any key held (the GET fast path's question per batch)?"""
        if not self.top:
            return 0
        want = self.top if self._overflow or key is None else self.ahead.get(key, 0)
        if not want or (revision is not None and revision >= want) or (
                meta.synced and meta.applied_seq >= want):
            return 0
        return want

    def applied(self, meta: BucketMeta) -> None:
        """The replica moved to `meta`: if it reached every revision handed out ahead of it,
        no key is held now."""
        if self.top and meta.synced and meta.applied_seq >= self.top:
            self.clear()

    def clear(self) -> None:
        """Forget every hold: the replica holds them all, or their numbering is gone (a full
        sync of a stream since recreated)."""
        self.ahead.clear()
        self.top = 0
        self._overflow = False


class Witness:
    """One bucket's replica as the read decisions take its word (kvcache.store.verdict.Witness):
    its feed's freshness and position, the ledger's holds. The GET fast path's plans carry
    it (Plan.witness), and ask it once per batch (`fresh_for_all`)."""

    __slots__ = ("feed", "floors", "holds")

    def __init__(self, feed: Feed, holds: Holds, floors: Floors) -> None:
        self.feed = feed
        self.holds = holds
        self.floors = floors

    @property
    def max_age_ns(self) -> int:
        return self.feed.max_age_ns

    @property
    def cache(self) -> NearCache | None:
        return self.feed.cache

    def fresh_within(self, max_stale_ms: int) -> bool:
        """Is the replica fresh enough to answer: synced, and not staler than the bound?"""
        return self.feed.fresh_within(max_stale_ms)

    def held_until(self, key: str | None, revision: int | None = None) -> int:
        """See Holds.held_until, at the feed's position."""
        return self.holds.held_until(key, revision, self.feed.meta)

    def below(self, key: str, revision: int) -> bool:
        """Is `revision` of `key` older than one already handed out (the floors)? The near
        cache asks it of what it holds (kvcache.store.nearcache.CacheWitness)."""
        return self.floors.below_revision(self.feed.bucket, key, revision)

    def handed_out(self, key: str, revision: int) -> None:
        """An answer for `key` at `revision` went out from NATS: see Holds.handed_out."""
        self.holds.handed_out(key, revision, self.feed.meta)

    def fresh_for_all(self, max_stale_ms: int) -> bool:
        """May every key be answered locally without looking at it? The rule for every key at
        once: fresh within the bound and no key held. The GET fast path asks this alone, so
        while a key is held its GETs go to the command layer, which asks per key."""
        return replica_verdict(self, max_stale_ms, True) == LOCAL


class Ledger:
    """What one sidecar handed out (see the module docstring): the floors, each bucket's holds
    and witness, each connection's stream revisions."""

    def __init__(self, max_age: Callable[[str], int] | None = None,
                 on_hold: Callable[[], None] | None = None) -> None:
        self.floors = Floors(max_age=max_age)
        self.on_hold = on_hold  # see Holds.on_hold (set before the first bucket)
        self.holds: dict[str, Holds] = {}
        self.witnesses: dict[str, Witness] = {}
        # connection id -> bucket -> the highest revision of its stream handed out to it
        self._streams: dict[int, dict[str, int]] = {}

    def witness(self, feed: Feed) -> Witness:
        """The bucket's witness (made once, with its holds)."""
        w = self.witnesses.get(feed.bucket)
        if w is None or w.feed is not feed:
            holds = self.holds.setdefault(feed.bucket, Holds(lambda: self.on_hold and self.on_hold()))
            w = self.witnesses[feed.bucket] = Witness(feed, holds, self.floors)
        return w

    # ------------------------------------------------------------------ what the feeds report

    def applied(self, bucket: str, meta: BucketMeta) -> None:
        """A feed's replica moved to `meta`: the holds it reached end."""
        holds = self.holds.get(bucket)
        if holds is not None:
            holds.applied(meta)

    def resync_began(self, bucket: str) -> None:
        """A full sync of the bucket began: nothing is read locally until it ends, and then
        the replica holds every revision handed out before it began; those of a stream since
        recreated (lower sequences) would otherwise keep their keys held for good."""
        holds = self.holds.get(bucket)
        if holds is not None:
            holds.clear()

    def renumbered(self, bucket: str) -> None:
        """The bucket's stream was recreated or rewound: its revisions start again."""
        self.floors.forget(bucket)

    def removed(self, bucket: str, below: int | None) -> None:
        """Messages of the bucket went with no marker (below `below`, or unknown ones)."""
        self.floors.forget(bucket, below)

    # ------------------------------------------------------------------ streams

    def stream_handed(self, conn: int, bucket: str, top: int) -> None:
        """Entries of the bucket's stream up to revision `top` went to connection `conn`."""
        seen = self._streams.setdefault(conn, {})
        if top > seen.get(bucket, 0):
            seen[bucket] = top

    def stream_regressed(self, conn: int, bucket: str, last: int) -> bool:
        """Did connection `conn` already read a revision of the bucket's stream above its last
        revision now (`last`)? Said once: the entry is forgotten, so a read from 0 starts afresh."""
        seen = self._streams.get(conn)
        if seen and seen.get(bucket, 0) > last:
            del seen[bucket]
            return True
        return False

    def forget(self, conn: int) -> None:
        """The connection is gone."""
        self._streams.pop(conn, None)
