"""Python clients for the sidecar's Unix socket: blocking `Client`, asyncio `AsyncClient`.

Every operation is written once, as a generator that yields the commands it needs and is sent
their replies (`_Op`); the two classes only move bytes. So SCAN paging, the KEYS fallback,
KV.GET decoding and INFO parsing cannot drift apart between them. `Client` uses nothing but
the `socket` module, so gevent's monkeypatching (locust) makes it cooperative.
"""
from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Generator, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

from kvcache import native
from kvcache.entry import Entry, Operation
from kvcache.errors import KvcacheError
from kvcache.resp import ReplyError

if TYPE_CHECKING:
    from kvcache.resp import ReplyReader as TwinReplyReader

# The reply parser: the Cython extension when built, else its pure-Python twin (same API).
ReplyReader = native.load("resp").ReplyReader

__all__ = [
    "Arg",
    "AsyncClient",
    "Client",
    "ConnectionFailed",
    "ResponseError",
    "encode_command",
    "parse_info",
]

Arg = str | bytes | bytearray | memoryview | int | float
T = TypeVar("T")
_Op = Generator[Sequence[Arg], Any, T]  # sent: a decoded reply, whatever the command's shape
"""An operation: yields commands, is sent each reply (or thrown its ResponseError), returns
its result."""

_READ_SIZE = 256 * 1024
# How long one XREAD of watch() waits for a change before asking again (below the timeout)
WATCH_BLOCK_MS = 2000
_INCOMPLETE = object()  # ReplyReader's "no full reply yet", distinct from a RESP3 false


class ResponseError(KvcacheError):
    """The server answered with an error reply (`ERR ...`, `READONLY ...`)."""


class ConnectionFailed(KvcacheError, ConnectionError):
    """The socket could not be reached, broke, timed out or sent garbage. The connection is
    dropped; the next call opens a new one."""


# --------------------------------------------------------------------------- shared codec


def encode_command(args: Sequence[Arg]) -> bytes:
    """A RESP multibulk request: binary safe, unlike the inline form."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, str):
            data: bytes | bytearray | memoryview = arg.encode()
        elif isinstance(arg, (bytes, bytearray, memoryview)):
            data = arg
        elif isinstance(arg, (int, float)) and not isinstance(arg, bool):
            data = repr(arg).encode()
        else:
            raise TypeError(f"cannot send {type(arg).__name__} as a command argument")
        parts.append(b"$%d\r\n%b\r\n" % (len(data), bytes(data)))
    return b"".join(parts)


def _text(value: object) -> str:
    if isinstance(value, (bytes, bytearray)):
        return value.decode("utf-8", "surrogateescape")
    return str(value)


def _info_value(value: str) -> object:
    """redis-py's INFO value rules: numbers become int/float, `a=1,b=x` a dict, `a,b` a list."""
    if "," not in value and "=" not in value:
        try:
            return float(value) if "." in value else int(value)
        except ValueError:
            return value
    if "=" not in value:
        return [_info_value(v) for v in value.split(",") if v]
    fields: dict[str, object] = {}
    for item in value.split(","):
        if not item:
            continue
        if "=" in item:
            k, v = item.rsplit("=", 1)
            fields[k] = _info_value(v)
        else:
            fields[item] = True
    return fields


def parse_info(text: str) -> dict[str, dict[str, object]]:
    """INFO text → {section name in lower case: {field: value}}."""
    sections: dict[str, dict[str, object]] = {}
    current = sections.setdefault("", {})
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("#"):
            current = sections.setdefault(line.lstrip("#").strip().lower(), {})
        elif ":" in line:
            key, value = line.split(":", 1)
            current[key] = _info_value(value)
    if not sections[""]:
        del sections[""]
    return sections


def _entry_from_reply(bucket: str, key: str, reply: object) -> Entry | None:
    """KV.GET's array [value, revision, created_ns, operation, source] → Entry."""
    if reply is None:
        return None
    if not isinstance(reply, list) or len(reply) < 5:
        raise ResponseError(f"unexpected KV.GET reply: {reply!r}")
    value, revision, created, operation, source = reply[:5]
    return Entry(
        bucket=bucket,
        key=key,
        value=None if value is None else bytes(value),
        revision=int(_text(revision)),
        created=int(_text(created)),
        operation=Operation.from_header(_text(operation)),
        source=_text(source),
    )


# --------------------------------------------------------------------------- operations


def _execute(args: Sequence[Arg]) -> _Op[object]:
    return (yield args)


def _ping() -> _Op[bool]:
    reply = yield ("PING",)
    if reply != b"PONG":
        raise ResponseError(f"unexpected PING reply: {reply!r}")
    return True


def _get(key: str) -> _Op[bytes | None]:
    return (yield ("GET", key))


def _mget(keys: Sequence[str]) -> _Op[list[bytes | None]]:
    if not keys:
        return []
    return (yield ("MGET", *keys))


