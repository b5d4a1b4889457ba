"""The fleet's relay: one sidecar per bucket republishes the bucket's stream on a core subject.

A bucket's stream can RePublish every stored message on a core subject; a sidecar then
follows that subject and needs no consumer of its own, so the consumers on the cluster do not
grow with the fleet (each consumer is a meta-layer assignment with its own delivery state and
heartbeats: ~70 KB of server memory apiece, measured). Where the operator has not set (or
cannot set) RePublish, one sidecar per bucket does it for the fleet: its `Relay` holds one pull
consumer over the whole bucket and publishes each message, as the stream stored it, on
`kvcache.changes.<domain or _>.<bucket>` with the headers RePublish sets (`Nats-Stream`,
`Nats-Subject`, `Nats-Sequence`, `Nats-Time-Stamp`, then the stored message's own:
`KV-Operation`, `Nats-Marker-Reason`, `Nats-TTL`, ...). The followers cannot tell the two
apart: they check whole-stream sequences, drop what they hold already and fill gaps with
Direct Get themselves, so the relay may start anywhere at or before what they hold.

**Who relays** (`RelayElection`), shaped like the fleet's shared stream-state poll
(kvcache.feed.fleet): the relay publishes a beat on `kvcache.relay.<domain or _>.<bucket>`
every period (its id, the last sequence it published, when), and one when it takes or leaves
the role. A synced sidecar that has heard no beat for 1.5 periods plus its rank (a fraction of
a period, from its id) takes the role: after a start or the relay's loss the sidecar of lowest
rank takes it first and the others hear its beat before their own wait ends, so a fleet of
10,000 does not make 10,000 consumers at once. A relay that hears a beat from a relay of lower
id steps down; one of higher id it ignores (that one steps down). So after about two periods
one relay serves a bucket, and another within about 2.5 periods if it goes away or is cut off.
Two relays at once (a race, a partition healing) only cost the cluster one more consumer for a
moment: the followers drop the duplicate sequences. A relay whose NATS connection is lost
steps down at its next look, within a quarter period (its consumer's pull went with the
connection; the consumer is deleted when possible, else reaped by its inactive_threshold).

**A relay that relays nothing** is lost (RelayLost): silent for three heartbeats, ended by
the server, or heartbeating while delivering nothing for three heartbeats though its sidecar
knows the stream holds more (a consumer on a replica cut off from its group's writes). It
steps down and the fleet elects again.

**Where it starts.** After the newest sequence its sidecar's replica holds for the bucket
(the followers dedupe), or after the last one the previous relay said it published when that
is lower (so a relay's failover leaves no gap the followers must fill), never more than
REPLAY_MAX messages back.

**Who can speak.** Anyone allowed to publish on `kvcache.changes.>` can give the fleet values
the stream never held, and on `kvcache.relay.>` can silence the relay: give those permissions
to the sidecars' NATS user only (README, "Permissions"), as for `kvcache.state.>`.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from ..errors import KvcacheError
from ..natsio import jetstream as jsapi
from ..natsio.nats_connection import NatsConnection, unsubscribe_quietly
from ..natsio.natsproto import parse_ack
from .consumer import NAME_TAKEN, PULL_MAX_BYTES, REQUEST_ENDED

log = logging.getLogger("kvcache.feed")

CHANGES_PREFIX = "kvcache.changes"
BEAT_PREFIX = "kvcache.relay"
# No beat heard within this many periods (plus the sidecar's rank): take the role.
HEARD_WITHIN_PERIODS = 1.5
# The relay's pull window (topped up at half): a relay publishes as it receives, so a small
# window is enough and bounds what its client buffers.
RELAY_BATCH = 1024
PULL_EXPIRES_S = 60.0
# A killed relay's consumer is reaped by the server this long after its last pull request.
RELAY_INACTIVE_S = 30.0
# A new relay republishes at most this many messages its followers may already hold.
REPLAY_MAX = 10_000
EARLY_503_RETRIES = 5  # pulls answered by no responders right after the creation, asked again
PLACEMENT_TRIES = 16  # consumers made to get one on the stream leader, at most


def changes_subject(domain: str | None, bucket: str) -> str:
    """The core subject a bucket's changes are relayed on (the followers subscribe to it)."""
    return f"{CHANGES_PREFIX}.{domain or '_'}.{bucket}"


