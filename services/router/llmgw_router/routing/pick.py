"""The endpoint choice: which endpoint of a model takes the next attempt, given those tried already.

Pure over the pool's live state and the clock passed in (the breaker's ``acquire`` is the one write:
a half-open breaker lets one probe through). The one place an endpoint is chosen, for a first attempt,
a retry and a stream's continuation alike; the KV cache's scoring joins the choice here.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from llmgw_router.routing.endpoints import EndpointState, Pool
from llmgw_router.routing.scheduling import choose, choose_affine


@dataclass(frozen=True, slots=True)
class Choosing:
    """How endpoints are chosen, set once per router."""

    # A load report older than this is not believed (scheduling.load_score).
    load_stale_s: float
    # Prefix affinity's bound: an endpoint over this times the mean load is passed over.
    prefix_load_factor: float
    rng: random.Random


def pick(
    pool: Pool,
    how: Choosing,
    model: str,
    tried: list[EndpointState],
    now: float,
    affinity: int | None = None,
    pin: EndpointState | None = None,
) -> EndpointState | None:
    """The endpoint for the next attempt, its breaker acquired; None when none may be tried."""
    if pin is not None:
        # Only this replica holds what the request names: it is asked even while draining (it finishes
        # what it holds), and retried only on itself (a stale keep-alive connection).
        return pin if len(tried) < 2 and pin.breaker.acquire(now) else None
    eps = pool.by_model.get(model)
    if not eps:
        return None
    cands = [e for e in eps if not e.draining and e not in tried and e.breaker.allows(now)]
    if not cands and tried:
        # Every endpoint was tried: a second go at one whose breaker still allows it (a stale
        # keep-alive connection is the common cause of a one-off failure).
        cands = [e for e in eps if not e.draining and e.breaker.allows(now)]
    if affinity is None:
        ep = choose(cands, now, how.load_stale_s, how.rng)
    else:
        ep = choose_affine(cands, affinity, how.prefix_load_factor)
    if ep is None or not ep.breaker.acquire(now):
        return None
    return ep
