"""Properties over generated fleets: placement never over-allocates, never uses an unhealthy card, never
splits a multi-node replica across fabrics, is deterministic; a reconcile plan never double-books."""

from __future__ import annotations

from types import MappingProxyType

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw_common.catalog import ModelProfile
from llmgw_controlplane.scheduler.placement import Placement, Unplaceable, explain, place
from llmgw_controlplane.scheduler.reconciler import reconcile
from llmgw_controlplane.scheduler.snapshot import (
    GpuView,
    NodeState,
    NodeView,
    ReplicaView,
    ShardView,
    Snapshot,
)
from tests.placement.placement_kit import A100, H100, profile, snap

CLASSES = (H100, A100)
FABRICS = (None, "f1", "f2")


@st.composite
def fleets(draw: st.DrawFn, max_nodes: int = 8) -> tuple[list[NodeView], list[ReplicaView]]:
    n = draw(st.integers(0, max_nodes))
    nodes: list[NodeView] = []
    replicas: list[ReplicaView] = []
    port = 20000
    for i in range(n):
        name = f"n{i}"
        count = draw(st.integers(0, 8))
        gpus = tuple(
            GpuView(
                j, draw(st.sampled_from(CLASSES)), healthy=draw(st.integers(0, 3)) > 0, reasons=("XID 79",)
            )
            for j in range(count)
        )
        nodes.append(
            NodeView(
                name=name,
                state=draw(st.sampled_from([NodeState.READY] * 4 + [NodeState.UNREACHABLE, NodeState.LOST])),
                fabric=draw(st.sampled_from(FABRICS)),
                gpus=gpus,
                memory_gb=draw(st.none() | st.sampled_from([8.0, 64.0])),
                cordoned=draw(st.integers(0, 9)) == 0,
                address=draw(st.sampled_from(["127.0.0.1", f"10.0.0.{i}"])),
            )
        )
        healthy = [g.index for g in gpus if g.healthy]
        held: list[int] = draw(st.lists(st.sampled_from(healthy), unique=True)) if healthy else []
        hosts = draw(st.booleans())
        if held or hosts:
            port += 1
            model = draw(st.sampled_from(["m0", "m1", "old"]))
            replicas.append(ReplicaView(f"r{i}", model, 0.0, (ShardView(0, name, tuple(held), port),)))
    return nodes, replicas


@st.composite
def profiles(draw: st.DrawFn, name: str = "m0") -> ModelProfile:
    cls = draw(st.sampled_from((*CLASSES, None)))
    if cls is None:
        return profile(
            name,
            engine="sim",
            nodes=draw(st.integers(1, 3)),
            replicas=draw(st.integers(0, 3)),
            min_memory_gb=draw(st.none() | st.just(32.0)),
        )
    return profile(
        name,
        engine="vllm",
        gpu_class=cls,
        gpus_per_node=draw(st.integers(1, 8)),
        nodes=draw(st.integers(1, 3)),
        replicas=draw(st.integers(0, 3)),
        min_memory_gb=draw(st.none() | st.just(32.0)),
    )


def _check_placement(res: Placement, prof: ModelProfile, s: Snapshot, extra: dict[str, set[int]]) -> None:
    used = s.used_gpus()
    assert len(res.shards) == prof.nodes
    assert len({sh.node for sh in res.shards}) == prof.nodes  # one shard per node
    for sh in res.shards:
        n = s.nodes[sh.node]
        assert n.state is NodeState.READY and not n.cordoned and not n.draining
        assert len(sh.gpus) == prof.gpus == len(set(sh.gpus))
        by_index = {g.index: g for g in n.gpus}
        for g in sh.gpus:
            assert by_index[g].healthy  # ARCHITECTURE #2
            assert by_index[g].gpu_class == prof.gpu_class
            assert g not in used.get(sh.node, set())  # never over-allocated
            assert g not in extra.get(sh.node, set())
    if prof.nodes > 1:
        fabrics = {s.nodes[sh.node].fabric for sh in res.shards}
        assert len(fabrics) == 1 and None not in fabrics  # ARCHITECTURE #7


