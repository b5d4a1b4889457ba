"""`kvcache load` on local Spark against real nats-servers: every input format, key templates,
JSON values, invalid keys, a server restarted mid-load, reruns, errors, spark-submit.

One SparkSession (local[2]) serves the whole test session; the CLI run in-process reuses it.
"""
from __future__ import annotations

import asyncio
import csv
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import nats
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.poll import wait_until
from support.sidecar_proc import run_cli

from kvcache import cli
from kvcache.natsio import jetstream as jsapi


def load(capsys, *args: str) -> tuple[int, str, str]:
    """`kvcache load ...` in-process (on the session's Spark): exit code, stdout, stderr."""
    code = cli.main(["load", *args, "--progress", "0"])
    out = capsys.readouterr()
    return code, out.out, out.err


async def _contents(url: str, bucket: str) -> tuple[dict[str, bytes], dict]:
    """Every key's last value (read from the stream with nats-py) and the stream's info."""
    nc = await nats.connect(url)
    try:
        info = await jsapi.stream_info(nc, f"KV_{bucket}", 5)
        js = nc.jetstream()
        out: dict[str, bytes] = {}
        sub = await js.subscribe(f"$KV.{bucket}.>", ordered_consumer=True, deliver_policy="last_per_subject")
        try:
            want = info["state"].get("num_subjects", 0)
            while len(out) < want:
                msg = await sub.next_msg(timeout=10)
                out[msg.subject[len(f"$KV.{bucket}."):]] = msg.data
        finally:
            await sub.unsubscribe()
        return out, info
    finally:
        await nc.close()


def contents(url: str, bucket: str) -> tuple[dict[str, bytes], dict]:
    return asyncio.run(_contents(url, bucket))


def summary_of(out: str) -> dict[str, int]:
    """The counts of the summary line (`N rows read, N written, N invalid, N failed (N retries)`)."""
    m = re.search(r"([\d,]+) rows read, ([\d,]+) written, ([\d,]+) invalid, ([\d,]+) failed "
                  r"\(([\d,]+) retries, ([\d,]+) disconnects\)", out)
    assert m, out
    names = ("read", "written", "invalid", "failed", "retries", "disconnects")
    return dict(zip(names, (int(g.replace(",", "")) for g in m.groups()), strict=True))


# ---------------------------------------------------------------------------- formats


def test_parquet_key_column_binary_value(spark, nats_server, tmp_path, capsys):
    rows = 300
    path = tmp_path / "users.parquet"
    pq.write_table(pa.table({
        "id": pa.array([f"user.{i:04d}" for i in range(rows)]),
        "blob": pa.array([bytes([i % 256, 0, 255]) + b"\n" for i in range(rows)], pa.binary()),
    }), path)
    code, out, err = load(capsys, str(path), "--nats", nats_server.url, "--bucket", "users",
                          "--key", "id", "--value", "blob", "--history", "3")
    assert code == 0, out + err
    assert summary_of(out) == {"read": rows, "written": rows, "invalid": 0, "failed": 0, "retries": 0,
                                "disconnects": 0}
    assert "created bucket 'users'" in err
    data, info = contents(nats_server.url, "users")
    assert data == {f"user.{i:04d}": bytes([i % 256, 0, 255]) + b"\n" for i in range(rows)}
    assert info["config"]["allow_direct"] is True and info["config"]["max_msgs_per_subject"] == 3


def test_csv_key_template_and_json_of_columns(spark, nats_server, tmp_path, capsys):
    path = tmp_path / "stock.csv"
    rows = [{"region": r, "id": f"{i:03d}", "name": f"item {i}", "qty": str(i * 7)}
            for i, r in enumerate(["eu", "us", "apac"] * 40)]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    code, out, err = load(capsys, str(path), "--nats", nats_server.url, "--bucket", "stock",
                          "--key", "stock.{region}.{id}", "--json", "name,qty")
    assert code == 0, out + err
    data, _ = contents(nats_server.url, "stock")
    # CSV columns stay text unless --infer-schema: "007" keeps its zeros in the key
    assert {k: json.loads(v) for k, v in data.items()} == {
        f"stock.{r['region']}.{r['id']}": {"name": r["name"], "qty": r["qty"]} for r in rows}


