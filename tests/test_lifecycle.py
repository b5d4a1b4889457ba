"""The sidecar's life as a process: stopping while NATS is down or hung, one sidecar
per data directory, and the embedded nats-server supervised.

Real processes only: nats-server started here (stopped, SIGSTOPped, SIGKILLed by its PID) and
`kvcache serve` as a subprocess. KVCACHE_LIFECYCLE_REPEAT=20 repeats the shutdown-during-an-
outage cases (default 1, for CI).
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time

import nats
import pytest
from support.poll import wait_until
from support.procs import embedded_pid, pid_alive
from support.sidecar_proc import SidecarProcess, run_cli
from support.topology import start_single

pytestmark = pytest.mark.servers  # each test starts its own servers or sidecar process

REPEAT = int(os.environ.get("KVCACHE_LIFECYCLE_REPEAT", "1"))
HEARTBEAT = ["--heartbeat-ms", "500"]


def make_bucket(url: str, bucket: str = "cfg", keys: int = 10) -> None:
    async def go() -> None:
        nc = await nats.connect(url)
        try:
            kv = await nc.jetstream().create_key_value(bucket=bucket, direct=True)
            for i in range(keys):
                await kv.put(f"k.{i}", f"v{i}".encode())
        finally:
            await nc.close()
    asyncio.run(go())


def children_of(pid: int) -> list[int]:
    """Live processes whose parent is `pid` (what a sidecar could leave behind)."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(d))
    return found


def assert_clean_exit(sc: SidecarProcess, code: int | None) -> None:
    log = sc.log()
    assert code == 0, log
    assert "Traceback" not in log and "RuntimeError" not in log, log
    assert log.rstrip().endswith("kvcache: stopped"), log  # every shutdown step ran
    assert not os.path.exists(sc.socket), log


def send_and_wait(sc: SidecarProcess, sig: int, timeout: float = 30.0) -> int:
    assert sc.proc is not None
    pid = sc.proc.pid
    sc.proc.send_signal(sig)
    code = sc.proc.wait(timeout)
    assert children_of(pid) == []
    return code


# ---------------------------------------------------------------------- stopping during an outage

