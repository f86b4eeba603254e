"""A profile change rolls a model's replicas one at a time (issue 12 item 14), through the drain mechanism:
one replacement is surged, the old replica stops only once it serves, never all at once."""

from __future__ import annotations

from dataclasses import replace

from llmgw_common.catalog import Catalog, ModelProfile
from llmgw_common.messages import ReplicaSpec
from llmgw_controlplane.scheduler.reconciler import reconcile
from llmgw_controlplane.scheduler.snapshot import Snapshot
from tests.placement.placement_kit import ShardState, apply, node, profile, replica, set_state, snap

OLD = profile(replicas=3, args=("--max-model-len", "4096"))
NEW = profile(replicas=3, args=("--max-model-len", "8192"))


def rolled(models: tuple[ModelProfile, ...] = (NEW,), n: int = 3) -> Snapshot:
    old = ReplicaSpec.of(OLD)
    reps = [replica(f"old{i}", "m", [("a", (i,))], created=float(i), spec=old) for i in range(n)]
    return snap([node("a"), node("b")], reps, models=list(models))


def serving(s: Snapshot) -> int:
    return sum(1 for r in s.replicas if all(sh.state is ShardState.READY for sh in r.shards))


def test_spec_matches_only_fields_a_running_replica_depends_on() -> None:
    spec = ReplicaSpec.of(OLD)
    assert spec.matches(OLD)
    for unchanged in (
        OLD.model_copy(update={"replicas": 7}),
        OLD.model_copy(update={"max_concurrency": 4}),
        OLD.model_copy(update={"queue_timeout_s": 1.0}),
    ):
        assert spec.matches(unchanged)
    for changed in (
        NEW,
        OLD.model_copy(update={"gpu_class": "A100-80GB"}),
        OLD.model_copy(update={"options": {"tokens_per_s": 5}}),
        OLD.model_copy(update={"env": {"X": "1"}}),
        OLD.model_copy(update={"weights": "other"}),
        OLD.model_copy(update={"engine": "sim"}),
    ):
        assert not spec.matches(changed)


def test_no_change_no_roll() -> None:
    plan = reconcile(rolled(models=(OLD.model_copy(update={"max_concurrency": 2}),)))
    assert not plan.changes


def test_profile_change_surges_one_replacement_and_stops_none() -> None:
    s = rolled()
    p1 = reconcile(s)
    assert p1.mark_draining == ("old0",)  # the oldest goes first
    assert not p1.stop
    (new,) = p1.place
    assert new.spec == ReplicaSpec.of(NEW)


def test_roll_one_at_a_time_never_below_the_wanted_count() -> None:
    s, memo = rolled(), None
    max_replicas, passes = 0, 0
    while any(r.spec != ReplicaSpec.of(NEW) for r in s.replicas) and passes < 20:
        passes += 1
        plan = reconcile(s, memo)
        memo = plan.memo
        assert len(plan.place) <= 1 and len(plan.stop) <= 1 and len(plan.mark_draining) <= 1
        if plan.stop:
            (stopped,) = plan.stop
            assert stopped.reason == "rolled: its replacement serves"
            assert stopped.replica_id.startswith("old")
        s = apply(s, plan, state=ShardState.STARTING, now=s.now + 1)
        max_replicas = max(max_replicas, len(s.replicas))
        assert serving(s) >= 3  # the replacement is not serving yet, the old ones all are
        # One pass later the replacement serves.
        for r in s.replicas:
            if r.spec == ReplicaSpec.of(NEW):
                s = set_state(s, r.id, ShardState.READY)
    assert passes == 6  # per replica: surge (mark + place), then stop once the replacement serves
    assert max_replicas == 4  # one surge at a time
    assert len(s.replicas) == 3 and serving(s) == 3
    assert not reconcile(s, memo).changes


