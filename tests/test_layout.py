"""The house rules that can be checked by reading the code, as rules over kvcache's folders
(docs/architecture.md, Where it lives): kvcache's folders and top-level modules stand in
layers, and a module imports only from its own layer or the ones below (no arrow back up); no
import cycle among kvcache's modules; the application side (app/) imports nothing of the
sidecar's sides, and the store (store/) nothing of the sides built on it. TYPE_CHECKING
imports count: an annotation is a dependency too."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support.modgraph import ROOT, cycles, graph

FOLDERS = {"app", "serve", "read", "feed", "store", "natsio", "ops", "pipeline", "supervisors", "_native"}

# The layers, bottom layer first: folders by name, top-level modules by their name without
# `kvcache.` ("kvcache" is the package itself). A module may import from its own layer and
# the layers below it, never from one above.
LAYERS: list[tuple[str, ...]] = [
    # the shared modules, each imported by many sides: exceptions, the key grammar, the KV
    # entry, the shared counters, the native extensions' table and the built extensions, RESP
    ("errors", "keys", "entry", "stats", "native", "_native", "resp"),
    ("store",),                                       # the LMDB replica: the sidecar's and the application's
    ("app", "kvcache"),                               # the application side over it, and the public API
    ("config", "config_sources", "config_nats"),      # the settings: read, checked, the NATS credentials
    ("natsio",),                                      # NATS: the connection, the protocol, JetStream's API
    ("feed",),                                        # the buckets' feeds into the replica
    ("ops",),                                         # metrics, latency, health, logs, the access log
    ("read",),                                        # the read decisions and reads to NATS and peers
    ("serve",),                                       # the RESP server and the command layer
    ("pipeline",),                                    # the Spark jobs
    ("supervisors",),                                 # the worker processes (workers = N)
    ("demo", "sidecar"),                              # wiring the parts together
    ("cli", "__main__"),                              # the `kvcache` command
]

# folder (or top-level module) -> what its modules may not import: folders by name, top-level
# modules by their module name
RULES = {
    # what an application imports stays light: no server, no NATS, no sidecar, no configuration
    "app": {"serve", "read", "feed", "natsio", "ops", "pipeline", "kvcache.sidecar", "kvcache.cli",
            "kvcache.config", "kvcache.config_sources", "kvcache.config_nats", "kvcache.demo"},
    # the LMDB replica is shared by the sidecar and the application's LocalReader
    "store": {"serve", "read", "feed", "app", "natsio", "ops", "pipeline", "kvcache.sidecar", "kvcache.cli"},
}
# the sides an application must never load: everything of the sidecar (the set the subprocess
# check below compares with)
SIDECAR_SIDES = {"serve", "read", "feed", "natsio", "ops", "pipeline"}


def folder(module: str) -> str:
    """kvcache.serve.server_get -> "serve"; a top-level module is its own name (kvcache.sidecar)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in FOLDERS) else module


def leaks(g: dict[str, list[str]], rules: dict[str, set[str]] = RULES) -> list[str]:
    """Every import that breaks a rule, as "importer -> imported"."""
    return [f"{m} -> {d}" for m, deps in sorted(g.items()) for d in deps
            if folder(m) in rules and folder(d) in rules[folder(m)]]


def layer(module: str, layers: list[tuple[str, ...]] = LAYERS) -> int:
    """The layer a module stands in (0: the bottom layer): its folder's, or its own."""
    name = folder(module).removeprefix("kvcache.")
    return next(i for i, names in enumerate(layers) if name in names)


def climbs(g: dict[str, list[str]], layers: list[tuple[str, ...]] = LAYERS) -> list[str]:
    """Every import from a lower layer to a higher one, as "importer -> imported"."""
    return [f"{m} -> {d}" for m, deps in sorted(g.items()) for d in deps if layer(d, layers) > layer(m, layers)]


