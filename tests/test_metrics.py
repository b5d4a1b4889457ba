"""The metrics listener (`metrics_listen`) against real scrapers and probes.

A real Prometheus server scrapes a running sidecar (and evaluates deploy/'s alert rules on
what it scraped); its HTTP API must agree with INFO, and every expression of the Grafana
dashboard must evaluate over the real series. promtool checks the exposition. /healthz,
/readyz and `kvcache health` follow a sidecar through its sync, a cut-off and back, with and
without `ready_on_fallback`; the HTTP edges (methods, keep-alive, HEAD, OpenMetrics, bad
requests) answer as HTTP says, and a port in use is one line."""
from __future__ import annotations

import http.client
import json
import re
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.kvdata import kv_put
from support.poll import wait_until
from support.prometheus import prometheus
from support.sidecar_proc import SidecarProcess, run_cli
from support.topology import DelayProxy, nats_run

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parent.parent
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "kvcache.json"
# Families whose series appear only once their reason first happens (a fresh sidecar shows none)
SPARSE = ("kvcache_consumer_recreations_total", "kvcache_feed_follow_ends_total")


def metrics_address(sc: SidecarProcess) -> str:
    with sc.client() as c:
        return str(c.info("server")["server"]["metrics_listen"])


def http_get(address: str, path: str, method: str = "GET",
             headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request(method, path, headers=headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def sidecar(tmp_path: Path, name: str, url: str, buckets: list[str], *extra: str) -> SidecarProcess:
    return SidecarProcess(tmp_path / name, url, buckets, extra=["--metrics-listen", "127.0.0.1:0", *extra])


def test_prometheus_scrapes_what_info_shows(nats_server, tmp_path, capsys):
    async def setup(js):
        kv = await js.create_key_value(bucket="pm")
        for i in range(20):
            await kv.put(f"k{i}", b"v" * 100)
        await js.create_key_value(bucket="pc")
        await (await js.key_value("pc")).put("far", b"x")
    nats_run(nats_server.url, setup)
    conf = tmp_path / "kvcache.toml"  # pm replicated, pc served by a near cache
    conf.write_text('[[bucket]]\nname = "pm"\n\n[[bucket]]\nname = "pc"\nkeys = []\ncache_max_keys = 100\n')
    sc = sidecar(tmp_path, "sc", nats_server.url, [], "--config", str(conf))
    with sc:
        sc.start()
        address = metrics_address(sc)
        with sc.client() as c:
            gets = 0
            for i in range(30):
                assert c.get(f"pm:k{i % 20}") == b"v" * 100
                gets += 1
            for i in range(10):
                assert c.get(f"pm:missing{i}") is None
                gets += 1
            assert c.mget(["pm:k1", "pm:nope"]) == [b"v" * 100, None]

            def far() -> bool:  # from NATS (a peer) first, then from the near cache
                nonlocal gets
                gets += 1
                return c.get("pc:far") == b"x" and c.info("stats")["stats"]["gets_cached"] >= 1
            wait_until(far, 10, "a near-cache hit")
            info = c.info("all")
        exposition = http_get(address, "/metrics")[2]
        exposed, documented = exposed_metrics(exposition), documented_metrics()
        # the per-worker families exist with workers above 1 only (tests/test_workers.py)
        workers_only = {"kvcache_worker_clients", "kvcache_worker_gets_total", "kvcache_worker_report_age_seconds"}
        # and the fleet relay's with relays on only (tests/test_relay.py)
        relays_only = {n for n in documented if n.startswith("kvcache_relay_")}
        assert set(exposed) == set(documented) - workers_only - relays_only
        for name, labels in exposed.items():  # a family with no series yet shows no labels
            assert labels == documented[name] or (not labels and name in SPARSE), name

        # promtool's lint of the exposition (names, units, help texts)
        promtool = shutil.which("promtool")
        if promtool is None:
            pytest.skip("promtool is not installed (make system-deps installs Debian's prometheus)")
        r = subprocess.run([promtool, "check", "metrics"], input=exposition, capture_output=True, timeout=30)
        assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), (r.stdout, r.stderr)

        with prometheus(tmp_path / "prom", [address], [ALERTS]) as prom:
            st = info["stats"]
            expect = {
                'sum(kvcache_reads_total{source="local"})': st["gets_local"],
                'sum(kvcache_reads_total{source="cache"})': st["gets_cached"],
                'sum(kvcache_reads_total{source=~"peer|leader|stale"})': st["gets_remote"],
                'sum(kvcache_reads_total{result="miss"})': st["gets_notfound"],
                'sum(kvcache_command_duration_seconds_count{command="get"})': gets,
                'kvcache_replica_lag_seconds{bucket="pm"}': info["buckets"]["pm"]["lag_ms"] / 1000,
                'kvcache_replica_keys{bucket="pm"}': info["buckets"]["pm"]["keys"],
                'kvcache_replica_applied_sequence{bucket="pm"}': info["buckets"]["pm"]["applied_seq"],
                'kvcache_replica_synced{bucket="pm"}': 1,
                'kvcache_cache_hits_total{bucket="pc"}': info["buckets"]["pc"]["cache_hits"],
                'sum(kvcache_nats_connected{connection="main"})': 1,
            }
            wait_until(lambda: all(prom.value(q) == v for q, v in expect.items()), 60,
                       "Prometheus to hold what INFO shows",
                       detail=lambda: json.dumps({q: [prom.value(q), v] for q, v in expect.items()}))
            assert st["gets_local"] == 30 + 10 + 2 and st["gets_remote"] >= 1
            hit_ratio = ('sum(kvcache_reads_total{source=~"local|cache"}) / sum(kvcache_reads_total)')
            ratio = prom.value(hit_ratio)
            assert ratio == pytest.approx((st["gets_local"] + st["gets_cached"]) /
                                          (st["gets_local"] + st["gets_cached"] + st["gets_remote"]))
            with capsys.disabled():  # figures to read by eye (`pytest -s`)
                print(f"\nPrometheus: {hit_ratio} = {ratio}")
                for q in ('kvcache_replica_lag_seconds', 'kvcache_replica_lag_messages',
                          'histogram_quantile(0.99, sum by (le) (kvcache_command_duration_seconds_bucket'
                          '{command="get"}))'):
                    print(f"Prometheus: {q} = {[(r['metric'].get('bucket'), r['value'][1]) for r in prom.query(q)]}")

            # every alert rule evaluates without error on the real series
            def rules_evaluated() -> list[dict]:
                rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
                assert rules and all(r["lastEvaluation"] != "0001-01-01T00:00:00Z" for r in rules)
                return rules
            rules = wait_until(rules_evaluated, 30, "every alert rule evaluated")
            assert [r["name"] for r in rules if r["health"] != "ok"] == []
            # ...and none fires for a healthy sidecar (`up` aside, every one reads kvcache_*)
            assert [r["name"] for r in rules if r["state"] == "firing"] == []

            # every dashboard expression evaluates and names only series that exist
            names = set(prom.api("label/__name__/values"))
            for expr in dashboard_exprs():
                prom.query(expr)  # a syntax error or a bad function raises
                used = {re.sub(r"_(bucket|sum|count)$", "", n) if n.startswith("kvcache_command_duration")
                        else n for n in re.findall(r"\b(?:kvcache|process)_[a-z_]+", expr)}
                missing = {n for n in used if n not in names and not any(m.startswith(n + "_") for m in names)}
                missing.discard("kvcache_consumer_recreations_total")  # no series until one happens
                assert not missing, (expr, missing)


def exposed_metrics(exposition: bytes) -> dict[str, set[str]]:
    """The kvcache_* metrics an exposition holds, as docs/metrics.md names them, with the
    label names their samples carry."""
    out: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(exposition.decode()):
        if fam.name.startswith("kvcache_"):
            name = fam.name + "_total" if fam.type == "counter" else fam.name
            out[name] = {k for s in fam.samples for k in s.labels if k != "le"}
    return out


def documented_metrics() -> dict[str, set[str]]:
    """docs/metrics.md's tables: metric -> its labels."""
    text = (ROOT / "docs" / "metrics.md").read_text()
    rows = re.findall(r"^\| `(kvcache_[a-z_]+)` \| \w+ \|([^|]*)\|", text, re.M)
    assert len(rows) > 40
    return {name: set(re.findall(r"`([a-z_]+)`", labels)) for name, labels in rows}


def dashboard_exprs() -> list[str]:
    """The Grafana dashboard's PromQL, its variables given values Prometheus can take."""
    doc = json.loads(DASHBOARD.read_text())
    panels = [p for top in doc["panels"] for p in [top, *top.get("panels", [])]]
    exprs = [t["expr"] for p in panels for t in p.get("targets", []) if t.get("expr")]
    assert exprs
    subst = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m", "${bucket}": "pm",
             "$bucket": "pm", "${instance}": ".*", "$instance": ".*", "${job}": "kvcache", "$job": "kvcache"}
    out = []
    for e in exprs:
        for k, v in subst.items():
            e = e.replace(k, v)
        assert "$" not in e, f"unsubstituted variable in {e}"
        out.append(e)
    return out


