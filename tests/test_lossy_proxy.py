"""The lossy NATS proxy (tests/support/lossy_proxy.py), which later tests trust to make the
gaps a core-subject follower must fill: it drops exactly what it says it dropped, on the
subjects asked and no others; a window drops everything in it and nothing after; requests and
JetStream's API pass through it; frames split at any byte are put together; and the check the
live tests make (missing == dropped) catches a proxy that drops without saying so, or says so
without dropping."""
from __future__ import annotations

import asyncio
import json
import random
import socket
import sys
import time
from pathlib import Path

import nats
import nats.js.errors
import pytest
from nats.js.api import RePublish, StreamConfig
from support.lossy_proxy import Dropper, Frame, FrameError, LossyProxy, ServerStream, subject_matches
from support.poll import until

ROOT = Path(__file__).resolve().parent.parent

# ------------------------------------------------------------------ quick: patterns and frames


@pytest.mark.parametrize(("pattern", "subject", "want"), [
    ("rp.>", "rp.a", True), ("rp.>", "rp.a.b", True), ("rp.>", "rp", False), ("rp.>", "rpx.a", False),
    ("rp.*", "rp.a", True), ("rp.*", "rp.a.b", False), ("*.a", "rp.a", True), ("rp.a", "rp.a", True),
    ("rp.a", "rp.b", False), ("rp.a", "rp.a.b", False), (">", "anything.at.all", True),
    ("$KV.b.>", "$KV.b.k", True), ("a.*.c", "a.b.c", True), ("a.*.c", "a.b.d", False),
])
def test_subject_patterns(pattern, subject, want) -> None:
    assert subject_matches(pattern, subject) is want


def _hmsg(subject: str, sid: int, headers: list[tuple[str, str]], payload: bytes, reply: str = "",
          status: str = "") -> bytes:
    block = (f"NATS/1.0{' ' + status if status else ''}\r\n"
             + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n").encode()
    r = f" {reply}" if reply else ""
    return f"HMSG {subject} {sid}{r} {len(block)} {len(block) + len(payload)}\r\n".encode() + block + payload + b"\r\n"


INFO = {"server_id": "S1", "max_payload": 1048576, "headers": True,
        "connect_urls": ["10.1.1.1:4222", "10.1.1.2:4222"], "ws_connect_urls": ["10.1.1.1:8080"]}
FAKE = b"\r\nMSG rp.a 1 5\r\nhello\r\n"   # a payload that looks like a frame on a dropped subject

# (bytes as the server sends them, forwarded bytes expected with every rp.> frame dropped,
#  the drop expected: (subject, Nats-Sequence) or None)
PIECES: list[tuple[bytes, bytes, tuple[str, int | None] | None]] = [
    (b"INFO " + json.dumps(INFO).encode() + b"\r\n",
     b"INFO " + json.dumps({k: v for k, v in INFO.items() if "connect_urls" not in k},
                           separators=(",", ":")).encode() + b"\r\n", None),
    (b"+OK\r\n", b"+OK\r\n", None),
    (b"MSG rp.a 1 5\r\nhello\r\n", b"", ("rp.a", None)),
    (_hmsg("rp.b", 2, [("Nats-Stream", "S"), ("Nats-Sequence", "42"), ("Nats-Subject", "in.b")], b"v42",
           reply="_INBOX.x"), b"", ("rp.b", 42)),
    (f"MSG other.a 3 {len(FAKE)}\r\n".encode() + FAKE + b"\r\n",
     f"MSG other.a 3 {len(FAKE)}\r\n".encode() + FAKE + b"\r\n", None),
    (b"PING\r\n", b"PING\r\n", None),
    (b"msg rp.c 1 0\r\n\r\n", b"", ("rp.c", None)),             # lower-case op, empty payload
    (b"MSG\trp.d\t1\t3\r\nabc\r\n", b"", ("rp.d", None)),        # tabs between the fields
    (_hmsg("other.h", 4, [("Nats-Sequence", "7")], b""), _hmsg("other.h", 4, [("Nats-Sequence", "7")], b""), None),
    (_hmsg("_INBOX.y", 5, [], b"", status="100 Idle Heartbeat"),
     _hmsg("_INBOX.y", 5, [], b"", status="100 Idle Heartbeat"), None),
    (b"PONG\r\n", b"PONG\r\n", None),
    (_hmsg("rp.e.f", 1, [("nats-sequence", "43")], b"x" * 3000), b"", ("rp.e.f", 43)),
    (b"-ERR 'Unknown Protocol Operation'\r\n", b"-ERR 'Unknown Protocol Operation'\r\n", None),
    (b"MSG rp 1 1\r\nz\r\n", b"MSG rp 1 1\r\nz\r\n", None),        # not under rp.>: kept
]
STREAM = b"".join(p[0] for p in PIECES)
FORWARDED = b"".join(p[1] for p in PIECES)
DROPS = [p[2] for p in PIECES if p[2]]


def run_chunks(chunks: list[bytes]) -> tuple[bytes, list[tuple[str, int | None]]]:
    """What a proxy connection forwards and records for the server's bytes in these chunks."""
    stream, dropper = ServerStream(), Dropper(["rp.>"])
    dropper.drop_all()
    out = b"".join(f.raw for chunk in chunks for f in stream.feed(chunk) if dropper.decide(f, 1))
    return out, [(d.subject, d.seq) for d in dropper.dropped]


def test_whole_stream() -> None:
    assert run_chunks([STREAM]) == (FORWARDED, DROPS)


def test_split_at_every_byte() -> None:
    """Two reads split at each byte, then one byte per read: always the same frames, drops
    and forwarded bytes as the stream in one read."""
    for i in range(len(STREAM) + 1):
        assert run_chunks([STREAM[:i], STREAM[i:]]) == (FORWARDED, DROPS), f"split at byte {i}"
    assert run_chunks([STREAM[i:i + 1] for i in range(len(STREAM))]) == (FORWARDED, DROPS)


def test_random_chunks_and_random_drops() -> None:
    """Random chunkings with drop probability 0.5 and one seed: the same decisions each time
    (one draw per matching frame, whatever the reads)."""
    def run(chunks: list[bytes]) -> tuple[bytes, list]:
        stream, dropper = ServerStream(), Dropper(["rp.>"], drop=0.5, seed=3)
        out = b"".join(f.raw for c in chunks for f in stream.feed(c) if dropper.decide(f, 1))
        return out, dropper.dropped
    whole, drops = run([STREAM * 20])
    assert 0 < len(drops) < 20 * len(DROPS)
    rng = random.Random(1)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(STREAM) * 20), rng.randint(1, 200)))
        data = STREAM * 20
        chunks = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
        out, got = run(chunks)
        assert out == whole
        assert [(d.subject, d.seq) for d in got] == [(d.subject, d.seq) for d in drops]


