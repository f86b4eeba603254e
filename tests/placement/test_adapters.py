"""Which replica loads which LoRA adapter (issue 33): every decision on a fake clock (``snap.now``)."""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

from llmgw_common.catalog import AdapterProfile, Catalog, LoadTarget, ModelProfile
from llmgw_common.messages import ReplicaSpec, ShardState
from llmgw_controlplane.scheduler.adapter_reports import AdapterSeen
from llmgw_controlplane.scheduler.adapters import (
    AdapterDecision,
    AdapterInputs,
    AdapterMemo,
    AdapterPolicy,
    decide_adapters,
)
from llmgw_controlplane.scheduler.snapshot import NodeView, ReplicaView, Snapshot
from tests.placement.placement_kit import local, node, profile, replica, snap

POLICY = AdapterPolicy(idle_s=600.0, min_residency_s=15.0, spread_per_replica=4.0)
BASE = profile("base", engine="sim", max_loras=2)
NAMES = ("a1", "a2", "a3", "a4")


def _cat_snap(
    replicas: list[ReplicaView],
    now: float = 1000.0,
    base: ModelProfile = BASE,
    nodes: list[NodeView] | None = None,
) -> Snapshot:
    s = snap(nodes or [node("n1", 0), node("n2", 0)], replicas, [base], now=now)
    adapters = tuple(AdapterProfile(name=n, base="base", weights=f"w-{n}") for n in NAMES)
    return replace(s, catalog=Catalog(models=s.catalog.models, adapters=adapters))


def _r(rid: str, n: str, **kw: object) -> ReplicaView:
    return replica(rid, "base", [(n, ())], spec=ReplicaSpec.of(BASE), **kw)  # type: ignore[arg-type]


def _seen(node_: str, loaded: tuple[str, ...] = (), busy: tuple[str, ...] = (), **kw: object) -> AdapterSeen:
    return AdapterSeen(node=node_, at=0.0, loaded=frozenset(loaded), busy=frozenset(busy), **kw)  # type: ignore[arg-type]


def _memo(
    assigned: dict[str, tuple[str, ...]], at: float, used: dict[str, float] | None = None
) -> AdapterMemo:
    m = AdapterMemo.from_assignments(assigned, at)
    return replace(m, used=MappingProxyType(used if used is not None else dict(m.used)))


def _decide(
    s: Snapshot,
    memo: AdapterMemo | None = None,
    *,
    demand: dict[str, int] | None = None,
    wanted: frozenset[str] = frozenset(),
    seen: dict[str, AdapterSeen] | None = None,
) -> AdapterDecision:
    inputs = AdapterInputs(seen=seen or {}, demand=demand or {}, wanted=wanted)
    return decide_adapters(s, memo or AdapterMemo(), inputs, POLICY)


def test_a_wanted_adapter_goes_to_the_least_loaded_ready_replica() -> None:
    s = _cat_snap([_r("r1", "n1"), _r("r2", "n2")])
    seen = {"r1": _seen("n1", load=5.0), "r2": _seen("n2", load=1.0)}
    d = _decide(s, wanted=frozenset({"a1"}), seen=seen)
    assert dict(d.assigned) == {"r2": ("a1",)}
    assert [(m.adapter, m.replica_id) for m in d.loads] == [("a1", "r2")]
    assert d.memo.loads == {"a1": 1} and not d.waiting


def test_a_node_holding_the_adapters_weights_is_preferred_over_load() -> None:
    nodes = [node("n1", 0, weights=(local("w-a1"),)), node("n2", 0)]
    s = _cat_snap([_r("r1", "n1"), _r("r2", "n2")], nodes=nodes)
    seen = {"r1": _seen("n1", load=5.0), "r2": _seen("n2", load=1.0)}
    assert dict(_decide(s, demand={"a1": 1}, seen=seen).assigned) == {"r1": ("a1",)}


def test_a_ready_replica_is_preferred_and_a_starting_one_is_used_when_none_is_ready() -> None:
    starting = _r("r2", "n2", state=ShardState.STARTING, created=990.0)
    s = _cat_snap([_r("r1", "n1"), starting])
    seen = {"r1": _seen("n1", load=9.0)}
    assert dict(_decide(s, wanted=frozenset({"a1"}), seen=seen).assigned) == {"r1": ("a1",)}
    only_starting = _cat_snap([starting])
    assert dict(_decide(only_starting, wanted=frozenset({"a1"})).assigned) == {"r2": ("a1",)}


def test_a_free_slot_is_taken_before_anything_is_let_go() -> None:
    s = _cat_snap([_r("r1", "n1"), _r("r2", "n2")], now=1500.0)
    memo = _memo({"r1": ("a1", "a2"), "r2": ("a3",)}, at=1000.0)
    d = _decide(s, memo, wanted=frozenset({"a4"}))
    assert dict(d.assigned) == {"r1": ("a1", "a2"), "r2": ("a3", "a4")}
    assert d.unloads == ()


