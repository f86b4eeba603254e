"""Node and replica tables from bus messages, judged by a fake clock."""

from __future__ import annotations

from llmgw_common.catalog import parse_catalog
from llmgw_common.ctl import ReplicaPhase
from llmgw_common.messages import (
    GpuInfo,
    Heartbeat,
    Inventory,
    Marks,
    ReplicaRecord,
    ShardPlacement,
    ShardReport,
    ShardState,
    ShardStatus,
)
from llmgw_controlplane.nodes import node_health
from llmgw_controlplane.scheduler.phase import replica_phase
from llmgw_controlplane.scheduler.reconciler import reconcile
from llmgw_controlplane.scheduler.routing import routing_content
from llmgw_controlplane.scheduler.snapshot import NodeState
from llmgw_controlplane.state import ClusterState


def _phase(st: ClusterState, now: float) -> ReplicaPhase:
    """r1's phase at ``now``, judged with its model's startup timeout from the catalog."""
    snap = st.snapshot(now)
    return replica_phase(snap, snap.replicas[0])


def _state() -> ClusterState:
    return ClusterState(heartbeat_interval_s=2.0, unreachable_after_missed=3, node_lost_s=30.0)


def _hb(
    node: str = "n1",
    boot: str = "b1",
    seq: int = 1,
    sent_at: float = 0.0,
    shards: tuple[ShardReport, ...] = (),
) -> Heartbeat:
    return Heartbeat(node=node, boot_id=boot, seq=seq, sent_at=sent_at, shards=shards)


def _inv(node: str = "n1", boot: str = "b1", memory_gb: float | None = None, gpus: int = 2) -> Inventory:
    return Inventory(
        node=node,
        boot_id=boot,
        sent_at=0.0,
        memory_gb=memory_gb,
        fabric="f1",
        gpus=tuple(
            GpuInfo(index=i, uuid=f"u{i}", name="H", gpu_class="H100", memory_mb=1) for i in range(gpus)
        ),
    )


def test_health_thresholds_are_exclusive_and_ordered() -> None:
    assert node_health(100.0, 106.0, 2.0, 3, 30.0) is NodeState.READY  # exactly 3 intervals: not yet
    assert node_health(100.0, 106.1, 2.0, 3, 30.0) is NodeState.UNREACHABLE
    assert node_health(100.0, 130.0, 2.0, 3, 30.0) is NodeState.UNREACHABLE
    assert node_health(100.0, 130.1, 2.0, 3, 30.0) is NodeState.LOST


def test_the_snapshot_and_the_transitions_judge_a_node_by_the_one_health_function() -> None:
    """At each threshold the snapshot's node state, ``judge()``'s and :func:`node_health` agree; a node
    without an inventory is unreachable in the snapshot only (it takes no new replicas), not silent."""
    st = _state()
    st.on_heartbeat(_hb(sent_at=0.0), now=100.0)
    st.on_inventory(_inv(), now=100.0)
    st.on_heartbeat(_hb(node="bare", sent_at=0.0), now=100.0)
    for now in (106.0, 106.1, 130.0, 130.1):
        want = node_health(100.0, now, 2.0, 3, 30.0)
        st.judge(now)
        assert (st.snapshot(now).nodes["n1"].state, st.nodes["n1"].health) == (want, want), now
        bare = NodeState.UNREACHABLE if want is NodeState.READY else want
        assert (st.snapshot(now).nodes["bare"].state, st.nodes["bare"].health) == (bare, want), now


def test_transitions_ready_unreachable_lost_and_back_by_own_clock() -> None:
    st = _state()
    # The sender's clock says 1970: health is judged by arrival time only.
    assert st.on_heartbeat(_hb(sent_at=0.0), now=1000.0)
    st.on_inventory(_inv(), now=1000.0)
    assert st.judge(1001.0) == []
    t = st.judge(1007.0)
    assert [(x.old, x.new) for x in t] == [(NodeState.READY, NodeState.UNREACHABLE)]
    assert st.snapshot(1007.0).nodes["n1"].state is NodeState.UNREACHABLE
    t = st.judge(1031.0)
    assert [(x.old, x.new) for x in t] == [(NodeState.UNREACHABLE, NodeState.LOST)]
    assert st.judge(1040.0) == []  # reported once
    assert st.on_heartbeat(_hb(seq=2), now=1041.0)  # comes back: matters to the reconciler
    t = st.judge(1041.0)
    assert [(x.old, x.new) for x in t] == [(NodeState.LOST, NodeState.READY)]


