"""Following a bucket with no consumer of the sidecar's own: the stream's RePublish.

Every JetStream consumer is an assignment in the cluster's meta layer with its own pull,
delivery state and heartbeats; one per sidecar per bucket makes a fleet's cost to the cluster
grow with the fleet (docs/architecture.md, "Following without a consumer"). A stream whose
configuration has a RePublish covering the whole bucket publishes every stored message again on
a core subject, with its stream, subject, sequence and time in headers. Once its consumer has
caught up, the feed (kvcache.feed.feed.Feed._run) subscribes to that subject, then ends the
consumer (deleted, not left to the server's reaper), and a `Follower` applies what arrives:

- A message at or below the replica's applied sequence is a duplicate and ignored; the next
  sequence is applied (all such in one event-loop turn, one batch through Feed._on_batch, as a
  consumer's delivery of the same messages would be: natsproto.fold_delivery); a higher one is
  a **gap**: core NATS dropped something. What arrives meanwhile is buffered (bounded), the gap
  is filled with Direct Get batches (`{"seq": from, "batch": n}`), then the buffer is applied.
  A batch returns every message the stream holds from its start sequence on, in order, so a
  sequence below the highest it returned that it did not return is no longer in the stream
  (superseded, deleted): skipped. A fill that cannot show the stream holds nothing more below
  the gap's end (timeout, no Direct Get responders, an error status, nothing at all returned)
  ends the follower: the feed goes back to a consumer from the applied sequence, which hands
  back to a follower once caught up again.
- Freshness rests on the stream's state answers the feed gets every watch_period anyway (its
  own poll or the fleet's shared one): an answer asked at `sent_ns` whose last sequence the
  replica holds makes it current as of `sent_ns`. An answer past the replica's position may
  describe messages still on their way; if the replica has not reached it within a grace
  (twice the answer's age, at least GRACE_MIN_S), that is a gap too, filled the same way. A
  message received proves nothing about what else the stream holds, so it moves nothing but
  the position. For a replicated stream the quorum's evidence bounds the age as before
  (kvcache.feed.freshness): a replica that missed messages is behind, never fresh.

The fleet's relay (kvcache.feed.relay) publishes a stream with no usable RePublish in the same
shape on `kvcache.changes.<domain or _>.<bucket>`: a Follower in mode `relay` follows that
subject exactly so, and also ends when no relay has been heard for a while (`alive`), so that
a fleet whose relay went away takes consumers again rather than ageing.

Anyone allowed to publish on the RePublish subject can inject messages the follower would
apply: the subject must be publishable by the server only (README, permissions).
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import nats.errors
from nats.aio.subscription import Subscription

from ..errors import KvcacheError
from ..natsio.jetstream import parse_time_ns
from ..natsio.nats_connection import NatsConnection, proto, unsubscribe_quietly
from ..natsio.natsproto import AckMeta, Run, fold_delivery

if TYPE_CHECKING:
    from ..config import BucketConfig
    from ..store.nearcache import NearCache
    from ..store.replica import BucketMeta

log = logging.getLogger("kvcache.feed")

# What a follower may hold while a gap is filled (or a consumer hands over); past either, it
# ends and the feed goes back to a consumer (which is bounded by its pull window instead).
BUFFER_MSGS = 10_000
BUFFER_BYTES = 16 * 1024 * 1024
# A Direct Get batch: messages and bytes per request.
FILL_BATCH = 1024
FILL_MAX_BYTES = 8 * 1024 * 1024
# A state answer past the replica's position counts as a gap once this long has passed (at
# least), or twice the answer's age when that is more: its messages may still be on their way.
GRACE_MIN_S = 0.05
# How often a follower with nothing to do looks at its grace deadlines anyway.
IDLE_CHECK_S = 1.0
# Why a follower ended (a metrics label, kvcache.ops.metrics): the feed went back to a consumer.
FOLLOW_END_REASONS = ("fill", "buffer", "connection", "stream_changed", "republish_changed", "denied", "relay")

_HMsg = proto.HMsg
_MAPPING = re.compile(r"\{\{.*\}\}|\$\d")


class FollowedFeed(Protocol):
    """What a Follower reads and tells of its feed (kvcache.feed.feed.Feed, which imports
    this module: a protocol, not an import back)."""

    nc: NatsConnection
    cfg: BucketConfig
    bucket: str
    stream: str
    prefix: str
    timeout: float
    meta: BucketMeta
    cache: NearCache | None
    follow_received: int
    follow_duplicates: int
    follow_foreign: int
    gaps_filled: int
    gap_fill_messages: int
    gap_fill_seconds: float
    skips_pinned: int
    pinned_ns: int

    @property
    def written_seq(self) -> int: ...

    def same_stream(self, info: dict) -> bool: ...

    def _on_batch(self, runs: list[Run]) -> bool: ...

    def follow_proven(self, as_of_ns: int) -> None: ...

    def pin(self) -> None: ...

    def unpin(self) -> None: ...


class FollowEnded(KvcacheError):
    """The follower can no longer show it holds the stream in order: back to a consumer.
    `reason` is one of FOLLOW_END_REASONS."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def republish_subject(config: dict, bucket: str) -> str | None:
    """The core subject to follow a bucket's stream on, from its configuration (STREAM.INFO
    `config`), or None when its RePublish cannot serve: none, headers only, or a source
    narrower than the whole bucket. The destination's wildcards and mapping functions
    (`{{wildcard(1)}}`, `$1`) become `*` (a final `>` stays): the message's own subject is in
    its Nats-Subject header."""
    rp = config.get("republish") or None
    if not isinstance(rp, dict) or rp.get("headers_only"):
        return None
    if (rp.get("src") or ">") not in (">", f"$KV.{bucket}.>"):
        return None
    dest = rp.get("dest") or ""
    if not dest:
        return None
    tokens = dest.split(".")
    out = []
    for i, token in enumerate(tokens):
        if token == ">" and i == len(tokens) - 1:
            out.append(">")
        elif token == "*" or _MAPPING.search(token):
            out.append("*")
        else:
            out.append(token)
    return ".".join(out)


