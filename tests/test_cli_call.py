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


BIG = b"x" * (512 * 1024)  # several times a pipe's buffer: its write cannot end before the reader goes


@pytest.fixture
def sidecar(nats_server, sidecars):
    async def setup(js):
        kv = await js.create_key_value(bucket="cli")
        for k, v in VALUES.items():
            await kv.put(k, v)
        await kv.put("big", BIG)
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


def _first_bytes_then_gone(command: str) -> tuple[str, str, str]:
    """`COMMAND | head -c 8` in bash: what head printed, the command's stderr, and its exit
    status as the shell sees it (PIPESTATUS)."""
    r = subprocess.run(["bash", "-c", f"{command} 2>err.txt | head -c 8; echo \" rc=${{PIPESTATUS[0]}}\"; cat err.txt"],
                       capture_output=True, text=True, timeout=60)
    out, _, rest = r.stdout.partition(" rc=")
    rc, _, err = rest.partition("\n")
    return out, err, rc


def test_a_reader_that_leaves_early_ends_it_quietly(sidecar, tmp_path, monkeypatch):
    """`kvcache cli GET big | head -c 8` (and `kvcache get`): the first bytes, then an exit
    as quiet as redis-cli's in the same pipe (killed by SIGPIPE: status 141), no
    BrokenPipeError traceback."""
    monkeypatch.chdir(tmp_path)
    kv = f"{sys.executable} -m kvcache"
    for command, first in ((f"{kv} cli --socket {sidecar.socket} GET big", '"xxxxxxx'),
                           (f"{kv} get --socket {sidecar.socket} big", "xxxxxxxx")):
        out, err, rc = _first_bytes_then_gone(command)
        print(f"{command.split(' -m ')[1].split(' --')[0]}: printed {out!r}, exit {rc}, stderr {err!r}")
        assert (out, err, rc) == (first, "", "141"), (command, out, err, rc)
    if shutil.which("redis-cli"):
        out, err, rc = _first_bytes_then_gone(f"redis-cli -s {sidecar.socket} GET big")
        print(f"redis-cli GET big: printed {out!r}, exit {rc}, stderr {err!r}")
        assert (err, rc) == ("", "141")
