"""The fuzz harnesses (tests/fuzz/fuzz_*.py), checked in process on the modules in place, so
that `make test` sees a harness that fell behind its reader's API before `make fuzz` does:
every seed passes (the twins agree on the test vectors, whole and cut at every boundary), a
difference injected into a twin is reported (and stops the harness) with the input as a bytes
literal that reproduces it, an exception the contract does not allow is reported even when
both twins raise it, and tests/fuzz/run.py fails a run whose log holds a sanitizer report or
a difference, and only then."""
from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import harness
import pytest

from kvcache.native import native_or_none

HERE = Path(__file__).resolve().parent
READERS = {"resp_request": "resp", "resp_reply": "resp", "nats": "natsproto", "server_get": "server_get"}
assert set(READERS) == set(harness.READERS)


def target(reader: str) -> ModuleType:
    if native_or_none(READERS[reader]) is None:  # an error with KVCACHE_REQUIRE_EXTENSIONS=1
        pytest.skip(f"kvcache._native.{READERS[reader]} is not built")
    module = importlib.import_module(f"fuzz_{reader}")
    module.setup()
    return module


def test_inputs_are_read_as_written() -> None:
    wire = bytes(range(256)) * 3
    case = harness.decode(harness.encode(wire, 0x25, bytes([0, 9, 255])))
    assert (case.options, case.choices, case.wire) == (0x25, bytes([0, 9, 255]), wire)
    chunks = case.chunks()
    assert b"".join(chunks) == wire and [len(c) for c in chunks[:4]] == [1, 10, 256, 1]
    assert harness.decode(harness.encode(b"x")).chunks() == [b"x"] and harness.decode(b"\x07").wire == b"\x07"
    assert harness.decode(b"\x01\x11" + b"z" * 20).choices == b"z" * 8  # 17 % (MAX_CHOICES + 1)
    assert all(b"".join(c) == wire[:40] for c in harness.splits(wire[:40]))


def test_a_framed_nats_input_gets_its_sizes_from_the_harness() -> None:
    import fuzz_nats

    from kvcache.natsio import natsproto
    wire = fuzz_nats.framed(fuzz_nats.unframed([(b"PING\r\n",), (b"a 1", b"xy"), (b"b 2 r", b"NATS/1.0\r\n\r\n", b"")]))
    assert wire == b"PING\r\nMSG a 1 2\r\nxy\r\nHMSG b 2 r 12 12\r\nNATS/1.0\r\n\r\n\r\n"
    assert [type(e).__name__ for e in natsproto.NatsReader().feed(wire)] == ["Ping", "Msg", "HMsg"]


@pytest.mark.parametrize("reader", harness.READERS)
def test_every_seed_passes_cut_at_every_boundary(reader: str, monkeypatch) -> None:
    module = target(reader)
    monkeypatch.setattr(harness, "EVERY_SPLIT", 64)
    seeds = module.seeds()
    assert len(seeds) > 20
    for seed in seeds:
        module.check(seed)


def _wrap(owner: type, name: str, change: Callable, monkeypatch) -> None:
    original = getattr(owner, name)

    def changed(self, *args, **kwargs):
        return change(original(self, *args, **kwargs))
    monkeypatch.setattr(owner, name, changed)


def _injected(reader: str, monkeypatch) -> None:
    """One difference in the twin's behaviour per reader, of the kind a twin could drift into."""
    if reader == "resp_request":
        from kvcache import resp
        _wrap(resp.RequestReader, "next_command", lambda args: args and [a.lower() for a in args], monkeypatch)
    elif reader == "resp_reply":
        from kvcache import resp
        _wrap(resp.ReplyReader, "gets", lambda r: r + b"!" if isinstance(r, bytes) and r else r, monkeypatch)
    elif reader == "nats":
        from kvcache.natsio import natsproto
        _wrap(natsproto.NatsReader, "feed", lambda events: events[:-1], monkeypatch)
    else:
        from kvcache.serve import server_get
        _wrap(server_get.ServerGets, "serve", lambda got: (got[0].replace(b"\r\n", b"\n"), *got[1:]), monkeypatch)


