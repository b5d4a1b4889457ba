"""INFO replication, CLIENT LIST / CLIENT INFO / CLIENT KILL against a real redis-server.

The same connections (a subscriber, a client in MULTI, one tracking, one WATCHing, one on
RESP3, ...) are opened on a real redis-server (Unix socket, tests/support/redis_ref.py) and
on a sidecar, and what each answers is compared: INFO replication field by field, CLIENT
LIST field by field (the fields kvcache cannot fill as Redis does are listed in
docs/commands.md and here, in DIFFERENT), CLIENT KILL's replies and errors byte for byte.
The reference may be an older Redis 7 than the 7.4 kvcache answers as: the fields 7.4 added
(REDIS_74_FIELDS) must then be the only ones it lacks.
"""
from __future__ import annotations

import re
import socket
import time
from collections.abc import Iterator

import pytest
import redis
from support.kvdata import _put_all
from support.poll import wait_until
from support.redis_ref import redis_server
from support.sidecar_proc import SidecarProcess
from support.topology import nats_run

from kvcache.app.client import ReplyReader
from kvcache.app.client import encode_command as encode
from kvcache.resp import ReplyError

VALUES = {"k1": b"v1", "k2": b"v2"}
# catClientInfoString (networking.c), Redis 7.4: every field, in order
REDIS_74_FIELDS = ("id addr laddr fd name age idle flags db sub psub ssub multi watch qbuf qbuf-free "
                   "argv-mem multi-mem rbs rbp obl oll omem tot-mem events cmd user redir resp "
                   "lib-name lib-ver").split()
# Fields that differ from redis-server's for the same connection, and why (docs/commands.md):
DIFFERENT = {
    "id": "each server numbers its own connections",
    "fd": "each server's own descriptors",
    "addr": "each server's own socket path (both `<path>:0`: checked apart)",
    "laddr": "the same",
    "qbuf": "kvcache has parsed the command being run: 0; Redis still holds its bytes",
    "qbuf-free": "kvcache's parser keeps no preallocated spare room: 0",
    "rbs": "kvcache keeps no per-client reply buffer: 0",
    "rbp": "the same",
    "tot-mem": "what kvcache can count (unparsed input, unwritten output, arguments held)",
}
EOF_WAIT = 10
SECONDS = ("age", "idle")  # counted in whole seconds by both servers
SECONDS_SLACK = 2


class Raw:
    """One raw RESP connection: commands out, parsed replies in (errors as ReplyError)."""

    def __init__(self, path: str | tuple[str, int]) -> None:
        if isinstance(path, tuple):
            self.s = socket.create_connection(path, timeout=10)
        else:
            self.s = socket.socket(socket.AF_UNIX)
            self.s.settimeout(10)
            self.s.connect(path)
        self.reader = ReplyReader(Raw)

    def call(self, *args: str | bytes) -> object:
        self.s.sendall(encode(list(args)))
        return self.reply()

    def reply(self) -> object:
        while (got := self.reader.gets()) is Raw:
            chunk = self.s.recv(65536)
            if not chunk:
                raise EOFError
            self.reader.feed(chunk)
        return got

    def wire(self, *args: str | bytes) -> bytes:
        """The reply's bytes, for one-line replies (status, error, integer)."""
        self.s.sendall(encode(list(args)))
        return read_line(self.s)

    def alive(self) -> bool:
        """Does the server still answer on this connection (a PING)?"""
        try:
            self.s.sendall(encode(["PING"]))
            self.reply()
            return True
        except (EOFError, ConnectionResetError, BrokenPipeError):
            return False

    def closed(self) -> bool:
        """Did the server close this connection (EOF within EOF_WAIT)?"""
        self.s.settimeout(EOF_WAIT)
        try:
            while True:
                chunk = self.s.recv(65536)
                if not chunk:
                    return True
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.s.close()


def read_line(s: socket.socket) -> bytes:
    got = b""
    while not got.endswith(b"\r\n"):
        chunk = s.recv(1)
        if not chunk:
            break
        got += chunk
    return got


