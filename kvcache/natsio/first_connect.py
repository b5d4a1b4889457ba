"""The first connection to NATS of every kvcache process that connects: the sidecar
(kvcache.natsio.upstream), `kvcache load`'s driver and its partition writers
(kvcache.pipeline). nats-py retries a first connect for ever when reconnects are unlimited,
and after a failed TLS handshake its connect never returns (2.16): a server that cannot be
reached, or refuses the credentials or the certificate, must be one line within seconds.

Imports nothing but asyncio and logging: Spark executors import it from the --py-files
bundle, which has no lmdb (kvcache.pipeline.bundle)."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Sequence


def _tls_eof_filter(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("returning true from eof_received()")


def quiet_tls_eof() -> None:
    """nats-py upgrades a plain stream to TLS (start_tls), whose protocol then answers EOF as
    a plain one would: asyncio warns about it at every close of a TLS connection, a line that
    tells the reader nothing."""
    logger = logging.getLogger("asyncio")
    if _tls_eof_filter not in logger.filters:
        logger.addFilter(_tls_eof_filter)


async def bounded(nc: object, connect: Awaitable[None], tls_failed: asyncio.Event, timeout: float,
                  errors: Sequence[BaseException]) -> BaseException | None:
    """Await `connect` (nats-py's connect of `nc`, one attempt per server) until it returns,
    a TLS handshake fails (`tls_failed`, set by the connection's error callback) or `timeout`
    passes. A connect that did not finish is cancelled and `nc` closed. None when connected;
    else why not: the connect's exception, or the last error the callback saw (`errors`; a
    TimeoutError when none)."""
    connecting = asyncio.ensure_future(connect)
    failed = asyncio.ensure_future(tls_failed.wait())
    try:
        await asyncio.wait({connecting, failed}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        failed.cancel()
        if not connecting.done():  # hung, a TLS failure, or the start abandoned
            connecting.cancel()
            await asyncio.wait({connecting})
            try:
                await asyncio.wait_for(nc.close(), 2)  # type: ignore[attr-defined]
            except Exception:  # a half-made connection: nothing to save
                pass
    if connecting.cancelled():
        return errors[-1] if errors else TimeoutError()
    return connecting.exception()
