"""Fallback GET latency through the sidecar's router, next to each peer on its own and to
nats-py `kv.get` connected to the hub (what users do today), in the same run.

    python bench/routing_bench.py --requests 2000

Starts a 3-node JetStream cluster (domain `hub`, an R3 bucket `rb`) and two leaf nodes, each
in its own domain with a mirror of the bucket (`mirror_direct`), all on 127.0.0.1. A DelayProxy
(tests/topology.py), run in a child process so it never competes with the measuring client for
the GIL, puts a one-way delay in front of each: leaf1 0 ms, hub 5 ms, leaf2 20 ms. The sidecar
connects to the hub through its proxy and has the two mirrors as [[peer]] entries through
theirs; its bucket replicates `local.>` only, so every `GET far.<n>` is a fallback read.

Phases: each peer's own Direct Get latency; nats-py `kv.get` over the hub proxy; sidecar GETs;
sidecar GETs with the fastest peer (leaf1) frozen a third of the way in. Reports p50/p99,
failed reads, hedges against the budget, and whether the issue's targets were met.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

import nats
import redis
from nats.js.api import ExternalStream, StreamConfig, StreamSource

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from sidecar_proc import Sidecar  # noqa: E402
from topology import DelayProxy, nats_run, start_cluster, start_leaf  # noqa: E402

BUCKET = "rb"
KEYS = 100
DELAYS = {"leaf1": 0.0, "hub": 0.005, "leaf2": 0.020}   # one-way, seconds


def pct(samples: list[float], p: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))] if s else float("nan")


# ---------------------------------------------------------------------------- proxies (child process)

def _proxy_host(targets: dict[str, int], delays: dict[str, float], conn) -> None:
    proxies = {n: DelayProxy(port, delays[n]).start() for n, port in targets.items()}
    conn.send({n: px.url for n, px in proxies.items()})
    while True:
        cmd, name = conn.recv()
        if cmd == "stop":
            break
        getattr(proxies[name], cmd)()
        conn.send("ok")
    for px in proxies.values():
        px.stop()


class ProxyHost:
    """DelayProxies in a child process; freeze/thaw by name."""

    def __init__(self, targets: dict[str, int], delays: dict[str, float]) -> None:
        self._conn, child = mp.Pipe()
        self._proc = mp.get_context("spawn").Process(target=_proxy_host, args=(targets, delays, child),
                                                     daemon=True)
        self._proc.start()
        self.urls: dict[str, str] = self._conn.recv()

    def do(self, cmd: str, name: str) -> None:
        self._conn.send((cmd, name))
        self._conn.recv()

    def stop(self) -> None:
        self._conn.send(("stop", ""))
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()


# ---------------------------------------------------------------------------- topology

def setup_data(hub_url: str, leaves: dict) -> None:
    async def hub(js):
        kv = await js.create_key_value(bucket=BUCKET, direct=True, replicas=3)
        for i in range(KEYS):
            await kv.put(f"far.{i}", b"x" * 100)
        return (await js.stream_info(f"KV_{BUCKET}")).state.last_seq
    last = nats_run(hub_url, hub)
    for name, leaf in leaves.items():
        async def mirror(js, name=name):
            stream = f"KV_{BUCKET}_{name}"
            await js.add_stream(StreamConfig(
                name=stream, mirror_direct=True, allow_direct=True,
                mirror=StreamSource(name=f"KV_{BUCKET}", external=ExternalStream(api="$JS.hub.API"))))
            while (await js.stream_info(stream)).state.last_seq < last:
                await asyncio.sleep(0.05)
        nats_run(leaf.url, mirror)


def sidecar_config(path: Path, urls: dict[str, str]) -> Path:
    lines = ["[nats]", f'servers = ["{urls["hub"]}"]', "[[bucket]]", f'name = "{BUCKET}"',
             'keys = ["local.>"]']
    for name in ("leaf1", "leaf2"):
        lines += ["[[peer]]", f'name = "{name}"', f'servers = ["{urls[name]}"]',
                  f'stream = "KV_{BUCKET}_{name}"', f'domain = "{name}"']
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------------------- measurements

async def peer_latency(url: str, subject_prefix: str, n: int) -> list[float]:
    """One peer's own Direct Get round trips, as the router would send them."""
    nc = await nats.connect(url)
    try:
        out = []
        for i in range(n + 50):
            t = time.perf_counter()
            await nc.request(f"{subject_prefix}.$KV.{BUCKET}.far.{i % KEYS}", b"", timeout=5)
            if i >= 50:
                out.append(time.perf_counter() - t)
        return out
    finally:
        await nc.close()


async def kv_get_latency(url: str, n: int) -> list[float]:
    nc = await nats.connect(url)
    try:
        kv = await nc.jetstream().key_value(BUCKET)
        out = []
        for i in range(n + 50):
            t = time.perf_counter()
            await kv.get(f"far.{i % KEYS}")
            if i >= 50:
                out.append(time.perf_counter() - t)
        return out
    finally:
        await nc.close()


def sidecar_latency(r: redis.Redis, n: int, on: dict | None = None) -> tuple[list[float], int]:
    """n GETs; `on` maps a request index to a callable run before it. Returns (latencies of the
    successful reads, failed reads)."""
    out, failed = [], 0
    for i in range(n):
        if on and i in on:
            on[i]()
        t = time.perf_counter()
        try:
            if r.get(f"far.{i % KEYS}") is None:
                failed += 1
                continue
        except redis.RedisError:
            failed += 1
            continue
        out.append(time.perf_counter() - t)
    return out, failed


def ms(x: float) -> str:
    return f"{x * 1000:.3f}"


