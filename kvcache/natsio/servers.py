"""Which NATS server a connection goes to next: never one that does not answer while another does.

nats-py, left to itself, reconnects through its pool in a shuffled order, and an attempt on an
address whose packets are silently dropped (a cut link, a firewall, a stopped host) waits out
the whole connect timeout before the next server is tried. With the server just left first
in the shuffle, a sidecar cut from its own server spent seconds per attempt knocking on it
while two reachable servers waited. A Redis or NATS operator expects what a
mature client does instead: find out which servers answer, go to one of those, and keep
knocking only where nothing answers.

`ServerChoice` is that, for one connection:

- **Probes.** When the connection is lost (and before the first connect), every server of the
  pool is asked at once for what any nats-server sends first on a new connection, its INFO
  line: a TCP connect and one line, no CONNECT, closed at once. The move waits only for the
  first server other than the one left to answer (milliseconds on a healthy network), never
  for the silent ones; their probes run on in the background and update what is known.
- **The choice** (nats-py's `reconnect_to_server_handler`): a server that answered since it
  last failed, chosen at random among those (the fleet keeps spreading over the cluster as
  nats-py's shuffle spreads it); else one never asked; the server just left, and any that
  failed, last, the longest-failed first.
- **Attempts.** A server that answered gets the configured connect timeout (it is there; a
  TLS handshake may be slow). One that has not gets a short one (`SHORT_ATTEMPT_S`): an
  address that drops packets costs that, not the connect timeout, and the background probe
  gives it the full timeout as soon as it answers.
- **Backoff.** Once every server failed since the connection was lost, each further round
  waits a jittered, doubling delay (`BACKOFF_*`): a cluster restart does not draw every
  sidecar of a fleet at the same instant, nor in lockstep after it.

So the time from a cut to connected again is the ping detection (kvcache.natsio.upstream) plus
one probe round trip and one connect to a server that answers, whatever the pool's order.
Cost to the cluster: one TCP connection per server per move, none in steady state.
"""
from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import ParseResult, urlparse

# An attempt on a server that has not answered a probe since it last failed: long enough for a
# TCP connect and an INFO line on any network a sidecar shares with its cluster.
SHORT_ATTEMPT_S = 1.0
# The longest a move waits for the probes before choosing (a server that answers answers in
# milliseconds; this only bounds the wait when none does).
PROBE_WAIT_S = 1.0
# Between rounds in which every server failed: first, doubling, at most; times a jitter in
# [1 - BACKOFF_JITTER, 1 + BACKOFF_JITTER].
BACKOFF_FIRST_S, BACKOFF_MAX_S, BACKOFF_JITTER = 0.25, 5.0, 0.5
# A server the connection left ranks below every other that answers, for this long after: a
# server left for showing no quorum still answers its INFO line.
LEFT_AVOID_S = 30.0


def parse_url(url: str) -> ParseResult:
    """A server URL as nats-py parses it for its pool: `host:port` means nats://host:port."""
    return urlparse(url if "://" in url else f"nats://{url}")


@dataclass
class ServerState:
    """What is known of one server of the pool (monotonic times; 0: never)."""

    answered: float = 0.0     # its INFO line last arrived (a probe or a connect)
    failed: float = 0.0       # a probe or an attempt last got nothing
    left: float = 0.0         # the connection last left it
    why: str = ""             # ...and why
    rtt_s: float = 0.0        # the last probe's time to the INFO line

    @property
    def alive(self) -> bool:
        """Answered since it last failed or was left."""
        return self.answered > max(self.failed, self.left)