def text(reply: object) -> str:
    """A verbatim or bulk reply's text (RESP3 verbatim strings come as `txt:...` or bytes)."""
    if isinstance(reply, bytes):
        reply = reply.decode()
    assert isinstance(reply, str), reply
    return reply[4:] if reply.startswith("txt:") else reply


def parse_line(line: str) -> list[tuple[str, str]]:
    return [tuple(part.split("=", 1)) for part in line.split(" ")]  # type: ignore[misc]


def client_list(conn: Raw, *args: str) -> dict[str, dict[str, str]]:
    """CLIENT LIST [args], by client name ('' for the unnamed)."""
    out = {}
    for line in text(conn.call("CLIENT", "LIST", *args)).splitlines():
        fields = dict(parse_line(line))
        out[fields["name"]] = fields
    return out


@pytest.fixture(scope="module")
def redis_sock(tmp_path_factory) -> Iterator[str]:
    with redis_server(tmp_path_factory.mktemp("redis"), VALUES) as path:
        yield path


@pytest.fixture(scope="module")
def url(nats_server_module) -> str:
    async def setup(js):
        kv = await js.create_key_value(bucket="cl", direct=True)
        await _put_all(kv, VALUES)
    nats_run(nats_server_module.url, setup)
    return nats_server_module.url


def start_sidecar(path, url: str, twins: bool = False) -> SidecarProcess:
    sc = SidecarProcess(path, url, ["cl"], extra=["--listen", "127.0.0.1:0"],
                        env={"KVCACHE_NO_EXTENSIONS": "1" if twins else "0"})
    return sc


@pytest.fixture(scope="module")
def sidecar(url, tmp_path_factory) -> Iterator[SidecarProcess]:
    sc = start_sidecar(tmp_path_factory.mktemp("native") / "sc", url)
    with sc:
        sc.start()
        yield sc
        assert sc.stop() == 0


def tcp_address(sc: SidecarProcess) -> tuple[str, int]:
    with sc.client() as c:
        host, port = c.info("server")["server"]["listen"].rsplit(":", 1)
    return host, int(port)


def wait_clients(path: str, n: int) -> None:
    """Until exactly `n` connections are open besides the one asking."""
    def settled() -> bool:
        c = Raw(path)
        try:
            return len(text(c.call("CLIENT", "LIST")).splitlines()) == n + 1
        finally:
            c.close()
    wait_until(settled, 10, f"{n} other connections")


# ---------------------------------------------------------------------- INFO replication

def info_lines(path: str, *section: str) -> list[str]:
    c = Raw(path)
    try:
        return text(c.call("INFO", *section)).split("\r\n")
    finally:
        c.close()


def test_info_replication_as_redis(redis_sock, sidecar):
    want = info_lines(redis_sock, "replication")
    got = info_lines(sidecar.socket, "replication")
    assert [line.split(":")[0] for line in got] == [line.split(":")[0] for line in want]
    assert got[0] == "# Replication" and got[-1] == ""  # the same framing: ends in CRLF
    for mine, theirs in zip(got, want, strict=True):
        name = mine.split(":")[0]
        if name == "master_replid":  # random per process, in both
            assert re.fullmatch(r"master_replid:[0-9a-f]{40}", mine), mine
        elif name == "repl_backlog_size":  # Redis: its configured size; kvcache has none
            assert mine == "repl_backlog_size:0"
        else:
            assert mine == theirs
    assert "role:master" in got and "connected_slaves:0" in got


@pytest.mark.parametrize("args", [(), ("default",), ("all",), ("everything",)])
def test_info_replication_in_default_and_all(redis_sock, sidecar, args):
    """Where Redis puts `# Replication`, after `# Stats`."""
    for path in (redis_sock, sidecar.socket):
        headers = [line for line in info_lines(path, *args) if line.startswith("# ")]
        assert "# Replication" in headers, (path, headers)
        assert headers.index("# Replication") == headers.index("# Stats") + 1, headers
    replid = [line for line in info_lines(sidecar.socket, *args) if line.startswith("master_replid:")]
    assert replid == [line for line in info_lines(sidecar.socket, "replication")
                      if line.startswith("master_replid:")]  # one per process, not per call


