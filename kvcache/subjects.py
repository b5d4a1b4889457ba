"""NATS subject filters over KV keys: one matcher for every place that asks whether a key
falls under a filter (a bucket's replicated set, a purge request's filter)."""
from __future__ import annotations


def subject_match(pattern: str, key: str) -> bool:
    """Does `key` match the filter `pattern` (`*` one token, `>` one or more at the end)?"""
    if pattern == ">":
        return True
    pt, kt = pattern.split("."), key.split(".")
    for i, p in enumerate(pt):
        if p == ">":
            return len(kt) > i
        if i >= len(kt) or (p != "*" and p != kt[i]):
            return False
    return len(pt) == len(kt)
