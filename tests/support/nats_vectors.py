"""Wire vectors for the NATS protocol reader (kvcache/natsio/natsproto.py and ext/natsproto.pyx).

One table, VECTORS: (name, wire bytes, expected events, expected error). `error` is None for
well-formed input, else a substring of the ProtocolError message; `events` are then the events
delivered before the error (a reader fed in pieces may deliver them across several feeds).
"""
from __future__ import annotations

from kvcache.natsio.natsproto import OK, PING, PONG, Err, HMsg, Info, Msg


def msg_frame(subject: str, sid: int, reply: str, payload: bytes) -> bytes:
    r = f" {reply}" if reply else ""
    return f"MSG {subject} {sid}{r} {len(payload)}\r\n".encode() + payload + b"\r\n"


def hmsg_frame(subject: str, sid: int, reply: str, block: bytes, payload: bytes) -> bytes:
    r = f" {reply}" if reply else ""
    return (f"HMSG {subject} {sid}{r} {len(block)} {len(block) + len(payload)}\r\n".encode()
            + block + payload + b"\r\n")


ACK = "$JS.ACK.KV_config.dXyS0rC1.1.4711.42.1700000000123456789.0"
ACK_LONG = "$JS.ACK.hub.ACCHASH.KV_config.dXyS0rC1.2.4712.43.1700000000123456790.7.x9ZkqT"
WATCH_HDR = b"NATS/1.0\r\nKV-Operation: DEL\r\n\r\n"
DIRECT_HDR = (b"NATS/1.0\r\nNats-Stream: KV_config\r\nNats-Subject: $KV.config.app.db\r\n"
              b"Nats-Sequence: 4711\r\nNats-Time-Stamp: 2026-11-21 06:40:57.123456789 +0000 UTC\r\n\r\n")
DIRECT_HEADERS = {"Nats-Stream": "KV_config", "Nats-Subject": "$KV.config.app.db",
                  "Nats-Sequence": "4711",
                  "Nats-Time-Stamp": "2026-11-21 06:40:57.123456789 +0000 UTC"}
HB_HDR = b"NATS/1.0 100 Idle Heartbeat\r\nNats-Last-Consumer: 1016\r\nNats-Last-Stream: 1024\r\n\r\n"
BINARY = b"\r\n\x00\xff\r\nMSG x 1 2\r\n\r\n"

