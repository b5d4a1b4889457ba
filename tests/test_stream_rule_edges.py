"""A bucket's stream reads (kvcache.read.stream_rules) at their edges: revision 1 below the
replica's horizon is a gap like any other, and the errors a reader gets, word for word (what
happened and what to do: read from 0). In process; the feed is what the rules ask of one."""
from __future__ import annotations

import pytest

from kvcache.config import BucketConfig
from kvcache.errors import CommandError
from kvcache.read import stream_rules
from kvcache.read.ledger import Ledger
from kvcache.store.replica import BucketMeta

SB = BucketConfig(name="s", max_stale_ms=1000)


class StaleFeed:
    synced = True
    meta = BucketMeta(applied_seq=5, synced=True)

    def fresh_within(self, ms: int) -> bool:
        return False

    def lag_ms(self) -> int:
        return 1050


def error(fn, *args) -> str:
    with pytest.raises(CommandError) as e:
        fn(*args)
    return str(e.value)


def test_revision_1_below_the_horizon_is_no_longer_known_exactly():
    assert error(stream_rules.exact_after, SB, 5, 50, 1) == (
        "ERR bucket s: changes after revision 1 are no longer known exactly (the replica's index starts "
        "after revision 5, where its last full sync began): read from 0 for a full listing")


def test_a_start_past_the_end_is_quoted_as_given_up_to_64_characters():
    given = b"9" * 70 + b"\xff"
    assert error(stream_rules.exact_after, SB, 0, 50, 60, given) == (
        f"ERR bucket s: start {'9' * 64} is past its next revision 51 (was the bucket recreated?): read from 0")
    assert error(stream_rules.exact_after, SB, 0, 50, 60, b"6\xff") == (
        "ERR bucket s: start 6\ufffd is past its next revision 51 (was the bucket recreated?): read from 0")


def test_a_stale_replicas_stream_error_names_its_lag():
    assert error(stream_rules.vouch, Ledger(), 1, SB, StaleFeed()) == (
        "ERR bucket s: replica stale (1.1s behind, max_stale_ms 1000): its stream cannot be read")
