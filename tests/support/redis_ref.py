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

from kvcache.app.client import encode_command
from kvcache.natsio.nats_server import die_with_parent
from support.kvdata import _put_all
from support.sidecar_proc import SidecarProcess
from support.topology import nats_run


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


# The two sides of a byte-for-byte comparison with redis-server (tests/test_client_reply.py,
# tests/test_redis_compat.py): commands sent to both end with END, whose reply ends what came back
# even after CLIENT REPLY OFF.
END = encode_command(["CLIENT", "REPLY", "ON"]) + encode_command(["ECHO", "__end__"])
END_REPLY = b"+OK\r\n$7\r\n__end__\r\n"


def bucket_holding(url: str, bucket: str, values: dict[str, bytes]) -> str:
    """Make `bucket` (Direct Get on) holding `values` on the server at `url`; returns `url`."""
    async def setup(js):
        kv = await js.create_key_value(bucket=bucket, direct=True)
        await _put_all(kv, values)
    nats_run(url, setup)
    return url


@contextlib.contextmanager
def twin_sidecar(twins: str, d: Path, url: str, spec: str) -> Iterator[str]:
    """A real sidecar on bucket `spec` (its default bucket), on its native modules
    (`twins` "native") or their pure-Python twins ("twins"); yields its socket's path and
    checks that it stops cleanly."""
    env = {"KVCACHE_NO_EXTENSIONS": "1" if twins == "twins" else "0"}
    sc = SidecarProcess(d / "sc", url, [spec], env=env)
    with sc:
        sc.start()
        yield sc.socket
        assert sc.stop() == 0
