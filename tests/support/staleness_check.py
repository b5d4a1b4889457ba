"""Judge a partition run's reads against the writer's acknowledgements (tests/test_partition.py,
bench/partition_bench.py). Pure: it reads two logs and starts nothing, so the quick tier tests
it on hand-made logs (tests/test_staleness_check.py).

The writer (support/partition_load.py, in its own network namespace) puts each key's own
counter as the value (b"0", b"1", ...), one put of a key at a time, and logs every
acknowledged put as `ack <key> <counter> <revision> <ack time>`. The readers (on the sidecar's
Unix socket) log every read as `read <conn> <kind> <key> <sent> <received> <status> <counter>
<revision>`. Times are CLOCK_MONOTONIC seconds, one clock for every namespace of a kernel, so
the two logs compare.

The rules, per read sent at `sent` answering counter `c` of key `k` (nil: no value):

- **stale**: `c` is lower than (or nil while there is) the counter of a put of `k`
  acknowledged more than `max_stale_ms` before `sent`. The sidecar promises nothing newer than
  that bound; anything older broke it.
- **strong** reads (`KV.GET ... CONSISTENCY strong`, kind `strong`) promise every write
  acknowledged before they were sent: they are judged by the same rule with a bound of 0.
- **regression**: `c` is lower than (or nil after) a counter an earlier read of `k` on the same
  connection answered, whatever the kinds of the two reads (a plain read after a strong one
  must not go back either). Keys are never deleted, so a nil after a value goes back too.
- **succeeded**: the read had a reply that is not an error (a stale answer succeeded; it is
  counted as stale apart), within the reader's timeout.
- **availability**, **recovery** and the longest outage are the plain reads' (`get`,
  `kv.get`): a strong read needs the stream's leader and is expected to fail while the
  sidecar cannot reach it; its successes are counted apart (`Verdict.strong_*`).
- **availability**: each connection's timeline is cut at the moments it sent a read; the stretch
  from one read's send to the next read's send (the last one: to its reply) is available when
  that read succeeded. Availability is the available share of all connections' timelines inside
  the window (from the fault's start to the end of the run): time spent waiting for an error or
  a timeout, and the pause after it, is what the fault cost the application.
- **recovery**: the time from the heal to the reply of the last read that failed or was stale
  (0 when none came after the heal); None (not recovered) when no read succeeded fresh after it.
"""
from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

OK, NIL = "ok", "nil"               # a value; no value (both are successful replies)
STRONG = "strong"                   # the kind of a KV.GET ... CONSISTENCY strong read
FAILED = ("err", "timeout", "conn")  # an error reply; no reply in time; could not connect/send


@dataclass(frozen=True)
class Read:
    conn: int
    kind: str        # "get", "kv.get" or "strong" (KV.GET ... CONSISTENCY strong)
    key: str
    sent: float
    recv: float
    status: str      # ok, nil, err, timeout, conn
    counter: int = -1
    revision: int = -1

    @property
    def succeeded(self) -> bool:
        return self.status in (OK, NIL)


@dataclass
class Acks:
    """Every key's acknowledged puts in ack-time order: times, counters (a running max, so one
    bisect answers "the newest counter acknowledged by then"), revisions."""

    times: dict[str, list[float]] = field(default_factory=dict)
    counters: dict[str, list[int]] = field(default_factory=dict)
    revisions: dict[str, list[int]] = field(default_factory=dict)
    count: int = 0

    @classmethod
    def of(cls, rows: Iterable[tuple[str, int, int, float]]) -> Acks:
        """From (key, counter, revision, ack time) rows, in any order."""
        acks = cls()
        per: dict[str, list[tuple[float, int, int]]] = {}
        for key, counter, rev, t in rows:
            per.setdefault(key, []).append((t, counter, rev))
            acks.count += 1
        for key, rows_k in per.items():
            rows_k.sort()
            high, hrev = -1, -1
            ts, cs, rs = [], [], []
            for t, c, r in rows_k:
                if c > high:
                    high, hrev = c, r
                ts.append(t)
                cs.append(high)
                rs.append(hrev)
            acks.times[key], acks.counters[key], acks.revisions[key] = ts, cs, rs
        return acks

    def newest_by(self, key: str, t: float) -> tuple[int, int, float] | None:
        """(counter, revision, ack time) of the newest put of `key` acknowledged at or before
        `t`; None if none was."""
        ts = self.times.get(key)
        if not ts:
            return None
        i = bisect.bisect_right(ts, t) - 1
        if i < 0:
            return None
        # the ack that set the running max: walk back to where the max was first reached
        c = self.counters[key][i]
        j = i
        while j > 0 and self.counters[key][j - 1] == c:
            j -= 1
        return c, self.revisions[key][i], ts[j]


