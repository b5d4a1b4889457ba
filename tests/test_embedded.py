"""`kvcache serve` with no NATS URL: an embedded nats-server and a demo bucket, as a new user
sees it; the embedded server never outlives the sidecar."""
from __future__ import annotations

import os
import time

import pytest
import redis
from support.procs import embedded_pid, pid_alive
from support.sidecar_proc import SidecarProcess, run_cli

pytestmark = pytest.mark.servers  # each test starts its own servers or sidecar process






@pytest.fixture
def demo(tmp_path):
    sc = SidecarProcess(tmp_path / "data", None).start()
    yield sc
    sc.kill()


def test_demo_bucket_works_out_of_the_box(demo):
    r = redis.Redis(unix_socket_path=demo.socket)
    assert r.get("greeting") == b"hello from kvcache"
    assert r.get("demo:user.0042") == b'{"id":42,"name":"user 42"}'
    assert r.dbsize() == 1001
    info = r.info("buckets")
    assert info["demo"]["synced"] == 1 and info["demo"]["keys"] == 1001
    out = run_cli("get", "--data-dir", str(demo.data_dir), "greeting")
    assert out.returncode == 0 and out.stdout == "hello from kvcache\n"
    out = run_cli("info", "--data-dir", str(demo.data_dir), "buckets")
    assert out.returncode == 0 and "demo:synced=1,keys=1001" in out.stdout


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
