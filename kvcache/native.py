"""The one place that chooses between a Cython extension and its pure-Python twin.

Every native module in kvcache/_native (built from ext/*.pyx) has a twin in kvcache/ with the
same API and the same errors, tested on the same wire vectors. The twin is used when the
extension is not built, or always when KVCACHE_NO_EXTENSIONS=1 (to compare, or to debug).

The choice is never silent: `report()` says which implementation serves each module and why
(the sidecar logs it at start and shows it in `INFO server` as `native`), a module that is
built but fails to import is told apart from one that is not built, and
KVCACHE_REQUIRE_EXTENSIONS=1 (set by CI) turns a missing or broken extension into an error,
for the sidecar and for the test suites that compare natives with twins (`native_or_none`).

What a pair shares is declared here once, as a `typing.Protocol` per pair (`CONTRACTS`, as
redis-py's `_parsers/` declares what its hiredis and Python parsers share): the names, their
parameters and what they return, and so all a caller may use of what `load` hands out. A
module's classes appear in its contract as constructors that return their instances' contract.
tests/test_twin_contracts.py checks both twins of every pair against it (members, parameters,
a call each); `pick` refuses an extension that lacks a member of its contract (a build older
than its .pyx) as broken.

A pair can be part of another's native path (`PARTS`): built as its own extension, so that
the layer below loads it without the one above (the store's near-cache hit counter, which the
GET path's extension calls in C), chosen and contracted like any pair, and reported under the
module it is part of, which serves natively only when its parts do.
"""
from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any, Protocol

from .errors import KvcacheError

# The one table of implementations: each extension in kvcache/_native (built from ext/<name>.pyx)
# -> its pure-Python twin under kvcache/, and what it does. Modules ask `load(name)`; nothing else
# chooses.
EXTENSIONS = {
    "resp": "resp",                    # the server's RESP request reader and the client's reply reader
    "natsproto": "natsio.natsproto",   # the NATS protocol reader under the feeds' and peers' connections
    "server_get": "serve.server_get",  # the server's GET fast path over the replica
    "app_get": "app.app_get",          # LocalReader.get in an application's process
}

# Pairs that are part of another's native path: native name -> (the EXTENSIONS entry it is part
# of, its twin). That module's extension calls the part's class in C (a cimport: it needs the
# native class, never the twin's), so it serves natively only when the part does; `report`
# names the modules of EXTENSIONS alone (INFO `native`, the metrics' build info).
PARTS = {
    "near_hits": ("server_get", "store.near_hits"),  # a near cache's hit counter, fed per GET by server_get
}

NO_EXTENSIONS = os.environ.get("KVCACHE_NO_EXTENSIONS", "") not in ("", "0")
REQUIRE_EXTENSIONS = os.environ.get("KVCACHE_REQUIRE_EXTENSIONS", "") not in ("", "0")

# native name -> "native", or why the twin serves
CHOSEN: dict[str, str] = {}


# --------------------------------------------------------------------------- the contracts
# One Protocol per pair (the module), and one per class it hands out (its instances). Members
# with a leading underscore are shared with a subclass on purpose (GetConnection's, which the
# server's ClientConnection extends, whichever twin it is).


class RequestReaderAPI(Protocol):
    """The server's RESP request reader: the GET fast path and the full parser cut one buffer,
    so both twins must cut it alike, at the same offsets."""

    max_request_bytes: int
    max_args: int

    @property
    def buffered(self) -> int: ...  # bytes received, not yet consumed
    def feed(self, data: bytes | bytearray | memoryview) -> None: ...
    def idle(self) -> bool: ...
    def take_gets(self) -> tuple[list[bytes], list[bytes], int] | None: ...  # (headers, keys, start)
    def rewind_gets(self, start: int, lengths: list[bytes], keys: list[bytes], count: int) -> None: ...
    def next_command(self) -> list[bytes] | None: ...
    def take_rest(self) -> bytes: ...  # what is not consumed, handed over (a worker's pipe)


