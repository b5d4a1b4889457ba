"""The first connection to NATS: `--connect-timeout-s` is its whole budget, and its one error
line names what was found at the address. Each case is a real listener this test starts on
127.0.0.1 (a socket that accepts and says nothing, one that sends an SSH banner, a
redis-server, nats-servers requiring TLS, TLS first, or credentials) and a real `kvcache serve`
(and `kvcache load`) process. The measured times are printed (`pytest -s`) beside the budget,
not asserted (a busy host stretches them).

And credentials given to a server that requires none: the sidecar starts, with one warning
(nats-server itself accepts them silently; refusing would break the usual rollout, which
gives clients their credentials before the server demands them).
"""
from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import nats
import pytest
from support.natsauth import have_openssl, make_pki
from support.poll import wait_until
from support.sidecar_proc import SidecarProcess, run_cli

from kvcache.natsio.nats_server import NatsServer, die_with_parent, free_port

pytestmark = pytest.mark.servers  # starts its own listeners, servers and sidecars

BUDGET_S = 2.0
ROWS: list[tuple[str, float, float, str]] = []  # case, budget, seconds to fail, the line


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    if not have_openssl():
        pytest.skip("the openssl CLI makes the test certificates")
    return make_pki(tmp_path_factory.mktemp("pki"))


def serve_fails(case: str, tmp_path: Path, url: str, *extra: str, budget: float = BUDGET_S) -> str:
    """`kvcache serve` against `url`: exit 1 with one `kvcache: error:` line, and nothing
    left in a fresh data directory. Returns the line; the time it took is printed."""
    data = tmp_path / "sc"
    t0 = time.monotonic()
    r = run_cli("serve", "--nats", url, "--bucket", "b", "--data-dir", str(data),
                "--connect-timeout-s", f"{budget:g}", *extra, timeout=60)
    took = time.monotonic() - t0
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvcache: error: cannot connect to NATS at {url}: "), r.stderr
    assert not data.exists()
    ROWS.append((case, budget, took, lines[0]))
    return lines[0].split(f"cannot connect to NATS at {url}: ", 1)[1]


@contextmanager
def listener(greeting: bytes | None = None, accept: bool = True) -> Iterator[int]:
    """A TCP listener on 127.0.0.1: its port. `accept=False`: connections complete in the
    kernel's backlog and nothing ever reads or writes them; else each accepted connection
    gets `greeting` (when given), then is held open, silent, until the listener closes."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            held.append(conn)
            if greeting:
                conn.sendall(greeting)

    thread = threading.Thread(target=serve, daemon=True) if accept else None
    if thread:
        thread.start()
    try:
        yield srv.getsockname()[1]
    finally:
        stop.set()
        if thread:
            thread.join(5)
        for c in held:
            c.close()
        srv.close()


def test_nothing_listening(tmp_path):
    why = serve_fails("nothing listening", tmp_path, f"nats://127.0.0.1:{free_port()}")
    assert why == "nothing listening there (connection refused)"


def test_a_port_that_accepts_and_says_nothing(tmp_path):
    """The connect timeout is the whole wait (it was 2 x the timeout + 1 s before: 5.8 s at
    2 s, 11.9 s at the default 5 s), and the line asks whether this is a NATS port."""
    with listener(accept=False) as port:
        url = f"nats://127.0.0.1:{port}"
        why = serve_fails("accepts, says nothing", tmp_path, url)
        assert why == ("no NATS INFO within 2s: is this a NATS port? (it accepted the connection and said "
                       "nothing, not even to a TLS handshake)")
        why = serve_fails("accepts, says nothing (default 5 s)", tmp_path, url, budget=5.0)
        assert why.startswith("no NATS INFO within 5s: is this a NATS port?")


def test_another_protocols_banner(tmp_path):
    with listener(b"SSH-2.0-x\r\n") as port:
        why = serve_fails("an SSH banner", tmp_path, f"nats://127.0.0.1:{port}")
    assert why == "not a NATS server: it said 'SSH-2.0-x\\r\\n' where a NATS server sends INFO first (an SSH server?)"
    with listener(b"+OK POP3 server ready\r\n") as port:
        why = serve_fails("a POP3 banner", tmp_path, f"nats://127.0.0.1:{port}")
    assert why.startswith("not a NATS server: it said '+OK POP3 server ready\\r\\n'")


def test_a_redis_server(tmp_path):
    """Redis says nothing until spoken to: its answer to PING is what shows it is not NATS."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
    try:
        wait_until(lambda: socket.create_connection(("127.0.0.1", port), 1).close() or True, 10, "redis-server")
        why = serve_fails("a redis-server", tmp_path, f"nats://127.0.0.1:{port}")
    finally:
        proc.terminate()
        proc.wait(10)
    assert why == ("not a NATS server: it answered PING with '+PONG\\r\\n' where a NATS server sends INFO first "
                   "(a Redis server?)")


