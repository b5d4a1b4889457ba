"""Builds kvcache's Cython extensions (ext/*.pyx → kvcache/_native/*.so); metadata is in pyproject.toml.

Every extension is built, or the install fails and says why: a plain `pip install` must not
leave the sidecar on its slower pure-Python twins without anyone being told (pip hides a
build's warnings). KVCACHE_PURE_PYTHON=1 installs without them, on purpose (a machine with no
C compiler); the sidecar then says at start, and in INFO, which twins serve.
KVCACHE_DEBUG_BUILD=1 (`make debug`) builds with assertions, bounds checks and -O0 -g for
gdb/valgrind; the default is an optimized build.

A module already built in place (kvcache/_native/*.so) is not compiled again when none of its
sources changed and it was built with the same flags and Python (a stamp under build/ says
so): `pip install -e ".[spark]"` on a built tree adds the extra in seconds, not the minute a
full build takes (pip's editable builds run in a fresh temporary directory, where setuptools'
own up-to-date check never finds the last build). KVCACHE_REBUILD=1 compiles everything again.
"""
import glob
import hashlib
import json
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
REBUILD = os.environ.get("KVCACHE_REBUILD") == "1"
ROOT = os.path.dirname(os.path.abspath(__file__))
STAMPS = os.path.join("build", "native-stamps")
# What every extension's C depends on beside its own sources: the Cython declarations and
# includes it may cimport or include (a change to any of them rebuilds every module).
SHARED_DEPENDS = ("ext/*.pxd", "ext/*.pxi", "ext/*.h", "ext/kvcache/_native/*.pxd")
HOW_TO_FIX = ("install a C compiler and the Python headers (Debian: apt-get install gcc python3-dev) and "
              "install again, or set KVCACHE_PURE_PYTHON=1 to install without the native modules (slower)")


class NativeBuildExt(build_ext):
    """Every extension or an error that names the one that failed and what to do."""

    def run(self) -> None:
        self._compiled: list[Extension] = []
        in_place = self.inplace  # --inplace or an editable install: built modules are copied in place
        try:
            super().run()
        except (CCompilerError, ExecError, PlatformError, OSError) as e:
            sys.exit(f"kvcache: ERROR: the native modules cannot be built ({_first_line(e)}): {HOW_TO_FIX}")
        if in_place:
            for ext in self._compiled:
                self._write_stamp(ext)

    def build_extension(self, ext: Extension) -> None:
        if self._reuse(ext):
            return
        try:
            super().build_extension(ext)
        except (CCompilerError, ExecError, PlatformError, OSError) as e:
            sys.exit(f"kvcache: ERROR: {ext.name} cannot be built ({_first_line(e)}): {HOW_TO_FIX}")
        self._compiled.append(ext)

    # A module is reused when the one in place is the one this build would make: its stamp
    # says this setup.py built that very file (its digest) from sources with the digest they
    # have now, with the same flags and Python. Digests, not times: each isolated build
    # (pip's) regenerates the C files with a Cython installed just then, so their times
    # always say "changed" while their bytes say the same.

    def _inplace(self, ext: Extension) -> str:
        return os.path.join(ROOT, os.path.dirname(ext.name.replace(".", os.sep)),
                            os.path.basename(self.get_ext_filename(ext.name)))

    def _stamp_path(self, ext: Extension) -> str:
        return os.path.join(ROOT, STAMPS, ext.name + ".json")

    def _stamp(self, ext: Extension) -> dict:
        """What the module in place must have been built from and with (its own digest apart)."""
        stem = os.path.join("ext", ext.name.rsplit(".", 1)[-1])
        inputs = sorted({*ext.sources, *ext.depends, stem + ".pyx",
                         *(os.path.relpath(f, ROOT) for pattern in SHARED_DEPENDS
                           for f in glob.glob(os.path.join(ROOT, pattern)))})
        digest = hashlib.sha256()
        for name in inputs:
            path = os.path.join(ROOT, name)
            if os.path.exists(path):
                digest.update(name.encode() + b"\0" + _digest(path).encode() + b"\0")
        return {"python": sys.version, "file": os.path.basename(self.get_ext_filename(ext.name)),
                "debug": DEBUG, "cflags": list(ext.extra_compile_args or []),
                "include_dirs": list(ext.include_dirs or []), "macros": [list(m) for m in ext.define_macros],
                "libraries": list(ext.libraries or []), "ldflags": list(ext.extra_link_args or []),
                "inputs": digest.hexdigest()}

    def _reuse(self, ext: Extension) -> bool:
        if self.force or REBUILD or DEBUG:
            return False
        built = self._inplace(ext)
        try:
            with open(self._stamp_path(ext)) as f:
                stamp = json.load(f)
            if stamp != {**self._stamp(ext), "built": _digest(built)}:
                return False
        except (OSError, ValueError):
            return False
        dest = self.get_ext_fullpath(ext.name)
        if os.path.abspath(dest) != built:
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            self.copy_file(built, dest)
        print(f"kvcache: {ext.name}: sources unchanged since it was built, not rebuilt", flush=True)
        return True

    def _write_stamp(self, ext: Extension) -> None:
        """Remember how the module in place was built (after the build copied it there)."""
        os.makedirs(os.path.dirname(self._stamp_path(ext)), exist_ok=True)
        with open(self._stamp_path(ext), "w") as f:
            json.dump({**self._stamp(ext), "built": _digest(self._inplace(ext))}, f)


def _digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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