@pytest.mark.parametrize("reader", harness.READERS)
def test_an_injected_difference_is_reported(reader: str, monkeypatch, capsys) -> None:
    module = target(reader)
    _injected(reader, monkeypatch)
    caught = []
    for seed in module.seeds():
        try:
            module.check(seed)
        except harness.Difference as e:
            caught.append((seed, str(e)))
    assert caught, "no seed showed the injected difference"
    seed, report = caught[0]
    assert report.startswith(f"fuzz: DIFFERENCE in {reader}: native and twin differ")
    literal = next(line for line in report.splitlines() if line.startswith("  input    = "))
    assert ast.literal_eval(literal.split(" = ", 1)[1]) == harness.decode(seed).wire
    assert "  native   = " in report and "  twin     = " in report and "first difference at" in report
    assert report in capsys.readouterr().err  # printed before the harness stops


def test_an_exception_outside_the_contract_is_reported_even_from_both(monkeypatch) -> None:
    module = target("resp_reply")

    def broken(self):
        raise IndexError("a reader's own bug")
    from kvcache import resp
    monkeypatch.setattr(resp.ReplyReader, "gets", broken)
    monkeypatch.setattr(module.native, "ReplyReader", resp.ReplyReader)  # both twins alike
    with pytest.raises(harness.Difference, match=r"raised builtins\.IndexError, which the contract does not allow"):
        module.check(harness.encode(b"+OK\r\n"))


def _runner() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fuzz_runner", HERE / "run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


CLEAN_LOG = """\
fuzz: nats: native modules loaded: {native}/natsproto.cpython-311-x86_64-linux-gnu.so
INFO: Loaded 1 modules   (14048 inline 8-bit counters): 14048 [0x7f, 0x7f),
#2048	pulse  cov: 2990 ft: 13001 corp: 311/20Kb exec/s: 400 rss: 300Mb
#24000	DONE   cov: 3105 ft: 14438 corp: 330/22Kb lim: 498 exec/s: 400 rss: 310Mb
COVERED_FUNC: hits: 12 edges: 30/44 __pyx_f_7kvcache_7_native_9natsproto_x /src/ext/natsproto.c:100
UNCOVERED_FUNC: hits: 0 edges: 0/20 __pyx_f_7kvcache_7_native_9natsproto_y /src/ext/natsproto.c:200
COVERED_FUNC: hits: 3 edges: 2/8 Py_DECREF /usr/include/python3.11/object.h:534
COVERED_FUNC: hits: 9 edges: 5/16 __Pyx_PyObject_FastCallDict /src/ext/natsproto.c:900
stat::number_of_executed_units: 24000
stat::average_exec_per_sec:     400
"""


@pytest.mark.parametrize("extra,problem", [
    ("", None),
    ("==77==ERROR: AddressSanitizer: heap-buffer-overflow on address 0x6", "1 sanitizer report(s)"),
    ("ext/resp.c:11616:42: runtime error: signed integer overflow", "1 sanitizer report(s)"),
    ("fuzz: DIFFERENCE in nats: native and twin differ", "1 difference(s) between the twins"),
])
def test_the_runner_fails_a_run_with_a_report(extra: str, problem: str | None, tmp_path) -> None:
    run = _runner()
    result = run.Result("nats")
    run.read_log(result, CLEAN_LOG.format(native=tmp_path) + extra + "\n", tmp_path)
    assert (result.executions, result.exec_per_s, result.cov, result.ft) == (24000, 400, 3105, 14438)
    assert (result.functions, result.edges, result.counters, result.modules) == ((1, 2), (30, 64), 14048, 1)
    assert result.problems == ([] if problem is None else [problem])


def test_the_runner_refuses_modules_from_another_build(tmp_path) -> None:
    run = _runner()
    result = run.Result("nats")
    run.read_log(result, CLEAN_LOG.format(native="/elsewhere"), tmp_path)
    assert result.failed and "native modules loaded from outside" in result.problems[0]
    result = run.Result("nats")  # a module loaded from the build, but not instrumented
    run.read_log(result, CLEAN_LOG.format(native=tmp_path).replace(
        "natsproto.cpython-311-x86_64-linux-gnu.so", f"natsproto.so {tmp_path}/resp.so"), tmp_path)
    assert result.problems == ["libFuzzer saw 1 instrumented modules, 2 are loaded"]
