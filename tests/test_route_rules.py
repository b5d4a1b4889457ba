"""The read policy's edges (kvcache.read.policy, kvcache.store.verdict), on the real pieces
of tests/test_readpolicy.py (an LMDB replica in a temp dir, real Feeds on a set clock, the
real Ledger): the revision at which MINREV is met, a record that reached a held revision
before the feed's position says so, a hold at revision 1, which key a stale answer is
checked against, and the errors a user reads, word for word (each one line that says what
to do)."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import test_readpolicy
from test_readpolicy import NOW, entry, stale

from kvcache.config import BucketConfig, Config
from kvcache.entry import Entry, Operation
from kvcache.errors import CommandError, UpstreamError
from kvcache.read.ledger import Ledger
from kvcache.read.policy import STALE_SOURCE, Cached, Held, Local, ReadPolicy, Remote
from kvcache.store import verdict
from kvcache.store.record import NEVER, encode_record, item
from kvcache.store.verdict import stored_revision

DOWN = UpstreamError("no peer answered")


@pytest.fixture
def env(tmp_path):
    """tests/test_readpolicy.py's: buckets b (with a near cache), all (serve_stale) and f."""
    yield from test_readpolicy.env.__wrapped__(tmp_path)


def message(policy: ReadPolicy, raw: bytes) -> str:
    with pytest.raises(CommandError) as e:
        policy.resolve(raw)
    return str(e.value)


# ---------------------------------------------------------------------- what a user reads

def test_resolve_says_what_is_wrong_word_for_word(env):
    p = env.policy
    assert message(p, b"\xff") == "ERR invalid key: not UTF-8"
    assert message(p, b"nope:x") == ("ERR no such bucket 'nope' in this sidecar (it replicates: b, all, f); "
                                     "to read it, add --bucket nope or a [[bucket]] entry and restart")
    assert message(p, b":x") == ("ERR no such bucket '' in this sidecar (it replicates: b, all, f); "
                                 "to read it, add --bucket NAME or a [[bucket]] entry and restart")
    long = "n" * 70
    assert message(p, f"{long}:x".encode()) == (
        f"ERR no such bucket '{long[:64]}' in this sidecar (it replicates: b, all, f); "
        f"to read it, add --bucket {long[:64]} or a [[bucket]] entry and restart")
    assert message(p, b"a.." + b"k" * 70) == (f"ERR invalid key '{('a..' + 'k' * 70)[:64]}': KV keys use "
                                               "A-Z a-z 0-9 - / _ = and dots between tokens")
    assert message(p, b"_kv." + b"k" * 70) == (f"ERR invalid key '{('_kv.' + 'k' * 70)[:64]}': keys starting "
                                                "with _kv are reserved for NATS's own use (ADR-8)")
    none = ReadPolicy(Config(), env.replica, {}, Ledger())
    assert message(none, b"x") == ("ERR no default bucket: this sidecar replicates no bucket; start it with "
                                   "--bucket NAME or a [[bucket]] entry")
    assert message(none, b"q:x") == ("ERR no such bucket 'q' in this sidecar (it replicates: none); "
                                     "to read it, add --bucket q or a [[bucket]] entry and restart")


@pytest.mark.parametrize(("count", "listed"), [
    (8, "b0, b1, b2, b3, b4, b5, b6, b7"),
    (9, "b0, b1, b2, b3, b4, b5, b6, b7, ..."),
])
def test_resolve_lists_eight_buckets_at_most(env, count, listed):
    cfg = Config(buckets=[BucketConfig(name=f"b{i}") for i in range(count)])
    assert message(ReadPolicy(cfg, env.replica, {}, Ledger()), b"nope:x") == (
        f"ERR no such bucket 'nope' in this sidecar (it replicates: {listed}); "
        "to read it, add --bucket nope or a [[bucket]] entry and restart")


# ---------------------------------------------------------------------- the route's edges

def test_minrev_equal_to_the_applied_sequence_is_met_by_the_replica(env):
    p = env.policy
    assert p.route(p.address(b"rep.a"), min_rev=10) == Local(env.replica.get("b", "rep.a"))
    assert p.route(p.address(b"rep.a"), min_rev=11).__class__ is Held


