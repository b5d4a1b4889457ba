"""Network partitions between real processes: network namespaces, veth links, iptables.

`Net` makes a router namespace and one namespace per host (`n1`, `n2`, `n3`: the nats servers;
`sc`: the sidecar; `w`: the writer and the harness's own control connection), each host joined
to the router by a veth pair on its own /24 (`10.213.<i>.2` the host, `.1` the router; the
router forwards). Faults are iptables rules in the router's FORWARD chain: `cut(a, b)` drops
everything between two hosts, `isolate(a)` between a and every other host, `shape(host, ...)`
drops a share of the host's packets (`-m statistic`) and hands the rest to a user-space shaper
(support/nfq_shaper.py, on an NFQUEUE: delay, jitter, reordering, duplication; this kernel has
no netem). `heal...`/`unshape` take them away again.

`PartitionEnv` adds a 3-node JetStream cluster whose servers run inside n1..n3
(`ip netns exec`), the control connection (nats-py, on an event loop in a thread that entered
`w`'s namespace), and sidecars started in `sc` whose Unix socket, in a temporary directory,
is reached from the root namespace (a socket path crosses network namespaces).
`run_fault(env, "d", RunConfig(...))` runs one fault of the catalogue (FAULTS) end to end
and judges the reads (support/staleness_check.py).

Cleanup: namespaces are named `kvp<pid>-<host>`; every process the harness starts is started
by it (stopped by its PID on the way out, and it dies with the harness anyway:
PR_SET_PDEATHSIG); deleting a namespace deletes its veth ends and its iptables rules. `close()`
runs on every exit path: the context manager, SIGTERM (turned into SystemExit while a `Net`
is open), KeyboardInterrupt, atexit. A run that was SIGKILLed leaves its namespaces behind:
the next `Net` deletes those of runs whose PID is gone (`cleanup_leftovers`).
"""
from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from kvcache.natsio.nats_server import ClusterConfig, NatsServer, die_with_parent
from support.poll import wait_until
from support.sidecar_proc import SidecarProcess
from support.staleness_check import STRONG, Verdict, judge, read_acks, read_reads
from support.topology import Cluster

HOSTS = ("n1", "n2", "n3", "sc", "w")
SERVERS = ("n1", "n2", "n3")
NET = "10.213"
PREFIX_RE = re.compile(r"^kvp(\d+)-")
HERE = Path(__file__).resolve().parent
CLONE_NEWNET = 0x40000000
T = TypeVar("T")


def mono() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def _run(*cmd: str, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


def unavailable() -> str | None:
    """Why partitions cannot run here (None: they can): root, `ip netns`, iptables."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and iptables)"
    if not shutil.which("ip"):
        return "no `ip` (iproute2)"
    if not shutil.which("iptables"):
        return "no iptables (make system-deps installs it)"
    probe = f"kvp{os.getpid()}-probe{uuid.uuid4().hex[:4]}"
    try:
        add = _run("ip", "netns", "add", probe, check=False)
        if add.returncode:
            return f"`ip netns add` fails: {add.stderr.strip()}"
        ipt = _run("ip", "netns", "exec", probe, "iptables", "-w", "-S", "FORWARD", check=False)
        if ipt.returncode:
            return f"iptables does not work in a network namespace: {ipt.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


def shaper_unavailable() -> str | None:
    """Why delay/reordering/duplication cannot be shaped here (None: they can)."""
    try:
        import netfilterqueue  # noqa: F401
    except ImportError:
        return "no NetfilterQueue (pip install -e '.[test]', with libnetfilter-queue-dev)"
    return None


def cleanup_leftovers() -> list[str]:
    """Delete the namespaces of partition runs whose process is gone (a SIGKILLed run);
    their processes died with it (PR_SET_PDEATHSIG). Returns the names deleted."""
    gone = []
    listing = _run("ip", "netns", "list", check=False).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        m = PREFIX_RE.match(name)
        if not m or int(m.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # that run is alive: its namespaces are its own
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        _run("ip", "netns", "del", name, check=False)
        gone.append(name)
        for d in Path(tempfile.gettempdir()).glob(f"kvp{m.group(1)}-sock-*"):
            shutil.rmtree(d, ignore_errors=True)  # its sockets' directory
    return gone


class NsThread:
    """One thread inside a network namespace: `call(fn)` runs fn there (sockets it opens
    belong to that namespace); `run(coro)` runs a coroutine on the thread's own event loop."""

    def __init__(self, ns: str) -> None:
        self.ns = ns
        self._ready = threading.Event()
        self._err: BaseException | None = None
        self.loop = asyncio.new_event_loop()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"ns-{ns}")
        self._pool.submit(self._main)
        if not self._ready.wait(10):
            raise RuntimeError(f"thread in namespace {ns} did not start")
        if self._err:
            raise self._err

    def _main(self) -> None:
        try:
            fd = os.open(f"/run/netns/{self.ns}", os.O_RDONLY)
            try:
                if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {self.ns}")
            finally:
                os.close(fd)
        except BaseException as e:
            self._err = e
            self._ready.set()
            return
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        self.loop.run_forever()
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()

    def call(self, fn: Callable, *args, timeout: float = 30):
        async def wrap():
            return fn(*args)
        return self.run(wrap(), timeout)

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._pool.shutdown(wait=True)


