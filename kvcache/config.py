"""The one `Config`: the sidecar's settings as dataclasses, and `validate`, the checks every
setting must pass, done once so the rest of the code can trust what it gets.

Reading the settings from their three sources (TOML file, `KVCACHE_*` environment, flags) is
`kvcache.config_sources.load`; checking the NATS credential files before connecting is
`kvcache.config_nats.validate_nats_auth`. Both import this module, never the other way round:
the dataclasses are what every side of the sidecar imports, and they stay light.
The values built from settings live here too: addresses, the socket path, the TLS context.
"""
from __future__ import annotations

import os
import re
import ssl
from dataclasses import dataclass, field
from pathlib import Path

from .errors import CommandError, ConfigError
from .keys import FilterSet, valid_filter

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
    """The sidecar's whole configuration, validated once by `validate` when
    kvcache.config_sources.load builds it (TOML, environment, flags)."""

    data_dir: str = "./kvcache-data"
    socket: str | None = None  # default: <data_dir>/kvcache.sock
    socket_mode: int = 0o660
    max_clients: int = 10_000
    # Processes serving the socket (kvcache.supervisors): 1 = this one alone; N > 1 = N worker
    # processes reading the one replica, beside this one (NATS, the feeds); "auto" in the
    # sources = the cores this process may run on.
    workers: int = 1
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
    # Share stream-state polls with the other sidecars of each bucket (kvcache.feed.fleet): one
    # STREAM.INFO per bucket per period for the whole fleet instead of one per sidecar.
    share_stream_state: bool = True
    # Follow each bucket whose stream has no usable RePublish on the fleet's relay, one sidecar
    # per bucket relaying it (kvcache.feed.relay): one consumer per bucket for the fleet. Off
    # (the default while it is experimental: docs/configuration.md): a consumer per sidecar per bucket.
    relay: bool = False
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
        """(max keys, max bytes) of a bucket's near cache; (0, 0): none. The top-level bounds
        cover the buckets with key filters only: a bucket replicating every key has nothing
        to cache, and one environment (`KVCACHE_CACHE_MAX_KEYS`) must be able to serve a
        whole bucket beside a cached one."""
        inherit = ">" not in b.keys
        return (b.cache_max_keys if b.cache_max_keys is not None else self.cache_max_keys if inherit else 0,
                b.cache_max_bytes if b.cache_max_bytes is not None else self.cache_max_bytes if inherit else 0)

    def serves_stale(self, b: BucketConfig) -> bool:
        """May a stale replica of this bucket answer when no peer can? Its own setting, else
        the top-level default."""
        return self.serve_stale if b.serve_stale is None else b.serve_stale


PASSWORD_ENV = "KVCACHE_REQUIREPASS"  # requirepass's other source (config_sources.load reads it)


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


# ---------------------------------------------------------------------------- validation

# `notify-keyspace-events`: Redis's class characters in the order CONFIG GET shows them, and
# the ones kvcache refuses. kvcache's events are in the classes `g` (del), `$` (set) and `x`
# (expired); the other data-type classes are accepted and never fire, as they never would in
# Redis for a database of strings. `m` (key misses) and `n` (new keys) are refused: kvcache
# does not send those. Checked here for the setting and for CONFIG SET alike.
KEYSPACE_CLASSES = "g$lshzxetd"
REFUSED_KEYSPACE_CLASSES = {"m": "key-miss events (m)", "n": "new-key events (n)"}


def parse_keyspace_events(text: str) -> str:
    """`notify-keyspace-events` as Redis reads it, in Redis's canonical order (`KEA` -> `AKE`).
    Raises CommandError with Redis's words (CONFIG SET answers them; `validate` rewords them)."""
    classes: set[str] = set()
    space = event = False
    for ch in text:
        if ch == "A":
            classes.update(KEYSPACE_CLASSES)
        elif ch in KEYSPACE_CLASSES:
            classes.add(ch)
        elif ch == "K":
            space = True
        elif ch == "E":
            event = True
        elif ch in REFUSED_KEYSPACE_CLASSES:
            raise CommandError(f"ERR kvcache does not send {REFUSED_KEYSPACE_CLASSES[ch]}")
        else:
            raise CommandError("ERR Invalid event class character. Use 'Ag$lshzxeKEtmdn'.")
    if not (space or event):
        return ""  # Redis keeps nothing when neither K nor E is given
    shown = "A" if classes == set(KEYSPACE_CLASSES) else "".join(c for c in KEYSPACE_CLASSES if c in classes)
    return shown + ("K" if space else "") + ("E" if event else "")


