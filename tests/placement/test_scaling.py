"""Scaling down (issue 13): the wanted replicas per model from a snapshot, idle knowledge and wakes (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw_common.catalog import ModelProfile
from llmgw_controlplane.scheduler.idle import UNKNOWN, IdleKind, IdleKnowledge
from llmgw_controlplane.scheduler.reconciler import reconcile
from llmgw_controlplane.scheduler.scaling import IdleLookup, ScaleMemo, decide
from llmgw_controlplane.scheduler.snapshot import ReplicaView
from tests.placement.placement_kit import node, profile, replica, snap

NOW = 10_000.0


def exact(s: float) -> IdleKnowledge:
    return IdleKnowledge(IdleKind.EXACT, s)


def bound(s: float) -> IdleKnowledge:
    return IdleKnowledge(IdleKind.AT_LEAST, s)


def lookup(table: Mapping[str, IdleKnowledge]) -> IdleLookup:
    return lambda rid, created: table.get(rid, UNKNOWN)


def scaling(
    name: str = "m", replicas: int = 1, floor: int = 0, idle_after: float = 600.0, **kw: Any
) -> ModelProfile:
    return profile(name, engine="sim", replicas=replicas, min_replicas=floor, idle_after=idle_after, **kw)


def reps(model: str, n: int, created: float = 0.0) -> list[ReplicaView]:
    return [replica(f"{model}-{i}", model, [("n1", ())], created=created) for i in range(n)]


@pytest.mark.parametrize(
    "case, idle, want, stop_first",
    [
        ("unknown is never idle", {}, 2, set()),
        ("idle but not long enough", {"m-0": exact(599), "m-1": bound(10)}, 2, set()),
        ("one known idle (exact)", {"m-0": exact(601), "m-1": exact(3)}, 1, {"m-0"}),
        ("one known idle (a lower bound)", {"m-0": bound(700), "m-1": exact(3)}, 1, {"m-0"}),
        ("both idle: down to the floor, never below", {"m-0": exact(900), "m-1": bound(800)}, 1, {"m-0"}),
    ],
)
def test_scale_down_table(case: str, idle: dict[str, IdleKnowledge], want: int, stop_first: set[str]) -> None:
    s = snap([node("n1")], reps("m", 2), [scaling(replicas=2, floor=1)], now=NOW)
    d = decide(s, lookup(idle), {}, ScaleMemo(targets={"m": 2}))
    assert d.wanted["m"] == want, case
    assert d.stop_first == frozenset(stop_first), case


def test_a_model_without_min_replicas_is_never_scaled() -> None:
    p = profile("m", engine="sim", replicas=2)
    s = snap([node("n1")], reps("m", 2), [p], now=NOW)
    d = decide(s, lookup({"m-0": exact(1e6), "m-1": exact(1e6)}), {}, ScaleMemo())
    assert "m" not in d.wanted and d.stop_first == frozenset()


def test_reaching_zero_is_said_once_and_the_model_is_cold() -> None:
    s = snap([node("n1")], reps("m", 1), [scaling()], now=NOW)
    d = decide(s, lookup({"m-0": exact(601)}), {}, ScaleMemo(targets={"m": 1}))
    assert (d.wanted["m"], d.to_zero, d.cold) == (0, ("m",), ("m",))
    s2 = snap([node("n1")], [], [scaling()], now=NOW + 1)
    d2 = decide(s2, lookup({}), {}, d.memo)
    assert (d2.wanted["m"], d2.to_zero, d2.cold) == (0, (), ("m",))


def test_a_fresh_control_plane_keeps_what_runs_and_scales_nothing_down() -> None:
    # No memo and no router report: the target is what runs (between floor and replicas).
    s = snap([node("n1")], reps("m", 2), [scaling(replicas=3, floor=0)], now=NOW)
    d = decide(s, lookup({}), {}, ScaleMemo())
    assert d.wanted["m"] == 2 and not d.to_zero


def test_a_crashed_replica_is_replaced_not_scaled_away() -> None:
    # The target stays 1 while its only replica is gone for a reason other than idleness.
    s = snap([node("n1")], [], [scaling()], now=NOW)
    d = decide(s, lookup({}), {}, ScaleMemo(targets={"m": 1}))
    assert d.wanted["m"] == 1 and d.cold == ()


def test_a_wake_raises_the_target_and_holds_it_for_idle_after() -> None:
    s = snap([node("n1")], [], [scaling(replicas=2)], now=NOW)
    d = decide(s, lookup({}), {"m": NOW - 1}, ScaleMemo(targets={"m": 0}))
    assert d.wanted["m"] == 2 and d.cold == ()
    # Its replica reported idle (a lower bound from a router start) within the window: kept.
    s2 = snap([node("n1")], reps("m", 2, created=NOW), [scaling(replicas=2)], now=NOW + 599)
    d2 = decide(s2, lookup({"m-0": bound(5000), "m-1": bound(5000)}), {"m": NOW}, d.memo)
    assert d2.wanted["m"] == 2
    # Past the window: scaled down like any other.
    s3 = snap([node("n1")], reps("m", 2, created=NOW), [scaling(replicas=2)], now=NOW + 700)
    d3 = decide(s3, lookup({"m-0": exact(650), "m-1": exact(650)}), {}, d2.memo)
    assert d3.wanted["m"] == 0 and d3.to_zero == ("m",)


def test_a_model_that_left_the_catalog_is_forgotten() -> None:
    s = snap([node("n1")], [], [], now=NOW)
    assert decide(s, lookup({}), {}, ScaleMemo(targets={"m": 1})).memo.targets == {}


def test_the_reconciler_stops_the_idle_replica_not_the_newest() -> None:
    p = scaling(replicas=2, floor=1)
    s = snap(
        [node("n1")], [*reps("m", 1, created=1.0), replica("m-new", "m", [("n1", ())], created=5.0)], [p]
    )
    d = decide(s, lookup({"m-0": exact(2000), "m-new": exact(1)}), {}, ScaleMemo(targets={"m": 2}))
    plan = reconcile(s, wanted=d.wanted, stop_first=d.stop_first)
    assert [x.replica_id for x in plan.stop] == ["m-0"]
    assert plan.place == ()


def test_the_reconciler_places_up_to_a_woken_target() -> None:
    p = scaling(replicas=1)
    s = snap([node("n1")], [], [p])
    d = decide(s, lookup({}), {"m": s.now}, ScaleMemo(targets={"m": 0}))
    assert len(reconcile(s, wanted=d.wanted).place) == 1
    cold = decide(s, lookup({}), {}, ScaleMemo(targets={"m": 0}))
    assert reconcile(s, wanted=cold.wanted).place == ()


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(0, 4),
    floor=st.integers(0, 4),
    extra=st.integers(0, 3),
    idle=st.lists(st.one_of(st.none(), st.floats(0, 5000)), min_size=4, max_size=4),
    kinds=st.lists(st.booleans(), min_size=4, max_size=4),
    target=st.one_of(st.none(), st.integers(0, 8)),
)
@pytest.mark.slow
def test_never_below_floor_never_above_replicas_never_stops_unknown(
    n: int, floor: int, extra: int, idle: list[float | None], kinds: list[bool], target: int | None
) -> None:
    replicas = floor + extra
    if replicas == floor:
        replicas += 1
    p = scaling(replicas=replicas, floor=floor)
    table = {
        f"m-{i}": (UNKNOWN if v is None else (exact(v) if k else bound(v)))
        for i, (v, k) in enumerate(zip(idle, kinds, strict=True))
    }
    s = snap([node("n1")], reps("m", n), [p], now=NOW)
    d = decide(s, lookup(table), {}, ScaleMemo(targets={} if target is None else {"m": target}))
    assert floor <= d.wanted["m"] <= replicas
    for rid in d.stop_first:
        assert table[rid].at_least(600.0)
    start = min(max(n if target is None else target, floor), replicas)
    known_idle = sum(1 for i in range(n) if table[f"m-{i}"].at_least(600.0))
    assert d.wanted["m"] == max(floor, start - known_idle)
