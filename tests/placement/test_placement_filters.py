"""Every feasibility filter, table-driven: what it refuses, and the reason it gives in the user's terms."""

from __future__ import annotations

import pytest

from llmgw_common.catalog import ModelProfile
from llmgw_controlplane.scheduler.placement import (
    Placement,
    Stage,
    Unplaceable,
    explain,
    place,
)
from llmgw_controlplane.scheduler.snapshot import NodeView
from tests.placement.placement_kit import A100, H100, NodeState, gpus, node, profile, replica, snap

REFUSALS: list[tuple[str, NodeView, ModelProfile, str, int]] = [
    (
        "unreachable",
        node("n1", state=NodeState.UNREACHABLE),
        profile(),
        "is unreachable (missed heartbeats)",
        Stage.STATE,
    ),
    (
        "lost",
        node("n1", state=NodeState.LOST),
        profile(),
        "is lost (silent past the lost timeout)",
        Stage.STATE,
    ),
    ("cordoned", node("n1", cordoned=True), profile(), "is cordoned", Stage.CORDON),
    ("draining", node("n1", draining=True), profile(), "is draining", Stage.DRAIN),
    (
        "engine",
        node("n1", engines=frozenset({"sim", "llamacpp"})),
        profile(),
        "does not offer engine vllm (offers llamacpp, sim)",
        Stage.ENGINE,
    ),
    (
        "label missing",
        node("n1"),
        profile(node_selector={"role": "coding"}),
        "lacks label role=coding",
        Stage.SELECTOR,
    ),
    (
        "label differs",
        node("n1", labels={"role": "chat"}),
        profile(node_selector={"role": "coding"}),
        "has label role=chat, needs role=coding",
        Stage.SELECTOR,
    ),
    (
        "memory",
        node("n1", memory_gb=8.0),
        profile(min_memory_gb=24),
        "has 8 GB of memory, needs 24",
        Stage.MEMORY,
    ),
    ("wrong class", node("n1", cls=A100), profile(), "has no H100-80GB GPUs (has A100-80GB)", Stage.CLASS),
    ("no gpus", node("n1", n_gpus=0), profile(), "has no GPUs, needs H100-80GB", Stage.CLASS),
    (
        "too few gpus, one unhealthy",
        node("n1", gpus=gpus(4, unhealthy={3: "XID 79"})),
        profile(gpus_per_node=4),
        "has 3 free H100-80GB, needs 4; GPU 3 unhealthy: XID 79",
        Stage.GPUS,
    ),
    (
        "cpu-only sim on no fabric for 2 nodes",
        node("n1", n_gpus=0),
        profile(engine="sim", nodes=2),
        "has no fabric; a 2-node replica needs whole nodes in one fabric",
        Stage.FABRIC,
    ),
]


@pytest.mark.parametrize(
    ("nv", "prof", "reason", "stage"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS]
)
def test_each_filter_refuses_with_its_reason(
    nv: NodeView, prof: ModelProfile, reason: str, stage: Stage
) -> None:
    res = place(prof, snap([nv]))
    assert isinstance(res, Unplaceable)
    assert [(r.node, r.reason, r.stage) for r in res.reasons] == [("n1", reason, stage)]
    # The stage is named, not a bare number: explain and summaries can say which filter refused.
    assert type(res.reasons[0].stage) is Stage
    # ARCHITECTURE #9: the one-line summary names what was short, never "no candidates".
    assert f"n1 {reason}" in res.summary
    assert res.summary.startswith(("no node can hold model m:", "no fabric has 2 whole nodes for model m:"))


@pytest.mark.parametrize(
    ("nv", "prof"),
    [
        (node("n1", memory_gb=None), profile(min_memory_gb=512)),  # #3: unknown memory is not small memory
        (node("n1", memory_gb=8.0), profile()),  # no min_memory_gb fits anywhere
        (node("n1", memory_gb=24.0), profile(min_memory_gb=24)),  # exactly enough
        (node("n1", labels={"role": "coding", "x": "y"}), profile(node_selector={"role": "coding"})),
        (node("n1", n_gpus=0), profile(engine="llamacpp")),  # CPU profile on a GPU-less node
        (node("n1", gpus=gpus(8, unhealthy={0: "XID 79", 1: ""})), profile(gpus_per_node=6)),
    ],
    ids=["memory-unknown", "no-min-memory", "memory-exact", "labels-superset", "cpu", "unhealthy-but-enough"],
)
def test_passing_nodes(nv: NodeView, prof: ModelProfile) -> None:
    res = place(prof, snap([nv]))
    assert isinstance(res, Placement), res
    assert res.nodes == ("n1",)


