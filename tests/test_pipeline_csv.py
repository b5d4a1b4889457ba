"""`kvcache load` reads CSV as RFC 4180 and JSON lines as common tools write them: every value
read back from NATS KV is byte for byte what the writer (Python's csv and json modules, pandas)
was given, on local Spark and on a standalone cluster; rows it cannot read are counted as
invalid and never written.
"""
from __future__ import annotations

import csv
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
from test_pipeline_load import contents, load, summary_of

from kvcache.pipeline.spark import record_end

# What CSV and JSON writers must get through intact: quotes (doubled in CSV), separators,
# line breaks of every kind inside a field, backslashes (Spark's default escape), non-ASCII.
TRICKY = ['{"qty":0}', 'say "hi"', '"', '""', 'a,b', 'tab\there', 'line1\nline2', 'crlf\r\nin',
          'cr\ronly', 'ends with newline\n', ' lead and trail ', "it's", 'back\\slash', 'back\\"q',
          '\\', 'trail\\', '#not a comment', 'ü', '日本', '😀 emoji', 'mixed ü,"日本"\r\n😀',
          'sep\u2028line', 'null', 'NaN', 'x' * 3000]


def values(tag: str, n: int = 60) -> dict[str, str]:
    """n keys `<tag>.<i>` and their values: every TRICKY one, each made unique."""
    return {f"{tag}.{i}": f"{TRICKY[i % len(TRICKY)]}|{i}" for i in range(n)}


def write_csv(path: Path, rows: dict[str, str], encoding: str = "utf-8", **fmt: object) -> None:
    with open(path, "w", newline="", encoding=encoding) as f:
        w = csv.writer(f, **fmt)  # type: ignore[arg-type]
        w.writerow(["k", "v", "n"])
        w.writerows([k, v, str(i)] for i, (k, v) in enumerate(rows.items()))


def write_pandas(path: Path, rows: dict[str, str], **kw: object) -> None:
    frame = pd.DataFrame({"k": list(rows), "v": list(rows.values()), "n": [str(i) for i in range(len(rows))]})
    frame.to_csv(path, index=False, **kw)  # type: ignore[call-overload]


def csv_inputs(d: Path) -> tuple[list[str], dict[str, str]]:
    """One file per common writer and dialect; keys tagged by file."""
    files: dict[str, tuple[str, dict[str, str]]] = {}

    def add(name: str) -> tuple[Path, dict[str, str]]:
        rows = values(name.replace("-", "_"))
        files[name] = (str(d / f"{name}.csv"), rows)
        return d / f"{name}.csv", rows

    write_csv(*add("py-crlf"))  # the csv module's default: CRLF, minimal quoting
    write_csv(*add("py-lf"), lineterminator="\n")
    write_csv(*add("py-all-quoted"), quoting=csv.QUOTE_ALL)
    write_csv(*add("py-bom"), encoding="utf-8-sig")  # what Excel writes as "CSV UTF-8"
    write_pandas(*add("pandas-lf"))
    write_pandas(*add("pandas-crlf"), lineterminator="\r\n")
    write_pandas(*add("pandas-bom"), encoding="utf-8-sig")
    expected = {k: v for _, rows in files.values() for k, v in rows.items()}
    return [p for p, _ in files.values()], expected


def test_record_end_skips_quoted_line_breaks():
    assert record_end(b'k,v\r\nx,y\r\n') == "\r\n"
    assert record_end(b'k,v\nx,"a\r\nb"\r\n') == "\n"
    assert record_end(b'"a\r\nb","c""\n"\r\nx') == "\r\n"  # breaks inside quotes, doubled quotes
    assert record_end(b'k,v\rx,y\r') == "\r"
    assert record_end(b'"k\nstill quoted') is None
    assert record_end(b'') is None


# ---------------------------------------------------------------------------- local[2]


def test_csv_from_python_and_pandas_round_trips_byte_for_byte(spark, nats_server, tmp_path, capsys):
    inputs, expected = csv_inputs(tmp_path)
    code, out, err = load(capsys, *inputs, "--nats", nats_server.url, "--bucket", "rfc",
                          "--key", "k", "--value", "v")
    assert code == 0, out + err
    n = len(expected)
    assert summary_of(out) == {"read": n, "written": n, "invalid": 0, "failed": 0, "retries": 0,
                                "disconnects": 0}
    data, _ = contents(nats_server.url, "rfc")
    assert data == {k: v.encode() for k, v in expected.items()}