def run(n: int, tmp: Path) -> dict:
    cluster = start_cluster(tmp / "hub", n=3, domain="hub")
    leaves, proxies, sc = {}, None, None
    try:
        for name in ("leaf1", "leaf2"):
            leaves[name] = start_leaf(tmp / "leaves", cluster, domain=name)
        setup_data(cluster.urls[0], leaves)
        proxies = ProxyHost({"hub": cluster.servers[0].port, "leaf1": leaves["leaf1"].port,
                             "leaf2": leaves["leaf2"].port}, DELAYS)
        urls = proxies.urls
        own = {}
        for name in ("leaf1", "hub", "leaf2"):
            prefix = ("$JS.API" if name == "hub" else f"$JS.{name}.API") + ".DIRECT.GET." + (
                f"KV_{BUCKET}" if name == "hub" else f"KV_{BUCKET}_{name}")
            own[name] = asyncio.run(peer_latency(urls[name], prefix, n))
        kvget = asyncio.run(kv_get_latency(urls["hub"], n))

        sc = Sidecar(tmp / "sc", None, extra=["--config", str(sidecar_config(tmp / "kvcache.toml", urls)),
                                              "--log-level", "warning"]).start()
        r = redis.Redis(unix_socket_path=sc.socket)
        sidecar_latency(r, 200)                                  # warm-up: every peer measured
        before, peers_before = r.info("routing"), r.info("peers")
        steady, steady_failed = sidecar_latency(r, n)
        mid, peers_mid = r.info("routing"), r.info("peers")
        hedge_delay_s = mid["leaf1"]["p95_us"] / 1e6
        stall_at = n // 3
        stalled, stalled_failed = sidecar_latency(r, n, {stall_at: lambda: proxies.do("freeze", "leaf1")})
        after = r.info("routing")
        peers_after = r.info("peers")
        proxies.do("thaw", "leaf1")
    finally:
        if sc:
            sc.kill()
        if proxies:
            proxies.stop()
        for leaf in leaves.values():
            leaf.stop()
        cluster.stop()

    def hedges(a: dict, b: dict) -> tuple[int, int]:
        return b["hedges_sent"] - a["hedges_sent"], b["routed_requests"] - a["routed_requests"]

    fastest_p99 = pct(own["leaf1"], 99)
    next_p99 = pct(own["hub"], 99)
    after_stall = stalled[stall_at:]
    steady_h, steady_req = hedges(before, mid)
    stall_h, stall_req = hedges(mid, after)
    budget = before["hedge_budget_ratio"]
    res = {
        "requests": n,
        "rows": [(f"peer leaf1 own Direct Get ({DELAYS['leaf1'] * 1000:g} ms)", own["leaf1"], 0),
                 (f"peer hub own Direct Get ({DELAYS['hub'] * 1000:g} ms)", own["hub"], 0),
                 (f"peer leaf2 own Direct Get ({DELAYS['leaf2'] * 1000:g} ms)", own["leaf2"], 0),
                 ("nats-py kv.get via the hub", kvget, 0),
                 ("sidecar GET (fallback, routed)", steady, steady_failed),
                 ("sidecar GET, leaf1 frozen at 1/3", stalled, stalled_failed),
                 ("  ...the reads after the freeze", after_stall, stalled_failed)],
        "hedges": {"steady": (steady_h, steady_req), "stall": (stall_h, stall_req), "ratio": budget},
        "hedge_delay_ms": hedge_delay_s * 1000,
        "leaf1_after_stall": peers_after["leaf1"]["state"],
        "requests_by_peer": {phase: {p: b[p]["requests"] - a[p]["requests"] for p in b}
                             for phase, a, b in (("steady", peers_before, peers_mid),
                                                 ("stall", peers_mid, peers_after))},
        "targets": {
            "p99 <= 1.2 x fastest peer p99": (pct(steady, 99), 1.2 * fastest_p99),
            "stalled p99 <= hedge delay + next peer p99": (pct(after_stall, 99), hedge_delay_s + next_p99),
            "zero failed reads": (steady_failed + stalled_failed, 0),
        },
    }
    return res


def report(res: dict) -> None:
    print(f"\n{res['requests']} GETs per row, sequential, one client\n")
    print("| reads | p50 ms | p99 ms | max ms | failed |")
    print("|---|---:|---:|---:|---:|")
    for label, lat, failed in res["rows"]:
        print(f"| {label} | {ms(pct(lat, 50))} | {ms(pct(lat, 99))} | {ms(max(lat))} | {failed} |")
    h = res["hedges"]
    for phase in ("steady", "stall"):
        sent, req = h[phase]
        print(f"\nhedges ({phase}): {sent} of {req} routed requests = {sent / max(req, 1):.1%} "
              f"(budget {h['ratio']:.0%} + burst)")
    for phase, by_peer in res["requests_by_peer"].items():
        print(f"requests by peer ({phase}, hedges and probes included): "
              + ", ".join(f"{p} {n}" for p, n in by_peer.items()))
    print(f"hedge delay (leaf1 p95 before the stall): {res['hedge_delay_ms']:.3f} ms; "
          f"leaf1 after the stall: {res['leaf1_after_stall']}")
    print("\ntargets:")
    for name, (got, limit) in res["targets"].items():
        ok = got <= limit
        if isinstance(got, float):
            print(f"  {name}: {ms(got)} ms vs {ms(limit)} ms -> {'met' if ok else 'NOT met'}")
        else:
            print(f"  {name}: {got} -> {'met' if ok else 'NOT met'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvroute-") as d:
        res = run(args.requests, Path(d))
    report(res)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {**res, "rows": [(label, pct(lat, 50), pct(lat, 99), failed)
                             for label, lat, failed in res["rows"]]}, indent=1, default=str))


if __name__ == "__main__":
    main()
