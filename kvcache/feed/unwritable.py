"""A replica its feed cannot write: since when, how many tries, and what the log says.

A write that fails (a full disk: LMDB's "No space left on device" or "Input/output error"; a
map that may not grow past max_map_size_mb; any other LMDB error) leaves the feed where it
was, and the next consumer delivers the same batch again, every few seconds (the feed's
backoff), until a write succeeds. Meanwhile the replica is known current only as of the last
time it applied everything it had received (kvcache.feed.freshness): its reads go to NATS
once that is older than max_stale_ms, and readiness says not ready.

A line per retry (the feed logged one) buried the state in its own noise: it is logged when
it begins, at most once a REMIND_S while it lasts, and when it ends, once a write succeeds
with nothing received left unapplied (the backlog applied).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("kvcache.feed")

# While the replica stays unwritable, its state is logged again this often (with the tries).
REMIND_S = 60.0


class Unwritable:
    """One feed's failed writes. `failed(error)` for each, `written()` once a write succeeded
    and the feed holds everything it received; `ms()` is how long it has been unwritable."""

    def __init__(self, bucket: str, clock: Callable[[], int] = time.time_ns) -> None:
        self.bucket = bucket
        self.clock = clock
        self.since_ns = 0  # when the first failed write of this spell was seen; 0: writable
        self.tries = 0     # failed writes in this spell
        self.error = ""    # the last one's message
        self._said_ns = 0  # when the state was last logged
        self._last: BaseException | None = None  # counted once, wherever it is seen

    def ms(self) -> int:
        """How long the replica has been unwritable (0: it is not)."""
        return max(0, (self.clock() - self.since_ns) // 1_000_000) if self.since_ns else 0

    def failed(self, error: BaseException) -> None:
        """A write failed and will be retried: one line when the spell begins, then one per
        REMIND_S. The same error seen again (where it was raised, then where it was caught)
        counts once."""
        if error is self._last:
            return
        self._last = error
        now = self.clock()
        self.tries += 1
        self.error = str(error)
        if not self.since_ns:
            self.since_ns = self._said_ns = now
            log.error("bucket %s: cannot write the replica: %s; retrying until a write succeeds "
                      "(reads go to NATS once the replica is max_stale_ms behind)", self.bucket, error)
        elif now - self._said_ns >= REMIND_S * 1e9:
            self._said_ns = now
            log.error("bucket %s: still cannot write the replica after %.0fs (%d tries): %s",
                      self.bucket, (now - self.since_ns) / 1e9, self.tries, error)
        else:
            log.debug("bucket %s: replica write failed again (try %d): %s", self.bucket, self.tries, error)

    def written(self) -> None:
        """A write succeeded and nothing received is left unapplied: the spell, if any, ends."""
        if not self.since_ns:
            return
        log.warning("bucket %s: replica written again: the backlog is applied after %.1fs "
                    "unwritable (%d failed tries)", self.bucket, (self.clock() - self.since_ns) / 1e9,
                    self.tries)
        self.since_ns = self.tries = 0
        self.error = ""
        self._last = None
