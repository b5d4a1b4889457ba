"""kvcache against the alternatives, in one run: a markdown table and a PNG chart.

    python bench/compare.py                                  # everything, 1M keys for the sync
    python bench/compare.py --keys 100000 --only get,latency,sync
    python bench/compare.py --only locust --locust-seconds 30

Starts everything itself on 127.0.0.1 and Unix sockets, in a temporary directory: nats-server
(kvcache.natsio.nats_server), a leaf nats-server in its own JetStream domain, redis-server, the sidecar
(`python -m kvcache serve`) and locust, each stopped by its own PID when its section ends. Every
wait and every child process is bounded in time. Sections (--only, comma separated):

  get      GET over the Unix socket with redis-benchmark, kvcache vs redis-server, at `-c 50`,
           `-c 50 -P 16` and `-c 1` (bench/socket_bench.py's run()).
  latency  Single-key reads, one at a time (--reads each, interleaved in rounds of 1,000): the
           sidecar (kvcache.Client GET; hits, and keys outside its filter that it reads from NATS),
           LocalReader in-process, nats-py `kv.get` (Direct Get to the hub), and a Direct Get
           answered by a mirror on a local leaf node (`$JS.API.DIRECT.GET.KV_read.$KV.read.<key>`
           from a client of the leaf): what a NATS expert would set up instead of a sidecar.
  sync     Initial sync of --keys keys: kvcache vs nats-py's watch vs a raw socket consumer
           that only counts deliveries (bench/sync_bench.py's run()).
  locust   bench/locustfile.py headless against the sidecar (Zipf hot keys, MGET, remote
           misses, missing keys) for --locust-seconds; its CSV files land in --out.

The read topology (latency, locust): a hub nats-server (domain `hub`) holds bucket `read`
(allow_direct) with `hot.*` and `cold.*` keys; the leaf (domain `leaf`) holds a mirror of
`KV_read` named `KV_read` in its own domain (mirror_direct, allow_direct), which is what lets
both a plain Direct Get and a sidecar connected to the leaf use it. The sidecars replicate only
`hot.>`, so `cold.*` reads go remote. Three sidecars (SIDECARS): `hub`, connected to the hub
(the default deployment; locust uses it); `peer`, connected to the hub with the leaf's mirror as
a [[peer]] (the router picks by latency); `leaf`, connected to the leaf (its feed and its
remote reads use the mirror).

Writes --out/compare.md (also printed), --out/compare.png and --out/compare.json.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import json
import os
import random
import resource
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nats

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for p in (ROOT / "tests", BENCH, ROOT):  # ROOT ends up first: this checkout's kvcache
    sys.path.insert(0, str(p))

import socket_bench
import sync_bench
from restart import publish_all
from support.sidecar_proc import SidecarProcess
from support.topology import Cluster, add_hub_mirror, start_leaf

from kvcache import LocalReader
from kvcache.app.client import Client
from kvcache.natsio.nats_server import NatsServer, free_port

SECTIONS = ("get", "latency", "sync", "locust")
READ_BUCKET = "read"
READ_STREAM = f"KV_{READ_BUCKET}"
HOT_PREFIX, COLD_PREFIX = "hot.", "cold."
ROUND = 1000  # reads per path before switching to the next one


def key_name(prefix: str, i: int) -> str:
    return f"{prefix}{i:06d}"


def value_of(key: str) -> bytes:
    """What the read bucket holds under `key`, 100 bytes (the locustfile checks replies)."""
    return (b"value-" + key.encode() + b"-").ljust(100, b"x")


def percentiles(samples_us: list[float]) -> dict[str, float]:
    s = sorted(samples_us)

    def at(p: float) -> float:
        return round(s[min(len(s) - 1, int(p / 100 * len(s)))], 1)
    return {"n": len(s), "p50": at(50), "p90": at(90), "p99": at(99), "p99.9": at(99.9),
            "max": round(s[-1], 1), "mean": round(sum(s) / len(s), 1)}


def child_env() -> dict[str, str]:
    """Children import this checkout's kvcache, whatever the current directory."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


# ----------------------------------------------------------------------------- read topology

# The sidecars of the read topology: name -> (what its main connection is, whether its config
# lists the leaf's mirror as a [[peer]]).
SIDECARS = {"hub": ("hub", False), "peer": ("hub", True), "leaf": ("leaf", False)}