def test_frames_report_subject_and_sequence() -> None:
    frames = ServerStream().feed(STREAM)
    assert [f.op for f in frames] == ["INFO", "+OK", "MSG", "HMSG", "MSG", "PING", "MSG", "MSG", "HMSG", "HMSG",
                                      "PONG", "HMSG", "-ERR", "MSG"]
    assert frames[3] == Frame("HMSG", PIECES[3][0], "rp.b", 42)
    assert frames[4].subject == "other.a" and frames[4].seq is None


@pytest.mark.parametrize("bad", [b"MSG a 1 x\r\n", b"MSG a 1\r\n", b"HMSG a 1 9 3\r\n",
                                 b"MSG a 1 3\r\nabcXY", b"HMSG a 1 -1 3\r\n"])
def test_not_nats_is_an_error(bad) -> None:
    with pytest.raises(FrameError):
        ServerStream().feed(bad)


async def test_the_proxy_puts_a_trickled_stream_together() -> None:
    """The proxy's own I/O, not only its parser: a server that sends the stream a byte per
    write (TCP_NODELAY, a loop turn between writes) reaches the client as the frames it
    forwards, with the rp.> ones dropped and recorded."""
    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(len(STREAM)):
            writer.write(STREAM[i:i + 1])
            await writer.drain()
            await asyncio.sleep(0)
        await reader.read()          # until the client goes
        writer.close()

    server = await asyncio.start_server(trickle, "127.0.0.1", 0)
    try:
        async with LossyProxy(server.sockets[0].getsockname()[1], ["rp.>"]) as px:
            px.drop_all()
            reader, writer = await asyncio.open_connection("127.0.0.1", px.port)
            got = await asyncio.wait_for(reader.readexactly(len(FORWARDED)), 30)
            writer.close()
        assert got == FORWARDED
        assert [(d.subject, d.seq) for d in px.dropped] == DROPS
    finally:
        server.close()


