"""Fallback GET latency through the sidecar's router, next to each peer on its own and to
nats-py `kv.get` connected to the hub (what users do today), in the same run.

    python bench/routing_bench.py --requests 2000

Starts a 3-node JetStream cluster (domain `hub`, an R3 bucket `rb`) and two leaf nodes, each
in its own domain with a mirror of the bucket (`mirror_direct`), all on 127.0.0.1. A DelayProxy
(tests/topology.py), run in a child process so it never competes with the measuring client for
the GIL, puts a one-way delay in front of each: leaf1 0 ms, hub 5 ms, leaf2 20 ms (--delays
changes them; `--delays 1,5,20` gives the fastest peer a network of its own). The sidecar
connects to the hub through its proxy and has the two mirrors as [[peer]] entries through
theirs; its bucket replicates `local.>` only, so every `GET far.<n>` is a fallback read.

Phases: each peer's own Direct Get latency; nats-py `kv.get` over the hub proxy; sidecar GETs;
sidecar GETs with the fastest peer (leaf1) frozen a third of the way in. Reports p50/p99,
failed reads, hedges against the budget, and whether the issue's targets were met. Sidecar
reads are timed through kvcache.AsyncClient and through redis-py; the row "the hop alone"
(a replicated key) is what any read through the sidecar costs on top of the peer.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import nats
import nats.errors
import redis
import redis.asyncio as aioredis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.checkers import percentile
from support.sidecar_proc import SidecarProcess
from support.topology import ProxyHost, add_hub_mirror, nats_run, start_cluster, start_leaf

from kvcache.app.client import AsyncClient, KvcacheError

BUCKET = "rb"
KEYS = 100
DELAYS = {"leaf1": 0.0, "hub": 0.005, "leaf2": 0.020}   # one-way, seconds


# ---------------------------------------------------------------------------- topology

def setup_data(hub_url: str, leaves: dict) -> None:
    async def hub(js):
        kv = await js.create_key_value(bucket=BUCKET, direct=True, replicas=3)
        for i in range(KEYS):
            await kv.put(f"far.{i}", b"x" * 100)
        await kv.put("local.0", b"x" * 100)     # replicated: the sidecar hop alone, for scale
        return (await js.stream_info(f"KV_{BUCKET}")).state.last_seq
    last = nats_run(hub_url, hub)
    for name, leaf in leaves.items():
        nats_run(leaf.url, lambda js, name=name: add_hub_mirror(js, f"KV_{BUCKET}_{name}", f"KV_{BUCKET}", last))


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


async def interleaved(urls: dict[str, str], socket: str, n: int, proxies: ProxyHost) -> dict:
    """Each iteration times, one after the other (in a shuffled order) on the same key:
    leaf1's and the hub's own Direct Get, nats-py `kv.get` via the hub and sidecar GETs, so
    the machine's noise (2 shared cores) falls on all of them alike. Phase `steady`, then phase `stall`, in which
    leaf1's proxy freezes a third of the way in (leaf1's own reads stop there)."""
    ncs = {name: await nats.connect(urls[name]) for name in ("leaf1", "hub")}
    subject = {"leaf1": f"$JS.leaf1.API.DIRECT.GET.KV_{BUCKET}_leaf1",
               "hub": f"$JS.API.DIRECT.GET.KV_{BUCKET}"}
    kv = await ncs["hub"].jetstream().key_value(BUCKET)
    r = aioredis.Redis(unix_socket_path=socket)
    kc = AsyncClient(socket)        # the package's own client: the leanest way in
    lat: dict[str, list[float]] = defaultdict(list)
    failed: Counter = Counter()
    order = random.Random(1)

    async def timed(label: str, op) -> None:
        t = time.perf_counter()
        try:
            if await op() is None:
                failed[label] += 1
                return
        except (TimeoutError, redis.RedisError, KvcacheError, nats.errors.Error):
            failed[label] += 1
            return
        lat[label].append(time.perf_counter() - t)

    try:
        for i in range(200):                                    # warm-up: every peer measured
            await r.get(f"far.{i % KEYS}")
        info = {"before": (await r.info("routing"), await r.info("peers"))}
        for phase in ("steady", "stall"):
            for i in range(n):
                key = f"far.{i % KEYS}"
                frozen = phase == "stall" and i >= n // 3
                if phase == "stall" and i == n // 3:
                    info["freeze"] = (await r.info("routing"), await r.info("peers"))
                    proxies.do("freeze", "leaf1")
                ops = [(f"{phase} {name}", lambda name=name, key=key: ncs[name].request(
                    f"{subject[name]}.$KV.{BUCKET}.{key}", b"", timeout=5))
                    for name in ("leaf1", "hub") if not (frozen and name == "leaf1")]
                ops += [(f"{phase} kv.get", lambda key=key: kv.get(key)),
                        (f"{phase} sidecar" + (" frozen" if frozen else ""), lambda key=key: kc.get(key)),
                        (f"{phase} sidecar local", lambda: kc.get("local.0")),
                        (f"{phase} redis-py", lambda key=key: r.get(key)),
                        (f"{phase} redis-py local", lambda: r.get("local.0"))]
                # In a new order each time: whichever read follows the slow (10+ ms) ones
                # finds processes and CPUs gone idle and pays for waking them (~0.5 ms here);
                # a fixed order would charge that to the same path every time.
                order.shuffle(ops)
                for label, op in ops:
                    await timed(label, op)
            info[phase] = (await r.info("routing"), await r.info("peers"))
        proxies.do("thaw", "leaf1")
        return {"lat": lat, "failed": failed, "info": info}
    finally:
        await r.aclose()
        await kc.aclose()
        for nc in ncs.values():
            await nc.close()


def ms(x: float) -> str:
    return f"{x * 1000:.3f}"


def run(n: int, tmp: Path, delays: dict[str, float] = DELAYS) -> dict:
    cluster = start_cluster(tmp / "hub", n=3, domain="hub")
    leaves, proxies, sc = {}, None, None
    try:
        for name in ("leaf1", "leaf2"):
            leaves[name] = start_leaf(tmp / "leaves", cluster, domain=name)
        setup_data(cluster.urls[0], leaves)
        proxies = ProxyHost({"hub": cluster.servers[0].port, "leaf1": leaves["leaf1"].port,
                             "leaf2": leaves["leaf2"].port}, delays)
        urls = proxies.urls
        leaf2 = asyncio.run(peer_latency(urls["leaf2"], f"$JS.leaf2.API.DIRECT.GET.KV_{BUCKET}_leaf2",
                                         max(100, n // 10)))
        sc = SidecarProcess(tmp / "sc", None, extra=["--config", str(sidecar_config(tmp / "kvcache.toml", urls)),
                                              "--log-level", "warning"]).start()
        m = asyncio.run(interleaved(urls, sc.socket, n, proxies))
    finally:
        if sc:
            sc.kill()
        if proxies:
            proxies.stop()
        for leaf in leaves.values():
            leaf.stop()
        cluster.stop()

    lat, failed, info = m["lat"], m["failed"], m["info"]

    def delta(a: str, b: str, what: str) -> dict:
        (ra, pa), (rb_, pb) = info[a], info[b]
        if what == "hedges":
            return {"sent": rb_["hedges_sent"] - ra["hedges_sent"],
                    "routed": rb_["routed_requests"] - ra["routed_requests"]}
        return {p: pb[p]["requests"] - pa[p]["requests"] for p in pb}

    stall_all = lat["stall sidecar"] + lat["stall sidecar frozen"]
    hedge_delay_s = info["freeze"][0]["leaf1"]["p95_us"] / 1e6
    sidecar_failed = sum(v for k, v in failed.items()
                         if ("sidecar" in k or "redis-py" in k) and "local" not in k)
    return {
        "requests": n,
        "rows": [(f"peer leaf1 own Direct Get ({delays['leaf1'] * 1e3:g} ms)", lat["steady leaf1"],
                  failed["steady leaf1"]),
                 (f"peer hub own Direct Get ({delays['hub'] * 1e3:g} ms)", lat["steady hub"], failed["steady hub"]),
                 (f"peer leaf2 own Direct Get ({delays['leaf2'] * 1e3:g} ms), separate run", leaf2, 0),
                 ("nats-py kv.get via the hub", lat["steady kv.get"], failed["steady kv.get"]),
                 ("sidecar GET (fallback, routed), kvcache.AsyncClient", lat["steady sidecar"],
                  failed["steady sidecar"]),
                 ("sidecar GET of a replicated key (the hop alone), kvcache.AsyncClient",
                  lat["steady sidecar local"], failed["steady sidecar local"]),
                 ("sidecar GET (fallback, routed), redis-py asyncio", lat["steady redis-py"],
                  failed["steady redis-py"]),
                 ("sidecar GET of a replicated key, redis-py asyncio", lat["steady redis-py local"],
                  failed["steady redis-py local"]),
                 ("stall phase: peer hub own Direct Get", lat["stall hub"], failed["stall hub"]),
                 ("stall phase: sidecar GET, leaf1 frozen at 1/3", stall_all,
                  failed["stall sidecar"] + failed["stall sidecar frozen"]),
                 ("  ...the sidecar GETs after the freeze", lat["stall sidecar frozen"],
                  failed["stall sidecar frozen"])],
        "hedges": {"steady": delta("before", "steady", "hedges"), "stall": delta("steady", "stall", "hedges"),
                   "ratio": info["before"][0]["hedge_budget_ratio"]},
        "hedge_delay_ms": hedge_delay_s * 1000,
        "leaf1_after_stall": info["stall"][1]["leaf1"]["state"],
        "router_view": {p: v for p, v in info["steady"][0].items() if isinstance(v, dict)},
        "requests_by_peer": {"steady": delta("before", "steady", "peers"),
                             "stall": delta("steady", "stall", "peers")},
        "targets": {
            "p99 <= 1.2 x fastest peer p99": (percentile(lat["steady sidecar"], 99),
                                              1.2 * percentile(lat["steady leaf1"], 99)),
            "stalled p99 <= hedge delay + next peer p99": (
                percentile(lat["stall sidecar frozen"], 99), hedge_delay_s + percentile(lat["stall hub"], 99)),
            "zero failed reads": (sidecar_failed, 0),
        },
    }


def report(res: dict) -> None:
    print(f"\n{res['requests']} iterations per phase, sequential, one client; each iteration reads the "
          "same key from leaf1 and the hub directly, with nats-py kv.get and through the sidecar\n")
    print("| reads | p50 ms | p99 ms | max ms | failed |")
    print("|---|---:|---:|---:|---:|")
    for label, lat, failed in res["rows"]:
        print(f"| {label} | {ms(percentile(lat, 50))} | {ms(percentile(lat, 99))} | {ms(max(lat))} | {failed} |")
    h = res["hedges"]
    for phase in ("steady", "stall"):
        sent, req = h[phase]["sent"], h[phase]["routed"]
        print(f"\nhedges ({phase}): {sent} of {req} routed requests = {sent / max(req, 1):.1%} "
              f"(budget {h['ratio']:.0%} + burst)")
    for phase, by_peer in res["requests_by_peer"].items():
        print(f"requests by peer ({phase}, hedges and probes included): "
              + ", ".join(f"{p} {n}" for p, n in by_peer.items()))
    print(f"hedge delay (leaf1 p95 before the stall): {res['hedge_delay_ms']:.3f} ms; "
          f"leaf1 after the stall: {res['leaf1_after_stall']}")
    print("\nthe router's own view after the steady phase (INFO routing, µs, in the sidecar):")
    for peer, row in res["router_view"].items():
        print(f"  {peer}: p50 {row['p50_us']}, p95 {row['p95_us']}, p99 {row['p99_us']}")
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
    ap.add_argument("--delays", metavar="MS,MS,MS", default="0,5,20",
                    help="one-way delays (ms) of leaf1, hub and leaf2; leaf1 must stay the fastest")
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvroute-") as d:
        ms_ = [float(x) / 1000 for x in args.delays.split(",")]
        res = run(args.requests, Path(d), dict(zip(("leaf1", "hub", "leaf2"), ms_, strict=True)))
    report(res)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {**res, "rows": [(label, percentile(lat, 50), percentile(lat, 99), failed)
                             for label, lat, failed in res["rows"]]}, indent=1, default=str))


if __name__ == "__main__":
    main()
