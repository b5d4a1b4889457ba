"""`kvcache hotkeys`: a Spark job over the access logs of many sidecars.

It reports the most read keys (with the share of their reads that went remote and missed),
latency percentiles per source (`local`, `cache`, each peer, `leader`), per bucket the key
filters that cover `--cover` of the reads (see `cover`), and per bucket how its reads were
served: from the replica, from the near cache (with the hit ratio the cache reached on the
keys outside the filters), from NATS, next to the share the proposed filters would keep local;
so an operator sees which of the two serves a bucket better. As a table on the terminal and,
under `--out`, CSV or Parquet files, a `filters.toml` to paste and a PNG chart.

Each log line counts as 1/rate reads (its sampling rate), so sidecars sampling at different
rates add up to an estimate of the real read counts.
"""
from __future__ import annotations

import argparse
import csv
import glob
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from ..errors import ConfigError, UpstreamError
from ..ops.accesslog import FIELDS, FILE_NAME
from . import spark as sparkio
from .cover import Filter, cover_filters

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

_TYPES = {"ts_ms": "long", "hit": "int", "latency_us": "long", "rate": "double"}
LOG_SCHEMA = ", ".join(f"{name} {_TYPES.get(name, 'string')}" for name in FIELDS)
PERCENTILES = (0.5, 0.9, 0.99)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("logdirs", nargs="+", metavar="LOGDIR",
                   help="access-log directories (or files) from one or many sidecars")
    p.add_argument("--top", type=int, default=20, metavar="N", help="keys to list (default 20)")
    p.add_argument("--cover", type=float, default=0.9, metavar="SHARE",
                   help="share of reads the key filters must cover (default 0.9)")
    p.add_argument("--out", metavar="DIR", help="write tables, filters.toml and hotkeys.png here")
    p.add_argument("--out-format", choices=("csv", "parquet"), default="csv", help="table files (default csv)")
    p.add_argument("--master", metavar="URL", help="Spark master (default local[*], or spark-submit's)")


@dataclass
class Report:
    """The job's answer; `tables()` gives it as rows for the terminal and the files."""

    lines: int
    reads: float
    top: list[dict[str, Any]]
    peers: list[dict[str, Any]]
    filters: dict[str, list[Filter]]
    bucket_reads: dict[str, float]
    cover: float
    curves: dict[str, list[float]] = field(default_factory=dict)  # bucket -> cumulative share by group
    # bucket -> source -> estimated reads (local, cache, a peer, leader, stale)
    sources: dict[str, dict[str, float]] = field(default_factory=dict)

    def tables(self) -> dict[str, list[dict[str, Any]]]:
        filters = []
        for bucket, fs in self.filters.items():
            acc = 0.0
            total = self.bucket_reads[bucket]
            for f in fs:
                acc += f.reads
                filters.append({"bucket": bucket, "filter": f.filter, "reads": round(f.reads),
                                "share": round(f.reads / total, 4), "cumulative": round(acc / total, 4),
                                "keys": f.keys})
        return {"top_keys": self.top, "peers": self.peers, "filters": filters, "buckets": self.serving()}

    def serving(self) -> list[dict[str, Any]]:
        """Per bucket: how its reads were served, and what the proposed filters would keep
        local. `cache_hit_ratio`: of the reads of keys outside the filters (the near cache's
        or NATS's), the share the cache answered; empty with no cache read at all."""
        rows = []
        for bucket, by_source in sorted(self.sources.items()):
            total = sum(by_source.values()) or 1.0
            local = by_source.get("local", 0.0)
            cache = by_source.get("cache", 0.0)
            remote = total - local - cache
            covered = sum(f.reads for f in self.filters.get(bucket, [])) / (self.bucket_reads.get(bucket) or 1.0)
            rows.append({"bucket": bucket, "reads": round(total), "local": round(local / total, 4),
                         "cache": round(cache / total, 4), "remote": round(remote / total, 4),
                         "cache_hit_ratio": round(cache / (cache + remote), 4) if cache else None,
                         "filters_would_cover": round(covered, 4)})
        return rows


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """The `kvcache hotkeys` command."""
    out = out or sys.stdout
    if not 0 < args.cover <= 1:
        raise ConfigError(f"--cover must be within 0 and 1, got {args.cover}")
    if args.top < 1:
        raise ConfigError(f"--top must be positive, got {args.top}")
    paths = log_paths(args.logdirs)
    spark, owned = sparkio.session(args.master, "kvcache hotkeys")
    try:
        report = analyse(spark.read.csv(paths, schema=LOG_SCHEMA, sep="\t", mode="DROPMALFORMED"),
                         args.top, args.cover)
    except ConfigError:
        raise
    except Exception as e:
        raise UpstreamError(f"hotkeys failed: {sparkio.first_line(e)}") from None
    finally:
        if owned:
            spark.stop()
    print_report(report, out)
    if args.out:
        written = write_outputs(report, args.out, args.out_format)
        print(f"\nwrote {', '.join(written)} under {args.out}", file=out)
    return 0


