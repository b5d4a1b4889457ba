"""valkey-glide (2.x, the async client) with its DEFAULT configuration against the sidecar's
loopback TCP listener. Without a read-only or replica read strategy glide asks each node
`INFO REPLICATION` when it connects and serves reads only from one that says `role:master`
(docs/info.md, `# Replication`)."""
from __future__ import annotations

from collections.abc import Iterator

import glide  # the test extra's valkey-glide
import pytest
from support.kvdata import _put_all
from support.sidecar_proc import SidecarProcess
from support.topology import nats_run

VALUES = {"g.k1": b"v1", "g.k2": b"v2", "g.bin": b"\x00\r\n\xff"}


@pytest.fixture(scope="module")
def sidecar(nats_server_module, tmp_path_factory) -> Iterator[SidecarProcess]:
    async def setup(js):
        kv = await js.create_key_value(bucket="gl", direct=True)
        await _put_all(kv, VALUES)
    nats_run(nats_server_module.url, setup)
    sc = SidecarProcess(tmp_path_factory.mktemp("glide") / "sc", nats_server_module.url, ["gl"],
                        extra=["--listen", "127.0.0.1:0"])
    with sc:
        sc.start()
        yield sc
        assert sc.stop() == 0


def tcp_port(sc: SidecarProcess) -> int:
    with sc.client() as c:
        return int(c.info("server")["server"]["listen"].rsplit(":", 1)[1])


async def test_glide_default_configuration_reads(sidecar):
    config = glide.GlideClientConfiguration([glide.NodeAddress("127.0.0.1", tcp_port(sidecar))])
    client = await glide.GlideClient.create(config)
    try:
        assert await client.get("g.k1") == b"v1"
        assert await client.get("g.nosuch") is None
        assert await client.mget(["g.k1", "g.nosuch", "g.bin"]) == [b"v1", None, b"\x00\r\n\xff"]
        assert await client.exists(["g.k1", "g.k2", "g.nosuch"]) == 2
        assert b"role:master" in await client.info([glide.InfoSection.REPLICATION])
        with pytest.raises(glide.RequestError, match="ReadOnly: kvcache is a read replica"):
            await client.set("g.k1", "x")
        # the connection as CLIENT LIST shows it: TCP, the library's name
        with sidecar.client() as c:
            rows = [dict(f.split("=", 1) for f in line.split(" "))
                    for line in c.execute("CLIENT", "LIST", "TYPE", "normal").decode().splitlines()]
        mine = [r for r in rows if r["flags"] == "N"]
        assert mine and mine[0]["laddr"] == f"127.0.0.1:{tcp_port(sidecar)}", rows
        print("\nglide's connection:", mine[0])
    finally:
        await client.close()
