"""What answers at a NATS URL's address, found in one look before nats-py is given it.

A nats-server sends `INFO {...}` the moment it accepts a connection; nats-py waits for that line
and, when something else comes or nothing does, says `empty response from server when
expecting INFO message` or `timed out`. The look says what it found instead:

- nothing listening (connection refused), or no answer to the TCP connect at all;
- a NATS server, with its INFO (whether it requires TLS or credentials);
- another protocol's first words: a banner sent at once (`SSH-2.0-...`, `+OK`), or, from a
  service that waits to be spoken to (Redis, HTTP), its answer to `PING\\r\\n` (which a NATS
  server would answer too, were it one): `+PONG`, `-NOAUTH`, `HTTP/1.1 400`;
- a TLS port: silent in plaintext, but a TLS handshake gets an answer (a NATS server with
  `handshake_first`, or any TLS service);
- silence until the deadline, or a connection closed without a word.

One TCP connection (and, for a silent port, one TLS attempt), closed at once; no CONNECT is
sent. Standard library only: `kvcache load`'s Spark executors import it from the --py-files
bundle (kvcache.pipeline.bundle).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

# What was found at an address (Found.kind)
NATS, REFUSED, NO_ANSWER, SILENT, CLOSED, BANNER, TLS, ERROR = (
    "nats", "refused", "no answer", "silent", "closed", "banner", "tls", "error")
# How long a port may stay silent before it is spoken to (PING) and offered a TLS handshake (a
# quarter of the time left, when that is less): a nats-server sends INFO at once, so this
# only delays finding out what a silent port is.
NUDGE_S = 0.5
# The most of a banner a message quotes
QUOTED_BYTES = 40
# Known first words, for the message's guess at what answered instead
_GUESSES = (("SSH-", "an SSH server"), ("HTTP/", "an HTTP server"), ("+PONG", "a Redis server"),
            ("-NOAUTH", "a Redis server"), ("-ERR", "a Redis server"), ("+OK", "a POP3 server"),
            ("220", "an SMTP or FTP server"), ("* OK", "an IMAP server"), ("AMQP", "an AMQP server"))


@dataclass
class Found:
    """What answered at `address` (host:port): `kind` is one of the constants above."""

    address: str
    kind: str
    info: dict[str, Any] = field(default_factory=dict)  # a NATS server's INFO
    said: bytes = b""      # a banner's first bytes
    after_ping: bool = False  # ... said only once spoken to
    error: str = ""        # ERROR's reason
    took_s: float = 0.0

    def describe(self, budget_s: float) -> str:
        """What was found, for `cannot connect to NATS at URL: ...`."""
        if self.kind == REFUSED:
            return "nothing listening there (connection refused)"
        if self.kind == NO_ANSWER:
            return (f"no answer to a TCP connect within {budget_s:g}s (a host that drops packets: "
                    "a firewall, a wrong address?)")
        if self.kind == SILENT:
            return (f"no NATS INFO within {budget_s:g}s: is this a NATS port? (it accepted the "
                    "connection and said nothing, not even to a TLS handshake)")
        if self.kind == CLOSED:
            return ("the connection was accepted and closed without a NATS INFO: is this a NATS "
                    "port? (a server at its connection limit closes new ones so, too)")
        if self.kind == TLS:
            return ("TLS expected: the port answers a TLS handshake and says nothing in plaintext, "
                    "where a NATS server sends INFO first (a NATS server with TLS handshake_first, "
                    "which kvcache does not speak, or another TLS service)")
        if self.kind == BANNER:
            text = self.said[:QUOTED_BYTES].decode("utf-8", "backslashreplace").replace("\r", "\\r").replace(
                "\n", "\\n")
            guess = next((who for start, who in _GUESSES if self.said.startswith(start.encode())), "")
            how = "answered PING with" if self.after_ping else "said"
            return (f"not a NATS server: it {how} '{text}'{'...' if len(self.said) > QUOTED_BYTES else ''} "
                    f"where a NATS server sends INFO first{f' ({guess}?)' if guess else ''}")
        if self.kind == ERROR:
            return self.error
        return "a NATS server"


def address_of(url: str) -> tuple[str, int]:
    """The host and port a NATS URL names (credentials and scheme aside; 4222 by default)."""
    uri = urlparse(url if "://" in url else f"nats://{url}")
    return uri.hostname or "", uri.port or 4222


class Look:
    """One look at `url`'s address. `found` is what it has found so far, so that a look cut
    short (the connection's budget spent) still tells: no answer to the TCP connect yet, or
    connected and silent."""

    def __init__(self, url: str) -> None:
        self.host, self.port = address_of(url)
        self.found = Found(f"{self.host}:{self.port}", NO_ANSWER)

    async def run(self, deadline: float) -> Found:
        """Find out what answers there, by `deadline` (the event loop's clock)."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            self.found = await self._look(deadline)
        finally:
            self.found.took_s = loop.time() - start
        return self.found

    async def _look(self, deadline: float) -> Found:
        host, port, address = self.host, self.port, self.found.address
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), _left(deadline))
        except ConnectionRefusedError:
            return Found(address, REFUSED)
        except TimeoutError:
            return Found(address, NO_ANSWER)
        except OSError as e:
            return Found(address, ERROR, error=e.strerror or str(e) or type(e).__name__)
        self.found = Found(address, SILENT)
        return await _listen(host, port, address, reader, writer, deadline)


