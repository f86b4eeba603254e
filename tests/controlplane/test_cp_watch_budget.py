"""model.down once a watched model has had no ready replica for its watch budget (issue 20).

The detector is pure: every call carries the control plane's clock, so time here is just numbers.
"""

from __future__ import annotations

from llmgw_common.catalog import parse_catalog
from llmgw_common.messages import ShardState
from llmgw_controlplane.scheduler.event_detection import EventDetector, watch_inputs
from llmgw_controlplane.scheduler.snapshot import NodeState, NodeView, ReplicaView, ShardView, Snapshot

WHY = {"m": "no ready replica: 1 failed on n1 (exit -9)"}


def test_down_only_once_the_budget_has_passed_since_the_last_ready_replica() -> None:
    d = EventDetector(placement_failing_after_s=60.0)
    assert d.models({"m": 1}, {"m": 20.0}, {}, 100.0) == []
    # Last seen ready at 100.0; an outage shorter than the budget says nothing.
    assert d.models({}, {"m": 20.0}, WHY, 100.5) == []
    assert d.models({}, {"m": 20.0}, WHY, 119.9) == []
    evs = d.models({}, {"m": 20.0}, WHY, 120.0)
    assert [e.kind for e in evs] == ["model.down"]
    down = evs[0]
    assert down.time == 120.0 and down.id == "model.down:m:120000"
    assert down.details["since"] == 100.0  # when the outage began: the notifier's outage start
    assert down.details["budget"] == 20.0
    assert "for 20s" in down.summary and "exit -9" in down.summary
    assert d.models({}, {"m": 20.0}, WHY, 150.0) == []  # said once
    evs = d.models({"m": 1}, {"m": 20.0}, {}, 151.0)
    assert [e.kind for e in evs] == ["model.recovered"]
    assert evs[0].details["since"] == 100.0


def test_a_blip_shorter_than_the_budget_says_nothing_and_restarts_the_count() -> None:
    d = EventDetector(placement_failing_after_s=60.0)
    d.models({"m": 1}, {"m": 5.0}, {}, 0.0)
    assert d.models({}, {"m": 5.0}, WHY, 4.0) == []
    assert d.models({"m": 1}, {"m": 5.0}, {}, 4.5) == []  # back in time: no down, so no recovered
    assert d.models({}, {"m": 5.0}, WHY, 9.0) == []  # 4.5 s since it last had one
    assert [e.kind for e in d.models({}, {"m": 5.0}, WHY, 9.5)] == ["model.down"]


def test_never_ready_is_not_down_and_unwatched_is_forgotten() -> None:
    d = EventDetector(placement_failing_after_s=60.0)
    assert d.models({}, {"m": 1.0}, {"m": "no replica placed yet"}, 0.0) == []
    assert d.models({}, {"m": 1.0}, {"m": "no replica placed yet"}, 1000.0) == []
    d.models({"m": 1}, {"m": 1.0}, {}, 1001.0)
    assert d.models({}, {}, WHY, 1005.0) == []  # no longer watched
    # Watched again: it must be seen ready again before an outage can be judged.
    assert d.models({}, {"m": 1.0}, WHY, 1010.0) == []


def test_zero_budget_alerts_on_the_first_pass_without_a_ready_replica() -> None:
    d = EventDetector(placement_failing_after_s=60.0)
    d.models({"m": 2}, {"m": 0.0}, {}, 10.0)
    assert [e.kind for e in d.models({}, {"m": 0.0}, WHY, 10.25)] == ["model.down"]


def _snap(node_state: NodeState, shard_state: ShardState = ShardState.READY) -> Snapshot:
    cat = parse_catalog(
        "models:\n  - {name: m, engine: sim, watch: {budget: 2s, probe_every: 5s}}\n  - {name: other, engine: sim}\n"
    )
    return Snapshot(
        now=100.0,
        nodes={"n1": NodeView(name="n1", state=node_state)},
        replicas=(
            ReplicaView(
                id="r1", model="m", created=0.0, shards=(ShardView(0, "n1", port=20001, state=shard_state),)
            ),
        ),
        catalog=cat,
    )


def test_watch_inputs_count_only_replicas_on_nodes_that_report() -> None:
    # A node that stopped reporting may still serve, but nobody knows: its replicas do not hold off
    # the alert (else a dead node's model is called down only after node-lost plus the budget).
    assert watch_inputs(_snap(NodeState.READY)) == ({"m": 1}, {"m": 2.0}, {})
    ready, budgets, why = watch_inputs(_snap(NodeState.UNREACHABLE))
    assert ready == {} and budgets == {"m": 2.0}
    assert why == {"m": "no ready replica known: its replicas are on nodes that stopped reporting (n1)"}
    assert watch_inputs(_snap(NodeState.LOST))[0] == {}
    assert watch_inputs(_snap(NodeState.READY, ShardState.FAILED))[0] == {}


def test_a_silent_node_makes_its_model_down_after_the_budget() -> None:
    d = EventDetector(placement_failing_after_s=60.0)
    ready, budgets, _ = watch_inputs(_snap(NodeState.READY))
    assert d.models(ready, budgets, {}, 100.0) == []
    ready, budgets, why = watch_inputs(_snap(NodeState.UNREACHABLE))
    assert d.models(ready, budgets, why, 101.5) == []
    (down,) = d.models(ready, budgets, why, 102.0)
    assert down.kind == "model.down" and "stopped reporting (n1)" in down.summary
