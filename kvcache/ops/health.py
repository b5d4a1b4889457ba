"""Liveness and readiness: the one rule both `kvcache health --ready` and the metrics
listener's /readyz apply.

Ready means the replica answers reads as promised: every bucket synced and within its
max_stale_ms. A replica that cannot be written (a full disk, a map at max_map_size_mb) is
behind from the last time it applied everything it had received (kvcache.feed.freshness), so
its lag grows while the feed retries: readiness turns once that passes the bound and does not
turn back at a retry; the line says why. With `ready_on_fallback` a bucket that is not
(syncing, or lagging) still counts while NATS is connected, since its reads then go to peers
or the leader: a pod that must not wait out a long first sync chooses that, at the price of
slower reads meanwhile.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple


class BucketState(NamedTuple):
    """What readiness needs of a bucket: INFO's `synced`, `lag_ms` and `max_stale_ms`, and
    `unwritable_ms` (0, or how long its replica has failed to be written: said in the line)."""

    name: str
    synced: bool
    lag_ms: int
    max_stale_ms: int
    unwritable_ms: int = 0


def _behind(b: BucketState) -> str:
    if not b.synced:
        return f"{b.name} (not synced)"
    why = f"{b.lag_ms} ms behind, max_stale_ms {b.max_stale_ms}"
    if b.unwritable_ms:
        why += f", its replica not written for {b.unwritable_ms / 1000:.1f}s: see the log"
    return f"{b.name} ({why})"


def readiness(buckets: Iterable[BucketState], nats_connected: bool,
              on_fallback: bool) -> tuple[bool, str]:
    """(ready, one line saying why)."""
    rows = list(buckets)
    behind = [_behind(b) for b in rows if not b.synced or b.lag_ms > b.max_stale_ms]
    if not behind:
        n = len(rows)
        return True, f"ready: {n} bucket{'s' if n != 1 else ''} synced and within max_stale_ms"
    if on_fallback and nats_connected:
        return True, f"ready: reads go to NATS meanwhile (ready_on_fallback): {', '.join(behind)}"
    why = ", NATS not connected" if on_fallback else ""
    return False, f"not ready: {', '.join(behind)}{why}"
