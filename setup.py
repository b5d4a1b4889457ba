"""Builds kvcache's Cython extensions (ext/*.pyx → kvcache/_native/*.so); metadata is in pyproject.toml.

Every extension is built, or the install fails and says why: a plain `pip install` must not
leave the sidecar on its slower pure-Python twins without anyone being told (pip hides a
build's warnings). KVCACHE_PURE_PYTHON=1 installs without them, on purpose (a machine with no
C compiler); the sidecar then says at start, and in INFO, which twins serve.
KVCACHE_DEBUG_BUILD=1 (`make debug`) builds with assertions, bounds checks and -O0 -g for
gdb/valgrind; the default is an optimized build.
"""
import glob
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, ExecError, PlatformError

DEBUG = os.environ.get("KVCACHE_DEBUG_BUILD") == "1"
PURE_PYTHON = os.environ.get("KVCACHE_PURE_PYTHON") == "1"
HOW_TO_FIX = ("install a C compiler and the Python headers (Debian: apt-get install gcc python3-dev) and "
              "install again, or set KVCACHE_PURE_PYTHON=1 to install without the native modules (slower)")


class NativeBuildExt(build_ext):
    """Every extension or an error that names the one that failed and what to do."""

    def run(self) -> None:
        try:
            super().run()
        except (CCompilerError, ExecError, PlatformError, OSError) as e:
            sys.exit(f"kvcache: ERROR: the native modules cannot be built ({_first_line(e)}): {HOW_TO_FIX}")

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except (CCompilerError, ExecError, PlatformError, OSError) as e:
            sys.exit(f"kvcache: ERROR: {ext.name} cannot be built ({_first_line(e)}): {HOW_TO_FIX}")


def _first_line(e: BaseException) -> str:
    text = (str(e).strip() or type(e).__name__).splitlines()[0]
    return text if len(text) <= 200 else text[:90] + " ... " + text[-100:]


# LMDB for the server's GET extension (ext/server_get.pyx), compiled into it from the source of
# the `lmdb` package on the package index: the same C library py-lmdb (the writer) bundles, so
# a plain `pip install` needs no system package to build or to run. It is fetched once into
# build/ with the pip that runs this build (its index, proxy and certificate settings apply);
# KVCACHE_LMDB_SRC=<dir with mdb.c, midl.c, lmdb.h> gives the sources instead (offline builds).
LMDB_EXTENSION = "ext/server_get.pyx"
LMDB_SDIST = "lmdb>=1.4"
LMDB_FILES = ("mdb.c", "midl.c", "lmdb.h", "midl.h")
LMDB_CACHE = os.path.join("build", "lmdb-src")


def lmdb_source() -> tuple[str | None, str]:
    """The directory holding LMDB's C sources, or None and why there is none."""
    given = os.environ.get("KVCACHE_LMDB_SRC")
    if given:
        missing = [f for f in LMDB_FILES if not os.path.exists(os.path.join(given, f))]
        return (None, f"KVCACHE_LMDB_SRC={given} lacks {', '.join(missing)}") if missing else (given, "")
    if all(os.path.exists(os.path.join(LMDB_CACHE, f)) for f in LMDB_FILES):
        return LMDB_CACHE, ""
    print(f"kvcache: fetching LMDB's C sources from the package index ({LMDB_SDIST}, sdist)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        got = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", "lmdb",
             "--dest", tmp, LMDB_SDIST],
            capture_output=True, text=True)
        archives = glob.glob(os.path.join(tmp, "lmdb-*.tar.gz"))
        if got.returncode != 0 or not archives:
            why = (got.stderr.strip().splitlines() or ["no sdist downloaded"])[-1]
            return None, f"could not download the {LMDB_SDIST} sdist: {why}"
        os.makedirs(LMDB_CACHE, exist_ok=True)
        with tarfile.open(archives[0]) as tar:
            for member in tar.getmembers():
                parts = member.name.split("/")
                if len(parts) == 3 and parts[1] == "lib" and parts[2] in LMDB_FILES and member.isfile():
                    with tar.extractfile(member) as src, open(os.path.join(LMDB_CACHE, parts[2]), "wb") as dst:
                        shutil.copyfileobj(src, dst)
    missing = [f for f in LMDB_FILES if not os.path.exists(os.path.join(LMDB_CACHE, f))]
    if missing:
        return None, f"the {LMDB_SDIST} sdist has no lib/{missing[0]}"
    return LMDB_CACHE, ""


def lmdb_extension(src: str, cflags: list[str]) -> Extension:
    """server_get with LMDB compiled in (the build stops when LMDB's sources cannot be had)."""
    where, why = lmdb_source()
    if where is None:
        sys.exit(f"kvcache: ERROR: {why}: {src} needs LMDB's C sources; set KVCACHE_LMDB_SRC to a directory "
                 "holding mdb.c, midl.c, lmdb.h and midl.h (from the lmdb sdist) for an offline build, or "
                 "KVCACHE_PURE_PYTHON=1 to install without the native modules (slower)")
    # LMDB's symbols stay inside this extension (hidden), so they never meet another LMDB
    # loaded in the same process.
    return Extension("kvcache._native.server_get",
                     [src, os.path.join(where, "mdb.c"), os.path.join(where, "midl.c")],
                     include_dirs=[where], extra_compile_args=[*cflags, "-fvisibility=hidden"])


def extensions():
    if PURE_PYTHON:
        print("kvcache: KVCACHE_PURE_PYTHON=1: no native modules built (their pure-Python twins serve)")
        return []
    from Cython.Build import cythonize

    directives = {
        "language_level": 3,
        "embedsignature": True,
        # Hot loops index bytes they have already bounds-checked themselves.
        "boundscheck": DEBUG,
        "wraparound": DEBUG,
        "initializedcheck": DEBUG,
        "cdivision": not DEBUG,
    }
    cflags = ["-O0", "-g3"] if DEBUG else ["-O3"]
    exts = []
    for src in sorted(glob.glob("ext/*.pyx")):
        if src == LMDB_EXTENSION:
            exts.append(lmdb_extension(src, cflags))
            continue
        exts.append(Extension(f"kvcache._native.{os.path.splitext(os.path.basename(src))[0]}", [src],
                              extra_compile_args=cflags))
    return cythonize(exts, compiler_directives=directives, annotate=DEBUG, include_path=["ext"],
                     force=DEBUG, quiet=True)


setup(ext_modules=extensions(), cmdclass={"build_ext": NativeBuildExt})