def test_json_lines_directory_whole_row_as_json(spark, nats_server, tmp_path, capsys):
    d = tmp_path / "events"
    d.mkdir()
    docs = [{"k": f"ev.{i}", "n": i, "tags": ["a", "b"][: i % 3], "note": None if i % 2 else "x"}
            for i in range(90)]
    for part in range(3):  # a directory of JSON-lines files, as Spark itself writes them
        (d / f"part-{part}.json").write_text("".join(json.dumps(doc) + "\n" for doc in docs[part::3]))
    code, out, err = load(capsys, str(d), "--nats", nats_server.url, "--bucket", "events", "--key", "k")
    assert code == 0, out + err
    data, _ = contents(nats_server.url, "events")
    assert len(data) == 90
    for doc in docs:  # no --value/--json: the whole row, nulls kept
        assert json.loads(data[doc["k"]]) == doc


def test_format_flag_overrides_the_extension(spark, nats_server, tmp_path, capsys):
    path = tmp_path / "data.txt"
    path.write_text("key\tvalue\nplain.1\tone\nplain.2\ttwo\n")
    code, out, err = load(capsys, str(path), "--nats", nats_server.url, "--bucket", "plain",
                          "--key", "key", "--value", "value", "--format", "csv", "--delimiter", "\t")
    assert code == 0, out + err
    assert contents(nats_server.url, "plain")[0] == {"plain.1": b"one", "plain.2": b"two"}


def test_bucket_and_run_flags(spark, nats_server, tmp_path, capsys):
    """--ttl and --replicas shape the new bucket, --partitions the write, --summary-json
    writes the summary; --infer-schema types CSV columns; --multiline reads JSON documents
    that span lines."""
    path = tmp_path / "n.csv"
    path.write_text("k,n\nnum.1,007\nnum.2,10\n")
    summary = tmp_path / "summary.json"
    code, out, err = load(capsys, str(path), "--nats", nats_server.url, "--bucket", "nums",
                          "--key", "k", "--json", "n", "--infer-schema", "--ttl", "60",
                          "--replicas", "1", "--partitions", "3", "--summary-json", str(summary))
    assert code == 0, out + err
    data, info = contents(nats_server.url, "nums")
    assert {k: json.loads(v) for k, v in data.items()} == {"num.1": {"n": 7}, "num.2": {"n": 10}}
    assert info["config"]["max_age"] == 60 * 10**9 and info["config"]["num_replicas"] == 1
    written = json.loads(summary.read_text())
    assert (written["bucket"], written["rows"], written["written"], written["partitions"]) == ("nums", 2, 2, 3)

    doc = tmp_path / "docs.json"
    doc.write_text('[\n {"k": "doc.1",\n  "v": "one"},\n {"k": "doc.2", "v": "two"}\n]\n')
    code, out, err = load(capsys, str(doc), "--nats", nats_server.url, "--bucket", "docs",
                          "--key", "k", "--value", "v", "--multiline")
    assert code == 0, out + err
    assert contents(nats_server.url, "docs")[0] == {"doc.1": b"one", "doc.2": b"two"}


# ---------------------------------------------------------------------------- invalid keys


def test_invalid_keys_are_counted_with_examples_and_fail_the_run(spark, nats_server, tmp_path, capsys):
    keys = ["ok.1", "bad key", "a..b", "_kv.reserved", None, "ok.2", ".lead", "wild.*", "ok.3"]
    path = tmp_path / "mixed.parquet"
    pq.write_table(pa.table({"key": pa.array(keys, pa.string()),
                             "v": pa.array([f"v{i}" for i in range(len(keys))])}), path)
    args = [str(path), "--nats", nats_server.url, "--bucket", "mixed", "--key", "key", "--value", "v"]
    code, out, _err = load(capsys, *args)
    assert code == 1
    assert summary_of(out) == {"read": 9, "written": 3, "invalid": 6, "failed": 0, "retries": 0,
                                "disconnects": 0}
    assert "'bad key'" in out and "'_kv.reserved': reserved prefix _kv" in out and "None: null key" in out
    assert contents(nats_server.url, "mixed")[0] == {"ok.1": b"v0", "ok.2": b"v5", "ok.3": b"v8"}
    code, out, _ = load(capsys, *args, "--skip-invalid")  # still reported, no longer fatal
    assert code == 0 and summary_of(out)["invalid"] == 6


