"""A replica that cannot be written must not be served past its bound.

The sidecar's data directory is a small tmpfs the test mounts itself, filled by a filler file
to about 64 KiB free; then 150 values of 10 kB are put, and `probe` is given a new value
behind them: the feed receives them but cannot write them (LMDB reports "Input/output error",
the disk being full), and it retries. What must hold, read from outside:
- no answer to `GET probe` or `KV.GET probe` is older than the new value once that value was
  acked more than max_stale_ms before the read was sent (the replica is known current only
  as of the last time it applied everything it had received, not the last time it received);
- INFO `lag_ms` grows while the replica cannot be written, it does not reset at each retry;
- readiness (/readyz, `kvcache health --ready`) turns not ready and stays so across several
  retries of the write; one log line says the replica cannot be written;
- once the filler is removed: ready again, the backlog applied, `probe` answered locally with
  its new value, and one log line says so.

Figures (how long after the ack the old value was last served, readiness flips) are printed
(`pytest -s`); assertions are about answers and states, never times.
"""
from __future__ import annotations

import itertools
import os
import time

import nats
import pytest
from support.poll import wait_until
from support.scrape import http_get, metrics_address, replica_error_retries
from support.sidecar_proc import SidecarProcess, run_cli
from support.tmpfs import fill, small_tmpfs

pytestmark = [pytest.mark.timeout(300), pytest.mark.servers]

BUCKET = "disk"
MAX_STALE_MS = 2000
TMPFS_SIZE = "4m"  # room for the backlog once the filler goes
FREE_LEFT = 64 * 1024
BIG_VALUES = 150
BIG_VALUE = b"x" * 10_000
OLD, NEW = b"old", b"new"
# Failed writes the feed must retry while readiness stays not ready (each retry recreated the
# consumer, and each reset the lag before the fix: readiness flipped back to ready).
HOLD_RETRIES = 3
PACE_S = 0.02  # between rounds of reads (not a wait for anything: reads keep going)
UNWRITABLE_LINE = "cannot write the replica"
WRITABLE_LINE = "replica written again"


class Reads:
    """Every answer to `probe` while the replica cannot be written: (seconds after the new
    value's ack the read was sent, revision, source, command)."""

    def __init__(self, sc: SidecarProcess, old_rev: int, new_rev: int, acked: float) -> None:
        self.sc, self.old_rev, self.new_rev, self.acked = sc, old_rev, new_rev, acked
        self.answers: list[tuple[float, int, str, str]] = []

    def round(self) -> None:
        with self.sc.client() as c:
            sent = time.monotonic()
            e = c.entry(f"{BUCKET}:probe")
            assert e is not None
            self.answers.append((sent - self.acked, e.revision, e.source, "KV.GET"))
            sent = time.monotonic()
            value = c.get(f"{BUCKET}:probe")
            assert value in (OLD, NEW), value
            self.answers.append((sent - self.acked, self.new_rev if value == NEW else self.old_rev,
                                 "?", "GET"))

    def too_old(self) -> list[tuple[float, int, str, str]]:
        """Answers older than the new value, sent more than max_stale_ms after its ack."""
        return [a for a in self.answers if a[0] * 1000 > MAX_STALE_MS and a[1] < self.new_rev]

    def old_served_until(self) -> float:
        return max((a[0] for a in self.answers if a[1] < self.new_rev), default=0.0)


