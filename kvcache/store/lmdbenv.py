"""The replica's LMDB environment as a file: opening it (with room for every named database),
proving it intact first (damage is deleted, the replica being only a cache of NATS), sharing
one read-only environment per path in a process, and growing the map.

Why a module of its own: this is how kvcache copes with LMDB and the disk (py-lmdb's
one-environment-per-path rule, LMDB's SIGBUS and abort() on a damaged file, its "Input/output
error" for a full disk), apart from what kvcache.store.replica keeps in the file.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from typing import overload

import lmdb

from ..errors import ReplicaError

log = logging.getLogger("kvcache.replica")

# Named databases: two per bucket (records, expiry index) and the meta database. An environment
# handle must be opened with room for every database it opens; room costs memory in every
# transaction (LMDB sizes a transaction's tables by it), so the writer takes what its buckets
# need (dbs_for), never less than MAX_DBS; readers take room for what the file holds.
MAX_DBS = 256
MAX_READERS = 1024
# LMDB's lock file holds a header and one 64-byte slot per reader (1024 readers: 65664 bytes);
# reserved a page beyond that (reserve_lock_file), since LMDB keeps a longer file as it is.
LOCK_FILE_BYTES = MAX_READERS * 64 + 4096


def dbs_for(buckets: int, existing: int = 0) -> int:
    """Room for `buckets` buckets (and `existing` databases already in the file), with margin:
    each has its records, its expiry index, its near cache, its revision index and its
    tombstones."""
    return max(MAX_DBS, 5 * buckets + 16, existing + 16)


@overload
def as_bytes(v: bytes | memoryview) -> bytes: ...
@overload
def as_bytes(v: bytes | memoryview | None) -> bytes | None: ...
def as_bytes(v: bytes | memoryview | None) -> bytes | None:
    """lmdb's read results, typed as what they are here: bytes (no `buffers=True` anywhere)."""
    return v  # type: ignore[return-value]


def _named_dbs(env: lmdb.Environment) -> int:
    with env.begin() as txn:  # the main database lists the named ones
        return sum(1 for _ in txn.cursor().iternext(keys=True, values=False))


def _open(path: str, map_size: int, max_dbs: int) -> lmdb.Environment:
    return lmdb.open(
        path, map_size=map_size, max_dbs=max_dbs,
        # Durability comes from NATS: after an OS crash we resume from an older
        # applied sequence, which is still consistent because data and position
        # share each transaction. Process crashes lose nothing either way.
        sync=False, metasync=False, readahead=False, max_readers=MAX_READERS,
    )


def reserve_lock_file(path: str) -> None:
    """Allocate every block of the environment's lock file before LMDB maps it. LMDB makes
    the file with ftruncate (a sparse file) and writes it through its map: on a filesystem
    with no room left (a full tmpfs above all) its first touch of a page never allocated is a
    SIGBUS that kills the process without a word, at open or later when a new reader takes
    a slot. Reserved here, a full disk is an error (lmdb.Error, ENOSPC) instead. Done before
    the open only: closing a descriptor of the file would drop the POSIX locks LMDB holds on
    it once it has opened it."""
    lock = os.path.join(path, "lock.mdb")
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise lmdb.Error(f"{lock}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        size = max(st.st_size, LOCK_FILE_BYTES)
        if st.st_blocks * 512 < size:
            os.posix_fallocate(fd, 0, size)
    except OSError as e:
        raise lmdb.Error(f"{lock}: {e.strerror}") from None
    finally:
        os.close(fd)


def drop(path: str, why: object) -> None:
    """Delete the environment at `path`, damaged (`why`): it will be rebuilt from NATS."""
    log.warning("replica at %s is damaged (%s): deleting it, it will be rebuilt from NATS", path, why)
    for name in ("data.mdb", "lock.mdb"):
        try:
            os.unlink(os.path.join(path, name))
        except FileNotFoundError:
            pass


def open_writer(path: str, map_size: int, max_dbs: int) -> tuple[lmdb.Environment, int]:
    """The writer's environment at `path` (created if missing), and the room for named
    databases it has: `max_dbs`, or more for a file from a configuration with more buckets.
    A damaged environment is deleted and created anew.

    Why: the replica is only a cache of NATS, so a damaged file costs a full resync and
    nothing else, while using it crashed the process (a truncated data.mdb is mapped past
    its end: SIGBUS at the first read of a missing page; a zeroed page: an assertion
    abort in LMDB's cursor), stopped the sidecar at every start (MDB_INVALID) or failed
    the feed's every write (MDB_CORRUPTED). Since looking at a damaged file can kill the
    looker, the look happens in a child process (see damage). LMDB keeps no checksums:
    damage inside a value cannot be seen, only damage to the file's structure.
    Raises lmdb.Error when LMDB cannot open it."""
    os.makedirs(path, exist_ok=True)
    why = damage(path)
    if why is not None:
        drop(path, why)
    reserve_lock_file(path)
    env = _open(path, map_size, max_dbs)
    existing = _named_dbs(env)
    if dbs_for(0, existing) > max_dbs:  # a file from a configuration with more buckets
        env.close()
        max_dbs = dbs_for(0, existing)
        env = _open(path, map_size, max_dbs)
    return env, max_dbs


# py-lmdb allows one Environment per path per process, so read-only users share one.
_READONLY_ENVS: dict[str, list] = {}


def shared_readonly_env(path: str) -> lmdb.Environment:
    """The process's read-only environment at `path`, opened at its first user; each call
    is matched by one release_readonly_env. Raises lmdb.Error when LMDB cannot open it."""
    key = os.path.realpath(path)
    entry = _READONLY_ENVS.get(key)
    if entry is None:
        env = lmdb.open(path, readonly=True, create=False, lock=True, readahead=False, max_readers=1024)
        existing = _named_dbs(env)  # room to open every database the file holds, as the writer has
        env.close()
        env = lmdb.open(path, max_dbs=dbs_for(0, existing), readonly=True, create=False, lock=True,
                        readahead=False, max_readers=1024)
        entry = _READONLY_ENVS[key] = [env, 0]
    entry[1] += 1
    return entry[0]


def release_readonly_env(path: str) -> None:
    """One user of shared_readonly_env(path) is done; the last one closes it."""
    key = os.path.realpath(path)
    entry = _READONLY_ENVS.get(key)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] <= 0:
        del _READONLY_ENVS[key]
        entry[0].close()


