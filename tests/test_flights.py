"""Coalesced reads to NATS (kvcache/read/flights.py) and the rule they follow
(kvcache.read.policy.may_join), in the quick tier: real asyncio, a stand-in router whose
answers the test releases when it chooses and whose requests it counts, and a settable clock.
The same reads against real servers: tests/test_stampede.py."""
from __future__ import annotations

import asyncio

import pytest

from kvcache.entry import Entry
from kvcache.errors import ReplyBudget, ReplyTooLarge, UpstreamError
from kvcache.read.flights import Flight, Flights, answer_of
from kvcache.read.policy import may_join

MS = 1_000_000


def flight(strong: bool = False, sent_ns: int | None = None) -> Flight:
    f = Flight(strong, None)  # type: ignore[arg-type]  # the rule reads no answer
    f.sent_ns = sent_ns
    return f


# ---------------------------------------------------------------- the rule


def test_a_plain_read_joins_a_request_sent_within_its_bound():
    assert may_join(flight(sent_ns=1_000 * MS), 1_500 * MS, False, 500)      # sent 500 ms before
    assert may_join(flight(sent_ns=1_600 * MS), 1_500 * MS, False, 500)      # sent after it arrived
    assert not may_join(flight(sent_ns=999 * MS), 1_500 * MS, False, 500)    # 501 ms before: older
    assert may_join(flight(sent_ns=None), 1_500 * MS, False, 0)              # not sent yet
    assert not may_join(flight(sent_ns=1_499 * MS), 1_500 * MS, False, 0)    # MAXSTALE 0


def test_a_plain_read_may_join_a_strong_request():
    assert may_join(flight(strong=True, sent_ns=1_400 * MS), 1_500 * MS, False, 500)


def test_a_strong_read_joins_only_a_strong_request_sent_after_it_arrived():
    arrived = 1_500 * MS
    assert not may_join(flight(strong=True, sent_ns=arrived - 1), arrived, True, 60_000)
    assert may_join(flight(strong=True, sent_ns=arrived), arrived, True, 60_000)
    assert may_join(flight(strong=True, sent_ns=None), arrived, True, 60_000)
    assert not may_join(flight(strong=False, sent_ns=None), arrived, True, 60_000)  # a peer's answer
    assert not may_join(flight(strong=False, sent_ns=arrived + 1), arrived, True, 60_000)


# ---------------------------------------------------------------- the requests


