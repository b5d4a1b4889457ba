"""The Cython RESP readers (ext/resp.pyx) against the pure-Python twin and hiredis.

tests/test_resp.py's wire vectors run here against the native module, whole, byte by byte and
split at every boundary; generated input is compared reader against reader (native vs twin,
native vs hiredis), `take_gets` runs included; random and mutated bytes may raise only
ProtocolError, in bounded time and memory. Skipped only when the extension is not built.
"""
from __future__ import annotations

import random
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.resp_vectors import (
    LIMIT_VECTORS,
    REPLY_VECTORS,
    REQUEST_VECTORS,
    _replies,
    norm,
    run_hiredis,
    splits,
)
from support.resp_vectors import run_replies as _run_replies
from support.resp_vectors import run_requests as _run_requests

from kvcache import resp as twin
from kvcache.errors import ProtocolError
from kvcache.native import native_or_none
from kvcache.resp import INLINE_MAX

native = native_or_none("resp")  # an error, not a skip, with KVCACHE_REQUIRE_EXTENSIONS=1
if native is None:
    pytest.skip("the Cython extension is not built", allow_module_level=True)


def run_requests(mod, chunks: list[bytes], **limits: int) -> tuple[list[list[bytes]], str | None]:
    return _run_requests(chunks, mod, **limits)


def run_replies(mod, chunks: list[bytes]) -> tuple[list, bool]:
    return _run_replies(chunks, mod)


def server_loop(mod, chunks: list[bytes], limits: dict | None = None) -> tuple[list, str | None, int]:
    """What ClientConnection._process does with a reader: take_gets runs first, each GET accepted
    only when its declared length matches its key (else rewound to it, or past it when it is a
    GET the server answers through dispatch), then next_command. Every command in order."""
    reader = mod.RequestReader(**(limits or {}))
    out: list = []
    try:
        for chunk in chunks:
            reader.feed(chunk)
            while True:
                run = reader.take_gets()
                if run is not None:
                    lengths, keys, start = run
                    for i, (declared, key) in enumerate(zip(lengths, keys, strict=True)):
                        if declared != twin.GET_LEN[len(key)]:
                            reader.rewind_gets(start, lengths, keys, i)
                            break
                        if key.startswith(b"r"):  # "remote": leave the fast path after it
                            reader.rewind_gets(start, lengths, keys, i + 1)
                            out.append(("slow", [b"GET", key]))
                            break
                        out.append(("fast", key))
                    else:
                        continue
                args = reader.next_command()
                if args is None:
                    break
                out.append(("cmd", args))
    except ProtocolError as exc:
        return out, str(exc), reader.buffered
    return out, None, reader.buffered


# --------------------------------------------------------------------------- the shared vectors


@pytest.mark.parametrize("name,wire,commands,err", REQUEST_VECTORS, ids=[v[0] for v in REQUEST_VECTORS])
def test_request_vectors(name: str, wire: bytes, commands: list, err: str | None) -> None:
    for chunks in splits(wire):
        assert run_requests(native, chunks) == (commands, err), chunks


@pytest.mark.parametrize("name,wire,limits,err", LIMIT_VECTORS, ids=[v[0] for v in LIMIT_VECTORS])
def test_limits(name: str, wire: bytes, limits: dict, err: str | None) -> None:
    ways = splits(wire) if len(wire) < 1000 else [[wire], [wire[:INLINE_MAX], wire[INLINE_MAX:]]]
    for chunks in ways:
        assert run_requests(native, chunks, **limits)[1] == err
        assert run_requests(native, chunks, **limits) == run_requests(twin, chunks, **limits)


@pytest.mark.parametrize("name,wire,replies,failed,like_hiredis", REPLY_VECTORS,
                         ids=[v[0] for v in REPLY_VECTORS])
def test_reply_vectors(name: str, wire: bytes, replies: list, failed: bool, like_hiredis: bool) -> None:
    for chunks in splits(wire):
        got, got_failed = run_replies(native, chunks)
        assert (norm(got), got_failed) == (norm(replies), failed), chunks
        if like_hiredis:
            expected, hi_failed = run_hiredis(chunks)
            assert (norm(got), got_failed) == (norm(expected), hi_failed), chunks


@pytest.mark.parametrize("wire", [v[1] for v in REQUEST_VECTORS + LIMIT_VECTORS] + [
    b"*2\r\n$3\r\nGET\r\n$3\r\nfoo\r\n" * 3,
    b"*2\r\n$3\r\nGET\r\n$3\r\nfoo\r\n*2\r\n$3\r\nGET\r\n$5\r\nab\r\n\r\n\r\n*1\r\n$4\r\nPING\r\n",
    b"*2\r\n$3\r\nGET\r\n$03\r\nfoo\r\n*2\r\n$3\r\nGET\r\n$4\r\nrfoo\r\n*2\r\n$3\r\nGET\r\n$1\r\nx\r\n",
    b"*2\r\n$3\r\nGET\r\n$3\r\nf\xffo\r\n*2\r\n$3\r\nget\r\n$1\r\nx\r\n",
])
def test_server_loop_vectors(wire: bytes) -> None:
    for chunks in splits(wire) if len(wire) < 1000 else [[wire]]:
        assert server_loop(native, chunks) == server_loop(twin, chunks), chunks


