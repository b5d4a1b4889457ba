"""`kvcache cli COMMAND [ARG ...]`: one command over the sidecar's socket, its reply printed
as `redis-cli` prints it in a terminal, so the README's examples run on a machine without
Debian's redis-tools (the demo installs nothing outside its virtualenv).

The reply is read here, type by type, rather than through kvcache.app.client: redis-cli
tells a status (`OK`) from a bulk string (`"OK"`) and an empty array from a nil one, and so
must this. RESP2 only: the connection never sends HELLO.
"""
from __future__ import annotations

import socket
from typing import BinaryIO

# redis-cli prints these commands' bulk replies as they are, not quoted (cliSendCommand's
# raw-output list): their text is meant for a person
_RAW = {"info", "client", "memory", "latency", "lolwut"}


class _Error(str):
    """An error reply, kept apart from a status reply for the printer."""


class _Status(str):
    """A status reply (`+OK`): redis-cli prints it without quotes."""


def call(path: str, args: list[str], timeout: float = 10.0) -> tuple[str, bool]:
    """Send one command to the sidecar at `path`; the reply as redis-cli would print it,
    and whether it was an error reply. OSError when the socket cannot be reached."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(_request([a.encode() for a in args]))
        reply = _read(s.makefile("rb"))
    raw = bool(args) and args[0].lower() in _RAW
    return _format(reply, raw), isinstance(reply, _Error)


def _request(args: list[bytes]) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


def _read(f: BinaryIO) -> object:
    line = f.readline()
    if not line.endswith(b"\r\n"):
        raise ConnectionError("the sidecar closed the connection before replying")
    kind, rest = line[:1], line[1:-2]
    if kind == b"+":
        return _Status(rest.decode(errors="replace"))
    if kind == b"-":
        return _Error(rest.decode(errors="replace"))
    if kind == b":":
        return int(rest)
    if kind == b"$":
        n = int(rest)
        if n < 0:
            return None
        data = f.read(n + 2)
        return data[:-2]
    if kind == b"*":
        n = int(rest)
        return None if n < 0 else [_read(f) for _ in range(n)]
    raise ConnectionError(f"unexpected reply from the sidecar: {line[:64]!r}")


def _quoted(b: bytes) -> str:
    """A bulk string as redis-cli quotes it (sdscatrepr): printable ASCII as is, `\\n`,
    `\\r`, `\\t`, `\\a`, `\\b`, `\\"`, `\\\\` escaped, other bytes as `\\xHH`."""
    out = ['"']
    for c in b:
        ch = chr(c)
        if ch in '\\"':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\a":
            out.append("\\a")
        elif ch == "\b":
            out.append("\\b")
        elif 32 <= c < 127:
            out.append(ch)
        else:
            out.append(f"\\x{c:02x}")
    out.append('"')
    return "".join(out)


def _format(reply: object, raw: bool, indent: int = 0) -> str:
    if isinstance(reply, _Error):
        return f"(error) {reply}"
    if isinstance(reply, _Status):
        return str(reply)
    if isinstance(reply, int):
        return f"(integer) {reply}"
    if reply is None:
        return "(nil)"
    if isinstance(reply, bytes):
        return reply.decode(errors="replace") if raw else _quoted(reply)
    assert isinstance(reply, list)
    if not reply:
        return "(empty array)"
    width = len(str(len(reply)))
    lines = []
    for i, item in enumerate(reply, 1):
        head = f"{i:>{width}}) "
        body = _format(item, raw, indent + len(head))
        lines.append((" " * indent if i > 1 else "") + head + body)
    return "\n".join(lines)
