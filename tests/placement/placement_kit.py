"""Builders for snapshots: a real in-memory state, written the way an operator would describe a fleet."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from llmgw_common.catalog import Catalog, ModelProfile
from llmgw_common.messages import ShardState, WeightsEntry
from llmgw_controlplane.scheduler.plan import Plan
from llmgw_controlplane.scheduler.snapshot import (
    GpuView,
    NodeState,
    NodeView,
    ReplicaView,
    ShardView,
    Snapshot,
)

H100 = "H100-80GB"
A100 = "A100-80GB"


def gpus(n: int, cls: str = H100, *, unhealthy: dict[int, str] | None = None) -> tuple[GpuView, ...]:
    bad = unhealthy or {}
    return tuple(
        GpuView(i, cls, 81920, healthy=i not in bad, reasons=(bad[i],) if bad.get(i) else ())
        for i in range(n)
    )


def node(name: str, n_gpus: int = 8, cls: str = H100, **kw: Any) -> NodeView:
    kw.setdefault("gpus", gpus(n_gpus, cls))
    if "labels" in kw:
        kw["labels"] = MappingProxyType(dict(kw["labels"]))
    return NodeView(name=name, **kw)


def profile(name: str = "m", **kw: Any) -> ModelProfile:
    kw.setdefault("engine", "vllm")
    if kw["engine"] == "vllm":
        kw.setdefault("gpu_class", H100)
    return ModelProfile(name=name, **kw)


def local(name: str) -> WeightsEntry:
    return WeightsEntry(name=name, path=f"/models/{name}", shared=False)


def shared(name: str, filer: str = "filer1:/models") -> WeightsEntry:
    return WeightsEntry(name=name, path=f"/mnt/models/{name}", shared=True, filer_id=filer)


def replica(
    rid: str,
    model: str,
    shards: Iterable[tuple[str, tuple[int, ...]]],
    *,
    created: float = 0.0,
    state: ShardState | None = ShardState.READY,
    port: int = 0,
    **kw: Any,
) -> ReplicaView:
    return ReplicaView(
        rid,
        model,
        created,
        tuple(ShardView(i, n, g, port + i if port else 0, state) for i, (n, g) in enumerate(shards)),
        **kw,
    )


def snap(
    nodes: Iterable[NodeView],
    replicas: Iterable[ReplicaView] = (),
    models: Iterable[ModelProfile] = (),
    now: float = 1000.0,
) -> Snapshot:
    return Snapshot(
        now=now,
        nodes=MappingProxyType({n.name: n for n in nodes}),
        replicas=tuple(replicas),
        catalog=Catalog(models=tuple(models)),
    )


def apply(s: Snapshot, plan: Plan, *, state: ShardState | None = None, now: float | None = None) -> Snapshot:
    """What the service would do: records added for placements, removed for stops, draining marked."""
    stopped = {x.replica_id for x in plan.stop}
    marked = set(plan.mark_draining)
    reps = [
        replace(r, draining=True, draining_since=s.now) if r.id in marked else r
        for r in s.replicas
        if r.id not in stopped
    ]
    for nr in plan.place:
        shards = tuple(
            replace(
                replica("x", "x", [(sh.node, sh.gpus)], state=state).shards[0], shard=sh.shard, port=sh.port
            )
            for sh in nr.shards
        )
        reps.append(ReplicaView(nr.replica_id, nr.model, s.now, shards, spec=nr.spec))
    return replace(s, replicas=tuple(reps), now=s.now if now is None else now)


def set_state(s: Snapshot, rid: str, state: ShardState, error: str | None = None) -> Snapshot:
    reps = tuple(
        replace(r, shards=tuple(replace(sh, state=state, error=error) for sh in r.shards))
        if r.id == rid
        else r
        for r in s.replicas
    )
    return replace(s, replicas=reps)


__all__ = [
    "A100",
    "H100",
    "NodeState",
    "ShardState",
    "apply",
    "gpus",
    "local",
    "node",
    "profile",
    "replica",
    "set_state",
    "shared",
    "snap",
]
