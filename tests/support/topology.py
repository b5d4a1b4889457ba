"""Real nats-server topologies for the tests: a single server, a JetStream cluster, leaf nodes.

Everything listens on 127.0.0.1 with free ports and keeps its state under the given
directory. Readiness is checked through each server's HTTP monitor (and a replicated
stream's through STREAM.INFO: wait_stream_current, replicated_kv), never by sleeping.
"""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.js.api import ExternalStream, StreamConfig, StreamInfo, StreamSource

from kvcache.natsio.nats_server import ClusterConfig, NatsServer, free_port
from support.poll import until, wait_until

HOST = "127.0.0.1"

# Set-up waits on a cluster are bounded generously: on a loaded CI host an election or a
# replica's catch-up can take many seconds, and a healthy cluster ends the wait at once.
SETTLE_TIMEOUT_S = 60.0

T = TypeVar("T")


class NotReady(Exception):
    """What a readiness check still misses; the poller reports the last one on timeout."""


# ---------------------------------------------------------------------------- replicated streams

# What JetStream answers while a clustered stream is being created or elects a leader: no
# interest yet in its subjects on the server the client is on (NoResponders, which js.publish
# turns into NoStreamResponse), no leader to answer (a timeout), or 503.
SETTLING = (nats.errors.NoRespondersError, nats.errors.TimeoutError,
            nats.js.errors.NoStreamResponseError, nats.js.errors.ServiceUnavailableError)


async def settled(call: Callable[[], Awaitable[T]], timeout: float = SETTLE_TIMEOUT_S) -> T:
    """`call()` retried while JetStream is settling (a replicated stream electing a leader,
    or its leader's subject interest not yet routed to the client's server), re-raised past
    the deadline. For set-up only: a test of the product must see those errors."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await call()
        except SETTLING:
            if time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.2)


def _stream_missing(info: StreamInfo) -> str | None:
    """What keeps `info`'s stream from taking writes on every replica: no leader, a replica
    not listed yet, offline or not current; None when there is nothing."""
    want = (info.config.num_replicas or 1) - 1
    if info.cluster is None:   # a server that is not clustered: no election, no replicas
        return None if want == 0 else f"no cluster info for an R{want + 1} stream"
    if not info.cluster.leader:
        return "no leader"
    reps = info.cluster.replicas or []
    if len(reps) < want:
        return f"leader {info.cluster.leader}, {len(reps)} of {want} replicas listed"
    behind = [f"{r.name} ({'offline' if r.offline else f'not current, lag {r.lag}'})"
              for r in reps if r.offline or not r.current]
    if behind:
        return f"leader {info.cluster.leader}, replica {', '.join(behind)}"
    return None


async def wait_stream_current(js, stream: str, timeout: float = SETTLE_TIMEOUT_S) -> StreamInfo:
    """Until `stream` has a leader and every replica is online and current (STREAM.INFO);
    returns that info. A stream's create is answered before its followers have caught up, and
    a write made while the group still elects is answered NoResponders: wait on the state
    itself, not on time. WaitTimeout names what was still missing."""
    async def ready() -> StreamInfo:
        info = await js.stream_info(stream)
        if missing := _stream_missing(info):
            raise NotReady(missing)
        return info
    return await until(ready, timeout, f"stream {stream}: a leader and every replica current",
                       interval=0.1)


async def replicated_kv(js, timeout: float = SETTLE_TIMEOUT_S, **config: Any):
    """`js.create_key_value(**config)` (retried while the cluster settles), then
    wait_stream_current on its stream: the bucket a fixture can write to and mirror. Write to
    it through `settled(lambda: kv.put(...))`: interest in the new leader's subjects may
    still be on its way over the routes to the client's server."""
    kv = await settled(lambda: js.create_key_value(**config), timeout)
    await wait_stream_current(js, f"KV_{config['bucket']}", timeout)
    return kv


def start_single(tmp_path: Path, name: str = "single", domain: str | None = None) -> NatsServer:
    """One JetStream server; the caller stops it."""
    base = Path(tmp_path) / name
    return NatsServer(base / "js", host=HOST, server_name=name, domain=domain).start()


