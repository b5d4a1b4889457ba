"""The Unix socket itself: permissions, ownership of the path, limits, hostile input,
backpressure, graceful shutdown, and the real redis-cli / redis-benchmark against it.

One nats-server and one sidecar serve the module; tests that need other flags start their
own sidecar on the same nats-server, and the shutdown test its own nats-server (it freezes
it). Every process is stopped by its own PID.
"""
from __future__ import annotations

import os
import random
import signal
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from support.kvdata import connect, info, key, read_until, rss_kb, seed_bucket
from support.poll import wait_until
from support.sidecar_proc import SidecarProcess, run_cli
from support.topology import nats_run

from kvcache.app.client import Client, encode_command
from kvcache.serve.relay import reply_end

NKEYS = 200
VALUE = b"v" * 100
REDIS_CLI = "/usr/bin/redis-cli"
REDIS_BENCHMARK = "/usr/bin/redis-benchmark"






@pytest.fixture(scope="module")
def url(nats_server_module) -> str:
    return seed_bucket(nats_server_module.url, {key(i): VALUE for i in range(NKEYS)})


@pytest.fixture(scope="module")
def sc(url, tmp_path_factory) -> Iterator[SidecarProcess]:
    # Replicates single-token keys only, so `out.remote` is a remote read.
    s = SidecarProcess(tmp_path_factory.mktemp("srv") / "sc", url, ["key:*"])
    with s:
        s.start()
        yield s
        assert s.stop() == 0


@pytest.fixture
def own_sidecar(url, tmp_path) -> Iterator:
    """Start extra sidecars on the module's nats-server; all stopped at the end."""
    started: list[SidecarProcess] = []

    def start(*extra: str, socket_path: Path | None = None, **kw) -> SidecarProcess:
        s = SidecarProcess(tmp_path / f"sc{len(started)}", url, ["key"], extra=list(extra),
                    socket=socket_path, **kw)
        started.append(s)
        return s.start()

    yield start
    for s in started:
        if s.proc and s.proc.poll() is None:
            s.stop()






def roundtrip(sock: str, data: bytes, until: bytes | None = None) -> bytes:
    s = connect(sock)
    try:
        s.sendall(data)
        return read_until(s, until)
    finally:
        s.close()




# --------------------------------------------------------------------------- the socket file


def test_socket_mode_default(sc):
    st = os.stat(sc.socket)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o660


def test_socket_mode_flag(own_sidecar):
    s = own_sidecar("--socket-mode", "600")
    assert stat.S_IMODE(os.stat(s.socket).st_mode) == 0o600
    assert s.client().ping()
    assert s.stop() == 0
    assert not os.path.exists(s.socket)


def test_stale_socket_is_replaced(own_sidecar, tmp_path):
    path = tmp_path / "stale.sock"
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(path))      # a socket file whose owner is gone: bound, never unlinked
    dead.close()
    assert stat.S_ISSOCK(os.lstat(path).st_mode)
    with pytest.raises(ConnectionRefusedError):
        connect(str(path))
    s = own_sidecar(socket_path=path)
    assert s.client().get("000000000001") == VALUE
    assert s.stop() == 0
    assert not path.exists()


def test_live_socket_is_refused(sc, url, tmp_path):
    r = run_cli("serve", "--data-dir", str(tmp_path / "second"), "--socket", sc.socket,
                "--nats", url, "--bucket", "key", "--log-level", "warning", timeout=60)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert lines == [f"kvcache: error: another process is already serving on {sc.socket}"], r.stderr
    assert sc.client().get("000000000001") == VALUE   # the first one is untouched
    assert os.path.exists(sc.socket)


def test_non_socket_file_is_refused(url, tmp_path):
    path = tmp_path / "not-a-socket"
    path.write_text("precious")
    r = run_cli("serve", "--data-dir", str(tmp_path / "d"), "--socket", str(path),
                "--nats", url, "--bucket", "key", "--log-level", "warning", timeout=60)
    assert r.returncode != 0
    assert r.stderr.strip().splitlines() == [
        f"kvcache: error: {path} exists and is not a socket; refusing to replace it"], r.stderr
    assert path.read_text() == "precious"


# --------------------------------------------------------------------------- limits