def _oracle_single(prof: ModelProfile, s: Snapshot, extra: dict[str, set[int]]) -> bool:
    """Brute force: does any node fit one single-node replica?"""
    used = s.used_gpus()
    for n in s.nodes.values():
        if n.state is not NodeState.READY or n.cordoned or n.draining or prof.engine not in n.engines:
            continue
        if prof.min_memory_gb is not None and n.memory_gb is not None and n.memory_gb < prof.min_memory_gb:
            continue
        taken = used.get(n.name, set()) | extra.get(n.name, set())
        free = [g for g in n.gpus if g.healthy and g.gpu_class == prof.gpu_class and g.index not in taken]
        if prof.gpu_class is None or len(free) >= prof.gpus:
            return True
    return False


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleet=fleets(), prof=profiles(), extra_seed=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 7))))
@pytest.mark.slow
def test_place_is_sound_complete_and_deterministic(
    fleet: tuple[list[NodeView], list[ReplicaView]], prof: ModelProfile, extra_seed: list[tuple[int, int]]
) -> None:
    nodes, replicas = fleet
    s = snap(nodes, replicas)
    extra: dict[str, set[int]] = {}
    for ni, g in extra_seed:
        extra.setdefault(f"n{ni}", set()).add(g)
    res = place(prof, s, extra_used=extra)
    # Deterministic, whatever order the node table was built in.
    shuffled = Snapshot(
        now=s.now, nodes=MappingProxyType(dict(reversed(list(s.nodes.items())))), replicas=s.replicas
    )
    assert place(prof, shuffled, extra_used=extra) == res
    assert place(prof, s, extra_used=extra) == res
    if isinstance(res, Placement):
        _check_placement(res, prof, s, extra)
    else:
        assert isinstance(res, Unplaceable)
        assert {r.node for r in res.reasons} == set(s.nodes)  # every node has its reason
        assert all(r.reason for r in res.reasons)
        assert res.summary.startswith(("no node can hold model", "no fabric has"))
    if prof.nodes == 1:
        assert isinstance(res, Placement) == _oracle_single(prof, s, extra)
    if not extra:
        ex = explain(prof, s)
        assert ex.next == res
        if prof.nodes == 1:
            assert [v.node for v in ex.nodes if v.rank == 1] == (
                list(res.nodes) if isinstance(res, Placement) else []
            )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleet=fleets(), p0=profiles("m0"), p1=profiles("m1"), p2=profiles("m2"))
@pytest.mark.slow
def test_reconcile_never_double_books_gpus_or_ports(
    fleet: tuple[list[NodeView], list[ReplicaView]], p0: ModelProfile, p1: ModelProfile, p2: ModelProfile
) -> None:
    nodes, replicas = fleet
    s = snap(nodes, replicas, models=[p0, p1, p2])
    plan = reconcile(s)
    assert reconcile(s) == plan  # pure: same snapshot, same plan
    gpus: set[tuple[str, int]] = {(sh.node, g) for r in s.replicas for sh in r.shards for g in sh.gpus}
    ports: set[tuple[str, int]] = {
        (s.nodes[sh.node].address, sh.port) for r in s.replicas for sh in r.shards if sh.port
    }
    profiles_by = {p.name: p for p in (p0, p1, p2)}
    for nr in plan.place:
        prof = profiles_by[nr.model]
        assert len(nr.shards) == prof.nodes
        for sh in nr.shards:
            n = s.nodes[sh.node]
            assert n.state is NodeState.READY
            assert sh.address == n.address
            for g in sh.gpus:
                assert (sh.node, g) not in gpus
                gpus.add((sh.node, g))
                assert next(x for x in n.gpus if x.index == g).healthy
            assert (sh.address, sh.port) not in ports
            ports.add((sh.address, sh.port))
    # Replicas of models that left the catalog are all torn down (#10).
    stopped = {x.replica_id for x in plan.stop}
    assert {r.id for r in s.replicas if r.model == "old"} <= stopped
    # Never more placements than missing replicas.
    for name, prof in profiles_by.items():
        assert sum(1 for nr in plan.place if nr.model == name) <= prof.replicas