def _tls_conf(pki: dict[str, Path], first: bool = False) -> str:
    return (f'tls {{ cert_file: "{pki["server.pem"]}", key_file: "{pki["server.key"]}"'
            f'{", handshake_first: true" if first else ""} }}')


def test_tls_required_by_the_server(tmp_path, pki):
    """No --tls-ca: nats-py checks the certificate against the system's CAs and fails; the
    line says the server requires TLS and which flag gives its CA."""
    server = NatsServer(tmp_path / "js", server_name="tlsreq", jetstream=False, extra_conf=_tls_conf(pki)).start()
    try:
        why = serve_fails("TLS required, no --tls-ca", tmp_path, server.url)
    finally:
        server.stop()
    assert "certificate verify failed" in why
    assert why.endswith("(the server requires TLS: its certificate was checked against this system's CAs; "
                        "give its CA with --tls-ca)"), why


def test_a_tls_first_port_spoken_to_in_plaintext(tmp_path, pki):
    server = NatsServer(tmp_path / "js", server_name="tlsfirst", jetstream=False,
                        extra_conf=_tls_conf(pki, first=True)).start()
    try:
        for extra in ([], ["--tls-ca", str(pki["ca.pem"])]):
            why = serve_fails(f"TLS handshake first{' (with --tls-ca)' if extra else ''}", tmp_path, server.url,
                              *extra)
            assert why.startswith("TLS expected: the port answers a TLS handshake and says nothing in plaintext, "
                                  "where a NATS server sends INFO first"), why
    finally:
        server.stop()


def test_tls_configured_but_the_server_offers_none(tmp_path, pki):
    """nats-py upgrades only when the server requires TLS: with --tls-ca against a server
    without TLS it would connect, credentials and all, in plaintext."""
    server = NatsServer(tmp_path / "js", server_name="plain", jetstream=False).start()
    try:
        why = serve_fails("--tls-ca, server without TLS", tmp_path, server.url, "--tls-ca", str(pki["ca.pem"]))
    finally:
        server.stop()
    assert why.startswith(f"TLS is configured (--tls-ca/--tls-cert) but the NATS server at {server.url} does not "
                          "require it (its INFO: tls_required false)"), why


def test_credentials_refused_or_missing(tmp_path):
    conf = 'authorization { users = [ {user: "kv", password: "right-pw"} ] }'
    server = NatsServer(tmp_path / "js", server_name="auth", jetstream=False, extra_conf=conf).start()
    try:
        why = serve_fails("credentials missing", tmp_path, server.url)
        assert why == ("authorization violation: the server requires credentials and none were given "
                       "(--user/--password, --token, --nkey, --creds, or user:password@ in the URL)")
        why = serve_fails("credentials refused", tmp_path, server.url, "--user", "kv", "--password", "wrong-pw")
        assert why == "authorization violation: the server refused the credentials given"
    finally:
        server.stop()