def test_hello_role_agrees(sidecar):
    c = redis.Redis(unix_socket_path=sidecar.socket, protocol=3)
    try:
        assert c.execute_command("HELLO", "3")[b"role"] == b"master"
        assert c.info("replication")["role"] == "master"
    finally:
        c.close()


# ---------------------------------------------------------------------- CLIENT LIST

def open_scenario(path: str, lib_info: bool) -> list[Raw]:
    """The same connections on either server, named for CLIENT LIST."""
    conns = []

    def conn(name: str, *commands: tuple[str, ...]) -> None:
        c = Raw(path)
        conns.append(c)
        assert c.call("CLIENT", "SETNAME", name) == b"OK"
        for command in commands:
            reply = c.call(*command)
            assert not isinstance(reply, ReplyError), (command, reply)
            if command[0] in ("SUBSCRIBE", "PSUBSCRIBE"):
                for _ in command[2:]:
                    c.reply()

    conn("sub", ("SUBSCRIBE", "c1", "c2"), ("PSUBSCRIBE", "p*"))
    conn("multi", ("MULTI",), ("GET", "k1"), ("GET", "k2"))
    conn("track", ("CLIENT", "TRACKING", "ON", "BCAST"))
    conn("noevict", ("CLIENT", "NO-EVICT", "ON"))
    conn("watch", ("WATCH", "k1", "k2"))
    conn("resp3", ("HELLO", "3"))
    conn("get", ("GET", "k1"))
    conn("dirty", ("WATCH", "k1"))  # made dirty below, on each its own way
    conn("unknown", ("ECHO", "x"))
    conns[-1].call("NOSUCHCOMMAND")
    if lib_info:
        conn("lib", ("CLIENT", "SETINFO", "LIB-NAME", "mylib"), ("CLIENT", "SETINFO", "LIB-VER", "1.2"))
    return conns


def same_field(field: str, theirs: str, mine: str) -> bool:
    """Equal, but for the seconds counted: each scenario was opened and listed a moment apart,
    so a second boundary may fall between them on a busy host."""
    if field in SECONDS:
        return abs(int(theirs) - int(mine)) <= SECONDS_SLACK
    return theirs == mine


def redis_has_lib_info(path: str) -> bool:
    c = Raw(path)
    try:
        return not isinstance(c.call("CLIENT", "SETINFO", "LIB-NAME", "x"), ReplyError)
    finally:
        c.close()


