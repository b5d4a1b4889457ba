"""pytest-benchmark: does a key fall under a bucket's filters? keys.FilterSet (compiled once)
against matching each filter in turn (keys.subject_match, what BucketConfig.replicates did).

    python -m pytest bench/test_bench_filters.py -p no:cacheprovider --benchmark-columns=min,median,ops

The filters are the shape `kvcache hotkeys --cover 0.9` proposed in bench/README's near-cache
run (569 of them, `g<N>.>`), plus a literal and a `*` filter. Each round asks about 1,000 keys:
a third under an early filter, a third under a late one, a third under none (the keys a
feed with a near cache sees most: outside the filters). The ratio is printed at the end
(`test_zz_ratio`). Not part of the test suite (testpaths=tests).
"""
from __future__ import annotations

import pytest

from kvcache.keys import FilterSet, subject_match

FILTERS = [f"g{i}.>" for i in range(569)] + ["config.main", "session.*.token"]
KEYS = [f"g{i % 50}.{i}" for i in range(333)] + [f"g{500 + i % 69}.{i}" for i in range(333)] + \
    [f"g{1000 + i}.{i}" for i in range(334)]
_MEDIANS: dict[str, float] = {}


def one_by_one(filters: list[str], keys: list[str]) -> int:
    return sum(any(subject_match(f, k) for f in filters) for k in keys)


def compiled(fs: FilterSet, keys: list[str]) -> int:
    return sum(fs.match(k) for k in keys)


def test_filters_one_by_one(benchmark):
    assert benchmark(one_by_one, FILTERS, KEYS) == 666
    _MEDIANS["one by one"] = benchmark.stats.stats.median


def test_filters_compiled(benchmark):
    fs = FilterSet(FILTERS)
    assert benchmark(compiled, fs, KEYS) == 666
    _MEDIANS["compiled"] = benchmark.stats.stats.median


def test_zz_ratio(capsys):
    if len(_MEDIANS) < 2:
        pytest.skip("run the whole file")
    with capsys.disabled():
        per_key = {k: v / len(KEYS) * 1e6 for k, v in _MEDIANS.items()}
        print(f"\nper key (median round / 1,000 keys): one by one {per_key['one by one']:.2f} µs, "
              f"compiled {per_key['compiled']:.3f} µs: {_MEDIANS['one by one'] / _MEDIANS['compiled']:.0f}×")
