"""The one place that chooses between a Cython extension and its pure-Python twin.

Every native module in kvcache/_native (built from ext/*.pyx) has a twin in kvcache/ with the
same API and the same errors, tested on the same wire vectors. The twin is used when the
extension is not built, or always when KVCACHE_NO_EXTENSIONS=1 (to compare, or to debug).

The choice is never silent: `report()` says which implementation serves each module and why
(the sidecar logs it at start and shows it in `INFO server` as `native`), a module that is
built but fails to import is told apart from one that is not built, and
KVCACHE_REQUIRE_EXTENSIONS=1 (set by CI) turns a missing or broken extension into an error,
for the sidecar and for the test suites that compare natives with twins (`native_or_none`).
"""
from __future__ import annotations

import importlib
import os
from types import ModuleType

from .errors import KvcacheError

# The one table of implementations: each extension in kvcache/_native (built from ext/<name>.pyx)
# -> its pure-Python twin under kvcache/, and what it does. Modules ask `load(name)`; nothing else
# chooses.
EXTENSIONS = {
    "resp": "resp",              # the server's RESP request reader and the client's reply reader
    "natsproto": "natsio.proto",  # the NATS protocol reader under the feeds' and peers' connections
    "server_get": "serve.get",   # the server's GET fast path over the replica
    "app_get": "app.get",        # LocalReader.get in an application's process
}

NO_EXTENSIONS = os.environ.get("KVCACHE_NO_EXTENSIONS", "") not in ("", "0")
REQUIRE_EXTENSIONS = os.environ.get("KVCACHE_REQUIRE_EXTENSIONS", "") not in ("", "0")

# native name -> "native", or why the twin serves
CHOSEN: dict[str, str] = {}


class MissingExtension(KvcacheError, ImportError):
    """KVCACHE_REQUIRE_EXTENSIONS is set and an extension is not built or does not import."""


def _load(native: str) -> tuple[ModuleType | None, str]:
    """The extension and "native", or None and why not."""
    full = f"kvcache._native.{native}"
    try:
        return importlib.import_module(full), "native"
    except ModuleNotFoundError as e:
        if e.name in (full, "kvcache._native"):
            return None, "not built"
        return None, f"broken: {e}"
    except ImportError as e:  # built, but does not load (a missing symbol, another Python)
        return None, f"broken: {e}"


def load(name: str) -> ModuleType:
    """The implementation serving `name` (a key of EXTENSIONS), chosen once and recorded."""
    return pick(name, EXTENSIONS[name])


def pick(native: str, twin: str) -> ModuleType:
    """`kvcache._native.<native>` when built and allowed, else `kvcache.<twin>` (recorded in
    CHOSEN; an error instead when extensions are required)."""
    if NO_EXTENSIONS:
        CHOSEN[native] = "twin (KVCACHE_NO_EXTENSIONS=1)"
        return importlib.import_module(f"kvcache.{twin}")
    module, why = _load(native)
    if module is not None:
        CHOSEN[native] = "native"
        return module
    if REQUIRE_EXTENSIONS:
        raise MissingExtension(f"kvcache._native.{native} is {why} and KVCACHE_REQUIRE_EXTENSIONS=1: "
                               "build it (pip install -e . with a C compiler and the Python headers)")
    CHOSEN[native] = f"twin ({why})"
    return importlib.import_module(f"kvcache.{twin}")


def native_or_none(native: str) -> ModuleType | None:
    """For tests that compare an extension with its twin: the extension, or None when it is
    not built; with KVCACHE_REQUIRE_EXTENSIONS=1 a missing one fails instead of skipping."""
    module, why = _load(native)
    if module is None and REQUIRE_EXTENSIONS:
        raise MissingExtension(f"kvcache._native.{native} is {why} and KVCACHE_REQUIRE_EXTENSIONS=1")
    return module


def report() -> dict[str, str]:
    """Which implementation serves each module (every one chosen now if not yet)."""
    for native, twin in EXTENSIONS.items():
        if native not in CHOSEN:
            pick(native, twin)
    return {native: CHOSEN[native] for native in EXTENSIONS}


def lmdb_version() -> str:
    """The LMDB compiled into the native GET path ("0.9.36"), or "" when its twin serves (which
    reads through py-lmdb's)."""
    if report()["server_get"] != "native":
        return ""
    full = importlib.import_module("kvcache._native.server_get").LMDB_VERSION  # "LMDB 0.9.36: (date)"
    return full.split()[1].rstrip(":")


def all_native() -> bool:
    return all(v == "native" for v in report().values())


def is_native(module: ModuleType) -> bool:
    return module.__name__.startswith("kvcache._native.")
