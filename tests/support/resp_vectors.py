"""RESP wire vectors and runners shared by the twin's tests (test_resp) and the native
parser's (test_resp_native): every vector runs on both, split at every byte boundary."""
from __future__ import annotations

import math

import hiredis
from hypothesis import strategies as st

from kvcache import resp
from kvcache.errors import ProtocolError
from kvcache.resp import INLINE_MAX, ReplyError


def splits(data: bytes) -> list[list[bytes]]:
    """Whole, byte by byte, and every two-chunk split."""
    ways = [[data], [data[i:i + 1] for i in range(len(data))]]
    ways += [[data[:i], data[i:]] for i in range(1, len(data))]
    return ways


def run_requests(chunks: list[bytes], mod=resp, **limits: int) -> tuple[list[list[bytes]], str | None]:
    """Every command the chunks hold, and the protocol error that ended them, if any; `mod`
    is the implementation under test (this twin, or the native module)."""
    reader = mod.RequestReader(**limits)
    commands: list[list[bytes]] = []
    try:
        for chunk in chunks:
            reader.feed(chunk)
            while (cmd := reader.next_command()) is not None:
                commands.append(cmd)
    except ProtocolError as exc:
        return commands, str(exc)
    return commands, None


_NONE = object()


def drain(reader, chunks: list[bytes], error_types: tuple[type[Exception], ...]) -> tuple[list, bool]:
    """All replies the chunks hold, and whether the reader reported a protocol error."""
    replies = []
    try:
        for chunk in chunks:
            reader.feed(chunk)
            while (reply := reader.gets()) is not _NONE:
                replies.append(reply)
    except error_types:
        return replies, True
    return replies, False


def run_replies(chunks: list[bytes], mod=resp) -> tuple[list, bool]:
    return drain(mod.ReplyReader(_NONE), chunks, (ProtocolError,))


def run_hiredis(chunks: list[bytes]) -> tuple[list, bool]:
    return drain(hiredis.Reader(notEnoughData=_NONE), chunks, (hiredis.ProtocolError,))


def norm(value: object) -> object:
    """Comparable form: error classes differ between the two readers, nan != nan."""
    if isinstance(value, Exception):
        return ("error", str(value))
    if isinstance(value, list):
        return [norm(v) for v in value]
    if isinstance(value, dict):
        return {k: norm(v) for k, v in value.items()}
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return value


MB = b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$5\r\nva\r\nl\r\n"  # binary-safe bulk holding CRLF