def test_exposition_in_chunks_is_the_exposition_in_one_go():
    """With 1,200 buckets and peers the families outgrow metrics.CHUNK: formatted a chunk at
    a time (the event loop free in between), the exposition is byte for byte the one a single
    call of prometheus_client's encoder makes, in both formats, and no chunk is longer."""
    import asyncio

    from prometheus_client.exposition import choose_encoder

    from kvcache.feed.feed import RECREATION_REASONS, RESYNC_REASONS
    from kvcache.ops import metrics
    from kvcache.ops.latency import Latency

    n = 1200
    latency = {"get": Latency(), "mget": Latency()}
    latency["get"].observe(7_000, 5)
    latency["get"].observe(3_000_000)
    snap = metrics.Snapshot(
        build={"version": "0", "resp": "native"}, latency=latency,
        reads={(f"b{i:04d}", src, res): i for i in range(n) for src in ("local", "peer") for res in ("hit", "miss")},
        client_gauges=tuple(range(len(metrics.CLIENT_GAUGES))), counters=tuple(range(len(metrics.COUNTERS))))
    for i in range(n):
        snap.buckets[f"b{i:04d}"] = metrics.BucketRow(
            bool(i % 2), i, 10 * i, 10 * i + i % 3, i / 1000, 5.0, i, i, tuple(range(len(RESYNC_REASONS))),
            tuple(i % 2 for _ in RECREATION_REASONS),
            None if i % 3 else (i, 64 * i, *range(len(metrics.CACHE_COUNTERS))))
        snap.peers.append(((f"p{i}", f"b{i:04d}", f"KV_b{i:04d}"), i % 2, 0.0004, 0, (1, 2, 3, 4, 5)))
    snap.nats = [("main", "127.0.0.1:4222", 1, 2)]
    assert max(len(f.samples) for f in metrics.families(snap)) > 4 * metrics.CHUNK

    class All:
        def collect(self):
            return list(metrics.families(snap))
    for accept in ("", "application/openmetrics-text; version=1.0.0"):
        encoder, _ = choose_encoder(accept)
        whole = encoder(All()).removesuffix(metrics.EOF)
        body, _ = asyncio.run(metrics.exposition(snap, accept))
        assert body.startswith(whole) and body[len(whole):].startswith(b"# HELP process_"), accept
        for family in metrics.families(snap):
            for text in metrics._chunks(family, encoder):
                assert sum(not line.startswith(b"#") for line in text.splitlines()) <= metrics.CHUNK


