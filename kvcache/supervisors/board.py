"""The workers' board: what the feed's process tells its worker processes, and what they tell
it back, in one small file mapped by all of them (`<data_dir>/workers.board`).

Worker processes (kvcache.supervisors.worker) answer GETs from the replica's files with no feed
of their own: the feed, the read ledger and every NATS connection stay in the feed's process.
The one thing a worker must know per batch is the read side's rule for every key at once
(kvcache.read.ledger.Witness.fresh_for_all: synced, fresh within the bucket's max_stale_ms, no
key held). The feed's process publishes it per bucket as a deadline on the wall clock: the last
moment the replica stays fresh if nothing changes (Freshness.fresh_until_ns), 0 while it is not
synced or a key is held. It is published again after every change of what the rule answers
(Feed.on_state) and as a hold is placed, before the answer that placed it goes out, so a
worker that reads it after that answer sees it. A worker reads one aligned 64-bit word per
bucket per batch, and compares it with its own clock (the same clock, the same host).

Each worker writes back its counters (requests, GETs answered, clients), for INFO and
/metrics to add up, and its pid, so the feed's process knows it started: twice a second, and
at once when the feed's process asks (`ask`, then SIGUSR1: INFO waits for every worker's
answer, so what a client did just before on any worker shows in it).

Layout: 64-bit native words. Header: magic, layout version, buckets, workers. Then per bucket
BUCKET_WORDS (deadline, max_age_ns), then per worker WORKER_FIELDS and two per bucket (GETs
answered found, not found).
"""
from __future__ import annotations

import ctypes
import mmap
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..feed.feed import Feed
    from ..read.ledger import Ledger

MAGIC = 0x4B5643424F415244  # "KVCBOARD"
VERSION = 1
# magic, version, buckets, workers, the report asked for (Board.ask), and the one of those that
# asks for every connection's state too (CLIENT LIST, CLIENT INFO)
HEADER_WORDS = 6
BUCKET_WORDS = 2  # local_until_ns, max_age_ns
# What a worker writes back, in order (each a count since it started, but `pid`, `clients`
# and `written_ns`, the wall-clock time of its last write)
WORKER_FIELDS = ("pid", "written_ns", "answered", "commands", "gets_local", "gets_notfound", "clients",
                 "connections_received", "rejected_connections", "protocol_errors", "clients_cut_off",
                 "reads_gathered")
# the fields that count since the worker started (summed over workers, kept when one is
# replaced); the others say where it is now
WORKER_COUNTS = tuple(f for f in WORKER_FIELDS if f not in ("pid", "written_ns", "answered", "clients"))
# then per bucket: GETs it answered found, and not found


def board_path(data_dir: str) -> str:
    return os.path.join(data_dir, "workers.board")


def conns_path(data_dir: str, worker: int) -> str:
    """Where worker `worker` writes its connections' state when asked: a line per connection,
    `<id in the feed's process> <last I/O, monotonic ns> <last command>`."""
    return os.path.join(data_dir, f"workers.{worker}.conns")


