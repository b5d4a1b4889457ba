"""`kvcache serve | get | info | health | load | hotkeys`: one clear line on stderr and a
non-zero exit on any failure."""
from __future__ import annotations

import argparse
import errno
import logging
import os
import sys
from typing import TYPE_CHECKING, Any, NoReturn

from . import __version__
from .config import Config
from .config_nats import validate_nats_auth
from .config_sources import load
from .errors import ConfigError, KvcacheError
from .ops import logformat

if TYPE_CHECKING:
    from .app.client import Client

EXIT_CONFIG = 2
EXIT_RUNTIME = 1
# stdout closed by its reader (`kvcache cli GET big | head -c 8`): the status a shell shows for
# redis-cli, cat or any C tool that SIGPIPE ended (128 + 13)
EXIT_BROKEN_PIPE = 141


class _NoCommand(Exception):
    """`kvcache` with no subcommand: main() lists them."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse exits 2 with usage; keep it to one line
        if message == "the following arguments are required: command":
            raise _NoCommand
        # main() prints "kvcache: error: ..."; name the subcommand's help, not a second prefix
        raise ConfigError(f"{message} (see {self.prog} --help)")


def _octal(text: str) -> int:
    try:
        return int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an octal file mode: {text}") from None


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML configuration file")
    p.add_argument("--socket", metavar="PATH", help="the sidecar's Unix socket")
    p.add_argument("--data-dir", metavar="DIR", dest="data_dir",
                   help="replica, embedded NATS store, lock file and default socket")


# Defaults computed at run time, for --help (the others come from config_sources.default_of).
_DEFAULT_TEXT = {
    "config": "none", "socket": "<data-dir>/kvcache.sock", "access_log_dir": "<data-dir>/access-logs",
    "nats_servers": "none: an embedded nats-server",
    "buckets": "none: a demo bucket on the embedded nats-server; with --nats, required",
}


def _document_settings(p: argparse.ArgumentParser) -> None:
    """Append each option's default and environment variable to its help, from the tables
    config_sources.py loads with (config_sources.env_var, config_sources.default_of): one
    source of truth."""
    from .config_sources import default_of, env_var

    for action in p._actions:
        var = env_var(action.dest)
        if var is None:
            continue
        if action.dest in _DEFAULT_TEXT:
            default = _DEFAULT_TEXT[action.dest]
        else:
            value = default_of(action.dest)
            if action.dest == "socket_mode":
                default = f"{value:o}"
            elif isinstance(value, bool):
                default = "on" if value else "off"
            else:
                default = "none" if value is None or value == "" else str(value)
        note = f"default: {default}; env {var}"
        if action.dest == "nats_servers":
            note += " (comma separated)"
        elif action.dest == "buckets":
            note += " (space separated)"
        help_text = (action.help or "").rstrip()
        action.help = f"{help_text} ({note})".lstrip().replace("%", "%%").replace("%%(", "%(")


def _nats_auth(p: argparse.ArgumentParser) -> None:
    """The NATS credential and TLS flags, defined once for `serve` and `load` (dests
    `nats_<NatsConfig field>`, which config_sources.load and the load job both read)."""
    p.add_argument("--creds", dest="nats_creds", metavar="FILE", help="NATS credentials file")
    p.add_argument("--nkey", dest="nats_nkey", metavar="FILE", help="NATS nkey seed file")
    p.add_argument("--token", dest="nats_token", metavar="TOKEN", help="NATS authentication token")
    p.add_argument("--user", dest="nats_user", metavar="USER", help="NATS user (with --password)")
    p.add_argument("--password", dest="nats_password", metavar="PASSWORD", help="NATS password")
    p.add_argument("--tls-ca", dest="nats_tls_ca", metavar="FILE",
                   help="CA certificates to verify the NATS servers with")
    p.add_argument("--tls-cert", dest="nats_tls_cert", metavar="FILE", help="client certificate for NATS")
    p.add_argument("--tls-key", dest="nats_tls_key", metavar="FILE", help="the client certificate's key")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvcache", description="Read-cache sidecar for NATS JetStream Key-Value.")
    parser.add_argument("--version", action="version", version=f"kvcache {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    serve = sub.add_parser("serve", help="run the sidecar")
    _common(serve)
    serve.add_argument("--nats", metavar="URL", action="append", dest="nats_servers",
                       help="NATS server URL (repeatable)")
    serve.add_argument("--bucket", metavar="NAME[:FILTER,...]", action="append", dest="buckets",
                       help="bucket to replicate, optionally with key filters (repeatable); "
                            "NAME: replicates no key (its near cache serves it)")
    serve.add_argument("--embedded-port", type=int, dest="embedded_port", metavar="PORT",
                       help="with no NATS URL: the embedded nats-server's client port on 127.0.0.1; "
                            "0: a free one each start")
    serve.add_argument("--max-stale-ms", type=int, dest="max_stale_ms", metavar="MS",
                       help="a replica cut off longer than this is not served: reads go to peers; "
                       "every bucket")
    serve.add_argument("--serve-stale", action=argparse.BooleanOptionalAction, dest="serve_stale",
                       default=None, help="replica older than max_stale_ms and no peer answering: "
                       "serve its last known value (marked stale) instead of an error; every bucket")
    serve.add_argument("--discover-peers", action=argparse.BooleanOptionalAction, dest="discover_peers",
                       default=None, help="also read from the mirrors each bucket stream lists as alternates")
    serve.add_argument("--share-stream-state", action=argparse.BooleanOptionalAction, dest="share_stream_state",
                       default=None, help="share stream-state polls with the other sidecars of each bucket "
                       "(core subject kvcache.state.>): one STREAM.INFO per bucket per period for the fleet")
    serve.add_argument("--relay", action=argparse.BooleanOptionalAction, dest="relay",
                       default=None, help="experimental, off by default: follow buckets whose stream has no "
                       "RePublish on the fleet's relay (core subject kvcache.changes.>), one consumer per "
                       "bucket for the fleet (docs/configuration.md says why it is not for production yet)")
    serve.add_argument("--socket-mode", type=_octal, dest="socket_mode", metavar="MODE",
                       help="the socket's file mode, octal: who may read")
    serve.add_argument("--max-args", type=int, dest="max_args", metavar="N",
                       help="most arguments in one request")
    serve.add_argument("--map-size-mb", type=int, dest="map_size_mb", metavar="MB",
                       help="initial LMDB map size (grows as needed)")
    serve.add_argument("--max-map-size-mb", type=int, dest="max_map_size_mb", metavar="MB",
                       help="largest the LMDB map may grow")
    serve.add_argument("--connect-timeout-s", type=float, dest="nats_connect_timeout_s", metavar="S",
                       help="first connection to NATS: give up after this long")
    serve.add_argument("--request-timeout-ms", type=int, dest="nats_request_timeout_ms", metavar="MS",
                       help="NATS requests (fallback reads, JetStream API) time out after this long")
    serve.add_argument("--workers", dest="workers", metavar="N",
                       help="processes serving the socket: N reading the one replica beside the "
                       "one that holds the NATS connection, or auto (the cores it may use)")
    serve.add_argument("--max-clients", type=int, dest="max_clients", metavar="N",
                       help="connections over this are refused")
    serve.add_argument("--max-request-bytes", type=int, dest="max_request_bytes", metavar="N",
                       help="larger requests are refused")
    serve.add_argument("--max-reply-bytes", type=int, dest="max_reply_bytes", metavar="N",
                       help="most bytes of values in one reply (MGET); more is refused")
    serve.add_argument("--client-write-stall-ms", type=int, dest="client_write_stall_ms", metavar="MS",
                       help="disconnect a client that reads none of its replies this long; 0 = never")
    serve.add_argument("--heartbeat-ms", type=int, dest="heartbeat_ms", metavar="MS",
                       help="consumer idle heartbeat; after 2 missed the replica counts as "
                       "behind from the last one heard, after 3 the consumer is recreated "
                       "(a replicated stream read whole: 30 s, and recreated when silent this "
                       "long x 3 while the quorum shows more)")
    _nats_auth(serve)
    serve.add_argument("--log-level", dest="log_level", metavar="LEVEL",
                       help="debug, info, warning or error")
    serve.add_argument("--log-format", dest="log_format", metavar="FORMAT",
                       help="text, or json: one JSON object per line")
    serve.add_argument("--access-log-rate", type=float, dest="access_log_rate", metavar="R",
                       help="share of reads to record for `kvcache hotkeys` (0..1, 0 = off)")
    serve.add_argument("--access-log-dir", dest="access_log_dir", metavar="DIR",
                       help="access log directory")
    serve.add_argument("--access-log-max-bytes", type=int, dest="access_log_max_bytes", metavar="N",
                       help="rotate access.log at this size")
    serve.add_argument("--access-log-files", type=int, dest="access_log_files", metavar="N",
                       help="rotated access logs kept")
    serve.add_argument("--cache-max-keys", type=int, dest="cache_max_keys", metavar="N",
                       help="near cache of keys outside each bucket's filters: at most N keys")
    serve.add_argument("--cache-max-bytes", type=int, dest="cache_max_bytes", metavar="N",
                       help="near cache: at most N bytes per bucket")
    serve.add_argument("--cache-admission", dest="cache_admission", metavar="HOW",
                       help="near cache admission: by read frequency (TinyLFU), or every answer (plain LRU)")
    serve.add_argument("--listen", dest="listen", metavar="HOST:PORT",
                       help="also serve RESP on this loopback TCP address (127.0.0.1:6380)")
    serve.add_argument("--listen-non-loopback", action=argparse.BooleanOptionalAction,
                       dest="listen_non_loopback", help="allow --listen on an address other than loopback")
    serve.add_argument("--requirepass-file", dest="requirepass_file", metavar="FILE",
                       help="file holding the password TCP clients must AUTH with "
                            "(or the password itself in KVCACHE_REQUIREPASS)")
    serve.add_argument("--metrics-listen", dest="metrics_listen", metavar="HOST:PORT",
                       help="serve Prometheus /metrics, /healthz and /readyz over HTTP here (127.0.0.1:9464)")
    serve.add_argument("--metrics-non-loopback", action=argparse.BooleanOptionalAction,
                       dest="metrics_non_loopback", help="allow --metrics-listen on an address other than loopback")
    serve.add_argument("--ready-on-fallback", action=argparse.BooleanOptionalAction,
                       dest="ready_on_fallback",
                       help="a bucket syncing or past max_stale_ms counts as ready while NATS answers its reads")
    serve.add_argument("--compat-identity", action=argparse.BooleanOptionalAction,
                       dest="compat_identity",
                       help="HELLO answers server 'redis' (client-side caches check it)")
    serve.add_argument("--notify-keyspace-events", dest="notify_keyspace_events", metavar="FLAGS",
                       help="keyspace notifications, Redis's flags ('' = off)")
    serve.add_argument("--tracking-table-max-keys", type=int, dest="tracking_table_max_keys",
                       metavar="N", help="keys remembered for CLIENT TRACKING clients")
    serve.add_argument("--pubsub-max-output-bytes", type=int, dest="pubsub_max_output_bytes",
                       metavar="N", help="cut off a subscriber with more output pending")
    _document_settings(serve)

    get = sub.add_parser("get", help="read a key through a running sidecar")
    _common(get)
    _document_settings(get)
    get.add_argument("key", help="KEY or BUCKET:KEY")
    get.add_argument("--entry", action="store_true", help="show revision, creation time and source")

    info = sub.add_parser("info", help="show a running sidecar's INFO")
    _common(info)
    info.add_argument("section", nargs="?", help="one INFO section, or all (default: the usual sections)")
    _document_settings(info)

    call = sub.add_parser("cli", help="send one command to a running sidecar, print the reply as redis-cli does")
    _common(call)
    _document_settings(call)
    call.add_argument("words", nargs=argparse.REMAINDER, metavar="COMMAND [ARG ...]",
                      help="a RESP command and its arguments, as you would give them to redis-cli")

    health = sub.add_parser("health", help="is a running sidecar live (ready with --ready)? exit 0 or 1")
    _common(health)
    health.add_argument("--ready", action="store_true",
                        help="also require every bucket synced and within its max_stale_ms")
    _document_settings(health)

    # The Spark jobs: their modules import pyspark only when they run.
    from .pipeline import hotkeys as hotkeys_job
    from .pipeline import load as load_job
    load_parser = sub.add_parser("load", help="bulk-load a dataset into a KV bucket (Spark)")
    load_job.add_arguments(load_parser)
    _nats_auth(load_parser)  # the driver and every partition connect with serve's credentials
    hotkeys_job.add_arguments(sub.add_parser("hotkeys", help="hot keys from sidecar access logs (Spark)"))
    return parser


_NOT_CONFIG = {"command", "config", "key", "entry", "section", "ready", "words"}


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _command_list(parser: argparse.ArgumentParser) -> str:
    """What bare `kvcache` prints: each subcommand and what it does, one line each."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help or "" for a in sub._choices_actions}
    width = max(map(len, helps))
    rows = [f"  {name:<{width}}  {text}" for name, text in helps.items()]
    return "\n".join(["usage: kvcache <command> [options]", "", "commands:", *rows, "",
                      "`kvcache <command> --help` lists a command's options; `kvcache --version` "
                      "prints the version."])


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The arguments; a mistake raises ConfigError naming the help of the subcommand it was
    made in (`kvcache serve --nosuch`: see kvcache serve --help, not kvcache --help)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        where = _subcommands(parser).get(args.command, parser)
        where.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, not at exit: a reader gone is a BrokenPipeError caught below
        return code
    except BrokenPipeError:
        return _reader_gone()


