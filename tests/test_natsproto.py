"""The NATS protocol reader: pure-Python twin and Cython extension, on the same vectors.

Every vector in nats_vectors.py runs against both implementations, whole, byte by byte and
split in two at every boundary. Generated MSG/HMSG streams are checked against nats-py's own
parser (its Parser class and its Client._process_headers, run as a library on an in-process
recorder). Random and mutated bytes must give events or a ProtocolError, nothing else, in
bounded time and with a bounded retained buffer, and the same answer from both versions.
"""
from __future__ import annotations

import enum
import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client as _NatsClient
from nats.protocol.parser import Parser as _NatsParser

from kvcache import natsproto as twin
from kvcache.errors import ProtocolError
from kvcache.natsproto import AckMeta, HMsg, Msg
from nats_vectors import ACK, ACK_LONG, VECTORS, hmsg_frame, msg_frame

try:
    from kvcache._native import natsproto as native
except ImportError:   # not built: the native half of every test is skipped
    native = None

IMPLS = [
    pytest.param(twin, id="python"),
    pytest.param(native, id="native",
                 marks=pytest.mark.skipif(native is None, reason="kvcache._native.natsproto not built")),
]


def splits(data: bytes) -> list[list[bytes]]:
    """Whole, byte by byte, and every two-chunk split."""
    ways = [[data], [data[i:i + 1] for i in range(len(data))]]
    ways += [[data[:i], data[i:]] for i in range(1, len(data))]
    return ways


def run(mod, chunks, **limits) -> tuple[list, str | None]:
    reader = mod.NatsReader(**limits)
    events: list = []
    try:
        for chunk in chunks:
            events += reader.feed(chunk)
    except ProtocolError as exc:
        return events + exc.events, str(exc)
    return events, None


def typed(events: list) -> list:
    return [(type(e).__name__, tuple(e)) for e in events]


# --------------------------------------------------------------------------- vectors


@pytest.mark.parametrize("mod", IMPLS)
@pytest.mark.parametrize("name,wire,expected,error", VECTORS, ids=[v[0] for v in VECTORS])
def test_vector(mod, name, wire, expected, error):
    for chunks in splits(wire):
        events, err = run(mod, chunks)
        assert typed(events) == typed(expected), (name, [len(c) for c in chunks])
        if error is None:
            assert err is None, (name, err)
        else:
            assert err is not None and error in err, (name, err)


def test_native_is_what_native_py_picks():
    from kvcache.native import is_native, pick
    mod = pick("natsproto", "natsproto")
    assert is_native(mod) == (native is not None and mod is native)


@pytest.mark.parametrize("mod", IMPLS)
def test_events_are_the_twins_types(mod):
    (ev,) = mod.NatsReader().feed(msg_frame("a", 1, "", b"x"))
    assert type(ev) is Msg and ev.subject == "a" and ev.payload == b"x"
    (ev,) = mod.NatsReader().feed(hmsg_frame("a", 1, "", b"NATS/1.0 404 No Messages\r\n\r\n", b""))
    assert type(ev) is HMsg and ev.status == 404 and ev.multi is None
    assert mod.NatsReader().feed(b"PING\r\n")[0] is twin.PING


@pytest.mark.parametrize("mod", IMPLS)
def test_unusable_after_error(mod):
    reader = mod.NatsReader()
    with pytest.raises(ProtocolError):
        reader.feed(b"BOGUS\r\n")
    with pytest.raises(ProtocolError, match="unusable"):
        reader.feed(b"PING\r\n")


@pytest.mark.parametrize("mod", IMPLS)
def test_limits_are_configurable(mod):
    assert run(mod, [b"MSG a 1 11\r\n"], max_payload=10)[1].startswith("nats: payload too large")
    assert run(mod, [b"MSG a 1 10\r\n0123456789\r\n"], max_payload=10)[1] is None
    line = b"MSG " + b"s" * 20 + b" 1 0\r\n"
    assert "control line too long" in run(mod, [line + b"\r\n"], max_control_line=16)[1]
    assert run(mod, [line + b"\r\n"], max_control_line=len(line) - 1)[1] is None


@pytest.mark.parametrize("mod", IMPLS)
def test_big_payload_in_many_reads_is_linear(mod):
    """A 16 MiB payload fed in 4 KiB reads: the control line is parsed once and the tail
    grows by appending, so this takes milliseconds, not the seconds a rescan would."""
    payload = bytes(range(256)) * (16 * 4096)
    wire = msg_frame("big", 1, "", payload) + b"PING\r\n"
    reader = mod.NatsReader()
    events = []
    t0 = time.perf_counter()
    for i in range(0, len(wire), 4096):
        events += reader.feed(wire[i:i + 4096])
    assert time.perf_counter() - t0 < 5
    assert events == [Msg(1, "big", "", payload), twin.PING] and reader.buffered() == 0