def test_repeated_heartbeat_is_not_news_but_a_shard_change_is() -> None:
    st = _state()
    st.on_heartbeat(_hb(seq=1), 10.0)
    st.on_inventory(_inv(), 10.0)
    st.judge(10.0)
    assert not st.on_heartbeat(_hb(seq=2), 11.0)
    rep = ShardReport(replica_id="r1", shard=0, model="m", state=ShardState.STARTING, port=20001)
    assert st.on_heartbeat(_hb(seq=3, shards=(rep,)), 12.0)
    assert not st.on_heartbeat(_hb(seq=4, shards=(rep,)), 13.0)
    ready = rep.model_copy(update={"state": ShardState.READY})
    assert st.on_heartbeat(_hb(seq=5, shards=(ready,)), 14.0)
    # A reordered older heartbeat counts for liveness, not content.
    assert not st.on_heartbeat(_hb(seq=4, shards=(rep,)), 15.0)
    assert st.nodes["n1"].shards[("r1", 0)].state is ShardState.READY
    assert st.nodes["n1"].last_seen == 15.0


def test_new_boot_id_is_a_restart_whose_first_reports_replace_the_old_boots() -> None:
    st = _state()
    r1, r2 = (
        ShardReport(replica_id=r, shard=0, model="m", state=ShardState.READY, port=1) for r in ("r1", "r2")
    )
    st.on_heartbeat(_hb(seq=7, sent_at=100.0, shards=(r1, r2)), 100.0)
    # The new boot's inventory proves the restart (an agent sends it before anything else).
    assert st.on_inventory(_inv(boot="b2"), 101.0)
    assert st.nodes["n1"].restarts == 1
    # Until the new boot reports its shards, the old boot's reports stand: the engines outlive an
    # agent, and voiding them here would take their endpoints from the routers until it does.
    assert set(st.nodes["n1"].shards) == {("r1", 0), ("r2", 0)}
    # Its statuses count even when its clock is behind the old boot's (a reboot may set it back).
    assert st.on_status(_status("b2", ShardState.STARTING, 99.0), 101.5)
    assert st.nodes["n1"].shards[("r1", 0)].state is ShardState.STARTING
    # Its first heartbeat replaces the old reports whole: r2's engine did not survive.
    assert st.on_heartbeat(_hb(boot="b2", seq=1, sent_at=99.5, shards=(r1,)), 102.0)
    assert st.nodes["n1"].shards == {("r1", 0): r1}


def test_node_without_inventory_takes_no_new_replicas_and_memory_unknown_stays_none() -> None:
    st = _state()
    st.on_heartbeat(_hb(), 1.0)
    assert st.snapshot(1.0).nodes["n1"].state is NodeState.UNREACHABLE
    st.on_inventory(_inv(memory_gb=None), 1.5)
    view = st.snapshot(2.0).nodes["n1"]
    assert view.state is NodeState.READY
    assert view.memory_gb is None  # not 0 (ARCHITECTURE #3)
    assert len(view.gpus) == 2


def test_inventory_repeat_keeps_the_cached_view_and_marks_reach_it() -> None:
    st = _state()
    st.on_inventory(_inv(), 1.0)
    v1 = st.snapshot(1.0).nodes["n1"]
    assert not st.on_inventory(_inv(), 2.0)  # same content, sent again
    assert st.snapshot(2.0).nodes["n1"] is v1
    st.marks = Marks(cordoned=("n1",), draining={"n1": 99.0})
    v2 = st.snapshot(2.0).nodes["n1"]
    assert v2.cordoned and v2.draining and v2.drain_deadline == 99.0


