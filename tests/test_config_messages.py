"""Configuration that used to be silent or misleading: each mistake is one line that
names it and the fix, a legal but likely unmeant setting is one warning at start, and a failed
start leaves the data directory as it found it. Parsing is checked in-process; what happens at
start runs `kvcache serve` as a subprocess against real nats-servers."""
from __future__ import annotations

import asyncio
import os
import re
import subprocess
import tempfile
import textwrap
from pathlib import Path

import nats
import pytest
from support.sidecar_proc import SidecarProcess, run_cli

from kvcache import config_sources
from kvcache.config import PASSWORD_ENV, start_warnings
from kvcache.config_sources import OTHER_ENV, load
from kvcache.errors import ConfigError
from kvcache.sidecar import MISSING_BUCKET_LIST, missing_bucket

ROOT = Path(__file__).resolve().parent.parent


def write(tmp_path: Path, text: str) -> str:
    p = tmp_path / "kvcache.toml"
    p.write_text(textwrap.dedent(text))
    return str(p)


def error_of(**kw) -> str:
    with pytest.raises(ConfigError) as e:
        load(**kw)
    text = str(e.value)
    assert "\n" not in text
    return text


def one_line_error(result: subprocess.CompletedProcess, code: int) -> str:
    """The CLI's one `kvcache: error:` line (exit `code`, no traceback); log lines before it
    (the embedded server's start) are the log, not the error."""
    assert result.returncode == code, result
    assert "Traceback" not in result.stderr, result.stderr
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("kvcache: error:")]
    assert len(errors) == 1 and result.stderr.strip().splitlines()[-1] == errors[0], result.stderr
    return errors[0]


async def make_buckets(url: str, buckets: dict[str, dict[str, bytes]]) -> None:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        for name, keys in buckets.items():
            kv = await js.create_key_value(bucket=name, direct=True)
            for k, v in keys.items():
                await kv.put(k, v)
    finally:
        await nc.close()


# ---------------------------------------------------------------------- 1: KVCACHE_* variables

@pytest.mark.parametrize("name, meant", [
    ("KVCACHE_NATS_SERVER", "KVCACHE_NATS_SERVERS"),
    ("KVCACHE_NATS", "KVCACHE_NATS_SERVERS"),       # the flag's name, --nats
    ("KVCACHE_BUCKET", "KVCACHE_BUCKETS"),          # the flag's name, --bucket
    ("KVCACHE_TOKEN", "KVCACHE_NATS_TOKEN"),        # a [nats] key without NATS_
    ("KVCACHE_MAXCLIENTS", "KVCACHE_MAX_CLIENTS"),
    ("kvcache_data_dir", "KVCACHE_DATA_DIR"),       # names are case sensitive
    ("KVCACHE_NO_EXTENSION", "KVCACHE_NO_EXTENSIONS"),
])
def test_unknown_variable_is_an_error_with_the_one_meant(name, meant):
    text = error_of(env={name: "nats://127.0.0.1:4222"})
    assert text == (f"unknown environment variable {name} (did you mean {meant}?): no kvcache setting "
                    "has that name (`kvcache serve --help` names each one's); rename or unset it")


def test_several_unknown_variables_in_one_line():
    text = error_of(env={"KVCACHE_NATS_SERVER": "x", "KVCACHE_ZZZ": "1", "KVCACHE_DATA_DIR": "/tmp/d"})
    assert text.startswith("unknown environment variables KVCACHE_NATS_SERVER (did you mean "
                           "KVCACHE_NATS_SERVERS?), KVCACHE_ZZZ: "), text
    assert text.endswith("rename or unset them")


def test_variables_that_are_not_settings_are_let_be():
    env = {name: "1" for name in OTHER_ENV} | {PASSWORD_ENV: "pw", "KVCACHE_NATS_SERVERS": "nats://127.0.0.1:1"}
    assert load(env=env).nats.servers == ["nats://127.0.0.1:1"]


