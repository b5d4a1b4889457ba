"""Freshness: how current one bucket's replica is known to be.

Two witnesses, and the replica is as stale as the older of them says:
- The consumer's word. A caught-up consumer hears from its server at least once a heartbeat;
  while it does, the replica is current. Silence, an interruption or catching up makes the
  replica as old as the last time it was caught up. Caught up counts only once written:
  deliveries received and not applied (a full disk, a map that may not grow: the feed
  retries them, kvcache.feed.unwritable) leave the replica as old as the last time it had
  applied everything it received, however often the server says there is nothing more.
- Quorum evidence (kvcache.feed.quorum), for a stream replicated in a cluster: a leader cut off
  from its peers keeps heartbeating and reports nothing pending, so the consumer's word proves
  nothing there; the replica counts as current only as of what the leader, heard by a quorum
  of its group, has shown, and only once the replica holds that sequence.

`Freshness` is one feed's (kvcache.feed.feed.Feed composes it): the consumer loop records what
it hears, the state polls hand in the stream's infos, and the read policy, INFO and readiness
ask for ages against a bound. Kept apart from the consumer loop, which only reports to it.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ..config import BucketConfig
from .quorum import RAFT_HEARTBEAT_S, Evidence, Proofs, evidence, needs_quorum

log = logging.getLogger("kvcache.feed")

# Heartbeats a caught-up feed may miss before its replica counts as behind since the last
# word heard (Freshness.ages_ms); the sidecar warns at start of a max_stale_ms under this many.
SILENT_HEARTBEATS = 2
# The least max_stale_ms a replicated stream's replica can keep on an idle stream: quorum
# evidence is up to a raft heartbeat (kvcache.feed.quorum.RAFT_HEARTBEAT_S) plus a state poll
# (Maintenance.watch_period) old when it arrives; a start warning names buckets below it.
QUORUM_MIN_STALE_MS = 1500
NEVER = (1 << 63) - 1  # fresh_until_ns when no age runs


class Freshness:
    """What one feed knows of its replica's age. The consumer loop sets `caught_up`,
    `interrupted`, `heard_ns` and `last_msg_ns` as it goes; `applied`, in the questions, is
    the replica's applied sequence (the evidence it reached depends on it)."""

    def __init__(self, cfg: BucketConfig, heartbeat_s: float, heard_ns: int,
                 clock: Callable[[], int] = time.time_ns) -> None:
        self.cfg = cfg
        # The wall clock every age is measured on (ns); tests set their own.
        self.clock = clock
        # The consumer has applied everything the server had, and says so.
        self.caught_up = False
        # Catching up after an interruption (start, lost consumer, reconnect): see ages_ms.
        self.interrupted = True
        # The last time the consumer said the replica was caught up and the replica held
        # everything it had delivered (set only after the write: Feed._on_batch; the meta's
        # fresh_at_ns is that moment bounded by the quorum evidence: what LocalReader goes by).
        self.heard_ns = heard_ns
        self.last_msg_ns = 0  # the stream timestamp of the newest message applied
        # A caught-up feed hears from the server at least once a heartbeat (an idle heartbeat
        # when nothing changes). Silence past SILENT_HEARTBEATS of them is a link that may have
        # stalled unnoticed: the replica is then only known current as of the last word heard.
        self.expect_heartbeats(heartbeat_s)
        # `quorum`: the stream needs quorum evidence (replicated in a cluster); `proofs`: the
        # evidence seen so far.
        self.quorum = False
        self.proofs = Proofs()
        self._born_ns = clock()

    def expect_heartbeats(self, heartbeat_s: float) -> None:
        """The consumer now made asks its server for an idle heartbeat every `heartbeat_s`
        (Feed.consumer_heartbeat_s): silence counts past SILENT_HEARTBEATS of those."""
        self._silence_ns = int(SILENT_HEARTBEATS * heartbeat_s * 1e9)

    def lag_ms(self, applied: int) -> int:
        """What INFO, readiness and the lag metric show: 0 while caught up, heard from, and
        (a replicated stream) vouched for by a quorum within max_stale_ms; else the age of the
        newest state we are sure to hold (`ages_ms`). Decisions use `ages_ms` itself against
        their own bound (`within`): a quorum's evidence is always some hundreds of ms old
        (polled every watch_period), which is no lag to show while it is within bound."""
        consumer, evidence = self.ages_ms(applied)
        return consumer if evidence <= self.cfg.max_stale_ms else max(consumer, evidence)

    def within(self, max_stale_ms: int, applied: int) -> bool:
        """Is a replica at `applied` no staler than the bound, by both witnesses? (Whether it
        is synced at all is the feed's question.)"""
        consumer, evidence = self.ages_ms(applied)
        return consumer <= max_stale_ms and evidence <= max_stale_ms

    def fresh_until_ns(self, max_stale_ms: int, applied: int) -> int:
        """The last wall-clock moment (ns) at which `within(max_stale_ms, applied)` holds if
        nothing else changes: the same two witnesses, as a deadline instead of a yes or no, for
        a reader in another process that cannot ask (kvcache.supervisors.board: the workers' GET
        path compares it with its own clock). 2**63-1: no age runs."""
        span = (max_stale_ms + 1) * 1_000_000 - 1  # an age in whole ms is <= the bound up to here
        heard = self.heard_ns
        if self.caught_up:
            until = heard + max(self._silence_ns, span) if heard else NEVER
        else:
            fresh = heard if self.interrupted else max(heard, self.last_msg_ns)
            until = fresh + span if fresh else NEVER
        if self.quorum:
            best = self.proofs.reached(applied)
            until = min(until, (best.as_of_ns if best is not None else self._born_ns) + span)
        return until

    def ages_ms(self, applied: int) -> tuple[int, int]:
        """The replica's age by the consumer's word, and by the quorum evidence it reached
        (0 for a stream with one copy, where the consumer's word is enough).

        Caught up counts only while the server keeps saying so: past two heartbeats of silence
        the age runs from the last time it did, so a link that stalls without closing (no
        disconnect, no error: the consumer is declared lost only after three heartbeats) turns
        the replica stale max_stale_ms after the last word, not three heartbeats later.

        While catching up after an interruption, the age counts from the last time we were
        caught up, not from the newest message applied: the replica then passes through the
        stream's past states, and reads that went to the peers during the outage may already
        have served newer revisions; serving an intermediate state locally would take those
        keys back in time (seen in tests/test_faults.py with a stream leader killed during
        writes: revision 806 read from a peer, then 406 from the catching-up replica).

        A replicated stream's consumer may be caught up with a store a partition left behind,
        its server heartbeating all the while: its age is also that of the newest quorum
        evidence whose sequence the replica holds (kvcache.feed.quorum)."""
        now = self.clock()
        heard = self.heard_ns
        if self.caught_up:
            lag = (now - heard) // 1_000_000 if heard and now - heard > self._silence_ns else 0
        else:
            fresh = heard if self.interrupted else max(heard, self.last_msg_ns)
            lag = max(0, (now - fresh) // 1_000_000) if fresh else 0
        if not self.quorum:
            return lag, 0
        best = self.proofs.reached(applied)
        return lag, max(0, (now - (best.as_of_ns if best is not None else self._born_ns)) // 1_000_000)

    def proven_with(self, applied: int, now: int) -> int:
        """The moment a replica at `applied`, caught up at `now`, is known to hold every
        acknowledged write as of: `now` itself for a stream with one copy, else the newest
        quorum evidence at or below `applied` (0: none yet). `applied` may be a batch's, not
        yet the meta's: nothing is changed."""
        if not self.quorum:
            return now
        best = self.proofs.at(applied)
        return min(now, best.as_of_ns) if best is not None else 0

    def proven_within(self, ms: int) -> bool:
        """Has a quorum shown this stream's state within `ms` (any evidence, reached or not)?
        Always for a stream with one copy."""
        return not self.quorum or self.proofs.required(self.clock() - ms * 1_000_000) is not None

    def required(self) -> Evidence | None:
        """The evidence a fallback answer must match (Feed.fence): the least demanding one a
        quorum showed within max_stale_ms; None when there is none."""
        return self.proofs.required(self.clock() - self.cfg.max_stale_ms * 1_000_000)

    def note(self, info: dict, sent_ns: int, applied: int) -> Evidence | None:
        """A STREAM.INFO (or STREAM.LIST entry) asked at `sent_ns`, the replica at `applied`:
        keep what it proves, and whether the stream needs such proof at all."""
        quorum = needs_quorum(info)
        if quorum and not self.quorum and self.cfg.max_stale_ms < QUORUM_MIN_STALE_MS:
            log.warning("bucket %s: max_stale_ms %d is below %d ms: its stream is replicated, and a "
                        "quorum's word about it is up to a raft heartbeat (%g s) plus a state poll "
                        "(max_stale_ms / 4 at this bound) old, so the replica will often count as stale",
                        self.cfg.name, self.cfg.max_stale_ms, QUORUM_MIN_STALE_MS, RAFT_HEARTBEAT_S)
        self.quorum = quorum
        ev = evidence(info, sent_ns)
        if ev is not None:
            self.proofs.add(ev, applied)
        return ev
