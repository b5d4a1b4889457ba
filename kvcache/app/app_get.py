"""LocalReader.get's hot path (pure-Python twin of ext/app_get.pyx; same behaviour).

    get = LocalGet(plans, fresh_until, env.begin, slow)
    value = get(key)

`plans[key]` is `(bucket, db, lmdb key, the bucket's max_age in ns or 0)`, and
`fresh_until[bucket]` the monotonic time until which the bucket counts as fresh. With both
in hand a read is one short transaction and a copy of the value; anything else (no plan yet,
freshness to check again, an LMDB error such as a map the writer grew) goes to `slow(key)`,
which does the checking, fills the dicts and returns the value itself (or raises).
"""
from __future__ import annotations

import time
from collections.abc import Callable

from ..store.record import stored_value

_monotonic = time.monotonic


class LocalGet:
    """LocalReader.get's hot path (twin of ext/app_get.pyx): a cached plan and a fresh bucket
    answer with one LMDB read; anything else goes back to LocalReader._get_checked."""

    __slots__ = ("begin", "fresh_until", "plans", "slow")

    def __init__(self, plans: dict, fresh_until: dict, begin: Callable, slow: Callable) -> None:
        self.plans = plans
        self.fresh_until = fresh_until
        self.begin = begin
        self.slow = slow

    def __call__(self, key: str) -> bytes | None:
        plan = self.plans.get(key)
        if plan is None or self.fresh_until.get(plan[0], 0.0) <= _monotonic():
            return self.slow(key)
        try:
            raw = self.begin(db=plan[1]).get(plan[2])
        except Exception:  # e.g. the writer grew the map: the slow path adopts it, retries
            return self.slow(key)
        if raw is None:
            return None
        return stored_value(raw, None, plan[3])  # (a deadline: its own TTL, or max_age)