def beat_subject(domain: str | None, bucket: str) -> str:
    return f"{BEAT_PREFIX}.{domain or '_'}.{bucket}"


def rfc3339_ns(ns: int) -> str:
    """`Nats-Time-Stamp` as RePublish writes it: Go's RFC3339Nano in UTC (trailing zeros of the
    fraction dropped, none at all for a whole second)."""
    secs, frac = divmod(ns, 1_000_000_000)
    text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(secs))
    if frac:
        text += "." + f"{frac:09d}".rstrip("0")
    return text + "Z"


class RelayLost(KvcacheError):
    """The relay's consumer can no longer be trusted (deleted, silent, the connection gone)."""


class Relay:
    """One bucket's relay while this sidecar holds the role: a pull consumer over the whole
    bucket (AckNone, in memory, named for the sidecar: `name`), its messages published on
    `subject` in the order they arrive. `run()` returns when `stop()` is called and raises
    RelayLost when the consumer fails; either way the consumer is deleted before it returns
    (or, unanswered, left to its inactive_threshold).

    A delivery the relay's client missed (a consumer-sequence gap) is not chased: the
    followers find the same gap in the stream sequences and fill it themselves. The stored
    headers are those nats-py hands over: a header name the message repeats keeps its last
    value only (KV's own headers are never repeated)."""

    def __init__(self, nc: NatsConnection, bucket: str, *, subject: str, name: str, start_seq: int,
                 api: str = "$JS.API", heartbeat_s: float = 2.0, timeout: float = 5.0,
                 inactive_s: float = RELAY_INACTIVE_S, newest: Callable[[], int] | None = None) -> None:
        self.nc = nc
        self.bucket = bucket
        self.stream = jsapi.kv_stream(bucket)
        self.subject = subject
        self.name = name
        self.start_seq = max(1, start_seq)
        self.api = api
        self.heartbeat_s = heartbeat_s
        self.timeout = timeout
        self.inactive_s = inactive_s
        self.relayed = 0        # messages published
        self.missed = 0         # deliveries the client did not receive (consumer-sequence gaps)
        self.placement_retries = 0  # consumers made again to get one on the stream leader
        self.last_seq = self.start_seq - 1  # the last stream sequence published
        self.stream_last = 0    # the stream's last sequence as the deliveries showed it
        self._next_cseq = 1
        self._pending = 0       # messages asked for and not yet delivered
        self._failure: str | None = None
        self._done = False
        self._heard = False     # has the server answered a pull yet (a delivery, a status)?
        self._early_503 = 0     # pulls answered by no responders before that (see _status)
        self._repull_at = 0.0   # when to pull again after one (monotonic; 0: not waiting)
        self._wake = asyncio.Event()
        self._last_activity = time.monotonic()
        self._created = False
        # The newest stream sequence the sidecar knows of (its feed, the state polls), and
        # since when it has been past what this relay delivered: a consumer that heartbeats
        # but delivers nothing the stream holds (one on a replica cut off from its group's
        # writes) is lost after three heartbeats of that, and the fleet elects again.
        self.newest = newest or (lambda: 0)
        self._behind_since: float | None = None
        self._last_delivery = time.monotonic()

    def stop(self) -> None:
        self._done = True
        self._wake.set()

    async def run(self) -> None:
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox, cb=self._on_msg)
        try:
            await self._create()
            await self._pull(inbox)
            while not self._done:
                try:
                    await asyncio.wait_for(self._wake.wait(), self.heartbeat_s)
                except TimeoutError:
                    pass
                self._wake.clear()
                if self._done:
                    break
                if self._failure:
                    raise RelayLost(self._failure)
                now = time.monotonic()
                silent = now - self._last_activity
                if silent > 3 * self.heartbeat_s:
                    raise RelayLost(f"no heartbeat for {silent:.1f}s")
                self._check_behind(now)
                if self._repull_at:
                    await asyncio.sleep(max(0.0, self._repull_at - now))
                    self._repull_at = 0.0
                    self._last_activity = time.monotonic()
                if self._pending <= RELAY_BATCH // 2:
                    await self._pull(inbox)
        finally:
            self._done = True
            await unsubscribe_quietly(sub)
            if self._created:
                # shielded: a cancelled run (the sidecar stopping) still deletes its consumer
                await asyncio.shield(self._delete(1.0))

    def _check_behind(self, now: float) -> None:
        newest = self.newest()
        if newest <= self.last_seq:
            self._behind_since = None
            return
        if self._behind_since is None:
            self._behind_since = now
        elif now - max(self._behind_since, self._last_delivery) > 3 * self.heartbeat_s:
            raise RelayLost(f"the stream holds sequence {newest}, and nothing past {self.last_seq} "
                            f"was delivered for {now - self._last_delivery:.1f}s")

    async def _create(self) -> None:
        """The relay's consumer, on the stream leader when a few tries get it there.

        nats-server puts an R1 consumer on a random replica of the stream, which reads that
        replica's store: one that lags or is cut off from its group relays late or nothing
        (the latter ends the relay: `_check_behind`). So, as the feed's consumers are
        (kvcache.feed.consumer), a misplaced one is deleted and made again, PLACEMENT_TRIES
        times at most (R3: all miss with p = 0.002); then the last one is kept, since a relay
        a little behind costs the followers only Direct Gets. A start past the stream's end
        (a stream recreated or rewound since the replica last applied) starts at its end
        instead: the followers' feeds replan on such a stream, and a relay waiting for
        sequences the stream will reach only later would relay nothing meanwhile."""
        stream_info = await jsapi.stream_info(self.nc, self.stream, self.timeout, self.api, need_leader=True)
        state = stream_info.get("state") or {}
        last = int(state.get("last_seq", 0) or 0)
        self.stream_last = last
        if self.start_seq > last + 1:
            log.info("%s: the relay starts at the stream's end (%d), not at %d", self.stream, last + 1,
                     self.start_seq)
            self.start_seq, self.last_seq = last + 1, last
        cfg = {
            "name": self.name,
            "ack_policy": "none",
            "replay_policy": "instant",
            "mem_storage": True,
            "num_replicas": 1,
            "inactive_threshold": int(self.inactive_s * 1e9),
            "deliver_policy": "by_start_sequence",
            "opt_start_seq": self.start_seq,
            "filter_subject": f"$KV.{self.bucket}.>",
        }
        request = {"stream_name": self.stream, "config": cfg, "action": "create"}
        for attempt in range(PLACEMENT_TRIES):
            info = await self._create_named(request)
            why = jsapi.misplaced(info, stream_info)
            if why is None:
                return
            if attempt == PLACEMENT_TRIES - 1:
                log.debug("%s: relay consumer kept off the leader: %s", self.stream, why)
                return
            self.placement_retries += 1
            await self._delete(self.timeout)

    async def _create_named(self, request: dict) -> dict:
        """CONSUMER.CREATE under the relay's name; one of the name left by an earlier run (a
        killed relay of this sidecar) is deleted and ours made."""
        subject = f"{self.api}.CONSUMER.CREATE.{self.stream}.{self.name}"
        self._created = True
        try:
            info = await jsapi.api_request(self.nc, subject, request, self.timeout)
        except jsapi.ApiError as e:
            if e.err_code not in NAME_TAKEN:
                raise
        else:
            if not ((info.get("delivered") or {}).get("consumer_seq", 0) or info.get("num_waiting", 0)):
                return info
        log.info("%s: replacing relay consumer %s left by an earlier run", self.stream, self.name)
        await self._delete(self.timeout)
        self._created = True
        return await jsapi.api_request(self.nc, subject, request, self.timeout)

    async def _delete(self, timeout: float) -> None:
        try:
            await jsapi.api_request(self.nc, f"{self.api}.CONSUMER.DELETE.{self.stream}.{self.name}",
                                    None, timeout)
        except jsapi.ApiError:  # not there: nothing to delete
            pass
        except Exception as e:  # not answered: inactive_threshold reaps it
            log.debug("%s: relay consumer %s not deleted: %s", self.stream, self.name, e)
            return
        log.debug("%s: relay consumer %s deleted", self.stream, self.name)
        self._created = False

    async def _pull(self, inbox: str) -> None:
        want = RELAY_BATCH - self._pending
        if want <= 0:
            return
        req = {"batch": want, "max_bytes": max(PULL_MAX_BYTES, 2 * (self.nc.max_payload or 0)),
               "expires": int(max(PULL_EXPIRES_S, 4 * self.heartbeat_s) * 1e9),
               "idle_heartbeat": int(self.heartbeat_s * 1e9)}
        self._pending += want
        await self.nc.publish(f"{self.api}.CONSUMER.MSG.NEXT.{self.stream}.{self.name}",
                              json.dumps(req).encode(), reply=inbox)

    async def _on_msg(self, msg) -> None:
        if self._done or self._failure:
            return
        self._last_activity = time.monotonic()
        meta = parse_ack(msg.reply) if msg.reply else None
        if meta is None:
            self._status(msg.headers or {})
            return
        self._pending -= 1
        self._heard = True
        if meta.consumer_seq != self._next_cseq:
            self.missed += max(0, meta.consumer_seq - self._next_cseq)
            log.debug("%s: relay missed deliveries %d..%d", self.stream, self._next_cseq, meta.consumer_seq - 1)
        self._next_cseq = meta.consumer_seq + 1
        headers = dict(msg.headers or {})
        headers["Nats-Stream"] = self.stream
        headers["Nats-Subject"] = msg.subject
        headers["Nats-Sequence"] = str(meta.stream_seq)
        headers["Nats-Time-Stamp"] = rfc3339_ns(meta.timestamp_ns)
        try:
            await self.nc.publish(self.subject, msg.data, headers=headers)
        except Exception as e:
            self._fail(f"publishing failed: {e}")
            return
        self.relayed += 1
        self.last_seq = meta.stream_seq
        self._last_delivery = self._last_activity
        self.stream_last = max(self.stream_last, meta.stream_seq + meta.pending)
        if self._pending <= RELAY_BATCH // 2:
            self._wake.set()

    def _status(self, headers: dict) -> None:
        status = headers.get("Status", "")
        desc = headers.get("Description", "")
        self._heard = self._heard or status != "503"
        if status == "100":
            last_c = int(headers.get("Nats-Last-Consumer", 0) or 0)
            if last_c >= self._next_cseq:  # deliveries lost on the way: the followers fill them
                self.missed += last_c - self._next_cseq + 1
                self._next_cseq = last_c + 1
            return
        if status in ("404", "408") or (status == "409" and any(d in desc for d in REQUEST_ENDED)):
            pending = headers.get("Nats-Pending-Messages")
            self._pending = max(0, self._pending - int(pending or 0)) if pending is not None else 0
            self._wake.set()
            return
        if status == "503" and not self._heard and self._early_503 < EARLY_503_RETRIES:
            # No responders to a pull right after the creation: on a cluster the new consumer's
            # interest may not have reached this client's server yet. Asked again shortly.
            self._early_503 += 1
            self._pending = 0
            self._repull_at = time.monotonic() + 0.1 * self._early_503
            self._wake.set()
            return
        if status in ("409", "400", "503"):
            self._fail(f"consumer ended: {status} {desc}".strip())

    def _fail(self, why: str) -> None:
        self._failure = self._failure or why
        self._wake.set()


