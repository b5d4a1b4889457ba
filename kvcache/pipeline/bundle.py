"""`python -m kvcache.pipeline.bundle DIR`: what `spark-submit` needs to run the jobs on a cluster.

Writes DIR/kvcache-pipeline.zip (the kvcache package's Python sources and nats-py, both pure
Python, for `--py-files`: executors import the partition writer from it) and
DIR/kvcache_submit.py (the application file: `kvcache load|hotkeys` arguments follow it).
Executors also need pyarrow, which PySpark installations carry for Arrow UDFs. The native
readers are left out: on executors kvcache uses their pure-Python twins.
"""
from __future__ import annotations

import os
import sys
import zipfile

import nats

import kvcache

ZIP_NAME = "kvcache-pipeline.zip"
SUBMIT_NAME = "kvcache_submit.py"
SUBMIT = '''"""spark-submit application: kvcache load|hotkeys ARGS (kvcache from --py-files)."""
import sys

from kvcache.cli import main

sys.exit(main(sys.argv[1:]))
'''


def _add_package(zf: zipfile.ZipFile, package_dir: str) -> int:
    root = os.path.dirname(package_dir)
    n = 0
    for dirpath, dirnames, files in os.walk(package_dir):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                zf.write(path, os.path.relpath(path, root))
                n += 1
    return n


def build(out_dir: str) -> tuple[str, str]:
    """Write the zip and the submit script into `out_dir`; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    zpath = os.path.join(out_dir, ZIP_NAME)
    with zipfile.ZipFile(zpath, "w", zipfile.ZIP_DEFLATED) as zf:
        for pkg in (kvcache, nats):
            assert pkg.__file__ is not None  # both are regular packages
            _add_package(zf, os.path.dirname(os.path.abspath(pkg.__file__)))
    spath = os.path.join(out_dir, SUBMIT_NAME)
    with open(spath, "w") as f:
        f.write(SUBMIT)
    return zpath, spath


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m kvcache.pipeline.bundle DIR", file=sys.stderr)
        return 2
    zpath, spath = build(argv[0])
    print(f"spark-submit --py-files {zpath} {spath} load|hotkeys ...")
    return 0


if __name__ == "__main__":
    sys.exit(main())
