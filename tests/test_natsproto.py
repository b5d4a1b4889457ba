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

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client as _NatsClient
from nats.protocol.parser import Parser as _NatsParser
from support.nats_vectors import ACK, ACK_LONG, VECTORS, hmsg_frame, msg_frame

from kvcache.entry import Operation
from kvcache.errors import ProtocolError
from kvcache.native import native_or_none
from kvcache.natsio import natsproto as twin
from kvcache.natsio.natsproto import AckMeta, HMsg, Msg
from kvcache.store.record import item, parse_msg_ttl
from kvcache.store.revindex import put_entry

# not built: the native half of every test is skipped (fails with KVCACHE_REQUIRE_EXTENSIONS=1)
native = native_or_none("natsproto")

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
    return [(type(e).__name__, e.fields() if type(e).__name__ == "Run" else tuple(e)) for e in events]


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
    from kvcache.native import is_native, load
    mod = load("natsproto")
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
    """A 16 MiB payload fed in 4 KiB reads: nothing comes out until the frame is whole, and
    the reader holds exactly what it was fed (the tail grows by appending: no copy of what
    was parsed, no rescan). How long it takes is bench/test_bench_natsproto.py's business."""
    payload = bytes(range(256)) * (16 * 4096)
    wire = msg_frame("big", 1, "", payload) + b"PING\r\n"
    reader = mod.NatsReader()
    events = []
    end = len(wire) - len(b"PING\r\n")
    for i in range(0, len(wire), 4096):
        events += reader.feed(wire[i:i + 4096])
        if i + 4096 < end:
            assert events == [] and reader.buffered() == i + 4096, i
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
_desc = st.text("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ", min_size=1,
                max_size=30).map(str.strip).filter(bool)


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
    chunks = [wire[a:b] for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True)]
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
    chunks = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    reader = mod.NatsReader(**LIMITS)
    for sid in range(16):   # the seeds' sids: their deliveries go through the fast lane too
        reader.add_lane(sid, 4)
    events: list = []
    err = None
    try:
        for chunk in chunks:
            events += reader.feed(chunk)
            # at most one partial frame is kept: control line + body + CRLF
            assert reader.buffered() <= LIMITS["max_control_line"] + 2 + LIMITS["max_payload"] + 2
    except ProtocolError as exc:
        err = str(exc)
        events += exc.events
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


# --------------------------------------------------------------------------- fast lanes

LANE_SID = 7
LANE_PREFIX = "$KV.config."


def lane_ack(sseq: int, cseq: int, pending: int = 0, long_form: bool = False) -> str:
    ts = 1_700_000_000_000_000_000 + sseq
    if long_form:
        return f"$JS.ACK.hub.ACCHASH.KV_config.cons.1.{sseq}.{cseq}.{ts}.{pending}.tok"
    return f"$JS.ACK.KV_config.cons.1.{sseq}.{cseq}.{ts}.{pending}"


def lane_frame(key: str, sseq: int, cseq: int, op: str | None = None, value: bytes = b"",
               extra: bytes = b"", sid: int = LANE_SID, **kw) -> bytes:
    subject = LANE_PREFIX + key
    reply = lane_ack(sseq, cseq, **kw)
    if op is None and not extra:
        return msg_frame(subject, sid, reply, value)
    block = b"NATS/1.0\r\n" + extra + (f"KV-Operation: {op}\r\n".encode() if op else b"") + b"\r\n"
    return hmsg_frame(subject, sid, reply, block, value)


def merged(events: list) -> list:
    """Runs of one sid with consecutive consumer sequences joined: how a reader fed in pieces
    may cut them is not part of the contract."""
    out: list = []
    for e in events:
        if type(e).__name__ == "Run":
            prev = out[-1] if out else None
            if prev and prev[0] == "Run" and prev[1] == e.sid and prev[3] + 1 == e.first_cseq:
                out[-1] = ("Run", e.sid, prev[2], e.last_cseq, max(prev[4], e.top_sseq), e.last_ts,
                           e.last_pending, prev[7] + e.items, prev[8] + e.deletes, prev[9] + e.marks,
                           prev[10] + e.ttls, prev[11] + e.entries)
            else:
                out.append(("Run", *e.fields()))
        else:
            out.append((type(e).__name__, tuple(e)))
    return out


