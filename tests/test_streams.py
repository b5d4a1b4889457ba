"""A bucket's changes as a Redis stream, `@<bucket>` (kvcache.serve.streams): read
with redis-py's own stream API, over RESP2 and RESP3, and checked against what a NATS watch
resumed from the same sequence delivers (a JetStream consumer on the KV stream from sequence
N + 1: in a history-1 bucket each key's latest message, once, in sequence order). A real
nats-server, the sidecar as a process."""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest
import redis
from support import kvwatch
from support.kvdata import change
from support.poll import wait_until
from support.sidecar_proc import SidecarProcess
from support.topology import nats_run

from kvcache.natsio.nats_server import NatsServer

pytestmark = pytest.mark.servers

BUCKET = "follow"


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Iterator[dict]:
    d = tmp_path_factory.mktemp("streams")
    server = NatsServer(d / "nats").start()

    async def setup(js):
        kv = await js.create_key_value(bucket=BUCKET, history=1)
        await kv.put("a", b"1")
        await kv.put("b", b"2")
        await kv.put("c", b"3")
        await kv.put("a", b"1b")      # a's first entry goes: one per key
        await kv.delete("b")          # a delete stays as an entry (op DEL, no value)
        await kv.put("d.x", b"4")
        await kv.purge("c")           # a purge too (op PURGE)

    try:
        nats_run(server.url, setup)
        sc = SidecarProcess(d / "sc", server.url, [BUCKET], extra=["--listen", "127.0.0.1:0"])
        with sc:
            sc.start(timeout=60)
            yield {"url": server.url, "sock": sc.socket, "dir": d, "server": server, "sc": sc}
            assert sc.stop() == 0
    finally:
        server.stop()


def put(url: str, key: str, value: bytes | None, op: str = "put", bucket: str = BUCKET) -> int:
    """Change one key through NATS; its revision."""
    async def go(js):
        revision = await change(await js.key_value(bucket), key, op, value)
        return revision or (await js.stream_info(f"KV_{bucket}")).state.last_seq
    return nats_run(url, go)


def nats_watch_from(url: str, seq: int, bucket: str = BUCKET) -> list[tuple[int, str, str]]:
    return kvwatch.nats_watch_from(url, bucket, seq)


def as_rows(entries) -> list[tuple[int, str, str]]:
    """redis-py's [(id, {field: value})] as (revision, key, op)."""
    return [(int(i.split(b"-")[0]), f[b"key"].decode(), f[b"op"].decode()) for i, f in entries]


def test_a_full_listing_is_each_key_once_at_its_latest_revision(env):
    r = redis.Redis(unix_socket_path=env["sock"])
    entries = r.xrange(f"@{BUCKET}")
    assert as_rows(entries) == nats_watch_from(env["url"], 0)
    by_key = {f[b"key"]: f for _, f in entries}
    assert by_key[b"a"][b"value"] == b"1b" and by_key[b"a"][b"op"] == b"PUT"
    assert b"value" not in by_key[b"b"] and by_key[b"b"][b"op"] == b"DEL"
    assert b"value" not in by_key[b"c"] and by_key[b"c"][b"op"] == b"PURGE"
    assert int(by_key[b"d.x"][b"created"]) > 1_600_000_000 * 10**9
    assert r.xread({f"@{BUCKET}": 0}) == [[f"@{BUCKET}".encode(), entries]]
    assert r.xlen(f"@{BUCKET}") == len(entries) == 4
    assert r.type(f"@{BUCKET}") == b"stream"
    assert r.xrevrange(f"@{BUCKET}") == entries[::-1]


