"""kvcache.keys is the one definition of the KV key grammar; the C copies are held to it here
on generated keys: the server's GET fast path's key check (ext/server_get.pyx, seen through
whether it asks the planner) and the RESP reader's GET-unit key characters (ext/resp_get.pxd,
seen through take_gets), every byte value in every position included."""
from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import keys
from kvcache import resp as twin_resp
from kvcache.native import native_or_none
from kvcache.resp import GET_LEN
from kvcache.store.replica import BucketMeta, Replica

native_get = native_or_none("server_get")
native_resp = native_or_none("resp")
pytestmark = pytest.mark.skipif(native_get is None or native_resp is None,
                                reason="native extensions not built (an error with KVCACHE_REQUIRE_EXTENSIONS=1)")

# Keys near the grammar's edges: every byte alone, before, inside and after a valid token,
# dots everywhere, and the 511-byte LMDB limit the fast path stops at.
EDGES = ([bytes([b]) for b in range(256)] + [b"a" + bytes([b]) + b"b" for b in range(256)]
         + [b"", b".", b"..", b"a.", b".a", b"a..b", b"a.b", b"a.b.c", b"-/_=", b"*", b">", b"a.*",
            b"a" * 511, b"a" * 512, b"a." * 200 + b"a", "ключ".encode(), b"a:b",
            # ADR-8's reserved prefix, and keys near it
            b"_kv", b"_kv.x", b"_kvx", b"_kv_", b"_k", b"_k.v", b"_KV.x", b"_kV", b"a._kv", b"x_kv", b"__kv"])
_ALPHABET = b"abzAZ09-/_=.:*> \r\n\x00\xffkv"
generated = st.one_of(st.binary(max_size=40), st.lists(st.sampled_from(list(_ALPHABET)), max_size=40).map(bytes))


def python_valid(raw: bytes) -> bool:
    """keys.readable_key on a raw key, as the server's planner sees it (UTF-8 or invalid)."""
    try:
        return keys.readable_key(raw.decode())
    except UnicodeDecodeError:
        return False


class Feed:
    max_age_ns = 0

    def fresh_for_all(self, max_stale_ms: int) -> bool:
        return True


@pytest.fixture(scope="module")
def direct_gets(tmp_path_factory):
    """The native GET path with one bucket that replicates every key, read without the
    planner when (and only when) its C check says the key is valid."""
    replica = Replica(str(tmp_path_factory.mktemp("keys") / "replica"), map_size=1 << 22)
    replica.apply_items("main", [], BucketMeta(stream="KV_main", applied_seq=0, synced=True))
    asked: list[bytes] = []

    def planner(raw: bytes):
        asked.append(raw)
        return False
    gets = native_get.ServerGets(replica, planner)
    gets.set_buckets([("main", Feed(), 1000, True)], "main")
    yield gets, asked, {}
    replica.close()


def c_key_check(direct_gets, raw: bytes) -> bool:
    """Did the C check find `raw` valid? The path asks the planner for a key it finds invalid,
    once per key (it caches the answer): each distinct key is asked once here."""
    gets, asked, seen = direct_gets
    if raw not in seen:
        del asked[:]
        gets.serve([GET_LEN[len(raw)]], [raw], 2, 1 << 20)
        seen[raw] = not asked  # answered in C without the planner: the C check said valid
    return seen[raw]


def check_fast_path(direct_gets, raw: bytes) -> None:
    want = python_valid(raw) and len(raw) <= 511  # longer keys live under a digest: the planner's
    assert c_key_check(direct_gets, raw) == want, raw


def check_resp_unit(raw: bytes) -> None:
    """The GET unit's key characters: native take_gets takes the unit as a GET exactly when
    the twin's regex (built from keys.TOKEN_CHARS) does."""
    wire = b"*2\r\n$3\r\nGET\r\n$%d\r\n%b\r\n" % (len(raw), raw)
    got = []
    for mod in (native_resp, twin_resp):
        reader = mod.RequestReader()
        reader.feed(wire)
        run = reader.take_gets()
        got.append(None if run is None else (list(run[0]), list(run[1])))
    assert got[0] == got[1], raw
    allowed = re.fullmatch(rb"[" + keys.TOKEN_CHARS.encode() + rb".:]{1,9999}", raw) is not None
    # taken whole as the unit's key exactly when every byte is allowed (a CRLF inside may end
    # a shorter unit: its declared length then says it is not this key)
    assert (got[1] is not None and got[1][1] == [raw]) == allowed, raw


def test_edges(direct_gets):
    for raw in EDGES:
        check_fast_path(direct_gets, raw)
        check_resp_unit(raw)


@settings(max_examples=3000, deadline=None)
@given(raw=generated)
def test_generated(direct_gets, raw):
    check_fast_path(direct_gets, raw)
    if raw:
        check_resp_unit(raw)


def test_filters_and_glob():
    assert keys.valid_filter("a.*.>") and keys.valid_filter(">") and not keys.valid_filter("a.>.b")
    assert not keys.valid_filter("a\n") and not keys.valid_filter("a..b")
    assert keys.subject_match("a.*", "a.b") and not keys.subject_match("a.*", "a.b.c")
    assert keys.subject_match("a.>", "a.b.c") and not keys.subject_match("a.>", "a")
    assert keys.glob_matcher("in.k[0-2]")("in.k1") and not keys.glob_matcher("in.k[0-2]")("in.k3")


_tokens = st.sampled_from(["a", "b", "c", "ab", "a-b"])
_keys = st.lists(_tokens, min_size=1, max_size=5).map(".".join)
_filters = st.lists(st.one_of(_tokens, st.just("*")), min_size=1, max_size=4).flatmap(
    lambda ts: st.sampled_from([".".join(ts), ".".join([*ts, ">"])])) | st.just(">")


@settings(max_examples=2000, deadline=None)
@given(filters=st.lists(_filters, max_size=8), probes=st.lists(_keys, min_size=1, max_size=8))
def test_a_filter_set_matches_as_its_filters_one_by_one(filters, probes):
    """FilterSet (literals a set, `prefix.>` a lookup per token prefix) against subject_match
    over every filter, on generated filters and keys over a small alphabet (so they meet)."""
    compiled = keys.FilterSet(filters)
    for key in probes:
        assert compiled.match(key) == any(keys.subject_match(f, key) for f in filters), (filters, key)


def test_a_filter_set_of_hundreds_of_prefixes():
    compiled = keys.FilterSet([f"g{i}.>" for i in range(569)] + ["x.y", "m.*.n"])
    assert compiled.match("g568.1") and compiled.match("g0.a.b") and not compiled.match("g569.1")
    assert not compiled.match("g5") and compiled.match("x.y") and not compiled.match("x.y.z")
    assert compiled.match("m.q.n") and not compiled.match("m.q")
    assert not keys.FilterSet([]).match("a") and keys.FilterSet([">"]).match("a")
