"""`kvcache hotkeys` on synthetic access logs with a known answer: top keys, remote ratios,
latency percentiles by source, the covering key filters, and the output files."""
from __future__ import annotations

import csv
from pathlib import Path

import matplotlib
import pyarrow.parquet as pq
import pytest
from support.sidecar_proc import run_cli

from kvcache import cli
from kvcache.keys import valid_filter as valid_key_filter
from kvcache.ops.accesslog import AccessLog
from kvcache.pipeline.cover import Filter, cover_filters, group_of
from kvcache.pipeline.hotkeys import Report, chart_figure

# Loaded here, at collection: on a machine where matplotlib has no font cache yet, its first
# load runs fc-list, a process, which the quick tier's tests may not start.
matplotlib.use("Agg")
import matplotlib.pyplot as plt

# ---------------------------------------------------------------------------- the algorithm

# bucket reads by group: 1000 in all
GROUPS = {
    "user.eu.*": (600.0, 100),
    "user.us.*": (300.0, 50),
    "session.*": (80.0, 10),
    "motd": (10.0, 1),
    "user.asia.*": (10.0, 10),
}


def names(fs: list[Filter]) -> list[str]:
    return [f.filter for f in fs]


def test_groups_are_parents():
    assert [group_of(k) for k in ("user.eu.7", "motd", "a.b")] == ["user.eu.*", "motd", "a.*"]


def test_cover_known_answers():
    assert names(cover_filters(GROUPS, 0.9)) == ["user.eu.>", "user.us.>"]
    assert names(cover_filters(GROUPS, 0.6)) == ["user.eu.>"]
    # a tie on reads takes the group with fewer keys (motd before user.asia.*)
    assert names(cover_filters(GROUPS, 0.99)) == ["user.eu.>", "user.us.>", "session.>", "motd"]
    assert cover_filters(GROUPS, 1.0) == [Filter(">", 1000.0, 171)]
    for cover in (0.5, 0.9, 0.99, 1.0):
        fs = cover_filters(GROUPS, cover)
        assert all(valid_key_filter(f.filter) for f in fs)
        assert sum(f.reads for f in fs) >= cover * 1000


def test_cover_merges_siblings_but_not_over_cold_keys():
    groups = {"a.b.*": (50.0, 5), "a.c.*": (40.0, 5), "z.*": (10.0, 5)}
    assert names(cover_filters(groups, 0.9)) == ["a.>"]  # every group under a. is hot
    deeper = {"a.b.*": (90.0, 5), "a.b.c.*": (5.0, 5), "z.*": (5.0, 5)}
    assert names(cover_filters(deeper, 0.9)) == ["a.b.*"]  # a.b.> would take in cold a.b.c.*
    assert cover_filters({}, 0.9) == []


# ---------------------------------------------------------------------------- the Spark job


