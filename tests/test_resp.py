"""Wire vectors for the RESP codec, shared by the pure-Python and (later) Cython parsers.

Every vector is applied whole, byte by byte, and split in two at every boundary: a parser
that keeps state between feeds must give the same answer for all of them. ReplyReader is
also checked against hiredis on the same vectors and on generated nested replies.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.resp_vectors import (
    LIMIT_VECTORS,
    REPLY_VECTORS,
    REQUEST_VECTORS,
    _replies,
    norm,
    run_hiredis,
    run_replies,
    run_requests,
    splits,
)

from kvcache import resp
from kvcache.errors import ProtocolError
from kvcache.native import native_or_none
from kvcache.resp import INLINE_MAX, ReplyError, ReplyReader, RequestReader

# --------------------------------------------------------------------------- helpers
















# --------------------------------------------------------------------------- requests




@pytest.mark.parametrize("name,wire,commands,err", REQUEST_VECTORS, ids=[v[0] for v in REQUEST_VECTORS])
def test_request_vectors(name: str, wire: bytes, commands: list, err: str | None) -> None:
    for chunks in splits(wire):
        assert run_requests(chunks) == (commands, err), chunks




@pytest.mark.parametrize("name,wire,limits,err", LIMIT_VECTORS, ids=[v[0] for v in LIMIT_VECTORS])
def test_limits(name: str, wire: bytes, limits: dict, err: str | None) -> None:
    ways = splits(wire) if len(wire) < 1000 else [[wire], [wire[:INLINE_MAX], wire[INLINE_MAX:]]]
    for chunks in ways:
        _commands, got = run_requests(chunks, **limits)
        assert got == err


def test_inline_at_limit_is_accepted() -> None:
    line = b"x" * INLINE_MAX
    for chunks in ([line + b"\r\n"], [line, b"\r", b"\n"], [line + b"\r", b"\n"]):
        assert run_requests(chunks) == ([[line]], None)


IMPLEMENTATIONS = [resp]
_native_resp = native_or_none("resp")  # not built: the twin alone is tested (unless required)
if _native_resp is not None:
    IMPLEMENTATIONS.append(_native_resp)


@pytest.mark.parametrize("mod", IMPLEMENTATIONS, ids=lambda m: m.__name__)
def test_unusable_after_error(mod) -> None:
    reader = mod.RequestReader()
    reader.feed(b"*x\r\n")
    with pytest.raises(ProtocolError):
        reader.next_command()
    reader.feed(b"PING\r\n")
    with pytest.raises(ProtocolError, match="invalid multibulk length"):
        reader.next_command()


def test_pipelined_many_in_one_feed() -> None:
    n = 20_000
    wire = b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\nkey:%d\r\n" % (len(b"key:%d" % i), i) for i in range(n))
    wire += b"PING\r\n" * 100
    reader = RequestReader()
    reader.feed(wire)
    commands = []
    while (cmd := reader.next_command()) is not None:
        commands.append(cmd)
    assert len(commands) == n + 100
    assert commands[12345] == [b"GET", b"key:12345"]
    assert reader.buffered == 0


def test_large_bulk_in_small_chunks_and_compaction() -> None:
    value = bytes(range(256)) * 4096  # 1 MiB, full of CR and LF
    wire = (b"*1\r\n$4\r\nPING\r\n" * 10_000) + b"*2\r\n$3\r\nSET\r\n$%d\r\n%b\r\n" % (len(value), value)
    reader = RequestReader()
    got = []
    for i in range(0, len(wire), 4096):
        reader.feed(wire[i:i + 4096])
        # consumed bytes are dropped once they pass 64 KiB
        assert len(reader._buf) - reader.buffered < 64 * 1024
        while (cmd := reader.next_command()) is not None:
            got.append(cmd)
    assert len(got) == 10_001 and got[-1] == [b"SET", value]


# --------------------------------------------------------------------------- replies



@pytest.mark.parametrize("name,wire,replies,failed,like_hiredis", REPLY_VECTORS,
                         ids=[v[0] for v in REPLY_VECTORS])
def test_reply_vectors(name: str, wire: bytes, replies: list, failed: bool, like_hiredis: bool) -> None:
    for chunks in splits(wire):
        got, got_failed = run_replies(chunks)
        assert (norm(got), got_failed) == (norm(replies), failed), chunks
        if like_hiredis:
            expected, hi_failed = run_hiredis(chunks)
            assert (norm(got), got_failed) == (norm(expected), hi_failed), chunks


def test_reply_false_is_not_incomplete() -> None:
    reader = ReplyReader()
    assert reader.gets() is False
    reader.feed(b"#f\r\n")
    assert reader.gets() is False  # the default sentinel is ambiguous, as in hiredis
    reader = ReplyReader(not_enough_data=None)
    reader.feed(b"#f\r")
    assert reader.gets() is None
    reader.feed(b"\n")
    assert reader.gets() is False


def test_reply_error_is_returned_and_reader_fails_for_good() -> None:
    reader = ReplyReader()
    reader.feed(b"-READONLY kvcache is a read replica\r\n!x\r\n+OK\r\n")
    err = reader.gets()
    assert isinstance(err, ReplyError) and str(err) == "READONLY kvcache is a read replica"
    for _ in range(2):
        with pytest.raises(ProtocolError):
            reader.gets()


def test_map_keys() -> None:
    reader = ReplyReader()
    reader.feed(b"%1\r\n*2\r\n:1\r\n:2\r\n+v\r\n")
    assert reader.gets() == {(1, 2): b"v"}  # an aggregate key, made hashable
    reader.feed(b"%2\r\n+k\r\n:1\r\n+k\r\n:2\r\n")
    assert reader.gets() == {b"k": 2}  # a repeated key: the last wins, as in redis-py


def test_large_reply_in_small_chunks() -> None:
    items = [resp.bulk(b"v%d\r\n" % i) for i in range(50_000)]
    wire = resp.array(items)
    reader = ReplyReader()
    reply = False
    for i in range(0, len(wire), 1000):
        reader.feed(wire[i:i + 1000])
        reply = reader.gets()
        assert reply is False or i + 1000 >= len(wire)
    assert reply == [b"v%d\r\n" % i for i in range(50_000)]
    assert reader.buffered == 0


# --------------------------------------------------------------------------- encoders


def test_encoders() -> None:
    assert resp.simple("OK") == resp.OK
    assert resp.simple("PONG") == resp.PONG
    assert resp.simple("a\r\nb") == b"+a  b\r\n"
    assert resp.error("ERR bad\nthing") == b"-ERR bad thing\r\n"
    assert resp.integer(-3) == b":-3\r\n"
    assert resp.bulk(b"a\r\n") == b"$3\r\na\r\n\r\n"
    assert resp.bulk(memoryview(b"xy")) == b"$2\r\nxy\r\n"
    assert resp.bulk(None, 2) == resp.NIL2 == b"$-1\r\n"
    assert resp.bulk(None, 3) == resp.NIL3 == b"_\r\n"
    assert resp.null(2) == resp.NIL2 and resp.null(3) == resp.NIL3
    assert resp.array([resp.integer(1), resp.bulk(b"a")]) == b"*2\r\n:1\r\n$1\r\na\r\n"
    assert resp.array([]) == resp.EMPTY_ARRAY
    assert resp.array(None, 2) == resp.NULL_ARRAY2 and resp.array(None, 3) == resp.NIL3
    pairs = [(resp.bulk(b"k"), resp.integer(1))]
    assert resp.map_(pairs, 2) == b"*2\r\n$1\r\nk\r\n:1\r\n"
    assert resp.map_(pairs, 3) == b"%1\r\n$1\r\nk\r\n:1\r\n"
    assert resp.verbatim("é", 3) == b"=6\r\ntxt:\xc3\xa9\r\n"
    assert resp.verbatim("é", 2) == b"$2\r\n\xc3\xa9\r\n"
    assert resp.boolean(True, 3) == b"#t\r\n" and resp.boolean(False, 2) == resp.ZERO
    assert resp.double(1.5, 3) == b",1.5\r\n" and resp.double(float("-inf"), 3) == b",-inf\r\n"
    assert resp.double(2, 2) == b"$3\r\n2.0\r\n"


# --------------------------------------------------------------------------- generated




@settings(max_examples=300, deadline=None)
@given(st.integers(2, 3).flatmap(lambda p: st.lists(_replies(p), min_size=1, max_size=4)),
       st.data())
def test_generated_replies_match_hiredis(replies: list[bytes], data: st.DataObject) -> None:
    wire = b"".join(replies)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=6)))
    chunks = [wire[a:b] for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True)]
    got, failed = run_replies(chunks)
    expected, hi_failed = run_hiredis([wire])
    assert not failed and not hi_failed
    assert len(got) == len(replies)
    assert norm(got) == norm(expected)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.binary(max_size=30), min_size=1, max_size=6), min_size=1, max_size=8),
       st.data())
def test_generated_requests_roundtrip(commands: list[list[bytes]], data: st.DataObject) -> None:
    wire = b"".join(resp.array([resp.bulk(a) for a in cmd]) for cmd in commands)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=6)))
    chunks = [wire[a:b] for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True)]
    assert run_requests(chunks) == (commands, None)


def test_bulk_array_copies_values_from_where_they_are():
    """MGET's reply: values may be memoryviews into the replica's map (kvcache.read.reads),
    written into the reply as they are; None is the protocol's nil."""
    values = [b"a", memoryview(b"xbcx")[1:3], None, b""]
    assert resp.bulk_array(values, 2) == b"*4\r\n$1\r\na\r\n$2\r\nbc\r\n$-1\r\n$0\r\n\r\n"
    assert resp.bulk_array(values, 3) == b"*4\r\n$1\r\na\r\n$2\r\nbc\r\n_\r\n$0\r\n\r\n"
    assert resp.bulk_array([], 2) == b"*0\r\n"
    assert resp.bulk_array(values, 2) == resp.array([resp.bulk(v, 2) for v in values], 2)
