"""A small tmpfs the test mounts itself, to fill up: the host's full disk, for real (LMDB, the
lock files, the embedded nats-server and the socket all meet the same ENOSPC a full disk gives)."""
from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_tmpfs(path: Path, size: str, options: str = "") -> Iterator[Path]:
    """A tmpfs of `size` (and mount `options`, e.g. nr_inodes=) mounted at `path`, unmounted
    on every way out. Skips where the test may not mount (not root, or no mount permission
    in this container)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs for the data directory needs root (CI runs as root)")
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}{',' + options if options else ''}",
                        "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip() or r.returncode}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(path)], check=True)  # busy: detach it now


def fill(path: Path, leave: int) -> Path:
    """A filler file leaving about `leave` bytes free on `path`'s filesystem."""
    st = os.statvfs(path)
    want = st.f_bavail * st.f_frsize - leave
    filler = path / "filler"
    with open(filler, "wb") as f:
        chunk = b"\0" * 65536
        while want > 0:
            try:
                want -= f.write(chunk[:min(want, len(chunk))])
            except OSError:  # ENOSPC: the filesystem counts blocks its own way; full enough
                break
    return filler