class ServerChoice:
    """The server choice of one nats-py connection (see the module docstring). `connect_timeout_s`
    is the configured one; `options` is the connection's options dict (nats-py reads
    `connect_timeout` from it for each attempt, which `choose` sets)."""

    def __init__(self, connect_timeout_s: float, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.options: dict[str, Any] | None = None
        self.servers: dict[str, ServerState] = {}   # by netloc
        self._clock = clock
        self._rng = rng or random.Random()
        self._probes: dict[str, asyncio.Task] = {}
        self._last_pick = ""       # the server the latest attempt went to
        self._round: set[str] = set()  # servers failed since the connection was lost
        self._rounds = 0           # rounds in which every server failed
        self.moving_since = 0.0    # when the connection was lost (0: connected)
        self.moved_from = ""       # ...from which server

    def state(self, netloc: str) -> ServerState:
        return self.servers.setdefault(netloc, ServerState())

    # ------------------------------------------------------------------ events

    def connected(self, netloc: str) -> float:
        """The connection is up on `netloc`; returns the seconds since it was lost (0 at the
        first connect)."""
        now = self._clock()
        self.state(netloc).answered = now
        took = now - self.moving_since if self.moving_since else 0.0
        self.moving_since, self._last_pick, self._round, self._rounds = 0.0, "", set(), 0
        return took

    async def leaving(self, netloc: str, why: str, pool: Iterable[ParseResult]) -> None:
        """The connection left `netloc` (`why`, for the log): probe the pool and return once a
        server other than it answered, every probe ended, or PROBE_WAIT_S passed."""
        now = self._clock()
        if netloc:
            s = self.state(netloc)
            s.left, s.why = now, why
        self.moving_since, self.moved_from = now, netloc
        self._round, self._rounds = set(), 0
        await self.probe(pool, wait_for_one_besides=netloc)

    async def probe(self, pool: Iterable[ParseResult], wait_for_one_besides: str | None = None) -> None:
        """Ask every server of `pool` for its INFO line at once (a probe already running for a
        server is not repeated). With `wait_for_one_besides` (a netloc, or "" for any),
        return when a server other than that one answered, or all probes ended, or
        PROBE_WAIT_S passed; else return at once (the probes run on)."""
        tasks = self._start_probes(pool)
        if wait_for_one_besides is None or not tasks:
            return
        deadline = self._clock() + min(PROBE_WAIT_S, self.connect_timeout_s)
        pending = {t for _, t in tasks}
        others = {t for n, t in tasks if n != wait_for_one_besides}
        while pending:
            left = deadline - self._clock()
            if left <= 0:
                return
            done, pending = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if any(t in others and t.result() for t in done):
                return

    def _start_probes(self, pool: Iterable[ParseResult]) -> list[tuple[str, asyncio.Task]]:
        tasks = []
        for uri in pool:
            netloc = uri.netloc
            task = self._probes.get(netloc)
            if task is None or task.done():
                task = self._probes[netloc] = asyncio.get_running_loop().create_task(self._probe_one(uri))
            tasks.append((netloc, task))
        return tasks

    async def _probe_one(self, uri: ParseResult) -> bool:
        """One server's INFO line within the connect timeout: True and its time when it came."""
        s = self.state(uri.netloc)
        start = self._clock()
        writer = None
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(uri.hostname, uri.port or 4222), self.connect_timeout_s)
            if uri.scheme in ("ws", "wss"):  # a websocket server says nothing before the upgrade
                ok = True
            else:
                line = await asyncio.wait_for(reader.readline(),
                                              max(0.0, start + self.connect_timeout_s - self._clock()))
                ok = line.startswith(b"INFO")
        except (TimeoutError, OSError, ValueError):
            ok = False
        finally:
            if writer is not None:
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()
        now = self._clock()
        if ok:
            s.answered, s.rtt_s = now, now - start
        else:
            s.failed = now
        return ok

    # ------------------------------------------------------------------ nats-py's handler

    def choose(self, servers: list, info: dict[str, Any]) -> tuple[Any, float]:
        """nats-py's reconnect_to_server_handler: the server of `servers` (nats-py `Server`s)
        to try now, and how long to wait first. Sets the attempt's connect timeout."""
        now = self._clock()
        if self._last_pick:  # called again: the previous attempt failed
            self.state(self._last_pick).failed = now
            self._round.add(self._last_pick)
        netlocs = [srv.uri.netloc for srv in servers]
        if netlocs and all(n in self._round for n in netlocs):  # a whole round failed
            self._round = set()
            self._rounds += 1
        delay = 0.0
        if self._rounds and not self._round:
            base = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (self._rounds - 1))
            delay = base * self._rng.uniform(1 - BACKOFF_JITTER, 1 + BACKOFF_JITTER)
        pick = min(servers, key=lambda srv: self._rank(srv.uri.netloc, srv.reconnects))
        self._last_pick = pick.uri.netloc
        if self.options is not None:
            alive = self.state(pick.uri.netloc).alive
            self.options["connect_timeout"] = (self.connect_timeout_s if alive
                                               else min(self.connect_timeout_s, SHORT_ATTEMPT_S))
        # what the next call will know: probes run while this attempt does
        self._start_probes([srv.uri for srv in servers])
        return pick, delay

    def _rank(self, netloc: str, reconnects: int) -> tuple:
        """Lower is better: answered (at random among them), never asked (at random), answered
        but left within LEFT_AVOID_S, then failed (the longest ago first; fewer attempts first)."""
        s = self.servers.get(netloc)
        if s is None or not (s.answered or s.failed or s.left):
            return (1, self._rng.random())
        if s.alive:
            if s.left and self._clock() - s.left < LEFT_AVOID_S:
                return (2, s.left)
            return (0, self._rng.random())
        return (3, max(s.failed, s.left), reconnects)

    def ordered(self, urls: list[str]) -> list[str]:
        """`urls` best first, as `choose` would rank them (for the first connect, which nats-py
        makes without the handler)."""
        return sorted(urls, key=lambda u: self._rank(parse_url(u).netloc, 0))

    def close(self) -> None:
        """Stop the probes still running."""
        for task in self._probes.values():
            task.cancel()
        self._probes.clear()
