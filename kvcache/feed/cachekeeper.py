"""The feed's side of the near cache: what keeps cached keys outside the filters true.

A bucket with a near cache (kvcache.store.nearcache) has its feed consume the whole bucket, not
only the replicated filters. Each batch is then split: keys inside the filters (and every
delete, since a long key's digest does not say where it belongs) go to the replica; a change
outside them replaces the cached key's record, in stream order (NearCache.refresh: a delete or
purge becomes a cached not-found), and is a change for the hub's listeners all the same. So a
write of a hot cached key sends no reader to NATS: the next read finds the new value.
A delete carries no sequence of its own; its cached not-found takes one more than the
sequence of the message delivered just before it, a lower bound of its own: no message of
the key can lie between the two, since the consumer reads every subject of the bucket.

A fallback read's answer fills the cache later than the read was sent, so a change the feed
applied meanwhile would be overwritten by the older answer. The keeper remembers the changes
outside the filters for as long as a read can be on its way (the request timeout, twice, and
a margin) and refuses a fill older than one of them (`fill_ok`).

`CacheKeeper` is one feed's (kvcache.feed.feed.Feed composes it when set_cache gives it a
cache). Kept apart from the consumer loop, which hands it each batch and asks nothing else.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict

from ..config import BucketConfig
from ..store.nearcache import NearCache
from ..store.record import LONG_KEY_PREFIX, RECORD, Item, decode_key
from .changes import Change

log = logging.getLogger("kvcache.feed")

# Keys outside the filters changed recently (the fill guard, CacheKeeper.fill_ok): kept this
# long beyond the request timeout, at most this many (past it, no fill for that long).
RECENT_MARGIN_S = 1.0
RECENT_MAX = 100_000


class CacheKeeper:
    """Keeps one bucket's near cache true from its feed's batches (see the module docstring)."""

    def __init__(self, cfg: BucketConfig, cache: NearCache, timeout: float) -> None:
        self.cfg = cfg
        self.cache = cache
        self.timeout = timeout
        # key -> (its newest change's sequence, when it was seen), oldest first
        self._recent: OrderedDict[bytes, tuple[int, float]] = OrderedDict()
        self._full_until = 0.0  # RECENT_MAX was passed: no fill until then

    def split(self, items: list[Item], seq: int, after: int) -> tuple[list[Item], list[Change]]:
        """A batch at `seq` (its top sequence) delivered after sequence `after` (the feed's
        position before it): the items for the replica (keys inside the filters, and every
        delete: a long key's digest does not say where it belongs), and the changes outside
        the filters, which refresh the cache (and are noted for the fill guard)."""
        keep: list[Item] = []
        outside: list[bytes] = []
        seqs: list[int] = []
        changes: list[Change] = []
        updates: list[tuple[bytes, bytes | None, int]] = []
        last = after  # the sequence of the message delivered last
        for lk, rec in items:
            if rec is None:
                keep.append((lk, rec))
                outside.append(lk)
                seqs.append(seq)  # the fill guard: the batch's top, which is at or above it
                updates.append((lk, None, last + 1))
                if not lk.startswith(LONG_KEY_PREFIX):
                    key = lk.decode()
                    if not self.cfg.replicates(key):
                        changes.append((key, "del"))
                continue
            revision = RECORD.unpack_from(rec)[0]
            last = max(last, revision)
            key = decode_key(lk, rec)
            if self.cfg.replicates(key):
                keep.append((lk, rec))
            else:
                outside.append(lk)
                seqs.append(revision)
                updates.append((lk, rec, revision))
                changes.append((key, "set"))
        if outside:
            self._note_recent(outside, seqs)
            self.cache.refresh(updates)
        return keep, changes

    def _note_recent(self, lkeys: list[bytes], seqs: list[int]) -> None:
        now = time.monotonic()
        recent = self._recent
        for lk, seq in zip(lkeys, seqs, strict=True):
            if seq > recent.get(lk, (0, 0.0))[0]:
                recent[lk] = (seq, now)
                recent.move_to_end(lk)
        horizon = now - self.timeout * 2 - RECENT_MARGIN_S
        while recent:
            first = next(iter(recent.values()))
            if first[1] >= horizon:
                break
            recent.popitem(last=False)
        if len(recent) > RECENT_MAX:  # too many to remember: no fills for a while instead
            recent.clear()
            self._full_until = now + self.timeout * 2 + RECENT_MARGIN_S

    def fill_ok(self, lkey: bytes, revision: int) -> bool:
        """Saw the feed no newer change of `lkey` than `revision` while a read was on its way?
        (A change it sees later invalidates the record as usual.) Whether the feed vouches
        for the bucket at all is Feed.fill_ok's question."""
        if time.monotonic() < self._full_until:
            return False
        seen = self._recent.get(lkey)
        return seen is None or seen[0] <= revision

    def clear(self, why: str) -> None:
        """Empty the cache: the feed can no longer tell which of its keys changed."""
        if len(self.cache):
            log.info("bucket %s: near cache cleared (%d keys): %s", self.cfg.name, self.cache.clear(), why)