def test_kubernetes_service_links_are_let_be():
    """A Service named kvcache (or kvcache-metrics) in the namespace puts its links in every
    container's environment: not typos, and a sidecar must start beside them."""
    links = {"KVCACHE_SERVICE_HOST": "10.0.0.7", "KVCACHE_SERVICE_PORT": "9464",
             "KVCACHE_SERVICE_PORT_METRICS": "9464", "KVCACHE_PORT": "tcp://10.0.0.7:9464",
             "KVCACHE_PORT_9464_TCP": "tcp://10.0.0.7:9464", "KVCACHE_PORT_9464_TCP_PROTO": "tcp",
             "KVCACHE_PORT_9464_TCP_PORT": "9464", "KVCACHE_PORT_9464_TCP_ADDR": "10.0.0.7",
             "KVCACHE_METRICS_SERVICE_HOST": "10.0.0.8", "KVCACHE_METRICS_PORT_80_TCP_ADDR": "10.0.0.8"}
    assert load(env={**links, "KVCACHE_NATS_SERVERS": "nats://127.0.0.1:1"}).nats.servers == ["nats://127.0.0.1:1"]
    with pytest.raises(ConfigError, match="KVCACHE_PORTS"):  # near, but no link's shape
        load(env={**links, "KVCACHE_PORTS": "1"})


def _read_by_the_repository() -> set[str]:
    """Every KVCACHE_* name in the code, build and CI files (not in these tests' own typos, nor
    in the module that names typos to explain its check)."""
    mine = {"test_config_messages.py", "test_config.py", "test_mistakes.py", "config_sources.py"}
    files = [*(p for p in (ROOT / "kvcache").rglob("*.py") if p.name not in mine),
             ROOT / "setup.py", ROOT / "Makefile", ROOT / "Dockerfile",
             *(ROOT / ".ci").glob("*"), *(ROOT / "bench").rglob("*.py"), *(ROOT / "deploy").rglob("*.y*ml"),
             *(ROOT / "deploy").rglob("*.service"), *(ROOT / "deploy").rglob("*.toml"),
             *(p for p in (ROOT / "tests").rglob("*.py") if "node_modules" not in p.parts and p.name not in mine)]
    names: set[str] = set()
    for f in files:
        if f.is_file():
            names |= set(re.findall(r"\bKVCACHE_[A-Z0-9_]*[A-Z0-9]\b", f.read_text(errors="replace")))
    return names


def test_every_variable_the_repository_reads_is_known():
    """OTHER_ENV is the one list of the variables that are not settings: a new one read
    anywhere (a test knob, a build switch) must be added there, or `load` would refuse it."""
    names = _read_by_the_repository()
    assert {"KVCACHE_PURE_PYTHON", "KVCACHE_FAULT_TABLE", "KVCACHE_REQUIRE_EXTENSIONS"} <= names  # the scan works
    assert sorted(names - config_sources.known_env()) == []


@pytest.mark.servers  # starts a process
def test_unknown_variable_stops_serve_before_an_embedded_server(tmp_path):
    """A typo'd NATS variable stops serve before anything starts; it used to start an embedded
    server instead."""
    data = tmp_path / "d"
    result = run_cli("serve", "--data-dir", str(data), "--bucket", "config",
                     env={"KVCACHE_NATS_SERVER": "nats://127.0.0.1:4222"})
    line = one_line_error(result, 2)
    assert line == ("kvcache: error: unknown environment variable KVCACHE_NATS_SERVER (did you mean "
                    "KVCACHE_NATS_SERVERS?): no kvcache setting has that name (`kvcache serve --help` "
                    "names each one's); rename or unset it")
    assert result.stderr.count("\n") == 1  # nothing logged: no embedded server was started
    assert not data.exists()


# ---------------------------------------------------------------------- 2: unknown TOML keys

