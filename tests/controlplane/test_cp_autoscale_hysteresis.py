"""A steady load never flaps (issue 21): the tolerance band over the target, the stabilization window
under it, never down while a step up is in flight, and a draining backlog sized by its arrivals. On the
fake clock, through the whole pass (Autoscaler -> reconcile -> apply)."""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import replace

from llmgw_common.messages import ShardState
from llmgw_controlplane.scheduler.autoscale import MODEL_SCALED_DOWN, MODEL_SCALED_UP
from llmgw_controlplane.scheduler.loadscale import LoadMemo, Step, Trend, follow_load
from llmgw_controlplane.scheduler.scaling import ScaleMemo, decide
from tests.placement.placement_kit import node, set_state, snap
from tests.placement.test_loadscale import NOW, Fleet, demand, following, no_idle, one_pass, reps


def _fleet(n: int, up_after: float, down_after: float) -> Fleet:
    # Target 10 in flight per replica, up to 6 replicas; n of them serving at the start.
    f = Fleet(following(max_replicas=6, up_after=up_after, down_after=down_after, in_flight_per_replica=10.0))
    f.s = snap([node("n1", n_gpus=8)], reps(n), [f.p], now=f.now)
    return f


def test_a_steady_noisy_load_around_its_target_gives_no_event_in_ten_minutes() -> None:
    # 2 replicas, target 10 per replica, 18..22 in flight (0.9..1.1 of the target), a sample a second:
    # without the band, 5 samples in a row over 10 per replica (up_after 5 s) read as a step up.
    f = _fleet(2, up_after=5.0, down_after=60.0)
    rng = random.Random(21)
    for _ in range(600):
        f.tick(rng.randint(18, 22))
    assert f.events == []
    assert f.serving() == 2 and len(f.s.replicas) == 2


def test_a_real_step_still_scales_up_within_up_after() -> None:
    f = _fleet(2, up_after=5.0, down_after=60.0)
    rng = random.Random(21)
    for _ in range(60):
        f.tick(rng.randint(18, 22))
    # 40 in flight on 2 replicas: 20 each, twice the target; ceil(2 * 20 / 10) = 4, after up_after.
    # Over from the first sample; up once it has been over for up_after (5 samples later).
    for _ in range(5):
        f.tick(40)
    assert f.events == []
    f.tick(40)
    assert f.events == [MODEL_SCALED_UP] and len(f.s.replicas) == 4


def test_a_lull_shorter_than_down_after_gives_back_nothing_the_load_then_asks_for_again() -> None:
    # 3 replicas at 8 per replica (target 10): with one fewer it would be 12, so it holds. A 30 s lull
    # (down_after 120 s) brings the average under the margin; giving a replica back then would be taken
    # back after up_after once the load returns (12 per replica on 2 is over the band).
    f = _fleet(3, up_after=10.0, down_after=120.0)
    for _ in range(600):
        f.tick(24)
    for _ in range(30):
        f.tick(0)
    for _ in range(300):
        f.tick(24)
    assert f.events == []
    assert len(f.s.replicas) == 3


def test_the_window_is_kept_a_long_lull_still_gives_back_one() -> None:
    f = _fleet(3, up_after=10.0, down_after=120.0)
    for _ in range(300):
        f.tick(24)
    for _ in range(200):
        f.tick(0)
    assert f.events.count(MODEL_SCALED_DOWN) >= 1


def test_never_down_while_a_step_up_is_in_flight() -> None:
    p = following(in_flight_per_replica=4.0, down_after=10.0, max_replicas=4)
    # 2 wanted, 2 placed, 1 serving: the step up is in flight. The load fell meanwhile (under for long):
    # the replica starting is not given back before it serves and the load spreads over it.
    memos: Mapping[str, LoadMemo] = {"m": LoadMemo(Trend.UNDER, NOW - 100)}
    s = set_state(snap([node("n1")], reps(2), [p], now=NOW), "m-1", ShardState.STARTING)
    base = decide(s, no_idle, {}, ScaleMemo(targets={"m": 2}))
    out = follow_load(s, {"m": demand(0)}, base, memos, no_idle, {})
    v = out.verdicts["m"]
    assert (out.decision.wanted["m"], v.step) == (2, Step.HOLD)
    assert v.why == "1 replica still starting: not scaled down meanwhile"


def test_a_replica_never_placed_is_still_given_up_when_the_load_falls() -> None:
    # Wanted 2, only 1 placed (no room for the other): nothing is in flight, the wish is dropped.
    p = following(in_flight_per_replica=4.0, down_after=10.0, max_replicas=4)
    memos: Mapping[str, LoadMemo] = {}
    for t in range(11):
        want, memos, step, why = one_pass(p, 1, demand(0), memos, NOW + t, 2)
    assert (want, step) == (1, Step.DOWN), why
    assert why.endswith("2 → 1 (never placed)")


def test_a_slowly_draining_backlog_adds_nothing_it_would_give_back_once_drained() -> None:
    # 4 replicas just started under the first step's backlog: 115 in flight (28.8 each, target 3), the
    # engines saturated (16 running) and finishing 1.1x what arrives. The backlog would ask for
    # ceil(4 * 28.8 / 3), capped at 6 (bench/autoscale.py's 4 -> 6, then 6 -> 5 -> 4 in steady load).
    p = following(in_flight_per_replica=3.0, max_replicas=6)
    memos: Mapping[str, LoadMemo] = {"m": LoadMemo(Trend.OVER, NOW - 30)}
    slow = demand(
        115, replicas_reporting=4, running=16.0, waiting=99.0, arrived=113, completed=124, rate_s=10
    )
    want, _, step, why = one_pass(p, 4, slow, memos, NOW, 4)
    assert (want, step) == (4, Step.HOLD), why
    assert "its queue shrinks (124 finished, 113 arrived in 10 s)" in why
    # Closed-loop clients finish as they arrive: their counts differ by a few, which is no drain.
    closed = replace(slow, completed=115)
    want, _, step, why = one_pass(p, 4, closed, memos, NOW, 4)
    assert (want, step) == (6, Step.UP), why