# ---------------------------------------------------------------------------- reruns, restarts


def test_rerun_is_idempotent(spark, nats_server, tmp_path, capsys):
    path = tmp_path / "ref.parquet"
    pq.write_table(pa.table({"code": [f"ref.{i}" for i in range(500)],
                             "label": [f"label {i}" for i in range(500)]}), path)
    args = [str(path), "--nats", nats_server.url, "--bucket", "ref", "--key", "code", "--value", "label"]
    assert load(capsys, *args)[0] == 0
    first, info1 = contents(nats_server.url, "ref")
    code, out, err = load(capsys, *args)
    assert code == 0 and "created bucket" not in err
    assert summary_of(out)["written"] == 500
    second, info2 = contents(nats_server.url, "ref")
    assert second == first and len(second) == 500
    assert info2["state"]["messages"] == info1["state"]["messages"] == 500  # history 1: no growth


def test_server_restart_mid_load_loses_nothing(spark, nats_server, tmp_path, capsys):
    rows = 40_000
    path = tmp_path / "big.parquet"
    pq.write_table(pa.table({"k": [f"big.{i % 97}.{i}" for i in range(rows)],
                             "v": [f"value-{i}" for i in range(rows)]}), path)
    result: dict[str, object] = {}

    def run() -> None:
        # a small window keeps the load going long enough to be interrupted
        result["code"] = cli.main(["load", str(path), "--nats", nats_server.url, "--bucket", "big",
                                   "--key", "k", "--value", "v", "--max-inflight", "32",
                                   "--ack-timeout", "2", "--retries", "30", "--progress", "1"])

    def stored() -> int:
        try:
            return contents_seq(nats_server.url, "big")
        except Exception:
            return 0

    t = threading.Thread(target=run)
    t.start()
    try:
        wait_until(lambda: stored() >= 2000, 120, "the load to be under way")
        nats_server.stop()  # mid-load: partitions lose their connections and acks
        nats_server.start()
    finally:
        t.join(300)
    out = capsys.readouterr()
    assert not t.is_alive()
    assert result["code"] == 0, out.out + out.err
    s = summary_of(out.out)
    assert s["written"] == rows and s["failed"] == 0
    assert s["disconnects"] >= 1  # the restart happened while partitions were writing
    data, _ = contents(nats_server.url, "big")
    assert len(data) == rows
    assert all(data[f"big.{i % 97}.{i}"] == f"value-{i}".encode() for i in range(rows))


def contents_seq(url: str, bucket: str) -> int:
    async def go() -> int:
        nc = await nats.connect(url, allow_reconnect=False, connect_timeout=1)
        try:
            return (await jsapi.stream_info(nc, f"KV_{bucket}", 2))["state"]["last_seq"]
        finally:
            await nc.close()
    return asyncio.run(go())


# ---------------------------------------------------------------------------- errors


def test_usage_and_input_errors_exit_2_with_one_line(tmp_path, nats_server):
    data = tmp_path / "d.parquet"
    pq.write_table(pa.table({"k": ["a"]}), data)
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (["load", str(tmp_path / "nope.parquet"), "--nats", nats_server.url, "--bucket", "b", "--key", "k"],
         "input not found"),
        (["load", str(data), "--nats", nats_server.url, "--bucket", "no.dots", "--key", "k"], "invalid bucket name"),
        (["load", str(data), "--nats", nats_server.url, "--bucket", "b"], "--key"),
        (["load", str(data), "--nats", nats_server.url, "--bucket", "b", "--key", "k", "--value", "v",
          "--json", "a"], "not allowed with"),
        (["load", str(data), "--nats", nats_server.url, "--bucket", "b", "--key", "{}"], "plain {column}"),
        (["load", str(empty), "--nats", nats_server.url, "--bucket", "b", "--key", "k"], "--format"),
    ]
    for argv, message in cases:
        p = run_cli(*argv)
        assert p.returncode == 2, (argv, p.stderr)
        assert message in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert "Traceback" not in p.stderr


