"""What the host takes away from a sidecar: its disk's room at start, its socket and its data
directory while it serves. Each gets one line and a state the probes (or the exit code) report,
as an operator of nginx, redis-server or nats-server expects, and nothing is left behind by a
start that failed.

- A full disk at start (a tmpfs the test mounts and fills): exit 1 with one line naming the
  data directory, the room left and what to do; no traceback, no file left (before: a
  25-line traceback from the lock file's write, an empty kvcache.lock left; a bit more room
  and LMDB's lock file killed the process with SIGBUS).
- The socket removed: made again within a second, with one line; a new client connects, one
  connected before keeps its connection. Its directory removed too: /readyz says not ready
  with the line, until the socket can be made again (before: nothing noticed, /readyz ready).
- The data directory removed (`rm -rf kvcache-data`, a user resetting the demo): a second
  sidecar on the same path is refused with the first's PID while the first runs (the lock is
  kept outside the directory too), and the first stops with exit 1 and one line (before: the
  lock went with the directory and the second started beside the first).
- A lock file removed is made again, so the second sidecar is still refused.

Real processes only (nats-server, `kvcache serve`); every wait polls real state.
"""
from __future__ import annotations

import asyncio
import os
import re
import signal
import stat
import subprocess
import sys
from pathlib import Path

import nats
import pytest
from support.procs import embedded_pid, pid_alive
from support.scrape import http_get, metrics_address
from support.sidecar_proc import SidecarProcess, run_cli
from support.tmpfs import fill, small_tmpfs

from kvcache.ops.datadir import outside_lock_path

pytestmark = [pytest.mark.timeout(180), pytest.mark.servers]

BUCKET = "host"


def put_keys(url: str, keys: dict[str, bytes]) -> None:
    async def go() -> None:
        nc = await nats.connect(url)
        try:
            kv = await nc.jetstream().create_key_value(bucket=BUCKET, direct=True)
            for k, v in keys.items():
                await kv.put(k, v)
        finally:
            await nc.close()
    asyncio.run(go())


def error_line(result: subprocess.CompletedProcess) -> str:
    """The CLI's one `kvcache: error:` line, last on stderr; no traceback."""
    assert "Traceback" not in result.stderr, result.stderr
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("kvcache: error:")]
    assert len(errors) == 1 and result.stderr.strip().splitlines()[-1] == errors[0], result.stderr
    return errors[0]


