"""One scheduler pass as its stages (scale, follow the load, reconcile, hold drains, evict), pure, with
one memo carried from pass to pass: what the control plane's loop and the fake-clock fleets both run."""

from __future__ import annotations

from dataclasses import replace

from llmgw_controlplane.scheduler.idle import UNKNOWN, IdleKind, IdleKnowledge
from llmgw_controlplane.scheduler.schedule import PassInputs, Policy, SchedulerMemo, schedule
from llmgw_controlplane.scheduler.snapshot import Snapshot
from tests.placement.placement_kit import apply, node
from tests.placement.placement_kit import snap as make_snap
from tests.placement.test_eviction import exact, gpu_model, lookup, on

NOW = 100_000.0
POLICY = Policy(min_residency_s=300.0)


def _one_card() -> Snapshot:
    # One card: "old" runs on it, idle for 400 s (its idle_after is 600 s: not scaled down); "new" (woken) has nowhere to go.
    return make_snap(
        [node("n1", n_gpus=1)], [on("old-0", "old", "n1", 0)], [gpu_model("old"), gpu_model("new")], now=NOW
    )


def test_an_eviction_stops_the_idle_replica_and_lowers_its_target_so_it_is_not_placed_back() -> None:
    s = _one_card()
    inputs = PassInputs(idle=lookup({"old-0": exact(400)}), wakes={"new": NOW}, waking=frozenset({"new"}))
    first = schedule(s, SchedulerMemo(), inputs, POLICY)
    assert "new" in first.plan.unplaceable
    assert [(e.victim.replica_id, e.for_model) for e in first.evicted] == [("old-0", "new")]
    assert [x.replica_id for x in first.plan.stop] == ["old-0"]
    assert first.making_room["new"].startswith("would evict old-0 of old on n1")
    assert first.memo.scale.targets["old"] == 0
    # The next pass (the victim gone): "new" is placed, "old" is not placed back.
    s2 = replace(apply(s, first.plan), now=NOW + 1)
    second = schedule(s2, first.memo, replace(inputs, idle=lookup({})), POLICY)
    assert [p.model for p in second.plan.place] == ["new"]
    assert not second.evicted and second.memo.scale.targets["old"] == 0


def test_a_waking_model_is_never_the_victim() -> None:
    s = _one_card()
    both = PassInputs(
        idle=lookup({"old-0": exact(400)}), wakes={"new": NOW}, waking=frozenset({"new", "old"})
    )
    out = schedule(s, SchedulerMemo(), both, POLICY)
    assert "new" in out.plan.unplaceable and not out.evicted and not out.plan.stop


def test_a_young_replica_is_kept_by_the_policys_residency() -> None:
    s = replace(_one_card(), replicas=(on("old-0", "old", "n1", 0, created=NOW - 10),))
    inputs = PassInputs(idle=lookup({"old-0": exact(400)}), wakes={"new": NOW}, waking=frozenset({"new"}))
    assert not schedule(s, SchedulerMemo(), inputs, POLICY).evicted
    assert schedule(s, SchedulerMemo(), inputs, Policy(min_residency_s=5.0)).evicted


def test_a_new_tenure_keeps_the_ids_minted_and_forgets_targets_trends_and_drains() -> None:
    s = _one_card()
    inputs = PassInputs(idle=lookup({"old-0": exact(400)}), wakes={"new": NOW}, waking=frozenset({"new"}))
    memo = schedule(s, SchedulerMemo(), inputs, POLICY).memo
    memo = replace(memo, drains=memo.drains.choose(["old-0"], NOW))
    fresh = memo.new_tenure()
    assert fresh.reconcile is memo.reconcile
    assert fresh.scale.targets == {} and fresh.load == {} and fresh.drains.draining == ()
    assert memo.scale.targets and memo.drains.draining == ("old-0",)


# ---------------------------------------------------------------- a handover is stopped once free


def _handed_over(now: float) -> Snapshot:
    # m-0 is on n1, which drains; its replacement m-1 serves on n2.
    return make_snap(
        [node("n1", n_gpus=1, draining=True), node("n2", n_gpus=1)],
        [on("m-0", "m", "n1", 0), on("m-1", "m", "n2", 0, created=NOW - 60)],
        [gpu_model("m", floor=None)],
        now=now,
    )


BUSY = IdleKnowledge(IdleKind.EXACT, 0.0, busy=True)


def _stops(memo: SchedulerMemo, now: float, k: IdleKnowledge) -> tuple[list[str], SchedulerMemo]:
    out = schedule(_handed_over(now), memo, PassInputs(idle=lookup({"m-0": k})), Policy(drain_grace_s=60.0))
    return [f"{x.replica_id}: {x.reason}" for x in out.plan.stop], out.memo


def test_a_drained_replica_whose_replacement_serves_is_stopped_only_after_the_routers_saw_its_flag() -> None:
    # The routing table flags it in the first pass that asks for its stop; a request routed to it just
    # before is still on its way, and vLLM aborts what it runs when stopped.
    stops, memo = _stops(SchedulerMemo(), NOW, exact(5))
    assert stops == [] and memo.drains.handovers == {"m-0": NOW}
    stops, memo = _stops(memo, NOW + 2, exact(7))
    assert stops == []
    stops, memo = _stops(memo, NOW + 3, exact(8))
    assert stops == ["m-0: drained: a replacement serves"]


def test_a_handover_with_a_request_on_it_waits_for_it_up_to_the_drain_grace() -> None:
    _, memo = _stops(SchedulerMemo(), NOW, BUSY)
    for t in (3, 30, 59):
        stops, memo = _stops(memo, NOW + t, BUSY)
        assert stops == [], t
    stops, _ = _stops(memo, NOW + 60, BUSY)
    assert stops == ["m-0: drained: a replacement serves; a request still on it after the drain grace"]


def test_a_handover_no_router_reports_on_is_stopped_once_settled() -> None:
    # Only a router holds a request, and a router that holds one reports it: none reporting holds none.
    _, memo = _stops(SchedulerMemo(), NOW, UNKNOWN)
    stops, _ = _stops(memo, NOW + 3, UNKNOWN)
    assert stops == ["m-0: drained: a replacement serves"]


def test_a_drained_replica_of_a_model_wanted_at_zero_is_no_handover() -> None:
    # Nothing serves instead, so the routing table never flags it (a model keeps one unflagged
    # endpoint) and routers keep sending it requests: a handover would wait out the whole grace.
    s = make_snap(
        [node("n1", n_gpus=1, draining=True)],
        [on("m-0", "m", "n1", 0)],
        [gpu_model("m", floor=None, replicas=0)],
        now=NOW,
    )
    out = schedule(s, SchedulerMemo(), PassInputs(idle=lookup({"m-0": BUSY})), Policy(drain_grace_s=60.0))
    assert [(x.replica_id, x.reason, x.handover) for x in out.plan.stop] == [
        ("m-0", "drained: 0 replicas wanted", False)
    ]
