"""INFO: the sidecar's state as Redis-style `# Section` / `field:value` text.

Assembled here from the narrow parts that hold the numbers (the shared Stats, the replica,
the feeds, the router, the access log), so that the command table only parses
INFO's arguments. Every field is documented in docs/info.md.
"""
from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from .. import __version__, native

if TYPE_CHECKING:
    from ..config import Config
    from ..feed.feed import Feed
    from ..feed.relay import RelayElection
    from ..ops.accesslog import AccessLog
    from ..read.router import Router
    from ..stats import Stats, WorkerTotals
    from ..store.replica import Replica
    from .pubsub import PubSub
    from .streams import Streams
    from .tracking import Tracking

DEFAULT_SECTIONS = frozenset({"server", "clients", "stats", "replication", "buckets", "peers"})
# The Redis version kvcache answers as: INFO's redis_version, and HELLO's version with
# compat_identity (client-side caches ask for 7.4: redis-py, Jedis)
REDIS_VERSION = "7.4.0"


# `# Replication` as redis-server 7.x prints it for a master with no replicas (field names and
# order: server.c, genRedisInfoString). kvcache is a replica of NATS, not of a Redis: no Redis
# replicates from it and it from none, so to a Redis client it is a master with no replicas,
# which is what clients that look (valkey-glide asks INFO REPLICATION at connect for
# `role:master`) must read. Values: docs/info.md.
NO_REPLID = "0" * 40


def _replication(replid: str) -> list[tuple[str, object]]:
    return [
        ("role", "master"), ("connected_slaves", 0), ("master_failover_state", "no-failover"),
        ("master_replid", replid), ("master_replid2", NO_REPLID), ("master_repl_offset", 0),
        ("second_repl_offset", -1), ("repl_backlog_active", 0), ("repl_backlog_size", 0),
        ("repl_backlog_first_byte_offset", 0), ("repl_backlog_histlen", 0),
    ]