@dataclass
class ReadSetup:
    hub: NatsServer
    leaf: NatsServer
    sidecars: dict[str, SidecarProcess]  # started ones, by SIDECARS name

    @property
    def sidecar(self) -> SidecarProcess:
        """The default deployment: connected to the hub, no extra peers."""
        return self.sidecars["hub"]


async def load_read_bucket(hub_url: str, leaf_url: str, hot: int, cold: int, timeout: float) -> None:
    """Bucket `read` on the hub with hot and cold keys, and its mirror on the leaf, caught up."""
    keys = [key_name(HOT_PREFIX, i) for i in range(hot)] + [key_name(COLD_PREFIX, i) for i in range(cold)]
    nc = await nats.connect(hub_url, connect_timeout=5, allow_reconnect=False)
    nl = await nats.connect(leaf_url, connect_timeout=5, allow_reconnect=False)
    try:
        js = nc.jetstream(timeout=30)
        await js.create_key_value(bucket=READ_BUCKET, direct=True, history=1)
        await publish_all(js, [(f"$KV.{READ_BUCKET}.{k}", value_of(k)) for k in keys])
        # a fresh stream: one message per key, so its last sequence is the key count
        await add_hub_mirror(nl.jetstream(timeout=30), READ_STREAM, READ_STREAM, len(keys), timeout,
                             max_msgs_per_subject=1)
    finally:
        await nc.close()
        await nl.close()


@contextlib.contextmanager
def read_setup(work: Path, hot: int, cold: int, names: list[str], timeout: float) -> Iterator[ReadSetup]:
    """Hub, leaf with its mirror, the loaded bucket, and the sidecars `names` (see SIDECARS)."""
    hub = NatsServer(work / "hub" / "js", server_name="hub", domain="hub", leafnodes_listen_port=free_port())
    servers: list[NatsServer] = []
    sidecars: dict[str, SidecarProcess] = {}
    try:
        servers.append(hub.start())
        leaf = start_leaf(work, Cluster(name="hub", domain="hub", servers=[hub]), domain="leaf")
        servers.append(leaf)
        asyncio.run(load_read_bucket(hub.url, leaf.url, hot, cold, timeout))
        bucket = f'[[bucket]]\nname = "{READ_BUCKET}"\nkeys = ["{HOT_PREFIX}>"]\n'
        peer = f'\n[[peer]]\nname = "leaf"\nservers = ["{leaf.url}"]\nstream = "{READ_STREAM}"\n'
        for name in names:
            where, with_peer = SIDECARS[name]
            config = work / f"kvcache-{name}.toml"
            config.write_text(bucket + (peer if with_peer else ""))
            sc = sidecars[name] = SidecarProcess(work / f"sc-{name}", (hub if where == "hub" else leaf).url,
                                          extra=["--config", str(config), "--log-level", "warning"],
                                          env=child_env())
            sc.start(timeout=timeout)
        yield ReadSetup(hub, leaf, sidecars)
    finally:
        for sc in reversed(list(sidecars.values())):
            try:
                sc.stop()
            except RuntimeError as e:  # ignored SIGTERM: stop() killed it
                print(e, file=sys.stderr)
        for srv in reversed(servers):
            srv.stop()


# ----------------------------------------------------------------------------- latency

@dataclass
class ReadPath:
    label: str
    keys: list[str]
    read: Callable[[str], Any]
    is_async: bool = False


