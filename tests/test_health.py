"""`kvcache health [--ready]`, the command liveness and readiness probes run, against a real
sidecar: not running, synced, and cut off from NATS (its feed connection frozen)."""
from __future__ import annotations

import pytest
from support.poll import wait_until
from support.sidecar_proc import SidecarProcess, run_cli
from support.topology import DelayProxy, nats_run

pytestmark = pytest.mark.timeout(120)


def health(sock: str, *extra: str) -> tuple[int, str]:
    r = run_cli("health", "--socket", sock, *extra)
    assert r.stderr == "" and len(r.stdout.strip().splitlines()) == 1, (r.stdout, r.stderr)
    return r.returncode, r.stdout.strip()


def test_health_through_a_sidecars_life(nats_server, tmp_path):
    sock = str(tmp_path / "sc" / "kvcache.sock")
    code, line = health(sock)
    assert code == 1 and line.startswith(f"not live: no sidecar answers on {sock}")

    async def setup(js):
        kv = await js.create_key_value(bucket="hl")
        await kv.put("a", b"1")
    nats_run(nats_server.url, setup)
    proxy = DelayProxy(nats_server.port).start()
    sc = SidecarProcess(tmp_path / "sc", proxy.url, ["hl"],
                        extra=["--max-stale-ms", "300", "--heartbeat-ms", "200"])
    try:
        sc.start()
        assert health(sock) == (0, f"live: the sidecar answers on {sock}")
        assert health(sock, "--ready") == (0, "ready: 1 bucket synced and within max_stale_ms")
        proxy.freeze()
        wait_until(lambda: health(sock, "--ready")[0] == 1, 30, "not ready once cut off")
        code, line = health(sock, "--ready")
        assert line.startswith("not ready: hl (") and "max_stale_ms 300" in line
        assert health(sock)[0] == 0  # still live: it answers
        proxy.thaw()
        wait_until(lambda: health(sock, "--ready")[0] == 0, 30, "ready again")
    finally:
        sc.kill()
        proxy.stop()
