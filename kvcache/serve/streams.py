"""Each bucket's changes as a Redis stream named `@<bucket>` (docs/commands.md, "Streams"):
XREAD (BLOCK included), XRANGE, XREVRANGE, XLEN, XINFO STREAM and TYPE, answered from the
replica's revision index (kvcache.store.revindex).

A stream may follow part of a bucket, as a NATS watch of a filter does: `@<bucket>:<filter>`
(`@demo:feature.*`, `@demo:feature.>`; ':' is in no bucket name and no key) holds the entries
of the keys the filter matches, read from the same index under the same rules, its IDs the
bucket's revisions (sparse, as a filtered watch's sequences), so an ID it handed out resumes
it. The filter must lie within what the sidecar replicates of the bucket (its `keys`): a
stream reaching past them would silently miss keys, so it is refused, naming them.

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
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import resp
from ..config import BucketConfig, Config
from ..errors import CommandError, ReplyTooLarge
from ..keys import KEY_TOKEN_RE, FilterSet, filter_within, valid_filter
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
                "changes, and '@<bucket>:<filter>', those of its keys under a filter (XREAD, XRANGE, "
                "XREVRANGE, XLEN, XINFO STREAM)")
INVALID_FILTER = ("ERR invalid key filter '{filter}' in stream '{key}': {problem}; a filter is tokens of "
                  "letters, digits, '-', '/', '_' and '=' joined by single dots, '*' for any one token, "
                  "'>' (last) for one or more")
NOT_WITHIN = ("ERR stream '{key}' would miss keys: bucket {bucket} replicates only the keys {filters} "
              "here, and '{filter}' reaches outside them; follow a filter within them")
# streams and compiled filters kept (their key -> Stream, bucket and filter -> match): a
# follower names its stream at every read
FILTERS_KEPT = 1024
# XINFO STREAM FULL's default number of entries, as Redis
XINFO_FULL_COUNT = 10
# A bucket's tail is kept while someone reads it: dropped at a batch when none has for this long
TAIL_IDLE_S = 10.0


@dataclass(frozen=True, slots=True)
class Stream:
    """What a stream key names: a bucket's changes, all of them (`@b`, `filter` None), or
    those of the keys a filter matches (`@b:feature.*`, its `match` asked of a key's bytes)."""

    bucket: str
    bc: BucketConfig
    feed: Feed
    filter: str | None = None
    match: Callable[[bytes], bool] | None = None


# (key as named, its stream, revisions above which to read)
Want = tuple[bytes, Stream, int]


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
        # bucket -> filter (None: the whole bucket) -> the recent end of that stream, encoded
        # once for every reader (stream_tail)
        self._tails: dict[str, dict[str | None, Tail]] = {}
        # (bucket, filter) -> its blocked readers: a tail is kept for them however idle
        self._following: dict[tuple[str, str | None], int] = {}
        # stream key as named -> its Stream (at most FILTERS_KEPT)
        self._streams: dict[bytes, Stream] = {}
        # (bucket, filter text) -> (the bucket's `keys` it was checked against, its match)
        self._filters: dict[tuple[str, str], tuple[tuple[str, ...], Callable[[bytes], bool] | None]] = {}
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
        """A feed applied a batch of `bucket`: its tails (the whole bucket's, each filter's)
        take the new entries (each encoded once, here), its blocked readers look again."""
        tails = self._tails.get(bucket)
        if tails:
            now = time.monotonic()
            for flt, tail in list(tails.items()):
                if not self._following.get((bucket, flt)) and now - tail.used > TAIL_IDLE_S:
                    del tails[flt]  # nobody follows it now: no encoding for nobody
            if tails:
                self._extend(bucket, list(tails.values()))
            else:
                del self._tails[bucket]
        self._wake(bucket, None)

    def removed(self, bucket: str) -> None:
        """Entries left the bucket's index with no newer one: its tail cannot tell."""
        self._tails.pop(bucket, None)

    def _extend(self, bucket: str, tails: list[Tail]) -> None:
        """Each tail takes the index's entries above its top (a filtered one, those its
        filter matches), up to the index's last revision, in one transaction."""
        rdb = self.replica.revs_ro(bucket)
        if rdb is None:
            return
        db, now, max_age = self.replica.db(bucket), time.time_ns(), self.replica.max_age.get(bucket, 0)
        with self.replica.env.begin(buffers=True) as txn:
            upto = revindex.bounds(txn, rdb)[1]
            for tail in tails:
                tail.extend(revindex.entries(txn, db, rdb, tail.top + 1, upto, None, False, now, max_age,
                                             tail.match), upto)

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

    def stream_of(self, raw: bytes) -> Stream:
        """The stream a key names, `@<bucket>` or `@<bucket>:<filter>`; CommandError for
        anything else, an invalid filter, or one reaching past what the bucket replicates."""
        known = self._streams.get(raw)
        if known is not None:  # a follower names its stream at every read: resolved once
            return known
        if raw[:1] != b"@":
            raise CommandError(NOT_A_STREAM.format(key=raw[:64].decode(errors="replace")))
        key = raw[:128].decode(errors="replace")
        name, colon, text = raw[1:].decode(errors="replace").partition(":")
        bc = self.cfg.bucket(name)
        if bc is None:
            names = ", ".join("@" + b.name for b in self.cfg.buckets[:8])
            raise CommandError(f"ERR no such stream '{key[:65]}': this sidecar replicates no bucket "
                               f"'{name[:64]}' (its streams: {names or 'none'})")
        if not bc.keys:
            raise CommandError(f"ERR bucket {name} replicates no keys here (its near cache only): "
                               "it has no stream")
        feed = self.feeds[bc.name]
        match = self._key_filter(bc, key, text) if colon else None
        stream = Stream(bc.name, bc, feed) if match is None else Stream(bc.name, bc, feed, text, match)
        if len(self._streams) >= FILTERS_KEPT:
            self._streams.clear()
        self._streams[raw] = stream  # (the configuration and the feeds are fixed once serving)
        return stream

    def _key_filter(self, bc: BucketConfig, key: str, text: str) -> Callable[[bytes], bool] | None:
        """The match of stream `key`'s filter `text` (None: it is `>`, the whole bucket),
        checked once per bucket and filter: a key filter, within the bucket's `keys`."""
        known = self._filters.get((bc.name, text))
        if known is not None and known[0] == tuple(bc.keys):
            return known[1]
        problem = _filter_problem(text)
        if problem is not None:
            raise CommandError(INVALID_FILTER.format(filter=text[:64], key=key, problem=problem))
        if not filter_within(text, bc.keys):
            shown = ", ".join(bc.keys[:8]) + (f" (and {len(bc.keys) - 8} more)" if len(bc.keys) > 8 else "")
            raise CommandError(NOT_WITHIN.format(key=key, bucket=bc.name, filters=shown, filter=text))
        match = None if text == ">" else _matcher(text)
        if len(self._filters) >= FILTERS_KEPT:
            self._filters.clear()
        self._filters[(bc.name, text)] = (tuple(bc.keys), match)
        return match

    def _vouch(self, conn: Session, s: Stream) -> None:
        """May the bucket's index answer now? (kvcache.read.stream_rules.vouch)"""
        stream_rules.vouch(self.ledger, conn.id, s.bc, s.feed)

    def _exact_after(self, s: Stream, after: int, given: bytes | None = None) -> None:
        """Can "what changed after `after`" be answered exactly? (stream_rules.exact_after;
        a filtered stream's IDs are the bucket's revisions: the same rule)"""
        stream_rules.exact_after(s.bc, s.feed.meta.horizon, s.feed.meta.applied_seq, after, given)

    # ------------------------------------------------------------------ reading

    def _entries(self, s: Stream, first: int, last: int, count: int | None,
                 reverse: bool, budget: int | None) -> tuple[list[bytes], int, int]:
        """The stream's encoded entries with revisions in [first, last] (at most `count`, and
        past `budget` bytes of values none more; None: no bound but max_reply_bytes, over
        which the read is refused), the highest revision among them, and, when there is none,
        the index's last revision: no entry of the stream lies in [first, that] either."""
        rdb = self.replica.revs_ro(s.bucket)
        out: list[bytes] = []
        top = 0
        if rdb is None:
            return out, top, 0
        db = self.replica.db(s.bucket)
        limit = self.cfg.max_reply_bytes
        size = 0
        with self.replica.env.begin(buffers=True) as txn:
            for e in revindex.entries(txn, db, rdb, first, last, count, reverse, time.time_ns(),
                                      self.replica.max_age.get(s.bucket, 0), s.match):
                out.append(_encode(e))
                top = max(top, e.revision)
                size += len(e.key) + (len(e.value) if e.value is not None else 0)
                if budget is not None and size >= budget:
                    break
                if size > limit:
                    raise ReplyTooLarge(f"ERR reply too large: its entries exceed max_reply_bytes ({limit}); "
                                        "ask for fewer with COUNT")
            seen = top if out else revindex.bounds(txn, rdb)[1]
        return out, top, seen

    def _handed(self, conn: Session, bucket: str, n: int, top: int) -> None:
        """n entries, up to revision `top`, go to the connection: never older than these."""
        if n:
            self.ledger.stream_handed(conn.id, bucket, top)
            self.entries_sent += n

    def _read(self, conn: Session, wants: Sequence[Want], count: int | None) -> tuple[bytes | None, list[Want]]:
        """XREAD's reply for what is there now, None when no stream has anything; and the
        wants to look at next: a stream with nothing after its ID had nothing up to the last
        revision looked at, so a blocked reader's next look starts there (a filter matching
        few keys is not walked again from the ID at every batch). From the stream's tail when
        the ID falls in it; else from the index, and the tail starts."""
        proto = conn.proto
        budget = self.cfg.max_reply_bytes
        parts: list[bytes] = []
        nexts: list[Want] = []
        for key, s, after in wants:
            got = None
            tails = self._tails.get(s.bucket)
            tail = tails.get(s.filter) if tails else None
            if tail is not None and tail.covers(after):
                got = tail.answer(after, count, budget, time.time_ns())
                seen = tail.top
                if got is None:  # an entry passed its deadline, or COUNT among blanks
                    del self._tails[s.bucket][s.filter]
                    tail = None
            if got is None:
                entries, top, seen = self._entries(s, after + 1, U64, count, False, budget)
                got = (resp.array(entries), len(entries), top)
                if tail is None:
                    self._tails.setdefault(s.bucket, {})[s.filter] = Tail(s.feed.meta.applied_seq, _encode,
                                                                           s.match)
            data, n, top = got
            if not n:
                nexts.append((key, s, max(after, seen)))
                continue
            nexts.append((key, s, after))
            self._handed(conn, s.bucket, n, top)
            parts.append(resp.bulk(key, proto) + data)
        if not parts:
            return None, nexts
        if proto == 3:
            return b"%%%d\r\n%b" % (len(parts), b"".join(parts)), nexts
        return b"*%d\r\n%b" % (len(parts), b"".join(b"*2\r\n" + p for p in parts)), nexts

    # ------------------------------------------------------------------ commands

    def xread(self, conn: Session, args: list[bytes]) -> bytes | Coroutine[object, object, bytes]:
        count, block, keys, ids = _xread_args(args)
        wants: list[Want] = []
        for key, raw_id in zip(keys, ids, strict=True):
            s = self.stream_of(key)
            self._vouch(conn, s)
            if raw_id == b"$":
                after = s.feed.meta.applied_seq
            elif raw_id == b"+":
                after = max(0, self._last_revision(s) - 1)
            elif raw_id == b">":
                raise CommandError("ERR The > ID can be specified only when calling XREADGROUP using the "
                                   "GROUP <group> <consumer> option.")
            else:
                after = stream_ids.after(raw_id)
                self._exact_after(s, after)
            wants.append((key, s, after))
        reply, wants = self._read(conn, wants, count)
        if reply is not None:
            return reply
        if block is None or conn.in_exec:  # EXEC never blocks (Redis: CLIENT_DENY_BLOCKING)
            return resp.array(None, conn.proto)
        return self._blocked(conn, wants, count, block)

    async def _blocked(self, conn: Session, wants: list[Want], count: int | None, block_ms: int) -> bytes:
        loop = asyncio.get_running_loop()
        deadline = None if block_ms == 0 else loop.time() + block_ms / 1000
        followed = {(s.bucket, s.filter) for _, s, _ in wants}
        buckets = {b for b, _ in followed}
        self.blocked += 1
        for f in followed:
            self._following[f] = self._following.get(f, 0) + 1
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
                for _, s, _ in wants:
                    self._vouch(conn, s)
                # a batch of the bucket wakes every reader of it; one whose filter matched
                # none of it finds nothing here and waits on, from where it looked last
                reply, wants = self._read(conn, wants, count)
                if reply is not None:
                    return reply
        finally:
            self.blocked -= 1
            for f in followed:
                left = self._following.pop(f) - 1
                if left:
                    self._following[f] = left

    def _range(self, conn: Session, args: list[bytes], reverse: bool) -> bytes:
        if len(args) not in (4, 6):  # (at least 4: the command table's arity)
            raise CommandError("ERR syntax error")
        s = self.stream_of(args[1])
        hi_raw, lo_raw = (args[2], args[3]) if reverse else (args[3], args[2])
        first, last = stream_ids.interval(lo_raw, hi_raw)
        count: int | None = None
        if len(args) == 6:
            if args[4].lower() != b"count":
                raise CommandError("ERR syntax error")
            count = integer(args[5])
            if count <= 0:
                return resp.array(None, conn.proto)
        self._vouch(conn, s)
        if first > 1:
            self._exact_after(s, first - 1, lo_raw)
        entries, top, _ = self._entries(s, first, last, count, reverse, None)
        self._handed(conn, s.bucket, len(entries), top)
        return resp.array(entries)

    def xrange(self, conn: Session, args: list[bytes]) -> bytes:
        return self._range(conn, args, reverse=False)

    def xrevrange(self, conn: Session, args: list[bytes]) -> bytes:
        return self._range(conn, args, reverse=True)

    def xlen(self, conn: Session, args: list[bytes]) -> bytes:
        s = self.stream_of(args[1])
        self._vouch(conn, s)
        return resp.integer(self._length(s))

    def _length(self, s: Stream) -> int:
        """The stream's entries: the index's count, or for a filtered stream those of its
        keys (a walk of the index asking the filter of each key, no record read)."""
        rdb = self.replica.revs_ro(s.bucket)
        if rdb is None:
            return 0
        with self.replica.env.begin(buffers=True) as txn:
            if s.match is None:
                return revindex.length(txn, rdb)
            return revindex.count_matching(txn, self.replica.db(s.bucket), rdb, s.match)

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
        s = self.stream_of(args[2])
        self._vouch(conn, s)
        return self._info(conn, s, full, count)

    def _last_revision(self, s: Stream) -> int:
        """The revision of the stream's last entry, 0 when it has none."""
        if s.match is not None:
            return self._entries(s, 0, U64, 1, True, None)[1]
        rdb = self.replica.revs_ro(s.bucket)
        if rdb is None:
            return 0
        with self.replica.env.begin() as txn:
            return revindex.bounds(txn, rdb)[1]

    def _info(self, conn: Session, s: Stream, full: bool, count: int) -> bytes:
        """XINFO STREAM. A filtered stream's `length`, first and last entries are its own;
        the index's pages, the last revision (`$`) and the horizon are the bucket's."""
        proto = conn.proto
        feed = s.feed
        rdb = self.replica.revs_ro(s.bucket)
        leaf = branch = 0
        if rdb is not None:
            with self.replica.env.begin() as txn:
                st = txn.stat(rdb)
                leaf, branch = st["leaf_pages"], st["branch_pages"]
        length = self._length(s)
        removed = self.replica.max_removed(s.bucket)
        first, lo, _ = self._entries(s, 0, U64, 1, False, None)
        last, _, _ = self._entries(s, 0, U64, 1, True, None)
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
            entries, _, _ = self._entries(s, 0, U64, count or None, False, None)
            pairs = [*head, (b"entries", resp.array(entries)), (b"groups", resp.array([]))]
        else:
            pairs = [*head, (b"groups", resp.integer(0)),
                     (b"first-entry", first[0] if first else resp.null(proto)),
                     (b"last-entry", last[0] if last else resp.null(proto))]
        pairs += [(b"nats-first-seq", resp.integer(feed.first_seq)),
                  (b"exact-after", resp.bulk(format_id(feed.meta.horizon)))]
        if s.filter is not None:
            pairs.append((b"key-filter", resp.bulk(s.filter.encode())))
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


def _filter_problem(text: str) -> str | None:
    """What makes `text` no key filter, for the error (kvcache.keys.valid_filter is the
    rule); None when it is one."""
    if valid_filter(text):
        return None
    tokens = text.split(".")
    for i, t in enumerate(tokens):
        if not t:
            return "the filter is empty" if len(tokens) == 1 else "it has an empty token"
        if t == ">" and i != len(tokens) - 1:
            return "'>' may only be its last token"
        if t not in ("*", ">") and KEY_TOKEN_RE.fullmatch(t) is None:
            return f"'{t[:64]}' is not a token"
    return "it is not a filter"


def _matcher(text: str) -> Callable[[bytes], bool]:
    """A filter asked of a key's bytes. Latin-1 maps each byte to one character, so the
    tokens are the bytes between dots, as NATS matches a subject."""
    match = FilterSet([text]).match
    return lambda key: match(key.decode("latin-1"))


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
