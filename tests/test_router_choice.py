"""The router's decisions in process (kvcache.read.router): which peer a read goes to, when it
is hedged and to whom, failover, ejection and probes, the revision floors and the read again
from other peers. The peers are scripted (a kvcache.read.peer.Peer whose requests are
answered by the test, the way tests/support/guarantees_world.py stands for NATS); the router,
its floors and its asyncio are the real ones. What a real server answers and how a peer times
it is tests/test_peer_live.py's and tests/test_routing.py's.

Choices drawn at random use a seeded random.Random, so each count below is one fixed number;
the bounds around it are those of the distribution, not of a timing.
"""
from __future__ import annotations

import asyncio
import random

import pytest

from kvcache.entry import Entry
from kvcache.errors import BehindQuorum, UpstreamError
from kvcache.feed.quorum import NO_FENCE, Fence
from kvcache.read.ledger import Floors
from kvcache.read.peer import Peer
from kvcache.read.router import PeerHealth, Router, RouterSettings

# A mutant that leaves a read waiting forever fails in seconds, not at the suite's 300 s.
pytestmark = pytest.mark.timeout(10)

B = "b"


class Conn:
    """What the router reads of a peer's connection: whether it is up."""

    def __init__(self) -> None:
        self.is_connected = True


class Scripted(Peer):
    """A peer answering from `answers`; `mode` ok, fail (UpstreamError), behind (BehindQuorum)
    or boom (a bug: ValueError); with `gate` set, each request waits for it first."""

    answers: dict
    mode: str
    asked: list
    gate: asyncio.Future | None
    cancelled: int
    timeouts: list     # the timeout of each request
    budgets: list      # get_many's budget

    async def get(self, key, timeout, leader=False, fence=NO_FENCE):
        self.timeouts.append(timeout)
        return (await self._answer([key], leader, fence))[key]

    async def get_many(self, keys, timeout, up_to_seq=None, budget=None, fence=NO_FENCE):
        self.timeouts.append(timeout)
        self.budgets.append(budget)
        return await self._answer(keys, None, fence)

    async def _answer(self, keys, leader, fence):
        self.asked.append((tuple(keys), leader, fence))
        try:
            if self.gate is not None:
                await asyncio.shield(self.gate)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if self.mode == "fail":
            raise UpstreamError(f"{self.name} failed")
        if self.mode == "behind":
            raise BehindQuorum(f"{self.name} behind")
        if self.mode == "boom":
            raise ValueError("boom")
        return {k: self.answers.get(k) for k in keys}


def peer(name: str, bucket: str = B, stream: str | None = None, ewma: float = 0.0, **answers: int | None) -> Scripted:
    p = Scripted(name, Conn(), stream or f"KV_{bucket}", bucket)  # type: ignore[arg-type]
    p.answers = {k: None if r is None else entry(k, r, bucket, name) for k, r in answers.items()}
    p.mode, p.asked, p.gate, p.cancelled, p.timeouts, p.budgets = "ok", [], None, 0, [], []
    if ewma:
        measured(p, ewma)
    return p


def entry(key: str, rev: int, bucket: str = B, source: str = "x") -> Entry:
    return Entry(bucket, key, b"v%d" % rev, rev, 1, source=source)


def measured(p: Peer, us: float, n: int = 1) -> Peer:
    """A peer measured at `us` (its estimate and `n` samples)."""
    p.stats.ewma_us = us
    p.stats.last_sample = 1.0
    for _ in range(n):
        p.stats.samples.append(us)
    p.stats._fresh = 16
    return p


def router(*peers: Peer, seed: int = 7, **settings) -> Router:
    r = Router(1.0, RouterSettings(**settings), rng=random.Random(seed))
    for p in peers:
        r.add(p)
    return r


# --------------------------------------------------------------------------- set-up and INFO


def test_defaults_are_the_tuned_ones():
    """The defaults the sidecar runs with (it passes no settings): a change must be deliberate."""
    s = RouterSettings()
    assert (s.hedge_ratio, s.hedge_burst, s.hedge_min_s, s.hedge_default_s, s.hedge_percentile) == (
        0.10, 10.0, 0.0005, 0.05, 0.95)
    assert (s.hedge_patience, s.eject_after, s.probe_backoff_s, s.probe_backoff_max_s, s.refresh_s) == (
        True, 3, 0.5, 30.0, 0.25)
    assert PeerHealth() == PeerHealth(0, False, 0.0, 0.0, False)
    r = Router(2.5)
    assert r.timeout == 2.5 and r.settings == s
    assert r._tokens == 10.0 and (r.requests, r.hedges_sent, r.hedges_won) == (0, 0, 0)
    assert r.fence(B) is NO_FENCE and r._fence(B) is NO_FENCE
    assert r.floors.max_age(B) == 0


