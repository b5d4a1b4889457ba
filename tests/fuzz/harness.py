"""What every fuzz harness (tests/fuzz/fuzz_*.py) shares: how a fuzz input is read, how the
native module and its pure-Python twin are run on it and compared, how a difference is told.

A harness checks one native reader against its twin (kvcache/native.py pairs them): the same
bytes, fed whole and cut at the fuzzer's chosen boundaries, must give the same outcome on
both (values, and the error's class and message where one is raised), and each twin must give
the same outcome whole as cut (up to what the contract leaves free, e.g. how a NATS fast lane
groups its runs). Memory errors and undefined behaviour in the C code are the sanitizers' to
report (`make fuzz` runs the harnesses on modules built with ASan and UBSan); a difference
or an exception the contract does not allow is reported here, as a Python bytes literal to
paste into a test, with both outcomes, and stops the run.

A fuzz input is `options, n, choices[n], wire`: `options` picks a harness's settings (limits,
protocol, ...), the `n` (at most MAX_CHOICES) choice bytes cut the wire (each gives one chunk of
1 to 256 bytes, in turn, until the wire is used up) and make the harness's other choices, and
`wire` is what the reader is fed. `encode` makes one (the seeds: the test vectors).

`python tests/fuzz/harness.py READER [libFuzzer arguments]` runs one harness under atheris
(tests/fuzz/run.py, `make fuzz`); `python tests/fuzz/run.py --replay READER FILE` runs one
input once, with whatever build of the native modules is importable.
"""
from __future__ import annotations

import importlib
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

MAX_CHOICES = 8
# FUZZ_EVERY_SPLIT=N: a wire of at most N bytes is also fed cut at every boundary (in two, and
# byte by byte), as the unit tests feed their vectors: `make fuzz-short` sets it
EVERY_SPLIT = int(os.environ.get("FUZZ_EVERY_SPLIT", "0") or 0)
# where `make fuzz` put the sanitized modules (build/fuzz/lib/kvcache/_native): searched before
# kvcache/_native, so that the in-place modules stay as they are
NATIVE_DIR = os.environ.get("KVCACHE_FUZZ_NATIVE", "")
# a reader's harness module (tests/fuzz/fuzz_<reader>.py) -> the pure-Python modules of its twin
# that atheris instruments, so that the fuzzer is guided by the branches and comparisons of
# both twins (the native side's come from the compiler)
INSTRUMENT = {
    "resp_request": ("kvcache.resp",),
    "resp_reply": ("kvcache.resp",),
    "nats": ("kvcache.natsio.natsproto", "kvcache.store.record", "kvcache.entry"),
    "server_get": ("kvcache.serve.server_get", "kvcache.resp"),
}
READERS = tuple(INSTRUMENT)
REPR_MAX = 1500  # characters of one outcome in a report


@dataclass(frozen=True)
class Case:
    """One fuzz input, read."""

    options: int
    choices: bytes
    wire: bytes

    def chunks(self) -> list[bytes]:
        """The wire cut as the choice bytes say (whole without any)."""
        if not self.choices:
            return [self.wire]
        out, pos, i = [], 0, 0
        while pos < len(self.wire):
            size = self.choices[i % len(self.choices)] + 1
            out.append(self.wire[pos:pos + size])
            pos += size
            i += 1
        return out

    def choice(self, i: int, n: int) -> int:
        """The i-th choice among n (0 without choice bytes)."""
        return self.choices[i % len(self.choices)] % n if self.choices and n > 0 else 0


def decode(data: bytes) -> Case:
    if len(data) < 2:
        return Case(0, b"", data)
    n = data[1] % (MAX_CHOICES + 1)
    return Case(data[0], data[2:2 + n], data[2 + n:])


def encode(wire: bytes, options: int = 0, choices: bytes = b"") -> bytes:
    assert len(choices) <= MAX_CHOICES
    return bytes([options & 0xFF, len(choices)]) + choices + wire


