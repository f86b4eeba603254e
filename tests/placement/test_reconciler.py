"""The reconciler, scenario by scenario, over real in-memory snapshots and a fake clock (``now``)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmgw_common.backoff import backoff_delay
from llmgw_common.catalog import Catalog
from llmgw_common.ctl import ReplicaPhase
from llmgw_controlplane.scheduler.phase import ReplicaStatus, replica_status
from llmgw_controlplane.scheduler.ports import PortsExhausted, allocate_port, ports_by_address
from llmgw_controlplane.scheduler.reconciler import default_replica_id, reconcile
from llmgw_controlplane.scheduler.snapshot import ReplicaView
from tests.placement.placement_kit import (
    NodeState,
    ShardState,
    apply,
    node,
    profile,
    replica,
    set_state,
    snap,
)


def test_places_missing_replicas_on_distinct_nodes_with_unique_ports() -> None:
    s = snap([node("a"), node("b")], models=[profile(replicas=2)])
    plan = reconcile(s)
    assert [len(r.shards) for r in plan.place] == [1, 1]
    assert {r.shards[0].node for r in plan.place} == {"a", "b"}
    ports = [r.shards[0].port for r in plan.place]
    assert len(set(ports)) == 2 and all(20000 <= p <= 29999 for p in ports)  # both on 127.0.0.1
    assert len({r.replica_id for r in plan.place}) == 2
    assert plan.memo.seq == 2
    assert not plan.stop and not plan.unplaceable


def test_steady_state_is_a_no_op_and_keeps_the_memo() -> None:
    s = snap([node("a"), node("b")], models=[profile(replicas=2)])
    first = reconcile(s)
    steady = apply(s, first, state=ShardState.READY, now=1001.0)
    plan = reconcile(steady, first.memo)
    assert not plan.changes
    assert plan.memo is first.memo
    assert not plan.unplaceable and not plan.backoff


def test_model_removed_from_catalog_is_torn_down() -> None:
    """ARCHITECTURE #10."""
    s = snap([node("a")], [replica("r1", "gone", [("a", (0,))])], models=[])
    plan = reconcile(s)
    assert [(x.replica_id, x.reason) for x in plan.stop] == [("r1", "model gone left the catalog")]


def test_replica_on_lost_node_is_replaced_and_forgotten() -> None:
    nodes = [node("a", state=NodeState.LOST), node("b")]
    s = snap(nodes, [replica("r1", "m", [("a", (0,))])], models=[profile()])
    plan = reconcile(s)
    assert [(x.replica_id, x.reason, x.node_lost) for x in plan.stop] == [("r1", "node a lost", True)]
    assert [r.shards[0].node for r in plan.place] == ["b"]


def test_node_absent_from_snapshot_counts_as_lost() -> None:
    s = snap([node("b")], [replica("r1", "m", [("a", (0,)), ("b", (0,))])], models=[profile(nodes=2)])
    plan = reconcile(s)
    assert [(x.replica_id, x.node_lost) for x in plan.stop] == [("r1", True)]


def test_unreachable_node_keeps_its_replica_and_gets_no_new_one() -> None:
    nodes = [node("a", state=NodeState.UNREACHABLE), node("b")]
    s = snap(nodes, [replica("r1", "m", [("a", (0,))])], models=[profile(replicas=2)])
    plan = reconcile(s)
    assert not plan.stop
    assert [r.shards[0].node for r in plan.place] == ["b"]


def test_drain_stops_old_replica_only_after_replacement_serves() -> None:
    """ARCHITECTURE #8, step by step."""
    nodes = [node("a", draining=True), node("b")]
    s = snap(nodes, [replica("old", "m", [("a", (0,))], created=1.0)], models=[profile()])
    p1 = reconcile(s)
    assert p1.mark_draining == ("old",)
    assert not p1.stop
    assert [r.shards[0].node for r in p1.place] == ["b"]
    new_id = p1.place[0].replica_id

    s2 = apply(s, p1, state=ShardState.STARTING, now=1010.0)
    p2 = reconcile(s2, p1.memo)
    assert not p2.stop and not p2.place and not p2.mark_draining  # the replacement is not serving yet

    s3 = set_state(s2, new_id, ShardState.READY)
    p3 = reconcile(s3, p2.memo)
    assert [(x.replica_id, x.reason) for x in p3.stop] == [("old", "drained: a replacement serves")]
    assert not p3.place


