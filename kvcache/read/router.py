"""Latency-aware routing of fallback reads across a bucket's peers (docs/architecture.md, Routing).

NATS picks a Direct Get responder at random inside a cluster, so choosing the fast one is ours
to do. A read goes to the better of two peers by cost (power of two choices; the two candidates
are drawn with probability inversely proportional to the square of cost, so two slow peers
are almost never the pair a read must choose from, while equal peers share the reads; probes
keep every peer measured). When the answer is late (about the chosen peer's p95, which is
the best peer's but when that one is busy) a **hedged** request goes to another peer, within
a budget of extra requests (a token bucket refilled by a share of the ordinary requests); the first good answer
wins and the other request is cancelled. Errors fail over to the next peer at once. Repeated
failures (errors, timeouts, hedges lost) **eject** a peer; it comes back after a successful
probe, tried with exponential backoff. Peers idle for a while are probed too, so an estimate
never goes stale because the peer stopped being chosen.

Strong reads go to the leader API of a peer reaching the bucket's own stream (not a mirror),
once quorum evidence shows no other leader can have replaced it (`strong_gate`).
Followers and mirrors lag: an answer older than a revision of the same key already read is
read again from the bucket's other peers (another mirror is likely caught up), then from the
leader; a key's reads never go back in time, and a read no reachable peer can answer at its
revision floor fails.
"""
from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any

from ..entry import Entry
from ..errors import ReplyBudget, UpstreamError
from ..feed.quorum import NO_FENCE, STRONG_EVIDENCE_MS, Fence, evidence
from ..natsio import jetstream as jsapi
from .ledger import FLOORS_MAX, Floors
from .peer import MULTI_LAST_MAX, Peer, PeerStats

__all__ = ["FLOORS_MAX", "MULTI_LAST_MAX", "Floors", "Peer", "PeerStats", "Router", "RouterSettings"]


@dataclass
class RouterSettings:
    """The router's knobs (hedging, ejection, probes); the defaults suit a sidecar reading at
    up to tens of thousands/s."""

    hedge_ratio: float = 0.10       # hedged requests allowed per ordinary request
    hedge_burst: float = 10.0       # tokens the budget can save up (and starts with)
    hedge_min_s: float = 0.0005     # never hedge sooner than this
    hedge_default_s: float = 0.05   # hedge delay before any peer has been measured
    hedge_percentile: float = 0.95
    hedge_patience: bool = True     # wait as long as a slower alternative would take (hedge_delay)
    eject_after: int = 3            # consecutive failures that eject a peer
    probe_backoff_s: float = 0.5    # first retry of an ejected peer; doubles on each failure
    probe_backoff_max_s: float = 30.0
    refresh_s: float = 0.25         # probe a healthy peer not measured for this long


Fetch = Callable[[Peer], Coroutine[Any, Any, Any]]


@dataclass
class PeerHealth:
    """The router's view of one peer, which it alone changes: consecutive failures, whether
    it is ejected, and when to probe it back (exponential backoff)."""

    failures: int = 0
    ejected: bool = False
    backoff: float = 0.0
    next_probe: float = 0.0
    probing: bool = False


