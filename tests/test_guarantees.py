"""The read guarantees, checked by table in process (the quick tier: no process started).

Every row is a read form x a feed state x what the sidecar already handed out x how NATS
answers (tests/support/guarantees.py: the model, and why each rule is what it is). Each row
plays its feed state on a real feed, replica, ledger, router and command layer, with a fake
clock and a scripted NATS (tests/support/guarantees_world.py), reads through a real client
connection (or LocalReader, or the stream commands), and checks every key's answer against
the model: its source among the allowed ones, its revision at or above the lowest that
source may give, an error only where one is allowed. Run with -s for the table.
"""
from __future__ import annotations

import asyncio
import os
import time

import pytest
from support import guarantees as g
from support.guarantees_world import Shared, World, play

import kvcache.app.reader
import kvcache.feed.changes
import kvcache.feed.feed
import kvcache.read.reads
from kvcache.app.client import encode_command

ROWS = [(f, s, h, u) for f in g.FORMS for s in g.STATES for h in g.HOLDING_NAMES
        for u in (g.UPSTREAM_NAMES if f.asks_nats else ("up",))]
# (row id, each key's allowed, each key's answer, seconds, keys answered below a revision
# handed out before, as the model allows for LocalReader and tracking): filled as rows run
RESULTS: list[tuple[str, str, str, float, list[str]]] = []


def _slug(text: str) -> str:
    return "-".join("".join(c if c.isalnum() else " " for c in text.lower()).split())


def _id(row) -> str:
    f, s, h, u = row
    return "/".join((_slug(f.name), _slug(s.name), h, _slug(u)))


# Rows that fail on this tree, each with why (strict: a row that passes fails the run, so a
# mark goes in the commit that fixes its cause). None today: the three causes the table found
# (a full disk vouched for, a recreated stream's index, MAXSTALE past a follower's fence) are
# fixed, each in the commit that removed its mark.

def known(form: g.Form, state: g.State, holding: str, upstream: str) -> str | None:
    """Why a row fails on this tree, or None."""
    return None


def _marks(row) -> list:
    why = known(*row)
    return [pytest.mark.xfail(strict=True, reason=why)] if why else []


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """The replica and fast paths every row shares, with the feed's and LocalReader's wall
    clock the row's story (the current world's FakeClock), a held read's wait and the
    staleness watch's period a millisecond (their outcome here is the story's)."""
    sh = Shared(tmp_path_factory.mktemp("guarantees"))
    fake_time = sh.time_module()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kvcache.feed.feed, "time", fake_time)
        mp.setattr(kvcache.app.reader, "time", fake_time)
        mp.setattr(kvcache.read.reads, "MINREV_WAIT_S", 0.001)
        mp.setattr(kvcache.feed.changes, "STALENESS_WATCH_MAX_S", 0.001)
        yield sh
    sh.close()


def _story_left(w: World) -> None:
    """The story reached its state (a check of the story, not of kvcache)."""
    s, meta = w.state, w.feed.meta
    assert (meta.applied_seq, meta.synced) == (s.applied, s.synced), (meta, s)
    for key in (g.KEY, g.FILLER):
        rec = w.shared.replica.get(g.BUCKET, key)
        assert (rec.revision if rec else 0) == s.replica.get(key, 0), (key, rec)


@pytest.mark.parametrize("row", [pytest.param(r, marks=_marks(r), id=_id(r)) for r in ROWS])
async def test_row(shared, row):
    form, state, holding, upstream = row
    t = time.perf_counter()
    w = World(shared, state, holding, upstream, form)
    try:
        await play(w)
        _story_left(w)
        handed = {k: w.handed_before(k) for k in form.keys}
        stream_handed = w.stream_handed
        seen = await w.read()
    finally:
        await w.close()
    rules = {k: g.allowed(form, state, upstream, k, handed[k], stream_handed) for k in form.keys}
    below = [k for k, s in seen.items()
             if not s.error and s.source not in ("dropped", "null") and s.revision < handed[k]]
    RESULTS.append((_id(row), "  ".join(f"{k}: {a.show()}" for k, a in rules.items()),
                    "  ".join(f"{k}: {s.show()}" for k, s in seen.items()), time.perf_counter() - t, below))
    command_error = g.command_error(form, rules)
    for key, a in rules.items():
        s = seen[key]
        where = f"{key}: got {s.show()}, allowed {a.show()} (handed {handed[key]}, stream {stream_handed})"
        if s.error:
            assert a.error or command_error, "an error where an answer was due: " + where
            continue
        assert not a.must_error, "an answer where only an error is right: " + where
        assert s.source in a.lowest, "a source not allowed: " + where
        if s.revision:
            assert s.gen == state.gen, "an answer of the old stream: " + where
        assert s.revision >= a.lowest[s.source], "below the lowest revision allowed: " + where
        assert s.top >= a.top, "a stream older than this connection already read: " + where