def _reader_gone() -> int:
    """The reader of stdout went away (`| head`): end quietly, as a tool killed by SIGPIPE
    does, rather than with a traceback. What is still buffered goes to /dev/null, so that
    the interpreter's own flush at exit cannot fail again (Python's documented recipe, with
    the status a shell shows for redis-cli in the same pipe)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real stdout (a test's capture): nothing to redirect
        pass
    return EXIT_BROKEN_PIPE


def _main(argv: list[str] | None) -> int:
    try:
        args = _parse(argv)
        if args.command in ("load", "hotkeys"):
            _require_spark(args.command)  # before anything is done (load creates buckets)
            from .pipeline import hotkeys
            from .pipeline import load as load_job
            return (load_job if args.command == "load" else hotkeys).run(args)
        overrides = {k: v for k, v in vars(args).items() if k not in _NOT_CONFIG}
        cfg = load(args.config, overrides=overrides)
        return {"serve": _serve, "get": _get, "info": _info, "health": _health,
                "cli": _cli}[args.command](cfg, args)
    except _NoCommand:
        given = sys.argv[1:] if argv is None else argv
        if given:  # options but no command: say what was not understood, then the list
            print(f"kvcache: error: no command in: {' '.join(given)}", file=sys.stderr)
        print(_command_list(build_parser()), file=sys.stderr)
        return EXIT_CONFIG
    except ConfigError as e:
        print(f"kvcache: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except KvcacheError as e:
        print(f"kvcache: error: {_server_words(e)}", file=sys.stderr)
        return EXIT_RUNTIME
    except KeyboardInterrupt:
        return 130


def _server_words(e: KvcacheError) -> str:
    """An error reply of the sidecar without Redis's `ERR ` code: after `kvcache: error:` it
    would say error twice (`kvcache: error: ERR invalid key ...`)."""
    text = str(e)
    from .app.client import ResponseError
    if isinstance(e, ResponseError) and text.startswith("ERR "):
        return text[4:]
    return text


def _unreachable(e: Exception, path: str) -> KvcacheError:
    """The sidecar's socket could not be opened: why, and what to check."""
    cause = e.__cause__ if isinstance(e.__cause__, OSError) else e
    why = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(cause)
    code = cause.errno if isinstance(cause, OSError) else None
    if code in (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTSOCK):
        return KvcacheError(f"cannot connect to the sidecar: {why}; is the sidecar running? (socket {path}: "
                            "--socket, --data-dir or KVCACHE_SOCKET choose it)")
    if code in (errno.EACCES, errno.EPERM):
        return KvcacheError(f"cannot connect to the sidecar: {why}; may this user open its socket? "
                            f"(socket {path}: its mode is the sidecar's socket_mode)")
    return KvcacheError(str(e))