VECTORS: list[tuple[str, bytes, list, str | None]] = [
    # ------------------------------------------------------------------ MSG
    ("msg", msg_frame("foo.bar", 1, "", b"hello"), [Msg(1, "foo.bar", "", b"hello")], None),
    ("msg reply", msg_frame("foo", 22, "_INBOX.abc.1", b"hi"), [Msg(22, "foo", "_INBOX.abc.1", b"hi")], None),
    ("msg empty payload", b"MSG foo 1 0\r\n\r\n", [Msg(1, "foo", "", b"")], None),
    ("msg binary crlf payload", msg_frame("bin", 3, "", BINARY), [Msg(3, "bin", "", BINARY)], None),
    ("msg tabs and lowercase op", b"msg\tfoo\t\t7  r 3\r\nabc\r\n", [Msg(7, "foo", "r", b"abc")], None),
    ("msg bare lf control line", b"MSG foo 1 2\nab\r\n", [Msg(1, "foo", "", b"ab")], None),
    ("msg utf8 subject", msg_frame("s.ünï", 1, "", b"x"), [Msg(1, "s.ünï", "", b"x")], None),
    ("two msgs", msg_frame("a", 1, "", b"1") + msg_frame("b", 2, "r", b"22"),
     [Msg(1, "a", "", b"1"), Msg(2, "b", "r", b"22")], None),
    # ------------------------------------------------------------------ HMSG
    ("hmsg headers only", hmsg_frame("foo", 1, "", b"NATS/1.0\r\nA: 1\r\nB-Name:  two words \r\n\r\n", b"pay"),
     [HMsg(1, "foo", "", 0, "", {"A": "1", "B-Name": "two words"}, b"pay")], None),
    ("hmsg headers no payload", hmsg_frame("foo", 1, "r", b"NATS/1.0\r\nA: 1\r\n\r\n", b""),
     [HMsg(1, "foo", "r", 0, "", {"A": "1"}, b"")], None),
    ("hmsg empty header block", hmsg_frame("foo", 1, "", b"NATS/1.0\r\n\r\n", b"x"),
     [HMsg(1, "foo", "", 0, "", {}, b"x")], None),
    ("hmsg status only 503", hmsg_frame("_INBOX.x", 5, "", b"NATS/1.0 503\r\n\r\n", b""),
     [HMsg(5, "_INBOX.x", "", 503, "", {}, b"")], None),
    ("hmsg status 404 no messages", hmsg_frame("_INBOX.x", 5, "", b"NATS/1.0 404 No Messages\r\n\r\n", b""),
     [HMsg(5, "_INBOX.x", "", 404, "No Messages", {}, b"")], None),
    ("hmsg idle heartbeat with headers", hmsg_frame("_INBOX.hb", 9, "", HB_HDR, b""),
     [HMsg(9, "_INBOX.hb", "", 100, "Idle Heartbeat",
           {"Nats-Last-Consumer": "1016", "Nats-Last-Stream": "1024"}, b"")], None),
    ("hmsg 204 EOB with headers",
     hmsg_frame("_INBOX.b", 2, "", b"NATS/1.0 204 EOB\r\nNats-Num-Pending: 0\r\nNats-Last-Sequence: 9\r\n\r\n", b""),
     [HMsg(2, "_INBOX.b", "", 204, "EOB", {"Nats-Num-Pending": "0", "Nats-Last-Sequence": "9"}, b"")], None),
    ("hmsg flow control",
     hmsg_frame("_INBOX.fc", 2, "$JS.FC.KV_c.x.1", b"NATS/1.0 100 FlowControl Request\r\n\r\n", b""),
     [HMsg(2, "_INBOX.fc", "$JS.FC.KV_c.x.1", 100, "FlowControl Request", {}, b"")], None),
    ("hmsg repeated header",
     hmsg_frame("f", 1, "", b"NATS/1.0\r\nX: 1\r\nY: y\r\nX: 2\r\nX: 3\r\n\r\n", b""),
     [HMsg(1, "f", "", 0, "", {"X": "3", "Y": "y"}, b"", {"X": ["1", "2", "3"]})], None),
    ("hmsg odd header lines",
     hmsg_frame("f", 1, "", b"NATS/1.0\r\nno colon\r\n: empty\r\nsp ace: x\r\nn\xc3\xa9: x\r\n"
                b"V: a:b:c\r\nU: \xc3\xa9\xff\r\nE:\r\n\r\n", b""),
     [HMsg(1, "f", "", 0, "", {"V": "a:b:c", "U": "é\ufffd", "E": ""}, b"")], None),
    ("hmsg binary crlf payload", hmsg_frame("bin", 3, "", b"NATS/1.0\r\nA: b\r\n\r\n", BINARY),
     [HMsg(3, "bin", "", 0, "", {"A": "b"}, BINARY)], None),
    ("kv watch delivery",
     hmsg_frame("$KV.config.app.db", 1, ACK, WATCH_HDR, b""),
     [HMsg(1, "$KV.config.app.db", ACK, 0, "", {"KV-Operation": "DEL"}, b"")], None),
    ("kv watch put as msg", msg_frame("$KV.config.app.db", 1, ACK_LONG, b"postgres://db:5432"),
     [Msg(1, "$KV.config.app.db", ACK_LONG, b"postgres://db:5432")], None),
    ("direct get reply", hmsg_frame("_INBOX.dg.1", 4, "", DIRECT_HDR, b"postgres://db:5432"),
     [HMsg(4, "_INBOX.dg.1", "", 0, "", DIRECT_HEADERS, b"postgres://db:5432")], None),
    # ------------------------------------------------------------------ control ops
    ("ping pong ok", b"PING\r\nPONG\r\n+OK\r\nping \r\n", [PING, PONG, OK, PING], None),
    ("err", b"-ERR 'Stale Connection'\r\n-ERR 'Permissions Violation for Subscription to \"x\"'\r\n",
     [Err("Stale Connection"), Err('Permissions Violation for Subscription to "x"')], None),
    ("info", b'INFO {"server_id":"N1","max_payload":1048576,"headers":true}\r\n',
     [Info({"server_id": "N1", "max_payload": 1048576, "headers": True})], None),
    ("mixed", b"PING\r\n" + msg_frame("a", 1, "", b"\r\n") + b"+OK\r\n",
     [PING, Msg(1, "a", "", b"\r\n"), OK], None),
    # ------------------------------------------------------------------ malformed
    ("unknown op", b"PING\r\nFOO bar\r\n", [PING], "unknown protocol op"),
    ("empty line", b"\r\n", [], "unknown protocol op"),
    ("ping with args", b"PING x\r\n", [], "unknown protocol op"),
    ("msg too few fields", b"MSG foo 5\r\nhello\r\n", [], "malformed MSG"),
    ("msg too many fields", b"MSG foo 1 r x 5\r\nhello\r\n", [], "malformed MSG"),
    ("msg bad size", b"MSG foo 1 5x\r\nhello\r\n", [], "bad payload size"),
    ("msg negative size", b"MSG foo 1 -5\r\nhello\r\n", [], "bad payload size"),
    ("msg bad sid", b"MSG foo one 5\r\nhello\r\n", [], "bad sid"),
    ("msg huge size", b"MSG foo 1 99999999999999999999\r\n", [], "bad payload size"),
    ("msg payload too large", b"MSG foo 1 67108865\r\n", [], "payload too large"),
    ("msg short payload", b"MSG foo 1 3\r\nhello\r\n", [], "not followed by CRLF"),
    ("hmsg header over total", b"HMSG foo 1 20 10\r\n", [], "exceeds total size"),
    ("hmsg bad header size", b"HMSG foo 1 x 10\r\n", [], "bad header size"),
    ("hmsg bad total size", b"HMSG foo 1 r 2 1.0\r\n", [], "bad total size"),
    ("hmsg too few fields", b"HMSG foo 1 10\r\n", [], "malformed HMSG"),
    ("control line too long", b"MSG " + b"a" * 5000 + b" 1 0\r\n\r\n", [], "control line too long"),
    ("info not json", b"INFO {nope\r\n", [], "INFO is not valid JSON"),
    ("info not object", b"INFO [1]\r\n", [], "not a JSON object"),
]
