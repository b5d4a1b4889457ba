"""The command layer in process, by table, over both twins (tests/support/command_layer.py):
real client connections over a recording transport, a real replica, real feeds never started,
no NATS. Each case is a pipeline of requests and the exact bytes that must come back, sent as
one socket read and again one byte per read (the RESP reader must cut the same requests).

The replies are Redis's where Redis has the command (checked against redis-server 7 by hand
when written: arity before AUTH, a subcommand's own arity, EXEC refused inside MULTI ending
the transaction, the integer readings); the rest are kvcache's (docs/commands.md)."""
from __future__ import annotations

import pytest
from support.command_layer import PASSWORD, VALUES, Layer

from kvcache.errors import CommandError
from kvcache.native import is_native, native_or_none
from kvcache.serve import arguments
from kvcache.serve.command_table import BY_NAME, COMMANDS, NO_AUTH, TRACKED, arity_error, key_args

NATIVE_BUILT = native_or_none("resp") is not None and native_or_none("server_get") is not None
TWINS = [pytest.param(False, id="native", marks=pytest.mark.skipif(not NATIVE_BUILT, reason="not built")),
         pytest.param(True, id="twins")]


def err(message: str) -> bytes:
    return b"-" + message.encode() + b"\r\n"


def arity(name: str) -> bytes:
    return err(f"ERR wrong number of arguments for '{name}' command")


NOT_INT = err("ERR value is not an integer or out of range")
EXECABORT = err("EXECABORT Transaction discarded because of previous errors.")
FIRST_ENTRY = (b"*1\r\n*2\r\n$3\r\n1-0\r\n*8\r\n$3\r\nkey\r\n$5\r\nin.k1\r\n$5\r\nvalue\r\n$2\r\nv1\r\n"
               b"$2\r\nop\r\n$3\r\nPUT\r\n$7\r\ncreated\r\n$19\r\n1700000000000000000\r\n")

