"""Command latency histograms: the bounds, and the counts a command's time falls into.

Counted only while the metrics listener is on (Config.metrics_listen): kvcache.serve.commands
times what dispatch answers, the GET fast path (kvcache.serve.server_get and its C twin) times each
socket read it answers whole, counting its time once per GET in it (every reply of the read
goes out in the same write). kvcache.ops.metrics turns the counts into Prometheus histograms at
scrape time, so an observation costs two clock reads and an increment, never a lock.
"""
from __future__ import annotations

from bisect import bisect_left

# Upper bounds (ns, inclusive) from 10 µs: the replica answers a GET in a few µs, a Direct Get
# takes a few hundred µs to ms, a request timeout several seconds. The C twin copies these.
BOUNDS_NS: tuple[int, ...] = (
    10_000, 25_000, 50_000, 100_000, 250_000, 500_000,
    1_000_000, 2_500_000, 5_000_000, 10_000_000, 25_000_000, 50_000_000,
    100_000_000, 250_000_000, 500_000_000, 1_000_000_000, 2_500_000_000, 5_000_000_000,
)


class Latency:
    """One command's histogram: counts per bucket (not cumulative; the last is +Inf) and the
    sum of the times observed, ns."""

    __slots__ = ("counts", "sum_ns")

    def __init__(self) -> None:
        self.counts = [0] * (len(BOUNDS_NS) + 1)
        self.sum_ns = 0

    def observe(self, ns: int, n: int = 1) -> None:
        """n commands that took ns each."""
        self.counts[bisect_left(BOUNDS_NS, ns)] += n
        self.sum_ns += ns * n

    def add(self, counts: list[int], sum_ns: int) -> None:
        """Fold in another histogram's counts (the GET fast path's, for `get`)."""
        for i, c in enumerate(counts):
            self.counts[i] += c
        self.sum_ns += sum_ns