class ReplyReaderAPI(Protocol):
    """The clients' RESP2/RESP3 reply reader (hiredis.Reader's shape): an application gets
    the same values and errors whichever twin its install has."""

    @property
    def buffered(self) -> int: ...
    def feed(self, data: bytes | bytearray | memoryview) -> None: ...
    def has_data(self) -> bool: ...
    def gets(self) -> object: ...  # a reply, or the reader's not_enough_data value


class Resp(Protocol):
    """kvcache.resp and ext/resp.pyx: the RESP readers, one contract so that the server and
    the clients parse the same bytes the same way on either twin."""

    # Not twinned, so not here: the encoders and constants, which the extension re-exports
    # (the twin's own objects).
    GET_LEN: list[bytes]  # GET_LEN[n] == the header take_gets gives a key of n bytes
    ReplyError: type[Exception]

    def RequestReader(self, max_request_bytes: int = ..., max_args: int = ...) -> RequestReaderAPI: ...
    def ReplyReader(self, not_enough_data: object = ...) -> ReplyReaderAPI: ...


class NatsReaderAPI(Protocol):
    """The NATS protocol reader under every NATS connection: the same events from the same
    bytes, in any chunking, whichever twin reads them."""

    max_control_line: int
    max_payload: int

    def feed(self, data: bytes) -> list: ...  # events: Msg, HMsg, Run, PING, PONG, OK, Err, Info
    def buffered(self) -> int: ...
    def add_lane(self, sid: int, prefix_len: int) -> None: ...
    def remove_lane(self, sid: int) -> None: ...


class RunAPI(Protocol):
    """A fast lane's consecutive deliveries (kvcache.natsio.natsproto.Run): the feed applies a
    Run's items and marks whichever twin built it."""

    sid: int
    first_cseq: int
    last_cseq: int
    top_sseq: int
    last_ts: int
    last_pending: int
    items: list
    deletes: int
    marks: list
    ttls: int
    entries: list

    def fields(self) -> tuple: ...  # the values of RUN_FIELDS, in order


class NatsProto(Protocol):
    """kvcache.natsio.natsproto and ext/natsproto.pyx: the NATS protocol reader and the event
    types callers test with `type(e) is ...` (the twin's own, re-exported by the extension)."""

    # Twin only, so not here: decode_headers, status_headers, mark_op (callers, and the
    # extension for mark_op, import the twin's), the types Ping/Pong/Ok (callers take
    # type(PING)), Run's constructor (the extension's ignores its arguments).
    Msg: type
    HMsg: type
    Info: type
    Err: type
    AckMeta: type
    Run: type[RunAPI]  # not built by callers: each twin's reader builds its own
    PING: object
    PONG: object
    OK: object
    RUN_FIELDS: tuple[str, ...]
    MARK_DEL: int
    MARK_PURGE: int
    MAX_CONTROL_LINE: int
    MAX_PAYLOAD: int

    def NatsReader(self, max_control_line: int = ..., max_payload: int = ...) -> NatsReaderAPI: ...
    def parse_ack(self, reply: bytes | str) -> tuple | None: ...  # an AckMeta, or None


class ServerGetsAPI(Protocol):
    """The server's GET fast path: the connection drives it and the metrics read it the
    same way whichever twin serves."""

    cached: int      # near-cache answers not yet counted by a connection
    defer: bool      # answer GET-only reads at the end of the loop's iteration (native only acts on it)
    call_soon: Callable[..., Any] | None
    timed: bool      # keep the latency histogram

    def set_buckets(self, buckets: list[tuple], default: str | None) -> None: ...
    def serve(self, lengths: list, keys: list, proto: int, budget: int) -> tuple[bytes, int, int]: ...
    def answer(self, reader: RequestReaderAPI, data: bytes, proto: int,
               budget: int) -> tuple[bytes, int, int, bool]: ...  # replies, answered, not found, more
    def flush(self) -> None: ...
    def forget_fresh(self) -> None: ...
    def observe(self, ns: int, n: int) -> None: ...
    def latency(self) -> tuple[list[int], int]: ...
    def bucket_reads(self) -> dict[str, tuple[int, int]]: ...
    def cache_reads(self) -> dict[str, tuple[int, int]]: ...


