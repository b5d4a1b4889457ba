"""The SparkSession the jobs run on, and Spark's input readers behind one function."""
from __future__ import annotations

import os
import re
import shutil
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
    made = None  # the log4j file's directory, removed once the JVM has read it
    if master and master.startswith("local") and not launched:
        made = tempfile.mkdtemp(prefix="kvcache-spark-")
        log4j = os.path.join(made, "log4j2.properties")
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
    finally:
        # log4j reads its configuration as the JVM starts, before getOrCreate returns (and
        # never again: no monitorInterval), so the file can go now: every run, and every
        # test session, used to leave a kvcache-spark-* directory in the temp directory.
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
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


# The column kvcache adds to every input: null for a row that was read, the record's text
# for one Spark could not read (PERMISSIVE mode's corrupt-record column).
UNREADABLE = "_kvcache_unreadable"
BOM = "\ufeff"
SNIFF_BYTES = 1 << 16


def read(spark: SparkSession, paths: list[str], fmt: str, *, delimiter: str | None = None,
         infer_schema: bool = False, multiline: bool = False, csv_single_line: bool = False) -> DataFrame:
    """Spark's own reader for the format, plus the column UNREADABLE (see there).

    CSV is read as RFC 4180: a header row, quotes doubled inside quoted fields, separators and
    line breaks inside quoted fields (Spark's multiLine, unless `csv_single_line`), a UTF-8 BOM
    dropped; every column a string unless `infer_schema` (keys like `007` stay intact). A row
    with the wrong number of fields or an unterminated quote is UNREADABLE, not loaded; a
    stray quote inside a quoted field stops the read with an error. JSON: one document per
    line unless `multiline`; a line that is not a JSON object is UNREADABLE."""
    from pyspark.sql import functions as F

    try:
        if fmt == "csv":
            sep = delimiter or ("\t" if all(p.lower().endswith(".tsv") for p in paths) else ",")
            df = _read_csv(spark, paths, sep, infer_schema, not csv_single_line)
        elif fmt == "json" and not multiline:
            df = _read_json_lines(spark, paths)
        elif fmt == "json":
            df = (spark.read.format("json")
                  .options(multiLine="true", mode="PERMISSIVE", columnNameOfCorruptRecord=UNREADABLE)
                  .load(paths))
        else:
            df = spark.read.format(fmt).load(paths)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"cannot read {', '.join(paths)} as {fmt}: {first_line(e)}") from None
    if UNREADABLE not in df.columns:  # JSON adds it only when some record did not parse
        df = df.withColumn(UNREADABLE, F.lit(None).cast("string"))
    return df


def _read_csv(spark: SparkSession, paths: list[str], sep: str, infer_schema: bool,
              multiline: bool) -> DataFrame:
    """RFC 4180 CSV with an explicit schema: the header's names (BOM stripped), text or
    inferred types, and the UNREADABLE column. Fields may span lines unless not `multiline`:
    then each file is read whole by one task (Spark cannot split such files), and the line
    break is the one each input's first record ends with (univocity would otherwise turn a
    CRLF inside a quoted field into LF), so inputs are read in groups by line break."""
    from functools import reduce

    from pyspark.sql.types import StringType, StructField, StructType

    base = {"header": "true", "sep": sep, "quote": '"', "escape": '"',
            "multiLine": str(multiline).lower(), "unescapedQuoteHandling": "RAISE_ERROR"}
    groups: dict[str | None, list[str]] = {}
    for p in paths:
        groups.setdefault(line_break_of(spark, p) if multiline else None, []).append(p)
    frames = []
    for line_sep, group in groups.items():
        opts = dict(base, **({"lineSep": line_sep} if line_sep else {}))
        found = spark.read.format("csv").options(**opts, inferSchema=str(infer_schema).lower()).load(group)
        fields = [StructField(f.name.lstrip(BOM) if i == 0 else f.name,
                              f.dataType if infer_schema else StringType(), True)
                  for i, f in enumerate(found.schema.fields)]
        schema = StructType([*fields, StructField(UNREADABLE, StringType(), True)])
        frames.append(spark.read.format("csv").options(**opts, mode="PERMISSIVE",
                                                       columnNameOfCorruptRecord=UNREADABLE)
                      .schema(schema).load(group))
    return reduce(lambda a, b: a.unionByName(b, allowMissingColumns=True), frames)