def grow(env: lmdb.Environment, max_map_size: int, what: str = "") -> None:
    """Double the map (a write found it full), up to `max_map_size`; ReplicaError beyond."""
    size = env.info()["map_size"]
    if size >= max_map_size:
        raise ReplicaError(
            f"replica map is full at {size >> 20} MiB ({what or 'write'}); it may not grow "
            f"beyond max_map_size_mb={max_map_size >> 20}: raise it, or replicate fewer keys"
        )
    try:
        env.set_mapsize(min(size * 2, max_map_size))
    except lmdb.Error as e:
        raise ReplicaError(f"cannot grow the replica map beyond {size >> 20} MiB: {e}") from None


def disk_hint(path: str) -> str:
    """LMDB reports a full disk as "Input/output error" (its short-write code): name the
    likely cause, or the error reads like failing hardware."""
    try:
        st = os.statvfs(path)
    except OSError:
        return ""
    free = st.f_bavail * st.f_frsize
    if free >= 64 << 20 and free >= st.f_blocks * st.f_frsize // 100:
        return ""
    return f" (disk full? {free >> 10} KiB free on the replica's filesystem)"


# Run by damage in a child process: exit 0 intact, 3 damaged (reason on stdout), 4 cannot
# tell (no proof of damage: the parent's own open reports the error). A signal is damage too.
_CHECK = r"""
import os, sys, lmdb
path = sys.argv[1]
damage = (lmdb.InvalidError, lmdb.CorruptedError, lmdb.VersionMismatchError,
          lmdb.PageNotFoundError, lmdb.IncompatibleError, lmdb.BadValsizeError)
try:
    env = lmdb.open(path, readonly=True, lock=False, create=False)
    with env.begin() as txn:
        count = sum(1 for _ in txn.cursor().iternext(keys=True, values=False))
    env.close()
    env = lmdb.open(path, readonly=True, lock=False, max_dbs=count + 1, create=False)
    need = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    size = os.path.getsize(os.path.join(path, "data.mdb"))
    if size < need:
        print(f"data.mdb is {size} bytes, its pages need {need}: truncated")
        sys.exit(3)
    with env.begin() as txn:
        names = list(txn.cursor().iternext(keys=True, values=False))
    for name in names:
        db = env.open_db(name, create=False)
        with env.begin(db=db) as txn:
            for _ in txn.cursor().iternext(keys=True, values=False):
                pass
except damage as e:
    print(e)
    sys.exit(3)
except Exception as e:
    print(e)
    sys.exit(4)
"""


def damage(path: str) -> str | None:
    """Why the replica at `path` cannot be trusted, or None. In a child process, because
    LMDB answers some damage with SIGBUS or abort(): is the file as long as its meta page
    says (checked before any other page is read), then a walk over the keys of every
    database (not the values' overflow pages, so it stays cheap next to a resync), in which
    LMDB checks each page it reaches."""
    data = os.path.join(path, "data.mdb")
    try:
        if os.path.getsize(data) == 0:
            return None
    except FileNotFoundError:
        return None
    r = subprocess.run([sys.executable, "-c", _CHECK, path], capture_output=True, text=True,
                       stdin=subprocess.DEVNULL)
    if r.returncode == 3:
        return r.stdout.strip() or "damaged"
    if r.returncode < 0:
        return f"reading it killed the checking process with {signal.Signals(-r.returncode).name}"
    return None