def test_every_unknown_key_is_named_at_once(tmp_path):
    path = write(tmp_path, """
        srvers = ["nats://127.0.0.1:4222"]
        bogus = 1
        [nats]
        srvers = ["nats://127.0.0.1:4222"]
        data_dir = "/tmp/kvc"
        [[bucket]]
        name = "config"
        kyes = ["app.>"]
        [[peer]]
        name = "west"
        servers = ["nats://127.0.0.1:5222"]
        stream = "KV_config_west"
        strem = "x"
    """)
    assert error_of(path=path, env={}) == (
        f"{path}: unknown keys 'srvers' (did you mean 'servers' in [nats]?); 'bogus'; "
        "'srvers' in [nats] (did you mean 'servers'?); 'data_dir' in [nats] (a top-level key: TOML "
        "puts the keys after [nats] into it; move it above the first [table]); 'kyes' in [[bucket]] "
        "'config' (did you mean 'keys'?); 'strem' in [[peer]] 'west' (did you mean 'stream'?)")


@pytest.mark.parametrize("text, message", [
    ("bogus = 1", "unknown key 'bogus'"),
    ("Log_Level = 'debug'", "unknown key 'Log_Level' (did you mean 'log_level'?)"),
    ("max_stale_ms = 100", "unknown key 'max_stale_ms' (a [[bucket]] key)"),
    ("[[bucket]]\nname = 'a'\nservers = []", "unknown key 'servers' in [[bucket]] 'a' (a [nats] key)"),
    ("[[bucket]]\nkyes = []", "unknown key 'kyes' in [[bucket]] #1 (did you mean 'keys'?)"),
])
def test_one_unknown_key(tmp_path, text, message):
    assert error_of(path=write(tmp_path, text), env={}).endswith(message)


# ---------------------------------------------------------------------- 3: a string for a list

@pytest.mark.parametrize("text, message", [
    ('[nats]\nservers = "nats://127.0.0.1:4222"',
     '[nats]: servers must be a list, got the string "nats://127.0.0.1:4222": '
     'write servers = ["nats://127.0.0.1:4222"]'),
    ('[nats]\nservers = "nats://a:4222,nats://b:4222"',
     'write servers = ["nats://a:4222", "nats://b:4222"]'),
    ('[nats]\nservers = "nats://user:s3cret@a:4222"', 'write servers = ["nats://***@a:4222"]'),
    ('[[bucket]]\nname = "config"\nkeys = "app.>"',
     'bucket config: keys must be a list, got the string "app.>": write keys = ["app.>"]'),
    ('[[peer]]\nname = "w"\nservers = "nats://127.0.0.1:5222"\nstream = "KV_w"',
     'peer servers must be a list, got the string "nats://127.0.0.1:5222": '
     'write servers = ["nats://127.0.0.1:5222"]'),
    ('[nats]\nservers = [4222]', 'servers must be a list of strings, like servers = ["nats://127.0.0.1:4222"]'),
    ('[bucket]\nname = "config"', "bucket must be an array of tables: write [[bucket]] (two pairs of brackets)"),
    ('[[nats]]\nservers = []', "nats must be a table: write [nats] (one pair of brackets), once"),
    ('bucket = ["config"]', "each bucket must be a table: write a [[bucket]] section per bucket"),
])
def test_a_string_where_a_list_belongs(tmp_path, text, message):
    text = error_of(path=write(tmp_path, text), env={})
    assert message in text
    assert "s3cret" not in text


# ---------------------------------------------------------------------- 4: a filter with no wildcard

def test_exact_key_filters_are_warned_about():
    def warnings(*buckets: str) -> list[str]:
        return start_warnings(load(env={}, overrides={"buckets": list(buckets)}))
    assert warnings("demo:feature") == [
        "bucket demo: key filter 'feature' has no wildcard: it replicates the one key 'feature', not the "
        "keys under it; for those write 'feature.>' (every level below) or 'feature.*' (one level)"]
    assert warnings("demo:a,b")[0].startswith("bucket demo: key filters 'a', 'b' have no wildcard")
    # a bucket that also has a wildcard filter: its exact keys are meant
    assert warnings("demo:a,b.>", "all", "one:a.*.c") == []


