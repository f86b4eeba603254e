"""The one doubling backoff: crash-looping replicas, webhook retries, restarted dev-cluster children."""

from __future__ import annotations


def backoff_delay(failures: int, base_s: float, max_s: float) -> float:
    """``min(base * 2**(failures-1), max)``: the first failure waits ``base``; none waits nothing."""
    if failures <= 0:
        return 0.0
    return min(base_s * 2.0 ** min(failures - 1, 62), max_s)


def jittered_delay(failures: int, base_s: float, max_s: float, rand: float) -> float:
    """:func:`backoff_delay` spread into its upper half with ``rand`` in [0, 1): many processes that
    failed together (notifiers on one webhook, control planes on one key) do not retry in step, and
    none waits less than half the doubling."""
    return backoff_delay(failures, base_s, max_s) * (0.5 + 0.5 * rand)
