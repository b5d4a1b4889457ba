"""A user's mistakes with the CLI: each ends in one clear line on stderr and a
non-zero exit, never a traceback, and before anything is created (no bucket, no data
directory, no nats-server). The CLI runs as a subprocess, as a user runs it."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import nats
import pytest
from support.sidecar_proc import SidecarProcess, run_cli

import kvcache

pytestmark = pytest.mark.servers  # each test starts its own servers or sidecar process


def one_line_error(result: subprocess.CompletedProcess, code: int, *fragments: str) -> str:
    assert result.returncode == code, result
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith("kvcache: error: "), line
    assert "kvcache: error:" not in line[len("kvcache: error: "):], line  # one prefix only
    for f in fragments:
        assert f in line, line
    return line


def run_without_pyspark(*args: str) -> subprocess.CompletedProcess:
    """The CLI in a Python where `import pyspark` fails (the Spark extra not installed)."""
    code = ("import sys; sys.modules['pyspark'] = None; from kvcache.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60)


async def _bucket_names(url: str) -> list[str]:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        return [s.config.name for s in await js.streams_info()]
    finally:
        await nc.close()


# ---------------------------------------------------------------------- configuration files

def test_config_file_in_utf16(tmp_path):
    path = tmp_path / "kvcache.toml"
    path.write_text('[[bucket]]\nname = "config"\n', encoding="utf-16")
    one_line_error(run_cli("serve", "--config", str(path), "--data-dir", str(tmp_path / "d")), 2,
                   "UTF-16", "UTF-8", "iconv")
    assert not (tmp_path / "d").exists()


def test_config_file_not_utf8(tmp_path):
    path = tmp_path / "kvcache.toml"
    path.write_bytes('log_level = "d\xe9bug"\n'.encode("latin-1"))
    one_line_error(run_cli("serve", "--config", str(path)), 2, "not UTF-8")


def test_config_file_with_utf8_bom_is_fine(tmp_path):
    from kvcache.config_sources import load
    path = tmp_path / "kvcache.toml"
    path.write_bytes(b"\xef\xbb\xbfmax_clients = 7\n")
    assert load(str(path), env={}).max_clients == 7


@pytest.mark.parametrize("literal, digits", [("660", "660"), ("600", "600"), ("400", "400"), ("1224", "660")])
def test_socket_mode_written_in_decimal(tmp_path, literal, digits):
    path = tmp_path / "kvcache.toml"
    path.write_text(f"socket_mode = {literal}   # meant as a file mode\n")
    line = one_line_error(run_cli("serve", "--config", str(path), "--data-dir", str(tmp_path / "d")), 2,
                          f"socket_mode = {literal} is read by TOML as the decimal number {literal}",
                          f"0o{digits}", f'"{digits}"')
    assert "got 1224" not in line
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("text, mode", [("socket_mode = 0o640", 0o640), ('socket_mode = "640"', 0o640),
                                        ('socket_mode = "0o600"', 0o600), ("socket_mode = 0o0660", 0o660)])
def test_socket_mode_in_octal_or_as_a_string(tmp_path, text, mode):
    from kvcache.config_sources import load
    path = tmp_path / "kvcache.toml"
    path.write_text(text + "\n")
    assert load(str(path), env={}).socket_mode == mode


def test_socket_mode_zero_is_read_as_a_mode(tmp_path):
    """`socket_mode = 0` is the same number in any base: read as the mode 000 (not refused as a
    decimal literal), which lets no one connect (tests/test_config_messages.py)."""
    from kvcache.config_sources import load
    from kvcache.errors import ConfigError
    path = tmp_path / "kvcache.toml"
    path.write_text("socket_mode = 0\n")
    with pytest.raises(ConfigError, match=r"^socket_mode 000 lets no one connect"):
        load(str(path), env={})


def test_socket_mode_bad_string(tmp_path):
    path = tmp_path / "kvcache.toml"
    path.write_text('socket_mode = "rw-rw----"\n')
    one_line_error(run_cli("serve", "--config", str(path)), 2, "octal file mode like 0o660")


# ---------------------------------------------------------------------- serve

def test_nats_without_a_bucket(tmp_path, nats_server):
    data = tmp_path / "d"
    line = one_line_error(run_cli("serve", "--nats", nats_server.url, "--data-dir", str(data)), 2,
                          "no bucket to replicate", "--bucket NAME")
    assert "demo bucket" in line
    assert not data.exists()
    assert asyncio.run(_bucket_names(nats_server.url)) == []
    # the same from the environment
    one_line_error(run_cli("serve", "--data-dir", str(data), env={"KVCACHE_NATS_SERVERS": nats_server.url}),
                   2, "no bucket to replicate")


@pytest.mark.parametrize("args, fragments", [
    (["--bucket", ":x"], ["invalid bucket name ''"]),
    (["--bucket", "cfg:a..b"], ["invalid key filter 'a..b'"]),
    (["--bucket", "cfg:,"], ["keys is empty and it has no near cache"]),
    (["--bucket", "a b"], ["invalid bucket name 'a b'"]),
    (["--max-stale-ms", "-1"], ["max_stale_ms must not be negative"]),
    (["--max-clients", "-3"], ["max_clients must be positive"]),
    (["--request-timeout-ms", "0"], ["request_timeout_ms must be positive"]),
    (["--connect-timeout-s", "-1"], ["connect_timeout_s", "must be positive"]),
    (["--client-write-stall-ms", "-1"], ["client_write_stall_ms"]),
    (["--access-log-files", "-1"], ["access_log_files not negative"]),
    (["--socket-mode", "999"], ["not an octal file mode: 999"]),
    (["--max-clients", "many"], ["argument --max-clients: invalid int value: 'many'", "kvcache serve --help"]),
    (["--no-such-flag"], ["unrecognized arguments: --no-such-flag", "(see kvcache serve --help)"]),
    (["--buckets", "x"], ["unrecognized arguments: --buckets x", "(see kvcache serve --help)"]),
    (["--socket", "/tmp/" + "s" * 120 + ".sock"], ["socket path is too long"]),
    (["--log-level", "loud"], ["log_level must be"]),
])
def test_serve_mistakes(tmp_path, args, fragments):
    data = tmp_path / "d"
    one_line_error(run_cli("serve", "--data-dir", str(data), *args), 2, *fragments)
    assert not data.exists()  # refused before anything was created


def test_max_stale_ms_from_environment_negative(tmp_path):
    one_line_error(run_cli("serve", "--data-dir", str(tmp_path / "d"), env={"KVCACHE_MAX_STALE_MS": "-5"}),
                   2, "KVCACHE_MAX_STALE_MS must not be negative")


def test_data_dir_unusable(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    one_line_error(run_cli("serve", "--data-dir", str(not_a_dir)), 2, "cannot create directory")
    # a directory where no file can be created (as root, permissions would not stop us)
    one_line_error(run_cli("serve", "--data-dir", "/proc/self", "--socket", str(tmp_path / "s.sock")), 2,
                   "cannot create the lock file /proc/self/kvcache.lock")


def test_access_log_dir_unusable(tmp_path):
    """Found at start, not by a traceback once the replica has synced."""
    one_line_error(run_cli("serve", "--data-dir", str(tmp_path / "d"), "--access-log-rate", "0.1",
                           "--access-log-dir", "/proc/self/x"), 2, "cannot create directory /proc/self/x")


def test_socket_path_taken_by_a_file(tmp_path):
    taken = tmp_path / "file.sock"
    taken.write_text("mine")
    one_line_error(run_cli("serve", "--data-dir", str(tmp_path / "d"), "--socket", str(taken)), 1,
                   "exists and is not a socket")
    assert taken.read_text() == "mine"


def test_bare_kvcache_lists_the_subcommands():
    """No subcommand: the list of them, one line each, not argparse's 'the following
    arguments are required: command'; exit 2 (a usage mistake)."""
    result = run_cli()
    assert result.returncode == 2 and result.stdout == ""
    assert "Traceback" not in result.stderr and "required" not in result.stderr
    lines = result.stderr.splitlines()
    assert lines[0] == "usage: kvcache <command> [options]"
    names = ["serve", "get", "info", "cli", "health", "load", "hotkeys"]
    rows = [line.split() for line in lines if line.startswith("  ")]
    assert [r[0] for r in rows] == names
    assert all(len(r) > 2 for r in rows)  # each with what it does
    assert "kvcache <command> --help" in result.stderr
    # options but no command: what was not understood, then the same list
    result = run_cli("--nosuch")
    assert result.returncode == 2
    assert result.stderr.splitlines()[0] == "kvcache: error: no command in: --nosuch"
    assert [line.split()[0] for line in result.stderr.splitlines() if line.startswith("  ")] == names


