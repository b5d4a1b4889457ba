"""The sidecar's access log: sampling, rotation, and the records a real sidecar writes for
local hits, misses and remote reads."""
from __future__ import annotations

import os
import time

import pytest
import redis
from support.access_records import read_records
from support.sidecar_proc import SidecarProcess
from support.topology import nats_run

from kvcache.config_sources import load as load_config
from kvcache.errors import ConfigError
from kvcache.ops.accesslog import AccessLog


def test_off_by_default_and_opens_nothing(tmp_path):
    cfg = load_config(env={}, overrides={"data_dir": str(tmp_path)})
    log = AccessLog.from_config(cfg)
    assert cfg.access_log_rate == 0 and not log.enabled
    assert not any(log.sampled() for _ in range(1000))
    assert log.directory == os.path.join(str(tmp_path), "access-logs") and not os.path.exists(log.directory)


def test_sampling_rate_is_honoured(tmp_path):
    log = AccessLog(str(tmp_path), 0.1, seed=7)
    n = sum(log.sampled() for _ in range(100_000))
    assert 9_000 < n < 11_000  # binomial(100000, 0.1): sd ~95, so this never fails by chance
    every = AccessLog(str(tmp_path / "all"), 1.0)
    assert all(every.sampled() for _ in range(1000))


def test_records_and_rotation(tmp_path):
    log = AccessLog(str(tmp_path), 1.0, max_bytes=1000, files=2)
    t0 = time.time_ns() // 1_000_000
    for i in range(100):
        log.record("b", f"key.{i:03d}", "local", i % 2 == 0, 12 + i, "GET")
    log.close()
    t1 = time.time_ns() // 1_000_000
    names = {p.name for p in tmp_path.iterdir()}
    # two rotated files kept, older ones dropped (access.log itself is opened by the next record)
    assert {"access.log.1", "access.log.2"} <= names <= {"access.log", "access.log.1", "access.log.2"}
    assert all(p.stat().st_size <= 1000 + 100 for p in tmp_path.iterdir())
    recs = read_records(tmp_path)
    last = dict(recs[-1])
    assert t0 <= int(last.pop("ts_ms")) <= t1  # the record's own time, in ms
    assert last == {"bucket": "b", "key": "key.099", "source": "local",
                    "hit": "0", "latency_us": "111", "command": "GET", "rate": "1"}
    keys = [r["key"] for r in recs]
    assert keys == [f"key.{i:03d}" for i in range(100 - len(keys), 100)]  # the newest, in order
    assert 20 < len(keys) < 100


def test_config_validation():
    with pytest.raises(ConfigError, match="access_log_rate"):
        load_config(env={"KVCACHE_ACCESS_LOG_RATE": "1.5"})
    cfg = load_config(env={"KVCACHE_ACCESS_LOG_RATE": "0.25", "KVCACHE_ACCESS_LOG_FILES": "3"})
    assert cfg.access_log_rate == 0.25 and cfg.access_log_files == 3