class GetConnectionAPI(Protocol):
    """A connection's hot path, the base of the server's ClientConnection: its subclass
    reads and sets the same state on either twin."""

    gets: ServerGetsAPI
    stats: Any                   # kvcache.stats.Stats
    reader: RequestReaderAPI
    proto: int
    last_cmd: bytes | None
    transport: Any               # asyncio.Transport (a property: it notes the socket)
    # shared with the subclass
    _busy: Any
    _closing: bool
    _paused_writing: bool
    _eof: bool
    _draining: bool
    _muted: bool
    _last_io: int

    def data_received(self, data: bytes) -> None: ...
    def _count(self, local: int, notfound: int) -> None: ...
    def _process(self) -> None: ...  # the subclass's generic request loop


class ServerGet(Protocol):
    """kvcache.serve.server_get and ext/server_get.pyx: the listener builds its ServerGets and every
    connection its GetConnection from the same module."""

    # Not shared, so not here: the extension's ServerGets.close(), .walked, .fallbacks and its
    # module's search() and LMDB_VERSION (lmdb_version() and tests/test_lmdb_walk.py ask the
    # extension for them); the twin's ServerGets.replica, .planner, .plans (the extension's are
    # C fields) and fit_send_buffer().
    def ServerGets(self, replica: Any, planner: Callable[[bytes], Any], writer_here: bool = True) -> ServerGetsAPI: ...
    def GetConnection(self, gets: ServerGetsAPI, stats: Any, reader: RequestReaderAPI) -> GetConnectionAPI: ...


class HitCounterAPI(Protocol):
    """A near cache's hit bookkeeping (its sketch, its sampled LRU moves): the near cache and
    both GET paths hand it hits alike whichever twin keeps them."""

    sketch: Any          # kvcache.store.sketch.FrequencySketch (the store stands a layer above)
    touched: list        # sampled keys not yet moved in the LRU order
    hits: int            # hits taken, since start
    pending: int         # hits not yet handed to the sketch's aging

    def take(self, keys: list[bytes]) -> None: ...  # the GET fast path's hits, a batch
    def read(self, key: bytes) -> None: ...         # a generic read, hit or not
    def drain(self) -> None: ...                    # the sampled keys to the LRU's end


class NearHits(Protocol):
    """kvcache.store.near_hits and ext/near_hits.pyx: what a NearCache builds its hit counter
    from. The native one also has a C entry (`take_one`, ext/kvcache/_native/near_hits.pxd)
    that the GET path's extension calls per hit; not a Python member, so not here."""

    def HitCounter(self, capacity: int, lru: Any) -> HitCounterAPI: ...


class LocalGetAPI(Protocol):
    """LocalReader.get's hot path: one read from a cached plan of a fresh bucket, else
    `slow(key)`, alike on either twin."""

    plans: dict      # key -> (bucket, db, lmdb key, max_age ns or 0)
    fresh_until: dict  # bucket -> monotonic time
    begin: Callable[..., Any]  # the environment's begin(db=...)
    slow: Callable[[str], bytes | None]

    def __call__(self, key: str) -> bytes | None: ...


class AppGet(Protocol):
    """kvcache.app.app_get and ext/app_get.pyx: what LocalReader builds its `get` from."""

    def LocalGet(self, plans: dict, fresh_until: dict, begin: Callable[..., Any],
                 slow: Callable[[str], bytes | None]) -> LocalGetAPI: ...


# native name (a key of EXTENSIONS) -> what its extension and its twin both are
CONTRACTS: dict[str, type] = {
    "resp": Resp,
    "natsproto": NatsProto,
    "server_get": ServerGet,
    "app_get": AppGet,
    "near_hits": NearHits,
}

# what typing puts into a Protocol class besides its members
_PROTOCOL_BOOKKEEPING = frozenset(("_is_protocol", "_is_runtime_protocol"))


def members(contract: type) -> list[str]:
    """The names a Protocol declares (attributes, properties, methods; `__call__` included),
    in declaration order."""
    names: dict[str, None] = {}
    for cls in reversed(contract.__mro__):
        if cls in (object, Protocol) or cls.__module__ == "typing":
            continue
        for name in (*inspect.get_annotations(cls), *cls.__dict__):
            dunder = name.startswith("__") and name.endswith("__")
            if (dunder and name != "__call__") or name in _PROTOCOL_BOOKKEEPING or name.startswith("_abc_"):
                continue
            names[name] = None
    return list(names)


