"""Each bucket's changes as a Redis stream named `@<bucket>` (docs/commands.md, "Streams"):
XREAD (BLOCK included), XRANGE, XREVRANGE, XLEN, XINFO STREAM and TYPE, answered from the
replica's revision index (kvcache.store.revindex).

Why a stream: an application that follows a bucket (values, revisions, deletes, resuming
after a restart) would otherwise hold a NATS watch of its own, one consumer per process, and
re-read the bucket whenever it cannot resume. Here any number of local readers share the
bucket's one consumer, and resume from the last ID they read.

An entry is a key at its latest revision: ID `<revision>-0`, fields `key`, `value` (absent
for a delete or purge), `op` (PUT, DEL, PURGE) and `created` (ns since the epoch). Reading
after ID N gives every key whose latest change is above N, in revision order, each once:
what a NATS watch of a history-1 bucket resumed from sequence N delivers.

The rules every read follows, as GET's, are the read side's (kvcache.read.stream_rules: the
replica vouched for, never older than what this connection already read, no silent gap), on
the sidecar's one ledger of what was handed out (kvcache.read.ledger); this module reads the
index and encodes. A blocked XREAD waits on a future per reader (no task per key): the feed's every applied
  batch (ChangeHub.advanced) wakes the bucket's readers. What they read is mostly the same
  recent entries, encoded once in the bucket's tail (kvcache.serve.stream_tail) as the batch
  is applied. A resync, a lost consumer or a replica passing max_stale_ms
  (ChangeHub.flushed) ends their wait with an error instead.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING

from .. import resp
from ..config import BucketConfig, Config
from ..errors import CommandError, ReplyTooLarge
from ..read import stream_rules
from ..store import revindex
from . import stream_ids
from .arguments import integer, timeout_ms
from .stream_ids import U64, format_id
from .stream_tail import Tail

if TYPE_CHECKING:
    from ..feed.feed import Feed
    from ..read.ledger import Ledger
    from ..store.replica import Replica
    from .session import Session

STREAM_TYPE = resp.simple("stream")
NOT_A_STREAM = ("ERR '{key}' is not a stream: kvcache's streams are '@<bucket>', a bucket's "
                "changes (XREAD, XRANGE, XREVRANGE, XLEN, XINFO STREAM)")
# XINFO STREAM FULL's default number of entries, as Redis
XINFO_FULL_COUNT = 10
# A bucket's tail is kept while someone reads it: dropped at a batch when none has for this long
TAIL_IDLE_S = 10.0

# (key, bucket config, feed, revisions above which to read)
Want = tuple[bytes, BucketConfig, "Feed", int]


class Streams:
    """The `@<bucket>` streams of one sidecar: the command handlers' reading and waiting,
    and the blocked readers (a change hub listener for flushes, a follower for batches)."""

    def __init__(self, cfg: Config, replica: Replica, feeds: dict[str, Feed], ledger: Ledger,
                 on_first: Callable[[], None] = lambda: None) -> None:
        self.cfg = cfg
        self.replica = replica
        self.feeds = feeds
        self.ledger = ledger  # what each connection was handed (kvcache.read.ledger)
        self.on_first = on_first  # the first blocked reader: the hub's staleness watch starts
        # bucket -> the futures of its blocked readers (a dict: ordered, O(1) removal)
        self.waiting: dict[str, dict[asyncio.Future, None]] = {}
        self._ended: str | None = None  # end_all's reason: a read that would block ends at once
        # bucket -> the recent end of its stream, encoded once for every reader (stream_tail)
        self._tails: dict[str, Tail] = {}
        self.entries_sent = 0
        self.blocked = 0

    # ------------------------------------------------------------------ hub side

    @property
    def listening(self) -> bool:
        return False  # the batches themselves are what wakes readers (advanced)

    @property
    def wants_flushes(self) -> bool:
        return bool(self.waiting or self._tails)

    def changed(self, bucket: str, changes: list) -> None:
        pass

    def flushed(self, bucket: str, why: str) -> None:
        """The bucket's replica can no longer be vouched for (a full resync, a lost
        consumer, past max_stale_ms): its blocked readers end with an error."""
        self._tails.pop(bucket, None)
        self._wake(bucket, {"resync": "a full resync began", "consumer": "its consumer was lost",
                            "stale": "its replica passed max_stale_ms"}.get(why, why))

    def advanced(self, bucket: str) -> None:
        """A feed applied a batch of `bucket`: its tail takes the new entries (each encoded
        once, here), its blocked readers look again."""
        tail = self._tails.get(bucket)
        if tail is not None:
            if bucket not in self.waiting and time.monotonic() - tail.used > TAIL_IDLE_S:
                del self._tails[bucket]  # nobody follows it now: no encoding for nobody
            else:
                self._extend(bucket, tail)
        self._wake(bucket, None)

    def removed(self, bucket: str) -> None:
        """Entries left the bucket's index with no newer one: its tail cannot tell."""
        self._tails.pop(bucket, None)

    def _extend(self, bucket: str, tail: Tail) -> None:
        rdb = self.replica.revs_ro(bucket)
        if rdb is None:
            return
        with self.replica.env.begin(buffers=True) as txn:
            tail.extend(revindex.entries(txn, self.replica.db(bucket), rdb, tail.top + 1, U64, None, False,
                                         time.time_ns(), self.replica.max_age.get(bucket, 0)))

    def end_all(self, why: str) -> None:
        """Shutdown: every blocked read ends now with the documented error, so its follower
        knows to read again elsewhere, and the stop does not wait out the drain's grace for
        reads that would otherwise block for ever (`XREAD BLOCK 0`)."""
        self._ended = why
        for bucket in list(self.waiting):
            self._wake(bucket, why)

    def _wake(self, bucket: str, why: str | None) -> None:
        waiting = self.waiting.pop(bucket, None)
        if waiting:
            for fut in waiting:
                if not fut.done():
                    fut.set_result(why)

    def forget(self, conn: Session) -> None:
        self.ledger.forget(conn.id)

    # ------------------------------------------------------------------ addressing

    def stream_of(self, raw: bytes) -> tuple[BucketConfig, Feed]:
        """The bucket a stream key `@<bucket>` names; CommandError for anything else."""
        if raw[:1] != b"@":
            raise CommandError(NOT_A_STREAM.format(key=raw[:64].decode(errors="replace")))
        name = raw[1:].decode(errors="replace")
        bc = self.cfg.bucket(name)
        if bc is None:
            names = ", ".join("@" + b.name for b in self.cfg.buckets[:8])
            raise CommandError(f"ERR no such stream '@{name[:64]}': this sidecar replicates no bucket "
                               f"'{name[:64]}' (its streams: {names or 'none'})")
        if not bc.keys:
            raise CommandError(f"ERR bucket {name} replicates no keys here (its near cache only): "
                               "it has no stream")
        return bc, self.feeds[bc.name]

    def _vouch(self, conn: Session, bc: BucketConfig, feed: Feed) -> None:
        """May the bucket's index answer now? (kvcache.read.stream_rules.vouch)"""
        stream_rules.vouch(self.ledger, conn.id, bc, feed)

    def _exact_after(self, bc: BucketConfig, feed: Feed, after: int, given: bytes | None = None) -> None:
        """Can "what changed after `after`" be answered exactly? (stream_rules.exact_after)"""
        stream_rules.exact_after(bc, feed.meta.horizon, feed.meta.applied_seq, after, given)

    # ------------------------------------------------------------------ reading

    def _entries(self, bc: BucketConfig, first: int, last: int, count: int | None,
                 reverse: bool, budget: int | None) -> tuple[list[bytes], int]:
        """Encoded entries with revisions in [first, last] (at most `count`, and past `budget`
        bytes of values none more; None: no bound but max_reply_bytes, over which the read is
        refused), and the highest revision among them."""
        rdb = self.replica.revs_ro(bc.name)
        out: list[bytes] = []
        top = 0
        if rdb is None:
            return out, top
        db = self.replica.db(bc.name)
        limit = self.cfg.max_reply_bytes
        size = 0
        with self.replica.env.begin(buffers=True) as txn:
            for e in revindex.entries(txn, db, rdb, first, last, count, reverse, time.time_ns(),
                                      self.replica.max_age.get(bc.name, 0)):
                out.append(_encode(e))
                top = max(top, e.revision)
                size += len(e.key) + (len(e.value) if e.value is not None else 0)
                if budget is not None and size >= budget:
                    break
                if size > limit:
                    raise ReplyTooLarge(f"ERR reply too large: its entries exceed max_reply_bytes ({limit}); "
                                        "ask for fewer with COUNT")
        return out, top

    def _handed(self, conn: Session, bucket: str, n: int, top: int) -> None:
        """n entries, up to revision `top`, go to the connection: never older than these."""
        if n:
            self.ledger.stream_handed(conn.id, bucket, top)
            self.entries_sent += n

    def _read(self, conn: Session, wants: Sequence[Want], count: int | None) -> bytes | None:
        """XREAD's reply for what is there now, None when no stream has anything. From the
        bucket's tail when the ID falls in it; else from the index, and the tail starts."""
        proto = conn.proto
        budget = self.cfg.max_reply_bytes
        parts: list[bytes] = []
        for key, bc, feed, after in wants:
            got = None
            tail = self._tails.get(bc.name)
            if tail is not None and tail.covers(after):
                got = tail.answer(after, count, budget, time.time_ns())
                if got is None:  # an entry passed its deadline, or COUNT among blanks
                    del self._tails[bc.name]
                    tail = None
            if got is None:
                entries, top = self._entries(bc, after + 1, U64, count, False, budget)
                got = (resp.array(entries), len(entries), top)
                if tail is None:
                    self._tails[bc.name] = Tail(feed.meta.applied_seq, _encode)
            data, n, top = got
            if not n:
                continue
            self._handed(conn, bc.name, n, top)
            parts.append(resp.bulk(key, proto) + data)
        if not parts:
            return None
        if proto == 3:
            return b"%%%d\r\n%b" % (len(parts), b"".join(parts))
        return b"*%d\r\n%b" % (len(parts), b"".join(b"*2\r\n" + p for p in parts))

    # ------------------------------------------------------------------ commands

    def xread(self, conn: Session, args: list[bytes]) -> bytes | Coroutine[object, object, bytes]:
        count, block, keys, ids = _xread_args(args)
        wants: list[Want] = []
        for key, raw_id in zip(keys, ids, strict=True):
            bc, feed = self.stream_of(key)
            self._vouch(conn, bc, feed)
            if raw_id == b"$":
                after = feed.meta.applied_seq
            elif raw_id == b"+":
                after = max(0, self._last_revision(bc) - 1)
            elif raw_id == b">":
                raise CommandError("ERR The > ID can be specified only when calling XREADGROUP using the "
                                   "GROUP <group> <consumer> option.")
            else:
                after = stream_ids.after(raw_id)
                self._exact_after(bc, feed, after)
            wants.append((key, bc, feed, after))
        reply = self._read(conn, wants, count)
        if reply is not None:
            return reply
        if block is None or conn.in_exec:  # EXEC never blocks (Redis: CLIENT_DENY_BLOCKING)
            return resp.array(None, conn.proto)
        return self._blocked(conn, wants, count, block)

    async def _blocked(self, conn: Session, wants: list[Want], count: int | None, block_ms: int) -> bytes:
        loop = asyncio.get_running_loop()
        deadline = None if block_ms == 0 else loop.time() + block_ms / 1000
        buckets = {bc.name for _, bc, _, _ in wants}
        self.blocked += 1
        try:
            while True:
                if self._ended is not None:
                    raise _read_ended(buckets, self._ended)
                fut = loop.create_future()
                first = not self.waiting
                for b in buckets:
                    self.waiting.setdefault(b, {})[fut] = None
                if first:
                    self.on_first()
                try:
                    if deadline is None:
                        why = await fut
                    else:
                        why = await asyncio.wait_for(fut, max(0.0, deadline - loop.time()))
                except TimeoutError:
                    return resp.array(None, conn.proto)
                finally:
                    for b in buckets:
                        w = self.waiting.get(b)
                        if w is not None:
                            w.pop(fut, None)
                            if not w:
                                del self.waiting[b]
                if why is not None:
                    raise _read_ended(buckets, why)
                for _, bc, feed, _ in wants:
                    self._vouch(conn, bc, feed)
                reply = self._read(conn, wants, count)
                if reply is not None:
                    return reply
        finally:
            self.blocked -= 1

    def _range(self, conn: Session, args: list[bytes], reverse: bool) -> bytes:
        if len(args) not in (4, 6):  # (at least 4: the command table's arity)
            raise CommandError("ERR syntax error")
        bc, feed = self.stream_of(args[1])
        hi_raw, lo_raw = (args[2], args[3]) if reverse else (args[3], args[2])
        first, last = stream_ids.interval(lo_raw, hi_raw)
        count: int | None = None
        if len(args) == 6:
            if args[4].lower() != b"count":
                raise CommandError("ERR syntax error")
            count = integer(args[5])
            if count <= 0:
                return resp.array(None, conn.proto)
        self._vouch(conn, bc, feed)
        if first > 1:
            self._exact_after(bc, feed, first - 1, lo_raw)
        entries, top = self._entries(bc, first, last, count, reverse, None)
        self._handed(conn, bc.name, len(entries), top)
        return resp.array(entries)

    def xrange(self, conn: Session, args: list[bytes]) -> bytes:
        return self._range(conn, args, reverse=False)

    def xrevrange(self, conn: Session, args: list[bytes]) -> bytes:
        return self._range(conn, args, reverse=True)

    def xlen(self, conn: Session, args: list[bytes]) -> bytes:
        bc, feed = self.stream_of(args[1])
        self._vouch(conn, bc, feed)
        rdb = self.replica.revs_ro(bc.name)
        if rdb is None:
            return resp.integer(0)
        with self.replica.env.begin() as txn:
            return resp.integer(revindex.length(txn, rdb))

    def exists(self, raw: bytes) -> bool:
        """Does stream key `raw` name a stream here (what TYPE answers `stream` of)?"""
        try:
            self.stream_of(raw)
        except CommandError:
            return False
        return True

    def type(self, conn: Session, args: list[bytes]) -> bytes:
        self.stream_of(args[1])
        return STREAM_TYPE

    def xinfo(self, conn: Session, args: list[bytes]) -> bytes:
        """XINFO HELP, GROUPS, CONSUMERS and STREAM; each one's argument count is checked
        before it runs (the command table's subcommand arity)."""
        sub = args[1].lower()
        if sub == b"help":
            return resp.array([resp.simple(line) for line in XINFO_HELP])
        if sub == b"groups":
            self.stream_of(args[2])
            return resp.array([])
        if sub == b"consumers":
            self.stream_of(args[2])
            raise CommandError(f"NOGROUP No such consumer group '{args[3][:64].decode(errors='replace')}' for "
                               f"key name '{args[2][:64].decode(errors='replace')}'")
        if sub != b"stream":
            raise CommandError(f"ERR unknown subcommand or wrong number of arguments for "
                               f"'{args[1][:64].decode(errors='replace')}'. Try XINFO HELP.")
        full, count = _xinfo_full(args[3:])
        bc, feed = self.stream_of(args[2])
        self._vouch(conn, bc, feed)
        return self._info(conn, bc, feed, full, count)

    def _last_revision(self, bc: BucketConfig) -> int:
        rdb = self.replica.revs_ro(bc.name)
        if rdb is None:
            return 0
        with self.replica.env.begin() as txn:
            return revindex.bounds(txn, rdb)[1]

    def _info(self, conn: Session, bc: BucketConfig, feed: Feed, full: bool, count: int) -> bytes:
        proto = conn.proto
        rdb = self.replica.revs_ro(bc.name)
        length = leaf = branch = 0
        if rdb is not None:
            with self.replica.env.begin() as txn:
                st = txn.stat(rdb)
                length, leaf, branch = st["entries"], st["leaf_pages"], st["branch_pages"]
        removed = self.replica.max_removed(bc.name)
        first, lo = self._entries(bc, 0, U64, 1, False, None)
        last, _ = self._entries(bc, 0, U64, 1, True, None)
        head = [
            (b"length", resp.integer(length)),
            # the index's LMDB pages stand where Redis counts its radix tree's
            (b"radix-tree-keys", resp.integer(leaf)),
            (b"radix-tree-nodes", resp.integer(leaf + branch)),
            (b"last-generated-id", resp.bulk(format_id(feed.meta.applied_seq))),
            (b"max-deleted-entry-id", resp.bulk(format_id(removed))),
            (b"entries-added", resp.integer(feed.meta.applied_seq)),
            (b"recorded-first-entry-id", resp.bulk(format_id(lo))),
        ]
        if full:
            entries, _ = self._entries(bc, 0, U64, count or None, False, None)
            pairs = [*head, (b"entries", resp.array(entries)), (b"groups", resp.array([]))]
        else:
            pairs = [*head, (b"groups", resp.integer(0)),
                     (b"first-entry", first[0] if first else resp.null(proto)),
                     (b"last-entry", last[0] if last else resp.null(proto))]
        pairs += [(b"nats-first-seq", resp.integer(feed.first_seq)),
                  (b"exact-after", resp.bulk(format_id(feed.meta.horizon)))]
        return resp.map_([(resp.bulk(k), v) for k, v in pairs], proto)


