"""The sidecar's NATS connections, looked after: the main one (which the feeds, the router's
`main` peer and the JetStream requests share) and the configured peers' (read/peerset.py).
Connecting with the configured credentials and TLS, a first connect that fails with its
reason instead of retrying forever, the pings that leave a dead server, moving off a server
that shows no quorum, the permission errors that end the sidecar, and what a disconnect or a
reconnect means for the feeds. Its own module so that sidecar.py only builds an Upstream and
hands its connections to the parts; it knows the feeds only through BucketFeed (natsio
imports nothing of feed/)."""
from __future__ import annotations

import asyncio
import logging
import re
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

from ..config import BucketConfig, Config, strip_url_auth, tls_context, url_auth
from ..errors import KvcacheError, UpstreamError, describe
from ..stats import Stats
from .first_connect import first_connect, quiet_tls_eof
from .nats_connection import NatsConnection
from .peek import NATS
from .servers import ServerChoice, parse_url

log = logging.getLogger("kvcache")

# Leaving a server: unanswered pings (nats-py's max_outstanding_pings), the shortest ping
# interval, and the wait before moving off a server that answers but shows no quorum
# (HOP_AFTER_STALE x max_stale_ms, at least HOP_MIN_S, doubling up to HOP_MAX_S).
PINGS_OUTSTANDING = 2
PING_MIN_S = 0.5
HOP_AFTER_STALE, HOP_MIN_S, HOP_MAX_S = 2, 3.0, 60.0


class BucketFeed(Protocol):
    """What the connections ask of a bucket's feed (kvcache.feed.feed.Feed)."""

    @property
    def cfg(self) -> BucketConfig: ...

    @property
    def quorum(self) -> bool: ...

    def proven_within(self, ms: int) -> bool: ...

    def connection_lost(self) -> None: ...

    def reconnected(self) -> None: ...

    def republish_denied(self, subject: str) -> bool: ...


