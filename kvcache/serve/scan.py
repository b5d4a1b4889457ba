"""The keyspace as KEYS, SCAN and DBSIZE list it, and SCAN's cursors.

The command table parses the arguments and encodes the replies; the walk of the replica lives
here, so the rules of a listing are in one place: a pattern names a bucket (`bucket:glob`, else
the default bucket), only live keys are listed, and reserved keys are left out (reading one is
an error, so a listing that showed it would promise a key no read can return).

A cursor is a number handed to the client for where a listing stopped. It maps to (bucket,
last LMDB key listed); the next SCAN resumes after that key, so a listing survives writes in
between (keys added behind the cursor are not seen, as with Redis's guarantees for keys not
present for the whole scan). Kept, not consumed: a client that lost a reply may send the same
cursor again. Bounded: the oldest cursors are forgotten.
"""
from __future__ import annotations

from collections import OrderedDict

from ..config import Config
from ..errors import CommandError
from ..keys import glob_matcher, reserved_key
from ..store.replica import Replica

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


class KeyListing:
    """KEYS, SCAN and DBSIZE's reads of the replica. Keys come back as the client names them
    (`bucket:key` when the pattern named the bucket), as bytes ready to encode."""

    def __init__(self, cfg: Config, replica: Replica, cursors: ScanCursors | None = None) -> None:
        self.cfg = cfg
        self.replica = replica
        self.cursors = cursors if cursors is not None else ScanCursors()

    def target(self, pattern: bytes) -> tuple[str, str, str]:
        """(bucket, key glob, prefix to show): `bucket:glob` lists another bucket."""
        text = pattern.decode(errors="replace")
        bucket, sep, glob = text.partition(":")
        if sep and self.cfg.bucket(bucket):
            return bucket, glob, bucket + ":"
        if not self.cfg.default_bucket:
            raise CommandError("ERR no bucket configured")
        return self.cfg.default_bucket, text, ""

    def keys(self, pattern: bytes) -> list[bytes]:
        """KEYS: every live key matching `pattern`, in one read transaction."""
        bucket, glob, shown = self.target(pattern)
        match = glob_matcher(glob)
        return [(shown + k).encode()
                for _, k in self.replica.iter_keys(bucket, live=True) if match(k) and not reserved_key(k)]

    def page(self, pattern: bytes, cursor: int, count: int) -> tuple[int, list[bytes]]:
        """SCAN: (next cursor, 0 when the listing is done; the keys matching `pattern` among the
        next `count` after `cursor`'s place). `count` bounds the keys walked, not the keys
        returned, so a page costs the same whatever the pattern matches."""
        bucket, glob, shown = self.target(pattern)
        after = None
        if cursor:
            # Kept, not consumed: a client that lost a reply may send the same cursor again.
            after = self.cursors.resume(cursor, bucket)
            if after is None:
                raise CommandError("ERR invalid cursor")
        match = glob_matcher(glob)
        found: list[bytes] = []
        last = None
        n = 0
        for lkey, key in self.replica.iter_keys(bucket, after=after, limit=count, live=True):
            last = lkey
            n += 1
            if match(key) and not reserved_key(key):  # (a reserved key reads as an error)
                found.append((shown + key).encode())
        next_cursor = 0
        if n == count and last is not None:
            next_cursor = self.cursors.save(bucket, last)
        return next_cursor, found

    def count(self) -> int:
        """DBSIZE: the default bucket's entries (0 without a default bucket)."""
        b = self.cfg.default_bucket
        return self.replica.count(b) if b else 0
