"""The choice by cached prefix and load (llmgw_router.cache.score): properties over plain data."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw_router.cache.score import bound, choose
from llmgw_router.routing.scheduling import load_score
from tests.router.cache.cache_helpers import Ep

NOW = 1000.0
STALE = 5.0


def p2c(cands: Sequence[Ep], r: Callable[[], float]) -> Ep:
    """The router's power of two choices (scheduling.choose), written out as the oracle."""
    n = len(cands)
    if n == 1:
        return cands[0]
    i = int(r() * n)
    j = int(r() * (n - 1))
    if j >= i:
        j += 1
    a, b = cands[i], cands[j]
    return b if load_score(b, NOW, STALE) < load_score(a, NOW, STALE) else a


_eps = st.lists(
    st.builds(
        Ep,
        replica_id=st.just(""),
        in_flight=st.integers(0, 12),
        running=st.none() | st.floats(0, 20),
        waiting=st.none() | st.floats(0, 5),
        kv_use=st.none() | st.floats(-0.5, 1.5),
        load_at=st.none() | st.sampled_from([NOW - 1, NOW - 10]),
    ),
    min_size=1,
    max_size=8,
).map(
    lambda es: [Ep(f"r{i}", e.in_flight, e.running, e.waiting, e.kv_use, e.load_at) for i, e in enumerate(es)]
)


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(
    _eps,
    st.lists(st.integers(0, 20), min_size=8, max_size=8),
    st.integers(0, 20),
    st.floats(1.0, 3.0),
    st.integers(0, 2**32),
)
def test_never_picks_a_candidate_over_the_bound(
    eps: list[Ep], hit_list: list[int], prompt_blocks: int, lf: float, seed: int
) -> None:
    hits = {f"r{i}": h for i, h in enumerate(hit_list)}
    c = choose(eps, hits, 16, prompt_blocks, NOW, STALE, random.Random(seed), lf)
    assert c is not None and c in eps
    cap = math.ceil(lf * (sum(e.in_flight for e in eps) + 1) / len(eps))
    assert cap == bound(eps, lf)
    assert c.in_flight + 1 <= cap


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(
    st.integers(2, 8),
    st.integers(0, 6),
    st.none() | st.floats(0, 10),
    st.lists(st.integers(0, 30), min_size=8, max_size=8),
    st.integers(1, 30),
    st.integers(0, 2**32),
)
def test_with_equal_load_the_longest_hit_wins(
    n: int, in_flight: int, running: float | None, hit_list: list[int], prompt_blocks: int, seed: int
) -> None:
    eps = [Ep(f"r{i}", in_flight, running, 0.0, 0.3, NOW - 1) for i in range(n)]
    hits = {f"r{i}": hit_list[i] for i in range(n)}
    c = choose(eps, hits, 16, prompt_blocks, NOW, STALE, random.Random(seed), 1.25)
    assert c is not None
    best = max(min(h, prompt_blocks) for h in hits.values())
    assert min(hits[c.replica_id], prompt_blocks) == best


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(_eps, st.integers(0, 20), st.floats(1.0, 3.0), st.integers(0, 2**32), st.integers(0, 3))
def test_with_no_hits_it_is_two_choices(
    eps: list[Ep], prompt_blocks: int, lf: float, seed: int, same: int
) -> None:
    # No hits at all, or the same hit everywhere (a system prompt every replica holds): the cache tells
    # no one apart, and the choice is the power of two choices over the eligible, draw for draw.
    hits = {e.replica_id: same for e in eps} if same else {}
    got = choose(eps, hits, 16, prompt_blocks, NOW, STALE, random.Random(seed), lf)
    cap = bound(eps, lf)
    eligible = [e for e in eps if e.in_flight + 1 <= cap]
    want = p2c(eligible, random.Random(seed).random)
    assert got is want


def test_a_long_hit_outweighs_a_little_load_and_not_a_lot() -> None:
    rng = random.Random(1)
    # 2,000 tokens in 16-token blocks, all cached on a: worth 125 * 16 / 512 ~ 3.9 requests of load.
    a, b = Ep("a", 3), Ep("b", 0)
    assert choose([a, b], {"a": 125}, 16, 125, NOW, STALE, rng, 10.0) is a
    a.in_flight = 5
    assert choose([a, b], {"a": 125}, 16, 125, NOW, STALE, rng, 10.0) is b
    # A short prompt goes by load: 6 blocks cached are worth 0.19 of a request.
    a.in_flight = 1
    assert choose([a, b], {"a": 6}, 16, 6, NOW, STALE, rng, 10.0) is b