def test_exact_key_filter_warning_at_start(tmp_path, nats_server):
    asyncio.run(make_buckets(nats_server.url, {"demo": {"feature.x": b"1"}}))
    with SidecarProcess(tmp_path / "sc", nats_server.url, buckets=["demo:feature"]) as sc:
        sc.start()
        assert ("WARNING kvcache: bucket demo: key filter 'feature' has no wildcard: it replicates "
                "the one key 'feature', not the keys under it; for those write 'feature.>' "
                "(every level below) or 'feature.*' (one level)") in sc.log()
        with sc.client() as c:
            assert c.entry("feature.x").source != "local"  # not replicated: read from NATS
        assert sc.stop() == 0


# ---------------------------------------------------------------------- 5: a missing bucket

def test_missing_bucket_names_the_buckets_there():
    url = "nats://127.0.0.1:4222"
    assert missing_bucket("Demo", url, ["config", "demo"], False) == (
        "bucket 'Demo' does not exist on nats://127.0.0.1:4222 (did you mean 'demo'? buckets there: config, demo)")
    assert missing_bucket("confgi", url, ["demo", "config"], False).endswith(
        "(did you mean 'config'? buckets there: config, demo)")
    assert missing_bucket("absent", url, ["demo"], False) == (
        "bucket 'absent' does not exist on nats://127.0.0.1:4222 (buckets there: demo)")
    assert missing_bucket("absent", url, [], False).endswith("(it has no KV buckets)")
    assert missing_bucket("absent", url, None, False) == "bucket 'absent' does not exist on nats://127.0.0.1:4222"
    many = [f"b{i:02d}" for i in range(25)]
    text = missing_bucket("B07", url, many, False)
    assert f"buckets there: {', '.join(many[:MISSING_BUCKET_LIST])} and 15 more)" in text
    assert "did you mean 'b07'?" in text
    assert missing_bucket("Demo", url, [], True) == (
        "bucket 'Demo' does not exist on the embedded nats-server nats://127.0.0.1:4222 (it has no KV "
        "buckets): no NATS URL was given (KVCACHE_NATS_SERVERS / --nats), so an embedded server was started")


# ---------------------------------------------------------------------- 6: the near cache's settings

def test_global_near_cache_skips_buckets_that_replicate_every_key():
    """An environment alone (Kubernetes) can have `config` replicated and `profiles` cached."""
    env = {"KVCACHE_BUCKETS": "config profiles:user.> none:", "KVCACHE_CACHE_MAX_KEYS": "100"}
    for cfg in (load(env=env),
                load(env={}, overrides={"buckets": ["config", "profiles:user.>", "none:"], "cache_max_keys": 100}),
                load(env={}, overrides={"cache_max_keys": 100, "buckets": ["config", "profiles:user.>", "none:"]})):
        assert [cfg.cache_bounds(b) for b in cfg.buckets] == [(0, 0), (100, 0), (100, 0)]
        assert start_warnings(cfg) == []


def test_global_near_cache_covering_no_bucket_is_warned_about():
    cfg = load(env={"KVCACHE_BUCKETS": "config", "KVCACHE_CACHE_MAX_KEYS": "100"})
    assert cfg.cache_bounds(cfg.buckets[0]) == (0, 0)
    assert start_warnings(cfg) == [
        "cache_max_keys 100 covers no bucket: every bucket here replicates every key, and a near cache "
        "holds only keys outside a bucket's filters (give the bucket to cache key filters: "
        "--bucket NAME:FILTER,... or keys = [...])"]