DEL, PURGE = twin.MARK_DEL, twin.MARK_PURGE


def lane_ts(sseq: int) -> int:
    return 1_700_000_000_000_000_000 + sseq


def expected_run(first_cseq: int, deliveries: list[tuple], pending: int = 0, ttls: int | None = None) -> tuple:
    """(key, stream seq, value, or DEL / PURGE for a delete[, ttl ns]) in order, consumer
    sequences from first_cseq. `ttls`: puts with a Nats-TTL header (default: those given a ttl)."""
    items = [item(d[0].encode(), None if isinstance(d[2], int) else d[2], d[1], lane_ts(d[1]), *d[3:])
             for d in deliveries]
    marks = [(d[0].encode(), d[1], d[2], lane_ts(d[1])) for d in deliveries if isinstance(d[2], int)]
    last = deliveries[-1][1]
    return ("Run", LANE_SID, first_cseq, first_cseq + len(deliveries) - 1,
            max(d[1] for d in deliveries), lane_ts(last), pending, items, len(marks), marks,
            sum(len(d) > 3 for d in deliveries) if ttls is None else ttls,
            [put_entry(lk, d[1]) for (lk, rec), d in zip(items, deliveries, strict=True) if rec is not None])


SEC = 1_000_000_000
HEARTBEAT = hmsg_frame("_INBOX.feed", LANE_SID, "", b"NATS/1.0 100 Idle Heartbeat\r\nNats-Last-Consumer: 3\r\n"
                       b"Nats-Last-Stream: 12\r\n\r\n", b"")
LONG_KEY = "long." + "x" * 600

