"""Configuration from TOML, environment and flags; and the CLI's one-line errors."""
from __future__ import annotations

import textwrap

import pytest
from support.sidecar_proc import run_cli

from kvcache.cli import build_parser
from kvcache.config_sources import load, parse_bucket_spec
from kvcache.errors import ConfigError
from kvcache.keys import valid_filter as valid_key_filter

FULL = """
socket = "/tmp/kvc-test.sock"
data_dir = "/tmp/kvc-data"
socket_mode = 0o600
[nats]
servers = ["nats://127.0.0.1:4222", "nats://127.0.0.1:4223"]
token = "s3cret"
[[bucket]]
name = "config"
keys = ["app.>", "feature.*"]
max_stale_ms = 250
[[bucket]]
name = "users"
[[peer]]
name = "west"
servers = ["nats://127.0.0.1:5222"]
stream = "KV_config_west"
domain = "west"
"""


def write(tmp_path, text: str):
    p = tmp_path / "kvcache.toml"
    p.write_text(textwrap.dedent(text))
    return str(p)


def test_toml_file_is_read_completely(tmp_path):
    cfg = load(write(tmp_path, FULL), env={})
    assert cfg.socket_path == "/tmp/kvc-test.sock"
    assert cfg.data_dir == "/tmp/kvc-data"
    assert cfg.socket_mode == 0o600
    assert cfg.nats.servers == ["nats://127.0.0.1:4222", "nats://127.0.0.1:4223"]
    assert cfg.nats.token == "s3cret"
    assert [b.name for b in cfg.buckets] == ["config", "users"]
    assert cfg.buckets[0].keys == ["app.>", "feature.*"] and cfg.buckets[0].max_stale_ms == 250
    assert cfg.buckets[1].keys == [">"] and cfg.buckets[1].max_stale_ms == 5000
    assert cfg.default_bucket == "config"
    assert cfg.peers[0].domain == "west" and cfg.peers[0].stream == "KV_config_west"
    assert not cfg.embedded


def test_defaults_mean_embedded_server_and_socket_in_data_dir():
    cfg = load(None, env={})
    assert cfg.embedded
    assert cfg.socket_path.endswith("kvcache-data/kvcache.sock")


def test_environment_overrides_file_and_flags_override_environment(tmp_path):
    path = write(tmp_path, FULL)
    env = {"KVCACHE_DATA_DIR": "/tmp/from-env", "KVCACHE_NATS_SERVERS": "nats://127.0.0.1:1,nats://127.0.0.1:2",
           "KVCACHE_BUCKETS": "alpha:a.>,b.* beta", "KVCACHE_MAX_CLIENTS": "7",
           "KVCACHE_SOCKET_MODE": "0640"}
    cfg = load(path, env=env)
    assert cfg.data_dir == "/tmp/from-env"
    assert cfg.nats.servers == ["nats://127.0.0.1:1", "nats://127.0.0.1:2"]
    assert [(b.name, b.keys) for b in cfg.buckets] == [("alpha", ["a.>", "b.*"]), ("beta", [">"])]
    assert cfg.max_clients == 7
    assert cfg.socket_mode == 0o640
    cfg = load(path, env=env, overrides={"data_dir": "/tmp/from-flag", "buckets": ["gamma"],
                                         "nats_servers": ["nats://127.0.0.1:3"], "max_stale_ms": 9})
    assert cfg.data_dir == "/tmp/from-flag"
    assert [b.name for b in cfg.buckets] == ["gamma"] and cfg.buckets[0].max_stale_ms == 9
    assert cfg.nats.servers == ["nats://127.0.0.1:3"]


def test_config_file_from_environment(tmp_path):
    cfg = load(None, env={"KVCACHE_CONFIG": write(tmp_path, FULL)})
    assert cfg.default_bucket == "config"