def test_a_hot_prefix_spills_at_the_bound() -> None:
    """Every request holds the same prefix, cached on r0 only: r0 fills to the bound, then others take."""
    rng = random.Random(3)
    eps = [Ep(f"r{i}") for i in range(4)]
    for _ in range(40):
        c = choose(eps, {"r0": 100}, 16, 100, NOW, STALE, rng, 1.25)
        assert c is not None
        c.in_flight += 1
    # Without the bound r0 would hold all 40 (its hit outweighs 3 requests); with it, ceil(1.25 x 40 / 4).
    assert eps[0].in_flight == 13
    assert sum(e.in_flight for e in eps) == 40


def test_fresh_reports_count_stale_ones_do_not() -> None:
    rng = random.Random(0)
    a = Ep("a", 0, running=9, waiting=0, load_at=NOW - 1)
    b = Ep("b", 1)
    assert choose([a, b], {"a": 3, "b": 1}, 16, 3, NOW, STALE, rng, 4.0) is b
    a.load_at = NOW - STALE - 1
    assert choose([a, b], {"a": 3, "b": 1}, 16, 3, NOW, STALE, rng, 4.0) is a


def test_edges() -> None:
    rng = random.Random(0)
    assert choose([], {}, 16, 3, NOW, STALE, rng, 1.25) is None
    only = Ep("a", 50)
    assert choose([only], {}, 16, 3, NOW, STALE, rng, 1.25) is only
    with pytest.raises(ValueError):
        choose([only], {}, 16, 3, NOW, STALE, rng, 0.9)
    # A callable rng is accepted, as the router's scheduling takes one.
    eps = [Ep("a"), Ep("b")]
    assert choose(eps, {}, 16, 3, NOW, STALE, lambda: 0.99, 1.25) is eps[1]
    # Equal cost among the best: a random one of them, both reachable.
    seen = {
        c.replica_id
        for s in range(40)
        if (
            c := choose(
                [Ep("a"), Ep("b"), Ep("c")], {"a": 4, "b": 4}, 16, 4, NOW, STALE, random.Random(s), 1.25
            )
        )
    }
    assert seen == {"a", "b"}


def _simulate(pick: Callable[[list[Ep], random.Random], Ep], seed: int) -> float:
    """Mean latency of 20,000 requests over 8 FIFO replicas at ~85 % load (Poisson arrivals, exponential
    service), each replica's in-flight count as the choice sees it: the control workload, no prefixes."""
    rnd, choice_rng = random.Random(seed), random.Random(seed + 1)
    eps = [Ep(f"r{i}") for i in range(8)]
    free_at = [0.0] * 8
    ends: list[list[float]] = [[] for _ in range(8)]
    t, total = 0.0, 0.0
    for _ in range(20_000):
        t += rnd.expovariate(8 * 0.85)
        for i, e in enumerate(eps):
            ends[i] = [x for x in ends[i] if x > t]
            e.in_flight = len(ends[i])
        c = pick(eps, choice_rng)
        i = eps.index(c)
        start = max(t, free_at[i])
        free_at[i] = start + rnd.expovariate(1.0)
        ends[i].append(free_at[i])
        total += free_at[i] - t
    return total / 20_000


@pytest.mark.slow
def test_the_control_workload_is_within_5_percent_of_least_loaded() -> None:
    """The issue's workload (c): seen on one run, mean latency 2.36 (P2C) against 1.95 (this choice)."""
    for seed in (1, 2, 3):
        plain = _simulate(lambda eps, r: p2c(eps, r.random), seed)
        cached = _simulate(lambda eps, r: choose(eps, {}, 16, 20, NOW, STALE, r, 1.25) or eps[0], seed)
        # Not worse by more than 5 % (the bound makes it better: P2C alone sometimes draws two busy ones).
        assert cached < plain * 1.05, (seed, plain, cached)