LANE_VECTORS = [
    ("puts in one run",
     lane_frame("a", 10, 1, value=b"1") + lane_frame("b", 11, 2, value=b"22") + lane_frame("c", 12, 3, value=b""),
     [expected_run(1, [("a", 10, b"1"), ("b", 11, b"22"), ("c", 12, b"")])]),
    ("deletes, purges and markers",
     lane_frame("a", 10, 1, op="DEL") + lane_frame("b", 11, 2, op="purge", value=b"ignored")
     + lane_frame("c", 12, 3, op="PUT", value=b"v") + lane_frame("d", 13, 4, extra=b"Nats-Marker-Reason: MaxAge\r\n")
     + lane_frame("e", 14, 5, extra=b"Nats-Msg-Id: x\r\n", value=b"kept")
     + lane_frame("f", 15, 6, op="bogus", value=b"a put"),
     [expected_run(1, [("a", 10, DEL), ("b", 11, PURGE), ("c", 12, b"v"), ("d", 13, PURGE),
                       ("e", 14, b"kept"), ("f", 15, b"a put")])]),
    ("a gap starts a new run; statuses stay events, in order",
     lane_frame("a", 10, 1, value=b"1") + lane_frame("b", 11, 2, value=b"2") + HEARTBEAT
     + lane_frame("c", 13, 4, value=b"3", pending=5),
     [expected_run(1, [("a", 10, b"1"), ("b", 11, b"2")]),
      ("HMsg", (LANE_SID, "_INBOX.feed", "", 100, "Idle Heartbeat",
                {"Nats-Last-Consumer": "3", "Nats-Last-Stream": "12"}, b"", None)),
      expected_run(4, [("c", 13, b"3")], pending=5)]),
    ("subject order: the top stream sequence is the highest, not the last",
     lane_frame("a", 50, 1, value=b"1") + lane_frame("b", 20, 2, value=b"2", long_form=True),
     [expected_run(1, [("a", 50, b"1"), ("b", 20, b"2")])]),
    ("per-message TTLs ride in the record (the first Nats-TTL header counts, as nats-server reads it; "
     "deletes keep none)",
     lane_frame("a", 10, 1, value=b"1", extra=b"Nats-TTL: 2s\r\n")
     + lane_frame("b", 11, 2, value=b"2", extra=b"Nats-TTL: never\r\n")
     + lane_frame("c", 12, 3, value=b"3", extra=b"Nats-TTL: 1\r\nNats-TTL: 1h30m\r\n")
     + lane_frame(LONG_KEY, 13, 4, value=b"L", extra=b"Nats-TTL: 5\r\n")
     + lane_frame("d", 14, 5, op="DEL", extra=b"Nats-TTL: 60s\r\n")
     + lane_frame("e", 15, 6, extra=b"Nats-Marker-Reason: MaxAge\r\nNats-TTL: 30s\r\n")
     + lane_frame("f", 16, 7, value=b"f", extra=b"Nats-TTL: bogus\r\n"),
     [expected_run(1, [("a", 10, b"1", 2 * SEC), ("b", 11, b"2", -1), ("c", 12, b"3", 1 * SEC),
                       (LONG_KEY, 13, b"L", 5 * SEC), ("d", 14, DEL), ("e", 15, PURGE), ("f", 16, b"f")],
                   ttls=5)]),  # f's unreadable TTL is none of its own, but the header counts
    ("long keys are stored under a digest with the key in the record",
     lane_frame(LONG_KEY, 10, 1, value=b"L") + lane_frame(LONG_KEY, 11, 2, op="DEL"),
     [expected_run(1, [(LONG_KEY, 10, b"L"), (LONG_KEY, 11, DEL)])]),
    ("other sids and non-ack replies are ordinary messages",
     msg_frame("$KV.config.x", 8, lane_ack(1, 1), b"v") + msg_frame("$KV.config.y", LANE_SID, "_INBOX.r", b"w")
     + lane_frame("z", 3, 1, value=b"z"),
     [("Msg", (8, "$KV.config.x", lane_ack(1, 1), b"v")), ("Msg", (LANE_SID, "$KV.config.y", "_INBOX.r", b"w")),
      expected_run(1, [("z", 3, b"z")])]),
    ("marks: each delete's operation, as Operation.of decides it",
     lane_frame("a", 10, 1, op="DEL") + lane_frame("b", 11, 2, op="PURGE", value=b"gone")
     + lane_frame("c", 12, 3, extra=b"Nats-Marker-Reason: Remove\r\n")
     + lane_frame("d", 13, 4, extra=b"Nats-Marker-Reason: MaxAge\r\n")
     + lane_frame("e", 14, 5, op="del") + lane_frame("f", 15, 6, op="Unknown", value=b"a put")
     + lane_frame(LONG_KEY, 16, 7, op="purge") + lane_frame("g", 17, 8, extra=b"Nats-Marker-Reason: Purge\r\n")
     + lane_frame("h", 18, 9, extra=b"Nats-Marker-Reason: remove\r\n")
     + lane_frame("i", 19, 10, extra=b"Nats-Marker-Reason: \t Remove  \r\n"),
     [expected_run(1, [("a", 10, DEL), ("b", 11, PURGE), ("c", 12, DEL), ("d", 13, PURGE), ("e", 14, DEL),
                       ("f", 15, b"a put"), (LONG_KEY, 16, PURGE), ("g", 17, PURGE), ("h", 18, PURGE),
                       ("i", 19, DEL)])]),
    ("marks: repeated headers, the last value counts; a KV-Operation outranks a marker",
     lane_frame("a", 10, 1, value=b"1", extra=b"KV-Operation: DEL\r\nKV-Operation: PUT\r\n")
     + lane_frame("b", 11, 2, extra=b"KV-Operation: PUT\r\nKV-Operation: purge\r\n")
     + lane_frame("c", 12, 3, extra=b"Nats-Marker-Reason: Remove\r\nNats-Marker-Reason: MaxAge\r\n")
     + lane_frame("d", 13, 4, extra=b"Nats-Marker-Reason: MaxAge\r\nNats-Marker-Reason: Remove\r\n")
     + lane_frame("e", 14, 5, value=b"5", extra=b"Nats-Marker-Reason: Remove\r\n", op="PUT")
     + lane_frame("f", 15, 6, extra=b"KV-Operation: DEL\r\nNats-Marker-Reason: MaxAge\r\n")
     + lane_frame("g", 16, 7, value=b"7", extra=b"KV-Operation:\r\n")
     + lane_frame("h", 17, 8, extra=b"Nats-Marker-Reason:\r\n")
     + lane_frame("i", 18, 9, value=b"9", extra=b"kv-operation: DEL\r\n")
     + lane_frame("j", 19, 10, extra=b"KV-Operation : DEL\r\n"),
     [expected_run(1, [("a", 10, b"1"), ("b", 11, PURGE), ("c", 12, PURGE), ("d", 13, DEL), ("e", 14, b"5"),
                       ("f", 15, DEL), ("g", 16, b"7"), ("h", 17, PURGE), ("i", 18, b"9"), ("j", 19, DEL)])]),
    ("marks: whitespace only str.strip() knows, non-ASCII and invalid UTF-8 in the values",
     lane_frame("a", 10, 1, extra=b"KV-Operation: DEL\x1c\r\n")
     + lane_frame("b", 11, 2, extra=b"KV-Operation: \xc2\xa0purge\r\n")
     + lane_frame("c", 12, 3, extra=b"Nats-Marker-Reason: Remove\xe2\x80\x83\r\n")
     + lane_frame("d", 13, 4, extra=b"Nats-Marker-Reason: \x1fRemove\xc2\x85\r\n")
     + lane_frame("e", 14, 5, value=b"5", extra=b"KV-Operation: DEL\xff\r\n")
     + lane_frame("f", 15, 6, extra=b"Nats-Marker-Reason: Remove\xff\r\n")
     + lane_frame("g", 16, 7, value=b"7", extra=b"KV-Operation: DE\xc2\xa0L\r\n")
     + lane_frame("h", 17, 8, extra=b"Nats-Marker-Reason: Re\x1cmove\r\n"),
     [expected_run(1, [("a", 10, DEL), ("b", 11, PURGE), ("c", 12, DEL), ("d", 13, DEL), ("e", 14, b"5"),
                       ("f", 15, PURGE), ("g", 16, b"7"), ("h", 17, PURGE)])]),
]


