"""Scores, table-driven: weights preference, bin-packing, CPU spread, model spread, deterministic ties."""

from __future__ import annotations

import pytest

from llmgw_common.catalog import ModelProfile
from llmgw_controlplane.scheduler.placement import Placement, explain, place
from llmgw_controlplane.scheduler.snapshot import NodeView, ReplicaView
from tests.placement.placement_kit import A100, local, node, profile, replica, shared, snap

CASES: list[tuple[str, list[NodeView], list[ReplicaView], ModelProfile, tuple[str, ...]]] = [
    # Bin-packing: the fullest node that still fits, so whole nodes stay free for multi-node replicas.
    (
        "pack",
        [node("a"), node("b"), node("c")],
        [replica("r1", "x", [("b", (0, 1, 2, 3, 4))])],
        profile(gpus_per_node=2),
        ("b",),
    ),
    ("pack-exact-fit", [node("a"), node("b", n_gpus=2)], [], profile(gpus_per_node=2), ("b",)),
    # Ties broken by name.
    ("tie-by-name", [node("c"), node("a"), node("b")], [], profile(), ("a",)),
    # Weights: a node that holds them locally wins over a fuller one.
    (
        "weights-local",
        [node("a", n_gpus=2), node("b", weights=(local("m"),), storage_looked=True)],
        [],
        profile(),
        ("b",),
    ),
    # Weights named differently from the model: the profile's weights name is what counts.
    (
        "weights-by-name",
        [node("a", n_gpus=2), node("b", weights=(local("llama-8b"),), storage_looked=True)],
        [],
        profile(weights="llama-8b"),
        ("b",),
    ),
    # Shared storage seen by one node of a fabric counts for every node of that fabric (#6) ...
    (
        "weights-shared-fabric",
        [
            node("a1", fabric="f-a", n_gpus=2),
            node("b1", fabric="f-b", weights=(shared("m"),), storage_looked=True),
            node("b2", fabric="f-b", n_gpus=4),
        ],
        [],
        profile(),
        ("b2",),
    ),
    # ... but never in another fabric: weights in f-b are not weights in f-a (#6).
    (
        "weights-not-across-fabrics",
        [
            node("a1", fabric="f-a", n_gpus=2),
            node("b1", fabric="f-b", weights=(shared("m"),), storage_looked=True),
        ],
        [replica("r", "x", [("b1", tuple(range(8)))])],
        profile(),
        ("a1",),
    ),
    # Local is never mistaken for shared: a local copy on b1 does not help b2 (#6).
    (
        "local-not-shared",
        [
            node("b1", fabric="f", weights=(local("m"),), storage_looked=True, cordoned=True),
            node("b2", fabric="f"),
            node("a", fabric="g", n_gpus=2),
        ],
        [],
        profile(),
        ("a",),
    ),
    # CPU replicas spread: the node running the fewest shards.
    (
        "cpu-spread",
        [node("a", n_gpus=0), node("b", n_gpus=0)],
        [replica("r1", "x", [("a", ())]), replica("r2", "y", [("a", ())])],
        profile(engine="llamacpp"),
        ("b",),
    ),
    # Replicas of one model spread over nodes, even against packing.
    (
        "model-spread-nodes",
        [node("a"), node("b")],
        [replica("r1", "m", [("a", (0,))]), replica("r2", "x", [("b", (0, 1, 2))])],
        profile(),
        ("b",),
    ),
    # ... and over fabrics where possible.
    (
        "model-spread-fabrics",
        [node("a1", fabric="fa"), node("a2", fabric="fa", n_gpus=2), node("b1", fabric="fb")],
        [replica("r1", "m", [("a1", (0,))])],
        profile(),
        ("b1",),
    ),
    # Multi-node: the fabric whose whole nodes pack best, leader first by name.
    (
        "multi-node",
        [node("a1", fabric="fa"), node("b1", fabric="fb"), node("b2", fabric="fb"), node("b3", fabric="fb")],
        [],
        profile(gpus_per_node=8, nodes=2),
        ("b1", "b2"),
    ),
    # Multi-node: nodes with fewer free cards are packed first within the fabric.
    (
        "multi-node-pack",
        [node("b1", fabric="fb"), node("b2", fabric="fb"), node("b3", fabric="fb", n_gpus=4)],
        [],
        profile(gpus_per_node=4, nodes=2),
        ("b3", "b1"),
    ),
    # Mixed classes: only the class asked for is counted.
    ("class", [node("a", cls=A100), node("b", n_gpus=1)], [], profile(), ("b",)),
]


@pytest.mark.parametrize(
    ("nodes", "replicas", "prof", "want"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_scores_choose(
    nodes: list[NodeView], replicas: list[ReplicaView], prof: ModelProfile, want: tuple[str, ...]
) -> None:
    res = place(prof, snap(nodes, replicas))
    assert isinstance(res, Placement), res
    assert res.nodes == want
    assert res.reasons  # it says why


def test_never_looked_ranks_with_found_nothing() -> None:
    """ARCHITECTURE #4: 'did not look' and 'looked, found nothing' score the same; only holding the weights ranks."""
    a = node("a", storage_looked=False)
    b = node("b", storage_looked=True, weights=())
    ex = explain(profile(), snap([a, b]))
    sa, sb = (v.score for v in ex.nodes)
    assert sa is not None and sb is not None
    assert sa.key("x") == sb.key("x")
    # Reverse the names: the order follows the name, not what was looked at.
    res = place(profile(), snap([node("b", storage_looked=False), node("a", storage_looked=True)]))
    assert isinstance(res, Placement) and res.nodes == ("a",)
    res = place(profile(), snap([node("a", storage_looked=False), node("b", storage_looked=True)]))
    assert isinstance(res, Placement) and res.nodes == ("a",)


def test_weights_are_a_preference_never_a_filter() -> None:
    res = place(profile(), snap([node("a", storage_looked=True)]))
    assert isinstance(res, Placement) and res.nodes == ("a",)
    # And the holder is skipped when it cannot fit.
    res = place(profile(gpus_per_node=4), snap([node("a"), node("b", n_gpus=2, weights=(local("m"),))]))
    assert isinstance(res, Placement) and res.nodes == ("a",)


def test_shared_weights_on_a_node_without_fabric_count_for_that_node_only() -> None:
    nodes = [node("a", fabric=None, weights=(shared("m"),)), node("b", fabric=None, n_gpus=1)]
    ex = explain(profile(), snap(nodes))
    assert {v.node: v.score and v.score.weights for v in ex.nodes} == {"a": "local", "b": None}


def test_reasons_name_weights_and_packing() -> None:
    res = place(profile(), snap([node("b", fabric="f", weights=(shared("m"),)), node("a", n_gpus=2)]))
    assert isinstance(res, Placement)
    assert res.reasons[0] == "b sees the weights m on shared storage in fabric f"
    assert res.reasons[1] == "b has 8 free H100-80GB: packing leaves 7"
    assert res.reasons[-1] == "2 of 2 nodes passed the node filters"
