"""The one place that chooses between a Cython extension and its pure-Python twin.

Every native module in kvcache/_native (built from ext/*.pyx) has a twin in kvcache/ with the
same API and the same errors, tested on the same wire vectors. The twin is used when the
extension is not built, or always when KVCACHE_NO_EXTENSIONS=1 (to compare, or to debug).
"""
from __future__ import annotations

import importlib
import os
from types import ModuleType

NO_EXTENSIONS = os.environ.get("KVCACHE_NO_EXTENSIONS", "") not in ("", "0")


def pick(native: str, twin: str) -> ModuleType:
    """`kvcache._native.<native>` when built and allowed, else `kvcache.<twin>`."""
    if not NO_EXTENSIONS:
        try:
            return importlib.import_module(f"kvcache._native.{native}")
        except ImportError:
            pass
    return importlib.import_module(f"kvcache.{twin}")


def is_native(module: ModuleType) -> bool:
    return module.__name__.startswith("kvcache._native.")