@dataclass
class Cluster:
    """A started JetStream cluster whose members all accept leaf node connections."""

    name: str
    domain: str | None
    servers: list[NatsServer] = field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    @property
    def leafnode_urls(self) -> list[str]:
        return [u for s in self.servers if (u := s.leafnode_url)]

    def server(self, name: str) -> NatsServer:
        """The member with this `server_name` (as reported by stream_info().cluster.leader)."""
        for s in self.servers:
            if s.server_name == name:
                return s
        raise KeyError(name)

    def meta_leader(self) -> str | None:
        """Name of the JetStream meta leader if every running member agrees on one."""
        leaders = set()
        for s in self.servers:
            if not s.running:
                continue
            meta = s.monitor("/jsz").get("meta_cluster") or {}
            leaders.add(meta.get("leader") or "")
        if len(leaders) == 1 and (leader := leaders.pop()):
            return leader
        return None

    def readiness(self) -> str:
        """The meta leader's name when the running members are ready for replicated streams:
        each routed to every other one, all agreeing on one meta leader, which sees every
        other member online and current, and healthz ok everywhere. Otherwise NotReady
        saying what is missing (the first thing found)."""
        running = [s for s in self.servers if s.running]
        names = {s.server_name for s in running}
        for s in running:
            remotes = {r.get("remote_name") for r in s.monitor("/routez").get("routes") or []}
            if missing := names - {s.server_name} - remotes:
                raise NotReady(f"{s.server_name} has no route to {sorted(missing)}")
        leader = self.meta_leader()
        if not leader:
            raise NotReady("no meta leader all members agree on")
        if leader not in names:
            raise NotReady(f"meta leader {leader} is not a running member")
        meta = self.server(leader).monitor("/jsz").get("meta_cluster") or {}
        peers = {p.get("name"): p for p in meta.get("replicas") or []}
        for name in sorted(names - {leader}):
            p = peers.get(name)
            if p is None or p.get("offline") or not p.get("current"):
                raise NotReady(f"meta leader {leader} sees {name} as {p or 'absent'}")
        for s in running:
            if (health := s.monitor("/healthz")).get("status") != "ok":
                raise NotReady(f"{s.server_name} healthz: {health}")
        return leader

    def wait_ready(self, timeout: float = SETTLE_TIMEOUT_S) -> str:
        """Until `readiness()` holds; the meta leader's name. An agreed meta leader alone is
        not enough: a member whose routes or meta log are still catching up cannot yet take
        its part in a new R3 stream (the create fails or the stream's election waits on it),
        and the fixture's first writes fail. Running members only (a test may have killed
        one)."""
        return wait_until(self.readiness, timeout,
                          f"cluster {self.name}: routes, one meta leader, every member current, healthz ok",
                          interval=0.1)

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


def start_cluster(tmp_path: Path, n: int = 3, domain: str | None = "hub", name: str = "hub") -> Cluster:
    """An n-node JetStream cluster (server names `<name>-0`...), ready for R-n streams."""
    base = Path(tmp_path) / name
    route_ports = [free_port(HOST) for _ in range(n)]
    routes = [f"nats-route://{HOST}:{p}" for p in route_ports]
    cluster = Cluster(name=name, domain=domain)
    for i, rport in enumerate(route_ports):
        sname = f"{name}-{i}"
        cluster.servers.append(
            NatsServer(
                base / sname / "js",
                host=HOST,
                server_name=sname,
                domain=domain,
                cluster=ClusterConfig(name=name, port=rport, routes=routes),
                leafnodes_listen_port=free_port(HOST),
                conf_dir=base,
            )
        )
    try:
        for s in cluster.servers:
            s.start()
        cluster.wait_ready()
    except BaseException:
        cluster.stop()
        raise
    return cluster


async def start_server(server: NatsServer, timeout: float = SETTLE_TIMEOUT_S) -> NatsServer:
    """(Re)start `server` from a coroutine: launched from the calling thread (the test's,
    which outlives the test) and only waited for in a worker thread. With
    `asyncio.to_thread(server.start)` the worker launches it, and the server gets SIGTERM
    (PR_SET_PDEATHSIG) when the test's event loop shuts its executor down: a module's
    cluster then goes on with a member gone, and the next R3 bucket never has every
    replica current."""
    server.launch()
    try:
        await asyncio.to_thread(server.wait_ready, timeout)
    except BaseException:
        server.kill()
        raise
    return server


def start_leaf(tmp_path: Path, hub: Cluster, domain: str, name: str | None = None, timeout: float = 15) -> NatsServer:
    """A standalone JetStream server in its own domain, leaf-connected to every hub member."""
    name = name or domain
    base = Path(tmp_path) / name
    leaf = NatsServer(
        base / "js",
        host=HOST,
        server_name=name,
        domain=domain,
        leaf_remotes=hub.leafnode_urls,
    )
    leaf.start()
    try:
        wait_until(
            lambda: leaf.monitor("/leafz").get("leafnodes", 0) >= 1,
            timeout,
            f"leaf {name} connected to hub {hub.name}",
        )
    except BaseException:
        leaf.stop()
        raise
    return leaf


async def add_hub_mirror(js, name: str, source: str, upto: int = 0, timeout: float = 30.0,
                         **config) -> None:
    """A mirror `name`, in js's own (leaf) domain, of the hub stream `source`, serving Direct
    Get as its source does; returns once it holds stream sequence `upto`."""
    await js.add_stream(StreamConfig(
        name=name, mirror_direct=True, allow_direct=True,
        mirror=StreamSource(name=source, external=ExternalStream(api="$JS.hub.API")), **config))
    async def reached() -> bool:
        return (await js.stream_info(name)).state.last_seq >= upto
    await until(reached, timeout, f"mirror {name} to reach sequence {upto}")