def _client(path: str, timeout: float | None = 5.0) -> Client:
    """A connected kvcache.app.client.Client, or one line saying why there is none."""
    from .app.client import Client, ConnectionFailed

    c = Client(path, timeout=timeout)
    try:
        c.ping()
    except ConnectionFailed as e:
        c.close()
        raise _unreachable(e, path) from None
    return c


def _require_spark(command: str) -> None:
    try:
        import pyspark  # noqa: F401
    except ImportError as e:
        missing = f"no module named '{e.name}'" if e.name else str(e)
        raise KvcacheError(f"kvcache {command} needs the Spark extra, which is not installed "
                           f"({missing}): {spark_install_hint()} (Spark also needs Java 17+)") from None


def spark_install_hint() -> str:
    """How to install the Spark extra here. kvcache is not on a package index, so
    `pip install 'kvcache[spark]'` finds nothing: from a clone (this package sits in a source
    tree: an editable install, or run from the checkout) the extra is installed from the tree;
    otherwise the extra's own packages are named, as this installation's metadata lists them."""
    package = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(package)
    if os.path.isfile(os.path.join(root, "pyproject.toml")) and os.path.isfile(os.path.join(root, "setup.py")):
        where = "." if os.path.abspath(os.getcwd()) == root else root
        return f"pip install -e '{where}[spark]'"
    return "pip install " + " ".join(f"'{r}'" for r in _spark_requirements())


