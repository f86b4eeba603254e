"""Synthetic fleets and catalogs for measuring the pure side (placement, reconcile) at scale.

For benches and tests only: the service never calls this. :func:`measure_reconcile` returns figures
that ``bench/controlplane_scale.py`` can print next to its bus-level ones.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from types import MappingProxyType

from llmgw_common.catalog import Catalog, ModelProfile
from llmgw_common.messages import GpuInfo, Inventory, ShardState
from llmgw_controlplane.plan import Plan, ReconcileMemo
from llmgw_controlplane.reconciler import reconcile
from llmgw_controlplane.snapshot import GpuView, NodeView, ReplicaView, ShardView, Snapshot

GPU_CLASS = "H100-80GB"


def synthetic_nodes(count: int, gpus_per_node: int = 8, nodes_per_fabric: int = 32) -> dict[str, NodeView]:
    """``count`` ready nodes of ``gpus_per_node`` H100s, grouped into fabrics, all on 127.0.0.1."""
    gpus = tuple(GpuView(i, GPU_CLASS, 81920) for i in range(gpus_per_node))
    return {
        f"node-{i:05d}": NodeView(
            name=f"node-{i:05d}",
            fabric=f"ib-{i // nodes_per_fabric:03d}",
            gpus=gpus,
            memory_gb=1024.0,
            cpus=128,
            last_seen=0.0,
        )
        for i in range(count)
    }


def synthetic_inventories(
    count: int, gpus_per_node: int = 8, nodes_per_fabric: int = 32, sent_at: float = 0.0
) -> list[Inventory]:
    """The inventories a fleet of :func:`synthetic_nodes` would publish (simulated, as they are)."""
    out = []
    for name, n in synthetic_nodes(count, gpus_per_node, nodes_per_fabric).items():
        out.append(
            Inventory(
                node=name,
                boot_id="boot-1",
                sent_at=sent_at,
                fabric=n.fabric,
                memory_gb=n.memory_gb,
                cpus=n.cpus,
                engines=tuple(sorted(n.engines)),
                simulated=True,
                gpus=tuple(
                    GpuInfo(
                        index=g.index,
                        uuid=f"GPU-{name}-{g.index}",
                        name=g.gpu_class,
                        gpu_class=g.gpu_class,
                        memory_mb=g.memory_mb,
                    )
                    for g in n.gpus
                ),
            )
        )
    return out


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
