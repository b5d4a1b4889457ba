"""`workers = N`: N processes serve the socket from the one replica (kvcache.supervisors), the
sidecar's own process keeping NATS, the feeds and every per-connection state.

Against real nats-servers, with real clients (redis-py, redis-benchmark, raw sockets):
- under load both workers answer GETs from the replica, and INFO adds them up;
- a revision handed out from NATS is never followed by an older one from the replica on any
  worker, with the feed held 0.8 s behind by a delaying proxy (the hold itself, published on
  the board before the answer that placed it goes out, is driven in tests/test_board.py);
- a worker killed with SIGKILL: its clients see a closed connection, never a wrong answer,
  another takes its place, and the others serve on;
- CLIENT LIST sees every worker's clients, and CLIENT KILL closes one on another worker;
- with the access log on, every GET any worker's client makes is recorded, once;
- the settings: `auto`, a bad count, a data directory too long for the internal socket.
The same suites that test one process (server, tracking, streams, pub/sub, MULTI, CLIENT,
AUTH, MINREV, the read matrix, partitions) run again with KVCACHE_WORKERS=2 in CI (`make
test-workers`).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
from support.kvdata import connect, kv_put, read_until
from support.poll import wait_until
from support.sidecar_proc import SidecarProcess, write_config
from support.topology import DelayProxy, nats_run

from kvcache.app.client import encode_command
from kvcache.config import ConfigError
from kvcache.config_sources import load
from kvcache.serve.relay import reply_end

pytestmark = pytest.mark.timeout(300)

BUCKET = "wk"
NKEYS = 50
VALUE = b"w" * 100
REDIS_BENCHMARK = shutil.which("redis-benchmark")


def key(i: int) -> str:
    return f"k{i:04d}"


def workers_info(sc: SidecarProcess) -> dict[str, dict]:
    with sc.client() as c:
        return {k: v for k, v in c.info("workers")["workers"].items() if k.startswith("worker") and k != "workers"}


def seed(url: str, bucket: str = BUCKET) -> None:
    async def setup(js):
        kv = await js.create_key_value(bucket=bucket, history=1)
        for i in range(NKEYS):
            await kv.put(key(i), VALUE)
    nats_run(url, setup)


@contextmanager
def two_workers(url: str, data: Path, *extra: str) -> Iterator[SidecarProcess]:
    """A sidecar with two workers on the seeded bucket, both serving; stopped cleanly after."""
    seed(url)
    sc = SidecarProcess(data, url, [BUCKET], extra=["--workers", "2", *extra])
    with sc:
        sc.start()
        wait_until(lambda: all(w["pid"] for w in workers_info(sc).values()), 30, "both workers serving")
        yield sc
        assert sc.stop() == 0


@pytest.fixture
def two(nats_server, tmp_path: Path) -> Iterator[SidecarProcess]:
    with two_workers(nats_server.url, tmp_path / "sc") as sc:
        yield sc
    # nothing of the workers left in the data directory: the internal socket, the board, the
    # connections' state CLIENT LIST had them write
    assert sorted(p.name for p in (tmp_path / "sc").glob("workers*")) == []


def get(c: socket.socket, k: str) -> bytes:
    """One GET on a raw connection, as clients send it (a multibulk: the GET path's; an inline
    GET is the command layer's, in the sidecar's process): its whole reply (b"" if the
    connection closed)."""
    c.sendall(encode_command(["GET", k]))
    buf = b""
    while reply_end(buf) < 0:
        chunk = c.recv(65536)
        if not chunk:
            return b""
        buf += chunk
    return buf


def spread(sc: SidecarProcess, most: int = 64) -> list[socket.socket]:
    """Connections opened until both workers have at least one (the kernel chooses)."""
    conns: list[socket.socket] = []
    for _ in range(most):
        c = connect(sc.socket)
        c.sendall(b"PING\r\n")
        assert read_until(c, b"+PONG\r\n") == b"+PONG\r\n"
        conns.append(c)
        if len(conns) >= 2 and all(int(w["clients"]) >= 1 for w in workers_info(sc).values()):
            return conns
    counts = {n: w["clients"] for n, w in workers_info(sc).items()}
    pytest.fail(f"{most} connections, and not every worker got one: {counts}")


def ten_gets_on_both(sc: SidecarProcess) -> list[socket.socket]:
    """Connections on both workers (spread), each having read keys 0-9 once."""
    conns = spread(sc)
    for c in conns:
        for i in range(10):
            assert get(c, key(i)) == b"$100\r\n" + VALUE + b"\r\n"
    return conns


@pytest.mark.skipif(REDIS_BENCHMARK is None, reason="redis-benchmark not installed (make system-deps)")
def test_under_load_both_workers_answer_and_info_adds_them_up(two):
    before = workers_info(two)
    r = subprocess.run([REDIS_BENCHMARK, "-s", two.socket, "-n", "40000", "-c", "50", "-q",
                        "GET", key(7)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "requests per second" in r.stdout + r.stderr, r.stderr
    print(r.stdout.strip().splitlines()[-1])
    after = workers_info(two)
    served = {n: int(after[n]["gets_local"]) - int(before[n]["gets_local"]) for n in after}
    print(f"GETs answered per worker: {served}")
    assert len(served) == 2 and all(n > 0 for n in served.values()), served
    with two.client() as c:
        stats = c.info("stats")["stats"]
    assert stats["gets_local"] >= 40000 and stats["gets_remote"] == 0
    assert stats["gets_local"] >= sum(int(w["gets_local"]) for w in after.values())


def test_a_revision_from_nats_is_never_followed_by_an_older_one_on_any_worker(nats_server, tmp_path):
    """The feed 0.8 s behind (a delaying proxy), well inside max_stale_ms: a strong read hands
    out revision r from the leader, then every connection, on both workers, reads the key:
    none may answer r-1 from its worker's replica. (On one NATS connection the feed's copy of
    r usually lands before the strong read's answer, so this is the end-to-end check; the
    case where NATS's answer is ahead of the replica, and the hold must reach every worker
    before it goes out, is driven in process: tests/test_board.py, with the hook removed it
    fails.)"""
    seed(nats_server.url)
    with DelayProxy(nats_server.port) as proxy:
        cfg = write_config(tmp_path / "kvcache.toml", {"servers": [proxy.url], "request_timeout_ms": 10_000},
                           [{"name": BUCKET, "max_stale_ms": 5000}])
        sc = SidecarProcess(tmp_path / "sc", None, extra=["--config", cfg, "--workers", "2"])
        with sc:
            sc.start()
            wait_until(lambda: all(w["pid"] for w in workers_info(sc).values()), 30, "both workers serving")
            conns = spread(sc)
            strong = redis.Redis(unix_socket_path=sc.socket, socket_timeout=30)
            proxy.delay = 0.8
            older = []
            for i in range(5):
                rev = kv_put(nats_server.url, BUCKET, key(1), b"v%d" % i)
                _value, got, *_, source = strong.execute_command("KV.GET", key(1), "CONSISTENCY", "strong")
                assert got == rev and source == b"leader", (got, rev, source)
                for c in conns:
                    reply = get(c, key(1))
                    if reply != b"$%d\r\nv%d\r\n" % (len(b"v%d" % i), i):
                        older.append((i, reply))
                print(f"put {i} acked at {rev}: {len(conns)} connections on both workers read it")
            strong.close()
            for c in conns:
                c.close()
            proxy.delay = 0
            assert not older, f"answers below a revision already handed out: {older}"
            assert sc.stop() == 0


def test_a_worker_killed_is_replaced_and_its_clients_see_a_closed_connection(two):
    conns = spread(two)
    before = workers_info(two)
    victim = int(before["worker0"]["pid"])
    on_victim = int(before["worker0"]["clients"])
    os.kill(victim, signal.SIGKILL)
    closed = answered = 0
    for c in conns:
        try:
            reply = get(c, key(3))
        except OSError:
            reply = b""
        if reply == b"":
            closed += 1
        else:  # whatever answers is right: the value, whole (never another reply)
            assert reply == b"$100\r\n" + VALUE + b"\r\n", reply
            answered += 1
        c.close()
    print(f"{on_victim} clients on the killed worker: {closed} closed, {answered} answered by the other")
    assert closed >= 1 and answered >= 1
    wait_until(lambda: int(workers_info(two)["worker0"]["pid"]) not in (0, victim), 30, "worker 0 started again")
    assert f"worker 0 (pid {victim}) was killed by signal 9; starting another" in two.log()
    with two.client() as c:
        assert c.get(key(3)) == VALUE
    assert two.proc is not None and two.proc.poll() is None  # the feed never stopped


def test_client_list_and_kill_see_every_workers_clients(two):
    conns = spread(two)
    r = redis.Redis(unix_socket_path=two.socket)
    listed = r.client_list()
    assert len(listed) == len(conns) + 1  # every connection, whichever worker has it, and this one
    assert {c["addr"] for c in listed} == {f"{two.socket}:0"}  # the clients' own socket
    ids = [int(c["id"]) for c in listed if int(c["id"]) != r.client_id()]
    assert r.client_kill_filter(_id=ids[0]) == 1
    gone = 0
    for c in conns:
        try:
            c.sendall(b"PING\r\n")
            gone += c.recv(64) == b""
        except OSError:
            gone += 1
        c.close()
    assert gone == 1
    r.close()


@pytest.mark.quick
def test_the_workers_setting(tmp_path):
    assert load(None, env={"KVCACHE_WORKERS": "auto"}).workers == len(os.sched_getaffinity(0))
    assert load(None, env={}, overrides={"workers": "3"}).workers == 3
    path = tmp_path / "kvcache.toml"
    path.write_text("workers = 2\n")
    assert load(str(path), env={}).workers == 2
    for bad in ("0", "-1", "two"):
        with pytest.raises(ConfigError, match="KVCACHE_WORKERS must be a number of processes"):
            load(None, env={"KVCACHE_WORKERS": bad})
    both = load(None, env={"KVCACHE_WORKERS": "2", "KVCACHE_ACCESS_LOG_RATE": "0.5"})
    assert (both.workers, both.access_log_rate) == (2, 0.5)
    long_dir = "/tmp/" + "d" * 95
    with pytest.raises(ConfigError, match="data_dir is too long for workers"):
        load(None, env={"KVCACHE_WORKERS": "2", "KVCACHE_DATA_DIR": long_dir,
                        "KVCACHE_SOCKET": "/tmp/s.sock"})


def test_the_access_log_records_every_get_on_every_worker(nats_server, tmp_path):
    """The access log is written by the sidecar's process: with it on, the workers answer no
    GET themselves (as without workers every GET then takes the command layer), so each GET a
    client of any worker makes is one line, and its hits and misses are as the replica has them."""
    from support.access_records import read_records
    with two_workers(nats_server.url, tmp_path / "sc", "--access-log-rate", "1") as sc:
        conns = ten_gets_on_both(sc)
        for c in conns:
            assert get(c, "nope") == b"$-1\r\n"
        want = 11 * len(conns)
        logs = tmp_path / "sc" / "access-logs"
        # buffered, flushed within a second
        wait_until(lambda: len(read_records(logs)) >= want, 10, f"{want} access log lines",
                   detail=lambda: str(len(read_records(logs))))
        records = read_records(logs)
        print(f"{len(conns)} connections over both workers, {len(records)} lines")
        assert len(records) == want
        assert sorted((r["key"], r["hit"]) for r in records) == sorted(
            [(key(i), "1") for i in range(10)] * len(conns) + [("nope", "0")] * len(conns))
        assert {r["bucket"] for r in records} == {BUCKET} and {r["source"] for r in records} == {"local"}
        assert all(int(w["gets_local"]) == 0 for w in workers_info(sc).values())
        for c in conns:
            c.close()


def test_metrics_add_up_every_worker_and_show_each(nats_server, tmp_path):
    from support.scrape import http_get, metrics_address
    with two_workers(nats_server.url, tmp_path / "sc", "--metrics-listen", "127.0.0.1:0") as sc:
        conns = ten_gets_on_both(sc)
        address = metrics_address(sc)
        want = 10 * len(conns)

        def scraped() -> dict[str, float]:
            status, text = http_get(address, "/metrics")
            assert status == 200
            return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                    if line.startswith(("kvcache_worker_", "kvcache_reads_total{"))}
        # the workers write their counters twice a second: /metrics shows them within that
        wait_until(lambda: sum(v for k, v in scraped().items() if k.startswith("kvcache_worker_gets_total"))
                   >= want, 10, f"{want} GETs in the workers counters", detail=lambda: repr(scraped()))
        got = scraped()
        each = {k: v for k, v in got.items() if k.startswith("kvcache_worker_gets_total")}
        print(each)
        assert set(each) == {'kvcache_worker_gets_total{worker="0"}', 'kvcache_worker_gets_total{worker="1"}'}
        assert all(v > 0 for v in each.values())
        assert got['kvcache_reads_total{bucket="wk",result="hit",source="local"}'] >= want
        assert {k.split("{")[0] for k in got if k.startswith("kvcache_worker_")} == {
            "kvcache_worker_clients", "kvcache_worker_gets_total", "kvcache_worker_report_age_seconds"}
        for c in conns:
            c.close()