def _entry(key: str, consistency: str | None, max_stale_ms: int | None,
           min_rev: int | None) -> _Op[Entry | None]:
    args: list[Arg] = ["KV.GET", key]
    if consistency is not None:
        args += ["CONSISTENCY", consistency]
    if max_stale_ms is not None:
        args += ["MAXSTALE", int(max_stale_ms)]
    if min_rev is not None:
        args += ["MINREV", int(min_rev)]
    reply = yield args
    bucket, sep, name = key.partition(":")
    if not sep:
        # A bare key reads the default bucket, which only the server knows.
        bucket, name = "", key
        if reply is not None:
            info = parse_info(_text((yield ("INFO", "server"))))
            bucket = str(info.get("server", {}).get("default_bucket", ""))
    return _entry_from_reply(bucket, name, reply)


def _keys(pattern: str) -> _Op[list[str]]:
    """SCAN rather than KEYS so a big replica is never listed in one reply; KEYS only for a
    server without SCAN. SCAN may repeat a key: keep the first."""
    seen: dict[str, None] = {}
    cursor: bytes = b"0"
    try:
        while True:
            reply = yield ("SCAN", cursor, "MATCH", pattern, "COUNT", 1000)
            cursor, batch = reply
            seen.update(dict.fromkeys(map(_text, batch)))
            if cursor in (b"0", 0):
                return list(seen)
    except ResponseError:
        pass
    reply = yield ("KEYS", pattern)
    return list(dict.fromkeys(map(_text, reply)))


def _stream_entries(bucket: str, reply: object) -> list[Entry]:
    """An XREAD reply on `@bucket` (RESP2: [[name, [[id, [field, value, ...]], ...]]], or
    None when nothing came) as Entries: value None for a delete or purge."""
    if reply is None:
        return []
    try:
        [(_, rows)] = cast("list[tuple[bytes, list]]", reply)
        out = []
        for entry_id, flat in rows:
            fields = dict(zip(flat[::2], flat[1::2], strict=True))
            out.append(Entry(bucket=bucket, key=_text(fields[b"key"]), value=fields.get(b"value"),
                             revision=int(_text(entry_id).partition("-")[0]),
                             created=int(_text(fields[b"created"])),
                             operation=Operation.from_header(_text(fields[b"op"]))))
        return out
    except (TypeError, ValueError, KeyError):
        raise ResponseError(f"unexpected XREAD reply: {reply!r:.200}") from None


def _check_block(block_ms: int, timeout: float | None) -> None:
    """watch()'s XREAD must come back before the client gives up on the connection."""
    if timeout is not None and block_ms >= timeout * 1000:
        raise ValueError(f"block_ms {block_ms} must be below the client's timeout ({timeout}s)")


def _xread(bucket: str, keys: str | None, after: int, count: int, block_ms: int) -> _Op[list[Entry]]:
    stream = f"@{bucket}" if keys is None else f"@{bucket}:{keys}"
    reply = yield ("XREAD", "COUNT", count, "BLOCK", block_ms, "STREAMS", stream, f"{after}-0")
    return _stream_entries(bucket, reply)


def _info(section: str | None) -> _Op[dict[str, dict[str, object]]]:
    reply = yield ("INFO",) if section is None else ("INFO", section)
    return parse_info(_text(reply))


def _step(op: _Op[T], reply: object) -> Sequence[Arg]:
    """Advance `op` with a reply; error replies are thrown into it so an operation can
    recover (the KEYS fallback). StopIteration carries the result out."""
    if isinstance(reply, ReplyError):
        return op.throw(ResponseError(str(reply)))
    return op.send(reply)


# --------------------------------------------------------------------------- blocking


