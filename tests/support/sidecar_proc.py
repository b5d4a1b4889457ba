"""Run `kvcache serve` as a real process for tests: started with chosen flags, probed over its
socket, stopped gracefully (SIGTERM) or killed (SIGKILL), always by its own PID."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from kvcache.app.client import Client
from kvcache.natsio.nats_server import die_with_parent
from support.poll import GiveUp, WaitTimeout, wait_until


class SidecarExited(GiveUp):
    """The sidecar process ended while a test waited for it to serve (the wait ends then)."""


TRACEBACK = "Traceback (most recent call last)"


class SidecarProcess:
    """`kvcache serve` as a child process of the test, logging to a file beside its data
    directory; stopped by its own PID. Every way a test ends it (stop, kill, the context
    manager, the `sidecars` fixture) checks its log: a Python traceback there fails the test,
    since the sidecar must answer every mistake with one line (`expect_traceback=True` for a
    test that provokes one on purpose)."""

    def __init__(self, data_dir: Path, nats_url: str | None, buckets: list[str] | None = None,
                 extra: list[str] | None = None, socket: Path | None = None,
                 env: dict[str, str] | None = None, expect_traceback: bool = False) -> None:
        self.expect_traceback = expect_traceback
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
        self.cwd: Path | None = None  # where it runs (None: the test's): `python -m` imports from there first

    def start(self, wait_synced: bool = True, timeout: float = 60.0) -> SidecarProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self.env, cwd=self.cwd,
                                     preexec_fn=die_with_parent)  # never outlive the test run
        self.wait_serving(timeout)
        if wait_synced:
            self.wait_synced(timeout)
        return self

    def client(self, timeout: float = 10.0) -> Client:
        return Client(self.socket, timeout=timeout)

    def wait_serving(self, timeout: float = 30.0) -> None:
        def serving() -> bool:
            if self.proc and self.proc.poll() is not None:
                raise SidecarExited(f"sidecar exited with {self.proc.returncode}:\n{self.log()}")
            with self.client(timeout=2) as c:
                return c.ping()
        try:
            wait_until(serving, timeout, "the sidecar to serve", detail=self.log)
        except WaitTimeout as e:
            if isinstance(e.__context__, SidecarExited) or (self.proc and self.proc.poll() is not None):
                raise SidecarExited(f"sidecar exited with {self.proc.returncode}:\n{self.log()}") from None
            raise

    def buckets(self) -> dict[str, dict]:
        with self.client() as c:
            return c.info("buckets").get("buckets", {})

    def wait_synced(self, timeout: float = 60.0, bucket: str | None = None) -> dict[str, dict]:
        """Until every bucket (or the one named) reports synced=1 and lag_ms=0."""
        def synced() -> dict[str, dict] | None:
            state = self.buckets()
            rows = [state[bucket]] if bucket and bucket in state else list(state.values())
            if rows and all(r["synced"] == 1 and r["lag_ms"] == 0 for r in rows) and (
                    not bucket or bucket in state):
                return state
            return None
        return wait_until(synced, timeout, f"{bucket or 'every bucket'} synced with no lag",
                          detail=self.log)

    def wait_for(self, pred, timeout: float = 20.0, what: str = "condition"):
        return wait_until(pred, timeout, what, detail=self.log)

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
                raise RuntimeError(f"sidecar ignored SIGTERM for {timeout}s:\n{self.log()}") from None
        code = self.proc.returncode
        self._log.close()
        self.check_log()
        return code

    def kill(self, check: bool = True) -> None:
        """SIGKILL: the crash path."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc:
            self._log.close()
            if check:
                self.check_log()

    def check_log(self) -> None:
        """Fail on a Python traceback anywhere in the sidecar's log (unless expected)."""
        if self.expect_traceback:
            return
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return
        at = text.find(TRACEBACK)
        if at >= 0:
            raise AssertionError(f"the sidecar logged a traceback ({self.log_path}):\n"
                                 f"{text[max(0, at - 2000):at + 4000]}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except FileNotFoundError:
            return ""

    def __enter__(self) -> SidecarProcess:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if self.proc:
            self.kill(check=exc_type is None)  # a failing test's own error comes first


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


def check_src(src: Path, who: str) -> None:
    """Does `python -P` with PYTHONPATH=src import src's kvcache? (A benchmark comparing the
    sidecar of another source tree, `--sidecar-src`, would otherwise compare this checkout
    with itself.) SystemExit naming `who` if not."""
    if not (src / "kvcache" / "__main__.py").is_file():
        raise SystemExit(f"{who}: {src} holds no kvcache/__main__.py")
    out = subprocess.run([sys.executable, "-P", "-c", "import kvcache; print(kvcache.__file__)"],
                         capture_output=True, text=True, timeout=60, cwd=tempfile.gettempdir(),
                         env={**os.environ, "PYTHONPATH": str(src)})
    where = Path(out.stdout.strip() or "?").resolve()
    if out.returncode or not where.is_relative_to(src.resolve()):
        raise SystemExit(f"{who}: with PYTHONPATH={src}, kvcache comes from {where} "
                         f"({out.stderr.strip()[-300:]})")