@pytest.mark.servers  # starts a process
def test_unreachable_nats_exits_1_before_spark(tmp_path):
    from kvcache.natsio.nats_server import free_port

    data = tmp_path / "d.parquet"
    pq.write_table(pa.table({"k": ["a"]}), data)
    p = run_cli("load", str(data), "--nats", f"nats://127.0.0.1:{free_port()}", "--bucket", "b", "--key", "k")
    assert p.returncode == 1
    assert "cannot connect to NATS" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_unknown_column_exits_2(spark, nats_server, tmp_path, capsys):
    data = tmp_path / "d.parquet"
    pq.write_table(pa.table({"k": ["a"], "v": ["1"]}), data)
    code, _, err = load(capsys, str(data), "--nats", nats_server.url, "--bucket", "b", "--key", "{k}.{zone}")
    assert code == 2
    assert "no column 'zone' in the input (columns: k, v)" in err


# ---------------------------------------------------------------------------- cluster form


def test_spark_submit_with_the_bundle(nats_server, tmp_path):
    """The README's cluster form, on a local master: the zip on --py-files, the submit script."""
    from kvcache.pipeline import bundle

    zpath, spath = bundle.build(str(tmp_path / "dist"))
    import zipfile
    names = zipfile.ZipFile(zpath).namelist()
    assert "kvcache/pipeline/writer.py" in names and "nats/aio/client.py" in names
    assert not any(n.endswith(".so") for n in names)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"id": i, "v": f"x{i}"}) + "\n" for i in range(50)))
    spark_submit = Path(sys.executable).with_name("spark-submit")
    p = subprocess.run([str(spark_submit), "--master", "local[2]", "--py-files", zpath, spath, "load",
                        str(data), "--nats", nats_server.url, "--bucket", "submitted", "--key", "item.{id}",
                        "--value", "v", "--progress", "0"], capture_output=True, text=True, timeout=300,
                       # the bundle is pure Python by design: its twins are the point here
                       env={**os.environ, "PYSPARK_PYTHON": sys.executable, "KVCACHE_REQUIRE_EXTENSIONS": "0"})
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    assert "50 rows read, 50 written" in p.stdout
    assert contents(nats_server.url, "submitted")[0] == {f"item.{i}": f"x{i}".encode() for i in range(50)}


# ---------------------------------------------------------------------------- empty values


async def _kv_get_all(url: str, bucket: str, keys: list[str]) -> dict[str, bytes]:
    """Each key's value as nats-py's KV API reads it back: a put (a delete or purge raises
    KeyDeletedError), whose empty value nats-py's Direct Get gives as None."""
    nc = await nats.connect(url)
    try:
        kv = await nc.jetstream().key_value(bucket)
        out = {}
        for k in keys:
            entry = await kv.get(k)
            out[k] = b"" if entry.value is None else entry.value
        return out
    finally:
        await nc.close()


def test_empty_csv_fields_load_as_empty_values_with_empty_values_put(spark, nats_server, tmp_path, capsys):
    """NATS KV values may be empty; Spark reads an empty CSV field, quoted or not, as null.
    By default such a row is invalid (as before); `--empty-values put` writes a zero-length
    value, read back byte for byte by nats-py, and "" inside --json values."""
    path = tmp_path / "empties.csv"
    path.write_bytes(b'k,v,n\r\nempty.bare,,1\r\nempty.quoted,"",2\r\nfull.1,x,3\r\nfull.2," ",4\r\n')
    args = [str(path), "--nats", nats_server.url, "--key", "k"]

    code, out, _ = load(capsys, *args, "--bucket", "nulls", "--value", "v")
    assert code == 1, out
    assert summary_of(out) == {"read": 4, "written": 2, "invalid": 2, "failed": 0, "retries": 0,
                                "disconnects": 0}
    assert "'empty.bare': null value" in out and "'empty.quoted': null value" in out

    code, out, err = load(capsys, *args, "--bucket", "empties", "--value", "v", "--empty-values", "put")
    assert code == 0, out + err
    assert summary_of(out) == {"read": 4, "written": 4, "invalid": 0, "failed": 0, "retries": 0,
                                "disconnects": 0}
    want = {"empty.bare": b"", "empty.quoted": b"", "full.1": b"x", "full.2": b" "}
    assert contents(nats_server.url, "empties")[0] == want
    assert asyncio.run(_kv_get_all(nats_server.url, "empties", list(want))) == want

    code, out, err = load(capsys, *args, "--bucket", "emptyjson", "--json", "v,n", "--empty-values", "put")
    assert code == 0, out + err
    assert json.loads(contents(nats_server.url, "emptyjson")[0]["empty.bare"]) == {"v": "", "n": "1"}


