"""Sampled access log of reads: the input of `kvcache hotkeys`.

Off by default (`access_log_rate = 0`). When on, a sampled share of reads is appended to
`<access_log_dir>/access.log` as one tab-separated line each, rotated by size like
logging's RotatingFileHandler (`access.log.1` is the newest rotated file). Writes are
buffered and flushed within a second, so the cost on the read path is a countdown and, for
a sampled read, one formatted line in memory.

Line format (FIELDS, tab-separated, no header):
    ts_ms  bucket  key  source  hit  latency_us  command  rate
`source` is `local`, the peer that answered (router label), `leader`, or `remote` when a
remote read found nothing and no peer is named; `hit` is 1 when a value was returned; `rate`
is the sampling rate the line was taken at, so readers can weigh lines from sidecars with
different rates (an estimate of real reads is the sum of 1/rate).

`latency_us` is the time the key's own read took, so that `kvcache hotkeys`' latency by
source compares like with like: for GET (and the other one-key commands) from the command's
start to the answer; for each key of an MGET or EXISTS, the key's own lookup when the replica
or the near cache answers it, and, when it waits for the replica or asks NATS, from the start
of that wait or request to the answer (the keys answered by one NATS batch each show the
batch's time). Never the time the command spent on the keys before it: the 1,000th key of an
MGET is not charged for the 999 read first. kvcache.read.reads measures it.
"""
from __future__ import annotations

import asyncio
import atexit
import math
import os
import random
import time
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import Config

FIELDS = ("ts_ms", "bucket", "key", "source", "hit", "latency_us", "command", "rate")
FILE_NAME = "access.log"
FLUSH_S = 1.0
BUFFER = 64 * 1024
_CLEAN = str.maketrans({"\t": " ", "\n": " ", "\r": " "})


class AccessLog:
    """Sampled, rotating, buffered writer of read records. `enabled` is False at rate 0, and
    then `sampled()` is always False and nothing is ever opened."""

    def __init__(self, directory: str, rate: float, max_bytes: int = 64 << 20, files: int = 10,
                 seed: int | None = None) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"access log rate must be within 0..1, got {rate}")
        self.directory = directory
        self.rate = rate
        self.enabled = rate > 0.0
        self.max_bytes = max_bytes
        self.files = files
        self.path = os.path.join(directory, FILE_NAME)
        self.records = 0
        self._rng = random.Random(seed)
        self._log_q = math.log1p(-rate) if 0.0 < rate < 1.0 else 0.0
        self._skip = self._next_skip()
        self._file: IO[str] | None = None
        self._size = 0
        self._last_flush = time.monotonic()
        self._flush_scheduled = False
        self._rate_text = f"{rate:g}"
        if self.enabled:
            os.makedirs(directory, exist_ok=True)
            atexit.register(self.close)

    @classmethod
    def from_config(cls, cfg: Config) -> AccessLog:
        """The sidecar's log from its Config (`access_log_*` settings)."""
        directory = cfg.access_log_dir or os.path.join(cfg.data_dir, "access-logs")
        return cls(directory, cfg.access_log_rate, cfg.access_log_max_bytes, cfg.access_log_files)

    # ------------------------------------------------------------------ sampling

    def _next_skip(self) -> int:
        """Reads to let pass before the next sampled one: geometric gaps give each read an
        independent chance `rate` while the hot path only decrements a counter."""
        if not self.enabled:
            return -1
        if self.rate >= 1.0:
            return 0
        u = 1.0 - self._rng.random()  # (0, 1]
        return int(math.log(u) / self._log_q)

    def sampled(self) -> bool:
        """Should this read be recorded? Call once per read, then `record` only if True."""
        skip = self._skip
        if skip > 0:
            self._skip = skip - 1
            return False
        if skip < 0:
            return False
        self._skip = self._next_skip()
        return True

    # ------------------------------------------------------------------ writing

    def record(self, bucket: str, key: str, source: str, hit: bool, latency_us: int,
               command: str = "GET") -> None:
        """Append one sampled read (call after `sampled()` returned True); `latency_us` is the
        key's own read time, not its command's (see the module's docstring)."""
        line = (f"{int(time.time() * 1000)}\t{bucket}\t{key}\t{source.translate(_CLEAN)}\t"
                f"{1 if hit else 0}\t{int(latency_us)}\t{command}\t{self._rate_text}\n")
        f = self._file
        if f is None:
            f = self._open()
        f.write(line)
        self._size += len(line)
        self.records += 1
        if self._size >= self.max_bytes:
            self._rotate()
        elif not self._flush_scheduled:
            self._schedule_flush()

    def _open(self) -> IO[str]:
        self._file = open(self.path, "a", buffering=BUFFER, encoding="utf-8")
        self._size = self._file.tell()
        return self._file

    def _rotate(self) -> None:
        """access.log -> access.log.1 -> ... -> access.log.<files>, dropping the oldest."""
        self.close()
        for i in range(self.files - 1, 0, -1):
            src = f"{self.path}.{i}"
            if os.path.exists(src):
                os.replace(src, f"{self.path}.{i + 1}")
        if self.files > 0:
            os.replace(self.path, f"{self.path}.1")
        else:
            os.unlink(self.path)
        self._size = 0

    def _schedule_flush(self) -> None:
        """Lines reach the file within FLUSH_S even when reads stop: a timer on the running
        loop, or (no loop) a flush on the next record after FLUSH_S."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            if time.monotonic() - self._last_flush >= FLUSH_S:
                self.flush()
            return
        self._flush_scheduled = True
        loop.call_later(FLUSH_S, self.flush)

    def flush(self) -> None:
        self._flush_scheduled = False
        self._last_flush = time.monotonic()
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