def test_client_list_field_by_field(redis_sock, sidecar, url):
    lib_info = redis_has_lib_info(redis_sock)
    theirs_conns = open_scenario(redis_sock, lib_info)
    mine_conns = open_scenario(sidecar.socket, lib_info)
    try:
        # WATCHed key changed: Redis by a write, kvcache by the feed
        writer = redis.Redis(unix_socket_path=redis_sock)
        try:
            writer.set("k1", b"new")
        finally:
            writer.close()  # not left to the collector: a failure here must not leak it to later tests
        nats_run(url, lambda js: _put(js, "k1", b"new"))
        lister_r, lister_k = Raw(redis_sock), Raw(sidecar.socket)

        def dirty() -> bool:
            return "d" in client_list(lister_k)["dirty"]["flags"]
        wait_until(dirty, 10, "the feed to dirty the WATCH")
        theirs, mine = client_list(lister_r), client_list(lister_k)
        assert set(mine) == set(theirs)
        ref_fields = list(next(iter(theirs.values())))
        assert list(next(iter(mine.values()))) == REDIS_74_FIELDS
        # an older reference lacks only what 7.4 added, and has the rest in the same order
        assert [f for f in REDIS_74_FIELDS if f in ref_fields] == ref_fields
        assert set(REDIS_74_FIELDS) - set(ref_fields) <= {"watch", "lib-name", "lib-ver"}
        differ = {(name, field): (row[field], mine[name][field])
                  for name, row in theirs.items() for field in ref_fields
                  if not same_field(field, row[field], mine[name][field])}
        # every field not in DIFFERENT is equal, for every connection
        assert not {k: v for k, v in differ.items() if k[1] not in DIFFERENT}, differ
        equal = set(ref_fields) - {field for _, field in differ}
        for name, row in mine.items():
            assert row["addr"] == row["laddr"] == f"{sidecar.socket}:0"
            assert theirs[name]["addr"] == theirs[name]["laddr"] == f"{redis_sock}:0"
            assert int(row["fd"]) > 2 and int(row["id"]) > 0
        # the states each connection is in, as both show them
        assert mine["sub"]["flags"] == "PU" and (mine["sub"]["sub"], mine["sub"]["psub"]) == ("2", "1")
        assert mine["multi"]["flags"] == "xU" and mine["multi"]["multi"] == "2"
        assert mine["multi"]["multi-mem"] == "42" and mine["multi"]["cmd"] == "get"
        assert mine["track"]["flags"] == "tBU" and mine["track"]["redir"] == "0"
        assert mine["noevict"]["flags"] == "Ue"
        assert mine["watch"]["watch"] == "2"
        assert mine["dirty"]["flags"] == "dU"
        assert mine["resp3"]["resp"] == "3" and mine["resp3"]["cmd"] == "hello"
        assert mine["unknown"]["cmd"] == "NULL"
        assert mine[""]["cmd"] == "client|list" and mine[""]["argv-mem"] == "10"
        print("\nCLIENT LIST, equal to redis-server's:", " ".join(f for f in ref_fields if f in equal))
        print("differing (documented):", " ".join(f for f in ref_fields if f not in equal))
        assert {f for f in ref_fields if f not in equal} <= set(DIFFERENT)

        # TYPE and ID filters: the same connections on both
        for kind in ("normal", "pubsub", "master", "replica", "slave", "NORMAL"):
            assert set(client_list(lister_k, "TYPE", kind)) == set(client_list(lister_r, "TYPE", kind)), kind
        assert set(client_list(lister_k, "TYPE", "pubsub")) == {"sub"}
        ids = [mine["watch"]["id"], "999999", mine["sub"]["id"]]
        assert list(client_list(lister_k, "ID", *ids)) == ["watch", "sub"]  # in the order asked
        assert text(lister_k.call("CLIENT", "LIST", "ID", "999999")) == ""
        # CLIENT INFO: the same line as CLIENT LIST's for the caller
        own = dict(parse_line(text(lister_k.call("CLIENT", "INFO")).rstrip("\n")))
        assert list(own) == REDIS_74_FIELDS and own["cmd"] == "client|info" and own["argv-mem"] == "10"
    finally:
        for c in theirs_conns + mine_conns:
            c.close()


async def _put(js, key: str, value: bytes) -> None:
    kv = await js.key_value("cl")
    await kv.put(key, value)


@pytest.mark.parametrize("args", [
    ("CLIENT", "LIST", "TYPE", "nosuch"), ("CLIENT", "LIST", "ID", "x"), ("CLIENT", "LIST", "ID", "1", "x"),
    ("CLIENT", "LIST", "nosuch"), ("CLIENT", "LIST", "TYPE"), ("CLIENT", "LIST", "TYPE", "normal", "x"),
    ("CLIENT", "KILL"), ("CLIENT", "KILL", "ID"), ("CLIENT", "KILL", "1.2.3.4:5"),
    ("CLIENT", "KILL", "ID", "x"), ("CLIENT", "KILL", "ID", "0"), ("CLIENT", "KILL", "ID", "-3"),
    ("CLIENT", "KILL", "ID", "999999"), ("CLIENT", "KILL", "TYPE", "nosuch"),
    ("CLIENT", "KILL", "USER", "nobody"), ("CLIENT", "KILL", "SKIPME", "maybe"),
    ("CLIENT", "KILL", "NOSUCH", "x"), ("CLIENT", "KILL", "ID", "999999", "TYPE"),
    ("CLIENT", "KILL", "ADDR", "1.2.3.4:5", "SKIPME", "no"), ("CLIENT", "KILL", "TYPE", "master"),
    ("CLIENT", "KILL", "LADDR", "nowhere:0", "USER", "default"),
], ids=lambda a: " ".join(a[1:]))
def test_client_list_kill_replies_byte_for_byte(redis_sock, sidecar, args):
    want, got = Raw(redis_sock), Raw(sidecar.socket)
    try:
        expected = want.wire(*args)
        assert got.wire(*args) == expected
    finally:
        want.close()
        got.close()