def test_status_keeps_error_and_log_tail_and_fails_the_replica() -> None:
    st = _state()
    st.set_catalog(parse_catalog("models: [{name: m, engine: sim, nodes: 2, gpu_class: H100}]"), 1)
    st.on_inventory(_inv("a"), 1.0)
    st.on_inventory(_inv("b"), 1.0)
    st.put_replica(
        ReplicaRecord(
            id="r1",
            model="m",
            created=1.0,
            shards=(
                ShardPlacement(shard=0, node="a", gpus=(0,), port=1),
                ShardPlacement(shard=1, node="b", gpus=(0,), port=2),
            ),
        )
    )
    assert _phase(st, 2.0) is ReplicaPhase.STARTING
    for node, shard in (("a", 0), ("b", 1)):
        st.on_status(
            ShardStatus(
                node=node,
                boot_id="b1",
                sent_at=2.0,
                replica_id="r1",
                shard=shard,
                model="m",
                state=ShardState.READY,
                port=1 + shard,
            ),
            2.0,
        )
    assert _phase(st, 2.0) is ReplicaPhase.READY
    assert st.on_status(
        ShardStatus(
            node="b",
            boot_id="b1",
            sent_at=3.0,
            replica_id="r1",
            shard=1,
            model="m",
            state=ShardState.FAILED,
            error="CUDA out of memory",
            log_tail=("loading", "OOM"),
        ),
        3.0,
    )
    assert _phase(st, 3.0) is ReplicaPhase.FAILED
    detail = st.detail("b", ("r1", 1))
    assert detail is not None and detail.error == "CUDA out of memory"
    assert detail.log_tail == ("loading", "OOM")
    assert st.detail("a", ("r1", 1)) is None  # node a said nothing of it


def test_nodes_known_only_from_records_are_judged_from_our_start() -> None:
    st = _state()
    st.know_node("ghost", 100.0)
    st.put_replica(
        ReplicaRecord(
            id="r1", model="m", created=1.0, shards=(ShardPlacement(shard=0, node="ghost", gpus=(), port=1),)
        )
    )
    snap = st.snapshot(101.0)
    assert snap.nodes["ghost"].state is NodeState.UNREACHABLE  # silent, not yet lost
    assert st.snapshot(131.0).nodes["ghost"].state is NodeState.LOST


def test_adopted_replicas_get_the_startup_timeout_from_when_we_could_observe() -> None:
    st = _state()
    st.set_observed_from(500.0)
    st.put_replica(
        ReplicaRecord(
            id="r1", model="m", created=1.0, shards=(ShardPlacement(shard=0, node="a", gpus=(), port=1),)
        )
    )
    assert st.snapshot(501.0).replicas[0].created == 500.0
    assert st.replicas["r1"].created == 1.0


def test_control_plane_outage_is_not_the_nodes_silence() -> None:
    from llmgw_controlplane.scheduler.snapshot import NodeState
    from llmgw_controlplane.state import ClusterState

    st = ClusterState(heartbeat_interval_s=1.0, unreachable_after_missed=3, node_lost_s=10.0)
    st.know_node("n1", 0.0)
    st.judge(0.0)
    # Without excusing, 20 s of silence is a lost node...
    assert [t.new for t in st.judge(20.0)] == [NodeState.LOST]
    st2 = ClusterState(heartbeat_interval_s=1.0, unreachable_after_missed=3, node_lost_s=10.0)
    st2.know_node("n1", 0.0)
    st2.judge(0.0)
    # ...but when the control plane itself was cut off until t=20, the node's clock restarts then.
    st2.excuse_silence(20.0)
    assert st2.judge(21.0) == []
    assert [t.new for t in st2.judge(31.0)] == [NodeState.LOST]


# ------------------------------------------------------------------ restarts and forged messages


def _ready_replica(st: ClusterState, timeout_s: float = 600.0) -> ShardReport:
    """Replica r1 of model m on n1, created at 0 and reported ready by boot b1 from t=1."""
    st.set_catalog(parse_catalog(f"models: [{{name: m, engine: sim, startup_timeout_s: {timeout_s}}}]"), 1)
    st.on_inventory(_inv(boot="b1"), 0.0)
    st.put_replica(
        ReplicaRecord(
            id="r1", model="m", created=0.0, shards=(ShardPlacement(shard=0, node="n1", gpus=(), port=1),)
        )
    )
    ready = ShardReport(replica_id="r1", shard=0, model="m", state=ShardState.READY, port=1, pid=42)
    st.on_heartbeat(_hb(boot="b1", seq=1, sent_at=1.0, shards=(ready,)), 1.0)
    return ready


def _status(boot: str, state: ShardState, t: float) -> ShardStatus:
    return ShardStatus(
        node="n1", boot_id=boot, sent_at=t, replica_id="r1", shard=0, model="m", state=state, port=1
    )


