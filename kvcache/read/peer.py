"""One read target: a (connection, stream) pair answering Direct Get (ADR-31) for a bucket.

Single keys use the subject-appended form `$JS.API.DIRECT.GET.<stream>.<subject>`; MGET misses
use `multi_last` batches (at most 1024 subjects a request, pinned to one snapshot with
`up_to_seq`). Streams without `allow_direct` have no Direct Get responders, so such a peer uses
the leader API `$JS.API.STREAM.MSG.GET`, which is also what `CONSISTENCY strong` reads use
(read-after-write). A peer also measures its requests, the figures the router chooses by
(kvcache.read.router).

A fenced single-key read (kvcache.feed.quorum.Fence) is a one-key `multi_last` batch: the
key's entry, then the end-of-batch reply naming the answering server's last sequence. The
fence's anchor key goes along only when the key is not known to have a message (a not-found
must still end in that reply, and a 404 carries none): a key this peer has seen with a
message (KNOWN_KEYS) is asked alone, two messages back like the plain Direct Get's one plus
the proof, and asked again with the anchor in the rare case that it has lost its message.
"""
from __future__ import annotations

import base64
import contextlib
import itertools
import json
import math
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from ..entry import Entry, Operation
from ..errors import BehindQuorum, ReplyBudget, UpstreamError
from ..feed.quorum import NO_FENCE, Fence
from ..natsio import jetstream as jsapi
from ..natsio.nats_connection import NatsConnection, request_batch
from ..store.record import NEVER, parse_msg_ttl

MULTI_LAST_MAX = 1024
NO_MESSAGE = 10037
EWMA_TAU_S = 0.5      # decay time of the latency estimate between sparse samples
EWMA_ALPHA = 0.1      # least weight of a new (faster) sample
SAMPLES = 256          # latency samples kept per peer for percentiles
RESORT_EVERY = 16      # percentiles are re-sorted after this many new samples
KNOWN_KEYS = 4096      # keys a peer remembers having a message: fenced reads ask them without the anchor


def header_int(hdrs: dict, name: str) -> int:
    """A Direct Get reply's number (Nats-Sequence, Nats-UpTo-Sequence, Nats-Num-Pending); 0
    when absent."""
    return int(hdrs.get(name) or 0)


@dataclass
class PeerStats:
    """What INFO shows about a peer, and the latency figures the router decides on."""

    requests: int = 0
    errors: int = 0
    hedges: int = 0        # hedged requests sent to this peer
    hedges_won: int = 0    # ...that answered first
    ejections: int = 0
    probes: int = 0
    ewma_us: float = 0.0
    last_sample: float = 0.0  # time.monotonic() of the latest sample; 0 = never measured
    samples: deque = field(default_factory=lambda: deque(maxlen=SAMPLES))
    _sorted: list = field(default_factory=list)
    _fresh: int = 0

    def observe(self, seconds: float) -> None:
        """Peak-sensitive EWMA: a slower sample is taken at once; a faster one weighs at least
        EWMA_ALPHA (a one-off spike fades within a few dozen answers), more when the previous
        sample is old (decay time EWMA_TAU_S: an estimate last updated long ago, as for a peer
        only probed, follows its next sample almost entirely)."""
        us = seconds * 1e6
        now = time.monotonic()
        if us >= self.ewma_us or not self.last_sample:
            self.ewma_us = us
        else:
            a = max(EWMA_ALPHA, 1 - math.exp(-(now - self.last_sample) / EWMA_TAU_S))
            self.ewma_us += a * (us - self.ewma_us)
        self._sample(us, now)

    def restart(self) -> None:
        """A peer back from ejection starts over, unmeasured: its old figures describe a peer
        that failed, and the probe that brought it back may have waited out the failure."""
        self.samples.clear()
        self._sorted = []
        self._fresh = 0
        self.ewma_us = 0.0
        self.last_sample = 0.0

    def _sample(self, us: float, now: float) -> None:
        self.samples.append(us)
        self._fresh += 1
        self.last_sample = now

    def percentile(self, q: float) -> float:
        """Latency (µs) below which a share `q` of the recent samples fall; 0 without samples."""
        if self._fresh >= RESORT_EVERY or len(self._sorted) < min(len(self.samples), RESORT_EVERY):
            self._sorted = sorted(self.samples)
            self._fresh = 0
        s = self._sorted
        return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