def test_own_near_cache_on_a_bucket_replicating_every_key_is_an_error(tmp_path):
    path = write(tmp_path, """
        cache_max_keys = 100                # the top level: fine, the bucket skips it
        [[bucket]]
        name = "config"
        cache_max_keys = 10
        cache_max_bytes = 1000
    """)
    assert error_of(path=path, env={}) == (
        "bucket 'config' replicates every key (keys = [\">\"]), so its own cache_max_keys and "
        "cache_max_bytes would cache nothing (a near cache holds the keys outside a bucket's filters): "
        "remove them from this [[bucket]], or give it key filters (keys = [\"feature.>\"]); the "
        "top-level setting skips such buckets by itself")
    assert error_of(env={}, overrides={"cache_max_bytes": -1}).startswith(
        "cache_max_keys and cache_max_bytes must not be negative")


def test_near_cache_from_the_environment_with_a_whole_bucket(tmp_path, nats_server):
    asyncio.run(make_buckets(nats_server.url, {"config": {"a": b"1"}, "profiles": {"user.1": b"x", "other": b"y"}}))
    env = {"KVCACHE_BUCKETS": "config profiles:user.>", "KVCACHE_CACHE_MAX_KEYS": "100"}
    with SidecarProcess(tmp_path / "sc", nats_server.url, env=env) as sc:
        sc.start()
        buckets = sc.buckets()
        assert "cache_keys" not in buckets["config"] and "cache_keys" in buckets["profiles"]
        assert "covers no bucket" not in sc.log()
        assert sc.stop() == 0


# ---------------------------------------------------------------------- 7: the reconcile line

def test_reconcile_says_keys_may_have_left_the_filters(tmp_path, nats_server):
    asyncio.run(make_buckets(nats_server.url, {"demo": {"a.1": b"1", "b.1": b"2", "b.2": b"3"}}))
    data = tmp_path / "sc"
    with SidecarProcess(data, nats_server.url, buckets=["demo"]) as sc:
        sc.start()
        assert sc.stop() == 0
    with SidecarProcess(data, nats_server.url, buckets=["demo:a.>"]) as sc:
        sc.start()
        sc.wait_for(lambda: "bucket demo: reconcile removed 2 keys that are gone upstream or outside "
                            "the key filters" in sc.log(), what="the reconcile line")
        assert "vanished" not in sc.log()
        assert sc.stop() == 0


# ---------------------------------------------------------------------- 8: a failed start

def test_missing_bucket_leaves_a_fresh_data_directory_empty(tmp_path, nats_server):
    asyncio.run(make_buckets(nats_server.url, {"demo": {}, "config": {}}))
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    result = run_cli("serve", "--nats", nats_server.url, "--bucket", "Demo", "--data-dir", str(fresh))
    line = one_line_error(result, 1)
    assert result.stderr.strip() == line  # the one line on stderr
    assert line == (f"kvcache: error: bucket 'Demo' does not exist on {nats_server.url} "
                    "(did you mean 'demo'? buckets there: config, demo)")
    assert list(fresh.iterdir()) == []
    # a data directory (and its parent) that did not exist: not there afterwards either
    absent = tmp_path / "new" / "d"
    one_line_error(run_cli("serve", "--nats", nats_server.url, "--bucket", "absent",
                           "--data-dir", str(absent)), 1)
    assert not (tmp_path / "new").exists()


@pytest.mark.servers  # starts a sidecar and its embedded nats-server
def test_missing_bucket_on_the_embedded_server_says_it_is_one(tmp_path):
    data = tmp_path / "d"
    line = one_line_error(run_cli("serve", "--bucket", "config", "--data-dir", str(data)), 1)
    assert re.fullmatch(r"kvcache: error: bucket 'config' does not exist on the embedded nats-server "
                        r"nats://127\.0\.0\.1:\d+ \(it has no KV buckets\): no NATS URL was given "
                        r"\(KVCACHE_NATS_SERVERS / --nats\), so an embedded server was started", line), line
    assert not data.exists()  # nor the embedded server's store, config and log


