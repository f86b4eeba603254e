"""The wake book (issue 13), pure: concurrent wakes are one, a window lasts idle_after from the last
wake (longer while unserved), and the cold start is measured from the first wake to the first ready."""

from __future__ import annotations

from llmgw_common.catalog import parse_catalog
from llmgw_controlplane.scheduler.wake_decisions import PENDING_WAKE_S, WakeBook

CAT = parse_catalog("models:\n  - {name: a, engine: sim, min_replicas: 0, idle_after: 60s}")


def test_concurrent_wakes_are_one_and_the_cold_start_counts_from_the_first() -> None:
    b = WakeBook()
    assert b.ask("a", 100.0) is True
    assert b.ask("a", 101.0) is False
    assert b.served({"a"}, CAT, 112.5) == [("a", 12.5)]
    assert b.cold_starts["a"] == (12.5, 112.5)
    assert b.served({"a"}, CAT, 113.0) == []  # said once


def test_a_served_wake_holds_the_model_for_idle_after_from_the_last_ask() -> None:
    b = WakeBook()
    b.ask("a", 100.0)
    b.ask("a", 130.0)
    b.served({"a"}, CAT, 140.0)
    assert b.windows(CAT, 189.0) == {"a": 130.0}
    assert b.windows(CAT, 190.0) == {}


def test_an_unserved_wake_outlasts_a_short_idle_after_but_not_forever() -> None:
    b = WakeBook()
    b.ask("a", 100.0)
    assert b.windows(CAT, 100.0 + 61) == {"a": 100.0}
    assert b.windows(CAT, 100.0 + PENDING_WAKE_S) == {}
    assert b.pending == {}  # given up: nobody asked again


def test_an_eviction_ends_the_window() -> None:
    b = WakeBook()
    b.ask("a", 100.0)
    b.served({"a"}, CAT, 105.0)
    b.forget("a")
    assert b.windows(CAT, 106.0) == {}


def test_a_model_that_left_the_catalog_leaves_the_book() -> None:
    # Renaming models over months must not grow the book (nor show cold starts of models long gone).
    b = WakeBook()
    b.ask("a", 100.0)
    b.served({"a"}, CAT, 110.0)
    assert "a" in b.cold_starts
    empty = parse_catalog("models: []")
    b.windows(empty, 120.0)
    assert b.served(set(), empty, 120.0) == []
    assert (b.pending, b.latest, b.cold_starts) == ({}, {}, {})