class Upstream:
    """The main NATS connection (`open`, then `nc` and `url`) and the peers' (`connect`).
    `feeds` is the sidecar's dict, filled as each bucket starts; `fail` ends the sidecar
    with an error (a permission the feeds cannot work without); after `stopping` is set,
    errors and disconnects are no longer reported."""

    def __init__(self, cfg: Config, stats: Stats, feeds: Mapping[str, BucketFeed], stopping: asyncio.Event,
                 fail: Callable[[KvcacheError], None]) -> None:
        self.cfg = cfg
        self.stats = stats
        self.feeds = feeds
        self.nc: NatsConnection | None = None
        self.url = ""  # the server the main connection uses now (no credentials)
        self._stopping = stopping
        self._fail = fail
        self._choices: list[ServerChoice] = []  # each connection's (kvcache.natsio.servers)
        self._leaving_why = ""  # why the main connection is being moved (leave_servers_without_quorum)

    async def open(self) -> NatsConnection:
        """The main connection, to the configured servers (read now: the embedded server's
        URL is filled in at start)."""
        self.nc = await self.connect(self.cfg.nats.servers)
        self.url = self.stats.nats_url = self.nc.connected_url.geturl() if self.nc.connected_url else ""
        self.stats.nats_connected = True
        return self.nc

    async def close(self) -> None:
        """Close the main connection, whatever state it is in."""
        for choice in self._choices:
            choice.close()
        nc = self.nc
        if nc is None or nc.is_closed:
            return
        # close(), not drain(): the feeds have unsubscribed already, and a drain against a
        # hung server only waits out its timeout and leaks its futures' errors.
        if not nc.is_connected:
            # Not connected (NATS down or a reconnect under way): what is still buffered
            # can never be sent, and nats-py's close() would write it to the dead
            # transport and fail half-way (RuntimeError from uvloop).
            nc._pending, nc._pending_data_size = [], 0
        await nc.close()

    async def connect(self, servers: list[str], peer: bool = False) -> NatsConnection:
        """A connection to `servers` with the configured credentials and TLS: a bounded first
        connect whose failure raises UpstreamError with the reason, then reconnects forever.
        A peer's (`peer`) leaves the feeds alone when it drops or comes back."""
        n = self.cfg.nats
        # Credentials in a URL go to nats-py as options (config_nats.validate_nats_auth made sure
        # no other auth option is set then): the URLs the connection keeps, which INFO, logs
        # and errors show, carry none.
        urls = [strip_url_auth(u) for u in servers]
        in_url = next((a for a in map(url_auth, servers) if a != (None, None)), None)
        nc = NatsConnection()
        first: list[BaseException] = []  # the first connect's failures: its error line says why
        denied: dict[tuple[str, str], float] = {}

        first_done = False
        tls_failed = asyncio.Event()
        # Where a reconnect goes: a server that answers, never one that drops packets while
        # another answers, whatever the pool's order (kvcache.natsio.servers).
        choice = ServerChoice(n.connect_timeout_s)
        self._choices.append(choice)
        at = [""]  # the netloc the connection is on (nats-py forgets it once disconnected)

        async def on_disconnect() -> None:
            if not peer:
                await self._on_disconnect()
            if nc.is_reconnecting and not self._stopping.is_set():
                why = "connection lost"
                if not peer and self._leaving_why:
                    why, self._leaving_why = self._leaving_why, ""
                await choice.leaving(at[0], why, nc.servers)

        async def on_reconnect() -> None:
            url = nc.connected_url
            at[0] = url.netloc if url else ""
            took = choice.connected(at[0])
            if not peer:
                await self._on_reconnect(choice, took)

        async def on_error(e: Exception) -> None:
            if not first_done:
                first.append(e)
                if isinstance(e, ssl.SSLError):
                    tls_failed.set()
            elif not self._denied(e, peer, denied):
                await self._on_error(e)

        opts: dict = dict(
            servers=urls, name="kvcache", connect_timeout=n.connect_timeout_s,
            max_reconnect_attempts=-1, reconnect_time_wait=0.5, allow_reconnect=True,
            # A server that stops answering (a cut link, a black-holed route) is left within
            # (max_outstanding_pings + 1) pings: under the tightest max_stale_ms, not nats-py's
            # 2-minute default, which left reads waiting on a dead server for minutes.
            ping_interval=self.ping_interval(), max_outstanding_pings=PINGS_OUTSTANDING,
            error_cb=on_error, disconnected_cb=on_disconnect, reconnected_cb=on_reconnect,
            reconnect_to_server_handler=choice.choose,
            # the first connect goes through the pool in the probes' order (below)
            dont_randomize=True,
        )
        if peer:  # a read-only peer: its connection's ups and downs are no business of the feeds
            opts.update(name="kvcache-peer")
        if n.creds:
            opts["user_credentials"] = n.creds
        if n.nkey:
            opts["nkeys_seed"] = n.nkey
        if n.token:
            opts["token"] = n.token
        if n.user:
            opts["user"], opts["password"] = n.user, n.password
        if in_url and in_url[1] is None:
            opts["token"] = in_url[0]
        elif in_url:
            opts["user"], opts["password"] = in_url
        tls = tls_context(n)
        if tls is not None:
            opts["tls"] = tls
        quiet_tls_eof()
        # nats-py retries the first connect forever when reconnects are unlimited; a sidecar
        # that cannot reach NATS at start must say so and exit instead. So: one bounded first
        # connection (the whole of connect_timeout_s: a look at each address, then one nats-py
        # attempt per server that answered as NATS, in that order), then reconnect forever
        # once connected. After a failed TLS handshake nats-py's connect never returns (2.16),
        # and a TLS failure at start is a configuration to fix, not a server to wait for.
        def attempt(servers: list[str], timeout: float) -> Awaitable[None]:
            return nc.connect(**{**opts, "servers": servers, "connect_timeout": timeout,
                                 "max_reconnect_attempts": 1})
        outcome = await first_connect(
            nc, attempt, urls, n.connect_timeout_s, tls_failed, first, shown=lambda u: u,
            tls=tls is not None or any(u.startswith("tls://") for u in urls),
            credentials=bool(n.creds or n.nkey or n.token or n.user or in_url))
        now = time.monotonic()
        for url, found in outcome.found.items():  # what reconnects know of each server from the start
            state = choice.state(parse_url(url).netloc)
            if found.kind == NATS:
                state.answered, state.rtt_s = now, found.took_s
            else:
                state.failed = now
        if outcome.error is not None:
            raise UpstreamError(f"cannot connect to NATS at {', '.join(urls)}: {outcome.error}")
        nc.options["max_reconnect_attempts"] = -1
        first_done = True
        choice.options = nc.options
        at[0] = nc.connected_url.netloc if nc.connected_url else ""
        choice.connected(at[0])
        for line in outcome.warnings:
            log.warning("%s", line)
        return nc

    def _denied(self, e: Exception, peer: bool, seen: dict[tuple[str, str], float]) -> bool:
        """A permissions violation: one warning naming the subject (again at most once a
        minute per subject); one the feeds cannot work without ends the sidecar, with that
        line as its error. False for any other error."""
        m = _PERMISSION_DENIED.search(str(e))
        if not m:
            return False
        op, subject = m.group(1).lower(), m.group(2)
        if op == "subscription" and any([feed.republish_denied(subject) for feed in self.feeds.values()]):
            return True  # a bucket's RePublish subject: that feed keeps a consumer (it says so)
        optional = _OPTIONAL_SUBSCRIBE.search(subject) if op == "subscription" else (
            not _FEED_PUBLISH.search(subject))
        what = f"NATS permission denied: {'publish' if op == 'publish' else 'subscribe'} to \"{subject}\""
        if peer or optional:
            now = time.monotonic()
            if now - seen.get((op, subject), -PERMISSION_LOG_S) >= PERMISSION_LOG_S:
                seen[(op, subject)] = now
                why = (" (single-key purges are then seen at the next restart)" if op == "subscription"
                       else "")
                log.warning("%s%s; the user kvcache connects as needs it (README: Permissions)", what, why)
        elif not self._stopping.is_set():
            self._fail(UpstreamError(f"{what}: the user kvcache connects as needs it to replicate "
                                     "(README: Permissions)"))
        return True

    async def _on_error(self, e: Exception) -> None:
        # Before the first connection the failure is reported once, as the startup error.
        if self.nc is not None and not self._stopping.is_set():
            log.warning("nats: %s", describe(e))

    async def _on_disconnect(self) -> None:
        if self._stopping.is_set() or self.nc is None:
            return
        log.warning("disconnected from NATS at %s", self.url or "?")
        self.stats.nats_connected = False
        for feed in self.feeds.values():
            feed.connection_lost()

    async def _on_reconnect(self, choice: ServerChoice, took: float) -> None:
        url = self.nc.connected_url if self.nc else None
        self.url = self.stats.nats_url = url.geturl() if url else ""
        left = choice.servers.get(choice.moved_from)
        log.info("reconnected to NATS at %s, %.2fs after leaving %s (%s)", self.url or "?", took,
                 choice.moved_from or "?", left.why if left else "connection lost")
        self.stats.nats_connected = True
        self.stats.nats_last_move_ms = round(took * 1000)
        for feed in self.feeds.values():
            feed.reconnected()  # start over now rather than after the feed's backoff

    def ping_interval(self) -> float:
        """Seconds between the main connection's pings: a server that stops answering is left
        after PINGS_OUTSTANDING + 1 of them, within half the tightest max_stale_ms (0.5 s to
        30 s between pings)."""
        tightest = min((b.max_stale_ms for b in self.cfg.buckets), default=5000)
        return min(30.0, max(PING_MIN_S, tightest / 1000 / (2 * (PINGS_OUTSTANDING + 1))))

    async def leave_servers_without_quorum(self) -> None:
        """Move to another server when the one in use answers but cannot show a quorum for
        any replicated bucket: a server cut off from its peers (its STREAM.INFO names itself
        leader with silent followers, or no leader at all), while another server of the
        cluster may reach the majority. After HOP_AFTER_STALE x max_stale_ms without evidence
        for every such bucket, force a reconnect (to a server that answers, other than this
        one: kvcache.natsio.servers); the feeds recreate their consumers there. When hopping does not help (the whole
        cluster has no quorum), the wait doubles up to HOP_MAX_S."""
        feeds = list(self.feeds.values())
        bound = min((f.cfg.max_stale_ms for f in feeds), default=5000)
        first = max(HOP_AFTER_STALE * bound / 1000, HOP_MIN_S)
        wait, since = first, None
        while True:
            await asyncio.sleep(max(0.1, bound / 4000))
            nc = self.nc
            quorum = [f for f in feeds if f.quorum]
            if nc is None or not nc.is_connected or not quorum:
                since = None
                continue
            if any(f.proven_within(f.cfg.max_stale_ms) for f in quorum):
                since, wait = None, first  # this server shows a quorum: moving helped, if it was needed
                continue
            now = time.monotonic()
            since = since or now
            if now - since < wait:
                continue
            log.warning("NATS server %s has shown no quorum for any replicated bucket in %.1fs: "
                        "moving to another server", self.url or "?", now - since)
            self.stats.server_moves += 1
            since, wait = None, min(wait * 2, HOP_MAX_S)
            self._leaving_why = "no quorum shown"
            await nc.force_reconnect()


# What a permissions violation names; the publishes the feeds cannot do without (the rest are
# reads, which fail on their own, and consumer deletes, which the server does by itself), and
# the subscriptions they can (purge and message-delete requests, see feed/feed.py; the fleet's
# shared stream state, see feed/fleet.py: without it a sidecar polls for itself).
_PERMISSION_DENIED = re.compile(r'permissions violation for (publish|subscription) to "([^"]*)"', re.I)
_FEED_PUBLISH = re.compile(r"\.API\.(STREAM\.INFO|CONSUMER\.CREATE|CONSUMER\.MSG\.NEXT)\.")
_OPTIONAL_SUBSCRIBE = re.compile(r"\.API\.STREAM\.(PURGE|MSG\.DELETE)\.|^kvcache\.state\.")
PERMISSION_LOG_S = 60.0