def lane_run(mod, chunks: list[bytes]) -> list:
    reader = mod.NatsReader()
    reader.add_lane(LANE_SID, len(LANE_PREFIX))
    events: list = []
    for chunk in chunks:
        events += reader.feed(chunk)
    return events


@pytest.mark.parametrize("mod", IMPLS)
@pytest.mark.parametrize("name,wire,expected", LANE_VECTORS, ids=[v[0] for v in LANE_VECTORS])
def test_lane_vector(mod, name, wire, expected):
    for chunks in splits(wire):
        assert merged(lane_run(mod, chunks)) == expected, (name, [len(c) for c in chunks])


@pytest.mark.parametrize("mod", IMPLS)
def test_lane_can_be_removed(mod):
    reader = mod.NatsReader()
    reader.add_lane(LANE_SID, len(LANE_PREFIX))
    assert type(reader.feed(lane_frame("a", 1, 1, value=b"v"))[0]).__name__ == "Run"
    reader.remove_lane(LANE_SID)
    reader.remove_lane(12345)   # not a lane: nothing happens
    assert type(reader.feed(lane_frame("a", 2, 2, value=b"v"))[0]) is Msg


_lane_key = st.one_of(st.lists(_tok, min_size=1, max_size=4).map(".".join), st.just(LONG_KEY))


# header lines that decide a delivery's operation, the odd ones included
OP_LINES = [b"KV-Operation: DEL", b"KV-Operation: purge", b"KV-Operation: PUT", b"KV-Operation: bogus",
            b"KV-Operation:", b"Nats-Marker-Reason: Remove", b"Nats-Marker-Reason: MaxAge",
            b"Nats-Marker-Reason: remove", b"Nats-Marker-Reason:", b"KV-Operation: DEL\x1c",
            b"KV-Operation: \xc2\xa0PURGE", b"KV-Operation: DEL\xff", b"Nats-Marker-Reason: Remove\xe2\x80\x83",
            b"Nats-Marker-Reason: \x1fRemove", b"Nats-Marker-Reason: Remove\xc2", b"kv-operation: DEL",
            b"KV-Operation : del", b"Nats-Marker-Reason:\tRemove\t"]