def _spark_requirements() -> list[str]:
    """The `spark` extra's requirements from the installed metadata (pyproject.toml's list
    when the metadata cannot be read)."""
    try:
        from importlib.metadata import requires
        reqs = [r.split(";")[0].strip() for r in requires("kvcache") or []
                if "extra" in r and ("'spark'" in r or '"spark"' in r)]
    except Exception:  # no metadata (run from a copy of the sources)
        reqs = []
    return reqs or ["pyspark>=3.5", "pyarrow>=14", "pandas>=2", "matplotlib>=3.7"]


def _serve(cfg: Config, args: argparse.Namespace) -> int:
    import uvloop

    if not cfg.embedded and not cfg.buckets:
        # The demo bucket belongs to the embedded nats-server; on a real NATS a sidecar with
        # no bucket would answer every read with an error.
        raise ConfigError("no bucket to replicate: name one with --bucket NAME[:FILTER,...] "
                          "(or KVCACHE_BUCKETS, or [[bucket]] in the config file); only the embedded "
                          "nats-server (no --nats) comes with a demo bucket")
    validate_nats_auth(cfg)

    from .sidecar import Sidecar

    logformat.setup(cfg.log_level, cfg.log_format)
    logging.getLogger("nats").setLevel(logging.CRITICAL)  # reported through our error callback
    sidecar = Sidecar(cfg)
    uvloop.run(sidecar.run())
    return sidecar.exit_code