def test_argparse_errors_have_one_prefix():
    line = one_line_error(run_cli("serve", "--max-clients"), 2, "argument --max-clients: expected one argument")
    assert "kvcache serve:" not in line
    one_line_error(run_cli("nosuchcommand"), 2, "invalid choice: 'nosuchcommand'")
    one_line_error(run_cli("get"), 2, "the following arguments are required: key", "kvcache get --help")
    one_line_error(run_cli("get", "k", "--nosuch"), 2, "unrecognized arguments: --nosuch", "(see kvcache get --help)")
    one_line_error(run_cli("info", "--entry"), 2, "unrecognized arguments: --entry", "(see kvcache info --help)")


# ---------------------------------------------------------------------- load / hotkeys without Spark

def test_load_without_spark_creates_nothing(tmp_path, nats_server):
    data = tmp_path / "rows.csv"
    data.write_text("k,v\na,1\n")
    result = run_without_pyspark("load", str(data), "--nats", nats_server.url, "--bucket", "fresh", "--key", "k")
    # kvcache is on no package index: from a clone, the extra is installed from the tree
    root = Path(kvcache.__file__).resolve().parent.parent
    where = "." if Path.cwd().resolve() == root else str(root)
    one_line_error(result, 1, "kvcache load needs the Spark extra", "no module named 'pyspark'",
                   f"pip install -e '{where}[spark]'")
    assert asyncio.run(_bucket_names(nats_server.url)) == []  # no bucket created


