"""kvcache.read.router.Peer against a real nats-server: Direct Get (ADR-31) in its single-key,
payload and multi_last forms, the leader API fallback, and how each reply status maps.

The error statuses are provoked for real: the server answers 408 to a subject-appended Direct
Get that carries a payload (and to an empty request), and 413 to a multi_last whose wildcard
matches more than 1024 subjects.
"""
from __future__ import annotations

import asyncio
import json

import nats
import pytest
from support.topology import nats_run

from kvcache.entry import Operation
from kvcache.errors import UpstreamError
from kvcache.read.router import MULTI_LAST_MAX, Peer, Router

BIG = 1100     # > 1024 subjects under `big.>`
MANY = 1500
TIMEOUT = 5.0


async def _put_all(kv, items: dict[str, bytes]) -> dict[str, int]:
    pairs = list(items.items())
    revs: dict[str, int] = {}
    for i in range(0, len(pairs), 200):
        chunk = pairs[i:i + 200]
        for (k, _), rev in zip(chunk, await asyncio.gather(*(kv.put(k, v) for k, v in chunk)), strict=True):
            revs[k] = rev
    return revs


@pytest.fixture(scope="module")
def data(nats_server_module) -> dict:
    url = nats_server_module.url
    out: dict = {"url": url}

    async def setup(js):
        kv = await js.create_key_value(bucket="rt", direct=True, history=10)
        out["a_rev"] = await kv.put("a", b"A")
        await kv.put("gone", b"x")
        await kv.delete("gone")
        out["gone_rev"] = (await js.stream_info("KV_rt")).state.last_seq
        await _put_all(kv, {f"big.{i}": b"b" for i in range(BIG)})
        out["many_revs"] = await _put_all(kv, {f"m.{i:04d}": b"v1-%d" % i for i in range(MANY)})
        out["snapshot"] = max(out["many_revs"].values())
        # a second generation of every m.* key, after the snapshot
        out["many_revs2"] = await _put_all(kv, {f"m.{i:04d}": b"v2-%d" % i for i in range(MANY)})
        nd = await js.create_key_value(bucket="rtnd")        # nats-py default: no allow_direct
        out["nd_rev"] = await nd.put("k", b"K")
        await nd.put("gone", b"x")
        await nd.delete("gone")
        assert not (await js.stream_info("KV_rtnd")).config.allow_direct

    nats_run(url, setup)
    return out


@pytest.fixture
async def nc(data):
    conn = await nats.connect(data["url"])
    try:
        yield conn
    finally:
        await conn.close()


def peer(nc, bucket: str = "rt", direct: bool = True, name: str = "main") -> Peer:
    return Peer(name, nc, f"KV_{bucket}", bucket, direct=direct)


# --------------------------------------------------------------------------- single key


async def test_direct_get_found_missing_deleted(nc, data):
    p = peer(nc)
    e = await p.get("a", TIMEOUT)
    assert (e.bucket, e.key, e.value, e.revision, e.operation, e.source) == (
        "rt", "a", b"A", data["a_rev"], Operation.PUT, "main.rt")
    assert e.created > 0
    assert await p.get("nosuch", TIMEOUT) is None                      # 404
    gone = await p.get("gone", TIMEOUT)
    assert (gone.operation, gone.value, gone.revision) == (Operation.DEL, None, data["gone_rev"])
    assert p.stats.requests == 3 and p.stats.errors == 0 and p.direct


async def test_leader_get(nc, data):
    p = peer(nc)
    e = await p.get("a", TIMEOUT, leader=True)
    assert (e.value, e.revision, e.source) == (b"A", data["a_rev"], "leader")
    direct = await p.get("a", TIMEOUT)
    assert e.created == direct.created
    assert await p.get("nosuch", TIMEOUT, leader=True) is None
    gone = await p.get("gone", TIMEOUT, leader=True)
    assert gone.operation is Operation.DEL and gone.value is None


async def test_status_408_subject_appended_with_payload(nc, data):
    """ADR-31: a subject-appended Direct Get must not carry a payload; the server says 408."""
    p = peer(nc)
    with pytest.raises(UpstreamError, match="408"):
        await p.direct_request("a", json.dumps({"seq": 1}).encode(), TIMEOUT)
    with pytest.raises(UpstreamError, match="408"):
        await p.direct_request(None, b"", TIMEOUT)              # an empty request
    # the payload form itself works, and finds the key from the reply's Nats-Subject
    e = await p.direct_request(None, json.dumps({"last_by_subj": "$KV.rt.a"}).encode(), TIMEOUT)
    assert (e.key, e.value, e.revision) == ("a", b"A", data["a_rev"])


async def test_status_413_multi_last_too_many_subjects(nc, data):
    p = peer(nc)
    with pytest.raises(UpstreamError, match="413"):
        await p.get_many(["big.>"], TIMEOUT)
    assert p.stats.errors == 1
    # a wildcard within the limit is fine
    got = await p.get_many(["big.1*"], TIMEOUT)
    assert got["big.1*"] is None  # results are keyed by the names asked for; a wildcard is no key


