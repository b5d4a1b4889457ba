"""Requests in flight (kvcache.read.flights) at their edges: a batch's keys carry the moment
the batch was sent (a later read joins it only within its bound) and are never strong (a
strong read never joins one); a key a batch's answer left out is answered not-found, by
nobody; a task cancelled before it answered cancels its readers' wait rather than leaving them
hanging; a joined batch over its sender's budget is a LookupError for the joiner. Real asyncio,
the stand-in router of tests/test_flights.py, a set clock."""
from __future__ import annotations

import asyncio

import pytest
from test_flights import MS, Clock, Router, flight, settle

from kvcache.errors import ReplyBudget
from kvcache.read.flights import Flights, _retrieve, answer_of
from kvcache.read.policy import may_join


async def test_a_batch_is_sent_at_a_moment_and_is_not_strong():
    router, clock = Router(), Clock()
    fl = Flights(router, may_join, clock)
    batch = fl.many("b", ["a"], None)
    assert not batch["a"].strong
    await settle()
    assert batch["a"].sent_ns == clock.now
    assert fl.find("b", "a", clock.now, True, 1000) is None  # strong: never a batch's answer
    clock.now += 2000 * MS
    assert fl.find("b", "a", clock.now, False, 1000) is None  # sent 2 s before: too old
    assert fl.find("b", "a", clock.now, False, 3000) is batch["a"]
    router.release.set()
    e, by = await answer_of(batch["a"], True)
    assert (e.key, by) == ("a", "main.b")  # who answered: the near cache's fill asks


async def test_a_key_the_batchs_answer_left_out_is_not_found_by_nobody():
    class Partial(Router):
        async def get_many_from(self, bucket, keys, budget=None):
            self.requests.append(("many", tuple(keys), False))
            return {}, {}

    fl = Flights(Partial(), may_join, Clock())
    batch = fl.many("b", ["a"], None)
    assert await answer_of(batch["a"], True) == (None, "")


async def test_a_task_cancelled_before_it_answered_cancels_the_wait_and_leaves_nothing_in_flight():
    router, clock = Router(), Clock()
    fl = Flights(router, may_join, clock)
    batch = fl.many("b", ["a", "c"], None)
    await settle()
    for task in asyncio.all_tasks():
        if task is not asyncio.current_task():
            task.cancel()
    await settle()
    assert batch["a"].future.cancelled() and batch["c"].future.cancelled()
    assert len(fl) == 0


async def test_a_joiner_of_a_batch_over_its_senders_budget_gets_lookup_error():
    router, clock = Router(), Clock()
    fl = Flights(router, may_join, clock)
    batch = fl.many("b", ["a", "c"], ReplyBudget(1))
    router.release.set()
    with pytest.raises(LookupError, match="joined batch over its sender's budget"):
        await answer_of(batch["a"], False)


async def test_a_failed_request_with_no_reader_left_is_marked_seen():
    loop = asyncio.get_running_loop()
    failed = loop.create_future()
    failed.set_exception(RuntimeError("no reader"))
    _retrieve(failed)
    assert failed._log_traceback is False  # asyncio will not log "exception was never retrieved"
    cancelled = loop.create_future()
    cancelled.cancel()
    _retrieve(cancelled)  # a cancelled one has no exception to mark: no error either


def test_a_plain_read_does_not_join_a_request_one_ns_older_than_its_bound():
    arrived = 1_500 * MS
    assert may_join(flight(sent_ns=arrived - 500 * MS), arrived, False, 500)
    assert not may_join(flight(sent_ns=arrived - 500 * MS - 1), arrived, False, 500)