class RelayNumbers(NamedTuple):
    """One bucket's relay as this sidecar sees it (INFO, the metrics)."""

    relaying: int       # 1 while this sidecar relays the bucket
    relayed: int        # messages it has published on the changes subject since start
    lag: int            # stream messages not yet relayed (0 when not relaying)
    role_changes: int   # times it took or left the role since start


@dataclass
class Seat:
    """One bucket's place in the election, as this sidecar sees it."""

    bucket: str
    period: float
    position: Callable[[], int]     # the replica's applied sequence
    eligible: Callable[[], bool]    # may this sidecar relay now (its replica synced)?
    newest: Callable[[], int]       # the newest stream sequence the sidecar's feed saw
    silent_since: float             # when the silence this sidecar waits out began
    heard: dict[str, float] = field(default_factory=dict)  # relay id -> when its last beat came
    previous_last: int | None = None  # the last sequence the previous relay published
    relay: Relay | None = None
    task: asyncio.Task | None = None     # the relay's run
    last_beat: float = 0.0
    role_changes: int = 0
    relayed: int = 0                # by this sidecar's relays before the current one
    last_heard: float = float("-inf")  # when a relay's beat last came (kept when it leaves)
    on_relay: Callable[[], None] | None = None  # told when a relay is heard or this sidecar takes the role
    missed: int = 0                 # deliveries its relays' client did not receive (the followers fill them)

    @property
    def relaying(self) -> bool:
        return self.relay is not None