def test_the_floors_and_fence_given_are_used():
    floors = Floors()
    assert Router(1.0, floors=floors).floors is floors
    assert Router(1.0, max_age=lambda b: 7).floors.max_age(B) == 7
    fence = Fence(5, "k")
    assert Router(1.0, fence={B: fence}.get)._fence(B) is fence
    with pytest.raises(UpstreamError, match=r"^bucket b: no quorum of its servers has shown its state within "
                                            r"max_stale_ms \(a partition, or no stream leader\)$"):
        Router(1.0, fence={"other": fence}.get)._fence(B)


def test_the_rng_given_draws_every_choice():
    def choices(r: Router, ps: list[Peer]) -> list[str]:
        return [r.choose(ps).name for _ in range(60)]
    ps = [peer("a", ewma=10), peer("b", ewma=11), peer("c", ewma=12)]
    picks = [choices(router(*ps, seed=3), ps) for _ in range(2)]
    assert picks[0] == picks[1] and set(picks[0]) == {"a", "b"}   # of two, never the costliest
    unseeded = Router(1.0)
    for p in ps:
        unseeded.add(p)
    assert unseeded.choose(ps) in ps


def test_peers_state_and_info_rows():
    a, b, c = peer("a"), peer("b"), peer("main", bucket="other")
    r = router(a, b, c)
    assert list(r.peers()) == [a, b, c]
    assert r.health[a] == PeerHealth()
    b.nc.is_connected = False
    r.health[c].ejected = True
    assert [r.state(p) for p in (a, b, c)] == ["up", "down", "ejected"]
    for us in range(1, 201):
        a.stats.samples.append(float(us))
    a._started[0] = 0.0
    a.stats.hedges_won, a.stats.ejections, a.stats.probes = 4, 5, 6
    r.requests, r.hedges_sent, r.hedges_won, r.strong_evidence_asked = 9, 8, 7, 3
    rows = r.info_rows()
    assert rows[:5] == [("routed_requests", 9), ("hedges_sent", 8), ("hedges_won", 7), ("hedge_budget_ratio", 0.10),
                        ("strong_evidence_requests", 3)]
    assert rows[5] == ("a", "p50_us=101,p95_us=191,p99_us=199,inflight=1,hedges_won=4,ejections=5,probes=6")
    assert [label for label, _ in rows[6:]] == ["b", "main.other"]


def test_bucket_peers_strong_takes_the_buckets_own_stream():
    up, mirror = peer("up"), peer("m", stream="KV_b_mirror")
    r = router(up, mirror)
    assert r._bucket_peers(B, False) == [up, mirror]
    assert r._bucket_peers(B, True) == [up]
    with pytest.raises(UpstreamError, match=r"^no peer can read bucket nope$"):
        r._bucket_peers("nope", False)
    r2 = router(mirror)
    with pytest.raises(UpstreamError, match=r"^no peer can read bucket b from its leader$"):
        r2._bucket_peers(B, True)


# --------------------------------------------------------------------------- choice


def test_choose_from_none_one_and_excluded():
    a, b = peer("a", ewma=10), peer("b", ewma=10)
    r = router(a, b)
    assert r.choose([]) is None
    assert r.choose([a]) is a
    assert r.choose([a, b], exclude=[a]) is b
    assert r.choose([a, b], exclude=[a, b]) is None


def test_an_unmeasured_peer_goes_first_unless_busy():
    a, fresh = peer("a", ewma=0.5), peer("fresh")   # both cost 1 µs (the floor)
    r = router(a, fresh)
    assert all(r.choose([a, fresh]) is fresh for _ in range(20))
    fresh._started[0] = 0.0  # its first request is on the way
    fresh.stats.ewma_us = 1e9
    assert all(r.choose([a, fresh]) is a for _ in range(20))


def test_the_better_of_two_and_never_the_costliest_of_three():
    a, b, slow = peer("a", ewma=100), peer("b", ewma=100), peer("slow", ewma=10_000)
    r = router(a, b, slow)
    got = [r.choose([a, b, slow]).name for _ in range(400)]
    assert "slow" not in got
    assert 100 < got.count("a") < 300   # equal peers share the reads
    # of two, always the cheaper, even below 2 µs (costs are floored at 1 µs, not above)
    x, y = peer("x", ewma=1.2), peer("y", ewma=1.9)
    r2 = router(x, y)
    assert all(r2.choose([x, y]) is x for _ in range(50))
    z = measured(peer("z"), 0.0)  # a cost of 0 is floored at 1 µs: no division by zero
    assert router(x, z).choose([x, z]) in (x, z)


