"""The first connection to NATS of every kvcache process that connects: the sidecar
(kvcache.natsio.upstream), `kvcache load`'s driver and its partition writers
(kvcache.pipeline). nats-py retries a first connect for ever when reconnects are unlimited,
and after a failed TLS handshake its connect never returns (2.16): a server that cannot be
reached, or refuses the credentials or the certificate, must be one line within seconds.

`first_connect` is the whole first connection within one budget (`connect_timeout_s`): a look
at each address (kvcache.natsio.peek: what answers there, in parallel), then nats-py's connect
to the servers that answered as NATS, given what is left. Its error names what was found
(nothing listening, a silent port, another protocol's banner, TLS expected, credentials
refused or missing) instead of nats-py's `timed out` or `empty response from server when
expecting INFO message`, and before it there is no second wait of a whole timeout per attempt.

Imports the standard library, nats-py's errors and kvcache.errors only: Spark executors import
it from the --py-files bundle, which has no lmdb (kvcache.pipeline.bundle)."""
from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import nats.errors

from ..errors import describe
from .peek import NATS, Found, Look


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


# What to give nats-py to connect with, in this order, within this many seconds
Connect = Callable[[list[str], float], Awaitable[None]]
AUTH_OPTIONS = "--user/--password, --token, --nkey, --creds, or user:password@ in the URL"


@dataclass
class Outcome:
    """How the first connection went: `error` (None when connected) is why not, to follow
    `cannot connect to NATS at URL: `; `warnings` are lines to log once connected; `found`
    what the look found at each URL it finished; `took_s` the time spent in all."""

    error: str | None
    warnings: list[str] = field(default_factory=list)
    found: dict[str, Found] = field(default_factory=dict)
    took_s: float = 0.0


async def first_connect(nc: object, connect: Connect, urls: list[str], budget_s: float,
                        tls_failed: asyncio.Event, errors: list[BaseException], *, shown: Callable[[str], str],
                        tls: bool, credentials: bool) -> Outcome:
    """Connect `nc` to one of `urls` within `budget_s` (see the module docstring).
    `connect(servers, timeout)` is nats-py's connect with the pool in that order and that
    connect timeout (one attempt per server); `tls_failed` and `errors` are what its error
    callback reports (see `bounded`); `shown(url)` is a URL as messages may show it; `tls`
    and `credentials`: whether TLS and credentials are configured."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = start + budget_s
    outcome = await _connect(nc, connect, urls, budget_s, deadline, tls_failed, errors, shown, tls, credentials)
    outcome.took_s = loop.time() - start
    return outcome


async def _connect(nc: object, connect: Connect, urls: list[str], budget_s: float, deadline: float,
                   tls_failed: asyncio.Event, errors: list[BaseException], shown: Callable[[str], str],
                   tls: bool, credentials: bool) -> Outcome:
    loop = asyncio.get_running_loop()
    # a websocket server says nothing before its HTTP upgrade: nats-py finds out itself
    looks = {u: Look(u) for u in urls if not u.lower().startswith(("ws://", "wss://"))}
    tasks = [asyncio.ensure_future(x.run(deadline)) for x in looks.values()]
    try:
        await _until_one_answers(tasks, deadline)
    finally:
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks)
    found = {u: x.found for u, x in looks.items()}  # (a look cut short says how far it got)
    answering = [u for u in urls if u not in looks or (u in found and found[u].kind == NATS)]
    if not answering:
        return Outcome(_per_server(urls, found, budget_s, shown), found=found)
    if tls:
        plain = [u for u in answering if u in found and not found[u].info.get("tls_required")]
        if plain:
            available = found[plain[0]].info.get("tls_available")
            return Outcome(
                f"TLS is configured (--tls-ca/--tls-cert) but the NATS server at {shown(plain[0])} does not "
                f"require it (its INFO: tls_required false{', tls_available true' if available else ''}), "
                "and nats-py would connect in plaintext: give that server a tls block (without "
                "allow_non_tls), or drop the TLS settings", found=found)
    ordered = answering + [u for u in urls if u not in answering]  # the pool reconnects use too
    left = max(0.0, deadline - loop.time())
    e = await bounded(nc, connect(ordered, left), tls_failed, left, errors)
    if e is None:
        info = getattr(nc, "_server_info", None) or {}
        warnings = []
        if credentials and not info.get("auth_required"):
            url = getattr(nc, "connected_url", None)
            where = shown(url.geturl()) if url is not None else ", ".join(map(shown, answering))
            warnings.append(f"the NATS server at {where} requires no authentication (its INFO: no "
                            "auth_required), so the credentials given are not used: every client "
                            "may connect as this one does; if the server should require them, "
                            "its authorization block is missing")
        return Outcome(None, warnings, found)
    if not isinstance(e, (OSError, TimeoutError, nats.errors.Error)):
        raise e
    return Outcome(_why_not(e, errors, [found[u] for u in answering if u in found], budget_s, tls, credentials)
                   + _others(urls, answering, found, budget_s, shown), found=found)


async def _until_one_answers(looks: Sequence[asyncio.Future[Found]], deadline: float) -> None:
    """Return once a look found a NATS server, every look ended, or `deadline` passed."""
    pending = set(looks)
    loop = asyncio.get_running_loop()
    while pending:
        left = deadline - loop.time()
        if left <= 0:
            return
        done, pending = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        if any(not t.cancelled() and t.exception() is None and t.result().kind == NATS for t in done):
            return


def _per_server(urls: list[str], found: dict[str, Found], budget_s: float, shown: Callable[[str], str]) -> str:
    """What each URL's look found (one URL: just that)."""
    def what(u: str) -> str:
        return found[u].describe(budget_s)
    if len(urls) == 1:
        return what(urls[0])
    return "; ".join(f"{shown(u)}: {what(u)}" for u in urls)


def _others(urls: list[str], answering: list[str], found: dict[str, Found], budget_s: float,
            shown: Callable[[str], str]) -> str:
    rest = [u for u in urls if u not in answering and u in found]
    return "".join(f"; {shown(u)}: {found[u].describe(budget_s)}" for u in rest)


def _why_not(e: BaseException, errors: list[BaseException], infos: list[Found], budget_s: float,
             tls: bool, credentials: bool) -> str:
    """Why nats-py did not connect to a server that answered as NATS: the server's own -ERR
    (before the reset or broken pipe that follows it) first, else its last failure, said
    with what the server's INFO tells."""
    said_by_server = [x for x in errors if str(x).startswith("nats: '")]
    if said_by_server:
        e = said_by_server[-1]
    elif errors and isinstance(e, (nats.errors.NoServersError, TimeoutError)):
        e = errors[-1]
    why = describe(e)
    if why.startswith("'") and why.endswith("'"):  # the server's -ERR 'Authorization Violation'
        why = why.strip("'").lower()
    if why == "authorization violation":
        if credentials:
            return f"{why}: the server refused the credentials given"
        return f"{why}: the server requires credentials and none were given ({AUTH_OPTIONS})"
    tls_required = any(f.info.get("tls_required") for f in infos)
    if isinstance(e, ssl.SSLError) or "certificate" in why:
        if tls_required and not tls:
            return (f"{why} (the server requires TLS: its certificate was checked against this "
                    "system's CAs; give its CA with --tls-ca)")
        return why
    if isinstance(e, TimeoutError):
        step = "the TLS handshake or " if tls_required else ""
        return (f"timed out: the server sent its INFO, but {step}the CONNECT went unanswered within "
                f"the {budget_s:g}s connect timeout")
    return why