# name -> (commands, the bytes of their replies, over TCP: AUTH applies)
CASES: dict[str, tuple[list[list[str]], bytes] | tuple[list[list[str]], bytes, bool]] = {
    "ping": ([["PING"], ["PING", "hi"], ["PING", "a", "b"]], b"+PONG\r\n$2\r\nhi\r\n" + arity("ping")),
    "echo": ([["ECHO", "x"], ["ECHO"]], b"$1\r\nx\r\n" + arity("echo")),
    "get, the GET path": ([["GET", "in.k1"], ["GET", "in.none"], ["GET", "in.empty"], ["GET", "in.big"]],
                          b"$2\r\nv1\r\n$-1\r\n$0\r\n\r\n$5000\r\n" + VALUES["in.big"] + b"\r\n"),
    "get, the generic path": ([["get", "in.k2"], ["GET"], ["GET", "a", "b"], ["GET", "in..bad"]],
                              b"$2\r\nv2\r\n" + arity("get") * 2
                              + err("ERR invalid key 'in..bad': KV keys use A-Z a-z 0-9 - / _ = "
                                    "and dots between tokens")),
    "mget, exists": ([["MGET", "in.k1", "in.none", "in.k3"], ["MGET"], ["EXISTS", "in.k1", "in.k2", "in.none"],
                      ["EXISTS", "@main"], ["EXISTS", "@main", "in.k1", "@main", "@nosuch"], ["EXISTS", "@nosuch"]],
                     b"*3\r\n$2\r\nv1\r\n$-1\r\n$2\r\nv3\r\n" + arity("mget") + b":2\r\n"
                     + b":1\r\n:3\r\n:0\r\n"),
    "strlen, type, ttl": ([["STRLEN", "in.k1"], ["TYPE", "in.k1"], ["TYPE", "in.none"], ["TYPE", "@main"],
                           ["TTL", "in.k1"], ["PTTL", "in.none"], ["TTL"], ["EXPIRETIME", "a", "b"]],
                          b":2\r\n+string\r\n+none\r\n+stream\r\n:-1\r\n:-2\r\n" + arity("ttl") + arity("expiretime")),
    "getrange integers": ([["GETRANGE", "in.k1", "0", "-1"], ["GETRANGE", "in.k1", "x", "1"],
                           ["GETRANGE", "in.k1", "01", "2"], ["GETRANGE", "in.k1", "0", "99999999999999999999"],
                           ["GETRANGE", "in.k1", "+1", "2"], ["GETRANGE", "in.k1", "1"]],
                          b"$2\r\nv1\r\n" + NOT_INT * 4 + arity("getrange")),
    "select integers": ([["SELECT", "0"], ["SELECT", "1"], ["SELECT", "+1"], ["SELECT", " 1"], ["SELECT", "-0"],
                         ["SELECT", "99999999999"], ["SELECT"]],
                        b"+OK\r\n" + err("ERR DB index is out of range") + NOT_INT * 3
                        + err("ERR value is out of range, value must between -2147483648 and 2147483647")
                        + arity("select")),
    "scan": ([["SCAN", "0", "COUNT", "100"], ["SCAN", "00", "MATCH", "in.k1"], ["SCAN", "x"], ["SCAN", "7"],
              ["SCAN", "0", "COUNT", "-1"], ["SCAN", "0", "COUNT", "0"], ["SCAN", "0", "COUNT", "18446744073709551616"],
              ["SCAN", "0", "MATCH"], ["SCAN", "0", "TYPE", "hash"]],
             b"*2\r\n$1\r\n0\r\n*5\r\n$6\r\nin.big\r\n$8\r\nin.empty\r\n$5\r\nin.k1\r\n$5\r\nin.k2\r\n$5\r\nin.k3\r\n"
             b"*2\r\n$1\r\n0\r\n*1\r\n$5\r\nin.k1\r\n" + err("ERR invalid cursor") * 2
             + err("ERR syntax error") * 2 + NOT_INT + err("ERR syntax error") + b"*2\r\n$1\r\n0\r\n*0\r\n"),
    "keys, dbsize": ([["KEYS", "in.k*"], ["DBSIZE"], ["DBSIZE", "x"]],
                     b"*3\r\n$5\r\nin.k1\r\n$5\r\nin.k2\r\n$5\r\nin.k3\r\n:5\r\n" + arity("dbsize")),
    "command": ([["COMMAND", "COUNT"], ["COMMAND", "COUNT", "x"], ["COMMAND", "INFO", "get", "nosuch"],
                 ["COMMAND", "DOCS", "ping", "nosuch", "PING"], ["COMMAND", "NOSUCH"]],
                b":%d\r\n" % len(COMMANDS) + arity("command|count")
                + b"*2\r\n*10\r\n$3\r\nget\r\n:2\r\n*2\r\n+readonly\r\n+fast\r\n:1\r\n:1\r\n:1\r\n"
                  b"*3\r\n+@read\r\n+@string\r\n+@fast\r\n*0\r\n*0\r\n*0\r\n*-1\r\n"
                + b"*2\r\n$4\r\nping\r\n*6\r\n$7\r\nsummary\r\n$15\r\nPing the server\r\n$5\r\ngroup\r\n"
                  b"$10\r\nconnection\r\n$5\r\nsince\r\n$5\r\n1.0.0\r\n"
                + err("ERR unknown subcommand 'NOSUCH'. Try COMMAND HELP.")),
    "client": ([["CLIENT"], ["CLIENT", "GETNAME", "x"], ["CLIENT", "NOSUCH"], ["CLIENT", "SETNAME", "n1"],
                ["CLIENT", "GETNAME"], ["CLIENT", "TRACKING", "on", "REDIRECT", "1x"], ["CLIENT", "LIST", "ID", "x"],
                ["CLIENT", "KILL", "ID", "0"], ["CLIENT", "KILL", "MAXAGE", "x"], ["CLIENT", "PAUSE"],
                ["CLIENT", "SETINFO", "lib-name"], ["CLIENT", "TRACKING"]],
               arity("client") + arity("client|getname") + err("ERR unknown subcommand 'NOSUCH'. Try CLIENT HELP.")
               + b"+OK\r\n$2\r\nn1\r\n" + NOT_INT + err("ERR Invalid client ID")
               + err("ERR client-id should be greater than 0") + err("ERR maxage is not an integer or out of range")
               + err("ERR unknown subcommand 'PAUSE'. Try CLIENT HELP.") + arity("client|setinfo")
               + arity("client|tracking")),
    "hello": ([["HELLO", "3x"], ["HELLO", "4"], ["HELLO", " 3"], ["HELLO", "2", "SETNAME"]],
              err("ERR Protocol version is not an integer or out of range")
              + err("NOPROTO unsupported protocol version")
              + err("ERR Protocol version is not an integer or out of range")
              + err("ERR Syntax error in HELLO option 'SETNAME'")),
    "config": ([["CONFIG"], ["CONFIG", "GET"], ["CONFIG", "SET", "a"], ["CONFIG", "SET", "a", "b", "c"],
                ["CONFIG", "GET", "databases"]],
               arity("config") + arity("config|get") + arity("config|set") * 2
               + b"*2\r\n$9\r\ndatabases\r\n$1\r\n1\r\n"),
    "pubsub": ([["PUBSUB"], ["PUBSUB", "NUMPAT", "x"], ["PUBSUB", "NUMPAT"], ["PUBSUB", "CHANNELS", "a", "b"],
                ["SUBSCRIBE"]],
               arity("pubsub") + arity("pubsub|numpat") + b":0\r\n" + arity("pubsub|channels") + arity("subscribe")),
    "multi": ([["MULTI"], ["GET", "in.k1"], ["TTL", "in.k1"], ["EXEC"]],
              b"+OK\r\n+QUEUED\r\n+QUEUED\r\n*2\r\n$2\r\nv1\r\n:-1\r\n"),
    "multi, a wrong count queued": ([["MULTI"], ["GET", "in.k1"], ["GET"], ["EXEC"]],
                                    b"+OK\r\n+QUEUED\r\n" + arity("get") + EXECABORT),
    "multi, a subcommand's count": ([["MULTI"], ["CLIENT", "GETNAME", "x"], ["EXEC"]],
                                    b"+OK\r\n" + arity("client|getname") + EXECABORT),
    "multi, exec's own count": ([["MULTI"], ["EXEC", "x"], ["EXEC"]],
                                b"+OK\r\n" + err("EXECABORT Transaction discarded because of: wrong number of "
                                                 "arguments for 'exec' command") + err("ERR EXEC without MULTI")),
    "multi, unknown and writes": ([["MULTI"], ["NOSUCH"], ["SET", "a", "b"], ["EXEC"]],
                                  b"+OK\r\n" + err("ERR unknown command 'NOSUCH', with args beginning with: ")
                                  + err("READONLY kvcache is a read replica") + EXECABORT),
    "kv.get options": ([["KV.GET", "in.k1", "MAXSTALE", "-1"], ["KV.GET", "in.k1", "MAXSTALE", "x"],
                        ["KV.GET", "in.k1", "MINREV", "99999999999999999999"], ["KV.GET", "in.k1", "NOPE", "1"],
                        ["KV.GET", "in.k1", "MAXSTALE"], ["KV.GET"]],
                       err("ERR value is out of range, must be positive") + NOT_INT * 2
                       + err("ERR syntax error") * 2 + arity("kv.get")),
    "stream arguments": ([["XREAD", "COUNT", "18446744073709551616", "STREAMS", "@main", "0"],
                          ["XREAD", "COUNT", "1x", "STREAMS", "@main", "0"],
                          ["XREAD", "BLOCK", "-1", "STREAMS", "@main", "0"],
                          ["XREAD", "BLOCK", "1x", "STREAMS", "@main", "0"],
                          ["XREAD", "BLOCK", "9223372036854775807", "STREAMS", "@main", "0"],
                          ["XREAD", "STREAMS", "@main"],
                          ["XRANGE", "@main", "-", "+", "COUNT", "x"], ["XRANGE", "@main", "-"],
                          ["XRANGE", "@main", "-", "+", "COUNT", "0"], ["XRANGE", "@main", "-", "+", "COUNT", "1"],
                          ["XREVRANGE", "@main", "+", "-", "COUNT", "-5"],
                          ["XINFO"], ["XINFO", "GROUPS"], ["XINFO", "STREAM"], ["XINFO", "GROUPS", "@main"],
                          ["XLEN", "@main"], ["XLEN"], ["XPENDING", "@main"]],
                         NOT_INT * 2 + err("ERR timeout is negative")
                         + err("ERR timeout is not an integer or out of range") + err("ERR timeout is out of range")
                         + arity("xread") + NOT_INT + arity("xrange") + b"*-1\r\n" + FIRST_ENTRY + b"*-1\r\n"
                         + arity("xinfo") + arity("xinfo|groups") + arity("xinfo|stream") + b"*0\r\n"
                         + b":5\r\n" + arity("xlen") + arity("xpending")),
    "arity before auth (TCP)": ([["GET"], ["GET", "in.k1"], ["CLIENT", "GETNAME", "x"], ["AUTH", "default", "nope"],
                                 ["AUTH", "default", PASSWORD], ["GET", "in.k1"]],
                                arity("get") + err("NOAUTH Authentication required.") + arity("client|getname")
                                + err("WRONGPASS invalid username-password pair or user is disabled.")
                                + b"+OK\r\n$2\r\nv1\r\n", True),
}