def test_max_clients(own_sidecar):
    s = own_sidecar("--max-clients", "5")
    first = Client(s.socket)
    # the helper's own probe connections may still be closing: wait until only ours is left
    # (with workers, on its worker too: a closed client counts there until its link to the
    # sidecar's process, where max_clients counts, is closed)
    wait_until(lambda: _only_one_client(first), 10, "probe connections gone")
    held = []
    for _ in range(4):
        c = connect(s.socket)
        c.sendall(b"PING\r\n")
        assert read_until(c, b"\r\n") == b"+PONG\r\n"
        held.append(c)
    sixth = connect(s.socket)
    assert read_until(sixth, None) == b"-ERR max number of clients reached\r\n"  # then EOF
    sixth.close()
    # redis-py writes HELLO before it reads, so it sees the message or, when the server has
    # already closed (as Redis itself does after saying why), a broken pipe
    with pytest.raises(redis.ConnectionError,
                       match=r"max number of clients reached|Broken pipe|Connection reset"):
        redis.Redis(unix_socket_path=s.socket).ping()
    for c in held:                                  # the five still work
        c.sendall(b"GET 000000000002\r\n")
        assert read_until(c, VALUE + b"\r\n") == b"$100\r\n" + VALUE + b"\r\n"
    assert first.get(key(2)) == VALUE
    held.pop().close()
    r = redis.Redis(unix_socket_path=s.socket)
    assert wait_until(lambda: _try_ping(r), 10, "a freed slot")
    r.close()
    assert first.info("clients")["clients"]["rejected_connections"] >= 2
    first.close()
    for c in held:
        c.close()


def _only_one_client(c: Client) -> bool:
    workers = c.info("workers").get("workers", {})  # (first: a link it still counts reaches the sidecar's count)
    on_workers = sum(int(w["clients"]) for k, w in workers.items() if k.startswith("worker") and k != "workers")
    return on_workers <= 1 and c.info("clients")["clients"]["connected_clients"] == 1


def _try_ping(r: redis.Redis) -> bool:
    try:
        return r.ping()
    except redis.ConnectionError:
        return False


def test_request_larger_than_limit(own_sidecar):
    s = own_sidecar("--max-request-bytes", "4096")
    ok = connect(s.socket)
    cases = [
        encode_command(["GET", "k" * 5000]),                      # one big argument
        b"*2\r\n$3\r\nGET\r\n$5000\r\n",                          # refused on the header alone
        encode_command(["MGET"] + [key(i) for i in range(400)]),  # many small ones
        b"GET " + b"k" * 5000 + b"\r\n",                           # inline
        b"GET " + b"k" * 5000,                                     # inline, no end in sight
    ]
    for data in cases:
        c = connect(s.socket)
        c.sendall(data)
        reply = read_until(c, None)               # the server closes after saying why
        assert reply.startswith(b"-ERR Protocol error: ") and reply.count(b"\r\n") == 1, reply
        c.close()
        ok.sendall(b"GET 000000000003\r\n")
        assert read_until(ok, VALUE + b"\r\n").endswith(VALUE + b"\r\n")
    assert info(s.socket)["protocol_errors"] == len(cases)
    ok.close()


# --------------------------------------------------------------------------- hostile input


# Each hostile input, sent alone on a connection that is then half-closed, and the whole reply:
# the exact error (Redis's wording), or nothing for an incomplete command (the client
# hung up before finishing it) and for empty lines and *0 / *-1 / any negative count (no command
# at all, as in Redis).
PROTO = b"-ERR Protocol error: "
HOSTILE = {
    b"\x00\xff\xfe garbage \x01\x02\r\n":
        b"-ERR unknown command '\x00\xef\xbf\xbd\xef\xbf\xbd', with args beginning with: 'garbage' '\x01\x02' \r\n",
    b"*-5\r\n": b"",
    b"*3000000000\r\n": PROTO + b"invalid multibulk length\r\n",   # past INT_MAX, as Redis
    b"*1\r\n$99999999999\r\n": PROTO + b"invalid bulk length\r\n",
    b"$99999999999\r\n": b"-ERR unknown command '$99999999999', with args beginning with: \r\n",
    b"*3\r\n$3\r\nGET\r\n": b"",                      # half a command, then close
    b"*2\r\n$3\r\nGET\r\n$5\r\nab": b"",
    b"*1\r\n$3\r\nGETxx\r\n": PROTO + b"bulk not terminated by CRLF\r\n",
    b"*abc\r\n": PROTO + b"invalid multibulk length\r\n",
    b"*1\r\n:3\r\n": PROTO + b"expected '$', got ':'\r\n",
    b"*99999999999999999999999\r\n": PROTO + b"invalid multibulk length\r\n",
    b"*1\r\n$-1\r\n": PROTO + b"invalid bulk length\r\n",
    b'GET "unbalanced\r\n': PROTO + b"unbalanced quotes in request\r\n",
    b"x" * (70 * 1024): PROTO + b"too big inline request\r\n",   # an inline line that never ends
    b"*1048577\r\n": PROTO + b"too many arguments\r\n",
    b"\r\n\r\n\n\n": b"",
    b"*0\r\n*-1\r\n": b"",
}


