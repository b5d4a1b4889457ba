"""The read guarantees as a model: for every read form, feed state and holding, which sources
may answer and the lowest revision each may answer with (docs/architecture.md, "Consistency";
docs/commands.md, KV.GET, MULTI/EXEC, Client-side caching, Streams; docs/configuration.md,
max_stale_ms and serve_stale).

This file is the spec, written once; tests/test_guarantees.py carries each row out against
the real read path in process (tests/support/guarantees_world.py) and checks the answer here.
Nothing in it asks kvcache: a state is described by what happened (its story) and the facts a
reader of the documentation can derive from that story, never by what the code concludes.

One bucket `b` (max_stale_ms BOUND_MS, heartbeat_ms HEARTBEAT_MS, a near cache) and three keys:
`in.k` (replicated), `in.f` (replicated, a filler) and `out.o` (outside the filters `in.>`:
read from NATS or the near cache). The leader's truth is a history of writes, each acknowledged
at a moment relative to the read (`at_ms`, negative: before it); a value names its write
(`g1:in.k@8`), so any answer, a GET's too, says which revision it is.

The rule, in one sentence per guarantee:
- bounded staleness: a read with bound B (max_stale_ms, or MAXSTALE) answers the key as of
  B before it arrived or later; on a link that said "caught up" and went silent, B is floored
  at two heartbeats (docs/commands.md: "floored at that on a silent one");
- CONSISTENCY strong: the latest acknowledged revision, from the stream's leader only;
- MINREV r: at or above r, never from a stale replica;
- monotonic reads: never below a revision of the key already handed out from NATS (the
  ledger's floors and holds: sidecar-wide), in the stream's current numbering (a recreated
  bucket starts again);
- the replica (or the near cache, which the same feed keeps) answers only while its feed
  vouches for it: synced and fresh within the read's bound;
- serve_stale: when NATS cannot answer, a plain read of a replicated key may get the replica's
  last known value, marked `stale`, never below what was handed out;
- an error only where no allowed source can answer (NATS unreachable, or unable to show an
  answer current for lack of quorum evidence, and the replica may not answer).
Per form, what the documentation says differently is written beside the form's rule below.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

BUCKET = "b"
KEY, FILLER, OUTSIDE = "in.k", "in.f", "out.o"
BOUND_MS = 1000                # the bucket's max_stale_ms
HEARTBEAT_MS = 500             # heartbeat_ms
SILENCE_MS = 2 * HEARTBEAT_MS  # kvcache.feed.freshness.SILENT_HEARTBEATS heartbeats
MAXSTALE_TIGHT, MAXSTALE_LOOSE = 200, 5000
LATEST = -1  # MINREV of the key's latest revision


@dataclass(frozen=True)
class Write:
    """One write the bucket acknowledged: stream sequence (= the key's revision), key, when
    (ms relative to the read), the stream's numbering (2: the bucket was recreated), and extra
    value bytes (a write too big for a full disk)."""

    seq: int
    key: str
    at_ms: int
    gen: int = 1
    pad: int = 0


@functools.cache
def value_of(w: Write) -> bytes:
    return f"g{w.gen}:{w.key}@{w.seq}".encode() + (b"#" * w.pad)


def parse_value(value: bytes) -> tuple[int, str, int]:
    """(numbering, key, revision) of a value written by value_of."""
    text = bytes(value).split(b"#", 1)[0].decode()
    gen, rest = text.split(":", 1)
    key, seq = rest.rsplit("@", 1)
    return int(gen[1:]), key, int(seq)


# The leader's truth. in.k: 2 long ago, 4 and 6 older than the bound, 8 within it (300 ms).
HISTORY = (
    Write(1, FILLER, -20_000), Write(2, KEY, -20_000), Write(3, OUTSIDE, -20_000),
    Write(4, KEY, -3_000), Write(5, OUTSIDE, -3_000),
    Write(6, KEY, -2_000), Write(7, OUTSIDE, -2_000),
    Write(8, KEY, -300), Write(9, OUTSIDE, -300),
    Write(10, FILLER, -100),
)
# The bucket deleted and created again 1500 ms before the read: a new stream, numbered from 1.
RECREATED_AT_MS = -1_500
HISTORY_RECREATED = (
    *(w for w in HISTORY if w.at_ms < RECREATED_AT_MS),
    Write(1, KEY, -1_400, 2), Write(2, OUTSIDE, -1_400, 2), Write(3, FILLER, -1_400, 2),
    Write(4, KEY, -200, 2), Write(5, OUTSIDE, -200, 2),
)
# A disk that fills: the first write after sequence 5 is larger than the replica's map
# (1 MiB in the executor).
HISTORY_DISK = (
    *HISTORY[:5],
    Write(6, FILLER, -2_000, pad=5 << 18), Write(7, KEY, -2_000), Write(8, OUTSIDE, -2_000),
    Write(9, KEY, -300), Write(10, OUTSIDE, -300),
)


@dataclass(frozen=True)
class State:
    """A feed state at the moment of the read, as its story makes it (the executor plays the
    story on the real feed; `replica` and `applied` are checked against the replica it left).
    `age_ms`: how old the replica is by the documented witnesses (the consumer's word, and a
    replicated stream's quorum evidence; None: not synced, nothing vouches); `silent`: the
    consumer said "caught up" and has been silent since (the two-heartbeat floor applies);
    `quorum`: a quorum's evidence within the bound exists, so a NATS answer can be shown
    current (always, for a stream with one copy)."""

    name: str
    story: str
    history: tuple[Write, ...]
    applied: int
    synced: bool
    age_ms: int | None
    replica: dict[str, int] = field(default_factory=dict)  # key -> revision the replica's record holds
    silent: bool = False
    quorum: bool = True
    gen: int = 1
    follower_seq: int | None = None  # Direct Gets answered by a member that holds up to this


STATES = (
    State("current", "caught up, last heard 50 ms ago", HISTORY, 10, True, 0,
          {KEY: 8, FILLER: 10}, silent=True),
    State("behind within the bound", "caught up at 7 400 ms ago; 8-10 on their way (silent < 2 heartbeats)",
          HISTORY, 7, True, 0, {KEY: 6, FILLER: 1}, silent=True),
    State("behind beyond the bound", "catching up slowly: applied 4-5 (acked 3000 ms ago), more pending",
          HISTORY, 5, True, 3_000, {KEY: 4, FILLER: 1}),
    State("stalled link, no evidence", "caught up at 5 2500 ms ago, then silence (no error, no disconnect)",
          HISTORY, 5, True, 2_500, {KEY: 4, FILLER: 1}, silent=True),
    State("resyncing", "the stream dropped 1-4 while the consumer was away: a full resync, part done",
          HISTORY, 6, False, None, {KEY: 6, FILLER: 1}),
    State("consumer recreated", "caught up at 7 600 ms ago, consumer lost, the new one delivered 8 (more pending)",
          HISTORY, 8, True, 600, {KEY: 8, FILLER: 1}),
    State("bucket recreated", "the bucket was deleted and created 1500 ms ago; resynced to the new stream",
          HISTORY_RECREATED, 3, True, 0, {KEY: 1, FILLER: 3}, silent=True, gen=2),
    State("no quorum shown", "replicated stream: the consumer's server was cut off at 5; no quorum "
          "evidence since 2700 ms ago", HISTORY, 5, True, 2_700, {KEY: 4, FILLER: 1}, quorum=False),
    State("follower lagging", "replicated stream, evidence 400 ms old at 7; Direct Gets answered by a "
          "follower holding up to 7", HISTORY, 7, True, 400, {KEY: 6, FILLER: 1}, follower_seq=7),
    State("deliveries not applied", "disk full: applied 5 2500 ms ago; every later batch received, "
          "its write failed (LMDB map full)", HISTORY_DISK, 5, True, 2_500, {KEY: 4, FILLER: 1}),
)

# What the sidecar already handed out before the read (acquired by real reads, so the ledger
# holds what the code made of them):
HOLDINGS = (
    ("nothing", "no earlier read of the key"),
    ("floor", "KV.GET key CONSISTENCY strong by another connection just before: the leader's "
              "revision handed out (the router's floor; a hold where the replica lacks it)"),
    ("hold", "the same answer taken earlier, before the state's last turn (a consumer lost, a "
             "resync, a recreation) or while the replica lacked it"),
    ("minrev", "the same connection's KV.GET key MINREV <latest> just before (read-your-writes)"),
)
HOLDING_NAMES = tuple(h for h, _ in HOLDINGS)

# NATS as the row's read finds it (every earlier read found it answering):
UPSTREAMS = (
    ("up", "NATS answers"),
    ("down", "every request fails at once (UpstreamError)"),
    ("timeout, serve_stale", "every request times out; the bucket has serve_stale on"),
)
UPSTREAM_NAMES = tuple(u for u, _ in UPSTREAMS)


@dataclass(frozen=True)
class Form:
    """A way of reading: `kind` is `point` (the command layer's or the GET fast path's
    reads of `keys`), `exec_watch` (WATCH, MULTI, the GETs, EXEC), `tracking` (what a CLIENT
    TRACKING client keeps), `localreader` (kvcache.app.reader in the application's process)
    or `stream` (XREAD/XRANGE). `asks_nats`: the form may reach NATS (else one upstream)."""

    name: str
    keys: tuple[str, ...]
    kind: str = "point"
    strong: bool = False
    maxstale: int | None = None
    minrev: int | None = None  # MINREV: LATEST (the key's latest revision), or this revision
    asks_nats: bool = True
    atomic: bool = False  # one command for every key: one key's error is the command's


FORMS = (
    Form("GET, generic path", (KEY,)),
    Form("GET, fast path (twin)", (KEY,)),
    Form("GET, fast path (native)", (KEY,)),
    Form("MGET", (KEY, OUTSIDE), atomic=True),
    Form("KV.GET", (KEY,)),
    Form("KV.GET CONSISTENCY strong", (KEY,), strong=True),
    Form(f"KV.GET MAXSTALE {MAXSTALE_TIGHT}", (KEY,), maxstale=MAXSTALE_TIGHT),
    Form(f"KV.GET MAXSTALE {MAXSTALE_LOOSE}", (KEY,), maxstale=MAXSTALE_LOOSE),
    Form("KV.GET MINREV latest", (KEY,), minrev=LATEST),
    Form("KV.GET MINREV 4", (KEY,), minrev=4),  # one the replica holds in most states
    Form("KV.GET out.o MINREV latest", (OUTSIDE,), minrev=LATEST),
    Form("MULTI GET GET EXEC", (KEY, OUTSIDE)),
    Form("WATCH MULTI GET EXEC", (KEY,), kind="exec_watch"),
    Form("near cache, generic path", (OUTSIDE,)),
    Form("near cache, fast path (twin)", (OUTSIDE,)),
    Form("near cache, fast path (native)", (OUTSIDE,)),
    Form("tracking client's kept value", (KEY,), kind="tracking", asks_nats=False),
    Form("LocalReader (native)", (KEY,), kind="localreader", asks_nats=False),
    Form("LocalReader (twin)", (KEY,), kind="localreader", asks_nats=False),
    Form("XRANGE @b", (KEY,), kind="stream", asks_nats=False),
    Form("XREAD @b", (KEY,), kind="stream", asks_nats=False),
    Form("XRANGE @b:in.k", (KEY,), kind="stream", asks_nats=False),
    Form("XREAD @b:in.k", (KEY,), kind="stream", asks_nats=False),
)


@dataclass(frozen=True)
class Allowed:
    """What may answer one key of one row: each allowed source with the lowest revision it
    may answer with (0: anything, a not-found included), and whether an error may be the
    answer (`error`); `must_error`: an error is the only right answer."""

    lowest: dict[str, int]
    error: bool
    must_error: bool = False
    top: int = 0  # a stream read: the least its last revision may be


    def show(self) -> str:
        srcs = ", ".join(f"{s}>={r}" for s, r in self.lowest.items())
        return ((srcs or "-") + (f"; top>={self.top}" if self.top else "") + ("; error" if self.error else "")
                + (" (only)" if self.must_error else ""))


# ---------------------------------------------------------------------- the truth

def writes_of(state: State) -> tuple[Write, ...]:
    """The stream as it is at the read: the current numbering's writes."""
    return tuple(w for w in state.history if w.gen == state.gen)


def revision_at(state: State, key: str, at_ms: int) -> int:
    """The key's revision as of `at_ms` (0: none yet)."""
    return max((w.seq for w in writes_of(state) if w.key == key and w.at_ms <= at_ms), default=0)


def latest(state: State, key: str) -> int:
    return revision_at(state, key, 0)


def minrev_of(form: Form, state: State, key: str) -> int:
    """The revision a MINREV read asks for (0: none)."""
    if form.minrev is None:
        return 0
    return latest(state, key) if form.minrev == LATEST else form.minrev


def effective_bound(form: Form, state: State) -> int:
    """The read's bound: MAXSTALE or max_stale_ms, floored at two heartbeats on a link that
    said "caught up" and went silent (docs/commands.md, KV.GET)."""
    bound = form.maxstale or BOUND_MS
    return max(bound, SILENCE_MS) if state.silent else bound


def vouched(state: State, bound: int) -> bool:
    """Does the feed vouch for the replica (and the near cache it keeps) within `bound`?"""
    return state.synced and state.age_ms is not None and state.age_ms <= bound


# ---------------------------------------------------------------------- the rule

def allowed(form: Form, state: State, upstream: str, key: str, handed: int = 0,
            stream_handed: int = 0) -> Allowed:
    """The row's rule for `key`. `handed`: the highest revision of the key already handed out
    from NATS or the replica to anyone, in the stream's current numbering (0: none);
    `stream_handed`: the highest revision of the bucket's stream this connection was handed,
    in any numbering (streams only)."""
    bound = effective_bound(form, state)
    fresh = vouched(state, bound)
    by_bound = latest(state, key) if form.strong else revision_at(state, key, -bound)

    if form.kind == "localreader":
        # Its witness is the meta record, and it sees no holds (docs/architecture.md,
        # "Consistency"): the bound alone, exactly (no heartbeat floor: the record holds the
        # last moment the replica was known caught up). StaleReplica where nothing vouches.
        exact = revision_at(state, key, -BOUND_MS)
        ok = vouched(state, BOUND_MS)
        return Allowed({"local": exact} if ok else {}, error=not ok, must_error=not ok)

    if form.kind == "stream":
        # The index answers only while vouched; never older than this connection's stream
        # (a recreated bucket: one error, then from 0); a point read's hand-outs do not bind it.
        regressed = stream_handed > state.applied
        if not fresh or regressed:
            return Allowed({}, error=True, must_error=True)
        return Allowed({"index": by_bound}, error=False, top=stream_handed)

    if form.kind == "tracking":
        # A kept value is vouched for while the feed vouches for the bucket and tells of
        # every change; what NATS handed to others does not invalidate it (docs/commands.md,
        # Client-side caching). Dropped is always safe.
        kept = {"client": revision_at(state, key, -BOUND_MS)} if vouched(state, BOUND_MS) else {}
        return Allowed({"dropped": 0, **kept}, error=False)

    if form.kind == "exec_watch" and not vouched(state, BOUND_MS):
        # EXEC answers null when a watched bucket's replica is not fresh within max_stale_ms.
        return Allowed({"null": 0}, error=False, must_error=False)

    replicated = key != OUTSIDE
    minrev = minrev_of(form, state, key)
    lowest = max(by_bound, handed, minrev)
    nats = upstream == "up" and state.quorum
    # A plain read's Direct Get may reach a follower that cannot show it holds what the read
    # needs: the router then fails it (an error, not a guess) unless the leader answers.
    follower = state.follower_seq
    follower_short = (follower is not None and not form.strong and form.minrev is None
                      and max((w.seq for w in writes_of(state) if w.key == key and w.seq <= follower),
                              default=0) < lowest)
    serve_stale = upstream == "timeout, serve_stale"
    plain = not form.strong and form.minrev is None

    out: dict[str, int] = {}
    if nats:
        if form.strong:
            out["leader"] = lowest
        else:
            out["peer"] = out["leader"] = lowest
        out["local>nats"] = lowest  # newest wins: the replica's copy was newer than NATS's answer
    if not form.strong and fresh:
        out["local" if replicated else "cache"] = lowest
    replica_rev = state.replica.get(key, 0)
    stale_ok = (serve_stale and not nats and plain and replicated
                and (state.synced or key in state.replica) and replica_rev >= handed)
    if stale_ok:
        out["stale"] = handed
    local_could = not form.strong and replicated and fresh and replica_rev >= lowest
    return Allowed(out, error=(not nats or follower_short) and not local_could and not stale_ok)


def command_error(form: Form, rules: dict[str, Allowed]) -> bool:
    """May the command fail? For one command over many keys (MGET), when any key's read may
    (docs/commands.md: a read NATS cannot answer fails the command, as the stale replica's
    may not stand in for every key); otherwise per key."""
    return form.atomic and any(a.error for a in rules.values())


def table_size() -> dict[str, int]:
    """Rows per form: states x holdings x upstreams (one upstream for a form never asking NATS)."""
    return {f.name: len(STATES) * len(HOLDINGS) * (len(UPSTREAMS) if f.asks_nats else 1) for f in FORMS}