def write_logs(base: Path) -> list[str]:
    """Two sidecars' logs, written by the sidecar's own AccessLog. Sidecar A samples every read:
    bucket cfg as GROUPS above (user.us.* and half of motd remote through `west`, user.asia.*
    misses at the leader with latencies 1..10 ms). Sidecar B samples half: 50 lines of
    other:x.1 stand for 100 reads."""
    a = AccessLog(str(base / "a"), 1.0, max_bytes=20_000, files=20)  # rotates: read them all
    for i in range(100):
        for _ in range(6):
            a.record("cfg", f"user.eu.{i}", "local", True, 10)
    for i in range(50):
        for _ in range(6):
            a.record("cfg", f"user.us.{i}", "west", True, 300)
    for i in range(10):
        for _ in range(8):
            a.record("cfg", f"session.{i}", "local", True, 10)
        a.record("cfg", f"user.asia.{i}", "leader", False, (i + 1) * 1000)
    for i in range(10):
        a.record("cfg", "motd", "west" if i % 2 else "local", True, 300 if i % 2 else 10)
    for i in range(20):  # a bucket served by its near cache: a read from NATS, then two hits
        a.record("big", f"p.{i}", "leader", True, 2000)
        a.record("big", f"p.{i}", "cache", True, 30)
        a.record("big", f"p.{i}", "cache", True, 30)
    a.close()
    b = AccessLog(str(base / "b"), 0.5)
    for _ in range(50):
        b.record("other", "x.1", "local", True, 10)
    b.close()
    return [str(base / "a"), str(base / "b")]


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_hotkeys_on_synthetic_logs(spark, tmp_path, capsys):
    dirs = write_logs(tmp_path / "logs")
    assert len(list((tmp_path / "logs" / "a").glob("access.log*"))) > 1  # rotated files count too
    out_dir = tmp_path / "report"
    code = cli.main(["hotkeys", *dirs, "--top", "3", "--cover", "0.9", "--out", str(out_dir)])
    out = capsys.readouterr().out
    assert code == 0
    assert "1,110 sampled reads, about 1,160 reads in all" in out
    assert 'name = "cfg"\nkeys = ["user.eu.>", "user.us.>"]  # 90.0% of reads' in out
    assert 'name = "other"\nkeys = [">"]  # 100.0% of reads' in out

    top = read_csv(out_dir / "top_keys.csv")
    assert [(r["bucket"], r["key"], r["reads"]) for r in top] == [
        ("other", "x.1", "100"), ("cfg", "motd", "10"), ("cfg", "session.0", "8")]
    assert [float(r["remote_ratio"]) for r in top] == [0.0, 0.5, 0.0]

    peers = {r["source"]: r for r in read_csv(out_dir / "peers.csv")}
    assert set(peers) == {"local", "cache", "west", "leader"}
    assert peers["cache"]["p50_us"] == "30"
    assert peers["west"]["p50_us"] == "300" and peers["local"]["p99_us"] == "10"
    assert int(peers["west"]["sampled"]) == 305

    filters = read_csv(out_dir / "filters.csv")
    assert [(r["bucket"], r["filter"], r["cumulative"]) for r in filters if r["bucket"] != "big"] == [
        ("cfg", "user.eu.>", "0.6"), ("cfg", "user.us.>", "0.9"), ("other", ">", "1.0")]
    assert (out_dir / "filters.toml").read_text().count("[[bucket]]") == 3
    served = {r["bucket"]: r for r in read_csv(out_dir / "buckets.csv")}
    assert (served["big"]["cache"], served["big"]["remote"], served["big"]["cache_hit_ratio"]) == (
        "0.6667", "0.3333", "0.6667")
    assert served["big"]["filters_would_cover"] == "1.0"  # p.> covers it all
    assert (served["cfg"]["local"], served["cfg"]["cache_hit_ratio"]) == ("0.685", "")  # 685 of 1000
    assert "how each bucket's reads were served" in out
    png = (out_dir / "hotkeys.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000

    code = cli.main(["hotkeys", *dirs, "--cover", "0.99", "--out", str(tmp_path / "pq"),
                     "--out-format", "parquet"])
    capsys.readouterr()
    assert code == 0
    table = pq.read_table(tmp_path / "pq" / "filters.parquet").to_pylist()
    assert [r["filter"] for r in table if r["bucket"] == "cfg"] == ["user.eu.>", "user.us.>", "session.>", "motd"]


@pytest.mark.servers  # starts a process
def test_hotkeys_bad_input_exits_2(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for argv, message in (
        (["hotkeys", str(tmp_path / "nope")], "log directory not found"),
        (["hotkeys", str(empty)], "no access logs"),
        (["hotkeys", str(empty), "--cover", "1.5"], "--cover must be within 0 and 1"),
        (["hotkeys", str(empty), "--top", "0"], "--top must be positive"),
    ):
        p = run_cli(*argv)
        assert p.returncode == 2 and message in p.stderr, (argv, p.stderr)
        assert len(p.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------------------- the chart


def _report(p50s: list[int]) -> Report:
    peers = [{"source": f"s{i}", "sampled": 10, "p50_us": p, "p90_us": p * 3, "p99_us": p * 30, "mean_us": p * 2.0}
             for i, p in enumerate(p50s)]
    return Report(lines=10, reads=10.0, top=[], peers=peers, filters={}, bucket_reads={}, cover=0.9)


@pytest.mark.parametrize(("p50s", "bottom"), [([12, 300, 2000], 10.0), ([10, 40], 1.0), ([0, 7], 0.1),
                                              ([1500], 1000.0)])
def test_latency_axis_starts_below_the_smallest_p50(p50s, bottom):
    """The log axis of "read latency by source" starts at the power of ten below the lowest
    p50 (a p50 of 0 is drawn as 1 µs), so every bar, the shortest too, shows a height."""
    fig = chart_figure(_report(p50s))
    try:
        ax = fig.axes[2]
        assert ax.get_yscale() == "log"
        low, _ = ax.get_ylim()
        shortest = min(bar.get_height() for bar in ax.patches)
        assert low == pytest.approx(bottom) and low < shortest
    finally:
        plt.close(fig)
