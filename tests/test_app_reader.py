"""LocalReader: in-process reads of the sidecar's LMDB files, with the freshness check."""
from __future__ import annotations

import asyncio
import time

import nats
import pytest
from support.sidecar_proc import SidecarProcess

from kvcache import LocalReader
from kvcache.app.reader import NotReplicated, StaleReplica
from kvcache.errors import ReplicaError
from kvcache.native import native_or_none

LONG_KEY = "long." + "k" * 600


async def fill(url: str) -> None:
    nc = await nats.connect(url)
    try:
        kv = await nc.jetstream().create_key_value(bucket="lr", direct=True)
        for i in range(200):
            await kv.put(f"a.{i}", b"value-%d\r\n\x00" % i)
        await kv.put(LONG_KEY, b"long value")
        other = await nc.jetstream().create_key_value(bucket="lr2", direct=True)
        await other.put("x", b"from lr2")
    finally:
        await nc.close()


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory, nats_server_module):
    asyncio.run(fill(nats_server_module.url))
    sc = SidecarProcess(tmp_path_factory.mktemp("lr") / "sc", nats_server_module.url, ["lr", "lr2"],
                 extra=["--heartbeat-ms", "200"]).start()
    yield sc
    sc.kill()


def test_reads_match_the_sidecar(sidecar):
    with LocalReader(str(sidecar.data_dir)) as r, sidecar.client() as c:
        assert r.buckets() == ["lr", "lr2"]
        assert r.default_bucket == "lr"
        for i in (0, 17, 199):
            assert r.get(f"a.{i}") == c.get(f"a.{i}") == b"value-%d\r\n\x00" % i
        assert r.get("lr2:x") == b"from lr2"
        assert r.get("a.9999") is None
        assert r.get(LONG_KEY) == b"long value"
        e = r.entry("lr:a.5")
        remote = c.entry("a.5")
        assert (e.bucket, e.key, e.value, e.revision, e.created) == \
            ("lr", "a.5", remote.value, remote.revision, remote.created)
        assert r.mget(["a.1", "nope", "lr2:x"]) == [b"value-1\r\n\x00", None, b"from lr2"]
        keys = r.keys()
        assert len(keys) == 201 and LONG_KEY in keys
        assert r.keys("a.1?") == [f"a.1{i}" for i in range(10)]


BAD_NAMES = ["bad key", "a..b", "a.", ".a", "", "x\ny", "_kv.x", "_kvx", "lr2:bad key", "lr2:_kv.y"]


def test_a_name_that_is_no_key_raises_the_sockets_error(sidecar):
    """Where the socket answers `ERR invalid key ...` (kvcache.Client raises it as
    ResponseError), LocalReader raises the same error with the same text: not None, which
    would say "absent" of a name no bucket can hold."""
    import kvcache
    with LocalReader(str(sidecar.data_dir)) as r, sidecar.client() as c:
        for name in BAD_NAMES:
            with pytest.raises(kvcache.ResponseError) as remote:
                c.get(name)
            assert str(remote.value).startswith("ERR invalid key"), (name, remote.value)
            for read in (r.get, r.entry, lambda k: r.mget(["a.1", k])):
                with pytest.raises(kvcache.ResponseError) as local:
                    read(name)
                assert str(local.value) == str(remote.value), name
        assert r.get("a.1") == b"value-1\r\n\x00"  # and a good key after them still reads


def test_sees_live_updates(sidecar):
    async def put():
        nc = await nats.connect(sidecar.args[sidecar.args.index("--nats") + 1])
        kv = await nc.jetstream().key_value("lr")
        rev = await kv.put("a.0", b"changed")
        await nc.close()
        return rev
    rev = asyncio.run(put())
    with LocalReader(str(sidecar.data_dir)) as r:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and r.get("a.0") != b"changed":
            time.sleep(0.01)
        assert r.get("a.0") == b"changed"
        assert r.entry("a.0").revision == rev


def test_two_readers_in_one_process(sidecar):
    a = LocalReader(str(sidecar.data_dir))
    b = LocalReader(str(sidecar.data_dir))
    assert a.get("a.3") == b.get("a.3")
    a.close()
    assert b.get("a.3") is not None  # closing one does not pull the environment from the other
    b.close()


def test_missing_replica_is_a_clear_error(tmp_path):
    with pytest.raises(ReplicaError, match="no kvcache replica"):
        LocalReader(str(tmp_path))


def test_stale_after_the_sidecar_stops(tmp_path, nats_server):
    asyncio.run(fill(nats_server.url))
    sc = SidecarProcess(tmp_path / "sc", nats_server.url, ["lr"], extra=["--heartbeat-ms", "200"]).start()
    reader = LocalReader(str(sc.data_dir), max_stale_ms=1000)
    assert reader.get("a.1") is not None
    assert sc.stop() == 0
    time.sleep(1.2)  # past max_stale_ms with nobody confirming freshness
    with pytest.raises(StaleReplica, match="stale"):
        reader.get("a.1")
    # A reader that accepts older data may still read it.
    with LocalReader(str(sc.data_dir), max_stale_ms=3_600_000) as lenient:
        assert lenient.get("a.1") is not None
    reader.close()


