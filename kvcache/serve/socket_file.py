"""The Unix socket's file, as a listener bound it: noticed when removed under it.

A socket file removed under a running server (`rm`, a cleaner of old files, a deployment
script) leaves it listening on a file no client can reach while it looks healthy; redis-server
and nginx do not notice either. The listener (kvcache.serve.resp_server.RespServer, or with
workers kvcache.supervisors.workers.Workers) asks `needs_remaking` every few seconds (a stat)
and binds the path again: one line when it did, one line and `fault` (what /readyz reports)
while it cannot.
"""
from __future__ import annotations

import logging
import os

from ..errors import KvcacheError

log = logging.getLogger("kvcache.server")


class SocketFile:
    """The file at `path` a listener bound with mode `mode`; `inode`: its (st_dev, st_ino)."""

    def __init__(self, path: str, mode: int) -> None:
        self.path = path
        self.mode = mode
        self.inode: tuple[int, int] | None = None
        # why the socket is not served (removed, and it cannot be made again), else None
        self.fault: str | None = None

    def bound(self, inode: tuple[int, int]) -> None:
        self.inode = inode

    def needs_remaking(self) -> bool:
        """Is the file at the path no longer the one bound (removed, or replaced)? An error
        looking (its directory unreadable) is a fault, not a reason to bind."""
        try:
            st = os.lstat(self.path)
            if (st.st_dev, st.st_ino) == self.inode:
                return False
        except FileNotFoundError:
            pass
        except OSError as e:
            self.cannot(e.strerror or str(e))
            return False
        return True

    def remade(self, inode: tuple[int, int]) -> None:
        self.inode = inode
        self.fault = None
        log.warning("socket %s was removed while serving; made it again (mode %o; connected clients "
                    "kept their connections)", self.path, self.mode)

    def cannot(self, why: str) -> None:
        """It cannot be made again now: one line (once per reason), and `fault` until it can."""
        fault = (f"socket {self.path} was removed while serving and cannot be made again ({why}): "
                 "clients cannot connect through it")
        if fault != self.fault:
            log.error("%s", fault)
        self.fault = fault

    def cannot_bind(self, error: KvcacheError | OSError) -> None:
        """`cannot`, for what claiming the path again (claim_socket_path: another process
        serving there, a file there) or binding it (its directory gone) raised."""
        self.cannot(str(error) if isinstance(error, KvcacheError) else (error.strerror or str(error)))

    def remove(self) -> None:
        """At stop: the file goes if it is still the one bound (not another process's since)."""
        try:
            st = os.lstat(self.path)
            if (st.st_dev, st.st_ino) == self.inode:
                os.unlink(self.path)
        except FileNotFoundError:
            pass
