"""`log_format = json`: every line the sidecar logs is one JSON object a log shipper can read
without parsing rules (a real sidecar process), and the formatter's fields (in process)."""
from __future__ import annotations

import json
import logging
import re

from support.sidecar_proc import SidecarProcess
from support.topology import nats_run

from kvcache.ops.logformat import JsonFormatter


def test_json_formatter_fields():
    f = JsonFormatter()
    rec = logging.LogRecord("kvcache.feed", logging.WARNING, __file__, 1, "bucket %s: %d keys", ("b", 3), None)
    rec.bucket = "b"  # what extra= attaches
    line = json.loads(f.format(rec))
    assert line["level"] == "warning" and line["logger"] == "kvcache.feed"
    assert line["message"] == "bucket b: 3 keys" and line["bucket"] == "b"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", line["time"])
    try:
        raise ValueError("boom")
    except ValueError:
        import sys
        rec = logging.LogRecord("kvcache", logging.ERROR, __file__, 1, "failed", None, sys.exc_info())
    line = json.loads(f.format(rec))
    assert "ValueError: boom" in line["exc"] and "\n" not in f.format(rec)


def test_a_sidecar_logs_json_lines(nats_server_module, tmp_path):
    async def setup(js):
        await js.create_key_value(bucket="lj")
    nats_run(nats_server_module.url, setup)
    sc = SidecarProcess(tmp_path / "sc", nats_server_module.url, ["lj"], extra=["--log-format", "json"])
    with sc:
        sc.start()
        assert sc.stop() == 0
    lines = [ln for ln in sc.log().splitlines() if ln.strip()]
    assert len(lines) >= 3
    parsed = [json.loads(ln) for ln in lines]  # every line, or this raises
    assert all({"time", "level", "logger", "message"} <= set(p) for p in parsed)
    assert any(p["message"].startswith("serving RESP on") for p in parsed)
    assert any(p["message"] == "stopped" for p in parsed)
