"""Catalog fields for replicas that follow the load (issue 21): defaults change nothing, problems listed."""

from __future__ import annotations

import pytest

from llmgw_common.catalog import CatalogError, TargetKind, catalog_to_yaml, parse_catalog


def _one(**fields: object) -> dict[str, object]:
    return {"models": [{"name": "m", "engine": "sim", **fields}]}


def _problems(**fields: object) -> list[str]:
    with pytest.raises(CatalogError) as e:
        parse_catalog(_one(**fields))
    return list(e.value.problems)


def test_an_existing_profile_neither_follows_load_nor_changes_its_ceiling() -> None:
    p = parse_catalog(_one(replicas=2)).models[0]
    assert p.max_replicas is None and p.ceiling == 2 and p.target is None
    assert not p.follows_load
    assert (p.up_after, p.down_after) == (15.0, 300.0)


def test_a_load_target_parses_with_durations_and_round_trips() -> None:
    cat = parse_catalog(
        _one(replicas=1, max_replicas=4, target={"waiting_per_replica": 2}, up_after="30s", down_after="10m")
    )
    p = cat.models[0]
    assert p.follows_load and p.ceiling == 4
    assert p.target is not None and p.target.kind is TargetKind.WAITING and p.target.value == 2.0
    assert (p.up_after, p.down_after) == (30.0, 600.0)
    assert parse_catalog(catalog_to_yaml(cat)) == cat


def test_a_latency_goal_is_a_target_too() -> None:
    p = parse_catalog(_one(max_replicas=3, target={"ttft_p90_ms": 800})).models[0]
    assert p.target is not None and p.target.kind is TargetKind.TTFT_P90 and p.follows_load


def test_a_target_may_scale_below_replicas_without_idle_after_but_not_to_zero() -> None:
    p = parse_catalog(_one(replicas=3, min_replicas=1, target={"kv_use": 0.7})).models[0]
    assert p.follows_load and p.floor == 1 and p.ceiling == 3
    assert any("set idle_after" in x for x in _problems(replicas=3, min_replicas=0, target={"kv_use": 0.7}))


def test_every_problem_is_listed_at_once() -> None:
    found = _problems(
        replicas=3,
        min_replicas=2,
        max_replicas=1,
        target={"waiting_per_replica": 2, "kv_use": 0.5},
        up_after=0,
        down_after=0,
    )
    text = "\n".join(found)
    assert "max_replicas 1 is below replicas 3" in text
    assert "max_replicas 1 is below min_replicas 2" in text
    assert "target sets waiting_per_replica, kv_use: set exactly one" in text
    assert "up_after must be more than 0" in text and "down_after must be more than 0" in text


def test_a_ceiling_without_a_target_and_a_target_without_a_ceiling_are_refused() -> None:
    assert any("no target says when" in x for x in _problems(replicas=1, max_replicas=3))
    assert any("nothing to scale between" in x for x in _problems(replicas=2, target={"kv_use": 0.8}))
    assert any("set exactly one" in x for x in _problems(max_replicas=2, target={}))


def test_a_kv_target_is_a_fraction() -> None:
    assert _problems(max_replicas=2, target={"kv_use": 1.5})


def test_replicas_zero_stays_off_whatever_the_target() -> None:
    p = parse_catalog(_one(replicas=0, max_replicas=3, target={"kv_use": 0.5})).models[0]
    assert not p.follows_load
