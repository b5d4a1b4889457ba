"""May the replica answer a key? The one rule, for every path that reads the replica.

    v = replica_verdict(witness, bound_ms, replicated, key, record, revision_of)
    LOCAL (0): the replica's record answers (None: the key is absent)
    v > 0:     the key is *held*: a newer revision of it was handed out from NATS, and the
               replica answers only once it has applied stream sequence v
    STALE:     the replica is not fresh within the bound (NATS answers, or serve_stale)
    OUTSIDE:   the key is outside its bucket's filters (the near cache, or NATS)

Three facts, asked in this order and each once: is the replica fresh within the bound the read
allows (`witness.fresh_within`: synced and current enough), is the key replicated (inside its
bucket's `keys` filters), and is it held (`witness.held_until`: the oldest sequence the
replica must reach before its record may answer `key`; `key` None asks for every key at once,
which is the GET fast path's per-batch question). The record's revision is looked at only for
a held key (`revision_of(record, witness)`), so the common case reads no header.

Who asks, each with its own witness:
- the sidecar's read policy (kvcache.read.policy.ReadPolicy.route), per key, for the command
  layer's reads (GET on the generic path, KV.GET, MGET, EXISTS, TTL and kin); its witness is
  the bucket's feed (freshness) with the read ledger's holds (kvcache.read.ledger);
- the server's GET fast path (kvcache.serve.server_get and ext/server_get.pyx), once per batch and
  bucket through `Witness.fresh_for_all` (kvcache.read.ledger) (this rule with `key` None), the keys being planned
  onto the replica only when replicated (ReadPolicy.plan);
- LocalReader (kvcache.app.reader), in an application's process, whose witness is the meta
  record the sidecar writes (store.replica.meta_fresh) and which sees no holds (they live in
  the sidecar's memory; its reads are never held).

Here, in store/, because all three may import it (the application side imports nothing of
read/ or feed/: tests/test_layout.py).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from .record import RECORD, deadline

LOCAL = 0
STALE = -1
OUTSIDE = -2


class Witness(Protocol):
    """What vouches for one bucket's replica to a reader."""

    @property
    def max_age_ns(self) -> int:
        """The bucket's max_age (0: none): a stored record's deadline counts it."""
        ...

    def fresh_within(self, max_stale_ms: int) -> bool:
        """Synced, and no staler than the bound?"""
        ...

    def held_until(self, key: str | None, revision: int | None = None) -> int:
        """0, or the stream sequence the replica must reach before its record of `key` (at
        `revision`; None: no record) answers it; `key` None: any key held."""
        ...


def record_revision(record: Any, witness: Witness) -> int | None:
    """The revision of a decoded record (kvcache.store.record.Record, expired ones already
    None)."""
    return record.revision


def stored_revision(raw: Any, witness: Witness) -> int | None:
    """The revision of a record as stored (bytes or a memoryview into the map); None when it
    has passed its deadline (its own TTL, or the bucket's max_age): absent."""
    due = deadline(raw, witness.max_age_ns)
    if due and time.time_ns() >= due:
        return None
    return RECORD.unpack_from(raw)[0]


def replica_verdict(witness: Witness, bound_ms: int, replicated: bool, key: str | None = None,
                    record: Any = None,
                    revision_of: Callable[[Any, Witness], int | None] = record_revision) -> int:
    """The verdict (see the module docstring): LOCAL, a held sequence, STALE or OUTSIDE."""
    if not witness.fresh_within(bound_ms):
        return STALE
    if not replicated:
        return OUTSIDE
    want = witness.held_until(key)
    if want and record is not None:
        revision = revision_of(record, witness)
        if revision is not None and revision >= want:
            return LOCAL  # its record is already at the revision handed out
    return want
