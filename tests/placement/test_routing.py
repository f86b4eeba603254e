"""What routers are told (``routing_content``), over real in-memory snapshots: pure, no bus.

ARCHITECTURE #8: a draining replica keeps taking new requests until enough replacements serve; only
then is its endpoint flagged ``draining`` so that routers send it nothing new.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import pytest

from llmgw_common.messages import ReplicaSpec
from llmgw_controlplane.scheduler.reconciler import reconcile
from llmgw_controlplane.scheduler.routing import routing_content
from llmgw_controlplane.scheduler.snapshot import NodeView, ReplicaView
from tests.placement.placement_kit import (
    NodeState,
    ShardState,
    apply,
    node,
    profile,
    replica,
    set_state,
    snap,
)


def _rep(
    rid: str, n: str, port: int, *, created: float, draining: bool = False, ready: bool = True
) -> ReplicaView:
    return replica(
        rid,
        "m",
        [(n, (0,))],
        created=created,
        port=port,
        state=ShardState.READY if ready else ShardState.STARTING,
        draining=draining,
        draining_since=900.0 if draining else None,
    )


def _flags(nodes: Iterable[NodeView], reps: Iterable[ReplicaView], wanted: int) -> dict[str, bool]:
    """replica id -> its endpoint's ``draining`` flag, for the endpoints routers are told of."""
    endpoints, _ = routing_content(snap(nodes, reps, models=[profile(replicas=wanted)]), {})
    return {e.replica_id: e.draining for e in endpoints.get("m", ())}


CASES = [
    pytest.param(
        [node("a"), node("b"), node("c")],
        [
            _rep("old", "a", 20000, created=1.0, draining=True),
            _rep("keep", "b", 20001, created=2.0),
            _rep("new", "c", 20002, created=950.0, ready=False),
        ],
        2,
        {"old": False, "keep": False},
        id="roll: replacement starting, the draining one still routed",
    ),
    pytest.param(
        [node("a"), node("b"), node("c")],
        [
            _rep("old", "a", 20000, created=1.0, draining=True),
            _rep("keep", "b", 20001, created=2.0),
            _rep("new", "c", 20002, created=950.0),
        ],
        2,
        {"old": True, "keep": False, "new": False},
        id="roll: replacement ready, the draining one flagged",
    ),
    pytest.param(
        [node("a", cordoned=True), node("b")],
        [_rep("r1", "a", 20000, created=1.0), _rep("r2", "b", 20001, created=2.0)],
        2,
        {"r1": False, "r2": False},
        id="cordon only: nothing flagged",
    ),
    pytest.param(
        [node("a", draining=True)],
        [_rep("old", "a", 20000, created=1.0, draining=True)],
        1,
        {"old": False},
        id="only replica draining, nowhere to go: still routed",
    ),
    pytest.param(
        [node("a", draining=True)],
        [_rep("old", "a", 20000, created=1.0, draining=True)],
        0,
        # Being stopped anyway; until it is, flagging it would only refuse every request of the model.
        {"old": False},
        id="0 wanted, only a draining replica: still routed until stopped",
    ),
    pytest.param(
        [node("a", draining=True), node("b")],
        [
            _rep("old1", "a", 20000, created=1.0, draining=True),
            _rep("old2", "a", 20001, created=2.0, draining=True),
            _rep("new1", "b", 20002, created=950.0),
            _rep("new2", "b", 20003, created=951.0, ready=False),
        ],
        3,
        # 1 replacement serves of 3 wanted: 2 draining ones still fill the gap.
        {"old1": False, "old2": False, "new1": False},
        id="node drain: 1 of 3 serves, both draining ones routed",
    ),
    pytest.param(
        [node("a", draining=True), node("b")],
        [
            _rep("old1", "a", 20000, created=1.0, draining=True),
            _rep("old2", "a", 20001, created=2.0, draining=True),
            _rep("new1", "b", 20002, created=950.0),
            _rep("new2", "b", 20003, created=951.0),
        ],
        3,
        # 2 serve of 3 wanted: the oldest draining one fills the gap (the one the reconciler keeps).
        {"old1": False, "old2": True, "new1": False, "new2": False},
        id="node drain: 2 of 3 serve, only the gap is filled",
    ),
]


@pytest.mark.parametrize(("nodes", "reps", "wanted", "flags"), CASES)
def test_draining_endpoint_is_flagged_only_once_enough_replacements_serve(
    nodes: list[NodeView], reps: list[ReplicaView], wanted: int, flags: dict[str, bool]
) -> None:
    assert _flags(nodes, reps, wanted) == flags


def test_cordon_changes_nothing_routers_are_told() -> None:
    reps = [_rep("r1", "a", 20000, created=1.0), _rep("r2", "b", 20001, created=2.0)]
    models = [profile(replicas=2)]
    plain = routing_content(snap([node("a"), node("b")], reps, models=models), {})
    cordoned = routing_content(snap([node("a", cordoned=True), node("b")], reps, models=models), {})
    assert cordoned == plain


def test_a_roll_never_routes_one_replica_short() -> None:
    """Step by step through reconcile: every snapshot routes as many unflagged endpoints as are wanted."""
    old = ReplicaSpec.of(profile(replicas=2, args=("--max-model-len", "4096")))
    s = snap(
        [node("a"), node("b"), node("c")],
        [
            replace(_rep("r1", "a", 20000, created=1.0), spec=old),
            replace(_rep("r2", "b", 20001, created=2.0), spec=old),
        ],
        # A changed profile: both replicas are outdated and rolled one at a time.
        models=[profile(replicas=2, args=("--max-model-len", "8192"))],
    )
    memo = None
    seen_flagged: set[str] = set()
    for step in range(12):
        plan = reconcile(s, memo)
        memo = plan.memo
        s = apply(s, plan, state=ShardState.STARTING, now=s.now + 1)
        endpoints, _ = routing_content(s, {})
        routed = [e for e in endpoints.get("m", ()) if not e.draining]
        assert len(routed) >= 2, f"step {step}: routed {[e.replica_id for e in routed]}"
        seen_flagged |= {e.replica_id for e in endpoints.get("m", ()) if e.draining}
        for r in s.replicas:
            if r.shards[0].state is ShardState.STARTING:
                s = set_state(s, r.id, ShardState.READY)
    assert {r.id for r in s.replicas}.isdisjoint({"r1", "r2"}), "the roll finished"
    assert seen_flagged == set()  # each old replica was stopped in the pass its replacement served


def test_coming_names_what_is_on_its_way_and_cold_only_what_has_nothing_coming() -> None:
    from llmgw_controlplane.scheduler.routing import coming_content

    models = [profile(m, engine="sim") for m in ("starting", "waking", "cold", "serving", "idle")]
    s = snap(
        [node("n1"), node("n2", state=NodeState.LOST)],
        [
            # Placed 10 s ago: within their startup timeout (past it they are failed, not coming).
            replica("s-0", "starting", [("n1", ())], state=ShardState.STARTING, created=990.0),
            replica("s-1", "starting", [("n1", ())], state=None, created=990.0),
            replica("lost-0", "idle", [("n2", ())], state=ShardState.STARTING, created=990.0),
            replica("ok-0", "serving", [("n1", ())], port=9000),
        ],
        models,
    )
    endpoints, _ = routing_content(s, {})
    coming, cold = coming_content(
        s, endpoints, {"waking": "evicting x", "serving": "?"}, ["cold", "starting", "gone"]
    )
    assert coming == {"starting": "2 replicas starting on n1", "waking": "evicting x"}
    assert cold == ("cold",)