def test_spark_hint_outside_a_clone_names_the_extras_packages():
    """Installed from a wheel (no source tree around the package), the hint names the
    packages of the `spark` extra, as pyproject.toml lists them."""
    from kvcache.cli import _spark_requirements
    with open(Path(kvcache.__file__).resolve().parent.parent / "pyproject.toml", "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["spark"]
    assert sorted(_spark_requirements()) == sorted(extra)


def test_hotkeys_without_spark(tmp_path):
    one_line_error(run_without_pyspark("hotkeys", str(tmp_path)), 1, "kvcache hotkeys needs the Spark extra")


# ---------------------------------------------------------------------- reading: get / info

@pytest.fixture
def one_bucket_sidecar(tmp_path, nats_server):
    async def make() -> None:
        nc = await nats.connect(nats_server.url)
        try:
            js = nc.jetstream()
            for b in ("configured", "other"):
                kv = await js.create_key_value(bucket=b, direct=True)
                await kv.put("k", b"v")
        finally:
            await nc.close()
    asyncio.run(make())
    with SidecarProcess(tmp_path / "sc", nats_server.url, buckets=["configured"]) as sc:
        sc.start()
        yield sc


def test_bucket_in_nats_but_not_configured(one_bucket_sidecar):
    sc = one_bucket_sidecar
    line = one_line_error(run_cli("get", "--socket", sc.socket, "other:k"), 1,
                          "no such bucket 'other' in this sidecar", "it replicates: configured",
                          "--bucket other", "[[bucket]]")
    assert line
    result = run_cli("get", "--socket", sc.socket, "configured:k")
    assert result.returncode == 0 and result.stdout == "v\n"


def test_info_unknown_section(one_bucket_sidecar):
    sc = one_bucket_sidecar
    one_line_error(run_cli("info", "--socket", sc.socket, "nosuchsection"), 2,
                   "no INFO section 'nosuchsection'", "server, clients, stats, replication, buckets, peers")
    result = run_cli("info", "--socket", sc.socket, "buckets")
    assert result.returncode == 0 and "configured:synced=1" in result.stdout


def test_get_and_info_without_a_sidecar(tmp_path):
    sock = tmp_path / "none.sock"
    one_line_error(run_cli("get", "--socket", str(sock), "k"), 1, "none.sock",
                   "No such file or directory", f"is the sidecar running? (socket {sock}")
    one_line_error(run_cli("info", "--data-dir", str(tmp_path)), 1, "kvcache.sock",
                   f"is the sidecar running? (socket {tmp_path / 'kvcache.sock'}")
    assert not os.path.exists(tmp_path / "kvcache.sock")
    # a socket file nothing listens on (a sidecar that was killed): the same hint
    import socket
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(sock))
    stale.close()
    one_line_error(run_cli("get", "--socket", str(sock), "k"), 1, "Connection refused",
                   f"is the sidecar running? (socket {sock}")


@pytest.mark.parametrize("key, fragments", [
    ("bad key", ["invalid key 'bad key': KV keys use A-Z a-z 0-9"]),
    ("a..b", ["invalid key 'a..b'"]),
    ("_kv.x", ["invalid key '_kv.x': keys starting with _kv are reserved"]),
    ("configured:_kvx", ["invalid key '_kvx'", "reserved"]),
])
def test_get_refused_key_one_clear_line(one_bucket_sidecar, key, fragments):
    """The sidecar's refusal, said once: no Redis `ERR` code after `kvcache: error:`."""
    line = one_line_error(run_cli("get", "--socket", one_bucket_sidecar.socket, key), 1, *fragments)
    assert line.startswith("kvcache: error: invalid key"), line
    assert "ERR" not in line