def _blobs(n: int, seed: int = 1234) -> Iterator[bytes]:
    rnd = random.Random(seed)
    valid = [encode_command(c) for c in (["GET", key(1)], ["MGET", key(1), key(2)], ["PING"],
                                         ["KV.GET", key(3), "MINREV", "1"], ["SCAN", "0"],
                                         ["HELLO", "3"], ["INFO"], ["CLIENT", "SETNAME", "x"])]
    for i in range(n):
        kind = i % 4
        if kind == 0:
            yield rnd.randbytes(rnd.randint(1, 512))
        elif kind == 1:   # a valid pipeline with bytes flipped, dropped or inserted
            b = bytearray(b"".join(rnd.choices(valid, k=rnd.randint(1, 6))))
            for _ in range(rnd.randint(1, 4)):
                op, pos = rnd.randint(0, 2), rnd.randrange(len(b))
                if op == 0:
                    b[pos] = rnd.randrange(256)
                elif op == 1:
                    del b[pos]
                else:
                    b.insert(pos, rnd.choice(b"*$:\r\n-0123456789"))
            yield bytes(b)
        elif kind == 2:   # RESP framing characters and numbers
            yield b"".join(rnd.choice([b"*", b"$", b"\r\n", b"-1", b"0", b"3", b"99999999999",
                                       b"GET", b"PING", b" ", b"\"", b"'", b"\n", b"\x00"])
                           for _ in range(rnd.randint(1, 40)))
        else:             # a truncated valid command
            c = rnd.choice(valid)
            yield c[:rnd.randrange(len(c))] + rnd.randbytes(rnd.randint(0, 8))


class Steady(threading.Thread):
    """A well-behaved redis-py client reading the whole time; records anything wrong."""

    def __init__(self, sock: str) -> None:
        super().__init__(daemon=True)
        self.r = redis.Redis(unix_socket_path=sock, protocol=3, socket_timeout=30)
        self.stop = threading.Event()
        self.ok = 0
        self.errors: list[str] = []

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            try:
                if self.r.get(key(i % NKEYS)) != VALUE:
                    self.errors.append(f"wrong value for {key(i % NKEYS)}")
                self.ok += 1
            except Exception as e:
                self.errors.append(repr(e))
                return
            i += 1

    def finish(self) -> None:
        self.stop.set()
        self.join(30)
        self.r.close()
        assert not self.is_alive()
        assert not self.errors, self.errors[:5]
        assert self.ok > 0


def _send_and_drain(sock: str, blob: bytes) -> bytes:
    s = connect(sock)
    try:
        try:
            s.sendall(blob)
            s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass   # the server may close first (a protocol error): fine
        try:
            return read_until(s, None)
        except ConnectionResetError:
            return b""
    finally:
        s.close()


def test_hostile_inputs(sc):
    steady = Steady(sc.socket)
    steady.start()
    before = info(sc.socket)
    for blob, want in HOSTILE.items():
        assert _send_and_drain(sc.socket, blob) == want, blob[:40]
    framing_lost = sum(want.startswith(PROTO) for want in HOSTILE.values())
    assert info(sc.socket)["protocol_errors"] - before["protocol_errors"] == framing_lost
    steady.finish()
    assert sc.proc.poll() is None