@dataclass(frozen=True)
class StaleRead:
    read: Read
    newest_counter: int
    newest_revision: int
    newest_ack: float

    @property
    def age_ms(self) -> float:
        """How long before the read the newer put had been acknowledged."""
        return (self.read.sent - self.newest_ack) * 1000

    def describe(self, t0: float = 0.0) -> str:
        r = self.read
        got = "nil" if r.status == NIL else f"counter {r.counter}" + (
            f" rev {r.revision}" if r.revision >= 0 else "")
        return (f"key {r.key} ({r.kind}, conn {r.conn}) sent at {r.sent - t0:+.3f}s answered {got}; "
                f"newest acknowledged: counter {self.newest_counter} rev {self.newest_revision} "
                f"acked at {self.newest_ack - t0:+.3f}s ({self.age_ms:.0f} ms before the read)")


@dataclass(frozen=True)
class Regression:
    read: Read
    before: int   # the highest counter this connection had read of the key

    def describe(self, t0: float = 0.0) -> str:
        r = self.read
        got = "nil" if r.status == NIL else f"counter {r.counter}"
        return (f"key {r.key} ({r.kind}, conn {r.conn}) sent at {r.sent - t0:+.3f}s answered {got} "
                f"after counter {self.before} on the same connection")


@dataclass
class Verdict:
    reads: int = 0               # every read of the run
    window_reads: int = 0        # reads sent inside the window
    window_ok: int = 0
    availability: float = 1.0    # 0..1, see the module's doc
    stale: list[StaleRead] = field(default_factory=list)
    regressions: list[Regression] = field(default_factory=list)
    recovery_s: float | None = 0.0
    # the longest stretch of the window with no fresh successful read (by reply time, any
    # connection): the worst time from the fault to serving again
    outage_s: float = 0.0
    acks: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    strong_reads: int = 0        # strong reads of the run (judged with a bound of 0)
    strong_ok: int = 0           # of which succeeded
    strong_stale: int = 0        # of which stale (also in `stale`)

    @property
    def succeeded_pct(self) -> float:
        return 100.0 * self.window_ok / self.window_reads if self.window_reads else 0.0

    @property
    def worst_stale(self) -> StaleRead | None:
        return max(self.stale, key=lambda s: s.age_ms, default=None)


def judge(acks: Acks, reads: Iterable[Read], max_stale_ms: float, window: tuple[float, float],
          heal: float, strong_bound_ms: float = 0.0) -> Verdict:
    """Judge `reads` (any order) against `acks`; `window` = (fault start, end of the run),
    `heal` = when the fault was healed (every time CLOCK_MONOTONIC seconds). Plain reads are
    judged at `max_stale_ms`, strong ones at `strong_bound_ms`."""
    bounds = {STRONG: strong_bound_ms / 1000.0}
    plain_bound = max_stale_ms / 1000.0
    v = Verdict(acks=acks.count)
    rows = sorted(reads, key=lambda r: (r.conn, r.sent))
    v.reads = len(rows)
    high: dict[tuple[int, str], int] = {}
    bad: set[int] = set()   # the reads that failed or were stale
    for i, r in enumerate(rows):
        strong = r.kind == STRONG
        v.strong_reads += strong
        if not r.succeeded:
            v.failures[r.status] = v.failures.get(r.status, 0) + 1
            bad.add(i)
            continue
        v.strong_ok += strong
        newest = acks.newest_by(r.key, r.sent - bounds.get(r.kind, plain_bound))
        if newest is not None and (r.status == NIL or r.counter < newest[0]):
            v.stale.append(StaleRead(r, *newest))
            v.strong_stale += strong
            bad.add(i)
        have = r.counter if r.status == OK else -1
        before = high.get((r.conn, r.key))
        if before is not None and have < before:
            v.regressions.append(Regression(r, before))
        else:
            high[(r.conn, r.key)] = have
    _timeline(v, [(r, i not in bad) for i, r in enumerate(rows) if r.kind != STRONG], window, heal)
    return v