def test_table():
    """The table's size and each row's rule and answer (printed with -s; written to
    $KVCACHE_GUARANTEES_TABLE when set), and the rows' time."""
    per_form = g.table_size()
    ran = {name: sum(1 for r in RESULTS if r[0].startswith(_slug(name) + "/")) for name in per_form}
    below: dict[str, int] = {}
    for rid, *_, keys in RESULTS:
        if keys and not known(*_row_of(rid)):
            below[rid.split("/")[0]] = below.get(rid.split("/")[0], 0) + 1
    lines = [f"guarantees: {len(g.FORMS)} forms x {len(g.STATES)} states x {len(g.HOLDINGS)} holdings x "
             f"{len(g.UPSTREAMS)} upstreams (1 for the {sum(not f.asks_nats for f in g.FORMS)} forms that never "
             f"ask NATS) = {sum(per_form.values())} rows; {len(RESULTS)} checked here in "
             f"{sum(r[3] for r in RESULTS):.1f} s ({len([1 for r in RESULTS if known(*_row_of(r[0]))])} "
             "known to fail: xfail)"]
    lines += [f"  {ran[name]:>4} of {n:>4}  {name}" for name, n in per_form.items()]
    lines += [f"answered below a revision handed out before, as documented: {n} rows of {form}"
              for form, n in below.items()]
    lines += [f"{rid}\n    allowed  {rule}\n    answered {got}" for rid, rule, got, *_ in RESULTS]
    text = "\n".join(lines)
    print("\n" + text)
    if path := os.environ.get("KVCACHE_GUARANTEES_TABLE"):
        with open(path, "w") as f:
            f.write(text + "\n")
    assert sum(per_form.values()) == len(ROWS)
    assert set(below) <= {_slug(f.name) for f in g.FORMS if f.kind in ("localreader", "tracking", "stream")}, below


def _row_of(rid: str):
    return next(r for r in ROWS if _id(r) == rid)


@pytest.mark.parametrize("form", [f for f in g.FORMS if f.name.startswith("near cache")], ids=lambda f: _slug(f.name))
async def test_a_floor_nobody_was_handed_can_lie_above_the_near_cache(shared, form):
    """The GET fast path (both twins) answers a near-cache hit without the floors, which the
    generic path asks (NearCache.answer); docs/architecture.md ("The near cache") says it need
    not, as every answer handed out from NATS goes through ReadPolicy.fill in the same step,
    leaving the cached record at or above it (the table's floor and hold rows: it does). The
    real pieces can still put a floor above a cached record: a read that asked NATS and whose
    client went away before the answer (the request is shielded, kvcache.read.flights: the
    router records the floor, nobody fills). Shown here: that state arises, and the read that
    follows, whichever path, answers at or above every revision handed out (nobody was handed
    the floor's). What each path answered is printed."""
    state = next(s for s in g.STATES if s.name == "current")
    w = World(shared, state, "nothing", "up", form)
    try:
        w.clock.at(-20_000)
        await w.start_over()
        await w.deliver([1, 2, 3])
        await w.warm()                  # out.o cached at 3
        await w.at(-2_400)
        await w.deliver([4, 5])         # ... and refreshed to 5 by the feed
        await w.at(-1_950)              # 7 acked at -2000, not delivered yet: the feed is fresh
        leaving = w.connect()
        leaving.conn.data_received(encode_command(["KV.GET", g.OUTSIDE, "CONSISTENCY", "strong"]))
        while not w.reads.flights._by_key:
            await asyncio.sleep(0)      # the request is on its way
        leaving.conn.connection_lost(None)  # ... and its client gone
        while w.reads.flights._by_key:
            await asyncio.sleep(0)
        cached = w.feed.cache.current_revision(g.OUTSIDE.encode())
        assert cached == (5, False), cached
        assert w.ledger.floors.below_revision(g.BUCKET, g.OUTSIDE, 5), "the floor above the cached record"
        handed = w.handed_before(g.OUTSIDE)
        assert handed < 7, "nobody was handed the floor's revision"
        seen = (await w.read())[g.OUTSIDE]
    finally:
        await w.close()
    print(f"\n{form.name}: floor 7 above the cached 5, handed {handed}: answered {seen.show()}")
    assert not seen.error and seen.revision >= handed
