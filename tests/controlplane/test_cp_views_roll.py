"""ctl views of a profile change being rolled out: which replicas run the old profile, and why a model
that serves is not done (issue 12 item 14)."""

from __future__ import annotations

from llmgw_common.catalog import parse_catalog
from llmgw_common.messages import (
    GpuInfo,
    Heartbeat,
    Inventory,
    ReplicaRecord,
    ReplicaSpec,
    ShardPlacement,
    ShardReport,
    ShardState,
)
from llmgw_controlplane import views
from llmgw_controlplane.scheduler.idle import IdleMerger
from llmgw_controlplane.state import ClusterState

OLD = parse_catalog("models: [{name: m, engine: sim, replicas: 2, options: {tokens_per_s: 100}}]")
NEW = parse_catalog("models: [{name: m, engine: sim, replicas: 2, options: {tokens_per_s: 120}}]")


def _state(specs: dict[str, ReplicaSpec]) -> ClusterState:
    st = ClusterState(heartbeat_interval_s=2.0, unreachable_after_missed=3, node_lost_s=30.0, catalog=NEW)
    gpu = GpuInfo(index=0, uuid="u", name="H", gpu_class="H100", memory_mb=1)
    st.on_inventory(Inventory(node="n1", boot_id="b", sent_at=0.0, gpus=(gpu,)), 100.0)
    shards = []
    for i, (rid, spec) in enumerate(specs.items()):
        st.put_replica(
            ReplicaRecord(
                id=rid,
                model="m",
                created=1.0,
                shards=(ShardPlacement(shard=0, node="n1", port=20000 + i),),
                spec=spec,
            )
        )
        shards.append(ShardReport(replica_id=rid, shard=0, model="m", state=ShardState.READY, port=20000 + i))
    st.on_heartbeat(Heartbeat(node="n1", boot_id="b", seq=1, sent_at=100.0, shards=tuple(shards)), 100.0)
    return st


def test_models_and_replicas_show_a_roll_in_progress_and_why_it_waits() -> None:
    st = _state({"old": ReplicaSpec.of(OLD.models[0]), "new": ReplicaSpec.of(NEW.models[0])})
    snap = st.snapshot(100.0)
    (m,) = views.models_info(snap, {}, {}, {})
    assert (m.state, m.ready, m.outdated) == ("ok", 2, 1)
    assert m.reason == "rolling out a profile change: 1 replica(s) on the old profile"
    (held,) = views.models_info(snap, {}, {"m": "no node has a free H100"}, {})
    assert held.reason is not None and held.reason.endswith("replacement held up: no node has a free H100")
    reps = {r.id: r for r in views.replicas_info(st, snap, IdleMerger(stale_s=5.0))}
    assert reps["old"].outdated and not reps["new"].outdated


def test_no_roll_no_reason() -> None:
    st = _state({"a": ReplicaSpec.of(NEW.models[0]), "b": ReplicaSpec.of(NEW.models[0])})
    (m,) = views.models_info(st.snapshot(100.0), {}, {}, {})
    assert (m.state, m.outdated, m.reason) == ("ok", 0, None)
