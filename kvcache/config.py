"""Configuration: TOML file, then `KVCACHE_*` environment, then flags; later sources win.

Every key of the TOML layout (docs/configuration.md) is reachable from all three sources, so a container
can be configured with environment variables alone and a developer with flags alone.
Validation happens here, once, so the rest of the code can trust what it gets.
"""
from __future__ import annotations

import base64
import json
import os
import re
import ssl
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .errors import CommandError, ConfigError
from .keys import FilterSet, valid_filter
from .serve.keyspace_events import parse_flags

BUCKET_NAME = re.compile(r"^[a-zA-Z0-9_-]+$")
MAX_SOCKET_PATH = 107  # sun_path is 108 bytes including the terminating NUL


@dataclass
class NatsConfig:
    """The `[nats]` table: servers and how to authenticate to them (docs/configuration.md)."""

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
    """One `[[bucket]]`: a KV bucket to replicate, which keys, and how stale it may be served."""

    name: str
    keys: list[str] = field(default_factory=lambda: [">"])
    max_stale_ms: int = 5000
    # Stale replica and no peer answering: serve the replica's last known value (True) or an
    # error (False). None: the top-level `serve_stale` decides (Config.serves_stale).
    serve_stale: bool | None = None
    # The near cache of keys outside `keys` (kvcache.store.nearcache): bounds in keys and bytes, 0 for
    # no bound of that kind, both 0 for no cache. None: the top-level setting (Config.cache_bounds).
    cache_max_keys: int | None = None
    cache_max_bytes: int | None = None
    # (the `keys` list compiled, its FilterSet): replicates() builds it on first use
    _compiled: tuple[list[str], FilterSet] | None = field(default=None, init=False, repr=False, compare=False)

    def replicates(self, key: str) -> bool:
        """Is the key inside the bucket's filters (kept in the replica, not read from NATS
        or the near cache)? The one rule the feed and the read policy both apply. The filters
        are compiled once (kvcache.keys.FilterSet), again only if `keys` is replaced."""
        compiled = self._compiled
        if compiled is None or compiled[0] is not self.keys or len(compiled[1].filters) != len(self.keys):
            compiled = self._compiled = (self.keys, FilterSet(self.keys))
        return compiled[1].match(key)


@dataclass
class PeerConfig:
    """One `[[peer]]`: another place (connection, stream, domain) fallback reads may go to."""

    name: str
    servers: list[str]
    stream: str
    domain: str | None = None


