"""Reads to NATS in flight, shared: concurrent reads of one key that must ask NATS send one
request, not one each.

A hot key outside a bucket's filters (or any key while the replica is stale) is read by many
connections at the same moment, and without this each sends its own Direct Get: NATS pays
for a key as many times as it has concurrent readers, exactly when it is hottest. Here each
request in flight is kept per (bucket, key) with the moment it was sent, and a read that must
ask NATS joins one when the read policy says the answer would keep the read's guarantees
(ReadPolicy.may_join; the argument is in docs/architecture.md, "Coalesced reads"):

- a plain read joins a request sent no earlier than its staleness bound allows (the answer
  shows the bucket as of some moment after the request was sent);
- a strong read (CONSISTENCY strong) joins only a strong request sent after it arrived;
- a MINREV read joins as a plain one, then checks the answer's revision and asks the leader
  on its own when it is below (kvcache.read.reads, which also decides whether an answer below
  the revision is the key's right one or the revision is beyond the bucket).

A request is sent by a task of its own, started on the next turn of the event loop: a reader
that goes away (its client disconnects) does not cancel the others' answer, and every read of
the key that arrives in the same turn joins a request not yet sent (`sent_ns` None), which
suits even a strong read. The answers are the router's (`get_from`, `get_many_from`: floors,
fences and catch-up applied once, at the end of the request, after every joined read
arrived); each read then applies its own newest-wins, fill and stale decisions. An MGET's
misses join the requests in flight for their keys and send the rest as one batch, whose keys
others may join in turn.

The reads that joined are counted by kvcache.read.reads (INFO `reads_coalesced`: the stampede
a hot key would have been).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from ..errors import ReplyBudget, ReplyTooLarge

if TYPE_CHECKING:
    from ..entry import Entry
    from .router import Router

# A key's answer: the entry (None: not found) and who answered (Router.get_from)
Answer = tuple["Entry | None", str]


class Flight:
    """One key's request to NATS: strong (the leader) or not, when it was sent (monotonic ns;
    None until its task starts), and the answer's future, shared by every read that joins."""

    __slots__ = ("future", "sent_ns", "strong")

    def __init__(self, strong: bool, future: asyncio.Future[Answer]) -> None:
        self.strong = strong
        self.sent_ns: int | None = None
        self.future = future


JoinRule = Callable[[Flight, int, bool, int], bool]


class Flights:
    """The requests in flight of one sidecar, by (bucket, key); see the module docstring."""

    def __init__(self, router: Router, may_join: JoinRule,
                 clock: Callable[[], int] = time.monotonic_ns) -> None:
        self.router = router
        self.may_join = may_join
        self.clock = clock
        self._by_key: dict[tuple[str, str], Flight] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def find(self, bucket: str, key: str, arrived_ns: int, strong: bool, bound_ms: int) -> Flight | None:
        """The request in flight for the key that a read arrived at `arrived_ns` may join, or
        None (it sends its own)."""
        flight = self._by_key.get((bucket, key))
        if flight is None or flight.future.done() or not self.may_join(flight, arrived_ns, strong, bound_ms):
            return None
        return flight

    def one(self, bucket: str, key: str, strong: bool) -> Flight:
        """Send a request for one key (Router.get_from) and keep it in flight for others."""
        flight = self._flight(bucket, key, strong)
        self._launch(self._one(bucket, key, strong, flight), [(bucket, key, flight)])
        return flight

    def many(self, bucket: str, keys: list[str], budget: ReplyBudget | None) -> dict[str, Flight]:
        """Send one batched request for keys of one bucket (Router.get_many_from, charged to
        `budget`) and keep each key in flight for others."""
        flights = {key: self._flight(bucket, key, False) for key in keys}
        self._launch(self._many(bucket, keys, budget, flights),
                     [(bucket, key, f) for key, f in flights.items()])
        return flights

    def _flight(self, bucket: str, key: str, strong: bool) -> Flight:
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        future.add_done_callback(_retrieve)
        flight = Flight(strong, future)
        self._by_key[(bucket, key)] = flight
        return flight

    def _launch(self, coro: Coroutine[Any, Any, None], flights: list[tuple[str, str, Flight]]) -> None:
        task = asyncio.get_running_loop().create_task(coro)

        def landed(_: asyncio.Task) -> None:
            for bucket, key, flight in flights:
                if self._by_key.get((bucket, key)) is flight:
                    del self._by_key[(bucket, key)]
                if not flight.future.done():  # the task was cancelled before it answered
                    flight.future.cancel()
        task.add_done_callback(landed)

    async def _one(self, bucket: str, key: str, strong: bool, flight: Flight) -> None:
        flight.sent_ns = self.clock()
        try:
            answer = await self.router.get_from(bucket, key, strong=strong)
        except Exception as e:  # every reader of the key gets it, and decides for itself
            flight.future.set_exception(e)
        else:
            flight.future.set_result(answer)

    async def _many(self, bucket: str, keys: list[str], budget: ReplyBudget | None,
                    flights: dict[str, Flight]) -> None:
        now = self.clock()
        for f in flights.values():
            f.sent_ns = now
        try:
            found, answered = await self.router.get_many_from(bucket, keys, budget)
        except Exception as e:
            for f in flights.values():
                f.future.set_exception(e)
        else:
            for key, f in flights.items():
                f.future.set_result((found.get(key), answered.get(key, "")))


async def answer_of(flight: Flight, own: bool) -> Answer:
    """A flight's answer for one of its readers; a reader that goes away does not cancel it
    for the others (shield). ReplyTooLarge from a batch another MGET sent was that MGET's own
    budget: a reader that only joined gets LookupError instead, and asks on its own."""
    try:
        return await asyncio.shield(flight.future)
    except ReplyTooLarge:
        if own:
            raise
        raise LookupError("joined batch over its sender's budget") from None


def _retrieve(future: asyncio.Future) -> None:
    """Mark a flight's failure as seen: a request that failed with no reader left is not an
    'exception never retrieved' in the log (its readers, if any, see it themselves)."""
    if not future.cancelled():
        future.exception()