@pytest.fixture(params=TWINS)
async def layer(request, tmp_path):
    layer = Layer(tmp_path, twins=request.param)
    yield layer
    layer.close()


@pytest.mark.parametrize("bytewise", [False, True], ids=["one read", "bytewise"])
@pytest.mark.parametrize("case", list(CASES))
async def test_replies_by_table(layer, case, bytewise):
    commands, expected, *tcp = CASES[case]
    client = layer.client(tcp=bool(tcp and tcp[0]))
    got = await client.call(*commands, bytewise=bytewise)
    assert got == expected


async def test_the_twin_asked_for_serves(layer):
    """The layer runs the implementation its id says (the RESP reader and the GET path)."""
    twins = layer.module.SERVER_GET.__name__ == "kvcache.serve.server_get"
    assert is_native(layer.module.WIRE) is not twins and is_native(layer.module.SERVER_GET) is not twins


async def test_a_wrong_count_is_refused_for_every_command_from_its_row(layer):
    """Each row's arity, and each subcommand's, is what dispatch holds a request to."""
    client = layer.client()
    for spec in COMMANDS:
        bad = [[spec.name.upper()] + ["x"] * n for n in range(0, 4)]
        bad = [args for args in bad if arity_error(spec, [a.encode() for a in args]) is not None]
        for args in bad:
            assert await client.call(args) == arity(spec.name), args
        for sub, n in spec.subcommands.items():
            if n is None or -2 <= n < 0:  # not run here; or the subcommand alone is enough
                continue
            args = [spec.name, sub.decode()] + ["x"] * (n - 1 if n > 0 else -n - 3)
            assert await client.call(args) == arity(f"{spec.name}|{sub.decode()}"), args