@pytest.mark.parametrize("mod", IMPLS)
def test_retained_buffer_is_only_the_partial_frame(mod):
    frame = msg_frame("a", 1, "", b"x" * 100)
    reader = mod.NatsReader()
    assert len(reader.feed(frame * 50 + frame[:30])) == 50
    assert reader.buffered() == 30
    assert len(reader.feed(frame[30:] + frame[:10])) == 1
    assert reader.buffered() == 10


# --------------------------------------------------------------------------- parse_ack

ACK_CASES = [
    (ACK, AckMeta("KV_config", "dXyS0rC1", 1, 4711, 42, 1700000000123456789, 0)),
    (ACK_LONG, AckMeta("KV_config", "dXyS0rC1", 2, 4712, 43, 1700000000123456790, 7)),
    ("$JS.ACK.d.h.S.C.1.2.3.4.5.t.extra", AckMeta("S", "C", 1, 2, 3, 4, 5)),
    ("$JS.ACK.S.C.18446744073709551615.0.0.0.0", AckMeta("S", "C", 2**64 - 1, 0, 0, 0, 0)),
    ("$JS.ACK.S.C.18446744073709551616.0.0.0.0", None),      # over 64 bits
    ("$JS.ACK.S.C.1.2.3.4", None),                           # 8 tokens
    ("$JS.ACK.S.C.1.2.3.4.5.6", None),                       # 10 tokens
    ("$JS.ACK.d.h.S.C.1.2.3.4.5", None),                     # 11 tokens
    ("$JS.ACK..C.1.2.3.4.5", None),                          # empty stream
    ("$JS.ACK.S..1.2.3.4.5", None),                          # empty consumer
    ("$JS.ACK.S.C.1.2.-3.4.5", None),
    ("$JS.ACK.S.C.1.2.+3.4.5", None),
    ("$JS.ACK.S.C.1.2. 3.4.5", None),
    ("$JS.ACK.S.C.1.2.3.4.", None),
    ("$JS.ACK.S.C.1.2.٣.4.5", None),                         # non-ASCII digit
    ("$JS.NAK.S.C.1.2.3.4.5", None),
    ("_INBOX.abc", None),
    ("", None),
    ("$JS.ACK.Strëam.C.1.2.3.4.5", AckMeta("Strëam", "C", 1, 2, 3, 4, 5)),
]


@pytest.mark.parametrize("mod", IMPLS)
@pytest.mark.parametrize("reply,expected", ACK_CASES)
def test_parse_ack(mod, reply, expected):
    assert mod.parse_ack(reply) == expected
    assert mod.parse_ack(reply.encode()) == expected
    if expected is not None:
        assert type(mod.parse_ack(reply)) is AckMeta


@pytest.mark.skipif(native is None, reason="kvcache._native.natsproto not built")
@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(["$JS", "ACK", "", "0", "12", "x", "18446744073709551616"]),
                          st.text(max_size=4)), max_size=14))
def test_parse_ack_twins_agree(tokens):
    reply = ".".join(tokens)
    assert native.parse_ack(reply) == twin.parse_ack(reply)


# --------------------------------------------------------------------------- nats-py


class _Recorder:
    """nats-py's Parser calls these on its client; the header decoding is nats-py's own."""
    _process_headers = _NatsClient._process_headers
    _parse_header_lines = staticmethod(_NatsClient._parse_header_lines)

    def __init__(self):
        self.msgs: list = []

    async def _error_cb(self, exc):
        raise exc

    async def _process_msg(self, sid, subject, reply, data, headers):
        self.msgs.append((sid, subject, reply, data, await self._process_headers(headers)))


