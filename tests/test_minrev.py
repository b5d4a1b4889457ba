"""KV.GET's MINREV carried out (kvcache/read/reads.py), in process: the real read policy, ledger,
feed (never started, its clock set by the test) and LMDB replica in a temporary directory,
and a stand-in router that answers as the test says and records each request. No process
is started: the quick tier. The same reads through a lagging feed against a real
nats-server: tests/test_minrev_live.py.

MINREV r promises an answer from the bucket at revision r or later: the replica when it holds
r and is fresh; else NATS. The leader's answer may be below r when the key was last written
before r (another key was written at r): that is right only if the bucket holds r, which the
sidecar knows from its feed or asks the leader (STREAM.INFO); a bucket whose last revision is
below r is an error that names both revisions, never the older answer.
"""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from kvcache.config import BucketConfig, Config
from kvcache.entry import Entry
from kvcache.errors import CommandError, UpstreamError
from kvcache.feed.feed import Feed
from kvcache.ops.accesslog import AccessLog
from kvcache.read import reads as reads_module
from kvcache.read.ledger import Ledger
from kvcache.read.policy import ReadPolicy
from kvcache.read.reads import Reads
from kvcache.stats import Stats
from kvcache.store.record import item
from kvcache.store.replica import BucketMeta, Replica

NOW = time.time_ns()
APPLIED = 10   # the replica's position: key `a` at revision 5, the bucket at 10


class Router:
    """The router's two calls a MINREV read makes: the key from the leader (get_from, strong)
    and the stream's last revision (last_revision), answered from `revisions` (the key's
    revision per leader answer, in turn; None: not found) and `last`, or failing with
    `fail[call]`; every call recorded."""

    def __init__(self, revisions: list[int | None], last: int = APPLIED,
                 fail: dict[str, Exception] | None = None) -> None:
        self.revisions = list(revisions)
        self.last = last
        self.fail = fail or {}
        self.calls: list[str] = []

    async def get_from(self, bucket: str, key: str, strong: bool = False) -> tuple[Entry | None, str]:
        call = "leader" if strong else "peer"
        self.calls.append(call)
        if call in self.fail:
            raise self.fail[call]
        rev = self.revisions.pop(0)
        source = "leader" if strong else "main." + bucket
        return (None if rev is None else Entry(bucket, key, b"v%d" % rev, rev, NOW, source=source)), "main." + bucket

    async def last_revision(self, bucket: str) -> int:
        self.calls.append("info")
        if "info" in self.fail:
            raise self.fail["info"]
        return self.last


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setattr(reads_module, "MINREV_WAIT_S", 0.01)  # the wait for the replica: short here
    replica = Replica(str(tmp_path / "replica"), buckets=1)
    bc = BucketConfig(name="b", max_stale_ms=5000)
    cfg = Config(data_dir=str(tmp_path), buckets=[bc])
    replica.apply_items("b", [item(b"a", b"A", 5, NOW)], BucketMeta(stream="KV_b", applied_seq=APPLIED, synced=True))
    feed = Feed(None, bc, replica)  # type: ignore[arg-type]  # never started: no connection
    fr = feed.freshness
    fr.clock = lambda: NOW
    fr.caught_up, fr.interrupted, fr.heard_ns = True, False, NOW   # fresh: 0 ms behind
    ledger = Ledger()
    policy = ReadPolicy(cfg, replica, {"b": feed}, ledger)
    stats = Stats()

    def reads(router: Router) -> Reads:
        return Reads(cfg, policy, router, stats, AccessLog.from_config(cfg))  # type: ignore[arg-type]
    yield SimpleNamespace(reads=reads, feed=feed, stats=stats)
    replica.close()


def entry_of(entry: Entry | None) -> Entry | None:
    return entry


async def kv_get(reads: Reads, key: str = "a", **kw) -> Entry | None:
    reply = reads.one(key.encode(), "KV.GET", entry_of, **kw)  # type: ignore[arg-type]  # the entry itself
    if asyncio.iscoroutine(reply):
        return await reply
    return reply  # type: ignore[return-value]