def _timeline(v: Verdict, rows: list[tuple[Read, bool]], window: tuple[float, float], heal: float) -> None:
    """Availability, the longest outage and recovery from the plain reads, (read, fresh and
    successful) in (connection, sent) order."""
    w0, w1 = window
    bad_until = None       # reply time of the last failed or stale read
    last_good = None       # reply time of the last fresh successful read
    good: list[float] = []  # reply times of the fresh successful reads
    avail = total = 0.0
    for i, (r, fine) in enumerate(rows):
        if not fine:
            bad_until = r.recv if bad_until is None else max(bad_until, r.recv)
        else:
            good.append(r.recv)
            if last_good is None or r.recv > last_good:
                last_good = r.recv
        if w0 <= r.sent < w1:
            v.window_reads += 1
            v.window_ok += r.succeeded
        # this read's stretch of its connection's timeline, clipped to the window
        nxt = rows[i + 1][0] if i + 1 < len(rows) and rows[i + 1][0].conn == r.conn else None
        end = nxt.sent if nxt is not None else r.recv
        a, b = max(r.sent, w0), min(max(end, r.sent), w1)
        if b > a:
            total += b - a
            if r.succeeded:
                avail += b - a
    v.availability = avail / total if total else 1.0
    marks = [w0, *sorted(t for t in good if w0 < t < w1), w1]
    v.outage_s = max(b - a for a, b in itertools.pairwise(marks))
    if bad_until is None or bad_until <= heal:
        v.recovery_s = 0.0
    elif last_good is None or last_good <= bad_until:
        v.recovery_s = None
    else:
        v.recovery_s = bad_until - heal


# ----------------------------------------------------------------------------- the logs

def read_acks(path: str | Path) -> Acks:
    rows = []
    with open(path) as f:
        for line in f:
            p = line.split()
            if p and p[0] == "ack":
                rows.append((p[1], int(p[2]), int(p[3]), float(p[4])))
    return Acks.of(rows)


def read_reads(path: str | Path) -> list[Read]:
    out = []
    with open(path) as f:
        for line in f:
            p = line.split()
            if p and p[0] == "read":
                out.append(Read(int(p[1]), p[2], p[3], float(p[4]), float(p[5]), p[6], int(p[7]), int(p[8])))
    return out


# ----------------------------------------------------------------------------- the table

COLUMNS = ("fault", "reads", "succeeded %", "availability %", "longest outage s", "stale", "regressions",
           "recovery s", "writes acked", "strong ok/stale")


def row(fault: str, v: Verdict) -> dict[str, str]:
    rec = "not recovered" if v.recovery_s is None else f"{v.recovery_s:.2f}"
    return {"fault": fault, "reads": f"{v.reads:,}", "succeeded %": f"{v.succeeded_pct:.1f}",
            "availability %": f"{100 * v.availability:.1f}", "longest outage s": f"{v.outage_s:.2f}",
            "stale": f"{len(v.stale):,}",
            "regressions": f"{len(v.regressions):,}", "recovery s": rec, "writes acked": f"{v.acks:,}",
            "strong ok/stale": f"{v.strong_ok:,}/{v.strong_stale:,}"}


def table(rows: list[dict[str, str]]) -> str:
    cols = list(COLUMNS)
    widths = {c: max(len(c), *(len(r.get(c, "")) for r in rows)) for c in cols}
    lines = [" | ".join(c.ljust(widths[c]) for c in cols), "-|-".join("-" * widths[c] for c in cols)]
    lines += [" | ".join(r.get(c, "").ljust(widths[c]) for c in cols) for r in rows]
    return "\n".join(lines)