def test_drop_in_names() -> None:
    public = {n for n in dir(twin) if not n.startswith("_") and n not in ("annotations", "re", "Final",
                                                                          "Iterable", "Sequence", "Bytes")}
    assert public <= set(dir(native))
    assert native.ReplyError is twin.ReplyError and native.GET_LEN is twin.GET_LEN
    assert native.bulk(b"x") == twin.bulk(b"x")


def test_take_gets_shares_get_len() -> None:
    reader = native.RequestReader()
    reader.feed(b"*2\r\n$3\r\nGET\r\n$3\r\nfoo\r\n*2\r\n$3\r\nGET\r\n$12\r\nkey:00000001\r\n")
    lengths, keys, start = reader.take_gets()
    assert start == 0 and keys == [b"foo", b"key:00000001"]
    assert lengths[0] is twin.GET_LEN[3] and lengths[1] is twin.GET_LEN[12]
    assert reader.buffered == 0


def test_take_gets_off_when_limit_is_small() -> None:
    for mod in (native, twin):
        reader = mod.RequestReader(max_request_bytes=100)
        reader.feed(b"*2\r\n$3\r\nGET\r\n$3\r\nfoo\r\n")
        assert reader.take_gets() is None and reader.next_command() == [b"GET", b"foo"]


def test_limits_are_writable_attributes() -> None:
    for mod in (native, twin):
        reader = mod.RequestReader()
        assert (reader.max_request_bytes, reader.max_args) == (4 * 1024 * 1024, 1_048_576)
        reader.max_args = 1
        reader.feed(b"*2\r\n")
        with pytest.raises(ProtocolError, match="too many arguments"):
            reader.next_command()


def test_reply_false_and_errors() -> None:
    reader = native.ReplyReader()
    assert reader.gets() is False and not reader.has_data()
    reader.feed(b"#f\r")
    assert reader.gets() is False and reader.has_data()
    reader = native.ReplyReader(None)
    reader.feed(b"-READONLY replica\r\n!x\r\n+OK\r\n")
    err = reader.gets()
    assert isinstance(err, twin.ReplyError) and str(err) == "READONLY replica"
    for _ in range(2):
        with pytest.raises(ProtocolError, match="invalid bulk length"):
            reader.gets()


def test_map_keys_and_big_integers() -> None:
    reader = native.ReplyReader()
    reader.feed(b"%1\r\n*2\r\n:1\r\n:2\r\n+v\r\n%2\r\n+k\r\n:1\r\n+k\r\n:2\r\n")
    assert reader.gets() == {(1, 2): b"v"}
    assert reader.gets() == {b"k": 2}
    wire = b":9999999999999999999\r\n:-9999999999999999999\r\n:-9223372036854775808\r\n(-123456789012345678901\r\n"
    assert run_replies(native, [wire]) == run_replies(twin, [wire])
    assert run_replies(native, [wire])[0][:2] == [9999999999999999999, -9999999999999999999]


def test_pipelined_and_compaction() -> None:
    value = bytes(range(256)) * 4096
    wire = (b"*1\r\n$4\r\nPING\r\n" * 10_000) + b"*2\r\n$3\r\nSET\r\n$%d\r\n%b\r\n" % (len(value), value)
    reader = native.RequestReader()
    got = []
    for i in range(0, len(wire), 4096):
        reader.feed(memoryview(wire)[i:i + 4096])
        assert len(reader._buf) - reader.buffered < 64 * 1024
        while (cmd := reader.next_command()) is not None:
            got.append(cmd)
    assert len(got) == 10_001 and got[-1] == [b"SET", value] and reader.buffered == 0


def test_large_reply_in_small_chunks() -> None:
    wire = twin.array([twin.bulk(b"v%d\r\n" % i) for i in range(50_000)])
    reader = native.ReplyReader()
    reply = False
    for i in range(0, len(wire), 1000):
        reader.feed(bytearray(wire[i:i + 1000]))
        reply = reader.gets()
        assert reply is False or i + 1000 >= len(wire)
    assert reply == [b"v%d\r\n" % i for i in range(50_000)]
    assert reader.buffered == 0


# --------------------------------------------------------------------------- generated


def _chunks(wire: bytes, data: st.DataObject) -> list[bytes]:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=6)))
    return [wire[a:b] for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True)]


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 3).flatmap(lambda p: st.lists(_replies(p), min_size=1, max_size=4)), st.data())
def test_generated_replies_vs_hiredis_and_twin(replies: list[bytes], data: st.DataObject) -> None:
    wire = b"".join(replies)
    chunks = _chunks(wire, data)
    got, failed = run_replies(native, chunks)
    expected, hi_failed = run_hiredis([wire])
    assert not failed and not hi_failed and len(got) == len(replies)
    assert norm(got) == norm(expected)
    assert norm(got) == norm(run_replies(twin, chunks)[0])