def test_failed_start_keeps_what_it_found(tmp_path, nats_server):
    """A replica (and lock file, sidecar id) made by an earlier start stays: only what the
    failed start added goes."""
    asyncio.run(make_buckets(nats_server.url, {"config": {"a": b"1"}}))
    data = tmp_path / "sc"
    with SidecarProcess(data, nats_server.url, buckets=["config"]) as sc:
        sc.start()
        assert sc.stop() == 0
    before = sorted(str(p.relative_to(data)) for p in data.rglob("*"))
    assert "replica" in before and "kvcache.lock" in before
    one_line_error(run_cli("serve", "--nats", nats_server.url, "--bucket", "config", "--bucket", "absent",
                           "--data-dir", str(data)), 1)
    assert sorted(str(p.relative_to(data)) for p in data.rglob("*")) == before
    with SidecarProcess(data, nats_server.url, buckets=["config"]) as sc:  # and it still serves
        sc.start()
        with sc.client() as c:
            assert c.get("a") == b"1"
        assert sc.stop() == 0


# ---------------------------------------------------------------------- 9: the socket's mode

# Every kind of socket_mode, and what it must give: refused (exit 2, one line naming the mode),
# warned (one line each at start, the start goes on), or silent. Connecting needs write
# permission on the socket file, and the kernel checks the owner's bits only for the owner.
SAFE = "use 660 (the sidecar's user and group) or 600 (its user only)"
SOCKET_MODES = {
    0o660: [], 0o600: [], 0o620: [], 0o700: [], 0o770: [], 0o760: [],  # the usual, x ignored
    0o400: "refused", 0o444: "refused", 0o000: "refused", 0o555: "refused",  # no one may write
    0o460: "refused", 0o066: "refused", 0o066 | 0o100: "refused",  # others may, the owner not
    0o777: ["world"], 0o666: ["world"], 0o662: ["world"], 0o602: ["world"],
    0o644: ["read-only"], 0o640: ["read-only"], 0o664: ["read-only"], 0o604: ["read-only"],
    0o646: ["world", "read-only"],
}


def _socket_mode_outcome(mode: int) -> str | list[str]:
    try:
        cfg = load(env={}, overrides={"socket_mode": mode})
    except ConfigError as e:
        assert "\n" not in str(e)
        return "refused"
    kinds = []
    for line in start_warnings(cfg):
        assert line.startswith(f"socket_mode {mode:03o}"), line
        kinds.append("world" if "every local user" in line else "read-only")
    return kinds


@pytest.mark.parametrize("mode", sorted(SOCKET_MODES), ids=lambda m: f"{m:03o}")
def test_socket_mode_refused_warned_or_silent(mode):
    assert _socket_mode_outcome(mode) == SOCKET_MODES[mode]


def test_socket_mode_messages():
    def refusal(mode: int) -> str:
        return error_of(env={}, overrides={"socket_mode": mode})

    def warnings(mode: int) -> list[str]:
        return start_warnings(load(env={}, overrides={"socket_mode": mode}))

    assert refusal(0o400) == ("socket_mode 400 lets no one connect: connecting to a Unix socket needs "
                              f"write permission on it, which 400 gives no one; {SAFE}")
    assert refusal(0o460) == (
        "socket_mode 460 shuts out the socket's owner, the user kvcache serve runs as (and its kvcache "
        "health and kvcache cli): connecting to a Unix socket needs write permission, and the owner "
        f"gets only the owner's bits (4), whatever the group's and others' say; {SAFE}")
    assert warnings(0o777) == [
        "socket_mode 777 lets every local user connect (others may write to the socket) and read every "
        "replicated key; 660 (the sidecar's user and group) or 600 (its user only) keeps them out"]
    assert warnings(0o644) == [
        "socket_mode 644: the group and others may read the socket file but not connect (connecting "
        "needs write permission; read does nothing for a socket), so it acts as 600; 660 lets the group "
        "connect"]
    assert warnings(0o664)[0].endswith("others may read the socket file but not connect (connecting needs "
                                       "write permission; read does nothing for a socket), so it acts as "
                                       "660; 660 lets the group connect")
    # the same from a file and the environment (octal strings), where most modes are written
    assert error_of(env={"KVCACHE_SOCKET_MODE": "400"}).startswith("socket_mode 400 lets no one connect")
    with tempfile.TemporaryDirectory() as d:
        assert error_of(path=write(Path(d), 'socket_mode = "0o440"\n'), env={}).startswith(
            "socket_mode 440 lets no one connect")


