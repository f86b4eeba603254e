"""The one doubling backoff: crash-looping replicas, webhook retries, restarted dev-cluster children."""

from __future__ import annotations


def backoff_delay(failures: int, base_s: float, max_s: float) -> float:
    """``min(base * 2**(failures-1), max)``: the first failure waits ``base``; none waits nothing."""
    if failures <= 0:
        return 0.0
    return min(base_s * 2.0 ** min(failures - 1, 62), max_s)