def test_draws_weigh_by_the_inverse_square_of_cost():
    a, b = peer("a"), peer("b")
    r = router(a, b, seed=1)
    costs = {id(a): 1.0, id(b): 2.0}
    n = sum(r._draw([a, b], costs) is a for _ in range(4000))
    assert 0.77 < n / 4000 < 0.83   # weights 1 : 1/4, so 0.8


def test_the_pool_is_the_healthy_then_the_not_ejected_then_all():
    a, b, c = peer("a"), peer("b"), peer("c")
    r = router(a, b, c)
    assert r._pool([a, b, c], [b]) == [a, c]
    r.health[a].ejected = True
    b.unanswered_since = 5.0
    c.nc.is_connected = False
    assert r._pool([a, b, c], []) == [b, c]         # no healthy one: the ones not ejected
    c.nc.is_connected = True
    assert r._pool([a, b, c], []) == [c]
    r.health[b].ejected = r.health[c].ejected = True
    assert r._pool([a, b, c], [c]) == [a, b]         # every one ejected: all of them


def test_best_is_the_cheapest_healthy_one():
    a, b, c = peer("a", ewma=30), peer("b", ewma=20), peer("c", ewma=10)
    r = router(a, b, c)
    assert r.best([a, b, c]) is c
    assert r.best([a, b, c], exclude=[c]) is b
    r.health[b].ejected = True
    assert r.best([a, b, c], exclude=[c]) is a
    assert r.best([a], exclude=[a]) is None


def test_cost_counts_the_queue_and_the_oldest_unanswered_request():
    p = measured(peer("p"), 100.0)
    assert p.cost(50.0) == 100.0
    p._started[0] = 49.999          # 1000 µs old, more than the estimate: it counts
    p._started[1] = 49.9999
    assert p.cost(50.0) == pytest.approx(1000.0 * 3)
    p._started.clear()
    p.unanswered_since = 49.998     # a cancelled request overtaken by a hedge, 2 ms ago
    assert p.cost(50.0) == pytest.approx(2000.0)
    p._started[0] = 49.999          # the older of the two counts
    assert p.cost(50.0) == pytest.approx(2000.0 * 2)
    p.unanswered_since = 49.9999
    assert p.cost(50.0) == pytest.approx(1000.0 * 2)


def test_hedge_delay():
    a, b = peer("a"), peer("b")
    for us in range(1, 101):
        a.stats.samples.append(us * 100.0)   # p95 9600 µs, p99 10000 µs
    a.stats.ewma_us, a.stats.last_sample = 5000.0, 1.0
    r = router(a, b, hedge_min_s=0.0001)
    assert r.hedge_delay(a, [a]) == 9600 / 1e6                     # its own p95
    measured(b, 9000.0)
    assert r.hedge_delay(a, [a, b]) == pytest.approx(0.0096)       # the alternative is not slower than its p99
    measured(b, 10_000.0)
    assert r.hedge_delay(a, [a, b]) == pytest.approx(0.0096)       # as slow as its p99 is not slower
    measured(b, 20_000.0)
    assert r.hedge_delay(a, [a, b]) == pytest.approx(0.020)        # ...it is: wait as long as it would take
    d = peer("d")
    for us in range(1, 201):
        d.stats.samples.append(us * 100.0)  # p99 19900 µs, the slowest 20000
    d.stats.last_sample = 1.0
    measured(b, 19_950.0)
    assert router(d, b).hedge_delay(d, [d, b]) == pytest.approx(0.01995)   # past its p99, not its slowest
    assert router(a, b, hedge_patience=False).hedge_delay(a, [a, b]) == pytest.approx(0.0096)
    assert router(a, b, hedge_percentile=0.5).hedge_delay(a, [a]) == pytest.approx(0.0051)
    # an unmeasured primary is timed by the best measured peer that is not ejected
    fresh, c = peer("fresh"), measured(peer("c"), 3000.0)
    r2 = router(fresh, b, c)
    assert r2.hedge_delay(fresh, [fresh, b, c]) == pytest.approx(0.003)
    r2.health[c].ejected = True
    assert r2.hedge_delay(fresh, [fresh, b, c]) == pytest.approx(0.020)
    assert r2.hedge_delay(fresh, [fresh]) == pytest.approx(0.05)    # nobody measured: the default
    assert router(fresh, hedge_default_s=0.2).hedge_delay(fresh, [fresh]) == pytest.approx(0.2)
    # never sooner than hedge_min_s
    assert router(a, hedge_min_s=0.5).hedge_delay(a, [a]) == 0.5
    assert Router(1.0).hedge_delay(measured(peer("q"), 1.0), []) == 0.0005


