"""The metrics listener (`metrics_listen`): Prometheus's /metrics, and /healthz and /readyz
for probes, over HTTP/1.1 on the sidecar's own event loop.

On the loop rather than prometheus_client's threaded server because the numbers are the
sidecar's live objects (dicts the loop changes): the snapshot is taken between two callbacks,
so a scrape sees one state and needs no lock, and the exposition is formatted a family at a
time with the loop free in between (kvcache.ops.metrics.exposition; a thread would not help: it
would hold the GIL the loop needs). The HTTP it speaks is what scrapers and probes send: GET
or HEAD, no body, keep-alive; anything else gets a status line and, where the request cannot
be trusted further, the connection closed.
"""
from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable

from ..errors import KvcacheError

log = logging.getLogger("kvcache.metrics")

MAX_HEAD = 16 * 1024  # request line and headers
IDLE_S = 60.0  # a keep-alive connection idle this long is closed (Prometheus scrapes every 15 s)
MAX_CONNECTIONS = 64  # scrapers and probes are few; more is a mistake or an attack
REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
           500: "Internal Server Error", 503: "Service Unavailable"}


class MetricsServer:
    """Serves /metrics: `scrape(accept)` gives the body and its content type; /healthz
    answers 200 while the sidecar's loop runs; /readyz answers 200 or 503 with `ready()`'s one
    line (kvcache.ops.health)."""

    def __init__(self, scrape: Callable[[str], Awaitable[tuple[bytes, str]]],
                 ready: Callable[[], tuple[bool, str]]) -> None:
        self.scrape = scrape
        self.ready = ready
        self.scrapes = 0
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task] = set()

    async def start(self, host: str, port: int, setting: str) -> str:
        """Listen; returns the bound address (port 0 asks for any free one)."""
        try:
            self._server = await asyncio.start_server(self._serve, host, port, limit=MAX_HEAD)
        except OSError as e:  # uvloop's message is its own: the errno's text reads as the RESP listeners'
            why = os.strerror(e.errno) if e.errno else str(e)
            raise KvcacheError(f"cannot listen on metrics_listen {setting}: {why}") from None
        bound = self._server.sockets[0].getsockname()
        return f"[{bound[0]}]:{bound[1]}" if ":" in bound[0] else f"{bound[0]}:{bound[1]}"

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for task in list(self._conns):
            task.cancel()
        if self._conns:
            await asyncio.wait(self._conns)
        await self._server.wait_closed()
        self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._conns) >= MAX_CONNECTIONS:
            writer.close()
            return
        self._conns.add(task)
        try:
            while await self._one(reader, writer):
                pass
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass
        except asyncio.LimitOverrunError:
            self._write(writer, 400, b"request head too large\n", close=True)
        finally:
            self._conns.discard(task)
            writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; False to close the connection."""
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), IDLE_S)
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            self._write(writer, 400, b"malformed request line\n", close=True)
            return False
        method, target, version = parts
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if line:
                name, sep, value = line.partition(":")
                if not sep:
                    self._write(writer, 400, b"malformed header\n", close=True)
                    return False
                headers[name.strip().lower()] = value.strip()
        close = headers.get("connection", "").lower() == "close" or (
            version == "HTTP/1.0" and headers.get("connection", "").lower() != "keep-alive")
        if headers.get("content-length", "0") != "0" or "transfer-encoding" in headers:
            self._write(writer, 400, b"a request body is not expected\n", close=True)
            return False
        if method not in ("GET", "HEAD"):
            self._write(writer, 405, b"GET or HEAD only\n", close=close, extra=b"Allow: GET, HEAD\r\n")
            return not close
        path = target.split("?", 1)[0]
        head_only = method == "HEAD"
        if path == "/metrics":
            try:
                body, content_type = await self.scrape(headers.get("accept", ""))
            except Exception:  # a bug in a collector costs this scrape, never the sidecar
                log.exception("metrics: the scrape failed")
                self._write(writer, 500, b"the scrape failed: see the sidecar's log\n", close=True)
                return False
            self.scrapes += 1
            self._write(writer, 200, body, close=close, content_type=content_type, head_only=head_only)
        elif path == "/healthz":
            self._write(writer, 200, b"live\n", close=close, head_only=head_only)
        elif path == "/readyz":
            ok, why = self.ready()
            self._write(writer, 200 if ok else 503, why.encode() + b"\n", close=close, head_only=head_only)
        else:
            self._write(writer, 404, b"not found: /metrics, /healthz and /readyz are served here\n",
                        close=close, head_only=head_only)
        await writer.drain()
        return not close

    @staticmethod
    def _write(writer: asyncio.StreamWriter, status: int, body: bytes, close: bool,
               content_type: str = "text/plain; charset=utf-8", head_only: bool = False,
               extra: bytes = b"") -> None:
        writer.write(b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s%s\r\n" % (
            status, REASONS[status].encode(), content_type.encode(), len(body), extra,
            b"Connection: close\r\n" if close else b""))
        if not head_only:
            writer.write(body)
