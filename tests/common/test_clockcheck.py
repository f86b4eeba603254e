"""Times from the bus against the receiver's clock: what is refused, how kept times rank, what is said."""

from __future__ import annotations

import logging

import pytest

from llmgw_runtime.clockcheck import MAX_AHEAD_S, Doubts, distrust, distrust_all, order_time


@pytest.mark.parametrize(
    "t", [float("nan"), float("inf"), float("-inf"), 1e300, 1000.0 + MAX_AHEAD_S + 0.001]
)
def test_not_finite_or_too_far_ahead_is_refused_with_the_reason(t: float) -> None:
    why = distrust(t, 1000.0)
    assert why is not None and "sent_at" in why


@pytest.mark.parametrize("t", [0.0, -5.0, 999.0, 1000.0, 1000.0 + MAX_AHEAD_S])
def test_past_and_slightly_ahead_are_believed(t: float) -> None:
    # The past is allowed: a sender cut off from the bus flushes its buffered messages late.
    assert distrust(t, 1000.0) is None


def test_distrust_all_names_the_first_bad_entry() -> None:
    assert distrust_all({"a": 1.0, "b": 2.0}, 10.0, "last use of") is None
    why = distrust_all({"a": 1.0, "b": 1e300}, 10.0, "last use of")
    assert why is not None and "'b'" in why


def test_a_kept_time_ranks_no_later_than_its_arrival() -> None:
    assert order_time(5.0, 10.0) == 5.0  # a late message keeps its own time
    assert order_time(50.0, 10.0) == 10.0  # one from the future counts as arrived now


def test_doubts_say_each_sender_and_kind_once_per_interval_and_count_all(
    caplog: pytest.LogCaptureFixture,
) -> None:
    d = Doubts(logging.getLogger("llmgw.test"), every_s=60.0)
    with caplog.at_level(logging.WARNING, logger="llmgw.test"):
        for t in (0.0, 1.0, 59.0):
            d.refuse("node n1", "time", "bad", t)
        d.refuse("node n1", "seq", "bad", 2.0)
        d.refuse("node n2", "time", "bad", 2.0)
        d.refuse("node n1", "time", "bad", 60.0)
    assert d.count == 6
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "not believed from node n1 (time): bad",
        "not believed from node n1 (seq): bad",
        "not believed from node n2 (time): bad",
        "not believed from node n1 (time): bad",
    ]
