"""The ledger's rules one by one (kvcache.read.ledger): what a read already handed out, and
the bounds it puts on the next one. Each test names the bound it holds: the revision at
which a floor or a hold starts and ends (an off-by-one there serves a key one revision back,
or holds it for good), the order floors are forgotten in, and what a feed's report ends.
In process, on the real Floors, Holds, Witness and Ledger; the feed is the few attributes the
ledger reads of one (bucket, meta, freshness)."""
from __future__ import annotations

import time
from types import SimpleNamespace

from kvcache.entry import Entry
from kvcache.read import ledger as ledger_mod
from kvcache.read.ledger import Floors, Holds, Ledger
from kvcache.store.replica import BucketMeta

B = "cfg"
HOUR_NS = 3600 * 10**9


def entry(key: str, revision: int, created: int = 0, expires: int = 0) -> Entry:
    return Entry(B, key, b"v", revision, created or time.time_ns(), expires=expires)


def feed(applied: int = 0, synced: bool = True, fresh: bool = True, bucket: str = B) -> SimpleNamespace:
    return SimpleNamespace(bucket=bucket, meta=BucketMeta(applied_seq=applied, synced=synced),
                           fresh_within=lambda ms: fresh, max_age_ns=0, cache=None)


# ---------------------------------------------------------------------- floors

def test_a_floor_refuses_only_revisions_below_it():
    floors = Floors()
    floors.saw(B, "k", entry("k", 7))
    assert floors.below(B, "k", entry("k", 6))
    assert not floors.below(B, "k", entry("k", 7))  # the same revision again is no step back
    assert floors.below_revision(B, "k", 6)
    assert not floors.below_revision(B, "k", 7)
    assert not floors.below_revision(B, "other", 1)


def test_a_floor_rises_and_never_falls():
    floors = Floors()
    floors.saw(B, "k", entry("k", 7))
    floors.saw(B, "k", entry("k", 5))  # an older answer read later leaves the floor at 7
    assert floors.below_revision(B, "k", 6)
    floors.saw(B, "k", entry("k", 9))
    assert floors.below_revision(B, "k", 8)
    floors.saw(B, "k", None)  # a not-found sets nothing
    assert floors.below_revision(B, "k", 8)


def test_a_not_found_after_a_value_is_below_until_the_value_expires():
    floors = Floors()
    floors.saw(B, "live", entry("live", 3))  # no TTL, no max_age: never expires
    assert floors.below(B, "live", None)
    now = time.time_ns()
    floors.saw(B, "ttl", entry("ttl", 4, created=now - HOUR_NS, expires=now - 1))  # expired
    assert not floors.below(B, "ttl", None)  # its not-found is the bucket's state now
    floors.saw(B, "later", entry("later", 5, created=now, expires=now + HOUR_NS))
    assert floors.below(B, "later", None)  # not expired yet: a not-found is a lag
    assert not floors.below(B, "unknown", None)


def test_a_floor_expires_with_the_buckets_max_age():
    now = time.time_ns()
    floors = Floors(max_age=lambda bucket: 60 * 10**9 if bucket == B else 0)
    floors.saw(B, "old", entry("old", 3, created=now - HOUR_NS))
    assert not floors.below(B, "old", None)  # created an hour ago, max_age a minute: gone
    floors.saw(B, "new", entry("new", 4, created=now))
    assert floors.below(B, "new", None)
    floors.saw("other", "old", Entry("other", "old", b"v", 3, now - HOUR_NS))
    assert floors.below("other", "old", None)  # that bucket has no max_age


def test_floors_forget_the_least_recently_read_key_first():
    floors = Floors(size=2)
    floors.saw(B, "a", entry("a", 1))
    floors.saw(B, "b", entry("b", 2))
    floors.saw(B, "a", entry("a", 1))  # read again: a is now the most recent
    floors.saw(B, "c", entry("c", 3))  # one too many: b goes
    assert floors.below_revision(B, "a", 0)
    assert not floors.below_revision(B, "b", 1)
    assert floors.below_revision(B, "c", 2)
    floors.saw(B, "d", entry("d", 4))  # and then a
    assert not floors.below_revision(B, "a", 0)
    assert floors.below_revision(B, "c", 2) and floors.below_revision(B, "d", 3)
    # the evicted key is out of the bucket's set too: forgetting below 10 leaves no stale entry
    floors.forget(B, 10)
    assert not floors.below_revision(B, "c", 2) and not floors.below_revision(B, "d", 3)


def test_floors_hold_exactly_size_keys():
    floors = Floors(size=2)
    floors.saw(B, "a", entry("a", 1))
    floors.saw(B, "b", entry("b", 2))
    assert floors.below_revision(B, "a", 0) and floors.below_revision(B, "b", 1)


