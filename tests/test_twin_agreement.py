"""Where a coverage-guided fuzz run found a native module and its pure-Python twin apart, both
against what they must mean, every input whole and split at every byte boundary.

- `Nats-TTL`: a JetStream delivery's own TTL, read as nats-server reads it (the first header
  line named exactly `Nats-TTL`, a Go duration or a count of seconds, `never`); the table's
  accepted and refused values are nats-server's own (the live test publishes each), and a TTL
  nats-server applies is never stored as none, nor closes the connection (a running sidecar
  applies past one).
- the inline status of an HMSG: whitespace around the status line (a trailing \\v, \\f or lone
  \\r) is part of neither the status nor the description, as in nats-py and nats.go.
- a RESP3 map's or attribute's element count: counted in 64 bits, so a count past what they
  hold is a protocol error in both (the native reader doubled it into a signed overflow).
- `rewind_gets`: a call that does not follow the `take_gets` it names is a ValueError in
  both, and the reader is left as it was (the native reader moved its read position anywhere).
- `NatsReader`'s limits: a negative one is a ValueError in both (the twin enforced
  `max_payload=-1` as "nothing fits", the native reader as "no limit").
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

import nats
import pytest
import redis
from nats.js.api import StreamConfig
from nats.js.errors import NotFoundError
from support.checkers import bucket_info, new_bucket, wait_synced
from support.nats_vectors import hmsg_frame
from support.poll import until

from kvcache import resp as resp_twin
from kvcache.errors import ProtocolError
from kvcache.native import native_or_none
from kvcache.natsio import natsproto as nats_twin
from kvcache.natsio.natsproto import HMsg
from kvcache.store import msgttl
from kvcache.store.record import NEVER, deadline, decode_record

# not built: the native half of each test is skipped (an error with KVCACHE_REQUIRE_EXTENSIONS=1)
nats_native = native_or_none("natsproto")
resp_native = native_or_none("resp")


def impls(twin, native, name: str) -> list:
    return [pytest.param(twin, id="python"),
            pytest.param(native, id="native",
                         marks=pytest.mark.skipif(native is None, reason=f"kvcache._native.{name} not built"))]


NATS = impls(nats_twin, nats_native, "natsproto")
RESP = impls(resp_twin, resp_native, "resp")


LLMAX = 2**63 - 1


def cuts(data: bytes) -> list[list[bytes]]:
    """Whole, and split in two at every byte boundary."""
    return [[data]] + [[data[:i], data[i:]] for i in range(1, len(data))]


# --------------------------------------------------------------------------- Nats-TTL

SEC = 1_000_000_000
LANE_SID = 7
LANE_PREFIX = "$KV.config."
TS = 1_700_000_000_000_000_000  # the delivery's timestamp: the record's creation

# A header value -> the TTL nats-server applies, in seconds (-1 for never, 0 for none of its
# own), or None where nats-server refuses the put ("invalid per-message TTL"). Measured with
# nats-server 2.15.1; test_ttl_table_is_what_nats_server_accepts checks it against the server.
TTL_VALUES: list[tuple[bytes, int | None]] = [
    (b"5s", 5), (b"1h30m", 5400), (b"5m0.5s", 300), (b"1000ms", 1), (b"5.s", 5), (b"+5s", 5),
    ("5000000µs".encode(), 5),          # U+00B5 MICRO SIGN: the fuzz run's input
    ("5000000μs".encode(), 5),          # U+03BC GREEK SMALL LETTER MU
    (b"5000000us", 5), (b"5000000000ns", 5),
    (b"1.5s", 1), (b"1.99999999s", 1),  # truncated to whole seconds
    (b"1.999999999999999999s", 2),   # Go's float step for a fraction rounds this one up
    (b".5s1.5s", 2),
    (b"5", 5), (b"00005", 5), (b"00", 0), (b"", 0),
    (b"never", -1), (b"NEVER", -1), (b"Never", -1),
    (b"0", None), (b"-0", None), (b"0.5s", None), (b"999ms", None), (b"-5s", None), (b".5s", None),
    ("\u0665".encode(), None), ("²".encode(), None), ("5²".encode(), None),  # ARABIC-INDIC DIGIT FIVE
    ("5\u0665s".encode(), None),
    (b"5s ", None), (b"\t5s", None), (b"5 s", None), (b"5S", None), (b"5sec", None), (b"1d", None),
    (b"1e3s", None), (b"0x10", None), (b"+5", None), (b"1.5", None), (b"1h-5m", None),
    (b"never ", None), ("nevér".encode(), None), (b"bogus", None),
    # the edges of 64 bits: a Go duration's overflow is refused, a count of seconds wraps
    (b"2562047h", 9223369200), (b"2562048h", None), (b"9223372036854775808ns", None),
    (b"9223372036854775808ns9223372036854775808ns5s", 5),
    (b"9223372036854775807", 9223372036854775807), (b"9223372036854775808", None),
    (b"18446744073709551617", 1), (b"99999999999", 99999999999), (b"9223372036", 9223372036),
    (b"36028797018964268", 36028797018964268),  # 2**55 + 300: times 10**9 wraps to 300 s
]

# Header blocks (their lines) -> the TTL nats-server applies: which line it reads
TTL_BLOCKS: list[tuple[bytes, int]] = [
    (b"Nats-TTL: 2s\r\nNats-TTL: 1h\r\n", 2),         # the first line counts
    (b"Nats-TTL: 1h\r\nNats-TTL: 2s\r\n", 3600),
    (b"Nats-TTL: 1h\r\nNats-TTL: bogus\r\n", 3600),
    (b"Nats-TTL:2s\r\n", 2), (b"Nats-TTL:    2s\r\n", 2),
    (b"Nats-TTL : 2s\r\n", 0), (b"nats-ttl: 2s\r\n", 0), (b"X-Nats-TTL: 2s\r\n", 0),  # not its name
    (b"A: b\r\nNats-TTL: 3s\r\nC: d\r\n", 3),
    (b"Nats-TTL\r\nNats-TTL: 2s\r\n", 2), (b"Nats-TTLx: 3\r\nNats-TTL: 2s\r\n", 2),
    # nats-server's search resumes after a candidate that is not a line's name, and gives up
    # when the next one starts within 2 bytes of where it resumed
    (b"X: Nats-TTLNats-TTL\r\nNats-TTL: 2s\r\n", 0), (b"X: Nats-TTL Nats-TTL\r\nNats-TTL: 2s\r\n", 0),
    (b"X: Nats-TTL  Nats-TTL\r\nNats-TTL: 2s\r\n", 2),
]


def server_deadline(seconds: int) -> int:
    """Where nats-server files a message with this TTL: its timestamp plus the TTL in int64
    nanoseconds, which wrap (a deadline at or before its creation: removed at once)."""
    at = (TS + seconds * SEC) & (2**64 - 1)
    return at - 2**64 if at >= 2**63 else at


def lane_frame(block: bytes, value: bytes = b"v", sseq: int = 10, cseq: int = 1) -> bytes:
    reply = f"$JS.ACK.KV_config.cons.1.{sseq}.{cseq}.{TS}.0"
    return hmsg_frame(LANE_PREFIX + "k", LANE_SID, reply, b"NATS/1.0\r\n" + block + b"\r\n", value)


def lane(mod, chunks: list[bytes]) -> tuple[list, int]:
    """A fast lane's items and its count of TTL headers, or the error that closed it."""
    reader = mod.NatsReader()
    reader.add_lane(LANE_SID, len(LANE_PREFIX))
    events: list = []
    for chunk in chunks:
        events += reader.feed(chunk)
    (run,) = events
    return run.items, run.ttls


