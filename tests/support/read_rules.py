"""Judge every answer a sidecar gave against what the writer had acknowledged, by the rules a read
form promises (docs/commands.md, docs/configuration.md "Staleness"). Pure: it takes the writer's
acknowledgements (support.staleness_check.Acks: key, revision, ack time) and the answers the
readers recorded, and starts nothing, so the quick tier proves it on hand-made histories with
wrong answers in them (tests/test_read_rules.py) before a live run trusts it
(tests/test_read_matrix_live.py).

An answer is one key's value as one read handed it out: its revision (None: not found), when
the read was sent (time.monotonic(), the writer's clock too), on which connection, and what the
read promised. The rules, each a kind of violation:

- **stale**: a revision below the key's newest acknowledged more than `bound_ms` before the
  read was sent (the bucket's max_stale_ms, or MAXSTALE; not found while one was).
- **strong**: for CONSISTENCY strong (`bound_ms` None), below any revision acknowledged
  before the read was sent.
- **minrev**: for MINREV r, not the bucket as of r or later: below the key's newest revision
  at or below r (the key's own write at r, or its last before another key's write at r).
- **back**: below what an earlier answer on the same connection handed out for the key (a
  not-found after a value too: the keys here are never deleted).
- **error**: an error where the read's documented errors (`errors`, regular expressions)
  do not allow one.
"""
from __future__ import annotations

import bisect
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from support.staleness_check import Acks


@dataclass(frozen=True)
class Answer:
    """One key's answer. `revision` None: not found (or, with `error`, no answer)."""

    form: str                   # the read form (GET, MGET, KV.GET strong, ...)
    state: str                  # the feed's state when it was sent
    conn: str                   # the connection (or client cache) that handed it out
    key: str
    sent: float                 # time.monotonic() when the read was sent
    revision: int | None
    bound_ms: float | None      # the read's staleness bound; None: CONSISTENCY strong
    source: str = ""            # as the reply names it ("" when it does not)
    error: str = ""             # the error reply, "" for an answer
    min_rev: int | None = None  # MINREV
    errors: tuple[str, ...] = ()  # the errors the docs allow this read here (regexes)


@dataclass(frozen=True)
class Violation:
    answer: Answer
    rule: str                   # stale, strong, minrev, back, error
    detail: str

    def __str__(self) -> str:
        a = self.answer
        got = f"error {a.error!r}" if a.error else f"revision {a.revision}"
        return (f"{self.rule}: {a.form} of {a.key} [{a.state}] on {a.conn} sent at {a.sent:.3f} "
                f"answered {got} from {a.source or '?'}: {self.detail}")


@dataclass
class Cell:
    """One row of the summary: a form in a state."""

    reads: int = 0
    errors: int = 0
    sources: set[str] = field(default_factory=set)
    violations: int = 0


class ReadRules:
    """Checks answers against `acks` (every write's key, revision and ack time; a key's initial
    write included). `check` returns the violations and keeps a summary per form and state."""

    def __init__(self, acks: Acks) -> None:
        self.acks = acks
        self.cells: dict[tuple[str, str], Cell] = {}
        self.violations: list[Violation] = []

    def newest_acked(self, key: str, by: float) -> int:
        """The key's newest revision acknowledged at or before `by` (0: none)."""
        got = self.acks.newest_by(key, by)
        return 0 if got is None else got[1]

    def newest_at(self, key: str, revision: int) -> int:
        """The key's newest revision at or below `revision` (0: none): what the bucket as of
        that revision holds for the key."""
        revs = self.acks.revisions.get(key, [])   # a running maximum: sorted
        i = bisect.bisect_right(revs, revision) - 1
        return revs[i] if i >= 0 else 0

    def check(self, answers: Iterable[Answer]) -> list[Violation]:
        found: list[Violation] = []
        high: dict[tuple[str, str], int] = {}
        for a in sorted(answers, key=lambda a: (a.conn, a.sent)):
            cell = self.cells.setdefault((a.form, a.state), Cell())
            cell.reads += 1
            if a.source:
                cell.sources.add(a.source)
            bad = self._judge(a, high)
            if a.error:
                cell.errors += 1
            if bad is not None:
                cell.violations += 1
                found.append(bad)
        self.violations += found
        return found

    def _judge(self, a: Answer, high: dict[tuple[str, str], int]) -> Violation | None:
        if a.error:
            if any(re.search(p, a.error) for p in a.errors):
                return None
            return Violation(a, "error", "no documented error for this read here")
        have = -1 if a.revision is None else a.revision
        if a.bound_ms is None:
            need = self.newest_acked(a.key, a.sent)
            if need and have < need:
                return Violation(a, "strong", f"revision {need} was acknowledged before the read")
        else:
            need = self.newest_acked(a.key, a.sent - a.bound_ms / 1000)
            if need and have < need:
                return Violation(a, "stale", f"revision {need} was acknowledged more than "
                                             f"{a.bound_ms:.0f} ms before the read")
        if a.min_rev is not None:
            need = self.newest_at(a.key, a.min_rev)
            if need and have < need:
                return Violation(a, "minrev", f"the bucket at revision {a.min_rev} holds the key at {need}")
        k = (a.conn, a.key)
        before = high.get(k)
        if before is not None and have < before:
            return Violation(a, "back", f"the same connection was handed revision {before} before")
        high[k] = max(have, before or -1)
        return None

    def table(self) -> str:
        """form x state: reads, errors, sources seen, violations."""
        states = list(dict.fromkeys(s for _, s in self.cells))
        forms = list(dict.fromkeys(f for f, _ in self.cells))
        rows = [["form", *states]]
        for form in forms:
            row = [form]
            for state in states:
                c = self.cells.get((form, state))
                row.append("-" if c is None else
                           f"{c.reads} reads, {c.errors} err, {c.violations} bad, {'/'.join(sorted(c.sources)) or '-'}")
            rows.append(row)
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [" | ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
        lines.insert(1, "-|-".join("-" * w for w in widths))
        return "\n".join(lines)
