"""Configuration: TOML file, then `KVCACHE_*` environment, then flags; later sources win.

Every key of the TOML layout in DESIGN.md is reachable from all three sources, so a container
can be configured with environment variables alone and a developer with flags alone.
Validation happens here, once, so the rest of the code can trust what it gets.
"""
from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from .errors import ConfigError

BUCKET_NAME = re.compile(r"^[a-zA-Z0-9_-]+$")
KEY_TOKEN = re.compile(r"^[-/_=a-zA-Z0-9]+$")
MAX_SOCKET_PATH = 107  # sun_path is 108 bytes including the terminating NUL


@dataclass
class NatsConfig:
    servers: list[str] = field(default_factory=list)
    creds: str | None = None
    nkey: str | None = None  # path to an nkey seed file
    token: str | None = None
    user: str | None = None
    password: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    connect_timeout_s: float = 5.0
    request_timeout_ms: int = 2000


@dataclass
class BucketConfig:
    name: str
    keys: list[str] = field(default_factory=lambda: [">"])
    max_stale_ms: int = 5000
    # Stale replica and no peer answering: serve the replica's last known value (True) or an
    # error (False). None: the top-level `serve_stale` decides (Config.serves_stale).
    serve_stale: bool | None = None


@dataclass
class PeerConfig:
    name: str
    servers: list[str]
    stream: str
    domain: str | None = None


@dataclass
class Config:
    data_dir: str = "./kvcache-data"
    socket: str | None = None  # default: <data_dir>/kvcache.sock
    socket_mode: int = 0o660
    max_clients: int = 10_000
    max_request_bytes: int = 4 * 1024 * 1024
    max_reply_bytes: int = 64 * 1024 * 1024  # one MGET's values, at most (the rest is refused)
    client_write_stall_ms: int = 60_000  # a client reading none of its queued replies this long is cut off; 0 = never
    max_args: int = 65_536
    heartbeat_ms: int = 2000
    map_size_mb: int = 1024
    max_map_size_mb: int = 1024 * 1024
    log_level: str = "info"
    access_log_rate: float = 0.0  # share of reads recorded for `kvcache hotkeys`; 0 = off
    access_log_dir: str | None = None  # default: <data_dir>/access-logs
    access_log_max_bytes: int = 64 * 1024 * 1024  # rotate access.log at this size
    access_log_files: int = 10  # rotated files kept (access.log.1 .. .N)
    discover_peers: bool = False  # add the mirrors each bucket stream lists as `alternates`
    serve_stale: bool = False  # default of [[bucket]] serve_stale (see BucketConfig)
    nats: NatsConfig = field(default_factory=NatsConfig)
    buckets: list[BucketConfig] = field(default_factory=list)
    peers: list[PeerConfig] = field(default_factory=list)

    @property
    def embedded(self) -> bool:
        """No NATS URL anywhere: run our own nats-server."""
        return not self.nats.servers

    @property
    def socket_path(self) -> str:
        return self.socket or os.path.join(self.data_dir, "kvcache.sock")

    @property
    def default_bucket(self) -> str | None:
        return self.buckets[0].name if self.buckets else None

    def bucket(self, name: str) -> BucketConfig | None:
        for b in self.buckets:
            if b.name == name:
                return b
        return None

    def serves_stale(self, b: BucketConfig) -> bool:
        """May a stale replica of this bucket answer when no peer can? Its own setting, else
        the top-level default."""
        return self.serve_stale if b.serve_stale is None else b.serve_stale


# ---------------------------------------------------------------------------- sources

_SCALARS = {f.name: f for f in fields(Config) if f.name not in ("nats", "buckets", "peers")}
_NATS_SCALARS = {f.name: f for f in fields(NatsConfig)}


