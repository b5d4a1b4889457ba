"""Processes the tests look at by PID: alive?, the embedded nats-server a sidecar started."""
from __future__ import annotations

import os

from support.sidecar_proc import SidecarProcess


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); it is dead for our purposes
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1][0] != "Z"


def embedded_pid(sc: SidecarProcess) -> int:
    with sc.client() as c:
        info = c.info("server")["server"]
    assert info["embedded_nats"] == 1
    port = int(str(info["nats_url"]).rsplit(":", 1)[1])
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        if cmd and cmd[0].endswith(b"nats-server") and str(sc.data_dir).encode() in b" ".join(cmd):
            return int(pid)
    raise AssertionError(f"no embedded nats-server found for port {port}")
