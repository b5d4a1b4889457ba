"""Runs the fuzz harnesses (tests/fuzz/fuzz_*.py) under atheris on the sanitized native modules
that tests/fuzz/build_sanitized.sh made, one reader after the other, and says per reader what
it did and what it found; `make fuzz` and `make fuzz-short` call it.

    python tests/fuzz/run.py [--seconds 60] [--readers nats,server_get] [--every-split 64]
    python tests/fuzz/run.py --replay READER FILE...   (one input, in process, no atheris)

Each reader keeps its corpus in build/fuzz/corpus/<reader>/ (seeded from the test vectors,
tests/support/*_vectors.py, and grown by every run), its libFuzzer log in build/fuzz/logs/ and
what it found in build/fuzz/findings/<reader>/ (the input that failed, for --replay). The
numbers come from libFuzzer: executions, `cov` and `ft` (edges and features reached, the
twins' Python included), and, at the end, the functions of kvcache's own code (ext/*.pyx as
Cython compiled them, its helpers apart) that the run reached and their edges: the proof that
the modules under test are the instrumented ones. A sanitizer report (ASan, UBSan), a difference between the twins, an
exception the contract does not allow, a hang or running out of memory fails the run.

The twin's Python is instrumented too (atheris), so that its branches and comparisons guide
the fuzzer as well as the C code's; FUZZ_PYTHON_COVERAGE=0 leaves it out (about twice the
executions, guided by the C side alone).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(HERE)]

from harness import READERS, Difference  # noqa: E402

# ASan: CPython's allocations at exit are not leaks to chase; a failed allocation is Python's
# MemoryError. UBSan: every report stops the run with its stack. PYTHONMALLOC=malloc: every
# Python object comes from malloc, so that a read past a small bytes object is caught (in
# pymalloc's pools it would land in the next object, unseen).
ASAN_OPTIONS = "detect_leaks=0:allocator_may_return_null=1:quarantine_size_mb=64:malloc_context_size=20"
UBSAN_OPTIONS = f"print_stacktrace=1:halt_on_error=1:suppressions={HERE / 'ubsan.supp'}"
LIBFUZZER = ["-print_final_stats=1", "-print_coverage=1", "-timeout=30", "-rss_limit_mb=3072", "-max_len=4096",
             "-use_value_profile=1"]

SANITIZER = re.compile(r"ERROR: AddressSanitizer|runtime error:|ERROR: LeakSanitizer")
STATUS = re.compile(r"^#(\d+)\s+\w+\s+cov: (\d+) ft: (\d+) corp: (\d+)/")
LOADED = re.compile(r"INFO: Loaded (\d+) modules\s+\((\d+) inline 8-bit counters\)")
# -print_coverage's lines; kvcache's own functions are those Cython names after their module
# (__pyx_f_7kvcache_7_native_4resp_...), apart from Cython's helpers and LMDB
FUNC = re.compile(r"^(UN)?COVERED_FUNC: hits: \d+ edges: (\d+)/(\d+) (\S+) ")


@dataclass
class Result:
    reader: str
    seconds: float = 0.0
    rc: int = 0
    executions: int = 0
    exec_per_s: int = 0
    cov: int = 0
    ft: int = 0
    corpus: int = 0
    counters: int = 0
    modules: int = 0   # instrumented modules libFuzzer saw
    natives: int = 0   # kvcache._native modules the harness loaded
    functions: tuple[int, int] = (0, 0)  # kvcache's own C functions reached, of all
    edges: tuple[int, int] = (0, 0)      # their edges reached, of all
    sanitizer: int = 0
    differences: int = 0
    problems: list[str] = field(default_factory=list)
    findings: list[Path] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return bool(self.problems)


def dictionary(tokens: list[bytes]) -> str:
    """libFuzzer's dictionary format: one quoted token a line, \\xNN for the rest."""
    def quote(token: bytes) -> str:
        return "".join(chr(b) if 32 <= b < 127 and b not in b'"\\' else f"\\x{b:02x}" for b in token)
    return "".join(f'"{quote(t)}"\n' for t in tokens)


