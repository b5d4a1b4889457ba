"""Fixtures that start real nats-server processes (see docs/architecture.md, "Tests").

The fixtures are synchronous (starting a process needs no event loop), so module-scoped ones
work with function-scoped asyncio tests. Teardown stops each server by its own PID, also
when the test failed.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import nats
import pytest
import uvloop
from support.sidecar_proc import SidecarProcess
from support.topology import Cluster, start_cluster, start_leaf, start_single

from kvcache.natsio.nats_server import NatsServer

# Feeds notice a lost consumer after 3 heartbeats: short ones keep fault tests quick.
HEARTBEAT = ["--heartbeat-ms", "500"]

# The fixtures that start servers. A test using none of them, in a module that does not say
# `pytestmark = pytest.mark.servers` (it starts them itself), is in the quick tier
# (`make quick`, `-m quick`); the tier is checked: a quick test that starts a process fails.
SERVER_FIXTURES = frozenset({"nats_server", "nats_server_module", "nats_cluster", "leaf_servers",
                             "nc", "sidecars", "spark", "redis_path"})


# Modules whose async tests run kvcache's own asyncio code in the test's event loop (NATS
# connection, feed, router, async client): each such test runs on the default loop and on
# uvloop, which the sidecar uses. The other async tests only drive processes.
IN_PROCESS_ASYNC = frozenset({"test_natsconn", "test_feed", "test_router", "test_client"})
LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
DEFAULT_LOOP = {"asyncio": asyncio.new_event_loop}


def pytest_asyncio_loop_factories(config, item):
    """pytest-asyncio's hook: the loops an async test runs on (ids `[asyncio]`, `[uvloop]`)."""
    if item.module is not None and item.module.__name__.rsplit(".", 1)[-1] in IN_PROCESS_ASYNC:
        return LOOPS
    return DEFAULT_LOOP


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.get_closest_marker("servers") is None and \
                not SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.quick)


@pytest.fixture(autouse=True)
def _quick_starts_no_process(request, monkeypatch):
    """A test in the quick tier must not start a process (a server, a sidecar, Spark)."""
    if request.node.get_closest_marker("quick") is not None:
        def refuse(*args, **kwargs):
            raise AssertionError(f"{request.node.nodeid} is in the quick tier (no servers) but "
                                 f"starts a process: {args[0] if args else kwargs.get('args')!r}; "
                                 "mark its module `pytestmark = pytest.mark.servers`")
        monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    yield


@pytest.fixture
def sidecars(tmp_path) -> Iterator[Callable[..., SidecarProcess]]:
    """Make sidecar processes (`kvcache serve` on one bucket spec, short heartbeats); every
    one still running at the end is killed (by its PID), and a traceback in any one's log
    fails the test (SidecarProcess.check_log)."""
    made: list[SidecarProcess] = []

    def make(url: str, spec: str, name: str = "sc", env: dict[str, str] | None = None,
             data_dir: Path | None = None) -> SidecarProcess:
        sc = SidecarProcess(data_dir or tmp_path / name, url, buckets=[spec], extra=HEARTBEAT, env=env)
        made.append(sc)
        return sc

    yield make
    for sc in made:
        sc.kill(check=False)
    for sc in made:  # then the logs: a traceback in any of them fails the test
        sc.check_log()


@pytest.fixture
def nats_server(tmp_path) -> Iterator[NatsServer]:
    """A fresh single JetStream server for one test."""
    server = start_single(tmp_path)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def nats_server_module(tmp_path_factory) -> Iterator[NatsServer]:
    """A single JetStream server shared by the tests of one module."""
    server = start_single(tmp_path_factory.mktemp("nats"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def nats_cluster(tmp_path_factory) -> Iterator[Cluster]:
    """A 3-node JetStream cluster `hub` (servers hub-0..hub-2) in domain `hub`,
    every member listening for leaf nodes. Tests that kill members should restart them."""
    cluster = start_cluster(tmp_path_factory.mktemp("cluster"), n=3, domain="hub")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def leaf_servers(tmp_path_factory, nats_cluster: Cluster) -> Iterator[dict[str, NatsServer]]:
    """Two leaf nodes, `leaf1` and `leaf2`, each a JetStream server in its own domain
    (named like the server) connected to `nats_cluster`; a dict name -> NatsServer."""
    base = tmp_path_factory.mktemp("leaves")
    leaves: dict[str, NatsServer] = {}
    try:
        for name in ("leaf1", "leaf2"):
            leaves[name] = start_leaf(base, nats_cluster, domain=name)
        yield leaves
    finally:
        for leaf in leaves.values():
            leaf.stop()


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """The fault tests' results (test_faults.FAULT_ROWS) as a markdown table; also written
    to $KVCACHE_FAULT_TABLE when set. Then the partition tests' (test_partition.PARTITION_ROWS)."""
    partition = getattr(sys.modules.get("test_partition"), "PARTITION_ROWS", None)
    if partition:
        from support.staleness_check import table as partition_table
        terminalreporter.section("network partitions")
        terminalreporter.write(partition_table(partition) + "\n")
    rows = getattr(sys.modules.get("test_faults"), "FAULT_ROWS", None)
    if not rows:
        return
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    table = "\n".join(lines) + "\n"
    terminalreporter.section("fault tests")
    terminalreporter.write(table)
    if path := os.environ.get("KVCACHE_FAULT_TABLE"):
        with open(path, "w") as f:
            f.write(table)


@pytest.fixture(scope="session")
def spark() -> Iterator[object]:
    """The test session's one SparkSession: local[2], small shuffles, no UI."""
    from kvcache.pipeline import spark as sparkio

    session, owned = sparkio.session("local[2]", "kvcache-tests")
    session.conf.set("spark.sql.shuffle.partitions", "4")
    yield session
    if owned:
        session.stop()


@pytest.fixture
async def nc(nats_server_module):
    """A nats-py connection to the module's server (no reconnects: a test's writes fail loudly)."""
    conn = await nats.connect(nats_server_module.url, connect_timeout=5, allow_reconnect=False)
    try:
        yield conn
    finally:
        await conn.close()
