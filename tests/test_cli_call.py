"""`kvcache cli`, the redis-cli stand-in for machines without redis-tools (README's quick
start), checked against redis-cli itself: the same command to the same sidecar prints the
same text (`redis-cli --no-raw`: its terminal format). Values with quotes, newlines, binary
bytes and an empty one; nil, integers, nested arrays, errors."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from support.sidecar_proc import run_cli
from support.topology import nats_run

pytestmark = pytest.mark.servers  # runs kvcache and redis-cli as processes

VALUES = {"plain": b"hello", "quoted": b'say "hi"\n\tend\\', "binary": bytes(range(0, 256, 7)),
          "empty": b"", "utf8": "héllo".encode()}

COMMANDS = [
    ["PING"], ["GET", "plain"], ["GET", "quoted"], ["GET", "binary"], ["GET", "empty"], ["GET", "utf8"],
    ["GET", "missing"], ["MGET", "plain", "missing", "empty"], ["EXISTS", "plain", "missing"],
    ["DBSIZE"], ["TYPE", "plain"], ["KEYS", "nothing.*"], ["SCAN", "0", "COUNT", "100"],
    ["XRANGE", "@cli", "-", "+", "COUNT", "2"], ["NOSUCH", "x"], ["GET"], ["INFO", "keyspace"],
    ["TTL", "plain"],
]


@pytest.fixture
def sidecar(nats_server, sidecars):
    async def setup(js):
        kv = await js.create_key_value(bucket="cli")
        for k, v in VALUES.items():
            await kv.put(k, v)
    nats_run(nats_server.url, setup)
    return sidecars(nats_server.url, "cli").start()


@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="redis-cli (redis-tools) is the reference")
@pytest.mark.parametrize("words", COMMANDS, ids=lambda w: " ".join(w))
def test_prints_what_redis_cli_prints(sidecar, words):
    ref = subprocess.run(["redis-cli", "--no-raw", "-s", sidecar.socket, *words], capture_output=True,
                         timeout=30)
    got = subprocess.run([sys.executable, "-m", "kvcache", "cli", "--socket", sidecar.socket, *words],
                         capture_output=True, timeout=30)
    assert got.stdout == ref.stdout, (got.stdout, ref.stdout, got.stderr)
    assert got.returncode == (1 if ref.stdout.startswith(b"(error)") else 0), got.stderr


def test_no_command_and_no_sidecar_are_one_line(tmp_path):
    r = run_cli("cli", "--data-dir", str(tmp_path))
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "kvcache: error: no command given: kvcache cli GET <key> (any command the sidecar answers, "
        "as redis-cli takes it)"]
    r = run_cli("cli", "--data-dir", str(tmp_path), "GET", "x")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith("kvcache: error: cannot connect to the sidecar: No such file or directory")