def prepare(reader: str, build: Path) -> tuple[Path, Path, Path]:
    """The reader's corpus (seeded), dictionary and findings folder."""
    target = importlib.import_module(f"fuzz_{reader}")
    corpus = build / "corpus" / reader
    corpus.mkdir(parents=True, exist_ok=True)
    for seed in target.seeds():
        path = corpus / f"seed-{hashlib.sha1(seed).hexdigest()}"
        if not path.exists():
            path.write_bytes(seed)
    words = build / "dict" / f"{reader}.dict"
    words.parent.mkdir(parents=True, exist_ok=True)
    words.write_text(dictionary(target.DICTIONARY))
    findings = build / "findings" / reader
    findings.mkdir(parents=True, exist_ok=True)
    return corpus, words, findings


def run_one(reader: str, python: str, build: Path, seconds: int, every_split: int) -> Result:
    corpus, words, findings = prepare(reader, build)
    before = set(findings.iterdir())
    logs = build / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{reader}.log"
    tmp = build / "tmp" / reader
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    native = build / "lib" / "kvcache" / "_native"
    env = {**os.environ, "LD_PRELOAD": str(build / "asan_with_fuzzer.so"), "ASAN_OPTIONS": ASAN_OPTIONS,
           "UBSAN_OPTIONS": UBSAN_OPTIONS, "PYTHONMALLOC": "malloc", "KVCACHE_FUZZ_NATIVE": str(native),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), str(HERE)]),
           "FUZZ_EVERY_SPLIT": str(every_split), "TMPDIR": str(tmp)}
    env.pop("KVCACHE_NO_EXTENSIONS", None)
    cmd = [python, str(HERE / "harness.py"), reader, str(corpus), f"-max_total_time={seconds}",
           f"-dict={words}", f"-artifact_prefix={findings}/", *LIBFUZZER]
    print(f"fuzz: {reader}: {seconds} s (log: {log.relative_to(ROOT)})", flush=True)
    t0 = time.monotonic()
    with open(log, "wb") as out:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                timeout=seconds + 600).returncode
        except subprocess.TimeoutExpired:
            rc = -1
    result = Result(reader, seconds=time.monotonic() - t0, rc=rc)
    shutil.rmtree(tmp, ignore_errors=True)
    read_log(result, log.read_text(errors="replace"), native)
    result.corpus = len(list(corpus.iterdir()))
    result.findings = sorted(set(findings.iterdir()) - before)
    if rc == -1:
        result.problems.append(f"did not end {seconds + 600} s after it began")
    elif rc != 0 and not result.problems:
        result.problems.append(f"exited with {rc}: see {log.relative_to(ROOT)}")
    return result


def read_log(result: Result, text: str, native: Path) -> None:
    lines = text.splitlines()
    for line in lines:
        if m := STATUS.match(line):
            result.executions, result.cov, result.ft = int(m[1]), int(m[2]), int(m[3])
        elif m := LOADED.search(line):
            result.modules += int(m[1])
            result.counters += int(m[2])
        elif line.startswith("stat::number_of_executed_units:"):
            result.executions = int(line.split(":")[-1])
        elif line.startswith("stat::average_exec_per_sec:"):
            result.exec_per_s = int(line.split(":")[-1])
    functions = [0, 0]
    edges = [0, 0]
    for m in map(FUNC.match, lines):
        if m and "_7kvcache_" in m[4]:
            functions[1] += 1
            functions[0] += not m[1]
            edges[0] += int(m[2])
            edges[1] += int(m[3])
    result.functions, result.edges = (functions[0], functions[1]), (edges[0], edges[1])
    result.sanitizer = sum(bool(SANITIZER.search(line)) for line in lines)
    result.differences = sum(line.startswith("fuzz: DIFFERENCE") for line in lines)
    loaded = next((line.split("loaded: ", 1)[1].split() for line in lines
                   if line.startswith(f"fuzz: {result.reader}: native modules loaded:")), [])
    if not loaded:
        result.problems.append("the harness did not start (no native modules loaded)")
    elif any(Path(p).parent != native for p in loaded):
        result.problems.append(f"native modules loaded from outside {native}: {loaded}")
    elif result.modules < len(loaded):
        result.problems.append(f"libFuzzer saw {result.modules} instrumented modules, {len(loaded)} are loaded")
    result.natives = len(loaded)
    if result.sanitizer:
        result.problems.append(f"{result.sanitizer} sanitizer report(s)")
    if result.differences:
        result.problems.append(f"{result.differences} difference(s) between the twins")
    for marker, what in (("ERROR: libFuzzer: timeout", "a hang"), ("ERROR: libFuzzer: out-of-memory", "out of memory"),
                         ("ERROR: libFuzzer: deadly signal", "a crash"),
                         ("=== Uncaught Python exception", "an exception in the harness")):
        if any(marker in line for line in lines) and not (result.sanitizer or result.differences):
            result.problems.append(what)
    if result.executions == 0 and not result.problems:
        result.problems.append("no input was run")


