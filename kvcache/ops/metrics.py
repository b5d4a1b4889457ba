"""Prometheus metrics: the sidecar's own counters, read when Prometheus scrapes.

Nothing is counted for the metrics (command latency aside, kvcache.ops.latency): a scrape reads
the parts that already count (Stats, the GET fast path, the feeds, the router and its peers,
the replica, the NATS connections). It does so in two steps, because a sidecar with 1,000
buckets exports some 25,000 series (1.6 MB) and formatting them takes longer than a read
may wait:

- `SidecarCollector.snapshot()` copies the numbers between two callbacks of the event loop
  (so every number comes from one state and no lock is needed): plain tuples;
- `exposition(snapshot, accept)` builds each metric family from the copy only when its turn
  comes and formats it at most CHUNK samples at a time, giving the loop back in between.
  (A worker thread would not spare the loop: formatting is Python code, and the thread
  would hold the GIL the loop needs.)

Names follow Prometheus's conventions (`_total` counters, base units: seconds and bytes) and
what comparable sidecars export (Envoy's redis proxy, the NATS exporter, client-go's
informers). Labels are bounded by the configuration: bucket, peer, stream, command and a few
fixed words; never a key. Every metric is documented in docs/metrics.md.
"""
from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from dataclasses import dataclass, field
from operator import itemgetter
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder

from .. import __version__, native
from ..feed.feed import RECREATION_REASONS, RESYNC_REASONS
from ..feed.follow import FOLLOW_END_REASONS
from .latency import BOUNDS_NS, Latency

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS

    from ..config import Config
    from ..feed.feed import Feed
    from ..feed.relay import RelayElection
    from ..stats import Stats, WorkerTotals
    from ..store.replica import Replica
    from .accesslog import AccessLog

# Samples formatted between two returns to the event loop: with 1,000 buckets a family has
# up to 4,000, and formatting them in one go held the loop 20-40 ms (bench/README.md, Metrics)
CHUNK = 500
T = TypeVar("T")
EOF = b"# EOF\n"  # OpenMetrics ends the whole exposition with it: once, at the end
# kvcache.ops.latency's bounds as Prometheus's `le` labels (seconds), +Inf last
LE = [f"{b / 1e9:g}" for b in BOUNDS_NS] + ["+Inf"]
# kvcache_reads_total's series every bucket has from the start (others appear when counted):
# the local ones, and the stale ones an alert's increase() must see go up from 0
INITIAL_READS = (("local", "hit"), ("local", "miss"), ("stale", "hit"), ("stale", "miss"))
CACHE_COUNTERS = (
    ("hits", "Reads of keys outside the filters the near cache answered"),
    ("misses", "Reads of keys outside the filters it did not"),
    ("admissions", "Answers from NATS taken in"),
    ("rejections", "Answers refused as colder than the key they would evict"),
    ("evictions", "Keys evicted to make room"),
    ("invalidations", "Keys dropped (a purge, limits, expiry, a resync, a contradicting answer)"),
    ("updates", "Cached keys the bucket's feed replaced with their new value or a not-found"))
PEER_COUNTERS = (
    ("requests", "Direct Get (or leader) requests sent to the peer"),
    ("errors", "Of those, failed (errors and timeouts)"),
    ("hedges", "Hedged second requests sent to the peer"),
    ("hedges_won", "Hedged requests whose answer came first"),
    ("ejections", "Times the router ejected the peer"))
CLIENT_GAUGES = (
    ("kvcache_clients", "Open client connections"),
    ("kvcache_max_clients", "max_clients: connections over it are refused"),
    ("kvcache_tracking_clients", "Connections with CLIENT TRACKING on"),
    ("kvcache_tracking_keys", "Key names in the tracking table"),
    ("kvcache_pubsub_clients", "Connections with at least one subscription"))