def check_record(rec: bytes, seconds: int) -> None:
    """The stored record keeps the value and the deadline nats-server keeps."""
    r = decode_record(b"k", rec)
    assert (r.value, r.revision, r.created) == (b"v", 10, TS)
    if seconds == 0:
        assert r.expires == 0 and deadline(rec) == 0            # no TTL of its own
    elif seconds < 0:
        assert r.expires == NEVER and deadline(rec) == 0        # never: not even max_age
    elif (due := server_deadline(seconds)) > TS:
        assert r.expires == due and deadline(rec) == due
    else:  # nats-server removes it at once: absent from its creation on
        assert 0 < r.expires <= TS and 0 < deadline(rec) <= TS


@pytest.mark.parametrize("mod", NATS)
@pytest.mark.parametrize("value,seconds", TTL_VALUES, ids=[repr(v) for v, _ in TTL_VALUES])
def test_lane_reads_nats_ttl_as_nats_server(mod, value, seconds):
    """Each value, through the fast lane, split at every boundary: the TTL nats-server applies
    (none where it refuses the value, as its store reads one it did not refuse), never a
    closed connection; the header counts as a TTL header either way."""
    wire = lane_frame(b"Nats-TTL: " + value + b"\r\n")
    for chunks in cuts(wire):
        items, ttls = lane(mod, chunks)
        assert ttls == 1 and [k for k, _ in items] == [b"k"]
        check_record(items[0][1], seconds or 0)