def test_empty_values_put_is_refused_for_other_formats(tmp_path, nats_server):
    data = tmp_path / "d.parquet"
    pq.write_table(pa.table({"k": ["a"], "v": [""]}), data)
    p = run_cli("load", str(data), "--nats", nats_server.url, "--bucket", "b", "--key", "k", "--value", "v",
                "--empty-values", "put")
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "--empty-values put is for CSV input, and this input is parquet" in lines[0], p.stderr


# ---------------------------------------------------------------------------- progress

# Runs `kvcache load` in a process of its own (a JVM of its own, as a user's run) with stderr
# wrapped: each line is recorded with whether Spark was running when it was written and how
# many Spark jobs had been started, so the order of the lines and Spark's work is seen directly.
PROGRESS_HARNESS = r"""
import json, sys
from kvcache import cli

class Recorder:
    def __init__(self, inner):
        self.inner, self.lines = inner, []
    def write(self, text):
        from pyspark import SparkContext
        sc = SparkContext._active_spark_context
        for line in text.splitlines():
            if line.startswith("kvcache load:"):
                jobs = len(sc.statusTracker().getJobIdsForGroup()) if sc is not None else None
                self.lines.append({"line": line, "spark": sc is not None, "jobs": jobs})
        return self.inner.write(text)
    def flush(self):
        self.inner.flush()

rec = sys.stderr = Recorder(sys.stderr)
code = cli.main(sys.argv[2:])
with open(sys.argv[1], "w") as f:
    json.dump({"code": code, "lines": rec.lines}, f)
"""


def test_progress_speaks_before_spark_starts(nats_server, tmp_path):
    """The first progress line comes before Spark starts (before the seconds a JVM takes), the
    read is announced before Spark runs any job for it, the write before the write's job; and
    the run leaves no kvcache-spark-* directory (its log4j file) in its temp directory."""
    data = tmp_path / "p.csv"
    data.write_text("k,v\n" + "".join(f"p.{i},v{i}\n" for i in range(200)))
    record = tmp_path / "lines.json"
    temp = tmp_path / "tmp"  # the run's temp directory: it must leave nothing of its own there
    temp.mkdir()
    p = subprocess.run([sys.executable, "-c", PROGRESS_HARNESS, str(record), "load", str(data),
                        "--nats", nats_server.url, "--bucket", "prog", "--key", "k", "--value", "v",
                        "--master", "local[1]", "--progress", "30"],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYSPARK_PYTHON": sys.executable, "TMPDIR": str(temp)})
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    assert not list(temp.glob("kvcache-spark-*")), sorted(x.name for x in temp.iterdir())
    assert "StatusLogger" not in p.stderr, p.stderr  # log4j had its configuration (read before it went)
    got = json.loads(record.read_text())
    assert got["code"] == 0
    lines = got["lines"]
    texts = [x["line"] for x in lines]
    assert texts[:4] == [
        "kvcache load: created bucket 'prog' (history 1, replicas 1, ttl 0s, allow_direct)",
        "kvcache load: starting Spark (master local[1])...",
        f"kvcache load: reading {data} as csv...",
        "kvcache load: writing into bucket 'prog' over 1 partition...",
    ], texts
    assert [x["spark"] for x in lines[:3]] == [False, False, True]  # the first two before the JVM
    assert lines[2]["jobs"] == 0  # the read announced before Spark read anything
    assert "200 rows read, 200 written" in p.stdout
    # Spark's own start-up chatter, if any, comes after the line saying it is starting
    ours = p.stderr.index("kvcache load: starting Spark")
    for spark_says in ("Setting default log level", "Using incubator modules"):
        if spark_says in p.stderr:
            assert p.stderr.index(spark_says) > ours, p.stderr
