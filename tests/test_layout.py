"""The house rules that can be checked by reading the code: no import cycle among kvcache's
modules (TYPE_CHECKING imports count), and no module of the server side imported by the
application side (the client and LocalReader stay light)."""
from __future__ import annotations

import subprocess
import sys

import pytest
from support.modgraph import cycles, graph

SERVER_SIDE = {"kvcache.serve.server", "kvcache.serve.commands", "kvcache.sidecar", "kvcache.feed.feed",
               "kvcache.read.router", "kvcache.serve.get", "kvcache.feed.consumer", "kvcache.feed.sweeps",
               "kvcache.serve.info", "kvcache.read.peer"}


def test_no_import_cycle():
    g = graph()
    assert len(g) > 30  # the walk found the modules
    assert cycles(g) == []


def test_a_cycle_is_found_when_there_is_one():
    assert cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]


@pytest.mark.servers  # a fresh interpreter: a process
def test_the_application_side_does_not_load_the_server():
    """`import kvcache.app.client` / `kvcache.app.reader` (what an application imports) loads none of
    the server side: a read from the application costs no import of the sidecar."""
    code = ("import sys, kvcache.app.client, kvcache.app.reader; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('kvcache'))))")
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                check=True).stdout.split())
    assert "kvcache.app.reader" in loaded
    assert loaded & SERVER_SIDE == set()
