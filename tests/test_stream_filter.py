"""A stream of part of a bucket, `@<bucket>:<filter>` (kvcache.serve.streams): what
a NATS KV watch of the same filter delivers (nats-py's `kv.watch(filter, include_history=True)`:
in a history-1 bucket, each matching key's latest message, deletes and purges included, in
sequence order), from 0 and resumed from an ID it handed out; blocked reads that wake only for
a matching key; the filter's grammar and its coverage by what the sidecar replicates. A real
nats-server, the sidecar as a process, redis-py and nats-py as the clients."""
from __future__ import annotations

import random
import threading
from collections.abc import Iterator

import pytest
import redis
from support.kvdata import change
from support.poll import wait_until
from support.sidecar_proc import SidecarProcess
from support.topology import nats_run

from kvcache.keys import filter_within
from kvcache.natsio.nats_server import NatsServer

servers = pytest.mark.servers

BUCKET = "flt"        # replicated whole
PART = "part"         # replicated for `feature.>` only
FILTERS = ["feature.*", "feature.>", "*.x", "feature.a", ">"]
# keys under `feature.*` and around it: deeper (`feature.>` only), elsewhere, and a near name
KEYS = ["feature.a", "feature.b", "feature.c", "feature.d", "feature.e", "feature.f", "feature.x",
        "feature.a.b", "feature.c.x", "feature.d.x", "other.x", "other.y", "other.z", "features", "x"]
OPS = 120

Row = tuple[int, str, bytes | None, str]  # (revision, key, value: None for a delete or purge, op)


def workload(url: str, bucket: str, seed: int, n: int) -> int:
    """`n` seeded puts, deletes and purges over KEYS; the stream's last sequence after them."""
    rng = random.Random(seed)

    async def go(js):
        kv = await js.key_value(bucket)
        for i in range(n):
            key = rng.choice(KEYS)
            op = rng.choices(["put", "delete", "purge"], [5, 3, 2])[0]
            await change(kv, key, op, b"v%d-%d" % (seed, i))
        return (await js.stream_info(f"KV_{bucket}")).state.last_seq
    return nats_run(url, go)


def put(url: str, key: str, value: bytes, bucket: str = BUCKET) -> int:
    async def go(js):
        return await (await js.key_value(bucket)).put(key, value)
    return nats_run(url, go)


def nats_watch(url: str, bucket: str, flt: str) -> list[Row]:
    """What nats-py's KV watch of `flt` with its history (from the stream's start: reading
    from 0) delivers of the messages there now. Their number is the stream's, asked first:
    nats-py's end-of-initial-values marker (None) may come before them when they arrive
    before its consumer info does, so it is skipped, not trusted."""
    async def go(js):
        info = await js.stream_info(f"KV_{bucket}", subjects_filter=f"$KV.{bucket}.{flt}")
        n = sum((info.state.subjects or {}).values())
        kv = await js.key_value(bucket)
        w = await kv.watch(flt, include_history=True)
        out: list[Row] = []
        try:
            while len(out) < n:
                if (e := await w.updates(timeout=10)) is None:
                    continue
                op = e.operation or "PUT"
                out.append((e.revision, e.key, e.value if op == "PUT" else None, op))
        finally:
            await w.stop()
        assert not out or out[-1][0] <= info.state.last_seq
        return out
    return nats_run(url, go)


def as_rows(entries) -> list[Row]:
    """redis-py's [(id, {field: value})] as rows."""
    return [(int(i.split(b"-")[0]), f[b"key"].decode(), f.get(b"value"), f[b"op"].decode())
            for i, f in entries]


def xread_all(r: redis.Redis, stream: str, after: str, count: int) -> list[Row]:
    """The stream read after `after` a page of `count` at a time, each from the last ID of
    the page before: a follower resuming from the IDs the filtered stream handed out."""
    rows: list[Row] = []
    while got := r.xread({stream: after}, count=count):
        [(name, entries)] = got
        assert name == stream.encode()
        rows += as_rows(entries)
        after = entries[-1][0].decode()
    return rows