async def test_tracking_remembers_the_keys_the_table_places(layer):
    """CLIENT TRACKING remembers the keys of tracked reads (their positions from the table),
    not a stream's, and invalidates them when the feed reports a change."""
    client = layer.client()
    assert (await client.call(["HELLO", "3"])).startswith(b"%7\r\n")
    assert await client.call(["CLIENT", "TRACKING", "on"]) == b"+OK\r\n"
    assert await client.call(["GET", "in.k1"], ["MGET", "in.k2", "in.k3"], ["XLEN", "@main"],
                             ["STRLEN", "in.none"]) == b"$2\r\nv1\r\n*2\r\n$2\r\nv2\r\n$2\r\nv3\r\n:5\r\n:0\r\n"
    assert set(layer.tracking.table) == {b"in.k1", b"in.k2", b"in.k3", b"in.none"}
    layer.tracking.changed("main", [("in.k2", "set")])
    assert await client.take(1) == b">2\r\n$10\r\ninvalidate\r\n*1\r\n$5\r\nin.k2\r\n"
    assert set(layer.tracking.table) == {b"in.k1", b"in.k3", b"in.none"}


async def test_client_list_names_the_command_looked_up(layer):
    """CLIENT LIST's cmd: Redis's full name of a container's subcommand (from the table), a
    write's name, NULL for what Redis does not know."""
    client = layer.client()
    for args, cmd in ((["CLIENT", "GETNAME"], b"client|getname"), (["CLIENT", "PAUSE", "1"], b"client|pause"),
                      (["CLIENT", "NOSUCH"], None), (["SET", "a", "b"], b"set"), (["NOSUCH"], None),
                      (["COMMAND"], b"command"), (["XINFO", "HELP"], b"xinfo|help")):
        await client.call(args)
        assert client.conn.last_cmd == cmd, args
    assert " cmd=xinfo|help " in layer.server.by_id[client.conn.id].client_info()


