"""A real Prometheus server (Debian's `prometheus` package, installed by `make system-deps`)
scraping 127.0.0.1 targets every second, asked through its HTTP API; stopped by its PID."""
from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvcache.natsio.nats_server import die_with_parent, free_port
from support.poll import wait_until


class Prometheus:
    def __init__(self, url: str, proc: subprocess.Popen, log: Path) -> None:
        self.url = url
        self.proc = proc
        self.log = log

    def api(self, path: str, **params: str) -> dict:
        """GET /api/v1/<path>; its `data` (an API error raises, with Prometheus's message)."""
        q = urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{q}", timeout=10) as r:
                doc = json.load(r)
        except urllib.error.HTTPError as e:
            raise AssertionError(f"Prometheus {path} {params}: {e.code} {e.read().decode()}") from None
        assert doc["status"] == "success", doc
        return doc["data"]

    def query(self, expr: str) -> list[dict]:
        """An instant query's vector: [{"metric": {...}, "value": [t, "v"]}]."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        return data["result"]

    def value(self, expr: str) -> float | None:
        """The single value of an instant query; None when it returns nothing."""
        result = self.query(expr)
        assert len(result) <= 1, result
        return float(result[0]["value"][1]) if result else None


@contextmanager
def prometheus(tmp: Path, targets: list[str], rule_files: list[Path] = ()) -> Iterator[Prometheus]:
    """Prometheus scraping `targets` (job `kvcache`) every second and evaluating `rule_files`
    every second, until the block ends."""
    exe = shutil.which("prometheus")
    if exe is None:
        pytest.skip("prometheus is not installed (make system-deps installs Debian's package)")
    tmp.mkdir(parents=True, exist_ok=True)
    config = tmp / "prometheus.yml"
    config.write_text(json.dumps({  # JSON is YAML
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [{"job_name": "kvcache", "static_configs": [{"targets": targets}]}],
    }))
    port = free_port("127.0.0.1")
    log = tmp / "prometheus.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [exe, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
    server = Prometheus(f"http://127.0.0.1:{port}", proc, log)
    try:
        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"prometheus exited with {proc.returncode}:\n{log.read_text()}")
            with urllib.request.urlopen(f"{server.url}/-/ready", timeout=2) as r:
                return r.status == 200
        wait_until(ready, 60, "Prometheus ready", detail=log.read_text)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