async def test_full_disk_is_not_served_past_the_bound(nats_server, tmp_path):
    nc = await nats.connect(nats_server.url)
    try:
        kv = await nc.jetstream().create_key_value(bucket=BUCKET, history=1)
        old_rev = await kv.put("probe", OLD)
        with small_tmpfs(tmp_path / "data", TMPFS_SIZE) as data, SidecarProcess(
                data, nats_server.url, buckets=[BUCKET], socket=tmp_path / "sc.sock",
                extra=["--heartbeat-ms", "500", "--max-stale-ms", str(MAX_STALE_MS),
                       "--metrics-listen", "127.0.0.1:0"]) as sc:
            sc.start()
            metrics = metrics_address(sc)
            with sc.client() as c:
                assert c.entry(f"{BUCKET}:probe").source == "local"
            assert http_get(metrics, "/readyz")[0] == 200
            filler = fill(data, FREE_LEFT)
            free_kib = os.statvfs(data).f_bavail * os.statvfs(data).f_frsize >> 10
            for i in range(BIG_VALUES):
                await kv.put(f"big.{i}", BIG_VALUE)
            new_rev = await kv.put("probe", NEW)
            acked = time.monotonic()

            # The replica cannot be written: read, watch readiness and lag, until readiness
            # has been not ready across HOLD_RETRIES failed writes and the bound is long past.
            reads = Reads(sc, old_rev, new_rev, acked)
            readiness: list[tuple[float, int]] = []  # (seconds after the ack, HTTP status)
            lags: list[int] = []  # INFO lag_ms once not ready
            retries_at_unready: int | None = None
            unready_why = ""
            deadline = acked + 120
            while True:
                reads.round()
                status, why = http_get(metrics, "/readyz")
                now = time.monotonic()
                readiness.append((now - acked, status))
                if status != 200:
                    unready_why = why
                    if retries_at_unready is None:
                        retries_at_unready = replica_error_retries(metrics, BUCKET)
                if retries_at_unready is not None:
                    with sc.client() as c:
                        lags.append(int(c.info("buckets")["buckets"][BUCKET]["lag_ms"]))
                    if (now - acked) * 1000 > 2 * MAX_STALE_MS and \
                            replica_error_retries(metrics, BUCKET) >= retries_at_unready + HOLD_RETRIES:
                        break
                assert now < deadline, f"readiness {readiness[-5:]}, lag {lags[-5:]}\n{sc.log()}"
                time.sleep(PACE_S)
            health = run_cli("health", "--ready", "--socket", sc.socket)
            flips = sum(1 for a, b in itertools.pairwise(readiness) if (a[1] == 200) != (b[1] == 200))
            first_unready = next(t for t, s in readiness if s != 200)
            ready_again = [(round(t, 2), s) for t, s in readiness if t > first_unready and s == 200]
            print(f"\nfree before the puts: {free_kib} KiB; new probe revision {new_rev} acked; "
                  f"old value last served {reads.old_served_until():.2f}s after the ack "
                  f"(bound {MAX_STALE_MS / 1000:g}s); {len(reads.too_old())} of {len(reads.answers)} "
                  f"answers older than the bound allows; readiness not ready from "
                  f"{first_unready:.2f}s, {flips} flips in {readiness[-1][0]:.1f}s; lag_ms "
                  f"{lags[0]}..{lags[-1]}; sources "
                  f"{sorted({a[2] for a in reads.answers if a[3] == 'KV.GET'})}")
            assert not reads.too_old(), reads.too_old()[:10]
            assert not ready_again, ready_again[:20]
            assert all(a <= b for a, b in itertools.pairwise(lags)), lags
            assert f"{BUCKET} (" in unready_why and "not written for" in unready_why, unready_why
            assert health.returncode == 1 and BUCKET in health.stdout, (health.stdout, health.stderr)
            assert sc.log().count(UNWRITABLE_LINE) == 1, sc.log()

            # Space freed: ready again once the backlog is applied, probe answered locally.
            filler.unlink()
            freed = time.monotonic()
            wait_until(lambda: http_get(metrics, "/readyz")[0] == 200, 60, "ready again", detail=sc.log)
            print(f"ready {time.monotonic() - freed:.2f}s after the filler was removed")
            with sc.client() as c:
                e = c.entry(f"{BUCKET}:probe")
                assert (e.revision, e.source, e.value) == (new_rev, "local", NEW), e
                assert c.get(f"{BUCKET}:probe") == NEW
                row = c.info("buckets")["buckets"][BUCKET]
                assert row["lag_ms"] == 0 and row["applied_seq"] >= new_rev, row
                assert c.entry(f"{BUCKET}:big.{BIG_VALUES - 1}").source == "local"
            health = run_cli("health", "--ready", "--socket", sc.socket)
            assert health.returncode == 0, (health.stdout, health.stderr)
            assert sc.log().count(WRITABLE_LINE) == 1, sc.log()
    finally:
        await nc.close()
