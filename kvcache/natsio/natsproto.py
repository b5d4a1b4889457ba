"""NATS client protocol reader: push-style and I/O-free (pure-Python twin of ext/natsproto.pyx).

    reader = NatsReader()
    for event in reader.feed(sock_bytes):   # any chunking: frames may split across feeds
        ...

Events (server → client ops), all tuples of a distinct type; test with `type(e) is Msg`:

- `Msg(sid, subject, reply, payload)`: `MSG`. sid int, subject/reply str (reply "" if none),
  payload bytes.
- `HMsg(sid, subject, reply, status, description, headers, payload, multi)`: `HMSG`. The
  `NATS/1.0 [<status> [<description>]]` first line of the header block gives `status` (int,
  0 when none) and `description` (str, "" when none), e.g. `100 Idle Heartbeat`,
  `404 No Messages`, `204 EOB`: after `NATS/1.0` and a space or tab, the line stripped of
  whitespace (bytes.strip()'s, a trailing \\v, \\f or lone \\r included, as nats-py strips the
  status and nats.go trims the line), its first token up to a space or tab is the status when
  it is 1 to 9 ASCII digits (nats-server writes 3), the rest, stripped, the description.
  `headers` is a dict name → last value (names ASCII, values UTF-8 with errors replaced,
  both stripped; lines without `:`, empty names and names with whitespace or non-ASCII bytes
  are skipped, like nats-py). `multi` is None unless a name repeats, then a dict name →
  [every value, in order] for the repeated names only.
- `PING`, `PONG`, `OK`: singletons of the types `Ping`, `Pong`, `Ok`.
- `Err(text)`: `-ERR 'text'` (quotes removed, case kept).
- `Info(info)`: `INFO {json}` as a dict.

Op names are case-insensitive and fields may be separated by spaces or tabs; control lines end
in CRLF (a bare LF is accepted). Malformed input raises `kvcache.errors.ProtocolError`, whose
`.events` holds the events parsed earlier in that feed; the reader is then unusable (the
connection must close). Limits: a control line of at most `max_control_line` bytes, a frame
body (headers + payload) of at most `max_payload` bytes (each 0 to 2**63 - 1: anything else
is an error at construction).

The reader keeps only the unparsed tail of a frame between feeds; a frame whose control line
has been parsed is not rescanned, so a big payload arriving in many reads costs linear time.

`parse_ack(reply)` parses a JetStream ack subject into an `AckMeta`, or None.

Fast lanes: `add_lane(sid, prefix_len)` marks a subscription as a KV consumer's delivery
subject. Its messages with a JetStream ack reply then come out not as Msg/HMsg but folded into
`Run` events: consecutive deliveries (consumer sequences without a gap) as replica items
(`kvcache.store.record.item`: the key is the subject minus its first prefix_len bytes), so that the
feed does no per-message work in Python. Anything else on that sid (heartbeats, pull-request
statuses) stays an ordinary event, in order. A delete item keeps only the LMDB key, so each Run
also carries `marks`: per delete, what the item drops (see Run). A put's own TTL is read from
its raw header block as nats-server reads it (kvcache.store.msgttl), not from the decoded
headers (which trim names and keep a repeated name's last value).
"""
from __future__ import annotations

import json
import re
from operator import index as _index
from typing import NamedTuple, cast

from kvcache.entry import Operation
from kvcache.errors import ProtocolError
from kvcache.store.msgttl import parse_msg_ttl, ttl_header
from kvcache.store.record import item as _item
from kvcache.store.revindex import put_entry

__all__ = [
    "MARK_DEL",
    "MARK_PURGE",
    "OK",
    "PING",
    "PONG",
    "AckMeta",
    "Err",
    "HMsg",
    "Info",
    "Msg",
    "NatsReader",
    "Ok",
    "Ping",
    "Pong",
    "ProtocolError",
    "Run",
    "decode_headers",
    "fold_delivery",
    "mark_op",
    "parse_ack",
    "status_headers",
]