# ---------------------------------------------------------------------- the table itself

def test_the_table_derives_what_was_declared_beside_it():
    assert TRACKED == {b"get", b"mget", b"exists", b"kv.get", b"ttl", b"pttl", b"expiretime", b"pexpiretime",
                       b"type", b"strlen", b"getrange"}
    assert NO_AUTH == {b"auth", b"hello", b"quit", b"reset"}
    assert key_args(BY_NAME[b"mget"], [b"MGET", b"a", b"b"]) == [b"a", b"b"]
    assert key_args(BY_NAME[b"kv.get"], [b"KV.GET", b"a", b"MAXSTALE", b"5"]) == [b"a"]
    assert key_args(BY_NAME[b"ping"], [b"PING", b"a"]) == []


# ---------------------------------------------------------------------- the integer parser

@pytest.mark.parametrize("raw,value", [
    (b"0", 0), (b"7", 7), (b"-7", -7), (b"9223372036854775807", (1 << 63) - 1),
    (b"-9223372036854775808", -(1 << 63)),
    (b"-0", None), (b"01", None), (b"+1", None), (b" 1", None), (b"1 ", None), (b"1_0", None), (b"", None),
    (b"-", None), (b"9223372036854775808", None), (b"-9223372036854775809", None), ("\u0661".encode(), None),
    (b"18446744073709551616", None), (b"1.0", None), (b"0x1", None), (b"1\n", None),
])
def test_integer_as_redis_string2ll(raw, value):
    if value is None:
        with pytest.raises(CommandError, match=r"^ERR value is not an integer or out of range$"):
            arguments.integer(raw)
    else:
        assert arguments.integer(raw) == value


def test_integer_ranges_and_words():
    assert arguments.integer(b"5", lo=0, hi=5) == 5
    with pytest.raises(CommandError, match=r"^ERR own words$"):
        arguments.integer(b"x", "ERR own words")
    with pytest.raises(CommandError, match=r"^ERR range$"):
        arguments.integer(b"6", "ERR own words", hi=5, range_error="ERR range")
    with pytest.raises(CommandError, match=r"^ERR own words$"):
        arguments.integer(b"6", "ERR own words", hi=5)
    with pytest.raises(CommandError, match="must be positive"):
        arguments.non_negative(b"-1")
    assert arguments.timeout_ms(b"0") == 0
    with pytest.raises(CommandError, match=r"^ERR timeout is out of range$"):
        arguments.timeout_ms(b"9223372036854775807")


@pytest.mark.parametrize("raw,value", [(b"0", 0), (b"00", 0), (b"+0", 0), (b"17", 17), (b"-1", (1 << 64) - 1),
                                       (b"18446744073709551615", (1 << 64) - 1), (b"18446744073709551616", None),
                                       (b"x", None), (b"", None), (b" 1", None)])
def test_cursor_as_redis_string2ull(raw, value):
    if value is None:
        with pytest.raises(CommandError, match=r"^ERR invalid cursor$"):
            arguments.cursor(raw)
    else:
        assert arguments.cursor(raw) == value
