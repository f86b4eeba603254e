"""Idle merge (ARCHITECTURE #1: unknown is not idle) and event detection, both pure."""

from __future__ import annotations

import pytest

from llmgw_common.router_messages import IdleReport
from llmgw_controlplane.scheduler.event_detection import EventDetector
from llmgw_controlplane.scheduler.idle import IdleKind, IdleMerger

DAY = 86400.0


def _rep(router: str, since: float, sent_at: float, **used: float) -> IdleReport:
    return IdleReport(router=router, since=since, sent_at=sent_at, last_used=used)


def test_no_router_reporting_means_unknown_never_zero_or_forever() -> None:
    m = IdleMerger(stale_s=5.0)
    k = m.idle_for("r1", now=1000.0)
    assert k.kind is IdleKind.UNKNOWN
    assert k.seconds is None
    assert k.json_seconds() < 0
    assert k.text() == "-"
    assert not k.at_least(0.0)  # unknown is never "idle for at least anything"


def test_newest_timestamp_wins_across_routers() -> None:
    m = IdleMerger(stale_s=5.0)
    m.add(_rep("a", since=0.0, sent_at=100.0, r1=50.0), received_at=100.0)
    m.add(_rep("b", since=0.0, sent_at=100.0, r1=80.0), received_at=100.0)
    k = m.idle_for("r1", now=100.0)
    assert k.kind is IdleKind.EXACT and k.seconds == 20.0
    assert k.text() == "20s"


def test_never_used_is_a_lower_bound_from_the_router_start() -> None:
    m = IdleMerger(stale_s=5.0)
    now = 3 * DAY
    m.add(_rep("a", since=0.0, sent_at=now), received_at=now)
    k = m.idle_for("r1", now=now)
    assert k.kind is IdleKind.AT_LEAST and k.seconds == 3 * DAY
    assert k.text() == ">=3d"
    assert k.at_least(DAY)
    # A replica younger than the router's knowledge: bounded by its own age.
    k2 = m.idle_for("r2", now=now, created=now - 600)
    assert k2.kind is IdleKind.AT_LEAST and k2.seconds == 600


def test_the_youngest_router_limits_the_bound() -> None:
    m = IdleMerger(stale_s=5.0)
    now = 3 * DAY
    m.add(_rep("old", since=0.0, sent_at=now), received_at=now)
    m.add(_rep("new", since=now - 60, sent_at=now), received_at=now)
    assert m.idle_for("r1", now=now).seconds == 60


def test_silent_router_is_dropped_after_stale_and_knowledge_becomes_unknown() -> None:
    m = IdleMerger(stale_s=5.0)
    m.add(_rep("a", since=0.0, sent_at=10.0, r1=9.0), received_at=10.0)
    assert m.idle_for("r1", now=14.0).kind is IdleKind.EXACT
    assert m.idle_for("r1", now=16.0).kind is IdleKind.UNKNOWN
    assert m.routers == ()


def test_router_restart_forgets_nothing_it_knew_but_knows_less() -> None:
    m = IdleMerger(stale_s=5.0)
    m.add(_rep("a", since=0.0, sent_at=100.0, r1=90.0), received_at=100.0)
    # The router restarts: a new since, an empty map. Its old knowledge is gone with it.
    m.add(_rep("a", since=101.0, sent_at=102.0), received_at=102.0)
    k = m.idle_for("r1", now=102.0)
    assert k.kind is IdleKind.AT_LEAST and k.seconds == 1.0


def test_delayed_older_report_does_not_replace_a_newer_one() -> None:
    m = IdleMerger(stale_s=5.0)
    m.add(_rep("a", since=0.0, sent_at=100.0, r1=99.0), received_at=100.0)
    m.add(_rep("a", since=0.0, sent_at=90.0, r1=50.0), received_at=100.5)
    assert m.last_used("r1") == 99.0


def test_watched_model_down_only_after_it_had_a_ready_replica_and_recovers() -> None:
    d = EventDetector(placement_failing_after_s=60.0)
    assert d.models({}, {"m": 0.0}, {"m": "no replica placed yet"}, 1.0) == []  # never up: not "down"
    assert d.models({"m": 1}, {"m": 0.0}, {}, 2.0) == []
    evs = d.models({}, {"m": 0.0}, {"m": "no ready replica: 1 starting on a"}, 3.0)
    assert [e.kind for e in evs] == ["model.down"]
    assert "1 starting on a" in evs[0].summary
    assert d.models({}, {"m": 0.0}, {}, 4.0) == []  # said once
    evs = d.models({"m": 2}, {"m": 0.0}, {}, 5.0)
    assert [e.kind for e in evs] == ["model.recovered"]
    # Unwatched models never alert.
    assert d.models({"x": 1}, {}, {}, 6.0) == [] and d.models({}, {}, {}, 7.0) == []


def test_placement_failing_after_threshold_once_and_again_after_it_clears() -> None:
    d = EventDetector(placement_failing_after_s=60.0)
    assert d.placement({"m": "needs 8 H100"}, 0.0) == []
    assert d.placement({"m": "needs 8 H100"}, 59.0) == []
    evs = d.placement({"m": "needs 8 H100"}, 60.0)
    assert [e.kind for e in evs] == ["placement.failing"]
    assert evs[0].details["reason"] == "needs 8 H100"
    assert d.placement({"m": "needs 8 H100"}, 200.0) == []
    assert d.placement({}, 201.0) == []
    assert d.placement({"m": "x"}, 202.0) == []
    assert [e.kind for e in d.placement({"m": "x"}, 262.0)] == ["placement.failing"]


