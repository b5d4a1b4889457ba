"""`kvcache serve` with no NATS URL: an embedded nats-server and a demo bucket, as a new user
sees it; the embedded server never outlives the sidecar."""
from __future__ import annotations

import asyncio
import os
import socket
import time

import nats
import pytest
import redis
from support.procs import embedded_pid, pid_alive
from support.sidecar_proc import SidecarProcess, run_cli

from kvcache import config_sources
from kvcache.demo import DEMO_BUCKET, DEMO_KEYS, demo_entries, demo_value
from kvcache.errors import ConfigError
from kvcache.natsio.nats_server import free_port

pytestmark = pytest.mark.servers  # each test starts its own servers or sidecar process

DEMO_SIZE = len(demo_entries())


@pytest.fixture
def demo(tmp_path):
    sc = SidecarProcess(tmp_path / "data", None).start()
    yield sc
    sc.kill()


def test_demo_bucket_works_out_of_the_box(demo):
    r = redis.Redis(unix_socket_path=demo.socket)
    assert r.get("greeting") == b"hello from kvcache"
    assert r.get("demo:user.0042") == b'{"id":42,"name":"user 42"}'
    # what README.md's snippets and bench/locustfile.py read
    assert r.get("feature.checkout") == b'{"enabled":true,"rollout":0.25}'
    assert r.mget("hot.000000", f"cold.{DEMO_KEYS - 1:06d}") == [demo_value("hot.000000"),
                                                                demo_value(f"cold.{DEMO_KEYS - 1:06d}")]
    assert len(demo_value("hot.000007")) == 100
    assert r.dbsize() == DEMO_SIZE
    info = r.info("buckets")
    assert info["demo"]["synced"] == 1 and info["demo"]["keys"] == DEMO_SIZE
    out = run_cli("get", "--data-dir", str(demo.data_dir), "greeting")
    assert out.returncode == 0 and out.stdout == "hello from kvcache\n"
    out = run_cli("info", "--data-dir", str(demo.data_dir), "buckets")
    assert out.returncode == 0 and f"demo:synced=1,keys={DEMO_SIZE}" in out.stdout


def test_sigterm_stops_the_embedded_server_and_removes_the_socket(demo):
    nats_pid = embedded_pid(demo)
    assert demo.stop() == 0
    assert not os.path.exists(demo.socket)
    assert not pid_alive(nats_pid)


def test_restart_keeps_the_demo_data(demo):
    assert demo.stop() == 0
    demo.start()
    with demo.client() as c:
        assert c.get("greeting") == b"hello from kvcache"
        assert c.info("buckets")["buckets"]["demo"]["resyncs"] == 0


def test_kill9_of_the_sidecar_takes_the_embedded_server_down(demo):
    nats_pid = embedded_pid(demo)
    demo.kill()
    deadline = time.monotonic() + 10
    while pid_alive(nats_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(nats_pid)
    # and a restart over the stale socket file works
    demo.start()
    with demo.client() as c:
        assert c.get("greeting") == b"hello from kvcache"


def test_embedded_port_fixes_the_servers_port(tmp_path):
    """embedded_port (KVCACHE_EMBEDDED_PORT): the embedded nats-server listens where the `nats`
    CLI can be pointed, in INFO too; restarted, it comes back on the same port."""
    port = free_port()
    sc = SidecarProcess(tmp_path / "data", None, env={"KVCACHE_EMBEDDED_PORT": str(port)})
    with sc.start():
        with sc.client() as c:
            assert c.info("server")["server"]["nats_url"] == f"nats://127.0.0.1:{port}"

        async def put() -> None:
            nc = await nats.connect(f"nats://127.0.0.1:{port}")
            await (await nc.jetstream().key_value(DEMO_BUCKET)).put("greeting", b"hello again")
            await nc.close()
        asyncio.run(put())
        sc.wait_for(lambda: sc.client().get("greeting") == b"hello again", what="the put to arrive")
        assert sc.stop() == 0
        sc.start()
        with sc.client() as c:  # the user's change is kept: a restart does not seed over it
            assert c.info("server")["server"]["nats_url"] == f"nats://127.0.0.1:{port}"
            assert c.get("greeting") == b"hello again"


def test_embedded_port_in_use_is_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = run_cli("serve", "--data-dir", str(tmp_path / "d"), env={"KVCACHE_EMBEDDED_PORT": str(port)})
    assert out.returncode == 1, out.stderr
    assert out.stderr == (f"kvcache: error: the embedded nats-server cannot listen on 127.0.0.1:{port} "
                          "(embedded_port, KVCACHE_EMBEDDED_PORT): address already in use\n")


def test_embedded_port_setting():
    assert config_sources.load(None, env={}).embedded_port == 0  # the default: a free port
    assert config_sources.load(None, env={"KVCACHE_EMBEDDED_PORT": "4222"}).embedded_port == 4222
    assert config_sources.load(None, env={}, overrides={"embedded_port": 4333}).embedded_port == 4333
    assert config_sources.env_var("embedded_port") == "KVCACHE_EMBEDDED_PORT"
    assert config_sources.default_of("embedded_port") == 0
    for bad in ("65536", "-1", "x"):
        with pytest.raises(ConfigError, match=r"KVCACHE_EMBEDDED_PORT|embedded_port"):
            config_sources.load(None, env={"KVCACHE_EMBEDDED_PORT": bad})


def test_embedded_port_in_toml(tmp_path):
    f = tmp_path / "k.toml"
    f.write_text("embedded_port = 4222\n")
    assert config_sources.load(str(f), env={}).embedded_port == 4222
    f.write_text('embedded_port = "4222"\n')
    with pytest.raises(ConfigError, match="embedded_port must be an integer"):
        config_sources.load(str(f), env={})


def test_an_older_demo_bucket_gets_the_keys_it_lacks(tmp_path):
    """A demo bucket made by an older kvcache (1,001 keys, no feature flags, no hot/cold keys)
    is filled in at the next start; the keys it had keep their values."""
    port = free_port()
    sc = SidecarProcess(tmp_path / "data", None, env={"KVCACHE_EMBEDDED_PORT": str(port)})
    with sc.start():
        async def make_it_old() -> None:
            nc = await nats.connect(f"nats://127.0.0.1:{port}")
            kv = await nc.jetstream().key_value(DEMO_BUCKET)
            await kv.put("user.0500", b"an older demo's key")
            for key in ("feature.checkout", "hot.000003", f"cold.{DEMO_KEYS - 1:06d}"):
                await kv.purge(key)
            await nc.close()
        asyncio.run(make_it_old())
        sc.wait_for(lambda: sc.client().get("feature.checkout") is None, what="the purge to arrive")
        assert sc.stop() == 0
        sc.start()
        with sc.client() as c:
            assert c.get("feature.checkout") == b'{"enabled":true,"rollout":0.25}'
            assert c.get("hot.000003") == demo_value("hot.000003")
            assert c.get("user.0500") == b"an older demo's key"
            assert c.info("buckets")["buckets"]["demo"]["keys"] == DEMO_SIZE + 1