def test_agent_restart_keeps_its_readopted_replicas_past_the_startup_timeout() -> None:
    st = _state()
    ready = _ready_replica(st, timeout_s=600.0)
    t = 700.0  # the replica has been up for 700 s, longer than its startup timeout
    st.on_heartbeat(_hb(boot="b1", seq=2, sent_at=t, shards=(ready,)), t)
    assert _phase(st, t) is ReplicaPhase.READY
    # The agent restarts: its new boot's inventory, then its re-adopted engine starting, then ready.
    st.on_inventory(_inv(boot="b2"), t + 1)
    steps = [
        (t + 1.5, None),
        (t + 2.0, _status("b2", ShardState.STARTING, t + 2.0)),
        (t + 3.0, _hb(boot="b2", seq=1, sent_at=t + 3.0, shards=(ready,))),
    ]
    for now, msg in steps:
        if isinstance(msg, ShardStatus):
            st.on_status(msg, now)
        elif msg is not None:
            st.on_heartbeat(msg, now)
        plan = reconcile(st.snapshot(now))
        assert plan.stop == () and plan.place == (), (now, plan.stop)
    assert _phase(st, t + 3.0) is ReplicaPhase.READY
    assert st.replicas["r1"].created == 0.0  # the record is unchanged


def test_an_agent_restart_keeps_the_ready_replica_routed_throughout() -> None:
    st = _state()
    ready = _ready_replica(st, timeout_s=600.0)

    def routed(now: float) -> list[str]:
        endpoints, _ = routing_content(st.snapshot(now), {})
        return [e.replica_id for e in endpoints.get("m", ())]

    assert routed(1.0) == ["r1"]
    # The new boot's inventory, then (the agent re-adopts its engine first) its ready status and heartbeat.
    st.on_inventory(_inv(boot="b2"), 2.0)
    assert routed(2.0) == ["r1"]
    st.on_status(_status("b2", ShardState.READY, 2.1), 2.1)
    assert routed(2.1) == ["r1"]
    st.on_heartbeat(_hb(boot="b2", seq=1, sent_at=2.2, shards=(ready,)), 2.2)
    assert routed(2.2) == ["r1"]


def test_another_nodes_restart_does_not_postpone_a_replicas_startup_timeout() -> None:
    """n2 claims n1's replica as its own ready shard and restarts: r1 (stuck starting on n1) still fails."""
    st = _state()
    _ready_replica(st, timeout_s=600.0)
    st.on_heartbeat(_hb(boot="b1", seq=2, sent_at=2.0), 2.0)  # n1: r1's engine is no longer ready
    claimed = ShardReport(replica_id="r1", shard=0, model="m", state=ShardState.READY, port=1)
    st.on_inventory(_inv(node="n2", boot="x1"), 2.0)
    for seq, t in enumerate((500.0, 599.0), 1):
        st.on_heartbeat(_hb(node="n2", boot=f"x{seq}", seq=1, sent_at=t, shards=(claimed,)), t)
        st.on_inventory(_inv(node="n2", boot=f"x{seq + 1}"), t + 0.5)  # a restart, proven
        st.on_heartbeat(_hb(seq=2 + seq, sent_at=t), t)  # n1 alive, r1 still not ready
    st.on_heartbeat(_hb(seq=10, sent_at=601.0), 601.0)
    assert _phase(st, 601.0) is ReplicaPhase.FAILED


def test_a_readopted_replica_that_never_reports_ready_again_still_fails_in_time() -> None:
    st = _state()
    _ready_replica(st, timeout_s=600.0)
    st.on_inventory(_inv(boot="b2"), 700.0)
    st.on_heartbeat(_hb(boot="b2", seq=1, sent_at=700.5), 700.5)  # its first: the engine is not ready
    # Counted from the restart: not before 600 s after it, but then.
    assert _phase(st, 1299.0) is ReplicaPhase.STARTING
    st.on_heartbeat(_hb(boot="b2", seq=2, sent_at=1299.0), 1299.0)  # keeps the node alive
    assert _phase(st, 1301.0) is ReplicaPhase.FAILED


def test_a_heartbeat_claiming_a_new_boot_is_not_believed_until_that_boots_inventory() -> None:
    st = _state()
    ready = _ready_replica(st)
    forged = _hb(boot="forged", seq=1, sent_at=2.0)
    assert not st.on_heartbeat(forged, 2.0)
    rec = st.nodes["n1"]
    assert rec.boot_id == "b1" and rec.restarts == 0 and rec.shards[("r1", 0)].state is ShardState.READY
    assert rec.last_seen == 1.0  # not even liveness
    assert st.wants_inventory("n1")  # the service asks the node to prove its boot
    assert not st.on_status(_status("forged", ShardState.FAILED, 2.5), 2.5)
    assert rec.shards[("r1", 0)].state is ShardState.READY
    # The genuine agent goes on; its inventory settles the question.
    st.on_heartbeat(_hb(boot="b1", seq=2, sent_at=3.0, shards=(ready,)), 3.0)
    st.on_inventory(_inv(boot="b1"), 3.5)
    assert not st.wants_inventory("n1")
    assert rec.last_seen == 3.5 and rec.seq == 2