def test_a_full_replica_lets_go_its_least_recently_used_adapter() -> None:
    s = _cat_snap([_r("r1", "n1")], now=1600.0)
    memo = _memo({"r1": ("a1", "a2")}, at=1000.0, used={"a1": 1500.0, "a2": 1200.0})
    d = _decide(s, memo, demand={"a3": 1})
    assert dict(d.assigned) == {"r1": ("a1", "a3")}
    assert [(m.adapter, m.replica_id) for m in d.unloads] == [("a2", "r1")]
    assert "least recently used" in d.unloads[0].why
    assert d.memo.unloads == {"a2": 1} and d.memo.loads == {"a3": 1}


def test_a_busy_adapter_is_never_let_go_even_when_least_recently_used() -> None:
    s = _cat_snap([_r("r1", "n1")], now=1600.0)
    memo = _memo({"r1": ("a1", "a2")}, at=1000.0, used={"a1": 1500.0, "a2": 1200.0})
    # a2 is the LRU by the memo, but its replica reports requests running on it: a1 goes instead.
    d = _decide(s, memo, demand={"a3": 1}, seen={"r1": _seen("n1", ("a1", "a2"), busy=("a2",))})
    assert dict(d.assigned) == {"r1": ("a2", "a3")}
    # Both busy: nothing is let go, and the wanted adapter waits, saying why.
    both = _decide(s, memo, demand={"a3": 1}, seen={"r1": _seen("n1", ("a1", "a2"), busy=("a1", "a2"))})
    assert dict(both.assigned) == {"r1": ("a1", "a2")} and both.unloads == ()
    assert "hold their 2 adapters, each in use or just loaded" in both.waiting["a3"]


def test_an_adapter_with_requests_held_or_in_flight_at_routers_is_never_let_go() -> None:
    s = _cat_snap([_r("r1", "n1")], now=1600.0)
    memo = _memo({"r1": ("a1", "a2")}, at=1000.0, used={"a1": 1500.0, "a2": 1200.0})
    d = _decide(s, memo, demand={"a3": 1, "a2": 1})  # a2 has one in flight by the routers' count
    assert dict(d.assigned) == {"r1": ("a2", "a3")}
    d2 = _decide(s, memo, demand={"a3": 1}, wanted=frozenset({"a1", "a2"}))  # held by wakes
    assert d2.unloads == () and "a3" in d2.waiting


def test_an_adapter_just_loaded_is_not_let_go_before_its_residency() -> None:
    s = _cat_snap([_r("r1", "n1")], now=1010.0)
    memo = _memo({"r1": ("a1", "a2")}, at=1000.0, used={"a1": 1000.0, "a2": 1000.0})
    d = _decide(s, memo, demand={"a3": 1})
    assert d.unloads == () and "a3" in d.waiting
    later = _decide(replace(s, now=1016.0), memo, demand={"a3": 1})
    assert [m.adapter for m in later.unloads] == ["a1"]  # the tie goes by name, both as old


def test_a_failed_load_is_withdrawn_and_tried_on_another_replica() -> None:
    s = _cat_snap([_r("r1", "n1"), _r("r2", "n2")], now=2000.0)
    memo = _memo({"r1": ("a1",)}, at=1990.0)
    seen = {"r1": _seen("n1", errors={"a1": "no adapter weights at w-a1"}), "r2": _seen("n2", load=9.0)}
    d = _decide(s, memo, demand={"a1": 1}, seen=seen)
    assert dict(d.assigned) == {"r2": ("a1",)}
    assert d.unloads[0].replica_id == "r1" and "its load failed" in d.unloads[0].why


def test_a_failed_load_with_nowhere_else_to_go_stays_asked_and_is_not_asked_again_elsewhere_soon() -> None:
    s = _cat_snap([_r("r1", "n1"), _r("r2", "n2")], now=2000.0)
    memo = _memo({"r1": ("a1",)}, at=1990.0)
    err = "no adapter weights at w-a1"
    seen = {"r1": _seen("n1", errors={"a1": err}), "r2": _seen("n2", errors={"a1": err})}
    d = _decide(s, memo, demand={"a1": 1}, seen=seen)
    # Both failed: it stays where it was asked (its error reported, its requests refused saying why).
    assert dict(d.assigned) == {"r1": ("a1",)} and d.unloads == ()
    # The agent stops reporting r2's error once nothing asks r2 for it: r2 is still not asked for
    # retry_failed_s, then it is.
    later = replace(s, now=2100.0)
    d2 = _decide(later, d.memo, demand={"a1": 1}, seen={"r1": _seen("n1", errors={"a1": err})})
    assert dict(d2.assigned) == {"r1": ("a1",)}
    much_later = replace(s, now=2000.0 + POLICY.retry_failed_s)
    d3 = _decide(much_later, d2.memo, demand={"a1": 1}, seen={"r1": _seen("n1", errors={"a1": err})})
    assert dict(d3.assigned) == {"r2": ("a1",)}


