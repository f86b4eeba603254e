"""Batching KV changes into KvDeltas and paging KvSnapshots, on plain data with a fake clock."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw_agent.kvdeltas import DeltaBatcher, ReplicaView, snapshot_page
from llmgw_agent.kvtranslate import Change
from llmgw_common.codec import encode
from llmgw_common.kvcache import MAX_KEYS_PER_MESSAGE, KvDeltas, KvSnapshot, KvSnapshotRequest


def batcher(**kw: object) -> DeltaBatcher:
    return DeltaBatcher("n1", "boot-1", tick_s=0.1, idle_s=5.0, **kw)  # type: ignore[arg-type]


def apply(held: dict[str, set[int]], msgs: list[KvDeltas]) -> None:
    """What a router does with deltas."""
    for m in msgs:
        for r in m.replicas:
            if r.gone:
                held.pop(r.replica, None)
                continue
            s = held.setdefault(r.replica, set())
            if r.cleared:
                s.clear()
            s |= set(r.stored)
            s -= set(r.removed)


def test_due_after_a_tick_when_changed_and_after_idle_s_when_not() -> None:
    b = batcher()
    b.add("r1", "m", 16, Change(stored=(1, 2)))
    assert b.due(0.0)  # never sent: the first message goes at once
    first = b.take(0.0)
    assert [m.seq for m in first] == [1] and first[0].replicas[0].stored == [1, 2]
    assert not b.due(4.9)
    b.add("r1", "m", 16, Change(stored=(3,)))
    assert not b.due(0.05) and b.due(0.1)
    msgs = b.take(0.1)
    assert [m.seq for m in msgs] == [2] and msgs[0].replicas[0].stored == [3]
    assert not b.due(5.0) and b.due(5.1)
    assert b.take(5.1)[0].replicas == [] and b.seq == 3
    # r1 held by receivers: the empty message keeps coming every idle_s.
    assert not b.due(10.0) and b.due(10.1)


def test_a_node_holding_no_replica_sends_no_idle_message() -> None:
    # Issue 35: every node's empty batch every 5 s, to every router, was 10,000 messages a second at
    # 50,000 nodes; a node with no replica that publishes KV events must send none.
    b = batcher()
    assert not any(b.due(t) for t in (0.0, 5.0, 60.0, 3600.0))
    assert b.seq == 0
    # A replica comes and goes: its gone message, then one empty one (a lost gone is noticed), then none.
    b.add("r1", "m", 16, Change(stored=(1,)))
    assert b.due(3600.0)
    b.take(3600.0)
    b.gone("r1", "m", 16)
    (gone,) = b.take(3601.0)
    assert gone.replicas[0].gone and b.held == {}
    assert not b.due(3605.0) and b.due(3606.0)
    (trailing,) = b.take(3606.0)
    assert trailing.replicas == [] and trailing.seq == gone.seq + 1
    assert not any(b.due(t) for t in (3611.0, 3700.0, 9999.0))
    # A replica that failed to open (cleared, never gone) is held: its idle messages go on.
    b.add("r2", "m", 16, Change(cleared=True))
    b.take(10_000.0)
    b.take(10_005.0)
    assert b.due(10_010.0)


def test_stored_then_removed_between_ticks_is_sent_as_nothing() -> None:
    b = batcher()
    b.add("r1", "m", 16, Change(stored=(1,)))
    b.take(0.0)
    b.add("r1", "m", 16, Change(stored=(2,)))
    b.add("r1", "m", 16, Change(removed=(2, 1)))
    b.add("r1", "m", 16, Change(stored=(1,)))
    assert not b.changed()
    assert b.take(1.0)[0].replicas == []


def test_a_clear_drops_what_was_pending_before_it() -> None:
    b = batcher()
    b.add("r1", "m", 16, Change(stored=(1, 2)))
    b.add("r1", "m", 16, Change(cleared=True, stored=(3,)))
    (m,) = b.take(0.0)
    (r,) = m.replicas
    assert r.cleared and r.stored == [3] and r.removed == []


def test_gone_replaces_pending_and_a_returning_replica_starts_cleared() -> None:
    b = batcher()
    b.add("r1", "m", 16, Change(stored=(1,)))
    b.gone("r1", "m", 16)
    (m,) = b.take(0.0)
    assert [(r.replica, r.gone, r.stored) for r in m.replicas] == [("r1", True, [])]
    b.gone("r2", "m", 16)
    b.add("r2", "m", 16, Change(stored=(5,)))
    (r,) = b.take(1.0)[0].replicas
    assert r.cleared and not r.gone and r.stored == [5]


def test_big_changes_are_split_under_the_message_limit_in_order() -> None:
    b = batcher(max_keys=10)
    b.add("a", "m", 16, Change(cleared=True, stored=tuple(range(25))))
    b.add("b", "m", 16, Change(stored=(100,), removed=(7,)))
    msgs = b.take(0.0)
    assert [m.seq for m in msgs] == [1, 2, 3]  # 10, 10, then 5 of a with the 2 of b
    assert all(sum(len(r.stored) + len(r.removed) for r in m.replicas) <= 10 for m in msgs)
    assert [r.cleared for m in msgs for r in m.replicas if r.replica == "a"] == [True, False, False]
    held: dict[str, set[int]] = {"a": {999}, "b": {7}}
    apply(held, msgs)
    assert held == {"a": set(range(25)), "b": {100}}


def test_a_full_message_fits_nats_payload_limit() -> None:
    b = batcher()
    b.add("r1", "m", 16, Change(stored=tuple(range(2**63, 2**63 + MAX_KEYS_PER_MESSAGE + 5))))
    msgs = b.take(0.0)
    assert len(msgs) == 2 and max(len(encode(m)) for m in msgs) < 1024 * 1024


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c"]),
            st.sampled_from(["store", "remove", "clear", "gone", "tick"]),
            st.lists(st.integers(0, 30), max_size=6),
        ),
        max_size=40,
    )
)
def test_a_receiver_of_every_message_holds_the_current_sets(ops: list[tuple[str, str, list[int]]]) -> None:
    b = batcher(max_keys=4)
    truth: dict[str, set[int]] = {}
    held: dict[str, set[int]] = {}
    t = 0.0
    for rid, op, keys in ops:
        cur = truth.setdefault(rid, set())
        if op == "store":
            new = set(keys) - cur
            cur |= new
            b.add(rid, "m", 16, Change(stored=tuple(new)))
        elif op == "remove":
            gone = set(keys) & cur
            cur -= gone
            b.add(rid, "m", 16, Change(removed=tuple(gone)))
        elif op == "clear":
            cur.clear()
            cur |= set(keys)
            b.add(rid, "m", 16, Change(cleared=True, stored=tuple(keys)))
        elif op == "gone":
            del truth[rid]
            b.gone(rid, "m", 16)
        else:
            t += 1
            apply(held, b.take(t))
    apply(held, b.take(t + 1))
    assert {k: v for k, v in held.items() if v} == {k: v for k, v in truth.items() if v}


VIEWS = {
    "r2": ReplicaView("m", 16, [5, 1, 3]),
    "r1": ReplicaView("m", 16, range(10, 17)),
    "r3": ReplicaView("m2", 128, []),
}


def pages(views: dict[str, ReplicaView], max_keys: int) -> list[KvSnapshot]:
    out: list[KvSnapshot] = []
    req = KvSnapshotRequest()
    while True:
        p = snapshot_page(req, views, node="n1", stream="s", seq=9, now=1.0, max_keys=max_keys)
        out.append(p)
        if p.next_replica is None:
            return out
        req = KvSnapshotRequest(replica=p.next_replica, offset=p.next_offset)


def test_one_page_holds_everything_when_it_fits() -> None:
    (p,) = pages(VIEWS, 100)
    assert p.running == ["r1", "r2", "r3"] and p.seq == 9 and p.stream == "s"
    got = {r.replica: (r.cleared, r.stored, r.block_size) for r in p.replicas}
    assert got == {"r1": (True, list(range(10, 17)), 16), "r2": (True, [1, 3, 5], 16), "r3": (True, [], 128)}


def test_pages_continue_by_key_and_a_receiver_rebuilds_every_set() -> None:
    ps = pages(VIEWS, 3)
    assert all(sum(len(r.stored) for r in p.replicas) <= 3 for p in ps)
    held: dict[str, set[int]] = {}
    for p in ps:
        for r in p.replicas:
            s = held.setdefault(r.replica, set())
            if r.cleared:
                s.clear()
            s |= set(r.stored)
    assert held == {"r1": set(range(10, 17)), "r2": {1, 3, 5}, "r3": set()}
    # The continuation of r1 starts at a key, and is not cleared (it adds to the first page).
    cont = [r for p in ps for r in p.replicas if r.replica == "r1"]
    assert [r.cleared for r in cont] == [True, False, False]


def test_a_key_removed_between_pages_shifts_nothing() -> None:
    p1 = snapshot_page(KvSnapshotRequest(), VIEWS, node="n", stream="s", seq=1, now=0, max_keys=3)
    assert p1.next_replica == "r1" and p1.next_offset == 13
    moved = dict(VIEWS, r1=ReplicaView("m", 16, [10, 13, 14, 15, 16]))  # 11, 12 removed meanwhile
    p2 = snapshot_page(
        KvSnapshotRequest(replica=p1.next_replica, offset=p1.next_offset), moved, node="n", stream="s", seq=2, now=0,
        max_keys=3,
    )  # fmt: skip
    assert p2.replicas[0].stored == [13, 14, 15]


def test_a_request_naming_a_replica_gone_meanwhile_goes_on_with_the_next() -> None:
    p = snapshot_page(KvSnapshotRequest(replica="r15", offset=7), VIEWS, node="n", stream="s", seq=1, now=0)
    assert [r.replica for r in p.replicas] == ["r2", "r3"] and all(r.cleared for r in p.replicas)