COUNTERS = (  # name (without _total), help
    ("kvcache_commands", "Commands processed (the GET fast path's included)"),
    ("kvcache_remote_errors", "Fallback reads that failed at every peer and the leader"),
    ("kvcache_reads_gathered", "GET-only socket reads of several clients answered together"),
    ("kvcache_reads_coalesced", "Reads that joined a request to NATS in flight for their key"),
    ("kvcache_stream_list_requests", "STREAM.LIST pages asked by the shared stream-state poll"),
    ("kvcache_access_log_records", "Lines written to the access log"),
    ("kvcache_connections", "Connections accepted or refused"),
    ("kvcache_connections_rejected", "Connections refused (over max_clients, or shutting down)"),
    ("kvcache_clients_cut_off", "Clients disconnected for not reading their replies or pushes"),
    ("kvcache_subscribers_cut_off", "Of those, over pubsub_max_output_bytes of pushed output"),
    ("kvcache_protocol_errors", "Connections closed for malformed RESP"),
    ("kvcache_tracking_invalidations", "Invalidation messages sent to tracking clients"),
    ("kvcache_pubsub_messages", "Pub/sub messages delivered (one per subscriber)"),
    ("kvcache_routed_requests", "Fallback reads routed to peers"))


@dataclass
class BucketRow:
    """One bucket's numbers at the scrape."""

    synced: bool
    keys: int
    applied: int
    upstream: int
    lag_s: float
    max_stale_s: float
    removed: int
    polls: int
    resyncs: tuple[int, ...]  # by RESYNC_REASONS
    recreations: tuple[int, ...]  # by RECREATION_REASONS
    cache: tuple[int, ...] | None  # keys, bytes, then CACHE_COUNTERS; None: no near cache
    relay: tuple[int, int, int, int] | None = None  # RelayNumbers; None: no part in a fleet relay
    follow: str = "consumer"  # or `republish`, `relay`: a core subject, no consumer (kvcache.feed.follow)
    gaps: int = 0
    gap_messages: int = 0
    gap_seconds: float = 0.0
    follow_ends: tuple[int, ...] = field(default_factory=lambda: (0,) * len(FOLLOW_END_REASONS))


@dataclass
class Snapshot:
    """Every number a scrape exports, copied on the event loop (SidecarCollector.snapshot)."""

    build: dict[str, str]
    reads: dict[tuple[str, str, str], int]
    latency: dict[str, Latency]
    client_gauges: tuple[int, ...]  # by CLIENT_GAUGES
    counters: tuple[int, ...]  # by COUNTERS
    buckets: dict[str, BucketRow] = field(default_factory=dict)
    peers: list[tuple[tuple[str, str, str], int, float, int, tuple[int, ...]]] = field(default_factory=list)
    nats: list[tuple[str, str, int, int]] = field(default_factory=list)
    lmdb: tuple[int, int, int] = (0, 0, 0)  # map size, used, max map size
    nats_last_move_s: float = 0.0  # the main connection's latest reconnect (Stats.nats_last_move_ms)
    # workers > 1: per worker (its index as a label), its clients now, GETs it answered from the
    # replica and seconds since it last wrote them (kvcache.supervisors.workers)
    workers: list[tuple[int, int, int, float]] = field(default_factory=list)


# What the collector reads of the read side and the server, a layer above ops/ (docs/
# architecture.md, Where it lives): named here, so that ops/ imports nothing of them.
# kvcache.serve.commands.Commands is a CommandLayer (the type checker checks that at
# kvcache.sidecar, which hands it over).
class _ReadPolicy(Protocol):
    @property
    def feeds(self) -> Mapping[str, Feed]: ...
    @property
    def replica(self) -> Replica: ...


class _Router(Protocol):
    @property
    def requests(self) -> int: ...
    def peers(self) -> Iterable[Any]: ...  # kvcache.read.peer.Peer: name, bucket, stream, inflight, stats
    def state(self, peer: Any, /) -> str: ...


class _Reads(Protocol):
    @property
    def policy(self) -> _ReadPolicy: ...
    @property
    def router(self) -> _Router: ...


class _Tracking(Protocol):
    @property
    def clients(self) -> Sized: ...
    @property
    def table(self) -> Sized: ...
    @property
    def invalidations(self) -> int: ...


class _PubSub(Protocol):
    @property
    def messages(self) -> int: ...
    def clients(self) -> int: ...


class CommandLayer(Protocol):
    @property
    def timing(self) -> Mapping[bytes, Latency] | None: ...
    @property
    def reads(self) -> _Reads: ...
    @property
    def tracking(self) -> _Tracking: ...
    @property
    def pubsub(self) -> _PubSub: ...
    @property
    def access(self) -> AccessLog: ...


