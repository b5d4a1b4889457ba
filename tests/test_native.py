"""kvcache.native: the choice between an extension and its twin is made in one place, recorded,
and an error instead of a silent fallback when KVCACHE_REQUIRE_EXTENSIONS=1 (CI sets it)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvcache import native


def test_report_names_every_extension():
    chosen = native.report()
    assert set(chosen) == set(native.EXTENSIONS)
    for name, how in chosen.items():
        assert how == "native" or how.startswith("twin ("), (name, how)
    if native.REQUIRE_EXTENSIONS and not native.NO_EXTENSIONS:
        assert native.all_native(), chosen


def test_not_built_is_told_apart_and_required_is_an_error(monkeypatch):
    assert native._load("nosuch") == (None, "not built")
    monkeypatch.setattr(native, "NO_EXTENSIONS", False)
    monkeypatch.setattr(native, "REQUIRE_EXTENSIONS", False)
    assert native.pick("nosuch", "resp").__name__ == "kvcache.resp"
    assert native.CHOSEN.pop("nosuch") == "twin (not built)"
    assert native.native_or_none("nosuch") is None
    monkeypatch.setattr(native, "REQUIRE_EXTENSIONS", True)
    with pytest.raises(native.MissingExtension, match="nosuch is not built"):
        native.pick("nosuch", "resp")
    with pytest.raises(native.MissingExtension):
        native.native_or_none("nosuch")


@pytest.mark.servers  # starts a process
def test_forced_twins_are_reported_as_such():
    env = {**os.environ, "KVCACHE_NO_EXTENSIONS": "1", "KVCACHE_REQUIRE_EXTENSIONS": "1"}
    out = subprocess.run([sys.executable, "-c", "from kvcache import native; print(native.report())"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("twin (KVCACHE_NO_EXTENSIONS=1)") == len(native.EXTENSIONS)