def test_csv_whole_row_json_and_tsv(spark, nats_server, tmp_path, capsys):
    """--json builds the document from the decoded fields (the BOM is not part of `k`); a TSV
    (tab separated, quoted the same way) reads the same."""
    rows = values("doc", 40)
    write_csv(tmp_path / "bom.csv", rows, encoding="utf-8-sig")
    code, out, err = load(capsys, str(tmp_path / "bom.csv"), "--nats", nats_server.url, "--bucket", "docs",
                          "--key", "k")
    assert code == 0, out + err
    data, _ = contents(nats_server.url, "docs")
    assert {k: json.loads(v) for k, v in data.items()} == {
        k: {"k": k, "v": v, "n": str(i)} for i, (k, v) in enumerate(rows.items())}

    tsv = values("tsv", 40)
    write_csv(tmp_path / "py.tsv", tsv, delimiter="\t")
    write_pandas(tmp_path / "pd.tsv", values("pdtsv", 40), sep="\t")
    code, out, err = load(capsys, str(tmp_path / "py.tsv"), str(tmp_path / "pd.tsv"), "--nats", nats_server.url,
                          "--bucket", "tsv", "--key", "k", "--value", "v")
    assert code == 0, out + err
    assert contents(nats_server.url, "tsv")[0] == {k: v.encode() for k, v in {**tsv, **values("pdtsv", 40)}.items()}


def test_json_lines_from_pandas_and_json_dumps(spark, nats_server, tmp_path, capsys):
    a, b, c = values("pd", 50), values("ascii", 50), values("utf8", 50)
    pd.DataFrame({"k": list(a), "v": list(a.values())}).to_json(tmp_path / "pandas.jsonl", orient="records",
                                                                   lines=True)
    (tmp_path / "ascii.jsonl").write_text("".join(json.dumps({"k": k, "v": v}) + "\n" for k, v in b.items()))
    (tmp_path / "utf8.jsonl").write_text(
        "".join(json.dumps({"k": k, "v": v}, ensure_ascii=False) + "\n" for k, v in c.items()), encoding="utf-8")
    assert "\\u00fc" in (tmp_path / "pandas.jsonl").read_text() and "ü" in (tmp_path / "utf8.jsonl").read_text()
    code, out, err = load(capsys, *(str(tmp_path / f) for f in ("pandas.jsonl", "ascii.jsonl", "utf8.jsonl")),
                          "--nats", nats_server.url, "--bucket", "jl", "--key", "k", "--value", "v")
    assert code == 0, out + err
    assert contents(nats_server.url, "jl")[0] == {k: v.encode() for k, v in {**a, **b, **c}.items()}


# ---------------------------------------------------------------------------- unreadable rows


def test_malformed_csv_rows_are_counted_and_never_written(spark, nats_server, tmp_path, capsys):
    good = {f"ok.{i}": f'fine "{i}", ü' for i in range(6)}
    body = io_csv([["k", "v", "w"], *([k, v, "w"] for k, v in list(good.items())[:3])])
    body += 'bad.many,too,many,fields\r\n'  # a field too many
    body += 'bad.few,few\r\n'  # a field too few
    body += io_csv([[k, v, "w"] for k, v in list(good.items())[3:]])
    body += 'bad.open,"never closed,w\r\n'  # an unterminated quote: runs to the end of the file
    path = tmp_path / "broken.csv"
    path.write_bytes(body.encode())
    args = [str(path), "--nats", nats_server.url, "--bucket", "broken", "--key", "k", "--value", "v"]
    code, out, err = load(capsys, *args)
    assert code == 1, out + err
    assert summary_of(out) == {"read": 9, "written": 6, "invalid": 3, "failed": 0, "retries": 0,
                                "disconnects": 0}
    assert "unreadable input row 'bad.many,too,many,fields'" in out and "'bad.few,few'" in out
    assert "bad.open" in out
    assert contents(nats_server.url, "broken")[0] == {k: v.encode() for k, v in good.items()}
    code, out, _ = load(capsys, *args, "--skip-invalid")  # reported, no longer fatal
    assert code == 0 and summary_of(out)["invalid"] == 3


def test_malformed_json_lines_are_counted_and_never_written(spark, nats_server, tmp_path, capsys):
    good = {f"ok.{i}": f"v{i} ü" for i in range(4)}
    lines = [json.dumps({"k": k, "v": v}) for k, v in good.items()]
    lines[2:2] = ['{"k": "bad.cut", "v": ', '42', '{"k": "bad.trailing", "v": "x"} junk']
    path = tmp_path / "broken.jsonl"
    path.write_text("\n".join(lines) + "\n")
    code, out, err = load(capsys, str(path), "--nats", nats_server.url, "--bucket", "brokenjl",
                          "--key", "k", "--value", "v")
    assert code == 1, out + err
    assert summary_of(out) == {"read": 7, "written": 4, "invalid": 3, "failed": 0, "retries": 0,
                                "disconnects": 0}
    assert "unreadable input row '{\"k\": \"bad.cut\", \"v\": '" in out
    assert contents(nats_server.url, "brokenjl")[0] == {k: v.encode() for k, v in good.items()}