class Router:
    """Chooses peers for fallback reads, hedges slow ones and ejects failing ones."""

    def __init__(self, timeout: float, settings: RouterSettings | None = None, rng: random.Random | None = None,
                 max_age: Callable[[str], int] | None = None,
                 fence: Callable[[str], Fence | None] | None = None, floors: Floors | None = None,
                 proven: Callable[[str, int], bool] | None = None) -> None:
        self.timeout = timeout
        self.settings = settings or RouterSettings()
        self._peers: dict[str, list[Peer]] = {}
        self.health: dict[Peer, PeerHealth] = {}  # the router's view of each peer
        self._rng = rng or random.Random()
        self._tokens = self.settings.hedge_burst
        self._background: set[asyncio.Task] = set()
        # the ledger's floors (kvcache.read.ledger): the highest revision read per key
        self.floors = floors if floors is not None else Floors(max_age=max_age)
        # What a bucket's fallback answers must show (kvcache.feed.quorum.Fence; None: nothing can
        # show it current now): the sidecar passes the feeds' quorum evidence.
        self.fence: Callable[[str], Fence | None] = fence or (lambda bucket: NO_FENCE)
        # Has a quorum shown a bucket's stream state within ms? The sidecar passes the feeds'
        # (Feed.proven_within); strong reads need it within STRONG_EVIDENCE_MS (`strong_gate`).
        self.proven: Callable[[str, int], bool] = proven or (lambda bucket, ms: True)
        self._strong_as_of: dict[str, int] = {}  # bucket -> the gate's own newest evidence (wall ns)
        self._strong_asks: dict[str, asyncio.Future] = {}  # bucket -> its STREAM.INFO in flight
        self.strong_evidence_asked = 0  # STREAM.INFO requests the gate sent
        self.hedges_sent = 0
        self.hedges_won = 0
        self.requests = 0

    def add(self, peer: Peer) -> None:
        self._peers.setdefault(peer.bucket, []).append(peer)
        self.health[peer] = PeerHealth()

    def state(self, peer: Peer) -> str:
        """`ejected` by the router, `down` while its connection is lost, else `up`."""
        if self.health[peer].ejected:
            return "ejected"
        return "up" if peer.nc.is_connected else "down"

    def peers(self) -> Iterable[Peer]:
        for ps in self._peers.values():
            yield from ps

    async def close(self) -> None:
        """Cancel the probes still running (they hold no state worth waiting for)."""
        for t in list(self._background):
            t.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    def info_rows(self) -> list[tuple[str, object]]:
        """INFO's `# Routing` section: totals, then per-peer latency percentiles (µs),
        in-flight requests, hedges won, ejections and probes."""
        rows: list[tuple[str, object]] = [
            ("routed_requests", self.requests), ("hedges_sent", self.hedges_sent),
            ("hedges_won", self.hedges_won), ("hedge_budget_ratio", self.settings.hedge_ratio),
            ("strong_evidence_requests", self.strong_evidence_asked)]
        for p in self.peers():
            st = p.stats
            rows.append((p.label, ",".join(f"{k}={v}" for k, v in (
                ("p50_us", int(st.percentile(0.5))), ("p95_us", int(st.percentile(0.95))),
                ("p99_us", int(st.percentile(0.99))), ("inflight", p.inflight),
                ("hedges_won", st.hedges_won), ("ejections", st.ejections), ("probes", st.probes)))))
        return rows

    # ------------------------------------------------------------------ reads

    async def get(self, bucket: str, key: str, strong: bool = False) -> Entry | None:
        return (await self.get_from(bucket, key, strong))[0]

    async def get_from(self, bucket: str, key: str, strong: bool = False) -> tuple[Entry | None, str]:
        """`get`, and who answered: the label of the peer whose answer it is, or "" when the
        first answer was behind and others were asked (_catch_up). A not-found names no
        source of its own; the near cache keeps one only from the bucket's own stream."""
        ps = self._bucket_peers(bucket, strong)
        fence = self._fence(bucket)
        if strong:
            await self.strong_gate(bucket, ps)
        self._schedule_probes(ps, key)
        e, by = await self._route(ps, lambda p: p.get(key, self.timeout, leader=strong, fence=fence), hedge=True)
        answered = by.label
        if not strong and self.floors.below(bucket, key, e):
            e = (await self._catch_up(bucket, [key], by, ps, fence))[key]
            answered = ""
        self.floors.saw(bucket, key, e)
        return e, answered

    async def get_many(self, bucket: str, keys: list[str],
                       budget: ReplyBudget | None = None) -> dict[str, Entry | None]:
        return (await self.get_many_from(bucket, keys, budget))[0]

    async def get_many_from(self, bucket: str, keys: list[str], budget: ReplyBudget | None = None
                            ) -> tuple[dict[str, Entry | None], dict[str, str]]:
        """MGET misses: one peer answers them all (one snapshot); errors fail over. The keys
        the peer answers older than a revision already read are read again (see _catch_up).
        With who answered each key, as `get_from` says it."""
        ps = self._bucket_peers(bucket, False)
        fence = self._fence(bucket)
        got, by = await self._route(ps, lambda p: p.get_many(keys, self.timeout, budget=budget, fence=fence),
                                    hedge=False)
        answered = dict.fromkeys(got, by.label)
        behind: list[str] = []
        for key, e in got.items():
            if self.floors.below(bucket, key, e):
                behind.append(key)
            else:
                self.floors.saw(bucket, key, e)
        if behind:
            for key, e in (await self._catch_up(bucket, behind, by, ps, fence)).items():
                got[key] = e
                answered[key] = ""
                self.floors.saw(bucket, key, e)
        return got, answered

    async def strong_gate(self, bucket: str, leaders: list[Peer]) -> None:
        """May a strong read of `bucket` take its believed leader's answer? Only while a quorum
        of the stream's group showed its state within STRONG_EVIDENCE_MS (kvcache.feed.quorum):
        the feed's evidence, or the gate's own; else one STREAM.INFO of the leader, shared by
        the strong reads of the bucket that wait meanwhile, must show it. The feed's evidence
        is kept within max_stale_ms, which may be longer than a cut-off leader takes to be
        replaced. UpstreamError when no evidence shows it."""
        span = STRONG_EVIDENCE_MS * 1_000_000
        if self.proven(bucket, STRONG_EVIDENCE_MS) or self._strong_as_of.get(bucket, 0) >= time.time_ns() - span:
            return
        ask = self._strong_asks.get(bucket)
        if ask is None:
            ask = asyncio.ensure_future(self._ask_evidence(bucket, leaders))
            self._strong_asks[bucket] = ask
            ask.add_done_callback(lambda f: self._asked(bucket, f))
        await asyncio.shield(ask)
        if self._strong_as_of.get(bucket, 0) < time.time_ns() - span:
            raise UpstreamError(f"bucket {bucket}: no quorum of its servers has shown its state within "
                                f"{STRONG_EVIDENCE_MS} ms, so a strong read cannot show its leader was not replaced")

    async def _ask_evidence(self, bucket: str, leaders: list[Peer]) -> None:
        sent = time.time_ns()
        self.strong_evidence_asked += 1
        info = await self._leader_info(leaders)
        ev = evidence(info, min(sent, time.time_ns()))
        if ev is not None and ev.as_of_ns > self._strong_as_of.get(bucket, 0):
            self._strong_as_of[bucket] = ev.as_of_ns

    def _asked(self, bucket: str, f: asyncio.Future) -> None:
        if self._strong_asks.get(bucket) is f:
            del self._strong_asks[bucket]
        if not f.cancelled():
            f.exception()  # retrieved: each waiting read has raised it already

    async def last_revision(self, bucket: str) -> int:
        """The bucket's last revision (its stream's last sequence) as the stream's leader shows
        it now: one STREAM.INFO, asked of a peer reaching the bucket's own stream (a mirror
        lags, and numbers only what it copied). Only a MINREV read whose answer is below its
        revision asks (kvcache.read.reads): is that revision beyond the bucket, or is the key
        older than it? UpstreamError when no leader answers."""
        info = await self._leader_info(self._bucket_peers(bucket, True))
        return int((info.get("state") or {}).get("last_seq", 0) or 0)

    async def _leader_info(self, leaders: list[Peer]) -> dict:
        """One STREAM.INFO, answered by the server that believes it leads, through `leaders`
        (peers reaching the bucket's own stream): MINREV's last revision, the strong gate's
        evidence. UpstreamError when no leader answers."""
        async def fetch(p: Peer) -> dict:
            return await jsapi.stream_info(p.nc, p.stream, self.timeout, p.api, need_leader=True)
        info, _ = await self._route(leaders, fetch, hedge=False)
        return info

    async def _catch_up(self, bucket: str, keys: list[str], stale: Peer,
                        peers: list[Peer], fence: Fence = NO_FENCE) -> dict[str, Entry | None]:
        """`stale` (a lagging mirror or follower) answered `keys` older than revisions already
        read. The leader has every acknowledged write, but it may be the one peer out of reach
        (a leaf cut off from its hub), while another mirror is caught up. So the keys still
        behind go to the other healthy peers in turn, cheapest first, then to the leader, then
        to the unhealthy peers (each once: a failover, not a hedge); the first answer at or
        above a key's floor is its answer. A key no peer answers at its floor fails the read:
        an older answer would take the key's reads back in time."""
        now = time.perf_counter()

        def place(p: Peer | None) -> tuple[int, float]:
            if p is None:   # the leader
                return 1, 0.0
            healthy = not self.health[p].ejected and not p.unanswered_since and p.nc.is_connected
            return 0 if healthy else 2, p.cost(now)
        order = sorted([*(p for p in peers if p is not stale), None], key=place)
        leaders = [p for p in peers if p.upstream]
        left: list[str] = list(keys)
        found: dict[str, Entry | None] = {}
        last: UpstreamError | None = None
        for p in order:
            got: dict[str, Entry | None] = {}
            try:
                if p is not None:
                    got = await self._read(p, left, fence)
                    self._succeeded(p)
                elif leaders:
                    await self._from_leader(leaders, left, got)
            except UpstreamError as exc:
                last = exc
                if p is not None:
                    self._failed(p)
            for key, e in got.items():
                if not self.floors.below(bucket, key, e):
                    found[key] = e
            left = [key for key in left if key not in found]
            if not left:
                return found
        more = f" and {len(left) - 1} more" if len(left) > 1 else ""
        raise UpstreamError(f"bucket {bucket}: every reachable peer was behind a revision already read "
                            f"of key {left[0]}{more}" + (f" (last error: {last})" if last else ""))

    async def _read(self, p: Peer, keys: list[str], fence: Fence = NO_FENCE) -> dict[str, Entry | None]:
        if len(keys) == 1:
            return {keys[0]: await p.get(keys[0], self.timeout, fence=fence)}
        return await p.get_many(keys, self.timeout, fence=fence)

    def _fence(self, bucket: str) -> Fence:
        """What an answer for `bucket` must show (kvcache.feed.quorum.Fence); UpstreamError at once
        when nothing could: no quorum evidence within the bucket's max_stale_ms, so no server's
        answer can be shown current, and asking one would only hand out an unproven value."""
        fence = self.fence(bucket)
        if fence is None:
            raise UpstreamError(f"bucket {bucket}: no quorum of its servers has shown its state within "
                                "max_stale_ms (a partition, or no stream leader)")
        return fence

    async def _from_leader(self, leaders: list[Peer], keys: list[str], into: dict[str, Entry | None]) -> None:
        """Read `keys` from the leader into `into`, one at a time (the leader API has no batch
        form); the first failure ends it, keeping what was read (the leader is out of reach:
        the next key would only wait out the same timeout)."""
        for key in keys:
            def fetch(p: Peer, key: str = key) -> Coroutine[Any, Any, Entry | None]:
                return p.get(key, self.timeout, leader=True)
            into[key], _ = await self._route(leaders, fetch, hedge=False)

    def _bucket_peers(self, bucket: str, strong: bool) -> list[Peer]:
        ps = self._peers.get(bucket)
        if ps and strong:
            ps = [p for p in ps if p.upstream]
        if not ps:
            raise UpstreamError(f"no peer can read bucket {bucket}" + (" from its leader" if strong else ""))
        return ps

    # ------------------------------------------------------------------ choice

    def choose(self, peers: list[Peer], exclude: Iterable[Peer] = ()) -> Peer | None:
        """Power of two choices by cost among the healthy peers not excluded (all of them when
        every one is ejected). Unmeasured peers go first: they have to be measured."""
        pool = self._pool(peers, exclude)
        if len(pool) <= 1:
            return pool[0] if pool else None
        fresh = [p for p in pool if not p.stats.last_sample and not p.inflight]
        if fresh:
            return fresh[0]
        now = time.perf_counter()
        costs = {id(p): max(p.cost(now), 1.0) for p in pool}
        a = self._draw(pool, costs)
        b = self._draw([p for p in pool if p is not a], costs)
        return a if costs[id(a)] <= costs[id(b)] else b

    def _pool(self, peers: list[Peer], exclude: Iterable[Peer]) -> list[Peer]:
        """The peers not excluded that are up and not suspect (overtaken by a hedge, not heard
        from since: it is being probed); else those not ejected; else all of them."""
        excluded = set(map(id, exclude))
        pool = [p for p in peers if id(p) not in excluded]
        health = self.health
        healthy = [p for p in pool if not health[p].ejected and not p.unanswered_since and p.nc.is_connected]
        return healthy or [p for p in pool if not health[p].ejected] or pool

    def _draw(self, pool: list[Peer], costs: dict[int, float]) -> Peer:
        weights = [1.0 / costs[id(p)] ** 2 for p in pool]
        return self._rng.choices(pool, weights)[0]

    def hedge_delay(self, primary: Peer, peers: list[Peer]) -> float:
        """When the request to `primary` is late (seconds): its p95. The primary is the best
        peer but when that one is busy or ejected; timing a slower primary by the best peer's
        p95 would hedge every such request and spend the budget for nothing. When even the
        best alternative is slower than the primary's p99, a hedge sent at the p95 would
        rarely win: it waits until the primary has taken as long as the alternative would
        (by then the primary is past its p99: likely stalled). An unmeasured primary is timed
        by the best measured peer."""
        s = self.settings
        q = s.hedge_percentile
        if primary.stats.samples:
            delay = primary.stats.percentile(q)
            alt = self.best(peers, exclude=(primary,))
            if s.hedge_patience and alt is not None and alt.stats.ewma_us > primary.stats.percentile(0.99):
                delay = max(delay, alt.stats.ewma_us)
        else:
            delay = min((p.stats.percentile(q) for p in peers if p.stats.samples and not self.health[p].ejected),
                        default=s.hedge_default_s * 1e6)
        return max(s.hedge_min_s, delay / 1e6)

    def best(self, peers: list[Peer], exclude: Iterable[Peer] = ()) -> Peer | None:
        """The cheapest healthy peer not excluded: where a hedge has the best chance to win."""
        pool = self._pool(peers, exclude)
        now = time.perf_counter()
        return min(pool, key=lambda p: p.cost(now)) if pool else None

    def _take_hedge_token(self) -> bool:
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False

    # ------------------------------------------------------------------ one routed request

    async def _route(self, peers: list[Peer], fetch: Fetch, hedge: bool) -> tuple[Any, Peer]:
        """Run `fetch` on the chosen peer; hedge it when late, fail over when it fails; the
        first answer wins and the requests still running are cancelled. Returns the answer
        and the peer that gave it (a lagging one is passed over when reading again)."""
        s = self.settings
        self.requests += 1
        self._tokens = min(s.hedge_burst, self._tokens + s.hedge_ratio)
        if len(peers) == 1:
            # Nothing to choose, hedge to or fail over to: await the request itself, not a
            # task and a wait() around it (each costs turns of the event loop on every read).
            p = peers[0]
            try:
                result = await fetch(p)
            except UpstreamError:
                self._failed(p)
                raise
            self._succeeded(p)
            return result, p
        loop = asyncio.get_running_loop()
        tried: list[Peer] = []
        running: dict[asyncio.Task, tuple[Peer, bool, float]] = {}
        # One future wakes this coroutine when a request ends or the hedge is due: cheaper
        # than asyncio.wait(), which hooks and unhooks every task and a timer on each call.
        wake = loop.create_future()

        def rouse(_: object = None) -> None:
            if not wake.done():
                wake.set_result(None)

        def launch(p: Peer, hedged: bool) -> None:
            tried.append(p)
            t: asyncio.Task[Any] = loop.create_task(fetch(p))
            t.add_done_callback(rouse)
            running[t] = (p, hedged, time.perf_counter())

        first = self.choose(peers)
        assert first is not None
        launch(first, False)
        timer = loop.call_later(self.hedge_delay(first, peers), rouse) if hedge else None
        last_exc: BaseException | None = None
        try:
            while True:
                await wake
                wake = loop.create_future()
                done = [t for t in running if t.done()]
                if not done:  # the hedge is due (one per read at most)
                    timer = None
                    nxt = self.best(peers, exclude=tried)
                    if nxt is not None and self._take_hedge_token():
                        self.hedges_sent += 1
                        nxt.stats.hedges += 1
                        launch(nxt, True)
                    continue
                for t in done:
                    p, hedged, _ = running.pop(t)
                    exc = t.exception()
                    if exc is None:
                        self._succeeded(p)
                        if hedged:
                            self.hedges_won += 1
                            p.stats.hedges_won += 1
                        for lp, lhedged, started in running.values():
                            if not lhedged:
                                self._lost(lp, started)
                        return t.result(), p
                    if not isinstance(exc, UpstreamError):
                        raise exc
                    self._failed(p)
                    last_exc = exc
                if not running:
                    nxt = self.choose(peers, exclude=tried)
                    if nxt is None:
                        assert last_exc is not None
                        raise last_exc
                    launch(nxt, False)
        finally:
            if timer is not None:
                timer.cancel()
            for t in running:
                t.remove_done_callback(rouse)
                if t.done():
                    t.cancelled() or t.exception()  # retrieved: no "never retrieved" warning
                else:
                    t.cancel()

    # ------------------------------------------------------------------ health

    def _succeeded(self, p: Peer) -> None:
        self.health[p].failures = 0

    def _failed(self, p: Peer) -> None:
        self.health[p].failures += 1
        if self.health[p].failures >= self.settings.eject_after and not self.health[p].ejected:
            self._eject(p)

    def _lost(self, p: Peer, started: float) -> None:
        """A first request overtaken by its hedge: what it waited is a lower bound of its
        latency, and losing counts as a failure (a stalled peer loses every time)."""
        p.stats.observe(time.perf_counter() - started)
        p.unanswered_since = min(p.unanswered_since or started, started)
        self._failed(p)

    def _eject(self, p: Peer) -> None:
        self.health[p].ejected = True
        p.stats.ejections += 1
        self.health[p].backoff = self.settings.probe_backoff_s
        self.health[p].next_probe = time.monotonic() + self.health[p].backoff

    def _schedule_probes(self, peers: list[Peer], key: str) -> None:
        """Probe (in the background, reading the same key) every ejected peer due for a retry
        and every healthy one not measured for `refresh_s`."""
        now = time.monotonic()
        refresh = len(peers) > 1   # a lone peer's estimate chooses nothing
        for p in peers:
            if self.health[p].probing or not (self.health[p].ejected or refresh):
                continue
            if self.health[p].ejected:
                due = self.health[p].next_probe
            elif p.unanswered_since:
                due = 0.0  # suspect: find out now whether it answers at all
            else:
                due = p.stats.last_sample + self.settings.refresh_s
            if (self.health[p].ejected or p.stats.last_sample) and now >= due and not p.inflight:
                self.health[p].probing = True
                t = asyncio.get_running_loop().create_task(self._probe(p, key))
                self._background.add(t)
                t.add_done_callback(self._background.discard)

    async def _probe(self, p: Peer, key: str) -> None:
        p.stats.probes += 1
        try:
            await p.get(key, self.timeout)
        except UpstreamError:
            if self.health[p].ejected:
                self.health[p].backoff = min(self.settings.probe_backoff_max_s, self.health[p].backoff * 2)
                self.health[p].next_probe = time.monotonic() + self.health[p].backoff
            else:
                self._failed(p)
        else:
            self.health[p].failures = 0
            if self.health[p].ejected:
                self.health[p].ejected = False
                p.stats.restart()
        finally:
            self.health[p].probing = False
