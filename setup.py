"""Builds kvcache's Cython extensions (ext/*.pyx → kvcache/_native/*.so); metadata is in pyproject.toml.

Every extension has a pure-Python twin in kvcache/, so a machine without a compiler still
installs a working (slower) kvcache: OptionalBuildExt skips, and names, every extension that
fails to compile (KVCACHE_REQUIRE_EXTENSIONS=1 makes that an error instead).
KVCACHE_DEBUG_BUILD=1 (`make debug`) builds with assertions, bounds
checks and -O0 -g for gdb/valgrind; the default is an optimized build.
"""
import glob
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, ExecError, PlatformError

DEBUG = os.environ.get("KVCACHE_DEBUG_BUILD") == "1"
# Set to make a failed compile fail the install (CI that must test the native paths).
REQUIRE_NATIVE = os.environ.get("KVCACHE_REQUIRE_EXTENSIONS") == "1"


class OptionalBuildExt(build_ext):
    """Build each extension if it can be; one that fails to compile (no C compiler, no Python
    headers, a broken toolchain) is skipped, loudly, and its pure-Python twin serves."""

    def initialize_options(self) -> None:
        super().initialize_options()
        self.skipped: list[tuple[str, str]] = []

    def run(self) -> None:
        try:
            super().run()
        except (CCompilerError, ExecError, PlatformError, OSError) as e:  # no compiler at all
            if REQUIRE_NATIVE:
                raise
            self.skipped = [(ext.name, _first_line(e)) for ext in self.extensions]
        if self.skipped:
            bar = "!" * 78
            lines = [bar, "kvcache: WARNING: these native extensions could not be built and were SKIPPED;",
                     "kvcache: their pure-Python twins will be used (same behaviour, slower):"]
            lines += [f"kvcache:   {name}: {why}" for name, why in self.skipped]
            lines += ["kvcache: install a C compiler and the Python headers (Debian: apt-get install "
                      "gcc python3-dev liblmdb-dev) and reinstall to build them.", bar]
            print("\n".join(lines), file=sys.stderr, flush=True)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except (CCompilerError, ExecError, PlatformError, OSError) as e:
            if REQUIRE_NATIVE:
                raise
            self.skipped.append((ext.name, _first_line(e)))


def _first_line(e: BaseException) -> str:
    text = (str(e).strip() or type(e).__name__).splitlines()[0]
    return text if len(text) <= 200 else text[:90] + " ... " + text[-100:]


# Extensions that link a system library, and the header that says it is installed. Without
# it the extension is skipped (its pure-Python twin serves); `make test` installs it.
SYSTEM_LIBS = {"ext/server_get.pyx": "lmdb.h"}  # Debian/Ubuntu: liblmdb-dev


def have_header(name: str) -> bool:
    dirs = [os.environ.get("KVCACHE_INCLUDE", ""), "/usr/include", "/usr/local/include",
            "/opt/homebrew/include"]
    return any(d and os.path.exists(os.path.join(d, name)) for d in dirs)


def extensions():
    sources = []
    for src in sorted(glob.glob("ext/*.pyx")):
        header = SYSTEM_LIBS.get(src)
        if header and not have_header(header):
            if REQUIRE_NATIVE:  # fail the build now, not the sidecar's start later
                sys.exit(f"kvcache: ERROR: {header} not found and KVCACHE_REQUIRE_EXTENSIONS=1: cannot build "
                         f"{src} (Debian: apt-get install liblmdb-dev; or set KVCACHE_INCLUDE)")
            print(f"kvcache: {header} not found, not building {src} (its pure-Python twin is used)")
            continue
        sources.append(src)
    if not sources:
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
    exts = [
        Extension(f"kvcache._native.{os.path.splitext(os.path.basename(src))[0]}", [src],
                  extra_compile_args=cflags)
        for src in sources
    ]
    return cythonize(exts, compiler_directives=directives, annotate=DEBUG, include_path=["ext"],
                     force=DEBUG, quiet=True)


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