def test_resume_from_a_middle_revision_is_what_a_nats_watch_delivers(env):
    r = redis.Redis(unix_socket_path=env["sock"])
    before = r.xrange(f"@{BUCKET}")
    mid = int(before[1][0].split(b"-")[0])
    revs = [put(env["url"], "e", b"5"), put(env["url"], "a", b"1c"), put(env["url"], "d.x", None, "delete")]
    env["sc"].wait_for(lambda: r.xlen(f"@{BUCKET}") == 5 and int(r.xrevrange(f"@{BUCKET}", count=1)[0][0]
                                                                  .split(b"-")[0]) == revs[-1],
                       what="the sidecar to apply the three changes")
    for since in (0, mid, revs[0], revs[-1]):
        got = r.xread({f"@{BUCKET}": f"{since}-0"})
        rows = as_rows(got[0][1]) if got else []
        assert rows == nats_watch_from(env["url"], since), since
    # XRANGE's exclusive start and COUNT page through the same
    page1 = r.xrange(f"@{BUCKET}", min="-", max="+", count=2)
    page2 = r.xrange(f"@{BUCKET}", min=b"(" + page1[-1][0], max="+", count=10)
    assert as_rows(page1 + page2) == nats_watch_from(env["url"], 0)


def test_blocked_readers_wake_on_the_feed(env):
    r = redis.Redis(unix_socket_path=env["sock"])
    got: list = []
    ready = threading.Event()

    def reader() -> None:
        c = redis.Redis(unix_socket_path=env["sock"], socket_timeout=30)
        ready.set()
        got.extend(c.xread({f"@{BUCKET}": "$"}, block=20_000))

    t = threading.Thread(target=reader)
    t.start()
    ready.wait(5)
    wait_until(lambda: r.info("clients")["blocked_clients"] == 1, 10, "the reader blocked")
    assert b"cmd=xread" in r.execute_command("CLIENT", "LIST")
    sent = r.info("stats")["stream_entries_sent"]
    rev = put(env["url"], "live", b"now")
    t.join(30)
    assert not t.is_alive()
    assert got and as_rows(got[0][1]) == [(rev, "live", "PUT")]
    assert got[0][1][0][1][b"value"] == b"now"
    assert r.info("clients")["blocked_clients"] == 0
    assert r.info("stats")["stream_entries_sent"] == sent + 1
    # a BLOCK that times out is the null reply
    t0 = time.monotonic()
    assert r.xread({f"@{BUCKET}": "$"}, block=300) == []
    assert time.monotonic() - t0 >= 0.25


def test_the_tcp_listener_serves_the_same_stream(env):
    with redis.Redis(unix_socket_path=env["sock"]) as r:
        listen = r.info("server")["listen"]
        entries = r.xrange(f"@{BUCKET}")
    host, port = listen.rsplit(":", 1)
    with redis.Redis(host=host, port=int(port), protocol=3) as t:
        assert t.xrange(f"@{BUCKET}") == entries
        assert t.xread({f"@{BUCKET}": 0}) == {f"@{BUCKET}".encode(): [entries]}


def test_resp3_multi_and_errors(env):
    r3 = redis.Redis(unix_socket_path=env["sock"], protocol=3)
    entries = r3.xrange(f"@{BUCKET}")
    assert r3.xread({f"@{BUCKET}": 0}) == {f"@{BUCKET}".encode(): [entries]}
    assert r3.xread({f"@{BUCKET}": "$"}, block=100) == {}
    info = r3.xinfo_stream(f"@{BUCKET}")
    assert info["length"] == len(entries) and info["first-entry"][0] == entries[0][0]
    assert info["last-entry"][0] == entries[-1][0]
    r = redis.Redis(unix_socket_path=env["sock"])
    info2 = r.xinfo_stream(f"@{BUCKET}")
    assert info2["last-entry"] == entries[-1] and info2["length"] == len(entries)
    # EXEC never blocks: an XREAD BLOCK queued in MULTI answers null at once
    p = r.pipeline(transaction=True)
    p.xread({f"@{BUCKET}": "$"}, block=10_000)
    p.xlen(f"@{BUCKET}")
    t0 = time.monotonic()
    assert p.execute() == [[], len(entries)]
    assert time.monotonic() - t0 < 5
    with pytest.raises(redis.ResponseError, match="not a stream"):
        r.xrange("plainkey")
    with pytest.raises(redis.ResponseError, match="no such stream '@nope'"):
        r.xread({"@nope": 0})
    with pytest.raises(redis.ResponseError, match="past its last revision"):
        r.xread({f"@{BUCKET}": "999999999-0"})
    with pytest.raises(redis.ResponseError, match="Invalid stream ID"):
        r.xrange(f"@{BUCKET}", min="1-x")
    with pytest.raises(redis.ReadOnlyError):
        r.xadd(f"@{BUCKET}", {"f": "v"})