@dataclass
class Config:
    """The sidecar's whole configuration, validated once by `load` (TOML, environment, flags)."""

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
    log_format: str = "text"  # or "json": one object per line (kvcache.ops.logformat)
    access_log_rate: float = 0.0  # share of reads recorded for `kvcache hotkeys`; 0 = off
    access_log_dir: str | None = None  # default: <data_dir>/access-logs
    access_log_max_bytes: int = 64 * 1024 * 1024  # rotate access.log at this size
    access_log_files: int = 10  # rotated files kept (access.log.1 .. .N)
    discover_peers: bool = False  # add the mirrors each bucket stream lists as `alternates`
    serve_stale: bool = False  # default of [[bucket]] serve_stale (see BucketConfig)
    cache_max_keys: int = 0  # default of [[bucket]] cache_max_keys: the near cache (store/nearcache.py)
    cache_max_bytes: int = 0  # default of [[bucket]] cache_max_bytes
    cache_admission: str = "frequency"  # near caches admit by read frequency, or "lru": every answer
    listen: str = ""  # a loopback TCP listener, "127.0.0.1:6380"; "" = none (the Unix socket only)
    listen_non_loopback: bool = False  # the second setting `listen` needs for any other address
    requirepass_file: str | None = None  # the password TCP clients must AUTH with (or KVCACHE_REQUIREPASS)
    metrics_listen: str = ""  # Prometheus /metrics, /healthz, /readyz over HTTP, "127.0.0.1:9464"; "" = off
    metrics_non_loopback: bool = False  # the second setting metrics_listen needs for any other address
    ready_on_fallback: bool = False  # a bucket syncing or past max_stale_ms is ready while NATS answers
    compat_identity: bool = False  # HELLO says server "redis", version REDIS_VERSION (client caches check it)
    notify_keyspace_events: str = "KEA"  # Redis's flags; "" = no keyspace notifications
    tracking_table_max_keys: int = 1_000_000  # keys remembered for tracking clients (Redis's default)
    pubsub_max_output_bytes: int = 32 * 1024 * 1024  # a subscriber with more pending output is cut off
    # The embedded nats-server's client port (no NATS URL given); 0 = a free port each start.
    # --embedded-port, KVCACHE_EMBEDDED_PORT.
    embedded_port: int = 0
    nats: NatsConfig = field(default_factory=NatsConfig)
    buckets: list[BucketConfig] = field(default_factory=list)
    peers: list[PeerConfig] = field(default_factory=list)
    # The password itself: from requirepass_file or KVCACHE_REQUIREPASS only (never a flag,
    # never a TOML key, never shown: not in repr, INFO or logs).
    requirepass: str | None = field(default=None, repr=False)

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """`metrics_listen` as (host, port), None when off (validated by `validate`)."""
        return _host_port(self.metrics_listen, "metrics_listen") if self.metrics_listen else None

    @property
    def listen_address(self) -> tuple[str, int] | None:
        """`listen` as (host, port), None when off (validated by `validate`)."""
        if not self.listen:
            return None
        return _host_port(self.listen)

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

    def cache_bounds(self, b: BucketConfig) -> tuple[int, int]:
        """(max keys, max bytes) of a bucket's near cache; (0, 0): none."""
        return (self.cache_max_keys if b.cache_max_keys is None else b.cache_max_keys,
                self.cache_max_bytes if b.cache_max_bytes is None else b.cache_max_bytes)

    def serves_stale(self, b: BucketConfig) -> bool:
        """May a stale replica of this bucket answer when no peer can? Its own setting, else
        the top-level default."""
        return self.serve_stale if b.serve_stale is None else b.serve_stale


# ---------------------------------------------------------------------------- sources

_SCALARS = {f.name: f for f in fields(Config) if f.name not in ("nats", "buckets", "peers", "requirepass")}
PASSWORD_ENV = "KVCACHE_REQUIREPASS"
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
        data = _read_setting_file(cfg.requirepass_file, "requirepass")
        text = data.decode("utf-8", "replace").rstrip("\r\n")
        if not text or "\n" in text:
            raise ConfigError(f"requirepass file {cfg.requirepass_file}: expected the password on one line")
        cfg.requirepass = text
    elif from_env is not None:
        if not from_env:
            raise ConfigError(f"{PASSWORD_ENV} is empty")
        cfg.requirepass = from_env


