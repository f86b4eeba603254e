"""Which replica takes a request, by its cached prefix and its load: a pure choice over plain data.

A replica's cost is its load plus the prompt tokens it would have to compute, in units of load:

    cost = load_score + uncached_tokens / tokens_per_load

``load_score`` is the router's least-loaded rule (running + waiting from a fresh report, or this router's
in-flight count, KV use as tie-breaker); ``tokens_per_load`` says how many prompt tokens of prefill weigh
as much as one request ahead (512 by default: a 2,000-token prompt wholly cached is worth ~4 requests of
load, a 100-token one a fifth of one, so short prompts go by load).

A bound keeps a hot prefix from piling onto one replica (how plain prefix affinity lost in closed loops,
and why Dynamo's KV router shed near saturation): a candidate whose in-flight count, with this request,
would pass ``ceil(load_factor x (total in-flight + 1) / n)`` is not eligible, the rule of
``routing.scheduling.choose_affine``. The least loaded candidate is always within it (see there), so the bound
never leaves no one.

Among the eligible, where the cache tells them apart (their hits differ) the lowest cost wins, ties
drawn at random; where it does not (no hits anywhere, or the same shared system prompt everywhere) the
choice is exactly the router's power of two choices (``routing.scheduling.choose``), the same draws from
``rng``: many routers acting on the same slightly old reports do not herd onto one replica.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, TypeVar

from llmgw_router.routing.scheduling import LoadView, load_score
from llmgw_router.routing.scheduling import choose as two_choices

# Prompt tokens of prefill that weigh as much as one request of load.
DEFAULT_TOKENS_PER_LOAD = 512.0


class Candidate(LoadView, Protocol):
    """What the choice reads of an endpoint: its load (``routing.scheduling.LoadView``) and its replica."""

    @property
    def replica_id(self) -> str: ...


C = TypeVar("C", bound=Candidate)


def bound(candidates: Sequence[Candidate], load_factor: float) -> int:
    """The most in-flight requests a candidate may hold with this one: ceil(load_factor x (in-flight + 1) / n)."""
    return math.ceil(load_factor * (sum(c.in_flight for c in candidates) + 1) / len(candidates))


def choose(
    candidates: Sequence[C],
    hits: Mapping[str, int],
    block_size: int,
    prompt_blocks: int,
    now: float,
    stale_s: float,
    rng: random.Random | Callable[[], float],
    load_factor: float,
    tokens_per_load: float = DEFAULT_TOKENS_PER_LOAD,
) -> C | None:
    """The replica for a request whose prompt has ``prompt_blocks`` full blocks of ``block_size`` tokens,
    ``hits`` being each replica's cached prefix in blocks (absent: none). None only without candidates."""
    if load_factor < 1.0:
        raise ValueError(f"load_factor must be >= 1, not {load_factor}")
    n = len(candidates)
    if n == 0:
        return None
    if n == 1:
        return candidates[0]
    cap = bound(candidates, load_factor)
    eligible = [c for c in candidates if c.in_flight + 1 <= cap]
    r = rng.random if isinstance(rng, random.Random) else rng
    if len(eligible) == 1:
        return eligible[0]
    own = [min(hits.get(c.replica_id, 0), prompt_blocks) for c in eligible]
    if min(own) == max(own):
        return two_choices(eligible, now, stale_s, r)
    per_block = block_size / tokens_per_load
    best: list[C] = []
    best_cost = math.inf
    for c, h in zip(eligible, own, strict=True):
        cost = load_score(c, now, stale_s) + (prompt_blocks - h) * per_block
        if cost < best_cost:
            best, best_cost = [c], cost
        elif cost == best_cost:
            best.append(c)
    return best[0] if len(best) == 1 else best[int(r() * len(best))]
