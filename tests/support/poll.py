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


class GiveUp(AssertionError):
    """Raised by a predicate when the condition can no longer hold (the process it waits for
    has exited): the wait ends at once with it instead of polling out its timeout."""


class _Poll:
    """One wait's bookkeeping, shared by the sync and async pollers: the deadline, and the
    last value or error seen, for the failure message."""

    def __init__(self, timeout: float, what: str, detail: Callable[[], str] | None) -> None:
        self.deadline = time.monotonic() + timeout
        self.timeout, self.what, self.detail = timeout, what, detail
        self.last: Any = None
        self.err: BaseException | None = None

    def saw(self, value: Any = None, err: BaseException | None = None) -> bool:
        """Record an attempt; True when it succeeded. Raises WaitTimeout past the deadline."""
        self.last, self.err = value, err
        if err is None and value:
            return True
        if time.monotonic() >= self.deadline:
            text = f"timed out after {self.timeout:g}s waiting for {self.what}; last value {self.last!r}"
            if self.err is not None:
                text += f", last error {self.err!r}"
            if self.detail is not None:
                text += "\n" + self.detail()
            raise WaitTimeout(text)
        return False


def wait_until(predicate: Callable[[], Any], timeout: float, what: str,
               interval: float = INTERVAL_S, detail: Callable[[], str] | None = None) -> Any:
    """Poll `predicate` until it returns something truthy (that value is returned); an
    exception it raises counts as "not yet", but GiveUp, which ends the wait. WaitTimeout at
    the deadline."""
    poll = _Poll(timeout, what, detail)
    while True:
        try:
            value, err = predicate(), None
        except GiveUp:
            raise
        except Exception as e:
            value, err = None, e
        if poll.saw(value, err):
            return value
        time.sleep(interval)


async def until(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition",
                interval: float = INTERVAL_S, detail: Callable[[], str] | None = None) -> Any:
    """wait_until for a coroutine: `predicate` may be sync or async."""
    poll = _Poll(timeout, what, detail)
    while True:
        try:
            value, err = predicate(), None
            if inspect.isawaitable(value):
                value = await value
        except GiveUp:
            raise
        except Exception as e:
            value, err = None, e
        if poll.saw(value, err):
            return value
        await asyncio.sleep(interval)
