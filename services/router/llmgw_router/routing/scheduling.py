"""Which endpoint takes the next request: a pure choice over plain data.

Load of an endpoint = max(this router's own in-flight count, running + waiting from the agent's last
report when that report is fresh) plus its KV-cache use as a tie-breaker. ``max`` rather than a sum
because the agent's count already includes this router's requests. A stale or missing report is
ignored (fail open to the in-flight count): an endpoint is never treated as saturated for lack of news.
Power of two choices: two random candidates, the lighter one wins, so many routers acting on the same
slightly old reports do not all herd onto the one endpoint that looked idlest.

Prefix affinity (optional, ``prefix_affinity``): requests sharing a prompt prefix (affinity.py's key) go
to the same replica, whose KV cache holds that prefix, within a load bound (:func:`choose_affine`).
"""

from __future__ import annotations

import hashlib
import math
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


# ------------------------------------------------------------ prefix affinity

_MASK64 = (1 << 64) - 1


def stable_id(text: str) -> int:
    """A 64-bit hash that is the same in every router process (``str.__hash__`` is salted per process),
    so routers side by side send a prefix to the same replica."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _weight(key: int, replica: int) -> int:
    # splitmix64's finaliser over key ^ replica: the rendezvous weight of the pair, cheap and well spread.
    x = key ^ replica
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class AffineView(Protocol):
    @property
    def in_flight(self) -> int: ...
    @property
    def affinity_id(self) -> int: ...


A = TypeVar("A", bound=AffineView)


def choose_affine(candidates: Sequence[A], key: int, load_factor: float) -> A | None:
    """Bounded-load rendezvous hashing: the candidates ordered by their weight for ``key`` (the same
    order in every router, and a candidate leaving moves only its own keys), the first one whose
    in-flight count, with this request, stays within ``ceil(load_factor x (in-flight + 1) / n)``.

    One always does: the least loaded holds at most floor(in-flight / n), so with this request at most
    ceil((in-flight + 1) / n). A hot prefix therefore fills its replica up to the bound, then spills
    to its next replica in the key's order, and so on (Mirrokni, Thorup, Zadimoghaddam 2018).
    """
    n = len(candidates)
    if n == 0:
        return None
    if n == 1:
        return candidates[0]
    cap = math.ceil(load_factor * (sum(c.in_flight for c in candidates) + 1) / n)
    for c in sorted(candidates, key=lambda c: _weight(key, c.affinity_id), reverse=True):
        if c.in_flight + 1 <= cap:
            return c
    raise AssertionError("bounded-load choice found no candidate under the bound")  # see the docstring
