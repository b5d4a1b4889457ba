"""A plain `pip install` of kvcache's sdist, in a fresh virtualenv with no system LMDB needed,
gets every native module: the GET path's LMDB is compiled in from the `lmdb` sdist (setup.py),
and a build that cannot make a native module fails instead of leaving the twins to serve
unannounced. Slow (a minute: a venv, the build dependencies, the compile) and needs the
package index, as `pip install` does."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from support.packaging import build_sdist, clean_env, pip_install, venv

pytestmark = [pytest.mark.servers, pytest.mark.slow]  # starts pip and compilers, not servers

PROBE = """
import glob, json, os, subprocess, kvcache, kvcache.native as n
so = glob.glob(os.path.join(os.path.dirname(kvcache.__file__), "_native", "server_get*.so"))[0]
print(json.dumps({"file": kvcache.__file__, "report": n.report(), "lmdb": n.lmdb_version(),
                  "ldd": subprocess.run(["ldd", so], capture_output=True, text=True).stdout}))
"""


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> Path:
    return build_sdist(tmp_path_factory.mktemp("sdist"))


def test_pip_install_of_the_sdist_has_every_native_module(sdist, tmp_path):
    python = venv(tmp_path / "venv")
    r = pip_install(python, str(sdist), tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                       env=clean_env())
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["file"].startswith(str(tmp_path / "venv")), got["file"]
    assert set(got["report"].values()) == {"native"}, got["report"]
    assert got["lmdb"].startswith("0.9."), got["lmdb"]
    assert "lmdb" not in got["ldd"], got["ldd"]  # LMDB is inside the module, not a system library


def test_a_module_that_cannot_be_built_fails_the_install(sdist, tmp_path):
    """No LMDB sources to be had (an empty KVCACHE_LMDB_SRC stands in for an offline index):
    the install stops with one line saying why and what to do, and nothing is installed."""
    python = venv(tmp_path / "venv")
    empty = tmp_path / "no-lmdb"
    empty.mkdir()
    r = pip_install(python, str(sdist), tmp_path, env={**clean_env(), "KVCACHE_LMDB_SRC": str(empty)})
    assert r.returncode != 0
    assert "kvcache: ERROR:" in r.stderr and "KVCACHE_PURE_PYTHON=1" in r.stderr, r.stderr[-3000:]
    assert subprocess.run([str(python), "-c", "import kvcache"], capture_output=True, cwd=tmp_path).returncode != 0