def test_fast_path_twins_agree(sidecar):
    """LocalGet (native and twin) on the same reader: same values, same fallbacks."""
    from kvcache.app import app_get as twin_mod
    native_mod = native_or_none("app_get")
    if native_mod is None:
        pytest.skip("kvcache._native.app_get not built")
    keys = [f"a.{i}" for i in range(0, 200, 13)] + [LONG_KEY, "lr2:x", "missing", "lr2:missing"]
    with LocalReader(sidecar.data_dir, max_stale_ms=60_000) as r:
        slow_calls: list[str] = []

        def slow(key):
            slow_calls.append(key)
            return r._get_checked(key)

        results = []
        for mod in (twin_mod, native_mod):
            slow_calls.clear()
            get = mod.LocalGet(r._located, r._fresh_until, r.env.begin, slow)
            first = [get(k) for k in keys]
            again = [get(k) for k in keys]
            assert first == again
            assert set(slow_calls) >= set(keys)   # the first read of every key is checked
            results.append(first)
            r._located.clear()
            r._fresh_until.clear()
        assert results[0] == results[1]
        assert results[0][-4] == b"long value" and results[0][-3] == b"from lr2"
        assert results[0][-2:] == [None, None]
        assert results[0][1] == b"value-13\r\n\x00"


def test_expired_records_are_absent(tmp_path, nats_server_module):
    """A key put with a Nats-TTL is absent to LocalReader once its deadline has passed (the
    LocalGet fast path, native and twin, `entry`, `keys`), with no sweep having run yet for
    the native/twin comparison; `never` and keys without a TTL stay."""
    from kvcache.app import app_get as twin_mod
    native_mod = native_or_none("app_get")

    async def fill_ttl() -> None:
        nc = await nats.connect(nats_server_module.url)
        try:
            js = nc.jetstream()
            kv = await js.create_key_value(bucket="lrttl")
            cfg = (await js.stream_info("KV_lrttl")).config
            cfg.allow_msg_ttl = True
            await js.update_stream(cfg)
            await kv.put("plain", b"p")
            for key, ttl in (("short", "2s"), (LONG_KEY, "2s"), ("never", "never"), ("long-lived", "1h")):
                await js.publish(f"$KV.lrttl.{key}", key.encode()[:8], headers={"Nats-TTL": ttl})
        finally:
            await nc.close()

    asyncio.run(fill_ttl())
    sc = SidecarProcess(tmp_path / "sc", nats_server_module.url, ["lrttl"], extra=["--heartbeat-ms", "200"]).start()
    try:
        keys = ["plain", "short", LONG_KEY, "never", "long-lived"]
        with LocalReader(str(sc.data_dir), max_stale_ms=60_000) as r:
            assert [r.get(k) for k in keys] == [b"p", b"short", b"long.kkk", b"never", b"long-liv"]
            due = r.entry("short").created + 2_000_000_000
            while time.time_ns() < due + 1_000_000:
                time.sleep(0.05)
            for mod in [twin_mod] + ([native_mod] if native_mod else []):
                get = mod.LocalGet(r._located, r._fresh_until, r.env.begin, r._get_checked)
                assert [get(k) for k in keys] == [b"p", None, None, b"never", b"long-liv"], mod
                assert [get(k) for k in keys] == [b"p", None, None, b"never", b"long-liv"], mod
            assert r.entry("short") is None and r.entry(LONG_KEY) is None
            assert sorted(r.keys()) == ["long-lived", "never", "plain"]
    finally:
        sc.kill()


def test_a_key_outside_the_filters_is_not_read_as_absent(tmp_path, nats_server):
    """With `keys = ["a.>"]` the replica holds none of `b.*`: the sidecar answers them from
    NATS, and LocalReader must not say None ("absent") of a key the bucket holds."""
    async def setup() -> None:
        nc = await nats.connect(nats_server.url)
        try:
            kv = await nc.jetstream().create_key_value(bucket="lf", direct=True)
            await kv.put("a.1", b"in")
            await kv.put("b.1", b"out")
        finally:
            await nc.close()
    asyncio.run(setup())
    conf = tmp_path / "kvcache.toml"
    conf.write_text(f'[nats]\nservers = ["{nats_server.url}"]\n[[bucket]]\nname = "lf"\nkeys = ["a.>"]\n')
    sc = SidecarProcess(tmp_path / "sc", None, extra=["--config", str(conf)]).start()
    try:
        with sc.client() as c:
            assert c.get("b.1") == b"out"  # the sidecar reads it from NATS
        with LocalReader(str(sc.data_dir)) as reader:
            assert reader.get("a.1") == b"in"
            assert reader.get("a.404") is None  # inside the filters: absent means absent
            assert reader.replicates("a.2") and not reader.replicates("b.1")
            for read in (reader.get, reader.entry, lambda k: reader.mget([k])):
                with pytest.raises(NotReplicated, match=r"outside bucket 'lf''s filters \(keys = \['a.>'\]\)"):
                    read("b.1")
            with pytest.raises(NotReplicated):
                reader.get("lf:b.404")
    finally:
        sc.kill()


def test_its_errors_are_public_names():
    """An application catches LocalReader's errors as kvcache.StaleReplica and
    kvcache.NotReplicated, not by the module they are defined in."""
    import kvcache
    from kvcache.app.client import ResponseError
    assert kvcache.StaleReplica is StaleReplica and kvcache.NotReplicated is NotReplicated
    assert kvcache.ResponseError is ResponseError  # a name that is no key, from either side
    assert {"StaleReplica", "NotReplicated", "LocalReader", "ResponseError"} <= set(kvcache.__all__)