def test_probability_out_of_range() -> None:
    with pytest.raises(ValueError, match="not between 0 and 1"):
        Dropper(["a"], drop=1.5)


# ------------------------------------------------------------------ live: a real nats-server

STREAM_NAME = "LOSSY"


async def _stream(nc, name: str, src: str, dest: str) -> None:
    js = nc.jetstream()
    try:
        await js.delete_stream(name)
    except nats.js.errors.NotFoundError:
        pass
    await js.add_stream(StreamConfig(name=name, subjects=[src], republish=RePublish(src=src, dest=dest)))


class Seen:
    """A subscriber's view: the Nats-Sequence of every RePublished message, and the payloads
    of the plain ones."""

    def __init__(self) -> None:
        self.seqs: list[int] = []
        self.plain: list[bytes] = []

    async def on_rp(self, msg) -> None:
        self.seqs.append(int(msg.headers["Nats-Sequence"]))

    async def on_plain(self, msg) -> None:
        self.plain.append(msg.data)


async def drained(conn, *subs) -> None:
    """Every frame forwarded so far has been handed to its callback: a PING after them (its
    PONG comes after every frame the proxy forwarded before it; nats-py queues each message
    before it reads the PONG), then every subscription's queue empty (a callback that does not
    await runs as soon as its message is taken off the queue)."""
    await conn.flush()
    await until(lambda: all(s.pending_msgs == 0 for s in subs), 10, "the subscriptions' callbacks to run")


def missing_vs_dropped(published: range, seen: list[int], dropped: list[int]) -> list[str]:
    """The check the live tests make: the subscriber misses exactly the sequences the proxy
    says it dropped, and gets each of the others once. Its findings, [] when it holds."""
    findings = []
    missing = set(published) - set(seen)
    if missing != set(dropped):
        findings.append(f"missing but not reported dropped: {sorted(missing - set(dropped))[:10]}; "
                        f"reported dropped but received: {sorted(set(dropped) - missing)[:10]}")
    if len(seen) != len(set(seen)):
        findings.append("a message received twice")
    if len(dropped) != len(set(dropped)):
        findings.append("a drop reported twice")
    return findings


async def lossy_run(px: LossyProxy, nc, n: int, subject: str = "rp.>") -> tuple[Seen, list[int]]:
    """`n` messages stored in the stream (published directly) and RePublished on rp.<...>, and
    `n` plain ones on plain.x, received through the proxy; returns what the subscriber saw
    and the sequences the proxy reports dropped."""
    await _stream(nc, STREAM_NAME, "in.>", "rp.>")
    sub_nc = await nats.connect(px.url, allow_reconnect=False)
    try:
        seen = Seen()
        subs = [await sub_nc.subscribe(subject, cb=seen.on_rp), await sub_nc.subscribe("plain.>", cb=seen.on_plain)]
        await sub_nc.flush()
        js = nc.jetstream()
        for i in range(n):
            await js.publish(f"in.k{i % 7}", b"v%d" % i)
            await nc.publish("plain.x", b"p%d" % i)
        await nc.flush()
        await until(lambda: px.matched >= n, 30, f"the proxy to see all {n} RePublished messages")
        await drained(sub_nc, *subs)
        return seen, [d.seq for d in px.dropped if d.seq is not None]
    finally:
        await sub_nc.close()


async def test_random_drops_are_exactly_the_missing(nc, nats_server_module) -> None:
    """p = 0.01 over 2,000 RePublished messages: the subscriber misses exactly the ones the
    proxy reports (by Nats-Sequence), and every message on another subject arrives."""
    n = 2000
    async with LossyProxy(nats_server_module.port, ["rp.>"], drop=0.01, seed=7) as px:
        seen, dropped = await lossy_run(px, nc, n)
    print(f"dropped {len(dropped)} of {n}: {dropped}")
    assert len(px.dropped) == len(dropped) > 0         # every drop has its sequence
    assert {d.why for d in px.dropped} == {"random"}
    assert missing_vs_dropped(range(1, n + 1), seen.seqs, dropped) == []
    assert seen.plain == [b"p%d" % i for i in range(n)]
    by_subject = px.stats()["dropped_by_subject"]
    assert sum(by_subject.values()) == len(dropped) and all(s.startswith("rp.") for s in by_subject)