class Router:
    """Router.get_from / get_many_from as Flights calls them: each request counted, each held
    until the test releases it (or fails it)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, tuple[str, ...], bool]] = []
        self.release = asyncio.Event()
        self.error: Exception | None = None
        self.revision = 7

    async def get_from(self, bucket: str, key: str, strong: bool = False):
        self.requests.append(("one", (key,), strong))
        await self.release.wait()
        if self.error is not None:
            raise self.error
        return Entry(bucket, key, b"v-" + key.encode(), self.revision, 1), "main." + bucket

    async def get_many_from(self, bucket: str, keys: list[str], budget: ReplyBudget | None = None):
        self.requests.append(("many", tuple(keys), False))
        await self.release.wait()
        if self.error is not None:
            raise self.error
        if budget is not None:
            for key in keys:
                budget.spend(len(key) + 2)
        return ({k: Entry(bucket, k, b"v-" + k.encode(), self.revision, 1) for k in keys},
                dict.fromkeys(keys, "main." + bucket))


class Clock:
    def __init__(self) -> None:
        self.now = 10_000 * MS

    def __call__(self) -> int:
        return self.now


async def read(fl: Flights, key: str, arrived: int, strong: bool = False, bound_ms: int = 1000):
    """What kvcache.read.reads does with a key that must ask NATS: join, or send."""
    f = fl.find("b", key, arrived, strong, bound_ms)
    own = f is None
    if own:
        f = fl.one("b", key, strong)
    return await answer_of(f, own)


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_concurrent_reads_of_one_key_send_one_request():
    router, clock = Router(), Clock()
    fl = Flights(router, may_join, clock)
    readers = [asyncio.create_task(read(fl, "hot", clock.now)) for _ in range(100)]
    await settle()
    clock.now += 5 * MS  # later arrivals, within the bound, join the request in flight
    readers += [asyncio.create_task(read(fl, "hot", clock.now)) for _ in range(100)]
    await settle()
    router.release.set()
    answers = await asyncio.gather(*readers)
    assert router.requests == [("one", ("hot",), False)]
    assert {(e.value, e.revision, by) for e, by in answers} == {(b"v-hot", 7, "main.b")}
    assert len(fl) == 0  # nothing left in flight once answered
    await read(fl, "hot", clock.now)  # a read after the answer sends a new request
    assert len(router.requests) == 2


async def test_a_plain_read_never_joins_a_request_older_than_its_bound():
    router, clock = Router(), Clock()
    fl = Flights(router, may_join, clock)
    first = asyncio.create_task(read(fl, "k", clock.now))
    await settle()  # sent at clock.now
    clock.now += 300 * MS
    late = asyncio.create_task(read(fl, "k", clock.now, bound_ms=200))   # sent 300 ms ago: too old
    within = asyncio.create_task(read(fl, "k", clock.now, bound_ms=500))  # within its bound: joins
    await settle()
    router.release.set()
    await asyncio.gather(first, late, within)
    assert [r[1] for r in router.requests] == [("k",), ("k",)]


async def test_a_strong_read_never_joins_a_request_sent_before_it_arrived():
    router, clock = Router(), Clock()
    fl = Flights(router, may_join, clock)
    plain = asyncio.create_task(read(fl, "k", clock.now))
    await settle()
    strong = asyncio.create_task(read(fl, "k", clock.now, strong=True))  # the plain one was sent
    await settle()
    clock.now += 1
    strong2 = asyncio.create_task(read(fl, "k", clock.now, strong=True))  # arrived after that one was sent
    await settle()
    router.release.set()
    await asyncio.gather(plain, strong, strong2)
    assert router.requests == [("one", ("k",), False), ("one", ("k",), True), ("one", ("k",), True)]


async def test_strong_reads_of_one_turn_share_a_request_not_yet_sent():
    router, clock = Router(), Clock()
    fl = Flights(router, may_join, clock)
    readers = [asyncio.create_task(read(fl, "k", clock.now, strong=True)) for _ in range(10)]
    await settle()
    router.release.set()
    await asyncio.gather(*readers)
    assert router.requests == [("one", ("k",), True)]


async def test_a_reader_that_goes_away_does_not_cancel_the_others():
    router, clock = Router(), Clock()
    fl = Flights(router, may_join, clock)
    first = asyncio.create_task(read(fl, "k", clock.now))
    other = asyncio.create_task(read(fl, "k", clock.now))
    await settle()
    first.cancel()  # the client that sent the request disconnected
    await settle()
    router.release.set()
    entry, _ = await other
    assert entry.value == b"v-k" and len(router.requests) == 1


async def test_a_failure_reaches_every_reader_of_the_request():
    router, clock = Router(), Clock()
    router.error = UpstreamError("no peer")
    fl = Flights(router, may_join, clock)
    readers = [asyncio.create_task(read(fl, "k", clock.now)) for _ in range(3)]
    await settle()
    router.release.set()
    results = await asyncio.gather(*readers, return_exceptions=True)
    assert all(isinstance(r, UpstreamError) for r in results) and len(router.requests) == 1


async def test_keys_of_a_batch_are_joined_by_single_reads_and_other_batches():
    router, clock = Router(), Clock()
    fl = Flights(router, may_join, clock)
    batch = fl.many("b", ["a", "c"], None)
    single = asyncio.create_task(read(fl, "c", clock.now))
    await settle()
    assert fl.find("b", "a", clock.now, False, 1000) is batch["a"]
    assert fl.find("b", "z", clock.now, False, 1000) is None
    router.release.set()
    entry, _ = await single
    assert entry.key == "c" and router.requests == [("many", ("a", "c"), False)]
    assert (await answer_of(batch["a"], True))[0].key == "a"


async def test_a_joined_batch_over_its_senders_budget_is_not_the_joiners_error():
    router, clock = Router(), Clock()
    fl = Flights(router, may_join, clock)
    batch = fl.many("b", ["a", "c"], ReplyBudget(1))  # its sender allows 1 byte of values
    joined = fl.find("b", "c", clock.now, False, 1000)
    assert joined is batch["c"]
    router.release.set()
    with pytest.raises(ReplyTooLarge):
        await answer_of(batch["a"], True)   # the sender's own error
    with pytest.raises(LookupError):
        await answer_of(joined, False)      # a joiner asks on its own instead
