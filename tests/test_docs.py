"""docs/ is the contract: every configuration key, command, INFO field and subcommand the code
has is documented there, and the configuration tables name no key the code lacks."""
from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

from kvcache import cli, config
from kvcache.serve.commands import COMMAND_SPECS

DOCS = Path(__file__).resolve().parent.parent / "docs"
KVCACHE = Path(__file__).resolve().parent.parent / "kvcache"


def _doc(name: str) -> str:
    return (DOCS / name).read_text()


def _config_keys() -> set[str]:
    keys = set()
    for cls in (config.Config, config.NatsConfig, config.BucketConfig, config.PeerConfig):
        # requirepass: the password itself, from requirepass_file or KVCACHE_REQUIREPASS only
        # and a field of its own state (`_`: BucketConfig's compiled filters) is no key
        keys |= {f.name for f in dataclasses.fields(cls)
                 if f.name not in ("nats", "buckets", "peers", "requirepass") and not f.name.startswith("_")}
    return keys


def test_every_configuration_key_is_documented_and_no_other():
    text = _doc("configuration.md")
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", text, re.M))
    assert _config_keys() - documented == set()
    assert documented - _config_keys() == set()


def test_every_command_is_documented():
    text = _doc("commands.md")
    missing = [name for name in COMMAND_SPECS if f"`{name.upper()}" not in text]
    assert missing == []


def _info_fields() -> set[str]:
    """Field names INFO prints: the literal (name, value) rows and _fields(...) keywords of
    kvcache/serve/info.py, and the router's routing rows."""
    names: set[str] = set()
    for path in (KVCACHE / "serve" / "info.py", KVCACHE / "read" / "router.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Tuple) and len(node.elts) == 2 and isinstance(node.elts[0], ast.Constant) \
                    and isinstance(node.elts[0].value, str) and re.fullmatch(r"[a-z0-9_]+", node.elts[0].value):
                names.add(node.elts[0].value)
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_fields":
                names |= {kw.arg for kw in node.keywords if kw.arg}
    return names


def test_every_info_field_is_documented():
    text = _doc("info.md")
    assert len(_info_fields()) > 30  # the walk found the fields (not a vacuous pass)
    assert sorted(f for f in _info_fields() if f"`{f}`" not in text) == []


def test_every_subcommand_is_documented():
    import argparse
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    text = _doc("cli.md")
    assert sorted(n for n in sub.choices if f"## `kvcache {n}`" not in text) == []


def test_the_code_cites_docs_not_an_outside_design_document():
    cited = [str(p) for p in KVCACHE.rglob("*.py") if "DESIGN.md" in p.read_text()]
    assert cited == []


def test_each_doc_says_each_thing_once():
    """No heading twice in one document (a section pasted in again drifts from its twin),
    and no metric described in two rows."""
    for path in sorted(DOCS.glob("*.md")):
        headings = re.findall(r"^#{1,6} .+$", path.read_text(), re.M)
        assert sorted({h for h in headings if headings.count(h) > 1}) == [], path.name
    rows = re.findall(r"^\| `(kvcache_[a-z_]+)` \|", _doc("metrics.md"), re.M)
    assert len(rows) > 40 and sorted({r for r in rows if rows.count(r) > 1}) == []
