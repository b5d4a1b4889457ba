"""Quorum evidence: what proves that a replica holds every write a bucket acknowledged.

A consumer's idle heartbeats come from a local timer on the server that hosts it, and the
stream's leader answers STREAM.INFO from its own store. A leader cut off from its peers keeps
doing both for 10-20 s after the majority elected another leader and acknowledged new writes
(docs/sources.md, "A partitioned stream leader": nats-server's raft timers, measured), so
"caught up, heartbeats arriving" proves nothing about a clustered stream. What does:

A stream's info, as its leader answers it, lists each follower's `active`: the time since
the leader last heard from it. A follower that voted for a newer term answers the leader's
appends with that term, and the leader steps down on the first such answer. So if, when the
leader built the answer, `need` followers (a quorum of the group less the leader) had been
heard from within `a`, no new leader can have been elected before `sent - a` (`sent`: when
we asked; the leader answered later): a new term needs the votes of a quorum, and a quorum
must include one of those followers (the group has `n` members, a quorum `n // 2 + 1`, so
`need = n - quorum`). Every write acknowledged before `sent - a` was therefore committed in
the leader's term or an earlier one, and is in the leader's store: its `last_seq` is at least
that write's sequence. A replica that has applied `last_seq` holds every write acknowledged
before `sent - a`: its staleness is at most `now - (sent - a)`. No clocks are compared: `a`
is a duration measured by the leader, `sent` and `now` are ours.

A stream of one replica has no peers to lose: its server's answer is its own proof. The
residual window is the leader's own stepdown after the first higher-term answer (it is
queued, not immediate): microseconds to a millisecond, far below any max_stale_ms.

`Evidence` is one such observation; `Proofs` keeps the few a feed needs.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

# Followers the stream's raft leader hears from at least once a second when idle (its
# heartbeat, nats-server raft.go hbInterval): `active` stays under this while healthy.
RAFT_HEARTBEAT_S = 1.0
# The idle heartbeat a consumer asks for when quorum evidence bounds its replica's staleness
# and it reads every message of the stream (kvcache.feed.feed.Feed.consumer_heartbeat_s): a
# backstop only, since a stalled consumer shows sooner as evidence it did not deliver.
QUORUM_HEARTBEAT_S = 30.0
# A strong read (KV.GET CONSISTENCY strong) is answered by the server that believes it leads
# (MSG.GET), which shows every write acknowledged before the read only while no other leader
# can have acknowledged one. Followers that lose the leader together elect another no sooner
# than an election timeout (nats-server raft.go: 4-9 s) after they last heard from it, at most
# a raft heartbeat before the leader's evidence of them ends. So while a quorum showed the
# stream's state within STRONG_EVIDENCE_MS (evidence no older than 4 s less that heartbeat,
# less a second for the read's own round trip), no such leader exists yet (Router.strong_gate;
# docs/architecture.md, "What a strong read rests on").
RAFT_ELECTION_MIN_S = 4.0
STRONG_EVIDENCE_MS = int((RAFT_ELECTION_MIN_S - RAFT_HEARTBEAT_S - 1.0) * 1000)
# Proofs kept that the replica has not reached yet (writes in flight): more than a poll's worth
PENDING_MAX = 16
# A Fence's anchor comes back, value and all, with each fenced read that asks for it: the
# feed prefers a key whose record is at most this big (kvcache.feed.feed.Feed._note_anchor).
ANCHOR_MAX_BYTES = 1024


@dataclass(frozen=True)
class Evidence:
    """The stream's leader, a quorum of its group with it, held `seq` at `as_of_ns` (wall
    clock, as the replica's meta records freshness) or later."""

    as_of_ns: int
    seq: int
    leader: str


def group_size(info: dict[str, Any]) -> int:
    """Members of the stream's raft group: the configured replicas, or the listed peers when
    more (a peer being replaced is still a voter)."""
    cluster = info.get("cluster") or {}
    listed = 1 + len(cluster.get("replicas") or [])
    return max(int((info.get("config") or {}).get("num_replicas", 1) or 1), listed)


def needs_quorum(info: dict[str, Any]) -> bool:
    """Is more than one server's word needed to call this stream's state current? Only for a
    stream replicated in a cluster; a lone server (no cluster) or an R1 stream is its own proof."""
    return info.get("cluster") is not None and group_size(info) > 1


