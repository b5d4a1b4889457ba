"""pytest-benchmark: the RESP readers, ours native (ext/resp.pyx) vs ours Python vs hiredis.

    python -m pytest bench/test_bench_resp.py -p no:cacheprovider --benchmark-columns=min,median,ops \
        --benchmark-sort=name

Each round parses one whole buffer with a fresh reader; ops/s below are rounds per second, so
items/s = ops × 10,000. The ratios of the groups are printed at the end of the session
(`test_zz_ratios`); run the whole file for them. Not part of the test suite (testpaths=tests).
"""
from __future__ import annotations

import hiredis
import pytest

from kvcache import resp as twin

native = pytest.importorskip("kvcache._native.resp", reason="the Cython extension is not built")

N = 10_000
GETS = b"".join(twin.array([twin.bulk(b"GET"), twin.bulk(b"key:%012d" % (1234 + i % 7))]) for i in range(N))
BULKS = b"".join(twin.bulk(b"value-%06d-" % i + b"x" * 32) for i in range(N))
NESTED = b"".join(
    twin.array([twin.integer(i), twin.array([twin.bulk(b"k%d" % i), twin.bulk(b"v"), twin.NIL2]), twin.OK])
    for i in range(N))

_RESULTS: dict[str, dict[str, float]] = {}


def _record(benchmark, group: str, who: str) -> None:
    _RESULTS.setdefault(group, {})[who] = benchmark.stats.stats.median


def _take_gets(mod) -> int:
    reader = mod.RequestReader()
    reader.feed(GETS)
    n = 0
    while (run := reader.take_gets()) is not None:
        n += len(run[1])
    return n


def _next_command(mod) -> int:
    reader = mod.RequestReader()
    reader.feed(GETS)
    n = 0
    while reader.next_command() is not None:
        n += 1
    return n


def _gets(make, wire: bytes) -> int:
    reader = make()
    reader.feed(wire)
    n = 0
    while reader.gets() is not False:
        n += 1
    return n


READERS = {
    "native": lambda: native.ReplyReader(),
    "python": lambda: twin.ReplyReader(),
    "hiredis": lambda: hiredis.Reader(),
}


@pytest.mark.parametrize("who,mod", [("native", native), ("python", twin)], ids=["native", "python"])
def test_request_take_gets(benchmark, who: str, mod) -> None:
    benchmark.group = "request take_gets: 10k pipelined GET key:000000001234"
    assert benchmark(_take_gets, mod) == N
    _record(benchmark, benchmark.group, who)


@pytest.mark.parametrize("who,mod", [("native", native), ("python", twin)], ids=["native", "python"])
def test_request_next_command(benchmark, who: str, mod) -> None:
    benchmark.group = "request next_command: 10k pipelined GET key:000000001234"
    assert benchmark(_next_command, mod) == N
    _record(benchmark, benchmark.group, who)


@pytest.mark.parametrize("who", list(READERS))
def test_reply_bulks(benchmark, who: str) -> None:
    benchmark.group = "reply gets: 10k bulk replies (45 B)"
    assert benchmark(_gets, READERS[who], BULKS) == N
    _record(benchmark, benchmark.group, who)


@pytest.mark.parametrize("who", list(READERS))
def test_reply_nested(benchmark, who: str) -> None:
    benchmark.group = "reply gets: 10k nested arrays [int, [bulk, bulk, nil], +OK]"
    assert benchmark(_gets, READERS[who], NESTED) == N
    _record(benchmark, benchmark.group, who)


def test_zz_ratios(capsys) -> None:
    """Items/s per reader and its ratio to the others, from the medians measured above."""
    if not _RESULTS:
        pytest.skip("run the whole file")
    lines = ["", "| group | reader | items/s | vs python | vs hiredis |", "|---|---|---|---|---|"]
    for group, medians in _RESULTS.items():
        for who, median in medians.items():
            py = medians.get("python")
            hi = medians.get("hiredis")
            lines.append(f"| {group} | {who} | {N / median:,.0f} | "
                         f"{py / median:.2f}× | " + (f"{hi / median:.2f}× |" if hi else "– |"))
    with capsys.disabled():
        print("\n".join(lines))
