"""pytest-benchmark: the NATS protocol reader, ours native (ext/natsproto.pyx) vs ours Python
(kvcache/natsio/natsproto.py) vs nats-py's parser, each decoding the header block.

    python -m pytest bench/test_bench_natsproto.py -p no:cacheprovider \
        --benchmark-columns=min,median,ops --benchmark-sort=name -s

Each round parses one buffer of 10,000 HMSG frames, fed in 64 KiB reads (what a socket read
returns), with a fresh reader. Frames:

- `watch`: KV watch deliveries as a push consumer receives them: subject `$KV.config.app.<i>`,
  a `$JS.ACK.KV_config.<consumer>.1.<sseq>.<cseq>.<ts>.<pending>` reply, a one-line header
  block (`KV-Operation: DEL`, so every frame goes through header decoding), a 100-byte value.
- `direct`: Direct Get replies: `Nats-Stream`, `Nats-Subject`, `Nats-Sequence`,
  `Nats-Time-Stamp`, a 100-byte value.

nats-py's side is its `Parser` driven without an event loop, on a recorder whose
`_process_msg` runs nats-py's own `Client._process_headers` and decodes subject and reply to
str (what `Client._build_message` does before making a Msg; the Msg object and the
subscription queue are left out, which favours nats-py). Ours returns HMsg events with str
subject/reply, status, description and a headers dict. frames/s = 10,000 / median; the table
and ratios are printed by `test_zz_table` (run the whole file, with -s).
Not part of the test suite (pyproject's testpaths = tests).
"""
from __future__ import annotations

import pytest
from nats.aio.client import Client as _NatsClient
from nats.protocol.parser import Parser as _NatsParser

from kvcache.natsio import natsproto as twin

native = pytest.importorskip("kvcache._native.natsproto", reason="the Cython extension is not built")

N = 10_000
READ = 64 * 1024
VALUE = b"v" * 100
CONSUMER = "Hq3ZpR8bXw2LmC5kTn7YdE"


def _hmsg(subject: str, reply: str, block: bytes, payload: bytes) -> bytes:
    r = f" {reply}" if reply else ""
    return (f"HMSG {subject} 1{r} {len(block)} {len(block) + len(payload)}\r\n".encode()
            + block + payload + b"\r\n")


WATCH = b"".join(
    _hmsg(f"$KV.config.app.{i}",
          f"$JS.ACK.KV_config.{CONSUMER}.1.{1000 + i}.{1 + i}.{1763707257123456789 + i}.{N - 1 - i}",
          b"NATS/1.0\r\nKV-Operation: DEL\r\n\r\n", VALUE)
    for i in range(N))
DIRECT = b"".join(
    _hmsg(f"_INBOX.Hq3ZpR8bXw2LmC5kTn7Y.{i}", "",
          (f"NATS/1.0\r\nNats-Stream: KV_config\r\nNats-Subject: $KV.config.app.{i}\r\n"
           f"Nats-Sequence: {1000 + i}\r\nNats-Time-Stamp: 2026-11-21 06:40:57.{i:09d} +0000 UTC\r\n\r\n").encode(),
          VALUE)
    for i in range(N))
WIRES = {"watch": WATCH, "direct": DIRECT}
CHUNKS = {name: [wire[i:i + READ] for i in range(0, len(wire), READ)] for name, wire in WIRES.items()}


class _Recorder:
    _process_headers = _NatsClient._process_headers
    _parse_header_lines = staticmethod(_NatsClient._parse_header_lines)

    def __init__(self):
        self.n = 0
        self.last = None

    async def _error_cb(self, exc):
        raise exc

    async def _process_msg(self, sid, subject, reply, data, headers):
        hdr = await self._process_headers(headers)
        self.last = (subject.decode(), reply.decode(), data, hdr)
        self.n += 1


def _natspy(chunks) -> int:
    rec = _Recorder()
    parser = _NatsParser(rec)
    for chunk in chunks:
        coro = parser.parse(chunk)
        try:
            coro.send(None)
        except StopIteration:
            pass
    return rec.n


def _ours(mod):
    def run(chunks) -> int:
        reader = mod.NatsReader()
        n = 0
        for chunk in chunks:
            n += len(reader.feed(chunk))
        return n
    return run


def _lane(mod):
    """The feed's fast lane: deliveries on the lane's sid come out as replica items in Runs
    (ack subject parsed, operation decided, record built); other frames as ordinary events."""
    def run(chunks) -> int:
        reader = mod.NatsReader()
        reader.add_lane(1, len("$KV.config."))
        n = 0
        for chunk in chunks:
            for e in reader.feed(chunk):
                n += len(e.items) if type(e).__name__ == "Run" else 1
        return n
    return run


WHO = {"native": _ours(native), "native-lane": _lane(native), "python": _ours(twin),
       "python-lane": _lane(twin), "nats-py": _natspy}
_RESULTS: dict[str, dict[str, float]] = {}


@pytest.mark.parametrize("frames", list(WIRES))
@pytest.mark.parametrize("who", list(WHO))
def test_reader(benchmark, frames, who):
    benchmark.group = frames
    assert benchmark(WHO[who], CHUNKS[frames]) == N
    _RESULTS.setdefault(frames, {})[who] = benchmark.stats.stats.median


def test_same_answers():
    for _frames, chunks in CHUNKS.items():
        r = native.NatsReader()
        ours = [e for c in chunks for e in r.feed(c)]
        t = twin.NatsReader()
        assert ours == [e for c in chunks for e in t.feed(c)]
        assert len(ours) == N and ours[-1].payload == VALUE


def test_zz_table():
    if not _RESULTS:
        pytest.skip("run the whole file")
    print("\n\n| frames | reader | frames/s | × nats-py |\n|---|---|---:|---:|")
    for frames, res in _RESULTS.items():
        base = res.get("nats-py")
        for who, median in res.items():
            ratio = f"{base / median:.1f}" if base else ""
            print(f"| {frames} | {who} | {N / median:,.0f} | {ratio} |")