XINFO_HELP = (
    "XINFO <subcommand> [<arg> [value] [opt] ...]. Subcommands are:",
    "CONSUMERS <key> <groupname>",
    "    Show consumers of <groupname> (a bucket's stream has no groups).",
    "GROUPS <key>",
    "    Show the stream consumer groups (none).",
    "STREAM <key> [FULL [COUNT <count>]",
    "    Show information about the stream.",
    "HELP",
    "    Print this help.",
)


def _encode(e: revindex.StreamEntry) -> bytes:
    """One entry: `[ID, [key, k, value, v, op, OP, created, ns]]` (no value for a delete)."""
    fields: list = [b"key", e.key]
    if e.value is not None:
        fields += [b"value", e.value]
    fields += [b"op", e.op.encode(), b"created", b"%d" % e.created]
    return b"*2\r\n" + resp.bulk(format_id(e.revision)) + resp.bulk_array(fields)


def _xread_args(args: list[bytes]) -> tuple[int | None, int | None, list[bytes], list[bytes]]:
    """XREAD [COUNT n] [BLOCK ms] STREAMS key... id...: Redis's checks and wording."""
    count: int | None = None
    block: int | None = None
    i = 1
    while i < len(args):
        opt = args[i].lower()
        if opt == b"count" and i + 1 < len(args):
            count = integer(args[i + 1])
            count = count if count > 0 else None
            i += 2
        elif opt == b"block" and i + 1 < len(args):
            block = timeout_ms(args[i + 1])
            i += 2
        elif opt == b"streams":
            rest = args[i + 1:]
            if not rest or len(rest) % 2:
                raise CommandError("ERR Unbalanced 'xread' list of streams: for each stream key an ID or "
                                   "'$' must be specified.")
            half = len(rest) // 2
            return count, block, rest[:half], rest[half:]
        else:
            raise CommandError("ERR syntax error")
    raise CommandError("ERR syntax error")


def _xinfo_full(rest: list[bytes]) -> tuple[bool, int]:
    if not rest:
        return False, 0
    if rest[0].lower() != b"full" or len(rest) not in (1, 3):
        raise CommandError("ERR syntax error")
    count = XINFO_FULL_COUNT
    if len(rest) == 3:
        if rest[1].lower() != b"count":
            raise CommandError("ERR syntax error")
        count = max(0, integer(rest[2]))
    return True, count


def _read_ended(buckets: set[str], why: str) -> CommandError:
    """The documented end of a blocked read (docs/commands.md): the follower reads again
    from the last ID it has, here or elsewhere."""
    return CommandError(f"ERR stream read ended: bucket {'/'.join(sorted(buckets))}: {why}; "
                        "read again from the last ID you have")