def test_probes_through_sync_cut_off_and_fallback(nats_server, tmp_path):
    """Syncing (its NATS link frozen before the sync could end), synced, cut off, back; and
    with ready_on_fallback, ready while syncing as long as NATS is connected."""
    async def setup(js):
        kv = await js.create_key_value(bucket="sy")
        for i in range(50):
            await kv.put(f"k{i}", b"v")
    nats_run(nats_server.url, setup)
    proxy = DelayProxy(nats_server.port, delay=0.3).start()
    fallback_proxy = DelayProxy(nats_server.port, delay=0.3).start()
    sc = sidecar(tmp_path, "sc", proxy.url, ["sy"], "--max-stale-ms", "300", "--heartbeat-ms", "500")
    fb = sidecar(tmp_path, "fb", fallback_proxy.url, ["sy"], "--ready-on-fallback")
    try:
        sc.start(wait_synced=False)
        proxy.freeze()
        fb.start(wait_synced=False)
        fallback_proxy.freeze()
        for s in (sc, fb):
            assert s.buckets()["sy"]["synced"] == 0, "synced before its link froze: raise the delay"

        def probes(s: SidecarProcess) -> tuple[tuple[int, str], tuple[int, str], tuple[int, str]]:
            r = run_cli("health", "--socket", s.socket, "--ready")
            assert r.stderr == "" and len(r.stdout.splitlines()) == 1, (r.stdout, r.stderr)
            status, _, body = http_get(metrics_address(s), "/readyz")
            live = http_get(metrics_address(s), "/healthz")
            return (r.returncode, r.stdout.strip()), (status, body.decode().strip()), (live[0], live[2].decode())

        cli, http_ready, live = probes(sc)
        assert cli == (1, "not ready: sy (not synced)")
        assert http_ready == (503, "not ready: sy (not synced)")
        assert live == (200, "live\n")
        cli, http_ready, _ = probes(fb)
        line = "ready: reads go to NATS meanwhile (ready_on_fallback): sy (not synced)"
        assert cli == (0, line) and http_ready == (200, line)

        proxy.thaw()
        sc.wait_synced()
        cli, http_ready, _ = probes(sc)
        assert cli == (0, "ready: 1 bucket synced and within max_stale_ms") and http_ready[0] == 200

        proxy.freeze()  # cut off: past max_stale_ms, not ready; still live
        wait_until(lambda: probes(sc)[1][0] == 503, 30, "not ready once cut off")
        cli, http_ready, live = probes(sc)
        assert cli[0] == 1 and cli[1].startswith("not ready: sy (") and "max_stale_ms 300" in cli[1]
        assert http_ready[0] == 503 and http_ready[1].startswith("not ready: sy (")
        assert live[0] == 200
        proxy.thaw()
        wait_until(lambda: probes(sc)[1][0] == 200, 30, "ready again")

        fallback_proxy.stop()  # its NATS connection lost: falling back is no longer possible
        wait_until(lambda: probes(fb)[1][0] == 503, 30, "not ready without NATS")
        cli, http_ready, _ = probes(fb)
        assert cli[0] == 1 and cli[1].endswith(", NATS not connected") and http_ready == (503, cli[1])
    finally:
        for s in (sc, fb):
            s.kill()
        proxy.stop()
        fallback_proxy.stop()