def test_random_blobs(sc):
    steady = Steady(sc.socket)
    steady.start()
    for blob in _blobs(10_000):
        _send_and_drain(sc.socket, blob)
    assert sc.proc.poll() is None
    steady.finish()
    with Client(sc.socket) as c:
        assert c.get("000000000005") == VALUE
    assert "Traceback" not in sc.log()


def test_inline_commands(sc):
    assert roundtrip(sc.socket, b"PING\r\n", b"\r\n") == b"+PONG\r\n"
    assert roundtrip(sc.socket, b"PING\n", b"\r\n") == b"+PONG\r\n"      # LF alone, as Redis
    assert roundtrip(sc.socket, b"\r\n  \r\nping\r\n", b"\r\n") == b"+PONG\r\n"
    assert roundtrip(sc.socket, b"GET 000000000007\r\n", VALUE) == b"$100\r\n" + VALUE + b"\r\n"
    assert roundtrip(sc.socket, b'ECHO "a b\\r\\n" \'c d\'\r\n', b"command\r\n") == (
        b"-ERR wrong number of arguments for 'echo' command\r\n")
    assert roundtrip(sc.socket, b'ECHO "a b\\x41"\r\n', b"A\r\n") == b"$4\r\na bA\r\n"
    # inline and multibulk mixed in one pipeline
    got = roundtrip(sc.socket, b"PING\r\n" + encode_command(["ECHO", "x"]) + b"EXISTS 000000000001\r\n",
                    b":1\r\n")
    assert got == b"+PONG\r\n$1\r\nx\r\n:1\r\n"


# --------------------------------------------------------------------------- backpressure


@pytest.mark.parametrize("target", [key(9), "big"], ids=["100B", "512KiB"])
def test_client_that_never_reads(sc, target):
    """A client pipelining GETs without reading its replies: the sidecar must stop reading
    from it (its write buffer is full) instead of buffering replies without bound, also
    when one read of requests asks for gigabytes of replies (GETs of a 512 KiB value)."""
    pid = sc.proc.pid
    base = rss_kb(pid)
    request = encode_command(["GET", target]) * (1 << 16)          # ~2 MB of GETs
    total_goal = 200 * 1024 * 1024
    sent = [0]
    done = threading.Event()
    s = connect(sc.socket, timeout=0.2)

    def writer():
        view = memoryview(request)
        try:
            while sent[0] < total_goal and not done.is_set():
                try:
                    sent[0] += s.send(view[sent[0] % len(request):])
                except TimeoutError:
                    continue
        except OSError:
            pass
        finally:
            done.set()

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    peak = base
    last, still_since = -1, time.monotonic()
    deadline = time.monotonic() + 60
    try:
        # until the writer is finished, or stuck for 3 s (the server stopped reading), or 60 s
        while not done.is_set() and time.monotonic() < deadline:
            peak = max(peak, rss_kb(pid))
            if peak - base > 256 * 1024:
                break  # failing: stop feeding it before it eats the machine
            if sent[0] != last:
                last, still_since = sent[0], time.monotonic()
            elif time.monotonic() - still_since > 3:
                break
            time.sleep(0.05)
        peak = max(peak, rss_kb(pid))
    finally:
        done.set()
        t.join(10)
        s.close()
    assert sent[0] < total_goal, "the sidecar read 200 MB from a client that never reads"
    assert (peak - base) < 64 * 1024, f"RSS grew {(peak - base) // 1024} MB (sent {sent[0] >> 20} MB)"
    # the connection is gone, the sidecar serves others
    wait_until(lambda: info(sc.socket, "clients")["connected_clients"] == 1, 20, "client dropped")
    assert sc.client().get(key(1)) == VALUE


def test_big_reply_pipeline_is_delivered(sc):
    """The same backpressure must not lose anything for a client that reads late."""
    n = 20_000
    s = connect(sc.socket, timeout=30)
    try:
        # The client reads only once its requests are all sent, or once the server stops
        # taking them (its backpressure: 2 MB of replies unread), whichever comes first: a
        # sendall of everything before any read could wait for the server while it waits too.
        sender = threading.Thread(target=s.sendall, args=(encode_command(["GET", key(4)]) * n,))
        sender.start()
        sender.join(5)
        want = (b"$100\r\n" + VALUE + b"\r\n") * n
        got = bytearray()
        while len(got) < len(want):
            chunk = s.recv(1 << 20)
            assert chunk
            got += chunk
        assert bytes(got) == want
        sender.join(30)
        assert not sender.is_alive()
    finally:
        s.close()