@st.composite
def lane_stream(draw) -> bytes:
    frames_: list[bytes] = []
    cseq = draw(st.integers(1, 5))
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["put", "put", "hdr", "ttl", "del", "marker", "ops", "gap", "status",
                                     "other"]))
        seq = draw(st.integers(1, 2**40))
        key = draw(_lane_key)
        value = draw(st.binary(max_size=40))
        if kind == "status":
            frames_.append(HEARTBEAT)
            continue
        if kind == "other":
            frames_.append(draw(frames()))
            continue
        if kind == "gap":
            cseq += draw(st.integers(2, 4))
        extra = b"Nats-Marker-Reason: " + draw(st.sampled_from([b"Purge", b"Remove", b"MaxAge"])) + b"\r\n" \
            if kind == "marker" else (b"Nats-Expected-Last-Subject-Sequence: 3\r\n" if kind == "hdr" else b"")
        if kind == "ops":
            extra = b"".join(line + b"\r\n" for line in draw(st.lists(st.sampled_from(OP_LINES), min_size=1,
                                                                        max_size=3)))
        if kind in ("ttl", "del", "marker") and draw(st.booleans()):
            extra += b"Nats-TTL: " + draw(st.sampled_from([b"2s", b"never", b"10", b"1m5s", b"x"])) + b"\r\n"
        op = draw(st.sampled_from(["DEL", "PURGE", "del", "Purge"])) if kind == "del" else None
        frames_.append(lane_frame(key, seq, cseq, op=op, value=value, extra=extra,
                                  pending=draw(st.integers(0, 9)), long_form=draw(st.booleans())))
        cseq += 1
    return b"".join(frames_)


def lane_reference(wire: bytes) -> list:
    """What the lane must produce, computed from the ordinary events of a reader without
    lanes: one item per delivery, by kvcache.store.record.item and Operation.of."""
    out: list = []
    for e in twin.NatsReader().feed(wire):
        ack = twin.parse_ack(e.reply) if e.sid == LANE_SID else None
        if ack is None or not e.subject.startswith(LANE_PREFIX):
            out.append((type(e).__name__, tuple(e)))
            continue
        hdrs = e.headers if type(e) is HMsg else None
        op = Operation.of(hdrs)
        value = e.payload if op is Operation.PUT else None
        key = e.subject[len(LANE_PREFIX):].encode()
        prev = out[-1] if out else None
        has_ttl = bool(hdrs) and value is not None and hdrs.get("Nats-TTL") is not None
        # the first Nats-TTL line counts, as nats-server reads it (the decoded headers keep the last)
        multi = e.multi if type(e) is HMsg else None
        ttl = parse_msg_ttl(multi["Nats-TTL"][0] if multi and "Nats-TTL" in multi else hdrs["Nats-TTL"]) \
            if has_ttl else 0
        it = item(key, value, ack.stream_seq, ack.timestamp_ns, ttl)
        entries = [put_entry(it[0], ack.stream_seq)] if value is not None else []
        marks = [] if value is not None else [
            (key, ack.stream_seq, DEL if op is Operation.DEL else PURGE, ack.timestamp_ns)]
        if prev and prev[0] == "Run" and prev[3] + 1 == ack.consumer_seq:
            out[-1] = ("Run", LANE_SID, prev[2], ack.consumer_seq, max(prev[4], ack.stream_seq),
                       ack.timestamp_ns, ack.pending, prev[7] + [it], prev[8] + (value is None),
                       prev[9] + marks, prev[10] + has_ttl, prev[11] + entries)
        else:
            out.append(("Run", LANE_SID, ack.consumer_seq, ack.consumer_seq, ack.stream_seq,
                        ack.timestamp_ns, ack.pending, [it], int(value is None), marks, int(has_ttl), entries))
    return out