class Net:
    """The namespaces, links and iptables rules of one run; a context manager."""

    def __init__(self, hosts: tuple[str, ...] = HOSTS, prefix: str | None = None) -> None:
        self.hosts = tuple(hosts)
        self.prefix = prefix or f"kvp{os.getpid()}-"
        self.router = self.prefix + "r"
        self.index = {h: i + 1 for i, h in enumerate(self.hosts)}
        self.made: list[str] = []
        self.cuts: dict[frozenset, list[list[str]]] = {}
        self.shaped: dict[str, tuple[list[list[str]], subprocess.Popen | None]] = {}
        self.procs: list[subprocess.Popen] = []
        self.closers: list[Callable[[], None]] = []
        self.threads: dict[str, NsThread] = {}
        self._queue = 0
        self._old_sigterm = None
        self._closed = False

    # ------------------------------------------------------------------ set up, tear down

    def ns(self, host: str) -> str:
        return self.prefix + host

    def addr(self, host: str) -> str:
        return f"{NET}.{self.index[host]}.2"

    def dev(self, host: str) -> str:
        """The router's end of the host's link."""
        return f"v{host}"

    def exec_args(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns(host)]

    def __enter__(self) -> Net:
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> Net:
        cleanup_leftovers()
        if threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        atexit.register(self.close)
        for name in [self.router] + [self.ns(h) for h in self.hosts]:
            _run("ip", "netns", "add", name)
            self.made.append(name)
            _run("ip", "-n", name, "link", "set", "lo", "up")
        _run("ip", "netns", "exec", self.router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        for h in self.hosts:
            i, ns = self.index[h], self.ns(h)
            _run("ip", "link", "add", "eth0", "netns", ns, "type", "veth",
                 "peer", "name", self.dev(h), "netns", self.router)
            _run("ip", "-n", ns, "addr", "add", f"{NET}.{i}.2/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "route", "add", "default", "via", f"{NET}.{i}.1")
            _run("ip", "-n", self.router, "addr", "add", f"{NET}.{i}.1/24", "dev", self.dev(h))
            _run("ip", "-n", self.router, "link", "set", self.dev(h), "up")
        return self

    def _on_sigterm(self, signum, frame) -> None:
        raise SystemExit(128 + signum)  # unwinds through every `with` and finally: close() runs

    def close(self) -> None:
        """Stop every process started here (by PID), then delete the namespaces (their links
        and rules go with them). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for fn in reversed(self.closers):
            with contextlib.suppress(Exception):
                fn()
        for h in list(self.shaped):
            with contextlib.suppress(Exception):
                self.unshape(h)
        for p in self.procs:
            stop_proc(p)
        for t in self.threads.values():
            with contextlib.suppress(Exception):
                t.close()
        for name in reversed(self.made):
            _run("ip", "netns", "del", name, check=False)
        self.made.clear()
        if self._old_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None
        atexit.unregister(self.close)

    def thread(self, host: str) -> NsThread:
        """The harness's thread inside `host`'s namespace (made on first use)."""
        if host not in self.threads:
            self.threads[host] = NsThread(self.ns(host))
        return self.threads[host]

    def popen(self, host: str | None, args: list[str], **kw) -> subprocess.Popen:
        """A process inside `host`'s namespace (None: the root namespace), stopped by close()
        if still running, and killed by the kernel if the harness dies first."""
        cmd = (self.exec_args(host) if host else []) + args
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent,
                             start_new_session=True, **kw)
        self.procs.append(p)
        return p

    # ------------------------------------------------------------------ faults

    def _ipt(self, op: str, rule: list[str]) -> None:
        _run("ip", "netns", "exec", self.router, "iptables", "-w", op, "FORWARD", *(
            ["1"] if op == "-I" else []), *rule)

    def cut(self, a: str, b: str, reject: bool = False) -> None:
        """Drop every packet between hosts a and b, both ways (reject: TCP gets a reset, so
        a connection attempt fails at once instead of timing out)."""
        pair = frozenset((a, b))
        if pair in self.cuts:
            return
        rules = []
        for x, y in ((a, b), (b, a)):
            base = ["-i", self.dev(x), "-o", self.dev(y)]
            if reject:
                rules.append([*base, "-p", "tcp", "-j", "REJECT", "--reject-with", "tcp-reset"])
            rules.append([*base, "-j", "DROP"])
        for r in reversed(rules):  # inserted at the top: above any shaping
            self._ipt("-I", r)
        self.cuts[pair] = rules

    def isolate(self, a: str, reject: bool = False) -> None:
        for b in self.hosts:
            if b != a:
                self.cut(a, b, reject)

    def heal(self, a: str, b: str | None = None) -> None:
        """Heal the cut between a and b, or (b None) every cut of a."""
        for pair in list(self.cuts):
            if a in pair and (b is None or b in pair):
                for r in self.cuts.pop(pair):
                    self._ipt("-D", r)

    def heal_all(self) -> None:
        for pair in list(self.cuts):
            for r in self.cuts.pop(pair):
                self._ipt("-D", r)

    def shape(self, host: str, loss: float = 0.0, delay_ms: float = 0.0, jitter_ms: float = 0.0,
              reorder: float = 0.0, duplicate: float = 0.0, reorder_ms: float = 20.0) -> None:
        """Degrade every packet to and from `host` (both directions, each on its own): drop
        a share `loss`, hold the rest delay_ms ± jitter_ms, a share `reorder` of them
        reorder_ms more, and send a share `duplicate` twice."""
        self.unshape(host)
        rules: list[list[str]] = []
        proc = None
        dirs = (["-i", self.dev(host)], ["-o", self.dev(host)])
        if loss:
            drop = ["-m", "statistic", "--mode", "random", "--probability", f"{loss:.4f}", "-j", "DROP"]
            rules += [[*d, *drop] for d in dirs]
        if delay_ms or jitter_ms or reorder or duplicate:
            if why := shaper_unavailable():
                raise RuntimeError(why)
            self._queue += 1
            q = self._queue
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.router, sys.executable, str(HERE / "nfq_shaper.py"),
                 "--queue", str(q), "--delay-ms", str(delay_ms), "--jitter-ms", str(jitter_ms),
                 "--reorder", str(reorder), "--reorder-ms", str(reorder_ms),
                 "--duplicate", str(duplicate)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
                preexec_fn=die_with_parent, start_new_session=True)
            self.procs.append(proc)
            line = proc.stdout.readline() if proc.stdout else ""
            if line.strip() != "ready":
                stop_proc(proc)
                raise RuntimeError(f"nfq shaper did not start (exit {proc.poll()})")
            rules += [[*d, "-j", "NFQUEUE", "--queue-num", str(q), "--queue-bypass"] for d in dirs]
        for r in rules:
            self._ipt("-A", r)
        self.shaped[host] = (rules, proc)

    def unshape(self, host: str | None = None) -> None:
        for h in ([host] if host else list(self.shaped)):
            if h not in self.shaped:
                continue
            rules, proc = self.shaped.pop(h)
            for r in rules:
                self._ipt("-D", r)
            if proc is not None:
                stop_proc(proc)

    def rules(self) -> str:
        return _run("ip", "netns", "exec", self.router, "iptables", "-w", "-S", "FORWARD").stdout


def stop_proc(p: subprocess.Popen, timeout: float = 10) -> int | None:
    """SIGTERM, then SIGKILL: by the process's own PID, always reaped."""
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.wait()
    for f in (p.stdout, p.stderr):
        if f is not None:
            with contextlib.suppress(Exception):
                f.close()
    return p.returncode


# ----------------------------------------------------------------------------- nats servers

class NsNatsServer(NatsServer):
    """A NatsServer run inside a host's namespace, on that host's address (4222; routes 6222;
    monitor 8222); its readiness and monitor checks are made from inside the namespace."""

    def __init__(self, net: Net, host: str, store: Path, routes: list[str], cluster: str) -> None:
        super().__init__(store / host / "js", host=net.addr(host), port=4222, monitor_port=8222,
                         server_name=host, cluster=ClusterConfig(name=cluster, port=6222, routes=routes),
                         conf_dir=store)
        self.net, self.nshost = net, host

    def command(self) -> list[str]:
        return [*self.net.exec_args(self.nshost), *super().command()]

    def _port_open(self) -> bool:
        return self.net.thread(self.nshost).call(super()._port_open)

    def _http_ok(self, path: str) -> bool:
        return self.net.thread(self.nshost).call(super()._http_ok, path)

    def monitor(self, path: str, timeout: float = 2) -> dict:
        return self.net.thread(self.nshost).call(super().monitor, path, timeout, timeout=timeout + 5)


class NsSidecar(SidecarProcess):
    """`kvcache serve` inside the `sc` namespace; its socket is reached from the root one."""

    def __init__(self, net: Net, data_dir: Path, socket: Path, urls: list[str], bucket: str,
                 extra: list[str], src: str | None = None) -> None:
        nats = [x for u in urls for x in ("--nats", u)]
        super().__init__(data_dir, None, [bucket], extra=nats + extra, socket=socket,
                         env={"PYTHONPATH": src} if src else None)
        if src:  # kvcache from that source tree: -P keeps the working directory off sys.path
            self.args[1:1] = ["-P"]
        self.args = [*net.exec_args("sc"), *self.args]


class PartitionEnv:
    """A Net, a 3-node JetStream cluster in n1..n3 and a control connection from `w`."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir)
        self.net = Net()
        self.servers: dict[str, NsNatsServer] = {}
        self.cluster: Cluster | None = None
        self.nc = None
        self.js = None
        self.socket_dir = ""

    def __enter__(self) -> PartitionEnv:
        try:
            self.net.open()
            self.net.closers.append(self._stop_servers)
            self.socket_dir = tempfile.mkdtemp(prefix=f"{self.net.prefix}sock-")
            routes = [f"nats-route://{self.net.addr(h)}:6222" for h in SERVERS]
            for h in SERVERS:
                self.servers[h] = NsNatsServer(self.net, h, self.workdir / "nats", routes, "kvp")
            self.cluster = Cluster(name="kvp", domain=None, servers=list(self.servers.values()))
            for s in self.servers.values():
                s.launch()
            for s in self.servers.values():
                s.wait_ready(30)
            self.cluster.wait_ready(60)
            self.connect()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.nc is not None:
            with contextlib.suppress(Exception):
                self.ctl(self.nc.close(), 5)
            self.nc = None
        self.net.close()
        if self.socket_dir:
            shutil.rmtree(self.socket_dir, ignore_errors=True)

    def _stop_servers(self) -> None:
        for s in self.servers.values():
            s.stop()

    def url(self, host: str) -> str:
        return f"nats://{self.net.addr(host)}:4222"

    # ------------------------------------------------------------------ control (from w)

    def ctl(self, coro, timeout: float = 60):
        return self.net.thread("w").run(coro, timeout)

    def connect(self) -> None:
        import nats

        async def go():
            return await nats.connect(servers=[self.url(h) for h in SERVERS], connect_timeout=2,
                                      max_reconnect_attempts=-1, reconnect_time_wait=0.2,
                                      name="partition-control")
        self.nc = self.ctl(go())
        self.js = self.nc.jetstream(timeout=5)

    async def _settled(self, call, timeout: float = 60):
        from support.checkers import SETTLING
        deadline = mono() + timeout
        while True:
            try:
                return await call()
            except SETTLING:
                if mono() >= deadline:
                    raise
                await asyncio.sleep(0.2)

    def create_bucket(self, bucket: str) -> None:
        from nats.js.api import KeyValueConfig

        cfg = KeyValueConfig(bucket=bucket, replicas=3, history=1, direct=True)
        self.ctl(self._settled(lambda: self.js.create_key_value(cfg)))
        self.wait_current(f"KV_{bucket}")

    def delete_bucket(self, bucket: str) -> None:
        with contextlib.suppress(Exception):
            self.ctl(self._settled(lambda: self.js.delete_key_value(bucket), 20), 30)

    def stream_state(self, stream: str):
        return self.ctl(self._settled(lambda: self.js.stream_info(stream), 20), 30)

    def leader(self, stream: str) -> str | None:
        return self.stream_state(stream).cluster.leader

    def current(self, stream: str) -> bool:
        c = self.stream_state(stream).cluster
        reps = c.replicas or []
        return bool(c.leader) and len(reps) == len(SERVERS) - 1 and all(
            r.current and not r.offline for r in reps)

    def wait_current(self, stream: str, timeout: float = 60) -> None:
        wait_until(lambda: self.current(stream), timeout, f"{stream}: a leader and every replica current")

    def via(self, host: str, call: Callable[[object], Awaitable[T]], timeout: float = 10) -> T:
        """`call(nc)` on a connection to `host` alone, made for it: the control client may sit
        on a server that a fault has cut from the one that must answer."""
        import nats

        async def go():
            nc = await nats.connect(servers=[self.url(host)], connect_timeout=2,
                                    allow_reconnect=False, name="partition-probe")
            try:
                return await call(nc)
            finally:
                await nc.close()
        return self.ctl(go(), timeout)

    def move_leader(self, stream: str, to: str, attempts: int = 12, current: bool = True,
                    via: str | None = None) -> str:
        """Make `to` lead `stream`: stepdown with a preferred placement (nats-server 2.11+),
        else plain stepdowns until it lands there. Returns the leader. `current=False`: do
        not wait for every replica to be current first (a fault has cut one off already);
        `via`: ask through that server alone (see `via`)."""
        async def stepdown(nc, preferred: bool) -> dict:
            body = json.dumps({"placement": {"preferred": to}}).encode() if preferred else b""
            msg = await nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", body, timeout=5)
            return json.loads(msg.data or b"{}")

        async def lead(nc) -> str | None:
            return (await nc.jetstream(timeout=3).stream_info(stream)).cluster.leader

        def leader() -> str | None:
            return self.leader(stream) if via is None else self.via(via, lead)

        preferred = True
        for _ in range(attempts):
            if current:
                self.wait_current(stream)
            now = leader()
            if now == to:
                return now
            try:
                reply = (self.ctl(stepdown(self.nc, preferred), 10) if via is None
                         else self.via(via, lambda nc, p=preferred: stepdown(nc, p)))
            except Exception:
                reply = {}
            if preferred and "error" in reply and "placement" in json.dumps(reply["error"]).lower():
                preferred = False  # a server without preferred placement: step down until it lands
            new = wait_until(lambda now=now: (lead := leader()) not in (None, now) and lead,
                             30, f"{stream}: a new leader after stepdown")
            if new == to:
                return new
        raise AssertionError(f"{stream}: could not move the leader to {to}: {leader()}")

    def connected_server(self, client_name: str = "kvcache") -> str | None:
        """The server the sidecar (client `kvcache` from `sc`'s address) is connected to."""
        for h, s in self.servers.items():
            if not s.running:
                continue
            with contextlib.suppress(Exception):
                for c in s.monitor("/connz").get("connections") or []:
                    if c.get("name") == client_name and c.get("ip") == self.net.addr("sc"):
                        return h
        return None

    # ------------------------------------------------------------------ servers

    def stop_server(self, host: str) -> None:
        self.servers[host].stop()

    def start_server(self, host: str) -> None:
        self.servers[host].start(30)

    def ensure_running(self) -> None:
        for s in self.servers.values():
            if not s.running:
                s.start(30)
        assert self.cluster is not None
        self.cluster.wait_ready(60)

    # ------------------------------------------------------------------ sidecar

    def sidecar(self, name: str, bucket: str, first: str, extra: list[str],
                pin: bool = True, timeout: float = 60, src: str | None = None) -> NsSidecar:
        """A sidecar in `sc` on `bucket`, its --nats URLs listing `first` first, then the other
        two. kvcache (nats-py underneath) has no option to keep that order (nats-py shuffles
        the list unless told not to), so with `pin` the other servers refuse `sc` (a TCP
        reset) until it has synced: it connects to `first`, and stays there until a fault
        moves it."""
        order = [first] + [h for h in SERVERS if h != first]
        sock = Path(self.socket_dir) / f"{name}.sock"
        sc = NsSidecar(self.net, self.workdir / name, sock, [self.url(h) for h in order], bucket, extra, src)
        self.net.closers.append(lambda: sc.kill(check=False))
        pinned = order[1:] if pin else []
        for h in pinned:
            self.net.cut("sc", h, reject=True)
        try:
            sc.start(wait_synced=False, timeout=timeout)
            # synced, and near enough the stream's end (a writer is going: lag may never be 0)
            sc.wait_for(lambda: all(r["synced"] == 1 and r["lag_ms"] < 1000 for r in sc.buckets().values()),
                        timeout, "the sidecar synced")
        finally:
            for h in pinned:
                self.net.heal("sc", h)
        if pin:
            at = wait_until(self.connected_server, 10, "the sidecar's connection in /connz")
            assert at == first, f"sidecar connected to {at}, not {first}"
        return sc


# ----------------------------------------------------------------------------- the fault runs

@dataclass
class RunConfig:
    keys: int = 2000
    rate: float = 300.0            # writes/s
    hold: float = 20.0             # seconds the fault lasts
    warmup: float = 3.0            # reading before the fault
    tail: float = 10.0             # reading after the heal
    max_stale_ms: int = 2000       # the sidecar's bound, and the checker's
    check_stale_ms: int | None = None  # the checker's bound when it differs (an injected fault)
    heartbeat_ms: int = 1000
    read_rate: float = 2000.0      # reads/s over all reader connections
    conns: int = 4
    read_timeout: float = 5.0
    strong_share: float = 0.0      # share of the reads sent CONSISTENCY strong (judged at bound 0)
    sidecar_first: str = "n1"
    sidecar_extra: list[str] = field(default_factory=list)
    restart_down: float = 2.0      # (h): how long each server stays down
    sidecar_src: str | None = None # run the sidecar from this source tree (PYTHONPATH), e.g. an older commit


@dataclass
class FaultResult:
    fault: str
    verdict: Verdict
    t_fault: float
    t_heal: float
    t_end: float
    notes: list[str] = field(default_factory=list)
    sidecar_log: str = ""
    # when the cluster itself was whole again after the heal (the stream led, every replica
    # current), from the control client: the sidecar cannot recover before it
    t_current: float | None = None
    # the strong rule's own check: the plain reads judged as if strong (bound 0). The replica
    # trails the writes by milliseconds, so a checker that sees none of those is not judging.
    plain_at_bound_0: int = 0


FAULTS = {
    "a": "5% loss + 100±50 ms delay on the sidecar's links",
    "b": "sidecar cut from every server",
    "c": "sidecar cut from its own server only",
    "d": "leader = sidecar's server, cut from the other two servers",
    "e": "25% reordering + 5% duplication on the sidecar's links",
    "f": "leader cut from the others; sidecar on a majority server",
    "g": "staggered: one follower cut from the leader a few ms before the other",
    "i": "leader moved off the sidecar's server, then cut; its consumer on a majority server",
    "j": "sidecar's server made leader while cut from one follower, then cut from the other",
    "h": "rolling restart of all three servers",
    "stale-injected": "sidecar with a huge max_stale_ms cut from every server (the checker must see stale reads)",
}


def _roles(fault: str, first: str) -> dict[str, str]:
    """Who leads the stream during the fault, and where the writer connects first (a server
    that stays in the majority and is neither the sidecar's nor the leader when it can)."""
    others = [h for h in SERVERS if h != first]
    leader = others[0] if fault in ("f", "j") else first
    writer = next(h for h in SERVERS if h not in (first, leader))
    return {"sidecar": first, "leader": leader, "writer": writer}


def apply_fault(env: PartitionEnv, fault: str, roles: dict[str, str], cfg: RunConfig,
                notes: list[str]) -> Callable[[], None]:
    """Inject `fault`; returns what heals it. (h) runs its whole restart sequence here."""
    net, sc, leader = env.net, roles["sidecar"], roles["leader"]
    followers = [h for h in SERVERS if h != leader]
    if fault == "a":
        net.shape("sc", loss=0.05, delay_ms=100, jitter_ms=50)
        return lambda: net.unshape("sc")
    if fault == "e":
        net.shape("sc", reorder=0.25, duplicate=0.05)
        return lambda: net.unshape("sc")
    if fault in ("b", "stale-injected"):
        net.isolate("sc")
        return lambda: net.heal("sc")
    if fault == "c":
        net.cut("sc", sc)
        return lambda: net.heal("sc", sc)
    if fault in ("d", "f"):
        for f in followers:
            net.cut(leader, f)
        return lambda: net.heal(leader)
    if fault == "i":
        # the consumer was made on the sidecar's server while it led: the new leader is cut
        # off right after the move, before the feed remakes its consumer there
        target = next(h for h in SERVERS if h != sc)
        env.move_leader(roles["stream"], target)
        for f in (h for h in SERVERS if h != target):
            net.cut(target, f)
        notes.append(f"leader moved to {target} and cut")
        return lambda: net.heal(target)
    if fault == "j":
        # The sidecar's server is made leader while cut from one follower, then cut from the
        # other: it never hears from the first in its term, and nats-server shows that
        # follower's `active` as 0 ("never"), which must not read as "just now"
        # (kvcache.feed.quorum; (i) meets the same by chance when its cut comes before the new
        # leader's first answer from a follower). An election across the half-cut link may go
        # to the third server instead: then heal, let the group settle and try again.
        third = next(h for h in SERVERS if h not in (sc, leader))
        attempt = 1
        while True:
            net.cut(sc, third)
            try:
                env.move_leader(roles["stream"], sc, attempts=1, current=False, via=sc)
                break
            except AssertionError:  # WaitTimeout is one
                net.heal(sc)
                if attempt == 3:
                    raise AssertionError(f"{sc} did not become leader while cut from {third}") from None
                env.wait_current(roles["stream"])
                attempt += 1
        net.cut(sc, leader)
        notes.append(f"leader moved to {sc} (attempt {attempt}), cut from {third} before "
                     f"and {leader} after")
        return lambda: net.heal(sc)
    if fault == "g":
        t0 = mono()
        net.cut(followers[0], leader)
        time.sleep(0.005)
        net.cut(followers[1], leader)
        notes.append(f"second cut {1000 * (mono() - t0):.0f} ms after the first")
        return lambda: net.heal(leader)
    if fault == "h":
        stream = roles["stream"]
        for h in [*followers, leader]:
            t0 = mono()
            env.stop_server(h)
            time.sleep(cfg.restart_down)
            env.start_server(h)
            env.wait_current(stream, 120)
            notes.append(f"{h} down→current {mono() - t0:.1f}s")
        return lambda: None
    raise ValueError(f"unknown fault {fault!r}")


def run_fault(env: PartitionEnv, fault: str, cfg: RunConfig, log: Callable[[str], None] = print) -> FaultResult:
    """One fault end to end on a fresh bucket and a fresh sidecar: place the stream leader,
    start the writer (in `w`), the sidecar (in `sc`, connected to cfg.sidecar_first), the
    readers; read cfg.warmup s, inject, hold cfg.hold s (h: the restarts), heal, read cfg.tail
    s more; judge."""
    run_id = f"{fault.replace('-', '')[:6]}{uuid.uuid4().hex[:6]}"
    bucket = f"p{run_id}"
    stream = f"KV_{bucket}"
    roles = {**_roles(fault, cfg.sidecar_first), "stream": stream}
    work = env.workdir / run_id
    work.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    env.ensure_running()
    env.create_bucket(bucket)
    procs: list[subprocess.Popen] = []
    sc = None
    try:
        env.move_leader(stream, roles["leader"])
        writer_order = [roles["writer"]] + [h for h in SERVERS if h != roles["writer"]]
        total = cfg.warmup + cfg.hold + cfg.tail + 120  # the load's own bound; stopped before
        wlog, rlog = work / "acks.log", work / "reads.log"
        writer = env.net.popen("w", [
            sys.executable, str(HERE / "partition_load.py"), "writer",
            "--servers", ",".join(env.url(h) for h in writer_order), "--bucket", bucket,
            "--keys", str(cfg.keys), "--rate", str(cfg.rate), "--seconds", str(total + 60),
            "--log", str(wlog)], stdout=subprocess.PIPE, stderr=open(work / "writer.err", "wb"), text=True)
        procs.append(writer)
        line = _readline(writer, 90)
        if line.strip() != "ready":
            raise RuntimeError(f"writer did not prime the keys: {line!r} "
                               f"{(work / 'writer.err').read_text()[-2000:]}")
        extra = ["--max-stale-ms", str(cfg.max_stale_ms), "--heartbeat-ms", str(cfg.heartbeat_ms),
                 *cfg.sidecar_extra]
        sc = env.sidecar(f"sc-{run_id}", bucket, cfg.sidecar_first, extra, src=cfg.sidecar_src)
        if (now := env.leader(stream)) != roles["leader"]:
            notes.append(f"leader moved to {now} during set-up; moved back")
            env.move_leader(stream, roles["leader"])
        readers = env.net.popen(None, [
            sys.executable, str(HERE / "partition_load.py"), "readers", "--socket", sc.socket,
            "--bucket", bucket, "--keys", str(cfg.keys), "--rate", str(cfg.read_rate),
            "--conns", str(cfg.conns), "--timeout", str(cfg.read_timeout), "--seconds", str(total),
            "--strong-share", str(cfg.strong_share),
            "--log", str(rlog)], stderr=open(work / "readers.err", "wb"))
        procs.append(readers)
        time.sleep(cfg.warmup)
        at = env.connected_server()
        if at != roles["sidecar"]:
            notes.append(f"sidecar on {at} at the fault, not {roles['sidecar']}")
        t_fault = mono()
        log(f"[{fault}] {FAULTS.get(fault, fault)}: leader {env.leader(stream)}, sidecar on {at}, "
            f"writer on {roles['writer']}")
        heal = apply_fault(env, fault, roles, cfg, notes)
        if fault != "h":
            time.sleep(cfg.hold)
        heal()
        t_heal = mono()
        t_current = None
        while mono() < t_heal + cfg.tail:
            if t_current is None:
                with contextlib.suppress(Exception):
                    if env.current(stream):
                        t_current = mono()
            time.sleep(0.25)
        t_end = mono()
        stop_proc(readers)
        stop_proc(writer)
    finally:
        for p in procs:
            stop_proc(p)
        env.net.heal_all()
        env.net.unshape()
        sidecar_log = ""
        if sc is not None:
            sc.kill(check=False)
            sidecar_log = str(sc.log_path)
        with contextlib.suppress(Exception):
            env.ensure_running()
        env.delete_bucket(bucket)
    check = cfg.check_stale_ms if cfg.check_stale_ms is not None else cfg.max_stale_ms
    acks, reads = read_acks(wlog), read_reads(rlog)
    verdict = judge(acks, reads, check, (t_fault, t_end), t_heal)
    as_strong = [dataclasses.replace(x, kind=STRONG) for x in reads if x.kind != STRONG]
    probe = len(judge(acks, as_strong, check, (t_fault, t_end), t_heal).stale)
    return FaultResult(fault, verdict, t_fault, t_heal, t_end, notes, sidecar_log, t_current, probe)


def _readline(p: subprocess.Popen, timeout: float) -> str:
    """A line of p's stdout within `timeout` ("" if none: it exited or took too long)."""
    import select

    assert p.stdout is not None
    ready, _, _ = select.select([p.stdout], [], [], timeout)
    return p.stdout.readline() if ready else ""


def describe(r: FaultResult) -> str:
    """The lines under a fault's table row: an example stale read and regression, notes."""
    out = []
    v = r.verdict
    if v.stale:
        out.append(f"  stale e.g. {v.stale[0].describe(r.t_fault)}")
        if (w := v.worst_stale) is not v.stale[0]:
            out.append(f"  stale, oldest: {w.describe(r.t_fault)}")
    if v.strong_stale:
        first = next(x for x in v.stale if x.read.kind == STRONG)
        out.append(f"  strong read stale e.g. {first.describe(r.t_fault)}")
    if v.regressions:
        out.append(f"  regression e.g. {v.regressions[0].describe(r.t_fault)}")
    if v.strong_reads:
        out.append(f"  strong reads: {v.strong_reads:,} sent, {v.strong_ok:,} answered, {v.strong_stale:,} stale "
                   f"at bound 0 (the plain reads judged at bound 0, the rule's check: {r.plain_at_bound_0:,} stale)")
    if v.failures:
        out.append(f"  failed reads: {v.failures}")
    out += [f"  note: {n}" for n in r.notes]
    whole = ("not within the tail" if r.t_current is None else f"{r.t_current - r.t_heal:.1f}s after the heal")
    out.append(f"  cluster whole again (stream led, replicas current): {whole}")
    out.append(f"  (times relative to the fault; healed at +{r.t_heal - r.t_fault:.1f}s; sidecar log {r.sidecar_log})")
    return "\n".join(out)


@contextlib.contextmanager
def partition_env(workdir: Path) -> Iterator[PartitionEnv]:
    with PartitionEnv(workdir) as env:
        yield env
