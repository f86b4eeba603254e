"""The notifier's counters: one :class:`NotifierStats` per notifier, written by the delivery workers
and the probes, read by tests, log lines and the Prometheus collector (``metrics.py``)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from prometheus_client import Histogram

# Seconds from an event's arrival at the notifier to its receiver's 2xx, retries included.
LAG_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
# Seconds a probe took (one over its budget is cut there): budgets are a second to a minute.
PROBE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0)
# What became of a probe (llmgw_notifier_probes_total's outcome).
PROBE_OUTCOMES = ("ok", "over_budget", "failed", "refused")


def delivery_lag_histogram() -> Histogram:
    """The delivery-lag histogram a :class:`NotifierStats` keeps, in no registry: the notifier's
    metrics (``metrics.py``) collect it."""
    return Histogram(
        "llmgw_notifier_delivery_lag_seconds",
        "Seconds from an event's arrival at the notifier until a receiver took it.",
        buckets=LAG_BUCKETS,
        registry=None,
    )


def probe_seconds_histogram() -> Histogram:
    """The probe-time histogram per watched model, in no registry (``metrics.py`` collects it)."""
    return Histogram(
        "llmgw_notifier_probe_seconds",
        "Seconds a probe of a watched model took through the router, until its answer or its budget.",
        labelnames=["model"],
        buckets=PROBE_BUCKETS,
        registry=None,
    )


@dataclass
class NotifierStats:
    """Counters a test or a log line can read; one object per notifier."""

    delivered_events: int = 0
    delivered_messages: int = 0
    failed_attempts: int = 0
    gave_up_events: int = 0
    filtered_events: int = 0
    merged_events: int = 0  # model.* events acknowledged unsent: another source had said it
    undecodable_events: int = 0  # not an Event, or details that do not fit its kind (event_details)
    unrenderable_events: int = 0  # terminated unsent: no message could be made of them
    events_emitted: int = 0
    up: bool = False  # settings and catalog read, workers started
    per_target: dict[str, int] = field(default_factory=dict)
    delivery_lag: Histogram = field(default_factory=delivery_lag_histogram)
    # Per watched model: probes by outcome (PROBE_OUTCOMES), and their times. A model no longer
    # watched leaves both (Prober.apply).
    probe_outcomes: dict[str, dict[str, int]] = field(default_factory=dict)
    probe_seconds: Histogram = field(default_factory=probe_seconds_histogram)

    def probed(self, model: str, outcome: str, seconds: float | None) -> None:
        """One probe of ``model``; ``seconds`` None for one that says nothing of the model (refused)."""
        per = self.probe_outcomes.setdefault(model, dict.fromkeys(PROBE_OUTCOMES, 0))
        per[outcome] += 1
        if seconds is not None:
            self.probe_seconds.labels(model).observe(seconds)

    def forget_probes(self, model: str) -> None:
        if self.probe_outcomes.pop(model, None) is not None:
            with contextlib.suppress(KeyError):
                self.probe_seconds.remove(model)