def _host_port(text: str, setting: str = "listen") -> tuple[str, int]:
    """`host:port` or `[v6]:port`."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536 or not host:  # 0: any free port
        example = "127.0.0.1:9464" if setting == "metrics_listen" else "127.0.0.1:6380"
        raise ConfigError(f"{setting} must be host:port (like {example}), got '{text}'")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def _loopback(host: str) -> bool:
    import ipaddress
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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


# ---------------------------------------------------------------------------- validation

def validate(cfg: Config) -> None:
    if not cfg.data_dir:
        raise ConfigError("data_dir must not be empty")
    if len(os.fsencode(os.path.abspath(cfg.socket_path))) > MAX_SOCKET_PATH:
        raise ConfigError(
            f"socket path is too long for a Unix socket ({MAX_SOCKET_PATH} bytes max): {cfg.socket_path}"
        )
    if not 0 <= cfg.embedded_port < 65536:
        raise ConfigError(f"embedded_port must be a TCP port (1-65535, or 0 for a free one), got {cfg.embedded_port}")
    if not 0 <= cfg.socket_mode <= 0o777:
        raise ConfigError(f"socket_mode must be an octal file mode, got {cfg.socket_mode:o}")
    for name in ("max_clients", "max_request_bytes", "max_reply_bytes", "max_args", "heartbeat_ms",
                 "map_size_mb"):
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{name} must be positive, got {getattr(cfg, name)}")
    if cfg.nats.connect_timeout_s <= 0 or cfg.nats.request_timeout_ms <= 0:
        raise ConfigError("connect_timeout_s and request_timeout_ms must be positive, got "
                          f"{cfg.nats.connect_timeout_s:g} and {cfg.nats.request_timeout_ms}")
    if cfg.client_write_stall_ms < 0:
        raise ConfigError(f"client_write_stall_ms must be 0 (never) or positive, got {cfg.client_write_stall_ms}")
    if cfg.max_map_size_mb < cfg.map_size_mb:
        raise ConfigError("max_map_size_mb must be at least map_size_mb")
    for url in cfg.nats.servers + [u for p in cfg.peers for u in p.servers]:
        if not re.match(r"^(nats|tls|ws|wss)://[^\s/]+$", url):
            raise ConfigError(f"invalid NATS URL '{redact_url(url)}' (expected nats://host:port)")
    seen: set[str] = set()
    for b in cfg.buckets:
        if not BUCKET_NAME.match(b.name):
            raise ConfigError(f"invalid bucket name '{b.name}' (letters, digits, '-' and '_' only)")
        if b.name in seen:
            raise ConfigError(f"bucket '{b.name}' is configured twice")
        seen.add(b.name)
        max_keys, max_bytes = cfg.cache_bounds(b)
        if max_keys < 0 or max_bytes < 0:
            raise ConfigError(f"bucket '{b.name}': cache_max_keys and cache_max_bytes must not be negative")
        if not b.keys and not (max_keys or max_bytes):
            raise ConfigError(f"bucket '{b.name}': keys is empty and it has no near cache "
                              "(cache_max_keys, cache_max_bytes): nothing would be served locally")
        if ">" in b.keys and (b.cache_max_keys or b.cache_max_bytes):
            raise ConfigError(f"bucket '{b.name}' replicates every key: its near cache would hold nothing")
        for f in b.keys:
            if not valid_filter(f):
                raise ConfigError(f"bucket '{b.name}': invalid key filter '{f}'")
        if b.max_stale_ms < 0:
            raise ConfigError(f"bucket '{b.name}': max_stale_ms must not be negative")
    if not 0.0 <= cfg.access_log_rate <= 1.0:
        raise ConfigError(f"access_log_rate must be within 0 and 1, got {cfg.access_log_rate}")
    if cfg.access_log_max_bytes <= 0 or cfg.access_log_files < 0:
        raise ConfigError("access_log_max_bytes must be positive and access_log_files not negative")
    if cfg.log_format not in ("text", "json"):
        raise ConfigError(f"log_format must be text or json, got '{cfg.log_format}'")
    if cfg.log_level.lower() not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"log_level must be debug, info, warning or error, got '{cfg.log_level}'")
    if cfg.listen:
        host, _ = _host_port(cfg.listen)
        if not _loopback(host):
            if not cfg.listen_non_loopback:
                raise ConfigError(f"listen = {cfg.listen} is not a loopback address: set "
                                  "listen_non_loopback = true as well to bind it")
            if not cfg.requirepass:
                raise ConfigError(f"listen = {cfg.listen} is not a loopback address: it needs a "
                                  f"password (requirepass_file or {PASSWORD_ENV})")
    if cfg.metrics_listen:
        host, _ = _host_port(cfg.metrics_listen, "metrics_listen")
        if not _loopback(host) and not cfg.metrics_non_loopback:
            raise ConfigError(f"metrics_listen = {cfg.metrics_listen} is not a loopback address: set "
                              "metrics_non_loopback = true as well to bind it")
    if cfg.cache_admission not in ("frequency", "lru"):
        raise ConfigError(f"cache_admission must be frequency or lru, got '{cfg.cache_admission}'")
    for name in ("tracking_table_max_keys", "pubsub_max_output_bytes"):
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{name} must be positive, got {getattr(cfg, name)}")
    try:
        parse_flags(cfg.notify_keyspace_events)
    except CommandError as e:
        raise ConfigError(f"notify_keyspace_events: {str(e).removeprefix('ERR ')}") from None
    peer_names = [p.name for p in cfg.peers]
    if len(set(peer_names)) != len(peer_names):
        raise ConfigError("peer names must be unique")
    if "stale" in peer_names:  # KV.GET's source for a stale replica's answer
        raise ConfigError("peer name 'stale' is reserved")



# ---------------------------------------------------------------------------- NATS auth and TLS

def validate_nats_auth(cfg: Config) -> None:
    """Credentials and TLS files, checked before anything connects: a missing, unreadable or
    malformed file is one line naming the setting and the file, never what the file holds.
    Only `serve` connects to NATS, so only it calls this: `kvcache get`/`info` with the same
    config file must not need the credentials."""
    n = cfg.nats
    if n.creds and n.nkey:
        raise ConfigError("creds and nkey are exclusive: a creds file holds the user's nkey seed already")
    if n.token and (n.user or n.password):
        raise ConfigError("token and user/password are exclusive")
    if n.password and not n.user:
        raise ConfigError("password needs user")
    if n.user and not n.password:
        raise ConfigError("user needs password")
    others = n.creds or n.nkey or n.token or n.user
    for servers in [n.servers] + [p.servers for p in cfg.peers]:
        in_urls = {url_auth(u) for u in servers} - {(None, None)}
        if len(in_urls) > 1:
            raise ConfigError(f"the NATS URLs {', '.join(map(redact_url, servers))} carry different credentials")
        if in_urls and others:  # nats-py would ignore the URL's
            url = next(u for u in servers if url_auth(u) != (None, None))
            raise ConfigError(f"the NATS URL {redact_url(url)} carries credentials and "
                              "creds, nkey, token or user is set too: give them once")
    if n.creds:
        check_creds_file(n.creds)
    if n.nkey:
        check_nkey_file(n.nkey)
    tls_context(n)


def url_auth(url: str) -> tuple[str | None, str | None]:
    """The user (or token) and password a `nats://user:pass@host` URL carries, as nats-py
    reads them (no unquoting)."""
    userinfo, at, _ = url.partition("://")[2].rpartition("@")
    if not at:
        return None, None
    user, colon, password = userinfo.partition(":")
    return user, (password if colon else None)


def strip_url_auth(url: str) -> str:
    """The URL without its credentials: what connections, logs and INFO show."""
    scheme, sep, rest = url.partition("://")
    return scheme + sep + rest.rpartition("@")[2]


def redact_url(url: str) -> str:
    """For messages: the credentials of a URL replaced by `***`."""
    stripped = strip_url_auth(url)
    if stripped == url:
        return url
    scheme, sep, rest = stripped.partition("://")
    return f"{scheme}{sep}***@{rest}"


def _read_setting_file(path: str, what: str, limit: int = 1 << 20) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError as e:
        raise ConfigError(f"{what} file {path}: {e.strerror}") from None


_JWT = re.compile(rb"^[A-Za-z0-9_-]+\.([A-Za-z0-9_-]+)\.[A-Za-z0-9_-]+$")


def _block_line(data: bytes, marker: bytes) -> bytes | None:
    """The line after the one holding `marker`, as nats-py reads a creds file."""
    lines = data.split(b"\n")
    for i, line in enumerate(lines[:-1]):
        if marker in line:
            return lines[i + 1]
    return None


def _user_seed(seed: bytes) -> str | None:
    """Why `seed` is not a user nkey seed, or None when it is."""
    import nkeys

    try:
        kp = nkeys.from_seed(bytearray(seed))
        kind = kp.public_key[:1]
        kp.wipe()
    except Exception:  # nkeys raises its own errors, binascii's and ValueError
        return "not an nkey seed"
    if kind != b"U":
        return "not a user nkey seed (a user seed starts with SU)"
    return None


def check_creds_file(path: str) -> None:
    """A creds file as nats-py reads it: the line after `BEGIN NATS USER JWT` is a JWT, the
    line after `BEGIN USER NKEY SEED` a user seed. (nats-py itself loops forever on a file
    with no JWT block.)"""
    data = _read_setting_file(path, "creds")
    jwt = _block_line(data, b"BEGIN NATS USER JWT")
    if jwt is None:
        raise ConfigError(f"creds file {path}: no user JWT in it (expected a -----BEGIN NATS USER JWT----- block)")
    m = _JWT.match(jwt)
    try:
        claims = json.loads(base64.urlsafe_b64decode(m.group(1) + b"=" * (-len(m.group(1)) % 4))) if m else None
    except ValueError:
        claims = None
    if not isinstance(claims, dict) or (claims.get("nats") or {}).get("type", "user") != "user":
        raise ConfigError(f"creds file {path}: its user JWT is malformed")
    seed = _block_line(data, b"BEGIN USER NKEY SEED")
    if seed is None:
        raise ConfigError(f"creds file {path}: no user nkey seed in it "
                          "(expected a -----BEGIN USER NKEY SEED----- block)")
    why = _user_seed(seed.strip())
    if why:
        raise ConfigError(f"creds file {path}: its seed is {why}")


def check_nkey_file(path: str) -> None:
    data = _read_setting_file(path, "nkey")
    why = _user_seed(data.strip())
    if why:
        hint = " (a creds file goes to creds, --creds)" if b"BEGIN NATS USER JWT" in data else ""
        raise ConfigError(f"nkey file {path}: {why}{hint}")


def tls_context(n: NatsConfig) -> ssl.SSLContext | None:
    """The client TLS context tls_ca / tls_cert / tls_key ask for (None: nats-py's own, for
    tls:// URLs and servers that require TLS); every file problem is a ConfigError."""
    if not (n.tls_ca or n.tls_cert or n.tls_key):
        return None
    if n.tls_key and not n.tls_cert:
        raise ConfigError("tls_key needs tls_cert (the client certificate the key belongs to)")
    for what, path in (("tls_ca", n.tls_ca), ("tls_cert", n.tls_cert), ("tls_key", n.tls_key)):
        if path:
            _read_setting_file(path, what, limit=1)
    try:
        ctx = ssl.create_default_context(cafile=n.tls_ca)
    except ssl.SSLError:
        raise ConfigError(f"tls_ca file {n.tls_ca}: no PEM certificate in it") from None
    if n.tls_cert:
        try:
            # A callable password: an encrypted key fails here instead of prompting on a terminal.
            ctx.load_cert_chain(n.tls_cert, n.tls_key, password=lambda: b"")
        except ssl.SSLError as e:
            if not n.tls_key and b"PRIVATE KEY" not in _read_setting_file(n.tls_cert, "tls_cert"):
                raise ConfigError(f"tls_cert file {n.tls_cert}: no private key in it "
                                  "(give the key file with tls_key, --tls-key)") from None
            if e.reason == "KEY_VALUES_MISMATCH":
                raise ConfigError(f"tls_key file {n.tls_key} does not belong to tls_cert {n.tls_cert}") from None
            if b"ENCRYPTED" in _read_setting_file(n.tls_key or n.tls_cert, "tls_key"):
                raise ConfigError(f"tls_key file {n.tls_key or n.tls_cert}: encrypted; "
                                  "kvcache needs an unencrypted key") from None
            raise ConfigError(f"tls_cert file {n.tls_cert}" + (f" / tls_key file {n.tls_key}" if n.tls_key else "")
                              + ": not a PEM certificate and its private key") from None
    return ctx


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


def ensure_dirs(cfg: Config) -> None:
    """Create the data, socket and (when it is on) access log directories, with a
    config-style error when we cannot: before anything starts, not after syncing."""
    dirs = [cfg.data_dir, os.path.dirname(os.path.abspath(cfg.socket_path))]
    if cfg.access_log_rate > 0:
        dirs.append(cfg.access_log_dir or os.path.join(cfg.data_dir, "access-logs"))
    for d in dict.fromkeys(dirs):
        try:
            Path(d).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot create directory {d}: {e.strerror}") from None