def test_forget_drops_a_buckets_floors_below_a_sequence_or_all():
    floors = Floors()
    for key, rev in (("a", 3), ("b", 5), ("c", 8)):
        floors.saw(B, key, entry(key, rev))
    floors.saw("other", "a", Entry("other", "a", b"v", 3, time.time_ns()))
    floors.forget(B, 5)  # messages below 5 went: a's floor goes, b (at 5) and c stay
    assert not floors.below_revision(B, "a", 2)
    assert floors.below_revision(B, "b", 4) and floors.below_revision(B, "c", 7)
    assert floors.below_revision("other", "a", 2)  # another bucket's floors stay
    floors.forget(B)  # recreated: all of them
    assert not floors.below_revision(B, "b", 4) and not floors.below_revision(B, "c", 7)
    floors.saw(B, "b", entry("b", 2))  # its keys can get a floor again, from scratch
    assert floors.below_revision(B, "b", 1)
    floors.forget("never-seen")  # a bucket with no floors: nothing to do


# ---------------------------------------------------------------------- holds

def test_a_hold_starts_only_above_what_a_synced_replica_applied():
    holds = Holds()
    holds.handed_out("k", 10, BucketMeta(applied_seq=10, synced=True))  # the replica has it
    assert holds.top == 0 and holds.held_until("k", None, BucketMeta(applied_seq=10, synced=True)) == 0
    holds.handed_out("k", 10, BucketMeta(applied_seq=10, synced=False))  # unsynced: counts
    assert holds.held_until("k", None, BucketMeta(applied_seq=10, synced=False)) == 10
    holds = Holds()
    holds.handed_out("k", 11, BucketMeta(applied_seq=10, synced=True))
    assert holds.held_until("k", None, BucketMeta(applied_seq=10, synced=True)) == 11


def test_a_held_key_is_released_at_the_revision_handed_out():
    holds = Holds()
    meta = BucketMeta(applied_seq=10, synced=True)
    holds.handed_out("k", 12, meta)
    assert holds.held_until("k", 11, meta) == 12  # its record is older: wait for 12
    assert holds.held_until("k", 12, meta) == 0  # its record is at 12 already
    assert holds.held_until("k", None, BucketMeta(applied_seq=11, synced=True)) == 12
    assert holds.held_until("k", None, BucketMeta(applied_seq=12, synced=True)) == 0
    assert holds.held_until("k", None, BucketMeta(applied_seq=12, synced=False)) == 12
    assert holds.held_until("other", None, meta) == 0  # another key is not held
    assert holds.held_until(None, None, meta) == 12  # the fast path's question: any key held


def test_a_hold_keeps_the_highest_revision_per_key_and_over_all():
    holds = Holds()
    meta = BucketMeta(applied_seq=1, synced=True)
    holds.handed_out("a", 9, meta)
    holds.handed_out("a", 7, meta)  # an older answer handed out later: a waits for 9 still
    holds.handed_out("b", 5, meta)
    assert holds.held_until("a", None, meta) == 9
    assert holds.held_until("b", None, meta) == 5
    assert holds.top == 9
    holds.handed_out("b", 9, meta)  # as high as the top: the top stays
    assert holds.top == 9 and holds.held_until("b", None, meta) == 9


def test_on_hold_is_called_when_the_first_key_is_held_only():
    calls = []
    holds = Holds(lambda: calls.append(1))
    meta = BucketMeta(applied_seq=1, synced=True)
    holds.handed_out("a", 3, meta)
    holds.handed_out("b", 4, meta)
    assert calls == [1]
    holds.applied(BucketMeta(applied_seq=4, synced=True))
    holds.handed_out("c", 6, BucketMeta(applied_seq=4, synced=True))
    assert calls == [1, 1]  # held again after every hold ended


def test_past_ahead_max_every_key_waits_for_the_top(monkeypatch):
    monkeypatch.setattr(ledger_mod, "AHEAD_MAX", 2)
    holds = Holds()
    meta = BucketMeta(applied_seq=1, synced=True)
    holds.handed_out("a", 3, meta)
    holds.handed_out("b", 4, meta)
    assert holds.held_until("never-read", None, meta) == 0
    holds.handed_out("c", 5, meta)  # no room to remember c: every key waits for the top
    assert holds.held_until("never-read", None, meta) == 5
    assert holds.held_until("a", None, meta) == 5
    holds.handed_out("a", 6, meta)  # a known key is still tracked past the limit
    assert holds.ahead["a"] == 6
    holds.clear()
    assert holds.held_until("never-read", None, meta) == 0
    holds.handed_out("a", 3, meta)
    assert holds.held_until("never-read", None, meta) == 0  # clear ended the overflow


def test_applied_ends_the_holds_only_at_the_top_and_synced():
    holds = Holds()
    holds.handed_out("a", 5, BucketMeta(applied_seq=1, synced=True))
    holds.applied(BucketMeta(applied_seq=4, synced=True))
    assert holds.top == 5
    holds.applied(BucketMeta(applied_seq=5, synced=False))
    assert holds.top == 5
    holds.applied(BucketMeta(applied_seq=5, synced=True))
    assert holds.top == 0 and not holds.ahead