def server_with_bucket(tmp_path, name: str) -> NatsServer:
    """A nats-server holding bucket b with a = 1."""
    server = NatsServer(tmp_path / "js", server_name=name).start()

    async def make() -> None:
        nc = await nats.connect(server.url)
        await (await nc.jetstream().create_key_value(bucket="b")).put("a", b"1")
        await nc.close()
    asyncio.run(make())
    return server


def test_a_pool_with_one_server_that_answers(tmp_path):
    """A refused and a silent address beside one NATS server: connected at once, without
    waiting out the silent one."""
    server = server_with_bucket(tmp_path, "pool")
    try:
        with listener(accept=False) as silent:
            urls = f"nats://127.0.0.1:{free_port()},nats://127.0.0.1:{silent},{server.url}"
            sc = SidecarProcess(tmp_path / "sc", None, buckets=["b"],
                                extra=["--connect-timeout-s", "30"], env={"KVCACHE_NATS_SERVERS": urls})
            with sc:
                t0 = time.monotonic()
                sc.start()
                took = time.monotonic() - t0
                with sc.client() as c:
                    assert c.get("a") == b"1"
                assert sc.stop() == 0
        ROWS.append(("pool: refused, silent, NATS", 30.0, took, "(started and served)"))
    finally:
        server.stop()


def test_credentials_for_a_server_without_auth_are_warned_about(tmp_path):
    server = server_with_bucket(tmp_path, "noauth")
    try:
        for n, flags in enumerate((["--user", "kv", "--password", "pw"], ["--token", "t0ken"])):
            with SidecarProcess(tmp_path / f"sc{n}", server.url, buckets=["b"], extra=flags) as sc:
                sc.start()
                warned = [ln for ln in sc.log().splitlines() if "requires no authentication" in ln]
                assert warned == [ln for ln in warned if "WARNING kvcache: the NATS server at " in ln]
                assert len(warned) == 1 and warned[0].endswith(
                    "requires no authentication (its INFO: no auth_required), so the credentials given are "
                    "not used: every client may connect as this one does; if the server should require them, "
                    "its authorization block is missing"), sc.log()
                assert sc.stop() == 0
                assert "pw" not in "".join(warned) and "t0ken" not in sc.log()
        with SidecarProcess(tmp_path / "plain", server.url, buckets=["b"]) as sc:  # none given: no warning
            sc.start()
            assert "requires no authentication" not in sc.log()
            assert sc.stop() == 0
    finally:
        server.stop()


def test_kvcache_load_says_the_same(tmp_path):
    """`kvcache load`'s driver shares the first connection: its line names what it found, and
    its budget is its own 3 s."""
    data = tmp_path / "d.csv"
    data.write_text("k,v\na,1\n")
    with listener(b"SSH-2.0-x\r\n") as banner, listener(accept=False) as silent:
        cases = (("load: an SSH banner", banner, "not a NATS server: it said 'SSH-2.0-x\\r\\n'"),
                 ("load: accepts, says nothing", silent, "no NATS INFO within 3s: is this a NATS port?"))
        for case, port, expect in cases:
            url = f"nats://127.0.0.1:{port}"
            t0 = time.monotonic()
            r = run_cli("load", str(data), "--nats", url, "--bucket", "b", "--key", "k", "--value", "v", timeout=120)
            took = time.monotonic() - t0
            lines = r.stderr.strip().splitlines()
            assert r.returncode == 1 and len(lines) == 1, r.stderr
            assert lines[0].startswith(f"kvcache: error: cannot connect to NATS at {url}: {expect}"), lines
            ROWS.append((case, 3.0, took, lines[0]))


def teardown_module() -> None:
    if ROWS:
        print("\n| case | budget | took | line |\n|---|---|---|---|")
        for case, budget, took, line in ROWS:
            print(f"| {case} | {budget:g} s | {took:.2f} s | {line} |")
