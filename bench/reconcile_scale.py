"""The pure reconcile at scale: one pass placing a synthetic catalog on an empty synthetic fleet, then
the median steady-state (no-op) pass. No bus, no processes: ``bench/controlplane_scale.py`` measures
the same through a real control-plane process.

    .venv/bin/python bench/reconcile_scale.py      # 100, 1,000, 5,000 nodes, 500 models
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from types import MappingProxyType

from llmgw_common.catalog import Catalog, ModelProfile
from llmgw_common.messages import ShardState
from llmgw_controlplane.scheduler.plan import Plan, ReconcileMemo
from llmgw_controlplane.scheduler.reconciler import reconcile
from llmgw_controlplane.scheduler.snapshot import GpuView, NodeView, ReplicaView, ShardView, Snapshot
from llmgw_sim.synthetic import GPU_CLASS, synthetic_inventories


def synthetic_nodes(count: int, gpus_per_node: int = 8, nodes_per_fabric: int = 32) -> dict[str, NodeView]:
    """The control plane's view of :func:`synthetic_inventories`: every node ready, on 127.0.0.1."""
    return {
        inv.node: NodeView(
            name=inv.node,
            fabric=inv.fabric,
            gpus=tuple(GpuView(g.index, g.gpu_class, g.memory_mb) for g in inv.gpus),
            memory_gb=inv.memory_gb,
            cpus=inv.cpus,
            engines=frozenset(inv.engines),
            last_seen=0.0,
        )
        for inv in synthetic_inventories(count, gpus_per_node, nodes_per_fabric)
    }


def synthetic_catalog(models: int) -> Catalog:
    """A mix: mostly 1-GPU models, some tensor-parallel, a few multi-node and CPU ones; 1-3 replicas."""
    out: list[ModelProfile] = []
    for i in range(models):
        kind = i % 20
        if kind == 0:
            p = ModelProfile(name=f"model-{i}", engine="sim", gpu_class=GPU_CLASS, gpus_per_node=8, nodes=2)
        elif kind in (1, 2):
            p = ModelProfile(name=f"model-{i}", engine="sim", replicas=1 + i % 2)
        elif kind < 8:
            p = ModelProfile(
                name=f"model-{i}", engine="vllm", gpu_class=GPU_CLASS, gpus_per_node=4, replicas=1 + i % 2
            )
        else:
            p = ModelProfile(
                name=f"model-{i}", engine="vllm", gpu_class=GPU_CLASS, gpus_per_node=1, replicas=1 + i % 3
            )
        out.append(p)
    return Catalog(models=tuple(out))


def settle(snap: Snapshot, plan: Plan, created: float) -> Snapshot:
    """The snapshot after ``plan`` was applied and every new shard reported ready (stops removed)."""
    stopped = {s.replica_id for s in plan.stop}
    replicas = [r for r in snap.replicas if r.id not in stopped]
    for nr in plan.place:
        shards = tuple(ShardView(s.shard, s.node, s.gpus, s.port, ShardState.READY) for s in nr.shards)
        replicas.append(ReplicaView(nr.replica_id, nr.model, created, shards))
    return replace(snap, replicas=tuple(replicas))


@dataclass(frozen=True, slots=True)
class ReconcileFigures:
    nodes: int
    models: int
    replicas: int
    place_from_empty_s: float
    steady_pass_ms: float
    steady_changes: bool


def measure_reconcile(nodes: int, models: int, *, repeats: int = 20) -> ReconcileFigures:
    """Time one pass placing everything from empty, then the median steady-state (no-op) pass."""
    catalog = synthetic_catalog(models)
    empty = Snapshot(now=1000.0, nodes=MappingProxyType(synthetic_nodes(nodes)), catalog=catalog)
    t0 = time.perf_counter()
    plan = reconcile(empty, ReconcileMemo())
    placed_s = time.perf_counter() - t0
    steady = replace(settle(empty, plan, created=1000.0), now=1001.0)
    memo = plan.memo
    times: list[float] = []
    last = plan
    for _ in range(repeats):
        t0 = time.perf_counter()
        last = reconcile(steady, memo)
        times.append(time.perf_counter() - t0)
    times.sort()
    return ReconcileFigures(
        nodes=nodes,
        models=models,
        replicas=len(steady.replicas),
        place_from_empty_s=placed_s,
        steady_pass_ms=times[len(times) // 2] * 1000,
        steady_changes=last.changes,
    )


if __name__ == "__main__":
    for n in (100, 1000, 5000):
        print(measure_reconcile(n, 500))