@pytest.mark.parametrize("outage", ["stopped", "hung"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("round_", range(REPEAT))
def test_stop_while_nats_is_down_or_hung(tmp_path, outage, sig, round_):
    server = start_single(tmp_path)
    try:
        make_bucket(server.url)
        with SidecarProcess(tmp_path / "sc", server.url, buckets=["cfg"], extra=HEARTBEAT) as sc:
            sc.start()
            if outage == "stopped":
                server.stop()
            else:
                server.pause()  # SIGSTOP: the connection stays up, nothing answers
            # the feed notices (missed heartbeats / the lost connection) before the signal
            sc.wait_for(lambda: "recreating consumer" in sc.log() or "disconnected" in sc.log(),
                        what="the outage noticed")
            assert_clean_exit(sc, send_and_wait(sc, sig))
            # the data directory is free again, and the replica was closed cleanly: a new
            # sidecar starts on it (and serves its keys from the replica once NATS is back)
            if outage == "hung":
                server.resume()
            else:
                server.start()
            sc.start()
            with sc.client() as c:
                assert c.get("k.3") == b"v3"
            assert_clean_exit(sc, send_and_wait(sc, signal.SIGTERM))
    finally:
        server.stop()


def test_sighup_stops_cleanly_and_says_why(tmp_path):
    """SIGHUP (a closed terminal, a supervisor's reload): there is no reload, so a graceful
    stop with a line saying so; before, the default action killed it and left its socket."""
    server = start_single(tmp_path)
    try:
        make_bucket(server.url)
        with SidecarProcess(tmp_path / "sc", server.url, buckets=["cfg"]) as sc:
            sc.start()
            with sc.client() as c:
                assert c.get("k.1") == b"v1"
            assert_clean_exit(sc, send_and_wait(sc, signal.SIGHUP))
            assert "SIGHUP: kvcache does not reload its configuration" in sc.log()
    finally:
        server.stop()


def test_stop_ends_blocked_stream_reads_with_their_error(tmp_path):
    """100 followers blocked in `XREAD BLOCK 0`: SIGTERM ends each read at once with the
    documented error (docs/commands.md), not by dropping the connection after the drain's
    grace (before: 5 s, then "connection closed" and no reply)."""
    server = start_single(tmp_path)
    followers: list[socket.socket] = []
    try:
        make_bucket(server.url)
        with SidecarProcess(tmp_path / "sc", server.url, buckets=["cfg"]) as sc:
            sc.start()
            for _ in range(100):
                s = socket.socket(socket.AF_UNIX)
                s.connect(str(sc.socket))
                s.sendall(b"*6\r\n$5\r\nXREAD\r\n$5\r\nBLOCK\r\n$1\r\n0\r\n"
                          b"$7\r\nSTREAMS\r\n$4\r\n@cfg\r\n$1\r\n$\r\n")
                followers.append(s)
            with sc.client() as c:
                wait_until(lambda: c.info("clients")["clients"]["blocked_clients"] == 100, 30,
                           "100 followers blocked")
            began = time.monotonic()
            assert_clean_exit(sc, send_and_wait(sc, signal.SIGTERM))
            print(f"stopped {time.monotonic() - began:.3f} s after SIGTERM with 100 followers")
        for s in followers:
            s.settimeout(10)
            reply = b""
            while not reply.endswith(b"\r\n"):
                got = s.recv(4096)
                assert got, f"closed without a reply after {reply!r}"
                reply += got
            assert reply == (b"-ERR stream read ended: bucket cfg: kvcache is shutting down; "
                             b"read again from the last ID you have\r\n")
    finally:
        for s in followers:
            s.close()
        server.stop()


def test_signal_during_start_exits_cleanly(tmp_path):
    """SIGTERM while the first connection to a hung server is still being attempted."""
    server = start_single(tmp_path)
    try:
        make_bucket(server.url)
        server.pause()
        sc = SidecarProcess(tmp_path / "sc", server.url, buckets=["cfg"],
                     extra=[*HEARTBEAT, "--connect-timeout-s", "30"])
        sc.data_dir.mkdir(parents=True)
        with sc:
            sc._log = open(sc.log_path, "ab")
            sc.proc = subprocess.Popen(sc.args, stdout=sc._log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, env=sc.env)
            sc.wait_for(lambda: os.path.exists(sc.data_dir / "kvcache.lock"), what="lock taken")
            code = send_and_wait(sc, signal.SIGTERM)
            sc._log.close()
            assert code == 0, sc.log()
            assert "Traceback" not in sc.log()
    finally:
        server.stop()


def test_stop_with_the_embedded_server_hung(tmp_path):
    """The embedded nats-server SIGSTOPped: SIGTERM still ends everything, the server too."""
    with SidecarProcess(tmp_path / "data", None) as sc:
        sc.start()
        nats_pid = embedded_pid(sc)
        os.kill(nats_pid, signal.SIGSTOP)
        assert_clean_exit(sc, send_and_wait(sc, signal.SIGTERM))
        assert not pid_alive(nats_pid)


# ---------------------------------------------------------------------- one sidecar per data dir

def test_second_sidecar_on_the_same_data_dir_is_refused(tmp_path):
    with SidecarProcess(tmp_path / "data", None) as first:
        first.start()
        before = sorted(os.listdir(first.data_dir))
        nats_pid = embedded_pid(first)
        # another socket, same data directory: refused before any nats-server or replica
        other = str(tmp_path / "other.sock")
        result = run_cli("serve", "--data-dir", str(first.data_dir), "--socket", other, timeout=60)
        assert result.returncode == 1, result
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
        assert lines[0].startswith("kvcache: error: data directory ")
        assert f"in use by another kvcache serve (pid {first.proc.pid})" in lines[0]
        assert not os.path.exists(other)
        assert sorted(os.listdir(first.data_dir)) == before
        assert embedded_pid(first) == nats_pid
        with first.client() as c:
            assert c.get("greeting") == b"hello from kvcache"
        assert first.stop() == 0
    # released on exit: the lock file stays, and does not block
    assert (tmp_path / "data" / "kvcache.lock").exists()
    with SidecarProcess(tmp_path / "data", None) as again:
        again.start()
        assert again.stop() == 0


def test_lock_of_a_killed_sidecar_does_not_block(tmp_path):
    with SidecarProcess(tmp_path / "data", None) as sc:
        sc.start()
        sc.kill()  # SIGKILL: no cleanup at all; the kernel drops the flock
        sc.start()
        with sc.client() as c:
            assert c.get("greeting") == b"hello from kvcache"
        assert sc.stop() == 0


# ---------------------------------------------------------------------- embedded server supervised

def wait_new_pid(sc: SidecarProcess, old: int) -> int:
    return sc.wait_for(lambda: _pid_or_none(sc, old), timeout=30, what="embedded nats-server restarted")


def _pid_or_none(sc: SidecarProcess, old: int) -> int | None:
    try:
        pid = embedded_pid(sc)
    except AssertionError:
        return None
    return pid if pid != old and pid_alive(pid) else None


def test_killed_embedded_server_is_restarted_and_reads_recover(tmp_path):
    with SidecarProcess(tmp_path / "data", None) as sc:
        sc.start()
        with sc.client() as c:
            url = c.info("server")["server"]["nats_url"]
        old = embedded_pid(sc)
        os.kill(old, signal.SIGKILL)
        new = wait_new_pid(sc, old)
        # the new PID shows in /proc a moment before the server is ready and the line logged
        sc.wait_for(lambda: f"(pid {new}; restart 1)" in sc.log(), what="the restart logged")
        assert f"embedded nats-server (pid {old}) exited on SIGKILL" in sc.log()

        def strong_read():
            try:
                with sc.client() as c:
                    return c.entry("greeting", consistency="strong")
            except Exception:
                return None
        e = sc.wait_for(strong_read, what="a read from the restarted server")
        assert e.value == b"hello from kvcache" and e.source == "leader"

        # the feed follows the restarted server: a write there reaches the replica
        async def put() -> None:
            nc = await nats.connect(str(url))
            try:
                kv = await nc.jetstream().key_value("demo")
                await kv.put("after.restart", b"yes")
            finally:
                await nc.close()
        asyncio.run(put())
        sc.wait_for(lambda: sc.client().get("after.restart") == b"yes", what="the write replicated")
        assert_clean_exit(sc, send_and_wait(sc, signal.SIGTERM))
        assert not pid_alive(new)


def test_embedded_server_that_cannot_start_again_ends_the_sidecar(tmp_path):
    """Its port taken after a crash: every restart fails, and after EMBEDDED_MAX_FAILURES the
    sidecar exits 1 with one clear error line."""
    with SidecarProcess(tmp_path / "data", None) as sc:
        sc.start()
        with sc.client() as c:
            port = int(str(c.info("server")["server"]["nats_url"]).rsplit(":", 1)[1])
        squatter = None
        pid = embedded_pid(sc)
        for _ in range(5):  # the restart may win the race for the port: kill it again
            os.kill(pid, signal.SIGKILL)
            while pid_alive(pid):
                time.sleep(0.01)
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
                s.listen()
                squatter = s
                break
            except OSError:
                s.close()
                pid = wait_new_pid(sc, pid)
        assert squatter is not None
        try:
            code = sc.proc.wait(120)
        finally:
            squatter.close()
        log = sc.log()
        assert code == 1, log
        assert "did not start again" in log
        last = log.strip().splitlines()[-1]
        assert last.startswith("kvcache: error: embedded nats-server died or failed to start"), log
        assert "giving up" in last
        assert not os.path.exists(sc.socket)
        assert children_of(sc.proc.pid) == []
        sc._log.close()
