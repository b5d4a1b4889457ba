"""`kvcache serve | get | info | load | hotkeys`: one clear line on stderr and a non-zero exit on any failure."""
from __future__ import annotations

import argparse
import logging
import sys

from . import __version__
from .config import Config, load
from .errors import ConfigError, KvcacheError

EXIT_CONFIG = 2
EXIT_RUNTIME = 1


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits 2 with usage; keep it to one line
        raise ConfigError(f"{self.prog}: {message}")


def _octal(text: str) -> int:
    try:
        return int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an octal file mode: {text}") from None


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML configuration file (or KVCACHE_CONFIG)")
    p.add_argument("--socket", metavar="PATH", help="Unix socket path (default: <data-dir>/kvcache.sock)")
    p.add_argument("--data-dir", metavar="DIR", dest="data_dir", help="replica and embedded NATS store")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvcache", description="Read-cache sidecar for NATS JetStream Key-Value.")
    parser.add_argument("--version", action="version", version=f"kvcache {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    serve = sub.add_parser("serve", help="run the sidecar")
    _common(serve)
    serve.add_argument("--nats", metavar="URL", action="append", dest="nats_servers",
                       help="NATS server URL (repeatable); none anywhere: embedded nats-server")
    serve.add_argument("--bucket", metavar="NAME[:FILTER,...]", action="append", dest="buckets",
                       help="bucket to replicate, optionally with key filters (repeatable)")
    serve.add_argument("--max-stale-ms", type=int, dest="max_stale_ms")
    serve.add_argument("--serve-stale", action=argparse.BooleanOptionalAction, dest="serve_stale",
                       default=None, help="replica older than max_stale_ms and no peer answering: "
                       "serve its last known value (marked stale) instead of an error; every bucket")
    serve.add_argument("--discover-peers", action=argparse.BooleanOptionalAction, dest="discover_peers",
                       default=None, help="also read from the mirrors each bucket stream lists as alternates")
    serve.add_argument("--socket-mode", type=_octal, dest="socket_mode", metavar="MODE")
    serve.add_argument("--max-args", type=int, dest="max_args")
    serve.add_argument("--map-size-mb", type=int, dest="map_size_mb")
    serve.add_argument("--max-map-size-mb", type=int, dest="max_map_size_mb")
    serve.add_argument("--connect-timeout-s", type=float, dest="nats_connect_timeout_s")
    serve.add_argument("--request-timeout-ms", type=int, dest="nats_request_timeout_ms")
    serve.add_argument("--max-clients", type=int, dest="max_clients")
    serve.add_argument("--max-request-bytes", type=int, dest="max_request_bytes")
    serve.add_argument("--max-reply-bytes", type=int, dest="max_reply_bytes")
    serve.add_argument("--client-write-stall-ms", type=int, dest="client_write_stall_ms")
    serve.add_argument("--heartbeat-ms", type=int, dest="heartbeat_ms")
    serve.add_argument("--creds", dest="nats_creds", metavar="FILE")
    serve.add_argument("--nkey", dest="nats_nkey", metavar="FILE")
    serve.add_argument("--token", dest="nats_token")
    serve.add_argument("--user", dest="nats_user")
    serve.add_argument("--password", dest="nats_password")
    serve.add_argument("--tls-ca", dest="nats_tls_ca", metavar="FILE")
    serve.add_argument("--tls-cert", dest="nats_tls_cert", metavar="FILE")
    serve.add_argument("--tls-key", dest="nats_tls_key", metavar="FILE")
    serve.add_argument("--log-level", dest="log_level")
    serve.add_argument("--access-log-rate", type=float, dest="access_log_rate", metavar="R",
                       help="share of reads to record for `kvcache hotkeys` (0..1, default 0 = off)")
    serve.add_argument("--access-log-dir", dest="access_log_dir", metavar="DIR",
                       help="access log directory (default: <data-dir>/access-logs)")
    serve.add_argument("--access-log-max-bytes", type=int, dest="access_log_max_bytes", metavar="N")
    serve.add_argument("--access-log-files", type=int, dest="access_log_files", metavar="N")

    get = sub.add_parser("get", help="read a key through a running sidecar")
    _common(get)
    get.add_argument("key", help="KEY or BUCKET:KEY")
    get.add_argument("--entry", action="store_true", help="show revision, creation time and source")

    info = sub.add_parser("info", help="show a running sidecar's INFO")
    _common(info)
    info.add_argument("section", nargs="?")

    # The Spark jobs: their modules import pyspark only when they run.
    from .pipeline import hotkeys as hotkeys_job, load as load_job
    load_job.add_arguments(sub.add_parser("load", help="bulk-load a dataset into a KV bucket (Spark)"))
    hotkeys_job.add_arguments(sub.add_parser("hotkeys", help="hot keys from sidecar access logs (Spark)"))
    return parser


_NOT_CONFIG = {"command", "config", "key", "entry", "section"}


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.command in ("load", "hotkeys"):
            from .pipeline import hotkeys, load as load_job
            return (load_job if args.command == "load" else hotkeys).run(args)
        overrides = {k: v for k, v in vars(args).items() if k not in _NOT_CONFIG}
        cfg = load(args.config, overrides=overrides)
        return {"serve": _serve, "get": _get, "info": _info}[args.command](cfg, args)
    except ConfigError as e:
        print(f"kvcache: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except KvcacheError as e:
        print(f"kvcache: error: {e}", file=sys.stderr)
        return EXIT_RUNTIME
    except KeyboardInterrupt:
        return 130


def _serve(cfg: Config, args: argparse.Namespace) -> int:
    import uvloop

    from .sidecar import Sidecar

    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("nats").setLevel(logging.CRITICAL)  # reported through our error callback
    sidecar = Sidecar(cfg)
    uvloop.run(sidecar.run())
    return sidecar.exit_code


def _get(cfg: Config, args: argparse.Namespace) -> int:
    from .client import Client

    with Client(cfg.socket_path) as c:
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
    sys.stdout.buffer.write(value + b"\n")
    return 0


def _info(cfg: Config, args: argparse.Namespace) -> int:
    from .client import Client

    with Client(cfg.socket_path) as c:
        text = c.execute("INFO", *([args.section] if args.section else []))
    print(text.decode() if isinstance(text, bytes) else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
