"""Builds kvcache's Cython extensions (ext/*.pyx → kvcache/_native/*.so); metadata is in pyproject.toml.

Every extension has a pure-Python twin in kvcache/, so a machine without a compiler still
installs a working (slower) kvcache. KVCACHE_DEBUG_BUILD=1 builds with assertions, bounds
checks and -O0 -g for gdb/valgrind; the default is an optimized build.
"""
import glob
import os

from setuptools import Extension, setup

DEBUG = os.environ.get("KVCACHE_DEBUG_BUILD") == "1"


# Extensions that link a system library, and the header that says it is installed. Without
# it the extension is skipped (its pure-Python twin serves); `make test` installs it.
SYSTEM_LIBS = {"ext/getpath.pyx": "lmdb.h"}  # Debian/Ubuntu: liblmdb-dev


def have_header(name: str) -> bool:
    dirs = [os.environ.get("KVCACHE_INCLUDE", ""), "/usr/include", "/usr/local/include",
            "/opt/homebrew/include"]
    return any(d and os.path.exists(os.path.join(d, name)) for d in dirs)


def extensions():
    sources = []
    for src in sorted(glob.glob("ext/*.pyx")):
        header = SYSTEM_LIBS.get(src)
        if header and not have_header(header):
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


setup(ext_modules=extensions())