class UnrecordedDrop(Dropper):
    """A fault on purpose: the 3rd drop is not recorded (a counter that undercounts)."""

    def _record(self, d) -> None:
        self.faults = getattr(self, "faults", 0) + 1
        if self.faults != 3:
            super()._record(d)


class PhantomDrop(Dropper):
    """A fault on purpose: the 2nd frame recorded as dropped is forwarded all the same."""

    def decide(self, frame, conn) -> bool:
        before = len(self._dropped)
        keep = super().decide(frame, conn)
        if not keep and before == 1:
            return True
        return keep


@pytest.mark.parametrize("fault", [UnrecordedDrop, PhantomDrop])
async def test_the_check_catches_a_faulty_drop_counter(nc, nats_server_module, fault) -> None:
    """The drop counter is trusted because this check catches a proxy whose record is wrong
    (a drop not recorded, a recorded drop forwarded): the same run as above, with the fault."""
    class Faulty(LossyProxy):
        def _make_dropper(self, subjects, drop, seed):
            return fault(subjects, drop, seed)
    n = 600
    async with Faulty(nats_server_module.port, ["rp.>"], drop=0.02, seed=7) as px:
        seen, dropped = await lossy_run(px, nc, n)
    assert len(dropped) >= 3
    findings = missing_vs_dropped(range(1, n + 1), seen.seqs, dropped)
    print(fault.__name__, findings)
    assert findings and "missing but not reported dropped" in findings[0]


async def test_window_drops_everything_in_it_and_nothing_after(nc, nats_server_module) -> None:
    """drop_all() until end_drop_all(): every message in between is dropped, every one after
    arrives; drop_all(seconds): the drops are the first messages of the window, all before it
    closes, and every message once one passes arrives."""
    await _stream(nc, STREAM_NAME, "in.>", "rp.>")
    js = nc.jetstream()
    async with LossyProxy(nats_server_module.port, ["rp.>"]) as px:
        sub_nc = await nats.connect(px.url, allow_reconnect=False)
        try:
            seen = Seen()
            sub = await sub_nc.subscribe("rp.>", cb=seen.on_rp)
            await sub_nc.flush()

            async def put(count: int) -> None:
                for _ in range(count):
                    target = px.matched + 1
                    await js.publish("in.w", b"w")
                    await until(lambda t=target: px.matched >= t, 30, "the proxy to see the message")

            await put(5)                                  # before: all pass
            px.drop_all()
            await put(40)
            px.end_drop_all()
            await put(30)
            await drained(sub_nc, sub)
            assert [d.seq for d in px.dropped] == list(range(6, 46))
            assert {d.why for d in px.dropped} == {"window"}
            assert seen.seqs == [*range(1, 6), *range(46, 76)]

            window = 2.5
            px.drop_all(window)
            opened = time.monotonic()
            first = len(px.dropped)
            passed_at = None
            for i in range(2000):                       # until one passes the closed window
                await put(1)
                if len(px.dropped) == first + i:
                    passed_at = 76 + i
                    break
                await asyncio.sleep(0.01)                 # pace the messages across the window
            assert passed_at is not None
            await put(20)
            await drained(sub_nc, sub)
            timed = px.dropped[first:]
            print(f"window of {window}s dropped {len(timed)} messages; seq {passed_at} passed")
            assert timed and [d.seq for d in timed] == list(range(76, passed_at))
            assert all(d.at < opened + window for d in timed)
            assert seen.seqs[35:] == list(range(passed_at, passed_at + 21))
        finally:
            await sub_nc.close()


