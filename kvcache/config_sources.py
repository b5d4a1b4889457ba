"""Where the settings come from: a TOML file, then `KVCACHE_*` environment variables, then
flags; later sources win. `load` reads all three into one validated `kvcache.config.Config`.

Every key of the TOML layout (docs/configuration.md) is reachable from all three sources, so a
container can be configured with environment variables alone and a developer with flags alone.
Its own module so the settings themselves (kvcache.config, which every side imports) do not
carry the parsing and coercion of each source; this module imports them, never the reverse.
"""
from __future__ import annotations

import difflib
import json
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from .config import (
    PASSWORD_ENV,
    BucketConfig,
    Config,
    NatsConfig,
    PeerConfig,
    read_setting_file,
    redact_url,
    validate,
)
from .errors import ConfigError

_SCALARS = {f.name: f for f in fields(Config) if f.name not in ("nats", "buckets", "peers", "requirepass")}
_NATS_SCALARS = {f.name: f for f in fields(NatsConfig)}


def load(
    path: str | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Build a validated Config. `overrides` are flag values (None means not given)."""
    env = os.environ if env is None else env
    check_env_names(env)
    path = path or env.get(_env_name("config"))
    raw: dict[str, Any] = _read_toml(path) if path else {}
    cfg = _from_mapping(raw, where=path or "config")
    _apply_env(cfg, env)
    _apply_overrides(cfg, overrides or {})
    _load_password(cfg, env)
    validate(cfg)
    return cfg


def _load_password(cfg: Config, env: Mapping[str, str]) -> None:
    """requirepass from its file or KVCACHE_REQUIREPASS, never both."""
    from_env = env.get(PASSWORD_ENV)
    if cfg.requirepass_file and from_env is not None:
        raise ConfigError(f"requirepass_file and {PASSWORD_ENV} are both set: give the password once")
    if cfg.requirepass_file:
        data = read_setting_file(cfg.requirepass_file, "requirepass")
        text = data.decode("utf-8", "replace").rstrip("\r\n")
        if not text or "\n" in text:
            raise ConfigError(f"requirepass file {cfg.requirepass_file}: expected the password on one line")
        cfg.requirepass = text
    elif from_env is not None:
        if not from_env:
            raise ConfigError(f"{PASSWORD_ENV} is empty")
        cfg.requirepass = from_env


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory") from None
    except OSError as e:
        raise ConfigError(f"config file {path}: {e.strerror}") from None
    if data.startswith((b"\xff\xfe", b"\xfe\xff")) or b"\0" in data:
        raise ConfigError(f"config file {path} is UTF-16 (or binary), not UTF-8 text as TOML must be: "
                          f"convert it, e.g. iconv -f UTF-16 -t UTF-8 {path}")
    try:
        text = data.removeprefix(b"\xef\xbb\xbf").decode()  # a UTF-8 BOM is harmless
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text as TOML must be "
                          f"(byte {e.start}: {data[e.start:e.start + 1]!r})") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path}: invalid TOML: {e}") from None
    _check_socket_mode_literal(text, raw, path)
    return raw


_SOCKET_MODE_LITERAL = re.compile(
    r"""^[ \t]*(?:socket_mode|"socket_mode"|'socket_mode')[ \t]*=[ \t]*([+-]?[0-9][0-9_]*)[ \t]*(?:#.*)?$""",
    re.MULTILINE)


def _check_socket_mode_literal(text: str, raw: dict[str, Any], where: str) -> None:
    """`socket_mode = 660` is the decimal number 660 to TOML (octal 1224), never the file mode
    the user meant: refuse a decimal literal and say how to write one (0o660 or "660")."""
    if not isinstance(raw.get("socket_mode"), int):
        return
    m = _SOCKET_MODE_LITERAL.search(text)
    if m is None or int(m.group(1).replace("_", "")) == 0:
        return
    lit = m.group(1)
    digits = lit if re.fullmatch(r"[0-7]{1,4}", lit) and int(lit, 8) <= 0o777 else "660"
    raise ConfigError(
        f"{where}: socket_mode = {lit} is read by TOML as the decimal number {int(lit.replace('_', ''))}, "
        f"not an octal file mode: write socket_mode = 0o{digits} or socket_mode = \"{digits}\"")


def _octal_mode(value: Any, what: str) -> int:
    """A file mode from a string (`"660"`, `"0660"`, `"0o660"`) or an integer (TOML's 0o660)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip().removeprefix("0o"), 8)
        except ValueError:
            pass
    raise ConfigError(f"{what} must be an octal file mode like 0o660 or \"660\", got {value!r}")


def _from_mapping(raw: dict[str, Any], where: str) -> Config:
    for table, t in (("nats", dict), ("bucket", list), ("peer", list)):
        _expect(raw.get(table, t()), t, f"{where}: {table}", table)
    _check_unknown_keys(raw, where)
    cfg = Config()
    for key, value in raw.items():
        if key == "nats":
            for k, v in value.items():
                _set_field(cfg.nats, _NATS_SCALARS, k, v, f"{where}: [nats]")
        elif key == "bucket":
            cfg.buckets = [_bucket_from(b, where) for b in value]
        elif key == "peer":
            cfg.peers = [_peer_from(p, where) for p in value]
        else:
            _set_field(cfg, _SCALARS, key, value, where)
    return cfg


# The keys of each table (docs/configuration.md), for the unknown-key check.
_TABLES = ("nats", "bucket", "peer")
_BUCKET_KEYS = ("name", "keys", "max_stale_ms", "serve_stale", "cache_max_keys", "cache_max_bytes")
_PEER_KEYS = ("name", "servers", "stream", "domain")


def _check_unknown_keys(raw: dict[str, Any], where: str) -> None:
    """Every key no table has, named at once in one line (not the first only), each with
    where it belongs or its nearest known key: a file with three typos is fixed in one go."""
    top = (*_SCALARS, *_TABLES)
    found = [_unknown(k, "", top) for k in raw if k not in top]
    found += [_unknown(k, "[nats]", tuple(_NATS_SCALARS)) for k in raw.get("nats", {}) if k not in _NATS_SCALARS]
    for table, keys in (("bucket", _BUCKET_KEYS), ("peer", _PEER_KEYS)):
        for i, entry in enumerate(raw.get(table, []), 1):
            if not isinstance(entry, dict):
                continue
            name = entry.get("name")
            label = f"[[{table}]] '{name}'" if isinstance(name, str) else f"[[{table}]] #{i}"
            found += [_unknown(k, label, keys) for k in entry if k not in keys]
    if found:
        raise ConfigError(f"{where}: unknown key{'s' if len(found) > 1 else ''} {'; '.join(found)}")


def _unknown(key: str, table: str, known: tuple[str, ...]) -> str:
    """One unknown key for `_check_unknown_keys`: `'srvers' in [nats] (did you mean 'servers'?)`.
    A key of another table says where it goes: TOML puts every key after a `[table]` header
    into that table, so a top-level key written below one is the usual way to get here."""
    where = f"'{key}'" + (f" in {table}" if table else "")
    homes = [t for t, keys in (("the top level", tuple(_SCALARS)), ("[nats]", tuple(_NATS_SCALARS)),
                               ("[[bucket]]", _BUCKET_KEYS), ("[[peer]]", _PEER_KEYS)) if key in keys]
    if homes:
        if homes[0] == "the top level" and table:
            return (f"{where} (a top-level key: TOML puts the keys after {table.split(' ')[0]} into it; "
                    "move it above the first [table])")
        return f"{where} (a {homes[0]} key)"
    lowered = {k.lower(): k for k in known}
    if key.lower() in lowered:
        return f"{where} (did you mean '{lowered[key.lower()]}'?)"
    # the nearest key of this table or another (this one's on a tie): `srvers` at the top
    # level is `servers` in [nats] rather than `workers`
    best: tuple[float, int, str, str] | None = None
    for rank, (other, keys) in enumerate((("", known), ("[nats]", tuple(_NATS_SCALARS)),
                                          ("[[bucket]]", _BUCKET_KEYS), ("[[peer]]", _PEER_KEYS))):
        if other and other == table.split(" ")[0]:
            continue
        for close in difflib.get_close_matches(key, keys, n=1):
            score = difflib.SequenceMatcher(None, key, close).ratio()
            if best is None or score > best[0]:
                best = (score, rank, close, other)
    if best is None:
        return where
    return f"{where} (did you mean '{best[2]}'" + (f" in {best[3]}?)" if best[3] else "?)")


def _bucket_from(raw: Any, where: str) -> BucketConfig:
    _entry(raw, "bucket", where)
    if "name" not in raw:
        raise ConfigError(f"{where}: [[bucket]] needs a name")
    b = BucketConfig(name=_typed(raw["name"], str, f"{where}: bucket name"))
    if "keys" in raw:
        b.keys = _str_list(raw["keys"], f"{where}: bucket {b.name}: keys", "keys")
    if "max_stale_ms" in raw:
        b.max_stale_ms = _typed(raw["max_stale_ms"], int, f"{where}: bucket {b.name}: max_stale_ms")
    if "serve_stale" in raw:
        b.serve_stale = _coerce(raw["serve_stale"], "bool", f"{where}: bucket {b.name}: serve_stale")
    for bound in ("cache_max_keys", "cache_max_bytes"):
        if bound in raw:
            setattr(b, bound, _typed(raw[bound], int, f"{where}: bucket {b.name}: {bound}"))
    return b


def _peer_from(raw: Any, where: str) -> PeerConfig:
    _entry(raw, "peer", where)
    for req in ("name", "servers", "stream"):
        if req not in raw:
            raise ConfigError(f"{where}: [[peer]] needs '{req}'")
    return PeerConfig(
        name=_typed(raw["name"], str, f"{where}: peer name"),
        servers=_str_list(raw["servers"], f"{where}: peer servers", "servers"),
        stream=_typed(raw["stream"], str, f"{where}: peer stream"),
        domain=_typed(raw["domain"], str, f"{where}: peer domain") if "domain" in raw else None,
    )


ENV_PREFIX = "KVCACHE_"
# Settings that are not fields of Config or NatsConfig but have a flag and a variable.
_ENV_EXTRA = ("config", "buckets", "max_stale_ms")


def env_var(setting: str) -> str | None:
    """The environment variable of a setting, named as its flag's dest: a Config field
    (`max_clients`), `nats_` + a NatsConfig field (`nats_creds`), or `config`, `buckets`,
    `max_stale_ms`. None: no variable. The one table for `_apply_env` and `--help`."""
    if setting in _SCALARS or setting in _ENV_EXTRA:
        return ENV_PREFIX + setting.upper()
    if setting.startswith("nats_") and setting[5:] in _NATS_SCALARS:
        return ENV_PREFIX + setting.upper()
    return None


def default_of(setting: str) -> Any:
    """A setting's default, named as in `env_var` (None: none, or computed at run time)."""
    if setting in _SCALARS:
        return getattr(Config(), setting)
    if setting.startswith("nats_") and setting[5:] in _NATS_SCALARS:
        return getattr(NatsConfig(), setting[5:])
    if setting == "max_stale_ms":
        return BucketConfig(name="").max_stale_ms
    return None


def _env_name(setting: str) -> str:
    """env_var for a setting known to have one."""
    var = env_var(setting)
    assert var is not None, setting
    return var


# The KVCACHE_* variables that are not settings, read by what the comment says: `load` lets
# them be. The one list of them (tests/test_config_messages.py checks the repository reads no
# other); a variable in neither this list nor the settings' is refused as a typo.
OTHER_ENV: dict[str, str] = {
    "KVCACHE_NO_EXTENSIONS": "kvcache/native.py: the pure-Python twins serve",
    "KVCACHE_REQUIRE_EXTENSIONS": "kvcache/native.py: a missing native module is an error (CI)",
    "KVCACHE_PURE_PYTHON": "setup.py: install without the native modules",
    "KVCACHE_DEBUG_BUILD": "setup.py: build the native modules with assertions (make debug)",
    "KVCACHE_LMDB_SRC": "setup.py: LMDB's C sources for an offline build",
    "KVCACHE_REBUILD": "setup.py: compile every native module again",
    "KVCACHE_FAULT_TABLE": "tests/conftest.py: where the fault tests' table is written",
    "KVCACHE_LIFECYCLE_REPEAT": "tests/test_lifecycle.py: repeats of the shutdown test",
    "KVCACHE_GUARANTEES_TABLE": "tests/test_guarantees.py: where the guarantee table is written",
    "KVCACHE_FUZZ_NATIVE": "tests/fuzz/harness.py: the sanitized native modules a fuzz run loads",
}
# What a flag's name or a [nats] key's name turns into by mistake, and the variable meant.
_ENV_ALIASES = {"NATS": "NATS_SERVERS", "NATS_URL": "NATS_SERVERS", "NATS_URLS": "NATS_SERVERS",
                "NATS_SERVER": "NATS_SERVERS", "SERVERS": "NATS_SERVERS", "BUCKET": "BUCKETS"}


def known_env() -> set[str]:
    """Every KVCACHE_* variable kvcache reads: the settings' (env_var), the password's and OTHER_ENV."""
    names = {env_var(s) for s in (*_SCALARS, *_ENV_EXTRA, *(f"nats_{n}" for n in _NATS_SCALARS))}
    return {n for n in names if n} | {PASSWORD_ENV} | set(OTHER_ENV)


# Kubernetes puts a service link in every container of a namespace for each Service there: a
# Service `kvcache` (or `kvcache-metrics`) gives KVCACHE_SERVICE_HOST, KVCACHE_PORT,
# KVCACHE_PORT_9464_TCP_ADDR, KVCACHE_METRICS_SERVICE_PORT_HTTP... These are not typos.
_SERVICE_LINK = re.compile(r"KVCACHE(_[A-Z0-9_]+)?_(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?"
                           r"|PORT(_\d+_(TCP|UDP|SCTP)(_(PROTO|PORT|ADDR))?)?)")


def check_env_names(env: Mapping[str, str]) -> None:
    """Refuse a KVCACHE_* variable kvcache does not read: a typo (`KVCACHE_NATS_SERVER`) would
    otherwise be ignored, and with no NATS URL left an embedded server starts in its place.
    All of them in one line, each with the variable it most likely meant. Kubernetes' service
    links (`_SERVICE_LINK`) are let be."""
    known = known_env()
    unknown = sorted(n for n in env if n.upper().startswith(ENV_PREFIX) and n not in known
                     and not _SERVICE_LINK.fullmatch(n))
    if not unknown:
        return
    named = []
    for name in unknown:
        meant = _env_meant(name, known)
        named.append(f"{name} (did you mean {meant}?)" if meant else name)
    many = len(named) > 1
    raise ConfigError(f"unknown environment variable{'s' if many else ''} {', '.join(named)}: "
                      "no kvcache setting has that name (`kvcache serve --help` names each one's); "
                      f"rename or unset {'them' if many else 'it'}")


def _env_meant(name: str, known: set[str]) -> str | None:
    """The variable an unknown KVCACHE_* name most likely meant: the same in capitals, a flag's
    name (`--nats`: KVCACHE_NATS), a [nats] key without its `NATS_`, else the nearest name."""
    upper = name.upper()
    if upper in known:
        return upper
    tail = upper[len(ENV_PREFIX):]
    for guess in (_ENV_ALIASES.get(tail), "NATS_" + tail):
        if guess and ENV_PREFIX + guess in known:
            return ENV_PREFIX + guess
    tails = sorted(k[len(ENV_PREFIX):] for k in known)
    close = difflib.get_close_matches(tail, tails, n=1)
    return ENV_PREFIX + close[0] if close else None


def _apply_env(cfg: Config, env: Mapping[str, str]) -> None:
    for name, f in _SCALARS.items():
        var = _env_name(name)
        value = env.get(var)
        if value is None:
            continue
        if name == "workers":  # a count or "auto"
            cfg.workers = workers_count(value, var)
        elif name == "socket_mode":  # file modes are octal, with or without the 0o
            try:
                cfg.socket_mode = int(value.removeprefix("0o"), 8)
            except ValueError:
                raise ConfigError(f"{var} must be an octal file mode, got '{value}'") from None
        else:
            setattr(cfg, name, _parse_scalar(value, str(f.type), var))
    for name, f in _NATS_SCALARS.items():
        var = _env_name("nats_" + name)
        value = env.get(var)
        if value is None:
            continue
        if name == "servers":
            cfg.nats.servers = _split_list(value)
        else:
            setattr(cfg.nats, name, _parse_scalar(value, str(f.type), var))
    if env.get(var := _env_name("buckets")):
        cfg.buckets = [parse_bucket_spec(s) for s in env[var].split()]
    if env.get(var := _env_name("max_stale_ms")):
        stale = _parse_scalar(env[var], "int", var)
        if stale < 0:
            raise ConfigError(f"{var} must not be negative, got {stale}")
        for b in cfg.buckets:
            b.max_stale_ms = stale
    if _env_name("serve_stale") in env:  # parsed into cfg.serve_stale above; like
        for b in cfg.buckets:           # KVCACHE_MAX_STALE_MS, it sets every bucket
            b.serve_stale = cfg.serve_stale
    for bound in ("cache_max_keys", "cache_max_bytes"):  # the same: every bucket with filters
        if _env_name(bound) in env:          # (one replicating every key has nothing to cache)
            for b in cfg.buckets:
                if ">" not in b.keys:
                    setattr(b, bound, getattr(cfg, bound))


def _apply_overrides(cfg: Config, overrides: Mapping[str, Any]) -> None:
    for key, value in overrides.items():
        if value is None or value == []:
            continue
        if key == "nats_servers":
            cfg.nats.servers = [s for v in value for s in _split_list(v)]
        elif key == "buckets":
            cfg.buckets = [parse_bucket_spec(s) for s in value]
        elif key == "max_stale_ms":
            if value < 0:  # checked here too: with no bucket yet (the demo) nothing else sees it
                raise ConfigError(f"max_stale_ms must not be negative, got {value}")
            for b in cfg.buckets:
                b.max_stale_ms = value
        elif key in ("serve_stale", "cache_max_keys", "cache_max_bytes"):
            # every bucket (the near cache's bounds: every bucket with key filters, see
            # Config.cache_bounds); buckets named by a later flag inherit it
            setattr(cfg, key, value)
            for b in cfg.buckets:
                if key == "serve_stale" or ">" not in b.keys:
                    setattr(b, key, value)
        elif key == "workers":
            cfg.workers = workers_count(value, "workers")
        elif key.startswith("nats_") and key[5:] in _NATS_SCALARS:
            setattr(cfg.nats, key[5:], value)
        elif key in _SCALARS:
            setattr(cfg, key, value)
        else:
            raise ConfigError(f"unknown setting '{key}'")


def parse_bucket_spec(spec: str) -> BucketConfig:
    """`name`, `name:filter,filter`, or `name:` for no replicated key (a bucket served by its
    near cache only). ':' is legal in neither bucket names nor keys."""
    name, colon, filters = spec.partition(":")
    b = BucketConfig(name=name)
    if colon:
        b.keys = [f for f in filters.split(",") if f]
    return b


# ---------------------------------------------------------------------------- helpers

def _set_field(obj: Any, known: dict[str, Any], key: str, value: Any, where: str) -> None:
    f = known.get(key)
    if f is None:
        raise ConfigError(f"{where}: unknown key '{key}'")
    if key == "socket_mode" and known is _SCALARS:
        obj.socket_mode = _octal_mode(value, f"{where}: socket_mode")
        return
    if key == "workers" and known is _SCALARS:
        obj.workers = workers_count(value, f"{where}: workers")
        return
    if key == "servers":
        setattr(obj, key, _str_list(value, f"{where}: servers", "servers"))
        return
    setattr(obj, key, _coerce(value, f.type, f"{where}: {key}"))


def workers_count(value: Any, what: str) -> int:
    """`workers`: a positive count, or "auto": the cores this process may run on."""
    if value == "auto":
        return len(os.sched_getaffinity(0))
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            raise ConfigError(f"{what} must be a number of processes or auto, got '{value}'") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{what} must be a number of processes (1 or more) or auto, got {value!r}")
    return value


def _coerce(value: Any, type_name: str, what: str) -> Any:
    base = type_name.split("|")[0].strip()
    if base == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{what} must be true or false, got {value!r}")
        return value
    if base == "int":
        return _typed(value, int, what)
    if base == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{what} must be a number, got {value!r}")
        return float(value)
    return _typed(value, str, what)


def _parse_scalar(text: str, type_name: str, what: str) -> Any:
    base = type_name.split("|")[0].strip()
    if base == "bool":
        if text.lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
            raise ConfigError(f"{what} must be true or false, got '{text}'")
        return text.lower() in ("1", "true", "yes", "on")
    try:
        if base == "int":
            return int(text)
        if base == "float":
            return float(text)
    except ValueError:
        raise ConfigError(f"{what} must be {_A.get(base, base)}, got '{text}'") from None
    return text


_A = {int: "an integer", str: "a string", "int": "an integer", "float": "a number"}


def _typed(value: Any, t: type, what: str) -> Any:
    if isinstance(value, bool) or not isinstance(value, t):
        raise ConfigError(f"{what} must be {_A[t]}, got {value!r}")
    return value


def _expect(value: Any, t: type, what: str, table: str) -> None:
    """A table (`[nats]`) or an array of tables (`[[bucket]]`); the brackets mixed up are
    the usual way to get the other, so the message says how many to write."""
    if isinstance(value, t):
        return
    if t is dict:
        raise ConfigError(f"{what} must be a table: write [{table}] (one pair of brackets), once")
    if isinstance(value, dict):
        raise ConfigError(f"{what} must be an array of tables: write [[{table}]] (two pairs of "
                          f"brackets), once per {table}")
    raise ConfigError(f"{what} must be an array of tables: write a [[{table}]] section per {table}")


def _entry(raw: Any, table: str, where: str) -> None:
    """One entry of an array of tables (`bucket = ["config"]` is not one)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: each {table} must be a table: write a [[{table}]] section per "
                          f"{table}, with its keys below it (got {table} = [{json.dumps(raw)}, ...])")


def _str_list(value: Any, what: str, key: str) -> list[str]:
    """A TOML list of strings. A bare string is refused, not taken as a list of one: `servers =
    "nats://a,nats://b"` would be one URL, and the message shows the list to write instead."""
    if isinstance(value, str):
        items = _split_list(value) or [value]
        shown = redact_url if key == "servers" else str
        listed = ", ".join(json.dumps(shown(v)) for v in items)
        raise ConfigError(f"{what} must be a list, got the string {json.dumps(shown(value))}: "
                          f"write {key} = [{listed}]")
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{what} must be a list of strings, like {key} = [\"{_EXAMPLE.get(key, 'x')}\"]")
    return list(value)


_EXAMPLE = {"servers": "nats://127.0.0.1:4222", "keys": "feature.>"}


def _split_list(text: str) -> list[str]:
    return [s for s in re.split(r"[,\s]+", text) if s]
