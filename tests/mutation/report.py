"""The mutation score of the modules that decide what a read may answer, and the check that
every surviving mutant is explained (`make mutation` runs it after `mutmut run`).

mutmut (pyproject.toml, [tool.mutmut]) leaves its results in ./mutants: per mutated file a
`.meta` (each mutant's exit code) and a `.spans` index from which `get_diff_for_mutant`
reads the mutant back. This prints killed / total per module, then every survivor with the
line it changed, and fails (exit 1) when a survivor has no entry in tests/mutation/survivors.md:
a refactor that adds a mutant no test notices turns `make mutation` red until a test kills
it or a reason says why it cannot change behaviour.

An entry of survivors.md names the function and the change, not mutmut's number for it (the
numbers shift whenever a function is edited):

    - `kvcache.read.policy.ReadPolicy.resolve`: `"ERR invalid key: not UTF-8"` -> `"XXERR ...XX"` — reason

that is, a bullet, the function's dotted name in backticks, a colon, the removed and added
text in backticks (each the changed lines, stripped, joined with " / "), an em dash and the
reason. `python tests/mutation/report.py --draft` prints the entries still missing, with
"REASON?" where the reason goes, for pasting.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SURVIVORS = Path(__file__).with_name("survivors.md")
# mutmut's exit codes (mutmut.stats.status_by_exit_code): a test failed (1; 3: pytest's own
# error), it ran past its time (timeouts: the mutant hangs, which a test notices too), or
# the mutant crashed the worker.
KILLED = {1, 3, 24, -24, 36, 152, 255, -11, -9}
SURVIVED = {0}
NO_TESTS = {5, 33}
ENTRY = re.compile(r"^- `(?P<func>[^`]+)`: `(?P<old>.*)` -> `(?P<new>.*)` — (?P<reason>\S.*)$")
SEP = "ǁ"  # mutmut's separator between class and method in a mangled name


@dataclass(frozen=True)
class Mutant:
    name: str  # mutmut's name: kvcache.read.ledger.xǁFloorsǁbelow__mutmut_3
    module: str
    func: str  # kvcache.read.ledger.Floors.below
    status: str  # killed, survived, no tests, timeout, not checked
    old: str
    new: str

    @property
    def key(self) -> tuple[str, str, str]:
        return self.func, self.old, self.new


def dotted(name: str) -> str:
    """kvcache.read.ledger.xǁFloorsǁbelow__mutmut_3 -> kvcache.read.ledger.Floors.below"""
    mangled = name.partition("__mutmut_")[0]
    module, _, fn = mangled.rpartition(".")
    if SEP in fn:
        _, cls, meth = fn.split(SEP)
        return f"{module}.{cls}.{meth}"
    return f"{module}.{fn[2:]}"


def change(diff: str) -> tuple[str, str]:
    """The removed and added lines of a mutant's unified diff, stripped, joined with " / "."""
    old, new = [], []
    for line in diff.splitlines():
        if line.startswith(("---", "+++", "@@")):
            continue
        if line.startswith("-"):
            old.append(line[1:].strip())
        elif line.startswith("+"):
            new.append(line[1:].strip())
    return " / ".join(old), " / ".join(new)


def status_of(code: int | None) -> str:
    if code is None:
        return "not checked"
    if code in KILLED:
        return "killed"
    if code in SURVIVED:
        return "survived"
    if code in NO_TESTS:
        return "no tests"
    return f"exit {code}"


def load(mutants_dir: Path) -> list[Mutant]:
    """Every mutant mutmut made, with its result and (for the ones not killed) its change."""
    from mutmut.mutation.diff_apply import get_diff_for_mutant  # (the mutation extra's)

    found: list[Mutant] = []
    for meta in sorted(mutants_dir.rglob("*.py.meta")):
        rel = meta.relative_to(mutants_dir).with_suffix("")  # kvcache/read/ledger.py
        module = str(rel.with_suffix("")).replace("/", ".")
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        for name, code in sorted(codes.items(), key=lambda kv: _natural(kv[0])):
            status = status_of(code)
            old = new = ""
            if status != "killed":
                old, new = change(get_diff_for_mutant(name, path=rel))
            found.append(Mutant(name, module, dotted(name), status, old, new))
    return found


def _natural(name: str) -> tuple[str, int]:
    base, _, n = name.rpartition("__mutmut_")
    return base, int(n) if n.isdigit() else 0


def reasons(path: Path) -> tuple[dict[tuple[str, str, str], str], list[str]]:
    """survivors.md's entries by (function, removed, added), and the lines that look like an
    entry but do not parse."""
    entries: dict[tuple[str, str, str], str] = {}
    bad: list[str] = []
    if not path.exists():
        return entries, bad
    for line in path.read_text().splitlines():
        if not line.startswith("- `"):
            continue
        m = ENTRY.match(line)
        if m is None:
            bad.append(line)
            continue
        entries[(m["func"], m["old"], m["new"])] = m["reason"]
    return entries, bad


def entry(m: Mutant, reason: str) -> str:
    return f"- `{m.func}`: `{m.old}` -> `{m.new}` — {reason}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mutants", type=Path, default=ROOT / "mutants", help="mutmut's output (default ./mutants)")
    ap.add_argument("--survivors", type=Path, default=SURVIVORS, help="the reasons file")
    ap.add_argument("--draft", action="store_true", help="print the missing entries, for pasting")
    args = ap.parse_args(argv)

    if not any(args.mutants.rglob("*.py.meta")):
        print(f"no mutmut results under {args.mutants}: run `make mutation` (or `mutmut run`) first")
        return 2
    mutants = load(args.mutants)
    known, bad = reasons(args.survivors)

    by_module: dict[str, Counter[str]] = {}
    for m in mutants:
        by_module.setdefault(m.module, Counter())[m.status] += 1
    print(f"{'module':34} {'killed':>7} {'total':>6} {'score':>6}  not killed")
    total = Counter[str]()
    for module, c in by_module.items():
        n = sum(c.values())
        total.update(c)
        rest = ", ".join(f"{k} {v}" for k, v in sorted(c.items()) if k != "killed")
        print(f"{module:34} {c['killed']:>7} {n:>6} {100 * c['killed'] / n:>5.1f}%  {rest}")
    n = sum(total.values())
    print(f"{'all':34} {total['killed']:>7} {n:>6} {100 * total['killed'] / n:>5.1f}%")

    alive = [m for m in mutants if m.status != "killed"]
    explained = [m for m in alive if m.key in known]
    missing = [m for m in alive if m.key not in known]
    stale = set(known) - {m.key for m in alive}
    print(f"\n{len(alive)} mutants not killed, {len(explained)} explained in "
          f"{args.survivors.relative_to(ROOT) if args.survivors.is_relative_to(ROOT) else args.survivors}")
    print()
    print(args.survivors.read_text() if args.survivors.exists() else "(no survivors file)")
    if stale:
        print(f"note: {len(stale)} entries of the survivors file match no surviving mutant now "
              "(killed since, or the code changed): remove them")
        for func, old, new in sorted(stale):
            print(f"  `{func}`: `{old}` -> `{new}`")
    for line in bad:
        print(f"error: not an entry (- `function`: `removed` -> `added` — reason): {line}")
    if missing:
        print(f"\nerror: {len(missing)} surviving mutants have no test that kills them and no reason "
              f"in {args.survivors.name}:")
        for m in missing:
            print(entry(m, "REASON?") + f"   [{m.status}: mutmut show {m.name}]")
    if args.draft:
        return 0
    return 1 if missing or bad else 0


if __name__ == "__main__":
    sys.exit(main())