def log_paths(logdirs: list[str]) -> list[str]:
    """The access log files (current and rotated) of each directory; files as given."""
    paths: list[str] = []
    for d in logdirs:
        if "://" in d:
            paths.append(d.rstrip("/") + f"/{FILE_NAME}*")
        elif os.path.isfile(d):
            paths.append(d)
        elif os.path.isdir(d):
            found = sorted(glob.glob(os.path.join(d, "**", f"{FILE_NAME}*"), recursive=True))
            if not found:
                raise ConfigError(f"no access logs ({FILE_NAME}*) under {d}")
            paths += found
        else:
            raise ConfigError(f"log directory not found: {d}")
    return paths


def analyse(logs: DataFrame, top: int, cover: float) -> Report:
    """All the aggregation happens in Spark; only per-group totals reach the driver."""
    from pyspark.sql import functions as F

    logs = logs.where(F.col("key").isNotNull() & F.col("bucket").isNotNull())
    w = F.when(F.col("rate") > 0, 1.0 / F.col("rate")).otherwise(F.lit(1.0))
    remote = F.when(~F.col("source").isin("local", "cache"), w).otherwise(0.0)
    miss = F.when(F.col("hit") == 0, w).otherwise(0.0)
    logs = logs.select("bucket", "key", "source", "latency_us", w.alias("w"), remote.alias("remote"),
                       miss.alias("miss")).cache()
    try:
        totals = logs.agg(F.count(F.lit(1)).alias("lines"), F.sum("w").alias("reads")).first()
        if not totals or not totals["lines"]:
            raise ConfigError("the access logs hold no records")
        per_key = logs.groupBy("bucket", "key").agg(
            F.sum("w").alias("reads"), F.count(F.lit(1)).alias("sampled"),
            F.sum("remote").alias("remote"), F.sum("miss").alias("miss"))
        top_rows = per_key.orderBy(F.desc("reads"), "bucket", "key").limit(top).collect()
        peers = logs.groupBy("source").agg(
            F.count(F.lit(1)).alias("sampled"),
            F.percentile_approx("latency_us", list(PERCENTILES), 10000).alias("p"),
            F.avg("latency_us").alias("mean")).orderBy("source").collect()
        parent = F.regexp_extract("key", r"^(.*)\.[^.]*$", 1)
        group = F.when(parent == "", F.col("key")).otherwise(F.concat(parent, F.lit(".*")))
        groups = per_key.groupBy("bucket", group.alias("grp")).agg(
            F.sum("reads").alias("reads"), F.count(F.lit(1)).alias("keys")).collect()
        served = logs.groupBy("bucket", "source").agg(F.sum("w").alias("reads")).collect()
    finally:
        logs.unpersist()
    by_bucket: dict[str, dict[str, tuple[float, int]]] = {}
    for g in groups:
        by_bucket.setdefault(g["bucket"], {})[g["grp"]] = (float(g["reads"]), int(g["keys"]))
    bucket_reads = {b: sum(r for r, _ in gs.values()) for b, gs in by_bucket.items()}
    sources: dict[str, dict[str, float]] = {}
    for row in served:
        sources.setdefault(row["bucket"], {})[row["source"]] = float(row["reads"])
    curves = {}
    for b, gs in by_bucket.items():
        acc, curve = 0.0, []
        for r, _ in sorted(gs.values(), key=lambda t: -t[0]):
            acc += r
            curve.append(acc / bucket_reads[b])
        curves[b] = curve
    return Report(
        lines=int(totals["lines"]), reads=float(totals["reads"]),
        top=[{"bucket": r["bucket"], "key": r["key"], "reads": round(r["reads"]), "sampled": r["sampled"],
              "remote_ratio": round(r["remote"] / r["reads"], 4), "miss_ratio": round(r["miss"] / r["reads"], 4)}
             for r in top_rows],
        peers=[{"source": r["source"], "sampled": r["sampled"],
                **{f"p{int(q * 100)}_us": int(v) for q, v in zip(PERCENTILES, r["p"], strict=True)},
                "mean_us": round(r["mean"], 1)} for r in peers],
        filters={b: cover_filters(gs, cover) for b, gs in sorted(by_bucket.items())},
        bucket_reads=bucket_reads, cover=cover, curves=curves, sources=sources)


# ---------------------------------------------------------------------------- output

