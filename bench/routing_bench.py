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
failed reads, hedges against the budget, and whether its targets (printed last) were met.
Sidecar reads are timed through kvcache.AsyncClient and through redis-py; the row "the hop
alone" (a replicated key) is what any read through the sidecar costs on top of the peer.

The quorum fence (kvcache.feed.quorum.Fence): `rb` is R3 in a cluster, so every
fallback read of it must come from a server showing it holds the sequence a quorum had (a
one-key `multi_last` batch whose end-of-batch reply names the server's last sequence). A
second bucket `r1`, R1 with the same keys and mirrors on the same leaves, needs no fence: its
GETs (`GET r1:<key>`) are plain subject-appended Direct Gets, through the same sidecar and the
same peer connections, in the same iterations. The rows "fence request, bare client" time the
fence's own requests to leaf1 from a plain NatsConnection beside its plain Direct Get: the
server's cost of the batch, apart from the sidecar's. Before the steady phase, leaf1's
`out_msgs` per sidecar read of each bucket shows the fence at work (2 replies: entry and
end-of-batch; 1 for a plain Direct Get).

`--sidecar-src DIR` also runs the kvcache of source tree DIR (e.g. a copy of the tree with
older files) as a second sidecar against the same peers, timed in the same iterations (rows
"(DIR)"): before and after in one run. `--no-stall` skips the stall phase.
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
from support.topology import ProxyHost, add_hub_mirror, nats_run, replicated_kv, settled, start_cluster, start_leaf

from kvcache.app.client import AsyncClient, KvcacheError
from kvcache.natsio.nats_connection import NatsConnection

BUCKET = "rb"
PLAIN = "r1"       # R1, same keys and mirrors: reads of it need no fence (plain Direct Gets)
KEYS = 100
DELAYS = {"leaf1": 0.0, "hub": 0.005, "leaf2": 0.020}   # one-way, seconds


# ---------------------------------------------------------------------------- topology

def setup_data(hub_url: str, leaves: dict) -> None:
    async def hub(js):
        last = {}
        for bucket, replicas in ((BUCKET, 3), (PLAIN, 1)):
            kv = await replicated_kv(js, bucket=bucket, direct=True, replicas=replicas)   # led, replicas current
            for i in range(KEYS):
                await settled(lambda i=i, kv=kv: kv.put(f"far.{i}", b"x" * 100))
            await settled(lambda kv=kv: kv.put("local.0", b"x" * 100))   # replicated: the sidecar hop alone, for scale
            last[bucket] = (await js.stream_info(f"KV_{bucket}")).state.last_seq
        return last
    last = nats_run(hub_url, hub)
    for name, leaf in leaves.items():
        for bucket in (BUCKET, PLAIN):
            nats_run(leaf.url, lambda js, name=name, bucket=bucket: add_hub_mirror(
                js, f"KV_{bucket}_{name}", f"KV_{bucket}", last[bucket]))


def sidecar_config(path: Path, urls: dict[str, str]) -> Path:
    lines = ["[nats]", f'servers = ["{urls["hub"]}"]']
    for bucket in (BUCKET, PLAIN):   # the first is the default bucket (GET <key>)
        lines += ["[[bucket]]", f'name = "{bucket}"', 'keys = ["local.>"]']
    for bucket in (BUCKET, PLAIN):
        for name in ("leaf1", "leaf2"):   # a leaf's two peers share one connection
            lines += ["[[peer]]", f'name = "{name}"' if bucket == BUCKET else f'name = "{name}-{bucket}"',
                      f'servers = ["{urls[name]}"]', f'stream = "KV_{bucket}_{name}"', f'domain = "{name}"']
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


async def replies_per_read(leaf, kc: AsyncClient, bucket: str, n: int = 200) -> float:
    """Messages leaf1's server sent per sidecar GET of `bucket` (its `out_msgs`, /varz): 1 for
    a plain Direct Get, 2 for a fenced one (the entry and the end-of-batch naming the server's
    last sequence), 3 with the anchor key beside it. Leaf1 is the peer every read goes to."""
    keys = [f"{bucket}:far.{i % KEYS}" for i in range(n)]
    before = leaf.monitor("/varz")["out_msgs"]
    for key in keys:
        await kc.get(key)
    return (leaf.monitor("/varz")["out_msgs"] - before) / n


async def interleaved(urls: dict[str, str], sockets: dict[str, str], n: int, proxies: ProxyHost,
                      leaf1, stall: bool = True) -> dict:
    """Each iteration times, one after the other (in a shuffled order) on the same key:
    leaf1's and the hub's own Direct Get, nats-py `kv.get` via the hub and sidecar GETs, so
    the machine's noise (2 shared cores) falls on all of them alike. Phase `steady`, then phase `stall`, in which
    leaf1's proxy freezes a third of the way in (leaf1's own reads stop there). `sockets`:
    this checkout's sidecar ("") and any other (--sidecar-src), timed alike."""
    ncs = {name: await nats.connect(urls[name]) for name in ("leaf1", "hub")}
    fast = NatsConnection()         # the sidecar's own client class, bare: the fence's requests
    await fast.connect(urls["leaf1"])
    subject = {"leaf1": f"$JS.leaf1.API.DIRECT.GET.KV_{BUCKET}_leaf1",
               "hub": f"$JS.API.DIRECT.GET.KV_{BUCKET}"}
    kv = await ncs["hub"].jetstream().key_value(BUCKET)
    socket = sockets[""]
    r = aioredis.Redis(unix_socket_path=socket)
    kc = AsyncClient(socket)        # the package's own client: the leanest way in
    others = {tag: AsyncClient(sock) for tag, sock in sockets.items() if tag}
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
            for c in (kc, *others.values()):
                await c.get(f"far.{i % KEYS}")
                await c.get(f"{PLAIN}:far.{i % KEYS}")
        out_msgs = {tag: {b: await replies_per_read(leaf1, c, b) for b in (BUCKET, PLAIN)}
                    for tag, c in (("", kc), *others.items())}
        info = {"before": (await r.info("routing"), await r.info("peers"))}
        fence_req = {form: f'{{"multi_last":[{subjects}],"batch":{len(subjects.split(","))}}}'
                     for form, subjects in (("[key]", '"$KV.rb.{key}"'),
                                            ("[key, anchor]", '"$KV.rb.{key}","$KV.rb.local.0"'))}
        for phase in ("steady", "stall") if stall else ("steady",):
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
                if phase == "steady":
                    ops += [(f"{phase} sidecar plain", lambda key=key: kc.get(f"{PLAIN}:{key}")),
                            (f"{phase} leaf1 fast_request", lambda key=key: fast.fast_request(
                                f"{subject['leaf1']}.$KV.{BUCKET}.{key}", b"", 5))]
                    ops += [(f"{phase} leaf1 fence {form}", lambda req=req, key=key: fast.fast_batch(
                        subject["leaf1"], req.replace("{key}", key).encode(), 5)) for form, req in fence_req.items()]
                    for tag, c in others.items():
                        ops += [(f"{phase} sidecar ({tag})", lambda c=c, key=key: c.get(key)),
                                (f"{phase} sidecar plain ({tag})", lambda c=c, key=key: c.get(f"{PLAIN}:{key}"))]
                # In a new order each time: whichever read follows the slow (10+ ms) ones
                # finds processes and CPUs gone idle and pays for waking them (~0.5 ms here);
                # a fixed order would charge that to the same path every time.
                order.shuffle(ops)
                for label, op in ops:
                    await timed(label, op)
            info[phase] = (await r.info("routing"), await r.info("peers"))
        if stall:
            proxies.do("thaw", "leaf1")
        return {"lat": lat, "failed": failed, "info": info, "out_msgs": out_msgs}
    finally:
        await r.aclose()
        for c in (kc, *others.values()):
            await c.aclose()
        for nc in ncs.values():
            await nc.close()
        await fast.close()


def ms(x: float) -> str:
    return f"{x * 1000:.3f}"


def sidecar_at(data_dir: Path, config: Path, src: Path | None) -> SidecarProcess:
    """This checkout's sidecar (src None), or the kvcache of source tree `src`: `python -P -m
    kvcache serve` with PYTHONPATH=src (-P: the working directory does not come first)."""
    sc = SidecarProcess(data_dir, None, extra=["--config", str(config), "--log-level", "warning"],
                        env=None if src is None else {"PYTHONPATH": str(src)})
    if src is not None:
        sc.args[1:1] = ["-P"]
    return sc


def run(n: int, tmp: Path, delays: dict[str, float] = DELAYS, other_src: Path | None = None,
        stall: bool = True) -> dict:
    cluster = start_cluster(tmp / "hub", n=3, domain="hub")
    leaves: dict = {}
    proxies = None
    scs: dict[str, SidecarProcess] = {}
    tag = f"{other_src}" if other_src is not None else ""
    try:
        for name in ("leaf1", "leaf2"):
            leaves[name] = start_leaf(tmp / "leaves", cluster, domain=name)
        setup_data(cluster.urls[0], leaves)
        proxies = ProxyHost({"hub": cluster.servers[0].port, "leaf1": leaves["leaf1"].port,
                             "leaf2": leaves["leaf2"].port}, delays)
        urls = proxies.urls
        leaf2 = asyncio.run(peer_latency(urls["leaf2"], f"$JS.leaf2.API.DIRECT.GET.KV_{BUCKET}_leaf2",
                                         max(100, n // 10)))
        config = sidecar_config(tmp / "kvcache.toml", urls)
        scs[""] = sidecar_at(tmp / "sc", config, None).start()
        if other_src is not None:
            scs[tag] = sidecar_at(tmp / "sc-other", config, other_src).start()
        m = asyncio.run(interleaved(urls, {t: sc.socket for t, sc in scs.items()}, n, proxies,
                                    leaves["leaf1"], stall))
    finally:
        for sc in scs.values():
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

    sidecar_failed = sum(v for k, v in failed.items()
                         if ("sidecar" in k or "redis-py" in k) and "local" not in k)
    d = delays
    rows = [(f"peer leaf1 own Direct Get ({d['leaf1'] * 1e3:g} ms), nats-py request", "steady leaf1"),
            ("peer leaf1 own Direct Get, NatsConnection.fast_request (the sidecar's client)",
             "steady leaf1 fast_request"),
            ("leaf1 fence request multi_last [key], bare NatsConnection", "steady leaf1 fence [key]"),
            ("leaf1 fence request multi_last [key, anchor], bare NatsConnection", "steady leaf1 fence [key, anchor]"),
            (f"peer hub own Direct Get ({d['hub'] * 1e3:g} ms)", "steady hub"),
            (f"peer leaf2 own Direct Get ({d['leaf2'] * 1e3:g} ms), separate run", None),
            ("nats-py kv.get via the hub", "steady kv.get"),
            (f"sidecar GET {BUCKET} (R3: fenced fallback, routed), kvcache.AsyncClient", "steady sidecar"),
            (f"sidecar GET {PLAIN} (R1: plain Direct Get, same peers), kvcache.AsyncClient", "steady sidecar plain"),
            *((f"  ({tag}) sidecar GET {BUCKET} (fenced)", f"steady sidecar ({tag})"),
              (f"  ({tag}) sidecar GET {PLAIN} (plain)", f"steady sidecar plain ({tag})"))[:2 if tag else 0],
            ("sidecar GET of a replicated key (the hop alone), kvcache.AsyncClient", "steady sidecar local"),
            ("sidecar GET (fallback, routed), redis-py asyncio", "steady redis-py"),
            ("sidecar GET of a replicated key, redis-py asyncio", "steady redis-py local")]
    out: dict = {
        "requests": n,
        "rows": [(label, leaf2 if key is None else lat[key], 0 if key is None else failed[key])
                 for label, key in rows],
        "out_msgs": m["out_msgs"],
        "hedges": {"steady": delta("before", "steady", "hedges"),
                   "ratio": info["before"][0]["hedge_budget_ratio"]},
        "router_view": {p: v for p, v in info["steady"][0].items() if isinstance(v, dict)},
        "requests_by_peer": {"steady": delta("before", "steady", "peers")},
    }
    own, fenced, plain = lat["steady leaf1"], lat["steady sidecar"], lat["steady sidecar plain"]
    out["fence"] = {label: (percentile(v, 50), percentile(v, 99)) for label, v in (
        ("fastest peer's own Direct Get (nats-py)", own), ("sidecar fenced", fenced),
        ("sidecar plain (R1)", plain), *(((f"({tag}) sidecar fenced", lat[f"steady sidecar ({tag})"]),
                                          (f"({tag}) sidecar plain", lat[f"steady sidecar plain ({tag})"]))
                                         if tag else ()))}
    out["targets"] = {
        "fenced p99 <= 1.2 x fastest peer p99 + 0.5 ms": (
            percentile(fenced, 99), 1.2 * percentile(own, 99) + 0.0005),
        "p99 <= 1.2 x fastest peer p99": (percentile(fenced, 99), 1.2 * percentile(own, 99)),
        "zero failed reads": (sidecar_failed, 0),
    }
    if tag:
        other = lat[f"steady sidecar ({tag})"]
        out["targets"][f"({tag}) fenced p99 <= 1.2 x fastest peer p99 + 0.5 ms"] = (
            percentile(other, 99), 1.2 * percentile(own, 99) + 0.0005)
    if stall:
        stall_all = lat["stall sidecar"] + lat["stall sidecar frozen"]
        hedge_delay_s = info["freeze"][0]["leaf1"]["p95_us"] / 1e6
        out["rows"] += [
            ("stall phase: peer hub own Direct Get", lat["stall hub"], failed["stall hub"]),
            ("stall phase: sidecar GET, leaf1 frozen at 1/3", stall_all,
             failed["stall sidecar"] + failed["stall sidecar frozen"]),
            ("  ...the sidecar GETs after the freeze", lat["stall sidecar frozen"], failed["stall sidecar frozen"])]
        out["hedges"]["stall"] = delta("steady", "stall", "hedges")
        out["requests_by_peer"]["stall"] = delta("steady", "stall", "peers")
        out["hedge_delay_ms"] = hedge_delay_s * 1000
        out["leaf1_after_stall"] = info["stall"][1]["leaf1"]["state"]
        out["targets"]["stalled p99 <= hedge delay + next peer p99"] = (
            percentile(lat["stall sidecar frozen"], 99), hedge_delay_s + percentile(lat["stall hub"], 99))
    return out


def report(res: dict) -> None:
    print(f"\n{res['requests']} iterations per phase, sequential, one client; each iteration reads the "
          "same key from leaf1 and the hub directly, with nats-py kv.get and through the sidecar\n")
    print("| reads | p50 ms | p99 ms | max ms | failed |")
    print("|---|---:|---:|---:|---:|")
    for label, lat, failed in res["rows"]:
        print(f"| {label} | {ms(percentile(lat, 50))} | {ms(percentile(lat, 99))} | {ms(max(lat))} | {failed} |")
    print("\nthe fence, same run (p50 / p99 ms):")
    for label, (p50, p99) in res["fence"].items():
        print(f"  {label}: {ms(p50)} / {ms(p99)}")
    for tag, per in res["out_msgs"].items():
        print(f"leaf1 messages out per sidecar GET{f' ({tag})' if tag else ''}: "
              + ", ".join(f"{b} {v:.2f}" for b, v in per.items())
              + " (1: a plain Direct Get; 2: key and end-of-batch; 3: with the anchor too)")
    h = res["hedges"]
    for phase in h.keys() - {"ratio"}:
        sent, req = h[phase]["sent"], h[phase]["routed"]
        print(f"\nhedges ({phase}): {sent} of {req} routed requests = {sent / max(req, 1):.1%} "
              f"(budget {h['ratio']:.0%} + burst)")
    for phase, by_peer in res["requests_by_peer"].items():
        print(f"requests by peer ({phase}, hedges and probes included): "
              + ", ".join(f"{p} {n}" for p, n in by_peer.items()))
    if "hedge_delay_ms" in res:
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
    ap.add_argument("--sidecar-src", type=Path, metavar="DIR",
                    help="also time the kvcache of source tree DIR (a second sidecar, same peers, same run)")
    ap.add_argument("--no-stall", action="store_true", help="skip the stall phase (leaf1 frozen)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvroute-") as d:
        ms_ = [float(x) / 1000 for x in args.delays.split(",")]
        res = run(args.requests, Path(d), dict(zip(("leaf1", "hub", "leaf2"), ms_, strict=True)),
                  args.sidecar_src.resolve() if args.sidecar_src else None, not args.no_stall)
    report(res)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {**res, "rows": [(label, percentile(lat, 50), percentile(lat, 99), failed)
                             for label, lat, failed in res["rows"]]}, indent=1, default=str))


if __name__ == "__main__":
    main()