def splits(wire: bytes) -> list[list[bytes]]:
    """Every two-chunk cut, and byte by byte."""
    return [[wire[:i], wire[i:]] for i in range(1, len(wire))] + [[wire[i:i + 1] for i in range(len(wire))]]


class Difference(AssertionError):
    """The twins disagree, or one raised what the contract does not allow: the report says how."""


@dataclass(frozen=True)
class Raised:
    """An exception as an outcome: compared by class and message (and the values a
    ProtocolError carries, e.g. the NATS reader's events before it)."""

    kind: str
    message: str
    extra: Any = None
    trace: str = ""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Raised) and (self.kind, self.message, self.extra) == (
            other.kind, other.message, other.extra)

    def __hash__(self) -> int:
        return hash((self.kind, self.message))

    def __repr__(self) -> str:
        extra = "" if self.extra is None else f", carrying {self.extra!r}"
        return f"raised {self.kind}({self.message!r}{extra})"


def outcome(run: Callable[[], Any], extra: Callable[[BaseException], Any] | None = None) -> Any:
    """What `run()` returns, or the Raised it raised."""
    try:
        return run()
    except Exception as e:
        return Raised(f"{type(e).__module__}.{type(e).__qualname__}", str(e),
                      extra(e) if extra is not None else None, traceback.format_exc())


def raised_within(value: Any) -> Raised | None:
    """The Raised in an outcome: the outcome itself, or a (results..., Raised) a runner
    returns to keep what came before the error."""
    if isinstance(value, Raised):
        return value
    if isinstance(value, tuple):
        return next((v for v in value if isinstance(v, Raised)), None)
    return None


def bytes_literal(data: bytes, limit: int = REPR_MAX) -> str:
    text = repr(data)
    return text if len(text) <= limit else text[:limit] + f"... ({len(data)} bytes)"


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= REPR_MAX else text[:REPR_MAX] + f"... ({len(text)} characters)"


def first_difference(a: Any, b: Any, path: str = "") -> tuple[str, Any, Any] | None:
    """Where two outcomes first differ: (index path, a's part, b's part), or None."""
    if a == b:
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and type(a) is type(b):
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            found = first_difference(x, y, f"{path}[{i}]")
            if found is not None:
                return found
        if len(a) != len(b):
            n = min(len(a), len(b))
            return f"{path}[{n}:]", list(a[n:n + 3]), list(b[n:n + 3])
    return path or "the whole", a, b


def report(reader: str, case: Case, what: str, chunks: list[bytes], sides: dict[str, Any],
           settings: str = "") -> str:
    lines = [f"fuzz: DIFFERENCE in {reader}: {what}",
             f"  input    = {bytes_literal(case.wire)}",
             f"  chunks   = {[len(c) for c in chunks]} (lengths)"]
    if settings:
        lines.append(f"  settings = {settings}")
    names = list(sides)
    for name, value in sides.items():
        lines.append(f"  {name:<8} = {_shown(value)}")
    if len(names) == 2:
        found = first_difference(sides[names[0]], sides[names[1]])
        if found is not None:
            where, x, y = found
            lines.append(f"  first difference at {where}: {names[0]} {_shown(x)}, {names[1]} {_shown(y)}")
    for name, value in sides.items():
        raised = raised_within(value)
        if raised is not None and raised.trace:
            lines.append(f"  ({name} raised here:)")
            lines.extend("    " + line for line in raised.trace.rstrip().splitlines()[-8:])
    return "\n".join(lines)