def evidence(info: dict[str, Any], sent_ns: int) -> Evidence | None:
    """What a STREAM.INFO (or STREAM.LIST entry) asked at `sent_ns` proves, or None when it
    proves nothing: no leader, or too few followers heard from (see the module docstring)."""
    state = info.get("state") or {}
    seq = int(state.get("last_seq", 0) or 0)
    cluster = info.get("cluster")
    if not needs_quorum(info):
        return Evidence(sent_ns, seq, (cluster or {}).get("leader") or "")
    assert cluster is not None
    leader = cluster.get("leader") or ""
    if not leader:
        return None
    n = group_size(info)
    need = n - (n // 2 + 1)
    if need == 0:  # two members: no quorum forms without the leader, which has every write
        return Evidence(sent_ns, seq, leader)
    # `active` 0 is "never heard from": nats-server reports a zero last-seen time as 0
    # (clusterInfo), and a follower turned leader starts with every other follower's zeroed
    # (raft.go resets them on a leader change), so a leader cut off right after its election
    # would otherwise show a follower "heard from just now" for as long as it stays cut off.
    # A follower really heard from is always some nanoseconds ago.
    actives = sorted(int(r["active"]) for r in cluster.get("replicas") or []
                     if not r.get("offline") and r.get("active"))
    if len(actives) < need:
        return None
    return Evidence(sent_ns - actives[need - 1], seq, leader)


@dataclass(frozen=True)
class Fence:
    """What a fallback answer must show to count as current (Router.fence): the answering
    server held stream sequence `seq` (its Direct Get batch reply names its last sequence,
    Nats-UpTo-Sequence), so it holds every write the bucket acknowledged before the evidence
    of `seq`. `anchor`: a key known to have a message, asked for beside a key read that may
    have none (kvcache.read.peer.Peer._fenced_get), so that a "no such key" reply still
    carries the server's sequence; the feed picks a small one when it can (ANCHOR_MAX_BYTES).
    seq 0: nothing to show (a stream with one copy)."""

    seq: int
    anchor: str = ""


NO_FENCE = Fence(0)


class Proofs:
    """A feed's evidence: the newest the replica has reached (`best`), the ones whose sequence
    it has not applied yet (their writes are on the way: promoted when applied), and the last
    few observed (`required`, for fallback reads)."""

    def __init__(self) -> None:
        self.best: Evidence | None = None
        self._pending: deque[Evidence] = deque(maxlen=PENDING_MAX)
        self._recent: deque[Evidence] = deque(maxlen=PENDING_MAX)

    @property
    def newest(self) -> Evidence | None:
        return self._recent[-1] if self._recent else None

    def add(self, ev: Evidence, applied: int) -> None:
        self._recent.append(ev)
        if ev.seq <= applied:
            if self.best is None or ev.as_of_ns > self.best.as_of_ns:
                self.best = ev
        else:
            self._pending.append(ev)
        self.reached(applied)

    def reached(self, applied: int) -> Evidence | None:
        """The newest evidence whose sequence the replica (at `applied`) holds."""
        pending = self._pending
        while pending and pending[0].seq <= applied:
            ev = pending.popleft()
            if self.best is None or ev.as_of_ns > self.best.as_of_ns:
                self.best = ev
        return self.best

    def at(self, applied: int) -> Evidence | None:
        """`reached` for a replica about to be at `applied`, changing nothing (its write may
        still fail)."""
        best = self.best
        for ev in self._pending:
            if ev.seq <= applied and (best is None or ev.as_of_ns > best.as_of_ns):
                best = ev
        return best

    def required(self, since_ns: int) -> Evidence | None:
        """The least demanding evidence observed as of `since_ns` or later: an answer from a
        server holding its sequence holds every write acknowledged before `since_ns`. None
        when there is none: nothing can show such an answer current."""
        fit = [ev for ev in self._recent if ev.as_of_ns >= since_ns]
        return min(fit, key=lambda ev: ev.seq) if fit else None

    def clear(self) -> None:
        """The stream was renumbered (recreated, rewound): its old sequences prove nothing."""
        self.best = None
        self._pending.clear()
        self._recent.clear()