MAX_CONTROL_LINE = 4096
MAX_PAYLOAD = 64 * 1024 * 1024


class Msg(NamedTuple):
    """A MSG frame (no headers)."""

    sid: int
    subject: str
    reply: str
    payload: bytes


class HMsg(NamedTuple):
    """An HMSG frame: headers (and the inline status of a status message) and payload."""

    sid: int
    subject: str
    reply: str
    status: int
    description: str
    headers: dict
    payload: bytes
    multi: dict | None = None


class Ping(NamedTuple):
    """A PING from the server (answered with PONG)."""

    pass


class Pong(NamedTuple):
    """A PONG from the server."""

    pass


class Ok(NamedTuple):
    """+OK (verbose mode)."""

    pass


class Err(NamedTuple):
    """-ERR from the server, with its message."""

    text: str


class Info(NamedTuple):
    """An INFO frame: the server's JSON description of itself."""

    info: dict


PING = Ping()
PONG = Pong()
OK = Ok()

RUN_FIELDS = ("sid", "first_cseq", "last_cseq", "top_sseq", "last_ts", "last_pending", "items",
              "deletes", "marks", "ttls", "entries")

# A mark's op (Run.marks): which delete a delivery stands for. 0 is a put, in C as here.
MARK_DEL = 1
MARK_PURGE = 2
_MARK_OF = {Operation.PUT: 0, Operation.DEL: MARK_DEL, Operation.PURGE: MARK_PURGE}


def mark_op(headers: dict | None) -> int:
    """Operation.of(headers) as a mark's op: 0 for a put, MARK_DEL or MARK_PURGE. The native
    lane asks this too when its byte-level scan cannot decide alone (a value edged with
    whitespace that only str.strip() knows, such as NBSP)."""
    return _MARK_OF[Operation.of(headers)]


class Run:
    """Consecutive fast-lane deliveries of one subscription: consumer sequences first_cseq ..
    last_cseq without a gap, the highest stream sequence among them, the last one's timestamp
    and pending count, `items` in delivery order and how many of them are deletes.

    `marks` has one `(key, seq, op, ts)` per delete item, in delivery order: what the item
    (`(lmdb_key, None)`) loses and a revision index needs: the NATS key's bytes as delivered
    (not the digest a long key is stored under), the stream sequence, MARK_DEL or MARK_PURGE
    (as Operation.of decides; a server marker is DEL only for the reason `Remove`) and the
    timestamp in ns. `deletes == len(marks)`. `ttls`: how many puts carry a TTL of their own
    (a `Nats-TTL` header): a batch with none, of a bucket with no max_age, files nothing in
    the expiry index, so the feed need not look at each record for a deadline. `entries`: each
    put item's revision-index entry (kvcache.store.revindex.put_entry), in order."""

    __slots__ = RUN_FIELDS

    def __init__(self, sid: int, cseq: int) -> None:
        self.sid = sid
        self.first_cseq = self.last_cseq = cseq
        self.top_sseq = self.last_ts = self.last_pending = self.deletes = self.ttls = 0
        self.items: list = []
        self.marks: list = []
        self.entries: list = []

    def fields(self) -> tuple:
        return tuple(getattr(self, f) for f in RUN_FIELDS)

    def __eq__(self, other: object) -> bool:  # equal to the native Run with the same fields
        fields = getattr(other, "fields", None)
        return fields is not None and type(other).__name__ == "Run" and self.fields() == fields()

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return f"Run(sid={self.sid}, cseq={self.first_cseq}..{self.last_cseq}, items={len(self.items)})"


class AckMeta(NamedTuple):
    """What a JetStream delivery's reply subject says: stream, consumer, sequences, time, pending."""

    stream: str
    consumer: str
    delivered: int
    stream_seq: int
    consumer_seq: int
    timestamp_ns: int
    pending: int


