"""kvcache as a user installs it: an sdist built from this tree, a fresh virtualenv, pip.
For tests/test_packaging.py (native modules) and tests/test_readme.py (the README run in the
environment `make demo` makes). Needs the package index, as `pip install` does."""
from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def clean_env() -> dict[str, str]:
    """This environment without kvcache's own variables (a user's shell has none)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("KVCACHE_")}


def build_sdist(out: Path) -> Path:
    """The sdist of this tree, as shipped (setup.py sdist needs no build dependencies)."""
    r = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "--dist-dir", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "KVCACHE_PURE_PYTHON": "1"})  # (no compile for an sdist)
    assert r.returncode == 0, r.stderr
    (archive,) = glob.glob(str(out / "kvcache-*.tar.gz"))
    return Path(archive)


def venv(where: Path) -> Path:
    """A fresh virtualenv (no system site-packages); its python."""
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, timeout=120)
    return where / "bin" / "python"


def pip_install(python: Path, spec: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-m", "pip", "install", "-q", spec], capture_output=True, text=True,
                          timeout=900, cwd=cwd, env=clean_env() if env is None else env)
