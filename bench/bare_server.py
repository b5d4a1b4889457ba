"""The bare server: a Protocol on uvloop that answers every GET of a socket read with the
same bulk reply, looking nothing up, the baseline under any server on uvloop.

What it costs per request (uvloop's read callback into Python, one bytes object in, one
write out, the system calls) is the least a Python server on uvloop can spend; socket_bench
--bare measures it beside kvcache and redis-server, so that a gap between kvcache and
redis-server can be told apart into what kvcache does and what the event loop costs.

    python bench/bare_server.py SOCKET VALUE_SIZE [--gather]

--gather holds each read's reply until the event loop's iteration ends and writes them then,
as kvcache's GET path does with two or more clients (and redis-server before it sleeps).
"""
from __future__ import annotations

import asyncio
import os
import signal
import sys

import uvloop

GET_UNIT = b"*2\r\n$3\r\nGET\r\n"


class BareServer(asyncio.Protocol):
    def __init__(self, reply: bytes, gather: list | None) -> None:
        self.reply = reply
        self.replies = [reply * n for n in range(65)]
        self.write = None
        self.gather = gather  # a list shared by the connections: replies held to the iteration's end

    def connection_made(self, transport) -> None:
        self.write = transport.write

    def data_received(self, data: bytes) -> None:
        n = data.count(GET_UNIT)
        if n == 0:  # redis-benchmark's CONFIG GET at start: an empty array will do
            out = b"*0\r\n"
        else:
            out = self.replies[n] if n <= 64 else self.reply * n
        if self.gather is None:
            self.write(out)
            return
        if not self.gather:
            asyncio.get_running_loop().call_soon(flush, self.gather)
        self.gather.append((self.write, out))


def flush(gather: list) -> None:
    for write, out in gather:
        write(out)
    gather.clear()


async def serve(path: str, value_size: int, gather: bool) -> None:
    reply = b"$%d\r\n%s\r\n" % (value_size, b"x" * value_size)
    loop = asyncio.get_running_loop()
    held: list | None = [] if gather else None
    server = await loop.create_unix_server(lambda: BareServer(reply, held), path)
    stop = loop.create_future()
    loop.add_signal_handler(signal.SIGTERM, stop.set_result, None)
    async with server:
        await stop
    os.unlink(path)


if __name__ == "__main__":
    uvloop.run(serve(sys.argv[1], int(sys.argv[2]), "--gather" in sys.argv[3:]))
