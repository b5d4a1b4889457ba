"""The data directory as the host holds it: one sidecar per directory (its locks), room on its
filesystem to start, and noticing, while serving, that it was removed.

Two locks, both exclusive flocks the kernel drops with the process (a file left by a killed
sidecar never blocks), each file holding the holder's PID for the refusal to name:
- `<data_dir>/kvcache.lock`, inside: it follows the directory itself, whatever path reaches it
  (a symlink, a bind mount, another container's view of a shared volume);
- `kvcache-<hash of the directory's real path>.lock` in a per-user runtime directory, outside:
  it outlives the directory. Without it `rm -rf kvcache-data` under a running sidecar took the
  inner lock with it, and a second `kvcache serve` on the same path started beside the first
  (a second embedded nats-server too), the first serving a directory no one could see.

A lock file removed under a running sidecar is made again (and flocked) at the next check; a
data directory removed (or replaced) is not something a sidecar can keep serving: its replica
and lock are gone with it, so the sidecar stops (DataDirLock.check says why).
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import stat

from ..errors import ConfigError, KvcacheError

log = logging.getLogger("kvcache")

LOCK_FILE = "kvcache.lock"
CHECK_S = 1.0  # how often a serving sidecar looks at its directory, lock files (and socket)
# Less room than this on the data directory's filesystem and a start cannot do its first
# writes (the replica's lock file and first pages, the embedded server's store and the demo
# bucket, a few dozen inodes): refused with one line rather than failing halfway.
START_FREE_BYTES = 1 << 20
START_FREE_INODES = 64
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def room(path: str) -> tuple[int, int | None]:
    """(bytes, inodes) free on `path`'s filesystem for this process (root may use the blocks
    reserved for it); inodes None where the filesystem does not count them."""
    st = os.statvfs(path)
    blocks = st.f_bfree if os.geteuid() == 0 else st.f_bavail
    return blocks * st.f_frsize, (st.f_favail if st.f_files else None)


def no_room(data_dir: str) -> KvcacheError:
    """The one line of a start that found (or ran into) a full filesystem."""
    try:
        free, inodes = room(data_dir)
    except OSError:
        left, need = "free space unknown", _size(START_FREE_BYTES)
    else:
        short_of_inodes = inodes is not None and inodes < START_FREE_INODES
        left = f"{inodes} inodes free" if short_of_inodes else f"{_size(free)} free"
        need = f"{START_FREE_INODES} inodes" if short_of_inodes else _size(START_FREE_BYTES)
    return KvcacheError(f"no space left for data directory {data_dir} ({left} on its filesystem, a start "
                        f"needs {need}): free space there, or choose another --data-dir")


def short_of_room(data_dir: str) -> bool:
    """Is there less room on `data_dir`'s filesystem than a start needs (START_FREE_BYTES,
    START_FREE_INODES)? False when it cannot be told."""
    try:
        free, inodes = room(data_dir)
    except OSError:
        return False
    return free < START_FREE_BYTES or (inodes is not None and inodes < START_FREE_INODES)


def check_room(data_dir: str, socket_path: str | None = None) -> None:
    """Refuse a start with too little room to make its first writes: one line (no_room)
    rather than whichever write failed first. The socket (elsewhere) needs one inode: checked
    here too, before NATS is asked for anything, not at the bind after the sync."""
    if short_of_room(data_dir):
        raise no_room(data_dir)
    if socket_path is not None:
        try:
            inodes = room(os.path.dirname(os.path.abspath(socket_path)))[1]
        except OSError:
            return
        if inodes == 0:
            raise KvcacheError(f"no space left for socket {socket_path} (no inode free on its filesystem): "
                               "free some there, or choose another --socket")


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 10 << 20 or (n and n % (1 << 20) == 0) else f"{n >> 10} KiB"


def runtime_dir() -> str:
    """Where the outside lock files live: `$XDG_RUNTIME_DIR/kvcache` (the per-user runtime
    directory systemd and login sessions provide), else `/tmp/kvcache-<uid>`. Made 0700;
    refused (ConfigError) when it is another user's or open to others, since whoever can
    write there can block this user's sidecars."""
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    path = os.path.join(xdg, "kvcache") if os.path.isabs(xdg) else f"/tmp/kvcache-{os.geteuid()}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise ConfigError(f"cannot create {path}: {e.strerror}") from None
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise ConfigError(f"{path} is not a directory of this user's that only it may write")
    return path


def outside_lock_path(data_dir: str, where: str | None = None) -> str:
    """The outside lock file of `data_dir`: keyed by its real path, so every spelling of the
    path (relative, through a symlink) finds the same file, and a directory made again at the
    path after a removal finds the lock its first sidecar still holds."""
    key = hashlib.sha256(os.path.realpath(data_dir).encode()).hexdigest()[:16]
    return os.path.join(where if where is not None else runtime_dir(), f"kvcache-{key}.lock")


