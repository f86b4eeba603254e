"""A load drain survives a failover (issue 21): the new leader derives it from the records (marked
draining, nothing else explaining it) and continues it: the replica is stopped once nothing is on it,
never at once while it serves, and no second replica is drained for the same step. On the fake clock,
through the whole pass (Autoscaler -> reconcile -> apply)."""

from __future__ import annotations

from dataclasses import replace

from llmgw_common.messages import ReplicaSpec
from llmgw_controlplane.scheduler.autoscale import MODEL_SCALED_DOWN, Autoscaler
from llmgw_controlplane.scheduler.drains import load_drain
from llmgw_controlplane.scheduler.idle import UNKNOWN
from llmgw_controlplane.scheduler.schedule import Policy, SchedulerMemo
from tests.placement.placement_kit import node, profile, snap
from tests.placement.test_loadscale import Fleet, following, reps


def _draining_fleet() -> tuple[Fleet, str]:
    """3 replicas serving, every one busy with a stream, the load gone: one is chosen and marked."""
    f = Fleet(following(max_replicas=3, in_flight_per_replica=4.0, down_after=120.0))
    f.s = snap([node("n1", n_gpus=8)], reps(3), [f.p], now=f.now)
    f.busy = {r.id for r in f.s.replicas}
    for _ in range(200):
        f.tick(0)
        if any(r.draining for r in f.s.replicas):
            break
    assert f.events == [MODEL_SCALED_DOWN]
    (draining,) = [r.id for r in f.s.replicas if r.draining]
    return f, draining


def _fail_over(f: Fleet) -> None:
    # What a takeover keeps: the records (the snapshot) and the routers' reports; not the old leader's
    # memory (its scheduler memo: targets, trends, the drains it chose).
    f.auto.new_tenure()
    f.memo = SchedulerMemo()


def test_a_new_leader_continues_the_drain_it_finds_in_the_records() -> None:
    f, draining = _draining_fleet()
    _fail_over(f)
    for _ in range(30):
        f.tick(0)
    # Still serving its stream: neither stopped at once nor doubled (a second replica drained).
    assert draining in {r.id for r in f.s.replicas}
    assert [r.id for r in f.s.replicas if r.draining] == [draining]
    assert len(f.s.replicas) == 3 and f.stopped_busy == []
    assert f.memo.drains.draining == (draining,)
    assert f.events == [MODEL_SCALED_DOWN]
    f.busy = set()  # the streams end
    for _ in range(5):
        f.tick(0)
    assert draining not in {r.id for r in f.s.replicas}
    assert len(f.s.replicas) == 2 and f.stopped_busy == []


def test_the_grace_counts_from_the_records_mark_not_from_the_takeover() -> None:
    f, draining = _draining_fleet()
    f.auto = Autoscaler(min_residency_s=0.0, demand=f.auto.demand)
    f.policy = Policy(drain_grace_s=60.0)
    f.memo = SchedulerMemo()
    marked = next(r.draining_since for r in f.s.replicas if r.id == draining)
    assert marked is not None
    while f.now < marked + 59:
        f.tick(0)
    assert draining in {r.id for r in f.s.replicas}
    for _ in range(3):
        f.tick(0)
    assert draining not in {r.id for r in f.s.replicas}
    assert f.stopped_busy == [draining]  # after the grace, as the old leader would have


def test_unknown_idleness_is_not_free_a_new_leader_that_heard_no_router_waits() -> None:
    f, draining = _draining_fleet()
    _fail_over(f)
    f.busy = set()
    f.idle = lambda: lambda rid, created: UNKNOWN  # type: ignore[method-assign]
    for _ in range(20):
        f.tick(0)
    assert draining in {r.id for r in f.s.replicas}


def test_a_roll_or_a_node_drain_is_not_taken_for_a_load_drain() -> None:
    f, draining = _draining_fleet()
    _fail_over(f)
    r = next(r for r in f.s.replicas if r.id == draining)
    assert load_drain(r, f.s)
    # Started with what the catalog no longer asks for: a roll marked it, the reconciler's reasons stand.
    old = ReplicaSpec(engine=f.p.engine, weights=f.p.weights_name, options={"startup_s": 1})
    assert not load_drain(replace(r, spec=old), f.s)
    # On a node being drained: that drain's deadline stands.
    n1 = replace(f.s.nodes["n1"], draining=True)
    assert not load_drain(r, replace(f.s, nodes={"n1": n1}))
    # A fixed-size model is never load-drained.
    fixed = profile("m", replicas=3)
    assert not load_drain(r, replace(f.s, catalog=f.s.catalog.model_copy(update={"models": (fixed,)})))
    # Not marked draining: nothing to take up.
    assert not load_drain(replace(r, draining=False), f.s)
