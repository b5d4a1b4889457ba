"""The shared counters: what the NATS connections, the feeds, the reads, the server and the
command layer count, and INFO and the metrics read.

One plain object, written in place on the hot path (an attribute increment, no lock: the
sidecar runs on one event loop), read by INFO and at a metrics scrape. In the bottom layer
(docs/architecture.md, Where it lives): every side counts into it, so it imports nothing of
kvcache, and the sides depend on it and not on each other.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Stats:
    """What the sidecar counts (INFO's `stats` and `clients` sections) and the facts about
    the process that INFO shows beside them."""

    gets_local: int = 0
    gets_remote: int = 0
    gets_cached: int = 0  # answered by a bucket's near cache (keys outside its filters)
    gets_notfound: int = 0
    remote_errors: int = 0
    gets_stale: int = 0  # answered from a stale replica (serve_stale) after a failed remote read
    stream_list_requests: int = 0  # STREAM.LIST pages asked by the shared state poll (statepoll)
    reads_gathered: int = 0  # GET-only reads answered together at an event-loop iteration's end
    reads_coalesced: int = 0  # reads that took a request to NATS in flight for the key (read.flights)
    commands: int = 0
    connections_received: int = 0
    connected_clients: int = 0
    rejected_connections: int = 0
    protocol_errors: int = 0
    clients_cut_off: int = 0  # read none of their queued replies for client_write_stall_ms
    subscribers_cut_off: int = 0  # of those, over pubsub_max_output_bytes of pushed messages
    started: float = field(default_factory=time.time)
    listen: str = ""  # the TCP listener's address once bound ("" without one)
    nats_url: str = ""  # the server the sidecar's own connection reached
    embedded_nats: bool = False  # the sidecar runs its own nats-server
    server_moves: int = 0  # moves off a server that showed no quorum (Upstream.leave_servers_without_quorum)
    nats_connected: bool = False  # the sidecar's own NATS connection is up (readiness, metrics)
    nats_last_move_ms: int = 0  # the latest reconnect: from leaving a server to connected again
    metrics_listen: str = ""  # the metrics listener's address once bound ("" without one)
    # Keys read by the command layer, by (bucket, source, result): source local, cache, peer,
    # leader or stale; result hit, miss or error (the command failed: no NATS answer and no
    # stale replica to give). The GET fast path counts its own (ServerGets.bucket_reads);
    # kvcache.ops.metrics adds the two at scrape time.
    reads: dict[tuple[str, str, str], int] = field(default_factory=dict)

    def read(self, bucket: str, source: str, found: bool, n: int = 1) -> None:
        """Count n keys answered (found or absent) by `source`."""
        key = (bucket, source, "hit" if found else "miss")
        self.reads[key] = self.reads.get(key, 0) + n

    def read_failed(self, bucket: str, n: int = 1) -> None:
        """Count n keys whose read failed outright (the command answered an error)."""
        key = (bucket, "peer", "error")
        self.reads[key] = self.reads.get(key, 0) + n


@dataclass
class WorkerTotals:
    """What the worker processes counted (kvcache.supervisors.workers.Workers.totals): INFO and
    /metrics add it to this process's."""

    total: dict[str, int]                   # WORKER_FIELDS summed (but pid and written_ns)
    each: list[dict[str, int]]              # per worker, as on the board
    reads: dict[str, tuple[int, int]]       # GETs per bucket, (found, not found), summed