@pytest.mark.parametrize("mod", IMPLS)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lane_stream(), st.randoms(use_true_random=False))
def test_lane_matches_the_ordinary_path(mod, wire, rnd):
    cuts = sorted(rnd.sample(range(1, len(wire)), min(3, len(wire) - 1)))
    chunks = [wire[a:b] for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True)]
    assert merged(lane_run(mod, chunks)) == lane_reference(wire)


@pytest.mark.parametrize("mod", IMPLS)
def test_lane_has_no_reference_leaks(mod):
    import gc
    import sys
    wire = b"".join(v[1] for v in LANE_VECTORS)
    runs = [e for e in lane_run(mod, [wire]) if type(e).__name__ == "Run"]
    for run_ in runs:
        assert sys.getrefcount(run_) == 3
        for it in run_.items:
            assert sys.getrefcount(it) == 3
            rec = it[1]
            if rec is not None:
                assert sys.getrefcount(rec) == 3   # the item, the variable, the argument
        for mark in run_.marks:
            assert sys.getrefcount(mark) == 3
    del runs, run_, it, rec, mark
    gc.collect()
    before = len(gc.get_objects())
    for _ in range(200):
        lane_run(mod, [wire])
    gc.collect()
    assert len(gc.get_objects()) - before < 50


def test_lane_vectors_are_what_the_ordinary_path_says():
    """The vectors' expected runs (operations written out by hand) agree with Operation.of."""
    for name, wire, expected in LANE_VECTORS:
        assert lane_reference(wire) == expected, name


@pytest.mark.parametrize("mod", IMPLS)
def test_marks_carry_what_a_delete_item_loses(mod):
    """Per delete item, in order: the key as delivered (a long key's text, not its digest),
    the stream sequence, 1 for DEL or 2 for PURGE, the timestamp; `deletes == len(marks)`."""
    assert (twin.MARK_DEL, twin.MARK_PURGE) == (1, 2)
    assert twin.RUN_FIELDS[-4:] == ("deletes", "marks", "ttls", "entries")
    wire = (lane_frame("a", 10, 1, op="DEL") + lane_frame("b", 11, 2, op="PURGE", value=b"gone")
            + lane_frame("c", 12, 3, extra=b"Nats-Marker-Reason: Remove\r\n")
            + lane_frame("d", 13, 4, extra=b"Nats-Marker-Reason: MaxAge\r\n")
            + lane_frame("e", 14, 5, op="del") + lane_frame("f", 15, 6, op="Unknown", value=b"put")
            + lane_frame(LONG_KEY, 16, 7, op="DEL") + lane_frame("g", 17, 8, value=b"put"))
    (r,) = lane_run(mod, [wire])
    assert r.marks == [(b"a", 10, 1, lane_ts(10)), (b"b", 11, 2, lane_ts(11)), (b"c", 12, 1, lane_ts(12)),
                       (b"d", 13, 2, lane_ts(13)), (b"e", 14, 1, lane_ts(14)),
                       (LONG_KEY.encode(), 16, 1, lane_ts(16))]
    assert all(type(f) is int for m in r.marks for f in m[1:]) and all(type(m[0]) is bytes for m in r.marks)
    assert r.deletes == len(r.marks) == 6
    assert [v is None for _, v in r.items] == [True] * 5 + [False, True, False]
    assert r.items[6][0] != LONG_KEY.encode()   # the item: under the digest; the mark: the key
    assert r.items[5][1][:16] == item(b"f", b"put", 15, lane_ts(15))[1][:16]   # revision, created
    (r,) = lane_run(mod, [lane_frame("p", 1, 1, value=b"v")])
    assert r.marks == [] and r.deletes == 0
    other = twin_run(r)
    assert r == other
    other.marks = [(b"p", 1, DEL, lane_ts(1))]
    assert r != other   # marks count in a Run's equality


def twin_run(r):
    """The twin's Run with r's fields (Runs of either kind compare by their fields)."""
    t = twin.Run(r.sid, r.first_cseq)
    for f in twin.RUN_FIELDS:
        setattr(t, f, getattr(r, f))
    return t