def fail(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
    raise Difference(text)


def differential(reader: str, case: Case, run: Callable[[ModuleType, list[bytes]], Any],
                 native: ModuleType, twin: ModuleType, allowed: tuple[type[BaseException], ...],
                 same_whole_as_cut: Callable[[Any], Any] | None = lambda v: v,
                 settings: str = "") -> None:
    """Run `run(module, chunks)` on both twins, whole and cut (and at every boundary when
    EVERY_SPLIT allows), and fail on the first difference: native against twin on the same
    chunks; and, unless `same_whole_as_cut` is None, each twin whole against itself cut, both
    seen through it (it drops what the contract leaves free). An exception other than
    `allowed` is a finding even where both raise it."""
    allowed_names = {f"{c.__module__}.{c.__qualname__}" for c in allowed}
    chunkings = [[case.wire], case.chunks()]
    if len(case.wire) <= EVERY_SPLIT:
        chunkings += splits(case.wire)
    whole: dict[str, Any] = {}
    for i, chunks in enumerate(chunkings):
        got = {"native": outcome(lambda m=native, c=chunks: run(m, c)),
               "twin": outcome(lambda m=twin, c=chunks: run(m, c))}
        for name, value in got.items():
            raised = raised_within(value)
            if raised is not None and raised.kind not in allowed_names:
                fail(report(reader, case, f"the {name} raised {raised.kind}, which the contract does not allow",
                            chunks, got, settings))
        if got["native"] != got["twin"]:
            fail(report(reader, case, "native and twin differ", chunks, got, settings))
        if i == 0:
            whole = got
        elif same_whole_as_cut is not None:
            for name, value in got.items():
                a, b = same_whole_as_cut(whole[name]), same_whole_as_cut(value)
                if a != b:
                    fail(report(reader, case, f"the {name} differs fed whole and fed cut", chunks,
                                {f"{name} whole": a, f"{name} cut": b}, settings))


# --------------------------------------------------------------------------- the modules


def _native_first() -> None:
    """Put NATIVE_DIR before kvcache/_native, before anything imports a native module (the
    store imports its near-cache hit counter when it is imported: a module loaded from the
    in-place build would be the one every later import and cimport gets)."""
    if NATIVE_DIR:
        import kvcache._native
        if NATIVE_DIR not in kvcache._native.__path__:
            kvcache._native.__path__.insert(0, NATIVE_DIR)


_native_first()


def native_module(name: str) -> ModuleType:
    """kvcache._native.<name>: the sanitized build when KVCACHE_FUZZ_NATIVE names one, else the
    one in place; never the twin (a harness without the native side checks nothing)."""
    try:
        module = importlib.import_module(f"kvcache._native.{name}")
    except ImportError as e:
        raise SystemExit(f"fuzz: kvcache._native.{name} does not import ({e}): build the native modules "
                         "(make install, or make fuzz for the sanitized ones)") from None
    if NATIVE_DIR:
        strays = [f for f in loaded_natives() if not os.path.samefile(os.path.dirname(f), NATIVE_DIR)]
        if strays:
            raise SystemExit(f"fuzz: native modules loaded from outside {NATIVE_DIR}: {', '.join(strays)}")
    return module


def loaded_natives() -> list[str]:
    """The files of the kvcache._native modules loaded now."""
    return sorted(m.__file__ or m.__name__ for name, m in list(sys.modules.items())
                  if name.startswith("kvcache._native.") and m is not None)


# --------------------------------------------------------------------------- under atheris


def main(argv: list[str]) -> None:
    """`harness.py READER [libFuzzer arguments]`: the reader's harness under atheris, the
    modules of its pure-Python twin (INSTRUMENT) imported first, instrumented."""
    import atheris

    if len(argv) < 2 or argv[1] not in READERS:
        raise SystemExit(f"usage: harness.py {{{','.join(READERS)}}} [libFuzzer arguments]")
    reader = argv[1]
    atheris.enabled_hooks.add("str")
    if os.environ.get("FUZZ_PYTHON_COVERAGE", "1") != "0":
        with atheris.instrument_imports(include=list(INSTRUMENT[reader])):
            for name in INSTRUMENT[reader]:
                importlib.import_module(name)
    target = importlib.import_module(f"fuzz_{reader}")
    target.setup()
    print(f"fuzz: {reader}: native modules loaded: {' '.join(loaded_natives())}", flush=True)
    atheris.Setup([argv[0], *argv[2:]], target.check)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
