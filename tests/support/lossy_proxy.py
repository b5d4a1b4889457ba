"""A lossy NATS proxy: a TCP forwarder on 127.0.0.1 between NATS clients and one nats-server
that drops whole MSG/HMSG frames the server sends on chosen subjects.

Core NATS is at-most-once: a message published on a core subject (a stream's RePublish, a
relay's feed) can be lost on the way to a subscriber (a slow consumer cut off, a route or a
client connection reset). A follower that relies on such a subject must find and fill the
gaps; this proxy makes those gaps on purpose, counted, so a test can check that every one was
filled. It stands in front of one server: everything a client sends goes through unchanged;
what the server sends is read frame by frame (the NATS client protocol: INFO, MSG, HMSG,
PING, PONG, +OK, -ERR, anything else as one line), and a MSG or HMSG whose subject matches
one of `subjects` (NATS subject patterns, `*` and `>`) is dropped

  * with probability `drop` (a seeded random.Random, drawn once per matching frame), or
  * every one while a window is open: `drop_all(seconds)`, or `drop_all()` until
    `end_drop_all()`.

Each drop is recorded (`dropped`: subject, the `Nats-Sequence` header when the frame has
one, the connection, why). The INFO the server sends is rewritten without `connect_urls` (and
`ws_connect_urls`), so a client does not learn the cluster's other servers and wander off past
the proxy. Frames split across reads at any byte are put together before a decision; nothing
is forwarded until its frame is whole.

It is a test tool and stays independent of the code it checks: it imports nothing of kvcache
and parses the protocol itself (only as far as it needs: frame boundaries, subjects, one
header).

In tests (the proxy on the test's own event loop, or in a thread of its own):

    async with LossyProxy(server.port, ["rp.>"], drop=0.01, seed=7) as px:
        nc = await nats.connect(px.url)
    with LossyProxy(server.port, ["rp.>"]) as px:      # sync fixtures, sidecar processes
        px.drop_all(5.0)

Standalone, for benches (commands on stdin, one JSON line of counts on `stats` and at exit):

    python -m tests.support.lossy_proxy --upstream 127.0.0.1:4222 --listen 127.0.0.1:0 \\
        --subject 'rp.>' --drop 0.01 --seed 1
    # stdin: `drop_all 5` (a window of 5 s), `drop_all` (until `end`), `end`, `stats`, `quit`
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

HOST = "127.0.0.1"
MAX_LINE = 1 << 20          # a control line longer than this is not NATS: close the connection
READ_SIZE = 65536


class FrameError(ValueError):
    """The server's byte stream is not the NATS protocol (a bad MSG/HMSG size, no CRLF after
    a body, an endless control line): the proxy closes that connection."""


# ------------------------------------------------------------------ subjects

def subject_matches(pattern: str, subject: str) -> bool:
    """Whether a NATS subject matches a pattern: `*` stands for one token, a final `>` for
    one or more."""
    pat, sub = pattern.split("."), subject.split(".")
    for i, tok in enumerate(pat):
        if tok == ">" and i == len(pat) - 1:
            return len(sub) > i
        if i >= len(sub) or (tok != "*" and tok != sub[i]):
            return False
    return len(pat) == len(sub)


# ------------------------------------------------------------------ the server's frames

@dataclass(frozen=True)
class Frame:
    """One whole server->client frame: its op (upper case: MSG, HMSG, INFO, PING, PONG, +OK,
    -ERR, or whatever word the line starts with), its bytes as they will be forwarded, and
    for MSG/HMSG the subject and the Nats-Sequence header (None when absent)."""

    op: str
    raw: bytes
    subject: str = ""
    seq: int | None = None


def header_value(block: bytes, name: str) -> str | None:
    """The value of header `name` (case-insensitive) in an HMSG header block, or None."""
    want = name.lower().encode()
    for line in block.split(b"\r\n")[1:]:
        key, sep, value = line.partition(b":")
        if sep and key.strip().lower() == want:
            return value.strip().decode("utf-8", "replace")
    return None


def rewrite_info(line: bytes) -> bytes:
    """An INFO line without the URLs of the cluster's other servers (a client would add them
    to its pool and could reconnect to one of them, past the proxy). A line that is not valid
    JSON is passed on as it came."""
    try:
        info = json.loads(line[4:].strip())
    except ValueError:
        return line
    if not isinstance(info, dict):
        return line
    for k in ("connect_urls", "ws_connect_urls"):
        info.pop(k, None)
    return b"INFO " + json.dumps(info, separators=(",", ":")).encode() + b"\r\n"


class ServerStream:
    """Splits what a server sends into whole frames; I/O-free, fed any chunking.

    Between feeds it keeps the unparsed tail: a control line not yet ended (scanned once), or
    a MSG/HMSG whose control line is parsed and whose body is still arriving (not rescanned)."""

    def __init__(self, max_line: int = MAX_LINE) -> None:
        self._buf = bytearray()
        self._scanned = 0        # bytes of an unfinished control line already searched for LF
        self._pending: tuple[str, str, int, int, int] | None = None  # op, subject, line, hdr, total

    def feed(self, data: bytes) -> list[Frame]:
        buf = self._buf
        buf += data
        out: list[Frame] = []
        pos = 0
        while True:
            if self._pending is None:
                nl = buf.find(b"\n", pos + self._scanned)
                if nl < 0:
                    self._scanned = len(buf) - pos
                    if self._scanned > MAX_LINE:
                        raise FrameError(f"control line over {MAX_LINE} bytes")
                    break
                self._scanned = 0
                line = bytes(buf[pos:nl + 1])
                fields = line.split()
                op = fields[0].decode("ascii", "replace").upper() if fields else ""
                if op in ("MSG", "HMSG"):
                    self._pending = (op, *_sizes(op, fields), nl + 1 - pos)
                    continue
                out.append(Frame(op, rewrite_info(line) if op == "INFO" else line))
                pos = nl + 1
                continue
            op, subject, hdr, total, line_len = self._pending
            end = pos + line_len + total + 2
            if len(buf) < end:
                break
            if buf[end - 2:end] != b"\r\n":
                raise FrameError(f"{op} {subject}: no CRLF after its {total} bytes")
            body = pos + line_len
            seq = None
            if op == "HMSG":
                value = header_value(bytes(buf[body:body + hdr]), "Nats-Sequence")
                seq = int(value) if value and value.isdigit() else None
            out.append(Frame(op, bytes(buf[pos:end]), subject, seq))
            self._pending = None
            pos = end
        del buf[:pos]
        return out


def _sizes(op: str, fields: list[bytes]) -> tuple[str, int, int]:
    """subject, header bytes, total bytes of a MSG (`MSG subj sid [reply] n`) or HMSG
    (`HMSG subj sid [reply] hdr total`) control line."""
    want = (4, 5) if op == "MSG" else (5, 6)
    if len(fields) not in want:
        raise FrameError(f"malformed {op} line: {b' '.join(fields)[:200]!r}")
    try:
        if op == "MSG":
            hdr, total = 0, int(fields[-1])
        else:
            hdr, total = int(fields[-2]), int(fields[-1])
    except ValueError:
        raise FrameError(f"bad sizes in {op} line: {b' '.join(fields)[:200]!r}") from None
    if hdr < 0 or total < hdr:
        raise FrameError(f"bad sizes in {op} line: {b' '.join(fields)[:200]!r}")
    return fields[1].decode("utf-8", "replace"), hdr, total


# ------------------------------------------------------------------ what to drop

@dataclass(frozen=True)
class Dropped:
    """One frame the proxy did not forward."""

    subject: str
    seq: int | None      # its Nats-Sequence header, when it had one
    conn: int            # which client connection (1, 2, ... in the order accepted)
    why: str             # "random" (probability `drop`) or "window" (drop_all)
    at: float            # time.monotonic()


class Dropper:
    """The decision, frame by frame, and its record. Thread-safe: the proxy decides on its
    event loop while a test or bench changes the rules and reads the counts from another."""

    def __init__(self, subjects: Iterable[str], drop: float = 0.0, seed: int | None = 0) -> None:
        if not 0.0 <= drop <= 1.0:
            raise ValueError(f"drop probability {drop} is not between 0 and 1")
        self.subjects = list(subjects)
        self.drop = drop
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._all = False
        self._until = 0.0
        self._dropped: list[Dropped] = []
        self._matched: Counter[str] = Counter()   # matching frames seen, by subject

    def drop_all(self, seconds: float | None = None) -> None:
        """Drop every matching frame for `seconds` from now, or until end_drop_all()."""
        with self._lock:
            if seconds is None:
                self._all = True
            else:
                self._until = time.monotonic() + seconds

    def end_drop_all(self) -> None:
        with self._lock:
            self._all, self._until = False, 0.0

    def decide(self, frame: Frame, conn: int) -> bool:
        """True to forward `frame`, False to drop it (and record the drop)."""
        if frame.op not in ("MSG", "HMSG") or not any(subject_matches(p, frame.subject) for p in self.subjects):
            return True
        with self._lock:
            self._matched[frame.subject] += 1
            now = time.monotonic()
            if self._all or now < self._until:
                why = "window"
            elif self.drop > 0 and self._rng.random() < self.drop:
                why = "random"
            else:
                return True
            self._record(Dropped(frame.subject, frame.seq, conn, why, now))
            return False

    def _record(self, d: Dropped) -> None:
        self._dropped.append(d)

    @property
    def dropped(self) -> list[Dropped]:
        with self._lock:
            return list(self._dropped)

    @property
    def matched(self) -> int:
        """Matching MSG/HMSG frames seen (dropped or forwarded)."""
        with self._lock:
            return sum(self._matched.values())

    def stats(self) -> dict[str, Any]:
        """The counts as plain data (the standalone proxy prints them as JSON)."""
        with self._lock:
            by_subject = Counter(d.subject for d in self._dropped)
            return {"matched": sum(self._matched.values()), "dropped": len(self._dropped),
                    "dropped_by_subject": dict(by_subject),
                    "dropped_seqs": [d.seq for d in self._dropped if d.seq is not None],
                    "window_drops": sum(d.why == "window" for d in self._dropped)}


# ------------------------------------------------------------------ the proxy

class LossyProxy:
    """The proxy: listens on `host` (port 0: a free one, see `url`), connects each client to
    `upstream` (a port on 127.0.0.1, or (host, port)), forwards client->server as it comes and
    server->client frame by frame through a Dropper (`drop_all`, `end_drop_all`, `dropped`,
    `matched`, `stats` are its). Runs on the caller's event loop (`async with`) or on one of
    its own in a thread (`with`, `start()`/`stop()`)."""

    def __init__(self, upstream: int | tuple[str, int], subjects: Sequence[str] = (), drop: float = 0.0,
                 seed: int | None = 0, host: str = HOST, port: int = 0) -> None:
        self.upstream = (HOST, upstream) if isinstance(upstream, int) else upstream
        self.host, self.port = host, port
        self.dropper = self._make_dropper(subjects, drop, seed)
        self.connections = 0          # client connections accepted so far
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def _make_dropper(self, subjects: Sequence[str], drop: float, seed: int | None) -> Dropper:
        return Dropper(subjects, drop, seed)

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    # the Dropper's controls and counts, for convenience
    def drop_all(self, seconds: float | None = None) -> None:
        self.dropper.drop_all(seconds)

    def end_drop_all(self) -> None:
        self.dropper.end_drop_all()

    @property
    def dropped(self) -> list[Dropped]:
        return self.dropper.dropped

    @property
    def matched(self) -> int:
        return self.dropper.matched

    def stats(self) -> dict[str, Any]:
        return {"connections": self.connections, **self.dropper.stats()}

    # ---------------------------------------------------------------- on the caller's loop
    async def serve(self) -> LossyProxy:
        """Start listening on the running loop."""
        self._server = await asyncio.start_server(self._accept, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def aclose(self) -> None:
        """Stop listening and close every connection through the proxy."""
        if self._server is not None:
            self._server.close()
            self._server = None
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def __aenter__(self) -> LossyProxy:
        return await self.serve()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ---------------------------------------------------------------- on a loop of its own
    def start(self) -> LossyProxy:
        """Run on an event loop in a thread of its own (sync fixtures, benches)."""
        ready = threading.Event()
        failed: list[BaseException] = []

        def run() -> None:
            loop = self._loop = asyncio.new_event_loop()
            try:
                loop.run_until_complete(self.serve())
            except BaseException as e:   # handed to the starting thread
                failed.append(e)
                ready.set()
                loop.close()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

        self._thread = threading.Thread(target=run, name=f"lossy-proxy-{self.upstream[1]}", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise TimeoutError("lossy proxy did not start")
        if failed:
            raise failed[0]
        return self

    def stop(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None:
            return
        asyncio.run_coroutine_threadsafe(self.aclose(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        assert self._thread is not None
        self._thread.join(10)

    def __enter__(self) -> LossyProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---------------------------------------------------------------- one client connection
    async def _accept(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        conn = self.connections
        swriter = None
        pumps: list[asyncio.Future] = []
        try:
            sreader, swriter = await asyncio.open_connection(*self.upstream)
            pumps = [asyncio.ensure_future(self._raw(creader, swriter)),
                     asyncio.ensure_future(self._frames(sreader, cwriter, conn))]
            await asyncio.gather(*pumps)
        except (OSError, FrameError):
            pass      # either side closed or reset, or the server spoke no NATS: close both
        except asyncio.CancelledError:
            pass      # aclose(): asyncio's stream callback would log a cancelled handler as an error
        finally:
            for w in (cwriter, swriter):
                if w is not None:
                    w.close()
            for t in pumps:
                t.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            self._tasks.discard(task)

    @staticmethod
    async def _raw(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """client -> server: as it comes."""
        while data := await reader.read(READ_SIZE):
            writer.write(data)
            await writer.drain()
        writer.close()

    async def _frames(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: int) -> None:
        """server -> client: whole frames, less the dropped ones, in order."""
        stream = ServerStream()
        while data := await reader.read(READ_SIZE):
            keep = [f.raw for f in stream.feed(data) if self.dropper.decide(f, conn)]
            if keep:
                writer.write(b"".join(keep))
                await writer.drain()
        writer.close()


# ------------------------------------------------------------------ standalone

def _hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return host or HOST, int(port)


def _probability(text: str) -> float:
    try:
        p = float(text)
    except ValueError:
        p = -1.0
    if not 0.0 <= p <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a probability between 0 and 1")
    return p


def _command(px: LossyProxy, line: str) -> bool:
    """Carry out one stdin command; False on `quit`."""
    words = line.split()
    if not words:
        return True
    cmd, args = words[0], words[1:]
    if cmd == "quit":
        return False
    if cmd == "drop_all":
        try:
            px.drop_all(float(args[0]) if args else None)
        except ValueError:
            print(json.dumps({"error": f"drop_all takes seconds, not {args[0]!r}"}), flush=True)
            return True
    elif cmd == "end":
        px.end_drop_all()
    elif cmd != "stats":
        print(json.dumps({"error": f"unknown command {cmd!r} (drop_all [S], end, stats, quit)"}), flush=True)
        return True
    print(json.dumps(px.stats()), flush=True)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.support.lossy_proxy",
                                description="A NATS proxy that drops messages on chosen subjects.")
    p.add_argument("--upstream", type=_hostport, required=True, help="the nats-server, HOST:PORT")
    p.add_argument("--listen", type=_hostport, default=(HOST, 0), help="HOST:PORT to listen on (port 0: a free one)")
    p.add_argument("--subject", action="append", default=[], help="a subject pattern to drop on (repeatable)")
    p.add_argument("--drop", type=_probability, default=0.0, help="probability of dropping a matching message")
    p.add_argument("--seed", type=int, default=0, help="seed of the drop decisions")
    a = p.parse_args(argv)
    if not a.subject:
        p.error("give at least one --subject to drop on")
    px = LossyProxy(a.upstream, a.subject, a.drop, a.seed, host=a.listen[0], port=a.listen[1])
    try:
        px.start()
    except OSError as e:
        print(f"lossy_proxy: cannot listen on {a.listen[0]}:{a.listen[1]}: {e.strerror}", file=sys.stderr)
        return 1

    def on_signal(signum: int, frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_signal)
    print(json.dumps({"listening": px.url}), flush=True)
    try:
        for line in sys.stdin:
            if not _command(px, line):
                break
        else:
            while True:      # stdin closed (a bench that sends nothing): run until a signal
                signal.pause()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        px.stop()
        print(json.dumps(px.stats()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