async def test_a_revision_the_replica_holds_is_answered_there_without_nats(env):
    router = Router([])
    e = await kv_get(env.reads(router), min_rev=APPLIED)
    assert e is not None and (e.revision, e.source) == (5, "local")   # the key older than r: right
    assert router.calls == []


async def test_a_revision_the_replica_lacks_is_the_leaders_answer_at_or_above_it(env):
    router = Router([12])
    e = await kv_get(env.reads(router), min_rev=12)
    assert e is not None and (e.revision, e.source) == (12, "leader")
    assert router.calls == ["leader"]     # at or above r: nothing more to ask


async def test_minrev_beyond_the_buckets_last_revision_is_an_error_naming_both(env):
    router = Router([5], last=APPLIED)
    with pytest.raises(CommandError) as err:
        await kv_get(env.reads(router), min_rev=1_000_000)
    assert str(err.value) == "ERR MINREV 1000000 is beyond bucket b's last revision 10"
    assert router.calls == ["leader", "info"]
    assert env.stats.reads[("b", "peer", "error")] == 1


async def test_a_key_older_than_a_revision_the_bucket_holds_is_read_again_from_the_bucket_at_it(env):
    """The leader's first answer (5) may predate revision 12 (written while it was asked): the
    key is asked again once the leader shows the bucket at 12, and that answer stands, the key
    older than 12 (another key's write) or, as here, written at 12 itself."""
    router = Router([5, 12], last=12)
    e = await kv_get(env.reads(router), min_rev=12)
    assert e is not None and (e.revision, e.source) == (12, "leader")
    assert router.calls == ["leader", "info", "leader"]
    router = Router([5, 5], last=12)   # another key's write at 12: the older revision is right
    e = await kv_get(env.reads(router), min_rev=12)
    assert e is not None and e.revision == 5


async def test_a_revision_the_feed_already_saw_the_stream_hold_needs_no_stream_info(env):
    env.feed.upstream_seq = 12          # the stream's last sequence as the feed last saw it
    router = Router([5])
    e = await kv_get(env.reads(router), min_rev=12)
    assert e is not None and e.revision == 5
    assert router.calls == ["leader"]


async def test_a_not_found_is_judged_as_an_older_answer(env):
    router = Router([None], last=APPLIED)
    with pytest.raises(CommandError, match="MINREV 11 is beyond bucket b's last revision 10"):
        await kv_get(env.reads(router), "nokey", min_rev=11)
    router = Router([None, None], last=11)
    assert await kv_get(env.reads(router), "nokey", min_rev=11) is None
    assert router.calls == ["leader", "info", "leader"]


async def test_strong_and_minrev_beyond_the_bucket_is_the_same_error(env):
    router = Router([5], last=APPLIED)
    with pytest.raises(CommandError, match="beyond bucket b's last revision 10"):
        await kv_get(env.reads(router), min_rev=11, strong=True)
    assert router.calls == ["leader", "info"]


@pytest.mark.parametrize("stale", [False, True], ids=["fresh", "stale"])
@pytest.mark.parametrize("fails", ["leader", "info"])
async def test_nats_unable_to_answer_is_an_error_never_the_replicas_older_record(env, stale, fails):
    """The replica holds revision 5 of the key, and serve_stale does not apply to MINREV: when
    the leader's answer, or the STREAM.INFO that would vouch for an older one, does not come,
    the read fails rather than guess, fresh replica or not."""
    if stale:
        fr = env.feed.freshness
        fr.caught_up, fr.interrupted, fr.heard_ns = False, True, NOW - 60_000_000_000
    error = UpstreamError(f"{fails} timed out")
    router = Router([5], fail={fails: error})
    with pytest.raises(CommandError) as err:
        await kv_get(env.reads(router), min_rev=11)
    assert str(err.value) == f"ERR upstream read failed: {fails} timed out"
    assert router.calls == ["leader"] if fails == "leader" else ["leader", "info"]