class LockFile:
    """One exclusive flock on a file holding the holder's PID. The `outside` one is removed
    on release (under the lock), and only its refusal is a start's error: a failure to make
    or write it is a ConfigError the caller may do without."""

    def __init__(self, path: str, data_dir: str, outside: bool) -> None:
        self.path = path
        self.data_dir = data_dir
        self.outside = outside
        self.fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise the one line naming the sidecar that holds it. A file
        removed between the open and the flock (its holder releasing it) is no lock: take
        the one at the path now."""
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
            except OSError as e:
                if e.errno in NO_SPACE and not self.outside:
                    raise no_room(self.data_dir) from None
                raise ConfigError(f"cannot create the lock file {self.path}: {e.strerror}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _holder(fd)
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise KvcacheError(
                        f"data directory {self.data_dir} is in use by another kvcache serve"
                        f"{f' (pid {holder})' if holder else ''}; one sidecar per data "
                        f"directory (lock: {self.path})") from None
                raise ConfigError(f"cannot lock {self.path}: {e.strerror}") from None
            if self._is(fd):
                break
            os.close(fd)
        self.fd = fd  # held from here: a failed start's undo removes the file under the lock
        pid = f"{os.getpid()}\n".encode()
        try:  # written over the old PID before the truncation: no block freed, then needed
            os.pwrite(fd, pid, 0)
            os.ftruncate(fd, len(pid))
        except OSError as e:
            if self.outside:  # held all the same: a refusal then names no PID
                log.debug("cannot write the lock file %s: %s", self.path, e.strerror)
            elif e.errno in NO_SPACE:
                raise no_room(self.data_dir) from None
            else:
                raise ConfigError(f"cannot write the lock file {self.path}: {e.strerror}") from None

    def _is(self, fd: int) -> bool:
        """Is `fd` the file at the path now?"""
        try:
            there = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino)

    def held(self) -> bool:
        """Is the file this process locked still the one at the path?"""
        return self.fd is not None and self._is(self.fd)

    def release(self) -> None:
        if self.fd is None:
            return
        if self.outside and self._is(self.fd):
            try:  # under the lock: whoever opened it meanwhile retries on the path (acquire)
                os.unlink(self.path)
            except OSError:
                pass
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None


def sweep(where: str) -> None:
    """Remove the outside lock files no process holds (left by killed sidecars: a clean stop
    removes its own), so that the runtime directory does not fill with them. Each is removed
    under its lock; a start that opened it meanwhile takes the path's new file (acquire)."""
    try:
        names = [n for n in os.listdir(where) if n.startswith("kvcache-") and n.endswith(".lock")]
    except OSError:
        return
    for name in names:
        path = os.path.join(where, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            st, mine = os.stat(path), os.fstat(fd)
            if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
                os.unlink(path)
        except OSError:  # held (a sidecar runs on it), or gone meanwhile
            pass
        finally:
            os.close(fd)


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    except OSError:
        return ""
    return text if text.isdigit() else ""


class DataDirLock:
    """The data directory's two locks (the module's docstring), and what the sidecar checks
    every CHECK_S seconds while it serves (check)."""

    def __init__(self, data_dir: str) -> None:
        self.data_dir = data_dir
        self.inside = LockFile(os.path.join(data_dir, LOCK_FILE), data_dir, outside=False)
        self.outside: LockFile | None = None
        self._identity: dict[str, tuple[int, int]] = {}  # path -> (st_dev, st_ino) at start
        self._unrelocked: set[str] = set()  # lock files removed that could not be made again

    @property
    def held(self) -> bool:
        return self.inside.fd is not None

    def acquire(self) -> None:
        """The outside lock, then the inside one: either refusal names the holder's PID. Where
        no runtime directory can be had (a read-only /tmp), one warning and the inside lock
        alone, as before there was an outside one. A failure leaves held what was taken: the
        failed start's undo removes the files it made under the lock, then `release`."""
        try:
            self.outside = LockFile(outside_lock_path(self.data_dir), self.data_dir, outside=True)
            self.outside.acquire()
        except (ConfigError, OSError) as e:  # not "in use": that one ends the start
            self.outside = None
            log.warning("no lock outside the data directory (%s): a second sidecar could start on %s "
                        "once it is removed under this one", e, self.data_dir)
        else:
            sweep(os.path.dirname(self.outside.path))
        self.inside.acquire()
        self.keep(self.data_dir)

    def keep(self, path: str) -> None:
        """Watch `path` (the directory, the replica's file): it must stay the file it is now."""
        st = os.stat(path)
        self._identity[path] = (st.st_dev, st.st_ino)

    def release(self) -> None:
        self.inside.release()
        if self.outside is not None:
            self.outside.release()

    def check(self) -> str | None:
        """None while the directory (and every kept file) is the one the sidecar started on;
        else the one line saying which is gone. A lock file removed meanwhile is made again
        and locked anew, with a line saying so."""
        for path, identity in self._identity.items():
            try:
                st = os.stat(path)
            except (FileNotFoundError, NotADirectoryError):
                return self._lost(path, "removed")
            except OSError:  # cannot tell now (a permission changed on the way): the next check
                return None
            if (st.st_dev, st.st_ino) != identity:
                return self._lost(path, "replaced by another")
        for lock in (self.inside, self.outside):
            if lock is not None and lock.fd is not None and not lock.held():
                self._relock(lock)
        return None

    def _lost(self, path: str, how: str) -> str:
        if path == self.data_dir:
            return (f"data directory {path} was {how} while serving (the replica and the lock with it): "
                    "stopping; start kvcache serve again to make it anew and resync")
        return (f"{path} was {how} while serving: stopping; start kvcache serve again to make the "
                "replica anew and resync")

    def _relock(self, lock: LockFile) -> None:
        """Take a removed lock file's path again (the old flock is kept until the new one is
        held); said once, and once if it cannot be."""
        old = lock.fd
        assert old is not None
        try:
            if lock.outside:
                runtime_dir()  # removed with it (XDG_RUNTIME_DIR goes at the last logout)
            lock.acquire()
        except (KvcacheError, OSError) as e:
            if lock.fd is not None and lock.fd != old:
                os.close(lock.fd)
            lock.fd = old
            if lock.path not in self._unrelocked:
                self._unrelocked.add(lock.path)
                log.warning("lock file %s was removed while serving and cannot be made again: %s",
                            lock.path, e)
            return
        self._unrelocked.discard(lock.path)
        fcntl.flock(old, fcntl.LOCK_UN)
        os.close(old)
        log.warning("lock file %s was removed while serving; made it again", lock.path)