class RelayElection:
    """This sidecar's side of the relays of the buckets it follows (module docstring): one
    beat subscription and one decision loop per bucket; `relaying(bucket)` and `seats` for
    INFO and the metrics."""

    def __init__(self, nc: NatsConnection, domain: str | None = None, *, sid: str, name: str,
                 clock: Callable[[], float] = time.monotonic, heartbeat_s: float = 2.0,
                 timeout: float = 5.0, inactive_s: float = RELAY_INACTIVE_S) -> None:
        self.nc = nc
        self.domain = domain
        self.id = sid
        self.name = name            # the relay consumers' name (kvcache.feed.names.relay_name)
        self.rank = _rank(sid)
        self._clock = clock
        self.heartbeat_s = heartbeat_s
        self.timeout = timeout
        self.inactive_s = inactive_s
        self.seats: dict[str, Seat] = {}
        self._subs: list = []
        self._loops: list[asyncio.Task] = []

    async def follow(self, bucket: str, period: float, position: Callable[[], int],
                     eligible: Callable[[], bool], newest: Callable[[], int] | None = None,
                     on_relay: Callable[[], None] | None = None) -> None:
        """Take part in `bucket`'s election, deciding every quarter `period`; `on_relay` is
        called at each beat of a relay and when this sidecar takes the role (its feed may
        then follow the relay's subject: kvcache.feed.feed.Feed.follow_relay)."""
        seat = Seat(bucket, period, position, eligible, newest or (lambda: 0), silent_since=self._clock(),
                    on_relay=on_relay)
        self.seats[bucket] = seat

        async def on_beat(msg) -> None:
            self._on_beat(seat, msg.data)
        self._subs.append(await self.nc.subscribe(beat_subject(self.domain, bucket), cb=on_beat))
        self._loops.append(asyncio.get_running_loop().create_task(self._loop(seat), name=f"relay:{bucket}"))

    def relaying(self, bucket: str) -> bool:
        seat = self.seats.get(bucket)
        return seat is not None and seat.relaying

    def heard_within(self, bucket: str, seconds: float) -> bool:
        """Is `bucket` relayed for the fleet, as far as this sidecar knows: it relays it
        itself, or a relay's beat came within `seconds`?"""
        seat = self.seats.get(bucket)
        if seat is None:
            return False
        if seat.relaying:
            return True
        return self._clock() - seat.last_heard <= seconds

    def relayed(self, bucket: str) -> int:
        seat = self.seats[bucket]
        return seat.relayed + (seat.relay.relayed if seat.relay else 0)

    def lag(self, bucket: str) -> int:
        """The newest stream sequence known (state polls, the relay's deliveries) minus the
        last one relayed; 0 when not relaying."""
        seat = self.seats[bucket]
        relay = seat.relay
        if relay is None:
            return 0
        return max(0, max(seat.newest(), relay.stream_last) - relay.last_seq)

    def numbers(self, bucket: str) -> RelayNumbers | None:
        """INFO's and the metrics' view of `bucket`'s relay on this sidecar; None when this
        sidecar takes no part in it (relays off, or the stream RePublishes itself)."""
        seat = self.seats.get(bucket)
        if seat is None:
            return None
        return RelayNumbers(int(seat.relaying), self.relayed(bucket), self.lag(bucket), seat.role_changes)

    async def close(self) -> None:
        """Leave every role (consumers deleted, the fleet told), then stop listening."""
        for task in self._loops:
            task.cancel()
        if self._loops:
            await asyncio.wait(self._loops)
        self._loops.clear()
        for seat in self.seats.values():
            if seat.relaying:
                await self._leave(seat, "stopping")
        await unsubscribe_quietly(*self._subs)
        self._subs.clear()

    # ------------------------------------------------------------------ the decision

    def decide(self, seat: Seat) -> str | None:
        """What this sidecar must do now for `seat`'s bucket: "take", "leave: <why>" or None."""
        now = self._clock()
        window = HEARD_WITHIN_PERIODS * seat.period
        for sid, when in list(seat.heard.items()):  # relays long silent: their silence began then
            if now - when > 2 * window:
                del seat.heard[sid]
                seat.silent_since = max(seat.silent_since, when)
        if seat.relaying:
            if not self.nc.is_connected:
                return "leave: the NATS connection was lost"
            lower = [sid for sid, when in seat.heard.items() if sid < self.id and now - when <= window]
            if lower:
                return f"leave: {min(lower)}, of lower id, relays it"
            return None
        if not self.nc.is_connected or not seat.eligible():
            return None
        since = max([seat.silent_since, *seat.heard.values()])
        if now - since > window + self.rank * seat.period:
            return "take"
        return None

    def _on_beat(self, seat: Seat, data: bytes) -> None:
        try:
            doc = json.loads(data)
            sender, relaying, last = str(doc["from"]), bool(doc["relaying"]), int(doc["last_seq"])
        except (ValueError, KeyError, TypeError):
            log.warning("bucket %s: a relay beat that is not kvcache's on %s: ignored",
                        seat.bucket, beat_subject(self.domain, seat.bucket))
            return
        if sender == self.id:
            return
        now = self._clock()
        seat.previous_last = last
        if relaying:
            seat.heard[sender] = seat.last_heard = now
            if seat.on_relay is not None:
                seat.on_relay()
        elif seat.heard.pop(sender, None) is not None:
            # a relay left: if it was the only one heard, the silence is as long as a lost
            # relay's would be by now
            window = HEARD_WITHIN_PERIODS * seat.period
            for sid in [sid for sid, when in seat.heard.items() if now - when > window]:
                del seat.heard[sid]
            if not seat.heard:
                seat.silent_since = now - window

    def _next_look(self, seat: Seat) -> float:
        """Seconds to the next decision: a quarter period, or sooner when this sidecar's wait
        for the role ends before (the ranks, fractions of a period apart, must not be
        rounded to the same look)."""
        tick = seat.period / 4
        if seat.relaying:
            return tick
        since = max([seat.silent_since, *seat.heard.values()])
        due = since + HEARD_WITHIN_PERIODS * seat.period + self.rank * seat.period - self._clock()
        return min(tick, max(0.005, due + 0.001))

    async def _loop(self, seat: Seat) -> None:
        while True:
            await asyncio.sleep(self._next_look(seat))
            try:
                await self._step(seat)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the next turn decides again
                log.warning("bucket %s: relay election: %s", seat.bucket, e)

    async def _step(self, seat: Seat) -> None:
        if seat.task is not None and seat.task.done():  # the relay failed: step down, wait again
            why = _failure(seat.task)
            await self._leave(seat, why)
            return
        decision = self.decide(seat)
        if decision == "take":
            await self._take(seat)
        elif decision is not None:
            await self._leave(seat, decision.removeprefix("leave: "))
        elif seat.relaying and self._clock() - seat.last_beat >= seat.period:
            await self._beat(seat, True)

    def _start_seq(self, seat: Seat) -> int:
        applied = seat.position()
        start = applied
        if seat.previous_last is not None and seat.previous_last < applied:
            start = max(seat.previous_last, applied - REPLAY_MAX)
        return start + 1

    async def _take(self, seat: Seat) -> None:
        start = self._start_seq(seat)
        seat.relay = Relay(self.nc, seat.bucket, subject=changes_subject(self.domain, seat.bucket),
                           name=self.name, start_seq=start, heartbeat_s=self.heartbeat_s,
                           timeout=self.timeout, inactive_s=self.inactive_s, newest=seat.newest)
        seat.role_changes += 1
        log.info("bucket %s: relaying for the fleet (from sequence %d)", seat.bucket, start)
        await self._beat(seat, True)  # the others back off before the consumer exists
        seat.task = asyncio.get_running_loop().create_task(seat.relay.run(), name=f"relay-run:{seat.bucket}")
        if seat.on_relay is not None:  # its own feed follows the relay's subject too
            seat.on_relay()

    async def _leave(self, seat: Seat, why: str) -> None:
        relay, task = seat.relay, seat.task
        if relay is None:
            return
        relay.stop()
        if task is not None:
            # its consumer's deletion is bounded (Relay.run); past that it is cut short
            done, _ = await asyncio.wait({task}, timeout=self.timeout + 2)
            if not done:
                task.cancel()
                await asyncio.wait({task})
            if not task.cancelled():
                task.exception()  # its failure is `why` already
        seat.relayed += relay.relayed
        seat.missed += relay.missed
        seat.relay, seat.task = None, None
        seat.role_changes += 1
        seat.silent_since = self._clock()  # not again before a full wait
        # its own feed, following the subject, waits for the next relay as the fleet does
        seat.last_heard = max(seat.last_heard, seat.silent_since)
        log.info("bucket %s: no longer relaying (%s)", seat.bucket, why)
        await self._beat(seat, False, relay.last_seq)

    async def _beat(self, seat: Seat, relaying: bool, last: int | None = None) -> None:
        if last is None:
            last = seat.relay.last_seq if seat.relay is not None else 0
        payload = json.dumps({"from": self.id, "relaying": relaying, "last_seq": last,
                              "sent_ns": time.time_ns()}, separators=(",", ":")).encode()
        seat.last_beat = self._clock()
        try:
            await self.nc.publish(beat_subject(self.domain, seat.bucket), payload)
        except Exception as e:  # the next beat tries again; silence only moves the role
            log.debug("bucket %s: relay beat not sent: %s", seat.bucket, e)


def _rank(sid: str) -> float:
    """A fraction of a period this sidecar waits beyond the others' silence, from its id: the
    ids' order when they are hex (the lowest takes first and also wins a tie), else a hash."""
    head = sid[:8]
    try:
        return int(head, 16) / (1 << (4 * len(head))) if head else 0.0
    except ValueError:
        return int(hashlib.sha256(sid.encode()).hexdigest()[:8], 16) / (1 << 32)


def _failure(task: asyncio.Task) -> str:
    if task.cancelled():
        return "cancelled"
    e = task.exception()
    return str(e) if e is not None else "its consumer ended"
