"""setup.py compiles a native module again only when it would come out different: an
editable build (as `pip install -e ".[spark]"` makes one, in fresh temporary directories)
reuses each module already built in place from the same sources with the same flags, and
rebuilds one whose source changed or whose file in place is not the one it built.

Slow (the first build compiles every module, half a minute on 2 cores); runs setuptools'
PEP 660 hook `build_editable` in a copy of the sources, never in this tree."""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.servers, pytest.mark.slow]  # starts compilers, not servers

ROOT = Path(__file__).resolve().parent.parent
MODULES = ["app_get", "natsproto", "near_hits", "resp", "server_get"]
BUILD = "import os; from setuptools import build_meta; os.makedirs('dist', exist_ok=True); " \
        "print(build_meta.build_editable('dist'))"


def _copy(dest: Path) -> Path:
    dest.mkdir()
    for name in ("setup.py", "pyproject.toml", "MANIFEST.in", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    shutil.copytree(ROOT / "ext", dest / "ext", ignore=shutil.ignore_patterns("*.c", "*.html", "*.so"))
    shutil.copytree(ROOT / "kvcache", dest / "kvcache",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
    return dest


def _build(tree: Path) -> dict[str, list[str]]:
    """One editable build; the modules it compiled and those it reused."""
    env = dict(os.environ)
    lmdb = ROOT / "build" / "lmdb-src"
    if (lmdb / "mdb.c").exists():
        env["KVCACHE_LMDB_SRC"] = str(lmdb)  # else setup.py fetches LMDB's sources itself
    for var in ("KVCACHE_REBUILD", "KVCACHE_DEBUG_BUILD", "KVCACHE_PURE_PYTHON"):
        env.pop(var, None)
    r = subprocess.run([sys.executable, "-c", BUILD], cwd=tree, capture_output=True, text=True, timeout=900,
                       env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    return {"compiled": sorted(re.findall(r"building 'kvcache\._native\.(\w+)' extension", out)),
            "reused": sorted(re.findall(r"kvcache: kvcache\._native\.(\w+): sources unchanged", out))}


def _digests(tree: Path) -> dict[str, str]:
    return {so.name.split(".")[0]: hashlib.sha256(so.read_bytes()).hexdigest()
            for so in (tree / "kvcache" / "_native").glob("*.so")}


def test_an_editable_build_compiles_only_what_changed(tmp_path):
    tree = _copy(tmp_path / "src")
    assert _build(tree) == {"compiled": MODULES, "reused": []}
    built = _digests(tree)
    assert sorted(built) == MODULES

    assert _build(tree) == {"compiled": [], "reused": MODULES}  # e.g. adding the spark extra
    assert _digests(tree) == built

    with open(tree / "ext" / "near_hits.pyx", "a") as f:
        f.write("\n# a changed source\n")
    with open(tree / "kvcache" / "_native" / next(p.name for p in (tree / "kvcache" / "_native").glob("resp.*.so")),
              "ab") as f:
        f.write(b"\0")  # a file in place that this build did not make
    assert _build(tree) == {"compiled": ["near_hits", "resp"],
                            "reused": ["app_get", "natsproto", "server_get"]}
    after = _digests(tree)
    assert {m for m in MODULES if after[m] != built[m]} <= {"near_hits", "resp"}
    assert _build(tree) == {"compiled": [], "reused": MODULES}