def load(
    path: str | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Build a validated Config. `overrides` are flag values (None means not given)."""
    env = os.environ if env is None else env
    path = path or env.get("KVCACHE_CONFIG")
    raw: dict[str, Any] = _read_toml(path) if path else {}
    cfg = _from_mapping(raw, where=path or "config")
    _apply_env(cfg, env)
    _apply_overrides(cfg, overrides or {})
    validate(cfg)
    return cfg


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path}: invalid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(f"config file {path}: {e.strerror}") from None


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
    unknown = set(raw) - {"name", "keys", "max_stale_ms", "serve_stale"}
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


def _apply_env(cfg: Config, env: Mapping[str, str]) -> None:
    for name, f in _SCALARS.items():
        var = "KVCACHE_" + name.upper()
        value = env.get(var)
        if value is None:
            continue
        if name == "socket_mode":  # file modes are octal, with or without the 0o
            try:
                cfg.socket_mode = int(value.removeprefix("0o"), 8)
            except ValueError:
                raise ConfigError(f"{var} must be an octal file mode, got '{value}'") from None
        else:
            setattr(cfg, name, _parse_scalar(value, f.type, var))
    for name, f in _NATS_SCALARS.items():
        var = "KVCACHE_NATS_" + name.upper()
        value = env.get(var)
        if value is None:
            continue
        if name == "servers":
            cfg.nats.servers = _split_list(value)
        else:
            setattr(cfg.nats, name, _parse_scalar(value, f.type, var))
    if env.get("KVCACHE_BUCKETS"):
        cfg.buckets = [parse_bucket_spec(s) for s in env["KVCACHE_BUCKETS"].split()]
    if env.get("KVCACHE_MAX_STALE_MS"):
        stale = _parse_scalar(env["KVCACHE_MAX_STALE_MS"], "int", "KVCACHE_MAX_STALE_MS")
        for b in cfg.buckets:
            b.max_stale_ms = stale
    if "KVCACHE_SERVE_STALE" in env:  # parsed into cfg.serve_stale above; like
        for b in cfg.buckets:           # KVCACHE_MAX_STALE_MS, it sets every bucket
            b.serve_stale = cfg.serve_stale


def _apply_overrides(cfg: Config, overrides: Mapping[str, Any]) -> None:
    for key, value in overrides.items():
        if value is None or value == []:
            continue
        if key == "nats_servers":
            cfg.nats.servers = [s for v in value for s in _split_list(v)]
        elif key == "buckets":
            cfg.buckets = [parse_bucket_spec(s) for s in value]
        elif key == "max_stale_ms":
            for b in cfg.buckets:
                b.max_stale_ms = value
        elif key == "serve_stale":  # every bucket; buckets named by a later flag inherit it
            cfg.serve_stale = value
            for b in cfg.buckets:
                b.serve_stale = value
        elif key.startswith("nats_") and key[5:] in _NATS_SCALARS:
            setattr(cfg.nats, key[5:], value)
        elif key in _SCALARS:
            setattr(cfg, key, value)
        else:
            raise ConfigError(f"unknown setting '{key}'")


def parse_bucket_spec(spec: str) -> BucketConfig:
    """`name` or `name:filter,filter` (':' is legal in neither bucket names nor keys)."""
    name, _, filters = spec.partition(":")
    b = BucketConfig(name=name)
    if filters:
        b.keys = [f for f in filters.split(",") if f]
    return b


# ---------------------------------------------------------------------------- validation

def validate(cfg: Config) -> None:
    if not cfg.data_dir:
        raise ConfigError("data_dir must not be empty")
    if len(os.fsencode(os.path.abspath(cfg.socket_path))) > MAX_SOCKET_PATH:
        raise ConfigError(
            f"socket path is too long for a Unix socket ({MAX_SOCKET_PATH} bytes max): {cfg.socket_path}"
        )
    if not 0 <= cfg.socket_mode <= 0o777:
        raise ConfigError(f"socket_mode must be an octal file mode, got {cfg.socket_mode:o}")
    for name in ("max_clients", "max_request_bytes", "max_reply_bytes", "max_args", "heartbeat_ms",
                 "map_size_mb"):
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{name} must be positive, got {getattr(cfg, name)}")
    if cfg.client_write_stall_ms < 0:
        raise ConfigError(f"client_write_stall_ms must be 0 (never) or positive, got {cfg.client_write_stall_ms}")
    if cfg.max_map_size_mb < cfg.map_size_mb:
        raise ConfigError("max_map_size_mb must be at least map_size_mb")
    for url in cfg.nats.servers + [u for p in cfg.peers for u in p.servers]:
        if not re.match(r"^(nats|tls|ws|wss)://[^\s/]+$", url):
            raise ConfigError(f"invalid NATS URL '{url}' (expected nats://host:port)")
    seen: set[str] = set()
    for b in cfg.buckets:
        if not BUCKET_NAME.match(b.name):
            raise ConfigError(f"invalid bucket name '{b.name}' (letters, digits, '-' and '_' only)")
        if b.name in seen:
            raise ConfigError(f"bucket '{b.name}' is configured twice")
        seen.add(b.name)
        if not b.keys:
            raise ConfigError(f"bucket '{b.name}': keys must list at least one filter")
        for f in b.keys:
            if not valid_key_filter(f):
                raise ConfigError(f"bucket '{b.name}': invalid key filter '{f}'")
        if b.max_stale_ms < 0:
            raise ConfigError(f"bucket '{b.name}': max_stale_ms must not be negative")
    if not 0.0 <= cfg.access_log_rate <= 1.0:
        raise ConfigError(f"access_log_rate must be within 0 and 1, got {cfg.access_log_rate}")
    if cfg.access_log_max_bytes <= 0 or cfg.access_log_files < 0:
        raise ConfigError("access_log_max_bytes must be positive and access_log_files not negative")
    if cfg.log_level.lower() not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"log_level must be debug, info, warning or error, got '{cfg.log_level}'")
    peer_names = [p.name for p in cfg.peers]
    if len(set(peer_names)) != len(peer_names):
        raise ConfigError("peer names must be unique")
    if "stale" in peer_names:  # KV.GET's source for a stale replica's answer
        raise ConfigError("peer name 'stale' is reserved")


def valid_key_filter(f: str) -> bool:
    """A NATS subject filter over KV keys: tokens, `*` for one token, `>` last."""
    tokens = f.split(".")
    for i, t in enumerate(tokens):
        if t == ">":
            if i != len(tokens) - 1:
                return False
        elif t != "*" and not KEY_TOKEN.match(t):
            return False
    return True


# ---------------------------------------------------------------------------- helpers

def _set_field(obj: Any, known: dict[str, Any], key: str, value: Any, where: str) -> None:
    f = known.get(key)
    if f is None:
        raise ConfigError(f"{where}: unknown key '{key}'")
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


def ensure_dirs(cfg: Config) -> None:
    """Create the data and socket directories, with a config-style error when we cannot."""
    for d in {cfg.data_dir, os.path.dirname(os.path.abspath(cfg.socket_path))}:
        try:
            Path(d).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot create directory {d}: {e.strerror}") from None
