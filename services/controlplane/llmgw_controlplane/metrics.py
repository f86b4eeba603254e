"""The control plane's Prometheus metrics, served at ``/metrics`` on the admin listener.

Everything but the pass-time histogram is read from the running parts when Prometheus scrapes, so the
loop counts nothing twice: passes and failed passes from the loop and its :class:`PassGuard`, the lease
from :class:`Leadership`, replicas by phase from :func:`phase.replica_status` (the one judgement of a
replica's phase) and nodes by health from a snapshot at the scrape's time. The histogram is fed by the
loop after each pass (``ReconcileLoop.on_pass``).

Every phase and health is exported, 0 when none is in it, so an alert on "none ready" sees a 0 rather
than a missing series. Unplaceable and down models are exported only while leading: a standby does not
pass, and what it decided when it last led is not the cluster's state now.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmgw_controlplane.pass_requests import PassReason, PassRequests
from llmgw_controlplane.pass_verdicts import Verdicts
from llmgw_controlplane.scheduler.event_detection import EventDetector
from llmgw_controlplane.scheduler.phase import ReplicaPhase, replica_status
from llmgw_controlplane.scheduler.snapshot import NodeState, Snapshot
from llmgw_runtime.runtime import PassGuard

__all__ = ["ControlPlaneMetrics", "MetricsSource", "add_metrics_route"]

# Pass times seen: ~1 ms steady on a small cluster, tens of ms at thousands of nodes (bench/reconcile_scale.py).
PASS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class MetricsSource(Protocol):
    """What the metrics read of the control plane (``ControlPlane`` is one)."""

    @property
    def leader(self) -> bool: ...
    @property
    def fence(self) -> int: ...
    @property
    def passes(self) -> int: ...
    @property
    def guard(self) -> PassGuard: ...
    @property
    def verdicts(self) -> Verdicts: ...
    @property
    def pass_requests(self) -> PassRequests: ...
    @property
    def detector(self) -> EventDetector: ...
    def snapshot(self) -> Snapshot: ...


class _StateCollector(Collector):
    def __init__(self, source: MetricsSource) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        src = self.source
        yield CounterMetricFamily(
            "llmgw_controlplane_reconcile_passes",
            "Reconcile passes completed while leading.",
            value=src.passes,
        )
        yield CounterMetricFamily(
            "llmgw_controlplane_reconcile_failed_passes",
            "Reconcile passes that raised (a bug or bad input, not the bus).",
            value=src.guard.failed,
        )
        asked = CounterMetricFamily(
            "llmgw_controlplane_pass_requests",
            "Requests for a pass before the tick, by what changed (many may lead to one pass).",
            labels=["reason"],
        )
        for reason in PassReason:
            asked.add_metric([reason.value], src.pass_requests.counts[reason])
        yield asked
        yield GaugeMetricFamily(
            "llmgw_controlplane_leader",
            "1 while this control plane holds the lease, 0 on standby.",
            value=int(src.leader),
        )
        yield GaugeMetricFamily(
            "llmgw_controlplane_lease_fence",
            "The lease's fencing token (its revision) of this control plane's tenure.",
            value=src.fence,
        )
        if src.leader:
            yield GaugeMetricFamily(
                "llmgw_controlplane_unplaceable_models",
                "Models with a replica the last pass could not place.",
                value=len(src.verdicts.unplaceable),
            )
            yield GaugeMetricFamily(
                "llmgw_controlplane_models_down",
                "Watched models said down (model.down) and not recovered since.",
                value=len(src.detector.down),
            )
        snap = src.snapshot()
        phases = dict.fromkeys(ReplicaPhase, 0)
        for r in snap.replicas:
            phases[replica_status(snap, r).phase] += 1
        g = GaugeMetricFamily("llmgw_controlplane_replicas", "Replicas by phase.", labels=["phase"])
        for phase, n in phases.items():
            g.add_metric([phase.value], n)
        yield g
        health = dict.fromkeys(NodeState, 0)
        for node in snap.nodes.values():
            health[node.state] += 1
        g = GaugeMetricFamily("llmgw_controlplane_nodes", "Nodes by health.", labels=["health"])
        for state, n in health.items():
            g.add_metric([state.value], n)
        yield g


class ControlPlaneMetrics:
    """A registry of this control plane's own (not the process-wide default: tests run several in one)."""

    def __init__(self, source: MetricsSource) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.pass_seconds = Histogram(
            "llmgw_controlplane_reconcile_pass_seconds",
            "Time of one reconcile pass (snapshot, reconcile, apply, routing, events).",
            buckets=PASS_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_StateCollector(source))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def add_metrics_route(app: FastAPI, metrics: ControlPlaneMetrics) -> None:
    """``GET /metrics`` on ``app`` (the admin listener, with its loopback guard)."""

    async def scrape() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    app.add_api_route("/metrics", scrape, methods=["GET"], include_in_schema=False)
