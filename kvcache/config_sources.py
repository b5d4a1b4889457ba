"""Where the settings come from: a TOML file, then `KVCACHE_*` environment variables, then
flags; later sources win. `load` reads all three into one validated `kvcache.config.Config`.

Every key of the TOML layout (docs/configuration.md) is reachable from all three sources, so a
container can be configured with environment variables alone and a developer with flags alone.
Its own module so the settings themselves (kvcache.config, which every side imports) do not
carry the parsing and coercion of each source; this module imports them, never the reverse.
"""
from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from .config import PASSWORD_ENV, BucketConfig, Config, NatsConfig, PeerConfig, read_setting_file, validate
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
    cfg = Config()
    for key, value in raw.items():
        if key == "nats":
            _expect(value, dict, f"{where}: [nats]")
            for k, v in value.items():
                _set_field(cfg.nats, _NATS_SCALARS, k, v, f"{where}: [nats]")
        elif key == "bucket":
            _expect(value, list, f"{where}: [[bucket]]")
            cfg.buckets = [_bucket_from(b, where) for b in value]
        elif key == "peer":
            _expect(value, list, f"{where}: [[peer]]")
            cfg.peers = [_peer_from(p, where) for p in value]
        else:
            _set_field(cfg, _SCALARS, key, value, where)
    return cfg


def _bucket_from(raw: Any, where: str) -> BucketConfig:
    _expect(raw, dict, f"{where}: [[bucket]]")
    unknown = set(raw) - {"name", "keys", "max_stale_ms", "serve_stale", "cache_max_keys", "cache_max_bytes"}
    if unknown:
        raise ConfigError(f"{where}: unknown key '{sorted(unknown)[0]}' in [[bucket]]")
    if "name" not in raw:
        raise ConfigError(f"{where}: [[bucket]] needs a name")
    b = BucketConfig(name=_typed(raw["name"], str, f"{where}: bucket name"))
    if "keys" in raw:
        b.keys = _str_list(raw["keys"], f"{where}: bucket {b.name}: keys")
    if "max_stale_ms" in raw:
        b.max_stale_ms = _typed(raw["max_stale_ms"], int, f"{where}: bucket {b.name}: max_stale_ms")
    if "serve_stale" in raw:
        b.serve_stale = _coerce(raw["serve_stale"], "bool", f"{where}: bucket {b.name}: serve_stale")
    for bound in ("cache_max_keys", "cache_max_bytes"):
        if bound in raw:
            setattr(b, bound, _typed(raw[bound], int, f"{where}: bucket {b.name}: {bound}"))
    return b


def _peer_from(raw: Any, where: str) -> PeerConfig:
    _expect(raw, dict, f"{where}: [[peer]]")
    unknown = set(raw) - {"name", "servers", "stream", "domain"}
    if unknown:
        raise ConfigError(f"{where}: unknown key '{sorted(unknown)[0]}' in [[peer]]")
    for req in ("name", "servers", "stream"):
        if req not in raw:
            raise ConfigError(f"{where}: [[peer]] needs '{req}'")
    return PeerConfig(
        name=_typed(raw["name"], str, f"{where}: peer name"),
        servers=_str_list(raw["servers"], f"{where}: peer servers"),
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


def _apply_env(cfg: Config, env: Mapping[str, str]) -> None:
    for name, f in _SCALARS.items():
        var = _env_name(name)
        value = env.get(var)
        if value is None:
            continue
        if name == "socket_mode":  # file modes are octal, with or without the 0o
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
    for bound in ("cache_max_keys", "cache_max_bytes"):  # the same: every bucket
        if _env_name(bound) in env:
            for b in cfg.buckets:
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
            # every bucket; buckets named by a later flag inherit it
            setattr(cfg, key, value)
            for b in cfg.buckets:
                setattr(b, key, value)
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
    if key == "servers":
        setattr(obj, key, _str_list(value, f"{where}: servers"))
        return
    setattr(obj, key, _coerce(value, f.type, f"{where}: {key}"))


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


def _expect(value: Any, t: type, what: str) -> None:
    if not isinstance(value, t):
        raise ConfigError(f"{what} must be a {'table' if t is dict else 'list of tables'}")


def _str_list(value: Any, what: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{what} must be a list of strings")
    return list(value)


def _split_list(text: str) -> list[str]:
    return [s for s in re.split(r"[,\s]+", text) if s]