def test_hedge_tokens_refill_by_the_ratio_up_to_the_burst():
    r = router(peer("a"), hedge_burst=2.0, hedge_ratio=0.5)
    assert [r._take_hedge_token() for _ in range(3)] == [True, True, False]
    r._tokens = 0.999
    assert not r._take_hedge_token() and r._tokens == 0.999
    r._tokens = 1.0
    assert r._take_hedge_token() and r._tokens == 0.0


# --------------------------------------------------------------------------- one routed request


async def test_a_lone_peer_is_awaited_and_its_failures_counted():
    p = peer("p", k=3)
    r = router(p, hedge_burst=5.0, hedge_ratio=0.25)
    r._tokens = 1.0
    r.health[p].failures = 2
    got, by = await r._route([p], lambda q: q.get("k", 1.0), hedge=True)
    assert (got.revision, by, r.health[p].failures, r.requests) == (3, p, 0, 1)
    assert r._tokens == 1.25
    p.mode = "fail"
    for n in (1, 2):
        with pytest.raises(UpstreamError, match=r"p failed"):
            await r._route([p], lambda q: q.get("k", 1.0), hedge=True)
        assert r.health[p].failures == n and not r.health[p].ejected
    with pytest.raises(UpstreamError):
        await r._route([p], lambda q: q.get("k", 1.0), hedge=True)
    assert r.health[p].ejected and p.stats.ejections == 1
    assert r.requests == 4 and r._tokens == 2.0
    r._tokens = 4.9
    p.mode = "ok"
    await r._route([p], lambda q: q.get("k", 1.0), hedge=True)
    assert r._tokens == 5.0    # up to the burst, no further


async def test_errors_fail_over_at_once_and_the_last_error_is_raised():
    a, b, c = peer("a", ewma=10, k=1), peer("b", ewma=20, k=2), peer("c", ewma=30, k=3)
    r = router(a, b, c)
    a.mode = c.mode = "fail"
    r.health[b].failures = 2
    got, by = await r._route([a, b, c], lambda q: q.get("k", 1.0), hedge=False)
    assert (got.revision, by) == (2, b)
    assert r.health[a].failures == 1 and r.health[b].failures == 0 and not c.asked
    assert (r.hedges_sent, r.hedges_won, b.stats.hedges_won) == (0, 0, 0)   # a failover is no hedge
    b.mode = "fail"
    with pytest.raises(UpstreamError, match=r"^c failed$"):   # the last one tried
        await r._route([a, b, c], lambda q: q.get("k", 1.0), hedge=False)
    assert [len(p.asked) for p in (a, b, c)] == [2, 2, 1]
    b.mode = "boom"                                           # a bug is no failover
    a.mode = "ok"
    r.health[a].ejected = True
    with pytest.raises(ValueError):
        await r._route([a, b], lambda q: q.get("k", 1.0), hedge=False)
    assert len(a.asked) == 2


def test_failures_eject_once_with_a_backoff(monkeypatch):
    p = peer("p")
    r = router(p, eject_after=2, probe_backoff_s=0.7)
    monkeypatch.setattr("kvcache.read.router.time.monotonic", lambda: 100.0)
    r._failed(p)
    assert r.health[p] == PeerHealth(failures=1)
    r._failed(p)
    assert r.health[p] == PeerHealth(2, True, 0.7, 100.7, False) and p.stats.ejections == 1
    r.health[p].backoff = 5.0
    r._failed(p)                         # already ejected: not again
    assert r.health[p] == PeerHealth(3, True, 5.0, 100.7, False) and p.stats.ejections == 1
    r._succeeded(p)
    assert r.health[p].failures == 0
    r.health[p].ejected = False          # probed back
    r._failed(p)
    r._failed(p)
    assert p.stats.ejections == 2


def test_a_request_overtaken_by_its_hedge_counts_as_unanswered(monkeypatch):
    p = measured(peer("p"), 100.0)
    r = router(p)
    monkeypatch.setattr("kvcache.read.router.time.perf_counter", lambda: 10.0)
    r._lost(p, 9.99)
    assert p.unanswered_since == 9.99 and r.health[p].failures == 1
    assert p.stats.ewma_us == pytest.approx(10_000.0) and len(p.stats.samples) == 2
    r._lost(p, 9.995)                    # a later one keeps the older moment
    assert p.unanswered_since == 9.99
    r._lost(p, 9.9)
    assert p.unanswered_since == 9.9


def hedging(*peers: Peer, **settings) -> Router:
    return router(*peers, **{"hedge_min_s": 0.001, "hedge_default_s": 0.001, **settings})


