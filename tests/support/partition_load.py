"""The partition run's load, as processes of their own (support/partition.py starts them):

    python partition_load.py writer --servers URL,... --bucket B --keys N --rate R --log FILE
    python partition_load.py readers --socket PATH --bucket B --keys N --rate R --log FILE

The writer (nats-py, started inside the writer's network namespace) first puts counter 0 of
every key, prints `ready`, then puts about `rate` writes/s round the keys, one put of a key at
a time, each key's value its own counter. Every acknowledged put is logged as
`ack <key> <counter> <revision> <CLOCK_MONOTONIC ack time>`. A put that fails or times out is
logged as `fail ...` and the key's next put carries the next counter (an unacknowledged put
may still have landed: its counter is then lower than the next one's, so the judge's rule
"older than an acknowledged counter" holds either way).

The readers (in the root namespace, on the sidecar's Unix socket) run `--conns` connections,
each sending one request at a time (by chance `GET key` or `KV.GET bucket:key`, and a
`--strong-share` of them `KV.GET bucket:key CONSISTENCY strong`) at `rate / conns` reads/s,
and log `read <conn> <kind> <key> <sent> <received> <status> <counter> <revision>` for each;
a read without a reply within `--timeout` closes its connection (its replies would no longer
pair with its requests) and opens a new one.

Both stop on SIGTERM/SIGINT, after `--seconds`, or after `--max` operations, whichever comes
first, and flush their logs on the way out. They import nothing of kvcache: the judge must not
share the sidecar's code.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import signal
import sys
import time

MONO = time.CLOCK_MONOTONIC


def now() -> float:
    return time.clock_gettime(MONO)


def key_name(i: int) -> str:
    return f"k{i:05d}"


def _stop_on_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


# ----------------------------------------------------------------------------- writer

async def writer(a: argparse.Namespace) -> None:
    import nats
    import nats.errors
    import nats.js.errors

    stop = asyncio.Event()
    _stop_on_signals(stop)
    deadline = now() + a.seconds
    log = open(a.log, "w", buffering=1 << 16)
    nc = await nats.connect(servers=a.servers.split(","), dont_randomize=True, connect_timeout=2,
                            allow_reconnect=True, max_reconnect_attempts=-1, reconnect_time_wait=0.2,
                            name="partition-writer")
    js = nc.jetstream(timeout=a.put_timeout)
    kv = await js.key_value(a.bucket)
    keys = [key_name(i) for i in range(a.keys)]
    counter = dict.fromkeys(keys, 0)
    acked = failed = 0

    async def put(key: str) -> bool:
        nonlocal acked, failed
        c = counter[key]
        counter[key] = c + 1
        try:
            rev = await kv.put(key, b"%d" % c)
        except (TimeoutError, nats.errors.Error, nats.js.errors.Error) as e:
            failed += 1
            log.write(f"fail {key} {c} {now():.6f} {type(e).__name__}\n")
            return False
        acked += 1
        log.write(f"ack {key} {c} {rev} {now():.6f}\n")
        return True

    async def prime(key: str) -> bool:
        try:
            rev = await kv.put(key, b"0")
        except (TimeoutError, nats.errors.Error, nats.js.errors.Error):
            return False
        counter[key] = 1
        log.write(f"ack {key} 0 {rev} {now():.6f}\n")
        return True

    # counter 0 of every key, 64 at a time, each retried until acknowledged (bounded by time)
    pending = list(keys)
    while pending and not stop.is_set() and now() < deadline:
        batch, pending = pending[:64], pending[64:]
        results = await asyncio.gather(*(prime(k) for k in batch))
        pending += [k for k, ok in zip(batch, results, strict=False) if not ok]
    print("ready", flush=True)

    inflight: dict[str, asyncio.Task] = {}
    order = keys[:]
    random.Random(a.seed).shuffle(order)
    i = 0
    t0, n = now(), 0
    while not stop.is_set() and now() < deadline and acked + failed < a.max:
        due = t0 + n / a.rate
        delay = due - now()
        if delay > 0:
            try:
                await asyncio.wait_for(stop.wait(), delay)
                break
            except TimeoutError:
                pass
        elif delay < -0.5:  # fell behind (an outage): go on at the rate, no burst
            t0, n = now(), 0
        n += 1
        if len(inflight) >= a.max_inflight:
            continue
        for _ in range(len(order)):  # the next key with no put in flight
            key = order[i % len(order)]
            i += 1
            if key not in inflight:
                task = asyncio.create_task(put(key))
                inflight[key] = task
                task.add_done_callback(lambda _t, key=key: inflight.pop(key, None))
                break
    if inflight:
        await asyncio.wait(list(inflight.values()), timeout=a.put_timeout + 1)
    log.close()
    try:
        await asyncio.wait_for(nc.close(), 3)
    except Exception:  # closing a connection mid-outage
        pass
    print(f"writer: {acked} acked, {failed} failed", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- readers

def _resp(*args: bytes) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(x), x) for x in args)


async def readers(a: argparse.Namespace) -> None:
    import hiredis

    stop = asyncio.Event()
    _stop_on_signals(stop)
    deadline = now() + a.seconds
    log = open(a.log, "w", buffering=1 << 16)
    per_conn = a.rate / a.conns
    budget = [a.max]
    bucket = a.bucket.encode()

    async def conn(n: int) -> None:
        rnd = random.Random(a.seed * 1000 + n)
        reader = writer_ = None
        parser = None
        t0, k = now(), 0
        while not stop.is_set() and now() < deadline and budget[0] > 0:
            delay = t0 + k / per_conn - now()
            if delay > 0:
                await asyncio.sleep(delay)
            elif delay < -0.5:
                t0, k = now(), 0
            k += 1
            budget[0] -= 1
            key = key_name(rnd.randrange(a.keys))
            if a.strong_share and rnd.random() < a.strong_share:
                kind, req = "strong", _resp(b"KV.GET", bucket + b":" + key.encode(), b"CONSISTENCY", b"strong")
            elif rnd.random() < 0.5:
                kind, req = "get", _resp(b"GET", key.encode())
            else:
                kind, req = "kv.get", _resp(b"KV.GET", bucket + b":" + key.encode())
            sent = now()
            status, counter, rev = "conn", -1, -1
            try:
                if writer_ is None:
                    reader, writer_ = await asyncio.wait_for(
                        asyncio.open_unix_connection(a.socket), a.timeout)
                    parser = hiredis.Reader()
                writer_.write(req)
                reply = await asyncio.wait_for(_reply(reader, parser), max(0.001, sent + a.timeout - now()))
                status, counter, rev = _judge_reply(kind, reply)
            except TimeoutError:
                status = "timeout" if writer_ is not None and parser is not None else "conn"
                writer_ = _close(writer_)
            except (OSError, EOFError, ValueError):
                status = "conn"
                writer_ = _close(writer_)
            recv = now()
            log.write(f"read {n} {kind} {key} {sent:.6f} {recv:.6f} {status} {counter} {rev}\n")
            if status == "conn":
                await asyncio.sleep(0.02)  # the socket is gone: don't spin
        _close(writer_)

    await asyncio.gather(*(conn(n) for n in range(a.conns)))
    log.close()


async def _reply(reader: asyncio.StreamReader, parser) -> object:
    while True:
        got = parser.gets()
        if got is not False:
            return got
        data = await reader.read(65536)
        if not data:
            raise EOFError("connection closed")
        parser.feed(data)


def _judge_reply(kind: str, reply: object) -> tuple[str, int, int]:
    """(status, counter, revision) of one reply."""
    import hiredis

    if isinstance(reply, hiredis.ReplyError):
        return "err", -1, -1
    if reply is None:
        return "nil", -1, -1
    if kind == "get":
        return "ok", int(reply), -1
    if isinstance(reply, list) and reply and reply[0] is not None:
        return "ok", int(reply[0]), int(reply[1])
    return "nil", -1, -1


def _close(w: asyncio.StreamWriter | None) -> None:
    if w is not None:
        w.close()


# ----------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("writer")
    w.add_argument("--servers", required=True)
    w.add_argument("--put-timeout", type=float, default=2.0)
    w.add_argument("--max-inflight", type=int, default=256)
    r = sub.add_parser("readers")
    r.add_argument("--socket", required=True)
    r.add_argument("--conns", type=int, default=4)
    r.add_argument("--timeout", type=float, default=5.0)
    r.add_argument("--strong-share", type=float, default=0.0,
                   help="share of the reads sent as KV.GET ... CONSISTENCY strong")
    for s in (w, r):
        s.add_argument("--bucket", required=True)
        s.add_argument("--keys", type=int, required=True)
        s.add_argument("--rate", type=float, required=True)
        s.add_argument("--seconds", type=float, required=True)
        s.add_argument("--max", type=int, default=2_000_000)
        s.add_argument("--seed", type=int, default=1)
        s.add_argument("--log", required=True)
    a = p.parse_args(argv)
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:  # pragma: no cover - the test extra has it
        runner = asyncio.run
    runner(writer(a) if a.cmd == "writer" else readers(a))


if __name__ == "__main__":
    main()
