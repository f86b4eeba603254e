"""The fast path (packing index + nodes with a non-default score) picks exactly what scoring every node picks.

Fleets here are large enough (> 64 eligible nodes) for place() to take the fast path; the oracle is
explain()'s full ranking, which scores and sorts every node.
"""

from __future__ import annotations

import random
from types import MappingProxyType

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw_common.catalog import ModelProfile
from llmgw_controlplane.scheduler.placement import Fleet, Placement, explain_in, place_in
from llmgw_controlplane.scheduler.snapshot import (
    GpuView,
    NodeState,
    NodeView,
    ReplicaView,
    ShardView,
    Snapshot,
)
from tests.placement.placement_kit import A100, H100, local, profile, shared


def _fleet(seed: int) -> Snapshot:
    rnd = random.Random(seed)
    nodes: dict[str, NodeView] = {}
    replicas: list[ReplicaView] = []
    for i in range(rnd.randint(70, 140)):
        name = f"n{i:03d}"
        fabric = rnd.choice([None, "f1", "f2", "f3", "f4"])
        gpus = tuple(
            GpuView(j, H100 if rnd.random() < 0.8 else A100, healthy=rnd.random() > 0.05)
            for j in range(rnd.choice([0, 4, 8, 8]))
        )
        weights = []
        if rnd.random() < 0.05:
            weights.append(local(rnd.choice(["m0", "m1"])))
        if rnd.random() < 0.03:
            weights.append(shared(rnd.choice(["m0", "m2"])))
        nodes[name] = NodeView(
            name=name,
            state=NodeState.READY if rnd.random() > 0.05 else NodeState.UNREACHABLE,
            fabric=fabric,
            gpus=gpus,
            cordoned=rnd.random() < 0.05,
            weights=tuple(weights),
        )
        held = [g.index for g in gpus if g.healthy and rnd.random() < 0.3]
        if held or rnd.random() < 0.2:
            replicas.append(
                ReplicaView(
                    f"r{i}", rnd.choice(["m0", "m1", "m2", "x"]), 0.0, (ShardView(0, name, tuple(held)),)
                )
            )
    return Snapshot(now=0.0, nodes=MappingProxyType(nodes), replicas=tuple(replicas))


def _profiles(rnd: random.Random) -> list[ModelProfile]:
    out = []
    for _ in range(rnd.randint(5, 25)):
        name = f"m{rnd.randint(0, 3)}"
        if rnd.random() < 0.2:
            out.append(profile(name, engine="sim"))
        else:
            out.append(
                profile(
                    name,
                    gpu_class=H100 if rnd.random() < 0.9 else A100,
                    gpus_per_node=rnd.choice([1, 1, 2, 4, 8]),
                )
            )
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
@pytest.mark.slow
def test_fast_path_matches_full_ranking_through_a_pass(seed: int) -> None:
    snap = _fleet(seed)
    fleet = Fleet(snap)
    for prof in _profiles(random.Random(seed)):
        ex = explain_in(prof, fleet)
        res = place_in(prof, fleet)
        first = [v.node for v in ex.nodes if v.rank == 1]
        if isinstance(res, Placement):
            assert first == [res.nodes[0]]
            fleet.take(res)
        else:
            assert first == []