def test_filters_apply_in_order_first_failing_reason_is_kept() -> None:
    # Cordoned AND wrong class: the cordon is what the operator must undo first.
    res = place(profile(), snap([node("n1", cls=A100, cordoned=True)]))
    assert isinstance(res, Unplaceable)
    assert res.reasons[0].reason == "is cordoned"


def test_excluded_node() -> None:
    res = place(profile(), snap([node("n1")]), exclude_nodes=frozenset({"n1"}))
    assert isinstance(res, Unplaceable)
    assert (res.reasons[0].reason, res.reasons[0].stage) == (
        "is excluded from this placement",
        Stage.EXCLUDED,
    )


def test_unhealthy_gpus_are_neither_used_nor_free() -> None:
    """ARCHITECTURE #2: 8 cards, 2 unhealthy, 4 in use: 2 free, not 4."""
    nv = node("n1", gpus=gpus(8, unhealthy={6: "XID 79", 7: "uncorrectable ECC errors: 3"}))
    held = replica("r1", "other", [("n1", (0, 1, 2, 3))])
    res = place(profile(gpus_per_node=4), snap([nv], [held]))
    assert isinstance(res, Unplaceable)
    assert res.reasons[0].reason == (
        "has 2 free H100-80GB, needs 4; GPU 6 unhealthy: XID 79; "
        "GPU 7 unhealthy: uncorrectable ECC errors: 3; 4 in use by replicas"
    )
    ok = place(profile(gpus_per_node=2), snap([nv], [held]))
    assert isinstance(ok, Placement)
    assert ok.shards[0].gpus == (4, 5)


def test_extra_used_counts_as_used() -> None:
    res = place(profile(gpus_per_node=4), snap([node("n1")]), extra_used={"n1": {0, 1, 2, 3, 4}})
    assert isinstance(res, Unplaceable)
    assert res.reasons[0].reason == "has 3 free H100-80GB, needs 4; 5 in use by replicas"


def test_wrong_fabric_free_cards_are_not_capacity() -> None:
    """ARCHITECTURE #7: 16 free cards in total, but one whole node per fabric, so no 2-node replica."""
    nodes = [node("a1", fabric="ib-a"), node("b1", fabric="ib-b"), node("c1", fabric=None)]
    res = place(profile("big", gpus_per_node=8, nodes=2), snap(nodes))
    assert isinstance(res, Unplaceable)
    by_node = {r.node: r.reason for r in res.reasons}
    assert by_node == {
        "a1": "fabric ib-a has 1 node with 8 free H100-80GB, needs 2",
        "b1": "fabric ib-b has 1 node with 8 free H100-80GB, needs 2",
        "c1": "has no fabric; a 2-node replica needs whole nodes in one fabric",
    }
    assert [f.reason for f in res.fabrics] == [
        "fabric ib-a has 1 node with 8 free H100-80GB, needs 2",
        "fabric ib-b has 1 node with 8 free H100-80GB, needs 2",
    ]
    assert res.summary.startswith("no fabric has 2 whole nodes for model big: fabric ib-a has 1 node")
    # A second whole node in ib-b makes it placeable, and only there.
    ok = place(profile("big", gpus_per_node=8, nodes=2), snap([*nodes, node("b2", fabric="ib-b")]))
    assert isinstance(ok, Placement)
    assert ok.nodes == ("b1", "b2")
    assert all(s.gpus == tuple(range(8)) for s in ok.shards)