_U64_MAX = (1 << 64) - 1
_I64_MAX = (1 << 63) - 1


def _u64(tok: str) -> int | None:
    if not tok or len(tok) > 20 or not tok.isascii() or not tok.isdigit():
        return None
    v = int(tok)
    return v if v <= _U64_MAX else None


def parse_ack(reply: bytes | str) -> AckMeta | None:
    """`$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>` (9 tokens) or
    `$JS.ACK.<domain>.<account hash>.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>.<token>`
    (12 or more tokens, ADR-15). Integers are plain ASCII digits fitting 64 bits; stream and
    consumer are non-empty. Anything else is None."""
    if isinstance(reply, (bytes, bytearray, memoryview)):
        reply = bytes(reply).decode("utf-8", "replace")
    t = reply.split(".")
    n = len(t)
    if n < 9 or t[0] != "$JS" or t[1] != "ACK":
        return None
    if n == 9:
        i = 2
    elif n >= 12:
        i = 4
    else:
        return None
    if not t[i] or not t[i + 1]:
        return None
    nums = [_u64(x) for x in t[i + 2:i + 7]]
    if None in nums:
        return None
    return AckMeta(t[i], t[i + 1], *cast("list[int]", nums))


_WS = b" \t\r\n\x0b\x0c"
_SEP = re.compile(rb"[ \t]")
_SEPS = re.compile(rb"[ \t]+")
_NAME_BAD = frozenset(b"\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f ")


def decode_headers(block: bytes) -> tuple[int, str, dict, dict | None]:
    """A `NATS/1.0 ...` header block → (status, description, headers, multi), see HMsg."""
    status = 0
    desc = ""
    headers: dict[str, str] = {}
    multi: dict[str, list[str]] | None = None
    lines = block.split(b"\r\n")
    first = lines[0]
    if first.startswith(b"NATS/1.0") and (len(first) == 8 or first[8] in (32, 9)):
        rest = first[8:].strip(_WS)
        i = 0
        while i < len(rest) and rest[i] not in (32, 9):
            i += 1
        tok = rest[:i]
        if 0 < len(tok) <= 9 and tok.isdigit():
            status = int(tok)
        desc = rest[i:].strip(_WS).decode("utf-8", "replace")
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            continue
        name = name.strip(_WS)
        if not name or any(c >= 0x80 or c in _NAME_BAD for c in name):
            continue
        key = name.decode("ascii")
        val = value.strip(_WS).decode("utf-8", "replace")
        if key in headers:
            if multi is None:
                multi = {}
            if key in multi:
                multi[key].append(val)
            else:
                multi[key] = [headers[key], val]
        headers[key] = val
    return status, desc, headers, multi


def status_headers(status: int, description: str, headers: dict) -> dict:
    """nats-py's shape of a header block: the inline status as `Status` (3 digits) and
    `Description` entries beside the headers (what nats-py's users, the router included, read)."""
    if not status:
        return headers
    out = dict(headers)
    out["Status"] = f"{status:03d}"
    if description:
        out["Description"] = description
    return out


def _deliver(events: list, sid: int, ack: AckMeta, key: bytes, header_block: bytes,
             payload: bytes) -> None:
    """Fold one fast-lane delivery into the Run at the end of `events`, or start a new one."""
    run = events[-1] if events else None
    cseq = ack.consumer_seq
    if type(run) is not Run or run.sid != sid or run.last_cseq + 1 != cseq:
        run = Run(sid, cseq)
        events.append(run)
    headers = decode_headers(header_block)[2] if header_block else None
    op = mark_op(headers)
    value = None if op else payload
    # the TTL nats-server applies: its own reading of the raw block, not the decoded headers
    # (the first line named exactly Nats-TTL, the value as sent: kvcache.store.msgttl)
    ttl_value = ttl_header(header_block) if header_block and value is not None else None
    ttl = parse_msg_ttl(ttl_value) if ttl_value is not None else 0
    it = _item(key, value, ack.stream_seq, ack.timestamp_ns, ttl)
    run.items.append(it)
    if value is not None:
        run.entries.append(put_entry(it[0], ack.stream_seq))
    if ttl_value is not None:
        run.ttls += 1
    if op:
        run.marks.append((key, ack.stream_seq, op, ack.timestamp_ns))
        run.deletes += 1
    run.last_cseq = cseq
    run.top_sseq = max(run.top_sseq, ack.stream_seq)
    run.last_ts = ack.timestamp_ns
    run.last_pending = ack.pending


