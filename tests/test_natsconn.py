"""kvcache.natsio.nats_connection.NatsConnection: nats-py with kvcache's wire reader, against a real server.

What nats-py's own client sees and what NatsConnection sees must be the same messages; the fast
lane must turn a real consumer's deliveries into the replica items kvcache.store.record builds.
"""
from __future__ import annotations

import asyncio
import itertools
import json

import nats
import pytest
from support.checkers import new_bucket

from kvcache import native
from kvcache.natsio.nats_connection import NatsConnection
from kvcache.store.record import item

NATIVE_OR_TWIN = "native" if native.is_native(native.load("natsproto")) else "twin"


@pytest.fixture
async def pair(nats_server_module):
    """(our NatsConnection, a plain nats-py client) on the same server."""
    ours = NatsConnection()
    await ours.connect(nats_server_module.url, connect_timeout=5, allow_reconnect=False)
    theirs = await nats.connect(nats_server_module.url, connect_timeout=5, allow_reconnect=False)
    try:
        yield ours, theirs
    finally:
        await ours.close()
        await theirs.close()


def view(msg) -> tuple:
    hdrs = {str(getattr(k, "value", k)): v for k, v in (msg.headers or {}).items()}
    return msg.subject, msg.reply, msg.data, hdrs


async def collect(nc, subject: str, n: int) -> tuple[object, list]:
    got: list = []
    done = asyncio.get_running_loop().create_future()

    async def cb(msg):
        got.append(view(msg))
        if len(got) == n and not done.done():
            done.set_result(None)

    sub = await nc.subscribe(subject, cb=cb)
    return (sub, done), got


async def test_same_messages_as_natspy(pair):
    ours, theirs = pair
    n = 200
    (_s1, d1), mine = await collect(ours, "cmp.>", n)
    (_s2, d2), ref = await collect(theirs, "cmp.>", n)
    await ours.flush()
    await theirs.flush()
    for i in range(n):
        headers = {"X-I": str(i), "Multi-Word": f"v {i} ünïcode"} if i % 3 else None
        payload = bytes(range(i % 256)) * (1 + i % 5)
        await theirs.publish(f"cmp.{i % 7}.x", payload, reply=f"r.{i}" if i % 2 else "", headers=headers)
    await asyncio.wait_for(asyncio.gather(d1, d2), 10)
    assert mine == ref
    assert len(mine) == n


async def test_requests_statuses_and_jetstream(pair):
    ours, _ = pair
    js = ours.jetstream()
    b = new_bucket()
    kv = await js.create_key_value(bucket=b, history=3, direct=True)
    rev = await kv.put("a.b", b"hello")
    entry = await kv.get("a.b")  # a Direct Get, answered with headers
    assert (entry.value, entry.revision) == (b"hello", rev)
    await kv.delete("a.b")
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await kv.get("a.b")
    # A 404 Direct Get reply is a status-only header block: nats-py's headers, our parsing.
    reply = await ours.request(f"$JS.API.DIRECT.GET.KV_{b}.$KV.{b}.missing", b"", timeout=5)
    assert reply.headers["Status"] == "404"
    assert reply.headers["Description"] == "Message Not Found"
    info = json.loads((await ours.request("$JS.API.INFO", b"", timeout=5)).data)
    assert info["type"] == "io.nats.jetstream.api.v1.account_info_response"
    await ours.flush()  # PING/PONG