class Info:
    """Builds INFO's text on demand (nothing is computed between INFO calls)."""

    def __init__(self, cfg: Config, stats: Stats, replica: Replica, feeds: dict[str, Feed], router: Router,
                 access: AccessLog,
                 tracking: Tracking | None = None, pubsub: PubSub | None = None,
                 fast_cache_reads: Callable[[], dict[str, tuple[int, int]]] | None = None,
                 streams: Streams | None = None) -> None:
        self.cfg = cfg
        self.streams = streams
        self.stats = stats
        self.replica = replica
        self.feeds = feeds
        self.router = router
        self.access = access
        self.tracking = tracking
        self.pubsub = pubsub
        # The near caches' hits the GET fast path answered (ServerGets.cache_reads): it counts
        # them itself, INFO adds them to each cache's own
        self.fast_cache_reads = fast_cache_reads or dict
        # As Redis makes one at start: 40 random hex digits, new with every process
        self.replid = os.urandom(20).hex()
        # workers > 1: their counters (kvcache.supervisors.workers.Workers.totals), added to
        # this process's; None: no workers
        self.workers: Callable[[], WorkerTotals] | None = None
        self.refresh: Callable[[], Awaitable[None]] | None = None  # their counters written now
        self.relays: RelayElection | None = None  # the fleet's relays this sidecar stands for

    def sections(self) -> dict[str, list[tuple[str, object]]]:
        st, cfg, router = self.stats, self.cfg, self.router
        fast = self.fast_cache_reads()
        workers = self.workers() if self.workers is not None else None
        w = workers.total if workers is not None else {}
        now = time.time_ns()
        return {
            "server": [
                ("kvcache_version", __version__), ("redis_version", REDIS_VERSION),
                ("process_id", os.getpid()), ("uptime_in_seconds", int(time.time() - st.started)),
                ("socket", cfg.socket_path), ("listen", st.listen), ("nats_url", st.nats_url),
                ("embedded_nats", int(st.embedded_nats)),
                ("nats_connected", int(st.nats_connected)),
                ("nats_server_moves", st.server_moves),
                ("nats_last_move_ms", st.nats_last_move_ms),
                ("metrics_listen", st.metrics_listen),
                ("ready_on_fallback", int(cfg.ready_on_fallback)),
                ("native", ",".join(f"{k}={v.split()[0]}" for k, v in native.report().items())),
                ("native_lmdb", native.lmdb_version()),
                ("default_bucket", cfg.default_bucket or ""),
            ],
            "clients": [
                ("connected_clients", st.connected_clients),
                ("maxclients", cfg.max_clients),
                ("rejected_connections", st.rejected_connections + w.get("rejected_connections", 0)),
                ("clients_cut_off", st.clients_cut_off + w.get("clients_cut_off", 0)),
                ("subscribers_cut_off", st.subscribers_cut_off),
                ("tracking_clients", len(self.tracking.clients) if self.tracking else 0),
                ("pubsub_clients", self.pubsub.clients() if self.pubsub else 0),
                ("blocked_clients", self.streams.blocked if self.streams else 0),
            ],
            "stats": [
                ("gets_local", st.gets_local + w.get("gets_local", 0)), ("gets_cached", st.gets_cached),
                ("gets_remote", st.gets_remote),
                ("gets_notfound", st.gets_notfound + w.get("gets_notfound", 0)), ("remote_errors", st.remote_errors),
                ("gets_stale", st.gets_stale), ("reads_gathered", st.reads_gathered + w.get("reads_gathered", 0)),
                ("reads_coalesced", st.reads_coalesced),
                ("stream_list_requests", st.stream_list_requests),
                ("stream_entries_sent", self.streams.entries_sent if self.streams else 0),
                ("total_commands_processed", st.commands + w.get("commands", 0)),
                ("total_connections_received", st.connections_received),
                ("protocol_errors", st.protocol_errors + w.get("protocol_errors", 0)),
                ("access_log_records", self.access.records),
                *(self.tracking.info() if self.tracking else []),
                *(self.pubsub.info() if self.pubsub else []),
                ("notify_keyspace_events", self.pubsub.flags if self.pubsub else ""),
            ],
            "replication": _replication(self.replid),
            "buckets": [(name, _fields(
                synced=int(f.synced), keys=self.replica.count(name), applied_seq=f.meta.applied_seq,
                upstream_seq=max(f.upstream_seq, f.meta.applied_seq), lag_ms=f.lag_ms(),
                max_stale_ms=f.cfg.max_stale_ms, unwritable_ms=f.unwritable_ms(),
                resyncs=f.meta.resyncs, removed_upstream=f.removed_upstream,
                state_polls=f.state_polls, state_shared=f.state_shared, follow=f.follow_mode,
                gaps_filled=f.gaps_filled, gap_fill_messages=f.gap_fill_messages,
                gap_fill_ms=int(f.gap_fill_seconds * 1000), gap_fill_skips=f.skips_pinned,
                **_cache_fields(f, fast.get(name, (0, 0))), **_relay_fields(self.relays, name)))
                for name, f in self.feeds.items()],
            "peers": [(p.label, _fields(
                stream=p.stream, state=router.state(p), ewma_us=int(p.stats.ewma_us),
                requests=p.stats.requests, errors=p.stats.errors, hedges=p.stats.hedges))
                for p in router.peers()],
            "routing": router.info_rows(),
            "workers": [("workers", cfg.workers), *((f"worker{i}", _fields(
                pid=e["pid"], clients=e["clients"], commands=e["commands"], gets_local=e["gets_local"],
                gets_notfound=e["gets_notfound"], connections_received=e["connections_received"],
                reported_ms_ago=(now - e["written_ns"]) // 1_000_000 if e["written_ns"] else -1))
                for i, e in enumerate(workers.each if workers is not None else []))],
        }

    def text(self, wanted: set[str]) -> str:
        """The sections asked for (none or `default`: the default ones; `all`/`everything`:
        every one), as INFO's reply text."""
        sections = self.sections()
        show: set[str] | frozenset[str] = DEFAULT_SECTIONS if not wanted or "default" in wanted else wanted
        if wanted & {"all", "everything"}:
            show = set(sections)
        lines: list[str] = []
        for name, items in sections.items():
            if name not in show:
                continue
            lines.append(f"# {name.capitalize()}")
            lines += [f"{k}:{v}" for k, v in items]
            lines.append("")
        return "\r\n".join(lines)


def _relay_fields(relays: RelayElection | None, bucket: str) -> dict[str, int]:
    """The bucket's fleet relay (kvcache.feed.relay), when this sidecar stands for it."""
    n = relays.numbers(bucket) if relays is not None else None
    if n is None:
        return {}
    return {"relaying": n.relaying, "relayed": n.relayed, "relay_lag": n.lag, "relay_role_changes": n.role_changes}


def _cache_fields(feed, fast: tuple[int, int]) -> dict[str, int]:
    """A bucket's near cache, when it has one (kvcache.store.nearcache); `fast`: the hits (of
    values, of not-founds) the GET fast path answered from it."""
    c = feed.cache
    if c is None:
        return {}
    st = c.stats
    return {"cache_keys": len(c), "cache_bytes": c.bytes, "cache_hits": st.hits + sum(fast),
            "cache_misses": st.misses, "cache_admissions": st.admissions,
            "cache_rejections": st.rejections, "cache_evictions": st.evictions,
            "cache_invalidations": st.invalidations, "cache_updates": st.updates}


def _fields(**kv: object) -> str:
    return ",".join(f"{k}={v}" for k, v in kv.items())