def test_breaker_is_the_worst_the_routers_report() -> None:
    from llmgw_common.router_messages import IdleReport
    from llmgw_controlplane.scheduler.idle import IdleMerger

    m = IdleMerger(stale_s=10)
    assert m.breaker("r1") == "closed"  # nobody reports: closed, not unknown-as-open
    m.add(IdleReport(router="a", since=0, sent_at=1, breakers={"r1": "half_open"}), 1)
    assert m.breaker("r1") == "half_open"
    m.add(IdleReport(router="b", since=0, sent_at=1, breakers={"r1": "open"}), 1)
    assert m.breaker("r1") == "open"
    m.prune(20)  # both routers went silent: their views are forgotten
    assert m.breaker("r1") == "closed"


# ------------------------------------------------------------------ departed routers, forged reports


def test_a_departed_routers_use_keeps_the_idle_bound_below_the_truth() -> None:
    """Router "gone" used r1 2 min ago and stopped reporting; "old" (up 2 h) never routed to r1."""
    m = IdleMerger(stale_s=5.0)
    t0 = 10 * DAY
    m.add(_rep("old", since=t0 - 2 * 3600, sent_at=t0), received_at=t0)
    m.add(_rep("gone", since=t0 - 3600, sent_at=t0, r1=t0 - 1), received_at=t0)
    now = t0 + 120  # both reported at t0; "gone" never again, "old" every tick
    for t in range(int(t0) + 1, int(now) + 1):
        m.add(_rep("old", since=t0 - 2 * 3600, sent_at=t), received_at=t)
    k = m.idle_for("r1", now=now)
    assert m.routers == ("old",)  # "gone" is forgotten as a reporter...
    # ...but not what it said: used 121 s ago, so no bound may claim more (it read ">=2h" before).
    assert k.kind is IdleKind.AT_LEAST and k.seconds is not None and k.seconds <= 121, k
    assert k.seconds == 120  # known up to its last report, not up to now
    assert not k.at_least(3600)  # not nominated idle for an hour
    # A replica nobody ever used is bounded by the departure too: "gone" might have used it last tick.
    assert m.idle_for("r2", now=now).seconds == 120
    # A use after the departure is exact again: every router since then is reporting.
    m.add(_rep("old", since=t0 - 2 * 3600, sent_at=now + 1, r1=now + 1), received_at=now + 1)
    k = m.idle_for("r1", now=now + 3)
    assert k.kind is IdleKind.EXACT and k.seconds == 2


def test_forged_idle_reports_from_the_future_are_dropped_and_do_not_freeze_the_router(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    m = IdleMerger(stale_s=5.0)
    m.add(_rep("a", since=0.0, sent_at=100.0, r1=90.0), received_at=100.0)
    with caplog.at_level(logging.WARNING, logger="llmgw.controlplane"):
        for forged in (
            _rep("a", since=0.0, sent_at=1e300, r1=1e300),
            _rep("a", since=0.0, sent_at=float("inf")),
            _rep("a", since=0.0, sent_at=float("nan")),
            _rep("a", since=1e300, sent_at=101.0),
            _rep("a", since=0.0, sent_at=101.0, r1=1e300),
        ):
            m.add(forged, received_at=101.0)
    assert m.last_used("r1") == 90.0  # none of them was believed
    lines = [r.getMessage() for r in caplog.records if "not believed" in r.getMessage()]
    assert len(lines) == 1 and "router a" in lines[0], lines  # said once, not once per message
    # The genuine next report is taken.
    m.add(_rep("a", since=0.0, sent_at=102.0, r1=101.5), received_at=102.0)
    assert m.last_used("r1") == 101.5


def test_a_report_claiming_a_time_slightly_ahead_outranks_genuine_ones_only_briefly() -> None:
    m = IdleMerger(stale_s=5.0)
    # 50 s ahead is within the allowed skew: kept, but it counts as sent when it arrived.
    m.add(_rep("a", since=0.0, sent_at=150.0, r1=1.0), received_at=100.0)
    m.add(_rep("a", since=0.0, sent_at=100.5, r1=100.2), received_at=100.6)
    assert m.last_used("r1") == 100.2
    # An older report, delayed, still never replaces a newer one.
    m.add(_rep("a", since=0.0, sent_at=99.0, r1=2.0), received_at=100.7)
    assert m.last_used("r1") == 100.2


def test_an_idle_report_naming_too_many_replicas_is_refused_and_said_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    from llmgw_runtime.clockcheck import Doubts

    doubts = Doubts(logging.getLogger("llmgw.controlplane"), every_s=60.0)
    m = IdleMerger(stale_s=600.0, doubts=doubts, max_report_entries=3)
    m.add(_rep("a", since=0.0, sent_at=100.0, r1=90.0, r2=91.0, r3=92.0), received_at=100.0)  # at the cap
    wide = IdleReport(
        router="a",
        since=0.0,
        sent_at=101.0,
        last_used={"r1": 100.5, "r2": 100.5},
        breakers={"r3": "open", "r4": "open"},
    )
    with caplog.at_level(logging.WARNING, logger="llmgw.controlplane"):
        m.add(wide, received_at=101.0)
        m.add(wide.model_copy(update={"sent_at": 130.0}), received_at=130.0)
        lines = [r.getMessage() for r in caplog.records if "not believed from router a" in r.getMessage()]
        assert len(lines) == 1 and "4 replicas" in lines[0], lines
        m.add(wide.model_copy(update={"sent_at": 162.0}), received_at=162.0)
        lines = [r.getMessage() for r in caplog.records if "not believed from router a" in r.getMessage()]
        assert len(lines) == 2
    assert doubts.count == 3
    assert m.last_used("r1") == 90.0 and m.breaker("r3") == "closed"  # the kept report stands
