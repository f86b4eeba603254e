"""Which endpoint takes the next request: a pure choice over plain data.

Load of an endpoint = max(this router's own in-flight count, running + waiting from the agent's last
report when that report is fresh) plus its KV-cache use as a tie-breaker. ``max`` rather than a sum
because the agent's count already includes this router's requests. A stale or missing report is
ignored (fail open to the in-flight count): an endpoint is never treated as saturated for lack of news.
Power of two choices: two random candidates, the lighter one wins, so many routers acting on the same
slightly old reports do not all herd onto the one endpoint that looked idlest.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar


class LoadView(Protocol):
    @property
    def in_flight(self) -> int: ...
    @property
    def running(self) -> float | None: ...
    @property
    def waiting(self) -> float | None: ...
    @property
    def kv_use(self) -> float | None: ...
    @property
    def load_at(self) -> float | None: ...


T = TypeVar("T", bound=LoadView)


def load_score(e: LoadView, now: float, stale_s: float) -> float:
    """The load used to compare endpoints; lower is better."""
    own = float(e.in_flight)
    at = e.load_at
    if at is None or now - at > stale_s:
        return own
    reported = (e.running or 0.0) + (e.waiting or 0.0)
    score = max(own, reported)
    if e.kv_use is not None:
        score += min(max(e.kv_use, 0.0), 1.0)
    return score


def choose(
    candidates: Sequence[T],
    now: float,
    stale_s: float,
    rng: random.Random | Callable[[], float],
) -> T | None:
    """Power of two choices over ``candidates`` (already filtered to those that may take traffic)."""
    n = len(candidates)
    if n == 0:
        return None
    if n == 1:
        return candidates[0]
    r = rng.random if isinstance(rng, random.Random) else rng
    i = int(r() * n)
    j = int(r() * (n - 1))
    if j >= i:
        j += 1
    a, b = candidates[i], candidates[j]
    sa, sb = load_score(a, now, stale_s), load_score(b, now, stale_s)
    if sb < sa:
        return b
    return a