def left_in(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


# ------------------------------------------------------------------------------ a full disk

NO_ROOM = (r"kvcache: error: no space left for data directory {dir} \((\d+ KiB free|\d+ inodes free) on its "
           r"filesystem, a start needs (1 MiB|64 inodes)\): free space there, or choose another --data-dir")


@pytest.mark.parametrize("leave, embedded", [
    (0, True),            # the lock file's first write fails (was: a traceback, kvcache.lock left)
    (16 << 10, True),     # room for the lock, not for the embedded server's demo bucket
    (64 << 10, False),    # room for the lock, not for the replica (was: LMDB's words only)
], ids=["nothing-free", "16KiB-embedded", "64KiB"])
def test_full_disk_at_start_is_one_line_and_leaves_nothing(tmp_path, nats_server, leave, embedded):
    with small_tmpfs(tmp_path / "disk", "4m") as disk:
        filler = fill(disk, leave)
        data = disk / "data"
        args = ["serve", "--data-dir", str(data), "--socket", str(tmp_path / "sc.sock")]
        if not embedded:
            put_keys(nats_server.url, {"a": b"1"})
            args += ["--nats", nats_server.url, "--bucket", BUCKET]
        result = run_cli(*args)
        print(f"\nleave {leave}: exit {result.returncode}: {result.stderr.strip().splitlines()[-1:]}")
        assert result.returncode == 1, result
        assert re.fullmatch(NO_ROOM.format(dir=re.escape(str(data))), error_line(result)), result.stderr
        assert left_in(disk) == [filler.name]  # not even the data directory the start made
        assert not (tmp_path / "sc.sock").exists()
        assert not os.path.exists(outside_lock_path(str(data)))


def test_socket_on_a_filesystem_out_of_inodes_is_refused_before_nats(tmp_path, nats_server):
    """A socket needs an inode and nothing else: none left was found at the bind, after the
    sync (its consumer made on the stream); now before NATS is asked for anything."""
    put_keys(nats_server.url, {"a": b"1"})
    with small_tmpfs(tmp_path / "run", "1m", "nr_inodes=8") as run:
        n = 0
        while True:  # every inode taken
            try:
                (run / f"f{n}").touch()
            except OSError:
                break
            n += 1
        sock = run / "sc.sock"
        result = run_cli("serve", "--data-dir", str(tmp_path / "data"), "--socket", str(sock),
                         "--nats", nats_server.url, "--bucket", BUCKET)
        print(f"\nexit {result.returncode}: {result.stderr.strip().splitlines()[-1:]}")
        assert result.returncode == 1, result
        assert error_line(result) == (f"kvcache: error: no space left for socket {sock} (no inode free on its "
                                      "filesystem): free some there, or choose another --socket")
        assert not (tmp_path / "data").exists() and not sock.exists()

    async def consumers() -> int:
        nc = await nats.connect(nats_server.url)
        try:
            return (await nc.jetstream().stream_info(f"KV_{BUCKET}")).state.consumer_count
        finally:
            await nc.close()
    assert asyncio.run(consumers()) == 0


def test_replica_on_a_full_disk_is_an_error_not_sigbus(tmp_path):
    """LMDB makes its lock file sparse and writes it through its map: on a full tmpfs the first
    touch of a page never allocated was a SIGBUS, the process gone without a word (reached
    with a few KiB free: the start's own room check comes before it in `kvcache serve`)."""
    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        fill(disk, 0)
        code = ("import sys\nfrom kvcache.errors import ReplicaError\nfrom kvcache.store.replica import Replica\n"
                "try:\n    Replica(sys.argv[1])\nexcept ReplicaError as e:\n    print(e)\n")
        result = subprocess.run([sys.executable, "-c", code, str(disk / "replica")], capture_output=True,
                                text=True, timeout=60)
        print(f"\nexit {result.returncode}: {result.stdout.strip()}")
        assert result.returncode == 0, (result.returncode, result.stderr)
        assert result.stdout.strip() == (f"cannot open replica at {disk / 'replica'}: "
                                         f"{disk / 'replica' / 'lock.mdb'}: No space left on device")


# ------------------------------------------------------------------------------ the socket removed

def socket_made_again(sc: SidecarProcess, old_inode: int) -> bool:
    try:
        st = os.lstat(sc.socket)
    except FileNotFoundError:
        return False
    return stat.S_ISSOCK(st.st_mode) and st.st_ino != old_inode


def test_removed_socket_is_made_again(tmp_path, nats_server):
    put_keys(nats_server.url, {"a": b"1"})
    with SidecarProcess(tmp_path / "data", nats_server.url, buckets=[BUCKET]) as sc:
        sc.start()
        before = os.lstat(sc.socket)
        with sc.client() as kept:
            assert kept.get(f"{BUCKET}:a") == b"1"
            os.unlink(sc.socket)
            sc.wait_for(lambda: socket_made_again(sc, before.st_ino), what="the socket made again")
            with sc.client() as fresh:  # a new client connects again
                assert fresh.get(f"{BUCKET}:a") == b"1"
            assert kept.get(f"{BUCKET}:a") == b"1"  # and one connected before keeps its connection
        assert stat.S_IMODE(os.lstat(sc.socket).st_mode) == stat.S_IMODE(before.st_mode)
        lines = [ln for ln in sc.log().splitlines() if "was removed while serving" in ln]
        assert len(lines) == 1 and lines[0].endswith(
            f"WARNING kvcache.server: socket {sc.socket} was removed while serving; made it again "
            f"(mode {stat.S_IMODE(before.st_mode):o}; connected clients kept their connections)"), sc.log()
        assert sc.stop() == 0
        assert not os.path.exists(sc.socket)


def test_socket_that_cannot_be_made_again_is_not_ready(tmp_path, nats_server):
    """The socket's own directory removed (not the data directory): not ready, saying why,
    until the directory is back and the socket made again."""
    put_keys(nats_server.url, {"a": b"1"})
    sockdir = tmp_path / "run"
    sockdir.mkdir()
    with SidecarProcess(tmp_path / "data", nats_server.url, buckets=[BUCKET], socket=sockdir / "sc.sock",
                        extra=["--metrics-listen", "127.0.0.1:0"]) as sc:
        sc.start()
        metrics = metrics_address(sc)
        assert http_get(metrics, "/readyz")[0] == 200
        os.unlink(sc.socket)
        sockdir.rmdir()
        status, why = sc.wait_for(lambda: (r := http_get(metrics, "/readyz"))[0] == 503 and r,
                                  what="/readyz not ready")
        print(f"\n/readyz {status}: {why.strip()}")
        assert why.strip() == (f"not ready: socket {sc.socket} was removed while serving and cannot be made "
                               "again (No such file or directory): clients cannot connect through it")
        assert http_get(metrics, "/healthz")[0] == 200  # alive: nothing a restart would mend sooner
        sockdir.mkdir()
        sc.wait_for(lambda: http_get(metrics, "/readyz")[0] == 200, what="/readyz ready again")
        with sc.client() as c:
            assert c.get(f"{BUCKET}:a") == b"1"
        assert sc.log().count("cannot be made again") == 1, sc.log()  # said once, not every second
        assert sc.stop() == 0


# ------------------------------------------------------------------------------ the data directory removed

def test_removed_data_dir_refuses_a_second_sidecar_and_stops_the_first(tmp_path):
    """`make demo`, `rm -rf kvcache-data`, `make demo` again. The first sidecar is held
    stopped (SIGSTOP) over the removal and the second start: the lock alone must refuse the
    second, whenever the first would notice."""
    data = tmp_path / "data"
    with SidecarProcess(data, None) as first:  # the embedded nats-server and its demo bucket
        first.start()
        nats_pid = embedded_pid(first)
        outside = outside_lock_path(str(data))
        assert os.path.exists(outside)
        first.proc.send_signal(signal.SIGSTOP)
        try:
            subprocess.run(["rm", "-rf", str(data)], check=True)
            second = run_cli("serve", "--data-dir", str(data), "--socket", str(tmp_path / "other.sock"))
        finally:
            first.proc.send_signal(signal.SIGCONT)
        print(f"\nsecond start: exit {second.returncode}: {second.stderr.strip()}")
        assert second.returncode == 1, second
        assert error_line(second) == (f"kvcache: error: data directory {data} is in use by another kvcache "
                                      f"serve (pid {first.proc.pid}); one sidecar per data directory "
                                      f"(lock: {outside})")
        assert "embedded nats-server" not in second.stderr  # refused before starting one
        assert not data.exists() and not (tmp_path / "other.sock").exists()

        code = first.proc.wait(60)
        line = (f"data directory {data} was removed while serving (the replica and the lock with it): "
                "stopping; start kvcache serve again to make it anew and resync")
        log = first.log()
        print(f"first: exit {code}: {log.strip().splitlines()[-1]}")
        assert code == 1, log
        assert f"ERROR kvcache: {line}" in log and log.rstrip().endswith(f"kvcache: error: {line}"), log
        assert "socket" not in log.split(line)[1], log  # nothing more to say once the directory is gone
        assert not pid_alive(nats_pid)
        assert not os.path.exists(outside)
        first.check_log()

    with SidecarProcess(data, None) as again:  # a start on the path now makes everything anew
        again.start()
        with again.client() as c:
            assert c.get("greeting") == b"hello from kvcache"
        assert again.stop() == 0


def test_removed_lock_files_are_made_again(tmp_path, nats_server):
    put_keys(nats_server.url, {"a": b"1"})
    with SidecarProcess(tmp_path / "data", nats_server.url, buckets=[BUCKET]) as sc:
        sc.start()
        inside, outside = sc.data_dir / "kvcache.lock", Path(outside_lock_path(str(sc.data_dir)))
        for lock in (inside, outside):
            lock.unlink()
        sc.wait_for(lambda: inside.exists() and outside.exists(), what="both lock files made again")
        sc.wait_for(lambda: sc.log().count("was removed while serving; made it again") == 2,
                    what="both said")
        assert inside.read_text() == outside.read_text() == f"{sc.proc.pid}\n"
        second = run_cli("serve", "--data-dir", str(sc.data_dir), "--socket", str(tmp_path / "other.sock"),
                         "--nats", nats_server.url, "--bucket", BUCKET)
        assert second.returncode == 1, second
        assert f"in use by another kvcache serve (pid {sc.proc.pid})" in error_line(second)
        assert sc.stop() == 0


# ------------------------------------------------------------------------------ the outside lock itself

def test_outside_lock_is_the_same_for_every_spelling_of_the_path(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    (tmp_path / "xdg").mkdir(mode=0o700)
    data = tmp_path / "data"
    data.mkdir()
    (tmp_path / "alias").symlink_to(data)
    monkeypatch.chdir(tmp_path)
    paths = {outside_lock_path(p) for p in (str(data), "data", "./data/", str(tmp_path / "alias"))}
    assert len(paths) == 1 and paths.pop().startswith(str(tmp_path / "xdg" / "kvcache") + "/")
    assert stat.S_IMODE(os.stat(tmp_path / "xdg" / "kvcache").st_mode) == 0o700


def test_a_runtime_dir_open_to_others_is_not_used(tmp_path, monkeypatch, caplog):
    """Whoever may write the lock's directory could block this user's sidecars: such a
    directory is not used, with one warning, and the lock inside the data directory holds."""
    from kvcache.ops.datadir import DataDirLock

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    (tmp_path / "xdg" / "kvcache").mkdir(parents=True)
    os.chmod(tmp_path / "xdg" / "kvcache", 0o777)
    data = tmp_path / "data"
    data.mkdir()
    lock = DataDirLock(str(data))
    lock.acquire()
    try:
        assert lock.outside is None and lock.held
        assert [r.getMessage() for r in caplog.records] == [
            f"no lock outside the data directory ({tmp_path / 'xdg' / 'kvcache'} is not a directory of this "
            f"user's that only it may write): a second sidecar could start on {data} once it is removed "
            "under this one"]
        assert (data / "kvcache.lock").read_text() == f"{os.getpid()}\n"
    finally:
        lock.release()
    assert os.listdir(tmp_path / "xdg" / "kvcache") == []


def test_outside_lock_files_of_killed_sidecars_are_swept(tmp_path, monkeypatch):
    """A killed sidecar leaves its outside lock file (a clean stop removes it): the next start
    removes every one no process holds, and leaves a held one."""
    import fcntl

    from kvcache.ops.datadir import DataDirLock

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    where = tmp_path / "xdg" / "kvcache"
    where.mkdir(parents=True, mode=0o700)
    left, held = where / "kvcache-0000000000000000.lock", where / "kvcache-1111111111111111.lock"
    left.write_text("4242\n")
    held.write_text("4343\n")
    with open(held) as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        (tmp_path / "data").mkdir()
        lock = DataDirLock(str(tmp_path / "data"))
        lock.acquire()
        try:
            assert sorted(os.listdir(where)) == sorted([held.name, os.path.basename(lock.outside.path)])
        finally:
            lock.release()
    assert os.listdir(where) == [held.name]
