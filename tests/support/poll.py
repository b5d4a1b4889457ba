"""The one poller of the test suite: wait until a condition holds, or fail saying what was
awaited, for how long, and the last value or error seen (plus, when given, a detail such as
the sidecar's log). One exception type, WaitTimeout, an AssertionError: a wait that times out
is a test failure, whichever helper waited."""
from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

INTERVAL_S = 0.05


class WaitTimeout(AssertionError):
    """A condition did not hold within its timeout."""


def _timeout(what: str, timeout: float, last: Any, err: BaseException | None,
             detail: Callable[[], str] | None) -> WaitTimeout:
    text = f"timed out after {timeout:g}s waiting for {what}; last value {last!r}"
    if err is not None:
        text += f", last error {err!r}"
    if detail is not None:
        text += "\n" + detail()
    return WaitTimeout(text)


def wait_until(predicate: Callable[[], Any], timeout: float, what: str,
               interval: float = INTERVAL_S, detail: Callable[[], str] | None = None) -> Any:
    """Poll `predicate` until it returns something truthy (that value is returned); an
    exception it raises counts as "not yet". WaitTimeout at the deadline."""
    deadline = time.monotonic() + timeout
    last: Any = None
    err: BaseException | None = None
    while True:
        try:
            last = predicate()
            if last:
                return last
            err = None
        except Exception as e:
            err = e
        if time.monotonic() >= deadline:
            raise _timeout(what, timeout, last, err, detail)
        time.sleep(interval)


async def until(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition",
                interval: float = INTERVAL_S, detail: Callable[[], str] | None = None) -> Any:
    """wait_until for a coroutine: `predicate` may be sync or async."""
    deadline = time.monotonic() + timeout
    last: Any = None
    err: BaseException | None = None
    while True:
        try:
            last = predicate()
            if inspect.isawaitable(last):
                last = await last
            if last:
                return last
            err = None
        except Exception as e:
            err = e
        if time.monotonic() >= deadline:
            raise _timeout(what, timeout, last, err, detail)
        await asyncio.sleep(interval)