def run_coro(coro):
    """Run a coroutine that never suspends (nats-py's parser on a recorder)."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    raise AssertionError("coroutine suspended")


def natspy_parse(chunks: list[bytes]) -> list:
    rec = _Recorder()
    parser = _NatsParser(rec)
    for chunk in chunks:
        run_coro(parser.parse(chunk))
    return rec.msgs


def _key(k) -> str:
    return k.value if isinstance(k, enum.Enum) else k


def natspy_view(m) -> tuple:
    sid, subject, reply, data, hdr = m
    hdr = {_key(k): v for k, v in (hdr or {}).items()}
    status = int(hdr.pop("Status", 0))
    desc = hdr.pop("Description", "")
    return sid, subject, reply, data, status, desc, hdr


def our_view(e) -> tuple:
    if type(e) is Msg:
        return e.sid, e.subject.encode(), e.reply.encode(), e.payload, 0, "", {}
    return e.sid, e.subject.encode(), e.reply.encode(), e.payload, e.status, e.description, e.headers


_tok = st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-$", min_size=1, max_size=12)
_subject = st.lists(_tok, min_size=1, max_size=5).map(".".join)
# nats-py stores the inline status under the header names Status and Description: keep clear
_name = st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_", min_size=1,
                max_size=20).filter(lambda n: n not in ("Status", "Description"))
_value = st.text(st.characters(blacklist_characters="\n", blacklist_categories=("Cs",)), max_size=40)
_desc = st.text("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ", min_size=1, max_size=30).map(str.strip).filter(bool)


@st.composite
def frames(draw) -> bytes:
    subject = draw(_subject)
    sid = draw(st.integers(1, 2**31))
    reply = draw(st.one_of(st.just(""), _subject, st.just(ACK), st.just(ACK_LONG)))
    payload = draw(st.binary(max_size=64) | st.sampled_from([b"\r\n", b"MSG a 1 1\r\nx\r\n", b""]))
    if not draw(st.booleans()):
        return msg_frame(subject, sid, reply, payload)
    headers = draw(st.lists(st.tuples(_name, _value), max_size=6))
    status = draw(st.one_of(st.none(), st.integers(100, 999)))
    first = b"NATS/1.0"
    if status is not None:
        desc = draw(_desc) if headers else draw(st.one_of(st.just(""), _desc))
        first += f" {status}".encode() + (f" {desc}".encode() if desc else b"")
    block = first + b"\r\n" + b"".join(f"{n}: {v}\r\n".encode() for n, v in headers) + b"\r\n"
    return hmsg_frame(subject, sid, reply, block, payload)


@pytest.mark.parametrize("mod", IMPLS)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(frames(), min_size=1, max_size=8), st.randoms(use_true_random=False))
def test_differential_against_natspy(mod, stream, rnd):
    wire = b"".join(stream)
    cuts = sorted(rnd.sample(range(1, len(wire)), min(3, len(wire) - 1)))
    chunks = [wire[a:b] for a, b in zip([0] + cuts, cuts + [len(wire)])]
    theirs = [natspy_view(m) for m in natspy_parse(chunks)]
    ours, err = run(mod, chunks)
    assert err is None
    assert [our_view(e) for e in ours] == theirs


# --------------------------------------------------------------------------- fuzz

SEED = [v[1] for v in VECTORS if v[3] is None]
LIMITS = {"max_control_line": 128, "max_payload": 512}


def mutate(rnd: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rnd.randint(1, 4)):
        op = rnd.randrange(4)
        i = rnd.randrange(len(b) + 1)
        if op == 0 and b:
            b[min(i, len(b) - 1)] = rnd.randrange(256)
        elif op == 1:
            b[i:i] = rnd.choice([b"\r\n", b" ", b"9", b"\x00", b"MSG ", b"HMSG ", b"-", b":"])
        elif op == 2:
            del b[i:i + rnd.randint(1, 8)]
        else:
            b[i:i] = bytes(b[rnd.randrange(len(b) + 1):][:16])
    return bytes(b)


def fuzz_one(mod, data: bytes, cuts: list[int]):
    chunks = [data[a:b] for a, b in zip([0] + cuts, cuts + [len(data)])]
    reader = mod.NatsReader(**LIMITS)
    events: list = []
    err = None
    t0 = time.perf_counter()
    try:
        for chunk in chunks:
            events += reader.feed(chunk)
            # at most one partial frame is kept: control line + body + CRLF
            assert reader.buffered() <= LIMITS["max_control_line"] + 2 + LIMITS["max_payload"] + 2
    except ProtocolError as exc:
        err = str(exc)
        events += exc.events
    assert time.perf_counter() - t0 < 1.0
    return typed(events), err


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.binary(max_size=600),
                 st.tuples(st.sampled_from(SEED), st.randoms(use_true_random=False))
                 .map(lambda t: mutate(t[1], b"".join(t[1].sample(SEED, 3)) + t[0]))),
       st.lists(st.integers(0, 2000), max_size=4))
def test_fuzz_no_crash_and_twins_agree(data, cuts):
    cuts = sorted({c for c in cuts if 0 < c < len(data)})
    theirs = fuzz_one(twin, data, cuts)
    if native is not None:
        assert fuzz_one(native, data, cuts) == theirs


@pytest.mark.parametrize("mod", IMPLS)
def test_no_reference_leaks(mod):
    """Every returned object is owned by its event only (a leaked reference in the native
    code would show here, and as a slowly growing heap in the sidecar)."""
    import gc
    import sys
    wire = b"".join(v[1] for v in VECTORS if v[3] is None)
    events = mod.NatsReader().feed(wire)
    assert len(events) > 20
    for ev in events:
        if ev in (twin.PING, twin.PONG, twin.OK):
            continue
        assert sys.getrefcount(ev) == 3, ev    # the list, the loop variable, the argument
        for field in ev:
            if isinstance(field, (bytes, dict)) and len(field) > 1:   # b"x" is a shared singleton
                assert sys.getrefcount(field) == 3, (ev, field)   # the event, the loop, the argument
    ack = mod.parse_ack(ACK)
    assert sys.getrefcount(ack) == 2
    del events, ev, ack
    gc.collect()
    before = len(gc.get_objects())
    reader = mod.NatsReader()
    for _ in range(200):
        reader.feed(wire)
        mod.parse_ack(ACK_LONG)
    gc.collect()
    assert len(gc.get_objects()) - before < 50