# ---------------------------------------------------------------------- the ledger and witness

def test_the_ledgers_witness_asks_the_holds_at_the_feeds_position():
    ledger = Ledger()
    f = feed(applied=10)
    w = ledger.witness(f)
    assert ledger.witness(f) is w  # made once per feed
    w.handed_out("k", 12)
    assert w.held_until("k") == 12
    assert w.held_until("k", 12) == 0  # the record's revision counts
    assert w.held_until("k", 11) == 12
    f.meta = BucketMeta(applied_seq=12, synced=True)
    assert w.held_until("k") == 0
    f2 = feed(applied=10)  # a new feed for the bucket: a new witness, the same holds
    w2 = ledger.witness(f2)
    assert w2 is not w and w2.holds is w.holds and w2.feed is f2


def test_the_ledgers_on_hold_is_called_through_the_witness():
    ledger = Ledger()
    calls = []
    ledger.on_hold = lambda: calls.append(1)  # set after construction: the holds call it late
    ledger.witness(feed(applied=1)).handed_out("k", 5)
    assert calls == [1]
    quiet = Ledger()
    quiet.witness(feed(applied=1)).handed_out("k", 5)  # none set: nothing called, no error
    given = Ledger(on_hold=lambda: calls.append(2))  # the sidecar's way: given at construction
    given.witness(feed(applied=1)).handed_out("k", 5)
    assert calls == [1, 2]


def test_the_ledger_passes_max_age_to_its_floors():
    now = time.time_ns()
    ledger = Ledger(max_age=lambda bucket: 60 * 10**9)
    ledger.floors.saw(B, "k", entry("k", 3, created=now - HOUR_NS))
    assert not ledger.floors.below(B, "k", None)


def test_what_the_feeds_report_ends_holds_and_floors():
    ledger = Ledger()
    f = feed(applied=1)
    w = ledger.witness(f)
    w.handed_out("k", 5)
    ledger.applied("other", BucketMeta(applied_seq=99, synced=True))  # another bucket's
    assert w.held_until("k") == 5
    ledger.applied(B, BucketMeta(applied_seq=5, synced=True))
    assert w.holds.top == 0
    w.handed_out("k", 7)
    ledger.resync_began(B)
    assert w.holds.top == 0
    ledger.resync_began("other")  # no holds there: nothing to do

    ledger.floors.saw(B, "a", entry("a", 3))
    ledger.floors.saw(B, "b", entry("b", 6))
    ledger.removed(B, 4)
    assert not ledger.floors.below_revision(B, "a", 2) and ledger.floors.below_revision(B, "b", 5)
    ledger.removed(B, None)  # unknown messages went: every floor of the bucket
    assert not ledger.floors.below_revision(B, "b", 5)
    ledger.floors.saw(B, "b", entry("b", 6))
    ledger.renumbered(B)
    assert not ledger.floors.below_revision(B, "b", 5)


def test_a_stream_regresses_only_below_the_highest_revision_handed_to_that_connection():
    ledger = Ledger()
    ledger.stream_handed(1, B, 10)
    ledger.stream_handed(1, B, 8)  # a lower one later keeps 10
    assert not ledger.stream_regressed(1, B, 10)  # at 10: no regression
    assert not ledger.stream_regressed(2, B, 1)  # another connection read nothing
    assert not ledger.stream_regressed(1, "other", 0)  # nor this one of another bucket
    assert ledger.stream_regressed(1, B, 9)
    assert not ledger.stream_regressed(1, B, 9)  # said once
    ledger.stream_handed(1, "other", 1)
    assert ledger.stream_regressed(1, "other", 0)
    ledger.stream_handed(3, B, 4)
    ledger.forget(3)
    assert not ledger.stream_regressed(3, B, 0)


def test_revision_1_counts_like_any_other():
    """The first revision of a bucket is 1: a floor, a hold and a stream's top start there."""
    floors = Floors()
    floors.saw(B, "k", entry("k", 1))
    assert floors.below(B, "k", None)
    holds = Holds()
    fresh = BucketMeta(applied_seq=0, synced=True)
    holds.handed_out("k", 1, fresh)
    assert holds.held_until("k", None, fresh) == 1
    assert holds.held_until("other", None, fresh) == 0
    ledger = Ledger()
    ledger.stream_handed(1, B, 1)
    assert ledger.stream_regressed(1, B, 0)


def test_a_not_found_is_below_a_floor_until_the_very_ns_it_expires(monkeypatch):
    floors = Floors()
    floors.saw(B, "k", entry("k", 3, created=1000, expires=2000))
    monkeypatch.setattr(ledger_mod, "time", SimpleNamespace(time_ns=lambda: 1999))
    assert floors.below(B, "k", None)
    monkeypatch.setattr(ledger_mod, "time", SimpleNamespace(time_ns=lambda: 2000))
    assert not floors.below(B, "k", None)
