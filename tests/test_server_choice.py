"""Where a NATS connection goes after losing its server (kvcache.natsio.servers): a server that
answers, never one that drops packets while another answers, whatever the pool's order.

The silent servers are real addresses on 127.0.0.1 that drop connection attempts: listening
sockets whose accept queue is full (the kernel then drops the SYN, as a firewall that DROPs
does, and the client waits out its connect timeout), and a SIGSTOPped nats-server (the kernel
completes the TCP handshake, the server never sends its INFO line). The pool lists a dozen of
them beside the cluster: nats-py's shuffled order, which kvcache used before, tried one of
them first on most reconnects and waited out the whole connect timeout on each.
"""
from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from urllib.parse import urlparse

import nats
import nats.errors
import pytest
from support.sidecar_proc import SidecarProcess
from support.topology import replicated_kv, settled

from kvcache.natsio.servers import BACKOFF_MAX_S, SHORT_ATTEMPT_S, ServerChoice, parse_url

pytestmark = pytest.mark.timeout(180)

BLACK_HOLES = 12
# Far above what a move takes: an attempt that waits it out is the bug under test.
CONNECT_TIMEOUT_S = 60.0


def closed_ports(n: int) -> list[int]:
    """`n` free ports on 127.0.0.1: a connection attempt is refused at once, for now."""
    ports = []
    for _ in range(n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    return ports


@contextlib.contextmanager
def black_holes(ports: list[int]) -> Iterator[list[str]]:
    """Make each port an address whose connection attempts hang: a listening socket (backlog
    0) whose accept queue one unaccepted connection fills, so the kernel drops further SYNs."""
    socks: list[socket.socket] = []
    try:
        for port in ports:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen(0)
            socks.append(s)
            for _ in range(2):  # the queue's one place, and a handshake in progress
                c = socket.socket()
                c.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    c.connect(("127.0.0.1", port))
                socks.append(c)
        yield [f"nats://127.0.0.1:{p}" for p in ports]
    finally:
        for s in socks:
            s.close()


@pytest.fixture(scope="module")
def holes() -> Iterator[list[str]]:
    with black_holes(closed_ports(BLACK_HOLES)) as urls:
        yield urls


class Srv:
    """nats-py's reconnect handler gets `Server`s: a uri and a reconnect count."""

    def __init__(self, url: str, reconnects: int = 0) -> None:
        self.uri = parse_url(url)
        self.reconnects = reconnects


# ----------------------------------------------------------------------------- the choice, in process

async def test_a_probe_finds_the_server_that_answers_among_black_holes(nats_server_module, holes):
    choice = ServerChoice(CONNECT_TIMEOUT_S)
    choice.options = {}
    pool = [*holes, nats_server_module.url]
    try:
        await choice.probe([parse_url(u) for u in pool], wait_for_one_besides="")
        live = urlparse(nats_server_module.url).netloc
        assert choice.state(live).alive
        # every order of the pool: the server that answered is chosen, with the full timeout
        for rot in range(len(pool)):
            servers = [Srv(u) for u in pool[rot:] + pool[:rot]]
            choice._last_pick = ""
            pick, delay = choice.choose(servers, {})
            assert pick.uri.netloc == live
            assert delay == 0
            assert choice.options["connect_timeout"] == CONNECT_TIMEOUT_S
        assert choice.ordered(pool)[0] == nats_server_module.url
    finally:
        choice.close()


async def test_silent_servers_get_short_attempts_and_a_failed_round_backs_off(holes):
    choice = ServerChoice(CONNECT_TIMEOUT_S)
    choice.options = {}
    servers = [Srv(u) for u in holes[:3]]
    try:
        picks, delays = [], []
        for _ in range(7):  # nothing answers: every attempt fails
            pick, delay = choice.choose(servers, {})
            picks.append(pick.uri.netloc)
            delays.append(delay)
            assert choice.options["connect_timeout"] == SHORT_ATTEMPT_S
        assert set(picks[:3]) == {s.uri.netloc for s in servers}, "each server once before any twice"
        assert delays[:3] == [0, 0, 0]
        assert 0 < delays[3] <= BACKOFF_MAX_S * 1.5, "a round in which every server failed waits"
        assert delays[6] > 0 and delays[4:6] == [0, 0]
    finally:
        choice.close()


async def test_the_server_left_ranks_below_another_that_answers(nats_cluster):
    choice = ServerChoice(CONNECT_TIMEOUT_S)
    choice.options = {}
    pool = [parse_url(u) for u in nats_cluster.urls]
    try:
        left = pool[0].netloc
        await choice.leaving(left, "no quorum shown", pool)
        await choice.probe(pool, wait_for_one_besides=None)
        # all three answer; the one just left (for showing no quorum) is never the first choice
        for _ in range(20):
            choice._last_pick = ""
            pick, _ = choice.choose([Srv(u) for u in nats_cluster.urls], {})
            assert pick.uri.netloc != left
    finally:
        choice.close()


# ----------------------------------------------------------------------------- a sidecar, end to end

async def _ready_bucket(url: str, bucket: str) -> None:
    """An R3 bucket, led, every replica current, with one key."""
    nc = await nats.connect(url)
    try:
        kv = await replicated_kv(nc.jetstream(), bucket=bucket, replicas=3, history=1)
        await settled(lambda: kv.put("k", b"v0"))
    finally:
        await nc.close()


def _server_info(sc: SidecarProcess) -> dict:
    with sc.client(timeout=5) as c:
        return c.info("server")["server"]


async def test_a_sidecar_cut_from_its_server_moves_to_one_that_answers(nats_cluster, tmp_path):
    """The sidecar's pool: a dozen addresses, then the cluster. At start the addresses refuse
    connections (nats-py moves past them at once); then they start dropping packets and the
    sidecar's server is stopped (SIGSTOP: it accepts TCP, answers nothing). The sidecar must
    reconnect to a live member and serve what the majority acknowledges, without an attempt on
    a silent address, each of which waits out CONNECT_TIMEOUT_S (longer than the test waits).
    In nats-py's shuffled order, 13 of the 15 addresses are silent."""
    bucket = "choice"
    await _ready_bucket(nats_cluster.urls[0], bucket)
    ports = closed_ports(BLACK_HOLES)
    pool = [f"nats://127.0.0.1:{p}" for p in ports] + nats_cluster.urls
    sc = SidecarProcess(tmp_path / "sc", ",".join(pool), buckets=[bucket],
                        extra=["--max-stale-ms", "3000", "--heartbeat-ms", "1000",
                               "--connect-timeout-s", str(CONNECT_TIMEOUT_S)])
    stopped = None
    holes = contextlib.ExitStack()
    try:
        sc.start(wait_synced=True, timeout=CONNECT_TIMEOUT_S / 2)
        at = _server_info(sc)["nats_url"]
        stopped = next(s for s in nats_cluster.servers if urlparse(s.url).netloc == urlparse(at).netloc)
        live = next(s.url for s in nats_cluster.servers if s is not stopped)
        nc = await nats.connect(live)
        try:
            kv = await nc.jetstream().key_value(bucket)
            offset = len(sc.log())
            holes.enter_context(black_holes(ports))
            stopped.pause()
            seq = await settled(lambda: kv.put("k", b"after the stop"))
        finally:
            await nc.close()

        def moved_and_current() -> bool:
            info = _server_info(sc)
            if not info["nats_connected"] or urlparse(info["nats_url"]).netloc == urlparse(at).netloc:
                return False
            with sc.client(timeout=5) as c:
                return c.get(f"{bucket}:k") == b"after the stop"
        # far below CONNECT_TIMEOUT_S: an attempt that waits it out on a silent address fails here
        sc.wait_for(moved_and_current, CONNECT_TIMEOUT_S / 3, f"the sidecar off {at}, serving seq {seq}")
        log = sc.log()[offset:]
        assert "reconnected to NATS at" in log and "after leaving" in log, log
        assert _server_info(sc)["nats_last_move_ms"] > 0
        # no attempt went to a silent address: nats-py reports each failed one through the
        # error callback, which the sidecar logs as "nats: ..."
        tried = [line for line in log.splitlines() if "nats: " in line and "127.0.0.1" in line]
        assert not tried, tried
    finally:
        if stopped is not None:
            stopped.resume()
        holes.close()
        sc.kill(check=False)
        sc.check_log()
        nats_cluster.wait_ready(60)