class SidecarCollector:
    """Takes a Snapshot of the sidecar's parts. `gets` is the server's GET fast path
    (kvcache.serve.server_get.ServerGets or its C twin); `connections` names the NATS connections
    in use (main, and one per configured peer server set)."""

    def __init__(self, cfg: Config, stats: Stats, commands: CommandLayer, gets,
                 connections: Callable[[], dict[str, NATS]]) -> None:
        self.cfg = cfg
        self.stats = stats
        self.commands = commands
        self.policy = commands.reads.policy
        self.gets = gets
        self.connections = connections
        # workers > 1: their counters (kvcache.supervisors.workers.Workers.totals), added in
        self.workers: Callable[[], WorkerTotals] | None = None
        self.relays: RelayElection | None = None  # the fleet's relays this sidecar stands for

    def snapshot(self) -> Snapshot:
        """Copy the numbers (on the event loop: see the module docstring)."""
        st, cmds, policy = self.stats, self.commands, self.policy
        reads = dict(st.reads)
        workers = self.workers() if self.workers is not None else None
        counted_by = [("local", self.gets.bucket_reads()), ("cache", self.gets.cache_reads())]
        if workers is not None:
            counted_by.append(("local", workers.reads))
        for source, counted in counted_by:
            for bucket, (found, absent) in counted.items():
                for result, n in (("hit", found), ("miss", absent)):
                    if n:
                        reads[(bucket, source, result)] = reads.get((bucket, source, result), 0) + n
        for bucket in policy.feeds:
            for series in INITIAL_READS:
                reads.setdefault((bucket, *series), 0)
        latency: dict[str, Latency] = {}
        for command, h in (cmds.timing or {}).items():
            copy = latency[command.decode(errors="replace")] = Latency()
            copy.add(h.counts, h.sum_ns)
        get = latency.setdefault("get", Latency())
        get.add(*self.gets.latency())
        router = cmds.reads.router
        now = time.time_ns()
        snap = Snapshot(
            workers=[(i, w["clients"], w["gets_local"] + w["gets_notfound"],
                      (now - w["written_ns"]) / 1e9 if w["written_ns"] else -1.0)
                     for i, w in enumerate(workers.each if workers is not None else [])],
            build={"version": __version__, **{k: v.split()[0] for k, v in native.report().items()},
                   "lmdb": native.lmdb_version()},
            reads=reads, latency=latency,
            client_gauges=(st.connected_clients, self.cfg.max_clients, len(cmds.tracking.clients),
                           len(cmds.tracking.table), cmds.pubsub.clients()),
            counters=(st.commands + (workers.total.get("commands", 0) if workers is not None else 0),
                      st.remote_errors, st.reads_gathered, st.reads_coalesced,
                      st.stream_list_requests,
                      cmds.access.records, st.connections_received, st.rejected_connections,
                      st.clients_cut_off, st.subscribers_cut_off, st.protocol_errors,
                      cmds.tracking.invalidations, cmds.pubsub.messages, router.requests))
        counts = policy.replica.counts(policy.feeds)
        fast = self.gets.cache_reads()  # the near caches' hits the GET fast path answered
        for name, f in policy.feeds.items():
            m, c = f.meta, f.cache
            cache = None
            if c is not None:
                counted = {k: getattr(c.stats, k) for k, _ in CACHE_COUNTERS}
                counted["hits"] += sum(fast.get(name, ()))
                cache = (len(c), c.bytes, *(counted[k] for k, _ in CACHE_COUNTERS))
            snap.buckets[name] = BucketRow(
                f.synced, counts[name], m.applied_seq, max(f.upstream_seq, m.applied_seq), f.lag_ms() / 1000,
                f.cfg.max_stale_ms / 1000, f.removed_upstream, f.state_polls,
                tuple(f.resync_reasons[r] for r in RESYNC_REASONS),
                tuple(f.recreations[r] for r in RECREATION_REASONS),
                cache, self.relays.numbers(name) if self.relays is not None else None,
                f.follow_mode, f.gaps_filled, f.gap_fill_messages, f.gap_fill_seconds,
                tuple(f.follow_ends[r] for r in FOLLOW_END_REASONS))
        for p in router.peers():
            snap.peers.append(((p.name, p.bucket, p.stream), int(router.state(p) == "up"), p.stats.ewma_us / 1e6,
                               p.inflight, tuple(getattr(p.stats, k) for k, _ in PEER_COUNTERS)))
        snap.nats = [(name, server_of(nc), int(nc.is_connected), nc.stats.get("reconnects", 0))
                     for name, nc in sorted(self.connections().items())]
        snap.nats_last_move_s = self.stats.nats_last_move_ms / 1000
        map_size, used = policy.replica.usage()
        snap.lmdb = (map_size, used, self.cfg.max_map_size_mb << 20)
        return snap