def excerpt(log: Path, limit: int = 60) -> str:
    """The report that stopped a run: the difference (to its last indented line), or the
    sanitizer's (to its SUMMARY line), or else the end of the log."""
    lines = log.read_text(errors="replace").splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("fuzz: DIFFERENCE")
                  or SANITIZER.search(line) or "ERROR: libFuzzer" in line), None)
    if start is None:
        return "\n".join(lines[-20:])
    end = start + 1
    if lines[start].startswith("fuzz: DIFFERENCE"):
        while end < len(lines) and lines[end].startswith(" "):
            end += 1
    else:
        while end < len(lines) and not lines[end - 1].startswith("SUMMARY:"):
            end += 1
    return "\n".join(line[:300] for line in lines[start:min(end, start + limit)])


def summary(results: list[Result]) -> str:
    head = (f"{'reader':<13} {'seconds':>7} {'executions':>11} {'exec/s':>7} {'cov':>6} {'ft':>7} {'corpus':>6}  "
            f"{'instrumented':>12} {'functions':>9} {'C edges':>11}  {'sanitizer':>9}  {'differences':>11}")
    rows = [head]
    for r in results:
        modules = f"{r.modules} of {r.natives}"
        fn = f"{r.functions[0]}/{r.functions[1]}"
        edges = f"{r.edges[0]}/{r.edges[1]}"
        rows.append(f"{r.reader:<13} {r.seconds:>7.0f} {r.executions:>11,} {r.exec_per_s:>7} {r.cov:>6} {r.ft:>7} "
                    f"{r.corpus:>6}  {modules:>12} {fn:>9} {edges:>11}  {r.sanitizer:>9}  {r.differences:>11}")
    rows.append("(instrumented: modules libFuzzer counts coverage in, of the kvcache._native modules loaded; "
                "functions, C edges: kvcache's own code reached)")
    return "\n".join("fuzz: " + row for row in rows)


def replay(reader: str, files: list[str]) -> int:
    """Each file's input through the harness once, in this process (whatever native build is
    importable; KVCACHE_FUZZ_NATIVE names another): the report, or 'no difference'."""
    target = importlib.import_module(f"fuzz_{reader}")
    target.setup()
    failed = 0
    for name in files:
        try:
            target.check(Path(name).read_bytes())
            print(f"fuzz: {name}: no difference")
        except Difference:
            failed += 1
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=60, help="per reader")
    parser.add_argument("--readers", default=",".join(READERS), help=f"of {','.join(READERS)}")
    parser.add_argument("--every-split", type=int, default=0, metavar="N",
                        help="also feed inputs of at most N bytes cut at every boundary")
    parser.add_argument("--build", default=str(ROOT / "build" / "fuzz"), help="build_sanitized.sh's output")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--replay", nargs="+", metavar=("READER", "FILE"))
    args = parser.parse_args(argv)
    if args.replay:
        if len(args.replay) < 2 or args.replay[0] not in READERS:
            parser.error(f"--replay READER FILE...: READER is one of {', '.join(READERS)}")
        return replay(args.replay[0], args.replay[1:])
    readers = [r for r in args.readers.split(",") if r]
    unknown = [r for r in readers if r not in READERS]
    if unknown:
        parser.error(f"unknown reader {', '.join(unknown)}: the readers are {', '.join(READERS)}")
    build = Path(args.build).resolve()
    if not (build / "asan_with_fuzzer.so").exists() or not (build / "lib" / "kvcache" / "_native").is_dir():
        parser.error(f"no sanitized build in {build}: run tests/fuzz/build_sanitized.sh (make fuzz does)")
    results = [run_one(r, args.python, build, args.seconds, args.every_split) for r in readers]
    print(summary(results))
    for r in results:
        if r.failed:
            log = build / "logs" / f"{r.reader}.log"
            print(f"fuzz: {r.reader} FAILED: {'; '.join(r.problems)}")
            for path in r.findings:
                print(f"fuzz:   input: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path} "
                      f"(python tests/fuzz/run.py --replay {r.reader} {path})")
            print(excerpt(log))
    return 1 if any(r.failed for r in results) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
