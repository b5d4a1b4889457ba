"""Every read form under every feed state a TCP proxy can make, against a real nats-server and a
sidecar process, each answer judged by the rules its form promises (tests/support/read_rules.py,
proven on wrong answers in tests/test_read_rules.py).

The sidecar reaches the server only through a DelayProxy (tests/support/topology.py); a writer
(nats-py, straight to the server) puts the bucket's keys all along, recording each revision and
the moment it was acknowledged. Bucket `m` replicates `k.>` (max_stale_ms 4000, heartbeats
every 500 ms) and keeps a near cache for the keys outside, `out.x` among them. The feed states:

- current: the proxy passes bytes at once;
- behind: 0.5 s each way, within every bound a read here gives (max_stale_ms 4000, MAXSTALE
  1500): the replica is behind and cannot tell (no clock is compared), and need not; MINREV's
  0.25 s wait for the replica runs out;
- stalled: the proxy frozen a moment ago, before two heartbeats of silence: nothing tells the
  sidecar yet, and its replica still answers within its bound;
- beyond: still frozen, the replica past max_stale_ms (INFO lag_ms shows it): NATS cannot
  answer either, so reads fail as documented (no peer could answer; upstream read failed).

The forms: GET (the fast path), GET inside MULTI/EXEC, MGET, KV.GET plain, CONSISTENCY strong,
MAXSTALE 1500 and MINREV r (r: the key's own last write, or the bucket's last write, another
key's), a client-side cache kept by CLIENT TRACKING (RESP3 pushes; a cached read, and a read
again after an invalidation), XRANGE and XREAD on `@m` and on `@m:k.*`, and GET and KV.GET of the
near-cached key. Each round sends one read of every form at once, each on its own connection;
rounds are paced by the writer's acknowledgements, never by sleeps. Answers outside the rules:
0. The summary table (form x state) is printed (`pytest -s`).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hiredis
import nats
import pytest
from support.poll import until
from support.read_rules import Answer, ReadRules
from support.sidecar_proc import SidecarProcess, write_config
from support.staleness_check import Acks
from support.topology import DelayProxy

from kvcache.app.client import encode_command

pytestmark = pytest.mark.timeout(300)

BUCKET = "m"
KEYS = ["k.0", "k.1", "k.2"]          # replicated (`k.>`)
NEAR = "out.x"                         # outside the filters: the near cache's
MAX_STALE_MS = 4000
HEARTBEAT_MS = 500
MAXSTALE = 1500
REQUEST_TIMEOUT_MS = 4000
# Behind, not gone: the sidecar leaves a server whose pings go unanswered for about half the
# tightest max_stale_ms (kvcache.natsio.upstream), so the round trip (twice this) stays under it
DELAY_S = 0.5
WRITE_GAP_S = 0.05                     # the writer's pace: about 20 puts a second
# What docs/configuration.md ("Staleness") and docs/commands.md say a read may answer instead of
# a value when neither the replica (past its bound) nor NATS (out of reach) can
FROZEN_ERRORS = (r"no peer could answer", r"upstream read failed", r"replica stale \(")
# The client-side cache is told to drop a bucket's values when its replica passes max_stale_ms,
# checked every tenth of the smallest max_stale_ms (docs/commands.md, Client-side caching)
TRACKING_BOUND_MS = MAX_STALE_MS * 1.1
STREAM_READS = ("XRANGE @m", "XRANGE @m:k.*", "XREAD @m", "XREAD @m:k.*")


class Conn:
    """A raw RESP connection to the sidecar's socket: requests in order, replies in order. With
    `on_push` (RESP3 and CLIENT TRACKING), every array is a push (the reads here answer none):
    pushes and replies are taken in the order they arrived, a push applied when `reply` or
    `drain` reaches it, so that a client cache filled from a reply drops the value when an
    invalidation that came after that reply says so (and not before it was filled)."""

    def __init__(self, name: str, on_push: Callable[[list], None] | None = None) -> None:
        self.name = name
        self.on_push = on_push
        self.arrived: asyncio.Queue[Any] = asyncio.Queue()
        self._task: asyncio.Task | None = None

    async def open(self, socket: str) -> Conn:
        self.reader, self.writer = await asyncio.open_unix_connection(socket)
        self._task = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        parser = hiredis.Reader()
        while data := await self.reader.read(1 << 16):
            parser.feed(data)
            while (reply := parser.gets()) is not False:
                self.arrived.put_nowait(reply)

    async def send(self, *commands: list[Any]) -> float:
        """Send the commands at once; the moment they left (time.monotonic())."""
        sent = time.monotonic()
        self.writer.write(b"".join(encode_command(list(c)) for c in commands))
        return sent

    def _push(self, item: Any) -> bool:
        if self.on_push is not None and isinstance(item, list):
            self.on_push(item)
            return True
        return False

    async def reply(self) -> Any:
        """The next reply (the pushes before it applied)."""
        while True:
            item = await asyncio.wait_for(self.arrived.get(), 60)
            if not self._push(item):
                return item

    async def drain(self) -> None:
        """Apply the pushes that arrived (the loop's turn first: what is on the socket now)."""
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        while not self.arrived.empty():
            item = self.arrived.get_nowait()
            assert self._push(item), f"a reply nobody asked for: {item!r}"

    async def close(self) -> None:
        self.writer.close()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


@dataclass
class Writer:
    """Puts the keys in turn, straight to the server, each value unique (`key=n`): every
    acknowledgement (key, value, revision, time) is kept, and `acked` wakes who waits for one."""

    kv: Any
    rows: list[tuple[str, bytes, int, float]] = field(default_factory=list)
    last: dict[str, int] = field(default_factory=dict)
    acked: asyncio.Event = field(default_factory=asyncio.Event)
    stop: bool = False

    async def put(self, key: str, value: bytes) -> int:
        rev = await self.kv.put(key, value)
        self.rows.append((key, value, rev, time.monotonic()))
        self.last[key] = rev
        self.acked.set()
        return rev

    async def run(self) -> None:
        n = 0
        while not self.stop:
            key = [*KEYS, NEAR][n % (len(KEYS) + 1)]
            n += 1
            await self.put(key, b"%s=%d" % (key.encode(), n))
            await asyncio.sleep(WRITE_GAP_S)   # the write rate, not a wait for anything

    async def next_ack(self) -> None:
        self.acked.clear()
        await self.acked.wait()

    @property
    def top(self) -> int:
        return max(self.last.values())


@dataclass
class Raw:
    """One key's answer as read, before its value is turned into a revision."""

    form: str
    state: str
    conn: str
    key: str
    sent: float
    value: bytes | None = None
    revision: int | None = None   # when the reply names it (KV.GET, stream IDs)
    source: str = ""
    error: str = ""
    bound_ms: float | None = MAX_STALE_MS
    min_rev: int | None = None


class Forms:
    """Every read form, each on its own connection(s): `round(state, i)` sends one read of
    each at once and records the answers."""

    def __init__(self, socket: str, writer: Writer) -> None:
        self.socket = socket
        self.writer = writer
        self.raw: list[Raw] = []
        self.cache: dict[str, bytes | None] = {}   # the tracking client's cache
        self.conns: dict[str, Conn] = {}

    async def open(self) -> None:
        for name in ("get", "multi", "mget", "kv", "strong", "maxstale", "minrev-own", "minrev-bucket",
                     *STREAM_READS, "near-get", "near-kv"):
            self.conns[name] = await Conn(name).open(self.socket)
        tr = self.conns["tracking"] = await Conn("tracking", self._invalidate).open(self.socket)
        await tr.send(["HELLO", "3"], ["CLIENT", "TRACKING", "ON"])
        hello, ok = await tr.reply(), await tr.reply()
        assert isinstance(hello, dict) and ok == b"OK", (hello, ok)

    def _invalidate(self, push: list) -> None:
        if push and push[0] == b"invalidate":
            keys = push[1]
            if keys is None:
                self.cache.clear()
            else:
                for k in keys:
                    self.cache.pop(k.decode(), None)

    async def close(self) -> None:
        for c in self.conns.values():
            await c.close()

    async def round(self, state: str, i: int) -> None:
        key = KEYS[i % len(KEYS)]
        reads: list[Awaitable[None]] = [
            self._get("GET", "get", state, key), self._multi(state, key), self._mget(state, i),
            self._kv("KV.GET", "kv", state, key), self._kv("KV.GET strong", "strong", state, key),
            self._kv("KV.GET MAXSTALE", "maxstale", state, key), self._minrev(state, key, True),
            self._minrev(state, key, False), self._tracking(state, key),
            *(self._stream(state, form) for form in STREAM_READS),
            self._get("GET near", "near-get", state, NEAR), self._kv("KV.GET near", "near-kv", state, NEAR)]
        await asyncio.gather(*reads)

    def _add(self, **kw: Any) -> None:
        self.raw.append(Raw(**kw))

    async def _get(self, form: str, conn: str, state: str, key: str) -> None:
        c = self.conns[conn]
        sent = await c.send(["GET", key])
        self._value(form, conn, state, key, sent, await c.reply())

    def _value(self, form: str, conn: str, state: str, key: str, sent: float, reply: Any, **kw: Any) -> None:
        if isinstance(reply, hiredis.ReplyError):
            self._add(form=form, state=state, conn=conn, key=key, sent=sent, error=str(reply), **kw)
        else:
            self._add(form=form, state=state, conn=conn, key=key, sent=sent, value=reply, **kw)

    async def _multi(self, state: str, key: str) -> None:
        c = self.conns["multi"]
        sent = await c.send(["MULTI"], ["GET", key], ["EXEC"])
        ok, queued, done = await c.reply(), await c.reply(), await c.reply()
        assert (ok, queued) == (b"OK", b"QUEUED") and isinstance(done, list), (ok, queued, done)
        self._value("MULTI GET", "multi", state, key, sent, done[0])

    async def _mget(self, state: str, i: int) -> None:
        c = self.conns["mget"]
        keys = [KEYS[i % len(KEYS)], KEYS[(i + 1) % len(KEYS)], NEAR]
        sent = await c.send(["MGET", *keys])
        reply = await c.reply()
        for n, key in enumerate(keys):
            self._value("MGET", "mget", state, key, sent, reply if isinstance(reply, hiredis.ReplyError) else reply[n])

    async def _kv(self, form: str, conn: str, state: str, key: str, *extra: Any, min_rev: int | None = None) -> None:
        c = self.conns[conn]
        args: list[Any] = ["KV.GET", key, *extra]
        bound: float | None = MAX_STALE_MS
        if conn == "strong":
            args += ["CONSISTENCY", "strong"]
            bound = None
        elif conn == "maxstale":
            args += ["MAXSTALE", MAXSTALE]
            bound = MAXSTALE
        sent = await c.send(args)
        reply = await c.reply()
        if isinstance(reply, hiredis.ReplyError):
            self._add(form=form, state=state, conn=conn, key=key, sent=sent, error=str(reply), bound_ms=bound,
                      min_rev=min_rev)
        elif reply is None:
            self._add(form=form, state=state, conn=conn, key=key, sent=sent, bound_ms=bound, min_rev=min_rev)
        else:
            value, rev, _created, _op, source = reply
            self._add(form=form, state=state, conn=conn, key=key, sent=sent, value=value, revision=rev,
                      source=source.decode(), bound_ms=bound, min_rev=min_rev)

    async def _minrev(self, state: str, key: str, own: bool) -> None:
        """MINREV of the key's own last write (read-your-writes), or of the bucket's last write
        (another key's, most times: the key's answer may then be older than r)."""
        w = self.writer
        r = w.last[key] if own else w.top
        conn = "minrev-own" if own else "minrev-bucket"
        await self._kv(f"KV.GET MINREV {conn[7:]}", conn, state, key, "MINREV", r, min_rev=r)

    async def _tracking(self, state: str, key: str) -> None:
        """The key as a caching client reads it: from its cache when it holds the key, else
        GET (kept until the sidecar says to drop it); twice, so that a value just read is
        read again from the cache unless it was invalidated meanwhile."""
        c = self.conns["tracking"]
        for _ in range(2):
            await c.drain()   # what the sidecar said so far, as a client library applies it
            if key in self.cache:
                self._add(form="tracking cached", state=state, conn="tracking", key=key, sent=time.monotonic(),
                          value=self.cache[key], source="client", bound_ms=TRACKING_BOUND_MS)
                continue
            sent = await c.send(["GET", key])
            reply = await c.reply()
            self._value("tracking GET", "tracking", state, key, sent, reply)
            if not isinstance(reply, hiredis.ReplyError):
                self.cache[key] = reply   # the pushes after the reply, in the next drain

    async def _stream(self, state: str, form: str) -> None:
        """The bucket's stream (or its keys under a filter) read whole: each key's entry is its
        latest revision."""
        c = self.conns[form]
        command, stream = form.split()
        sent = await c.send([command, stream, "-", "+"] if command == "XRANGE" else [command, "STREAMS", stream, "0"])
        reply = await c.reply()
        conn = form
        if isinstance(reply, hiredis.ReplyError):
            for key in KEYS:
                self._add(form=form, state=state, conn=conn, key=key, sent=sent, error=str(reply))
            return
        entries = reply if command == "XRANGE" else (reply[0][1] if reply else [])
        seen: dict[str, tuple[int, bytes | None]] = {}
        for eid, fields in entries:
            f = dict(zip(fields[::2], fields[1::2], strict=True))
            seen[f[b"key"].decode()] = (int(eid.split(b"-")[0]), f.get(b"value"))
        for key in KEYS:
            rev, value = seen.get(key, (None, None))
            self._add(form=form, state=state, conn=conn, key=key, sent=sent, value=value, revision=rev)


@dataclass
class Live:
    proxy: DelayProxy
    sc: SidecarProcess
    writer: Writer
    forms: Forms

    def bucket(self) -> dict:
        return self.sc.buckets()[BUCKET]


@pytest.fixture
async def live(nats_server, tmp_path: Path) -> AsyncIterator[Live]:
    async with AsyncExitStack() as stack:
        nc = await nats.connect(nats_server.url)
        stack.push_async_callback(nc.close)
        kv = await nc.jetstream().create_key_value(bucket=BUCKET, history=1)
        writer = Writer(kv)
        for key in [*KEYS, NEAR]:
            await writer.put(key, b"%s=0" % key.encode())
        proxy = DelayProxy(nats_server.port).start()
        stack.callback(proxy.stop)
        cfg = write_config(tmp_path / "kvcache.toml",
                           {"servers": [proxy.url], "request_timeout_ms": REQUEST_TIMEOUT_MS},
                           [{"name": BUCKET, "keys": ["k.>"], "max_stale_ms": MAX_STALE_MS, "cache_max_keys": 100}],
                           heartbeat_ms=HEARTBEAT_MS)
        sc = SidecarProcess(tmp_path / "sc", None, extra=["--config", cfg])
        stack.callback(sc.kill)
        await asyncio.to_thread(sc.start)
        forms = Forms(sc.socket, writer)
        await forms.open()
        stack.push_async_callback(forms.close)
        yield Live(proxy, sc, writer, forms)
        writer.stop = True
        assert await asyncio.to_thread(sc.stop) == 0


async def bucket_row(live: Live) -> dict:
    return await asyncio.to_thread(live.bucket)


async def test_every_read_form_keeps_its_rules_under_every_feed_state(live: Live):
    w, forms = live.writer, live.forms
    writing = asyncio.create_task(w.run())
    i = 0

    async def rounds(state: str, n: int) -> None:
        nonlocal i
        for _ in range(n):
            await forms.round(state, i)
            i += 1
            await w.next_ack()   # the bucket changed since: the next round reads a newer state

    try:
        await rounds("current", 6)
        live.proxy.delay = DELAY_S
        await rounds("behind", 4)
        live.proxy.delay = 0
        top = w.top
        await until(lambda: _applied(live, top), 30, f"the replica back at revision {top}")
        live.proxy.freeze()
        await rounds("stalled", 1)     # sent at once: no silence noticed yet
        await until(lambda: _lag_past(live), 30, "the replica past max_stale_ms")
        await rounds("beyond", 2)
        live.proxy.thaw()
        await until(lambda: _lag_zero(live), 60, "the replica current again")
    finally:
        w.stop = True
        await writing
    acks = Acks.of((key, rev, rev, t) for key, _, rev, t in w.rows)
    revision_of = {(key, value): rev for key, value, rev, _ in w.rows}
    answers = []
    for r in forms.raw:
        rev = r.revision
        if rev is None and r.value is not None:
            rev = revision_of[(r.key, r.value)]
        frozen = r.state in ("stalled", "beyond")
        answers.append(Answer(r.form, r.state, r.conn, r.key, r.sent, rev, r.bound_ms, r.source, r.error,
                              r.min_rev, FROZEN_ERRORS if frozen else ()))
    rules = ReadRules(acks)
    bad = rules.check(answers)
    print(f"\n{len(answers)} answers, {len(w.rows)} writes acknowledged\n{rules.table()}")
    assert not bad, "\n".join(map(str, bad[:20]))
    # the states were what they claim: remote and local answers behind, errors once frozen past the bound
    seen = {(a.form, a.state): a for a in answers}
    assert not any(a.error for a in answers if a.state in ("current", "behind"))
    assert seen[("KV.GET strong", "behind")].source == "leader"
    assert all(a.error for a in answers if a.state == "beyond" and a.form != "tracking cached")


async def _applied(live: Live, revision: int) -> bool:
    return int((await bucket_row(live))["applied_seq"]) >= revision


async def _lag_past(live: Live) -> bool:
    return int((await bucket_row(live))["lag_ms"]) > MAX_STALE_MS


async def _lag_zero(live: Live) -> bool:
    row = await bucket_row(live)
    return int(row["lag_ms"]) == 0 and int(row["synced"]) == 1