@pytest.mark.parametrize("mod", NATS)
@pytest.mark.parametrize("block,seconds", TTL_BLOCKS, ids=[repr(b) for b, _ in TTL_BLOCKS])
def test_lane_reads_the_line_nats_server_reads(mod, block, seconds):
    wire = lane_frame(block)
    for chunks in cuts(wire):
        items, ttls = lane(mod, chunks)
        assert ttls == (1 if seconds else 0)
        check_record(items[0][1], seconds)


def test_the_twins_build_the_same_records():
    """Native and twin: the same items, byte for byte, for every value and block above."""
    if nats_native is None:
        pytest.skip("kvcache._native.natsproto not built")
    blocks = [b"Nats-TTL: " + v + b"\r\n" for v, _ in TTL_VALUES] + [b for b, _ in TTL_BLOCKS]
    for block in blocks:
        wire = lane_frame(block)
        assert lane(nats_native, [wire]) == lane(nats_twin, [wire]), block


def test_msg_ttl_is_parse_message_ttl():
    """The parser alone: seconds as nats-server's parseMessageTTL, None where it refuses;
    parse_msg_ttl in ns (0 for a refused value), from bytes or from str."""
    for value, seconds in TTL_VALUES:
        assert msgttl.msg_ttl(value) == seconds, value
        ns = 0 if not seconds else -1 if seconds < 0 else seconds * SEC
        assert msgttl.parse_msg_ttl(value) == ns, value
        assert msgttl.parse_msg_ttl(value.decode("utf-8")) == ns, value
    assert msgttl.parse_msg_ttl(None) == 0


def test_a_refused_ttl_is_logged_once(caplog, monkeypatch):
    """A value nats-server refuses (it can only come from a server that ignored the header,
    before 2.11): no TTL of its own, as nats-server's store reads it, and one warning naming
    it, whichever twin reads it."""
    monkeypatch.setattr(msgttl, "_warned", False)
    wire = lane_frame(b"Nats-TTL: 5\xc2\xb2\r\n") + lane_frame(b"Nats-TTL: 0\r\n", sseq=11, cseq=2)
    with caplog.at_level(logging.WARNING, logger="kvcache.feed"):
        for mod in [m for m in (nats_twin, nats_native) if m is not None]:
            lane(mod, [wire])
    (rec,) = [r for r in caplog.records if "Nats-TTL" in r.getMessage()]
    assert "5\\xc2\\xb2" in rec.getMessage()