def _read_json_lines(spark: SparkSession, paths: list[str]) -> DataFrame:
    """One JSON object per line, with the schema Spark infers. Each line is parsed by
    `from_json` from the line's text rather than by the JSON reader, which reads the first
    value of a line and ignores what follows it (`{"k": 1} junk`): a line that does not end
    in its object is UNREADABLE too. A UTF-8 BOM is dropped; blank lines are skipped."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import StringType, StructField, StructType

    found = spark.read.format("json").options(mode="PERMISSIVE", columnNameOfCorruptRecord=UNREADABLE).load(paths)
    schema = StructType([*(f for f in found.schema.fields if f.name != UNREADABLE),
                         StructField(UNREADABLE, StringType(), True)])
    text = F.regexp_replace(F.col("value"), "^\ufeff", "")
    lines = spark.read.format("text").load(paths).select(text.alias("line")).where(F.trim("line") != "")
    row = F.from_json("line", schema, {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": UNREADABLE})
    parsed = lines.select(row.alias("row"), "line")
    ends_well = F.rtrim(F.col("line")).endswith("}")
    unreadable = (F.when(F.col("row").isNull() | ~ends_well, F.col("line"))
                  .otherwise(F.col(f"row.{UNREADABLE}")))
    return parsed.select(*(F.col("row")[f.name].alias(f.name) for f in schema.fields if f.name != UNREADABLE),
                         unreadable.alias(UNREADABLE))


def line_break_of(spark: SparkSession, path: str) -> str | None:
    """The line break ending the first record of `path` (a file, a directory's first data
    file, or a glob's first match; decompressed when its name says so), read through Hadoop's
    file system as Spark reads it. None when it cannot be told: Spark then detects it."""
    try:
        jvm: Any = spark._jvm
        conf = spark._jsc.hadoopConfiguration()
        hpath = jvm.org.apache.hadoop.fs.Path(path)
        fs = hpath.getFileSystem(conf)
        statuses = fs.globStatus(hpath)
        first = _first_file(fs, list(statuses or []))
        if first is None:
            return None
        stream = fs.open(first)
        try:
            codec = jvm.org.apache.hadoop.io.compress.CompressionCodecFactory(conf).getCodec(first)
            source = codec.createInputStream(stream) if codec is not None else stream
            data = bytes(source.readNBytes(SNIFF_BYTES))
        finally:
            stream.close()
    except Exception:
        return None
    return record_end(data)


def _first_file(fs: Any, statuses: list[Any], depth: int = 0) -> Any:
    for st in sorted(statuses, key=lambda s: str(s.getPath().getName())):
        name = str(st.getPath().getName())
        if name.startswith(("_", ".")):
            continue
        if not st.isDirectory():
            return st.getPath()
        if depth < 4:
            found = _first_file(fs, list(fs.listStatus(st.getPath())), depth + 1)
            if found is not None:
                return found
    return None


def record_end(data: bytes) -> str | None:
    """The line break ending the first CSV record of `data` ("\r\n", "\n" or "\r"), not
    counting breaks inside quoted fields; None when no record ends within `data`."""
    quoted = False
    for i, b in enumerate(data):
        if b == 0x22:
            quoted = not quoted  # a doubled quote toggles twice
        elif quoted:
            continue
        elif b == 0x0A:
            return "\r\n" if i and data[i - 1] == 0x0D else "\n"
        elif b == 0x0D and i + 1 < len(data) and data[i + 1] != 0x0A:
            return "\r"
    return None


def read_error(e: BaseException) -> str:
    """The line a user needs from a failed read: a CSV parse error says which file and line
    (Spark wraps univocity's message in several layers of JVM exceptions)."""
    text = str(e)
    if "TextParsingException" not in text:
        return first_line(e)
    causes = re.findall(r"TextParsingException: ([^\n]*)", text)
    what = re.sub(r"\s*(To allow|Cannot parse).*", "", causes[-1]).strip() if causes else ""
    where = re.search(r"Internal state when error was thrown: line=(\d+)", text)
    file = re.search(r"while reading file (\S+?)\.?\s", text)
    parts = [f"cannot read {file.group(1)}" if file else "cannot read the input",
             f"near line {int(where.group(1)) + 1}" if where else None, what or "malformed CSV"]
    return ": ".join(p for p in parts if p)


def quote(column: str) -> str:
    """A column name for F.col even when it holds dots or spaces."""
    return "`" + column.replace("`", "``") + "`"