def test_drain_deadline_stops_the_old_replica_even_without_replacement() -> None:
    nodes = [node("a", draining=True, drain_deadline=1500.0)]
    s = snap(
        nodes, [replica("old", "m", [("a", (0,))], draining=True, draining_since=900.0)], models=[profile()]
    )
    assert not reconcile(s).stop  # nowhere to go, deadline not reached: it keeps serving
    late = reconcile(replace(s, now=1500.0))
    assert [(x.replica_id, x.reason) for x in late.stop] == [("old", "drain deadline passed")]


def test_drain_grace_applies_when_the_node_has_no_deadline() -> None:
    s = snap(
        [node("a", draining=True)],
        [replica("old", "m", [("a", (0,))], draining=True, draining_since=0.0)],
        models=[profile()],
        now=599.0,
    )
    assert not any(x.replica_id == "old" for x in reconcile(s, drain_grace_s=600.0).stop)
    assert [x.reason for x in reconcile(replace(s, now=600.0), drain_grace_s=600.0).stop] == [
        "drain deadline passed"
    ]


def test_a_lifted_drain_never_times_out_a_replica_with_nowhere_to_go() -> None:
    """Uncordon lifts the node's drain: its marked replica is replaced when room comes, never just stopped."""
    s = snap(
        [node("a")],
        [replica("old", "m", [("a", (0,))], draining=True, draining_since=0.0)],
        models=[profile()],
        now=86400.0,
    )
    plan = reconcile(s, drain_grace_s=600.0)
    assert not any(x.replica_id == "old" for x in plan.stop)


def test_draining_replica_that_does_not_serve_is_stopped_at_once() -> None:
    s = snap(
        [node("a", draining=True), node("b")],
        [replica("old", "m", [("a", (0,))], state=ShardState.STARTING, created=990.0)],
        models=[profile()],
    )
    plan = reconcile(s)
    assert [(x.replica_id, x.reason) for x in plan.stop] == [("old", "draining and not serving")]


def test_surplus_stops_not_ready_first_then_newest() -> None:
    reps = [
        replica("old", "m", [("a", (0,))], created=1.0),
        replica("new", "m", [("a", (1,))], created=3.0),
        replica("mid", "m", [("a", (2,))], created=2.0),
        replica("starting", "m", [("a", (3,))], created=999.0, state=ShardState.STARTING),
    ]
    s = snap([node("a")], reps, models=[profile(replicas=2)])
    plan = reconcile(s)
    assert [x.replica_id for x in plan.stop] == ["starting", "new"]
    assert all(x.reason == "surplus: 4 replicas, 2 wanted" for x in plan.stop)


def test_failed_replica_is_stopped_and_model_backs_off_exponentially() -> None:
    s = snap(
        [node("a"), node("b")],
        [replica("r1", "m", [("a", (0,))], state=ShardState.FAILED)],
        models=[profile()],
    )
    s = set_state(s, "r1", ShardState.FAILED, "CUDA out of memory")
    p1 = reconcile(s, backoff_base_s=5, backoff_max_s=12)
    assert [(x.replica_id, x.failed) for x in p1.stop] == [("r1", True)]
    assert p1.stop[0].reason == "failed: shard 0 on a: CUDA out of memory"
    assert not p1.place
    assert p1.backoff["m"].until == 1005.0 and p1.backoff["m"].failures == 1
    assert "CUDA out of memory" in p1.backoff["m"].reason

    # The stop has not landed yet: the same failure is not counted twice.
    p1b = reconcile(replace(s, now=1001.0), p1.memo, backoff_base_s=5, backoff_max_s=12)
    assert p1b.memo.model("m").failures == 1 and "m" in p1b.backoff

    # Backoff over: a new replica is placed; it fails too; the wait doubles, then is capped.
    gone = replace(s, replicas=(), now=1005.0)
    p2 = reconcile(gone, p1b.memo, backoff_base_s=5, backoff_max_s=12)
    assert len(p2.place) == 1
    s3 = set_state(
        apply(gone, p2, state=ShardState.FAILED, now=1006.0), p2.place[0].replica_id, ShardState.FAILED
    )
    p3 = reconcile(s3, p2.memo, backoff_base_s=5, backoff_max_s=12)
    assert p3.backoff["m"].until == 1006.0 + 10.0
    assert backoff_delay(3, 5, 12) == 12.0 and backoff_delay(0, 5, 12) == 0.0