# (name, wire bytes, expected commands, expected error or None)
REQUEST_VECTORS = [
    ("get", b"*2\r\n$3\r\nGET\r\n$3\r\nfoo\r\n", [[b"GET", b"foo"]], None),
    ("binary", MB, [[b"SET", b"k", b"va\r\nl"]], None),
    ("empty bulk", b"*2\r\n$4\r\nECHO\r\n$0\r\n\r\n", [[b"ECHO", b""]], None),
    ("nul bytes", b"*1\r\n$3\r\n\x00\xff\n\r\n", [[b"\x00\xff\n"]], None),
    ("pipelined", b"*1\r\n$4\r\nPING\r\n" * 3 + MB, [[b"PING"]] * 3 + [[b"SET", b"k", b"va\r\nl"]], None),
    ("zero and null multibulk", b"*0\r\n*-1\r\n*1\r\n$4\r\nPING\r\n", [[b"PING"]], None),
    ("inline", b"PING\r\n", [[b"PING"]], None),
    ("inline lf only", b"GET  a\tb\n", [[b"GET", b"a", b"b"]], None),
    ("inline empty lines", b"\r\n\n  \r\nPING\r\n", [[b"PING"]], None),
    ("inline quotes", b'SET "a b" "x\\"y\\n\\x41" \'it\\\'s\'\r\n',
     [[b"SET", b"a b", b'x"y\nA', b"it's"]], None),
    ("inline empty quoted", b'ECHO ""\r\n', [[b"ECHO", b""]], None),
    ("inline then multibulk", b"PING\r\n*1\r\n$4\r\nPING\r\nECHO x\r\n",
     [[b"PING"], [b"PING"], [b"ECHO", b"x"]], None),
    ("unbalanced quotes", b'PING\r\nECHO "abc\r\n', [[b"PING"]],
     "Protocol error: unbalanced quotes in request"),
    ("quote not followed by space", b'ECHO "a"b\r\n', [],
     "Protocol error: unbalanced quotes in request"),
    ("bad multibulk length", b"*x\r\n", [], "Protocol error: invalid multibulk length"),
    # as Redis (processMultibulkBuffer): a negative count is no command; past INT_MAX, an error
    ("negative multibulk length", b"*-2\r\n*-10\r\nPING\r\n", [[b"PING"]], None),
    ("multibulk length past INT_MAX", b"*2147483648\r\n", [], "Protocol error: invalid multibulk length"),
    # numbers as Redis's string2ll reads them: no leading zero, no `-0`
    ("multibulk length with a leading zero", b"*01\r\n$4\r\nPING\r\n", [],
     "Protocol error: invalid multibulk length"),
    ("multibulk length minus zero", b"*-0\r\n", [], "Protocol error: invalid multibulk length"),
    ("bulk length with a leading zero", b"*1\r\n$04\r\nPING\r\n", [], "Protocol error: invalid bulk length"),
    ("bulk length zero", b"*1\r\n$0\r\n\r\n", [[b""]], None),
    ("multibulk length with space", b"* 1\r\n", [], "Protocol error: invalid multibulk length"),
    ("expected dollar", b"*1\r\n+PING\r\n", [], "Protocol error: expected '$', got '+'"),
    ("bad bulk length", b"*1\r\n$x\r\n", [], "Protocol error: invalid bulk length"),
    ("negative bulk length", b"*1\r\n$-1\r\n", [], "Protocol error: invalid bulk length"),
    ("bulk without crlf", b"*1\r\n$2\r\nabcd\r\n", [], "Protocol error: bulk not terminated by CRLF"),
    ("good then bad", b"*1\r\n$4\r\nPING\r\n*1\r\n:1\r\n", [[b"PING"]],
     "Protocol error: expected '$', got ':'"),
    ("incomplete", b"*2\r\n$3\r\nGET\r\n$3\r\nfo", [], None),
]


LIMIT_VECTORS = [
    ("too many arguments", b"*11\r\n", dict(max_args=10), "Protocol error: too many arguments"),
    ("max args ok", b"*2\r\n$1\r\na\r\n$1\r\nb\r\n", dict(max_args=2), None),
    ("bulk too big", b"*1\r\n$101\r\n", dict(max_request_bytes=100), "Protocol error: invalid bulk length"),
    ("request too large", b"*3\r\n$40\r\n" + b"a" * 40 + b"\r\n$40\r\n" + b"b" * 40 + b"\r\n$40\r\n",
     dict(max_request_bytes=100), "Protocol error: request too large"),
    ("inline too big", b"x" * (INLINE_MAX + 10), {}, "Protocol error: too big inline request"),
    ("inline too big with newline", b"x" * (INLINE_MAX + 1) + b"\r\n", {},
     "Protocol error: too big inline request"),
    ("mbulk count line too big", b"*" + b"1" * (INLINE_MAX + 10), {},
     "Protocol error: too big mbulk count string"),
    ("bulk count line too big", b"*1\r\n$" + b"1" * (INLINE_MAX + 10), {},
     "Protocol error: too big bulk count string"),
]