def nats_run(url: str, fn):
    """Run `fn(js)` on a fresh nats-py connection (a short asyncio.run of its own)."""
    async def go():
        nc = await nats.connect(url)
        try:
            return await fn(nc.jetstream())
        finally:
            await nc.close()
    return asyncio.run(go())


class DelayProxy:
    """A TCP forwarder on 127.0.0.1 in front of one server: every byte waits `delay` seconds in
    each direction (a one-way delay; the kernel here has no netem), and `freeze()` holds all
    traffic until `thaw()` (a stall the client cannot tell from a hung server).

    It runs its own event loop in a thread, so sync fixtures, async tests and benches can all
    use it; `delay` can be changed at any time."""

    def __init__(self, target_port: int, delay: float = 0.0, host: str = HOST) -> None:
        self.target = (host, target_port)
        self.host = host
        self.port = free_port(host)
        self.delay = delay
        self._loop: asyncio.AbstractEventLoop | None = None
        self._flowing: asyncio.Event | None = None
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[asyncio.StreamWriter] = set()
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self) -> DelayProxy:
        ready = threading.Event()

        def run() -> None:
            loop = self._loop = asyncio.new_event_loop()
            self._flowing = asyncio.Event()
            self._flowing.set()
            self._server = loop.run_until_complete(asyncio.start_server(self._accept, self.host, self.port))
            ready.set()
            loop.run_forever()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

        self._thread = threading.Thread(target=run, name=f"delay-proxy-{self.port}", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise TimeoutError("delay proxy did not start")
        return self

    def freeze(self) -> None:
        assert self._loop and self._flowing
        self._loop.call_soon_threadsafe(self._flowing.clear)

    def thaw(self) -> None:
        assert self._loop and self._flowing
        self._loop.call_soon_threadsafe(self._flowing.set)

    def stop(self) -> None:
        if not self._loop:
            return

        async def shut() -> None:
            assert self._server
            self._server.close()
            for w in list(self._conns):
                w.close()
            me = asyncio.current_task()
            rest = [t for t in asyncio.all_tasks() if t is not me]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)
        asyncio.run_coroutine_threadsafe(shut(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        assert self._thread
        self._thread.join(5)
        self._loop = None

    def __enter__(self) -> DelayProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _accept(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        try:
            sreader, swriter = await asyncio.open_connection(*self.target)
        except OSError:
            cwriter.close()
            return
        self._conns |= {cwriter, swriter}
        try:
            await asyncio.gather(self._pump(creader, swriter), self._pump(sreader, cwriter))
        except asyncio.CancelledError:
            pass  # stop(): asyncio's stream callback would log a cancelled handler as an error
        finally:
            for w in (cwriter, swriter):
                self._conns.discard(w)
                w.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read as it comes, write each chunk `delay` after it arrived, in order."""
        queue: asyncio.Queue = asyncio.Queue()

        async def read() -> None:
            loop = asyncio.get_running_loop()
            try:
                while data := await reader.read(65536):
                    queue.put_nowait((loop.time() + self.delay, data))
            except OSError:
                pass
            queue.put_nowait((0.0, b""))

        reading = asyncio.get_running_loop().create_task(read())
        try:
            loop = asyncio.get_running_loop()
            while True:
                due, data = await queue.get()
                if not data:
                    break
                if due > loop.time():
                    await asyncio.sleep(due - loop.time())
                assert self._flowing
                await self._flowing.wait()
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            reading.cancel()
            writer.close()


# ---------------------------------------------------------------------------- proxies in a child process

def _proxy_host(targets: dict[str, int], delays: dict[str, float], conn) -> None:
    proxies = {n: DelayProxy(port, delays[n]).start() for n, port in targets.items()}
    conn.send({n: px.url for n, px in proxies.items()})
    while True:
        cmd, name = conn.recv()
        if cmd == "stop":
            break
        getattr(proxies[name], cmd)()
        conn.send("ok")
    for px in proxies.values():
        px.stop()


class ProxyHost:
    """DelayProxies in a child process (so a benchmark's client never competes with them for
    the GIL); freeze/thaw by name; `urls` maps each name to its proxy's URL."""

    def __init__(self, targets: dict[str, int], delays: dict[str, float]) -> None:
        self._conn, child = mp.Pipe()
        self._proc = mp.get_context("spawn").Process(target=_proxy_host, args=(targets, delays, child),
                                                     daemon=True)
        self._proc.start()
        self.urls: dict[str, str] = self._conn.recv()

    def do(self, cmd: str, name: str) -> None:
        self._conn.send((cmd, name))
        self._conn.recv()

    def stop(self) -> None:
        self._conn.send(("stop", ""))
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