# ---------------------------------------------------------------------- CLIENT KILL

def kill_scenario(path: str, *kill: str) -> tuple[bytes, dict[str, bool]]:
    """Open named connections, run CLIENT KILL from `killer` (`@name`: that one's id), then
    say which still answer."""
    names = ["killer", "a", "b", "sub"]
    conns = {n: Raw(path) for n in names}
    try:
        for n, c in conns.items():
            c.call("CLIENT", "SETNAME", n)
        conns["sub"].call("SUBSCRIBE", "ch")
        wait_clients(path, len(names))
        ids = {n: str(c.call("CLIENT", "ID")) for n, c in conns.items() if n != "sub"}
        args = [ids.get(a[1:], a) if a.startswith("@") else a for a in kill]
        reply = conns["killer"].wire("CLIENT", "KILL", *args)
        return reply, {n: c.alive() for n, c in conns.items()}
    finally:
        for c in conns.values():
            c.close()


@pytest.mark.parametrize("kill", [
    ("ID", "@a"), ("TYPE", "pubsub"), ("TYPE", "normal"), ("TYPE", "normal", "SKIPME", "no"),
    ("USER", "default", "SKIPME", "yes"), ("ID", "@killer", "SKIPME", "no"), ("ID", "@killer"),
], ids=lambda a: " ".join(a))
def test_client_kill_as_redis(redis_sock, sidecar, kill):
    """The same kill on both servers: the same reply, the same connections closed (the
    caller too when it matches with SKIPME no, after its reply)."""
    want = kill_scenario(redis_sock, *kill)
    got = kill_scenario(sidecar.socket, *kill)
    assert got == want
    wait_clients(sidecar.socket, 0)


def test_client_kill_old_form_unix_kills_every_unix_client(redis_sock, sidecar):
    """`CLIENT KILL <socket path>:0` names every Unix socket client, the caller included."""
    for path in (redis_sock, sidecar.socket):
        conns = [Raw(path) for _ in range(3)]
        try:
            wait_clients(path, 3)
            assert conns[0].wire("CLIENT", "KILL", f"{path}:0") == b"+OK\r\n"
            assert all(c.closed() for c in conns), path
        finally:
            for c in conns:
                c.close()
        wait_clients(path, 0)


def test_client_kill_tcp_addr_laddr_and_cleanup(sidecar):
    host, port = tcp_address(sidecar)
    tcp = Raw((host, port))
    tcp.call("CLIENT", "SETNAME", "tcp")
    tcp.call("SUBSCRIBE", "x")  # its subscription must go with it
    unix = Raw(sidecar.socket)
    try:
        row = client_list(unix)["tcp"]
        assert row["laddr"] == f"{host}:{port}" and row["flags"] == "P"
        assert re.fullmatch(r"127\.0\.0\.1:\d+", row["addr"]) and row["addr"] != row["laddr"]
        assert unix.wire("CLIENT", "KILL", "LADDR", f"{host}:{port}", "TYPE", "normal") == b":0\r\n"
        assert unix.wire("CLIENT", "KILL", row["addr"]) == b"+OK\r\n"
        assert tcp.closed()
        assert "tcp" not in client_list(unix)  # gone at once, as Redis's freeClient
        with sidecar.client() as c:
            clients = c.info("clients")["clients"]
            assert clients["pubsub_clients"] == 0
        assert unix.wire("CLIENT", "KILL", row["addr"]) == b"-ERR No such client\r\n"
        tcp2 = Raw((host, port))
        assert tcp2.call("PING") == b"PONG"  # accepted
        assert unix.wire("CLIENT", "KILL", "LADDR", f"{host}:{port}") == b":1\r\n"
        assert tcp2.closed()
        tcp2.close()
    finally:
        tcp.close()
        unix.close()