def test_crash_loop_ends_when_a_newer_replica_serves() -> None:
    s = snap([node("a")], [replica("r1", "m", [("a", (0,))], state=ShardState.FAILED)], models=[profile()])
    p1 = reconcile(s)
    later = replace(s, replicas=(replica("r2", "m", [("a", (1,))], created=1010.0),), now=1020.0)
    p2 = reconcile(later, p1.memo)
    assert p2.memo.model("m").failures == 0 and p2.memo.model("m").next_attempt == 0.0
    assert p2.memo.counted == frozenset()  # r1 is gone: pruned


def test_startup_timeout_fails_the_replica() -> None:
    r = replica("r1", "m", [("a", (0,))], state=ShardState.STARTING, created=0.0)
    s = snap([node("a")], [r], models=[profile(startup_timeout_s=100)], now=101.0)
    plan = reconcile(s)
    assert plan.stop[0].failed
    assert plan.stop[0].reason == "failed: not ready 100s after start: shard 0 on a starting"


def test_replica_ready_only_when_all_shards_are_and_every_error_is_kept() -> None:
    r = replica("r", "m", [("a", (0,)), ("b", (0,))])

    def status(v: ReplicaView) -> ReplicaStatus:
        return replica_status(snap([node("a"), node("b")], [v], models=[profile()], now=0.0), v)

    assert status(r).phase is ReplicaPhase.READY
    half = replace(r, shards=(r.shards[0], replace(r.shards[1], state=ShardState.STARTING)))
    assert status(half).phase is ReplicaPhase.STARTING
    unknown = replace(r, shards=(r.shards[0], replace(r.shards[1], state=None)))
    assert status(unknown).phase is ReplicaPhase.STARTING
    both = replace(
        r, shards=tuple(replace(s, state=ShardState.FAILED, error=f"e{s.shard}") for s in r.shards)
    )
    st = status(both)
    assert st.phase is ReplicaPhase.FAILED
    assert st.errors == ("shard 0 on a: e0", "shard 1 on b: e1")
    stopped = replace(r, shards=(r.shards[0], replace(r.shards[1], state=ShardState.STOPPED)))
    assert status(stopped).phase is ReplicaPhase.STOPPING


def test_stopped_shard_stops_the_replica_without_backoff() -> None:
    s = snap(
        [node("a"), node("b")],
        [replica("r", "m", [("a", (0,))], state=ShardState.STOPPED)],
        models=[profile()],
    )
    plan = reconcile(s)
    assert [(x.replica_id, x.failed) for x in plan.stop] == [("r", False)]
    assert not plan.backoff


def test_unplaceable_is_reported_with_its_start_and_cleared_when_placed() -> None:
    s = snap([node("a", n_gpus=2)], models=[profile(gpus_per_node=4)])
    p1 = reconcile(s)
    assert p1.unplaceable["m"].summary == "no node can hold model m: a has 2 free H100-80GB, needs 4"
    assert p1.memo.model("m").unplaceable_since == 1000.0
    p2 = reconcile(replace(s, now=1030.0), p1.memo)
    assert p2.memo.model("m").unplaceable_since == 1000.0  # the streak's start is kept
    grown = replace(s, nodes={"a": node("a", n_gpus=2), "b": node("b")}, now=1040.0)
    p3 = reconcile(grown, p2.memo)
    assert len(p3.place) == 1 and not p3.unplaceable
    assert p3.memo.model("m").unplaceable_since is None


def test_memo_forgets_models_that_left_the_catalog() -> None:
    s = snap([node("a", n_gpus=0)], models=[profile()])
    p1 = reconcile(s)
    assert "m" in p1.memo.models
    p2 = reconcile(replace(s, catalog=Catalog()), p1.memo)
    assert "m" not in p2.memo.models


def test_placing_false_stops_but_places_nothing() -> None:
    s = snap([node("a")], [replica("r", "gone", [("a", (0,))])], models=[profile()])
    plan = reconcile(s, placing=False)
    assert [x.replica_id for x in plan.stop] == ["r"] and not plan.place


def test_no_double_booking_within_one_pass_and_against_existing_ports() -> None:
    # Many simulated nodes on one address: ports must differ across all of them.
    nodes = [node(f"n{i}", n_gpus=2) for i in range(6)]
    seed_port = allocate_port(set(), seed="m-3e8000-0/0")
    existing = replica("held", "x", [("n0", (0,))], port=seed_port)
    s = snap(nodes, [existing], models=[profile("x"), profile("m", replicas=11)])
    plan = reconcile(s, new_id=lambda model, seq: f"{model}-3e8000-{seq}")
    gpus = [(sh.node, g) for r in plan.place for sh in r.shards for g in sh.gpus]
    assert len(gpus) == len(set(gpus)) == 11
    assert ("n0", 0) not in gpus
    ports = [sh.port for r in plan.place for sh in r.shards]
    assert len(set(ports)) == len(ports)
    assert seed_port not in ports
    assert "m" not in plan.unplaceable