def test_half_close_still_gets_replies(sc):
    """A client that half-closes after its requests (shell pipes, `nc -U`) gets every reply,
    a remote one included, and then the connection closes."""
    s = connect(sc.socket, timeout=30)
    try:
        s.sendall(encode_command(["GET", key(1)]) + encode_command(["GET", "out.remote"])
                  + b"GET 000000000002\r\n")
        s.shutdown(socket.SHUT_WR)
        got = read_until(s, None)
    finally:
        s.close()
    assert got == b"$100\r\n" + VALUE + b"\r\n$12\r\nremote value\r\n$100\r\n" + VALUE + b"\r\n"


# --------------------------------------------------------------------------- shutdown


@pytest.mark.servers  # starts a process
def test_sigterm_with_request_in_flight(tmp_path):
    """SIGTERM while a remote read waits on NATS: the reply still goes out, then the sidecar
    exits 0 and removes its socket. NATS is frozen (SIGSTOP) to hold the read in flight."""
    from support.topology import start_single
    ns = start_single(tmp_path / "n")
    try:
        async def setup(js):
            kv = await js.create_key_value(bucket="key", direct=True)
            await kv.put("in.a", b"local")
            await kv.put("out.a", b"remote")
        nats_run(ns.url, setup)
        s = SidecarProcess(tmp_path / "sc", ns.url, ["key:in.>"],
                    env={"KVCACHE_NATS_REQUEST_TIMEOUT_MS": "60000"})
        with s:
            s.start()
            c = connect(s.socket, timeout=60)
            ns.pause()
            try:
                c.sendall(b"GET out.a\r\n")
                wait_until(lambda: info(s.socket)["gets_remote"] == 1, 20, "request in flight")
                s.proc.send_signal(signal.SIGTERM)
                wait_until(lambda: "shutting down" in s.log(), 20, "SIGTERM handled")
                with pytest.raises(OSError):      # no longer accepting
                    connect(s.socket).sendall(b"PING\r\n")
            finally:
                ns.resume()
            got = read_until(c, b"remote\r\n")
            assert got == b"$6\r\nremote\r\n", f"{got!r}\n{s.log()}"
            assert s.proc.wait(30) == 0
            c.close()
            assert not os.path.exists(s.socket)
    finally:
        ns.stop()


# --------------------------------------------------------------------------- redis-tools


def test_redis_cli(sc):
    def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([REDIS_CLI, "-s", sc.socket, *args], capture_output=True,
                              text=True, timeout=30, input=stdin)
    r = cli("PING")
    assert (r.returncode, r.stdout, r.stderr) == (0, "PONG\n", "")
    r = cli("GET", key(1))
    assert (r.returncode, r.stdout.strip()) == (0, VALUE.decode())
    r = cli("GET", "out.remote")
    assert (r.returncode, r.stdout.strip()) == (0, "remote value")
    r = cli("MGET", key(1), "nosuch", "key:out.remote")
    assert r.returncode == 0 and r.stdout.split("\n")[:3] == [VALUE.decode(), "", "remote value"]
    r = cli("--scan", "--pattern", "00000000019*")
    assert r.returncode == 0 and sorted(r.stdout.split()) == [key(i) for i in range(190, 200)]
    r = cli("INFO", "buckets")
    assert r.returncode == 0 and "key:synced=1" in r.stdout
    r = cli("-3", "KV.GET", key(2))
    assert r.returncode == 0 and "local" in r.stdout
    r = cli(stdin="PING\nGET 000000000003\nSET a b\n")
    assert r.returncode == 0
    assert r.stdout.split("\n")[:3] == ["PONG", VALUE.decode(), "READONLY kvcache is a read replica"]


@pytest.mark.parametrize("extra", [[], ["-r", "10000", "-P", "16"], ["-r", "10000", "-c", "50"]],
                         ids=["plain", "random-pipelined", "random-50-clients"])