async def test_fast_lane_gets_runs_of_replica_items(pair):
    ours, theirs = pair
    js = theirs.jetstream()
    b = new_bucket()  # unique: the test runs once per event loop on one server
    kv = await js.create_key_value(bucket=b, history=1)
    want = {}
    for i in range(300):
        want[f"k.{i:03d}"] = (f"v{i}".encode(), await kv.put(f"k.{i:03d}", f"v{i}".encode()))
    await kv.delete("k.007")  # history 1: the stream holds 300 messages, sequences 1..301

    batches: list[list] = []
    inbox = ours.new_inbox()
    sub = await ours.subscribe(inbox)
    ours.add_lane(sub._id, f"$KV.{b}.", batches.append)
    cfg = {"stream_name": f"KV_{b}", "config": {
        "deliver_subject": inbox, "ack_policy": "none", "deliver_policy": "all", "mem_storage": True,
        "idle_heartbeat": 200_000_000}}
    await ours.request(f"$JS.API.CONSUMER.CREATE.KV_{b}", json.dumps(cfg).encode(), timeout=5)

    async def all_delivered():
        while sum(len(ev.items) for b in batches for ev in b if type(ev).__name__ == "Run") < 300:
            await asyncio.sleep(0.02)
    await asyncio.wait_for(all_delivered(), 10)

    runs = [ev for b in batches for ev in b if type(ev).__name__ == "Run"]
    assert next(type(r).__module__ for r in runs).endswith("natsproto")
    items = [it for r in runs for it in r.items]
    assert runs[0].first_cseq == 1 and runs[-1].last_cseq == 300
    assert all(a.last_cseq + 1 == b.first_cseq for a, b in itertools.pairwise(runs))
    # every put is exactly the record kvcache.store.record builds; the delete is (key, None)
    by_key = {lk: rec for lk, rec in items}
    assert by_key[b"k.007"] is None
    rec = by_key[b"k.008"]
    value, rev = want["k.008"]
    assert rec == item(b"k.008", value, rev, int.from_bytes(rec[8:16], "little"))[1]
    assert len(by_key) == 300
    assert runs[-1].last_pending == 0 and runs[-1].top_sseq == 301

    # heartbeats are not deliveries: they reach the handler as ordinary events
    await asyncio.sleep(0.5)
    assert any(type(ev).__name__ == "HMsg" and ev.status == 100 for b in batches for ev in b)

    ours.remove_lane(sub._id)
    n = len(batches)
    await kv.put("after", b"x")
    msg = await sub.next_msg(timeout=5)  # without the lane, nats-py's queue gets it again
    while (msg.headers or {}).get("Status") == "100":  # an idle heartbeat may come first
        msg = await sub.next_msg(timeout=5)
    assert msg.subject == f"$KV.{b}.after" and msg.data == b"x"
    assert len(batches) == n
    await sub.unsubscribe()


def test_reader_in_use_is_the_one_native_py_picks():
    nc = NatsConnection()
    assert type(nc._ps.reader).__module__.endswith(
        "_native.natsproto" if NATIVE_OR_TWIN == "native" else "kvcache.natsio.natsproto")


async def test_fast_request_answers_like_natspy_request(pair):
    """Found, not found, no responders and a timeout: the same Msg or error as request()."""
    ours, _ = pair
    js = ours.jetstream()
    bucket = new_bucket()
    kv = await js.create_key_value(bucket=bucket, direct=True)
    rev = await kv.put("a", b"value a")
    found = f"$JS.API.DIRECT.GET.KV_{bucket}.$KV.{bucket}.a"
    missing = f"$JS.API.DIRECT.GET.KV_{bucket}.$KV.{bucket}.nope"
    for _ in range(3):  # the first call sets the inbox up and may go through request()
        for subject in (found, missing):
            a = await ours.fast_request(subject, b"", 5)
            b = await ours.request(subject, b"", timeout=5)
            assert (a.data, a.headers) == (b.data, b.headers)
    assert a.headers is not None
    got = await ours.fast_request(found, b"", 5)
    assert got.data == b"value a" and got.headers["Nats-Sequence"] == str(rev)
    with pytest.raises(nats.errors.NoRespondersError):
        await ours.fast_request("no.one.listens.here", b"", 5)
    sub = await ours.subscribe("silent.service")  # someone listens, nobody answers
    with pytest.raises(nats.errors.TimeoutError):
        await ours.fast_request("silent.service", b"ping", 0.2)
    await sub.unsubscribe()
    assert not ours._fast_waiting  # nothing left behind, answered or not
    # many at once, each gets its own answer
    keys = [f"k{i}" for i in range(50)]
    for k in keys:
        await kv.put(k, k.encode())
    replies = await asyncio.gather(*(ours.fast_request(f"$JS.API.DIRECT.GET.KV_{bucket}.$KV.{bucket}.{k}", b"", 5)
                                     for k in keys))
    assert [r.data for r in replies] == [k.encode() for k in keys]