async def test_a_late_request_is_hedged_to_the_best_other_peer_which_wins():
    a, b, c = peer("a", ewma=10, k=1), peer("b", ewma=20, k=2), peer("c", ewma=40, k=3)
    r = hedging(a, b, c)
    a.gate = asyncio.get_running_loop().create_future()
    got, by = await r._route([a, b, c], lambda q: q.get("k", 1.0), hedge=True)
    assert (got.revision, by) == (2, b) and not c.asked
    assert (r.hedges_sent, r.hedges_won, b.stats.hedges, b.stats.hedges_won) == (1, 1, 1, 1)
    await asyncio.sleep(0)   # the cancelled request's turn
    assert a.cancelled == 1 and a.unanswered_since > 0 and r.health[a].failures == 1
    assert len(a.stats.samples) == 2 and r._tokens == 9.0
    a.unanswered_since, a.stats.ewma_us = 0.0, 10.0    # a is the one chosen again
    await r._route([a, b, c], lambda q: q.get("k", 1.0), hedge=True)
    assert (r.hedges_sent, r.hedges_won, b.stats.hedges, b.stats.hedges_won) == (2, 2, 2, 2)
    a.gate.cancel()


async def test_the_first_answer_wins_over_its_hedge():
    a, b = peer("a", ewma=10, k=1), peer("b", ewma=20, k=2)
    r = hedging(a, b)
    a.gate = asyncio.get_running_loop().create_future()
    b.gate = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(r._route([a, b], lambda q: q.get("k", 1.0), hedge=True))
    while not b.asked:
        await asyncio.sleep(0.001)
    a.gate.set_result(None)
    got, by = await task
    assert (got.revision, by) == (1, a)
    assert (r.hedges_sent, r.hedges_won, b.stats.hedges, b.stats.hedges_won) == (1, 0, 1, 0)
    await asyncio.sleep(0)
    assert b.cancelled == 1 and not b.unanswered_since and r.health[b].failures == 0
    b.gate.cancel()


async def test_a_failed_hedge_leaves_the_first_request_running():
    a, b = peer("a", ewma=10, k=1), peer("b", ewma=20, k=2)
    r = hedging(a, b)
    a.gate = asyncio.get_running_loop().create_future()
    b.mode = "fail"
    task = asyncio.ensure_future(r._route([a, b], lambda q: q.get("k", 1.0), hedge=True))
    while not r.health[b].failures:
        await asyncio.sleep(0.001)
    assert not task.done()
    a.gate.set_result(None)
    assert (await task)[1] is a and r.hedges_sent == 1


@pytest.mark.parametrize("why", ["no hedge asked", "no token"])
async def test_no_hedge_without_asking_or_a_token(why):
    a, b = peer("a", ewma=10, k=1), peer("b", ewma=20, k=2)
    r = hedging(a, b, hedge_ratio=0.0)
    if why == "no token":
        r._tokens = 0.0
    a.gate = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(r._route([a, b], lambda q: q.get("k", 1.0), hedge=why == "no token"))
    # the hedge would be due after 1 ms; a timer due sooner runs first, and the router's
    # wake-up is queued before this test's
    await asyncio.sleep(0.05)
    assert r.hedges_sent == 0 and not b.asked and not task.done()
    a.gate.set_result(None)
    assert (await task)[1] is a


async def test_no_second_hedge_when_none_is_left_to_ask():
    a = peer("a", ewma=10, k=1)
    b = peer("b", ewma=10, k=2)
    r = hedging(a, b)
    a.gate = asyncio.get_running_loop().create_future()
    b.gate = a.gate
    task = asyncio.ensure_future(r._route([a, b], lambda q: q.get("k", 1.0), hedge=True))
    while not (a.asked and b.asked):
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.02)
    assert r.hedges_sent == 1 and r._tokens == 9.0
    a.gate.set_result(None)
    assert (await task)[0].revision in (1, 2)


# --------------------------------------------------------------------------- probes


async def probed(r: Router, peers: list[Peer], key: str = "k") -> list[asyncio.Task]:
    r._schedule_probes(peers, key)
    tasks = list(r._background)
    await asyncio.gather(*tasks)
    return tasks


