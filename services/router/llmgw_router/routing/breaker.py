"""A circuit breaker per endpoint: closed -> open after consecutive failures -> half-open probe.

Connection errors and 5xx answers count as failures. While open the endpoint gets no traffic; after a
cool-down one request at a time is let through as a probe, and its outcome closes or re-opens the
breaker (with a longer cool-down, capped). Time is a parameter: every method takes ``now``.
"""

from __future__ import annotations

from enum import StrEnum

from llmgw_common.backoff import backoff_delay


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


# Gauge values for the metrics: 0 closed, 1 half-open, 2 open.
STATE_VALUE = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


class Breaker:
    __slots__ = (
        "_failed_probes",
        "_open_until",
        "_probing",
        "base_cooldown_s",
        "failures",
        "max_cooldown_s",
        "state",
        "threshold",
    )

    def __init__(self, threshold: int = 3, cooldown_s: float = 2.0, max_cooldown_s: float = 30.0) -> None:
        self.threshold = threshold
        self.base_cooldown_s = cooldown_s
        self.max_cooldown_s = max_cooldown_s
        self.state = BreakerState.CLOSED
        self.failures = 0
        # Probes that failed since the breaker last closed: each doubles the next cool-down.
        self._failed_probes = 0
        # The moment the cool-down ends, kept as one sum: comparing ``now - opened_at >= cooldown`` can
        # come out 3.9999999999 for a 4 s cool-down and refuse a probe that is due.
        self._open_until = 0.0
        self._probing = False

    def allows(self, now: float) -> bool:
        """Whether a request may be sent now, without taking the probe slot (used when ranking)."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            return now >= self._open_until
        return not self._probing

    def acquire(self, now: float) -> bool:
        """Take permission to send one request; in half-open only one probe is in flight at a time."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            if now < self._open_until:
                return False
            self.state = BreakerState.HALF_OPEN
            self._probing = False
        if self._probing:
            return False
        self._probing = True
        return True

    def success(self) -> None:
        self.failures = 0
        if self.state is not BreakerState.CLOSED:
            self.state = BreakerState.CLOSED
            self._failed_probes = 0
            self._probing = False

    def failure(self, now: float) -> None:
        self.failures += 1
        if self.state is BreakerState.HALF_OPEN:
            # The probe failed: back off longer before the next one.
            self._failed_probes += 1
            self._open(now)
        elif self.state is BreakerState.CLOSED and self.failures >= self.threshold:
            self._open(now)

    def abandon(self) -> None:
        """A probe that ended without a verdict (the client went away): free the probe slot."""
        self._probing = False

    def _open(self, now: float) -> None:
        self.state = BreakerState.OPEN
        cooldown = backoff_delay(self._failed_probes + 1, self.base_cooldown_s, self.max_cooldown_s)
        self._open_until = now + cooldown
        self._probing = False