def test_every_module_is_in_a_folder_or_a_shared_one():
    """A new module goes into the folder of its side; the top level holds the shared modules and
    the ones that wire or run the whole (a new one there is a decision: add it here)."""
    top = {m for m in graph() if m.count(".") == 1 and folder(m) == m}
    assert top == {f"kvcache.{m}" for m in ("__main__", "cli", "config", "config_sources", "config_nats",
                                            "demo", "entry", "errors", "keys", "native", "resp", "sidecar",
                                            "stats")}
    on_disk = {p.name for p in (ROOT / "kvcache").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert on_disk == FOLDERS


def test_every_folder_and_top_level_module_is_in_one_layer():
    """The layers name every folder and top-level module once, and nothing else: a new one is
    placed in a layer when it is added."""
    placed = [name for names in LAYERS for name in names]
    assert len(placed) == len(set(placed))
    assert set(placed) == {folder(m).removeprefix("kvcache.") for m in graph()}


def test_no_import_climbs_a_layer():
    g = graph()
    assert len(g) > 30  # the walk found the modules
    assert climbs(g) == []


def test_a_climb_is_found_when_there_is_one(tmp_path: Path):
    """An arrow back up is reported, a TYPE_CHECKING one too, and only it: the checker over
    the real graph with an arrow injected, and over a package written for the test (the arrow
    config -> serve/ this layout once had, under TYPE_CHECKING)."""
    g = {m: list(deps) for m, deps in graph().items()}
    g["kvcache.store.replica"].append("kvcache.serve.server_get")
    g["kvcache.stats"] = [*g["kvcache.stats"], "kvcache.ops.latency"]
    assert climbs(g) == ["kvcache.stats -> kvcache.ops.latency", "kvcache.store.replica -> kvcache.serve.server_get"]
    for path, text in {"__init__.py": "", "errors.py": "", "serve/__init__.py": "",
                       "serve/keyspace_events.py": "from ..errors import CommandError\n",
                       "config.py": "from typing import TYPE_CHECKING\nfrom .errors import ConfigError\n"
                                    "if TYPE_CHECKING:\n    from .serve.keyspace_events import parse_flags\n"}.items():
        (tmp_path / "kvcache" / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "kvcache" / path).write_text(text)
    assert climbs(graph(tmp_path)) == ["kvcache.config -> kvcache.serve.keyspace_events"]


def test_the_layers_keep_the_rules():
    """What app/ and store/ may not import stands in layers above them: the layers alone would
    refuse it, so the order cannot drift away from the rules below."""
    for side, forbidden in RULES.items():
        assert all(layer(f"kvcache.{name}.x" if name in FOLDERS else name) > layer(f"kvcache.{side}.x")
                   for name in forbidden), side


def test_no_import_cycle():
    g = graph()
    assert len(g) > 30  # the walk found the modules
    assert cycles(g) == []


def test_a_cycle_is_found_when_there_is_one():
    assert cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]


def test_the_application_side_and_the_store_import_only_what_they_may():
    g = graph()
    assert any(folder(m) == "app" for m in g) and any(folder(m) == "store" for m in g)
    assert leaks(g) == []


def test_a_leak_is_found_when_there_is_one():
    g = {"kvcache.app.reader": ["kvcache.store.replica", "kvcache.read.policy"],
         "kvcache.app.client": ["kvcache.resp", "kvcache.config"],
         "kvcache.store.replica": ["kvcache.errors"], "kvcache.serve.server_get": ["kvcache.store.replica"]}
    assert leaks(g) == ["kvcache.app.client -> kvcache.config", "kvcache.app.reader -> kvcache.read.policy"]


@pytest.mark.servers  # a fresh interpreter: a process
def test_the_application_side_does_not_load_the_server():
    """`import kvcache.app.client, kvcache.app.reader` (what an application imports, and what
    kvcache.Client and kvcache.LocalReader load) loads no module of the sidecar's sides: a read
    from the application costs no import of the server, the read path or the feeds. The
    forbidden set is every module under those folders, from the tree, not a list kept by hand."""
    sidecar = {m for m in graph() if folder(m) in SIDECAR_SIDES} | {
        "kvcache.sidecar", "kvcache.cli", "kvcache.config", "kvcache.config_sources", "kvcache.config_nats",
        "kvcache.demo"}
    assert {"kvcache.serve.resp_server", "kvcache.read.reads", "kvcache.feed.feed"} <= sidecar
    code = ("import sys, kvcache.app.client, kvcache.app.reader, kvcache; kvcache.Client, kvcache.LocalReader; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('kvcache'))))")
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                check=True).stdout.split())
    assert "kvcache.app.reader" in loaded and "kvcache.store.replica" in loaded
    assert loaded & sidecar == set()