def header_block(headers: dict, multi: dict | None = None) -> bytes:
    """A decoded header dict (and a repeated name's values, `multi`) as a `NATS/1.0` block,
    for natsproto.fold_delivery: the operation and TTL headers decode as they were sent."""
    lines = [b"NATS/1.0"]
    for name, value in headers.items():
        for v in (multi[name] if multi and name in multi else (value,)):
            lines.append(f"{name}: {v}".encode())
    return b"\r\n".join(lines) + b"\r\n\r\n"


class Follower:
    """One feed's following of its stream's RePublish subject (see the module docstring).

    `subscribe()` first (messages are only buffered), then the feed ends its consumer and calls
    `follow()`, which returns never: it raises FollowEnded (back to a consumer), the feed's
    ReplicaError (a batch could not be written) or CancelledError. `word(info, sent_ns)`
    hands it each state answer of the stream; `fail()` ends it from outside (a lost
    connection)."""

    def __init__(self, feed: FollowedFeed, subject: str, mode: str = "republish",
                 alive: Callable[[], bool] | None = None) -> None:
        self.feed = feed
        self.subject = subject
        # `republish`: the stream's own RePublish subject; `relay`: the fleet relay's
        # (kvcache.feed.relay), the same shape, which `alive` says is still relayed (checked
        # every IDLE_CHECK_S: once it is not, the follower ends and the feed takes a consumer).
        self.mode = mode
        self.alive = alive
        self.nc: NatsConnection = feed.nc
        self._sid: int | None = None
        self._sub: Subscription | None = None
        self._buffer: dict[int, tuple[str, dict, dict | None, bytes]] = {}
        self._bytes = 0
        self._holding = True  # only buffer: the consumer still runs, or a fill is on its way
        self._wake = asyncio.Event()
        self._ended: BaseException | None = None
        # state answers past the position: (last sequence, asked at ns, gap after monotonic)
        self._words: list[tuple[int, int, float]] = []
        self._whole = feed.cache is not None or list(feed.cfg.keys) == [">"]

    # ------------------------------------------------------------------ lifecycle

    async def subscribe(self) -> None:
        """Subscribe, and wait until the server has the interest (a round trip): from then on
        every message the stream stores reaches this follower or is a gap it will see."""
        sub = await self.nc.subscribe(self.subject)  # messages never reach its queue: the lane takes them
        self._sub = sub
        self._sid = sub._id
        self.nc.add_lane(sub._id, "", self._on_lane)
        await self.nc.flush(int(max(1.0, self.feed.timeout)))

    async def close(self) -> None:
        if self._sid is not None:
            self.nc.remove_lane(self._sid)
        sub, self._sub = self._sub, None
        await unsubscribe_quietly(sub)

    def fail(self, message: str, reason: str) -> None:
        if self._ended is None:
            self._ended = FollowEnded(message, reason)
        self._wake.set()

    async def follow(self) -> None:
        self._holding = False
        self._drain()
        while True:
            if self._ended is not None:
                raise self._ended
            if self.alive is not None and not self.alive():
                raise FollowEnded("no relay heard", "relay")
            end = self._gap_end()
            if end:
                await self._fill(end)
                continue
            due = min((w[2] for w in self._words), default=None)
            wait = IDLE_CHECK_S if due is None else max(0.0, due - time.monotonic())
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), min(wait, IDLE_CHECK_S))
            except TimeoutError:
                pass

    # ------------------------------------------------------------------ messages

    def _on_lane(self, batch: list) -> None:
        self._on_messages([(ev.headers, ev.multi, ev.payload) for ev in batch if type(ev) is _HMsg])

    def _on_messages(self, msgs: list[tuple[dict, dict | None, bytes]]) -> None:
        if self._ended is not None:
            return
        feed = self.feed
        feed.follow_received += len(msgs)
        nxt = feed.written_seq + 1
        run: list[tuple[int, str, dict, dict | None, bytes]] = []  # continuing the replica: applied
        for headers, multi, payload in msgs:
            seq = self._sequence(headers)
            if seq is None:
                continue
            if seq < nxt or seq in self._buffer:
                feed.follow_duplicates += 1
                continue
            if seq == nxt and not self._holding and not self._buffer:
                run.append((seq, headers["Nats-Subject"], headers, multi, payload))
                nxt += 1
                continue
            if len(self._buffer) >= BUFFER_MSGS or self._bytes + len(payload) > BUFFER_BYTES:
                self.fail(f"more than {BUFFER_MSGS} messages or {BUFFER_BYTES >> 20} MiB waiting on a gap",
                          "buffer")
                return
            self._buffer[seq] = (headers["Nats-Subject"], headers, multi, payload)
            self._bytes += len(payload)
        if not self._holding:
            try:
                if run:
                    self._apply(run)
                self._drain()
            except BaseException:  # kept in _ended: follow() raises it (not the connection's reader)
                pass
        if self._buffer or self._words:
            self._wake.set()

    def _sequence(self, headers: dict) -> int | None:
        """The stream sequence of a republished message of our stream; None for anything
        else (another stream's, no sequence, a subject outside the bucket)."""
        if headers.get("Nats-Stream") != self.feed.stream:
            self.feed.follow_foreign += 1
            return None
        try:
            seq = int(headers.get("Nats-Sequence") or 0)
        except ValueError:
            seq = 0
        if seq <= 0 or not str(headers.get("Nats-Subject", "")).startswith(self.feed.prefix):
            self.feed.follow_foreign += 1
            return None
        return seq

    def _drain(self) -> None:
        """Apply the buffered messages that continue the replica without a gap."""
        applied = self.feed.written_seq
        buf = self._buffer
        for seq in [s for s in buf if s <= applied]:
            self._bytes -= len(buf.pop(seq)[3])
        run: list[tuple[int, str, dict, dict | None, bytes]] = []
        nxt = applied + 1
        while nxt in buf:
            subject, headers, multi, payload = buf.pop(nxt)
            self._bytes -= len(payload)
            run.append((nxt, subject, headers, multi, payload))
            nxt += 1
        if run:
            self._apply(run)

    def _apply(self, msgs: list[tuple[int, str, dict, dict | None, bytes]]) -> None:
        """One batch through the feed, decoded as a consumer's delivery (fold_delivery); keys
        outside a filtered bucket's filters advance the position and are not kept. Messages
        must continue the replica: the first is its next sequence, or a fill showed that
        none is missing before it. While pinned (Feed.pin) the records are written and the
        feed's position stays where it is. A failed write ends the follower (the feed's
        ReplicaError)."""
        feed = self.feed
        prefix = len(feed.prefix)
        events: list = []
        top = ts = 0
        cseq = 1
        for seq, subject, headers, multi, payload in msgs:
            top = max(top, seq)
            key = subject[prefix:]
            ts = parse_time_ns(str(headers.get("Nats-Time-Stamp", "")))
            if not self._whole and not feed.cfg.replicates(key):
                continue
            ack = AckMeta(feed.stream, "", 1, seq, cseq, ts, 0)
            fold_delivery(events, ack, key.encode(), header_block(headers, multi), payload)
            cseq += 1
        if not events:  # all outside the filters: the position moves all the same
            events.append(Run(0, 1))
            events[-1].last_ts = ts
        events[-1].top_sseq = max(events[-1].top_sseq, top)
        try:
            feed._on_batch(events)
        except BaseException as e:
            if self._ended is None:
                self._ended = e
            self._wake.set()
            raise
        self._reached()

    # ------------------------------------------------------------------ freshness

    def word(self, info: dict, sent_ns: int) -> None:
        """A state answer of the stream asked at `sent_ns`: the replica is current as of then
        once it holds the answer's last sequence; past the grace without it, a gap."""
        feed = self.feed
        if not feed.same_stream(info):
            self.fail("the stream was recreated", "stream_changed")
            return
        republished = republish_subject(info.get("config") or {}, feed.bucket)
        if republished != (self.subject if self.mode == "republish" else None):
            self.fail("the stream's RePublish changed", "republish_changed")
            return
        last = int((info.get("state") or {}).get("last_seq", 0) or 0)
        now = time.time_ns()
        sent_ns = min(sent_ns, now)
        if self._releases(last, sent_ns):
            feed.unpin()
        if last <= feed.meta.applied_seq:
            self._proven(sent_ns)
            return
        grace = max(GRACE_MIN_S, 2 * (now - sent_ns) / 1e9)
        self._words.append((last, sent_ns, time.monotonic() + grace))
        self._wake.set()

    def _reached(self) -> None:
        """The words the replica now holds make it current as of when they were asked; one
        asked after the latest skip, once held, unpins the position first (Feed.pin)."""
        feed = self.feed
        if any(self._releases(last, sent_ns) for last, sent_ns, _ in self._words):
            feed.unpin()
        applied = feed.meta.applied_seq
        reached = [w for w in self._words if w[0] <= applied]
        if reached:
            self._words = [w for w in self._words if w[0] > applied]
            self._proven(max(w[1] for w in reached))

    def _releases(self, last: int, sent_ns: int) -> bool:
        """Does a state answer (its last sequence, asked at `sent_ns`) release the feed's pin?
        Asked after the latest skip, and held by the replica (Feed.pin)."""
        feed = self.feed
        return bool(feed.pinned_ns) and sent_ns >= feed.pinned_ns and last <= feed.written_seq

    def _proven(self, as_of_ns: int) -> None:
        self.feed.follow_proven(as_of_ns)

    def _gap_end(self) -> int:
        """The last sequence a fill must reach now (0: none): below the lowest buffered
        message when the replica does not continue into it, or a state answer past the
        replica whose grace is over."""
        applied = self.feed.written_seq
        end = 0
        if self._buffer:
            low = min(self._buffer)
            if low > applied + 1:
                end = low - 1
        now = time.monotonic()
        for last, _, due in self._words:
            if last > applied and now >= due:
                end = max(end, last)
        return end

    # ------------------------------------------------------------------ gaps

    async def _fill(self, end: int) -> None:
        """Direct Get batches from the replica's next sequence until the stream shows it
        holds nothing more up to `end`; then the buffer. Raises FollowEnded when it cannot."""
        feed = self.feed
        started = time.monotonic()
        first = feed.written_seq + 1
        got_total = 0
        self._holding = True
        try:
            while feed.written_seq < end:
                if self._ended is not None:
                    raise self._ended
                start = feed.written_seq + 1
                msgs = await self._batch(start, min(end - start + 1, FILL_BATCH))
                if self._ended is not None:
                    raise self._ended
                fresh = [m for m in msgs if m[0] >= start]
                if not fresh:
                    raise FollowEnded(f"gap {start}..{end}: the stream returned nothing from {start} on",
                                      "fill")
                got_total += len(fresh)
                cont = next((i for i, m in enumerate(fresh) if m[0] != start + i), len(fresh))
                if cont:
                    self._apply(fresh[:cont])
                if cont < len(fresh):  # the stream no longer holds start + cont: skipped
                    if not feed.pinned_ns:
                        feed.skips_pinned += 1
                        log.debug("bucket %s: a fill skipped sequences after %d: the position stays "
                                  "there until a state answer asked from now on is reached",
                                  feed.bucket, feed.meta.applied_seq)
                    feed.pin()  # the latest skip: an answer asked after it is needed
                    self._apply(fresh[cont:])
        finally:
            self._holding = False
        feed.gaps_filled += 1
        feed.gap_fill_messages += got_total
        took = time.monotonic() - started
        feed.gap_fill_seconds += took
        log.debug("bucket %s: gap %d..%d filled with %d messages in %.1f ms", feed.bucket, first, end,
                  got_total, took * 1000)
        self._drain()

    async def _batch(self, start: int, n: int) -> list[tuple[int, str, dict, dict | None, bytes]]:
        """One Direct Get batch from `start`: the messages in sequence order (an empty list
        when the stream holds none from there: 404). Raises FollowEnded on anything else."""
        feed = self.feed
        subject = f"$JS.API.DIRECT.GET.{feed.stream}"
        payload = json.dumps({"seq": start, "batch": n, "max_bytes": FILL_MAX_BYTES}).encode()
        try:
            replies = await self.nc.fast_batch(subject, payload, feed.timeout)
        except nats.errors.NoRespondersError:
            raise FollowEnded("no Direct Get responders (is allow_direct set on the stream?)", "fill") from None
        except nats.errors.TimeoutError:
            raise FollowEnded("Direct Get batch timed out", "fill") from None
        except nats.errors.Error as e:
            raise FollowEnded(f"Direct Get batch failed: {e}", "fill") from None
        out: list[tuple[int, str, dict, dict | None, bytes]] = []
        for msg in replies:
            headers = msg.headers or {}
            status = headers.get("Status")
            if status == "204" or status == "404":
                break
            if status:
                raise FollowEnded(f"Direct Get answered {status} {headers.get('Description', '')}".rstrip(), "fill")
            seq = self._sequence(headers)
            if seq is None:
                raise FollowEnded("Direct Get answered a message of another stream", "fill")
            out.append((seq, headers["Nats-Subject"], headers, None, msg.data))
        return out