def test_a_strong_read_keeps_its_minrev(env):
    p = env.policy
    assert p.route(p.address(b"rep.a"), strong=True, min_rev=7) == Remote(True, 1000, 7, False, False)


def test_a_record_at_the_held_revision_answers_before_the_feeds_position_says_so(env):
    """The replica's record is read from LMDB, the feed's position from memory: a record
    already at the revision handed out answers, in one read and in a transaction."""
    p, feed, w = env.policy, env.feeds["b"], env.w["b"]
    feed.meta.applied_seq = 4  # the position as the feed last told it, below rep.a's record (5)
    w.handed_out("rep.a", 5)
    assert p.route(p.address(b"rep.a")) == Local(env.replica.get("b", "rep.a"))
    with env.replica.env.begin(buffers=True) as txn:
        got = p.route(p.address(b"rep.a"), txn=txn)
        assert got.__class__ is Local and got.record is not None
        w.handed_out("rep.a", 6)
        assert p.route(p.address(b"rep.a"), txn=txn) == Held(6, Remote(False, 1000, None, False, True))


def test_in_a_transaction_another_held_key_does_not_hold_this_one(env):
    p, w = env.policy, env.w["b"]
    w.handed_out("rep.gone", 12)
    with env.replica.env.begin(buffers=True) as txn:
        assert p.route(p.address(b"rep.a"), txn=txn).__class__ is Local


def test_a_hold_at_revision_1_holds(env):
    p, feed, w = env.policy, env.feeds["b"], env.w["b"]
    feed.meta.applied_seq = 0
    w.handed_out("rep.none", 1)
    assert p.route(p.address(b"rep.none")) == Held(1, Remote(False, 1000, None, False, True))


def test_a_cached_entry_keeps_its_expiry(env):
    env.cache.offer_entry("other.key", b"other.key", b"V", 4, NOW, NEVER)
    p = env.policy
    assert p.route(p.address(b"other.key")) == Cached(
        Entry("b", "other.key", b"V", 4, NOW, 0, Operation.PUT, "cache", NEVER))


def test_newest_at_the_applied_sequence_is_the_replicas_word(env):
    p = env.policy
    # the synced replica applied 10 and has no rep.none: a remote PUT at 10 was deleted since
    assert p.newest(p.address(b"rep.none"), entry("rep.none", b"lagging", 10)) is None
    assert env.ledger.holds["b"].ahead == {}


def test_a_stored_record_past_the_buckets_max_age_is_absent():
    now = time.time_ns()
    raw = encode_record(b"k", b"k", b"v", 7, now - 3600 * 10**9)
    assert stored_revision(raw, SimpleNamespace(max_age_ns=0)) == 7
    assert stored_revision(raw, SimpleNamespace(max_age_ns=60 * 10**9)) is None
    assert stored_revision(raw, SimpleNamespace(max_age_ns=7200 * 10**9)) == 7


def test_a_stored_record_is_absent_from_its_deadline_on(monkeypatch):
    raw = encode_record(b"k", b"k", b"v", 7, 1000, ttl_ns=500)  # leaves the bucket at 1500
    monkeypatch.setattr(verdict, "time", SimpleNamespace(time_ns=lambda: 1499))
    assert stored_revision(raw, SimpleNamespace(max_age_ns=0)) == 7
    monkeypatch.setattr(verdict, "time", SimpleNamespace(time_ns=lambda: 1500))
    assert stored_revision(raw, SimpleNamespace(max_age_ns=0)) is None


# ---------------------------------------------------------------------- a stale answer's checks

SERVES_STALE = Remote(False, 2000, None, False, True)


def stale_error(policy: ReadPolicy, raw: bytes, route: Remote) -> str:
    with pytest.raises(CommandError) as e:
        policy.stale_entry(policy.address(raw), route, DOWN)
    return str(e.value)


