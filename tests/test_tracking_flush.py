"""When kvcache can no longer vouch for what a caching client holds, it says so: the null
invalidation (drop everything) on a replica past max_stale_ms and on a full resync; and a
full tracking table invalidates its oldest keys. A real nats-server, the sidecar's feed
connection through a DelayProxy the test freezes, raw RESP3 sockets as the caching clients.
"""
from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.poll import wait_until
from support.resp_conn import RespConn
from support.sidecar_proc import SidecarProcess
from support.topology import DelayProxy, nats_run

from kvcache.app.client import Client
from kvcache.app.client import encode_command as encode

pytestmark = pytest.mark.timeout(180)

FLUSH = b">2\r\n$10\r\ninvalidate\r\n_\r\n"


class Tracker(RespConn):
    """A RESP3 connection with CLIENT TRACKING ON."""

    def __init__(self, path: str, *options: str) -> None:
        super().__init__(path, timeout=30)
        self.s.sendall(encode(["HELLO", "3"]) + encode(["CLIENT", "TRACKING", "ON", *options]))
        self.read(b"modules\r\n*0\r\n+OK\r\n")

    def get(self, key: str, value: bytes) -> bytes:
        """GET, and what came up to its reply (pushes sent before it, the reply)."""
        want = b"$%d\r\n%b\r\n" % (len(value), value)
        got = self.call("GET", key, until=want)
        assert got.endswith(want)
        return got


@pytest.fixture
def frozen_env(nats_server, tmp_path) -> Iterator[dict]:
    async def setup(js):
        kv = await js.create_key_value(bucket="fl", direct=True)
        for k in ("a", "b"):
            await kv.put(k, b"1")
    nats_run(nats_server.url, setup)
    proxy = DelayProxy(nats_server.port).start()
    sc = SidecarProcess(tmp_path / "sc", proxy.url, ["fl"],
                        extra=["--max-stale-ms", "400", "--heartbeat-ms", "200",
                               "--request-timeout-ms", "500", "--tracking-table-max-keys", "4"])
    try:
        sc.start()
        yield {"url": nats_server.url, "sc": sc, "sock": sc.socket, "proxy": proxy}
    finally:
        sc.kill()
        proxy.stop()


def test_flush_when_the_replica_passes_max_stale_ms(frozen_env):
    t = Tracker(frozen_env["sock"])
    bcast = Tracker(frozen_env["sock"], "BCAST")
    try:
        t.get("a", b"1")
        # The feed hears nothing more: its consumer is given up after three missed heartbeats
        # (a flush), and the replica's lag then passes 400 ms (another, if any client read
        # since). Either way the clients are told before anything changes unseen for longer.
        frozen_env["proxy"].freeze()
        assert t.read(FLUSH).endswith(FLUSH)
        assert bcast.read(FLUSH).endswith(FLUSH)
    finally:
        frozen_env["proxy"].thaw()
        t.close()
        bcast.close()


def test_flush_on_a_full_resync(frozen_env):
    """The bucket is deleted and created again: its revisions start over, the feed syncs it
    from scratch, and nothing a client holds from before can be vouched for."""
    t = Tracker(frozen_env["sock"])
    try:
        t.get("b", b"1")

        async def recreate(js):
            await js.delete_key_value("fl")
            kv = await js.create_key_value(bucket="fl", direct=True)
            await kv.put("b", b"2")
        nats_run(frozen_env["url"], recreate)
        assert t.read(FLUSH).endswith(FLUSH)
    finally:
        t.close()


def test_a_full_table_invalidates_its_oldest_keys(frozen_env):
    """tracking_table_max_keys = 4: the fifth key read evicts the first (its reader is told)."""
    async def fill(js):
        kv = await js.key_value("fl")
        for i in range(6):
            await kv.put(f"t{i}", b"x")
    nats_run(frozen_env["url"], fill)
    t = Tracker(frozen_env["sock"])
    try:
        with Client(frozen_env["sock"]) as c:
            wait_until(lambda: c.get("t5") == b"x", 10, "the keys")
        evicted = [t.get(f"t{i}", b"x") for i in range(6)]
        # the fifth and sixth reads each evicted the oldest key: its invalidation follows the
        # reply that evicted it (so it comes before the next reply)
        assert evicted[:5] == [b"$1\r\nx\r\n"] * 5
        assert evicted[5] == b">2\r\n$10\r\ninvalidate\r\n*1\r\n$2\r\nt0\r\n$1\r\nx\r\n"
        assert t.read(b"t1\r\n") == b">2\r\n$10\r\ninvalidate\r\n*1\r\n$2\r\nt1\r\n"
    finally:
        t.close()