def test_http_edges(nats_server, tmp_path):
    nats_run(nats_server.url, lambda js: js.create_key_value(bucket="he"))
    kv_put(nats_server.url, "he", "a", b"1")
    sc = sidecar(tmp_path, "sc", nats_server.url, ["he"])
    with sc:
        sc.start()
        address = metrics_address(sc)
        host, port = address.rsplit(":", 1)

        status, headers, body = http_get(address, "/metrics",
                                         headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        assert status == 200 and headers["content-type"].startswith("application/openmetrics-text")
        assert body.endswith(b"# EOF\n") and b"kvcache_reads_total" not in body.split(b"# EOF")[1]
        status, headers, body = http_get(address, "/metrics", method="HEAD")
        assert status == 200 and body == b"" and int(headers["content-length"]) > 1000
        status, headers, body = http_get(address, "/nowhere")
        assert status == 404 and b"/metrics, /healthz and /readyz" in body
        status, headers, body = http_get(address, "/metrics", method="DELETE")
        assert status == 405 and headers["allow"] == "GET, HEAD"

        # keep-alive: three requests on one connection
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        for path in ("/healthz", "/metrics", "/readyz"):
            conn.request("GET", path)
            r = conn.getresponse()
            assert r.status == 200 and r.read()
        conn.close()

        # malformed: one status line, then the connection closes
        for raw in (b"garbage\r\n\r\n", b"GET /metrics HTTP/1.1\r\nno colon\r\n\r\n",
                    b"POST /metrics HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc",
                    b"GET /" + b"x" * 20_000 + b" HTTP/1.1\r\n\r\n"):
            with socket.create_connection((host, int(port)), timeout=10) as s:
                s.sendall(raw)
                reply = b""
                while chunk := s.recv(65536):
                    reply += chunk
            assert reply.startswith(b"HTTP/1.1 400 Bad Request\r\n"), (raw[:40], reply[:80])
        assert http_get(address, "/healthz")[0] == 200  # the listener goes on

        # the port taken: the second sidecar says so in one line and exits 1
        other = SidecarProcess(tmp_path / "other", nats_server.url, ["he"], extra=["--metrics-listen", address])
        other.data_dir.mkdir(parents=True)
        r = subprocess.run(other.args, capture_output=True, text=True, timeout=60)
        assert r.returncode == 1
        assert r.stderr.strip().splitlines()[-1] == (
            f"kvcache: error: cannot listen on metrics_listen {address}: Address already in use")
        assert "Traceback" not in r.stderr


def test_every_consumer_loss_has_its_reason():
    """kvcache_consumer_recreations_total's `reason`: every ConsumerLost kvcache raises, every
    failure a consumer records, carries one of RECREATION_REASONS; kvcache_feed_follow_ends_total's,
    every end of a follower, one of FOLLOW_END_REASONS (each of them used)."""
    import ast

    from kvcache.errors import BucketNotFound, UpstreamError
    from kvcache.feed.consumer import ConsumerLost
    from kvcache.feed.feed import RECREATION_REASONS, _recreation_reason
    from kvcache.feed.follow import FOLLOW_END_REASONS

    reasons: list[str] = []
    follow_reasons: list[str] = []  # a follower's end (kvcache_feed_follow_ends_total's `reason`)
    for f in ("feed/consumer.py", "feed/feed.py", "feed/follow.py"):
        for node in ast.walk(ast.parse((ROOT / "kvcache" / f).read_text())):
            call = isinstance(node, ast.Call) and (getattr(node.func, "id", None) in ("ConsumerLost", "FollowEnded")
                                                   or getattr(node.func, "attr", None) == "fail")
            passed_on = call and len(node.args) == 2 and ast.unparse(node.args[1]) == "reason"  # Follower.fail
            if call and not passed_on and not any(isinstance(a, ast.Starred) for a in node.args):
                assert len(node.args) == 2 and isinstance(node.args[1], ast.Constant), ast.unparse(node)
                func = ast.unparse(node.func)
                follows = f == "feed/follow.py" or "follower" in func or func == "FollowEnded"
                (follow_reasons if follows else reasons).append(node.args[1].value)
            if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "self._failure" \
                    and isinstance(node.value, ast.Tuple):
                reasons.append(node.value.elts[1].value)
    assert len(reasons) >= 8 and set(reasons) <= set(RECREATION_REASONS), reasons
    assert set(follow_reasons) == set(FOLLOW_END_REASONS), follow_reasons
    assert {"heartbeat", "gap", "connection", "placement", "ended", "stream_recreated"} <= set(reasons)
    assert _recreation_reason(ConsumerLost("no heartbeat for 6.0s", "heartbeat")) == "heartbeat"
    assert _recreation_reason(BucketNotFound("gone")) == "bucket_missing"
    assert _recreation_reason(UpstreamError("api")) == "upstream"


def test_reads_by_source_leader_stale_and_failed(nats_server, tmp_path):
    """kvcache_reads_total's other sources: CONSISTENCY strong reads the leader; cut off from
    NATS past max_stale_ms, serve_stale answers `stale`; a key the stale replica cannot vouch
    for fails the read (`peer`, `error`)."""
    nats_run(nats_server.url, lambda js: js.create_key_value(bucket="rs"))
    kv_put(nats_server.url, "rs", "a", b"1")
    proxy = DelayProxy(nats_server.port).start()
    sc = sidecar(tmp_path, "sc", proxy.url, ["rs"], "--serve-stale", "--max-stale-ms", "300",
                 "--heartbeat-ms", "500", "--request-timeout-ms", "500")
    try:
        sc.start()
        address = metrics_address(sc)
        with sc.client() as c:
            assert c.entry("a", consistency="strong").source == "leader"
            proxy.freeze()
            wait_until(lambda: c.info("buckets")["buckets"]["rs"]["lag_ms"] > 300, 30, "past max_stale_ms")
            stale = c.entry("a")
            assert stale is not None and stale.source == "stale" and stale.value == b"1"
            with pytest.raises(Exception, match="upstream read failed"):
                c.entry("a", consistency="strong")  # strong never takes a stale answer
            info = c.info("stats")["stats"]

        def series() -> dict[tuple[str, str], float]:
            out = {}
            for fam in text_string_to_metric_families(http_get(address, "/metrics")[2].decode()):
                for s in fam.samples:
                    if s.name == "kvcache_reads_total" and s.labels["bucket"] == "rs" and s.value:
                        out[(s.labels["source"], s.labels["result"])] = s.value
                    if s.name == "kvcache_remote_errors_total":
                        out[("remote_errors", "")] = s.value
            return out
        assert series() == {("leader", "hit"): 1, ("stale", "hit"): 1, ("peer", "error"): 1,
                            ("remote_errors", ""): info["remote_errors"]}
        assert info["remote_errors"] == 2 and info["gets_stale"] == 1
    finally:
        sc.kill()
        proxy.stop()


def test_readyz_says_shutting_down_while_clients_drain(nats_server, tmp_path):
    """SIGTERM with a read in flight: until its client is answered, /readyz answers 503
    "shutting down" (a load balancer stops sending) and /healthz still 200; then the
    listener closes with the rest."""
    nats_run(nats_server.url, lambda js: js.create_key_value(bucket="sd"))
    kv_put(nats_server.url, "sd", "far", b"1")
    proxy = DelayProxy(nats_server.port).start()
    sc = sidecar(tmp_path, "sc", proxy.url, ["sd:near.>"], "--request-timeout-ms", "4000")
    try:
        sc.start()
        address = metrics_address(sc)
        assert http_get(address, "/readyz")[0] == 200
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(sc.socket)
            proxy.freeze()  # the Direct Get of `far` (outside the filters) hangs
            s.sendall(b"*2\r\n$3\r\nGET\r\n$3\r\nfar\r\n")
            assert sc.proc is not None
            sc.proc.send_signal(signal.SIGTERM)
            wait_until(lambda: "shutting down" in sc.log(), 10, "SIGTERM handled")
            status, _, body = http_get(address, "/readyz")
            assert (status, body) == (503, b"not ready: shutting down\n")
            assert http_get(address, "/healthz")[0] == 200
            s.settimeout(15)
            assert s.recv(4096).startswith(b"-")  # the read ends in its timeout: an error reply
            proxy.thaw()
        assert sc.proc.wait(30) == 0
        with pytest.raises(OSError):
            http_get(address, "/healthz")
    finally:
        sc.kill()
        proxy.stop()