async def test_requests_and_jetstream_pass(nc, nats_server_module) -> None:
    """With every rp.> message dropped: a request through the proxy is answered, JetStream's
    API answers through it, and a subscriber on rp.> past the proxy gets nothing while one
    connected directly gets every message."""
    await _stream(nc, STREAM_NAME, "in.>", "rp.>")

    async def echo(msg) -> None:
        await msg.respond(b"echo:" + msg.data)
    await nc.subscribe("svc.echo", cb=echo)
    direct = Seen()
    await nc.subscribe("rp.>", cb=direct.on_rp)
    await nc.flush()
    async with LossyProxy(nats_server_module.port, ["rp.>"], drop=1.0) as px:
        sub_nc = await nats.connect(px.url, allow_reconnect=False)
        try:
            lost = Seen()
            sub = await sub_nc.subscribe("rp.>", cb=lost.on_rp)
            assert (await sub_nc.request("svc.echo", b"hi", timeout=10)).data == b"echo:hi"
            sjs = sub_nc.jetstream()
            for i in range(10):
                await sjs.publish("in.r", b"r%d" % i)
            assert (await sjs.stream_info(STREAM_NAME)).state.messages == 10
            await until(lambda: px.matched >= 10, 30, "the proxy to see the 10 messages")
            await drained(sub_nc, sub)
            await until(lambda: len(direct.seqs) >= 10, 10, "the direct subscriber's 10")
            assert lost.seqs == [] and len(px.dropped) == 10
            assert direct.seqs == list(range(1, 11))
            assert not sub_nc.discovered_servers
        finally:
            await sub_nc.close()


async def test_a_cluster_client_stays_behind_the_proxy(nats_cluster) -> None:
    """A cluster's INFO lists the other servers (connect_urls), and nats-py adds them to its
    pool; through the proxy it learns none of them."""
    server = nats_cluster.servers[0]
    direct = await nats.connect(server.url, allow_reconnect=False)
    try:
        assert direct.discovered_servers, "the cluster advertises no connect_urls: this test shows nothing"
    finally:
        await direct.close()
    async with LossyProxy(server.port, ["rp.>"]) as px:
        through = await nats.connect(px.url, allow_reconnect=False)
        try:
            assert through.discovered_servers == []
            assert "connect_urls" not in through._server_info
        finally:
            await through.close()


def test_sync_proxy_in_a_thread(nats_server_module) -> None:
    """The `with` form (its own loop in a thread), as sync fixtures and benches use it."""
    async def go(url: str) -> bytes:
        async def ok(msg) -> None:
            await msg.respond(b"ok")
        c = await nats.connect(url, allow_reconnect=False)
        try:
            await c.subscribe("svc.t", cb=ok)
            return (await c.request("svc.t", b"", timeout=10)).data
        finally:
            await c.close()
    with LossyProxy(nats_server_module.port, ["rp.>"]) as px:
        assert asyncio.run(go(px.url)) == b"ok"
        assert px.connections == 1


async def test_standalone_proxy(nc, nats_server_module) -> None:
    """`python -m tests.support.lossy_proxy`, as a bench runs it: the URL on its first line,
    `drop_all` / `end` / `stats` on stdin, the counts as JSON, and again at `quit`."""
    await _stream(nc, STREAM_NAME, "in.>", "rp.>")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.support.lossy_proxy", "--upstream", f"127.0.0.1:{nats_server_module.port}",
        "--subject", "rp.>", cwd=ROOT, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    assert proc.stdin and proc.stdout

    async def say(line: str) -> dict:
        proc.stdin.write(line.encode() + b"\n")
        await proc.stdin.drain()
        return json.loads(await asyncio.wait_for(proc.stdout.readline(), 30))
    try:
        url = json.loads(await asyncio.wait_for(proc.stdout.readline(), 30))["listening"]
        sub_nc = await nats.connect(url, allow_reconnect=False)
        try:
            seen = Seen()
            sub = await sub_nc.subscribe("rp.>", cb=seen.on_rp)
            await sub_nc.flush()
            js = nc.jetstream()
            await say("drop_all")
            for _ in range(3):
                await js.publish("in.s", b"s")

            async def matched(k: int) -> bool:
                return (await say("stats"))["matched"] >= k
            await until(lambda: matched(3), 30, "the proxy to see 3 messages")
            await say("end")
            await js.publish("in.s", b"s")
            await until(lambda: matched(4), 30, "the proxy to see the 4th message")
            await drained(sub_nc, sub)
            stats = await say("stats")
            assert (stats["dropped"], stats["dropped_seqs"], stats["window_drops"]) == (3, [1, 2, 3], 3)
            assert seen.seqs == [4]
        finally:
            await sub_nc.close()
        proc.stdin.write(b"quit\n")
        await proc.stdin.drain()
        assert json.loads(await asyncio.wait_for(proc.stdout.readline(), 30))["dropped"] == 3
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
