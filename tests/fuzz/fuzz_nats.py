"""Fuzz harness: the NATS protocol reader, ext/natsproto.pyx against kvcache/natsio/natsproto.py,
the JetStream fast lane (`add_lane`: KV deliveries folded into Runs of replica items, HMSG
headers deciding each one's operation and TTL) included.

The options byte picks the limits (bits 0-1, LIMITS: the last is a negative max_payload,
which both twins must meet alike), whether sids 0-15 are fast lanes
(bit 2) with a key prefix of 4 (`$KV.`) or 11 bytes (`$KV.config.`, bit 3), whether one
lane (a choice byte names it) is removed after the first chunk (bit 4), and whether the wire
is framed by the harness (bit 5, `framed`): then a mutated header or payload keeps its frame's
sizes right, where a byte-level mutation of a sized frame would mostly break its framing. The outcome: every
event (a Run by its fields), the protocol error (class, message, the events it carries) and
what stayed buffered; with small limits, the reader must never hold more than one frame.
"""
from __future__ import annotations

from dataclasses import replace
from types import ModuleType
from typing import Any

from harness import Raised, decode, differential, encode, native_module
from support.nats_vectors import ACK, ACK_LONG, VECTORS, hmsg_frame, msg_frame

from kvcache.errors import ProtocolError
from kvcache.natsio import natsproto as twin

LIMITS: list[dict[str, int]] = [{}, {"max_control_line": 128, "max_payload": 512},
                                {"max_control_line": 24, "max_payload": 8},
                                {"max_control_line": twin.MAX_CONTROL_LINE, "max_payload": -1}]
LANES = 16
native: ModuleType | None = None


def setup() -> None:
    global native
    native = native_module("natsproto")


def typed(events: list) -> list:
    return [(type(e).__name__, e.fields() if type(e).__name__ == "Run" else tuple(e)) for e in events]


def run(mod: ModuleType, chunks: list[bytes], options: int, removed: int) -> tuple[list, Raised | None, int]:
    limits = LIMITS[options & 3]
    reader = mod.NatsReader(**limits)
    if options & 4:
        for sid in range(LANES):
            reader.add_lane(sid, 11 if options & 8 else 4)
    bound = limits["max_control_line"] + 2 + limits["max_payload"] + 2 if limits.get("max_payload", 0) > 0 else 0
    events: list = []
    try:
        for i, chunk in enumerate(chunks):
            events += reader.feed(chunk)
            if bound and reader.buffered() > bound:
                raise AssertionError(f"holds {reader.buffered()} bytes, more than one frame ({bound})")
            if i == 0 and options & 16:
                reader.remove_lane(removed)
    except ProtocolError as e:
        return typed(events + e.events), Raised(f"{type(e).__module__}.{type(e).__qualname__}", str(e)), \
            reader.buffered()
    return typed(events), None, reader.buffered()


def merged(value: Any) -> Any:
    """Fed whole or cut: the same events and error. Left free: where a lane's Run is cut (runs
    of one sid with consecutive consumer sequences are joined here), what stays buffered after
    an error, and, when a lane is removed after the first chunk, everything (the chunk decides
    which deliveries came before)."""
    if not isinstance(value, tuple):
        return value
    events, err, buffered = value
    out: list = []
    for name, fields in events:
        prev = out[-1] if out else None
        if name == "Run" and prev and prev[0] == "Run" and prev[1] == fields[0] and prev[3] + 1 == fields[1]:
            sid, first, _last, top, _ts, _pending, items, deletes, marks, ttls, entries = prev[1:]
            out[-1] = ("Run", sid, first, fields[2], max(top, fields[3]), fields[4], fields[5], items + fields[6],
                       deletes + fields[7], marks + fields[8], ttls + fields[9], entries + fields[10])
        elif name == "Run":
            out.append(("Run", *fields))
        else:
            out.append((name, fields))
    return (out, err) if err is not None else (out, err, buffered)


FRAME, FIELD = b"\x00\x01", b"\x00\x02"