def filters_toml(report: Report) -> str:
    """`[[bucket]]` tables ready to paste into the sidecar's configuration."""
    out = [f"# kvcache hotkeys: filters covering {report.cover:.0%} of each bucket's sampled reads"]
    for bucket, fs in report.filters.items():
        keys = ", ".join(f'"{f.filter}"' for f in fs)
        share = sum(f.reads for f in fs) / report.bucket_reads[bucket]
        out += ["", "[[bucket]]", f'name = "{bucket}"', f"keys = [{keys}]  # {share:.1%} of reads"]
    return "\n".join(out) + "\n"


def _table(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return ["(none)"]
    cols = list(rows[0])
    cells = [[_fmt(r[c]) for c in cols] for r in rows]
    width = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    def line(vals):
        return "  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(vals, width, strict=True)))
    return [line(cols), line(["-" * w for w in width])] + [line(r) for r in cells]


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}" if v < 1 else f"{v:,.1f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def print_report(report: Report, out: TextIO) -> None:
    t = report.tables()
    print(f"{report.lines:,} sampled reads, about {report.reads:,.0f} reads in all", file=out)
    for title, name in (("top keys", "top_keys"), ("latency by source", "peers"),
                        (f"key filters covering {report.cover:.0%} of reads", "filters"),
                        ("how each bucket's reads were served (near cache vs the filters above)", "buckets")):
        print(f"\n{title}", file=out)
        for line in _table(t[name]):
            print(line, file=out)
    print("\n" + filters_toml(report), end="", file=out)


def write_outputs(report: Report, out_dir: str, fmt: str) -> list[str]:
    """One file per table (CSV or Parquet), filters.toml and hotkeys.png."""
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for name, rows in report.tables().items():
        path = os.path.join(out_dir, f"{name}.{fmt}")
        if fmt == "csv":
            with open(path, "w", newline="") as f:
                if rows:
                    wr = csv.DictWriter(f, fieldnames=list(rows[0]))
                    wr.writeheader()
                    wr.writerows(rows)
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(rows), path)
        written.append(os.path.basename(path))
    with open(os.path.join(out_dir, "filters.toml"), "w") as f:
        f.write(filters_toml(report))
    written.append("filters.toml")
    chart(report, os.path.join(out_dir, "hotkeys.png"))
    written.append("hotkeys.png")
    return written


def chart(report: Report, path: str) -> None:
    """Write the report's charts (see `chart_figure`) as a PNG."""
    import matplotlib.pyplot as plt

    fig = chart_figure(report)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def chart_figure(report: Report) -> Any:
    """Top keys by reads (remote share shaded), cumulative read share by key group per
    bucket with the cover line, and latency percentiles by source: a matplotlib Figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 6))
    ax = axes[0]
    top = report.top[:20][::-1]
    labels = [f"{r['bucket']}:{r['key']}"[:40] for r in top]
    reads = [r["reads"] for r in top]
    remote = [r["reads"] * r["remote_ratio"] for r in top]
    ax.barh(labels, reads, color="#4c72b0", label="reads")
    ax.barh(labels, remote, color="#dd8452", label="of which remote")
    ax.set_title("top keys by reads")
    ax.legend(loc="lower right")
    ax.tick_params(axis="y", labelsize=7)
    ax = axes[1]
    for bucket, curve in report.curves.items():
        ax.plot(range(1, len(curve) + 1), curve, marker=".", label=bucket)
    ax.axhline(report.cover, color="grey", linestyle="--", label=f"cover {report.cover:.0%}")
    if max((len(c) for c in report.curves.values()), default=0) > 20:
        ax.set_xscale("log")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("key groups, most read first")
    ax.set_ylabel("share of reads")
    ax.set_title("cumulative read share")
    ax.legend(loc="lower right")
    ax = axes[2]
    peers = report.peers
    xs = range(len(peers))
    heights = []
    for i, q in enumerate(PERCENTILES):
        key = f"p{int(q * 100)}_us"
        values = [max(p[key], 1) for p in peers]
        heights += values
        ax.bar([x + (i - 1) * 0.27 for x in xs], values, width=0.27, label=key)
    ax.set_xticks(list(xs), [p["source"] for p in peers], rotation=20, fontsize=8)
    ax.set_yscale("log")
    if heights:
        ax.set_ylim(bottom=log_floor(min(heights)))
    ax.set_ylabel("µs")
    ax.set_title("read latency by source")
    ax.legend()
    fig.tight_layout()
    return fig


def log_floor(smallest: float) -> float:
    """The bottom of a log axis for bars whose smallest is `smallest` (the lowest p50): the
    power of ten below it, so that every bar, the shortest too, shows a height (matplotlib's
    own limits on a log axis can start above the shortest bar and hide it)."""
    import math

    bottom = 10.0 ** math.floor(math.log10(smallest))
    return bottom / 10 if bottom >= smallest else bottom