@pytest.mark.parametrize("text, message", [
    ("bogus = 1", "unknown key 'bogus'"),
    ("[nats]\nsrvers = []", "unknown key 'srvers'"),
    ("[[bucket]]\nkeys = ['a']", "needs a name"),
    ("[[bucket]]\nname = 'a b'", "invalid bucket name"),
    ("[[bucket]]\nname = 'a'\nkeys = ['a.>.b']", "invalid key filter"),
    ("[[bucket]]\nname = 'a'\nkeys = ['a*']", "invalid key filter"),
    ("[[bucket]]\nname = 'a'\n[[bucket]]\nname = 'a'", "configured twice"),
    ("[[bucket]]\nname = 'a'\nmax_stale_ms = 'x'", "must be an integer"),
    ("max_clients = 0", "must be positive"),
    ("[nats]\nservers = ['http://x']", "invalid NATS URL"),
    ("socket = '/tmp/" + "x" * 120 + "'", "too long"),
    ("this is not toml", "invalid TOML"),
    ("[[peer]]\nname = 'p'\nservers = ['nats://127.0.0.1:1']", "needs 'stream'"),
    ("log_level = 'loud'", "log_level"),
    ("serve_stale = 1", "serve_stale must be true or false"),
    ("[[bucket]]\nname = 'a'\nserve_stale = 'yes'", "bucket a: serve_stale must be true or false"),
    ("[[peer]]\nname = 'stale'\nservers = ['nats://127.0.0.1:1']\nstream = 'KV_a'", "reserved"),
])
def test_bad_configuration_is_one_clear_error(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load(write(tmp_path, text), env={})


def test_bad_environment_value():
    with pytest.raises(ConfigError, match="KVCACHE_MAX_CLIENTS must be an integer"):
        load(None, env={"KVCACHE_MAX_CLIENTS": "many"})


STALE = """
serve_stale = true
[[bucket]]
name = "inherits"
[[bucket]]
name = "own"
serve_stale = false
"""


def test_serve_stale_per_bucket_with_a_global_default(tmp_path):
    cfg = load(None, env={"KVCACHE_BUCKETS": "a"})
    assert cfg.serve_stale is False and not cfg.serves_stale(cfg.buckets[0])  # off by default
    cfg = load(write(tmp_path, STALE), env={})
    assert [cfg.serves_stale(b) for b in cfg.buckets] == [True, False]
    # like KVCACHE_MAX_STALE_MS / --max-stale-ms: the environment and the flag set every bucket
    cfg = load(write(tmp_path, STALE), env={"KVCACHE_SERVE_STALE": "on"})
    assert [cfg.serves_stale(b) for b in cfg.buckets] == [True, True]
    cfg = load(write(tmp_path, STALE), env={"KVCACHE_SERVE_STALE": "on"},
               overrides={"serve_stale": False})
    assert [cfg.serves_stale(b) for b in cfg.buckets] == [False, False]
    # buckets named by flag or environment take the global value
    cfg = load(write(tmp_path, STALE), env={}, overrides={"buckets": ["x", "y"]})
    assert [cfg.serves_stale(b) for b in cfg.buckets] == [True, True]
    cfg = load(None, env={"KVCACHE_SERVE_STALE": "1"}, overrides={"buckets": ["x"]})
    assert cfg.serves_stale(cfg.buckets[0])
    with pytest.raises(ConfigError, match="KVCACHE_SERVE_STALE must be true or false"):
        load(None, env={"KVCACHE_SERVE_STALE": "maybe"})


@pytest.mark.parametrize("argv, value", [([], None), (["--serve-stale"], True),
                                         (["--no-serve-stale"], False)])
def test_serve_stale_flag(argv, value):
    assert build_parser().parse_args(["serve", *argv]).serve_stale is value


def test_bucket_spec_and_filters():
    assert parse_bucket_spec("cfg").keys == [">"]
    assert parse_bucket_spec("cfg:a.>,b.*.c").keys == ["a.>", "b.*.c"]
    assert valid_key_filter("a.*.c") and valid_key_filter(">") and valid_key_filter("a_b-c/d=e")
    assert not valid_key_filter("a..b") and not valid_key_filter("a.>.b") and not valid_key_filter("")


# ---------------------------------------------------------------------- the CLI's failures

def assert_one_line_error(result, fragment: str, code: int):
    assert result.returncode == code, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("kvcache: error:"), result.stderr
    assert fragment in lines[0], result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.servers  # starts a process
def test_cli_bad_flag():
    assert_one_line_error(run_cli("serve", "--no-such-flag"), "unrecognized arguments", 2)


@pytest.mark.servers  # starts a process
def test_cli_bad_config_file(tmp_path):
    assert_one_line_error(run_cli("serve", "--config", write(tmp_path, "[[bucket]]\nname='x y'")),
                          "invalid bucket name", 2)
    assert_one_line_error(run_cli("serve", "--config", str(tmp_path / "missing.toml")),
                          "config file not found", 2)


@pytest.mark.servers  # starts a process
def test_cli_unreachable_nats(tmp_path):
    from kvcache.natsio.nats_server import free_port
    url = f"nats://127.0.0.1:{free_port()}"
    result = run_cli("serve", "--nats", url, "--bucket", "x", "--data-dir", str(tmp_path / "d"))
    assert_one_line_error(result, "cannot connect to NATS", 1)


def test_cli_missing_bucket(tmp_path, nats_server):
    result = run_cli("serve", "--nats", nats_server.url, "--bucket", "absent",
                     "--data-dir", str(tmp_path / "d"))
    assert_one_line_error(result, f"bucket 'absent' does not exist on {nats_server.url} (it has no KV buckets)", 1)
    assert not (tmp_path / "d").exists()  # what the failed start made is gone (test_config_messages.py)


@pytest.mark.servers  # starts a process
def test_cli_get_without_sidecar(tmp_path):
    result = run_cli("get", "k", "--socket", str(tmp_path / "none.sock"))
    assert_one_line_error(result, "is the sidecar running? (socket " + str(tmp_path / "none.sock"), 1)


def test_every_config_key_has_a_flag() -> None:
    """docs/configuration.md: every key is also settable by flag. Flags reach the same fields as TOML."""
    from kvcache import config_sources
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    dests = {a.dest for a in serve._actions}
    assert set(config_sources._SCALARS) <= dests
    assert {f"nats_{n}" for n in config_sources._NATS_SCALARS} - {"nats_servers"} <= dests
    args = serve.parse_args(["--discover-peers", "--map-size-mb", "64", "--request-timeout-ms", "750"])
    cfg = load(None, env={}, overrides={k: v for k, v in vars(args).items() if k in dests})
    assert cfg.discover_peers is True and cfg.map_size_mb == 64 and cfg.nats.request_timeout_ms == 750


def test_serve_help_names_every_default_and_variable():
    """`kvcache serve --help`: every option says its default and its environment variable, and
    the variable it names is the one config_sources.load reads (same table), with the flag's effect."""
    import re as _re

    from kvcache import config_sources
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    samples = {int: "7", float: "0.5", None: "x"}
    special = {"socket_mode": ("600", "600"), "nats_servers": ("nats://127.0.0.1:9",) * 2,
               "buckets": ("zz", "zz"), "log_level": ("debug", "debug"), "data_dir": ("/tmp/kvc-h",) * 2,
               "socket": ("/tmp/kvc-h.sock",) * 2, "access_log_rate": ("0.5", "0.5")}
    checked = 0
    for action in serve._actions:
        if action.dest in ("help", "config"):
            continue
        assert action.help and "(default: " in action.help, action.option_strings
        m = _re.search(r"; env (KVCACHE_[A-Z_]+)", action.help)
        assert m, action.help
        var = m.group(1)
        assert var == config_sources.env_var(action.dest)
        if isinstance(action, __import__("argparse").BooleanOptionalAction):
            # the flag that changes the default: --no-X for a setting on by default
            on = config_sources.default_of(action.dest) is True
            argv, env_value = [action.option_strings[1 if on else 0]], "false" if on else "true"
        else:
            flag_value, env_value = special.get(action.dest) or (samples.get(action.type, "x"),) * 2
            argv = [action.option_strings[0], flag_value]
        args = serve.parse_args(argv)
        overrides = {k: v for k, v in vars(args).items() if k != "config"}

        def outcome(var=var, dest=action.dest, **kw):
            try:
                return load(None, **kw)
            except ConfigError as e:
                return str(e).replace(var, "X").replace(dest.removeprefix("nats_"), "X")
        from_flag = outcome(env={}, overrides=overrides)
        from_env = outcome(env={var: env_value})
        assert from_flag == from_env, (action.dest, from_flag, from_env)
        assert from_env != load(None, env={}) or action.dest == "max_stale_ms", action.dest
        checked += 1
    assert checked == len(serve._actions) - 2 >= 31  # all but --help and --config (tested above)
    assert "(default: 660; env KVCACHE_SOCKET_MODE)" in " ".join(serve.format_help().split())


@pytest.mark.parametrize("overrides,env,message", [
    ({"listen": "10.0.0.5:6380"}, {}, "is not a loopback address: set listen_non_loopback"),
    ({"listen": "0.0.0.0:6380", "listen_non_loopback": True}, {}, "it needs a password"),
    ({"listen": "127.0.0.1"}, {}, "listen must be host:port"),
    ({"listen": "127.0.0.1:70000"}, {}, "listen must be host:port"),
    ({"requirepass_file": "/nonexistent/pass"}, {}, "requirepass file /nonexistent/pass"),
    ({}, {"KVCACHE_REQUIREPASS": ""}, "KVCACHE_REQUIREPASS is empty"),
    ({"notify_keyspace_events": "Kq"}, {}, "notify_keyspace_events: Invalid event class character"),
    ({"notify_keyspace_events": "Em"}, {}, "notify_keyspace_events: kvcache does not send key-miss"),
    ({"tracking_table_max_keys": 0}, {}, "tracking_table_max_keys must be positive"),
])
def test_listener_password_and_notification_settings_are_checked(overrides, env, message):
    with pytest.raises(ConfigError, match=message):
        load(env=env, overrides=overrides)


def test_password_from_a_file_or_the_environment_never_both(tmp_path):
    f = tmp_path / "pass"
    f.write_text("from-file\n")
    assert load(env={}, overrides={"requirepass_file": str(f)}).requirepass == "from-file"
    assert load(env={"KVCACHE_REQUIREPASS": "from-env"}).requirepass == "from-env"
    with pytest.raises(ConfigError, match="both set"):
        load(env={"KVCACHE_REQUIREPASS": "x"}, overrides={"requirepass_file": str(f)})
    cfg = load(env={"KVCACHE_REQUIREPASS": "from-env"},
               overrides={"listen": "[::1]:0", "listen_non_loopback": False})
    assert cfg.listen_address == ("::1", 0)
    assert "from-env" not in repr(cfg)
    assert load(env={}, overrides={"listen": "0.0.0.0:6380", "listen_non_loopback": True,
                                   "requirepass_file": str(f)}).listen_address == ("0.0.0.0", 6380)