async def test_an_ejected_peer_is_probed_when_due_and_comes_back_unmeasured():
    import time
    p = measured(peer("p", k=1), 500.0, n=3)
    r = router(p, probe_backoff_s=0.5, probe_backoff_max_s=1.5)
    r._eject(p)
    assert r.health[p].next_probe == pytest.approx(time.monotonic() + 0.5, abs=0.2)
    assert await probed(r, [p]) == [] and not p.asked       # not due yet
    r.health[p].next_probe = time.monotonic() - 0.001
    p.mode = "fail"
    assert len(await probed(r, [p])) == 1 and p.asked == [(("k",), False, NO_FENCE)]
    h = r.health[p]
    assert h.ejected and h.backoff == 1.0 and h.next_probe == pytest.approx(time.monotonic() + 1.0, abs=0.2)
    assert not h.probing and p.stats.probes == 1 and h.failures == 0
    h.next_probe = 0.0
    await probed(r, [p])
    assert h.backoff == 1.5 and h.next_probe == pytest.approx(time.monotonic() + 1.5, abs=0.2)
    h.next_probe, p.mode, h.failures = 0.0, "ok", 2
    await probed(r, [p])
    assert not h.ejected and h.failures == 0 and p.stats.probes == 3
    assert p.stats.ewma_us == 0.0 and not p.stats.samples and not p.stats.last_sample


async def test_healthy_peers_are_probed_when_not_measured_for_a_while():
    import time
    now = time.monotonic()
    old, recent, never, suspect, busy = (peer(n, k=1) for n in ("old", "recent", "never", "suspect", "busy"))
    for p, at in ((old, now - 1.0), (recent, now + 60), (suspect, now + 60), (busy, now - 1.0)):
        measured(p, 100.0).stats.last_sample = at
    suspect.unanswered_since = 1.0
    busy._started[0] = 0.0
    ps = [old, recent, never, suspect, busy]
    r = router(*ps, refresh_s=0.25)
    await probed(r, ps)
    assert [p.name for p in ps if p.asked] == ["old", "suspect"]
    assert (old.stats.probes, r.health[old].failures) == (1, 0)
    old.mode = "fail"
    old.stats.last_sample = now - 1.0
    await probed(r, ps)
    assert r.health[old].failures == 1 and not r.health[old].ejected
    # a lone healthy peer is never probed: its estimate chooses nothing
    old.mode = "ok"
    await probed(r, [old])
    assert len(old.asked) == 2
    # and one being probed is not probed again
    old.gate = asyncio.get_running_loop().create_future()
    r._schedule_probes(ps, "k")
    first = list(r._background)
    r._schedule_probes(ps, "k")
    assert len(r._background) == len(first) and r.health[old].probing
    await r.close()
    assert all(t.cancelled() for t in first)
    r.health[old].probing = False
    r.health[old].ejected = True
    r.health[old].next_probe = now - 1.0
    old.gate = None
    await probed(r, [old])      # a lone peer ejected is probed (the cancelled probe never asked)
    assert len(old.asked) == 3 and old.stats.probes == 3


async def test_close_cancels_the_probes_still_running():
    p, q = measured(peer("p", k=1), 10.0), measured(peer("q", k=1), 10.0)
    p.stats.last_sample = q.stats.last_sample = 0.001
    p.gate = asyncio.get_running_loop().create_future()
    r = router(p, q)
    r._schedule_probes([p, q], "k")
    running = list(r._background)
    assert len(running) == 2
    await asyncio.wait_for(r.close(), 5)
    assert all(t.done() for t in running) and p.cancelled == 1
    await Router(1.0).close()


# --------------------------------------------------------------------------- reads and floors


async def test_get_from_reads_with_the_fence_and_keeps_the_floor():
    fence = Fence(9, "anchor")
    a = peer("a", k=5)
    r = Router(1.0, fence=lambda b: fence)
    r.add(a)
    e, by = await r.get_from(B, "k")
    assert (e.revision, by) == (5, "a") and a.asked == [(("k",), False, fence)]
    assert r.floors.below(B, "k", entry("k", 4))
    assert (await r.get(B, "k", strong=True)).revision == 5 and a.asked[-1][1] is True
    a.answers["k"] = entry("k", 3)                # a strong read's answer is the leader's: no read again
    e, by = await r.get_from(B, "k", strong=True)
    assert (e.revision, by) == (3, "a")


async def test_an_answer_behind_the_floor_is_read_again_elsewhere():
    lag, fresh = peer("lag", ewma=10, k=3), peer("fresh", ewma=1000, k=6)
    r = router(lag, fresh, refresh_s=1e9)
    r.floors.saw(B, "k", entry("k", 5))
    e, by = await r.get_from(B, "k")
    assert (e.revision, by) == (6, "") and [len(lag.asked), len(fresh.asked)] == [1, 1]
    assert r.floors.below(B, "k", entry("k", 5))
    got, answered = await r.get_many_from(B, ["k", "j"])
    assert got == {"k": fresh.answers["k"], "j": None} and answered == {"k": "", "j": "lag"}
    assert fresh.asked[-1][0] == ("k",)
    lag.answers["j"] = entry("j", 2)
    got, answered = await r.get_many_from(B, ["j"])
    assert answered == {"j": "lag"} and r.floors.below(B, "j", entry("j", 1))
    assert await r.get_many(B, ["j"]) == {"j": lag.answers["j"]}


