"""The read-rules checker (tests/support/read_rules.py) on hand-made histories: every rule passes
the right answers and catches a wrong one put in on purpose, so that the live matrix
(tests/test_read_matrix_live.py) may trust its zero. No process is started: the quick tier."""
from __future__ import annotations

import pytest
from support.read_rules import Answer, ReadRules
from support.staleness_check import Acks

# key a written at revisions 1 (t=0), 3 (t=1), 5 (t=2); key b at 2 (t=0.5), then the bucket's
# revision 4 is b's (t=1.5); key a's 5 is the last write
ACKS = [("a", 1, 1, 0.0), ("b", 2, 2, 0.5), ("a", 3, 3, 1.0), ("b", 4, 4, 1.5), ("a", 5, 5, 2.0)]
STALE = ("no peer could answer",)


def rules() -> ReadRules:
    return ReadRules(Acks.of(ACKS))


def answer(revision: int | None, sent: float, bound_ms: float | None = 1000, key: str = "a",
           conn: str = "c1", **kw) -> Answer:
    return Answer(kw.pop("form", "GET"), kw.pop("state", "current"), conn, key, sent, revision, bound_ms, **kw)


def rules_of(answers: list[Answer]) -> list[str]:
    return [v.rule for v in rules().check(answers)]


def test_answers_within_every_rule_pass():
    assert rules_of([
        answer(1, 0.5),                        # rev 3 (t=1) is not yet 1 s old at 0.5
        answer(3, 2.5),                        # rev 5 (t=2) only 0.5 s old
        answer(5, 2.1, None, conn="c2"),       # strong: everything acked before
        answer(3, 2.2, min_rev=3, conn="c3"),  # MINREV 3: the key's own write at 3
        answer(3, 2.3, min_rev=4, conn="c4"),  # MINREV 4 (b's write): a's newest at or below 4 is 3
        answer(None, 2.5, error="ERR bucket m: replica stale (3.0s behind, max_stale_ms 1000) and "
                                "no peer could answer: timed out", errors=STALE, conn="c5"),
    ]) == []


@pytest.mark.parametrize("wrong, rule", [
    (answer(1, 2.5), "stale"),                          # rev 3 acked 1.5 s before: bound 1000 ms
    (answer(None, 2.5), "stale"),                       # not found while a value was acked long before
    (answer(None, 0.6, None, key="b"), "strong"),       # strong: not found after b's first write
    (answer(3, 2.5, bound_ms=400), "stale"),            # MAXSTALE 400: rev 5 acked 0.5 s before
    (answer(3, 2.1, None), "strong"),                   # strong: rev 5 acked at 2.0, before the read
    (answer(1, 1.5, min_rev=3), "minrev"),              # MINREV 3 answered below it
    (answer(1, 1.6, min_rev=4), "minrev"),              # MINREV 4: the bucket at 4 holds a at 3
    (answer(None, 1.5, error="ERR upstream read failed: x"), "error"),  # no error allowed here
    (answer(None, 1.5, error="ERR something else", errors=STALE), "error"),
], ids=["stale", "not-found", "strong-not-found", "maxstale", "strong", "minrev-own", "minrev-other-key", "error",
        "undocumented-error"])
def test_each_rule_catches_a_wrong_answer(wrong, rule):
    assert rules_of([answer(1, 0.1, conn="other"), wrong]) == [rule]


def test_going_back_on_one_connection_is_caught_and_across_connections_is_not():
    assert rules_of([answer(5, 2.1, None), answer(3, 2.2)]) == ["back"]      # strong 5, then local 3
    assert rules_of([answer(5, 2.1, None), answer(3, 2.2, conn="c2")]) == []  # another connection
    assert rules_of([answer(3, 1.1), answer(None, 1.2, 10_000)]) == ["back"]  # a value, then not found


def test_a_replica_served_regardless_of_its_state_is_caught():
    """The fault the matrix exists for, as a history: MINREV r answered r-1 from the replica
    (fresh within its bound, behind r), as kvcache did before MINREV's second route kept it."""
    history = [answer(3, 1.05, form="KV.GET MINREV", min_rev=3, source="leader"),
               answer(3, 2.05, form="KV.GET MINREV", min_rev=5, source="local", conn="c2")]
    r = rules()
    bad = r.check(history)
    assert [(v.rule, v.answer.source) for v in bad] == [("minrev", "local")]
    assert "minrev: KV.GET MINREV of a [current] on c2" in str(bad[0])
    table = r.table()
    assert "KV.GET MINREV" in table and "2 reads, 0 err, 1 bad, leader/local" in table
