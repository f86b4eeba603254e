"""A node's delta stream in order (llmgw_router.cache.feeds): pure decisions over plain data."""

from __future__ import annotations

from llmgw_common.kvcache import KvDeltas
from llmgw_router.cache.feeds import RETRY_MIN_S, Delta, Feeds


def d(seq: int, stream: str = "s1", node: str = "n", sent_at: float = 100.0) -> KvDeltas:
    return KvDeltas(node=node, stream=stream, seq=seq, sent_at=sent_at)


def synced(f: Feeds, seq: int = 0, stream: str = "s1") -> None:
    assert f.begin_sync("n")
    assert f.snapshot_applied("n", stream, seq, 50.0) == []


def test_in_order_applies_repeats_are_stale() -> None:
    f = Feeds()
    synced(f, 3)
    assert f.on_delta(d(4), 0) is Delta.APPLY
    assert f.on_delta(d(5), 0) is Delta.APPLY
    assert f.on_delta(d(5), 0) is Delta.STALE
    assert f.on_delta(d(2), 0) is Delta.STALE
    assert f.stale == 2 and f.nodes["n"].seq == 5


def test_an_unknown_node_a_gap_or_a_new_stream_asks_for_a_snapshot() -> None:
    f = Feeds()
    assert f.on_delta(d(7), 0) is Delta.SYNC  # never synced
    assert f.on_delta(d(8), 0) is Delta.HELD
    assert f.snapshot_applied("n", "s1", 7, 50.0) == [d(8)]
    assert f.on_delta(d(10), 0) is Delta.SYNC and f.gaps == 1
    assert f.snapshot_applied("n", "s1", 10, 50.0) == []
    assert f.on_delta(d(1, "s2"), 0) is Delta.SYNC and f.gaps == 2
    assert not f.begin_sync("n")  # one is coming already


def test_held_batches_must_follow_the_snapshot() -> None:
    f = Feeds()
    assert f.begin_sync("n")
    for s in (3, 4, 6):
        assert f.on_delta(d(s), 0) is Delta.HELD
    # The snapshot is at 4: 3 and 4 are in it, 6 does not follow (5 lost): ask again.
    assert f.snapshot_applied("n", "s1", 4, 50.0) is None
    assert f.nodes["n"].syncing
    assert f.snapshot_applied("n", "s1", 6, 50.0) == []
    assert not f.nodes["n"].syncing and f.nodes["n"].seq == 6


def test_another_streams_held_batches_older_than_the_snapshot_go_newer_ones_ask_again() -> None:
    f = Feeds()
    assert f.begin_sync("n")
    f.on_delta(d(9, "old", sent_at=10.0), 0)
    f.on_delta(d(3, "new", sent_at=60.0), 0)
    assert f.snapshot_applied("n", "new", 2, 50.0) == [d(3, "new", sent_at=60.0)]
    assert f.begin_sync("n")
    f.on_delta(d(1, "newer", sent_at=70.0), 0)
    assert f.snapshot_applied("n", "new", 3, 60.0) is None


def test_held_batches_are_bounded() -> None:
    f = Feeds(max_held=3)
    assert f.begin_sync("n")
    for s in range(1, 6):
        f.on_delta(d(s), 0)
    assert f.dropped_held == 2
    # 1 and 2 went: a snapshot at 0 cannot be followed; one at 2 can.
    assert f.snapshot_applied("n", "s1", 0, 50.0) is None
    assert [x.seq for x in f.snapshot_applied("n", "s1", 2, 50.0) or []] == [3, 4, 5]


def test_a_failed_snapshot_follows_from_an_empty_base_and_retries_with_backoff() -> None:
    f = Feeds()
    assert f.on_delta(d(5), 0.0) is Delta.SYNC
    f.on_delta(d(6), 0.0)
    f.on_delta(d(8), 0.0)  # 7 lost: the base restarts after the hole
    f.on_delta(d(9), 0.0)
    assert [x.seq for x in f.snapshot_failed("n", 100.0)] == [8, 9]
    assert f.due(100.0 + RETRY_MIN_S - 0.01) == [] and f.due(100.0 + RETRY_MIN_S) == ["n"]
    assert f.on_delta(d(10), 100.0) is Delta.APPLY
    # A gap before the retry: the base restarts there, without a snapshot.
    assert f.on_delta(d(12), 100.5) is Delta.RESTART
    assert f.nodes["n"].seq == 12 and not f.nodes["n"].whole
    # Once due, a gap asks again; failing again doubles the wait.
    assert f.on_delta(d(14), 101.0) is Delta.SYNC
    assert f.snapshot_failed("n", 101.0) == [d(14)]
    assert f.nodes["n"].retry_at == 101.0 + 2 * RETRY_MIN_S
    # Nothing held: nothing to apply, the stream unknown until the next batch.
    assert f.begin_sync("n")
    assert f.snapshot_failed("n", 200.0) == []
    assert f.nodes["n"].stream is None
    f.forget("n")
    assert "n" not in f.nodes