_KEY = st.text("abcrxyz019:_-./=", min_size=1, max_size=12).map(str.encode)
_COMMAND = st.one_of(
    _KEY.map(lambda k: twin.array([twin.bulk(b"GET"), twin.bulk(k)])),  # the fast path
    st.tuples(_KEY, st.integers(0, 15)).map(  # a declared length that lies
        lambda kn: b"*2\r\n$3\r\nGET\r\n$%d\r\n%b\r\n" % (kn[1], kn[0])),
    _KEY.map(lambda k: b"*2\r\n$3\r\nGET\r\n$0%d\r\n%b\r\n" % (len(k), k)),  # leading zero
    st.lists(st.binary(max_size=12), min_size=1, max_size=4).map(
        lambda args: twin.array([twin.bulk(a) for a in args])),
    st.lists(st.sampled_from([b"PING", b"GET", b"k", b'"a b"', b"'x'", b""]), max_size=3).map(
        lambda ws: b" ".join(ws) + b"\r\n"),
    st.binary(max_size=8),  # noise: usually a protocol error, sometimes a partial frame
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_COMMAND, min_size=1, max_size=12), st.data())
def test_generated_requests_vs_twin(commands: list[bytes], data: st.DataObject) -> None:
    wire = b"".join(commands)
    chunks = _chunks(wire, data)
    assert run_requests(native, chunks) == run_requests(twin, chunks)
    assert server_loop(native, chunks) == server_loop(twin, chunks)


@settings(max_examples=100, deadline=None)
@given(st.lists(_KEY, min_size=1, max_size=50), st.integers(0, 50))
def test_take_gets_and_rewind_vs_twin(keys: list[bytes], stop: int) -> None:
    wire = b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%b\r\n" % (len(k), k) for k in keys) + b"*1\r\n$4\r\nPING\r\n"
    results = []
    for mod in (native, twin):
        reader = mod.RequestReader()
        reader.feed(wire)
        lengths, got, start = reader.take_gets()
        reader.rewind_gets(start, lengths, got, min(stop, len(got)))
        results.append((lengths, got, start, reader.buffered, reader.take_gets(), reader.next_command()))
    assert results[0] == results[1]


# --------------------------------------------------------------------------- fuzz

_SEEDS = [v[1] for v in REQUEST_VECTORS + REPLY_VECTORS] + [
    twin.array([twin.bulk(b"GET"), twin.bulk(b"key:1")]) * 3,
    b"%2\r\n+a\r\n:1\r\n$1\r\nb\r\n*1\r\n_\r\n|1\r\n+t\r\n:3\r\n=7\r\ntxt:abc\r\n",
]


def _mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(5)
        i = rng.randrange(len(b) + 1)
        if op == 0 and b:
            b[min(i, len(b) - 1)] = rng.randrange(256)
        elif op == 1:
            b[i:i] = bytes([rng.choice(b"\r\n*$:-+_#,=!%~>|(0123456789")])
        elif op == 2 and b:
            del b[i:i + rng.randint(1, 4)]
        elif op == 3:
            b[i:i] = rng.choice([b"\r\n", b"-1", b"99999999999999999999", b"*9999999\r\n", b"$1\r\n"])
        else:
            b[i:i] = data[: rng.randint(0, len(data))]
    return bytes(b)


def _fuzz_one(data: bytes, rng: random.Random) -> None:
    cut = rng.randint(0, len(data))
    for make in (lambda: native.RequestReader(max_request_bytes=1 << 16, max_args=1000),
                 native.ReplyReader):
        reader = make()
        is_request = isinstance(reader, native.RequestReader)
        try:
            for chunk in (data[:cut], data[cut:]):
                reader.feed(chunk)
                for _ in range(len(data) + 2):  # every call consumes input or returns "not yet"
                    if is_request:
                        run = reader.take_gets()
                        if run is not None:
                            reader.rewind_gets(run[2], run[0], run[1], rng.randint(0, len(run[0])))
                        if reader.next_command() is None and run is None:
                            break
                    elif reader.gets() is False:
                        break
                else:
                    raise AssertionError("no progress")
        except ProtocolError:
            pass
        assert reader.buffered <= len(data)


def test_fuzz_random_and_mutated_bytes() -> None:
    rng = random.Random(1234)
    tracemalloc.start()
    try:
        for n in range(20_000):
            if n % 2:
                data = _mutate(rng, rng.choice(_SEEDS))
            else:
                data = rng.randbytes(rng.randint(0, 64))
            _fuzz_one(data, rng)  # a hang is pytest-timeout's to catch, not a time limit's
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * 1024 * 1024, peak  # bounded: nothing sized by a declared length


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_native_matches_twin(data: bytes) -> None:
    """On arbitrary bytes both readers agree, protocol error and message included."""
    assert run_requests(native, [data]) == run_requests(twin, [data])
    got, expected = run_replies(native, [data]), run_replies(twin, [data])
    assert (norm(got[0]), got[1]) == (norm(expected[0]), expected[1])
