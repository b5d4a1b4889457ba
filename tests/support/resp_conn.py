"""A raw RESP connection for the tests that check exact bytes, pushes included: buffered, so
a push read past stays for the next `read`."""
from __future__ import annotations

import socket

from kvcache.app.client import encode_command as encode


class RespConn:
    """TCP (`address` a (host, port)) or a Unix socket (`address` a path)."""

    def __init__(self, address: str | tuple[str, int], timeout: float = 10) -> None:
        if isinstance(address, tuple):
            self.s = socket.create_connection(address, timeout=timeout)
        else:
            self.s = socket.socket(socket.AF_UNIX)
            self.s.settimeout(timeout)
            self.s.connect(address)
        self.timeout = timeout
        self.buf = b""

    def send(self, *args: str | bytes) -> None:
        self.s.sendall(encode(list(args)))

    def read(self, until: bytes) -> bytes:
        """Everything up to and including `until` (the rest stays buffered)."""
        while until not in self.buf:
            chunk = self.s.recv(65536)
            if not chunk:
                raise EOFError(self.buf)
            self.buf += chunk
        i = self.buf.index(until) + len(until)
        out, self.buf = self.buf[:i], self.buf[i:]
        return out

    def call(self, *args: str | bytes, until: bytes = b"\r\n") -> bytes:
        self.send(*args)
        return self.read(until)

    def nothing_for(self, seconds: float) -> bool:
        """True when nothing arrives (and nothing is buffered) for `seconds`."""
        self.s.settimeout(seconds)
        try:
            chunk = self.s.recv(65536)
        except TimeoutError:
            return not self.buf
        finally:
            self.s.settimeout(self.timeout)
        self.buf += chunk
        return False

    def close(self) -> None:
        self.s.close()