def test_an_adapter_that_failed_everywhere_waits_with_its_error() -> None:
    s = _cat_snap([_r("r1", "n1")], now=2000.0)
    seen = {"r1": _seen("n1", errors={"a1": "rank 64 exceeds max_lora_rank 16"})}
    d = _decide(s, wanted=frozenset({"a1"}), seen=seen)
    assert dict(d.assigned) == {}
    assert d.waiting["a1"] == "its load failed: replica r1: rank 64 exceeds max_lora_rank 16"


def test_a_base_with_no_running_replica_makes_the_adapter_wait() -> None:
    s = _cat_snap([])
    assert _decide(s, wanted=frozenset({"a1"})).waiting == {"a1": "no replica of base base runs"}
    failed = _cat_snap([_r("r1", "n1", state=ShardState.FAILED)])
    assert _decide(failed, wanted=frozenset({"a1"})).waiting == {"a1": "no replica of base base runs"}


def test_a_hot_adapter_spreads_to_one_more_replica_per_pass_and_gives_it_back_when_cool() -> None:
    s = _cat_snap([_r("r1", "n1"), _r("r2", "n2")], now=2000.0)
    memo = _memo({"r1": ("a1",)}, at=1000.0)
    d = _decide(s, memo, demand={"a1": 4})  # 4 per replica: at the threshold, not above
    assert dict(d.assigned) == {"r1": ("a1",)}
    hot = _decide(s, memo, demand={"a1": 9})
    assert dict(hot.assigned) == {"r1": ("a1",), "r2": ("a1",)}
    assert "9 requests over 1 replica(s), above 4 each" in hot.loads[0].why
    # Cooling: 3 requests are more than one replica carries at half the threshold (2): both kept.
    s2 = replace(s, now=2020.0)
    assert dict(_decide(s2, hot.memo, demand={"a1": 3}).assigned) == {"r1": ("a1",), "r2": ("a1",)}
    # 2 fit one replica at half the threshold: the newer copy goes (after its residency).
    cool = _decide(s2, hot.memo, demand={"a1": 2})
    assert dict(cool.assigned) == {"r1": ("a1",)}
    assert cool.unloads[0].replica_id == "r2"
    # Never a copy its replica reports busy.
    busy = _decide(s2, hot.memo, demand={"a1": 2}, seen={"r2": _seen("n2", ("a1",), busy=("a1",))})
    assert dict(busy.assigned) == {"r2": ("a1",)}


def test_spreading_follows_the_bases_in_flight_target() -> None:
    base = profile(
        "base",
        engine="sim",
        max_loras=2,
        replicas=1,
        max_replicas=3,
        target=LoadTarget(in_flight_per_replica=10.0),
    )
    s = _cat_snap([_r("r1", "n1"), _r("r2", "n2")], now=2000.0, base=base)
    memo = _memo({"r1": ("a1",)}, at=1000.0)
    assert len(_decide(s, memo, demand={"a1": 9}).assigned) == 1
    assert len(_decide(s, memo, demand={"a1": 11}).assigned) == 2


def test_an_unused_adapter_is_let_go_after_idle_s_and_never_while_busy() -> None:
    memo = _memo({"r1": ("a1", "a2")}, at=1000.0, used={"a1": 1000.0, "a2": 1500.0})
    s = _cat_snap([_r("r1", "n1")], now=1599.0)
    assert _decide(s, memo).unloads == ()
    d = _decide(replace(s, now=1600.0), memo)
    assert dict(d.assigned) == {"r1": ("a2",)} and "unused for 600s" in d.unloads[0].why
    busy = _decide(replace(s, now=1600.0), memo, seen={"r1": _seen("n1", ("a1", "a2"), busy=("a1",))})
    assert dict(busy.assigned) == {"r1": ("a1", "a2")}
    # Busy counts as used: its idle time starts again.
    assert busy.memo.used["a1"] == 1600.0


def test_a_replacement_replica_gets_the_adapters_of_the_one_that_went_away() -> None:
    memo = _memo({"r1": ("a1", "a2")}, at=1000.0, used={"a1": 1900.0, "a2": 1000.0})
    # r1 failed; r2 (its replacement) runs. a1 was used lately, a2 not for idle_s.
    s = _cat_snap([_r("r1", "n1", state=ShardState.FAILED), _r("r2", "n2")], now=2000.0)
    d = _decide(s, memo)
    assert dict(d.assigned) == {"r2": ("a1",)}
    assert {(m.adapter, m.why) for m in d.unloads} == {
        ("a1", "its replica stopped"),
        ("a2", "its replica stopped"),
    }
    assert d.loads[0].why == "its replica went away"


