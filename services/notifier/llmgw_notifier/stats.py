"""The notifier's counters: one :class:`NotifierStats` per notifier, written by the delivery workers
and the probes, read by tests, log lines and the Prometheus collector (``metrics.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import Histogram

# Seconds from an event's arrival at the notifier to its receiver's 2xx, retries included.
LAG_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)


def delivery_lag_histogram() -> Histogram:
    """The delivery-lag histogram a :class:`NotifierStats` keeps, in no registry: the notifier's
    metrics (``metrics.py``) collect it."""
    return Histogram(
        "llmgw_notifier_delivery_lag_seconds",
        "Seconds from an event's arrival at the notifier until a receiver took it.",
        buckets=LAG_BUCKETS,
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