async def test_catch_up_asks_healthy_peers_then_the_leader_then_the_rest():
    up = peer("up", ewma=50, k=1)                    # the bucket's own stream
    m1 = peer("m1", stream="KV_b_m1", ewma=30, k=1)
    m2 = peer("m2", stream="KV_b_m2", ewma=10, k=1)
    sick = peer("sick", stream="KV_b_s", ewma=1, k=1)
    stale = peer("stale", stream="KV_b_x", k=1)
    r = router(up, m1, m2, sick, stale)
    r.health[sick].ejected = True
    for key in ("k", "j"):
        r.floors.saw(B, key, entry(key, 5))
    ps = [up, m1, m2, sick, stale]
    with pytest.raises(UpstreamError, match=r"every reachable peer was behind a revision already read "
                                             r"of key k and 1 more$"):
        await r._catch_up(B, ["k", "j"], stale, ps)
    order = [p.name for p in ps for _ in p.asked]
    assert not stale.asked
    asked = [(p.name, q) for p in (m2, m1, up, sick) for q in p.asked]
    assert asked == [("m2", (("k", "j"), None, NO_FENCE)), ("m1", (("k", "j"), None, NO_FENCE)),
                     ("up", (("k", "j"), None, NO_FENCE)), ("up", (("k",), True, NO_FENCE)),
                     ("up", (("j",), True, NO_FENCE)), ("sick", (("k", "j"), None, NO_FENCE))]
    assert len(order) == 6
    # the order itself: healthy by cost, then the leader, then the unhealthy
    seq: list[str] = []
    for p in ps:
        p.asked = _Log(seq, p.name)
    up.answers["j"] = entry("j", 5)
    m1.answers["k"] = entry("k", 7)
    got = await r._catch_up(B, ["k", "j"], stale, ps, Fence(3))
    assert seq == ["m2", "m1", "up"] and got == {"k": m1.answers["k"], "j": up.answers["j"]}
    assert m1.asked == [(("k", "j"), None, Fence(3))] and up.asked == [(("j",), False, Fence(3))]


class _Log(list):
    def __init__(self, seq: list, name: str) -> None:
        super().__init__()
        self.seq, self.name = seq, name

    def append(self, item) -> None:
        self.seq.append(self.name + ("!" if item[1] else ""))
        super().append(item)


async def test_a_peer_passed_over_does_not_end_the_probes():
    import time
    busy, due = measured(peer("busy", k=1), 10.0), measured(peer("due", k=1), 10.0)
    due.stats.last_sample = time.monotonic() - 1.0
    r = router(busy, due)
    r.health[busy].probing = True
    await probed(r, [busy, due])
    assert not busy.asked and len(due.asked) == 1


async def test_reads_go_with_the_routers_timeout_budget_and_fence():
    from kvcache.errors import ReplyBudget
    fence = Fence(4, "a")
    up, m = peer("up", ewma=10, k=1), peer("m", stream="KV_b_m", ewma=20, k=1)
    r = Router(2.5, RouterSettings(), rng=random.Random(1), fence={B: fence}.get)
    for p in (up, m):
        r.add(p)
    budget = ReplyBudget(100)
    assert (await r.get_many(B, ["k", "j"], budget)) == {"k": up.answers["k"], "j": None}
    assert up.budgets == [budget] and up.asked[-1] == (("k", "j"), None, fence)
    await r.get(B, "k")
    assert up.asked[-1] == (("k",), False, fence)
    r.floors.saw(B, "k", entry("k", 2))
    m.answers["k"] = entry("k", 2)
    await r.get_from(B, "k")                           # read again: single key
    assert m.asked[-1] == (("k",), False, fence)
    await r.get_many_from(B, ["k", "j"])               # ...and many (j: at its floor)
    r.floors.saw(B, "j", entry("j", 1))
    m.answers["j"] = entry("j", 1)
    await r.get_many_from(B, ["k", "j"])
    assert m.asked[-1] == (("k", "j"), None, fence)
    r2 = Router(2.5, rng=random.Random(1))
    for p in (up, peer("up2", ewma=20, k=1)):
        r2.add(p)
    r2.floors.saw(B, "k", entry("k", 9))
    with pytest.raises(UpstreamError):
        await r2.get_from(B, "k")                      # ... and the leader's reads
    m.stats.last_sample = up.stats.last_sample = 0.001
    await r.get_from(B, "k")                           # and a probe
    await asyncio.gather(*r._background)
    assert {t for p in (up, m) for t in p.timeouts} == {2.5}
    assert any(q[0] == ("k",) and q[1] is False for q in m.asked[-2:])


