"""The SparkSession the jobs run on, and Spark's input readers behind one function."""
from __future__ import annotations

import os
import sys
import tempfile
import warnings
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

FORMATS = {".parquet": "parquet", ".parq": "parquet", ".csv": "csv", ".tsv": "csv",
           ".json": "json", ".jsonl": "json", ".ndjson": "json"}
COMPRESSED = (".gz", ".bz2", ".snappy", ".zst", ".lz4", ".deflate")
QUIET_LOG4J = """rootLogger.level = error
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n
"""


def session(master: str | None, app: str) -> tuple[SparkSession, bool]:
    """The active session (spark-submit, tests, a notebook) or a new one on `master`
    (default `local[*]`). Returns (session, owned): the caller stops only what it started."""
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"pyspark\..*")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"pyspark\..*")
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    if SparkContext._active_spark_context is not None:  # any thread's: not ours to stop
        return SparkSession.builder.getOrCreate(), False
    b = SparkSession.builder.appName(app).config("spark.ui.showConsoleProgress", "false")
    # Under spark-submit the launcher has set the master already (and the JVM runs).
    launched = "PYSPARK_GATEWAY_PORT" in os.environ
    if master or not launched:
        master = master or "local[*]"
        b = b.master(master)
    if master and master.startswith("local") and not launched:
        log4j = os.path.join(tempfile.mkdtemp(prefix="kvcache-spark-"), "log4j2.properties")
        with open(log4j, "w") as f:
            f.write(QUIET_LOG4J)
        b = (b.config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.ui.enabled", "false")
             # local workers run this interpreter (not whatever `python3` is on PATH)
             .config("spark.pyspark.python", os.environ.get("PYSPARK_PYTHON", sys.executable))
             .config("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile=file:{log4j}"))
    try:
        spark = b.getOrCreate()
    except Exception as e:  # no Java, bad master URL...
        raise ConfigError(f"cannot start Spark (master {master or 'from spark-submit'}): {first_line(e)}") from None
    spark.sparkContext.setLogLevel("ERROR")
    return spark, True


def first_line(e: BaseException) -> str:
    """Spark and Py4J errors carry JVM stack traces; users get the first meaningful line."""
    for line in str(e).splitlines():
        line = line.strip()
        if line and not line.startswith(("Traceback", "at ", "JVM stacktrace")):
            return line[:500]
    return type(e).__name__


def detect_format(paths: list[str], given: str | None) -> str:
    """`--format`, else the extension of the inputs (of the files inside a directory);
    local paths must exist."""
    if given:
        if given not in ("parquet", "csv", "json"):
            raise ConfigError(f"--format must be parquet, csv or json, got '{given}'")
    found: set[str] = set()
    for p in paths:
        if "://" not in p and not os.path.exists(p):
            raise ConfigError(f"input not found: {p}")
        names = [p]
        if os.path.isdir(p):
            names = [n for _, _, files in os.walk(p) for n in files if not n.startswith(("_", "."))]
        for n in names:
            fmt = _format_of(n)
            if fmt:
                found.add(fmt)
    if given:
        return given
    if len(found) != 1:
        what = "no known extension" if not found else f"mixed formats {sorted(found)}"
        raise ConfigError(f"cannot tell the input format ({what}): give --format parquet|csv|json")
    return found.pop()


def _format_of(name: str) -> str | None:
    low = name.lower()
    for c in COMPRESSED:
        if low.endswith(c):
            low = low[: -len(c)]
            break
    return FORMATS.get(os.path.splitext(low)[1])


def read(spark: SparkSession, paths: list[str], fmt: str, *, delimiter: str | None = None,
         infer_schema: bool = False, multiline: bool = False) -> DataFrame:
    """Spark's own reader for the format. CSV: a header row, every column a string unless
    `infer_schema` (keys like `007` stay intact). JSON: one document per line unless `multiline`."""
    reader = spark.read.format(fmt)
    opts: dict[str, Any] = {}
    if fmt == "csv":
        opts = {"header": "true", "inferSchema": str(infer_schema).lower(),
                "sep": delimiter or ("\t" if all(p.lower().endswith(".tsv") for p in paths) else ",")}
    elif fmt == "json":
        opts = {"multiLine": str(multiline).lower()}
    try:
        return reader.options(**opts).load(paths)
    except Exception as e:
        raise ConfigError(f"cannot read {', '.join(paths)} as {fmt}: {first_line(e)}") from None


def quote(column: str) -> str:
    """A column name for F.col even when it holds dots or spaces."""
    return "`" + column.replace("`", "``") + "`"