def test_client_kill_maxage(sidecar):
    """MAXAGE (Redis 7.4): only connections at least that many seconds old."""
    old = Raw(sidecar.socket)
    old.call("CLIENT", "SETNAME", "old")
    time.sleep(2.1)
    young = Raw(sidecar.socket)
    young.call("CLIENT", "SETNAME", "young")
    killer = Raw(sidecar.socket)
    try:
        assert killer.wire("CLIENT", "KILL", "MAXAGE", "1000") == b":0\r\n"
        assert killer.wire("CLIENT", "KILL", "MAXAGE", "0") == b"-ERR maxage should be greater than 0\r\n"
        assert killer.wire("CLIENT", "KILL", "MAXAGE", "x") == \
            b"-ERR maxage is not an integer or out of range\r\n"
        assert int(client_list(killer)["old"]["age"]) >= 2
        assert killer.wire("CLIENT", "KILL", "MAXAGE", "2") == b":1\r\n"
        assert old.closed()
        assert set(client_list(killer)) == {"young", ""}
    finally:
        for c in (old, young, killer):
            c.close()


def test_client_kill_while_waiting_for_nats(sidecar, url):
    """A connection whose reply NATS must give (a key outside the replica... here a MINREV
    read the replica cannot reach) is killed cleanly: nothing is written to it, and the
    sidecar goes on."""
    waiting = Raw(sidecar.socket)
    waiting.call("CLIENT", "SETNAME", "waiting")
    waiting.s.sendall(encode(["KV.GET", "k2", "MINREV", "999999"]))
    killer = Raw(sidecar.socket)
    try:
        row = client_list(killer)["waiting"]
        assert killer.wire("CLIENT", "KILL", "ID", row["id"]) == b":1\r\n"
        assert waiting.closed()
        assert "waiting" not in client_list(killer)
        assert killer.call("GET", "k2") == b"v2"
    finally:
        waiting.close()
        killer.close()


# ---------------------------------------------------------------------- idle and cmd, both GET paths

@pytest.fixture(scope="module", params=["native", "twins"])
def any_path(request, sidecar, url, tmp_path_factory) -> Iterator[SidecarProcess]:
    if request.param == "native":
        yield sidecar
        return
    sc = start_sidecar(tmp_path_factory.mktemp("twins") / "sc", url, twins=True)
    with sc:
        sc.start()
        yield sc
        assert sc.stop() == 0


def test_idle_and_cmd_follow_the_get_path(any_path):
    """GETs the fast path answers (in C, or its twin) show as cmd=get, and idle counts from
    the client's last read; another command shows by its full name."""
    quiet, lister = Raw(any_path.socket), Raw(any_path.socket)
    busy = [Raw(any_path.socket) for _ in range(3)]  # with 2+ clients the native path gathers reads
    try:
        quiet.call("CLIENT", "SETNAME", "quiet")
        assert quiet.call("GET", "k2") == b"v2"
        for i, c in enumerate(busy):
            c.call("CLIENT", "SETNAME", f"busy{i}")
        time.sleep(2.2)
        for c in busy:
            assert c.call("GET", "k2") == b"v2"
        rows = client_list(lister)
        assert rows["quiet"]["cmd"] == "get" and int(rows["quiet"]["idle"]) >= 2, rows["quiet"]
        assert int(rows["quiet"]["age"]) >= 2
        for i in range(3):
            assert rows[f"busy{i}"]["cmd"] == "get" and rows[f"busy{i}"]["idle"] == "0", rows[f"busy{i}"]
        quiet.call("CONFIG", "GET", "maxclients")
        assert client_list(lister)["quiet"]["cmd"] == "config|get"
        assert client_list(lister)["quiet"]["idle"] == "0"
    finally:
        for c in (quiet, lister, *busy):
            c.close()