def test_a_heartbeat_with_an_absurd_seq_or_time_freezes_nothing() -> None:
    st = _state()
    ready = _ready_replica(st)
    rec = st.nodes["n1"]

    def shard_state() -> ShardState:  # read afresh each time (mypy would narrow an expression kept)
        return rec.shards[("r1", 0)].state

    # A huge seq (same boot) claiming the replica is gone: not taken...
    st.on_heartbeat(_hb(boot="b1", seq=2**62, sent_at=2.0, shards=()), 2.0)
    assert shard_state() is ShardState.READY
    # ...and the genuine heartbeats after it still are (before, they looked like replays forever).
    failed = ready.model_copy(update={"state": ShardState.FAILED})
    assert st.on_heartbeat(_hb(boot="b1", seq=2, sent_at=3.0, shards=(failed,)), 3.0)
    assert shard_state() is ShardState.FAILED and rec.seq == 2
    # Times that are not times, or far in our future: the whole message is refused.
    for bad in (1e300, float("inf"), float("nan"), 3.0 + 3600):
        assert not st.on_heartbeat(_hb(boot="b1", seq=3, sent_at=bad, shards=(ready,)), 3.5)
        assert not st.on_inventory(_inv(boot="b1").model_copy(update={"sent_at": bad}), 3.5)
    assert shard_state() is ShardState.FAILED and rec.last_seen == 3.0
    # A status sent after the last genuine heartbeat is still taken (a kept 1e300 hid every one).
    assert st.on_status(_status("b1", ShardState.READY, 4.0), 4.0)
    assert shard_state() is ShardState.READY


def test_a_genuine_seq_jump_after_a_gap_is_taken() -> None:
    st = _state()
    _ready_replica(st)
    rec = st.nodes["n1"]
    # 100 s without heartbeats reaching us (at 2 s a beat, 50 were missed): a jump that fits the gap.
    assert st.on_heartbeat(_hb(boot="b1", seq=52, sent_at=101.0), 101.0)
    assert rec.seq == 52 and rec.shards == {}
    # A jump larger than the time allows is held until the next heartbeat confirms it.
    stopping = ShardReport(replica_id="r1", shard=0, model="m", state=ShardState.STOPPING, port=1)
    st.on_heartbeat(_hb(boot="b1", seq=5000, sent_at=102.0, shards=(stopping,)), 102.0)
    assert rec.seq == 52 and rec.shards == {}
    assert st.on_heartbeat(_hb(boot="b1", seq=5001, sent_at=104.0, shards=(stopping,)), 104.0)
    assert rec.seq == 5001 and rec.shards[("r1", 0)].state is ShardState.STOPPING


def test_silent_node_without_replicas_is_forgotten_after_node_forget_s() -> None:
    st = _state()  # node_lost_s 30
    for n in ("gone", "holds", "alive"):
        st.on_inventory(_inv(node=n), now=100.0)
    st.put_replica(
        ReplicaRecord(
            id="r1",
            model="m",
            created=1.0,
            shards=(ShardPlacement(shard=0, node="holds", gpus=(0,), port=1),),
        )
    )
    forget_s = 3600.0
    t = 100.0 + 30.0 + forget_s  # lost for exactly node_forget_s: not yet
    st.on_heartbeat(_hb(node="alive"), now=t)
    assert st.forget_silent(t, forget_s) == []
    assert st.snapshot(t).nodes["gone"].state is NodeState.LOST
    st.on_heartbeat(_hb(node="alive", seq=2), now=t + 1)
    assert st.forget_silent(t + 1, forget_s) == ["gone"]
    # Gone from the table and from every view built from it; the one holding a replica stays.
    assert set(st.nodes) == {"holds", "alive"}
    assert set(st.snapshot(t + 1).nodes) == {"holds", "alive"}
    assert st.forget_silent(t + 2, forget_s) == []  # said once
    # Its replica gone, the other lost node is forgotten too.
    st.drop_replica("r1")
    assert st.forget_silent(t + 3, forget_s) == ["holds"]
    # A forgotten node that reports again is a new node.
    assert st.on_heartbeat(_hb(node="gone", seq=7), now=t + 4)
    assert st.snapshot(t + 4).nodes["gone"].state is NodeState.UNREACHABLE  # no inventory yet