async def look(url: str, deadline: float) -> Found:
    """What answers at `url`'s address, found by `deadline` (see Look)."""
    return await Look(url).run(deadline)


async def _listen(host: str, port: int, address: str, reader: asyncio.StreamReader,
                  writer: asyncio.StreamWriter, deadline: float) -> Found:
    """Connected: what the peer says first, or to PING, or whether it speaks TLS."""
    loop = asyncio.get_running_loop()
    tls_probe: asyncio.Task | None = None
    try:
        said: bytes | str | None = await _first_words(reader, loop.time() + min(NUDGE_S, _left(deadline) / 4))
        after_ping = said is None
        if said is None:  # silent so far: speak to it, and offer TLS on a second connection
            tls_probe = asyncio.ensure_future(_answers_tls(host, port, deadline))
            with contextlib.suppress(OSError):
                writer.write(b"PING\r\n")
            said = await _until_words_or_tls(reader, tls_probe, deadline)
        if said == TLS:
            return Found(address, TLS)
        if said is None:
            return Found(address, SILENT)
        assert isinstance(said, bytes)
        if not said:
            return Found(address, CLOSED)
        return _words(address, said, after_ping and not said.startswith(b"INFO"))
    finally:
        if tls_probe is not None and not tls_probe.done():
            tls_probe.cancel()
            await asyncio.wait({tls_probe})
        writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(writer.wait_closed(), 1)


def _words(address: str, said: bytes, after_ping: bool) -> Found:
    if said.startswith(b"INFO "):
        try:
            info = json.loads(said[5:].split(b"\r\n", 1)[0])
        except ValueError:
            info = None
        if isinstance(info, dict):
            return Found(address, NATS, info=info)
    return Found(address, BANNER, said=said, after_ping=after_ping)


def _left(deadline: float) -> float:
    return max(0.0, deadline - asyncio.get_running_loop().time())


async def _first_words(reader: asyncio.StreamReader, until: float) -> bytes | None:
    """The first bytes the peer sends (a whole line when it starts with INFO), b"" when it
    closes first, None when it says nothing by `until`."""
    try:
        data = await asyncio.wait_for(reader.read(4096), _left(until))
    except TimeoutError:
        return None
    except OSError:
        return b""
    while data.startswith(b"INFO") and b"\n" not in data and len(data) < 1 << 16:
        try:
            more = await asyncio.wait_for(reader.read(4096), _left(until) or 0.5)
        except (TimeoutError, OSError):
            break
        if not more:
            break
        data += more
    return data


async def _until_words_or_tls(reader: asyncio.StreamReader, tls_probe: asyncio.Task,
                              deadline: float) -> bytes | str | None:
    """After the PING: the peer's first words, TLS when it answered the TLS handshake while
    silent in plaintext, b"" when it closed (and TLS did not answer), None when nothing came
    by `deadline`."""
    words = asyncio.ensure_future(_first_words(reader, deadline))
    try:
        pending: set[asyncio.Future] = {words, tls_probe}
        while pending:
            done, pending = await asyncio.wait(pending, timeout=_left(deadline),
                                               return_when=asyncio.FIRST_COMPLETED)
            if not done:
                return None
            if words in done and words.result():
                return words.result()
            if tls_probe in done and tls_probe.result():
                return TLS
        return words.result()  # closed (b""), or silent (None), and no TLS either
    finally:
        if not words.done():
            words.cancel()
            await asyncio.wait({words})


async def _answers_tls(host: str, port: int, deadline: float) -> bool:
    """Does the port answer a TLS handshake (completing it, or refusing it with a TLS alert:
    a client certificate required, say)? No certificate is checked: only the protocol."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port, ssl=ctx, server_hostname=host or None),
                                           _left(deadline))
    except ssl.SSLError as e:
        return "ALERT" in (e.reason or "").upper()
    except (OSError, TimeoutError, ValueError):
        return False
    writer.close()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(writer.wait_closed(), 1)
    return True
