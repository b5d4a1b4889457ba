"""Network partitions, full form: a 3-node JetStream cluster and the sidecar, each in its own
network namespace, faults injected with iptables in a router namespace between them, and every
read judged against the writer's acknowledgements, a strong read (`--strong-share`) with a
bound of 0 (tests/support/partition.py,
tests/support/staleness_check.py; bench/README.md, "Network partitions").

    python bench/partition_bench.py --runs 1 --hold 20 --keys 2000 --rate 300 \\
        --max-stale-ms 2000 --heartbeat-ms 1000 --faults a,b,c,d,e,f,g,h

Needs root, iproute2 and iptables (make system-deps); faults a and e also NetfilterQueue.
Each fault runs on a fresh bucket (R3, history 1) and a fresh sidecar; the cluster and the
namespaces are shared by the run and removed at the end, on every exit path.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from support.partition import FAULTS, PartitionEnv, RunConfig, describe, run_fault, unavailable
from support.staleness_check import row, table


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--hold", type=float, default=20.0, help="seconds each fault lasts")
    p.add_argument("--keys", type=int, default=2000)
    p.add_argument("--rate", type=float, default=300.0, help="writes/s")
    p.add_argument("--read-rate", type=float, default=2000.0, help="reads/s over all reader connections")
    p.add_argument("--conns", type=int, default=4, help="reader connections")
    p.add_argument("--strong-share", type=float, default=0.1,
                   help="share of the reads sent KV.GET ... CONSISTENCY strong, judged with a bound of 0 "
                        "(they are left out of availability: they need the leader)")
    p.add_argument("--max-stale-ms", type=int, default=2000)
    p.add_argument("--heartbeat-ms", type=int, default=1000)
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of reads before each fault")
    p.add_argument("--tail", type=float, default=10.0, help="seconds of reads after each heal")
    p.add_argument("--restart-down", type=float, default=2.0, help="(h): seconds each server stays down")
    p.add_argument("--faults", default="a,b,c,d,e,f,g,h,i",
                   help="comma separated, of: " + "; ".join(f"{k}: {v}" for k, v in FAULTS.items()
                                                            ).replace("%", "%%"))
    p.add_argument("--sidecar-src", default=None,
                   help="run the sidecar from this source tree (PYTHONPATH) instead of the installed kvcache")
    p.add_argument("--sidecar-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for the sidecar, e.g. --sidecar-arg=--relay (repeatable)")
    p.add_argument("--workdir", default=None, help="keep logs here (default: a temporary directory)")
    a = p.parse_args()
    faults = [f.strip() for f in a.faults.split(",") if f.strip()]
    if bad := [f for f in faults if f not in FAULTS]:
        p.error(f"unknown faults {bad}; known: {', '.join(FAULTS)}")
    if why := unavailable():
        print(f"partition_bench: {why}", file=sys.stderr)
        return 2
    work = Path(a.workdir or tempfile.mkdtemp(prefix="kvp-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"logs under {work}", flush=True)
    cfg = RunConfig(keys=a.keys, rate=a.rate, hold=a.hold, warmup=a.warmup, tail=a.tail,
                    max_stale_ms=a.max_stale_ms, heartbeat_ms=a.heartbeat_ms, read_rate=a.read_rate,
                    conns=a.conns, restart_down=a.restart_down, sidecar_src=a.sidecar_src,
                    strong_share=a.strong_share,
                    sidecar_extra=a.sidecar_arg)
    summary: dict[str, list] = {f: [] for f in faults}
    t0 = time.monotonic()
    with PartitionEnv(work) as env:
        for run in range(1, a.runs + 1):
            rows = []
            for f in faults:
                r = run_fault(env, f, cfg, log=lambda s: print(s, flush=True))
                rows.append(row(f, r.verdict))
                summary[f].append(r.verdict)
                print(table([rows[-1]]) + "\n" + describe(r), flush=True)
            print(f"\nrun {run}/{a.runs} (hold {a.hold:g}s, {a.keys} keys, {a.rate:g} writes/s, "
                  f"max_stale_ms {a.max_stale_ms}, heartbeat_ms {a.heartbeat_ms}):\n{table(rows)}\n", flush=True)
    print(f"summary over {a.runs} run(s), {time.monotonic() - t0:.0f}s:")
    print("fault | runs with stale | stale reads (total) | regressions (total) | availability % (min–max) "
          "| longest outage s (max) | recovery s (max) | strong reads answered / stale at bound 0 (total) "
          "| description")
    failed = False
    for f, vs in summary.items():
        stale_runs = sum(1 for v in vs if v.stale)
        rec = [v.recovery_s for v in vs]
        rec_s = "not recovered" if None in rec else f"{max(rec):.2f}"
        av = [100 * v.availability for v in vs]
        print(f"{f} | {stale_runs}/{len(vs)} | {sum(len(v.stale) for v in vs):,} | "
              f"{sum(len(v.regressions) for v in vs):,} | {min(av):.1f}–{max(av):.1f} | "
              f"{max(v.outage_s for v in vs):.2f} | {rec_s} | {sum(v.strong_ok for v in vs):,} / "
              f"{sum(v.strong_stale for v in vs):,} | {FAULTS[f]}")
        failed |= bool(stale_runs) or any(v.regressions for v in vs) or None in rec
        failed |= f == "c" and min(av) < 90.0
    print("verdict:", "FAIL (stale reads, regressions, no recovery, or (c) under 90% available)" if failed else "pass")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