# (name, wire, expected replies, protocol error expected, same as hiredis)
REPLY_VECTORS = [
    ("simple", b"+OK\r\n", [b"OK"], False, True),
    ("empty simple", b"+\r\n", [b""], False, True),
    ("error", b"-ERR unknown command\r\n", [ReplyError("ERR unknown command")], False, True),
    ("integer", b":42\r\n:-7\r\n", [42, -7], False, True),
    ("bulk", b"$5\r\nhello\r\n", [b"hello"], False, True),
    ("binary bulk", b"$6\r\na\r\nb\r\n\r\n", [b"a\r\nb\r\n"], False, True),
    ("empty bulk", b"$0\r\n\r\n", [b""], False, True),
    ("null bulk", b"$-1\r\n", [None], False, True),
    ("null array", b"*-1\r\n", [None], False, True),
    ("empty array", b"*0\r\n", [[]], False, True),
    ("nested array", b"*3\r\n:1\r\n*2\r\n$1\r\na\r\n$-1\r\n-ERR in\r\n",
     [[1, [b"a", None], ReplyError("ERR in")]], False, True),
    ("deep", b"*1\r\n" * 6 + b":1\r\n", [[[[[[[1]]]]]]], False, True),
    ("pipelined", b"+OK\r\n" * 3 + b":1\r\n", [b"OK"] * 3 + [1], False, True),
    ("resp3 null", b"_\r\n", [None], False, True),
    ("double", b",1.5\r\n,-2\r\n,1e+16\r\n,inf\r\n,-inf\r\n", [1.5, -2.0, 1e16, math.inf, -math.inf],
     False, True),
    ("nan", b",nan\r\n", ["nan"], False, True),
    ("boolean", b"#t\r\n#f\r\n", [True, False], False, True),
    ("verbatim", b"=15\r\ntxt:Some string\r\n", [b"Some string"], False, True),
    ("empty verbatim", b"=4\r\ntxt:\r\n", [b""], False, True),
    ("map", b"%2\r\n+a\r\n:1\r\n$1\r\nb\r\n*1\r\n_\r\n", [{b"a": 1, b"b": [None]}], False, True),
    ("empty map", b"%0\r\n", [{}], False, True),
    ("set", b"~2\r\n:1\r\n:2\r\n", [[1, 2]], False, True),
    ("push", b">3\r\n+message\r\n+ch\r\n$1\r\nx\r\n", [[b"message", b"ch", b"x"]], False, True),
    ("bignum", b"(3492890328409238509324850943850943825024385\r\n",
     [3492890328409238509324850943850943825024385], False, False),
    ("attribute skipped", b"|1\r\n+ttl\r\n:3\r\n$1\r\nv\r\n", [b"v"], False, False),
    ("nested attribute", b"*2\r\n|1\r\n+a\r\n+b\r\n:1\r\n:2\r\n", [[1, 2]], False, False),
    ("empty attribute", b"|0\r\n:5\r\n", [5], False, False),
    ("blob error", b"!9\r\nERR x\r\nyz\r\n", [ReplyError("ERR x\r\nyz")], False, False),
    ("bad type", b"+OK\r\nx\r\n", [b"OK"], True, True),
    ("bad integer", b":abc\r\n", [], True, True),
    ("bad bulk length", b"$-2\r\n", [], True, True),
    ("bad boolean", b"#x\r\n", [], True, True),
    ("bad double", b",abc\r\n", [], True, True),
    ("bad bignum", b"(12a\r\n", [], True, True),
    ("bad verbatim", b"=3\r\nabc\r\n", [], True, True),
    ("bulk without crlf", b"$3\r\nabcXY", [], True, False),  # hiredis does not check
    ("incomplete", b"*2\r\n:1\r\n$3\r\nab", [], False, True),
]


def _replies(proto: int) -> st.SearchStrategy[bytes]:
    """Encoded reply trees, built with the module's own encoders."""
    key = st.one_of(st.binary(max_size=20).map(resp.bulk), st.integers(-2**63, 2**63 - 1).map(resp.integer))
    scalar = st.one_of(
        st.binary(max_size=40).map(lambda b: resp.bulk(b, proto)),
        st.just(resp.null(proto)),
        st.integers(-2**63, 2**63 - 1).map(resp.integer),
        st.text(st.characters(blacklist_categories=("Cs",)), max_size=20).map(resp.simple),
        st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=20)
        .map(lambda s: resp.error("ERR " + s)),
        st.text(max_size=40).map(lambda s: resp.verbatim(s, proto)),
        st.booleans().map(lambda v: resp.boolean(v, proto)),
        st.floats(allow_nan=False).map(lambda x: resp.double(x, proto)),
    )
    return st.recursive(
        scalar,
        lambda inner: st.one_of(
            st.lists(inner, max_size=5).map(lambda items: resp.array(items, proto)),
            st.just(resp.array(None, proto)),
            # unique keys: hiredis pairs a repeated key's value with the wrong key
            st.lists(st.tuples(key, inner), max_size=4, unique_by=lambda kv: kv[0])
            .map(lambda pairs: resp.map_(pairs, proto)),
        ),
        max_leaves=25,
    )
