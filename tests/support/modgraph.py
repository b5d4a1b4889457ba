"""kvcache's module import graph, from the source (AST): which kvcache modules each module
imports, TYPE_CHECKING imports included, and the cycles in it. `python -m support.modgraph`
(from tests/) prints the graph."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def graph(root: Path = ROOT) -> dict[str, list[str]]:
    mods: dict[str, Path] = {}
    for p in sorted((root / "kvcache").rglob("*.py")):
        parts = p.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = p
    out: dict[str, list[str]] = {}
    for name, p in mods.items():
        package = name if p.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                for a in node.names:
                    if f"{mod}.{a.name}" in mods:
                        deps.add(f"{mod}.{a.name}")
                    elif mod in mods:
                        deps.add(mod)
        deps.discard(name)
        out[name] = sorted(deps)
    return out


def cycles(g: dict[str, list[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in g:
        if v not in index:
            visit(v)
    return found


if __name__ == "__main__":
    g = graph(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
    for name, deps in g.items():
        print(f"{name}: {', '.join(d.removeprefix('kvcache.') for d in deps)}")
    print("cycles:", cycles(g) or "none")