@dataclass(eq=False)  # a peer is itself: the router keys its view of each peer by identity
class Peer:
    """One read target and its requests: a NATS connection and a stream holding a bucket's
    keys (the bucket's own, a replica's, a mirror's). It measures its requests (latency,
    in flight, errors: PeerStats); whether it is chosen, ejected or probed is the router's
    business (kvcache.read.router.PeerHealth)."""

    name: str
    nc: NATS
    stream: str
    bucket: str
    domain: str | None = None
    direct: bool = True
    stats: PeerStats = field(default_factory=PeerStats)
    # perf_counter() at which a request overtaken by a hedge (and cancelled) was sent; until
    # the peer answers again it counts as still unanswered, so a stalled peer keeps getting
    # costlier although its requests were cancelled. 0 = none.
    unanswered_since: float = 0.0
    _started: dict = field(default_factory=dict)   # request id -> perf_counter() at start
    _ids: Iterator[int] = field(default_factory=itertools.count)
    # Keys this peer last answered with a message (a put or a delete marker), oldest first: a
    # hint only, for which request form a fenced read sends (_fenced_get), never an answer.
    _has_message: dict = field(default_factory=dict)

    @property
    def inflight(self) -> int:
        return len(self._started)

    @property
    def upstream(self) -> bool:
        """Does this peer reach the bucket's own stream (whose leader has every write), rather
        than a mirror?"""
        return self.stream == jsapi.kv_stream(self.bucket)

    def cost(self, now: float) -> float:
        """Expected wait (µs) for one more request: the latency estimate, raised by the age of
        the oldest unanswered request (a stalled peer gets costlier by the millisecond, before
        any timeout), times the queue it would join."""
        est = self.stats.ewma_us
        oldest = min(self._started.values(), default=self.unanswered_since or now)
        if self.unanswered_since:
            oldest = min(oldest, self.unanswered_since)
        est = max(est, (now - oldest) * 1e6)
        return est * (len(self._started) + 1)

    @property
    def api(self) -> str:
        return jsapi.api_prefix(self.domain)

    @property
    def label(self) -> str:
        """The name INFO lists this peer under and KV.GET reports as the source. The main
        connection serves every bucket, so its peers are told apart by bucket."""
        return f"{self.name}.{self.bucket}" if self.name == "main" else self.name

    def _begin(self) -> tuple[int, float]:
        """Count one request and time it: `_done` or `_error` ends it."""
        self.stats.requests += 1
        rid = next(self._ids)
        start = self._started[rid] = time.perf_counter()
        return rid, start

    def _done(self, rid: int, start: float) -> None:
        del self._started[rid]
        self.stats.observe(time.perf_counter() - start)
        self.unanswered_since = 0.0

    def _error(self, rid: int, exc: BaseException) -> BaseException:
        """The exception a failed request raises: a NATS failure becomes an UpstreamError.
        No-responders passes through uncounted: the caller switches to the leader API and
        that request is the one that counts."""
        del self._started[rid]
        if isinstance(exc, nats.errors.NoRespondersError):
            self.stats.requests -= 1
        elif isinstance(exc, UpstreamError):
            self.stats.errors += 1
        elif isinstance(exc, (nats.errors.Error, OSError)):
            self.stats.errors += 1
            return UpstreamError(f"peer {self.label}: {type(exc).__name__}: {exc}")
        return exc

    @contextlib.contextmanager
    def _accounted(self) -> Iterator[None]:
        """`_begin`/`_done`/`_error` around a block (the hot single-key path calls them inline:
        a generator context manager costs a few µs a read)."""
        rid, start = self._begin()
        try:
            yield
        except BaseException as exc:
            err = self._error(rid, exc)
            if err is exc:
                raise
            raise err from None
        self._done(rid, start)

    # ------------------------------------------------------------------ single key

    async def get(self, key: str, timeout: float, leader: bool = False,
                  fence: Fence = NO_FENCE) -> Entry | None:
        """The key's newest entry as this peer holds it. With a `fence`, a Direct Get answer
        counts only from a server that shows it holds the fence's sequence (a one-key batch
        get, whose end-of-batch reply names the server's last sequence: _fenced_get)."""
        if self.direct and not leader:
            rid, start = self._begin()
            try:
                e = await (self._fenced_get(key, fence, timeout) if fence.seq
                           else self.direct_request(key, b"", timeout))
            except BaseException as exc:
                err = self._error(rid, exc)
                if not isinstance(err, nats.errors.NoRespondersError):
                    if err is exc:
                        raise
                    raise err from None
                self.direct = False  # no allow_direct (nats-py's default for new buckets)
            else:
                self._done(rid, start)
                return e
        with self._accounted():
            return await self._leader_get(key, timeout)

    async def direct_request(self, key: str | None, payload: bytes, timeout: float) -> Entry | None:
        """One single-message Direct Get: subject-appended (`...DIRECT.GET.<stream>.<subject>`)
        when `key` is given, else `payload` is the request. A 404 is None; any other status
        (408 bad or empty request, 413, ...) raises UpstreamError."""
        subject = f"{self.api}.DIRECT.GET.{self.stream}"
        if key is not None:
            subject += "." + jsapi.kv_subject(self.bucket, key)
        try:
            if isinstance(self.nc, NatsConnection):
                msg = await self.nc.fast_request(subject, payload, timeout)
            else:
                msg = await self.nc.request(subject, payload, timeout=timeout)
        except nats.errors.TimeoutError:
            raise UpstreamError(f"peer {self.label}: Direct Get timed out after {timeout:.1f}s") from None
        e = self._entry_from_msg(msg, key)
        if key is not None:
            self._saw(key, e is not None)
        return e

    async def _fenced_get(self, key: str, fence: Fence, timeout: float) -> Entry | None:
        """The key's newest entry from a server that shows, in the same reply, that it holds
        stream sequence `fence.seq`; BehindQuorum from any other (the router then asks the
        next peer).

        One `multi_last` batch: the key's last message, then the 204 end-of-batch whose
        Nats-UpTo-Sequence is the answering server's last sequence (a request reaches one
        member of the Direct Get queue group, and every message of its reply comes from that
        member). A key without a message gets a 404 instead, which carries no sequence, so
        the fence's anchor (a key known to have a message) is asked beside any key this peer
        has not seen with one: a not-found then still ends in the 204. A key it has seen is
        asked alone, one message fewer (the anchor's header and value), and asked again with
        the anchor should it answer 404 (its message removed since). Nothing is taken from an
        earlier reply: the hint only chooses the request."""
        subject = jsapi.kv_subject(self.bucket, key)
        can_anchor = bool(fence.anchor) and fence.anchor != key
        anchored = can_anchor and key not in self._has_message
        request = f"{self.api}.DIRECT.GET.{self.stream}"
        for _ in range(2):
            subjects = [subject, jsapi.kv_subject(self.bucket, fence.anchor)] if anchored else [subject]
            payload = b'{"multi_last":%s,"batch":%d}' % (json.dumps(subjects).encode(), len(subjects))
            try:
                msgs = await (self.nc.fast_batch(request, payload, timeout) if isinstance(self.nc, NatsConnection)
                              else request_batch(self.nc, request, payload, timeout))
            except nats.errors.TimeoutError:
                raise UpstreamError(f"peer {self.label}: multi_last timed out") from None
            found: Msg | None = None
            tail = pending = -1    # from the end-of-batch reply; -1: none came
            for msg in msgs:
                hdrs = msg.headers or {}
                status = hdrs.get("Status")
                if not status:
                    if hdrs.get("Nats-Subject") == subject:
                        found = msg  # the anchor's own entry is no answer: only its batch's tail is
                elif status == "204":
                    tail, pending = header_int(hdrs, "Nats-UpTo-Sequence"), header_int(hdrs, "Nats-Num-Pending")
                elif status == "404":  # none of the subjects has a message: no sequence to check
                    if anchored or not can_anchor:
                        raise BehindQuorum(f"peer {self.label}: cannot show it holds stream "
                                           f"sequence {fence.seq} (no key to anchor the read)")
                    self._has_message.pop(key, None)
                else:
                    raise self._batch_failed(status, hdrs)
            if tail < 0:               # the 404 of a key asked alone: again, anchored
                anchored = True
                continue
            if tail < fence.seq:
                raise BehindQuorum(f"peer {self.label}: holds the stream up to {tail}, "
                                   f"below {fence.seq} which a quorum had within max_stale_ms")
            if found is None and pending > 0:
                # The batch ended before the key (the server's byte limit, reached by the
                # anchor's value): the key alone, with its own proof.
                anchored = False
                continue
            e = self._entry_from_msg(found, key) if found is not None else None
            self._saw(key, e is not None)
            return e
        raise UpstreamError(f"peer {self.label}: no reply showed key {key} with the server's sequence")

    def _batch_failed(self, status: str, hdrs: dict) -> UpstreamError:
        """A multi_last reply's error status (413: its wildcard matches too many subjects)."""
        return UpstreamError(f"peer {self.label}: multi_last failed: {status} {hdrs.get('Description', '')}".rstrip())

    def _saw(self, key: str, has_message: bool) -> None:
        """Remember whether the key answered with a message (the oldest of KNOWN_KEYS goes)."""
        known = self._has_message
        if not has_message:
            known.pop(key, None)
        elif key not in known:
            known[key] = None
            if len(known) > KNOWN_KEYS:
                del known[next(iter(known))]

    def _entry_from_msg(self, msg: Msg, key: str | None = None) -> Entry | None:
        hdrs = msg.headers or {}
        status = hdrs.get("Status")
        if status:
            if status == "404":
                return None
            raise UpstreamError(
                f"peer {self.label}: Direct Get failed: {status} {hdrs.get('Description', '')}".rstrip())
        if key is None:
            key = hdrs.get("Nats-Subject", "")[len(jsapi.kv_subject(self.bucket, "")):]
        return self._entry(key, msg.data, hdrs, header_int(hdrs, "Nats-Sequence"),
                           jsapi.parse_time_ns(hdrs.get("Nats-Time-Stamp", "")))

    async def _leader_get(self, key: str, timeout: float) -> Entry | None:
        try:
            doc = await jsapi.api_request(
                self.nc, f"{self.api}.STREAM.MSG.GET.{self.stream}",
                {"last_by_subj": jsapi.kv_subject(self.bucket, key)}, timeout)
        except jsapi.ApiError as e:
            # Only "no message found" is a miss. A 404 with another err_code (stream not
            # found: 10059) is an error, or a deleted bucket would read as all keys missing.
            if e.err_code == NO_MESSAGE or (e.code == 404 and not e.err_code):
                return None
            raise
        m = doc.get("message", {})
        hdrs = jsapi.parse_header_block(base64.b64decode(m["hdrs"])) if m.get("hdrs") else {}
        data = base64.b64decode(m.get("data", "")) if m.get("data") else b""
        return self._entry(key, data, hdrs, m.get("seq", 0), jsapi.parse_time_ns(m.get("time", "")),
                           source="leader")

    def _entry(self, key: str, data: bytes, hdrs: dict, seq: int, created: int,
               source: str | None = None) -> Entry:
        op = Operation.of(hdrs)
        ttl = parse_msg_ttl(hdrs.get("Nats-TTL"))
        expires = 0 if not ttl else NEVER if ttl < 0 else created + ttl
        return Entry(self.bucket, key, data if op is Operation.PUT else None, seq, created,
                     0, op, source or self.label, expires)

    # ------------------------------------------------------------------ many keys

    async def get_many(self, keys: list[str], timeout: float, up_to_seq: int | None = None,
                       budget: ReplyBudget | None = None, fence: Fence = NO_FENCE) -> dict[str, Entry | None]:
        """multi_last batches; one snapshot across batches via the first batch's up-to sequence
        (or `up_to_seq`: the keys as they were at that stream sequence). Values are charged to
        `budget` as they arrive (when this peer's answer is the one used): ReplyTooLarge stops
        the read. `fence`: the first batch's server must show it holds the fence's sequence
        (kvcache.feed.quorum.Fence), or the read fails here (BehindQuorum) and goes elsewhere."""
        attempt = budget.fork() if budget is not None else None
        if not self.direct and up_to_seq is None:
            got: dict[str, Entry | None] = {}
            for k in keys:
                e = got[k] = await self.get(k, timeout, leader=True)
                if attempt is not None and e is not None and e.value:
                    attempt.spend(len(e.value))
            if budget is not None and attempt is not None:
                budget.left = attempt.left
            return got
        out: dict[str, Entry | None] = {}
        up_to = up_to_seq
        try:
            with self._accounted():
                for i in range(0, len(keys), MULTI_LAST_MAX):
                    chunk = keys[i : i + MULTI_LAST_MAX]
                    up_to = await self._multi_last(chunk, up_to, timeout, out, attempt,
                                                   fence if i == 0 else NO_FENCE)
        except nats.errors.NoRespondersError:
            if up_to_seq is not None:
                raise UpstreamError(f"peer {self.label}: no Direct Get responders "
                                    "(a point-in-time read needs allow_direct)") from None
            self.direct = False
            return await self.get_many(keys, timeout, budget=budget, fence=fence)
        for k in keys:
            out.setdefault(k, None)
        if budget is not None and attempt is not None:
            budget.left = attempt.left
        return out

    async def _multi_last(self, keys: list[str], up_to: int | None, timeout: float,
                          out: dict[str, Entry | None], budget: ReplyBudget | None = None,
                          fence: Fence = NO_FENCE) -> int | None:
        remaining = {jsapi.kv_subject(self.bucket, k): k for k in keys}
        anchor = jsapi.kv_subject(self.bucket, fence.anchor) if fence.seq and fence.anchor else ""
        while remaining:
            subjects = list(remaining)
            if anchor and anchor not in remaining:
                subjects.append(anchor)  # its entry is not an answer: only its batch's tail is
            req: dict = {"multi_last": subjects, "batch": len(subjects)}
            if up_to:
                req["up_to_seq"] = up_to
            subject = f"{self.api}.DIRECT.GET.{self.stream}"
            payload = json.dumps(req).encode()
            try:
                msgs = await (self.nc.fast_batch(subject, payload, timeout) if isinstance(self.nc, NatsConnection)
                              else request_batch(self.nc, subject, payload, timeout))
            except nats.errors.TimeoutError:
                raise UpstreamError(f"peer {self.label}: multi_last timed out") from None
            more = False
            got_any = False
            for msg in msgs:
                hdrs = msg.headers or {}
                status = hdrs.get("Status")
                if status == "204":  # EOB
                    tail = header_int(hdrs, "Nats-UpTo-Sequence")
                    if fence.seq and tail < fence.seq:
                        raise BehindQuorum(f"peer {self.label}: holds the stream up to {tail}, "
                                           f"below {fence.seq} which a quorum had within max_stale_ms")
                    fence = NO_FENCE
                    up_to = up_to or tail or None
                    more = header_int(hdrs, "Nats-Num-Pending") > 0
                elif status == "404":  # none of the subjects has a message
                    if fence.seq:  # and so no sequence of the server's to check
                        raise BehindQuorum(f"peer {self.label}: cannot show it holds stream "
                                           f"sequence {fence.seq} (no key to anchor the read)")
                elif status:
                    raise self._batch_failed(status, hdrs)
                else:
                    key = remaining.pop(hdrs.get("Nats-Subject", ""), None)
                    if key is not None:
                        got_any = True
                        if budget is not None:
                            budget.spend(len(msg.data))
                        out[key] = self._entry_from_msg(msg, key)
                        self._saw(key, True)
            if not more or not got_any:
                return up_to
        return up_to