def _get(cfg: Config, args: argparse.Namespace) -> int:
    with _client(cfg.socket_path) as c:
        if args.entry:
            e = c.entry(args.key)
            if e is None:
                print("(nil)")
                return 1
            print(f"value: {e.value!r}\nrevision: {e.revision}\ncreated: {e.created}\n"
                  f"operation: {e.operation.value}\nsource: {e.source}")
            return 0
        value = c.get(args.key)
    if value is None:
        print("(nil)", file=sys.stderr)
        return 1
    _write_all(value + b"\n")
    return 0


def _write_all(data: bytes) -> None:
    """All of `data` to stdout. A large write to a pipe whose reader left returns short (the
    count the pipe took) rather than failing; the next write raises BrokenPipeError, which
    main() turns into a quiet exit."""
    out = sys.stdout.buffer
    view = memoryview(data)
    while view:
        n = out.write(view)
        view = view[n:] if n else view[:0]  # (None: a non-blocking stdout buffered it all)


def _info(cfg: Config, args: argparse.Namespace) -> int:
    with _client(cfg.socket_path) as c:
        text = c.execute("INFO", *([args.section] if args.section else []))
        text = text.decode() if isinstance(text, bytes) else text
        if args.section and not text.strip():
            # Redis answers an unknown section with nothing; a person wants to hear why.
            everything = c.execute("INFO", "everything")
            everything = everything.decode() if isinstance(everything, bytes) else everything
            names = [line[2:].strip().lower() for line in everything.splitlines() if line.startswith("# ")]
            raise ConfigError(f"no INFO section '{args.section}'; sections: {', '.join(names)}, all")
    print(text)
    return 0


def _cli(cfg: Config, args: argparse.Namespace) -> int:
    """redis-cli's one-command form for machines without redis-tools: the reply printed as
    redis-cli prints it; exit 1 on an error reply."""
    from .app.cli_call import call

    if not args.words:
        raise ConfigError("no command given: kvcache cli GET <key> (any command the sidecar "
                          "answers, as redis-cli takes it)")
    try:
        text, failed = call(cfg.socket_path, args.words)
    except OSError as e:
        raise _unreachable(e, cfg.socket_path) from None
    if text:  # (redis-cli prints nothing at all for an empty INFO section)
        print(text)
    return 1 if failed else 0


def _health(cfg: Config, args: argparse.Namespace) -> int:
    """For liveness and readiness probes: one line saying why, exit 0 (yes) or 1 (no).
    Live: the sidecar answers PING on its socket. Ready: also every bucket synced and its
    replica within max_stale_ms, as INFO reports them."""
    from .app.client import Client
    from .ops.health import BucketState, readiness

    try:
        with Client(cfg.socket_path, timeout=5) as c:
            c.ping()
            if not args.ready:
                print(f"live: the sidecar answers on {cfg.socket_path}")
                return 0
            info = c.info()  # default sections: server and buckets among them
            buckets: dict[str, Any] = info.get("buckets", {})
            server: dict[str, Any] = info.get("server", {})
    except (OSError, KvcacheError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        print(f"not live: no sidecar answers on {cfg.socket_path}: {why}")
        return 1
    ready, why = readiness(
        (BucketState(name, bool(row.get("synced")), int(row.get("lag_ms", 0)), int(row.get("max_stale_ms", 0)),
                     int(row.get("unwritable_ms", 0)))
         for name, row in buckets.items()),
        bool(server.get("nats_connected")), bool(server.get("ready_on_fallback")))
    print(why)
    return 0 if ready else 1


if __name__ == "__main__":
    sys.exit(main())
