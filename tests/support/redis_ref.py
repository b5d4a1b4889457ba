"""A real redis-server on a Unix socket (--port 0: no TCP), as the reference the byte-exact
tests compare kvcache's replies with."""
from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from kvcache.natsio.nats_server import die_with_parent


@contextlib.contextmanager
def redis_server(d: Path, values: dict[str, bytes] | None = None) -> Iterator[str]:
    """Start redis-server in `d` holding `values`; yields its socket path; stopped by its PID."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed")
    path = str(d / "redis.sock")
    proc = subprocess.Popen([exe, "--port", "0", "--unixsocket", path, "--unixsocketperm", "700",
                             "--save", "", "--appendonly", "no", "--dir", str(d)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                c = redis.Redis(unix_socket_path=path)
                c.ping()
                break
            except (redis.ConnectionError, FileNotFoundError):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.05)
        if values:
            c.mset(values)
        c.close()
        yield path
    finally:
        proc.terminate()
        proc.wait(10)
