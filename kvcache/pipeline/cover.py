"""Key filters that cover a share of a bucket's reads: what to put in a bucket's `keys`.

Keys are grouped by their parent: `user.eu.42` belongs to `user.eu.*` (one more token
under `user.eu`), a one-token key is its own group. Groups are disjoint, so:
1. taking groups by reads, most read first, until the share is reached gives the fewest
   groups that cover it;
2. each chosen group is then widened to the highest prefix `p.>` under which every group seen
   in the logs was chosen too, so the filters match no key the logs show as outside the hot
   set; `>` when everything was chosen.
Pure Python over the per-group totals the Spark job computes.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Filter:
    """A key filter `kvcache hotkeys` proposes, with the reads and keys it covers."""

    filter: str
    reads: float
    keys: int


def group_of(key: str) -> str:
    """The leaf group (a key filter) a key belongs to."""
    parent, dot, _ = key.rpartition(".")
    return f"{parent}.*" if dot else key


def _prefix(group: str) -> tuple[str, ...]:
    return tuple(group[:-2].split(".")) if group.endswith(".*") else ()


def cover_filters(groups: dict[str, tuple[float, int]], cover: float) -> list[Filter]:
    """`groups`: leaf group -> (reads, distinct keys). The filters, most read first."""
    total = sum(r for r, _ in groups.values())
    if total <= 0:
        return []
    target = cover * total - 1e-9 * total
    chosen: set[str] = set()
    acc = 0.0
    for g, (reads, _keys) in sorted(groups.items(), key=lambda kv: (-kv[1][0], kv[1][1], kv[0])):
        if acc >= target:
            break
        chosen.add(g)
        acc += reads
    # every prefix -> the groups below it (the empty prefix holds them all)
    below: dict[tuple[str, ...], set[str]] = {}
    for g in groups:
        p = _prefix(g)
        for i in range(len(p) + 1):
            below.setdefault(p[:i], set()).add(g)
    merged: dict[str, list[float]] = {}
    for g in chosen:
        p = _prefix(g)
        name = g
        for i in range(len(p) + 1):  # shortest first: the highest prefix that qualifies
            if below[p[:i]] <= chosen:
                name = ".".join(p[:i]) + ".>" if i else ">"
                break
        reads, keys = groups[g]
        acc_g = merged.setdefault(name, [0.0, 0])
        acc_g[0] += reads
        acc_g[1] += keys
    return sorted((Filter(f, r, int(k)) for f, (r, k) in merged.items()),
                  key=lambda f: (-f.reads, f.filter))
