"""How often keys are read, approximately, in bounded memory: the frequency sketch the near
cache admits by (TinyLFU, as Caffeine and Ristretto do).

A count-min sketch of 4 rows of small counters (saturating at 15, as Caffeine's 4-bit ones),
`width` a power of two of about 8 counters per key the cache holds. As in Caffeine, a key's 4
counters lie in one 64-byte block (one cache line: 16 counters of each row), chosen by the
key's hash, so counting a read costs one memory miss, not four. Every `sample` increments,
all counters are halved, so the sketch follows what is hot now rather than what was once.
Memory is fixed at construction: a scan of a million distinct keys moves counters, never grows
anything.

A near cache's sketch belongs to its hit counter (kvcache.store.near_hits), which alone adds
to it. The counter's native twin adds the GET path's hits to the same counters in C
(ext/near_hits.pyx, `_sketch_add`: the same slots from the key's hash, so the two agree
counter for counter: tests/test_nearcache_hits.py) and tells how many it added when it hands
them over (`note`). So the counters are one bytearray for the life of the sketch: aging
halves them in place.
"""
from __future__ import annotations

ROWS = 4
MAX_COUNT = 15
_HALF = bytes(i >> 1 for i in range(256))
_SEEDS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x27D4EB2F165667C5)
_BLOCK_SEED = 0xD6E8FEB86659FD93
_MASK64 = (1 << 64) - 1
BLOCK = 64  # counters in a block: ROWS rows of BLOCK // ROWS


class FrequencySketch:
    """Estimated read counts of keys (bytes), within a factor the width bounds."""

    __slots__ = ("_counts", "_shift", "additions", "sample", "width")

    def __init__(self, capacity: int) -> None:
        width = 16
        while width < 8 * max(1, capacity):
            width <<= 1
        self.width = width
        self._counts = bytearray(ROWS * width)
        self._shift = (ROWS * width // BLOCK).bit_length() - 1  # log2 of the number of blocks
        self.sample = 10 * max(1, capacity)
        self.additions = 0

    def _slots(self, key: bytes) -> list[int]:
        h = hash(key) & _MASK64
        block = ((h * _BLOCK_SEED) & _MASK64) >> (64 - self._shift) if self._shift else 0
        return [block * BLOCK + row * (BLOCK // ROWS) + (((h * seed) & _MASK64) >> 60)
                for row, seed in enumerate(_SEEDS)]

    def increment(self, key: bytes) -> None:
        self.add_counts(key)
        self.note(1)

    def add_counts(self, key: bytes) -> int:
        """One read of the key into its counters, not yet into `additions` (`note`); the
        key's estimate after it."""
        counts = self._counts
        low = MAX_COUNT
        for i in self._slots(key):
            c = counts[i]
            if c < MAX_COUNT:
                c += 1
                counts[i] = c
            low = min(low, c)
        return low

    def note(self, n: int) -> None:
        """n reads added to the counters (add_counts, or the hit counter's native twin): every
        `sample` of them, all counters are halved."""
        self.additions += n
        if self.additions >= self.sample:
            self._age()

    def estimate(self, key: bytes) -> int:
        counts = self._counts
        return min(counts[i] for i in self._slots(key))

    def _age(self) -> None:
        """Halve every counter (a C-speed translate), in place: old popularity fades."""
        self._counts[:] = bytes(self._counts).translate(_HALF)
        self.additions //= 2

    @property
    def counts(self) -> bytearray:
        """The counters (ROWS rows of `width`), for the hit counter's native twin to add to."""
        return self._counts

    @property
    def shift(self) -> int:
        """log2 of the number of blocks (the block is the hash's top `shift` bits)."""
        return self._shift

    @property
    def nbytes(self) -> int:
        return len(self._counts)
