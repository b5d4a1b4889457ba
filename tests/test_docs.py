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


ROOT = DOCS.parent
# What a clone holds and a reader follows: the docs, the READMEs, and the code and tests that cite them
LINKED = [*sorted(DOCS.glob("*.md")), ROOT / "README.md", ROOT / "bench" / "README.md",
          ROOT / "deploy" / "README.md"]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", _outside_code(path.read_text()), re.M)}


def _outside_code(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def _links(path: Path) -> list[str]:
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", _outside_code(path.read_text()))
            if not re.match(r"[a-z]+:", t)]


def test_relative_links_lead_somewhere():
    """Every relative link in the docs and READMEs names a file of the repository, and an
    anchor a heading of it (GitHub's slug)."""
    assert len([t for p in LINKED for t in _links(p)]) > 20  # the walk found links
    broken = []
    for path in LINKED:
        for target in _links(path):
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []


def test_the_repository_points_inside_itself():
    """The facts the code, tests and docs rely on are in docs/ (sources.md) with their public
    sources, never in notes beside the repository that a clone does not have."""
    kinds = (".py", ".pyx", ".pxd", ".pxi", ".md", ".toml", ".yaml", ".yml", ".sh", ".js", ".mjs")
    files = [p for d in ("kvcache", "ext", "tests", "docs", "bench", "deploy") for p in (ROOT / d).rglob("*")
             if p.suffix in kinds and "node_modules" not in p.parts and p.is_file()]
    files += [ROOT / "README.md", ROOT / "Makefile"]
    outside = re.compile(r"\.\./shared/|shared/notes/")
    here = Path(__file__).resolve()
    cited = sorted(str(p.relative_to(ROOT)) for p in files
                   if p.resolve() != here and outside.search(p.read_text(errors="replace")))
    assert len(files) > 100 and cited == []
