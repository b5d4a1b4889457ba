"""Prometheus metrics: the sidecar's own counters, read when Prometheus scrapes.

A prometheus_client collector over the parts that already count (Stats, the GET fast path,
the feeds, the router and its peers, the replica, the NATS connections): nothing is counted
twice and the hot path pays nothing for a metric nobody scrapes (only command latency is
timed, and only while the metrics listener is on: kvcache.latency). Each scrape walks the
parts on the event loop, between two callbacks, so every number comes from one state.

Names follow Prometheus's conventions (`_total` counters, base units: seconds and bytes) and
what comparable sidecars export (Envoy's redis proxy, the NATS exporter, client-go's
informers). Labels are bounded by the configuration: bucket, peer, stream, command and a
few fixed words; never a key. Every metric is documented in docs/metrics.md.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)

from . import __version__, native
from .feed import RECREATION_REASONS, RESYNC_REASONS
from .latency import BOUNDS_NS, Latency

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS

    from .commands import Commands
    from .config import Config
    from .readpolicy import ReadPolicy
    from .stats import Stats

# kvcache.latency's bounds as Prometheus's `le` labels (seconds), +Inf last
LE = [f"{b / 1e9:g}" for b in BOUNDS_NS] + ["+Inf"]
# kvcache_reads_total's series every bucket has from the start (others appear when counted):
# the local ones, and those the alerts' increase() must see go up from 0
INITIAL_READS = (("local", "hit"), ("local", "miss"), ("stale", "hit"), ("stale", "miss"), ("peer", "error"))


class SidecarCollector:
    """Reads the sidecar's parts at each scrape. `gets` is the server's GET fast path
    (kvcache.server_get.LocalGets or its C twin); `connections` names the NATS connections
    in use (main, and one per configured peer server set)."""

    def __init__(self, cfg: Config, stats: Stats, commands: Commands, gets,
                 connections: Callable[[], dict[str, NATS]]) -> None:
        self.cfg = cfg
        self.stats = stats
        self.commands = commands
        self.policy: ReadPolicy = commands.policy
        self.gets = gets
        self.connections = connections

    def collect(self) -> Iterator[Metric]:
        yield from self._build()
        yield from self._reads()
        yield from self._latency()
        yield from self._clients()
        yield from self._replica()
        yield from self._cache()
        yield from self._peers()
        yield from self._nats()
        yield from self._lmdb()

    # ------------------------------------------------------------------ families

    def _build(self) -> Iterator[Metric]:
        chosen = {k: v.split()[0] for k, v in native.report().items()}
        yield InfoMetricFamily("kvcache_build", "kvcache's version and the implementation serving each "
                               "native module (native or twin)",
                               value={"version": __version__, **chosen, "lmdb": native.lmdb_version()})

    def _reads(self) -> Iterator[Metric]:
        st = self.stats
        reads = CounterMetricFamily("kvcache_reads_total", "Keys read, by bucket, the source that "
                                    "answered (local, cache, peer, leader, stale) and the result "
                                    "(hit, miss, error)", labels=["bucket", "source", "result"])
        counts = dict(st.reads)
        for bucket, (found, absent) in self.gets.bucket_reads().items():
            for result, n in (("hit", found), ("miss", absent)):
                if n:
                    key = (bucket, "local", result)
                    counts[key] = counts.get(key, 0) + n
        for bucket in self.policy.feeds:  # what alerts watch exists from the start, at 0
            for series in INITIAL_READS:
                counts.setdefault((bucket, *series), 0)
        for (bucket, source, result), n in sorted(counts.items()):
            reads.add_metric([bucket, source, result], n)
        yield reads
        yield CounterMetricFamily("kvcache_commands_total", "Commands processed (the GET fast path's included)",
                                  value=st.commands)
        yield CounterMetricFamily("kvcache_remote_errors_total", "Fallback reads that failed at every "
                                  "peer and the leader", value=st.remote_errors)
        yield CounterMetricFamily("kvcache_reads_gathered_total", "GET-only socket reads of several "
                                  "clients answered together at an event-loop iteration's end",
                                  value=st.reads_gathered)
        yield CounterMetricFamily("kvcache_stream_list_requests_total", "STREAM.LIST pages asked by the "
                                  "shared stream-state poll", value=st.stream_list_requests)
        yield CounterMetricFamily("kvcache_access_log_records_total", "Lines written to the access log",
                                  value=self.commands.access.records)

    def _latency(self) -> Iterator[Metric]:
        hist = HistogramMetricFamily("kvcache_command_duration_seconds", "Time from a command's "
                                     "request to its reply, by command (kept while the metrics "
                                     "listener is on)", labels=["command"])
        timing = dict(self.commands.timing or {})
        counts, sum_ns = self.gets.latency()
        get = Latency()
        get.add(counts, sum_ns)
        if b"get" in timing:
            get.add(timing[b"get"].counts, timing[b"get"].sum_ns)
        timing[b"get"] = get
        for name, h in sorted(timing.items()):
            cumulative, buckets = 0, []
            for le, c in zip(LE, h.counts, strict=True):
                cumulative += c
                buckets.append((le, cumulative))
            hist.add_metric([name.decode(errors="replace")], buckets, h.sum_ns / 1e9)
        yield hist

    def _clients(self) -> Iterator[Metric]:
        st, cmds = self.stats, self.commands
        gauges = (
            ("kvcache_clients", "Open client connections", st.connected_clients),
            ("kvcache_max_clients", "max_clients: connections over it are refused", self.cfg.max_clients),
            ("kvcache_tracking_clients", "Connections with CLIENT TRACKING on", len(cmds.tracking.clients)),
            ("kvcache_tracking_keys", "Key names in the tracking table", len(cmds.tracking.table)),
            ("kvcache_pubsub_clients", "Connections with at least one subscription", cmds.pubsub.clients()),
        )
        for name, doc, v in gauges:
            yield GaugeMetricFamily(name, doc, value=v)
        counters = (
            ("kvcache_connections", "Connections accepted or refused", st.connections_received),
            ("kvcache_connections_rejected", "Connections refused (over max_clients, or shutting down)",
             st.rejected_connections),
            ("kvcache_clients_cut_off", "Clients disconnected for not reading their replies or pushes",
             st.clients_cut_off),
            ("kvcache_subscribers_cut_off", "Of those, over pubsub_max_output_bytes of pushed output",
             st.subscribers_cut_off),
            ("kvcache_protocol_errors", "Connections closed for malformed RESP", st.protocol_errors),
            ("kvcache_tracking_invalidations", "Invalidation messages sent to tracking clients",
             cmds.tracking.invalidations),
            ("kvcache_pubsub_messages", "Pub/sub messages delivered (one per subscriber)", cmds.pubsub.messages),
        )
        for name, doc, v in counters:
            yield CounterMetricFamily(name, doc, value=v)

    def _replica(self) -> Iterator[Metric]:
        labels = ["bucket"]
        synced = GaugeMetricFamily("kvcache_replica_synced", "1 once the replica holds every key "
                                   "(initial or full re-sync done)", labels=labels)
        keys = GaugeMetricFamily("kvcache_replica_keys", "Records in the replica", labels=labels)
        applied = GaugeMetricFamily("kvcache_replica_applied_sequence", "Last stream sequence applied",
                                    labels=labels)
        upstream = GaugeMetricFamily("kvcache_replica_upstream_sequence", "The stream's last sequence "
                                     "as last seen", labels=labels)
        lag_s = GaugeMetricFamily("kvcache_replica_lag_seconds", "How long the replica has been "
                                  "behind the stream (0 when caught up)", labels=labels)
        lag_m = GaugeMetricFamily("kvcache_replica_lag_messages", "Stream messages not yet applied",
                                  labels=labels)
        bound = GaugeMetricFamily("kvcache_replica_max_stale_seconds", "The bucket's max_stale_ms: "
                                  "the replica answers while its lag is within it", labels=labels)
        removed = CounterMetricFamily("kvcache_replica_removed_upstream", "Keys removed with no "
                                      "message to follow (expiry, limits, purges)", labels=labels)
        polls = CounterMetricFamily("kvcache_replica_state_polls", "Looks at the stream's state made "
                                    "to watch for such removals", labels=labels)
        resyncs = CounterMetricFamily("kvcache_replica_resyncs", "Full resyncs since start, by "
                                      "reason", labels=["bucket", "reason"])
        recreations = CounterMetricFamily("kvcache_consumer_recreations", "Consumers recreated since "
                                          "start, by reason", labels=["bucket", "reason"])
        replica = self.policy.replica
        for name, f in self.policy.feeds.items():
            m = f.meta
            up = max(f.upstream_seq, m.applied_seq)
            synced.add_metric([name], int(f.synced))
            keys.add_metric([name], replica.count(name))
            applied.add_metric([name], m.applied_seq)
            upstream.add_metric([name], up)
            lag_s.add_metric([name], f.lag_ms() / 1000)
            lag_m.add_metric([name], up - m.applied_seq)
            bound.add_metric([name], f.cfg.max_stale_ms / 1000)
            removed.add_metric([name], f.removed_upstream)
            polls.add_metric([name], f.state_polls)
            for reason in RESYNC_REASONS:
                resyncs.add_metric([name, reason], f.resync_reasons[reason])
            for reason in RECREATION_REASONS:
                recreations.add_metric([name, reason], f.recreations[reason])
        yield from (synced, keys, applied, upstream, lag_s, lag_m, bound, removed, polls, resyncs, recreations)

    def _cache(self) -> Iterator[Metric]:
        labels = ["bucket"]
        gauges = {"keys": GaugeMetricFamily("kvcache_cache_keys", "Keys in the bucket's near cache", labels=labels),
                  "bytes": GaugeMetricFamily("kvcache_cache_bytes", "Bytes the near cache holds (keys, "
                                             "records and 64 bytes of bookkeeping each)", labels=labels)}
        docs = {"hits": "Reads of keys outside the filters the near cache answered",
                "misses": "Reads of keys outside the filters it did not",
                "admissions": "Answers from NATS taken in",
                "rejections": "Answers refused as colder than the key they would evict",
                "evictions": "Keys evicted to make room",
                "invalidations": "Keys dropped because the bucket changed them"}
        counters = {k: CounterMetricFamily(f"kvcache_cache_{k}", doc, labels=labels) for k, doc in docs.items()}
        for name, f in self.policy.feeds.items():
            c = f.cache
            if c is None:
                continue
            gauges["keys"].add_metric([name], len(c))
            gauges["bytes"].add_metric([name], c.bytes)
            for k, fam in counters.items():
                fam.add_metric([name], getattr(c.stats, k))
        yield from gauges.values()
        yield from counters.values()

    def _peers(self) -> Iterator[Metric]:
        router = self.policy.router
        labels = ["peer", "bucket", "stream"]
        up = GaugeMetricFamily("kvcache_peer_up", "1 while the router may send the peer reads "
                               "(0: ejected after errors, or its connection is down)", labels=labels)
        ewma = GaugeMetricFamily("kvcache_peer_latency_ewma_seconds", "The router's latency estimate "
                                 "for the peer", labels=labels)
        inflight = GaugeMetricFamily("kvcache_peer_inflight_requests", "Requests sent to the peer and "
                                     "not yet answered", labels=labels)
        counters = {k: CounterMetricFamily(f"kvcache_peer_{k}", doc, labels=labels) for k, doc in (
            ("requests", "Direct Get (or leader) requests sent to the peer"),
            ("errors", "Of those, failed (errors and timeouts)"),
            ("hedges", "Hedged second requests sent to the peer"),
            ("hedges_won", "Hedged requests whose answer came first"),
            ("ejections", "Times the router ejected the peer"))}
        for p in router.peers():
            lv = [p.name, p.bucket, p.stream]
            up.add_metric(lv, int(router.state(p) == "up"))
            ewma.add_metric(lv, p.stats.ewma_us / 1e6)
            inflight.add_metric(lv, p.inflight)
            for k, fam in counters.items():
                fam.add_metric(lv, getattr(p.stats, k))
        yield from (up, ewma, inflight, *counters.values())
        yield CounterMetricFamily("kvcache_routed_requests", "Fallback reads routed to peers", value=router.requests)

    def _nats(self) -> Iterator[Metric]:
        connected = GaugeMetricFamily("kvcache_nats_connected", "1 while the NATS connection is up",
                                      labels=["connection"])
        reconnects = CounterMetricFamily("kvcache_nats_reconnects", "Reconnections of the NATS connection",
                                         labels=["connection"])
        for name, nc in sorted(self.connections().items()):
            connected.add_metric([name], int(nc.is_connected))
            reconnects.add_metric([name], nc.stats.get("reconnects", 0))
        yield connected
        yield reconnects

    def _lmdb(self) -> Iterator[Metric]:
        map_size, used = self.policy.replica.usage()
        yield GaugeMetricFamily("kvcache_lmdb_map_size_bytes", "The replica's LMDB map size (grows as "
                                "needed)", value=map_size)
        yield GaugeMetricFamily("kvcache_lmdb_used_bytes", "Bytes of the map in use (pages up to the "
                                "last one written)", value=used)
        yield GaugeMetricFamily("kvcache_lmdb_max_map_size_bytes", "max_map_size_mb: the most the map "
                                "may grow to", value=self.cfg.max_map_size_mb << 20)


def registry(collector: SidecarCollector) -> CollectorRegistry:
    """The sidecar's registry: its own collector, plus the process (CPU, memory, file
    descriptors) and Python platform collectors every Prometheus client library exports."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector)
    ProcessCollector(registry=reg)
    PlatformCollector(registry=reg)
    return reg