def test_a_stray_quote_in_a_quoted_field_stops_the_load(spark, nats_server, tmp_path, capsys):
    """RFC 4180 has no reading for `"ab"cd`: Spark would keep the quotes; kvcache refuses."""
    path = tmp_path / "stray.csv"
    path.write_text('k,v\nok.1,one\nbad.1,"ab"cd\n')
    code, _, err = load(capsys, str(path), "--nats", nats_server.url, "--bucket", "stray",
                          "--key", "k", "--value", "v")
    assert code == 1
    assert "stray.csv" in err and "Unescaped quote character" in err, err
    assert len(err.strip().splitlines()) == 2, err  # created bucket, then the one error line


def io_csv(rows: list[list[str]]) -> str:
    import io
    buf = io.StringIO()
    csv.writer(buf).writerows(rows)
    return buf.getvalue()


# ---------------------------------------------------------------------------- standalone cluster


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def standalone(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """A Spark standalone cluster: one master and one worker (2 cores), both on 127.0.0.1,
    started from pyspark's own `bin/spark-class`, stopped by PID. Yields the master URL and
    the worker's directory (where each application's executors keep their logs)."""
    import pyspark

    home = Path(pyspark.__file__).parent
    work = tmp_path_factory.mktemp("spark-standalone")
    port, ui = _free_port(), _free_port()
    env = {**os.environ, "SPARK_HOME": str(home), "SPARK_LOCAL_IP": "127.0.0.1",
           "PYSPARK_PYTHON": sys.executable, "SPARK_LOG_DIR": str(work), "SPARK_WORKER_DIR": str(work / "w")}
    spark_class = str(home / "bin" / "spark-class")
    procs: list[subprocess.Popen] = []
    try:
        for name, argv in (
            ("master", ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port),
                        "--webui-port", str(ui)]),
            ("worker", ["org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1", "--port",
                        str(_free_port()), "--webui-port", str(_free_port()), "--cores", "2", "--memory",
                        "1g", "--work-dir", str(work / "w"), f"spark://127.0.0.1:{port}"]),
        ):
            log = open(work / f"{name}.log", "w")
            procs.append(subprocess.Popen([spark_class, *argv], env=env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 120
        while True:  # the master's JSON status: one ALIVE worker
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{ui}/json/", timeout=2) as r:
                    if any(w.get("state") == "ALIVE" for w in json.load(r).get("workers", [])):
                        break
            except OSError:
                pass
            for p in procs:
                assert p.poll() is None, "".join((work / f"{n}.log").read_text()[-2000:] for n in ("master", "worker"))
            assert time.monotonic() < deadline, "the standalone worker did not register"
            time.sleep(0.5)
        yield f"spark://127.0.0.1:{port}", work / "w"
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)


@pytest.mark.servers  # starts a Spark master and worker
def test_csv_round_trips_on_a_standalone_cluster(standalone, nats_server, tmp_path):
    """The same files through a driver of its own (`python -m kvcache load --master
    spark://...`), executors on a standalone worker: every byte arrives as written, a bad row
    is counted and not written."""
    master, worker_dir = standalone
    inputs, expected = csv_inputs(tmp_path)
    bad = {f"cl.{i}": f'"{i}",\r\n日本' for i in range(3)}
    (tmp_path / "cl.csv").write_text(io_csv([["k", "v", "n"], *([k, v, "0"] for k, v in bad.items())])
                                     + "cl.bad,only two\r\n", encoding="utf-8")
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable}
    p = subprocess.run([sys.executable, "-m", "kvcache", "load", *inputs, str(tmp_path / "cl.csv"),
                        "--master", master, "--nats", nats_server.url, "--bucket", "cluster",
                        "--key", "k", "--value", "v", "--progress", "0"],
                       capture_output=True, text=True, timeout=600, env=env)
    n = len(expected) + len(bad) + 1
    assert p.returncode == 1, p.stdout + p.stderr[-3000:]
    assert summary_of(p.stdout) == {"read": n, "written": n - 1, "invalid": 1, "failed": 0, "retries": 0,
                                    "disconnects": 0}, p.stdout
    assert "'cl.bad,only two'" in p.stdout
    assert contents(nats_server.url, "cluster")[0] == {k: v.encode() for k, v in {**expected, **bad}.items()}
    assert list(worker_dir.glob("app-*/*/stderr")), "no executor ran on the standalone worker"