def families(snap: Snapshot) -> Iterator[Metric]:
    """The metric families of a snapshot (any thread)."""
    yield InfoMetricFamily("kvcache_build", "kvcache's version and the implementation serving each "
                           "native module (native or twin)", value=snap.build)
    reads = CounterMetricFamily("kvcache_reads_total", "Keys read, by bucket, the source that answered "
                                "(local, cache, peer, leader, stale) and the result (hit, miss, error)",
                                labels=["bucket", "source", "result"])
    for (bucket, source, result), n in sorted(snap.reads.items()):
        reads.add_metric([bucket, source, result], n)
    yield reads
    hist = HistogramMetricFamily("kvcache_command_duration_seconds", "Time from a command's request to "
                                 "its reply, by command (kept while the metrics listener is on)",
                                 labels=["command"])
    for name, h in sorted(snap.latency.items()):
        cumulative, buckets = 0, []
        for le, c in zip(LE, h.counts, strict=True):
            cumulative += c
            buckets.append((le, cumulative))
        hist.add_metric([name], buckets, h.sum_ns / 1e9)
    yield hist
    for (name, doc), v in zip(CLIENT_GAUGES, snap.client_gauges, strict=True):
        yield GaugeMetricFamily(name, doc, value=v)
    for (name, doc), v in zip(COUNTERS, snap.counters, strict=True):
        yield CounterMetricFamily(name, doc, value=v)
    yield from _replica(snap)
    yield from _peers(snap)
    connected = GaugeMetricFamily("kvcache_nats_connected", "1 while the NATS connection is up; "
                                  "server: the one in use (host:port)", labels=["connection", "server"])
    reconnects = CounterMetricFamily("kvcache_nats_reconnects", "Reconnections of the NATS connection",
                                     labels=["connection"])
    for name, server, up, n in snap.nats:
        connected.add_metric([name, server], up)
        reconnects.add_metric([name], n)
    yield connected
    yield reconnects
    yield GaugeMetricFamily("kvcache_nats_last_move_seconds", "The main NATS connection's latest reconnect: "
                            "from leaving a server to connected to another (0: none yet)",
                            value=snap.nats_last_move_s)
    map_size, used, max_size = snap.lmdb
    yield GaugeMetricFamily("kvcache_lmdb_map_size_bytes", "The replica's LMDB map size (grows as needed)",
                            value=map_size)
    yield GaugeMetricFamily("kvcache_lmdb_used_bytes", "Bytes of the map in use (pages up to the last one "
                            "written)", value=used)
    yield GaugeMetricFamily("kvcache_lmdb_max_map_size_bytes", "max_map_size_mb: the most the map may grow to",
                            value=max_size)
    if snap.workers:
        clients = GaugeMetricFamily("kvcache_worker_clients", "A worker process's open client connections",
                                    labels=["worker"])
        gets = CounterMetricFamily("kvcache_worker_gets", "GETs a worker process answered from the replica "
                                   "(in kvcache_reads_total too)", labels=["worker"])
        age = GaugeMetricFamily("kvcache_worker_report_age_seconds", "Since a worker process last wrote its "
                                "counters (twice a second while it runs)", labels=["worker"])
        for i, n_clients, n_gets, seconds in snap.workers:
            clients.add_metric([str(i)], n_clients)
            gets.add_metric([str(i)], n_gets)
            age.add_metric([str(i)], seconds)
        yield clients
        yield gets
        yield age


