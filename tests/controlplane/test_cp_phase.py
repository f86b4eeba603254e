"""One notion of a replica's phase and of whether it is routed, read alike by every part of the control plane.

The reconciler, the routing table, events and the ctl views all read :func:`phase.replica_status` and
:func:`phase.serving`; these tests hold them to one answer over the same snapshot and fake clock.
"""

from __future__ import annotations

from llmgw_common.codec import decode, encode
from llmgw_common.ctl import ModelsReply, ModelState, ReplicaPhase, ReplicasReply
from llmgw_common.messages import ReplicaSpec
from llmgw_controlplane import views
from llmgw_controlplane.scheduler.event_detection import watch_inputs
from llmgw_controlplane.scheduler.idle import IdleMerger
from llmgw_controlplane.scheduler.phase import judged, replica_status, serving
from llmgw_controlplane.scheduler.reconciler import reconcile
from llmgw_controlplane.scheduler.routing import coming_content, routing_content
from llmgw_controlplane.scheduler.snapshot import Snapshot
from llmgw_controlplane.state import ClusterState
from tests.placement.placement_kit import NodeState, ShardState, node, profile, replica, snap


def _state() -> ClusterState:
    return ClusterState(heartbeat_interval_s=2.0, unreachable_after_missed=3, node_lost_s=30.0)


def _stuck(now: float) -> Snapshot:
    """r1 has been starting since 0 on a reporting node; its model allows 600 s to start."""
    return snap(
        [node("a")],
        [replica("r1", "m", [("a", (0,))], created=0.0, state=ShardState.STARTING, port=20000)],
        models=[profile(replicas=1, startup_timeout_s=600.0)],
        now=now,
    )


def test_a_replica_past_its_startup_timeout_is_failed_to_the_reconciler_ctl_and_routing() -> None:
    s = _stuck(601.0)
    plan = reconcile(s)
    assert [(x.replica_id, x.failed) for x in plan.stop] == [("r1", True)]
    # ctl replicas and ctl models say what the reconciler acts on, not "starting".
    [info] = views.replicas_info(_state(), s, IdleMerger(stale_s=5.0))
    assert info.state is ReplicaPhase.FAILED
    [model] = views.models_info(s, {}, {}, {})
    assert (model.starting, model.failed, model.state) == (0, 1, ModelState.DOWN)
    # Routers are not told a failed replica is on its way (they would hold requests for it).
    endpoints, why = routing_content(s, {})
    coming, _ = coming_content(s, endpoints, {}, ())
    assert "m" not in coming
    assert why["m"].startswith("no ready replica: 1 failed on a")


def test_the_same_replica_within_its_startup_timeout_is_starting_everywhere() -> None:
    s = _stuck(599.0)
    assert not reconcile(s).stop
    [info] = views.replicas_info(_state(), s, IdleMerger(stale_s=5.0))
    assert info.state is ReplicaPhase.STARTING
    assert views.models_info(s, {}, {}, {})[0].state is ModelState.STARTING
    endpoints, why = routing_content(s, {})
    assert coming_content(s, endpoints, {}, ())[0] == {"m": "1 replica starting on a"}
    assert why["m"] == "no ready replica: 1 starting on a"


def test_the_startup_timeout_is_the_one_the_replica_was_started_with() -> None:
    """A spec kept on the record wins over the current profile (a profile change rolls; it does not
    shorten the time a replica already starting was given)."""
    started = ReplicaSpec.of(profile(startup_timeout_s=1200.0))
    s = snap(
        [node("a")],
        [replica("r1", "m", [("a", (0,))], state=ShardState.STARTING, spec=started)],
        models=[profile(startup_timeout_s=600.0)],
        now=900.0,
    )
    assert replica_status(s, s.replicas[0]).phase is ReplicaPhase.STARTING
    gone = snap([node("a")], [replica("r1", "gone", [("a", (0,))], state=ShardState.STARTING)], now=1e6)
    # A model no longer in the catalog and no spec kept: no timeout to judge by (it is torn down anyway).
    assert replica_status(gone, gone.replicas[0]).phase is ReplicaPhase.STARTING


def test_failed_keeps_every_shards_error_and_stopping_says_which_shard() -> None:
    s = snap(
        [node("a"), node("b")],
        [replica("r1", "m", [("a", (0,)), ("b", (0,))], state=ShardState.FAILED)],
        models=[profile()],
    )
    st = replica_status(s, s.replicas[0])
    assert st.phase is ReplicaPhase.FAILED
    assert st.errors == ("shard 0 on a: failed", "shard 1 on b: failed")
    s2 = snap([node("a")], [replica("r1", "m", [("a", (0,))], state=ShardState.STOPPED)], models=[profile()])
    assert replica_status(s2, s2.replicas[0]) == replica_status(s2, s2.replicas[0])
    assert replica_status(s2, s2.replicas[0]).errors == ("shard 0 on a stopped",)


def test_serving_is_ready_and_on_no_lost_node_and_events_count_only_reporting_nodes() -> None:
    reps = [replica("r1", "m", [("a", (0,))], port=20000), replica("r2", "m", [("b", (0,))], port=20000)]
    models = [profile(watch={"budget": 5.0})]
    s = snap([node("a"), node("b", state=NodeState.UNREACHABLE)], reps, models=models)
    assert [serving(s, r) for r in s.replicas] == [True, True]
    assert watch_inputs(s)[0] == {"m": 1}  # r2 serves, but nobody knows that it does
    lost = snap([node("a"), node("b", state=NodeState.LOST)], reps, models=models)
    assert [serving(lost, r) for r in lost.replicas] == [True, False]
    absent = snap([node("a")], reps, models=models)
    assert [serving(absent, r) for r in absent.replicas] == [True, False]


def test_phases_are_judged_once_per_snapshot() -> None:
    s = _stuck(601.0)
    assert judged(s) is judged(s)
    assert judged(s).status["r1"].phase is ReplicaPhase.FAILED
    # Another time is another snapshot, judged afresh.
    assert judged(_stuck(599.0)).status["r1"].phase is ReplicaPhase.STARTING


def test_ctl_replies_carry_the_states_as_enums_through_the_codec() -> None:
    """``ctl replicas`` and ``ctl models`` say a replica's phase, its shards' states and a model's state
    as enums, and a reply decoded on the ctl side has the same enums (one codec)."""
    s = _stuck(599.0)
    [info] = views.replicas_info(_state(), s, IdleMerger(stale_s=5.0))
    assert (info.state, info.shards[0].state) == (ReplicaPhase.STARTING, ShardState.STARTING)
    assert type(info.shards[0].state) is ShardState
    reply = ReplicasReply(replicas=(info,))
    back = decode(encode(reply), ReplicasReply)
    assert back == reply and type(back.replicas[0].state) is ReplicaPhase
    models = ModelsReply(models=views.models_info(s, {}, {}, {}))
    assert type(decode(encode(models), ModelsReply).models[0].state) is ModelState
