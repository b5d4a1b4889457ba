"""The read decisions of a bucket's stream (`@<bucket>`, kvcache.serve.streams encodes them),
beside the point reads' (kvcache.read.policy) and on the same ledger (kvcache.read.ledger).
A filtered stream (`@<bucket>:<filter>`) reads the same index and its IDs are the same
revisions, so it follows the same rules, on the bucket's entry in the ledger:

- **vouched**: the bucket's replica must be synced and fresh within its max_stale_ms, else the
  read is an error saying which (there is no other copy of the index to fall back on);
- **never older than what this connection already read**: a stream whose last revision fell
  below one it handed out (the bucket was recreated) is an error until the reader starts
  again from 0 (`Ledger.stream_regressed`, `Ledger.stream_handed`);
- **no silent gap** (`exact_after`): an ID below the replica's horizon (BucketMeta.horizon: its
  last full sync began there, and what the stream dropped before may have left no entry) is an
  error that says to read from 0; so is an ID past the bucket's last revision.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import CommandError

if TYPE_CHECKING:
    from ..config import BucketConfig
    from ..feed.feed import Feed
    from .ledger import Ledger


def vouch(ledger: Ledger, conn: int, bc: BucketConfig, feed: Feed) -> None:
    """May the bucket's index answer connection `conn` now? CommandError saying why not."""
    if not feed.synced:
        raise CommandError(f"ERR bucket {bc.name}: replica not synced yet: its stream cannot be read")
    if not feed.fresh_within(bc.max_stale_ms):
        raise CommandError(f"ERR bucket {bc.name}: replica stale ({feed.lag_ms() / 1000:.1f}s behind, "
                           f"max_stale_ms {bc.max_stale_ms}): its stream cannot be read")
    last = feed.meta.applied_seq
    if ledger.stream_regressed(conn, bc.name, last):  # said once: a read from 0 starts afresh
        raise CommandError(f"ERR bucket {bc.name}: its last revision {last} is below "
                           "one this connection already read (the bucket was recreated): read from 0")


def exact_after(bc: BucketConfig, horizon: int, last: int, after: int, given: bytes | None = None) -> None:
    """Can "what changed after `after`" be answered exactly by an index exact after `horizon`,
    whose last revision is `last`? CommandError saying why not. `given`: the range's start as
    the client wrote it (XRANGE: `after` is one below it), named in the error instead."""
    if 0 < after < horizon:
        raise CommandError(f"ERR bucket {bc.name}: changes after revision {after} are no longer known "
                           f"exactly (the replica's index starts after revision {horizon}, where its last "
                           "full sync began): read from 0 for a full listing")
    if after > last:
        what = (f"start {given.decode(errors='replace')[:64]} is past its next revision {last + 1}"
                if given is not None else f"revision {after} is past its last revision {last}")
        raise CommandError(f"ERR bucket {bc.name}: {what} (was the bucket recreated?): read from 0")
