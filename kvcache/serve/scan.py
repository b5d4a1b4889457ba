"""SCAN's cursors: a number handed to the client for where a listing stopped.

A cursor maps to (bucket, last LMDB key listed); the next SCAN resumes after that key, so a
listing survives writes in between (keys added behind the cursor are not seen, as with
Redis's guarantees for keys not present for the whole scan). Kept, not consumed: a client that
lost a reply may send the same cursor again. Bounded: the oldest cursors are forgotten.
"""
from __future__ import annotations

from collections import OrderedDict

SCAN_CURSORS = 10_000


class ScanCursors:
    """The cursors of one server, oldest first."""

    def __init__(self, limit: int = SCAN_CURSORS) -> None:
        self._cursors: OrderedDict[int, tuple[str, bytes]] = OrderedDict()
        self._next = 1
        self.limit = limit

    def save(self, bucket: str, last: bytes) -> int:
        cursor = self._next
        self._next += 1
        self._cursors[cursor] = (bucket, last)
        while len(self._cursors) > self.limit:
            self._cursors.popitem(last=False)
        return cursor

    def resume(self, cursor: int, bucket: str) -> bytes | None:
        """The key to list after, or None for an unknown cursor or another bucket's."""
        saved = self._cursors.get(cursor)
        if saved is None or saved[0] != bucket:
            return None
        self._cursors.move_to_end(cursor)
        return saved[1]
