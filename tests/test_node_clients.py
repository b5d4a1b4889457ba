"""node-redis v5 (its client-side cache over RESP3, `multi()`, WATCH, its stream API) and
ioredis (`multi()`, WATCH, its stream API) against a real sidecar over the Unix socket, from
tests/node/clients.mjs; nats-py writes the keys between the script's steps.

The Node packages are pinned in tests/node/package-lock.json and installed by `make
install-test` (npm ci). Skipped, saying why, only when `node` is absent.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.kvwatch import nats_watch_from
from support.poll import wait_until
from support.sidecar_proc import SidecarProcess
from support.topology import nats_run

from kvcache.app.client import Client

NODE_DIR = Path(__file__).parent / "node"
NODE = shutil.which("node")

pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed (Node 18+ runs these)")


@pytest.fixture(scope="module")
def env(nats_server_module, tmp_path_factory) -> Iterator[dict]:
    if not (NODE_DIR / "node_modules" / "redis").is_dir() or not (NODE_DIR / "node_modules" / "ioredis").is_dir():
        pytest.fail("tests/node/node_modules is missing: run `make install-test` (npm ci in tests/node)")
    url = nats_server_module.url

    async def setup(js):
        kv = await js.create_key_value(bucket="nd", direct=True)
        for k in ("cache", "multi", "iomulti"):
            await kv.put(k, b"v1")
        for bucket in STREAM_BUCKETS:  # a bucket each: the stream scenarios compare whole listings
            skv = await js.create_key_value(bucket=bucket, history=1)
            for k in ("s.a", "s.b", "s.c", "s.d"):
                await skv.put(k, k.encode())
            await skv.put("s.a", b"again")
            await skv.delete("s.b")
    nats_run(url, setup)
    sc = SidecarProcess(tmp_path_factory.mktemp("nd") / "sc", url, ["nd", *STREAM_BUCKETS])
    with sc:
        sc.start()
        yield {"url": url, "sc": sc, "sock": sc.socket}
        assert sc.stop() == 0


STREAM_BUCKETS = ("ndstream", "iostream")


def write(url: str, key: str, value: bytes | None, bucket: str = "nd") -> None:
    async def fn(js):
        kv = await js.key_value(bucket)
        await (kv.put(key, value) if value is not None else kv.delete(key))
    nats_run(url, fn)


class Script:
    """clients.mjs as a child process: JSON lines out, a line in at each writer's turn."""

    def __init__(self, scenario: str, sock: str, key: str) -> None:
        self.proc = subprocess.Popen([NODE, str(NODE_DIR / "clients.mjs"), scenario, sock, key],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, cwd=NODE_DIR)

    def next(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(10)
            raise AssertionError(f"script ended ({self.proc.returncode}): {self.proc.stderr.read()}")
        got = json.loads(line)
        assert "error" not in got, got
        return got

    def go(self) -> None:
        assert self.next() == {"wait": True}

    def resume(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        try:
            assert self.proc.wait(30) == 0, self.proc.stderr.read()
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


def settled(env: dict, key: str, value: bytes | None) -> None:
    with Client(env["sock"]) as c:
        wait_until(lambda: c.get(key) == value, 10, f"{key} to be {value!r}")


def test_node_redis_client_side_cache(env):
    """node-redis's cache (RESP3, CLIENT TRACKING ON): repeated reads are hits; a PUT and then
    a DEL from NATS reach it through invalidations."""
    s = Script("node-redis-cache", env["sock"], "cache")
    try:
        first = s.next()
        assert first["first"] == "v1" and first["hits"] >= 100 and first["misses"] == 1
        s.go()
        write(env["url"], "cache", b"v2")
        s.resume()
        second = s.next()
        assert second["second"] == "v2" and second["ms"] >= 0
        s.go()
        write(env["url"], "cache", None)
        s.resume()
        third = s.next()
        assert third["third"] is None and third["ms"] >= 0
    finally:
        s.close()


@pytest.mark.parametrize("scenario,key", [("node-redis-multi", "multi"), ("ioredis-multi", "iomulti")])
def test_multi_and_watch(env, scenario, key):
    """multi() answers reads; a write from NATS between WATCH and EXEC aborts the
    transaction (node-redis: WatchError; ioredis: null); a queued write is refused."""
    settled(env, key, b"v1")
    s = Script(scenario, env["sock"], key)
    try:
        plain = s.next()["plain"]
        if scenario == "ioredis-multi":
            assert plain == [[None, "v1"], [None, -1], [None, 2]]
        else:
            assert plain == ["v1", -1, 2]
        s.go()
        write(env["url"], key, b"v2")
        settled(env, key, b"v2")
        s.resume()
        watched = s.next()["watched"]
        assert watched == ("WatchError" if scenario == "node-redis-multi" else None)
        refused = s.next()["write"]
        assert "EXECABORT" in refused or "READONLY" in refused or "read replica" in refused, refused
    finally:
        s.close()


@pytest.mark.parametrize("scenario,bucket", [("node-redis-stream", "ndstream"), ("ioredis-stream", "iostream")])
def test_stream_apis_follow_a_bucket(env, scenario, bucket):
    """Each library's own stream API on `@<bucket>`: XRANGE and XREAD from 0 are the whole
    bucket, XREAD from a middle revision exactly the keys changed since, both as a NATS watch
    resumed from the same sequence delivers them; a blocked XREAD from `$` wakes with a put,
    then with a delete (op DEL, no value)."""
    s = Script(scenario, env["sock"], bucket)
    try:
        first = s.next()
        full = [tuple(r[:3]) for r in first["listing"]]
        assert full == [tuple(r) for r in nats_watch_from(env["url"], bucket, 0)]
        assert first["read"] == first["listing"] and first["name"] == f"@{bucket}"
        assert dict((r[1], r[3]) for r in first["listing"]) == {"s.a": "again", "s.b": None, "s.c": "s.c",
                                                                  "s.d": "s.d"}
        second = s.next()
        assert [tuple(r[:3]) for r in second["resumed"]] == [
            tuple(r) for r in nats_watch_from(env["url"], bucket, second["mid"])]
        assert second["resumed"] and all(r[0] > second["mid"] for r in second["resumed"])
        for turn, value in (("put", b"live"), ("delete", None)):
            s.go()
            write(env["url"], "s.live", value, bucket)
            s.resume()
            got = s.next()
            assert got["turn"] == turn
            assert [(r[1], r[2], r[3]) for r in got["live"]] == [
                ("s.live", "PUT" if value else "DEL", value.decode() if value else None)]
    finally:
        s.close()
