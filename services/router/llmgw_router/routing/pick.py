"""The endpoint choice: which endpoint of a model takes the next attempt, given those tried already.

Pure over the pool's live state and the clock passed in (the breaker's ``acquire`` is the one write:
a half-open breaker lets one probe through). The one place an endpoint is chosen, for a first attempt,
a retry and a stream's continuation alike; the KV cache's scoring joins the choice here. A LoRA adapter
(issue 33) is chosen for among its base's endpoints that hold it loaded, by the same choice.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from llmgw_router.routing.endpoints import EndpointState, Pool
from llmgw_router.routing.scheduling import choose, choose_affine

P = TypeVar("P", contravariant=True)


class CacheChoice(Protocol[P]):
    """Routing by cached prefix (``llmgw_router.cache.router.PrefixRouting``), as the choice sees it: the
    candidate holding most of the request's prompt within the load bound, and where it went."""

    def choose(
        self,
        model: str,
        candidates: Sequence[EndpointState],
        prefix: P,
        now: float,
        rng: random.Random | Callable[[], float],
    ) -> EndpointState | None: ...

    def sent(self, model: str, replica: str, prefix: P, now: float) -> None: ...


@dataclass(frozen=True, slots=True)
class Choosing:
    """How endpoints are chosen, set once per router (the cache once the bus is reached)."""

    # A load report older than this is not believed (scheduling.load_score).
    load_stale_s: float
    # Prefix affinity's bound: an endpoint over this times the mean load is passed over.
    prefix_load_factor: float
    rng: random.Random
    cache: CacheChoice[Any] | None = None


def pick(
    pool: Pool,
    how: Choosing,
    model: str,
    tried: list[EndpointState],
    now: float,
    affinity: int | None = None,
    pin: EndpointState | None = None,
    prefix: Any = None,
    adapter: str | None = None,
) -> EndpointState | None:
    """The endpoint for the next attempt, its breaker acquired; None when none may be tried. ``model``
    names the endpoints (an adapter's base); ``adapter``: only those whose report lists it loaded (an
    engine without it answers 404), within the same bound and load choice as any request."""
    if pin is not None:
        # Only this replica holds what the request names: it is asked even while draining (it finishes
        # what it holds), and retried only on itself (a stale keep-alive connection).
        return pin if len(tried) < 2 and pin.breaker.acquire(now) else None
    eps = pool.by_model.get(model)
    if eps and adapter is not None:
        eps = [e for e in eps if adapter in e.adapters]
    if not eps:
        return None
    cands = [e for e in eps if not e.draining and e not in tried and e.breaker.allows(now)]
    if not cands and tried:
        # Every endpoint was tried: a second go at one whose breaker still allows it (a stale
        # keep-alive connection is the common cause of a one-off failure).
        cands = [e for e in eps if not e.draining and e.breaker.allows(now)]
    cache = how.cache if prefix is not None else None
    if cache is not None:
        # The replica holding most of the prompt in its KV cache, weighed against load, within a bound.
        ep = cache.choose(model, cands, prefix, now, how.rng)
    elif affinity is None:
        ep = choose(cands, now, how.load_stale_s, how.rng)
    else:
        ep = choose_affine(cands, affinity, how.prefix_load_factor)
    if ep is None or not ep.breaker.acquire(now):
        return None
    if cache is not None:
        cache.sent(model, ep.replica_id, prefix, now)
    return ep