class Client:
    """Blocking client. Connects on first use and again after a broken connection; one
    request at a time, so share it between threads only behind a lock."""

    def __init__(self, socket_path: str, timeout: float | None = 5.0) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._reader: TwinReplyReader | None = None  # the native one has the same API

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self.socket_path)
        except BaseException:
            sock.close()
            raise
        self._sock, self._reader = sock, ReplyReader(_INCOMPLETE)
        return sock

    def _roundtrip(self, args: Sequence[Arg]) -> object:
        request = encode_command(args)
        try:
            sock = self._sock or self._connect()
            reader = self._reader
            assert reader is not None
            sock.sendall(request)
            while (reply := reader.gets()) is _INCOMPLETE:
                data = sock.recv(_READ_SIZE)
                if not data:
                    raise ConnectionResetError("connection closed by the server")
                reader.feed(data)
            return reply
        except BaseException as exc:
            # the reply stream is out of step (or gone): never reuse this connection
            self.close()
            if isinstance(exc, (OSError, KvcacheError)):
                raise ConnectionFailed(f"kvcache at {self.socket_path}: {exc}") from exc
            raise

    def _run(self, op: _Op[T]) -> T:
        try:
            args = next(op)
            while True:
                args = _step(op, self._roundtrip(args))
        except StopIteration as stop:
            return stop.value

    def close(self) -> None:
        sock, self._sock, self._reader = self._sock, None, None
        if sock is not None:
            sock.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def execute(self, *args: Arg) -> Any:
        """Any command, reply as parsed; an error reply raises ResponseError."""
        return self._run(_execute(args))

    def ping(self) -> bool:
        return self._run(_ping())

    def get(self, key: str) -> bytes | None:
        return self._run(_get(key))

    def mget(self, keys: Sequence[str]) -> list[bytes | None]:
        return self._run(_mget(keys))

    def entry(self, key: str, consistency: str | None = None, max_stale_ms: int | None = None,
              min_rev: int | None = None) -> Entry | None:
        """The value with its KV metadata; None when the key does not exist."""
        return self._run(_entry(key, consistency, max_stale_ms, min_rev))

    def keys(self, pattern: str = "*") -> list[str]:
        return self._run(_keys(pattern))

    def watch(self, bucket: str, after: int = 0, count: int = 1000,
              block_ms: int = WATCH_BLOCK_MS, keys: str | None = None) -> Iterator[Entry]:
        """Follow a bucket through its stream `@bucket` (docs/commands.md, "Streams"), or only
        the keys a filter matches (`keys="feature.*"`: the stream `@bucket:feature.*`, as NATS
        KV's watch("feature.*") does): every
        key whose latest change is above revision `after` (0: the whole bucket first), then
        each change as the sidecar applies it, in revision order, for as long as the caller
        iterates. A delete or purge is an Entry with value None (its `operation` says which).
        Keep the last entry's revision to resume from it, after a restart of either side.
        An error reply (the replica stale or resyncing, a revision no longer answered
        exactly) raises ResponseError: read again from the last revision, or from 0 when
        the error says so. `block_ms` must stay below the client's timeout."""
        _check_block(block_ms, self.timeout)
        last = after
        while True:
            for entry in self._run(_xread(bucket, keys, last, count, block_ms)):
                last = entry.revision
                yield entry

    def info(self, section: str | None = None) -> dict[str, dict[str, object]]:
        return self._run(_info(section))


# --------------------------------------------------------------------------- asyncio


class AsyncClient:
    """asyncio client. Concurrent calls on one instance are serialized by a lock (one
    request in flight per connection); a call cancelled mid-reply drops the connection."""

    def __init__(self, socket_path: str, timeout: float | None = 5.0) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self._lock = asyncio.Lock()
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._reader: TwinReplyReader | None = None  # the native one has the same API

    async def _roundtrip(self, args: Sequence[Arg]) -> object:
        request = encode_command(args)
        try:
            async with asyncio.timeout(self.timeout):
                if self._streams is None:
                    self._streams = await asyncio.open_unix_connection(self.socket_path)
                    self._reader = ReplyReader(_INCOMPLETE)
                stream, writer = self._streams
                reader = self._reader
                assert reader is not None
                writer.write(request)
                await writer.drain()
                while (reply := reader.gets()) is _INCOMPLETE:
                    data = await stream.read(_READ_SIZE)
                    if not data:
                        raise ConnectionResetError("connection closed by the server")
                    reader.feed(data)
                return reply
        except BaseException as exc:
            self._drop()
            if isinstance(exc, (OSError, KvcacheError)):  # TimeoutError is an OSError
                raise ConnectionFailed(f"kvcache at {self.socket_path}: {exc}") from exc
            raise

    async def _run(self, op: _Op[T]) -> T:
        async with self._lock:
            try:
                args = next(op)
                while True:
                    args = _step(op, await self._roundtrip(args))
            except StopIteration as stop:
                return stop.value

    def _drop(self) -> None:
        streams, self._streams, self._reader = self._streams, None, None
        if streams is not None:
            streams[1].close()

    async def aclose(self) -> None:
        streams = self._streams
        self._drop()
        if streams is not None:
            try:
                await streams[1].wait_closed()
            except OSError:
                pass

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def execute(self, *args: Arg) -> Any:
        """Any command, reply as parsed; an error reply raises ResponseError."""
        return await self._run(_execute(args))

    async def ping(self) -> bool:
        return await self._run(_ping())

    async def get(self, key: str) -> bytes | None:
        return await self._run(_get(key))

    async def mget(self, keys: Sequence[str]) -> list[bytes | None]:
        return await self._run(_mget(keys))

    async def entry(self, key: str, consistency: str | None = None,
                    max_stale_ms: int | None = None, min_rev: int | None = None) -> Entry | None:
        """The value with its KV metadata; None when the key does not exist."""
        return await self._run(_entry(key, consistency, max_stale_ms, min_rev))

    async def keys(self, pattern: str = "*") -> list[str]:
        return await self._run(_keys(pattern))

    async def watch(self, bucket: str, after: int = 0, count: int = 1000,
                    block_ms: int = WATCH_BLOCK_MS, keys: str | None = None) -> AsyncIterator[Entry]:
        """Client.watch, for asyncio: `async for entry in client.watch("config"): ...`."""
        _check_block(block_ms, self.timeout)
        last = after
        while True:
            for entry in await self._run(_xread(bucket, keys, last, count, block_ms)):
                last = entry.revision
                yield entry

    async def info(self, section: str | None = None) -> dict[str, dict[str, object]]:
        return await self._run(_info(section))
