"""The embedded nats-server of `kvcache serve` with no NATS URL, supervised: started with its
store under the data directory, restarted after a crash on the same port and store with a
growing pause, given up on once it cannot stay up. The process itself is natsio/nats_server.py's
NatsServer; what to do when it dies is this module's, so that sidecar.py only starts, watches
and stops it."""
from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from collections.abc import Callable

from ..errors import KvcacheError, UpstreamError, describe
from .nats_server import NatsServer, port_taken

log = logging.getLogger("kvcache")

# Restarted after a crash with a growing pause (0.25 s doubling up to 5 s), and given up on
# (the sidecar exits 1) once it has died or failed to start EMBEDDED_MAX_FAILURES times within
# EMBEDDED_WINDOW_S.
EMBEDDED_POLL_S = 0.2
EMBEDDED_MAX_FAILURES = 5
EMBEDDED_WINDOW_S = 60.0
EMBEDDED_BACKOFF_S = (0.25, 5.0)


class EmbeddedNats:
    """One embedded nats-server: `start`, then `supervise` as a task until the sidecar stops,
    then `stop`. `restarts` counts the restarts after a crash."""

    def __init__(self, data_dir: str, port: int = 0) -> None:
        self.data_dir = data_dir
        self.port = port  # embedded_port: a fixed client port (the `nats` CLI can name it), else 0, a free one
        self.server: NatsServer | None = None
        self.restarts = 0

    def start(self) -> str:
        """Start the server (on the calling thread: see below) and return its client URL."""
        store = os.path.join(os.path.abspath(self.data_dir), "nats")
        os.makedirs(store, exist_ok=True)
        if self.port and (why := port_taken("127.0.0.1", self.port)):
            raise UpstreamError(f"the embedded nats-server cannot listen on 127.0.0.1:{self.port} "
                                f"(embedded_port, KVCACHE_EMBEDDED_PORT): {why.lower()}")
        self.server = NatsServer(store, port=self.port or None,
                                 server_name="kvcache-embedded", conf_dir=self.data_dir)
        # Started from the main thread on purpose: the server dies with the thread that
        # started it (PR_SET_PDEATHSIG), and executor threads come and go.
        self.server.start()
        log.info("started embedded nats-server %s (pid %d, store %s)",
                 self.server.url, self.server.pid, store)
        return self.server.url

    async def supervise(self, stopping: asyncio.Event, give_up: Callable[[KvcacheError], None]) -> None:
        """Restart the server when it dies, on the same port and store (the connection
        reconnects and the feeds resume by themselves); give up, calling `give_up` with the
        error to end the sidecar with, after EMBEDDED_MAX_FAILURES deaths or failed starts
        within EMBEDDED_WINDOW_S: a server that cannot stay up is a problem for a person.
        Returns when `stopping` is set."""
        failures: collections.deque[float] = collections.deque()
        loop = asyncio.get_running_loop()
        while not stopping.is_set():
            await asyncio.sleep(EMBEDDED_POLL_S)
            srv = self.server
            if srv is None or srv.running or stopping.is_set():
                continue
            log.error("embedded nats-server (pid %s) exited %s", srv.pid, srv.exit_status())
            failures.append(time.monotonic())
            while not stopping.is_set():
                now = time.monotonic()
                while failures and failures[0] < now - EMBEDDED_WINDOW_S:
                    failures.popleft()
                if len(failures) >= EMBEDDED_MAX_FAILURES:
                    give_up(UpstreamError(
                        f"embedded nats-server died or failed to start {len(failures)} times within "
                        f"{EMBEDDED_WINDOW_S:g}s; giving up (its log: {srv.log_file})"))
                    return
                delay = min(EMBEDDED_BACKOFF_S[0] * 2 ** (len(failures) - 1), EMBEDDED_BACKOFF_S[1])
                log.warning("restarting embedded nats-server in %gs (failure %d of %d within %gs)",
                            delay, len(failures), EMBEDDED_MAX_FAILURES, EMBEDDED_WINDOW_S)
                await asyncio.sleep(delay)
                if stopping.is_set():
                    return
                try:
                    srv.launch()  # here, on the main thread: see start
                    await loop.run_in_executor(None, srv.wait_ready, 10.0)
                except (KvcacheError, OSError) as e:
                    srv.kill()
                    failures.append(time.monotonic())
                    log.error("embedded nats-server did not start again: %s", describe(e).splitlines()[0])
                    continue
                self.restarts += 1
                log.warning("restarted embedded nats-server %s (pid %d; restart %d)",
                            srv.url, srv.pid, self.restarts)
                break

    def stop(self) -> None:
        """Stop the server, if started; safe to call twice."""
        if self.server is not None:
            try:
                self.server.stop()
            finally:
                self.server = None
