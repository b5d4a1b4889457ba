"""Real nats-server topologies for the tests: a single server, a JetStream cluster, leaf nodes.

Everything listens on 127.0.0.1 with free ports and keeps its state under the given
directory. Readiness is checked through each server's HTTP monitor, never by sleeping.
"""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading
from dataclasses import dataclass, field
from pathlib import Path

import nats
from nats.js.api import ExternalStream, StreamConfig, StreamSource

from kvcache.natsio.server import ClusterConfig, NatsServer, free_port
from support.poll import until, wait_until

HOST = "127.0.0.1"




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

    def wait_ready(self, timeout: float = 30) -> str:
        """Wait for an agreed meta leader and a healthy JetStream on every running member."""
        wait_until(self.meta_leader, timeout, f"JetStream meta leader in cluster {self.name}")
        wait_until(
            lambda: all(s.monitor("/healthz").get("status") == "ok" for s in self.servers if s.running),
            timeout,
            f"healthz ok on every member of cluster {self.name}",
        )
        leader = self.meta_leader()
        assert leader
        return leader

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