def test_an_id_below_the_horizon_must_start_from_0(env, tmp_path):
    """A bucket whose stream no longer starts at 1 when the sidecar first syncs: changes
    before its first sequence may have left no entry, so resuming from below it is an error
    that says to read from 0; 0 and any ID from the horizon on are answered."""
    async def setup(js):
        kv = await js.create_key_value(bucket="late", history=1)
        for i in range(5):
            await kv.put("k", b"%d" % i)   # the stream now starts at 5
        await kv.put("j", b"x")
    nats_run(env["url"], setup)
    sc = SidecarProcess(tmp_path / "sc", env["url"], ["late"])
    with sc:
        sc.start(timeout=60)
        r = redis.Redis(unix_socket_path=sc.socket)
        with pytest.raises(redis.ResponseError, match="read from 0 for a full listing"):
            r.xread({"@late": "2-0"})
        assert as_rows(r.xread({"@late": 0})[0][1]) == [(5, "k", "PUT"), (6, "j", "PUT")]
        assert as_rows(r.xread({"@late": "5-0"})[0][1]) == [(6, "j", "PUT")]
        assert r.xinfo_stream("@late")["exact-after"] == b"4-0"
        assert sc.stop() == 0


def test_a_resume_after_the_sidecar_restarts(env, tmp_path):
    """Changes made while the sidecar is down arrive, from the last ID read before."""
    sc = SidecarProcess(tmp_path / "sc", env["url"], [BUCKET])
    with sc:
        sc.start(timeout=60)
        r = redis.Redis(unix_socket_path=sc.socket)
        last = r.xrevrange(f"@{BUCKET}", count=1)[0][0]
        assert sc.stop() == 0
        put(env["url"], "while-down", b"1")
        put(env["url"], "e", None, "purge")
        sc.start(timeout=60)
        got = r.xread({f"@{BUCKET}": last})
        since = int(last.split(b"-")[0])
        assert as_rows(got[0][1]) == nats_watch_from(env["url"], since)
        assert [k for _, k, _ in as_rows(got[0][1])] == ["while-down", "e"]
        assert sc.stop() == 0


def test_a_resume_after_a_full_resync_is_refused_then_exact_from_0(env, tmp_path):
    """The sidecar is down while every key it knew changes: the stream no longer holds the
    sequence after its position, so it resyncs fully. A reader resuming from before is told
    to read from 0; from 0, and from the new horizon on, the stream is what a NATS watch
    delivers."""
    async def setup(js):
        kv = await js.create_key_value(bucket="rs", history=1)
        for k in ("k1", "k2", "k3"):
            await kv.put(k, b"old")
    nats_run(env["url"], setup)
    sc = SidecarProcess(tmp_path / "sc", env["url"], ["rs"])
    with sc:
        sc.start(timeout=60)
        r = redis.Redis(unix_socket_path=sc.socket)
        last = r.xread({"@rs": 0})[0][1][-1][0]
        assert sc.stop() == 0
        put(env["url"], "k1", b"new", bucket="rs")   # 4, gone at once: the stream starts at 5
        put(env["url"], "k1", b"newer", bucket="rs")
        put(env["url"], "k3", b"new", bucket="rs")
        put(env["url"], "k2", None, "delete", bucket="rs")
        put(env["url"], "k4", b"new", bucket="rs")
        sc.start(timeout=60)
        assert "full resync" in sc.log()
        with pytest.raises(redis.ResponseError, match="read from 0"):
            r.xread({"@rs": last})
        assert as_rows(r.xread({"@rs": 0})[0][1]) == nats_watch_from(env["url"], 0, "rs")
        horizon = int(r.xinfo_stream("@rs")["exact-after"].split(b"-")[0])
        assert horizon == 4  # the stream's first sequence (5) - 1 when the resync began
        assert as_rows(r.xread({"@rs": horizon})[0][1]) == nats_watch_from(env["url"], horizon, "rs")
        assert sc.stop() == 0