def fold_delivery(events: list, ack: AckMeta, key: bytes, header_block: bytes, payload: bytes) -> None:
    """The fast lane's own rule for one delivery, for messages that reach the feed another way
    (a stream's RePublish, a Direct Get batch: kvcache.feed.follow): folded into the Run at the
    end of `events` (consumer sequence `ack.consumer_seq` continuing it) or a new one, so that
    they are decoded exactly as a consumer's delivery of the same message would be."""
    _deliver(events, 0, ack, key, header_block, payload)


def _limit(name: str, value: int) -> int:
    """A NatsReader limit (bytes) as both twins take it: an integer from 0 to 2**63 - 1, else
    TypeError or ValueError at construction (a negative one read as "no limit" natively and
    "nothing fits" here, until both refused it)."""
    value = _index(value)
    if not 0 <= value <= _I64_MAX:
        raise ValueError(f"NatsReader: {name} must be 0 to {_I64_MAX} bytes, got {value}")
    return value


def _size(tok: bytes, what: str) -> int:
    if not tok or len(tok) > 19 or not tok.isdigit():
        raise ProtocolError(f"nats: bad {what} field {tok[:32]!r}")
    return int(tok)


class NatsReader:
    """Push-style NATS protocol reader; see the module docstring."""

    def __init__(self, max_control_line: int = MAX_CONTROL_LINE, max_payload: int = MAX_PAYLOAD):
        self.max_control_line = _limit("max_control_line", max_control_line)
        self.max_payload = _limit("max_payload", max_payload)
        self._buf = bytearray()   # the unparsed tail of the previous feeds
        self._scan = 0            # where to resume looking for LF in an incomplete control line
        self._pending = None      # (kind, sid, subject, reply, hdr_len, total_len, body_off, raw subject)
        self._broken = False
        self._lanes: dict[int, int] = {}

    def add_lane(self, sid: int, prefix_len: int) -> None:
        """Fold this subscription's JetStream deliveries into Run events (module docstring)."""
        self._lanes[sid] = prefix_len

    def remove_lane(self, sid: int) -> None:
        self._lanes.pop(sid, None)

    def buffered(self) -> int:
        """Bytes held between feeds (at most one partial frame)."""
        return len(self._buf)

    def feed(self, data: bytes) -> list:
        if self._broken:
            raise ProtocolError("nats: reader unusable after a protocol error")
        buf: bytes | bytearray
        if self._buf:
            self._buf += data
            buf = self._buf
        else:
            buf = data
        events: list = []
        try:
            pos = self._parse(buf, events)
        except ProtocolError as exc:
            self._broken = True
            self._buf = bytearray()
            exc.events = events
            raise
        except Exception as exc:   # e.g. RecursionError from json: still a protocol error
            self._broken = True
            self._buf = bytearray()
            err = ProtocolError(f"nats: malformed input ({exc})")
            err.events = events
            raise err from None
        if pos >= len(buf):
            self._buf = bytearray()
        elif buf is data:
            self._buf = bytearray(data[pos:])
        else:
            del self._buf[:pos]
        return events

    def _parse(self, buf, events: list) -> int:
        pos = 0
        end = len(buf)
        while pos < end:
            pend = self._pending
            if pend is None:
                eol = buf.find(b"\n", pos + self._scan, pos + self.max_control_line + 1)
                if eol < 0:
                    have = end - pos
                    if have > self.max_control_line:
                        raise ProtocolError(
                            f"nats: control line too long (over {self.max_control_line} bytes)")
                    self._scan = have
                    return pos
                self._scan = 0
                line_end = eol - 1 if eol > pos and buf[eol - 1] == 13 else eol
                line = bytes(buf[pos:line_end])
                pend = self._control(line, eol + 1 - pos, events)
                if pend is None:
                    pos = eol + 1
                    continue
                self._pending = pend
            kind, sid, subject, reply, hdr_len, total, body_off, raw_subject = pend
            need = body_off + total + 2
            if end - pos < need:
                return pos
            b = pos + body_off
            if buf[b + total] != 13 or buf[b + total + 1] != 10:
                raise ProtocolError("nats: message payload not followed by CRLF")
            plen = self._lanes.get(sid) if self._lanes else None
            ack = parse_ack(reply) if plen is not None else None
            if ack is not None and plen is not None and len(raw_subject) >= plen:
                _deliver(events, sid, ack, raw_subject[plen:], bytes(buf[b:b + hdr_len]),
                         bytes(buf[b + hdr_len:b + total]))
            elif kind == 1:
                events.append(Msg(sid, subject, reply, bytes(buf[b:b + total])))
            else:
                status, desc, headers, multi = decode_headers(bytes(buf[b:b + hdr_len]))
                events.append(HMsg(sid, subject, reply, status, desc, headers,
                                   bytes(buf[b + hdr_len:b + total]), multi))
            self._pending = None
            pos += need
        return pos

    def _control(self, line: bytes, body_off: int, events: list):
        m = _SEP.search(line)
        if m is None:
            op, rest = line, b""
        else:
            op, rest = line[:m.start()], line[m.start() + 1:]
        op = op.upper()
        if op == b"MSG" or op == b"HMSG":
            args = _SEPS.split(rest.strip(b" \t"))
            hmsg = op == b"HMSG"
            want = 4 if hmsg else 3
            if len(args) not in (want, want + 1):
                raise ProtocolError(f"nats: malformed {op.decode()} control line")
            subject = args[0].decode("utf-8", "replace")
            sid = _size(args[1], "sid")
            if sid > _I64_MAX:
                raise ProtocolError(f"nats: bad sid field {args[1][:32]!r}")
            reply = args[2].decode("utf-8", "replace") if len(args) == want + 1 else ""
            if hmsg:
                hdr_len = _size(args[-2], "header size")
                total = _size(args[-1], "total size")
                if hdr_len > total:
                    raise ProtocolError(f"nats: header size {hdr_len} exceeds total size {total}")
            else:
                hdr_len = 0
                total = _size(args[-1], "payload size")
            if total > self.max_payload:
                raise ProtocolError(
                    f"nats: payload too large ({total} bytes, limit {self.max_payload})")
            return (2 if hmsg else 1, sid, subject, reply, hdr_len, total, body_off, args[0])
        if op == b"PING" and not rest.strip(_WS):
            events.append(PING)
        elif op == b"PONG" and not rest.strip(_WS):
            events.append(PONG)
        elif op == b"+OK" and not rest.strip(_WS):
            events.append(OK)
        elif op == b"-ERR":
            text = rest.strip(_WS)
            if len(text) >= 2 and text[0] == 39 and text[-1] == 39:
                text = text[1:-1]
            events.append(Err(text.decode("utf-8", "replace")))
        elif op == b"INFO":
            try:
                info = json.loads(rest)
            except ValueError:
                raise ProtocolError("nats: INFO is not valid JSON") from None
            if not isinstance(info, dict):
                raise ProtocolError("nats: INFO is not a JSON object")
            events.append(Info(info))
        else:
            raise ProtocolError(f"nats: unknown protocol op {line[:32]!r}")
        return None
