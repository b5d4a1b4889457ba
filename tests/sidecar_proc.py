"""Run `kvcache serve` as a real process for tests: started with chosen flags, probed over its
socket, stopped gracefully (SIGTERM) or killed (SIGKILL), always by its own PID."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvcache.client import Client, ConnectionFailed
from kvcache.natsserver import die_with_parent


class SidecarProcess:
    def __init__(self, data_dir: Path, nats_url: str | None, buckets: list[str] | None = None,
                 extra: list[str] | None = None, socket: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.socket = str(socket or self.data_dir / "kvcache.sock")
        self.args = [sys.executable, "-m", "kvcache", "serve", "--data-dir", str(self.data_dir),
                     "--socket", self.socket]
        if nats_url:
            self.args += ["--nats", nats_url]
        for b in buckets or []:
            self.args += ["--bucket", b]
        self.args += extra or []
        self.env = {**os.environ, **(env or {})}
        self.log_path = self.data_dir.parent / f"{self.data_dir.name}-sidecar.log"
        self.proc: subprocess.Popen | None = None

    def start(self, wait_synced: bool = True, timeout: float = 60.0) -> SidecarProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self.env,
                                     preexec_fn=die_with_parent)  # never outlive the test run
        self.wait_serving(timeout)
        if wait_synced:
            self.wait_synced(timeout)
        return self

    def client(self, timeout: float = 10.0) -> Client:
        return Client(self.socket, timeout=timeout)

    def wait_serving(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc and self.proc.poll() is not None:
                raise RuntimeError(f"sidecar exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with self.client(timeout=2) as c:
                    if c.ping():
                        return
            except ConnectionFailed:
                time.sleep(0.05)
        raise TimeoutError(f"sidecar not serving after {timeout}s:\n{self.log()}")

    def buckets(self) -> dict[str, dict]:
        with self.client() as c:
            return c.info("buckets").get("buckets", {})

    def wait_synced(self, timeout: float = 60.0, bucket: str | None = None) -> dict[str, dict]:
        """Until every bucket (or the one named) reports synced=1 and lag_ms=0."""
        deadline = time.monotonic() + timeout
        state: dict = {}
        while time.monotonic() < deadline:
            state = self.buckets()
            rows = [state[bucket]] if bucket and bucket in state else list(state.values())
            if rows and all(r["synced"] == 1 and r["lag_ms"] == 0 for r in rows) and (
                    not bucket or bucket in state):
                return state
            time.sleep(0.05)
        raise TimeoutError(f"sidecar not synced after {timeout}s: {state}\n{self.log()}")

    def wait_for(self, pred, timeout: float = 20.0, what: str = "condition"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = pred()
            if value:
                return value
            time.sleep(0.05)
        raise TimeoutError(f"{what} not reached after {timeout}s\n{self.log()}")

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM and wait: the graceful path. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise RuntimeError(f"sidecar ignored SIGTERM for {timeout}s:\n{self.log()}")
        code = self.proc.returncode
        self._log.close()
        return code

    def kill(self) -> None:
        """SIGKILL: the crash path."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc:
            self._log.close()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except FileNotFoundError:
            return ""

    def __enter__(self) -> SidecarProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc and self.proc.poll() is None:
            self.kill()


def run_cli(*args: str, timeout: float = 60.0, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvcache", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def write_config(path: Path, nats: dict, buckets: list[dict], peers: list[dict] = (), **top) -> str:
    """A kvcache.toml from plain values: top-level keys, [nats], [[bucket]]s and [[peer]]s."""
    def table(d: dict) -> str:
        return "\n".join(f"{k} = {json.dumps(v)}" for k, v in d.items())
    parts = [table(top), "[nats]", table(nats)]
    parts += [f"[[bucket]]\n{table(b)}" for b in buckets] + [f"[[peer]]\n{table(p)}" for p in peers]
    Path(path).write_text("\n".join(parts) + "\n")
    return str(path)