async def measure_reads(rs: ReadSetup, hot: int, cold: int, reads: int, timeout: float
                        ) -> tuple[dict[str, list[float]], dict[str, int], dict[str, dict]]:
    """Sequential single-key reads per path, µs each; returns the samples, the wrong replies
    per path, and each sidecar's router peers (INFO peers) after the run."""
    rng = random.Random(7)
    hot_keys = [key_name(HOT_PREFIX, rng.randrange(hot)) for _ in range(reads)]
    cold_keys = [key_name(COLD_PREFIX, rng.randrange(cold)) for _ in range(reads)]
    nc_hub = await nats.connect(rs.hub.url, connect_timeout=5, allow_reconnect=False)
    nc_leaf = await nats.connect(rs.leaf.url, connect_timeout=5, allow_reconnect=False)
    clients = {name: Client(sc.socket, timeout=5) for name, sc in rs.sidecars.items()}
    reader = LocalReader(str(rs.sidecar.data_dir))
    try:
        kv = await nc_hub.jetstream(timeout=5).key_value(READ_BUCKET)
        assert kv._direct, "the bucket should have allow_direct"  # nats-py then uses Direct Get

        async def nats_kv_get(key: str) -> bytes:
            return (await kv.get(key)).value

        async def leaf_direct_get(key: str) -> bytes:
            msg = await nc_leaf.request(f"$JS.API.DIRECT.GET.{READ_STREAM}.$KV.{READ_BUCKET}.{key}", b"", timeout=2)
            return msg.data if not (msg.headers or {}).get("Status") else b""

        miss_labels = {
            "hub": "kvcache GET, outside the filter: Direct Get to the hub (sidecar on the hub)",
            "peer": "kvcache GET, outside the filter: routed to the hub or the leaf's mirror ([[peer]])",
            "leaf": "kvcache GET, outside the filter: Direct Get to the leaf's mirror (sidecar on the leaf)",
        }
        paths = [
            ReadPath("kvcache GET, replica hit (Client over the socket)", hot_keys, clients["hub"].get),
            ReadPath("kvcache LocalReader.get, in-process (same replica)", hot_keys, reader.get),
            *(ReadPath(miss_labels[name], cold_keys, c.get) for name, c in clients.items()),
            ReadPath("nats-py kv.get (Direct Get to the hub)", hot_keys, nats_kv_get, True),
            ReadPath("nats-py Direct Get to the leaf's mirror (client on the leaf)", hot_keys, leaf_direct_get, True),
        ]
        samples: dict[str, list[float]] = {p.label: [] for p in paths}
        wrong = dict.fromkeys(samples, 0)
        for p in paths:  # warm up: connections, caches, the router's estimates
            for key in p.keys[:200]:
                await p.read(key) if p.is_async else p.read(key)
        deadline = time.monotonic() + timeout
        perf = time.perf_counter
        for start in range(0, reads, ROUND):
            if time.monotonic() > deadline:
                print(f"latency: --timeout reached after {start} reads per path", file=sys.stderr)
                break
            for p in paths:
                xs = samples[p.label]
                for key in p.keys[start:start + ROUND]:
                    t0 = perf()
                    v = (await p.read(key)) if p.is_async else p.read(key)
                    xs.append((perf() - t0) * 1e6)
                    if v != value_of(key):
                        wrong[p.label] += 1
        peers = {name: c.info("peers").get("peers", {}) for name, c in clients.items()}
        return samples, wrong, peers
    finally:
        for c in clients.values():
            c.close()
        reader.close()
        await nc_hub.close()
        await nc_leaf.close()


def peers_note(peers: dict[str, dict]) -> str:
    """Which peers each sidecar's router had, and how many remote reads each served."""
    where = {"hub": "on the hub", "peer": "on the hub with the [[peer]]", "leaf": "on the leaf"}
    parts = [f"{where[name]}: " + ", ".join(
        f"`{label}` {row.get('requests', 0):,} requests" + (f" ({row['hedges']:,} hedges)" if row.get("hedges") else "")
        for label, row in rows.items()) for name, rows in peers.items()]
    text = "Router peers after the run (INFO peers), sidecar " + "; ".join(parts) + "."
    if "peer" in peers and "leaf" not in peers["peer"]:
        text += (" The [[peer]] `leaf` is missing: this kvcache does not use configured peers, so "
                 "only the sidecar connected to the leaf reads from its mirror.")
    return text