async def hpub(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, subject: str,
               block: bytes) -> dict:
    """Publish one message with this header block, byte for byte; the JetStream answer."""
    hdr = b"NATS/1.0\r\n" + block + b"\r\n"
    writer.write(b"HPUB %b ack %d %d\r\n%bv\r\n" % (subject.encode(), len(hdr), len(hdr) + 1, hdr))
    await writer.drain()
    while True:
        line = await reader.readline()
        if line.startswith(b"MSG "):
            body = await reader.readexactly(int(line.split()[-1]) + 2)
            return json.loads(body)
        if line.startswith(b"PING"):
            writer.write(b"PONG\r\n")
        elif line.startswith(b"-ERR"):
            raise AssertionError(line)


async def test_ttl_table_is_what_nats_server_accepts(nats_server):
    """Every value of the table, published raw to a stream that takes per-message TTLs: the
    server refuses exactly those the table says it refuses. Then the expiry itself, waited
    for: a block whose first Nats-TTL is 1s is removed while one whose first is 1h stays,
    a name that is not exactly `Nats-TTL` (or one the server's search gives up before) gives
    no TTL, and a count of seconds whose deadline overflows 64 bits is removed at once; the
    sidecar reads each block so."""
    server = nats_server
    nc = await nats.connect(server.url, allow_reconnect=False)
    try:
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name="TTLS", subjects=["ttl.>"], allow_msg_ttl=True))
        host, port = server.url.removeprefix("nats://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        await reader.readline()  # INFO
        writer.write(b'CONNECT {"verbose":false,"headers":true}\r\nSUB ack 1\r\n')
        refused = []
        for i, (value, _) in enumerate(TTL_VALUES):
            answer = await hpub(reader, writer, f"ttl.v{i}", b"Nats-TTL: " + value + b"\r\n")
            if "error" in answer:
                assert answer["error"]["err_code"] == 10165, answer   # invalid per-message TTL
                refused.append(value)
        assert refused == [v for v, s in TTL_VALUES if s is None]

        stays = {"b1": b"Nats-TTL: 1h\r\nNats-TTL: 1s\r\n", "b2": b"Nats-TTL : 1s\r\n",
                 "b3": b"nats-ttl: 1s\r\n", "b4": b"X: Nats-TTL Nats-TTL\r\nNats-TTL: 1s\r\n"}
        goes = {"g1": b"Nats-TTL: 1s\r\nNats-TTL: 1h\r\n", "g2": b"Nats-TTL:1s\r\n",
                "g3": b"X: Nats-TTL  Nats-TTL\r\nNats-TTL: 1s\r\n",
                "g4": b"Nats-TTL: 18446744073709551617\r\n", "g5": b"Nats-TTL: 99999999999\r\n"}
        for name, block in {**stays, **goes}.items():
            assert "error" not in await hpub(reader, writer, f"ttl.{name}", block)
        writer.close()

        async def present(name: str) -> bool:
            try:
                await js.get_msg("TTLS", subject=f"ttl.{name}")
                return True
            except NotFoundError:
                return False

        async def all_gone() -> bool:
            return not any([await present(n) for n in goes])

        await until(all_gone, 30, "the 1 s TTLs removed")
        assert all([await present(n) for n in stays])
        # what the sidecar reads from the same blocks: 1 s for those removed, 1 h or none for the others
        for name, block in {**stays, **goes}.items():
            ttl = msgttl.parse_msg_ttl(msgttl.ttl_header(b"NATS/1.0\r\n" + block + b"\r\n"))
            assert (ttl == SEC or ttl > 2**62) if name in goes else ttl in (0, 3600 * SEC), name
    finally:
        await nc.close()


@pytest.mark.timeout(120)
async def test_the_feed_takes_every_ttl_nats_server_takes(nats_server, sidecars):
    """Through a running sidecar: `Nats-TTL: 36028797018964268` (seconds that nats-server
    multiplies into 300 s, its int64 nanoseconds wrapping) used to close the feed's NATS
    connection at every redelivery, so nothing after it was applied; `300000000µs` was stored
    with no TTL by the native feed. Now the feed applies past both, each key's deadline its
    creation plus 300 s, and `99999999999` (whose deadline overflows: nats-server removes the
    message at once) leaves its key absent."""
    nc = await nats.connect(nats_server.url, allow_reconnect=False)
    try:
        js = nc.jetstream()
        b = new_bucket()
        kv = await js.create_key_value(bucket=b)
        cfg = (await js.stream_info(f"KV_{b}")).config
        cfg.allow_msg_ttl = True
        await js.update_stream(cfg)
        await kv.put("before", b"1")
        sc = sidecars(nats_server.url, b).start(wait_synced=False)
        await wait_synced(sc, b, keys=1)
        await js.publish(f"$KV.{b}.wrap", b"w", headers={"Nats-TTL": "36028797018964268"})
        await js.publish(f"$KV.{b}.micro", b"m", headers={"Nats-TTL": "300000000\u00b5s"})
        await js.publish(f"$KV.{b}.huge", b"h", headers={"Nats-TTL": "99999999999"})
        last = await kv.put("after", b"2")
        await until(lambda: bucket_info(sc, b)["applied_seq"] >= last, 30, f"the feed applying seq {last}",
                    detail=sc.log)
        r = redis.Redis(unix_socket_path=sc.socket, socket_timeout=10)
        assert r.get(f"{b}:after") == b"2" and r.get(f"{b}:huge") is None
        for key in ("wrap", "micro"):
            created = int(r.execute_command("KV.GET", f"{b}:{key}")[2])
            assert r.execute_command("PEXPIRETIME", f"{b}:{key}") == (created + 300 * SEC) // 1_000_000, key
    finally:
        await nc.close()


# --------------------------------------------------------------------------- HMSG status lines

STATUS_LINES: list[tuple[bytes, int, str]] = [
    (b"NATS/1.0 404\x0b", 404, ""),                 # the fuzz run's input
    (b"NATS/1.0 404\x0c", 404, ""),
    (b"NATS/1.0 404\r", 404, ""),                   # a lone CR before the CRLF
    (b"NATS/1.0 404 \t\x0b\x0c\r", 404, ""),
    (b"NATS/1.0 404 No Messages\x0b", 404, "No Messages"),
    (b"NATS/1.0 408 Request Timeout\r", 408, "Request Timeout"),
    (b"NATS/1.0\t503\x0c", 503, ""),
    (b"NATS/1.0 404\x0bx", 0, ""),                  # \v inside the token: not a status
    (b"NATS/1.0 40x", 0, ""),
]


@pytest.mark.parametrize("mod", NATS)
@pytest.mark.parametrize("first,status,desc", STATUS_LINES, ids=[repr(f) for f, _, _ in STATUS_LINES])
def test_status_line_whitespace(mod, first, status, desc):
    wire = hmsg_frame("_INBOX.x", 1, "", first + b"\r\nNats-Pending: 3\r\n\r\n", b"")
    for chunks in cuts(wire):
        events: list = []
        reader = mod.NatsReader()
        for chunk in chunks:
            events += reader.feed(chunk)
        assert events == [HMsg(1, "_INBOX.x", "", status, desc, {"Nats-Pending": "3"}, b"", None)]


# --------------------------------------------------------------------------- RESP3 aggregate counts

# an aggregate header -> fine (waits for its elements), or the count is past 64 bits
COUNTS: list[tuple[bytes, bool]] = [
    (b"%4611686018427387903\r\n", True),   # LLMAX // 2 pairs: 2 * that elements still fit
    (b"%4611686018427387904\r\n", False),  # the fuzz run's overflow: doubled, past LLMAX
    (b"|4611686018427387904\r\n", False),  # an attribute counts pairs too
    (b"%9223372036854775807\r\n", False),
    (b"%9999999999999999999\r\n", False),
    (b"*9223372036854775807\r\n", True),
    (b"*9223372036854775808\r\n", False),
    (b"~9999999999999999999\r\n", False),
    (b">9223372036854775808\r\n", False),
    (b"*2\r\n%4611686018427387904\r\n", False),  # nested
]


@pytest.mark.parametrize("mod", RESP)
@pytest.mark.parametrize("wire,fits", COUNTS, ids=[repr(w) for w, _ in COUNTS])
def test_aggregate_count_past_64_bits(mod, wire, fits):
    for chunks in cuts(wire):
        reader = mod.ReplyReader()
        got: list = []
        try:
            for chunk in chunks:
                reader.feed(chunk)
                got.append(reader.gets())
        except ProtocolError as e:
            assert not fits and str(e) == "Protocol error: invalid aggregate length"
            with pytest.raises(ProtocolError):  # sticky
                reader.gets()
            continue
        assert fits and got == [False] * len(chunks), got


@pytest.mark.parametrize("mod", RESP)
def test_a_map_that_fits_still_parses(mod):
    reader = mod.ReplyReader()
    reader.feed(b"%2\r\n+a\r\n:1\r\n+b\r\n%1\r\n+c\r\n:2\r\n|1\r\n+k\r\n+v\r\n*1\r\n:3\r\n")
    assert reader.gets() == {b"a": 1, b"b": {b"c": 2}}
    assert reader.gets() == [3]


# --------------------------------------------------------------------------- rewind_gets


def get_cmd(key: bytes) -> bytes:
    return b"*2\r\n$3\r\nGET\r\n$%d\r\n%b\r\n" % (len(key), key)


WIRE = get_cmd(b"a") + get_cmd(b"key:2") + get_cmd(b"c") + b"*1\r\n$4\r\nPING\r\n"

# a wrong call, given what take_gets returned -> the ValueError's text
BAD_REWINDS: list[tuple[str, Callable[[int, list, list], tuple], str]] = [
    ("count -1", lambda s, ls, ks: (s, ls, ks, -1), "count -1 is not within the 3 GETs"),
    ("count past the run", lambda s, ls, ks: (s, ls, ks, 4), "count 4 is not within the 3 GETs"),
    ("count past a list", lambda s, ls, ks: (s, ls, ks[:1], 2), "count 2 is not within the 1 GETs"),
    ("another start", lambda s, ls, ks: (s + 1, ls, ks, 1), "start 1 is not where take_gets began (0)"),
    ("a negative start", lambda s, ls, ks: (-40, ls, ks, 0), "start -40 is not where take_gets began (0)"),
    ("a huge start", lambda s, ls, ks: (2**70, ls, ks, 0), f"start {2**70} is not where take_gets began (0)"),
    ("longer keys", lambda s, ls, ks: (s, ls, [b"x" * 99] * 3, 3),
     "the first 3 GETs end at 354, past where take_gets stopped (64)"),
]


def taken(mod):
    reader = mod.RequestReader()
    reader.feed(WIRE)
    lengths, keys, start = reader.take_gets()
    assert (lengths, keys, start) == ([b"$1", b"$5", b"$1"], [b"a", b"key:2", b"c"], 0)
    return reader, lengths, keys, start


@pytest.mark.parametrize("mod", RESP)
@pytest.mark.parametrize("name,args,message", BAD_REWINDS, ids=[b[0] for b in BAD_REWINDS])
def test_a_wrong_rewind_is_refused(mod, name, args, message):
    """The same ValueError from both, and the reader as it was: the PING after the run is
    next, and the buffer is intact (a later feed and compaction work)."""
    reader, lengths, keys, start = taken(mod)
    before = reader.buffered
    with pytest.raises(ValueError, match=r"^rewind_gets: ") as e:
        reader.rewind_gets(*args(start, lengths, keys))
    assert message in str(e.value)
    assert reader.buffered == before == 14
    reader.rewind_gets(start, lengths, keys, 1)   # the right call still works
    assert reader.next_command() == [b"GET", b"key:2"]
    reader.feed(b"*1\r\n$70000\r\n" + b"x" * 70_000 + b"\r\n")
    assert [reader.next_command(), reader.next_command(), reader.next_command()] == [
        [b"GET", b"c"], [b"PING"], [b"x" * 70_000]]


@pytest.mark.parametrize("mod", RESP)
def test_a_rewind_must_follow_its_take(mod):
    """No take_gets yet, a second rewind, or the reader moved on since (next_command):
    refused, with the same text from both; a count that is not an integer: TypeError."""
    reader = mod.RequestReader()
    reader.feed(WIRE)
    with pytest.raises(ValueError, match="no take_gets to rewind"):
        reader.rewind_gets(0, [], [], 0)
    reader, lengths, keys, start = taken(mod)
    reader.rewind_gets(start, lengths, keys, 1)
    with pytest.raises(ValueError, match="no take_gets to rewind"):
        reader.rewind_gets(start, lengths, keys, 1)
    reader, lengths, keys, start = taken(mod)
    assert reader.next_command() == [b"PING"]
    with pytest.raises(ValueError, match="no take_gets to rewind"):
        reader.rewind_gets(start, lengths, keys, 0)
    with pytest.raises(TypeError):
        taken(mod)[0].rewind_gets(0, [b"$1"], [b"a"], 1.0)


@pytest.mark.parametrize("mod", RESP)
def test_rewinds_that_are_right(mod):
    """Each count from 0 to the whole run: the GETs after it come next, as before."""
    for count in range(4):
        reader, lengths, keys, start = taken(mod)
        reader.rewind_gets(start, lengths, keys, count)
        rest = [reader.next_command() for _ in range(5 - count)]
        assert rest == [[b"GET", k] for k in keys[count:]] + [[b"PING"], None]
    # a take after an earlier one: its own start
    reader = mod.RequestReader()
    reader.feed(get_cmd(b"a") + b"*1\r\n$4\r\nPING\r\n" + get_cmd(b"b") * 2)
    assert reader.take_gets()[1] == [b"a"] and reader.next_command() == [b"PING"]
    lengths, keys, start = reader.take_gets()
    assert start == 34
    reader.rewind_gets(start, lengths, keys, 1)
    assert reader.next_command() == [b"GET", b"b"] and reader.buffered == 0


# --------------------------------------------------------------------------- NatsReader limits


@pytest.mark.parametrize("mod", NATS)
@pytest.mark.parametrize("limits", [{"max_payload": -1}, {"max_control_line": -1},
                                    {"max_payload": 2**63}, {"max_control_line": -(2**70)}])
def test_a_limit_out_of_range_is_refused(mod, limits):
    ((name, value),) = limits.items()
    with pytest.raises(ValueError, match=f"^NatsReader: {name} must be 0 to {LLMAX} bytes, got {value}$"):
        mod.NatsReader(**limits)


@pytest.mark.parametrize("mod", NATS)
def test_limits_that_are_right(mod):
    """0 and the largest: what they say, in both. Not an integer: TypeError in both."""
    assert mod.NatsReader(max_payload=0).feed(b"MSG a 1 0\r\n\r\n")[0].payload == b""
    with pytest.raises(ProtocolError, match="payload too large"):
        mod.NatsReader(max_payload=0).feed(b"MSG a 1 1\r\nx\r\n")
    big = mod.NatsReader(max_control_line=LLMAX, max_payload=LLMAX)
    assert (big.max_control_line, big.max_payload) == (LLMAX, LLMAX)
    assert big.feed(b"MSG a 1 1\r\nx\r\nPING\r\n")[1] is nats_twin.PING
    with pytest.raises(TypeError):
        mod.NatsReader(max_payload=1.5)