class Board:
    """The mapped file, by words (`memoryview.cast("q")`: each item read or written is one
    aligned 64-bit load or store, never torn)."""

    def __init__(self, path: str, buckets: Sequence[str], workers: int, create: bool) -> None:
        self.path = path
        self.buckets = list(buckets)
        self.index = {name: i for i, name in enumerate(self.buckets)}
        self.workers = workers
        self.worker_words = len(WORKER_FIELDS) + 2 * len(self.buckets)
        words = HEADER_WORDS + BUCKET_WORDS * len(self.buckets) + self.worker_words * workers
        size = words * 8
        if create:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.ftruncate(fd, size)
        else:
            fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.words = memoryview(self._map).cast("q")
        if create:
            self.words[1], self.words[2], self.words[3] = VERSION, len(self.buckets), workers
            self.words[0] = MAGIC
        elif (self.words[0], self.words[1], self.words[2], self.words[3]) != (
                MAGIC, VERSION, len(self.buckets), workers):
            raise ValueError(f"{path} is not this sidecar's board")

    def _bucket_word(self, bucket: str) -> int:
        return HEADER_WORDS + BUCKET_WORDS * self.index[bucket]

    def _worker_word(self, worker: int) -> int:
        return HEADER_WORDS + BUCKET_WORDS * len(self.buckets) + self.worker_words * worker

    # ------------------------------------------------------------ the feed's process writes

    def publish(self, bucket: str, local_until_ns: int, max_age_ns: int) -> None:
        at = self._bucket_word(bucket)
        self.words[at + 1] = max_age_ns
        self.words[at] = local_until_ns

    def clear_worker(self, worker: int) -> None:
        at = self._worker_word(worker)
        for i in range(self.worker_words):
            self.words[at + i] = 0

    def worker(self, worker: int) -> dict[str, int]:
        """A worker's counters as it last wrote them (WORKER_FIELDS)."""
        at = self._worker_word(worker)
        return {name: self.words[at + i] for i, name in enumerate(WORKER_FIELDS)}

    def worker_reads(self, worker: int) -> dict[str, tuple[int, int]]:
        """A worker's GETs per bucket, (found, not found)."""
        at = self._worker_word(worker) + len(WORKER_FIELDS)
        return {name: (self.words[at + 2 * i], self.words[at + 2 * i + 1]) for i, name in enumerate(self.buckets)}

    def ask(self, connections: bool = False) -> int:
        """Ask for a report now (the workers are then signalled): the number each answers with.
        `connections`: each also writes its connections' state (conns_path)."""
        want = self.words[4] + 1
        if connections:
            self.words[5] = want
        self.words[4] = want
        return want

    def connections_asked(self) -> bool:
        """Does the report asked for now include the connections (read by a worker)?"""
        return self.words[5] == self.words[4]

    def answered(self, worker: int) -> int:
        return self.words[self._worker_word(worker) + 2]

    # ------------------------------------------------------------ a worker reads and writes

    def witness(self, bucket: str) -> BoardWitness:
        return BoardWitness(self, self._bucket_word(bucket))

    def report(self, worker: int, counts: dict[str, int], reads: dict[str, tuple[int, int]] | None = None) -> None:
        at = self._worker_word(worker)
        asked = self.words[4]
        for i, name in enumerate(WORKER_FIELDS):
            if name in counts:
                self.words[at + i] = counts[name]
        for bucket, (found, absent) in (reads or {}).items():
            if bucket in self.index:
                slot = at + len(WORKER_FIELDS) + 2 * self.index[bucket]
                self.words[slot], self.words[slot + 1] = found, absent
        self.words[at + 1] = time.time_ns()
        self.words[at + 2] = asked  # last: what was asked before these counts were written

    def close(self) -> None:
        self.words.release()
        self._map.close()


class BoardWitness:
    """One bucket's replica as a worker's GET path takes its word (the `witness` of its plans,
    kvcache.serve.server_get): the deadline its feed's process published."""

    __slots__ = ("_at", "_words", "address", "cache")

    def __init__(self, board: Board, at: int) -> None:
        self._words = board.words
        self._at = at
        self.cache = None  # a worker has no near cache: those keys go to the feed's process
        # where its two words are in this process's memory: the native GET path reads the
        # deadline there itself, each batch, with no call into Python (ext/server_get.pyx);
        # valid while the board is mapped, which is the worker's whole life
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(board._map, at * 8))

    @property
    def max_age_ns(self) -> int:
        return self._words[self._at + 1]

    def fresh_for_all(self, max_stale_ms: int) -> bool:
        """The rule for every key at once, as the feed's process last published it for the
        bucket's own bound (the only one the GET path asks with)."""
        return time.time_ns() <= self._words[self._at]


class BoardPublisher:
    """The feed's process's side: each bucket's verdict for every key at once (the witness's
    fresh_for_all at the bucket's bound), published as a deadline. `publish(bucket)` is what
    a feed calls after every change of it (Feed.on_state); `held()` what the ledger calls as a
    hold is placed (Ledger.on_hold), before the answer that placed it goes out, so that no
    worker answers that key from the replica after a client saw the newer revision."""

    def __init__(self, board: Board, feeds: Mapping[str, Feed], ledger: Ledger,
                 forget_fresh: Callable[[], None]) -> None:
        self.board = board
        self.feeds = feeds
        self.ledger = ledger
        self.forget_fresh = forget_fresh  # this process's own GET path's cached verdicts

    def publish(self, bucket: str) -> None:
        feed = self.feeds.get(bucket)
        if feed is None:  # (still starting: published once it is in, and before any worker)
            return
        holds = self.ledger.holds.get(bucket)
        meta = feed.meta
        if not meta.synced or (holds is not None and holds.held_until(None, None, meta)):
            until = 0
        else:
            until = feed.freshness.fresh_until_ns(feed.cfg.max_stale_ms, meta.applied_seq)
        self.board.publish(bucket, until, feed.max_age_ns)

    def publish_all(self) -> None:
        for bucket in self.feeds:
            self.publish(bucket)

    def held(self) -> None:
        """A key became held: no verdict believed before it may answer it, here or in a worker."""
        self.forget_fresh()
        self.publish_all()