def latency_table(samples: dict[str, list[float]], wrong: dict[str, int]) -> tuple[str, list[dict]]:
    rows = [{"path": label, **percentiles(xs), "wrong": wrong[label]} for label, xs in samples.items() if xs]
    ref = next((r["p50"] for r in rows if r["path"].startswith("nats-py kv.get")), None)
    lines = ["| path | reads | p50 µs | p90 µs | p99 µs | p99.9 µs | mean µs | nats-py kv.get p50 / this p50 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = f"{ref / r['p50']:.1f}x" if ref and r["p50"] else "-"
        bad = f" ({r['wrong']} wrong)" if r["wrong"] else ""
        lines.append(f"| {r['path']}{bad} | {r['n']:,} | {r['p50']:.1f} | {r['p90']:.1f} | {r['p99']:.1f} | "
                     f"{r['p99.9']:.1f} | {r['mean']:.1f} | {ratio} |")
    return "\n".join(lines), rows


# ----------------------------------------------------------------------------- locust

def run_locust(rs: ReadSetup, out: Path, args: argparse.Namespace) -> tuple[str, list[dict]]:
    """bench/locustfile.py headless against the hub sidecar; its CSVs go to `out`."""
    prefix, lat_out = out / "locust", out / "locust_latency.json"
    for f in out.glob("locust_*"):
        f.unlink()
    cmd = [sys.executable, "-m", "locust", "-f", str(BENCH / "locustfile.py"), "--headless",
           "-u", str(args.locust_users), "-r", str(args.locust_rate), "-t", f"{args.locust_seconds}s",
           "--csv", str(prefix), "--only-summary", "--stop-timeout", "5", "--loglevel", "WARNING",
           "--kv-socket", rs.sidecar.socket, "--kv-hot-keys", str(args.hot_keys),
           "--kv-cold-keys", str(args.cold_keys), "--kv-wait-ms", str(args.locust_wait_ms),
           "--kv-latency-out", str(lat_out)]
    print("+ " + shlex.join(cmd), file=sys.stderr, flush=True)
    with Client(rs.sidecar.socket) as c:
        before = c.info("stats")["stats"]
    sidecar_cpu, children_cpu, t0 = socket_bench.cpu_seconds(rs.sidecar.proc.pid), _children_cpu(), time.monotonic()
    # subprocess.run kills the child (by its PID) if it overruns the bound
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.locust_seconds + 120,
                       cwd=ROOT, env=child_env())
    wall = time.monotonic() - t0
    sidecar_cpu = socket_bench.cpu_seconds(rs.sidecar.proc.pid) - sidecar_cpu
    locust_cpu = _children_cpu() - children_cpu
    sys.stderr.write(r.stdout[-6000:] + r.stderr[-6000:])
    with Client(rs.sidecar.socket) as c:
        after = c.info("stats")["stats"]
    stats_csv = Path(f"{prefix}_stats.csv")
    if not stats_csv.exists():
        raise RuntimeError(f"locust exited with {r.returncode} and wrote no stats: {r.stderr[-2000:]}")
    ours = json.loads(lat_out.read_text()) if lat_out.exists() else {}
    rows = []
    lines = ["| request | requests | failures | req/s | p50 µs | p90 µs | p99 µs | p99.9 µs | max µs | locust avg ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    with open(stats_csv, newline="") as f:
        for row in csv.DictReader(f):
            name = row["Name"]
            mine = ours.get(name, {})
            rows.append({"name": name, "requests": int(row["Request Count"]), "failures": int(row["Failure Count"]),
                         "rps": float(row["Requests/s"]), "avg_ms": float(row["Average Response Time"]), **mine})
            us = [f"{mine[k]:,.1f}" if k in mine else "-" for k in ("p50", "p90", "p99", "p99.9", "max")]
            lines.append(f"| {name} | {rows[-1]['requests']:,} | {rows[-1]['failures']:,} | {rows[-1]['rps']:,.0f} | "
                         + " | ".join(us) + f" | {rows[-1]['avg_ms']:.3f} |")
    delta = {k: after[k] - before[k] for k in ("gets_local", "gets_remote", "gets_notfound", "remote_errors")}
    hot_cpu = " locust warned that its CPU was above 90%." if "CPU usage" in r.stderr + r.stdout else ""
    note = (f"`locust -u {args.locust_users} -r {args.locust_rate} -t {args.locust_seconds}s`, "
            f"think time {args.locust_wait_ms:g} ms mean, {args.hot_keys:,} hot keys (Zipf 1.1), "
            f"{args.cold_keys:,} cold; locust exit code {r.returncode}. CPU over the {wall:.0f} s: "
            f"locust {locust_cpu / wall:.0%} of one core, the sidecar {sidecar_cpu / wall:.0%}; "
            "response times are measured in locust, so they include its own scheduling. "
            "Sidecar INFO over the run: " + ", ".join(f"{k} +{v:,}" for k, v in delta.items()) + "." + hot_cpu)
    return "\n".join([*lines, "", note]), rows


def _children_cpu() -> float:
    """CPU seconds of this process's reaped children (locust, once subprocess.run returns)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


# ----------------------------------------------------------------------------- report

def versions() -> str:
    from importlib.metadata import version

    def cmd(*a: str) -> str:
        try:
            return subprocess.run(a, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return "?"
    redis = cmd(socket_bench.REDIS_SERVER, "--version").split(" sha=")[0].replace("Redis server v=", "")
    commit = cmd("git", "-C", str(ROOT), "rev-parse", "--short", "HEAD") or "? (not a git checkout)"
    dirty = cmd("git", "-C", str(ROOT), "status", "--porcelain", "--", "kvcache", "ext")
    import pkgutil

    import kvcache._native
    from kvcache.native import NO_EXTENSIONS
    built = sorted(m.name for m in pkgutil.iter_modules(kvcache._native.__path__))
    native = ("pure-Python twins (KVCACHE_NO_EXTENSIONS)" if NO_EXTENSIONS else
              f"native: {', '.join(built)}" if built else "pure-Python twins (extensions not built)")
    return (f"{sync_bench.versions()}, redis-server {redis}, locust {version('locust')}; "
            f"kvcache at {commit}{' + uncommitted changes in kvcache/ or ext/' if dirty else ''} "
            f"({native})")


def chart(figures: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [k for k in SECTIONS if k in figures]
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 3.6 * len(panels)), squeeze=False)
    for ax, name in zip(axes[:, 0], panels, strict=True):
        data = figures[name]
        if name == "get":
            variants = [v for v, _ in socket_bench.VARIANTS]
            xs = range(len(variants))
            for off, target, color in ((-0.2, "redis", "#c0392b"), (0.2, "kvcache", "#2874a6")):
                vals = [data[f"{target} {v}"]["rps"] for v in variants]
                bars = ax.bar([x + off for x in xs], vals, 0.4, label=target, color=color)
                ax.bar_label(bars, [f"{v / 1000:,.0f}k" for v in vals], fontsize=8)
            ratios = [data[f"kvcache {v}"]["rps"] / data[f"redis {v}"]["rps"] for v in variants]
            ax.set_xticks(list(xs), [f"{v}\nkvcache/redis {r:.2f}" for v, r in zip(variants, ratios, strict=True)])
            ax.set_xlabel("redis-benchmark -t get")
            ax.set_yscale("log")
            ax.set_ylabel("GET requests/s (log)")
            ax.set_title("GET over the Unix socket: kvcache vs redis-server")
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        elif name in ("latency", "locust"):
            rows = [r for r in data if "p50" in r]
            labels = [r.get("path") or r.get("name") for r in rows]
            ys = range(len(rows))
            for off, q, color in ((-0.2, "p50", "#2874a6"), (0.2, "p99", "#85c1e9")):
                bars = ax.barh([y + off for y in ys], [r[q] for r in rows], 0.4, label=q, color=color)
                ax.bar_label(bars, [f"{r[q]:,.0f}" for r in rows], fontsize=8)
            ax.set_yticks(list(ys), labels, fontsize=8)
            ax.invert_yaxis()
            ax.set_xscale("log")
            ax.margins(x=0.12)
            ax.set_xlabel("µs (log)")
            ax.set_title("single-key reads, one at a time" if name == "latency"
                         else "locust mix over the socket (per request, µs)")
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        elif name == "sync":
            rows = [r for r in data["results"] if r["rate"]]
            bars = ax.barh(range(len(rows)), [r["rate"] for r in rows], color="#2874a6")
            ax.bar_label(bars, [f"{r['rate']:,.0f}" for r in rows], fontsize=8)
            ax.set_yticks(range(len(rows)), [r["method"] for r in rows], fontsize=8)
            ax.invert_yaxis()
            ax.margins(x=0.12)
            ax.set_xlabel("keys/s")
            ax.set_title(f"initial sync of {data['keys']:,} keys")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"sections, comma separated: {','.join(SECTIONS)}")
    ap.add_argument("--keys", type=int, default=1_000_000, help="sync: keys in the bucket")
    ap.add_argument("--sync-repeat", type=int, default=3,
                    help="sync: runs of kvcache and the raw consumers (best kept; nats-py's watch runs once)")
    ap.add_argument("--requests", type=int, default=200_000, help="get: redis-benchmark -n per run")
    ap.add_argument("--repeat", type=int, default=3, help="get: runs per target and variant (best is kept)")
    ap.add_argument("--reads", type=int, default=20_000, help="latency: sequential reads per path")
    ap.add_argument("--hot-keys", type=int, default=10_000, help="latency/locust: replicated keys")
    ap.add_argument("--cold-keys", type=int, default=10_000, help="latency/locust: keys outside the filter")
    ap.add_argument("--locust-users", type=int, default=50)
    ap.add_argument("--locust-rate", type=float, default=10, help="users started per second")
    ap.add_argument("--locust-seconds", type=int, default=30)
    ap.add_argument("--locust-wait-ms", type=float, default=10, help="mean think time per user")
    ap.add_argument("--timeout", type=float, default=600, help="bound for each step (s)")
    ap.add_argument("--out", type=Path, default=BENCH / "results", help="where the outputs go")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = ap.parse_args(argv)
    args.sections = [s for s in args.only.split(",") if s]
    if unknown := set(args.sections) - set(SECTIONS):
        ap.error(f"unknown section(s): {', '.join(sorted(unknown))}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    socket_bench.exit_on_sigterm()
    args.out.mkdir(parents=True, exist_ok=True)
    started = datetime.now(UTC)
    md: list[str] = []
    figures: dict[str, Any] = {}
    problems: list[str] = []
    with socket_bench.work_dir("kvcache-compare-", lambda: args.keep) as work:
        if "get" in args.sections:
            print("== get: redis-benchmark over the Unix socket", file=sys.stderr, flush=True)
            g = socket_bench.run(work / "get", args.requests, repeat=args.repeat, timeout=args.timeout)
            md += ["## GET over the Unix socket (redis-benchmark)", "", g.table(), ""]
            figures["get"] = {f"{t} {v}": r for (t, v), r in g.results.items()}
            problems += g.problems

        if "latency" in args.sections or "locust" in args.sections:
            names = list(SIDECARS) if "latency" in args.sections else ["hub"]
            with read_setup(work / "read", args.hot_keys, args.cold_keys, names, args.timeout) as rs:
                if "latency" in args.sections:
                    print("== latency: single-key reads", file=sys.stderr, flush=True)
                    import uvloop
                    samples, wrong, peers = uvloop.run(
                        measure_reads(rs, args.hot_keys, args.cold_keys, args.reads, args.timeout))
                    table, rows = latency_table(samples, wrong)
                    md += ["## Single-key read latency (sequential, one request at a time)", "",
                           f"{args.reads:,} reads per path, interleaved in rounds of {ROUND:,}; "
                           f"{args.hot_keys:,} replicated keys and {args.cold_keys:,} outside the filter, "
                           f"values {len(value_of(key_name(HOT_PREFIX, 0)))} B; nats-py on uvloop. "
                           + peers_note(peers), "", table, ""]
                    figures["latency"] = rows
                    problems += [f"{r['path']}: {r['wrong']} wrong replies" for r in rows if r["wrong"]]
                if "locust" in args.sections:
                    print("== locust", file=sys.stderr, flush=True)
                    table, rows = run_locust(rs, args.out, args)
                    md += ["## locust: an application's read mix over the socket", "", table, ""]
                    figures["locust"] = rows
                    problems += [f"locust {r['name']}: {r['failures']} failures" for r in rows if r["failures"]]

        if "sync" in args.sections:
            print(f"== sync: {args.keys:,} keys", file=sys.stderr, flush=True)
            s = asyncio.run(sync_bench.run(work / "sync", args.keys, timeout=args.timeout,
                                           repeat=args.sync_repeat))
            md += ["## Initial sync", "", s.table(), ""]
            figures["sync"] = {"keys": s.n, "results": [
                {"method": r.method, "kind": r.kind, "keys": r.keys, "seconds": r.seconds,
                 "rate": s.rate(r.kind), "note": r.note} for r in s.results]}
            problems += [f"sync: {r.method} did not finish" for r in s.results
                         if not r.finished and r.kind != "watch"]

    seconds = (datetime.now(UTC) - started).total_seconds()
    head = ["# kvcache compared", "",
            f"`{shlex.join(['python', 'bench/compare.py', *(sys.argv[1:] if argv is None else argv)])}`, "
            f"{started:%Y-%m-%d %H:%M} UTC, {seconds:.0f} s.", "",
            f"{versions()}. One machine with {os.cpu_count()} CPUs shared with other work: "
            "compare ratios within a run, not absolute figures across runs.", ""]
    if problems:
        head += ["**Problems:** " + "; ".join(problems), ""]
    text = "\n".join(head + md)
    (args.out / "compare.md").write_text(text)
    (args.out / "compare.json").write_text(json.dumps(figures, indent=1, default=str) + "\n")
    chart(figures, args.out / "compare.png")
    print(text)
    print(f"wrote {args.out / 'compare.md'}, compare.png, compare.json", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