def test_redis_benchmark(sc, extra):
    before = info(sc.socket)
    r = subprocess.run([REDIS_BENCHMARK, "-s", sc.socket, "-t", "get", "-n", "20000", "-c", "10",
                        "-q", *extra], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    assert "GET:" in out and "requests per second" in out, out
    # redis-benchmark exits non-zero at the first error reply; warnings (CONFIG GET) show here
    assert "ERR" not in out and "rror" not in out and "WARN" not in out, out
    after = info(sc.socket)
    assert after["protocol_errors"] == before["protocol_errors"]
    assert after["gets_local"] - before["gets_local"] >= 20000
    assert after["gets_remote"] == before["gets_remote"]


def test_many_clients_each_get_their_own_replies_in_order(sc):
    """With two or more clients the native GET path defers GET-only reads to the end of the
    event loop's iteration and answers them together: each client must still get exactly
    its own replies, in order, whatever else it mixes in (remote keys, misses, invalid keys,
    other commands, pipelines split across reads). The reference is each request answered
    alone, on the only connection."""
    requests = [encode_command(["GET", key(i)]) for i in (1, 2, 150)] + [
        encode_command(["GET", "key:" + key(3)]), encode_command(["GET", "999999999999"]),
        encode_command(["GET", "out.remote"]), encode_command(["GET", "bad..key"]),
        encode_command(["PING"]), encode_command(["EXISTS", key(4)]), encode_command(["GET", "nobucket:x"])]
    reference = {}
    with connect(sc.socket) as alone:
        for r in requests:
            alone.sendall(r + encode_command(["PING"]))
            # the request's reply and PING's, read as two whole replies (they may come in
            # separate writes: with workers a relayed reply and a local one do)
            got = b""
            while (end := reply_end(got)) < 0 or reply_end(got, end) < 0:
                chunk = alone.recv(65536)
                assert chunk, "connection closed"
                got += chunk
            assert got[end:] == b"+PONG\r\n", got
            reference[r] = got[:end]
    rnd = random.Random(11)
    before = info(sc.socket)
    clients = [connect(sc.socket) for _ in range(24)]
    try:
        for _ in range(40):
            plans = [[rnd.choice(requests) for _ in range(rnd.choice((1, 1, 1, 2, 5)))] for _ in clients]
            for c, plan in zip(clients, plans, strict=True):
                wire = b"".join(plan)
                cut = rnd.randrange(len(wire) + 1) if rnd.random() < 0.2 else len(wire)
                c.sendall(wire[:cut])
                if cut < len(wire):
                    c.sendall(wire[cut:])
            for c, plan in zip(clients, plans, strict=True):
                want = b"".join(reference[r] for r in plan)
                got = b""
                while len(got) < len(want):
                    chunk = c.recv(65536)
                    assert chunk, "connection closed"
                    got += chunk
                assert got == want
    finally:
        for c in clients:
            c.close()
    after = info(sc.socket)
    assert after["protocol_errors"] == before["protocol_errors"]
    if "server_get=native" in info(sc.socket, "server")["native"]:  # the pure-Python path answers each read at once
        assert after["reads_gathered"] > before["reads_gathered"]


def test_sigterm_with_a_client_that_never_reads(own_sidecar):
    """Shutdown must not wait on a client that stopped reading with replies still queued."""
    s = own_sidecar()
    c = connect(s.socket, timeout=0.5)
    request = encode_command(["GET", "big"]) * 1000
    try:
        while True:          # until the sidecar stops reading from us
            c.send(request)
    except TimeoutError:
        pass
    s.proc.send_signal(signal.SIGTERM)
    try:
        assert s.proc.wait(30) == 0
    finally:
        c.close()
    assert not os.path.exists(s.socket)


def test_max_args_bounds_one_request(own_sidecar):
    """`--max-args 3`: a request of three arguments is served, one of four is refused with
    Redis's protocol error and the connection closed (its framing cannot be trusted)."""
    s = own_sidecar("--max-args", "3")
    got = roundtrip(s.socket, encode_command(["MGET", key(1), key(2)]), VALUE + b"\r\n" + b"$100\r\n")
    assert got.startswith(b"*2\r\n$100\r\n" + VALUE), got[:40]
    assert roundtrip(s.socket, encode_command(["MGET", key(1), key(2), key(3)])) == \
        b"-ERR Protocol error: too many arguments\r\n"
    assert info(s.socket)["protocol_errors"] == 1
