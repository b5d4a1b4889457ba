"""A user-space packet shaper on an NFQUEUE, for kernels without netem (this one has none).

    python nfq_shaper.py --queue N [--delay-ms D] [--jitter-ms J] [--reorder P] [--reorder-ms R]
                         [--duplicate P] [--seconds S]

Runs inside the router namespace of support/partition.Net, which sends the shaped host's
forwarded packets to queue N (`-j NFQUEUE --queue-num N --queue-bypass`: while no shaper is
bound the packets pass unshaped). Each packet is held `D ± J` ms (uniform; jitter alone
reorders, as netem's does), a share P of them `R` ms more (they are overtaken by the packets
behind them: reordering), then accepted; a share of them is also sent once more as a copy
through a raw socket (duplication). Loss is iptables' own (`-m statistic`), not done here.

Prints `ready` once bound; exits on SIGTERM/SIGINT or after `--seconds`, releasing every packet
it holds first (accepted: a shaper that stops is a link that heals).
"""
from __future__ import annotations

import argparse
import heapq
import random
import select
import signal
import socket
import sys
import time


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--queue", type=int, required=True)
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--jitter-ms", type=float, default=0.0)
    p.add_argument("--reorder", type=float, default=0.0)
    p.add_argument("--reorder-ms", type=float, default=20.0)
    p.add_argument("--duplicate", type=float, default=0.0)
    p.add_argument("--seconds", type=float, default=3600.0)
    p.add_argument("--seed", type=int, default=7)
    a = p.parse_args(argv)

    from netfilterqueue import NetfilterQueue

    rnd = random.Random(a.seed)
    held: list[tuple[float, int, object, bytes | None]] = []
    seq = [0]
    stats = {"packets": 0, "reordered": 0, "duplicated": 0}
    raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    stop = [False]

    def on_signal(*_: object) -> None:
        stop[0] = True
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def release(pkt, copy: bytes | None) -> None:
        pkt.accept()
        if copy is not None:
            try:
                raw.sendto(copy, (socket.inet_ntoa(copy[16:20]), 0))
            except OSError:
                pass

    def on_packet(pkt) -> None:
        stats["packets"] += 1
        hold = a.delay_ms + (rnd.uniform(-a.jitter_ms, a.jitter_ms) if a.jitter_ms else 0.0)
        if a.reorder and rnd.random() < a.reorder:
            hold += a.reorder_ms
            stats["reordered"] += 1
        copy = None
        if a.duplicate and rnd.random() < a.duplicate:
            copy = pkt.get_payload()
            stats["duplicated"] += 1
        if hold <= 0:
            release(pkt, copy)
            return
        seq[0] += 1
        heapq.heappush(held, (time.monotonic() + hold / 1000.0, seq[0], pkt, copy))

    nfq = NetfilterQueue()
    nfq.bind(a.queue, on_packet, max_len=65536)
    fd = nfq.get_fd()
    print("ready", flush=True)
    deadline = time.monotonic() + a.seconds
    try:
        while not stop[0] and time.monotonic() < deadline:
            wait = 0.05
            if held:
                wait = min(wait, max(0.0, held[0][0] - time.monotonic()))
            try:
                ready, _, _ = select.select([fd], [], [], wait)
            except InterruptedError:
                continue
            if ready:
                nfq.run(block=False)
            t = time.monotonic()
            while held and held[0][0] <= t:
                _, _, pkt, copy = heapq.heappop(held)
                release(pkt, copy)
    finally:
        while held:
            _, _, pkt, copy = heapq.heappop(held)
            release(pkt, copy)
        nfq.unbind()
        print(f"shaper: {stats}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