@pytest.mark.servers  # runs processes as other users
@pytest.mark.skipif(os.geteuid() != 0, reason="connecting as three users needs root to become them")
def test_socket_mode_rule_is_the_kernels(tmp_path):
    """The rule above, checked against the kernel: for each mode, a socket owned by one
    user, connected to by that user, a member of its group and another user. Refused modes
    are those whose owner cannot connect; warned-for world modes those that let the other
    user in; a read-only class connects no more than with no bits at all."""
    import socket

    owner, group_member, other = 65534, 65533, 65532
    group = 65534
    # a directory the three users can reach (pytest's own temporary directories are root's only)
    where = Path(tempfile.mkdtemp(prefix="kvcache-mode-"))
    where.chmod(0o711)
    path = where / "s.sock"

    def connects(uid: int, gid: int) -> bool:
        pid = os.fork()  # (not a new interpreter: this one's files may be closed to that user)
        if pid == 0:
            try:
                os.setgroups([gid])
                os.setgid(gid)
                os.setuid(uid)
                socket.socket(socket.AF_UNIX).connect(str(path))
                os._exit(0)
            except BaseException:
                os._exit(1)
        return os.waitpid(pid, 0)[1] == 0

    rows = []
    for mode, expected in sorted(SOCKET_MODES.items()):
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.bind(str(path))
                s.listen(8)
                os.chown(path, owner, group)
                os.chmod(path, mode)
                who = {"owner": connects(owner, group), "group": connects(group_member, group),
                       "other": connects(other, other)}
        finally:
            path.unlink(missing_ok=True)
        rows.append(f"{mode:03o}: {expected!s:22} " + " ".join(k for k, v in who.items() if v))
        assert (expected == "refused") == (not who["owner"]), (oct(mode), who)
        if expected == "refused":
            continue
        assert ("world" in expected) == who["other"], (oct(mode), who)
        if "read-only" in expected:
            acts = int(next(w for w in start_warnings(load(env={}, overrides={"socket_mode": mode}))
                            if "acts as" in w).split("acts as ")[1][:3], 8)
            assert who["group"] == bool(acts & 0o020) and who["other"] == bool(acts & 0o002), (oct(mode), who)
    where.rmdir()
    print("\n" + "\n".join(rows))


def test_socket_mode_at_start(tmp_path, nats_server):
    """`kvcache serve --socket-mode 400`: exit 2 before anything is made; 777: one warning in
    the log, and the socket has the mode asked for."""
    data = tmp_path / "refused"
    result = run_cli("serve", "--nats", nats_server.url, "--bucket", "sm", "--data-dir", str(data),
                     "--socket-mode", "400")
    assert one_line_error(result, 2).startswith("kvcache: error: socket_mode 400 lets no one connect")
    assert not data.exists()
    asyncio.run(make_buckets(nats_server.url, {"sm": {"a": b"1"}}))
    with SidecarProcess(tmp_path / "sc", nats_server.url, buckets=["sm"], extra=["--socket-mode", "777"]) as sc:
        sc.start()
        warned = [ln for ln in sc.log().splitlines() if "WARNING" in ln and "socket_mode" in ln]
        assert len(warned) == 1, warned
        assert "WARNING kvcache: socket_mode 777 lets every local user connect" in warned[0], warned
        assert Path(sc.socket).stat().st_mode & 0o777 == 0o777
        assert sc.stop() == 0
