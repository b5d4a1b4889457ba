"""`KV.GET k MINREV r` against a real nats-server while the sidecar's feed lags: read-your-writes
after one's own put.

A single nats-server; the sidecar reaches it only through a TCP proxy that delays every byte
0.8 s each way (tests/support/topology.py DelayProxy), so its replica runs about 0.8 s behind,
well inside the bucket's max_stale_ms of 5 s: the replica is fresh by its bound, yet it does
not hold the revision just written. The writer (nats-py) talks to the server directly. Each
try puts the key (acknowledged at revision r) and at once reads it with MINREV r on the
sidecar's socket (redis-py): no answer may be below r. A replica fresh within its bound but
behind r once answered r-1 from `local`, after the 0.25 s wait, in every try.

Latencies and sources are printed (`pytest -s`), never asserted: a right answer through this
proxy takes the wait and a round trip to the server (about 1.85 s), or less when the feed
delivers r during the wait.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from support.kvdata import kv_put
from support.poll import wait_until
from support.sidecar_proc import SidecarProcess, write_config
from support.topology import DelayProxy, nats_run

pytestmark = pytest.mark.timeout(300)

BUCKET = "demo"
KEY = "k"
DELAY_S = 0.8
MAX_STALE_MS = 5000
TRIES = 20


@dataclass
class Live:
    server_url: str
    proxy: DelayProxy
    sc: SidecarProcess
    r: redis.Redis

    def applied(self) -> int:
        """The sidecar's replica position for the bucket (INFO buckets)."""
        return int(self.sc.buckets()[BUCKET]["applied_seq"])


@pytest.fixture
def live(nats_server, tmp_path: Path) -> Iterator[Live]:
    async def setup(js):
        kv = await js.create_key_value(bucket=BUCKET, history=1)
        await kv.put(KEY, b"0")
    nats_run(nats_server.url, setup)
    with DelayProxy(nats_server.port) as proxy:
        cfg = write_config(tmp_path / "kvcache.toml",
                           {"servers": [proxy.url], "request_timeout_ms": 10_000},
                           [{"name": BUCKET, "max_stale_ms": MAX_STALE_MS}])
        sc = SidecarProcess(tmp_path / "sc", None, extra=["--config", cfg])
        with sc:
            sc.start()  # synced, no lag: the proxy passes bytes at once until told otherwise
            r = redis.Redis(unix_socket_path=sc.socket, socket_timeout=60)
            try:
                yield Live(nats_server.url, proxy, sc, r)
            finally:
                r.close()
            assert sc.stop() == 0


def test_minrev_read_after_ones_own_put_never_answers_below_it(live: Live):
    live.proxy.delay = DELAY_S

    rows: list[tuple[int, int, float, str]] = []   # (r, answered revision, seconds, source)
    for i in range(1, TRIES + 1):
        # as an application would find it: the replica holds the previous write, not the next
        prev = rows[-1][0] if rows else 0
        wait_until(lambda prev=prev: live.applied() >= prev, 30, f"the replica at revision {prev}")
        rev = kv_put(live.server_url, BUCKET, KEY, b"%d" % i)  # nats-py, straight to the server
        t0 = time.perf_counter()
        value, got, _created, _op, source = live.r.execute_command("KV.GET", KEY, "MINREV", rev)
        took = time.perf_counter() - t0
        rows.append((rev, got, took, source.decode()))
        print(f"try {i:2}: put acked at {rev}, MINREV {rev} answered {got} ({value!r}) "
              f"from {source.decode()} after {took * 1000:.0f} ms")
    took_ms = [t * 1000 for _, _, t, _ in rows]
    sources = sorted({s for *_, s in rows})
    print(f"{TRIES} MINREV reads: latency min {min(took_ms):.0f} ms, median "
          f"{statistics.median(took_ms):.0f} ms, max {max(took_ms):.0f} ms; sources {sources}")
    below = [(rev, got, s) for rev, got, _, s in rows if got < rev]
    assert not below, f"{len(below)} of {TRIES} answers below the revision asked (r, answered, source): {below}"


def test_minrev_of_a_key_older_than_r_answers_and_beyond_the_bucket_is_an_error(live: Live):
    """MINREV r asks for the bucket as of revision r or later, not for the key at r: a key last
    written before r (another key was written at r) is answered at its own revision, from the
    leader while the replica lags behind r. A revision the bucket has not reached is an error
    naming it and the bucket's last revision, never the older answer."""
    mine = kv_put(live.server_url, BUCKET, KEY, b"mine")
    live.proxy.delay = DELAY_S
    rev = kv_put(live.server_url, BUCKET, "other", b"theirs")     # the bucket at r, the key below
    t0 = time.perf_counter()
    value, got, _created, _op, source = live.r.execute_command("KV.GET", KEY, "MINREV", rev)
    took = time.perf_counter() - t0
    print(f"MINREV {rev} of a key last written at {got}: {value!r} from {source.decode()} "
          f"after {took * 1000:.0f} ms")
    assert (value, got) == (b"mine", mine) and got < rev
    live.proxy.delay = 0   # a revision beyond the bucket is one whatever the link

    async def last_seq(js) -> int:
        return (await js.stream_info(f"KV_{BUCKET}")).state.last_seq
    last = nats_run(live.server_url, last_seq)
    t0 = time.perf_counter()
    with pytest.raises(redis.ResponseError) as err:
        live.r.execute_command("KV.GET", KEY, "MINREV", 1_000_000)
    print(f"MINREV 1000000: {err.value} after {(time.perf_counter() - t0) * 1000:.0f} ms")
    assert str(err.value) == f"MINREV 1000000 is beyond bucket {BUCKET}'s last revision {last}"
    with pytest.raises(redis.ResponseError, match=f"MINREV {last + 1} is beyond bucket {BUCKET}'s "
                                                 f"last revision {last}"):
        live.r.execute_command("KV.GET", KEY, "MINREV", last + 1, "CONSISTENCY", "strong")
    # the replica current: the revision it holds answers there
    wait_until(lambda: live.applied() >= last, 30, f"the replica at revision {last}")
    reply = live.r.execute_command("KV.GET", KEY, "MINREV", last)
    assert (reply[0], reply[1], reply[4]) == (b"mine", mine, b"local")