# The per-bucket gauges: name, help, the BucketRow's value
REPLICA_GAUGES: tuple[tuple[str, str, Callable[[BucketRow], float]], ...] = (
    ("kvcache_replica_synced", "1 once the replica holds every key (initial or full re-sync done)",
     lambda b: int(b.synced)),
    ("kvcache_replica_keys", "Records in the replica", lambda b: b.keys),
    ("kvcache_replica_applied_sequence", "Last stream sequence applied", lambda b: b.applied),
    ("kvcache_replica_upstream_sequence", "The stream's last sequence as last seen", lambda b: b.upstream),
    ("kvcache_replica_lag_seconds", "How long the replica has been behind the stream (0 when caught up and heard from)",
     lambda b: b.lag_s),
    ("kvcache_replica_lag_messages", "Stream messages not yet applied", lambda b: b.upstream - b.applied),
    ("kvcache_replica_max_stale_seconds", "The bucket's max_stale_ms: the replica answers while its "
     "lag is within it", lambda b: b.max_stale_s))


# The fleet relay's families (kvcache.feed.relay), in RelayNumbers' order: only for buckets
# this sidecar stands for the relay of
RELAY_FAMILIES: tuple[tuple[type[GaugeMetricFamily] | type[CounterMetricFamily], str, str], ...] = (
    (GaugeMetricFamily, "kvcache_relay_active", "1 while this sidecar relays the bucket's stream for the fleet"),
    (CounterMetricFamily, "kvcache_relay_messages", "Stream messages this sidecar relayed for the fleet"),
    (GaugeMetricFamily, "kvcache_relay_lag_messages", "Stream messages not yet relayed (0 when not relaying)"),
    (CounterMetricFamily, "kvcache_relay_role_changes", "Times this sidecar took or left the bucket's relay"))


def _filled(family: GaugeMetricFamily | CounterMetricFamily, rows: Iterable[tuple[list[str], T]],
            value: Callable[[T], float]) -> Metric:
    """`family` with one sample per row: the row's label values, and `value` of its data."""
    for labels, row in rows:
        family.add_metric(labels, value(row))
    return family


def _replica(snap: Snapshot) -> Iterator[Metric]:
    """The per-bucket families, each built only when asked for: with 1,000 buckets building
    them all before the first is formatted held the event loop for tens of ms."""
    labels = ["bucket"]
    rows = [([bucket], b) for bucket, b in snap.buckets.items()]
    for name, doc, value in REPLICA_GAUGES:
        yield _filled(GaugeMetricFamily(name, doc, labels=labels), rows, value)
    yield _filled(CounterMetricFamily("kvcache_replica_removed_upstream", "Keys removed with no message to "
                                      "follow (expiry, limits, purges)", labels=labels), rows, lambda b: b.removed)
    yield _filled(CounterMetricFamily("kvcache_replica_state_polls", "Looks at the stream's state made to "
                                      "watch for such removals", labels=labels), rows, lambda b: b.polls)
    resyncs = CounterMetricFamily("kvcache_replica_resyncs", "Full resyncs since start, by reason",
                                  labels=["bucket", "reason"])
    for [bucket], b in rows:
        for reason, n in zip(RESYNC_REASONS, b.resyncs, strict=True):
            resyncs.add_metric([bucket, reason], n)
    yield resyncs
    recreations = CounterMetricFamily("kvcache_consumer_recreations", "Consumers recreated since start, "
                                      "by reason", labels=["bucket", "reason"])
    for [bucket], b in rows:
        for reason, n in zip(RECREATION_REASONS, b.recreations, strict=True):
            if n:  # eleven reasons a bucket: only those that happened (resyncs: every one, at 0)
                recreations.add_metric([bucket, reason], n)
    yield recreations
    follow = GaugeMetricFamily("kvcache_feed_follow", "1 while the bucket is followed on a core subject with "
                               "no consumer (source: republish, relay), 0 with a consumer (source: consumer)",
                               labels=["bucket", "source"])
    for [bucket], b in rows:
        follow.add_metric([bucket, b.follow], int(b.follow != "consumer"))
    yield follow
    yield _filled(CounterMetricFamily("kvcache_feed_gaps", "Gaps in the RePublish subject's sequence found "
                                      "and filled with Direct Get batches", labels=labels), rows, lambda b: b.gaps)
    yield _filled(CounterMetricFamily("kvcache_feed_gap_fill_messages", "Messages applied by gap fills",
                                      labels=labels), rows, lambda b: b.gap_messages)
    yield _filled(CounterMetricFamily("kvcache_feed_gap_fill_seconds", "Time spent filling gaps",
                                      labels=labels), rows, lambda b: b.gap_seconds)
    ends = CounterMetricFamily("kvcache_feed_follow_ends", "Times following the RePublish subject ended and "
                               "the feed went back to a consumer, by reason", labels=["bucket", "reason"])
    for [bucket], b in rows:
        for reason, n in zip(FOLLOW_END_REASONS, b.follow_ends, strict=True):
            if n:
                ends.add_metric([bucket, reason], n)
    yield ends
    cached = [(lv, b.cache) for lv, b in rows if b.cache is not None]
    cache_families: list[tuple[type[GaugeMetricFamily] | type[CounterMetricFamily], str, str]] = [
        (GaugeMetricFamily, "kvcache_cache_keys", "Keys in the bucket's near cache"),
        (GaugeMetricFamily, "kvcache_cache_bytes", "Bytes the near cache holds (keys, records and 64 bytes "
         "of bookkeeping each)"),
        *((CounterMetricFamily, f"kvcache_cache_{k}", doc) for k, doc in CACHE_COUNTERS)]
    for i, (kind, name, doc) in enumerate(cache_families):
        yield _filled(kind(name, doc, labels=labels), cached, itemgetter(i))
    relayed = [(lv, b.relay) for lv, b in rows if b.relay is not None]
    for i, (kind, name, doc) in enumerate(RELAY_FAMILIES if relayed else ()):  # with relays on only
        yield _filled(kind(name, doc, labels=labels), relayed, itemgetter(i))