def test_a_draining_replica_keeps_its_adapters_and_its_replacement_loads_them() -> None:
    memo = _memo({"r1": ("a1",)}, at=1000.0, used={"a1": 1900.0})
    s = _cat_snap([_r("r1", "n1", draining=True), _r("r2", "n2")], now=2000.0)
    d = _decide(s, memo)
    assert dict(d.assigned) == {"r1": ("a1",), "r2": ("a1",)}


def test_a_new_tenure_lets_nothing_go_at_once_and_counts_nothing() -> None:
    memo = AdapterMemo.from_assignments({"r1": ("a1", "a2")}, 5000.0)
    d = _decide(_cat_snap([_r("r1", "n1")], now=5000.0), memo, demand={"a3": 1})
    assert dict(d.assigned) == {"r1": ("a1", "a2")} and d.unloads == () and d.loads == ()


def test_an_adapter_that_left_the_catalog_is_dropped_and_its_counts_forgotten() -> None:
    memo = replace(_memo({"r1": ("a1", "gone")}, at=1000.0), loads=MappingProxyType({"gone": 3, "a1": 1}))
    d = _decide(_cat_snap([_r("r1", "n1")], now=1001.0), memo)
    assert dict(d.assigned) == {"r1": ("a1",)}
    assert d.memo.loads == {"a1": 1} and "gone" not in d.memo.used


def test_a_replica_started_without_lora_is_never_asked_to_load() -> None:
    old = replica("r1", "base", [("n1", ())], spec=ReplicaSpec.of(profile("base", engine="sim")))
    d = _decide(_cat_snap([old]), wanted=frozenset({"a1"}))
    assert dict(d.assigned) == {}
    assert d.waiting == {
        "a1": "the replicas of base base were started without LoRA (max_loras): they are being replaced"
    }


def test_an_adapter_used_within_recent_use_s_is_not_let_go() -> None:
    # a1 had requests a second ago (none reported now: the report of the next may be a tick away).
    memo = _memo({"r1": ("a1", "a2")}, at=1000.0, used={"a1": 1599.0, "a2": 1599.5})
    s = _cat_snap([_r("r1", "n1")], now=1600.0)
    d = _decide(s, memo, demand={"a3": 1})
    assert d.unloads == () and "a3" in d.waiting
    later = _decide(replace(s, now=1601.0 + POLICY.recent_use_s), memo, demand={"a3": 1})
    assert [m.adapter for m in later.unloads] == ["a1"]


def test_a_request_seen_only_as_an_arrival_counts_as_use_for_the_lru_order() -> None:
    memo = _memo({"r1": ("a1", "a2")}, at=1000.0, used={"a1": 1200.0, "a2": 1300.0})
    s = _cat_snap([_r("r1", "n1")], now=1600.0)
    # a1 is older by the memo, but a short request for it arrived since the last pass: a2 goes.
    d = decide_adapters(s, memo, AdapterInputs(demand={"a3": 1}, touched=frozenset({"a1"})), POLICY)
    assert [m.adapter for m in d.unloads] == ["a2"] and d.memo.used["a1"] == 1600.0


def test_when_slots_are_short_the_adapter_waiting_longest_goes_first() -> None:
    s = _cat_snap([_r("r1", "n1")], now=1600.0)
    memo = replace(
        _memo({"r1": ("a1", "a2")}, at=1000.0, used={"a1": 1500.0, "a2": 1500.0}),
        waiting_since=MappingProxyType({"a4": 1550.0}),
    )
    seen = {"r1": _seen("n1", ("a1", "a2"), busy=("a1",))}  # one slot may be freed: a2's
    d = _decide(s, memo, wanted=frozenset({"a3", "a4"}), seen=seen)
    assert dict(d.assigned) == {"r1": ("a1", "a4")}
    assert d.memo.waiting_since == {"a3": 1600.0}  # a3 waits from now; a4 no longer waits
    # Next time a slot frees, a3 (now the longest waiting) goes before a newcomer named earlier.
    d2 = decide_adapters(
        replace(s, now=1700.0),
        replace(d.memo, used=MappingProxyType({"a1": 1600.0, "a4": 1600.0})),
        AdapterInputs(seen={"r1": _seen("n1", ("a1", "a4"), busy=("a1",))}, wanted=frozenset({"a2", "a3"})),
        POLICY,
    )
    assert dict(d2.assigned) == {"r1": ("a1", "a3")} and d2.waiting == {"a2": d2.waiting["a2"]}