def test_kvcache_clients_watch_a_bucket(env):
    """kvcache.Client.watch and AsyncClient.watch: the listing from a revision, then changes
    as they come, as Entries (a delete's value None)."""
    from kvcache.app.client import AsyncClient, Client
    from kvcache.entry import Operation

    with Client(env["sock"], timeout=10) as c:
        it = c.watch(BUCKET)
        listing = [next(it) for _ in range(len(nats_watch_from(env["url"], 0)))]
        assert [(e.revision, e.key, e.operation.value) for e in listing] == nats_watch_from(env["url"], 0)
        rev = put(env["url"], "watched", b"w")
        e = next(it)
        assert (e.key, e.value, e.revision, e.operation) == ("watched", b"w", rev, Operation.PUT)
        rev = put(env["url"], "watched", None, "delete")
        e = next(it)
        assert (e.key, e.value, e.revision, e.operation) == ("watched", None, rev, Operation.DEL)

    async def follow() -> list:
        async with AsyncClient(env["sock"], timeout=10) as ac:
            got = []
            async for entry in ac.watch(BUCKET, after=rev - 1):
                got.append(entry)
                if len(got) == 2:
                    return got
                await asyncio.to_thread(put, env["url"], "async", b"a")
        return got
    got = asyncio.run(follow())
    assert [(g.key, g.operation) for g in got] == [("watched", Operation.DEL), ("async", Operation.PUT)]

    with Client(env["sock"], timeout=10) as c:  # a key filter: the stream @<bucket>:<filter>
        it = c.watch(BUCKET, after=rev, keys="watched")
        put(env["url"], "async", b"not matched")
        put_rev = put(env["url"], "watched", b"again")
        e = next(it)
        assert (e.bucket, e.key, e.value, e.revision) == (BUCKET, "watched", b"again", put_rev)
        put(env["url"], "async", b"still not matched")
        del_rev = put(env["url"], "watched", None, "delete")
        e = next(it)
        assert (e.bucket, e.key, e.operation, e.revision) == (BUCKET, "watched", Operation.DEL, del_rev)


def test_markers_the_stream_drops_leave_the_stream(env, tmp_path):
    """A delete stays an entry while its marker is in the stream; `purge_deletes` (a subject
    purge of each marker) takes it out of the stream, and out of `@<bucket>` too, once the
    sidecar has seen the purge: the listing is again what a NATS watch from 0 delivers."""
    async def setup(js):
        kv = await js.create_key_value(bucket="pd", history=1)
        await kv.put("live", b"1")
        await kv.put("gone", b"2")
        await kv.delete("gone")
        await kv.put("purged", b"3")
        await kv.purge("purged")
    nats_run(env["url"], setup)
    sc = SidecarProcess(tmp_path / "sc", env["url"], ["pd"])
    with sc:
        sc.start(timeout=60)
        r = redis.Redis(unix_socket_path=sc.socket)
        assert [k for _, k, _ in as_rows(r.xrange("@pd"))] == ["live", "gone", "purged"]

        async def purge(js):
            await (await js.key_value("pd")).purge_deletes(olderthan=0)
        nats_run(env["url"], purge)
        sc.wait_for(lambda: len(r.xrange("@pd")) == 1, 20, "the purged markers to leave the stream")
        assert as_rows(r.xrange("@pd")) == nats_watch_from(env["url"], 0, "pd")
        assert r.xlen("@pd") == 1
        assert sc.stop() == 0