def _peers(snap: Snapshot) -> Iterator[Metric]:
    """The per-peer families, each built only when asked for (see _replica)."""
    labels = ["peer", "bucket", "stream"]
    rows = [(list(lv), (up, latency, inflight, *counts)) for lv, up, latency, inflight, counts in snap.peers]
    gauges = (("kvcache_peer_up", "1 while the router may send the peer reads (0: ejected after errors, or "
               "its connection is down)"),
              ("kvcache_peer_latency_ewma_seconds", "The router's latency estimate for the peer"),
              ("kvcache_peer_inflight_requests", "Requests sent to the peer and not yet answered"))
    for i, (name, doc) in enumerate(gauges):
        yield _filled(GaugeMetricFamily(name, doc, labels=labels), rows, itemgetter(i))
    for i, (k, doc) in enumerate(PEER_COUNTERS, start=len(gauges)):
        yield _filled(CounterMetricFamily(f"kvcache_peer_{k}", doc, labels=labels), rows, itemgetter(i))


class _One:
    """A collector of one family, or of one chunk of it (exposition formats those one at a time)."""

    def __init__(self, family: Metric) -> None:
        self.family = family

    def collect(self) -> list[Metric]:
        return [self.family]


def _chunks(family: Metric, encoder: Callable[[_One], bytes]) -> Iterator[bytes]:
    """A family's exposition CHUNK samples at a time: the first with its comment lines (HELP,
    TYPE, UNIT), the others with only their sample lines (which never start with `#`), so
    that joined they are the family's exposition as one call would make it."""
    samples = family.samples
    for start in range(0, max(len(samples), 1), CHUNK):
        part = copy.copy(family)
        part.samples = samples[start:start + CHUNK]
        text = encoder(_One(part)).removesuffix(EOF)
        if start:
            text = b"".join(line for line in text.splitlines(keepends=True) if not line.startswith(b"#"))
        yield text


async def exposition(snap: Snapshot, accept: str) -> tuple[bytes, str]:
    """The exposition of a snapshot in the format the scraper accepts (Prometheus text, or
    OpenMetrics), with the process (CPU, memory, file descriptors) and Python platform
    collectors every Prometheus client library exports: (body, content type). At most CHUNK
    samples at a time, the event loop free in between."""
    encoder, content_type = choose_encoder(accept)
    parts: list[bytes] = []
    for family in families(snap):
        for text in _chunks(family, encoder):
            parts.append(text)
            await asyncio.sleep(0)
    reg = CollectorRegistry(auto_describe=False)
    ProcessCollector(registry=reg)
    PlatformCollector(registry=reg)
    parts.append(encoder(reg))
    return b"".join(parts), content_type


def server_of(nc: Any) -> str:
    """The server a NATS connection uses (host:port; '' while it has none): a label, bounded
    by the configured and discovered servers."""
    url = getattr(nc, "connected_url", None)
    return url.netloc.rpartition("@")[2] if url is not None and url.netloc else ""