async def test_a_strong_read_asks_only_the_buckets_own_stream():
    up, m = peer("up", ewma=50, k=1), peer("m", stream="KV_b_m", ewma=1, k=2)
    r = router(up, m, refresh_s=1e9)
    for _ in range(5):
        assert (await r.get_from(B, "k", strong=True)) == (up.answers["k"], "up")
    assert not m.asked and all(q[1] is True for q in up.asked)
    assert (await r.get(B, "k")).revision == 2                       # not strong by default
    assert m.asked == [(("k",), False, NO_FENCE)]
    lone = router(m)
    assert await lone.get_many(B, ["k"]) == {"k": m.answers["k"]}    # MGET reads mirrors


async def test_a_read_is_hedged_and_its_idle_peers_probed_on_the_way():
    import time
    a, b = peer("a", ewma=10, k=1), peer("b", ewma=20, k=2)
    r = hedging(a, b)
    b.stats.last_sample = time.monotonic() + 60
    a.gate = asyncio.get_running_loop().create_future()
    assert await r.get_from(B, "k") == (b.answers["k"], "b")
    assert r.hedges_sent == 1
    a.gate.cancel()
    c = measured(peer("c", k=3), 10.0)
    d = measured(peer("d", k=4), 10.0)
    c.stats.last_sample = d.stats.last_sample = time.monotonic() - 10
    r2 = router(c, d)
    await r2.get_from(B, "key")
    await asyncio.gather(*r2._background)
    assert {q[0] for q in c.asked + d.asked} == {("key",)} and len(c.asked + d.asked) == 3


@pytest.mark.parametrize("form", ["many", "leader"])
async def test_no_hedge_for_mget_or_leader_reads(form):
    a, b = peer("a", ewma=10, k=1), peer("b", ewma=20, k=2)
    r = hedging(a, b)
    a.gate = asyncio.get_running_loop().create_future()
    if form == "many":
        task = asyncio.ensure_future(r.get_many(B, ["k"]))
    else:
        task = asyncio.ensure_future(r._from_leader([a, b], ["k"], {}))
    await asyncio.sleep(0.05)       # the hedge would be due after 1 ms (see above)
    assert r.hedges_sent == 0 and not b.asked
    a.gate.set_result(None)
    await task


async def test_an_answer_at_its_floor_keeps_its_source():
    lag = peer("lag", ewma=10, k=5)
    r = router(lag, peer("other", ewma=20, k=9), refresh_s=1e9)
    r.floors.saw(B, "k", entry("k", 5))
    assert (await r.get_from(B, "k")) == (lag.answers["k"], "lag")
    assert (await r.get_many_from(B, ["k"]))[1] == {"k": "lag"}


async def test_a_read_again_skips_peers_as_far_behind_and_raises_the_floor():
    lag, mid, fresh = peer("lag", ewma=10, k=3), peer("mid", ewma=20, k=4), peer("fresh", ewma=1000, k=6)
    r = router(lag, mid, fresh, refresh_s=1e9)
    r.floors.saw(B, "k", entry("k", 5))
    assert (await r.get_from(B, "k")) == (fresh.answers["k"], "")
    fresh.answers["k"] = entry("k", 7)
    got, answered = await r.get_many_from(B, ["k"])
    assert got["k"].revision == 7 and answered == {"k": ""}
    assert r.floors.below(B, "k", entry("k", 6))
    assert len(lag.asked) == 2 and len(mid.asked) == 2   # the lagging one is not asked again


async def test_catch_up_places_the_leader_before_any_unhealthy_peer_and_names_the_last_error():
    up = peer("up", k=1)
    sick = peer("sick", stream="KV_b_s", k=1)           # unmeasured: cost 0, like the leader's
    stale = peer("stale", stream="KV_b_x", k=1)
    r = router(up, sick, stale)
    r.health[sick].ejected = True
    r.health[up].ejected = True
    r.floors.saw(B, "k", entry("k", 5))
    seq: list[str] = []
    for p in (up, sick, stale):
        p.asked = _Log(seq, p.name)
    sick.mode = "fail"
    with pytest.raises(UpstreamError, match=r"^bucket b: every reachable peer was behind a revision already "
                                            r"read of key k \(last error: sick failed\)$"):
        await r._catch_up(B, ["k"], stale, [up, sick, stale])
    assert seq == ["up!", "up", "sick"] and r.health[sick].failures == 1
    up.mode = "fail"
    with pytest.raises(UpstreamError, match=r"\(last error: up failed\)$"):
        await r._catch_up(B, ["k"], stale, [up, stale])
    with pytest.raises(UpstreamError, match=r"read of key k$"):
        await router(stale)._catch_up(B, ["k"], stale, [stale])