def test_partially_used_node_is_not_a_whole_node() -> None:
    nodes = [node("a1", fabric="ib-a"), node("a2", fabric="ib-a")]
    res = place(profile("big", gpus_per_node=8, nodes=2), snap(nodes, [replica("r", "x", [("a2", (0,))])]))
    assert isinstance(res, Unplaceable)
    assert {r.node: r.reason for r in res.reasons} == {
        "a1": "fabric ib-a has 1 node with 8 free H100-80GB, needs 2",
        "a2": "has 7 free H100-80GB, needs 8; 1 in use by replicas",
    }


def test_summary_groups_identical_reasons_with_counts_closest_first() -> None:
    nodes = [node(f"c{i}", cls=A100) for i in range(10)] + [node("g1", n_gpus=2), node("x", cordoned=True)]
    res = place(profile(gpus_per_node=4), snap(nodes))
    assert isinstance(res, Unplaceable)
    assert res.summary == (
        "no node can hold model m: g1 has 2 free H100-80GB, needs 4; "
        "10 nodes (c0, c1, c2 and 7 more): has no H100-80GB GPUs (has A100-80GB); x is cordoned"
    )
    assert len(res.reasons) == 12


def test_summary_for_an_empty_fleet_says_so() -> None:
    res = place(profile(), snap([]))
    assert isinstance(res, Unplaceable)
    assert res.summary == "no node can hold model m: no node has reported"


def test_vllm_without_gpu_class_is_refused_with_the_profile_problem() -> None:
    prof = ModelProfile.model_construct(**{**profile().model_dump(), "gpu_class": None})
    res = place(prof, snap([node("n1")]))
    assert isinstance(res, Unplaceable)
    assert res.summary == "engine vllm needs a GPU: model m has no gpu_class"


def test_explain_lists_every_node_with_verdict_score_and_rank() -> None:
    nodes = [node("a", n_gpus=4), node("b"), node("c", cordoned=True), node("d", memory_gb=8.0)]
    ex = explain(profile(gpus_per_node=2, min_memory_gb=16), snap(nodes))
    by = {v.node: v for v in ex.nodes}
    assert [v.node for v in ex.nodes] == ["a", "b", "c", "d"]
    assert (by["a"].feasible, by["a"].rank, by["a"].score and by["a"].score.free_after) == (True, 1, 2)
    assert (by["b"].feasible, by["b"].rank, by["b"].score and by["b"].score.free_after) == (True, 2, 6)
    assert (by["c"].feasible, by["c"].reason) == (False, "is cordoned")
    assert (by["d"].feasible, by["d"].reason) == (False, "has 8 GB of memory, needs 16")
    assert isinstance(ex.next, Placement)
    assert ex.next.nodes == ("a",)
    assert ex.needs == "2 H100-80GB, engine vllm"


def test_explain_agrees_with_place_when_unplaceable() -> None:
    nodes = [node("a", fabric="f1"), node("b", fabric="f2")]
    prof = profile(gpus_per_node=8, nodes=2)
    ex = explain(prof, snap(nodes))
    assert isinstance(ex.next, Unplaceable)
    assert ex.next == place(prof, snap(nodes))
    assert [(f.fabric, f.feasible, f.eligible_nodes) for f in ex.fabrics] == [
        ("f1", False, ("a",)),
        ("f2", False, ("b",)),
    ]
    assert H100 in ex.needs and ex.needs.startswith("2 nodes x 8")


def test_summary_names_near_fabrics_only_and_compresses_many() -> None:
    nodes = [node(f"{f}-1", fabric=f) for f in ("f1", "f2", "f3", "f4", "f5", "f6")]
    nodes += [node(f"e{i}", fabric=f"empty{i}", cordoned=True) for i in range(30)]
    res = place(profile("big", gpus_per_node=8, nodes=2), snap(nodes))
    assert isinstance(res, Unplaceable)
    assert len(res.fabrics) == 36
    assert res.summary == (
        "no fabric has 2 whole nodes for model big: fabric f1 has 1 node with 8 free H100-80GB, needs 2; "
        "fabric f2 has 1 node with 8 free H100-80GB, needs 2; fabric f3 has 1 node with 8 free H100-80GB, "
        "needs 2; fabric f4 has 1 node with 8 free H100-80GB, needs 2; 2 more fabrics short of whole nodes; "
        "30 nodes (e0, e1, e10 and 27 more): is cordoned"
    )