def test_new_id_collisions_with_existing_replicas_are_skipped() -> None:
    s = snap([node("a")], [replica("m-0", "m", [("a", (0,))])], models=[profile(replicas=2)])
    plan = reconcile(s, new_id=lambda model, seq: f"{model}-{seq}")
    assert [r.replica_id for r in plan.place] == ["m-1"]
    assert plan.memo.seq == 2


def test_default_replica_id_is_safe_as_a_key() -> None:
    assert default_replica_id("meta-llama/Llama-3:8b", 1.5, 7) == "meta-llama_Llama-3_8b-5dc-7"


def test_multi_node_replica_gets_a_leader_address() -> None:
    nodes = [node("a1", fabric="f", address="10.0.0.1"), node("a2", fabric="f", address="10.0.0.2")]
    plan = reconcile(snap(nodes, models=[profile(gpus_per_node=8, nodes=2)]))
    (nr,) = plan.place
    assert [sh.shard for sh in nr.shards] == [0, 1]
    assert nr.leader == f"10.0.0.1:{nr.shards[0].port}"


def test_ports() -> None:
    assert allocate_port(set(), seed="s") == allocate_port(set(), seed="s")
    p = allocate_port(set(), seed="s", lo=100, hi=102)
    assert allocate_port({p}, seed="s", lo=100, hi=102) != p
    assert allocate_port({100, 101}, seed="x", lo=100, hi=102) == 102
    with pytest.raises(PortsExhausted, match="no free port in 100-102"):
        allocate_port({100, 101, 102}, seed="s", lo=100, hi=102)
    with pytest.raises(ValueError, match="empty port range"):
        allocate_port(set(), seed="s", lo=5, hi=4)
    s = snap(
        [node("a", address="h1"), node("b", address="h1")],
        [
            replica("r1", "m", [("a", ())], port=20001),
            replica("r2", "m", [("b", ())], port=20002),
            replica("r3", "m", [("gone", ())], port=20003),
        ],
    )
    assert ports_by_address(s) == {"h1": {20001, 20002}, "gone": {20003}}


def test_ports_exhausted_makes_the_model_unplaceable_with_the_reason() -> None:
    nodes = [node("a", address="h1")]
    held = replica("r1", "x", [("a", (0,))], port=20000)
    s = snap(nodes, [held], models=[profile("x"), profile("m")])
    plan = reconcile(s, port_range=(20000, 20000))
    assert plan.unplaceable["m"].summary == (
        "cannot place model m on a: address h1 has no free port in 20000-20000: all 1 are in use"
    )
    assert not plan.place


def test_unplaceable_reasons_are_reused_while_recent_but_the_decision_is_fresh() -> None:
    s = snap([node("a", n_gpus=2)], models=[profile(gpus_per_node=4)])
    p1 = reconcile(s, reasons_refresh_s=10)
    # Same refusal, 5 s later: the reasons are the memo's (no verdict per node), and the memo is unchanged.
    p2 = reconcile(replace(s, now=1005.0), p1.memo, reasons_refresh_s=10)
    assert p2.unplaceable["m"] is p1.unplaceable["m"]
    assert p2.memo is p1.memo
    # The node shrank: within the window the old reasons stand, after it they are worked out again.
    shrunk = replace(s, nodes={"a": node("a", n_gpus=1)})
    p3 = reconcile(replace(shrunk, now=1009.0), p2.memo, reasons_refresh_s=10)
    assert p3.unplaceable["m"].summary.endswith("a has 2 free H100-80GB, needs 4")
    p4 = reconcile(replace(shrunk, now=1010.0), p3.memo, reasons_refresh_s=10)
    assert p4.unplaceable["m"].summary.endswith("a has 1 free H100-80GB, needs 4")
    assert p4.memo.model("m").unplaceable_since == 1000.0
    # Capacity appears inside the window: placed at once, and the remembered refusal is dropped.
    grown = replace(s, nodes={"a": node("a", n_gpus=2), "b": node("b")}, now=1011.0)
    p5 = reconcile(grown, p4.memo, reasons_refresh_s=10)
    assert [r.shards[0].node for r in p5.place] == ["b"]
    assert p5.memo.model("m").unplaceable is None and p5.memo.model("m").unplaceable_since is None