def framed(wire: bytes) -> bytes:
    """The wire a framed input stands for: frames split by FRAME, each `control` (one field:
    sent as it is), `control FIELD payload` (a MSG) or `control FIELD headers FIELD payload`
    (an HMSG), the sizes of the last two written by the harness: `MSG <control> <size>` and
    `HMSG <control> <header size> <total size>`."""
    out = []
    for frame in wire.split(FRAME):
        fields = frame.split(FIELD, 2)
        if len(fields) == 1:
            out.append(frame)
        elif len(fields) == 2:
            out.append(b"MSG %s %d\r\n%s\r\n" % (fields[0], len(fields[1]), fields[1]))
        else:
            head, payload = fields[1], fields[2]
            out.append(b"HMSG %s %d %d\r\n%s%s\r\n" % (fields[0], len(head), len(head) + len(payload), head, payload))
    return b"".join(out)


def unframed(frames: list[tuple[bytes, ...]]) -> bytes:
    """A framed wire (see framed) from (control[, headers], payload) tuples."""
    return FRAME.join(FIELD.join(f) for f in frames)


def check(data: bytes) -> None:
    case = decode(data)
    if case.options & 32:
        case = replace(case, wire=framed(case.wire))
    removed = case.choice(0, LANES)
    assert native is not None, "setup() first"
    # a negative limit is the caller's mistake: refused alike (ValueError) or taken alike
    allowed = (ProtocolError, ValueError) if LIMITS[case.options & 3].get("max_payload", 0) < 0 else (ProtocolError,)
    differential("nats", case, lambda mod, chunks: run(mod, chunks, case.options, removed), native, twin,
                 allowed=allowed, same_whole_as_cut=None if case.options & 16 else merged,
                 settings=f"limits {LIMITS[case.options & 3]}, " + (
                     f"sids 0-{LANES - 1} lanes (key prefix {11 if case.options & 8 else 4} bytes)"
                     + (f", lane {removed} removed after the first chunk" if case.options & 16 else "")
                     if case.options & 4 else "no lanes"))


def lane_ack(sseq: int, cseq: int, pending: int = 0, long_form: bool = False) -> str:
    ts = 1_700_000_000_000_000_000 + sseq
    if long_form:
        return f"$JS.ACK.hub.ACCHASH.KV_config.cons.1.{sseq}.{cseq}.{ts}.{pending}.tok"
    return f"$JS.ACK.KV_config.cons.1.{sseq}.{cseq}.{ts}.{pending}"


def lane_frame(key: str, sseq: int, cseq: int, sid: int = 7, headers: bytes = b"", value: bytes = b"",
               long_form: bool = False) -> bytes:
    reply = lane_ack(sseq, cseq, long_form=long_form)
    if not headers:
        return msg_frame("$KV.config." + key, sid, reply, value)
    return hmsg_frame("$KV.config." + key, sid, reply, b"NATS/1.0\r\n" + headers + b"\r\n", value)


LANE_WIRES = [
    lane_frame("a", 10, 1, value=b"1") + lane_frame("b", 11, 2, value=b"22") + lane_frame("c", 12, 3),
    lane_frame("a", 10, 1, headers=b"KV-Operation: DEL\r\n")
    + lane_frame("b", 11, 2, headers=b"KV-Operation: PURGE\r\n")
    + lane_frame("c", 12, 3, headers=b"Nats-Marker-Reason: MaxAge\r\n")
    + lane_frame("d", 13, 4, headers=b"Nats-Marker-Reason: Remove\r\n", long_form=True),
    lane_frame("a", 10, 1, headers=b"Nats-TTL: 2s\r\n", value=b"1")
    + lane_frame("b", 11, 2, headers=b"Nats-TTL: never\r\n", value=b"2")
    + lane_frame("c", 12, 3, headers=b"Nats-TTL: 1\r\nNats-TTL: 1h30m\r\n", value=b"3")
    + lane_frame("d", 13, 4, headers=b"Nats-TTL: bogus\r\n", value=b"4"),
    lane_frame("a", 10, 1, value=b"1") + hmsg_frame("_INBOX.feed", 7, "", b"NATS/1.0 100 Idle Heartbeat\r\n"
                                                    b"Nats-Last-Consumer: 3\r\nNats-Last-Stream: 12\r\n\r\n", b"")
    + lane_frame("c", 13, 4, value=b"3"),
    lane_frame("long." + "x" * 300, 10, 1, value=b"L") + lane_frame("e", 11, 2, headers=b"kv-operation: del\r\n"),
    msg_frame("$KV.config.x", 8, lane_ack(1, 1), b"v") + msg_frame("$KV.config.y", 7, "_INBOX.r", b"w"),
]