def lacks(module: object, contract: type | None) -> list[str]:
    """The members of `contract` that `module` does not have (none without a contract)."""
    return [] if contract is None else [name for name in members(contract) if not hasattr(module, name)]


class MissingExtension(KvcacheError, ImportError):
    """KVCACHE_REQUIRE_EXTENSIONS is set and an extension is not built or does not import."""


def _load(native: str) -> tuple[ModuleType | None, str]:
    """The extension and "native", or None and why not."""
    full = f"kvcache._native.{native}"
    try:
        return importlib.import_module(full), "native"
    except ModuleNotFoundError as e:
        if e.name in (full, "kvcache._native"):
            return None, "not built"
        return None, f"broken: {e}"
    except ImportError as e:  # built, but does not load (a missing symbol, another Python)
        return None, f"broken: {e}"


def load(name: str) -> ModuleType:
    """The implementation serving `name` (a key of EXTENSIONS or PARTS), chosen and recorded: a
    module that meets CONTRACTS[name] (typed as a module here, so that callers can subclass
    its classes and name them in annotations)."""
    return pick(name, EXTENSIONS[name] if name in EXTENSIONS else PARTS[name][1])


def pick(native: str, twin: str) -> ModuleType:
    """`kvcache._native.<native>` when built, allowed and complete (every member of its
    contract) and its PARTS are native too, else `kvcache.<twin>` (recorded in CHOSEN; an
    error instead when extensions are required)."""
    if NO_EXTENSIONS:
        CHOSEN[native] = "twin (KVCACHE_NO_EXTENSIONS=1)"
        return importlib.import_module(f"kvcache.{twin}")
    module, why = _load(native)
    missing = lacks(module, CONTRACTS.get(native)) if module is not None else []
    if missing:  # built from an older ext/<native>.pyx than its twin's contract
        module, why = None, f"broken: lacks {', '.join(missing)} (a stale build?)"
    for part, (whole, part_twin) in PARTS.items():
        if module is not None and whole == native and not is_native(pick(part, part_twin)):
            module, why = None, f"its part {part} is {CHOSEN[part]}"
    if module is not None:
        CHOSEN[native] = "native"
        return module
    if REQUIRE_EXTENSIONS:
        raise MissingExtension(f"kvcache._native.{native} is {why} and KVCACHE_REQUIRE_EXTENSIONS=1: "
                               "build it (pip install -e . with a C compiler and the Python headers)")
    CHOSEN[native] = f"twin ({why})"
    return importlib.import_module(f"kvcache.{twin}")


def native_or_none(native: str) -> ModuleType | None:
    """For tests that compare an extension with its twin: the extension, or None when it is
    not built; with KVCACHE_REQUIRE_EXTENSIONS=1 a missing one fails instead of skipping."""
    module, why = _load(native)
    if module is None and REQUIRE_EXTENSIONS:
        raise MissingExtension(f"kvcache._native.{native} is {why} and KVCACHE_REQUIRE_EXTENSIONS=1")
    return module


def report() -> dict[str, str]:
    """Which implementation serves each module (every one chosen now if not yet)."""
    for native, twin in EXTENSIONS.items():
        if native not in CHOSEN:
            pick(native, twin)
    return {native: CHOSEN[native] for native in EXTENSIONS}


def lmdb_version() -> str:
    """The LMDB compiled into the native GET path ("0.9.36"), or "" when its twin serves (which
    reads through py-lmdb's)."""
    if report()["server_get"] != "native":
        return ""
    full = importlib.import_module("kvcache._native.server_get").LMDB_VERSION  # "LMDB 0.9.36: (date)"
    return full.split()[1].rstrip(":")


def all_native() -> bool:
    return all(v == "native" for v in report().values())


def is_native(module: ModuleType) -> bool:
    return module.__name__.startswith("kvcache._native.")