def test_real_sidecar_logs_local_remote_and_misses(tmp_path, nats_server):
    async def fill(js):
        kv = await js.create_key_value(bucket="app", direct=True)
        for i in range(5):
            await kv.put(f"hot.{i}", f"h{i}".encode())
            await kv.put(f"cold.{i}", f"c{i}".encode())
    nats_run(nats_server.url, fill)
    logdir = tmp_path / "logs"

    def sidecar() -> SidecarProcess:  # every read logged; rotation at 4000 bytes, 2 files kept
        return SidecarProcess(tmp_path / "data", nats_server.url, ["app:hot.>"],
                       extra=["--access-log-rate", "1", "--access-log-dir", str(logdir),
                              "--access-log-max-bytes", "4000", "--access-log-files", "2"])

    sc = sidecar()
    with sc:
        sc.start()
        r = redis.Redis(unix_socket_path=sc.socket)
        assert r.get("hot.1") == b"h1"          # local hit, through the GET path
        assert r.get("hot.nope") is None         # local miss
        assert r.get("cold.2") == b"c2"          # remote hit: Direct Get on the main connection
        assert r.get("cold.nope") is None        # remote miss
        assert r.mget("hot.3", "cold.3") == [b"h3", b"c3"]
        assert r.exists("hot.4", "hot.none") == 1
        assert r.execute_command("KV.GET", "cold.4")[0] == b"c4"
        assert r.info("stats")["access_log_records"] == 9
        assert sc.stop() == 0  # SIGTERM: buffered lines are flushed on exit
    recs = read_records(logdir)
    got = [(r["command"], r["bucket"], r["key"], r["source"], r["hit"]) for r in recs]
    assert got == [
        ("GET", "app", "hot.1", "local", "1"),
        ("GET", "app", "hot.nope", "local", "0"),
        ("GET", "app", "cold.2", "main.app", "1"),
        ("GET", "app", "cold.nope", "remote", "0"),
        ("MGET", "app", "hot.3", "local", "1"),
        ("MGET", "app", "cold.3", "main.app", "1"),
        ("EXISTS", "app", "hot.4", "local", "1"),
        ("EXISTS", "app", "hot.none", "local", "0"),
        ("KV.GET", "app", "cold.4", "main.app", "1"),
    ]
    assert all(int(r["latency_us"]) >= 0 and r["rate"] == "1" for r in recs)
    assert int(recs[2]["latency_us"]) > 0  # a NATS round trip takes some microseconds

    # many reads: rotation keeps access.log plus 2 rotated files
    sc2 = sidecar()
    with sc2:
        sc2.start()
        r = redis.Redis(unix_socket_path=sc2.socket)
        pipe = r.pipeline(transaction=False)
        for i in range(600):
            pipe.get(f"hot.{i % 5}")
        assert pipe.execute()[:5] == [b"h0", b"h1", b"h2", b"h3", b"h4"]
        assert sc2.stop() == 0
    assert sorted(p.name for p in logdir.iterdir()) == ["access.log", "access.log.1", "access.log.2"]
    assert read_records(logdir)[-1]["key"] == "hot.4"


def test_sidecar_without_rate_writes_no_log(tmp_path, nats_server):
    nats_run(nats_server.url, lambda js: js.create_key_value(bucket="quiet"))
    sc = SidecarProcess(tmp_path / "data", nats_server.url, ["quiet"])
    with sc:
        sc.start()
        assert redis.Redis(unix_socket_path=sc.socket).get("missing") is None
        assert sc.stop() == 0
    assert not (tmp_path / "data" / "access-logs").exists()


def test_mget_keys_log_their_own_latency(tmp_path, nats_server):
    """Each MGET key's latency_us is its own read, not the time since the MGET began: the
    replica's keys' latencies add up to less than the whole command took as the client saw
    it (charged from the command's start, the 1,000th key alone would take about that much
    and their sum hundreds of times more); the keys NATS answered in one batch each show at
    most the command's time."""
    n = 1000

    async def fill(js):
        kv = await js.create_key_value(bucket="app", direct=True)
        for i in range(n):
            await kv.put(f"hot.{i}", b"h")
        for i in range(5):
            await kv.put(f"cold.{i}", b"c")
    nats_run(nats_server.url, fill)
    logdir = tmp_path / "logs"
    sc = SidecarProcess(tmp_path / "data", nats_server.url, ["app:hot.>"],
                        extra=["--access-log-rate", "1", "--access-log-dir", str(logdir)])
    keys = [f"hot.{i}" for i in range(n)] + [f"cold.{i}" for i in range(5)]
    with sc:
        sc.start()
        r = redis.Redis(unix_socket_path=sc.socket)
        assert r.get("hot.0") == b"h"  # connected and warm
        t0 = time.perf_counter_ns()
        values = r.mget(keys)
        wall_us = (time.perf_counter_ns() - t0) // 1000
        assert values == [b"h"] * n + [b"c"] * 5
        assert sc.stop() == 0
    recs = [rec for rec in read_records(logdir) if rec["command"] == "MGET"]
    assert [rec["key"] for rec in recs] == keys
    local = [int(rec["latency_us"]) for rec in recs if rec["source"] == "local"]
    remote = [int(rec["latency_us"]) for rec in recs if rec["source"] != "local"]
    assert len(local) == n and len(remote) == 5
    assert sum(local) <= wall_us, (sum(local), wall_us, local[-5:])
    assert all(0 < lat <= wall_us for lat in remote), (remote, wall_us)