def lane_parts(key: str, sseq: int, cseq: int, headers: bytes = b"", value: bytes = b"") -> tuple[bytes, ...]:
    control = f"$KV.config.{key} 7 {lane_ack(sseq, cseq)}".encode()
    return (control, b"NATS/1.0\r\n" + headers + b"\r\n", value) if headers else (control, value)


LANE_FRAMES = [
    [lane_parts("a", 10, 1, b"Nats-TTL: 2s\r\n", b"1"), lane_parts("b", 11, 2, b"Nats-TTL: 90000000000ns\r\n", b"2"),
     lane_parts("c", 12, 3, b"KV-Operation: DEL\r\n"), lane_parts("d", 13, 4, value=b"4")],
    [(b"PING\r\n",), lane_parts("e", 20, 1, b"Nats-Marker-Reason: MaxAge\r\nNats-TTL: 1m\r\n"),
     (b"_INBOX.x 7", b"NATS/1.0 100 Idle Heartbeat\r\nNats-Last-Consumer: 1\r\n\r\n", b""),
     lane_parts("f", 21, 2, b"Nats-TTL: never\r\n", b"v")],
    # a Nats-TTL in each unit of a Go duration, and in seconds
    [lane_parts(f"t{i}", 30 + i, 1 + i, b"Nats-TTL: " + ttl + b"\r\n", b"v") for i, ttl in enumerate(
        [b"1500ms", b"3000000us", b"2h", b"1m30s", b"7", b"1.5s"])],
]


def seeds() -> list[bytes]:
    out = []
    for wire in [v[1] for v in VECTORS if len(v[1]) < 4096]:
        out += [encode(wire), encode(wire, 1, bytes([4, 9])), encode(wire, 2)]
    for wire in LANE_WIRES:
        out += [encode(wire, 4 | 8), encode(wire, 4 | 8, bytes([30, 2, 60])), encode(wire, 4 | 1),
                encode(wire, 4 | 8 | 16, bytes([7, 40]))]
    out.append(encode(msg_frame("a", 1, ACK, b"x") + msg_frame("b", 2, ACK_LONG, b"y"), 4))
    for frames in LANE_FRAMES:
        out += [encode(unframed(frames), 32 | 4 | 8), encode(unframed(frames), 32 | 4 | 8, bytes([17, 3])),
                encode(unframed(frames), 32)]
    return out


DICTIONARY = [b"\r\n", b"MSG ", b"HMSG ", b"PING\r\n", b"PONG\r\n", b"+OK\r\n", b"-ERR '", b"INFO {}",
              b"NATS/1.0", b"NATS/1.0 100 Idle Heartbeat", b"NATS/1.0 404 No Messages", b"NATS/1.0 503",
              b"\r\n\r\n", b": ", b"KV-Operation: ", b"DEL", b"PURGE", b"Nats-Marker-Reason: ", b"MaxAge",
              b"Remove", b"Nats-TTL: ", b"never", b"ns", b"us", b"\xc2\xb5s", b"\xce\xbcs", b"ms", b"s", b"m", b"h",
              b"$JS.ACK.", b"$JS.ACK.KV_config.cons.1.", b"$KV.config.", b".1700000000000000000.0",
              b"18446744073709551615", b"18446744073709551616", b"9223372036854775807", b"\t", b"\x0b", b"\x0c",
              b"\xc2\xa0", b"\xff", b"\xef\xbf\xbd", FRAME, FIELD]