def test_stale_errors_word_for_word(env):
    p, feed = env.policy, env.feeds["b"]
    stale(feed, 1050)
    assert stale_error(p, b"rep.a", Remote(False, 1000, None, False, True)) == (
        "ERR bucket b: replica stale (1.1s behind, max_stale_ms 1000) and no peer could answer: no peer answered")
    feed.meta.synced = False
    assert stale_error(p, b"rep.a", Remote(False, 1000, None, False, True)) == (
        "ERR bucket b: replica not synced and no peer could answer: no peer answered")
    feed.meta.synced = True
    stale(feed, 0)
    assert stale_error(p, b"rep.a", Remote(False, 1000, None, False, True)) == (
        "ERR bucket b: replica behind a revision of the key already read from NATS and no peer could "
        "answer: no peer answered")
    every = env.feeds["all"]
    every.meta.synced = False
    stale(every)
    assert stale_error(p, b"all:missing", SERVES_STALE) == (
        "ERR bucket all: replica not synced and no peer could answer: no peer answered; not serving stale: "
        "the key may exist, the replica has not finished its sync")


def test_a_stale_answer_is_checked_against_its_own_revision(env):
    """serve_stale gives the replica's record when nothing newer of that key was handed out:
    a floor at the record's own revision, or another key held, does not refuse it."""
    p, every, w = env.policy, env.feeds["all"], env.w["all"]
    stale(every)
    env.floors.saw("all", "x", entry("x", b"X", 3, bucket="all"))  # read from NATS at 3 before
    every.meta.applied_seq = 2  # the feed's position lags its record of x (3)
    w.handed_out("x", 3)  # x at 3 handed out: the record is at it
    w.handed_out("y", 5)  # another key held
    got = p.stale_entry(p.address(b"all:x"), SERVES_STALE, DOWN)
    assert got == Entry("all", "x", b"X", 3, NOW, 0, Operation.PUT, STALE_SOURCE)
    w.handed_out("x", 4)
    assert stale_error(p, b"all:x", SERVES_STALE).endswith(
        "not serving stale: a newer revision of the key was already read from a peer")


# ---------------------------------------------------------------------- the near cache's fill

def _fill(env, key, e, answered):
    env.policy.fill(env.policy.address(key.encode()), e, answered)


def test_fill_keeps_a_cached_not_found_and_a_newer_value(env):
    cache = env.cache
    _fill(env, "gone", None, "main.b")
    _fill(env, "gone", None, "main.b")  # the same not-found again: kept
    assert cache.lookup(b"gone") == (None, 0, 0, 0)
    _fill(env, "k", entry("k", b"v", 9), "main.b")
    _fill(env, "k", entry("k", None, 8, op=Operation.DEL), "main.b")  # an older deletion's marker
    assert cache.lookup(b"k") == (b"v", 9, NOW, 0)


def test_a_deletions_marker_is_the_responders_to_vouch_for(env):
    _fill(env, "d", entry("d", None, 9, source="main.b", op=Operation.DEL), "mirror.b")
    assert b"d" not in env.cache  # answered by a mirror, whatever the marker says


def test_fill_that_may_not_go_in_drops_only_an_older_cached_value(env):
    cache = env.cache
    _fill(env, "k", entry("k", b"v", 9), "main.b")
    stale(env.feeds["b"])  # the feed cannot vouch: nothing goes in
    _fill(env, "k", entry("k", b"old", 7), "main.b")
    _fill(env, "k", entry("k", b"v", 9), "main.b")
    assert cache.lookup(b"k") == (b"v", 9, NOW, 0)


def test_fill_keeps_the_answers_expiry(env):
    _fill(env, "t", entry("t", b"v", 4, expires=NEVER), "main.b")
    assert env.cache.lookup(b"t") == (b"v", 4, NOW, NEVER)


def test_fill_refuses_an_answer_older_than_a_change_the_feed_saw_meanwhile(env):
    """A change of the key (outside the filters) delivered while the read was on its way:
    the answer, older, must not go into the near cache; one at that revision may."""
    keeper = env.feeds["b"]._keeper
    keeper.split([item(b"k", b"new", 8, NOW)], 8, 7)  # the feed's batch: k changed at 8
    _fill(env, "k", entry("k", b"old", 7), "main.b")
    assert env.cache.lookup(b"k") != (b"old", 7, NOW, 0)
    _fill(env, "k", entry("k", b"new", 8), "main.b")
    assert env.cache.lookup(b"k") == (b"new", 8, NOW, 0)