def applied(r: redis.Redis, bucket: str) -> int:
    return int(r.xinfo_stream(f"@{bucket}")["last-generated-id"].split(b"-")[0])


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Iterator[dict]:
    d = tmp_path_factory.mktemp("stream_filter")
    server = NatsServer(d / "nats").start()

    async def setup(js):
        await js.create_key_value(bucket=BUCKET, history=1)
        await js.create_key_value(bucket=PART, history=1)

    try:
        nats_run(server.url, setup)
        workload(server.url, BUCKET, 1, OPS // 2)  # before the sidecar: its first sync
        workload(server.url, PART, 2, 20)
        sc = SidecarProcess(d / "sc", server.url, [BUCKET, f"{PART}:feature.>"])
        with sc:
            sc.start(timeout=60)
            r = redis.Redis(unix_socket_path=sc.socket)
            last = workload(server.url, BUCKET, 3, OPS // 2)  # and after: through the feed
            sc.wait_for(lambda: applied(r, BUCKET) == last, what="the sidecar to apply the workload")
            yield {"url": server.url, "sock": sc.socket, "sc": sc}
            assert sc.stop() == 0
    finally:
        server.stop()


@servers
@pytest.mark.parametrize("flt", FILTERS)
def test_a_filtered_stream_is_what_a_nats_watch_of_the_filter_delivers(env, flt):
    r = redis.Redis(unix_socket_path=env["sock"])
    stream = f"@{BUCKET}:{flt}"
    want = nats_watch(env["url"], BUCKET, flt)
    assert want, "the workload leaves entries under every filter"
    if flt in ("feature.*", "feature.>", ">"):
        assert {op for *_, op in want} == {"PUT", "DEL", "PURGE"}, "the workload leaves each kind"
    assert as_rows(r.xrange(stream)) == want
    assert as_rows(r.xrevrange(stream)) == want[::-1]
    assert xread_all(r, stream, "0", 1_000) == want
    assert xread_all(r, stream, "0", 3) == want  # resumed from each page's last ID
    # resumed from a middle ID it handed out: the watch's messages after that sequence
    mid = want[len(want) // 2][0]
    after_mid = [row for row in want if row[0] > mid]
    assert xread_all(r, stream, f"{mid}-0", 1_000) == after_mid
    assert as_rows(r.xrange(stream, min=f"({mid}-0")) == after_mid
    # and from an ID between its entries (another key's revision, or one gone): the same rule
    revs = {row[0] for row in want}
    for gap in [rev for rev in range(want[0][0], want[-1][0]) if rev not in revs][::7]:
        assert xread_all(r, stream, f"{gap}-0", 1_000) == [row for row in want if row[0] > gap]
    # XLEN, TYPE, EXISTS, XINFO of the filtered name
    assert r.xlen(stream) == len(want)
    assert r.type(stream) == b"stream"
    assert r.exists(stream) == 1
    info = r.xinfo_stream(stream)
    assert info["length"] == len(want)
    assert as_rows([info["first-entry"]]) == want[:1] and as_rows([info["last-entry"]]) == want[-1:]
    assert info["last-generated-id"] == r.xinfo_stream(f"@{BUCKET}")["last-generated-id"]
    assert as_rows(r.xread({stream: "+"})[0][1]) == want[-1:]
    if flt == ">":
        assert r.xrange(stream) == r.xrange(f"@{BUCKET}")
    else:
        assert info["key-filter"] == flt.encode()


@servers
def test_a_bucket_replicating_a_filter_streams_filters_within_it(env):
    r = redis.Redis(unix_socket_path=env["sock"])
    for flt in ("feature.*", "feature.>", "feature.a.b"):
        assert as_rows(r.xrange(f"@{PART}:{flt}")) == nats_watch(env["url"], PART, flt)
    for flt in (">", "other.*", "*.x", "features"):
        for call in (lambda s: r.xread({s: 0}), r.xrange, r.xrevrange, r.xlen, r.xinfo_stream, r.type):
            with pytest.raises(redis.ResponseError) as e:
                call(f"@{PART}:{flt}")
            assert str(e.value) == (f"stream '@{PART}:{flt}' would miss keys: bucket {PART} replicates only "
                                    f"the keys feature.> here, and '{flt}' reaches outside them; follow a "
                                    "filter within them")
        assert r.exists(f"@{PART}:{flt}") == 0


@servers
def test_an_invalid_filter_is_an_error_saying_why(env):
    r = redis.Redis(unix_socket_path=env["sock"])
    for flt, why in (("", "the filter is empty"), ("feature..a", "it has an empty token"),
                     (".feature", "it has an empty token"), ("feature.", "it has an empty token"),
                     ("feature.>.a", "'>' may only be its last token"), ("fea*", "'fea*' is not a token"),
                     ("feature.a b", "'a b' is not a token"), ("f:g", "'f:g' is not a token")):
        stream = f"@{BUCKET}:{flt}"
        for call in (lambda s: r.xread({s: "$"}, block=10_000), r.xrange, r.xlen, r.type):
            with pytest.raises(redis.ResponseError, match=r"^invalid key filter") as e:
                call(stream)
            assert str(e.value).startswith(f"invalid key filter '{flt}' in stream '{stream}': {why}; "), e.value
        assert r.exists(stream) == 0
    with pytest.raises(redis.ResponseError, match=r"no such stream '@nope:feature\.\*'"):
        r.xrange("@nope:feature.*")
    with pytest.raises(redis.ResponseError, match="past its last revision"):
        r.xread({f"@{BUCKET}:feature.*": "999999999-0"})
    assert r.exists(f"@{BUCKET}:feature.*", f"@{BUCKET}", f"@{BUCKET}:>") == 3


def blocked_read(sock: str, streams: dict[str, str], block_ms: int) -> tuple[threading.Thread, list]:
    """An XREAD BLOCK in a thread of its own; its reply lands in the list."""
    got: list = []

    def reader() -> None:
        with redis.Redis(unix_socket_path=sock, socket_timeout=60) as c:
            got.append(c.xread(streams, block=block_ms))
    t = threading.Thread(target=reader)
    t.start()
    return t, got


@servers
def test_a_blocked_read_wakes_for_a_matching_key_only(env):
    r = redis.Redis(unix_socket_path=env["sock"])
    stream = f"@{BUCKET}:feature.*"
    sent = r.info("stats")["stream_entries_sent"]
    t, got = blocked_read(env["sock"], {stream: "$"}, 30_000)
    wait_until(lambda: r.info("clients")["blocked_clients"] == 1, 10, "the reader blocked")
    # keys outside the filter: each batch wakes the bucket's readers, and this one waits on
    for key in ("other.x", "feature.a.b", "features"):
        rev = put(env["url"], key, b"not for it")
        env["sc"].wait_for(lambda rev=rev: applied(r, BUCKET) >= rev, what=f"the sidecar to apply {key}")
    assert t.is_alive() and r.info("clients")["blocked_clients"] == 1
    rev = put(env["url"], "feature.q", b"for it")
    t.join(30)
    assert not t.is_alive()
    [[name, entries]] = got[0]
    assert name == stream.encode()
    assert as_rows(entries) == [(rev, "feature.q", b"for it", "PUT")]
    assert r.info("stats")["stream_entries_sent"] == sent + 1
    assert r.info("clients")["blocked_clients"] == 0


@servers
def test_a_blocked_read_of_several_filters_answers_the_ones_that_matched(env):
    r = redis.Redis(unix_socket_path=env["sock"], protocol=3)
    t, got = blocked_read(env["sock"], {f"@{BUCKET}:feature.*": "$", f"@{BUCKET}:other.*": "$"}, 30_000)
    wait_until(lambda: r.info("clients")["blocked_clients"] == 1, 10, "the reader blocked")
    put(env["url"], "x", b"neither")
    rev = put(env["url"], "other.y", b"the second")
    t.join(30)
    assert not t.is_alive()
    assert [(name, as_rows(entries)) for name, entries in got[0]] == \
        [(f"@{BUCKET}:other.*".encode(), [(rev, "other.y", b"the second", "PUT")])]
    # a resumed read of both from an earlier ID gives each its own keys, RESP3's map of streams
    both = r.xread({f"@{BUCKET}:feature.*": f"{rev - 1}-0", f"@{BUCKET}:*.y": f"{rev - 2}-0"})
    assert {k: as_rows(v[0]) for k, v in both.items()} == \
        {f"@{BUCKET}:*.y".encode(): [(rev, "other.y", b"the second", "PUT")]}


@servers
def test_a_blocked_read_with_only_other_keys_written_times_out_empty(env):
    r = redis.Redis(unix_socket_path=env["sock"])
    t, got = blocked_read(env["sock"], {f"@{BUCKET}:feature.*": "$"}, 2_000)
    wait_until(lambda: r.info("clients")["blocked_clients"] == 1, 10, "the reader blocked")
    rev = put(env["url"], "other.x", b"not for it")
    env["sc"].wait_for(lambda: applied(r, BUCKET) >= rev, what="the sidecar to apply other.x")
    t.join(30)
    assert not t.is_alive()
    assert got == [[]]


@servers
def test_deletes_and_purges_of_matching_keys_are_entries_as_in_the_watch(env):
    r = redis.Redis(unix_socket_path=env["sock"])
    stream = f"@{BUCKET}:feature.*"
    start = applied(r, BUCKET)

    async def go(js):
        kv = await js.key_value(BUCKET)
        await kv.put("feature.d", b"1")
        await kv.delete("feature.d")
        await kv.put("feature.e", b"2")
        await kv.purge("feature.e")
        await kv.delete("other.y")
        return (await js.stream_info(f"KV_{BUCKET}")).state.last_seq
    last = nats_run(env["url"], go)
    env["sc"].wait_for(lambda: applied(r, BUCKET) == last, what="the sidecar to apply the changes")
    rows = xread_all(r, stream, f"{start}-0", 10)
    assert [(k, v, op) for _, k, v, op in rows] == [("feature.d", None, "DEL"), ("feature.e", None, "PURGE")]
    assert rows == [row for row in nats_watch(env["url"], BUCKET, "feature.*") if row[0] > start]


def test_filter_within_the_replicated_filters():
    assert filter_within("feature.*", [">"])
    assert filter_within("feature.*", ["feature.>"])
    assert filter_within("feature.a.b", ["feature.>"])
    assert not filter_within("feature.>", ["feature.*"])
    assert filter_within("feature.>", ["feature.*", "feature.*.>"])  # together, not alone
    assert not filter_within("feature.>", ["feature.*", "feature.*.*"])
    assert not filter_within(">", ["feature.>"])
    assert filter_within(">", ["*", "*.>"])
    assert filter_within("a.*.c", ["a.>"])
    assert not filter_within("a.*.c", ["a.b.c"])
    assert not filter_within("feature.*", ["feature.a", "feature.b"])
    assert filter_within("*.b", ["*.b", "x"])
    assert not filter_within("*.b", ["a.*"])
    assert not filter_within("x", ["x.>"])
    assert filter_within("x", ["x", "y.>"])


def test_filter_within_agrees_with_the_keys_it_matches():
    """On generated filters over a small alphabet, a filter said within others matches no
    sampled key they miss (the sample includes a token none of them names)."""
    from kvcache.keys import subject_match

    rng = random.Random(39)
    tokens = ["a", "b", "z"]

    def gen() -> str:
        n = rng.randint(1, 3)
        out = [rng.choice([*tokens, "*", "*"]) for _ in range(n)]
        if rng.random() < 0.3:
            out.append(">")
        return ".".join(out)

    keys = [".".join(rng.choice([*tokens, "q"]) for _ in range(rng.randint(1, 5))) for _ in range(400)]
    said = 0
    for _ in range(400):
        f, gs = gen(), [gen() for _ in range(rng.randint(1, 3))]
        if filter_within(f, gs):
            said += 1
            for k in keys:
                if subject_match(f, k):
                    assert any(subject_match(g, k) for g in gs), (f, gs, k)
        else:
            # not within: some key under f that none of gs matches (built from f, with a fresh token)
            assert any(subject_match(f, k) and not any(subject_match(g, k) for g in gs)
                       for k in _keys_of(f, 6)), (f, gs)
    assert said > 20


def _keys_of(f: str, longest: int) -> list[str]:
    """Keys `f` matches, its wildcards as any of a few tokens, `>` as 1 to `longest` tokens."""
    out = [""]
    for t in f.split("."):
        if t == ">":
            out = [p + "." + ".".join(["q"] * n) if p else ".".join(["q"] * n)
                   for p in out for n in range(1, longest + 1)]
        else:
            opts = ["a", "b", "z", "q"] if t == "*" else [t]
            out = [(p + "." + o) if p else o for p in out for o in opts]
    return out