def validate(cfg: Config) -> None:
    if not cfg.data_dir:
        raise ConfigError("data_dir must not be empty")
    if len(os.fsencode(os.path.abspath(cfg.socket_path))) > MAX_SOCKET_PATH:
        raise ConfigError(
            f"socket path is too long for a Unix socket ({MAX_SOCKET_PATH} bytes max): {cfg.socket_path}"
        )
    internal = os.path.join(os.path.abspath(cfg.data_dir), "workers.sock")
    if cfg.workers > 1 and len(os.fsencode(internal)) > MAX_SOCKET_PATH:
        raise ConfigError(f"data_dir is too long for workers: their internal socket {internal} would be "
                          f"over {MAX_SOCKET_PATH} bytes (a Unix socket's limit)")
    if not 0 <= cfg.embedded_port < 65536:
        raise ConfigError(f"embedded_port must be a TCP port (1-65535, or 0 for a free one), got {cfg.embedded_port}")
    if not 0 <= cfg.socket_mode <= 0o777:
        raise ConfigError(f"socket_mode must be an octal file mode, got {cfg.socket_mode:o}")
    unusable = socket_mode_error(cfg.socket_mode)
    if unusable:
        raise ConfigError(unusable)
    for name in ("workers", "max_clients", "max_request_bytes", "max_reply_bytes", "max_args", "heartbeat_ms",
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
    if cfg.cache_max_keys < 0 or cfg.cache_max_bytes < 0:
        raise ConfigError("cache_max_keys and cache_max_bytes must not be negative, got "
                          f"{cfg.cache_max_keys} and {cfg.cache_max_bytes}")
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
        own = [n for n in ("cache_max_keys", "cache_max_bytes") if getattr(b, n)]
        if ">" in b.keys and own:
            raise ConfigError(
                f"bucket '{b.name}' replicates every key (keys = [\">\"]), so its own {' and '.join(own)} "
                "would cache nothing (a near cache holds the keys outside a bucket's filters): remove "
                f"{'them' if len(own) > 1 else 'it'} from this [[bucket]], or give it key filters "
                "(keys = [\"feature.>\"]); the top-level setting skips such buckets by itself")
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
        parse_keyspace_events(cfg.notify_keyspace_events)
    except CommandError as e:
        raise ConfigError(f"notify_keyspace_events: {str(e).removeprefix('ERR ')}") from None
    peer_names = [p.name for p in cfg.peers]
    if len(set(peer_names)) != len(peer_names):
        raise ConfigError("peer names must be unique")
    if "stale" in peer_names:  # KV.GET's source for a stale replica's answer
        raise ConfigError("peer name 'stale' is reserved")


def start_warnings(cfg: Config) -> list[str]:
    """What `kvcache serve` warns about at start (one line each): settings that are legal but
    most likely not what was meant, so that they do not fail silently."""
    lines = socket_mode_warnings(cfg.socket_mode)
    for b in cfg.buckets:
        exact = [f for f in b.keys if "*" not in f.split(".") and ">" not in f.split(".")]
        # A bucket with a wildcard filter too was written by someone who knows them: its
        # exact keys are meant. Only filters that are all exact keys are likely prefixes.
        if exact and len(exact) == len(b.keys):
            if len(exact) == 1:
                what = (f"key filter '{exact[0]}' has no wildcard: it replicates the one key "
                        f"'{exact[0]}', not the keys under it")
            else:
                what = (f"key filters {', '.join(repr(f) for f in exact)} have no wildcard: they "
                        "replicate those exact keys, not the keys under them")
            lines.append(f"bucket {b.name}: {what}; for those write "
                         f"'{exact[0]}.>' (every level below) or '{exact[0]}.*' (one level)")
    bounds = [f"{n} {getattr(cfg, n)}" for n in ("cache_max_keys", "cache_max_bytes") if getattr(cfg, n)]
    if bounds and all(">" in b.keys for b in cfg.buckets):
        verb = "covers" if len(bounds) == 1 else "cover"
        lines.append(f"{' and '.join(bounds)} {verb} no bucket: every bucket here replicates every "
                     "key, and a near cache holds only keys outside a bucket's filters (give the "
                     "bucket to cache key filters: --bucket NAME:FILTER,... or keys = [...])")
    return lines


# ---------------------------------------------------------------------------- the socket's mode

# What a `socket_mode` lets happen, said before the socket exists.
#
# Connecting to a Unix socket needs write permission on its file (connect(2): EACCES without
# it); read and execute do nothing for a socket. The kernel checks one class of bits only: the
# owner's for the owner, whatever the group's and others' say. So:
#
# - **Refused** (one line, before anything starts): a mode without owner write (`u+w`). The
#   owner is the user `kvcache serve` runs as, and its own `kvcache health` probe and
#   `kvcache cli` run as it; with no write bit anywhere (400, 444) no one but root connects.
# - **Warned** (one line at start, the start goes on): others' write (`o+w`, as in 777 or 666):
#   every local user can connect and read every replicated key; and a class given read without
#   write (644, 640: a file's habit), which lets that class in no more than 600 would.
SAFE_MODES = "660 (the sidecar's user and group) or 600 (its user only)"
_CLASSES = ((0o070, "the group"), (0o007, "others"))


def socket_mode_error(mode: int) -> str | None:
    """Why `mode` cannot be the socket's: a ConfigError's text; None when it can."""
    if mode & 0o200:
        return None
    if not mode & 0o222:
        return (f"socket_mode {mode:03o} lets no one connect: connecting to a Unix socket needs write "
                f"permission on it, which {mode:03o} gives no one; use {SAFE_MODES}")
    return (f"socket_mode {mode:03o} shuts out the socket's owner, the user kvcache serve runs as "
            "(and its kvcache health and kvcache cli): connecting to a Unix socket needs write "
            f"permission, and the owner gets only the owner's bits ({mode >> 6:o}), whatever the "
            f"group's and others' say; use {SAFE_MODES}")


def socket_mode_warnings(mode: int) -> list[str]:
    """What `mode` lets happen that was most likely not meant (one line each)."""
    lines = []
    if mode & 0o002:
        lines.append(f"socket_mode {mode:03o} lets every local user connect (others may write to the "
                     f"socket) and read every replicated key; {SAFE_MODES} keeps them out")
    read_only = [who for bits, who in _CLASSES if mode & bits & 0o444 and not mode & bits & 0o222]
    if read_only:
        acts = mode & ~sum(bits for bits, who in _CLASSES if who in read_only) & 0o666
        lines.append(f"socket_mode {mode:03o}: {' and '.join(read_only)} may read the socket file but "
                     f"not connect (connecting needs write permission; read does nothing for a "
                     f"socket), so it acts as {acts:03o}; 660 lets the group connect")
    return lines


# ---------------------------------------------------------------------------- NATS URLs and TLS

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


def read_setting_file(path: str, what: str, limit: int = 1 << 20) -> bytes:
    """A file a setting names (password, creds, nkey, TLS), an unreadable one a ConfigError."""
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError as e:
        raise ConfigError(f"{what} file {path}: {e.strerror}") from None


def tls_context(n: NatsConfig) -> ssl.SSLContext | None:
    """The client TLS context tls_ca / tls_cert / tls_key ask for (None: nats-py's own, for
    tls:// URLs and servers that require TLS); every file problem is a ConfigError."""
    if not (n.tls_ca or n.tls_cert or n.tls_key):
        return None
    if n.tls_key and not n.tls_cert:
        raise ConfigError("tls_key needs tls_cert (the client certificate the key belongs to)")
    for what, path in (("tls_ca", n.tls_ca), ("tls_cert", n.tls_cert), ("tls_key", n.tls_key)):
        if path:
            read_setting_file(path, what, limit=1)
    try:
        ctx = ssl.create_default_context(cafile=n.tls_ca)
    except ssl.SSLError:
        raise ConfigError(f"tls_ca file {n.tls_ca}: no PEM certificate in it") from None
    if n.tls_cert:
        try:
            # A callable password: an encrypted key fails here instead of prompting on a terminal.
            ctx.load_cert_chain(n.tls_cert, n.tls_key, password=lambda: b"")
        except ssl.SSLError as e:
            if not n.tls_key and b"PRIVATE KEY" not in read_setting_file(n.tls_cert, "tls_cert"):
                raise ConfigError(f"tls_cert file {n.tls_cert}: no private key in it "
                                  "(give the key file with tls_key, --tls-key)") from None
            if e.reason == "KEY_VALUES_MISMATCH":
                raise ConfigError(f"tls_key file {n.tls_key} does not belong to tls_cert {n.tls_cert}") from None
            if b"ENCRYPTED" in read_setting_file(n.tls_key or n.tls_cert, "tls_key"):
                raise ConfigError(f"tls_key file {n.tls_key or n.tls_cert}: encrypted; "
                                  "kvcache needs an unencrypted key") from None
            raise ConfigError(f"tls_cert file {n.tls_cert}" + (f" / tls_key file {n.tls_key}" if n.tls_key else "")
                              + ": not a PEM certificate and its private key") from None
    return ctx


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