async def test_missing_stream_is_an_error_not_a_miss(nc, data):
    """A stream that does not exist must not read as 'every key is missing'."""
    for direct in (True, False):
        p = Peer("main", nc, "KV_nosuchbucket", "nosuchbucket", direct=direct)
        with pytest.raises(UpstreamError):
            await p.get("a", TIMEOUT)
        with pytest.raises(UpstreamError):
            await p.get("a", TIMEOUT, leader=True)


# --------------------------------------------------------------------------- no allow_direct


async def test_stream_without_allow_direct_uses_leader_api(nc, data):
    p = peer(nc, "rtnd", direct=True)  # not told: finds out from the missing responders
    e = await p.get("k", TIMEOUT)
    assert (e.value, e.revision, e.source) == (b"K", data["nd_rev"], "leader")
    assert p.direct is False
    assert await p.get("nosuch", TIMEOUT) is None
    assert (await p.get("gone", TIMEOUT)).operation is Operation.DEL
    got = await p.get_many(["k", "nosuch", "gone"], TIMEOUT)
    assert got["k"].value == b"K" and got["nosuch"] is None
    assert got["gone"].operation is Operation.DEL
    p2 = peer(nc, "rtnd", direct=True)
    got = await p2.get_many(["k", "nosuch"], TIMEOUT)   # multi_last finds no responders either
    assert got["k"].value == b"K" and got["nosuch"] is None and p2.direct is False


# --------------------------------------------------------------------------- multi_last


async def test_multi_last_mixed(nc, data):
    p = peer(nc)
    got = await p.get_many(["a", "nosuch", "gone", "m.0001"], TIMEOUT)
    assert got["a"].value == b"A" and got["a"].revision == data["a_rev"]
    assert got["nosuch"] is None
    assert got["gone"].operation is Operation.DEL and got["gone"].value is None
    assert got["m.0001"].value == b"v2-1"
    assert await p.get_many(["nosuch1", "nosuch2"], TIMEOUT) == {"nosuch1": None, "nosuch2": None}


async def test_multi_last_more_than_1024_keys(nc, data):
    assert MANY > MULTI_LAST_MAX
    p = peer(nc)
    keys = [f"m.{i:04d}" for i in range(MANY)]
    got = await p.get_many(keys, TIMEOUT)
    assert list(got) == keys
    assert [got[k].value for k in keys] == [b"v2-%d" % i for i in range(MANY)]
    assert [got[k].revision for k in keys] == [data["many_revs2"][k] for k in keys]


async def test_multi_last_point_in_time(nc, data):
    """up_to_seq pins every batch to one stream sequence: the first generation comes back."""
    p = peer(nc)
    keys = [f"m.{i:04d}" for i in range(MANY)]
    got = await p.get_many(keys, TIMEOUT, up_to_seq=data["snapshot"])
    assert [got[k].value for k in keys] == [b"v1-%d" % i for i in range(MANY)]
    assert [got[k].revision for k in keys] == [data["many_revs"][k] for k in keys]
    assert await p.get_many(["a", "m.0000"], TIMEOUT, up_to_seq=data["a_rev"]) == {
        "a": (await p.get("a", TIMEOUT)), "m.0000": None}


async def test_multi_last_one_snapshot_while_writing(nc, data):
    """Writes racing a split multi_last never mix generations: the answer for each key is its
    last revision at or below one sequence (the first batch's Nats-UpTo-Sequence)."""
    js = nc.jetstream()
    kv = await js.key_value("rt")
    keys = [f"m.{i:04d}" for i in range(MANY)]
    # each key's revisions from now on (the module's data may have been written since: this
    # test runs once per event loop on the same server)
    history: dict[str, list[int]] = {k: [(await kv.get(k)).revision] for k in keys}
    stop = asyncio.Event()

    async def writer():
        # alternately a key of the first multi_last batch and one of the second: a reply
        # mixing two points in time shows as a first-batch key older than the snapshot
        n = 0
        while not stop.is_set():
            k = keys[0] if n % 2 else keys[-1 - (n % 200)]
            history[k].append(await kv.put(k, b"w%d" % n))
            n += 1

    task = asyncio.create_task(writer())
    try:
        p = peer(nc)
        for _ in range(5):
            got = await p.get_many(keys, TIMEOUT)
            upto = max(e.revision for e in got.values())
            for k in keys:
                assert got[k].revision == max(r for r in history[k] if r <= upto), k
    finally:
        stop.set()
        await task


# --------------------------------------------------------------------------- router


async def test_router_picks_a_peer(nc, data):
    router = Router(TIMEOUT)
    with pytest.raises(UpstreamError, match="no peer"):
        await router.get("rt", "a")
    router.add(peer(nc))
    assert (await router.get("rt", "a")).value == b"A"
    assert (await router.get("rt", "a", strong=True)).source == "leader"
    assert (await router.get_many("rt", ["a", "nosuch"]))["nosuch"] is None
    assert [p.label for p in router.peers()] == ["main.rt"]