def test_replacement_that_fails_never_stops_the_old_one() -> None:
    s = rolled()
    p1 = reconcile(s)
    new_id = p1.place[0].replica_id
    s = apply(s, p1, state=ShardState.STARTING, now=1001.0)
    s = set_state(s, new_id, ShardState.FAILED, "CUDA out of memory")
    p2 = reconcile(s, p1.memo)
    assert [(x.replica_id, x.failed) for x in p2.stop] == [(new_id, True)]
    assert "m" in p2.backoff and not p2.place
    s = apply(s, p2, now=1002.0)
    assert {r.id for r in s.replicas} == {"old0", "old1", "old2"} and serving(s) == 3

    # A day later (far past any drain grace), backoff over: a new replacement, the old one still kept.
    s = replace(s, now=1002.0 + 86400)
    p3 = reconcile(s, p2.memo, drain_grace_s=600.0)
    assert not p3.stop and len(p3.place) == 1 and not p3.mark_draining
    assert p3.place[0].spec == ReplicaSpec.of(NEW)


def test_no_room_to_surge_keeps_every_old_replica_serving_and_says_why() -> None:
    old = ReplicaSpec.of(OLD)
    reps = [replica(f"old{i}", "m", [("a", (i,))], created=float(i), spec=old) for i in range(2)]
    s = snap([node("a", n_gpus=2)], reps, models=[NEW.model_copy(update={"replicas": 2})])
    plan = reconcile(s, drain_grace_s=600.0)
    assert not plan.stop and not plan.place
    assert "m" in plan.unplaceable
    s = apply(s, plan, now=1000.0 + 86400)
    assert not reconcile(s, plan.memo, drain_grace_s=600.0).stop


def test_a_record_without_spec_is_never_rolled() -> None:
    s = snap(
        [node("a")], [replica("legacy", "m", [("a", (0,))])], models=[NEW.model_copy(update={"replicas": 1})]
    )
    assert not reconcile(s).changes


def test_scale_down_during_a_change_stops_old_replicas_first() -> None:
    s = rolled()
    s = replace(
        s,
        replicas=(*s.replicas, replica("new0", "m", [("b", (0,))], created=500.0, spec=ReplicaSpec.of(NEW))),
    )
    plan = reconcile(replace(s, catalog=Catalog(models=(NEW.model_copy(update={"replicas": 2}),))))
    assert sorted(x.replica_id for x in plan.stop) == ["old1", "old2"]  # surplus: the outdated go first
    assert not plan.place


def test_reverting_a_failed_profile_change_keeps_the_old_replicas_serving() -> None:
    """The replacement crash-loops; a day later the operator reverts the profile. The replica the roll had
    marked matches the profile again, but its mark stays: it must keep serving until a replacement does
    (by the drain grace counted from the mark, it would have been stopped at once, leaving none)."""
    s = rolled(n=1)
    s = replace(s, catalog=Catalog(models=(NEW.model_copy(update={"replicas": 1}),)))
    p1 = reconcile(s, drain_grace_s=600.0)
    assert p1.mark_draining == ("old0",)
    new_id = p1.place[0].replica_id
    s = apply(s, p1, state=ShardState.STARTING, now=s.now + 1)
    s = set_state(s, new_id, ShardState.FAILED, "CUDA out of memory")
    p2 = reconcile(s, p1.memo, drain_grace_s=600.0)
    s = apply(s, p2, now=s.now + 86400)
    assert [r.id for r in s.replicas] == ["old0"] and s.replicas[0].draining

    s = replace(s, catalog=Catalog(models=(OLD.model_copy(update={"replicas": 1}),)))
    p3 = reconcile(s, p2.memo, drain_grace_s=600.0)
    assert not p3.stop, p3.stop
    s = apply(s, p3, state=ShardState.STARTING, now=s.now + 1)
    assert serving(s) == 1
    memo = p3.memo
    for _ in range(3):  # the replacement starts: the old one serves meanwhile
        s = replace(s, now=s.now + 100)
        plan = reconcile(s, memo, drain_grace_s=600.0)
        assert not plan.stop and not plan.place, (plan.stop, plan.place)
        memo = plan.memo
    s = set_state(s, next(r.id for r in s.replicas if r.id != "old0"), ShardState.READY)
    plan = reconcile(s, memo, drain_grace_s=600.0)
    assert [x.replica_id for x in plan.stop] == ["old0"]
    assert serving(apply(s, plan)) == 1
