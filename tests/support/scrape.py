"""A sidecar's own counters, read from its metrics listener: for tests that wait on what the
sidecar did (a write retried) rather than on how many log lines it wrote about it. The
listener is turned on with METRICS_ENV (any free port; INFO `metrics_listen` names it)."""
from __future__ import annotations

import http.client

from prometheus_client.parser import text_string_to_metric_families

from support.poll import wait_until

# The environment a sidecar needs for these helpers: its metrics listener on any free port.
METRICS_ENV = {"KVCACHE_METRICS_LISTEN": "127.0.0.1:0"}


def metrics_address(sc, timeout: float = 30.0) -> str:
    """Where the sidecar (a SidecarProcess) serves /metrics, as INFO says: the listener is
    bound just after the socket starts answering, so INFO may name none for a moment."""
    def bound() -> str:
        with sc.client() as c:
            return str(c.info("server")["server"]["metrics_listen"])
    return str(wait_until(bound, timeout, "the sidecar's metrics listener to be bound"))


def http_get(address: str, path: str) -> tuple[int, str]:
    """(status, body) of GET `path` on the listener at `address` (host:port)."""
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read().decode()
    finally:
        conn.close()


def replica_error_retries(address: str, bucket: str) -> int:
    """kvcache_consumer_recreations_total{bucket, reason="replica_error"}: the bucket's failed
    replica writes the feed has retried (0 before the first)."""
    _, text = http_get(address, "/metrics")
    for fam in text_string_to_metric_families(text):
        if fam.name == "kvcache_consumer_recreations":
            for s in fam.samples:
                if s.name.endswith("_total") and s.labels.get("reason") == "replica_error" \
                        and s.labels.get("bucket") == bucket:
                    return int(s.value)
    return 0
